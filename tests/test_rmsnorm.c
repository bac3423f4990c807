/* Tests for the CPU RMSNorm: forward and rstd against a double reference,
 * backward against central differences of the double forward, accumulation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

/* Normalised-error tolerances: forward against double (a few f32 roundings),
 * gradients against central differences with step FD_H (truncation error
 * ~1e-9 at this step; the rest is the f32 kernel). */
#define TOL_FWD 1e-6
#define TOL_GRAD 1e-5
#define FD_H 1e-4
/* (D = 1 uses a large eps: with a tiny one the gradient is eps / |x|^3, all
 * cancellation in f32.) */

typedef struct {
    int N, D;
    float eps;
} shape_t;

static const shape_t g_shapes[] = {
    {1, 1, 0.1f}, {1, 7, 1e-5f}, {3, 64, 1e-6f}, {5, 33, 1e-6f}, {17, 300, 1e-5f}, {2, 2, 0.5f},
};
#define NSHAPES (int)(sizeof g_shapes / sizeof g_shapes[0])

/* out (N, D) = x / sqrt(mean(x^2) + eps) * w (w NULL: ones), rstd (N). */
static void ref_forward(double *out, double *rstd, const double *x, const double *w, int N, int D,
                        double eps) {
    for (int i = 0; i < N; i++) {
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += x[(size_t)i * D + d] * x[(size_t)i * D + d];
        double r = 1.0 / sqrt(ss / D + eps);
        if (rstd)
            rstd[i] = r;
        for (int d = 0; d < D; d++)
            out[(size_t)i * D + d] = x[(size_t)i * D + d] * r * (w ? w[d] : 1.0);
    }
}

static double ref_loss(double *tmp, const double *x, const double *w, const double *G, int N, int D,
                       double eps) {
    ref_forward(tmp, NULL, x, w, N, D, eps);
    double L = 0.0;
    for (size_t i = 0; i < (size_t)N * D; i++)
        L += tmp[i] * G[i];
    return L;
}

static void fd_grad(double *grad, double *p, size_t n, double *tmp, const double *x,
                    const double *w, const double *G, int N, int D, double eps) {
    for (size_t i = 0; i < n; i++) {
        double keep = p[i];
        p[i] = keep + FD_H;
        double lp = ref_loss(tmp, x, w, G, N, D, eps);
        p[i] = keep - FD_H;
        double lm = ref_loss(tmp, x, w, G, N, D, eps);
        p[i] = keep;
        grad[i] = (lp - lm) / (2.0 * FD_H);
    }
}

static void check(shape_t s, int with_w, uint64_t seed) {
    int N = s.N, D = s.D;
    size_t n = (size_t)N * D;
    float *x = malloc(n * sizeof(float)), *w = malloc((size_t)D * sizeof(float));
    float *out = malloc(n * sizeof(float)), *rstd = malloc((size_t)N * sizeof(float));
    float *dout = malloc(n * sizeof(float));
    tu_fill(x, n, seed, -2.0f, 2.0f);
    tu_fill(w, (size_t)D, seed + 1, 0.5f, 1.5f);
    tu_fill(dout, n, seed + 2, -1.0f, 1.0f);
    double *xd = malloc(n * sizeof(double)), *wd = malloc((size_t)D * sizeof(double));
    double *G = malloc(n * sizeof(double)), *ref = malloc(n * sizeof(double));
    double *rref = malloc((size_t)N * sizeof(double));
    for (size_t i = 0; i < n; i++)
        xd[i] = x[i], G[i] = dout[i];
    for (int d = 0; d < D; d++)
        wd[d] = w[d];
    const float *wk = with_w ? w : NULL;
    const double *wr = with_w ? wd : NULL;

    tu_poison(out, n);
    tu_poison(rstd, (size_t)N);
    cpu_rmsnorm_forward(out, rstd, x, wk, N, D, s.eps);
    ref_forward(ref, rref, xd, wr, N, D, s.eps);
    char what[128];
    snprintf(what, sizeof what, "N=%d D=%d eps=%g w=%d", N, D, s.eps, with_w);
    char w1[160];
    snprintf(w1, sizeof w1, "out %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, n, 1e-6), TOL_FWD, w1);
    snprintf(w1, sizeof w1, "rstd %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(rstd, rref, (size_t)N, 1e-6), TOL_FWD, w1);

    double *tmp = malloc(n * sizeof(double)), *gx = malloc(n * sizeof(double));
    double *gw = malloc((size_t)D * sizeof(double));
    fd_grad(gx, xd, n, tmp, xd, wr, G, N, D, s.eps);
    fd_grad(gw, wd, (size_t)D, tmp, xd, wd, G, N, D, s.eps);
    float *dx = malloc(n * sizeof(float)), *dw = malloc((size_t)D * sizeof(float));
    double *ex = malloc(n * sizeof(double)), *ew = malloc((size_t)D * sizeof(double));
    for (int pre = 0; pre < 2; pre++) {
        if (pre) {
            tu_fill(dx, n, seed + 3, -1.0f, 1.0f);
            tu_fill(dw, (size_t)D, seed + 4, -1.0f, 1.0f);
        } else {
            memset(dx, 0, n * sizeof(float));
            memset(dw, 0, (size_t)D * sizeof(float));
        }
        for (size_t i = 0; i < n; i++)
            ex[i] = dx[i] + gx[i];
        for (int d = 0; d < D; d++)
            ew[d] = dw[d] + gw[d];
        /* dw is the gradient of the weight whether or not the forward used
         * one: with w NULL it is taken at w = ones. */
        cpu_rmsnorm_backward(dx, dw, dout, x, wk, rstd, N, D);
        snprintf(w1, sizeof w1, "dx %s prefilled=%d", what, pre);
        TU_ASSERT_CLOSE(tu_rel_err_fd(dx, ex, n, 1e-3), TOL_GRAD, w1);
        if (with_w) {
            snprintf(w1, sizeof w1, "dw %s prefilled=%d", what, pre);
            TU_ASSERT_CLOSE(tu_rel_err_fd(dw, ew, (size_t)D, 1e-3), TOL_GRAD, w1);
        }
    }
    /* NULL gradient outputs are skipped. */
    memcpy(out, dx, n * sizeof(float));
    cpu_rmsnorm_backward(dx, NULL, dout, x, wk, rstd, N, D);
    cpu_rmsnorm_backward(NULL, dw, dout, x, wk, rstd, N, D);
    for (size_t i = 0; i < n; i++)
        ex[i] += gx[i];
    snprintf(w1, sizeof w1, "dx only %s", what);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, ex, n, 1e-3), TOL_GRAD, w1);
    free(x), free(w), free(out), free(rstd), free(dout), free(xd), free(wd), free(G), free(ref);
    free(rref), free(tmp), free(gx), free(gw), free(dx), free(dw), free(ex), free(ew);
}

static void test_forward_backward(void) {
    for (int si = 0; si < NSHAPES; si++)
        for (int ww = 0; ww < 2; ww++)
            check(g_shapes[si], ww, 40 + 2 * si + ww);
}

/* Above the parallel threshold, with rows of very different scale. */
static void test_large(void) {
    enum { N = 64, D = 1031 };
    float *x = malloc((size_t)N * D * sizeof(float)), *w = malloc(D * sizeof(float));
    float *out = malloc((size_t)N * D * sizeof(float)), *rstd = malloc(N * sizeof(float));
    double *xd = malloc((size_t)N * D * sizeof(double)), *wd = malloc(D * sizeof(double));
    double *ref = malloc((size_t)N * D * sizeof(double)), *rref = malloc(N * sizeof(double));
    tu_fill(x, (size_t)N * D, 3, -1.0f, 1.0f);
    tu_fill(w, D, 4, -2.0f, 2.0f);
    for (int i = 0; i < N; i++)
        for (int d = 0; d < D; d++)
            x[(size_t)i * D + d] *= powf(10.0f, (float)(i % 7) - 3.0f);
    for (size_t i = 0; i < (size_t)N * D; i++)
        xd[i] = x[i];
    for (int d = 0; d < D; d++)
        wd[d] = w[d];
    tu_poison(out, (size_t)N * D);
    cpu_rmsnorm_forward(out, rstd, x, w, N, D, 1e-6f);
    ref_forward(ref, rref, xd, wd, N, D, 1e-6);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, (size_t)N * D, 1e-6), TOL_FWD, "large out");
    for (int i = 0; i < N; i++) {
        double e = fabs(rstd[i] - rref[i]) / rref[i];
        CU_ASSERT(e < 1e-6);
    }
    free(x), free(w), free(out), free(rstd), free(xd), free(wd), free(ref), free(rref);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward, rstd and finite-difference backward", test_forward_backward},
        {"large rows of mixed scale", test_large},
        CU_TEST_INFO_NULL,
    };
    return tu_main("rmsnorm", tests);
}
