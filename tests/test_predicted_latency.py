"""The predicted-latency policy on its own: the TTFT prediction (router/latency.py), hot
families spreading over a bounded, deterministic set of workers and returning to one
(router/hot_spread.py, with an injected clock), new prefixes placed by recent work."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from kvmesh.core.config import RouterConfig
from kvmesh.core.seams import WorkerStats
from kvmesh.router.hot_spread import FamilySpread, WorkMeter, preference_order
from kvmesh.router.latency import StepCostModel, TtftCalibration, predict_ttft_s, uncached_prompt_tokens
from kvmesh.router.routing import (PredictedLatencyState, RouteRequest, RoutingDecision, RoutingPath, choose_worker,
                                   family_key)

BLOCK = 16
COST = StepCostModel(step_overhead_s=0.004, prefill_s_per_token=0.0004, decode_s_per_token=0.0025)
CONFIG = RouterConfig(policy="predicted_latency", imbalance_ratio=1.5, imbalance_abs_tokens=1000,
                      imbalance_margin_requests=0, spread_cooldown_s=10.0, work_half_life_s=30.0)
KEY = b"family-a"
PROMPT = 1000  # tokens: 62 full blocks + 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stats(worker_id: str, tokens_to_compute: int = 0, num_running: int = 0) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=BLOCK, num_blocks_total=1000,
                       num_blocks_used=0, num_blocks_cached=0, num_blocks_free=1000, kv_tokens_used=0,
                       kv_tokens_capacity=16000, kv_tokens_reserved=0, num_running=num_running, num_waiting=0,
                       queued_prompt_tokens=0, prefix_cache_hit_rate=0.0, output_tokens_per_s=100.0,
                       tokens_to_compute=tokens_to_compute)


def route(state, matched, workers, key=KEY, commit=True, config=CONFIG):
    request = RouteRequest(PROMPT, BLOCK, key)
    decision = choose_worker(matched, workers, config, random.Random(0), request=request, state=state)
    if commit:
        state.commit(decision, PROMPT - min(matched.get(decision.worker_id, 0) * BLOCK, PROMPT - 1))
    return decision


def test_the_prediction_is_the_work_ahead_plus_the_uncached_prompt_at_the_step_cost():
    # 1,500 tokens ahead + 1,000 - 62 x 16 = 8 uncached, 4 decoding: 1,508 tokens in
    # ceil(1508 / (512 - 4)) = 3 steps of 4 ms + 4 x 2.5 ms.
    uncached = uncached_prompt_tokens(PROMPT, 62, BLOCK)
    assert uncached == 8
    predicted = predict_ttft_s(COST, stats("w0", 1000, num_running=4), 500, uncached, 512)
    assert predicted == pytest.approx(1508 * 0.0004 + 3 * (0.004 + 4 * 0.0025))
    # A whole match still computes the last prompt token.
    assert uncached_prompt_tokens(64, 4, BLOCK) == 1


def test_the_calibration_learns_actual_over_predicted_and_reports_the_error():
    calibration = TtftCalibration(weight=0.5)
    assert calibration.factor == 1.0 and calibration.mean_abs_relative_error() == 0.0
    for _ in range(40):
        calibration.observe(0.1, 0.2)  # the workers are twice as slow as modelled
    assert calibration.factor == pytest.approx(2.0, rel=1e-6)
    assert calibration.calibrated_s(0.3) == pytest.approx(0.6, rel=1e-6)
    assert calibration.mean_abs_relative_error() == pytest.approx(0.5)


def test_a_request_goes_to_the_holder_of_its_prefix_with_the_lowest_prediction():
    state = PredictedLatencyState(CONFIG, 512, Clock())
    workers = [stats("w0", 200), stats("w1", 100), stats("w2", 0)]
    decision = route(state, {"w0": 62, "w1": 62}, workers)
    assert (decision.worker_id, decision.path, decision.matched_blocks) == ("w1", RoutingPath.PREFIX_MATCH, 62)
    assert decision.predicted_ttft_s == pytest.approx(predict_ttft_s(COST, workers[1], 0, 8, 512))
    with pytest.raises(ValueError, match="RouteRequest"):
        choose_worker({}, workers, CONFIG, random.Random(0))


def test_a_new_prefix_goes_where_less_recent_work_went_among_workers_that_predict_alike():
    clock = Clock()
    state = PredictedLatencyState(CONFIG, 512, clock)
    workers = [stats("w0"), stats("w1"), stats("w2", 5000)]
    placed = []
    for i in range(4):
        decision = route(state, {}, workers, key=f"new-{i}".encode())
        placed.append(decision.worker_id)
        clock.now += 1.0
    # w2 is busy (its prediction is far above the others); w0 and w1 alternate by recent work.
    assert decision.path is RoutingPath.NO_PREFIX
    assert "w2" not in placed and sorted(placed) == ["w0", "w0", "w1", "w1"]


def test_with_several_replicas_a_new_family_goes_to_the_first_worker_of_its_order_within_the_bound():
    config = dataclasses.replace(CONFIG, num_replicas=2)
    state = PredictedLatencyState(config, 512, Clock())
    ids = ["w0", "w1", "w2", "w3"]
    for i in range(8):
        key = f"new-{i}".encode()
        order = preference_order(key, ids)
        # its first worker queues far ahead (out of the load guard's bound); the second stored
        # far more blocks than the least busy (past the deadband): the third takes it
        state.observe_stored(order[1], 300)
        workers = [stats(w, 5000 if w == order[0] else 0) for w in ids]
        decision = route(state, {}, workers, key=key, commit=False, config=config)
        assert (decision.worker_id, decision.path) == (order[2], RoutingPath.NO_PREFIX)
        state.stored_blocks.forget(order[1])
    # a worker whose cache holds far more than the others' is passed over
    full = dataclasses.replace(stats("w0"), num_blocks_used=990)
    key = next(f"room-{i}".encode() for i in range(100) if preference_order(f"room-{i}".encode(), ids)[0] == "w0")
    assert route(state, {}, [full] + [stats(w) for w in ids[1:]], key=key, commit=False, config=config).worker_id \
        == preference_order(key, ids)[1]


def test_two_router_replicas_send_a_new_familys_first_requests_to_the_same_worker():
    """Each replica has its own recent work (the requests it sent) and in-flight tokens; both
    place each new family on the first worker of its rendezvous order, where the least recent
    work of each replica's own sent them to different workers, and so did the load guard
    counting each one's own in-flight tokens."""
    ids = ["w0", "w1", "w2", "w3"]
    workers = [stats(w) for w in ids]
    config = dataclasses.replace(CONFIG, num_replicas=2)
    replicas = [PredictedLatencyState(config, 512, Clock()) for _ in range(2)]
    replicas[0].work.observe("w0", 600)  # one replica sent w0 a request, the other w1 and w2
    replicas[1].work.observe("w1", 900)
    replicas[1].work.observe("w2", 300)
    # each one's own burst of tickets puts a different worker past the load guard's margin
    in_flight = [{"w0": 2600}, {"w1": 1500, "w2": 300}]
    for i in range(16):
        key = f"family-{i}".encode()
        request = RouteRequest(PROMPT, BLOCK, key)
        chosen = {choose_worker({}, workers, config, random.Random(r), extra_load_tokens=in_flight[r],
                                request=request, state=replicas[r]).worker_id for r in range(2)}
        assert chosen == {preference_order(key, ids)[0]}


def test_a_hot_family_grows_onto_the_first_worker_of_its_order_within_the_bound():
    state = PredictedLatencyState(CONFIG, 512, Clock())
    state.family_hit_work.observe(KEY, 10_000)  # its recent cache hits: a second copy of its prefix pays
    order = preference_order(KEY, ["w0", "w1", "w2", "w3"])
    home, first, second = order[3], order[0], order[1]
    # The home's queue runs ahead (3,000 vs 0: ratio and margin); the family's first choice
    # is itself loaded past the bound, so the walk takes the next one.
    loads = {home: 3000, first: 2500, second: 0}
    workers = [stats(w, loads.get(w, 0)) for w in order]
    decision = route(state, {home: 62}, workers)
    assert (decision.worker_id, decision.path) == (second, RoutingPath.PREFIX_SPREAD)
    assert decision.spread.members == (home, second)
    # Deterministic: a second replica (its own state) with the same view picks the same worker.
    other = PredictedLatencyState(CONFIG, 512, Clock())
    other.family_hit_work.observe(KEY, 10_000)
    assert route(other, {home: 62}, workers, commit=False).worker_id == second
    # The family now routes between its two members by prediction, the newcomer holding it too.
    decision = route(state, {home: 62, second: 62}, [stats(w, loads.get(w, 0)) for w in order])
    assert decision.worker_id == second and decision.path is RoutingPath.PREFIX_MATCH


def test_a_family_does_not_spread_when_the_bounded_worker_would_not_serve_it_sooner():
    state = PredictedLatencyState(CONFIG, 512, Clock())
    order = preference_order(KEY, ["w0", "w1", "w2"])
    # The home runs ahead of the idle worker (1,500 vs 0), but the family's first worker within
    # the bound has 900 tokens queued and would compute the whole 1,000-token prompt: 1,900
    # tokens against 1,508 at home. The walk stops there (the idle worker is further down).
    workers = [stats(order[0], 900), stats(order[1], 0), stats(order[2], 1500)]
    decision = route(state, {order[2]: 62}, workers)
    assert (decision.worker_id, decision.path) == (order[2], RoutingPath.PREFIX_MATCH)
    assert state.spread.members(KEY) == ()


def test_a_family_grows_for_queue_only_when_its_worker_is_a_hot_spot_not_when_one_worker_idles():
    """Past capacity every worker queues; one that has just emptied is not a reason to copy a
    prefix there: the family's best worker must run ahead of the mean load, not the minimum."""
    state = PredictedLatencyState(CONFIG, 512, Clock())
    state.family_hit_work.observe(KEY, 10_000)  # a second copy would pay for itself
    order = preference_order(KEY, ["w0", "w1", "w2", "w3"])
    home, idle = order[3], order[2]
    saturated = [stats(w, 0 if w == idle else 3000) for w in order]  # mean 2,250: home 1.33x
    decision = route(state, {home: 62}, saturated)
    assert (decision.worker_id, decision.path) == (home, RoutingPath.PREFIX_MATCH)
    hot_spot = [stats(w, {home: 3000, idle: 0}.get(w, 1000)) for w in order]  # mean 1,250: 2.4x
    decision = route(state, {home: 62}, hot_spot)
    assert decision.path is RoutingPath.PREFIX_SPREAD and decision.worker_id != home


def test_a_family_with_little_traffic_waits_at_home_rather_than_copy_its_prefix():
    """Its worker's queue runs ahead and an idle worker would serve this request sooner, but
    the family's recent cache hits (1,500 tokens, 750 a worker after growing) are less than the
    992-token prefix the newcomer would compute: a second copy would cost more than it moves."""
    state = PredictedLatencyState(CONFIG, 512, Clock())
    state.family_hit_work.observe(KEY, 1500)
    order = preference_order(KEY, ["w0", "w1", "w2"])
    home = order[2]
    decision = route(state, {home: 62}, [stats(home, 3000), stats(order[0]), stats(order[1])])
    assert (decision.worker_id, decision.path) == (home, RoutingPath.PREFIX_MATCH)
    state.family_hit_work.observe(KEY, 500)  # 2,000 tokens: 1,000 a worker, more than the prefix
    decision = route(state, {home: 62}, [stats(home, 3000), stats(order[0]), stats(order[1])])
    assert (decision.worker_id, decision.path) == (order[0], RoutingPath.PREFIX_SPREAD)


def test_a_young_familys_hits_count_at_the_rate_they_came_not_as_the_few_seconds_they_add_up_to():
    """1,200 tokens of cache hits pay for no second copy of a 992-token prefix from a family
    seen for 100 s (1,330 at its steady rate, 665 a worker), but do from one seen for 2 s:
    judged over at least the 10 s cooldown, they are the start of 5,800 (2,900 a worker)."""
    def family_seen_for(age_s):
        clock = Clock()
        state = PredictedLatencyState(CONFIG, 512, clock)
        state.family_work.observe(KEY, PROMPT)  # its first request, which computed the prefix
        clock.now += age_s
        state.family_hit_work.observe(KEY, 1200)
        return state

    order = preference_order(KEY, ["w0", "w1", "w2"])
    home = order[2]
    hot = [stats(home, 3000), stats(order[0]), stats(order[1])]
    old, young = family_seen_for(100.0), family_seen_for(2.0)
    assert old.movable_work(KEY) == pytest.approx(1200 / (1 - 2 ** (-100 / 30)))
    assert young.movable_work(KEY) == pytest.approx(1200 / (1 - 2 ** (-10 / 30)))
    assert route(old, {home: 62}, hot).path is RoutingPath.PREFIX_MATCH
    decision = route(young, {home: 62}, hot)
    assert (decision.worker_id, decision.path) == (order[0], RoutingPath.PREFIX_SPREAD)


def test_a_spread_family_returns_to_one_worker_only_after_the_cooldown_without_need():
    clock = Clock()
    state = PredictedLatencyState(CONFIG, 512, clock)
    state.family_hit_work.observe(KEY, 10_000)
    order = preference_order(KEY, ["w0", "w1", "w2"])
    home = order[2]
    hot = [stats(home, 3000), stats(order[0], 0), stats(order[1], 0)]
    assert route(state, {home: 62}, hot).path is RoutingPath.PREFIX_SPREAD
    members = state.spread.members(KEY)
    assert members == (home, order[0])
    # Still hot: the home alone would run ahead, so the newcomer stays however long it lasts.
    for _ in range(5):
        clock.now += 6.0
        route(state, {home: 62, order[0]: 62}, hot)
        assert state.spread.members(KEY) == members
    # The heat passes: one quiet request does not shrink it before the cooldown (no flapping).
    cool = [stats(w) for w in order]
    clock.now += 6.0
    route(state, {home: 62, order[0]: 62}, cool)
    assert state.spread.members(KEY) == members
    clock.now += 4.0  # 10 s since it was last needed
    assert state.spread.members(KEY) == (home,)
    decision = route(state, {home: 62, order[0]: 62}, cool)
    assert (decision.worker_id, decision.path) == (home, RoutingPath.PREFIX_MATCH)


def test_a_family_whose_worker_computes_far_more_than_the_mean_spreads_before_anyone_queues():
    clock = Clock()
    state = PredictedLatencyState(CONFIG, 512, clock)
    ids = ["w0", "w1", "w2", "w3"]
    home = preference_order(KEY, ids)[3]
    idle = [stats(w) for w in ids]
    for _ in range(3):  # the home's recent work, all of it this family's cache hits: 3,000 vs a mean of 750
        state.work.observe(home, 1000)
        state.family_work.observe(KEY, 1000)
        state.family_hit_work.observe(KEY, 1000)
    decision = route(state, {home: 62}, idle)
    assert decision.path is RoutingPath.PREFIX_SPREAD and decision.spread.cause == "work"
    assert decision.spread.members[0] == home
    # The family's work, carried by its home alone, keeps the second worker needed.
    clock.now += 5.0
    second = decision.worker_id
    decision = route(state, {home: 62, second: 62}, idle)  # the newcomer holds the prefix now
    assert decision.path is RoutingPath.PREFIX_MATCH and decision.spread.needed
    assert len(state.spread.members(KEY)) == 2
    # A family quiet for longer than the cooldown comes back narrower; still hot, it grows
    # again onto the same worker (whose cache may still hold it).
    clock.now += 20.0
    again = route(state, {home: 62, second: 62}, idle)
    assert again.path is RoutingPath.PREFIX_SPREAD and again.spread.members == decision.spread.members


def test_a_family_on_a_worker_busy_with_other_families_stays_home():
    """The worker's recent work runs ahead, but not because of this family (a few cache hits
    against other families' prefixes computed there): spreading would only recompute its prefix
    elsewhere, so it stays, and new prefixes steer around that worker instead."""
    state = PredictedLatencyState(CONFIG, 512, Clock())
    ids = ["w0", "w1", "w2", "w3"]
    home = preference_order(KEY, ids)[3]
    state.work.observe(home, 3000)  # other families' prefixes
    state.family_work.observe(KEY, 200)
    idle = [stats(w) for w in ids]
    decision = route(state, {home: 62}, idle)
    assert (decision.worker_id, decision.path) == (home, RoutingPath.PREFIX_MATCH)
    assert state.spread.members(KEY) == ()
    assert route(state, {}, idle, key=b"family-b").worker_id != home


def test_spread_state_and_recent_work_are_bounded_and_decay():
    clock = Clock()
    spread = FamilySpread(cooldown_s=1.0, clock=clock, max_families=2)
    from kvmesh.router.hot_spread import SpreadAction

    for key in (b"a", b"b", b"c"):
        spread.apply(SpreadAction(key, ("w0", "w1"), True, False))
    assert spread.members(b"a") == () and spread.members(b"c") == ("w0", "w1") and spread.num_spread() == 2
    meter = WorkMeter(half_life_s=10.0, clock=clock)
    meter.observe("w0", 1000)
    clock.now += 10.0
    assert meter.value("w0") == pytest.approx(500.0) and meter.value("w9") == 0.0
    # Per family: the least recently observed key goes first, and the total follows.
    families = WorkMeter(half_life_s=10.0, clock=clock, max_keys=2)
    for key, tokens in ((b"a", 100), (b"b", 200), (b"a", 100), (b"c", 400)):
        families.observe(key, tokens)
    assert families.value(b"b") == 0.0 and families.value(b"a") == pytest.approx(200.0)
    assert families.total() == pytest.approx(600.0)
    # ... and its age with it (a key seen again starts young)
    assert families.age_s(b"b") is None and families.age_s(b"a") == 0.0
    clock.now += 3.0
    assert families.age_s(b"c") == 3.0
    # A family's work counts every ticket; the work that would move only its cache hits (its
    # prefix, computed once, would not).
    state = PredictedLatencyState(CONFIG, 512, clock)
    route(state, {}, [stats("w0"), stats("w1")])
    assert state.family_work.value(KEY) == pytest.approx(1000.0) and state.family_hit_work.value(KEY) == 0.0
    route(state, {"w0": 62, "w1": 62}, [stats("w0"), stats("w1")])
    assert state.family_work.value(KEY) == pytest.approx(1008.0)
    assert state.family_hit_work.value(KEY) == pytest.approx(8.0)


def test_the_family_key_covers_the_first_blocks_and_the_config_is_validated():
    hashes = [bytes([i]) * 8 for i in range(5)]
    assert family_key(hashes, 3) == hashes[2] and family_key(hashes, 16) == hashes[4] and family_key([], 3) is None
    with pytest.raises(ValueError, match="spread_family_blocks"):
        dataclasses.replace(CONFIG, spread_family_blocks=0).validate()
    assert not math.isnan(CONFIG.latency_tie_ratio)


def test_with_several_replicas_recent_work_is_what_the_workers_stored_as_every_replica_hears_it():
    """Two replicas whose own tickets disagree (each sent the other worker more) both see, in
    the prefix events, that the first worker of the family's order computed far more: both
    pass it over for the second."""
    config = dataclasses.replace(CONFIG, num_replicas=2)
    ids = ["w0", "w1", "w2"]
    key = b"family-b"
    first, second = preference_order(key, ids)[:2]
    replicas = [PredictedLatencyState(config, 512, Clock()) for _ in range(2)]
    replicas[0].work.observe(second, 9000)
    replicas[1].work.observe(ids[0] if ids[0] != first else ids[2], 9000)
    for state in replicas:
        state.observe_stored(first, 400)  # 6,400 tokens of prefix computed there, as the events say
    request = RouteRequest(PROMPT, BLOCK, key)
    workers = [stats(w) for w in ids]
    assert {choose_worker({}, workers, config, random.Random(0), request=request, state=s).worker_id
            for s in replicas} == {second}


def test_a_new_family_goes_where_its_prefix_fits_beside_the_families_in_use_not_into_a_full_cache():
    """One replica, caches full of an earlier workload's blocks (the footprint then says
    nothing): each worker holds three 33-block prompts in 128 blocks. Three families in use on
    w0, one on w1; a fourth new family goes to w1 although w0 is predicted sooner, where before
    it took w0 and each of its requests evicted another family's prefix there."""
    clock = Clock()
    state = PredictedLatencyState(CONFIG, 512, clock)
    full = {"num_blocks_total": 128, "num_blocks_cached": 128, "num_blocks_free": 0}
    workers = [dataclasses.replace(stats("w0"), **full), dataclasses.replace(stats("w1", tokens_to_compute=300), **full)]
    prompt = 33 * BLOCK + 10

    def place(key: bytes) -> str:
        decision = choose_worker({}, workers, CONFIG, random.Random(0), request=RouteRequest(prompt, BLOCK, key),
                                 state=state)
        state.commit(decision, prompt, prompt // BLOCK)
        return decision.worker_id

    for key in (b"f0", b"f1", b"f2"):
        state.commit(RoutingDecision("w0", 0, RoutingPath.NO_PREFIX, 0, family_key=key), prompt, prompt // BLOCK)
    state.commit(RoutingDecision("w1", 0, RoutingPath.NO_PREFIX, 0, family_key=b"f3"), prompt, prompt // BLOCK)
    assert place(b"f4") == "w1"  # w0 sooner (300 tokens less queued), but three in use fill it
    clock.now += 120.0  # the three went quiet: their blocks are evictable, w0 takes new families again
    assert place(b"f5") == "w0"



def test_a_claim_proposal_weighs_the_work_every_replica_hears_not_its_own_dispatches():
    """Proposing a new family's claim, a replica places by the blocks the workers stored (the
    prefix events every replica hears) plus what it sent that no report holds yet; placing on
    its own, by its own recent work. Its own work said w1 was idle, the events that w1 computed
    most (the other replica's families)."""
    config = dataclasses.replace(CONFIG, num_replicas=2, latency_tie_ratio=10.0)
    state = PredictedLatencyState(config, 512, Clock())
    state.work.observe("w0", 9000)
    state.observe_stored("w1", 900)
    workers = [stats("w0"), stats("w1")]
    own = dataclasses.replace(config, num_replicas=1)  # the proposal's rule is the one-replica one
    request = RouteRequest(PROMPT, BLOCK, b"family-new")
    assert choose_worker({}, workers, own, random.Random(0), request=request, state=state).worker_id == "w1"
    proposing = dataclasses.replace(request, proposing_claim=True)
    assert choose_worker({}, workers, own, random.Random(0), request=proposing, state=state).worker_id == "w0"
    # what it sent w0 since the last report counts there too
    assert choose_worker({}, workers, own, random.Random(0), extra_load_tokens={"w0": 20_000}, request=proposing,
                         state=state).worker_id == "w1"


def test_with_several_replicas_a_replicas_own_dispatches_count_for_the_share_of_traffic_it_sees():
    """Each of two replicas sends about half the requests: its recent-work meters count each
    ticket twice, so the spreading rule's absolute bounds read the cluster's work."""
    for replicas in (1, 2):
        state = PredictedLatencyState(dataclasses.replace(CONFIG, num_replicas=replicas), 512, Clock())
        state.commit(RoutingDecision("w0", 62, RoutingPath.PREFIX_MATCH, 0, 0.1, None, KEY), 100)
        assert state.work.value("w0") == pytest.approx(100 * replicas)
        assert state.family_work.value(KEY) == pytest.approx(100 * replicas)
        assert state.family_hit_work.value(KEY) == pytest.approx(100 * replicas)
