"""The one object a request carries through the router's stages (router/stages/__init__.py).

A plain mutable dataclass: each stage reads what the ones before it set and adds its own
part; no stage keeps a request's state anywhere else. Fields are None until their stage ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.core.seams import GenerateRequest, RequestBudget
from kvmesh.router.admission_budget import AdmissionTicket
from kvmesh.router.convert import InboundRequest
from kvmesh.router.quota import Reservation
from kvmesh.router.routing import RoutingDecision
from kvmesh.router.tenants import Tenant


@dataclass
class RequestContext:
    inbound: InboundRequest  # as the edge decoded it
    arrived_s: float  # time.time() at the router: TTFT and e2e latency start here
    root_span: Any  # kvmesh.request, ended by the stream (or by start when a stage refuses)
    parent: Any  # the trace context the stages' spans hang from (root_span's)
    tenant: Tenant | None = None  # authenticate
    # validate: the worker's request (later stages replace it: the engine priority, a
    # degradation cap, the transfer hint), its budget inside (`request.budget`)
    request: GenerateRequest | None = None
    reservation: Reservation | None = None  # quota
    degraded: str | None = None  # degrade: the ladder step that admitted it; None = as sent
    decision: RoutingDecision | None = None  # admit/route: the worker and why
    ticket: AdmissionTicket | None = None  # admit/route: its KV reservation at the router
    dispatched_s: float | None = None  # time.time() when admission let it go
    spans: tuple = ()  # stream: (kvmesh.stream, kvmesh.request), ended in that order when it ends

    @property
    def budget(self) -> RequestBudget:
        """The request's budget as admitted (validate computes it; a cap replaces it)."""
        assert self.request is not None and self.request.budget is not None, "validate has not run"
        return self.request.budget

    @property
    def tenant_id(self) -> str:
        return self.tenant.id if self.tenant is not None else ""
