"""The structs Python hands the CPU kernels, defined once for ctypes and for C.

Each struct is a list of (field, C type); the ctypes class is built from it here and the C
typedef is generated from it into worker/kernels/cpu/kvmesh_cpu.h (between its GENERATED ABI
markers). The build refuses a header whose block differs from `c_declarations()`, so the two
sides cannot drift; `python -m kvmesh.worker.kernels.cpu_abi` rewrites the block after a change
here. Pointers travel as integers (tensor.data_ptr()), so every pointer field is a c_void_p.
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

HEADER = Path(__file__).parent / "cpu" / "kvmesh_cpu.h"
_BEGIN = "/* BEGIN GENERATED ABI"
_END = "/* END GENERATED ABI */"
_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _ctype(c_type: str):
    return ctypes.c_void_p if c_type.endswith("*") else _SCALARS[c_type]


class _CStruct(ctypes.Structure):
    c_name = ""
    c_doc = ""
    c_fields: tuple[tuple[str, str], ...] = ()

    @classmethod
    def c_typedef(cls) -> str:
        body = "".join(f"    {c_type}{'' if c_type.endswith('*') else ' '}{name};\n" for name, c_type in cls.c_fields)
        return f"/* {cls.c_doc} */\ntypedef struct {{\n{body}}} {cls.c_name};\n"


def _struct(name: str, c_name: str, doc: str, fields: tuple[tuple[str, str], ...]) -> type[_CStruct]:
    return type(name, (_CStruct,), {"c_name": c_name, "c_doc": doc, "c_fields": fields,
                                    "_fields_": [(f, _ctype(t)) for f, t in fields]})


LayerDescriptor = _struct("LayerDescriptor", "kvmesh_layer", (
    "One decoder layer: norms, the four projections (weight, per-row scales for int8 or NULL,\n"
    "   the AMX-packed copy or NULL), its K/V cache; int4 projections: the weight is the packed\n"
    "   codes [N][K/2], scales / zeros / mins (mins NULL where none) [N][K/group], the packed\n"
    "   field the kernels' metadata made at load or NULL (kvmesh_int4.meta)."), (
    ("input_norm", "const void *"), ("post_attention_norm", "const void *"),
    ("qkv_weight", "const void *"), ("qkv_scales", "const void *"),
    ("o_weight", "const void *"), ("o_scales", "const void *"),
    ("gate_up_weight", "const void *"), ("gate_up_scales", "const void *"),
    ("down_weight", "const void *"), ("down_scales", "const void *"),
    ("key_cache", "void *"), ("value_cache", "void *"),
    ("qkv_packed", "const void *"), ("o_packed", "const void *"),
    ("gate_up_packed", "const void *"), ("down_packed", "const void *"),
    ("qkv_zeros", "const void *"), ("qkv_mins", "const void *"), ("o_zeros", "const void *"),
    ("o_mins", "const void *"), ("gate_up_zeros", "const void *"), ("gate_up_mins", "const void *"),
    ("down_zeros", "const void *"), ("down_mins", "const void *")))

ModelDescriptor = _struct("ModelDescriptor", "kvmesh_model", (
    "The model the native step runs, built once at load (cpu_native_step.NativeDecoder.build)."), (
    ("num_layers", "int64_t"), ("hidden", "int64_t"), ("intermediate", "int64_t"),
    ("num_q_heads", "int64_t"), ("num_kv_heads", "int64_t"), ("head_dim", "int64_t"),
    ("weight_kind", "int64_t"), ("bf16", "int64_t"),
    ("block_size", "int64_t"),  # K/V cache [num_blocks, block_size, Hkv, D], strides in elements:
    ("cache_block_stride", "int64_t"), ("cache_slot_stride", "int64_t"), ("cache_head_stride", "int64_t"),
    ("vocab", "int64_t"), ("lm_head_kind", "int64_t"), ("int8_activations", "int64_t"),
    ("int4_factored", "int64_t"),  # fp32-activation int4 layers in kvmesh_gemv_int4's INT4_FACTORED form
    ("int4_group", "int64_t"),  # int4 layers: inputs per scale / zero / min, a multiple of 32
    ("int4_scale_dtype", "int64_t"), ("int4_zero_dtype", "int64_t"), ("int4_min_dtype", "int64_t"),  # META_*
    # int4 layers' codes in 8-row panels (int4_panels.c; int8_activations only)
    ("int4_interleaved", "int64_t"),
    # a bf16 model's int4 layers and Q8_0 LM head dequantized to bf16 a 4-row group at a time,
    # VDPBF16PS products (kvmesh_gemv_int4_bf16: the bf16 model's sums at the int4 bytes)
    ("int4_bf16", "int64_t"),
    ("rms_norm_eps", "float"),
    ("embed", "const void *"),  # [V, H] in the model dtype, or int8 codes when embed_scales is set
    ("embed_scales", "const float *"),  # an int8 table's fp32 scales, one a 32-input group (GGUF Q8_0), or NULL
    ("final_norm", "const void *"),
    ("rope_cos", "const float *"), ("rope_sin", "const float *"),  # [max positions, D] fp32
    ("lm_head_weight", "const void *"), ("lm_head_scales", "const void *"), ("lm_head_packed", "const void *"),
    ("layers", "const kvmesh_layer *")))

StepBatch = _struct("StepBatch", "kvmesh_step_batch", (
    "One step of num_tokens tokens: token b is fed at positions[b] into KV slot slots[b] and\n"
    "   attends over the first seq_lens[b] tokens of its request through its block table (row b of\n"
    "   block_tables, block_table_width entries); logits [num_samples, vocab] for the tokens\n"
    "   sample_rows[0 .. num_samples). rows = 0 .. num_tokens - 1."), (
    ("num_tokens", "int64_t"), ("tokens", "const int64_t *"), ("positions", "const int64_t *"),
    ("slots", "const int64_t *"), ("block_tables", "const int32_t *"), ("block_table_width", "int64_t"),
    ("seq_lens", "const int32_t *"), ("rows", "const int64_t *"), ("sample_rows", "const int64_t *"),
    ("num_samples", "int64_t"), ("num_threads", "int64_t"), ("logits", "float *")))

STRUCTS = (LayerDescriptor, ModelDescriptor, StepBatch)

# The constants both sides read, as C enums: (comment, {name: value})
# W_I8G: int8 codes with one fp32 scale a 32-input group, the LM head only (a GGUF Q8_0 table)
WEIGHT_KINDS = {"W_F32": 0, "W_BF16": 1, "W_I8": 2, "W_I4": 3, "W_I8G": 4}
META_DTYPES = {"META_F32": 0, "META_BF16": 1, "META_F16": 2}  # int4 scales / zeros / mins as stored
STEP_ANSWERS = {"KVMESH_STEP_OK": 0, "KVMESH_STEP_NO_MEMORY": 1, "KVMESH_STEP_NOT_BUILT": 2}
FEATURES = {"KVMESH_FEATURE_DPBF16": 1,  # bf16 projections by VDPBF16PS
            "KVMESH_FEATURE_AMX": 2,  # ... by AMX tiles (the tile state granted)
            "KVMESH_FEATURE_AMX_INT8": 4,  # int8 x int8 AMX products (the self-draft's)
            "KVMESH_FEATURE_NATIVE_STEP": 8,  # the native step itself (every build)
            "KVMESH_FEATURE_AVX512": 16}  # its fp32 / bf16 / int8 projections in AVX-512
ENUMS = (("kvmesh_model.weight_kind and lm_head_kind", WEIGHT_KINDS),
         ("kvmesh_model.int4_*_dtype", META_DTYPES), ("kvmesh_native_step's answers", STEP_ANSWERS),
         ("kvmesh_cpu_features() bits", FEATURES))


def c_declarations() -> str:
    """The header's generated block, markers included."""
    intro = (f"{_BEGIN}: worker/kernels/cpu_abi.py defines these structs and constants for\n"
             "   ctypes and C at once; `python -m kvmesh.worker.kernels.cpu_abi` rewrites this block. Do not\n"
             "   edit by hand. */\n")
    enums = "".join(f"\n/* {doc} */\nenum {{ {', '.join(f'{k} = {v}' for k, v in values.items())} }};\n"
                    for doc, values in ENUMS)
    return intro + "".join("\n" + s.c_typedef() for s in STRUCTS) + enums + "\n" + _END


def _block_pattern() -> re.Pattern:
    return re.compile(re.escape(_BEGIN) + r".*?" + re.escape(_END), re.S)


def header_block(header_text: str) -> str | None:
    found = _block_pattern().search(header_text)
    return None if found is None else found.group(0)


def rewrite_header(path: Path = HEADER) -> bool:
    """Puts the current declarations into the header; True when it changed."""
    text = path.read_text()
    if header_block(text) is None:
        raise ValueError(f"{path} has no GENERATED ABI block")
    updated = _block_pattern().sub(lambda _: c_declarations(), text)
    if updated != text:
        path.write_text(updated)
    return updated != text


if __name__ == "__main__":
    print(f"{HEADER}: {'rewritten' if rewrite_header() else 'already current'}")
    sys.exit(0)
