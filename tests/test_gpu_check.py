"""load_tests/gpu_check.py --dry-run on CPU: every section's code runs at toy sizes and the
JSON has the schema and the case lists the GPU run will fill, so the first run on a GPU only
has to execute it. (Timings here are CPU noise and are not looked at.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kvmesh.load_tests import gpu_check  # noqa: E402


def test_dry_run_writes_every_section_in_the_gpu_schema(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["dry_run"] is True and "schema_problems" not in results
    assert gpu_check.validate_results(results) == []
    assert [k for k in results if isinstance(results[k], dict)] == ["environment", "quant_gemm", "fused_ops",
                                                                    "engine_decode", "memory_plan"]
    assert all(results[k]["ok"] for k in ("environment", "quant_gemm", "fused_ops", "engine_decode", "memory_plan"))
    plan = results["memory_plan"]  # CPU: the self-draft's pool as large as the target's, in the split
    assert plan["num_draft_blocks"] == plan["num_blocks"] == 64
    assert plan["split_bytes"]["draft_kv_pool"] == plan["split_bytes"]["kv_pool"] > 0

    gemm = results["quant_gemm"]["rows"]
    assert {(r["kernel"], r["m"]) for r in gemm} == {(k, m) for k in ("w4a16", "w8a16") for m in (1, 16, 128)}
    for row in gemm:  # the toy shape ran through the kernels (interpreter) and matched the oracle
        assert "error" not in row and row["max_abs_err_vs_oracle"] < 0.05
        assert row["flops"] == 2 * row["m"] * row["n"] * row["k"]
    assert [r["rows"] for r in results["fused_ops"]["rows"]] == [1, 32, 128]

    engine = results["engine_decode"]
    modes = [(r["weight"], r["cuda_graphs"], r["fused"]) for r in engine["runs"]]
    assert modes == list(gpu_check.ENGINE_MODES)
    for run in engine["runs"]:
        assert "error" not in run, run
        assert [row["batch"] for row in run["rows"]] == [1, 2]
        assert all(row["decode_tokens"] > 0 and row["graph_replays"] == 0 for row in run["rows"])
        assert run["graphs_captured"] == [] and run["graphs_off_reason"]  # CPU: eager, and it says why
    assert set(engine["summary"]) == {"1", "2"}
    assert set(engine["summary"]["1"]) == {"graphs_speedup", "fused_speedup_eager", "fused_speedup_graphs",
                                           "int8_vs_bf16", "int4_vs_bf16"}


def test_gpu_cases_cover_the_issue_and_count_bytes_exactly():
    cases = gpu_check.gemm_cases(dry_run=False)
    assert len(cases) == 2 * len(gpu_check.GEMM_SHAPES) * 3
    down_w4 = next(c for c in cases if c["kernel"] == "w4a16" and c["shape"] == "llama3_8b_down" and c["m"] == 1)
    n, k = 4096, 14336  # packed codes + bf16 scale and zero per 128-group + bf16 x and y
    assert down_w4["bytes"] == n * k // 2 + 2 * 2 * n * (k // 128) + 2 * k + 2 * n
    down_w8 = next(c for c in cases if c["kernel"] == "w8a16" and c["shape"] == "llama3_8b_down" and c["m"] == 128)
    assert down_w8["bytes"] == n * k + 2 * n + 2 * 128 * k + 2 * 128 * n and down_w8["group_size"] is None
    assert gpu_check.ENGINE_BATCHES == (1, 32, 128)
    assert {(w, g) for w, g, fused in gpu_check.ENGINE_MODES if fused} == \
        {(w, g) for w in ("none", "int8", "int4") for g in (True, False)}
    assert ("none", False, False) in gpu_check.ENGINE_MODES  # the unfused step, eager


def test_schema_check_reports_what_is_missing():
    results = {"quant_gemm": {"ok": True, "seconds": 1.0, "dtype": "bf16",
                              "rows": [{"kernel": "w8a16", "shape": "x", "m": 1, "n": 2, "k": 2, "group_size": None,
                                        "bytes": 1, "flops": 1}]},
               "fused_ops": {"ok": False, "seconds": 0.1},
               "engine_decode": {"ok": True, "seconds": 1.0, "summary": {}}}
    problems = gpu_check.validate_results(results)
    assert "quant_gemm.rows[0]: missing time_ms" in problems
    assert "fused_ops: failed without an error" in problems
    assert "engine_decode: missing runs" in problems
    results["quant_gemm"]["rows"][0] = {**results["quant_gemm"]["rows"][0], "error": "OutOfMemoryError"}
    assert not any(p.startswith("quant_gemm") for p in gpu_check.validate_results(results))


def test_pytest_sections_get_what_is_left_of_the_budget(monkeypatch):
    monkeypatch.setitem(gpu_check._DEADLINE, "at", gpu_check.time.perf_counter() + 100)
    assert 90 < gpu_check._time_left_s(200) <= 100  # cut to the budget
    assert gpu_check._time_left_s(30) == 30  # its own timeout when shorter
    monkeypatch.setitem(gpu_check._DEADLINE, "at", gpu_check.time.perf_counter() + 5)
    with pytest.raises(TimeoutError):
        gpu_check.run_pytest(["tests/test_gpu_check.py"], {}, 60)  # recorded as a skipped section
