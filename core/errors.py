"""The error hierarchy kvmesh raises across its seams.

Each class names what went wrong for the caller; the mapping to gRPC status codes and HTTP
statuses lives in exactly one place (router/status_map.py). No torch import here: the router
imports this module.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of every error kvmesh reports to a caller."""

    retryable: bool = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequestError(KvmeshError):
    """The request can never succeed as sent (bad parameter, prompt too long, ...)."""


class UnauthenticatedError(KvmeshError):
    """Missing or unknown API key."""


class PermissionDeniedError(KvmeshError):
    """The caller is known but may not use what it asked for (another tenant's adapter)."""


class AdapterNotFoundError(KvmeshError):
    """The requested LoRA adapter is not registered (or its files are gone)."""


class RetryableError(KvmeshError):
    """Refused for now: the same request may succeed after `retry_after_s` seconds."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)

    def __reduce__(self):  # pickling (Ray actor -> router) must carry retry_after_s too
        return (type(self), (self.message, self.retry_after_s))


class QuotaExceededError(RetryableError):
    """The tenant's token or concurrency limit is reached; retry after `retry_after_s`."""


class OverloadedError(RetryableError):
    """Capacity is exhausted right now (KV budget, queue full, queue timeout)."""


class DeadlineUnmeetableError(OverloadedError):
    """Refused at once: the queue ahead drains too slowly for the request's deadline. A
    retryable overload to the caller (same status, with retry-after); its own class so the
    router can count this reason apart."""


class QueueSlotTakenError(OverloadedError):
    """Refused while queued: a more important request took this one's slot in a full
    admission lane. A retryable overload to the caller; its own class so it is counted apart."""


class RequestCancelledError(KvmeshError):
    """The request was cancelled (client gone, Cancel RPC)."""


class DeadlineExceededError(KvmeshError):
    """The request's deadline passed before it finished."""


class WorkerFailedError(KvmeshError):
    """The worker (or its model forward) failed; a retry may land on a healthy worker."""

    retryable = True


class RouterReplicaStoppingError(KvmeshError):
    """The router replica serving the request is being removed (a rolling update, a
    scale-down) and its drain grace ran out: the request ends retryably, and a client
    continues it on another replica (a stream: from the tokens it received, docs/api.md)."""

    retryable = True


class RequestBudgetMismatchError(KvmeshError):
    """A worker was sent a request whose carried budget (seams.RequestBudget) does not match
    the request itself: the router and the worker disagree (block size, tokenizer) or the
    budget was changed on the way. A server fault, never the client's: it maps to INTERNAL."""
