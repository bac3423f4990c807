/* Tests for moe/mlp: the SwiGLU block against a double-precision reference, f32 and bf16
 * base weights, with and without LoRA; finite-difference gradients of the input and of
 * every adapter; accumulation and determinism. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/status.h"
#include "moe/mlp.h"
#include "tests/testutil.h"

enum { T = 5, D = 12, F = 10 };
static const int RANK[3] = {3, 2, 4}; /* gate, up, down */

/* One block's parameters: f32 masters, the stored base (f32 or bf16), adapters. */
typedef struct fixture {
    dtype_t dt;
    int adapted;
    float wg[F * D], wu[F * D], wd[D * F];    /* values as stored, in f32 */
    uint16_t bg[F * D], bu[F * D], bd[D * F]; /* bf16 storage */
    float A[3][64], B[3][64];                 /* (R, C) and (OC, R) of gate, up, down */
    float dA[3][64], dB[3][64];
    lora_pair_t lp[3];
    mlp_weights_t w;
} fixture_t;

static void fixture_init(fixture_t *f, dtype_t dt, int adapted, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->dt = dt;
    f->adapted = adapted;
    tu_fill(f->wg, F * D, seed, -0.3f, 0.3f);
    tu_fill(f->wu, F * D, seed + 1, -0.3f, 0.3f);
    tu_fill(f->wd, D * F, seed + 2, -0.3f, 0.3f);
    if (dt == DT_BF16) {
        convert_from_f32(f->bg, DT_BF16, f->wg, F * D);
        convert_from_f32(f->bu, DT_BF16, f->wu, F * D);
        convert_from_f32(f->bd, DT_BF16, f->wd, D * F);
        convert_to_f32(f->wg, f->bg, DT_BF16, F * D);
        convert_to_f32(f->wu, f->bu, DT_BF16, F * D);
        convert_to_f32(f->wd, f->bd, DT_BF16, D * F);
        f->w.gate = wview_of(f->bg, DT_BF16);
        f->w.up = wview_of(f->bu, DT_BF16);
        f->w.down = wview_of(f->bd, DT_BF16);
    } else {
        f->w.gate = wview_f32(f->wg);
        f->w.up = wview_f32(f->wu);
        f->w.down = wview_f32(f->wd);
    }
    const int C[3] = {D, D, F}, OC[3] = {F, F, D};
    for (int j = 0; j < 3; j++) {
        tu_fill(f->A[j], (size_t)RANK[j] * C[j], seed + 10 + j, -0.4f, 0.4f);
        tu_fill(f->B[j], (size_t)OC[j] * RANK[j], seed + 20 + j, -0.4f, 0.4f);
        f->lp[j] = (lora_pair_t){f->A[j], f->B[j], f->dA[j], f->dB[j], RANK[j], 0.75f};
    }
    if (adapted) {
        f->w.lora_gate = &f->lp[0];
        f->w.lora_up = &f->lp[1];
        f->w.lora_down = &f->lp[2];
    }
}

/* ---- double reference ---------------------------------------------------------------- */

/* out (OC) = W in (C) + scale B (A in) when p is given. */
static void ref_proj(double *out, const double *in, const float *W, const lora_pair_t *p,
                     const double *A, const double *B, int C, int OC) {
    for (int o = 0; o < OC; o++) {
        double acc = 0;
        for (int c = 0; c < C; c++)
            acc += (double)W[o * C + c] * in[c];
        out[o] = acc;
    }
    if (!p)
        return;
    double xa[8];
    for (int r = 0; r < p->R; r++) {
        xa[r] = 0;
        for (int c = 0; c < C; c++)
            xa[r] += A[r * C + c] * in[c];
    }
    for (int o = 0; o < OC; o++)
        for (int r = 0; r < p->R; r++)
            out[o] += (double)p->scale * B[o * p->R + r] * xa[r];
}

/* Adapter parameters in double, so finite differences can nudge them. */
typedef struct dparams {
    double A[3][64], B[3][64];
} dparams_t;

static void dparams_of(dparams_t *q, const fixture_t *f) {
    const int C[3] = {D, D, F}, OC[3] = {F, F, D};
    for (int j = 0; j < 3; j++) {
        for (int i = 0; i < RANK[j] * C[j]; i++)
            q->A[j][i] = f->A[j][i];
        for (int i = 0; i < OC[j] * RANK[j]; i++)
            q->B[j][i] = f->B[j][i];
    }
}

static void ref_mlp(double *y, const double *x, const fixture_t *f, const dparams_t *q) {
    for (int t = 0; t < T; t++) {
        double g[F], u[F], h[F];
        ref_proj(g, x + t * D, f->wg, f->w.lora_gate, q->A[0], q->B[0], D, F);
        ref_proj(u, x + t * D, f->wu, f->w.lora_up, q->A[1], q->B[1], D, F);
        for (int i = 0; i < F; i++)
            h[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        ref_proj(y + t * D, h, f->wd, f->w.lora_down, q->A[2], q->B[2], F, D);
    }
}

static double ref_loss(const double *x, const fixture_t *f, const dparams_t *q, const float *dy) {
    double y[T * D], L = 0;
    ref_mlp(y, x, f, q);
    for (int i = 0; i < T * D; i++)
        L += dy[i] * y[i];
    return L;
}

/* ---- tests --------------------------------------------------------------------------- */

static void run_forward(fixture_t *f, arena_t *ar, mlp_acts_t *a, float *y, const float *x) {
    CU_ASSERT_EQUAL_FATAL(mlp_acts_alloc(a, ar, &f->w, T, F), 0);
    tu_poison(a->g, T * F);
    tu_poison(a->u, T * F);
    tu_poison(a->h, T * F);
    tu_poison(y, T * D);
    mlp_forward(backend_cpu()->k, y, a, x, &f->w, T, D, F);
}

static void check_forward(dtype_t dt, int adapted, const char *what) {
    fixture_t *f = malloc(sizeof *f);
    fixture_init(f, dt, adapted, 100 + dt * 7 + adapted);
    float x[T * D], y[T * D];
    double xd[T * D], yd[T * D];
    tu_fill(x, T * D, 5, -1, 1);
    for (int i = 0; i < T * D; i++)
        xd[i] = x[i];
    arena_t ar;
    arena_init(&ar, 0);
    mlp_acts_t a;
    run_forward(f, &ar, &a, y, x);
    dparams_t q;
    dparams_of(&q, f);
    ref_mlp(yd, xd, f, &q);
    TU_ASSERT_CLOSE(tu_rel_err_fd(y, yd, T * D, 1e-3), 1e-5, what);
    CU_ASSERT_EQUAL(a.xa_gate != NULL, adapted);
    CU_ASSERT_EQUAL(a.xa_down != NULL, adapted);
    arena_free(&ar);
    free(f);
}

static void test_forward(void) {
    check_forward(DT_F32, 0, "forward f32");
    check_forward(DT_F32, 1, "forward f32 + LoRA");
    check_forward(DT_BF16, 0, "forward bf16");
    check_forward(DT_BF16, 1, "forward bf16 + LoRA");
}

static void check_backward(dtype_t dt, const char *what) {
    fixture_t *f = malloc(sizeof *f);
    fixture_init(f, dt, 1, 200 + dt);
    float x[T * D], y[T * D], dy[T * D], dx[T * D], pre[T * D];
    double xd[T * D], fd[T * D];
    tu_fill(x, T * D, 6, -1, 1);
    tu_fill(dy, T * D, 7, -1, 1);
    tu_fill(pre, T * D, 8, -1, 1);
    for (int i = 0; i < T * D; i++)
        xd[i] = x[i];
    arena_t ar;
    arena_init(&ar, 0);
    mlp_acts_t a;
    run_forward(f, &ar, &a, y, x);

    /* Gradients accumulate onto what is already there. */
    const int C[3] = {D, D, F}, OC[3] = {F, F, D};
    for (int j = 0; j < 3; j++) {
        tu_fill(f->dA[j], (size_t)RANK[j] * C[j], 300 + j, -1, 1);
        tu_fill(f->dB[j], (size_t)OC[j] * RANK[j], 310 + j, -1, 1);
    }
    fixture_t *pre_f = malloc(sizeof *pre_f);
    memcpy(pre_f, f, sizeof *f);
    memcpy(dx, pre, sizeof dx);
    size_t ns = mlp_backward_scratch_floats(&f->w, T, F);
    CU_ASSERT_EQUAL(ns, (size_t)T * (3 * F + 4));
    float *scratch = malloc(sizeof(float) * ns);
    tu_poison(scratch, ns);
    mlp_backward(backend_cpu()->k, dx, dy, x, &a, &f->w, T, D, F, scratch);
    for (int i = 0; i < T * D; i++)
        dx[i] -= pre[i];

    dparams_t q;
    dparams_of(&q, f);
    const double h = 1e-5;
    for (int i = 0; i < T * D; i++) {
        double x0 = xd[i];
        xd[i] = x0 + h;
        double up = ref_loss(xd, f, &q, dy);
        xd[i] = x0 - h;
        double dn = ref_loss(xd, f, &q, dy);
        xd[i] = x0;
        fd[i] = (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, fd, T * D, 1e-2), 2e-5, what);

    for (int j = 0; j < 3; j++) {
        for (int which = 0; which < 2; which++) {
            double *P = which ? q.B[j] : q.A[j];
            int n = which ? OC[j] * RANK[j] : RANK[j] * C[j];
            float *got = which ? f->dB[j] : f->dA[j];
            const float *was = which ? pre_f->dB[j] : pre_f->dA[j];
            float g[64];
            double fdp[64];
            for (int i = 0; i < n; i++) {
                g[i] = got[i] - was[i];
                double p0 = P[i];
                P[i] = p0 + h;
                double up = ref_loss(xd, f, &q, dy);
                P[i] = p0 - h;
                double dn = ref_loss(xd, f, &q, dy);
                P[i] = p0;
                fdp[i] = (up - dn) / (2 * h);
            }
            TU_ASSERT_CLOSE(tu_rel_err_fd(g, fdp, (size_t)n, 1e-2), 2e-5, which ? "dB" : "dA");
        }
    }
    free(scratch);
    free(pre_f);
    arena_free(&ar);
    free(f);
}

static void test_backward(void) {
    check_backward(DT_F32, "backward f32 dx");
    check_backward(DT_BF16, "backward bf16 dx");
}

/* Without adapters and without dx nothing is written; with dx only the input gradient. */
static void test_backward_plain(void) {
    fixture_t *f = malloc(sizeof *f);
    fixture_init(f, DT_F32, 0, 400);
    float x[T * D], y[T * D], dy[T * D], dx[T * D];
    double xd[T * D], fd[T * D];
    tu_fill(x, T * D, 9, -1, 1);
    tu_fill(dy, T * D, 10, -1, 1);
    for (int i = 0; i < T * D; i++)
        xd[i] = x[i];
    arena_t ar;
    arena_init(&ar, 0);
    mlp_acts_t a;
    run_forward(f, &ar, &a, y, x);
    size_t ns = mlp_backward_scratch_floats(&f->w, T, F);
    CU_ASSERT_EQUAL(ns, (size_t)T * 3 * F);
    float *scratch = malloc(sizeof(float) * ns);
    memset(dx, 0, sizeof dx);
    mlp_backward(backend_cpu()->k, dx, dy, x, &a, &f->w, T, D, F, scratch);
    dparams_t q;
    dparams_of(&q, f);
    const double h = 1e-5;
    for (int i = 0; i < T * D; i++) {
        double x0 = xd[i];
        xd[i] = x0 + h;
        double up = ref_loss(xd, f, &q, dy);
        xd[i] = x0 - h;
        double dn = ref_loss(xd, f, &q, dy);
        xd[i] = x0;
        fd[i] = (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, fd, T * D, 1e-2), 2e-5, "dx without adapters");
    free(scratch);
    arena_free(&ar);
    free(f);
}

static void test_zero_rows(void) {
    fixture_t *f = malloc(sizeof *f);
    fixture_init(f, DT_F32, 1, 500);
    float y[D];
    tu_poison(y, D);
    mlp_acts_t a;
    memset(&a, 0, sizeof a);
    mlp_forward(backend_cpu()->k, y, &a, NULL, &f->w, 0, D, F);
    CU_ASSERT(isnan(y[0])); /* untouched */
    mlp_backward(backend_cpu()->k, NULL, NULL, NULL, &a, &f->w, 0, D, F, NULL);
    CU_ASSERT_EQUAL(mlp_backward_scratch_floats(&f->w, 0, F), 0);
    free(f);
}

static void test_deterministic(void) {
    fixture_t *f = malloc(sizeof *f);
    fixture_init(f, DT_BF16, 1, 600);
    float x[T * D], y1[T * D], y2[T * D], dy[T * D], dx1[T * D], dx2[T * D];
    tu_fill(x, T * D, 11, -1, 1);
    tu_fill(dy, T * D, 12, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    mlp_acts_t a1, a2;
    float *scratch = malloc(sizeof(float) * mlp_backward_scratch_floats(&f->w, T, F));
    float dA1[64], dA2[64];
    run_forward(f, &ar, &a1, y1, x);
    memset(dx1, 0, sizeof dx1);
    memset(f->dA[0], 0, sizeof f->dA[0]);
    mlp_backward(backend_cpu()->k, dx1, dy, x, &a1, &f->w, T, D, F, scratch);
    memcpy(dA1, f->dA[0], sizeof dA1);
    run_forward(f, &ar, &a2, y2, x);
    memset(dx2, 0, sizeof dx2);
    memset(f->dA[0], 0, sizeof f->dA[0]);
    mlp_backward(backend_cpu()->k, dx2, dy, x, &a2, &f->w, T, D, F, scratch);
    memcpy(dA2, f->dA[0], sizeof dA2);
    CU_ASSERT(memcmp(y1, y2, sizeof y1) == 0);
    CU_ASSERT(memcmp(dx1, dx2, sizeof dx1) == 0);
    CU_ASSERT(memcmp(dA1, dA2, sizeof dA1) == 0);
    free(scratch);
    arena_free(&ar);
    free(f);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"forward vs reference (f32, bf16, LoRA)", test_forward},
        {"backward dx, dA, dB (finite differences)", test_backward},
        {"backward without adapters", test_backward_plain},
        {"zero rows", test_zero_rows},
        {"deterministic", test_deterministic},
        CU_TEST_INFO_NULL,
    };
    return tu_main("mlp", tests);
}
