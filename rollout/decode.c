/* decode: incremental forward of new tokens with a KV cache, and merged adapters. */
#include "rollout/decode.h"

#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"
#include "rollout/amx_matmul.h"
#include "rollout/attn_decode.h"

#define ALLOC(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = arena_alloc((ar), sizeof(*(ptr)) * (size_t)(n));                                   \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "decode activations");                                 \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Weights.                                                                  */

static void bind_layer(rl_layer_t *r, const model_layer_t *ly) {
    free(r->absorbed); /* built again from the weights now bound */
    r->absorbed = NULL;
    r->ly = ly;
    r->wq = ly->wq;
    r->wk = ly->wk;
    r->wv = ly->wv;
    r->wo = ly->wo;
    r->lq = ly->lora_q;
    r->lk = ly->lora_k;
    r->lv = ly->lora_v;
    r->lo = ly->lora_o;
    r->mla = ly->mla;
    r->moe_cfg = ly->moe_cfg;
    r->moe_cfg.aux_coef = 0.0f; /* generation needs no balance loss */
    r->moe_w = ly->moe_w;
    r->dense = ly->dense;
}

/* Merged-mode layer: the model's views in the engine's own tables, no adapters. */
static void base_layer(rl_layer_t *r, const model_layer_t *ly, int E) {
    bind_layer(r, ly);
    r->lq = r->lk = r->lv = r->lo = NULL;
    r->mla.lora_q_a = r->mla.lora_q_b = r->mla.lora_q = NULL;
    r->mla.lora_kv_a = r->mla.lora_kv_b = r->mla.lora_o = NULL;
    r->dense.lora_gate = r->dense.lora_up = r->dense.lora_down = NULL;
    r->moe_w.lora_gate = r->moe_w.lora_up = r->moe_w.lora_down = NULL;
    r->moe_w.shared.lora_gate = r->moe_w.shared.lora_up = r->moe_w.shared.lora_down = NULL;
    if (ly->moe) {
        memcpy(r->experts, ly->experts, sizeof(wview_t) * 3 * (size_t)E);
        r->moe_w.gate = r->experts;
        r->moe_w.up = r->experts + E;
        r->moe_w.down = r->experts + 2 * (size_t)E;
    }
}

int rl_weights_init(rl_weights_t *w, const model_t *m) {
    memset(w, 0, sizeof *w);
    w->k = *m->k;
    if (m->k->matmul_forward == cpu_matmul_forward && amx_matmul_available())
        w->k.matmul_forward = amx_matmul_forward;
    w->L = m->L;
    w->layers = calloc((size_t)m->L, sizeof *w->layers);
    if (!w->layers)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for %d layers", m->L);
    rl_weights_bind(w, m);
    return MO_OK;
}

void rl_weights_model(const rl_weights_t *w, const model_t *m, model_t *out) {
    *out = *m;
    out->k = &w->k;
}

void rl_weights_bind(rl_weights_t *w, const model_t *m) {
    MO_ASSERT(!w->merged);
    for (int l = 0; l < m->L; l++)
        bind_layer(&w->layers[l], &m->layers[l]);
}

void rl_weights_free(rl_weights_t *w) {
    if (w->layers)
        for (int l = 0; l < w->L; l++) {
            free(w->layers[l].experts);
            free(w->layers[l].absorbed);
        }
    for (int i = 0; w->copies && i < w->n_modules; i++)
        free(w->copies[i]);
    free(w->copies);
    free(w->targets);
    free(w->layers);
    memset(w, 0, sizeof *w);
}

/* Where module i's weight sits in the engine's layers, in the model's module order:
 * per layer q, k, v, o; then each routed expert's gate, up, down; the shared experts';
 * or the dense MLP's. */
static int merged_tables(rl_weights_t *w, const model_t *m) {
    int n = m->n_modules, E = m->E;
    free(w->copies); /* left by an earlier attempt that ran out of memory */
    free(w->targets);
    w->copies = calloc((size_t)n, sizeof *w->copies);
    w->n_modules = n;
    w->targets = calloc((size_t)n, sizeof *w->targets);
    if (!w->copies || !w->targets)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for merged weights");
    int i = 0;
    for (int l = 0; l < m->L; l++) {
        rl_layer_t *r = &w->layers[l];
        const model_layer_t *ly = &m->layers[l];
        if (ly->moe && !r->experts) {
            r->experts = malloc(sizeof(wview_t) * 3 * (size_t)E);
            if (!r->experts)
                return mo_errorf(MO_ENOMEM, "rollout: out of memory for merged weights");
        }
        base_layer(r, ly, E);
        if (m->mla) { /* q_a, q_b or q, kv_a, kv_b, o (the model's module order) */
            if (m->mla_cfg.q_rank > 0) {
                w->targets[i++] = &r->mla.q_a;
                w->targets[i++] = &r->mla.q_b;
            } else {
                w->targets[i++] = &r->mla.q;
            }
            w->targets[i++] = &r->mla.kv_a;
            w->targets[i++] = &r->mla.kv_b;
            w->targets[i++] = &r->mla.o;
        } else {
            wview_t *attn[4] = {&r->wq, &r->wk, &r->wv, &r->wo};
            for (int p = 0; p < 4; p++)
                w->targets[i++] = attn[p];
        }
        if (!ly->moe) {
            w->targets[i++] = &r->dense.gate;
            w->targets[i++] = &r->dense.up;
            w->targets[i++] = &r->dense.down;
            continue;
        }
        for (int e = 0; e < E; e++)
            for (int p = 0; p < 3; p++)
                w->targets[i++] = &r->experts[(size_t)p * E + e];
        if (ly->moe_cfg.n_shared > 0) {
            w->targets[i++] = &r->moe_w.shared.gate;
            w->targets[i++] = &r->moe_w.shared.up;
            w->targets[i++] = &r->moe_w.shared.down;
        }
    }
    MO_ASSERT(i == n);
    w->n_modules = n;
    w->merged = 1;
    return MO_OK;
}

/* Module i's weight: copy of the base (from the model's view) with pair p merged in. */
static int merge_module(rl_weights_t *w, const model_t *m, int i, const wview_t *base,
                        const lora_pair_t *p) {
    const lora_module_desc_t *d = &m->modules[i];
    dtype_t dt = base->dtype;
    if (base->scale || (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16))
        return mo_errorf(MO_EUNSUPPORTED,
                         "rollout: cannot merge an adapter into %s weight \"%s\" (F32, BF16 or "
                         "F16 without block scales); run the adapter unmerged",
                         dtype_name(dt), d->name);
    size_t bytes = (size_t)d->OC * (size_t)d->C * dtype_size(dt);
    if (!w->copies[i] && !(w->copies[i] = malloc(bytes)))
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for a merged copy of \"%s\"", d->name);
    memcpy(w->copies[i], base->data, bytes);
    TRY(lora_merge(m->k, w->copies[i], dt, p, d->C, d->OC));
    *w->targets[i] = wview_of(w->copies[i], dt);
    return MO_OK;
}

int rl_weights_merge(rl_weights_t *w, const model_t *m, const lora_adapter_t *ad) {
    if (!w->merged)
        TRY(merged_tables(w, m));
    /* Back to the base everywhere, then fold the adapter in module by module. */
    for (int l = 0; l < m->L; l++)
        base_layer(&w->layers[l], &m->layers[l], m->E);
    if (!ad)
        return MO_OK;
    if (ad->n_full > 0)
        return mo_errorf(MO_EUNSUPPORTED,
                         "rollout: the adapter trains router or norm weights in full (\"%s\"); "
                         "they are applied unmerged only: run the adapter unmerged",
                         ad->tensors[ad->n_tensors - ad->n_full].name);
    int matched = 0;
    for (int i = 0; i < m->n_modules; i++) {
        const lora_module_desc_t *d = &m->modules[i];
        int e = lora_adapter_find(ad, d->name);
        if (e < 0)
            continue;
        const lora_entry_t *en = &ad->entries[e];
        if (en->C != d->C || en->OC != d->OC)
            return mo_errorf(MO_EINVAL,
                             "adapter module \"%s\" is (out %d, in %d), the model's projection "
                             "is (out %d, in %d)",
                             d->name, en->OC, en->C, d->OC, d->C);
        wview_t base = *w->targets[i];
        lora_pair_t p = lora_adapter_pair(ad, e, 0);
        int rc = merge_module(w, m, i, &base, &p);
        if (rc < 0) {
            for (int l = 0; l < m->L; l++)
                base_layer(&w->layers[l], &m->layers[l], m->E);
            return rc;
        }
        matched++;
    }
    if (matched != ad->n_entries) {
        for (int l = 0; l < m->L; l++)
            base_layer(&w->layers[l], &m->layers[l], m->E);
        return mo_errorf(MO_EINVAL,
                         "adapter: %d of its %d modules are not projections of this "
                         "model",
                         ad->n_entries - matched, ad->n_entries);
    }
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

/* out (N, OC) = inp (N, C) W^T (+ the adapter). */
static int proj(const model_t *m, arena_t *ar, float *out, const float *inp, const wview_t *w,
                const lora_pair_t *p, int N, int C, int OC) {
    m->k->matmul_forward(out, inp, w, NULL, N, C, OC);
    if (p) {
        float *xa; /* (N, R) */
        ALLOC(xa, ar, (size_t)N * p->R);
        lora_forward(m->k, out, xa, inp, p, N, C, OC);
    }
    return MO_OK;
}

/* Per-head norm (when nw) and RoPE: raw (N, nh, Dh) -> out. */
static int norm_rope(const model_t *m, arena_t *ar, float *out, const float *raw, const float *nw,
                     const int32_t *pos, int N, int nh) {
    if (nw) {
        float *rstd;
        ALLOC(rstd, ar, (size_t)N * nh);
        m->k->rmsnorm_forward(out, rstd, raw, nw, N * nh, m->Dh, m->eps);
    }
    m->k->rope_forward(out, nw ? out : raw, pos, m->inv_freq, m->rope_mscale, N, nh, m->Dh, m->Dh);
    return MO_OK;
}

int decode_kv_cache_init(kv_cache_t *c, const model_t *m, int64_t budget_tokens, int block_tokens) {
    if (m->mla)
        return kv_cache_init_latent(c, m->L, m->mla_cfg.kv_rank + m->mla_cfg.rope, budget_tokens,
                                    block_tokens);
    return kv_cache_init(c, m->L, m->Hkv, m->Dh, budget_tokens, block_tokens);
}

/* Row i's latent [c_kv (Rkv) | rope(k_pe) (Dr)] into the cache, from mla_forward's acts. */
static void write_latent(kv_cache_t *c, const mla_cfg_t *mc, const mla_acts_t *a,
                         const decode_batch_t *b, int l, float *row) {
    int Rkv = mc->kv_rank, Dr = mc->rope;
    size_t hp = (size_t)mc->H * mc->pd;
    for (int i = 0; i < b->N; i++) {
        memcpy(row, a->ckv_n + (size_t)i * Rkv, sizeof(float) * (size_t)Rkv);
        memcpy(row + Rkv, a->k + i * hp + mc->nope, sizeof(float) * (size_t)Dr); /* head 0 */
        kv_write(c, b->seqs[i], l, b->pos[i], row, NULL);
    }
}

/* r->absorbed (Rkv, H (Dn + Dv)) = the effective kv_b_proj weight transposed, W + scale
 * B A with an unmerged adapter on kv_b_proj (the merged weight in merged mode): the
 * identity through the projection, so every weight dtype and the adapter go the way
 * proj does. Built once per binding. */
static int absorbed_weight(const model_t *m, arena_t *ar, rl_layer_t *r) {
    if (r->absorbed)
        return MO_OK;
    const mla_cfg_t *mc = &m->mla_cfg;
    int Rkv = mc->kv_rank, kvo = mc->H * (mc->nope + mc->vd);
    float *eye, *wt; /* (Rkv, Rkv), (Rkv, kvo) */
    ALLOC(eye, ar, (size_t)Rkv * Rkv);
    memset(eye, 0, sizeof(float) * (size_t)Rkv * Rkv);
    for (int i = 0; i < Rkv; i++)
        eye[(size_t)i * Rkv + i] = 1.0f;
    wt = malloc(sizeof(float) * (size_t)Rkv * (size_t)kvo);
    if (!wt)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for an absorbed kv_b_proj (%d x %d)",
                         Rkv, kvo);
    int rc = proj(m, ar, wt, eye, &r->mla.kv_b, r->mla.lora_kv_b, Rkv, Rkv, kvo);
    if (rc < 0) {
        free(wt);
        return rc;
    }
    r->absorbed = wt;
    return MO_OK;
}

/* ql (N, H, Rkv + Dr) = [q_nope W_UK | rope(q_pe)] from q (N, H, Dp), the absorbed
 * queries that score directly against the cached latent rows. */
static void absorb_queries(float *ql, const float *q, const float *wt, const mla_cfg_t *mc, int N) {
    int H = mc->H, Rkv = mc->kv_rank, Dn = mc->nope, Dr = mc->rope, Dp = mc->pd;
    size_t W = (size_t)Rkv + (size_t)Dr, ld = (size_t)H * (size_t)(Dn + mc->vd);
    for (int i = 0; i < N; i++)
        for (int h = 0; h < H; h++) {
            const float *qh = q + ((size_t)i * H + h) * Dp;
            float *d = ql + ((size_t)i * H + h) * W;
            const float *wk = wt + (size_t)h * (Dn + mc->vd); /* W_UK_h^T column block */
            for (int cc = 0; cc < Rkv; cc++) {
                const float *wr = wk + (size_t)cc * ld;
                float acc = 0.0f;
                for (int j = 0; j < Dn; j++)
                    acc += qh[j] * wr[j];
                d[cc] = acc;
            }
            memcpy(d + Rkv, qh + Dn, sizeof(float) * (size_t)Dr);
        }
}

/* ao (N, H Dv) = ctx W_UV^T per head from the attended latents ctx (N, H, Rkv). */
static void expand_values(float *ao, const float *ctx, const float *wt, const mla_cfg_t *mc,
                          int N) {
    int H = mc->H, Rkv = mc->kv_rank, Dn = mc->nope, Dv = mc->vd;
    size_t ld = (size_t)H * (size_t)(Dn + Dv);
    for (int i = 0; i < N; i++)
        for (int h = 0; h < H; h++) {
            const float *ch = ctx + ((size_t)i * H + h) * Rkv;
            float *d = ao + (size_t)i * H * Dv + (size_t)h * Dv;
            const float *wv = wt + (size_t)h * (Dn + Dv) + Dn;
            memset(d, 0, sizeof(float) * (size_t)Dv);
            for (int cc = 0; cc < Rkv; cc++) {
                const float *wr = wv + (size_t)cc * ld;
                for (int v = 0; v < Dv; v++)
                    d[v] += ch[cc] * wr[v];
            }
        }
}

/* MLA: o (N, D) from the normed rows ln. mla_forward gives the queries and the latent at
 * the rows' positions (and, for a prefill, the output itself: the expanded form over the
 * whole sequences); the latent goes into the cache. A decode takes each row as a
 * sequence of its own in mla_forward, then attends over the cached latents with the
 * up-projections absorbed: q_nope W_UK scores against c_kv, the attended latent times
 * W_UV is the head's output, then o_proj. */
static int mla_attention(const model_t *m, arena_t *ar, float *o, const float *ln, rl_layer_t *r,
                         int l, kv_cache_t *c, const decode_batch_t *b) {
    const mla_cfg_t *mc = &m->mla_cfg;
    int N = b->N, H = mc->H, Rkv = mc->kv_rank, Dv = mc->vd, B = b->B;
    size_t W = (size_t)Rkv + (size_t)mc->rope;
    const int32_t *cu = b->cu;
    if (!b->prefill) {
        int32_t *each;
        ALLOC(each, ar, N + 1);
        for (int i = 0; i <= N; i++)
            each[i] = i;
        cu = each;
        B = N;
    }
    mla_acts_t a;
    float *row; /* (Rkv + Dr) */
    TRY(mla_forward(m->k, ar, &a, o, ln, mc, &r->mla, b->pos, cu, B, N));
    ALLOC(row, ar, W);
    write_latent(c, mc, &a, b, l, row);
    if (b->prefill)
        return MO_OK;
    float *ql, *ctx, *ao;
    TRY(absorbed_weight(m, ar, r));
    const float *wt = r->absorbed;
    ALLOC(ql, ar, (size_t)N * H * W);
    absorb_queries(ql, a.q, wt, mc, N);
    ALLOC(ctx, ar, (size_t)N * H * Rkv);
    attn_decode_latent(ctx, ql, c, l, (const kv_seq_t *const *)b->seqs, b->pos, N, H, Rkv,
                       mc->scale);
    ALLOC(ao, ar, (size_t)N * H * Dv);
    expand_values(ao, ctx, wt, mc, N);
    return proj(m, ar, o, ao, &r->mla.o, r->mla.lora_o, N, H * Dv, m->D);
}

/* o (N, D) = the attention block's output for rows x; k and v go into the cache. */
static int attention(const model_t *m, arena_t *ar, float *o, const float *x, rl_layer_t *r, int l,
                     kv_cache_t *c, const decode_batch_t *b) {
    const kernels_t *k = m->k;
    int N = b->N, D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    float *ln, *rstd, *q, *kk, *v, *qr, *kr, *att;
    ALLOC(ln, ar, (size_t)N * D);
    ALLOC(rstd, ar, N);
    k->rmsnorm_forward(ln, rstd, x, r->ly->attn_norm, N, D, m->eps);
    if (m->mla)
        return mla_attention(m, ar, o, ln, r, l, c, b);
    ALLOC(q, ar, (size_t)N * qd);
    ALLOC(kk, ar, (size_t)N * kvd);
    ALLOC(v, ar, (size_t)N * kvd);
    TRY(proj(m, ar, q, ln, &r->wq, r->lq, N, D, qd));
    TRY(proj(m, ar, kk, ln, &r->wk, r->lk, N, D, kvd));
    TRY(proj(m, ar, v, ln, &r->wv, r->lv, N, D, kvd));
    ALLOC(qr, ar, (size_t)N * qd);
    ALLOC(kr, ar, (size_t)N * kvd);
    TRY(norm_rope(m, ar, qr, q, r->ly->q_norm, b->pos, N, m->H));
    TRY(norm_rope(m, ar, kr, kk, r->ly->k_norm, b->pos, N, m->Hkv));
    for (int i = 0; i < N; i++)
        kv_write(c, b->seqs[i], l, b->pos[i], kr + (size_t)i * kvd, v + (size_t)i * kvd);
    ALLOC(att, ar, (size_t)N * qd);
    if (b->prefill) {
        float *lse;
        ALLOC(lse, ar, (size_t)N * m->H);
        k->attention_forward(att, lse, qr, kr, v, b->cu, b->B, m->H, m->Hkv, m->Dh, m->attn_scale,
                             r->ly->window);
    } else {
        attn_decode_forward(att, qr, c, l, (const kv_seq_t *const *)b->seqs, b->pos, N, m->H,
                            m->attn_scale, r->ly->window);
    }
    return proj(m, ar, o, att, &r->wo, r->lo, N, qd, D);
}

/* Copies MoE layer mi's experts idx (N, K) into the routing record (N, M, K). */
static void record(uint16_t *routing, const int32_t *idx, int N, int M, int K, int mi) {
    for (int i = 0; i < N; i++)
        for (int j = 0; j < K; j++)
            routing[((size_t)i * M + mi) * K + j] = (uint16_t)idx[(size_t)i * K + j];
}

static int layer(const model_t *m, arena_t *ar, float *x, rl_layer_t *r, int l, kv_cache_t *c,
                 const decode_batch_t *b) {
    int N = b->N, D = m->D;
    size_t ND = (size_t)N * D;
    float *o, *ln, *rstd;
    ALLOC(o, ar, ND);
    TRY(attention(m, ar, o, x, r, l, c, b));
    for (size_t i = 0; i < ND; i++)
        x[i] += o[i]; /* h = x + attention */
    ALLOC(ln, ar, ND);
    ALLOC(rstd, ar, N);
    m->k->rmsnorm_forward(ln, rstd, x, r->ly->mlp_norm, N, D, m->eps);
    float *ff = o;
    if (r->ly->moe) {
        moe_state_t st;
        int rc = moe_forward(m->k, ar, &st, ff, ln, &r->moe_cfg, &r->moe_w, N, NULL, DT_U16);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
        if (b->routing)
            record(b->routing, st.idx, N, m->n_moe, m->K, r->ly->moe_index);
    } else {
        mlp_acts_t acts;
        int F = m->cfg.intermediate_size;
        TRY(mlp_acts_alloc(&acts, ar, &r->dense, N, F));
        mlp_forward(m->k, ff, &acts, ln, &r->dense, N, D, F);
    }
    for (size_t i = 0; i < ND; i++)
        x[i] += ff[i];
    return MO_OK;
}

int decode_forward(const model_t *m0, const rl_weights_t *w, kv_cache_t *c, arena_t *ar,
                   const decode_batch_t *b, float *x) {
    if (b->N == 0)
        return MO_OK;
    model_t mk; /* the model on the engine's kernels */
    rl_weights_model(w, m0, &mk);
    const model_t *m = &mk;
    for (int i = 0; i < b->N; i++)
        MO_ASSERT(b->tokens[i] >= 0 && b->tokens[i] < m->V && b->pos[i] < b->seqs[i]->len);
    m->k->embedding_forward(x, b->tokens, &m->embed, b->N, m->D);
    for (int l = 0; l < m->L; l++) {
        arena_reset(ar);
        TRY(layer(m, ar, x, &w->layers[l], l, c, b));
    }
    arena_reset(ar);
    return MO_OK;
}
