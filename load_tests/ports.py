"""A free TCP port for the servers a load test or an end-to-end test starts on loopback."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on every address at this moment. Serve's gRPC proxy binds [::]:port
    whatever router.host says, and Ray's own servers hold random ports on the node's address:
    a port probed on 127.0.0.1 alone was free there yet taken on the node's address, and the
    proxy failed to bind (seen once in a suite run)."""
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind(("::" if family == socket.AF_INET6 else "", 0))  # dual-stack wildcard
            return s.getsockname()[1]
    except OSError:  # no IPv6 on this host
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]
