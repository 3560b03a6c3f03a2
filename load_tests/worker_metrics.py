"""A worker actor's own Prometheus figures, read the way a router replica reads them (its poll's
metrics snapshot), for benchmarks that look inside a served engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerMetrics:
    """One snapshot of a worker's metrics, parsed once; read as many figures from it as needed."""

    samples: tuple  # prometheus_client Samples (name, labels, value, ...)

    def total(self, name: str, **labels) -> float:
        """The sum of the samples called `name` (with at least `labels`)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())


def read_worker_metrics(handle) -> WorkerMetrics:
    """The worker's metrics now: one poll of its actor."""
    import ray  # Ray: only where a cluster runs
    from prometheus_client.parser import text_string_to_metric_families  # with Ray, as above

    text = ray.get(handle.poll.remote(0)).metrics_snapshot.decode()
    return WorkerMetrics(tuple(s for f in text_string_to_metric_families(text) for s in f.samples))
