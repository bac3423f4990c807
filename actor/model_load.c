/* model_load: building a model_t from a Hugging Face checkpoint (tensor names, shapes,
 * views into the mapping), its adapter module list, and adapter binding. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/model.h"
#include "core/backend.h"
#include "core/status.h"

#define NAME_CAP 256

static void tname(char *buf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tname(char *buf, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, NAME_CAP, fmt, ap);
    va_end(ap);
}

static int push_scale(model_t *m, float *scale) {
    if (!scale)
        return MO_OK;
    if (m->n_scales == m->cap_scales) {
        int cap = m->cap_scales ? 2 * m->cap_scales : 16;
        float **s = realloc(m->scales, sizeof *s * (size_t)cap);
        if (!s) {
            free(scale);
            return mo_errorf(MO_ENOMEM, "model: out of memory for weight scales");
        }
        m->scales = s;
        m->cap_scales = cap;
    }
    m->scales[m->n_scales++] = scale;
    return MO_OK;
}

/* A frozen matrix (rows, cols) as a view into the checkpoint. */
static int load_matrix(model_t *m, const char *name, int64_t rows, int64_t cols, wview_t *w) {
    if (st_checkpoint_find(m->ck, name) < 0)
        return mo_errorf(MO_ENOTFOUND, "%s: tensor \"%s\" is missing (expected shape (%lld, %lld))",
                         m->path, name, (long long)rows, (long long)cols);
    tensor_t t;
    float *scale = NULL;
    int rc = st_checkpoint_weight(m->ck, name, m->cfg.fp8_block, &t, w, &scale);
    if (rc < 0)
        return mo_error_wrap(rc, "%s: tensor \"%s\"", m->path, name);
    TRY(push_scale(m, scale));
    if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols) {
        char got[96];
        tensor_shape_str(&t, got, sizeof got);
        return mo_errorf(MO_EMALFORMED, "%s: tensor \"%s\" has shape %s, expected (%lld, %lld)",
                         m->path, name, got, (long long)rows, (long long)cols);
    }
    return MO_OK;
}

/* A small vector (n) converted to f32 into dst. */
static int load_vector(model_t *m, const char *name, int64_t n, float *dst) {
    if (st_checkpoint_find(m->ck, name) < 0)
        return mo_errorf(MO_ENOTFOUND, "%s: tensor \"%s\" is missing (expected shape (%lld))",
                         m->path, name, (long long)n);
    tensor_t t;
    TRY(st_checkpoint_get(m->ck, name, &t));
    if (t.ndim != 1 || t.shape[0] != n) {
        char got[96];
        tensor_shape_str(&t, got, sizeof got);
        return mo_errorf(MO_EMALFORMED, "%s: tensor \"%s\" has shape %s, expected (%lld)", m->path,
                         name, got, (long long)n);
    }
    if (!dtype_is_float(t.dtype) || t.dtype == DT_F64)
        return mo_errorf(MO_EMALFORMED, "%s: tensor \"%s\" has dtype %s, expected a float type",
                         m->path, name, dtype_name(t.dtype));
    convert_to_f32(dst, t.data, t.dtype, (size_t)n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(dst[i]))
            return mo_errorf(MO_EMALFORMED, "%s: tensor \"%s\" holds a non-finite value at %lld",
                             m->path, name, (long long)i);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Layers.                                                                   */

/* Floats of f32 vectors the model keeps. */
static size_t vec_floats(const model_config_t *c) {
    size_t D = (size_t)c->hidden_size, per = 2 * D;
    if (c->arch == ARCH_QWEN3_MOE)
        per += 2 * (size_t)c->head_dim;
    if (c->arch == ARCH_DEEPSEEK_V3) /* q_a_layernorm, kv_a_layernorm */
        per += (size_t)c->q_lora_rank + (size_t)c->kv_lora_rank;
    if (c->scoring_func == SCORE_SIGMOID)
        per += (size_t)c->num_experts;
    return per * (size_t)c->num_hidden_layers + D + (size_t)c->head_dim / 2;
}

/* The router configuration of the model's MoE layers. */
static void router_of(router_cfg_t *r, const model_config_t *c, const float *bias) {
    int norm = c->norm_topk_prob;
    float rsf = (float)c->routed_scaling_factor;
    if (c->scoring_func == SCORE_SIGMOID) {
        router_cfg_init(r, ROUTER_SIGMOID_GROUPED, c->num_experts, c->num_experts_per_tok);
        r->routed_scaling_factor = rsf;
        r->e_score_correction_bias = bias;
    } else {
        router_kind_t kind = c->topk_method == TOPK_GROUP_LIMITED_GREEDY ? ROUTER_SOFTMAX_GROUPED
                                                                         : ROUTER_SOFTMAX_TOPK;
        router_cfg_init(r, kind, c->num_experts, c->num_experts_per_tok);
        r->routed_scaling_factor = norm ? 1.0f : rsf; /* scaled only when not renormalised */
    }
    r->norm_topk_prob = norm;
    if (r->kind != ROUTER_SOFTMAX_TOPK) {
        r->n_group = c->n_group;
        r->topk_group = c->topk_group;
    }
}

/* ------------------------------------------------------------------------ */
/* MLA attention (DeepSeek-V3 / Kimi K2).                                    */

/* Layer l's self_attn.<what>.weight (n) copied to *vec, which *dst then points at. */
static int load_mla_norm(model_t *m, const float **dst, int l, const char *what, int64_t n,
                         float **vec) {
    char name[NAME_CAP];
    tname(name, "model.layers.%d.self_attn.%s.weight", l, what);
    TRY(load_vector(m, name, n, *vec));
    *dst = *vec;
    *vec += n;
    return MO_OK;
}

static int load_mla(model_t *m, mla_weights_t *w, int l, float **vec) {
    const mla_cfg_t *c = &m->mla_cfg;
    int64_t D = m->D, H = c->H, qo = H * c->qd;
    char n[NAME_CAP];
    if (c->q_rank > 0) {
        tname(n, "model.layers.%d.self_attn.q_a_proj.weight", l);
        TRY(load_matrix(m, n, c->q_rank, D, &w->q_a));
        TRY(load_mla_norm(m, &w->q_a_norm, l, "q_a_layernorm", c->q_rank, vec));
        tname(n, "model.layers.%d.self_attn.q_b_proj.weight", l);
        TRY(load_matrix(m, n, qo, c->q_rank, &w->q_b));
    } else {
        tname(n, "model.layers.%d.self_attn.q_proj.weight", l);
        TRY(load_matrix(m, n, qo, D, &w->q));
    }
    tname(n, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
    TRY(load_matrix(m, n, (int64_t)c->kv_rank + c->rope, D, &w->kv_a));
    TRY(load_mla_norm(m, &w->kv_a_norm, l, "kv_a_layernorm", c->kv_rank, vec));
    tname(n, "model.layers.%d.self_attn.kv_b_proj.weight", l);
    TRY(load_matrix(m, n, H * (c->nope + c->vd), c->kv_rank, &w->kv_b));
    tname(n, "model.layers.%d.self_attn.o_proj.weight", l);
    return load_matrix(m, n, D, H * c->vd, &w->o);
}

/* ------------------------------------------------------------------------ */
/* GQA attention and feed-forward.                                           */

/* q, k, v, o projections (and Qwen3's q/k norms) of a GQA layer. */
static int load_gqa(model_t *m, model_layer_t *ly, int l, float **vec) {
    char n[NAME_CAP];
    int64_t D = m->D, qd = (int64_t)m->H * m->Dh, kvd = (int64_t)m->Hkv * m->Dh;
    tname(n, "model.layers.%d.self_attn.q_proj.weight", l);
    TRY(load_matrix(m, n, qd, D, &ly->wq));
    tname(n, "model.layers.%d.self_attn.k_proj.weight", l);
    TRY(load_matrix(m, n, kvd, D, &ly->wk));
    tname(n, "model.layers.%d.self_attn.v_proj.weight", l);
    TRY(load_matrix(m, n, kvd, D, &ly->wv));
    tname(n, "model.layers.%d.self_attn.o_proj.weight", l);
    TRY(load_matrix(m, n, D, qd, &ly->wo));
    if (m->cfg.arch == ARCH_QWEN3_MOE) {
        tname(n, "model.layers.%d.self_attn.q_norm.weight", l);
        TRY(load_vector(m, n, m->Dh, *vec));
        ly->q_norm = *vec;
        *vec += m->Dh;
        tname(n, "model.layers.%d.self_attn.k_norm.weight", l);
        TRY(load_vector(m, n, m->Dh, *vec));
        ly->k_norm = *vec;
        *vec += m->Dh;
    }
    return MO_OK;
}

static int load_attention(model_t *m, model_layer_t *ly, int l, float **vec) {
    char n[NAME_CAP];
    int64_t D = m->D;
    tname(n, "model.layers.%d.input_layernorm.weight", l);
    TRY(load_vector(m, n, D, *vec));
    ly->attn_norm = *vec;
    *vec += D;
    TRY(m->mla ? load_mla(m, &ly->mla, l, vec) : load_gqa(m, ly, l, vec));
    tname(n, "model.layers.%d.post_attention_layernorm.weight", l);
    TRY(load_vector(m, n, D, *vec));
    ly->mlp_norm = *vec;
    *vec += D;
    return MO_OK;
}

/* gate, up, down of an MLP at prefix ("model.layers.3.mlp.") with hidden width F. */
static int load_mlp(model_t *m, mlp_weights_t *w, const char *prefix, int64_t F) {
    char n[NAME_CAP];
    tname(n, "%sgate_proj.weight", prefix);
    TRY(load_matrix(m, n, F, m->D, &w->gate));
    tname(n, "%sup_proj.weight", prefix);
    TRY(load_matrix(m, n, F, m->D, &w->up));
    tname(n, "%sdown_proj.weight", prefix);
    TRY(load_matrix(m, n, m->D, F, &w->down));
    return MO_OK;
}

/* Routed expert e's gate, up, down (Mixtral: w1, w3, w2). */
static int load_expert(model_t *m, model_layer_t *ly, int l, int e) {
    static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char *const mx[3] = {"w1", "w3", "w2"};
    int mixtral = m->cfg.arch == ARCH_MIXTRAL;
    int64_t F = m->cfg.moe_intermediate_size, D = m->D;
    for (int p = 0; p < 3; p++) {
        char n[NAME_CAP];
        if (mixtral)
            tname(n, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l, e, mx[p]);
        else
            tname(n, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, hf[p]);
        TRY(load_matrix(m, n, p == 2 ? D : F, p == 2 ? F : D, &ly->experts[(size_t)p * m->E + e]));
    }
    return MO_OK;
}

static int load_moe(model_t *m, model_layer_t *ly, int l, float **vec, wview_t *views,
                    const lora_pair_t **slots) {
    const model_config_t *c = &m->cfg;
    const char *blk = c->arch == ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    char n[NAME_CAP];
    int E = m->E;
    ly->experts = views;
    ly->expert_lora = slots;
    tname(n, "model.layers.%d.%s.gate.weight", l, blk);
    TRY(load_matrix(m, n, E, m->D, &ly->moe_w.router));
    if (c->scoring_func == SCORE_SIGMOID) {
        tname(n, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        TRY(load_vector(m, n, E, *vec));
        ly->e_bias = *vec;
        *vec += E;
    }
    for (int e = 0; e < E; e++)
        TRY(load_expert(m, ly, l, e));
    ly->moe_w.gate = views;
    ly->moe_w.up = views + E;
    ly->moe_w.down = views + 2 * (size_t)E;
    ly->moe_w.lora_gate = (const lora_pair_t *const *)slots;
    ly->moe_w.lora_up = (const lora_pair_t *const *)(slots + E);
    ly->moe_w.lora_down = (const lora_pair_t *const *)(slots + 2 * (size_t)E);
    ly->moe_cfg.D = m->D;
    ly->moe_cfg.F = c->moe_intermediate_size;
    ly->moe_cfg.n_shared = c->n_shared_experts;
    ly->moe_cfg.aux_coef = m->opts.aux_coef;
    router_of(&ly->moe_cfg.router, c, ly->e_bias);
    if (c->n_shared_experts > 0) {
        tname(n, "model.layers.%d.mlp.shared_experts.", l);
        TRY(load_mlp(m, &ly->moe_w.shared, n,
                     (int64_t)c->n_shared_experts * c->moe_intermediate_size));
    }
    return moe_cfg_check(&ly->moe_cfg) < 0 ? mo_error_wrap(MO_ECONFIG, "%s: layer %d", m->path, l)
                                           : MO_OK;
}

static int load_layers(model_t *m) {
    const model_config_t *c = &m->cfg;
    size_t per = 3 * (size_t)m->E;
    m->layers = calloc((size_t)m->L, sizeof *m->layers);
    m->vecs = malloc(sizeof(float) * vec_floats(c));
    m->views = calloc(per * (size_t)(m->n_moe ? m->n_moe : 1), sizeof *m->views);
    m->lora_ptrs = calloc(per * (size_t)(m->n_moe ? m->n_moe : 1), sizeof *m->lora_ptrs);
    if (!m->layers || !m->vecs || !m->views || !m->lora_ptrs)
        return mo_errorf(MO_ENOMEM, "model: out of memory for %d layers", m->L);
    float *vec = m->vecs;
    int mi = 0;
    for (int l = 0; l < m->L; l++) {
        model_layer_t *ly = &m->layers[l];
        ly->window = model_config_window(c, l);
        ly->moe = model_config_is_moe_layer(c, l);
        ly->moe_index = ly->moe ? mi : -1;
        TRY(load_attention(m, ly, l, &vec));
        if (ly->moe) {
            TRY(load_moe(m, ly, l, &vec, m->views + per * mi, m->lora_ptrs + per * mi));
            mi++;
        } else {
            char n[NAME_CAP];
            tname(n, "model.layers.%d.mlp.", l);
            TRY(load_mlp(m, &ly->dense, n, c->intermediate_size));
        }
    }
    TRY(load_vector(m, "model.norm.weight", m->D, vec));
    m->final_norm = vec;
    vec += m->D;
    m->inv_freq = vec;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Adapter modules.                                                          */

typedef struct mod_builder {
    model_t *m;
    int n;
} mod_builder_t;

static int add_module(mod_builder_t *b, const char *name, const char *proj, lora_kind_t kind, int C,
                      int OC, const lora_pair_t **slot) {
    lora_module_desc_t *d = &b->m->modules[b->n];
    char *s = malloc(strlen(name) + 1);
    if (!s)
        return mo_errorf(MO_ENOMEM, "model: out of memory for module names");
    strcpy(s, name);
    d->name = s;
    d->proj = proj;
    d->kind = kind;
    d->C = C;
    d->OC = OC;
    b->m->module_slot[b->n++] = slot;
    return MO_OK;
}

/* Adapter modules of an MLA layer, in mla_weights_t's order. */
static int add_mla_modules(mod_builder_t *b, int l) {
    const mla_cfg_t *c = &b->m->mla_cfg;
    mla_weights_t *w = &b->m->layers[l].mla;
    int D = c->D, qo = c->H * c->qd;
    const char *proj[6] = {"q_a_proj",           "q_b_proj",  "q_proj",
                           "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
    const int C[6] = {D, c->q_rank, D, D, c->kv_rank, c->H * c->vd};
    const int OC[6] = {c->q_rank, qo, qo, c->kv_rank + c->rope, c->H * (c->nope + c->vd), D};
    const lora_pair_t **slot[6] = {&w->lora_q_a,  &w->lora_q_b,  &w->lora_q,
                                   &w->lora_kv_a, &w->lora_kv_b, &w->lora_o};
    for (int p = 0; p < 6; p++) {
        if ((p < 2 && c->q_rank == 0) || (p == 2 && c->q_rank > 0))
            continue;
        char n[NAME_CAP];
        tname(n, "model.layers.%d.self_attn.%s", l, proj[p]);
        TRY(add_module(b, n, proj[p], LORA_KIND_ATTENTION, C[p], OC[p], slot[p]));
    }
    return MO_OK;
}

/* Attention modules per layer. */
static int attention_modules(const model_t *m) {
    return m->mla ? (m->mla_cfg.q_rank > 0 ? 5 : 4) : 4;
}

/* gate, up, down of an MLP (F wide) under prefix; names[] the checkpoint's spelling. */
static int add_mlp_modules(mod_builder_t *b, const char *prefix, const char *const names[3],
                           lora_kind_t kind, int F, const lora_pair_t **gate,
                           const lora_pair_t **up, const lora_pair_t **down) {
    static const char *const canon[3] = {"gate_proj", "up_proj", "down_proj"};
    const lora_pair_t **slots[3] = {gate, up, down};
    int D = b->m->D;
    for (int p = 0; p < 3; p++) {
        char n[NAME_CAP];
        tname(n, "%s%s", prefix, names[p]);
        TRY(add_module(b, n, canon[p], kind, p == 2 ? F : D, p == 2 ? D : F, slots[p]));
    }
    return MO_OK;
}

static int add_layer_modules(mod_builder_t *b, int l) {
    static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char *const mx[3] = {"w1", "w3", "w2"};
    static const char *const attn[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    model_t *m = b->m;
    model_layer_t *ly = &m->layers[l];
    int qd = m->H * m->Dh, kvd = m->Hkv * m->Dh;
    const int C[4] = {m->D, m->D, m->D, qd}, OC[4] = {qd, kvd, kvd, m->D};
    const lora_pair_t **aslot[4] = {&ly->lora_q, &ly->lora_k, &ly->lora_v, &ly->lora_o};
    char n[NAME_CAP];
    if (m->mla)
        TRY(add_mla_modules(b, l));
    for (int p = 0; p < 4 && !m->mla; p++) {
        tname(n, "model.layers.%d.self_attn.%s", l, attn[p]);
        TRY(add_module(b, n, attn[p], LORA_KIND_ATTENTION, C[p], OC[p], aslot[p]));
    }
    if (!ly->moe) {
        tname(n, "model.layers.%d.mlp.", l);
        return add_mlp_modules(b, n, hf, LORA_KIND_DENSE_MLP, m->cfg.intermediate_size,
                               &ly->dense.lora_gate, &ly->dense.lora_up, &ly->dense.lora_down);
    }
    int mixtral = m->cfg.arch == ARCH_MIXTRAL, E = m->E;
    for (int e = 0; e < E; e++) {
        if (mixtral)
            tname(n, "model.layers.%d.block_sparse_moe.experts.%d.", l, e);
        else
            tname(n, "model.layers.%d.mlp.experts.%d.", l, e);
        TRY(add_mlp_modules(b, n, mixtral ? mx : hf, LORA_KIND_EXPERT, ly->moe_cfg.F,
                            &ly->expert_lora[e], &ly->expert_lora[E + e],
                            &ly->expert_lora[2 * (size_t)E + e]));
    }
    if (ly->moe_cfg.n_shared > 0) {
        tname(n, "model.layers.%d.mlp.shared_experts.", l);
        TRY(add_mlp_modules(b, n, hf, LORA_KIND_SHARED_EXPERT, ly->moe_cfg.n_shared * ly->moe_cfg.F,
                            &ly->moe_w.shared.lora_gate, &ly->moe_w.shared.lora_up,
                            &ly->moe_w.shared.lora_down));
    }
    return MO_OK;
}

static int build_modules(model_t *m) {
    size_t n = 0;
    for (int l = 0; l < m->L; l++) {
        const model_layer_t *ly = &m->layers[l];
        n += (size_t)attention_modules(m) +
             3 * (size_t)(ly->moe ? m->E + (ly->moe_cfg.n_shared > 0) : 1);
    }
    m->modules = calloc(n, sizeof *m->modules);
    m->module_slot = calloc(n, sizeof *m->module_slot);
    m->pairs = calloc(n, sizeof *m->pairs);
    if (!m->modules || !m->module_slot || !m->pairs)
        return mo_errorf(MO_ENOMEM, "model: out of memory for %zu adapter modules", n);
    mod_builder_t b = {m, 0};
    for (int l = 0; l < m->L; l++) {
        int rc = add_layer_modules(&b, l);
        m->n_modules = b.n;
        TRY(rc);
    }
    MO_ASSERT((size_t)b.n == n);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Weights an adapter may train in full (model_adapter_add_full).           */

/* One such weight: where the model reads it and its gradient, and its frozen value. */
struct model_full {
    char name[NAME_CAP]; /* Hugging Face parameter name */
    int router;          /* 1: a router (rows, cols) = (E, D); 0: a norm vector (n, 1) */
    int rows, cols;
    const float **w;   /* the norm's weight pointer (norms) */
    wview_t *view;     /* the router's view (router) */
    float **dw;        /* where its gradient pointer goes */
    const float *base; /* frozen norm */
    wview_t base_view; /* frozen router */
};

static void full_add(struct model_full *f, int *n, const char *name, const float **w, float **dw,
                     int rows) {
    struct model_full *x = &f[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->name, NAME_CAP, "%s", name);
    x->rows = rows;
    x->cols = 1;
    x->w = w;
    x->dw = dw;
    x->base = *w;
}

/* m->full: every norm vector and router of the model, with the frozen values. */
static int full_table(model_t *m) {
    if (m->full)
        return MO_OK;
    int cap = 7 * m->L + 1, n = 0;
    struct model_full *f = calloc((size_t)cap, sizeof *f);
    if (!f)
        return mo_errorf(MO_ENOMEM, "model %s: out of memory", m->path);
    char nm[NAME_CAP];
    const char *blk = m->cfg.arch == ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    for (int l = 0; l < m->L; l++) {
        model_layer_t *ly = &m->layers[l];
        tname(nm, "model.layers.%d.input_layernorm.weight", l);
        full_add(f, &n, nm, &ly->attn_norm, &ly->d_attn_norm, m->D);
        if (ly->q_norm) {
            tname(nm, "model.layers.%d.self_attn.q_norm.weight", l);
            full_add(f, &n, nm, &ly->q_norm, &ly->d_q_norm, m->Dh);
            tname(nm, "model.layers.%d.self_attn.k_norm.weight", l);
            full_add(f, &n, nm, &ly->k_norm, &ly->d_k_norm, m->Dh);
        }
        if (m->mla && ly->mla.q_a_norm) {
            tname(nm, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
            full_add(f, &n, nm, &ly->mla.q_a_norm, &ly->mla.d_q_a_norm, m->mla_cfg.q_rank);
        }
        if (m->mla) {
            tname(nm, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
            full_add(f, &n, nm, &ly->mla.kv_a_norm, &ly->mla.d_kv_a_norm, m->mla_cfg.kv_rank);
        }
        tname(nm, "model.layers.%d.post_attention_layernorm.weight", l);
        full_add(f, &n, nm, &ly->mlp_norm, &ly->d_mlp_norm, m->D);
        if (ly->moe) {
            struct model_full *x = &f[n++];
            tname(x->name, "model.layers.%d.%s.gate.weight", l, blk);
            x->router = 1;
            x->rows = m->E;
            x->cols = m->D;
            x->view = &ly->moe_w.router;
            x->dw = &ly->moe_w.drouter;
            x->base_view = ly->moe_w.router;
        }
    }
    full_add(f, &n, "model.norm.weight", &m->final_norm, &m->d_final_norm, m->D);
    m->full = f;
    m->n_full = n;
    return MO_OK;
}

/* Every full weight back to its frozen value, no gradient. */
static void full_unbind(model_t *m) {
    for (int i = 0; i < m->n_full; i++) {
        struct model_full *x = &m->full[i];
        if (x->router)
            *x->view = x->base_view;
        else
            *x->w = x->base;
        *x->dw = NULL;
    }
}

static struct model_full *full_find(model_t *m, const char *name) {
    for (int i = 0; i < m->n_full; i++)
        if (strcmp(m->full[i].name, name) == 0)
            return &m->full[i];
    return NULL;
}

/* Binds ad's full tensors (the LoRA pairs are bound). */
static int full_bind(model_t *m, const lora_adapter_t *ad) {
    if (ad->n_full == 0)
        return MO_OK;
    TRY(full_table(m));
    for (int t = ad->n_tensors - ad->n_full; t < ad->n_tensors; t++) {
        const lora_tensor_t *lt = &ad->tensors[t];
        struct model_full *x = full_find(m, lt->name);
        if (!x)
            return mo_errorf(MO_EINVAL,
                             "adapter full tensor \"%s\" is not a trainable weight of "
                             "this model",
                             lt->name);
        if (lt->shape[0] != x->rows || lt->shape[1] != x->cols)
            return mo_errorf(MO_EINVAL,
                             "adapter full tensor \"%s\" is (%lld, %lld), the model's "
                             "weight is (%d, %d)",
                             lt->name, (long long)lt->shape[0], (long long)lt->shape[1], x->rows,
                             x->cols);
        const float *w = ad->params + lt->offset;
        if (x->router)
            *x->view = wview_f32(w);
        else
            *x->w = w;
        *x->dw = ad->grads ? ad->grads + lt->offset : NULL;
    }
    return MO_OK;
}

int model_adapter_add_full(model_t *m, lora_adapter_t *ad, int router, int norms) {
    if (router && m->n_moe == 0)
        return mo_errorf(MO_EINVAL, "model %s: a trainable router needs MoE layers, it has none",
                         m->path);
    TRY(full_table(m));
    float *buf = NULL;
    int rc = MO_OK;
    for (int i = 0; i < m->n_full && rc == MO_OK; i++) {
        const struct model_full *x = &m->full[i];
        if (x->router ? !router : !norms)
            continue;
        if (!x->router) {
            rc = lora_adapter_add_full(ad, x->name, x->rows, 1, x->base);
            continue;
        }
        if (x->base_view.scale) {
            rc = mo_errorf(MO_EINVAL,
                           "model %s: router \"%s\" is stored with fp8 block scales; "
                           "it cannot be trained in full",
                           m->path, x->name);
            break;
        }
        size_t n = (size_t)x->rows * x->cols;
        if (!buf && !(buf = malloc(n * sizeof *buf))) {
            rc = mo_errorf(MO_ENOMEM, "model %s: out of memory", m->path);
            break;
        }
        convert_to_f32(buf, x->base_view.data, x->base_view.dtype, n);
        rc = lora_adapter_add_full(ad, x->name, x->rows, x->cols, buf);
    }
    free(buf);
    return rc;
}

int model_set_adapter(model_t *m, const lora_adapter_t *ad) {
    for (int i = 0; i < m->n_modules; i++)
        *m->module_slot[i] = NULL;
    full_unbind(m);
    m->adapter = NULL;
    m->step = NULL;
    if (!ad)
        return MO_OK;
    unsigned char *used = calloc((size_t)ad->n_entries + 1, 1);
    if (!used)
        return mo_errorf(MO_ENOMEM, "model: out of memory binding an adapter");
    int rc = MO_OK, matched = 0;
    for (int i = 0; i < m->n_modules && rc == MO_OK; i++) {
        const lora_module_desc_t *d = &m->modules[i];
        int e = lora_adapter_find(ad, d->name);
        if (e < 0)
            continue;
        const lora_entry_t *en = &ad->entries[e];
        if (en->C != d->C || en->OC != d->OC) {
            rc = mo_errorf(MO_EINVAL,
                           "adapter module \"%s\" is (out %d, in %d), the model's projection is "
                           "(out %d, in %d)",
                           d->name, en->OC, en->C, d->OC, d->C);
            break;
        }
        m->pairs[i] = lora_adapter_pair(ad, e, 1);
        *m->module_slot[i] = &m->pairs[i];
        used[e] = 1;
        matched++;
    }
    for (int e = 0; rc == MO_OK && matched < ad->n_entries && e < ad->n_entries; e++)
        if (!used[e])
            rc = mo_errorf(MO_EINVAL, "adapter module \"%s\" is not a projection of this model",
                           ad->entries[e].name);
    free(used);
    if (rc == MO_OK)
        rc = full_bind(m, ad);
    if (rc < 0) {
        for (int i = 0; i < m->n_modules; i++)
            *m->module_slot[i] = NULL;
        full_unbind(m);
        return rc;
    }
    m->adapter = ad;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Open and destroy.                                                         */

static int check_config(const model_config_t *c, const char *where) {
    TRY(model_config_validate(c, where));
    if (c->vocab_size > INT32_MAX / 2)
        return mo_errorf(MO_EUNSUPPORTED, "%s: vocab_size %lld is too large", where,
                         (long long)c->vocab_size);
    if (c->num_experts > 65536)
        return mo_errorf(MO_EUNSUPPORTED,
                         "%s: %d experts exceed the 65536 that routing records (uint16) hold",
                         where, c->num_experts);
    return MO_OK;
}

static int open_weights(model_t *m) {
    const model_config_t *c = &m->cfg;
    m->L = c->num_hidden_layers;
    m->D = c->hidden_size;
    m->H = c->num_attention_heads;
    m->Hkv = c->num_key_value_heads;
    m->Dh = c->head_dim;
    m->E = c->num_experts;
    m->K = c->num_experts_per_tok;
    m->V = (int)c->vocab_size;
    m->eps = (float)c->rms_norm_eps;
    m->attn_scale = 1.0f / sqrtf((float)m->Dh);
    m->mla = c->arch == ARCH_DEEPSEEK_V3;
    if (m->mla) {
        int rc = mla_cfg_init(&m->mla_cfg, c);
        if (rc < 0)
            return mo_error_wrap(rc, "%s", m->path);
        m->attn_scale = m->mla_cfg.scale;
    }
    for (int l = 0; l < m->L; l++)
        m->n_moe += model_config_is_moe_layer(c, l);
    TRY(load_matrix(m, "model.embed_tokens.weight", m->V, m->D, &m->embed));
    if (c->tie_word_embeddings)
        m->lm_head = m->embed;
    else
        TRY(load_matrix(m, "lm_head.weight", m->V, m->D, &m->lm_head));
    TRY(load_layers(m));
    int rot = m->mla ? m->mla_cfg.rope : m->Dh;
    int rc = rope_init(m->inv_freq, &m->rope_mscale, rot, (float)c->rope_theta, &c->rope_scaling);
    if (rc < 0)
        return mo_error_wrap(rc, "%s: rope", m->path);
    m->mla_cfg.inv_freq = m->inv_freq;
    m->mla_cfg.rope_mscale = m->rope_mscale;
    TRY(build_modules(m));
    m->stats = calloc((size_t)(m->n_moe ? m->n_moe : 1), sizeof *m->stats);
    size_t n_stat = (size_t)(m->n_moe ? m->n_moe : 1) * (size_t)m->E;
    int64_t *load = calloc(n_stat, sizeof *load);
    float *prob_mean = calloc(n_stat, sizeof *prob_mean);
    if (!m->stats || !load || !prob_mean) {
        free(load);
        free(prob_mean);
        return mo_errorf(MO_ENOMEM, "model: out of memory for load statistics");
    }
    for (int l = 0, mi = 0; l < m->L; l++)
        if (m->layers[l].moe) {
            m->stats[mi].layer = l;
            m->stats[mi].load = load + (size_t)mi * m->E;
            m->stats[mi].prob_mean = prob_mean + (size_t)mi * m->E;
            mi++;
        }
    if (m->n_moe == 0)
        m->stats[0].load = load, m->stats[0].prob_mean = prob_mean;
    return MO_OK;
}

int model_open_config(model_t **out, const model_config_t *cfg, const char *weights,
                      const model_opts_t *opts) {
    *out = NULL;
    TRY(check_config(cfg, weights));
    if (opts && (opts->logits_chunk_rows < 0 || !(opts->aux_coef >= 0.0f)))
        return mo_errorf(MO_EINVAL,
                         "model options: logits_chunk_rows %d and aux_coef %g must "
                         "be >= 0",
                         opts->logits_chunk_rows, (double)opts->aux_coef);
    model_t *m = calloc(1, sizeof *m);
    if (!m)
        return mo_errorf(MO_ENOMEM, "model: out of memory");
    m->cfg = *cfg;
    if (opts)
        m->opts = *opts;
    m->k = backend_cpu()->k;
    arena_init(&m->arena, (size_t)1 << 20);
    arena_init(&m->scratch, (size_t)1 << 20);
    m->path = malloc(strlen(weights) + 1);
    int rc = m->path ? MO_OK : mo_errorf(MO_ENOMEM, "model: out of memory");
    if (rc == MO_OK) {
        strcpy(m->path, weights);
        rc = st_checkpoint_open(&m->ck, weights);
    }
    if (rc == MO_OK)
        rc = open_weights(m);
    if (rc < 0) {
        model_destroy(&m);
        return rc;
    }
    *out = m;
    return MO_OK;
}

int model_open(model_t **out, const char *dir, const model_opts_t *opts) {
    *out = NULL;
    model_config_t c;
    TRY(model_config_load(&c, dir));
    return model_open_config(out, &c, dir, opts);
}

void model_destroy(model_t **pm) {
    model_t *m = pm ? *pm : NULL;
    if (!m)
        return;
    for (int i = 0; i < m->n_modules; i++)
        free((char *)m->modules[i].name);
    free(m->modules);
    free(m->module_slot);
    free(m->pairs);
    free(m->full);
    if (m->stats) {
        free(m->stats[0].load);
        free(m->stats[0].prob_mean);
    }
    free(m->stats);
    for (int i = 0; i < m->n_scales; i++)
        free(m->scales[i]);
    free(m->scales);
    free(m->layers);
    free(m->vecs);
    free(m->views);
    free(m->lora_ptrs);
    st_checkpoint_close(&m->ck);
    arena_free(&m->arena);
    arena_free(&m->scratch);
    free(m->path);
    free(m);
    *pm = NULL;
}
