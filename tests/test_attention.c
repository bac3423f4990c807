/* Tests of the CPU attention kernel: forward against a double-precision
 * reference, backward against finite differences and an analytic double
 * reference, accumulation, NULL gradients, and thread-count independence. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "tests/testutil.h"

/* Normalised error bounds: float kernel against a double reference. */
#define TOL_FWD 2e-6
#define TOL_GRAD 1e-5
/* The analytic double reference against central differences in double. */
#define TOL_REF 1e-7
#define FD_EPS 1e-5

typedef struct acase {
    const char *name;
    int B;
    int32_t cu[8]; /* (B + 1) */
    int H, Hkv, Dh, window;
    float scale;
} acase_t;

static const acase_t FD_CASES[] = {
    {"mha single", 1, {0, 9}, 2, 2, 5, 0, 0.6f},
    {"gqa varlen window", 3, {0, 6, 7, 11}, 8, 2, 3, 3, 0.8f},
    {"gqa varlen", 3, {0, 5, 6, 14}, 8, 2, 4, 0, 0.7f},
    {"mqa varlen", 3, {0, 1, 8, 13}, 3, 1, 4, 0, 0.7f},
    {"mha window", 1, {0, 10}, 2, 2, 7, 4, 0.5f},
    {"mqa multiblock window", 2, {0, 40, 75}, 2, 1, 3, 35, 0.9f},
};

static const acase_t BIG_CASES[] = {
    {"gqa 70/1/45", 3, {0, 70, 71, 116}, 4, 2, 16, 0, 0.25f},
    {"gqa 70/1/45 window 40", 3, {0, 70, 71, 116}, 4, 2, 16, 40, 0.25f},
    {"mqa 100 window 33 Dh 67", 1, {0, 100}, 2, 1, 67, 33, 0.12f},
    {"mha 64/33 window 32", 2, {0, 64, 97}, 4, 4, 8, 32, 0.35f},
    {"mha 1/1/1", 3, {0, 1, 2, 3}, 2, 2, 6, 0, 0.4f},
    /* Whole micro-tiles, query chunks of the dk/dv pass, bands cut by a window. */
    {"gqa 300/45 Dh 64", 2, {0, 300, 345}, 4, 2, 64, 0, 0.125f},
    {"gqa 300/45 Dh 64 window 150", 2, {0, 300, 345}, 4, 2, 64, 150, 0.125f},
    {"mqa 261 Dh 32 window 17", 1, {0, 261}, 3, 1, 32, 17, 0.2f},
};

static int ntok(const acase_t *c) {
    return c->cu[c->B];
}

static int sees(const acase_t *c, int i, int j) {
    return j <= i && (c->window <= 0 || i - j < c->window);
}

/* Softmax probabilities p (T) of query i, head h over keys s0 .. i; returns lse. */
static double ref_probs(double *p, const double *q, const double *k, const acase_t *c, int s0,
                        int i, int h) {
    int Dh = c->Dh, kvh = h / (c->H / c->Hkv);
    double m = -INFINITY;
    for (int j = s0; j <= i; j++) {
        if (!sees(c, i, j))
            continue;
        double s = 0;
        for (int d = 0; d < Dh; d++)
            s += q[((size_t)i * c->H + h) * Dh + d] * k[((size_t)j * c->Hkv + kvh) * Dh + d];
        p[j] = s * c->scale;
        if (p[j] > m)
            m = p[j];
    }
    double sum = 0;
    for (int j = s0; j <= i; j++)
        if (sees(c, i, j))
            sum += exp(p[j] - m);
    for (int j = s0; j <= i; j++)
        p[j] = sees(c, i, j) ? exp(p[j] - m) / sum : 0.0;
    return m + log(sum);
}

static void ref_forward(double *out, double *lse, const double *q, const double *k, const double *v,
                        const acase_t *c) {
    int T = ntok(c), Dh = c->Dh, G = c->H / c->Hkv;
    double *p = malloc(sizeof(double) * T);
    for (int b = 0; b < c->B; b++)
        for (int i = c->cu[b]; i < c->cu[b + 1]; i++)
            for (int h = 0; h < c->H; h++) {
                lse[(size_t)i * c->H + h] = ref_probs(p, q, k, c, c->cu[b], i, h);
                double *o = out + ((size_t)i * c->H + h) * Dh;
                for (int d = 0; d < Dh; d++) {
                    double s = 0;
                    for (int j = c->cu[b]; j <= i; j++)
                        s += p[j] * v[((size_t)j * c->Hkv + h / G) * Dh + d];
                    o[d] = s;
                }
            }
    free(p);
}

/* Gradients of L = sum(out * dout) through softmax directly: for each row,
 * dP_j = dout . v_j, dS_j = P_j (dP_j - sum_l P_l dP_l). Overwrites dq, dk, dv. */
static void ref_backward(double *dq, double *dk, double *dv, const double *dout, const double *q,
                         const double *k, const double *v, const acase_t *c) {
    int T = ntok(c), Dh = c->Dh, G = c->H / c->Hkv;
    memset(dq, 0, sizeof(double) * T * c->H * Dh);
    memset(dk, 0, sizeof(double) * T * c->Hkv * Dh);
    memset(dv, 0, sizeof(double) * T * c->Hkv * Dh);
    double *p = malloc(sizeof(double) * T), *dp = malloc(sizeof(double) * T);
    for (int b = 0; b < c->B; b++)
        for (int i = c->cu[b]; i < c->cu[b + 1]; i++)
            for (int h = 0; h < c->H; h++) {
                int s0 = c->cu[b], kvh = h / G;
                ref_probs(p, q, k, c, s0, i, h);
                const double *go = dout + ((size_t)i * c->H + h) * Dh;
                double D = 0;
                for (int j = s0; j <= i; j++) {
                    dp[j] = 0;
                    for (int d = 0; d < Dh; d++)
                        dp[j] += go[d] * v[((size_t)j * c->Hkv + kvh) * Dh + d];
                    D += p[j] * dp[j];
                }
                for (int j = s0; j <= i; j++) {
                    double ds = p[j] * (dp[j] - D) * c->scale;
                    size_t qo = ((size_t)i * c->H + h) * Dh, ko = ((size_t)j * c->Hkv + kvh) * Dh;
                    for (int d = 0; d < Dh; d++) {
                        dq[qo + d] += ds * k[ko + d];
                        dk[ko + d] += ds * q[qo + d];
                        dv[ko + d] += p[j] * go[d];
                    }
                }
            }
    free(p);
    free(dp);
}

static double ref_loss(const double *q, const double *k, const double *v, const double *g,
                       const acase_t *c, double *out, double *lse) {
    ref_forward(out, lse, q, k, v, c);
    double L = 0;
    size_t n = (size_t)ntok(c) * c->H * c->Dh;
    for (size_t i = 0; i < n; i++)
        L += out[i] * g[i];
    return L;
}

/* Central differences of L with respect to every element of x (n), one of q, k, v. */
static void fd_grad(double *grad, double *x, size_t n, const double *q, const double *k,
                    const double *v, const double *g, const acase_t *c, double *out, double *lse) {
    for (size_t i = 0; i < n; i++) {
        double save = x[i];
        x[i] = save + FD_EPS;
        double lp = ref_loss(q, k, v, g, c, out, lse);
        x[i] = save - FD_EPS;
        double lm = ref_loss(q, k, v, g, c, out, lse);
        x[i] = save;
        grad[i] = (lp - lm) / (2 * FD_EPS);
    }
}

static double *to_double(const float *x, size_t n) {
    double *d = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

static float *fmalloc(size_t n) {
    return malloc(sizeof(float) * (n ? n : 1));
}

/* One case's float inputs and kernel outputs. */
typedef struct abufs {
    size_t nq, nkv, nl;
    float *q, *k, *v, *g, *out, *lse, *dq, *dk, *dv;
} abufs_t;

static void bufs_init(abufs_t *a, const acase_t *c, uint64_t seed) {
    a->nq = (size_t)ntok(c) * c->H * c->Dh;
    a->nkv = (size_t)ntok(c) * c->Hkv * c->Dh;
    a->nl = (size_t)ntok(c) * c->H;
    a->q = fmalloc(a->nq), a->g = fmalloc(a->nq), a->out = fmalloc(a->nq), a->dq = fmalloc(a->nq);
    a->k = fmalloc(a->nkv), a->v = fmalloc(a->nkv);
    a->dk = fmalloc(a->nkv), a->dv = fmalloc(a->nkv);
    a->lse = fmalloc(a->nl);
    tu_fill(a->q, a->nq, seed, -1.5f, 1.5f);
    tu_fill(a->k, a->nkv, seed + 1, -1.5f, 1.5f);
    tu_fill(a->v, a->nkv, seed + 2, -1.0f, 1.0f);
    tu_fill(a->g, a->nq, seed + 3, -1.0f, 1.0f);
}

static void bufs_free(abufs_t *a) {
    free(a->q), free(a->k), free(a->v), free(a->g), free(a->out), free(a->lse);
    free(a->dq), free(a->dk), free(a->dv);
}

static void run_forward(abufs_t *a, const acase_t *c) {
    tu_poison(a->out, a->nq);
    tu_poison(a->lse, a->nl);
    cpu_attention_forward(a->out, a->lse, a->q, a->k, a->v, c->cu, c->B, c->H, c->Hkv, c->Dh,
                          c->scale, c->window);
}

/* Backward into buffers pre-filled with known values, which are then
 * subtracted, so the check also covers accumulation. */
static void run_backward_accum(abufs_t *a, const acase_t *c) {
    tu_fill(a->dq, a->nq, 91, -1.0f, 1.0f);
    tu_fill(a->dk, a->nkv, 92, -1.0f, 1.0f);
    tu_fill(a->dv, a->nkv, 93, -1.0f, 1.0f);
    cpu_attention_backward(a->dq, a->dk, a->dv, a->g, a->q, a->k, a->v, a->out, a->lse, c->cu, c->B,
                           c->H, c->Hkv, c->Dh, c->scale, c->window);
    float *pre = fmalloc(a->nq);
    tu_fill(pre, a->nq, 91, -1.0f, 1.0f);
    for (size_t i = 0; i < a->nq; i++)
        a->dq[i] -= pre[i];
    tu_fill(pre, a->nkv, 92, -1.0f, 1.0f);
    for (size_t i = 0; i < a->nkv; i++)
        a->dk[i] -= pre[i];
    tu_fill(pre, a->nkv, 93, -1.0f, 1.0f);
    for (size_t i = 0; i < a->nkv; i++)
        a->dv[i] -= pre[i];
    free(pre);
}

static void check_case(const acase_t *c, int use_fd, uint64_t seed) {
    abufs_t a;
    bufs_init(&a, c, seed);
    double *q = to_double(a.q, a.nq), *k = to_double(a.k, a.nkv), *v = to_double(a.v, a.nkv);
    double *g = to_double(a.g, a.nq);
    double *out = malloc(sizeof(double) * a.nq), *lse = malloc(sizeof(double) * a.nl);
    double *rdq = malloc(sizeof(double) * a.nq), *rdk = malloc(sizeof(double) * a.nkv);
    double *rdv = malloc(sizeof(double) * a.nkv);
    char what[160];

    run_forward(&a, c);
    ref_forward(out, lse, q, k, v, c);
    snprintf(what, sizeof what, "%s: out", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_fd(a.out, out, a.nq, 1e-3), TOL_FWD, what);
    snprintf(what, sizeof what, "%s: lse", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_fd(a.lse, lse, a.nl, 1e-3), TOL_FWD, what);

    run_backward_accum(&a, c);
    ref_backward(rdq, rdk, rdv, g, q, k, v, c);
    if (use_fd) {
        double *fq = malloc(sizeof(double) * a.nq), *fk = malloc(sizeof(double) * a.nkv);
        double *fv = malloc(sizeof(double) * a.nkv);
        fd_grad(fq, q, a.nq, q, k, v, g, c, out, lse);
        fd_grad(fk, k, a.nkv, q, k, v, g, c, out, lse);
        fd_grad(fv, v, a.nkv, q, k, v, g, c, out, lse);
        /* The analytic reference must agree with finite differences. */
        double e = 0;
        for (size_t i = 0; i < a.nq; i++)
            e = fmax(e, fabs(fq[i] - rdq[i]));
        for (size_t i = 0; i < a.nkv; i++)
            e = fmax(e, fmax(fabs(fk[i] - rdk[i]), fabs(fv[i] - rdv[i])));
        snprintf(what, sizeof what, "%s: reference vs finite differences", c->name);
        TU_ASSERT_CLOSE(e, TOL_REF, what);
        memcpy(rdq, fq, sizeof(double) * a.nq);
        memcpy(rdk, fk, sizeof(double) * a.nkv);
        memcpy(rdv, fv, sizeof(double) * a.nkv);
        free(fq), free(fk), free(fv);
    }
    snprintf(what, sizeof what, "%s: dq", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_fd(a.dq, rdq, a.nq, 1e-3), TOL_GRAD, what);
    snprintf(what, sizeof what, "%s: dk", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_fd(a.dk, rdk, a.nkv, 1e-3), TOL_GRAD, what);
    snprintf(what, sizeof what, "%s: dv", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_fd(a.dv, rdv, a.nkv, 1e-3), TOL_GRAD, what);

    free(q), free(k), free(v), free(g), free(out), free(lse), free(rdq), free(rdk), free(rdv);
    bufs_free(&a);
}

static void test_finite_differences(void) {
    for (size_t i = 0; i < sizeof FD_CASES / sizeof FD_CASES[0]; i++)
        check_case(&FD_CASES[i], 1, 100 + 10 * i);
}

static void test_multiblock_reference(void) {
    for (size_t i = 0; i < sizeof BIG_CASES / sizeof BIG_CASES[0]; i++)
        check_case(&BIG_CASES[i], 0, 300 + 10 * i);
}

/* Every token of a length-1 sequence attends to itself only: out = v. */
static void test_single_token_is_value(void) {
    const acase_t c = {"1/1", 2, {0, 1, 2}, 4, 2, 5, 0, 0.3f};
    abufs_t a;
    bufs_init(&a, &c, 7);
    run_forward(&a, &c);
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 4; h++)
            for (int d = 0; d < 5; d++)
                CU_ASSERT_EQUAL(a.out[(i * 4 + h) * 5 + d], a.v[(i * 2 + h / 2) * 5 + d]);
    bufs_free(&a);
}

/* dq, dk, dv computed alone (the others NULL) equal the full backward bitwise. */
static void test_null_gradients_skipped(void) {
    const acase_t *c = &BIG_CASES[1];
    abufs_t a;
    bufs_init(&a, c, 17);
    run_forward(&a, c);
    float *full[3] = {fmalloc(a.nq), fmalloc(a.nkv), fmalloc(a.nkv)};
    size_t n[3] = {a.nq, a.nkv, a.nkv};
    for (int t = 0; t < 3; t++)
        memset(full[t], 0, sizeof(float) * n[t]);
    cpu_attention_backward(full[0], full[1], full[2], a.g, a.q, a.k, a.v, a.out, a.lse, c->cu, c->B,
                           c->H, c->Hkv, c->Dh, c->scale, c->window);
    for (int t = 0; t < 3; t++) {
        float *one = fmalloc(n[t]);
        memset(one, 0, sizeof(float) * n[t]);
        cpu_attention_backward(t == 0 ? one : NULL, t == 1 ? one : NULL, t == 2 ? one : NULL, a.g,
                               a.q, a.k, a.v, a.out, a.lse, c->cu, c->B, c->H, c->Hkv, c->Dh,
                               c->scale, c->window);
        CU_ASSERT(memcmp(one, full[t], sizeof(float) * n[t]) == 0);
        free(one);
    }
    for (int t = 0; t < 3; t++)
        free(full[t]);
    bufs_free(&a);
}

/* Results are the same bits on 1 and 3 threads. */
static void test_thread_count_independent(void) {
    const acase_t *c = &BIG_CASES[0];
    abufs_t a[2];
    int saved = omp_get_max_threads();
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(r == 0 ? 1 : 3);
        bufs_init(&a[r], c, 23);
        run_forward(&a[r], c);
        memset(a[r].dq, 0, sizeof(float) * a[r].nq);
        memset(a[r].dk, 0, sizeof(float) * a[r].nkv);
        memset(a[r].dv, 0, sizeof(float) * a[r].nkv);
        cpu_attention_backward(a[r].dq, a[r].dk, a[r].dv, a[r].g, a[r].q, a[r].k, a[r].v, a[r].out,
                               a[r].lse, c->cu, c->B, c->H, c->Hkv, c->Dh, c->scale, c->window);
    }
    omp_set_num_threads(saved);
    CU_ASSERT(memcmp(a[0].out, a[1].out, sizeof(float) * a[0].nq) == 0);
    CU_ASSERT(memcmp(a[0].lse, a[1].lse, sizeof(float) * a[0].nl) == 0);
    CU_ASSERT(memcmp(a[0].dq, a[1].dq, sizeof(float) * a[0].nq) == 0);
    CU_ASSERT(memcmp(a[0].dk, a[1].dk, sizeof(float) * a[0].nkv) == 0);
    CU_ASSERT(memcmp(a[0].dv, a[1].dv, sizeof(float) * a[0].nkv) == 0);
    bufs_free(&a[0]);
    bufs_free(&a[1]);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"finite differences (MHA, GQA, MQA, varlen, window)", test_finite_differences},
        {"multi-block against the double reference", test_multiblock_reference},
        {"length-1 sequences return v", test_single_token_is_value},
        {"NULL gradients are skipped", test_null_gradients_skipped},
        {"same bits on 1 and 3 threads", test_thread_count_independent},
        CU_TEST_INFO_NULL,
    };
    return tu_main("attention", tests);
}
