"""Quantized self-draft: the served model's own weights, quantized (int8 or int4 weight-only,
quant/linear.py), guess the next k tokens for the full-precision model.

No second checkpoint to download: the draft is loaded from the same folder at start. Its KV
lives in its own small paged pool (a KVCacheManager of its own, no prefix caching), one
`DraftSequence` per request. The draft proposes its argmax at each position (one-hot
drafts, see worker/runner/rejection_sampler.py).

What the draft's KV holds is decided by tokens, not by bookkeeping of accept/reject: at each
proposal its cached tokens are compared with the request's current tokens and cut back to
the common prefix, so rejected drafts, preemption and recompute all roll back the same way.

    request tokens   [p0 .. pn  a1 a2 x]      a1 a2 accepted drafts, x the target's token
    draft KV         [p0 .. pn  a1 a2 d3]     d3 rejected: cut to the common prefix
    this proposal    feeds x (and anything else not yet cached), then k - 1 single tokens
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch import nn

from kvmesh.kv.kv_cache_manager import KVCacheManager, PrefixMatch
from kvmesh.quant.linear import Int8WeightOnlyLinear
from kvmesh.worker.engine_loop.draft_proposers import DraftAsk
from kvmesh.worker.engine_loop.scheduler_output import ScheduledRequest
from kvmesh.worker.runner.cpu_model_runner import CpuModelRunner
from kvmesh.worker.runner.model_runner import ModelRunner, StepInputs, allocate_kv_caches
from kvmesh.worker.runner.model_setup import load_model, pick_backend, resolve_model, with_valid_group_size

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DraftSequence:
    """One request's tokens in the draft's KV (the KVRequest fields the manager reads)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens fed (their KV is cached), then pending
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # unused: no prefix caching in the draft pool
    extra_keys: tuple[str, ...] = ()
    lora_slot: int | None = None  # the draft runs the base weights (StepInputs reads every entry's slot)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


class _Int8LMHead(nn.Module):
    """The draft's LM head in int8 (per vocabulary row): on a small model the head is a large
    share of the bytes a decode step reads (SmolLM2-135M: 28M of 135M parameters), and the
    draft only needs its argmax right most of the time. World size 1: nothing to gather.

    On CPU the head runs as a dynamically quantized int8 x int8 GEMM (torch's quantized
    engine: the activation row is quantized per call, the weight prepacked once for VNNI /
    AMX-int8), which reads the int8 weight at memory speed; the weight-only int8 kernel
    converts each weight to bf16 first and is compute-bound. SmolLM2's 49152 x 576 head, one
    token, 1 thread on this project's Sapphire Rapids machine: 3.0 vs 7.2 ms (4.5 vs 12.0
    under load), its best rows rescored exactly (see forward). Elsewhere (CUDA, or a torch without the quantized engine) it stays the
    weight-only Int8WeightOnlyLinear. Either way the verify forward of the full-precision
    model decides which drafts are kept, so the head's rounding changes only acceptance."""

    def __init__(self, weight: torch.Tensor, vocab_size: int):
        super().__init__()
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
        dense.weight.data = weight.detach()
        self.linear = Int8WeightOnlyLinear.from_linear(dense)
        self.vocab_size = vocab_size
        self._dynamic = _prepack_dynamic_int8(self.linear.weight_int8, self.linear.scales)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._dynamic is None or hidden.dim() != 2:
            return self.linear(hidden)
        x = hidden.float()
        logits = torch.ops.quantized.linear_dynamic(x, self._dynamic, False)
        # The activation is quantized per tensor, so outliers in the hidden state blur the
        # ranking (SmolLM2, chat prompts, teacher-forced: the argmax matched the target's at
        # 0.88 of positions vs 0.94 with the weight-only head). Rescore the few best rows
        # with the unquantized activation; the argmax is then the weight-only head's
        # whenever it is among them. Only the draft's argmax reads these logits.
        top = logits.topk(_RESCORED_ROWS, dim=-1).indices  # [N, R]
        rows = self.linear.weight_int8[top].float()  # [N, R, H]
        exact = torch.bmm(rows, x[:, :, None])[:, :, 0] * self.linear.scales[top].float()
        return logits.scatter_(1, top, exact)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :self.vocab_size]


_RESCORED_ROWS = 8  # vocabulary rows the draft head rescores exactly per token


def _prepack_dynamic_int8(weight_int8: torch.Tensor, scales: torch.Tensor):
    """The int8 weight prepacked for torch's dynamic-quantized linear (CPU), or None where
    that engine is missing or refuses it."""
    if weight_int8.device.type != "cpu" or not torch.backends.quantized.supported_engines:
        return None
    try:
        with warnings.catch_warnings():  # the quantized-tensor constructor warns of its future
            warnings.simplefilter("ignore")
            zero_points = torch.zeros(weight_int8.shape[0], dtype=torch.long)
            q = torch._make_per_channel_quantized_tensor(weight_int8, scales.double(), zero_points, 0)
            return torch.ops.quantized.linear_prepack(q, None)
    except (RuntimeError, AttributeError) as exc:
        logger.info("self-draft LM head: no dynamic int8 kernel (%s); weight-only int8", exc)
        return None


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class DraftModel:
    """The self-draft's model, loaded before the engine's memory plan so its weights count."""

    model: nn.Module
    config: object  # the draft's KvmeshConfig (its quant, TP 1, no CUDA graphs)
    spec: object  # its ModelSpec (device, dtype, hf_config)


def load_draft(config) -> DraftModel:
    """This model's weights quantized to speculative.draft_quant, whole on this process (rank 0
    under tensor parallelism)."""
    draft_config = config.replace(quant={"weight": config.speculative.draft_quant},
                                  parallel={"tensor_parallel_size": 1, "cuda_graphs": False})
    model_spec = resolve_model(draft_config)
    draft_config = with_valid_group_size(draft_config, model_spec.hf_config)
    model = load_model(draft_config, model_spec)
    head = model.lm_head  # a kept int8 group table (GGUF Q8_0) gives its float rows for the per-row copy
    weight = head.dequantized_weight() if hasattr(head, "dequantized_weight") else head.weight
    model.lm_head = _Int8LMHead(weight, model_spec.hf_config.vocab_size)
    return DraftModel(model, draft_config, model_spec)


class SelfDraftProposer:
    method = "self_draft"

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, clock=time.perf_counter):
        self.runner = runner
        self.kv = kv
        self._seqs: dict[str, DraftSequence] = {}
        # Measured at start, in the engine's forward clock: one draft (a single-token forward
        # of the draft), and what each further row of a forward adds, in such forwards: the
        # draft's catch-up reads run through int8 kernels whose cost grows with the rows
        # much faster than the target's forward does.
        self.prior_s_per_token, self._forwards_per_row = self._calibrate(clock)

    def _calibrate(self, clock, repeats: int = 3) -> tuple[float, float]:
        many_rows = min(32, self.kv.capacity_tokens - 8)  # a tiny pool calibrates with fewer rows
        if many_rows < 2:
            return 0.0, 0.0  # no room to measure: the speculator learns from real steps
        seq = DraftSequence("__calibration__", token_ids=[0] * (8 + many_rows))
        self.kv.allocate(seq, seq.num_tokens, PrefixMatch([], 0))
        try:
            def timed(num_rows: int) -> float:
                entry = ScheduledRequest(request=seq, num_scheduled_tokens=num_rows, num_computed_tokens=8,
                                         token_ids=(0,) * num_rows, block_ids=tuple(seq.block_ids), sample=True)
                inputs = StepInputs.build([entry], self.kv.block_size)
                self.runner.forward(inputs)  # first-call allocations
                started = clock()
                for _ in range(repeats):
                    self.runner.forward(inputs)
                return (clock() - started) / repeats

            one, many = timed(1), timed(many_rows)
            return one, max(0.0, (many - one) / ((many_rows - 1) * one)) if one > 0 else 0.0
        finally:
            self.kv.free(seq)

    @classmethod
    def from_config(cls, config, parts) -> "SelfDraftProposer":
        """The draft parts.draft (loaded before the memory plan, which counts its weights), with
        its own KV pool of parts.plan.num_draft_blocks blocks."""
        draft_config, model_spec, model = parts.draft.config, parts.draft.spec, parts.draft.model
        block_size = parts.plan.block_size
        num_blocks = parts.plan.num_draft_blocks
        caches = allocate_kv_caches(model_spec.hf_config.num_hidden_layers, num_blocks, block_size,
                                    model.num_kv_heads, model.head_dim, model_spec.dtype, model_spec.device)
        backend = pick_backend(draft_config, model_spec.device)
        if model_spec.device.type == "cpu":
            # The draft's steps are small (a token or a short catch-up per speculating request):
            # on CPU they run as one native call where it applies (int8 draft weights and head),
            # several times cheaper than the eager forward; only acceptance can change with it.
            runner = CpuModelRunner(model, backend, caches, None, block_size, self_draft=True)
        else:
            runner = ModelRunner(model, backend, model_spec.device, caches, None, block_size)
        logger.info("self-draft: %s weights, %d KV blocks x %d tokens", config.speculative.draft_quant, num_blocks,
                    block_size)
        clock = time.process_time if model_spec.device.type == "cpu" else time.perf_counter
        return cls(runner, KVCacheManager(num_blocks, block_size, enable_prefix_caching=False), clock)

    def propose(self, asks: Sequence[DraftAsk]) -> dict[str, list[int]]:
        live = [a for a in asks if self._catch_up(a)]
        drafts: dict[str, list[int]] = {a.request.request_id: [] for a in live}
        self._feed_long_catch_ups([self._seqs[a.request.request_id] for a in live])
        while live:
            seqs = [self._seqs[a.request.request_id] for a in live]
            entries = [ScheduledRequest(request=s, num_scheduled_tokens=s.num_tokens - s.num_computed_tokens,
                                        num_computed_tokens=s.num_computed_tokens,
                                        token_ids=tuple(s.token_ids[s.num_computed_tokens:]),
                                        block_ids=tuple(s.block_ids), sample=True) for s in seqs]
            logits = self.runner.forward(StepInputs.build(entries, self.kv.block_size))
            next_live = []
            for ask, seq, token in zip(live, seqs, logits.argmax(dim=-1).tolist()):
                seq.num_computed_tokens = seq.num_tokens
                out = drafts[ask.request.request_id]
                out.append(token)
                # Feed the draft back for the next position, if one is wanted and fits.
                if len(out) < ask.num_tokens and self.kv.can_append(seq, 1):
                    seq.token_ids.append(token)
                    self.kv.append(seq, 1)
                    next_live.append(ask)
            live = next_live
        return drafts

    def _feed_long_catch_ups(self, seqs: list[DraftSequence]) -> None:
        """When the tokens the draft's KV lacks do not fit one native step, read all but each
        sequence's last one first, in steps of at most the native step's size (no sampling), so
        the first draft forward below is a small step too. A larger step runs the eager int8
        forward, ~10x the per-token cost the calibration measured and the speculator prices:
        a request joining speculation late (400 tokens behind) cost 1.2 s at one thread."""
        limit = self.runner.native_max_tokens
        if not limit or sum(s.num_tokens - s.num_computed_tokens for s in seqs) <= limit:
            return
        for seq in seqs:
            while (behind := seq.num_tokens - 1 - seq.num_computed_tokens) > 0:
                take = min(limit, behind)
                start = seq.num_computed_tokens
                entry = ScheduledRequest(request=seq, num_scheduled_tokens=take, num_computed_tokens=start,
                                         token_ids=tuple(seq.token_ids[start:start + take]),
                                         block_ids=tuple(seq.block_ids), sample=False)
                self.runner.forward(StepInputs.build([entry], self.kv.block_size))
                seq.num_computed_tokens = start + take

    def _catch_up(self, ask: DraftAsk) -> bool:
        """Cut the request's draft KV back to what still matches its tokens and give it slots
        for the rest (at least the last token, whose logits give the first draft). False:
        the draft pool has no room for it now (it decodes without drafts this step)."""
        request = ask.request
        tokens = request.all_token_ids
        seq = self._seqs.get(request.request_id)
        if seq is None:
            seq = self._seqs[request.request_id] = DraftSequence(request.request_id)
        keep = min(_common_prefix(seq.token_ids, tokens, seq.num_computed_tokens), len(tokens) - 1)
        seq.num_computed_tokens = keep
        seq.token_ids = list(tokens)
        if self.kv.holds(seq):
            self.kv.trim(seq)
            if self.kv.can_append(seq, len(tokens) - keep):
                self.kv.append(seq, len(tokens) - keep)
                return True
            self.forget(request.request_id)
            return False
        if not self.kv.can_allocate(seq, len(tokens), PrefixMatch([], 0)):
            self._seqs.pop(request.request_id)
            return False
        self.kv.allocate(seq, len(tokens), PrefixMatch([], 0))
        return True

    def catch_up_forwards(self, request) -> float:
        """What reading the tokens the draft's KV lacks costs, in single-token forwards."""
        return self.num_catch_up_tokens(request) * self._forwards_per_row

    def num_catch_up_tokens(self, request) -> int:
        """Tokens before the last known one that the draft's KV lacks (the last one is fed
        with the first draft position anyway)."""
        seq = self._seqs.get(request.request_id)
        tokens = request.all_token_ids
        n = 0 if seq is None else seq.num_computed_tokens
        if n and seq.token_ids[:n] != tokens[:n]:  # usually equal: one C-level comparison
            n = _common_prefix(seq.token_ids, tokens, n)
        return max(0, len(tokens) - n - 1)

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    @property
    def num_held_blocks(self) -> int:
        return self.kv.pool.num_used_blocks
