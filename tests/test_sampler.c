/* Tests for rollout/sampler: parameter checks, the top-k / top-p / min-p masks and their
 * order on crafted distributions, temperature, greedy, the logprob definition against a
 * double reference and the logprob kernel, the counter-based draw, quickselect against a
 * full sort with ties, and sampling frequencies over 1e5 draws. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"
#include "rollout/sampler.h"
#include "tests/testutil.h"

static sampling_params_t params(float T, float top_p, int top_k, float min_p) {
    sampling_params_t p = {T, top_p, top_k, min_p};
    return p;
}

/* The kept set of a distribution as a bit mask over V <= 64. */
static uint64_t kept(sampler_t *s, const float *logits, const sampling_params_t *p, float *dist) {
    int n = sampler_distribution(s, logits, p, dist);
    CU_ASSERT_FATAL(n > 0);
    uint64_t mask = 0;
    int cnt = 0;
    double sum = 0.0;
    for (int j = 0; j < s->V; j++)
        if (dist[j] > 0.0f) {
            mask |= 1ull << j;
            cnt++;
            sum += dist[j];
        }
    CU_ASSERT_EQUAL(cnt, n);
    CU_ASSERT(fabs(sum - 1.0) < 1e-6);
    return mask;
}

static void test_params_check(void) {
    sampling_params_t ok = sampling_params_default();
    CU_ASSERT_EQUAL(sampling_params_check(&ok), 0);
    sampling_params_t bad[] = {
        params(-1.0f, 1.0f, 0, 0.0f), params(NAN, 1.0f, 0, 0.0f),  params(INFINITY, 1.0f, 0, 0.0f),
        params(1.0f, 0.0f, 0, 0.0f),  params(1.0f, 1.5f, 0, 0.0f), params(1.0f, NAN, 0, 0.0f),
        params(1.0f, 1.0f, -1, 0.0f), params(1.0f, 1.0f, 0, 1.0f), params(1.0f, 1.0f, 0, -0.1f),
    };
    const char *field[] = {"temperature", "temperature", "temperature", "top_p", "top_p",
                           "top_p",       "top_k",       "min_p",       "min_p"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CU_ASSERT_EQUAL(sampling_params_check(&bad[i]), MO_EINVAL);
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), field[i]));
    }
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, 4), 0);
    float l[4] = {0.1f, 0.2f, 0.3f, 0.4f};
    int32_t tok = -7;
    float lp;
    CU_ASSERT_EQUAL(sampler_sample(&s, l, &bad[3], 0.5, &tok, &lp), MO_EINVAL);
    CU_ASSERT_EQUAL(tok, -7);
    sampler_free(&s);
    CU_ASSERT_EQUAL(sampler_init(&s, 0), MO_EINVAL);
}

/* p = (0.5, 0.2, 0.15, 0.1, 0.05) at temperature 1. */
static void crafted(float *l) {
    const double p[5] = {0.5, 0.2, 0.15, 0.1, 0.05};
    for (int j = 0; j < 5; j++)
        l[j] = (float)log(p[j]) + 3.0f; /* a shift changes nothing */
}

static void test_top_k(void) {
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, 5), 0);
    float l[5], d[5];
    crafted(l);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 3, 0.0f}, d), 0x7u);
    CU_ASSERT(fabsf(d[0] - 0.5f / 0.85f) < 1e-6f && fabsf(d[2] - 0.15f / 0.85f) < 1e-6f);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 1, 0.0f}, d), 0x1u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 5, 0.0f}, d), 0x1fu);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 99, 0.0f}, d), 0x1fu);
    /* Ties go to the lower id. */
    float t[5] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
    CU_ASSERT_EQUAL(kept(&s, t, &(sampling_params_t){1.0f, 1.0f, 2, 0.0f}, d), 0x6u);
    CU_ASSERT_EQUAL(kept(&s, t, &(sampling_params_t){1.0f, 1.0f, 4, 0.0f}, d), 0x1eu);
    sampler_free(&s);
}

static void test_top_p_and_order(void) {
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, 5), 0);
    float l[5], d[5];
    crafted(l);
    /* Kept while the mass before the token is < top_p. */
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.45f, 0, 0.0f}, d), 0x1u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.65f, 0, 0.0f}, d), 0x3u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.75f, 0, 0.0f}, d), 0x7u);
    CU_ASSERT(fabsf(d[1] - 0.2f / 0.85f) < 1e-6f);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.99f, 0, 0.0f}, d), 0x1fu);
    /* top-p renormalises over the top-k set: with k = 2 the first token holds 5/7 > 0.6. */
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.6f, 0, 0.0f}, d), 0x3u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.6f, 2, 0.0f}, d), 0x1u);
    /* min-p keeps p >= min_p * max p = 0.175 here. */
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 0, 0.35f}, d), 0x3u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 1.0f, 0, 0.25f}, d), 0x7u);
    /* All three: the intersection of the prefixes. */
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.9f, 4, 0.25f}, d), 0x7u);
    CU_ASSERT_EQUAL(kept(&s, l, &(sampling_params_t){1.0f, 0.65f, 4, 0.1f}, d), 0x3u);
    sampler_free(&s);
}

/* Temperature scales the logits before everything else. */
static void test_temperature(void) {
    enum { V = 40 };
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, V), 0);
    float l[V], d[V];
    tu_fill(l, V, 3, -4.0f, 4.0f);
    const float Ts[3] = {0.5f, 1.0f, 2.0f};
    for (int i = 0; i < 3; i++) {
        CU_ASSERT_EQUAL(sampler_distribution(&s, l, &(sampling_params_t){Ts[i], 1.0f, 0, 0.0f}, d),
                        V);
        double z = 0.0, ref[V], err = 0.0;
        for (int j = 0; j < V; j++)
            z += exp((double)l[j] / Ts[i]);
        for (int j = 0; j < V; j++) {
            ref[j] = exp((double)l[j] / Ts[i]) / z;
            err = fmax(err, fabs(d[j] - ref[j]));
        }
        TU_ASSERT_CLOSE(err, 1e-6, "tempered distribution");
    }
    /* Low temperature concentrates the mass on the argmax. */
    sampler_distribution(&s, l, &(sampling_params_t){0.01f, 1.0f, 0, 0.0f}, d);
    int am = 0;
    for (int j = 1; j < V; j++)
        am = l[j] > l[am] ? j : am;
    CU_ASSERT(d[am] > 0.99f);
    sampler_free(&s);
}

/* The logprob is of the tempered distribution before truncation. */
static void test_logprob_definition(void) {
    enum { V = 64 };
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, V), 0);
    float l[V];
    tu_fill(l, V, 9, -3.0f, 3.0f);
    sampling_params_t ps[4] = {{0.7f, 1.0f, 0, 0.0f},
                               {0.7f, 0.5f, 0, 0.0f},
                               {1.3f, 1.0f, 5, 0.0f},
                               {1.0f, 0.8f, 10, 0.05f}};
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 20; k++) {
            double u = sampler_uniform(5, (uint64_t)i, 0, (uint64_t)k);
            int32_t tok;
            float lp;
            CU_ASSERT_EQUAL_FATAL(sampler_sample(&s, l, &ps[i], u, &tok, &lp), 0);
            double z = 0.0;
            for (int j = 0; j < V; j++)
                z += exp((double)l[j] / ps[i].temperature);
            double ref = (double)l[tok] / ps[i].temperature - log(z);
            CU_ASSERT(fabs(lp - ref) < 2e-6);
            /* The learner's kernel at the same temperature gives the same number. */
            float klp, lse;
            cpu_logprob_forward(&klp, NULL, &lse, l, &tok, 1, V, ps[i].temperature);
            CU_ASSERT(fabsf(lp - klp) <= 1e-6f);
        }
    sampler_free(&s);
}

static void test_greedy(void) {
    enum { V = 30 };
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, V), 0);
    float l[V], d[V];
    tu_fill(l, V, 4, -2.0f, 2.0f);
    l[17] = 5.0f;
    l[21] = 5.0f; /* a tie: the lower id wins */
    sampling_params_t g = {0.0f, 0.3f, 3, 0.2f};
    for (int k = 0; k < 5; k++) {
        int32_t tok;
        float lp;
        CU_ASSERT_EQUAL(sampler_sample(&s, l, &g, k / 5.0, &tok, &lp), 0);
        CU_ASSERT_EQUAL(tok, 17);
        float klp, lse;
        cpu_logprob_forward(&klp, NULL, &lse, l, &tok, 1, V, 1.0f); /* temperature 1 */
        CU_ASSERT(fabsf(lp - klp) <= 1e-6f);
    }
    CU_ASSERT_EQUAL(sampler_distribution(&s, l, &g, d), 1);
    CU_ASSERT_EQUAL(d[17], 1.0f);
    sampler_free(&s);
}

static void test_uniform_keys(void) {
    double a = sampler_uniform(1, 2, 3, 4);
    CU_ASSERT(a >= 0.0 && a < 1.0);
    CU_ASSERT_EQUAL(a, sampler_uniform(1, 2, 3, 4));
    CU_ASSERT(a != sampler_uniform(2, 2, 3, 4));
    CU_ASSERT(a != sampler_uniform(1, 3, 3, 4));
    CU_ASSERT(a != sampler_uniform(1, 2, 4, 4));
    CU_ASSERT(a != sampler_uniform(1, 2, 3, 5));
    double mean = 0.0;
    for (int i = 0; i < 10000; i++)
        mean += sampler_uniform(7, 0, 0, (uint64_t)i);
    CU_ASSERT(fabs(mean / 10000 - 0.5) < 0.02);
    /* The same draw gives the same token. */
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, 50), 0);
    float l[50];
    tu_fill(l, 50, 8, -1.0f, 1.0f);
    sampling_params_t p = {0.9f, 0.95f, 0, 0.0f};
    int32_t t1, t2;
    float lp1, lp2;
    sampler_sample(&s, l, &p, a, &t1, &lp1);
    sampler_sample(&s, l, &p, a, &t2, &lp2);
    CU_ASSERT_EQUAL(t1, t2);
    CU_ASSERT_EQUAL(lp1, lp2);
    sampler_free(&s);
}

/* Reference order: weight descending, then id. */
static const float *g_e;
static int by_weight(const void *pa, const void *pb) {
    int a = *(const int *)pa, b = *(const int *)pb;
    if (g_e[a] != g_e[b])
        return g_e[a] > g_e[b] ? -1 : 1;
    return a - b;
}

/* top-k through quickselect on a large vocabulary with many ties equals a full sort. */
static void test_top_k_large_ties(void) {
    enum { V = 5000 };
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, V), 0);
    float *l = malloc(sizeof(float) * V), *d = malloc(sizeof(float) * V);
    float *e = malloc(sizeof(float) * V);
    int *ord = malloc(sizeof(int) * V);
    tu_fill(l, V, 21, -6.0f, 6.0f);
    for (int j = 0; j < V; j++)
        l[j] = floorf(l[j] * 4.0f) / 4.0f; /* 48 distinct values */
    const int ks[4] = {1, 37, 500, 4999};
    for (int i = 0; i < 4; i++) {
        CU_ASSERT_EQUAL(
            sampler_distribution(&s, l, &(sampling_params_t){1.0f, 1.0f, ks[i], 0.0f}, d), ks[i]);
        float m = -INFINITY;
        for (int j = 0; j < V; j++)
            m = l[j] > m ? l[j] : m;
        for (int j = 0; j < V; j++) {
            e[j] = expf(l[j] - m);
            ord[j] = j;
        }
        g_e = e;
        qsort(ord, V, sizeof(int), by_weight);
        int bad = 0;
        for (int r = 0; r < V; r++)
            bad += (r < ks[i]) != (d[ord[r]] > 0.0f);
        CU_ASSERT_EQUAL(bad, 0);
    }
    free(l);
    free(d);
    free(e);
    free(ord);
    sampler_free(&s);
}

/* Frequencies of 1e5 draws against the distribution: within 5 standard errors. */
static void check_frequencies(const sampling_params_t *p, uint64_t seed) {
    enum { V = 50, N = 100000 };
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, V), 0);
    float l[V], d[V];
    tu_fill(l, V, seed, -2.5f, 2.5f);
    sampler_distribution(&s, l, p, d);
    int cnt[V] = {0};
    for (int i = 0; i < N; i++) {
        int32_t tok;
        float lp;
        CU_ASSERT_EQUAL_FATAL(
            sampler_sample(&s, l, p, sampler_uniform(seed, 9, 1, (uint64_t)i), &tok, &lp), 0);
        CU_ASSERT_FATAL(tok >= 0 && tok < V);
        cnt[tok]++;
    }
    int bad = 0;
    for (int j = 0; j < V; j++) {
        double f = (double)cnt[j] / N, q = d[j];
        double tol = 5.0 * sqrt(q * (1.0 - q) / N) + 1e-4;
        if (q == 0.0 ? cnt[j] != 0 : fabs(f - q) > tol) {
            tu_report("token %d: frequency %.5f, probability %.5f", j, f, q);
            bad++;
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
    sampler_free(&s);
}

static void test_frequencies(void) {
    check_frequencies(&(sampling_params_t){1.0f, 1.0f, 0, 0.0f}, 31);
    check_frequencies(&(sampling_params_t){0.8f, 0.9f, 20, 0.01f}, 32);
    check_frequencies(&(sampling_params_t){1.5f, 0.7f, 0, 0.0f}, 33);
    check_frequencies(&(sampling_params_t){1.0f, 1.0f, 0, 0.3f}, 34);
}

static void test_bad_logits(void) {
    sampler_t s;
    CU_ASSERT_EQUAL_FATAL(sampler_init(&s, 3), 0);
    sampling_params_t p = sampling_params_default();
    int32_t tok;
    float lp;
    float a[3] = {0.0f, NAN, 1.0f}, b[3] = {0.0f, INFINITY, 1.0f};
    float c[3] = {-INFINITY, -INFINITY, -INFINITY}, d[3] = {-INFINITY, 2.0f, -INFINITY};
    CU_ASSERT_EQUAL(sampler_sample(&s, a, &p, 0.5, &tok, &lp), MO_EMALFORMED);
    CU_ASSERT_EQUAL(sampler_sample(&s, b, &p, 0.5, &tok, &lp), MO_EMALFORMED);
    CU_ASSERT_EQUAL(sampler_sample(&s, c, &p, 0.5, &tok, &lp), MO_EMALFORMED);
    /* -inf entries are only impossible tokens. */
    CU_ASSERT_EQUAL(sampler_sample(&s, d, &p, 0.99, &tok, &lp), 0);
    CU_ASSERT_EQUAL(tok, 1);
    CU_ASSERT_EQUAL(lp, 0.0f);
    sampler_free(&s);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"parameter checks", test_params_check},
        {"top-k mask and ties", test_top_k},
        {"top-p, min-p and their order", test_top_p_and_order},
        {"temperature", test_temperature},
        {"logprob: tempered, before truncation", test_logprob_definition},
        {"greedy", test_greedy},
        {"counter-based draws", test_uniform_keys},
        {"top-k quickselect with ties vs sort", test_top_k_large_ties},
        {"sampling frequencies (1e5 draws)", test_frequencies},
        {"non-finite logits", test_bad_logits},
        CU_TEST_INFO_NULL,
    };
    return tu_main("sampler", tests);
}
