"""Batched LoRA updates: the base projection runs once over the whole step, then each row
adds the low-rank update of its own adapter (Punica's idea, as S-LoRA and vLLM serve many
adapters in one batch).

For a projection y = x W^T with adapter s on row i:

    y[i] += (x[i] A_s^T) B_s^T          A_s: [r_s, in]  (shrink)   B_s: [out, r_s]  (expand)

with the adapter's scaling (lora_alpha / r) already folded into B_s at load time.

Segments. The runner orders a step's requests by adapter slot (base rows first), so each
slot's rows are one contiguous run of the flat token batch, a segment (SGMV's layout: vLLM's
`sgmv_shrink` / `sgmv_expand`, S-LoRA's segments):

    rows   [ base | base | s0 s0 s0 | s2 | s2 s2 ]      segments ((0, 2, 5), (2, 5, 8))
                                                          (slot, first row, past the last row)

and the update is two GEMMs per segment at the adapter's own rank, written in place into the
segment's rows of the projection's output (`addmm_`: no temporary of the output's width, no
copy). Base rows cost nothing. Projections that read the same input (q/k/v, gate/up) shrink
together: the slot pool keeps their A matrices stacked (worker/runner/lora_slots.py), so one
GEMM gives every member's low-rank activations and each member expands its own columns.

It replaced (docs/benchmarks.md, "LoRA") one shrink of every row against all slots side by
side, masked to the row's own slot, then one expand: four times the FLOPs at 4 slots, base
rows included; the segmented update is cheaper from about 32 rows a step, the masked one at
a few rows per adapter (one call per segment and projection is what the segments pay).
Correctness never depends on the order: any order gives more, shorter segments, never a
wrong row. `add_lora_reference` is the per-row definition the tests hold the segmented path to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Projections that read the same input and whose outputs the model computes side by side:
# their updates share one shrink GEMM. Keyed by group name, members in output column order.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
GROUP_OF: dict[str, tuple[str, int]] = {m: (g, i) for g, members in LORA_GROUPS.items() for i, m in enumerate(members)}


@dataclass(frozen=True)
class GroupSlot:
    """One slot's adapter on one projection group of one layer (views into the slot stacks).

    a:        [sum of member ranks, in]  the members' A matrices stacked (one shrink GEMM)
    members:  (member index in the group, first row of its A in `a`, B^T [rank, out]) for each
              member the adapter targets"""

    a: torch.Tensor
    members: tuple[tuple[int, int, torch.Tensor], ...]


def segments_of(row_slots: Sequence[int | None]) -> tuple[tuple[int, int, int], ...]:
    """Runs of equal adapter slot over a step's rows: ((slot, start, stop), ...); base rows
    (None) belong to none."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(row_slots) + 1):
        if i == len(row_slots) or row_slots[i] != row_slots[start]:
            if row_slots[start] is not None:
                segments.append((row_slots[start], start, i))
            start = i
    return tuple(segments)


def add_lora_segments(outs: Sequence[torch.Tensor], x: torch.Tensor, per_slot: Sequence[GroupSlot | None],
                      segments: Sequence[tuple[int, int, int]]) -> None:
    """outs[j] [T, out_j] (views allowed) += each segment's adapter update of group member j.

    x [T, in]: the group's input; per_slot[s]: the group's weights in slot s (None: the slot's
    adapter does not target the group)."""
    for slot, start, stop in segments:
        group = per_slot[slot]
        if group is None:
            continue
        low_rank = x[start:stop] @ group.a.t()  # [rows, sum of ranks]: every member's shrink at once
        for member, offset, b_t in group.members:
            outs[member][start:stop].addmm_(low_rank[:, offset:offset + b_t.shape[0]], b_t)


def add_lora_reference(out: torch.Tensor, x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                       row_slots: Sequence[int | None]) -> torch.Tensor:
    """The definition, one row at a time; weights[s] = (A [r, in], B [out, r]) of slot s or
    None; returns a new tensor (never modifies its inputs)."""
    result = out.clone()
    for i, slot in enumerate(row_slots):
        if slot is None or weights[slot] is None:
            continue
        a, b = weights[slot]
        result[i] += (x[i:i + 1] @ a.t() @ b.t())[0]
    return result


class LoraStep:
    """What one step's forward needs to add its rows' adapter updates: the worker's slot
    weights per (layer, group) (worker/runner/lora_slots.py `groups`) and the step's segments.
    The model calls `add` after each base projection (group)."""

    def __init__(self, groups: dict[tuple[int, str], list[GroupSlot | None]],
                 segments: Sequence[tuple[int, int, int]]):
        self.groups = groups
        self.segments = segments

    @property
    def num_rows(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)

    def add(self, layer: int, group: str, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """outs: the group's member outputs (LORA_GROUPS order; column views of one fused
        output are fine) += their updates."""
        per_slot = self.groups.get((layer, group))
        if per_slot is not None:
            add_lora_segments(outs, x, per_slot, self.segments)
