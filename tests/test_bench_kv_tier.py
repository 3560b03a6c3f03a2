"""load_tests/bench_kv_tier.py --quick on the tiny model: the tier is hit, the outputs agree with
recompute, every figure is there (no timing is asserted: performance lives in the benchmark)."""

import json

from kvmesh.load_tests import bench_kv_tier


def test_quick_run_hits_the_tier_and_reports_every_figure(tiny_model_dir, tmp_path):
    out = tmp_path / "tier.json"
    bench_kv_tier.main(["--quick", "--model", tiny_model_dir, "--threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    spec = data["spec"]
    assert data["outputs_equal"] is True
    # Every measured request found its whole prefix (full blocks) in the tier.
    full_blocks = spec["prefix_tokens"] // spec["block_size"]
    assert data["tier_hit_tokens"] >= spec["families"] * spec["rounds"] * full_blocks * spec["block_size"]
    assert data["tier_bytes_loaded"] > 0 and data["tier_bytes_stored"] > 0
    assert data["ttft_p50_s_recompute"] > 0 and data["ttft_p50_s_tier"] > 0 and data["ttft_p50_ratio"] > 0
    assert data["cpu_flags"] and data["num_tier_blocks"] > data["num_pool_blocks"]
