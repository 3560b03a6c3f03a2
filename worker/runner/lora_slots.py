"""A worker's LoRA adapter slots: a bounded pool of resident adapters, loaded on demand, LRU.

    slots (lora.max_loras = 4):   [ a ][ b ][   ][ c ]      resident adapters; a running
    pins (requests using it):       2    0         1        request pins its adapter's slot
    LRU of unpinned residents:    b                         evicted first when a load needs a slot

Loading has two halves so the step thread never reads a file:

    start_load(key)   a loader thread reads and checks the PEFT files (worker/model/lora_weights.py)
    poll()            on the step thread, between steps: each finished read is copied into a free
                      slot, or the least recently used unpinned one (an eviction); a read with
                      no slot to take waits for a pin to drop

The weights of all slots live in stacks per (layer, projection), padded to lora.max_rank,
the layout batched LoRA kernels index by slot (worker/kernels/lora_ops.py):

    a[(layer, proj)]  [S, R, in]     b[(layer, proj)]  [S, out, R]     ranks[(layer, proj)]  [S]

A stack is allocated the first time an adapter targets its projection, so projections no
adapter touches cost no memory. Not thread-safe except start_load: the engine's step thread
owns it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.core.seams import AdapterRef
from kvmesh.worker.model.lora_weights import LoraWeights, load_peft_adapter, projection_shapes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSlotStats:
    num_slots: int
    num_slots_used: int
    num_loads: int
    num_evictions: int
    num_load_failures: int
    load_time_s: float  # loader-thread seconds spent reading adapters, all loads
    resident: tuple[str, ...]  # adapter names in slots


class AdapterSlots:
    def __init__(self, hf_config, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 reader: Callable[[AdapterRef], LoraWeights] | None = None):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._shapes = projection_shapes(hf_config)
        self._read = reader or (lambda ref: load_peft_adapter(ref.name, ref.path, hf_config, dtype, max_rank))
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], list[int]] = {}
        # All slots side by side per projection, for the two-GEMM update (lora_ops.add_lora_stacked):
        # (a_cat [S * R, in], b_cat [out, S * R], R) with R the largest rank resident there;
        # rebuilt when an install changes that projection.
        self.packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._slot_of: dict[AdapterRef, int] = {}
        self._ref_in: list[AdapterRef | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unpinned resident slots
        self._loading: dict[AdapterRef, concurrent.futures.Future] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-lora-load")
        self.num_loads = self.num_evictions = self.num_load_failures = 0
        self.load_time_s = 0.0

    # ---- residency ------------------------------------------------------------------------

    def slot_of(self, ref: AdapterRef) -> int | None:
        return self._slot_of.get(ref)

    def is_loading(self, ref: AdapterRef) -> bool:
        return ref in self._loading

    def pin(self, ref: AdapterRef) -> int:
        slot = self._slot_of[ref]
        self._pins[slot] += 1
        self._lru.pop(slot, None)
        return slot

    def unpin(self, ref: AdapterRef) -> None:
        slot = self._slot_of[ref]
        assert self._pins[slot] > 0, "unpinning an adapter nobody pinned"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._lru[slot] = None  # most recently used last

    # ---- loading --------------------------------------------------------------------------

    def start_load(self, ref: AdapterRef) -> None:
        """Read `ref` in the loader thread unless it is resident or already being read."""
        if ref in self._slot_of or ref in self._loading:
            return
        self._loading[ref] = self._executor.submit(self._timed_read, ref)

    def _timed_read(self, ref: AdapterRef) -> tuple[LoraWeights, float]:
        started = time.perf_counter()
        weights = self._read(ref)
        return weights, time.perf_counter() - started

    def poll(self) -> tuple[list[AdapterRef], dict[AdapterRef, BaseException]]:
        """Install finished reads (step thread): (installed refs, {ref: the error of a failed read})."""
        installed: list[AdapterRef] = []
        failed: dict[AdapterRef, BaseException] = {}
        for ref, future in list(self._loading.items()):
            if not future.done():
                continue
            exc = future.exception()
            if exc is not None:
                del self._loading[ref]
                self.num_load_failures += 1
                failed[ref] = exc
                continue
            slot = self._free_slot(keep=installed)
            if slot is None:
                continue  # every slot is pinned: wait for a request to finish
            del self._loading[ref]
            weights, seconds = future.result()
            self._install(slot, ref, weights)
            self.load_time_s += seconds
            installed.append(ref)
        return installed, failed

    def wait_loads(self, timeout_s: float | None = None) -> None:
        """Block until every read in flight is done (tests and start-up preloads)."""
        concurrent.futures.wait(list(self._loading.values()), timeout=timeout_s)

    def _free_slot(self, keep: list[AdapterRef]) -> int | None:
        """An empty slot, or the least recently used unpinned one emptied; never the slot of an
        adapter in `keep` (installed in this poll: its waiting requests have not pinned it yet)."""
        for slot, ref in enumerate(self._ref_in):
            if ref is None:
                return slot
        kept = {self._slot_of[ref] for ref in keep}
        slot = next((s for s in self._lru if s not in kept), None)
        if slot is None:
            return None
        del self._lru[slot]
        evicted = self._ref_in[slot]
        del self._slot_of[evicted]
        self._ref_in[slot] = None
        self.num_evictions += 1
        logger.debug("adapter %s evicted from slot %d", evicted.name, slot)
        return slot

    def _install(self, slot: int, ref: AdapterRef, weights: LoraWeights) -> None:
        changed = set(weights.modules)
        for key, ranks in self.ranks.items():  # clear what the slot's previous adapter left:
            if ranks[slot]:  # the packed update reads every slot up to the largest rank
                ranks[slot] = 0
                self.a[key][slot].zero_()
                self.b[key][slot].zero_()
                changed.add(key)
        for key, (a, b) in weights.modules.items():
            a_stack, b_stack = self._stacks(key)
            r = a.shape[0]
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            a_stack[slot, :r].copy_(a)
            b_stack[slot, :, :r].copy_(b)
            self.ranks[key][slot] = r
        for key in changed:
            self._pack(key)
        self._ref_in[slot] = ref
        self._slot_of[ref] = slot
        self._lru[slot] = None
        self.num_loads += 1

    def _pack(self, key: tuple[int, str]) -> None:
        rank = max(self.ranks[key])
        if rank == 0:
            self.packed.pop(key, None)
            return
        a, b = self.a[key], self.b[key]  # [S, R_max, in], [S, out, R_max]
        a_cat = a[:, :rank].reshape(-1, a.shape[-1]).contiguous()
        b_cat = b[:, :, :rank].permute(1, 0, 2).reshape(b.shape[1], -1).contiguous()
        self.packed[key] = (a_cat, b_cat, rank)

    def _stacks(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.a:
            out_features, in_features = self._shapes[key[1]]
            s, r = self.num_slots, self.max_rank
            self.a[key] = torch.zeros(s, r, in_features, dtype=self.dtype, device=self.device)
            self.b[key] = torch.zeros(s, out_features, r, dtype=self.dtype, device=self.device)
            self.ranks[key] = [0] * s
        return self.a[key], self.b[key]

    # ---- figures --------------------------------------------------------------------------

    def stats(self) -> AdapterSlotStats:
        resident = tuple(ref.name for ref in self._ref_in if ref is not None)
        return AdapterSlotStats(self.num_slots, len(resident), self.num_loads, self.num_evictions,
                                self.num_load_failures, self.load_time_s, resident)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
