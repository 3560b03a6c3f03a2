"""Process-group plumbing for tensor parallelism: join, collectives with timeouts, leave.

A `Collectives` object is what the model sees: `rank`, `world_size`, `all_reduce(x)` and
`all_gather_last_dim(x)`. At world size 1 both are no-ops that return their input, so the
single-rank model runs exactly the code it ran before tensor parallelism existed.

Groups are built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` objects on a loopback
`TCPStore`, never through `torch.distributed.init_process_group`: the global default group
is one per process, and a worker that rebuilds its group after a rank dies (or a test
process that builds groups of 2 and 4 one after another) needs several over its lifetime.
Every collective has a timeout (gloo's process-group timeout), so a dead peer turns into a
`WorkerFailedError` within `timeout_s` instead of a hang; gloo usually notices sooner, when
the peer's TCP connection closes.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvmesh.core.errors import WorkerFailedError

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # every rank of a group sits on one node (STRICT_PACK placement)


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0's store listens, and which generation of the group this is (a rebuilt
    group uses a fresh key prefix so stale keys from a dead generation never match)."""

    port: int
    world_size: int
    generation: int
    timeout_s: float
    backend: str  # "gloo" | "nccl"


class Collectives:
    """The collectives one rank runs; a no-op at world size 1."""

    def __init__(self, rank: int = 0, world_size: int = 1, process_group=None, store=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._pg = process_group
        self._store = store  # kept alive: rank 0's store is the server the others dial
        self.broken = False
        self.collective_s = 0.0  # wall time spent in collectives (incl. waiting for slower ranks)
        self.num_collectives = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks (in place on x when it is contiguous)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        self._wait(self._pg.allreduce([x]), "all_reduce")
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._wait(self._pg.allgather([parts], [x]), "all_gather")
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        if self.world_size > 1:
            self._wait(self._pg.allreduce([torch.zeros(1)]), "barrier")

    def _wait(self, work, what: str) -> None:
        if self.broken:
            raise WorkerFailedError(f"tensor-parallel group is broken; {what} refused")
        started = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: peer closed its connection, or the timeout passed
            self.broken = True
            raise WorkerFailedError(f"tensor-parallel {what} failed on rank {self.rank}: {exc}") from exc
        finally:
            self.collective_s += time.perf_counter() - started
            self.num_collectives += 1

    def adopt(self, other: "Collectives") -> None:
        """Take over a rebuilt group's connection (the model keeps holding this object)."""
        if (other.rank, other.world_size) != (self.rank, self.world_size):
            raise ValueError("a rebuilt group must keep each rank's place")
        self._pg, self._store, self.broken = other._pg, other._store, False

    def close(self) -> None:
        self.broken = True
        self._pg = None
        self._store = None


def single_rank() -> Collectives:
    return Collectives(0, 1)


def start_store(world_size: int, timeout_s: float):
    """Rank 0's TCP store on a free loopback port; returns (store, port)."""
    store = dist.TCPStore(LOOPBACK, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port


def join_group(address: GroupAddress, rank: int, store=None) -> Collectives:
    """Blocks until all `address.world_size` ranks have joined (or the store times out)."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if store is None:
        store = dist.TCPStore(LOOPBACK, address.port, address.world_size, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"kvmesh-tp/{address.generation}/", store)
    if address.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, opts)
    elif address.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        opts._timeout = timeout
        pg = dist.ProcessGroupGloo(prefixed, rank, address.world_size, opts)
    else:
        raise ValueError(f"unknown collective backend {address.backend!r}")
    logger.info("rank %d joined tensor-parallel group gen %d (%d ranks, %s)", rank, address.generation,
                address.world_size, address.backend)
    return Collectives(rank, address.world_size, pg, store)
