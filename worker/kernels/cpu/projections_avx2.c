/* The native step's projections in AVX2 + FMA, compiled into every variant (all of them have
   AVX2 + FMA + F16C):

     kvmesh_gemv_avx2   fp32 / bf16 (widened by a shift) / int8 with one scale a row: the avx2
                        build's path (the AVX-512 builds run projections.c's)
     kvmesh_gemv_int4   int4 groups as stored (quant.weight: int4, GGUF Q4_0 / Q4_1 / Q4_K
                        kept): every build's int4 path
     kvmesh_gemv_i8g    int8 codes with one fp32 scale a 32-input group (an LM head that is a
                        GGUF Q8_0 table, read as stored instead of as its fp32 copy)

   Both stream each weight row once per step for up to MAX_TOKENS_A_PASS tokens, whose fp32
   accumulators stay in registers (AVX2 has 16), so a batch of up to 8 decode rows reads its
   weights from memory once; more tokens re-read the row from L1. */
#include <math.h>

#include "kvmesh_cpu.h"

#define MAX_TOKENS_A_PASS 8
/* passes of rows ahead that the Q8_0 head kernels prefetch: without it the head (49152 rows of
   576 bytes at batch 1) streamed at ~half the rate the int4 rows, which prefetch, reach */
#define I8G_PREFETCH_PASSES 2
#define PREFETCH_ROWS 2  /* rows ahead: the hardware prefetcher alone under-reads these short rows */

static inline __m256 load_w8(const char *row, int64_t k, const int kind) {
    if (kind == W_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k))));
    if (kind == W_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k))), 16));
    return _mm256_loadu_ps((const float *)row + k);
}

/* Two weight rows (r0, r1) against C tokens: res[i * C + j] = W[r_i] . x[j] (K % 8 == 0). */
static inline __attribute__((always_inline)) void tile2(const char *r0, const char *r1, int64_t K, const float *x,
                                                        int64_t ldx, const int C, const int kind, const int64_t ahead,
                                                        float *res) {
    __m256 acc[2][4];
    #pragma GCC unroll 4
    for (int j = 0; j < C; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const int64_t es = w_elem_size(kind);
    for (int64_t k = 0; k < K; k += 8) {
        if (ahead && ((k * es) & 63) == 0) {
            _mm_prefetch(r0 + ahead + k * es, _MM_HINT_T0);
            _mm_prefetch(r1 + ahead + k * es, _MM_HINT_T0);
        }
        const __m256 w0 = load_w8(r0, k, kind), w1 = load_w8(r1, k, kind);
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            const __m256 xv = _mm256_loadu_ps(x + j * ldx + k);
            acc[0][j] = _mm256_fmadd_ps(w0, xv, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(w1, xv, acc[1][j]);
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < C; j++) { res[j] = hsum8(acc[0][j]); res[C + j] = hsum8(acc[1][j]); }
}

void kvmesh_gemv_avx2(const void *w, const int kind, const void *scale, const int sbf16, int64_t K, int64_t n0,
                      int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy) {
    const int64_t row = K * w_elem_size(kind);
    const char *wc = (const char *)w;
    float res[8];
    for (int64_t n = n0; n < n1; n += 2) {
        const char *r0 = wc + n * row, *r1 = n + 1 < n1 ? r0 + row : r0;  /* an odd last row: twice */
        for (int64_t b = 0; b < B; b += 4) {
            const int64_t c = B - b < 4 ? B - b : 4, ahead = b == 0 ? PREFETCH_ROWS * 2 * row : 0;
            switch (c) {
                case 4: tile2(r0, r1, K, x + b * ldx, ldx, 4, kind, ahead, res); break;
                case 3: tile2(r0, r1, K, x + b * ldx, ldx, 3, kind, ahead, res); break;
                case 2: tile2(r0, r1, K, x + b * ldx, ldx, 2, kind, ahead, res); break;
                default: tile2(r0, r1, K, x + b * ldx, ldx, 1, kind, ahead, res);
            }
            for (int64_t j = 0; j < c; j++) {
                y[(b + j) * ldy + n] = res[j];
                if (n + 1 < n1) y[(b + j) * ldy + n + 1] = res[c + j];
            }
        }
    }
    if (kind == W_I8)
        for (int64_t b = 0; b < B; b++)
            for (int64_t m = n0; m < n1; m++) y[b * ldy + m] *= load_elem(scale, m, sbf16);
}


/* 32 codes (16 bytes: input 2i in the low nibble of byte i, 2i + 1 in the high one) as four
   vectors of 8 fp32 values in input order */
static inline __attribute__((always_inline)) void codes32(const uint8_t *p, __m256 *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  /* inputs 0-15, 16-31 */
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

/* One int4 row against C tokens, the general exact form (rows whose groups int4_fma_meta
   cannot fold): res[j] = W[n] . x[j]. Each group's weights are
   (code - zero) * scale + min, the subtraction exact and the rest one FMA: the product of a
   code and a GGUF scale is exact in fp32 (quant/gguf_layouts.py), so this rounds once where
   dequantize_int4_groupwise rounds once (its add of the min), and with no min the product
   is the only rounding in both: the weights are bit for bit the eager path's. */
static inline __attribute__((always_inline)) void int4_row(const kvmesh_int4 *p, int64_t n, int64_t K,
                                                           const float *x, int64_t ldx, const int C,
                                                           const int prefetch, float *res) {
    const int64_t groups = K / p->group;
    const uint8_t *codes = p->codes + n * (K / 2);
    __m256 acc[MAX_TOKENS_A_PASS];
    #pragma GCC unroll 8
    for (int j = 0; j < C; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = n * groups + g;
        const __m256 zero = _mm256_set1_ps(load_meta(p->zeros, at, p->zero_dtype));
        const __m256 scale = _mm256_set1_ps(load_meta(p->scales, at, p->scale_dtype));
        const __m256 min = _mm256_set1_ps(p->mins ? load_meta(p->mins, at, p->min_dtype) : 0.0f);
        for (int64_t k = g * p->group; k < (g + 1) * p->group; k += 32) {
            if (prefetch && (k & 127) == 0) _mm_prefetch((const char *)codes + PREFETCH_ROWS * (K / 2) + k / 2, _MM_HINT_T0);
            __m256 q[4];
            codes32(codes + k / 2, q);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m256 w = _mm256_fmadd_ps(_mm256_sub_ps(q[i], zero), scale, min);
                #pragma GCC unroll 8
                for (int j = 0; j < C; j++)
                    acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + j * ldx + k + 8 * i), acc[j]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < C; j++) res[j] = hsum8(acc[j]);
}

/* 32 bytes in input order -> the 16 even ones, then the 16 odd ones */
static inline __m256i evens_then_odds(__m256i bytes) {
    const __m256i pick = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    bytes = _mm256_shuffle_epi8(bytes, pick);  /* each 16: 8 evens then 8 odds */
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

/* int4 against int8 activations, as llama.cpp's AVX2 ggml_vec_dot_q4_1_q8_1: each token's row
   is quantized per 32-input block (one fp32 scale a block, its fp32 sum kept), laid out so a
   block's 16 code bytes line up with it unshuffled: the low nibbles (even inputs) then the high
   ones (odd inputs). A block's dot product is then one VPMADDUBSW (u8 codes x s8 activations)
   and one VPMADDWD, against the ~30 instructions of dequantizing 32 weights to fp32: with
   (code - zero) * scale + min, sum_k x_k w_k = scale * sum_k x_k (code_k - 8) + (min + (8 - zero)
   * scale) * sum_k x_k, the first from the int8 products, the second from the block's fp32 sum. */
Int8Rows kvmesh_int8_rows(const float *x, int64_t ldx, int64_t B, int64_t K, const int input_order) {
    static __thread void *buf;
    static __thread size_t cap;
    /* + the row's block scales and shifts, and MAX_TOKENS_A_PASS rows of scale products */
    const size_t need = (size_t)(B * K) + sizeof(float) * (size_t)((3 * B + 2 + MAX_TOKENS_A_PASS) * (K / 32)) + 64;
    if (cap < need) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
    }
    Int8Rows r = {0, 0, 0, 0, 0};
    if (!buf) return r;
    r.scale = (float *)buf;
    r.sum = r.scale + B * (K / 32);
    r.qsum8 = (int32_t *)(r.sum + B * (K / 32));
    r.meta = (float *)(r.qsum8 + B * (K / 32));
    r.q = (int8_t *)(r.meta + (2 + MAX_TOKENS_A_PASS) * (K / 32));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < K; k += 32) {
            const float *xb = x + b * ldx + k;
            __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
                total = _mm256_add_ps(total, v[i]);
            }
            __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            m = _mm_max_ss(m, _mm_movehdup_ps(m));
            const float top = _mm_cvtss_f32(m), scale = top > 0.0f ? top / 127.0f : 1.0f;
            const int64_t at = b * (K / 32) + k / 32;
            r.scale[at] = scale;
            r.sum[at] = hsum8(total);
            const __m256 inv = _mm256_set1_ps(1.0f / scale);
            __m256i qi[4];
            for (int i = 0; i < 4; i++)
                qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* 32 int32 -> 32 int8 in input order, then evens before odds */
            const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
            __m256i bytes = _mm256_packs_epi16(w01, w23);  /* lanes interleaved: 0-3 8-11 16-19 24-27 | 4-7 ... */
            bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  /* input order */
            if (!input_order) bytes = evens_then_odds(bytes);
            _mm256_storeu_si256((__m256i *)(r.q + b * K + k), bytes);
            const __m256i q16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
            __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1));
            q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4e));
            r.qsum8[at] = 8 * _mm_cvtsi128_si32(_mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xb1)));
        }
    return r;
}

/* Row n's per-block scale and shift (min + (8 - zero) * scale, what the centred codes leave out)
   into meta[0 .. blocks) and meta[blocks .. 2 blocks): eight groups a vector where each block
   is a group with fp16 metadata (GGUF Q4_0 / Q4_1), else one group at a time. */
static void int4_block_meta(const kvmesh_int4 *p, int64_t n, int64_t K, float *meta) {
    const int64_t groups = K / p->group, blocks = K / 32, per = p->group / 32;
    float *scale = meta, *shift = meta + blocks;
    int64_t g = 0;
    if (per == 1 && p->scale_dtype == META_F16 && p->zero_dtype == META_F16 && (!p->mins || p->min_dtype == META_F16))
        for (; g + 8 <= groups; g += 8) {
            const int64_t at = n * groups + g;
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->scales + at)));
            const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->zeros + at)));
            const __m256 m = p->mins ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->mins + at)))
                                     : _mm256_setzero_ps();
            _mm256_storeu_ps(scale + g, s);
            _mm256_storeu_ps(shift + g, _mm256_fmadd_ps(_mm256_sub_ps(_mm256_set1_ps(8.0f), z), s, m));
        }
    for (; g < groups; g++) {
        const int64_t at = n * groups + g;
        const float s = load_meta(p->scales, at, p->scale_dtype);
        const float shifted = (p->mins ? load_meta(p->mins, at, p->min_dtype) : 0.0f)
                              + (8.0f - load_meta(p->zeros, at, p->zero_dtype)) * s;
        for (int64_t b = g * per; b < (g + 1) * per; b++) { scale[b] = s; shift[b] = shifted; }
    }
}

/* sum of a[i] * b[i], i < n */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum8(acc);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* One int4 row against C tokens' int8 rows: res[j] = W[n] . x[j]. meta: the row's block scales
   and shifts (int4_block_meta); sx: room for C x blocks products of the block scale and each
   token's block scale, so the inner loop broadcasts one float from memory a block and token. */
static inline __attribute__((always_inline)) void int4_row_i8(const kvmesh_int4 *p, int64_t n, int64_t K,
                                                              const Int8Rows *xr, const int64_t b0, const int C,
                                                              const int prefetch, const float *meta, float *sx,
                                                              float *res) {
    const int64_t blocks = K / 32;
    const uint8_t *codes = p->codes + n * (K / 2);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1), eight = _mm256_set1_epi8(8);
    __m256 acc[MAX_TOKENS_A_PASS];
    #pragma GCC unroll 8
    for (int j = 0; j < C; j++) {
        acc[j] = _mm256_setzero_ps();
        const float *xs = xr->scale + (b0 + j) * blocks;
        int64_t b = 0;
        for (; b + 8 <= blocks; b += 8)
            _mm256_storeu_ps(sx + j * blocks + b, _mm256_mul_ps(_mm256_loadu_ps(meta + b), _mm256_loadu_ps(xs + b)));
        for (; b < blocks; b++) sx[j * blocks + b] = meta[b] * xs[b];
    }
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t k = blk * 32;
        if (prefetch && (k & 127) == 0) _mm_prefetch((const char *)codes + PREFETCH_ROWS * (K / 2) + k / 2, _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128((const __m128i *)(codes + k / 2));
        /* codes - 8, evens | odds: centred, so the int8 products' sum and the fp32 shift term
           stay small beside the result (codes 0..15 against a zero near 8 would make them
           both large and cancel) */
        const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4), eight);
        const __m256i aq = _mm256_sign_epi8(q, q);  /* |q| for VPMADDUBSW's unsigned operand */
        #pragma GCC unroll 8
        for (int j = 0; j < C; j++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->q + (b0 + j) * K + k));
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(xq, q)), ones);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(sx + j * blocks + blk), acc[j]);
        }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < C; j++) res[j] = hsum8(acc[j]) + dot_f32(meta + blocks, xr->sum + (b0 + j) * blocks, blocks);
}

/* Rows [n0, n1) one at a time: int4_row_i8 (a8), else int4_row (a8 = 0, or no memory for the int8 rows). */
static void int4_rows_one_by_one(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                 int64_t ldx, int64_t B, float *y, int64_t ldy, const int a8) {
    float res[MAX_TOKENS_A_PASS];
    Int8Rows xr = {0, 0, 0, 0, 0};
    if (a8) xr = kvmesh_int8_rows(x, ldx, B, K, 0);
    const int int8 = xr.q != 0;  /* no memory for the int8 rows: the fp32 path */
    const int64_t blocks = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        if (int8) int4_block_meta(p, n, K, xr.meta);
        for (int64_t b = 0; b < B; b += MAX_TOKENS_A_PASS) {
            const int64_t c = B - b < MAX_TOKENS_A_PASS ? B - b : MAX_TOKENS_A_PASS;
            const float *xb = x + b * ldx;
            const int pf = b == 0;
#define INT4_ROW(C) do { if (int8) int4_row_i8(p, n, K, &xr, b, C, pf, xr.meta, xr.meta + 2 * blocks, res); \
                         else int4_row(p, n, K, xb, ldx, C, pf, res); } while (0)
            switch (c) {
                case 8: INT4_ROW(8); break;
                case 7: INT4_ROW(7); break;
                case 6: INT4_ROW(6); break;
                case 5: INT4_ROW(5); break;
                case 4: INT4_ROW(4); break;
                case 3: INT4_ROW(3); break;
                case 2: INT4_ROW(2); break;
                default: INT4_ROW(1);
            }
#undef INT4_ROW
            for (int64_t j = 0; j < c; j++) y[(b + j) * ldy + n] = res[j];
        }
    }
}

/* The exact path's fast form. Each weight is fmadd(code, scale, c) with c = min - zero * scale
   folded per group: bit for bit dequantize_int4_groupwise's (code - zero) * scale + min where
   that fold is exact (int4_fma_meta says where), so it keeps the eager weights while spending
   per 16 weights one widening load, an AND, a shift, two conversions and two FMAs, then two
   FMAs a token. The 16 codes of 8 bytes widen to 32-bit lanes holding byte i: its low nibble is
   input 2i, the high one input 2i + 1, so the tokens' rows are laid out once a call as the
   codes are (each 16 inputs: the 8 even ones, then the 8 odd ones) and no code is shuffled.
   Several rows a pass share each load of a token's inputs (batch 1: 4 rows); up to 8 tokens a
   pass share each row's dequantized weights (rows x tokens <= 8 accumulators). */
#define I4_TILE_ACCUMULATORS 8

/* TILE(R, C) with constant R x C (<= 8 accumulators) for run-time r rows (4, 2 or 1), c tokens */
#define TILE_BY_SHAPE(TILE, r, c) do {                                                                       \
    if ((r) == 4) {                                                                                         \
        if ((c) == 2) TILE(4, 2); else TILE(4, 1);                                                          \
    } else if ((r) == 2) {                                                                                  \
        switch (c) { case 4: TILE(2, 4); break; case 3: TILE(2, 3); break; case 2: TILE(2, 2); break;       \
                     default: TILE(2, 1); }                                                                 \
    } else {                                                                                                \
        switch (c) { case 8: TILE(1, 8); break; case 7: TILE(1, 7); break; case 6: TILE(1, 6); break;       \
                     case 5: TILE(1, 5); break; case 4: TILE(1, 4); break; case 3: TILE(1, 3); break;       \
                     case 2: TILE(1, 2); break; default: TILE(1, 1); }                                      \
    }                                                                                                       \
} while (0)

/* rows a pass for B tokens: 4 at batch 1-2, 2 at 3-4, then 1 (rows x tokens <= 8 accumulators) */
static inline int rows_a_pass(int64_t B) { return B >= 5 ? 1 : B >= 3 ? 2 : 4; }
/* the same for the factorised tiles' rows x tokens <= 4 accumulators: 4 at batch 1, 2 at 2, then 1 */
static inline int rows_a_pass4(int64_t B) { return B >= 3 ? 1 : B == 2 ? 2 : 4; }


/* Row n's group scales into meta[0, G) and offsets c into meta[G, 2G); 0 where a group cannot
   fold exactly. With zero 0, c is the min: the same FMA as the general form (int4_row), whose
   one rounding is eager's where code * scale is exact (every GGUF type's). Otherwise only with
   no min and an integer zero whose product with the scale is exact (GGUF Q4_0's 8 x an fp16
   scale; kvmesh's int4 in a 16-bit dtype): c = -zero * scale, and the FMA's one rounding of
   code * scale - zero * scale is eager's one rounding of (code - zero) * scale. kvmesh's int4
   in fp32 (fp32 scales) mostly takes the general form. */
static int int4_fma_meta(const kvmesh_int4 *p, int64_t n, int64_t G, float *meta) {
    float *sc = meta, *off = meta + G;
    const int64_t at = n * G;
    const __m256 zero = _mm256_setzero_ps();
    __m256 bad = zero;
    /* whole vectors of 8 groups; a tail of G % 8 groups as the last 8 again (overlapping: the
       same values stored twice), since the scalar groups cost as much as the vectors */
    int64_t g = 0;
    for (; g < G && G >= 8; g += 8) {
        if (g + 8 > G) g = G - 8;
        const __m256 s = load8_meta(p->scales, at + g, p->scale_dtype), z = load8_meta(p->zeros, at + g, p->zero_dtype);
        const __m256 m = p->mins ? load8_meta(p->mins, at + g, p->min_dtype) : zero;
        const __m256 prod = _mm256_mul_ps(z, s), z0 = _mm256_cmp_ps(z, zero, _CMP_EQ_OQ);
        const __m256 integer = _mm256_cmp_ps(z, _mm256_round_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                             _CMP_EQ_OQ);
        const __m256 exact = _mm256_cmp_ps(_mm256_fmsub_ps(z, s, prod), zero, _CMP_EQ_OQ);
        const __m256 folds = _mm256_or_ps(z0, _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(m, zero, _CMP_EQ_OQ), integer), exact));
        bad = _mm256_or_ps(bad, _mm256_xor_ps(folds, _mm256_castsi256_ps(_mm256_set1_epi32(-1))));
        _mm256_storeu_ps(sc + g, s);
        _mm256_storeu_ps(off + g, _mm256_blendv_ps(_mm256_sub_ps(zero, prod), m, z0));
    }
    if (_mm256_movemask_ps(bad)) return 0;
    for (; g < G; g++) {
        const float s = load_meta(p->scales, at + g, p->scale_dtype), z = load_meta(p->zeros, at + g, p->zero_dtype);
        const float m = p->mins ? load_meta(p->mins, at + g, p->min_dtype) : 0.0f, prod = z * s;
        sc[g] = s;
        if (z == 0.0f) { off[g] = m; continue; }
        if (m != 0.0f || z != rintf(z) || fmaf(z, s, -prod) != 0.0f) return 0;
        off[g] = -prod;
    }
    return 1;
}

/* The tokens' rows in the codes' order (each 16 inputs: 8 even, then 8 odd), in a per-thread
   buffer with `extra` floats after them for the rows' metadata; NULL: no memory. */
static float *nibble_ordered_rows(const float *x, int64_t ldx, int64_t B, int64_t K, int64_t extra) {
    static __thread float *buf;
    static __thread size_t cap;
    const size_t need = sizeof(float) * (size_t)(B * K + extra);
    if (cap < need) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
    }
    if (!buf) return NULL;
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < K; k += 16) {
            const __m256 lo = _mm256_loadu_ps(x + b * ldx + k), hi = _mm256_loadu_ps(x + b * ldx + k + 8);
            /* shuffle_ps picks within 128-bit lanes: lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6; the
               64-bit permute puts the lanes' halves in order */
            const __m256d even = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88));
            const __m256d odd = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd));
            _mm256_storeu_ps(buf + b * K + k, _mm256_castpd_ps(_mm256_permute4x64_pd(even, 0xd8)));
            _mm256_storeu_ps(buf + b * K + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(odd, 0xd8)));
        }
    return buf;
}

/* 16 codes of 8 bytes as fp32: the low nibbles (inputs 2i) into even, the high ones into odd */
static inline __attribute__((always_inline)) void codes16(const uint8_t *p, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
    *odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* R rows from `codes` (their metadata: meta + 2 G r) against C nibble-ordered token rows:
   res[r * C + j]. */
static inline __attribute__((always_inline)) void int4_tile(const uint8_t *codes, int64_t K, int64_t group,
                                                            const float *meta, int64_t G, const float *xp, const int R,
                                                            const int C, const int prefetch, float *res) {
    __m256 acc[4][I4_TILE_ACCUMULATORS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 s[4], c[4];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            s[r] = _mm256_broadcast_ss(meta + 2 * G * r + g);
            c[r] = _mm256_broadcast_ss(meta + 2 * G * r + G + g);
            if (prefetch && ((g * group) & 127) == 0)  /* the rows of the next pass */
                _mm_prefetch((const char *)codes + (r + R) * (K / 2) + g * group / 2, _MM_HINT_T0);
        }
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
            __m256 even[4], odd[4];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                codes16(codes + r * (K / 2) + k / 2, &even[r], &odd[r]);
                even[r] = _mm256_fmadd_ps(even[r], s[r], c[r]);
                odd[r] = _mm256_fmadd_ps(odd[r], s[r], c[r]);
            }
            #pragma GCC unroll 8
            for (int j = 0; j < C; j++) {
                const __m256 xe = _mm256_loadu_ps(xp + j * K + k), xo = _mm256_loadu_ps(xp + j * K + k + 8);
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(odd[r], xo, _mm256_fmadd_ps(even[r], xe, acc[r][j]));
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}

/* The factorised form of int4_tile: with w = code * s + c per group, W[n] . x = sum_g s_g (sum_k
   code_k x_k) + sum_g c_g X_g (X_g: the group's input sum, xsum[j * G + g]), so each weight costs
   one FMA a token and no dequantizing FMA. Not bit for bit eager's weights (each product
   rounds as code x input, then the group's sum as x scale): fp32 sums in another order. Up to 4
   accumulators (R x C <= 4), each with its group's partial sum beside it. */
#define I4F_TILE_ACCUMULATORS 4

static inline __attribute__((always_inline)) void int4_tile_factored(const uint8_t *codes, int64_t K, int64_t group,
                                                                     const float *meta, int64_t G, const float *xp,
                                                                     const float *xsum, const int R, const int C,
                                                                     const int prefetch, float *res) {
    __m256 acc[4][I4F_TILE_ACCUMULATORS], part[4][I4F_TILE_ACCUMULATORS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) part[r][j] = _mm256_setzero_ps();
            if (prefetch && ((g * group) & 127) == 0)  /* the rows of the next pass */
                _mm_prefetch((const char *)codes + (r + R) * (K / 2) + g * group / 2, _MM_HINT_T0);
        }
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
            __m256 even[4], odd[4];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) codes16(codes + r * (K / 2) + k / 2, &even[r], &odd[r]);
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) {
                const __m256 xe = _mm256_loadu_ps(xp + j * K + k), xo = _mm256_loadu_ps(xp + j * K + k + 8);
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    part[r][j] = _mm256_fmadd_ps(odd[r], xo, _mm256_fmadd_ps(even[r], xe, part[r][j]));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_broadcast_ss(meta + 2 * G * r + g);
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) acc[r][j] = _mm256_fmadd_ps(part[r][j], s, acc[r][j]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]) + dot_f32(meta + 2 * G * r + G, xsum + j * G, G);
}

/* TILE(R, C) with constant R x C <= 4 for run-time r rows (4, 2 or 1), c tokens */
#define TILE_BY_SHAPE4(TILE, r, c) do {                                                                      \
    if ((r) == 4) TILE(4, 1);                                                                               \
    else if ((r) == 2) { if ((c) == 2) TILE(2, 2); else TILE(2, 1); }                                       \
    else switch (c) { case 4: TILE(1, 4); break; case 3: TILE(1, 3); break; case 2: TILE(1, 2); break;      \
                      default: TILE(1, 1); }                                                                \
} while (0)

/* The exact path: rows [n0, n1) in passes of R rows x up to 8 / R tokens (the factorised form:
   4 / R); 0 where there was no memory for the reordered rows (nothing written). */
static int int4_gemv_exact(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                           int64_t B, float *y, int64_t ldy, const int factored) {
    const int64_t G = K / p->group;
    float *xp = nibble_ordered_rows(x, ldx, B, K, 2 * 4 * G + B * G);
    if (!xp) return 0;
    float *own = xp + B * K, *xsum = own + 2 * 4 * G, res[I4_TILE_ACCUMULATORS];
    const int64_t tile = factored ? I4F_TILE_ACCUMULATORS : I4_TILE_ACCUMULATORS;
    if (factored)
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < G; g++) {
                float total = 0.0f;
                for (int64_t k = g * p->group; k < (g + 1) * p->group; k++) total += x[b * ldx + k];
                xsum[b * G + g] = total;
            }
    for (int64_t n = n0; n < n1;) {
        const int pass = factored ? rows_a_pass4(B) : rows_a_pass(B);
        const int R = n1 - n >= pass ? pass : 1;
        int folds = 1;
        const float *meta = p->meta ? p->meta + n * 2 * G : own;  /* made at load, or now */
        for (int r = 0; r < R && folds && !p->meta; r++) folds = int4_fma_meta(p, n + r, G, own + 2 * G * r);
        if (!folds) {
            int4_rows_one_by_one(p, K, n, n + R, x, ldx, B, y, ldy, 0);
            n += R;
            continue;
        }
        const uint8_t *codes = p->codes + n * (K / 2);
        for (int64_t b = 0; b < B;) {
            const int c = (int)(B - b < tile / R ? B - b : tile / R);
            const float *xb = xp + b * K;
            if (factored) {
#define I4F_TILE(R_, C_) int4_tile_factored(codes, K, p->group, meta, G, xb, xsum + b * G, R_, C_, b == 0, res)
                TILE_BY_SHAPE4(I4F_TILE, R, c);
#undef I4F_TILE
            } else {
#define I4_TILE(R_, C_) int4_tile(codes, K, p->group, meta, G, xb, R_, C_, b == 0, res)
                TILE_BY_SHAPE(I4_TILE, R, c);
#undef I4_TILE
            }
            for (int r = 0; r < R; r++)
                for (int j = 0; j < c; j++) y[(b + j) * ldy + n + r] = res[r * c + j];
            b += c;
        }
        n += R;
    }
    return 1;
}

void kvmesh_gemv_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                      int64_t B, float *y, int64_t ldy, const int form) {
    if (p->interleaved) {  /* 8-row panels: int4_panels.c */
        if (form != INT4_A8 || !kvmesh_gemv_int4_panels(p, K, n0, n1, x, ldx, B, y, ldy))
            kvmesh_gemv_int4_panels_fp32(p, K, n0, n1, x, ldx, B, y, ldy);
        return;
    }
    if (form != INT4_A8 && kvmesh_gemm_int4(p, K, n0, n1, x, ldx, B, y, ldy)) return;  /* many tokens */
    if (form != INT4_A8 && int4_gemv_exact(p, K, n0, n1, x, ldx, B, y, ldy, form == INT4_FACTORED)) return;
    int4_rows_one_by_one(p, K, n0, n1, x, ldx, B, y, ldy, form == INT4_A8);
}

/* R rows of int8 codes (one fp32 scale a 32-input group) against C fp32 token rows: res[r * C + j].
   Each weight is code * scale, exact for a GGUF Q8_0 table (a 7-bit code times an fp16 scale),
   so the weights are those of its fp32 copy, read at a quarter of its bytes.
   Factorised as int4_tile_factored: per group, sum code x input (one FMA a weight and token,
   no multiply by the scale), then that sum times the group's scale; fp32 sums rounded in
   another order than code * scale * input. R x C <= 4. */
static inline __attribute__((always_inline)) void i8g_tile_factored(const int8_t *codes, const float *scales,
                                                                    int64_t K, const float *x, int64_t ldx,
                                                                    const int R, const int C, const int prefetch,
                                                                    float *res) {
    const int64_t G = K / 32;
    __m256 acc[4][I4F_TILE_ACCUMULATORS], part[4][I4F_TILE_ACCUMULATORS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) part[r][j] = _mm256_setzero_ps();
            if (prefetch && (g & 1) == 0)  /* the rows a pass ahead: a 64-byte line is two groups */
                _mm_prefetch((const char *)(codes + (r + I8G_PREFETCH_PASSES * R) * K + 32 * g), _MM_HINT_T0);
        }
        #pragma GCC unroll 4
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 8) {
            __m256 w[4];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                w[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + r * K + k))));
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) {
                const __m256 xv = _mm256_loadu_ps(x + j * ldx + k);
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) part[r][j] = _mm256_fmadd_ps(w[r], xv, part[r][j]);
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_broadcast_ss(scales + r * G + g);
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) acc[r][j] = _mm256_fmadd_ps(part[r][j], s, acc[r][j]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}

void kvmesh_gemv_i8g(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1, const float *x,
                     int64_t ldx, int64_t B, float *y, int64_t ldy) {
    if (kvmesh_gemm_i8g(w, scales, K, n0, n1, x, ldx, B, y, ldy)) return;  /* many tokens */
    float res[I4F_TILE_ACCUMULATORS];
    for (int64_t n = n0; n < n1;) {
        const int pass = rows_a_pass4(B);
        const int R = n1 - n >= pass ? pass : 1;
        const int8_t *codes = w + n * K;
        const float *sc = scales + n * (K / 32);
        for (int64_t b = 0; b < B;) {
            const int c = (int)(B - b < I4F_TILE_ACCUMULATORS / R ? B - b : I4F_TILE_ACCUMULATORS / R);
#define I8G_TILE_F(R_, C_) i8g_tile_factored(codes, sc, K, x + b * ldx, ldx, R_, C_, b == 0, res)
            TILE_BY_SHAPE4(I8G_TILE_F, R, c);
#undef I8G_TILE_F
            for (int r = 0; r < R; r++)
                for (int j = 0; j < c; j++) y[(b + j) * ldy + n + r] = res[r * c + j];
            b += c;
        }
        n += R;
    }
}

/* R rows of int8 codes (one fp32 scale a 32-input group) against C tokens' int8 rows (input
   order): res[r * C + j]. A group's dot product is one VPMADDUBSW (|code| against the token's
   int8 values carrying the code's sign; |code| <= 128, so a pair's sum stays below 2^15) and
   one VPMADDWD, then one FMA by the code's scale times the token's block scale (llama.cpp's
   Q8_0 x Q8_0). */
static inline __attribute__((always_inline)) void i8g_tile_a8(const int8_t *codes, const float *scales, int64_t K,
                                                              const Int8Rows *xr, int64_t b0, const int R, const int C,
                                                              const int prefetch, float *res) {
    const int64_t G = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i w[4], aw[4];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if (prefetch && (g & 1) == 0)
                _mm_prefetch((const char *)(codes + (r + I8G_PREFETCH_PASSES * R) * K + 32 * g), _MM_HINT_T0);
            w[r] = _mm256_loadu_si256((const __m256i *)(codes + r * K + 32 * g));
            aw[r] = _mm256_sign_epi8(w[r], w[r]);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->q + (b0 + j) * K + 32 * g));
            const float xs = xr->scale[(b0 + j) * G + g];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xq, w[r])), ones);
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scales[r * G + g] * xs), acc[r][j]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}

void kvmesh_gemv_i8g_a8(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1, const float *x,
                        int64_t ldx, int64_t B, float *y, int64_t ldy) {
    const Int8Rows xr = kvmesh_int8_rows(x, ldx, B, K, 1);
    if (!xr.q) {  /* no memory for the int8 rows: fp32 activations */
        kvmesh_gemv_i8g(w, scales, K, n0, n1, x, ldx, B, y, ldy);
        return;
    }
    float res[I4F_TILE_ACCUMULATORS];
    for (int64_t n = n0; n < n1;) {
        const int pass = rows_a_pass4(B);
        const int R = n1 - n >= pass ? pass : 1;
        const int8_t *codes = w + n * K;
        const float *sc = scales + n * (K / 32);
        for (int64_t b = 0; b < B;) {
            const int c = (int)(B - b < I4F_TILE_ACCUMULATORS / R ? B - b : I4F_TILE_ACCUMULATORS / R);
#define I8G_TILE_A8(R_, C_) i8g_tile_a8(codes, sc, K, &xr, b, R_, C_, b == 0, res)
            TILE_BY_SHAPE4(I8G_TILE_A8, R, c);
#undef I8G_TILE_A8
            for (int r = 0; r < R; r++)
                for (int j = 0; j < c; j++) y[(b + j) * ldy + n + r] = res[r * c + j];
            b += c;
        }
        n += R;
    }
}
