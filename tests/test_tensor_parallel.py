"""Tensor parallelism: greedy tokens at TP=N equal TP=1, and a dead rank fails fast.

Real Ray actors and a real gloo group on loopback; one local Ray cluster for the module
(logical CPUs beyond the machine's 2 cores so a TP=4 group can be placed: the ranks run one
torch thread each). Every engine runs mixed-length prompts with small prefill chunks and a
block pool small enough to force preemption, as tests/test_engine_exact.py does.
"""

import dataclasses
import threading
import time

import pytest
import torch

from e2e_cluster import own_ray
from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, SamplingParams
from kvmesh.worker.parallel.distributed import single_rank
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.parallel.layers import ShardSpec, head_shard

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about dragons",
    "List three primary colors:",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    with own_ray(num_cpus=8):
        yield ray


def _config(model_dir, tp, *, num_blocks, new_tokens_budget=1 << 20, **extra):
    return KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32"},
        "cache": {"num_blocks": num_blocks, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      "max_total_kv_tokens": new_tokens_budget},
        "parallel": {"tensor_parallel_size": tp, "device": "cpu", "attention_backend": "torch",
                     "worker_num_cpus": 1, "collective_timeout_s": 20},
        **extra,
    })


def _greedy(config, max_tokens, prompts=PROMPTS, inspect=None):
    engine = Engine.from_config(config)
    try:
        if inspect is not None:
            inspect(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"r{i}", prompt=prompt,
                                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0)))
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None, delta.error
                tokens[delta.request_id].extend(delta.token_ids)
            engine.check_integrity()
        stats = engine.stats()
        assert stats.num_blocks_used == 0
        return [tokens[f"r{i}"] for i in range(len(prompts))], stats
    finally:
        shutdown = getattr(engine.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


@pytest.fixture(scope="module")
def tiny_tp1(tiny_model_dir):
    return _greedy(_config(tiny_model_dir, 1, num_blocks=8), 24)


# The tiny model has 2 KV heads: at TP=4 each lives on 2 ranks.
@pytest.mark.e2e
@pytest.mark.parametrize("tp,vocab_parallel", [(2, True), (4, True), (2, False)])
def test_tiny_model_tp_matches_tp1(ray_cluster, tiny_model_dir, tiny_tp1, tp, vocab_parallel):
    want, stats = tiny_tp1
    assert stats.num_preemptions_recompute > 0, "the small pool must force preemption"
    config = _config(tiny_model_dir, tp, num_blocks=8)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, vocab_parallel=vocab_parallel))
    got, _ = _greedy(config, 24)
    assert got == want


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_speculation_under_tp2_matches_tp1(ray_cluster, tiny_model_dir, tiny_tp1, method):
    """Drafts are proposed on rank 0 (the self-draft is a whole int8 model there) and verified
    in the TP group's one forward; greedy tokens stay those of plain TP=1 decoding."""
    want, _ = tiny_tp1
    speculative = {"speculative": {"method": method, "ngram_min_tokens": 1, "load_threshold_tokens": 1000}}
    engines = []
    got, _ = _greedy(_config(tiny_model_dir, 2, num_blocks=8, **speculative), 24, inspect=engines.append)
    assert got == want
    assert engines[0].speculator.counters.num_accepted_tokens > 0


@pytest.mark.e2e
def test_smollm2_tp3_matches_tp1(ray_cluster, smollm2_dir):
    # 9 query heads, 3 KV heads: one KV head and three query heads per rank.
    # Three prompts (about 6, 6 and 20 tokens + 10 new) need 4 blocks of 16; the pool has 3.
    want, stats = _greedy(_config(smollm2_dir, 1, num_blocks=3), 10, PROMPTS[:3])
    assert stats.num_preemptions_recompute > 0
    got, _ = _greedy(_config(smollm2_dir, 3, num_blocks=3), 10, PROMPTS[:3])
    assert got == want


@pytest.mark.e2e
def test_int8_weights_tp2_match_int8_tp1(ray_cluster, tiny_model_dir):
    quant = {"quant": {"weight": "int8"}}
    want, _ = _greedy(_config(tiny_model_dir, 1, num_blocks=8, **quant), 16)
    from kvmesh.quant.linear import Int8WeightOnlyLinear

    def sharded_int8(engine):
        attn = engine.runner.model.model.layers[0].self_attn
        assert isinstance(attn.o_proj, Int8WeightOnlyLinear) and attn.o_proj.in_features == 32  # 64 / 2
        assert isinstance(attn.k_proj, Int8WeightOnlyLinear) and attn.k_proj.out_features == 16  # 1 of 2 KV heads

    got, _ = _greedy(_config(tiny_model_dir, 2, num_blocks=8, **quant), 16, inspect=sharded_int8)
    assert got == want


@pytest.mark.e2e
def test_int4_awq_tp2_matches_tp1_from_one_calibration(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """TP=1 calibrates and caches the AWQ scales; TP=2 finds them in the cache, and each rank
    cuts its shard from the same full-model quantization: the same greedy tokens."""
    from kvmesh.quant.linear import Int4WeightOnlyLinear
    from kvmesh.worker.runner import awq_calibration

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    searches = []
    real_search = awq_calibration._calibrate_and_search
    monkeypatch.setattr(awq_calibration, "_calibrate_and_search",
                        lambda *a: searches.append(1) or real_search(*a))
    quant = {"quant": {"weight": "int4_awq", "group_size": 32}}
    want, _ = _greedy(_config(tiny_model_dir, 1, num_blocks=8, **quant), 16)
    assert len(searches) == 1 and len(list((tmp_path / "awq").glob("*.safetensors"))) == 1

    def sharded_awq(engine):
        down = engine.runner.model.model.layers[0].mlp.down_proj  # row-parallel: K split, scales too
        assert isinstance(down, Int4WeightOnlyLinear) and down.in_features == 64
        assert down.input_inv_scale is not None and down.input_inv_scale.shape == (64,)

    got, _ = _greedy(_config(tiny_model_dir, 2, num_blocks=8, **quant), 16, inspect=sharded_awq)
    assert len(searches) == 1  # from the cache
    assert got == want


@pytest.mark.e2e
def test_swap_preemption_under_tp_matches_tp1(ray_cluster, tiny_model_dir, tiny_tp1):
    """Swap preemption copies every rank's KV shard out to its own swap space and back: the
    tokens are those of TP=1 with recompute."""
    want, _ = tiny_tp1
    swap = {"scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                          "max_total_kv_tokens": 1 << 20, "preemption_mode": "swap"}}
    got, stats = _greedy(_config(tiny_model_dir, 2, num_blocks=8, **swap), 24)
    assert got == want
    assert stats.num_preemptions_swap > 0


def test_head_sharding_rules():
    from kvmesh.worker.parallel.distributed import Collectives

    def spec(heads, rank, n):
        return head_shard(heads, Collectives(rank, n), "KV")

    assert spec(8, 3, 4) == ShardSpec(0, 3, 4)
    assert [spec(2, r, 4).index for r in range(4)] == [0, 0, 1, 1]  # each KV head on 2 ranks
    with pytest.raises(ConfigError):
        spec(3, 0, 2)  # neither divides the other
    assert single_rank().all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


@pytest.mark.e2e
def test_tp_size_that_cannot_split_heads_is_a_config_error(ray_cluster, tiny_model_dir):
    with pytest.raises(ConfigError):
        Engine.from_config(_config(tiny_model_dir, 3, num_blocks=8))  # 4 query heads over 3 ranks


@pytest.mark.e2e
def test_killed_rank_fails_the_step_then_group_rebuilds(ray_cluster, tiny_model_dir, tiny_tp1):
    engine = Engine.from_config(_config(tiny_model_dir, 2, num_blocks=32))
    try:
        engine.add_request(GenerateRequest("doomed", prompt=PROMPTS[2],
                                           sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)))
        engine.step()  # the group is healthy: the first chunk runs
        peer = engine.runner.group.peers[0]
        # Kill the peer while rank 0 is inside a step (a real ray.kill, mid-generation).
        killer = threading.Timer(0.05, lambda: ray_cluster.kill(peer, no_restart=True))
        killer.start()
        errors = []
        started = time.monotonic()
        while engine.has_unfinished() and time.monotonic() - started < 60:
            errors += [d for d in engine.step() if d.finish_reason == FinishReason.ERROR]
        killer.join()
        assert not engine.has_unfinished(), "the request must end, not hang"
        assert len(errors) == 1 and errors[0].request_id == "doomed"
        assert errors[0].error_type == "WorkerFailedError"
        assert engine.stats().num_blocks_used == 0

        engine.add_request(GenerateRequest("after", prompt=PROMPTS[0],
                                           sampling=SamplingParams(max_tokens=8, temperature=0)))
        tokens = []
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None, delta.error
                tokens += delta.token_ids
        assert tokens == tiny_tp1[0][0][:8], "the rebuilt group computes what one rank does"
        assert engine.runner.group.generation == 2
    finally:
        engine.runner.shutdown()


@pytest.mark.parametrize("weight", ["int8", "int4"])
def test_quantized_shards_recompose_the_single_rank_layer(weight):
    # No Ray: the shards of one projection, run side by side, must give the unsharded
    # quantized layer's output (columns concatenated; rows summed, the bias added once).
    from types import SimpleNamespace

    from torch import nn

    from kvmesh.worker.parallel.layers import quantize_sharded

    torch.manual_seed(0)
    full = nn.Linear(128, 64, bias=True)
    cfg = SimpleNamespace(weight=weight, group_size=32)
    whole = quantize_sharded(full, ShardSpec(0, 0, 1), cfg)
    x = torch.randn(5, 128)
    want = whole(x)
    columns = torch.cat([quantize_sharded(full, ShardSpec(0, r, 2), cfg)(x) for r in range(2)], dim=-1)
    torch.testing.assert_close(columns, want)
    rows = sum(quantize_sharded(full, ShardSpec(1, r, 2), cfg)(x[:, r * 64:(r + 1) * 64]) for r in range(2))
    torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_and_head_with_padded_vocab():
    # A real gloo group of 3 ranks as threads of this process; a vocabulary of 10 rows is
    # padded to 12 (4 per rank) and the padding must never show up in outputs.
    from concurrent.futures import ThreadPoolExecutor

    from kvmesh.worker.parallel.distributed import GroupAddress, join_group, start_store
    from kvmesh.worker.parallel.layers import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    table = torch.randn(10, 8)
    ids = torch.tensor([0, 9, 4, 5, 3])
    hidden = torch.randn(2, 8)
    store, port = start_store(3, 20)
    address = GroupAddress(port, 3, 1, 20.0, "gloo")

    def rank(r):
        coll = join_group(address, r, store if r == 0 else None)
        embed = VocabParallelEmbedding(10, 8, coll)
        embed.weight.weight_loader(embed.weight, table)
        head = ParallelLMHead(10, 8, coll)
        head.weight.weight_loader(head.weight, table)
        with torch.no_grad():
            return embed(ids), head.gather_logits(head(hidden))

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rank, range(3)))
    for embedded, logits in results:
        torch.testing.assert_close(embedded, table[ids])
        torch.testing.assert_close(logits, hidden @ table.T)
