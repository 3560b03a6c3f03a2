"""The many-adapter workload: random PEFT LoRA adapters for a model and Zipf adapter popularity.

    write_random_adapters(model_dir_or_hf_config, root, 8, rank=16)  ->  {name: folder}
    zipf_adapter_choices(num_requests=96, num_adapters=8, s=1.1, seed=0) -> [adapter index, ...]

The adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors,
`base_model.model.model.layers.N.<block>.<proj>.lora_{A,B}.weight`), so the engine loads them
through exactly the path it loads trained adapters; their values are random (load tests
measure speed and placement, not quality). Popularity follows Zipf (rank k has weight
1 / k^s), the shape adapter traffic of many tenants has: a few hot adapters, a long tail.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from kvmesh.worker.engine_api import LORA_MODULES, lora_projection_shapes

def write_random_adapter(folder: str, hf_config, rank: int, seed: int, targets=LORA_MODULES, alpha: int = 16) -> str:
    from safetensors.torch import save_file  # transformers' dependency; only this helper needs it

    gen = torch.Generator().manual_seed(seed)
    shapes = lora_projection_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "use_dora": False, "use_rslora": False}, fh)
    return folder


def write_random_adapters(hf_config, root: str, num_adapters: int, rank: int = 16, seed: int = 0) -> dict[str, str]:
    return {f"adapter-{i}": write_random_adapter(os.path.join(root, f"adapter-{i}"), hf_config, rank, seed + i)
            for i in range(num_adapters)}


def zipf_adapter_choices(num_requests: int, num_adapters: int, s: float = 1.1, seed: int = 0) -> list[int]:
    """Adapter index per request, index k drawn with probability proportional to 1 / (k + 1)^s."""
    weights = 1.0 / np.arange(1, num_adapters + 1) ** s
    rng = np.random.default_rng(seed)
    return rng.choice(num_adapters, size=num_requests, p=weights / weights.sum()).tolist()
