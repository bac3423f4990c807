/* gpu_moe: the mixture-of-experts device blocks (core/cuda/moe_cuda.h) against the CPU
 * layer (moe/moe.c, moe/mlp.c, lora/lora.c) on random routings: one token, K = E, uneven
 * loads with idle experts, one heavy expert over many row tiles, and a routing with more
 * experts than the plan's scan block has threads. The dispatch plan and the gathers must
 * equal the CPU's exactly; combines agree to a few ulp; grouped products, LoRA and the
 * expert MLP by normalised error max|gpu - cpu| / max|cpu| within the tolerances below,
 * with f32 and bf16 expert weights. Outputs are poisoned (NaN, or an impossible index)
 * before each kernel runs; accumulating outputs are checked from zero (the increment
 * against the CPU's) and from random contents (prefill + increment).
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/arena.h"
#include "core/backend.h"
#include "core/cuda/moe_cuda.h"
#include "core/dtype.h"
#include "core/kernels.h"
#include "core/status.h"
#include "lora/lora.h"
#include "moe/mlp.h"
#include "moe/moe.h"
#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

static const kernels_t *KC; /* the CPU table */

/* ---- host helpers ---- */

static float *rounded_bf16(const float *x, size_t n) {
    float *y = hcopy(x, n);
    uint16_t *t = malloc((n ? n : 1) * sizeof(uint16_t));
    convert_from_f32(t, DT_BF16, x, n);
    convert_to_f32(y, t, DT_BF16, n);
    free(t);
    return y;
}

static void check_exact(const char *what, const void *got, const void *want, size_t nb) {
    int same = memcmp(got, want, nb) == 0;
    if (!same)
        tu_report("%s: differs from the CPU", what);
    CU_ASSERT(same);
}

/* ---- cases and routings ---- */

typedef struct {
    int T, D, F, E, K, R;
    int skew; /* 0 uniform, 1 idle experts (e % 3 == 1) and a busy expert 0, 2 one heavy */
} mcase_t;

static const mcase_t CASES[] = {
    {1, 64, 32, 4, 2, 2, 0},     /* one token: most experts idle */
    {9, 33, 70, 4, 4, 3, 0},     /* K = E: every token on every expert */
    {37, 48, 40, 6, 2, 4, 1},    /* uneven, idle experts, odd widths */
    {130, 96, 80, 8, 2, 8, 1},   /* uneven over several row tiles */
    {70, 128, 64, 16, 4, 0, 0},  /* no adapters */
    {300, 160, 136, 5, 2, 8, 2}, /* one heavy expert: many row tiles, partial column tiles */
};
#define NCASES (int)(sizeof CASES / sizeof CASES[0])

static double expert_weight(int skew, int e) {
    if (skew == 1)
        return e % 3 == 1 ? 0.0 : (e == 0 ? 6.0 : 1.0);
    if (skew == 2)
        return e == 0 ? 50.0 : 1.0;
    return 1.0;
}

/* idx (T, K): K distinct experts per token drawn with the case's weights. */
static int32_t *route(int T, int K, int E, int skew, uint64_t seed) {
    size_t S = (size_t)T * K;
    int32_t *idx = malloc((S ? S : 1) * sizeof(int32_t));
    float *u = hrand(S, seed, 0.0f, 1.0f);
    char *used = malloc((size_t)E);
    for (int t = 0; t < T; t++) {
        memset(used, 0, (size_t)E);
        for (int k = 0; k < K; k++) {
            double total = 0.0;
            for (int e = 0; e < E; e++)
                total += used[e] ? 0.0 : expert_weight(skew, e);
            double x = u[(size_t)t * K + k] * total, acc = 0.0;
            int pick = -1;
            for (int e = 0; e < E; e++) {
                double w = used[e] ? 0.0 : expert_weight(skew, e);
                if (w <= 0.0)
                    continue;
                pick = e;
                acc += w;
                if (x < acc)
                    break;
            }
            CU_ASSERT_FATAL(pick >= 0);
            used[pick] = 1;
            idx[(size_t)t * K + k] = pick;
        }
    }
    free(used);
    free(u);
    return idx;
}

/* The CPU plan (in ar) and the device plan of one routing; they must be identical. */
typedef struct {
    int T, K, E, S;
    int32_t *idx; /* (S) host */
    int32_t *didx;
    moe_dispatch_t cpu;
    moe_cuda_plan_t gpu;
} plans_t;

static void int_poison(int32_t *d, size_t n) {
    if (n == 0)
        return;
    int32_t *h = malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        h[i] = INT32_MIN + (int32_t)(i % 7);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d, DEV_CUDA, h, DEV_CPU, n * sizeof(int32_t)) == 0);
    free(h);
}

static void plans_make(plans_t *p, arena_t *ar, int T, int K, int E, int skew, uint64_t seed) {
    char w[160];
    p->T = T, p->K = K, p->E = E, p->S = T * K;
    size_t S = (size_t)p->S;
    p->idx = route(T, K, E, skew, seed);
    p->didx = dput(p->idx, S * sizeof(int32_t));
    TU_CHECK_RC(moe_dispatch_plan(&p->cpu, ar, p->idx, T, K, E));
    TU_CHECK_RC(moe_cuda_plan_alloc(&p->gpu, T, K, E));
    int_poison(p->gpu.offsets, (size_t)E + 1);
    int_poison(p->gpu.slot_of_row, S);
    int_poison(p->gpu.row_of_slot, S);
    TU_CHECK_RC(moe_cuda_plan_build(&p->gpu, p->didx));
    TU_CHECK_RC(moe_cuda_plan_check(&p->gpu));
    int32_t *h = malloc((S + (size_t)E + 1) * sizeof(int32_t));
    snprintf(w, sizeof w, "plan T=%d K=%d E=%d", T, K, E);
    dget(h, p->gpu.offsets, ((size_t)E + 1) * sizeof(int32_t));
    check_exact(w, h, p->cpu.offsets, ((size_t)E + 1) * sizeof(int32_t));
    dget(h, p->gpu.slot_of_row, S * sizeof(int32_t));
    check_exact(w, h, p->cpu.slot_of_row, S * sizeof(int32_t));
    dget(h, p->gpu.row_of_slot, S * sizeof(int32_t));
    check_exact(w, h, p->cpu.row_of_slot, S * sizeof(int32_t));
    free(h);
}

static void plans_free(plans_t *p) {
    moe_cuda_plan_free(&p->gpu);
    dfree(p->didx);
    free(p->idx);
}

/* ---- per-expert matrices: host copies, device copies and the device table ---- */

typedef struct {
    int n;
    size_t elems; /* per matrix */
    dtype_t dt;
    void **h;  /* (n) host, NULL where absent */
    void **d;  /* (n) device, NULL where absent */
    void *tab; /* device array of the n device pointers */
} mats_t;

/* Matrix e is absent when mod > 0 and e % mod == rem. lo == hi gives that constant. */
static void mats_make(mats_t *m, int n, size_t elems, dtype_t dt, uint64_t seed, float lo, float hi,
                      int mod, int rem) {
    m->n = n, m->elems = elems, m->dt = dt;
    m->h = calloc((size_t)n, sizeof(void *));
    m->d = calloc((size_t)n, sizeof(void *));
    size_t es = dtype_size(dt);
    for (int e = 0; e < n; e++) {
        if (mod > 0 && e % mod == rem)
            continue;
        float *f = hrand(elems, seed + 101 * (uint64_t)e, lo, hi);
        if (lo == hi)
            for (size_t i = 0; i < elems; i++)
                f[i] = lo;
        m->h[e] = malloc(elems * es);
        convert_from_f32(m->h[e], dt, f, elems);
        free(f);
        m->d[e] = dput(m->h[e], elems * es);
    }
    m->tab = dput(m->d, (size_t)n * sizeof(void *));
}

/* Uploads new host contents of matrix e. */
static void mats_set(mats_t *m, int e, const float *f) {
    convert_from_f32(m->h[e], m->dt, f, m->elems);
    CU_ASSERT_FATAL(
        g_gpu->copy(g_gpu, m->d[e], DEV_CUDA, m->h[e], DEV_CPU, m->elems * dtype_size(m->dt)) == 0);
}

static void mats_free(mats_t *m) {
    for (int e = 0; e < m->n; e++) {
        free(m->h[e]);
        if (m->d[e])
            dfree(m->d[e]);
    }
    free(m->h);
    free(m->d);
    dfree(m->tab);
}

static wview_t mats_view(const mats_t *m, int e) {
    return wview_of(m->h[e], m->dt);
}

static const char *dt_name(dtype_t dt) {
    return dt == DT_F32 ? "f32" : "bf16";
}

/* ---- the plan ---- */

static void test_plan(void) {
    arena_t ar;
    arena_init(&ar, 0);
    for (int c = 0; c < NCASES; c++) {
        plans_t p;
        plans_make(&p, &ar, CASES[c].T, CASES[c].K, CASES[c].E, CASES[c].skew, 100 + c);
        plans_free(&p);
        arena_reset(&ar);
    }
    /* Many plan tiles; more experts than the scan block's threads; T = 0. */
    static const int big[][4] = {{3000, 8, 128, 1}, {600, 3, 2000, 0}, {0, 2, 4, 0}};
    for (int i = 0; i < 3; i++) {
        plans_t p;
        plans_make(&p, &ar, big[i][0], big[i][1], big[i][2], big[i][3], 200 + i);
        plans_free(&p);
        arena_reset(&ar);
    }
    arena_free(&ar);
}

static void test_plan_bad_index(void) {
    enum { T = 300, K = 2, E = 5 };
    CU_ASSERT_EQUAL_FATAL(synced(), 0);
    int32_t *idx = route(T, K, E, 0, 77);
    idx[2 * 131 + 1] = E; /* slot 263 */
    idx[2 * 290] = -3;    /* slot 580 */
    int32_t *didx = dput(idx, sizeof(int32_t) * T * K);
    moe_cuda_plan_t p;
    TU_CHECK_RC(moe_cuda_plan_alloc(&p, T, K, E));
    TU_CHECK_RC(moe_cuda_plan_build(&p, didx));
    int rc = moe_cuda_plan_check(&p);
    CU_ASSERT_EQUAL(rc, MO_EINVAL);
    const char *want = "slot 263 names expert 5, outside [0, 5)";
    if (!strstr(mo_last_error(), want))
        tu_report("plan check: \"%s\", wanted \"%s\"", mo_last_error(), want);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), want));
    /* The device flag makes synchronize fail once, then it is clear. */
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), MO_EINVAL);
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), 0);
    /* The plan is still a permutation of the slots (later kernels stay in bounds). */
    int32_t *row = malloc(sizeof(int32_t) * T * K);
    char *seen = calloc(T * K, 1);
    dget(row, p.row_of_slot, sizeof(int32_t) * T * K);
    int perm = 1;
    for (int s = 0; s < T * K; s++) {
        if (row[s] < 0 || row[s] >= T * K || seen[row[s]])
            perm = 0;
        else
            seen[row[s]] = 1;
    }
    CU_ASSERT(perm);
    /* A good routing on the same plan checks clean. */
    int32_t *good = route(T, K, E, 0, 78);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, didx, DEV_CUDA, good, DEV_CPU, sizeof(int32_t) * T * K) ==
                    0);
    TU_CHECK_RC(moe_cuda_plan_build(&p, didx));
    CU_ASSERT_EQUAL(moe_cuda_plan_check(&p), 0);
    CU_ASSERT_EQUAL(synced(), 0);
    moe_cuda_plan_t q;
    CU_ASSERT_EQUAL(moe_cuda_plan_alloc(&q, 4, 2, MOE_CUDA_MAX_EXPERTS + 1), MO_EINVAL);
    moe_cuda_plan_free(&p);
    moe_cuda_plan_free(&p); /* a second free is harmless */
    dfree(didx);
    free(idx), free(good), free(row), free(seen);
}

/* ---- gather and combine ---- */

static void gather_case(const mcase_t *c, uint64_t seed) {
    arena_t ar;
    arena_init(&ar, 0);
    plans_t p;
    plans_make(&p, &ar, c->T, c->K, c->E, c->skew, seed);
    size_t T = (size_t)c->T, D = (size_t)c->D, S = (size_t)p.S;
    char w[160];
    snprintf(w, sizeof w, "T=%d D=%d E=%d K=%d", c->T, c->D, c->E, c->K);
    float *x = hrand(T * D, seed + 1, -1, 1), *wt = hrand(S, seed + 2, 0.1f, 1);
    float *yg = hrand(S * D, seed + 3, -1, 1), *dout = hrand(T * D, seed + 4, -1, 1);
    float *dx0 = hrand(T * D, seed + 5, -1, 1), *dyg0 = hrand(S * D, seed + 6, -1, 1);
    float *dw0 = hrand(S, seed + 7, -1, 1);
    float *d_x = dput(x, T * D * 4), *d_wt = dput(wt, S * 4), *d_yg = dput(yg, S * D * 4);
    float *d_dout = dput(dout, T * D * 4);

    /* dispatch forward: exact */
    float *cx = hzeros(S * D), *d_xg = dpoison(S * D);
    moe_dispatch_forward(cx, x, &p.cpu, c->D);
    TU_CHECK_RC(moe_cuda_dispatch_forward(d_xg, d_x, &p.gpu, c->D));
    float *g = dget_f(d_xg, S * D);
    check_exact(w, g, cx, S * D * 4);
    free(g);

    /* dispatch backward onto random dx: exact (the same adds in the same order) */
    float *cdx = hcopy(dx0, T * D), *d_dx = dput(dx0, T * D * 4);
    moe_dispatch_backward(cdx, yg, &p.cpu, c->D);
    TU_CHECK_RC(moe_cuda_dispatch_backward(d_dx, d_yg, &p.gpu, c->D));
    g = dget_f(d_dx, T * D);
    check_exact(w, g, cdx, T * D * 4);
    free(g);

    /* combine forward */
    float *co = hzeros(T * D), *d_o = dpoison(T * D);
    moe_combine_forward(co, yg, wt, &p.cpu, c->D);
    TU_CHECK_RC(moe_cuda_combine_forward(d_o, d_yg, d_wt, &p.gpu, c->D));
    g = dget_f(d_o, T * D);
    TU_ASSERT_CLOSE(err(g, co, T * D), TOL_EW, w);
    free(g);

    /* combine backward onto random gradients, both outputs, then each alone */
    float *cdy = hcopy(dyg0, S * D), *cdw = hcopy(dw0, S);
    moe_combine_backward(cdy, cdw, dout, yg, wt, &p.cpu, c->D);
    float *d_dy = dput(dyg0, S * D * 4), *d_dw = dput(dw0, S * 4);
    TU_CHECK_RC(moe_cuda_combine_backward(d_dy, d_dw, d_dout, d_yg, d_wt, &p.gpu, c->D));
    g = dget_f(d_dy, S * D);
    TU_ASSERT_CLOSE(err(g, cdy, S * D), TOL_EW, w);
    free(g);
    g = dget_f(d_dw, S);
    TU_ASSERT_CLOSE(err(g, cdw, S), TOL_EW, w);
    free(g);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d_dy, DEV_CUDA, dyg0, DEV_CPU, S * D * 4) == 0);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d_dw, DEV_CUDA, dw0, DEV_CPU, S * 4) == 0);
    TU_CHECK_RC(moe_cuda_combine_backward(NULL, d_dw, d_dout, d_yg, d_wt, &p.gpu, c->D));
    g = dget_f(d_dy, S * D);
    check_exact("combine backward without dyg leaves it", g, dyg0, S * D * 4);
    free(g);
    g = dget_f(d_dw, S);
    TU_ASSERT_CLOSE(err(g, cdw, S), TOL_EW, w);
    free(g);
    TU_CHECK_RC(moe_cuda_combine_backward(d_dy, NULL, d_dout, d_yg, d_wt, &p.gpu, c->D));
    g = dget_f(d_dy, S * D);
    TU_ASSERT_CLOSE(err(g, cdy, S * D), TOL_EW, w);
    free(g);

    dfree(d_x), dfree(d_wt), dfree(d_yg), dfree(d_dout), dfree(d_xg), dfree(d_dx), dfree(d_o);
    dfree(d_dy), dfree(d_dw);
    free(x), free(wt), free(yg), free(dout), free(dx0), free(dyg0), free(dw0), free(cx);
    free(cdx), free(co), free(cdy), free(cdw);
    plans_free(&p);
    arena_free(&ar);
}

static void test_gather_combine(void) {
    for (int c = 0; c < NCASES; c++)
        gather_case(&CASES[c], 300 + 10 * (uint64_t)c);
}

/* ---- grouped products ---- */

/* out (S, OC) (+)= per expert rows x_e (rows_e, C) @ W_e^T on the CPU. */
static void cpu_gmm_forward(float *out, const float *x, const mats_t *w, const int32_t *off, int C,
                            int OC) {
    for (int e = 0; e < w->n; e++) {
        int rows = off[e + 1] - off[e];
        if (rows == 0 || !w->h[e])
            continue;
        wview_t v = mats_view(w, e);
        KC->matmul_forward(out + (size_t)off[e] * OC, x + (size_t)off[e] * C, &v, NULL, rows, C,
                           OC);
    }
}

/* dx (S, C) += dout_e (rows_e, OC) @ W_e on the CPU. */
static void cpu_gmm_backward_x(float *dx, const float *dout, const mats_t *w, const int32_t *off,
                               int C, int OC) {
    for (int e = 0; e < w->n; e++) {
        int rows = off[e + 1] - off[e];
        if (rows == 0 || !w->h[e])
            continue;
        wview_t v = mats_view(w, e);
        KC->matmul_backward(dx + (size_t)off[e] * C, NULL, NULL, dout + (size_t)off[e] * OC, NULL,
                            &v, rows, C, OC);
    }
}

static void gmm_case(const mcase_t *c, dtype_t dt, uint64_t seed) {
    arena_t ar;
    arena_init(&ar, 0);
    plans_t p;
    plans_make(&p, &ar, c->T, c->K, c->E, c->skew, seed);
    int E = c->E, C = c->D, OC = c->F, S = p.S;
    const int32_t *off = p.cpu.offsets;
    size_t nx = (size_t)S * C, no = (size_t)S * OC;
    char w[160];
    snprintf(w, sizeof w, "gmm %s S=%d C=%d OC=%d E=%d", dt_name(dt), S, C, OC, E);
    mats_t W;
    mats_make(&W, E, (size_t)OC * C, dt, seed + 1, -1, 1, 0, 0);
    float *x = hrand(nx, seed + 2, -1, 1), *dout = hrand(no, seed + 3, -1, 1);
    float *d_x = dput(x, nx * 4), *d_dout = dput(dout, no * 4);
    float *tol_x = dt == DT_BF16 ? rounded_bf16(x, nx) : hcopy(x, nx);
    float *tol_g = dt == DT_BF16 ? rounded_bf16(dout, no) : hcopy(dout, no);

    /* forward, overwriting a poisoned output */
    float *co = hzeros(no), *cr = hzeros(no), *d_o = dpoison(no);
    cpu_gmm_forward(co, x, &W, off, C, OC);
    cpu_gmm_forward(cr, tol_x, &W, off, C, OC);
    TU_CHECK_RC(moe_cuda_gmm_forward(d_o, d_x, W.tab, dt, p.gpu.offsets, E, S, C, OC, 1.0f, 0));
    float *g = dget_f(d_o, no);
    TU_ASSERT_CLOSE(err(g, co, no), dt == DT_F32 ? TOL_F32 : TOL_LOWP, w);
    TU_ASSERT_CLOSE(err(g, cr, no), dt == DT_F32 ? TOL_F32 : TOL_LOWP_ROUNDED, w);
    /* accumulating with alpha on random contents */
    float *pre = hrand(no, seed + 4, -1, 1);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d_o, DEV_CUDA, pre, DEV_CPU, no * 4) == 0);
    TU_CHECK_RC(moe_cuda_gmm_forward(d_o, d_x, W.tab, dt, p.gpu.offsets, E, S, C, OC, -0.5f, 1));
    float *g2 = dget_f(d_o, no);
    for (size_t i = 0; i < no; i++)
        g[i] *= -0.5f;
    check_acc(w, pre, g, g2, no);
    free(g), free(g2), free(pre);

    /* a slice of the experts, as one rank holds them under expert parallelism: experts
     * 1 .. E-2 on their own buffer, the table offset, the offsets relative */
    if (E >= 3) {
        int e0 = 1, n = E - 2, rows = off[e0 + n] - off[e0];
        int32_t *rel = malloc(sizeof(int32_t) * (size_t)(n + 1));
        for (int i = 0; i <= n; i++)
            rel[i] = off[e0 + i] - off[e0];
        int32_t *d_rel = dput(rel, sizeof(int32_t) * (size_t)(n + 1));
        size_t ns = (size_t)rows * OC;
        float *d_s = dpoison(ns);
        TU_CHECK_RC(moe_cuda_gmm_forward(d_s, d_x + (size_t)off[e0] * C, (const void **)W.tab + e0, dt,
                                      d_rel, n, rows, C, OC, 1.0f, 0));
        g = dget_f(d_s, ns);
        TU_ASSERT_CLOSE(err(g, co + (size_t)off[e0] * OC, ns), dt == DT_F32 ? TOL_F32 : TOL_LOWP,
                        "expert slice");
        free(g), free(rel);
        dfree(d_rel), dfree(d_s);
    }

    /* input gradient: overwrite, then accumulate */
    float *cdx = hzeros(nx), *cdr = hzeros(nx), *d_dx = dpoison(nx);
    cpu_gmm_backward_x(cdx, dout, &W, off, C, OC);
    cpu_gmm_backward_x(cdr, tol_g, &W, off, C, OC);
    TU_CHECK_RC(moe_cuda_gmm_backward_x(d_dx, d_dout, W.tab, dt, p.gpu.offsets, E, S, C, OC, 1.0f, 0));
    g = dget_f(d_dx, nx);
    TU_ASSERT_CLOSE(err(g, cdx, nx), dt == DT_F32 ? TOL_F32 : TOL_LOWP, w);
    TU_ASSERT_CLOSE(err(g, cdr, nx), dt == DT_F32 ? TOL_F32 : TOL_LOWP_ROUNDED, w);
    pre = hrand(nx, seed + 5, -1, 1);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d_dx, DEV_CUDA, pre, DEV_CPU, nx * 4) == 0);
    TU_CHECK_RC(moe_cuda_gmm_backward_x(d_dx, d_dout, W.tab, dt, p.gpu.offsets, E, S, C, OC, 1.0f, 1));
    g2 = dget_f(d_dx, nx);
    check_acc(w, pre, g, g2, nx);
    free(g), free(g2), free(pre);

    /* weight gradient (f32): from zero, then onto random contents; idle experts untouched */
    if (dt == DT_F32) {
        mats_t G;
        mats_make(&G, E, (size_t)OC * C, DT_F32, seed + 6, 0, 0, 0, 0);
        TU_CHECK_RC(moe_cuda_gmm_backward_w(G.tab, d_dout, d_x, p.gpu.offsets, E, S, C, OC, 1.0f));
        float **inc = calloc((size_t)E, sizeof(float *));
        for (int e = 0; e < E; e++) {
            float *ce = hzeros(G.elems);
            int rows = off[e + 1] - off[e];
            wview_t v = mats_view(&W, e);
            if (rows > 0)
                KC->matmul_backward(NULL, ce, NULL, dout + (size_t)off[e] * OC,
                                    x + (size_t)off[e] * C, &v, rows, C, OC);
            inc[e] = dget_f(G.d[e], G.elems);
            TU_ASSERT_CLOSE(err(inc[e], ce, G.elems), TOL_F32, w);
            float *r = hrand(G.elems, seed + 7 + e, -1, 1);
            mats_set(&G, e, r);
            free(r), free(ce);
        }
        TU_CHECK_RC(moe_cuda_gmm_backward_w(G.tab, d_dout, d_x, p.gpu.offsets, E, S, C, OC, 1.0f));
        for (int e = 0; e < E; e++) {
            float *got = dget_f(G.d[e], G.elems);
            check_acc(w, G.h[e], inc[e], got, G.elems);
            if (off[e + 1] == off[e])
                check_exact("idle expert's weight gradient", got, G.h[e], G.elems * 4);
            free(got), free(inc[e]);
        }
        free(inc);
        mats_free(&G);
    }
    mats_free(&W);
    dfree(d_x), dfree(d_dout), dfree(d_o), dfree(d_dx);
    free(x), free(dout), free(tol_x), free(tol_g), free(co), free(cr), free(cdx), free(cdr);
    plans_free(&p);
    arena_free(&ar);
}

static void test_gmm(void) {
    for (int c = 0; c < NCASES; c++) {
        gmm_case(&CASES[c], DT_F32, 400 + 10 * (uint64_t)c);
        gmm_case(&CASES[c], DT_BF16, 500 + 10 * (uint64_t)c);
    }
}

static void test_gmm_errors(void) {
    CU_ASSERT_EQUAL(moe_cuda_gmm_forward(NULL, NULL, NULL, DT_F32, NULL, 2, 4, 0, 3, 1, 0),
                    MO_EINVAL);
    int32_t off[3] = {0, 2, 4};
    int32_t *d_off = dput(off, sizeof off);
    void *tab = dnew(2 * sizeof(void *));
    CU_ASSERT_EQUAL(moe_cuda_gmm_forward(NULL, NULL, tab, DT_F16, d_off, 2, 4, 3, 3, 1, 0),
                    MO_EUNSUPPORTED);
    CU_ASSERT_EQUAL(moe_cuda_gmm_backward_w(NULL, NULL, NULL, d_off, 2, 4, 3, 3, 1), MO_EINVAL);
    CU_ASSERT_EQUAL(synced(), 0);
    dfree(d_off), dfree(tab);
}

/* ---- LoRA ---- */

/* Host pairs of expert e from the A, B, dA, dB sets (NULL where absent). */
static lora_pair_t pair_of(const mats_t *A, const mats_t *B, const mats_t *dA, const mats_t *dB,
                           int e, int R, float scale) {
    lora_pair_t q = {A->h[e], B->h[e], dA ? dA->h[e] : NULL, dB ? dB->h[e] : NULL, R, scale};
    return q;
}

typedef struct {
    mats_t A, B, dA, dB;
    moe_cuda_lora_t l;
    lora_pair_t *pairs;        /* (E) host pairs */
    const lora_pair_t **ptabs; /* (E) NULL where not adapted */
} ad_t;

static void ad_make(ad_t *a, int E, int C, int OC, int R, int mod, int rem, uint64_t seed) {
    float scale = 2.0f / (float)R;
    mats_make(&a->A, E, (size_t)R * C, DT_F32, seed, -1, 1, mod, rem);
    mats_make(&a->B, E, (size_t)OC * R, DT_F32, seed + 1, -1, 1, mod, rem);
    mats_make(&a->dA, E, (size_t)R * C, DT_F32, seed, 0, 0, mod, rem);
    mats_make(&a->dB, E, (size_t)OC * R, DT_F32, seed, 0, 0, mod, rem);
    a->l.A = a->A.tab, a->l.B = a->B.tab, a->l.dA = a->dA.tab, a->l.dB = a->dB.tab;
    a->l.R = R, a->l.scale = scale;
    a->pairs = calloc((size_t)E, sizeof(lora_pair_t));
    a->ptabs = calloc((size_t)E, sizeof(lora_pair_t *));
    for (int e = 0; e < E; e++) {
        a->pairs[e] = pair_of(&a->A, &a->B, &a->dA, &a->dB, e, R, scale);
        a->ptabs[e] = a->A.h[e] ? &a->pairs[e] : NULL;
    }
}

static void ad_free(ad_t *a) {
    mats_free(&a->A), mats_free(&a->B), mats_free(&a->dA), mats_free(&a->dB);
    free(a->pairs), free(a->ptabs);
}

/* The device adapter gradients against the host copies the CPU accumulated into. */
static void ad_check_grads(const ad_t *a, double tol, const char *what) {
    char w[200];
    for (int e = 0; e < a->A.n; e++) {
        if (!a->A.h[e])
            continue;
        float *g = dget_f(a->dA.d[e], a->dA.elems);
        snprintf(w, sizeof w, "%s dA[%d]", what, e);
        TU_ASSERT_CLOSE(err(g, a->dA.h[e], a->dA.elems), tol, w);
        free(g);
        g = dget_f(a->dB.d[e], a->dB.elems);
        snprintf(w, sizeof w, "%s dB[%d]", what, e);
        TU_ASSERT_CLOSE(err(g, a->dB.h[e], a->dB.elems), tol, w);
        free(g);
    }
}

static void lora_case(const mcase_t *c, uint64_t seed) {
    arena_t ar;
    arena_init(&ar, 0);
    plans_t p;
    plans_make(&p, &ar, c->T, c->K, c->E, c->skew, seed);
    int E = c->E, C = c->D, OC = c->F, R = c->R, S = p.S;
    const int32_t *off = p.cpu.offsets;
    size_t nx = (size_t)S * C, no = (size_t)S * OC, nr = (size_t)S * R;
    char w[160];
    snprintf(w, sizeof w, "lora S=%d C=%d OC=%d R=%d E=%d", S, C, OC, R, E);
    ad_t a;
    ad_make(&a, E, C, OC, R, 3, 2, seed + 1); /* experts 2, 5, ... without adapter */
    float *x = hrand(nx, seed + 2, -1, 1), *y0 = hrand(no, seed + 3, -1, 1);
    float *dy = hrand(no, seed + 4, -1, 1);
    float *d_x = dput(x, nx * 4), *d_y = dput(y0, no * 4), *d_dy = dput(dy, no * 4);
    float *zx = hzeros(nx);
    float *d_xa = dpoison(nr), *d_tmp = dpoison(nr), *d_dx = dput(zx, nx * 4);

    float *cy = hcopy(y0, no), *cxa = hzeros(nr), *cdx = hzeros(nx), *tmp = hzeros(nr);
    for (int e = 0; e < E; e++) {
        int rows = off[e + 1] - off[e];
        if (rows == 0 || !a.ptabs[e])
            continue;
        size_t r0 = (size_t)off[e];
        lora_forward(KC, cy + r0 * OC, cxa + r0 * R, x + r0 * C, a.ptabs[e], rows, C, OC);
        lora_backward(KC, cdx + r0 * C, dy + r0 * OC, x + r0 * C, cxa + r0 * R, a.ptabs[e], rows, C,
                      OC, tmp);
    }
    TU_CHECK_RC(moe_cuda_lora_forward(d_y, d_xa, d_x, &a.l, p.gpu.offsets, E, S, C, OC));
    float *gy = dget_f(d_y, no), *gxa = dget_f(d_xa, nr);
    for (size_t i = 0; i < no; i++) /* the increments */
        gy[i] -= y0[i], cy[i] -= y0[i];
    TU_ASSERT_CLOSE(err(gy, cy, no), TOL_F32, w);
    TU_ASSERT_CLOSE(err(gxa, cxa, nr), TOL_F32, w);
    TU_CHECK_RC(
        moe_cuda_lora_backward(d_dx, d_dy, d_x, d_xa, &a.l, p.gpu.offsets, E, S, C, OC, d_tmp));
    float *gdx = dget_f(d_dx, nx);
    TU_ASSERT_CLOSE(err(gdx, cdx, nx), TOL_F32, w);
    ad_check_grads(&a, TOL_F32, w);

    ad_free(&a);
    dfree(d_x), dfree(d_y), dfree(d_dy), dfree(d_xa), dfree(d_tmp), dfree(d_dx);
    free(x), free(y0), free(dy), free(zx), free(cy), free(cxa), free(cdx), free(tmp);
    free(gy), free(gxa), free(gdx);
    plans_free(&p);
    arena_free(&ar);
}

static void test_lora(void) {
    for (int c = 0; c < NCASES; c++)
        if (CASES[c].R > 0)
            lora_case(&CASES[c], 600 + 10 * (uint64_t)c);
}

/* ---- the expert MLP ---- */

/* Rows of the per-expert CPU buffers (field at byte offset fo of mlp_acts_t, width wdt)
 * stacked into one (S, wdt) buffer; zeros for experts without it. */
static float *stack_acts(const mlp_acts_t *acts, size_t fo, const int32_t *off, int E, int wdt,
                         int S) {
    float *out = hzeros((size_t)S * wdt);
    for (int e = 0; e < E; e++) {
        const float *src = *(float *const *)((const char *)&acts[e] + fo);
        int rows = off[e + 1] - off[e];
        if (rows > 0 && src)
            memcpy(out + (size_t)off[e] * wdt, src, sizeof(float) * (size_t)rows * wdt);
    }
    return out;
}

static void compare_acts(const float *d, const mlp_acts_t *acts, size_t fo, const int32_t *off,
                         int E, int wdt, int S, double tol, const char *what) {
    float *want = stack_acts(acts, fo, off, E, wdt, S), *got = dget_f(d, (size_t)S * wdt);
    TU_ASSERT_CLOSE(err(got, want, (size_t)S * wdt), tol, what);
    free(want), free(got);
}

static void experts_case(const mcase_t *c, dtype_t dt, uint64_t seed) {
    arena_t ar;
    arena_init(&ar, 0);
    plans_t p;
    plans_make(&p, &ar, c->T, c->K, c->E, c->skew, seed);
    int E = c->E, D = c->D, F = c->F, R = c->R, S = p.S;
    const int32_t *off = p.cpu.offsets;
    size_t nd = (size_t)S * D, nf = (size_t)S * F, nr = (size_t)S * (R ? R : 1);
    double tol = dt == DT_F32 ? TOL_F32 : TOL_LOWP;
    char w[160];
    snprintf(w, sizeof w, "experts %s S=%d D=%d F=%d E=%d R=%d", dt_name(dt), S, D, F, E, R);
    mats_t Wg, Wu, Wd;
    mats_make(&Wg, E, (size_t)F * D, dt, seed + 1, -0.3f, 0.3f, 0, 0);
    mats_make(&Wu, E, (size_t)F * D, dt, seed + 2, -0.3f, 0.3f, 0, 0);
    mats_make(&Wd, E, (size_t)D * F, dt, seed + 3, -0.3f, 0.3f, 0, 0);
    ad_t ag, au, ad;
    memset(&ag, 0, sizeof ag), memset(&au, 0, sizeof au), memset(&ad, 0, sizeof ad);
    moe_cuda_experts_t dw;
    memset(&dw, 0, sizeof dw);
    dw.dtype = dt, dw.gate = Wg.tab, dw.up = Wu.tab, dw.down = Wd.tab;
    wview_t *hg = calloc((size_t)E, sizeof(wview_t)), *hu = calloc((size_t)E, sizeof(wview_t));
    wview_t *hd = calloc((size_t)E, sizeof(wview_t));
    for (int e = 0; e < E; e++)
        hg[e] = mats_view(&Wg, e), hu[e] = mats_view(&Wu, e), hd[e] = mats_view(&Wd, e);
    moe_weights_t hw;
    memset(&hw, 0, sizeof hw);
    hw.gate = hg, hw.up = hu, hw.down = hd;
    if (R > 0) {
        ad_make(&ag, E, D, F, R, 3, 2, seed + 10);
        ad_make(&au, E, D, F, R, 2, 1, seed + 20);
        ad_make(&ad, E, F, D, R, 3, 0, seed + 30);
        dw.lora_gate = ag.l, dw.lora_up = au.l, dw.lora_down = ad.l;
        hw.lora_gate = ag.ptabs, hw.lora_up = au.ptabs, hw.lora_down = ad.ptabs;
    }
    float *xe = hrand(nd, seed + 4, -1, 1), *dye = hrand(nd, seed + 5, -1, 1);
    float *d_xe = dput(xe, nd * 4), *d_dye = dput(dye, nd * 4), *d_ye = dpoison(nd);
    moe_cuda_acts_t da = {dpoison(nf), dpoison(nf), dpoison(nf), NULL, NULL, NULL};
    if (R > 0)
        da.xa_gate = dpoison(nr), da.xa_up = dpoison(nr), da.xa_down = dpoison(nr);

    /* forward */
    float *cye = hzeros(nd);
    mlp_acts_t *acts = arena_alloc(&ar, sizeof(mlp_acts_t) * (size_t)E);
    CU_ASSERT_FATAL(acts != NULL);
    TU_CHECK_RC(moe_experts_forward(KC, &ar, cye, acts, xe, off, E, 0, &hw, D, F));
    TU_CHECK_RC(moe_cuda_experts_forward(d_ye, &da, d_xe, p.gpu.offsets, E, S, &dw, D, F));
    float *g = dget_f(d_ye, nd);
    TU_ASSERT_CLOSE(err(g, cye, nd), tol, w);
    free(g);
    compare_acts(da.g, acts, offsetof(mlp_acts_t, g), off, E, F, S, tol, "acts g");
    compare_acts(da.u, acts, offsetof(mlp_acts_t, u), off, E, F, S, tol, "acts u");
    compare_acts(da.h, acts, offsetof(mlp_acts_t, h), off, E, F, S, tol, "acts h");
    if (R > 0) {
        compare_acts(da.xa_gate, acts, offsetof(mlp_acts_t, xa_gate), off, E, R, S, tol, "xa_gate");
        compare_acts(da.xa_up, acts, offsetof(mlp_acts_t, xa_up), off, E, R, S, tol, "xa_up");
        compare_acts(da.xa_down, acts, offsetof(mlp_acts_t, xa_down), off, E, R, S, tol, "xa_down");
    }

    /* backward from zeroed dxe, onto random dxe */
    float *cdx = hzeros(nd), *d_dx = dput(cdx, nd * 4);
    float *d_scr = dpoison(moe_cuda_experts_backward_scratch_floats(&dw, S, F));
    TU_CHECK_RC(moe_experts_backward(KC, &ar, cdx, dye, xe, acts, off, E, 0, &hw, D, F));
    TU_CHECK_RC(
        moe_cuda_experts_backward(d_dx, d_dye, d_xe, &da, p.gpu.offsets, E, S, &dw, D, F, d_scr));
    float *inc = dget_f(d_dx, nd);
    TU_ASSERT_CLOSE(err(inc, cdx, nd), tol, w);
    if (R > 0) {
        ad_check_grads(&ag, tol, "gate adapter");
        ad_check_grads(&au, tol, "up adapter");
        ad_check_grads(&ad, tol, "down adapter");
    }
    float *pre = hrand(nd, seed + 6, -1, 1);
    CU_ASSERT_FATAL(g_gpu->copy(g_gpu, d_dx, DEV_CUDA, pre, DEV_CPU, nd * 4) == 0);
    TU_CHECK_RC(
        moe_cuda_experts_backward(d_dx, d_dye, d_xe, &da, p.gpu.offsets, E, S, &dw, D, F, d_scr));
    g = dget_f(d_dx, nd);
    check_acc(w, pre, inc, g, nd);
    free(g), free(inc), free(pre);

    if (R > 0) {
        ad_free(&ag), ad_free(&au), ad_free(&ad);
        dfree(da.xa_gate), dfree(da.xa_up), dfree(da.xa_down);
    }
    mats_free(&Wg), mats_free(&Wu), mats_free(&Wd);
    dfree(da.g), dfree(da.u), dfree(da.h), dfree(d_xe), dfree(d_dye), dfree(d_ye);
    dfree(d_dx), dfree(d_scr);
    free(hg), free(hu), free(hd), free(xe), free(dye), free(cye), free(cdx);
    plans_free(&p);
    arena_free(&ar);
}

static void test_experts(void) {
    for (int c = 0; c < NCASES; c++) {
        experts_case(&CASES[c], DT_F32, 700 + 10 * (uint64_t)c);
        experts_case(&CASES[c], DT_BF16, 800 + 10 * (uint64_t)c);
    }
}

static CU_TestInfo g_tests[] = {
    {"plan", test_plan},
    {"plan_bad_index", test_plan_bad_index},
    {"gather_combine", test_gather_combine},
    {"gmm", test_gmm},
    {"gmm_errors", test_gmm_errors},
    {"lora", test_lora},
    {"experts", test_experts},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!(g_gpu = gpu_suite_backend("gpu_moe", &rc)))
        return rc;
    backend_cpu_set_threads(0);
    KC = backend_cpu()->k;
    return tu_main("gpu_moe", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_moe"); }
#endif
