"""Batch-1 decode against its memory-bandwidth floor on a Llama-3.2-1B-shaped model.

A decode step at batch 1 reads every weight once (the tied embedding whole, as the LM head)
and little else, so its floor is the weight bytes a token over the read bandwidth this
process measures (bench_engine.MemoryProbe: a sum over a buffer far larger than the caches,
the engine's threads). The model is random-weight, Llama-3.2-1B's shapes (hidden 2048, 16
layers, 32 query heads over 8 KV heads, head_dim 64, MLP 8192, vocabulary 128256, tied, llama3
RoPE scaling), saved with save_pretrained in bf16 to a temporary folder; each mode's engine
decodes one request in alternating rounds (a bandwidth probe beside each round, the same
load on a shared machine), and it prints per mode: tok/s, the bytes a token reads, GB/s
achieved, and the fraction of the floor (1.0 = decoding at the memory bandwidth).

    python -m kvmesh.load_tests.bench_bandwidth_floor [--modes bf16,int4,int4-a8] [--rounds 3]
        [--tokens 32] [--threads 2]

Modes (the native CPU step where it runs, every other setting its default):
    bf16     model.dtype bf16
    int4     quant.weight int4 (group 128, bf16 scales / zeros), int4 layers exact
    int4-a8  the same, quant.int4_activations int8 (llama.cpp's Q4 x Q8; the LM head read as an
             int8 copy)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.load_tests.bench_engine import MemoryProbe, decode_rate
from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer
from kvmesh.worker.engine_api import Engine

# Function-level imports: transformers, only where the checkpoint is built.

# Llama-3.2-1B's config.json, as far as shapes and RoPE go
LLAMA_32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                   rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
MODES = {"bf16": ("none", "fp32"), "int4": ("int4", "fp32"), "int4-a8": ("int4", "int8")}
PROMPT = tuple(range(100, 132))


def write_checkpoint(folder: Path) -> Path:
    """The random-weight checkpoint (HF's own init, bf16) with a small BPE tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_32_1B), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    train_corpus_tokenizer().save_pretrained(folder)
    return folder


def token_read_bytes(engine: Engine, context_tokens: float) -> int:
    """What a batch-1 decode step reads at least: every weight tensor once (parameters and the
    quantized layers' codes / scales / zeros; not the RoPE tables), the tied embedding as the
    LM head (or the int8 copy the int8-activation step reads instead), and the K/V of its
    context."""
    model = engine.runner.model
    tensors = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "rotary" not in n}
    total = sum(t.nbytes for t in {t.data_ptr(): t for t in tensors.values()}.values())  # tied: once
    decoder = engine.runner.native_decoder
    if decoder is not None and decoder.int8_head_bytes:
        total += decoder.int8_head_bytes - model.model.embed_tokens.weight.nbytes
    return int(total + context_tokens * engine.parts.plan.kv_bytes_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of " + ", ".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="parallel.cpu_threads")
    parser.add_argument("--model", help="an existing checkpoint folder instead of a fresh random one")
    args = parser.parse_args()
    folder = Path(args.model) if args.model else write_checkpoint(Path(tempfile.mkdtemp(prefix="llama32-1b-")))
    try:
        engines = {}
        for name in args.modes.split(","):
            weight, activations = MODES[name]
            engines[name] = Engine.from_config(KvmeshConfig.from_dict({
                "model": {"path": str(folder), "dtype": "bf16", "max_model_len": 512},
                "quant": {"weight": weight, "int4_activations": activations},
                "cache": {"num_blocks": 16, "block_size": 16},
                "parallel": {"device": "cpu", "cpu_threads": args.threads}}))
            print(f"{name}: CPU step {engines[name].runner.cpu_step.describe()}", flush=True)
        probe = MemoryProbe(1024)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        bandwidth: list[float] = []
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                rates[name].append(decode_rate(engines[name], PROMPT, 1, args.tokens)[0])
                bandwidth.append(probe.read_gb_s(3))
        gb_s = statistics.median(bandwidth)
        print(f"\n{args.threads} threads, {args.rounds} rounds of {args.tokens} tokens (median step), "
              f"read bandwidth {gb_s:.1f} GB/s (median of {len(bandwidth)} probes)")
        print("mode      tok/s  MB a token  GB/s read  floor tok/s  fraction of the floor   rounds")
        for name, engine in engines.items():
            read = token_read_bytes(engine, len(PROMPT) + args.tokens / 2)
            tok_s = statistics.median(rates[name])
            floor = gb_s * 1e9 / read
            print(f"{name:8s} {tok_s:6.1f}  {read / 1e6:10.0f}  {tok_s * read / 1e9:9.1f}  {floor:11.1f}  "
                  f"{tok_s / floor:21.2f}   {' '.join(f'{v:.1f}' for v in rates[name])}")
    finally:
        if not args.model:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
