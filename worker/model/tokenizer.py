"""Tokenizer loading and chat rendering, torch-free so the router can use it too."""

from __future__ import annotations

from kvmesh.core.config import ModelConfig
from kvmesh.core.errors import InvalidRequestError
from kvmesh.worker.model.loader import resolve_model


def load_tokenizer(cfg: ModelConfig):
    """The model's HF tokenizer (from the converted folder when there is one, else the GGUF)."""
    from transformers import AutoTokenizer

    resolved = resolve_model(cfg)
    if resolved.hf_dir is not None:
        return AutoTokenizer.from_pretrained(resolved.hf_dir)
    assert resolved.gguf_path is not None
    return AutoTokenizer.from_pretrained(str(resolved.gguf_path.parent), gguf_file=resolved.gguf_path.name)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Messages [{"role", "content"}] -> prompt text with the model's chat template."""
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError("each message needs a string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"unknown message role {m['role']!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; send a plain prompt")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
