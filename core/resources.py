"""How many CPUs each worker rank asks Ray for, so the defaults fit the machine they run on.

`parallel.worker_num_cpus` left unset (None) is derived when the app is built, from the CPUs
Ray reports for the cluster:

    share = (cluster CPUs - CPUs the router replicas need) / worker ranks, floored to 0.05,
            at most DEFAULT_WORKER_NUM_CPUS

    2 CPUs, 2 workers, 1 router replica:  (2 - 2 x 0.25) / 2 = 0.75 each
    (the router reserve counts one replica more than configured: Serve starts a new replica
    before stopping the old one on an update, and that one must be placeable too)

Measured before this existed: `kvmesh serve --workers 2` on a 2-CPU machine left the second
worker pending on {'CPU': 1.0} forever, the cluster half up and saying nothing. Now a share
below MIN_WORKER_NUM_CPUS, or an explicit value the cluster cannot hold, fails at start with
a message naming the setting.
"""

from __future__ import annotations

import dataclasses
import math

from kvmesh.core.config import ConfigError, KvmeshConfig

DEFAULT_WORKER_NUM_CPUS = 1.0  # one core per rank when the machine has them
MIN_WORKER_NUM_CPUS = 0.05
_GRANULE_CPUS = 0.05


def worker_rank_count(config: KvmeshConfig) -> int:
    """Ranks of every engine: the main workers and the degradation ladder's fallback pool."""
    engines = config.parallel.num_workers + config.degradation.fallback_pool.num_workers
    return engines * config.parallel.tensor_parallel_size


def derive_worker_num_cpus(cluster_cpus: float, num_ranks: int, router_cpus: float) -> float:
    """The CPU request per worker rank that lets every rank and the router fit (see module doc)."""
    share = (cluster_cpus - router_cpus) / max(1, num_ranks)
    share = math.floor(share / _GRANULE_CPUS + 1e-9) * _GRANULE_CPUS
    if share < MIN_WORKER_NUM_CPUS:
        raise ConfigError(
            f"{num_ranks} worker rank(s) do not fit on {cluster_cpus:g} CPUs next to the router "
            f"({router_cpus:g} CPUs): lower --workers / --tp, or set parallel.worker_num_cpus "
            f"(e.g. --set parallel.worker_num_cpus=0) to oversubscribe on purpose")
    return round(min(DEFAULT_WORKER_NUM_CPUS, share), 2)


def resolve_worker_num_cpus(config: KvmeshConfig, cluster_cpus: float, router_cpus: float) -> KvmeshConfig:
    """`config` with parallel.worker_num_cpus set: derived when unset, checked when given."""
    ranks = worker_rank_count(config)
    given = config.parallel.worker_num_cpus
    if given is None:
        derived = derive_worker_num_cpus(cluster_cpus, ranks, router_cpus)
        return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, worker_num_cpus=derived))
    if given * ranks + router_cpus > cluster_cpus + 1e-9:
        raise ConfigError(
            f"parallel.worker_num_cpus={given:g} x {ranks} worker rank(s) + {router_cpus:g} for the router "
            f"exceeds the {cluster_cpus:g} CPUs Ray sees: some workers would never start. Lower "
            f"--set parallel.worker_num_cpus=..., or leave it unset to derive it from the CPUs")
    return config
