"""LoRA on the router side without a cluster: the adapter registry (names, tenants, the CLI's
file), the error mapping, and adapter-aware routing decisions."""

import random

import grpc
import pytest

from kvmesh.core.config import KvmeshConfig, LoraConfig, RouterConfig
from kvmesh.core.errors import AdapterNotFoundError, InvalidRequestError, PermissionDeniedError
from kvmesh.core.seams import AdapterRef, WorkerStats
from kvmesh.deploy.cli import main as cli_main
from kvmesh.router import status_map
from kvmesh.router.adapter_affinity import AdapterPlacement
from kvmesh.router.adapters import AdapterRegistry
from kvmesh.router.routing import AdapterRouting, RoutingPath, choose_worker

BASE = "tiny"


def _registry(tmp_path, **extra) -> AdapterRegistry:
    config = KvmeshConfig.from_dict({"lora": {"adapters": [
        {"name": "shared", "path": "/a/shared"},
        {"name": "acme-only", "path": "/a/acme", "tenant": "acme"},
    ], **extra}}).lora
    return AdapterRegistry(config, refresh_s=0.0)


@pytest.mark.parametrize("model, adapter, want", [
    ("", "", None), (BASE, "", None),
    (f"{BASE}:shared", "", "shared"), ("shared", "", "shared"), ("", "shared", "shared"),
    (f"{BASE}:shared", "shared", "shared"), (f"{BASE}:acme-only", "", "acme-only"),
])
def test_requested_adapter_resolves(tmp_path, model, adapter, want):
    ref = _registry(tmp_path).resolve(model, adapter, BASE, "acme")
    assert (ref.name if ref else None) == want
    if ref is not None:
        assert ref.path.startswith("/a/")


@pytest.mark.parametrize("model, adapter, tenant, error", [
    (f"{BASE}:nope", "", "acme", AdapterNotFoundError),
    ("", "nope", "acme", AdapterNotFoundError),
    (f"{BASE}:acme-only", "", "other", PermissionDeniedError),
    ("acme-only", "", "other", PermissionDeniedError),
    ("other-model", "", "acme", InvalidRequestError),  # not an adapter either: the old 400
    ("other-model:shared", "", "acme", InvalidRequestError),
    (f"{BASE}:", "", "acme", InvalidRequestError),
    (f"{BASE}:shared", "acme-only", "acme", InvalidRequestError),
])
def test_bad_adapter_requests_raise_typed_errors(tmp_path, model, adapter, tenant, error):
    with pytest.raises(error):
        _registry(tmp_path).resolve(model, adapter, BASE, tenant)


def test_errors_map_to_not_found_and_permission_denied():
    for error, code, http in ((AdapterNotFoundError("x"), grpc.StatusCode.NOT_FOUND, 404),
                              (PermissionDeniedError("x"), grpc.StatusCode.PERMISSION_DENIED, 403)):
        status = status_map.status_for(error)
        assert (status.grpc_code, status.http_status) == (code, http)
        rebuilt = status_map.error_from_grpc(code, "x", [(status_map.ERROR_KIND_KEY, status.kind)])
        assert type(rebuilt) is type(error)


def test_cli_adds_lists_removes_and_routers_pick_it_up(tmp_path, capsys):
    folder = tmp_path / "support"
    (folder).mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"")
    records = tmp_path / "adapters.yaml"
    registry = _registry(tmp_path, adapters_file=str(records))
    assert cli_main(["adapters", "--file", str(records), "add", "support", str(folder), "--tenant", "acme"]) == 0
    assert cli_main(["adapters", "--file", str(records), "add", "support", str(folder)]) == 1  # exists
    assert cli_main(["adapters", "--file", str(records), "add", "bad", str(tmp_path)]) == 2  # not an adapter
    assert cli_main(["adapters", "--file", str(records), "add", "a:b", str(folder)]) == 2  # bad name
    assert registry.resolve(f"{BASE}:support", "", BASE, "acme") == AdapterRef("support", str(folder))
    assert [a.name for a in registry.visible_to("acme")] == ["acme-only", "shared", "support"]
    assert [a.name for a in registry.visible_to("other")] == ["shared"]
    capsys.readouterr()
    assert cli_main(["adapters", "--file", str(records), "list", "--json"]) == 0
    assert '"support"' in capsys.readouterr().out
    assert cli_main(["adapters", "--file", str(records), "remove", "support"]) == 0
    assert cli_main(["adapters", "--file", str(records), "remove", "support"]) == 1
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(f"{BASE}:support", "", BASE, "acme")


def _stats(worker_id: str, load: int, resident=()) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=16, num_blocks_total=100, num_blocks_used=0,
                       num_blocks_cached=0, num_blocks_free=100, kv_tokens_used=0, kv_tokens_capacity=1600,
                       kv_tokens_reserved=0, num_running=0, num_waiting=0, queued_prompt_tokens=0,
                       prefix_cache_hit_rate=0.0, output_tokens_per_s=0.0, tokens_to_compute=load,
                       lora_slots_total=4, resident_adapters=tuple(resident))


def _route(workers, holders, counts, cost, matched=None):
    config = RouterConfig(policy="prefix_aware", imbalance_ratio=1.5, imbalance_abs_tokens=100)
    return choose_worker(matched or {}, workers, config, random.Random(0),
                         adapter=AdapterRouting(frozenset(holders), counts, cost))


def test_adapter_request_goes_to_its_holder_unless_a_load_is_cheaper_than_the_queue():
    workers = [_stats("w0", 300), _stats("w1", 0)]
    # w0 holds it and is 300 tokens ahead, a load is worth 400: stay (no load)
    d = _route(workers, {"w0"}, {"w0": 2, "w1": 2}, cost=400)
    assert (d.worker_id, d.path) == ("w0", RoutingPath.ADAPTER_HOLDER)
    # a load is worth 50 tokens and w0 is overloaded by the imbalance guard: load it on w1
    d = _route(workers, {"w0"}, {"w0": 2, "w1": 2}, cost=50)
    assert (d.worker_id, d.path) == ("w1", RoutingPath.ADAPTER_LOAD)
    # nobody holds it: the worker with a free slot (fewer adapters) among the calm ones
    d = _route([_stats("w0", 0), _stats("w1", 40)], set(), {"w0": 4, "w1": 1}, cost=400)
    assert (d.worker_id, d.path) == ("w1", RoutingPath.ADAPTER_LOAD)
    # a cached prefix (keyed by adapter) still wins
    d = _route([_stats("w0", 50), _stats("w1", 0)], {"w1"}, {}, cost=400, matched={"w0": 3})
    assert d.path == RoutingPath.PREFIX_MATCH and d.worker_id == "w0"


def test_placement_remembers_sends_until_reports_and_forgets_them():
    now = [0.0]
    placement = AdapterPlacement(memory_s=10.0, clock=lambda: now[0])
    placement.update([_stats("w0", 0, ["a"]), _stats("w1", 0)])
    placement.note_routed("w1", "b")
    assert placement.holders("a", ["w0", "w1"]) == {"w0"}
    assert placement.holders("b", ["w0", "w1"]) == {"w1"}
    now[0] = 11.0
    assert placement.holders("b", ["w0", "w1"]) == set()


def test_lora_config_is_validated():
    with pytest.raises(ValueError):
        KvmeshConfig.from_dict({"lora": {"adapters": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}})
    with pytest.raises(ValueError):
        KvmeshConfig.from_dict({"lora": {"max_rank": 0}})
    assert LoraConfig().max_loras == 4


def _simulated_loads(policy: str, choices: list[int], num_workers: int = 2, num_slots: int = 4) -> int:
    """Requests one after another (each ends before the next, so no slot stays pinned) through
    the real routing decision and AdapterPlacement, against per-worker LRU slot pools; the
    adapter loads the workers make."""
    import collections

    from kvmesh.router.routing import RoundRobinCursor

    slots = {f"w{i}": collections.OrderedDict() for i in range(num_workers)}
    placement = AdapterPlacement(memory_s=1e9, clock=lambda: 0.0)
    config = RouterConfig(policy=policy)
    cursor, rng, loads = RoundRobinCursor(), random.Random(0), 0
    for choice in choices:
        name = f"adapter-{choice}"
        workers = [_stats(w, 0, list(lru)) for w, lru in slots.items()]
        placement.update(workers)
        ids = [w.worker_id for w in workers]
        adapter = AdapterRouting(frozenset(placement.holders(name, ids)),
                                 {w: len(placement.adapters_on(w)) for w in ids}, load_cost_tokens=400)
        worker = choose_worker({}, workers, config, rng, cursor, adapter=adapter).worker_id
        placement.note_routed(worker, name)
        lru = slots[worker]
        if name in lru:
            lru.move_to_end(name)
        else:
            loads += 1
            if len(lru) == num_slots:
                lru.popitem(last=False)
            lru[name] = None
    return loads


def test_adapter_affinity_needs_at_most_half_the_loads_of_round_robin_on_zipf_traffic():
    from kvmesh.load_tests.workloads import zipf_adapter_choices

    choices = zipf_adapter_choices(400, 8, s=1.1, seed=0)
    aware, round_robin = _simulated_loads("prefix_aware", choices), _simulated_loads("round_robin", choices)
    assert aware <= 8, "each adapter loaded once: 8 adapters fit 2 workers x 4 slots"
    assert aware <= 0.5 * round_robin, (aware, round_robin)
