"""The Kvmesh gRPC service, as methods of the router deployment (Serve's gRPC ingress).

Serve's gRPC proxy owns the port and registers the generated servicer through
`add_KvmeshServicer_to_server` below (gRPCOptions.grpc_servicer_functions =
["kvmesh.router.grpc_service.add_KvmeshServicer_to_server"]); for each RPC it calls the
ingress deployment's method of the same name with the decoded request and a
`RayServegRPCContext`. `KvmeshGrpcMethods` is that set of methods, mixed into the router
deployment (router/app.py) next to the FastAPI routes, so gRPC and HTTP share one replica
and one `RouterCore`.

Errors: the status comes from router/status_map.py; it is set on the context (code,
details, trailing metadata `x-kvmesh-error` and `retry-after-ms`) and the method then
raises, which makes Serve end the RPC with exactly that status, also mid-stream. Serve
keeps only the code and details of a failing method, so the details carry the trailers as
a tag that router/grpc_edge.py, in Serve's proxy, turns back into trailing metadata; the
edge also refuses undecodable bytes and cancels streams whose client left (see there).

Metadata read: `authorization: Bearer <key>`, `x-kvmesh-attempt`, `traceparent`/`tracestate`,
and `x-kvmesh-timeout-s` (a server-enforced deadline; a client's own gRPC deadline also
works, because the proxy then cancels the call, which aborts the request on the worker).
Trailing metadata `x-kvmesh-worker` names the worker that served a Generate, and
`x-kvmesh-degraded` (cap | fallback) the degradation-ladder step that admitted it, if any
(also the final message's `degraded` field; router/degradation.py).
"""

from __future__ import annotations

import logging
import sys
import time

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import convert, degradation, grpc_edge, status_map
from kvmesh.router.convert import InboundRequest
from kvmesh.router.router_core import RouterCore
from kvmesh.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "x-kvmesh-timeout-s"
WORKER_KEY = "x-kvmesh-worker"

# Serve's proxy pickles each decoded request message to hand it to a replica, and pickle
# finds a class by its __module__. protoc names the messages' module after the .proto
# file ("kvmesh_pb2"), not after the package we import it as; until the stubs are generated
# with the package name, this alias lets both the proxy (which imports the servicer
# function below) and the replica (which imports this module) resolve it.
sys.modules.setdefault(pb.GenerateRequest.__module__, pb)


def add_KvmeshServicer_to_server(servicer, server) -> None:  # noqa: N802 (protoc's name)
    """The servicer function Serve's gRPC proxy registers (gRPCOptions.grpc_servicer_functions):
    the generated registration plus the proxy-side edge (router/grpc_edge.py)."""
    grpc_edge.add_kvmesh_service(servicer, server)


class KvmeshGrpcMethods:
    """gRPC methods of the router deployment; the class using it sets `self.core`."""

    core: RouterCore

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            _check_decoded(request)
            stream = await self.core.start(inbound_from_pb(request, _invocation_metadata(grpc_context)))
            routed_to = stream.worker_id
            if grpc_context is not None:
                grpc_context.set_trailing_metadata(_trailers(routed_to, stream.degraded))
            async for delta in stream:
                if grpc_context is not None and stream.worker_id != routed_to:
                    # Re-routed before any token (the first worker refused or failed): name
                    # the worker that serves it. Serve's proxy copies the context with each
                    # message, so this must be set before one is yielded.
                    routed_to = stream.worker_id
                    grpc_context.set_trailing_metadata(_trailers(routed_to, stream.degraded))
                yield convert.delta_to_pb(delta)
        except Exception as exc:
            _fail(grpc_context, exc)
            raise

    async def Cancel(self, request: pb.CancelRequest, grpc_context=None) -> pb.CancelResponse:
        try:
            _check_decoded(request)
            meta = convert.call_metadata_from_grpc(_invocation_metadata(grpc_context))
            found = await self.core.cancel(request.request_id, meta.api_key)
        except Exception as exc:
            _fail(grpc_context, exc)
            raise
        return pb.CancelResponse(found=found)

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        meta = convert.call_metadata_from_grpc(_invocation_metadata(grpc_context))
        return convert.models_to_pb(self.core.list_models(meta.api_key))

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        view = self.core.cluster_view()
        return convert.health_to_pb(convert.HealthStatus(serving=view.num_routable > 0, num_workers=view.num_workers,
                                                         num_healthy_workers=view.num_routable))

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context=None) -> pb.GetStatsResponse:
        view = await self.core.live_cluster_view()
        admission = self.core.admission.snapshot()
        totals = convert.ClusterTotals.from_workers(
            view.workers, router_queue_len=admission.num_queued_first + admission.num_queued_retry,
            router_in_flight=self.core.in_flight)  # read after the await: live
        return convert.cluster_stats_to_pb(convert.ClusterStats(workers=view.workers, totals=totals,
                                                                ages_s=view.ages_s))


def _invocation_metadata(grpc_context) -> list[tuple[str, str]]:
    return list(grpc_context.invocation_metadata()) if grpc_context is not None else []


def _check_decoded(request) -> None:
    """A request the proxy could not parse (grpc_edge.UndecodableRequest) is the client's error;
    the edge normally refuses it before it gets here."""
    if isinstance(request, grpc_edge.UndecodableRequest):
        raise InvalidRequestError(request.message)


def _fail(grpc_context, exc: BaseException) -> None:
    """Put the status for `exc` on the context; the caller re-raises so Serve sends it."""
    status = status_map.status_for(exc)
    if status.kind == "internal":
        logger.exception("gRPC request failed", exc_info=exc)
    else:
        status_map.log_client_error(status, "gRPC")
    if grpc_context is not None:
        grpc_context.set_code(status.grpc_code)
        # The trailers ride in the details too: Serve drops a failing method's trailing
        # metadata, and the edge in its proxy moves them back (router/grpc_edge.py).
        grpc_context.set_details(status_map.grpc_details(status))
        grpc_context.set_trailing_metadata(list(status_map.grpc_trailing_metadata(status)))


def _trailers(worker_id: str, degraded: str | None) -> list[tuple[str, str]]:
    """The serving worker, and the degradation step when the ladder took one."""
    trailers = [(WORKER_KEY, worker_id)]
    if degraded:
        trailers.append((degradation.DEGRADED_KEY, degraded))
    return trailers


def inbound_from_pb(request: pb.GenerateRequest, metadata: list[tuple[str, str]]) -> InboundRequest:
    """The router core's request from the message and the call metadata (convert.py)."""
    timeout_s = status_map.positive_float(status_map.metadata_value(metadata, TIMEOUT_KEY), f"metadata {TIMEOUT_KEY}")
    return convert.inbound_from_pb(request, convert.call_metadata_from_grpc(metadata),
                                   deadline_s=None if timeout_s is None else time.time() + timeout_s)
