"""The host tier below the device pool: its books (kv/host_tier.py) and, through the real engine
(tiny random Llama), exact greedy output on tier hits, the content check, tenant isolation."""

import pytest
from engine_runs import generate_greedy, tiny_engine

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.core.seams import SamplingParams
from kvmesh.kv.hashing import hash_block
from kvmesh.kv.host_tier import HostTier
from kvmesh.kv.prefix_cache import CachedBlockKey


def _key(tokens, parent=None, extra=("salt=a",)):
    return CachedBlockKey(hash_block(parent, tokens, extra), parent, tuple(tokens), tuple(extra))


# ---- the books ------------------------------------------------------------------------------

def test_tier_is_an_lru_of_confirmed_entries_that_never_evicts_a_held_slot():
    tier = HostTier(num_slots=2, block_size=2)
    a, b, c = _key([1, 2]), _key([3, 4]), _key([5, 6])
    slot_a = tier.store(a)
    assert tier.lookup(a) is None, "pending until the copy is confirmed"
    tier.confirm(slot_a, a.block_hash, 111)
    assert tier.lookup(a) == (slot_a, 111)
    assert tier.store(a) is None, "the same block again: no second copy"
    slot_b = tier.store(b)
    tier.confirm(slot_b, b.block_hash, 222)
    tier.hold(slot_a)  # a's load is in flight (and a is now the most recently used): c takes b's slot
    slot_c = tier.store(c)
    assert slot_c == slot_b and not tier.holds_hash(b.block_hash) and tier.holds_hash(a.block_hash)
    tier.hold(slot_c)
    assert tier.store(_key([7, 8])) is None and tier.num_store_skips == 1, "every slot held: nothing evicted"
    tier.take_copies()
    tier.check_integrity()
    assert tier.stats().num_evictions == 1


def test_tier_serves_only_an_equal_key_and_drops_a_rejected_one():
    tier = HostTier(num_slots=4, block_size=2)
    mine = _key([1, 2], extra=("salt=a",))
    slot = tier.store(mine)
    tier.confirm(slot, mine.block_hash, 7)
    forged = CachedBlockKey(mine.block_hash, None, (1, 2), ("salt=b",))  # same hash, another tenant's keys
    assert tier.lookup(forged) is None
    tier.reject(mine)
    assert tier.lookup(mine) is None and tier.stats().num_checksum_failures == 1
    tier.check_integrity()


def test_a_late_confirm_for_a_reused_slot_is_ignored():
    tier = HostTier(num_slots=1, block_size=2)
    a, b = _key([1, 2]), _key([3, 4])
    slot = tier.store(a)
    assert tier.store(b) == slot  # a was still pending: its slot went to b
    tier.confirm(slot, a.block_hash, 1)
    assert tier.lookup(b) is None and tier.lookup(a) is None
    tier.check_integrity()


# ---- through the engine ---------------------------------------------------------------------

FAMILIES = [f"Family {name} handbook: the {name} team ships on Tuesdays, reviews on Mondays, "
            f"and answers every {name} question with a short numbered list. " for name in
            ("amber", "birch", "cobalt", "dune")]


_engine = tiny_engine


def _generate(engine, rid, prompt, salt=None):
    return generate_greedy(engine, rid, prompt, salt)[:2]


def _cycle_families(engine, salt=None):
    """Every family once (the pool holds about one), then the first family's follow-up."""
    for i, family in enumerate(FAMILIES):
        _generate(engine, f"warm-{i}", family + "First question?", salt)
    return _generate(engine, "follow-up", FAMILIES[0] + "Second question?", salt)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_tier_hits_give_the_same_greedy_tokens_as_pool_hits(tiny_model_dir, kv_dtype):
    tiered = _engine(tiny_model_dir, num_blocks=12, host_tier_num_blocks=64, kv_cache_dtype=kv_dtype)
    tokens, usage = _cycle_families(tiered)
    tier = tiered.scheduler.kv.host_tier.stats()
    assert tier.num_hits > 0 and usage.cached_tokens == tier.num_hit_tokens, "the prefix came from the tier"
    store = tiered.parts.host_tier_store
    assert store.num_bytes_loaded == tier.num_hits * store.bytes_per_block
    large = _engine(tiny_model_dir, num_blocks=96, kv_cache_dtype=kv_dtype)  # everything stays resident
    reference, ref_usage = _cycle_families(large)
    assert large.scheduler.kv.host_tier is None and ref_usage.cached_tokens == usage.cached_tokens
    assert tokens == reference, "a tier hit serves the same bytes a pool hit would"
    if kv_dtype == "auto":
        plain, _ = _cycle_families(_engine(tiny_model_dir, num_blocks=96, enable_prefix_caching=False))
        assert tokens == plain, "and the same tokens as computing everything"


def test_a_damaged_host_copy_is_recomputed_not_served(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=12, host_tier_num_blocks=64)
    for i, family in enumerate(FAMILIES):
        _generate(engine, f"warm-{i}", family + "First question?")
    for layer in engine.parts.host_tier_store.caches:
        layer.key_cache.add_(1.0)  # every host copy damaged after its checksum was taken
    tokens, usage = _generate(engine, "follow-up", FAMILIES[0] + "Second question?")
    tier = engine.scheduler.kv.host_tier.stats()
    assert usage.cached_tokens == 0 and tier.num_hits == 0 and tier.num_checksum_failures == 1
    plain, _ = _cycle_families(_engine(tiny_model_dir, num_blocks=96, enable_prefix_caching=False))
    assert tokens == plain


def test_a_tenants_salted_blocks_never_reach_another_tenant_through_the_tier(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=12, host_tier_num_blocks=64)
    _, own = _cycle_families(engine, salt="tenant-a")
    hits_a = engine.scheduler.kv.host_tier.num_hits
    assert own.cached_tokens > 0 and hits_a > 0
    _, other = _generate(engine, "intruder", FAMILIES[0] + "Second question?", salt="tenant-b")
    assert other.cached_tokens == 0 and engine.scheduler.kv.host_tier.num_hits == hits_a


def test_tier_size_comes_from_the_config(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=12, host_tier_gib=0.001)
    plan = engine.parts.plan
    assert plan.num_host_tier_blocks == int(0.001 * 2**30) // (plan.kv_bytes_per_token * plan.block_size)
    assert engine.scheduler.kv.host_tier.num_slots == plan.num_host_tier_blocks
    assert _engine(tiny_model_dir, num_blocks=12).scheduler.kv.host_tier is None, "off by default"
    with pytest.raises(ConfigError):
        KvmeshConfig.from_dict({"cache": {"host_tier_gib": -1}}).validate()


def test_tier_figures_reach_the_workers_metrics(tiny_model_dir):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.core.kv_tier_metrics import KVTierCollector

    engine = _engine(tiny_model_dir, num_blocks=12, host_tier_num_blocks=64)
    _cycle_families(engine)
    registry = CollectorRegistry()
    registry.register(KVTierCollector("worker-7", engine.kv_tier_figures))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    figures = engine.kv_tier_figures()
    assert figures.hit_tokens > 0 and figures.bytes_loaded > 0
    assert samples[("kvmesh_kv_tier_hit_tokens_total", (("worker", "worker-7"),))] == figures.hit_tokens
    assert samples[("kvmesh_kv_tier_bytes_total", (("direction", "load"), ("worker", "worker-7")))] == \
        figures.bytes_loaded
    assert samples[("kvmesh_kv_tier_blocks", (("state", "total"), ("worker", "worker-7")))] == 64
    empty = CollectorRegistry()
    empty.register(KVTierCollector("w", _engine(tiny_model_dir, num_blocks=12).kv_tier_figures))
    assert b"kv_tier" not in generate_latest(empty), "no tier, no tier samples"


def test_prefix_events_cover_the_pool_and_the_tier():
    """The router's view: a block evicted from the pool into the tier is still the worker's (no
    EVICTED); it is EVICTED once the tier drops it too, and a reset lists tier blocks as well."""
    from fake_paged_model import FakePagedModel, run_until_idle

    from kvmesh.core.config import SchedulerConfig
    from kvmesh.core.seams import PrefixEventKind
    from kvmesh.kv.kv_cache_manager import KVCacheManager
    from kvmesh.worker.engine_loop.request import Request, RequestStatus
    from kvmesh.worker.engine_loop.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_tier_blocks=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_total_kv_tokens=100), kv, clock=lambda: 0.0)
    model = FakePagedModel(4, 2, num_tier_blocks=4).attach(scheduler)
    families = [[10 * f + i for i in range(5)] for f in range(8)]  # 2 full blocks each (+1 token)

    def run(family: int, rid: str) -> Request:
        request = Request(rid, families[family], SamplingParams(max_tokens=1), arrival_time=0.0)
        scheduler.add_request(request)
        run_until_idle(scheduler, model)
        assert request.status is RequestStatus.FINISHED
        return request

    first = run(0, "a")
    hashes = set(first.block_hashes[:2])
    run(1, "b")  # pool (4 blocks) evicts family 0 into the tier
    events = kv.events_since(0).events
    evicted = {h for e in events if e.kind is PrefixEventKind.EVICTED for h in e.block_hashes}
    assert kv.pool.num_evictions > 0 and not (hashes & evicted), "in the tier: still this worker's"
    in_tier = hashes & set(kv.host_tier.hashes())
    assert in_tier and hashes <= in_tier | set(kv.prefix_cache.hashes())
    assert hashes <= set(kv.events_since(10**6).all_hashes), "a reset lists tier blocks too"
    for family in range(2, 8):  # pool and tier (4 + 4 blocks) drop family 0 at last
        run(family, f"f{family}")
    evicted = {h for e in kv.events_since(0).events if e.kind is PrefixEventKind.EVICTED for h in e.block_hashes}
    assert hashes <= evicted and not (hashes & (set(kv.host_tier.hashes()) | set(kv.prefix_cache.hashes())))
