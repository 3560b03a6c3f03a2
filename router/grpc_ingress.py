"""The router replica's own gRPC server: kvmesh.v1 without a proxy hop.

Each router replica (a Serve deployment replica, router/app.py) starts one `grpc.aio` server
on its event loop, on `router.host:router.grpc_port`, with SO_REUSEPORT: every replica on a
node binds the same port and the kernel spreads new connections over them, so clients see
one address per node, as with Serve's proxy, but a streamed message crosses no other process.
Serve still owns the replicas (config, health checks, autoscaling, rolling updates; Helm deploys
the same Serve application); Serve's own gRPC proxy is not started for this port.

    client ──gRPC──> [node:grpc_port, SO_REUSEPORT] ──> replica 1 grpc.aio server ─┐
                                                   └──> replica 2 grpc.aio server ─┴─> RouterCore

Server construction is here and only here (`start_grpc_server`); transport security is
router/tls.py's `add_grpc_port` (router.tls: TLS, mTLS, certificate rotation).

Drain: router/replica_drain.py closes this server's listener and the HTTP one together when
Serve stops the replica, gives the streams in flight router.drain_grace_s, and hands the rest to
their clients' resumption.
"""

from __future__ import annotations

import logging

import grpc

from kvmesh.core.config import RouterConfig
from kvmesh.router.grpc_edge import add_kvmesh_service
from kvmesh.router.tls import add_grpc_port

logger = logging.getLogger(__name__)

# Clients stream many tokens per call: let a connection carry many concurrent streams, and
# keep idle connections alive through NATs and load balancers.
_SERVER_OPTIONS = (
    ("grpc.so_reuseport", 1),
    ("grpc.max_concurrent_streams", 4096),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)
# Seconds a replica that failed to start lets its calls finish before it cancels them.
SHUTDOWN_GRACE_S = 5.0


async def start_grpc_server(servicer, router: RouterConfig) -> grpc.aio.Server:
    """Serve `servicer` (router/grpc_service.py) on router.host:router.grpc_port; started."""
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    add_kvmesh_service(servicer, server)
    address = _address(router.host, router.grpc_port)
    port = add_grpc_port(server, address, router.tls)
    if port == 0:
        raise RuntimeError(f"the router's gRPC server could not bind {address}")
    await server.start()
    logger.info("gRPC ingress serving kvmesh.v1 on %s (%s)", address, "TLS" if router.tls.enabled else "plaintext")
    return server


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def stop_grpc_server(server: grpc.aio.Server | None) -> None:
    if server is not None:
        await server.stop(SHUTDOWN_GRACE_S)
