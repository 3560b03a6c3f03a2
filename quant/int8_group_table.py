"""A token table kept as int8 codes with one fp32 scale per group of 32 inputs (a GGUF Q8_0
`token_embd`, as the embedded SmolLM2 file stores it), serving as the embedding and, when
the model ties them, as the LM head, with no float copy of the table resident.

Dequantized to fp32 the embedded model's table is 113 MB; its Q8_0 groups are 28 MB of codes
and 3.5 MB of scales. Each use dequantizes only what it reads: the lookup the looked-up rows,
the eager LM head a slice of rows at a time (the native step reads the codes and scales in
place, cpu_native_step.py). code x scale is exact in fp32 (an int8 times an fp16 scale), so
the rows are bit for bit gguf's own dequantization, rounded to the model dtype as the
dequantized table would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.core.config import ConfigError

GROUP_SIZE = 32
# Rows the eager head dequantizes at once: 4096 x 576 fp32 is 9 MiB of temporaries
HEAD_CHUNK_ROWS = 4096


class Int8GroupEmbedding(nn.Module):
    """The embedding: codes [V, H] int8, scales [V, H / 32] fp32; rows out in `dtype`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        rows, width = codes.shape
        if codes.dtype != torch.int8 or width % GROUP_SIZE or scales.dtype != torch.float32 \
                or scales.shape != (rows, width // GROUP_SIZE):
            raise ConfigError(f"an int8 group table needs int8 codes [V, H] (H a multiple of {GROUP_SIZE}) and fp32 "
                              f"scales [V, H/{GROUP_SIZE}], got {codes.dtype} {tuple(codes.shape)} and "
                              f"{scales.dtype} {tuple(scales.shape)}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.dtype = dtype  # what the rows come out in: the model dtype
        self.num_embeddings, self.embedding_dim = rows, width

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) dequantized in the model dtype."""
        return _dequantize(self.codes[start:end], self.scales[start:end], self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _dequantize(self.codes[input_ids], self.scales[input_ids], self.dtype)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round the scales (the table stays exact): a dtype cast only
        # changes the dtype the rows come out in; device moves apply to the buffers as usual.
        probe = fn(torch.zeros(0, dtype=torch.float32))
        if probe.dtype != torch.float32:
            self.dtype = probe.dtype
            device = probe.device
            return super()._apply(lambda t: t.to(device), recurse)
        return super()._apply(fn, recurse)


class Int8GroupLMHead(nn.Module):
    """The tied LM head over the embedding's table: [N, H] -> logits [N, V] (one rank)."""

    packed = None  # no oneDNN layout (fuse_projections packs float heads only)

    def __init__(self, table: Int8GroupEmbedding, vocab_size: int):
        super().__init__()
        # Not a submodule: the embedding owns the buffers, so a move or a state walk meets them once.
        self.__dict__["table"] = table
        self.vocab_size = vocab_size
        # Where set, a function (codes, scales) -> those rows in bf16 (the CPU kernels'
        # dequantization, the values of rows() in bf16): bf16 forwards take their rows from it,
        # set where the native step reads this head as those bf16 rows (cpu_native_step, int4_bf16)
        self.bf16_rows = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        table = self.table
        fast = self.bf16_rows is not None and hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu"
        parts = [F.linear(hidden, self.bf16_rows(table.codes[start:start + HEAD_CHUNK_ROWS],
                                                 table.scales[start:start + HEAD_CHUNK_ROWS]) if fast
                          else table.rows(start, start + HEAD_CHUNK_ROWS).to(hidden.dtype))
                 for start in range(0, table.num_embeddings, HEAD_CHUNK_ROWS)]
        return torch.cat(parts, dim=-1)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return local_logits[:, :self.vocab_size]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table as a float [V, H] (a copy: for callers that re-quantize it)."""
        return _dequantize(self.table.codes, self.table.scales, dtype)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lead = codes.shape[:-1]
    groups = codes.reshape(*lead, -1, GROUP_SIZE).to(torch.float32) * scales[..., None]
    return groups.reshape(*lead, -1).to(dtype)
