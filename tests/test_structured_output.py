"""Structured output without a cluster: the constraint checks, the HTTP and proto forms, the
sampler's masks, and the engine on the tiny random Llama (random weights produce garbage, so
whatever is valid here is valid because of the masks). Over gRPC and the OpenAI SDK:
tests/test_structured_output_e2e.py."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from engine_runs import tiny_engine
from structured_schemas import HELD_OUT_SCHEMAS
from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.seams import FinishReason, GenerateRequest, SamplingParams, StructuredOutput
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import convert
from kvmesh.router.structured_request import structured_from_body
from kvmesh.worker.engine_loop import structured_output
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.model.grammar import check_structured_output, grammar_key
from kvmesh.worker.runner.sampler import SamplingRow, sample

REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe later")


def _schema(i: int) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(HELD_OUT_SCHEMAS[i]))


def _run(engine: Engine, requests: list[GenerateRequest]) -> tuple[dict, dict]:
    """All requests added at once, stepped to the end with the invariants checked after every
    step; (request id -> {sample index: text}, request id -> {sample index: final delta})."""
    for r in requests:
        engine.add_request(r)
    texts: dict[str, dict[int, str]] = {}
    finals: dict[str, dict[int, object]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            texts.setdefault(d.request_id, {}).setdefault(d.sample_index, "")
            texts[d.request_id][d.sample_index] += d.text
            if d.finished:
                finals.setdefault(d.request_id, {})[d.sample_index] = d
        engine.check_integrity()
    assert engine.stats().num_blocks_used == 0 and engine.stats().kv_tokens_reserved == 0
    return texts, finals


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return tiny_engine(tiny_model_dir, num_blocks=2048)


# ---- constraints: checks and forms ----------------------------------------------------------

@pytest.mark.parametrize("structured,named", [
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "nonsense"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("json_schema", "[1, 2]"), "JSON Schema"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
    (StructuredOutput("grammar", 'root ::= "a" missing'), "missing"),
    (StructuredOutput("choice", choices=()), "choices"),
    (StructuredOutput("choice", choices=("",)), "non-empty"),
    (StructuredOutput("regex", "x" * 70_000), "65536"),
    (StructuredOutput("xml", "<a/>"), "kind"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_the_problem(structured, named):
    with pytest.raises(InvalidRequestError) as info:
        check_structured_output(structured)
    assert named in info.value.message
    if structured.problem():  # a shape problem is a sampling rule too (the engine checks it again)
        with pytest.raises(InvalidRequestError):
            SamplingParams(structured=structured).validate()


def test_every_form_compiles_and_the_cache_key_separates_tokenizers():
    for s in [_schema(i) for i in range(len(HELD_OUT_SCHEMAS))] + [
            StructuredOutput("json_object"), StructuredOutput("regex", REGEX), StructuredOutput("choice", choices=CHOICES),
            StructuredOutput("grammar", 'start: "a" /[0-9]+/'), StructuredOutput("grammar", 'root ::= "x" [0-9]+')]:
        check_structured_output(s)
    assert grammar_key(_schema(0), "m@1") != grammar_key(_schema(0), "m@2")
    assert grammar_key(StructuredOutput("regex", "ab"), "m") != grammar_key(StructuredOutput("grammar", "ab"), "m")


def test_http_forms_map_to_one_constraint_and_two_are_refused():
    schema = HELD_OUT_SCHEMAS[0]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    assert structured_from_body({"response_format": rf}) == StructuredOutput("json_schema", json.dumps(schema))
    assert structured_from_body({"response_format": {"type": "json_object"}}) == StructuredOutput("json_object")
    assert structured_from_body({"response_format": {"type": "text"}}) is None
    assert structured_from_body({"guided_json": schema}).kind == "json_schema"
    assert structured_from_body({"guided_json": json.dumps(schema)}).spec == json.dumps(schema)
    assert structured_from_body({"guided_regex": REGEX}) == StructuredOutput("regex", REGEX)
    assert structured_from_body({"guided_choice": list(CHOICES)}) == StructuredOutput("choice", choices=CHOICES)
    assert structured_from_body({"guided_grammar": "start: /a+/"}) == StructuredOutput("grammar", "start: /a+/")
    assert structured_from_body({"structured_outputs": {"regex": REGEX, "backend": "x"}}) == StructuredOutput("regex", REGEX)
    assert structured_from_body({"structured_outputs": {"json_object": True}}) == StructuredOutput("json_object")
    for bad in ({"response_format": {"type": "yaml"}}, {"response_format": {"type": "json_schema"}},
                {"response_format": "json"}, {"guided_choice": "yes"}, {"guided_regex": 5},
                {"guided_regex": REGEX, "guided_choice": ["a"]}, {"structured_outputs": []}):
        with pytest.raises(InvalidRequestError):
            structured_from_body(bad)


@pytest.mark.parametrize("structured", [StructuredOutput("json_schema", '{"type": "object"}'),
                                        StructuredOutput("json_object"), StructuredOutput("regex", REGEX),
                                        StructuredOutput("choice", choices=CHOICES),
                                        StructuredOutput("grammar", "start: /a+/"), None])
def test_the_proto_field_round_trips(structured):
    params = SamplingParams(max_tokens=4, structured=structured)
    wire = pb.SamplingParams.FromString(convert.sampling_to_pb(params).SerializeToString())
    assert convert.sampling_from_pb(wire) == params
    assert wire.HasField("structured") == (structured is not None)


# ---- the sampler -------------------------------------------------------------------------------

def test_masks_touch_only_constrained_rows_and_the_grammar_wins_over_min_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[5, 17]] = True
    greedy = SamplingParams(temperature=0.0, logprobs=True)
    rows = [SamplingRow(greedy, [1], [], None), SamplingRow(greedy, [1], [], None, allowed=allowed),
            SamplingRow(SamplingParams(temperature=0.9), [1], [], torch.Generator().manual_seed(1), allowed=allowed)]
    free = sample(logits, rows[:1], torch.Generator())
    result = sample(logits, rows, torch.Generator())
    assert result.token_ids[0] == free.token_ids[0] == int(logits[0].argmax())
    assert result.token_ids[1] == (5 if logits[1, 5] > logits[1, 17] else 17)
    assert result.token_ids[2] in (5, 17)
    # logprobs come from the unmasked distribution, as the free sampler reports them
    assert result.logprobs[1] == pytest.approx(float(torch.log_softmax(logits[1], -1)[result.token_ids[1]]))


# ---- the engine ----------------------------------------------------------------------------------

def test_held_out_schemas_sampled_at_0_7_all_parse_and_validate(engine):
    requests = [GenerateRequest(f"s{i}-{seed}", prompt="Return the record as JSON.", sampling=SamplingParams(
        max_tokens=256, temperature=0.7, seed=seed, structured=_schema(i)))
        for i in range(len(HELD_OUT_SCHEMAS)) for seed in range(4)]
    texts, finals = _run(engine, requests)
    for r in requests:
        i = int(r.request_id[1:].split("-")[0])
        assert finals[r.request_id][0].finish_reason == FinishReason.STOP, r.request_id
        jsonschema.validate(json.loads(texts[r.request_id][0]), HELD_OUT_SCHEMAS[i])
    figures = engine.structured.figures()
    assert figures.num_cache_misses <= len(HELD_OUT_SCHEMAS) and figures.num_cache_hits >= len(requests) - len(
        HELD_OUT_SCHEMAS)


def test_regex_choice_grammar_and_json_object_all_match_beside_free_text(engine):
    forms = {"re": StructuredOutput("regex", REGEX), "ch": StructuredOutput("choice", choices=CHOICES),
             "gr": StructuredOutput("grammar", 'root ::= "id-" [0-9] [0-9]? ";"'), "jo": StructuredOutput("json_object")}
    requests = [GenerateRequest(f"{k}{seed}", prompt="Answer:", sampling=SamplingParams(
        max_tokens=64, temperature=0.7, seed=seed, structured=s)) for k, s in forms.items() for seed in range(6)]
    requests.append(GenerateRequest("free", prompt="Answer:", sampling=SamplingParams(max_tokens=16, temperature=0.7)))
    texts, finals = _run(engine, requests)
    for seed in range(6):
        assert re.fullmatch(REGEX, texts[f"re{seed}"][0])
        assert texts[f"ch{seed}"][0] in CHOICES
        assert re.fullmatch(r"id-[0-9][0-9]?;", texts[f"gr{seed}"][0])
        # Any object: a random model rarely closes a free-text key, so many run to max_tokens
        # (finish reason length, a prefix of an object); those that stop are whole objects.
        if finals[f"jo{seed}"][0].finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(texts[f"jo{seed}"][0]), dict)
        else:
            assert texts[f"jo{seed}"][0].startswith("{")
    assert finals["free"][0].usage.completion_tokens == 16 or finals["free"][0].finish_reason == FinishReason.STOP


def test_n_samples_logprobs_stop_strings_and_max_tokens_compose(engine):
    requests = [
        GenerateRequest("n3", prompt="Pick:", sampling=SamplingParams(
            max_tokens=128, temperature=0.7, seed=3, n=3, logprobs=True, structured=_schema(0))),
        # a stop string ends the output where it appears, grammar or not (not emitted)
        GenerateRequest("stop", prompt="Pick:", sampling=SamplingParams(
            max_tokens=64, temperature=0.0, stop=("-",), structured=StructuredOutput("regex", REGEX))),
        # max_tokens too small for the grammar: finish reason length, a prefix of a valid output
        GenerateRequest("short", prompt="Pick:", sampling=SamplingParams(
            max_tokens=3, temperature=0.0, structured=_schema(1))),
        GenerateRequest("min", prompt="Pick:", sampling=SamplingParams(
            max_tokens=16, min_tokens=10, temperature=0.0, structured=StructuredOutput("choice", choices=("ok",)))),
    ]
    texts, finals = _run(engine, requests)
    assert sorted(texts["n3"]) == [0, 1, 2]
    for index, text in texts["n3"].items():
        jsonschema.validate(json.loads(text), HELD_OUT_SCHEMAS[0])
        assert finals["n3"][index].usage.completion_tokens >= 1
    assert re.fullmatch(r"[0-9]{3}", texts["stop"][0]) and finals["stop"][0].finish_reason == FinishReason.STOP
    assert finals["short"][0].finish_reason == FinishReason.LENGTH and texts["short"][0].startswith("{")
    assert texts["min"][0] == "ok" and finals["min"][0].finish_reason == FinishReason.STOP


def test_logprobs_are_one_per_token(engine):
    engine.add_request(GenerateRequest("lp", prompt="Pick:", sampling=SamplingParams(
        max_tokens=32, temperature=0.7, seed=1, logprobs=True, structured=StructuredOutput("regex", REGEX))))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.token_ids
            logprobs += d.logprobs or ()
    assert len(tokens) == len(logprobs) and all(lp <= 0.0 for lp in logprobs)


# Schemas whose greedy output on the tiny model is short (a few blocks): the small pool below
# must preempt, yet hold any one request whole.
_GREEDY_SCHEMAS = (0, 1, 2, 4, 5, 0, 1, 2)


def _greedy_constrained(i: int) -> GenerateRequest:
    return GenerateRequest(f"g{i}", prompt=f"Record number {i} as JSON:", sampling=SamplingParams(
        max_tokens=100, temperature=0.0, structured=_schema(_GREEDY_SCHEMAS[i])))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_stay_valid_and_greedy_identical(tiny_model_dir, engine, mode):
    reference, _ = _run(engine, [_greedy_constrained(i) for i in range(len(_GREEDY_SCHEMAS))])
    small = Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 512},
        "cache": {"block_size": 8, "num_blocks": 14},
        "scheduler": {"preemption_mode": mode, "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600,
                      "max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      # reserve on an estimate, not max_tokens: more start than the pool holds
                      "admission_reserve": "expected", "expected_output_floor_tokens": 1}}))
    texts, _ = _run(small, [_greedy_constrained(i) for i in range(len(_GREEDY_SCHEMAS))])
    assert small.scheduler.num_preemptions[mode] > 0, "the pool is small enough to preempt"
    assert texts == reference
    for i, schema in enumerate(_GREEDY_SCHEMAS):
        jsonschema.validate(json.loads(texts[f"g{i}"][0]), HELD_OUT_SCHEMAS[schema])
    small.close()


def test_speculation_skips_constrained_requests_counts_it_and_keeps_greedy_outputs(tiny_model_dir, engine):
    reference, _ = _run(engine, [_greedy_constrained(i) for i in range(3)])
    spec = Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 512},
        "cache": {"block_size": 8, "num_blocks": 512},
        "speculative": {"method": "ngram", "num_tokens": 4, "ngram_min_tokens": 1, "load_threshold_tokens": 1000}}))
    free = GenerateRequest("free", prompt="dog dog dog dog dog dog", sampling=SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True))
    texts, _ = _run(spec, [_greedy_constrained(i) for i in range(3)] + [free])
    assert {k: v for k, v in texts.items() if k != "free"} == reference
    skipped = spec.structured.figures().num_spec_skipped
    assert skipped > 0
    # the reason is counted where operators read it: kvmesh_spec_skipped_total{reason=...}
    from kvmesh.core.structured_output_metrics import StructuredOutputCollector

    samples = {(s.name, s.labels.get("reason")): s.value
               for family in StructuredOutputCollector("w0", spec.structured.figures).collect() for s in family.samples}
    assert samples[("kvmesh_spec_skipped_total", "structured_output")] == skipped
    spec.close()


def test_a_grammar_compiles_off_the_step_thread_while_others_run(engine, monkeypatch):
    release = threading.Event()
    compile_grammar = structured_output.GrammarCache._compile

    def slow_compile(self, text):
        assert threading.current_thread() is not threading.main_thread()
        release.wait(30)
        return compile_grammar(self, text)

    monkeypatch.setattr(structured_output.GrammarCache, "_compile", slow_compile)
    never_seen = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(50)},
        "required": [f"p{i}" for i in range(50)], "additionalProperties": False}))
    engine.add_request(GenerateRequest("wide", prompt="Fill it:", sampling=SamplingParams(
        max_tokens=480, temperature=0.0, structured=never_seen)))
    engine.add_request(GenerateRequest("other", prompt="Go on:", sampling=SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True)))
    other_done = False
    for _ in range(20):  # the other request runs to its end while the grammar compiles
        other_done |= any(d.request_id == "other" and d.finished for d in engine.step())
        engine.check_integrity()
    assert other_done and [r.request_id for r in engine.scheduler.waiting] == ["wide"]
    release.set()
    text = ""
    while engine.has_unfinished():
        text += "".join(d.text for d in engine.step())
    assert sorted(json.loads(text)) == sorted(f"p{i}" for i in range(50))


def test_a_constraint_refused_at_the_engine_holds_nothing(engine):
    bad = GenerateRequest("bad", prompt="x", sampling=SamplingParams(
        max_tokens=8, structured=StructuredOutput("regex", "a(b")))
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        engine.add_request(bad)
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.kv_tokens_reserved, stats.num_blocks_used) == (0, 0, 0, 0)
