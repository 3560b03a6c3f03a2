"""quant.weight=int4_awq in the serving engine: calibrated at start through kvmesh's own model,
the search cached on disk under a fingerprint of everything it depends on."""

from __future__ import annotations

import logging

import pytest
import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.quant.awq import load_awq_results
from kvmesh.quant.calibration import HELDOUT_TEXT, load_text, projection_linears, token_sequences
from kvmesh.quant.linear import Int4WeightOnlyLinear
from kvmesh.worker.runner import awq_calibration
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.runner.model_runner import prefill_logits


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    return tmp_path / "awq"


@pytest.fixture
def searches(monkeypatch):
    """Counts real calibrations + searches (the cache must spare them)."""
    calls = []
    real = awq_calibration._calibrate_and_search
    monkeypatch.setattr(awq_calibration, "_calibrate_and_search", lambda *a: calls.append(1) or real(*a))
    return calls


def _config(model_dir, weight="int4_awq", **quant):
    return KvmeshConfig().replace(model={"path": model_dir, "dtype": "fp32"},
                                  quant={"weight": weight, "group_size": 32, **quant},
                                  cache={"num_blocks": 64, "swap_space_gib": 0.0})


def _greedy(engine, prompt: str, max_tokens: int = 12) -> list[int]:
    engine.add_request(GenerateRequest("g", prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0, ignore_eos=True)))
    tokens = []
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens.extend(delta.token_ids)
    return tokens


def _heldout_logit_error(engine, reference) -> float:
    """Relative error of the engine's teacher-forced logits on held-out text vs `reference`'s."""
    ids = token_sequences(engine.tokenizer, load_text(HELDOUT_TEXT), seq_len=128, max_sequences=1)[0]
    ours = prefill_logits(engine.runner.model, ids, engine.runner.kv_caches, engine.runner.backend)
    theirs = prefill_logits(reference.runner.model, ids, reference.runner.kv_caches, reference.runner.backend)
    return float((ours - theirs).norm() / theirs.norm())


def test_engine_calibrates_at_start_and_reuses_the_cache(tiny_model_dir, cache_dir, searches):
    engine = Engine.from_config(_config(tiny_model_dir))
    assert len(searches) == 1
    assert projection_linears(engine.runner.model) == []  # no float projection left ...
    quantized = [m for m in engine.runner.model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    assert len(quantized) == 2 * 7 and all(m.input_inv_scale is not None for m in quantized)
    assert any(not torch.all(m.input_inv_scale == 1) for m in quantized)  # ... and AWQ moved some scales
    files = list(cache_dir.glob("*.safetensors"))
    assert len(files) == 1 and len(load_awq_results(files[0])) == 2 * 7
    first = _greedy(engine, "The capital of France is")
    assert engine.stats().num_blocks_used == 0

    again = Engine.from_config(_config(tiny_model_dir))
    assert len(searches) == 1  # the cached search, not a new one
    assert _greedy(again, "The capital of France is") == first
    for a, b in zip(quantized, [m for m in again.runner.model.modules() if isinstance(m, Int4WeightOnlyLinear)]):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.input_inv_scale, b.input_inv_scale)


@pytest.fixture(scope="module")
def outlier_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a few large input channels into every projection, as trained LLMs
    have (the RMSNorm weights of 4 of 64 channels x 30): the case AWQ exists for."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-outliers")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    (weights,) = path.glob("*.safetensors")
    state = load_file(str(weights))
    for name, tensor in state.items():
        if name.endswith("layernorm.weight"):
            tensor[:4] *= 30.0
    save_file(state, str(weights), metadata={"format": "pt"})
    return str(path)


def test_awq_engine_tracks_the_float_model_better_than_rtn(outlier_model_dir, cache_dir):
    """On held-out text with outlier input channels, AWQ's logits are clearly closer to the
    unquantized engine's than plain round-to-nearest int4's (measured 0.30 vs 0.49)."""
    reference = Engine.from_config(_config(outlier_model_dir, weight="none"))
    rtn = _heldout_logit_error(Engine.from_config(_config(outlier_model_dir, weight="int4")), reference)
    awq = _heldout_logit_error(Engine.from_config(_config(outlier_model_dir)), reference)
    assert 0 < awq < 0.8 * rtn, (awq, rtn)


def test_a_different_calibration_text_is_a_different_search(tiny_model_dir, cache_dir, searches, tmp_path):
    Engine.from_config(_config(tiny_model_dir))
    text = tmp_path / "traffic.txt"
    text.write_text("Support ticket: my order has not arrived yet. " * 400, encoding="utf-8")
    Engine.from_config(_config(tiny_model_dir, calibration_path=str(text)))
    assert len(searches) == 2 and len(list(cache_dir.glob("*.safetensors"))) == 2


def test_an_unreadable_cache_file_is_recomputed(tiny_model_dir, cache_dir, searches, caplog):
    Engine.from_config(_config(tiny_model_dir))
    (path,) = cache_dir.glob("*.safetensors")
    path.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="kvmesh.worker.runner.awq_calibration"):
        Engine.from_config(_config(tiny_model_dir))
    assert len(searches) == 2 and "ignoring unreadable AWQ cache" in caplog.text
    assert len(load_awq_results(path)) == 2 * 7  # rewritten whole


def test_missing_calibration_text_fails_at_start(tiny_model_dir, cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="calibration text"):
        Engine.from_config(_config(tiny_model_dir, calibration_path=str(tmp_path / "nope.txt")))
