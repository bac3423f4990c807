/* test_golden: the actor against the PyTorch reference (tests/golden/make_golden.py) on
 * tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models in f32 and bf16: logprobs, entropies,
 * routing, the loss, LoRA gradients, and LoRA parameters after AdamW steps, tensor by
 * tensor.
 * Exits 77 (skipped) when Debian's python3 cannot import torch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/backend.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "lora/peft.h"
#include "tests/testutil.h"

/* Tolerances (f32 compute on both sides; bf16 weights are widened to f32 exactly).
 * logp and entropy: absolute, in nats. loss: relative. Gradients: per tensor,
 * max |c - torch| / max(max |torch|, GRAD_FLOOR * the largest |torch| of all tensors).
 * AdamW: max |c - torch| over all parameters, in units of lr. */
#define TOL_LOGP 2e-5
#define TOL_ENTROPY 2e-5
#define TOL_LOSS 1e-5
#define TOL_GRAD 2e-4
#define GRAD_FLOOR 1e-2
#define TOL_ADAMW_LR 2e-2

#define MAXT 64
#define ADAMW_STEPS 3

/* One comparison: a model (the `moerl init-model` preset, or a variant written through
 * the C API), an adapter and a batch. */
typedef struct gcase {
    const char *name;
    model_arch_t arch;
    dtype_t dtype;
    int variant;       /* 0: moerl init-model preset; 1: the variant config of variant_config */
    int rslora;        /* adapter scale alpha / sqrt(R) */
    float temperature; /* of the logprobs */
    float aux_coef;    /* moerl's balance-loss coefficient (model_opts_t.aux_coef) */
    int aux_pool;      /* model_set_aux_pool: against transformers' load_balancing_loss_func */
} gcase_t;

static const gcase_t g_cases[] = {
    {"qwen3_moe-f32", ARCH_QWEN3_MOE, DT_F32, 0, 0, 1.0f, 0.0f, 0},
    {"qwen3_moe-bf16", ARCH_QWEN3_MOE, DT_BF16, 0, 1, 0.7f, 0.0f, 0},
    {"mixtral-f32", ARCH_MIXTRAL, DT_F32, 0, 0, 1.0f, 0.01f, 0},
    {"mixtral-bf16", ARCH_MIXTRAL, DT_BF16, 0, 0, 1.3f, 0.0f, 0},
    {"qwen3_moe-variant", ARCH_QWEN3_MOE, DT_F32, 1, 0, 0.9f, 0.02f, 0},
    {"mixtral-variant", ARCH_MIXTRAL, DT_BF16, 1, 1, 1.0f, 0.0f, 0},
    {"deepseek_v3-f32", ARCH_DEEPSEEK_V3, DT_F32, 0, 0, 1.0f, 0.0f, 0},
    {"deepseek_v3-variant", ARCH_DEEPSEEK_V3, DT_BF16, 1, 1, 0.8f, 0.01f, 0},
    {"qwen3_moe-aux-pooled", ARCH_QWEN3_MOE, DT_F32, 1, 0, 1.0f, 0.05f, 1},
    {"mixtral-aux-pooled", ARCH_MIXTRAL, DT_F32, 0, 0, 1.0f, 0.02f, 1},
};

/* AdamW hyperparameters of the parameter comparison. */
static const float g_lr = 1e-2f, g_b1 = 0.9f, g_b2 = 0.95f, g_eps = 1e-8f, g_wd = 0.1f;

static char g_root[512];

/* Runs a shell command; its exit status, or -1. */
static int run_cmd(const char *cmd) {
    int rc = system(cmd);
    if (rc == -1 || !WIFEXITED(rc))
        return -1;
    return WEXITSTATUS(rc);
}

static int torch_available(void) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s -c 'import torch' >/dev/null 2>&1", tu_python());
    return run_cmd(cmd) == 0;
}

/* The variant configs: what the presets do not exercise.
 * Qwen3: 3 layers, the middle one dense (mlp_only_layers), a sliding window of 5 on layers
 * >= 1, tied embeddings, no top-k renormalisation, YaRN RoPE scaling.
 * Mixtral: a sliding window of 6 on every layer and llama3 RoPE scaling.
 * DeepSeek-V3: 3 layers (the first dense), q_proj instead of the latent q, rope dims not
 * interleaved, YaRN with mscale_all_dim (squared attention scale), 4 expert groups of
 * which 2 are kept, no top-k renormalisation; random e_score_correction_bias
 * (randomise_bias). */
static void variant_config(model_config_t *c, model_arch_t arch) {
    if (arch == ARCH_DEEPSEEK_V3) {
        c->num_hidden_layers = 3;
        c->q_lora_rank = 0;
        c->rope_interleave = 0;
        c->n_group = 4;
        c->topk_group = 2;
        c->norm_topk_prob = 0;
        c->max_position_embeddings = 4096;
        rope_scaling_t r = {ROPE_YARN, 4.0f, 0, 0, 1024, 32.0f, 1.0f, 1.0f, 1.0f, 0};
        c->rope_scaling = r;
    } else if (arch == ARCH_QWEN3_MOE) {
        c->num_hidden_layers = 3;
        c->mlp_only_layers[1] = 1;
        c->use_sliding_window = 1;
        c->sliding_window = 5;
        c->max_window_layers = 1;
        c->tie_word_embeddings = 1;
        c->norm_topk_prob = 0;
        c->rope_theta = 10000.0;
        c->max_position_embeddings = 4096;
        rope_scaling_t r = {ROPE_YARN, 4.0f, 0, 0, 1024, 32.0f, 1.0f, 0, 0, 0};
        c->rope_scaling = r;
    } else {
        c->sliding_window = 6;
        c->rope_theta = 10000.0;
        rope_scaling_t r = {ROPE_LLAMA3, 8.0f, 1.0f, 4.0f, 64, 0, 0, 0, 0, 0};
        c->rope_scaling = r;
    }
}

/* Rewrites dir/model.safetensors with random e_score_correction_bias vectors (the
 * initialiser writes zeros), so that the bias changes which experts are chosen. */
static int randomise_bias(const char *dir) {
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", dir, ST_SINGLE_NAME);
    st_file_t *f = NULL;
    TRY(st_open(&f, path));
    int n = st_count(f), rc = MO_OK;
    size_t nb = 0;
    for (int i = 0; i < n; i++) {
        const st_info_t *in = st_info(f, i);
        if (strstr(in->name, "e_score_correction_bias") && (in->dtype != DT_F32 || in->ndim != 1))
            rc = mo_errorf(MO_EMALFORMED, "%s: %s is not a 1-D F32 tensor", path, in->name);
        else if (strstr(in->name, "e_score_correction_bias"))
            nb += (size_t)in->shape[0];
    }
    st_item_t *items = calloc(n > 0 ? (size_t)n : 1, sizeof *items);
    float *bias = malloc(sizeof(float) * (nb ? nb : 1));
    if (rc == MO_OK && (!items || !bias))
        rc = mo_errorf(MO_ENOMEM, "randomise_bias: out of memory");
    for (int i = 0, off = 0; rc == MO_OK && i < n; i++) {
        items[i].name = st_info(f, i)->name;
        items[i].tensor = st_tensor(f, i);
        if (strstr(items[i].name, "e_score_correction_bias")) {
            size_t E = (size_t)items[i].tensor.shape[0];
            rng_fill_uniform(bias + off, E, 41, (uint64_t)i, -0.05f, 0.05f);
            items[i].tensor.data = bias + off;
            off += (int)E;
        }
    }
    if (rc == MO_OK)
        rc = st_write(path, items, n, NULL, 0);
    free(items);
    free(bias);
    st_close(&f);
    return rc;
}

/* Writes the case's model directory. */
static int make_model(const gcase_t *gc, const char *dir) {
    if (!gc->variant) {
        char cmd[2048];
        static const char *const arch[ARCH_COUNT] = {"qwen3_moe", "mixtral", "deepseek_v3"};
        snprintf(cmd, sizeof cmd,
                 "%s init-model --arch %s --size tiny --dtype %s --seed 3 --out %s >/dev/null",
                 tu_moerl_exe(), arch[gc->arch], gc->dtype == DT_BF16 ? "bf16" : "f32", dir);
        int rc = run_cmd(cmd);
        if (rc != 0)
            tu_report("%s: `%s` exited with %d", gc->name, cmd, rc);
        return rc == 0 ? 0 : -1;
    }
    model_config_t c;
    TRY(init_model_config(&c, gc->arch, INIT_SIZE_TINY, gc->dtype));
    variant_config(&c, gc->arch);
    TRY(model_config_validate(&c, gc->name));
    init_model_opts_t io = {9, 0.08f};
    TRY(init_model_write(dir, &c, &io));
    return gc->arch == ARCH_DEEPSEEK_V3 ? randomise_bias(dir) : 0;
}

/* An adapter on every projection with random A and B (B is zero at creation). */
static int make_adapter(lora_adapter_t **out, const model_t *m, const gcase_t *gc) {
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {4, 8.0f, gc->rslora, 0.0f, 17, 0, targets, 1};
    TRY(lora_adapter_new(out, &lc, m->modules, m->n_modules));
    lora_adapter_t *ad = *out;
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        float amp = (i % 2) ? 0.15f : 0.25f;
        rng_fill_uniform(ad->params + t->offset, t->numel, 23, 1000 + (uint64_t)i, -amp, amp);
    }
    return 0;
}

/* A packed batch: sequences of 9, 1, 14 and 6 tokens, random ids and loss coefficients. */
typedef struct gbatch {
    int T, B;
    int32_t tok[MAXT], pos[MAXT], tgt[MAXT], cu[8];
    float dlogp[MAXT], dent[MAXT];
} gbatch_t;

static void make_batch(gbatch_t *b, int V, uint64_t seed) {
    static const int lens[4] = {9, 1, 14, 6};
    b->B = 4;
    b->cu[0] = 0;
    for (int i = 0; i < b->B; i++)
        b->cu[i + 1] = b->cu[i] + lens[i];
    b->T = b->cu[b->B];
    for (int t = 0; t < b->T; t++) {
        b->tok[t] = (int32_t)(rng_uniform(seed, 1, (uint64_t)t) * (float)V) % V;
        b->dlogp[t] = 2.0f * rng_uniform(seed, 2, (uint64_t)t) - 1.0f;
        b->dent[t] = rng_uniform(seed, 3, (uint64_t)t) - 0.5f;
    }
    model_batch_next_token(b->pos, b->tgt, b->tok, b->cu, b->B);
    b->tgt[4] = -1; /* a token without a target inside a sequence */
}

static int write_inputs(const char *path, const gbatch_t *b, const gcase_t *gc) {
    int64_t sT[1] = {b->T}, sC[1] = {b->B + 1};
    st_item_t it[6] = {
        {"tokens", tensor_view((void *)b->tok, DT_I32, DEV_CPU, 1, sT)},
        {"positions", tensor_view((void *)b->pos, DT_I32, DEV_CPU, 1, sT)},
        {"cu_seqlens", tensor_view((void *)b->cu, DT_I32, DEV_CPU, 1, sC)},
        {"targets", tensor_view((void *)b->tgt, DT_I32, DEV_CPU, 1, sT)},
        {"dlogp", tensor_view((void *)b->dlogp, DT_F32, DEV_CPU, 1, sT)},
        {"dentropy", tensor_view((void *)b->dent, DT_F32, DEV_CPU, 1, sT)},
    };
    char v[9][32];
    snprintf(v[0], 32, "%.9g", (double)gc->temperature);
    snprintf(v[1], 32, "%.9g", (double)gc->aux_coef);
    snprintf(v[2], 32, "%d", ADAMW_STEPS);
    snprintf(v[3], 32, "%.9g", (double)g_lr);
    snprintf(v[4], 32, "%.9g", (double)g_b1);
    snprintf(v[5], 32, "%.9g", (double)g_b2);
    snprintf(v[6], 32, "%.9g", (double)g_eps);
    snprintf(v[7], 32, "%.9g", (double)g_wd);
    snprintf(v[8], 32, "%d", gc->aux_pool);
    st_meta_t meta[9] = {{"temperature", v[0]}, {"aux_coef", v[1]}, {"adamw_steps", v[2]},
                         {"lr", v[3]},          {"beta1", v[4]},    {"beta2", v[5]},
                         {"eps", v[6]},         {"weight_decay", v[7]}, {"aux_pool", v[8]}};
    return st_write(path, it, 6, meta, 9);
}

/* The golden tensor `name` as f32 with n elements, or NULL (reported). */
static const float *golden(const st_file_t *g, const char *name, size_t n) {
    tensor_t t;
    if (st_get(g, name, &t) < 0 || t.dtype != DT_F32 || (size_t)tensor_numel(&t) != n) {
        tu_report("golden tensor %s: missing, not F32 or not %zu elements", name, n);
        return NULL;
    }
    return (const float *)t.data;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double e = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        e = d > e || isnan(d) ? d : e;
    }
    return e;
}

static double max_abs(const float *a, size_t n) {
    double e = 0.0;
    for (size_t i = 0; i < n; i++)
        e = fabs((double)a[i]) > e ? fabs((double)a[i]) : e;
    return e;
}

/* Everything one case opens. */
typedef struct gctx {
    const gcase_t *gc;
    char dir[768];
    model_t *m;
    lora_adapter_t *ad;
    st_file_t *g;
    gbatch_t b;
} gctx_t;

static int ctx_open(gctx_t *x, const gcase_t *gc) {
    memset(x, 0, sizeof *x);
    x->gc = gc;
    snprintf(x->dir, sizeof x->dir, "%s/%s", g_root, gc->name);
    char model[1024], adapter[1024], in[1024], out[1024], cmd[8192];
    snprintf(model, sizeof model, "%s-model", x->dir);
    snprintf(adapter, sizeof adapter, "%s-adapter", x->dir);
    snprintf(in, sizeof in, "%s-inputs.safetensors", x->dir);
    snprintf(out, sizeof out, "%s-golden.safetensors", x->dir);
    if (make_model(gc, model) < 0)
        return -1;
    model_opts_t o = {0, 0, gc->aux_coef};
    TRY(model_open(&x->m, model, &o));
    TRY(model_set_aux_pool(x->m, gc->aux_pool));
    TRY(make_adapter(&x->ad, x->m, gc));
    TRY(peft_save(x->ad, adapter, NULL));
    make_batch(&x->b, x->m->V, 31);
    TRY(write_inputs(in, &x->b, gc));
    snprintf(cmd, sizeof cmd,
             "%s %s/tests/golden/make_golden.py --model %s --adapter %s --inputs %s --out %s",
             tu_python(), tu_source_dir(), model, adapter, in, out);
    int rc = run_cmd(cmd);
    if (rc != 0) {
        tu_report("%s: `%s` exited with %d", gc->name, cmd, rc);
        return -1;
    }
    return st_open(&x->g, out);
}

static void ctx_close(gctx_t *x) {
    st_close(&x->g);
    lora_adapter_destroy(&x->ad);
    model_destroy(&x->m);
}

/* Forward at the adapter's current parameters; returns the loss in double. */
static double forward(gctx_t *x, float *logp, float *ent, uint16_t *routing) {
    const gbatch_t *b = &x->b;
    model_batch_t mb = {b->T, b->B, b->tok, b->pos, b->cu, b->tgt, x->gc->temperature, NULL,
                        routing};
    tu_poison(logp, (size_t)b->T);
    tu_poison(ent, (size_t)b->T);
    int rc = model_forward(x->m, &mb, logp, ent, 1);
    if (rc < 0)
        tu_report("%s: forward: %s", x->gc->name, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    double L = model_aux_loss(x->m);
    for (int t = 0; t < b->T; t++)
        L += (double)b->dlogp[t] * logp[t] + (double)b->dent[t] * ent[t];
    return L;
}

static void backward(gctx_t *x) {
    lora_adapter_zero_grads(x->ad);
    int rc = model_backward(x->m, x->b.dlogp, x->b.dent);
    if (rc < 0)
        tu_report("%s: backward: %s", x->gc->name, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* Routing: the same experts in the same order for every token and MoE layer. */
static void check_routing(gctx_t *x, const uint16_t *routing) {
    int T = x->b.T, M = x->m->n_moe, K = x->m->K;
    tensor_t t;
    CU_ASSERT_EQUAL_FATAL(st_get(x->g, "routing", &t), 0);
    CU_ASSERT_FATAL(t.dtype == DT_I32 && tensor_numel(&t) == (int64_t)T * M * K);
    const int32_t *ref = t.data;
    int bad = 0;
    for (int i = 0; i < T * M * K; i++)
        bad += ref[i] != (int32_t)routing[i];
    if (bad)
        tu_report("%s: %d of %d routing choices differ", x->gc->name, bad, T * M * K);
    CU_ASSERT_EQUAL(bad, 0);
}

static void check_forward(gctx_t *x, double *loss_err) {
    int T = x->b.T;
    float logp[MAXT], ent[MAXT];
    uint16_t *routing = malloc(sizeof(uint16_t) * (size_t)T * x->m->n_moe * x->m->K);
    CU_ASSERT_FATAL(routing != NULL);
    double L = forward(x, logp, ent, routing);
    const float *glp = golden(x->g, "logp", (size_t)T), *gent = golden(x->g, "entropy", (size_t)T);
    const float *gl = golden(x->g, "loss", 1), *gaux = golden(x->g, "aux_loss", 1);
    CU_ASSERT_FATAL(glp && gent && gl && gaux);
    double elp = max_abs_diff(logp, glp, (size_t)T), een = max_abs_diff(ent, gent, (size_t)T);
    *loss_err = fabs(L - gl[0]) / fmax(fabs((double)gl[0]), 1e-6);
    double eaux = fabs((double)model_aux_loss(x->m) - gaux[0]);
    printf("\n  %-18s logp %.2e  entropy %.2e  loss %.2e (rel)  aux %.2e", x->gc->name, elp, een,
           *loss_err, eaux);
    TU_ASSERT_CLOSE(elp, TOL_LOGP, "logp");
    TU_ASSERT_CLOSE(een, TOL_ENTROPY, "entropy");
    TU_ASSERT_CLOSE(*loss_err, TOL_LOSS, "loss");
    TU_ASSERT_CLOSE(eaux, TOL_LOSS * fmax(fabs((double)gaux[0]), 1.0), "aux loss");
    check_routing(x, routing);
    free(routing);
}

/* Per-tensor normalised error of the C buffer buf against the golden tensors prefix.key. */
static double compare_adapter(gctx_t *x, const float *buf, const char *prefix, double floor_rel,
                              double *worst_abs) {
    const lora_adapter_t *ad = x->ad;
    char key[512];
    double gmax = 0.0, worst = 0.0;
    for (int i = 0; i < ad->n_tensors; i++) {
        snprintf(key, sizeof key, "%s.%s%s", prefix, PEFT_KEY_PREFIX, ad->tensors[i].name);
        const float *ref = golden(x->g, key, ad->tensors[i].numel);
        CU_ASSERT_FATAL(ref != NULL);
        gmax = fmax(gmax, max_abs(ref, ad->tensors[i].numel));
    }
    *worst_abs = 0.0;
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        snprintf(key, sizeof key, "%s.%s%s", prefix, PEFT_KEY_PREFIX, t->name);
        const float *ref = golden(x->g, key, t->numel);
        double d = max_abs_diff(buf + t->offset, ref, t->numel);
        double e = d / fmax(max_abs(ref, t->numel), floor_rel * gmax);
        if (e > worst)
            worst = e;
        if (d > *worst_abs)
            *worst_abs = d;
    }
    return worst;
}

static void check_grads(gctx_t *x) {
    backward(x);
    double abs_err;
    double e = compare_adapter(x, x->ad->grads, "grad", GRAD_FLOOR, &abs_err);
    printf("  grads %.2e (norm)", e);
    TU_ASSERT_CLOSE(e, TOL_GRAD, "LoRA gradients");
}

/* ADAMW_STEPS of forward, backward and the kernel table's AdamW, against torch.optim.AdamW. */
static void check_adamw(gctx_t *x) {
    lora_adapter_t *ad = x->ad;
    size_t n = ad->n_params;
    float *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
    CU_ASSERT_FATAL(m && v);
    const float *gloss = golden(x->g, "adamw_loss", ADAMW_STEPS);
    CU_ASSERT_FATAL(gloss != NULL);
    const kernels_t *k = backend_cpu()->k;
    float logp[MAXT], ent[MAXT];
    double eloss = 0.0;
    for (int s = 1; s <= ADAMW_STEPS; s++) {
        double L = forward(x, logp, ent, NULL);
        eloss = fmax(eloss, fabs(L - gloss[s - 1]) / fmax(fabs((double)gloss[s - 1]), 1e-6));
        backward(x);
        k->adamw_update(ad->params, ad->grads, m, v, n, g_lr, g_b1, g_b2, g_eps, g_wd, s);
    }
    double abs_err;
    compare_adapter(x, ad->params, "adamw", 1.0, &abs_err);
    printf("  adamw loss %.2e  params %.2e lr", eloss, abs_err / g_lr);
    TU_ASSERT_CLOSE(eloss, TOL_LOSS, "loss during AdamW");
    TU_ASSERT_CLOSE(abs_err / g_lr, TOL_ADAMW_LR, "LoRA parameters after AdamW");
    free(m);
    free(v);
}

static void run_case(const gcase_t *gc) {
    gctx_t x;
    int rc = ctx_open(&x, gc);
    if (rc < 0)
        tu_report("%s: %s", gc->name, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(x.m, x.ad), 0);
    double loss_err;
    check_forward(&x, &loss_err);
    check_grads(&x);
    check_adamw(&x);
    ctx_close(&x);
}

static void test_qwen3_f32(void) { run_case(&g_cases[0]); }
static void test_qwen3_bf16(void) { run_case(&g_cases[1]); }
static void test_mixtral_f32(void) { run_case(&g_cases[2]); }
static void test_mixtral_bf16(void) { run_case(&g_cases[3]); }
static void test_qwen3_variant(void) { run_case(&g_cases[4]); }
static void test_mixtral_variant(void) { run_case(&g_cases[5]); }
static void test_deepseek_f32(void) { run_case(&g_cases[6]); }
static void test_deepseek_variant(void) { run_case(&g_cases[7]); }
static void test_qwen3_aux_pool(void) { run_case(&g_cases[8]); }
static void test_mixtral_aux_pool(void) { run_case(&g_cases[9]); }

int main(void) {
    if (!torch_available()) {
        printf("test_golden: SKIPPED: %s cannot import torch (install python3-torch)\n",
               tu_python());
        return 77;
    }
    if (tu_tmpdir(g_root, sizeof g_root) < 0) {
        fprintf(stderr, "test_golden: cannot create a temporary directory\n");
        return 1;
    }
    CU_TestInfo tests[] = {
        {"qwen3_moe f32 preset", test_qwen3_f32},
        {"qwen3_moe bf16 preset, rsLoRA", test_qwen3_bf16},
        {"mixtral f32 preset, balance loss", test_mixtral_f32},
        {"mixtral bf16 preset", test_mixtral_bf16},
        {"qwen3_moe variant: dense layer, window, tied, yarn", test_qwen3_variant},
        {"mixtral variant: window, llama3 rope, bf16, rsLoRA", test_mixtral_variant},
        {"deepseek_v3 f32 preset: MLA, shared expert, groups", test_deepseek_f32},
        {"deepseek_v3 variant: q_proj, yarn, bias, bf16", test_deepseek_variant},
        {"qwen3_moe variant, balance loss pooled over layers (HF)", test_qwen3_aux_pool},
        {"mixtral f32 preset, balance loss pooled over layers (HF)", test_mixtral_aux_pool},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("golden", tests);
    tu_rmtree(g_root);
    return rc;
}
