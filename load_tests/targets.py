"""What a load test sends requests to. Every target streams `StreamChunk`s for a request and
raises errors from kvmesh.core.errors, so the driver's retry and error accounting is the
same whichever target is under test.

  engine  the in-process AsyncEngine (kvmesh.worker.runtime.async_engine) with config overrides
  http    an OpenAI-compatible server (/v1/completions, streamed SSE) via httpx
  grpc    the kvmesh router through its client library (kvmesh.router.client)
  cluster a local kvmesh cluster started for the run, then tested over gRPC (grpc_target.py)
  hf_static, hf_continuous, llama_cpp   peer engines (peer_targets.py)

Network targets are loopback-only unless `allow_remote` is set: a load test aimed at the
wrong host is a denial-of-service attack.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlparse

from kvmesh.core.errors import (InvalidRequestError, KvmeshError, OverloadedError, QuotaExceededError,
                                  UnauthenticatedError, WorkerFailedError)
from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import AdapterRef, FinishReason, GenerateRequest, SamplingParams, StructuredOutput
from kvmesh.load_tests.server_metrics import parse_prometheus_sample
from kvmesh.load_tests.structured_workload import http_fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_text: str
    max_tokens: int  # exact output length: sent with ignore_eos (a ceiling when `stop` is set)
    tenant_id: str = "default"
    api_key: str | None = None
    attempt: int = 1  # 1 = first attempt
    stop: tuple[str, ...] = ()  # stop strings: the output ends at the first (EOS counts too)
    structured: StructuredOutput | None = None  # the output ends where the constraint is complete
    adapter: str | None = None  # a LoRA adapter's name (None = the base model)

    @property
    def exact_length(self) -> bool:
        """Exactly max_tokens (ignore_eos), or up to max_tokens ending at a stop or the grammar's end."""
        return not self.stop and self.structured is None

    def sampling(self) -> SamplingParams:
        """Greedy; exactly max_tokens, or up to max_tokens ending at a stop string or EOS."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.exact_length,
                              stop=self.stop, structured=self.structured)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed delta as the client sees it."""

    num_tokens: int  # tokens carried by this delta (0 for a usage-only final chunk)
    finished: bool = False
    text: str = ""  # the delta's text (the driver keeps it for structured-output checks)
    completion_tokens: int | None = None  # the server's count, on the final chunk
    cached_tokens: int | None = None
    degraded: bool = False  # the server's degradation ladder capped it or sent it to its fallback pool
    # the delta's token ids, where the target sees them (engine, gRPC; the OpenAI HTTP stream
    # carries text only): what the chaos campaign compares with each prompt's greedy output
    token_ids: tuple[int, ...] | None = None


class Target(ABC):
    name: str = "target"

    async def start(self) -> None:
        """Load models / open connections (not timed)."""

    @abstractmethod
    def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        """An async generator of chunks; closing it early cancels the request server-side."""

    async def server_sample(self) -> dict[str, float] | None:
        """Server-side figures right now (KV usage, running, waiting, ...); None = unknown."""
        return None

    async def close(self) -> None:
        """Release everything start() acquired."""


def check_loopback(url: str, allow_remote: bool) -> None:
    host = urlparse(url).hostname or ""
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidRequestError(f"refusing non-loopback target {host!r}; pass --allow-remote to load-test it")


# ---- in-process engine --------------------------------------------------------------------


def engine_stats_sample(stats) -> dict[str, float]:
    """WorkerStats -> the server-sample keys the report plots."""
    total = max(1, stats.num_blocks_total)
    return {
        "kv_usage": stats.num_blocks_used / total,
        "kv_tokens_used": float(stats.kv_tokens_used),
        "num_running": float(stats.num_running),
        "num_waiting": float(stats.num_waiting),
        "num_preemptions": float(stats.num_preemptions_recompute + stats.num_preemptions_swap),
        "num_priority_preemptions": float(stats.num_preemptions_priority),
        "num_priority_preemptions_kv": float(stats.num_preemptions_priority_kv),
        "num_outgrown_estimates": float(stats.num_outgrown_estimates),
        "prefix_cache_hit_rate": float(stats.prefix_cache_hit_rate),
        "num_adapter_loads": float(stats.num_adapter_loads),
    }


class EngineTarget(Target):
    """kvmesh's AsyncEngine in this process, built from a config dict (campaign overrides)."""

    name = "engine"

    def __init__(self, config: dict, worker_id: str = "loadtest-0"):
        self.config_dict = config
        self.worker_id = worker_id
        self.engine = None
        self.adapter_paths: dict[str, str] = {}  # lora.adapters: name -> folder

    async def start(self) -> None:
        from kvmesh.worker.engine_api import AsyncEngine  # torch: only for an engine target

        config = KvmeshConfig.from_dict(self.config_dict)
        self.adapter_paths = {a.name: a.path for a in config.lora.adapters}
        # Model loading blocks for seconds: keep it off the event loop.
        self.engine = await asyncio.to_thread(AsyncEngine.from_config, config, self.worker_id)

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        adapter = None
        if request.adapter is not None:
            if request.adapter not in self.adapter_paths:
                raise InvalidRequestError(f"adapter {request.adapter!r} is not in the engine's lora.adapters")
            adapter = AdapterRef(request.adapter, self.adapter_paths[request.adapter])
        req = GenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                              sampling=request.sampling(),
                              tenant_id=request.tenant_id, attempt=request.attempt, adapter=adapter)
        async with contextlib.aclosing(self.engine.generate(req)) as deltas:
            async for delta in deltas:
                if delta.finish_reason == FinishReason.ERROR:
                    raise WorkerFailedError(delta.error or "engine error")
                usage = delta.usage if delta.finished else None
                yield StreamChunk(num_tokens=len(delta.token_ids), finished=delta.finished, text=delta.text,
                                  completion_tokens=usage.completion_tokens if usage else None,
                                  cached_tokens=usage.cached_tokens if usage else None,
                                  token_ids=tuple(delta.token_ids))

    async def server_sample(self) -> dict[str, float] | None:
        if self.engine is None:
            return None
        return engine_stats_sample(await self.engine.stats_async())  # waits in a thread, not the loop

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None


# ---- OpenAI-compatible HTTP ---------------------------------------------------------------


def http_error(status: int, body: str, retry_after: str | None) -> KvmeshError:
    """HTTP status -> the kvmesh error a client would act on (the router maps them back)."""
    retry_after_s = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else 1.0
    message = f"HTTP {status}: {body[:200]}"
    if status == 429:
        return QuotaExceededError(message, retry_after_s)
    if status == 503:
        return OverloadedError(message, retry_after_s)
    if status == 401:
        return UnauthenticatedError(message)
    if 400 <= status < 500:
        return InvalidRequestError(message)
    return WorkerFailedError(message)


class OpenAIHttpTarget(Target):
    """POST {base_url}/v1/completions with stream=true; counts one token per content chunk
    and takes the final usage chunk's completion_tokens as the authoritative count."""

    name = "http"

    def __init__(self, base_url: str, model: str | None = None, metrics_url: str | None = None,
                 allow_remote: bool = False, send_token_ids: bool = False, timeout_s: float = 600.0):
        check_loopback(base_url, allow_remote)
        if metrics_url:
            check_loopback(metrics_url, allow_remote)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.metrics_url = metrics_url
        self.send_token_ids = send_token_ids
        self.timeout_s = timeout_s
        self.client = None

    async def start(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)

    def _body(self, request: TargetRequest) -> dict:
        body = {"prompt": list(request.prompt_token_ids) if self.send_token_ids else request.prompt_text,
                "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": request.exact_length, "stream_options": {"include_usage": True}}
        if request.stop:
            body["stop"] = list(request.stop)
        if request.structured is not None:
            body |= http_fields(request.structured)
        if request.adapter:  # "base:adapter" as OpenAI clients name an adapter of a base model
            body["model"] = f"{self.model}:{request.adapter}" if self.model else request.adapter
        elif self.model:
            body["model"] = self.model
        return body

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        import httpx

        headers = {"Authorization": f"Bearer {request.api_key}"} if request.api_key else {}
        if request.attempt > 1:
            headers["x-kvmesh-attempt"] = str(request.attempt)  # lets the router use its retry lane
        try:
            async with self.client.stream("POST", f"{self.base_url}/v1/completions", json=self._body(request),
                                          headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    raise http_error(resp.status_code, body, resp.headers.get("retry-after"))
                async for line in resp.aiter_lines():
                    chunk = parse_sse_line(line)
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as exc:
            raise WorkerFailedError(f"transport: {type(exc).__name__}") from exc

    async def server_sample(self) -> dict[str, float] | None:
        if not self.metrics_url or self.client is None:
            return None
        try:
            resp = await self.client.get(self.metrics_url, timeout=2.0)
        except Exception as exc:  # a missing /metrics must not fail the load test
            logger.debug("metrics scrape failed: %s", exc)
            return None
        return parse_prometheus_sample(resp.text) if resp.status_code == 200 else None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def parse_sse_line(line: str) -> StreamChunk | None:
    """One SSE line of an OpenAI completions stream -> a chunk (None: nothing to count)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    data = json.loads(payload)
    if "error" in data:
        raise WorkerFailedError(f"stream error: {data['error']}")
    usage = data.get("usage")
    choices = data.get("choices") or []
    text = "".join((c.get("text") or c.get("delta", {}).get("content") or "") for c in choices)
    finished = any(c.get("finish_reason") for c in choices) or usage is not None
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        return StreamChunk(num_tokens=1 if text else 0, finished=True, completion_tokens=usage.get("completion_tokens"),
                           cached_tokens=details.get("cached_tokens"), degraded=bool(usage.get("kvmesh_degraded")),
                           text=text)
    if not text and not finished:
        return None
    return StreamChunk(num_tokens=1 if text else 0, finished=finished, text=text)
