"""PEFT LoRA adapters for tests, made on the tiny random Llama (tests/conftest.py)."""

from __future__ import annotations

import torch


def make_adapter(base_dir: str, out_dir: str, rank: int, targets: list[str], alpha: int, rslora: bool, seed: int):
    """A PEFT adapter folder whose lora_B is random and large enough (std 0.5) that the
    adapter changes greedy tokens: PEFT's default B = 0 would make it a no-op."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(out_dir)


def hf_peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int) -> list:
    """HF greedy tokens of the base model with the adapter merged (PEFT merge_and_unload, fp32)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        model.eval()
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
