"""LoRA adapters in the engine: token-exact against HF + PEFT, slots, cache isolation.

Three PEFT adapters of different ranks and target modules are made on the tiny random Llama
(tests/conftest.py); the reference is HF greedy `generate` on the base model with each
adapter merged (PEFT's merge_and_unload, fp32). The engine serves all of them and base-model
requests in ONE continuous batch (the batched update: worker/kernels/lora_ops.py).
"""

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import AdapterRef, FinishReason, GenerateRequest, SamplingParams
from kvmesh.core.telemetry import EngineMetrics
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.kernels.lora_ops import LoraStep, add_lora_reference
from lora_adapters import hf_peft_greedy, make_adapter

NEW_TOKENS = 12
# name -> (rank, target modules, alpha, rslora): different ranks and projections on purpose
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], 16, False),
    "mlp16": (16, ["o_proj", "gate_proj", "down_proj"], 32, True),
    "all64": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 32, False),
}
PROMPTS = [[(7 * i + 13 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate((40, 9, 23, 17))]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        dirs[name] = str(root / name)
        make_adapter(tiny_model_dir, dirs[name], *spec, seed=seed)
    return dirs


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir, adapter_dirs):
    want = {None: hf_peft_greedy(tiny_model_dir, None, PROMPTS, NEW_TOKENS)}
    for name, path in adapter_dirs.items():
        want[name] = hf_peft_greedy(tiny_model_dir, path, PROMPTS, NEW_TOKENS)
    return want


def _engine(tiny_model_dir, max_loras=4, **sched) -> Engine:
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32"},
        "cache": {"num_blocks": 128, "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 24, "max_queue_time_s": 3600,
                      **sched},
        "lora": {"max_loras": max_loras},
    }))


def _run(engine: Engine, on_step=None) -> dict[str, list]:
    """Drive the engine to the end: request id -> (token ids, final delta)."""
    tokens: dict[str, list[int]] = {}
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta
        engine.check_integrity()
        if on_step is not None:
            on_step(engine)
    return {rid: (tokens.get(rid, []), finals[rid]) for rid in finals}


def _greedy(max_tokens=NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_mixed_batch_of_three_adapters_and_base_equals_hf_peft_merged(tiny_model_dir, adapter_dirs, hf_reference):
    for name in ADAPTERS:  # every adapter really changes the output, or the comparison proves nothing
        assert hf_reference[name] != hf_reference[None], name
    engine = _engine(tiny_model_dir)
    for name in (None, *ADAPTERS):
        ref = None if name is None else AdapterRef(name, adapter_dirs[name])
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(GenerateRequest(f"{name}-{i}", prompt_token_ids=tuple(prompt), sampling=_greedy(),
                                               adapter=ref))
    metrics = EngineMetrics("w0")
    engine.phase_clock.observers.append(metrics.observe_step_report)
    mixes: list[set] = []
    results = _run(engine, lambda e: mixes.append({r.adapter and r.adapter.name for r in e.scheduler.running}))
    assert {None, *ADAPTERS} in mixes, "base rows and all three adapters must share a step"
    assert engine.runner.eager_step_reasons["lora_rows"] > 0
    # every adapter row the model ran (prompt + all but the last output token), per step in the metric
    lora_rows = {s.name: s.value for f in text_string_to_metric_families(metrics.snapshot().decode())
                 for s in f.samples if s.name.startswith("kvmesh_lora_rows")}
    assert lora_rows["kvmesh_lora_rows_sum"] == len(ADAPTERS) * sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    assert 0 < lora_rows["kvmesh_lora_rows_count"] <= len(mixes)
    for name in (None, *ADAPTERS):
        for i in range(len(PROMPTS)):
            got, final = results[f"{name}-{i}"]
            assert final.finish_reason == FinishReason.LENGTH
            assert got == hf_reference[name][i], f"adapter {name} prompt {i}"
    assert engine.stats().num_blocks_used == 0
    stats = engine.runner.lora_slots.stats()
    assert (stats.num_loads, stats.num_evictions, stats.num_slots_used) == (3, 0, 3)
    usage = engine.adapters.usage()
    assert usage["qv8"].num_requests == len(PROMPTS)
    assert usage["qv8"].num_output_tokens == len(PROMPTS) * NEW_TOKENS


def test_two_slots_evict_lru_and_keep_outputs_exact(tiny_model_dir, adapter_dirs, hf_reference):
    """Three adapters through two slots: the third waits for a slot whose requests ended, the
    least recently used unpinned adapter is evicted, and outputs stay exact."""
    engine = _engine(tiny_model_dir, max_loras=2)
    names = list(ADAPTERS)
    for name in names:
        engine.add_request(GenerateRequest(name, prompt_token_ids=tuple(PROMPTS[0]), sampling=_greedy(),
                                           adapter=AdapterRef(name, adapter_dirs[name])))
    peak = []
    results = _run(engine, lambda e: peak.append(len({r.adapter for r in e.scheduler.running})))
    assert max(peak) <= 2, "never more adapters in a batch than slots"
    for name in names:
        assert results[name][0] == hf_reference[name][0], name
    stats = engine.runner.lora_slots.stats()
    assert (stats.num_loads, stats.num_evictions) == (3, 1)
    # the evicted adapter comes back on demand (a fourth load) and is still exact
    evicted = next(n for n in names if n not in stats.resident)
    engine.add_request(GenerateRequest("again", prompt_token_ids=tuple(PROMPTS[1]), sampling=_greedy(),
                                       adapter=AdapterRef(evicted, adapter_dirs[evicted])))
    assert _run(engine)["again"][0] == hf_reference[evicted][1]
    assert engine.runner.lora_slots.stats().num_loads == 4


def test_adapters_never_share_kv_with_base_or_each_other(tiny_model_dir, adapter_dirs):
    engine = _engine(tiny_model_dir)
    prompt = tuple(PROMPTS[0])  # 40 tokens: 4 full shareable blocks of 8
    qv8 = AdapterRef("qv8", adapter_dirs["qv8"])
    order = [("base", None), ("qv8", qv8), ("mlp16", AdapterRef("mlp16", adapter_dirs["mlp16"])), ("qv8-again", qv8)]
    cached = {}
    for rid, ref in order:  # one at a time, so each finds what the earlier ones left in the cache
        engine.add_request(GenerateRequest(rid, prompt_token_ids=prompt, sampling=_greedy(2), adapter=ref))
        cached[rid] = _run(engine)[rid][1].usage.cached_tokens
    assert cached == {"base": 0, "qv8": 0, "mlp16": 0, "qv8-again": 32}
    assert engine.block_extra_keys(None, qv8) != engine.block_extra_keys(None)


def test_unknown_adapter_path_fails_the_request_cleanly(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir)
    engine.add_request(GenerateRequest("gone", prompt_token_ids=(5, 6, 7), sampling=_greedy(),
                                       adapter=AdapterRef("gone", str(tmp_path / "missing"))))
    engine.add_request(GenerateRequest("base", prompt_token_ids=(5, 6, 7), sampling=_greedy(2)))
    results = _run(engine)
    assert results["gone"][1].finish_reason == FinishReason.ERROR
    assert results["gone"][1].error_type == "AdapterNotFoundError"
    assert results["base"][1].finish_reason == FinishReason.LENGTH
    assert engine.stats().num_blocks_used == 0


def test_abort_while_waiting_for_the_adapter(tiny_model_dir, adapter_dirs):
    engine = _engine(tiny_model_dir)
    engine.add_request(GenerateRequest("w", prompt_token_ids=(5, 6, 7), sampling=_greedy(),
                                       adapter=AdapterRef("qv8", adapter_dirs["qv8"])))
    assert engine.has_unfinished()
    [final] = engine.abort("w")
    assert final.finish_reason == FinishReason.ABORT and not engine.has_unfinished()
    engine.runner.lora_slots.wait_loads(10)
    engine.step()  # the finished read is installed, nobody waits on it: unpinned, evictable
    stats = engine.runner.lora_slots.stats()
    assert stats.num_slots_used == 1 and engine.runner.lora_slots._pins == [0, 0, 0, 0]


def test_bad_adapter_is_refused_with_the_reason(tiny_model_dir, tmp_path):
    from kvmesh.core.errors import InvalidRequestError
    from kvmesh.worker.model.lora_weights import load_peft_adapter
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_model_dir)
    path = tmp_path / "dora"
    make_adapter(tiny_model_dir, str(path), 8, ["q_proj"], 16, False, seed=1)
    with pytest.raises(InvalidRequestError, match="rank 8 is outside"):
        load_peft_adapter("x", str(path), hf, torch.float32, max_rank=4)
    cfg = path / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"use_dora": false', '"use_dora": true'))
    with pytest.raises(InvalidRequestError, match="use_dora"):
        load_peft_adapter("x", str(path), hf, torch.float32, max_rank=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_lora_matches_the_per_row_reference(dtype):
    """The engine's segmented update over slots installed by AdapterSlots (ranks 8, 16, 4 and
    one adapter not targeting the group; one adapter also on up_proj, sharing the group's
    shrink) against the per-row definition, rows in any order (interleaved: many segments)
    and sorted by slot as the runner orders them (one segment per slot)."""
    from types import SimpleNamespace

    from kvmesh.worker.kernels.lora_ops import segments_of
    from kvmesh.worker.model.lora_weights import LoraWeights
    from kvmesh.worker.runner.lora_slots import AdapterSlots

    gen = torch.Generator().manual_seed(0)
    hf = SimpleNamespace(hidden_size=24, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1)
    d_in, d_out = 24, 40  # gate_proj / up_proj: [inter, hidden]
    ranks = {"r8": 8, "r16": 16, "none": 0, "r4": 4}

    def pair(r, rows, cols):
        return torch.randn(r, cols, generator=gen).to(dtype), torch.randn(rows, r, generator=gen).to(dtype)

    def read(ref):
        r = ranks[ref.name]
        modules = {} if r == 0 else {(0, "gate_proj"): pair(r, d_out, d_in)}
        if ref.name == "r8":
            modules[(0, "up_proj")] = pair(8, d_out, d_in)
        modules[(0, "q_proj")] = pair(2, 24, 24)
        return LoraWeights(ref.name, ref.path, max(r, 2), modules)

    slots = AdapterSlots(hf, 4, 16, dtype, torch.device("cpu"), reader=read)
    refs = [AdapterRef(name, "/x") for name in ranks]
    for ref in refs:
        slots.start_load(ref)
        slots.wait_loads(10)
        slots.poll()
    slot = {ref.name: slots.slot_of(ref) for ref in refs}
    assert slots.allocated_bytes <= AdapterSlots.max_bytes(hf, 4, 16, dtype)
    # base rows, one request's prefill chunk, interleaved decode rows of several adapters
    names = [None, "r16", "r16", "r16", "r8", None, "r4", "r8", "none", "r16", None, "r4"]
    x = torch.randn(len(names), d_in, generator=gen).to(dtype)
    base = torch.randn(len(names), 2 * d_out, generator=gen).to(dtype)
    for order in (list(range(len(names))), sorted(range(len(names)), key=lambda i: slot.get(names[i], -1))):
        row_slots = [None if names[i] is None else slot[names[i]] for i in order]
        xs, bases = x[order], base[order]
        x_before, base_before = xs.clone(), bases.clone()
        want = torch.cat([add_lora_reference(half, xs, [slots.module_weights(0, module, s) for s in range(4)],
                                             row_slots) for half, module in zip(bases.chunk(2, dim=-1),
                                                                                 ("gate_proj", "up_proj"))], dim=-1)
        assert torch.equal(xs, x_before) and torch.equal(bases, base_before), "the reference modifies nothing"
        got = bases.clone()
        segments = segments_of(row_slots)
        LoraStep(slots.groups, segments).add(0, "gate_up", xs, got.chunk(2, dim=-1))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
        for i, s in enumerate(row_slots):  # base rows and rows whose adapter skips the group: untouched, bit for bit
            if s is None or s == slot["none"]:
                assert torch.equal(got[i], bases[i])
            if s != slot["r8"]:  # only r8 targets up_proj
                assert torch.equal(got[i, d_out:], bases[i, d_out:])
        assert not torch.equal(got, bases)
    assert len(segments) == 4, "rows sorted by slot: one segment per adapter that has rows"
