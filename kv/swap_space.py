"""CPU swap space: bookkeeping of the host blocks that hold swapped-out requests' KV.

The engine sizes it (cache.swap_space_gib / bytes per block -> num_cpu_blocks) and moves the
bytes; this class only decides which CPU block receives which device block. A swapped-out
request owns its CPU blocks until it is swapped back in or finishes; there is no sharing
and no caching here, so the state is just a free list and an owner map.
"""

from __future__ import annotations

from collections import deque


class SwapSpace:
    def __init__(self, num_cpu_blocks: int):
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_cpu_blocks = num_cpu_blocks
        self._free: deque[int] = deque(range(num_cpu_blocks))
        self._owned: dict[str, list[int]] = {}  # request_id -> CPU blocks, block-table order

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_cpu_blocks - len(self._free)

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._owned

    def take(self, request_id: str, num_blocks: int) -> list[int]:
        assert request_id not in self._owned, f"{request_id} is already swapped out"
        assert self.can_hold(num_blocks), "take() beyond the swap space: check can_hold first"
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._owned[request_id] = blocks
        return blocks

    def give_back(self, request_id: str) -> list[int]:
        """Return the request's CPU blocks to the free list (swap-in done, or discarded)."""
        blocks = self._owned.pop(request_id, [])
        self._free.extend(blocks)
        return blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._owned.get(request_id, ()))

    def check_integrity(self) -> None:
        owned = [b for blocks in self._owned.values() for b in blocks]
        everything = owned + list(self._free)
        assert len(everything) == len(set(everything)) == self.num_cpu_blocks, "CPU blocks lost or doubly owned"
