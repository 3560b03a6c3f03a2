"""Tiny random-weight Llama GGUF files, written with the `gguf` package's writer.

Projections in one quantized type (Q8_0, Q4_0, Q4_1 quantized by gguf.quants; Q4_K, which
gguf-py cannot quantize, as random valid blocks: fp16 d / dmin, random 6-bit scale and min
pairs, random codes), the token embedding in Q8_0, the output head in F16, norms in F32,
and the small byte-level BPE tokenizer (load_tests/tiny_tokenizer.py) as a `gpt2` GGUF
tokenizer, so transformers' GGUF loader and kvmesh's both read the file. Used by
tests/test_gguf_kept.py and load_tests/bench_gguf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
VOCAB = 1000
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, context=1024)  # K: multiples of 256 (Q4_K)


def _q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K rows: [rows, cols / 256 * 144] uint8, weights of std ~ cols ** -0.5."""
    n = rows * cols // 256
    # w = d * sc * q - dmin * m with sc, m, q uniform: dmin = 7.5 d centres it, std ~ 250 d
    d = np.full((n, 1), cols ** -0.5 / 250, dtype=np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    scales = rng.integers(0, 256, (n, 12), dtype=np.uint8)
    codes = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, codes], axis=1)
    return blocks.reshape(rows, -1)


def random_tensor(rng: np.random.Generator, rows: int, cols: int, type_name: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor: a random [rows, cols] weight in type_name."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        return _q4_k_blocks(rows, cols, rng), qtype
    w = rng.normal(0.0, cols ** -0.5, (rows, cols)).astype(np.float32)
    if type_name == "F32":
        return w, None
    if type_name == "F16":
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def _add_tokenizer(writer) -> int:
    """The tiny BPE tokenizer as GGUF tokenizer fields; returns its EOS id."""
    tok = train_corpus_tokenizer(VOCAB)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i == eos else 1 for i in range(len(tokens))])  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    return eos


def write_tiny_llama_gguf(path: Path, type_name: str, seed: int = 0, overrides: dict | None = None,
                          tied: bool = False) -> Path:
    """A 2-layer random Llama whose projections are `type_name` (overrides: tensor name -> type);
    tied: no output.weight, the LM head is the Q8_0 token table (as the embedded model's)."""
    import gguf

    s = SHAPE
    head_dim = s["hidden"] // s["heads"]
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    _add_tokenizer(writer)
    shapes = {"token_embd.weight": ((VOCAB, s["hidden"]), "Q8_0")}
    if not tied:
        shapes["output.weight"] = ((VOCAB, s["hidden"]), "F16")
    for i in range(s["layers"]):
        kv = s["kv_heads"] * head_dim
        for name, shape in (("attn_q", (s["hidden"], s["hidden"])), ("attn_k", (kv, s["hidden"])),
                            ("attn_v", (kv, s["hidden"])), ("attn_output", (s["hidden"], s["hidden"])),
                            ("ffn_gate", (s["intermediate"], s["hidden"])), ("ffn_up", (s["intermediate"], s["hidden"])),
                            ("ffn_down", (s["hidden"], s["intermediate"]))):
            shapes[f"blk.{i}.{name}.weight"] = (shape, type_name)
    for name, (shape, kind) in shapes.items():
        data, raw_dtype = random_tensor(rng, *shape, (overrides or {}).get(name, kind))
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    for name in [f"blk.{i}.{n}.weight" for i in range(s["layers"]) for n in ("attn_norm", "ffn_norm")] + \
            ["output_norm.weight"]:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
