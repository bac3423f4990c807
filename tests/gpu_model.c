/* gpu_model: the CUDA scoring forward (actor/model_cuda.h) against the CPU model_forward on
 * tiny random Qwen3-MoE models (3 layers, the middle one a dense MLP) and tiny Mixtral models
 * (sliding window 4), with random norm weights and a random LoRA adapter on every linear
 * projection (attention, experts, dense MLP; non-zero B): packed batches of several uneven
 * sequences (one of length 1, targets -1 inside), logits in several chunks, with and without
 * the adapter, f32 and bf16 weights. logp and entropy are compared by normalised error
 * max|gpu - cpu| / max|cpu|; outputs are poisoned (NaN) before each run. Also: the routing
 * output equals the CPU's (f32), routing replay matches the CPU's replay, repeated calls are
 * deterministic and make no new device allocations, new adapter parameters reach the device
 * with model_cuda_sync_adapter, bad batches and replays are refused on the host, and
 * unsupported features are refused at upload with their name.
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "actor/model_cuda.h"
#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/rng.h"
#include "core/status.h"
#include "tests/model_gpu_fixture.h"
#include "tests/testutil.h"

/* f32 weights: f32 products (no TF32) and f32 attention in another summation order. */
#define TOL_F32 1e-5
/* bf16 weights: the device rounds the activations of bf16 products to bf16. */
#define TOL_BF16 1e-2
/* Init std of the matrices: large enough that logprobs and entropies spread over several
 * nats; with bf16 weights smaller, so that the bf16 roundings stay well inside TOL_BF16 (on
 * the CPU the bf16 model differs from its f32 twin by ~3e-3 at this std). */
#define INIT_STD_F32 0.25f
#define INIT_STD_BF16 0.15f

/* fx_open_model with logits in chunks of 5 rows and a bound adapter with gradients. */
static void fx_open_arch(fx_t *f, model_arch_t arch, dtype_t dt, uint64_t seed) {
    fx_opts_t o = {INIT_STD_F32, INIT_STD_BF16, 5, 0.0f, 0};
    fx_open_model(f, arch, dt, seed, &o);
}

static void fx_open(fx_t *f, dtype_t dt, uint64_t seed) {
    fx_open_arch(f, ARCH_QWEN3_MOE, dt, seed);
}

static void cpu_forward(model_t *m, batch_t *b, float *logp, float *ent) {
    model_batch_t v = view(b);
    tu_poison(logp, (size_t)b->T);
    tu_poison(ent, (size_t)b->T);
    int rc = model_forward(m, &v, logp, ent, 0);
    if (rc < 0)
        tu_report("cpu forward: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

static void gpu_forward(model_cuda_t *mc, batch_t *b, float *logp, float *ent, int ad) {
    model_batch_t v = view(b);
    tu_poison(logp, (size_t)b->T);
    tu_poison(ent, (size_t)b->T);
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, logp, ent, ad));
}

static double spread(const float *x, int n) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        lo = fmin(lo, x[i]);
        hi = fmax(hi, x[i]);
    }
    return hi - lo;
}

/* GPU against CPU on one batch, with (ad = 1) or without the adapter. Returns the CPU's
 * logp into ref when not NULL. */
static void compare(fx_t *f, model_cuda_t *mc, batch_t *b, int ad, double tol, const char *what,
                    float *ref) {
    float lc[MAXT], ec[MAXT], lg[MAXT], eg[MAXT];
    TU_CHECK_RC(model_set_adapter(f->m, ad ? f->ad : NULL));
    cpu_forward(f->m, b, lc, ec);
    TU_CHECK_RC(model_set_adapter(f->m, f->ad));
    gpu_forward(mc, b, lg, eg, ad);
    double el = tu_rel_err_ff(lg, lc, (size_t)b->T, 1e-6);
    double ee = tu_rel_err_ff(eg, ec, (size_t)b->T, 1e-6);
    printf("  %-24s T=%2d B=%d: logp err %.2e, entropy err %.2e (spreads %.2f, %.2f)\n", what, b->T,
           b->B, el, ee, spread(lc, b->T), spread(ec, b->T));
    CU_ASSERT(el <= tol);
    CU_ASSERT(ee <= tol);
    for (int t = 0; t < b->T; t++) {
        CU_ASSERT(isfinite(lg[t]) && isfinite(eg[t]));
        if (b->tgt[t] < 0)
            CU_ASSERT_EQUAL(lg[t], 0.0f);
    }
    if (ref)
        memcpy(ref, lc, sizeof(float) * (size_t)b->T);
}

static void check_model(model_arch_t arch, dtype_t dt, double tol) {
    fx_t f;
    fx_open_arch(&f, arch, dt, dt == DT_F32 ? 7 : 8);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    CU_ASSERT_EQUAL(model_cuda_has_adapter(mc), 1);
    static const int lens1[5] = {7, 1, 12, 4, 9};
    static const int lens2[3] = {20, 1, 30};
    static const int lens3[1] = {1};
    batch_t b1, b2, b3;
    make_batch(&b1, f.m, lens1, 5, 31, 0.8f);
    make_batch(&b2, f.m, lens2, 3, 32, 1.0f);
    make_batch(&b3, f.m, lens3, 1, 33, 1.3f);
    float with[MAXT], without[MAXT];
    compare(&f, mc, &b1, 1, tol, "adapter", with);
    compare(&f, mc, &b1, 0, tol, "no adapter", without);
    /* The adapter moves the logprobs far more than the tolerance: the comparisons above
     * see it. */
    double moved = tu_rel_err_ff(with, without, (size_t)b1.T, 1e-6);
    printf("  adapter effect on logp: %.2e\n", moved);
    CU_ASSERT(moved > 10.0 * tol);
    compare(&f, mc, &b2, 1, tol, "adapter, larger batch", NULL);
    compare(&f, mc, &b3, 1, tol, "adapter, one token", NULL);
    compare(&f, mc, &b3, 0, tol, "no adapter, one token", NULL);
    /* Back to the first batch: the scratch is reused (no new device allocation) and the
     * result is the same bits as a second run gives. */
    float l1[MAXT], e1[MAXT], l2[MAXT], e2[MAXT];
    gpu_forward(mc, &b1, l1, e1, 1);
    cuda_pool_stats_t ps0, ps1;
    backend_cuda_pool_stats(&ps0);
    gpu_forward(mc, &b1, l2, e2, 1);
    backend_cuda_pool_stats(&ps1);
    CU_ASSERT_EQUAL(ps1.device_allocs, ps0.device_allocs);
    CU_ASSERT_EQUAL(memcmp(l1, l2, sizeof(float) * (size_t)b1.T), 0);
    CU_ASSERT_EQUAL(memcmp(e1, e2, sizeof(float) * (size_t)b1.T), 0);
    /* logp only (entropy NULL) gives the same logp. */
    model_batch_t v = view(&b1);
    tu_poison(l2, (size_t)b1.T);
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, l2, NULL, 1));
    CU_ASSERT_EQUAL(memcmp(l1, l2, sizeof(float) * (size_t)b1.T), 0);
    /* New adapter parameters (an optimizer step): the upload keeps the old ones until
     * model_cuda_sync_adapter, then matches the CPU with the new ones. */
    tu_randomise_adapter(f.ad, 77);
    gpu_forward(mc, &b1, l2, e2, 1);
    CU_ASSERT_EQUAL(memcmp(l1, l2, sizeof(float) * (size_t)b1.T), 0);
    TU_CHECK_RC(model_cuda_sync_adapter(mc));
    compare(&f, mc, &b1, 1, tol, "adapter after sync", NULL);
    gpu_forward(mc, &b1, l2, e2, 1);
    CU_ASSERT(tu_rel_err_ff(l2, l1, (size_t)b1.T, 1e-6) > 10.0 * tol);
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    CU_ASSERT_EQUAL(model_cuda_sync_adapter(mc), MO_ESTATE);
    TU_CHECK_RC(model_set_adapter(f.m, f.ad));
    model_cuda_free(&mc);
    CU_ASSERT_PTR_NULL(mc);
    model_cuda_free(&mc);
    fx_close(&f);
}

static void test_f32(void) {
    check_model(ARCH_QWEN3_MOE, DT_F32, TOL_F32);
}

static void test_bf16(void) {
    check_model(ARCH_QWEN3_MOE, DT_BF16, TOL_BF16);
}

/* Mixtral with a sliding window of 4 (shorter than most sequences of the batches: the
 * window changes the CPU's result, checked first). */
static void test_mixtral_window(void) {
    fx_t f;
    fx_open_arch(&f, ARCH_MIXTRAL, DT_F32, 15);
    static const int lens[3] = {12, 1, 9};
    batch_t b;
    make_batch(&b, f.m, lens, 3, 71, 1.0f);
    float lw[MAXT], ew[MAXT], lf[MAXT], ef[MAXT];
    cpu_forward(f.m, &b, lw, ew);
    for (int l = 0; l < f.m->L; l++)
        f.m->layers[l].window = 0;
    cpu_forward(f.m, &b, lf, ef);
    for (int l = 0; l < f.m->L; l++)
        f.m->layers[l].window = 4;
    CU_ASSERT(tu_rel_err_ff(lf, lw, (size_t)b.T, 1e-6) > 10.0 * TOL_F32);
    fx_close(&f);
    check_model(ARCH_MIXTRAL, DT_F32, TOL_F32);
    check_model(ARCH_MIXTRAL, DT_BF16, TOL_BF16);
}

/* An upload of the base model (no adapter bound) scores it; asking for the adapter is
 * refused. */
static void test_base_upload(void) {
    fx_t f;
    fx_open(&f, DT_F32, 9);
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    CU_ASSERT_EQUAL(model_cuda_has_adapter(mc), 0);
    static const int lens[3] = {5, 1, 8};
    batch_t b;
    make_batch(&b, f.m, lens, 3, 41, 1.0f);
    float lc[MAXT], ec[MAXT], lg[MAXT], eg[MAXT];
    cpu_forward(f.m, &b, lc, ec);
    gpu_forward(mc, &b, lg, eg, 0);
    CU_ASSERT(tu_rel_err_ff(lg, lc, (size_t)b.T, 1e-6) <= TOL_F32);
    CU_ASSERT(tu_rel_err_ff(eg, ec, (size_t)b.T, 1e-6) <= TOL_F32);
    model_batch_t v = view(&b);
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "no adapter"));
    CU_ASSERT_EQUAL(model_cuda_sync_adapter(mc), MO_EINVAL);
    model_cuda_free(&mc);
    fx_close(&f);
}

/* Bad batches are refused on the host with the position named; the next good call works
 * (no error is left pending). */
static void test_bad_batch(void) {
    fx_t f;
    fx_open(&f, DT_F32, 10);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    static const int lens[2] = {5, 6};
    batch_t b;
    make_batch(&b, f.m, lens, 2, 51, 1.0f);
    float lg[MAXT], eg[MAXT];
    model_batch_t v = view(&b);
    b.tok[4] = f.m->V;
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "token 4"));
    b.tok[4] = 3;
    b.tgt[6] = -2;
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "target 6"));
    b.tgt[6] = 1;
    b.cu[1] = 7;
    b.cu[2] = 6;
    v.cu_seqlens = b.cu;
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EINVAL);
    b.cu[1] = 5;
    b.cu[2] = 11;
    v.temperature = 0.0f;
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EINVAL);
    v.temperature = 1.0f;
    /* Replayed experts: (T, M, K) with M = 2 MoE layers, K = 2. */
    uint16_t replay[MAXT * 2 * 2];
    int M = f.m->n_moe, K = f.m->K;
    CU_ASSERT_EQUAL_FATAL(M * K, 4);
    for (int i = 0; i < b.T * M; i++) {
        replay[i * K] = (uint16_t)(i % f.m->E);
        replay[i * K + 1] = (uint16_t)((i + 3) % f.m->E);
    }
    v.replay = replay;
    replay[(5 * M + 1) * K + 1] = (uint16_t)f.m->E;
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EMALFORMED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "token 5 slot 1"));
    replay[(5 * M + 1) * K + 1] = replay[(5 * M + 1) * K];
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &v, lg, eg, 1), MO_EMALFORMED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "twice"));
    v.replay = NULL;
    model_batch_t empty = {0, 0, NULL, NULL, b.cu, NULL, 1.0f, NULL, NULL};
    CU_ASSERT_EQUAL(model_cuda_logprobs(mc, &empty, lg, eg, 1), 0);
    compare(&f, mc, &b, 1, TOL_F32, "after refusals", NULL);
    model_cuda_free(&mc);
    fx_close(&f);
}

/* Routing output against the CPU's (equal with f32 weights), and routing replay: the
 * adapter's routing replayed on the base model (a routing the base model would not choose)
 * on both sides. */
static void check_routing(dtype_t dt, double tol) {
    fx_t f;
    fx_open(&f, dt, dt == DT_F32 ? 13 : 14);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    static const int lens[4] = {9, 1, 14, 6};
    batch_t b;
    make_batch(&b, f.m, lens, 4, 61, 0.9f);
    size_t nr = (size_t)b.T * f.m->n_moe * f.m->K;
    uint16_t *rc_ad = malloc(nr * 2), *rg = malloc(nr * 2), *rc_base = malloc(nr * 2);
    float lc[MAXT], ec[MAXT], lg[MAXT], eg[MAXT];
    model_batch_t v = view(&b);
    /* Natural routing with the adapter. */
    v.routing = rc_ad;
    TU_CHECK_RC(model_forward(f.m, &v, lc, ec, 0));
    memset(rg, 0xff, nr * 2);
    v.routing = rg;
    gpu_forward(mc, &b, lg, eg, 1); /* poisons; then the call with routing: */
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, lg, eg, 1));
    size_t differ = 0;
    for (size_t i = 0; i < nr; i++)
        differ += rg[i] != rc_ad[i];
    printf("  routing slots differing from the CPU's: %zu of %zu\n", differ, nr);
    if (dt == DT_F32)
        CU_ASSERT_EQUAL(differ, 0);
    for (size_t i = 0; i < nr; i++)
        CU_ASSERT(rg[i] < f.m->E);
    /* The base model routes otherwise. */
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    v.routing = rc_base;
    TU_CHECK_RC(model_forward(f.m, &v, lc, ec, 0));
    differ = 0;
    for (size_t i = 0; i < nr; i++)
        differ += rc_base[i] != rc_ad[i];
    CU_ASSERT(differ > 0);
    /* Replay the adapter's routing on the base model. */
    v.routing = NULL;
    v.replay = rc_ad;
    tu_poison(lc, (size_t)b.T);
    tu_poison(ec, (size_t)b.T);
    TU_CHECK_RC(model_forward(f.m, &v, lc, ec, 0));
    v.routing = rg;
    memset(rg, 0xff, nr * 2);
    tu_poison(lg, (size_t)b.T);
    tu_poison(eg, (size_t)b.T);
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, lg, eg, 0));
    CU_ASSERT_EQUAL(memcmp(rg, rc_ad, nr * 2), 0);
    double el = tu_rel_err_ff(lg, lc, (size_t)b.T, 1e-6);
    double ee = tu_rel_err_ff(eg, ec, (size_t)b.T, 1e-6);
    printf("  %-24s T=%2d B=%d: logp err %.2e, entropy err %.2e\n", "replay, no adapter", b.T, b.B,
           el, ee);
    CU_ASSERT(el <= tol);
    CU_ASSERT(ee <= tol);
    /* Replay changes the result: natural routing of the base model differs. */
    float ln[MAXT], en[MAXT];
    gpu_forward(mc, &b, ln, en, 0);
    CU_ASSERT(tu_rel_err_ff(ln, lg, (size_t)b.T, 1e-6) > 10.0 * tol);
    TU_CHECK_RC(model_set_adapter(f.m, f.ad));
    free(rc_ad);
    free(rg);
    free(rc_base);
    model_cuda_free(&mc);
    fx_close(&f);
}

static void test_routing_f32(void) {
    check_routing(DT_F32, TOL_F32);
}

static void test_routing_bf16(void) {
    check_routing(DT_BF16, TOL_BF16);
}

/* An upload that must fail with MO_ECONFIG and a message naming the feature. */
static void expect_refused(const model_t *m, const char *word) {
    model_cuda_t *mc = (model_cuda_t *)&mc; /* must be set to NULL */
    int rc = model_cuda_upload(&mc, m);
    CU_ASSERT_EQUAL(rc, MO_ECONFIG);
    CU_ASSERT_PTR_NULL(mc);
    const char *msg = mo_last_error();
    if (!strstr(msg, word))
        tu_report("refusal message '%s' does not name '%s'", msg, word);
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, word));
    model_cuda_free(&mc);
}

/* A tiny model of another architecture, without adapter. */
static model_t *open_arch(char *dir, size_t cap, model_arch_t arch, dtype_t dt) {
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, cap), 0);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, arch, INIT_SIZE_TINY, dt), 0);
    CU_ASSERT_EQUAL_FATAL(model_config_validate(&c, "gpu_model"), 0);
    init_model_opts_t io = {3, 0.0f};
    model_t *m = NULL;
    int rc = init_model_write(dir, &c, &io);
    if (rc == 0)
        rc = model_open(&m, dir, NULL);
    if (rc < 0)
        tu_report("open: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return m;
}

static void test_refusals(void) {
    char dir[512];
    model_t *m = open_arch(dir, sizeof dir, ARCH_QWEN3_MOE, DT_F16);
    expect_refused(m, "only f32 and bf16");
    model_destroy(&m);
    tu_rmtree(dir);
    m = open_arch(dir, sizeof dir, ARCH_DEEPSEEK_V3, DT_F32);
    expect_refused(m, "latent attention");
    model_destroy(&m);
    tu_rmtree(dir);

    /* Features edited into a loaded Qwen3 model one at a time, each restored after. */
    fx_t f;
    fx_open(&f, DT_F32, 12);
    model_layer_t *ly = &f.m->layers[2];
    router_cfg_t keep = ly->moe_cfg.router;
    ly->moe_cfg.router.kind = ROUTER_SIGMOID_GROUPED;
    expect_refused(f.m, "sigmoid");
    ly->moe_cfg.router.kind = ROUTER_SOFTMAX_GROUPED;
    ly->moe_cfg.router.n_group = 2;
    expect_refused(f.m, "group-limited");
    ly->moe_cfg.router = keep;
    ly->moe_cfg.n_shared = 1;
    expect_refused(f.m, "shared experts");
    ly->moe_cfg.n_shared = 0;
    wview_t wk = ly->wq;
    ly->wq.dtype = DT_F8E4M3;
    expect_refused(f.m, "only f32 and bf16");
    ly->wq = wk;
    wk = f.m->layers[0].moe_w.gate[3];
    ((wview_t *)f.m->layers[0].moe_w.gate)[3].data = NULL; /* as a dropped expert */
    expect_refused(f.m, "expert parallelism");
    ((wview_t *)f.m->layers[0].moe_w.gate)[3] = wk;
    /* Everything restored: the upload works. */
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    model_cuda_free(&mc);
    fx_close(&f);
}

static CU_TestInfo g_tests[] = {
    {"f32", test_f32},
    {"bf16", test_bf16},
    {"mixtral_window", test_mixtral_window},
    {"base_upload", test_base_upload},
    {"routing_f32", test_routing_f32},
    {"routing_bf16", test_routing_bf16},
    {"bad_batch", test_bad_batch},
    {"refusals", test_refusals},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!gpu_suite_backend("gpu_model", &rc))
        return rc;
    backend_cpu_set_threads(0);
    return tu_main("gpu_model", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_model"); }
#endif
