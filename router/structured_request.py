"""The structured-output forms an OpenAI request body may carry, as one StructuredOutput.

    response_format   {"type": "text"}                                  free text (OpenAI)
                      {"type": "json_object"}                           any JSON object
                      {"type": "json_schema", "json_schema":
                         {"name": ..., "schema": {...}, "strict": ...}} that schema
    guided_json       a schema (object or JSON text)                    vLLM's names
    guided_regex      a pattern
    guided_choice     a list of strings
    guided_grammar    a Lark or GBNF grammar
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
                                                                        vLLM's newer object

At most one may be given (two constraints on one output are refused rather than one picked).
`strict` is accepted either way and the schema is always enforced: kvmesh masks tokens, it
never merely asks the model. Whether the schema, regex or grammar compiles is checked later,
by RouterCore, before anything is reserved (worker/model/grammar.py).
"""

from __future__ import annotations

import json

from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.seams import StructuredOutput

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}


def structured_from_body(body: dict) -> StructuredOutput | None:
    """The one constraint the body asks for, or None (free text). InvalidRequestError when a
    form is malformed or more than one is given."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    for name in _GUIDED_FIELDS:
        value = body.get(name)
        if value is not None:
            found.append((name, _from_guided(name.removeprefix("guided_"), value, name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequestError("'structured_outputs' must be an object")
        for key, value in outputs.items():
            if key not in _STRUCTURED_OUTPUTS_KEYS:
                continue  # vLLM's other keys (backend options, ...) do not apply here
            if value is None or (key == "json_object" and value is False):
                continue
            found.append((f"structured_outputs.{key}", _from_guided(key, value, f"structured_outputs.{key}")))
    if len(found) > 1:
        raise InvalidRequestError("at most one structured output constraint per request, got "
                                  + ", ".join(name for name, _ in found))
    return found[0][1] if found else None


def _from_response_format(value) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("'response_format' must be an object with a string 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format json_schema needs a 'json_schema' object")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format json_schema needs 'json_schema.schema', a JSON Schema object")
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise InvalidRequestError("'json_schema.strict' must be a boolean")
        return StructuredOutput("json_schema", json.dumps(schema))
    raise InvalidRequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _from_guided(kind: str, value, field: str) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, dict):
            return StructuredOutput("json_schema", json.dumps(value))
        if isinstance(value, str):
            return StructuredOutput("json_schema", value)
        raise InvalidRequestError(f"'{field}' must be a JSON Schema object or its JSON text")
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"'{field}' must be true or absent")
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"'{field}' must be a list of strings")
        return StructuredOutput("choice", choices=tuple(value))
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{field}' must be a string")
    return StructuredOutput(kind, value)  # regex | grammar
