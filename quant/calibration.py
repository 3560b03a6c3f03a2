"""Calibration: run text through a model and record what the quantizers need to know.

Per-input-channel activation statistics of every Llama projection (AWQ's mean |x| and a
sample of rows for its loss), collected with forward pre-hooks, so it works on HF's
LlamaForCausalLM and on kvmesh's model alike (same module names). The bundled corpus is a
public-domain English text (quant/data/); the articles warn that calibration data should
resemble real traffic, so `QuantConfig.calibration_path` can point at a sample of it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvmesh.core.config import ConfigError

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
CALIBRATION_TEXT = DATA_DIR / "calibration.txt"  # Austen, Pride and Prejudice, ch. 1-2
HELDOUT_TEXT = DATA_DIR / "heldout.txt"  # Carroll, Alice's Adventures in Wonderland, ch. 1

PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# forward(model, input_ids [S] int64) runs one sequence; the default suits HF models.
ForwardFn = Callable[[nn.Module, torch.Tensor], object]


def hf_forward(model: nn.Module, input_ids: torch.Tensor) -> object:
    return model(input_ids[None, :])


def is_projection(name: str) -> bool:
    """model.layers.3.self_attn.q_proj -> True; lm_head, embed_tokens -> False."""
    return name.rsplit(".", 1)[-1] in PROJECTION_NAMES


def projection_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's Llama projections (nn.Linear, named as is_projection says), in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and is_projection(name)]


def layer_index(name: str) -> int | None:
    """model.layers.3.self_attn.k_proj -> 3."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def load_text(path: str | Path | None = None) -> str:
    """The calibration text at `path`, or the bundled corpus."""
    p = Path(path) if path is not None else CALIBRATION_TEXT
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"calibration text {p}: {exc}") from None
    if not text.strip():
        raise ConfigError(f"calibration text {p} is empty")
    return text


def token_sequences(tokenizer, text: str, seq_len: int = 128, max_sequences: int = 8) -> list[torch.Tensor]:
    """Cut the tokenized text into up to `max_sequences` [seq_len] int64 sequences.

    tokenizer: anything with encode(text) -> list[int] (a HF tokenizer)."""
    if seq_len < 2 or max_sequences < 1:
        raise ConfigError("calibration needs seq_len >= 2 and max_sequences >= 1")
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    count = min(max_sequences, ids.numel() // seq_len)
    if count == 0:
        raise ConfigError(f"calibration text has {ids.numel()} tokens, fewer than seq_len {seq_len}")
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


@dataclass(frozen=True)
class ActivationStats:
    """What one linear layer saw on its input during calibration."""

    mean_abs: torch.Tensor  # [K] fp32, mean |x| per input channel over all tokens
    max_abs: torch.Tensor  # [K] fp32
    num_tokens: int
    samples: torch.Tensor  # [S, K] fp32, a uniform random sample of input rows (S <= max_samples)


class _InputRecorder:
    """Accumulates one layer's input statistics; a reservoir keeps a uniform row sample."""

    def __init__(self, max_samples: int, generator: torch.Generator):
        self.max_samples, self.generator = max_samples, generator
        self.sum_abs: torch.Tensor | None = None
        self.max_abs: torch.Tensor | None = None
        self.num_tokens = 0
        self.samples: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()  # [tokens, K]
        abs_x = x.abs()
        if self.sum_abs is None:
            self.sum_abs, self.max_abs = abs_x.sum(0), abs_x.amax(0)
            self.samples = x[: self.max_samples].clone()
            start = self.samples.shape[0]
        else:
            self.sum_abs += abs_x.sum(0)
            self.max_abs = torch.maximum(self.max_abs, abs_x.amax(0))
            start = 0
        rest = x[start:]
        free = self.max_samples - self.samples.shape[0]
        if free > 0:  # the reservoir is not full yet: take rows as they come
            self.samples = torch.cat([self.samples, rest[:free]])
            start, rest = start + free, rest[free:]
        if rest.shape[0]:  # Algorithm R, vectorised: row i replaces slot j ~ U[0, seen_i]
            seen = self.num_tokens + start + torch.arange(rest.shape[0])
            j = (torch.rand(rest.shape[0], generator=self.generator) * (seen + 1)).long()
            keep = j < self.max_samples
            self.samples[j[keep]] = rest[keep]  # a slot drawn twice keeps one of its rows
        self.num_tokens += x.shape[0]

    def stats(self) -> ActivationStats:
        return ActivationStats(mean_abs=self.sum_abs / self.num_tokens, max_abs=self.max_abs,
                               num_tokens=self.num_tokens, samples=self.samples)


def run_hooked(model: nn.Module, sequences: Iterable[torch.Tensor], forward: ForwardFn, handles: list) -> None:
    """Run every sequence through `model` with forward hooks registered, then remove the
    hooks (`handles`) whatever happens, so a failed calibration leaves the model clean."""
    try:
        for ids in sequences:
            forward(model, ids)
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def collect_activation_stats(model: nn.Module, sequences: Iterable[torch.Tensor], *,
                             forward: ForwardFn = hf_forward,
                             module_filter: Callable[[str], bool] = is_projection,
                             max_samples: int = 256, seed: int = 0) -> dict[str, ActivationStats]:
    """Run `sequences` through `model`; per matching nn.Linear, its input statistics."""
    generator = torch.Generator().manual_seed(seed)
    recorders: dict[str, _InputRecorder] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module_filter(name):
            recorders[name] = _InputRecorder(max_samples, generator)
            handles.append(module.register_forward_pre_hook(recorders[name]))
    if not recorders:
        raise ConfigError("calibration: the model has no linear layers named like Llama projections")
    run_hooked(model, sequences, forward, handles)
    missing = [name for name, r in recorders.items() if r.num_tokens == 0]
    if missing:
        raise ConfigError(f"calibration: no activations reached {missing[:3]}{'...' if len(missing) > 3 else ''}")
    log.info("calibrated %d layers on %d tokens", len(recorders), next(iter(recorders.values())).num_tokens)
    return {name: r.stats() for name, r in recorders.items()}
