/* Tests for the CPU SwiGLU: forward against a double reference, backward
 * against central differences, accumulation and NULL gradient outputs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

/* Normalised-error tolerances: forward (f32 exp and products), gradients
 * against central differences with step FD_H (truncation ~1e-9). */
#define TOL_FWD 1e-6
#define TOL_GRAD 1e-5
#define FD_H 1e-4

static double ref_silu(double g) {
    return g / (1.0 + exp(-g));
}

/* Runs backward on gradient buffers holding `pre` and checks them against
 * pre + the finite-difference gradients fdg, fdu (either may be skipped). */
static void check_backward(float *dg, float *du, const double *fdg, const double *fdu,
                           const float *dout, const float *gate, const float *up, size_t n,
                           const char *what) {
    double *eg = malloc(n * sizeof(double)), *eu = malloc(n * sizeof(double));
    float *keep_u = malloc(n * sizeof(float)), *keep_g = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        eg[i] = (double)dg[i] + fdg[i];
        eu[i] = (double)du[i] + fdu[i];
    }
    memcpy(keep_g, dg, n * sizeof(float));
    memcpy(keep_u, du, n * sizeof(float));
    char w[96];
    /* both, then each alone: a NULL output must be left alone */
    cpu_swiglu_backward(dg, du, dout, gate, up, n);
    snprintf(w, sizeof w, "dgate %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dg, eg, n, 1e-3), TOL_GRAD, w);
    snprintf(w, sizeof w, "dup %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(du, eu, n, 1e-3), TOL_GRAD, w);
    memcpy(dg, keep_g, n * sizeof(float));
    memcpy(du, keep_u, n * sizeof(float));
    cpu_swiglu_backward(dg, NULL, dout, gate, up, n);
    snprintf(w, sizeof w, "dgate alone %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dg, eg, n, 1e-3), TOL_GRAD, w);
    CU_ASSERT(memcmp(du, keep_u, n * sizeof(float)) == 0);
    memcpy(keep_g, dg, n * sizeof(float));
    cpu_swiglu_backward(NULL, du, dout, gate, up, n);
    CU_ASSERT(memcmp(dg, keep_g, n * sizeof(float)) == 0);
    snprintf(w, sizeof w, "dup alone %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(du, eu, n, 1e-3), TOL_GRAD, w);
    free(eg), free(eu), free(keep_u), free(keep_g);
}

static void check(size_t n, uint64_t seed) {
    float *gate = malloc(n * sizeof(float)), *up = malloc(n * sizeof(float));
    float *out = malloc(n * sizeof(float)), *dout = malloc(n * sizeof(float));
    float *dg = malloc(n * sizeof(float)), *du = malloc(n * sizeof(float));
    double *ref = malloc(n * sizeof(double)), *fdg = malloc(n * sizeof(double));
    double *fdu = malloc(n * sizeof(double));
    tu_fill(gate, n, seed, -8.0f, 8.0f);
    tu_fill(up, n, seed + 1, -2.0f, 2.0f);
    tu_fill(dout, n, seed + 2, -1.0f, 1.0f);
    if (n > 3) { /* saturated gates and a signed zero */
        gate[1] = -100.0f;
        gate[2] = 100.0f;
        gate[3] = -0.0f;
    }
    tu_poison(out, n);
    cpu_swiglu_forward(out, gate, up, n);
    for (size_t i = 0; i < n; i++)
        ref[i] = ref_silu(gate[i]) * up[i];
    char what[64];
    snprintf(what, sizeof what, "forward n=%zu", n);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, n, 1e-3), TOL_FWD, what);

    /* L = sum(silu(g) u G): each element only reaches its own output. */
    for (size_t i = 0; i < n; i++) {
        double g = gate[i], u = up[i], G = dout[i];
        fdg[i] = (ref_silu(g + FD_H) - ref_silu(g - FD_H)) * u * G / (2.0 * FD_H);
        fdu[i] = (ref_silu(g) * (u + FD_H) - ref_silu(g) * (u - FD_H)) * G / (2.0 * FD_H);
    }
    memset(dg, 0, n * sizeof(float));
    memset(du, 0, n * sizeof(float));
    snprintf(what, sizeof what, "n=%zu zeroed", n);
    check_backward(dg, du, fdg, fdu, dout, gate, up, n, what);
    tu_fill(dg, n, seed + 3, -1.0f, 1.0f);
    tu_fill(du, n, seed + 4, -1.0f, 1.0f);
    snprintf(what, sizeof what, "n=%zu prefilled", n);
    check_backward(dg, du, fdg, fdu, dout, gate, up, n, what);
    free(gate), free(up), free(out), free(dout), free(dg), free(du), free(ref), free(fdg);
    free(fdu);
}

static void test_swiglu(void) {
    const size_t sizes[] = {1, 7, 1000, 70001}; /* the last runs on several threads */
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        check(sizes[k], 20 + k);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward and finite-difference backward", test_swiglu},
        CU_TEST_INFO_NULL,
    };
    return tu_main("swiglu", tests);
}
