/* test_model: the policy model's forward and backward on tiny random models: finite
 * differences on LoRA parameters, recompute, routing replay, packing, determinism, input
 * checks, and a PyTorch reference (tests/model_ref.py) for logprobs, entropies and LoRA
 * gradients. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/rng.h"
#include "core/status.h"
#include "lora/peft.h"
#include "tests/testutil.h"

#define MAXT 64

/* A tiny model on disk, its adapter, and a packed batch with a random objective
 * L = sum_t a_t logp_t + b_t entropy_t. */
typedef struct fx {
    char dir[512];
    model_t *m;
    lora_adapter_t *ad;
    int T, B;
    int32_t tok[MAXT], pos[MAXT], tgt[MAXT], cu[8];
    float a[MAXT], b[MAXT];
    float temperature;
} fx_t;

typedef enum { FX_QWEN3 = 0, FX_MIXTRAL } fx_kind_t;

/* Qwen3: 3 layers, the middle one dense (mlp_only_layers); Mixtral: sliding window 4. */
static void fx_config(model_config_t *c, fx_kind_t kind) {
    int rc = init_model_config(c, kind == FX_QWEN3 ? ARCH_QWEN3_MOE : ARCH_MIXTRAL, INIT_SIZE_TINY,
                               DT_F32);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    if (kind == FX_QWEN3) {
        c->num_hidden_layers = 3;
        c->max_window_layers = 3;
        c->mlp_only_layers[1] = 1;
    } else {
        c->sliding_window = 4;
    }
    CU_ASSERT_EQUAL_FATAL(model_config_validate(c, "test"), 0);
}

/* Random B (and A) so every adapted path contributes. */
static lora_adapter_t *make_adapter(const model_t *m, const char *target, int rank) {
    const char *targets[1] = {target};
    lora_config_t lc = {rank, 2.0f * rank, 0, 0.0f, 11, 0, targets, 1};
    lora_adapter_t *ad = NULL;
    int rc = lora_adapter_new(&ad, &lc, m->modules, m->n_modules);
    if (rc < 0)
        tu_report("adapter: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return ad;
}

/* Sequences of the given lengths, random tokens and objective. */
static void fx_batch(fx_t *f, const int *lens, int B, uint64_t seed) {
    f->B = B;
    f->cu[0] = 0;
    for (int b = 0; b < B; b++)
        f->cu[b + 1] = f->cu[b] + lens[b];
    f->T = f->cu[B];
    CU_ASSERT_FATAL(f->T <= MAXT);
    for (int t = 0; t < f->T; t++) {
        f->tok[t] = (int32_t)(rng_uniform(seed, 1, (uint64_t)t) * 261.0f) % 261;
        f->a[t] = 2.0f * rng_uniform(seed, 2, (uint64_t)t) - 1.0f;
        f->b[t] = 2.0f * rng_uniform(seed, 3, (uint64_t)t) - 1.0f;
    }
    model_batch_next_token(f->pos, f->tgt, f->tok, f->cu, B);
    if (f->T > 3)
        f->tgt[2] = -1; /* a token without a target inside a sequence */
    f->temperature = 0.8f;
}

static void fx_open(fx_t *f, fx_kind_t kind, const model_opts_t *o, float std) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    model_config_t c;
    fx_config(&c, kind);
    init_model_opts_t io = {7, std};
    int rc = init_model_write(f->dir, &c, &io);
    if (rc == 0)
        rc = model_open(&f->m, f->dir, o);
    if (rc < 0)
        tu_report("fixture: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    f->ad = make_adapter(f->m, "all-linear", 4);
    tu_randomise_adapter(f->ad, 5);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(f->m, f->ad), 0);
    static const int lens[2] = {9, 6};
    fx_batch(f, lens, 2, 3);
}

static void fx_close(fx_t *f) {
    model_destroy(&f->m);
    lora_adapter_destroy(&f->ad);
    tu_rmtree(f->dir);
}

static model_batch_t fx_view(fx_t *f, const uint16_t *replay, uint16_t *routing) {
    model_batch_t b = {f->T, f->B, f->tok, f->pos, f->cu, f->tgt, f->temperature, replay, routing};
    return b;
}

/* Forward; returns the objective in double and fills logp/entropy/routing. */
static double fx_forward(fx_t *f, model_t *m, float *logp, float *ent, uint16_t *routing,
                         const uint16_t *replay, int for_backward) {
    model_batch_t b = fx_view(f, replay, routing);
    tu_poison(logp, (size_t)f->T);
    tu_poison(ent, (size_t)f->T);
    int rc = model_forward(m, &b, logp, ent, for_backward);
    if (rc < 0)
        tu_report("forward: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    double L = 0.0;
    for (int t = 0; t < f->T; t++)
        L += (double)f->a[t] * logp[t] + (double)f->b[t] * ent[t];
    return L + model_aux_loss(m);
}

static size_t routing_len(const fx_t *f) {
    return (size_t)f->T * (size_t)(f->m->n_moe ? f->m->n_moe : 1) * (size_t)f->m->K;
}

/* Analytic gradient of the objective into f->ad->grads. */
static void fx_gradient(fx_t *f) {
    float logp[MAXT], ent[MAXT];
    fx_forward(f, f->m, logp, ent, NULL, NULL, 1);
    lora_adapter_zero_grads(f->ad);
    int rc = model_backward(f->m, f->a, f->b);
    if (rc < 0)
        tu_report("backward: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* ------------------------------------------------------------------------ */
/* Finite differences.                                                       */

/* Parameter index of a sample: tensors of attention entries and of the others by
 * turns, A and B by turns. */
static size_t sample_param(const lora_adapter_t *ad, int i, uint64_t seed) {
    int attn = i % 2 == 0, want_b = (i / 2) % 2;
    int cand[4096], n = 0;
    for (int e = 0; e < ad->n_entries && n < 4096; e++)
        if ((ad->entries[e].kind == LORA_KIND_ATTENTION) == attn)
            cand[n++] = e;
    CU_ASSERT_FATAL(n > 0);
    int e = cand[(int)(rng_uniform(seed, 7, (uint64_t)i) * (float)n) % n];
    const lora_tensor_t *t = &ad->tensors[2 * e + want_b];
    size_t j = (size_t)(rng_uniform(seed, 8, (uint64_t)i) * (float)t->numel) % t->numel;
    return t->offset + j;
}

typedef size_t (*sampler_fn)(const lora_adapter_t *ad, int i, uint64_t seed);

/* Central differences on n parameters drawn by sample, skipping nudges that change the
 * routing; returns the normalised error max |fd - an| / max |an|. */
static double fd_check_with(fx_t *f, int n, float eps, int *checked, sampler_fn sample) {
    fx_gradient(f);
    size_t rl = routing_len(f);
    uint16_t *r0 = calloc(rl, 2), *r1 = calloc(rl, 2);
    float logp[MAXT], ent[MAXT];
    fx_forward(f, f->m, logp, ent, r0, NULL, 0);
    double maxd = 0.0, maxg = 1e-3;
    *checked = 0;
    for (int i = 0; i < n; i++) {
        size_t p = sample(f->ad, i, 99);
        float keep = f->ad->params[p];
        f->ad->params[p] = keep + eps;
        double lp = fx_forward(f, f->m, logp, ent, r1, NULL, 0);
        int same = memcmp(r0, r1, rl * 2) == 0;
        f->ad->params[p] = keep - eps;
        double lm = fx_forward(f, f->m, logp, ent, r1, NULL, 0);
        same = same && memcmp(r0, r1, rl * 2) == 0;
        f->ad->params[p] = keep;
        if (!same)
            continue;
        double fd = (lp - lm) / (2.0 * (double)eps), an = f->ad->grads[p];
        maxd = fmax(maxd, fabs(fd - an));
        maxg = fmax(maxg, fabs(an));
        (*checked)++;
    }
    free(r0);
    free(r1);
    return maxd / maxg;
}

static double fd_check(fx_t *f, int n, float eps, int *checked) {
    return fd_check_with(f, n, eps, checked, sample_param);
}

static void run_fd(fx_kind_t kind, float aux) {
    fx_t f;
    model_opts_t o = {0, 0, aux};
    fx_open(&f, kind, &o, 0.15f);
    if (aux > 0.0f) /* the balance loss alone, so that its gradient is what is checked */
        for (int t = 0; t < f.T; t++)
            f.a[t] = f.b[t] = 0.0f;
    int checked = 0;
    double err = fd_check(&f, 48, 1e-3f, &checked);
    if (checked < 36)
        tu_report("only %d of 48 finite-difference samples kept their routing", checked);
    CU_ASSERT(checked >= 36);
    TU_ASSERT_CLOSE(err, 1e-2,
                    aux > 0.0f         ? "balance loss LoRA gradient"
                    : kind == FX_QWEN3 ? "qwen3 LoRA gradient"
                                       : "mixtral LoRA gradient");
    if (aux > 0.0f)
        CU_ASSERT(model_aux_loss(f.m) > 0.0f);
    fx_close(&f);
}

/* The balance loss pooled over the MoE layers (model_set_aux_pool) alone: its LoRA
 * gradient against central differences; the per-layer shares sum to a positive loss that
 * differs from the per-layer form's. */
static void run_fd_pool(fx_kind_t kind) {
    fx_t f;
    model_opts_t o = {0, 0, 0.05f};
    fx_open(&f, kind, &o, 0.15f);
    for (int t = 0; t < f.T; t++)
        f.a[t] = f.b[t] = 0.0f;
    float logp[MAXT], ent[MAXT];
    fx_forward(&f, f.m, logp, ent, NULL, NULL, 0);
    double per_layer = model_aux_loss(f.m);
    CU_ASSERT_EQUAL_FATAL(model_set_aux_pool(f.m, 2), MO_EINVAL);
    CU_ASSERT_EQUAL_FATAL(model_set_aux_pool(f.m, 1), MO_OK);
    fx_forward(&f, f.m, logp, ent, NULL, NULL, 0);
    double pooled = model_aux_loss(f.m);
    CU_ASSERT(pooled > 0.0 && fabs(pooled - per_layer) > 1e-6 * per_layer);
    int checked = 0;
    double err = fd_check(&f, 48, 1e-3f, &checked);
    if (checked < 36)
        tu_report("only %d of 48 finite-difference samples kept their routing", checked);
    CU_ASSERT(checked >= 36);
    TU_ASSERT_CLOSE(err, 1e-2,
                    kind == FX_QWEN3 ? "qwen3 pooled balance loss LoRA gradient"
                                     : "mixtral pooled balance loss LoRA gradient");
    /* With recompute: the same pooled loss and the same gradient bits. */
    model_t *rm = NULL;
    model_opts_t ro = {1, 0, 0.05f};
    CU_ASSERT_EQUAL_FATAL(model_open(&rm, f.dir, &ro), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(rm, f.ad), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_aux_pool(rm, 1), 0);
    size_t n = f.ad->n_params;
    float *g0 = malloc(sizeof(float) * n);
    fx_gradient(&f);
    memcpy(g0, f.ad->grads, sizeof(float) * n);
    fx_forward(&f, rm, logp, ent, NULL, NULL, 1);
    CU_ASSERT((double)model_aux_loss(rm) == pooled);
    lora_adapter_zero_grads(f.ad);
    CU_ASSERT_EQUAL_FATAL(model_backward(rm, f.a, f.b), 0);
    CU_ASSERT(memcmp(g0, f.ad->grads, sizeof(float) * n) == 0);
    free(g0);
    model_destroy(&rm);
    fx_close(&f);
}

/* Parameter index of a sample among the full tensors: tensor by turns, element at random. */
static size_t sample_full(const lora_adapter_t *ad, int i, uint64_t seed) {
    const lora_tensor_t *t = &ad->tensors[ad->n_tensors - ad->n_full + i % ad->n_full];
    size_t j = (size_t)(rng_uniform(seed, 9, (uint64_t)i) * (float)t->numel) % t->numel;
    return t->offset + j;
}

/* Router and norm weights trained in full (model_adapter_add_full), with the balance
 * loss on: the table and initial values, their gradients against central differences,
 * the frozen weights back after unbinding, and a full tensor the model lacks refused. */
static void run_fd_full(fx_kind_t kind, int recompute) {
    fx_t f;
    model_opts_t o = {recompute, 0, 0.05f};
    fx_open(&f, kind, &o, 0.15f);
    model_t *m = f.m;
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, NULL), 0);
    const float *norm0 = m->layers[0].attn_norm, *fnorm0 = m->final_norm;
    const void *router0 = m->layers[0].moe_w.router.data;
    CU_ASSERT_FATAL(m->layers[0].moe);
    int lora_tensors = f.ad->n_tensors, want = 1;
    for (int l = 0; l < m->L; l++)
        want += 2 + (m->layers[l].q_norm ? 2 : 0) + m->layers[l].moe;
    CU_ASSERT_EQUAL_FATAL(model_adapter_add_full(m, f.ad, 1, 1), 0);
    CU_ASSERT_EQUAL(f.ad->n_full, want);
    CU_ASSERT_EQUAL(f.ad->n_tensors, lora_tensors + want);
    const lora_tensor_t *t0 = &f.ad->tensors[lora_tensors],
                        *tl = &f.ad->tensors[f.ad->n_tensors - 1];
    CU_ASSERT_STRING_EQUAL(t0->name, "model.layers.0.input_layernorm.weight");
    CU_ASSERT_STRING_EQUAL(tl->name, "model.norm.weight");
    CU_ASSERT(memcmp(f.ad->params + t0->offset, norm0, sizeof(float) * (size_t)m->D) == 0);
    int rt = lora_adapter_find_full(f.ad, kind == FX_MIXTRAL
                                              ? "model.layers.0.block_sparse_moe.gate.weight"
                                              : "model.layers.0.mlp.gate.weight");
    CU_ASSERT_FATAL(rt >= 0);
    CU_ASSERT(f.ad->tensors[rt].shape[0] == m->E && f.ad->tensors[rt].shape[1] == m->D);
    CU_ASSERT(memcmp(f.ad->params + f.ad->tensors[rt].offset, router0,
                     sizeof(float) * (size_t)m->E * m->D) == 0); /* the fixture is F32 */
    if (kind == FX_QWEN3)
        CU_ASSERT(lora_adapter_find_full(f.ad, "model.layers.0.self_attn.q_norm.weight") >= 0);
    /* Away from the initial values, so that every weight matters on its own. */
    for (int t = lora_tensors; t < f.ad->n_tensors; t++) {
        float *p = f.ad->params + f.ad->tensors[t].offset;
        for (size_t j = 0; j < f.ad->tensors[t].numel; j++)
            p[j] *= 0.7f + 0.6f * rng_uniform(21, (uint64_t)t, j);
    }
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, f.ad), 0);
    CU_ASSERT(m->layers[0].attn_norm == f.ad->params + t0->offset);
    CU_ASSERT(m->final_norm == f.ad->params + tl->offset);
    CU_ASSERT(m->d_final_norm == f.ad->grads + tl->offset);
    int checked = 0;
    double err = fd_check_with(&f, 60, 1e-3f, &checked, sample_full);
    if (checked < 40)
        tu_report("only %d of 60 finite-difference samples kept their routing", checked);
    CU_ASSERT(checked >= 40);
    TU_ASSERT_CLOSE(err, 1e-2,
                    kind == FX_QWEN3 ? "qwen3 router and norm gradients"
                                     : "mixtral router and norm gradients");
    /* Every full tensor received a gradient. */
    for (int t = lora_tensors; t < f.ad->n_tensors; t++) {
        double g = 0.0;
        for (size_t j = 0; j < f.ad->tensors[t].numel; j++)
            g += fabs(f.ad->grads[f.ad->tensors[t].offset + j]);
        if (!(g > 0.0))
            tu_report("no gradient for %s", f.ad->tensors[t].name);
        CU_ASSERT(g > 0.0);
    }
    CU_ASSERT_EQUAL(model_set_adapter(m, NULL), 0);
    CU_ASSERT(m->layers[0].attn_norm == norm0 && m->final_norm == fnorm0);
    CU_ASSERT(m->layers[0].moe_w.router.data == router0);
    CU_ASSERT_PTR_NULL(m->layers[0].d_attn_norm);
    CU_ASSERT_PTR_NULL(m->layers[0].moe_w.drouter);
    /* A full tensor that is not a weight of the model. */
    lora_adapter_t *other = make_adapter(m, "q_proj", 2);
    float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(other, "model.layers.0.foo.weight", 4, 1, v), 0);
    CU_ASSERT_EQUAL(lora_adapter_add_full(other, "model.layers.0.foo.weight", 4, 1, v), MO_EINVAL);
    CU_ASSERT_EQUAL(model_set_adapter(m, other), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "model.layers.0.foo.weight"));
    CU_ASSERT_PTR_NULL(m->adapter);
    CU_ASSERT_PTR_NULL(m->layers[0].lora_q);
    lora_adapter_destroy(&other);
    fx_close(&f);
}

static void test_fd_full_qwen3(void) {
    run_fd_full(FX_QWEN3, 0);
}

static void test_fd_full_mixtral_recompute(void) {
    run_fd_full(FX_MIXTRAL, 1);
}

static void test_fd_aux_pool(void) {
    run_fd_pool(FX_QWEN3);
    run_fd_pool(FX_MIXTRAL);
}

static void test_fd_qwen3(void) {
    run_fd(FX_QWEN3, 0.0f);
}

static void test_fd_mixtral_window(void) {
    run_fd(FX_MIXTRAL, 0.0f);
}

static void test_fd_aux_loss(void) {
    run_fd(FX_QWEN3, 1.0f);
}

/* The DeepSeek-V3 feed-forward (sigmoid routing with a correction bias, group limit,
 * routed scaling, a shared expert) behind GQA attention: the Qwen3 fixture's last MoE
 * layer is switched to it through the public layer struct. */
static void test_fd_deepseek_moe_path(void) {
    fx_t f;
    fx_open(&f, FX_QWEN3, NULL, 0.15f);
    model_layer_t *ly = &f.m->layers[2];
    int E = f.m->E, D = f.m->D, F = ly->moe_cfg.F;
    float bias[8], *sw = malloc(sizeof(float) * 3 * (size_t)F * D);
    CU_ASSERT_FATAL(E == 8);
    tu_fill(bias, 8, 41, 0.0f, 0.3f); /* biased scores stay > 0, above masked groups' 0 */
    rng_fill_normal(sw, 3 * (size_t)F * D, 42, 1, 0.0f, 0.15f);
    router_cfg_t *r = &ly->moe_cfg.router;
    router_cfg_init(r, ROUTER_SIGMOID_GROUPED, E, f.m->K);
    r->norm_topk_prob = 1;
    r->routed_scaling_factor = 2.5f;
    r->n_group = 2;
    r->topk_group = 1;
    r->e_score_correction_bias = bias;
    ly->moe_cfg.n_shared = 1;
    ly->moe_w.shared.gate = wview_f32(sw);
    ly->moe_w.shared.up = wview_f32(sw + (size_t)F * D);
    ly->moe_w.shared.down = wview_f32(sw + 2 * (size_t)F * D);
    int checked = 0;
    double err = fd_check(&f, 48, 1e-3f, &checked);
    CU_ASSERT(checked >= 36);
    TU_ASSERT_CLOSE(err, 1e-2, "deepseek feed-forward LoRA gradient");
    /* The group limit holds: both experts of a token come from one group of 4. */
    size_t rl = routing_len(&f);
    uint16_t *rt = malloc(rl * 2);
    float logp[MAXT], ent[MAXT];
    fx_forward(&f, f.m, logp, ent, rt, NULL, 0);
    for (int t = 0; t < f.T; t++) {
        const uint16_t *x = rt + ((size_t)t * 2 + 1) * 2; /* MoE layer 1 of 2 */
        CU_ASSERT(x[0] / 4 == x[1] / 4);
    }
    free(rt);
    free(sw);
    fx_close(&f);
}

/* ------------------------------------------------------------------------ */
/* Exact identities.                                                         */

static void test_recompute_identical(void) {
    fx_t f;
    fx_open(&f, FX_QWEN3, NULL, 0.15f);
    model_t *rm = NULL;
    model_opts_t o = {1, 0, 0.0f};
    CU_ASSERT_EQUAL_FATAL(model_open(&rm, f.dir, &o), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(rm, f.ad), 0);
    size_t n = f.ad->n_params;
    float *g0 = malloc(sizeof(float) * n);
    fx_gradient(&f);
    memcpy(g0, f.ad->grads, sizeof(float) * n);
    float l0[MAXT], e0[MAXT], l1[MAXT], e1[MAXT];
    fx_forward(&f, f.m, l0, e0, NULL, NULL, 1);
    fx_forward(&f, rm, l1, e1, NULL, NULL, 1);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    lora_adapter_zero_grads(f.ad);
    CU_ASSERT_EQUAL_FATAL(model_backward(rm, f.a, f.b), 0);
    CU_ASSERT(memcmp(g0, f.ad->grads, sizeof(float) * n) == 0);
    double gmax = 0.0;
    for (size_t i = 0; i < n; i++)
        gmax = fmax(gmax, fabs(g0[i]));
    CU_ASSERT(gmax > 1e-4); /* the gradient is not trivially zero */
    /* Inference mode computes the same numbers. */
    fx_forward(&f, f.m, l1, e1, NULL, NULL, 0);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    free(g0);
    model_destroy(&rm);
    fx_close(&f);
}

static void test_replay(void) {
    fx_t f;
    fx_open(&f, FX_MIXTRAL, NULL, 0.15f);
    size_t rl = routing_len(&f), n = f.ad->n_params;
    uint16_t *rec = malloc(rl * 2), *again = malloc(rl * 2);
    float l0[MAXT], e0[MAXT], l1[MAXT], e1[MAXT];
    float *g0 = malloc(sizeof(float) * n);
    fx_forward(&f, f.m, l0, e0, rec, NULL, 1);
    lora_adapter_zero_grads(f.ad);
    CU_ASSERT_EQUAL_FATAL(model_backward(f.m, f.a, f.b), 0);
    memcpy(g0, f.ad->grads, sizeof(float) * n);
    memset(again, 0xff, rl * 2);
    fx_forward(&f, f.m, l1, e1, again, rec, 1);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(rec, again, rl * 2) == 0);
    lora_adapter_zero_grads(f.ad);
    CU_ASSERT_EQUAL_FATAL(model_backward(f.m, f.a, f.b), 0);
    CU_ASSERT(memcmp(g0, f.ad->grads, sizeof(float) * n) == 0);
    /* A different routing is used when replayed: every slot moves to another expert. */
    int E = f.m->E;
    for (size_t i = 0; i < rl; i++)
        again[i] = (uint16_t)((rec[i] + 1) % E);
    uint16_t *got = malloc(rl * 2);
    fx_forward(&f, f.m, l1, e1, got, again, 0);
    CU_ASSERT(memcmp(got, again, rl * 2) == 0);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) != 0);
    /* An expert index outside [0, E) is rejected. */
    again[3] = (uint16_t)E;
    model_batch_t b = fx_view(&f, again, NULL);
    CU_ASSERT_EQUAL(model_forward(f.m, &b, l1, NULL, 0), MO_EMALFORMED);
    free(got);
    free(rec);
    free(again);
    free(g0);
    fx_close(&f);
}

static void test_base_equals_zero_b(void) {
    fx_t f;
    fx_open(&f, FX_QWEN3, NULL, 0.15f);
    float l0[MAXT], e0[MAXT], l1[MAXT], e1[MAXT];
    CU_ASSERT_EQUAL(model_set_adapter(f.m, NULL), 0);
    fx_forward(&f, f.m, l0, e0, NULL, NULL, 0);
    CU_ASSERT_EQUAL(model_set_adapter(f.m, f.ad), 0);
    fx_forward(&f, f.m, l1, e1, NULL, NULL, 0);
    CU_ASSERT(tu_rel_err_ff(l1, l0, (size_t)f.T, 1.0) > 1e-4); /* the adapter matters */
    for (int i = 1; i < f.ad->n_tensors; i += 2)
        memset(f.ad->params + f.ad->tensors[i].offset, 0, sizeof(float) * f.ad->tensors[i].numel);
    fx_forward(&f, f.m, l1, e1, NULL, NULL, 0);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    fx_close(&f);
}

/* The packed batch equals each sequence run alone. */
static void test_packed_equals_separate(void) {
    fx_t f;
    fx_open(&f, FX_MIXTRAL, NULL, 0.15f);
    static const int lens[3] = {11, 5, 8};
    fx_batch(&f, lens, 3, 21);
    float lp[MAXT], ep[MAXT], ls[MAXT], es[MAXT];
    fx_forward(&f, f.m, lp, ep, NULL, NULL, 0);
    for (int b = 0; b < f.B; b++) {
        int s0 = f.cu[b], n = f.cu[b + 1] - s0;
        int32_t cu[2] = {0, n};
        model_batch_t one = {n,    1,   f.tok + s0, f.pos + s0, cu, f.tgt + s0, f.temperature,
                             NULL, NULL};
        CU_ASSERT_EQUAL_FATAL(model_forward(f.m, &one, ls + s0, es + s0, 0), 0);
    }
    TU_ASSERT_CLOSE(tu_rel_err_ff(lp, ls, (size_t)f.T, 1.0), 1e-6, "packed logprobs");
    TU_ASSERT_CLOSE(tu_rel_err_ff(ep, es, (size_t)f.T, 1.0), 1e-6, "packed entropies");
    fx_close(&f);
}

static void test_deterministic_and_stats(void) {
    fx_t f;
    fx_open(&f, FX_QWEN3, NULL, 0.15f);
    float l0[MAXT], e0[MAXT], l1[MAXT], e1[MAXT];
    fx_forward(&f, f.m, l0, e0, NULL, NULL, 0);
    fx_forward(&f, f.m, l1, e1, NULL, NULL, 0);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT_EQUAL(f.m->n_moe, 2);
    for (int t = 0; t < f.T; t++) {
        CU_ASSERT(f.tgt[t] >= 0 ? l0[t] < 0.0f : l0[t] == 0.0f);
        CU_ASSERT(e0[t] > 0.0f && e0[t] <= logf(261.0f) + 1e-4f);
    }
    for (int i = 0; i < f.m->n_moe; i++) {
        const model_moe_stats_t *s = &f.m->stats[i];
        int64_t sum = 0, mx = 0;
        for (int e = 0; e < f.m->E; e++) {
            sum += s->load[e];
            mx = s->load[e] > mx ? s->load[e] : mx;
        }
        CU_ASSERT_EQUAL(sum, (int64_t)f.T * f.m->K);
        CU_ASSERT(fabsf(s->imbalance - (float)mx / ((float)sum / (float)f.m->E)) < 1e-5f);
        CU_ASSERT(s->layer == (i == 0 ? 0 : 2)); /* layer 1 is dense */
    }
    fx_close(&f);
}

static void test_bad_inputs(void) {
    fx_t f;
    fx_open(&f, FX_QWEN3, NULL, 0.15f);
    float lp[MAXT];
    model_batch_t b = fx_view(&f, NULL, NULL);
    CU_ASSERT_EQUAL(model_backward(f.m, f.a, f.b), MO_ESTATE);
    int32_t keep = f.tok[4];
    f.tok[4] = 261;
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 0), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "token 4 is id 261"));
    f.tok[4] = keep;
    f.tgt[5] = 300;
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 0), MO_EINVAL);
    f.tgt[5] = 1;
    f.cu[1] = 20;
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 0), MO_EINVAL);
    f.cu[1] = 9;
    b.temperature = 0.0f;
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 0), MO_EINVAL);
    b.temperature = 1.0f;
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 1), 0);
    CU_ASSERT_EQUAL(model_set_adapter(f.m, f.ad), 0); /* rebinding invalidates the step */
    CU_ASSERT_EQUAL(model_backward(f.m, f.a, f.b), MO_ESTATE);
    CU_ASSERT_EQUAL(model_forward(f.m, &b, lp, NULL, 0), 0);
    CU_ASSERT_EQUAL(model_backward(f.m, f.a, f.b), MO_ESTATE); /* inference forward */
    fx_close(&f);
}

/* Module list and adapter binding. */
static void test_modules_and_binding(void) {
    fx_t f;
    fx_open(&f, FX_MIXTRAL, NULL, 0.02f);
    model_t *m = f.m;
    int E = m->E;
    CU_ASSERT_EQUAL(m->n_modules, m->L * (4 + 3 * E));
    CU_ASSERT_STRING_EQUAL(m->modules[0].name, "model.layers.0.self_attn.q_proj");
    CU_ASSERT_EQUAL(m->modules[1].OC, m->Hkv * m->Dh);
    CU_ASSERT_STRING_EQUAL(m->modules[4].name, "model.layers.0.block_sparse_moe.experts.0.w1");
    CU_ASSERT_STRING_EQUAL(m->modules[4].proj, "gate_proj");
    CU_ASSERT_STRING_EQUAL(m->modules[5].name, "model.layers.0.block_sparse_moe.experts.0.w3");
    CU_ASSERT_STRING_EQUAL(m->modules[6].name, "model.layers.0.block_sparse_moe.experts.0.w2");
    CU_ASSERT_EQUAL(m->modules[6].C, m->cfg.moe_intermediate_size);
    CU_ASSERT_EQUAL(m->modules[6].kind, LORA_KIND_EXPERT);
    /* Targets by projection words select across the model. */
    lora_adapter_t *ad = make_adapter(m, "gate_proj", 2);
    CU_ASSERT_EQUAL(ad->n_entries, m->L * E);
    CU_ASSERT_EQUAL(model_set_adapter(m, ad), 0);
    CU_ASSERT_PTR_NOT_NULL(m->layers[1].expert_lora[3]);
    CU_ASSERT_PTR_NULL(m->layers[1].expert_lora[E + 3]);
    CU_ASSERT_PTR_NULL(m->layers[1].lora_q);
    /* An adapter whose module has another shape is refused and nothing stays bound. */
    lora_module_desc_t bad = m->modules[4];
    bad.C += 1;
    const char *targets[1] = {"gate_proj"};
    lora_config_t lc = {2, 4.0f, 0, 0.0f, 1, 0, targets, 1};
    lora_adapter_t *other = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&other, &lc, &bad, 1), 0);
    CU_ASSERT_EQUAL(model_set_adapter(m, other), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "block_sparse_moe.experts.0.w1"));
    CU_ASSERT_PTR_NULL(m->layers[0].expert_lora[0]);
    CU_ASSERT_PTR_NULL(m->adapter);
    lora_adapter_destroy(&other);
    /* ... and so is one naming a module the model does not have. */
    bad = m->modules[4];
    bad.name = "model.layers.9.block_sparse_moe.experts.0.w1";
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&other, &lc, &bad, 1), 0);
    CU_ASSERT_EQUAL(model_set_adapter(m, other), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "not a projection of this model"));
    lora_adapter_destroy(&other);
    lora_adapter_destroy(&ad);
    fx_close(&f);
}

/* ------------------------------------------------------------------------ */
/* PyTorch reference.                                                        */

/* Writes the batch and objective for tests/model_ref.py. */
static int write_ref_input(const fx_t *f, const char *path) {
    FILE *fp = fopen(path, "w");
    if (!fp)
        return -1;
    fprintf(fp, "{\"temperature\": %.9g, \"cu\": [", (double)f->temperature);
    for (int b = 0; b <= f->B; b++)
        fprintf(fp, "%s%d", b ? ", " : "", f->cu[b]);
    const char *keys[5] = {"tokens", "positions", "targets", "a", "b"};
    for (int k = 0; k < 5; k++) {
        fprintf(fp, "], \"%s\": [", keys[k]);
        for (int t = 0; t < f->T; t++) {
            if (k < 3) {
                const int32_t *v = k == 0 ? f->tok : k == 1 ? f->pos : f->tgt;
                fprintf(fp, "%s%d", t ? ", " : "", v[t]);
            } else {
                fprintf(fp, "%s%.9g", t ? ", " : "", (double)(k == 3 ? f->a[t] : f->b[t]));
            }
        }
    }
    fprintf(fp, "]}\n");
    return fclose(fp);
}

/* Reads n doubles written one per line after a "# name" header line. */
static int read_block(FILE *fp, const char *name, double *v, size_t n) {
    char line[256];
    if (!fgets(line, sizeof line, fp) || strncmp(line, "# ", 2) ||
        strncmp(line + 2, name, strlen(name)))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (fscanf(fp, "%lf\n", &v[i]) != 1)
            return -1;
    return 0;
}

static void run_reference(fx_kind_t kind) {
    fx_t f;
    fx_open(&f, kind, NULL, 0.15f);
    char adir[600], in[600], out[600], cmd[4096];
    snprintf(adir, sizeof adir, "%s/adapter", f.dir);
    snprintf(in, sizeof in, "%s/batch.json", f.dir);
    snprintf(out, sizeof out, "%s/ref.txt", f.dir);
    CU_ASSERT_EQUAL_FATAL(peft_save(f.ad, adir, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(write_ref_input(&f, in), 0);
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/model_ref.py' '%s' '%s' '%s' > '%s'", tu_python(),
             tu_source_dir(), f.dir, adir, in, out);
    int st = system(cmd);
    if (st != 0)
        tu_report("reference script failed (%d): %s", st, cmd);
    CU_ASSERT_EQUAL_FATAL(st, 0);
    fx_gradient(&f);
    float logp[MAXT], ent[MAXT];
    fx_forward(&f, f.m, logp, ent, NULL, NULL, 0);
    size_t n = f.ad->n_params;
    double *rl = malloc(sizeof(double) * (size_t)f.T), *re = malloc(sizeof(double) * (size_t)f.T);
    double *rg = malloc(sizeof(double) * n);
    FILE *fp = fopen(out, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "logp", rl, (size_t)f.T), 0);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "entropy", re, (size_t)f.T), 0);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "grads", rg, n), 0);
    fclose(fp);
    TU_ASSERT_CLOSE(tu_rel_err_fd(logp, rl, (size_t)f.T, 1.0), 5e-6, "logprobs vs PyTorch");
    TU_ASSERT_CLOSE(tu_rel_err_fd(ent, re, (size_t)f.T, 1.0), 5e-6, "entropies vs PyTorch");
    TU_ASSERT_CLOSE(tu_rel_err_fd(f.ad->grads, rg, n, 1e-3), 1e-5, "LoRA gradients vs PyTorch");
    free(rl);
    free(re);
    free(rg);
    fx_close(&f);
}

static void test_reference_qwen3(void) {
    run_reference(FX_QWEN3);
}

static void test_reference_mixtral(void) {
    run_reference(FX_MIXTRAL);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"fd_qwen3", test_fd_qwen3},
        {"fd_mixtral_window", test_fd_mixtral_window},
        {"fd_aux_loss", test_fd_aux_loss},
        {"fd_aux_pool", test_fd_aux_pool},
        {"fd_deepseek_moe_path", test_fd_deepseek_moe_path},
        {"fd_full_qwen3", test_fd_full_qwen3},
        {"fd_full_mixtral_recompute", test_fd_full_mixtral_recompute},
        {"recompute_identical", test_recompute_identical},
        {"replay", test_replay},
        {"base_equals_zero_b", test_base_equals_zero_b},
        {"packed_equals_separate", test_packed_equals_separate},
        {"deterministic_and_stats", test_deterministic_and_stats},
        {"bad_inputs", test_bad_inputs},
        {"modules_and_binding", test_modules_and_binding},
        {"reference_qwen3", test_reference_qwen3},
        {"reference_mixtral", test_reference_mixtral},
        CU_TEST_INFO_NULL,
    };
    return tu_main("model", tests);
}
