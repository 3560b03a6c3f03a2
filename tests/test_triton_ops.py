"""The fused Triton ops (worker/kernels/triton_ops.py) against their torch definitions (worker/kernels/torch_ops.py).

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before triton is imported); with
CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kvmesh.worker.kernels import torch_ops, triton_ops  # noqa: E402
from kvmesh.core.errors import InvalidRequestError  # noqa: E402
from kvmesh.worker.kernels.triton_ops import round_to, tl, triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = getattr(torch, "float8_e4m3fn", None)
if FP8 is not None and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    FP8 = None  # Triton's fp8e4nv needs sm89+; the interpreter emulates it anywhere


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _assert_matches(got, expected):
    """Within one unit in the last place of the output dtype: the kernels round where torch
    rounds, but their fp32 exp / sum order may differ from torch's by an fp32 ulp, which
    now and then flips a bf16/fp16 rounding."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, atol=ulp * 1e-2, rtol=ulp if got.dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 200])
def test_rms_norm(dtype, hidden):
    x = _randn(2, 3, hidden, dtype=dtype, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=1)
    x_in = x.clone()
    _assert_matches(triton_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    assert torch.equal(x, x_in)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_new_residual(dtype):
    x = _randn(5, 96, dtype=dtype, seed=2)
    residual = _randn(5, 96, dtype=dtype, seed=3, scale=4.0)
    weight = _randn(96, dtype=dtype, seed=4)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = torch_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: bit-exact in any dtype
    _assert_matches(out, expected_out)
    assert torch.equal(x, x_in) and torch.equal(residual, residual_in)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = _randn(7, 2 * 1100, dtype=dtype, seed=5, scale=2.0)  # I = 1100 spans two column blocks
    _assert_matches(triton_ops.silu_and_mul(x), torch_ops.silu_and_mul(x))


def test_silu_and_mul_strided_rows():
    wide = _randn(4, 3 * 48, seed=6)
    x = wide[:, :96]  # rows 144 elements apart
    assert not x.is_contiguous()
    _assert_matches(triton_ops.silu_and_mul(x), torch_ops.silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_separate_gate_and_up(dtype):
    gate, up = _randn(3, 80, dtype=dtype, seed=15, scale=2.0), _randn(3, 80, dtype=dtype, seed=16)
    _assert_matches(triton_ops.silu_mul(gate, up), torch_ops.silu_mul(gate, up))
    assert torch.equal(torch_ops.silu_mul(gate, up), torch_ops.silu_and_mul(torch.cat([gate, up], -1)))


def test_int4_packing_convention():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])
    packed = torch_ops.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]  # low nibble = even index
    assert torch.equal(torch_ops.unpack_int4(packed), q.to(torch.uint8))


def _random_w4(out_features, in_features, group_size, seed, zeros_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen)
    groups = (out_features, in_features // group_size)
    scales = torch.rand(groups, generator=gen) * 0.05 + 0.001
    zeros = torch.randint(0, 16, groups, generator=gen).to(zeros_dtype)
    return q, torch_ops.pack_int4(q), scales, zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("group_size", [32, 128])
def test_w4a16_matmul(dtype, num_rows, group_size):
    q, packed, scales, zeros = _random_w4(72, 256, group_size, seed=num_rows)
    x = _randn(num_rows, 256, dtype=dtype, seed=7)
    args = (packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group_size)
    got = triton_ops.w4a16_matmul(x, *args)
    expected = torch_ops.w4a16_matmul(x, *args)
    # Both sum 256 rounded products in fp32, in different orders.
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_w4a16_dequantizes_as_documented_and_accepts_integer_zeros():
    q, packed, scales, zeros = _random_w4(16, 64, 32, seed=9, zeros_dtype=torch.uint8)
    w = (q.float() - zeros.float().repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    torch.testing.assert_close(torch_ops.dequantize_w4(packed, scales, zeros, 32), w)
    eye = torch.eye(64, device=DEVICE)  # x = I: the kernel's output is W^T itself
    got = triton_ops.w4a16_matmul(eye, packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32)
    torch.testing.assert_close(got.cpu(), w.t(), atol=1e-6, rtol=1e-6)


def test_w4a16_reads_quant_packing_when_present():
    primitives = pytest.importorskip("kvmesh.quant.primitives")
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(10))
    q, scale, zero = primitives.quantize_int4_groupwise(w, 64)
    packed = primitives.pack_int4(q)
    x = _randn(3, 128, seed=11)
    expected = x.cpu() @ primitives.dequantize_int4_groupwise(q, scale, zero).t()
    got = triton_ops.w4a16_matmul(x, packed.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 64)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def _random_w8(out_features, in_features, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=gen) * 0.02 + 0.001).to(dtype)
    return q.to(DEVICE), scales.to(DEVICE)


# fp32: the kernel and torch sum the same exact products in different orders (fp32 rounding);
# fp16 / bf16: that order can flip the rounding of the unscaled product by one unit in the
# last place, which the scale then carries: one fp16 / bf16 ulp relative, plus an atol for
# outputs near zero.
W8_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2 ** -7), torch.float16: (2e-3, 2 ** -10)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 33])
def test_w8a16_matmul(dtype, num_rows):
    q, scales = _random_w8(72, 160, seed=num_rows, dtype=dtype)  # N, K not multiples of the 64 tiles
    x = _randn(num_rows, 160, dtype=dtype, seed=17)
    got = triton_ops.w8a16_matmul(x, q, scales)
    expected = torch_ops.w8a16_matmul(x, q, scales)
    atol, rtol = W8_TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def test_w8a16_is_the_int8_linear_and_its_dequantized_weight():
    linear_mod = pytest.importorskip("kvmesh.quant.linear")
    lin = torch.nn.Linear(96, 48, bias=False)
    torch.nn.init.normal_(lin.weight, generator=torch.Generator().manual_seed(18))
    int8 = linear_mod.Int8WeightOnlyLinear.from_linear(lin)
    x = _randn(4, 96, seed=19)
    got = triton_ops.w8a16_matmul(x, int8.weight_int8.to(DEVICE), int8.scales.to(DEVICE))
    torch.testing.assert_close(got.cpu(), x.cpu() @ int8.dequantized_weight().t(), atol=1e-4, rtol=1e-4)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    tl.store(out_ptr + offs, round_to(x, out_ptr.dtype.element_ty), mask=valid)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16] + ([FP8] if FP8 is not None else []))
def test_round_to_is_round_to_nearest_even_like_torch(target):
    limit = 448.0 if target == FP8 else 1e4
    x = torch.cat([
        _randn(2048, seed=12, scale=50.0).cpu(),
        torch.tensor([2 ** -8, 2 ** -10, 3 * 2 ** -10, 0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
                      -(1.0 + 2 ** -8), 1.0625, 1.1875, 0.0048828125, 255.0]),  # ties and subnormals
        torch.rand(256, generator=torch.Generator().manual_seed(13)) * 2 ** -6,
    ]).clamp(-limit, limit).to(DEVICE)
    out = torch.empty(x.shape, dtype=target, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 512),)](x, out, x.numel(), BLOCK=512)
    assert torch.equal(out.float(), x.to(target).float())


@triton.jit
def _round_half_even_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, triton_ops.round_half_even(tl.load(x_ptr + offs)))


def test_round_half_even_matches_torch_round_at_ties():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.49, 3.4999998, -0.49, 0.0,
                      1e-8, 100.5000076, -64.5, 7.0], device=DEVICE)
    out = torch.empty_like(x)
    _round_half_even_kernel[(1,)](x, out, BLOCK=16)
    assert torch.equal(out, torch.round(x))


def test_bad_inputs_raise_typed_errors():
    x = _randn(2, 8)
    with pytest.raises(InvalidRequestError):
        triton_ops.rms_norm(x, _randn(7), 1e-6)
    with pytest.raises(InvalidRequestError):
        triton_ops.fused_add_rms_norm(x, _randn(2, 4), _randn(8), 1e-6)
    with pytest.raises(InvalidRequestError):
        triton_ops.silu_and_mul(_randn(2, 7))
    _, packed, scales, zeros = _random_w4(16, 64, 32, seed=14)
    with pytest.raises(InvalidRequestError):
        triton_ops.w4a16_matmul(_randn(2, 32), packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32)
    with pytest.raises(InvalidRequestError):
        triton_ops.w4a16_matmul(_randn(2, 64), packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 64)
    with pytest.raises(InvalidRequestError):
        triton_ops.w4a16_matmul(_randn(2, 64, dtype=torch.float64), packed.to(DEVICE), scales.to(DEVICE),
                                zeros.to(DEVICE), 32)
    q, w8_scales = _random_w8(16, 64, seed=20, dtype=torch.float32)
    with pytest.raises(InvalidRequestError):
        triton_ops.w8a16_matmul(_randn(2, 32), q, w8_scales)  # K mismatch
    with pytest.raises(InvalidRequestError):
        triton_ops.w8a16_matmul(_randn(2, 64), q, w8_scales[:8])
    with pytest.raises(InvalidRequestError):
        triton_ops.w8a16_matmul(_randn(2, 64), q.float(), w8_scales)  # not int8
    with pytest.raises(InvalidRequestError):
        triton_ops.silu_mul(_randn(2, 8), _randn(2, 6))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter is only chosen without CUDA")
def test_interpreter_works_when_triton_was_imported_first():
    """transformers imports torch._dynamo, which imports triton before a test can set
    TRITON_INTERPRET; the kernels must still run (a fresh process, to import in that order)."""
    script = (
        "import os, sys, torch, triton\n"
        "assert 'triton' in sys.modules\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from kvmesh.worker.kernels import torch_ops, triton_ops\n"
        "x = torch.randn(3, 64); r = torch.randn(3, 64); w = torch.randn(64)\n"
        "out, res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6)\n"
        "ref, ref_res = torch_ops.fused_add_rms_norm(x, r, w, 1e-6)\n"
        "torch.testing.assert_close(out, ref); assert torch.equal(res, ref_res)\n"
        "print('ok')\n")
    proc = _fresh_python_without_interpreter(script)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.skipif(DEVICE == "cuda", reason="without CUDA only")
def test_import_never_sets_the_interpreter():
    """Importing the kernels changes no process setting: without CUDA and without
    TRITON_INTERPRET=1 the import fails with ImportError (the engine's "Triton unavailable")."""
    script = (
        "import os\n"
        "try:\n"
        "    import kvmesh.worker.kernels.triton_ops\n"
        "except ImportError as exc:\n"
        "    print('refused', 'TRITON_INTERPRET' in os.environ, 'CUDA' in str(exc))\n")
    proc = _fresh_python_without_interpreter(script)
    assert proc.stdout.strip() == "refused False True", proc.stderr[-2000:]


def _fresh_python_without_interpreter(script: str) -> subprocess.CompletedProcess:
    """`script` in a new interpreter whose environment lacks TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
