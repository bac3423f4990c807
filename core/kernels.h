/* kernels: the op table every backend fills (CPU reference, CUDA).
 *
 * Conventions, shared by every backend:
 * - Dimension letters: N rows (tokens), T tokens, D width, F expert hidden,
 *   H heads, Hkv kv heads, Dh head dim, V vocab, K experts per token, C in
 *   features, OC out features, R LoRA rank, B sequences.
 * - Activations and gradients are f32; frozen weights are read through a
 *   wview_t in their stored dtype.
 * - Forward functions overwrite their outputs. Backward functions ACCUMULATE
 *   (+=) into every gradient output, which callers zero first; a NULL gradient
 *   output is skipped.
 * - Outputs come first, inputs after. No op allocates per call; a CPU op may
 *   keep a grow-only per-thread scratch buffer (see core/cpu/scratch.h).
 */
#ifndef MOERL_CORE_KERNELS_H
#define MOERL_CORE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A read-only weight matrix (rows, cols) in row-major order, in any float
 * dtype. fp8 weights may carry DeepSeek-style block scales: the real value of
 * element (r, c) is data[r, c] * scale[r / block, c / block], with scale of
 * shape (ceil(rows / block), ceil(cols / block)). */
typedef struct wview {
    const void *data;
    dtype_t dtype;
    const float *scale; /* NULL unless fp8 with block scales */
    int block;          /* scale block edge (128 in DeepSeek-V3), 0 without scales */
} wview_t;

static inline wview_t wview_f32(const float *p) {
    wview_t w = {p, DT_F32, NULL, 0};
    return w;
}

static inline wview_t wview_of(const void *p, dtype_t dt) {
    wview_t w = {p, dt, NULL, 0};
    return w;
}

/* RoPE scaling as Hugging Face configs carry it (rope_scaling). */
typedef enum { ROPE_DEFAULT = 0, ROPE_LINEAR, ROPE_LLAMA3, ROPE_YARN } rope_type_t;

typedef struct rope_scaling {
    rope_type_t type;
    float factor;               /* linear, llama3, yarn */
    float low_freq_factor;      /* llama3 */
    float high_freq_factor;     /* llama3 */
    int original_max_position;  /* llama3, yarn */
    float beta_fast, beta_slow; /* yarn (defaults 32, 1) */
    float mscale;               /* yarn, DeepSeek style (0 = unset) */
    float mscale_all_dim;       /* yarn, DeepSeek style (0 = unset) */
    float attention_factor;     /* yarn (0 = derive from factor) */
} rope_scaling_t;

typedef struct kernels {
    /* out (T, OC) = inp (T, C) @ w^T, w (OC, C); plus bias (OC) if not NULL. */
    void (*matmul_forward)(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                           int C, int OC);
    /* dinp (T, C) += dout @ w; dw (OC, C) += dout^T @ inp (w must be f32 when dw != NULL);
     * dbias (OC) += column sums of dout. */
    void (*matmul_backward)(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const wview_t *w, int T, int C, int OC);

    /* out (T, D) = wte[ids[t]], wte (V, D). */
    void (*embedding_forward)(float *out, const int32_t *ids, const wview_t *wte, int T, int D);
    /* dwte (V, D) += scatter of dout (T, D) by ids. */
    void (*embedding_backward)(float *dwte, const float *dout, const int32_t *ids, int T, int D);

    /* out (N, D) = x * rstd * w; rstd (N) = 1 / sqrt(mean(x^2) + eps); w NULL means ones. */
    void (*rmsnorm_forward)(float *out, float *rstd, const float *x, const float *w, int N, int D,
                            float eps);
    void (*rmsnorm_backward)(float *dx, float *dw, const float *dout, const float *x,
                             const float *w, const float *rstd, int N, int D);

    /* Rotary embedding, rotate-half layout (pairs i, i + rot/2) on the first
     * `rot` of Dh dims of each head; x (N, H, Dh), pos (N); angles pos * inv_freq (rot/2)
     * computed in f32, cos and sin multiplied by mscale. out may equal x. */
    void (*rope_forward)(float *out, const float *x, const int32_t *pos, const float *inv_freq,
                         float mscale, int N, int H, int Dh, int rot);
    /* dx += R^T dout; dx must not alias dout. */
    void (*rope_backward)(float *dx, const float *dout, const int32_t *pos, const float *inv_freq,
                          float mscale, int N, int H, int Dh, int rot);

    /* Causal attention with grouped-query heads over B packed sequences:
     * sequence b holds tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 (cu_seqlens (B+1)).
     * q (T, H, Dh), k and v (T, Hkv, Dh), out (T, H, Dh), lse (T, H) the
     * log-sum-exp of each softmax row (kept for backward). window > 0 limits
     * token i to keys j with i - j < window; 0 means no limit. */
    void (*attention_forward)(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *cu_seqlens, int B, int H, int Hkv,
                              int Dh, float scale, int window);
    void (*attention_backward)(float *dq, float *dk, float *dv, const float *dout, const float *q,
                               const float *k, const float *v, const float *out, const float *lse,
                               const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh,
                               float scale, int window);

    /* out (n) = silu(gate) * up. */
    void (*swiglu_forward)(float *out, const float *gate, const float *up, size_t n);
    void (*swiglu_backward)(float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, size_t n);

    /* Row softmax of x (N, C). */
    void (*softmax_forward)(float *out, const float *x, int N, int C);
    void (*softmax_backward)(float *dx, const float *dout, const float *out, int N, int C);

    /* The K largest of each row of x (N, C), in descending order; ties go
     * to the lower index. idx (N, K), val (N, K). */
    void (*topk_forward)(int32_t *idx, float *val, const float *x, int N, int C, int K);
    /* dx (N, C) += scatter of dval (N, K) by idx. */
    void (*topk_backward)(float *dx, const float *dval, const int32_t *idx, int N, int C, int K);

    /* For logits (N, V) divided by temperature: logp (N) the log-probability of
     * targets (N), entropy (N, or NULL) of the distribution, lse (N) its
     * log-sum-exp (of the scaled logits). */
    void (*logprob_forward)(float *logp, float *entropy, float *lse, const float *logits,
                            const int32_t *targets, int N, int V, float temperature);
    /* dlogits (N, V) += from dlogp (N, or NULL) and dentropy (N, or NULL). */
    void (*logprob_backward)(float *dlogits, const float *dlogp, const float *dentropy,
                             const float *logits, const float *lse, const int32_t *targets, int N,
                             int V, float temperature);

    /* AdamW with decoupled weight decay and bias correction; step counts from 1. */
    void (*adamw_update)(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int step);
} kernels_t;

/* Fills inv_freq (rot/2) and *mscale for a rotary dimension, base theta and
 * optional scaling (NULL or ROPE_DEFAULT: none). MO_EINVAL on bad fields. */
int rope_init(float *inv_freq, float *mscale, int rot, float theta, const rope_scaling_t *sc);

#ifdef __cplusplus
}
#endif
#endif
