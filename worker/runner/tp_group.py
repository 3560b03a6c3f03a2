"""The tensor-parallel group: rank 0 in this process, ranks 1..N-1 in Ray actors.

    engine process (rank 0)                          Ray actors (ranks 1..N-1, one bundle each
    scheduler, engine, sampler                        of a STRICT_PACK placement group)
    TensorParallelRunner.forward(inputs)
      -- execute.remote(ops, inputs) ------------->   RankWorker.execute: block ops, same forward
      own forward on its shard <== gloo/NCCL ==>      on its shard (all-reduce after o_proj and
      ray.get(peer results, timeout)                  down_proj, all-gather of vocab logits)
      sample (rank 0 only)

Why step inputs travel as Ray calls and not as a torch.distributed broadcast (nano-vllm uses
shared memory + events): a step's inputs are a few host lists (StepInputs, BlockOps), a Ray
call costs well under a millisecond against a step of tens of milliseconds, and Ray hands
us actor-death detection for free: a peer killed mid-step makes rank 0's collective fail
(gloo sees the closed connection; the group timeout is the backstop) and `ray.get` raise
RayActorError, so the step fails with WorkerFailedError instead of hanging. A broadcast
would need a length-then-payload protocol and a receive loop on every rank that can itself
hang when rank 0 dies.

Failure and restart: the failed step's requests end with WorkerFailedError; the runner
sets `kv_lost` because the peers' KV shards are gone, and the engine then fails every other
request that held KV and forgets the prefix cache (no request may continue on half a
cache). The next forward rebuilds the group: new actors, a new store and process-group
generation, fresh peer caches; rank 0 keeps its model and rebinds its Collectives.

Ray: the group needs a running Ray. When none is initialised it starts a local one
(`ray.init(include_dashboard=False)`, RAY_AUTH_MODE=disabled). Rank 0's TCP store listens on
loopback, so every rank must share rank 0's node: the placement group is STRICT_PACK,
targeted at this node, and each peer's node is checked after it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.worker.parallel.distributed import Collectives, GroupAddress, join_group, start_store
from kvmesh.core.errors import WorkerFailedError
from kvmesh.worker.runner.awq_calibration import awq_results_for
from kvmesh.worker.runner.model_runner import BlockOps, ModelRunner, StepInputs
from kvmesh.worker.runner.model_setup import allocate_rank_caches, load_model, pick_backend, resolve_model
from kvmesh.worker.parallel.layers import check_splittable
from kvmesh.worker.parallel.placement import actor_resource_options, engine_runtime_env, rank_bundle

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # placement + model load on a busy machine


class RankWorker:
    """One peer rank (1..N-1): its model shard and KV shard; runs the forward rank 0 sends."""

    def __init__(self, config: KvmeshConfig, rank: int):
        # Each rank gets its own worker_num_cpus cores; torch's default (all cores per
        # process) would make N ranks fight over the same cores.
        torch.set_num_threads(config.parallel.engine_threads())
        self.config = config
        self.rank = rank
        self.runner: ModelRunner | None = None
        self.coll: Collectives | None = None
        self.model = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join(self, address: GroupAddress) -> None:
        self.coll = join_group(address, self.rank)

    def load(self, awq=None) -> None:
        """awq: rank 0's AWQ search results (int4_awq), the same for every rank."""
        self.spec = resolve_model(self.config)
        self.model = load_model(self.config, self.spec, self.coll, awq)

    def allocate(self, num_blocks: int, num_swap_blocks: int) -> None:
        kv, swap = allocate_rank_caches(self.config, self.spec, self.model, num_blocks, num_swap_blocks)
        self.runner = ModelRunner(self.model, pick_backend(self.config, self.spec.device), self.spec.device, kv, swap,
                                  self.config.cache.block_size)

    def execute(self, ops: BlockOps, inputs: StepInputs) -> None:
        self.runner.run_block_ops(ops)
        if not self.config.parallel.vocab_parallel:  # a replicated LM head: only rank 0 needs logits
            inputs = dataclasses.replace(inputs, sample_at=())
        self.runner.forward(inputs)  # vocab-parallel logits take part in the gather; rank 0 samples


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False)  # never join a stranger's cluster


class TensorParallelGroup:
    """Rank 0's handle on the group: starts, drives, watches and restarts the peer ranks."""

    def __init__(self, config: KvmeshConfig):
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.collective_timeout_s
        self.backend = "nccl" if config.parallel.device == "cuda" or (
            config.parallel.device == "auto" and torch.cuda.is_available()) else "gloo"
        self.generation = 0
        self.coll: Collectives | None = None  # rank 0's, shared with its model for its lifetime
        self.peers: list = []
        self._placement = None
        self.needs_restart = False
        self.awq = None  # int4_awq: the search results every rank quantizes with (also on restart)

    # ---- start / stop ----------------------------------------------------------------

    def start(self):
        """Start the peers and join the group; returns rank 0's model shard."""
        spec = resolve_model(self.config)
        check_splittable(spec.hf_config, self.world_size)
        if self.config.quant.weight == "int4_awq":  # calibrated once, on the full model, before any shard
            full = self.config.replace(quant={"weight": "none"})  # the full, unsharded float model
            self.awq = awq_results_for(self.config, spec, pick_backend(self.config, spec.device),
                                       lambda: load_model(full, spec))
        try:
            self._start_peers()
            loading = [p.load.remote(self.awq) for p in self.peers]  # peers load while rank 0 does
            model = load_model(self.config, spec, self.coll, self.awq)
            self._get(loading, _START_TIMEOUT_S, "loading the model shards")
        except BaseException:
            self.shutdown()
            raise
        return model

    def _start_peers(self) -> None:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _ensure_ray()
        par = self.config.parallel
        bundle = rank_bundle(par)
        here = ray.get_runtime_context().get_node_id()
        # A worker actor runs in bundle 0 of its engine's group (worker/parallel/placement.py):
        # the peers take bundles 1..N-1, so the engine holds exactly N bundles. Outside such an
        # actor (an in-process engine) the peers get a group of their own.
        engine_group = get_current_placement_group()
        if engine_group is not None and engine_group.bundle_count == self.world_size:
            group, first_bundle, self._placement = engine_group, 1, None
        else:
            if self.backend == "nccl":  # each peer drives a device of its own
                bundle.setdefault("GPU", 1.0)
            group = self._placement = placement_group([dict(bundle) for _ in range(self.world_size - 1)],
                                                      strategy="STRICT_PACK", _soft_target_node_id=here)
            first_bundle = 0
        self._get([group.ready()], _START_TIMEOUT_S, "placing the tensor-parallel ranks")
        actor_cls = ray.remote(RankWorker)
        self.peers = [
            actor_cls.options(**actor_resource_options(bundle), max_restarts=0, max_task_retries=0,
                              runtime_env=engine_runtime_env(par),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(group, first_bundle + i)
                              ).remote(self.config, rank)
            for i, rank in enumerate(range(1, self.world_size))]
        nodes = self._get([p.node_id.remote() for p in self.peers], _START_TIMEOUT_S, "starting the ranks")
        if any(n != here for n in nodes):
            self.shutdown()
            raise ConfigError("tensor-parallel ranks must share the engine's node (rank 0's store is on loopback); "
                              "no node had room for all of them")
        self.generation += 1
        store, port = start_store(self.world_size, self.timeout_s)
        address = GroupAddress(port, self.world_size, self.generation, self.timeout_s, self.backend)
        joining = [p.join.remote(address) for p in self.peers]
        joined = join_group(address, 0, store)  # blocks until every peer has joined
        self._get(joining, _START_TIMEOUT_S, "joining the group")
        if self.coll is None:
            self.coll = joined
        else:
            self.coll.adopt(joined)
        logger.info("tensor-parallel group gen %d up: %d ranks (%s)", self.generation, self.world_size, self.backend)

    def restart(self, num_blocks: int, num_swap_blocks: int) -> None:
        logger.warning("restarting tensor-parallel group (gen %d failed)", self.generation)
        self.shutdown()
        self._start_peers()
        self._get([p.load.remote(self.awq) for p in self.peers], _START_TIMEOUT_S, "reloading the model shards")
        self.allocate(num_blocks, num_swap_blocks)
        self.needs_restart = False

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for peer in self.peers:
            try:
                ray.kill(peer, no_restart=True)
            except Exception:  # already dead: nothing to end
                logger.debug("peer already gone", exc_info=True)
        self.peers = []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None
        if self.coll is not None:
            self.coll.close()

    # ---- one step ----------------------------------------------------------------------

    def allocate(self, num_blocks: int, num_swap_blocks: int) -> None:
        self._get([p.allocate.remote(num_blocks, num_swap_blocks) for p in self.peers], _START_TIMEOUT_S,
                  "allocating the KV shards")

    def launch(self, ops: BlockOps, inputs: StepInputs) -> list:
        return [p.execute.remote(ops, inputs) for p in self.peers]

    def collect(self, refs: list) -> None:
        self._get(refs, self.timeout_s, "running the step")

    def _get(self, refs: list, timeout_s: float, what: str):
        import ray

        try:
            return ray.get(refs, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as exc:
            self.needs_restart = True
            raise WorkerFailedError(f"tensor-parallel rank failed while {what}: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every block op and forward also runs on the peers, in the same order."""

    def __init__(self, group: TensorParallelGroup, plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group
        self.plan = plan
        self.kv_lost = False  # set when a rank died: every rank's KV must be considered gone
        self._pending_ops = BlockOps()
        group.allocate(plan.num_blocks, plan.num_swap_blocks)

    def run_block_ops(self, ops: BlockOps) -> None:
        super().run_block_ops(ops)
        self._pending_ops = ops  # shipped with the next forward, applied there before it

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        ops, self._pending_ops = self._pending_ops, BlockOps()
        if self.group.needs_restart:
            self.group.restart(self.plan.num_blocks, self.plan.num_swap_blocks)
        try:
            refs = self.group.launch(ops, inputs)
            logits = super().forward(inputs)
            self.group.collect(refs)
            return logits
        except Exception as exc:
            self.group.needs_restart = True
            self.kv_lost = True
            if isinstance(exc, WorkerFailedError):
                raise
            raise WorkerFailedError(f"tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        self.group.shutdown()
