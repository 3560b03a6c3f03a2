"""Pull a prefix's KV from another worker, or recompute it? A cost model from measured rates.

    recompute_s = missing_tokens / prefill_tokens_per_s            (this worker's measured prefill)
    pull_s      = overhead_s + missing_bytes / transfer_bytes_per_s  (measured pulls, Ray included)
    pull when pull_s < recompute_s

Both rates are exponentially weighted means of what this worker measured (prefill steps
from its step reports, pulls from their wall time); until one is measured its prior stands
(`TransferPriors`). A pull that failed or timed out is counted as a very slow one, so pulls
that keep failing stop being tried (the worker recomputes) until the measured prefill rate
makes them worth it again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferPriors:
    prefill_tokens_per_s: float = 2_000.0  # a small model on a few CPU cores
    transfer_bytes_per_s: float = 200e6  # Ray object transfer on one node, with (de)serialisation
    overhead_s: float = 0.02  # an actor call round trip
    weight: float = 0.3  # of each new measurement in the running means
    min_prefill_tokens: int = 32  # steps with fewer prefill tokens say little about the rate


class TransferCostModel:
    def __init__(self, priors: TransferPriors = TransferPriors()):
        self.priors = priors
        self.prefill_tokens_per_s = priors.prefill_tokens_per_s
        self.transfer_bytes_per_s = priors.transfer_bytes_per_s
        self.num_prefill_samples = 0
        self.num_transfer_samples = 0

    def _mix(self, old: float, new: float, first: bool) -> float:
        return new if first else (1 - self.priors.weight) * old + self.priors.weight * new

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < self.priors.min_prefill_tokens or seconds <= 0:
            return
        self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, num_tokens / seconds,
                                              self.num_prefill_samples == 0)
        self.num_prefill_samples += 1

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        self.transfer_bytes_per_s = self._mix(self.transfer_bytes_per_s, num_bytes / seconds,
                                              self.num_transfer_samples == 0)
        self.num_transfer_samples += 1

    def observe_failure(self, num_bytes: int, timeout_s: float) -> None:
        """A failed pull costs what waiting for it did, at least its timeout's worth."""
        self.observe_transfer(max(num_bytes, 1), max(timeout_s, self.priors.overhead_s))

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def pull_s(self, num_bytes: int) -> float:
        return self.priors.overhead_s + num_bytes / self.transfer_bytes_per_s

    def pull_is_cheaper(self, num_tokens: int, num_bytes: int) -> bool:
        return num_tokens > 0 and self.pull_s(num_bytes) < self.recompute_s(num_tokens)
