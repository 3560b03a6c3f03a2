"""Stage 2: everything about the request that needs no capacity: its id, model and adapter,
deadline, sampling rules, stop strings, a structured-output constraint that must compile, the
prompt (chat rendered, tokenized as the engine does) and whether it fits the model's context.
Its product is the worker's `GenerateRequest` with the request's budget inside
(`RequestBudget`: prompt tokens, max_tokens x n, KV tokens), computed here once: quota,
degrade and admit read it, and the worker verifies it rather than deriving its own.

Request ids: the client's id (or a generated one) is scoped by tenant on the worker
(`<tenant>/<id>`), so one tenant can never cancel another's request by guessing its id.
"""

from __future__ import annotations

import time
import uuid

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import DeadlineExceededError, InvalidRequestError
from kvmesh.core.seams import GenerateRequest, check_fits_context
from kvmesh.kv.kv_cost import request_budget
from kvmesh.router import request_rules
from kvmesh.router.adapters import AdapterRegistry
from kvmesh.router.convert import InboundRequest
from kvmesh.router.stages.context import RequestContext
from kvmesh.worker.public_api import check_structured_output, render_chat


def scoped_request_id(tenant_id: str, request_id: str) -> str:
    return f"{tenant_id}/{request_id}"


class RequestValidator:
    """Builds the worker's request from what the edge decoded, or raises InvalidRequestError
    (AdapterNotFoundError, PermissionDeniedError, DeadlineExceededError)."""

    def __init__(self, config: KvmeshConfig, tokenizer, adapters: AdapterRegistry, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.model_name = model_name

    def validate(self, ctx: RequestContext, max_model_len: int | None, block_size: int) -> None:
        """Set `ctx.request`. `max_model_len`: the workers' context length (None before any
        worker answered: not checked here, the worker checks it); `block_size`: theirs."""
        inbound, tenant = ctx.inbound, ctx.tenant
        request_rules.check_request_id(inbound.request_id)
        request_rules.check_model_name(inbound.model)
        request_rules.check_model_name(inbound.adapter)
        adapter = self.adapters.resolve(inbound.model, inbound.adapter, self.model_name, tenant.id)
        if inbound.deadline_s is not None and inbound.deadline_s <= time.time():
            raise DeadlineExceededError("the request's deadline passed before it was started")
        inbound.sampling.validate(self.config.scheduler.max_new_tokens, self.config.scheduler.max_n)
        request_rules.check_stop_strings(inbound.sampling.stop)
        check_structured_output(inbound.sampling.structured)  # compiles? answered before any reservation
        prompt_ids = self._prompt_token_ids(inbound, max_model_len)
        ctx.request = GenerateRequest(
            request_id=scoped_request_id(tenant.id, inbound.request_id or uuid.uuid4().hex),
            prompt_token_ids=prompt_ids, sampling=inbound.sampling,
            priority=tenant.priority + inbound.priority, tenant_id=tenant.id, cache_salt=tenant.cache_salt,
            deadline_s=inbound.deadline_s, attempt=inbound.attempt, trace_context=dict(inbound.trace_context),
            resume_token_ids=_resume_token_ids(inbound), resume_text_chars=inbound.resume_text_chars,
            adapter=adapter, budget=request_budget(len(prompt_ids), inbound.sampling, block_size))

    def _prompt_token_ids(self, inbound: InboundRequest, max_model_len: int | None) -> tuple[int, ...]:
        given = [x is not None for x in (inbound.prompt, inbound.messages, inbound.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("send exactly one of prompt, messages (chat) or prompt_token_ids")
        if inbound.prompt_token_ids is not None:
            ids = tuple(inbound.prompt_token_ids)
            request_rules.check_prompt_token_ids(ids, len(self.tokenizer))
        else:
            text = inbound.prompt
            if inbound.messages is not None:
                for message in inbound.messages:
                    request_rules.check_text(message.content, "message content")
                text = render_chat(self.tokenizer, [m.to_dict() for m in inbound.messages])
            request_rules.check_text(text, "prompt")
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))  # as the engine does
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if max_model_len is not None:
            check_fits_context(len(ids), inbound.sampling.max_tokens, max_model_len)
        return ids


def _resume_token_ids(inbound: InboundRequest) -> tuple[int, ...]:
    """A client's resumption, checked where the router can (the engine checks the ids against
    its vocabulary): one sample, something left to generate."""
    ids = inbound.resume_token_ids
    if ids and inbound.sampling.n != 1:
        raise InvalidRequestError("only a single-sample request (n = 1) can be resumed")
    if ids and len(ids) >= inbound.sampling.max_tokens:
        raise InvalidRequestError(f"{len(ids)} resume_token_ids leave nothing of max_tokens "
                                  f"({inbound.sampling.max_tokens})")
    if inbound.resume_text_chars and not ids:
        raise InvalidRequestError("resume_text_chars without resume_token_ids")
    return ids
