"""Structured-output workloads: the constraints a campaign's requests carry, and whether each
output meets its constraint.

    workload: {kind: synthetic, ..., constraints_path: load_tests/data/structured-constraints.json}

The file is a JSON list of constraints, each in the shape of vLLM's `structured_outputs`
object (the OpenAI HTTP target sends it as that field; the router reads the same keys):

    {"json": {...a JSON Schema...}}   {"json_object": true}   {"regex": "[A-Z]{2}-[0-9]{4}"}
    {"choice": ["approve", "reject"]}   {"grammar": "start: ..."}   (Lark or GBNF)

Request i carries constraint i mod len. A constrained request ends where its grammar is
complete (EOS); its `output` length is only a ceiling (max_tokens).

Validity of a finished output (RequestRecord.structured_valid; RunSummary.structured_valid_rate
= valid / completed constrained requests): json -> parses and validates against the schema
(`jsonschema`, the test extra), json_object -> parses to an object, regex -> the whole text
matches (Python `re`: write patterns in the syntax both share), choice -> exactly one of the
choices. Grammars are not checked here (None): no second parser of Lark / GBNF is at hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.seams import StructuredOutput


def read_constraints(path: str | Path) -> tuple[StructuredOutput, ...]:
    """The constraints of a `constraints_path` file, each checked for shape (InvalidRequestError
    naming the entry). Whether each compiles is the server's to say, per request."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{path}: cannot read the constraints ({exc})") from None
    if not isinstance(entries, list) or not entries:
        raise InvalidRequestError(f"{path}: a non-empty JSON list of constraints is expected")
    out = []
    for i, entry in enumerate(entries):
        structured = _from_entry(entry)
        problem = "one of json, json_object, regex, choice, grammar per entry" if structured is None else \
            structured.problem()
        if problem:
            raise InvalidRequestError(f"{path}[{i}]: {problem}")
        out.append(structured)
    if any(s.kind == "json_schema" for s in out):
        try:
            import jsonschema  # noqa: F401 - the validity check needs it; a test extra, so asked for here
        except ImportError:
            raise InvalidRequestError("JSON Schema constraints are checked with jsonschema: "
                                      "pip install 'kvmesh[test]'") from None
    return tuple(out)


def _from_entry(entry) -> StructuredOutput | None:
    if not isinstance(entry, dict) or len(entry) != 1:
        return None
    (key, value), = entry.items()
    if key == "json" and isinstance(value, dict):
        return StructuredOutput("json_schema", json.dumps(value))
    if key == "json_object" and value is True:
        return StructuredOutput("json_object")
    if key in ("regex", "grammar") and isinstance(value, str):
        return StructuredOutput(key, value)
    if key == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        return StructuredOutput("choice", choices=tuple(value))
    return None


def http_fields(structured: StructuredOutput) -> dict:
    """The OpenAI request body field that asks for `structured` (vLLM's structured_outputs)."""
    value = {"json_schema": lambda: {"json": json.loads(structured.spec)}, "json_object": lambda: {"json_object": True},
             "regex": lambda: {"regex": structured.spec}, "choice": lambda: {"choice": list(structured.choices)},
             "grammar": lambda: {"grammar": structured.spec}}[structured.kind]()
    return {"structured_outputs": value}


def output_is_valid(structured: StructuredOutput, text: str) -> bool | None:
    """Whether `text` meets `structured` (module doc); None when this kind is not checked."""
    if structured.kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if structured.kind == "json_object":
            return isinstance(value, dict)
        import jsonschema  # the test extra: only runs with JSON Schema constraints import it

        try:
            jsonschema.validate(value, json.loads(structured.spec))
        except jsonschema.ValidationError:
            return False
        return True
    if structured.kind == "regex":
        return re.fullmatch(structured.spec, text) is not None
    if structured.kind == "choice":
        return text in structured.choices
    return None
