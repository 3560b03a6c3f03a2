"""Peer engines for the `peers` campaign: the same model, served by other batching code.

  hf_static      HF transformers `generate` on fixed batches (default 8): a batch is formed
                 from whatever waits (up to batch_size), run until its longest request ends,
                 and only then is the next batch formed -- the article's "static batching"
  hf_continuous  HF transformers 5.x continuous batching (ContinuousBatchingManager), streamed
  llama_cpp      llama-cpp-python on the GGUF file, one request at a time (only if importable)

Model source: `options.model_path` (HF folder), else the run config's model.path, else
the embedded SmolLM2 (the GGUF, converted to an HF folder by kvmesh.worker.model.loader).
Per-token timing for hf_static comes from a logits processor, called once per decoding
step after the step's forward pass: step k's call is when every request of the batch has
its k-th token (a request whose max_tokens < k is done; its extra tokens are discarded).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from kvmesh.load_tests.targets import StreamChunk, Target, TargetRequest
from kvmesh.core.errors import InvalidRequestError, WorkerFailedError
from kvmesh.core.config import ModelConfig
from kvmesh.worker.engine_api import ensure_hf_dir

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _model_source(options: dict, config: dict) -> tuple[str | None, str | None]:
    """(hf_dir, gguf_path) for the peer to load."""
    path = options.get("model_path") or (config.get("model") or {}).get("path")

    resolved = ensure_hf_dir(ModelConfig(path=path))  # GGUF: converted to a cached HF folder once
    return (str(resolved.hf_dir) if resolved.hf_dir else None,
            str(resolved.gguf_path) if resolved.gguf_path else None)


def _load_hf_model(options: dict, config: dict, attn_implementation: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir, _ = _model_source(options, config)
    dtype = getattr(torch, _DTYPES.get(options.get("dtype", "fp32"), "float32"))
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs).eval()


@dataclass
class _Pending:
    request: TargetRequest
    chunks: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False

    def post(self, item) -> None:
        if not self.cancelled:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)


class HFStaticBatchTarget(Target):
    name = "hf_static"

    def __init__(self, options: dict, config: dict):
        self.options, self.config = options, config
        self.batch_size = int(options.get("batch_size", 8))
        if self.batch_size < 1:
            raise InvalidRequestError("hf_static batch_size must be >= 1")
        self.model = None
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        self.model = await asyncio.to_thread(_load_hf_model, self.options, self.config)
        self._thread = threading.Thread(target=self._serve, name="hf-static-batcher", daemon=True)
        self._thread.start()

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        pending = _Pending(request, asyncio.Queue(), asyncio.get_running_loop())
        self._inbox.put(pending)
        try:
            while True:
                item = await pending.chunks.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            pending.cancelled = True  # a static batch cannot drop a member: its tokens are discarded

    def _serve(self) -> None:
        while True:
            first = self._inbox.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                batch.append(nxt)
            try:
                self._run_batch(batch)
            except Exception as exc:  # report to every member, keep serving
                logger.exception("hf_static batch failed")
                for p in batch:
                    p.post(WorkerFailedError(f"hf generate failed: {exc}"))

    def _run_batch(self, batch: list[_Pending]) -> None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        lengths = [len(p.request.prompt_token_ids) for p in batch]
        width = max(lengths)
        # Left padding: every prompt ends at the same column, so step k is token k for all.
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - lengths[row]:] = torch.tensor(p.request.prompt_token_ids)
            mask[row, width - lengths[row]:] = 1
        max_new = max(p.request.max_tokens for p in batch)
        step = {"k": 0}

        class _StepClock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                step["k"] += 1
                for p in batch:
                    if step["k"] <= p.request.max_tokens:
                        done = step["k"] == p.request.max_tokens
                        p.post(StreamChunk(1, finished=done, completion_tokens=p.request.max_tokens if done else None))
                return scores

        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([_StepClock()]))

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None


class HFContinuousTarget(Target):
    """transformers' ContinuousBatchingManager; tokens stream through result handlers."""

    name = "hf_continuous"

    def __init__(self, options: dict, config: dict):
        self.options, self.config = options, config
        self.manager = None

    async def start(self) -> None:
        from transformers import GenerationConfig

        model = await asyncio.to_thread(_load_hf_model, self.options, self.config,
                                        self.options.get("attn_implementation"))
        gen = GenerationConfig(max_new_tokens=int(self.options.get("max_new_tokens", 2048)), do_sample=False,
                               eos_token_id=-1, pad_token_id=0,
                               max_batch_tokens=int(self.options.get("max_batch_tokens", 256)))
        self.manager = model.init_continuous_batching(generation_config=gen)
        self.manager.start()

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        chunks: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(request.request_id, chunks.put_nowait)
        self.manager.add_request(list(request.prompt_token_ids), request_id=request.request_id,
                                 max_new_tokens=request.max_tokens, streaming=True, eos_token_id=-1)
        seen = 0
        finished = False
        try:
            while not finished:
                out = await chunks.get()
                if out.error:
                    raise WorkerFailedError(f"hf continuous batching: {out.error}")
                finished = out.is_finished()
                new = len(out.generated_tokens) - seen
                seen = len(out.generated_tokens)
                if new > 0 or finished:
                    yield StreamChunk(max(new, 0), finished=finished, completion_tokens=seen if finished else None)
        finally:
            if not finished:
                self.manager.cancel_request(request.request_id)

    async def close(self) -> None:
        if self.manager is not None:
            await asyncio.to_thread(self.manager.stop, True, 30.0)
            self.manager = None


class LlamaCppTarget(Target):
    """llama-cpp-python on the GGUF file; one request at a time in a worker thread."""

    name = "llama_cpp"

    def __init__(self, options: dict, config: dict):
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise InvalidRequestError("target llama_cpp needs llama-cpp-python (pip install llama-cpp-python)") from None
        self.options, self.config = options, config
        self.llm = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        from llama_cpp import Llama

        _, gguf = _model_source(self.options, self.config)
        if gguf is None:
            raise InvalidRequestError("llama_cpp needs a GGUF model (model.path ending in .gguf or the embedded one)")
        self.llm = await asyncio.to_thread(Llama, model_path=gguf, n_ctx=int(self.options.get("n_ctx", 4096)),
                                           verbose=False)

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        async with self._lock:
            it = self.llm.generate(list(request.prompt_token_ids), temp=0.0)
            for i in range(request.max_tokens):
                await asyncio.to_thread(next, it)
                done = i + 1 == request.max_tokens
                yield StreamChunk(1, finished=done, completion_tokens=request.max_tokens if done else None)


def build_peer_target(kind: str, options: dict, config: dict) -> Target:
    cls = {"hf_static": HFStaticBatchTarget, "hf_continuous": HFContinuousTarget, "llama_cpp": LlamaCppTarget}[kind]
    return cls(options, config)
