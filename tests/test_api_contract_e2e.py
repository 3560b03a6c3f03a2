"""The API contract over the real ingresses: Serve's gRPC and HTTP proxies on loopback sockets,
two CPU workers running a tiny random Qwen2 (a family other than Llama, served as `kvmesh
serve --model DIR` serves it: its greedy tokens are HF's, and kvmesh_model_info says which
forward runs and why), one cluster for the module.

Regression tests for the faults an independent client found (issue #13), then the fuzz
suite: seeded random and mutated requests over gRPC (messages and raw bytes) and HTTP
(JSON bodies), random client closes and Cancel calls, with the invariants

* every answer is OK or a documented status: never UNKNOWN / INTERNAL / HTTP 500;
* the server stays SERVING;
* every closed or cancelled request is freed: once all calls end, every worker shows
  0 KV tokens used, 0 running, 0 waiting (within a bound, polled through GetStats);
* a fixed greedy request returns the same text before and after.

KVMESH_FUZZ_CASES (default 300: a few seconds) and KVMESH_FUZZ_SEED make longer runs.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from e2e_cluster import scrape, serving, tiny_cluster_config, total, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(600)]

APP_NAME = "kvmesh-contract"
NUM_WORKERS = 2
NUM_BLOCKS = 256  # x block 16 = 4096 KV tokens per worker
BLOCK_SIZE = 16
MODEL_LEN = 1024  # the tiny model's positions
LONG = 800  # max_tokens of a request that must still be running when the test acts on it
FREED_BOUND_S = 60.0  # every closed stream is freed well within this (polled, not timed)

GENERATE = "/kvmesh.v1.Kvmesh/Generate"
CANCEL = "/kvmesh.v1.Kvmesh/Cancel"
# Documented statuses a client's own input may get (proto header); UNAVAILABLE only when a
# worker fails, which the fuzz suite does not cause.
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
HTTP_CLIENT_STATUSES = {200, 400, 404, 405, 422, 429, 504}


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir):
    config = tiny_cluster_config(tiny_qwen2_dir, num_workers=NUM_WORKERS, num_blocks=NUM_BLOCKS,
                                 # Resumption off: section 6 checks the error a client gets when a
                                 # stream cannot be resumed (tests/test_failover_resume_e2e.py
                                 # covers the default, resumed streams).
                                 router={"policy": "round_robin", "max_queue_len": 4, "max_queue_wait_s": 2.0,
                                         "max_stream_resumptions": 0})
    as_dict = config.to_dict()
    as_dict["scheduler"]["max_new_tokens"] = MODEL_LEN  # the context length binds, not this ceiling
    as_dict["model"]["cpu_native_max_tokens"] = 8  # asked for, so the worker says why it does not run it
    config = KvmeshConfig.from_dict(as_dict)
    with serving(config, APP_NAME):
        yield config


@pytest.fixture(scope="module")
def channel(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield channel
    channel.close()


@pytest.fixture(scope="module")
def stub(channel):
    return kvmesh_pb2_grpc.KvmeshStub(channel)


@pytest.fixture(scope="module")
def http_base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


def _request(prompt: str = "The quick brown fox", max_tokens: int = 8, request_id: str = "", **sampling):
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return pb.GenerateRequest(request_id=request_id, prompt=prompt, sampling=params)


def _status(call_fn) -> tuple[grpc.StatusCode, str, dict]:
    """(code, details, trailing metadata) of a finished call, consuming a stream fully."""
    try:
        result = call_fn()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)) and hasattr(result, "code"):
            list(result)
            return result.code(), result.details() or "", dict(result.trailing_metadata() or ())
        return grpc.StatusCode.OK, "", {}
    except grpc.RpcError as error:
        return error.code(), error.details() or "", dict(error.trailing_metadata() or ())


def _stats(stub) -> pb.GetStatsResponse:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def _idle(stub) -> bool:
    """Every worker healthy with nothing running, waiting or holding KV; router empty."""
    stats = _stats(stub)
    return (len(stats.workers) == NUM_WORKERS and stats.totals.router_in_flight == 0
            and all(w.healthy and w.num_running == 0 and w.num_waiting == 0 and w.kv_tokens_used == 0
                    and w.num_blocks_used == 0 for w in stats.workers))


def _wait_idle(stub, what: str) -> None:
    wait_for(lambda: _idle(stub), timeout_s=FREED_BOUND_S, what=what, interval_s=0.2)


def _greedy_text(stub) -> str:
    responses = list(stub.Generate(_request("kvmesh keeps its contract because", max_tokens=12), timeout=60))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return "".join(r.text for r in responses)


# ---- 2. A non-Llama family served: HF's greedy tokens, the forward path named ------------------

def test_qwen2_served_token_identical_to_hf_and_path_named(cluster, stub, http_base):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmesh.worker.kernels import cpu_native_step

    prompt = "The quick brown fox jumps over the lazy dog because"
    streamed = [t for r in stub.Generate(_request(prompt, max_tokens=16), timeout=60) for t in r.token_ids]
    folder = cluster.model.path
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert streamed == want
    info = [dict(labels) for name, labels in scrape(http_base) if name == "kvmesh_model_info"]
    assert len(info) == NUM_WORKERS and all(i["model_type"] == "qwen2" and i["forward_path"] == "eager" for i in info)
    # the native C step implements Llama's layer: it names what this model has beyond it
    expected = cpu_native_step.unavailable_reason() or "qwen2: q/k/v or o biases"
    assert all(expected in i["forward_path_reason"] for i in info), info


# ---- 3. ListModels reports the context length requests are validated against ----------------

def test_list_models_reports_the_validated_context_length(cluster, stub, http_base):
    [model] = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert model.max_model_len == MODEL_LEN and model.block_size == BLOCK_SIZE
    assert httpx.get(f"{http_base}/v1/models").json()["data"][0]["max_model_len"] == MODEL_LEN
    # ...and it is the limit the router enforces: one token over is refused, at the limit runs.
    ids = list(range(100, 124))
    over = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=MODEL_LEN - len(ids) + 1))
    code, details, _ = _status(lambda: stub.Generate(over, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and str(MODEL_LEN) in details


def test_usage_with_n_2_is_per_sample_over_grpc_and_per_request_over_http(stub, http_base):
    """proto Usage / docs/api.md: each sample's final message carries that sample's tokens;
    the OpenAI response reports the request once, the samples' completions summed."""
    sampling = pb.SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=7, ignore_eos=True)
    replies = list(stub.Generate(pb.GenerateRequest(prompt="Count with me", sampling=sampling), timeout=60))
    for i in (0, 1):
        [final] = [r for r in replies if r.finished and r.sample_index == i]
        streamed = sum(len(r.token_ids) for r in replies if r.sample_index == i)
        assert final.usage.completion_tokens == streamed == 5
    body = {"prompt": "Count with me", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    whole = httpx.post(f"{http_base}/v1/completions", json=body, timeout=60).json()
    assert len(whole["choices"]) == 2 and whole["usage"]["completion_tokens"] == 10
    assert whole["usage"]["prompt_tokens"] == final.usage.prompt_tokens
    chunks = [json.loads(line[len("data: "):]) for line in httpx.post(
        f"{http_base}/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60).text.splitlines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [10]


def test_a_resumed_request_streams_exactly_the_missing_rest(stub):
    """proto GenerateRequest 9-10: what a client whose stream broke off sends again. Greedy:
    the rest is the reference's rest, token for token and character for character."""
    reference = list(stub.Generate(_request("Resume me", max_tokens=12), timeout=60))
    ref_ids = [t for r in reference for t in r.token_ids]
    ref_text = "".join(r.text for r in reference)
    assert len(ref_ids) == 12
    # Break off after whole messages (a message may carry several tokens when paced).
    cuts = [(sum(len(r.token_ids) for r in reference[:m]), "".join(r.text for r in reference[:m]))
            for m in range(1, len(reference))]
    cuts = [cut for cut in cuts if 0 < cut[0] < 12]
    assert cuts
    for k, first_text in {cuts[0][0]: cuts[0], cuts[-1][0]: cuts[-1], cuts[len(cuts) // 2][0]: cuts[len(cuts) // 2]}.values():
        request = _request("Resume me", max_tokens=12)
        request.resume_token_ids.extend(ref_ids[:k])
        request.resume_text_chars = len(first_text)
        rest = list(stub.Generate(request, timeout=60))
        assert [t for r in rest for t in r.token_ids] == ref_ids[k:]
        assert first_text + "".join(r.text for r in rest) == ref_text
        assert rest[-1].usage.completion_tokens == 12
    for bad, why in (({"n": 2}, "n = 1"), ({}, "leave nothing")):
        request = _request("Resume me", max_tokens=3, **bad)
        request.resume_token_ids.extend(ref_ids[:3])
        code, details, _ = _status(lambda: stub.Generate(request, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details, details


# ---- 4. non-finite / out-of-range sampling values; the n ceiling -----------------------------

@pytest.mark.parametrize("sampling", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"top_p": 1.5},
    {"min_p": -math.inf}, {"repetition_penalty": math.inf}, {"presence_penalty": math.nan},
    {"frequency_penalty": 3.0}, {"top_k": 0}, {"n": 17}, {"n": 1000}, {"min_tokens": 50},
])
def test_out_of_range_sampling_is_invalid_argument_over_grpc(stub, sampling):
    request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4, **sampling))
    code, details, trailers = _status(lambda: stub.Generate(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (sampling, code, details)
    assert trailers.get("x-kvmesh-error") == "invalid_request"
    assert "x-kvmesh-error=" not in details  # the plain message: the tag moved into the trailers


@pytest.mark.parametrize("body", [
    '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}',
    '{"prompt": "hi", "max_tokens": 4, "top_p": Infinity}',
    '{"prompt": "hi", "max_tokens": 4, "n": 1000}',
    '{"prompt": "hi", "max_tokens": 4, "seed": 100000000000000000000000}',
    '{"prompt": "\\ud800 lone surrogate", "max_tokens": 4}',
    # found by the fuzz suite (were HTTP 500): stream options of the wrong type
    '{"prompt": "hi", "max_tokens": 1, "stream": true, "stream_options": 1}',
    '{"prompt": "hi", "max_tokens": 1, "stream": "NaN"}',
])
def test_out_of_range_values_are_http_400(http_base, body):
    reply = httpx.post(f"{http_base}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_request"


# ---- 5. undecodable bytes and invalid UTF-8 --------------------------------------------------

def _raw_generate(channel, data: bytes, timeout: float = 30):
    call = channel.unary_stream(GENERATE, request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString)
    return _status(lambda: call(data, timeout=timeout))


def test_undecodable_bytes_and_invalid_utf8_are_invalid_argument(channel):
    valid = _request("hi", max_tokens=2).SerializeToString()
    invalid_utf8 = b"\x1a\x03\xff\xfe\xfd" + valid[valid.index(b"2"):]  # field 3 (prompt) = 3 bad bytes
    for data in (b"\xff\xff\xff\xff", b"\x0a\x80", invalid_utf8):
        code, details, trailers = _raw_generate(channel, data)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (data, code, details)
        assert "class" not in details and "DecodeError" not in details and "GenerateRequest" in details
        assert trailers.get("x-kvmesh-error") == "invalid_request"
    cancel = channel.unary_unary(CANCEL, request_serializer=None, response_deserializer=pb.CancelResponse.FromString)
    code, _, _ = _status(lambda: cancel(b"\x0a\x02\xc3\x28", timeout=10))  # request_id: invalid UTF-8
    assert code == grpc.StatusCode.INVALID_ARGUMENT


# ---- 7. a request that can never fit is INVALID_ARGUMENT, never retryable --------------------

def test_request_that_can_never_fit_is_invalid_argument(stub):
    ids = pb.TokenIds(ids=list(range(200, 215)))  # 15 prompt tokens
    # 5 x (15 + 802) = 4085 raw tokens fit a 4096-token worker, but each sample reserves whole
    # blocks: 5 x 16 x ceil(817 / 16) = 4160 do not.
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=802, n=5))
    code, details, trailers = _status(lambda: stub.Generate(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "retry-after-ms" not in trailers
    many = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=8, n=1000))
    assert _status(lambda: stub.Generate(many, timeout=30))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # One block less per sample fits, and runs.
    fits = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=801, n=5,
                                                                               ignore_eos=True, temperature=0.0))
    finals = [r for r in stub.Generate(fits, timeout=120) if r.finished]
    assert len(finals) == 5 and all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in finals)


# ---- 2. a refused duplicate request id leaves the original running ---------------------------

def test_refused_duplicate_request_id_does_not_touch_the_original(stub):
    original = stub.Generate(_request("duplicates must not abort", max_tokens=200, request_id="dup-1"), timeout=120)
    first = next(original)
    assert not first.finished
    for _ in range(3):
        code, details, _ = _status(lambda: stub.Generate(_request("again", max_tokens=4, request_id="dup-1"),
                                                         timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in details
    rest = list(original)
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 200
    # Once it ended, the id is free again.
    assert list(stub.Generate(_request("again", max_tokens=2, request_id="dup-1"), timeout=30))[-1].finished


# ---- 8. GetStats is live ---------------------------------------------------------------------

def test_get_stats_is_live(stub):
    calls = [stub.Generate(_request(f"live stats {i}", max_tokens=LONG), timeout=120) for i in range(4)]
    try:
        for call in calls:
            next(call)  # each has produced a token: admitted, running on a worker
        stats = _stats(stub)
        assert stats.totals.router_in_flight == 4
        assert sum(w.num_running for w in stats.workers) == 4
        assert all(w.stats_age_s == 0.0 for w in stats.workers)
        assert stats.totals.kv_tokens_used > 0
    finally:
        for call in calls:
            call.cancel()
    _wait_idle(stub, "cancelled streams freed")


# ---- 6. error trailers: RESOURCE_EXHAUSTED --------------------------------------------------

def test_resource_exhausted_carries_trailers_and_retry_after(stub, http_base):
    # 4096 KV tokens per worker, ~816 per request: 10 fit, the router queues 4 more, the rest
    # are refused at once.
    calls = [stub.Generate(_request(f"overload {i}", max_tokens=LONG), timeout=120) for i in range(20)]
    try:
        refused = wait_for(lambda: [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED],
                           timeout_s=60, what="an overload refusal")
        trailers = dict(refused[0].trailing_metadata())
        assert trailers["x-kvmesh-error"] == "overloaded" and int(trailers["retry-after-ms"]) > 0
        assert "retry-after-ms" not in refused[0].details()  # plain message
        reply = httpx.post(f"{http_base}/v1/completions", json={"prompt": "over", "max_tokens": LONG}, timeout=60)
        assert reply.status_code == 429 and int(reply.headers["retry-after"]) >= 1
        assert reply.headers["x-kvmesh-error"] == "overloaded"
    finally:
        for call in calls:
            call.cancel()
    _wait_idle(stub, "overload streams freed")


# ---- 1. every client close reaches the engine -----------------------------------------------

def _finished_by_length(http_base: str) -> float:
    """Requests this (single) router replica saw end with finish_reason length, ever."""
    return total(scrape(http_base), "kvmesh_requests_total", finish_reason="length")


def test_every_closed_stream_is_freed(stub, http_base):
    """Each stream is closed after 0-4 messages of its 800: none may run to its length (that is
    what a close Serve's proxy fails to pass on looks like: the engine generates on for
    nobody), and the workers end with nothing running or held."""
    rng = random.Random(13)
    length_before = _finished_by_length(http_base)
    for round_index in range(3):
        calls = [stub.Generate(_request(f"close {round_index} {i}", max_tokens=LONG), timeout=120)
                 for i in range(8)]

        def close_at_random(call, reads: int, delay_s: float):
            try:
                for _ in range(reads):
                    next(call)
            except (StopIteration, grpc.RpcError):
                pass
            time.sleep(delay_s)
            call.cancel()

        threads = [threading.Thread(target=close_at_random, args=(c, rng.randint(0, 4), rng.uniform(0, 0.05)))
                   for c in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_idle(stub, f"round {round_index}: every closed stream freed")
    assert _finished_by_length(http_base) == length_before


# ---- logging: expected client errors once, briefly ------------------------------------------

def test_client_errors_are_logged_once_without_traceback(stub):
    import ray

    marker = f"no-such-model-{random.Random().randrange(10**9)}"
    code, _, _ = _status(lambda: stub.Generate(pb.GenerateRequest(prompt="hi", model=marker), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    logs_dir = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")

    def lines_with_marker() -> list[tuple[str, list[str], int]]:
        found = []
        for root, _, files in os.walk(logs_dir):
            for name in files:
                try:
                    with open(os.path.join(root, name), errors="replace") as f:
                        lines = f.read().splitlines()
                except OSError:
                    continue
                found.extend((name, lines, i) for i, line in enumerate(lines) if marker in line)
        return found

    wait_for(lines_with_marker, timeout_s=20, what="the refusal in the logs")
    time.sleep(1.0)  # let every process flush
    found = lines_with_marker()
    assert len(found) == 1, [(name, lines[i]) for name, lines, i in found]
    name, lines, i = found[0]
    assert "Traceback" not in "\n".join(lines[i:i + 3]) and "INVALID_ARGUMENT" in lines[i]


# ---- the fuzz suite -------------------------------------------------------------------------

_EXTREME_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-300, 1e300, 2.5, -2.5, 0.5, 1.0)
_EXTREME_INTS = (0, 1, -1, 2, 16, 17, 1000, 2 ** 31 - 1, -(2 ** 31))
_EXTREME_UINTS = (0, 1, 2, 4, 16, 17, 1000, 2 ** 32 - 1)


def _random_sampling(rng: random.Random) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=rng.choice((1, 2, 4, 8)), temperature=rng.choice((0.0, 0.7)))
    for name in rng.sample(["max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                            "presence_penalty", "frequency_penalty", "min_tokens", "n", "stop", "stop_token_ids",
                            "ignore_eos", "logprobs"], rng.randint(0, 4)):
        if name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(msg, name, rng.choice(_EXTREME_FLOATS))
        elif name in ("max_tokens", "min_tokens"):
            setattr(msg, name, rng.choice((0, 1, 3, 8, 2 ** 32 - 1)))
        elif name == "n":
            setattr(msg, name, rng.choice(_EXTREME_UINTS))
        elif name == "top_k":
            msg.top_k = rng.choice(_EXTREME_INTS)
        elif name == "seed":
            msg.seed = rng.choice((0, -1, 2 ** 63 - 1, -(2 ** 63)))
        elif name == "stop":
            msg.stop.extend(rng.choice(([""], ["x"] * 40, ["a" * 1000], ["\n", "."], ["é"])))
        elif name == "stop_token_ids":
            msg.stop_token_ids.extend(rng.choice(([-1], [0], [2 ** 31 - 1], list(range(100)))))
        else:
            setattr(msg, name, True)
    return msg


def _random_request(rng: random.Random) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(sampling=_random_sampling(rng))
    which = rng.choice(("prompt", "chat", "ids", "none", "huge", "empty"))
    if which == "prompt":
        msg.prompt = rng.choice(("hello", "é ü 漢字 🙂", "\x00\x01", " " * 50, "tell me a story"))
    elif which == "chat":
        msg.chat.messages.extend(rng.choice(([pb.ChatMessage(role="user", content="hi")],
                                             [pb.ChatMessage(role="robot", content="hi")],
                                             [pb.ChatMessage(role="", content="")], [])))
        if not msg.chat.messages:
            msg.chat.SetInParent()
    elif which == "ids":
        msg.prompt_token_ids.ids.extend(rng.choice(([1, 2, 3], [-5], [2 ** 31 - 1], list(range(50)), [0])))
        if rng.random() < 0.1:
            msg.prompt_token_ids.SetInParent()
            del msg.prompt_token_ids.ids[:]
    elif which == "huge":
        msg.prompt = "word " * rng.choice((2000, 20000))
    elif which == "empty":
        msg.prompt = ""
    if rng.random() < 0.2:
        msg.model = rng.choice(("", "nope", "x" * 1000))
    if rng.random() < 0.2:
        msg.request_id = rng.choice(("", "fuzz-dup", "r" * 300, "a/b", f"fuzz-{rng.randrange(10**6)}"))
    if rng.random() < 0.2:
        msg.priority = rng.choice(_EXTREME_INTS)
    return msg


def _mutated_bytes(rng: random.Random, msg: pb.GenerateRequest) -> bytes:
    data = bytearray(msg.SerializeToString())
    kind = rng.choice(("flip", "truncate", "random", "utf8"))
    if kind == "flip" and data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncate" and data:
        data = data[:rng.randrange(len(data))]
    elif kind == "random":
        data = bytearray(rng.randbytes(rng.randint(1, 64)))
    else:  # a prompt field holding invalid UTF-8, then the rest of a valid message
        data = bytearray(b"\x1a\x02\xc3\x28") + data
    return bytes(data)


def _random_json(rng: random.Random, chat: bool) -> str:
    values = (None, True, 0, -1, 1, 2 ** 70, 1.5, "NaN", "x", [], {}, [1, 2], {"a": 1})
    body: dict = {}
    if chat:
        body["messages"] = rng.choice(([{"role": "user", "content": "hi"}], [{"role": 1}], "hi", [],
                                       [{"role": "user", "content": [{"type": "image"}]}],
                                       [{"role": "user", "content": None}]))
    else:
        body["prompt"] = rng.choice(("hi", ["hi"], [1, 2, 3], [[1, 2]], [], "", 5, [-1], ["a", "b"], None))
    for name in rng.sample(["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                            "min_tokens", "logprobs", "stream", "stream_options", "model", "request_id",
                            "max_completion_tokens"], rng.randint(0, 5)):
        body[name] = rng.choice(values)
    body.setdefault("max_tokens", rng.choice((1, 4)))
    text = json.dumps(body)
    for token in ('"NaN"', "2.5"):
        if rng.random() < 0.3:  # bare NaN / Infinity, which Python's JSON parser accepts
            text = text.replace(token, rng.choice(("NaN", "Infinity", "-Infinity")), 1)
    if rng.random() < 0.05:
        text = text[:rng.randrange(max(1, len(text)))]
    return text


class _Fuzzer:
    def __init__(self, channel, stub, http_base: str, seed: int):
        self.channel, self.stub, self.http_base, self.seed = channel, stub, http_base, seed
        self.raw = channel.unary_stream(GENERATE, request_serializer=None,
                                        response_deserializer=pb.GenerateResponse.FromString)
        self.http = httpx.Client(timeout=60)
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def _note(self, key: str, bad: str | None = None) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if bad:
                self.failures.append(bad)

    def case(self, index: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + index)
        kind = rng.choice(("message", "message", "bytes", "json", "json", "close", "cancel"))
        getattr(self, f"_{kind}")(rng, index)

    def _check_grpc(self, kind: str, code, details: str, what) -> None:
        bad = None
        if code not in CLIENT_CODES:
            bad = f"{kind}: {code} {details!r} for {what!r}"
        elif code != grpc.StatusCode.OK and ("Traceback" in details or "<class" in details):
            bad = f"{kind}: internals in the message {details!r}"
        self._note(f"{kind}:{code.name}", bad)

    def _message(self, rng, index) -> None:
        msg = _random_request(rng)
        code, details, _ = _status(lambda: self.stub.Generate(msg, timeout=60))
        self._check_grpc("message", code, details, msg)

    def _bytes(self, rng, index) -> None:
        data = _mutated_bytes(rng, _random_request(rng))
        code, details, _ = _status(lambda: self.raw(data, timeout=60))
        self._check_grpc("bytes", code, details, data)

    def _json(self, rng, index) -> None:
        chat = rng.random() < 0.5
        body = _random_json(rng, chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        reply = self.http.post(f"{self.http_base}{path}", content=body, headers={"content-type": "application/json"})
        bad = None
        if reply.status_code not in HTTP_CLIENT_STATUSES:
            bad = f"json: HTTP {reply.status_code} {reply.text[:200]!r} for {body!r}"
        elif reply.status_code == 200 and "text/event-stream" in reply.headers.get("content-type", ""):
            if '"error"' in reply.text and "server_error" in reply.text:
                bad = f"json: in-band server error {reply.text[:200]!r} for {body!r}"
        self._note(f"json:{reply.status_code}", bad)

    def _close(self, rng, index) -> None:
        call = self.stub.Generate(_request(f"fuzz close {index}", max_tokens=rng.choice((50, LONG))), timeout=60)
        try:
            for _ in range(rng.randint(0, 3)):
                next(call)
        except (StopIteration, grpc.RpcError):
            pass
        time.sleep(rng.uniform(0, 0.03))
        call.cancel()
        self._note("close")

    def _cancel(self, rng, index) -> None:
        request_id = f"fuzz-cancel-{self.seed}-{index}"
        call = self.stub.Generate(_request(f"fuzz cancel {index}", max_tokens=LONG, request_id=request_id),
                                  timeout=60)
        try:
            next(call)
        except (StopIteration, grpc.RpcError):
            pass
        target = rng.choice((request_id, "", "unknown-id", "\u00e9" * 300))
        code, details, _ = _status(lambda: self.stub.Cancel(pb.CancelRequest(request_id=target), timeout=30))
        self._check_grpc("cancel", code, details, target)
        if target != request_id:
            call.cancel()
        try:
            list(call)
        except grpc.RpcError as error:
            self._check_grpc("cancelled-stream", error.code(), error.details() or "", request_id)


def test_fuzz_the_api(channel, stub, http_base):
    cases = int(os.environ.get("KVMESH_FUZZ_CASES", "300"))
    seed = int(os.environ.get("KVMESH_FUZZ_SEED", "1313"))
    _wait_idle(stub, "idle before the fuzz suite")
    before = _greedy_text(stub)
    fuzzer = _Fuzzer(channel, stub, http_base, seed)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(fuzzer.case, i) for i in range(cases)]:
            future.result()
    elapsed_s = time.monotonic() - started
    print(f"fuzz: {cases} cases, seed {seed}, {elapsed_s:.1f} s, outcomes {sorted(fuzzer.counts.items())}")
    assert not fuzzer.failures, fuzzer.failures[:10]
    assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
    _wait_idle(stub, "every fuzzed request freed")
    assert _greedy_text(stub) == before


# ---- 6. error trailers: UNAVAILABLE after a worker failure (last: it restarts a worker) -----

def test_worker_failure_ends_streams_unavailable_with_trailers(cluster, stub, http_base):
    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    calls = [stub.Generate(_request(f"doomed {i}", max_tokens=LONG), timeout=120) for i in range(2)]
    for call in calls:
        next(call)  # streaming: round robin put one on each worker
    ray.kill(ray.get_actor(worker_actor_name(APP_NAME, 0), namespace=WORKER_NAMESPACE), no_restart=False)
    codes = []
    for call in calls:
        try:
            list(call)
            codes.append((grpc.StatusCode.OK, {}))
        except grpc.RpcError as error:
            codes.append((error.code(), dict(error.trailing_metadata() or ())))
    failed = [trailers for code, trailers in codes if code == grpc.StatusCode.UNAVAILABLE]
    assert failed, codes
    assert all(t.get("x-kvmesh-error") == "worker_failed" and int(t["retry-after-ms"]) == 100 for t in failed)
    for code, _ in codes:
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    for call in calls:
        call.cancel()
    wait_for(lambda: stub.Health(pb.HealthRequest(), timeout=10).num_healthy_workers == NUM_WORKERS,
             timeout_s=180, what="the killed worker back")
    _wait_idle(stub, "idle after the worker restart")
