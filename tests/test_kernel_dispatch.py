"""worker/kernels/dispatch.py: the model's fused ops and the quantized linears take the
Triton kernels on CUDA and the torch definitions elsewhere; force_triton() sends them through
Triton on CPU (the interpreter), where they must give the torch path's results.

Tolerances: fp32 to fp32 rounding of a different summation order (1e-4 on O(1)
outputs); bf16 to two bf16 ulps (2**-6 relative: the layer rounds its matmul output and then
the bias add, the oracle rounds once) plus 2e-2 absolute near zero.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kvmesh.core.config import KvmeshConfig  # noqa: E402
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear  # noqa: E402
from kvmesh.worker.kernels import dispatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2 ** -6}}


def _linear(out_features, in_features, seed):
    lin = torch.nn.Linear(in_features, out_features, bias=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.1, generator=gen)  # outputs O(1), as a trained layer's
        lin.bias.normal_(0.0, 0.1, generator=gen)
    return lin


def test_dispatch_follows_the_device_and_the_switch():
    x = torch.zeros(2)
    assert not dispatch.use_triton(x)  # CPU: torch
    with dispatch.force_triton():
        assert dispatch.use_triton(x)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(dispatch.use_triton(x)))
        thread.start()
        thread.join()
        assert seen == [False]  # the switch is this thread's only
        with dispatch.force_triton(False):
            assert not dispatch.use_triton(x)
        assert dispatch.use_triton(x)
    assert not dispatch.use_triton(x)
    assert dispatch.w8a16_matmul(x[None], torch.zeros(1, 2, dtype=torch.int8), torch.ones(1)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda lin: Int8WeightOnlyLinear.from_linear(lin),
                                  lambda lin: Int4WeightOnlyLinear.from_linear(lin, 32),
                                  lambda lin: Int4WeightOnlyLinear.from_linear(lin, 32, input_scale=torch.rand(96) + 0.5)],
                         ids=["int8", "int4", "int4-awq"])
def test_quantized_linear_on_the_triton_path_equals_its_dequantized_oracle(dtype, make):
    layer = make(_linear(48, 96, seed=1)).to(dtype).to(DEVICE)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    with dispatch.force_triton():
        got = layer(x)
    # the oracle: the stored weight dequantized, applied to the (AWQ-scaled) input, plus the bias
    xs = x if layer.input_inv_scale is None else x * layer.input_inv_scale.to(dtype)
    expected = (xs.float() @ layer.dequantized_weight(dtype).float().t() + layer.bias.float()).to(dtype)
    assert got.dtype == dtype and got.shape == (3, 48)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def _greedy(tiny_model_dir, weight: str, triton: bool) -> dict[str, list[int]]:
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine

    engine = Engine.from_config(KvmeshConfig.from_dict({
        # cpu_native_max_tokens 0: every step through the decoder's layers (torch or Triton),
        # never the native CPU step that fp32 int8 / int4 models take by default.
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 128, "cpu_native_max_tokens": 0},
        "quant": {"weight": weight, "group_size": 32},
        "cache": {"num_blocks": 16, "block_size": 8},
        "parallel": {"device": DEVICE, "attention_backend": "torch"}}))
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(["The capital of France is", "1, 2, 3, 4,"]):
        engine.add_request(GenerateRequest(f"r{i}", prompt=prompt, sampling=sampling))
    out: dict[str, list[int]] = {}
    with dispatch.force_triton(triton):
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None, delta.error
                out.setdefault(delta.request_id, []).extend(delta.token_ids)
    return out


@pytest.mark.parametrize("weight", ["int8", "int4"])
def test_tiny_model_greedy_tokens_equal_on_the_triton_path(tiny_model_dir, weight):
    """The whole decoder through the Triton path in the interpreter (fused add+RMSNorm,
    RMSNorm, SiLU-mul, W8A16 / W4A16 matmuls) gives the torch path's greedy tokens."""
    calls = []
    real = dispatch._triton

    def counting():
        calls.append(1)
        return real()

    torch_tokens = _greedy(tiny_model_dir, weight, triton=False)
    dispatch._triton = counting
    try:
        triton_tokens = _greedy(tiny_model_dir, weight, triton=True)
    finally:
        dispatch._triton = real
    assert calls, "the Triton path was never taken"
    assert all(len(ids) == 5 for ids in triton_tokens.values())
    assert triton_tokens == torch_tokens



@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_kept_layers_on_the_triton_path_equal_their_dequantized_oracle(type_name):
    """GGUF layers (quant/gguf_layouts.py): Q4_1 / Q4_K's mins fold into the kernel's float zero
    points; Q8_0's group scales take the dequantizing path."""
    import numpy as np

    from kvmesh.load_tests.gguf_checkpoints import random_tensor
    from kvmesh.quant.gguf_layouts import quantized_linear

    data, _ = random_tensor(np.random.default_rng(3), 48, 256, type_name)
    layer = quantized_linear("blk.0.ffn_up.weight", type_name, data, 48).to(DEVICE)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with dispatch.force_triton():
        got = layer(x)
    expected = x.float() @ layer.dequantized_weight().t()
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
