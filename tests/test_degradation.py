"""The degradation ladder's config: which rule covers a class, the fallback pool's workers."""

from __future__ import annotations

import pytest

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.router.degradation import fallback_pool_config, rule_for


def _config(**degradation) -> KvmeshConfig:
    return KvmeshConfig.from_dict({"quant": {"weight": "none"}, "scheduler": {"max_num_seqs": 8},
                                   "parallel": {"num_workers": 2}, "degradation": degradation})


def test_a_rule_covers_its_class_and_the_less_important_ones_up_to_the_next_rule():
    config = _config(rules=[{"min_priority_class": 1, "cap_max_tokens": 64},
                            {"min_priority_class": 3, "queue_wait_s": 0.5}])
    assert rule_for(config, 0) is None  # more important than every rule: no ladder
    assert rule_for(config, 1).cap_max_tokens == 64
    assert rule_for(config, 2).cap_max_tokens == 64
    assert rule_for(config, 3).queue_wait_s == 0.5 and rule_for(config, 9).cap_max_tokens is None
    assert rule_for(_config(), 5) is None


def test_the_fallback_pool_runs_its_own_weights_and_size_and_nothing_else_changes():
    config = _config(fallback_pool={"num_workers": 1, "quant_weight": "int4", "max_num_seqs": 2})
    fallback = fallback_pool_config(config)
    assert (fallback.quant.weight, fallback.scheduler.max_num_seqs, fallback.parallel.num_workers) == ("int4", 2, 1)
    assert fallback.cache == config.cache and fallback.model == config.model
    assert fallback_pool_config(_config()) is None


@pytest.mark.parametrize("bad", [
    {"rules": [{"fallback": True}]},  # a fallback step with no pool
    {"rules": [{"min_priority_class": 1}, {"min_priority_class": 1}]},
    {"rules": [{"cap_max_tokens": 0}]},
    {"rules": [{"queue_wait_s": -1}]},
    {"fallback_pool": {"num_workers": 1, "quant_weight": "int3"}},
])
def test_bad_ladders_fail_on_load(bad):
    with pytest.raises(ConfigError):
        _config(**bad)
