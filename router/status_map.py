"""The one place kvmesh errors become gRPC status codes, HTTP statuses and OpenAI error bodies.

    error (kvmesh.core.errors)   gRPC                 HTTP  OpenAI type            retry-after
    InvalidRequestError            INVALID_ARGUMENT     400   invalid_request_error  -
    UnauthenticatedError           UNAUTHENTICATED      401   authentication_error   -
    PermissionDeniedError          PERMISSION_DENIED    403   permission_error       -
    AdapterNotFoundError           NOT_FOUND            404   not_found_error        -
    QuotaExceededError             RESOURCE_EXHAUSTED   429   rate_limit_error       yes
    OverloadedError                RESOURCE_EXHAUSTED   429   overloaded_error       yes
    WorkerFailedError              UNAVAILABLE          503   server_error           yes (0.1 s)
    RouterReplicaStoppingError     UNAVAILABLE          503   server_error           yes (0 s)
    DeadlineExceededError          DEADLINE_EXCEEDED    504   timeout_error          -
    RequestCancelledError          CANCELLED            499   request_cancelled      -
    anything else                  INTERNAL             500   server_error           -
      (RequestBudgetMismatchError among them: router and worker disagree, a server fault)

Retry-after travels as the HTTP `Retry-After` header (whole seconds, rounded up, as RFC 9110
allows only integers) and as gRPC trailing metadata `retry-after-ms` (milliseconds, rounded
up, so a client never retries earlier than the server asked). Trailing metadata
`x-kvmesh-error` names the error kind so a client can rebuild the typed error
(`error_from_grpc`): two causes share RESOURCE_EXHAUSTED.

Unexpected exceptions are reported as INTERNAL with a generic message: their text may hold
internals (or prompt text) and is logged, not returned.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kvmesh.core.errors import (
    AdapterNotFoundError,
    DeadlineExceededError,
    InvalidRequestError,
    KvmeshError,
    OverloadedError,
    PermissionDeniedError,
    QuotaExceededError,
    RequestCancelledError,
    RouterReplicaStoppingError,
    UnauthenticatedError,
    WorkerFailedError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_MS_KEY = "retry-after-ms"
ERROR_KIND_KEY = "x-kvmesh-error"
ATTEMPT_KEY = "x-kvmesh-attempt"
AUTHORIZATION_KEY = "authorization"
HTTP_CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; no standard one exists
INTERNAL_ERROR_MESSAGE = "internal server error"
# UNAVAILABLE after a worker failure: the router has already marked the worker failed and
# routes a retry elsewhere, so a client may come back almost at once.
WORKER_FAILED_RETRY_AFTER_S = 0.1
# UNAVAILABLE from a router replica that is stopping: its listener is already closed, so a
# client's next connection reaches another replica at once.
REPLICA_STOPPING_RETRY_AFTER_S = 0.0


@dataclass(frozen=True)
class ErrorStatus:
    """How one error is reported on each protocol."""

    kind: str  # stable machine name, sent as x-kvmesh-error and as the OpenAI `code`
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    message: str
    retry_after_s: float | None = None  # only for retryable capacity errors


@dataclass(frozen=True)
class _Rule:
    error_type: type[KvmeshError]
    kind: str
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str


# Order matters only for subclasses (none today); the first isinstance match wins.
_RULES: tuple[_Rule, ...] = (
    _Rule(InvalidRequestError, "invalid_request", grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    _Rule(UnauthenticatedError, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    _Rule(PermissionDeniedError, "permission_denied", grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    _Rule(AdapterNotFoundError, "adapter_not_found", grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    _Rule(QuotaExceededError, "quota_exceeded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    _Rule(OverloadedError, "overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "overloaded_error"),
    _Rule(WorkerFailedError, "worker_failed", grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    _Rule(RouterReplicaStoppingError, "replica_stopping", grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    _Rule(DeadlineExceededError, "deadline_exceeded", grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    _Rule(RequestCancelledError, "cancelled", grpc.StatusCode.CANCELLED, HTTP_CLIENT_CLOSED_REQUEST,
          "request_cancelled"),
)
_INTERNAL = _Rule(KvmeshError, "internal", grpc.StatusCode.INTERNAL, 500, "server_error")
_RULE_BY_KIND = {rule.kind: rule for rule in _RULES}

# gRPC codes a client may retry: capacity (with retry-after) and a failed/unreachable worker.
RETRYABLE_GRPC_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


def status_for(error: BaseException) -> ErrorStatus:
    """Map any exception to its protocol status (unknown exceptions become INTERNAL)."""
    rule = next((r for r in _RULES if isinstance(error, r.error_type)), _INTERNAL)
    message = error.message if isinstance(error, KvmeshError) and rule is not _INTERNAL else INTERNAL_ERROR_MESSAGE
    retry_after_s = getattr(error, "retry_after_s", None) if rule is not _INTERNAL else None
    if retry_after_s is None and rule.error_type is WorkerFailedError:
        retry_after_s = WORKER_FAILED_RETRY_AFTER_S
    if retry_after_s is None and rule.error_type is RouterReplicaStoppingError:
        retry_after_s = REPLICA_STOPPING_RETRY_AFTER_S
    return ErrorStatus(kind=rule.kind, grpc_code=rule.grpc_code, http_status=rule.http_status,
                       openai_type=rule.openai_type, message=message,
                       retry_after_s=None if retry_after_s is None else max(0.0, float(retry_after_s)))


def is_client_error(error: BaseException) -> bool:
    """A kvmesh error reported on purpose with a documented status (not INTERNAL)."""
    return isinstance(error, KvmeshError) and any(isinstance(error, r.error_type) for r in _RULES)


def log_client_error(status: ErrorStatus, where: str) -> None:
    """One line per expected client error, no traceback (they are the client's to act on)."""
    logger.warning("%s request refused: %s %s: %s", where, status.grpc_code.name, status.kind, status.message)


# ---- HTTP / OpenAI -------------------------------------------------------------------------

def retry_after_header_s(retry_after_s: float) -> int:
    """Whole seconds for the HTTP Retry-After header: rounded up, never earlier than asked."""
    return max(0, math.ceil(retry_after_s))


def retry_after_ms(retry_after_s: float) -> int:
    return max(0, math.ceil(retry_after_s * 1000.0))


def openai_error_body(status: ErrorStatus, param: str | None = None) -> dict:
    """The body OpenAI's API returns on errors: {"error": {message, type, param, code}}."""
    return {"error": {"message": status.message, "type": status.openai_type, "param": param,
                      "code": status.kind}}


def http_headers(status: ErrorStatus) -> dict[str, str]:
    headers = {ERROR_KIND_KEY: status.kind}
    if status.retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_header_s(status.retry_after_s))
        headers[RETRY_AFTER_MS_KEY] = str(retry_after_ms(status.retry_after_s))
    return headers


# ---- gRPC server side ------------------------------------------------------------------------

def grpc_trailing_metadata(status: ErrorStatus) -> tuple[tuple[str, str], ...]:
    metadata = [(ERROR_KIND_KEY, status.kind)]
    if status.retry_after_s is not None:
        metadata.append((RETRY_AFTER_MS_KEY, str(retry_after_ms(status.retry_after_s))))
    return tuple(metadata)


async def abort_grpc(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End an aio RPC with the status for `error` (raises, as context.abort always does)."""
    status = status_for(error)
    await context.abort(status.grpc_code, status.message, trailing_metadata=grpc_trailing_metadata(status))


# ---- gRPC client side (the reverse) ---------------------------------------------------------

def is_retryable(code: grpc.StatusCode) -> bool:
    return code in RETRYABLE_GRPC_CODES


def code_to_act_on(code: grpc.StatusCode, details: str | None,
                   trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> grpc.StatusCode:
    """The code a client that did not cancel the call itself acts on. A CANCELLED without a
    kvmesh error kind was not sent by a kvmesh handler (every status kvmesh sends carries
    its kind, a cancel too): gRPC core sends it for the calls a server had received but not yet
    handed to its application when its shutdown began (a stopping router replica whose last
    calls raced its listener's close; grpc/grpc#41785). That is UNAVAILABLE: retry elsewhere."""
    if code != grpc.StatusCode.CANCELLED:
        return code
    return code if error_kind_from_status(trailing_metadata, details) else grpc.StatusCode.UNAVAILABLE


def error_kind_from_status(trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
                           details: str | None) -> str | None:
    """The kvmesh error kind a status carries: trailing `x-kvmesh-error`, else the details' tag
    (a proxy may keep only code and details); None when no kvmesh handler sent it."""
    return (metadata_value(trailing_metadata, ERROR_KIND_KEY)
            or metadata_value(split_details(details or "")[1], ERROR_KIND_KEY))


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k.lower() == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


def positive_float(raw: str | None, what: str) -> float | None:
    """A caller-supplied number (gRPC metadata or HTTP header, named by `what`, e.g.
    "header x-kvmesh-timeout-s"): None when absent, InvalidRequestError unless a number > 0."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequestError(f"{what} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(f"{what} must be a finite number > 0, got {raw!r}")
    return value


def retry_after_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """Seconds from trailing `retry-after-ms`, or None when absent or malformed."""
    raw = metadata_value(metadata, RETRY_AFTER_MS_KEY)
    try:
        return None if raw is None else max(0.0, int(raw) / 1000.0)
    except ValueError:
        return None


# Serve's gRPC proxy drops a replica's trailing metadata when a method raises (it carries only
# the code and details across). So the replica appends its trailers to the details as a tag,
# ` [x-kvmesh-error=overloaded; retry-after-ms=78]`, and the edge in Serve's proxy
# (router/grpc_edge.py) moves them back into real trailing metadata; a client that still
# finds the tag (another proxy in front) reads it from the details.
_DETAILS_TAG = re.compile(r" \[((?:[a-z0-9-]+=[^;\]]*)(?:; [a-z0-9-]+=[^;\]]*)*)\]$")


def grpc_details(status: "ErrorStatus") -> str:
    """The status details: the message, then the trailing metadata as a tag."""
    tag = "; ".join(f"{k}={v}" for k, v in grpc_trailing_metadata(status))
    return f"{status.message} [{tag}]"


def split_details(details: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(message, trailing metadata pairs) from details that may end with the tag."""
    match = _DETAILS_TAG.search(details or "")
    if match is None:
        return details, ()
    pairs = tuple(tuple(item.split("=", 1)) for item in match.group(1).split("; "))
    return details[:match.start()], pairs


def retry_after_from_status(metadata: Iterable[tuple[str, str | bytes]] | None, details: str | None) -> float | None:
    """Seconds from trailing `retry-after-ms`, else from the details' tag, else None."""
    from_metadata = retry_after_from_metadata(metadata)
    if from_metadata is not None:
        return from_metadata
    return retry_after_from_metadata(split_details(details or "")[1])


_KIND_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.NOT_FOUND: "adapter_not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",  # when the server did not say which
    grpc.StatusCode.UNAVAILABLE: "worker_failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
    grpc.StatusCode.CANCELLED: "cancelled",
}


def error_from_grpc(code: grpc.StatusCode, details: str | None,
                    trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> KvmeshError:
    """Rebuild the typed kvmesh error a server (or the channel) reported."""
    message = split_details(details or "")[0]
    kind = error_kind_from_status(trailing_metadata, details)
    rule = _RULE_BY_KIND.get(kind or "") or _RULE_BY_KIND.get(_KIND_BY_CODE.get(code, ""))
    message = message or code.name
    if rule is None:
        error = KvmeshError(f"{code.name}: {message}")
    elif rule.error_type in (QuotaExceededError, OverloadedError):
        retry_after_s = retry_after_from_status(trailing_metadata, details)
        error = rule.error_type(message, retry_after_s=0.0 if retry_after_s is None else retry_after_s)
    else:
        error = rule.error_type(message)
    error.grpc_code = code  # the client's retry policy reads the wire code, not the class
    return error
