"""OpenVINO GenAI's decode step by batch, the counterpart of bench_batched_step's table: run by
the OpenVINO environment's interpreter (stdlib + openvino at top, no kvmesh), on one IR that
load_tests/openvino_peer.py exported:

    /work/ov-venv/bin/python load_tests/openvino_step.py ~/.cache/kvmesh/openvino/SmolLM2-135M-Instruct-int4

A ContinuousBatchingPipeline as bench_openvino's child builds it (1 GB KV, 2 threads); per batch
(8, 32, 64) that many 45-token requests of 40 greedy tokens; a step counts where every request
got one token; prints each batch's median step wall ms and process CPU ms."""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import numpy as np  # the OpenVINO environment's packages
    import openvino as ov
    import openvino_genai

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ir")
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = 1
    pipe = openvino_genai.ContinuousBatchingPipeline(args.ir, scheduler, "CPU", {"INFERENCE_NUM_THREADS": args.threads})
    running = openvino_genai.GenerationStatus.RUNNING

    def run(batch: int, new_tokens: int, first_id: int) -> tuple[float, float, int]:
        handles = []
        for i in range(batch):
            config = openvino_genai.GenerationConfig()
            config.max_new_tokens = config.min_new_tokens = new_tokens
            config.ignore_eos, config.do_sample = True, False
            ids = [(97 * i + k) % 40000 + 100 for k in range(45)]
            handles.append(pipe.add_request(first_id + i, ov.Tensor(np.array([ids], dtype=np.int64)), config))
        decode: list[tuple[float, float]] = []
        while any(h.get_status() == running for h in handles):
            wall, cpu = time.perf_counter(), time.process_time()
            pipe.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            got = sum(len(o.generated_ids) for h in handles if h.can_read() for o in h.read().values())
            if got == batch:
                decode.append((wall, cpu))
        return (statistics.median(w for w, _ in decode) * 1e3, statistics.median(c for _, c in decode) * 1e3,
                len(decode))

    run(4, 8, 0)  # warm-up
    for n, batch in enumerate(int(b) for b in args.batches.split(",")):
        wall_ms, cpu_ms, steps = run(batch, 40, 100 * (n + 1))
        print(f"batch {batch}: step {wall_ms:.1f} ms wall, {cpu_ms:.1f} ms CPU (median of {steps} decode steps)",
              flush=True)


if __name__ == "__main__":
    main()
