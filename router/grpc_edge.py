"""The byte-level edge of the gRPC ingress (router/grpc_ingress.py): how requests are decoded.

Undecodable request bytes (or invalid UTF-8 in a string field, which protobuf refuses while
parsing) would fail in gRPC's deserializer, before any kvmesh code runs, as UNKNOWN with a
Python class name in the message. The deserializer registered here never raises: it hands an
`UndecodableRequest` on, and the servicer answers INVALID_ARGUMENT (router/grpc_service.py).

Expected client errors are not logged with a traceback by Serve (`quiet_client_errors`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import status_map

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.v1.Kvmesh"
UNDECODABLE_MESSAGE = "the request is not a valid {name} message (undecodable bytes or invalid UTF-8 in a string field)"


@dataclass(frozen=True)
class UndecodableRequest:
    """What the lenient deserializer returns for bytes that do not parse (picklable, so a
    replica reached without the edge can refuse it too)."""

    message_name: str

    @property
    def message(self) -> str:
        return UNDECODABLE_MESSAGE.format(name=self.message_name)


def lenient_deserializer(message_class):
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception:  # DecodeError, and whatever else bad bytes make protobuf raise
            return UndecodableRequest(name)

    return deserialize


def add_kvmesh_service(servicer, server) -> None:
    """Register the Kvmesh service like the generated add_KvmeshServicer_to_server, with
    lenient deserializers (every request arrives parsed, or as an UndecodableRequest)."""
    service = pb.DESCRIPTOR.services_by_name["Kvmesh"]
    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient_deserializer(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


# ---- logging -----------------------------------------------------------------------------

_CLIENT_ERROR_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
})


class _QuietClientErrors(logging.Filter):
    """Drops Serve's traceback records for errors kvmesh reported on purpose with a status a
    client acts on; the router replica logs each once, in one line (status_map.log_client_error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        code = getattr(exc, "grpc_code", None)
        original = getattr(exc, "original_exception", None) or exc.__cause__ or exc
        if code in _CLIENT_ERROR_CODES:
            return False
        return not status_map.is_client_error(original)


def quiet_client_errors() -> None:
    """Install the filter on Serve's logger in this process (proxy or replica); idempotent."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _QuietClientErrors) for f in serve_logger.filters):
        serve_logger.addFilter(_QuietClientErrors())
