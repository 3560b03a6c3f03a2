"""The engine as a library: the one module of worker/ that load_tests/ (benchmarks, peer
comparisons, campaigns) may import, as vLLM's offline benchmarks use its `LLM` class and
engine rather than the scheduler or the model runner.

    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_api import Engine

    engine = Engine.from_config(KvmeshConfig.from_dict({"model": {"path": "./hf-folder"}}))
    engine.add_request(GenerateRequest("r1", prompt="Hello", sampling=SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for delta in engine.step():          # one scheduler step: every running request's deltas
            print(delta.text, end="")

What it offers, and nothing else of worker/:

    Engine            the synchronous engine (docs/engine.md): add_request / step /
                      has_unfinished / abort / stats / kv_tier_figures / check_integrity
    AsyncEngine       the same engine behind a step thread, streamed with asyncio
                      (what a worker actor runs)
    start_workers, kill_workers
                      the engine as Ray worker actors (as the router starts them)
    resolve_model, ensure_hf_dir, embedded_gguf_path, load_tokenizer, render_chat
                      the model files and tokenizer the engine would use for a config
    cpu_has_native_bf16
                      whether `model.dtype: auto` picks bf16 on this CPU
    LORA_MODULES, lora_projection_shapes
                      the projections a LoRA adapter may target and their (out, in) shapes
                      for a model's config (what an adapter written for it must hold)

Requests, deltas, stats and errors are the bottom layer's (kvmesh.core). A benchmark that
measures a component itself (a kernel, the router's policy) imports that component and is
named in tests/test_layers.py's COMPONENT_BENCHMARKS with its reason.
"""

from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.model.loader import embedded_gguf_path, ensure_hf_dir
from kvmesh.worker.model.lora_weights import LORA_MODULES
from kvmesh.worker.model.lora_weights import projection_shapes as lora_projection_shapes
from kvmesh.worker.model.tokenizer import load_tokenizer, render_chat
from kvmesh.worker.runner.model_setup import cpu_has_native_bf16, resolve_model
from kvmesh.worker.runtime.actor import kill_workers, start_workers
from kvmesh.worker.runtime.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "Engine", "LORA_MODULES", "cpu_has_native_bf16", "lora_projection_shapes", "embedded_gguf_path", "ensure_hf_dir", "kill_workers",
           "load_tokenizer", "render_chat", "resolve_model", "start_workers"]
