"""A router replica's drain over both of its edges, when Serve stops it (a rolling update, a
scale-down, the app deleted).

    1. both listeners close at once: new connections reach the other replicas on the ports
       (router/grpc_ingress.py, router/http_ingress.py); idle HTTP keep-alive connections
       close; requests not yet streaming (waiting in admission) and any that still reach the
       replica end `replica_stopping` (UNAVAILABLE / 503) at once, through their own call
       (router/starting_requests.py): the client retries them on another replica;
    2. the streams in flight (gRPC Generate calls, HTTP requests: SSE streams) get
       router.drain_grace_s to finish;
    3. the rest are handed to their clients (router/worker_channels.py `hand_off_all`): a gRPC
       stream ends UNAVAILABLE `replica_stopping` and the client resumes it on another replica
       from the tokens it received; an SSE stream gets the same error as an in-band event,
       then `[DONE]` (docs/api.md);
    4. HANDOFF_FLUSH_S later both servers cancel whatever is left.

A gRPC call that reaches the server in the instant its stop begins, before the server hands
it to the servicer, is ended by gRPC core itself, CANCELLED without `x-kvmesh-error`
(grpc/grpc#41785; no server API closes the listener and the connections without it): the
kvmesh client takes that for UNAVAILABLE (status_map.code_to_act_on), and docs/api.md tells
other clients to do the same.

Serve runs this from the replica's `__del__` after its own wait loop
(graceful_shutdown_wait_loop_s), within graceful_shutdown_timeout_s, which build_router_app
sizes from the grace.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.router.http_ingress import HttpIngress

logger = logging.getLogger(__name__)

# After the hand-off: time for the handed-off streams' statuses to reach their clients before
# the servers cancel whatever is left.
HANDOFF_FLUSH_S = 2.0
_DRAIN_POLL_S = 0.05


async def drain_replica(grpc_server: grpc.aio.Server, servicer, http: HttpIngress | None, grace_s: float) -> int:
    """Stop taking calls on both edges, let what is in flight finish for up to `grace_s`, then
    hand the rest to their clients; returns how many streams and HTTP requests were still
    running at the hand-off. `servicer` is the ReplicaGrpcServicer (its live stream count and
    RouterCore)."""
    # Each server's stop closes its listener now and waits for its calls until the grace
    # plus the flush, then cancels them: ours end before that, by the hand-off below.
    refused = servicer.core.starting.refuse_all()
    stopping = [asyncio.ensure_future(grpc_server.stop(grace_s + HANDOFF_FLUSH_S))]
    if refused:
        logger.info("router replica stopping: %d request(s) not yet streaming (waiting in admission) refused, "
                    "to be retried on another replica", refused)
    if http is not None:
        stopping.append(asyncio.ensure_future(http.shutdown(grace_s + HANDOFF_FLUSH_S)))

    def in_flight() -> int:
        return servicer.num_active_streams + (http.num_in_flight if http is not None else 0)

    deadline = time.monotonic() + grace_s
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    live = in_flight()
    servicer.core.channels.hand_off_all()
    if live:
        logger.info("router replica stopping: %d stream(s) or request(s) still running after the %.1f s drain "
                    "grace handed to their clients", live, grace_s)
    for result in await asyncio.gather(*stopping, return_exceptions=True):
        if isinstance(result, Exception):
            logger.warning("an edge's stop failed: %r", result)
    return live
