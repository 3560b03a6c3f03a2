"""A request's budget (core/seams.RequestBudget) is computed once where the request enters and
carried to the engine, which serves the figures it was sent or refuses them; and max_tokens
changes form only where docs/engine.md's table ("A request's max_tokens") says it does.

The router's validate stage and the engine run for real here (tiny random Llama, its own
tokenizer); the cluster path (the budget pickled to a worker actor) is test_serve_e2e's."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import RequestBudgetMismatchError
from kvmesh.core.seams import GenerateRequest, RequestBudget, SamplingParams
from kvmesh.kv.kv_cost import check_budget, request_budget
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import convert, status_map
from kvmesh.router.adapters import AdapterRegistry
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.stages.degrade import capped
from kvmesh.router.stages.validate import RequestValidator
from kvmesh.router.tenants import Tenant
from kvmesh.worker.engine_loop.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The rules of the house: shoes off, lights out at ten, and"
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> KvmeshConfig:
    return KvmeshConfig.from_dict({"model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 512},
                                   "cache": {"num_blocks": 64, "block_size": BLOCK_SIZE}})


@pytest.fixture(scope="module")
def engine(config) -> Engine:
    return Engine.from_config(config)


def _drain(engine: Engine) -> list:
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
        engine.check_integrity()
    return deltas


def _validated(config: KvmeshConfig, tokenizer, msg: pb.GenerateRequest) -> tuple[convert.InboundRequest,
                                                                                   RequestContext]:
    """The gRPC message through the edge's decoding and the router's validate stage."""
    inbound = convert.inbound_from_pb(msg)
    ctx = RequestContext(inbound, arrived_s=0.0, root_span=None, parent=None, tenant=Tenant("t1"))
    validator = RequestValidator(config, tokenizer, AdapterRegistry(config.lora), "tiny")
    validator.validate(ctx, max_model_len=512, block_size=BLOCK_SIZE)
    return inbound, ctx


def test_the_budget_is_the_kv_rule_and_the_quota_output():
    budget = request_budget(100, SamplingParams(max_tokens=20, n=3), block_size=16)
    assert budget == RequestBudget(prompt_tokens=100, max_tokens=20, n=3, block_size=16, kv_tokens=3 * 128)
    assert budget.output_tokens == 60  # what the tenant's quota reserves
    check_budget(budget, 100, SamplingParams(max_tokens=20, n=3), 16)  # its own request: no error


@pytest.mark.parametrize("change", [dict(prompt_tokens=99), dict(max_tokens=21), dict(n=2), dict(block_size=8),
                                    dict(kv_tokens=3 * 112)])
def test_a_changed_budget_is_refused_field_by_field(change):
    budget = dataclasses.replace(request_budget(100, SamplingParams(max_tokens=20, n=3), 16), **change)
    with pytest.raises(RequestBudgetMismatchError):
        check_budget(budget, 100, SamplingParams(max_tokens=20, n=3), 16)


def test_the_router_budget_reaches_the_engine_which_serves_it(config, engine):
    """gRPC message -> validate stage -> engine: the SamplingParams the edge decoded is the
    object the engine's requests hold, and the budget computed at the router is accepted as
    is (the engine, reading the same request, agrees with it)."""
    msg = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=6, n=2, temperature=0, ignore_eos=True))
    inbound, ctx = _validated(config, engine.tokenizer, msg)
    request = ctx.request
    assert request.sampling is inbound.sampling and request.sampling.max_tokens == msg.sampling.max_tokens
    assert ctx.budget == request_budget(len(request.prompt_token_ids), inbound.sampling, BLOCK_SIZE)
    engine.add_request(request)
    members = [r for r in engine.scheduler.waiting if r.request_id.startswith(request.request_id)]
    assert len(members) == 2 and all(r.sampling is request.sampling for r in members)
    finals = [d for d in _drain(engine) if d.finished]
    assert sorted(d.usage.completion_tokens for d in finals) == [6, 6]


def test_a_capped_request_carries_the_capped_budget(config, engine):
    """The degradation ladder's cap lowers max_tokens and the budget together; the engine
    serves the capped request with the cap."""
    msg = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    _, ctx = _validated(config, engine.tokenizer, msg)
    small = capped(ctx.request, 3)
    assert (small.sampling.max_tokens, small.budget.max_tokens) == (3, 3)
    assert small.budget.kv_tokens < ctx.budget.kv_tokens
    engine.add_request(small)
    finals = [d for d in _drain(engine) if d.finished]
    assert [d.usage.completion_tokens for d in finals] == [3]


@pytest.mark.parametrize("change", [dict(kv_tokens=-BLOCK_SIZE), dict(max_tokens=1), dict(prompt_tokens=-1),
                                    dict(block_size=BLOCK_SIZE)])
def test_the_engine_refuses_a_changed_budget_and_holds_nothing(engine, change):
    """Each figure off by a little (an understated KV reservation, a raised max_tokens, a
    prompt counted differently, a router and worker with different block sizes): refused
    with RequestBudgetMismatchError (INTERNAL to the client: the servers disagree), never
    served on figures the engine re-derived."""
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = engine.tokenize(GenerateRequest("probe", prompt=PROMPT))
    budget = request_budget(len(ids), sampling, BLOCK_SIZE)
    changed = dataclasses.replace(budget, **{k: getattr(budget, k) + v for k, v in change.items()})
    with pytest.raises(RequestBudgetMismatchError) as refused:
        engine.add_request(GenerateRequest("changed", prompt_token_ids=tuple(ids), sampling=sampling, budget=changed))
    assert status_map.status_for(refused.value).kind == "internal"
    assert not engine.has_unfinished()
    engine.check_integrity()
    engine.add_request(GenerateRequest("as-sent", prompt_token_ids=tuple(ids), sampling=sampling, budget=budget))
    assert [d.usage.completion_tokens for d in _drain(engine) if d.finished] == [6]


# ---- where max_tokens may change form (docs/engine.md, "A request's max_tokens") --------------

# Modules that may build a SamplingParams (or replace one's fields): the edges decode one, the
# client library sends one, the degradation cap lowers max_tokens.
MAY_BUILD_SAMPLING = {"router/convert.py", "router/openai_http.py", "router/client.py", "router/stages/degrade.py"}
# Modules that may compute a RequestBudget: the validate stage (the router's edge), the cap (a
# new budget with the new max_tokens), and the engine when it is the edge itself.
MAY_COMPUTE_BUDGET = {"router/stages/validate.py", "router/stages/degrade.py", "worker/engine_loop/engine.py"}


def form_changes(root: Path, folders=("router", "worker")) -> dict[str, set[str]]:
    """path -> {"sampling", "budget"}: where a module builds a SamplingParams
    (`SamplingParams(...)`, `dataclasses.replace(<...>.sampling, ...)`) or computes a budget
    (`request_budget(...)`)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                kind = None
                if name == "SamplingParams":
                    kind = "sampling"
                elif name == "replace" and node.args and ast.unparse(node.args[0]).split(".")[-1] == "sampling":
                    kind = "sampling"
                elif name == "request_budget":
                    kind = "budget"
                if kind:
                    found.setdefault(path.relative_to(root).as_posix(), set()).add(kind)
    return found


def test_max_tokens_changes_form_only_where_the_table_says():
    found = form_changes(ROOT)
    builds_sampling = {p for p, kinds in found.items() if "sampling" in kinds}
    computes_budget = {p for p, kinds in found.items() if "budget" in kinds}
    assert builds_sampling <= MAY_BUILD_SAMPLING, builds_sampling - MAY_BUILD_SAMPLING
    assert computes_budget <= MAY_COMPUTE_BUDGET, computes_budget - MAY_COMPUTE_BUDGET
    assert {"router/stages/validate.py", "worker/engine_loop/engine.py"} <= computes_budget


def test_the_form_walk_sees_a_stage_that_rebuilds_max_tokens(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "quota_stage.py").write_text(
        "import dataclasses\n"
        "def reserve(request):\n"
        "    sampling = dataclasses.replace(request.sampling, max_tokens=request.sampling.max_tokens * 2)\n"
        "    return request_budget(1, sampling, 16)\n")
    assert form_changes(tmp_path, ("router",)) == {"router/quota_stage.py": {"sampling", "budget"}}
