/* The native step's projections in AVX2 + FMA, compiled into every variant (all of them have
   AVX2 + FMA + F16C):

     kvmesh_gemv_avx2   fp32 / bf16 (widened by a shift) / int8 with one scale a row: the avx2
                        build's path (the AVX-512 builds run projections.c's)
     kvmesh_gemv_int4   int4 groups as stored (quant.weight: int4, GGUF Q4_0 / Q4_1 / Q4_K
                        kept): every build's int4 path

   Both stream each weight row once per step for up to MAX_TOKENS_A_PASS tokens, whose fp32
   accumulators stay in registers (AVX2 has 16), so a batch of up to 8 decode rows reads its
   weights from memory once; more tokens re-read the row from L1. */
#include "kvmesh_cpu.h"

#define MAX_TOKENS_A_PASS 8
#define PREFETCH_ROWS 2  /* rows ahead: the hardware prefetcher alone under-reads these short rows */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

static inline float load_meta(const void *p, int64_t i, const int dtype) {
    if (dtype == META_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return load_elem(p, i, dtype == META_BF16);
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

/* One int4 row against C tokens: res[j] = W[n] . x[j]. Each group's weights are
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

void kvmesh_gemv_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                      int64_t B, float *y, int64_t ldy) {
    float res[MAX_TOKENS_A_PASS];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < B; b += MAX_TOKENS_A_PASS) {
            const int64_t c = B - b < MAX_TOKENS_A_PASS ? B - b : MAX_TOKENS_A_PASS;
            const float *xb = x + b * ldx;
            const int pf = b == 0;
            switch (c) {
                case 8: int4_row(p, n, K, xb, ldx, 8, pf, res); break;
                case 7: int4_row(p, n, K, xb, ldx, 7, pf, res); break;
                case 6: int4_row(p, n, K, xb, ldx, 6, pf, res); break;
                case 5: int4_row(p, n, K, xb, ldx, 5, pf, res); break;
                case 4: int4_row(p, n, K, xb, ldx, 4, pf, res); break;
                case 3: int4_row(p, n, K, xb, ldx, 3, pf, res); break;
                case 2: int4_row(p, n, K, xb, ldx, 2, pf, res); break;
                default: int4_row(p, n, K, xb, ldx, 1, pf, res);
            }
            for (int64_t j = 0; j < c; j++) y[(b + j) * ldy + n] = res[j];
        }
}
