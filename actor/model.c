/* model: forward and backward of the policy model over a packed batch. */
#include "actor/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "moe/moe_ep.h"

/* What one layer's forward keeps for its backward. Buffers of absent adapters and of
 * the feed-forward kind the layer does not have are NULL. */
typedef struct layer_acts {
    const float *x;                   /* (T, D) layer input */
    float *ln1;                       /* (T, D) rmsnorm(x) */
    float *rstd1;                     /* (T) */
    float *q;                         /* (T, H Dh) q projection, before its norm (Qwen3 only) */
    float *rstd_q;                    /* (T, H) */
    float *k;                         /* (T, Hkv Dh) k projection, before its norm (Qwen3 only) */
    float *rstd_k;                    /* (T, Hkv) */
    float *qr;                        /* (T, H Dh) q after norm and RoPE */
    float *kr;                        /* (T, Hkv Dh) k after norm and RoPE */
    float *v;                         /* (T, Hkv Dh) */
    float *att;                       /* (T, H Dh) attention output */
    float *lse;                       /* (T, H) */
    float *xa_q, *xa_k, *xa_v, *xa_o; /* (T, R) adapter inputs x A^T */
    float *h1;                        /* (T, D) x + attention */
    float *ln2;                       /* (T, D) rmsnorm(h1) */
    float *rstd2;                     /* (T) */
    moe_state_t moe;
    moe_ep_state_t moe_ep; /* the MoE layer under expert parallelism (model_set_comm) */
    mlp_acts_t mlp;
    mla_acts_t mla; /* MLA attention (model_t.mla); the GQA buffers above are then NULL */
} layer_acts_t;

struct model_step {
    int T, B;
    float temperature;
    const lora_adapter_t *adapter; /* bound during the forward */
    int32_t *positions;            /* (T) */
    int32_t *cu;                   /* (B + 1) */
    int32_t *targets;              /* (T) the target, 0 where there is none */
    unsigned char *has_target;     /* (T) */
    float **xs;                    /* (L + 1) residual stream entering each layer, (T, D) */
    layer_acts_t *acts;            /* (L) without recompute */
    int32_t **route;               /* (L) (T, K) experts used by MoE layers */
    float *hf;                     /* (T, D) final rmsnorm output */
    float *rstd_f;                 /* (T) */
    float *lse;                    /* (T) log-sum-exp of the scaled logits */
};

#define ALLOC(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = arena_alloc((ar), sizeof(*(ptr)) * (size_t)(n));                                   \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "model activations");                                  \
    } while (0)

/* 1 when the MoE layers run expert-parallel. */
static int use_ep(const model_t *m) {
    return m->comm && comm_size(m->comm) > 1;
}

static int max_rank(const model_t *m) {
    return m->adapter ? m->adapter->R : 1;
}

static int chunk_rows(const model_t *m) {
    if (m->opts.logits_chunk_rows > 0)
        return m->opts.logits_chunk_rows;
    int r = (1 << 22) / m->V;
    return r > 0 ? r : 1;
}

/* ------------------------------------------------------------------------ */
/* Layer forward.                                                            */

/* out (T, OC) = inp (T, C) W^T (+ its adapter; xa (T, R) allocated when present). */
static int proj_forward(const model_t *m, arena_t *ar, float *out, float **xa, const float *inp,
                        const wview_t *w, const lora_pair_t *p, int T, int C, int OC) {
    m->k->matmul_forward(out, inp, w, NULL, T, C, OC);
    *xa = NULL;
    if (p) {
        ALLOC(*xa, ar, (size_t)T * p->R);
        lora_forward(m->k, out, *xa, inp, p, T, C, OC);
    }
    return MO_OK;
}

/* Per-head RMSNorm (when w) and RoPE of q or k: raw (T, nh, Dh) -> out. */
static void norm_rope(const model_t *m, float *out, float *rstd, const float *raw, const float *w,
                      const model_step_t *st, int nh) {
    const kernels_t *k = m->k;
    int T = st->T;
    if (w)
        k->rmsnorm_forward(out, rstd, raw, w, T * nh, m->Dh, m->eps);
    k->rope_forward(out, w ? out : raw, st->positions, m->inv_freq, m->rope_mscale, T, nh, m->Dh,
                    m->Dh);
}

static int attention_forward(const model_t *m, arena_t *ar, layer_acts_t *a, float *o,
                             const model_layer_t *ly, const model_step_t *st) {
    const kernels_t *k = m->k;
    int T = st->T, D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    ALLOC(a->ln1, ar, (size_t)T * D);
    ALLOC(a->rstd1, ar, T);
    k->rmsnorm_forward(a->ln1, a->rstd1, a->x, ly->attn_norm, T, D, m->eps);
    if (m->mla) /* DeepSeek-V3 / Kimi K2 */
        return mla_forward(k, ar, &a->mla, o, a->ln1, &m->mla_cfg, &ly->mla, st->positions, st->cu,
                           st->B, T);
    ALLOC(a->qr, ar, (size_t)T * qd);
    ALLOC(a->kr, ar, (size_t)T * kvd);
    ALLOC(a->v, ar, (size_t)T * kvd);
    float *q = a->qr, *kk = a->kr;
    if (ly->q_norm) {
        ALLOC(a->q, ar, (size_t)T * qd);
        ALLOC(a->k, ar, (size_t)T * kvd);
        ALLOC(a->rstd_q, ar, (size_t)T * m->H);
        ALLOC(a->rstd_k, ar, (size_t)T * m->Hkv);
        q = a->q;
        kk = a->k;
    }
    TRY(proj_forward(m, ar, q, &a->xa_q, a->ln1, &ly->wq, ly->lora_q, T, D, qd));
    TRY(proj_forward(m, ar, kk, &a->xa_k, a->ln1, &ly->wk, ly->lora_k, T, D, kvd));
    TRY(proj_forward(m, ar, a->v, &a->xa_v, a->ln1, &ly->wv, ly->lora_v, T, D, kvd));
    norm_rope(m, a->qr, a->rstd_q, q, ly->q_norm, st, m->H);
    norm_rope(m, a->kr, a->rstd_k, kk, ly->k_norm, st, m->Hkv);
    ALLOC(a->att, ar, (size_t)T * qd);
    ALLOC(a->lse, ar, (size_t)T * m->H);
    k->attention_forward(a->att, a->lse, a->qr, a->kr, a->v, st->cu, st->B, m->H, m->Hkv, m->Dh,
                         m->attn_scale, ly->window);
    return proj_forward(m, ar, o, &a->xa_o, a->att, &ly->wo, ly->lora_o, T, qd, D);
}

/* x_out (T, D) = layer l applied to a->x. replay: (T, K) experts in replay_dt, or NULL. */
static int layer_forward(const model_t *m, arena_t *ar, layer_acts_t *a, float *x_out, int l,
                         const model_step_t *st, const void *replay, dtype_t replay_dt) {
    const model_layer_t *ly = &m->layers[l];
    int T = st->T, D = m->D;
    size_t TD = (size_t)T * D;
    float *o;
    ALLOC(o, ar, TD);
    TRY(attention_forward(m, ar, a, o, ly, st));
    ALLOC(a->h1, ar, TD);
    for (size_t i = 0; i < TD; i++)
        a->h1[i] = a->x[i] + o[i];
    ALLOC(a->ln2, ar, TD);
    ALLOC(a->rstd2, ar, T);
    m->k->rmsnorm_forward(a->ln2, a->rstd2, a->h1, ly->mlp_norm, T, D, m->eps);
    float *ff = o; /* (T, D) reused for the feed-forward output */
    if (ly->moe) {
        int rc = use_ep(m) ? moe_ep_forward(m->k, ar, m->comm, &a->moe_ep, ff, a->ln2,
                                            &ly->moe_cfg, &ly->moe_w, T, replay, replay_dt)
                           : moe_forward(m->k, ar, &a->moe, ff, a->ln2, &ly->moe_cfg, &ly->moe_w,
                                         T, replay, replay_dt);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
    } else {
        TRY(mlp_acts_alloc(&a->mlp, ar, &ly->dense, T, m->cfg.intermediate_size));
        mlp_forward(m->k, ff, &a->mlp, a->ln2, &ly->dense, T, D, m->cfg.intermediate_size);
    }
    for (size_t i = 0; i < TD; i++)
        x_out[i] = a->h1[i] + ff[i];
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

static int check_batch(const model_t *m, const model_batch_t *b, const float *logp) {
    if (!b || b->T < 0 || b->B < 0 || !b->cu_seqlens ||
        (b->T > 0 && (!b->tokens || !b->positions || !b->targets || !logp)))
        return mo_errorf(MO_EINVAL, "model forward: a batch needs T >= 0, B >= 0, tokens, "
                                    "positions, cu_seqlens, targets and a logp output");
    if (!(b->temperature > 0.0f) || !isfinite(b->temperature))
        return mo_errorf(MO_EINVAL, "model forward: temperature %g must be finite and > 0",
                         (double)b->temperature);
    if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->B] != b->T)
        return mo_errorf(MO_EINVAL,
                         "model forward: cu_seqlens must run from 0 to T = %d, got %d "
                         "to %d",
                         b->T, b->cu_seqlens[0], b->cu_seqlens[b->B]);
    for (int i = 0; i < b->B; i++)
        if (b->cu_seqlens[i + 1] < b->cu_seqlens[i])
            return mo_errorf(MO_EINVAL, "model forward: cu_seqlens decreases at %d (%d > %d)",
                             i + 1, b->cu_seqlens[i], b->cu_seqlens[i + 1]);
    for (int t = 0; t < b->T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= m->V)
            return mo_errorf(MO_EINVAL, "model forward: token %d is id %d, outside [0, %d)", t,
                             b->tokens[t], m->V);
    for (int t = 0; t < b->T; t++) {
        if (b->targets[t] < -1 || b->targets[t] >= m->V)
            return mo_errorf(MO_EINVAL, "model forward: target %d is id %d, outside [-1, %d)", t,
                             b->targets[t], m->V);
        if (b->positions[t] < 0)
            return mo_errorf(MO_EINVAL, "model forward: position %d is %d, expected >= 0", t,
                             b->positions[t]);
    }
    return MO_OK;
}

/* The step's copies of the batch. */
static int step_begin(model_t *m, model_step_t **out, const model_batch_t *b, int for_backward) {
    arena_t *ar = &m->arena;
    model_step_t *st;
    ALLOC(st, ar, 1);
    memset(st, 0, sizeof *st);
    int T = b->T, L = m->L;
    st->T = T;
    st->B = b->B;
    st->temperature = b->temperature;
    st->adapter = m->adapter;
    ALLOC(st->positions, ar, T);
    ALLOC(st->cu, ar, b->B + 1);
    ALLOC(st->targets, ar, T);
    ALLOC(st->has_target, ar, T);
    memcpy(st->positions, b->positions, sizeof(int32_t) * (size_t)T);
    memcpy(st->cu, b->cu_seqlens, sizeof(int32_t) * (size_t)(b->B + 1));
    for (int t = 0; t < T; t++) {
        st->has_target[t] = b->targets[t] >= 0;
        st->targets[t] = b->targets[t] >= 0 ? b->targets[t] : 0;
    }
    int nx = for_backward ? L + 1 : 2;
    ALLOC(st->xs, ar, L + 1);
    for (int i = 0; i < nx; i++)
        ALLOC(st->xs[i], ar, (size_t)T * m->D);
    for (int i = nx; i <= L; i++)
        st->xs[i] = st->xs[i % 2];
    ALLOC(st->route, ar, L);
    for (int l = 0; l < L; l++) {
        st->route[l] = NULL;
        if (m->layers[l].moe)
            ALLOC(st->route[l], ar, (size_t)T * m->K);
    }
    st->acts = NULL;
    if (for_backward && !m->opts.recompute) {
        ALLOC(st->acts, ar, L);
        memset(st->acts, 0, sizeof *st->acts * (size_t)L);
    }
    *out = st;
    return MO_OK;
}

/* Routing bookkeeping after MoE layer l: the step's record, the caller's, the stats. */
static void record_routing(model_t *m, model_step_t *st, const model_batch_t *b, int l,
                           const moe_state_t *ms) {
    int T = st->T, K = m->K, M = m->n_moe, mi = m->layers[l].moe_index;
    memcpy(st->route[l], ms->idx, sizeof(int32_t) * (size_t)T * K);
    if (b->routing)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                b->routing[((size_t)t * M + mi) * K + j] = (uint16_t)ms->idx[(size_t)t * K + j];
    model_moe_stats_t *s = &m->stats[mi];
    memcpy(s->load, ms->load, sizeof(int64_t) * (size_t)m->E);
    s->imbalance = ms->imbalance;
    s->aux_loss = ms->aux_loss;
}

/* The batch's replay slice (T, K) of MoE layer l, in ar. */
static int replay_slice(const model_t *m, arena_t *ar, uint16_t **out, const model_batch_t *b,
                        int l) {
    int T = b->T, K = m->K, M = m->n_moe, mi = m->layers[l].moe_index;
    uint16_t *s;
    ALLOC(s, ar, (size_t)T * K);
    for (int t = 0; t < T; t++)
        memcpy(s + (size_t)t * K, b->replay + ((size_t)t * M + mi) * K, sizeof(uint16_t) * K);
    *out = s;
    return MO_OK;
}

/* A rank without tokens still takes part in every MoE layer's exchanges, in layer order.
 * What the backward needs stays in st->acts (without recompute). */
static int ep_empty_forward(model_t *m, model_step_t *st) {
    for (int l = 0; l < m->L; l++) {
        const model_layer_t *ly = &m->layers[l];
        if (!ly->moe)
            continue;
        int keep = st->acts != NULL;
        layer_acts_t local, *a = keep ? &st->acts[l] : &local;
        float dummy[1] = {0.0f};
        memset(a, 0, sizeof *a);
        int rc = moe_ep_forward(m->k, keep ? &m->arena : &m->scratch, m->comm, &a->moe_ep, dummy,
                                dummy, &ly->moe_cfg, &ly->moe_w, 0, NULL, DT_I32);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
        memcpy(m->stats[ly->moe_index].load, a->moe_ep.loc.load, sizeof(int64_t) * (size_t)m->E);
        m->stats[ly->moe_index].imbalance = a->moe_ep.loc.imbalance;
        m->stats[ly->moe_index].aux_loss = a->moe_ep.loc.aux_loss;
        if (!keep)
            arena_reset(&m->scratch);
    }
    return MO_OK;
}

/* 1 when the balance loss is pooled over the MoE layers (model_opts_t.aux_pool). */
static int aux_pooled(const model_t *m) {
    return m->aux_pool && m->opts.aux_coef > 0.0f && m->n_moe > 0;
}

/* mean (E) = the router probabilities of ms's T tokens averaged over them; each token's
 * sigmoid scores are first normalised to sum 1, as router_aux_loss does. */
static int layer_prob_mean(model_t *m, arena_t *ar, float *mean, const moe_state_t *ms,
                           const router_cfg_t *rc, int T) {
    int E = m->E;
    double *acc;
    ALLOC(acc, ar, E);
    memset(acc, 0, sizeof(double) * (size_t)E);
    for (int t = 0; t < T; t++) {
        const float *p = ms->probs + (size_t)t * E;
        double z = 0.0;
        for (int e = 0; e < E; e++)
            z += p[e];
        z = rc->kind == ROUTER_SIGMOID_GROUPED ? z : 1.0;
        for (int e = 0; e < E; e++)
            acc[e] += p[e] / z;
    }
    for (int e = 0; e < E; e++)
        mean[e] = T > 0 ? (float)(acc[e] / T) : 0.0f;
    return MO_OK;
}

/* The pooled balance loss aux_coef E sum_e F_e P_e (model_opts_t.aux_pool), F_e the
 * slots of e in all M layers over M T K, P_e the mean of the layers' prob_mean: layer
 * i's share aux_coef E sum_e F_e prob_mean_i[e] / M goes to its stats. */
static void aux_pool_forward(model_t *m, int T) {
    int M = m->n_moe, E = m->E;
    double slots = (double)M * T * m->K;
    for (int i = 0; i < M; i++) {
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            int64_t c = 0;
            for (int j = 0; j < M; j++)
                c += m->stats[j].load[e];
            s += (double)c / slots * m->stats[i].prob_mean[e];
        }
        m->stats[i].aux_loss = slots > 0 ? (float)(m->opts.aux_coef * E * s / M) : 0.0f;
    }
}

static int layers_forward(model_t *m, model_step_t *st, const model_batch_t *b) {
    for (int l = 0; l < m->L; l++) {
        int keep = st->acts != NULL;
        arena_t *ar = keep ? &m->arena : &m->scratch;
        layer_acts_t local, *a = keep ? &st->acts[l] : &local;
        memset(a, 0, sizeof *a);
        a->x = st->xs[l];
        uint16_t *replay = NULL;
        if (b->replay && m->layers[l].moe)
            TRY(replay_slice(m, ar, &replay, b, l));
        TRY(layer_forward(m, ar, a, st->xs[l + 1], l, st, replay, DT_U16));
        if (m->layers[l].moe)
            record_routing(m, st, b, l, use_ep(m) ? &a->moe_ep.loc : &a->moe);
        if (m->layers[l].moe && aux_pooled(m))
            TRY(layer_prob_mean(m, ar, m->stats[m->layers[l].moe_index].prob_mean, &a->moe,
                                &m->layers[l].moe_cfg.router, st->T));
        if (!keep)
            arena_reset(&m->scratch);
    }
    return MO_OK;
}

/* Final norm, chunked lm_head and log-probabilities. */
static int head_forward(model_t *m, model_step_t *st, float *logp, float *entropy,
                        int for_backward) {
    arena_t *ar = for_backward ? &m->arena : &m->scratch;
    int T = st->T, D = m->D, V = m->V, rows = chunk_rows(m);
    ALLOC(st->hf, ar, (size_t)T * D);
    ALLOC(st->rstd_f, ar, T);
    ALLOC(st->lse, ar, T);
    m->k->rmsnorm_forward(st->hf, st->rstd_f, st->xs[m->L], m->final_norm, T, D, m->eps);
    float *logits;
    ALLOC(logits, &m->scratch, (size_t)(rows < T ? rows : T) * V);
    for (int r0 = 0; r0 < T; r0 += rows) {
        int n = T - r0 < rows ? T - r0 : rows;
        m->k->matmul_forward(logits, st->hf + (size_t)r0 * D, &m->lm_head, NULL, n, D, V);
        m->k->logprob_forward(logp + r0, entropy ? entropy + r0 : NULL, st->lse + r0, logits,
                              st->targets + r0, n, V, st->temperature);
    }
    for (int t = 0; t < T; t++)
        if (!st->has_target[t])
            logp[t] = 0.0f;
    arena_reset(&m->scratch);
    return MO_OK;
}

void model_batch_next_token(int32_t *positions, int32_t *targets, const int32_t *tokens,
                            const int32_t *cu_seqlens, int B) {
    for (int b = 0; b < B; b++)
        for (int t = cu_seqlens[b]; t < cu_seqlens[b + 1]; t++) {
            positions[t] = t - cu_seqlens[b];
            targets[t] = t + 1 < cu_seqlens[b + 1] ? tokens[t + 1] : -1;
        }
}

int model_forward(model_t *m, const model_batch_t *b, float *logp, float *entropy,
                  int for_backward) {
    m->step = NULL;
    arena_reset(&m->arena);
    arena_reset(&m->scratch);
    TRY(check_batch(m, b, logp));
    model_step_t *st = NULL;
    TRY(step_begin(m, &st, b, for_backward));
    for (int i = 0; i < m->n_moe; i++) {
        memset(m->stats[i].load, 0, sizeof(int64_t) * (size_t)m->E);
        m->stats[i].imbalance = m->stats[i].aux_loss = 0.0f;
    }
    if (b->T == 0) {
        int rc = use_ep(m) ? ep_empty_forward(m, st) : MO_OK;
        arena_reset(&m->scratch);
        m->step = for_backward && rc == MO_OK ? st : NULL;
        return rc;
    }
    m->k->embedding_forward(st->xs[0], b->tokens, &m->embed, b->T, m->D);
    int rc = layers_forward(m, st, b);
    if (rc == MO_OK && aux_pooled(m))
        aux_pool_forward(m, b->T);
    if (rc == MO_OK)
        rc = head_forward(m, st, logp, entropy, for_backward);
    arena_reset(&m->scratch);
    if (rc == MO_OK && for_backward)
        m->step = st;
    return rc;
}

int model_set_aux_pool(model_t *m, int pool) {
    if (pool != 0 && pool != 1)
        return mo_errorf(MO_EINVAL, "model %s: aux_pool %d must be 0 or 1", m->path, pool);
    if (pool && use_ep(m))
        return mo_errorf(MO_EINVAL,
                         "model %s: the pooled balance loss (aux_pool) needs the "
                         "whole batch's routing and does not run expert-parallel",
                         m->path);
    m->aux_pool = pool;
    /* Pooled, the MoE layers keep no loss of their own: aux_pool_forward/backward add it. */
    for (int l = 0; l < m->L; l++)
        m->layers[l].moe_cfg.aux_coef = pool ? 0.0f : m->opts.aux_coef;
    m->step = NULL;
    return MO_OK;
}

float model_aux_loss(const model_t *m) {
    float s = 0.0f;
    for (int i = 0; i < m->n_moe; i++)
        s += m->stats[i].aux_loss;
    return s;
}

void model_embed(const model_t *m, float *x, const int32_t *ids, int T) {
    m->k->embedding_forward(x, ids, &m->embed, T, m->D);
}

void model_logits(const model_t *m, float *logits, float *normed, float *rstd, const float *x,
                  int n) {
    m->k->rmsnorm_forward(normed, rstd, x, m->final_norm, n, m->D, m->eps);
    m->k->matmul_forward(logits, normed, &m->lm_head, NULL, n, m->D, m->V);
}

/* ------------------------------------------------------------------------ */
/* Backward.                                                                 */

static float *zeros(arena_t *ar, size_t n) {
    float *p = arena_calloc(ar, sizeof(float) * n);
    if (!p)
        mo_error_wrap(MO_ENOMEM, "model backward");
    return p;
}

#define ZEROS(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = zeros((ar), (n));                                                                  \
        if (!(ptr))                                                                                \
            return MO_ENOMEM;                                                                      \
    } while (0)

/* dinp (T, C) += from dout (T, OC) through W (when dinp) and its adapter. */
static void proj_backward(const model_t *m, float *dinp, const float *dout, const float *inp,
                          const float *xa, const wview_t *w, const lora_pair_t *p, int T, int C,
                          int OC, float *tmp) {
    if (dinp)
        m->k->matmul_backward(dinp, NULL, NULL, dout, inp, w, T, C, OC);
    if (p)
        lora_backward(m->k, dinp, dout, inp, xa, p, T, C, OC, tmp);
}

/* draw (T, nh, Dh) += from dout through RoPE and (when w) the per-head norm; dw (Dh)
 * += the norm weight's gradient when not NULL. */
static int norm_rope_backward(const model_t *m, arena_t *ar, float *draw, float *dw,
                              const float *dout, const float *raw, const float *rstd,
                              const float *w, const model_step_t *st, int nh) {
    int T = st->T;
    if (!w) {
        m->k->rope_backward(draw, dout, st->positions, m->inv_freq, m->rope_mscale, T, nh, m->Dh,
                            m->Dh);
        return MO_OK;
    }
    float *dn;
    ZEROS(dn, ar, (size_t)T * nh * m->Dh);
    m->k->rope_backward(dn, dout, st->positions, m->inv_freq, m->rope_mscale, T, nh, m->Dh, m->Dh);
    m->k->rmsnorm_backward(draw, dw, dn, raw, w, rstd, T * nh, m->Dh);
    return MO_OK;
}

/* attention_backward for MLA layers. */
static int mla_attention_backward(const model_t *m, arena_t *ar, float *dx, const float *dh,
                                  const layer_acts_t *a, const model_layer_t *ly,
                                  const model_step_t *st, int need_dx) {
    int T = st->T, D = m->D, need_dln1 = need_dx || ly->d_attn_norm;
    float *dln1 = NULL;
    if (need_dln1)
        ZEROS(dln1, ar, (size_t)T * D);
    TRY(mla_backward(m->k, ar, dln1, dh, &a->mla, &m->mla_cfg, &ly->mla, st->positions, st->cu,
                     st->B, T));
    if (need_dln1)
        m->k->rmsnorm_backward(need_dx ? dx : NULL, ly->d_attn_norm, dln1, a->x, ly->attn_norm,
                               a->rstd1, T, D);
    return MO_OK;
}

/* dx (T, D) += from dh (T, D), the gradient at the attention block's output. */
static int attention_backward(const model_t *m, arena_t *ar, float *dx, const float *dh,
                              const layer_acts_t *a, const model_layer_t *ly,
                              const model_step_t *st, int need_dx) {
    if (m->mla)
        return mla_attention_backward(m, ar, dx, dh, a, ly, st, need_dx);
    const kernels_t *k = m->k;
    int T = st->T, D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    float *tmp, *datt, *dqr, *dkr, *dv, *dq, *dk, *dln1 = NULL;
    ALLOC(tmp, ar, (size_t)T * max_rank(m));
    ZEROS(datt, ar, (size_t)T * qd);
    proj_backward(m, datt, dh, a->att, a->xa_o, &ly->wo, ly->lora_o, T, qd, D, tmp);
    ZEROS(dqr, ar, (size_t)T * qd);
    ZEROS(dkr, ar, (size_t)T * kvd);
    ZEROS(dv, ar, (size_t)T * kvd);
    k->attention_backward(dqr, dkr, dv, datt, a->qr, a->kr, a->v, a->att, a->lse, st->cu, st->B,
                          m->H, m->Hkv, m->Dh, m->attn_scale, ly->window);
    ZEROS(dq, ar, (size_t)T * qd);
    ZEROS(dk, ar, (size_t)T * kvd);
    TRY(norm_rope_backward(m, ar, dq, ly->d_q_norm, dqr, a->q, a->rstd_q, ly->q_norm, st, m->H));
    TRY(norm_rope_backward(m, ar, dk, ly->d_k_norm, dkr, a->k, a->rstd_k, ly->k_norm, st, m->Hkv));
    int need_dln1 = need_dx || ly->d_attn_norm;
    if (need_dln1)
        ZEROS(dln1, ar, (size_t)T * D);
    proj_backward(m, dln1, dq, a->ln1, a->xa_q, &ly->wq, ly->lora_q, T, D, qd, tmp);
    proj_backward(m, dln1, dk, a->ln1, a->xa_k, &ly->wk, ly->lora_k, T, D, kvd, tmp);
    proj_backward(m, dln1, dv, a->ln1, a->xa_v, &ly->wv, ly->lora_v, T, D, kvd, tmp);
    if (need_dln1)
        k->rmsnorm_backward(need_dx ? dx : NULL, ly->d_attn_norm, dln1, a->x, ly->attn_norm,
                            a->rstd1, T, D);
    return MO_OK;
}

/* dx (T, D) += the pooled balance loss's gradient through the router of MoE layer ly.
 * router_aux_loss_backward differentiates aux_coef E sum_e c_e / (T K) P_e over this
 * layer's T tokens; with c the slots of all M layers that is M^2 times the pooled loss's
 * term of this layer. */
static int aux_pool_backward(const model_t *m, arena_t *ar, float *dx, const moe_state_t *ms,
                             const model_layer_t *ly, int T) {
    int M = m->n_moe, E = m->E;
    int64_t *c;
    float *dlogits; /* (T, E) */
    ALLOC(c, ar, E);
    ZEROS(dlogits, ar, (size_t)T * E);
    for (int e = 0; e < E; e++) {
        c[e] = 0;
        for (int j = 0; j < M; j++)
            c[e] += m->stats[j].load[e];
    }
    router_aux_loss_backward(&ly->moe_cfg.router, dlogits, 1.0f / ((float)M * (float)M), c,
                             ms->probs, T, m->opts.aux_coef);
    m->k->matmul_backward(dx, ly->moe_w.drouter, NULL, dlogits, ms->x, &ly->moe_w.router, T, m->D,
                          E);
    return MO_OK;
}

/* dx (T, D) = the gradient at layer l's input from dy (T, D) at its output. */
static int layer_backward(const model_t *m, arena_t *ar, float *dx, const float *dy,
                          const layer_acts_t *a, int l, const model_step_t *st, int need_dx) {
    const model_layer_t *ly = &m->layers[l];
    int T = st->T, D = m->D, F = m->cfg.intermediate_size;
    memcpy(dx, dy, sizeof(float) * (size_t)T * D); /* residual: dh1 starts as dy */
    float *dln2;
    ZEROS(dln2, ar, (size_t)T * D);
    if (ly->moe) {
        int rc = use_ep(m) ? moe_ep_backward(m->k, ar, m->comm, dln2, dy, &a->moe_ep, &ly->moe_cfg,
                                             &ly->moe_w)
                           : moe_backward(m->k, ar, dln2, dy, &a->moe, &ly->moe_cfg, &ly->moe_w);
        if (rc >= 0 && aux_pooled(m))
            rc = aux_pool_backward(m, ar, dln2, &a->moe, ly, T);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d backward", l);
    } else {
        float *scratch;
        ALLOC(scratch, ar, mlp_backward_scratch_floats(&ly->dense, T, F));
        mlp_backward(m->k, dln2, dy, a->ln2, &a->mlp, &ly->dense, T, D, F, scratch);
    }
    m->k->rmsnorm_backward(dx, ly->d_mlp_norm, dln2, a->h1, ly->mlp_norm, a->rstd2, T, D);
    /* dx now holds dh1: the attention block's output gradient and the residual's. */
    return attention_backward(m, ar, dx, dx, a, ly, st, need_dx);
}

/* dx (T, D) += the gradient at the final norm's input. */
static int head_backward(model_t *m, float *dx, const float *dlogp, const float *dentropy) {
    model_step_t *st = m->step;
    int T = st->T, D = m->D, V = m->V, rows = chunk_rows(m);
    float *dl, *dhf, *logits, *dlogits;
    ALLOC(dl, &m->arena, T);
    for (int t = 0; t < T; t++)
        dl[t] = st->has_target[t] ? dlogp[t] : 0.0f;
    ZEROS(dhf, &m->arena, (size_t)T * D);
    size_t cap = (size_t)(rows < T ? rows : T) * V;
    ALLOC(logits, &m->scratch, cap);
    ALLOC(dlogits, &m->scratch, cap);
    for (int r0 = 0; r0 < T; r0 += rows) {
        int n = T - r0 < rows ? T - r0 : rows;
        const float *hf = st->hf + (size_t)r0 * D;
        m->k->matmul_forward(logits, hf, &m->lm_head, NULL, n, D, V);
        memset(dlogits, 0, sizeof(float) * (size_t)n * V);
        m->k->logprob_backward(dlogits, dl + r0, dentropy ? dentropy + r0 : NULL, logits,
                               st->lse + r0, st->targets + r0, n, V, st->temperature);
        m->k->matmul_backward(dhf + (size_t)r0 * D, NULL, NULL, dlogits, hf, &m->lm_head, n, D, V);
    }
    arena_reset(&m->scratch);
    m->k->rmsnorm_backward(dx, m->d_final_norm, dhf, st->xs[m->L], m->final_norm, st->rstd_f, T, D);
    return MO_OK;
}

/* The backward of ep_empty_forward: every MoE layer's exchanges in reverse layer order
 * (recomputing the forward's first under recompute, as layer_backward's caller does). */
static int ep_empty_backward(model_t *m, const model_step_t *st) {
    for (int l = m->L - 1; l >= 0; l--) {
        const model_layer_t *ly = &m->layers[l];
        if (!ly->moe)
            continue;
        float dummy[1] = {0.0f}, dx[1] = {0.0f};
        moe_ep_state_t local;
        const moe_ep_state_t *s = st->acts ? &st->acts[l].moe_ep : &local;
        int rc = MO_OK;
        if (!st->acts)
            rc = moe_ep_forward(m->k, &m->scratch, m->comm, &local, dummy, dummy, &ly->moe_cfg,
                                &ly->moe_w, 0, NULL, DT_I32);
        if (rc == MO_OK)
            rc = moe_ep_backward(m->k, &m->scratch, m->comm, dx, dummy, s, &ly->moe_cfg,
                                 &ly->moe_w);
        arena_reset(&m->scratch);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d backward", l);
    }
    return MO_OK;
}

int model_backward(model_t *m, const float *dlogp, const float *dentropy) {
    model_step_t *st = m->step;
    if (!st || st->adapter != m->adapter)
        return mo_errorf(MO_ESTATE, "model backward: no forward with for_backward = 1 since the "
                                    "last forward or adapter change");
    if (!dlogp)
        return mo_errorf(MO_EINVAL, "model backward: dlogp is required");
    int T = st->T;
    if (T == 0)
        return use_ep(m) ? ep_empty_backward(m, st) : MO_OK;
    float *dxa, *dxb;
    ZEROS(dxa, &m->arena, (size_t)T * m->D);
    ALLOC(dxb, &m->arena, (size_t)T * m->D);
    TRY(head_backward(m, dxa, dlogp, dentropy));
    for (int l = m->L - 1; l >= 0; l--) {
        layer_acts_t local, *a = &local;
        if (st->acts) {
            a = &st->acts[l];
        } else {
            float *x_out;
            memset(&local, 0, sizeof local);
            local.x = st->xs[l];
            ALLOC(x_out, &m->scratch, (size_t)T * m->D);
            TRY(layer_forward(m, &m->scratch, &local, x_out, l, st, st->route[l], DT_I32));
        }
        TRY(layer_backward(m, &m->scratch, dxb, dxa, a, l, st, l > 0));
        float *t = dxa;
        dxa = dxb;
        dxb = t;
        arena_reset(&m->scratch);
    }
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Expert parallelism.                                                       */

/* Frees the fp8 scale of a dropped view and forgets it in m->scales. */
static void drop_view(model_t *m, wview_t *v) {
    if (v->scale)
        for (int i = 0; i < m->n_scales; i++)
            if (m->scales[i] == v->scale) {
                free(m->scales[i]);
                m->scales[i] = m->scales[--m->n_scales];
                break;
            }
    memset(v, 0, sizeof *v);
}

int model_set_comm(model_t *m, comm_t *cm) {
    if (!cm || comm_size(cm) == 1 || cm == m->comm)
        return MO_OK;
    if (use_ep(m))
        return mo_errorf(MO_ESTATE, "model %s: already expert-parallel over %d ranks", m->path,
                         comm_size(m->comm));
    if (aux_pooled(m))
        return mo_errorf(MO_EINVAL,
                         "model %s: the pooled balance loss (aux_pool) needs the "
                         "whole batch's routing and does not run expert-parallel",
                         m->path);
    int N = comm_size(cm), r = comm_rank(cm), e0 = 0, n = m->E;
    if (m->n_moe > 0) {
        int rc = moe_ep_check(m->E, N);
        if (rc < 0)
            return mo_error_wrap(rc, "model %s", m->path);
        moe_ep_experts(m->E, N, r, &e0, &n);
        for (int l = 0; l < m->L; l++) {
            if (!m->layers[l].moe)
                continue;
            wview_t *ex = m->layers[l].experts; /* (3, E) */
            for (int p = 0; p < 3; p++)
                for (int e = 0; e < m->E; e++)
                    if (e < e0 || e >= e0 + n)
                        drop_view(m, &ex[(size_t)p * m->E + e]);
        }
    }
    m->comm = cm;
    m->ep_e0 = e0;
    m->ep_n = n;
    m->step = NULL;
    return MO_OK;
}

int model_set_device_comm(model_t *m, comm_t *cm) {
    if (!cm) {
        m->device_comm = NULL;
        return MO_OK;
    }
    if (!use_ep(m))
        return mo_errorf(MO_ESTATE,
                         "model %s: a device communicator needs expert parallelism first "
                         "(model_set_comm with more than one rank)",
                         m->path);
    if (comm_size(cm) != comm_size(m->comm) || comm_rank(cm) != comm_rank(m->comm))
        return mo_errorf(MO_EINVAL,
                         "model %s: the device communicator is rank %d of %d ('%s'), the "
                         "expert-parallel one rank %d of %d ('%s'): they must agree",
                         m->path, comm_rank(cm), comm_size(cm), comm_backend_name(cm),
                         comm_rank(m->comm), comm_size(m->comm), comm_backend_name(m->comm));
    m->device_comm = cm;
    return MO_OK;
}

size_t model_expert_weight_bytes(const model_t *m) {
    size_t b = 0;
    int e0 = m->ep_n > 0 ? m->ep_e0 : 0, n = m->ep_n > 0 ? m->ep_n : m->E;
    for (int l = 0; l < m->L; l++)
        if (m->layers[l].moe)
            b += moe_ep_expert_weight_bytes(&m->layers[l].moe_cfg, &m->layers[l].moe_w, e0, n);
    return b;
}
