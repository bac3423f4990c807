/* mla: multi-head latent attention forward and backward (see mla.h for the math). */
#include "actor/mla.h"

#include <math.h>
#include <string.h>

#include "core/status.h"

#define ALLOC(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = arena_alloc((ar), sizeof(*(ptr)) * (size_t)(n));                                   \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "MLA activations");                                    \
    } while (0)

#define ZEROS(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = arena_calloc((ar), sizeof(*(ptr)) * (size_t)(n));                                  \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "MLA backward");                                       \
    } while (0)

/* YaRN's attention scale (transformers' yarn_get_mscale). */
static double yarn_mscale(double factor, double mscale) {
    return factor <= 1.0 ? 1.0 : 0.1 * mscale * log(factor) + 1.0;
}

int mla_cfg_init(mla_cfg_t *c, const model_config_t *mc) {
    if (mc->arch != ARCH_DEEPSEEK_V3 || mc->kv_lora_rank < 1 || mc->qk_rope_head_dim < 2 ||
        mc->qk_rope_head_dim % 2 != 0 || mc->qk_nope_head_dim < 0 || mc->v_head_dim < 1 ||
        mc->q_lora_rank < 0 || mc->num_attention_heads < 1 || mc->hidden_size < 1)
        return mo_errorf(MO_EINVAL,
                         "MLA: %s needs kv_lora_rank >= 1, an even qk_rope_head_dim >= 2, "
                         "qk_nope_head_dim >= 0, v_head_dim >= 1 and q_lora_rank >= 0 "
                         "(got %d, %d, %d, %d, %d)",
                         model_arch_name(mc->arch), mc->kv_lora_rank, mc->qk_rope_head_dim,
                         mc->qk_nope_head_dim, mc->v_head_dim, mc->q_lora_rank);
    memset(c, 0, sizeof *c);
    c->D = mc->hidden_size;
    c->H = mc->num_attention_heads;
    c->q_rank = mc->q_lora_rank;
    c->kv_rank = mc->kv_lora_rank;
    c->nope = mc->qk_nope_head_dim;
    c->rope = mc->qk_rope_head_dim;
    c->vd = mc->v_head_dim;
    c->qd = c->nope + c->rope;
    c->pd = c->qd > c->vd ? c->qd : c->vd;
    c->interleave = mc->rope_interleave != 0;
    c->norm_eps = 1e-6f;
    double s = 1.0 / sqrt((double)c->qd);
    const rope_scaling_t *r = &mc->rope_scaling;
    if (r->type != ROPE_DEFAULT && r->mscale_all_dim != 0.0f) {
        double ms = yarn_mscale(r->factor, r->mscale_all_dim);
        s *= ms * ms;
    }
    c->scale = (float)s;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Layout helpers.                                                           */

/* Source dim of rope dim j: the interleave permutation (x0, x2, ..., x1, x3, ...). */
static inline int rope_src(int j, int Dr, int interleave) {
    int half = Dr / 2;
    if (!interleave)
        return j;
    return j < half ? 2 * j : 2 * (j - half) + 1;
}

/* dst (T, nh, Dr) = the Dr dims at offset off of each head of src, head h of row t at
 * src + t * rs + h * hs, reordered by the interleave permutation when perm. */
static void gather_rope(float *dst, const float *src, int T, int nh, size_t rs, size_t hs, int off,
                        int Dr, int perm) {
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            const float *s = src + (size_t)t * rs + (size_t)h * hs + off;
            float *d = dst + ((size_t)t * nh + h) * Dr;
            for (int j = 0; j < Dr; j++)
                d[j] = s[rope_src(j, Dr, perm)];
        }
}

/* The transpose of gather_rope: dst's dims (strided as above) += src (T, nh, Dr). */
static void scatter_rope(float *dst, const float *src, int T, int nh, size_t rs, size_t hs, int off,
                         int Dr, int perm) {
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            float *d = dst + (size_t)t * rs + (size_t)h * hs + off;
            const float *s = src + ((size_t)t * nh + h) * Dr;
            for (int j = 0; j < Dr; j++)
                d[rope_src(j, Dr, perm)] += s[j];
        }
}

/* dst (T, n) = columns [off, off + n) of src (T, ld). */
static void take_cols(float *dst, const float *src, int T, int ld, int off, int n) {
    for (int t = 0; t < T; t++)
        memcpy(dst + (size_t)t * n, src + (size_t)t * ld + off, sizeof(float) * (size_t)n);
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

/* out (T, OC) = inp (T, C) W^T (+ its adapter; xa (T, R) allocated when present). */
static int proj_forward(const kernels_t *k, arena_t *ar, float *out, float **xa, const float *inp,
                        const wview_t *w, const lora_pair_t *p, int T, int C, int OC) {
    k->matmul_forward(out, inp, w, NULL, T, C, OC);
    *xa = NULL;
    if (p) {
        ALLOC(*xa, ar, (size_t)T * p->R);
        lora_forward(k, out, *xa, inp, p, T, C, OC);
    }
    return MO_OK;
}

/* qraw (T, H Dq): q_b_proj(q_a_layernorm(q_a_proj(x))) or q_proj(x). */
static int q_forward(const kernels_t *k, arena_t *ar, mla_acts_t *a, float *qraw,
                     const mla_cfg_t *c, const mla_weights_t *w, int T) {
    int D = c->D, Rq = c->q_rank, qo = c->H * c->qd;
    if (Rq == 0)
        return proj_forward(k, ar, qraw, &a->xa_q, a->x, &w->q, w->lora_q, T, D, qo);
    ALLOC(a->qa, ar, (size_t)T * Rq);
    ALLOC(a->qa_n, ar, (size_t)T * Rq);
    ALLOC(a->rstd_qa, ar, T);
    TRY(proj_forward(k, ar, a->qa, &a->xa_q_a, a->x, &w->q_a, w->lora_q_a, T, D, Rq));
    k->rmsnorm_forward(a->qa_n, a->rstd_qa, a->qa, w->q_a_norm, T, Rq, c->norm_eps);
    return proj_forward(k, ar, qraw, &a->xa_q_b, a->qa_n, &w->q_b, w->lora_q_b, T, Rq, qo);
}

/* a->q (T, H, Dp) = [q_nope | rope(q_pe) | 0] from qraw (T, H, Dq). */
static int build_query(const kernels_t *k, arena_t *ar, mla_acts_t *a, const float *qraw,
                       const mla_cfg_t *c, const int32_t *pos, int T) {
    int H = c->H, Dn = c->nope, Dr = c->rope, Dq = c->qd, Dp = c->pd;
    float *qpe; /* (T, H, Dr) */
    ALLOC(qpe, ar, (size_t)T * H * Dr);
    gather_rope(qpe, qraw, T, H, (size_t)H * Dq, (size_t)Dq, Dn, Dr, c->interleave);
    k->rope_forward(qpe, qpe, pos, c->inv_freq, c->rope_mscale, T, H, Dr, Dr);
    ALLOC(a->q, ar, (size_t)T * H * Dp);
    for (size_t th = 0; th < (size_t)T * H; th++) {
        float *d = a->q + th * Dp;
        memcpy(d, qraw + th * Dq, sizeof(float) * (size_t)Dn);
        memcpy(d + Dn, qpe + th * Dr, sizeof(float) * (size_t)Dr);
        memset(d + Dq, 0, sizeof(float) * (size_t)(Dp - Dq));
    }
    return MO_OK;
}

/* a->k, a->v (T, H, Dp) from kvb (T, H, Dn + Dv) and the rotated shared kpe (T, Dr). */
static void build_key_value(mla_acts_t *a, const float *kvb, const float *kpe, const mla_cfg_t *c,
                            int T) {
    int H = c->H, Dn = c->nope, Dr = c->rope, Dv = c->vd, Dq = c->qd, Dp = c->pd;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            size_t th = (size_t)t * H + h;
            const float *src = kvb + th * (size_t)(Dn + Dv);
            float *kd = a->k + th * Dp, *vd = a->v + th * Dp;
            memcpy(kd, src, sizeof(float) * (size_t)Dn);
            memcpy(kd + Dn, kpe + (size_t)t * Dr, sizeof(float) * (size_t)Dr);
            memset(kd + Dq, 0, sizeof(float) * (size_t)(Dp - Dq));
            memcpy(vd, src + Dn, sizeof(float) * (size_t)Dv);
            memset(vd + Dv, 0, sizeof(float) * (size_t)(Dp - Dv));
        }
}

/* The key/value path: a->k, a->v from x. */
static int kv_forward(const kernels_t *k, arena_t *ar, mla_acts_t *a, const mla_cfg_t *c,
                      const mla_weights_t *w, const int32_t *pos, int T) {
    int D = c->D, H = c->H, Rkv = c->kv_rank, Dr = c->rope, Dp = c->pd;
    int ca = Rkv + Dr, kvo = H * (c->nope + c->vd);
    float *comp, *kpe, *kvb; /* (T, Rkv + Dr), (T, Dr), (T, H (Dn + Dv)) */
    ALLOC(comp, ar, (size_t)T * ca);
    TRY(proj_forward(k, ar, comp, &a->xa_kv_a, a->x, &w->kv_a, w->lora_kv_a, T, D, ca));
    ALLOC(kpe, ar, (size_t)T * Dr);
    gather_rope(kpe, comp, T, 1, (size_t)ca, 0, Rkv, Dr, c->interleave);
    k->rope_forward(kpe, kpe, pos, c->inv_freq, c->rope_mscale, T, 1, Dr, Dr);
    ALLOC(a->ckv, ar, (size_t)T * Rkv);
    ALLOC(a->ckv_n, ar, (size_t)T * Rkv);
    ALLOC(a->rstd_kv, ar, T);
    take_cols(a->ckv, comp, T, ca, 0, Rkv);
    k->rmsnorm_forward(a->ckv_n, a->rstd_kv, a->ckv, w->kv_a_norm, T, Rkv, c->norm_eps);
    ALLOC(kvb, ar, (size_t)T * kvo);
    TRY(proj_forward(k, ar, kvb, &a->xa_kv_b, a->ckv_n, &w->kv_b, w->lora_kv_b, T, Rkv, kvo));
    ALLOC(a->k, ar, (size_t)T * H * Dp);
    ALLOC(a->v, ar, (size_t)T * H * Dp);
    build_key_value(a, kvb, kpe, c, T);
    return MO_OK;
}

int mla_forward(const kernels_t *k, arena_t *ar, mla_acts_t *a, float *out, const float *x,
                const mla_cfg_t *c, const mla_weights_t *w, const int32_t *pos, const int32_t *cu,
                int B, int T) {
    int H = c->H, Dv = c->vd, Dp = c->pd;
    memset(a, 0, sizeof *a);
    a->x = x;
    float *qraw; /* (T, H Dq) */
    ALLOC(qraw, ar, (size_t)T * H * c->qd);
    TRY(q_forward(k, ar, a, qraw, c, w, T));
    TRY(build_query(k, ar, a, qraw, c, pos, T));
    TRY(kv_forward(k, ar, a, c, w, pos, T));
    ALLOC(a->att, ar, (size_t)T * H * Dp);
    ALLOC(a->lse, ar, (size_t)T * H);
    k->attention_forward(a->att, a->lse, a->q, a->k, a->v, cu, B, H, H, Dp, c->scale, 0);
    ALLOC(a->ao, ar, (size_t)T * H * Dv);
    take_cols(a->ao, a->att, T * H, Dp, 0, Dv);
    return proj_forward(k, ar, out, &a->xa_o, a->ao, &w->o, w->lora_o, T, H * Dv, c->D);
}

/* ------------------------------------------------------------------------ */
/* Backward.                                                                 */

/* dinp (T, C, or NULL) += from dout (T, OC) through W and its adapter. */
static void proj_backward(const kernels_t *k, float *dinp, const float *dout, const float *inp,
                          const float *xa, const wview_t *w, const lora_pair_t *p, int T, int C,
                          int OC, float *tmp) {
    if (dinp)
        k->matmul_backward(dinp, NULL, NULL, dout, inp, w, T, C, OC);
    if (p)
        lora_backward(k, dinp, dout, inp, xa, p, T, C, OC, tmp);
}

static int max_rank(const mla_weights_t *w) {
    const lora_pair_t *ps[6] = {w->lora_q_a,  w->lora_q_b,  w->lora_q,
                                w->lora_kv_a, w->lora_kv_b, w->lora_o};
    int r = 1;
    for (int i = 0; i < 6; i++)
        if (ps[i] && ps[i]->R > r)
            r = ps[i]->R;
    return r;
}

/* dqraw (T, H Dq) from dq (T, H, Dp): the nope dims as they are, the rope dims back
 * through the rotation and the interleave permutation. */
static int query_backward(const kernels_t *k, arena_t *ar, float *dqraw, const float *dq,
                          const mla_cfg_t *c, const int32_t *pos, int T) {
    int H = c->H, Dn = c->nope, Dr = c->rope, Dq = c->qd, Dp = c->pd;
    float *g, *dpe; /* (T, H, Dr) */
    ALLOC(g, ar, (size_t)T * H * Dr);
    ZEROS(dpe, ar, (size_t)T * H * Dr);
    gather_rope(g, dq, T, H, (size_t)H * Dp, (size_t)Dp, Dn, Dr, 0);
    k->rope_backward(dpe, g, pos, c->inv_freq, c->rope_mscale, T, H, Dr, Dr);
    for (size_t th = 0; th < (size_t)T * H; th++)
        memcpy(dqraw + th * Dq, dq + th * Dp, sizeof(float) * (size_t)Dn);
    scatter_rope(dqraw, dpe, T, H, (size_t)H * Dq, (size_t)Dq, Dn, Dr, c->interleave);
    return MO_OK;
}

/* dx += the q path's share from dqraw (T, H Dq). */
static int q_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dqraw,
                      const mla_acts_t *a, const mla_cfg_t *c, const mla_weights_t *w, int T,
                      float *tmp) {
    int D = c->D, Rq = c->q_rank, qo = c->H * c->qd;
    if (Rq == 0) {
        proj_backward(k, dx, dqraw, a->x, a->xa_q, &w->q, w->lora_q, T, D, qo, tmp);
        return MO_OK;
    }
    float *dqa_n, *dqa; /* (T, Rq) */
    ZEROS(dqa_n, ar, (size_t)T * Rq);
    ZEROS(dqa, ar, (size_t)T * Rq);
    proj_backward(k, dqa_n, dqraw, a->qa_n, a->xa_q_b, &w->q_b, w->lora_q_b, T, Rq, qo, tmp);
    k->rmsnorm_backward(dqa, w->d_q_a_norm, dqa_n, a->qa, w->q_a_norm, a->rstd_qa, T, Rq);
    proj_backward(k, dx, dqa, a->x, a->xa_q_a, &w->q_a, w->lora_q_a, T, D, Rq, tmp);
    return MO_OK;
}

/* dx += the key/value path's share from dk, dv (T, H, Dp). */
static int kv_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dk, const float *dv,
                       const mla_acts_t *a, const mla_cfg_t *c, const mla_weights_t *w,
                       const int32_t *pos, int T, float *tmp) {
    int D = c->D, H = c->H, Rkv = c->kv_rank, Dn = c->nope, Dr = c->rope, Dv = c->vd;
    int Dp = c->pd, ca = Rkv + Dr, kvo = H * (Dn + Dv);
    float *dkvb, *gpe, *dpe, *dckv_n, *dckv, *dcomp;
    ALLOC(dkvb, ar, (size_t)T * kvo);
    ZEROS(gpe, ar, (size_t)T * Dr); /* the shared k_pe's gradient, summed over heads */
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            size_t th = (size_t)t * H + h;
            float *d = dkvb + th * (size_t)(Dn + Dv);
            memcpy(d, dk + th * Dp, sizeof(float) * (size_t)Dn);
            memcpy(d + Dn, dv + th * Dp, sizeof(float) * (size_t)Dv);
            for (int j = 0; j < Dr; j++)
                gpe[(size_t)t * Dr + j] += dk[th * Dp + Dn + j];
        }
    ZEROS(dpe, ar, (size_t)T * Dr);
    k->rope_backward(dpe, gpe, pos, c->inv_freq, c->rope_mscale, T, 1, Dr, Dr);
    ZEROS(dckv_n, ar, (size_t)T * Rkv);
    ZEROS(dckv, ar, (size_t)T * Rkv);
    proj_backward(k, dckv_n, dkvb, a->ckv_n, a->xa_kv_b, &w->kv_b, w->lora_kv_b, T, Rkv, kvo, tmp);
    k->rmsnorm_backward(dckv, w->d_kv_a_norm, dckv_n, a->ckv, w->kv_a_norm, a->rstd_kv, T, Rkv);
    ZEROS(dcomp, ar, (size_t)T * ca);
    for (int t = 0; t < T; t++)
        memcpy(dcomp + (size_t)t * ca, dckv + (size_t)t * Rkv, sizeof(float) * (size_t)Rkv);
    scatter_rope(dcomp, dpe, T, 1, (size_t)ca, 0, Rkv, Dr, c->interleave);
    proj_backward(k, dx, dcomp, a->x, a->xa_kv_a, &w->kv_a, w->lora_kv_a, T, D, ca, tmp);
    return MO_OK;
}

int mla_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout, const mla_acts_t *a,
                 const mla_cfg_t *c, const mla_weights_t *w, const int32_t *pos, const int32_t *cu,
                 int B, int T) {
    int H = c->H, Dv = c->vd, Dp = c->pd;
    size_t THp = (size_t)T * H * Dp;
    float *tmp, *dao, *datt, *dq, *dk, *dv, *dqraw;
    ALLOC(tmp, ar, (size_t)T * max_rank(w));
    ZEROS(dao, ar, (size_t)T * H * Dv);
    proj_backward(k, dao, dout, a->ao, a->xa_o, &w->o, w->lora_o, T, H * Dv, c->D, tmp);
    ZEROS(datt, ar, THp);
    for (size_t th = 0; th < (size_t)T * H; th++)
        memcpy(datt + th * Dp, dao + th * Dv, sizeof(float) * (size_t)Dv);
    ZEROS(dq, ar, THp);
    ZEROS(dk, ar, THp);
    ZEROS(dv, ar, THp);
    k->attention_backward(dq, dk, dv, datt, a->q, a->k, a->v, a->att, a->lse, cu, B, H, H, Dp,
                          c->scale, 0);
    TRY(kv_backward(k, ar, dx, dk, dv, a, c, w, pos, T, tmp));
    ZEROS(dqraw, ar, (size_t)T * H * c->qd);
    TRY(query_backward(k, ar, dqraw, dq, c, pos, T));
    return q_backward(k, ar, dx, dqraw, a, c, w, T, tmp);
}
