/* Tests of the CPU row softmax: forward against a double reference (small,
 * wide, and large-offset rows), backward against finite differences with
 * accumulation into pre-filled gradients. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

#define TOL_FWD 1e-6  /* normalised error of the float forward */
#define TOL_GRAD 1e-5 /* normalised error of the float backward vs finite differences */
#define FD_EPS 1e-5

static void ref_softmax(double *y, const double *x, int N, int C) {
    for (int n = 0; n < N; n++) {
        const double *xr = x + (size_t)n * C;
        double m = -INFINITY, s = 0;
        for (int c = 0; c < C; c++)
            m = fmax(m, xr[c]);
        for (int c = 0; c < C; c++)
            s += exp(xr[c] - m);
        for (int c = 0; c < C; c++)
            y[(size_t)n * C + c] = exp(xr[c] - m) / s;
    }
}

static void check_forward(int N, int C, float lo, float hi, uint64_t seed) {
    size_t n = (size_t)N * C;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    double *xd = malloc(sizeof(double) * n), *yd = malloc(sizeof(double) * n);
    tu_fill(x, n, seed, lo, hi);
    for (size_t i = 0; i < n; i++)
        xd[i] = x[i];
    tu_poison(y, n);
    cpu_softmax_forward(y, x, N, C);
    ref_softmax(yd, xd, N, C);
    char what[96];
    snprintf(what, sizeof what, "softmax forward N=%d C=%d in [%g, %g)", N, C, lo, hi);
    TU_ASSERT_CLOSE(tu_rel_err_fd(y, yd, n, 1e-30), TOL_FWD, what);
    /* Each row sums to one. */
    for (int r = 0; r < N; r++) {
        double s = 0;
        for (int c = 0; c < C; c++)
            s += y[(size_t)r * C + c];
        CU_ASSERT(fabs(s - 1.0) < 1e-5);
    }
    free(x), free(y), free(xd), free(yd);
}

static void test_forward(void) {
    check_forward(7, 13, -4.0f, 4.0f, 1);
    check_forward(3, 5000, -6.0f, 6.0f, 2);
    check_forward(16, 4096, -3.0f, 3.0f, 3); /* the multi-threaded path */
    check_forward(4, 9, 100.0f, 110.0f, 4);  /* exp would overflow without the max */
    check_forward(5, 1, -1.0f, 1.0f, 5);     /* one column: all ones */
}

/* In place (out == x) gives the same result. */
static void test_in_place(void) {
    enum { N = 3, C = 17 };
    float x[N * C], y[N * C];
    tu_fill(x, N * C, 8, -2.0f, 2.0f);
    cpu_softmax_forward(y, x, N, C);
    cpu_softmax_forward(x, x, N, C);
    CU_ASSERT(memcmp(x, y, sizeof x) == 0);
}

static void test_backward_finite_differences(void) {
    enum { N = 4, C = 9 };
    size_t n = N * C;
    float x[N * C], y[N * C], g[N * C], dx[N * C], pre[N * C];
    double xd[N * C], yd[N * C], fd[N * C];
    tu_fill(x, n, 11, -3.0f, 3.0f);
    tu_fill(g, n, 12, -1.0f, 1.0f);
    tu_fill(pre, n, 13, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++)
        xd[i] = x[i];
    for (size_t i = 0; i < n; i++) {
        double save = xd[i], lp = 0, lm = 0;
        xd[i] = save + FD_EPS;
        ref_softmax(yd, xd, N, C);
        for (size_t j = 0; j < n; j++)
            lp += yd[j] * g[j];
        xd[i] = save - FD_EPS;
        ref_softmax(yd, xd, N, C);
        for (size_t j = 0; j < n; j++)
            lm += yd[j] * g[j];
        xd[i] = save;
        fd[i] = (lp - lm) / (2 * FD_EPS);
    }
    tu_poison(y, n);
    cpu_softmax_forward(y, x, N, C);
    memcpy(dx, pre, sizeof dx);
    cpu_softmax_backward(dx, g, y, N, C);
    for (size_t i = 0; i < n; i++)
        dx[i] -= pre[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, fd, n, 1e-3), TOL_GRAD, "softmax backward");
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward against double reference", test_forward},
        {"in place", test_in_place},
        {"backward: finite differences, accumulates", test_backward_finite_differences},
        CU_TEST_INFO_NULL,
    };
    return tu_main("softmax", tests);
}
