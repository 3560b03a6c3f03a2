"""oneDNN-prepacked bf16 weights (worker/kernels/packed_weights.py): bit-identical to F.linear,
never applied to a weight they were not built from, and the engine's bf16 output unchanged."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.kernels import packed_weights
from kvmesh.worker.kernels.packed_weights import PackedWeight

needs_packing = pytest.mark.skipif(not packed_weights.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)),
                                   reason="no oneDNN bf16 on this CPU / torch build")


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_is_bit_identical(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    packed = PackedWeight.pack(w)
    assert packed is not None
    assert torch.equal(packed.linear(x, b), F.linear(x, w, b))
    assert torch.equal(packed_weights.linear(x, w, None, packed), F.linear(x, w))


@needs_packing
def test_packed_weight_is_only_used_for_its_own_weight():
    torch.manual_seed(0)
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    packed = PackedWeight.pack(w)
    other = torch.randn(32, 16, dtype=torch.bfloat16)  # e.g. the parameter replaced after packing
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(packed_weights.linear(x, other, None, packed), F.linear(x, other))
    x32, w32 = x.float(), w.float()  # fp32 never takes the packed path
    assert torch.equal(packed_weights.linear(x32, w32, None, packed), F.linear(x32, w32))
    assert PackedWeight.pack(w32) is None


def _greedy(model_dir, prepack):
    engine = Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "bf16", "cpu_prepack_weights": prepack},
        "cache": {"num_blocks": 64, "block_size": 16},
        "parallel": {"device": "cpu"}}))
    prompts = [(1, 5, 9, 200, 31), tuple(range(40, 77)), (7,)]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)))
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).append((delta.token_ids, delta.logprobs))
    return engine, out


@needs_packing
def test_engine_output_is_the_same_with_and_without_prepacking(tiny_model_dir):
    packed_engine, packed = _greedy(tiny_model_dir, True)
    model = packed_engine.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(f is not None and f.packed is not None for f in (attn.qkv, attn.o, mlp.gate_up, mlp.down))
    assert model.lm_head.packed is not None
    plain_engine, plain = _greedy(tiny_model_dir, False)
    assert plain_engine.runner.model.lm_head.packed is None
    assert packed == plain


def test_no_onednn_packing_falls_back_to_f_linear(monkeypatch):
    """A torch without oneDNN (or whose reorder refuses the weight) packs nothing, and the fused
    projection then runs plain F.linear: same output, no error."""
    from torch import nn

    from kvmesh.worker.model.llama import FusedLinears

    torch.manual_seed(0)
    lins = [nn.Linear(16, n, bias=False).to(torch.bfloat16) for n in (8, 4)]
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    want = torch.cat([F.linear(x, lin.weight) for lin in lins], dim=-1)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    fused = FusedLinears(lins, prepack=True)
    assert fused.packed is None and torch.equal(fused(x), want)
    monkeypatch.undo()

    def refuse(*args):
        raise RuntimeError("no reorder for this weight")

    monkeypatch.setattr(packed_weights, "can_pack", lambda w: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert PackedWeight.pack(lins[0].weight) is None
