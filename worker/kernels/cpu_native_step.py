"""A small step on CPU as ONE native call: every layer, the attention and the LM head.

At batch 1 a decode step of SmolLM2 reads ~107 MB of int8 (or ~214 MB of bf16) projection
weights, which one core streams in ~9 ms (~17 ms); eager torch spends as long again on ~20
small ops per layer (norms, residual adds, RoPE, SiLU-mul, views, the KV write), each a Python
call and a dispatcher round trip, and oneDNN's bf16 GEMM reaches only 5-7 GB/s at one row
(docs/benchmarks.md). llama.cpp's 80 tok/s at batch 1 on the same 2 cores is its whole graph in
C. This module does the same for the steps it takes: the model's own weights (read in place;
on a CPU with AMX, bf16 weights from one copy laid out for its tiles at load) and the model's
own paged KV cache (written and read through the block tables,
so larger steps, preemption, prefix caching and swapping keep running in torch on the same
cache), one C call per step:

    per layer, SPMD over an OpenMP team (torch's own threads), a barrier between the phases:
      RMSNorm -> QKV rows (this thread's share) | RoPE + K/V into the cache (this thread's
      tokens) | paged attention of this thread's tokens (the C kernel of cpu_paged_attention.py)
      | O rows | residual + RMSNorm -> gate/up rows + SiLU-mul | down rows
    final residual + RMSNorm -> LM head rows (this thread's share of the vocabulary) for the
    tokens that sample -> fp32 logits

A step is up to `max_tokens` tokens of any shape: decode rows, a prefill chunk (each token
attends causally to its request through its own position), speculative verify rows. The
projections read each weight row once per step, in place, for all its tokens: on a CPU with
AMX, bf16 weights go through AMX tiles (16 tokens times a 16-row weight block per instruction,
so up to 64 tokens cost about what reading the weights costs); otherwise GEMVs (fp32 FMA, int8
and bf16 widened in registers, bf16 pairs by VDPBF16PS where the CPU has it), memory-bound at a
handful of tokens, where the packed GEMMs are not yet efficient. Larger steps run eagerly
(oneDNN / AMX GEMMs). Weights it takes: plain fp32 / bf16 (the fused QKV and gate-up weights, o, down, the LM head) and
weight-only int8 with one scale per row (quant.weight: int8, and the self-draft's int8 head).
Not taken (eager runs every step, one log line says why): int4, AWQ input scales, biases,
quantized KV, tensor parallelism, non-CPU devices, widths not a multiple of 16, CPUs without
AVX-512, no C compiler.

Numerics: activations stay fp32 through the whole step (eager rounds each op's output to the
model dtype), K/V are rounded to the cache dtype as they are stored, and the attention reads
the cache dtype as the eager kernel does. bf16 weights on a CPU with AVX512_BF16 take each
projection's input rounded to bf16 (VDPBF16PS or AMX, fp32 sums), as oneDNN's bf16 GEMMs do.
In fp32 the step is the eager one up to the order of fp32 sums (tests/test_cpu_native_decode.py: logits within 1e-5, greedy tokens identical with
chunked prefill and preemption); in bf16 it is closer to the fp32 model than eager bf16 is.
On by default for 16-bit models (`model.cpu_native_max_tokens`: auto = steps of up to 64
tokens with AMX, else 12 tokens per thread up to 24; fp32 stays eager unless asked, it is the
token-exact reference path), and for the
self-draft's small steps (worker/engine_loop/self_draft.py), where only acceptance can change.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from kvmesh.core.config import CPU_NATIVE_MAX_TOKENS
from kvmesh.quant.linear import Int8WeightOnlyLinear
from kvmesh.worker.kernels import cpu_build, cpu_paged_attention

logger = logging.getLogger(__name__)

_DECODER_SOURCE = r"""
#include <math.h>
#include <string.h>
#include <omp.h>

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };

/* The model descriptor, an int64 array built once in Python (see NativeDecoder._descriptor). */
enum { M_LAYERS, M_HIDDEN, M_INTER, M_HQ, M_HKV, M_D, M_WKIND, M_BF16, M_BLOCK, M_CBS, M_CSS, M_CHS,
       M_VOCAB, M_LMKIND, M_EMBED, M_FNORM, M_COS, M_SIN, M_LMW, M_LMS, M_A8, M_LMP, M_HEADER };
enum { L_INNORM, L_POSTNORM, L_QKVW, L_QKVS, L_OW, L_OS, L_GUW, L_GUS, L_DW, L_DS, L_KC, L_VC,
       L_QKVP, L_OP, L_GUP, L_DP, L_FIELDS };  /* ..P: the weight in amx_packed layout, or 0 */

#define PTR(x) ((const void *)(intptr_t)(x))

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load_w16(const void *w, int64_t i, const int kind) {
    if (kind == W_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
    if (kind == W_BF16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    return _mm512_loadu_ps((const float *)w + i);
}

static inline int64_t w_elem_size(const int kind) { return kind == W_I8 ? 1 : kind == W_BF16 ? 2 : 4; }

/* Four weight rows (from row n) dotted with C activation rows: res[i * C + j] = W[n + i] . x[j].
   The weight rows are streamed once (prefetched PREFETCH_GROUPS groups ahead: the hardware
   prefetcher alone reached ~half the core's read bandwidth on these short rows); C <= TILE_ROWS
   keeps the 4 x C accumulators, the four widened weight vectors and one activation vector in
   AVX-512's 32 registers (4 x 6 + 4 + 1 = 29), so a speculative verify of k + 1 <= 6 tokens
   reads each weight row from memory once, as a single decode row does. */
#define PREFETCH_GROUPS 2
#define TILE_ROWS 6
static inline __attribute__((always_inline)) void tile4(const char *w, int64_t n, int64_t K, const float *x,
        int64_t ldx, const int C, const int kind, const int prefetch, float *res) {
    const int64_t es = w_elem_size(kind), row = K * es;
    const char *r0 = w + n * row;
    __m512 acc[4][TILE_ROWS];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (prefetch && ((k * es) & 63) == 0)
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm_prefetch(r0 + (PREFETCH_GROUPS * 4 + i) * row + k * es, _MM_HINT_T0);
        __m512 wv[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) wv[i] = load_w16(r0 + i * row, k, kind);
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) {
            const __m512 xv = _mm512_loadu_ps(x + j * ldx + k);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) res[i * C + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* The row-group walk both GEMVs share: weight rows from n four at a time (n is left at the first
   row of an uneven share's tail), the B tokens TILE_ROWS at a time, TILE(C) the GEMV's tile
   function for the tokens from b with a constant C (so its accumulators stay in registers)
   writing res, scattered into y[token * ldy + row]. */
#define FOR_EACH_ROW_TILE(TILE) \
    for (; n + 4 <= n1; n += 4) \
        for (int64_t b = 0; b < B; b += TILE_ROWS) { \
            const int64_t c = B - b < TILE_ROWS ? B - b : TILE_ROWS; \
            const int pf = b == 0; \
            switch (c) { \
                case 6: TILE(6); break; \
                case 5: TILE(5); break; \
                case 4: TILE(4); break; \
                case 3: TILE(3); break; \
                case 2: TILE(2); break; \
                default: TILE(1); \
            } \
            for (int i = 0; i < 4; i++) \
                for (int64_t j = 0; j < c; j++) y[(b + j) * ldy + n + i] = res[i * c + j]; \
        }

/* y[b * ldy + n] = scale[n] * dot(W[n, :K], x[b * ldx, :K]) for n in [n0, n1), b < B (K % 16 == 0):
   four weight rows at a time against the batch rows TILE_ROWS at a time (the four rows stay in
   L1 across the row groups), so each weight row is read from memory once per step whatever B is. */
static inline __attribute__((always_inline)) void gemv_kind(
        const void *w, const void *scale, const int sbf16, int64_t K, int64_t n0, int64_t n1,
        const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, const int kind) {
    const int64_t es = w_elem_size(kind);
    int64_t n = n0;
    float res[4 * TILE_ROWS];
#define FMA_TILE(C) tile4((const char *)w, n, K, x + b * ldx, ldx, C, kind, pf, res)
    FOR_EACH_ROW_TILE(FMA_TILE)
#undef FMA_TILE
    for (; n < n1; n++) {  /* the last rows of an uneven share */
        const char *row = (const char *)w + n * K * es;
        for (int64_t b = 0; b < B; b++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) a = _mm512_fmadd_ps(load_w16(row, k, kind), _mm512_loadu_ps(x + b * ldx + k), a);
            y[b * ldy + n] = _mm512_reduce_add_ps(a);
        }
    }
    if (kind == W_I8)
        for (int64_t b = 0; b < B; b++)
            for (int64_t m = n0; m < n1; m++) y[b * ldy + m] *= load_elem(scale, m, sbf16);
}

#ifdef __AVX512BF16__
/* bf16 weights on a CPU with AVX512_BF16: the activation rows are rounded to bf16 once per
   projection and each pair of products is one lane of VDPBF16PS (fp32 accumulation), half the
   instructions of widening every weight to fp32 for an FMA. Past a few rows this GEMV is
   compute-bound (1 thread, FMAs: 5 rows cost 1.3x one row), so this keeps verify rows and
   mid-size batches near the cost of reading the weights once. The matmul inputs are then
   rounded to bf16, as the eager forward's oneDNN GEMMs round them. */
#define HAVE_DPBF16 1

/* rows [B][ldx] fp32 -> out [B][K] bf16, round to nearest even (K % 32 == 0) */
static void rows_to_bf16(const float *x, int64_t ldx, int64_t B, int64_t K, uint16_t *out) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512((void *)(out + b * K + k),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + b * ldx + k + 16),
                                                             _mm512_loadu_ps(x + b * ldx + k)));
}

/* tile4 for bf16 weights and bf16 activation rows x [C][K]: res[i * C + j] = W[n + i] . x[j] */
static inline __attribute__((always_inline)) void tile4_dp(const char *w, int64_t n, int64_t K, const uint16_t *x,
        const int C, const int prefetch, float *res) {
    const int64_t row = K * 2;
    const char *r0 = w + n * row;
    __m512 acc[4][TILE_ROWS];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (prefetch)
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm_prefetch(r0 + (PREFETCH_GROUPS * 4 + i) * row + k * 2, _MM_HINT_T0);
        __m512bh wv[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(r0 + i * row + k * 2));
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + j * K + k));
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) res[i * C + j] = _mm512_reduce_add_ps(acc[i][j]);
}

static void gemv_bf16_dp(const void *w, int64_t K, int64_t n0, int64_t n1, const uint16_t *x, int64_t B,
                         float *y, int64_t ldy) {
    const char *wc = (const char *)w;
    int64_t n = n0;
    float res[4 * TILE_ROWS];
#define DP_TILE(C) tile4_dp(wc, n, K, x + b * K, C, pf, res)
    FOR_EACH_ROW_TILE(DP_TILE)
#undef DP_TILE
    for (; n < n1; n++) {  /* the last rows of an uneven share: the same sums, one row at a time */
        const char *r = wc + n * K * 2;
        for (int64_t b = 0; b < B; b++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(r + k * 2)),
                                     (__m512bh)_mm512_loadu_si512((const void *)(x + b * K + k)));
            y[b * ldy + n] = _mm512_reduce_add_ps(a);
        }
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_DPBF16)
/* bf16 weights on a CPU with AMX: TDPBF16PS, one instruction a 16 x 16 x 32 product, so a step
   of up to 64 tokens costs about what reading the weights costs (the FMA / VDPBF16PS GEMVs
   above are compute-bound past a few tokens): gemm_bf16_amx_packed below. Linux grants AMX
   state per process on request (kvmesh_native_decode_init); without the grant the VDPBF16PS
   path runs. */
#define HAVE_AMX 1
#define AMX_MAX_TOKENS 64  /* four accumulator tiles of 16 tokens (more: the GEMV paths) */
#include <sys/syscall.h>
#include <unistd.h>

static int amx_granted = 0;

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* B rows of `words` 4-byte words each (bf16 pairs, int8 quads) -> ceil(B/16) groups of
   [words][16 rows]: AMX's B-operand layout, rows beyond B zero. Word w of a group's 16 rows
   is one masked 16-lane gather. */
static void rows_to_amx_words(const void *rows_in, int64_t words, int64_t B, void *out) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)words));
    for (int64_t g = 0; g < (B + 15) / 16; g++) {
        const int64_t valid = B - g * 16 < 16 ? B - g * 16 : 16;
        const __mmask16 live = (__mmask16)((1u << valid) - 1u);
        const int32_t *src = (const int32_t *)rows_in + g * 16 * words;
        int32_t *dst = (int32_t *)out + g * 16 * words;
        for (int64_t w = 0; w < words; w++)
            _mm512_storeu_si512((void *)(dst + w * 16),
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, src + w, 4));
    }
}

/* One k-step of a 16-row weight block (at wk, row stride lda bytes) against up to four
   16-token groups (their blocks at bk + g * gstride, 64-byte rows), accumulating into tiles
   0-3 with DP (_tile_dpbf16ps or _tile_dpbssd). Two tile registers each for the weight block
   (4, 6) and the tokens' block (5, 7), taken in turn by the step's parity: a tile load must
   wait for every product still reading its register, so with one of each the next weight
   block's read queued behind the products. */
#define AMX_BLOCK_STEP(DP, parity, wk, lda, bk, gstride, groups) do { \
        if ((parity) == 0) { \
            _tile_loadd(4, wk, lda); _tile_loadd(5, bk, 64); DP(0, 4, 5); \
            if ((groups) > 1) { _tile_loadd(7, (bk) + (gstride), 64); DP(1, 4, 7); } \
            if ((groups) > 2) { _tile_loadd(5, (bk) + 2 * (gstride), 64); DP(2, 4, 5); } \
            if ((groups) > 3) { _tile_loadd(7, (bk) + 3 * (gstride), 64); DP(3, 4, 7); } \
        } else { \
            _tile_loadd(6, wk, lda); _tile_loadd(7, bk, 64); DP(0, 6, 7); \
            if ((groups) > 1) { _tile_loadd(5, (bk) + (gstride), 64); DP(1, 6, 5); } \
            if ((groups) > 2) { _tile_loadd(7, (bk) + 2 * (gstride), 64); DP(2, 6, 7); } \
            if ((groups) > 3) { _tile_loadd(5, (bk) + 3 * (gstride), 64); DP(3, 6, 5); } \
        } \
    } while (0)

/* y[b * ldy + n] = W[n] . x[b] for n in [n0, n1), B <= 64, from a copy of the weight laid
   out for AMX once, at load (amx_packed in Python): 16-row blocks, each K/32 tiles of
   [16 pairs][16 rows][2] bf16, one contiguous KB each, TDPBF16PS's B operand as it lies. The
   tokens are the A operand straight from their bf16 rows (16 tokens x 32 values, row stride
   K), and a product tile (16 tokens x 16 outputs) is y's layout, stored as it lies. A pass
   takes two weight blocks x two token groups (tiles 0-3 accumulate, 4-5 hold tokens, 6-7
   weights): four products per four tile loads; the second token pair re-reads the two
   blocks from L1/L2 (36 KB at K = 576).
   The kernel it replaced read the model's own weight as the A operand (16 rows at the row
   stride), re-laid the tokens into pair layout per projection and gathered each product
   tile's columns into y: five tile loads per four products, 16 strided weight streams.
   Measured on the 2-core Sapphire Rapids machine (docs/benchmarks.md, ninth round): alone,
   64 tokens, 2 threads, 18-22 GB/s of weights at K = 576 against 12-13; in the engine,
   batch-64 step 36-40 -> 28-30 ms, batch 1 ~10% faster too. At 64 tokens it is bound by
   the tile loads' L2 traffic (~1 TFLOP/s a core with the weights L2-resident, ~3 with
   everything in L1), not by the prefetch distance (2-16 k-steps, T0 or T1: all within noise). */
#define PACKED_PREFETCH 4  /* k-steps ahead */
#define PACKED_STORE(t, g, col) do { \
        const int64_t valid = B - (g) * 16 < 16 ? B - (g) * 16 : 16; \
        if (valid == 16) _tile_stored(t, y + (g) * 16 * ldy + (col), ldy * 4); \
        else { \
            _tile_stored(t, ctile, 64); \
            for (int64_t r = 0; r < valid; r++) memcpy(y + ((g) * 16 + r) * ldy + (col), ctile + r * 16, 64); \
        } \
    } while (0)
static void gemm_bf16_amx_packed(const uint16_t *wp, const void *w, int64_t K, int64_t n0, int64_t n1,
                                 const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *xb,
                                 const int x_ready) {
    if (!x_ready) rows_to_bf16(x, ldx, B, K, xb);  /* rows past B are never stored: any value */
    const int64_t ks = K / 32, groups = (B + 15) / 16, lda = K * 2;
    float ctile[256];
    int64_t n = n0;
    while (n + 16 <= n1) {
        const int two = n + 32 <= n1;
        const char *b0 = (const char *)(wp + n * K), *b1 = b0 + ks * 1024;
        for (int64_t g = 0; g < groups; g += 2) {
            const int pair = g + 1 < groups;
            const char *xa = (const char *)xb + g * 16 * lda;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            if (two && pair) {
                for (int64_t kb = 0; kb < ks; kb++) {
                    if (g == 0)
                        for (int i = 0; i < 16; i++) {
                            _mm_prefetch(b0 + (kb + PACKED_PREFETCH) * 1024 + i * 64, _MM_HINT_T0);
                            _mm_prefetch(b1 + (kb + PACKED_PREFETCH) * 1024 + i * 64, _MM_HINT_T0);
                        }
                    _tile_loadd(6, b0 + kb * 1024, 64); _tile_loadd(7, b1 + kb * 1024, 64);
                    _tile_loadd(4, xa + kb * 64, lda); _tile_loadd(5, xa + 16 * lda + kb * 64, lda);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
            } else {
                for (int64_t kb = 0; kb < ks; kb++) {
                    _tile_loadd(6, b0 + kb * 1024, 64); _tile_loadd(4, xa + kb * 64, lda); _tile_dpbf16ps(0, 4, 6);
                    if (two) { _tile_loadd(7, b1 + kb * 1024, 64); _tile_dpbf16ps(1, 4, 7); }
                    if (pair) {
                        _tile_loadd(5, xa + 16 * lda + kb * 64, lda); _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
            }
            PACKED_STORE(0, g, n);
            if (two) PACKED_STORE(1, g, n + 16);
            if (pair) { PACKED_STORE(2, g + 1, n); if (two) PACKED_STORE(3, g + 1, n + 16); }
        }
        n += two ? 32 : 16;
    }
    if (n < n1) gemv_bf16_dp(w, K, n, n1, xb, B, y, ldy);  /* a share's last rows short of a block */
}
#endif

#if defined(HAVE_AMX) && defined(__AMX_INT8__)
/* int8 weights with int8 activations (the self-draft only: only its acceptance can change):
   each token's row is quantized symmetrically (one scale a row) and laid out in AMX's quad
   layout [K/4][16 rows][4], the weight block is TDPBSSD's A operand in place (16 rows x 64
   int8), int32 sums scaled by the weight row's and the token's scales. The FMA GEMV widens
   every int8 weight to fp32 first and reached ~9 GB/s of the core's ~12 at one token; this
   reads the weights at the bf16 AMX path's rate. */
#define HAVE_AMX_I8 1

/* rows [B][ldx] fp32 -> q [B][K] int8, scales [B]; then ceil(B/16) groups of [K/4][16][4] */
static void rows_to_amx_quads(const float *x, int64_t ldx, int64_t B, int64_t K, int8_t *q, float *scales,
                              int8_t *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * ldx;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + k)));
        const float m = _mm512_reduce_max_ps(amax);
        const float scale = m > 0.0f ? m / 127.0f : 1.0f;
        scales[b] = scale;
        const __m512 inv = _mm512_set1_ps(1.0f / scale);
        for (int64_t k = 0; k < K; k += 16) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + k), inv),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)(q + b * K + k), _mm512_cvtsepi32_epi8(v));
        }
    }
    rows_to_amx_words(q, K / 4, B, out);
}

#define AMX_STORE_I8(t, g) do { \
        _tile_stored(t, itile, 64); \
        const int64_t cols = B - (g) * 16 < 16 ? B - (g) * 16 : 16; \
        const __m512 ws = load16(scale, n, sbf16); \
        for (int64_t c = 0; c < cols; c++) { \
            const __m512 v = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(column, itile + c, 4)); \
            _mm512_storeu_ps(y + ((g) * 16 + c) * ldy + n, _mm512_mul_ps(_mm512_mul_ps(v, ws), \
                                                                          _mm512_set1_ps(xs[(g) * 16 + c]))); \
        } \
    } while (0)

static __thread float amx_i8_scales[64];

/* y[b * ldy + n] = scale[n] * (W[n] . x[b]) for n in [n0, n1) (16-row blocks; the rest by the
   FMA GEMV on the fp32 rows), B <= 64, K % 64 == 0 */
static void gemv_i8_amx(const void *w, const void *scale, const int sbf16, int64_t K, int64_t n0, int64_t n1,
                        const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, int8_t *q, int8_t *quads,
                        const int x_ready) {
    float *xs = amx_i8_scales;
    if (!x_ready) rows_to_amx_quads(x, ldx, B, K, q, xs, quads);
    const int64_t groups = (B + 15) / 16, gstride = K * 16;
    int32_t itile[256];
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
        const char *a = (const char *)w + n * K;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += 64) {
            if (n + 32 <= n1)
                for (int i = 0; i < 16; i++) _mm_prefetch(a + (16 + i) * K + k, _MM_HINT_T0);
            const int8_t *bk = quads + (k / 4) * 64;
            AMX_BLOCK_STEP(_tile_dpbssd, (k / 64) % 2, a + k, K, bk, gstride, groups);
        }
        AMX_STORE_I8(0, 0);
        if (groups > 1) AMX_STORE_I8(1, 1);
        if (groups > 2) AMX_STORE_I8(2, 2);
        if (groups > 3) AMX_STORE_I8(3, 3);
    }
    if (n < n1) gemv_kind(w, scale, sbf16, K, n, n1, x, ldx, B, y, ldy, W_I8);
}
#endif

/* x16: the thread's scratch for a projection's input rows in bf16 or int8 (room for 2 x [B
   rounded up to 16][K] bf16), used where the bf16 dot-product or an AMX path applies; x_ready:
   it already holds this x (the previous call had the same input: gate then up); a8: int8
   weights may take int8 activations (the self-draft) */
static void gemv(const void *w, const void *wp, const int kind, const void *scale, const int sbf16, int64_t K,
                 int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16,
                 const int x_ready, const int a8) {
    (void)wp;  /* only the AMX build reads packed weights */
    if (n0 >= n1 || B == 0) return;  /* B = 0: a step with no token to sample reads no LM head */
    if (kind == W_I8) {
#ifdef HAVE_AMX_I8
        if (a8 && amx_granted && K % 64 == 0 && B <= AMX_MAX_TOKENS) {
            gemv_i8_amx(w, scale, sbf16, K, n0, n1, x, ldx, B, y, ldy, (int8_t *)x16,
                        (int8_t *)x16 + ((B + 15) / 16) * 16 * K, x_ready);
            return;
        }
#endif
        (void)a8;
        gemv_kind(w, scale, sbf16, K, n0, n1, x, ldx, B, y, ldy, W_I8);
    }
    else if (kind == W_BF16) {
#ifdef HAVE_AMX
        if (wp && amx_granted && K % 32 == 0 && B <= AMX_MAX_TOKENS) {
            gemm_bf16_amx_packed((const uint16_t *)wp, w, K, n0, n1, x, ldx, B, y, ldy, x16, x_ready);
            return;
        }
#endif
#ifdef HAVE_DPBF16
        if (K % 32 == 0) {
            if (!x_ready) rows_to_bf16(x, ldx, B, K, x16);
            gemv_bf16_dp(w, K, n0, n1, x16, B, y, ldy);
            return;
        }
#endif
        gemv_kind(w, scale, sbf16, K, n0, n1, x, ldx, B, y, ldy, W_BF16);
    }
    else gemv_kind(w, scale, sbf16, K, n0, n1, x, ldx, B, y, ldy, W_F32);
}

/* out = weight * (x / sqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm in fp32 */
static void rms_norm_rows(const float *x, const void *weight, const int bf16, int64_t B, int64_t H, float eps,
                          float *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * H;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < H; i++) ss += xb[i] * xb[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) out[b * H + i] = load_elem(weight, i, bf16) * (xb[i] * inv);
    }
}

/* Scratch kept per thread across steps (the OpenMP team is torch's pool: the same threads every
   step). A fresh malloc of these sizes (up to ~1 MB at 64 tokens) is a fresh mmap, and every
   page of it faults on first touch, every step. */
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[3];
    static __thread size_t cap[3];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

typedef struct {
    const int64_t *m;
    float eps;
    int64_t B, threads;
    const int64_t *tokens, *positions, *slots, *rows;
    const int32_t *tables, *seq_lens;
    int64_t t_rs;
    const int64_t *sample_rows;
    int64_t S;
    float *logits;
    /* shared buffers */
    float *qkv, *o_out, *act, *down_out;
    void *q_attn, *attn_out;
    int failed;
} Step;

static inline int64_t share(int64_t n, int64_t tid, int64_t threads, int64_t align) {
    /* the start of thread tid's share of n, on a multiple of align */
    int64_t units = (n + align - 1) / align;
    int64_t at = units * tid / threads * align;
    return at < n ? at : n;
}

/* Thread tid of T inside the step's OpenMP team (torch's own pool: the library links the
   libgomp torch has loaded, so no second set of threads spins against torch's). */
static void step_thread(Step *s, const int64_t tid, const int64_t T) {
    const int64_t B = s->B;
    const int64_t *m = s->m;
    const int64_t L = m[M_LAYERS], H = m[M_HIDDEN], I = m[M_INTER], hq = m[M_HQ], hkv = m[M_HKV], D = m[M_D];
    const int wk = (int)m[M_WKIND], bf16 = (int)m[M_BF16], a8 = (int)m[M_A8];
    const int64_t nqkv = (hq + 2 * hkv) * D, bs = m[M_BLOCK], cbs = m[M_CBS], css = m[M_CSS], chs = m[M_CHS];
    const float *cos_t = (const float *)PTR(m[M_COS]), *sin_t = (const float *)PTR(m[M_SIN]);
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t esz = bf16 ? 2 : 4;
    /* private: the residual stream, the normed input of the next projection, the attention
       output widened to fp32, one head's scratch, the rows that get logits (every thread keeps
       identical copies of the first three: cheaper than a barrier) */
    const int64_t widest = I > H ? (I > hq * D ? I : hq * D) : (H > hq * D ? H : hq * D);
    float *priv = (float *)scratch(0, sizeof(float) * (size_t)(B * (2 * H + hq * D) + 2 * D + s->S * H)
                                  + sizeof(uint16_t) * (size_t)(2 * (((B > s->S ? B : s->S) + 15) / 16 * 16) * widest));
    if (!priv) { __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED); }
    float *res = priv, *h = res + B * H, *attn = h + B * H, *tmp = attn + B * hq * D;
    float *picked = tmp + 2 * D;  /* [S, H]: the final hidden rows that get logits */
    uint16_t *x16 = (uint16_t *)(picked + s->S * H);  /* a projection's input rows in bf16 */
    const int64_t r0 = B * tid / T, r1 = B * (tid + 1) / T;  /* this thread's tokens */
    const void *embed = PTR(m[M_EMBED]);
    if (priv) for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < H; i++) res[b * H + i] = load_elem(embed, s->tokens[b] * H + i, bf16);
    #pragma omp barrier  /* everyone has its workspace (or knows someone has none) */
    if (__atomic_load_n(&s->failed, __ATOMIC_RELAXED)) return;
#ifdef HAVE_AMX
    if (amx_granted) amx_configure();  /* tile state is per thread; oneDNN loads its own before use */
#endif
    for (int64_t l = 0; l < L; l++) {
        const int64_t *lp = m + M_HEADER + l * L_FIELDS;
        /* residual += previous layer's MLP output (the embedding itself at layer 0) */
        if (l > 0) {
            #pragma omp simd
            for (int64_t i = 0; i < B * H; i++) res[i] += s->down_out[i];
        }
        rms_norm_rows(res, PTR(lp[L_INNORM]), bf16, B, H, s->eps, h);
        gemv(PTR(lp[L_QKVW]), PTR(lp[L_QKVP]), wk, PTR(lp[L_QKVS]), bf16, H, share(nqkv, tid, T, 16),
             share(nqkv, tid + 1, T, 16),
             h, H, B, s->qkv, nqkv, x16, 0, a8);
        #pragma omp barrier
        /* RoPE on q and k heads, K/V into the cache, then attention: this thread's rows only */
        for (int64_t b = r0; b < r1; b++) {
            float *row = s->qkv + b * nqkv;
            const float *c = cos_t + s->positions[b] * D, *sn = sin_t + s->positions[b] * D;
            for (int64_t hd = 0; hd < hq + hkv; hd++) {
                float *v = row + hd * D;
                memcpy(tmp, v, sizeof(float) * (size_t)D);
                /* rotate_half in two vectorisable halves (no index wrap-around) */
                #pragma omp simd
                for (int64_t e = 0; e < D / 2; e++) v[e] = tmp[e] * c[e] + tmp[e + D / 2] * sn[e];
                #pragma omp simd
                for (int64_t e = D / 2; e < D; e++) v[e] = tmp[e] * c[e] + tmp[e - D / 2] * sn[e];
            }
            const int64_t slot = s->slots[b];
            const int64_t at = (slot / bs) * cbs + (slot % bs) * css;
            void *kc = (void *)PTR(lp[L_KC]), *vc = (void *)PTR(lp[L_VC]);
            for (int64_t g = 0; g < hkv; g++) {
                #pragma omp simd
                for (int64_t e = 0; e < D; e++) {
                    store_elem(kc, at + g * chs + e, row[(hq + g) * D + e], bf16);
                    store_elem(vc, at + g * chs + e, row[(hq + hkv + g) * D + e], bf16);
                }
            }
            #pragma omp simd
            for (int64_t e = 0; e < hq * D; e++) store_elem(s->q_attn, b * hq * D + e, row[e], bf16);
        }
        #pragma omp barrier  /* a request's tokens may sit on two threads: all K/V written first */
        if (r1 > r0 && (bf16 ? kvmesh_paged_decode_bf16 : kvmesh_paged_decode_f32)(
                s->q_attn, hq * D, D, PTR(lp[L_KC]), PTR(lp[L_VC]), cbs, css, chs, s->tables, s->t_rs, s->seq_lens,
                s->rows, s->rows, r0, r1, s->attn_out, hq * D, D, hq, hkv, D, bs, scale))
            __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
        #pragma omp barrier
        #pragma omp simd
        for (int64_t i = 0; i < B * hq * D; i++) attn[i] = load_elem(s->attn_out, i, bf16);
        gemv(PTR(lp[L_OW]), PTR(lp[L_OP]), wk, PTR(lp[L_OS]), bf16, hq * D, share(H, tid, T, 16),
             share(H, tid + 1, T, 16),
             attn, hq * D, B, s->o_out, H, x16, 0, a8);
        #pragma omp barrier
        #pragma omp simd
        for (int64_t i = 0; i < B * H; i++) res[i] += s->o_out[i];
        rms_norm_rows(res, PTR(lp[L_POSTNORM]), bf16, B, H, s->eps, h);
        {   /* gate rows i and up rows I + i of this thread's share of the intermediate width,
               then act = silu(gate) * up for them */
            const int64_t i0 = share(I, tid, T, 16), i1 = share(I, tid + 1, T, 16), w = i1 - i0;
            const int64_t es = w_elem_size(wk);
            float *gu = (float *)scratch(1, sizeof(float) * (size_t)(2 * B * (w > 0 ? w : 1)));
            if (!gu) __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
            else if (w > 0) {
                const char *gw = (const char *)PTR(lp[L_GUW]);
                const char *gs = (const char *)PTR(lp[L_GUS]), *us = gs;
                if (gs) { gs += i0 * esz; us += (I + i0) * esz; }
                const char *gp = (const char *)PTR(lp[L_GUP]);  /* packed: same element offsets */
                gemv(gw + i0 * H * es, gp ? gp + i0 * H * es : 0, wk, gs, bf16, H, 0, w, h, H, B, gu, w, x16, 0, a8);
                gemv(gw + (I + i0) * H * es, gp ? gp + (I + i0) * H * es : 0, wk, us, bf16, H, 0, w, h, H, B,
                     gu + B * w, w, x16, 1, a8);
                for (int64_t b = 0; b < B; b++) {
                    const float *gb = gu + b * w, *ub = gu + B * w + b * w;
                    float *ab = s->act + b * I + i0;
                    /* sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) below: both from
                       t = e^-|g| and a select, so the loop vectorises (as many exps as rows) */
                    #pragma omp simd
                    for (int64_t i = 0; i < w; i++) {
                        const float g = gb[i], t = exp_nonpositive(-fabsf(g));
                        ab[i] = g * ((g >= 0.0f ? 1.0f : t) / (1.0f + t)) * ub[i];
                    }
                }
            }
        }
        #pragma omp barrier
        gemv(PTR(lp[L_DW]), PTR(lp[L_DP]), wk, PTR(lp[L_DS]), bf16, I, share(H, tid, T, 16),
             share(H, tid + 1, T, 16),
             s->act, I, B, s->down_out, H, x16, 0, a8);
        #pragma omp barrier
    }
    for (int64_t i = 0; i < B * H; i++) res[i] += s->down_out[i];
    rms_norm_rows(res, PTR(m[M_FNORM]), bf16, B, H, s->eps, h);
    for (int64_t j = 0; j < s->S; j++)  /* the LM head's input rows, rounded to the model dtype as eager */
        for (int64_t i = 0; i < H; i++)
            picked[j * H + i] = bf16 ? round_bf16(h[s->sample_rows[j] * H + i]) : h[s->sample_rows[j] * H + i];
    const int64_t V = m[M_VOCAB];
    /* The LM head keeps fp32 activations: quantizing the final hidden state per row flipped
       the self-draft's argmax often enough to cut its acceptance from 0.90 to 0.85 (bundled
       chat prompts, docs/benchmarks.md, sixth round). */
    gemv(PTR(m[M_LMW]), PTR(m[M_LMP]), (int)m[M_LMKIND], PTR(m[M_LMS]), bf16, H, share(V, tid, T, 16),
         share(V, tid + 1, T, 16),
         picked, H, s->S, s->logits, V, x16, 0, 0);
#ifdef HAVE_AMX
    if (amx_granted) _tile_release();
#endif
}

/* One step of B tokens: token b is fed at positions[b] into KV slot slots[b] and attends over
   the first seq_lens[b] tokens of its request (itself included) through tables[b * t_rs ...];
   logits [S, vocab] fp32 for the tokens sample_rows[0 .. S). rows = 0 .. B-1.
   0 = ok, 1 = out of memory (no workspace), 2 = built without AVX-512. */
int kvmesh_native_decode(const int64_t *m, float eps, int64_t B, const int64_t *tokens, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t t_rs, const int32_t *seq_lens,
                         const int64_t *rows, const int64_t *sample_rows, int64_t S, int64_t threads, float *logits) {
    const int64_t nqkv = (m[M_HQ] + 2 * m[M_HKV]) * m[M_D], qw = m[M_HQ] * m[M_D];
    const int64_t esz = m[M_BF16] ? 2 : 4;
    float *shared = (float *)scratch(2, sizeof(float) * (size_t)(B * (nqkv + 2 * m[M_HIDDEN] + m[M_INTER]))
                                    + (size_t)(2 * B * qw * esz));
    if (!shared) return 1;
    Step s = {m, eps, B, threads < 1 ? 1 : threads, tokens, positions, slots, rows, tables, seq_lens, t_rs,
              sample_rows, S, logits};
    s.qkv = shared;
    s.o_out = s.qkv + B * nqkv;
    s.down_out = s.o_out + B * m[M_HIDDEN];
    s.act = s.down_out + B * m[M_HIDDEN];
    s.q_attn = (void *)(s.act + B * m[M_INTER]);
    s.attn_out = (char *)s.q_attn + B * qw * esz;
    s.failed = 0;
    #pragma omp parallel num_threads((int)s.threads)
    step_thread(&s, omp_get_thread_num(), omp_get_num_threads());
    return s.failed ? 1 : 0;
}
#else
int kvmesh_native_decode(const int64_t *m, float eps, int64_t B, const int64_t *tokens, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t t_rs, const int32_t *seq_lens,
                         const int64_t *rows, const int64_t *sample_rows, int64_t S, int64_t threads,
                         float *logits) { return 2; }
#endif

/* What this build does (tests and logs read it): 1 = bf16 projections by VDPBF16PS, 2 = by AMX
   tiles (tile state granted), 4 = the self-draft's int8 x int8 AMX path. */
int kvmesh_native_decode_features(void) {
    int features = 0;
#ifdef HAVE_DPBF16
    features |= 1;
#endif
#ifdef HAVE_AMX
    if (amx_granted) features |= 2;
#endif
#ifdef HAVE_AMX_I8
    if (amx_granted) features |= 4;
#endif
    return features;
}

/* Asks Linux for AMX tile state in this process (ARCH_REQ_XCOMP_PERM = 0x1023 for
   XFEATURE_XTILEDATA = 18); 1 = the AMX path runs. Called once after loading. */
int kvmesh_native_decode_init(void) {
#ifdef HAVE_AMX
    amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
#else
    return 0;
#endif
}
"""

_W_F32, _W_BF16, _W_I8 = 0, 1, 2
_FEATURE_DPBF16 = 1  # kvmesh_native_decode_features(): built with the VDPBF16PS path
_FEATURE_AMX = 2  # ... and the AMX path, with the tile state granted
_FEATURE_AMX_INT8 = 4  # ... and the int8-activation AMX path (the self-draft's)
_ENTRY_ARGTYPES = ([ctypes.c_void_p, ctypes.c_float, ctypes.c_int64] + [ctypes.c_void_p] * 4
                   + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p])


class NotTaken(Exception):
    """The model or cache has something the native step does not implement (the message says
    what); the eager forward serves every step then."""


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _float_kind(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return _W_F32
    if dtype == torch.bfloat16:
        return _W_BF16
    raise NotTaken(f"weights in {dtype}")


def _projection(fused, members: tuple, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(kind, [N, K] weight, per-row scales or None) of one projection (a fused group, or one
    linear), read in place; NotTaken for anything but plain float and per-row int8."""
    if fused is not None and fused.usable(members):
        layer = getattr(fused, "merged", None)
        if layer is None:  # FusedLinears: the concatenated float weight
            if fused.bias is not None:
                raise NotTaken("a projection with a bias")
            return _float_kind(fused.weight.dtype), fused.weight, None
    elif len(members) == 1:
        layer = members[0]
    else:
        raise NotTaken("unfused q/k/v or gate/up projections")
    if isinstance(layer, Int8WeightOnlyLinear):
        if layer.bias is not None or layer.input_inv_scale is not None:
            raise NotTaken("int8 projection with a bias or AWQ input scales")
        if layer.scales.dtype != dtype:
            raise NotTaken(f"int8 scales in {layer.scales.dtype}, model in {dtype}")
        return _W_I8, layer.weight_int8, layer.scales
    weight = getattr(layer, "weight", None)
    if not isinstance(layer, torch.nn.Linear) or weight is None or layer.bias is not None:
        raise NotTaken(f"projection {type(layer).__name__}")
    if layer._forward_hooks or layer._forward_pre_hooks:
        raise NotTaken("a hooked projection")
    return _float_kind(weight.dtype), weight, None


def _lm_head(head, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """The LM head's rows: the model's float head, or an int8 head (the self-draft's,
    worker/engine_loop/self_draft.py, keeps its weight-only int8 layer as `linear`)."""
    inner = getattr(head, "linear", None)
    if isinstance(inner, Int8WeightOnlyLinear):
        return _projection(None, (inner,), dtype)
    weight = getattr(head, "weight", None)
    if weight is None or getattr(head, "bias", None) is not None:
        raise NotTaken(f"LM head {type(head).__name__}")
    if weight.dtype != dtype:
        raise NotTaken(f"LM head in {weight.dtype}, model in {dtype}")
    return _float_kind(weight.dtype), weight, None


def amx_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """A [N, K] bf16 weight's whole 16-row blocks in gemm_bf16_amx_packed's layout, [N/16]
    [K/32][16 pairs][16 rows][2] (a second copy: the model keeps its own for eager steps),
    or None where that kernel does not apply."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 32 or n < 16:
        return None
    blocks = n // 16
    with torch.no_grad():
        return weight[:blocks * 16].view(blocks, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _layer_fields(layer, cache, dtype: torch.dtype,
                  strides: tuple) -> tuple[list[int], list[torch.Tensor], int, list[torch.Tensor | None]]:
    """One layer's L_FIELDS pointers up to L_QKVP (norms, the four projections' weights and
    scales, its K/V cache), the tensors behind them, the projections' weight kind, and the
    four projection weights the AMX kernel could take packed (None where not bf16)."""
    attn, mlp = layer.self_attn, layer.mlp
    if cache.quantized or cache.key_cache.dtype != dtype or cache.value_cache.dtype != dtype:
        raise NotTaken(f"KV cache in {cache.key_cache.dtype}{' (quantized)' if cache.quantized else ''}")
    if cache.key_cache.stride() != strides or cache.value_cache.stride() != strides or strides[-1] != 1:
        raise NotTaken("KV cache layers of different layouts")
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(n.dtype != dtype or not n.is_contiguous() for n in norms):
        raise NotTaken("norm weights in another dtype")
    projections = (_projection(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj), dtype),
                   _projection(attn.o, (attn.o_proj,), dtype),
                   _projection(mlp.gate_up, (mlp.gate_proj, mlp.up_proj), dtype),
                   _projection(mlp.down, (mlp.down_proj,), dtype))
    if len({kind for kind, _, _ in projections}) != 1:
        raise NotTaken("projections of mixed kinds")
    pointers = [_ptr(norms[0]), _ptr(norms[1])]
    tensors = [*norms, cache.key_cache, cache.value_cache]
    for _, weight, scales in projections:
        if not weight.is_contiguous() or (scales is not None and not scales.is_contiguous()):
            raise NotTaken("a non-contiguous projection weight")
        pointers += [_ptr(weight), _ptr(scales)]
        tensors += [weight] + ([scales] if scales is not None else [])
    pointers += [_ptr(cache.key_cache), _ptr(cache.value_cache)]
    return pointers, tensors, projections[0][0], [w if kind == _W_BF16 else None for kind, w, _ in projections]


class NativeDecoder:
    """The compiled step for one model and its KV caches. `run(inputs)` -> fp32 logits of the
    step's sampling rows for a step of at most `max_tokens` tokens, else None (run eagerly)."""

    def __init__(self, fn, keep: list, descriptor: torch.Tensor, eps: float, vocab: int, max_tokens: int,
                 gather_logits):
        self._fn = fn
        self._gather_logits = gather_logits  # the head's own trim of padded vocabulary rows
        self._keep = keep  # every tensor the descriptor points into stays alive with it
        self._descriptor = descriptor
        self._eps = eps
        self.vocab = vocab
        self.max_tokens = max_tokens
        self._rows = torch.arange(max_tokens, dtype=torch.long)
        self.steps_run = 0  # steps this decoder served (tests and benchmarks read it)
        # The logits are written into this buffer, rows [0, S), and returned as a view valid
        # until the next step (as CUDA graphs' static outputs are): a fresh [64, 49152] fp32
        # tensor a step cost ~6 ms of first-touch page faults (a third of the LM head's time).
        self._logits = torch.empty(0, vocab, dtype=torch.float32)
        self.bf16_path: str | None = None  # bf16 models: 'amx' | 'vdpbf16ps' | 'fma' (set by build)
        self.int8_amx = False  # int8 weights as int8 x int8 AMX products (set by build)
        self.amx_packed_bytes = 0  # the copies of bf16 weights laid out for AMX tiles (set by build)

    @classmethod
    def build(cls, model, kv_caches: list, max_tokens: int, int8_activations: bool = False) -> "NativeDecoder":
        """Raises NotTaken (the reason) where the native step does not apply. int8_activations:
        int8 layer weights may run as int8 x int8 AMX products, each token's activations
        quantized per row (the self-draft: a draft only has to guess right, and it then reads
        its weights at the bf16 path's rate; the LM head keeps fp32 activations)."""
        reason = unavailable_reason()
        if reason is not None:
            raise NotTaken(reason)
        if model.coll.world_size != 1:
            raise NotTaken("tensor parallelism")
        refusal = model.arch.llama_shaped_refusal()
        if refusal is not None:  # the C step implements Llama's layer only
            raise NotTaken(refusal)
        cfg = model.config
        embed = model.model.embed_tokens.weight
        dtype = embed.dtype
        if embed.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise NotTaken(f"model on {embed.device.type} in {dtype}")
        attn0 = model.model.layers[0].self_attn
        hidden, hq, hkv, d = cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        inter = model.model.layers[0].mlp.gate_proj.out_features
        if any(n % 16 for n in (hidden, inter, hq * d, d)) or hq % hkv:
            raise NotTaken(f"widths hidden {hidden}, intermediate {inter}, heads {hq}x{d} (multiples of 16 needed)")
        loaded = _load()
        if loaded is None:
            raise NotTaken(f"native build failed ({cpu_build.unavailable_reason() or 'see the log'})")
        fn, features = loaded
        k0 = kv_caches[0].key_cache
        strides = k0.stride()
        keep: list[torch.Tensor] = []
        layers: list[list[int]] = []
        to_pack: list[torch.Tensor | None] = []  # four a layer, then the LM head
        kinds: set[int] = set()
        for layer, cache in zip(model.model.layers, kv_caches, strict=True):
            pointers, tensors, kind, bf16_weights = _layer_fields(layer, cache, dtype, strides)
            layers.append(pointers)
            keep += tensors
            to_pack += bf16_weights
            kinds.add(kind)
        if len(kinds) != 1:
            raise NotTaken("projections of mixed kinds")
        lm_kind, lm, lm_scales = _lm_head(model.lm_head, dtype)
        final_norm = model.model.norm.weight
        cos, sin = model.rotary.cos, model.rotary.sin_signed
        for t in (embed, lm, final_norm, cos, sin) + (() if lm_scales is None else (lm_scales,)):
            if not t.is_contiguous():
                raise NotTaken("a non-contiguous embedding, LM head or table")
        if final_norm.dtype != dtype or cos.dtype != torch.float32 or lm.shape[1] != hidden:
            raise NotTaken("final norm or RoPE tables in another dtype, or an LM head of another width")
        keep += [embed, lm, final_norm, cos, sin] + ([] if lm_scales is None else [lm_scales])
        # every check passed: only now copy the weights (packing is ~0.1 s and a weights' worth of memory)
        to_pack.append(lm if lm_kind == _W_BF16 else None)
        packed = [amx_packed(w) if w is not None and features & _FEATURE_AMX else None for w in to_pack]
        keep += [t for t in packed if t is not None]
        weight_kind = kinds.pop()
        header = [len(model.model.layers), hidden, inter, hq, hkv, d, weight_kind, int(dtype == torch.bfloat16),
                  k0.shape[1], strides[0], strides[1], strides[2], lm.shape[0], lm_kind,
                  _ptr(embed), _ptr(final_norm), _ptr(cos), _ptr(sin), _ptr(lm), _ptr(lm_scales),
                  int(int8_activations), _ptr(packed[-1])]
        fields = [p for i, pointers in enumerate(layers) for p in pointers + [_ptr(t) for t in packed[4 * i:4 * i + 4]]]
        descriptor = torch.tensor(header + fields, dtype=torch.int64)
        decoder = cls(fn, keep, descriptor, float(cfg.rms_norm_eps), lm.shape[0], max_tokens,
                      model.lm_head.gather_logits)
        if dtype == torch.bfloat16:
            decoder.bf16_path = ('amx' if features & _FEATURE_AMX else
                                 'vdpbf16ps' if features & _FEATURE_DPBF16 else 'fma')
        decoder.int8_amx = int8_activations and bool(features & _FEATURE_AMX_INT8) and weight_kind == _W_I8
        decoder.amx_packed_bytes = sum(t.nbytes for t in packed if t is not None)
        return decoder

    def run(self, inputs) -> torch.Tensor | None:
        """inputs: the step's StepInputs (worker/runner/model_runner.py) -> fp32 logits
        [len(sample_at), vocab] (no rows for a mid-prompt chunk; a view of the decoder's own
        buffer, overwritten by its next step), or None when the step has more than max_tokens
        tokens."""
        n = len(inputs.input_ids)
        if n > self.max_tokens:
            return None
        positions = torch.tensor(inputs.positions, dtype=torch.long)
        seq_lens = (positions + 1).to(torch.int32)  # each token attends to its request up to itself
        tables = inputs.block_table_tensor()
        width = tables.shape[1]
        if n != len(inputs.query_lens):  # a request with several tokens: its table once per token
            owner = torch.repeat_interleave(torch.arange(len(inputs.query_lens)), torch.tensor(inputs.query_lens))
            tables = tables[owner]
        tokens = torch.tensor(inputs.input_ids, dtype=torch.long)
        slots = torch.tensor(inputs.slot_mapping, dtype=torch.long)
        sample_rows = torch.tensor(inputs.sample_at, dtype=torch.long)
        if self._logits.shape[0] < len(inputs.sample_at):
            self._logits = torch.empty(self.max_tokens, self.vocab, dtype=torch.float32)
        logits = self._logits[:len(inputs.sample_at)]
        failed = self._fn(self._descriptor.data_ptr(), self._eps, n, tokens.data_ptr(), positions.data_ptr(),
                          slots.data_ptr(), tables.data_ptr(), width, seq_lens.data_ptr(), self._rows.data_ptr(),
                          sample_rows.data_ptr(), len(inputs.sample_at), torch.get_num_threads(), logits.data_ptr())
        if failed == 2:
            raise RuntimeError("native step: the library was built without AVX-512")
        if failed:
            raise MemoryError("native step: no memory for its workspace")
        self.steps_run += 1
        return self._gather_logits(logits)


def unavailable_reason() -> str | None:
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()} (the native step needs AVX-512)"
    if os.environ.get("KVMESH_NATIVE_DECODE", "1") == "0":
        return "disabled by KVMESH_NATIVE_DECODE=0"
    return cpu_build.unavailable_reason()


def _bf16_flags() -> tuple[str, ...]:
    """Compiler flags for the bf16 projection paths this CPU has (torch's own probes):
    VDPBF16PS with AVX512_BF16, and AMX tiles on top where it has them too."""
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return ()
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")  # every AMX CPU has both
    return ("-mavx512bf16",)


def _load():
    # -fopenmp: the step's threads are an OpenMP team; libgomp.so.1 resolves to the one torch
    # has already loaded (same soname), so the step runs on torch's own thread pool.
    lib = cpu_build.build("native_decode", cpu_paged_attention.C_SOURCE + _DECODER_SOURCE,
                           ("-fopenmp",) + _bf16_flags())
    if lib is None:
        return None
    fn = lib.kvmesh_native_decode
    fn.argtypes, fn.restype = _ENTRY_ARGTYPES, ctypes.c_int
    lib.kvmesh_native_decode_init.restype = lib.kvmesh_native_decode_features.restype = ctypes.c_int
    lib.kvmesh_native_decode_init()
    return fn, lib.kvmesh_native_decode_features()


# model.cpu_native_max_tokens auto for 16-bit models: native steps up to where the eager
# forward's GEMMs catch up (bf16, SmolLM2, docs/benchmarks.md, sixth round). With AMX the
# native projections are AMX tiles too and win at every size it takes (2 threads: 2.3x at 16
# tokens, 1.6x at 64; 1 thread 1.3x at 64): the largest step, 64. Without AMX they are
# VDPBF16PS / FMA GEMVs, ahead to about 12 tokens per thread (1 thread: 1.36x at 8, 1.07x at
# 12, 0.87x at 16; 2 threads: 1.35x at 16, 1.10x at 24, 0.92x at 32), measured to 2 threads,
# so no more than GEMV_MAX_TOKENS_CAP past them.
GEMV_TOKENS_PER_THREAD = 12
GEMV_MAX_TOKENS_CAP = 24


def amx_available() -> bool:
    """The native library built with its AMX path and Linux granted the tile state."""
    loaded = _load() if unavailable_reason() is None else None
    return loaded is not None and bool(loaded[1] & _FEATURE_AMX)


def auto_max_tokens(threads: int) -> int:
    if amx_available():
        return CPU_NATIVE_MAX_TOKENS
    return min(GEMV_MAX_TOKENS_CAP, GEMV_TOKENS_PER_THREAD * max(1, threads))


def max_tokens_for(configured: int | None, dtype: torch.dtype, threads: int) -> int:
    """model.cpu_native_max_tokens resolved: auto (None) is auto_max_tokens(threads) for
    16-bit models and 0 for fp32, which stays the eager, token-exact reference path unless
    asked."""
    if configured is not None:
        return configured
    return 0 if dtype == torch.float32 else auto_max_tokens(threads)


def install(runner, model, kv_caches: list, max_tokens: int, what: str = "the model",
            int8_activations: bool = False) -> str | None:
    """Sets runner.native_decoder, or logs once why the eager forward keeps every step and
    returns that reason (None when the native step is on)."""
    try:
        runner.native_decoder = decoder = NativeDecoder.build(model, kv_caches, max_tokens, int8_activations)
        logger.info("native step on for %s, steps of <= %d tokens%s%s%s", what, max_tokens,
                    f", bf16 projections by {decoder.bf16_path}" if decoder.bf16_path else "",
                    f" ({decoder.amx_packed_bytes / 2**20:.0f} MiB of weights re-laid for its tiles)"
                    if decoder.amx_packed_bytes else "",
                    ", int8 projections as int8 x int8 AMX products" if decoder.int8_amx else "")
    except NotTaken as why:
        logger.warning("native step not taken for %s (%s): eager forward", what, why)
        return str(why)
    return None
