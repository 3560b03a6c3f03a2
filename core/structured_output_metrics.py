"""A worker's structured-output figures as Prometheus samples (names in one place).

The engine fills `StructuredOutputFigures` (worker/engine_loop/structured_output.py); the
worker actor registers a `StructuredOutputCollector` on its EngineMetrics registry, so the
figures ride in the snapshot the router renders on /metrics:

    kvmesh_structured_requests_total{worker, kind}            constrained requests (json_schema, regex, ...)
    kvmesh_grammar_cache_total{worker, result="hit"|"miss"}   compiled-grammar cache lookups
    kvmesh_grammar_compile_seconds_total{worker}              compile-thread seconds (mean = / misses)
    kvmesh_structured_mask_seconds_total{worker}              step-thread seconds computing token masks
    kvmesh_spec_skipped_total{worker, reason="structured_output"}   request-steps not speculated
    kvmesh_step_phase_seconds{phase="mask"}                   (EngineMetrics) mask time per step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PREFIX = "kvmesh_"
SPEC_SKIP_STRUCTURED = "structured_output"


@dataclass(frozen=True)
class StructuredOutputFigures:
    num_requests: dict[str, int] = field(default_factory=dict)  # kind -> requests
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    compile_s_total: float = 0.0
    mask_s_total: float = 0.0
    num_spec_skipped: int = 0


class StructuredOutputCollector:
    """A prometheus_client custom collector reading the figures at snapshot time."""

    def __init__(self, worker_id: str, figures: Callable[[], StructuredOutputFigures | None]):
        self.worker_id = worker_id
        self._figures = figures

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        f = self._figures()
        if f is None:
            return
        w = self.worker_id
        requests = CounterMetricFamily(PREFIX + "structured_requests", "Requests with a structured-output constraint.",
                                       labels=["worker", "kind"])
        for kind, count in sorted(f.num_requests.items()):
            requests.add_metric([w, kind], count)
        yield requests
        cache = CounterMetricFamily(PREFIX + "grammar_cache", "Compiled-grammar cache lookups.",
                                    labels=["worker", "result"])
        cache.add_metric([w, "hit"], f.num_cache_hits)
        cache.add_metric([w, "miss"], f.num_cache_misses)
        yield cache
        yield _one(PREFIX + "grammar_compile_seconds", "Seconds compiling grammars (compile thread).", w,
                   f.compile_s_total)
        yield _one(PREFIX + "structured_mask_seconds", "Seconds computing token masks on the step thread.", w,
                   f.mask_s_total)
        skipped = CounterMetricFamily(PREFIX + "spec_skipped", "Request-steps that did not speculate, by reason.",
                                      labels=["worker", "reason"])
        skipped.add_metric([w, SPEC_SKIP_STRUCTURED], f.num_spec_skipped)
        yield skipped


def _one(name: str, doc: str, worker_id: str, value: float):
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=["worker"])
    family.add_metric([worker_id], value)
    return family
