"""Structured-output constraints as llguidance grammars, torch-free so the router uses it too.

llguidance (guidance-ai/llguidance, the engine behind vLLM's `guidance` backend and
llama.cpp's `--llguidance`) turns a JSON Schema, a regex, a choice list or a Lark / GBNF
grammar into one grammar text; an `LLMatcher` built from that text and the model's tokenizer
gives the token mask of each step. Why llguidance rather than xgrammar: it needs neither torch
nor anything else at import (the router validates with it before reserving anything, and the
router never imports torch), its matcher is built lazily (an Earley parser over a lexer built
on demand: a 50-property schema takes ~2 ms, not a compile step that blocks), and it reads
GBNF as well as Lark.

    grammar_text(StructuredOutput("regex", r"\\d{3}"))  -> 'start: /\\d{3}/' (llguidance's text)
    check_structured_output(so)                       -> raises InvalidRequestError naming the problem
    grammar_key(so, tokenizer_id)                     -> the compiled-grammar cache key (sha256)

JSON is generated compact (no whitespace between tokens, as OpenAI's and llama.cpp's JSON
modes do): a flexible-whitespace grammar lets a model spend its whole max_tokens on spaces
and newlines, which llguidance would allow forever.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import threading

import llguidance

from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.seams import StructuredOutput

# llguidance's JSON compile options for every json_schema / json_object request.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_VALIDATION_CACHE_SIZE = 1024  # distinct constraints whose verdict the router remembers


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar for a constraint (not yet checked: see check_structured_output).
    Raises InvalidRequestError when the spec is not even well-formed text of its kind (a
    schema that is not JSON)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema must be a JSON object (a JSON Schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # Each choice a literal alternative: the output is exactly one of them.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in structured.choices))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (recognised by `::=`)
    raise InvalidRequestError(f"unknown structured output kind {kind!r}")


def check_structured_output(structured: StructuredOutput | None) -> None:
    """Raise InvalidRequestError naming the problem when the constraint cannot be compiled
    (bad schema, regex or grammar). Tokenizer-independent, so the router can answer before it
    reserves quota or KV; verdicts are remembered by content (the same schema again is free)."""
    if structured is None:
        return
    problem = structured.problem()
    if problem is None:
        problem = _grammar_problem(structured)
    if problem:
        raise InvalidRequestError(f"invalid {structured.kind}: {problem}")


@functools.lru_cache(maxsize=_VALIDATION_CACHE_SIZE)
def _grammar_problem(structured: StructuredOutput) -> str:
    try:
        text = grammar_text(structured)
    except InvalidRequestError as exc:
        return exc.message
    except ValueError as exc:  # llguidance: the schema text is not a JSON object
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return messages[0].strip() if is_error and messages else ""


def grammar_key(structured: StructuredOutput, tokenizer_id: str) -> str:
    """Cache key of a compiled grammar: sha256 over (tokenizer identity, kind, spec, choices)."""
    h = hashlib.sha256()
    for part in (tokenizer_id, structured.kind, structured.spec, *structured.choices):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.encode("utf-8"))
    return h.hexdigest()


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> "llguidance.LLTokenizer":
    """llguidance's view of the model's HF tokenizer: the token trie and the slices its masks
    use (~0.35 s of CPU for a 50k vocabulary, holding the GIL throughout). Built once per
    process for a given tokenizer, vocabulary and EOS set: engines in one process (tests,
    benchmarks) share it. The mask spans the model's whole vocabulary (`vocab_size`, which
    may pad past the tokenizer's); EOS is every id the engine stops on. As llguidance.hf
    does, from the Rust tokenizer's JSON (a fast tokenizer), padding and truncation off."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (Rust) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    key = (hashlib.sha256(text.encode("utf-8")).hexdigest(), vocab_size, tuple(eos_token_ids))
    with _LL_TOKENIZERS_LOCK:
        found = _LL_TOKENIZERS.get(key)
        if found is None:
            found = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids))
            _LL_TOKENIZERS[key] = found
        return found


_LL_TOKENIZERS: dict[tuple, "llguidance.LLTokenizer"] = {}  # see ll_tokenizer
_LL_TOKENIZERS_LOCK = threading.Lock()
