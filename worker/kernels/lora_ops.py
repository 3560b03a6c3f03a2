"""Batched LoRA updates: the base projection runs once over the whole step, then each row
adds the low-rank update of its own adapter (Punica's idea, as S-LoRA and vLLM serve many
adapters in one batch).

For a projection y = x W^T with adapter s on row i:

    y[i] += (x[i] A_s^T) B_s^T          A_s: [r_s, in]  (shrink)   B_s: [out, r_s]  (expand)

with the adapter's scaling (lora_alpha / r) already folded into B_s at load time. The adapter
weights of a worker live in slot stacks (worker/runner/lora_slots.py), padded to the largest
rank, and packed side by side per projection (R = the largest rank resident there):

    a_stack  [S, R_max, in]   slot s holds A_s in rows 0 .. r_s - 1, zeros after
    b_stack  [S, out, R_max]  slot s holds B_s in columns 0 .. r_s - 1, zeros after
    a_cat    [S * R, in]      = a_stack[:, :R] flattened: slot s in rows s*R .. s*R + R - 1
    b_cat    [out, S * R]     = b_stack[:, :, :R] side by side: slot s in columns s*R ..

`add_lora_stacked` is the path the engine runs (CPU and GPU alike): one shrink GEMM of every
row against every slot, a mask keeping each row's own slot (segmented by slot without a
loop), one expand GEMM. A first version looped over adapter groups (index_select, two small
GEMMs, index_add per group and projection): about 4x slower at 64 decode rows over 4 adapters
on this CPU, the loop's launches dominating. `add_lora_reference` loops over rows one at a
time: the plain definition the tests hold the stacked path to.
"""

from __future__ import annotations

import torch


def slot_mask(row_slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S * rank]: 1 where column j belongs to row i's slot (j // rank == slot), else 0;
    row_slots [T] int64 with -1 for base rows (all zeros)."""
    col_slot = torch.arange(num_slots * rank, device=row_slots.device) // rank
    return (row_slots[:, None] == col_slot[None, :]).to(dtype)


def add_lora_stacked(out: torch.Tensor, x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor,
                     mask: torch.Tensor) -> None:
    """out [T, out] += ((x a_cat^T) * mask) b_cat^T, every slot's update in two GEMMs.

    a_cat [S * R, in] and b_cat [out, S * R] hold all slots side by side (slot s in columns
    s*R .. s*R + R - 1, zero-padded past its rank); `mask` (slot_mask) keeps each row's own
    slot's R columns of the shrink, so the expand adds exactly that slot's update (zeros for
    base rows). S * R extra columns of work instead of one small GEMM pair per adapter: on
    CPU at decode sizes, fewer, larger GEMMs beat a Python loop over adapter groups."""
    out += ((x @ a_cat.t()) * mask) @ b_cat.t()


def add_lora_reference(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                       ranks: list[int], row_slots: list[int | None]) -> torch.Tensor:
    """The definition, one row at a time; returns a new tensor (never modifies its inputs)."""
    result = out.clone()
    for i, slot in enumerate(row_slots):
        if slot is None or ranks[slot] == 0:
            continue
        r = ranks[slot]
        a, b = a_stack[slot, :r], b_stack[slot, :, :r]
        result[i] += (x[i:i + 1] @ a.t() @ b.t())[0]
    return result


class LoraStep:
    """What one step's forward needs to add its rows' adapter updates: the worker's packed
    slot weights (worker/runner/lora_slots.py `packed`: per (layer, projection) all slots side
    by side) and each row's slot. The model calls `add` after each base projection."""

    def __init__(self, packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]],
                 row_slots: list[int | None], num_slots: int, dtype: torch.dtype, device: torch.device):
        self.packed = packed
        self.num_slots = num_slots
        self._row_slots = torch.tensor([-1 if s is None else s for s in row_slots], dtype=torch.long, device=device)
        self._dtype = dtype
        self._masks: dict[int, torch.Tensor] = {}  # padded rank -> slot_mask, built once per step

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out_features] += the update of projection `module` of layer `layer`."""
        packed = self.packed.get((layer, module))
        if packed is None:
            return
        a_cat, b_cat, rank = packed
        mask = self._masks.get(rank)
        if mask is None:
            mask = self._masks[rank] = slot_mask(self._row_slots, self.num_slots, rank, self._dtype)
        add_lora_stacked(out, x, a_cat, b_cat, mask)

    def add_fused(self, layer: int, modules: tuple[str, ...], sizes: list[int], x: torch.Tensor,
                  out: torch.Tensor) -> None:
        """Projections run as one GEMM (merged QKV, gate-up): `out` holds them side by side,
        sizes[i] columns each; each member's update goes to its own columns."""
        start = 0
        for module, size in zip(modules, sizes):
            self.add(layer, module, x, out[:, start:start + size])
            start += size
