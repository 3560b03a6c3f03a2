"""OpenAI-compatible HTTP API (FastAPI), served by each router replica itself
(router/http_ingress.py; no proxy process between the client and the replica).

    POST /v1/completions        prompt (text or token ids) -> text; SSE when "stream": true
    POST /v1/chat/completions   messages -> assistant message; SSE when "stream": true
    GET  /v1/models             the served model
    GET  /health                200 while at least one worker is routable, else 503
    GET  /metrics               Prometheus text format
    GET  /-/healthz             200 "success" while the replica serves (the liveness path of
                                Serve's proxy, which KubeRay probes on the serve port)

Every route goes through the replica's `RouterCore`, the same object the gRPC servicer
uses. Usage follows OpenAI, including `prompt_tokens_details.cached_tokens` (prompt tokens
served from the prefix cache); streamed responses carry it in a last chunk with empty
`choices` when `stream_options.include_usage` is true, as OpenAI does.

kvmesh extensions (request body): top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
request_id. Structured output: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`
(router/structured_request.py). Headers: `Authorization: Bearer <key>`, `x-kvmesh-attempt` (client retry count),
`x-kvmesh-timeout-s` (deadline, seconds from arrival). Errors use OpenAI's error body and
the statuses of router/status_map.py; an error after streaming began is sent as one SSE
`data: {"error": ...}` event (the status line is already gone), then the stream ends.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvmesh.router import degradation, status_map
from kvmesh.router.auth import bearer_token
from kvmesh.router.convert import ChatMessage, InboundRequest
from kvmesh.router.router_core import RequestStream, RouterCore
from kvmesh.router.structured_request import structured_from_body
from kvmesh.core.seams import RequestDelta, SamplingParams, Usage, request_usage
from kvmesh.core.errors import InvalidRequestError
from kvmesh.router.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-kvmesh-timeout-s"
WORKER_HEADER = "x-kvmesh-worker"  # which worker served the request (debugging, tests)

# OpenAI field -> SamplingParams field, with the type each must have.
_SAMPLING_FIELDS = {
    "max_tokens": ("max_tokens", int), "temperature": ("temperature", float), "top_p": ("top_p", float),
    "top_k": ("top_k", int), "min_p": ("min_p", float), "seed": ("seed", int), "n": ("n", int),
    "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
    "repetition_penalty": ("repetition_penalty", float), "ignore_eos": ("ignore_eos", bool),
    "min_tokens": ("min_tokens", int),
    "speculative": ("speculative", bool),  # kvmesh extension: false = never speculate for it
}


def build_replica_app(core: RouterCore, board=None) -> FastAPI:
    """The ASGI app one router replica serves (router/app.py starts it on its HTTP server):
    every route over that replica's `RouterCore`; `board` is the MetricsBoard actor whose peer
    snapshots /metrics merges in."""
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate_response(core, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate_response(core, request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return models_body(core, bearer_token(request.headers.get("authorization")))

    @app.get("/health")
    async def health() -> Response:
        return health_response(core)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await metrics_response(core, board)

    @app.get("/-/healthz")
    async def liveness() -> Response:
        return PlainTextResponse("success")

    return app


def models_body(core: RouterCore, api_key: str | None = None) -> dict:
    # max_model_len is a kvmesh extension (vLLM reports it too): the context length requests
    # are validated against. LoRA adapters the caller may use follow the base model, with
    # `parent` (and `root`) naming it, as vLLM lists them.
    data = []
    for m in core.list_models(api_key):
        entry = {"id": m.id, "object": "model", "created": 0, "owned_by": m.owned_by, "max_model_len": m.max_model_len}
        if m.parent:
            entry.update(parent=m.parent, root=m.parent)
        data.append(entry)
    return {"object": "list", "data": data}


def _model_name(core: RouterCore, stream: RequestStream) -> str:
    """The `model` a response reports: "<base>:<adapter>" for a request run with an adapter."""
    adapter = stream.adapter
    return core.model_name if adapter is None else f"{core.model_name}:{adapter.name}"


def health_response(core: RouterCore) -> JSONResponse:
    view = core.cluster_view()
    body = {"status": "ok" if view.num_routable else "unavailable", "num_workers": view.num_workers,
            "num_healthy_workers": view.num_routable}
    return JSONResponse(body, status_code=200 if view.num_routable else 503)


async def metrics_response(core: RouterCore, board=None) -> Response:
    """This replica's metrics merged with its peers' latest snapshots from the MetricsBoard
    actor (Serve sends a scrape to any one replica). Board unreachable: own metrics only."""

    peers: list[bytes] = []
    if board is not None:
        try:
            peers = await board.snapshots.remote(exclude=core.metrics.replica_id)
        except Exception as exc:  # the board restarts with the cluster; a partial scrape beats none
            logger.warning("metrics board unreachable (%s); /metrics shows this replica only", type(exc).__name__)
    return Response(core.metrics.render(peers), media_type=CONTENT_TYPE)


async def generate_response(core: RouterCore, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    try:
        body = await _json_body(request)
        inbound = _inbound(request, body, chat)
        streaming, include_usage = _streaming_options(body)  # checked before anything starts
        stream = await core.start(inbound)
    except Exception as exc:
        return error_response(exc)
    created = int(time.time())
    if streaming:
        # Wait for the first delta before answering 200: an error the worker raises before
        # any output (its own validation, its queue timing out) still gets a real status,
        # and the stream's generator is started, so even a client that leaves before the
        # body is sent has its request aborted and its quota released (asyncio closes
        # abandoned, started async generators).
        deltas = stream.__aiter__()
        try:
            first = [await deltas.__anext__()]
        except StopAsyncIteration:
            first = []
        except Exception as exc:
            return error_response(exc)
        events = _sse_events(_chain(first, deltas), stream.request_id, _model_name(core, stream), created, chat,
                             include_usage, stream.degraded)
        return StreamingResponse(events, media_type="text/event-stream", headers=_stream_headers(stream))
    try:
        result = await _collect(stream, _model_name(core, stream), created, chat)
    except Exception as exc:
        return error_response(exc)
    # Read after the stream: a worker that failed before the first token was replaced.
    if stream.degraded:
        result["usage"] = {**(result["usage"] or {}), "kvmesh_degraded": stream.degraded}
    return JSONResponse(result, headers=_stream_headers(stream))


def _stream_headers(stream: RequestStream) -> dict[str, str]:
    """Which worker served the request and, when the degradation ladder admitted it, which
    step (cap | fallback; router/degradation.py): `usage.kvmesh_degraded` says it too."""
    headers = {WORKER_HEADER: stream.worker_id}
    if stream.degraded:
        headers[degradation.DEGRADED_KEY] = stream.degraded
    return headers


def error_response(exc: BaseException) -> JSONResponse:
    status = status_map.status_for(exc)
    if status.kind == "internal":
        logger.exception("request failed", exc_info=exc)
    else:
        status_map.log_client_error(status, "HTTP")
    return JSONResponse(status_map.openai_error_body(status), status_code=status.http_status,
                        headers=status_map.http_headers(status))


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError("the request body must be JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def _inbound(request: Request, body: dict, chat: bool) -> InboundRequest:
    prompt, token_ids, messages = None, None, None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list")
        messages = tuple(_chat_message(m) for m in messages)
    else:
        prompt, token_ids = _completion_prompt(body.get("prompt"))
    timeout_s = _float_header(request, TIMEOUT_HEADER)
    return InboundRequest(
        api_key=bearer_token(request.headers.get("authorization")),
        request_id=_optional(body, "request_id", str) or "",
        prompt=prompt, prompt_token_ids=token_ids, messages=messages,
        sampling=_sampling(body, chat), model=_optional(body, "model", str) or "",
        deadline_s=None if timeout_s is None else time.time() + timeout_s,
        attempt=int(_float_header(request, status_map.ATTEMPT_KEY) or 1),
        trace_context={k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")})


def _streaming_options(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), each a JSON boolean when given."""
    streaming = bool(_optional(body, "stream", bool))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError(f"'stream_options' must be an object, got {options!r}")
    include_usage = bool(_optional(options or {}, "include_usage", bool))
    return streaming, include_usage


def _chat_message(message) -> ChatMessage:
    if not isinstance(message, dict):
        raise InvalidRequestError("each message must be an object with 'role' and 'content'")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise InvalidRequestError("only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    return ChatMessage(message.get("role"), content)


def _completion_prompt(prompt) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    raise InvalidRequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request)")


def _sampling(body: dict, chat: bool) -> SamplingParams:
    kwargs = {}
    for name, (field_name, kind) in _SAMPLING_FIELDS.items():
        value = _optional(body, name, kind)
        if value is not None:
            kwargs[field_name] = value
    if chat and body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"] = _optional(body, "max_completion_tokens", int)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("'stop' must be a string or a list of strings")
        kwargs["stop"] = tuple(stop)
    if body.get("logprobs") not in (None, False, 0):
        kwargs["logprobs"] = True
    structured = structured_from_body(body)  # response_format, guided_*, structured_outputs
    if structured is not None:
        kwargs["structured"] = structured
    return SamplingParams(**kwargs)


def _optional(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidRequestError(f"'{name}' must be of type {kind.__name__}, got {value!r}")
    return value


def _float_header(request: Request, name: str) -> float | None:
    return status_map.positive_float(request.headers.get(name), f"header {name}")


# ---- responses ---------------------------------------------------------------------------

def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _choice(delta: RequestDelta, chat: bool, first: bool) -> dict:
    finish = delta.finish_reason.value if delta.finished and delta.finish_reason else None
    if chat:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": delta.sample_index, "delta": content, "logprobs": None, "finish_reason": finish}
    logprobs = {"token_logprobs": list(delta.logprobs)} if delta.logprobs is not None else None
    return {"index": delta.sample_index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}


async def _chain(first: list[RequestDelta], rest: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
    for delta in first:
        yield delta
    try:
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()


async def _sse_events(stream: AsyncIterator[RequestDelta], request_id: str, model: str, created: int, chat: bool,
                      include_usage: bool, degraded: str | None = None) -> AsyncIterator[str]:
    object_name = "chat.completion.chunk" if chat else "text_completion"
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    started: set[int] = set()
    usages: list[Usage] = []
    try:
        async for delta in stream:
            if delta.usage is not None:
                usages.append(delta.usage)
            if not delta.text and not delta.finished and delta.sample_index in started:
                continue
            chunk = {"id": response_id, "object": object_name, "created": created, "model": model,
                     "choices": [_choice(delta, chat, delta.sample_index not in started)]}
            started.add(delta.sample_index)
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            chunk = {"id": response_id, "object": object_name, "created": created, "model": model,
                     "choices": [], "usage": usage_json(request_usage(usages))}
            if degraded:
                chunk["usage"] = {**(chunk["usage"] or {}), "kvmesh_degraded": degraded}
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
        status = status_map.status_for(exc)
        yield f"data: {json.dumps(status_map.openai_error_body(status))}\n\n"
    yield "data: [DONE]\n\n"


async def _collect(stream: RequestStream, model: str, created: int, chat: bool) -> dict:
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[float]] = {}
    finish: dict[int, str | None] = {}
    usages: list[Usage] = []
    async for delta in stream:
        texts.setdefault(delta.sample_index, []).append(delta.text)
        if delta.logprobs is not None:
            logprobs.setdefault(delta.sample_index, []).extend(delta.logprobs)
        if delta.finished:
            finish[delta.sample_index] = delta.finish_reason.value if delta.finish_reason else None
        if delta.usage is not None:
            usages.append(delta.usage)
    choices = []
    for index in sorted(texts):
        text = "".join(texts[index])
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": finish.get(index)})
        else:
            lp = {"token_logprobs": logprobs[index]} if index in logprobs else None
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish.get(index)})
    return {"id": ("chatcmpl-" if chat else "cmpl-") + stream.request_id,
            "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_json(request_usage(usages))}
