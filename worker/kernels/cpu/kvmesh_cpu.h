/* The CPU kernels' one header: the structs Python passes (generated), the element helpers
   every kernel shares, and the entry points.

   Built by worker/kernels/cpu_build.py into one shared library per instruction set (avx2,
   avx512, avx512_bf16, amx: the same sources, different -m flags), loaded through ctypes.
   Every variant has AVX2 + FMA + F16C (the native step with AVX2 projections, int4 in every
   variant); the code below __AVX512F__ / __AVX512BF16__ / __AMX_TILE__ guards is what a
   variant adds. */
#ifndef KVMESH_CPU_H
#define KVMESH_CPU_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

/* Symbols one source file calls in another, not part of the library's interface. */
#define KVMESH_INTERNAL __attribute__((visibility("hidden")))

/* BEGIN GENERATED ABI: worker/kernels/cpu_abi.py defines these structs and constants for
   ctypes and C at once; `python -m kvmesh.worker.kernels.cpu_abi` rewrites this block. Do not
   edit by hand. */

/* One decoder layer: norms, the four projections (weight, per-row scales for int8 or NULL,
   the AMX-packed copy or NULL), its K/V cache; int4 projections: the weight is the packed
   codes [N][K/2], scales / zeros / mins (mins NULL where none) [N][K/group], the packed
   field the kernels' metadata made at load or NULL (kvmesh_int4.meta). */
typedef struct {
    const void *input_norm;
    const void *post_attention_norm;
    const void *qkv_weight;
    const void *qkv_scales;
    const void *o_weight;
    const void *o_scales;
    const void *gate_up_weight;
    const void *gate_up_scales;
    const void *down_weight;
    const void *down_scales;
    void *key_cache;
    void *value_cache;
    const void *qkv_packed;
    const void *o_packed;
    const void *gate_up_packed;
    const void *down_packed;
    const void *qkv_zeros;
    const void *qkv_mins;
    const void *o_zeros;
    const void *o_mins;
    const void *gate_up_zeros;
    const void *gate_up_mins;
    const void *down_zeros;
    const void *down_mins;
} kvmesh_layer;

/* The model the native step runs, built once at load (cpu_native_step.NativeDecoder.build). */
typedef struct {
    int64_t num_layers;
    int64_t hidden;
    int64_t intermediate;
    int64_t num_q_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t weight_kind;
    int64_t bf16;
    int64_t block_size;
    int64_t cache_block_stride;
    int64_t cache_slot_stride;
    int64_t cache_head_stride;
    int64_t vocab;
    int64_t lm_head_kind;
    int64_t int8_activations;
    int64_t int4_factored;
    int64_t int4_group;
    int64_t int4_scale_dtype;
    int64_t int4_zero_dtype;
    int64_t int4_min_dtype;
    int64_t int4_interleaved;
    int64_t int4_bf16;
    float rms_norm_eps;
    const void *embed;
    const float *embed_scales;
    const void *final_norm;
    const float *rope_cos;
    const float *rope_sin;
    const void *lm_head_weight;
    const void *lm_head_scales;
    const void *lm_head_packed;
    const kvmesh_layer *layers;
} kvmesh_model;

/* One step of num_tokens tokens: token b is fed at positions[b] into KV slot slots[b] and
   attends over the first seq_lens[b] tokens of its request through its block table (row b of
   block_tables, block_table_width entries); logits [num_samples, vocab] for the tokens
   sample_rows[0 .. num_samples). rows = 0 .. num_tokens - 1. */
typedef struct {
    int64_t num_tokens;
    const int64_t *tokens;
    const int64_t *positions;
    const int64_t *slots;
    const int32_t *block_tables;
    int64_t block_table_width;
    const int32_t *seq_lens;
    const int64_t *rows;
    const int64_t *sample_rows;
    int64_t num_samples;
    int64_t num_threads;
    float *logits;
} kvmesh_step_batch;

/* kvmesh_model.weight_kind and lm_head_kind */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3, W_I8G = 4 };

/* kvmesh_model.int4_*_dtype */
enum { META_F32 = 0, META_BF16 = 1, META_F16 = 2 };

/* kvmesh_native_step's answers */
enum { KVMESH_STEP_OK = 0, KVMESH_STEP_NO_MEMORY = 1, KVMESH_STEP_NOT_BUILT = 2 };

/* kvmesh_cpu_features() bits */
enum { KVMESH_FEATURE_DPBF16 = 1, KVMESH_FEATURE_AMX = 2, KVMESH_FEATURE_AMX_INT8 = 4, KVMESH_FEATURE_NATIVE_STEP = 8, KVMESH_FEATURE_AVX512 = 16 };

/* END GENERATED ABI */

typedef union { uint32_t u; float f; } bits32;

static inline float load_elem(const void *p, int64_t i, const int bf16) {
    if (bf16) { bits32 v; v.u = (uint32_t)((const uint16_t *)p)[i] << 16; return v.f; }
    return ((const float *)p)[i];
}

static inline void store_elem(void *p, int64_t i, float x, const int bf16) {
    if (bf16) {  /* round to nearest even, NaN -> 0x7fc0: c10::BFloat16's conversion */
        bits32 v; v.f = x;
        uint16_t h = (v.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0
                     : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
        ((uint16_t *)p)[i] = h;
    } else {
        ((float *)p)[i] = x;
    }
}

/* exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial, ~2 ulp; vectorisable
   (the rounding is the float add of 1.5 * 2^23, no library call). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = x * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 s; s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

static inline float round_bf16(float x) {
    bits32 v; v.f = x; v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u; return v.f;
}

static inline int64_t w_elem_size(const int kind) { return kind == W_I8 ? 1 : kind == W_BF16 ? 2 : 4; }

#ifdef __AVX512F__
/* 16 elements from p + i widened to fp32 (bf16 by a shift). */
static inline __m512 load16(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

/* paged_attention.c: out[q_rows[i]] = attention of q[q_rows[i]] over request reqs[i]'s cached
   context, rows [begin, end) of the list; strides in elements. 0 = ok, 1 = no memory. */
#define KVMESH_PAGED_DECODE_ARGS \
    const void *q, int64_t q_rs, int64_t q_hs, const void *kc, const void *vc, int64_t c_bs, int64_t c_ss, \
    int64_t c_hs, const int32_t *tables, int64_t t_rs, const int32_t *seq_lens, const int64_t *q_rows, \
    const int64_t *reqs, int64_t begin, int64_t end, void *out, int64_t o_rs, int64_t o_hs, int64_t hq, \
    int64_t hkv, int64_t d, int64_t block_size, float scale
int kvmesh_paged_decode_f32(KVMESH_PAGED_DECODE_ARGS);
int kvmesh_paged_decode_bf16(KVMESH_PAGED_DECODE_ARGS);

/* projections.c: y[b * ldy + n] = W[n] . x[b] (times the row's scale for int8) for n in
   [n0, n1), b < B, by the fastest path this build and the weight kind have (see there). */
KVMESH_INTERNAL void kvmesh_gemv(const void *w, const void *wp, const int kind, const void *scale, const int sbf16,
                                 int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y,
                                 int64_t ldy, uint16_t *x16, const int x_ready, const int a8);
/* The same for fp32 / bf16 / int8 weights in AVX2 + FMA (projections_avx2.c): the avx2 build's path. */
KVMESH_INTERNAL void kvmesh_gemv_avx2(const void *w, const int kind, const void *scale, const int sbf16, int64_t K,
                                      int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y,
                                      int64_t ldy);

/* One int4 projection as stored: codes [N][K/2] (input k in the low nibble of byte k/2 when k is
   even, the high one when odd), scales / zeros / mins [N][K/group] (mins NULL: none), each
   in its META_* dtype; weight = (code - zero) * scale + min. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *zeros, *mins;
    int64_t group;
    int scale_dtype, zero_dtype, min_dtype;
    int interleaved;  /* codes in 8-row panels (int4_panels.c), every row of the projection */
    /* NULL, or the plain rows' metadata as the fp32-activation kernels use it, made at load
       (cpu_native_step.int4_kernel_meta): row n's group scales then offsets, meta[n * 2G + g]
       and meta[n * 2G + G + g], as int4_fma_meta computes them a call */
    const float *meta;
} kvmesh_int4;

/* The sum of a vector's 8 lanes (the per-row and the batched AVX2 kernels' dot products). */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One int4 metadata value (scale / zero / min, a META_* dtype) as fp32; eight from i on. */
static inline float load_meta(const void *p, int64_t i, const int dtype) {
    if (dtype == META_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return load_elem(p, i, dtype == META_BF16);
}

static inline __m256 load8_meta(const void *p, int64_t i, const int dtype) {
    if (dtype == META_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dtype == META_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* The int4 projection's rows [row0, ...) as a projection of its own (gate / up halves). */
static inline kvmesh_int4 int4_rows(kvmesh_int4 p, int64_t row0, int64_t K) {
    static const int64_t meta_size[] = {4, 2, 2};  /* META_F32, META_BF16, META_F16 */
    const int64_t groups = K / p.group;
    p.codes += row0 * (K / 2);
    p.scales = (const char *)p.scales + row0 * groups * meta_size[p.scale_dtype];
    p.zeros = (const char *)p.zeros + row0 * groups * meta_size[p.zero_dtype];
    if (p.mins) p.mins = (const char *)p.mins + row0 * groups * meta_size[p.min_dtype];
    if (p.meta) p.meta += row0 * 2 * groups;
    return p;
}

/* kvmesh_gemv_int4's forms: INT4_EXACT each weight dequantized in registers exactly as
   quant/primitives.dequantize_int4_groupwise computes it, fp32 activations; INT4_FACTORED fp32
   activations, each group's sum of code x input times its scale (the same weights, fp32 sums
   rounded in another order); INT4_A8 activations quantized to int8 per 32-input block and
   int8 x u4 products (llama.cpp's Q4_1 x Q8_1 scheme). */
enum { INT4_EXACT = 0, INT4_A8 = 1, INT4_FACTORED = 2 };

/* projections_avx2.c: y[b * ldy + n] = W[n] . x[b] for the int4 projection p, n in [n0, n1), in
   one of the forms above. Every variant. */
KVMESH_INTERNAL void kvmesh_gemv_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                      int64_t ldx, int64_t B, float *y, int64_t ldy, const int form);

/* projections.c: the same products for int4 weights and for int8 codes with one fp32 scale a
   32-input group (a GGUF Q8_0 LM head) with bf16 products: each 4-row group dequantized to the
   bf16 values of the model's float copy, then VDPBF16PS as bf16 weights (the bf16 model's sums bit
   for bit); x16 and x_ready as kvmesh_gemv's. 0 in builds without VDPBF16PS (nothing written). */
KVMESH_INTERNAL int kvmesh_gemv_int4_bf16(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                          int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16,
                                          const int x_ready);
KVMESH_INTERNAL int kvmesh_gemv_i8g_bf16(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1,
                                         const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16,
                                         const int x_ready);
/* 1 where this build has them. */
KVMESH_INTERNAL int kvmesh_bf16_products(void);
/* An int4 projection's rows [0, N) (the kvmesh_int4 fields, plain rows) dequantized to those bf16
   values, out [N][K], over `threads` OpenMP threads: the eager layer's weight in that mode
   (quant/linear.py, bf16_dense). 0 where not done: no VDPBF16PS build, K or the group not
   multiples of 32. */
int kvmesh_int4_to_bf16(const uint8_t *codes, const void *scales, const void *zeros, const void *mins, int64_t group,
                        int64_t scale_dtype, int64_t zero_dtype, int64_t min_dtype, int64_t N, int64_t K, uint16_t *out,
                        int64_t threads);
/* The same for int8 codes [N][K] with fp32 scales [N][K/32] (a Q8_0 head's rows: code * scale):
   the eager head's weight in that mode (quant/int8_group_table.py). 0 where not done (no
   VDPBF16PS build, K not a multiple of 32). */
int kvmesh_i8g_to_bf16(const int8_t *codes, const float *scales, int64_t N, int64_t K, uint16_t *out,
                       int64_t threads);

/* Tokens' rows quantized to int8 per 32-input block (projections_avx2.c, kvmesh_int8_rows):
   q [B][K] each block's 16 even inputs then its 16 odd ones (the order of a block's low and
   high nibbles), scale [B][K/32] (x ~ q * scale), sum [B][K/32] the fp32 inputs' sum, qsum8
   [B][K/32] 8 x the sum of q (what centring the codes at 8 takes off the int8 products), meta:
   room for the per-row kernel's row metadata. In a per-thread buffer; all NULL: no memory.
   input_order: q in the inputs' own order instead (int8 codes: the LM head's Q8_0 table). */
typedef struct {
    int8_t *q;
    float *scale;
    float *sum;
    int32_t *qsum8;
    float *meta;  /* [2 + 8][K / 32] */
} Int8Rows;
KVMESH_INTERNAL Int8Rows kvmesh_int8_rows(const float *x, int64_t ldx, int64_t B, int64_t K, const int input_order);

/* int4_panels.c: kvmesh_gemv_int4's INT4_A8 form over codes in 8-row panels, n0 and n1
   multiples of 8; 0 where there was no memory (nothing written). */
KVMESH_INTERNAL int kvmesh_gemv_int4_panels(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                            int64_t ldx, int64_t B, float *y, int64_t ldy);
/* The same weights in fp32, one code at a time: panels where the int8 rows found no memory. */
KVMESH_INTERNAL void kvmesh_gemv_int4_panels_fp32(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1,
                                                  const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy);

/* int4_panels.c: an int8 LM head whose codes are in 16-row panels (cpu_native_step.int8_row_panels),
   with one scale a row (scale [N], bf16 when sbf16) or, group_scales not NULL, one fp32 scale a
   32-input group in panels too ([N / 16][K / 32][16]: a GGUF Q8_0 table), against the tokens
   quantized to int8 per 32-input block, n0 a multiple of 16; 0 where there was no memory (nothing
   written). The fp32 form reads the same panels with fp32 activations (where the int8 rows found
   no memory). */
KVMESH_INTERNAL int kvmesh_gemv_i8_panels(const int8_t *w, const void *scale, const int sbf16, const float *group_scales,
                                          int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B,
                                          float *y, int64_t ldy);
KVMESH_INTERNAL void kvmesh_gemv_i8_panels_fp32(const int8_t *w, const void *scale, const int sbf16,
                                                const float *group_scales, int64_t K, int64_t n0, int64_t n1,
                                                const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy);

/* projections_avx2.c: y[b * ldy + n] = W[n] . x[b] for int8 codes w [N][K] with one fp32 scale a
   32-input group, scales [N][K / 32] (W_I8G: an LM head that is a GGUF Q8_0 table); K % 32 == 0. */
KVMESH_INTERNAL void kvmesh_gemv_i8g(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1,
                                     const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy);

/* The same against the tokens quantized to int8 per 32-input block (kvmesh_int8_rows): the LM
   head of an int4 model run with int8 activations. */
KVMESH_INTERNAL void kvmesh_gemv_i8g_a8(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1,
                                        const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy);

/* int4_gemm_avx2.c: the same products for steps of at least kvmesh_gemm_min_rows() tokens (a
   panel of weight rows dequantized once a call, then FMA-bound tiles over every token): int4
   with fp32 activations (the exact form's weights) and Q8_0 groups. 1 = y written, 0 = not
   taken (fewer tokens, or no memory: the caller's per-row kernels run). */
#define KVMESH_GEMM_DEFAULT_MIN_ROWS 8
KVMESH_INTERNAL int kvmesh_gemm_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                     int64_t ldx, int64_t B, float *y, int64_t ldy);
KVMESH_INTERNAL int kvmesh_gemm_i8g(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1,
                                    const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy);
/* The batched kernels' threshold for the whole process (benchmarks A/B it); returns the old one. */
int kvmesh_set_gemm_min_rows(int rows);
int kvmesh_gemm_min_rows(void);

/* The calling thread's AMX tile configuration for a step, and its release (no-ops without AMX). */
KVMESH_INTERNAL void kvmesh_amx_tiles_begin(void);
KVMESH_INTERNAL void kvmesh_amx_tiles_end(void);

/* Asks Linux for AMX tile state once after loading; 1 = the AMX paths run. */
int kvmesh_cpu_init(void);
/* What this build does: KVMESH_FEATURE_* bits. */
int kvmesh_cpu_features(void);

/* native_step.c: one step of the model over the batch; KVMESH_STEP_*. */
int kvmesh_native_step(const kvmesh_model *m, const kvmesh_step_batch *batch);
/* 0 when the model descriptor is one the step can run, else the number of its first
   inconsistency (cpu_native_step.py names them). Runs in every variant. */
int kvmesh_native_step_check(const kvmesh_model *m);

#endif
