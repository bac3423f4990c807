/* Tests for moe/router: selection and weights against a double-precision reference of
 * the Hugging Face routers, group limits and ties, replay, finite-difference backward,
 * the balance loss and load statistics. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/status.h"
#include "moe/router.h"
#include "tests/testutil.h"

#define MAXE 64

static const kernels_t *K_(void) {
    return backend_cpu()->k;
}

/* ---- double reference (one token row) ---------------------------------------------- */

static int softmaxy(const router_cfg_t *c) {
    return c->kind != ROUTER_SIGMOID_GROUPED;
}

static void ref_scores(const router_cfg_t *c, double *s, const double *l) {
    int E = c->E;
    if (softmaxy(c)) {
        double mx = l[0], z = 0;
        for (int e = 1; e < E; e++)
            mx = l[e] > mx ? l[e] : mx;
        for (int e = 0; e < E; e++)
            z += exp(l[e] - mx);
        for (int e = 0; e < E; e++)
            s[e] = exp(l[e] - mx) / z;
    } else {
        for (int e = 0; e < E; e++)
            s[e] = 1.0 / (1.0 + exp(-l[e]));
    }
}

/* Sort key for the reference top-k: larger value first, then lower index. */
typedef struct {
    double v;
    int i;
} kv_t;

static int kv_cmp(const void *a, const void *b) {
    const kv_t *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->i - y->i;
}

static void ref_topk(int *idx, const double *v, int n, int k) {
    kv_t a[MAXE];
    for (int i = 0; i < n; i++) {
        a[i].v = v[i];
        a[i].i = i;
    }
    qsort(a, (size_t)n, sizeof a[0], kv_cmp);
    for (int i = 0; i < k; i++)
        idx[i] = a[i].i;
}

static void ref_select(const router_cfg_t *c, int *idx, const double *s) {
    int E = c->E;
    double ch[MAXE];
    for (int e = 0; e < E; e++)
        ch[e] = s[e] + (c->e_score_correction_bias ? c->e_score_correction_bias[e] : 0.0);
    if (c->kind != ROUTER_SOFTMAX_TOPK && c->n_group > 1) {
        int G = c->n_group, gs = E / G, top[MAXE], keep[MAXE] = {0};
        double gsc[MAXE];
        for (int g = 0; g < G; g++) {
            int two[MAXE];
            ref_topk(two, ch + g * gs, gs, gs);
            gsc[g] = c->kind == ROUTER_SOFTMAX_GROUPED ? ch[g * gs + two[0]]
                                                       : ch[g * gs + two[0]] + ch[g * gs + two[1]];
        }
        ref_topk(top, gsc, G, c->topk_group);
        for (int i = 0; i < c->topk_group; i++)
            keep[top[i]] = 1;
        for (int e = 0; e < E; e++)
            if (!keep[e / gs])
                ch[e] = c->group_mask_neg_inf ? -INFINITY : 0.0;
    }
    ref_topk(idx, ch, E, c->K);
}

static void ref_weights(const router_cfg_t *c, double *w, const int *idx, const double *s) {
    double sum = 0;
    for (int i = 0; i < c->K; i++)
        sum += s[idx[i]];
    double eps = c->kind == ROUTER_SOFTMAX_TOPK ? 0.0 : 1e-20;
    for (int i = 0; i < c->K; i++)
        w[i] = (c->norm_topk_prob ? s[idx[i]] / (sum + eps) : s[idx[i]]) * c->routed_scaling_factor;
}

/* ---- helpers ------------------------------------------------------------------------ */

/* Runs router_forward and checks it against the reference on every row. */
static void check_forward(const router_cfg_t *c, const float *logits, int T, const char *what) {
    int E = c->E, K = c->K;
    int32_t *idx = malloc(sizeof(int32_t) * T * K);
    float *w = malloc(sizeof(float) * T * K), *p = malloc(sizeof(float) * T * E);
    tu_poison(w, (size_t)T * K);
    tu_poison(p, (size_t)T * E);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), c, idx, w, p, logits, T), 0);
    double worst = 0, worst_p = 0;
    int mismatches = 0;
    for (int t = 0; t < T; t++) {
        double l[MAXE] = {0}, s[MAXE], rw[MAXE];
        int ri[MAXE];
        for (int e = 0; e < E; e++)
            l[e] = logits[t * E + e];
        ref_scores(c, s, l);
        ref_select(c, ri, s);
        ref_weights(c, rw, ri, s);
        for (int i = 0; i < K; i++) {
            if (ri[i] != idx[t * K + i])
                mismatches++;
            double d = fabs(rw[i] - w[t * K + i]) / (fabs(rw[i]) + 1e-6);
            worst = d > worst || isnan(d) ? d : worst;
        }
        for (int e = 0; e < E; e++) {
            double d = fabs(s[e] - p[t * E + e]);
            worst_p = d > worst_p || isnan(d) ? d : worst_p;
        }
    }
    if (mismatches)
        tu_report("%s: %d selection mismatches", what, mismatches);
    CU_ASSERT_EQUAL(mismatches, 0);
    TU_ASSERT_CLOSE(worst, 2e-6, what);
    TU_ASSERT_CLOSE(worst_p, 1e-6, what);
    free(idx);
    free(w);
    free(p);
}

static void random_logits(float *l, int n, uint64_t seed) {
    tu_fill(l, (size_t)n, seed, -3, 3);
}

/* ---- forward ------------------------------------------------------------------------ */

static void test_softmax_topk_forward(void) {
    enum { T = 9, E = 8 };
    float logits[T * E];
    random_logits(logits, T * E, 11);
    for (int K = 1; K <= E; K++)
        for (int norm = 0; norm < 2; norm++) {
            router_cfg_t c;
            router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, E, K);
            c.norm_topk_prob = norm;
            c.routed_scaling_factor = norm ? 1.0f : 2.5f;
            check_forward(&c, logits, T, "softmax top-k");
        }
}

static float g_bias[MAXE];

static void test_sigmoid_grouped_forward(void) {
    enum { T = 12, E = 16 };
    float logits[T * E];
    random_logits(logits, T * E, 12);
    tu_fill(g_bias, E, 13, -0.5f, 0.5f);
    for (int norm = 0; norm < 2; norm++)
        for (int neg = 0; neg < 2; neg++)
            for (int ng = 1; ng <= 8; ng *= 2) {
                router_cfg_t c;
                router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, 4);
                c.norm_topk_prob = norm;
                c.routed_scaling_factor = 2.5f;
                c.n_group = ng;
                c.topk_group = ng > 2 ? ng / 2 : ng;
                c.e_score_correction_bias = g_bias;
                c.group_mask_neg_inf = neg;
                CU_ASSERT_EQUAL(router_cfg_check(&c), 0);
                check_forward(&c, logits, T, "sigmoid grouped");
            }
}

static void test_softmax_grouped_forward(void) {
    enum { T = 10, E = 12 };
    float logits[T * E];
    random_logits(logits, T * E, 14);
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SOFTMAX_GROUPED, E, 3);
    c.n_group = 4;
    c.topk_group = 2;
    c.routed_scaling_factor = 16.0f;
    check_forward(&c, logits, T, "softmax grouped");
    c.norm_topk_prob = 1;
    c.routed_scaling_factor = 1.0f;
    check_forward(&c, logits, T, "softmax grouped normalised");
}

/* The expert with the best score sits in a group whose second expert is poor: the group
 * is dropped and that expert is not chosen. */
static void test_group_masked_off(void) {
    enum { E = 8 };
    float logits[E] = {5, -5, 1, 1, 0.5f, 0.5f, -1, -1};
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, 2);
    c.n_group = 4;
    c.topk_group = 2;
    c.norm_topk_prob = 1;
    int32_t idx[2];
    float w[2], p[E];
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 1), 0);
    /* Groups 1 (1.46) and 2 (1.24) beat group 0 (0.9933 + 0.0067 = 1.0): experts 2 and 3,
     * tied, in index order. */
    CU_ASSERT_EQUAL(idx[0], 2);
    CU_ASSERT_EQUAL(idx[1], 3);
    CU_ASSERT_DOUBLE_EQUAL(w[0], 0.5, 1e-7);
    CU_ASSERT_DOUBLE_EQUAL(w[1], 0.5, 1e-7);

    /* With a bias that makes every biased score negative, Hugging Face's 0.0 fill lets
     * experts of dropped groups win; the -inf fill keeps to the kept groups. */
    float bias[E];
    for (int e = 0; e < E; e++)
        bias[e] = -2.0f;
    c.e_score_correction_bias = bias;
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 1), 0);
    CU_ASSERT_EQUAL(idx[0], 0);
    CU_ASSERT_EQUAL(idx[1], 1);
    check_forward(&c, logits, 1, "zero fill");
    c.group_mask_neg_inf = 1;
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 1), 0);
    CU_ASSERT_EQUAL(idx[0], 2);
    CU_ASSERT_EQUAL(idx[1], 3);
    check_forward(&c, logits, 1, "-inf fill");
}

static void test_ties(void) {
    enum { E = 8 };
    float logits[2 * E];
    for (int e = 0; e < 2 * E; e++)
        logits[e] = 0.25f;
    logits[E + 5] = 1.0f; /* row 1: one winner, the rest tied */
    int32_t idx[2 * 3];
    float w[2 * 3], p[2 * E];
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, E, 3);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 2), 0);
    int want[6] = {0, 1, 2, 5, 0, 1};
    for (int i = 0; i < 6; i++)
        CU_ASSERT_EQUAL(idx[i], want[i]);
    /* Grouped: all groups tie, so the lowest topk_group groups are kept. */
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, 3);
    c.n_group = 4;
    c.topk_group = 2;
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 2), 0);
    int want_g[6] = {0, 1, 2, 5, 0, 1}; /* row 1: group 2 (experts 4, 5) leads, then 0 */
    for (int i = 0; i < 6; i++)
        CU_ASSERT_EQUAL(idx[i], want_g[i]);
    check_forward(&c, logits, 2, "grouped ties");
}

static void test_nan_logits_select_valid(void) {
    enum { E = 6, K = 3 };
    float logits[E] = {NAN, 0.5f, NAN, -1.0f, NAN, NAN};
    int32_t idx[K];
    float w[K], p[E];
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, K);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, 1), 0);
    CU_ASSERT_EQUAL(idx[0], 1);
    CU_ASSERT_EQUAL(idx[1], 3);
    CU_ASSERT_EQUAL(idx[2], 0); /* NaNs rank last, in index order */
}

/* ---- replay ------------------------------------------------------------------------- */

static void test_replay(void) {
    enum { T = 6, E = 16, K = 4 };
    float logits[T * E];
    random_logits(logits, T * E, 21);
    tu_fill(g_bias, E, 22, -0.3f, 0.3f);
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, K);
    c.n_group = 4;
    c.topk_group = 2;
    c.norm_topk_prob = 1;
    c.routed_scaling_factor = 2.5f;
    c.e_score_correction_bias = g_bias;
    int32_t idx[T * K], ridx[T * K];
    float w[T * K], rw[T * K], p[T * E], rp[T * E];
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, T), 0);

    uint16_t u16[T * K];
    for (int i = 0; i < T * K; i++)
        u16[i] = (uint16_t)idx[i];
    tu_poison(rw, T * K);
    CU_ASSERT_EQUAL_FATAL(router_replay(K_(), &c, ridx, rw, rp, logits, u16, DT_U16, T), 0);
    CU_ASSERT(memcmp(ridx, idx, sizeof idx) == 0);
    CU_ASSERT(memcmp(rw, w, sizeof w) == 0);
    tu_poison(rw, T * K);
    CU_ASSERT_EQUAL_FATAL(router_replay(K_(), &c, ridx, rw, rp, logits, idx, DT_I32, T), 0);
    CU_ASSERT(memcmp(rw, w, sizeof w) == 0);

    /* Different experts (ones natural routing would not pick): the weights follow the
     * same formula for them. */
    int32_t other[T * K];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < K; i++)
            other[t * K + i] = (int32_t)((t * 3 + i * 5 + 1) % E);
    CU_ASSERT_EQUAL_FATAL(router_replay(K_(), &c, ridx, rw, rp, logits, other, DT_I32, T), 0);
    double worst = 0;
    int differs = 0;
    for (int t = 0; t < T; t++) {
        double l[MAXE] = {0}, s[MAXE], ref[MAXE];
        int oi[MAXE];
        for (int e = 0; e < E; e++)
            l[e] = logits[t * E + e];
        for (int i = 0; i < K; i++)
            oi[i] = other[t * K + i];
        ref_scores(&c, s, l);
        ref_weights(&c, ref, oi, s);
        for (int i = 0; i < K; i++) {
            double d = fabs(ref[i] - rw[t * K + i]);
            worst = d > worst ? d : worst;
            differs |= ridx[t * K + i] != idx[t * K + i];
        }
    }
    TU_ASSERT_CLOSE(worst, 1e-6, "replayed weights");
    CU_ASSERT(differs);

    /* Bad input is an error, not a crash. */
    int32_t bad[T * K];
    memcpy(bad, idx, sizeof bad);
    bad[7] = E;
    CU_ASSERT_EQUAL(router_replay(K_(), &c, ridx, rw, rp, logits, bad, DT_I32, T), MO_EMALFORMED);
    bad[7] = -1;
    CU_ASSERT_EQUAL(router_replay(K_(), &c, ridx, rw, rp, logits, bad, DT_I32, T), MO_EMALFORMED);
    u16[3] = 60000;
    CU_ASSERT_EQUAL(router_replay(K_(), &c, ridx, rw, rp, logits, u16, DT_U16, T), MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "60000") != NULL);
    memcpy(bad, idx, sizeof bad);
    bad[5] = bad[4];
    CU_ASSERT_EQUAL(router_replay(K_(), &c, ridx, rw, rp, logits, bad, DT_I32, T), MO_EMALFORMED);
    CU_ASSERT_EQUAL(router_replay(K_(), &c, ridx, rw, rp, logits, idx, DT_F32, T), MO_EINVAL);
}

/* ---- backward ----------------------------------------------------------------------- */

/* sum_{t,k} dw[t,k] * w[t,k](logits) with the selection idx held fixed. */
static double ref_loss(const router_cfg_t *c, const double *logits, const int32_t *idx,
                       const float *dw, int T) {
    double L = 0;
    for (int t = 0; t < T; t++) {
        double s[MAXE], w[MAXE];
        int ix[MAXE];
        ref_scores(c, s, logits + t * c->E);
        for (int i = 0; i < c->K; i++)
            ix[i] = idx[t * c->K + i];
        ref_weights(c, w, ix, s);
        for (int i = 0; i < c->K; i++)
            L += dw[t * c->K + i] * w[i];
    }
    return L;
}

static void check_backward(const router_cfg_t *c, int T, uint64_t seed, const char *what) {
    int E = c->E, K = c->K, n = T * E;
    float *logits = malloc(sizeof(float) * n), *p = malloc(sizeof(float) * n);
    float *dl = malloc(sizeof(float) * n), *pre = malloc(sizeof(float) * n);
    float *w = malloc(sizeof(float) * T * K), *dw = malloc(sizeof(float) * T * K);
    int32_t *idx = malloc(sizeof(int32_t) * T * K);
    double *ld = malloc(sizeof(double) * n), *fd = malloc(sizeof(double) * n);
    random_logits(logits, n, seed);
    tu_fill(dw, (size_t)T * K, seed + 1, -1, 1);
    tu_fill(pre, (size_t)n, seed + 2, -1, 1);
    memcpy(dl, pre, sizeof(float) * n);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), c, idx, w, p, logits, T), 0);
    router_backward(c, dl, dw, idx, p, T);
    for (int i = 0; i < n; i++) {
        dl[i] -= pre[i];
        ld[i] = logits[i];
    }
    const double h = 1e-5;
    for (int i = 0; i < n; i++) {
        double x0 = ld[i];
        ld[i] = x0 + h;
        double up = ref_loss(c, ld, idx, dw, T);
        ld[i] = x0 - h;
        double dn = ref_loss(c, ld, idx, dw, T);
        ld[i] = x0;
        fd[i] = (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dl, fd, (size_t)n, 1e-2), 2e-5, what);
    free(logits);
    free(p);
    free(dl);
    free(pre);
    free(w);
    free(dw);
    free(idx);
    free(ld);
    free(fd);
}

static void test_backward_softmax(void) {
    router_cfg_t c;
    for (int K = 1; K <= 8; K += K < 2 ? 1 : 3) {
        for (int norm = 0; norm < 2; norm++) {
            router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, 8, K);
            c.norm_topk_prob = norm;
            c.routed_scaling_factor = 1.5f;
            check_backward(&c, 7, 31 + K, norm ? "softmax top-k normalised" : "softmax top-k");
        }
    }
    router_cfg_init(&c, ROUTER_SOFTMAX_GROUPED, 12, 3);
    c.n_group = 4;
    c.topk_group = 2;
    c.routed_scaling_factor = 16.0f;
    check_backward(&c, 6, 41, "softmax grouped");
}

static void test_backward_sigmoid(void) {
    enum { E = 16 };
    tu_fill(g_bias, E, 51, -0.5f, 0.5f);
    for (int norm = 0; norm < 2; norm++)
        for (int K = 1; K <= E; K += K == 1 ? 3 : 12) {
            router_cfg_t c;
            router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, K);
            c.norm_topk_prob = norm;
            c.routed_scaling_factor = 2.5f;
            c.e_score_correction_bias = g_bias;
            if (K <= 8) {
                c.n_group = 4;
                c.topk_group = 2;
            }
            check_backward(&c, 6, 52 + K, norm ? "sigmoid normalised" : "sigmoid");
        }
}

/* ---- balance loss and load ---------------------------------------------------------- */

static double ref_aux(const router_cfg_t *c, const double *logits, const int64_t *counts, int T,
                      double coef) {
    int E = c->E;
    double P[MAXE] = {0};
    for (int t = 0; t < T; t++) {
        double s[MAXE], z = 0;
        ref_scores(c, s, logits + t * E);
        for (int e = 0; e < E; e++)
            z += s[e];
        for (int e = 0; e < E; e++)
            P[e] += s[e] / z / T;
    }
    double L = 0;
    for (int e = 0; e < E; e++)
        L += (double)counts[e] / ((double)T * c->K) * P[e];
    return coef * E * L;
}

static void check_aux(router_kind_t kind, uint64_t seed, const char *what) {
    enum { T = 10, E = 8, K = 2, N = T * E };
    router_cfg_t c;
    router_cfg_init(&c, kind, E, K);
    float logits[N], p[N], w[T * K], dl[N], pre[N];
    int32_t idx[T * K];
    int64_t counts[E];
    double ld[N], fd[N];
    random_logits(logits, N, seed);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, idx, w, p, logits, T), 0);
    router_load_stats(counts, NULL, idx, T, K, E);
    const float coef = 0.37f, dloss = 1.7f;
    for (int i = 0; i < N; i++)
        ld[i] = logits[i];
    double want = ref_aux(&c, ld, counts, T, coef);
    float got = router_aux_loss(&c, counts, p, T, coef);
    TU_ASSERT_CLOSE(fabs(got - want) / fabs(want), 1e-6, what);
    tu_fill(pre, N, seed + 1, -1, 1);
    memcpy(dl, pre, sizeof dl);
    router_aux_loss_backward(&c, dl, dloss, counts, p, T, coef);
    for (int i = 0; i < N; i++)
        dl[i] -= pre[i];
    const double h = 1e-5;
    for (int i = 0; i < N; i++) {
        double x0 = ld[i];
        ld[i] = x0 + h;
        double up = ref_aux(&c, ld, counts, T, coef);
        ld[i] = x0 - h;
        double dn = ref_aux(&c, ld, counts, T, coef);
        ld[i] = x0;
        fd[i] = dloss * (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dl, fd, N, 1e-3), 2e-5, what);
}

static void test_aux_loss(void) {
    check_aux(ROUTER_SOFTMAX_TOPK, 61, "aux loss softmax");
    check_aux(ROUTER_SIGMOID_GROUPED, 62, "aux loss sigmoid");
    /* Perfectly balanced uniform routing gives coef exactly. */
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, 4, 1);
    float p[4 * 4];
    for (int i = 0; i < 16; i++)
        p[i] = 0.25f;
    int64_t counts[4] = {1, 1, 1, 1};
    CU_ASSERT_DOUBLE_EQUAL(router_aux_loss(&c, counts, p, 4, 0.5f), 0.5, 1e-6);
}

static void test_load_stats(void) {
    int32_t idx[5 * 2] = {0, 1, 0, 2, 0, 3, 1, 0, 0, 2};
    int64_t counts[5];
    float imb = NAN;
    router_load_stats(counts, &imb, idx, 5, 2, 5);
    int64_t want[5] = {5, 2, 2, 1, 0};
    for (int e = 0; e < 5; e++)
        CU_ASSERT_EQUAL(counts[e], want[e]);
    CU_ASSERT_DOUBLE_EQUAL(imb, 2.5, 1e-6); /* max 5 over mean 10 / 5 */
    router_load_stats(counts, &imb, idx, 0, 2, 5);
    CU_ASSERT_EQUAL(counts[0], 0);
    CU_ASSERT_EQUAL(imb, 0.0f);
}

static void test_cfg_check(void) {
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, 16, 4);
    CU_ASSERT_EQUAL(router_cfg_check(&c), 0);
    c.n_group = 3;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    c.n_group = 4;
    c.topk_group = 5;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    c.topk_group = 1;
    c.K = 5; /* more than the 4 experts of one kept group */
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    c.K = 17;
    c.n_group = 1;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    c.K = 2;
    c.n_group = 16; /* one expert per group: no top-2 */
    c.topk_group = 2;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, 8, 2);
    c.e_score_correction_bias = g_bias;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    router_cfg_init(&c, ROUTER_SOFTMAX_TOPK, 8, 2);
    c.routed_scaling_factor = 0.0f;
    CU_ASSERT_EQUAL(router_cfg_check(&c), MO_ECONFIG);
    int32_t idx[2];
    float w[2], p[8], l[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CU_ASSERT_EQUAL(router_forward(K_(), &c, idx, w, p, l, 1), MO_ECONFIG);
}

static void test_deterministic(void) {
    enum { T = 33, E = 16, K = 4 };
    float logits[T * E], w1[T * K], w2[T * K], p1[T * E], p2[T * E], d1[T * E], d2[T * E];
    float dw[T * K];
    int32_t i1[T * K], i2[T * K];
    random_logits(logits, T * E, 71);
    tu_fill(dw, T * K, 72, -1, 1);
    tu_fill(g_bias, E, 73, -0.5f, 0.5f);
    router_cfg_t c;
    router_cfg_init(&c, ROUTER_SIGMOID_GROUPED, E, K);
    c.n_group = 4;
    c.topk_group = 2;
    c.norm_topk_prob = 1;
    c.routed_scaling_factor = 2.5f;
    c.e_score_correction_bias = g_bias;
    memset(d1, 0, sizeof d1);
    memset(d2, 0, sizeof d2);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, i1, w1, p1, logits, T), 0);
    router_backward(&c, d1, dw, i1, p1, T);
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &c, i2, w2, p2, logits, T), 0);
    router_backward(&c, d2, dw, i2, p2, T);
    CU_ASSERT(memcmp(i1, i2, sizeof i1) == 0);
    CU_ASSERT(memcmp(w1, w2, sizeof w1) == 0);
    CU_ASSERT(memcmp(d1, d2, sizeof d1) == 0);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"softmax top-k forward vs reference", test_softmax_topk_forward},
        {"sigmoid grouped forward vs reference", test_sigmoid_grouped_forward},
        {"softmax grouped forward vs reference", test_softmax_grouped_forward},
        {"group masked off, zero and -inf fill", test_group_masked_off},
        {"ties go to the lower index", test_ties},
        {"NaN logits still select valid experts", test_nan_logits_select_valid},
        {"routing replay", test_replay},
        {"backward softmax (finite differences)", test_backward_softmax},
        {"backward sigmoid (finite differences)", test_backward_sigmoid},
        {"balance loss value and gradient", test_aux_loss},
        {"load statistics", test_load_stats},
        {"configuration checks", test_cfg_check},
        {"deterministic", test_deterministic},
        CU_TEST_INFO_NULL,
    };
    return tu_main("router", tests);
}
