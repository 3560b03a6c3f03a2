"""Weight quantization primitives: round-trip error bounds, exact int4 packing, bad input."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.config import ConfigError
from kvmesh.quant import primitives as P


def weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 17] = 1.5  # an outlier, so per-row scales differ a lot
    w[5] = 0.0  # an all-zero row must not divide by zero
    w[7] = w[7].abs() + 0.01  # an all-positive row: the asymmetric range must still hold 0
    return w


def test_int8_round_trip_within_half_a_step():
    w = weight()
    q, scale = P.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) <= 127
    w_hat = P.dequantize_int8_per_channel(q, scale)
    err = (w - w_hat).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)
    assert torch.all(w_hat[5] == 0)
    # each row's absmax is represented exactly (q = +-127)
    rows = torch.arange(w.shape[0])
    assert torch.allclose(w_hat[rows, w.abs().argmax(1)].abs(), w.abs().amax(1), rtol=1e-6)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group_size):
    w = weight()
    q, scale, zero = P.quantize_int4_groupwise(w, group_size)
    n, k = w.shape
    assert q.dtype == torch.uint8 and q.shape == (n, k)
    assert scale.shape == zero.shape == (n, k // group_size)
    assert int(q.max()) <= 15 and torch.all(zero == zero.round()) and float(zero.min()) >= 0 and float(zero.max()) <= 15
    w_hat = P.dequantize_int4_groupwise(q, scale, zero)
    step = scale.repeat_interleave(group_size, dim=1)
    assert torch.all((w - w_hat).abs() <= step / 2 + 1e-6)
    assert torch.all(w_hat[5] == 0)
    # a smaller group can only tighten the steps; int4 is much coarser than int8
    q8, s8 = P.quantize_int8_per_channel(w)
    assert (w - w_hat).abs().mean() > (w - P.dequantize_int8_per_channel(q8, s8)).abs().mean()


def test_int4_group_size_changes_error_in_the_right_direction():
    w = weight(k=512)
    errors = []
    for g in (32, 64, 128):
        q, s, z = P.quantize_int4_groupwise(w, g)
        errors.append(float((w - P.dequantize_int4_groupwise(q, s, z)).pow(2).mean()))
    assert errors[0] < errors[1] < errors[2]


def test_pack_unpack_is_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (33, 128), generator=g, dtype=torch.uint8)
    packed = P.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (33, 64)
    assert torch.equal(P.unpack_int4(packed), q)
    # documented nibble order: even column low, odd column high
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    # every byte value survives unpack -> pack
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    assert torch.equal(P.pack_int4(P.unpack_int4(all_bytes)), all_bytes)


def test_pack_slices_by_whole_groups():
    # a row-parallel shard of columns [64, 128) is bytes [32, 64) of the packed row
    q = torch.randint(0, 16, (4, 256), dtype=torch.uint8)
    assert torch.equal(P.pack_int4(q)[:, 32:64], P.pack_int4(q[:, 64:128]))


def test_tinygemm_scale_and_zero_matches_our_dequantization():
    w = weight(n=32, k=128)
    q, scale, zero = P.quantize_int4_groupwise(w, 32)
    sz = P.tinygemm_scale_and_zero(scale, zero, torch.float32)  # [K/G, N, 2]
    assert sz.shape == (4, 32, 2)
    s = sz[..., 0].t().repeat_interleave(32, 1)
    z = sz[..., 1].t().repeat_interleave(32, 1)
    torch_formula = (q.float() - 8) * s + z  # torch's int4pack kernels' dequantization
    assert torch.allclose(torch_formula, P.dequantize_int4_groupwise(q, scale, zero), atol=1e-6)


@pytest.mark.parametrize("call", [
    lambda: P.quantize_int4_groupwise(torch.randn(8, 96), 64),  # 64 does not divide 96
    lambda: P.quantize_int4_groupwise(torch.randn(8, 96), 0),
    lambda: P.quantize_int8_per_channel(torch.randn(8)),  # not [N, K]
    lambda: P.quantize_int8_per_channel(torch.ones(4, 4, dtype=torch.int32)),
    lambda: P.pack_int4(torch.zeros(2, 3, dtype=torch.uint8)),  # odd K
    lambda: P.pack_int4(torch.full((2, 4), 16, dtype=torch.uint8)),  # out of range
])
def test_bad_input_is_a_config_error(call):
    with pytest.raises(ConfigError):
        call()
