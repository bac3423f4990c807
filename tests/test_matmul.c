/* Tests for the CPU matmul: forward against a double reference on the
 * dequantised weights, backward against central differences, for every weight
 * dtype, on both sides of the small-T threshold. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/dtype.h"
#include "tests/testutil.h"

/* Normalised-error tolerances: forward against the double reference (f32
 * accumulation over C terms), gradients against central differences (the op
 * is linear, so the differences are exact up to rounding). */
#define TOL_FWD 2e-6
#define TOL_GRAD 1e-5
#define TOL_BIG 5e-6 /* forward/backward with C = 65537 */
#define FD_H 1e-3

/* The kernel switches from its fused path to blocked sgemm at T = 16; the
 * shapes below sit on both sides. */
typedef struct {
    int T, C, OC;
} shape_t;

static const shape_t g_shapes[] = {
    {1, 7, 5}, {1, 64, 3}, {3, 33, 17}, {15, 19, 40}, {16, 31, 29}, {17, 40, 23}, {24, 9, 70},
};
#define NSHAPES (int)(sizeof g_shapes / sizeof g_shapes[0])

typedef struct {
    dtype_t dt;
    int block; /* fp8 block-scale edge, 0 for none */
    const char *name;
} wkind_t;

static const wkind_t g_kinds[] = {
    {DT_F32, 0, "f32"},    {DT_BF16, 0, "bf16"},          {DT_F16, 0, "f16"},
    {DT_F8E4M3, 0, "fp8"}, {DT_F8E4M3, 4, "fp8 block 4"}, {DT_F8E4M3, 7, "fp8 block 7"},
};
#define NKINDS (int)(sizeof g_kinds / sizeof g_kinds[0])

/* A weight (OC, C) in a stored dtype plus its dequantised values in double. */
typedef struct {
    void *data;
    float *scale; /* (ceil(OC / block), ceil(C / block)) or NULL */
    wview_t view;
    double *deq; /* (OC, C) */
} tweight_t;

static double stored_to_double(const void *data, dtype_t dt, size_t i) {
    switch (dt) {
    case DT_F32: return ((const float *)data)[i];
    case DT_BF16: return bf16_to_f32(((const uint16_t *)data)[i]);
    case DT_F16: return f16_to_f32(((const uint16_t *)data)[i]);
    case DT_F8E4M3: return fp8e4m3_to_f32(((const uint8_t *)data)[i]);
    default: return NAN;
    }
}

static void tweight_make(tweight_t *w, const wkind_t *k, int OC, int C, uint64_t seed) {
    size_t n = (size_t)OC * (size_t)C;
    float *f = malloc(n * sizeof(float));
    tu_fill(f, n, seed, -1.0f, 1.0f);
    w->data = malloc(n * dtype_size(k->dt));
    convert_from_f32(w->data, k->dt, f, n);
    free(f);
    w->scale = NULL;
    int nbc = 1;
    if (k->block) {
        int nbr = (OC + k->block - 1) / k->block;
        nbc = (C + k->block - 1) / k->block;
        w->scale = malloc((size_t)nbr * (size_t)nbc * sizeof(float));
        tu_fill(w->scale, (size_t)nbr * (size_t)nbc, seed + 1, 0.25f, 2.0f);
    }
    w->view = wview_of(w->data, k->dt);
    w->view.scale = w->scale;
    w->view.block = k->block;
    w->deq = malloc(n * sizeof(double));
    for (int r = 0; r < OC; r++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            double s = k->block ? w->scale[(r / k->block) * nbc + c / k->block] : 1.0;
            w->deq[i] = stored_to_double(w->data, k->dt, i) * s;
        }
}

static void tweight_free(tweight_t *w) {
    free(w->data);
    free(w->scale);
    free(w->deq);
}

static double *to_double(const float *x, size_t n) {
    double *d = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

/* out (T, OC) = inp (T, C) @ w^T + bias. */
static void ref_forward(double *out, const double *inp, const double *w, const double *bias, int T,
                        int C, int OC) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += inp[(size_t)t * C + c] * w[(size_t)o * C + c];
            out[(size_t)t * OC + o] = s;
        }
}

static double ref_loss(double *scratch, const double *inp, const double *w, const double *bias,
                       const double *G, int T, int C, int OC) {
    ref_forward(scratch, inp, w, bias, T, C, OC);
    double L = 0.0;
    for (size_t i = 0; i < (size_t)T * OC; i++)
        L += scratch[i] * G[i];
    return L;
}

/* grad (n) = dL/dp by central differences, nudging p in place. */
static void fd_grad(double *grad, double *p, size_t n, double *scratch, const double *inp,
                    const double *w, const double *bias, const double *G, int T, int C, int OC) {
    for (size_t i = 0; i < n; i++) {
        double keep = p[i];
        p[i] = keep + FD_H;
        double lp = ref_loss(scratch, inp, w, bias, G, T, C, OC);
        p[i] = keep - FD_H;
        double lm = ref_loss(scratch, inp, w, bias, G, T, C, OC);
        p[i] = keep;
        grad[i] = (lp - lm) / (2.0 * FD_H);
    }
}

static void check_forward(const wkind_t *k, shape_t s, int with_bias, uint64_t seed) {
    int T = s.T, C = s.C, OC = s.OC;
    tweight_t w;
    tweight_make(&w, k, OC, C, seed);
    float *inp = malloc((size_t)T * C * sizeof(float));
    float *bias = malloc((size_t)OC * sizeof(float));
    float *out = malloc((size_t)T * OC * sizeof(float));
    tu_fill(inp, (size_t)T * C, seed + 2, -1.0f, 1.0f);
    tu_fill(bias, (size_t)OC, seed + 3, -1.0f, 1.0f);
    tu_poison(out, (size_t)T * OC);
    cpu_matmul_forward(out, inp, &w.view, with_bias ? bias : NULL, T, C, OC);

    double *inp_d = to_double(inp, (size_t)T * C), *bias_d = to_double(bias, (size_t)OC);
    double *ref = malloc((size_t)T * OC * sizeof(double));
    ref_forward(ref, inp_d, w.deq, with_bias ? bias_d : NULL, T, C, OC);
    char what[128];
    snprintf(what, sizeof what, "forward %s T=%d C=%d OC=%d bias=%d", k->name, T, C, OC, with_bias);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, (size_t)T * OC, 1e-6), TOL_FWD, what);
    free(inp), free(bias), free(out), free(inp_d), free(bias_d), free(ref);
    tweight_free(&w);
}

static void test_forward(void) {
    for (int ki = 0; ki < NKINDS; ki++)
        for (int si = 0; si < NSHAPES; si++)
            for (int b = 0; b < 2; b++)
                check_forward(&g_kinds[ki], g_shapes[si], b, 100 + 17 * ki + si);
}

/* Runs backward into gradient buffers pre-filled with `pre` (zeros or random)
 * and checks result - pre against the finite-difference gradient. */
static void check_backward(const wkind_t *k, shape_t s, uint64_t seed) {
    int T = s.T, C = s.C, OC = s.OC;
    size_t nin = (size_t)T * C, nw = (size_t)OC * C, nout = (size_t)T * OC;
    tweight_t w;
    tweight_make(&w, k, OC, C, seed);
    int train_w = k->dt == DT_F32 && !k->block;
    float *inp = malloc(nin * sizeof(float)), *dout = malloc(nout * sizeof(float));
    tu_fill(inp, nin, seed + 2, -1.0f, 1.0f);
    tu_fill(dout, nout, seed + 4, -1.0f, 1.0f);
    double *inp_d = to_double(inp, nin), *G = to_double(dout, nout);
    double *bias_d = calloc((size_t)OC, sizeof(double));
    double *scratch = malloc(nout * sizeof(double));
    double *g_inp = malloc(nin * sizeof(double)), *g_w = malloc(nw * sizeof(double));
    double *g_b = malloc((size_t)OC * sizeof(double));
    fd_grad(g_inp, inp_d, nin, scratch, inp_d, w.deq, bias_d, G, T, C, OC);
    if (train_w)
        fd_grad(g_w, w.deq, nw, scratch, inp_d, w.deq, bias_d, G, T, C, OC);
    else
        memset(g_w, 0, nw * sizeof(double));
    fd_grad(g_b, bias_d, (size_t)OC, scratch, inp_d, w.deq, bias_d, G, T, C, OC);

    float *dinp = malloc(nin * sizeof(float)), *dw = malloc(nw * sizeof(float));
    float *db = malloc((size_t)OC * sizeof(float));
    double *exp_inp = malloc(nin * sizeof(double)), *exp_w = malloc(nw * sizeof(double));
    double *exp_b = malloc((size_t)OC * sizeof(double));
    for (int pre = 0; pre < 2; pre++) {
        if (pre) {
            tu_fill(dinp, nin, seed + 5, -2.0f, 2.0f);
            tu_fill(dw, nw, seed + 6, -2.0f, 2.0f);
            tu_fill(db, (size_t)OC, seed + 7, -2.0f, 2.0f);
        } else {
            memset(dinp, 0, nin * sizeof(float));
            memset(dw, 0, nw * sizeof(float));
            memset(db, 0, (size_t)OC * sizeof(float));
        }
        for (size_t i = 0; i < nin; i++)
            exp_inp[i] = dinp[i] + g_inp[i];
        for (size_t i = 0; i < nw; i++)
            exp_w[i] = dw[i] + g_w[i];
        for (int i = 0; i < OC; i++)
            exp_b[i] = db[i] + g_b[i];
        cpu_matmul_backward(dinp, train_w ? dw : NULL, db, dout, inp, &w.view, T, C, OC);
        char what[160];
        snprintf(what, sizeof what, "%s T=%d C=%d OC=%d prefilled=%d", k->name, T, C, OC, pre);
        char w1[200];
        snprintf(w1, sizeof w1, "dinp %s", what);
        TU_ASSERT_CLOSE(tu_rel_err_fd(dinp, exp_inp, nin, 1e-3), TOL_GRAD, w1);
        snprintf(w1, sizeof w1, "dbias %s", what);
        TU_ASSERT_CLOSE(tu_rel_err_fd(db, exp_b, (size_t)OC, 1e-3), TOL_GRAD, w1);
        if (train_w) {
            snprintf(w1, sizeof w1, "dw %s", what);
            TU_ASSERT_CLOSE(tu_rel_err_fd(dw, exp_w, nw, 1e-3), TOL_GRAD, w1);
        }
    }
    free(inp), free(dout), free(inp_d), free(G), free(bias_d), free(scratch);
    free(g_inp), free(g_w), free(g_b), free(dinp), free(dw), free(db);
    free(exp_inp), free(exp_w), free(exp_b);
    tweight_free(&w);
}

static void test_backward_fd(void) {
    for (int ki = 0; ki < NKINDS; ki++)
        for (int si = 0; si < NSHAPES; si++)
            check_backward(&g_kinds[ki], g_shapes[si], 300 + 13 * ki + si);
}

/* NULL gradient outputs are skipped; the others still accumulate. */
static void test_backward_null_outputs(void) {
    enum { T = 5, C = 12, OC = 9 };
    tweight_t w;
    tweight_make(&w, &g_kinds[1], OC, C, 77);
    float inp[T * C], dout[T * OC], dinp[T * C], db[OC], pre_b[OC];
    tu_fill(inp, T * C, 1, -1, 1);
    tu_fill(dout, T * OC, 2, -1, 1);
    tu_fill(pre_b, OC, 3, -1, 1);
    memcpy(db, pre_b, sizeof db);
    cpu_matmul_backward(NULL, NULL, db, dout, inp, &w.view, T, C, OC);
    double exp_b[OC];
    for (int o = 0; o < OC; o++) {
        exp_b[o] = pre_b[o];
        for (int t = 0; t < T; t++)
            exp_b[o] += dout[t * OC + o];
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(db, exp_b, OC, 1e-3), TOL_GRAD, "dbias alone");
    memset(dinp, 0, sizeof dinp);
    memcpy(db, pre_b, sizeof db);
    cpu_matmul_backward(dinp, NULL, NULL, dout, inp, &w.view, T, C, OC);
    for (int o = 0; o < OC; o++)
        CU_ASSERT(db[o] == pre_b[o]);
    double exp_in[T * C];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) {
            exp_in[t * C + c] = 0;
            for (int o = 0; o < OC; o++)
                exp_in[t * C + c] += dout[t * OC + o] * w.deq[o * C + c];
        }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dinp, exp_in, T * C, 1e-3), TOL_GRAD, "dinp alone");
    tweight_free(&w);
}

/* C = 65537 makes the blocked path convert two blocks of 64 rows (the second
 * partial) and the fused path run many column chunks; checked against the
 * direct double products, forward and input gradient. */
static void test_large_c(void) {
    const int C = 65537, OC = 66;
    const int Ts[] = {2, 16};
    const wkind_t *kinds[] = {&g_kinds[1], &g_kinds[5]};
    for (int ki = 0; ki < 2; ki++) {
        tweight_t w;
        tweight_make(&w, kinds[ki], OC, C, 900 + ki);
        for (int ti = 0; ti < 2; ti++) {
            int T = Ts[ti];
            float *inp = malloc((size_t)T * C * sizeof(float));
            float *out = malloc((size_t)T * OC * sizeof(float));
            float *dout = malloc((size_t)T * OC * sizeof(float));
            float *dinp = malloc((size_t)T * C * sizeof(float));
            tu_fill(inp, (size_t)T * C, 901, -1, 1);
            tu_fill(dout, (size_t)T * OC, 902, -1, 1);
            tu_fill(dinp, (size_t)T * C, 903, -1, 1);
            double *ref = malloc((size_t)T * OC * sizeof(double));
            double *ref_in = malloc((size_t)T * C * sizeof(double));
            for (size_t i = 0; i < (size_t)T * C; i++)
                ref_in[i] = dinp[i];
            double *inp_d = to_double(inp, (size_t)T * C);
            ref_forward(ref, inp_d, w.deq, NULL, T, C, OC);
            for (int t = 0; t < T; t++)
                for (int o = 0; o < OC; o++) {
                    double d = dout[t * OC + o];
                    const double *wr = w.deq + (size_t)o * C;
                    double *dst = ref_in + (size_t)t * C;
                    for (int c = 0; c < C; c++)
                        dst[c] += d * wr[c];
                }
            tu_poison(out, (size_t)T * OC);
            cpu_matmul_forward(out, inp, &w.view, NULL, T, C, OC);
            cpu_matmul_backward(dinp, NULL, NULL, dout, inp, &w.view, T, C, OC);
            char what[96];
            snprintf(what, sizeof what, "forward %s T=%d C=%d", kinds[ki]->name, T, C);
            TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, (size_t)T * OC, 1e-3), TOL_BIG, what);
            snprintf(what, sizeof what, "dinp %s T=%d C=%d", kinds[ki]->name, T, C);
            TU_ASSERT_CLOSE(tu_rel_err_fd(dinp, ref_in, (size_t)T * C, 1e-3), TOL_BIG, what);
            free(inp), free(out), free(dout), free(dinp), free(ref), free(ref_in), free(inp_d);
        }
        tweight_free(&w);
    }
    cpu_scratch_release();
}

/* The fused kernels give the same bits on 1 and on several threads. */
static void test_thread_count_invariance(void) {
    const int T = 4, C = 300, OC = 97;
    tweight_t w;
    tweight_make(&w, &g_kinds[2], OC, C, 55);
    float *inp = malloc(T * C * sizeof(float)), *dout = malloc(T * OC * sizeof(float));
    float *o1 = malloc(T * OC * sizeof(float)), *o2 = malloc(T * OC * sizeof(float));
    float *d1 = calloc(T * C, sizeof(float)), *d2 = calloc(T * C, sizeof(float));
    tu_fill(inp, T * C, 56, -1, 1);
    tu_fill(dout, T * OC, 57, -1, 1);
    int nth = omp_get_max_threads();
    omp_set_num_threads(1);
    cpu_matmul_forward(o1, inp, &w.view, NULL, T, C, OC);
    cpu_matmul_backward(d1, NULL, NULL, dout, inp, &w.view, T, C, OC);
    omp_set_num_threads(nth > 1 ? nth : 3);
    cpu_matmul_forward(o2, inp, &w.view, NULL, T, C, OC);
    cpu_matmul_backward(d2, NULL, NULL, dout, inp, &w.view, T, C, OC);
    omp_set_num_threads(nth);
    CU_ASSERT(memcmp(o1, o2, T * OC * sizeof(float)) == 0);
    CU_ASSERT(memcmp(d1, d2, T * C * sizeof(float)) == 0);
    free(inp), free(dout), free(o1), free(o2), free(d1), free(d2);
    tweight_free(&w);
}

/* Row conversion matches the scalar converters of core/dtype.h on every f16
 * and fp8 bit pattern (NaN for NaN), and applies block scales by block. */
static void test_wview_rows_exhaustive(void) {
    uint16_t *h = malloc(65536 * sizeof(uint16_t));
    uint8_t b[256];
    float *out = malloc(65536 * sizeof(float));
    for (int i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    for (int i = 0; i < 256; i++)
        b[i] = (uint8_t)i;
    int bad = 0;
    wview_t wh = wview_of(h, DT_F16);
    tu_poison(out, 65536);
    cpu_wview_rows_f32(out, &wh, 0, 1, 65536);
    for (int i = 0; i < 65536; i++) {
        float e = f16_to_f32(h[i]);
        if (isnan(e) ? !isnan(out[i]) : memcmp(&e, &out[i], 4) != 0)
            bad++;
    }
    for (int i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    wview_t wb = wview_of(h, DT_BF16);
    cpu_wview_rows_f32(out, &wb, 0, 256, 256);
    for (int i = 0; i < 65536; i++) {
        float e = bf16_to_f32(h[i]);
        if (isnan(e) ? !isnan(out[i]) : memcmp(&e, &out[i], 4) != 0)
            bad++;
    }
    wview_t w8 = wview_of(b, DT_F8E4M3);
    cpu_wview_rows_f32(out, &w8, 0, 16, 16);
    for (int i = 0; i < 256; i++) {
        float e = fp8e4m3_to_f32(b[i]);
        if (isnan(e) ? !isnan(out[i]) : memcmp(&e, &out[i], 4) != 0)
            bad++;
    }
    CU_ASSERT_EQUAL(bad, 0);
    /* Rows 5..10 of a (16, 16) fp8 view with 3x3 blocks (partial last block). */
    float scale[6 * 6];
    tu_fill(scale, 36, 9, 0.5f, 2.0f);
    w8.scale = scale;
    w8.block = 3;
    tu_poison(out, 6 * 16);
    cpu_wview_rows_f32(out, &w8, 5, 6, 16);
    bad = 0;
    for (int r = 5; r < 11; r++)
        for (int c = 0; c < 16; c++) {
            float e = fp8e4m3_to_f32(b[r * 16 + c]) * scale[(r / 3) * 6 + c / 3];
            float g = out[(r - 5) * 16 + c];
            if (isnan(e) ? !isnan(g) : e != g)
                bad++;
        }
    CU_ASSERT_EQUAL(bad, 0);
    free(h);
    free(out);
}

static void test_scratch(void) {
    float *a = cpu_scratch_floats(0, 10);
    float *b = cpu_scratch_floats(1, 1000);
    CU_ASSERT_PTR_NOT_NULL(a);
    CU_ASSERT(((uintptr_t)a % 64) == 0 && ((uintptr_t)b % 64) == 0);
    CU_ASSERT(a != b);
    for (int i = 0; i < 10; i++)
        a[i] = (float)i;
    CU_ASSERT(cpu_scratch_floats(0, 5) == a); /* no shrink, same buffer */
    CU_ASSERT(a[9] == 9.0f);
    CU_ASSERT(cpu_scratch_bytes() >= 1010 * sizeof(float));
    float *c = cpu_scratch_floats(0, 100000);
    c[99999] = 1.0f;
    cpu_scratch_release();
    CU_ASSERT_EQUAL(cpu_scratch_bytes(), 0);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward: all dtypes and shapes vs double reference", test_forward},
        {"backward: finite differences, accumulation", test_backward_fd},
        {"backward: NULL gradient outputs skipped", test_backward_null_outputs},
        {"large C: blocked and chunked paths", test_large_c},
        {"fused kernels: thread-count invariant", test_thread_count_invariance},
        {"wview rows: exhaustive f16/bf16/fp8, block scales", test_wview_rows_exhaustive},
        {"scratch: slots, growth, release", test_scratch},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("matmul", tests);
    cpu_scratch_release();
    return rc;
}
