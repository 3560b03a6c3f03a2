"""load_tests/bench_openvino.py and its OpenVINO child: both sides get the same requests, the
child protocol, the report's ratios. The OpenVINO side itself needs the OpenVINO GenAI
environment and an IR (load_tests/openvino_peer.py); CI has neither, and the test is marked slow
(run it with `pytest -m slow tests/test_bench_openvino.py`)."""

import dataclasses
import os
import sys

import pytest

from kvmesh.load_tests import bench_openvino, bench_served, openvino_child, openvino_peer


@pytest.fixture(scope="module")
def requests(tiny_model_dir):
    return bench_served.seed_shaped_requests(bench_served.serve_config(tiny_model_dir), quick=True)


def test_the_child_gets_the_requests_kvmesh_runs(requests):
    setup = bench_openvino.child_setup(requests, threads=2)
    got = openvino_child.decode_setup(openvino_child.encode_setup(setup))  # what the child reads
    assert got == setup
    assert got.requests == tuple((r.prompt_token_ids, r.output_tokens) for r in requests)
    assert got.threads == 2 and got.warmup == bench_served.WARMUP_REQUESTS


def test_the_child_refuses_requests_it_cannot_run_exactly():
    with pytest.raises(ValueError, match="at least one output token"):
        openvino_child.decode_setup('{"requests": [[[1, 2], 0]], "threads": 1, "cache_size_gb": 1, "warmup": 0}')
    assert openvino_child.check_lengths([3, 4], [3, 4]) is None
    assert "1 of 2 requests" in openvino_child.check_lengths([3, 5], [3, 4])
    assert openvino_child.check_lengths([3], [3, 4]) is not None


def test_a_child_without_openvino_is_a_clear_error(requests):
    """The protocol end to end with this interpreter (no openvino_genai): the child reads the
    setup, fails to import, and the parent says the child exited instead of hanging."""
    setup = bench_openvino.child_setup(requests[:1], threads=1)
    with pytest.raises(RuntimeError, match="the OpenVINO child exited"):
        bench_openvino.OpenVinoPeer(sys.executable, setup)


def test_the_report_pairs_each_mode_with_the_best_ir(tiny_model_dir):
    run = bench_openvino.EngineRunFigures(output_tok_s=100.0, e2e_p50_s=1.0, e2e_p99_s=2.0, wall_s=3.0,
                                          output_tokens=300)
    slow = dataclasses.replace(run, output_tok_s=40.0, e2e_p99_s=4.0)
    fast = dataclasses.replace(run, output_tok_s=50.0, e2e_p99_s=3.0)
    figures = [bench_openvino.SideRound(side, r, fig) for r in (0, 1) for side, fig in
               (("kvmesh default", run), ("openvino fp16", slow), ("openvino int8", fast))]
    figures[3] = dataclasses.replace(figures[3], run=dataclasses.replace(run, output_tok_s=150.0))
    report = bench_openvino.format_report(figures, bench_served.serve_config(tiny_model_dir))
    assert "| kvmesh default | 125.0 |" in report
    assert ("kvmesh default / openvino int8 (the best IR): throughput 2.50x (rounds: 2.00, 3.00), "
            "E2E P99 0.67x (rounds: 0.67, 0.67)") in report


_IR = openvino_peer.ir_dir("int8")


@pytest.mark.slow  # ~10-20 s of OpenVINO on 2 cores: past the suite's budget where the venv exists (`pytest -m slow`)
@pytest.mark.skipif(not os.path.exists(openvino_peer.DEFAULT_OV_PYTHON) or not (_IR / "openvino_model.xml").exists(),
                    reason="needs the OpenVINO GenAI environment and the embedded model's int8 IR "
                           "(python -m kvmesh.load_tests.openvino_peer)")
def test_the_openvino_side_runs_the_requests_exactly():
    config = bench_served.serve_config(None)
    requests = bench_served.seed_shaped_requests(config, quick=True)[:3]
    peer = bench_openvino.OpenVinoPeer(openvino_peer.DEFAULT_OV_PYTHON, bench_openvino.child_setup(requests, 2))
    try:
        figures = peer.run(_IR)  # the child checks every request's length; the parent the total
    finally:
        peer.close()
    assert figures.output_tokens == sum(r.output_tokens for r in requests)
    assert 0 < figures.e2e_p50_s <= figures.e2e_p99_s <= figures.wall_s
