"""proto/: the checked-in stubs match kvmesh.proto and import as kvmesh.proto.*."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.proto import generate, kvmesh_pb2, kvmesh_pb2_grpc


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
