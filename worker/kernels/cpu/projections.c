/* The projections of the native step (native_step.c): y = W x for a step's rows, from the
   model's own weights (fp32, bf16, or int8 with one scale per row), by the fastest path the
   build and the CPU have:

     AMX tiles           bf16 weights from their AMX-packed copy (TDPBF16PS), int8 weights
                         with int8 activations (TDPBSSD, the self-draft only), steps <= 64 rows
     VDPBF16PS GEMVs     bf16 weights with AVX512_BF16; a bf16 model's int4 groups and Q8_0 LM
                         head too, each 4-row group dequantized to its bf16 values first
     FMA GEMVs           every kind, widened to fp32 in registers (any AVX-512 CPU)

   Everything above the #else needs AVX-512; the avx2 build runs projections_avx2.c's AVX2 + FMA
   GEMVs instead, and int4 weights with fp32 activations go to projections_avx2.c in every build. */
#include "kvmesh_cpu.h"

#ifdef __AVX512F__

static inline __m512 load_w16(const void *w, int64_t i, const int kind) {
    if (kind == W_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
    if (kind == W_BF16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    return _mm512_loadu_ps((const float *)w + i);
}

/* The four sums of a, b, c, d's lanes, each added in _mm512_reduce_add_ps's order (halves,
   quarters, then pairs), so bit-identical to four of them, in a third of the instructions: at
   K = 576 the 24 reductions of a 4 x 6 tile were ~15% of its time. */
static inline __attribute__((always_inline)) __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* ab: 128-bit lanes [a0 + a2, a1 + a3, b0 + b2, b1 + b3] (a's 256-bit halves added), cd alike */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    /* lane q: the four partial sums of a, b, c, d (their 128-bit halves added) */
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));  /* [t0 + t2, t1 + t3, ..] */
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0xb1));  /* element 0 of lane q: its sum */
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0, 0), v));
}

/* Four weight rows (from row n) dotted with C activation rows, stored as y[j * ldy + i] =
   W[n + i] . x[j]. The weight rows are streamed once (the group PREFETCH_GROUPS groups ahead is
   prefetched: the hardware prefetcher alone reached ~half the core's read bandwidth on these
   short rows); C <= TILE_ROWS keeps the 4 x C accumulators, the four widened weight vectors and
   one activation vector in AVX-512's 32 registers (4 x 6 + 4 + 1 = 29), so a speculative verify
   of k + 1 <= 6 tokens reads each weight row from memory once, as a single decode row does.
   The group ahead is 4 rows x K contiguous: a tile's k-step (one 64-byte line of each row) prefetches
   its next four lines in address order, one stream the hardware prefetcher follows (four lines a
   row apart, the order the group is read in, left a row-strided batch-1 GEMV at ~12 GB/s of a
   Zen 4 core's ~17: 1.3x at batch 1-4). A group takes `passes` tiles (ceil(B / TILE_ROWS));
   pass p prefetches every passes-th k-step's lines from the p-th: issued in one pass, the
   prefetches of a 64-row step outran the core's outstanding misses and its projections ran at
   ~0.84x their speed with the weights in cache (1 thread, Zen 4); spread, ~0.97x. */
#define PREFETCH_GROUPS 2
#define TILE_ROWS 6
static inline __attribute__((always_inline)) void tile4(const char *w, int64_t n, int64_t K, const float *x,
        int64_t ldx, const int C, const int kind, const int pass, const int passes, float *y, int64_t ldy) {
    const int64_t es = w_elem_size(kind), row = K * es;
    const char *r0 = w + n * row, *ahead = r0 + PREFETCH_GROUPS * 4 * row;
    __m512 acc[4][TILE_ROWS];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t next_line = pass;  /* the next 64-byte line of the rows this pass prefetches */
    for (int64_t k = 0; k < K; k += 16) {
        if (k * es == next_line * 64) {
            next_line += passes;
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm_prefetch(ahead + (k * es / 64) * 256 + i * 64, _MM_HINT_T0);
        }
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
    #pragma GCC unroll 6
    for (int j = 0; j < C; j++) _mm_storeu_ps(y + j * ldy, sum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
}

/* The row-group walk both GEMVs share: weight rows from n four at a time (n is left at the first
   row of an uneven share's tail), the B tokens TILE_ROWS at a time (pass p of `passes`), TILE(C)
   the GEMV's tile function for the tokens from b with a constant C (so its accumulators stay in
   registers) writing y[token * ldy + row]. */
#define FOR_EACH_ROW_TILE(TILE) FOR_EACH_ROW_GROUP((void)0, TILE)
/* The same, with the statement GROUP run before each row group's tiles. */
#define FOR_EACH_ROW_GROUP(GROUP, TILE) \
    const int passes = (int)((B + TILE_ROWS - 1) / TILE_ROWS); \
    for (; n + 4 <= n1; n += 4) { \
        GROUP; \
        for (int64_t b = 0; b < B; b += TILE_ROWS) { \
            const int64_t c = B - b < TILE_ROWS ? B - b : TILE_ROWS; \
            const int pass = (int)(b / TILE_ROWS); \
            switch (c) { \
                case 6: TILE(6); break; \
                case 5: TILE(5); break; \
                case 4: TILE(4); break; \
                case 3: TILE(3); break; \
                case 2: TILE(2); break; \
                default: TILE(1); \
            } \
        } \
    }

/* y[b * ldy + n] = scale[n] * dot(W[n, :K], x[b * ldx, :K]) for n in [n0, n1), b < B (K % 16 == 0):
   four weight rows at a time against the batch rows TILE_ROWS at a time (the four rows stay in
   L1 across the row groups), so each weight row is read from memory once per step whatever B is. */
static inline __attribute__((always_inline)) void gemv_kind(
        const void *w, const void *scale, const int sbf16, int64_t K, int64_t n0, int64_t n1,
        const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, const int kind) {
    const int64_t es = w_elem_size(kind);
    int64_t n = n0;
#define FMA_TILE(C) tile4((const char *)w, n, K, x + b * ldx, ldx, C, kind, pass, passes, y + b * ldy + n, ldy)
    FOR_EACH_ROW_TILE(FMA_TILE)
#undef FMA_TILE
    for (; n < n1; n++) {  /* the last rows of an uneven share */
        const char *row = (const char *)w + n * K * es;
        for (int64_t b = 0; b < B; b++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16)
                a = _mm512_fmadd_ps(load_w16(row, k, kind), _mm512_loadu_ps(x + b * ldx + k), a);
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

/* One k-step of a 4 x C bf16 tile: acc[i][j] += wv[i] . x[j * K ..] (32 inputs), VDPBF16PS. */
static inline __attribute__((always_inline)) void dp4_step(__m512 acc[4][TILE_ROWS], const __m512bh wv[4],
                                                          const uint16_t *x, int64_t K, const int C) {
    #pragma GCC unroll 6
    for (int j = 0; j < C; j++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + j * K));
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
}

/* A 4 x C tile's sums: y[j * ldy + i] = the lanes of acc[i][j] added */
static inline __attribute__((always_inline)) void store_sums4(__m512 acc[4][TILE_ROWS], const int C, float *y,
                                                             int64_t ldy) {
    #pragma GCC unroll 6
    for (int j = 0; j < C; j++) _mm_storeu_ps(y + j * ldy, sum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
}

/* tile4 for bf16 weights and bf16 activation rows x [C][K]: y[j * ldy + i] = W[n + i] . x[j].
   Up to L2_PREFETCH_PASSES passes a group (steps of up to 18 rows) the group ahead is prefetched
   into L2 only: into L1 (T0) its prefetches held the L1's miss slots the tile's own loads wait
   for, and 2 threads read the weights at ~12-14 GB/s of the ~31 the box streams (12-16 rows: the
   projections 0.65-0.7x the time with T2; at 24-64 rows T0 is 1-4% ahead; Zen 4). */
#define L2_PREFETCH_PASSES 3
static inline __attribute__((always_inline)) void tile4_dp(const char *w, int64_t n, int64_t K, const uint16_t *x,
        const int C, const int pass, const int passes, float *y, int64_t ldy, const int prefetch) {
    const int64_t row = K * 2;
    const char *r0 = w + n * row, *ahead = r0 + PREFETCH_GROUPS * 4 * row;
    __m512 acc[4][TILE_ROWS];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        #pragma GCC unroll 6
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t next_line = pass;  /* the next 64-byte line of the rows (one a k-step) this pass prefetches */
    for (int64_t k = 0; k < K; k += 32) {
        if (prefetch && k / 32 == next_line) {
            next_line += passes;
            if (passes <= L2_PREFETCH_PASSES)
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) _mm_prefetch(ahead + (k / 32) * 256 + i * 64, _MM_HINT_T2);
            else
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) _mm_prefetch(ahead + (k / 32) * 256 + i * 64, _MM_HINT_T0);
        }
        __m512bh wv[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(r0 + i * row + k * 2));
        dp4_step(acc, wv, x + k, K, C);
    }
    store_sums4(acc, C, y, ldy);
}

/* One bf16 row r against the B rows of x: y[b * ldy] = r . x[b], tile4_dp's sums for that row
   (one accumulator, reduced in _mm512_reduce_add_ps's order, as sum4 adds). */
static inline void row_dp(const char *r, int64_t K, const uint16_t *x, int64_t B, float *y, int64_t ldy) {
    for (int64_t b = 0; b < B; b++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(r + k * 2)),
                                 (__m512bh)_mm512_loadu_si512((const void *)(x + b * K + k)));
        y[b * ldy] = _mm512_reduce_add_ps(a);
    }
}

static void gemv_bf16_dp(const void *w, int64_t K, int64_t n0, int64_t n1, const uint16_t *x, int64_t B,
                         float *y, int64_t ldy) {
    const char *wc = (const char *)w;
    int64_t n = n0;
#define DP_TILE(C) tile4_dp(wc, n, K, x + b * K, C, pass, passes, y + b * ldy + n, ldy, 1)
    FOR_EACH_ROW_TILE(DP_TILE)
#undef DP_TILE
    for (; n < n1; n++) row_dp(wc + n * K * 2, K, x, B, y + n, ldy);  /* the last rows of an uneven share */
}

/* Stored weights with bf16 products: int4 groups (kvmesh_int4) or a Q8_0 table's int8 groups
   (code x fp32 scale, K/32 a row), each 4-row group dequantized to bf16 into an L1 scratch
   [4][K], then the same tile4_dp walk as bf16 weights over it for every token pass. A weight is
   the value the model's float copy holds in bf16: for int4 ((code - zero) * scale) + min in fp32
   (a multiply, then an add: quant/primitives.dequantize_int4_groupwise and gguf's own
   dequantize, then torch's round to nearest even; one FMA only where the product is exact:
   TABLE_FMA), for int8 code * scale (exact); so the
   sums are those of bf16 weights bit for bit, from int4's ~0.3x of their bytes. An int4 group's
   16 possible weights are computed once, as a bf16 table, and its codes look theirs up (VPERMW):
   ~2 ns a group of 32 weights on a Zen 4 core, which at one token is most of the step (the bf16
   GEMV itself reads from L1). The codes of the group PREFETCH_GROUPS ahead are prefetched a line
   at a time through the dequantization (tile4_dp's own prefetch is off: the scratch is in L1). */
#define DQ_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)  /* rounding given: never contracted into an FMA */

/* G metadata values (a META_* dtype) from i on -> fp32 out[0 .. G); 1 where all are 0 */
static inline int meta_to_f32(const void *p, int64_t i, int64_t G, const int dtype, float *out) {
    __mmask16 nonzero = 0;
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 live = (__mmask16)(G - g >= 16 ? 0xffff : (1u << (G - g)) - 1u);
        __m512 v;
        if (dtype == META_F32) v = _mm512_maskz_loadu_ps(live, (const float *)p + i + g);
        else {
            const __m256i h = _mm256_maskz_loadu_epi16(live, (const uint16_t *)p + i + g);
            v = dtype == META_F16 ? _mm512_cvtph_ps(h)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        nonzero |= _mm512_cmpneq_ps_mask(v, _mm512_setzero_ps());
        _mm512_mask_storeu_ps(out + g, live, v);
    }
    return nonzero == 0;
}

/* How a row group's tables are computed, the same values in each form:
     TABLE_SUB      (code - zero) * scale, then + min: a multiply and an add, each rounded
     TABLE_MUL_ADD  the zeros all 0 (GGUF Q4_1, Q4_K): the subtraction skipped
     TABLE_FMA      the zeros all 0 and fp16 scales (GGUF Q4_1): code * scale has at most
                    4 + 11 significant bits, exact in fp32, so one FMA rounds code * scale + min
                    as the add after the multiply does (15 x 65504 never overflows): one op of
                    the ~11 a group of 32 weights costs at one token, the one-token projections
                    ~0.9x the time (C harness, Zen 4). Other scales (fp32: Q4_K's d x sc, quant's
                    own) keep the multiply and the add. */
enum { TABLE_SUB = 0, TABLE_MUL_ADD = 1, TABLE_FMA = 2 };

/* the table form of p's row group whose zeros are all 0 (zero) or not */
static inline int int4_table_form(const kvmesh_int4 *p, const int zero) {
    if (!zero) return TABLE_SUB;
    return p->scale_dtype == META_F16 ? TABLE_FMA : TABLE_MUL_ADD;
}

/* Group g's 16 possible weights ((code - zero) * scale) + min as bf16, in words 0-15 and again in
   16-31 (so a lookup's index bit 4 selects nothing). FORM: a TABLE_* form; MINS: there are mins. */
static inline __attribute__((always_inline)) __m512i int4_group_table(const float *s, const float *z, const float *m,
                                                                     int64_t g, const int FORM, const int MINS) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 w;
    if (FORM == TABLE_FMA && MINS) w = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(m[g]));
    else {
        const __m512 q = FORM == TABLE_SUB ? _mm512_sub_ps(iota, _mm512_set1_ps(z[g])) : iota;
        w = _mm512_mul_round_ps(q, _mm512_set1_ps(s[g]), DQ_RN);
        if (MINS) w = _mm512_add_round_ps(w, _mm512_set1_ps(m[g]), DQ_RN);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(w, w);
}

/* VPMULTISHIFTQB (AVX512_VBMI): byte j of each qword of the result = the 8 bits of data's qword
   from bit ctl.byte[j] on. The int4 paths check the CPU at run time (cpu_has_vbmi) so one
   avx512_bf16 library still runs where VBMI is missing (Cooper Lake); there the assembler's
   form stands in for the intrinsic, which needs -mavx512vbmi. */
static inline __attribute__((always_inline)) __m512i multishift_bytes(__m512i ctl, __m512i data) {
#ifdef __AVX512VBMI__
    return _mm512_multishift_epi64_epi8(ctl, data);
#else
    __m512i out;
    __asm__("vpmultishiftqb %2, %1, %0" : "=v"(out) : "v"(ctl), "v"(data));
    return out;
#endif
}

static int cpu_has_vbmi(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512vbmi") ? 1 : 0;
    return known;
}

/* 32 inputs' codes (16 bytes) -> their bf16 weights from the group's table (VPERMW reads an
   index word's low 5 bits). VBMI: qword q holds code bytes 2q, 2q + 1 (inputs 4q .. 4q + 3) and
   VPMULTISHIFTQB moves input 4q + j's nibble (bits 4j ..) into word j's low byte, one shuffle
   fewer than widening bytes to dwords and splitting their nibbles (VPMOVZXBD + VPSLLD +
   VPTERNLOGD: dword i holds byte i's low nibble, input 2i, in its low word and its high
   nibble in the high word): one-token steps' projections ~0.95x the time (C harness). */
static inline __attribute__((always_inline)) __m512i int4_block_lookup(const uint8_t *codes, __m512i table,
                                                                      const int VBMI) {
    __m512i idx;
    if (VBMI) {
        idx = multishift_bytes(_mm512_set1_epi64(0x0c0c080804040000ll),
                               _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)codes)));
    } else {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
        idx = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000f000f), 0xa8);
    }
    return _mm512_permutexvar_epi16(idx, table);
}

static inline __attribute__((always_inline)) void int4_block_to_bf16(const uint8_t *codes, __m512i table,
                                                                    uint16_t *out, const int VBMI) {
    _mm512_storeu_si512((void *)out, int4_block_lookup(codes, table, VBMI));
}

/* One row's G groups of `group` inputs -> out [K] bf16; the codes `ahead` bytes on prefetched a
   line (4 blocks) at a time. */
static inline __attribute__((always_inline)) void int4_row_to_bf16(const uint8_t *codes, const float *s,
        const float *z, const float *m, int64_t G, int64_t group, const int64_t ahead, uint16_t *out,
        const int FORM, const int MINS, const int VBMI) {
    if (group == 32) {  /* GGUF's: one block a group, four a line */
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) {
            _mm_prefetch((const char *)codes + ahead + g * 16, _MM_HINT_T0);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                int4_block_to_bf16(codes + (g + i) * 16, int4_group_table(s, z, m, g + i, FORM, MINS),
                                   out + (g + i) * 32, VBMI);
        }
        for (; g < G; g++)
            int4_block_to_bf16(codes + g * 16, int4_group_table(s, z, m, g, FORM, MINS), out + g * 32, VBMI);
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        const __m512i table = int4_group_table(s, z, m, g, FORM, MINS);
        for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
            if ((k / 2) % 64 == 0) _mm_prefetch((const char *)codes + ahead + k / 2, _MM_HINT_T0);
            int4_block_to_bf16(codes + k / 2, table, out + k, VBMI);
        }
    }
}

/* rows [n, n + rows) of p's metadata in fp32: scales, zeros, mins each [rows][G] in meta (their
   metadata is contiguous: one pass); 1 where the zeros are all 0 */
static inline __attribute__((always_inline)) int int4_meta_to_f32(const kvmesh_int4 *p, int64_t n, const int rows,
                                                                 int64_t G, float *meta) {
    meta_to_f32(p->scales, n * G, rows * G, p->scale_dtype, meta);
    const int zero = meta_to_f32(p->zeros, n * G, rows * G, p->zero_dtype, meta + rows * G);
    if (p->mins) meta_to_f32(p->mins, n * G, rows * G, p->min_dtype, meta + 2 * rows * G);
    return zero;
}

/* rows [n, n + rows) of p -> out [rows][K] bf16 */
static inline __attribute__((always_inline)) void int4_rows_to_bf16(const kvmesh_int4 *p, int64_t n, const int rows,
                                                                   int64_t K, uint16_t *out, const int VBMI) {
    const int64_t G = K / p->group, ahead = PREFETCH_GROUPS * 4 * (K / 2);
    float meta[3 * rows * G];  /* the rows' scales, zeros, mins */
    const float *s = meta, *z = meta + rows * G, *m = meta + 2 * rows * G;
    const int form = int4_table_form(p, int4_meta_to_f32(p, n, rows, G, meta));
    for (int r = 0; r < rows; r++) {
        const uint8_t *codes = p->codes + (n + r) * (K / 2);
        const float *sr = s + r * G, *zr = z + r * G, *mr = m + r * G;
        uint16_t *o = out + r * K;
        if (p->mins && form == TABLE_FMA)
            int4_row_to_bf16(codes, sr, zr, mr, G, p->group, ahead, o, TABLE_FMA, 1, VBMI);
        else if (p->mins && form == TABLE_MUL_ADD)
            int4_row_to_bf16(codes, sr, zr, mr, G, p->group, ahead, o, TABLE_MUL_ADD, 1, VBMI);
        else if (p->mins) int4_row_to_bf16(codes, sr, zr, mr, G, p->group, ahead, o, TABLE_SUB, 1, VBMI);
        else int4_row_to_bf16(codes, sr, zr, mr, G, p->group, ahead, o, TABLE_SUB, 0, VBMI);
    }
}

/* rows [n, n + rows) of int8 codes w [N][K] with scales [N][K/32] -> out [rows][K] bf16 */
static inline __attribute__((always_inline)) void i8g_rows_to_bf16(const int8_t *w, const float *scales, int64_t n,
                                                                  const int rows, int64_t K, uint16_t *out) {
    const int64_t ahead = PREFETCH_GROUPS * 4 * K;
    for (int r = 0; r < rows; r++) {
        const int8_t *codes = w + (n + r) * K;
        for (int64_t k = 0; k < K; k += 32) {
            if (k % 64 == 0) _mm_prefetch((const char *)codes + ahead + k, _MM_HINT_T0);
            const __m512 s = _mm512_set1_ps(scales[(n + r) * (K / 32) + k / 32]);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + k))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + k + 16))));
            _mm512_storeu_si512((void *)(out + r * K + k),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_round_ps(hi, s, DQ_RN),
                                                             _mm512_mul_round_ps(lo, s, DQ_RN)));
        }
    }
}

/* The walk over dequantized row groups: DEQUANT(rows) fills wb with rows [n, n + rows). */
#define DEQUANT_DP_WALK(DEQUANT) do { \
        uint16_t wb[4 * K]; \
        const char *wc = (const char *)wb; \
        int64_t n = n0; \
        FOR_EACH_ROW_GROUP(DEQUANT(4), DQ_TILE) \
        for (; n < n1; n++) { DEQUANT(1); row_dp(wc, K, x16, B, y + n, ldy); } \
    } while (0)
#define DQ_TILE(C) tile4_dp(wc, 0, K, x16 + b * K, C, pass, passes, y + b * ldy + n, ldy, 0)

/* Each int4 row group is dequantized into the scratch before its passes. Looking a group's weights
   up in registers straight into its first pass's products (stored for the later passes) measured
   1.00-1.05x this walk's decode step time in the engine (7 rows 1.05x, 16 1.03x, 32 1.01-1.02x,
   64 1.02-1.03x; SmolLM2 int4 bf16, 2 threads, Zen 4, the two alternated step by step), though a
   lone projection loop had it ahead at 8 rows. */
int kvmesh_gemv_int4_bf16(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                          int64_t B, float *y, int64_t ldy, uint16_t *x16, const int x_ready) {
    if (n0 >= n1 || B == 0) return 1;
    if (!x_ready) rows_to_bf16(x, ldx, B, K, x16);
#define INT4_ROWS(rows) int4_rows_to_bf16(p, n, rows, K, wb, 1)
#define INT4_ROWS_NO_VBMI(rows) int4_rows_to_bf16(p, n, rows, K, wb, 0)
    if (cpu_has_vbmi()) DEQUANT_DP_WALK(INT4_ROWS);
    else DEQUANT_DP_WALK(INT4_ROWS_NO_VBMI);
#undef INT4_ROWS_NO_VBMI
#undef INT4_ROWS
    return 1;
}

int kvmesh_gemv_i8g_bf16(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1, const float *x,
                         int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16, const int x_ready) {
    if (n0 >= n1 || B == 0) return 1;
    if (!x_ready) rows_to_bf16(x, ldx, B, K, x16);
#define I8G_ROWS(rows) i8g_rows_to_bf16(w, scales, n, rows, K, wb)
    DEQUANT_DP_WALK(I8G_ROWS);
#undef I8G_ROWS
    return 1;
}
#undef DQ_TILE

int kvmesh_int4_to_bf16(const uint8_t *codes, const void *scales, const void *zeros, const void *mins, int64_t group,
                        int64_t scale_dtype, int64_t zero_dtype, int64_t min_dtype, int64_t N, int64_t K, uint16_t *out,
                        int64_t threads) {
    if (K % 32 || group % 32 || K % group) return 0;
    const kvmesh_int4 p = {codes, scales, zeros, mins, group, (int)scale_dtype, (int)zero_dtype, (int)min_dtype, 0, 0};
    const int vbmi = cpu_has_vbmi();
    #pragma omp parallel for num_threads((int)(threads < 1 ? 1 : threads)) schedule(static)
    for (int64_t n = 0; n < N; n += 4) {
        if (n + 4 <= N) {
            if (vbmi) int4_rows_to_bf16(&p, n, 4, K, out + n * K, 1);
            else int4_rows_to_bf16(&p, n, 4, K, out + n * K, 0);
        } else for (int64_t r = n; r < N; r++) int4_rows_to_bf16(&p, r, 1, K, out + r * K, vbmi);
    }
    return 1;
}

int kvmesh_i8g_to_bf16(const int8_t *codes, const float *scales, int64_t N, int64_t K, uint16_t *out,
                       int64_t threads) {
    if (K % 32) return 0;
    #pragma omp parallel for num_threads((int)(threads < 1 ? 1 : threads)) schedule(static)
    for (int64_t n = 0; n < N; n += 4) {
        if (n + 4 <= N) i8g_rows_to_bf16(codes, scales, n, 4, K, out + n * K);
        else for (int64_t r = n; r < N; r++) i8g_rows_to_bf16(codes, scales, r, 1, K, out + r * K);
    }
    return 1;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_DPBF16)
/* bf16 weights on a CPU with AMX: TDPBF16PS, one instruction a 16 x 16 x 32 product, so a step
   of up to 64 tokens costs about what reading the weights costs (the FMA / VDPBF16PS GEMVs
   above are compute-bound past a few tokens): gemm_bf16_amx_packed below. Linux grants AMX
   state per process on request (kvmesh_cpu_init); without the grant the VDPBF16PS
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
   Measured 2026-12-02 on the 2-core Sapphire Rapids machine (SPR in docs/benchmarks.md): alone,
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
void kvmesh_gemv(const void *w, const void *wp, const int kind, const void *scale, const int sbf16, int64_t K,
                 int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy,
                 uint16_t *x16, const int x_ready, const int a8) {
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

#else
/* The avx2 build: projections_avx2.c's GEMVs for every float and int8 kind. */
void kvmesh_gemv(const void *w, const void *wp, const int kind, const void *scale, const int sbf16, int64_t K,
                 int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy,
                 uint16_t *x16, const int x_ready, const int a8) {
    (void)wp; (void)x16; (void)x_ready; (void)a8;
    if (n0 >= n1 || B == 0) return;
    kvmesh_gemv_avx2(w, kind, scale, sbf16, K, n0, n1, x, ldx, B, y, ldy);
}
#endif /* __AVX512F__ */

#ifndef HAVE_DPBF16
/* Builds without VDPBF16PS: not taken (kvmesh_native_step_check refuses bf16 products there). */
int kvmesh_gemv_int4_bf16(const kvmesh_int4 *p, int64_t K, int64_t n0, int64_t n1, const float *x, int64_t ldx,
                          int64_t B, float *y, int64_t ldy, uint16_t *x16, const int x_ready) {
    (void)p; (void)K; (void)n0; (void)n1; (void)x; (void)ldx; (void)B; (void)y; (void)ldy; (void)x16; (void)x_ready;
    return 0;
}

int kvmesh_gemv_i8g_bf16(const int8_t *w, const float *scales, int64_t K, int64_t n0, int64_t n1, const float *x,
                         int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16, const int x_ready) {
    (void)w; (void)scales; (void)K; (void)n0; (void)n1; (void)x; (void)ldx; (void)B; (void)y; (void)ldy; (void)x16;
    (void)x_ready;
    return 0;
}

int kvmesh_int4_to_bf16(const uint8_t *codes, const void *scales, const void *zeros, const void *mins, int64_t group,
                        int64_t scale_dtype, int64_t zero_dtype, int64_t min_dtype, int64_t N, int64_t K, uint16_t *out,
                        int64_t threads) {
    (void)codes; (void)scales; (void)zeros; (void)mins; (void)group; (void)scale_dtype; (void)zero_dtype;
    (void)min_dtype; (void)N; (void)K; (void)out; (void)threads;
    return 0;
}

int kvmesh_i8g_to_bf16(const int8_t *codes, const float *scales, int64_t N, int64_t K, uint16_t *out,
                       int64_t threads) {
    (void)codes; (void)scales; (void)N; (void)K; (void)out; (void)threads;
    return 0;
}
#endif

int kvmesh_bf16_products(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

void kvmesh_amx_tiles_begin(void) {
#ifdef HAVE_AMX
    if (amx_granted) amx_configure();  /* tile state is per thread; oneDNN loads its own before use */
#endif
}

void kvmesh_amx_tiles_end(void) {
#ifdef HAVE_AMX
    if (amx_granted) _tile_release();
#endif
}

int kvmesh_cpu_features(void) {
    int features = KVMESH_FEATURE_NATIVE_STEP;
#ifdef __AVX512F__
    features |= KVMESH_FEATURE_AVX512;
#endif
#ifdef HAVE_DPBF16
    features |= KVMESH_FEATURE_DPBF16;
#endif
#ifdef HAVE_AMX
    if (amx_granted) features |= KVMESH_FEATURE_AMX;
#endif
#ifdef HAVE_AMX_I8
    if (amx_granted) features |= KVMESH_FEATURE_AMX_INT8;
#endif
    return features;
}

/* ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18: Linux grants AMX tile state per
   process on request. */
int kvmesh_cpu_init(void) {
#ifdef HAVE_AMX
    amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
#else
    return 0;
#endif
}
