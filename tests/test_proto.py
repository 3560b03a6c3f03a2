"""proto/: the checked-in stubs match kvmesh.proto and import as kvmesh.proto.*."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvmesh.proto import generate, kvmesh_pb2, kvmesh_pb2_grpc
from kvmesh.router.convert import worker_stats_from_pb, worker_stats_to_pb
from kvmesh.core.seams import WorkerStats


def test_regenerating_gives_identical_files(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generate.GENERATED_FILES)
    for name in generate.GENERATED_FILES:
        fresh = (tmp_path / name).read_text()
        checked_in = (generate.PROTO_DIR / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run python -m kvmesh.proto.generate"


def test_grpc_stub_imports_messages_through_the_package():
    text = (generate.PROTO_DIR / "kvmesh_pb2_grpc.py").read_text()
    assert "from kvmesh.proto import kvmesh_pb2 as kvmesh__pb2" in text
    assert "\nimport kvmesh_pb2" not in text
    assert kvmesh_pb2_grpc.kvmesh__pb2 is kvmesh_pb2


def test_service_has_the_contracted_methods():
    service = kvmesh_pb2.DESCRIPTOR.services_by_name["Kvmesh"]
    assert kvmesh_pb2.DESCRIPTOR.package == "kvmesh.v1"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Cancel", "ListModels", "Health", "GetStats"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert not methods["Cancel"].server_streaming


def test_prompt_chat_and_token_ids_are_mutually_exclusive():
    request = kvmesh_pb2.GenerateRequest(prompt="hello")
    assert request.WhichOneof("input") == "prompt"
    request.prompt_token_ids.ids.extend([1, 2, 3])
    assert request.WhichOneof("input") == "prompt_token_ids"
    assert not request.HasField("prompt")


def test_optional_sampling_fields_track_presence_through_the_wire():
    sent = kvmesh_pb2.SamplingParams(temperature=0.0, max_tokens=8)
    received = kvmesh_pb2.SamplingParams.FromString(sent.SerializeToString())
    assert received.HasField("temperature") and received.temperature == 0.0  # greedy, not "unset"
    assert not received.HasField("top_p")
    assert not received.HasField("seed")


def test_worker_stats_cross_the_wire_field_for_field():
    stats = WorkerStats(worker_id="w0", healthy=True, block_size=16, num_blocks_total=64, num_blocks_used=9,
                        num_blocks_cached=3, num_blocks_free=52, kv_tokens_used=140, kv_tokens_capacity=1024,
                        kv_tokens_reserved=400, num_running=2, num_waiting=1, queued_prompt_tokens=30,
                        prefix_cache_hit_rate=0.25, output_tokens_per_s=12.5, num_preemptions_recompute=4,
                        num_preemptions_swap=1, num_preemptions_priority=3, num_outgrown_estimates=2,
                        prefix_event_seq=7, tokens_to_compute=95, kv_tokens_reserved_shared=250,
                        num_preemptions_priority_kv=2, lora_slots_total=4, resident_adapters=("a", "b"),
                        num_adapter_loads=5, num_adapter_evictions=3, num_waiting_for_adapter=1)
    assert all(getattr(stats, f.name) not in (0, None, ()) for f in dataclasses.fields(WorkerStats))  # all set
    assert worker_stats_from_pb(worker_stats_to_pb(stats, age_s=0.5)) == stats
