"""load_tests/bench_light_ttft.py: its sides' syntax and its in-process side on the tiny model
(the served sides are bench_served's deployment, covered by tests/test_load_smoke.py)."""

import argparse

import pytest

from e2e_cluster import tiny_cluster_config
from kvmesh.load_tests import bench_light_ttft


def test_a_side_is_a_name_and_its_overrides():
    assert bench_light_ttft.parse_side("off=router.sched_idle=false") == ("off", ("router.sched_idle=false",))
    assert bench_light_ttft.parse_side("two=a.b=1,c.d=2") == ("two", ("a.b=1", "c.d=2"))
    assert bench_light_ttft.parse_side("defaults=") == ("defaults", ())
    for bad in ("router.sched_idle", "=router.sched_idle=false"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_light_ttft.parse_side(bad)


def test_in_process_side_times_each_request_alone(tiny_model_dir):
    config = tiny_cluster_config(tiny_model_dir)
    prompts = [[1000 + i + j for j in range(24)] for i in range(bench_light_ttft.WARMUP + 4)]
    ttft_ms, e2e_ms = bench_light_ttft.in_process(config, prompts)
    assert 0 < ttft_ms < e2e_ms  # the first token comes before the 32nd
