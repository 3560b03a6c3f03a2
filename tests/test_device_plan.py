"""The memory plan counts every device allocation before sizing the KV pools (kv/device_plan.py),
and the engine fills it from its config: the parts never add up to more than
gpu_memory_utilization x device memory, for every speculative method with and without CUDA
graphs. Devices are made-up sizes here: the plan is arithmetic, the engine's CPU run checks
the wiring (draft pool size, split in the plan)."""

from __future__ import annotations

import itertools

import pytest

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.kv.device_plan import (DeviceParts, graph_static_bytes, plan_device, scaled_activation_bytes)

GIB = 1 << 30
MIB = 1 << 20


def test_pools_take_what_the_parts_leave():
    parts = DeviceParts(runtime_bytes=500 * MIB, weight_bytes=13 * GIB, activation_bytes=GIB, sampler_bytes=64 * MIB)
    plan = plan_device(int(24 * GIB * 0.8), parts, kv_bytes_per_block=2 * MIB)
    left = int(24 * GIB * 0.8) - parts.total_bytes
    assert plan.num_blocks == left // (2 * MIB) and plan.num_draft_blocks == 0
    assert plan.total_bytes <= plan.budget_bytes < plan.total_bytes + 2 * MIB
    assert sum(plan.split().values()) == plan.total_bytes


def test_self_draft_pool_is_as_many_blocks_as_the_target_unless_configured():
    parts = DeviceParts(weight_bytes=4 * GIB, draft_weight_bytes=GIB)
    same = plan_device(16 * GIB, parts, 2 * MIB, draft_kv_bytes_per_block=MIB)
    assert same.num_draft_blocks == same.num_blocks > 0
    assert same.total_bytes <= 16 * GIB < same.total_bytes + 3 * MIB
    fixed = plan_device(16 * GIB, parts, 2 * MIB, draft_kv_bytes_per_block=MIB, draft_num_blocks=100)
    assert fixed.num_draft_blocks == 100 and fixed.total_bytes <= 16 * GIB < fixed.total_bytes + 2 * MIB


def test_an_explicit_pool_that_does_not_fit_is_refused_by_how_much():
    with pytest.raises(ConfigError, match="do not fit the device budget by"):
        plan_device(GIB, DeviceParts(weight_bytes=900 * MIB), MIB, num_blocks=200)
    assert plan_device(GIB, DeviceParts(weight_bytes=900 * MIB), MIB, num_blocks=200, must_fit=False).num_blocks == 200
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        plan_device(GIB, DeviceParts(weight_bytes=GIB), MIB)


def test_graph_estimates_follow_shapes():
    # one bucket of 1: 3 int64 + 1 int32 per row, 2 query starts, a 4-block table row, hidden 8 x 2 bytes
    assert graph_static_bytes([1], 4, 8, 2) == 28 + 8 + 16 + 16
    assert scaled_activation_bytes(8192 * 100, 8192, 64) == 64 * 100
    assert scaled_activation_bytes(1000, 10, 100) == 1000  # never above the profiled forward


# ---- the engine's plan, on a made-up CUDA device -------------------------------------------

class _FakeCudaModel:
    """What _plan_memory reads of a model: its tensors and KV geometry."""

    def __init__(self, weight_bytes: int, num_kv_heads: int, head_dim: int):
        import torch

        self._weights = [torch.empty(weight_bytes // 2, dtype=torch.bfloat16, device="meta")]
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def parameters(self):
        return iter(self._weights)

    def buffers(self):
        return iter(())


@pytest.mark.parametrize("method,cuda_graphs", list(itertools.product(["none", "ngram", "self_draft"], [False, True])))
def test_engine_plan_stays_inside_the_utilization_target(monkeypatch, method, cuda_graphs):
    import torch
    from transformers import LlamaConfig

    from kvmesh.worker.engine_loop import engine_setup
    from kvmesh.worker.engine_loop.self_draft import DraftModel

    total, free = 24 * GIB, 24 * GIB - 300 * MIB - 2 * GIB - (GIB if method == "self_draft" else 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": total}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=16,
                     intermediate_size=8192, vocab_size=128256)
    config = KvmeshConfig.from_dict({"cache": {"gpu_memory_utilization": 0.8, "block_size": 16},
                                     "scheduler": {"max_num_seqs": 64},
                                     "parallel": {"cuda_graphs": cuda_graphs},
                                     "speculative": {"method": method}})
    model = _FakeCudaModel(2 * GIB, 8, 64)
    draft = None
    if method == "self_draft":
        spec = type("Spec", (), {"dtype": torch.bfloat16})
        draft = DraftModel(_FakeCudaModel(GIB, 8, 64), config, spec)
    plan = engine_setup._plan_memory(config, model, hf, torch.device("cuda", 0), "bf16",
                                     profile_peak=lambda: 700 * MIB, max_model_len=8192, draft=draft)
    split = plan.device.split()
    assert sum(split.values()) <= 0.8 * total
    assert split["weights"] == 2 * GIB and split["runtime"] == 300 * MIB and split["activations"] == 700 * MIB
    assert split["sampler"] == 64 * (1 + (config.speculative.num_tokens if method != "none" else 0)) * 128256 * 30
    assert (split["cuda_graphs"] > 0) == cuda_graphs
    # LoRA slots (lora.max_loras 4 at lora.max_rank 64 by default), reserved at rank 64 on all 7
    # projections of the 16 layers: sum of (in + out) = q 4096 + k 2560 + v 2560 + o 4096 + 3 x 10240
    assert split["lora_slots"] == 4 * 64 * 16 * 44032 * 2
    if method == "self_draft":
        assert split["draft_weights"] == GIB and plan.num_draft_blocks == plan.num_blocks
        assert split["draft_kv_pool"] == split["kv_pool"]  # same geometry, same dtype here
    else:
        assert split["draft_weights"] == split["draft_kv_pool"] == 0
    # the pool took what was left, to within one block
    per_block = plan.kv_bytes_per_token * plan.block_size
    assert 0.8 * total - sum(split.values()) < per_block * (2 if method == "self_draft" else 1)
