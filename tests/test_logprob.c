/* Tests of the CPU logprob kernel: target log-probability, entropy and
 * log-sum-exp of temperature-scaled logits against a double reference (small
 * and 150k-wide vocabularies, temperatures 1 and 0.7), and the backward from
 * dlogp only, dentropy only and both against finite differences. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

#define TOL_FWD 1e-6  /* normalised error, floor 1 (values are O(1)..O(10)) */
#define TOL_GRAD 1e-5 /* normalised error of the float backward vs finite differences */
#define FD_EPS 1e-5

/* Double reference for one row: returns lse, writes logp and entropy. */
static double ref_row(double *logp, double *ent, const double *l, int V, int32_t t, double T) {
    double m = -INFINITY, s = 0, a = 0;
    for (int j = 0; j < V; j++)
        m = fmax(m, l[j] / T);
    for (int j = 0; j < V; j++)
        s += exp(l[j] / T - m);
    double lse = m + log(s);
    for (int j = 0; j < V; j++) {
        double lp = l[j] / T - lse;
        a -= exp(lp) * lp;
    }
    *logp = l[t] / T - lse;
    *ent = a;
    return lse;
}

static void make_inputs(float *logits, int32_t *targets, int N, int V, float lo, float hi,
                        uint64_t seed) {
    tu_fill(logits, (size_t)N * V, seed, lo, hi);
    for (int n = 0; n < N; n++) {
        targets[n] = (int32_t)(((uint64_t)n * 7919u + seed) % (uint64_t)V);
        logits[(size_t)n * V + (n * 31 % V)] += 8.0f; /* a peak, not always the target */
    }
}

static void check_forward(int N, int V, float T, uint64_t seed) {
    size_t n = (size_t)N * V;
    float *logits = malloc(sizeof(float) * n);
    int32_t *targets = malloc(sizeof(int32_t) * N);
    float *logp = malloc(sizeof(float) * N), *ent = malloc(sizeof(float) * N);
    float *lse = malloc(sizeof(float) * N), *logp2 = malloc(sizeof(float) * N);
    float *lse2 = malloc(sizeof(float) * N);
    double *rl = malloc(sizeof(double) * N), *re = malloc(sizeof(double) * N);
    double *rz = malloc(sizeof(double) * N), *row = malloc(sizeof(double) * V);
    make_inputs(logits, targets, N, V, -10.0f, 10.0f, seed);
    tu_poison(logp, N), tu_poison(ent, N), tu_poison(lse, N);
    cpu_logprob_forward(logp, ent, lse, logits, targets, N, V, T);
    for (int r = 0; r < N; r++) {
        for (int j = 0; j < V; j++)
            row[j] = logits[(size_t)r * V + j];
        rz[r] = ref_row(&rl[r], &re[r], row, V, targets[r], T);
    }
    char what[96];
    snprintf(what, sizeof what, "logprob N=%d V=%d T=%g: logp", N, V, T);
    TU_ASSERT_CLOSE(tu_rel_err_fd(logp, rl, N, 1.0), TOL_FWD, what);
    snprintf(what, sizeof what, "logprob N=%d V=%d T=%g: entropy", N, V, T);
    TU_ASSERT_CLOSE(tu_rel_err_fd(ent, re, N, 1.0), TOL_FWD, what);
    snprintf(what, sizeof what, "logprob N=%d V=%d T=%g: lse", N, V, T);
    TU_ASSERT_CLOSE(tu_rel_err_fd(lse, rz, N, 1.0), TOL_FWD, what);
    /* Without entropy, logp and lse are unchanged. */
    tu_poison(logp2, N), tu_poison(lse2, N);
    cpu_logprob_forward(logp2, NULL, lse2, logits, targets, N, V, T);
    CU_ASSERT(memcmp(logp, logp2, sizeof(float) * N) == 0);
    CU_ASSERT(memcmp(lse, lse2, sizeof(float) * N) == 0);
    free(logits), free(targets), free(logp), free(ent), free(lse), free(logp2), free(lse2);
    free(rl), free(re), free(rz), free(row);
}

static void test_forward(void) {
    check_forward(6, 1000, 1.0f, 1);
    check_forward(6, 1000, 0.7f, 2);
    check_forward(2, 150000, 1.0f, 3);
    check_forward(2, 150000, 0.7f, 4);
    check_forward(3, 1, 0.7f, 5); /* one token: logp 0, entropy 0 */
}

/* L = sum_n a_n logp_n + b_n H_n, with a or b absent. */
static double ref_loss(const double *l, const int32_t *targets, int N, int V, double T,
                       const float *a, const float *b) {
    double L = 0;
    for (int n = 0; n < N; n++) {
        double lp, h;
        ref_row(&lp, &h, l + (size_t)n * V, V, targets[n], T);
        L += (a ? a[n] * lp : 0) + (b ? b[n] * h : 0);
    }
    return L;
}

static void check_backward(int N, int V, float T, int with_logp, int with_ent, uint64_t seed) {
    size_t n = (size_t)N * V;
    float *logits = malloc(sizeof(float) * n), *dl = malloc(sizeof(float) * n);
    float *pre = malloc(sizeof(float) * n);
    double *ld = malloc(sizeof(double) * n), *fd = malloc(sizeof(double) * n);
    int32_t *targets = malloc(sizeof(int32_t) * N);
    float *logp = malloc(sizeof(float) * N), *ent = malloc(sizeof(float) * N);
    float *lse = malloc(sizeof(float) * N), *ga = malloc(sizeof(float) * N);
    float *gb = malloc(sizeof(float) * N);
    make_inputs(logits, targets, N, V, -3.0f, 3.0f, seed);
    tu_fill(ga, N, seed + 1, -1.0f, 1.0f);
    tu_fill(gb, N, seed + 2, -1.0f, 1.0f);
    const float *a = with_logp ? ga : NULL, *b = with_ent ? gb : NULL;
    for (size_t i = 0; i < n; i++)
        ld[i] = logits[i];
    for (size_t i = 0; i < n; i++) {
        double save = ld[i];
        ld[i] = save + FD_EPS;
        double lp = ref_loss(ld, targets, N, V, T, a, b);
        ld[i] = save - FD_EPS;
        double lm = ref_loss(ld, targets, N, V, T, a, b);
        ld[i] = save;
        fd[i] = (lp - lm) / (2 * FD_EPS);
    }
    tu_poison(lse, N);
    cpu_logprob_forward(logp, ent, lse, logits, targets, N, V, T);
    tu_fill(pre, n, seed + 3, -1.0f, 1.0f);
    memcpy(dl, pre, sizeof(float) * n);
    cpu_logprob_backward(dl, a, b, logits, lse, targets, N, V, T);
    for (size_t i = 0; i < n; i++)
        dl[i] -= pre[i];
    char what[96];
    snprintf(what, sizeof what, "logprob backward T=%g dlogp=%d dentropy=%d", T, with_logp,
             with_ent);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dl, fd, n, 1e-3), TOL_GRAD, what);
    free(logits), free(dl), free(pre), free(ld), free(fd), free(targets);
    free(logp), free(ent), free(lse), free(ga), free(gb);
}

static void test_backward_finite_differences(void) {
    const float temps[2] = {1.0f, 0.7f};
    for (int t = 0; t < 2; t++) {
        check_backward(3, 40, temps[t], 1, 0, 10 + t);
        check_backward(3, 40, temps[t], 0, 1, 20 + t);
        check_backward(3, 40, temps[t], 1, 1, 30 + t);
    }
}

/* Both gradients NULL: dlogits is untouched. */
static void test_backward_nothing_to_do(void) {
    enum { N = 2, V = 16 };
    float logits[N * V], dl[N * V], before[N * V], logp[N], lse[N];
    int32_t targets[N] = {3, 15};
    tu_fill(logits, N * V, 41, -2.0f, 2.0f);
    tu_fill(dl, N * V, 42, -1.0f, 1.0f);
    memcpy(before, dl, sizeof dl);
    cpu_logprob_forward(logp, NULL, lse, logits, targets, N, V, 1.0f);
    cpu_logprob_backward(dl, NULL, NULL, logits, lse, targets, N, V, 1.0f);
    CU_ASSERT(memcmp(dl, before, sizeof dl) == 0);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward against double reference", test_forward},
        {"backward: finite differences, accumulates", test_backward_finite_differences},
        {"backward with no incoming gradient", test_backward_nothing_to_do},
        CU_TEST_INFO_NULL,
    };
    return tu_main("logprob", tests);
}
