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
"""

from __future__ import annotations

import logging
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
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


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
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvmesh-grammar")
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
        self._tokenizer_id = tokenizer_id
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._cache: GrammarCache | None = None  # built with the first constraint (~1 s)
        self._constraints: dict[str, _Constraint] = {}
        self.num_requests: dict[str, int] = {}  # kind -> constrained requests added
        self.num_spec_skipped = 0  # request-steps a constrained request did not speculate
        self.mask_s_total = 0.0
        self._broken: dict[str, str] = {}  # request id -> why its matcher cannot go on

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(ll_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids))
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
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(active), words), dtype=torch.int32)
        for i, (request, c) in enumerate(active):
            problem = self._sync(request, c)
            if problem is None:
                c.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            else:  # EOS only this step; the engine fails it with the problem right after
                self._broken[request.request_id] = problem
                bitmask[i] = 0
                for eos in self._eos_token_ids:
                    bitmask[i, eos // 32] |= 1 << (eos % 32)
        # [N, words] int32 -> [N, words, 32] bits, little-endian within a word -> [N, V] bool
        allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().reshape(len(active), words * 32)
        allowed = allowed[:, :self.vocab_size]
        self.mask_s_total += time.perf_counter() - started
        return {r.request_id: allowed[i] for i, (r, _) in enumerate(active)}

    def _sync(self, request: Request, c: _Constraint) -> str | None:
        """Bring the matcher to exactly the request's output tokens (module doc); the problem
        when it cannot."""
        if c.matcher is None:
            c.matcher = c.compiled.result().deep_copy()
        output = request.output_token_ids
        if c.num_consumed > len(output):
            c.matcher.rollback(c.num_consumed - len(output))
            c.num_consumed = len(output)
        if c.num_consumed < len(output):
            new = output[c.num_consumed:]
            if not c.matcher.consume_tokens(new):
                # Only a token the mask forbade gets here (a bug, or an output resumed from a
                # run without this constraint): the request cannot continue under it.
                return f"the output left its structured-output grammar: {c.matcher.get_error()}"
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
