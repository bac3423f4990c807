/* gpu_engine: the rollout engine on the CUDA device (engine_opts_t.device DEV_CUDA) against
 * the same engine on the CPU, on tiny random Qwen3-MoE (3 layers, the middle one dense, f32
 * and bf16) and Mixtral (sliding window 4, f32) models with a random LoRA adapter on every
 * linear projection. Four prompts (5, 1, 13 and 4 tokens) with 3, 1, 2 and 2 samples under
 * several sampling settings (temperature 1, greedy, top-k with top-p, min-p), in a batch of
 * 6 and a KV cache of 12 blocks of 4 tokens, so that requests wait for room and blocks are
 * used again. With f32 weights every sample must equal the CPU engine's: tokens, finish
 * reasons, routing (prompt and completion) and adapter versions exactly, log-probabilities
 * within 1e-5. Every device sample's log-probabilities are also checked against the
 * learner's forward of the whole sequence (model_forward on the CPU, temperature as
 * sampled): within 1e-4 for f32, 1e-2 * max(1, |logp|) for bf16 weights, whose device
 * products round their operands to bf16 (the tokens may then part from the CPU engine's,
 * which the bf16 case reports and does not assert). Also: separate prefills per sample, an
 * adapter swapped twice mid-generation (to an adapter of another rank, then to none), and
 * the refusals (merge_adapter on the device, a model the device path does not run).
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/backend.h"
#include "core/rng.h"
#include "core/status.h"
#include "rollout/engine.h"
#include "tests/model_gpu_fixture.h"
#include "tests/testutil.h"

#define NREQ 4
#define MAXP 13
#define MAX_NEW 9
#define LOGP_TOL_ENGINE 1e-5 /* device vs CPU engine, f32 */
#define LOGP_TOL_F32 1e-4    /* device engine vs the learner's forward, f32 */
#define LOGP_TOL_BF16 1e-2   /* ... bf16 weights, times max(1, |logp|) */

static const int g_plen[NREQ] = {5, 1, 13, 4};
static const int g_G[NREQ] = {3, 1, 2, 2};

static void fx_open(fx_t *f, model_arch_t arch, dtype_t dt) {
    fx_opts_t o = {0.25f, 0.15f, 0, 0.0f, 1};
    fx_open_model(f, arch, dt, arch == ARCH_MIXTRAL ? 17 : 13, &o);
}

typedef struct reqs {
    int32_t prompt[NREQ][MAXP];
    gen_request_t r[NREQ];
} reqs_t;

/* The four requests: temperature 1; greedy; 0.8 with top-k 5 and top-p 0.9; 1 with min-p. */
static void make_reqs(reqs_t *q, const model_t *m) {
    memset(q, 0, sizeof *q);
    for (int k = 0; k < NREQ; k++) {
        for (int i = 0; i < g_plen[k]; i++)
            q->prompt[k][i] = (int32_t)(rng_uniform(91, (uint64_t)k, (uint64_t)i) * m->V) % m->V;
        gen_request_t *r = &q->r[k];
        r->id = 100 + (uint64_t)k;
        r->prompt = q->prompt[k];
        r->prompt_len = g_plen[k];
        r->n = g_G[k];
        r->params = gen_params_default();
        r->params.max_new_tokens = MAX_NEW;
        r->params.seed = 5;
        r->params.ignore_eos = 1;
        r->params.record_routing = 1;
        r->params.record_prompt_routing = 1;
    }
    q->r[1].params.sampling.temperature = 0.0f;
    q->r[2].params.sampling.temperature = 0.8f;
    q->r[2].params.sampling.top_k = 5;
    q->r[2].params.sampling.top_p = 0.9f;
    q->r[3].params.sampling.min_p = 0.05f;
}

static engine_opts_t small_opts(device_t dev) {
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_batch = 6;
    o.max_seq_len = 32;
    o.kv_cache_tokens = 48;
    o.block_tokens = 4;
    o.device = dev;
    return o;
}

static engine_t *new_engine(fx_t *f, const engine_opts_t *o) {
    engine_t *e = NULL;
    int rc = engine_new(&e, f->m, o);
    if (rc < 0)
        tu_report("engine (%s): %s", o->device == DEV_CUDA ? "cuda" : "cpu", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    TU_CHECK_RC(engine_set_adapter(e, f->ad, 1));
    return e;
}

/* Runs the requests to completion on an engine with options o; gs (or NULL) receives its
 * CUDA graphs' counts. */
static void run_on(fx_t *f, const engine_opts_t *o, const reqs_t *q, gen_group_t **out,
                   engine_graph_stats_t *gs) {
    engine_t *e = new_engine(f, o);
    TU_CHECK_RC(engine_generate(e, q->r, NREQ, out));
    engine_stats_t st = engine_get_stats(e);
    CU_ASSERT(st.waited > 0); /* the batch and the cache were short: requests waited */
    if (gs)
        engine_get_graph_stats(e, gs);
    engine_destroy(&e);
}

static void run(fx_t *f, const engine_opts_t *o, const reqs_t *q, gen_group_t **out) {
    run_on(f, o, q, out, NULL);
}

static void free_groups(gen_group_t **g) {
    for (int i = 0; i < NREQ; i++)
        gen_group_free(&g[i]);
}

/* Device groups d against CPU groups c: everything equal, logprobs within tol. */
static void expect_same(gen_group_t **d, gen_group_t **c, const char *what) {
    double err = 0;
    int diff = 0, tokens = 0;
    for (int k = 0; k < NREQ; k++) {
        CU_ASSERT_EQUAL_FATAL(d[k]->status, 0);
        CU_ASSERT_EQUAL_FATAL(c[k]->status, 0);
        CU_ASSERT_EQUAL_FATAL(d[k]->n, c[k]->n);
        size_t MK = (size_t)c[k]->M * c[k]->K, P = (size_t)c[k]->prompt_len;
        diff += memcmp(d[k]->prompt_routing, c[k]->prompt_routing, sizeof(uint16_t) * P * MK) != 0;
        for (int j = 0; j < c[k]->n; j++) {
            const gen_sample_t *a = &d[k]->samples[j], *b = &c[k]->samples[j];
            CU_ASSERT_EQUAL_FATAL(a->n_tokens, b->n_tokens);
            diff += memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)b->n_tokens) != 0;
            diff += memcmp(a->routing, b->routing, sizeof(uint16_t) * b->n_tokens * MK) != 0;
            diff += a->finish != b->finish || a->version_first != b->version_first ||
                    a->version_last != b->version_last;
            for (int i = 0; i < b->n_tokens; i++)
                err = fmax(err, fabs((double)a->logprobs[i] - b->logprobs[i]));
            tokens += b->n_tokens;
        }
    }
    printf("\n  %s: %d tokens, differences %d, max |dlogp| vs cpu engine %.3g\n", what, tokens,
           diff, err);
    CU_ASSERT(tokens > 0);
    CU_ASSERT_EQUAL(diff, 0);
    CU_ASSERT(err <= LOGP_TOL_ENGINE);
}

/* max over the sample's tokens of |engine logp - learner logp| / max(1, |learner logp|)
 * when rel, else the plain difference. */
static double learner_err(model_t *m, const gen_group_t *g, const gen_sample_t *s, float temp,
                          int rel) {
    int P = g->prompt_len, n = s->n_tokens, T = P + n;
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)T), *pos = malloc(sizeof(int32_t) * T);
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)T);
    float *logp = malloc(sizeof(float) * (size_t)T);
    memcpy(seq, g->prompt, sizeof(int32_t) * (size_t)P);
    memcpy(seq + P, s->tokens, sizeof(int32_t) * (size_t)n);
    int32_t cu[2] = {0, T};
    model_batch_next_token(pos, tgt, seq, cu, 1);
    model_batch_t b = {T, 1, seq, pos, cu, tgt, temp, NULL, NULL};
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, logp, NULL, 0), 0);
    double err = 0;
    for (int i = 0; i < n; i++) {
        double ref = logp[P - 1 + i], d = fabs(ref - s->logprobs[i]);
        err = fmax(err, rel ? d / fmax(1.0, fabs(ref)) : d);
    }
    free(seq);
    free(pos);
    free(tgt);
    free(logp);
    return err;
}

/* Every device sample against the learner's forward with the adapter bound. */
static void expect_learner(fx_t *f, gen_group_t **d, const reqs_t *q, double tol, int rel,
                           const char *what) {
    TU_CHECK_RC(model_set_adapter(f->m, f->ad));
    double err = 0;
    for (int k = 0; k < NREQ; k++) {
        float T = q->r[k].params.sampling.temperature;
        for (int j = 0; j < d[k]->n; j++)
            err = fmax(err, learner_err(f->m, d[k], &d[k]->samples[j], T > 0 ? T : 1.0f, rel));
    }
    printf("  %s: max |dlogp| vs learner %.3g (tolerance %.0e%s)\n", what, err, tol,
           rel ? " x max(1, |logp|)" : "");
    CU_ASSERT(err <= tol);
    TU_CHECK_RC(model_set_adapter(f->m, NULL));
}

/* The device engine (its decode steps replayed as CUDA graphs when gs is given, which
 * then receives their counts) against the CPU engine and the learner on one model. */
static void check_model_on(model_arch_t arch, dtype_t dt, int no_prefix_sharing,
                           engine_graph_stats_t *gs, const char *what) {
    fx_t f;
    fx_open(&f, arch, dt);
    reqs_t q;
    make_reqs(&q, f.m);
    gen_group_t *c[NREQ], *d[NREQ];
    engine_opts_t oc = small_opts(DEV_CPU), od = small_opts(DEV_CUDA);
    oc.no_prefix_sharing = od.no_prefix_sharing = no_prefix_sharing;
    od.cuda_graphs = gs != NULL;
    run(&f, &oc, &q, c);
    run_on(&f, &od, &q, d, gs);
    if (dt == DT_F32) {
        expect_same(d, c, what);
        expect_learner(&f, d, &q, LOGP_TOL_F32, 0, what);
    } else {
        int same = 0, total = 0;
        for (int k = 0; k < NREQ; k++)
            for (int j = 0; j < c[k]->n; j++, total++)
                same += d[k]->samples[j].n_tokens == c[k]->samples[j].n_tokens &&
                        !memcmp(d[k]->samples[j].tokens, c[k]->samples[j].tokens,
                                sizeof(int32_t) * (size_t)c[k]->samples[j].n_tokens);
        printf("\n  %s: %d of %d samples equal to the cpu engine's\n", what, same, total);
        expect_learner(&f, d, &q, LOGP_TOL_BF16, 1, what);
    }
    free_groups(c);
    free_groups(d);
    fx_close(&f);
}

static void check_model(model_arch_t arch, dtype_t dt, int no_prefix_sharing, const char *what) {
    check_model_on(arch, dt, no_prefix_sharing, NULL, what);
}

/* Decode steps replayed as CUDA graphs (rows padded to 1, 2, 4, 8, 8k): the CPU engine's
 * tokens, routing and logprobs as without graphs; on a GPU steps replay recorded graphs,
 * in the host twin (no graphs) every step runs as usual and the reason is kept. */
static void test_qwen3_graphs(void) {
    engine_graph_stats_t gs;
    check_model_on(ARCH_QWEN3_MOE, DT_F32, 0, &gs, "qwen3-moe f32, cuda graphs");
    printf("  graphs: %llu recorded, %llu steps replayed, %llu as usual, %llu dropped%s%s\n",
           (unsigned long long)gs.captured, (unsigned long long)gs.replayed,
           (unsigned long long)gs.eager, (unsigned long long)gs.invalidated,
           gs.off_reason[0] ? "; off: " : "", gs.off_reason);
#ifdef MOERL_HOST_TWIN
    CU_ASSERT(gs.captured == 0 && gs.replayed == 0 && gs.eager > 0);
    CU_ASSERT(strstr(gs.off_reason, "no CUDA graphs") != NULL);
#else
    CU_ASSERT_STRING_EQUAL(gs.off_reason, "");
    CU_ASSERT(gs.captured > 0);
    CU_ASSERT(gs.replayed > gs.captured); /* recorded shapes came again */
#endif
}

static void test_qwen3_f32(void) {
    check_model(ARCH_QWEN3_MOE, DT_F32, 0, "qwen3-moe f32");
}

static void test_mixtral_window(void) {
    check_model(ARCH_MIXTRAL, DT_F32, 0, "mixtral f32, window 4");
}

static void test_separate_prefill(void) {
    check_model(ARCH_QWEN3_MOE, DT_F32, 1, "qwen3-moe f32, no prefix sharing");
}

static void test_qwen3_bf16(void) {
    check_model(ARCH_QWEN3_MOE, DT_BF16, 0, "qwen3-moe bf16");
}

/* Submits the requests, runs 3 steps with f->ad (version 1), swaps to ad2 (version 2), runs
 * 4 more, swaps to no adapter (version 3) and runs to the end. */
static void run_swaps(fx_t *f, const engine_opts_t *o, const reqs_t *q,
                      const lora_adapter_t *ad2, gen_group_t **out) {
    engine_t *e = new_engine(f, o);
    for (int k = 0; k < NREQ; k++)
        TU_CHECK_RC(engine_submit(e, &q->r[k]));
    for (int s = 0; s < 7; s++) {
        if (s == 3)
            TU_CHECK_RC(engine_set_adapter(e, ad2, 2));
        CU_ASSERT_EQUAL_FATAL(engine_step(e), 1);
    }
    TU_CHECK_RC(engine_set_adapter(e, NULL, 3));
    int got = 0;
    while (got < NREQ) {
        CU_ASSERT_FATAL(engine_step(e) >= 0);
        gen_group_t *g;
        while (engine_collect(e, &g) == 1)
            out[g->ticket] = g, got++;
    }
    engine_destroy(&e);
}

static void test_adapter_swap(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32);
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {8, 16.0f, 0, 0.0f, 23, 1, targets, 1}; /* another rank */
    lora_adapter_t *ad2 = NULL;
    TU_CHECK_RC(lora_adapter_new(&ad2, &lc, f.m->modules, f.m->n_modules));
    tu_randomise_adapter(ad2, 29);
    reqs_t q;
    make_reqs(&q, f.m);
    gen_group_t *c[NREQ], *d[NREQ];
    engine_opts_t oc = small_opts(DEV_CPU), od = small_opts(DEV_CUDA);
    run_swaps(&f, &oc, &q, ad2, c);
    run_swaps(&f, &od, &q, ad2, d);
    expect_same(d, c, "adapter swapped mid-generation");
    int versions = 0;
    for (int k = 0; k < NREQ; k++)
        for (int j = 0; j < d[k]->n; j++)
            versions += d[k]->samples[j].version_last == 3;
    CU_ASSERT(versions > 0); /* some samples ran past both swaps */
    free_groups(c);
    free_groups(d);
    lora_adapter_destroy(&ad2);
    fx_close(&f);
}

static void test_refusals(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32);
    engine_opts_t o = small_opts(DEV_CUDA);
    o.merge_adapter = 1;
    engine_t *e = NULL;
    CU_ASSERT_EQUAL(engine_new(&e, f.m, &o), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(e);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "merge_adapter"));
    moerl_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.run.device = DEV_CUDA;
    engine_opts_from_config(&o, &cfg);
    CU_ASSERT_EQUAL(o.device, DEV_CUDA);
    fx_close(&f);
    /* Multi-head latent attention: the device path refuses the model, naming it. */
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_DEEPSEEK_V3, INIT_SIZE_TINY, DT_F32), 0);
    char dir[512];
    model_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    init_model_opts_t io = {3, 0.15f};
    TU_CHECK_RC(init_model_write(dir, &c, &io));
    TU_CHECK_RC(model_open(&m, dir, NULL));
    o = small_opts(DEV_CUDA);
    CU_ASSERT_EQUAL(engine_new(&e, m, &o), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(e);
    printf("\n  refused: %s\n", mo_last_error());
    model_destroy(&m);
    tu_rmtree(dir);
}

static CU_TestInfo g_tests[] = {
    {"qwen3_f32", test_qwen3_f32},
    {"qwen3_graphs", test_qwen3_graphs},
    {"mixtral_window", test_mixtral_window},
    {"separate_prefill", test_separate_prefill},
    {"qwen3_bf16", test_qwen3_bf16},
    {"adapter_swap", test_adapter_swap},
    {"refusals", test_refusals},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!gpu_suite_backend("gpu_engine", &rc))
        return rc;
    backend_cpu_set_threads(0);
    return tu_main("gpu_engine", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_engine"); }
#endif
