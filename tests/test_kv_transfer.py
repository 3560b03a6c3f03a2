"""Prefix KV between two engines (tiny random Llama, in one process; the Ray path is in
tests/test_kv_transfer_e2e.py): export from the holder's pool or tier, import into the puller's
tier after the hash / token / checksum checks, then an exact tier hit; the cost model."""

import pytest
from engine_runs import generate_greedy, tiny_engine

from kvmesh.kv.transfer_cost import TransferCostModel, TransferPriors
from kvmesh.worker.engine_loop.kv_transfer import export_prefix, import_prefix, local_prefix_blocks

PREFIX = "Shared onboarding guide: badges at the desk, laptops from IT, lunch at noon, and " * 2


def _engine(model_dir):
    return tiny_engine(model_dir, num_blocks=48, host_tier_num_blocks=32)


def _generate(engine, rid, prompt, salt=None):
    return generate_greedy(engine, rid, prompt, salt)[:2]


@pytest.fixture(scope="module")
def holder(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    _generate(engine, "warm-a", PREFIX + "First day?", salt="tenant-a")
    return engine


def _tokens(engine, prompt):
    return list(engine.tokenizer.encode(prompt, add_special_tokens=False))


def test_pulled_blocks_are_tier_hits_with_the_same_greedy_output(holder, tiny_model_dir):
    prompt = PREFIX + "Second day?"
    tokens, keys = _tokens(holder, prompt), holder.block_extra_keys("tenant-a")
    export = export_prefix(holder, tokens, keys, first_block=0)
    assert export.num_blocks == local_prefix_blocks(holder, tokens, keys) > 0
    puller = _engine(tiny_model_dir)
    result = import_prefix(puller, export, tokens, puller.block_extra_keys("tenant-a"))
    assert result.num_stored == export.num_blocks and result.num_refused == 0
    assert local_prefix_blocks(puller, tokens, puller.block_extra_keys("tenant-a")) == export.num_blocks
    out, usage = _generate(puller, "pulled", prompt, salt="tenant-a")
    assert usage.cached_tokens == export.num_blocks * 8
    reference, _ = _generate(holder, "local", prompt, salt="tenant-a")  # a pool hit on the holder
    assert out == reference


def test_another_tenants_or_damaged_blocks_are_never_stored(holder, tiny_model_dir):
    prompt = PREFIX + "Third day?"
    tokens = _tokens(holder, prompt)
    assert export_prefix(holder, tokens, holder.block_extra_keys("tenant-b"), 0).num_blocks == 0, \
        "the holder serves tenant-a's blocks to nobody else"
    export = export_prefix(holder, tokens, holder.block_extra_keys("tenant-a"), 0)
    puller = _engine(tiny_model_dir)
    stolen = import_prefix(puller, export, tokens, puller.block_extra_keys("tenant-b"))
    assert stolen.num_stored == 0 and stolen.num_refused == export.num_blocks, "hashes under tenant-b's keys differ"
    export.tensors[0][1].add_(1.0)  # block 1 damaged in transit
    damaged = import_prefix(puller, export, tokens, puller.block_extra_keys("tenant-a"))
    assert damaged.num_stored == 1 and damaged.num_refused == export.num_blocks - 1
    assert puller.scheduler.kv.host_tier.stats().num_checksum_failures == 2
    puller.check_integrity()


def test_cost_model_pulls_only_when_cheaper_than_recompute():
    model = TransferCostModel(TransferPriors(prefill_tokens_per_s=1000.0, transfer_bytes_per_s=1e8, overhead_s=0.01))
    assert model.pull_is_cheaper(1000, 10_000_000)  # 0.11 s pull vs 1 s prefill
    assert not model.pull_is_cheaper(50, 10_000_000)  # 0.11 s vs 0.05 s
    model.observe_prefill(10_000, 1.0)  # measured: 10k tokens/s
    assert model.prefill_tokens_per_s == 10_000 and not model.pull_is_cheaper(1000, 10_000_000)
    model.observe_transfer(10_000_000, 0.01)  # measured: 1 GB/s
    assert model.pull_is_cheaper(1000, 10_000_000)
    model.observe_failure(10_000_000, 5.0)  # a timed-out pull drags the bandwidth down
    assert model.transfer_bytes_per_s < 1e9 and model.pull_is_cheaper(1000, 10_000_000)
    for _ in range(8):  # pulls that keep failing stop being tried
        model.observe_failure(10_000_000, 5.0)
    assert not model.pull_is_cheaper(1000, 10_000_000)
    assert not model.pull_is_cheaper(0, 0)
