"""Workload generators: what each request asks for (prompt, output length, tenant).

Every generator is seeded and returns a fixed list of `WorkloadRequest`s before the run
starts (vLLM bench serve's lesson: the same request set for every configuration, so
configurations differ only in the server). Output lengths are exact: requests are sent
with ignore_eos=True and max_tokens=output_tokens. Except with `stop` (stop strings) and
`max_tokens` set: then every request asks for max_tokens and ends at the first stop string
(a sentence, a line), as real clients' requests do, so the output is shorter than asked and
set by the text, not by the `output` distribution (what admission on expected output is for).

Kinds (the `kind` field of a workload spec in a campaign):

  synthetic      input/output lengths from named distributions (default: the articles'
                 traffic, mean input 200, mean output 400, P99 output 2000), x `scale`
  shared_prefix  N families, each a system prompt of `prefix_tokens`, plus unique suffixes
                 (SGLang's generated-shared-prefix dataset)
  long_short     a fraction of long prompts among short ones (head-of-line blocking)
  trace          requests replayed from a JSONL trace file (see trace_format.py)

Any kind may spread its requests over LoRA adapters (`adapters: N`): request i runs with
adapter `adapter-k`, k drawn with Zipf popularity (`adapter_zipf_s`; 0 = uniform) from its own
seeded generator, so the prompts and lengths are those of the same workload without adapters
(the base-model run of a campaign compares like with like). For in-process and cluster targets
the campaign runner writes random PEFT adapters of `adapter_rank` under those names
(load_tests/lora_campaign.py); other targets must serve adapters of those names.

Any generated kind may carry structured-output constraints (`constraints_path`,
structured_workload.py): each output then ends where its grammar is complete.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvmesh.core.seams import StructuredOutput
from kvmesh.load_tests.corpus import TokenCorpus
from kvmesh.load_tests.structured_workload import read_constraints
from kvmesh.load_tests.trace_format import TraceRecord, read_trace
from kvmesh.core.errors import InvalidRequestError

# Standard normal quantile at 0.99: P99 of a lognormal is exp(mu + Z99 * sigma).
Z99 = 2.3263478740408408


@dataclass(frozen=True)
class LengthDistribution:
    """A named token-length distribution.

    kind: fixed (always `mean`), uniform (`min`..`max`), lognormal (fitted so that the
    unclipped mean is `mean` and the unclipped P99 is `p99`). Samples are rounded and
    clipped to [min, max]; clipping moves the mean slightly (documented, not hidden).
    """

    kind: str = "lognormal"
    mean: float = 400.0
    p99: float | None = 2000.0
    min: int = 1
    max: int = 8192

    def validate(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise InvalidRequestError(f"length distribution kind must be fixed|uniform|lognormal, got {self.kind!r}")
        if self.min < 1 or self.max < self.min:
            raise InvalidRequestError(f"length bounds must satisfy 1 <= min <= max, got {self.min}..{self.max}")
        if self.kind == "lognormal":
            if self.p99 is None or not (self.p99 > self.mean > 0):
                raise InvalidRequestError("lognormal lengths need p99 > mean > 0")
            if 2 * math.log(self.p99 / self.mean) > Z99 ** 2:
                raise InvalidRequestError(f"p99/mean = {self.p99 / self.mean:.1f} is too skewed for a lognormal (max 14.9)")

    def lognormal_params(self) -> tuple[float, float]:
        """(mu, sigma) with exp(mu + sigma^2/2) = mean and exp(mu + Z99 sigma) = p99.

        Subtracting the logs: sigma^2/2 - Z99 sigma + ln(p99/mean) = 0; the smaller root
        is the one whose P99 sits above the mean.
        """
        gap = math.log(self.p99 / self.mean)
        sigma = Z99 - math.sqrt(Z99 ** 2 - 2 * gap)
        return math.log(self.mean) - sigma ** 2 / 2, sigma

    def scaled(self, factor: float) -> "LengthDistribution":
        """Lengths x factor (a campaign scaled down to fit a CPU keeps the shape)."""
        if factor <= 0:
            raise InvalidRequestError(f"scale must be > 0, got {factor}")
        return LengthDistribution(self.kind, self.mean * factor, None if self.p99 is None else self.p99 * factor,
                                  max(1, round(self.min * factor)), max(1, round(self.max * factor)))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        self.validate()
        if self.kind == "fixed":
            raw = np.full(n, self.mean)
        elif self.kind == "uniform":
            raw = rng.integers(self.min, self.max + 1, size=n).astype(float)
        else:
            mu, sigma = self.lognormal_params()
            raw = rng.lognormal(mu, sigma, size=n)
        return np.clip(np.rint(raw), self.min, self.max).astype(int)


# The articles' traffic: mean input 200, mean output 400, P99 output 2000. They give no
# input P99; 1000 (the same 5x tail ratio as the output) is our assumption.
ARTICLE_INPUT = LengthDistribution("lognormal", mean=200, p99=1000, min=4, max=4096)
ARTICLE_OUTPUT = LengthDistribution("lognormal", mean=400, p99=2000, min=1, max=4096)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload, fixed before the run."""

    index: int
    prompt_token_ids: tuple[int, ...]
    prompt_text: str
    output_tokens: int
    tenant_id: str = "default"
    api_key: str | None = None
    family: int | None = None  # shared-prefix family, None = unique prompt
    cancel_after_tokens: int | None = None  # client cancels after this many output tokens
    stop: tuple[str, ...] = ()  # set: output_tokens is the max_tokens asked, the text ends it sooner
    arrival_offset_s: float | None = None  # only for traces: when to send, from run start
    adapter: str | None = None  # the LoRA adapter the request asks for (None = the base model)
    # structured output (structured_workload.py): output_tokens is then a ceiling, the
    # grammar's end (EOS) ends the output
    structured: StructuredOutput | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """A campaign's `workload:` section (unused fields are ignored by a kind)."""

    kind: str = "synthetic"
    num_requests: int = 100
    seed: int = 0
    scale: float = 1.0  # multiplies every length (not trace texts)
    input: LengthDistribution = field(default_factory=lambda: ARTICLE_INPUT)
    output: LengthDistribution = field(default_factory=lambda: ARTICLE_OUTPUT)
    # shared_prefix
    num_families: int = 4
    prefix_tokens: int = 512
    # long_short: `long_fraction` of prompts are `long_input` (a distribution), rest `input`
    long_fraction: float = 0.1
    long_input: LengthDistribution = field(default_factory=lambda: LengthDistribution("fixed", 2048, None, 1, 8192))
    # cancellation: this fraction of requests is cancelled at a uniform point of its output
    cancel_fraction: float = 0.0
    # trace
    trace_path: str | None = None
    # natural output ends: every request asks max_tokens and stops at the first of `stop`
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    # LoRA: spread the requests over `adapters` adapters (adapter-0 .. adapter-{N-1}) with Zipf
    # popularity of exponent adapter_zipf_s (0 = uniform); 0 adapters = the base model
    adapters: int = 0
    adapter_zipf_s: float = 1.1
    adapter_rank: int = 16  # of the random adapters the runner writes for engine / cluster targets
    # structured output: a JSON list of constraints, request i carries entry i mod len
    # (load_tests/structured_workload.py); synthetic, shared_prefix and long_short kinds
    constraints_path: str | None = None

    def validate(self) -> None:
        if self.kind not in ("synthetic", "shared_prefix", "long_short", "trace"):
            raise InvalidRequestError(f"workload kind must be synthetic|shared_prefix|long_short|trace, got {self.kind!r}")
        if self.num_requests < 1:
            raise InvalidRequestError("workload.num_requests must be >= 1")
        if not 0 <= self.cancel_fraction <= 1 or not 0 <= self.long_fraction <= 1:
            raise InvalidRequestError("workload fractions must be in [0, 1]")
        if self.kind == "shared_prefix" and (self.num_families < 1 or self.prefix_tokens < 1):
            raise InvalidRequestError("shared_prefix needs num_families >= 1 and prefix_tokens >= 1")
        if self.kind == "trace" and not self.trace_path:
            raise InvalidRequestError("a trace workload needs trace_path")
        if self.kind == "trace" and self.constraints_path:
            raise InvalidRequestError("constraints_path applies to generated workloads, not traces")
        if bool(self.stop) != (self.max_tokens is not None) or (self.max_tokens is not None and self.max_tokens < 1):
            raise InvalidRequestError("workload.stop and workload.max_tokens (>= 1) go together")
        for dist in (self.input, self.output, self.long_input):
            dist.validate()
        if self.adapters < 0 or self.adapter_zipf_s < 0 or self.adapter_rank < 1:
            raise InvalidRequestError("workload.adapters >= 0, adapter_zipf_s >= 0 and adapter_rank >= 1 are needed")

    def adapter_names(self) -> list[str]:
        return [adapter_name(i) for i in range(self.adapters)]


def adapter_name(index: int) -> str:
    """The name of a workload's adapter `index` (the random adapters' folder names too)."""
    return f"adapter-{index}"


def zipf_adapter_choices(num_requests: int, num_adapters: int, s: float = 1.1, seed: int = 0) -> list[int]:
    """Adapter index per request, index k drawn with probability proportional to 1 / (k + 1)^s."""
    weights = 1.0 / np.arange(1, num_adapters + 1) ** s
    rng = np.random.default_rng(seed)
    return rng.choice(num_adapters, size=num_requests, p=weights / weights.sum()).tolist()


def with_adapters(requests: list[WorkloadRequest], spec: WorkloadSpec) -> list[WorkloadRequest]:
    """Each request given its adapter by Zipf popularity (spec.adapters > 0), prompts unchanged."""
    if not spec.adapters:
        return requests
    choices = zipf_adapter_choices(len(requests), spec.adapters, spec.adapter_zipf_s, seed=spec.seed)
    return [dataclasses.replace(r, adapter=adapter_name(c)) for r, c in zip(requests, choices)]


def generate_workload(spec: WorkloadSpec, corpus: TokenCorpus, tenant_id: str = "default",
                      api_key: str | None = None) -> list[WorkloadRequest]:
    """The seeded request list for `spec` (same spec, same tokenizer -> same requests)."""
    spec.validate()
    return with_adapters(_generate(spec, corpus, tenant_id, api_key), spec)


def _generate(spec: WorkloadSpec, corpus: TokenCorpus, tenant_id: str, api_key: str | None) -> list[WorkloadRequest]:
    if spec.kind == "trace":
        return trace_to_workload(read_trace(spec.trace_path), corpus, seed=spec.seed, scale=spec.scale)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    outputs = spec.output.scaled(spec.scale).sample(rng, n)
    if spec.stop:  # the text ends each output; every request asks for the same ceiling
        outputs = np.full(n, spec.max_tokens)
    families: list[int | None] = [None] * n
    prefixes: list[tuple[int, ...]] = [()] * n
    if spec.kind == "shared_prefix":
        family_prefixes = [corpus.sample_prompt(max(1, round(spec.prefix_tokens * spec.scale)), rng)[0]
                           for _ in range(spec.num_families)]
        families = [int(f) for f in rng.integers(0, spec.num_families, size=n)]
        prefixes = [family_prefixes[f] for f in families]
    inputs = spec.input.scaled(spec.scale).sample(rng, n)
    if spec.kind == "long_short":
        is_long = rng.random(n) < spec.long_fraction
        inputs = np.where(is_long, spec.long_input.scaled(spec.scale).sample(rng, n), inputs)
    cancel_points = _cancel_points(rng, outputs, spec.cancel_fraction)
    constraints = read_constraints(spec.constraints_path) if spec.constraints_path else ()
    requests = []
    for i in range(n):
        ids, text = corpus.sample_prompt(int(inputs[i]), rng, prefix_ids=prefixes[i])
        requests.append(WorkloadRequest(index=i, prompt_token_ids=ids, prompt_text=text,
                                        output_tokens=int(outputs[i]), tenant_id=tenant_id, api_key=api_key,
                                        family=families[i], cancel_after_tokens=cancel_points[i],
                                        stop=tuple(spec.stop),
                                        structured=constraints[i % len(constraints)] if constraints else None))
    return requests


def _cancel_points(rng: np.random.Generator, outputs: np.ndarray, fraction: float) -> list[int | None]:
    """For a `fraction` of requests, the number of output tokens after which the client
    cancels: uniform in [1, output-1], so the request is cut mid-stream (requests of one
    output token cannot be cut and are never chosen)."""
    chosen = rng.random(len(outputs)) < fraction
    points = [int(rng.integers(1, o)) if o >= 2 else None for o in outputs]
    return [p if c else None for p, c in zip(points, chosen)]


def trace_to_workload(records: list[TraceRecord], corpus: TokenCorpus, seed: int = 0,
                      scale: float = 1.0) -> list[WorkloadRequest]:
    """Trace records -> requests; length-only prompts are cut from the corpus (seeded).
    `scale` multiplies length-only prompts and output lengths, never given texts or ids."""
    rng = np.random.default_rng(seed)
    out = []
    for i, rec in enumerate(records):
        if rec.prompt_token_ids is not None:
            ids, text = rec.prompt_token_ids, corpus.decode(rec.prompt_token_ids)
        elif rec.prompt is not None:
            ids, text = tuple(corpus.encode(rec.prompt)), rec.prompt
        else:
            ids, text = corpus.sample_prompt(max(1, round(rec.prompt_tokens * scale)), rng)
        out.append(WorkloadRequest(index=i, prompt_token_ids=tuple(ids), prompt_text=text,
                                   output_tokens=max(1, round(rec.output_tokens * scale)), tenant_id=rec.tenant,
                                   api_key=rec.api_key, family=rec.family,
                                   cancel_after_tokens=rec.cancel_after_tokens, arrival_offset_s=rec.arrival_s,
                                   adapter=rec.adapter))
    return out
