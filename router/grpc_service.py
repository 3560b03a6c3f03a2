"""The Kvmesh gRPC service, served by the router replica itself (router/grpc_ingress.py).

The client's HTTP/2 connection ends in the replica's own `grpc.aio` server: a streamed message
goes worker -> replica -> client socket and crosses no proxy process (Serve's gRPC proxy cost
a second process's CPU per message; docs/deploy.md). `ReplicaGrpcServicer` holds the replica's
`RouterCore`, the same object the OpenAI HTTP routes use, so auth, quotas, admission, routing
and error mapping are one code path whichever protocol a client speaks.

Errors: the status comes from router/status_map.py; `context.abort` ends the call with its
code, the plain message as details and the trailing metadata `x-kvmesh-error` and
`retry-after-ms`, also mid-stream. Undecodable request bytes (or invalid UTF-8 in a string
field) reach the handler as a grpc_edge.UndecodableRequest and get INVALID_ARGUMENT, not
gRPC's UNKNOWN with a Python class name.

Disconnects and deadlines: a client that closes its stream, cancels, or passes its gRPC
deadline makes grpc.aio cancel the handler; the cancellation unwinds the RequestStream, which
aborts the request on its worker and frees its KV blocks (router/stages/stream.py).

Metadata read: `authorization: Bearer <key>`, `x-kvmesh-attempt`, `traceparent`/`tracestate`,
and `x-kvmesh-timeout-s` (a server-enforced deadline; a client's own gRPC deadline also works).
Trailing metadata `x-kvmesh-worker` names the worker that served a Generate,
`x-kvmesh-router-replica` the router replica (an opaque id), and
`x-kvmesh-degraded` (cap | fallback) the degradation-ladder step that admitted it, if any
(also the final message's `degraded` field; router/degradation.py).
"""

from __future__ import annotations

import logging
import time

import grpc

from kvmesh.core.errors import InvalidRequestError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import convert, degradation, grpc_edge, status_map
from kvmesh.router.convert import InboundRequest
from kvmesh.router.router_core import RouterCore

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "x-kvmesh-timeout-s"
WORKER_KEY = "x-kvmesh-worker"
REPLICA_KEY = "x-kvmesh-router-replica"  # which router replica served the call (operations, tests)


class ReplicaGrpcServicer:
    """The kvmesh.v1.Kvmesh methods over one replica's RouterCore (grpc.aio handlers)."""

    def __init__(self, core: RouterCore):
        self.core = core
        self.num_active_streams = 0  # Generate calls in progress (what a drain waits for)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.num_active_streams += 1
        try:
            _check_decoded(request)
            stream = await self.core.start(inbound_from_pb(request, _invocation_metadata(context)))
            routed_to = stream.worker_id
            replica = self.core.channels.replica_id
            context.set_trailing_metadata(_trailers(routed_to, stream.degraded, replica))
            async for delta in stream:
                if stream.worker_id != routed_to:
                    # Re-routed before any token (the first worker refused or failed): name
                    # the worker that serves it.
                    routed_to = stream.worker_id
                    context.set_trailing_metadata(_trailers(routed_to, stream.degraded, replica))
                yield convert.delta_to_pb(delta)
        except Exception as exc:
            await _fail(context, exc)
        finally:
            self.num_active_streams -= 1

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:  # noqa: N802
        try:
            _check_decoded(request)
            meta = convert.call_metadata_from_grpc(_invocation_metadata(context))
            found = await self.core.cancel(request.request_id, meta.api_key)
        except Exception as exc:
            await _fail(context, exc)
        return pb.CancelResponse(found=found)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:  # noqa: N802
        meta = convert.call_metadata_from_grpc(_invocation_metadata(context))
        return convert.models_to_pb(self.core.list_models(meta.api_key))

    async def Health(self, request, context) -> pb.HealthResponse:  # noqa: N802
        view = self.core.cluster_view()
        return convert.health_to_pb(convert.HealthStatus(serving=view.num_routable > 0, num_workers=view.num_workers,
                                                         num_healthy_workers=view.num_routable))

    async def GetStats(self, request, context) -> pb.GetStatsResponse:  # noqa: N802
        view = await self.core.live_cluster_view()
        admission = self.core.admission.snapshot()
        totals = convert.ClusterTotals.from_workers(
            view.workers, router_queue_len=admission.num_queued_first + admission.num_queued_retry,
            router_in_flight=self.core.in_flight)  # read after the await: live
        return convert.cluster_stats_to_pb(convert.ClusterStats(workers=view.workers, totals=totals,
                                                                ages_s=view.ages_s))


def _invocation_metadata(context) -> list[tuple[str, str]]:
    return [(k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)]


def _check_decoded(request) -> None:
    """Bytes that did not parse (grpc_edge.UndecodableRequest) are the client's error."""
    if isinstance(request, grpc_edge.UndecodableRequest):
        raise InvalidRequestError(request.message)


async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status for `exc` (context.abort raises; nothing returns)."""
    status = status_map.status_for(exc)
    if status.kind == "internal":
        logger.exception("gRPC request failed", exc_info=exc)
    else:
        status_map.log_client_error(status, "gRPC")
    await status_map.abort_grpc(context, exc)


def _trailers(worker_id: str, degraded: str | None, replica: str) -> list[tuple[str, str]]:
    """The serving worker and router replica, and the degradation step when the ladder took one."""
    trailers = [(WORKER_KEY, worker_id), (REPLICA_KEY, replica)]
    if degraded:
        trailers.append((degradation.DEGRADED_KEY, degraded))
    return trailers


def inbound_from_pb(request: pb.GenerateRequest, metadata: list[tuple[str, str]]) -> InboundRequest:
    """The router core's request from the message and the call metadata (convert.py)."""
    timeout_s = status_map.positive_float(status_map.metadata_value(metadata, TIMEOUT_KEY), f"metadata {TIMEOUT_KEY}")
    return convert.inbound_from_pb(request, convert.call_metadata_from_grpc(metadata),
                                   deadline_s=None if timeout_s is None else time.time() + timeout_s)
