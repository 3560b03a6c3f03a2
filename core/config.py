"""One configuration tree for kvmesh, validated on load.

The CLI flags, the Serve YAML (``serveConfigV2`` args) and the Helm values all map onto these
fields. Each component receives only its own section (``config.cache``, ``config.scheduler``,
...). Validation happens here, at start, so a bad value fails before anything serves.

    KvmeshConfig
    ├── model          which weights, dtype, context length
    ├── cache          paged KV cache: block size, memory budget, KV dtype, prefix cache, swap
    ├── scheduler      batching policy and every admission / scheduling limit
    ├── parallel       workers, tensor parallelism, device, attention backend
    ├── quant          weight quantization
    ├── router         ports, routing policy, admission thresholds, retry lane
    ├── tenants        auth, quota store, tenant list
    ├── observability  tracing exporter and sampling, metrics
    ├── degradation    the ladder under pressure (cap, fallback pool, reject) per priority class
    └── speculative    speculative decoding: proposer, draft length, load threshold
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{name} must be one of {list(allowed)}, got {value!r}")


# model.cpu_native_max_tokens' auto value for small steps on AMX CPUs (and VDPBF16PS ones without
# AMX, fp32 int4 models): the native step's AMX path holds a call's tokens in four 16-token tiles
# (worker/kernels/cpu_native_step.py). Larger steps go to the projections 64 tokens a call.
CPU_NATIVE_MAX_TOKENS = 64


@dataclass(frozen=True)
class ModelConfig:
    # HF folder (config.json + safetensors) or a .gguf file; None = embedded SmolLM2.
    path: str | None = None
    # Name the API reports; None = derived from the path.
    served_model_name: str | None = None
    # Part of the prefix-cache extra keys: bump it when the weights at `path` change.
    revision: str = "main"
    dtype: str = "auto"  # auto = bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX), else fp32
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    # bf16 on CPU: keep projection and LM-head weights in oneDNN's blocked layout, reordered
    # once at load instead of on every matmul (worker/kernels/packed_weights.py). Costs a
    # second copy of those weights; false = plain F.linear.
    cpu_prepack_weights: bool = True
    # decode = compile the decoder stack with torch.compile / inductor (CPU, one rank) for
    # steps of at most scheduler.max_num_seqs tokens, warmed at start; projections and
    # attention stay the eager kernels (worker/runner/compiled_forward.py). off = eager.
    compile: str = "off"
    # CPU attention backend: decode rows of an unquantized fp32 / bf16 cache attend through a
    # small C kernel reading K/V in place via the block tables (built on first use with the
    # system C compiler; worker/kernels/cpu_paged_attention.py), instead of gathering each
    # row's blocks and running SDPA per group. false = always the gather + SDPA path.
    cpu_decode_kernel: bool = True
    # CPU: steps of at most this many tokens (small decode batches, short prefill
    # chunks, speculative verify rows) run the whole layer stack and the LM head as one native
    # call (worker/kernels/cpu_native_step.py: GEMVs over the model's own fp32 / bf16 / int8 /
    # int4 weights, the same paged KV cache); larger steps and what it does not take run eagerly.
    # None = auto: for 16-bit models 64 on CPUs with AMX, every step up to the scheduler's
    # max_num_batched_tokens on CPUs with VDPBF16PS and no AMX (Zen 4; prompt chunks whose
    # attention is long run eagerly: cpu_native_step.PREFILL_ATTENTION_PAIRS_MAX), else 12
    # tokens per torch thread, at most 24 (where it measured faster than eager's GEMMs);
    # fp32 float weights 12 a thread, at most 24 (fp32 GEMVs; token-exact: the eager forward up
    # to the order of fp32 sums); fp32 int8 as 16-bit, fp32 int4 64 (eager dequantizes every
    # call); 0 = off for any dtype (every step eager, the reference path).
    cpu_native_max_tokens: int | None = None

    def validate(self) -> None:
        _one_of("model.dtype", self.dtype, ("auto", "fp32", "bf16", "fp16"))
        _one_of("model.compile", self.compile, ("off", "decode"))
        _check(self.max_model_len is None or self.max_model_len >= 1, "model.max_model_len must be >= 1")
        _check(self.cpu_native_max_tokens is None or self.cpu_native_max_tokens >= 0,
               "model.cpu_native_max_tokens must be >= 0 (or null: auto)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    # Memory for the KV cache on CPU (GiB). On CUDA the budget comes from
    # gpu_memory_utilization x device memory minus weights and the profiled peak activation.
    cpu_kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.80  # the articles: plan to at most ~80% of device memory
    # Explicit block count, overriding the memory budget (tests use small pools).
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # auto = model dtype
    enable_prefix_caching: bool = True
    swap_space_gib: float = 0.5  # CPU swap space for swap preemption
    # The host tier below the pool (kv/host_tier.py): evicted prefix blocks are kept in this
    # much host memory (GiB; 0 = off) and copied back on a hit instead of recomputed.
    # host_tier_num_blocks overrides the size in blocks (tests use small tiers).
    host_tier_gib: float = 0.0
    host_tier_num_blocks: int | None = None
    # Pulling prefix KV from the worker the router names (needs the host tier): auto = when
    # the cost model says it beats recomputing (kv/transfer_cost.py), always, or never.
    kv_transfer: str = "auto"
    kv_transfer_timeout_s: float = 5.0

    def validate(self) -> None:
        _check(self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
               f"cache.block_size must be a power of two >= 1, got {self.block_size}")
        _check(self.cpu_kv_cache_gib > 0, "cache.cpu_kv_cache_gib must be > 0")
        _check(0 < self.gpu_memory_utilization <= 1, "cache.gpu_memory_utilization must be in (0, 1]")
        _check(self.num_blocks is None or self.num_blocks >= 1, "cache.num_blocks must be >= 1")
        _one_of("cache.kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp32", "fp16", "bf16", "int8", "fp8", "int4"))
        _check(self.swap_space_gib >= 0, "cache.swap_space_gib must be >= 0")
        _check(self.host_tier_gib >= 0, "cache.host_tier_gib must be >= 0")
        _check(self.host_tier_num_blocks is None or self.host_tier_num_blocks >= 0,
               "cache.host_tier_num_blocks must be >= 0")
        _one_of("cache.kv_transfer", self.kv_transfer, ("auto", "always", "never"))
        _check(self.kv_transfer_timeout_s > 0, "cache.kv_transfer_timeout_s must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "continuous"  # continuous | static | dynamic
    max_num_seqs: int = 64  # max_active_requests
    max_num_batched_tokens: int = 512  # token budget of one step (decode + prefill)
    max_prefill_tokens_per_step: int = 512  # chunked prefill: prompt tokens per step
    max_total_kv_tokens: int | None = None  # None = the KV cache's capacity
    max_new_tokens: int = 2048  # ceiling on a request's max_tokens
    max_n: int = 16  # ceiling on a request's n (samples of one prompt)
    max_queue_len: int = 1024
    max_queue_time_s: float = 60.0
    preemption_mode: str = "recompute"  # recompute | swap
    static_batch_size: int = 8  # policy=static: batch formed, run to completion
    dynamic_batch_window_s: float = 0.05  # policy=dynamic: wait this long to fill a batch
    # A waiting request of a strictly more important priority class (tenants[].priority plus
    # the request's own) may preempt running requests of less important classes when it
    # cannot start otherwise; each request is preempted so at most max_priority_preemptions
    # times (then it runs to completion: no starvation by preemption, no thrashing). 3, not
    # 1: a victim resumes first within its class, so with 1 the running requests are soon all
    # spent and important ones wait for a slot again (priority campaign, docs/load-testing.md).
    priority_preemption: bool = False
    max_priority_preemptions: int = 3
    # What a request's KV reservation counts for its output: its whole max_tokens (never
    # preempted for lack of blocks unless over-committed), or `expected`: an estimate learned
    # per tenant from finished requests (kv/output_estimate.py), never below the floor,
    # topped up as a request outgrows it, preemption as the safety valve.
    admission_reserve: str = "max_tokens"  # max_tokens | expected
    expected_output_floor_tokens: int = 16
    expected_output_quantile: float = 0.9
    # Class-aware KV admission: this share of the KV budget is kept for requests of a class
    # more important than (numerically below) kv_reserved_below_class; the other classes
    # together may commit at most the rest, so a flood of them cannot take all of it.
    kv_reserved_fraction: float = 0.0
    kv_reserved_below_class: int = 1
    # With priority_preemption: a request the KV budget refuses may also take the KV
    # reservations of requests of strictly less important classes (least important, most
    # recently started first; each within max_priority_preemptions). They go back to waiting
    # (recompute or swap, their tokens kept) and reserve again before they resume, so an
    # important request never waits for a flood's reservations to drain. Off: only slots,
    # step budget and blocks are preempted for priority (worker/engine_loop/admission.py).
    priority_preempts_kv_reservations: bool = True
    # The worker actor's per-request `generate` streams (not the router's path, which takes one
    # channel per worker and router.stream_messages_per_s): at most this many messages a second
    # over all of them (each waits streams / budget seconds, at most 1 s, after a message; what
    # arrives meanwhile goes out merged). First and final deltas never wait; 0 = one message per
    # step per stream (worker/runtime/async_engine.py).
    stream_messages_per_s: float = 100.0

    def validate(self) -> None:
        _one_of("scheduler.policy", self.policy, ("continuous", "static", "dynamic"))
        _one_of("scheduler.preemption_mode", self.preemption_mode, ("recompute", "swap"))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_per_step",
                     "max_new_tokens", "max_n", "max_queue_len", "static_batch_size"):
            _check(getattr(self, name) >= 1, f"scheduler.{name} must be >= 1")
        _check(self.max_total_kv_tokens is None or self.max_total_kv_tokens >= 1,
               "scheduler.max_total_kv_tokens must be >= 1")
        _check(self.max_queue_time_s > 0, "scheduler.max_queue_time_s must be > 0")
        _check(self.dynamic_batch_window_s >= 0, "scheduler.dynamic_batch_window_s must be >= 0")
        _check(self.max_priority_preemptions >= 1, "scheduler.max_priority_preemptions must be >= 1")
        _one_of("scheduler.admission_reserve", self.admission_reserve, ("max_tokens", "expected"))
        _check(self.expected_output_floor_tokens >= 1, "scheduler.expected_output_floor_tokens must be >= 1")
        _check(0 < self.expected_output_quantile <= 1, "scheduler.expected_output_quantile must be in (0, 1]")
        _check(0 <= self.kv_reserved_fraction < 1, "scheduler.kv_reserved_fraction must be in [0, 1)")
        _check(self.stream_messages_per_s >= 0, "scheduler.stream_messages_per_s must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    num_workers: int = 1  # engines (each one TP group)
    tensor_parallel_size: int = 1
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto = triton on CUDA, cpu on CPU; torch = the reference
    # Ray resource each worker rank asks for, besides CPU ("GPU" on GPU nodes; tests use a
    # custom resource to stand in for GPUs on one machine). None = no extra resource.
    worker_resource: str | None = None
    # CPUs each worker rank asks Ray for; None = derived from the CPUs Ray sees when the app
    # is built (core/resources.py), so the defaults bring up every worker on the machine.
    worker_num_cpus: float | None = None
    # CPU engines: torch / native-step threads per worker rank. None = worker_num_cpus rounded
    # down (at least 1). Set apart from worker_num_cpus so that one worker can run a thread on
    # every core while Ray still reserves a share for the router (`kvmesh serve` does on
    # machines of <= 4 cores: deploy/cmd_serve.py).
    cpu_threads: int | None = None
    # CPU engines: how long a native-step thread spins at an OpenMP barrier before it sleeps,
    # in libgomp's iterations (GOMP_SPINCOUNT in the engine processes' environment, set before
    # torch loads libgomp). libgomp's default (300,000: milliseconds) keeps a thread spinning
    # through every slice the OS hands the serving stack on its teammate's core; a short spin
    # lets the waiting core go idle, so the preempted teammate resumes there instead of the
    # whole team waiting for it (docs/deploy.md, the engine's share of the cores). None =
    # libgomp's default, or whatever the environment already sets.
    cpu_spin_count: int | None = 3000
    # Tensor parallelism: the longest a collective or a peer rank's step may take before the
    # step fails with WorkerFailedError and the group is rebuilt (a dead peer is usually
    # noticed sooner, when its connection closes).
    collective_timeout_s: float = 60.0
    # Embedding + LM head split by vocabulary rows over the TP ranks (True) or a full copy
    # on each (False); load_tests/bench_tp.py measures both.
    vocab_parallel: bool = True
    # CUDA + Triton attention, tensor_parallel_size 1: decode steps replay CUDA graphs captured
    # at start for batch buckets up to the one holding scheduler.max_num_seqs (worker/
    # cuda_graphs.py); false, or a capture failure, runs decode eagerly. No effect on CPU.
    cuda_graphs: bool = True
    # How long an engine's start waits for its placement group (one bundle per TP rank on one
    # node, worker/parallel/placement.py) before failing with the missing resource named;
    # raise it where an autoscaler adds nodes on demand.
    placement_timeout_s: float = 15.0

    def engine_threads(self) -> int:
        """Threads a CPU worker rank runs its engine on (cpu_threads, else its CPU share)."""
        return self.cpu_threads or max(1, int(self.worker_num_cpus or 1))

    def validate(self) -> None:
        _check(self.num_workers >= 1, "parallel.num_workers must be >= 1")
        _check(self.placement_timeout_s > 0, "parallel.placement_timeout_s must be > 0")
        _check(self.tensor_parallel_size >= 1, "parallel.tensor_parallel_size must be >= 1")
        _one_of("parallel.device", self.device, ("auto", "cpu", "cuda"))
        _one_of("parallel.attention_backend", self.attention_backend, ("auto", "torch", "cpu", "triton"))
        _check(self.worker_num_cpus is None or self.worker_num_cpus >= 0, "parallel.worker_num_cpus must be >= 0")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "parallel.cpu_threads must be >= 1")
        _check(self.cpu_spin_count is None or self.cpu_spin_count >= 0, "parallel.cpu_spin_count must be >= 0")
        _check(self.collective_timeout_s > 0, "parallel.collective_timeout_s must be > 0")


@dataclass(frozen=True)
class QuantConfig:
    # auto | none | int8 | int4 | int4_awq | gguf (a .gguf model served in its own quantization:
    # Q8_0 -> int8 groups, Q4_0 / Q4_1 / Q4_K -> int4 groups, scales and mins as stored; other
    # types refused at load; worker/model/gguf_loader.py). none dequantizes a GGUF at load.
    # auto = gguf for a .gguf model (the embedded one included) on a CPU whose model dtype is
    # fp32 and that runs the native step (its exact int4: the dequantized model's tokens, HF's,
    # at a fraction of the bytes; docs/benchmarks.md), else none
    # (worker/runner/model_setup.py resolve_weight_quant).
    weight: str = "auto"
    group_size: int = 128  # int4 group size
    # What int4 layers multiply in the CPU native step: fp32 = each weight dequantized in
    # registers exactly as the eager layer does (greedy tokens those of the dequantized model,
    # i.e. HF transformers' on a GGUF); int8 = activations quantized to int8 per 32-input block
    # (llama.cpp's Q4 x Q8 dot products: the fastest mode, logits within ~5 %, not token-exact).
    int4_activations: str = "fp32"
    # Text file used for AWQ scale search and static fp8 KV scales; None = bundled corpus.
    calibration_path: str | None = None

    def validate(self) -> None:
        _one_of("quant.weight", self.weight, ("auto", "none", "int8", "int4", "int4_awq", "gguf"))
        _one_of("quant.group_size", self.group_size, (32, 64, 128))
        _one_of("quant.int4_activations", self.int4_activations, ("fp32", "int8"))


@dataclass(frozen=True)
class TlsConfig:
    """Transport security of the router's gRPC and HTTP edges (router/tls.py). PEM files,
    e.g. a Kubernetes Secret of type kubernetes.io/tls mounted read-only (the chart's
    `tls.secretName`); re-read when they change, so a rotated certificate serves new
    connections without a restart. No cert_file = plaintext."""

    cert_file: str | None = None  # server certificate chain
    key_file: str | None = None  # its private key
    # Set = mutual TLS: clients must present a certificate signed by one of these CAs.
    client_ca_file: str | None = None
    reload_check_s: float = 30.0  # how often the files are checked for a rotation

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    def validate(self) -> None:
        _check((self.cert_file is None) == (self.key_file is None),
               "router.tls.cert_file and router.tls.key_file go together")
        _check(self.client_ca_file is None or self.enabled, "router.tls.client_ca_file needs cert_file and key_file")
        _check(self.reload_check_s > 0, "router.tls.reload_check_s must be > 0")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    num_replicas: int = 1
    policy: str = "predicted_latency"  # predicted_latency | prefix_aware | least_loaded | round_robin
    # Prefix affinity yields to load when the preferred worker's load exceeds the least
    # loaded worker's by both of these (load: tokens still to compute, router/routing.py).
    imbalance_ratio: float = 1.5
    imbalance_abs_tokens: int = 2048
    # Admission: requests waiting at the router beyond the workers' budgets, and the share
    # of that queue (and of the token budget headroom) that retries may use.
    max_queue_len: int = 256
    retry_lane_fraction: float = 0.2
    stats_refresh_s: float = 0.25
    # Longest a request waits in the router's admission queue before OverloadedError
    # (a request's own deadline, when sooner, wins).
    max_queue_wait_s: float = 30.0
    # Refuse (retryable, with retry-after) on arrival a request whose deadline its expected
    # queue wait already overruns, instead of queueing it until the deadline fails it.
    deadline_shedding: bool = True
    # Failover that keeps the stream: a request whose worker dies after streaming output is
    # resumed on a survivor (prompt + the tokens streamed so far) at most this many times;
    # 0 = the client gets a retryable WorkerFailedError instead.
    max_stream_resumptions: int = 1
    # Drain: a router replica being removed (`serve deploy` of a new config, a scale-down,
    # `kvmesh serve` stopping) closes its gRPC listener at once, lets the streams it carries
    # finish for up to this long, then ends the rest retryably (UNAVAILABLE replica_stopping)
    # for clients to resume on another replica. `kvmesh serve` on SIGTERM and `kvmesh drain`
    # give a drained worker the same grace before its streams move to another worker.
    drain_grace_s: float = 30.0
    # The absolute imbalance margin is at least this many mean requests, in the load's unit
    # (what recent admissions cost their workers: a cache hit its uncached tail): a fixed
    # token count below one request lets a single queued request break affinity (long
    # prompts), one far above it never does (short ones). 0 = imbalance_abs_tokens alone.
    imbalance_margin_requests: float = 2.0
    # Affinity wait: a request whose cached prefix lives on a worker with no KV budget left
    # (and that the load guard would still pick) waits up to this long for room there before
    # it spills to another worker as a whole-prompt miss (router/affinity_wait.py). 0 = spill at once.
    affinity_wait_s: float = 1.0
    # Several router replicas and tenants.redis_url set: a new prompt family goes to the worker
    # the first replica to place it claimed in that Redis (router/family_claims.py); the claim
    # expires this long after its family's last request. 0 = off (each replica's own rule).
    family_claim_ttl_s: float = 10.0
    # A Ray resource each router replica asks for (0.01 of it), so replicas run only on the
    # nodes that advertise it: the replicas serve gRPC on grpc_port themselves
    # (router/grpc_ingress.py), so they must run where clients reach that port (the Helm
    # chart advertises it on the head, which its Service targets). None = anywhere.
    replica_resource: str | None = None
    # Messages a router replica writes to its clients a second, over all its streams: after a
    # message a stream holds what its worker sends until the next tick of its share (in-flight
    # streams / this, at most 1 s; one clock for the replica, router/stream_pacer.py) and sends
    # it merged, so under load a message carries several tokens and the stack's CPU a token
    # falls (vLLM's and SGLang's stream interval, sized by load). The first token and the final
    # message never wait. 0 = a message per delta a worker sends.
    stream_messages_per_s: float = 2000.0
    # The replica's threads run at Linux's SCHED_IDLE (router/app.py): they get a core only
    # when no engine thread wants it (or a sliver of a busy core, so they never starve).
    # For a machine whose engine threads take every core (`kvmesh serve` on <= 4 cores,
    # router/launch.py): a replica woken for a step's tokens then waits for a core the
    # engine leaves idle (a barrier's wait, the step's own Python) instead of preempting
    # one of the engine's lockstep threads mid-phase while the others wait for it at the
    # next barrier (docs/deploy.md). False: the replica only runs nicer than the engines.
    sched_idle: bool = False
    # ...while the replica carries this many streams or more; at half of it or fewer it runs at
    # its nice again, so a lightly loaded replica's first token does not wait for an idle core
    # (router/thread_priority.py; leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE, else
    # the replica stays there). 0: SCHED_IDLE throughout.
    sched_idle_min_streams: int = 4
    # predicted_latency policy (router/routing.py, router/latency.py, router/hot_spread.py).
    # The engine's step-cost model the TTFT prediction uses: overhead + prefill tokens x
    # per-token + decoding sequences x per-sequence (defaults: the CPU engine, measured by
    # `python -m kvmesh.load_tests.routing_sim --measure`).
    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 0.0004
    decode_s_per_token: float = 0.0025
    # Workers whose predicted TTFT is within this fraction of the best are equally good for a
    # new prefix; among them the one sent the least recent work takes it.
    latency_tie_ratio: float = 0.25
    # Half-life of the recent work per worker that breaks those ties (seconds).
    work_half_life_s: float = 30.0
    # A family is the requests sharing their first this-many full blocks (its spread key).
    spread_family_blocks: int = 16
    # A spread family gives back its newest worker after this long without needing it.
    spread_cooldown_s: float = 10.0
    # A family also spreads when its worker's recent work exceeds the mean by this ratio (and
    # the imbalance margin) while nobody queues yet: the computed-tokens balance it keeps.
    # Workers kept within r of the mean either way are within r^2 of each other: 1.2 keeps
    # computed max/min near 1.44, inside the 1.5 the routing table is held to.
    spread_work_ratio: float = 1.2
    tls: TlsConfig = field(default_factory=TlsConfig)

    def validate(self) -> None:
        self.tls.validate()
        _one_of("router.policy", self.policy, ("prefix_aware", "predicted_latency", "least_loaded", "round_robin"))
        _check(1 <= self.grpc_port <= 65535 or self.grpc_port == 0, "router.grpc_port out of range")
        _check(1 <= self.http_port <= 65535 or self.http_port == 0, "router.http_port out of range")
        _check(self.num_replicas >= 1, "router.num_replicas must be >= 1")
        _check(self.stream_messages_per_s >= 0, "router.stream_messages_per_s must be >= 0")
        _check(self.imbalance_ratio >= 1.0, "router.imbalance_ratio must be >= 1")
        _check(self.imbalance_abs_tokens >= 0, "router.imbalance_abs_tokens must be >= 0")
        _check(self.max_queue_len >= 0, "router.max_queue_len must be >= 0")
        _check(0 <= self.retry_lane_fraction <= 1, "router.retry_lane_fraction must be in [0, 1]")
        _check(self.stats_refresh_s > 0, "router.stats_refresh_s must be > 0")
        _check(self.max_queue_wait_s > 0, "router.max_queue_wait_s must be > 0")
        _check(self.sched_idle_min_streams >= 0, "router.sched_idle_min_streams must be >= 0")
        _check(self.max_stream_resumptions >= 0, "router.max_stream_resumptions must be >= 0")
        _check(self.drain_grace_s >= 0, "router.drain_grace_s must be >= 0")
        _check(self.imbalance_margin_requests >= 0, "router.imbalance_margin_requests must be >= 0")
        _check(self.affinity_wait_s >= 0, "router.affinity_wait_s must be >= 0")
        _check(self.family_claim_ttl_s >= 0, "router.family_claim_ttl_s must be >= 0")
        for name in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_token", "latency_tie_ratio",
                     "spread_cooldown_s"):
            _check(getattr(self, name) >= 0, f"router.{name} must be >= 0")
        _check(self.work_half_life_s > 0, "router.work_half_life_s must be > 0")
        _check(self.spread_work_ratio >= 1.0, "router.spread_work_ratio must be >= 1")
        _check(self.spread_family_blocks >= 1, "router.spread_family_blocks must be >= 1")


@dataclass(frozen=True)
class TenantConfig:
    id: str
    # Salted hashes only ("scheme$salt$hexdigest"); plain keys never live in config.
    api_key_hashes: tuple[str, ...] = ()
    priority: int = 0  # lower value = served first (like vLLM's priority scheduling)
    prompt_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_concurrent_kv_tokens: int | None = None
    max_tokens_ceiling: int | None = None
    cache_salt: str | None = None  # set = this tenant's prefix cache is isolated

    def validate(self) -> None:
        _check(bool(self.id), "tenants.tenants[].id must be non-empty")
        for name in ("prompt_tokens_per_minute", "output_tokens_per_minute", "max_concurrent_requests",
                     "max_concurrent_kv_tokens", "max_tokens_ceiling"):
            v = getattr(self, name)
            _check(v is None or v >= 1, f"tenant {self.id}: {name} must be >= 1")


@dataclass(frozen=True)
class TenantsConfig:
    auth_required: bool = False  # embedded default: open, one default tenant (logged loudly)
    redis_url: str | None = None  # None = in-process quota store
    default_tenant: str = "default"
    tenants: tuple[TenantConfig, ...] = ()
    # Tenant records written by `kvmesh tenants ...` when there is no redis_url (YAML file);
    # with redis_url they live in Redis. Either overlays `tenants` above, reloaded periodically.
    tenants_file: str | None = None
    tenant_refresh_s: float = 5.0
    quota_probe_interval_s: float = 1.0  # Redis reconnect probe while on local fallback limits

    def validate(self) -> None:
        ids = [t.id for t in self.tenants]
        _check(len(ids) == len(set(ids)), f"tenants: duplicate tenant ids in {ids}")
        _check(self.tenant_refresh_s > 0, "tenants.tenant_refresh_s must be > 0")
        _check(self.quota_probe_interval_s > 0, "tenants.quota_probe_interval_s must be > 0")
        for t in self.tenants:
            t.validate()


@dataclass(frozen=True)
class ObservabilityConfig:
    tracing_exporter: str = "none"  # none | console | otlp
    # e.g. http://otel-collector:4317, or file:///var/log/kvmesh/spans.jsonl: OTLP/JSON lines
    # written by every process itself, no collector (read them with `kvmesh trace`)
    otlp_endpoint: str | None = None
    trace_sampling_ratio: float = 1.0
    metrics_enabled: bool = True

    def validate(self) -> None:
        _one_of("observability.tracing_exporter", self.tracing_exporter, ("none", "console", "otlp"))
        _check(self.tracing_exporter != "otlp" or bool(self.otlp_endpoint),
               "observability.otlp_endpoint is required when tracing_exporter is otlp")
        _check(0 <= self.trace_sampling_ratio <= 1, "observability.trace_sampling_ratio must be in [0, 1]")


@dataclass(frozen=True)
class DegradationRule:
    """What the router does for one range of priority classes when the main pool has no room
    (router/degradation.py), in this order: queue up to `queue_wait_s` -> cap max_tokens to
    `cap_max_tokens` (when set) -> send to the fallback pool (when `fallback`) -> reject
    with retry-after. The rule with the highest `min_priority_class` not above a request's
    class applies (lower class = more important); a class no rule covers queues up to
    router.max_queue_wait_s and is then rejected, as without a ladder."""

    min_priority_class: int = 0
    queue_wait_s: float = 0.0
    cap_max_tokens: int | None = None
    fallback: bool = False

    def validate(self) -> None:
        _check(self.queue_wait_s >= 0, "degradation.rules[].queue_wait_s must be >= 0")
        _check(self.cap_max_tokens is None or self.cap_max_tokens >= 1,
               "degradation.rules[].cap_max_tokens must be >= 1")


@dataclass(frozen=True)
class FallbackPoolConfig:
    """A second worker group the ladder's `fallback` step sends requests to, never used by
    undegraded traffic: the same model with other weight quantization (e.g. int4, cheaper
    per token), or another model that shares the main model's tokenizer. 0 workers = none."""

    num_workers: int = 0
    quant_weight: str | None = None  # None = quant.weight of the main pool
    model_path: str | None = None  # None = model.path of the main pool
    max_num_seqs: int | None = None  # None = scheduler.max_num_seqs

    def validate(self) -> None:
        _check(self.num_workers >= 0, "degradation.fallback_pool.num_workers must be >= 0")
        if self.quant_weight is not None:
            _one_of("degradation.fallback_pool.quant_weight", self.quant_weight, ("none", "int8", "int4", "int4_awq"))
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1,
               "degradation.fallback_pool.max_num_seqs must be >= 1")


@dataclass(frozen=True)
class DegradationConfig:
    rules: tuple[DegradationRule, ...] = ()  # empty = no ladder: queue, then reject
    fallback_pool: FallbackPoolConfig = field(default_factory=FallbackPoolConfig)

    def validate(self) -> None:
        classes = [r.min_priority_class for r in self.rules]
        _check(len(classes) == len(set(classes)), f"degradation.rules: duplicate min_priority_class in {classes}")
        for rule in self.rules:
            rule.validate()
            _check(not rule.fallback or self.fallback_pool.num_workers > 0,
                   "degradation.rules[].fallback needs degradation.fallback_pool.num_workers >= 1")
        self.fallback_pool.validate()


@dataclass(frozen=True)
class SpeculativeConfig:
    # none | ngram (prompt lookup in the request's own tokens) | self_draft (this model's
    # weights quantized to draft_quant draft for the full-precision model)
    method: str = "none"
    num_tokens: int = 4  # most drafts per request per step (adapted down per request)
    ngram_min_tokens: int = 2  # shortest suffix n-gram prompt lookup matches
    ngram_max_tokens: int = 5  # longest (the longest match wins)
    draft_quant: str = "int8"  # self_draft weights: int8 | int4
    draft_num_blocks: int | None = None  # self_draft KV pool; None = as many blocks as the target's
    # Speculation stays off in a step whose decode rows exceed this; None = decided per step
    # from live step times (worker/engine_loop/speculator.py), the default.
    load_threshold_tokens: int | None = None

    def validate(self) -> None:
        _one_of("speculative.method", self.method, ("none", "ngram", "self_draft"))
        _check(1 <= self.num_tokens <= 16, "speculative.num_tokens must be in [1, 16]")
        _check(1 <= self.ngram_min_tokens <= self.ngram_max_tokens,
               "speculative.ngram_min_tokens must be >= 1 and <= speculative.ngram_max_tokens")
        _one_of("speculative.draft_quant", self.draft_quant, ("int8", "int4"))
        _check(self.draft_num_blocks is None or self.draft_num_blocks >= 1, "speculative.draft_num_blocks must be >= 1")
        _check(self.load_threshold_tokens is None or self.load_threshold_tokens >= 1,
               "speculative.load_threshold_tokens must be >= 1")


@dataclass(frozen=True)
class AdapterConfig:
    """One registered LoRA adapter: requested as model "<base>:<name>" (or "<name>")."""

    name: str
    path: str  # a PEFT folder (adapter_config.json + adapter_model.safetensors) every worker can read
    tenant: str | None = None  # set = only this tenant may use it

    def validate(self) -> None:
        _check(bool(self.name) and ":" not in self.name and "/" not in self.name,
               f"lora.adapters[].name must be non-empty without ':' or '/', got {self.name!r}")
        _check(bool(self.path), f"lora adapter {self.name}: path must be non-empty")


@dataclass(frozen=True)
class LoraConfig:
    # Adapter slots per worker: how many adapters one step can mix (vLLM's max_loras). A request
    # of a further adapter waits for a slot whose requests all ended (LRU eviction). 0 = off.
    max_loras: int = 4
    max_rank: int = 64  # slot stacks are padded to this rank; a larger adapter is refused
    adapters: tuple[AdapterConfig, ...] = ()
    # Records written by `kvmesh adapters ...` (YAML), overlaying `adapters`; reloaded every
    # tenants.tenant_refresh_s by the router.
    adapters_file: str | None = None
    # Adapter-aware routing: the time one adapter load is worth, in queued requests' time
    # (router/routing.py weighs it against the load a worker already has).
    load_cost_requests: float = 4.0

    def validate(self) -> None:
        _check(self.max_loras >= 0, "lora.max_loras must be >= 0")
        _check(1 <= self.max_rank <= 256, "lora.max_rank must be in 1..256")
        _check(self.load_cost_requests >= 0, "lora.load_cost_requests must be >= 0")
        names = [a.name for a in self.adapters]
        _check(len(names) == len(set(names)), f"lora.adapters: duplicate names in {names}")
        for a in self.adapters:
            a.validate()


@dataclass(frozen=True)
class KvmeshConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> "KvmeshConfig":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        s = self.scheduler
        _check(s.max_prefill_tokens_per_step <= s.max_num_batched_tokens,
               "scheduler.max_prefill_tokens_per_step must be <= scheduler.max_num_batched_tokens")
        return self

    # ---- loading / dumping -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict | None) -> "KvmeshConfig":
        return _build(cls, data or {}, "").validate()

    @classmethod
    def from_yaml(cls, path: str | Path) -> "KvmeshConfig":
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        _check(isinstance(data, dict), f"{path}: top level must be a mapping")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return _to_plain(self)

    def replace(self, **sections: Any) -> "KvmeshConfig":
        """Override fields by dotted section: cfg.replace(scheduler={"max_num_seqs": 4})."""
        data = self.to_dict()
        for section, values in sections.items():
            _check(section in data, f"unknown config section {section!r}")
            data[section].update(values)
        return KvmeshConfig.from_dict(data)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


def _build(cls: type, data: Any, where: str) -> Any:
    _check(isinstance(data, dict), f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    _check(not unknown, f"{where or 'config'}: unknown field(s) {unknown}; known: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(non_none[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        _check(isinstance(value, bool), f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), f"{where}: expected a string, got {value!r}")
        return value
    return value


# ---- `--set section.field=value` onto the same fields ---------------------------------


def apply_overrides(config: KvmeshConfig, overrides: typing.Sequence[str]) -> KvmeshConfig:
    """Apply ``section.field=value`` overrides (value parsed as YAML: 8, 0.5, true, null, [..]).

    The flag names are the config's own dotted field names, so the CLI cannot drift from the
    config file or the Helm values: ``--set scheduler.max_num_seqs=32``.
    """
    data = config.to_dict()
    for item in overrides:
        path, value = _parse_override(item)
        section, name = path
        if section not in data:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; known: {sorted(data)}")
        if name not in data[section]:
            raise ConfigError(f"--set {item!r}: unknown field {name!r} in {section}; "
                              f"known: {sorted(data[section])}")
        data[section][name] = value
    return KvmeshConfig.from_dict(data)


def _parse_override(item: str) -> tuple[tuple[str, str], Any]:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.field=value, got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    return (parts[0], parts[1]), value
