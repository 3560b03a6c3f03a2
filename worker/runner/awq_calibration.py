"""quant.weight=int4_awq at engine start: calibrate, search the AWQ scales, cache them.

AWQ (quant/awq.py) needs to know which input channels carry large activations, so an int4
AWQ engine first runs calibration text through its own unquantized model:

    calibration text (quant.calibration_path, or the bundled corpus)
      -> CALIBRATION_SEQUENCES x CALIBRATION_SEQ_LEN tokens, one prefill each, through
         kvmesh's model and attention backend on a scratch KV cache
      -> per-projection input statistics (quant/calibration.py hooks)
      -> alpha search per projection (quant/awq.py), then Q(W * s) with 1/s kept in the layer

The search costs ~35 s for SmolLM2 on one CPU thread, so its results are cached:

    $KVMESH_CACHE_DIR (~/.cache/kvmesh)/awq/<fingerprint>.safetensors

The fingerprint covers everything the result depends on: every file of the weights folder
(name, size, mtime), the calibration text's bytes, the sequence plan, the group size, the
activation dtype and the alpha grid. A restarted worker, a rebuilt tensor-parallel group or
the next start reuses the file; any change recomputes it. Under tensor parallelism rank 0
runs this on a full (unsharded) fp model before the ranks load, and hands every rank the
same results, so all shards are cut from one quantization.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.quant.awq import ALPHA_GRID, AwqSearchResult, load_awq_results, save_awq_results, search_model_awq
from kvmesh.quant.calibration import collect_activation_stats, load_text, projection_linears, token_sequences
from kvmesh.worker.model.loader import cache_root
from kvmesh.worker.runner.model_runner import allocate_kv_caches, prefill_logits
from kvmesh.worker.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# The calibration plan, as AutoAWQ's n_samples / seqlen (smaller: a CPU must run it at start).
CALIBRATION_SEQUENCES = 4
CALIBRATION_SEQ_LEN = 256
MAX_SAMPLES = 256  # activation rows per projection kept for the search's loss
_FORMAT_VERSION = 1  # bump when the search or the file layout changes


def awq_cache_dir() -> Path:
    return cache_root().parent / "awq"


def awq_fingerprint(config: KvmeshConfig, spec, text: str) -> str:
    """What the AWQ search result depends on, hashed (see the module docstring); `text` is
    the calibration text."""
    hf_dir = Path(spec.hf_dir)
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in hf_dir.iterdir() if p.is_file())
    key = {"version": _FORMAT_VERSION, "weights": str(hf_dir.resolve()), "files": files,
           "text": hashlib.sha256(text.encode("utf-8")).hexdigest(), "sequences": CALIBRATION_SEQUENCES,
           "seq_len": CALIBRATION_SEQ_LEN, "max_samples": MAX_SAMPLES, "group_size": config.quant.group_size,
           "dtype": str(spec.dtype), "alphas": list(ALPHA_GRID)}
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=12).hexdigest()


def awq_results_for(config: KvmeshConfig, spec, backend, full_model: Callable[[], torch.nn.Module]
                    ) -> dict[str, AwqSearchResult]:
    """The AWQ search results for the configured model: from the cache, or computed and cached.

    full_model() returns this process's full, unquantized model; it is called only on a cache
    miss (the caller loads one when it has none). backend: the attention backend it runs on."""
    text = load_text(config.quant.calibration_path)
    path = awq_cache_dir() / f"{awq_fingerprint(config, spec, text)}.safetensors"
    if path.exists():
        try:
            results = load_awq_results(path)
        except Exception as exc:  # a truncated or foreign file: recompute rather than fail the start
            logger.warning("ignoring unreadable AWQ cache %s: %s", path, exc)
        else:
            logger.info("int4_awq: %d projections' scales from the cache %s", len(results), path)
            return results
    model = full_model()
    if model.coll.world_size != 1:
        raise ConfigError("int4_awq calibration needs the full model, not a tensor-parallel shard")
    results = _calibrate_and_search(config, model, text, backend)
    _save_atomically(path, results)
    return results


def _calibrate_and_search(config: KvmeshConfig, model, text: str, backend) -> dict[str, AwqSearchResult]:
    start = time.perf_counter()
    sequences = token_sequences(load_tokenizer(config.model), text, seq_len=CALIBRATION_SEQ_LEN,
                                max_sequences=CALIBRATION_SEQUENCES)
    device = next(model.parameters()).device
    block_size = config.cache.block_size
    scratch = allocate_kv_caches(model.config.num_hidden_layers, -(-CALIBRATION_SEQ_LEN // block_size), block_size,
                                 model.num_kv_heads, model.head_dim, next(model.parameters()).dtype, device)
    logger.info("int4_awq: calibrating on %d x %d tokens of %s, then searching %d projections (once; cached)",
                len(sequences), CALIBRATION_SEQ_LEN, config.quant.calibration_path or "the bundled corpus",
                len(projection_linears(model)))
    stats = collect_activation_stats(model, sequences, max_samples=MAX_SAMPLES,
                                     forward=lambda m, ids: prefill_logits(m, ids, scratch, backend))
    del scratch
    results = search_model_awq(model, stats, config.quant.group_size)
    alphas = [r.alpha for r in results.values()]
    logger.info("int4_awq: scales searched in %.1f s; alpha mean %.2f, %d of %d projections kept RTN (alpha 0)",
                time.perf_counter() - start, sum(alphas) / len(alphas), alphas.count(0.0), len(alphas))
    return results


def _save_atomically(path: Path, results: dict[str, AwqSearchResult]) -> None:
    """Write then rename, so a concurrent reader (another worker starting) never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_awq_results(Path(tmp), results)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:  # a read-only cache costs the next start a search, nothing more
        logger.warning("could not cache AWQ scales at %s: %s", path, exc)
