"""Campaigns: a YAML list of runs (target + config overrides + workload + arrival), executed
one after another against fresh targets, written to a result directory.

    name: seed-table
    description: the article's batching table, scaled to a CPU
    tokenizer: {}                 # a ModelConfig for the workload tokenizer; {} = defaults.config.model
    defaults:                     # deep-merged under every run
      target: {kind: engine}      # engine|http|grpc|cluster|hf_static|hf_continuous|llama_cpp (+ options)
      config: {scheduler: {max_num_seqs: 16}}     # KvmeshConfig overrides (engine / peers)
      workload: {kind: synthetic, num_requests: 32, scale: 0.05, seed: 0}
      arrival: {process: poisson, rate: 2.0, seed: 0}   # rate: [1, 2, 4] = a sweep
      retry: {mode: none}
      slo: {ttft_ms: 2000, tpot_ms: 250}
      warmup_requests: 1          # sent before the measured run, not recorded
      torch_threads: 1            # in-process targets: torch intra-op threads
    runs:
      - name: static-batch-8
        config: {scheduler: {policy: static, static_batch_size: 8}}
      - name: llama-cpp
        target: {kind: llama_cpp}
        optional: true            # skipped (and reported) when the target is unavailable here
      - name: tenants
        streams:                  # one stream per tenant; each inherits workload/arrival
          - {tenant: heavy, api_key: k1, arrival: {rate: 4}}
          - {tenant: light, api_key: k2, workload: {num_requests: 8}}
      - name: chaos               # faults done to the cluster during the load (load_tests/faults.py)
        target: {kind: cluster, redis: true, client_retries: true}
        faults: {kinds: [kill_worker, redis_stop, redis_restart], every_s: 30}
        rate_of: {run: capacity, fraction: 0.7}   # the open-loop rate: 0.7 x the req/s run
                                                  # `capacity` (earlier) completed on this machine
    checks:                       # the shape the campaign must show (reported, not asserted)
      - {run: continuous, metric: output_token_throughput, op: ">=", baseline: static-batch-8, ratio: 2.0}
      - {run: cancel, metric: final.kv_tokens_used, op: "==", value: 0}
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from kvmesh.load_tests.arrivals import ArrivalSpec
from kvmesh.load_tests.corpus import TokenCorpus
from kvmesh.load_tests.driver import DriverRetryPolicy, RunDriver, TenantStream
from kvmesh.load_tests.faults import FaultPlan
from kvmesh.load_tests.metrics import SLO, summarize
from kvmesh.load_tests import chaos, peer_targets
from kvmesh.load_tests.grpc_target import ClusterTarget, GrpcTarget
from kvmesh.load_tests.targets import EngineTarget, OpenAIHttpTarget, Target, TargetRequest
from kvmesh.load_tests.workloads import LengthDistribution, WorkloadSpec, generate_workload
from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.core.config import ModelConfig
from kvmesh.load_tests.report import write_reports

logger = logging.getLogger(__name__)

_RUN_KEYS = {"name", "target", "config", "workload", "arrival", "retry", "slo", "streams", "warmup_requests",
             "sample_interval_s", "label", "torch_threads", "optional", "faults", "rate_of"}
_DEFAULT_SAMPLE_INTERVAL_S = 0.25
_STREAM_KEYS = {"tenant", "api_key", "workload", "arrival"}


@dataclass(frozen=True)
class StreamPlan:
    tenant: str
    api_key: str | None
    workload: WorkloadSpec
    arrival: ArrivalSpec


@dataclass(frozen=True)
class RateOf:
    """A run's `rate_of:` section: its open-loop arrival rate is `fraction` x the requests/s an
    earlier run of the campaign completed on this machine (a saturated `capacity` run, say),
    so "70% of capacity" holds wherever the campaign runs instead of on the machine a fixed
    rate was chosen on."""

    run: str
    fraction: float

    def validate(self) -> None:
        if not self.run:
            raise InvalidRequestError("rate_of.run must name an earlier run")
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction < math.inf):
            raise InvalidRequestError(f"rate_of.fraction must be a finite number > 0, got {self.fraction!r}")


@dataclass(frozen=True)
class RunPlan:
    """One fully resolved run of a campaign."""

    name: str
    target_kind: str
    target_options: dict
    config: dict  # KvmeshConfig overrides as a plain dict
    streams: tuple[StreamPlan, ...]
    retry: DriverRetryPolicy
    slo: SLO
    warmup_requests: int = 1
    sample_interval_s: float = 0.5
    label: str = ""
    # torch intra-op threads for in-process targets (engine and peers alike, so comparisons
    # are fair); None = torch's default. On a shared CPU, 1 avoids OpenMP oversubscription.
    torch_threads: int | None = None
    optional: bool = False  # a target that cannot be built here (llama_cpp missing) is skipped
    faults: FaultPlan | None = None  # a chaos run (load_tests/faults.py): cluster targets only
    rate_of: RateOf | None = None  # the arrival rate, from an earlier run's throughput (resolve_rate)


@dataclass(frozen=True)
class Campaign:
    name: str
    description: str
    runs: tuple[RunPlan, ...]
    checks: tuple[dict, ...]
    tokenizer_model: dict  # ModelConfig fields for the workload tokenizer
    source: dict  # the YAML as loaded, kept in results.json


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _dataclass_from(cls, data: dict | None, where: str):
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequestError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    for name in ("input", "output", "long_input"):
        if cls is WorkloadSpec and isinstance(data.get(name), dict):
            data[name] = _dataclass_from(LengthDistribution, data[name], f"{where}.{name}")
    if cls is ArrivalSpec and data.get("rate") in ("inf", None):
        data["rate"] = math.inf
    try:
        obj = cls(**data)
    except TypeError as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None
    obj.validate() if hasattr(obj, "validate") else None
    return obj


def _expand_sweep(run: dict) -> list[dict]:
    """arrival.rate: [r1, r2, ...] -> one run per rate, named '<name>@<rate>'."""
    rate = (run.get("arrival") or {}).get("rate")
    if not isinstance(rate, list):
        return [run]
    if run.get("streams"):
        raise InvalidRequestError(f"run {run.get('name')}: a rate sweep needs a single stream")
    out = []
    for r in rate:
        one = deep_merge(run, {"arrival": {"rate": r}})
        one["name"] = f"{run['name']}@{r}"
        one.setdefault("label", run["name"])
        out.append(one)
    return out


def _check_config(config: dict, where: str) -> None:
    """Config overrides must make a valid KvmeshConfig: typos fail at load, not mid-campaign."""

    try:
        KvmeshConfig.from_dict(config)
    except ConfigError as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None


def _plan_run(run: dict, where: str) -> RunPlan:
    unknown = sorted(set(run) - _RUN_KEYS)
    if unknown:
        raise InvalidRequestError(f"{where}: unknown key(s) {unknown}; known: {sorted(_RUN_KEYS)}")
    if not run.get("name"):
        raise InvalidRequestError(f"{where}: every run needs a name")
    _check_config(run.get("config") or {}, f"{where}.config")
    target = dict(run.get("target") or {"kind": "engine"})
    kind = target.pop("kind", "engine")
    faults = None if run.get("faults") is None else _dataclass_from(FaultPlan, run["faults"], f"{where}.faults")
    if faults is not None and kind != "cluster":
        raise InvalidRequestError(f"{where}.faults: faults are done to a cluster the run starts (target.kind: cluster)")
    if faults is not None and faults.needs_redis and not target.get("redis"):
        raise InvalidRequestError(f"{where}.faults: redis kinds need a Redis the target owns (target.redis: true)")
    stream_dicts = run.get("streams") or [{}]
    rate_of = None if run.get("rate_of") is None else _plan_rate_of(run, stream_dicts, f"{where}.rate_of")
    streams = []
    for i, s in enumerate(stream_dicts):
        bad = sorted(set(s) - _STREAM_KEYS)
        if bad:
            raise InvalidRequestError(f"{where}.streams[{i}]: unknown key(s) {bad}")
        streams.append(StreamPlan(
            tenant=s.get("tenant", "default"), api_key=s.get("api_key"),
            workload=_dataclass_from(WorkloadSpec, deep_merge(run.get("workload") or {}, s.get("workload") or {}),
                                     f"{where}.workload"),
            arrival=_dataclass_from(ArrivalSpec, deep_merge(run.get("arrival") or {}, s.get("arrival") or {}),
                                    f"{where}.arrival")))
    return RunPlan(name=str(run["name"]), target_kind=kind, target_options=target, config=run.get("config") or {},
                   streams=tuple(streams), retry=_dataclass_from(DriverRetryPolicy, run.get("retry"), f"{where}.retry"),
                   slo=_dataclass_from(SLO, run.get("slo"), f"{where}.slo"),
                   warmup_requests=int(run.get("warmup_requests", 1)),
                   sample_interval_s=float(run.get("sample_interval_s", _DEFAULT_SAMPLE_INTERVAL_S)),
                   label=str(run.get("label") or run["name"]),
                   torch_threads=None if run.get("torch_threads") is None else int(run["torch_threads"]),
                   optional=bool(run.get("optional", False)), faults=faults, rate_of=rate_of)


def _plan_rate_of(run: dict, stream_dicts: list, where: str) -> RateOf:
    """A `rate_of:` section, refused where the rate it sets would be ambiguous or unused (it
    replaces a rate the defaults give; one the run itself gives is refused in parse_campaign)."""
    rate_of = _dataclass_from(RateOf, run["rate_of"], where)
    arrival = run.get("arrival") or {}
    if len(stream_dicts) > 1:
        raise InvalidRequestError(f"{where}: a run of several streams has no one rate to set")
    if arrival.get("process", "poisson") not in ("poisson", "gamma", "constant"):
        raise InvalidRequestError(f"{where}: needs an open-loop arrival process (poisson, gamma, constant), "
                                  f"got {arrival.get('process')!r}")
    if rate_of.run == run.get("name"):
        raise InvalidRequestError(f"{where}: a run cannot take its rate from itself")
    return rate_of


def resolve_rate(plan: RunPlan, done_runs: list[dict]) -> tuple[RunPlan, dict]:
    """The plan with its `rate_of` rate filled in from the run it names among `done_runs` (the
    campaign's results so far), and what was taken (kept in the run's result as `rate_of`)."""
    if plan.rate_of is None:
        return plan, {}
    base = next((r for r in done_runs if r["name"] == plan.rate_of.run), None)
    if base is None:
        raise InvalidRequestError(f"run {plan.name} takes its rate from run {plan.rate_of.run!r}, which has not "
                                  f"run before it (left out with --only, skipped, or later in the campaign)")
    throughput = base["summary"].get("request_throughput") or 0.0
    if not throughput > 0:
        raise InvalidRequestError(f"run {plan.name} takes its rate from run {plan.rate_of.run!r}, which completed "
                                  f"no request")
    rate = plan.rate_of.fraction * throughput
    streams = tuple(replace(s, arrival=replace(s.arrival, rate=rate)) for s in plan.streams)
    taken = {"run": plan.rate_of.run, "fraction": plan.rate_of.fraction, "baseline_request_throughput": throughput,
             "rate": rate}
    return replace(plan, streams=streams), taken


def parse_campaign(data: dict, where: str = "campaign") -> Campaign:
    if isinstance(data, dict) and data.get("runner"):  # a campaign with its own driver
        raise InvalidRequestError(f"{where}: not a generic campaign; run it with `python -m {data['runner']}`")
    if not isinstance(data, dict) or not data.get("runs"):
        raise InvalidRequestError(f"{where}: a campaign is a mapping with a non-empty 'runs' list")
    unknown = sorted(set(data) - {"name", "description", "defaults", "runs", "checks", "tokenizer"})
    if unknown:
        raise InvalidRequestError(f"{where}: unknown top-level key(s) {unknown}")
    defaults = data.get("defaults") or {}
    runs: list[RunPlan] = []
    for i, run in enumerate(data["runs"]):
        if isinstance(run, dict) and run.get("rate_of") is not None and "rate" in (run.get("arrival") or {}):
            raise InvalidRequestError(f"{where}.runs[{i}]: rate_of sets the arrival rate; leave arrival.rate out")
        for expanded in _expand_sweep(deep_merge(defaults, run)):
            runs.append(_plan_run(expanded, f"{where}.runs[{i}]"))
    names = [r.name for r in runs]
    if len(names) != len(set(names)):
        raise InvalidRequestError(f"{where}: run names must be unique, got {names}")
    for i, plan in enumerate(runs):
        if plan.rate_of is not None and plan.rate_of.run not in names[:i]:
            raise InvalidRequestError(f"{where}: run {plan.name} takes its rate from {plan.rate_of.run!r}, "
                                      f"which is not a run before it ({names[:i]})")
    tokenizer_model = data.get("tokenizer") or ((defaults.get("config") or {}).get("model") or {})
    return Campaign(name=str(data.get("name", Path(where).stem)), description=str(data.get("description", "")),
                    runs=tuple(runs), checks=tuple(data.get("checks") or ()), tokenizer_model=dict(tokenizer_model),
                    source=data)


def load_campaign(path: str | Path) -> Campaign:
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    return parse_campaign(data, str(path))


def load_workload_tokenizer(model_fields: dict):
    from kvmesh.worker.engine_api import load_tokenizer  # torch: the engine API loads the engine

    return load_tokenizer(_dataclass_from(ModelConfig, model_fields, "tokenizer"))


async def execute_run(plan: RunPlan, corpus: TokenCorpus, allow_remote: bool = False, progress: bool = True) -> dict:
    """Build the target, warm it up, drive the streams, summarize. Returns the run's result."""
    streams = [TenantStream(requests=tuple(generate_workload(s.workload, corpus, s.tenant, s.api_key)),
                             arrival=s.arrival) for s in plan.streams]
    config = plan.config
    adapters = sorted({r.adapter for s in streams for r in s.requests if r.adapter})
    if adapters and plan.target_kind in ("engine", "cluster"):  # targets this process starts: give them the adapters
        from kvmesh.load_tests.lora_campaign import campaign_adapters_config  # torch: LoRA runs only

        config = campaign_adapters_config(config, adapters, max(s.workload.adapter_rank for s in plan.streams))
    target = build_target(plan.target_kind, plan.target_options, config, allow_remote)
    if plan.torch_threads is not None:
        import torch
        torch.set_num_threads(plan.torch_threads)
    started = time.time()
    chaos_part = None
    await target.start()
    try:
        await _warm_up(target, streams[0].requests, plan.warmup_requests)
        driver = RunDriver(target, plan.retry, run_id=plan.name, sample_interval_s=plan.sample_interval_s,
                           progress=progress)
        if plan.faults is None:
            result = await driver.run(streams)
        else:
            result, chaos_part = await chaos.run_on_target(driver, streams, plan.faults, target)
    finally:
        await target.close()
    if chaos_part is not None:  # greedy references in this process, once the cluster is gone
        chaos_part = await asyncio.to_thread(chaos.finish, target.config, streams, result.records, chaos_part)
    summary = summarize(result.records, plan.slo)
    tenants = sorted({s.tenant for s in plan.streams})
    by_tenant = ({t: summarize([r for r in result.records if r.tenant_id == t], plan.slo).to_json() for t in tenants}
                 if len(tenants) > 1 else {})
    return {"name": plan.name, "label": plan.label, "target": {"kind": plan.target_kind, **plan.target_options},
            "config": plan.config, "arrival": [_arrival_json(s.arrival) for s in plan.streams],
            "tenants": [s.tenant for s in plan.streams], "retry": plan.retry.mode,
            "slo": {"ttft_ms": plan.slo.ttft_ms, "tpot_ms": plan.slo.tpot_ms, "e2e_ms": plan.slo.e2e_ms},
            "started_at": started, "summary": summary.to_json(), "summary_by_tenant": by_tenant,
            "records": [r.to_json() for r in result.records], "server_samples": result.server_samples,
            "final_server_sample": result.final_server_sample, "chaos": chaos_part}


def _arrival_json(spec: ArrivalSpec) -> dict:
    rate = None if math.isinf(spec.rate) else spec.rate  # JSON has no infinity
    return {"process": spec.process, "rate": rate, "burstiness": spec.burstiness, "concurrency": spec.concurrency,
            "label": spec.label()}


async def _warm_up(target, requests, count: int) -> None:
    """A few short requests so model warm-up (first-call allocations) is not measured."""
    for i, req in enumerate(requests[:count]):
        treq = TargetRequest(request_id=f"warmup-{i}-{time.monotonic_ns()}", prompt_token_ids=req.prompt_token_ids,
                             prompt_text=req.prompt_text, tenant_id=req.tenant_id, api_key=req.api_key,
                             # stop workloads: whole requests, which also teach expected-output estimates
                             max_tokens=req.output_tokens if req.stop else min(4, req.output_tokens), stop=req.stop,
                             adapter=req.adapter)
        try:
            async for _ in target.stream(treq):
                pass
        except Exception as exc:  # warm-up failures show up again in the measured run
            logger.warning("warm-up request failed: %r", exc)


def run_campaign(campaign: Campaign, out_dir: str | Path, tokenizer=None, allow_remote: bool = False,
                 progress: bool = True, only: list[str] | None = None) -> dict:
    """Execute every run, then write results.json, summary.md and report.html to out_dir."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = TokenCorpus(tokenizer if tokenizer is not None else load_workload_tokenizer(campaign.tokenizer_model))
    runs = [r for r in campaign.runs if not only or r.name in only or r.label in only]
    results = {"campaign": campaign.name, "description": campaign.description, "created_at": time.time(),
               "source": campaign.source, "checks": list(campaign.checks), "runs": []}
    results["skipped"] = []
    for plan in runs:
        logger.info("run %s: target %s", plan.name, plan.target_kind)
        try:
            plan, rate_taken = resolve_rate(plan, results["runs"])
            result = asyncio.run(execute_run(plan, corpus, allow_remote, progress))
            if rate_taken:
                achieved = result["summary"]["request_throughput"] / rate_taken["baseline_request_throughput"]
                result["rate_of"] = {**rate_taken, "achieved_fraction": achieved}
            results["runs"].append(result)
        except InvalidRequestError as exc:
            if not plan.optional:
                raise
            logger.warning("skipping optional run %s: %s", plan.name, exc.message)
            results["skipped"].append({"name": plan.name, "reason": exc.message})
        # Written after every run: an interrupted campaign keeps what it measured.
        (out / "results.json").write_text(json.dumps(results, indent=1))
    write_reports(results, out)
    return results


def build_target(kind: str, options: dict, config: dict, allow_remote: bool) -> Target:
    """A target from a campaign run's `target:` section."""
    options = dict(options)
    if kind == "engine":
        return EngineTarget(config)
    if kind == "http":
        return OpenAIHttpTarget(allow_remote=allow_remote, **options)
    if kind == "grpc":
        return GrpcTarget(allow_remote=allow_remote, **options)
    if kind == "cluster":
        return ClusterTarget(config, **options)
    if kind in ("hf_static", "hf_continuous", "llama_cpp"):
        return peer_targets.build_peer_target(kind, options, config)
    raise InvalidRequestError(
        f"unknown target kind {kind!r} (engine|http|grpc|cluster|hf_static|hf_continuous|llama_cpp)")
