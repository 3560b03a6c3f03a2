"""What a scheduler reports (SchedulerStats: the worker's stats, the router's view of its
room, metrics) and the window of per-step samples its peak and mean figures are taken over."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.kv.kv_cache_manager import KVCacheStats


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    queued_prompt_tokens: int  # tokens waiting requests still have to compute
    kv_tokens_used: int
    kv_tokens_reserved: int
    kv_tokens_budget: int
    peak_kv_tokens: int  # over the stats window
    mean_kv_tokens: float  # over the stats window (per step)
    batch_fill_rate: float  # mean of scheduled tokens / max_num_batched_tokens per step
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_preemptions_priority: int  # made for a more important waiting request (running ones also above)
    num_outgrown_estimates: int  # admission_reserve=expected: requests that produced more than estimated
    prefix_cache_hit_rate: float
    output_tokens_per_s: float
    drain_tokens_per_s: float  # reserved KV tokens returned per second
    num_steps: int
    kv: KVCacheStats
    tokens_to_compute: int = 0  # prompt not yet computed + output still to come, running and waiting
    # of num_preemptions_priority, KV reservations taken (of waiting requests too, which free no blocks)
    num_preemptions_priority_kv: int = 0
    kv_tokens_reserved_shared: int = 0  # of kv_tokens_reserved, what classes >= kv_reserved_below_class hold
    # Hashes of the full prompt blocks live requests hold (pinned, in their tables, or to be
    # computed by them): a newcomer sharing them adds nothing for them to kv_tokens_reserved,
    # while one reusing a cached block outside this set adds it (pinned, paid by nobody).
    held_block_hashes: frozenset[bytes] = frozenset()


class StepWindow:
    """One sample a step over the last `window_s` seconds: KV tokens in use, batch fill."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, int, float]] = deque()  # (time, kv tokens, fill rate)

    def record(self, now: float, kv_tokens: int, fill_rate: float) -> None:
        self._samples.append((now, kv_tokens, fill_rate))
        while self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def peak_kv_tokens(self) -> int:
        return max((s[1] for s in self._samples), default=0)

    def mean_kv_tokens(self) -> float:
        return sum(s[1] for s in self._samples) / len(self._samples) if self._samples else 0.0

    def mean_fill_rate(self) -> float:
        return sum(s[2] for s in self._samples) / len(self._samples) if self._samples else 0.0
