"""The orders a scheduler serves, admits and preempts requests in, and the work a request has
left: the keys and counts every step of worker/engine_loop/scheduler.py is built from."""

from __future__ import annotations

import math

from kvmesh.worker.engine_loop.request import Request


def running_order(request: Request) -> tuple[int, float]:
    """Served first = smallest; the preemption victim is the largest (newest, least important)."""
    return (request.priority, request.arrival_time)


def waiting_order(request: Request) -> tuple[int, int, float]:
    # Within a priority, preempted requests go to the front: they were admitted before.
    return (request.priority, 0 if request.num_preemptions else 1, request.arrival_time)


def priority_victim_order(request: Request) -> tuple[int, float, float]:
    """Priority preemption takes the largest: least important class, then the one that
    started most recently (it has the least work to lose; one not started yet, none)."""
    started = request.first_scheduled_time if request.first_scheduled_time is not None else math.inf
    return (request.importance_class, started, request.arrival_time)


def known_tokens_to_compute(request: Request) -> int:
    """Tokens the model still has to run for a waiting request: its pinned prefix will be
    shared, not computed (at least one token always is, for the logits)."""
    return max(1, request.num_tokens - max(request.num_computed_tokens, request.num_reserved_cached_tokens))


def output_tokens_left(request: Request) -> int:
    """Output a request may still produce: what its reservation covers (max_tokens, or the
    expected-output estimate, topped up as it grows) less what it has produced."""
    return max(0, (request.reserved_output_tokens or request.sampling.max_tokens) - request.num_output_tokens)


def tokens_left_to_compute(request: Request) -> int:
    """Forward-pass tokens a request still costs this worker: the known tokens not yet
    computed (a waiting request's pinned prefix left out) plus the output still to come,
    less one (the forward of the last known token yields the next output). The router's load guard
    compares workers by this sum, the work they have to do, not by the KV they hold: a
    worker whose requests hit a long cached prefix holds much KV and has little to compute."""
    return known_tokens_to_compute(request) - 1 + output_tokens_left(request)
