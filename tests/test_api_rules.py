"""The request validation rules and the error-status wire format, without a cluster (the real
ingresses are exercised in tests/test_api_contract_e2e.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import grpc_edge, request_rules, status_map
from kvmesh.core.seams import SAMPLING_RULES, SamplingParams
from kvmesh.core.errors import InvalidRequestError, OverloadedError, WorkerFailedError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PROTO = Path(__file__).resolve().parents[1] / "proto" / "kvmesh.proto"

BAD_SAMPLING = [
    ("max_tokens", 0), ("max_tokens", 5000), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", -0.1), ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.0001), ("top_k", 0), ("top_k", -2),
    ("min_p", -math.inf), ("min_p", 1.5), ("repetition_penalty", math.inf), ("repetition_penalty", 0.0),
    ("presence_penalty", math.nan), ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
    ("min_tokens", 9), ("n", 0), ("n", 17), ("seed", 2 ** 64), ("stop", ("",)), ("stop", ("x",) * 17),
    ("stop", ("y" * 257,)), ("stop_token_ids", (-1,)), ("stop_token_ids", tuple(range(65))),
    ("temperature", True), ("max_tokens", 4.0),
]


@pytest.mark.parametrize("field,value", BAD_SAMPLING)
def test_every_out_of_range_or_non_finite_value_is_refused(field, value):
    params = dataclasses.replace(SamplingParams(max_tokens=8), **{field: value})
    with pytest.raises(InvalidRequestError) as info:
        params.validate(max_new_tokens=2048, max_n=16)
    assert field.split("_")[0] in info.value.message


def test_in_range_values_pass_and_the_ceilings_are_the_servers():
    SamplingParams(max_tokens=8, temperature=2.0, top_p=1.0, top_k=-1, min_p=1.0, n=16, seed=-(2 ** 63),
                   presence_penalty=-2.0, stop=("x",) * 16, stop_token_ids=tuple(range(64))).validate(8, 16)
    SamplingParams(n=1000).validate()  # no server ceiling given: only n >= 1 holds


def test_docs_and_proto_header_list_every_sampling_rule():
    docs = DOCS.read_text()
    proto = PROTO.read_text().split("syntax =")[0]  # the header comment
    for rule in SAMPLING_RULES:
        assert f"`{rule.name}`" in docs, rule.name
        assert rule.name in proto, rule.name


@pytest.mark.parametrize("check,args", [
    (request_rules.check_text, ("a \ud800 b", "prompt")),
    (request_rules.check_request_id, ("r" * 257,)),
    (request_rules.check_model_name, ("m" * 257,)),
    (request_rules.check_prompt_token_ids, ((1, -1), 100)),
    (request_rules.check_prompt_token_ids, ((100,), 100)),
    (request_rules.check_stop_strings, (("\udfff",),)),
])
def test_request_rules_refuse_with_invalid_request(check, args):
    with pytest.raises(InvalidRequestError):
        check(*args)


def test_lenient_deserializer_turns_bad_bytes_into_a_refusal_not_an_exception():
    decode = grpc_edge.lenient_deserializer(pb.GenerateRequest)
    good = pb.GenerateRequest(prompt="hi").SerializeToString()
    assert decode(good).prompt == "hi"
    for data in (b"\xff\xff\xff", b"\x1a\x02\xc3\x28", good[:-1]):
        result = decode(data)
        assert isinstance(result, grpc_edge.UndecodableRequest), data
        assert result.message.startswith("the request is not a valid kvmesh.v1.GenerateRequest")


@pytest.mark.parametrize("error,trailers", [
    (OverloadedError("admission queue full", retry_after_s=0.0771),
     (("x-kvmesh-error", "overloaded"), ("retry-after-ms", "78"))),
    (WorkerFailedError("worker w0 failed"), (("x-kvmesh-error", "worker_failed"), ("retry-after-ms", "100"))),
    (InvalidRequestError("top_p must be in (0, 1], got nan"), (("x-kvmesh-error", "invalid_request"),)),
])
def test_trailers_ride_in_the_details_and_split_back_off(error, trailers):
    status = status_map.status_for(error)
    assert status_map.grpc_trailing_metadata(status) == trailers
    details = status_map.grpc_details(status)
    assert status_map.split_details(details) == (error.message, trailers)
    # a client behind another proxy that kept only the details still rebuilds the typed error
    rebuilt = status_map.error_from_grpc(status.grpc_code, details, None)
    assert type(rebuilt) is type(error) and rebuilt.message == error.message


def test_messages_with_brackets_are_not_mistaken_for_tags():
    assert status_map.split_details("top_p must be in (0, 1], got [1, 2]") == ("top_p must be in (0, 1], got [1, 2]", ())


def test_worker_failure_gets_a_retry_after_header_over_http():
    headers = status_map.http_headers(status_map.status_for(WorkerFailedError("gone")))
    assert headers["Retry-After"] == "1" and headers["retry-after-ms"] == "100"


def test_positive_float_metadata_must_be_finite():
    for raw in ("inf", "nan", "-1", "0"):
        with pytest.raises(InvalidRequestError):
            status_map.positive_float(raw, "header x-kvmesh-timeout-s")
    assert status_map.positive_float("2.5", "x") == 2.5


def test_client_errors_are_told_apart_from_bugs():
    assert status_map.is_client_error(InvalidRequestError("x"))
    assert status_map.is_client_error(OverloadedError("x", 1.0))
    assert not status_map.is_client_error(RuntimeError("x"))
    status = status_map.status_for(RuntimeError("secret prompt text"))
    assert status.grpc_code == grpc.StatusCode.INTERNAL and "secret" not in status.message


def test_engine_refuses_n_samples_that_can_never_fit_in_whole_blocks(tiny_model_dir):
    """The worker's own check (a request reaching it without the router's): 64 blocks of 8 =
    512 KV tokens; 3 x (15 + 154) = 507 raw tokens fit, but 3 x 8 x ceil(169 / 8) = 528 do not."""
    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import GenerateRequest
    from kvmesh.worker.engine_loop.engine import Engine

    engine = Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 256},
        "cache": {"num_blocks": 64, "block_size": 8}}))
    ids = tuple(range(200, 215))
    with pytest.raises(InvalidRequestError, match="whole blocks of 8"):
        engine.validate(GenerateRequest("r", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=154, n=3)))
    engine.validate(GenerateRequest("r", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=153, n=3)))
    with pytest.raises(InvalidRequestError, match="n = 17"):
        engine.validate(GenerateRequest("r", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=2, n=17)))
