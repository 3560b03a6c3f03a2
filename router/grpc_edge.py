"""What runs in Serve's gRPC proxy, in front of the router replica: the byte-level edge.

Serve's proxy owns the gRPC port and imports `add_KvmeshServicer_to_server` (router/
grpc_service.py re-exports it) to register the Kvmesh service; the handlers it installs
forward each call to a router replica. Three parts of the contract can only be kept here,
where the client's bytes and its HTTP/2 stream are:

* Undecodable request bytes (or invalid UTF-8 in a string field, which protobuf refuses
  while parsing) would fail in gRPC's deserializer, before any kvmesh code runs, as UNKNOWN
  with a Python class name in the message. The deserializer registered here never raises:
  it hands an `UndecodableRequest` on, and the edge answers INVALID_ARGUMENT.
* Trailing metadata. A replica's error reaches the proxy as a status code and details only
  (Serve drops the replica's trailing metadata on an error), so the replica appends its
  trailers to the details as a tag (status_map.grpc_details) and the edge moves them back
  into real trailers (`retry-after-ms`, `x-kvmesh-error`) with the plain message as details.
* Client disconnects. Serve cancels the replica's call when the client's cancellation
  lands while the proxy awaits the replica, but not when it lands while the proxy's
  generator is suspended at a `yield` (it then closes with "async generator ignored
  GeneratorExit" and the replica keeps generating). The edge sees every early end of a
  Generate stream, whatever path Serve took, and sends a Cancel for the request's id
  through Serve's own Cancel handler with the caller's metadata (so the tenant scoping of
  ids holds). For that the edge gives a request without an id one (a uuid), which is what
  "empty = the server assigns one" promises anyway.

Expected client errors are not logged with a traceback by the proxy (`quiet_client_errors`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import status_map

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.v1.Kvmesh"
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
CANCEL_METHOD = f"/{SERVICE_NAME}/Cancel"
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
    lenient deserializers; on Serve's proxy server, also wrap its handlers with the edge."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is not None and not isinstance(factory, _EdgeHandlerFactory):
        server.service_handler_factory = _EdgeHandlerFactory(factory)
        quiet_client_errors()
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


class _EdgeHandlerFactory:
    """Wraps Serve's service_handler_factory: Kvmesh methods get the edge around Serve's handler."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, service_method: str, streaming_type):
        handler = self._inner(service_method=service_method, streaming_type=streaming_type)
        if not service_method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if getattr(streaming_type, "name", "") == "UNARY_STREAM":
            cancel = self._inner(service_method=CANCEL_METHOD, streaming_type=_unary_unary_type(streaming_type))
            return _stream_edge(handler, cancel if service_method == GENERATE_METHOD else None)
        if getattr(streaming_type, "name", "") == "UNARY_UNARY":
            return _unary_edge(handler)
        return handler


def _unary_unary_type(streaming_type):
    return type(streaming_type)["UNARY_UNARY"]


def _unary_edge(handler):
    async def unary(request, context):
        if isinstance(request, UndecodableRequest):
            _refuse_undecodable(context, request)
            return b""
        try:
            return await handler(request, context)
        finally:
            _tags_to_trailers(context)

    return unary


def _stream_edge(handler, cancel_handler):
    async def unary_stream(request, context):
        if isinstance(request, UndecodableRequest):
            _refuse_undecodable(context, request)
            return
        if cancel_handler is not None and not request.request_id:
            request.request_id = uuid.uuid4().hex
        # Taken now: the finally below may run when the call is already gone, from a garbage
        # collector's finalizer on another thread, where touching `context` crashes the process.
        detached = _DetachedContext(context)
        loop = asyncio.get_running_loop()
        ended = False
        try:
            async for message in handler(request, context):
                yield message
            ended = True
        finally:
            if ended:
                _tags_to_trailers(context)
            elif cancel_handler is not None:
                # The client left (or the call was cancelled) before the stream ended: make
                # sure the engine stops, whether or not Serve passed the cancellation on.
                _spawn_cancel(cancel_handler, request.request_id, detached, loop)

    return unary_stream


_pending_cancels: set[asyncio.Task] = set()  # strong references until each cancel is sent


def _spawn_cancel(cancel_handler, request_id: str, detached: "_DetachedContext",
                  loop: asyncio.AbstractEventLoop) -> None:
    """Send the Cancel on the call's own event loop; safe from any thread."""

    async def send():
        try:
            await cancel_handler(pb.CancelRequest(request_id=request_id), detached)
        except Exception as exc:  # the router may be gone too; nothing else to do here
            logger.warning("cancel of abandoned request %s failed: %s", request_id, exc)

    def start() -> None:
        task = loop.create_task(send())
        _pending_cancels.add(task)
        task.add_done_callback(_pending_cancels.discard)

    try:
        loop.call_soon_threadsafe(start)
    except RuntimeError:  # the loop is closed: the proxy is shutting down
        pass


class _DetachedContext:
    """A stand-in ServicerContext for a call made after the client's own call ended: the
    client's metadata (API key, Serve's application name), and nothing sent anywhere."""

    def __init__(self, context):
        self._metadata = tuple(context.invocation_metadata() or ())
        self._peer = context.peer()

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return self._peer

    def auth_context(self):
        return {}

    def trailing_metadata(self):
        return ()

    def code(self):
        return None

    def details(self):
        return None

    def peer_identities(self):
        return None

    def peer_identity_key(self):
        return None

    def __getattr__(self, name):  # set_code, set_details, set_trailing_metadata, ...: no one to tell
        return lambda *args, **kwargs: None


def _refuse_undecodable(context, request: UndecodableRequest) -> None:
    status = status_map.status_for(status_map.InvalidRequestError(request.message))
    status_map.log_client_error(status, "gRPC")
    context.set_code(status.grpc_code)
    context.set_details(status.message)
    context.set_trailing_metadata(status_map.grpc_trailing_metadata(status))


def _tags_to_trailers(context) -> None:
    """Move the tag a replica put at the end of the details into trailing metadata."""
    details = context.details()
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    message, pairs = status_map.split_details(details or "")
    if not pairs:
        return
    context.set_details(message)
    existing = [(k, v) for k, v in (context.trailing_metadata() or ()) if k not in dict(pairs)]
    context.set_trailing_metadata(tuple(existing) + tuple(pairs))


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
