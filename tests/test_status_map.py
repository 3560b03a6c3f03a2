"""router/status_map.py: every kvmesh error maps to one gRPC code, HTTP status and OpenAI body."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.router import status_map
from kvmesh.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvmeshError,
    OverloadedError,
    QuotaExceededError,
    RequestCancelledError,
    RouterReplicaStoppingError,
    UnauthenticatedError,
    WorkerFailedError,
)

CASES = [
    (InvalidRequestError("max_tokens must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (UnauthenticatedError("unknown API key"), grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (QuotaExceededError("tenant over budget", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
     "rate_limit_error"),
    (OverloadedError("KV budget exhausted", retry_after_s=0.2), grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
     "overloaded_error"),
    (WorkerFailedError("no healthy worker"), grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (RouterReplicaStoppingError("router replica stopping"), grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (DeadlineExceededError("deadline passed"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (RequestCancelledError("client went away"), grpc.StatusCode.CANCELLED, 499, "request_cancelled"),
]


@pytest.mark.parametrize("error,code,http,openai_type", CASES, ids=lambda v: type(v).__name__)
def test_each_error_has_one_code_status_and_type(error, code, http, openai_type):
    status = status_map.status_for(error)
    assert (status.grpc_code, status.http_status, status.openai_type) == (code, http, openai_type)
    assert status.message == error.message
    body = status_map.openai_error_body(status, param="max_tokens")
    assert set(body) == {"error"}
    assert body["error"] == {"message": error.message, "type": openai_type, "param": "max_tokens",
                             "code": status.kind}


@pytest.mark.parametrize("error,code,http,openai_type", CASES, ids=lambda v: type(v).__name__)
def test_client_rebuilds_the_same_typed_error_from_the_wire(error, code, http, openai_type):
    status = status_map.status_for(error)
    trailing = status_map.grpc_trailing_metadata(status)
    rebuilt = status_map.error_from_grpc(status.grpc_code, status.message, trailing)
    assert type(rebuilt) is type(error)
    assert rebuilt.message == error.message
    assert rebuilt.grpc_code == code
    if hasattr(error, "retry_after_s"):
        # milliseconds rounded up: never earlier than the server asked, at most 1 ms later
        assert error.retry_after_s <= rebuilt.retry_after_s <= error.retry_after_s + 0.001


def test_retry_after_rounds_up_for_http_seconds_and_grpc_milliseconds():
    status = status_map.status_for(OverloadedError("busy", retry_after_s=0.2))
    assert status_map.http_headers(status)["Retry-After"] == "1"
    assert status_map.http_headers(status)["retry-after-ms"] == "200"
    assert dict(status_map.grpc_trailing_metadata(status))["retry-after-ms"] == "200"
    assert status_map.retry_after_header_s(1.0) == 1
    assert status_map.retry_after_header_s(1.001) == 2
    assert status_map.retry_after_ms(0.0014) == 2


def test_errors_without_retry_after_send_no_retry_headers():
    status = status_map.status_for(InvalidRequestError("bad"))
    assert "Retry-After" not in status_map.http_headers(status)
    assert "retry-after-ms" not in dict(status_map.grpc_trailing_metadata(status))
    assert status.retry_after_s is None


def test_unexpected_exceptions_are_internal_and_do_not_leak_their_text():
    status = status_map.status_for(RuntimeError("CUDA error at secret/path.py, prompt='my password'"))
    assert status.grpc_code == grpc.StatusCode.INTERNAL
    assert status.http_status == 500
    assert "password" not in status.message
    assert status.retry_after_s is None


def test_only_capacity_and_unavailable_codes_are_retryable():
    retryable = {c for c in grpc.StatusCode if status_map.is_retryable(c)}
    assert retryable == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def test_bare_channel_codes_map_to_typed_errors_without_kvmesh_metadata():
    # A connection refused reaches the client as UNAVAILABLE with no x-kvmesh-error.
    error = status_map.error_from_grpc(grpc.StatusCode.UNAVAILABLE, "failed to connect", ())
    assert isinstance(error, WorkerFailedError)
    error = status_map.error_from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "too big", None)
    assert isinstance(error, OverloadedError) and error.retry_after_s == 0.0
    error = status_map.error_from_grpc(grpc.StatusCode.INTERNAL, "boom", ())
    assert type(error) is KvmeshError and "INTERNAL" in error.message


def test_malformed_retry_after_metadata_is_ignored():
    assert status_map.retry_after_from_metadata([("retry-after-ms", "soon")]) is None
    assert status_map.retry_after_from_metadata([("retry-after-ms", b"1500")]) == 1.5
