/* int4 x int8 activations over codes laid out in 8-row panels: llama.cpp's repacked Q4_0x8
   idea (ggml-cpu repack.cpp, block_q4_0x8 and ggml_gemv_q4_0_8x8_q8_0), so each load of a
   token's activations serves eight output rows and the eight rows' sums land in the eight
   lanes of one vector: no horizontal sum a row, and the rows' scales are one vector a group.

   Layout (quant/primitives.interleave_int4_rows writes it, in place: the panel keeps its
   bytes): rows [8P, 8P + 8) of a projection hold, for each 32-input block b, 128 bytes in four
   chunks of 32; chunk c holds, row by row, each row's code bytes 4c .. 4c + 3 of the block. So
   32-bit lane r of a chunk is row r's: its low nibbles are the block's inputs 8c, 8c + 2, 8c
   + 4, 8c + 6, which are the token's int8 q[4c .. 4c + 4) (kvmesh_int8_rows puts a block's
   even inputs first), and its high nibbles inputs 8c + 1, ..., q[16 + 4c .. 16 + 4c + 4).
   One VPMADDUBSW of the unsigned codes against those four activation bytes broadcast to every
   lane gives each row two pair sums (VPDPBUSD on AVX512-VNNI builds adds the four at once).

   The arithmetic is the per-row INT4_A8 kernel's (projections_avx2.c): with codes centred at
   8, sum_k x_k w_k = scale * sum_k x_k (code_k - 8) + shift * sum_k x_k, shift = min + (8 -
   zero) * scale; the centring is exact in integers (sum code x q - 8 sum q, kvmesh_int8_rows
   keeps 8 sum q a block). */
#include <math.h>

#include "kvmesh_cpu.h"

#define PANEL_ROWS 8
#define PANEL_TOKENS 4  /* tokens a pass: 3 x 4 vectors of sums + the codes' 3 fit AVX2's 16 registers */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PANEL_VNNI 1
#else
#define PANEL_VNNI 0
#endif

/* out[i * 8 + r] = in[r][i]: eight vectors of eight rows' values into eight of eight columns */
static inline void transpose8(const __m256 *in, float *out) {
    const __m256 t0 = _mm256_unpacklo_ps(in[0], in[1]), t1 = _mm256_unpackhi_ps(in[0], in[1]);
    const __m256 t2 = _mm256_unpacklo_ps(in[2], in[3]), t3 = _mm256_unpackhi_ps(in[2], in[3]);
    const __m256 t4 = _mm256_unpacklo_ps(in[4], in[5]), t5 = _mm256_unpackhi_ps(in[4], in[5]);
    const __m256 t6 = _mm256_unpacklo_ps(in[6], in[7]), t7 = _mm256_unpackhi_ps(in[6], in[7]);
    const __m256 u[8] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee),
                         _mm256_shuffle_ps(t4, t6, 0x44), _mm256_shuffle_ps(t4, t6, 0xee),
                         _mm256_shuffle_ps(t5, t7, 0x44), _mm256_shuffle_ps(t5, t7, 0xee)};
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out + 8 * i, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
        _mm256_storeu_ps(out + 8 * (4 + i), _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
    }
}

/* Rows [n, n + 8)'s metadata by group with the rows as lanes: scale[g * 8 + r] and shift[g * 8
   + r] = min + (8 - zero) * scale of row n + r's group g. */
static void panel_meta(const kvmesh_int4 *p, int64_t n, int64_t G, float *scale, float *shift) {
    const __m256 eight = _mm256_set1_ps(8.0f);
    int64_t g = 0;
    for (; g < G && G >= 8; g += 8) {  /* a tail of G % 8 groups: the last 8 again, overlapping */
        if (g + 8 > G) g = G - 8;
        __m256 s[PANEL_ROWS], h[PANEL_ROWS];
        for (int r = 0; r < PANEL_ROWS; r++) {
            const int64_t at = (n + r) * G + g;
            s[r] = load8_meta(p->scales, at, p->scale_dtype);
            const __m256 m = p->mins ? load8_meta(p->mins, at, p->min_dtype) : _mm256_setzero_ps();
            h[r] = _mm256_fmadd_ps(_mm256_sub_ps(eight, load8_meta(p->zeros, at, p->zero_dtype)), s[r], m);
        }
        transpose8(s, scale + 8 * g);
        transpose8(h, shift + 8 * g);
    }
    for (; g < G; g++)
        for (int r = 0; r < PANEL_ROWS; r++) {
            const int64_t at = (n + r) * G + g;
            const float s = load_meta(p->scales, at, p->scale_dtype), m = p->mins ? load_meta(p->mins, at, p->min_dtype) : 0.0f;
            scale[8 * g + r] = s;
            shift[8 * g + r] = fmaf(8.0f - load_meta(p->zeros, at, p->zero_dtype), s, m);
        }
}

static inline __m256i broadcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

/* One panel (codes: its first byte) against C tokens from b0: y[j * ldy + r] = W[n + r] . x[b0 + j]
   (y: the first row's output of token b0). xsum [B][G]: each token's fp32 group sums. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *codes, int64_t K, int64_t group,
                                                             const float *scale, const float *shift,
                                                             const Int8Rows *xr, const float *xsum, int64_t b0,
                                                             const int C, float *y, int64_t ldy) {
    const int64_t blocks = K / 32, G = K / group, per = group / 32;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[PANEL_TOKENS];
    #pragma GCC unroll 4
    for (int j = 0; j < C; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 t[PANEL_TOKENS];
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++) t[j] = _mm256_setzero_ps();
        for (int64_t blk = g * per; blk < (g + 1) * per; blk++) {
            const uint8_t *cb = codes + 128 * blk;
            __m256i dot[PANEL_TOKENS];
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) dot[j] = _mm256_setzero_si256();
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + 32 * c));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                #pragma GCC unroll 4
                for (int j = 0; j < C; j++) {
                    const int8_t *q = xr->q + (b0 + j) * K + 32 * blk;
#if PANEL_VNNI
                    dot[j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(dot[j], lo, broadcast4(q + 4 * c)), hi,
                                                 broadcast4(q + 16 + 4 * c));
#else
                    /* int16 sums: 8 pairs of |code x q| <= 15 x 127 stay below 2^15 */
                    dot[j] = _mm256_add_epi16(dot[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q + 4 * c)),
                                                                       _mm256_maddubs_epi16(hi, broadcast4(q + 16 + 4 * c))));
#endif
                }
            }
            #pragma GCC unroll 4
            for (int j = 0; j < C; j++) {
                const int64_t at = (b0 + j) * blocks + blk;
#if !PANEL_VNNI
                dot[j] = _mm256_madd_epi16(dot[j], _mm256_set1_epi16(1));
#endif
                dot[j] = _mm256_sub_epi32(dot[j], _mm256_set1_epi32(xr->qsum8[at]));
                t[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j]), _mm256_set1_ps(xr->scale[at]), t[j]);
            }
        }
        const __m256 s = _mm256_loadu_ps(scale + 8 * g), h = _mm256_loadu_ps(shift + 8 * g);
        #pragma GCC unroll 4
        for (int j = 0; j < C; j++)
            acc[j] = _mm256_fmadd_ps(t[j], s, _mm256_fmadd_ps(h, _mm256_set1_ps(xsum[(b0 + j) * G + g]), acc[j]));
    }
    #pragma GCC unroll 4
    for (int j = 0; j < C; j++) _mm256_storeu_ps(y + j * ldy, acc[j]);
}

/* The panels' scratch: rows' scales and shifts by group (2 x 8 G) and the tokens' group sums
   (B G), per thread; NULL: no memory. */
static float *panel_scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (cap < floats) {
        free(buf);
        buf = malloc(sizeof(float) * floats);
        cap = buf ? floats : 0;
    }
    return buf;
}

int kvmesh_gemv_int4_panels(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                            int64_t B, float *y, int64_t ldy) {
    const int64_t G = K / p->group, blocks = K / 32, per = p->group / 32;
    const Int8Rows xr = kvmesh_int8_rows(x, ldx, B, K, 0);
    float *scale = panel_scratch((size_t)(16 * G + B * G));
    if (!xr.q || !scale) return 0;
    float *shift = scale + 8 * G, *xsum = shift + 8 * G;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < G; g++) {
            float total = 0.0f;
            for (int64_t i = 0; i < per; i++) total += xr.sum[b * blocks + g * per + i];
            xsum[b * G + g] = total;
        }
    for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
        panel_meta(p, n, G, scale, shift);
        const uint8_t *codes = p->codes + n * (K / 2);
        for (int64_t b = 0; b < B; b += PANEL_TOKENS) {
            float *yb = y + b * ldy + n;
#define PANEL(C) panel_tile(codes, K, p->group, scale, shift, &xr, xsum, b, C, yb, ldy)
            switch (B - b < PANEL_TOKENS ? B - b : PANEL_TOKENS) {
                case 4: PANEL(4); break;
                case 3: PANEL(3); break;
                case 2: PANEL(2); break;
                default: PANEL(1);
            }
#undef PANEL
        }
    }
    return 1;
}

/* Row n0 + r's code for input k of a panel-laid projection (the no-memory path's reader) */
static inline int panel_code(const uint8_t *panel, int64_t r, int64_t k) {
    const int64_t byte = (k % 32) / 2;
    const uint8_t v = panel[128 * (k / 32) + 32 * (byte / 4) + 4 * r + byte % 4];
    return k % 2 ? v >> 4 : v & 0x0f;
}

void kvmesh_gemv_int4_panels_fp32(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x,
                                  int64_t ldx, int64_t B, float *y, int64_t ldy) {
    const int64_t G = K / p->group;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *panel = p->codes + (n - n % PANEL_ROWS) * (K / 2);
        for (int64_t b = 0; b < B; b++) {
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const int64_t at = n * G + g;
                const float s = load_meta(p->scales, at, p->scale_dtype), z = load_meta(p->zeros, at, p->zero_dtype);
                const float m = p->mins ? load_meta(p->mins, at, p->min_dtype) : 0.0f;
                for (int64_t k = g * p->group; k < (g + 1) * p->group; k++)
                    total += ((float)panel_code(panel, n % PANEL_ROWS, k) - z) * s * x[b * ldx + k] + m * x[b * ldx + k];
            }
            y[b * ldy + n] = total;
        }
    }
}

/* An int8 LM head with one scale a row (the int4 x int8 step's copy of a float head) or one a
   32-input group (a GGUF Q8_0 table: group scales in panels too, [panel][block][16 rows]) against
   the tokens' int8 rows (input order, per 32-input block), over codes in 16-row panels: at batch
   1 the head read one row after another streamed at about half the rate the int4 panels reach
   (docs/benchmarks.md, decode on EPYC), and each load here serves 16 rows.

   Layout (cpu_native_step.int8_row_panels): rows [16P, 16P + 16) hold, for each 4 inputs c,
   64 bytes: row r's codes 4c .. 4c + 3 at 4r; rows past N are zero. With AVX512-VNNI one
   VPDPBUSD a 4-input chunk takes the codes XOR 0x80 (code + 128, the unsigned operand) against
   the token's four int8 values broadcast, the 16 rows' sums in the 16 lanes; each row then
   carries 128 x sum q of every block times its scale, one number a token taken off at the end.
   Without VNNI: VPMADDUBSW on |code| against q carrying the code's sign, as the Q8_0 head. */
#define HEAD_PANEL_ROWS 16

#if PANEL_VNNI && defined(__AVX512F__)
/* 16 rows' sums over every block for one token: lanes = rows */
static inline __m512 head_panel_token(const int8_t *panel, const float *gs, int64_t K, const Int8Rows *xr, int64_t b) {
    const int64_t blocks = K / 32;
    const int8_t *q = xr->q + b * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m512i dot = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            int32_t v;
            memcpy(&v, q + 32 * blk + 4 * c, sizeof v);
            const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(panel + 512 * blk + 64 * c), flip);
            dot = _mm512_dpbusd_epi32(dot, w, _mm512_set1_epi32(v));
        }
        const __m512 sx = _mm512_set1_ps(xr->scale[b * blocks + blk]);
        if (gs)  /* each row's own scale for the block: the offset off a block at a time */
            acc = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps((float)(16 * xr->qsum8[b * blocks + blk]))),
                                  _mm512_mul_ps(_mm512_loadu_ps(gs + 16 * blk), sx), acc);
        else
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sx, acc);
    }
    if (gs) return acc;
    float offset = 0.0f;  /* 128 x sum q = 16 x (8 x sum q), a block at a time */
    for (int64_t blk = 0; blk < blocks; blk++)
        offset += xr->scale[b * blocks + blk] * (float)(16 * xr->qsum8[b * blocks + blk]);
    return _mm512_sub_ps(acc, _mm512_set1_ps(offset));
}
#else
static inline __m256 head_half_chunk(const int8_t *codes, __m256i qv, __m256i dot) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)codes);
    return _mm256_castsi256_ps(_mm256_add_epi32(dot, _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(qv, w)), _mm256_set1_epi16(1))));
}

/* the same in two halves of 8 rows: out[0 .. 16) */
static inline void head_panel_token_avx2(const int8_t *panel, const float *gs, int64_t K, const Int8Rows *xr, int64_t b,
                                         float *out) {
    const int64_t blocks = K / 32;
    const int8_t *q = xr->q + b * K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int c = 0; c < 8; c++) {
            const __m256i qv = broadcast4(q + 32 * blk + 4 * c);
            for (int h = 0; h < 2; h++)
                dot[h] = _mm256_castps_si256(head_half_chunk(panel + 512 * blk + 64 * c + 32 * h, qv, dot[h]));
        }
        const __m256 s = _mm256_set1_ps(xr->scale[b * blocks + blk]);
        for (int h = 0; h < 2; h++)
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), gs ? _mm256_mul_ps(_mm256_loadu_ps(gs + 16 * blk + 8 * h), s) : s,
                                     acc[h]);
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}
#endif

int kvmesh_gemv_i8_panels(const int8_t *w, const void *scale, const int sbf16, const float *group_scales, int64_t K,
                          int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy) {
    const Int8Rows xr = kvmesh_int8_rows(x, ldx, B, K, 1);
    if (!xr.q) return 0;
    float sums[HEAD_PANEL_ROWS];
    for (int64_t n = n0; n < n1; n += HEAD_PANEL_ROWS) {
        const int8_t *panel = w + n * K;
        const float *gs = group_scales ? group_scales + n * (K / 32) : NULL;  /* [panel][block][16 rows] */
        const int64_t rows = n1 - n < HEAD_PANEL_ROWS ? n1 - n : HEAD_PANEL_ROWS;
        for (int64_t b = 0; b < B; b++) {
#if PANEL_VNNI && defined(__AVX512F__)
            _mm512_storeu_ps(sums, head_panel_token(panel, gs, K, &xr, b));
#else
            head_panel_token_avx2(panel, gs, K, &xr, b, sums);
#endif
            for (int64_t r = 0; r < rows; r++) y[b * ldy + n + r] = gs ? sums[r] : sums[r] * load_elem(scale, n + r, sbf16);
        }
    }
    return 1;
}

void kvmesh_gemv_i8_panels_fp32(const int8_t *w, const void *scale, const int sbf16, const float *group_scales,
                                int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y,
                                int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const int64_t p = n - n % HEAD_PANEL_ROWS, r = n % HEAD_PANEL_ROWS;
        const int8_t *panel = w + p * K;
        for (int64_t b = 0; b < B; b++) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const float v = (float)panel[64 * (k / 4) + 4 * r + k % 4] * x[b * ldx + k];
                total += group_scales ? v * group_scales[p * (K / 32) + 16 * (k / 32) + r] : v;
            }
            y[b * ldy + n] = group_scales ? total : total * load_elem(scale, n, sbf16);
        }
    }
}
