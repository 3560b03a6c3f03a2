"""Stage 4: the degradation ladder of the request's class (router/degradation.py) around
admission (admit_route.py): admitted as sent (queueing up to the rule's wait), else capped
(max_tokens lowered, with a new budget), else on the fallback pool, else refused with the
main pool's OverloadedError. A class no rule covers is admitted as sent or refused."""

from __future__ import annotations

import dataclasses

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import OverloadedError, WorkerFailedError
from kvmesh.core.seams import GenerateRequest
from kvmesh.kv.kv_cost import request_budget
from kvmesh.router import degradation
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.stages.admit_route import Admitter
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.worker_pool import WorkerPool


async def admit_degrading(ctx: RequestContext, admitter: Admitter, config: KvmeshConfig, pool: WorkerPool,
                          metrics: RouterMetrics) -> None:
    """Set ctx.decision, ctx.ticket, ctx.request (as admitted: capped or not, with its
    transfer hint) and ctx.degraded (the step taken; None: admitted as sent)."""
    request, parent = ctx.request, ctx.parent
    rule = degradation.rule_for(config, request.priority_class)
    if rule is None:
        ctx.decision, ctx.ticket, ctx.request = await admitter.admit(request, exclude=frozenset(), parent=parent)
        return
    place = admitter.admission.now()  # every step keeps the request's place in the queue
    try:
        ctx.decision, ctx.ticket, ctx.request = await admitter.admit(
            request, exclude=frozenset(), parent=parent, max_wait_s=rule.queue_wait_s, queued_since=place)
        return
    except OverloadedError as exc:
        refused = exc
    steps: list[tuple[str, GenerateRequest, bool]] = []
    if rule.cap_max_tokens is not None and request.sampling.max_tokens > rule.cap_max_tokens:
        steps.append((degradation.STEP_CAP, capped(request, rule.cap_max_tokens), False))
    if rule.fallback and pool.fallback_ids:
        steps.append((degradation.STEP_FALLBACK, request, True))
    for step, degraded_request, on_fallback in steps:
        try:
            ctx.decision, ctx.ticket, ctx.request = await admitter.admit(
                degraded_request, exclude=frozenset(), parent=parent, max_wait_s=0.0, fallback=on_fallback,
                queued_since=place)
        except (OverloadedError, WorkerFailedError):
            continue
        metrics.observe_degraded(step)
        ctx.degraded = step
        return
    metrics.observe_degraded(degradation.STEP_REJECT)
    raise refused


def capped(request: GenerateRequest, max_tokens: int) -> GenerateRequest:
    """The request with max_tokens lowered to `max_tokens`, and the budget that goes with it."""
    sampling = dataclasses.replace(request.sampling, max_tokens=max_tokens)
    budget = request.budget
    return dataclasses.replace(request, sampling=sampling,
                               budget=request_budget(budget.prompt_tokens, sampling, budget.block_size))
