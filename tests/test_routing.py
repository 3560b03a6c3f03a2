"""router/routing.py on its own: policies, health, and two simulations with a simulated cache."""

from __future__ import annotations

import collections
import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from kvmesh.core.config import RouterConfig
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.router.routing import (RequestSizeMeter, RoundRobinCursor, RoutingPath, choose_worker,
                                   imbalance_margin_tokens, worker_load_tokens)
from kvmesh.core.seams import PrefixEvent, PrefixEventBatch, PrefixEventKind, WorkerStats
from kvmesh.core.errors import WorkerFailedError


def stats(worker_id, tokens_to_compute=0, kv_tokens_used=None, healthy=True):
    """A worker whose load (routing.worker_load_tokens) is `tokens_to_compute`; it holds as
    much KV unless told otherwise."""
    kv = tokens_to_compute if kv_tokens_used is None else kv_tokens_used
    return WorkerStats(worker_id=worker_id, healthy=healthy, block_size=16, num_blocks_total=1000,
                       num_blocks_used=0, num_blocks_cached=0, num_blocks_free=1000,
                       kv_tokens_used=kv, kv_tokens_capacity=16000, kv_tokens_reserved=kv,
                       num_running=0, num_waiting=0, queued_prompt_tokens=0,
                       prefix_cache_hit_rate=0.0, output_tokens_per_s=100.0, tokens_to_compute=tokens_to_compute)


PREFIX = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=1000)


def test_longest_prefix_wins_while_load_is_within_bounds():
    workers = [stats("w0", 100), stats("w1", 1000), stats("w2", 0)]
    decision = choose_worker({"w0": 2, "w1": 5}, workers, PREFIX, random.Random(0))
    assert (decision.worker_id, decision.matched_blocks, decision.path) == ("w1", 5, RoutingPath.PREFIX_MATCH)
    assert decision.load_tokens == 1000


def test_affinity_breaks_only_when_both_ratio_and_absolute_margin_are_exceeded():
    rng = random.Random(0)
    # 2000 vs 1100: ratio 1.8 > 1.5 but margin 900 <= 1000 -> keep affinity
    workers = [stats("w0", 2000), stats("w1", 1100)]
    assert choose_worker({"w0": 3}, workers, PREFIX, rng).worker_id == "w0"
    # 5000 vs 4000: margin 1000... ratio 1.25 <= 1.5 -> keep affinity
    workers = [stats("w0", 5000), stats("w1", 4000)]
    assert choose_worker({"w0": 3}, workers, PREFIX, rng).worker_id == "w0"
    # 3000 vs 1000: ratio 3 and margin 2000 -> load wins
    workers = [stats("w0", 3000), stats("w1", 1000)]
    decision = choose_worker({"w0": 3}, workers, PREFIX, rng)
    assert (decision.worker_id, decision.path, decision.matched_blocks) == ("w1", RoutingPath.PREFIX_IMBALANCED, 0)


def test_router_in_flight_tokens_count_as_load():
    workers = [stats("w0", 0), stats("w1", 0)]
    decision = choose_worker({"w0": 1}, workers, PREFIX, random.Random(0), extra_load_tokens={"w0": 5000})
    assert decision.worker_id == "w1"
    assert worker_load_tokens(workers[0], 5000) == 5000


def test_no_prefix_uses_power_of_two_choices_by_load():
    workers = [stats("w0", 900), stats("w1", 100), stats("w2", 500)]
    counts = collections.Counter(
        choose_worker({}, workers, PREFIX, random.Random(seed)).worker_id for seed in range(300))
    # p2c never picks the most loaded of three; the least loaded wins whenever sampled (2/3)
    assert counts["w0"] == 0
    assert counts["w1"] > counts["w2"]


def test_unhealthy_workers_are_never_chosen_and_none_healthy_is_unavailable():
    workers = [stats("w0", 0, healthy=False), stats("w1", 10_000)]
    for policy in ("prefix_aware", "least_loaded", "round_robin"):
        config = RouterConfig(policy=policy)
        for seed in range(20):
            d = choose_worker({"w0": 9}, workers, config, random.Random(seed), cursor=RoundRobinCursor())
            assert d.worker_id == "w1"
    with pytest.raises(WorkerFailedError):
        choose_worker({}, [stats("w0", healthy=False)], PREFIX, random.Random(0))
    with pytest.raises(WorkerFailedError):
        choose_worker({}, [], PREFIX, random.Random(0))


def test_least_loaded_and_round_robin():
    workers = [stats("w0", 300), stats("w1", 200), stats("w2", 200)]
    config = RouterConfig(policy="least_loaded")
    picks = {choose_worker({}, workers, config, random.Random(s)).worker_id for s in range(30)}
    assert picks == {"w1", "w2"}
    cursor = RoundRobinCursor()
    config = RouterConfig(policy="round_robin")
    order = [choose_worker({"w0": 4}, workers, config, random.Random(0), cursor=cursor).worker_id
             for _ in range(6)]
    assert order == ["w0", "w1", "w2", "w0", "w1", "w2"]
    with pytest.raises(ValueError):
        choose_worker({}, workers, config, random.Random(0))


# ---- simulations ------------------------------------------------------------------------

BLOCK = 4
EXTRA = ("model=sim",)


@dataclass
class SimWorker:
    """An LRU prefix cache of a fixed number of blocks that emits the events a worker would."""

    worker_id: str
    capacity_blocks: int
    lru: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    seq: int = 0
    active: list = field(default_factory=list)  # [steps_left, tokens]

    def serve(self, block_hashes) -> tuple[int, PrefixEventBatch]:
        hit = 0
        while hit < len(block_hashes) and block_hashes[hit] in self.lru:
            hit += 1
        for h in block_hashes:
            self.lru[h] = True
            self.lru.move_to_end(h)
        evicted = []
        while len(self.lru) > self.capacity_blocks:
            evicted.append(self.lru.popitem(last=False)[0])
        events = [PrefixEvent(self.seq, PrefixEventKind.STORED, tuple(block_hashes))]
        if evicted:
            events.append(PrefixEvent(self.seq + 1, PrefixEventKind.EVICTED, tuple(evicted)))
        self.seq += len(events)
        return hit, PrefixEventBatch(self.worker_id, self.seq, tuple(events))

    def load(self) -> int:
        return sum(tokens for _, tokens in self.active)

    def step(self) -> None:
        self.active = [[left - 1, tokens] for left, tokens in self.active if left > 1]


def simulate(config, family_weights, *, seed, num_workers=4, capacity_blocks=12, steps=400,
             arrivals_per_step=1, duration_steps=4, prefix_blocks=8, suffix_blocks=2):
    """Returns (prefix-cache token hit rate, tokens routed per worker)."""
    rng = random.Random(seed)
    sim = [SimWorker(f"w{i}", capacity_blocks) for i in range(num_workers)]
    by_id = {w.worker_id: w for w in sim}
    index, cursor = PrefixIndex(), RoundRobinCursor()
    hit_tokens = prompt_tokens = 0
    routed = collections.Counter()
    families = list(range(len(family_weights)))
    for step in range(steps):
        for _ in range(arrivals_per_step):
            family = rng.choices(families, weights=family_weights)[0]
            unique = [rng.randrange(10**6) for _ in range(suffix_blocks * BLOCK)]
            tokens = [1000 + family] * (prefix_blocks * BLOCK) + unique
            hashes = hash_full_blocks(tokens, BLOCK, EXTRA)
            workers = [stats(w.worker_id, w.load()) for w in sim]
            decision = choose_worker(index.longest_prefix(hashes), workers, config, rng, cursor=cursor)
            worker = by_id[decision.worker_id]
            hit_blocks, batch = worker.serve(hashes)
            index.apply(batch)
            worker.active.append([duration_steps, len(tokens)])
            routed[worker.worker_id] += len(tokens)
            hit_tokens += hit_blocks * BLOCK
            prompt_tokens += len(tokens)
        for w in sim:
            w.step()
        index.check_integrity()
    return hit_tokens / prompt_tokens, routed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_prompt_families_prefix_aware_hits_at_least_twice_round_robin(seed):
    weights = [1, 1, 1, 1]
    prefix_rate, _ = simulate(RouterConfig(policy="prefix_aware"), weights, seed=seed)
    rr_rate, _ = simulate(RouterConfig(policy="round_robin"), weights, seed=seed)
    assert prefix_rate >= 2 * rr_rate
    assert prefix_rate > 0.6  # 8 of every 10 blocks are a family prefix


def test_skewed_mix_load_threshold_keeps_workers_within_one_and_a_half_x():
    # 85% of traffic shares one prefix: pure affinity would pile it onto one worker.
    weights = [85, 5, 5, 5]
    kwargs = dict(seed=3, arrivals_per_step=4, duration_steps=8, capacity_blocks=40)
    balanced = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=80)
    hit_rate, routed = simulate(balanced, weights, **kwargs)
    assert max(routed.values()) <= 1.5 * min(routed.values())
    # ... and the thresholds are what did it: without them the hot worker takes most tokens.
    sticky = RouterConfig(policy="prefix_aware", imbalance_ratio=1000.0, imbalance_abs_tokens=10**9)
    _, routed_sticky = simulate(sticky, weights, **kwargs)
    assert max(routed_sticky.values()) > 3 * min(routed_sticky.values())
    # spilling the hot family onto other workers still leaves them caching its prefix
    assert hit_rate > 0.5


def test_an_overloaded_family_spills_to_the_worker_already_holding_it_not_a_new_one():
    config = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=500)
    # w0 holds the whole prefix but is overloaded; w1 holds most of it (an earlier spill).
    workers = [stats("w0", 3000), stats("w1", 400), stats("w2", 0), stats("w3", 0)]
    picks = {choose_worker({"w0": 10, "w1": 8}, workers, config, random.Random(s)).path for s in range(20)}
    decisions = {choose_worker({"w0": 10, "w1": 8}, workers, config, random.Random(s)).worker_id for s in range(20)}
    assert picks == {RoutingPath.PREFIX_SPILL} and decisions == {"w1"}
    # Once every holder is overloaded too, the family gets one more worker (power of two).
    workers = [stats("w0", 3000), stats("w1", 3000), stats("w2", 0), stats("w3", 0)]
    decision = choose_worker({"w0": 10, "w1": 8}, workers, config, random.Random(0))
    assert decision.path is RoutingPath.PREFIX_IMBALANCED and decision.worker_id in {"w2", "w3"}
    # A worker holding only a sliver of the prefix is not a holder worth sticking to.
    workers = [stats("w0", 3000), stats("w1", 0), stats("w2", 0)]
    assert choose_worker({"w0": 10, "w1": 2}, workers, config, random.Random(1)).path is RoutingPath.PREFIX_IMBALANCED


def test_the_absolute_margin_is_counted_in_mean_requests_so_one_long_request_does_not_break_affinity():
    """7.2k-token requests (the 16-worker table's): the hot worker one request ahead of an idle
    one keeps its family; two and a bit requests ahead it spills. With short requests the
    fixed floor (imbalance_abs_tokens) still applies, and 0 requests means the floor alone."""
    config = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=2048,
                          imbalance_margin_requests=2.0)
    long_request = 7232
    assert imbalance_margin_tokens(config, long_request) == 2 * long_request
    assert imbalance_margin_tokens(config, 200) == 2048  # short requests: the floor
    assert imbalance_margin_tokens(RouterConfig(imbalance_margin_requests=0), long_request) == 2048

    one_ahead = [stats("w0", long_request + 1000), stats("w1", 1000)]
    kept = choose_worker({"w0": 375}, one_ahead, config, random.Random(0), mean_request_tokens=long_request)
    assert (kept.worker_id, kept.path) == ("w0", RoutingPath.PREFIX_MATCH)
    # The same loads judged by the fixed 2,048 tokens alone (no requests measured yet): a spill.
    fixed = choose_worker({"w0": 375}, one_ahead, config, random.Random(0))
    assert (fixed.worker_id, fixed.path) == ("w1", RoutingPath.PREFIX_IMBALANCED)

    far_ahead = [stats("w0", 3 * long_request), stats("w1", 0)]
    spilled = choose_worker({"w0": 375}, far_ahead, config, random.Random(0), mean_request_tokens=long_request)
    assert (spilled.worker_id, spilled.path) == ("w1", RoutingPath.PREFIX_IMBALANCED)

    short = [stats("w0", 3500), stats("w1", 1000)]
    assert choose_worker({"w0": 12}, short, config, random.Random(0), mean_request_tokens=200).worker_id == "w1"


def test_request_size_meter_is_the_mean_of_a_sliding_window():
    meter = RequestSizeMeter(window=4)
    assert meter.mean_tokens() == 0.0
    for size in (100, 100, 100, 100):
        meter.observe(size)
    assert meter.mean_tokens() == 100
    meter.observe(500)  # the oldest 100 leaves the window
    assert meter.mean_tokens() == 200


def test_blocks_the_index_knows_are_a_floor_under_a_stale_footprint():
    """w1's last poll predates the family it just served (that request has ended, so it is
    not in flight either); the index still knows its blocks and the next new family goes to
    w0, as it would once the stats catch up."""
    w0 = dataclasses.replace(stats("w0"), num_blocks_cached=12)
    w1 = dataclasses.replace(stats("w1"), num_blocks_cached=12)  # stale: 24 really
    config = RouterConfig(policy="prefix_aware")
    stale = {choose_worker({}, [w0, w1], config, random.Random(seed)).worker_id for seed in range(20)}
    assert stale == {"w0", "w1"}  # a tie: either
    known = {"w0": 12, "w1": 24}
    picks = {choose_worker({}, [w0, w1], config, random.Random(seed), known_blocks=known).worker_id
             for seed in range(20)}
    assert picks == {"w0"}


def test_load_is_the_work_left_to_compute_not_the_kv_held():
    """w0 holds a long cached prefix for its family's running requests (much KV, little to
    compute): it keeps the family. w1 holds little KV but has a long prompt queued to
    compute: a family there spills to the idle worker."""
    config = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=1000)
    hits = [stats("w0", tokens_to_compute=300, kv_tokens_used=8000), stats("w1", tokens_to_compute=0)]
    kept = choose_worker({"w0": 30}, hits, config, random.Random(0))
    assert (kept.worker_id, kept.path, kept.load_tokens) == ("w0", RoutingPath.PREFIX_MATCH, 300)
    misses = [stats("w0", tokens_to_compute=0), stats("w1", tokens_to_compute=4000, kv_tokens_used=200)]
    spilled = choose_worker({"w1": 30}, misses, config, random.Random(0))
    assert (spilled.worker_id, spilled.path) == ("w0", RoutingPath.PREFIX_IMBALANCED)
