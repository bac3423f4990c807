/* Tests of the CPU top-k: order and ties against a selection reference for
 * K = 1, small K, large K (the sorting path) and K = C; NaN placement; the
 * backward scatter accumulating into a pre-filled gradient. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

/* Reference: K rounds of "largest not yet taken, lowest index on ties". */
static void ref_topk(int32_t *idx, float *val, const float *x, int C, int K) {
    char *taken = calloc((size_t)C, 1);
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int c = 0; c < C; c++)
            if (!taken[c] && (best < 0 || x[c] > x[best]))
                best = c;
        taken[best] = 1;
        idx[k] = best;
        val[k] = x[best];
    }
    free(taken);
}

/* Rows of x (N, C); quantised values when `ties` so that many entries are equal. */
static void check_against_reference(int N, int C, int K, int ties, uint64_t seed) {
    size_t n = (size_t)N * C;
    float *x = malloc(sizeof(float) * n), *val = malloc(sizeof(float) * N * K);
    int32_t *idx = malloc(sizeof(int32_t) * N * K), *ridx = malloc(sizeof(int32_t) * K);
    float *rval = malloc(sizeof(float) * K);
    tu_fill(x, n, seed, -5.0f, 5.0f);
    if (ties)
        for (size_t i = 0; i < n; i++)
            x[i] = floorf(x[i]);
    tu_poison(val, (size_t)N * K);
    for (int i = 0; i < N * K; i++)
        idx[i] = -7;
    cpu_topk_forward(idx, val, x, N, C, K);
    int bad = 0;
    for (int r = 0; r < N; r++) {
        ref_topk(ridx, rval, x + (size_t)r * C, C, K);
        for (int k = 0; k < K; k++)
            bad += idx[r * K + k] != ridx[k] || val[r * K + k] != rval[k];
    }
    if (bad)
        tu_report("topk N=%d C=%d K=%d ties=%d: %d mismatches", N, C, K, ties, bad);
    CU_ASSERT_EQUAL(bad, 0);
    free(x), free(val), free(idx), free(ridx), free(rval);
}

static void test_random_rows(void) {
    check_against_reference(5, 37, 1, 0, 1);
    check_against_reference(5, 37, 4, 0, 2);
    check_against_reference(5, 37, 37, 0, 3); /* K = C */
    check_against_reference(3, 256, 8, 0, 4);
    check_against_reference(3, 256, 100, 0, 5); /* sorting path */
    check_against_reference(64, 384, 8, 0, 6);  /* router-sized, multi-threaded */
    check_against_reference(2, 5000, 5000, 0, 7);
}

static void test_ties(void) {
    check_against_reference(6, 40, 1, 1, 11);
    check_against_reference(6, 40, 7, 1, 12);
    check_against_reference(6, 40, 40, 1, 13);
    check_against_reference(4, 300, 64, 1, 14); /* sorting path with ties */
    /* A worked example: ties keep index order. */
    const float x[6] = {1, 3, 3, 2, 3, 1};
    int32_t idx[6];
    float val[6];
    cpu_topk_forward(idx, val, x, 1, 6, 4);
    const int32_t want4[4] = {1, 2, 4, 3};
    CU_ASSERT(memcmp(idx, want4, sizeof want4) == 0);
    CU_ASSERT(val[0] == 3 && val[1] == 3 && val[2] == 3 && val[3] == 2);
    cpu_topk_forward(idx, val, x, 1, 6, 6);
    const int32_t want6[6] = {1, 2, 4, 3, 0, 5};
    CU_ASSERT(memcmp(idx, want6, sizeof want6) == 0);
    /* -0 and +0 compare equal: index order. */
    const float z[3] = {0.0f, -0.0f, -1.0f};
    cpu_topk_forward(idx, val, z, 1, 3, 2);
    CU_ASSERT(idx[0] == 0 && idx[1] == 1);
}

/* NaN goes after every number on both paths. */
static void test_nan_last(void) {
    float x[40];
    tu_fill(x, 40, 21, -1.0f, 1.0f);
    x[3] = NAN;
    x[0] = -INFINITY;
    int32_t idx[40];
    float val[40];
    for (int K = 40; K >= 39; K--) { /* sorting path (K > 32) */
        cpu_topk_forward(idx, val, x, 1, 40, K);
        CU_ASSERT(idx[38] == 0);
        if (K == 40)
            CU_ASSERT(idx[39] == 3 && isnan(val[39]));
    }
    const float y[3] = {1.0f, NAN, 2.0f};
    cpu_topk_forward(idx, val, y, 1, 3, 3); /* insertion path */
    CU_ASSERT(idx[0] == 2 && idx[1] == 0 && idx[2] == 1);
    cpu_topk_forward(idx, val, y, 1, 3, 2);
    CU_ASSERT(idx[0] == 2 && idx[1] == 0);
}

static void test_backward_scatter(void) {
    enum { N = 4, C = 19, K = 5 };
    float x[N * C], val[N * K], dval[N * K], dx[N * C], pre[N * C];
    int32_t idx[N * K];
    tu_fill(x, N * C, 31, -1.0f, 1.0f);
    tu_fill(dval, N * K, 32, -1.0f, 1.0f);
    tu_fill(pre, N * C, 33, -1.0f, 1.0f);
    cpu_topk_forward(idx, val, x, N, C, K);
    memcpy(dx, pre, sizeof dx);
    cpu_topk_backward(dx, dval, idx, N, C, K);
    int bad = 0;
    for (int r = 0; r < N; r++)
        for (int c = 0; c < C; c++) {
            float want = pre[r * C + c];
            for (int k = 0; k < K; k++)
                if (idx[r * K + k] == c)
                    want += dval[r * K + k];
            bad += dx[r * C + c] != want;
        }
    CU_ASSERT_EQUAL(bad, 0);
    /* val is x gathered at idx, so the scatter is its exact gradient. */
    for (int r = 0; r < N; r++)
        for (int k = 0; k < K; k++)
            CU_ASSERT_EQUAL(val[r * K + k], x[r * C + idx[r * K + k]]);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"random rows: K = 1, small K, large K, K = C", test_random_rows},
        {"ties go to the lower index", test_ties},
        {"NaN sorts last", test_nan_last},
        {"backward scatters and accumulates", test_backward_scatter},
        CU_TEST_INFO_NULL,
    };
    return tu_main("topk", tests);
}
