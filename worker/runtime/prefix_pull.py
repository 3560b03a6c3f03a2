"""Pulling a prompt's prefix KV from the worker the router named (GenerateRequest.kv_source)
into this worker's host tier before the request is queued, when the cost model says the pull
beats recomputing (kv/transfer_cost.py); any failure or timeout falls back to recompute.

    this worker                                   holder (Ray actor, by name)
    local_prefix_blocks -> have h of n blocks
    cost: (n - h) blocks pull_s < recompute_s ?
       export_prefix.remote(tokens, keys, h) ---> blocks h.. it holds (pool or tier), checksums
    import_prefix: own hash + tokens + checksum per block, into the host tier
    queue the request: its admission copies those blocks from the tier like any tier hit

Transfer figures (blocks, bytes, seconds, fallbacks) feed the worker's kvmesh_kv_* metrics
(core/kv_tier_metrics.py) and a kvmesh.worker.kv_pull span under the request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvmesh.core import telemetry
from kvmesh.core.seams import GenerateRequest
from kvmesh.core.step_phases import StepReport
from kvmesh.kv.transfer_cost import TransferCostModel
from kvmesh.worker.engine_loop.kv_transfer import import_prefix, local_prefix_blocks, shareable_blocks

logger = logging.getLogger(__name__)

SPAN_KV_PULL = "kvmesh.worker.kv_pull"


class PrefixPuller:
    def __init__(self, engine, namespace: str, timeout_s: float = 5.0, mode: str = "auto",
                 cost: TransferCostModel | None = None, tracer=None):
        self._engine = engine  # AsyncEngine
        self._namespace = namespace
        self.timeout_s = timeout_s
        self.mode = mode  # cache.kv_transfer: auto | always | never
        self.cost = cost or TransferCostModel()
        self._tracer = tracer
        self._peers: dict[str, object] = {}
        self.num_pulls = 0
        self.num_blocks_in = 0
        self.num_bytes_in = 0
        self.transfer_s = 0.0
        self.num_fallbacks = 0
        self.num_skipped_by_cost = 0

    def observe_step_report(self, report: StepReport) -> None:
        """The prefill rate the cost model weighs pulls against (a StepPhaseClock observer)."""
        self.cost.observe_prefill(report.prefill_tokens, report.total_s)

    async def pull(self, request: GenerateRequest, prompt_ids: list[int]) -> int:
        """Blocks stored in this worker's tier for the request (0: nothing pulled). Never raises."""
        engine = self._engine.engine
        store = engine.parts.host_tier_store
        if not request.kv_source or store is None or self.mode == "never":
            return 0
        tokens = list(prompt_ids) + list(request.resume_token_ids)
        extra_keys = self._engine.block_extra_keys(request.cache_salt, request.adapter)
        have = await self._engine.locked_async(local_prefix_blocks, tokens, extra_keys)
        wanted = shareable_blocks(len(tokens), engine.block_size) - have
        num_bytes = wanted * store.bytes_per_block
        if wanted <= 0 or (self.mode == "auto" and not self.cost.pull_is_cheaper(wanted * engine.block_size,
                                                                                   num_bytes)):
            self.num_skipped_by_cost += wanted > 0
            return 0
        span = (telemetry.start_worker_span(self._tracer, request, SPAN_KV_PULL) if self._tracer is not None
                else _no_span())
        with span as s:
            started = time.perf_counter()
            try:
                peer = await self._peer(request.kv_source)
                export = await asyncio.wait_for(_awaited(peer.export_prefix.remote(tokens, extra_keys, have)),
                                                self.timeout_s)
                result = await self._engine.locked_async(import_prefix, export, tokens, extra_keys)
            except Exception as exc:  # the holder died, timed out, or refused: recompute instead
                elapsed = time.perf_counter() - started
                self.num_fallbacks += 1
                self.cost.observe_failure(num_bytes, elapsed)
                logger.warning("prefix pull from %s failed (%s); recomputing", request.kv_source, type(exc).__name__)
                if s is not None:
                    s.set_attribute("kvmesh.kv_pull.outcome", "fallback")
                return 0
            elapsed = time.perf_counter() - started
            self.num_pulls += 1
            self.num_blocks_in += result.num_stored
            self.num_bytes_in += export.num_bytes
            self.transfer_s += elapsed
            self.cost.observe_transfer(export.num_bytes, elapsed)
            if s is not None:
                s.set_attributes({"kvmesh.kv_pull.outcome": "pulled", "kvmesh.kv_pull.source": request.kv_source,
                                  "kvmesh.kv_pull.blocks": result.num_stored, "kvmesh.kv_pull.bytes": export.num_bytes,
                                  "kvmesh.kv_pull.seconds": elapsed})
            return result.num_stored

    async def _peer(self, actor_name: str):
        handle = self._peers.get(actor_name)
        if handle is None:
            import ray  # in the worker process only (Ray runs it)

            handle = await asyncio.to_thread(ray.get_actor, actor_name, self._namespace)
            self._peers[actor_name] = handle
        return handle


async def _awaited(ref):
    return await ref


class _no_span:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
