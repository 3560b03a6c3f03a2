"""The one place kvmesh errors become gRPC status codes, HTTP statuses and OpenAI error bodies.

    error (kvmesh.core.errors)   gRPC                 HTTP  OpenAI type            retry-after
    InvalidRequestError            INVALID_ARGUMENT     400   invalid_request_error  -
    UnauthenticatedError           UNAUTHENTICATED      401   authentication_error   -
    QuotaExceededError             RESOURCE_EXHAUSTED   429   rate_limit_error       yes
    OverloadedError                RESOURCE_EXHAUSTED   429   overloaded_error       yes
    WorkerFailedError              UNAVAILABLE          503   server_error           -
    DeadlineExceededError          DEADLINE_EXCEEDED    504   timeout_error          -
    RequestCancelledError          CANCELLED            499   request_cancelled      -
    anything else                  INTERNAL             500   server_error           -

Retry-after travels as the HTTP `Retry-After` header (whole seconds, rounded up, as RFC 9110
allows only integers) and as gRPC trailing metadata `retry-after-ms` (milliseconds, rounded
up, so a client never retries earlier than the server asked). Trailing metadata
`x-kvmesh-error` names the error kind so a client can rebuild the typed error
(`error_from_grpc`): two causes share RESOURCE_EXHAUSTED.

Unexpected exceptions are reported as INTERNAL with a generic message: their text may hold
internals (or prompt text) and is logged, not returned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kvmesh.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvmeshError,
    OverloadedError,
    QuotaExceededError,
    RequestCancelledError,
    UnauthenticatedError,
    WorkerFailedError,
)

RETRY_AFTER_MS_KEY = "retry-after-ms"
ERROR_KIND_KEY = "x-kvmesh-error"
ATTEMPT_KEY = "x-kvmesh-attempt"
AUTHORIZATION_KEY = "authorization"
HTTP_CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; no standard one exists
INTERNAL_ERROR_MESSAGE = "internal server error"


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
    _Rule(QuotaExceededError, "quota_exceeded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    _Rule(OverloadedError, "overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "overloaded_error"),
    _Rule(WorkerFailedError, "worker_failed", grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
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
    return ErrorStatus(kind=rule.kind, grpc_code=rule.grpc_code, http_status=rule.http_status,
                       openai_type=rule.openai_type, message=message,
                       retry_after_s=None if retry_after_s is None else max(0.0, float(retry_after_s)))


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
    if value <= 0:
        raise InvalidRequestError(f"{what} must be > 0")
    return value


def retry_after_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """Seconds from trailing `retry-after-ms`, or None when absent or malformed."""
    raw = metadata_value(metadata, RETRY_AFTER_MS_KEY)
    try:
        return None if raw is None else max(0.0, int(raw) / 1000.0)
    except ValueError:
        return None


# Serve's gRPC proxy drops a replica's trailing metadata when a streaming method raises
# before its first message (it carries only the code and details across), which is exactly
# when overload is reported. So the retry-after also rides at the end of the details.
_RETRY_AFTER_IN_DETAILS = re.compile(r" \[" + RETRY_AFTER_MS_KEY + r"=(\d+)\]$")


def grpc_details(status: "ErrorStatus") -> str:
    """The status details: the message, plus ` [retry-after-ms=N]` when there is one."""
    if status.retry_after_s is None:
        return status.message
    return f"{status.message} [{RETRY_AFTER_MS_KEY}={retry_after_ms(status.retry_after_s)}]"


def retry_after_from_status(metadata: Iterable[tuple[str, str | bytes]] | None, details: str | None) -> float | None:
    """Seconds from trailing `retry-after-ms`, else from the details' suffix, else None."""
    from_metadata = retry_after_from_metadata(metadata)
    if from_metadata is not None:
        return from_metadata
    match = _RETRY_AFTER_IN_DETAILS.search(details or "")
    return None if match is None else int(match.group(1)) / 1000.0


_KIND_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",  # when the server did not say which
    grpc.StatusCode.UNAVAILABLE: "worker_failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
    grpc.StatusCode.CANCELLED: "cancelled",
}


def error_from_grpc(code: grpc.StatusCode, details: str | None,
                    trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> KvmeshError:
    """Rebuild the typed kvmesh error a server (or the channel) reported."""
    kind = metadata_value(trailing_metadata, ERROR_KIND_KEY)
    rule = _RULE_BY_KIND.get(kind or "") or _RULE_BY_KIND.get(_KIND_BY_CODE.get(code, ""))
    message = _RETRY_AFTER_IN_DETAILS.sub("", details or "") or code.name
    if rule is None:
        error = KvmeshError(f"{code.name}: {message}")
    elif rule.error_type in (QuotaExceededError, OverloadedError):
        retry_after_s = retry_after_from_status(trailing_metadata, details)
        error = rule.error_type(message, retry_after_s=0.0 if retry_after_s is None else retry_after_s)
    else:
        error = rule.error_type(message)
    error.grpc_code = code  # the client's retry policy reads the wire code, not the class
    return error
