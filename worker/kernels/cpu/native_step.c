/* A small step on CPU as ONE native call: every layer, the attention and the LM head
   (worker/kernels/cpu_native_step.py says when it runs and what it takes):

    per layer, SPMD over an OpenMP team (torch's own threads), a barrier between the phases:
      RMSNorm -> QKV rows (this thread's share) | RoPE + K/V into the cache (this thread's
      tokens) | paged attention of this thread's tokens (paged_attention.c) | O rows |
      residual + RMSNorm -> gate/up rows + SiLU-mul | down rows
    final residual + RMSNorm -> LM head rows (this thread's share of the vocabulary) for the
    tokens that sample -> fp32 logits

   The projections are projections.c's (AVX-512 builds) or projections_avx2.c's (the avx2
   build; int4 weights with fp32 or int8 activations in every build; a bf16 model's int4 layers
   as bf16 products where the build has VDPBF16PS, int4_bf16). Every variant has the step. */
#include <math.h>
#include <omp.h>

#include "kvmesh_cpu.h"

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

/* out[i] = silu(g[i]) * u[i]: sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) below, both
   from t = e^-|g| and a select, so the loop vectorises (as many exps as rows) */
static inline void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float t = exp_nonpositive(-fabsf(g[i]));
        out[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : t) / (1.0f + t)) * u[i];
    }
}

/* Scratch kept per thread across steps (the OpenMP team is torch's pool: the same threads every
   step). A fresh malloc of these sizes (up to ~1 MB at 64 tokens) is a fresh mmap, and every
   page of it faults on first touch, every step. */
#define SCRATCH_SLOTS 4  /* private rows, dequantized weight rows, the step's shared buffers, gate/up sums */
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[SCRATCH_SLOTS];
    static __thread size_t cap[SCRATCH_SLOTS];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

typedef struct {
    const kvmesh_model *m;
    float eps;
    int64_t B, threads;
    const int64_t *tokens, *positions, *slots, *rows;
    const int32_t *tables, *seq_lens;
    int64_t t_rs;
    const int64_t *sample_rows;
    int64_t S;
    float *logits;
    /* shared buffers */
    float *qkv, *o_out, *gate_up, *act, *down_out;
    void *q_attn, *attn_out;
    int64_t *taken;  /* per phase (PHASES a layer, then the LM head): how far its work is handed out */
    int failed;
} Step;

/* A phase's work is handed out in chunks, each thread taking the next one as it gets to it,
   instead of a fixed share a thread. On a machine whose cores the engine shares with its
   serving stack (the worker's event loop, Ray, the router), the OS preempts one of the team's
   threads now and then: with fixed shares the others finish theirs and wait at the barrier for
   its rows, so every slice the stack takes costs the engine that slice on every core; with
   chunks they take its rows over and wait only for the chunk it holds. ~4 chunks a thread keep
   the per-call setup (a projection lays its input rows out once a call) small. */
#define PHASES 5  /* QKV, attention, O, gate/up, down */
#define CHUNKS_A_THREAD 4

static inline int64_t chunk_size(int64_t n, int64_t threads, int64_t align) {
    if (threads == 1) return n > 0 ? n : 1;
    int64_t c = (n + CHUNKS_A_THREAD * threads - 1) / (CHUNKS_A_THREAD * threads);
    c = (c + align - 1) / align * align;
    return c > 0 ? c : align;
}

/* The next chunk [*c0, *c1) of phase `phase`'s n units, 0 when all are handed out. */
static inline int take_chunk(const Step *s, int64_t phase, int64_t n, int64_t chunk, int64_t *c0, int64_t *c1) {
    const int64_t at = __atomic_fetch_add(&s->taken[phase], chunk, __ATOMIC_RELAXED);
    if (at >= n) return 0;
    *c0 = at;
    *c1 = at + chunk < n ? at + chunk : n;
    return 1;
}

/* The form kvmesh_gemv_int4 computes this model's int4 layers in */
static inline int int4_form(const kvmesh_model *m) {
    return m->int8_activations ? INT4_A8 : m->int4_factored ? INT4_FACTORED : INT4_EXACT;
}

/* One projection's rows [n0, n1) for B <= TOKEN_BLOCK tokens: int4 weights by kvmesh_gemv_int4 (w:
   the codes; scales, zeros, mins and the group as the model describes them), every other kind by
   kvmesh_gemv. */
static inline void project_tokens(const kvmesh_model *m, const int kind, const void *w, const void *wp,
                                  const void *scales, const kvmesh_int4 *p, const int sbf16, int64_t K, int64_t n0,
                                  int64_t n1, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy,
                                  uint16_t *x16, const int x_ready, const int a8) {
    if (kind != W_I4) kvmesh_gemv(w, wp, kind, scales, sbf16, K, n0, n1, x, ldx, B, y, ldy, x16, x_ready, a8);
    else if (m->int4_bf16) kvmesh_gemv_int4_bf16(p, K, n0, n1, x, ldx, B, y, ldy, x16, x_ready);
    else kvmesh_gemv_int4(p, K, n0, n1, x, ldx, B, y, ldy, int4_form(m));
}

/* A step's tokens go to the GEMVs TOKEN_BLOCK at a time. The GEMVs walk every token they are given
   past each 4-row weight group: 64 tokens' bf16 inputs (64 x K x 2 bytes, 74-197 KB for SmolLM2)
   stay in L2 while the chunk's rows pass, where a 512-token prefill step's are 0.6-1.5 MB. A
   chunk's weight rows (~150-250 KB) are then read once a block, from L2 (a 512-token step 0.81x
   eager's time on Zen 4: docs/engine.md, "Native step"). */
#define TOKEN_BLOCK 64

/* One projection's rows [n0, n1) for all B tokens: y[b * ldy + n] = W[n] . x[b]. x16: the
   thread's bf16 scratch for x, [B][K] (x_ready: it holds this x already). A bf16 model's int4 rows
   (int4_bf16) are dequantized once a call into a private bf16 copy of the rows when the tokens
   take several blocks (the same values kvmesh_gemv_int4_bf16 makes a group at a time, the same
   VDPBF16PS walk over them: the same sums), not once a block. */
static void project(const kvmesh_model *m, const int kind, const void *w, const void *wp, const void *scales,
                    const void *zeros, const void *mins, const int sbf16, int64_t K, int64_t n0, int64_t n1,
                    const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, uint16_t *x16,
                    const int x_ready, const int a8) {
    if (n0 >= n1 || B == 0) return;
    const kvmesh_int4 p = {(const uint8_t *)w, scales, zeros, mins, m->int4_group, (int)m->int4_scale_dtype,
                           (int)m->int4_zero_dtype, (int)m->int4_min_dtype, (int)m->int4_interleaved,
                           (const float *)wp};  /* an int4 projection's "packed" copy: its kernel metadata */
    if (B <= TOKEN_BLOCK) {
        project_tokens(m, kind, w, wp, scales, &p, sbf16, K, n0, n1, x, ldx, B, y, ldy, x16, x_ready, a8);
        return;
    }
    if (kind == W_I4 && m->int4_bf16) {
        uint16_t *rows = (uint16_t *)scratch(1, sizeof(uint16_t) * (size_t)((n1 - n0) * K));
        const kvmesh_int4 q = int4_rows(p, n0, K);
        if (rows && kvmesh_int4_to_bf16(q.codes, q.scales, q.zeros, q.mins, q.group, q.scale_dtype, q.zero_dtype,
                                        q.min_dtype, n1 - n0, K, rows, 1)) {
            for (int64_t b0 = 0; b0 < B; b0 += TOKEN_BLOCK)
                kvmesh_gemv(rows, NULL, W_BF16, NULL, sbf16, K, 0, n1 - n0, x + b0 * ldx, ldx,
                            B - b0 < TOKEN_BLOCK ? B - b0 : TOKEN_BLOCK, y + b0 * ldy + n0, ldy, x16 + b0 * K,
                            x_ready, 0);
            return;
        }
    }
    /* int8 x int8 AMX products lay a call's input out in their own form (and keep its scales per
       thread): re-laid every block */
    const int ready = x_ready && !(a8 && kind == W_I8);
    for (int64_t b0 = 0; b0 < B; b0 += TOKEN_BLOCK)
        project_tokens(m, kind, w, wp, scales, &p, sbf16, K, n0, n1, x + b0 * ldx, ldx,
                       B - b0 < TOKEN_BLOCK ? B - b0 : TOKEN_BLOCK, y + b0 * ldy, ldy, x16 + b0 * K, ready, a8);
}

/* Vocabulary rows [c0, c1) of the LM head for S <= TOKEN_BLOCK final hidden rows x [S][H] ->
   logits [S][vocab] (x16: the thread's bf16 scratch, x_ready as project's). The LM head keeps
   fp32 activations: quantizing the final hidden state per row flipped the self-draft's argmax
   often enough to cut its acceptance from 0.90 to 0.85 (bundled chat prompts, measured
   2026-12-02 on the SPR machine of docs/benchmarks.md). An int4 model's int8-activation step
   (llama.cpp's scheme) takes its int8 head, a Q8_0 table or the int8 copy of a float head in
   16-row panels (lm_head_packed), as llama.cpp does, against the hidden state quantized per
   32-input block: at batch 1 that head was as long as all the int4 layers (SmolLM2-135M, 49152 x
   576; Llama-3.2-1B's, 128256 x 2048). */
static void lm_head_rows(const kvmesh_model *m, int64_t c0, int64_t c1, const float *x, int64_t S, float *logits,
                         uint16_t *x16, const int ready) {
    const int64_t H = m->hidden, V = m->vocab;
    const int bf16 = (int)m->bf16, head_a8 = m->int8_activations && m->weight_kind == W_I4;
    if (m->lm_head_packed && (m->lm_head_kind == W_I8 || m->lm_head_kind == W_I8G)) {
        /* 16-row panels (chunks start on a panel); a Q8_0 table's group scales (lm_head_scales) in panels too */
        const float *gs = m->lm_head_kind == W_I8G ? (const float *)m->lm_head_scales : NULL;
        if (!kvmesh_gemv_i8_panels((const int8_t *)m->lm_head_packed, m->lm_head_scales, bf16, gs, H, c0, c1, x, H, S,
                                   logits, V))
            kvmesh_gemv_i8_panels_fp32((const int8_t *)m->lm_head_packed, m->lm_head_scales, bf16, gs, H, c0, c1, x, H,
                                       S, logits, V);
    } else if (m->lm_head_kind == W_I8G && m->int4_bf16)  /* the bf16 model's head values, bf16 products */
        kvmesh_gemv_i8g_bf16((const int8_t *)m->lm_head_weight, (const float *)m->lm_head_scales, H, c0, c1, x, H, S,
                             logits, V, x16, ready);
    else if (m->lm_head_kind == W_I8G && head_a8)
        kvmesh_gemv_i8g_a8((const int8_t *)m->lm_head_weight, (const float *)m->lm_head_scales, H, c0, c1, x, H, S,
                           logits, V);
    else if (m->lm_head_kind == W_I8G)  /* a GGUF Q8_0 table read as stored */
        kvmesh_gemv_i8g((const int8_t *)m->lm_head_weight, (const float *)m->lm_head_scales, H, c0, c1, x, H, S,
                        logits, V);
    else
        kvmesh_gemv(m->lm_head_weight, m->lm_head_packed, (int)m->lm_head_kind, m->lm_head_scales, bf16, H, c0, c1, x,
                    H, S, logits, V, x16, ready, 0);
}

/* Thread tid of T inside the step's OpenMP team (torch's own pool: the library links the
   libgomp torch has loaded, so no second set of threads spins against torch's). */
static void step_thread(Step *s, const int64_t tid, const int64_t T) {
    const int64_t B = s->B;
    const kvmesh_model *m = s->m;
    const int64_t L = m->num_layers, H = m->hidden, I = m->intermediate;
    const int64_t hq = m->num_q_heads, hkv = m->num_kv_heads, D = m->head_dim;
    const int wk = (int)m->weight_kind, bf16 = (int)m->bf16, a8 = (int)m->int8_activations;
    const int64_t nqkv = (hq + 2 * hkv) * D, bs = m->block_size;
    const int64_t cbs = m->cache_block_stride, css = m->cache_slot_stride, chs = m->cache_head_stride;
    const float *cos_t = m->rope_cos, *sin_t = m->rope_sin;
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
    const void *embed = m->embed;
    if (priv && m->embed_scales) {  /* an int8 table (GGUF Q8_0): code x scale, exact in fp32, as eager */
        for (int64_t b = 0; b < B; b++) {
            const int8_t *row = (const int8_t *)embed + s->tokens[b] * H;
            const float *sc = m->embed_scales + s->tokens[b] * (H / 32);
            for (int64_t i = 0; i < H; i++) {
                const float v = (float)row[i] * sc[i / 32];
                res[b * H + i] = bf16 ? round_bf16(v) : v;  /* the rows come out in the model dtype */
            }
        }
    } else if (priv) for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < H; i++) res[b * H + i] = load_elem(embed, s->tokens[b] * H + i, bf16);
    #pragma omp barrier  /* everyone has its workspace (or knows someone has none) */
    if (__atomic_load_n(&s->failed, __ATOMIC_RELAXED)) return;
    kvmesh_amx_tiles_begin();
    /* each phase's chunk: rows of a projection (16-row aligned: AMX's packed blocks), tokens of attention */
    const int64_t qkv_chunk = chunk_size(nqkv, T, 16), h_chunk = chunk_size(H, T, 16);
    const int64_t gu_chunk = chunk_size(I, T, 16), token_chunk = chunk_size(B, T, 1);
    for (int64_t l = 0; l < L; l++) {
        const kvmesh_layer *lp = &m->layers[l];
        /* residual += previous layer's MLP output (the embedding itself at layer 0) */
        if (l > 0) {
            #pragma omp simd
            for (int64_t i = 0; i < B * H; i++) res[i] += s->down_out[i];
        }
        rms_norm_rows(res, lp->input_norm, bf16, B, H, s->eps, h);
        const int64_t ph = l * PHASES;
        int64_t c0, c1;
        for (int ready = 0; take_chunk(s, ph, nqkv, qkv_chunk, &c0, &c1); ready = 1)
            project(m, wk, lp->qkv_weight, lp->qkv_packed, lp->qkv_scales, lp->qkv_zeros, lp->qkv_mins, bf16, H,
                    c0, c1, h, H, B, s->qkv, nqkv, x16, ready, a8);
        #pragma omp barrier
        /* RoPE on q and k heads, K/V into the cache: this thread's tokens */
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
            void *kc = lp->key_cache, *vc = lp->value_cache;
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
        while (take_chunk(s, ph + 1, B, token_chunk, &c0, &c1))
            if ((bf16 ? kvmesh_paged_decode_bf16 : kvmesh_paged_decode_f32)(
                    s->q_attn, hq * D, D, lp->key_cache, lp->value_cache, cbs, css, chs, s->tables, s->t_rs,
                    s->seq_lens, s->rows, s->rows, c0, c1, s->attn_out, hq * D, D, hq, hkv, D, bs, scale))
                __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
        #pragma omp barrier
        #pragma omp simd
        for (int64_t i = 0; i < B * hq * D; i++) attn[i] = load_elem(s->attn_out, i, bf16);
        for (int ready = 0; take_chunk(s, ph + 2, H, h_chunk, &c0, &c1); ready = 1)
            project(m, wk, lp->o_weight, lp->o_packed, lp->o_scales, lp->o_zeros, lp->o_mins, bf16, hq * D,
                    c0, c1, attn, hq * D, B, s->o_out, H, x16, ready, a8);
        #pragma omp barrier
        #pragma omp simd
        for (int64_t i = 0; i < B * H; i++) res[i] += s->o_out[i];
        rms_norm_rows(res, lp->post_attention_norm, bf16, B, H, s->eps, h);
        /* gate rows i and up rows I + i of each chunk of the intermediate width, then
           act = silu(gate) * up for them: up to TOKEN_BLOCK tokens into this thread's [2][B][w]
           scratch, more through project()'s token blocks into columns i and I + i of gate_up [B][2I] */
        const int64_t es = w_elem_size(wk);
        float *gu = B <= TOKEN_BLOCK ? (float *)scratch(3, sizeof(float) * (size_t)(2 * B * gu_chunk)) : s->gate_up;
        if (!gu) __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
        for (int ready = 0; gu && take_chunk(s, ph + 3, I, gu_chunk, &c0, &c1); ready = 1) {
            const int64_t i0 = c0, w = c1 - c0;
            if (B > TOKEN_BLOCK) {
                project(m, wk, lp->gate_up_weight, lp->gate_up_packed, lp->gate_up_scales, lp->gate_up_zeros,
                        lp->gate_up_mins, bf16, H, c0, c1, h, H, B, gu, 2 * I, x16, ready, a8);
                project(m, wk, lp->gate_up_weight, lp->gate_up_packed, lp->gate_up_scales, lp->gate_up_zeros,
                        lp->gate_up_mins, bf16, H, I + c0, I + c1, h, H, B, gu, 2 * I, x16, 1, a8);
                for (int64_t b = 0; b < B; b++)
                    silu_mul(gu + b * 2 * I + i0, gu + b * 2 * I + I + i0, w, s->act + b * I + i0);
                continue;
            }
            if (wk == W_I4) {  /* rows i0.. and I + i0.. of the codes and their groups */
                const kvmesh_int4 all = {(const uint8_t *)lp->gate_up_weight, lp->gate_up_scales,
                                         lp->gate_up_zeros, lp->gate_up_mins, m->int4_group,
                                         (int)m->int4_scale_dtype, (int)m->int4_zero_dtype, (int)m->int4_min_dtype,
                                         (int)m->int4_interleaved, (const float *)lp->gate_up_packed};
                const kvmesh_int4 gate = int4_rows(all, i0, H), up = int4_rows(all, I + i0, H);
                if (m->int4_bf16) {
                    kvmesh_gemv_int4_bf16(&gate, H, 0, w, h, H, B, gu, w, x16, ready);
                    kvmesh_gemv_int4_bf16(&up, H, 0, w, h, H, B, gu + B * w, w, x16, 1);
                } else {
                    kvmesh_gemv_int4(&gate, H, 0, w, h, H, B, gu, w, int4_form(m));
                    kvmesh_gemv_int4(&up, H, 0, w, h, H, B, gu + B * w, w, int4_form(m));
                }
            } else {
                const char *gw = (const char *)lp->gate_up_weight;
                const char *gs = (const char *)lp->gate_up_scales, *us = gs;
                if (gs) { gs += i0 * esz; us += (I + i0) * esz; }
                const char *gp = (const char *)lp->gate_up_packed;  /* packed: same element offsets */
                kvmesh_gemv(gw + i0 * H * es, gp ? gp + i0 * H * es : 0, wk, gs, bf16, H, 0, w, h, H, B, gu, w,
                            x16, ready, a8);
                kvmesh_gemv(gw + (I + i0) * H * es, gp ? gp + (I + i0) * H * es : 0, wk, us, bf16, H, 0, w, h,
                            H, B, gu + B * w, w, x16, 1, a8);
            }
            for (int64_t b = 0; b < B; b++) silu_mul(gu + b * w, gu + B * w + b * w, w, s->act + b * I + i0);
        }
        #pragma omp barrier
        for (int ready = 0; take_chunk(s, ph + 4, H, h_chunk, &c0, &c1); ready = 1)
            project(m, wk, lp->down_weight, lp->down_packed, lp->down_scales, lp->down_zeros, lp->down_mins, bf16, I,
                    c0, c1, s->act, I, B, s->down_out, H, x16, ready, a8);
        #pragma omp barrier
    }
    for (int64_t i = 0; i < B * H; i++) res[i] += s->down_out[i];
    rms_norm_rows(res, m->final_norm, bf16, B, H, s->eps, h);
    for (int64_t j = 0; j < s->S; j++)  /* the LM head's input rows, rounded to the model dtype as eager */
        for (int64_t i = 0; i < H; i++)
            picked[j * H + i] = bf16 ? round_bf16(h[s->sample_rows[j] * H + i]) : h[s->sample_rows[j] * H + i];
    const int64_t V = m->vocab;
    int64_t c0, c1;
    for (int ready = 0; take_chunk(s, L * PHASES, V, chunk_size(V, T, 16), &c0, &c1); ready = 1)
        for (int64_t j0 = 0; j0 < s->S; j0 += TOKEN_BLOCK)
            lm_head_rows(m, c0, c1, picked + j0 * H, s->S - j0 < TOKEN_BLOCK ? s->S - j0 : TOKEN_BLOCK,
                         s->logits + j0 * V, x16 + j0 * H, ready);
    kvmesh_amx_tiles_end();
}

/* One step of the batch (kvmesh_step_batch says what each field holds): KVMESH_STEP_*. */
int kvmesh_native_step(const kvmesh_model *m, const kvmesh_step_batch *batch) {
    const int64_t B = batch->num_tokens;
    const int64_t nqkv = (m->num_q_heads + 2 * m->num_kv_heads) * m->head_dim, qw = m->num_q_heads * m->head_dim;
    const int64_t esz = m->bf16 ? 2 : 4;
    const size_t phases = (size_t)(m->num_layers * PHASES + 1);
    int64_t *taken = (int64_t *)scratch(2, sizeof(int64_t) * phases
                                       + sizeof(float) * (size_t)(B * (nqkv + 2 * m->hidden + 3 * m->intermediate))
                                       + (size_t)(2 * B * qw * esz));
    if (!taken) return KVMESH_STEP_NO_MEMORY;
    memset(taken, 0, sizeof(int64_t) * phases);
    float *shared = (float *)(taken + phases);
    Step s = {m, m->rms_norm_eps, B, batch->num_threads < 1 ? 1 : batch->num_threads, batch->tokens,
              batch->positions, batch->slots, batch->rows, batch->block_tables, batch->seq_lens,
              batch->block_table_width, batch->sample_rows, batch->num_samples, batch->logits};
    s.qkv = shared;
    s.o_out = s.qkv + B * nqkv;
    s.down_out = s.o_out + B * m->hidden;
    s.gate_up = s.down_out + B * m->hidden;
    s.act = s.gate_up + B * 2 * m->intermediate;
    s.q_attn = (void *)(s.act + B * m->intermediate);
    s.attn_out = (char *)s.q_attn + B * qw * esz;
    s.taken = taken;
    s.failed = 0;
    #pragma omp parallel num_threads((int)s.threads)
    step_thread(&s, omp_get_thread_num(), omp_get_num_threads());
    return s.failed ? KVMESH_STEP_NO_MEMORY : KVMESH_STEP_OK;
}

int kvmesh_native_step_check(const kvmesh_model *m) {
    /* the step's own assumptions (cpu_native_step.py's CHECK_FAILURES names each number) */
    const int64_t widths[] = {m->hidden, m->intermediate, m->num_q_heads * m->head_dim, m->head_dim};
    for (int i = 0; i < 4; i++)
        if (widths[i] <= 0 || widths[i] % 16) return 1;
    if (m->num_kv_heads <= 0 || m->num_q_heads % m->num_kv_heads) return 2;
    if (m->weight_kind < W_F32 || m->weight_kind > W_I4 || m->lm_head_kind < W_F32 || m->lm_head_kind > W_I8G
        || m->lm_head_kind == W_I4 || ((m->lm_head_kind == W_I8G || m->embed_scales) && m->hidden % 32))
        return 3;
    if (m->bf16 != 0 && m->bf16 != 1) return 4;
    /* an int8 head in panels: the int4 x int8 step's (int4_panels.c), whose chunks of rows are 16-aligned */
    if (m->lm_head_packed && (m->lm_head_kind == W_I8 || m->lm_head_kind == W_I8G)
        && (!m->int8_activations || m->weight_kind != W_I4 || m->hidden % 32))
        return 3;
    const int head_scaled = m->lm_head_kind == W_I8 || m->lm_head_kind == W_I8G;
    if (!m->embed || !m->final_norm || !m->rope_cos || !m->rope_sin || !m->lm_head_weight || m->vocab <= 0
        || head_scaled != (m->lm_head_scales != NULL))
        return 5;
    if (m->num_layers <= 0 || !m->layers || m->block_size <= 0) return 6;
    const int i4 = m->weight_kind == W_I4;
    if (i4) {  /* kvmesh_gemv_int4 walks whole groups of 32-input blocks */
        const int64_t g = m->int4_group, dts[] = {m->int4_scale_dtype, m->int4_zero_dtype, m->int4_min_dtype};
        if (g <= 0 || g % 32 || m->hidden % g || m->intermediate % g || (m->num_q_heads * m->head_dim) % g)
            return 9;
        for (int i = 0; i < 3; i++)
            if (dts[i] < META_F32 || dts[i] > META_F16) return 9;
    }
    /* bf16 products: a bf16 model's plain int4 rows (fp32 activations otherwise), this build's VDPBF16PS */
    if (m->int4_bf16 && (!i4 || m->bf16 != 1 || m->int8_activations || m->int4_interleaved || m->hidden % 32
                         || m->intermediate % 32 || (m->num_q_heads * m->head_dim) % 32 || !kvmesh_bf16_products()))
        return 11;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const kvmesh_layer *lp = &m->layers[l];
        const int scaled = m->weight_kind == W_I8 || i4;
        if (!lp->input_norm || !lp->post_attention_norm || !lp->qkv_weight || !lp->o_weight || !lp->gate_up_weight
            || !lp->down_weight || !lp->key_cache || !lp->value_cache)
            return 7;
        if (scaled != (lp->qkv_scales != NULL) || scaled != (lp->o_scales != NULL)
            || scaled != (lp->gate_up_scales != NULL) || scaled != (lp->down_scales != NULL))
            return 8;
        if (i4 != (lp->qkv_zeros != NULL) || i4 != (lp->o_zeros != NULL) || i4 != (lp->gate_up_zeros != NULL)
            || i4 != (lp->down_zeros != NULL))
            return 10;
    }
    return 0;
}
