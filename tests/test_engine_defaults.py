"""Defaults resolved from the machine and the model: model.dtype auto, the int4 group size."""

import logging
import os

import pytest
import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.quant.primitives import largest_valid_group_size
from kvmesh.worker.runner import model_setup
from kvmesh.worker.model.loader import load_hf_config


@pytest.mark.parametrize("native, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, caplog, native, want):
    monkeypatch.setattr(model_setup, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="kvmesh.worker.runner.model_setup"):
        assert model_setup.pick_dtype(KvmeshConfig(), torch.device("cpu")) == want
    assert "model.dtype auto" in caplog.text
    explicit = KvmeshConfig().replace(model={"dtype": "fp32"})
    assert model_setup.pick_dtype(explicit, torch.device("cpu")) == torch.float32


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux CPU flags")
def test_native_bf16_probe_agrees_with_the_cpu_flags():
    flags = set(open("/proc/cpuinfo").read().split())
    assert model_setup.cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16", "amx_tile"} & flags)


def test_int4_group_size_is_the_largest_that_divides(smollm2_dir, caplog):
    hf = load_hf_config(smollm2_dir)  # hidden 576 = 9 x 64
    cfg = KvmeshConfig().replace(quant={"weight": "int4"})  # default group size 128
    with caplog.at_level(logging.INFO, logger="kvmesh.worker.runner.model_setup"):
        assert model_setup.with_valid_group_size(cfg, hf).quant.group_size == 64
    assert "using 64" in caplog.text
    small = cfg.replace(quant={"group_size": 32})
    assert model_setup.with_valid_group_size(small, hf).quant.group_size == 32
    assert model_setup.with_valid_group_size(KvmeshConfig(), hf).quant.group_size == 128  # no int4: untouched
    with pytest.raises(ConfigError, match="no int4 group size"):
        largest_valid_group_size([576, 100], 128)
