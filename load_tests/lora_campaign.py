"""The many-adapter workload's adapters: random PEFT LoRA adapters for a model.

    write_random_adapters(hf_config, root, 8, rank=16)  ->  {name: folder}
    campaign_adapters_config(run_config, ["adapter-0", ...], rank=16) -> the run's config with them

The adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors,
`base_model.model.model.layers.N.<block>.<proj>.lora_{A,B}.weight`), so the engine loads them
through exactly the path it loads trained adapters; their values are random (load tests
measure speed and placement, not quality). Which request asks for which adapter (Zipf
popularity, a few hot adapters and a long tail) is the workload's: load_tests/workloads.py.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.load_tests.workloads import adapter_name
from kvmesh.worker.engine_api import LORA_MODULES, ensure_hf_dir, lora_projection_shapes

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
    return {adapter_name(i): write_random_adapter(os.path.join(root, adapter_name(i)), hf_config, rank, seed + i)
            for i in range(num_adapters)}


def campaign_adapters_config(config: dict, names: list[str], rank: int) -> dict:
    """A run's KvmeshConfig overrides with random adapters of `rank` registered under `names`
    (lora.adapters), written once per process and model; names the campaign already lists
    keep their own folder. The adapters are made for the model the run serves."""
    from transformers import AutoConfig  # load time only

    listed = {a["name"] for a in (config.get("lora") or {}).get("adapters", ())}
    missing = [n for n in names if n not in listed]
    if not missing:
        return config
    model = KvmeshConfig.from_dict(config).model
    key = (model.path, model.revision, rank)
    if key not in _WRITTEN:
        hf_config = AutoConfig.from_pretrained(str(ensure_hf_dir(model).hf_dir))
        _WRITTEN[key] = (hf_config, tempfile.mkdtemp(prefix="kvmesh-campaign-adapters-"))
    hf_config, root = _WRITTEN[key]
    added = []
    for name in missing:
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):  # seeded by name: the same adapter in every run
            write_random_adapter(folder, hf_config, rank, seed=zlib.crc32(name.encode()))
        added.append({"name": name, "path": folder})
    lora = dict(config.get("lora") or {})
    lora["adapters"] = [*lora.get("adapters", ()), *added]
    return {**config, "lora": lora}


_WRITTEN: dict[tuple, tuple] = {}  # (model path, revision, rank) -> (hf config, adapters folder)
