"""Stage 3: the tenant's quota (router/quota.py) reserves the request's prompt and its whole
output (`budget.output_tokens`: max_tokens x n) up front, or the request stops with
QuotaExceededError (InvalidRequestError when it exceeds a limit no wait can meet). The stream
settles the reservation on every exit path (refunds what was not generated)."""

from __future__ import annotations

from kvmesh.router import tracing
from kvmesh.router.quota import QuotaStore, check_request_fits
from kvmesh.router.stages.context import RequestContext


async def reserve_quota(ctx: RequestContext, store: QuotaStore, tracer) -> None:
    budget = ctx.budget
    with tracer.start_as_current_span(tracing.SPAN_QUOTA, context=ctx.parent):
        check_request_fits(ctx.tenant.limits, ctx.tenant.id, budget.prompt_tokens, budget.output_tokens)
        ctx.reservation = await store.reserve(ctx.tenant, budget.prompt_tokens, budget.output_tokens)
