"""Tensor-parallel layers: each rank holds a slice of a weight, cut at load time.

Every parameter carries a `weight_loader(param, full_tensor)` (nano-vllm's idea): the model
hands it the full Hugging Face tensor and the layer copies out its own rows or columns, so
a checkpoint loads unchanged at any world size. The layers subclass nn.Linear / nn.Embedding
with the shard's shape, so module and parameter names stay Hugging Face's and quant/ still
finds `q_proj`, `down_proj`, ... by name.

How a Llama layer splits over N ranks (Megatron's pattern: one all-reduce per block):

    q_proj, k_proj, v_proj   column-parallel by whole heads  -> attention runs on local heads
    o_proj                   row-parallel (input columns)     -> partial sums, all-reduced
    gate_proj, up_proj       column-parallel                  -> SiLU(gate) * up is local
    down_proj                row-parallel                     -> partial sums, all-reduced
    embed_tokens, lm_head    vocab-parallel (rows of V) or replicated (parallel.vocab_parallel;
                             same speed within noise on CPU, a third of the table's memory;
                             figures in load_tests/bench_tp.py)

KV heads that do not divide by N are replicated as vLLM's QKVParallelLinear does: with
Hkv < N each KV head lives on N / Hkv ranks, and rank r holds KV head r // (N / Hkv), the
one its query heads use (q head h belongs to KV group h // (Hq / Hkv)).

Row-parallel layers return this rank's partial sum; the model all-reduces after o_proj and
down_proj (gpt-fast's placement) so a weight-only quantized layer that replaced the
projection (quant/linear.py, which knows how to shard itself) needs no wrapper. The bias of
a row-parallel layer lives on rank 0 only, so the sum adds it exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.core.config import ConfigError
from kvmesh.worker.kernels import packed_weights
from kvmesh.worker.parallel.distributed import Collectives
from kvmesh.worker.kernels.packed_weights import PackedWeight
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

@dataclass(frozen=True)
class ShardSpec:
    """Which slice of a full weight this rank holds: shard `index` of `num_shards` equal parts
    along `dim` (0 = output rows, column-parallel; 1 = input columns, row-parallel)."""

    dim: int
    index: int
    num_shards: int

    def bounds(self, size: int, what: str) -> tuple[int, int]:
        if size % self.num_shards:
            raise ConfigError(f"cannot split {what} of size {size} into {self.num_shards} equal shards")
        part = size // self.num_shards
        return self.index * part, (self.index + 1) * part

    def take(self, full: torch.Tensor, what: str) -> torch.Tensor:
        start, end = self.bounds(full.shape[self.dim], what)
        return full.narrow(self.dim, start, end - start)


def _check_loaded(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ConfigError(f"{name}: shard shape {tuple(loaded.shape)} does not match the parameter "
                          f"{tuple(param.shape)}")


class _ShardedLinear(nn.Linear):
    """nn.Linear of the shard's shape whose loaders cut the full tensor by `self.shard`."""

    shard: ShardSpec

    def _attach_loaders(self) -> None:
        self.weight.weight_loader = self._load_weight
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias

    def _load_weight(self, param: nn.Parameter, full: torch.Tensor) -> None:
        part = self.shard.take(full, "weight")
        _check_loaded(param, part, type(self).__name__)
        param.data.copy_(part)

    def _load_bias(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if self.shard.dim == 1:  # row-parallel: the partial sums add the bias once, on rank 0
            param.data.copy_(full if self.shard.index == 0 else torch.zeros_like(full))
            return
        param.data.copy_(self.shard.take(full, "bias"))


class ColumnParallelLinear(_ShardedLinear):
    """y[:, shard] = x @ W[shard].T: out_features split evenly, input replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool, coll: Collectives):
        self.shard = ShardSpec(0, coll.rank, coll.world_size)
        start, end = self.shard.bounds(out_features, "out_features")
        super().__init__(in_features, end - start, bias=bias)
        self._attach_loaders()


class RowParallelLinear(_ShardedLinear):
    """Partial y = x[:, shard] @ W[:, shard].T; the caller all-reduces over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, coll: Collectives):
        self.shard = ShardSpec(1, coll.rank, coll.world_size)
        start, end = self.shard.bounds(in_features, "in_features")
        super().__init__(end - start, out_features, bias=bias)
        self._attach_loaders()


def head_shard(num_heads: int, coll: Collectives, what: str) -> ShardSpec:
    """Whole heads per rank; replicated heads when num_heads < world size (vLLM's rule)."""
    n = coll.world_size
    if num_heads % n == 0:
        return ShardSpec(0, coll.rank, n)
    if num_heads < n and n % num_heads == 0:
        return ShardSpec(0, coll.rank // (n // num_heads), num_heads)  # n / num_heads copies of each
    raise ConfigError(f"parallel.tensor_parallel_size={n} does not fit {num_heads} {what} heads: it must divide "
                      f"them, or be a multiple of them (heads are then replicated)")


class QKVParallelLinear(_ShardedLinear):
    """Column-parallel by whole heads: one of q_proj / k_proj / v_proj (kept apart so Hugging
    Face names load as is; after loading, the model runs the three as one GEMM over shared
    storage, worker/model/llama.py FusedLinears). `num_local_heads` is what this rank's attention runs."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, bias: bool, coll: Collectives, what: str):
        self.shard = head_shard(num_heads, coll, what)
        self.num_local_heads = num_heads // self.shard.num_shards
        super().__init__(hidden_size, self.num_local_heads * head_dim, bias=bias)
        self._attach_loaders()


def check_splittable(hf_config, world_size: int) -> None:
    """Raise ConfigError before any rank starts when the model cannot split N ways."""

    coll = Collectives(0, world_size)
    head_shard(hf_config.num_attention_heads, coll, "query")
    head_shard(hf_config.num_key_value_heads, coll, "KV")
    ShardSpec(0, 0, world_size).bounds(hf_config.intermediate_size, "intermediate_size")


def padded_vocab(vocab_size: int, num_shards: int) -> int:
    return -(-vocab_size // num_shards) * num_shards


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the (padded) vocabulary; other ids look up zeros, then all-reduce.

    parallel=False keeps the whole table on every rank (no collective)."""

    def __init__(self, vocab_size: int, hidden_size: int, coll: Collectives, parallel: bool = True):
        self.coll = coll
        self.vocab_size = vocab_size
        self.shard = ShardSpec(0, coll.rank, coll.world_size) if parallel else ShardSpec(0, 0, 1)
        self.vocab_start, self.vocab_end = self.shard.bounds(padded_vocab(vocab_size, self.shard.num_shards), "vocab")
        super().__init__(self.vocab_end - self.vocab_start, hidden_size)
        self.weight.weight_loader = self._load_weight

    def reset_parameters(self) -> None:
        # A table built on the meta device is installed by its loader; torch's normal_ init on
        # meta runs through its decompositions and imports torch._dynamo (and triton), ~140 MiB
        # of a CPU worker's resident memory for nothing.
        if not self.weight.is_meta:
            super().reset_parameters()

    def _load_weight(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if full.shape[0] != self.vocab_size:
            raise ConfigError(f"embedding has {full.shape[0]} rows, config says vocab {self.vocab_size}")
        param.data.zero_()  # rows past the real vocabulary (padding) stay zero
        rows = full[self.vocab_start:min(self.vocab_end, self.vocab_size)]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.num_shards == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        x = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)  # [T, H], zero off-shard
        return self.coll.all_reduce(x)  # exactly one rank contributes each row: the sum is exact


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary rows; `gather_logits` assembles [N, V] on every rank."""

    packed: PackedWeight | None = None  # oneDNN layout of the weight (bf16 CPU), set by fuse_projections

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V_shard]
        return packed_weights.linear(hidden, self.weight, None, self.packed)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        if self.shard.num_shards == 1:
            return local_logits[:, :self.vocab_size]
        return self.coll.all_gather_last_dim(local_logits)[:, :self.vocab_size]


def quantize_sharded(full: nn.Linear, shard: ShardSpec, quant_cfg, awq=None) -> nn.Module:
    """Quantize the full projection, then cut it with the quant layer's own `shard`: int8
    per-channel scales and int4 groups are computed over the whole row, so the shards hold
    exactly the values a single rank would (quantizing a column slice would not). int4_awq
    takes `awq`, the AWQ search result of this projection on the full model; its input
    scales are cut with the input columns (row-parallel) or kept whole (column-parallel)."""

    if quant_cfg.weight == "int8":
        q = Int8WeightOnlyLinear.from_linear(full)
    elif quant_cfg.weight == "int4":
        q = Int4WeightOnlyLinear.from_linear(full, quant_cfg.group_size)
    elif quant_cfg.weight == "int4_awq":
        if awq is None:
            raise ConfigError("quant.weight=int4_awq under tensor parallelism needs the AWQ scales of the full "
                              "model (worker/runner/awq_calibration.py) for every projection")
        q = Int4WeightOnlyLinear.from_linear(full, quant_cfg.group_size, input_scale=awq.input_scale)
    else:
        raise ConfigError(f"quant.weight={quant_cfg.weight} is not supported with tensor parallelism")
    return q.shard(shard.dim, shard.index, shard.num_shards)
