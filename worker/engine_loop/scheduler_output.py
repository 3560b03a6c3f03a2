"""What one scheduler step tells the model runner to do.

The engine executes a SchedulerOutput in this order, before and around the forward:

    1. swap_out     copy device block -> CPU block      (preempted with mode swap)
    2. swap_in      copy CPU block -> device block      (resumed swapped requests)
    3. copy_blocks  copy device block -> device block   (copy-on-write for n > 1 forks)
    4. forward      for each ScheduledRequest, feed token_ids at positions
                    num_computed_tokens .. num_computed_tokens + num_scheduled_tokens - 1,
                    writing KV through block_ids (slot = block_ids[pos // bs] * bs + pos % bs)
    5. sample       one token for each ScheduledRequest with `sample` set, then
                    Scheduler.update_from_output(output, {request_id: token_id})
                    (a speculating entry feeds its last known token + spec_token_ids; the
                    runner verifies the drafts and also returns the accepted ones)

Swap-outs come first because a device block released by a swap-out may be handed to
another request in the same step; its bytes must leave before anything overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.worker.engine_loop.request import Request, RequestStatus

BlockPair = tuple[int, int]  # (source block, destination block)


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request  # live engine object: sampling params, group, ids
    num_scheduled_tokens: int
    num_computed_tokens: int  # position of the first scheduled token
    token_ids: tuple[int, ...]  # all_token_ids[num_computed_tokens : + num_scheduled_tokens]
    block_ids: tuple[int, ...]  # the block table as of this step (covers every scheduled slot)
    sample: bool  # the chunk reaches the last known token: the runner samples a next token
    # Drafted tokens scheduled after the last known token (speculative decoding): token_ids
    # is (last known token, *spec_token_ids) and num_scheduled_tokens is 1 + their count.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    status: RequestStatus  # FINISHED, CANCELLED, REJECTED or FAILED


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    scheduled: tuple[ScheduledRequest, ...] = ()  # running order: earlier entries were served first
    preempted_ids: tuple[str, ...] = ()
    swap_out: tuple[BlockPair, ...] = ()  # (device block, CPU block)
    swap_in: tuple[BlockPair, ...] = ()  # (CPU block, device block)
    copy_blocks: tuple[BlockPair, ...] = ()  # (device block, device block)
    # Requests that reached a terminal state since the previous step's output (aborted,
    # finished by the engine, rejected on queue timeout); their blocks are already free.
    finished: tuple[FinishedRequest, ...] = ()
    token_budget: int = 0  # the step's max_num_batched_tokens, for the batch fill rate
    # Host-tier copies (kv/host_tier.py): stores (device block, host slot, block hash) run
    # first, loads (host slot, device block) after the block copies above, both before the forward.
    tier_stores: tuple[tuple[int, int, bytes], ...] = ()
    tier_loads: tuple[BlockPair, ...] = ()

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        """Nothing to run (the engine may sleep until a request arrives)."""
        return not (self.scheduled or self.swap_out or self.swap_in or self.copy_blocks)
