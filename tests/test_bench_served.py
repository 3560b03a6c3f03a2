"""load_tests/bench_served.py: both sides run the config `kvmesh serve` deploys, and the
in-process side's figures and the report's ratios (the served side needs Ray: its path is
the chaos and routing campaigns' ClusterTarget, exercised by their e2e tests)."""

import argparse
import dataclasses

from kvmesh.deploy import cmd_serve
from kvmesh.load_tests import bench_served


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_both_sides_run_the_config_kvmesh_serve_deploys(tiny_model_dir):
    ours = bench_served.serve_config(tiny_model_dir, ("scheduler.max_num_seqs=8",))
    theirs = cmd_serve.config_from_args(_serve_args("--model", tiny_model_dir, "--set", "scheduler.max_num_seqs=8"))
    assert ours.replace(router={"host": theirs.router.host}) == theirs


def test_the_in_process_side_and_the_report(tiny_model_dir):
    config = bench_served.serve_config(tiny_model_dir, ("parallel.cpu_threads=1",))
    requests = bench_served.seed_shaped_requests(config, quick=True)
    figures = bench_served.run_in_process(config, requests, 0)
    run = figures.run
    assert figures.side == "in-process" and run.output_tok_s > 0
    assert 0 < run.e2e_p50_s <= run.e2e_p99_s <= run.wall_s
    served = bench_served.SideFigures("served", 0, dataclasses.replace(
        run, output_tok_s=run.output_tok_s / 2, e2e_p99_s=run.e2e_p99_s * 3), "")
    later = bench_served.SideFigures("served", 1, run, "")
    report = bench_served.format_report(config, [figures, served, later, dataclasses.replace(figures, round=1)])
    assert "throughput 0.75x (rounds: 0.50, 1.00)" in report and "E2E P99 2.00x (rounds: 3.00, 1.00)" in report
