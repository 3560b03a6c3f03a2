"""Predicted time to first token on a worker, from its reported work and a step-cost model.

The predicted-latency policy (router/routing.py) scores each worker by how soon it would
produce this request's first token, as llm-d's latency-predictor scorer does, but from a
model of our own engine's step rather than a trained network:

    step_s = step_overhead_s + P x prefill_s_per_token + D x decode_s_per_token

for a step of P prefill tokens and D decoding sequences (`StepCostModel`; the routing
simulator runs its engines on the same model, and `load_tests/routing_sim.py --measure` fits
it to the real engine). A request arriving at worker w must wait for the work ahead of it
and then compute its own uncached prompt:

    ahead_w   = tokens_to_compute_w + router in-flight tokens_w     (the load, routing.py)
    prefill_w = ahead_w + uncached prompt tokens on w               (prefix cache hits excluded)
    steps_w   = ceil(prefill_w / (max_num_batched_tokens - D_w))   D_w = its running requests
    TTFT_w    = prefill_w x prefill_s_per_token + steps_w x (step_overhead_s + D_w x decode_s_per_token)

The work ahead counts the output still to come of running requests at the prefill rate (the
stats do not split it out): an over-estimate where outputs are long, the same on every
worker for a given backlog. Only the ranking of workers decides routing, so a model that is
off by a constant factor routes the same; `TtftCalibration` learns that factor online from
the TTFT workers report (predicted vs actual, the metric `kvmesh_route_ttft_error_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.core.seams import WorkerStats


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per engine step: overhead + prefill tokens x per-token + decoding sequences x
    per-sequence. Defaults: the embedded SmolLM2 engine on one Sapphire Rapids core
    (`routing_sim.measure_cost_model`); a GPU engine is ~10-50x faster per token."""

    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 0.0004
    decode_s_per_token: float = 0.0025

    def step_s(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (self.step_overhead_s + prefill_tokens * self.prefill_s_per_token
                + decode_tokens * self.decode_s_per_token)


def uncached_prompt_tokens(num_prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker holding `matched_blocks` leading blocks must still compute (its
    last prompt token is always computed, as the worker caps a match)."""
    cached = min(matched_blocks * block_size, max(0, num_prompt_tokens - 1))
    return num_prompt_tokens - cached


def predict_ttft_s(cost: StepCostModel, stats: WorkerStats, extra_tokens: int, uncached_tokens: int,
                   max_num_batched_tokens: int) -> float:
    """Seconds from arrival at the worker to this request's first token (module docstring)."""
    decoding = stats.num_running
    prefill = stats.tokens_to_compute + extra_tokens + uncached_tokens
    steps = max(1, math.ceil(prefill / max(1, max_num_batched_tokens - decoding)))
    return prefill * cost.prefill_s_per_token + steps * (cost.step_overhead_s + decoding * cost.decode_s_per_token)


class TtftCalibration:
    """Predicted vs actual TTFT: the factor actual / predicted (an exponential mean of its log,
    so one slow outlier moves it little) and the mean absolute relative error of the raw
    predictions. One per router replica; the simulator keeps one too."""

    def __init__(self, weight: float = 0.05) -> None:
        self._weight = weight
        self._log_factor = 0.0
        self.num_observed = 0
        self._abs_relative_error_sum = 0.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0 or actual_s <= 0:
            return
        self._log_factor += self._weight * (math.log(actual_s / predicted_s) - self._log_factor)
        self.num_observed += 1
        self._abs_relative_error_sum += abs(actual_s - predicted_s) / actual_s

    @property
    def factor(self) -> float:
        """actual ~ factor x predicted (1.0 before any observation)."""
        return math.exp(self._log_factor)

    def calibrated_s(self, predicted_s: float) -> float:
        return predicted_s * self.factor

    def mean_abs_relative_error(self) -> float:
        """Mean |actual - predicted| / actual of the raw predictions (0.0 before any)."""
        return self._abs_relative_error_sum / self.num_observed if self.num_observed else 0.0
