"""Random-weight checkpoints of every served model family, and their bf16 agreement report.

Each family's config comes from transformers' AutoConfig.for_model with the real model's
head_dim, GQA ratio and family switches (biases, q/k norms, soft-capping, window layout),
few layers and a small hidden size, so a forward is cheap; the checkpoint is saved with
save_pretrained beside a small byte-level BPE tokenizer (load_tests/tiny_tokenizer.py).
Every norm weight and bias is randomised (HF initialises them to constants), so a formula
that ignored one would change the tokens. tests/test_model_families.py holds kvmesh to HF's
fp32 greedy tokens on them; `main` reports how often bf16 greedy decoding agrees:

    python -m kvmesh.load_tests.family_checkpoints [--families qwen2,gemma2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer
from kvmesh.worker.engine_api import Engine

# Function-level imports: transformers, only where a checkpoint is built or HF is run.

VOCAB = 1000
WINDOW = 24  # sliding windows shorter than the longer test prompts
# (model_type, the real model it takes its head shapes from, config overrides)
FAMILIES: dict[str, dict] = {
    # Qwen2.5-0.5B: 14 query heads over 2 KV heads (7:1), head_dim 64, q/k/v biases
    "qwen2": dict(hidden_size=448, num_attention_heads=7, num_key_value_heads=1, intermediate_size=512),
    # Qwen3-0.6B: 16 over 8 (2:1), head_dim 128 (wider than hidden / heads), q/k RMSNorm
    "qwen3": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  intermediate_size=512),
    # Phi-3-mini: 32 over 32 (MHA), head_dim 96, fused qkv_proj / gate_up_proj, a window
    "phi3": dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
                 sliding_window=WINDOW, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # Mistral-7B: 32 over 8 (4:1), head_dim 128, a window on every layer
    "mistral": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                    intermediate_size=512, sliding_window=WINDOW),
    # Gemma-2-2B: 8 over 4, head_dim 256, query_pre_attn_scalar 256, sliding and full layers
    # alternating; soft-capping at 2 / 5 instead of 50 / 30, so that it changes these small
    # scores and logits measurably (the real caps barely touch a random model's)
    "gemma2": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                   intermediate_size=512, query_pre_attn_scalar=256, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0),
    # Gemma-3-1B: 4 over 1, head_dim 256, q/k norms, local RoPE base 10k vs global 1M
    "gemma3_text": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        intermediate_size=512, query_pre_attn_scalar=256, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention"]),
}
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512, bos_token_id=0,
              eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def hf_config(family: str):
    from transformers import AutoConfig

    # untied even for Gemma (whose real checkpoints tie): a tied random model scaling its
    # embeddings by sqrt(hidden) only ever predicts its input token again (tying itself is
    # served and tested on SmolLM2)
    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})


def write_checkpoint(family: str, folder: Path, tokenizer, seed: int = 0) -> Path:
    """A random-weight `family` checkpoint (save_pretrained) with `tokenizer`, in folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma stores w around 0 for (1 + w), the rest around 1
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif "lm_head" in name:  # logits of std ~1-2: greedy ties are unlikely
                p.normal_(0.0, 0.125)
            elif "embed_tokens" in name:  # Gemma scales embeddings by sqrt(hidden): unit-scale after it
                p.normal_(0.0, p.shape[1] ** -0.5 if family.startswith("gemma") else 0.125)
            elif name.endswith("proj.weight"):  # unit-scale outputs: attention scores of std ~1, not ~0
                p.normal_(0.0, p.shape[1] ** -0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, dtype=torch.float32) -> list[list[int]]:
    """HF generate's greedy continuations of each prompt (token ids)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, x.shape[1]:].tolist())
    return outputs


def kvmesh_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, dtype: str = "fp32",
                  backend: str = "cpu", **sched) -> tuple[list[list[int]], object]:
    """kvmesh's engine, all prompts in one continuous batch -> (continuations, engine stats)."""

    config = KvmeshConfig.from_dict({
        "model": {"path": str(folder), "dtype": dtype},
        "cache": {"num_blocks": sched.pop("num_blocks", 64), "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600, **sched},
        "parallel": {"attention_backend": backend, "device": "cpu"},
    })
    engine = Engine.from_config(config)
    return greedy_continuations(engine, prompts, new_tokens, check_integrity=True), engine.stats()


def greedy_continuations(engine, prompts: list[list[int]], new_tokens: int,
                         check_integrity: bool = False, ignore_eos: bool = False) -> list[list[int]]:
    """Every prompt added to `engine` at once, stepped to the end: each one's `new_tokens`
    greedy tokens, in prompt order; `check_integrity` after every step. EOS is masked until
    `new_tokens` (min_tokens), or with `ignore_eos` sampled like any token and generation goes
    on past it (what a load test's exact-length request gets)."""
    for i, ids in enumerate(prompts):
        sampling = (SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True) if ignore_eos
                    else SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0))
        engine.add_request(GenerateRequest(f"r{i}", prompt_token_ids=tuple(ids), sampling=sampling))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        if check_integrity:
            engine.check_integrity()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def hf_prompt_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def family_prompts(tokenizer) -> list[list[int]]:
    """Prompts of 5 to ~70 tokens: the longer ones pass the sliding window (WINDOW tokens)."""
    texts = ["The capital of France is",
             "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
             "dragons, castles and the stars. Every night she would",
             "def fibonacci(n):",
             "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
             "synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves "
             "the green pigment chlorophyll and generates oxygen as a byproduct. The main stages are"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each continuation that matches before the first difference."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fractions.append(same / max(1, len(y)))
    return sum(fractions) / len(fractions)


def main() -> None:
    import tempfile


    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = train_corpus_tokenizer(VOCAB)
    prompts = family_prompts(tokenizer)
    print("family       fp32==HF  bf16 vs HF fp32  bf16 vs HF bf16  (greedy prefix agreement, mean over prompts)")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = write_checkpoint(family, Path(tmp) / family, tokenizer)
            want32 = hf_greedy(folder, prompts, args.new_tokens)
            want16 = hf_greedy(folder, prompts, args.new_tokens, torch.bfloat16)
            got32, _ = kvmesh_greedy(folder, prompts, args.new_tokens)
            got16, _ = kvmesh_greedy(folder, prompts, args.new_tokens, dtype="bf16")
            print(f"{family:12s} {agreement(got32, want32):8.3f}  {agreement(got16, want32):15.3f}  "
                  f"{agreement(got16, want16):15.3f}")


if __name__ == "__main__":
    main()
