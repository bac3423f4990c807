/* gpu_testutil: what the GPU suites share: the tolerances of a device result against
 * the CPU's, device buffers through the CUDA backend (failing the test on an error),
 * host buffers, and the accumulate check. Include once per test program, after setting
 * g_gpu = backend_get(DEV_CUDA) before the first helper runs. */
#ifndef MOERL_TESTS_GPU_TESTUTIL_H
#define MOERL_TESTS_GPU_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/status.h"
#include "tests/testutil.h"

/* f32 ops with reductions (products with f32 weights, rmsnorm, softmax, attention,
 * logprob, grouped products): sums in a different order than the CPU's. */
#define TOL_F32 1e-5
/* Elementwise f32 ops and combines (swiglu, rope, adamw): a few ulp from expf/cosf/sinf
 * and fused multiply-adds. */
#define TOL_EW 1e-6
/* Products with bf16, f16 or fp8 weights against the CPU's f32 product: the activations
 * are rounded to bf16 (f16) for the product. */
#define TOL_LOWP 1e-2
/* The same products against the CPU run on activations rounded the same way (weights and
 * power-of-two block scales are exact in bf16): only the summation differs (tensor-core
 * f32 accumulation may round toward zero, a bias of up to ~1e-4 over thousands of
 * terms); a wrong index or scale gives ~1. */
#define TOL_LOWP_ROUNDED 5e-4
/* A backward run on prefilled gradients against prefill + increments. */
#define TOL_ACC 1e-6

static const backend_t *g_gpu; /* the CUDA backend */

/* ---- device buffers ---- */

static inline void *dnew(size_t nb) {
    void *p = NULL;
    CU_ASSERT_FATAL(g_gpu->alloc(g_gpu, &p, nb ? nb : 4) == 0);
    return p;
}

static inline void dset(void *d, const void *h, size_t nb) {
    if (nb)
        CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d, DEV_CUDA, h, DEV_CPU, nb) == 0);
}

static inline void *dput(const void *h, size_t nb) {
    void *d = dnew(nb);
    dset(d, h, nb);
    return d;
}

/* n floats of NaN on the device. */
static inline float *dpoison(size_t n) {
    float *h = malloc((n ? n : 1) * sizeof(float));
    tu_poison(h, n);
    float *d = dput(h, n * sizeof(float));
    free(h);
    return d;
}

static inline float *dzeros(size_t n) {
    float *d = dnew(n * sizeof(float));
    CU_ASSERT_FATAL(g_gpu->memset_zero(g_gpu, d, n * sizeof(float)) == 0);
    return d;
}

static inline int synced(void) {
    int rc = g_gpu->synchronize(g_gpu);
    if (rc != 0)
        tu_report("synchronize: %s", mo_last_error());
    return rc;
}

/* Waits for the kernels (failing the test on a recorded error), then copies. */
static inline void dget(void *h, const void *d, size_t nb) {
    CU_ASSERT_FATAL(synced() == 0);
    if (nb)
        CU_ASSERT_FATAL(g_gpu->copy(g_gpu, h, DEV_CPU, d, DEV_CUDA, nb) == 0);
}

static inline float *dget_f(const float *d, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof(float));
    dget(h, d, n * sizeof(float));
    return h;
}

static inline void dfree(void *d) {
    g_gpu->free(g_gpu, d);
}

/* ---- host buffers ---- */

static inline float *hrand(size_t n, uint64_t seed, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    tu_fill(x, n, seed, lo, hi);
    return x;
}

static inline float *hzeros(size_t n) {
    return calloc(n ? n : 1, sizeof(float));
}

static inline float *hcopy(const float *x, size_t n) {
    float *y = malloc((n ? n : 1) * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}

/* ---- checks ---- */

static inline double err(const float *gpu, const float *cpu, size_t n) {
    return tu_rel_err_ff(gpu, cpu, n, 1e-6);
}

/* got = pre + inc, up to f32 rounding (normalised by max |pre| + |inc|). */
static inline void check_acc(const char *what, const float *pre, const float *inc,
                             const float *got, size_t n) {
    double maxv = 1e-6, maxd = 0.0;
    for (size_t i = 0; i < n; i++) {
        double want = (double)pre[i] + (double)inc[i];
        double v = fabs((double)pre[i]) + fabs((double)inc[i]);
        maxv = v > maxv ? v : maxv;
        double d = fabs((double)got[i] - want);
        if (!(d <= maxd))
            maxd = isnan(d) ? INFINITY : d;
    }
    char w[200];
    snprintf(w, sizeof w, "%.180s (accumulate)", what);
    TU_ASSERT_CLOSE(maxd / maxv, TOL_ACC, w);
}

#endif
