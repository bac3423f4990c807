/* Tests for the CPU AdamW step: a few steps against a double reference of
 * torch.optim.AdamW's algorithm and against values PyTorch itself printed. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

/* Normalised tolerance against the double reference (f32 state over a few
 * steps), and element-wise relative tolerance against PyTorch's f32 run
 * (which orders its f32 operations slightly differently). */
#define TOL_REF 2e-6
#define TOL_TORCH 2e-6

/* torch.optim.AdamW.step for one tensor, in double:
 *   p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
 *   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). */
static void ref_adamw(double *p, const double *g, double *m, double *v, size_t n, double lr,
                      double b1, double b2, double eps, double wd, int step) {
    double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
    for (size_t i = 0; i < n; i++) {
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + eps);
    }
}

typedef struct {
    float lr, b1, b2, eps, wd;
    int steps;
} hp_t;

static void check_reference(size_t n, hp_t h, uint64_t seed) {
    float *p = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float));
    float *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
    double *pd = malloc(n * sizeof(double)), *gd = malloc(n * sizeof(double));
    double *md = calloc(n, sizeof(double)), *vd = calloc(n, sizeof(double));
    tu_fill(p, n, seed, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++)
        pd[i] = p[i];
    for (int step = 1; step <= h.steps; step++) {
        /* gradients of varying scale and sign from step to step */
        tu_fill(g, n, seed + 100 + step, -1.0f, 1.0f);
        for (size_t i = 0; i < n; i++) {
            g[i] *= (float)(1 + (i + step) % 5) * 0.3f;
            gd[i] = g[i];
        }
        cpu_adamw_update(p, g, m, v, n, h.lr, h.b1, h.b2, h.eps, h.wd, step);
        ref_adamw(pd, gd, md, vd, n, h.lr, h.b1, h.b2, h.eps, h.wd, step);
    }
    char what[96];
    snprintf(what, sizeof what, "param n=%zu lr=%g wd=%g steps=%d", n, h.lr, h.wd, h.steps);
    TU_ASSERT_CLOSE(tu_rel_err_fd(p, pd, n, 1e-3), TOL_REF, what);
    snprintf(what, sizeof what, "m n=%zu steps=%d", n, h.steps);
    TU_ASSERT_CLOSE(tu_rel_err_fd(m, md, n, 1e-3), TOL_REF, what);
    snprintf(what, sizeof what, "v n=%zu steps=%d", n, h.steps);
    TU_ASSERT_CLOSE(tu_rel_err_fd(v, vd, n, 1e-6), TOL_REF, what);
    free(p), free(g), free(m), free(v), free(pd), free(gd), free(md), free(vd);
}

static void test_reference(void) {
    const hp_t hps[] = {
        {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 5},
        {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 3},
        {3e-4f, 0.8f, 0.99f, 1e-6f, 0.0f, 7},
    };
    const size_t sizes[] = {1, 13, 100003}; /* the last runs on several threads */
    for (size_t k = 0; k < sizeof hps / sizeof hps[0]; k++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            check_reference(sizes[s], hps[k], 10 * k + s);
}

/* torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
 * PyTorch 1.13 float32, three steps from p0 with these gradients. */
static void test_torch_values(void) {
    enum { N = 6 };
    float p[N] = {0.5f, -1.25f, 2.0f, -0.03125f, 1e-3f, 0.75f};
    const float grads[3][N] = {
        {0.1f, -0.2f, 0.3f, 1e-4f, 0.0f, -5.0f},
        {0.05f, 0.2f, -0.3f, 2e-4f, 0.0f, 4.0f},
        {-0.1f, 0.25f, 0.3f, -1e-4f, 0.0f, 3.0f},
    };
    const double after[3][N] = {
        {4.895000160e-01, -1.238749981e+00, 1.988000035e+00, -4.121775180e-02, 9.990000399e-04,
         7.592499852e-01},
        {4.796175957e-01, -1.238037586e+00, 1.986538410e+00, -5.075579137e-02, 9.980010800e-04,
         7.590736151e-01},
        {4.780303240e-01, -1.241318703e+00, 1.981194019e+00, -5.490655452e-02, 9.970030515e-04,
         7.559905648e-01},
    };
    const double m_end[N] = {
        2.599999774e-03, 2.679999918e-02, 2.730000019e-02, 1.609999890e-05, 0.0, 2.550000250e-01};
    const double v_end[N] = {
        1.070000115e-03, 6.830000319e-03, 1.283625141e-02, 2.851249903e-09, 0.0, 2.338124990e+00};
    float m[N] = {0}, v[N] = {0};
    for (int s = 0; s < 3; s++) {
        cpu_adamw_update(p, grads[s], m, v, N, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, s + 1);
        for (int i = 0; i < N; i++) {
            double e = fabs(p[i] - after[s][i]) / fabs(after[s][i]);
            if (!(e <= TOL_TORCH))
                tu_report("step %d param %d: %.9g vs torch %.9g", s + 1, i, p[i], after[s][i]);
            CU_ASSERT(e <= TOL_TORCH);
        }
    }
    for (int i = 0; i < N; i++) {
        CU_ASSERT(fabs(m[i] - m_end[i]) <= TOL_TORCH * fabs(m_end[i]));
        CU_ASSERT(fabs(v[i] - v_end[i]) <= TOL_TORCH * fabs(v_end[i]));
    }
}

/* Step 1 from zero moments moves each weight by lr * sign(g) (|g| >> eps),
 * after the decoupled decay. */
static void test_first_step(void) {
    enum { N = 5 };
    float p[N] = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f};
    const float g[N] = {0.3f, -7.0f, 1e-3f, -0.02f, 42.0f};
    float m[N] = {0}, v[N] = {0};
    const float lr = 0.05f, wd = 0.2f;
    float p0[N];
    memcpy(p0, p, sizeof p);
    cpu_adamw_update(p, g, m, v, N, lr, 0.9f, 0.999f, 1e-8f, wd, 1);
    for (int i = 0; i < N; i++) {
        double expect = p0[i] * (1.0 - lr * wd) - lr * (g[i] > 0 ? 1.0 : -1.0);
        CU_ASSERT(fabs(p[i] - expect) < 1e-5);
    }
}

int main(void) {
    CU_TestInfo tests[] = {
        {"steps vs double reference", test_reference},
        {"three steps vs PyTorch values", test_torch_values},
        {"first step moves by lr", test_first_step},
        CU_TEST_INFO_NULL,
    };
    return tu_main("adamw", tests);
}
