"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a Llama model.

PEFT stores, for each adapted projection `model.layers.N.<block>.<proj>`:

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   [out, r]

and the forward it trains is y = x W^T + scaling * (x A^T) B^T with scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Here the scaling is folded into B once, so serving
adds (x A^T) B^T. Ranks come from the tensors (rank_pattern may give projections different
ranks); what the engine cannot serve exactly (DoRA, LoRA biases, extra trained modules,
per-module alphas, transposed weights) is refused with the reason, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kvmesh.core.errors import AdapterNotFoundError, InvalidRequestError

# The projections an adapter may target, by PEFT's module name, and the block that owns each.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraWeights:
    """One adapter in host memory, ready to copy into a slot: per (layer, module) the pair
    (A [r, in], B [out, r] with the scaling folded in), in the model's dtype."""

    name: str
    path: str
    max_rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m in LORA_MODULES if any(k[1] == m for k in self.modules))

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise AdapterNotFoundError(f"no PEFT adapter at {path!r} (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(config_path) as fh:
        config = json.load(fh)
    refusals = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none" or bool(config.get("lora_bias")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "layer_replication": bool(config.get("layer_replication")),
    }
    refused = [k for k, bad in refusals.items() if bad]
    if refused:
        raise InvalidRequestError(f"adapter at {path!r}: {', '.join(refused)} not supported (plain LoRA only)")
    return config


def load_peft_adapter(name: str, path: str, hf_config, dtype: torch.dtype, max_rank: int) -> LoraWeights:
    """Read and check an adapter against the base model's shapes (hf_config); raises
    AdapterNotFoundError (no adapter there) or InvalidRequestError (one we cannot serve)."""
    from safetensors.torch import load_file  # safetensors is transformers' dependency; only adapters need it here

    config = _read_config(path)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in LORA_MODULES or _BLOCK[m.group(3)] != m.group(2):
            raise InvalidRequestError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of "
                                      f"{'/'.join(LORA_MODULES)}")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = tensor
    shapes = projection_shapes(hf_config)
    modules = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"} or not 0 <= layer < hf_config.num_hidden_layers:
            raise InvalidRequestError(f"adapter {name!r}: layer {layer} {module} needs exactly one lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        out_features, in_features = shapes[module]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise InvalidRequestError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                      f"{tuple(b.shape)}; the model wants [r, {in_features}] and [{out_features}, r]")
        if not 1 <= rank <= max_rank:
            raise InvalidRequestError(f"adapter {name!r}: rank {rank} is outside 1..lora.max_rank ({max_rank})")
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        # fold in fp32, then cast once: the same rounding as PEFT's fp32 delta
        modules[(layer, module)] = (a.to(dtype).contiguous(), (b.to(torch.float32) * scaling).to(dtype).contiguous())
    if not modules:
        raise InvalidRequestError(f"adapter {name!r} at {path!r} holds no LoRA weights")
    return LoraWeights(name, path, max(a.shape[0] for a, _ in modules.values()), modules)


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each full projection."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
