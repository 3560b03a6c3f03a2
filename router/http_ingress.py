"""The router replica's own HTTP server: the OpenAI API, /health and /metrics without a proxy hop.

Each router replica (router/app.py) serves its ASGI app (router/openai_http.py
`build_replica_app`) with uvicorn on its own event loop, on `router.host:router.http_port`,
from a socket bound with SO_REUSEPORT: every replica on a node binds the same port and the
kernel spreads new connections over them, as it does for the gRPC port
(router/grpc_ingress.py). An SSE chunk goes worker -> replica -> client socket, crossing no
other process; Serve's HTTP proxy is not started (router/launch.py, deploy/serve_config.py).

    client ──HTTP(S)──> [node:http_port, SO_REUSEPORT] ──> replica 1 uvicorn ─┐
                                                     └──> replica 2 uvicorn ─┴─> RouterCore

Transport security is router/tls.py's `ReloadingSSLContext` (router.tls): the context is
built once and a rotated certificate is loaded into it every router.tls.reload_check_s, so new
handshakes get the new certificate without a restart; with router.tls.client_ca_file the
handshake requires a client certificate signed by that CA (mutual TLS).

Drain (`HttpIngress.shutdown`, run by router/replica_drain.py when Serve stops the replica):
the listener closes at once (new connections go to the other replicas on the port), idle
keep-alive connections close, responses in flight (SSE streams) continue until they end or
the drain hands them off (an in-band `replica_stopping` error event, router/openai_http.py),
and whatever is left after that is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from kvmesh.core.config import RouterConfig
from kvmesh.router.tls import ReloadingSSLContext

logger = logging.getLogger(__name__)

# Pending connections the kernel queues per replica before accept (uvicorn's default).
LISTEN_BACKLOG = 2048
# Idle keep-alive connections close after this long (Serve's proxy default too).
KEEP_ALIVE_S = 5


class InFlightCounter:
    """ASGI middleware counting the HTTP requests in progress (an SSE stream counts until its
    last event is sent): what a drain waits for."""

    def __init__(self, app):
        self.app = app
        self.num_in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1


class HttpIngress:
    """One replica's uvicorn server on a SO_REUSEPORT socket; `start` it, then `shutdown`."""

    def __init__(self, app, router: RouterConfig):
        self.counter = InFlightCounter(app)
        self._router = router
        self._ssl = ReloadingSSLContext(router.tls) if router.tls.enabled else None
        self._config = uvicorn.Config(
            self.counter, lifespan="off", log_config=None, access_log=False, proxy_headers=False,
            timeout_keep_alive=KEEP_ALIVE_S, backlog=LISTEN_BACKLOG,
            ssl_context_factory=None if self._ssl is None else (lambda _config, _default: self._ssl.context))
        self._server = uvicorn.Server(self._config)
        self._tick: asyncio.Task | None = None
        self._rotations: asyncio.Task | None = None
        self.port = 0

    @property
    def num_in_flight(self) -> int:
        return self.counter.num_in_flight

    @property
    def failed(self) -> BaseException | None:
        """The error that ended the server's tick loop (None while it runs)."""
        for task in (self._tick, self._rotations):
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def start(self) -> None:
        sock = listen_socket(self._router.host, self._router.http_port)
        self.port = sock.getsockname()[1]
        self._config.load()
        self._server.lifespan = self._config.lifespan_class(self._config)  # "off": a no-op
        try:
            await self._server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        # uvicorn's tick: the Date header once a second; `should_exit` ends it.
        self._tick = asyncio.get_running_loop().create_task(self._server.main_loop())
        if self._ssl is not None:
            self._rotations = asyncio.get_running_loop().create_task(self._follow_rotations())
        logger.info("HTTP ingress serving the OpenAI API on %s:%d (%s)", self._router.host, self.port,
                    _security(self._router))

    async def _follow_rotations(self) -> None:
        while True:
            await asyncio.sleep(self._router.tls.reload_check_s)
            try:
                self._ssl.maybe_reload()
            except Exception as exc:  # a file gone mid-rotation: keep serving the loaded pair
                logger.warning("HTTP TLS reload failed (%s); serving the previous certificate", type(exc).__name__)

    async def shutdown(self, grace_s: float) -> None:
        """Close the listener now, let responses in flight run for up to `grace_s`, then
        cancel what is left."""
        self._config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        if self._rotations is not None:
            self._rotations.cancel()
        if self._server.started:
            await self._server.shutdown()
        # Responses cancelled at the timeout may leave their connections open: close them.
        for connection in list(self._server.server_state.connections):
            connection.transport.close()
        if self._tick is not None:
            await asyncio.gather(self._tick, return_exceptions=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound to host:port with SO_REUSEPORT (every replica on the
    node binds the same port) and SO_REUSEADDR (a restart binds while old connections linger)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the router's HTTP server could not bind {host}:{port}: {exc}") from exc
    return sock


def _security(router: RouterConfig) -> str:
    if not router.tls.enabled:
        return "plaintext"
    return "mutual TLS" if router.tls.client_ca_file is not None else "TLS"
