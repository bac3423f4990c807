/* model_cuda: the policy model's scoring forward on the CUDA backend. */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/model_glue.h"
#include "core/cuda/moe_cuda.h"
#include "core/dtype.h"
#include "core/status.h"

/* ------------------------------------------------------------------------ */
/* What the device path covers.                                              */

static int dtype_ok(const wview_t *w) {
    return (w->dtype == DT_F32 || w->dtype == DT_BF16) && !w->scale && w->data;
}

static int refuse(const model_t *m, const char *feature) {
    return mo_errorf(MO_ECONFIG, "model_cuda: %s (%s) is not supported by the CUDA forward",
                     feature, m->path ? m->path : "model");
}

/* what: the weight's name; l: its layer, or -1 outside the layers. */
static int check_weight(const model_t *m, const wview_t *w, const char *what, int l) {
    if (dtype_ok(w))
        return MO_OK;
    char where[64] = "";
    if (l >= 0)
        snprintf(where, sizeof where, "layer %d ", l);
    if (!w->data)
        return mo_errorf(MO_ECONFIG,
                         "model_cuda: %s%s has no weights on this rank (under expert "
                         "parallelism, model_set_comm keeps only the rank's own experts, and "
                         "those must all be there) (%s)",
                         where, what, m->path ? m->path : "model");
    return mo_errorf(MO_ECONFIG,
                     "model_cuda: %s%s is %s%s: only f32 and bf16 weights are supported by the "
                     "CUDA forward (%s)",
                     where, what, dtype_name(w->dtype), w->scale ? " with block scales (fp8)" : "",
                     m->path ? m->path : "model");
}

static int check_attention(const model_t *m, const model_layer_t *ly, int l) {
    TRY(check_weight(m, &ly->wq, "q_proj", l));
    TRY(check_weight(m, &ly->wk, "k_proj", l));
    TRY(check_weight(m, &ly->wv, "v_proj", l));
    return check_weight(m, &ly->wo, "o_proj", l);
}

static int check_moe(const model_t *m, const model_layer_t *ly, int l) {
    const router_cfg_t *rc = &ly->moe_cfg.router;
    if (rc->kind == ROUTER_SIGMOID_GROUPED)
        return mo_errorf(MO_ECONFIG,
                         "model_cuda: layer %d routes with sigmoid scores and group limits "
                         "(sigmoid_grouped router), which is not supported by the CUDA forward "
                         "(softmax top-k only) (%s)",
                         l, m->path ? m->path : "model");
    if (rc->kind != ROUTER_SOFTMAX_TOPK || rc->n_group > 1)
        return mo_errorf(MO_ECONFIG,
                         "model_cuda: layer %d uses a group-limited router, which is not "
                         "supported by the CUDA forward (softmax top-k only) (%s)",
                         l, m->path ? m->path : "model");
    if (rc->e_score_correction_bias || ly->e_bias)
        return refuse(m, "e_score_correction_bias");
    if (ly->moe_cfg.n_shared > 0)
        return mo_errorf(MO_ECONFIG,
                         "model_cuda: layer %d has %d shared experts, which are not supported by "
                         "the CUDA forward (%s)",
                         l, ly->moe_cfg.n_shared, m->path ? m->path : "model");
    if (rc->E != m->E || rc->K != m->K || ly->moe_cfg.D != m->D)
        return mo_errorf(MO_ECONFIG, "model_cuda: layer %d has E=%d K=%d D=%d, the model %d %d %d",
                         l, rc->E, rc->K, ly->moe_cfg.D, m->E, m->K, m->D);
    TRY(check_weight(m, &ly->moe_w.router, "router", l));
    int e0, n; /* the experts this rank holds */
    mc_ep_range(m, &e0, &n);
    dtype_t dt = ly->moe_w.gate[e0].dtype;
    for (int e = e0; e < e0 + n; e++) {
        TRY(check_weight(m, &ly->moe_w.gate[e], "expert gate_proj", l));
        TRY(check_weight(m, &ly->moe_w.up[e], "expert up_proj", l));
        TRY(check_weight(m, &ly->moe_w.down[e], "expert down_proj", l));
        if (ly->moe_w.gate[e].dtype != dt || ly->moe_w.up[e].dtype != dt ||
            ly->moe_w.down[e].dtype != dt)
            return refuse(m, "experts of mixed dtypes");
    }
    return MO_OK;
}

static int check_dense(const model_t *m, const model_layer_t *ly, int l) {
    TRY(check_weight(m, &ly->dense.gate, "mlp gate_proj", l));
    TRY(check_weight(m, &ly->dense.up, "mlp up_proj", l));
    TRY(check_weight(m, &ly->dense.down, "mlp down_proj", l));
    if (ly->dense.up.dtype != ly->dense.gate.dtype || ly->dense.down.dtype != ly->dense.gate.dtype)
        return refuse(m, "a dense MLP of mixed dtypes");
    return MO_OK;
}

static int check_supported(const model_t *m) {
    if (m->mla)
        return refuse(m, "multi-head latent attention (MLA, DeepSeek-V3 / Kimi K2)");
    if (m->adapter && m->adapter->n_full > 0)
        return refuse(m, "an adapter with trainable full weights (model_adapter_add_full)");
    if (!dtype_ok(&m->embed))
        return check_weight(m, &m->embed, "embed_tokens", -1);
    if (!dtype_ok(&m->lm_head))
        return check_weight(m, &m->lm_head, "lm_head", -1);
    if (m->Dh % 2 != 0)
        return mo_errorf(MO_ECONFIG, "model_cuda: head_dim %d must be even for RoPE", m->Dh);
    for (int l = 0; l < m->L; l++) {
        const model_layer_t *ly = &m->layers[l];
        TRY(check_attention(m, ly, l));
        TRY(ly->moe ? check_moe(m, ly, l) : check_dense(m, ly, l));
    }
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Upload: one layout function run twice, first to size the pool block, then to fill it. */

typedef struct up {
    const backend_t *be;
    char *base; /* NULL: sizing pass */
    size_t off;
    const void **tab;         /* (E) host staging for pointer tables */
    const lora_adapter_t *ad; /* the bound adapter, or NULL */
    const float *dparams;     /* (ad->n_params) its parameters on the device (fill pass) */
    const float *dgrads;      /* (ad->n_params) their gradients on the device (fill pass) */
} up_t;

static size_t align_up(size_t n) {
    return (n + MC_ALIGN - 1) / MC_ALIGN * MC_ALIGN;
}

/* *dst = the device copy of bytes of host memory (NULL in the sizing pass); host NULL only
 * reserves the bytes. */
static int put(up_t *u, const void **dst, const void *host, size_t bytes) {
    size_t o = align_up(u->off);
    u->off = o + bytes;
    *dst = NULL;
    if (!u->base)
        return MO_OK;
    *dst = u->base + o;
    if (bytes > 0 && host)
        TRY(u->be->copy(u->be, u->base + o, DEV_CUDA, host, DEV_CPU, bytes));
    return MO_OK;
}

static int put_f(up_t *u, const float **dst, const float *host, size_t n) {
    const void *d;
    TRY(put(u, &d, host, n * sizeof(float)));
    *dst = d;
    return MO_OK;
}

/* A matrix (rows, cols) in its stored dtype. */
static int put_w(up_t *u, wview_t *dst, const wview_t *src, size_t rows, size_t cols) {
    const void *d;
    TRY(put(u, &d, src->data, rows * cols * dtype_size(src->dtype)));
    *dst = wview_of(d, src->dtype);
    return MO_OK;
}

/* A matrix (rows, cols) converted to f32 (exact from bf16). */
static int put_w_f32(up_t *u, wview_t *dst, const wview_t *src, size_t rows, size_t cols) {
    size_t n = rows * cols;
    const float *d = NULL;
    if (!u->base || src->dtype == DT_F32) {
        TRY(put_f(u, &d, src->dtype == DT_F32 ? src->data : NULL, n));
    } else {
        float *h = malloc(n * sizeof(float));
        if (!h)
            return mo_errorf(MO_ENOMEM, "model_cuda: %zu bytes to convert the router",
                             n * sizeof(float));
        convert_to_f32(h, src->data, src->dtype, n);
        int rc = put_f(u, &d, h, n);
        free(h);
        TRY(rc);
    }
    *dst = wview_f32(d);
    return MO_OK;
}

/* The device table of n pointers u->tab[0 .. n-1]. */
static int put_tab(up_t *u, const void *const **dst, int n) {
    const void *d;
    TRY(put(u, &d, u->tab, sizeof(void *) * (size_t)n));
    *dst = d;
    return MO_OK;
}

/* The device address in dev (u->dparams or u->dgrads) of the adapter's parameter at host
 * address x (an A or B of one of its pairs): the same offset from the start. NULL in the
 * sizing pass. */
static int dparam(up_t *u, const void **dst, const float *dev, const float *x, size_t n) {
    const float *lo = u->ad->params, *hi = lo + u->ad->n_params;
    if (x < lo || x + n > hi)
        return mo_errorf(MO_EINVAL, "model_cuda: an adapter pair lies outside its parameters");
    *dst = dev ? (const void *)(dev + (x - lo)) : NULL;
    return MO_OK;
}

/* The adapter tables of one projection (OC, C) for n experts from pairs p (n, entries may
 * be NULL); l->A stays NULL when no entry has an adapter. */
static int put_lora(up_t *u, moe_cuda_lora_t *l, const lora_pair_t *const *p, int n, int C,
                    int OC) {
    memset(l, 0, sizeof *l);
    int any = 0;
    for (int e = 0; e < n; e++)
        if (p[e]) {
            any = 1;
            l->R = p[e]->R;
            l->scale = p[e]->scale;
        }
    if (!any)
        return MO_OK;
    /* (4, n) staging: A, B, then dA, dB at the same offsets into the gradients. */
    const void **tabs = malloc(sizeof(void *) * 4 * (size_t)n);
    if (!tabs)
        return mo_errorf(MO_ENOMEM, "model_cuda: adapter tables");
    int rc = MO_OK;
    for (int e = 0; e < n && rc == MO_OK; e++) {
        for (int j = 0; j < 4; j++)
            tabs[(size_t)j * n + e] = NULL;
        if (!p[e])
            continue;
        size_t na = (size_t)l->R * C, nb = (size_t)OC * l->R;
        rc = dparam(u, &tabs[e], u->dparams, p[e]->A, na);
        if (rc == MO_OK)
            rc = dparam(u, &tabs[(size_t)n + e], u->dparams, p[e]->B, nb);
        if (rc == MO_OK)
            rc = dparam(u, &tabs[(size_t)2 * n + e], u->dgrads, p[e]->A, na);
        if (rc == MO_OK)
            rc = dparam(u, &tabs[(size_t)3 * n + e], u->dgrads, p[e]->B, nb);
    }
    const void *const *t[4] = {NULL, NULL, NULL, NULL};
    for (int j = 0; j < 4 && rc == MO_OK; j++) {
        memcpy(u->tab, tabs + (size_t)j * n, sizeof(void *) * (size_t)n);
        rc = put_tab(u, &t[j], n);
    }
    free(tabs);
    TRY(rc);
    /* In the sizing pass the tables are NULL: mark the adapter present all the same. */
    l->A = t[0] ? (const float *const *)t[0] : (const float *const *)u->tab;
    l->B = (const float *const *)t[1];
    l->dA = (float *const *)t[2];
    l->dB = (float *const *)t[3];
    return MO_OK;
}

static int put_attention(up_t *u, const model_t *m, mc_layer_t *d, const model_layer_t *ly) {
    size_t D = (size_t)m->D, qd = (size_t)m->H * m->Dh, kvd = (size_t)m->Hkv * m->Dh;
    TRY(put_f(u, &d->attn_norm, ly->attn_norm, D));
    TRY(put_f(u, &d->mlp_norm, ly->mlp_norm, D));
    d->q_norm = d->k_norm = NULL;
    if (ly->q_norm)
        TRY(put_f(u, &d->q_norm, ly->q_norm, (size_t)m->Dh));
    if (ly->k_norm)
        TRY(put_f(u, &d->k_norm, ly->k_norm, (size_t)m->Dh));
    TRY(put_w(u, &d->wq, &ly->wq, qd, D));
    TRY(put_w(u, &d->wk, &ly->wk, kvd, D));
    TRY(put_w(u, &d->wv, &ly->wv, kvd, D));
    return put_w(u, &d->wo, &ly->wo, D, qd);
}

/* The device table of one projection of n experts: w[e] (rows, cols). */
static int put_expert_mats(up_t *u, const void *const **dst, const wview_t *w, int n, size_t rows,
                           size_t cols) {
    for (int e = 0; e < n; e++) {
        wview_t d;
        TRY(put_w(u, &d, &w[e], rows, cols));
        u->tab[e] = d.data;
    }
    return put_tab(u, dst, n);
}

static int put_ffn(up_t *u, const model_t *m, mc_layer_t *d, const model_layer_t *ly) {
    int D = m->D;
    const wview_t *gate, *up, *down;
    if (ly->moe) {
        int e0; /* the local experts only (expert parallelism) */
        mc_ep_range(m, &e0, &d->n_ex);
        d->F = ly->moe_cfg.F;
        gate = ly->moe_w.gate + e0, up = ly->moe_w.up + e0, down = ly->moe_w.down + e0;
        d->norm_topk = ly->moe_cfg.router.norm_topk_prob;
        d->route_scale = ly->moe_cfg.router.routed_scaling_factor;
        TRY(put_w_f32(u, &d->router, &ly->moe_w.router, (size_t)m->E, (size_t)D));
    } else {
        d->n_ex = 1;
        d->F = m->cfg.intermediate_size;
        gate = &ly->dense.gate, up = &ly->dense.up, down = &ly->dense.down;
    }
    int n = d->n_ex, F = d->F;
    d->ex.dtype = gate[0].dtype;
    TRY(put_expert_mats(u, &d->ex.gate, gate, n, (size_t)F, (size_t)D));
    TRY(put_expert_mats(u, &d->ex.up, up, n, (size_t)F, (size_t)D));
    return put_expert_mats(u, &d->ex.down, down, n, (size_t)D, (size_t)F);
}

/* One layer's adapter tables: q, k, v, o, then its experts' (or dense MLP's) gate, up and
 * down. */
typedef struct lset {
    moe_cuda_lora_t q, k, v, o, gate, up, down;
} lset_t;

/* The adapter tables of layer ly into s, for d's experts (already laid out). */
static int put_layer_lora(up_t *u, const model_t *m, lset_t *s, const mc_layer_t *d,
                          const model_layer_t *ly) {
    int D = m->D, qd = m->H * m->Dh, kvd = m->Hkv * m->Dh, n = d->n_ex, F = d->F;
    TRY(put_lora(u, &s->q, &ly->lora_q, 1, D, qd));
    TRY(put_lora(u, &s->k, &ly->lora_k, 1, D, kvd));
    TRY(put_lora(u, &s->v, &ly->lora_v, 1, D, kvd));
    TRY(put_lora(u, &s->o, &ly->lora_o, 1, qd, D));
    const lora_pair_t *const *lg = ly->moe_w.lora_gate, *const *lu = ly->moe_w.lora_up,
                             *const *ld = ly->moe_w.lora_down;
    const lora_pair_t *none[1] = {NULL};
    int e0, ne; /* the local experts' pairs (expert parallelism) */
    mc_ep_range(m, &e0, &ne);
    if (!ly->moe)
        lg = &ly->dense.lora_gate, lu = &ly->dense.lora_up, ld = &ly->dense.lora_down;
    else
        lg = lg ? lg + e0 : NULL, lu = lu ? lu + e0 : NULL, ld = ld ? ld + e0 : NULL;
    memset(&s->gate, 0, sizeof s->gate);
    memset(&s->up, 0, sizeof s->up);
    memset(&s->down, 0, sizeof s->down);
    if (n == 1 || lg)
        TRY(put_lora(u, &s->gate, lg ? lg : none, n, D, F));
    if (n == 1 || lu)
        TRY(put_lora(u, &s->up, lu ? lu : none, n, D, F));
    if (n == 1 || ld)
        TRY(put_lora(u, &s->down, ld ? ld : none, n, F, D));
    return MO_OK;
}

/* The bound adapter's part of the upload: its parameters, room for their gradients, and
 * every layer's tables (sets (L)). */
static int adapter_layout(model_cuda_t *mc, up_t *u, lset_t *sets) {
    const model_t *m = mc->m;
    u->ad = m->adapter;
    if (u->ad) {
        TRY(put_f(u, &u->dparams, u->ad->params, u->ad->n_params));
        TRY(put_f(u, &u->dgrads, NULL, u->ad->n_params)); /* reserved, zeroed by the backward */
    }
    for (int l = 0; l < m->L; l++)
        TRY(put_layer_lora(u, m, &sets[l], &mc->layers[l], &m->layers[l]));
    return MO_OK;
}

static void adapter_commit(model_cuda_t *mc, const up_t *u, const lset_t *sets, void *mem) {
    if (mc->amem)
        mc->be->free(mc->be, mc->amem);
    mc->amem = mem;
    mc->ad = u->ad;
    mc->R = u->ad ? u->ad->R : 0;
    mc->dparams = (float *)u->dparams;
    mc->dgrads = (float *)u->dgrads;
    for (int l = 0; l < mc->L; l++) {
        mc_layer_t *d = &mc->layers[l];
        const lset_t *s = &sets[l];
        d->lq = s->q, d->lk = s->k, d->lv = s->v, d->lo = s->o;
        d->ex.lora_gate = s->gate, d->ex.lora_up = s->up, d->ex.lora_down = s->down;
    }
}

/* The bound adapter (or none) uploaded into a pool block of its own, which replaces the
 * upload's adapter (mc->amem, the layers' tables) only once all of it is made. */
static int adapter_upload(model_cuda_t *mc) {
    up_t u = {mc->be, NULL, 0, NULL, NULL, NULL, NULL};
    u.tab = calloc((size_t)(mc->E > 1 ? mc->E : 1), sizeof(void *));
    lset_t *sets = calloc((size_t)(mc->L > 0 ? mc->L : 1), sizeof *sets);
    int rc = u.tab && sets ? adapter_layout(mc, &u, sets)
                           : mo_errorf(MO_ENOMEM, "model_cuda: adapter tables");
    void *mem = NULL;
    if (rc == MO_OK && u.off > 0) {
        rc = mc->be->alloc(mc->be, &mem, u.off);
        u.base = mem;
        u.off = 0;
        if (rc == MO_OK)
            rc = adapter_layout(mc, &u, sets);
    }
    if (rc == MO_OK)
        adapter_commit(mc, &u, sets, mem);
    else if (mem)
        mc->be->free(mc->be, mem);
    free(u.tab);
    free(sets);
    return rc;
}

static int layout(model_cuda_t *mc, up_t *u) {
    const model_t *m = mc->m;
    size_t V = (size_t)m->V, D = (size_t)m->D;
    TRY(put_w(u, &mc->embed, &m->embed, V, D));
    if (m->lm_head.data == m->embed.data && m->lm_head.dtype == m->embed.dtype)
        mc->lm_head = mc->embed; /* tied */
    else
        TRY(put_w(u, &mc->lm_head, &m->lm_head, V, D));
    TRY(put_f(u, &mc->final_norm, m->final_norm, D));
    TRY(put_f(u, &mc->inv_freq, m->inv_freq, (size_t)m->Dh / 2));
    for (int l = 0; l < m->L; l++) {
        mc_layer_t *d = &mc->layers[l];
        d->moe = m->layers[l].moe;
        d->moe_index = m->layers[l].moe_index;
        d->window = m->layers[l].window;
        TRY(put_attention(u, m, d, &m->layers[l]));
        TRY(put_ffn(u, m, d, &m->layers[l]));
    }
    return MO_OK;
}

static int upload(model_cuda_t *mc) {
    up_t u = {mc->be, NULL, 0, NULL, NULL, NULL, NULL};
    int n = mc->E > 1 ? mc->E : 1;
    u.tab = calloc((size_t)n, sizeof(void *));
    if (!u.tab)
        return mo_errorf(MO_ENOMEM, "model_cuda: pointer tables");
    int rc = layout(mc, &u);
    if (rc == MO_OK) {
        void *p = NULL;
        rc = mc->be->alloc(mc->be, &p, u.off > 0 ? u.off : 1);
        mc->wmem = p;
        u.base = p;
        u.off = 0;
    }
    if (rc == MO_OK)
        rc = layout(mc, &u);
    free(u.tab);
    return rc == MO_OK ? adapter_upload(mc) : rc;
}

/* Rank and widths the scratch depends on. */
static void dims(model_cuda_t *mc) {
    const model_t *m = mc->m;
    mc->R = m->adapter ? m->adapter->R : 0;
    mc->Fmax = 1;
    for (int l = 0; l < m->L; l++) {
        int F = m->layers[l].moe ? m->layers[l].moe_cfg.F : m->cfg.intermediate_size;
        mc->Fmax = F > mc->Fmax ? F : mc->Fmax;
        mc->n_moe += m->layers[l].moe;
        mc->dense |= !m->layers[l].moe;
    }
}

int model_cuda_upload(model_cuda_t **out, const model_t *m) {
    *out = NULL;
    if (!m)
        return mo_errorf(MO_EINVAL, "model_cuda_upload: no model");
    TRY(check_supported(m));
    const backend_t *be = backend_get(DEV_CUDA);
    if (!be)
        return mo_error_wrap(MO_EDEVICE, "model_cuda_upload");
    model_cuda_t *mc = calloc(1, sizeof *mc);
    if (!mc)
        return mo_errorf(MO_ENOMEM, "model_cuda_upload");
    mc->m = m;
    mc->be = be;
    mc->L = m->L, mc->D = m->D, mc->H = m->H, mc->Hkv = m->Hkv, mc->Dh = m->Dh;
    mc->E = m->E, mc->K = m->K, mc->V = m->V;
    dims(mc);
    mc->layers = calloc((size_t)(m->L > 0 ? m->L : 1), sizeof *mc->layers);
    int rc = mc->layers ? upload(mc) : mo_errorf(MO_ENOMEM, "model_cuda_upload");
    if (rc == MO_OK)
        rc = mc_ep_init(mc);
    if (rc < 0) {
        model_cuda_free(&mc);
        return mo_error_wrap(rc, "model_cuda_upload");
    }
    *out = mc;
    return MO_OK;
}

void model_cuda_free(model_cuda_t **pmc) {
    if (!pmc || !*pmc)
        return;
    model_cuda_t *mc = *pmc;
    if (mc->be) {
        mc->be->synchronize(mc->be); /* no queued work may still read the blocks */
        mc_graphs_free(mc);
        mc_train_free(mc);
        mc_ep_free(mc);
        moe_cuda_plan_free(&mc->plan);
        if (mc->smem)
            mc->be->free(mc->be, mc->smem);
        if (mc->dmem)
            mc->be->free(mc->be, mc->dmem);
        if (mc->wmem)
            mc->be->free(mc->be, mc->wmem);
        if (mc->amem)
            mc->be->free(mc->be, mc->amem);
        if (mc->kvmem)
            mc->be->free(mc->be, mc->kvmem);
    }
    free(mc->layers);
    free(mc);
    *pmc = NULL;
}

int model_cuda_has_adapter(const model_cuda_t *mc) {
    return mc && mc->R > 0;
}

int model_cuda_sync_adapter(model_cuda_t *mc) {
    if (!mc || !mc->ad)
        return mo_errorf(MO_EINVAL, "model_cuda_sync_adapter: the upload holds no adapter");
    if (mc->m->adapter != mc->ad)
        return mo_errorf(MO_ESTATE, "model_cuda_sync_adapter: the adapter uploaded is no longer "
                                    "bound to the model");
    TRY(mc->be->synchronize(mc->be)); /* no queued work still reads the old parameters */
    mc_train_invalidate(mc);
    return mc->be->copy(mc->be, mc->dparams, DEV_CUDA, mc->ad->params, DEV_CPU,
                        sizeof(float) * mc->ad->n_params);
}

/* 1 when b's pairs lie where a's do, with the same shapes and scale: the device tables
 * built for a serve b. */
static int same_layout(const lora_adapter_t *a, const lora_adapter_t *b) {
    if (a->n_params != b->n_params || a->n_entries != b->n_entries || a->R != b->R ||
        a->scale != b->scale)
        return 0;
    for (int e = 0; e < a->n_entries; e++) {
        const lora_entry_t *x = &a->entries[e], *y = &b->entries[e];
        if (strcmp(x->name, y->name) != 0 || x->C != y->C || x->OC != y->OC || x->R != y->R ||
            x->off_A != y->off_A || x->off_B != y->off_B)
            return 0;
    }
    return 1;
}

int model_cuda_rebind_adapter(model_cuda_t *mc) {
    static const char fn[] = "model_cuda_rebind_adapter";
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    const lora_adapter_t *ad = mc->m->adapter;
    if (ad && ad->n_full > 0)
        return mo_errorf(MO_EINVAL,
                         "%s: the adapter bound trains %d full weights (%s, ...: "
                         "model_adapter_add_full), which the CUDA forward does not support; "
                         "the upload keeps its adapter",
                         fn, ad->n_full, ad->tensors[2 * ad->n_entries].name);
    TRY(mc->be->synchronize(mc->be)); /* no queued work still reads the old adapter */
    mc_train_invalidate(mc);
    if (ad && mc->ad && same_layout(ad, mc->ad)) {
        mc->ad = ad;
        return mc->be->copy(mc->be, mc->dparams, DEV_CUDA, ad->params, DEV_CPU,
                            sizeof(float) * ad->n_params);
    }
    mc_train_free(mc); /* its buffers are sized for the old adapter */
    int rc = adapter_upload(mc);
    return rc < 0 ? mo_error_wrap(rc, fn) : MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Scratch.                                                                  */

void *mc_bump(mc_bump_t *b, size_t bytes) {
    size_t o = align_up(b->off);
    b->off = o + (bytes > 0 ? bytes : 1);
    return b->base ? b->base + o : NULL;
}

void mc_ids_layout(const model_cuda_t *mc, mc_bump_t *b, mc_ids_t *id, int T, int B) {
    MC_BUMP(id->tok, b, T);
    MC_BUMP(id->pos, b, T);
    MC_BUMP(id->tgt, b, T);
    MC_BUMP(id->cu, b, B + 1);
    MC_BUMP(id->off1, b, 2);
    MC_BUMP(id->route, b, (size_t)mc->n_moe * T * mc->K);
}

/* Rows of logits formed at a time: model_opts_t.logits_chunk_rows when set, else up to 256 MiB
 * of logits (fewer passes over lm_head than the CPU's default). */
int mc_logits_rows(const model_cuda_t *mc, int T) {
    int r = mc->m->opts.logits_chunk_rows > 0 ? mc->m->opts.logits_chunk_rows : (1 << 26) / mc->V;
    r = r > 0 ? r : 1;
    return r < T ? r : T;
}

size_t mc_expert_rows(const model_cuda_t *mc, int T) {
    size_t S = mc->n_moe ? (size_t)T * mc->K : 0;
    return mc->dense && (size_t)T > S ? (size_t)T : S;
}

/* Carves the buffers for T tokens of B sequences; returns the bytes. */
static size_t scratch_layout(const model_cuda_t *mc, mc_scratch_t *s, char *base, int T, int B) {
    mc_bump_t b = {base, 0};
    size_t TD = (size_t)T * mc->D, qd = (size_t)T * mc->H * mc->Dh;
    size_t kvd = (size_t)T * mc->Hkv * mc->Dh, S = (size_t)T * mc->K;
    size_t rows_ex = mc_expert_rows(mc, T);
    size_t R = (size_t)(mc->R > 0 ? mc->R : 1);
    mc_ids_layout(mc, &b, &s->id, T, B);
    MC_BUMP(s->x, &b, TD);
    MC_BUMP(s->h1, &b, TD);
    MC_BUMP(s->ln, &b, TD);
    MC_BUMP(s->o, &b, TD);
    MC_BUMP(s->q, &b, qd);
    MC_BUMP(s->qr, &b, qd);
    MC_BUMP(s->att, &b, qd);
    MC_BUMP(s->k, &b, kvd);
    MC_BUMP(s->kr, &b, kvd);
    MC_BUMP(s->v, &b, kvd);
    MC_BUMP(s->lse_att, &b, (size_t)T * mc->H);
    MC_BUMP(s->rstd, &b, (size_t)T * mc->H);
    MC_BUMP(s->xa, &b, (size_t)T * R);
    MC_BUMP(s->rlogits, &b, (size_t)T * mc->E);
    MC_BUMP(s->probs, &b, (size_t)T * mc->E);
    MC_BUMP(s->val, &b, S);
    MC_BUMP(s->wt, &b, S);
    MC_BUMP(s->xg, &b, rows_ex * mc->D);
    MC_BUMP(s->yg, &b, rows_ex * mc->D);
    MC_BUMP(s->g, &b, rows_ex * mc->Fmax);
    MC_BUMP(s->u, &b, rows_ex * mc->Fmax);
    MC_BUMP(s->h, &b, rows_ex * mc->Fmax);
    MC_BUMP(s->xa_g, &b, rows_ex * R);
    MC_BUMP(s->xa_u, &b, rows_ex * R);
    MC_BUMP(s->xa_d, &b, rows_ex * R);
    MC_BUMP(s->hf, &b, TD);
    MC_BUMP(s->lse, &b, T);
    MC_BUMP(s->logp, &b, T);
    MC_BUMP(s->ent, &b, T);
    MC_BUMP(s->logits, &b, (size_t)mc_logits_rows(mc, T) * mc->V);
    return b.off;
}

int mc_block_ready(model_cuda_t *mc, void **mem, size_t *cap, size_t need) {
    if (need <= *cap)
        return MO_OK;
    if (*mem)
        mc->be->free(mc->be, *mem);
    *mem = NULL;
    *cap = 0;
    TRY(mc->be->alloc(mc->be, mem, need));
    *cap = need;
    return MO_OK;
}

int mc_plan_ready(const model_cuda_t *mc, moe_cuda_plan_t *plan, int *plan_T, int T) {
    if (mc->n_moe == 0)
        return MO_OK;
    if (plan->mem && T <= *plan_T) { /* the arrays hold T K slots: no new block */
        plan->T = T;
        return MO_OK;
    }
    moe_cuda_plan_free(plan);
    *plan_T = -1;
    TRY(moe_cuda_plan_alloc(plan, T, mc->K, mc->E));
    *plan_T = T;
    return MO_OK;
}

int mc_scratch_ready(model_cuda_t *mc, int T, int B) {
    TRY(mc_block_ready(mc, &mc->smem, &mc->scap, scratch_layout(mc, &mc->s, NULL, T, B)));
    scratch_layout(mc, &mc->s, mc->smem, T, B);
    return mc_plan_ready(mc, &mc->plan, &mc->plan_T, T);
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

/* The replayed experts (T, M, K) of b: each in [0, E), none twice for one token and layer
 * (router_replay's checks, MO_EMALFORMED). */
static int check_replay(const model_cuda_t *mc, const model_batch_t *b, const char *fn) {
    int M = mc->n_moe, K = mc->K;
    for (int t = 0; t < b->T; t++)
        for (int mi = 0; mi < M; mi++) {
            const uint16_t *row = b->replay + ((size_t)t * M + mi) * K;
            for (int i = 0; i < K; i++) {
                if (row[i] >= mc->E)
                    return mo_errorf(MO_EMALFORMED,
                                     "%s: routing replay of MoE layer %d: token %d slot %d names "
                                     "expert %d, outside [0, %d)",
                                     fn, mi, t, i, row[i], mc->E);
                for (int j = 0; j < i; j++)
                    if (row[j] == row[i])
                        return mo_errorf(MO_EMALFORMED,
                                         "%s: routing replay of MoE layer %d: token %d names "
                                         "expert %d twice (slots %d and %d)",
                                         fn, mi, t, row[i], j, i);
            }
        }
    return MO_OK;
}

int mc_check_batch(const model_cuda_t *mc, const model_batch_t *b, const float *logp,
                   const char *fn) {
    int V = mc->V;
    if (!b || b->T < 0 || b->B < 0 || !b->cu_seqlens ||
        (b->T > 0 && (!b->tokens || !b->positions || !b->targets || !logp)))
        return mo_errorf(MO_EINVAL,
                         "%s: a batch needs T >= 0, B >= 0, tokens, positions, cu_seqlens, "
                         "targets and a logp output",
                         fn);
    if (!(b->temperature > 0.0f) || !isfinite(b->temperature))
        return mo_errorf(MO_EINVAL, "%s: temperature %g must be finite and > 0", fn,
                         (double)b->temperature);
    if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->B] != b->T)
        return mo_errorf(MO_EINVAL, "%s: cu_seqlens must run from 0 to T = %d, got %d to %d", fn,
                         b->T, b->cu_seqlens[0], b->cu_seqlens[b->B]);
    for (int i = 0; i < b->B; i++)
        if (b->cu_seqlens[i + 1] < b->cu_seqlens[i])
            return mo_errorf(MO_EINVAL, "%s: cu_seqlens decreases at %d (%d > %d)", fn, i + 1,
                             b->cu_seqlens[i], b->cu_seqlens[i + 1]);
    for (int t = 0; t < b->T; t++) {
        if (b->tokens[t] < 0 || b->tokens[t] >= V)
            return mo_errorf(MO_EINVAL, "%s: token %d is id %d, outside [0, %d)", fn, t,
                             b->tokens[t], V);
        if (b->targets[t] < -1 || b->targets[t] >= V)
            return mo_errorf(MO_EINVAL, "%s: target %d is id %d, outside [-1, %d)", fn, t,
                             b->targets[t], V);
        if (b->positions[t] < 0)
            return mo_errorf(MO_EINVAL, "%s: position %d is %d, expected >= 0", fn, t,
                             b->positions[t]);
    }
    return b->replay ? check_replay(mc, b, fn) : MO_OK;
}

/* The staging address h of the device buffer p, the ids region starting at id->tok. */
static int32_t *staged(int32_t *h, const mc_ids_t *id, const int32_t *p) {
    return (int32_t *)((char *)h + ((const char *)p - (const char *)id->tok));
}

/* mc_ids_layout puts tok, pos, tgt, cu, off1 and route in this order: one copy fills them
 * (targets -1 as 0; route only with a replay). */
int mc_upload_batch(model_cuda_t *mc, const mc_ids_t *id, const model_batch_t *b, const char *fn) {
    int T = b->T, M = mc->n_moe, K = mc->K;
    const int32_t *end = b->replay ? id->route + (size_t)M * T * K : id->off1 + 2;
    size_t n = (size_t)((const char *)end - (const char *)id->tok);
    int32_t *h = calloc(1, n);
    if (!h)
        return mo_errorf(MO_ENOMEM, "%s: %zu bytes of staging", fn, n);
    int32_t *tgt = staged(h, id, id->tgt), *off1 = staged(h, id, id->off1);
    memcpy(staged(h, id, id->tok), b->tokens, sizeof(int32_t) * (size_t)T);
    memcpy(staged(h, id, id->pos), b->positions, sizeof(int32_t) * (size_t)T);
    memcpy(staged(h, id, id->cu), b->cu_seqlens, sizeof(int32_t) * (size_t)(b->B + 1));
    for (int t = 0; t < T; t++)
        tgt[t] = b->targets[t] >= 0 ? b->targets[t] : 0;
    off1[0] = 0;
    off1[1] = T;
    if (b->replay) { /* (T, M, K) u16 -> (M, T, K) int32 */
        int32_t *route = staged(h, id, id->route);
        for (int t = 0; t < T; t++)
            for (int mi = 0; mi < M; mi++)
                for (int j = 0; j < K; j++)
                    route[((size_t)mi * T + t) * K + j] = b->replay[((size_t)t * M + mi) * K + j];
    }
    int rc = mc->be->copy(mc->be, id->tok, DEV_CUDA, h, DEV_CPU, n);
    free(h);
    return rc;
}

/* out (T, OC) = inp (T, C) W^T, plus its adapter's term (xa (T, R) its input) when l. */
static int proj(const model_cuda_t *mc, float *out, float *xa, const float *inp, const wview_t *w,
                const moe_cuda_lora_t *l, int T, int C, int OC) {
    mc->be->k->matmul_forward(out, inp, w, NULL, T, C, OC);
    if (l && l->A)
        TRY(moe_cuda_lora_forward(out, xa, inp, l, mc->id->off1, 1, T, C, OC));
    return MO_OK;
}

/* qk (T, nh, Dh) = RoPE(norm(raw)) (norm skipped when w is NULL; rstd (T nh) its scales). */
static void norm_rope(const model_cuda_t *mc, float *qk, float *rstd, const float *raw,
                      const float *w, int T, int nh) {
    const kernels_t *k = mc->be->k;
    if (w)
        k->rmsnorm_forward(qk, rstd, raw, w, T * nh, mc->Dh, mc->m->eps);
    k->rope_forward(qk, w ? qk : raw, mc->id->pos, mc->inv_freq, mc->m->rope_mscale, T, nh, mc->Dh,
                    mc->Dh);
}

/* mc->s.o (T, D) = the attention block of layer l on rmsnorm(a->x): causal attention over
 * the packed sequences, or mc->attend's core (the decode step's paged cache). */
static int attention(model_cuda_t *mc, int l, const mc_acts_t *a, int T, int B, int ad) {
    const mc_layer_t *ly = &mc->layers[l];
    const kernels_t *k = mc->be->k;
    int D = mc->D, qd = mc->H * mc->Dh, kvd = mc->Hkv * mc->Dh;
    k->rmsnorm_forward(a->ln1, a->rstd1, a->x, ly->attn_norm, T, D, mc->m->eps);
    float *q = ly->q_norm ? a->q : a->qr, *kk = ly->k_norm ? a->k : a->kr;
    TRY(proj(mc, q, a->xa_q, a->ln1, &ly->wq, ad ? &ly->lq : NULL, T, D, qd));
    TRY(proj(mc, kk, a->xa_k, a->ln1, &ly->wk, ad ? &ly->lk : NULL, T, D, kvd));
    TRY(proj(mc, a->v, a->xa_v, a->ln1, &ly->wv, ad ? &ly->lv : NULL, T, D, kvd));
    norm_rope(mc, a->qr, a->rstd_q, q, ly->q_norm, T, mc->H);
    norm_rope(mc, a->kr, a->rstd_k, kk, ly->k_norm, T, mc->Hkv);
    if (mc->attend)
        TRY(mc->attend(mc, l, a, T));
    else
        k->attention_forward(a->att, a->lse, a->qr, a->kr, a->v, mc->id->cu, B, mc->H, mc->Hkv,
                             mc->Dh, mc->m->attn_scale, ly->window);
    return proj(mc, mc->s.o, a->xa_o, a->att, &ly->wo, ad ? &ly->lo : NULL, T, qd, D);
}

moe_cuda_experts_t mc_experts_of(const mc_layer_t *ly, int ad) {
    moe_cuda_experts_t w = ly->ex;
    if (!ad) {
        w.lora_gate.A = NULL;
        w.lora_up.A = NULL;
        w.lora_down.A = NULL;
    }
    return w;
}

moe_cuda_acts_t mc_expert_acts(const mc_acts_t *a, const moe_cuda_experts_t *w) {
    moe_cuda_acts_t e = {a->g,
                         a->u,
                         a->h,
                         w->lora_gate.A ? a->xa_g : NULL,
                         w->lora_up.A ? a->xa_u : NULL,
                         w->lora_down.A ? a->xa_d : NULL};
    return e;
}

/* mc->s.o (T, D) = the MoE layer on a->ln2: router logits -> softmax -> top-k (or the replayed
 * experts) -> weights -> dispatch -> experts -> combine. */
static int moe(model_cuda_t *mc, const mc_layer_t *ly, const mc_acts_t *a, int T, int ad) {
    const kernels_t *k = mc->be->k;
    const mc_scratch_t *s = &mc->s;
    int D = mc->D, E = mc->E, K = mc->K, S = T * K;
    k->matmul_forward(s->rlogits, a->ln2, &ly->router, NULL, T, D, E);
    k->softmax_forward(a->probs, s->rlogits, T, E);
    int32_t *idx = mc->id->route + (size_t)ly->moe_index * S; /* (T, K) */
    if (mc->replay)
        TRY(model_glue_take(s->val, a->probs, idx, T, E, K));
    else
        k->topk_forward(idx, s->val, a->probs, T, E, K);
    TRY(model_glue_topk_weights(a->wt, s->val, T, K, ly->norm_topk, ly->route_scale));
    TRY(moe_cuda_plan_build(mc->cur_plan, idx));
    TRY(moe_cuda_dispatch_forward(s->xg, a->ln2, mc->cur_plan, D));
    if (mc->ep) { /* expert parallelism: the rows go to their experts' ranks and back */
        TRY(mc_ep_experts_forward(mc, ly, a->yg, s->xg, mc->cur_plan->offsets, ad));
    } else {
        moe_cuda_experts_t w = mc_experts_of(ly, ad);
        moe_cuda_acts_t e = mc_expert_acts(a, &w);
        TRY(moe_cuda_experts_forward(a->yg, &e, s->xg, mc->cur_plan->offsets, E, S, &w, D, ly->F));
    }
    return moe_cuda_combine_forward(s->o, a->yg, a->wt, mc->cur_plan, D);
}

/* mc->s.o (T, D) = the dense SwiGLU MLP on a->ln2, as one expert owning every row. */
static int dense(const model_cuda_t *mc, const mc_layer_t *ly, const mc_acts_t *a, int T, int ad) {
    moe_cuda_experts_t w = mc_experts_of(ly, ad);
    moe_cuda_acts_t e = mc_expert_acts(a, &w);
    return moe_cuda_experts_forward(mc->s.o, &e, a->ln2, mc->id->off1, 1, T, &w, mc->D, ly->F);
}

int mc_layer_forward(model_cuda_t *mc, int l, const mc_acts_t *a, int T, int B, int ad) {
    const mc_layer_t *ly = &mc->layers[l];
    size_t TD = (size_t)T * mc->D;
    TRY(attention(mc, l, a, T, B, ad));
    TRY(model_glue_add(a->h1, a->x, mc->s.o, TD));
    mc->be->k->rmsnorm_forward(a->ln2, a->rstd2, a->h1, ly->mlp_norm, T, mc->D, mc->m->eps);
    TRY(ly->moe ? moe(mc, ly, a, T, ad) : dense(mc, ly, a, T, ad));
    return model_glue_add(a->out, a->h1, mc->s.o, TD);
}

void mc_head_forward(const model_cuda_t *mc, float *hf, float *rstd, float *lse, float *logp,
                     float *ent, const float *x, int T, float temperature) {
    const kernels_t *k = mc->be->k;
    int D = mc->D, V = mc->V, rows = mc_logits_rows(mc, T);
    k->rmsnorm_forward(hf, rstd, x, mc->final_norm, T, D, mc->m->eps);
    for (int r0 = 0; r0 < T; r0 += rows) {
        int n = T - r0 < rows ? T - r0 : rows;
        k->matmul_forward(mc->s.logits, hf + (size_t)r0 * D, &mc->lm_head, NULL, n, D, V);
        k->logprob_forward(logp + r0, ent + r0, lse + r0, mc->s.logits, mc->id->tgt + r0, n, V,
                           temperature);
    }
}

mc_acts_t mc_scoring_acts(const mc_scratch_t *s) {
    mc_acts_t a;
    memset(&a, 0, sizeof a);
    a.x = s->x;
    a.out = s->x;
    a.ln1 = a.ln2 = s->ln;
    a.rstd1 = a.rstd2 = a.rstd_q = a.rstd_k = s->rstd;
    a.q = s->q;
    a.k = s->k;
    a.qr = s->qr;
    a.kr = s->kr;
    a.v = s->v;
    a.att = s->att;
    a.lse = s->lse_att;
    a.xa_q = a.xa_k = a.xa_v = a.xa_o = s->xa;
    a.h1 = s->h1;
    a.probs = s->probs;
    a.wt = s->wt;
    a.yg = s->yg;
    a.g = s->g;
    a.u = s->u;
    a.h = s->h;
    a.xa_g = s->xa_g;
    a.xa_u = s->xa_u;
    a.xa_d = s->xa_d;
    return a;
}

static int run(model_cuda_t *mc, const model_batch_t *b, int ad) {
    int T = b->T;
    mc->replay = b->replay != NULL;
    TRY(mc_scratch_ready(mc, T, b->B));
    mc->id = &mc->s.id;
    mc->cur_plan = &mc->plan;
    TRY(mc_upload_batch(mc, mc->id, b, "model_cuda_logprobs"));
    const mc_scratch_t *s = &mc->s;
    mc->be->k->embedding_forward(s->x, s->id.tok, &mc->embed, T, mc->D);
    mc_acts_t a = mc_scoring_acts(s);
    for (int l = 0; l < mc->L; l++) {
        int rc = mc_layer_forward(mc, l, &a, T, b->B, ad);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
    }
    mc_head_forward(mc, s->hf, s->rstd, s->lse, s->logp, s->ent, s->x, T, b->temperature);
    return mc->be->synchronize(mc->be);
}

int mc_fail(model_cuda_t *mc, int rc, const char *fn) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mo_last_error());
    mc->be->synchronize(mc->be);
    return mo_errorf(rc, "%s: %s", fn, msg);
}

int mc_routing_out(model_cuda_t *mc, const int32_t *route, const model_batch_t *b, const char *fn) {
    int T = b->T, M = mc->n_moe, K = mc->K;
    size_t n = (size_t)M * T * K;
    if (n == 0)
        return MO_OK;
    int32_t *h = malloc(n * sizeof *h);
    if (!h)
        return mo_errorf(MO_ENOMEM, "%s: %zu bytes of routing", fn, n * sizeof *h);
    int rc = mc->be->copy(mc->be, h, DEV_CPU, route, DEV_CUDA, n * sizeof *h);
    if (rc == MO_OK)
        for (int mi = 0; mi < M; mi++)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < K; j++)
                    b->routing[((size_t)t * M + mi) * K + j] =
                        (uint16_t)h[((size_t)mi * T + t) * K + j];
    free(h);
    return rc < 0 ? mc_fail(mc, rc, fn) : MO_OK;
}

int mc_check_use_adapter(const model_cuda_t *mc, int use_adapter, const char *fn) {
    if (use_adapter != 0 && use_adapter != 1)
        return mo_errorf(MO_EINVAL, "%s: use_adapter %d must be 0 or 1", fn, use_adapter);
    if (use_adapter && mc->R == 0)
        return mo_errorf(MO_EINVAL,
                         "%s: use_adapter = 1 but the upload holds no adapter (bind "
                         "one with model_set_adapter before model_cuda_upload)",
                         fn);
    return MO_OK;
}

int mc_results_out(model_cuda_t *mc, const model_batch_t *b, float *logp, float *entropy,
                   const int32_t *route, const char *fn) {
    const backend_t *be = mc->be;
    size_t bytes = sizeof(float) * (size_t)b->T;
    int rc = be->copy(be, logp, DEV_CPU, mc->s.logp, DEV_CUDA, bytes);
    if (rc == MO_OK && entropy)
        rc = be->copy(be, entropy, DEV_CPU, mc->s.ent, DEV_CUDA, bytes);
    if (rc < 0)
        return mc_fail(mc, rc, fn);
    if (b->routing)
        TRY(mc_routing_out(mc, route, b, fn));
    for (int t = 0; t < b->T; t++)
        if (b->targets[t] < 0)
            logp[t] = 0.0f;
    return MO_OK;
}

int model_cuda_logprobs(model_cuda_t *mc, const model_batch_t *b, float *logp, float *entropy,
                        int use_adapter) {
    static const char fn[] = "model_cuda_logprobs";
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    TRY(mc_check_batch(mc, b, logp, fn));
    TRY(mc_check_use_adapter(mc, use_adapter, fn));
    int T = b->T;
    int rc = MO_OK;
    if (T > 0)
        rc = run(mc, b, use_adapter);
    else if (mc->ep) /* no tokens: this rank still serves its experts */
        rc = mc_ep_empty_forward(mc, use_adapter);
    if (rc < 0)
        return mc_fail(mc, rc, fn);
    if (T == 0)
        return MO_OK;
    return mc_results_out(mc, b, logp, entropy, mc->s.id.route, fn);
}

#endif /* MOERL_HAVE_CUDA */
