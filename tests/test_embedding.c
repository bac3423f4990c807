/* Tests for the CPU embedding lookup: forward against the dequantised table
 * for every dtype, backward against central differences, accumulation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/dtype.h"
#include "tests/testutil.h"

/* Normalised-error tolerances: the forward is a copy (block scales add one
 * f32 rounding); the backward sums at most T terms per element. */
#define TOL_FWD 1e-7
#define TOL_GRAD 1e-6
#define FD_H 1e-3

typedef struct {
    dtype_t dt;
    int block;
    const char *name;
} wkind_t;

static const wkind_t g_kinds[] = {
    {DT_F32, 0, "f32"},    {DT_BF16, 0, "bf16"},          {DT_F16, 0, "f16"},
    {DT_F8E4M3, 0, "fp8"}, {DT_F8E4M3, 3, "fp8 block 3"},
};
#define NKINDS (int)(sizeof g_kinds / sizeof g_kinds[0])

typedef struct {
    int V, D, T;
} shape_t;

static const shape_t g_shapes[] = {{5, 1, 1}, {11, 7, 1}, {11, 33, 20}, {3, 300, 9}, {40, 64, 64}};
#define NSHAPES (int)(sizeof g_shapes / sizeof g_shapes[0])

static double stored_to_double(const void *data, dtype_t dt, size_t i) {
    switch (dt) {
    case DT_F32: return ((const float *)data)[i];
    case DT_BF16: return bf16_to_f32(((const uint16_t *)data)[i]);
    case DT_F16: return f16_to_f32(((const uint16_t *)data)[i]);
    case DT_F8E4M3: return fp8e4m3_to_f32(((const uint8_t *)data)[i]);
    default: return NAN;
    }
}

/* Ids drawn with repeats (T > V in some shapes), every id in range. */
static void make_ids(int32_t *ids, int T, int V, uint64_t seed) {
    float *u = malloc((size_t)T * sizeof(float));
    tu_fill(u, (size_t)T, seed, 0.0f, 1.0f);
    for (int t = 0; t < T; t++) {
        ids[t] = (int32_t)(u[t] * V);
        if (ids[t] >= V)
            ids[t] = V - 1;
    }
    free(u);
}

static void check_forward(const wkind_t *k, shape_t s, uint64_t seed) {
    int V = s.V, D = s.D, T = s.T;
    size_t n = (size_t)V * D;
    float *f = malloc(n * sizeof(float));
    tu_fill(f, n, seed, -3.0f, 3.0f);
    void *data = malloc(n * dtype_size(k->dt));
    convert_from_f32(data, k->dt, f, n);
    int nbc = (D + (k->block ? k->block : 1) - 1) / (k->block ? k->block : 1);
    float *scale = NULL;
    wview_t w = wview_of(data, k->dt);
    if (k->block) {
        int nbr = (V + k->block - 1) / k->block;
        scale = malloc((size_t)nbr * nbc * sizeof(float));
        tu_fill(scale, (size_t)nbr * nbc, seed + 1, 0.25f, 2.0f);
        w.scale = scale;
        w.block = k->block;
    }
    int32_t *ids = malloc((size_t)T * sizeof(int32_t));
    make_ids(ids, T, V, seed + 2);
    float *out = malloc((size_t)T * D * sizeof(float));
    double *ref = malloc((size_t)T * D * sizeof(double));
    tu_poison(out, (size_t)T * D);
    cpu_embedding_forward(out, ids, &w, T, D);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            size_t i = (size_t)ids[t] * D + d;
            double sc = k->block ? scale[(ids[t] / k->block) * nbc + d / k->block] : 1.0;
            ref[(size_t)t * D + d] = stored_to_double(data, k->dt, i) * sc;
        }
    char what[96];
    snprintf(what, sizeof what, "forward %s V=%d D=%d T=%d", k->name, V, D, T);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, (size_t)T * D, 1e-6), TOL_FWD, what);
    free(f), free(data), free(scale), free(ids), free(out), free(ref);
}

static void test_forward(void) {
    for (int ki = 0; ki < NKINDS; ki++)
        for (int si = 0; si < NSHAPES; si++)
            check_forward(&g_kinds[ki], g_shapes[si], 10 + 7 * ki + si);
}

/* L = sum(wte[ids] * G) in double. */
static double ref_loss(const double *wte, const int32_t *ids, const double *G, int T, int D) {
    double L = 0.0;
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++)
            L += wte[(size_t)ids[t] * D + d] * G[(size_t)t * D + d];
    return L;
}

static void check_backward(shape_t s, uint64_t seed) {
    int V = s.V, D = s.D, T = s.T;
    size_t n = (size_t)V * D, no = (size_t)T * D;
    double *wte = malloc(n * sizeof(double)), *G = malloc(no * sizeof(double));
    double *fd = malloc(n * sizeof(double)), *expect = malloc(n * sizeof(double));
    float *dout = malloc(no * sizeof(float)), *dwte = malloc(n * sizeof(float));
    int32_t *ids = malloc((size_t)T * sizeof(int32_t));
    tu_fill_d(wte, n, seed, -1.0, 1.0);
    tu_fill(dout, no, seed + 1, -1.0f, 1.0f);
    for (size_t i = 0; i < no; i++)
        G[i] = dout[i];
    make_ids(ids, T, V, seed + 2);
    for (size_t i = 0; i < n; i++) {
        double keep = wte[i];
        wte[i] = keep + FD_H;
        double lp = ref_loss(wte, ids, G, T, D);
        wte[i] = keep - FD_H;
        double lm = ref_loss(wte, ids, G, T, D);
        wte[i] = keep;
        fd[i] = (lp - lm) / (2.0 * FD_H);
    }
    for (int pre = 0; pre < 2; pre++) {
        if (pre)
            tu_fill(dwte, n, seed + 3, -2.0f, 2.0f);
        else
            memset(dwte, 0, n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            expect[i] = dwte[i] + fd[i];
        cpu_embedding_backward(dwte, dout, ids, T, D);
        char what[96];
        snprintf(what, sizeof what, "dwte V=%d D=%d T=%d prefilled=%d", V, D, T, pre);
        TU_ASSERT_CLOSE(tu_rel_err_fd(dwte, expect, n, 1e-3), TOL_GRAD, what);
    }
    cpu_embedding_backward(NULL, dout, ids, T, D); /* skipped, must not crash */
    free(wte), free(G), free(fd), free(expect), free(dout), free(dwte), free(ids);
}

static void test_backward_fd(void) {
    for (int si = 0; si < NSHAPES; si++)
        check_backward(g_shapes[si], 50 + si);
}

/* A wide table (D above the parallel threshold) with every id repeated. */
static void test_backward_repeated_ids_wide(void) {
    enum { V = 4, D = 20000, T = 12 };
    float *dout = malloc((size_t)T * D * sizeof(float));
    float *dwte = malloc((size_t)V * D * sizeof(float));
    double *expect = malloc((size_t)V * D * sizeof(double));
    int32_t ids[T];
    for (int t = 0; t < T; t++)
        ids[t] = (t * 3) % V;
    tu_fill(dout, (size_t)T * D, 5, -1.0f, 1.0f);
    tu_fill(dwte, (size_t)V * D, 6, -1.0f, 1.0f);
    for (size_t i = 0; i < (size_t)V * D; i++)
        expect[i] = dwte[i];
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++)
            expect[(size_t)ids[t] * D + d] += dout[(size_t)t * D + d];
    cpu_embedding_backward(dwte, dout, ids, T, D);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dwte, expect, (size_t)V * D, 1e-3), TOL_GRAD, "wide dwte");
    free(dout), free(dwte), free(expect);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward: all dtypes vs dequantised table", test_forward},
        {"backward: finite differences, accumulation", test_backward_fd},
        {"backward: repeated ids, wide rows", test_backward_repeated_ids_wide},
        CU_TEST_INFO_NULL,
    };
    return tu_main("embedding", tests);
}
