"""Transport security for the router's edges: TLS, optional mutual TLS, certificate rotation.

One module that every edge calls, whatever owns its socket:

    port = add_grpc_port(server, "0.0.0.0:50051", config.router.tls)   # a grpc(.aio) server
    context = ReloadingSSLContext(config.router.tls)                   # an ssl.SSLContext for HTTP

Certificates are PEM files (`router.tls.cert_file`, `key_file`, and `client_ca_file` for
mTLS), typically a Kubernetes Secret mounted read-only (helm: `tls.secretName`). Rotation
(cert-manager renewing the Secret, which the kubelet swaps in place) reaches new connections
without a restart:

* gRPC: `grpc.dynamic_ssl_server_credentials` asks `CertificateFiles.grpc_update` at each
  handshake; it re-reads the files when their (mtime, size) changed, at most every
  `reload_check_s`, and hands gRPC the new configuration.
* HTTP: `ReloadingSSLContext.maybe_reload()` loads the new chain into the same context (new
  handshakes use it; connections already open keep theirs); the replica's HTTP server
  (router/http_ingress.py) calls it every reload_check_s.

A half-written rotation (key and certificate that do not match yet) is not loaded: the
previous pair keeps serving and the next check tries again. Keys are never logged.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from kvmesh.core.config import TlsConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PemFiles:
    """The contents of the configured files at one moment."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None


class CertificateFiles:
    """Reads the PEM files of a TlsConfig and notices when they change."""

    def __init__(self, tls: TlsConfig, clock: Callable[[], float] = time.monotonic):
        if not tls.enabled:
            raise ValueError("router.tls has no cert_file: nothing to load")
        self._tls = tls
        self._clock = clock
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads
        self._stamp = self._file_stamp()
        self._checked_s = clock()
        self.current = self._read()
        self.num_reloads = 0

    def _paths(self) -> list[str]:
        return [p for p in (self._tls.cert_file, self._tls.key_file, self._tls.client_ca_file) if p]

    def _file_stamp(self) -> tuple:
        return tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in self._paths())

    def _read(self) -> PemFiles:
        def load(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as fh:
                return fh.read()
        return PemFiles(load(self._tls.cert_file), load(self._tls.key_file), load(self._tls.client_ca_file))

    def check(self, force: bool = False) -> PemFiles | None:
        """The new contents when the files changed since the last load (checked at most every
        reload_check_s unless `force`), else None. A pair that does not load keeps the old."""
        with self._lock:
            now = self._clock()
            if not force and now - self._checked_s < self._tls.reload_check_s:
                return None
            self._checked_s = now
            try:
                stamp = self._file_stamp()
                if stamp == self._stamp:
                    return None
                _check_pair(self._tls)
                files = self._read()
            except (OSError, ssl.SSLError) as exc:
                logger.warning("TLS files changed but do not load yet (%s); serving the previous certificate",
                               type(exc).__name__)
                return None
            self._stamp, self.current = stamp, files
            self.num_reloads += 1
            logger.info("TLS certificate reloaded from %s", self._tls.cert_file)
            return files

    def grpc_update(self) -> grpc.ServerCertificateConfiguration | None:
        """dynamic_ssl_server_credentials' fetcher: a new configuration or None (keep)."""
        files = self.check()
        return None if files is None else _grpc_configuration(files)


def _check_pair(tls: TlsConfig) -> None:
    """ssl.SSLError when the key does not belong to the certificate (a rotation caught
    between its two writes) or a file is not PEM."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        context.load_verify_locations(tls.client_ca_file)


def _grpc_configuration(files: PemFiles) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(files.private_key, files.cert_chain)],
                                                     root_certificates=files.client_ca)


# ---- gRPC ------------------------------------------------------------------------------------

def grpc_server_credentials(tls: TlsConfig) -> tuple[grpc.ServerCredentials, CertificateFiles]:
    """TLS credentials that follow rotations (and require a client certificate when
    client_ca_file is set), with the file watcher behind them."""
    _check_pair(tls)  # a bad pair fails at start, with the ssl error
    files = CertificateFiles(tls)
    credentials = grpc.dynamic_ssl_server_credentials(
        _grpc_configuration(files.current), files.grpc_update,
        require_client_authentication=tls.client_ca_file is not None)
    return credentials, files


def add_grpc_port(server, address: str, tls: TlsConfig) -> int:
    """Listen on `address`: TLS when router.tls has a certificate, else plaintext. The bound
    port (0 = could not bind), as grpc's add_*_port."""
    if not tls.enabled:
        return server.add_insecure_port(address)
    credentials, _ = grpc_server_credentials(tls)
    return server.add_secure_port(address, credentials)


def grpc_channel_credentials(ca_file: str | None = None, cert_file: str | None = None,
                             key_file: str | None = None) -> grpc.ChannelCredentials:
    """A client's credentials: trust `ca_file` (None = the system roots), and present
    cert_file/key_file when the server asks for mutual TLS."""
    def load(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as fh:
            return fh.read()
    return grpc.ssl_channel_credentials(root_certificates=load(ca_file), private_key=load(key_file),
                                        certificate_chain=load(cert_file))


# ---- HTTP ------------------------------------------------------------------------------------

class ReloadingSSLContext:
    """A server-side ssl.SSLContext (`.context`) whose certificate follows rotations:
    `maybe_reload()` loads changed files into the same context."""

    def __init__(self, tls: TlsConfig, clock: Callable[[], float] = time.monotonic):
        self.files = CertificateFiles(tls, clock)
        self._tls = tls
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        self._load()
        if tls.client_ca_file is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED

    def _load(self) -> None:
        self.context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
        if self._tls.client_ca_file is not None:
            self.context.load_verify_locations(self._tls.client_ca_file)

    def maybe_reload(self, force: bool = False) -> bool:
        """True when a rotation was loaded."""
        if self.files.check(force=force) is None:
            return False
        self._load()
        return True
