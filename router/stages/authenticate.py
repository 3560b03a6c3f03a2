"""Stage 1: the API key names a tenant (router/auth.py), or the request stops here with
UnauthenticatedError."""

from __future__ import annotations

from kvmesh.router import tracing
from kvmesh.router.auth import Authenticator
from kvmesh.router.stages.context import RequestContext


def authenticate(ctx: RequestContext, authenticator: Authenticator, tracer) -> None:
    with tracer.start_as_current_span(tracing.SPAN_AUTH, context=ctx.parent):
        ctx.tenant = authenticator.authenticate(ctx.inbound.api_key)
    ctx.root_span.set_attributes({tracing.ATTR_TENANT: ctx.tenant.id, tracing.ATTR_ATTEMPT: ctx.inbound.attempt})
