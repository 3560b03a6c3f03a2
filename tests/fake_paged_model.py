"""A torch-free stand-in for the model runner, for the scheduler and KV bookkeeping tests.

Its "KV cache" is a token id per slot. It executes a SchedulerOutput the way the engine does
(swap-out, swap-in, copy-on-write copies, then the forward writes every scheduled token at
its slot through the block table) and samples

    next token = f(the whole history read back through the block table)

so a wrong block table, a missed copy, a swap to the wrong block or a foreign block served
from the prefix cache changes the output (or trips the unwritten-slot assertion), and a run
under pressure can be compared token for token with an unpressured run.
"""

from __future__ import annotations

from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.engine_loop.scheduler import Scheduler
from kvmesh.worker.engine_loop.scheduler_output import SchedulerOutput


def next_token(history: list[int]) -> int:
    state = 0
    for token in history:
        state = (state * 31 + token + 1) % 1_000_003
    return state % 1000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What an unpressured, uncached run produces for this prompt."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakePagedModel:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, num_tier_blocks: int = 0):
        self.block_size = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tier: list[list[int | None]] = [[None] * block_size for _ in range(num_tier_blocks)]
        self.num_forward_tokens = 0

    def tier_checksum(self, slot: int) -> int:
        return hash(tuple(self.tier[slot]))

    def attach(self, scheduler: Scheduler) -> "FakePagedModel":
        """Check host-tier content on lookup as the engine does (the tier's bytes live here)."""
        if scheduler.kv.host_tier is not None:
            scheduler.kv.host_tier.verify = lambda slot, checksum: self.tier_checksum(slot) == checksum
        return self

    def _slot(self, block_ids: tuple[int, ...], position: int) -> tuple[list[int | None], int]:
        return self.device[block_ids[position // self.block_size]], position % self.block_size

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        for device_block, slot, _ in output.tier_stores:
            self.tier[slot] = list(self.device[device_block])
        for device_block, cpu_block in output.swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in output.swap_in:
            self.device[device_block] = list(self.cpu[cpu_block])
        for source, destination in output.copy_blocks:
            self.device[destination] = list(self.device[source])
        for slot, device_block in output.tier_loads:
            self.device[device_block] = list(self.tier[slot])
        for entry in output.scheduled:
            for position, token in zip(entry.positions, entry.token_ids):
                block, offset = self._slot(entry.block_ids, position)
                block[offset] = token
            self.num_forward_tokens += entry.num_scheduled_tokens
        sampled = {}
        for entry in output.scheduled:
            if entry.sample:
                history = []
                for position in range(entry.positions.stop):
                    block, offset = self._slot(entry.block_ids, position)
                    assert block[offset] is not None, f"{entry.request_id} read unwritten slot {position}"
                    history.append(block[offset])
                sampled[entry.request_id] = next_token(history)
        return sampled


def engine_step(scheduler: Scheduler, model: FakePagedModel) -> SchedulerOutput:
    """One engine iteration: schedule, run, update, finish at max_tokens, check invariants."""
    output = scheduler.schedule()
    sampled = model.execute(output)
    for _, slot, block_hash in output.tier_stores:
        scheduler.kv.host_tier.confirm(slot, block_hash, model.tier_checksum(slot))
    scheduler.update_from_output(output, sampled)
    done = [r.request_id for r in scheduler.running if r.num_output_tokens >= r.sampling.max_tokens]
    scheduler.finish_requests(done)
    scheduler.check_integrity()
    return output


def run_until_idle(scheduler: Scheduler, model: FakePagedModel, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished():
        assert len(outputs) < max_steps, "the scheduler made no progress"
        outputs.append(engine_step(scheduler, model))
    return outputs


def assert_pool_whole(scheduler: Scheduler) -> None:
    """Every block is free or cached with zero references, and swap space is empty."""
    kv = scheduler.kv
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in kv.pool.blocks)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.swap.num_used_blocks == 0
    assert scheduler.admission.reserved_tokens == 0 and scheduler.admission.owed_tokens == 0
    if kv.host_tier is not None:  # entries stay (a cache), but none is held by a load
        assert kv.host_tier.num_held_slots == 0


def outputs_of(requests: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in requests}
