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

/* int4 against int8 activations, as llama.cpp's AVX2 ggml_vec_dot_q4_1_q8_1: each token's row
   is quantized per 32-input block (one fp32 scale a block, its fp32 sum kept), laid out so a
   block's 16 code bytes line up with it unshuffled: the low nibbles (even inputs) then the high
   ones (odd inputs). A block's dot product is then one VPMADDUBSW (u8 codes x s8 activations)
   and one VPMADDWD, against the ~30 instructions of dequantizing 32 weights to fp32: with
   (code - zero) * scale + min, sum_k x_k w_k = scale * sum_k x_k (code_k - 8) + (min + (8 - zero)
   * scale) * sum_k x_k, the first from the int8 products, the second from the block's fp32 sum. */
typedef struct {
    int8_t *q;       /* [B][K] the blocks' inputs: even inputs then odd ones */
    float *scale;    /* [B][K / 32] */
    float *sum;      /* [B][K / 32] the fp32 inputs' sum */
    float *meta;     /* [2 + MAX_TOKENS_A_PASS][K / 32]: one row's block scales, shifts, scale products */
} Int8Rows;

static Int8Rows int8_rows(const float *x, int64_t ldx, int64_t B, int64_t K) {
    static __thread void *buf;
    static __thread size_t cap;
    /* + the row's block scales and shifts, and MAX_TOKENS_A_PASS rows of scale products */
    const size_t need = (size_t)(B * K) + sizeof(float) * (size_t)((2 * B + 2 + MAX_TOKENS_A_PASS) * (K / 32)) + 64;
    if (cap < need) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
    }
    Int8Rows r = {0, 0, 0, 0};
    if (!buf) return r;
    r.scale = (float *)buf;
    r.sum = r.scale + B * (K / 32);
    r.meta = r.sum + B * (K / 32);
    r.q = (int8_t *)(r.meta + (2 + MAX_TOKENS_A_PASS) * (K / 32));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i evens = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
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
            const __m256i pick = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                  0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            bytes = _mm256_shuffle_epi8(bytes, pick);  /* each 16: 8 evens then 8 odds */
            bytes = _mm256_permutevar8x32_epi32(bytes, evens);  /* 16 evens, then 16 odds */
            _mm256_storeu_si256((__m256i *)(r.q + b * K + k), bytes);
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

void kvmesh_gemv_int4(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                      int64_t B, float *y, int64_t ldy, const int a8) {
    float res[MAX_TOKENS_A_PASS];
    Int8Rows xr = {0, 0, 0, 0};
    if (a8) xr = int8_rows(x, ldx, B, K);
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
