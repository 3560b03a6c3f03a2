/* Decode attention read straight from the paged KV cache (worker/kernels/cpu_paged_attention.py
   says why and how it is called):

    for each decode row, for each KV head g (its G = Hq / Hkv query heads share the K/V loads):
        s[j, t] = (q_j . k_t) * scale      t < context, fp32 accumulation
        p[j, t] = exp(s[j, t] - max_t s)   one pass, the whole row's scores kept
        out_j   = sum_t p[j, t] v_t / sum_t p[j, t]

   fp32 and bf16 caches (bf16 widened to fp32 on load, the output rounded to nearest-even as
   torch does; with bf16 the p that weight V are rounded to bf16, as torch's CPU flash
   attention does). The native step (native_step.c) calls it for its own tokens. */
#include "kvmesh_cpu.h"
/* Row j of the [G, ctx + 1] scores: exp(s - max) in place, their sum in the spare slot. With a
   bf16 cache the probabilities that weight V are rounded to bf16 (the sum is of the unrounded
   ones), as torch's CPU flash attention does for bf16 inputs, so the result follows SDPA's. */
static inline void softmax_rows(float *restrict s, int64_t g_per, int64_t s_stride, int64_t ctx, const int bf16) {
    for (int64_t j = 0; j < g_per; j++) {
        float *restrict sj = s + j * s_stride;
        float m = sj[0];
        #pragma omp simd reduction(max:m)
        for (int64_t t = 1; t < ctx; t++) m = sj[t] > m ? sj[t] : m;
        float total = 0.0f;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < ctx; t++) {
            const float e = exp_nonpositive(sj[t] - m);
            total += e;
            sj[t] = bf16 ? round_bf16(e) : e;
        }
        sj[ctx] = total;
    }
}

/* One decode row of q ([Hq, D] at q_row, head stride q_hs) against its cached context.
   Always inlined into callers that pass a constant d (64, 128) and bf16 flag, so the inner
   loops compile to fixed-length vector code. K/V rows are walked block by block (no division
   per token) and each K/V row is widened to fp32 once for all G query heads of its KV head. */
static inline __attribute__((always_inline)) void attend_row(
        const void *q, int64_t q_hs, const void *kc, const void *vc, int64_t c_hs, const int64_t *offs,
        int64_t ctx, void *out, int64_t o_hs, int64_t hq, int64_t hkv, const int64_t d, float scale,
        float *work, const int bf16) {
    const int64_t g_per = hq / hkv;
    float *restrict qf = work;                /* [G, D] */
    float *restrict acc = qf + g_per * d;     /* [G, D] */
    float *restrict row = acc + g_per * d;    /* [D]: one K or V row in fp32 */
    float *restrict s = row + d;              /* [G, ctx + 1]: the scores, then the sum of their exps */
    const int64_t s_stride = ctx + 1;
    for (int64_t g = 0; g < hkv; g++) {
        for (int64_t j = 0; j < g_per; j++)
            for (int64_t e = 0; e < d; e++)
                qf[j * d + e] = load_elem(q, (g * g_per + j) * q_hs + e, bf16);
        for (int64_t t = 0; t < ctx; t++) {
            for (int64_t e = 0; e < d; e++) row[e] = load_elem(kc, offs[t] + g * c_hs + e, bf16);
            for (int64_t j = 0; j < g_per; j++) {
                const float *qj = qf + j * d;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t e = 0; e < d; e++) dot += qj[e] * row[e];
                s[j * s_stride + t] = dot * scale;
            }
        }
        softmax_rows(s, g_per, s_stride, ctx, bf16);
        for (int64_t e = 0; e < g_per * d; e++) acc[e] = 0.0f;
        for (int64_t t = 0; t < ctx; t++) {
            for (int64_t e = 0; e < d; e++) row[e] = load_elem(vc, offs[t] + g * c_hs + e, bf16);
            for (int64_t j = 0; j < g_per; j++) {
                const float pj = s[j * s_stride + t];
                float *aj = acc + j * d;
                #pragma omp simd
                for (int64_t e = 0; e < d; e++) aj[e] += pj * row[e];
            }
        }
        for (int64_t j = 0; j < g_per; j++) {
            const float inv = 1.0f / s[j * s_stride + ctx];
            for (int64_t e = 0; e < d; e++)
                store_elem(out, (g * g_per + j) * o_hs + e, acc[j * d + e] * inv, bf16);
        }
    }
}

#ifdef __AVX512F__
/* d == 64 with AVX-512: a K / V row is four zmm registers (load16 widens bf16 by a shift). */
#define MAX_G 16

/* A 64-element K or V row at element `at`, 16 tokens before it is read: the cache streams
   from memory (a batch-64 step reads ~110 MB of it), and without this each row's loads
   waited on memory (QK 44, PV 35 cycles a token and KV head; 30% and 12% fewer with it). */
static inline __attribute__((always_inline)) void prefetch_row64(const void *cache, int64_t at, const int bf16) {
    const char *row = (const char *)cache + at * (bf16 ? 2 : 4);
    for (int line = 0; line < (bf16 ? 2 : 4); line++) _mm_prefetch(row + 64 * line, _MM_HINT_T0);
}

/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: pairs interleaved and added
   within 128-bit lanes (16 -> 8 -> 4 vectors, each lane then holds one lane-sum of four
   inputs), then the 128-bit lanes added across (4 -> 2 -> 1). 45 shuffles and adds. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 u[8], w[4];
    for (int i = 0; i < 8; i++)  /* per lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per lane: the lane sums of inputs 4i .. 4i + 3 */
        const __m512d c = _mm512_castps_pd(u[2 * i]), d = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}
static inline __attribute__((always_inline)) void attend_row_d64(
        const void *q, int64_t q_hs, const void *kc, const void *vc, int64_t c_hs, const int64_t *offs,
        int64_t ctx, void *out, int64_t o_hs, int64_t hq, int64_t hkv, float scale, float *restrict s,
        const int bf16) {
    const int64_t g_per = hq / hkv, s_stride = ctx + 1;
    for (int64_t g = 0; g < hkv; g++) {
        __m512 qv[MAX_G][4];
        for (int64_t j = 0; j < g_per; j++)
            for (int c = 0; c < 4; c++)
                qv[j][c] = load16(q, (g * g_per + j) * q_hs + 16 * c, bf16);
        /* Scores 16 tokens at a time: each token's 16 lane-wise partial products per query
           head are kept, then one transposing reduction (sum16) turns 16 of them into 16
           scores: ~3 shuffles and adds a score instead of a full horizontal reduction each. */
        for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
            const int64_t n = ctx - t0 < 16 ? ctx - t0 : 16;
            __m512 part[MAX_G][16];
            for (int64_t i = 0; i < 16; i++) {
                if (i >= n) {
                    for (int64_t j = 0; j < g_per; j++) part[j][i] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t at = offs[t0 + i] + g * c_hs;
                if (t0 + i + 16 < ctx) prefetch_row64(kc, offs[t0 + i + 16] + g * c_hs, bf16);
                const __m512 k0 = load16(kc, at, bf16), k1 = load16(kc, at + 16, bf16);
                const __m512 k2 = load16(kc, at + 32, bf16), k3 = load16(kc, at + 48, bf16);
                for (int64_t j = 0; j < g_per; j++) {
                    __m512 a = _mm512_mul_ps(qv[j][0], k0);
                    __m512 b2 = _mm512_mul_ps(qv[j][1], k1);
                    a = _mm512_fmadd_ps(qv[j][2], k2, a);
                    b2 = _mm512_fmadd_ps(qv[j][3], k3, b2);
                    part[j][i] = _mm512_add_ps(a, b2);
                }
            }
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int64_t j = 0; j < g_per; j++)
                _mm512_mask_storeu_ps(s + j * s_stride + t0, live, _mm512_mul_ps(sum16(part[j]), _mm512_set1_ps(scale)));
        }
        softmax_rows(s, g_per, s_stride, ctx, bf16);
        __m512 acc[MAX_G][4];
        for (int64_t j = 0; j < g_per; j++)
            for (int c = 0; c < 4; c++) acc[j][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < ctx; t++) {
            const int64_t at = offs[t] + g * c_hs;
            if (t + 16 < ctx) prefetch_row64(vc, offs[t + 16] + g * c_hs, bf16);
            const __m512 v0 = load16(vc, at, bf16), v1 = load16(vc, at + 16, bf16);
            const __m512 v2 = load16(vc, at + 32, bf16), v3 = load16(vc, at + 48, bf16);
            for (int64_t j = 0; j < g_per; j++) {
                const __m512 p = _mm512_set1_ps(s[j * s_stride + t]);
                acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
                acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
                acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
            }
        }
        for (int64_t j = 0; j < g_per; j++) {
            const float inv = 1.0f / s[j * s_stride + ctx];
            float o[64];
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + 16 * c, acc[j][c]);
            for (int e = 0; e < 64; e++) store_elem(out, (g * g_per + j) * o_hs + e, o[e] * inv, bf16);
        }
    }
}
#endif

/* Rows [begin, end) of the decode list: row i reads q / writes out at q_rows[i] and uses
   request reqs[i]'s block table and context length. Strides in elements. 0 = ok, 1 = no memory. */
static inline __attribute__((always_inline)) int run(const void *q, int64_t q_rs, int64_t q_hs, const void *kc, const void *vc,
               int64_t c_bs, int64_t c_ss, int64_t c_hs, const int32_t *tables, int64_t t_rs,
               const int32_t *seq_lens, const int64_t *q_rows, const int64_t *reqs, int64_t begin, int64_t end,
               void *out, int64_t o_rs, int64_t o_hs, int64_t hq, int64_t hkv, int64_t d,
               int64_t block_size, float scale, const int bf16) {
    int64_t max_ctx = 1;
    for (int64_t i = begin; i < end; i++) max_ctx = seq_lens[reqs[i]] > max_ctx ? seq_lens[reqs[i]] : max_ctx;
    const int64_t g_per = hq / hkv;
    /* the row's token offsets, then the kernel's fp32 scratch (q, accumulators, one K/V row, scores) */
    int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)max_ctx
                                      + sizeof(float) * (size_t)((2 * g_per + 1) * d + g_per * (max_ctx + 1)));
    if (!offs) return 1;
    float *work = (float *)(offs + max_ctx);
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t i = begin; i < end; i++) {
        const int64_t r = reqs[i], row = q_rows[i], ctx = seq_lens[r];
        const void *qr = (const char *)q + row * q_rs * esz;
        void *outr = (char *)out + row * o_rs * esz;
        const int32_t *table = tables + r * t_rs;
        for (int64_t t = 0; t < ctx; t++) offs[t] = (int64_t)table[t / block_size] * c_bs + (t % block_size) * c_ss;
#ifdef __AVX512F__
        if (d == 64 && g_per <= MAX_G)
            attend_row_d64(qr, q_hs, kc, vc, c_hs, offs, ctx, outr, o_hs, hq, hkv, scale, work, bf16);
        else
#endif
        if (d == 64)  /* constant head sizes get fixed-length vector loops */
            attend_row(qr, q_hs, kc, vc, c_hs, offs, ctx, outr, o_hs, hq, hkv, 64, scale, work, bf16);
        else if (d == 128)
            attend_row(qr, q_hs, kc, vc, c_hs, offs, ctx, outr, o_hs, hq, hkv, 128, scale, work, bf16);
        else
            attend_row(qr, q_hs, kc, vc, c_hs, offs, ctx, outr, o_hs, hq, hkv, d, scale, work, bf16);
    }
    free(offs);
    return 0;
}

#define ENTRY(name, bf16) \
int name(KVMESH_PAGED_DECODE_ARGS) { \
    return run(q, q_rs, q_hs, kc, vc, c_bs, c_ss, c_hs, tables, t_rs, seq_lens, q_rows, reqs, begin, end, \
               out, o_rs, o_hs, hq, hkv, d, block_size, scale, bf16); }
ENTRY(kvmesh_paged_decode_f32, 0)
ENTRY(kvmesh_paged_decode_bf16, 1)
