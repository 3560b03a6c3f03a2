"""Where an engine's ranks run: one Ray bundle per tensor-parallel rank, all on one node.

    engine (TP = N)          placement group "kvmesh-pg-<app>-<index>", STRICT_PACK, detached
      rank 0  WorkerActor    bundle 0  {CPU: c, GPU: 1}      (or {CPU: c, <resource>: 1})
      rank 1  RankWorker     bundle 1  {CPU: c, GPU: 1}
      ...
      rank N-1               bundle N-1

The group asks for exactly N GPUs: rank 0 takes one like every other rank (it uses one device),
and the peers go into the same group's other bundles (worker/runner/tp_group.py finds the group
with `ray.util.get_current_placement_group()`). STRICT_PACK keeps every rank on rank 0's node,
which its loopback TCP store needs. The group is detached and named after the worker actor, so
a restarted actor lands in its own bundle again and the group dies only with `kill_workers`.

The Helm chart gives each worker pod `engine_total(...)`'s GPUs (helm/kvmesh/templates/
rayservice.yaml: tensor_parallel_size of them); tests/test_helm_chart.py checks both agree.
"""

from __future__ import annotations

import logging

from kvmesh.core.config import ConfigError, ParallelConfig

logger = logging.getLogger(__name__)

PLACEMENT_GROUP_PREFIX = "kvmesh-pg-"


def rank_bundle(parallel: ParallelConfig) -> dict[str, float]:
    """The Ray resources one rank holds: its CPUs plus one unit of the worker resource."""
    bundle: dict[str, float] = {"CPU": float(parallel.worker_num_cpus or 0.0)}
    if parallel.worker_resource:
        bundle[parallel.worker_resource] = 1.0
    return {k: v for k, v in bundle.items() if v > 0}


def engine_bundles(parallel: ParallelConfig) -> list[dict[str, float]]:
    """One bundle per tensor-parallel rank, rank 0 first."""
    return [rank_bundle(parallel) for _ in range(parallel.tensor_parallel_size)]


def engine_total(parallel: ParallelConfig) -> dict[str, float]:
    """What one engine asks of Ray in all (the chart sizes a worker pod from the same numbers)."""
    total: dict[str, float] = {}
    for bundle in engine_bundles(parallel):
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def actor_resource_options(bundle: dict[str, float]) -> dict:
    """Ray actor options asking for exactly `bundle` (GPU and CPU are options of their own)."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0), "resources": custom}


def engine_runtime_env(parallel: ParallelConfig) -> dict:
    """The Ray runtime_env of an engine's processes (a worker actor, a tensor-parallel rank):
    the OpenMP spin of parallel.cpu_spin_count, which libgomp reads once, when torch loads it."""
    if parallel.cpu_spin_count is None:
        return {}
    return {"env_vars": {"GOMP_SPINCOUNT": str(parallel.cpu_spin_count)}}


def placement_group_name(actor_name: str) -> str:
    return PLACEMENT_GROUP_PREFIX + actor_name


def missing_resources(need: dict[str, float], nodes: list[dict[str, float]]) -> str:
    """Why no node can hold `need`, naming the resource ("" when one can): compares with the
    node that comes closest (the most of the scarcest resource)."""
    if any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
        return ""
    if not nodes:
        return "the cluster has no alive node"
    short = []
    for name, amount in sorted(need.items()):
        best = max(node.get(name, 0.0) for node in nodes)
        if best < amount:
            short.append(f"{name}: needs {amount:g} on one node, the largest node has {best:g}")
    return "; ".join(short) or "no single node has all of them at once"


def _alive_node_totals() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def engine_placement_group(parallel: ParallelConfig, actor_name: str):
    """The engine's placement group (found, or created and waited for); None for TP = 1.

    Raises ConfigError naming the missing resource when the group cannot be placed within
    parallel.placement_timeout_s (the group is removed again, so nothing stays pending)."""
    if parallel.tensor_parallel_size == 1:
        return None
    from ray.util import get_placement_group
    from ray.util.placement_group import placement_group, remove_placement_group

    name = placement_group_name(actor_name)
    try:
        group = get_placement_group(name)
    except ValueError:  # not created yet (another router replica may be creating it right now)
        try:
            group = placement_group(engine_bundles(parallel), strategy="STRICT_PACK", name=name,
                                    lifetime="detached")
        except ValueError:  # lost the race: it exists now
            group = get_placement_group(name)
    timeout_s = parallel.placement_timeout_s
    if not group.wait(timeout_seconds=timeout_s):
        need = engine_total(parallel)
        why = missing_resources(need, _alive_node_totals()) or "the resources are held by other work"
        remove_placement_group(group)
        raise ConfigError(
            f"cannot place a tensor-parallel engine of {parallel.tensor_parallel_size} ranks "
            f"({', '.join(f'{k} {v:g}' for k, v in sorted(need.items()))} on one node) within "
            f"{timeout_s:g} s: {why} (parallel.placement_timeout_s waits longer for an autoscaler)")
    return group


def remove_engine_placement_group(actor_name: str) -> bool:
    """Remove the engine's placement group if it exists; True when one was removed."""
    from ray.util import get_placement_group
    from ray.util.placement_group import remove_placement_group

    try:
        group = get_placement_group(placement_group_name(actor_name))
    except ValueError:
        return False
    remove_placement_group(group)
    return True
