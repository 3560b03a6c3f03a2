"""Structured output in the engine: grammars compiled off the step thread, one matcher per
constrained request, the token masks of each step.

    add_request   -> StructuredOutputs.add(request): the grammar is looked up in the cache by
                     grammar_key(constraint, tokenizer) or compiled in the compile thread; the
                     request waits in the scheduler's queue meanwhile (`is_ready` is the
                     scheduler's admission gate), so a new schema never stalls others' steps
    each step     -> masks(requests that sample): each matcher is brought to the request's
                     output (`_sync`), its next-token mask filled; the sampler sets every
                     forbidden token's logit to -inf (worker/runner/sampler.py)
    finish/abort  -> forget(request_id)

The matcher's position is defined by the request's output tokens, not by events: `_sync`
consumes what the output gained since the last mask and rolls back what it lost. So a
request preempted by recompute or swap (its output kept) continues where it was, tokens cut
after a stop are rolled back, and a failed-over request (output resumed) consumes its resumed
tokens first. EOS is in the mask only where the grammar is complete (llguidance's rule), so
a constrained request stops only on complete output, or on max_tokens (finish reason
length: the output is then a prefix of a valid one).

Speculative decoding skips constrained requests (Speculator's eligibility; counted as
`num_spec_skipped`): drafts would need a mask per draft position and a rollback of rejected
ones, for the few requests that speculate at all under load.

Compiled grammars: a pristine matcher per key (LRU, `MAX_CACHED_GRAMMARS`), deep-copied for
each request (microseconds); n > 1 samples share one compile. The compile thread builds the
matcher (llguidance drops the GIL while it does) and computes its first mask, which is when
llguidance builds most of its lexer, so the step thread's first mask is as cheap as any.

What a never-seen schema must not cost the others (the step thread is the engine's only
owner; vLLM's StructuredOutputManager and SGLang's grammar backend compile in a thread too):
  * CPU: the compile thread runs at the lowest CPU priority (`_yield_cpu`): on a CPU worker
    the forward's threads own every core, and a compile at equal priority took a core from
    a whole step's matrix products; at the lowest it runs in the step's single-threaded
    gaps (scheduling, sampling, detokenizing) and on idle cores.
  * the GIL: llguidance drops it for compiles, masks and validation; building its view of the
    tokenizer (`LLTokenizer`: ~0.35 s of CPU for a 50k vocabulary, 2 s on a loaded 2-core
    box) holds it throughout, so it is built before the step thread starts (`prepare`,
    called by AsyncEngine; once per process: grammar.ll_tokenizer) instead of at the first
    constrained request, which would freeze every step for that long.
  * the step: masks of all constrained rows are computed in one call on llguidance's thread
    pool with the GIL dropped (`LLExecutor`), matchers advanced the same way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.structured_output_metrics import StructuredOutputFigures
from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.model.grammar import grammar_key, grammar_text, ll_tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 1  # compiles are milliseconds; one thread keeps them off the step's cores


def _yield_cpu() -> None:
    """The compile thread's initializer: this thread only (its Linux thread id) to the lowest
    CPU priority, so a compile never takes a core the forward's threads are using (module
    doc). Best effort: where the OS refuses, the thread keeps the default priority."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        logger.debug("the grammar compile thread keeps the default CPU priority")


@dataclass
class _Constraint:
    key: str
    kind: str
    compiled: Future  # -> a pristine llguidance.LLMatcher
    matcher: "llguidance.LLMatcher | None" = None
    num_consumed: int = 0  # output tokens the matcher has consumed


class GrammarCache:
    """Pristine matchers by key, compiled in a thread pool; concurrent asks for one key share
    the compile (a Future). A compile that fails is not cached."""

    def __init__(self, tokenizer: "llguidance.LLTokenizer", max_cached: int = MAX_CACHED_GRAMMARS):
        self._tokenizer = tokenizer
        self._max_cached = max_cached
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvmesh-grammar", initializer=_yield_cpu)
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0
        self.compile_s_total = 0.0

    def get(self, key: str, text: str) -> Future:
        with self._lock:
            found = self._compiled.get(key)
            if found is not None and not (found.done() and found.exception() is not None):
                self._compiled.move_to_end(key)
                self.num_hits += 1
                return found
            self.num_misses += 1
            future = self._pool.submit(self._compile, text)
            self._compiled[key] = future
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
            return future

    def _compile(self, text: str) -> "llguidance.LLMatcher":
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if not matcher.is_error():
            # The first mask builds most of the lexer; done here, not on the step thread.
            scratch = np.zeros((1, (self._tokenizer.vocab_size + 31) // 32), dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        elapsed = time.perf_counter() - started
        with self._lock:
            self.compile_s_total += elapsed
        if matcher.is_error():
            raise InvalidRequestError(f"the constraint does not compile: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    """The engine's constrained requests: their matchers and each step's masks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], tokenizer_id: str):
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._tokenizer_id = tokenizer_id
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._cache: GrammarCache | None = None  # built by prepare() or the first constraint
        self._executor: "llguidance.LLExecutor | None" = None
        self._constraints: dict[str, _Constraint] = {}
        self.num_requests: dict[str, int] = {}  # kind -> constrained requests added
        self.num_spec_skipped = 0  # request-steps a constrained request did not speculate
        self.mask_s_total = 0.0
        self._broken: dict[str, str] = {}  # request id -> why its matcher cannot go on

    def prepare(self) -> None:
        """Build llguidance's tokenizer view now (~0.35 s holding the GIL: module doc), before
        a step thread runs; without it the first constrained request builds it. A tokenizer
        llguidance cannot read (not a fast tokenizer) is left to fail that request instead."""
        try:
            _ = self.cache
        except Exception as exc:  # noqa: BLE001 - the engine serves free text all the same
            logger.warning("structured output unavailable with this tokenizer: %s", exc)

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(ll_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids))
            # The masks' pool: as many threads as the forward has (they run between forwards).
            self._executor = llguidance.LLExecutor(max(1, torch.get_num_threads()))
        return self._cache

    def add(self, request: Request) -> None:
        """Start (or find) the compile of `request`'s constraint; no-op for free text.
        Raises InvalidRequestError when the spec is not well-formed text of its kind."""
        structured = request.sampling.structured
        if structured is None:
            return
        key = grammar_key(structured, self._tokenizer_id)
        text = grammar_text(structured)
        self._constraints[request.request_id] = _Constraint(key, structured.kind, self.cache.get(key, text))
        self.num_requests[structured.kind] = self.num_requests.get(structured.kind, 0) + 1

    def is_constrained(self, request: Request) -> bool:
        return request.request_id in self._constraints

    def is_ready(self, request: Request) -> bool:
        """The scheduler may start `request`: free text, or its grammar is compiled (or failed:
        the engine then fails it at the next step)."""
        c = self._constraints.get(request.request_id)
        return c is None or c.compiled.done()

    def failed(self) -> dict[str, str]:
        """Requests whose grammar failed to compile, or whose matcher broke -> the message."""
        out = dict(self._broken)
        for rid, c in self._constraints.items():
            if c.matcher is None and c.compiled.done() and c.compiled.exception() is not None:
                exc = c.compiled.exception()
                out[rid] = exc.message if isinstance(exc, InvalidRequestError) else f"{type(exc).__name__}: {exc}"
        return out

    def forget(self, request_id: str) -> None:
        self._constraints.pop(request_id, None)
        self._broken.pop(request_id, None)

    def masks(self, requests: list[Request]) -> dict[str, torch.Tensor]:
        """request id -> bool [vocab_size] (True = allowed) for the constrained ones of
        `requests` (those sampling this step), each matcher first brought to its output."""
        active = [(r, self._constraints[r.request_id]) for r in requests if r.request_id in self._constraints]
        if not active:
            return {}
        started = time.perf_counter()
        bitmask = np.zeros((len(active), self._words), dtype=np.int32)
        fill: list[tuple[llguidance.LLMatcher, int]] = []
        for i, (request, problem) in enumerate(zip((r for r, _ in active), self._sync_all(active))):
            if problem is None:
                fill.append((self._constraints[request.request_id].matcher, i))
            else:  # EOS only this step; the engine fails it with the problem right after
                self._broken[request.request_id] = problem
                words = bitmask.view(np.uint32)
                for eos in self._eos_token_ids:
                    words[i, eos // 32] |= np.uint32(1 << (eos % 32))
        if fill:  # every row at once on llguidance's pool, the GIL dropped
            self._executor.unsafe_compute_mask_ptr(fill, bitmask.ctypes.data, self._words * 4, len(active))
        # bit j of word w is token 32 w + j (little-endian words): unpack to one byte per token
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        allowed = torch.from_numpy(allowed).view(torch.bool)
        self.mask_s_total += time.perf_counter() - started
        return {r.request_id: allowed[i] for i, (r, _) in enumerate(active)}

    def _sync_all(self, active: list[tuple[Request, _Constraint]]) -> list[str | None]:
        """Bring every matcher to exactly its request's output tokens (module doc); per row,
        the problem when it cannot (None: in sync). The usual case, one new token, is
        consumed for all rows in one call on llguidance's pool."""
        problems: list[str | None] = [None] * len(active)
        one_new: list[int] = []
        for i, (request, c) in enumerate(active):
            if c.matcher is None:
                c.matcher = c.compiled.result().deep_copy()
            if len(request.output_token_ids) == c.num_consumed + 1:
                one_new.append(i)
            else:
                problems[i] = self._sync(request, c)
        if one_new:
            pairs = [(active[i][1].matcher, active[i][0].output_token_ids[-1]) for i in one_new]
            for i, ok in zip(one_new, self._executor.consume_token_par(pairs)):
                c = active[i][1]
                c.num_consumed += 1
                if not ok:
                    problems[i] = _left_grammar(c.matcher)
        return problems

    def _sync(self, request: Request, c: _Constraint) -> str | None:
        """One matcher brought to its request's output: rolled back over what the output lost
        (stop truncation, a failover's different suffix), then the new tokens consumed."""
        output = request.output_token_ids
        if c.num_consumed > len(output):
            c.matcher.rollback(c.num_consumed - len(output))
            c.num_consumed = len(output)
        if c.num_consumed < len(output):
            new = output[c.num_consumed:]
            if not c.matcher.consume_tokens(new):
                return _left_grammar(c.matcher)
            c.num_consumed = len(output)
        return None

    def figures(self) -> StructuredOutputFigures:
        cache = self._cache
        return StructuredOutputFigures(
            num_requests=dict(self.num_requests), num_cache_hits=cache.num_hits if cache else 0,
            num_cache_misses=cache.num_misses if cache else 0, compile_s_total=cache.compile_s_total if cache else 0.0,
            mask_s_total=self.mask_s_total, num_spec_skipped=self.num_spec_skipped)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()


def _left_grammar(matcher: "llguidance.LLMatcher") -> str:
    # Only a token the mask forbade gets here (a bug, or an output resumed from a run without
    # this constraint): the request cannot continue under it.
    return f"the output left its structured-output grammar: {matcher.get_error()}"
