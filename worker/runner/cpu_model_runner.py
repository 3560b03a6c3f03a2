"""The CPU model runner: small steps as ONE native call where the native step takes the model
(worker/kernels/cpu_native_step.py), every other step eagerly (ModelRunner), on one KV cache.

As vLLM keeps cpu_model_runner beside its GPU runner, the choice between the two forwards is
made here, once, at construction, and kept as `cpu_step` (the worker's start line and the
`kvmesh_model_info` metric report it):

    path         what runs the steps of <= max_tokens tokens
    amx          the native step, projections by AMX tiles
    avx512_bf16  the native step, bf16 projections by VDPBF16PS
    fma          the native step, projections by AVX-512 FMAs (fp32, int8, or bf16 without AVX512_BF16)
    avx2         the native step, projections by AVX2 FMAs (the avx2 build: fp32, bf16, int8)
    int4_avx2    the native step, int4 groups with fp32 activations, each weight dequantized in
                 registers exactly as the eager layer does (AVX2 in any build): what int4
                 models run by default (quant.int4_activations fp32: token-exact)
    int4_avx2_a8 the same with int8 activations per 32-input block (llama.cpp's Q4 x Q8
                 scheme; quant.int4_activations int8): the fastest mode, not token-exact
    int4_avx512_bf16  a bf16 model's int4 layers (e.g. quant.weight gguf, model.dtype bf16) on a
                 CPU with VDPBF16PS: each 4-row group dequantized to the bf16 values of the model
                 dequantized at load, then VDPBF16PS as its bf16 weights (the same logits, bit
                 for bit, from the int4 bytes; a Q8_0 head alike)
    torch        no native step: every step eager; `reason` says why (fp32 float models by
                 default, what the step does not implement, no kernels)

model.cpu_native_max_tokens: auto (None) is steps of up to 64 tokens with AMX, every step up to the
scheduler's budget on a CPU with VDPBF16PS and no AMX (Zen 4: bf16 models' bf16 and int4 weights;
prompt chunks of long attention run eagerly), else 12 tokens a thread up to 24, for 16-bit models
and fp32 int8 models; fp32 float weights 12 a thread up to
24 (fp32 GEMVs on any CPU; token-exact); 64 for fp32 int4 models (eager dequantizes every call);
0 = every step eager. `numerics` says what the step's sums are (numerics_of): the start line and
kvmesh_model_info carry it beside the path.
The self-draft (worker/engine_loop/self_draft.py) asks for the auto size whatever its dtype, and
int8 x int8 AMX products for its int8 layers: only its acceptance can change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.worker.attention.backend import AttentionBackend, LayerKVCache
from kvmesh.worker.kernels import cpu_native_step
from kvmesh.worker.runner.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuStepPath:
    """What serves a CPU runner's small steps (see the module doc)."""

    path: str  # amx | avx512_bf16 | fma | avx2 | int4_avx2_a8 | int4_avx2 | int4_avx512_bf16 | torch
    reason: str = ""  # why torch; empty otherwise
    max_tokens: int = 0  # the largest step the native step takes (0: torch)
    variant: str = ""  # the CPU kernels' build the native step runs (worker/kernels/cpu_build.py)
    numerics: str = ""  # its sums against the eager forward (see numerics_of)

    def describe(self) -> str:
        if self.path == "torch":
            return f"torch ({self.reason})"
        return f"{self.path} (the {self.variant} build, steps of <= {self.max_tokens} tokens, {self.numerics})"


def numerics_of(decoder: cpu_native_step.NativeDecoder, dtype: torch.dtype) -> str:
    """What the native step's sums are against the eager forward: in an fp32 model with fp32
    activations the same up to the order of fp32 sums (greedy tokens those of HF transformers
    in fp32, and of a GGUF as HF dequantizes it: tests/test_engine_exact.py); int8 activations
    are llama.cpp's Q4 x Q8 scheme (logits within ~5 %); a 16-bit model's step keeps fp32
    activations where eager rounds each op's output to the model dtype."""
    if decoder.path == "int4_avx2_a8" or decoder.int8_amx:
        return "int8 activations, not token-exact"
    if dtype != torch.float32:
        return f"{str(dtype).removeprefix('torch.')} model" + (", bf16 inputs" if decoder.path in ("amx", "avx512_bf16", "int4_avx512_bf16")
                                                               else ", fp32 activations")
    return "fp32, token-exact"


class CpuModelRunner(ModelRunner):
    def __init__(self, model, backend: AttentionBackend, kv_caches: list[LayerKVCache],
                 swap_caches: list[LayerKVCache] | None, block_size: int, seed: int = 0,
                 native_max_tokens: int | None = None, self_draft: bool = False,
                 int4_int8_activations: bool = False, max_step_tokens: int = cpu_native_step.CPU_NATIVE_MAX_TOKENS):
        """native_max_tokens: model.cpu_native_max_tokens (None = auto); self_draft: the
        self-draft's runner (auto size whatever the dtype, int8 activations);
        int4_int8_activations: quant.int4_activations int8 (else int4 layers are exact);
        max_step_tokens: scheduler.max_num_batched_tokens (the largest step auto may take)."""
        super().__init__(model, backend, torch.device("cpu"), kv_caches, swap_caches, block_size, seed=seed)
        self.native_decoder: cpu_native_step.NativeDecoder | None = None
        self.cpu_step = self._choose(native_max_tokens, self_draft, int4_int8_activations, max_step_tokens)

    def _choose(self, configured: int | None, self_draft: bool, int4_int8_activations: bool,
                max_step_tokens: int) -> CpuStepPath:
        what = "the self-draft" if self_draft else "the model"
        threads = torch.get_num_threads()
        dtype = next(self.model.parameters()).dtype
        quantized = cpu_native_step.quantized_weights(self.model)
        if self_draft:
            max_tokens = configured if configured is not None else cpu_native_step.auto_max_tokens(threads)
        else:
            max_tokens = cpu_native_step.max_tokens_for(configured, dtype, threads, quantized,
                                                        quantized == "int4" and int4_int8_activations, max_step_tokens)
        if not max_tokens:
            reason = "model.cpu_native_max_tokens 0"
            logger.info("CPU step for %s: torch (%s)", what, reason)
            return CpuStepPath("torch", reason)
        try:
            # quant.int4_activations int8: int4 layers take int8 activations (per 32-input block)
            # as llama.cpp's Q4 x Q8 dot products do (the fastest mode, not token-exact); the
            # self-draft always does (only its acceptance can change)
            int8 = self_draft or (quantized == "int4" and int4_int8_activations)
            decoder = cpu_native_step.NativeDecoder.build(self.model, self.kv_caches, max_tokens, int8_activations=int8)
        except cpu_native_step.NotTaken as why:
            logger.warning("native step not taken for %s (%s): eager forward", what, why)
            return CpuStepPath("torch", str(why))
        self.native_decoder = decoder
        logger.info("native step on for %s, steps of <= %d tokens, projections by %s (%s build, %s)%s%s%s", what,
                    max_tokens, decoder.path, decoder.variant, numerics_of(decoder, dtype),
                    f", {decoder.amx_packed_bytes / 2**20:.0f} MiB of weights re-laid for its tiles"
                    if decoder.amx_packed_bytes else "",
                    f", the LM head as an int8 copy ({decoder.int8_head_bytes / 2**20:.0f} MiB"
                    f"{', its exact Q8_0 groups' if decoder.head_q8_0 else ''})"
                    if decoder.int8_head_bytes else
                    ", the LM head read in place as the model's Q8_0 table" if decoder.head_q8_0 else "",
                    ", int8 projections as int8 x int8 AMX products" if decoder.int8_amx else "")
        return CpuStepPath(decoder.path, "", max_tokens, decoder.variant, numerics_of(decoder, dtype))

    @property
    def native_max_tokens(self) -> int:
        return self.native_decoder.max_tokens if self.native_decoder is not None else 0

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Steps the native decoder takes (<= max_tokens tokens, no LoRA adapter rows) as one
        native call; the rest eagerly (ModelRunner.forward)."""
        if self.native_decoder is not None and not inputs.lora_slots:
            logits = self.native_decoder.run(inputs)
            if logits is not None:
                return logits if inputs.sample_at else None
            if len(inputs.input_ids) <= self.native_decoder.max_tokens:  # refused for its prompt attention
                self.eager_step_reasons["prefill_attention"] += 1
        return super().forward(inputs)
