"""Checks of a Generate request's own fields, outside its sampling parameters: one function per
rule, called by RouterCore for gRPC and HTTP alike (the sampling rules are
`kvmesh.core.seams.SAMPLING_RULES`). Each raises InvalidRequestError (INVALID_ARGUMENT /
HTTP 400) with a message a user can act on; docs/api.md lists every rule.

Why these exist: text reaches the tokenizer (Rust) and the chat template (Jinja), which
raise their own exception types on input they cannot take; a lone UTF-16 surrogate from a
JSON body, for one, would otherwise surface as an internal error.
"""

from __future__ import annotations

from kvmesh.core.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 256
MAX_MODEL_NAME_CHARS = 256


def check_text(text: str, field: str) -> None:
    """Text must be a string of Unicode scalar values (encodable as UTF-8)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{field} must be a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{field} is not valid Unicode text (it holds a lone surrogate)") from None


def check_request_id(request_id: str) -> None:
    """Client request ids: any text of at most MAX_REQUEST_ID_CHARS characters ("" = assigned)."""
    check_text(request_id, "request_id")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters")


def check_model_name(model: str) -> None:
    check_text(model, "model")
    if len(model) > MAX_MODEL_NAME_CHARS:
        raise InvalidRequestError(f"model must be at most {MAX_MODEL_NAME_CHARS} characters")


def check_prompt_token_ids(ids: tuple[int, ...], vocab_size: int) -> None:
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab_size})")


def check_stop_strings(stop: tuple[str, ...]) -> None:
    for s in stop:
        check_text(s, "stop")

