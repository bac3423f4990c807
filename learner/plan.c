/* plan: per-GPU memory and per-step communication of a model on a parallel layout. */
#include "learner/plan.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "moe/mlp.h"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define ARENA_ALIGN 64.0 /* core/arena.c rounds every allocation up to this */
#define FP8_BLOCK 128    /* fp8 scale block edge (DeepSeek-V3, Kimi K2) */
#define INT4_GROUP 32    /* int4 scale group (Kimi K2 Thinking) */

static const char *const g_wnames[PLAN_W_COUNT] = {"f32", "bf16", "fp8", "int4"};

const char *plan_wtype_name(plan_wtype_t t) {
    return (unsigned)t < PLAN_W_COUNT ? g_wnames[t] : "?";
}

int plan_wtype_from_name(const char *name, plan_wtype_t *out) {
    for (int i = 0; i < PLAN_W_COUNT; i++)
        if (name && strcmp(name, g_wnames[i]) == 0) {
            *out = (plan_wtype_t)i;
            return MO_OK;
        }
    return mo_errorf(MO_EINVAL, "unknown storage type '%s' (expected f32, bf16, fp8 or int4)",
                     name ? name : "");
}

static double ceil_div(int64_t a, int64_t b) {
    int64_t q = (a + b - 1) / b;
    return (double)q;
}

double plan_matrix_bytes(plan_wtype_t t, int64_t rows, int64_t cols) {
    double n = (double)rows * (double)cols;
    switch (t) {
    case PLAN_W_F32: return 4.0 * n;
    case PLAN_W_BF16: return 2.0 * n;
    case PLAN_W_FP8: return n + 4.0 * ceil_div(rows, FP8_BLOCK) * ceil_div(cols, FP8_BLOCK);
    case PLAN_W_INT4: return 0.5 * n + 2.0 * (double)rows * ceil_div(cols, INT4_GROUP);
    default: return 0.0;
    }
}

void plan_layout_default(plan_layout_t *l) {
    static const char *const attention[1] = {"attention"};
    memset(l, 0, sizeof *l);
    l->ep = 8;
    l->dp = 1;
    l->gpu_mem_gib = 80.0;
    l->lora_rank = 16;
    l->targets = attention;
    l->n_targets = 1;
    l->base = PLAN_W_BF16;
    l->seq_len = 4096;
    l->tokens = 4096;
    l->recompute = 1;
    l->imbalance = 1.0;
    l->a2a_bytes = 4;
    l->reserve_gib = 2.0;
    l->rollout_gpus = 8;
    l->kv = PLAN_W_BF16;
}

/* ------------------------------------------------------------------------ */
/* Frozen weights.                                                           */

/* What a tensor is, for the storage rule of plan_wtype_t. */
typedef enum { T_EMBED = 0, T_VECTOR, T_BIAS, T_ROUTER, T_PROJ, T_EXPERT } tcat_t;

typedef struct wsum {
    plan_wtype_t base;
    double repl;           /* bytes of everything but routed experts */
    double experts;        /* bytes of all routed experts */
    int64_t params;        /* every parameter */
    int64_t params_expert; /* routed-expert parameters */
} wsum_t;

static plan_wtype_t stored_as(plan_wtype_t base, tcat_t cat) {
    if (cat == T_BIAS || base == PLAN_W_F32)
        return PLAN_W_F32;
    if (base == PLAN_W_FP8 && (cat == T_PROJ || cat == T_EXPERT))
        return PLAN_W_FP8;
    if (base == PLAN_W_INT4 && cat == T_EXPERT)
        return PLAN_W_INT4;
    return PLAN_W_BF16;
}

/* A matrix (rows, cols), or a vector (rows) when cols is 0. */
static void tensor(wsum_t *w, tcat_t cat, int64_t rows, int64_t cols) {
    plan_wtype_t t = stored_as(w->base, cat);
    int64_t n = rows * (cols > 0 ? cols : 1);
    double b = cols > 0 ? plan_matrix_bytes(t, rows, cols) : (t == PLAN_W_F32 ? 4.0 : 2.0) * rows;
    w->params += n;
    if (cat == T_EXPERT) {
        w->experts += b;
        w->params_expert += n;
    } else {
        w->repl += b;
    }
}

static void mlp_tensors(wsum_t *w, tcat_t cat, int64_t F, int64_t D) {
    tensor(w, cat, F, D);
    tensor(w, cat, F, D);
    tensor(w, cat, D, F);
}

static void attention_tensors(wsum_t *w, const model_config_t *c) {
    int64_t D = c->hidden_size, H = c->num_attention_heads, Dh = c->head_dim;
    if (c->arch != ARCH_DEEPSEEK_V3) {
        int64_t kvd = (int64_t)c->num_key_value_heads * Dh;
        tensor(w, T_PROJ, H * Dh, D);
        tensor(w, T_PROJ, kvd, D);
        tensor(w, T_PROJ, kvd, D);
        tensor(w, T_PROJ, D, H * Dh);
        if (c->arch == ARCH_QWEN3_MOE) {
            tensor(w, T_VECTOR, Dh, 0);
            tensor(w, T_VECTOR, Dh, 0);
        }
        return;
    }
    int64_t qr = c->q_lora_rank, kvr = c->kv_lora_rank, rope = c->qk_rope_head_dim;
    if (qr > 0) {
        tensor(w, T_PROJ, qr, D);
        tensor(w, T_VECTOR, qr, 0);
        tensor(w, T_PROJ, H * Dh, qr);
    } else {
        tensor(w, T_PROJ, H * Dh, D);
    }
    tensor(w, T_PROJ, kvr + rope, D);
    tensor(w, T_VECTOR, kvr, 0);
    tensor(w, T_PROJ, H * (c->qk_nope_head_dim + c->v_head_dim), kvr);
    tensor(w, T_PROJ, D, H * c->v_head_dim);
}

/* Every tensor the checkpoint holds (the actor's names and shapes, MTP layers excluded). */
static void weight_sum(wsum_t *w, const model_config_t *c, plan_wtype_t base) {
    memset(w, 0, sizeof *w);
    w->base = base;
    int64_t D = c->hidden_size, V = c->vocab_size, E = c->num_experts;
    tensor(w, T_EMBED, V, D);
    if (!c->tie_word_embeddings)
        tensor(w, T_EMBED, V, D);
    tensor(w, T_VECTOR, D, 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        tensor(w, T_VECTOR, D, 0);
        tensor(w, T_VECTOR, D, 0);
        attention_tensors(w, c);
        if (!model_config_is_moe_layer(c, l)) {
            mlp_tensors(w, T_PROJ, c->intermediate_size, D);
            continue;
        }
        tensor(w, T_ROUTER, E, D);
        if (c->scoring_func == SCORE_SIGMOID)
            tensor(w, T_BIAS, E, 0);
        for (int64_t e = 0; e < E; e++)
            mlp_tensors(w, T_EXPERT, c->moe_intermediate_size, D);
        if (c->n_shared_experts > 0)
            mlp_tensors(w, T_PROJ, (int64_t)c->n_shared_experts * c->moe_intermediate_size, D);
    }
}

/* ------------------------------------------------------------------------ */
/* Adapter modules (as actor/model_load.c builds them).                      */

/* Where a module sits: its layer, and its slot: 0..5 attention (GQA q k v o; MLA q_a q_b
 * q kv_a kv_b o), 10 + p routed expert projection p (gate up down), 20 + p shared,
 * 30 + p dense; expert the routed expert's index (-1 otherwise). */
typedef struct mod_info {
    int layer, slot, expert;
} mod_info_t;

typedef struct mod_list {
    lora_module_desc_t *mods;
    mod_info_t *info;
    int n, cap;
} mod_list_t;

static const char *const g_canon[3] = {"gate_proj", "up_proj", "down_proj"};

static int push_mod(mod_list_t *b, const char *proj, lora_kind_t kind, int C, int OC,
                    mod_info_t info, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static int push_mod(mod_list_t *b, const char *proj, lora_kind_t kind, int C, int OC,
                    mod_info_t info, const char *fmt, ...) {
    MO_ASSERT(b->n < b->cap);
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    size_t len = strlen(name) + 1;
    char *s = malloc(len);
    if (!s)
        return mo_errorf(MO_ENOMEM, "plan: out of memory for module names");
    memcpy(s, name, len);
    lora_module_desc_t *d = &b->mods[b->n];
    d->name = s;
    d->proj = proj;
    d->kind = kind;
    d->C = C;
    d->OC = OC;
    b->info[b->n++] = info;
    return MO_OK;
}

static int mla_modules(mod_list_t *b, const model_config_t *c, int l) {
    static const char *const proj[6] = {"q_a_proj",           "q_b_proj",  "q_proj",
                                        "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
    int D = c->hidden_size, H = c->num_attention_heads, Rq = c->q_lora_rank;
    int qo = H * (c->qk_nope_head_dim + c->qk_rope_head_dim), Rkv = c->kv_lora_rank;
    const int C[6] = {D, Rq, D, D, Rkv, H * c->v_head_dim};
    const int OC[6] = {
        Rq, qo, qo, Rkv + c->qk_rope_head_dim, H * (c->qk_nope_head_dim + c->v_head_dim), D};
    for (int p = 0; p < 6; p++) {
        if ((p < 2 && Rq == 0) || (p == 2 && Rq > 0))
            continue;
        mod_info_t in = {l, p, -1};
        TRY(push_mod(b, proj[p], LORA_KIND_ATTENTION, C[p], OC[p], in,
                     "model.layers.%d.self_attn.%s", l, proj[p]));
    }
    return MO_OK;
}

static int gqa_modules(mod_list_t *b, const model_config_t *c, int l) {
    static const char *const proj[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    int D = c->hidden_size, qd = c->num_attention_heads * c->head_dim;
    int kvd = c->num_key_value_heads * c->head_dim;
    const int C[4] = {D, D, D, qd}, OC[4] = {qd, kvd, kvd, D};
    for (int p = 0; p < 4; p++) {
        mod_info_t in = {l, p, -1};
        TRY(push_mod(b, proj[p], LORA_KIND_ATTENTION, C[p], OC[p], in,
                     "model.layers.%d.self_attn.%s", l, proj[p]));
    }
    return MO_OK;
}

/* gate, up, down of an MLP F wide: prefix + names[p], slot base + p. */
static int mlp_modules(mod_list_t *b, const model_config_t *c, const char *prefix,
                       const char *const names[3], lora_kind_t kind, int F, int l, int base,
                       int expert) {
    int D = c->hidden_size;
    for (int p = 0; p < 3; p++) {
        mod_info_t in = {l, base + p, expert};
        TRY(push_mod(b, g_canon[p], kind, p == 2 ? F : D, p == 2 ? D : F, in, "%s%s", prefix,
                     names[p]));
    }
    return MO_OK;
}

static int layer_modules(mod_list_t *b, const model_config_t *c, int l) {
    static const char *const mx[3] = {"w1", "w3", "w2"};
    char prefix[160];
    TRY(c->arch == ARCH_DEEPSEEK_V3 ? mla_modules(b, c, l) : gqa_modules(b, c, l));
    if (!model_config_is_moe_layer(c, l)) {
        snprintf(prefix, sizeof prefix, "model.layers.%d.mlp.", l);
        return mlp_modules(b, c, prefix, g_canon, LORA_KIND_DENSE_MLP, c->intermediate_size, l, 30,
                           -1);
    }
    int mixtral = c->arch == ARCH_MIXTRAL;
    for (int e = 0; e < c->num_experts; e++) {
        if (mixtral)
            snprintf(prefix, sizeof prefix, "model.layers.%d.block_sparse_moe.experts.%d.", l, e);
        else
            snprintf(prefix, sizeof prefix, "model.layers.%d.mlp.experts.%d.", l, e);
        TRY(mlp_modules(b, c, prefix, mixtral ? mx : g_canon, LORA_KIND_EXPERT,
                        c->moe_intermediate_size, l, 10, e));
    }
    if (c->n_shared_experts > 0) {
        snprintf(prefix, sizeof prefix, "model.layers.%d.mlp.shared_experts.", l);
        TRY(mlp_modules(b, c, prefix, g_canon, LORA_KIND_SHARED_EXPERT,
                        c->n_shared_experts * c->moe_intermediate_size, l, 20, -1));
    }
    return MO_OK;
}

static void mod_list_free(mod_list_t *b) {
    for (int i = 0; i < b->n; i++)
        free((char *)b->mods[i].name);
    free(b->mods);
    free(b->info);
    memset(b, 0, sizeof *b);
}

static int mod_list_build(mod_list_t *b, const model_config_t *c) {
    memset(b, 0, sizeof *b);
    int attn = c->arch == ARCH_DEEPSEEK_V3 ? (c->q_lora_rank > 0 ? 5 : 4) : 4;
    int64_t n = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n += attn + 3 * (model_config_is_moe_layer(c, l)
                             ? (int64_t)c->num_experts + (c->n_shared_experts > 0)
                             : 1);
    if (n < 1 || n > INT32_MAX / 2)
        return mo_errorf(MO_EUNSUPPORTED, "plan: %lld adapter modules (expected 1 .. 2^30)",
                         (long long)n);
    b->cap = (int)n;
    b->mods = calloc((size_t)n, sizeof *b->mods);
    b->info = calloc((size_t)n, sizeof *b->info);
    if (!b->mods || !b->info) {
        mod_list_free(b);
        return mo_errorf(MO_ENOMEM, "plan: out of memory for %lld adapter modules", (long long)n);
    }
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int rc = layer_modules(b, c, l);
        if (rc < 0) {
            mod_list_free(b);
            return rc;
        }
    }
    return MO_OK;
}

int plan_modules(lora_module_desc_t **mods, int *n, const model_config_t *c) {
    *mods = NULL;
    *n = 0;
    mod_list_t b;
    TRY(mod_list_build(&b, c));
    free(b.info);
    *mods = b.mods;
    *n = b.n;
    return MO_OK;
}

void plan_modules_free(lora_module_desc_t **mods, int n) {
    if (!mods || !*mods)
        return;
    for (int i = 0; i < n; i++)
        free((char *)(*mods)[i].name);
    free(*mods);
    *mods = NULL;
}

/* ------------------------------------------------------------------------ */
/* The adapter the targets select.                                           */

/* Which projections of a layer carry an adapter (routed experts: any expert's). */
typedef struct ad_layer {
    unsigned char attn[6];
    unsigned char expert[3], shared[3], dense[3];
} ad_layer_t;

typedef struct adapt {
    ad_layer_t *layer;      /* (L) */
    int64_t params;         /* the whole adapter */
    int64_t params_expert;  /* of which routed experts' */
    int64_t params_expert0; /* routed experts' adapters of the experts rank 0 owns */
    int n_modules;          /* adapted projections */
} adapt_t;

static int adapt_build(adapt_t *a, const model_config_t *c, const plan_layout_t *l) {
    memset(a, 0, sizeof *a);
    mod_list_t b;
    TRY(mod_list_build(&b, c));
    unsigned char *sel = calloc((size_t)b.n + 1, 1);
    a->layer = calloc((size_t)c->num_hidden_layers, sizeof *a->layer);
    if (!sel || !a->layer) {
        free(sel);
        free(a->layer);
        a->layer = NULL;
        mod_list_free(&b);
        return mo_errorf(MO_ENOMEM, "plan: out of memory for the adapter selection");
    }
    int rc = lora_select_targets(sel, b.mods, b.n, l->targets, l->n_targets);
    int own = c->num_experts / l->ep;
    for (int i = 0; rc == MO_OK && i < b.n; i++) {
        if (!sel[i])
            continue;
        const mod_info_t *in = &b.info[i];
        int64_t p = (int64_t)l->lora_rank * (b.mods[i].C + b.mods[i].OC);
        ad_layer_t *ly = &a->layer[in->layer];
        a->params += p;
        a->n_modules++;
        if (in->slot < 10) {
            ly->attn[in->slot] = 1;
        } else if (in->slot < 20) {
            ly->expert[in->slot - 10] = 1;
            a->params_expert += p;
            a->params_expert0 += in->expert < own ? p : 0;
        } else if (in->slot < 30) {
            ly->shared[in->slot - 20] = 1;
        } else {
            ly->dense[in->slot - 30] = 1;
        }
    }
    free(sel);
    mod_list_free(&b);
    if (rc < 0) {
        free(a->layer);
        a->layer = NULL;
    }
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Activations: the actor's allocations, one by one.                          */

typedef struct actx {
    const model_config_t *c;
    const ad_layer_t *ad; /* (L) */
    double T, S;          /* tokens, token slots T K */
    double R;             /* LoRA rank */
    int ep;               /* ranks of the MoE layer */
    int ep_layer;         /* 1: the expert-parallel layer (moe_ep), 0: moe_forward */
    double imb;           /* busiest expert / mean */
} actx_t;

/* Bytes bump-allocated for n elements of es bytes. */
static double al(double n, double es) {
    double b = n * es;
    return ceil((b > 1.0 ? b : 1.0) / ARENA_ALIGN) * ARENA_ALIGN;
}
static double f4(double n) {
    return al(n, 4.0);
}

/* One layer's bytes: what its forward allocates, its backward's temporaries, and
 * the all-to-all row buffers among each. */
typedef struct lbytes {
    double fwd, bwd, a2a_fwd, a2a_bwd;
} lbytes_t;

static int any3(const unsigned char *f) {
    return f[0] || f[1] || f[2];
}

/* mlp_acts_alloc for rows rows of width F. */
static double mlp_acts(const actx_t *x, double rows, double F, const unsigned char *ad) {
    double b = 3.0 * f4(rows * F);
    for (int p = 0; p < 3; p++)
        b += ad[p] ? f4(rows * x->R) : 0.0;
    return b;
}

/* mlp_backward_scratch_floats. */
static double mlp_scratch(const actx_t *x, double rows, double F, const unsigned char *ad) {
    return f4(rows * (3.0 * F + (any3(ad) ? x->R : 0.0)));
}

/* moe_experts_forward over n experts receiving rows rows: per expert with rows, its
 * activations; the expected rows spread evenly over the experts. */
static double experts_acts(const actx_t *x, double n, double rows, const unsigned char *ad) {
    double F = x->c->moe_intermediate_size;
    double active = rows < n ? floor(rows) : n;
    double b = al(n, sizeof(mlp_acts_t));
    return active >= 1.0 ? b + active * mlp_acts(x, rows / active, F, ad) : b;
}

static void attn_gqa_fwd(const actx_t *x, const ad_layer_t *ad, double *b) {
    const model_config_t *c = x->c;
    double T = x->T, H = c->num_attention_heads, Hkv = c->num_key_value_heads;
    double qd = H * c->head_dim, kvd = Hkv * c->head_dim;
    *b += f4(T * qd) + 2.0 * f4(T * kvd); /* qr, kr, v */
    if (c->arch == ARCH_QWEN3_MOE)        /* q, k before their norms, rstd_q, rstd_k */
        *b += f4(T * qd) + f4(T * kvd) + f4(T * H) + f4(T * Hkv);
    for (int p = 0; p < 4; p++)
        *b += ad->attn[p] ? f4(T * x->R) : 0.0;
    *b += f4(T * qd) + f4(T * H); /* att, lse */
}

static void attn_mla_fwd(const actx_t *x, const ad_layer_t *ad, double *b) {
    const model_config_t *c = x->c;
    double T = x->T, H = c->num_attention_heads, Rq = c->q_lora_rank, Rkv = c->kv_lora_rank;
    double Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    double Dq = Dn + Dr, Dp = Dq > Dv ? Dq : Dv;
    *b += f4(T * H * Dq); /* qraw */
    if (Rq > 0)
        *b += 2.0 * f4(T * Rq) + f4(T); /* qa, qa_n, rstd_qa */
    for (int p = 0; p < 6; p++)
        *b += ad->attn[p] ? f4(T * x->R) : 0.0;
    *b += f4(T * H * Dr) + f4(T * H * Dp);              /* qpe, q */
    *b += f4(T * (Rkv + Dr)) + f4(T * Dr);              /* comp, kpe */
    *b += 2.0 * f4(T * Rkv) + f4(T);                    /* ckv, ckv_n, rstd_kv */
    *b += f4(T * H * (Dn + Dv)) + 2.0 * f4(T * H * Dp); /* kvb, k, v */
    *b += f4(T * H * Dp) + f4(T * H) + f4(T * H * Dv);  /* att, lse, ao */
}

/* Router, routing and the dispatch plan (moe.c route + moe_dispatch_plan). */
static double route_fwd(const actx_t *x) {
    double T = x->T, E = x->c->num_experts, K = x->c->num_experts_per_tok, S = x->S;
    return 2.0 * f4(T * E) + al(T * K, 4) + f4(T * K) + al(E, 8) + al(E + 1, 4) + 2.0 * al(S, 4) +
           al(E, 4);
}

static double shared_fwd(const actx_t *x, const ad_layer_t *ad) {
    const model_config_t *c = x->c;
    if (c->n_shared_experts == 0)
        return 0.0;
    double Fs = (double)c->n_shared_experts * c->moe_intermediate_size;
    return f4(x->T * c->hidden_size) + mlp_acts(x, x->T, Fs, ad->shared);
}

static double shared_bwd(const actx_t *x, const ad_layer_t *ad) {
    const model_config_t *c = x->c;
    if (c->n_shared_experts == 0)
        return 0.0;
    double Fs = (double)c->n_shared_experts * c->moe_intermediate_size;
    return mlp_scratch(x, x->T, Fs, ad->shared);
}

/* moe_forward / moe_backward (ep 1). */
static void moe_local(const actx_t *x, const ad_layer_t *ad, lbytes_t *o) {
    const model_config_t *c = x->c;
    double T = x->T, S = x->S, D = c->hidden_size, E = c->num_experts;
    double F = c->moe_intermediate_size;
    o->fwd += route_fwd(x) + 2.0 * f4(S * D); /* xg, yg */
    o->fwd += experts_acts(x, E, S, ad->expert) + shared_fwd(x, ad);
    double rows = fmin(S, ceil(x->imb * S / E));                       /* the busiest expert */
    o->bwd += shared_bwd(x, ad) + 2.0 * f4(S * D) + f4(S) + f4(T * E); /* dyg, dxg, dw, dlogits */
    o->bwd += mlp_scratch(x, rows, F, ad->expert);
}

/* moe_ep_forward / moe_ep_backward on the busiest of N ranks. It receives R = min(imb, N) S
 * rows: every one of its experts as busy as the busiest expert, at most everything. */
static void moe_ep(const actx_t *x, const ad_layer_t *ad, lbytes_t *o) {
    const model_config_t *c = x->c;
    double T = x->T, S = x->S, D = c->hidden_size, E = c->num_experts, N = x->ep;
    double F = c->moe_intermediate_size, n = E / N, R = ceil(fmin(x->imb, N) * S);
    double rows = fmin(R, ceil(x->imb * S * N / E)); /* the busiest expert */
    double xch = al(E, 8) + 6.0 * al(N, 8) + al(N * n, 8) + al(N, 8) + al(n + 1, 4) + al(R, 4);
    double a2a = 2.0 * f4(S * D) + 3.0 * f4(R * D); /* xg, yg, receive buffer, xe, ye */
    o->fwd += route_fwd(x) + al(2 + E, 8) + xch + a2a;
    o->fwd += experts_acts(x, n, R, ad->expert) + shared_fwd(x, ad);
    o->a2a_fwd += a2a;
    double a2a_b = 2.0 * f4(S * D) + 3.0 * f4(R * D); /* dyg, dxg, buffer, dye, dxe */
    o->bwd += shared_bwd(x, ad) + a2a_b + f4(S) + f4(T * E);
    o->bwd += mlp_scratch(x, rows, F, ad->expert);
    o->a2a_bwd += a2a_b;
}

static void attn_gqa_bwd(const actx_t *x, double *b) {
    const model_config_t *c = x->c;
    double T = x->T, qd = (double)c->num_attention_heads * c->head_dim;
    double kvd = (double)c->num_key_value_heads * c->head_dim;
    *b += f4(T * x->R) + 3.0 * f4(T * qd) + 3.0 * f4(T * kvd); /* tmp, datt dqr dq, dkr dv dk */
    if (c->arch == ARCH_QWEN3_MOE)
        *b += f4(T * qd) + f4(T * kvd); /* through the q/k norms */
}

static void attn_mla_bwd(const actx_t *x, const ad_layer_t *ad, double *b) {
    const model_config_t *c = x->c;
    double T = x->T, H = c->num_attention_heads, Rq = c->q_lora_rank, Rkv = c->kv_lora_rank;
    double Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    double Dq = Dn + Dr, Dp = Dq > Dv ? Dq : Dv;
    int adapted = 0;
    for (int p = 0; p < 6; p++)
        adapted |= ad->attn[p];
    *b += f4(T * (adapted ? x->R : 1.0)) + f4(T * H * Dv) + 4.0 * f4(T * H * Dp);
    *b += f4(T * H * (Dn + Dv)) + 2.0 * f4(T * Dr) + 2.0 * f4(T * Rkv) + f4(T * (Rkv + Dr));
    *b += f4(T * H * Dq) + 2.0 * f4(T * H * Dr);
    if (Rq > 0)
        *b += 2.0 * f4(T * Rq);
}

/* Layer l (layer_forward / layer_backward of actor/model.c). */
static lbytes_t layer_bytes(const actx_t *x, int l) {
    const model_config_t *c = x->c;
    const ad_layer_t *ad = &x->ad[l];
    double T = x->T, TD = T * c->hidden_size;
    lbytes_t o = {0.0, 0.0, 0.0, 0.0};
    o.fwd = 2.0 * f4(TD) + f4(T); /* o, ln1, rstd1 */
    if (c->arch == ARCH_DEEPSEEK_V3)
        attn_mla_fwd(x, ad, &o.fwd);
    else
        attn_gqa_fwd(x, ad, &o.fwd);
    o.fwd += 2.0 * f4(TD) + f4(T);           /* h1, ln2, rstd2 */
    o.bwd = f4(TD) + (l > 0 ? f4(TD) : 0.0); /* dln2, dln1 when dx is needed */
    if (model_config_is_moe_layer(c, l)) {
        if (x->ep_layer)
            moe_ep(x, ad, &o);
        else
            moe_local(x, ad, &o);
    } else {
        o.fwd += mlp_acts(x, T, c->intermediate_size, ad->dense);
        o.bwd += mlp_scratch(x, T, c->intermediate_size, ad->dense);
    }
    if (c->arch == ARCH_DEEPSEEK_V3)
        attn_mla_bwd(x, ad, &o.bwd);
    else
        attn_gqa_bwd(x, &o.bwd);
    return o;
}

static int chunk_rows(const model_config_t *c, const plan_layout_t *l, double T) {
    int r = l->logits_chunk_rows > 0 ? l->logits_chunk_rows : (int)((1 << 22) / c->vocab_size);
    r = r > 0 ? r : 1;
    return (double)r < T ? r : (int)T;
}

static void acts_total(plan_acts_t *a, const actx_t *x, const plan_layout_t *l, int recompute,
                       int for_backward) {
    const model_config_t *c = x->c;
    int L = c->num_hidden_layers, n_moe = 0;
    double T = x->T, TD = T * c->hidden_size, B = ceil(T / l->seq_len);
    double logits = f4((double)chunk_rows(c, l, T) * (double)c->vocab_size);
    for (int i = 0; i < L; i++)
        n_moe += model_config_is_moe_layer(c, i);
    /* step_begin: the batch's copies, the residual streams, the routing record. */
    double arena = 2.0 * al(T, 4) + al(B + 1, 4) + al(T, 1) + al(L + 1, 8) + al(L, 8);
    arena += (for_backward ? L + 1.0 : 2.0) * f4(TD) + n_moe * al(T * c->num_experts_per_tok, 4);
    double scratch = 0.0, a2a = 0.0, kept_a2a = 0.0;
    for (int i = 0; i < L; i++) {
        lbytes_t lb = layer_bytes(x, i);
        double peak, peak_a2a;
        if (!for_backward) { /* the forward of one layer at a time */
            peak = lb.fwd;
            peak_a2a = lb.a2a_fwd;
        } else if (recompute) { /* the layer's output, its forward again, its backward */
            peak = f4(TD) + lb.fwd + lb.bwd;
            peak_a2a = lb.a2a_fwd + lb.a2a_bwd;
        } else { /* the forward stays in the arena */
            arena += lb.fwd;
            kept_a2a += lb.a2a_fwd;
            peak = lb.bwd;
            peak_a2a = lb.a2a_bwd;
        }
        if (peak > scratch) {
            scratch = peak;
            a2a = peak_a2a;
        }
    }
    double head = f4(TD) + 2.0 * f4(T); /* final norm output, rstd, lse */
    if (!for_backward) {
        if (head + logits > scratch) {
            scratch = head + logits;
            a2a = 0.0;
        }
    } else {
        arena += head + 3.0 * f4(TD) + f4(T); /* + dx ping-pong, dhf, dl */
        if (2.0 * logits > scratch) {
            scratch = 2.0 * logits;
            a2a = 0.0;
        }
    }
    a->kept = arena;
    a->temps = scratch;
    a->a2a = kept_a2a + a2a;
}

static int check_layout(const model_config_t *c, const plan_layout_t *l) {
    int E = c->num_experts;
    if (l->ep < 1 || E % l->ep != 0)
        return mo_errorf(MO_EINVAL,
                         "plan: ep %d must divide the %d routed experts (each GPU owns E / ep)",
                         l->ep, E);
    if (l->rollout_gpus < 1 || E % l->rollout_gpus != 0)
        return mo_errorf(MO_EINVAL, "plan: rollout GPUs %d must divide the %d routed experts",
                         l->rollout_gpus, E);
    if (l->dp < 1 || l->lora_rank < 1 || l->tokens < 1 || l->seq_len < 1 || l->n_targets < 1 ||
        !l->targets)
        return mo_errorf(MO_EINVAL,
                         "plan: dp %d, LoRA rank %d, tokens %lld, seq-len %d and the target "
                         "count %d must all be >= 1",
                         l->dp, l->lora_rank, (long long)l->tokens, l->seq_len, l->n_targets);
    if (!(l->imbalance >= 1.0 && l->imbalance < 1e6) || !(l->gpu_mem_gib > 0.0) ||
        !(l->reserve_gib >= 0.0) || l->logits_chunk_rows < 0 || l->kv_tokens < 0 ||
        (double)l->tokens * c->num_experts_per_tok > 1e15)
        return mo_errorf(MO_EINVAL,
                         "plan: imbalance %g must be >= 1, gpu memory %g GiB > 0, reserve %g "
                         "GiB >= 0, logits chunk rows %d and KV tokens %lld >= 0",
                         l->imbalance, l->gpu_mem_gib, l->reserve_gib, l->logits_chunk_rows,
                         (long long)l->kv_tokens);
    if (l->a2a_bytes != 2 && l->a2a_bytes != 4)
        return mo_errorf(MO_EINVAL, "plan: all-to-all element bytes %d must be 2 or 4",
                         l->a2a_bytes);
    if (l->kv != PLAN_W_F32 && l->kv != PLAN_W_BF16 && l->kv != PLAN_W_FP8)
        return mo_errorf(MO_EINVAL, "plan: the KV cache type must be f32, bf16 or fp8, got %s",
                         plan_wtype_name(l->kv));
    if ((unsigned)l->base >= PLAN_W_COUNT)
        return mo_errorf(MO_EINVAL, "plan: unknown base storage type %d", (int)l->base);
    return MO_OK;
}

static void actx_init(actx_t *x, const model_config_t *c, const plan_layout_t *l, const adapt_t *ad,
                      int ep) {
    x->c = c;
    x->ad = ad->layer;
    x->T = (double)l->tokens;
    x->S = x->T * c->num_experts_per_tok;
    x->R = l->lora_rank;
    x->ep = ep;
    x->ep_layer = ep > 1;
    x->imb = l->imbalance;
}

int plan_activations(plan_acts_t *a, const model_config_t *c, const plan_layout_t *l, int recompute,
                     int for_backward) {
    memset(a, 0, sizeof *a);
    TRY(model_config_validate(c, "plan"));
    TRY(check_layout(c, l));
    adapt_t ad;
    TRY(adapt_build(&ad, c, l));
    MO_ASSERT(ad.layer != NULL);
    actx_t x;
    actx_init(&x, c, l, &ad, l->ep);
    acts_total(a, &x, l, recompute, for_backward);
    free(ad.layer);
    return MO_OK;
}

int plan_moe_block(plan_block_t *b, const model_config_t *c, const plan_layout_t *l, int layer,
                   int ep_layer) {
    memset(b, 0, sizeof *b);
    TRY(model_config_validate(c, "plan"));
    TRY(check_layout(c, l));
    if (!model_config_is_moe_layer(c, layer))
        return mo_errorf(MO_EINVAL, "plan: layer %d is not a MoE layer", layer);
    adapt_t ad;
    TRY(adapt_build(&ad, c, l));
    MO_ASSERT(ad.layer != NULL);
    actx_t x;
    actx_init(&x, c, l, &ad, l->ep);
    x.ep_layer = ep_layer;
    lbytes_t o = {0.0, 0.0, 0.0, 0.0};
    if (ep_layer)
        moe_ep(&x, &ad.layer[layer], &o);
    else
        moe_local(&x, &ad.layer[layer], &o);
    free(ad.layer);
    b->fwd = o.fwd;
    b->bwd = o.bwd;
    b->a2a_fwd = o.a2a_fwd;
    b->a2a_bwd = o.a2a_bwd;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Communication.                                                            */

void plan_a2a_exact(plan_a2a_t *t, const int64_t *counts, int N, int E, int D, int elem_bytes,
                    int rank) {
    MO_ASSERT(N >= 1 && E % N == 0 && rank >= 0 && rank < N);
    memset(t, 0, sizeof *t);
    int n = E / N;
    for (int p = 0; p < N; p++)
        for (int e = 0; e < E; e++) {
            int64_t k = counts[(size_t)p * E + e];
            int owner = e / n;
            if (p == rank && owner == rank)
                t->rows_local += k;
            else if (p == rank)
                t->rows_out += k;
            else if (owner == rank)
                t->rows_in += k;
        }
    uint64_t row = (uint64_t)D * (uint64_t)elem_bytes, cnt = (uint64_t)n * 8u;
    t->bytes_sent = 2u * (uint64_t)(t->rows_out + t->rows_in) * row + (uint64_t)(N - 1) * cnt;
    t->bytes_recv = t->bytes_sent;
    t->bytes_local = 4u * (uint64_t)t->rows_local * row + cnt;
}

double plan_a2a_uniform(int64_t T, int K, int D, int N, int elem_bytes) {
    return (double)T * K * D * elem_bytes * 2.0 * 2.0 * (double)(N - 1) / N;
}

static void comm_plan(plan_t *p, const model_config_t *c, const plan_layout_t *l,
                      const adapt_t *ad) {
    int N = l->ep, n = c->num_experts / N, G = p->gpus;
    double rows = (double)p->n_moe * plan_a2a_uniform(l->tokens, c->num_experts_per_tok,
                                                      c->hidden_size, N, l->a2a_bytes);
    double counts = (double)p->n_moe * (N - 1) * 8.0 * n; /* the forward's count exchange */
    p->a2a_step[0] = rows + counts;
    p->a2a_step[1] = 1.5 * rows + 2.0 * counts; /* 6 row exchanges instead of 4 */
    p->allreduce_payload = 4.0 * (double)(ad->params - ad->params_expert);
    p->allreduce_ring = G > 1 ? 2.0 * (G - 1) / G * p->allreduce_payload : 0.0;
    p->expert_allreduce_payload = 4.0 * (double)ad->params_expert0;
    p->expert_allreduce_ring =
        l->dp > 1 ? 2.0 * (l->dp - 1) / l->dp * p->expert_allreduce_payload : 0.0;
    p->sync_f32 = 4.0 * (double)ad->params;
    p->sync_bf16 = 2.0 * (double)ad->params;
}

/* ------------------------------------------------------------------------ */
/* Rollout.                                                                  */

static void rollout_plan(plan_t *p, const model_config_t *c, const plan_layout_t *l,
                         const wsum_t *w, const adapt_t *ad) {
    int Nr = l->rollout_gpus, E = c->num_experts, L = c->num_hidden_layers;
    p->roll_base = w->repl + w->experts / Nr;
    /* The adapter's routed-expert part, sharded like the experts. */
    int per_gpu = E / Nr; /* exact: Nr divides E */
    double ex_gpu = (double)ad->params_expert * ((double)per_gpu / E);
    p->roll_adapter = 4.0 * ((double)(ad->params - ad->params_expert) + ex_gpu);
    actx_t x;
    actx_init(&x, c, l, ad, Nr);
    plan_acts_t fwd;
    acts_total(&fwd, &x, l, 0, 0);
    p->roll_workspace = fwd.kept + fwd.temps;
    p->roll_left =
        l->gpu_mem_gib * GIB - p->roll_base - p->roll_adapter - p->roll_workspace - p->reserve;
    double b = l->kv == PLAN_W_F32 ? 4.0 : l->kv == PLAN_W_BF16 ? 2.0 : 1.0;
    if (c->arch == ARCH_DEEPSEEK_V3) /* the latent c_kv and the shared rope key */
        p->kv_bytes_per_token = (double)L * (c->kv_lora_rank + c->qk_rope_head_dim) * b;
    else
        p->kv_bytes_per_token = 2.0 * L * c->num_key_value_heads * (double)c->head_dim * b;
    p->kv_capacity = p->roll_left > 0.0 ? (int64_t)floor(p->roll_left / p->kv_bytes_per_token) : 0;
    p->kv_fits = l->kv_tokens <= p->kv_capacity;
}

/* ------------------------------------------------------------------------ */
/* The plan.                                                                 */

int plan_compute(plan_t *p, const model_config_t *c, const plan_layout_t *l) {
    memset(p, 0, sizeof *p);
    TRY(model_config_validate(c, "plan"));
    TRY(check_layout(c, l));
    adapt_t ad;
    TRY(adapt_build(&ad, c, l));
    MO_ASSERT(ad.layer != NULL);
    p->layout = *l;
    p->gpus = l->ep * l->dp;
    p->experts_per_gpu = c->num_experts / l->ep;
    for (int i = 0; i < c->num_hidden_layers; i++)
        p->n_moe += model_config_is_moe_layer(c, i);
    model_config_param_counts(c, &p->params_total, &p->params_active);

    wsum_t w, w16;
    weight_sum(&w, c, l->base);
    weight_sum(&w16, c, PLAN_W_BF16);
    p->params_experts = w.params_expert;
    p->base_replicated = w.repl;
    p->base_experts = w.experts / l->ep;
    p->full_base = w.repl + w.experts;
    p->full_bf16 = w16.repl + w16.experts;

    p->lora_params = ad.params;
    p->lora_params_experts = ad.params_expert;
    p->lora_params_gpu = ad.params - ad.params_expert + ad.params_expert0;
    p->n_lora_modules = ad.n_modules;
    p->lora_bytes = p->grad_bytes = 4.0 * (double)p->lora_params_gpu;
    p->adam_bytes = 8.0 * (double)p->lora_params_gpu;
    p->reserve = l->reserve_gib * GIB;

    actx_t x;
    actx_init(&x, c, l, &ad, l->ep);
    double fixed = p->base_replicated + p->base_experts + p->lora_bytes + p->grad_bytes +
                   p->adam_bytes + p->reserve;
    for (int m = 0; m < 2; m++) {
        acts_total(&p->acts[m], &x, l, m, 1);
        p->total[m] = fixed + p->acts[m].kept + p->acts[m].temps;
        p->fits[m] = p->total[m] <= l->gpu_mem_gib * GIB;
    }
    actx_t one = x; /* one token, to read off the per-token rate of a layer */
    one.T = 1e6;
    one.S = one.T * c->num_experts_per_tok;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        int moe = model_config_is_moe_layer(c, i);
        if (p->layer_bytes_per_token[moe] == 0.0)
            p->layer_bytes_per_token[moe] = layer_bytes(&one, i).fwd / one.T;
    }
    comm_plan(p, c, l, &ad);
    rollout_plan(p, c, l, &w, &ad);
    free(ad.layer);
    return MO_OK;
}

int plan_smallest_ep(const model_config_t *c, const plan_layout_t *l, int *ep_out) {
    *ep_out = 0;
    plan_layout_t t = *l;
    t.dp = 1;
    for (int ep = 1; ep <= c->num_experts; ep++) {
        if (c->num_experts % ep != 0)
            continue;
        t.ep = ep;
        plan_t p;
        TRY(plan_compute(&p, c, &t));
        if (p.fits[l->recompute ? 1 : 0]) {
            *ep_out = ep;
            return MO_OK;
        }
    }
    return MO_OK;
}
