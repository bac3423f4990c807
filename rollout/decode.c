/* decode: incremental forward of new tokens with a KV cache, and merged adapters. */
#include "rollout/decode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"
#include "moe/router.h"
#include "rollout/amx_matmul.h"
#include "rollout/lora_rows.h"
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
    r->attn_norm = ly->attn_norm;
    r->q_norm = ly->q_norm;
    r->k_norm = ly->k_norm;
    r->mlp_norm = ly->mlp_norm;
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

/* The packed copies: a weight packs when it is bf16 without block scales, present (not
 * dropped by expert parallelism) and its input width a multiple of 32. */
static int packs(const wview_t *v, int C) {
    return v->data && v->dtype == DT_BF16 && !v->scale && C % 32 == 0;
}

/* Weights v (n, each (OC[i], C)) packed back to back into p at buf + at (buf NULL: only
 * counted); returns at plus the elements they take, or at when one of them does not
 * pack (p->w stays NULL). */
static size_t pack_set(rl_pack_t *p, uint16_t *buf, size_t at, const wview_t *const *v,
                       const int *OC, int n, int C) {
    memset(p, 0, sizeof *p);
    size_t need = 0;
    for (int i = 0; i < n; i++) {
        if (!packs(v[i], C))
            return at;
        need += amx_packed_elems(OC[i], C);
    }
    if (buf) {
        size_t o = at;
        for (int i = 0; i < n; i++) {
            amx_pack_bf16(buf + o, (const uint16_t *)v[i]->data, OC[i], C);
            p->src[i] = v[i]->data;
            o += amx_packed_elems(OC[i], C);
        }
        p->w = buf + at;
    }
    return at + need;
}

/* An MLP's gate and up (one product, amx_pack_bf16_glu) and down. */
static size_t pack_mlp(rl_pack_t *gu, rl_pack_t *dn, uint16_t *buf, size_t at,
                       const mlp_weights_t *mw, int D, int F) {
    const wview_t *d1[1] = {&mw->down};
    int oc1[1] = {D};
    memset(gu, 0, sizeof *gu);
    if (packs(&mw->gate, D) && packs(&mw->up, D)) {
        if (buf) {
            amx_pack_bf16_glu(buf + at, (const uint16_t *)mw->gate.data,
                              (const uint16_t *)mw->up.data, F, D);
            gu->w = buf + at;
            gu->src[0] = mw->gate.data;
            gu->src[1] = mw->up.data;
        }
        at += 2 * amx_packed_elems(F, D);
    }
    return pack_set(dn, buf, at, d1, oc1, 1, F);
}

/* Layer r's packed copies from its views into buf (NULL: counts the elements). */
static size_t pack_layer(rl_layer_t *r, const model_t *m, uint16_t *buf) {
    int D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    size_t at = 0;
    if (!m->mla) {
        const wview_t *qkv[3] = {&r->wq, &r->wk, &r->wv}, *o[1] = {&r->wo};
        int oc3[3] = {qd, kvd, kvd}, oc1[1] = {D};
        at = pack_set(&r->qkv, buf, at, qkv, oc3, 3, D);
        at = pack_set(&r->o, buf, at, o, oc1, 1, qd);
    }
    if (!r->ly->moe)
        return pack_mlp(&r->mlp_gu, &r->mlp_down, buf, at, &r->dense, D, m->cfg.intermediate_size);
    const wview_t *rv[1] = {&r->moe_w.router};
    int E = r->moe_cfg.router.E, F = r->moe_cfg.F;
    at = pack_set(&r->router, buf, at, rv, &E, 1, D);
    for (int e = 0; e < E; e++) {
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        at = pack_mlp(&r->exp_gu[e], &r->exp_down[e], buf, at, &mw, D, F);
    }
    if (r->moe_cfg.n_shared > 0)
        at = pack_mlp(&r->mlp_gu, &r->mlp_down, buf, at, &r->moe_w.shared, D,
                      r->moe_cfg.n_shared * F);
    return at;
}

/* Every layer's packed copies, made again from the views as they are now. */
static int pack_all(rl_weights_t *w, const model_t *m) {
    for (int l = 0; l < m->L; l++) {
        rl_layer_t *r = &w->layers[l];
        if (r->ly->moe && !r->exp_gu) {
            r->exp_gu = calloc(2 * (size_t)m->E, sizeof *r->exp_gu);
            if (!r->exp_gu)
                return mo_errorf(MO_ENOMEM, "rollout: out of memory for packed weights");
            r->exp_down = r->exp_gu + m->E;
        }
        size_t n = pack_layer(r, m, NULL);
        free(r->pbuf);
        r->pbuf = n ? malloc(sizeof(uint16_t) * n) : NULL;
        if (n && !r->pbuf) {
            pack_layer(r, m, NULL); /* nothing packed */
            return mo_errorf(MO_ENOMEM,
                             "rollout: out of memory for the packed weights of layer %d (%zu "
                             "MiB)",
                             l, sizeof(uint16_t) * n >> 20);
        }
        pack_layer(r, m, r->pbuf);
    }
    return MO_OK;
}

int rl_weights_init(rl_weights_t *w, const model_t *m, int pack) {
    memset(w, 0, sizeof *w);
    w->k = *m->k;
    if (m->k->matmul_forward == cpu_matmul_forward && amx_matmul_available())
        w->k.matmul_forward = amx_matmul_forward;
    w->L = m->L;
    w->layers = calloc((size_t)m->L, sizeof *w->layers);
    if (!w->layers)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for %d layers", m->L);
    rl_weights_bind(w, m);
    w->packed = pack && w->k.matmul_forward == amx_matmul_forward;
    return w->packed ? pack_all(w, m) : MO_OK;
}

void rl_weights_model(const rl_weights_t *w, const model_t *m, model_t *out) {
    *out = *m;
    out->k = &w->k;
    out->final_norm = w->final_norm;
}

void rl_weights_bind(rl_weights_t *w, const model_t *m) {
    MO_ASSERT(!w->merged);
    lora_rows_cache_build(&w->lora, m->adapter);
    for (int l = 0; l < m->L; l++) {
        bind_layer(&w->layers[l], &m->layers[l]);
        w->layers[l].lora = &w->lora;
    }
    w->final_norm = m->final_norm;
}

void rl_weights_free(rl_weights_t *w) {
    if (w->layers)
        for (int l = 0; l < w->L; l++) {
            free(w->layers[l].experts);
            free(w->layers[l].absorbed);
            free(w->layers[l].exp_gu);
            free(w->layers[l].pbuf);
        }
    for (int i = 0; w->copies && i < w->n_modules; i++)
        free(w->copies[i]);
    free(w->copies);
    free(w->targets);
    free(w->layers);
    lora_rows_cache_free(&w->lora);
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

/* Every layer back to the model's weights. */
static void restore_base(rl_weights_t *w, const model_t *m) {
    for (int l = 0; l < m->L; l++)
        base_layer(&w->layers[l], &m->layers[l], m->E);
    w->final_norm = m->final_norm;
}

/* The slot in layer l that full tensor name stands for (and its shape), or NULL: the
 * names model_adapter_add_full gives. A router slot is returned through *router. */
static const float **full_slot(rl_weights_t *w, const model_t *m, const char *name, int *rows,
                               int *cols, wview_t **router) {
    char nm[160];
    *router = NULL;
    *cols = 1;
    *rows = m->D;
    if (strcmp(name, "model.norm.weight") == 0)
        return &w->final_norm;
    const char *blk = m->cfg.arch == ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    for (int l = 0; l < m->L; l++) {
        rl_layer_t *r = &w->layers[l];
        const model_layer_t *ly = &m->layers[l];
        struct {
            const char *what;
            const float **slot;
            int n;
        } norms[6] = {
            {"input_layernorm", &r->attn_norm, m->D},
            {"post_attention_layernorm", &r->mlp_norm, m->D},
            {"self_attn.q_norm", ly->q_norm ? &r->q_norm : NULL, m->Dh},
            {"self_attn.k_norm", ly->q_norm ? &r->k_norm : NULL, m->Dh},
            {"self_attn.q_a_layernorm", m->mla && ly->mla.q_a_norm ? &r->mla.q_a_norm : NULL,
             m->mla_cfg.q_rank},
            {"self_attn.kv_a_layernorm", m->mla ? &r->mla.kv_a_norm : NULL, m->mla_cfg.kv_rank},
        };
        for (int i = 0; i < 6; i++) {
            snprintf(nm, sizeof nm, "model.layers.%d.%s.weight", l, norms[i].what);
            if (norms[i].slot && strcmp(name, nm) == 0) {
                *rows = norms[i].n;
                return norms[i].slot;
            }
        }
        snprintf(nm, sizeof nm, "model.layers.%d.%s.gate.weight", l, blk);
        if (ly->moe && strcmp(name, nm) == 0) {
            *rows = m->E;
            *cols = m->D;
            *router = &r->moe_w.router;
            return NULL;
        }
    }
    return NULL;
}

/* The routers and norms ad trains in full in place of the model's (merged mode). */
static int merge_full(rl_weights_t *w, const model_t *m, const lora_adapter_t *ad) {
    for (int t = ad->n_tensors - ad->n_full; t < ad->n_tensors; t++) {
        const lora_tensor_t *lt = &ad->tensors[t];
        int rows, cols;
        wview_t *router;
        const float **slot = full_slot(w, m, lt->name, &rows, &cols, &router);
        if (!slot && !router)
            return mo_errorf(MO_EINVAL,
                             "adapter full tensor \"%s\" is not a trainable weight of this model",
                             lt->name);
        if (lt->shape[0] != rows || lt->shape[1] != cols)
            return mo_errorf(MO_EINVAL,
                             "adapter full tensor \"%s\" is (%lld, %lld), the model's weight is "
                             "(%d, %d)",
                             lt->name, (long long)lt->shape[0], (long long)lt->shape[1], rows,
                             cols);
        const float *v = ad->params + lt->offset;
        if (router)
            *router = wview_f32(v);
        else
            *slot = v;
    }
    return MO_OK;
}

/* rl_weights_merge on tables already in merged mode, from the base. */
static int merge_in(rl_weights_t *w, const model_t *m, const lora_adapter_t *ad) {
    restore_base(w, m);
    if (!ad)
        return MO_OK;
    TRY(merge_full(w, m, ad));
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
        TRY(merge_module(w, m, i, &base, &p));
        matched++;
    }
    if (matched != ad->n_entries)
        return mo_errorf(MO_EINVAL,
                         "adapter: %d of its %d modules are not projections of this "
                         "model",
                         ad->n_entries - matched, ad->n_entries);
    return MO_OK;
}

int rl_weights_merge(rl_weights_t *w, const model_t *m, const lora_adapter_t *ad) {
    if (!w->merged)
        TRY(merged_tables(w, m));
    int rc = merge_in(w, m, ad);
    if (rc < 0)
        restore_base(w, m);
    if (w->packed) { /* the merged copies (or the base again) */
        int prc = pack_all(w, m);
        if (rc == MO_OK)
            rc = prc;
    }
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

/* out (N, OC) = inp (N, C) W^T (+ the adapter). */
static int proj(const model_t *m, arena_t *ar, const lora_rows_cache_t *lc, float *out,
                const float *inp, const wview_t *w, const lora_pair_t *p, int N, int C, int OC) {
    m->k->matmul_forward(out, inp, w, NULL, N, C, OC);
    if (p) {
        float *xa; /* (N, R) */
        ALLOC(xa, ar, (size_t)N * p->R);
        lora_rows_par(out, xa, inp, p, lc, N, C, OC);
    }
    return MO_OK;
}

/* The packed copy p stands in for the views v (n): packed from them. It does at any row
 * count: a matrix-vector product reads the weights once either way, and a row's result
 * then never depends on how many rows run with it. */
static int pack_ok(const rl_pack_t *p, const wview_t *const *v, int n, int N) {
    if (!p->w || N < 1)
        return 0;
    for (int i = 0; i < n; i++)
        if (v[i]->data != p->src[i])
            return 0;
    return 1;
}

/* out[i] (N, OC[i]) = inp (N, C) W_i^T (+ adapter lp[i]) for the n weights v: one packed
 * product over p when it stands in for them (one split of inp), one product each
 * otherwise. The same bits either way (amx_matmul_packed). lp NULL: no adapters. */
static int proj_n(const model_t *m, arena_t *ar, const lora_rows_cache_t *lc, const rl_pack_t *p,
                  float *const *out, const float *inp, const wview_t *const *v,
                  const lora_pair_t *const *lp, const int *OC, int n, int N, int C) {
    if (!pack_ok(p, v, n, N)) {
        for (int i = 0; i < n; i++)
            TRY(proj(m, ar, lc, out[i], inp, v[i], lp ? lp[i] : NULL, N, C, OC[i]));
        return MO_OK;
    }
    amx_out_t o[3];
    MO_ASSERT(n <= 3);
    for (int i = 0; i < n; i++)
        o[i] = (amx_out_t){out[i], NULL, OC[i]};
    amx_matmul_packed(o, n, inp, p->w, N, C);
    for (int i = 0; lp && i < n; i++)
        if (lp[i]) {
            float *xa; /* (N, R) */
            ALLOC(xa, ar, (size_t)N * lp[i]->R);
            lora_rows_par(out[i], xa, inp, lp[i], lc, N, C, OC[i]);
        }
    return MO_OK;
}

/* y (N, D) = (silu(x Wg^T) * x Wu^T) Wd^T with the MLP's adapters; gate and up as one
 * product over gu when packed (SwiGLU taken from the accumulators when neither has an
 * adapter), down over dn; g, u, h (N, F) temporaries. */
static int mlp_rows(const model_t *m, arena_t *ar, const lora_rows_cache_t *lc, float *y,
                    const float *x, const mlp_weights_t *w, const rl_pack_t *gu,
                    const rl_pack_t *dn, float *g, float *u, float *h, int N, int D, int F) {
    const wview_t *gu_v[2] = {&w->gate, &w->up}, *dn_v[1] = {&w->down};
    const lora_pair_t *gu_l[2] = {w->lora_gate, w->lora_up}, *dn_l[1] = {w->lora_down};
    if (pack_ok(gu, gu_v, 2, N) && !gu_l[0] && !gu_l[1]) {
        amx_matmul_glu(h, NULL, NULL, x, gu->w, N, D, F);
    } else {
        if (pack_ok(gu, gu_v, 2, N)) {
            amx_matmul_glu(NULL, g, u, x, gu->w, N, D, F);
        } else {
            TRY(proj(m, ar, lc, g, x, &w->gate, NULL, N, D, F));
            TRY(proj(m, ar, lc, u, x, &w->up, NULL, N, D, F));
        }
        float *gu_out[2] = {g, u};
        for (int i = 0; i < 2; i++)
            if (gu_l[i]) {
                float *xa; /* (N, R) */
                ALLOC(xa, ar, (size_t)N * gu_l[i]->R);
                lora_rows_par(gu_out[i], xa, x, gu_l[i], lc, N, D, F);
            }
        m->k->swiglu_forward(h, g, u, (size_t)N * F);
    }
    return proj_n(m, ar, lc, dn, &y, h, dn_v, dn_l, &D, 1, N, F);
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
    int rc = proj(m, ar, r->lora, wt, eye, &r->mla.kv_b, r->mla.lora_kv_b, Rkv, Rkv, kvo);
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
    return proj(m, ar, r->lora, o, ao, &r->mla.o, r->mla.lora_o, N, H * Dv, m->D);
}

/* o (N, D) = the attention block's output for rows x; k and v go into the cache. */
static int attention(const model_t *m, arena_t *ar, float *o, const float *x, rl_layer_t *r, int l,
                     kv_cache_t *c, const decode_batch_t *b) {
    const kernels_t *k = m->k;
    int N = b->N, D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    float *ln, *rstd, *q, *kk, *v, *qr, *kr, *att;
    ALLOC(ln, ar, (size_t)N * D);
    ALLOC(rstd, ar, N);
    k->rmsnorm_forward(ln, rstd, x, r->attn_norm, N, D, m->eps);
    if (m->mla)
        return mla_attention(m, ar, o, ln, r, l, c, b);
    ALLOC(q, ar, (size_t)N * qd);
    ALLOC(kk, ar, (size_t)N * kvd);
    ALLOC(v, ar, (size_t)N * kvd);
    float *qkv_out[3] = {q, kk, v};
    const wview_t *qkv_v[3] = {&r->wq, &r->wk, &r->wv}, *o_v[1] = {&r->wo};
    const lora_pair_t *qkv_l[3] = {r->lq, r->lk, r->lv}, *o_l[1] = {r->lo};
    int qkv_oc[3] = {qd, kvd, kvd};
    TRY(proj_n(m, ar, r->lora, &r->qkv, qkv_out, ln, qkv_v, qkv_l, qkv_oc, 3, N, D));
    ALLOC(qr, ar, (size_t)N * qd);
    ALLOC(kr, ar, (size_t)N * kvd);
    TRY(norm_rope(m, ar, qr, q, r->q_norm, b->pos, N, m->H));
    TRY(norm_rope(m, ar, kr, kk, r->k_norm, b->pos, N, m->Hkv));
    ALLOC(att, ar, (size_t)N * qd);
    if (b->prefill) {
        for (int i = 0; i < N; i++)
            kv_write(c, b->seqs[i], l, b->pos[i], kr + (size_t)i * kvd, v + (size_t)i * kvd);
        float *lse;
        ALLOC(lse, ar, (size_t)N * m->H);
        k->attention_forward(att, lse, qr, kr, v, b->cu, b->B, m->H, m->Hkv, m->Dh, m->attn_scale,
                             r->ly->window);
    } else {
        attn_decode_store_forward(att, qr, kr, v, c, l, (const kv_seq_t *const *)b->seqs, b->pos, N,
                                  m->H, m->attn_scale, r->ly->window);
    }
    return proj_n(m, ar, r->lora, &r->o, &o, att, o_v, o_l, &D, 1, N, qd);
}

/* Copies MoE layer mi's experts idx (N, K) into the routing record (N, M, K). */
static void record(uint16_t *routing, const int32_t *idx, int N, int M, int K, int mi) {
    for (int i = 0; i < N; i++)
        for (int j = 0; j < K; j++)
            routing[((size_t)i * M + mi) * K + j] = (uint16_t)idx[(size_t)i * K + j];
}

static const rl_pack_t no_pack;

/* The experts' groups for the grouped products, or 0 when an expert with rows lacks a
 * packed copy standing in for its weights. *lora: some expert has an adapter. */
static int expert_groups(amx_group_t *gu, amx_group_t *dn, const rl_layer_t *r, const int32_t *off,
                         int E, int *lora) {
    *lora = 0;
    for (int e = 0; e < E; e++) {
        int rows = off[e + 1] - off[e];
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        const wview_t *gu_v[2] = {&mw.gate, &mw.up}, *dn_v[1] = {&mw.down};
        if (rows > 0 && !(r->exp_gu && pack_ok(&r->exp_gu[e], gu_v, 2, rows) && r->exp_down &&
                          pack_ok(&r->exp_down[e], dn_v, 1, rows)))
            return 0;
        gu[e] = (amx_group_t){rows ? r->exp_gu[e].w : NULL, off[e], rows};
        dn[e] = (amx_group_t){rows ? r->exp_down[e].w : NULL, off[e], rows};
        *lora |= mw.lora_gate || mw.lora_up || mw.lora_down;
    }
    return 1;
}

/* The largest rank of the experts' adapters (0: none). */
static int expert_rank(const rl_layer_t *r, int E) {
    int R = 0;
    for (int e = 0; e < E; e++) {
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        const lora_pair_t *p[3] = {mw.lora_gate, mw.lora_up, mw.lora_down};
        for (int i = 0; i < 3; i++)
            if (p[i] && p[i]->R > R)
                R = p[i]->R;
    }
    return R;
}

/* The experts' gate and up adapters added to g and u (S, F), then h = silu(g) * u, one
 * expert per thread at a time (xa: S rows of the largest rank). */
static void experts_gu_lora(const model_t *m, const rl_layer_t *r, float *h, float *g, float *u,
                            float *xa, const float *xg, const int32_t *off, int E, int R) {
    int D = m->D, F = r->moe_cfg.F;
#pragma omp parallel for schedule(dynamic, 1) if (off[E] > 1)
    for (int e = 0; e < E; e++) {
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        size_t a = (size_t)off[e];
        int rows = off[e + 1] - off[e];
        if (mw.lora_gate)
            lora_rows(g + a * F, xa + a * R, xg + a * D, mw.lora_gate, r->lora, rows, D, F);
        if (mw.lora_up)
            lora_rows(u + a * F, xa + a * R, xg + a * D, mw.lora_up, r->lora, rows, D, F);
        amx_swiglu(h + a * F, g + a * F, u + a * F, (size_t)rows * F);
    }
}

/* The experts' down adapters added to yg (S, D), one expert per thread at a time. */
static void experts_down_lora(const model_t *m, const rl_layer_t *r, float *yg, float *xa,
                              const float *h, const int32_t *off, int E, int R) {
    int D = m->D, F = r->moe_cfg.F;
#pragma omp parallel for schedule(dynamic, 1) if (off[E] > 1)
    for (int e = 0; e < E; e++) {
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        size_t a = (size_t)off[e];
        if (mw.lora_down)
            lora_rows(yg + a * D, xa + a * R, h + a * F, mw.lora_down, r->lora, off[e + 1] - off[e],
                      F, D);
    }
}

/* yg (S, D) = every expert's MLP on its dispatched rows of xg (S, D), through the grouped
 * products (one parallel region for all the experts' gate and up, one for their down;
 * each row's bits those mlp_rows gives it); *done 0, and nothing computed, when an
 * expert's weights have no packed copy. */
static int experts_grouped(const model_t *m, arena_t *ar, float *yg, const float *xg,
                           const rl_layer_t *r, const int32_t *off, int E, int *done) {
    int D = m->D, F = r->moe_cfg.F, lora;
    amx_group_t *gu, *dn;
    ALLOC(gu, ar, (size_t)E);
    ALLOC(dn, ar, (size_t)E);
    *done = expert_groups(gu, dn, r, off, E, &lora);
    if (!*done)
        return MO_OK;
    size_t S = (size_t)off[E];
    float *h;
    ALLOC(h, ar, S * F);
    if (!lora) {
        amx_matmul_glu_groups(h, NULL, NULL, xg, gu, E, D, F);
        amx_matmul_packed_groups(yg, h, dn, E, F, D);
        return MO_OK;
    }
    int R = expert_rank(r, E);
    float *g, *u, *xa;
    ALLOC(g, ar, S * F);
    ALLOC(u, ar, S * F);
    ALLOC(xa, ar, S * (size_t)R);
    amx_matmul_glu_groups(NULL, g, u, xg, gu, E, D, F);
    experts_gu_lora(m, r, h, g, u, xa, xg, off, E, R);
    amx_matmul_packed_groups(yg, h, dn, E, F, D);
    experts_down_lora(m, r, yg, xa, h, off, E, R);
    return MO_OK;
}

/* yg (S, D) = every expert's MLP on its dispatched rows of xg (S, D), one expert after
 * the other (mlp_rows). */
static int experts_each(const model_t *m, arena_t *ar, float *yg, const float *xg,
                        const rl_layer_t *r, const int32_t *off, int E) {
    int D = m->D, F = r->moe_cfg.F, most = 0;
    float *g, *u, *h;
    for (int e = 0; e < E; e++)
        if (off[e + 1] - off[e] > most)
            most = off[e + 1] - off[e];
    ALLOC(g, ar, (size_t)most * F);
    ALLOC(u, ar, (size_t)most * F);
    ALLOC(h, ar, (size_t)most * F);
    for (int e = 0; e < E; e++) {
        int rows = off[e + 1] - off[e];
        if (rows == 0)
            continue;
        mlp_weights_t mw = moe_expert_weights(&r->moe_w, e);
        size_t at = (size_t)off[e] * D;
        TRY(mlp_rows(m, ar, r->lora, yg + at, xg + at, &mw, r->exp_gu ? &r->exp_gu[e] : &no_pack,
                     r->exp_down ? &r->exp_down[e] : &no_pack, g, u, h, rows, D, F));
    }
    return MO_OK;
}

/* out (N, D) = the MoE block on the normed rows x, as moe_forward with natural routing
 * computes it (the same routing, dispatch and combine; each expert's gate and up as one
 * product where packed); *idx (N, K) receives the experts. */
static int moe_block(const model_t *m, arena_t *ar, float *out, const float *x, rl_layer_t *r,
                     int N, const int32_t **idx_out) {
    const moe_cfg_t *c = &r->moe_cfg;
    int D = m->D, E = c->router.E, K = c->router.K, F = c->F;
    size_t S = (size_t)N * K;
    float *logits, *probs, *weight, *xg, *yg, *g, *u, *h;
    int32_t *idx;
    ALLOC(logits, ar, (size_t)N * E);
    ALLOC(probs, ar, (size_t)N * E);
    ALLOC(weight, ar, S);
    ALLOC(idx, ar, S);
    const wview_t *rv[1] = {&r->moe_w.router};
    TRY(proj_n(m, ar, r->lora, &r->router, &logits, x, rv, NULL, &E, 1, N, D));
    TRY(router_forward(m->k, &c->router, idx, weight, probs, logits, N));
    moe_dispatch_t plan;
    TRY(moe_dispatch_plan(&plan, ar, idx, N, K, E));
    ALLOC(xg, ar, S * D);
    ALLOC(yg, ar, S * D);
    moe_dispatch_forward(xg, x, &plan, D);
    int grouped = 0;
    TRY(experts_grouped(m, ar, yg, xg, r, plan.offsets, E, &grouped));
    if (!grouped)
        TRY(experts_each(m, ar, yg, xg, r, plan.offsets, E));
    moe_combine_forward(out, yg, weight, &plan, D);
    if (c->n_shared > 0) {
        int Fs = c->n_shared * F;
        float *ys;
        ALLOC(ys, ar, (size_t)N * D);
        ALLOC(g, ar, (size_t)N * Fs);
        ALLOC(u, ar, (size_t)N * Fs);
        ALLOC(h, ar, (size_t)N * Fs);
        TRY(mlp_rows(m, ar, r->lora, ys, x, &r->moe_w.shared, &r->mlp_gu, &r->mlp_down, g, u, h, N,
                     D, Fs));
        for (size_t i = 0; i < (size_t)N * D; i++)
            out[i] += ys[i];
    }
    *idx_out = idx;
    return MO_OK;
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
    m->k->rmsnorm_forward(ln, rstd, x, r->mlp_norm, N, D, m->eps);
    float *ff = o;
    if (r->ly->moe) {
        const int32_t *idx = NULL;
        int rc = moe_block(m, ar, ff, ln, r, N, &idx);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
        if (b->routing)
            record(b->routing, idx, N, m->n_moe, m->K, r->ly->moe_index);
    } else {
        float *g, *u, *h;
        int F = m->cfg.intermediate_size;
        ALLOC(g, ar, (size_t)N * F);
        ALLOC(u, ar, (size_t)N * F);
        ALLOC(h, ar, (size_t)N * F);
        TRY(mlp_rows(m, ar, r->lora, ff, ln, &r->dense, &r->mlp_gu, &r->mlp_down, g, u, h, N, D,
                     F));
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
