"""Per-step time of tensor parallelism on this machine: TP=1 against TP=N, and the share of
rank 0's step spent in collectives (all-reduce after o_proj / down_proj, the vocab-parallel
embedding's all-reduce and the logits all-gather).

    python -m kvmesh.load_tests.bench_tp [--tp 3] [--batch 8] [--steps 10] [--prompt-tokens 32] [--threads 1]

Runs SmolLM2-135M (fp32, torch attention, CPU, gloo) through the real Engine: `batch`
requests of `prompt-tokens` tokens are prefilled, then `steps` decode steps are timed.
Variants: TP=1, TP=N vocab-parallel, TP=N replicated embedding/LM head. Not a test: the
figures depend on the machine and on whatever else runs on it.

The collective share is measured on rank 0 and includes waiting for the slowest rank, so
on an over-subscribed CPU it is mostly load imbalance, not wire time.

Figures, 2026-11-29, this project's 2-core CPU (shared with other jobs), batch 8, 32-token
prompts, 10 timed decode steps, one torch thread per rank. Two runs: (a) machine load
average ~15, peers computing logits in both modes; (b) load ~5, peers skip the logits when
the LM head is replicated (only rank 0 samples), which is the code as it stands:

     tp  embedding/head   step ms (a)  step ms (b)  collective share (b)  collectives/step
      1  -                    383          120              0%                    0
      3  vocab-parallel       449          384             80%                   62
      3  replicated           543          373             73%                   60

TP=3 is 3x slower here, as expected: three rank processes share two cores (with other
work), so each of the 62 collectives per step (2 per layer x 30 layers, the embedding's
all-reduce, the logits all-gather) waits for a descheduled rank, and a 135M model's decode
step is too small for a third of its matmuls to pay that back. The collective share is that
waiting, not wire time. TP pays on GPUs, where each rank owns a device and the all-reduce
runs over NVLink. Vocab-parallel and replicated are within noise of each other in (b);
vocab-parallel keeps a third of the 113 MiB fp32 embedding table per rank (the tied LM head
shares it), so it is the default (parallel.vocab_parallel). A run with rank 0 on 2 threads
measured TP=1 at ~8 s a step under load: two OpenMP threads on an over-subscribed machine
spin on barriers, hence --threads 1.
"""

from __future__ import annotations

import argparse
import os
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_api import Engine


def _config(tp: int, vocab_parallel: bool, batch: int, prompt_tokens: int, steps: int) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"dtype": "fp32"},
        "cache": {"num_blocks": batch * (-(-(prompt_tokens + steps + 4) // 16)) + 4, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": max(256, batch * prompt_tokens),
                      "max_prefill_tokens_per_step": max(256, batch * prompt_tokens)},
        "parallel": {"tensor_parallel_size": tp, "device": "cpu", "attention_backend": "torch",
                     "worker_num_cpus": 1, "vocab_parallel": vocab_parallel},
    })


def measure(tp: int, vocab_parallel: bool, batch: int, prompt_tokens: int, steps: int) -> dict:
    started = time.perf_counter()
    engine = Engine.from_config(_config(tp, vocab_parallel, batch, prompt_tokens, steps))
    load_s = time.perf_counter() - started
    try:
        vocab = engine.parts.hf_config.vocab_size
        for i in range(batch):
            ids = [(97 + 13 * i + 7 * j) % vocab for j in range(prompt_tokens)]
            engine.add_request(GenerateRequest(f"b{i}", prompt_token_ids=ids, sampling=SamplingParams(
                max_tokens=steps + 2, temperature=0, ignore_eos=True)))
        engine.step()  # prefill (all prompts fit one step) and the first token
        engine.step()  # warm-up decode
        coll = engine.runner.model.coll
        coll_before, n_before = coll.collective_s, coll.num_collectives
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
        total = sum(step_s)
        return {"tp": tp, "vocab_parallel": vocab_parallel, "load_s": load_s,
                "step_ms_median": sorted(step_s)[len(step_s) // 2] * 1e3, "step_ms_mean": total / steps * 1e3,
                "collective_share": (coll.collective_s - coll_before) / total,
                "collectives_per_step": (coll.num_collectives - n_before) / steps}
    finally:
        if hasattr(engine.runner, "shutdown"):
            engine.runner.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of rank 0 (each peer rank runs worker_num_cpus = 1)")
    args = parser.parse_args()
    import ray
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(2, args.tp), include_dashboard=False, log_to_driver=False)
    rows = [measure(1, True, args.batch, args.prompt_tokens, args.steps),
            measure(args.tp, True, args.batch, args.prompt_tokens, args.steps),
            measure(args.tp, False, args.batch, args.prompt_tokens, args.steps)]
    print(f"{'tp':>3} {'vocab':>10} {'load s':>7} {'step ms (median)':>17} {'step ms (mean)':>15} "
          f"{'collective share':>17} {'collectives/step':>17}")
    for r in rows:
        print(f"{r['tp']:>3} {'parallel' if r['vocab_parallel'] else 'replicated':>10} {r['load_s']:>7.1f} "
              f"{r['step_ms_median']:>17.1f} {r['step_ms_mean']:>15.1f} {r['collective_share']:>17.1%} "
              f"{r['collectives_per_step']:>17.0f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
