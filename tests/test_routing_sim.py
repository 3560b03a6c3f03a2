"""load_tests/routing_sim.py: the real router policy, prefix index and worker scheduler / KV
manager driven by simulated engines. Simulated time, seeded: the outcome is deterministic."""

from __future__ import annotations

import pytest

from kvmesh.load_tests.routing_sim import CostModel, SimCluster, SimWorkload, markdown_table, simulate

# Six families of a 10-block prefix, one of them 31% of the traffic; each worker's pool holds
# about three prefixes: the shape, scaled down to run in a fraction of a second.
CLUSTER = SimCluster(num_workers=2, num_blocks=40, block_size=16, max_num_seqs=4)
WORKLOAD = SimWorkload(family_weights=(31, 18, 15, 13, 12, 11), prefix_tokens=160, question_tokens=(4, 12),
                       max_tokens=4, num_requests=60, concurrency=4)


def test_every_request_is_served_and_prefix_aware_beats_round_robin_under_cache_pressure():
    prefix = simulate("prefix_aware", CLUSTER, WORKLOAD)
    robin = simulate("round_robin", CLUSTER, WORKLOAD)
    assert prefix.num_requests == robin.num_requests == WORKLOAD.num_requests
    assert prefix.hit_rate > robin.hit_rate
    assert prefix.families_on_more_than_one < robin.families_on_more_than_one == 6
    # Tokens computed are what the workers' prefix caches did not save: fewer under affinity.
    assert sum(prefix.computed_tokens_per_worker.values()) < sum(robin.computed_tokens_per_worker.values())
    table = markdown_table([prefix, robin])
    assert "prefix_aware" in table and "round_robin" in table


def test_step_time_follows_the_cost_model_and_open_loop_arrivals_run():
    cost = CostModel(step_overhead_s=0.0, prefill_s_per_token=0.001, decode_s_per_token=0.0)
    one = SimWorkload(num_families=1, prefix_tokens=160, question_tokens=(8, 8), max_tokens=1, num_requests=1,
                      concurrency=1)
    result = simulate("round_robin", SimCluster(num_workers=1, num_blocks=40, cost=cost), one)
    # 168 prompt tokens in one prefill step at 1 ms each; the first token comes with it.
    assert abs(result.ttft_p50_ms - 168.0) < 1e-6
    open_loop = simulate("prefix_aware", CLUSTER, SimWorkload(**{**WORKLOAD.__dict__, "qps": 20.0}))
    assert open_loop.num_requests == WORKLOAD.num_requests and open_loop.load == "20 qps"


def test_replaying_the_campaign_sends_its_exact_requests():
    from pathlib import Path

    from kvmesh.load_tests.routing_sim import replay_campaign
    from kvmesh.core.config import RouterConfig

    spec = Path(__file__).resolve().parents[1] / "load_tests" / "campaigns" / "routing-under-load.yaml"
    results = replay_campaign(str(spec), CostModel(), RouterConfig(), concurrency=[1], num_requests=6)
    assert [(r.policy, r.load, r.num_requests) for r in results] == [
        ("predicted_latency", "1 in flight", 6), ("prefix_aware", "1 in flight", 6), ("round_robin", "1 in flight", 6)]


def test_the_oracle_hit_rate_bounds_every_policy_and_counts_only_repeated_full_blocks():
    from kvmesh.load_tests.routing_campaign import oracle_hit_rate

    family_a, family_b = list(range(1000, 1032)), list(range(2000, 2032))  # two 2-block prefixes
    prompts = [family_a + [1] * 8, family_a + [2] * 8, family_b + [3] * 8, family_a[:16] + [4] * 24]
    # The first of each family misses; the second A hits both blocks, the last only block 0.
    assert oracle_hit_rate(prompts, 16) == (32 + 16) / (40 * 4)
    # A prompt that is all prefix still computes its last token: its last block cannot hit.
    assert oracle_hit_rate([family_a, family_a], 16) == 16 / 64
    for policy in ("prefix_aware", "round_robin"):
        result = simulate(policy, CLUSTER, WORKLOAD)
        assert 0 < result.hit_rate <= result.oracle_hit_rate < 1


def test_a_warm_up_sends_its_requests_one_at_a_time_before_the_closed_loop_starts():
    warm = SimWorkload(**{**WORKLOAD.__dict__, "num_requests": 12, "warm_up": 12, "concurrency": 4})
    result = simulate("prefix_aware", CLUSTER, warm)
    assert result.num_requests == 12
    # Each request is sent two polls after the previous one ended: never two at once.
    assert result.sim_duration_s >= 11 * 2 * CLUSTER.stats_refresh_s
    assert result.spills_router == result.spills_worker_refused == 0


def test_predicted_latency_runs_the_router_s_own_state_and_reports_its_ttft_prediction_error():
    """The simulator routes predicted_latency with the router's PredictedLatencyState (its
    step-cost model set to the engines'), and learns predicted vs actual TTFT as router_core does."""
    result = simulate("predicted_latency", CLUSTER, WORKLOAD)
    robin = simulate("round_robin", CLUSTER, WORKLOAD)
    assert result.num_requests == WORKLOAD.num_requests
    assert result.hit_rate >= 0.95 * result.oracle_hit_rate and result.families_on_more_than_one == 0
    assert result.ttft_p50_ms < robin.ttft_p50_ms
    assert sum(result.routing_paths.values()) == WORKLOAD.num_requests
    assert 0 < result.ttft_prediction_error < 10 and 0.1 < result.ttft_prediction_factor < 10
    assert robin.ttft_prediction_error == 0.0  # round robin predicts nothing


def test_two_router_replicas_split_families_on_their_own_and_agree_through_the_shared_claims():
    """Two simulated router replicas (each its own index, admission view, state and queue,
    polling out of phase), the two-replica campaign's shape: placing new families each by its
    own view they put one family on both workers; with the shared claims they agree, and the
    claims' live-family room keeps a fourth family off a worker whose cache holds three."""
    cluster = SimCluster(2, 128, 16, 8, 512, 0.5)
    for seed, concurrency in ((1, 4), (0, 16), (3, 4)):
        workload = SimWorkload(num_families=6, family_weights=(31, 18, 15, 13, 12, 11), prefix_tokens=528,
                               question_tokens=(12, 24), max_tokens=8, num_requests=64, concurrency=concurrency,
                               seed=seed)
        alone = simulate("predicted_latency", cluster, workload, num_routers=2, claims_ttl_s=None)
        agreed = simulate("predicted_latency", cluster, workload, num_routers=2, claims_ttl_s=10.0)
        assert agreed.num_requests == alone.num_requests == 64 and agreed.num_routers == 2
        assert agreed.families_on_more_than_one == 0, (seed, concurrency)
        assert agreed.hit_rate == pytest.approx(agreed.oracle_hit_rate, abs=1e-9), (seed, concurrency)
        if seed != 3:  # the runs where the replicas' own views split a family
            assert alone.families_on_more_than_one > 0, (seed, concurrency)
