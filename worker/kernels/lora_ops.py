"""Batched LoRA updates: the base projection runs once over the whole step, then each row
adds the low-rank update of its own adapter (Punica's idea, as S-LoRA and vLLM serve many
adapters in one batch).

For a projection y = x W^T with adapter s on row i:

    y[i] += (x[i] A_s^T) B_s^T          A_s: [r_s, in]  (shrink)   B_s: [out, r_s]  (expand)

with the adapter's scaling (lora_alpha / r) already folded into B_s at load time. The adapter
weights of a worker live in slot stacks (worker/runner/lora_slots.py), padded to the largest
rank:

    a_stack  [S, R, in]      slot s holds A_s in rows 0 .. r_s - 1, zeros after
    b_stack  [S, out, R]     slot s holds B_s in columns 0 .. r_s - 1, zeros after

`add_lora_segmented` is the CPU path: rows are grouped by slot once per step (RowGroups), and
each group runs the two small GEMMs on its rows with the slot's true rank (no padded work),
then scatters its update into `out`. Base rows (no adapter) are in no group and cost nothing.
`add_lora_reference` loops over rows one at a time: the plain definition the tests hold the
segmented path to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGroup:
    """The rows of one step that use adapter slot `slot` (sorted, [n] int64), or the contiguous
    range [start, end) when they are (one request's rows are contiguous: a prefill chunk)."""

    slot: int
    rows: torch.Tensor  # [n] int64
    start: int
    end: int
    contiguous: bool


@dataclass(frozen=True)
class RowGroups:
    """One step's rows grouped by adapter slot; built once per step, used by every projection."""

    groups: tuple[RowGroup, ...]
    num_rows: int

    @classmethod
    def build(cls, row_slots: list[int | None]) -> "RowGroups":
        """row_slots: [T] the adapter slot of each token row, None for a base row."""
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(row_slots):
            if slot is not None:
                by_slot.setdefault(slot, []).append(i)
        groups = []
        for slot, rows in sorted(by_slot.items()):
            start, end = rows[0], rows[-1] + 1
            groups.append(RowGroup(slot, torch.tensor(rows, dtype=torch.long), start, end, end - start == len(rows)))
        return cls(tuple(groups), len(row_slots))

    @property
    def empty(self) -> bool:
        return not self.groups


def add_lora_segmented(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                       ranks: list[int], groups: RowGroups) -> None:
    """out [T, out] += per-row LoRA update of x [T, in] (in place; `out` may be a column slice
    of a fused projection's output). ranks[s]: slot s's rank for this projection (0 = the
    adapter does not target it)."""
    for g in groups.groups:
        r = ranks[g.slot]
        if r == 0:
            continue
        a = a_stack[g.slot, :r]  # [r, in]
        b = b_stack[g.slot, :, :r]  # [out, r]
        if g.contiguous:
            rows = x[g.start:g.end]
            out[g.start:g.end] += (rows @ a.t()) @ b.t()
        else:
            delta = (x.index_select(0, g.rows) @ a.t()) @ b.t()
            out.index_add_(0, g.rows, delta)


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


@dataclass(frozen=True)
class LoraStep:
    """What one step's forward needs to add its rows' adapter updates: the slot stacks of the
    worker (worker/runner/lora_slots.py: a, b, ranks per (layer, projection)) and the step's
    rows grouped by slot. The model calls `add` after each base projection."""

    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    ranks: dict[tuple[int, str], list[int]]
    groups: RowGroups

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out_features] += the update of projection `module` of layer `layer`."""
        key = (layer, module)
        ranks = self.ranks.get(key)
        if ranks is not None:
            add_lora_segmented(out, x, self.a[key], self.b[key], ranks, self.groups)

    def add_fused(self, layer: int, modules: tuple[str, ...], sizes: list[int], x: torch.Tensor,
                  out: torch.Tensor) -> None:
        """Projections run as one GEMM (merged QKV, gate-up): `out` holds them side by side,
        sizes[i] columns each; each member's update goes to its own columns."""
        start = 0
        for module, size in zip(modules, sizes):
            self.add(layer, module, x, out[:, start:start + size])
            start += size
