/* gpu_model_train: the CUDA training step (actor/model_cuda.h: model_cuda_forward_train and
 * model_cuda_backward) against the CPU model_forward(for_backward = 1) and model_backward on
 * tiny random Qwen3-MoE models (3 layers, the middle one a dense MLP; f32 and bf16 weights)
 * and a tiny Mixtral (sliding window 4), with random norm weights and a random "all-linear"
 * LoRA adapter (non-zero B): packed batches of uneven sequences (one of length 1, a target
 * -1 inside), logits in several chunks, random dlogp and dentropy. The LoRA gradients are
 * compared by normalised error max|gpu - cpu| / max|cpu| over all of them and for each
 * group (attention, expert and dense-MLP modules, A and B apart): 1e-5 with f32 weights;
 * with bf16 3e-2 over all and 5e-2 per group (logp and entropy 1e-2); a tensor whose CPU
 * gradient is zero (an expert no token chose) must be zero on the GPU too. The
 * bf16 model replays the CPU's routing on both sides (a bf16 rounding may flip a choice);
 * the f32 one routes by itself and must route as the CPU does; another case replays the
 * base model's routing. Also: the forward's logp and entropy equal model_cuda_logprobs's
 * bits and the CPU's within the tolerance; backward adds into pre-filled gradients; a
 * second step gives the same bits with no new device allocation; a scoring call between
 * forward_train and backward changes nothing; and the refusals (backward without a
 * forward, after an adapter sync or change, without dlogp, without a gradient buffer; a
 * forward without an adapter or with a balance loss).
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

/* f32 weights: f32 products (no TF32), other summation orders. */
#define TOL_F32 1e-5
/* bf16 weights: the device rounds the activations (and output gradients) of bf16 products
 * to bf16, each a relative error up to 2^-9. TOL_BF16 bounds logp and entropy (as in
 * gpu_model.c); the backward compounds the roundings over twice as many products: the same
 * roundings applied on the host to these models give the gradients a normalised error
 * between 5e-3 and 1.7e-2 depending on the seed, so they get 3e-2 over all of them and 5e-2
 * within a group (whose largest gradient may be several times smaller than the largest of
 * all). A wrong index or scale gives ~1 either way. */
#define TOL_BF16 1e-2
#define TOL_BF16_GRAD 3e-2
#define TOL_BF16_GROUP 5e-2
/* Init std of the matrices: f32 as in gpu_model.c; bf16 smaller (0.1, against 0.15 there),
 * which keeps the compounded roundings smaller. */
#define INIT_STD_F32 0.25f
#define INIT_STD_BF16 0.1f

/* fx_open_model with logits in chunks of 5 rows, aux_coef and the adapter's gradients
 * as asked. */
static void fx_open_arch(fx_t *f, model_arch_t arch, dtype_t dt, uint64_t seed, float aux_coef,
                         int no_grads) {
    fx_opts_t o = {INIT_STD_F32, INIT_STD_BF16, 5, aux_coef, no_grads};
    fx_open_model(f, arch, dt, seed, &o);
}

/* Random upstream gradients in [-1, 1), a few exact zeros. */
static void make_dout(float *dlogp, float *dent, int T, uint64_t seed) {
    rng_fill_uniform(dlogp, (size_t)T, seed, 1, -1.0f, 1.0f);
    rng_fill_uniform(dent, (size_t)T, seed, 2, -1.0f, 1.0f);
    dlogp[0] = 0.0f;
    dent[T - 1] = 0.0f;
}

/* The CPU step: the adapter's gradients (zeroed first) into g (n_params). */
static void cpu_step(fx_t *f, const model_batch_t *v, const float *dlogp, const float *dent,
                     float *logp, float *ent, float *g) {
    lora_adapter_zero_grads(f->ad);
    tu_poison(logp, (size_t)v->T);
    tu_poison(ent, (size_t)v->T);
    int rc = model_forward(f->m, v, logp, ent, 1);
    if (rc == 0)
        rc = model_backward(f->m, dlogp, dent);
    if (rc < 0)
        tu_report("cpu step: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    memcpy(g, f->ad->grads, sizeof(float) * f->ad->n_params);
}

/* The GPU step: the same into g. */
static void gpu_step(fx_t *f, model_cuda_t *mc, const model_batch_t *v, const float *dlogp,
                     const float *dent, float *logp, float *ent, float *g) {
    lora_adapter_zero_grads(f->ad);
    tu_poison(logp, (size_t)v->T);
    tu_poison(ent, (size_t)v->T);
    TU_CHECK_RC(model_cuda_forward_train(mc, v, logp, ent));
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    memcpy(g, f->ad->grads, sizeof(float) * f->ad->n_params);
}

/* The six groups: kind (attention, expert, dense) x (A, B). */
static int group_of(const lora_adapter_t *ad, int tensor) {
    const lora_entry_t *e = &ad->entries[tensor / 2];
    int k = e->kind == LORA_KIND_ATTENTION ? 0 : e->kind == LORA_KIND_EXPERT ? 1 : 2;
    return 2 * k + tensor % 2;
}

static const char *const g_group_name[6] = {"attention A", "attention B", "experts A",
                                            "experts B",   "dense A",     "dense B"};

/* GPU gradients g against the CPU's ref: normalised error over all of them within tol, and
 * per group within tol_group; every group the adapter has with a non-zero gradient; tensors
 * zero on the CPU zero on the GPU. */
static void compare_grads(const lora_adapter_t *ad, const float *g, const float *ref, double tol,
                          double tol_group, const char *what) {
    double maxd[6] = {0}, maxr[6] = {0};
    int present[6] = {0};
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        int k = group_of(ad, i);
        present[k] = 1;
        double tr = 0.0;
        for (size_t j = 0; j < t->numel; j++) {
            size_t at = t->offset + j;
            CU_ASSERT(isfinite(g[at]));
            maxd[k] = fmax(maxd[k], fabs((double)g[at] - ref[at]));
            maxr[k] = fmax(maxr[k], fabs((double)ref[at]));
            tr = fmax(tr, fabs((double)ref[at]));
        }
        if (tr == 0.0)
            for (size_t j = 0; j < t->numel; j++)
                if (g[t->offset + j] != 0.0f) {
                    tu_report("%s: %s is zero on the CPU, not on the GPU", what, t->name);
                    CU_FAIL("gradient zero on the CPU only");
                    break;
                }
    }
    double alld = 0.0, allr = 0.0;
    for (int k = 0; k < 6; k++) {
        if (!present[k])
            continue;
        double err = maxd[k] / fmax(maxr[k], 1e-12);
        printf("  %-28s %-12s grad err %.2e (max |grad| %.2e)\n", what, g_group_name[k], err,
               maxr[k]);
        CU_ASSERT(maxr[k] > 0.0);
        TU_ASSERT_CLOSE(err, tol_group, g_group_name[k]);
        alld = fmax(alld, maxd[k]);
        allr = fmax(allr, maxr[k]);
    }
    double err = alld / fmax(allr, 1e-12);
    printf("  %-28s %-12s grad err %.2e\n", what, "all", err);
    TU_ASSERT_CLOSE(err, tol, "all gradients");
}

/* One architecture and dtype: the forward and the gradients against the CPU, the
 * accumulate contract, determinism, no new allocations, and a scoring call in between. */
static void check_train(model_arch_t arch, dtype_t dt, double tol, double tol_group,
                        uint64_t seed) {
    fx_t f;
    fx_open_arch(&f, arch, dt, seed, 0.0f, 0);
    model_t *m = f.m;
    size_t n = f.ad->n_params;
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, m));
    static const int lens[5] = {7, 1, 12, 4, 9};
    batch_t b;
    make_batch(&b, m, lens, 5, seed + 30, 0.8f);
    model_batch_t v = view(&b);
    size_t nr = (size_t)b.T * m->n_moe * m->K;
    uint16_t *rc_cpu = malloc(nr * 2), *rc_gpu = malloc(nr * 2);
    float *ref = malloc(n * sizeof(float)), *g1 = malloc(n * sizeof(float));
    float *g2 = malloc(n * sizeof(float)), *g0 = malloc(n * sizeof(float));
    CU_ASSERT_FATAL(rc_cpu && rc_gpu && ref && g1 && g2 && g0);
    float dlogp[MAXT], dent[MAXT], lc[MAXT], ec[MAXT], lg[MAXT], eg[MAXT], ls[MAXT], es[MAXT];
    make_dout(dlogp, dent, b.T, seed + 40);

    /* The CPU's own routing; bf16 replays it on both sides. */
    v.routing = rc_cpu;
    TU_CHECK_RC(model_forward(m, &v, lc, ec, 0));
    v.routing = NULL;
    if (dt != DT_F32)
        v.replay = rc_cpu;
    cpu_step(&f, &v, dlogp, dent, lc, ec, ref);
    memset(rc_gpu, 0xff, nr * 2);
    v.routing = rc_gpu;
    gpu_step(&f, mc, &v, dlogp, dent, lg, eg, g1);
    v.routing = NULL;
    CU_ASSERT_EQUAL(memcmp(rc_gpu, rc_cpu, nr * 2), 0);
    double el = tu_rel_err_ff(lg, lc, (size_t)b.T, 1e-6);
    double ee = tu_rel_err_ff(eg, ec, (size_t)b.T, 1e-6);
    printf("  %s %s T=%d: logp err %.2e, entropy err %.2e\n",
           arch == ARCH_QWEN3_MOE ? "qwen3_moe" : "mixtral", dt == DT_F32 ? "f32" : "bf16", b.T, el,
           ee);
    double tol_fwd = dt == DT_F32 ? TOL_F32 : TOL_BF16;
    CU_ASSERT(el <= tol_fwd);
    CU_ASSERT(ee <= tol_fwd);
    for (int t = 0; t < b.T; t++)
        if (b.tgt[t] < 0)
            CU_ASSERT_EQUAL(lg[t], 0.0f);
    compare_grads(f.ad, g1, ref, tol, tol_group, dt == DT_F32 ? "f32" : "bf16");

    /* The training forward scores as model_cuda_logprobs does, bit for bit. */
    tu_poison(ls, (size_t)b.T);
    tu_poison(es, (size_t)b.T);
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, ls, es, 1));
    CU_ASSERT_EQUAL(memcmp(ls, lg, sizeof(float) * (size_t)b.T), 0);
    CU_ASSERT_EQUAL(memcmp(es, eg, sizeof(float) * (size_t)b.T), 0);

    /* A second step: the same bits, no new device allocation. */
    cuda_pool_stats_t ps0, ps1;
    backend_cuda_pool_stats(&ps0);
    gpu_step(&f, mc, &v, dlogp, dent, lg, eg, g2);
    backend_cuda_pool_stats(&ps1);
    CU_ASSERT_EQUAL(ps1.device_allocs, ps0.device_allocs);
    CU_ASSERT_EQUAL(memcmp(g1, g2, sizeof(float) * n), 0);

    /* The backward adds into pre-filled gradients (the step is still pending). */
    rng_fill_uniform(g0, n, seed, 50, -1.0f, 1.0f);
    memcpy(f.ad->grads, g0, sizeof(float) * n);
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    size_t off = 0;
    for (size_t i = 0; i < n; i++)
        off += f.ad->grads[i] != g0[i] + g1[i];
    CU_ASSERT_EQUAL(off, 0);

    /* A scoring call on a larger batch between forward_train and backward changes nothing. */
    static const int lens2[3] = {20, 1, 30};
    batch_t b2;
    make_batch(&b2, m, lens2, 3, seed + 31, 1.0f);
    model_batch_t v2 = view(&b2);
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    TU_CHECK_RC(model_cuda_logprobs(mc, &v2, ls, es, 0));
    lora_adapter_zero_grads(f.ad);
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    CU_ASSERT_EQUAL(memcmp(f.ad->grads, g1, sizeof(float) * n), 0);

    /* Without dentropy: the CPU's gradients of logp alone. */
    cpu_step(&f, &v, dlogp, NULL, lc, ec, ref);
    gpu_step(&f, mc, &v, dlogp, NULL, lg, eg, g2);
    compare_grads(f.ad, g2, ref, tol, tol_group, "no dentropy");

    free(rc_cpu);
    free(rc_gpu);
    free(ref);
    free(g0);
    free(g1);
    free(g2);
    model_cuda_free(&mc);
    fx_close(&f);
}

static void test_f32(void) {
    check_train(ARCH_QWEN3_MOE, DT_F32, TOL_F32, TOL_F32, 7);
}

static void test_bf16(void) {
    check_train(ARCH_QWEN3_MOE, DT_BF16, TOL_BF16_GRAD, TOL_BF16_GROUP, 8);
}

static void test_mixtral(void) {
    check_train(ARCH_MIXTRAL, DT_F32, TOL_F32, TOL_F32, 15);
}

/* Routing replay: the base model's routing (which the adapted model would not choose)
 * replayed in the training step on both sides. */
static void test_replay(void) {
    fx_t f;
    fx_open_arch(&f, ARCH_QWEN3_MOE, DT_F32, 13, 0.0f, 0);
    model_t *m = f.m;
    size_t n = f.ad->n_params;
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, m));
    static const int lens[4] = {9, 1, 14, 6};
    batch_t b;
    make_batch(&b, m, lens, 4, 61, 0.9f);
    model_batch_t v = view(&b);
    size_t nr = (size_t)b.T * m->n_moe * m->K;
    uint16_t *base = malloc(nr * 2), *ad_route = malloc(nr * 2), *out = malloc(nr * 2);
    float *ref = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float));
    float *gn = malloc(n * sizeof(float));
    CU_ASSERT_FATAL(base && ad_route && out && ref && g && gn);
    float dlogp[MAXT], dent[MAXT], lc[MAXT], ec[MAXT], lg[MAXT], eg[MAXT];
    make_dout(dlogp, dent, b.T, 62);
    TU_CHECK_RC(model_set_adapter(m, NULL));
    v.routing = base;
    TU_CHECK_RC(model_forward(m, &v, lc, ec, 0));
    TU_CHECK_RC(model_set_adapter(m, f.ad));
    v.routing = ad_route;
    TU_CHECK_RC(model_forward(m, &v, lc, ec, 0));
    size_t differ = 0;
    for (size_t i = 0; i < nr; i++)
        differ += base[i] != ad_route[i];
    CU_ASSERT(differ > 0);
    /* The natural step, for the comparison below. */
    v.routing = NULL;
    gpu_step(&f, mc, &v, dlogp, dent, lg, eg, gn);
    /* Replayed. */
    v.replay = base;
    cpu_step(&f, &v, dlogp, dent, lc, ec, ref);
    memset(out, 0xff, nr * 2);
    v.routing = out;
    gpu_step(&f, mc, &v, dlogp, dent, lg, eg, g);
    CU_ASSERT_EQUAL(memcmp(out, base, nr * 2), 0);
    double el = tu_rel_err_ff(lg, lc, (size_t)b.T, 1e-6);
    printf("  replay: logp err %.2e\n", el);
    CU_ASSERT(el <= TOL_F32);
    compare_grads(f.ad, g, ref, TOL_F32, TOL_F32, "replay");
    /* The replay changes the gradients. */
    CU_ASSERT(tu_rel_err_ff(gn, g, n, 1e-6) > 10.0 * TOL_F32);
    free(base);
    free(ad_route);
    free(out);
    free(ref);
    free(g);
    free(gn);
    model_cuda_free(&mc);
    fx_close(&f);
}

/* What is refused, and that a refusal leaves the next good step working. */
static void test_state(void) {
    fx_t f;
    fx_open_arch(&f, ARCH_QWEN3_MOE, DT_F32, 9, 0.0f, 0);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    static const int lens[2] = {5, 6};
    batch_t b;
    make_batch(&b, f.m, lens, 2, 71, 1.0f);
    model_batch_t v = view(&b);
    float dlogp[MAXT], dent[MAXT], lg[MAXT], eg[MAXT];
    make_dout(dlogp, dent, b.T, 72);
    /* No forward_train yet (a scoring call is not one). */
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    TU_CHECK_RC(model_cuda_logprobs(mc, &v, lg, eg, 1));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    CU_ASSERT_EQUAL(model_cuda_backward(NULL, dlogp, dent), MO_EINVAL);
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, NULL, dent), MO_EINVAL);
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    /* A sync of the parameters ends the step. */
    TU_CHECK_RC(model_cuda_sync_adapter(mc));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    /* A refused batch ends it too. */
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    b.tok[3] = f.m->V;
    CU_ASSERT_EQUAL(model_cuda_forward_train(mc, &v, lg, eg), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "token 3"));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    b.tok[3] = 1;
    /* Another adapter bound (here none): forward and backward refuse. */
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    CU_ASSERT_EQUAL(model_cuda_forward_train(mc, &v, lg, eg), MO_ESTATE);
    TU_CHECK_RC(model_set_adapter(f.m, f.ad));
    /* An empty batch is a step with nothing to add. */
    model_batch_t empty = {0, 0, NULL, NULL, b.cu, NULL, 1.0f, NULL, NULL};
    TU_CHECK_RC(model_cuda_forward_train(mc, &empty, lg, eg));
    lora_adapter_zero_grads(f.ad);
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    for (size_t i = 0; i < f.ad->n_params; i++)
        CU_ASSERT_EQUAL(f.ad->grads[i], 0.0f);
    /* The next good step works. */
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    model_cuda_free(&mc);

    /* An upload without an adapter has nothing to train. */
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    CU_ASSERT_EQUAL(model_cuda_forward_train(mc, &v, lg, eg), MO_EINVAL);
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_ESTATE);
    model_cuda_free(&mc);
    fx_close(&f);

    /* An adapter without a gradient buffer. */
    fx_open_arch(&f, ARCH_QWEN3_MOE, DT_F32, 10, 0.0f, 1);
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    TU_CHECK_RC(model_cuda_forward_train(mc, &v, lg, eg));
    CU_ASSERT_EQUAL(model_cuda_backward(mc, dlogp, dent), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "gradient buffer"));
    model_cuda_free(&mc);
    fx_close(&f);

    /* A balance loss. */
    fx_open_arch(&f, ARCH_QWEN3_MOE, DT_F32, 11, 0.02f, 0);
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    CU_ASSERT_EQUAL(model_cuda_forward_train(mc, &v, lg, eg), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "balance loss"));
    model_cuda_free(&mc);
    fx_close(&f);
}

static CU_TestInfo g_tests[] = {
    {"f32", test_f32},       {"bf16", test_bf16},   {"mixtral", test_mixtral},
    {"replay", test_replay}, {"state", test_state}, CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!gpu_suite_backend("gpu_model_train", &rc))
        return rc;
    backend_cpu_set_threads(0);
    return tu_main("gpu_model_train", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_model_train"); }
#endif
