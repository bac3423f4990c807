/* test_lora: LoRA apply against a double reference, its gradients by finite
 * differences, accumulation, rsLoRA scale, and merged vs unmerged apply. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "lora/lora.h"
#include "tests/testutil.h"

static const kernels_t *K(void) {
    return backend_cpu()->k;
}

/* A small problem: x (T, C), A (R, C), B (OC, R), dy (T, OC), all non-zero. */
typedef struct prob {
    int T, C, OC, R;
    float scale;
    float *x, *A, *B, *dy;
} prob_t;

static prob_t prob_new(int T, int C, int OC, int R, float scale, uint64_t seed) {
    prob_t p = {T, C, OC, R, scale, NULL, NULL, NULL, NULL};
    p.x = malloc(sizeof(float) * T * C);
    p.A = malloc(sizeof(float) * R * C);
    p.B = malloc(sizeof(float) * OC * R);
    p.dy = malloc(sizeof(float) * T * OC);
    tu_fill(p.x, (size_t)T * C, seed, -1.0f, 1.0f);
    tu_fill(p.A, (size_t)R * C, seed + 1, -0.5f, 0.5f);
    tu_fill(p.B, (size_t)OC * R, seed + 2, -0.5f, 0.5f);
    tu_fill(p.dy, (size_t)T * OC, seed + 3, -1.0f, 1.0f);
    return p;
}

static void prob_free(prob_t *p) {
    free(p->x);
    free(p->A);
    free(p->B);
    free(p->dy);
}

static lora_pair_t pair_of(const prob_t *p, float *dA, float *dB) {
    lora_pair_t q = {p->A, p->B, dA, dB, p->R, p->scale};
    return q;
}

/* y (T, OC) = scale * (x A^T) B^T in double, from double inputs. */
static void ref_lora(double *y, const double *x, const double *A, const double *B, int T, int C,
                     int OC, int R, double scale) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = 0;
            for (int r = 0; r < R; r++) {
                double xa = 0;
                for (int c = 0; c < C; c++)
                    xa += x[t * C + c] * A[r * C + c];
                s += xa * B[o * R + r];
            }
            y[t * OC + o] = scale * s;
        }
}

static double *to_d(const float *f, size_t n) {
    double *d = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

static void check_forward(int T, int C, int OC, int R, float scale) {
    prob_t p = prob_new(T, C, OC, R, scale, 11 + T);
    size_t TO = (size_t)T * OC;
    float *y = malloc(sizeof(float) * TO), *xa = malloc(sizeof(float) * T * R);
    double *y0 = malloc(sizeof(double) * TO), *yr = malloc(sizeof(double) * TO);
    double *xa_r = malloc(sizeof(double) * T * R);
    tu_fill(y, TO, 99, -2.0f, 2.0f); /* lora_forward adds to y */
    for (size_t i = 0; i < TO; i++)
        y0[i] = y[i];
    tu_poison(xa, (size_t)T * R);
    lora_pair_t q = pair_of(&p, NULL, NULL);
    lora_forward(K(), y, xa, p.x, &q, T, C, OC);

    double *xd = to_d(p.x, (size_t)T * C), *Ad = to_d(p.A, (size_t)R * C);
    double *Bd = to_d(p.B, (size_t)OC * R);
    ref_lora(yr, xd, Ad, Bd, T, C, OC, R, scale);
    for (size_t i = 0; i < TO; i++)
        yr[i] += y0[i];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            double s = 0;
            for (int c = 0; c < C; c++)
                s += xd[t * C + c] * Ad[r * C + c];
            xa_r[t * R + r] = s;
        }
    TU_ASSERT_CLOSE(tu_rel_err_fd(y, yr, TO, 1e-6), 1e-5, "lora forward y");
    TU_ASSERT_CLOSE(tu_rel_err_fd(xa, xa_r, (size_t)T * R, 1e-6), 1e-5, "lora forward xa");
    free(y), free(xa), free(y0), free(yr), free(xa_r), free(xd), free(Ad), free(Bd);
    prob_free(&p);
}

static void test_forward_matches_double(void) {
    check_forward(5, 12, 7, 3, 2.0f);
    check_forward(37, 40, 24, 4, 0.5f);
    check_forward(1, 64, 96, 16, 1.0f);
}

/* L = sum(dy .* lora(x, A, B)) in double. */
static double loss_d(const double *x, const double *A, const double *B, const double *dy, int T,
                     int C, int OC, int R, double scale) {
    double *y = malloc(sizeof(double) * T * OC), L = 0;
    ref_lora(y, x, A, B, T, C, OC, R, scale);
    for (int i = 0; i < T * OC; i++)
        L += dy[i] * y[i];
    free(y);
    return L;
}

/* Central differences of loss_d with respect to every element of v (n). */
static void fd_grad(double *g, double *v, size_t n, const double *x, const double *A,
                    const double *B, const double *dy, const prob_t *p) {
    const double h = 1e-6;
    for (size_t i = 0; i < n; i++) {
        double keep = v[i];
        v[i] = keep + h;
        double lp = loss_d(x, A, B, dy, p->T, p->C, p->OC, p->R, p->scale);
        v[i] = keep - h;
        double lm = loss_d(x, A, B, dy, p->T, p->C, p->OC, p->R, p->scale);
        v[i] = keep;
        g[i] = (lp - lm) / (2 * h);
    }
}

static void test_backward_finite_differences(void) {
    prob_t p = prob_new(6, 10, 9, 3, 1.75f, 7);
    int T = p.T, C = p.C, OC = p.OC, R = p.R;
    float *xa = malloc(sizeof(float) * T * R), *tmp = malloc(sizeof(float) * T * R);
    float *y = malloc(sizeof(float) * T * OC);
    float *dx = calloc((size_t)T * C, sizeof(float)), *dA = calloc((size_t)R * C, sizeof(float));
    float *dB = calloc((size_t)OC * R, sizeof(float));
    tu_fill(y, (size_t)T * OC, 5, -1.0f, 1.0f);
    tu_poison(xa, (size_t)T * R);
    lora_pair_t q = pair_of(&p, dA, dB);
    lora_forward(K(), y, xa, p.x, &q, T, C, OC);
    tu_poison(tmp, (size_t)T * R);
    lora_backward(K(), dx, p.dy, p.x, xa, &q, T, C, OC, tmp);

    double *xd = to_d(p.x, (size_t)T * C), *Ad = to_d(p.A, (size_t)R * C);
    double *Bd = to_d(p.B, (size_t)OC * R), *dyd = to_d(p.dy, (size_t)T * OC);
    double *g = malloc(sizeof(double) * T * C);
    fd_grad(g, xd, (size_t)T * C, xd, Ad, Bd, dyd, &p);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, g, (size_t)T * C, 1e-6), 1e-5, "dx vs finite differences");
    fd_grad(g, Ad, (size_t)R * C, xd, Ad, Bd, dyd, &p);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dA, g, (size_t)R * C, 1e-6), 1e-5, "dA vs finite differences");
    fd_grad(g, Bd, (size_t)OC * R, xd, Ad, Bd, dyd, &p);
    TU_ASSERT_CLOSE(tu_rel_err_fd(dB, g, (size_t)OC * R, 1e-6), 1e-5, "dB vs finite differences");
    free(xa), free(tmp), free(y), free(dx), free(dA), free(dB);
    free(xd), free(Ad), free(Bd), free(dyd), free(g);
    prob_free(&p);
}

/* Backward adds to what the gradients hold and skips NULL outputs. */
static void test_backward_accumulates(void) {
    prob_t p = prob_new(8, 16, 12, 4, 0.5f, 21);
    int T = p.T, C = p.C, OC = p.OC, R = p.R;
    size_t nx = (size_t)T * C, na = (size_t)R * C, nb = (size_t)OC * R;
    float *xa = malloc(sizeof(float) * T * R), *tmp = malloc(sizeof(float) * T * R);
    float *y = calloc((size_t)T * OC, sizeof(float));
    float *dx1 = calloc(nx, 4), *dA1 = calloc(na, 4), *dB1 = calloc(nb, 4);
    float *dx2 = malloc(nx * 4), *dA2 = malloc(na * 4), *dB2 = malloc(nb * 4);
    float *dx0 = malloc(nx * 4), *dA0 = malloc(na * 4), *dB0 = malloc(nb * 4);
    lora_pair_t q1 = pair_of(&p, dA1, dB1);
    lora_forward(K(), y, xa, p.x, &q1, T, C, OC);
    lora_backward(K(), dx1, p.dy, p.x, xa, &q1, T, C, OC, tmp); /* one pass from zero */

    tu_fill(dx0, nx, 31, -1.0f, 1.0f);
    tu_fill(dA0, na, 32, -1.0f, 1.0f);
    tu_fill(dB0, nb, 33, -1.0f, 1.0f);
    memcpy(dx2, dx0, nx * 4), memcpy(dA2, dA0, na * 4), memcpy(dB2, dB0, nb * 4);
    lora_pair_t q2 = pair_of(&p, dA2, dB2);
    lora_backward(K(), dx2, p.dy, p.x, xa, &q2, T, C, OC, tmp);
    lora_backward(K(), dx2, p.dy, p.x, xa, &q2, T, C, OC, tmp);
    double *e = malloc(sizeof(double) * nx);
    for (size_t i = 0; i < nx; i++)
        e[i] = (double)dx0[i] + 2.0 * dx1[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx2, e, nx, 1e-6), 1e-6, "dx accumulates");
    for (size_t i = 0; i < na; i++)
        e[i] = (double)dA0[i] + 2.0 * dA1[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dA2, e, na, 1e-6), 1e-6, "dA accumulates");
    for (size_t i = 0; i < nb; i++)
        e[i] = (double)dB0[i] + 2.0 * dB1[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dB2, e, nb, 1e-6), 1e-6, "dB accumulates");

    /* NULL outputs are skipped; the others still get exactly one pass. */
    memcpy(dA2, dA0, na * 4);
    lora_pair_t q3 = pair_of(&p, dA2, NULL);
    lora_backward(K(), NULL, p.dy, p.x, xa, &q3, T, C, OC, tmp);
    for (size_t i = 0; i < na; i++)
        e[i] = (double)dA0[i] + dA1[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dA2, e, na, 1e-6), 1e-6, "dA alone");
    memcpy(dB2, dB0, nb * 4);
    lora_pair_t q4 = pair_of(&p, NULL, dB2);
    lora_backward(K(), NULL, p.dy, p.x, xa, &q4, T, C, OC, tmp);
    for (size_t i = 0; i < nb; i++)
        e[i] = (double)dB0[i] + dB1[i];
    TU_ASSERT_CLOSE(tu_rel_err_fd(dB2, e, nb, 1e-6), 1e-6, "dB alone");
    free(xa), free(tmp), free(y), free(dx1), free(dA1), free(dB1), free(dx2), free(dA2);
    free(dB2), free(dx0), free(dA0), free(dB0), free(e);
    prob_free(&p);
}

/* The adapter's scale is alpha / R, or alpha / sqrt(R) with rsLoRA, and
 * the forward uses it. */
static void test_rslora_scale(void) {
    const char *tg[] = {"q_proj"};
    lora_module_desc_t m = {"model.layers.0.self_attn.q_proj", "q_proj", LORA_KIND_ATTENTION, 24,
                            20};
    lora_config_t cfg = {.rank = 16, .alpha = 32.0f, .seed = 3, .targets = tg, .n_targets = 1};
    lora_adapter_t *plain = NULL, *rs = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&plain, &cfg, &m, 1), 0);
    cfg.rslora = 1;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&rs, &cfg, &m, 1), 0);
    CU_ASSERT_EQUAL(plain->scale, 2.0f);
    CU_ASSERT_EQUAL(rs->scale, 8.0f);

    int T = 3, C = 24, OC = 20, R = 16;
    lora_pair_t q = lora_adapter_pair(rs, 0, 0);
    tu_fill(q.B, (size_t)OC * R, 8, -0.1f, 0.1f); /* B starts at 0; make it count */
    float x[3 * 24], y[3 * 20], xa[3 * 16];
    tu_fill(x, sizeof x / 4, 9, -1.0f, 1.0f);
    memset(y, 0, sizeof y);
    lora_forward(K(), y, xa, x, &q, T, C, OC);
    double *xd = to_d(x, sizeof x / 4), *Ad = to_d(q.A, (size_t)R * C),
           *Bd = to_d(q.B, (size_t)OC * R);
    double yr[3 * 20];
    ref_lora(yr, xd, Ad, Bd, T, C, OC, R, 32.0 / 4.0);
    TU_ASSERT_CLOSE(tu_rel_err_fd(y, yr, sizeof y / 4, 1e-6), 1e-5, "rsLoRA forward");
    free(xd), free(Ad), free(Bd);
    lora_adapter_destroy(&plain);
    lora_adapter_destroy(&rs);
    CU_ASSERT_PTR_NULL(plain);
}

/* d (OC, C) = scale * B A in double. */
static void delta_d(double *d, const prob_t *p) {
    for (int o = 0; o < p->OC; o++)
        for (int c = 0; c < p->C; c++) {
            double s = 0;
            for (int r = 0; r < p->R; r++)
                s += (double)p->B[o * p->R + r] * p->A[r * p->C + c];
            d[o * p->C + c] = p->scale * s;
        }
}

/* |scale| sum_r |B_or A_rc|: the magnitude that bounds the product's error. */
static double delta_abs(const prob_t *p, int o, int c) {
    double s = 0;
    for (int r = 0; r < p->R; r++)
        s += fabs((double)p->B[o * p->R + r] * p->A[r * p->C + c]);
    return fabs(p->scale) * s;
}

static void test_merge_f32(void) {
    prob_t p = prob_new(9, 48, 40, 8, 1.5f, 41);
    int T = p.T, C = p.C, OC = p.OC;
    size_t nw = (size_t)OC * C, ny = (size_t)T * OC;
    float *W = malloc(nw * 4), *Wm = malloc(nw * 4), *y1 = malloc(ny * 4), *y2 = malloc(ny * 4);
    float *xa = malloc(sizeof(float) * T * p.R);
    double *d = malloc(nw * sizeof(double));
    tu_fill(W, nw, 42, -1.0f, 1.0f);
    memcpy(Wm, W, nw * 4);
    lora_pair_t q = pair_of(&p, NULL, NULL);
    CU_ASSERT_EQUAL_FATAL(lora_merge(K(), Wm, DT_F32, &q, C, OC), 0);
    delta_d(d, &p);
    int bad = 0;
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)o * C + c;
            double tol = 0x1p-20 * (fabs(W[i]) + delta_abs(&p, o, c));
            bad += !(fabs(Wm[i] - (W[i] + d[i])) <= tol);
        }
    CU_ASSERT_EQUAL(bad, 0);

    /* unmerged: y1 = x W^T + lora; merged: y2 = x W'^T */
    wview_t w = wview_f32(W), wm = wview_f32(Wm);
    tu_poison(y1, ny), tu_poison(y2, ny), tu_poison(xa, (size_t)T * p.R);
    K()->matmul_forward(y1, p.x, &w, NULL, T, C, OC);
    lora_forward(K(), y1, xa, p.x, &q, T, C, OC);
    K()->matmul_forward(y2, p.x, &wm, NULL, T, C, OC);
    TU_ASSERT_CLOSE(tu_rel_err_ff(y2, y1, ny, 1e-6), 1e-5, "merged vs unmerged forward (f32)");

    CU_ASSERT_EQUAL_FATAL(lora_unmerge(K(), Wm, DT_F32, &q, C, OC), 0);
    bad = 0;
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)o * C + c;
            double tol = 0x1p-19 * (fabs(W[i]) + delta_abs(&p, o, c));
            bad += !(fabs(Wm[i] - W[i]) <= tol);
        }
    CU_ASSERT_EQUAL(bad, 0);
    free(W), free(Wm), free(y1), free(y2), free(xa), free(d);
    prob_free(&p);
}

/* bf16 and f16 copies: one rounding of the f32 sum, merged forward equal to
 * the product with those rounded weights, unmerge back within two roundings. */
static void check_merge_low(dtype_t dt, double u) {
    prob_t p = prob_new(7, 40, 24, 4, 2.0f, 51);
    int T = p.T, C = p.C, OC = p.OC;
    size_t nw = (size_t)OC * C, ny = (size_t)T * OC;
    float *Wf = malloc(nw * 4), *Wr = malloc(nw * 4), *y = malloc(ny * 4);
    uint16_t *W = malloc(nw * 2), *Wm = malloc(nw * 2);
    double *d = malloc(nw * sizeof(double)), *yr = malloc(ny * sizeof(double));
    tu_fill(Wf, nw, 52, -1.0f, 1.0f);
    convert_from_f32(W, dt, Wf, nw);
    convert_to_f32(Wf, W, dt, nw); /* the exact base values */
    memcpy(Wm, W, nw * 2);
    lora_pair_t q = pair_of(&p, NULL, NULL);
    CU_ASSERT_EQUAL_FATAL(lora_merge(K(), Wm, dt, &q, C, OC), 0);
    convert_to_f32(Wr, Wm, dt, nw);
    delta_d(d, &p);
    int bad = 0;
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)o * C + c;
            double exact = Wf[i] + d[i];
            double tol = u * fabs(exact) + 0x1p-21 * (fabs(Wf[i]) + delta_abs(&p, o, c)) + 1e-30;
            bad += !(fabs(Wr[i] - exact) <= tol);
        }
    CU_ASSERT_EQUAL(bad, 0);

    /* merged forward = x (rounded W')^T */
    wview_t wm = wview_of(Wm, dt);
    tu_poison(y, ny);
    K()->matmul_forward(y, p.x, &wm, NULL, T, C, OC);
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = 0;
            for (int c = 0; c < C; c++)
                s += (double)p.x[t * C + c] * Wr[o * C + c];
            yr[t * OC + o] = s;
        }
    TU_ASSERT_CLOSE(tu_rel_err_fd(y, yr, ny, 1e-6), 1e-5, "merged low-precision forward");

    CU_ASSERT_EQUAL_FATAL(lora_unmerge(K(), Wm, dt, &q, C, OC), 0);
    convert_to_f32(Wr, Wm, dt, nw);
    bad = 0;
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)o * C + c;
            double tol = 2 * u * (fabs(Wf[i]) + fabs(d[i])) * 1.01 + 1e-30;
            bad += !(fabs(Wr[i] - Wf[i]) <= tol);
        }
    CU_ASSERT_EQUAL(bad, 0);
    free(Wf), free(Wr), free(y), free(W), free(Wm), free(d), free(yr);
    prob_free(&p);
}

static void test_merge_bf16_f16(void) {
    check_merge_low(DT_BF16, 0x1p-8); /* half a bf16 ulp, relative (8-bit significand) */
    check_merge_low(DT_F16, 0x1p-11); /* 11-bit significand */
}

static void test_merge_rejects_fp8(void) {
    prob_t p = prob_new(2, 8, 8, 2, 1.0f, 61);
    uint8_t w[64];
    memset(w, 0x38, sizeof w);
    lora_pair_t q = pair_of(&p, NULL, NULL);
    CU_ASSERT_EQUAL(lora_merge(K(), w, DT_F8E4M3, &q, 8, 8), MO_EUNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "F8_E4M3"));
    prob_free(&p);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward matches double", test_forward_matches_double},
        {"backward finite differences", test_backward_finite_differences},
        {"backward accumulates", test_backward_accumulates},
        {"rsLoRA scale", test_rslora_scale},
        {"merge f32", test_merge_f32},
        {"merge bf16 f16", test_merge_bf16_f16},
        {"merge rejects fp8", test_merge_rejects_fp8},
        CU_TEST_INFO_NULL,
    };
    return tu_main("lora", tests);
}
