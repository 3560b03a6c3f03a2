"""A worker's LoRA adapter slots: a bounded pool of resident adapters, loaded on demand, LRU.

    slots (lora.max_loras = 4):   [ a ][ b ][   ][ c ]      resident adapters; a running
    pins (requests using it):       2    0         1        request pins its adapter's slot
    LRU of unpinned residents:    b                         evicted first when a load needs a slot

Loading has two halves so the step thread never reads a file:

    start_load(key)   a loader thread reads and checks the PEFT files (worker/model/lora_weights.py)
    poll()            on the step thread, between steps: each finished read is copied into a free
                      slot, or the least recently used unpinned one (an eviction); a read with
                      no slot to take waits for a pin to drop

The weights of all slots live in stacks, A per (layer, projection group) and B^T per (layer,
projection), each slot at its adapter's own rank (the layout the segmented update reads,
worker/kernels/lora_ops.py):

    a[(layer, group)]    [S, members x R, in]   slot s: the members' A stacked, rank after rank
    b_t[(layer, proj)]   [S, R, out]            slot s: B^T in rows 0 .. r - 1
    groups[(layer, group)][s]   GroupSlot: views of slot s's rows at their ranks, None if untargeted

(R = lora.max_rank). A stack is allocated the first time an adapter targets its projection,
so projections no adapter touches cost no memory; `max_bytes` is what all of them would take,
what the device plan reserves (kv/device_plan.py). Rows past a slot's ranks are never read,
so a slot is reused without clearing. Not thread-safe except start_load: the engine's step
thread owns it.
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
from kvmesh.worker.kernels.lora_ops import GROUP_OF, LORA_GROUPS, GroupSlot
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
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, group) -> [S, members x R, in]
        self.b_t: dict[tuple[int, str], torch.Tensor] = {}  # (layer, projection) -> [S, R, out]
        # (layer, group) -> per slot its GroupSlot (views at the adapter's ranks) or None
        self.groups: dict[tuple[int, str], list[GroupSlot | None]] = {}
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
        for per_slot in self.groups.values():  # what the slot's previous adapter targeted
            per_slot[slot] = None
        by_group: dict[tuple[int, str], list[tuple[int, str]]] = collections.defaultdict(list)
        for layer, module in weights.modules:
            by_group[(layer, GROUP_OF[module][0])].append((layer, module))
        for (layer, group), keys in by_group.items():
            a_stack = self._a_stack(layer, group)
            members, offset = [], 0
            for key in sorted(keys, key=lambda k: GROUP_OF[k[1]][1]):  # member order, as the output columns
                a, b = weights.modules[key]
                r = a.shape[0]
                a_stack[slot, offset:offset + r].copy_(a)
                b_t = self._b_stack(key)[slot, :r]
                b_t.copy_(b.t())
                members.append((GROUP_OF[key[1]][1], offset, b_t))
                offset += r
            self.groups[(layer, group)][slot] = GroupSlot(a_stack[slot, :offset], tuple(members))
        self._ref_in[slot] = ref
        self._slot_of[ref] = slot
        self._lru[slot] = None
        self.num_loads += 1

    def _a_stack(self, layer: int, group: str) -> torch.Tensor:
        key = (layer, group)
        if key not in self.a:
            members = LORA_GROUPS[group]
            in_features = self._shapes[members[0]][1]
            self.a[key] = torch.zeros(self.num_slots, len(members) * self.max_rank, in_features, dtype=self.dtype,
                                      device=self.device)
            self.groups[key] = [None] * self.num_slots
        return self.a[key]

    def _b_stack(self, key: tuple[int, str]) -> torch.Tensor:
        if key not in self.b_t:
            out_features = self._shapes[key[1]][0]
            self.b_t[key] = torch.zeros(self.num_slots, self.max_rank, out_features, dtype=self.dtype,
                                        device=self.device)
        return self.b_t[key]

    def module_weights(self, layer: int, module: str, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [r, in], B [out, r]) of `module` in `slot`, views; None where untargeted (tests)."""
        group, index = GROUP_OF[module]
        entry = self.groups.get((layer, group), [None] * self.num_slots)[slot]
        for member, offset, b_t in () if entry is None else entry.members:
            if member == index:
                return entry.a[offset:offset + b_t.shape[0]], b_t.t()
        return None

    @property
    def allocated_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b_t.values()))

    @staticmethod
    def max_bytes(hf_config, num_slots: int, max_rank: int, dtype: torch.dtype) -> int:
        """The stacks' bytes once adapters have targeted every projection of every layer: the
        most this pool allocates (the device plan reserves it before sizing the KV pool)."""
        per_rank = sum(out_features + in_features for out_features, in_features in projection_shapes(hf_config).values())
        return num_slots * max_rank * hf_config.num_hidden_layers * per_rank * torch.empty((), dtype=dtype).element_size()

    # ---- figures --------------------------------------------------------------------------

    def stats(self) -> AdapterSlotStats:
        resident = tuple(ref.name for ref in self._ref_in if ref is not None)
        return AdapterSlotStats(self.num_slots, len(resident), self.num_loads, self.num_evictions,
                                self.num_load_failures, self.load_time_s, resident)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
