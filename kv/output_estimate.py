"""How many output tokens a request will probably produce, learned from finished ones.

Admission on expected output (`scheduler.admission_reserve: expected`) reserves a request's
prompt plus this estimate instead of its whole max_tokens, so more requests run at once when
clients ask for far more than they use. Pure bookkeeping (no torch), in kv/ beside the one
KV-cost rule (kv_cost.py) because two sides use it: the worker's admission
(worker/engine_loop/admission.py) and the router's cost of a request in front of such
workers (router/router_core.py), each learning from the requests it saw finish. Per tenant (each tenant's traffic has its own shape):

    estimate = min(max_tokens, max(floor, quantile_q(last WINDOW outputs of the tenant)))

and max_tokens itself until the tenant has MIN_SAMPLES finished requests (nothing is known
yet; a wrong guess costs preemptions). Only requests that ended by themselves (stop
condition or max_tokens) teach it; cancelled or failed ones say nothing about length.

When a request outgrows its estimate, the scheduler tops its reservation up block by block
(so admission sees the real commitment) and preemption is the safety valve if the pool
runs short meanwhile; both are counted.
"""

from __future__ import annotations

import collections
import math

WINDOW = 256  # finished requests remembered per tenant
MIN_SAMPLES = 8  # finished requests before the estimate replaces max_tokens


class OutputLengthEstimator:
    def __init__(self, floor_tokens: int, quantile: float):
        self.floor_tokens = floor_tokens
        self.quantile = quantile
        self._outputs: dict[str, collections.deque[int]] = {}

    def observe(self, tenant_id: str, num_output_tokens: int) -> None:
        self._outputs.setdefault(tenant_id, collections.deque(maxlen=WINDOW)).append(num_output_tokens)

    def estimate(self, tenant_id: str, max_tokens: int) -> int:
        """Output tokens to reserve for a new request of this tenant asking for max_tokens."""
        seen = self._outputs.get(tenant_id)
        if seen is None or len(seen) < MIN_SAMPLES:
            return max_tokens
        ordered = sorted(seen)
        # Nearest rank: the smallest observed length covering `quantile` of the requests.
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        return min(max_tokens, max(self.floor_tokens, ordered[rank - 1]))
