"""The router replica's own HTTP server (router/http_ingress.py) over real sockets, without Ray:
two servers share one port (SO_REUSEPORT), TLS with a certificate rotated in place reaching
new connections without a restart, mutual TLS refusing a client without a certificate, and the
drain: the listener closes at once while a streaming response in flight runs to its end."""

from __future__ import annotations

import asyncio
import ssl
import threading

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from test_tls import _served_cert_der  # the certificate a new connection is shown
from tls_certs import ThrowawayPki

from kvmesh.core.config import RouterConfig, TlsConfig
from kvmesh.load_tests.grpc_target import free_port
from kvmesh.router.http_ingress import HttpIngress
from kvmesh.router.starting_requests import StartingRequests


def _app(release: threading.Event | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            yield "data: first\n\n"
            while release is not None and not release.is_set():
                await asyncio.sleep(0.01)
            yield "data: last\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class IngressThread:
    """HttpIngress servers on an event loop of their own (as each replica has)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.ingresses: list[HttpIngress] = []

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, router: RouterConfig, release: threading.Event | None = None) -> HttpIngress:
        ingress = HttpIngress(_app(release), router)
        self.run(ingress.start())
        self.ingresses.append(ingress)
        return ingress

    def stop(self) -> None:
        for ingress in self.ingresses:
            self.run(ingress.shutdown(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def servers():
    thread = IngressThread()
    yield thread
    thread.stop()


@pytest.fixture
def pki(tmp_path):
    return ThrowawayPki.create(tmp_path)


def _router(tls: TlsConfig | None = None) -> RouterConfig:
    return RouterConfig(host="127.0.0.1", http_port=free_port(), tls=tls or TlsConfig())


def _client_context(pki, with_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    if with_client_cert:
        context.load_cert_chain(str(pki.client_cert_file), str(pki.client_key_file))
    return context


def test_two_servers_share_the_port(servers):
    router = _router()
    first, second = servers.start(router), servers.start(router)
    assert first.port == second.port == router.http_port
    for _ in range(8):  # fresh connections, spread by the kernel: each answers
        assert httpx.get(f"http://127.0.0.1:{router.http_port}/ping", timeout=10).json() == {"ok": True}


def test_tls_rotation_reaches_new_connections_and_plaintext_is_refused(servers, pki):
    router = _router(TlsConfig(cert_file=str(pki.server_cert_file), key_file=str(pki.server_key_file),
                               reload_check_s=0.05))
    servers.start(router)
    base = f"127.0.0.1:{router.http_port}"
    with httpx.Client(verify=_client_context(pki, False), timeout=10) as client:
        assert client.get(f"https://{base}/ping").json() == {"ok": True}
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{base}/ping", timeout=10)
    assert _served_cert_der(router.http_port, pki) == pki.server_cert_der
    rotated = pki.rotate_server_cert()
    served = None
    for _ in range(200):  # the server checks the files every reload_check_s
        served = _served_cert_der(router.http_port, pki)
        if served == rotated:
            break
        servers.run(asyncio.sleep(0.05))
    assert served == rotated
    with httpx.Client(verify=_client_context(pki, False), timeout=10) as client:  # the new chain verifies
        assert client.get(f"https://{base}/ping").json() == {"ok": True}


def test_mutual_tls_refuses_a_client_without_a_certificate(servers, pki):
    router = _router(TlsConfig(cert_file=str(pki.server_cert_file), key_file=str(pki.server_key_file),
                               client_ca_file=str(pki.ca_file)))
    servers.start(router)
    url = f"https://127.0.0.1:{router.http_port}/ping"
    with pytest.raises(httpx.TransportError):
        httpx.get(url, verify=_client_context(pki, False), timeout=10)
    stranger = ThrowawayPki.create(pki.folder / "stranger")  # a certificate from another CA
    other = ssl.create_default_context(cafile=str(pki.ca_file))
    other.load_cert_chain(str(stranger.client_cert_file), str(stranger.client_key_file))
    with pytest.raises(httpx.TransportError):
        httpx.get(url, verify=other, timeout=10)
    assert httpx.get(url, verify=_client_context(pki, True), timeout=10).json() == {"ok": True}


def test_shutdown_closes_the_listener_and_lets_a_stream_in_flight_finish(servers):
    release = threading.Event()
    router = _router()
    ingress = servers.start(router, release)
    base = f"http://127.0.0.1:{router.http_port}"
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{base}/stream") as response:
        lines = response.iter_lines()
        assert next(lines) == "data: first"
        assert ingress.num_in_flight == 1
        stopping = asyncio.run_coroutine_threadsafe(ingress.shutdown(30.0), servers.loop)
        # The listener closes at once: a new connection is refused while the stream goes on.
        for _ in range(200):
            try:
                httpx.get(f"{base}/ping", timeout=2)
            except httpx.ConnectError:
                break
            servers.run(asyncio.sleep(0.02))
        else:
            raise AssertionError("the listener still accepts connections after shutdown began")
        assert not stopping.done()
        release.set()
        assert [line for line in lines if line] == ["data: last"]
    stopping.result(30)
    assert ingress.num_in_flight == 0
    servers.ingresses.remove(ingress)


class _HandOff:
    """Stands in for the replica's RouterCore in the drain: `channels.hand_off_all()` ends the
    streams in flight (here: releases the app's one stream, as the real hand-off's
    replica_stopping error ends an SSE stream)."""

    def __init__(self, release: threading.Event):
        self.channels = self
        self.starting = StartingRequests()
        self.release = release
        self.num_hand_offs = 0

    def hand_off_all(self) -> None:
        self.num_hand_offs += 1
        self.release.set()


def test_replica_drain_waits_the_grace_then_hands_off_the_http_stream(servers):
    from kvmesh.router.replica_drain import drain_replica

    release = threading.Event()
    router = _router()
    ingress = servers.start(router, release)
    grpc_server = servers.run(_started_grpc_server())
    servicer = type("Servicer", (), {"num_active_streams": 0, "core": _HandOff(release)})()
    base = f"http://127.0.0.1:{router.http_port}"
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{base}/stream") as response:
        lines = response.iter_lines()
        assert next(lines) == "data: first"
        draining = asyncio.run_coroutine_threadsafe(drain_replica(grpc_server, servicer, ingress, 0.5), servers.loop)
        assert [line for line in lines if line] == ["data: last"]  # ended by the hand-off, after the grace
    assert draining.result(30) == 1 and servicer.core.num_hand_offs == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/ping", timeout=2)
    servers.ingresses.remove(ingress)


async def _started_grpc_server():
    import grpc

    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server
