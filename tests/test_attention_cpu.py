"""The CPU attention fast path (worker/attention/cpu_backend.py) against the torch reference backend.

Batches mix decodes of very different context lengths (several decode groups), prefill
chunks over cached context and from scratch, GQA, block sizes 8 and 16, permuted block ids,
plain and int8 KV. Blocks no request owns hold NaN in the poisoned variant: the fast path
reads only the requests' own blocks, so its output stays finite and unchanged. Engine-level token
identity with HF (chunked prefill + preemption) is in tests/test_engine_exact.py.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.quant import kv_quant
from kvmesh.worker.kernels import cpu_build, cpu_paged_attention
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache
from kvmesh.worker.attention.cpu_backend import CpuAttentionBackend, group_decode_rows
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

# (context tokens already cached, new tokens this step)
MIXED_BATCH = [(0, 7), (13, 1), (20, 9), (31, 1), (0, 1), (16, 1), (5, 17), (90, 1), (91, 1), (47, 1), (2, 1)]


def _make_batch(requests, num_kv_heads, queries_per_kv, head_dim, block_size, kv, poison):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [ctx + q for ctx, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.randint(0, num_blocks, (len(requests), max(blocks_per_req) + 2), generator=gen,
                                 dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = perm[cursor:cursor + n]
        cursor += n
    storage = torch.float32 if kv == "auto" else kv_quant.kv_storage_dtype(kv)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if poison else 0.0
    cache = LayerKVCache(torch.full(shape, fill if kv == "auto" else 0, dtype=storage),
                         torch.full(shape, fill if kv == "auto" else 0, dtype=storage))
    if kv != "auto":
        cache.key_scale = torch.full(shape[:3], fill, dtype=kv_quant.KV_SCALE_DTYPE)
        cache.value_scale = torch.full(shape[:3], fill, dtype=kv_quant.KV_SCALE_DTYPE)
    for i, n in enumerate(blocks_per_req):  # owned blocks: written or zero, never poison
        owned = block_tables[i, :n].long()
        for t in (cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale):
            if t is not None:
                t[owned] = 0
    new_slots = []
    for i, (ctx, q) in enumerate(requests):
        pos = torch.arange(ctx + q)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        new_slots.append(slots[ctx:])
        for which in ("key", "value"):
            x = torch.randn(ctx + q, num_kv_heads, head_dim, generator=gen)
            flat = getattr(cache, f"{which}_cache").view(-1, num_kv_heads, head_dim)
            if kv == "auto":
                flat[slots] = x
            else:
                stored, scale = kv_quant.quantize_kv(x, kv)
                flat[slots] = stored
                getattr(cache, f"{which}_scale").view(-1, num_kv_heads)[slots] = scale
    query_lens = [q for _, q in requests]
    query = torch.randn(sum(query_lens), num_kv_heads * queries_per_kv, head_dim, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.cat(new_slots), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens))
    return query, cache, meta


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("decode_kernel", [False, True], ids=["grouped", "kernel"])
def test_fast_path_matches_reference(kv, block_size, queries_per_kv, decode_kernel):
    if decode_kernel:
        _kernel_or_skip()
    query, cache, meta = _make_batch(MIXED_BATCH, 2, queries_per_kv, 16, block_size, kv, poison=False)
    want = TorchAttentionBackend().attend(query, cache, meta, 0.25)
    fast = CpuAttentionBackend(use_kernel=decode_kernel)
    got = fast.attend(query, cache, meta, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.backend_plans["cpu"]
    if decode_kernel and kv == "auto":  # every decode row in the kernel's one call
        assert plan.kernel_rows is not None and not plan.decode_groups
        assert plan.kernel_rows.query_rows.numel() == sum(q == 1 for _, q in MIXED_BATCH)
    else:  # quantized KV stays on the grouped path
        assert plan.kernel_rows is None
        assert len(plan.decode_groups) > 1, "the mixed lengths must split into several decode groups"
    assert fast.attend(query, cache, meta, 0.25).equal(got), "the cached plan serves every later layer"

    # Blocks no request owns poisoned with NaN: the fast path never reads them.
    query_p, cache_p, meta_p = _make_batch(MIXED_BATCH, 2, queries_per_kv, 16, block_size, kv, poison=True)
    assert CpuAttentionBackend(use_kernel=decode_kernel).attend(query_p, cache_p, meta_p, 0.25).equal(got)


def test_decode_groups_bound_the_padding():
    lens = [5, 300, 7, 290, 64, 64, 65, 1, 1000, 12]
    groups = group_decode_rows(list(enumerate(lens)), pad_ratio=1.25)
    assert sorted(r for g in groups for r, _ in g) == list(range(len(lens)))
    for g in groups:
        longest = max(n for _, n in g)
        assert len(g) * longest <= 1.25 * sum(n for _, n in g)
    # far fewer padded tokens than batch x longest context
    assert sum(len(g) * max(n for _, n in g) for g in groups) <= 1.25 * sum(lens) < len(lens) * max(lens)


def _kernel_or_skip():
    """Skips only where the kernel cannot exist here (no compiler, no AVX2, switched off): with
    a compiler, a build that fails fails the test."""
    if cpu_paged_attention.unavailable_reason() is not None:
        pytest.skip(f"no paged decode kernel here: {cpu_paged_attention.unavailable_reason()}")
    kernel = cpu_paged_attention.load()
    assert kernel is not None, f"the CPU kernels did not build: {cpu_build.load_failure()}"
    return kernel


def _bf16(query, cache):
    return query.bfloat16(), LayerKVCache(cache.key_cache.bfloat16(), cache.value_cache.bfloat16())


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the AVX-512 path, the fixed-length loops, the generic loops
def test_kernel_head_sizes_in_fp32(head_dim):
    _kernel_or_skip()
    query, cache, meta = _make_batch(MIXED_BATCH, 2, 3, head_dim, 16, "auto", poison=False)
    want = TorchAttentionBackend().attend(query, cache, meta, head_dim ** -0.5)
    got = CpuAttentionBackend(use_kernel=True).attend(query, cache, meta, head_dim ** -0.5)
    assert meta.backend_plans["cpu"].kernel_rows is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_kernel_in_bf16_is_the_reference_up_to_bf16_rounding(queries_per_kv, head_dim):
    """bf16 cache and queries: the kernel widens to fp32, so against the fp32 reference on the
    same (bf16-rounded) values it is off by the output's bf16 rounding only, and it is no
    further from that than the bf16 SDPA path is."""
    _kernel_or_skip()
    query, cache, meta = _make_batch(MIXED_BATCH, 2, queries_per_kv, head_dim, 16, "auto", poison=False)
    q16, c16 = _bf16(query, cache)
    exact = TorchAttentionBackend().attend(q16.float(), LayerKVCache(c16.key_cache.float(), c16.value_cache.float()),
                                           meta, 0.125)
    got = CpuAttentionBackend(use_kernel=True).attend(q16, c16, meta, 0.125)
    assert got.dtype == torch.bfloat16 and meta.backend_plans["cpu"].kernel_rows is not None
    grouped = CpuAttentionBackend(use_kernel=False).attend(q16, c16, _make_batch(
        MIXED_BATCH, 2, queries_per_kv, head_dim, 16, "auto", poison=False)[2], 0.125)
    decode = torch.tensor([i for i, (_, q) in enumerate(MIXED_BATCH) if q == 1])
    rows = meta.query_start_loc[:-1].long()[decode]
    err = (got[rows].float() - exact[rows]).abs().max().item()
    assert err <= 2 ** -8 * exact[rows].abs().max().item()  # one bf16 rounding of the largest output
    assert err <= 2 * (grouped[rows].float() - exact[rows]).abs().max().item() + 1e-6


@pytest.mark.parametrize("variant", cpu_build.VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variant_this_cpu_runs_matches_the_reference(variant, dtype):
    """Each instruction-set build of the kernel (not only the one picked for this CPU), head
    sizes 64 (AVX-512's own path) and 32; every variant compiles in tests/test_cpu_kernels.py."""
    _kernel_or_skip()
    if variant not in cpu_build.runnable_variants():
        pytest.skip(f"this CPU does not run the {variant.name} build")
    kernel = cpu_paged_attention.PagedDecodeKernel(cpu_build.load_variant(variant))
    for head_dim in (64, 32):
        query, cache, meta = _make_batch(MIXED_BATCH, 2, 3, head_dim, 16, "auto", poison=False)
        if dtype == torch.bfloat16:
            query, cache = _bf16(query, cache)
        want = TorchAttentionBackend().attend(query.float(), LayerKVCache(
            cache.key_cache.float(), cache.value_cache.float()), meta, head_dim ** -0.5)
        got = CpuAttentionBackend(kernel=kernel).attend(query, cache, meta, head_dim ** -0.5)
        assert meta.backend_plans["cpu"].kernel_rows is not None
        decode = torch.tensor([i for i, (_, q) in enumerate(MIXED_BATCH) if q == 1])
        rows = meta.query_start_loc[:-1].long()[decode]
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
        err = (got[rows].float() - want[rows]).abs().max().item()
        assert err <= tolerance * want[rows].abs().max().item(), (variant.name, head_dim, err)


def test_kernel_rows_split_over_threads_give_the_same_bits():
    _kernel_or_skip()
    query, cache, meta = _make_batch(MIXED_BATCH * 3, 2, 3, 32, 8, "auto", poison=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CpuAttentionBackend().attend(query, cache, meta, 0.2)
        torch.set_num_threads(3)
        meta.backend_plans.clear()
        three = CpuAttentionBackend().attend(query, cache, meta, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert three.equal(one)


def test_no_kernel_keeps_the_grouped_path(monkeypatch, tmp_path, caplog):
    """Switched off, without a compiler, or when every build fails (a flag the compiler
    refuses): load() is None, a build failure is a WARNING, and the backend plans decode
    groups, with the reference's output."""
    query, cache, meta = _make_batch(MIXED_BATCH, 2, 3, 16, 8, "auto", poison=False)
    want = TorchAttentionBackend().attend(query, cache, meta, 0.25)
    monkeypatch.setenv("KVMESH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("KVMESH_PAGED_DECODE_KERNEL", "0")
    assert "disabled" in cpu_paged_attention.unavailable_reason() and cpu_paged_attention.load() is None
    monkeypatch.delenv("KVMESH_PAGED_DECODE_KERNEL")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    assert cpu_paged_attention.unavailable_reason() == "no C compiler on PATH"
    assert cpu_paged_attention.load() is None
    monkeypatch.undo()
    if cpu_paged_attention.unavailable_reason() is None:
        monkeypatch.setenv("KVMESH_KERNEL_CACHE", str(tmp_path))
        monkeypatch.setenv("KVMESH_KERNEL_CFLAGS", "-mno-such-instruction-set")
        cpu_build.reset()
        try:
            with caplog.at_level("WARNING", logger=cpu_build.__name__):
                assert cpu_paged_attention.load() is None
            assert "-mno-such-instruction-set" in caplog.text and "torch path runs" in caplog.text
            backend = CpuAttentionBackend()
            got = backend.attend(query, cache, meta, 0.25)
            assert backend.kernel() is None and len(meta.backend_plans["cpu"].decode_groups) > 1
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        finally:
            monkeypatch.undo()
            cpu_build.reset()
