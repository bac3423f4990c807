/* Tests for rollout/amx_matmul: products of f32 activations with bf16 weights against a
 * double reference (row counts below, at and above a tile, column and output counts that
 * are and are not multiples of the tile blocks, with bias), a row's bits not depending
 * on the other rows, and the same bits on one and two threads. Where the CPU has no AMX
 * the fallback kernel is what runs and is checked the same way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "rollout/amx_matmul.h"
#include "tests/testutil.h"

/* w (OC, C) bf16 from uniform [-1, 1) (the top half of each float). */
static uint16_t *make_w(int OC, int C, uint64_t seed) {
    size_t n = (size_t)OC * C;
    float *f = malloc(sizeof(float) * n);
    uint16_t *w = malloc(sizeof(uint16_t) * n);
    tu_fill(f, n, seed, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &f[i], sizeof u);
        w[i] = (uint16_t)(u >> 16);
    }
    free(f);
    return w;
}

static double bf16d(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void reference(double *ref, const float *x, const uint16_t *w, const float *bias, int T,
                      int C, int OC) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += (double)x[(size_t)t * C + c] * bf16d(w[(size_t)o * C + c]);
            ref[(size_t)t * OC + o] = s;
        }
}

static void check(int T, int C, int OC, int with_bias, uint64_t seed) {
    size_t nx = (size_t)T * C, no = (size_t)T * OC;
    float *x = malloc(sizeof(float) * nx), *out = malloc(sizeof(float) * no);
    float *bias = malloc(sizeof(float) * (size_t)OC);
    double *ref = malloc(sizeof(double) * no);
    uint16_t *w = make_w(OC, C, seed);
    /* activations over several binades, so all three bf16 parts matter */
    tu_fill(x, nx, seed + 1, -3.0f, 3.0f);
    for (size_t i = 0; i < nx; i += 7)
        x[i] *= 1e-3f;
    tu_fill(bias, (size_t)OC, seed + 2, -1.0f, 1.0f);
    tu_poison(out, no);
    wview_t wv = wview_of(w, DT_BF16);
    amx_matmul_forward(out, x, &wv, with_bias ? bias : NULL, T, C, OC);
    reference(ref, x, w, with_bias ? bias : NULL, T, C, OC);
    char what[96];
    snprintf(what, sizeof what, "T %d C %d OC %d bias %d", T, C, OC, with_bias);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, no, 1.0), 2e-6, what);
    free(x), free(out), free(bias), free(ref), free(w);
}

static void test_shapes(void) {
    const int Ts[] = {1, 15, 16, 17, 37, 64, 100};
    const int Cs[] = {32, 96, 48};
    const int OCs[] = {16, 32, 45, 64, 261};
    uint64_t seed = 10;
    for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
        for (size_t b = 0; b < sizeof Cs / sizeof *Cs; b++)
            for (size_t c = 0; c < sizeof OCs / sizeof *OCs; c++, seed += 3)
                check(Ts[a], Cs[b], OCs[c], (int)(seed & 1), seed);
}

/* The first 20 rows give the same bits alone (T 20) as among 90 rows, and the 90 rows
 * the same bits on 1 and 2 threads. */
static void test_rows_independent(void) {
    enum { C = 256, OC = 200, TA = 20, TB = 90 };
    float *x = malloc(sizeof(float) * TB * C), *a = malloc(sizeof(float) * TA * OC);
    float *b = malloc(sizeof(float) * TB * OC), *one = malloc(sizeof(float) * TB * OC);
    uint16_t *w = make_w(OC, C, 77);
    tu_fill(x, (size_t)TB * C, 78, -2.0f, 2.0f);
    wview_t wv = wview_of(w, DT_BF16);
    int threads = backend_cpu_threads();
    for (int th = 1; th <= 2; th++) {
        backend_cpu_set_threads(th);
        tu_poison(a, (size_t)TA * OC);
        tu_poison(b, (size_t)TB * OC);
        amx_matmul_forward(a, x, &wv, NULL, TA, C, OC);
        amx_matmul_forward(b, x, &wv, NULL, TB, C, OC);
        CU_ASSERT(memcmp(a, b, sizeof(float) * TA * OC) == 0);
        if (th == 1)
            memcpy(one, b, sizeof(float) * TB * OC);
        else
            CU_ASSERT(memcmp(one, b, sizeof(float) * TB * OC) == 0);
    }
    backend_cpu_set_threads(threads);
    free(x), free(a), free(b), free(one), free(w);
}

/* Above the rows taken at a time (256): the product against the reference, and rows 250
 * to 279 (across the chunk boundary) the same bits as computed alone. */
static void test_row_chunks(void) {
    enum { C = 96, OC = 45, T = 300, R0 = 250, TA = 30 };
    check(T, C, OC, 1, 91);
    float *x = malloc(sizeof(float) * T * C), *a = malloc(sizeof(float) * TA * OC);
    float *b = malloc(sizeof(float) * T * OC);
    uint16_t *w = make_w(OC, C, 92);
    tu_fill(x, (size_t)T * C, 93, -2.0f, 2.0f);
    wview_t wv = wview_of(w, DT_BF16);
    tu_poison(a, (size_t)TA * OC);
    tu_poison(b, (size_t)T * OC);
    amx_matmul_forward(a, x + (size_t)R0 * C, &wv, NULL, TA, C, OC);
    amx_matmul_forward(b, x, &wv, NULL, T, C, OC);
    CU_ASSERT(memcmp(a, b + (size_t)R0 * OC, sizeof(float) * TA * OC) == 0);
    free(x), free(a), free(b), free(w);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"products vs double reference", test_shapes},
        {"rows independent of the batch and threads", test_rows_independent},
        {"more rows than one chunk", test_row_chunks},
        CU_TEST_INFO_NULL,
    };
    return tu_main("amx_matmul", tests);
}
