/* mla: multi-head latent attention (DeepSeek-V3, Kimi K2): the attention block's forward
 * and backward over a packed batch, with LoRA on its projections. */
#ifndef MOERL_ACTOR_MLA_H
#define MOERL_ACTOR_MLA_H

#include <stdint.h>

#include "actor/model_config.h"
#include "core/arena.h"
#include "core/kernels.h"
#include "lora/lora.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens, B sequences, D model width, H heads, Rq q_lora_rank, Rkv kv_lora_rank,
 * Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, Dq = Dn + Dr the query/key head
 * dim, Dp = max(Dq, Dv) the head dim the attention kernel runs at, R LoRA rank.
 *
 * On the normed residual x (T, D), as Hugging Face's DeepseekV3Attention:
 *   q   = q_b_proj(rmsnorm(q_a_proj(x)))  (Rq > 0)  or  q_proj(x)  (Rq = 0)   (T, H, Dq)
 *   c   = kv_a_proj_with_mqa(x) = [c_kv (Rkv) | k_pe (Dr)]                        (T, Rkv + Dr)
 *   kv  = kv_b_proj(rmsnorm(c_kv)) = per head [k_nope (Dn) | v (Dv)]             (T, H, Dn + Dv)
 *   query = [q_nope | rope(q_pe)], key = [k_nope | rope(k_pe)] (k_pe shared by every head)
 *   out = o_proj(causal attention(query, key, v))                                 (T, D)
 * RoPE acts on the last Dr dims of each head. With rope_interleave the rope dims are first
 * permuted from (x0, x1, x2, x3, ...) to (x0, x2, ..., x1, x3, ...) and then rotated in
 * the rotate-half layout (Hugging Face's apply_rotary_pos_emb_interleave; the result stays
 * permuted, which leaves q . k unchanged). The two latent RMSNorms use eps 1e-6, as the
 * Hugging Face modules are built without the config's rms_norm_eps.
 *
 * The attention kernel takes one head dim for q, k and v: query and key are zero-padded
 * from Dq to Dp and v from Dv to Dp (zero columns add nothing to the scores and give zero
 * output columns), and the output is sliced back to Dv before o_proj. */

/* Dimensions and constants of the MLA layers of a model. */
typedef struct mla_cfg {
    int D, H;
    int q_rank;            /* Rq; 0: q_proj */
    int kv_rank;           /* Rkv */
    int nope, rope;        /* Dn, Dr */
    int vd;                /* Dv */
    int qd;                /* Dq = Dn + Dr */
    int pd;                /* Dp = max(Dq, Dv) */
    int interleave;        /* rope dims stored as interleaved pairs */
    float norm_eps;        /* of q_a_layernorm and kv_a_layernorm: 1e-6 */
    float scale;           /* softmax scale: Dq^-0.5, times mscale^2 for DeepSeek YaRN */
    const float *inv_freq; /* (Dr / 2) RoPE frequencies, set by the caller */
    float rope_mscale;     /* cos/sin multiplier, set by the caller */
} mla_cfg_t;

/* Fills c from a DeepSeek-V3 config (MO_EINVAL when it has no MLA dimensions). The
 * softmax scale is qk_head_dim^-0.5, multiplied by yarn_get_mscale(factor,
 * mscale_all_dim)^2 when rope_scaling sets mscale_all_dim; inv_freq and rope_mscale are
 * left for the caller (rope_init with rot = qk_rope_head_dim). */
int mla_cfg_init(mla_cfg_t *c, const model_config_t *mc);

/* One layer's frozen MLA weights and the adapters bound to them (NULL: none). */
typedef struct mla_weights {
    wview_t q_a;            /* (Rq, D) q_a_proj, when Rq > 0 */
    const float *q_a_norm;  /* (Rq) q_a_layernorm, when Rq > 0 */
    wview_t q_b;            /* (H Dq, Rq) q_b_proj, when Rq > 0 */
    wview_t q;              /* (H Dq, D) q_proj, when Rq = 0 */
    wview_t kv_a;           /* (Rkv + Dr, D) kv_a_proj_with_mqa */
    const float *kv_a_norm; /* (Rkv) kv_a_layernorm */
    wview_t kv_b;           /* (H (Dn + Dv), Rkv) kv_b_proj */
    wview_t o;              /* (D, H Dv) o_proj */
    const lora_pair_t *lora_q_a, *lora_q_b, *lora_q, *lora_kv_a, *lora_kv_b, *lora_o;
    /* Gradients of the two latent norms when they are trained (the backward accumulates
     * into them), or NULL (frozen). */
    float *d_q_a_norm;  /* (Rq) */
    float *d_kv_a_norm; /* (Rkv) */
} mla_weights_t;

/* What the forward keeps for the backward (in the caller's arena). Buffers of absent
 * adapters and of the absent q path are NULL. */
typedef struct mla_acts {
    const float *x;   /* (T, D) the block input (not owned) */
    float *qa;        /* (T, Rq) q_a_proj output */
    float *qa_n;      /* (T, Rq) after q_a_layernorm */
    float *rstd_qa;   /* (T) */
    float *ckv;       /* (T, Rkv) c_kv, before kv_a_layernorm */
    float *ckv_n;     /* (T, Rkv) after kv_a_layernorm */
    float *rstd_kv;   /* (T) */
    float *q, *k, *v; /* (T, H, Dp) attention inputs, zero-padded */
    float *att;       /* (T, H, Dp) attention output */
    float *lse;       /* (T, H) */
    float *ao;        /* (T, H Dv) o_proj input */
    float *xa_q_a, *xa_q_b, *xa_q, *xa_kv_a, *xa_kv_b, *xa_o; /* (T, R) adapter inputs x A^T */
} mla_acts_t;

/* out (T, D) = the attention block on x (T, D); pos (T) RoPE positions; cu (B + 1) the
 * packed sequences. Fills a (from ar). MO_ENOMEM when the arena cannot grow. */
int mla_forward(const kernels_t *k, arena_t *ar, mla_acts_t *a, float *out, const float *x,
                const mla_cfg_t *c, const mla_weights_t *w, const int32_t *pos, const int32_t *cu,
                int B, int T);

/* From dout (T, D): dx (T, D, or NULL) += the gradient at x, and the bound adapters' dA,
 * dB and the latent norms' d_q_a_norm, d_kv_a_norm (where set) accumulate. Temporaries
 * come from ar. */
int mla_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout, const mla_acts_t *a,
                 const mla_cfg_t *c, const mla_weights_t *w, const int32_t *pos, const int32_t *cu,
                 int B, int T);

#ifdef __cplusplus
}
#endif
#endif
