"""Smoke campaigns (seconds) against the real in-process AsyncEngine and the HF static-batch
peer, on a tiny random Llama with a tokenizer trained on the bundled corpus."""

import asyncio
import importlib.util
from pathlib import Path

import pytest

from e2e_cluster import shared_ray
from kvmesh.load_tests.campaign import parse_campaign, run_campaign
from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("kvmesh.worker.runtime.async_engine") is None,
                       reason="kvmesh.worker.runtime.async_engine (the in-process engine) is not available"),
]


CONSTRAINTS = str(Path(__file__).resolve().parents[1] / "load_tests" / "data" / "structured-constraints.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model_dir, tokenizer): a 2-layer random Llama whose vocabulary is the corpus BPE."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-load-model")
    tokenizer = train_corpus_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _defaults(model_dir, **overrides):
    base = {
        "config": {"model": {"path": model_dir, "dtype": "fp32"}, "cache": {"block_size": 16, "num_blocks": 128},
                   "scheduler": {"max_num_seqs": 8, "max_new_tokens": 256}, "parallel": {"device": "cpu"}},
        "workload": {"kind": "synthetic", "num_requests": 12, "scale": 0.04, "seed": 1},
        "arrival": {"process": "poisson", "rate": 40, "seed": 1},
        "slo": {"ttft_ms": 60000, "tpot_ms": 60000}, "torch_threads": 1, "sample_interval_s": 0.1,
    }
    base.update(overrides)
    return base


def test_engine_campaign_cancel_storm_prefix_and_peer(tiny, tmp_path):
    model_dir, tokenizer = tiny
    campaign = parse_campaign({
        "name": "smoke",
        "defaults": _defaults(model_dir),
        "runs": [
            {"name": "cancel-storm", "workload": {"cancel_fraction": 0.5}, "retry": {"mode": "backoff"}},
            {"name": "prefix-closed", "arrival": {"process": "closed", "concurrency": 2},
             "workload": {"kind": "shared_prefix", "num_families": 2, "prefix_tokens": 800,
                          "input": {"kind": "fixed", "mean": 4, "p99": None}}},
            # its Poisson rate: half of what prefix-closed completed per second, here
            {"name": "half-of-prefix", "rate_of": {"run": "prefix-closed", "fraction": 0.5},
             "workload": {"num_requests": 4}},
            {"name": "static-4", "target": {"kind": "hf_static", "batch_size": 4}},
            {"name": "hf-continuous", "target": {"kind": "hf_continuous", "max_batch_tokens": 128}},
            {"name": "llama-cpp", "target": {"kind": "llama_cpp"}, "optional": True},
            # LoRA: 3 random adapters (Zipf) through 2 slots: loads, evictions, nothing failed
            {"name": "lora-zipf", "workload": {"adapters": 3, "adapter_rank": 4}, "config": {"lora": {"max_loras": 2}}},
            {"name": "structured", "workload": {  # outputs end with their grammar; 240 is a ceiling
                "num_requests": 6, "scale": 1.0, "constraints_path": CONSTRAINTS,
                "input": {"kind": "fixed", "mean": 8, "p99": None}, "output": {"kind": "fixed", "mean": 240, "p99": None}}},
        ],
        "checks": [{"run": "cancel-storm", "metric": "final.kv_tokens_used", "op": "==", "value": 0},
                   {"run": "structured", "metric": "structured_valid_rate", "op": "==", "value": 1.0}],
    })
    results = run_campaign(campaign, tmp_path, tokenizer=tokenizer, progress=False)
    runs = {r["name"]: r for r in results["runs"]}

    storm = runs["cancel-storm"]
    recs = storm["records"]
    assert len(recs) == 12
    assert storm["summary"]["cancelled"] >= 2 and storm["summary"]["failed"] == 0
    for r in recs:  # ignore_eos: a completed request has exactly its output length
        if r["status"] == "ok":
            assert r["output_tokens"] == r["expected_output_tokens"]
            assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
    assert storm["server_samples"], "the engine's stats are sampled during the run"
    assert storm["final_server_sample"]["kv_tokens_used"] == 0  # every cancelled request freed its KV
    assert storm["final_server_sample"]["num_running"] == 0

    prefix = runs["prefix-closed"]["summary"]
    assert prefix["completed"] == 12
    assert prefix["prefix_cache_hit_rate"] > 0.3  # 32-token family prefixes are reused
    half = runs["half-of-prefix"]
    assert half["arrival"][0]["rate"] == pytest.approx(prefix["request_throughput"] / 2)
    assert half["rate_of"]["achieved_fraction"] == pytest.approx(
        half["summary"]["request_throughput"] / prefix["request_throughput"])
    assert half["summary"]["completed"] == 4

    for peer in ("static-4", "hf-continuous"):  # peers generate the same exact lengths
        summary, records = runs[peer]["summary"], runs[peer]["records"]
        assert summary["completed"] == 12 and summary["ttft"]["count"] == 12
        assert summary["total_output_tokens"] == sum(r["expected_output_tokens"] for r in records)
    lora = runs["lora-zipf"]
    assert lora["summary"]["completed"] == 12 and lora["summary"]["failed"] == 0
    assert lora["final_server_sample"]["num_adapter_loads"] >= 3  # every adapter used was loaded
    if importlib.util.find_spec("llama_cpp") is None:  # optional peer: skipped, and the report says so
        assert [s["name"] for s in results["skipped"]] == ["llama-cpp"]

    # Each constrained output (random weights: valid only because of the masks) is checked
    # against its constraint by the driver: JSON Schemas, a regex, a choice.
    structured = runs["structured"]
    assert structured["summary"]["completed"] == 6 and structured["summary"]["structured_valid_rate"] == 1.0
    assert [r["structured_valid"] for r in structured["records"]] == [True] * 6
    assert all(r["structured_valid"] is None for r in storm["records"])  # free text: not checked
    assert structured["final_server_sample"]["kv_tokens_used"] == 0

    for name in ("results.json", "report.html", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0
    summary_md = (tmp_path / "summary.md").read_text()
    assert "PASS: cancel-storm: final.kv_tokens_used == 0" in summary_md
    assert "PASS: structured: structured_valid_rate == 1" in summary_md
    assert "Run half-of-prefix: offered 0.5 x run prefix-closed's" in summary_md


def test_overload_naive_retries_are_counted(tiny, tmp_path):
    model_dir, tokenizer = tiny
    defaults = _defaults(model_dir)
    defaults["config"]["scheduler"].update(max_num_seqs=1, max_queue_len=1)
    campaign = parse_campaign({
        "name": "overload-smoke", "defaults": defaults,
        "runs": [{"name": "naive", "arrival": {"rate": "inf"}, "retry": {"mode": "naive", "max_attempts": 3}},
                 {"name": "backoff", "arrival": {"rate": "inf"}, "retry": {"mode": "backoff", "max_attempts": 3}},
                 {"name": "no-retry", "arrival": {"rate": "inf"}}],
    })
    results = run_campaign(campaign, tmp_path, tokenizer=tokenizer, progress=False)
    runs = {r["name"]: r["summary"] for r in results["runs"]}
    # A burst of 12 into a queue of 1: refusals are errors without retries ...
    assert runs["no-retry"]["failed"] > 0 and runs["no-retry"]["retries"] == 0
    assert set(runs["no-retry"]["errors_by_code"]) == {"Overloaded"}
    # ... and immediate resends with naive retries (each counted, with its error code).
    assert runs["naive"]["retries"] > 0
    assert set(runs["naive"]["retried_errors_by_code"]) == {"Overloaded"}
    # Shedding is in the headline: refused requests / offered.
    assert runs["no-retry"]["shed_rate"] == pytest.approx(runs["no-retry"]["failed"] / 12)
    # Naive resends ignore the advertised retry-after, so they cannot judge it; backoff waits
    # at least that long, and each of its retries records the advice and the wait.
    assert runs["naive"]["retry_after_accuracy"] is None
    backoff = next(r for r in results["runs"] if r["name"] == "backoff")
    retried = [r for r in backoff["records"] if r["attempts"] > 1]
    assert retried and all(len(r["retry_after_s"]) == len(r["retry_delay_s"]) == r["attempts"] - 1 for r in retried)
    assert all(w >= a for r in retried for a, w in zip(r["retry_after_s"], r["retry_delay_s"]))
    assert 0.0 <= backoff["summary"]["retry_after_accuracy"] <= 1.0


def test_cli_runs_a_campaign_file_with_a_trace_replay(tiny, tmp_path):
    import yaml

    from kvmesh.deploy.cli import main

    model_dir, tokenizer = tiny
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.0, "tenant": "a", "prompt_tokens": 9, "output_tokens": 5}\n'
                     '{"arrival_s": 0.2, "tenant": "b", "prompt": "Call me Ishmael.", "output_tokens": 3}\n')
    tokenizer.save_pretrained(tmp_path / "tok")
    spec = {"name": "cli-smoke", "tokenizer": {"path": model_dir},
            "defaults": _defaults(model_dir, workload={"kind": "trace", "trace_path": str(trace)},
                                  arrival={"process": "trace"}),
            "runs": [{"name": "replay"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["load", "run", str(path), "--out", str(out), "--no-progress"]) == 0
    recs = __import__("json").loads((out / "results.json").read_text())["runs"][0]["records"]
    assert [(r["tenant_id"], r["output_tokens"]) for r in recs] == [("a", 5), ("b", 3)]


class VirtualClock:
    """The run's time: it moves only when the driver sleeps (one stream: sleeps never overlap)."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # let tasks created before this sleep start at the current time
        self.now_s += max(0.0, seconds)


def test_trace_requests_are_sent_at_their_offsets(tiny):
    from kvmesh.load_tests.arrivals import ArrivalSpec
    from kvmesh.load_tests.corpus import TokenCorpus
    from kvmesh.load_tests.driver import DriverRetryPolicy, RunDriver, TenantStream
    from kvmesh.load_tests.targets import EngineTarget
    from kvmesh.load_tests.workloads import WorkloadRequest

    model_dir, tokenizer = tiny
    ids = tuple(TokenCorpus(tokenizer).encode("Call me Ishmael."))
    requests = tuple(WorkloadRequest(index=i, prompt_token_ids=ids, prompt_text="Call me Ishmael.", output_tokens=3,
                                     arrival_offset_s=offset) for i, offset in enumerate((0.0, 0.2, 1.5)))
    clock = VirtualClock()

    async def scenario():
        target = EngineTarget(_defaults(model_dir)["config"])
        await target.start()
        try:
            driver = RunDriver(target, DriverRetryPolicy("none"), progress=False, clock=clock, sleep=clock.sleep)
            return await driver.run([TenantStream(requests, ArrivalSpec("trace"))])
        finally:
            await target.close()

    result = asyncio.run(scenario())
    assert [(r.index, r.send_s, r.status) for r in result.records] == [(0, 0.0, "ok"), (1, 0.2, "ok"), (2, 1.5, "ok")]


@pytest.mark.e2e
@pytest.mark.shared_ray
def test_cluster_target_over_grpc_and_openai_http(tiny, tmp_path):
    """A real 1-worker cluster (Ray Serve): the grpc target (client library) and the http
    target (OpenAI SSE + /metrics scrape) measure the same exact-length requests."""
    import asyncio
    import os

    import ray

    from kvmesh.load_tests.arrivals import ArrivalSpec
    from kvmesh.load_tests.corpus import TokenCorpus
    from kvmesh.load_tests.driver import DriverRetryPolicy, RunDriver, TenantStream
    from kvmesh.load_tests.grpc_target import ClusterTarget
    from kvmesh.load_tests.metrics import summarize
    from kvmesh.load_tests.targets import OpenAIHttpTarget
    from kvmesh.load_tests.workloads import LengthDistribution, WorkloadSpec, generate_workload

    model_dir, tokenizer = tiny
    config = _defaults(model_dir)["config"]
    config["parallel"].update(num_workers=1, worker_num_cpus=0.5)
    config["router"] = {"host": "127.0.0.1", "stats_refresh_s": 0.1}
    requests = tuple(generate_workload(WorkloadSpec(num_requests=6, scale=0.04, seed=3), TokenCorpus(tokenizer)))
    # structured output through the router: gRPC's proto field, HTTP's structured_outputs
    constrained = tuple(generate_workload(WorkloadSpec(
        num_requests=6, seed=4, input=LengthDistribution("fixed", 8, None), output=LengthDistribution("fixed", 240, None),
        constraints_path=CONSTRAINTS), TokenCorpus(tokenizer)))

    async def drive(target, requests=requests):
        return await RunDriver(target, DriverRetryPolicy("backoff", max_attempts=5), progress=False,
                               sample_interval_s=0.1).run([TenantStream(requests, ArrivalSpec("poisson", rate=20, seed=3))])

    async def scenario():
        cluster = ClusterTarget(config, app_name="kvmesh-load-smoke")
        await cluster.start()
        try:
            grpc_result = await drive(cluster)
            structured = [await drive(cluster, constrained)]
            router = cluster.config.router
            http = OpenAIHttpTarget(f"http://127.0.0.1:{router.http_port}",
                                    metrics_url=f"http://127.0.0.1:{router.http_port}/metrics")
            await http.start()
            try:
                http_result = await drive(http)
                structured.append(await drive(http, constrained))
            finally:
                await http.close()
        finally:
            await cluster.close()
        return grpc_result, http_result, structured

    shared_ray()
    grpc_result, http_result, structured = asyncio.run(scenario())
    expected = sum(r.output_tokens for r in requests)
    for result in (grpc_result, http_result):
        summary = summarize(result.records)
        assert summary.completed == 6 and summary.failed == 0
        assert summary.total_output_tokens == expected  # exact lengths through the router
        assert summary.ttft.count == 6
    assert any("num_running" in s for s in grpc_result.server_samples)  # GetStats samples
    assert grpc_result.final_server_sample["kv_tokens_used"] == 0
    assert any("kv_usage" in s for s in http_result.server_samples)  # parsed from /metrics
    for result in structured:  # gRPC, then HTTP: every output meets its constraint
        summary = summarize(result.records)
        assert summary.completed == 6 and summary.structured_valid_rate == 1.0
