"""Token-exact greedy outputs against HF transformers on the real SmolLM2 weights.

Eight prompts of mixed lengths are served together in one continuous batch, with chunked
prefill forced small (16 tokens per step) and a block pool small enough that decodes must
preempt (the KV budget is over-committed on purpose so admission lets them all in). Every
request must still produce exactly HF `generate`'s greedy tokens, with the torch reference
attention backend and with the CPU fast path (worker/attention/cpu_backend.py), both eager, which
are therefore token-identical to each other, and with the CPU default, the native step.
"""

import os

import pytest
import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.kernels import cpu_native_step

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
    "dragons, castles and the stars. Every night she would",
    "List three primary colors:",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves "
    "the green pigment chlorophyll and generates oxygen as a byproduct. The main stages are",
    "1, 2, 3, 4, 5,",
    "Translate to French: 'Good morning, how are you today?'",
]
# gpu_check runs it with triton; on CPU both the reference and the fast path are checked
BACKENDS = [os.environ["KVMESH_TEST_ATTENTION_BACKEND"]] if "KVMESH_TEST_ATTENTION_BACKEND" in os.environ \
    else ["torch", "cpu"]


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def _run_engine(smollm2_dir, backend, native: int | None = None, **sched):
    """smollm2_dir None: the embedded GGUF itself (its Q4_1 file), not its HF folder."""
    device = "cuda" if backend == "triton" else "cpu"
    config = KvmeshConfig.from_dict({
        "model": {"path": smollm2_dir, "dtype": "fp32", "cpu_native_max_tokens": native},
        "cache": {"num_blocks": 12, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600, **sched},
        "parallel": {"attention_backend": backend, "device": device},
    })
    engine = Engine.from_config(config)
    if native is None and device == "cpu":  # the default: the native step where this CPU builds it
        assert engine.runner.cpu_step.numerics == "fp32, token-exact", engine.runner.cpu_step.describe()
        # quant.weight auto: the GGUF's own int4 for the .gguf file, fp32 for the HF folder
        assert engine.parts.weight_quant == ("gguf" if smollm2_dir is None else "none")
        fp32_path = "fma" if cpu_native_step.avx512_build() else "avx2"  # chosen by the CPU's build
        assert engine.runner.cpu_step.path == ("int4_avx2" if smollm2_dir is None else fp32_path), \
            engine.runner.cpu_step.describe()
        if smollm2_dir is None:
            _token_table_is_kept_as_its_q8_0_groups(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{i}", prompt=prompt,
                                           sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    max_running = 0
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        engine.check_integrity()
        max_running = max(max_running, engine.scheduler.stats().num_running)
    stats = engine.stats()
    assert stats.num_blocks_used == 0, "every finished request returns its blocks"
    if native is None and device == "cpu":
        assert engine.runner.native_decoder.steps_run >= NEW_TOKENS, "the native step served the decode steps"
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))], stats, max_running


def _token_table_is_kept_as_its_q8_0_groups(engine) -> None:
    """The embedded file's Q8_0 token table (embedding and tied head) is held once, as its int8
    codes and scales: no float copy of it, in the model or in the native step's own tensors."""
    from kvmesh.quant.int8_group_table import Int8GroupEmbedding, Int8GroupLMHead

    model, decoder = engine.runner.model, engine.runner.native_decoder
    table = model.model.embed_tokens
    assert isinstance(table, Int8GroupEmbedding) and isinstance(model.lm_head, Int8GroupLMHead)
    assert model.lm_head.table is table and table.codes.dtype == torch.int8
    vocab_by_hidden = table.codes.numel()
    held = [*model.parameters(), *model.buffers(), *decoder._description.keep]
    copies = [tuple(t.shape) for t in held if t.is_floating_point() and t.numel() >= vocab_by_hidden]
    assert not copies, f"a float copy of the token table is resident: {copies}"
    assert decoder.head_q8_0 and decoder.int8_head_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_hf_under_chunking_and_preemption(smollm2_dir, hf_reference, mode, backend):
    # native 0: every step through the eager forward and this attention backend (the reference)
    ours, stats, max_running = _run_engine(smollm2_dir, backend, native=0, preemption_mode=mode)
    assert max_running >= 4, "the prompts must really share a continuous batch"
    preemptions = stats.num_preemptions_recompute + stats.num_preemptions_swap
    assert preemptions > 0, "the small pool must force preemption"
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
    for i, (got, want) in enumerate(zip(ours, hf_reference)):
        assert got == want, f"prompt {i} diverged from HF at token {next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"


@pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None,
                    reason=f"no native CPU step here: {cpu_native_step.unavailable_reason()}")
@pytest.mark.parametrize("source", ["hf_folder", "gguf"])
def test_the_native_cpu_step_in_fp32_equals_hf(smollm2_dir, hf_reference, source):
    """The default on CPU for fp32 (model.cpu_native_max_tokens auto): the native step (AVX2 or
    AVX-512 build, whichever this CPU runs) on the real weights, decode batches and 16-token
    prefill chunks as one C call each, preemption by recompute, the same greedy tokens as HF.
    hf_folder: the converted folder, fp32 GEMVs; gguf: the embedded model as `kvmesh serve`
    starts it, every setting its default (quant.weight auto: its Q4_1 layers kept, each weight
    dequantized in registers; the Q8_0 head read as its int8 groups). HF's reference is
    transformers' load of the same GGUF (dequantized to fp32), so both must give its tokens."""
    ours, stats, _ = _run_engine(smollm2_dir if source == "hf_folder" else None, "cpu", native=None,
                                 preemption_mode="recompute")
    assert stats.num_preemptions_recompute > 0
    for i, (got, want) in enumerate(zip(ours, hf_reference)):
        assert got == want, f"prompt {i} diverged from HF at token {next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
