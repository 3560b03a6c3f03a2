"""kv/output_estimate.py: the per-tenant output-length estimate, by hand; its config."""

import pytest

from kvmesh.core.config import ConfigError, SchedulerConfig
from kvmesh.kv.output_estimate import MIN_SAMPLES, WINDOW, OutputLengthEstimator


def test_max_tokens_until_enough_finished_requests_then_the_quantile_with_a_floor():
    est = OutputLengthEstimator(floor_tokens=16, quantile=0.9)
    for n in range(1, MIN_SAMPLES):  # 7 samples: not enough yet
        est.observe("a", n * 10)
    assert est.estimate("a", 500) == 500
    est.observe("a", 80)
    # Outputs 10..70 and 80 (8 samples): nearest rank ceil(0.9 x 8) = 8 -> 80.
    assert est.estimate("a", 500) == 80
    assert est.estimate("a", 50) == 50  # never above what the request asks for
    assert est.estimate("b", 500) == 500  # another tenant has taught nothing
    for _ in range(MIN_SAMPLES):
        est.observe("short", 3)
    assert est.estimate("short", 500) == 16  # the floor


def test_the_window_forgets_old_requests():
    est = OutputLengthEstimator(floor_tokens=1, quantile=0.5)
    for _ in range(WINDOW):
        est.observe("a", 400)
    assert est.estimate("a", 1000) == 400
    for _ in range(WINDOW):
        est.observe("a", 20)  # the traffic changed shape
    assert est.estimate("a", 1000) == 20


def test_config_names_the_bad_field():
    for bad, field in (({"admission_reserve": "guess"}, "admission_reserve"),
                       ({"expected_output_floor_tokens": 0}, "expected_output_floor_tokens"),
                       ({"expected_output_quantile": 0.0}, "expected_output_quantile"),
                       ({"max_priority_preemptions": 0}, "max_priority_preemptions")):
        with pytest.raises(ConfigError, match=field):
            SchedulerConfig(**bad).validate()
