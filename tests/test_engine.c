/* Tests for rollout/engine on tiny random Qwen3-MoE (with a dense layer), Mixtral
 * (sliding window) and DeepSeek-V3 (MLA) models: logprobs and routing against the learner's forward
 * of the whole sequence (natural routing and replay, with and without an adapter, several sampling
 * settings), batch vs one by one and thread count, shared vs separate prefill, adapter swap
 * mid-generation, merged adapters, stop strings and stop ids, length limits, per-request errors,
 * waiting for KV room, the step-wise API, options from a job config, and `moerl generate` as a
 * process. DeepSeek-V3 (MLA attention) is checked against the learner as well. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/rng.h"
#include "core/status.h"
#include "lora/peft.h"
#include "rollout/amx_matmul.h"
#include "rollout/decode.h"
#include "rollout/engine.h"
#include "tests/testutil.h"

/* Logprobs of the engine and of the learner's forward differ by float rounding only
 * (rows batched differently through the products). */
#define LOGP_TOL 1e-4

typedef struct fx {
    char dir[512];
    model_t *m;
    tokenizer_t *tok;
} fx_t;

static void fx_open(fx_t *f, model_arch_t arch, dtype_t dt) {
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, arch, INIT_SIZE_TINY, dt), 0);
    if (arch == ARCH_QWEN3_MOE) { /* three layers, the middle one a dense MLP */
        c.num_hidden_layers = 3;
        c.max_window_layers = 3;
        c.mlp_only_layers[1] = 1;
    } else if (arch == ARCH_MIXTRAL) {
        c.sliding_window = 6; /* generation runs past it */
    } /* DeepSeek-V3: MLA, a leading dense layer, a shared expert, sigmoid routing */
    CU_ASSERT_EQUAL_FATAL(model_config_validate(&c, "test"), 0);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    init_model_opts_t io = {arch == ARCH_MIXTRAL ? 7u : 5u, 0.15f};
    int rc = init_model_write(f->dir, &c, &io);
    if (rc == MO_OK)
        rc = model_open(&f->m, f->dir, NULL);
    if (rc == MO_OK)
        rc = tokenizer_load(f->dir, &f->tok);
    if (rc < 0)
        tu_report("fixture: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

static void fx_close(fx_t *f) {
    tokenizer_destroy(&f->tok);
    model_destroy(&f->m);
    tu_rmtree(f->dir);
}

/* An adapter on every projection with random A and B (B non-zero). */
static lora_adapter_t *make_adapter(const model_t *m, uint64_t seed) {
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {4, 8.0f, 0, 0.0f, seed, 1, targets, 1};
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &lc, m->modules, m->n_modules), 0);
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        rng_fill_uniform(ad->params + t->offset, t->numel, seed, 100 + (uint64_t)i, -0.3f, 0.3f);
    }
    return ad;
}

/* make_adapter plus the routers and norms trained in full (model_adapter_add_full), each
 * value moved by a random factor in [0.7, 1.3). */
static lora_adapter_t *make_adapter_full(model_t *m, uint64_t seed) {
    lora_adapter_t *ad = make_adapter(m, seed);
    int t0 = ad->n_tensors;
    CU_ASSERT_EQUAL_FATAL(model_adapter_add_full(m, ad, m->n_moe > 0, 1), 0);
    for (int i = t0; i < ad->n_tensors; i++) {
        float *p = ad->params + ad->tensors[i].offset;
        for (size_t j = 0; j < ad->tensors[i].numel; j++)
            p[j] *= 0.7f + 0.6f * rng_uniform(seed, 300 + (uint64_t)i, j);
    }
    return ad;
}

static engine_t *new_engine(fx_t *f, const engine_opts_t *o) {
    engine_opts_t d;
    memset(&d, 0, sizeof d);
    d.max_batch = 16;
    d.max_seq_len = 96;
    d.tok = f->tok;
    engine_t *e = NULL;
    int rc = engine_new(&e, f->m, o ? o : &d);
    if (rc < 0)
        tu_report("engine: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return e;
}

/* Prompt tokens (bytes) for request k. */
static void prompt_of(int32_t *p, int P, uint64_t k) {
    for (int i = 0; i < P; i++)
        p[i] = (int32_t)(rng_uniform(77, k, (uint64_t)i) * 256.0f) % 256;
}

static gen_request_t request(uint64_t id, const int32_t *prompt, int P, int n, float T, int max_new,
                             uint64_t seed) {
    gen_request_t r;
    memset(&r, 0, sizeof r);
    r.id = id;
    r.prompt = prompt;
    r.prompt_len = P;
    r.n = n;
    r.params = gen_params_default();
    r.params.sampling.temperature = T;
    r.params.max_new_tokens = max_new;
    r.params.seed = seed;
    r.params.ignore_eos = 1;
    r.params.record_routing = 1;
    r.params.record_prompt_routing = 1;
    return r;
}

static void free_groups(gen_group_t **g, int n) {
    for (int i = 0; i < n; i++)
        gen_group_free(&g[i]);
}

/* What the learner's forward says about one completion. */
typedef struct check {
    double logp_err;   /* max |engine logprob - learner logprob| */
    int route_diff;    /* routing entries where natural routing differs from the record */
    int replay_diff;   /* entries where the replayed forward used other experts */
    double replay_err; /* max |engine logprob - learner logprob with replay| */
    int tokens;
} check_t;

static void check_sample(model_t *m, const gen_group_t *g, const gen_sample_t *s, float temp,
                         check_t *c) {
    int P = g->prompt_len, n = s->n_tokens, T = P + n;
    size_t MK = (size_t)g->M * g->K;
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)T), *pos = malloc(sizeof(int32_t) * T);
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)T);
    float *logp = malloc(sizeof(float) * (size_t)T);
    uint16_t *rout = malloc(sizeof(uint16_t) * (size_t)T * MK + 2);
    uint16_t *replay = malloc(sizeof(uint16_t) * (size_t)T * MK + 2);
    memcpy(seq, g->prompt, sizeof(int32_t) * (size_t)P);
    memcpy(seq + P, s->tokens, sizeof(int32_t) * (size_t)n);
    int32_t cu[2] = {0, T};
    model_batch_next_token(pos, tgt, seq, cu, 1);
    model_batch_t b = {T, 1, seq, pos, cu, tgt, temp, NULL, rout};
    tu_poison(logp, (size_t)T);
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, logp, NULL, 0), 0);
    for (int i = 0; i < n; i++)
        c->logp_err = fmax(c->logp_err, fabs((double)logp[P - 1 + i] - s->logprobs[i]));
    c->tokens += n;
    if (MK > 0) {
        CU_ASSERT_PTR_NOT_NULL_FATAL(g->prompt_routing);
        CU_ASSERT_PTR_NOT_NULL_FATAL(s->routing);
        memcpy(replay, g->prompt_routing, sizeof(uint16_t) * (size_t)P * MK);
        memcpy(replay + (size_t)P * MK, s->routing, sizeof(uint16_t) * (size_t)n * MK);
        for (size_t i = 0; i < (size_t)T * MK; i++)
            c->route_diff += rout[i] != replay[i];
        b.replay = replay;
        tu_poison(logp, (size_t)T);
        CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, logp, NULL, 0), 0);
        for (size_t i = 0; i < (size_t)T * MK; i++)
            c->replay_diff += rout[i] != replay[i];
        for (int i = 0; i < n; i++)
            c->replay_err = fmax(c->replay_err, fabs((double)logp[P - 1 + i] - s->logprobs[i]));
    }
    free(seq);
    free(pos);
    free(tgt);
    free(logp);
    free(rout);
    free(replay);
}

/* Every sample of every group against the learner at temperature temps[i] (group i). */
static void check_groups(model_t *m, gen_group_t **g, int n, const float *temps, const char *what) {
    check_t c;
    memset(&c, 0, sizeof c);
    for (int i = 0; i < n; i++) {
        CU_ASSERT_EQUAL_FATAL(g[i]->status, 0);
        for (int j = 0; j < g[i]->n; j++)
            check_sample(m, g[i], &g[i]->samples[j], temps[i], &c);
    }
    printf("\n  %s: %d tokens, max |dlogp| %.3g (replay %.3g), routing differences %d\n", what,
           c.tokens, c.logp_err, c.replay_err, c.route_diff);
    CU_ASSERT(c.tokens > 0);
    TU_ASSERT_CLOSE(c.logp_err, LOGP_TOL, "engine vs learner logprobs");
    TU_ASSERT_CLOSE(c.replay_err, LOGP_TOL, "engine vs learner logprobs with replay");
    CU_ASSERT_EQUAL(c.route_diff, 0);
    CU_ASSERT_EQUAL(c.replay_diff, 0);
}

/* 1: the engines consistency() makes keep no packed weight copies. */
static int no_packed;

/* Requests with plain, truncated, greedy and tempered sampling; the learner runs at the
 * temperature the logprob is defined at (1 for greedy). */
static void consistency(model_arch_t arch, dtype_t dt, int with_adapter, int merge) {
    fx_t f;
    fx_open(&f, arch, dt);
    /* with_adapter 2: routers and norms trained in full too */
    lora_adapter_t *ad = with_adapter == 2 ? make_adapter_full(f.m, 3)
                         : with_adapter    ? make_adapter(f.m, 3)
                                           : NULL;
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 16;
    o.max_seq_len = 96;
    o.tok = f.tok;
    o.merge_adapter = merge;
    o.no_packed_weights = no_packed;
    engine_t *e = new_engine(&f, &o);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e, ad, 5), 0);
    if (merge) /* the learner side runs the adapter unmerged */
        CU_ASSERT_EQUAL_FATAL(model_set_adapter(f.m, ad), 0);
    if (with_adapter == 2) /* the learner's forward below reads the adapter's norms */
        CU_ASSERT(f.m->final_norm == ad->params + ad->tensors[ad->n_tensors - 1].offset);
    int32_t p[4][24];
    const int P[4] = {5, 17, 1, 11};
    for (int k = 0; k < 4; k++)
        prompt_of(p[k], P[k], (uint64_t)k);
    gen_request_t r[4] = {
        request(10, p[0], P[0], 3, 1.0f, 20, 1), request(11, p[1], P[1], 2, 1.0f, 14, 2),
        request(12, p[2], P[2], 2, 0.0f, 16, 3), request(13, p[3], P[3], 2, 0.7f, 18, 4)};
    r[1].params.sampling.top_p = 0.9f;
    r[1].params.sampling.top_k = 20;
    r[1].params.sampling.min_p = 0.02f;
    const float temps[4] = {1.0f, 1.0f, 1.0f, 0.7f};
    gen_group_t *g[4];
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, r, 4, g), 0);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < g[i]->n; j++) {
            CU_ASSERT_EQUAL(g[i]->samples[j].version_first, 5);
            CU_ASSERT_EQUAL(g[i]->samples[j].version_last, 5);
        }
    char what[96];
    snprintf(what, sizeof what, "%s %s%s%s%s", f.m->cfg.model_type, dtype_name(dt),
             with_adapter ? " + adapter" : "", with_adapter == 2 ? ", router and norms" : "",
             merge ? " (merged)" : "");
    check_groups(f.m, g, 4, temps, what);
    /* Greedy samples of one prompt agree. */
    CU_ASSERT_EQUAL(g[2]->samples[0].n_tokens, g[2]->samples[1].n_tokens);
    CU_ASSERT(memcmp(g[2]->samples[0].tokens, g[2]->samples[1].tokens,
                     sizeof(int32_t) * (size_t)g[2]->samples[0].n_tokens) == 0);
    free_groups(g, 4);
    engine_destroy(&e);
    lora_adapter_destroy(&ad);
    fx_close(&f);
}

static void test_consistency_qwen3(void) {
    consistency(ARCH_QWEN3_MOE, DT_BF16, 0, 0);
    consistency(ARCH_QWEN3_MOE, DT_BF16, 1, 0);
}

/* The same requests on two engines of one model (the second one merged) with adapter ad:
 * the same tokens, logprobs within LOGP_TOL. */
static void merged_vs_unmerged(fx_t *f, const lora_adapter_t *ad) {
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 8;
    o.max_seq_len = 64;
    o.tok = f->tok;
    engine_t *e[2];
    gen_group_t *g[2][2];
    int32_t p[2][12];
    for (int k = 0; k < 2; k++)
        prompt_of(p[k], 12, 40 + (uint64_t)k);
    for (int v = 0; v < 2; v++) {
        o.merge_adapter = v;
        e[v] = new_engine(f, &o);
        CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e[v], ad, 1), 0);
        gen_request_t r[2] = {request(1, p[0], 12, 3, 1.0f, 16, 7),
                              request(2, p[1], 12, 2, 0.0f, 16, 8)};
        CU_ASSERT_EQUAL_FATAL(engine_generate(e[v], r, 2, g[v]), 0);
    }
    double err = 0.0;
    int diff = 0, n = 0;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < g[0][i]->n; j++) {
            const gen_sample_t *a = &g[0][i]->samples[j], *b = &g[1][i]->samples[j];
            CU_ASSERT_EQUAL_FATAL(a->n_tokens, b->n_tokens);
            for (int t = 0; t < a->n_tokens; t++) {
                diff += a->tokens[t] != b->tokens[t];
                err = fmax(err, fabs((double)a->logprobs[t] - b->logprobs[t]));
                n++;
            }
        }
    tu_report("%s merged vs unmerged, routers and norms in full: %d tokens, max |dlogp| %.3g",
              f->m->cfg.model_type, n, err);
    CU_ASSERT(n > 0);
    CU_ASSERT_EQUAL(diff, 0);
    TU_ASSERT_CLOSE(err, LOGP_TOL, "merged vs unmerged logprobs");
    for (int v = 0; v < 2; v++) {
        free_groups(g[v], 2);
        engine_destroy(&e[v]);
    }
}

/* Merged into bf16 copies where the CPU has AMX: every packed copy was made from the
 * merged copies (the views' data), and holds their packed values. */
static void check_packed_merge(const model_t *m, const lora_adapter_t *ad) {
    if (!amx_matmul_available())
        return;
    rl_weights_t w;
    CU_ASSERT_EQUAL_FATAL(rl_weights_init(&w, m, 1), 0);
    CU_ASSERT_EQUAL_FATAL(rl_weights_merge(&w, m, ad), 0);
    CU_ASSERT_EQUAL(w.packed, 1);
    int bad = 0, n = 0;
    for (int l = 0; l < m->L; l++) {
        const rl_layer_t *r = &w.layers[l];
        int qd = m->H * m->Dh;
        bad += !r->qkv.w || r->qkv.src[0] != r->wq.data || r->o.src[0] != r->wo.data;
        bad += r->attn_norm == m->layers[l].attn_norm; /* the adapter's norm */
        if (r->ly->moe) {
            bad += !r->exp_gu[0].w || r->exp_gu[0].src[0] != r->moe_w.gate[0].data;
            bad += r->router.w && r->router.src[0] == r->moe_w.router.data; /* f32 router */
        }
        uint16_t *p = malloc(sizeof(uint16_t) * amx_packed_elems(qd, m->D));
        amx_pack_bf16(p, r->wq.data, qd, m->D);
        bad += memcmp(p, r->qkv.w, sizeof(uint16_t) * amx_packed_elems(qd, m->D)) != 0;
        bad += r->wq.data == m->layers[l].wq.data; /* a merged copy */
        free(p);
        n++;
    }
    CU_ASSERT(n > 0);
    CU_ASSERT_EQUAL(bad, 0);
    rl_weights_free(&w);
}

/* Routers and norms trained in full, unmerged and merged: the engine's logprobs are the
 * learner's with them bound, merged and unmerged engines agree, and a full tensor that
 * names no weight of the model (or has the wrong shape) is refused by the merge. */
static void test_full_tensors(void) {
    consistency(ARCH_QWEN3_MOE, DT_F32, 2, 0);
    consistency(ARCH_MIXTRAL, DT_F32, 2, 0);
    consistency(ARCH_DEEPSEEK_V3, DT_F32, 2, 0);
    consistency(ARCH_QWEN3_MOE, DT_F32, 2, 1);
    consistency(ARCH_MIXTRAL, DT_F32, 2, 1);
    consistency(ARCH_DEEPSEEK_V3, DT_F32, 2, 1);
    /* bf16: the LoRA pairs' B zero, so that the merged copies are the base exactly (a
     * merge into bf16 rounds); the copies are packed again for the tiles */
    const model_arch_t archs[3] = {ARCH_QWEN3_MOE, ARCH_DEEPSEEK_V3, ARCH_QWEN3_MOE};
    const dtype_t dts[3] = {DT_F32, DT_F32, DT_BF16};
    for (int a = 0; a < 3; a++) {
        fx_t f;
        fx_open(&f, archs[a], dts[a]);
        lora_adapter_t *ad = make_adapter_full(f.m, 4);
        if (dts[a] == DT_BF16) {
            for (int i = 0; i < ad->n_entries; i++) {
                const lora_tensor_t *t = &ad->tensors[2 * i + 1];
                memset(ad->params + t->offset, 0, sizeof(float) * t->numel);
            }
            check_packed_merge(f.m, ad);
        }
        merged_vs_unmerged(&f, ad);
        engine_opts_t o;
        memset(&o, 0, sizeof o);
        o.max_batch = 4;
        o.max_seq_len = 32;
        o.merge_adapter = 1;
        engine_t *e = new_engine(&f, &o);
        lora_tensor_t *last = &ad->tensors[ad->n_tensors - 1]; /* model.norm.weight */
        last->shape[0]--;
        CU_ASSERT_EQUAL(engine_set_adapter(e, ad, 1), MO_EINVAL);
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "model.norm.weight"));
        last->shape[0]++;
        char *name = last->name;
        last->name = "model.no_such_norm.weight";
        CU_ASSERT_EQUAL(engine_set_adapter(e, ad, 1), MO_EINVAL);
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "no_such_norm"));
        last->name = name;
        CU_ASSERT_EQUAL(engine_set_adapter(e, ad, 1), 0);
        engine_destroy(&e);
        lora_adapter_destroy(&ad);
        fx_close(&f);
    }
}

static void test_consistency_mixtral(void) {
    consistency(ARCH_MIXTRAL, DT_BF16, 0, 0);
    consistency(ARCH_MIXTRAL, DT_BF16, 1, 0);
}

static void test_consistency_deepseek(void) {
    consistency(ARCH_DEEPSEEK_V3, DT_BF16, 0, 0);
    consistency(ARCH_DEEPSEEK_V3, DT_BF16, 1, 0);
}

/* Without packed weight copies (the tiles read the weights in place), and with the AMX
 * tiles turned off (as on a CPU without them: the engine runs the CPU kernels, no packed
 * copies): the engine still agrees with the learner. */
static void test_without_amx(void) {
    no_packed = 1;
    consistency(ARCH_QWEN3_MOE, DT_BF16, 1, 0);
    consistency(ARCH_DEEPSEEK_V3, DT_BF16, 0, 0);
    no_packed = 0;
    amx_matmul_force_off(1);
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    rl_weights_t w;
    CU_ASSERT_EQUAL_FATAL(rl_weights_init(&w, f.m, 1), 0);
    CU_ASSERT_EQUAL(w.packed, 0);
    CU_ASSERT(w.k.matmul_forward == f.m->k->matmul_forward);
    CU_ASSERT_PTR_NULL(w.layers[0].qkv.w);
    rl_weights_free(&w);
    fx_close(&f);
    consistency(ARCH_QWEN3_MOE, DT_BF16, 1, 0);
    consistency(ARCH_DEEPSEEK_V3, DT_BF16, 2, 0);
    consistency(ARCH_QWEN3_MOE, DT_F32, 2, 1);
    amx_matmul_force_off(0);
}

/* Merged into f32 copies: the learner's unmerged forward still agrees. */
static void test_merged_adapter(void) {
    consistency(ARCH_QWEN3_MOE, DT_F32, 1, 1);
    consistency(ARCH_DEEPSEEK_V3, DT_F32, 1, 1);
}

/* The KV cache holds, per token and layer, the MLA latent (kv_lora_rank +
 * qk_rope_head_dim floats) for DeepSeek-V3, and keys and values of every kv head
 * otherwise. */
static void test_kv_memory(void) {
    fx_t f;
    fx_open(&f, ARCH_DEEPSEEK_V3, DT_BF16);
    const model_config_t *c = &f.m->cfg;
    engine_t *e = new_engine(&f, NULL);
    size_t latent = sizeof(float) * (size_t)c->num_hidden_layers *
                    (size_t)(c->kv_lora_rank + c->qk_rope_head_dim);
    size_t expanded = sizeof(float) * (size_t)c->num_hidden_layers *
                      (size_t)c->num_attention_heads *
                      (size_t)(c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim);
    size_t got = engine_kv_token_bytes(e);
    tu_report("deepseek_v3 KV cache: %zu bytes per token (latent), expanded keys and values "
              "would be %zu",
              got, expanded);
    CU_ASSERT_EQUAL(got, latent);
    CU_ASSERT(got < expanded);
    engine_destroy(&e);
    fx_close(&f);
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    e = new_engine(&f, NULL);
    CU_ASSERT_EQUAL(engine_kv_token_bytes(e),
                    2 * sizeof(float) * (size_t)f.m->L * (size_t)f.m->Hkv * (size_t)f.m->Dh);
    engine_destroy(&e);
    fx_close(&f);
}

/* The same requests in one batch, one at a time, and on one thread give the same tokens. */
static void test_batch_vs_single(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    lora_adapter_t *ad = make_adapter(f.m, 9);
    int32_t p[4][16];
    const int P[4] = {7, 3, 12, 9};
    gen_request_t r[4];
    for (int k = 0; k < 4; k++) {
        prompt_of(p[k], P[k], 40 + (uint64_t)k);
        r[k] = request(100 + (uint64_t)k, p[k], P[k], 2, 1.0f, 10 + 3 * k, 50 + (uint64_t)k);
    }
    r[2].params.sampling.top_k = 30;
    gen_group_t *all[4], *one[4], *single_thread[4];
    engine_t *e = new_engine(&f, NULL);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e, ad, 1), 0);
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, r, 4, all), 0);
    for (int k = 0; k < 4; k++)
        CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r[k], 1, &one[k]), 0);
    int threads = backend_cpu_threads();
    backend_cpu_set_threads(1);
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, r, 4, single_thread), 0);
    backend_cpu_set_threads(threads);
    double err = 0.0;
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 2; j++) {
            const gen_sample_t *a = &all[k]->samples[j], *b = &one[k]->samples[j];
            const gen_sample_t *c = &single_thread[k]->samples[j];
            CU_ASSERT_EQUAL_FATAL(a->n_tokens, b->n_tokens);
            CU_ASSERT_EQUAL_FATAL(a->n_tokens, c->n_tokens);
            CU_ASSERT(!memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n_tokens));
            CU_ASSERT(!memcmp(a->tokens, c->tokens, sizeof(int32_t) * (size_t)a->n_tokens));
            for (int i = 0; i < a->n_tokens; i++)
                err = fmax(err, fmax(fabs(a->logprobs[i] - b->logprobs[i]),
                                     fabs(a->logprobs[i] - c->logprobs[i])));
        }
    TU_ASSERT_CLOSE(err, 1e-5, "batched vs single logprobs");
    /* The two samples of a prompt differ (different draws). */
    CU_ASSERT(memcmp(all[0]->samples[0].tokens, all[0]->samples[1].tokens, sizeof(int32_t) * 10) !=
              0);
    free_groups(all, 4);
    free_groups(one, 4);
    free_groups(single_thread, 4);
    engine_destroy(&e);
    lora_adapter_destroy(&ad);
    fx_close(&f);
}

/* A group's samples share one prefill; separately prefilled samples give the same. */
static void test_prefix_sharing(void) {
    fx_t f;
    fx_open(&f, ARCH_MIXTRAL, DT_BF16);
    int32_t p[2][40];
    const int P[2] = {37, 18}; /* over two and one KV blocks, partial last blocks */
    gen_request_t r[2];
    for (int k = 0; k < 2; k++) {
        prompt_of(p[k], P[k], 60 + (uint64_t)k);
        r[k] = request(200 + (uint64_t)k, p[k], P[k], 4, 1.0f, 12, 7);
    }
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 16;
    o.max_seq_len = 96;
    o.tok = f.tok;
    engine_t *shared = new_engine(&f, &o);
    o.no_prefix_sharing = 1;
    engine_t *separate = new_engine(&f, &o);
    gen_group_t *a[2], *b[2];
    CU_ASSERT_EQUAL_FATAL(engine_generate(shared, r, 2, a), 0);
    CU_ASSERT_EQUAL_FATAL(engine_generate(separate, r, 2, b), 0);
    CU_ASSERT_EQUAL(engine_get_stats(shared).prefill_tokens, P[0] + P[1]);
    CU_ASSERT_EQUAL(engine_get_stats(separate).prefill_tokens, 4 * (P[0] + P[1]));
    double err = 0.0;
    for (int k = 0; k < 2; k++) {
        CU_ASSERT_EQUAL(memcmp(a[k]->prompt_routing, b[k]->prompt_routing,
                               sizeof(uint16_t) * (size_t)P[k] * a[k]->M * a[k]->K),
                        0);
        for (int j = 0; j < 4; j++) {
            const gen_sample_t *x = &a[k]->samples[j], *y = &b[k]->samples[j];
            CU_ASSERT_EQUAL_FATAL(x->n_tokens, y->n_tokens);
            CU_ASSERT(!memcmp(x->tokens, y->tokens, sizeof(int32_t) * (size_t)x->n_tokens));
            CU_ASSERT(!memcmp(x->routing, y->routing,
                              sizeof(uint16_t) * (size_t)x->n_tokens * a[k]->M * a[k]->K));
            for (int i = 0; i < x->n_tokens; i++)
                err = fmax(err, fabs(x->logprobs[i] - y->logprobs[i]));
        }
    }
    TU_ASSERT_CLOSE(err, 1e-5, "shared vs separate prefill logprobs");
    free_groups(a, 2);
    free_groups(b, 2);
    engine_destroy(&shared);
    engine_destroy(&separate);
    fx_close(&f);
}

static int run_until_done(engine_t *e, gen_group_t **out, int n) {
    int got = 0, guard = 0;
    while (got < n && guard++ < 10000) {
        int rc = engine_step(e);
        if (rc < 0)
            return rc;
        while (got < n && engine_collect(e, &out[got]) == 1)
            got++;
    }
    return got == n ? 0 : -1;
}

/* Swapping the adapter between decode steps: tokens before the swap are as under the
 * old adapter, the next token's distribution changes, versions are recorded. */
static void adapter_swap(model_arch_t arch, dtype_t dt, int merge) {
    fx_t f;
    fx_open(&f, arch, dt);
    lora_adapter_t *a1 = make_adapter(f.m, 21), *a2 = make_adapter(f.m, 22);
    int32_t p[9];
    prompt_of(p, 9, 3);
    gen_request_t r = request(7, p, 9, 2, 1.0f, 12, 3);
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 16;
    o.max_seq_len = 96;
    o.merge_adapter = merge;
    engine_t *ref = new_engine(&f, &o);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(ref, a1, 1), 0);
    gen_group_t *gref;
    CU_ASSERT_EQUAL_FATAL(engine_generate(ref, &r, 1, &gref), 0);
    engine_destroy(&ref);

    engine_t *e = new_engine(&f, &o);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e, a1, 1), 0);
    CU_ASSERT_EQUAL_FATAL(engine_submit(e, &r), 0);
    for (int s = 0; s < 4; s++) /* prefill (token 0), then tokens 1, 2, 3 */
        CU_ASSERT_EQUAL_FATAL(engine_step(e), 1);
    /* An adapter that does not fit is refused and the current one stays. */
    lora_module_desc_t *mods = malloc(sizeof *mods * (size_t)f.m->n_modules);
    memcpy(mods, f.m->modules, sizeof *mods * (size_t)f.m->n_modules);
    mods[0].OC += 1;
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {2, 2.0f, 0, 0.0f, 1, 1, targets, 1};
    lora_adapter_t *bad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&bad, &lc, mods, f.m->n_modules), 0);
    CU_ASSERT_EQUAL(engine_set_adapter(e, bad, 9), MO_EINVAL);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e, a2, 2), 0);
    gen_group_t *g;
    CU_ASSERT_EQUAL_FATAL(run_until_done(e, &g, 1), 0);
    for (int j = 0; j < 2; j++) {
        const gen_sample_t *x = &g->samples[j], *y = &gref->samples[j];
        CU_ASSERT_FATAL(x->n_tokens > 4);
        CU_ASSERT(!memcmp(x->tokens, y->tokens, sizeof(int32_t) * 4));
        CU_ASSERT(!memcmp(x->logprobs, y->logprobs, sizeof(float) * 4));
        if (x->tokens[4] == y->tokens[4])
            CU_ASSERT(fabs(x->logprobs[4] - y->logprobs[4]) > 1e-3);
        CU_ASSERT_EQUAL(x->version_first, 1);
        CU_ASSERT_EQUAL(x->version_last, 2);
        CU_ASSERT_EQUAL(y->version_last, 1);
    }
    /* Back to the base model: version 0. */
    CU_ASSERT_EQUAL(engine_set_adapter(e, NULL, 0), 0);
    gen_group_t *gb;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &gb), 0);
    CU_ASSERT_EQUAL(gb->samples[0].version_last, 0);
    /* ... which is the untouched base: a fresh engine without an adapter agrees. */
    CU_ASSERT_PTR_NULL(f.m->adapter);
    engine_t *plain = new_engine(&f, NULL);
    gen_group_t *gp;
    CU_ASSERT_EQUAL_FATAL(engine_generate(plain, &r, 1, &gp), 0);
    for (int j = 0; j < 2; j++)
        CU_ASSERT(gp->samples[j].n_tokens == gb->samples[j].n_tokens &&
                  !memcmp(gp->samples[j].tokens, gb->samples[j].tokens,
                          sizeof(int32_t) * (size_t)gp->samples[j].n_tokens));
    gen_group_free(&gp);
    engine_destroy(&plain);
    gen_group_free(&gb);
    gen_group_free(&g);
    gen_group_free(&gref);
    engine_destroy(&e);
    lora_adapter_destroy(&bad);
    free(mods);
    lora_adapter_destroy(&a1);
    lora_adapter_destroy(&a2);
    fx_close(&f);
}

static void test_adapter_swap(void) {
    adapter_swap(ARCH_QWEN3_MOE, DT_BF16, 0);
    adapter_swap(ARCH_QWEN3_MOE, DT_BF16, 1); /* merged: the copies are rebuilt, the base is
                                                 untouched */
    /* MLA: the absorbed kv_b_proj follows the adapter (unmerged and merged). */
    adapter_swap(ARCH_DEEPSEEK_V3, DT_BF16, 0);
    adapter_swap(ARCH_DEEPSEEK_V3, DT_F32, 1);
}

/* Byte length of the text of tokens [0, k). */
static size_t text_bytes(const tokenizer_t *tok, const int32_t *t, int k) {
    size_t n = 0;
    for (int i = 0; i < k; i++) {
        const char *b;
        size_t len;
        CU_ASSERT_EQUAL_FATAL(tokenizer_token_bytes(tok, t[i], &b, &len), 0);
        n += len;
    }
    return n;
}

static void test_stops_and_limits(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    engine_t *e = new_engine(&f, NULL);
    int32_t p[6];
    prompt_of(p, 6, 11);
    gen_request_t r = request(1, p, 6, 1, 0.0f, 24, 0);
    gen_group_t *ref;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &ref), 0);
    const gen_sample_t *rs = &ref->samples[0];
    CU_ASSERT_EQUAL_FATAL(rs->n_tokens, 24);
    CU_ASSERT_EQUAL(rs->finish, FINISH_LENGTH);
    CU_ASSERT_EQUAL(rs->text_len, text_bytes(f.tok, rs->tokens, 24));

    /* A stop string: the bytes of a later token (NUL-free), matched on the text. */
    int k0 = 3;
    const char *tb;
    size_t tl;
    while (k0 < 20 && (tokenizer_token_bytes(f.tok, rs->tokens[k0], &tb, &tl) < 0 || tl == 0 ||
                       memchr(tb, 0, tl)))
        k0++;
    CU_ASSERT_FATAL(k0 < 20);
    char stop[64];
    memcpy(stop, tb, tl);
    stop[tl] = '\0';
    const char *stops[1] = {stop};
    size_t at = 0;
    while (memcmp(rs->text + at, stop, tl))
        at++; /* first occurrence */
    int kend = 0;
    while (text_bytes(f.tok, rs->tokens, kend) < at + tl)
        kend++;
    for (int incl = 0; incl < 2; incl++) {
        gen_request_t rq = r;
        rq.params.stop_strings = stops;
        rq.params.n_stop_strings = 1;
        rq.params.include_stop_string = incl;
        gen_group_t *g;
        CU_ASSERT_EQUAL_FATAL(engine_generate(e, &rq, 1, &g), 0);
        const gen_sample_t *s = &g->samples[0];
        CU_ASSERT_EQUAL(s->finish, FINISH_STOP_STRING);
        CU_ASSERT_EQUAL(s->n_tokens, kend);
        CU_ASSERT(!memcmp(s->tokens, rs->tokens, sizeof(int32_t) * (size_t)kend));
        CU_ASSERT_EQUAL(s->text_len, at + (incl ? tl : 0));
        CU_ASSERT(!memcmp(s->text, rs->text, s->text_len) && s->text[s->text_len] == '\0');
        gen_group_free(&g);
    }

    /* A stop id: generation ends at its first occurrence, which is kept as the last token;
     * the text leaves its bytes out. */
    int32_t sid = rs->tokens[5];
    int kid = 0;
    while (rs->tokens[kid] != sid)
        kid++;
    gen_request_t rq = r;
    rq.params.stop_ids = &sid;
    rq.params.n_stop_ids = 1;
    gen_group_t *g;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &rq, 1, &g), 0);
    CU_ASSERT_EQUAL(g->samples[0].finish, FINISH_STOP_TOKEN);
    CU_ASSERT_EQUAL(g->samples[0].n_tokens, kid + 1);
    CU_ASSERT_EQUAL(g->samples[0].tokens[kid], sid);
    CU_ASSERT_EQUAL(g->samples[0].text_len, text_bytes(f.tok, rs->tokens, kid));
    gen_group_free(&g);

    /* The model's eos ids (and the tokenizer's) stop by default, unless ignore_eos. */
    engine_destroy(&e);
    f.m->cfg.n_eos = 1;
    f.m->cfg.eos_token_id[0] = sid;
    e = new_engine(&f, NULL);
    rq = r;
    rq.params.ignore_eos = 0;
    int32_t teos = tokenizer_eos_id(f.tok);
    CU_ASSERT(teos >= 0);
    int keos = 0;
    while (rs->tokens[keos] != sid && rs->tokens[keos] != teos)
        keos++;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &rq, 1, &g), 0);
    CU_ASSERT_EQUAL(g->samples[0].finish, FINISH_STOP_TOKEN);
    CU_ASSERT_EQUAL(g->samples[0].n_tokens, keos + 1);
    gen_group_free(&g);
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &g), 0); /* ignore_eos */
    CU_ASSERT_EQUAL(g->samples[0].n_tokens, 24);
    gen_group_free(&g);
    engine_destroy(&e);

    /* max_new_tokens, and the room left by max_seq_len. */
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_seq_len = 6 + 5;
    o.tok = f.tok;
    e = new_engine(&f, &o);
    rq = request(2, p, 6, 2, 1.0f, 50, 1);
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &rq, 1, &g), 0);
    for (int j = 0; j < 2; j++) {
        CU_ASSERT_EQUAL(g->samples[j].n_tokens, 5);
        CU_ASSERT_EQUAL(g->samples[j].finish, FINISH_LENGTH);
    }
    gen_group_free(&g);
    rq.params.max_new_tokens = 3;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &rq, 1, &g), 0);
    CU_ASSERT_EQUAL(g->samples[1].n_tokens, 3);
    gen_group_free(&g);
    engine_destroy(&e);
    gen_group_free(&ref);
    fx_close(&f);
}

/* Bad requests come back with their own errors; the good ones in the batch still run. */
static void test_request_errors(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 4;
    o.max_seq_len = 128;
    o.kv_cache_tokens = 256;
    o.tok = f.tok;
    engine_t *e = new_engine(&f, &o);
    int32_t p[130], badid[3] = {1, 261 + 4, 2};
    prompt_of(p, 130, 5);
    const char *empty[1] = {""};
    enum { NR = 12 };
    gen_request_t r[NR];
    for (int i = 0; i < NR; i++)
        r[i] = request((uint64_t)i, p, 4, 2, 1.0f, 5, 1);
    r[1].prompt_len = 0;
    r[2].prompt = badid;
    r[2].prompt_len = 3;
    r[3].prompt_len = 128;
    r[4].n = 0;
    r[5].params.sampling.top_p = 0.0f;
    r[6].params.sampling.temperature = -1.0f;
    r[7].n = 5;
    r[8].params.max_new_tokens = 0;
    r[9].params.stop_strings = empty;
    r[9].params.n_stop_strings = 1;
    r[10].prompt_len = 60; /* 4 samples of up to 128 tokens: more than the whole cache */
    r[10].n = 4;
    r[10].params.max_new_tokens = 68;
    r[11].params.sampling.min_p = 1.0f;
    const char *words[NR] = {NULL,      "empty prompt", "vocabulary",  "max_seq_len",
                             "n = 0",   "top_p",        "temperature", "max_batch",
                             "max_new", "stop string",  "KV",          "min_p"};
    gen_group_t *g[NR];
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, r, NR, g), 0);
    CU_ASSERT_EQUAL(g[0]->status, 0);
    CU_ASSERT_EQUAL(g[0]->samples[1].n_tokens, 5);
    for (int i = 1; i < NR; i++) {
        CU_ASSERT_EQUAL(g[i]->status, MO_EINVAL);
        CU_ASSERT_EQUAL(g[i]->id, (uint64_t)i);
        CU_ASSERT_EQUAL(g[i]->n, 0);
        CU_ASSERT_PTR_NOT_NULL_FATAL(g[i]->error);
        if (!strstr(g[i]->error, words[i]))
            tu_report("request %d: \"%s\" does not mention \"%s\"", i, g[i]->error, words[i]);
        CU_ASSERT_PTR_NOT_NULL(strstr(g[i]->error, words[i]));
    }
    free_groups(g, NR);
    /* submit answers directly too, and the rejected request is still collected. */
    CU_ASSERT_EQUAL(engine_submit(e, &r[4]), MO_EINVAL);
    CU_ASSERT_EQUAL(engine_pending(e), 1);
    gen_group_t *x;
    CU_ASSERT_EQUAL(engine_collect(e, &x), 1);
    CU_ASSERT_EQUAL(x->status, MO_EINVAL);
    gen_group_free(&x);
    CU_ASSERT_EQUAL(engine_pending(e), 0);
    engine_destroy(&e);
    /* Stop strings need a tokenizer. */
    o.tok = NULL;
    e = new_engine(&f, &o);
    gen_request_t rs = request(1, p, 4, 1, 1.0f, 5, 1);
    const char *stops[1] = {"ab"};
    rs.params.stop_strings = stops;
    rs.params.n_stop_strings = 1;
    CU_ASSERT_EQUAL(engine_generate(e, &rs, 1, &x), 0);
    CU_ASSERT_EQUAL(x->status, MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(x->error, "tokenizer"));
    gen_group_free(&x);
    rs.params.n_stop_strings = 0;
    CU_ASSERT_EQUAL(engine_generate(e, &rs, 1, &x), 0);
    CU_ASSERT_EQUAL(x->status, 0);
    CU_ASSERT_PTR_NULL(x->samples[0].text);
    gen_group_free(&x);
    engine_destroy(&e);
    fx_close(&f);
}

/* A cache that holds one request at a time: the others wait, results do not change. */
static void test_kv_budget_wait(void) {
    fx_t f;
    fx_open(&f, ARCH_MIXTRAL, DT_BF16);
    int32_t p[3][10];
    gen_request_t r[3];
    for (int k = 0; k < 3; k++) {
        prompt_of(p[k], 10, 90 + (uint64_t)k);
        r[k] = request(300 + (uint64_t)k, p[k], 10, 2, 1.0f, 20, 4);
    }
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 8;
    o.max_seq_len = 64;
    o.kv_cache_tokens = 64; /* 4 blocks: one request (2 samples x 30 tokens) */
    engine_t *small = new_engine(&f, &o);
    o.kv_cache_tokens = 0;
    engine_t *big = new_engine(&f, &o);
    gen_group_t *a[3], *b[3];
    CU_ASSERT_EQUAL_FATAL(engine_generate(small, r, 3, a), 0);
    CU_ASSERT_EQUAL_FATAL(engine_generate(big, r, 3, b), 0);
    engine_stats_t st = engine_get_stats(small);
    CU_ASSERT(st.waited > 0);
    CU_ASSERT(st.kv_peak_tokens <= 64);
    CU_ASSERT(engine_get_stats(big).waited == 0);
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 2; j++) {
            CU_ASSERT_EQUAL(a[k]->status, 0);
            CU_ASSERT_EQUAL_FATAL(a[k]->samples[j].n_tokens, b[k]->samples[j].n_tokens);
            CU_ASSERT(!memcmp(a[k]->samples[j].tokens, b[k]->samples[j].tokens,
                              sizeof(int32_t) * (size_t)a[k]->samples[j].n_tokens));
        }
    free_groups(a, 3);
    free_groups(b, 3);
    engine_destroy(&small);
    engine_destroy(&big);
    fx_close(&f);
}

/* Submit while running, step, collect; requests join the running batch. */
static void test_step_api(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    engine_t *e = new_engine(&f, NULL);
    CU_ASSERT_EQUAL(engine_step(e), 0); /* idle */
    int32_t p[2][8];
    prompt_of(p[0], 8, 1);
    prompt_of(p[1], 5, 2);
    gen_request_t r[2] = {request(1, p[0], 8, 3, 1.0f, 9, 5), request(2, p[1], 5, 1, 1.0f, 4, 6)};
    CU_ASSERT_EQUAL(engine_submit(e, &r[0]), 0);
    CU_ASSERT_EQUAL(engine_step(e), 1);
    CU_ASSERT_EQUAL(engine_step(e), 1);
    CU_ASSERT_EQUAL(engine_submit(e, &r[1]), 0);
    CU_ASSERT_EQUAL(engine_pending(e), 2);
    gen_group_t *tmp;
    CU_ASSERT_EQUAL(engine_generate(e, r, 1, &tmp), MO_ESTATE);
    gen_group_t *got[2];
    CU_ASSERT_EQUAL_FATAL(run_until_done(e, got, 2), 0);
    CU_ASSERT_EQUAL(engine_pending(e), 0);
    CU_ASSERT_EQUAL(engine_step(e), 0);
    /* The short request joined later and finished first. */
    CU_ASSERT_EQUAL(got[0]->id, 2);
    CU_ASSERT_EQUAL(got[1]->id, 1);
    engine_t *e2 = new_engine(&f, NULL);
    gen_group_t *alone[2];
    CU_ASSERT_EQUAL_FATAL(engine_generate(e2, r, 2, alone), 0);
    for (int k = 0; k < 2; k++) {
        const gen_group_t *x = got[1 - k], *y = alone[k];
        for (int j = 0; j < x->n; j++)
            CU_ASSERT(x->samples[j].n_tokens == y->samples[j].n_tokens &&
                      !memcmp(x->samples[j].tokens, y->samples[j].tokens,
                              sizeof(int32_t) * (size_t)x->samples[j].n_tokens));
    }
    engine_stats_t st = engine_get_stats(e);
    CU_ASSERT_EQUAL(st.generated, 3 * 9 + 4);
    CU_ASSERT_EQUAL(st.steps_prefill, 2);
    free_groups(got, 2);
    free_groups(alone, 2);
    engine_destroy(&e2);
    engine_destroy(&e);
    fx_close(&f);
}

/* The rollout section of a job config as options and parameters. */
static void test_from_config(void) {
    moerl_config_t cfg;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&cfg), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.max_batch", "12"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.kv_cache_tokens", "5000"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "model.max_seq_len", "300"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.merge_adapter", "true"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.temperature", "0.6"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.top_p", "0.95"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.top_k", "40"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.max_new_tokens", "77"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.stop_strings", "[\"</answer>\", \"###\"]"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.record_prompt_routing", "true"), 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "run.seed", "99"), 0);
    engine_opts_t o;
    engine_opts_from_config(&o, &cfg);
    CU_ASSERT_EQUAL(o.max_batch, 12);
    CU_ASSERT_EQUAL(o.kv_cache_tokens, 5000);
    CU_ASSERT_EQUAL(o.max_seq_len, 300);
    CU_ASSERT_EQUAL(o.merge_adapter, 1);
    CU_ASSERT_EQUAL(o.no_packed_weights, 0);
    CU_ASSERT_EQUAL(config_set(&cfg, "rollout.packed_weights", "false"), 0);
    engine_opts_from_config(&o, &cfg);
    CU_ASSERT_EQUAL(o.no_packed_weights, 1);
    gen_params_t p;
    gen_params_from_config(&p, &cfg);
    CU_ASSERT(fabsf(p.sampling.temperature - 0.6f) < 1e-7f);
    CU_ASSERT(fabsf(p.sampling.top_p - 0.95f) < 1e-7f);
    CU_ASSERT_EQUAL(p.sampling.top_k, 40);
    CU_ASSERT_EQUAL(p.max_new_tokens, 77);
    CU_ASSERT_EQUAL_FATAL(p.n_stop_strings, 2);
    CU_ASSERT_STRING_EQUAL(p.stop_strings[1], "###");
    CU_ASSERT_EQUAL(p.record_prompt_routing, 1);
    CU_ASSERT_EQUAL(p.seed, 99);
    config_free(&cfg);
}

/* Runs the moerl executable; stdout lines parsed as JSON into lines (up to cap). */
static int run_cli(const char *args, cJSON **lines, int cap, int *n) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s generate %s 2>/dev/null", tu_moerl_exe(), args);
    FILE *p = popen(cmd, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    char *line = NULL;
    size_t lcap = 0;
    *n = 0;
    while (getline(&line, &lcap, p) > 0) {
        cJSON *j = cJSON_Parse(line);
        if (!j)
            tu_report("not JSON: %s", line);
        CU_ASSERT_PTR_NOT_NULL(j);
        if (j && *n < cap)
            lines[(*n)++] = j;
        else
            cJSON_Delete(j);
    }
    free(line);
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_cli(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_BF16);
    cJSON *l[8];
    int n;
    char args[2048];
    snprintf(args, sizeof args,
             "--model %s --prompt 'hello' -n 2 --max-tokens 6 --seed 5 --routing --ignore-eos",
             f.dir);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 0);
    CU_ASSERT_EQUAL_FATAL(n, 2);
    /* The same request in process gives the same tokens. */
    int32_t hello[5] = {'h', 'e', 'l', 'l', 'o'};
    gen_request_t r = request(0, hello, 5, 2, 1.0f, 6, 5);
    engine_t *e = new_engine(&f, NULL);
    gen_group_t *g;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &g), 0);
    for (int j = 0; j < 2; j++) {
        cJSON *o = l[j];
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(o, "prompt_id")->valueint, 0);
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(o, "sample")->valueint, j);
        CU_ASSERT_STRING_EQUAL(cJSON_GetObjectItem(o, "finish_reason")->valuestring, "length");
        CU_ASSERT(cJSON_IsString(cJSON_GetObjectItem(o, "text")));
        cJSON *ids = cJSON_GetObjectItem(o, "token_ids"), *lp = cJSON_GetObjectItem(o, "logprobs");
        cJSON *rt = cJSON_GetObjectItem(o, "routing");
        CU_ASSERT_EQUAL_FATAL(cJSON_GetArraySize(ids), 6);
        CU_ASSERT_EQUAL(cJSON_GetArraySize(lp), 6);
        CU_ASSERT_EQUAL_FATAL(cJSON_GetArraySize(rt), 6);
        CU_ASSERT_EQUAL(cJSON_GetArraySize(cJSON_GetArrayItem(rt, 0)), g->M);
        CU_ASSERT_EQUAL(cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetArrayItem(rt, 0), 0)), g->K);
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(o, "adapter_version")->valueint, 0);
        for (int i = 0; i < 6; i++) {
            CU_ASSERT_EQUAL(cJSON_GetArrayItem(ids, i)->valueint, g->samples[j].tokens[i]);
            CU_ASSERT(fabs(cJSON_GetArrayItem(lp, i)->valuedouble - g->samples[j].logprobs[i]) <
                      1e-6);
        }
        cJSON_Delete(o);
    }
    gen_group_free(&g);

    /* With a PEFT adapter: the same tokens as the engine with that adapter, version 1. */
    lora_adapter_t *ad = make_adapter(f.m, 31);
    char adir[600];
    snprintf(adir, sizeof adir, "%s/adapter", f.dir);
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, adir, NULL), 0);
    snprintf(args, sizeof args,
             "--model %s --adapter %s --prompt 'hello' -n 2 --max-tokens 6 --seed 5 --ignore-eos",
             f.dir, adir);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 0);
    CU_ASSERT_EQUAL_FATAL(n, 2);
    CU_ASSERT_EQUAL_FATAL(engine_set_adapter(e, ad, 1), 0);
    r.params.record_routing = 0;
    CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &g), 0);
    for (int j = 0; j < 2; j++) {
        cJSON *ids = cJSON_GetObjectItem(l[j], "token_ids"),
              *lp = cJSON_GetObjectItem(l[j], "logprobs");
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(l[j], "adapter_version")->valueint, 1);
        CU_ASSERT_PTR_NULL(cJSON_GetObjectItem(l[j], "routing"));
        for (int i = 0; i < 6; i++) {
            CU_ASSERT_EQUAL(cJSON_GetArrayItem(ids, i)->valueint, g->samples[j].tokens[i]);
            CU_ASSERT(fabs(cJSON_GetArrayItem(lp, i)->valuedouble - g->samples[j].logprobs[i]) <
                      1e-6);
        }
        cJSON_Delete(l[j]);
    }
    gen_group_free(&g);
    engine_destroy(&e);
    lora_adapter_destroy(&ad);

    /* A prompts file with bad lines: each gets its error line, the others run. */
    char path[600];
    snprintf(path, sizeof path, "%s/prompts.jsonl", f.dir);
    FILE *pf = fopen(path, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(pf);
    fputs("{\"id\": \"a\", \"prompt\": \"abc\"}\n{oops\n\n{\"prompt\": \"\"}\n"
          "{\"prompt_ids\": [1, 999]}\n{\"prompt\": \"x\", \"top_p\": 0}\n"
          "{\"prompt_ids\": [3, 4], \"n\": 3, \"max_tokens\": 2}\n",
          pf);
    fclose(pf);
    snprintf(args, sizeof args, "--model %s --prompts %s --max-tokens 4 --ignore-eos", f.dir, path);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 1);
    CU_ASSERT_EQUAL_FATAL(n, 8);
    CU_ASSERT_STRING_EQUAL(cJSON_GetObjectItem(l[0], "prompt_id")->valuestring, "a");
    CU_ASSERT_EQUAL(cJSON_GetArraySize(cJSON_GetObjectItem(l[0], "token_ids")), 4);
    const char *errs[4] = {"JSON", "empty", "vocabulary", "top_p"};
    for (int i = 1; i <= 4; i++) {
        cJSON *er = cJSON_GetObjectItem(l[i], "error");
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(l[i], "prompt_id")->valueint, i);
        CU_ASSERT_FATAL(cJSON_IsString(er));
        CU_ASSERT_PTR_NOT_NULL(strstr(er->valuestring, errs[i - 1]));
    }
    for (int i = 5; i < 8; i++) {
        CU_ASSERT_EQUAL(cJSON_GetObjectItem(l[i], "prompt_id")->valueint, 5);
        CU_ASSERT_EQUAL(cJSON_GetArraySize(cJSON_GetObjectItem(l[i], "token_ids")), 2);
    }
    for (int i = 0; i < n; i++)
        cJSON_Delete(l[i]);
    /* Usage errors. */
    CU_ASSERT_EQUAL(run_cli("--prompt x", l, 8, &n), 2);
    CU_ASSERT_EQUAL(n, 0);
    snprintf(args, sizeof args, "--model %s --prompt x --top-p abc", f.dir);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 2);
    snprintf(args, sizeof args, "--model %s --prompt x --device tpu", f.dir);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 2);
#ifndef MOERL_HAVE_CUDA
    /* A build without the CUDA backend refuses the device before any request runs. */
    snprintf(args, sizeof args, "--model %s --prompt x --device cuda", f.dir);
    CU_ASSERT_EQUAL(run_cli(args, l, 8, &n), 1);
    CU_ASSERT_EQUAL(n, 0);
#endif
    fx_close(&f);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"qwen3_moe: logprobs and routing vs the learner", test_consistency_qwen3},
        {"mixtral (sliding window): logprobs and routing vs the learner", test_consistency_mixtral},
        {"deepseek_v3 (MLA, shared expert, sigmoid router) vs the learner",
         test_consistency_deepseek},
        {"KV cache bytes per token: the MLA latent", test_kv_memory},
        {"no packed weights; without the AMX tiles", test_without_amx},
        {"merged adapter vs the learner", test_merged_adapter},
        {"routers and norms trained in full, unmerged and merged", test_full_tensors},
        {"batch vs one by one vs one thread", test_batch_vs_single},
        {"shared vs separate prefill", test_prefix_sharing},
        {"adapter swap mid-generation (unmerged and merged)", test_adapter_swap},
        {"stop strings, stop ids, eos, length limits", test_stops_and_limits},
        {"per-request errors", test_request_errors},
        {"waiting for KV room", test_kv_budget_wait},
        {"step-wise API", test_step_api},
        {"options and parameters from a job config", test_from_config},
        {"moerl generate", test_cli},
        CU_TEST_INFO_NULL,
    };
    return tu_main("engine", tests);
}
