"""A worker actor's own Prometheus figures, read the way a router replica reads them (its poll's
metrics snapshot), for benchmarks that look inside a served engine."""

from __future__ import annotations


def worker_metric(handle, name: str, **labels) -> float:
    """The sum of the samples called `name` (with at least `labels`) in the worker's snapshot."""
    import ray  # Ray: only where a cluster runs
    from prometheus_client.parser import text_string_to_metric_families  # with Ray, as above

    text = ray.get(handle.poll.remote(0)).metrics_snapshot.decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())
