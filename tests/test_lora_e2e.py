"""LoRA adapters through the real cluster: the Serve app (gRPC + OpenAI HTTP), two CPU workers
with the tiny random Llama, tenants with API keys, adapters registered in the config (one
bound to tenant acme, one shared) and one added at run time with `kvmesh adapters add`.

One cluster for the module (CI time). Checked: the adapter's greedy tokens over HTTP and gRPC
equal HF + PEFT merged; ListModels and /v1/models list what the caller may use; unknown
adapter NOT_FOUND / 404; another tenant's adapter PERMISSION_DENIED / 403; a tenant never
hits the cache another adapter filled; per-adapter metrics.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from e2e_cluster import TEST_HASH_ITERATIONS, serving, settled_scrape, tiny_cluster_config, total, wait_for
from kvmesh.deploy.cli import main as cli_main
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router.tenants import generate_api_key, hash_api_key
from lora_adapters import hf_peft_greedy, make_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(400)]

APP_NAME = "kvmesh-lora"
ACME_KEY = generate_api_key()
OTHER_KEY = generate_api_key()
PROMPT_IDS = list(range(2000, 2040))  # 40 tokens: 2 full blocks of 16 a repeat can hit
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    specs = {"acme-support": (8, ["q_proj", "v_proj"], 16, False, 0), "shared": (16, ["gate_proj", "down_proj"],
                                                                              32, False, 1),
             "late": (8, ["o_proj"], 16, False, 2)}
    dirs = {}
    for name, (rank, targets, alpha, rslora, seed) in specs.items():
        dirs[name] = str(root / name)
        make_adapter(tiny_model_dir, dirs[name], rank, targets, alpha, rslora, seed)
    dirs["records"] = str(root / "adapters.yaml")
    return dirs


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, adapters):
    tenants = {"auth_required": True, "tenant_refresh_s": 0.2, "tenants": [
        {"id": "acme", "api_key_hashes": [hash_api_key(ACME_KEY, TEST_HASH_ITERATIONS)]},
        {"id": "other", "api_key_hashes": [hash_api_key(OTHER_KEY, TEST_HASH_ITERATIONS)]},
    ]}
    config = tiny_cluster_config(tiny_model_dir, num_workers=2, router={"policy": "prefix_aware"}, tenants=tenants)
    config = config.replace(lora={"max_loras": 2, "adapters_file": adapters["records"], "adapters": [
        {"name": "acme-support", "path": adapters["acme-support"], "tenant": "acme"},
        {"name": "shared", "path": adapters["shared"]}]})
    with serving(config, APP_NAME):
        yield config


@pytest.fixture(scope="module")
def http_base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


@pytest.fixture(scope="module")
def stub(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def base_name(http_base) -> str:
    return _models(http_base, ACME_KEY)[0]["id"]


def _models(http_base: str, key: str) -> list[dict]:
    return httpx.get(f"{http_base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]


def _complete(http_base: str, key: str, model: str, prompt=PROMPT_IDS) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{http_base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _grpc(stub, key: str, adapter: str = "", model: str = "", prompt=PROMPT_IDS) -> tuple[list[int], pb.Usage]:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, adapter=adapter,
                                 model=model)
    tokens, usage = [], None
    for msg in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=60):
        tokens.extend(msg.token_ids)
        if msg.finished:
            usage = msg.usage
    return tokens, usage


def test_adapter_outputs_equal_hf_peft_merged_over_grpc_and_http(tiny_model_dir, adapters, stub, http_base,
                                                                 base_name):
    want = hf_peft_greedy(tiny_model_dir, adapters["acme-support"], [PROMPT_IDS], MAX_TOKENS)[0]
    base = hf_peft_greedy(tiny_model_dir, None, [PROMPT_IDS], MAX_TOKENS)[0]
    assert want != base
    assert _grpc(stub, ACME_KEY, adapter="acme-support")[0] == want
    assert _grpc(stub, ACME_KEY, model=f"{base_name}:acme-support")[0] == want
    assert _grpc(stub, ACME_KEY)[0] == base
    response = _complete(http_base, ACME_KEY, f"{base_name}:acme-support")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == f"{base_name}:acme-support"
    text = response.json()["choices"][0]["text"]
    plain = _complete(http_base, ACME_KEY, base_name).json()["choices"][0]["text"]
    assert text != plain


def test_listing_shows_each_tenant_its_own_and_shared_adapters(stub, http_base, base_name):
    assert [m["id"] for m in _models(http_base, ACME_KEY)] == [base_name, f"{base_name}:acme-support",
                                                               f"{base_name}:shared"]
    other = _models(http_base, OTHER_KEY)
    assert [m["id"] for m in other] == [base_name, f"{base_name}:shared"]
    assert other[1]["parent"] == base_name
    listed = stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {OTHER_KEY}"),))
    assert [(m.id, m.parent) for m in listed.models] == [(base_name, ""), (f"{base_name}:shared", base_name)]


def test_unknown_and_foreign_adapters_are_refused(stub, http_base, base_name):
    assert _complete(http_base, ACME_KEY, f"{base_name}:nope").status_code == 404
    response = _complete(http_base, OTHER_KEY, f"{base_name}:acme-support")
    assert response.status_code == 403 and "another tenant" in response.text
    assert _complete(http_base, OTHER_KEY, "acme-support").status_code == 403
    for key, adapter, code in ((ACME_KEY, "nope", grpc.StatusCode.NOT_FOUND),
                               (OTHER_KEY, "acme-support", grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as info:
            _grpc(stub, key, adapter=adapter)
        assert info.value.code() == code


def test_a_tenant_never_hits_the_cache_of_another_adapter(stub):
    prompt = list(range(3000, 3040))
    _, first = _grpc(stub, ACME_KEY, adapter="acme-support", prompt=prompt)
    _, again = _grpc(stub, ACME_KEY, adapter="acme-support", prompt=prompt)
    assert first.cached_tokens == 0 and again.cached_tokens == 32, "the adapter's own repeat hits"
    _, other_base = _grpc(stub, OTHER_KEY, prompt=prompt)
    _, other_shared = _grpc(stub, OTHER_KEY, adapter="shared", prompt=prompt)
    assert other_base.cached_tokens == 0 and other_shared.cached_tokens == 0


def test_adapter_added_with_the_cli_is_served(adapters, stub, http_base, base_name):
    assert cli_main(["adapters", "--file", adapters["records"], "add", "late", adapters["late"]]) == 0
    wait_for(lambda: any(m["id"].endswith(":late") for m in _models(http_base, ACME_KEY)), timeout_s=30,
             what="the router to read the adapters file")
    tokens, usage = _grpc(stub, OTHER_KEY, adapter="late")
    assert len(tokens) == MAX_TOKENS and usage.completion_tokens == MAX_TOKENS


def test_per_adapter_metrics(http_base, stub):
    _grpc(stub, ACME_KEY, adapter="shared")
    samples = wait_for(lambda: (s := settled_scrape(http_base))
                       and total(s, "kvmesh_lora_adapter_loads_total") >= 2 and s, what="worker lora stats")
    assert total(samples, "kvmesh_adapter_requests_total", adapter="acme-support") >= 4
    assert total(samples, "kvmesh_adapter_generation_tokens_total", adapter="shared") >= MAX_TOKENS
    assert total(samples, "kvmesh_lora_slots") == 4  # 2 workers x 2 slots
    assert 1 <= total(samples, "kvmesh_lora_slots_used") <= 4
    assert total(samples, "kvmesh_rejections_total", reason="adapter_not_found") >= 1
    assert total(samples, "kvmesh_rejections_total", reason="permission_denied") >= 1
