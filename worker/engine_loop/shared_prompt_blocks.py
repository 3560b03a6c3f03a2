"""Full prompt blocks live requests share on one worker: which ones admitted requests will
hold (claims, counted by chain hash before anyone has computed them), whether a block a
waiting request needs is being prefilled by a running one right now, and the pins that keep
a block counted for the waiting requests admitted against it. The scheduler charges a
newcomer nothing for a block another live request holds or will compute, and the router
reads the same set (`SchedulerStats.held_block_hashes`) to judge fit from the same numbers."""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.kv.kv_cache_manager import KVCacheManager, PrefixMatch
from kvmesh.worker.engine_loop.request import Request


class SharedPromptBlocks:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        # chain hash -> unfinished requests whose prompt holds that full block
        self._claims: dict[bytes, int] = {}

    def claim(self, request: Request, sign: int) -> None:
        """Count (sign +1) or forget (-1) the full prompt blocks an admitted request will hold."""
        for block_hash in request.block_hashes[:self._num_shareable_blocks(request)]:
            count = self._claims.get(block_hash, 0) + sign
            if count:
                self._claims[block_hash] = count
            else:
                del self._claims[block_hash]

    def held_block_hashes(self) -> frozenset[bytes]:
        return frozenset(self._claims)

    def claimed_blocks_after(self, request: Request, pinned_tokens: int) -> int:
        """Prompt blocks after the pinned prefix that an admitted request's prompt also holds
        (same chain hash): computed once by that one, shared by this one."""
        if self.kv.prefix_cache is None:
            return 0
        start = pinned_tokens // self.kv.block_size
        claimed = 0
        for block_hash in request.block_hashes[start:self._num_shareable_blocks(request)]:
            if block_hash not in self._claims:
                break
            claimed += 1
        return claimed

    def in_progress(self, request: Request, num_matched_blocks: int, running: Iterable[Request]) -> bool:
        """True when the block after the request's cached prefix is one a running request is
        still prefilling (same chain hash, not yet computed). Admitting it now would compute
        the same prefix twice, in the same batch, and cache one copy; waiting a step or a few
        (the other's prefill chunks) turns all of it into a cache hit. Measured in the routing
        simulator at 16 in flight: without this, a family's concurrent requests each
        computed the whole 528-token prefix (hit rate 0.82 of a possible 0.91).
        A preempted or finished leader no longer counts, so nobody waits forever."""
        if (self.kv.prefix_cache is None or request.num_computed_tokens
                or num_matched_blocks >= len(request.block_hashes)):
            return False
        wanted = request.block_hashes[num_matched_blocks]
        bs = self.kv.block_size
        for other in running:
            first_uncomputed = other.num_computed_tokens // bs
            if wanted in other.block_hashes[first_uncomputed:other.num_prompt_tokens // bs]:
                return True
        return False

    def pin_for_claimants(self, waiting: Iterable[Request]) -> None:
        """Before a request lets its blocks go: waiting requests admitted against prompt blocks
        another request was computing (claimed, not pinned: `claimed_blocks_after`) pin those
        now resident, as far as they counted them. Else the blocks fell out of the committed
        total between their computer's end and the claimant's start (nobody held them), the
        worker admitted into that room, and the claimant's start added them back past the
        budget (or, evicted meanwhile, topped its reservation up): refusals of requests the
        router had admitted on the worker's own report (the 2-worker campaign at 16 in flight)."""
        if self.kv.prefix_cache is None:
            return
        block = self.kv.block_size
        for request in waiting:
            if request.num_reserved_cached_tokens <= request.num_pinned_tokens or request.num_computed_tokens:
                continue
            match = self.kv.match_prefix(request)
            num_blocks = min(len(match.block_ids), request.num_reserved_cached_tokens // block)
            if num_blocks * block > request.num_pinned_tokens:
                self.kv.extend_pin(request, PrefixMatch(match.block_ids[:num_blocks], num_blocks * block))
                request.num_pinned_tokens = num_blocks * block

    def _num_shareable_blocks(self, request: Request) -> int:
        # As a prefix match is capped: the last prompt token is always computed.
        return min(len(request.block_hashes), (request.num_prompt_tokens - 1) // self.kv.block_size)
