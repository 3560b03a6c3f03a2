/* The batched projections in AVX2 + FMA, compiled into every variant: steps of many rows (a
   decode batch of 8-64 requests, a prefill chunk) through the int4 layers and a GGUF Q8_0 LM
   head.

   The per-row kernels (projections_avx2.c) dequantize a weight row in registers for every pass
   of up to 4-8 tokens and sum each token's row in one accumulator chain per token: at 64
   tokens they dequantize every weight 16 times, and their few chains leave the FMA units
   waiting on each FMA's latency (4 cycles on Zen 3, 2 FMA units: 8 independent chains are
   needed to keep both busy). Here a panel of PANEL_ROWS weight rows is dequantized once per
   call into a per-thread fp32 buffer (L1), bit for bit the per-row exact form's weights:
   (code - zero) * scale + min, one FMA (int4, as int4_row), code * scale (Q8_0, exact in
   fp32), then PANEL_ROWS rows x TILE_TOKENS tokens = 12 independent accumulators run over K
   with 3 weight loads (L1) and 4 token loads (L1/L2) per 12 FMAs in 16 registers (a 4 x 3 tile
   needs 17: the compiler re-loads a row for each token), FMA-bound. Only the fp32
   order of the sums differs from eager's (the tests hold it within 1e-5 and to HF's tokens).

   Taken from kvmesh_gemm_min_rows tokens on (kvmesh_set_gemm_min_rows; the A/B benchmark
   load_tests/bench_batched_step.py moves it), for int4 layers with fp32 activations (both the
   exact and the factorised form: the weights here are the exact form's) and Q8_0 heads. */
#include "kvmesh_cpu.h"

#define PANEL_ROWS 3
#define TILE_TOKENS 4

static int gemm_min_rows = KVMESH_GEMM_DEFAULT_MIN_ROWS;

int kvmesh_set_gemm_min_rows(int rows) {
    const int before = gemm_min_rows;
    gemm_min_rows = rows;
    return before;
}

int kvmesh_gemm_min_rows(void) { return gemm_min_rows; }

/* A per-thread panel of PANEL_ROWS x K fp32 weights; NULL: no memory. */
static float *panel_buffer(int64_t K) {
    static __thread float *buf;
    static __thread size_t cap;
    const size_t need = sizeof(float) * (size_t)(PANEL_ROWS * K) + 64;
    if (cap < need) {
        free(buf);
        buf = (float *)aligned_alloc(64, (need + 63) / 64 * 64);
        cap = buf ? need : 0;
    }
    return buf;
}

/* int4 row n dequantized into out[0, K): (code - zero) * scale + min per group, the one FMA of
   projections_avx2.c's int4_row (its weights are eager's bit for bit: see there). */
static void int4_dequant_row(const kvmesh_int4 *p, int64_t n, int64_t K, float *out) {
    const int64_t groups = K / p->group;
    const uint8_t *codes = p->codes + n * (K / 2);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = n * groups + g;
        const __m256 zero = _mm256_set1_ps(load_meta(p->zeros, at, p->zero_dtype));
        const __m256 scale = _mm256_set1_ps(load_meta(p->scales, at, p->scale_dtype));
        const __m256 min = _mm256_set1_ps(p->mins ? load_meta(p->mins, at, p->min_dtype) : 0.0f);
        for (int64_t k = g * p->group; k < (g + 1) * p->group; k += 32) {
            /* 16 bytes: input 2i in the low nibble of byte i, 2i + 1 in the high one */
            const __m128i v = _mm_loadu_si128((const __m128i *)(codes + k / 2));
            const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  /* inputs 0-15, 16-31 */
            const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
            for (int i = 0; i < 4; i++) {
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
                _mm256_store_ps(out + k + 8 * i, _mm256_fmadd_ps(_mm256_sub_ps(q, zero), scale, min));
            }
        }
    }
}

/* Q8_0 row n (codes [N][K], one fp32 scale a 32-input group) into out[0, K): code * scale. */
static void i8g_dequant_row(const int8_t *w, const float *scales, int64_t n, int64_t K, float *out) {
    const int8_t *codes = w + n * K;
    const float *sc = scales + n * (K / 32);
    for (int64_t k = 0; k < K; k += 32) {
        const __m256 s = _mm256_set1_ps(sc[k / 32]);
        for (int i = 0; i < 4; i++)
            _mm256_store_ps(out + k + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(codes + k + 8 * i)))), s));
    }
}

/* R panel rows (w [R][K]) against C token rows: res[r * C + j] = w[r] . x[j] (K % 8 == 0). */
static inline __attribute__((always_inline)) void panel_tile(const float *w, int64_t K, const float *x, int64_t ldx,
                                                             const int R, const int C, float *res) {
    __m256 acc[PANEL_ROWS][TILE_TOKENS];
    #pragma GCC unroll 3
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[PANEL_ROWS];
        #pragma GCC unroll 3
        for (int r = 0; r < R; r++) wv[r] = _mm256_load_ps(w + r * K + k);
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            const __m256 xv = _mm256_loadu_ps(x + j * ldx + k);
            #pragma GCC unroll 3
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
        }
    }
    #pragma GCC unroll 3
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}

/* Rows the next panel takes of `left`: 3, and 2 + 2 for the last 4 (a 16-row chunk: 3 3 3 3 2 2) */
static inline int panel_rows(int64_t left) { return left == 4 ? 2 : left >= 3 ? 3 : (int)left; }

/* The panel's R rows (n..n + R) against every token: y[b * ldy + n + r]. */
static void panel_times_tokens(const float *panel, int64_t K, const int R, int64_t n, const float *x, int64_t ldx,
                               int64_t B, float *y, int64_t ldy) {
    float res[PANEL_ROWS * TILE_TOKENS];
    for (int64_t b = 0; b < B; b += TILE_TOKENS) {
        const int C = (int)(B - b < TILE_TOKENS ? B - b : TILE_TOKENS);
        const float *xb = x + b * ldx;
#define TILE(R_, C_) panel_tile(panel, K, xb, ldx, R_, C_, res)
#define TOKENS(R_) do { switch (C) { case 4: TILE(R_, 4); break; case 3: TILE(R_, 3); break;             \
                                     case 2: TILE(R_, 2); break; default: TILE(R_, 1); } } while (0)
        if (R == 3) TOKENS(3); else if (R == 2) TOKENS(2); else TOKENS(1);
#undef TOKENS
#undef TILE
        for (int r = 0; r < R; r++)
            for (int j = 0; j < C; j++) y[(b + j) * ldy + n + r] = res[r * C + j];
    }
}

int kvmesh_gemm_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B,
                     float *y, int64_t ldy) {
    if (B < gemm_min_rows || K % 32) return 0;
    float *panel = panel_buffer(K);
    if (!panel) return 0;
    for (int64_t n = n0; n < n1;) {
        const int R = panel_rows(n1 - n);
        for (int r = 0; r < R; r++) int4_dequant_row(p, n + r, K, panel + r * K);
        panel_times_tokens(panel, K, R, n, x, ldx, B, y, ldy);
        n += R;
    }
    return 1;
}

int kvmesh_gemm_i8g(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1, const float *x,
                    int64_t ldx, int64_t B, float *y, int64_t ldy) {
    if (B < gemm_min_rows || K % 32) return 0;
    float *panel = panel_buffer(K);
    if (!panel) return 0;
    for (int64_t n = n0; n < n1;) {
        const int R = panel_rows(n1 - n);
        for (int r = 0; r < R; r++) i8g_dequant_row(w, scales, n + r, K, panel + r * K);
        panel_times_tokens(panel, K, R, n, x, ldx, B, y, ldy);
        n += R;
    }
    return 1;
}
