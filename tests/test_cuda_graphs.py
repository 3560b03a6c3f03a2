"""The CUDA-graph decode runner's host-side parts, on CPU: bucket choice, padding to the
bucket and back, the Triton kernels' handling of padding rows, and the fallback to eager.

Capture and replay themselves need a GPU (load_tests/gpu_check.py). The engine test below
stands a `_ReplayEagerly` object in for torch.cuda.CUDAGraph: its replay() runs the same
forward on the same static tensors, so everything around the graph (copy into the static
inputs, padding rows, slicing the output) runs for real through the tiny model.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kvmesh.core.config import KvmeshConfig  # noqa: E402
from kvmesh.worker.runner import cuda_graphs  # noqa: E402
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache  # noqa: E402
from kvmesh.worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvmesh.worker.runner.cuda_graphs import PAD_SLOT, CudaGraphRunner, pad_decode, select_bucket  # noqa: E402
from kvmesh.worker.runner.model_runner import StepInputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter


def decode_inputs(seq_lens, block_size=4, first_token=10):
    """StepInputs of a decode-only batch: request i at position seq_lens[i] - 1 in blocks
    numbered from 3 * i (so tables differ per request)."""
    ids, positions, slots, tables = [], [], [], []
    for i, n in enumerate(seq_lens):
        blocks = tuple(3 * i + j for j in range(-(-n // block_size)))
        pos = n - 1
        ids.append(first_token + i)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(blocks)
    b = len(seq_lens)
    return StepInputs(tuple(ids), tuple(positions), tuple(slots), (1,) * b, tuple(seq_lens), tuple(tables),
                      tuple(range(b)))


def test_select_bucket_takes_the_smallest_that_fits():
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    assert [select_bucket(b, buckets) for b in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    assert select_bucket(129, buckets) is None  # above the largest: eager
    assert select_bucket(0, buckets) is None
    assert select_bucket(3, {8, 4}) == 4  # any iterable of sizes
    assert cuda_graphs.validate_buckets([8, 1, 8, 2]) == (1, 2, 8)
    for bad in ([], [0, 4], [2.5]):
        with pytest.raises(ValueError):
            cuda_graphs.validate_buckets(bad)


def test_pad_decode_fills_padding_rows_and_keeps_real_rows():
    inputs = decode_inputs([5, 1, 9])
    padded = pad_decode(inputs, bucket=4, max_blocks_per_seq=4)
    assert padded.bucket == 4 and padded.batch_size == 3
    assert padded.input_ids.tolist() == [10, 11, 12, 0]
    assert padded.positions.tolist() == [4, 0, 8, 0]
    assert padded.slot_mapping.tolist() == [*inputs.slot_mapping, PAD_SLOT]
    assert padded.seq_lens.tolist() == [5, 1, 9, 0]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.block_tables.tolist() == [[0, 1, 0, 0], [3, 0, 0, 0], [6, 7, 8, 0], [0, 0, 0, 0]]
    meta = cuda_graphs.padded_metadata(padded, max_seq_len=16)
    assert meta.num_reqs == 4 and meta.all_decode and meta.max_seq_len == 16
    assert meta.seq_lens_host == (5, 1, 9, 0) and meta.query_lens_host == (1, 1, 1, 1)


def test_pad_decode_rejects_what_a_graph_cannot_hold():
    with pytest.raises(ValueError):
        pad_decode(decode_inputs([5, 1, 9]), bucket=2, max_blocks_per_seq=4)  # too many rows
    with pytest.raises(ValueError):
        pad_decode(decode_inputs([17]), bucket=1, max_blocks_per_seq=4)  # 5 blocks > 4
    prefill = StepInputs((1, 2), (0, 1), (0, 1), (2,), (2,), ((0,),), (1,))
    assert not cuda_graphs.is_decode_only(prefill)
    with pytest.raises(ValueError):
        pad_decode(prefill, bucket=2, max_blocks_per_seq=4)
    assert cuda_graphs.is_decode_only(decode_inputs([3, 4]))


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_padding_rows_leave_the_cache_alone_and_real_rows_unchanged(kv):
    """Triton write_kv + attend on a padded batch: padding rows (slot -1, length 0) write
    nothing and read nothing; the real rows' outputs equal the unpadded batch's."""
    from kvmesh.quant.kv_quant import kv_storage_dtype
    from kvmesh.worker.runner.model_runner import allocate_kv_caches

    block_size, hkv, hq, d = 4, 2, 4, 16
    storage = torch.float32 if kv == "auto" else kv_storage_dtype(kv)
    cache = allocate_kv_caches(1, 12, block_size, hkv, d, storage, DEVICE)[0]
    gen = torch.Generator().manual_seed(0)
    for t in (cache.key_cache, cache.value_cache):  # arbitrary earlier context
        t.copy_(torch.randint(0, 255, t.shape, generator=gen).to(t.dtype) if kv == "int4"
                else torch.randn(t.shape, generator=gen))
    inputs = decode_inputs([5, 2, 9], block_size=block_size)
    b = 3
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE)
    k, v = torch.randn(b, hkv, d, generator=gen).to(DEVICE), torch.randn(b, hkv, d, generator=gen).to(DEVICE)
    backend = TritonAttentionBackend()

    def clone(c):
        return LayerKVCache(*(None if t is None else t.clone() for t in
                              (c.key_cache, c.value_cache, c.key_scale, c.value_scale)))

    plain = clone(cache)
    meta = AttentionMetadata(torch.arange(b + 1, dtype=torch.int32, device=DEVICE),
                             torch.tensor(inputs.seq_lens, dtype=torch.int32, device=DEVICE),
                             pad_decode(inputs, b, 3).block_tables.to(DEVICE),
                             torch.tensor(inputs.slot_mapping, device=DEVICE),
                             1, max(inputs.seq_lens), (1,) * b, inputs.seq_lens)
    backend.write_kv(plain, k, v, meta.slot_mapping)
    expected = backend.attend(q, plain, meta, 0.25)

    padded_cache = clone(cache)
    padded = pad_decode(inputs, bucket=8, max_blocks_per_seq=3)
    pmeta = cuda_graphs.padded_metadata(padded, max_seq_len=12, device=DEVICE)
    pad = lambda x: torch.cat([x, torch.full((8 - b, *x.shape[1:]), 7.0, device=DEVICE)])  # noqa: E731 - junk rows
    backend.write_kv(padded_cache, pad(k), pad(v), pmeta.slot_mapping)
    got = backend.attend(pad(q), padded_cache, pmeta, 0.25)
    for a, c in zip((plain.key_cache, plain.value_cache, plain.key_scale, plain.value_scale),
                    (padded_cache.key_cache, padded_cache.value_cache, padded_cache.key_scale,
                     padded_cache.value_scale)):
        if a is not None:
            assert torch.equal(a, c)  # padding rows wrote nothing, not even the last slot
    torch.testing.assert_close(got[:b], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[b:], torch.zeros_like(got[b:]))  # no key seen: zeros, not NaN


def test_runner_is_off_on_cpu_and_falls_back_when_capture_fails():
    inputs = decode_inputs([3])
    runner = CudaGraphRunner(lambda *a: torch.zeros(1, 4), TritonAttentionBackend(), [], torch.device("cpu"),
                             max_model_len=16, block_size=4)
    assert not runner.enabled and runner.disabled_reason == "not a CUDA device"
    runner.capture()
    assert runner.run(inputs) is None and not runner.graphs

    class TorchBackend:
        name = "torch"

    assert "needs triton" in CudaGraphRunner._why_not(torch.device("cuda"), TorchBackend(), 1)
    assert "tensor parallelism" in CudaGraphRunner._why_not(torch.device("cuda"), TritonAttentionBackend(), 2)
    # A capture that fails (here: no CUDA at all) turns graphs off; the engine stays eager.
    runner.disabled_reason = None
    runner.capture()
    assert not runner.enabled and runner.disabled_reason.startswith("capture failed")
    assert runner.run(inputs) is None


class _ReplayEagerly:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay() reruns the captured forward on
    the same static tensors and writes the same output tensor."""

    def __init__(self, runner: CudaGraphRunner, static):
        self.runner, self.static = runner, static
        self.hidden = runner._forward(static)

    def replay(self):
        self.hidden.copy_(self.runner._forward(self.static))


def test_engine_greedy_tokens_equal_with_padded_replay(tiny_model_dir):
    """Decode steps through the runner (copy into static inputs, padded to buckets 2 and 4,
    slice back) give the eager engine's greedy tokens; prefill chunks stay eager."""
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine

    def run(with_graphs: bool) -> tuple[dict[str, list[int]], int]:
        engine = _tiny_engine(tiny_model_dir, cuda_graphs=False)
        runner = engine.runner
        graphs = None
        if with_graphs:
            graphs = CudaGraphRunner(runner.model, runner.backend, runner.kv_caches, DEVICE, 64, 8,
                                     buckets=(2, 4))
            graphs.disabled_reason = None  # the CPU stand-in below replaces the CUDA capture
            for bucket in graphs.buckets:
                stand_in = _ReplayEagerly(graphs, graphs._static_for(bucket))
                graphs.graphs[bucket] = cuda_graphs._Graph(stand_in, stand_in.static, stand_in.hidden)
            runner.graph_runner = graphs
        return _greedy(engine), graphs.replays if graphs else 0

    eager, _ = run(False)
    replayed, replays = run(True)
    assert replays > 0  # decode steps went through the padded bucket
    assert replayed == eager and all(len(t) == 4 for t in eager.values())


def _tiny_engine(tiny_model_dir, cuda_graphs: bool):
    from kvmesh.worker.engine_loop.engine import Engine

    return Engine.from_config(KvmeshConfig.from_dict({
        # cpu_native_max_tokens 0: on CPU the native step would take the decode steps this
        # tests through the graph runner (fp32 models take it by default)
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 64, "cpu_native_max_tokens": 0},
        "cache": {"num_blocks": 24, "block_size": 8},
        "parallel": {"device": DEVICE.type, "attention_backend": "triton", "cuda_graphs": cuda_graphs}}))


def _greedy(engine) -> dict[str, list[int]]:
    from kvmesh.core.seams import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(["The capital of France is", "1, 2, 3,", "def f(x):"]):
        engine.add_request(GenerateRequest(f"r{i}", prompt=prompt, sampling=sampling))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real capture and replay need CUDA (gpu_check runs this)")
def test_captured_graphs_give_the_eager_greedy_tokens_on_cuda(tiny_model_dir):
    graphed = _tiny_engine(tiny_model_dir, cuda_graphs=True)
    graphs = graphed.runner.graph_runner
    assert graphs is not None and graphs.enabled, graphs and graphs.disabled_reason
    assert sorted(graphs.graphs) == [b for b in cuda_graphs.DEFAULT_BUCKETS if b <= 64]  # max_num_seqs 64
    tokens = _greedy(graphed)
    assert graphs.replays > 0
    assert tokens == _greedy(_tiny_engine(tiny_model_dir, cuda_graphs=False))
