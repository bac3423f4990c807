/* gpu_sampler: the CUDA sampler (core/cuda/sampler.h) against the CPU sampler
 * (rollout/sampler.h) row by row on random logits, V in {261, 4096, 151936}, greedy,
 * temperatures 0.3 / 1 / 1.7 with no truncation, top-k, top-p, min-p and all three, on
 * wide, narrow, tied and peaked logits. The device uniform must equal sampler_uniform()
 * bit for bit; logp within 1e-5 * max(|logp|, 1) of the CPU's log-probability of the same
 * token; the token equal to the CPU's except on rows where a cut or the draw sits within
 * 1e-6 (relative to the mass) of a boundary in the CPU's own arithmetic, or where two
 * weights next to a cut or the pick differ by less than 1e-6 (relative); those rows are
 * counted, printed, and must stay under 5% of the rows. Two runs give identical bits.
 * Malformed logits and bad parameters give per-row statuses. Exits 77 (skipped) without
 * CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/sampler.h"
#include "core/rng.h"
#include "core/status.h"
#include "rollout/sampler.h"
#include "tests/testutil.h"

#define TOL_LOGP 1e-5
#define EPS_EDGE 1e-6

static const backend_t *g_gpu;

static void *dput(const void *h, size_t nb) {
    void *d = NULL;
    CU_ASSERT_FATAL(g_gpu->alloc(g_gpu, &d, nb) == 0);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d, DEV_CUDA, h, DEV_CPU, nb) == 0);
    return d;
}

static void dget(void *h, const void *d, size_t nb) {
    int rc = g_gpu->synchronize(g_gpu);
    if (rc != 0)
        tu_report("synchronize: %s", mo_last_error());
    CU_ASSERT_FATAL(rc == 0);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, h, DEV_CPU, d, DEV_CUDA, nb) == 0);
}

typedef struct out {
    int32_t *tok, *st; /* (B) */
    float *lp;         /* (B) */
    double *u;         /* (B) */
} out_t;

/* Runs the device sampler on host rows, outputs poisoned first. */
static void run(out_t *o, const float *l, const cuda_sample_req_t *rq, int B, int V) {
    o->tok = malloc(sizeof(int32_t) * (size_t)B);
    o->st = malloc(sizeof(int32_t) * (size_t)B);
    o->lp = malloc(sizeof(float) * (size_t)B);
    o->u = malloc(sizeof(double) * (size_t)B);
    for (int b = 0; b < B; b++)
        o->tok[b] = -2, o->st[b] = 12345, o->lp[b] = NAN, o->u[b] = NAN;
    float *dl = dput(l, sizeof(float) * (size_t)B * (size_t)V);
    cuda_sample_req_t *dr = dput(rq, sizeof *rq * (size_t)B);
    int32_t *dt = dput(o->tok, sizeof(int32_t) * (size_t)B);
    int32_t *ds = dput(o->st, sizeof(int32_t) * (size_t)B);
    float *dp = dput(o->lp, sizeof(float) * (size_t)B);
    double *du = dput(o->u, sizeof(double) * (size_t)B);
    int rc = cuda_sample(dt, dp, ds, du, dl, dr, B, V);
    if (rc != 0)
        tu_report("cuda_sample: %s", mo_last_error());
    CU_ASSERT_FATAL(rc == 0);
    dget(o->tok, dt, sizeof(int32_t) * (size_t)B);
    dget(o->st, ds, sizeof(int32_t) * (size_t)B);
    dget(o->lp, dp, sizeof(float) * (size_t)B);
    dget(o->u, du, sizeof(double) * (size_t)B);
    g_gpu->free(g_gpu, dl), g_gpu->free(g_gpu, dr), g_gpu->free(g_gpu, dt);
    g_gpu->free(g_gpu, ds), g_gpu->free(g_gpu, dp), g_gpu->free(g_gpu, du);
}

static void out_free(out_t *o) {
    free(o->tok), free(o->st), free(o->lp), free(o->u);
}

/* ---- the CPU's arithmetic, recomputed to find rows on a rounding edge ---- */

typedef struct ref {
    float *e;   /* (V) exp(l / T - m), as the CPU sampler forms it */
    int32_t *o; /* (V) ids in sorted order */
    double lz;
} ref_t;

static const float *g_e;
static int by_weight(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (g_e[a] != g_e[b])
        return g_e[a] > g_e[b] ? -1 : 1;
    return a < b ? -1 : 1;
}

static void ref_weights(ref_t *r, const float *l, int V, float T) {
    float mx = -INFINITY;
    for (int j = 0; j < V; j++)
        mx = l[j] > mx ? l[j] : mx;
    float m = mx / T;
    double sum = 0.0;
    for (int j = 0; j < V; j++) {
        r->e[j] = expf(l[j] / T - m);
        sum += r->e[j];
    }
    r->lz = (double)m + log(sum);
}

static int near(double a, double b, double scale) {
    return fabs(a - b) <= EPS_EDGE * scale;
}

static int near_tie(float a, float b) {
    return a != b && fabs((double)a - (double)b) <= EPS_EDGE * fmax(a, b);
}

/* 1 when rounding could move this row's token between two correct implementations. */
static int on_edge(ref_t *r, int V, const sampling_params_t *p, double u, int32_t cpu_tok) {
    const float *e = r->e;
    int topk = p->top_k > 0 && p->top_k < V;
    if (!topk && p->top_p >= 1.0f && p->min_p <= 0.0f) {
        double total = 0.0, cum = 0.0;
        for (int j = 0; j < V; j++)
            total += e[j];
        for (int j = 0; j < V; j++) {
            if (near(cum, u * total, total))
                return 1;
            cum += e[j];
        }
        return 0;
    }
    for (int j = 0; j < V; j++)
        r->o[j] = j;
    g_e = e;
    qsort(r->o, (size_t)V, sizeof(int32_t), by_weight);
    int n = topk ? p->top_k : V;
    if (topk && near_tie(e[r->o[n - 1]], e[r->o[n]]))
        return 1;
    double mass = 0.0;
    for (int i = 0; i < n; i++)
        mass += e[r->o[i]];
    if (p->top_p < 1.0f) {
        double cum = 0.0, lim = (double)p->top_p * mass;
        int keep = 0;
        while (keep < n && cum < lim) {
            if (near(cum, lim, mass) || near(cum + e[r->o[keep]], lim, mass))
                return 1;
            cum += e[r->o[keep++]];
        }
        if (keep < n && near_tie(e[r->o[keep - 1]], e[r->o[keep]]))
            return 1;
        n = keep;
    }
    if (p->min_p > 0.0f) {
        int keep = 0;
        for (int j = 0; j < V; j++)
            if (near(e[j], p->min_p, p->min_p))
                return 1;
        while (keep < n && e[r->o[keep]] >= p->min_p)
            keep++;
        n = keep;
    }
    double total = 0.0, cum = 0.0;
    for (int i = 0; i < n; i++)
        total += e[r->o[i]];
    for (int i = 0; i < n; i++) {
        int32_t id = r->o[i];
        if (near(cum, u * total, total))
            return 1;
        if (id == cpu_tok && ((i > 0 && near_tie(e[r->o[i - 1]], e[id])) ||
                              (i + 1 < V && near_tie(e[id], e[r->o[i + 1]]))))
            return 1;
        cum += e[id];
    }
    return near(cum, u * total, total);
}

/* ---- inputs ---- */

static void fill_logits(float *l, int V, int pattern, uint64_t seed) {
    tu_fill(l, (size_t)V, seed, -1.0f, 1.0f);
    for (int j = 0; j < V; j++) {
        switch (pattern) {
        case 0: l[j] *= 8.0f; break;                          /* wide */
        case 1: l[j] *= 0.5f; break;                          /* narrow: nearly flat */
        case 2: l[j] = roundf(l[j] * 4.0f) * 0.75f; break;    /* 9 values: large ties */
        default: l[j] = l[j] * 3.0f + (j % 97 == 5 ? 9.0f : 0.0f); break; /* peaked */
        }
    }
}

static sampling_params_t sp(float T, float top_p, int top_k, float min_p) {
    sampling_params_t p = {T, top_p, top_k, min_p};
    return p;
}

static int param_sets(sampling_params_t *ps, int V) {
    static const float temps[3] = {0.3f, 1.0f, 1.7f};
    int n = 0;
    ps[n++] = sp(0.0f, 1.0f, 0, 0.0f);
    for (int t = 0; t < 3; t++) {
        float T = temps[t];
        ps[n++] = sp(T, 1.0f, 0, 0.0f);
        ps[n++] = sp(T, 1.0f, V, 0.0f); /* k = V: no truncation */
        ps[n++] = sp(T, 1.0f, 1, 0.0f);
        ps[n++] = sp(T, 1.0f, 50, 0.0f);
        ps[n++] = sp(T, 1.0f, V - 1, 0.0f);
        ps[n++] = sp(T, 0.5f, 0, 0.0f);
        ps[n++] = sp(T, 0.9f, 0, 0.0f);
        ps[n++] = sp(T, 0.95f, 0, 0.0f);
        ps[n++] = sp(T, 1.0f, 0, 0.05f);
        ps[n++] = sp(T, 1.0f, 0, 0.2f);
        ps[n++] = sp(T, 0.9f, 50, 0.05f);
        ps[n++] = sp(T, 0.8f, 1000, 0.01f);
    }
    return n;
}

static cuda_sample_req_t req_of(const sampling_params_t *p, int row, uint64_t salt) {
    cuda_sample_req_t r;
    memset(&r, 0, sizeof r);
    r.temperature = p->temperature, r.top_p = p->top_p, r.top_k = p->top_k, r.min_p = p->min_p;
    r.seed = 1234567ull + salt;
    r.request_id = (uint64_t)row * 0x9E3779B97F4A7C15ull;
    r.sample_index = (uint64_t)(row % 7);
    r.token_index = (uint64_t)row * 4099u + ((uint64_t)(row & 1) << 35);
    return r;
}

static void check_vocab(int V, int reps) {
    sampling_params_t ps[64];
    int np = param_sets(ps, V), B = np * 4 * reps;
    float *l = calloc((size_t)B * (size_t)V, sizeof(float));
    cuda_sample_req_t *rq = calloc((size_t)B, sizeof *rq);
    sampling_params_t *rp = calloc((size_t)B, sizeof *rp);
    CU_ASSERT_FATAL(l && rq && rp);
    for (int b = 0; b < B; b++) {
        rp[b] = ps[b % np];
        fill_logits(l + (size_t)b * (size_t)V, V, (b / np) % 4, 777u * (uint64_t)V + (uint64_t)b);
        rq[b] = req_of(&rp[b], b, (uint64_t)V);
    }
    out_t g, g2;
    run(&g, l, rq, B, V);
    run(&g2, l, rq, B, V);
    sampler_t s;
    CU_ASSERT_FATAL(sampler_init(&s, V) == 0);
    ref_t r = {malloc(sizeof(float) * (size_t)V), malloc(sizeof(int32_t) * (size_t)V), 0.0};
    int bad_u = 0, bad_tok = 0, bad_lp = 0, edge = 0, moved = 0, bad_ref = 0;
    double worst = 0.0;
    for (int b = 0; b < B; b++) {
        const float *lb = l + (size_t)b * (size_t)V;
        double u = sampler_uniform(rq[b].seed, rq[b].request_id, rq[b].sample_index,
                                   rq[b].token_index);
        bad_u += memcmp(&u, &g.u[b], sizeof u) != 0;
        int32_t tok;
        float lp;
        CU_ASSERT_FATAL(sampler_sample(&s, lb, &rp[b], u, &tok, &lp) == 0);
        CU_ASSERT_EQUAL(g.st[b], 0);
        float T = rp[b].temperature == 0.0f ? 1.0f : rp[b].temperature;
        ref_weights(&r, lb, V, T);
        bad_ref += (float)((double)(lb[tok] / T) - r.lz) != lp;
        int32_t gt = g.tok[b];
        if (gt < 0 || gt >= V) {
            bad_tok++;
            continue;
        }
        if (gt != tok) {
            moved++;
            if (rp[b].temperature == 0.0f || !on_edge(&r, V, &rp[b], u, tok))
                bad_tok++;
        }
        if (rp[b].temperature != 0.0f && on_edge(&r, V, &rp[b], u, tok))
            edge++;
        double want = (double)(float)((double)(lb[gt] / T) - r.lz);
        double err = fabs((double)g.lp[b] - want) / fmax(fabs(want), 1.0);
        worst = fmax(worst, err);
        bad_lp += !(err <= TOL_LOGP);
    }
    printf("\n  V=%d: %d rows, %d on a rounding edge, %d tokens differ (allowed on edge rows), "
           "worst logp error %.2e ",
           V, B, edge, moved, worst);
    CU_ASSERT_EQUAL(bad_u, 0);
    CU_ASSERT_EQUAL(bad_ref, 0);
    CU_ASSERT_EQUAL(bad_tok, 0);
    CU_ASSERT_EQUAL(bad_lp, 0);
    CU_ASSERT(edge * 20 <= B);
    CU_ASSERT(memcmp(g.tok, g2.tok, sizeof(int32_t) * (size_t)B) == 0);
    CU_ASSERT(memcmp(g.lp, g2.lp, sizeof(float) * (size_t)B) == 0);
    out_free(&g), out_free(&g2);
    free(r.e), free(r.o), free(l), free(rq), free(rp);
    sampler_free(&s);
}

static void test_small_vocab(void) { check_vocab(261, 4); }
static void test_medium_vocab(void) { check_vocab(4096, 2); }
static void test_qwen_vocab(void) { check_vocab(151936, 1); }

/* Bad rows get their status, token -1 and logp NaN; good rows beside them are sampled. */
static void test_malformed(void) {
    enum { B = 9, V = 300 };
    float *l = malloc(sizeof(float) * B * V);
    cuda_sample_req_t rq[B];
    sampling_params_t p[B];
    for (int b = 0; b < B; b++) {
        tu_fill(l + b * V, V, 50u + (uint64_t)b, -4.0f, 4.0f);
        p[b] = sp(1.0f, 0.9f, 20, 0.0f);
    }
    l[1 * V + 7] = NAN;
    l[2 * V + 299] = INFINITY;
    for (int j = 0; j < V; j++)
        l[3 * V + j] = -INFINITY;
    for (int j = 0; j < V; j += 2)
        l[4 * V + j] = -INFINITY; /* valid: half the tokens impossible */
    p[5].top_p = 0.0f;
    p[6].temperature = NAN;
    p[7].top_k = -1;
    p[8].min_p = 1.0f;
    int want[B] = {0, MO_EMALFORMED, MO_EMALFORMED, MO_EMALFORMED, 0,
                   MO_EINVAL, MO_EINVAL, MO_EINVAL, MO_EINVAL};
    for (int b = 0; b < B; b++)
        rq[b] = req_of(&p[b], b, 9);
    out_t g;
    run(&g, l, rq, B, V);
    sampler_t s;
    CU_ASSERT_FATAL(sampler_init(&s, V) == 0);
    for (int b = 0; b < B; b++) {
        int32_t tok = -1;
        float lp = NAN;
        double u = sampler_uniform(rq[b].seed, rq[b].request_id, rq[b].sample_index,
                                   rq[b].token_index);
        int rc = sampler_sample(&s, l + b * V, &p[b], u, &tok, &lp);
        CU_ASSERT_EQUAL(rc, want[b]);
        CU_ASSERT_EQUAL(g.st[b], want[b]);
        if (want[b] != 0) {
            CU_ASSERT_EQUAL(g.tok[b], -1);
            CU_ASSERT(isnan(g.lp[b]));
        } else {
            CU_ASSERT_EQUAL(g.tok[b], tok);
            CU_ASSERT(fabsf(g.lp[b] - lp) <= 1e-5f * fmaxf(fabsf(lp), 1.0f));
            CU_ASSERT(b != 4 || tok % 2 == 1);
        }
    }
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), 0); /* row errors are not device errors */
    out_free(&g);
    sampler_free(&s);
    free(l);
}

static void test_arguments(void) {
    int32_t x;
    CU_ASSERT_EQUAL(cuda_sample(&x, NULL, NULL, NULL, NULL, NULL, -1, 10), MO_EINVAL);
    CU_ASSERT_EQUAL(cuda_sample(&x, NULL, NULL, NULL, NULL, NULL, 1, 0), MO_EINVAL);
    CU_ASSERT_EQUAL(cuda_sample(&x, NULL, NULL, NULL, NULL, NULL, 1, 10), MO_EINVAL);
    CU_ASSERT_EQUAL(cuda_sample(NULL, NULL, NULL, NULL, NULL, NULL, 0, 10), MO_OK);
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), 0);
}

int main(void) {
    int rc = 0;
    if (!(g_gpu = gpu_suite_backend("gpu_sampler", &rc)))
        return rc;
    CU_TestInfo tests[] = {
        {"arguments", test_arguments},
        {"V=261 against the CPU sampler", test_small_vocab},
        {"V=4096 against the CPU sampler", test_medium_vocab},
        {"V=151936 against the CPU sampler", test_qwen_vocab},
        {"malformed logits and bad parameters", test_malformed},
        CU_TEST_INFO_NULL,
    };
    return tu_main("gpu_sampler", tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_sampler"); }
#endif
