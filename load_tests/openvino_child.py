"""The OpenVINO side of load_tests/bench_openvino.py: a child process run by the OpenVINO GenAI
environment's interpreter (`python openvino_child.py`), so it imports nothing of kvmesh
(standard library only at the top; openvino_genai inside the run).

The protocol, one JSON object a line:

    parent -> child   {"requests": [[prompt ids, output tokens], ...], "threads": 2,
                       "cache_size_gb": 1, "warmup": 2}                       (once, first)
    child -> parent   {"ready": true, "openvino_genai": "<version>"}
    parent -> child   {"ir": "/path/to/ir"}                                    (one a round)
    child -> parent   {"finish_s": [...], "wall_s": s, "output_tokens": n, "load_s": s}
                      or {"error": "..."}
    the parent closes stdin: the child exits.

Each round builds a fresh ContinuousBatchingPipeline on the IR (nothing cached from an earlier
round), runs the first `warmup` requests, then adds every request at t=0 and steps the pipeline
until all are done; a request's E2E is when its handle stops running. Every request is greedy
with EOS ignored and exactly its output length (min_new_tokens = max_new_tokens); the child
checks each produced exactly that many tokens and says so in an error otherwise. Anything the
libraries print goes to stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildSetup:
    requests: tuple[tuple[tuple[int, ...], int], ...]  # (prompt token ids, exact output tokens)
    threads: int
    cache_size_gb: int  # the KV cache the scheduler holds (GB): sized to hold the whole run
    warmup: int  # requests run once on a fresh pipeline before the timed run


def encode_setup(setup: ChildSetup) -> str:
    return json.dumps({"requests": [[list(ids), n] for ids, n in setup.requests], "threads": setup.threads,
                       "cache_size_gb": setup.cache_size_gb, "warmup": setup.warmup})


def decode_setup(line: str) -> ChildSetup:
    data = json.loads(line)
    requests = tuple((tuple(int(t) for t in ids), int(n)) for ids, n in data["requests"])
    if not requests or any(n < 1 or not ids for ids, n in requests):
        raise ValueError("every request needs a prompt and at least one output token")
    return ChildSetup(requests, int(data["threads"]), int(data["cache_size_gb"]), int(data["warmup"]))


def check_lengths(produced: list[int], wanted: list[int]) -> str | None:
    """None when every request produced exactly its output length, else what differed."""
    wrong = [(i, p, w) for i, (p, w) in enumerate(zip(produced, wanted)) if p != w]
    if len(produced) != len(wanted) or wrong:
        return (f"{len(wrong)} of {len(wanted)} requests produced a different length than asked "
                f"(request, produced, asked: {wrong[:3]})")
    return None


def _run_requests(pipe, ov, np, requests, first_id: int) -> tuple[list[float], float, list[int]]:
    """Every request added at t=0, the pipeline stepped until done: (finish s, wall s, tokens a request)."""
    import openvino_genai  # the child's interpreter is the OpenVINO environment's

    handles = []
    t0 = time.perf_counter()
    for i, (ids, n) in enumerate(requests):
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = n
        config.ignore_eos = True
        config.do_sample = False
        handles.append(pipe.add_request(first_id + i, ov.Tensor(np.array([ids], dtype=np.int64)), config))
    finish: dict[int, float] = {}
    produced = [0] * len(handles)
    running = openvino_genai.GenerationStatus.RUNNING
    while len(finish) < len(handles):
        pipe.step()
        now = time.perf_counter() - t0
        for i, handle in enumerate(handles):
            if i in finish:
                continue
            if handle.can_read():
                for output in handle.read().values():
                    produced[i] += len(output.generated_ids)
            if handle.get_status() != running:
                finish[i] = now
    return [finish[i] for i in range(len(handles))], time.perf_counter() - t0, produced


def run_round(setup: ChildSetup, ir: str) -> dict:
    import numpy as np  # the child's interpreter is the OpenVINO environment's
    import openvino as ov  # (as above)
    import openvino_genai  # (as above)

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = setup.cache_size_gb
    t = time.perf_counter()
    pipe = openvino_genai.ContinuousBatchingPipeline(ir, scheduler, "CPU", {"INFERENCE_NUM_THREADS": setup.threads})
    load_s = time.perf_counter() - t
    try:
        warm = setup.requests[:setup.warmup]
        _, _, warm_produced = _run_requests(pipe, ov, np, warm, first_id=0)
        finish_s, wall_s, produced = _run_requests(pipe, ov, np, setup.requests, first_id=len(warm))
        error = check_lengths(warm_produced + produced, [n for _, n in warm] + [n for _, n in setup.requests])
        if error:
            return {"error": error}
        return {"finish_s": finish_s, "wall_s": wall_s, "output_tokens": sum(produced), "load_s": load_s}
    finally:
        del pipe


def main() -> None:
    out = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    setup = decode_setup(sys.stdin.readline())
    import openvino_genai  # the child's interpreter is the OpenVINO environment's

    out.write(json.dumps({"ready": True, "openvino_genai": openvino_genai.__version__}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = run_round(setup, json.loads(line)["ir"])
        except Exception as exc:  # the parent reports it: the child's one channel is the protocol
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
