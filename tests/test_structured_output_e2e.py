"""Structured output over the real ingresses (gRPC and the OpenAI SDK over HTTP), one tiny-Llama
CPU worker for the module: held-out schemas at temperature 0.7 all parse and validate, regex
and choice all match, bad constraints are INVALID_ARGUMENT / HTTP 400 naming the problem with
nothing reserved (the worker's KV back to 0), and the worker's metrics count them."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from e2e_cluster import scrape, serving, tiny_cluster_config, wait_for
from structured_schemas import HELD_OUT_SCHEMAS
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(600)]

REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, num_blocks=512, max_num_seqs=16)
    with serving(config, "kvmesh-structured"):
        yield config


@pytest.fixture(scope="module")
def stub(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def openai_client(cluster):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.router.http_port}/v1", api_key="unused", max_retries=0)


def _grpc_text(stub, structured: pb.StructuredOutput, seed: int, max_tokens: int = 256) -> tuple[str, int]:
    request = pb.GenerateRequest(prompt="Return it as JSON:", sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.7, seed=seed, structured=structured))
    text, finish = "", 0
    for message in stub.Generate(request, timeout=120):
        text += message.text
        finish = message.finish_reason or finish
    return text, finish


def _kv_idle(stub) -> bool:
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    return all(w.kv_tokens_used == 0 and w.num_running == 0 and w.num_waiting == 0 and w.kv_tokens_reserved == 0
               for w in stats.workers)


def test_held_out_schemas_regex_and_choice_over_grpc(stub):
    for i, schema in enumerate(HELD_OUT_SCHEMAS):
        for seed in range(2):
            text, finish = _grpc_text(stub, pb.StructuredOutput(json_schema=json.dumps(schema)), seed)
            assert finish == pb.FINISH_REASON_STOP, (i, text)
            jsonschema.validate(json.loads(text), schema)
    for seed in range(3):
        assert re.fullmatch(REGEX, _grpc_text(stub, pb.StructuredOutput(regex=REGEX), seed)[0])
        choice = pb.StructuredOutput(choice=pb.ChoiceList(choices=CHOICES))
        assert _grpc_text(stub, choice, seed)[0] in CHOICES


def test_held_out_schemas_and_guided_forms_over_the_openai_sdk(openai_client):
    for i, schema in enumerate(HELD_OUT_SCHEMAS):
        response = openai_client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Return it as JSON."}], max_tokens=256,
            temperature=0.7, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    for seed in range(3):
        regex = openai_client.completions.create(model="", prompt="Code:", max_tokens=32, temperature=0.7, seed=seed,
                                                 extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, regex.choices[0].text)
        picked = openai_client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Pick one."}], max_tokens=16, temperature=0.7, seed=seed,
            extra_body={"guided_choice": CHOICES})
        assert picked.choices[0].message.content in CHOICES
        outputs = openai_client.completions.create(model="", prompt="Code:", max_tokens=32, temperature=0.7, seed=seed,
                                                   extra_body={"structured_outputs": {"regex": REGEX}})
        assert re.fullmatch(REGEX, outputs.choices[0].text)


def test_bad_constraints_are_refused_naming_the_problem_with_nothing_reserved(stub, openai_client, cluster):
    import openai

    bad = [pb.StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'),
           pb.StructuredOutput(regex="a(b"), pb.StructuredOutput(grammar="start: undefined_rule"),
           pb.StructuredOutput(choice=pb.ChoiceList())]
    for structured in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
                max_tokens=8, structured=structured)), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert any(word in info.value.details() for word in ("nonsense", "unclosed", "undefined_rule", "choices"))
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                     "type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
                 {"guided_regex": "a(b"}, {"guided_grammar": "start: undefined_rule"},
                 {"response_format": {"type": "yaml"}}, {"guided_regex": "[0-9]", "guided_choice": ["a"]}):
        with pytest.raises(openai.BadRequestError) as http_info:
            openai_client.completions.create(model="", prompt="x", max_tokens=8, extra_body=body)
        assert http_info.value.status_code == 400
    wait_for(lambda: _kv_idle(stub), 30, "the worker's KV back to 0")
    metrics = scrape(f"http://127.0.0.1:{cluster.router.http_port}")
    constrained = sum(v for (name, labels), v in metrics.items() if name == "kvmesh_structured_requests_total")
    assert constrained >= len(HELD_OUT_SCHEMAS)
    hits = sum(v for (name, labels), v in metrics.items()
               if name == "kvmesh_grammar_cache_total" and ("result", "hit") in labels)
    assert hits > 0, "the second request of a schema finds it compiled"
