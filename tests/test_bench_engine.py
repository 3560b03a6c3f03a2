"""load_tests/bench_engine.py --quick on the tiny model: the report has every figure, in
the right shape (no timing is asserted: performance lives in the benchmark itself)."""

import json

from kvmesh.load_tests import bench_engine


def test_quick_run_reports_every_figure(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    report = bench_engine.main(["--quick", "--model", tiny_model_dir, "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [m["mode"] for m in data["modes"]] == [m[0] for m in bench_engine.QUICK_MODES]
    for m in data["modes"]:
        run = m["seed_run"]
        assert run["output_tokens"] > 0 and run["output_tok_s"] > 0
        assert 0 < run["e2e_p50_s"] <= run["e2e_p99_s"] <= run["wall_s"]
        assert m["batch1_decode_tok_s"] > 0 and m["batch64_decode_tok_s"] > 0
        assert m["gemm_gflop_s"] > 0 and m["gemm_fraction"] > 0
        assert 0 < m["plain_gemm_gflop_s"] <= m["gemm_gflop_s"]  # each sample: F.linear or better
        assert m["batch64_read_mb"] > 0 and m["read_gb_s"] > 0 and m["bandwidth_fraction"] > 0
    hf = data["hf_static"]
    assert hf["output_tokens"] == data["modes"][0]["seed_run"]["output_tokens"]
    assert data["llama_server"] is None
    table = bench_engine.format_table(report)
    assert "kvmesh fp32" in table and "HF static batches of 8" in table and "CPU flags" in table
    assert "at the memory floor (fp32)" in table
    assert "batch-64 step / plain F.linear (fp32)" in table


def test_ab_run_alternates_the_modes(tiny_model_dir, capsys):
    bench_engine.main(["--quick", "--model", tiny_model_dir, "--threads", "1", "--ab", "bf16-grouped,bf16",
                       "--rounds", "2"])
    out = capsys.readouterr()
    order = [json.loads(line[len("[ab] "):])["mode"] for line in out.err.splitlines() if line.startswith("[ab] ")]
    assert order == ["bf16-grouped", "bf16"] * 2
    assert "| bf16-grouped |" in out.out and "(1.00x)" in out.out and "| bf16 |" in out.out
