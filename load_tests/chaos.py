"""A chaos run: the load and the fault schedule (load_tests/faults.py) together against a
running cluster, then what each fault cost.

    result, outcomes = await drive_with_faults(driver, streams, plan, cluster)
    end = await settle(cluster, plan)              # workers idle, cluster whole, KV blocks left
    prompts = prompts_of(streams)
    references = greedy_references(config, reference_lengths(result.records, prompts))  # cluster gone
    report = chaos_report(result.records, outcomes, end, prompts, references)

Per fault the report gives the requests that failed after the client's own retries and
resumptions, the streams whose tokens are not their prompt's greedy output (missing, repeated,
diverged: token_check.py), and the time to recover. A request's trouble is put down to the
latest fault done before its last sign of life (its end, its last token, else its send); trouble
before the first fault is under "none". The run's end adds the KV blocks the workers still
hold once idle, which must be 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvmesh.load_tests.driver import RunDriver, RunResult, TenantStream
from kvmesh.load_tests.faults import ChaosCluster, FaultOutcome, FaultPlan
from kvmesh.load_tests.metrics import STATUS_ERROR, STATUS_OK, RequestRecord
from kvmesh.load_tests.token_check import VERDICTS, compare_stream

logger = logging.getLogger(__name__)


async def drive_with_faults(driver: RunDriver, streams: list[TenantStream], plan: FaultPlan,
                            cluster: ChaosCluster) -> tuple[RunResult, list[FaultOutcome]]:
    """Run the load; meanwhile do the planned faults on time until the load has ended (a fault
    under way then is finished, its recovery measured). With `plan.count` set the load ends
    when the last fault has recovered: what it has not sent by then is not sent."""
    load = asyncio.create_task(driver.run(streams))
    await asyncio.sleep(0)  # the driver takes its start time before it first waits
    outcomes: list[FaultOutcome] = []
    try:
        for fault in plan.schedule():
            wait_s = fault.at_s - driver.now_s()
            if wait_s > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(load), wait_s)
            if load.done():
                break
            outcomes.append(await _do_fault(fault, plan, cluster, driver))
            logger.info("fault %d %s at %.1f s on %s: recovered in %s s", fault.index, fault.kind,
                        outcomes[-1].at_s, outcomes[-1].target, outcomes[-1].recovery_s)
        if plan.count is not None:  # a counted plan ends the load once its faults are done
            driver.stop_sending()
        result = await load
    finally:
        if not load.done():
            load.cancel()
    return result, outcomes


async def _do_fault(fault, plan: FaultPlan, cluster: ChaosCluster, driver: RunDriver) -> FaultOutcome:
    at_s = driver.now_s()
    try:
        target = await asyncio.to_thread(cluster.inject, fault, plan)
    except Exception as exc:  # a fault that could not be done is reported, and broke nothing
        logger.warning("fault %s could not be done: %r", fault.kind, exc)
        return FaultOutcome(fault.index, fault.kind, fault.at_s, at_s, "", None, f"{type(exc).__name__}: {exc}")
    # A drain's hold is the fault itself: its recovery runs from the undrain. Every other
    # fault's runs from the moment it was done (a redeploy's includes Serve's rollout).
    since_s = driver.now_s() if fault.kind == "drain_worker" else at_s
    recovery = await asyncio.to_thread(cluster.wait_whole, plan.recovery_timeout_s)
    recovery_s = None if recovery is None else driver.now_s() - since_s
    return FaultOutcome(fault.index, fault.kind, fault.at_s, at_s, target, recovery_s)


async def settle(cluster: ChaosCluster, plan: FaultPlan) -> dict:
    """After the load: Redis back if a fault left it down, the cluster whole, the workers idle
    -> {"whole_after_s", "kv_blocks_used": {worker: blocks}, "running", "waiting"}."""
    if cluster.redis is not None and cluster.redis_down:
        await asyncio.to_thread(cluster.redis.restart)
        cluster.redis_down = False
    whole_s = await asyncio.to_thread(cluster.wait_whole, plan.recovery_timeout_s)
    stats = await asyncio.to_thread(cluster.wait_idle, plan.settle_timeout_s)
    return {"whole_after_s": whole_s,
            "kv_blocks_used": {name: s.num_blocks_used for name, s in stats.items()},
            "running": sum(s.num_running for s in stats.values()),
            "waiting": sum(s.num_waiting for s in stats.values()),
            "workers_seen": len(stats)}


Prompts = dict[tuple[str, int], tuple[int, ...]]  # (tenant, request index) -> prompt token ids


def prompts_of(streams: list[TenantStream]) -> Prompts:
    return {(r.tenant_id, r.index): tuple(r.prompt_token_ids) for s in streams for r in s.requests}


def reference_lengths(records: list[RequestRecord], prompts: Prompts) -> dict[tuple[int, ...], int]:
    """{prompt token ids: the longest output asked of it} over the streams that can be checked."""
    out: dict[tuple[int, ...], int] = {}
    for record in records:
        key = prompts.get((record.tenant_id, record.index))
        if record.output_token_ids is not None and key:
            out[key] = max(out.get(key, 0), record.expected_output_tokens)
    return out


def _last_seen_s(record: RequestRecord) -> float:
    if record.end_s is not None:
        return record.end_s
    return record.delta_times_s[-1] if record.delta_times_s else record.send_s


def _fault_of(record: RequestRecord, outcomes: list[FaultOutcome]) -> int | None:
    """The index of the latest fault done before the record's last sign of life."""
    seen = _last_seen_s(record)
    done = [o.index for o in outcomes if o.error is None and o.at_s <= seen]
    return done[-1] if done else None


def chaos_report(records: list[RequestRecord], outcomes: list[FaultOutcome], end: dict, prompts: Prompts,
                 references: dict[tuple[int, ...], list[int]]) -> dict:
    """The per-fault table and the run's totals (plain JSON)."""
    rows = {o.index: {**o.to_json(), "in_flight": 0, "failed": 0, **dict.fromkeys(VERDICTS[1:], 0)}
            for o in outcomes}
    none_row = {"index": None, "kind": "none", "in_flight": 0, "failed": 0, **dict.fromkeys(VERDICTS[1:], 0)}
    totals = {"requests": len(records), "failed": 0, "checked": 0, **dict.fromkeys(VERDICTS, 0)}
    streams = []
    for record in records:
        for o in outcomes:
            if o.error is None and record.send_s <= o.at_s <= _last_seen_s(record):
                rows[o.index]["in_flight"] += 1
        row = rows.get(_fault_of(record, outcomes), none_row)
        if record.status == STATUS_ERROR:
            totals["failed"] += 1
            row["failed"] += 1
            continue
        reference = references.get(prompts.get((record.tenant_id, record.index)))
        if record.status != STATUS_OK or record.output_token_ids is None or reference is None:
            continue
        check = compare_stream(record.output_token_ids, reference[:record.expected_output_tokens])
        totals["checked"] += 1
        totals[check.verdict] += 1
        if check.verdict != "ok":
            row[check.verdict] += 1
            streams.append({"index": record.index, "tenant": record.tenant_id, **check.to_json()})
    recoveries = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    return {"faults": [rows[o.index] for o in outcomes] + ([none_row] if any(
                none_row[k] for k in ("failed", *VERDICTS[1:])) else []),
            "totals": {**totals, "faults": len(outcomes), "faults_not_done": sum(o.error is not None for o in outcomes),
                       "not_recovered": sum(o.error is None and o.recovery_s is None for o in outcomes),
                       "max_recovery_s": max(recoveries, default=None),
                       "kv_blocks_used_end": sum(end.get("kv_blocks_used", {}).values()), **end},
            "bad_streams": streams}


async def run_on_target(driver: RunDriver, streams: list[TenantStream], plan: FaultPlan, target) -> tuple[RunResult, dict]:
    """The chaos part of a campaign run on a started `cluster` target: load + faults, then
    settle (before the target closes) -> (the load's result, what `finish` needs)."""
    cluster = ChaosCluster(target.config, target.app_name, target.redis)
    result, outcomes = await drive_with_faults(driver, streams, plan, cluster)
    end = await settle(cluster, plan)
    return result, {"outcomes": outcomes, "end": end}


def finish(config, streams: list[TenantStream], records: list[RequestRecord], partial: dict) -> dict:
    """References from an engine in this process (run it once the cluster is gone: the CPU
    is free again), then the report."""
    from kvmesh.load_tests.token_check import greedy_references  # torch: the engine

    prompts = prompts_of(streams)
    references = greedy_references(config, reference_lengths(records, prompts))
    return chaos_report(records, partial["outcomes"], partial["end"], prompts, references)
