/* test_mla: multi-head latent attention (DeepSeek-V3 / Kimi K2) in the policy model: finite
 * differences on the LoRA parameters of tiny DeepSeek-V3 models (q_a/q_b and plain q_proj,
 * interleaved and plain RoPE, v_head_dim below and above the query head dim, YaRN with
 * mscale), the float64 PyTorch reference (tests/model_ref.py), exact identities, the
 * adapter module list, broken checkpoints and `moerl score` on a deepseek_v3 model. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "actor/init_model.h"
#include "actor/mla.h"
#include "actor/model.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "lora/peft.h"
#include "tests/testutil.h"

#define MAXT 48

/* Fixture variants of the tiny DeepSeek-V3 preset (D 64, H 4, 8 experts, layer 0 dense):
 *   QLORA: q_lora_rank 32, qk_nope 16, qk_rope 8, v_head 16, rope_interleave
 *   QPROJ: q_lora_rank 0 (q_proj), qk_nope 8, qk_rope 8, v_head 24 (> qk head 16), no
 *          interleave
 *   YARN:  QLORA with YaRN (factor 4, original 64, mscale 1, mscale_all_dim 0.8) and
 *          positions starting at 37 */
typedef enum { MX_QLORA = 0, MX_QPROJ, MX_YARN } mx_kind_t;

typedef struct mx {
    char dir[512];
    model_t *m;
    lora_adapter_t *ad;
    int T, B;
    int32_t tok[MAXT], pos[MAXT], tgt[MAXT], cu[8];
    float a[MAXT], b[MAXT];
    float temperature;
} mx_t;

static void mx_config(model_config_t *c, mx_kind_t kind) {
    CU_ASSERT_EQUAL_FATAL(init_model_config(c, ARCH_DEEPSEEK_V3, INIT_SIZE_TINY, DT_F32), 0);
    if (kind == MX_QPROJ) {
        c->q_lora_rank = 0;
        c->rope_interleave = 0;
        c->qk_nope_head_dim = 8;
        c->qk_rope_head_dim = 8;
        c->v_head_dim = 24;
        c->head_dim = 16;
    } else if (kind == MX_YARN) {
        rope_scaling_t *r = &c->rope_scaling;
        r->type = ROPE_YARN;
        r->factor = 4.0f;
        r->original_max_position = 64;
        r->beta_fast = 32.0f;
        r->beta_slow = 1.0f;
        r->mscale = 1.0f;
        r->mscale_all_dim = 0.8f;
        c->max_position_embeddings = 256; /* factor * original: one reading of both */
    }
    CU_ASSERT_EQUAL_FATAL(model_config_validate(c, "test"), 0);
}

static lora_adapter_t *make_adapter(const model_t *m, const char *const *targets, int n, int rank) {
    lora_config_t lc = {rank, 2.0f * rank, 0, 0.0f, 11, 0, targets, n};
    lora_adapter_t *ad = NULL;
    int rc = lora_adapter_new(&ad, &lc, m->modules, m->n_modules);
    if (rc < 0)
        tu_report("adapter: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return ad;
}

static void mx_batch(mx_t *f, const int *lens, int B, uint64_t seed, int pos0) {
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
    for (int t = 0; t < f->T; t++)
        f->pos[t] += pos0;
    f->tgt[2] = -1; /* a token without a target inside a sequence */
    f->temperature = 0.8f;
}

static void mx_open(mx_t *f, mx_kind_t kind, const model_opts_t *o) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    model_config_t c;
    mx_config(&c, kind);
    init_model_opts_t io = {7, 0.15f};
    int rc = init_model_write(f->dir, &c, &io);
    if (rc == 0)
        rc = model_open(&f->m, f->dir, o);
    if (rc < 0)
        tu_report("fixture: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    const char *all[1] = {"all-linear"};
    f->ad = make_adapter(f->m, all, 1, 4);
    tu_randomise_adapter(f->ad, 5);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(f->m, f->ad), 0);
    static const int lens[2] = {9, 6};
    mx_batch(f, lens, 2, 3, kind == MX_YARN ? 37 : 0);
}

static void mx_close(mx_t *f) {
    model_destroy(&f->m);
    lora_adapter_destroy(&f->ad);
    tu_rmtree(f->dir);
}

static size_t routing_len(const mx_t *f) {
    return (size_t)f->T * (size_t)f->m->n_moe * (size_t)f->m->K;
}

/* Forward; returns the objective sum_t a_t logp_t + b_t entropy_t in double. */
static double mx_forward(mx_t *f, model_t *m, float *logp, float *ent, uint16_t *routing,
                         const uint16_t *replay, int for_backward) {
    model_batch_t b = {f->T, f->B, f->tok, f->pos, f->cu, f->tgt, f->temperature, replay, routing};
    tu_poison(logp, (size_t)f->T);
    tu_poison(ent, (size_t)f->T);
    int rc = model_forward(m, &b, logp, ent, for_backward);
    if (rc < 0)
        tu_report("forward: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    double L = 0.0;
    for (int t = 0; t < f->T; t++)
        L += (double)f->a[t] * logp[t] + (double)f->b[t] * ent[t];
    return L;
}

static void mx_gradient(mx_t *f, model_t *m) {
    float logp[MAXT], ent[MAXT];
    mx_forward(f, m, logp, ent, NULL, NULL, 1);
    lora_adapter_zero_grads(f->ad);
    int rc = model_backward(m, f->a, f->b);
    if (rc < 0)
        tu_report("backward: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* ------------------------------------------------------------------------ */
/* Finite differences.                                                       */

static const char *const g_mla_projs[6] = {"q_a_proj",           "q_b_proj",  "q_proj",
                                           "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};

/* Sample i: an MLA projection by turns (those the model has), A or B by turns, a random
 * layer and element. */
static size_t sample_param(const lora_adapter_t *ad, int i, uint64_t seed) {
    const char *have[6];
    int nh = 0;
    for (int p = 0; p < 6; p++)
        for (int e = 0; e < ad->n_entries; e++)
            if (!strcmp(ad->entries[e].proj, g_mla_projs[p])) {
                have[nh++] = g_mla_projs[p];
                break;
            }
    CU_ASSERT_FATAL(nh > 0);
    const char *proj = have[i % nh];
    int want_b = (i / nh) % 2, cand[64], n = 0;
    for (int e = 0; e < ad->n_entries && n < 64; e++)
        if (!strcmp(ad->entries[e].proj, proj))
            cand[n++] = e;
    int e = cand[(int)(rng_uniform(seed, 7, (uint64_t)i) * (float)n) % n];
    const lora_tensor_t *t = &ad->tensors[2 * e + want_b];
    size_t j = (size_t)(rng_uniform(seed, 8, (uint64_t)i) * (float)t->numel) % t->numel;
    return t->offset + j;
}

/* Central differences on n sampled MLA adapter parameters with the routing of the
 * unperturbed forward replayed (held fixed); the normalised error max |fd - an| / max |an|. */
static double fd_check(mx_t *f, int n, float eps) {
    mx_gradient(f, f->m);
    size_t rl = routing_len(f);
    uint16_t *r0 = malloc(rl * 2);
    float logp[MAXT], ent[MAXT];
    mx_forward(f, f->m, logp, ent, r0, NULL, 0);
    double maxd = 0.0, maxg = 1e-3;
    for (int i = 0; i < n; i++) {
        size_t p = sample_param(f->ad, i, 99);
        float keep = f->ad->params[p];
        f->ad->params[p] = keep + eps;
        double lp = mx_forward(f, f->m, logp, ent, NULL, r0, 0);
        f->ad->params[p] = keep - eps;
        double lm = mx_forward(f, f->m, logp, ent, NULL, r0, 0);
        f->ad->params[p] = keep;
        double fd = (lp - lm) / (2.0 * (double)eps), an = f->ad->grads[p];
        maxd = fmax(maxd, fabs(fd - an));
        maxg = fmax(maxg, fabs(an));
    }
    free(r0);
    return maxd / maxg;
}

static void run_fd(mx_kind_t kind, const char *what) {
    mx_t f;
    mx_open(&f, kind, NULL);
    double err = fd_check(&f, 60, 1e-3f);
    TU_ASSERT_CLOSE(err, 1e-2, what);
    mx_close(&f);
}

static void test_fd_q_lora(void) {
    run_fd(MX_QLORA, "MLA (q_a/q_b, interleaved rope) LoRA gradient");
}

static void test_fd_q_proj(void) {
    run_fd(MX_QPROJ, "MLA (q_proj, plain rope, v wider than qk) LoRA gradient");
}

static void test_fd_yarn(void) {
    run_fd(MX_YARN, "MLA with YaRN LoRA gradient");
}

/* ------------------------------------------------------------------------ */
/* Router and norm weights trained in full.                                  */

/* Kinds of trainable tensor the check below reports separately, since their gradients
 * differ by orders of magnitude. */
enum { KIND_ROUTER = 0, KIND_LAYER_NORM, KIND_MLA_NORM, KIND_FINAL_NORM, KIND_LORA, N_KINDS };
static const char *const g_kind_names[N_KINDS] = {"router", "layer norm", "MLA latent norm",
                                                  "final norm", "LoRA"};

static int full_kind(const char *name) {
    if (strstr(name, ".gate.weight"))
        return KIND_ROUTER;
    if (strstr(name, "a_layernorm"))
        return KIND_MLA_NORM;
    if (!strcmp(name, "model.norm.weight"))
        return KIND_FINAL_NORM;
    return KIND_LAYER_NORM;
}

/* Sample i: even samples a full tensor by turns (element at random), odd ones an MLA
 * LoRA parameter (sample_param). *kind receives the sample's kind. */
static size_t sample_full(const lora_adapter_t *ad, int i, uint64_t seed, int *kind) {
    if (i % 2) {
        *kind = KIND_LORA;
        return sample_param(ad, i / 2, seed);
    }
    const lora_tensor_t *t = &ad->tensors[ad->n_tensors - ad->n_full + (i / 2) % ad->n_full];
    *kind = full_kind(t->name);
    size_t j = (size_t)(rng_uniform(seed, 9, (uint64_t)i) * (float)t->numel) % t->numel;
    return t->offset + j;
}

/* Central differences (routing replayed, as fd_check; the balance loss included) on n
 * samples of sample_full; err[k] the normalised error of kind k, cnt[k] its samples. */
static void fd_check_full(mx_t *f, int n, float eps, double *err, int *cnt) {
    mx_gradient(f, f->m);
    size_t rl = routing_len(f);
    uint16_t *r0 = malloc(rl * 2);
    float logp[MAXT], ent[MAXT];
    mx_forward(f, f->m, logp, ent, r0, NULL, 0);
    double maxd[N_KINDS] = {0}, maxg[N_KINDS];
    for (int k = 0; k < N_KINDS; k++)
        maxg[k] = 1e-3, cnt[k] = 0;
    for (int i = 0; i < n; i++) {
        int kind;
        size_t p = sample_full(f->ad, i, 99, &kind);
        float keep = f->ad->params[p];
        f->ad->params[p] = keep + eps;
        double lp = mx_forward(f, f->m, logp, ent, NULL, r0, 0) + model_aux_loss(f->m);
        f->ad->params[p] = keep - eps;
        double lm = mx_forward(f, f->m, logp, ent, NULL, r0, 0) + model_aux_loss(f->m);
        f->ad->params[p] = keep;
        double fd = (lp - lm) / (2.0 * (double)eps), an = f->ad->grads[p];
        maxd[kind] = fmax(maxd[kind], fabs(fd - an));
        maxg[kind] = fmax(maxg[kind], fabs(an));
        cnt[kind]++;
    }
    for (int k = 0; k < N_KINDS; k++)
        err[k] = maxd[k] / maxg[k];
    free(r0);
}

/* The tiny DeepSeek-V3 (MLA, sigmoid router with a non-zero e_score_correction_bias and
 * group limit, a shared expert, layer 0 dense) with the routers and every norm trained in
 * full and the balance loss on: the table (the MLA latent norms included), the
 * gradients of each kind against central differences, a gradient for every full tensor,
 * the frozen values back after unbinding, and a PEFT round trip under the Hugging Face
 * names. */
static void run_fd_full(mx_kind_t kind, int recompute) {
    mx_t f;
    model_opts_t o = {recompute, 0, 0.05f};
    mx_open(&f, kind, &o);
    model_t *m = f.m;
    CU_ASSERT_FATAL(m->L == 2 && !m->layers[0].moe && m->layers[1].moe);
    CU_ASSERT_FATAL(m->layers[1].moe_cfg.n_shared == 1 && m->layers[1].e_bias);
    /* A correction bias that changes the selection (it is 0 in the checkpoint). */
    size_t rl = routing_len(&f);
    uint16_t *r0 = malloc(rl * 2), *r1 = malloc(rl * 2);
    float lp0[MAXT], lp1[MAXT], ent[MAXT];
    mx_forward(&f, m, lp0, ent, r0, NULL, 0);
    tu_fill((float *)m->layers[1].e_bias, (size_t)m->E, 41, 0.0f, 0.3f);
    mx_forward(&f, m, lp0, ent, r1, NULL, 0);
    CU_ASSERT(memcmp(r0, r1, rl * 2) != 0);
    free(r0);
    free(r1);
    int qa = m->mla_cfg.q_rank > 0;
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, NULL), 0);
    const float *kv0 = m->layers[0].mla.kv_a_norm, *qa0 = m->layers[1].mla.q_a_norm;
    int lora_tensors = f.ad->n_tensors, want = 2 * (3 + qa) + 1 + 1;
    CU_ASSERT_EQUAL_FATAL(model_adapter_add_full(m, f.ad, 1, 1), 0);
    CU_ASSERT_EQUAL(f.ad->n_full, want);
    const char *names[3] = {"model.layers.1.self_attn.kv_a_layernorm.weight",
                            "model.layers.1.self_attn.q_a_layernorm.weight",
                            "model.layers.1.mlp.gate.weight"};
    for (int i = 0; i < 3; i++) {
        int t = lora_adapter_find_full(f.ad, names[i]);
        if (i == 1 && !qa) {
            CU_ASSERT(t < 0);
            continue;
        }
        CU_ASSERT_FATAL(t >= 0);
        int64_t rows = i == 0 ? m->mla_cfg.kv_rank : i == 1 ? m->mla_cfg.q_rank : m->E;
        CU_ASSERT(f.ad->tensors[t].shape[0] == rows);
        CU_ASSERT(f.ad->tensors[t].shape[1] == (i == 2 ? m->D : 1));
    }
    int tkv = lora_adapter_find_full(f.ad, "model.layers.0.self_attn.kv_a_layernorm.weight");
    CU_ASSERT_FATAL(tkv >= 0);
    CU_ASSERT(memcmp(f.ad->params + f.ad->tensors[tkv].offset, kv0,
                     sizeof(float) * (size_t)m->mla_cfg.kv_rank) == 0);
    for (int t = lora_tensors; t < f.ad->n_tensors; t++) {
        float *p = f.ad->params + f.ad->tensors[t].offset;
        for (size_t j = 0; j < f.ad->tensors[t].numel; j++)
            p[j] *= 0.7f + 0.6f * rng_uniform(21, (uint64_t)t, j);
    }
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, f.ad), 0);
    CU_ASSERT(m->layers[0].mla.kv_a_norm == f.ad->params + f.ad->tensors[tkv].offset);
    CU_ASSERT(m->layers[0].mla.d_kv_a_norm == f.ad->grads + f.ad->tensors[tkv].offset);
    double err[N_KINDS];
    int cnt[N_KINDS];
    fd_check_full(&f, 12 * want, 2e-3f, err, cnt);
    for (int k = 0; k < N_KINDS; k++) {
        char what[128];
        snprintf(what, sizeof what, "deepseek_v3 %s gradient (%s, recompute %d)", g_kind_names[k],
                 kind == MX_QLORA ? "q_a/q_b" : "q_proj", recompute);
        CU_ASSERT(cnt[k] >= 2);
        TU_ASSERT_CLOSE(err[k], 1e-2, what);
    }
    for (int t = lora_tensors; t < f.ad->n_tensors; t++) {
        double g = 0.0;
        for (size_t j = 0; j < f.ad->tensors[t].numel; j++)
            g += fabs(f.ad->grads[f.ad->tensors[t].offset + j]);
        if (!(g > 0.0))
            tu_report("no gradient for %s", f.ad->tensors[t].name);
        CU_ASSERT(g > 0.0);
    }
    /* Saved and loaded under the Hugging Face names: the same logprobs. */
    char adir[600];
    snprintf(adir, sizeof adir, "%s/adapter", f.dir);
    CU_ASSERT_EQUAL_FATAL(peft_save(f.ad, adir, NULL), 0);
    lora_adapter_t *back = NULL;
    int rc = peft_load_new(&back, adir, m->modules, m->n_modules, 1);
    if (rc < 0)
        tu_report("peft load: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(back->n_full, want);
    CU_ASSERT(lora_adapter_find_full(back, names[0]) >= 0);
    mx_forward(&f, m, lp0, ent, NULL, NULL, 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, back), 0);
    mx_forward(&f, m, lp1, ent, NULL, NULL, 0);
    CU_ASSERT(memcmp(lp0, lp1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT_EQUAL(model_set_adapter(m, NULL), 0);
    lora_adapter_destroy(&back);
    CU_ASSERT(m->layers[0].mla.kv_a_norm == kv0 && m->layers[1].mla.q_a_norm == qa0);
    CU_ASSERT_PTR_NULL(m->layers[0].mla.d_kv_a_norm);
    CU_ASSERT_PTR_NULL(m->layers[1].mla.d_q_a_norm);
    mx_close(&f);
}

static void test_fd_full_q_lora(void) {
    run_fd_full(MX_QLORA, 0);
}

static void test_fd_full_q_proj_recompute(void) {
    run_fd_full(MX_QPROJ, 1);
}

/* ------------------------------------------------------------------------ */
/* PyTorch reference.                                                        */

static int write_ref_input(const mx_t *f, const char *path) {
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

static void run_reference(mx_kind_t kind, const char *what) {
    mx_t f;
    mx_open(&f, kind, NULL);
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
    mx_gradient(&f, f.m);
    float logp[MAXT], ent[MAXT];
    mx_forward(&f, f.m, logp, ent, NULL, NULL, 0);
    size_t n = f.ad->n_params;
    double rl[MAXT], re[MAXT], *rg = malloc(sizeof(double) * n);
    FILE *fp = fopen(out, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "logp", rl, (size_t)f.T), 0);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "entropy", re, (size_t)f.T), 0);
    CU_ASSERT_EQUAL_FATAL(read_block(fp, "grads", rg, n), 0);
    fclose(fp);
    char w[160];
    snprintf(w, sizeof w, "%s: logprobs vs PyTorch", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(logp, rl, (size_t)f.T, 1.0), 1e-5, w);
    snprintf(w, sizeof w, "%s: entropies vs PyTorch", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(ent, re, (size_t)f.T, 1.0), 1e-5, w);
    snprintf(w, sizeof w, "%s: LoRA gradients vs PyTorch", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(f.ad->grads, rg, n, 1e-3), 1e-4, w);
    /* The MLA entries alone (the gradients of the projections this suite is about). */
    double maxd = 0.0, maxg = 1e-3;
    for (int e = 0; e < f.ad->n_entries; e++) {
        if (f.ad->entries[e].kind != LORA_KIND_ATTENTION)
            continue;
        for (int ab = 0; ab < 2; ab++) {
            const lora_tensor_t *t = &f.ad->tensors[2 * e + ab];
            for (size_t i = t->offset; i < t->offset + t->numel; i++) {
                maxd = fmax(maxd, fabs((double)f.ad->grads[i] - rg[i]));
                maxg = fmax(maxg, fabs(rg[i]));
            }
        }
    }
    snprintf(w, sizeof w, "%s: MLA LoRA gradients vs PyTorch", what);
    TU_ASSERT_CLOSE(maxd / maxg, 1e-4, w);
    free(rg);
    mx_close(&f);
}

static void test_reference_q_lora(void) {
    run_reference(MX_QLORA, "q_lora");
}

static void test_reference_q_proj(void) {
    run_reference(MX_QPROJ, "q_proj");
}

static void test_reference_yarn(void) {
    run_reference(MX_YARN, "yarn");
}

/* ------------------------------------------------------------------------ */
/* Identities and configuration.                                             */

/* Recompute gives the same bits; a packed batch equals its sequences alone; an adapter
 * with B = 0 equals the base model. */
static void test_identities(void) {
    mx_t f;
    mx_open(&f, MX_QLORA, NULL);
    model_t *rm = NULL;
    model_opts_t o = {1, 0, 0.0f};
    CU_ASSERT_EQUAL_FATAL(model_open(&rm, f.dir, &o), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(rm, f.ad), 0);
    size_t n = f.ad->n_params;
    float *g0 = malloc(sizeof(float) * n);
    mx_gradient(&f, f.m);
    memcpy(g0, f.ad->grads, sizeof(float) * n);
    mx_gradient(&f, rm);
    CU_ASSERT(memcmp(g0, f.ad->grads, sizeof(float) * n) == 0);
    float l0[MAXT], e0[MAXT], l1[MAXT], e1[MAXT];
    mx_forward(&f, f.m, l0, e0, NULL, NULL, 0);
    for (int b = 0; b < f.B; b++) {
        int s0 = f.cu[b], len = f.cu[b + 1] - s0;
        int32_t cu[2] = {0, len};
        model_batch_t one = {len,           1,    f.tok + s0, f.pos + s0, cu, f.tgt + s0,
                             f.temperature, NULL, NULL};
        CU_ASSERT_EQUAL_FATAL(model_forward(f.m, &one, l1 + s0, e1 + s0, 0), 0);
    }
    TU_ASSERT_CLOSE(tu_rel_err_ff(l0, l1, (size_t)f.T, 1.0), 1e-6, "packed logprobs");
    TU_ASSERT_CLOSE(tu_rel_err_ff(e0, e1, (size_t)f.T, 1.0), 1e-6, "packed entropies");
    CU_ASSERT_EQUAL(model_set_adapter(f.m, NULL), 0);
    mx_forward(&f, f.m, l1, e1, NULL, NULL, 0);
    CU_ASSERT(tu_rel_err_ff(l0, l1, (size_t)f.T, 1.0) > 1e-4); /* the adapter matters */
    for (int i = 1; i < f.ad->n_tensors; i += 2)
        memset(f.ad->params + f.ad->tensors[i].offset, 0, sizeof(float) * f.ad->tensors[i].numel);
    CU_ASSERT_EQUAL(model_set_adapter(f.m, f.ad), 0);
    mx_forward(&f, f.m, l0, e0, NULL, NULL, 0);
    CU_ASSERT(memcmp(l0, l1, sizeof(float) * (size_t)f.T) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof(float) * (size_t)f.T) == 0);
    free(g0);
    model_destroy(&rm);
    mx_close(&f);
}

/* Softmax scale and RoPE tables from the config. */
static void test_cfg(void) {
    model_config_t c;
    mla_cfg_t mc;
    mx_config(&c, MX_QLORA);
    CU_ASSERT_EQUAL_FATAL(mla_cfg_init(&mc, &c), 0);
    CU_ASSERT(mc.qd == 24 && mc.pd == 24 && mc.vd == 16 && mc.q_rank == 32 && mc.interleave);
    CU_ASSERT(fabs(mc.scale - 1.0 / sqrt(24.0)) < 1e-7);
    mx_config(&c, MX_QPROJ);
    CU_ASSERT_EQUAL_FATAL(mla_cfg_init(&mc, &c), 0);
    CU_ASSERT(mc.qd == 16 && mc.pd == 24 && mc.q_rank == 0 && !mc.interleave);
    mx_config(&c, MX_YARN);
    CU_ASSERT_EQUAL_FATAL(mla_cfg_init(&mc, &c), 0);
    double ms = 0.1 * 0.8 * log(4.0) + 1.0;
    CU_ASSERT(fabs(mc.scale - ms * ms / sqrt(24.0)) < 1e-6);
    c.rope_scaling.mscale_all_dim = 0.0f; /* no mscale_all_dim: the plain scale */
    CU_ASSERT_EQUAL_FATAL(mla_cfg_init(&mc, &c), 0);
    CU_ASSERT(fabs(mc.scale - 1.0 / sqrt(24.0)) < 1e-7);
    mx_t f;
    mx_open(&f, MX_YARN, NULL);
    CU_ASSERT(f.m->mla && f.m->mla_cfg.inv_freq == f.m->inv_freq);
    double att = (0.1 * log(4.0) + 1.0) / ms; /* cos/sin factor: mscale over mscale_all_dim */
    CU_ASSERT(fabs(f.m->rope_mscale - att) < 1e-6);
    CU_ASSERT(fabs(f.m->inv_freq[0] - 1.0) < 1e-7);        /* extrapolated */
    CU_ASSERT(fabs(f.m->inv_freq[3] - 1e-3 / 4.0) < 1e-9); /* interpolated */
    CU_ASSERT(fabs(f.m->attn_scale - f.m->mla_cfg.scale) == 0.0f);
    mx_close(&f);
    c.arch = ARCH_MIXTRAL;
    CU_ASSERT_EQUAL(mla_cfg_init(&mc, &c), MO_EINVAL);
}

/* The projections offered to adapters and how target words select them. */
static void test_modules(void) {
    mx_t f;
    mx_open(&f, MX_QLORA, NULL);
    model_t *m = f.m;
    static const char *const want[5] = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                        "o_proj"};
    const int C[5] = {64, 32, 64, 32, 4 * 16}, OC[5] = {32, 4 * 24, 32 + 8, 4 * 32, 64};
    for (int p = 0; p < 5; p++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.0.self_attn.%s", want[p]);
        CU_ASSERT_STRING_EQUAL(m->modules[p].name, name);
        CU_ASSERT_STRING_EQUAL(m->modules[p].proj, want[p]);
        CU_ASSERT_EQUAL(m->modules[p].kind, LORA_KIND_ATTENTION);
        CU_ASSERT(m->modules[p].C == C[p] && m->modules[p].OC == OC[p]);
    }
    CU_ASSERT_STRING_EQUAL(m->modules[5].name, "model.layers.0.mlp.gate_proj"); /* dense */
    CU_ASSERT_EQUAL(m->n_modules, 2 * 5 + 3 + 3 * (8 + 1));
    /* "attention" takes every MLA projection; projection words pick single ones. */
    const char *attn[1] = {"attention"}, *kvb[2] = {"kv_b_proj", "o_proj"};
    lora_adapter_t *ad = make_adapter(m, attn, 1, 2);
    CU_ASSERT_EQUAL(ad->n_entries, 10);
    lora_adapter_destroy(&ad);
    ad = make_adapter(m, kvb, 2, 2);
    CU_ASSERT_EQUAL(ad->n_entries, 4);
    CU_ASSERT_EQUAL(model_set_adapter(m, ad), 0);
    CU_ASSERT_PTR_NOT_NULL(m->layers[1].mla.lora_kv_b);
    CU_ASSERT_PTR_NULL(m->layers[1].mla.lora_kv_a);
    lora_adapter_destroy(&ad);
    /* GQA words name nothing in an MLA model with q_lora_rank > 0. */
    const char *gqa[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    lora_config_t lc = {2, 4.0f, 0, 0.0f, 1, 0, gqa, 4};
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &lc, m->modules, m->n_modules), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "'q_proj' selects no module"));
    mx_close(&f);
    mx_open(&f, MX_QPROJ, NULL);
    CU_ASSERT_STRING_EQUAL(f.m->modules[0].name, "model.layers.0.self_attn.q_proj");
    CU_ASSERT(f.m->modules[0].C == 64 && f.m->modules[0].OC == 4 * 16);
    CU_ASSERT_STRING_EQUAL(f.m->modules[1].proj, "kv_a_proj_with_mqa");
    CU_ASSERT_EQUAL(f.m->modules[3].OC, 64); /* o_proj (D, H v_head) */
    CU_ASSERT_EQUAL(f.m->modules[3].C, 4 * 24);
    mx_close(&f);
}

/* Rewrites dir/model.safetensors without `drop` and with `reshape` given shape (r, c). */
static void rewrite(const char *dir, const char *drop, const char *reshape, int64_t r, int64_t c) {
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path), 0);
    int n = st_count(f), k = 0;
    st_item_t *items = calloc((size_t)n, sizeof *items);
    for (int i = 0; i < n; i++) {
        const st_info_t *in = st_info(f, i);
        if (drop && !strcmp(in->name, drop))
            continue;
        items[k].name = in->name;
        items[k].tensor = st_tensor(f, i);
        if (reshape && !strcmp(in->name, reshape)) {
            items[k].tensor.shape[0] = r;
            items[k].tensor.shape[1] = c;
        }
        k++;
    }
    CU_ASSERT_EQUAL(st_write(path, items, k, NULL, 0), 0);
    free(items);
    st_close(&f);
}

static void test_bad_checkpoints(void) {
    char dir[512];
    model_config_t c;
    mx_config(&c, MX_QLORA);
    c.torch_dtype = DT_BF16;
    init_model_opts_t io = {3, 0.0f};
    model_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    CU_ASSERT_EQUAL_FATAL(init_model_write(dir, &c, &io), 0);
    rewrite(dir, "model.layers.1.self_attn.kv_a_layernorm.weight", NULL, 0, 0);
    CU_ASSERT_EQUAL(model_open(&m, dir, NULL), MO_ENOTFOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "kv_a_layernorm.weight\" is missing"));
    CU_ASSERT_EQUAL_FATAL(init_model_write(dir, &c, &io), 0);
    /* kv_b_proj as if v_head_dim were 8: (H (16 + 8), 32) instead of (128, 32). */
    rewrite(dir, NULL, "model.layers.0.self_attn.kv_b_proj.weight", 96, 32);
    CU_ASSERT_EQUAL(model_open(&m, dir, NULL), MO_EMALFORMED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "expected (128, 32)"));
    CU_ASSERT_PTR_NULL(m);
    tu_rmtree(dir);
}

/* ------------------------------------------------------------------------ */
/* moerl score.                                                              */

/* Runs `moerl ARGS` (stderr dropped); the exit status, stdout in *out. */
static int run_moerl(const char *args, char **out) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>/dev/null", tu_moerl_exe(), args);
    *out = NULL;
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap);
    while (buf && n < cap - 1 && (got = fread(buf + n, 1, cap - 1 - n, p)) > 0)
        n += got;
    int st = pclose(p);
    if (buf)
        buf[n] = '\0';
    *out = buf;
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* `moerl score` output's logprobs[1..n-1] into logp; returns n or -1. */
static int score_cli(const char *args, float *logp, int cap) {
    char *out = NULL;
    int st = run_moerl(args, &out);
    if (st != 0 || !out)
        tu_report("moerl %s: status %d, output %s", args, st, out ? out : "");
    CU_ASSERT_EQUAL(st, 0);
    cJSON *j = out ? cJSON_Parse(out) : NULL;
    free(out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    cJSON *l = cJSON_GetObjectItem(j, "logprobs");
    int n = cJSON_GetArraySize(l);
    for (int i = 1; i < n && i <= cap; i++)
        logp[i - 1] = (float)cJSON_GetArrayItem(l, i)->valuedouble;
    cJSON_Delete(j);
    return n;
}

static void test_cli_score(void) {
    char dir[512], mdir[600], adir[600], args[2048];
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    snprintf(mdir, sizeof mdir, "%s/m", dir);
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    char *out = NULL;
    snprintf(args, sizeof args, "init-model --arch deepseek_v3 --size tiny --seed 4 --out '%s'",
             mdir);
    CU_ASSERT_EQUAL_FATAL(run_moerl(args, &out), 0);
    free(out);
    int32_t tok[6] = {104, 105, 33, 10, 200, 7}, pos[6], tgt[6], cu[2] = {0, 6};
    float cli[8], lib[8], ent[8];
    snprintf(args, sizeof args, "score --model '%s' --tokens \"104 105 33 10 200 7\"", mdir);
    CU_ASSERT_EQUAL_FATAL(score_cli(args, cli, 8), 6);
    model_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(model_open(&m, mdir, NULL), 0);
    model_batch_next_token(pos, tgt, tok, cu, 1);
    model_batch_t b = {6, 1, tok, pos, cu, tgt, 1.0f, NULL, NULL};
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, lib, ent, 0), 0);
    TU_ASSERT_CLOSE(tu_rel_err_ff(cli, lib, 5, 1.0), 1e-6, "deepseek_v3 score vs library");
    for (int i = 0; i < 5; i++)
        CU_ASSERT(cli[i] < -4.5f && cli[i] > -7.0f); /* near -log(261) */
    /* With an adapter on the MLA projections and the shared experts. */
    const char *targets[3] = {"q_b_proj", "kv_b_proj", "shared_experts"};
    lora_config_t lc = {4, 8.0f, 0, 0.0f, 3, 1, targets, 3};
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &lc, m->modules, m->n_modules), 0);
    rng_fill_uniform(ad->params, ad->n_params, 8, 1, -0.5f, 0.5f);
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, adir, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, ad), 0);
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, lib, ent, 0), 0);
    float cla[8];
    snprintf(args, sizeof args,
             "score --model '%s' --adapter '%s' --tokens \"104 105 33 10 200 7\"", mdir, adir);
    CU_ASSERT_EQUAL_FATAL(score_cli(args, cla, 8), 6);
    TU_ASSERT_CLOSE(tu_rel_err_ff(cla, lib, 5, 1.0), 1e-6, "deepseek_v3 score with adapter");
    CU_ASSERT(tu_rel_err_ff(cla, cli, 5, 1.0) > 1e-3); /* the adapter changed the scores */
    lora_adapter_destroy(&ad);
    model_destroy(&m);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"fd_q_lora", test_fd_q_lora},
        {"fd_q_proj", test_fd_q_proj},
        {"fd_yarn", test_fd_yarn},
        {"fd_full_q_lora", test_fd_full_q_lora},
        {"fd_full_q_proj_recompute", test_fd_full_q_proj_recompute},
        {"reference_q_lora", test_reference_q_lora},
        {"reference_q_proj", test_reference_q_proj},
        {"reference_yarn", test_reference_yarn},
        {"identities", test_identities},
        {"cfg", test_cfg},
        {"modules", test_modules},
        {"bad_checkpoints", test_bad_checkpoints},
        {"cli_score", test_cli_score},
        CU_TEST_INFO_NULL,
    };
    return tu_main("mla", tests);
}
