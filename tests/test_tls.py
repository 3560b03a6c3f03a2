"""TLS and mutual TLS on the router's edges (router/tls.py) over real sockets: the kvmesh
gRPC client (router/client.py) against a grpc.aio server bound by `add_grpc_port`, a
plaintext client refused, certificates rotated in place and picked up by new connections
without a restart, and the HTTP side's reloading ssl.SSLContext under a real HTTPS server."""

import asyncio
import socket
import ssl
import threading

import grpc
import pytest
from test_client import ScriptedKvmesh, ServerThread
from tls_certs import ThrowawayPki

from kvmesh.core.config import ConfigError, KvmeshConfig, TlsConfig
from kvmesh.core.seams import SamplingParams
from kvmesh.core.errors import WorkerFailedError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import tls
from kvmesh.router.client import KvmeshClient
from kvmesh.router.retry import RetryPolicy

NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture
def pki(tmp_path):
    return ThrowawayPki.create(tmp_path)


def _tls_config(pki, mutual: bool = False, reload_check_s: float = 30.0) -> TlsConfig:
    return TlsConfig(cert_file=str(pki.server_cert_file), key_file=str(pki.server_key_file),
                     client_ca_file=str(pki.ca_file) if mutual else None, reload_check_s=reload_check_s)


def _served_cert_der(port: int, pki, with_client_cert: bool = False) -> bytes:
    """The certificate a new TLS connection to the port is shown."""
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    context.set_alpn_protocols(["h2"])
    if with_client_cert:
        context.load_cert_chain(str(pki.client_cert_file), str(pki.client_key_file))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as conn:
            return conn.getpeercert(binary_form=True)


def _generate_text(client) -> str:
    return "".join(d.text for d in client.generate("ok", sampling=SamplingParams(max_tokens=4), timeout_s=10))


def test_grpc_client_over_tls_plaintext_refused_and_rotation_without_restart(pki):
    server = ServerThread(_tls_config(pki, reload_check_s=0.05))
    try:
        with KvmeshClient(server.target, api_key="sk-test", retry_policy=NO_RETRY,
                          credentials=tls.grpc_channel_credentials(str(pki.ca_file))) as client:
            assert _generate_text(client)
        with KvmeshClient(server.target, api_key="sk-test", retry_policy=NO_RETRY) as plaintext:
            with pytest.raises(WorkerFailedError):  # UNAVAILABLE: the handshake never completes
                _generate_text(plaintext)
        # A client that does not trust the server's CA is refused too.
        untrusted = ThrowawayPki.create(pki.folder / "other")
        with KvmeshClient(server.target, retry_policy=NO_RETRY,
                          credentials=tls.grpc_channel_credentials(str(untrusted.ca_file))) as stranger:
            with pytest.raises(WorkerFailedError):
                _generate_text(stranger)

        before = pki.server_cert_der
        assert _served_cert_der(server.port, pki) == before
        rotated = pki.rotate_server_cert()
        assert rotated != before
        served = None
        for _ in range(200):  # the next handshakes after reload_check_s see the new certificate
            served = _served_cert_der(server.port, pki)
            if served == rotated:
                break
        assert served == rotated
        with KvmeshClient(server.target, retry_policy=NO_RETRY,
                          credentials=tls.grpc_channel_credentials(str(pki.ca_file))) as client:
            assert _generate_text(client)
    finally:
        server.stop()


def test_mutual_tls_requires_a_client_certificate(pki):
    server = ServerThread(_tls_config(pki, mutual=True))
    try:
        with KvmeshClient(server.target, retry_policy=NO_RETRY,
                          credentials=tls.grpc_channel_credentials(str(pki.ca_file))) as anonymous:
            with pytest.raises(WorkerFailedError):
                _generate_text(anonymous)
        credentials = tls.grpc_channel_credentials(str(pki.ca_file), str(pki.client_cert_file),
                                                   str(pki.client_key_file))
        with KvmeshClient(server.target, retry_policy=NO_RETRY, credentials=credentials) as client:
            assert _generate_text(client)
    finally:
        server.stop()


def test_a_half_written_rotation_keeps_the_previous_pair(pki):
    now = [0.0]
    files = tls.CertificateFiles(_tls_config(pki, reload_check_s=1.0), clock=lambda: now[0])
    first = files.current
    pki.server_key_file.write_bytes(ThrowawayPki.create(pki.folder / "x").server_key_file.read_bytes())
    now[0] = 2.0
    assert files.check() is None and files.current == first  # key of another certificate
    pki.rotate_server_cert()
    assert files.check() is None  # checked less than reload_check_s ago
    now[0] = 4.0
    assert files.check() is not None and files.num_reloads == 1 and files.current != first


def test_http_context_reloads_into_the_same_context(pki):
    now = [0.0]
    reloading = tls.ReloadingSSLContext(_tls_config(pki, reload_check_s=1.0), clock=lambda: now[0])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            conn, _ = listener.accept()
            try:
                with reloading.context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(1)
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert _served_cert_der(port, pki) == pki.server_cert_der
        rotated = pki.rotate_server_cert()
        assert not reloading.maybe_reload()  # within reload_check_s
        now[0] = 2.0
        assert reloading.maybe_reload()
        assert _served_cert_der(port, pki) == rotated
    finally:
        stop.set()
        listener.close()


def test_tls_config_is_validated():
    with pytest.raises(ConfigError, match="go together"):
        KvmeshConfig.from_dict({"router": {"tls": {"cert_file": "/c.pem"}}})
    with pytest.raises(ConfigError, match="client_ca_file"):
        KvmeshConfig.from_dict({"router": {"tls": {"client_ca_file": "/ca.pem"}}})


def test_plaintext_port_when_tls_is_off():
    async def scenario():
        server = grpc.aio.server()
        pb_grpc.add_KvmeshServicer_to_server(ScriptedKvmesh(), server)
        port = tls.add_grpc_port(server, "127.0.0.1:0", TlsConfig())
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = [r async for r in pb_grpc.KvmeshStub(channel).Generate(
                pb.GenerateRequest(prompt="ok", sampling=pb.SamplingParams(max_tokens=2)), timeout=10)]
        await server.stop(None)
        return replies

    assert asyncio.run(scenario())[-1].finished
