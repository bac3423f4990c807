/* Tests for rollout/amx_matmul: products of f32 activations with bf16 weights against a
 * double reference (row counts below, at and above a tile, column and output counts that
 * are and are not multiples of the tile blocks, with bias), a row's bits not depending
 * on the other rows, and the same bits on one and two threads. Where the CPU has no AMX
 * the fallback kernel is what runs and is checked the same way. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cpu/cpu_kernels.h"
#include "rollout/amx_matmul.h"
#include "tests/testutil.h"

/* w (OC, C) bf16 from uniform [-1, 1) (the top half of each float). */
static uint16_t *make_w(int OC, int C, uint64_t seed) {
    size_t n = (size_t)OC * C;
    float *f = malloc(sizeof(float) * n);
    uint16_t *w = malloc(sizeof(uint16_t) * n);
    tu_fill(f, n, seed, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &f[i], sizeof u);
        w[i] = (uint16_t)(u >> 16);
    }
    free(f);
    return w;
}

static double bf16d(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void reference(double *ref, const float *x, const uint16_t *w, const float *bias, int T,
                      int C, int OC) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += (double)x[(size_t)t * C + c] * bf16d(w[(size_t)o * C + c]);
            ref[(size_t)t * OC + o] = s;
        }
}

static void check(int T, int C, int OC, int with_bias, uint64_t seed) {
    size_t nx = (size_t)T * C, no = (size_t)T * OC;
    float *x = malloc(sizeof(float) * nx), *out = malloc(sizeof(float) * no);
    float *bias = malloc(sizeof(float) * (size_t)OC);
    double *ref = malloc(sizeof(double) * no);
    uint16_t *w = make_w(OC, C, seed);
    /* activations over several binades, so all three bf16 parts matter */
    tu_fill(x, nx, seed + 1, -3.0f, 3.0f);
    for (size_t i = 0; i < nx; i += 7)
        x[i] *= 1e-3f;
    tu_fill(bias, (size_t)OC, seed + 2, -1.0f, 1.0f);
    tu_poison(out, no);
    wview_t wv = wview_of(w, DT_BF16);
    amx_matmul_forward(out, x, &wv, with_bias ? bias : NULL, T, C, OC);
    reference(ref, x, w, with_bias ? bias : NULL, T, C, OC);
    char what[96];
    snprintf(what, sizeof what, "T %d C %d OC %d bias %d", T, C, OC, with_bias);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, no, 1.0), 2e-6, what);
    free(x), free(out), free(bias), free(ref), free(w);
}

static void test_shapes(void) {
    const int Ts[] = {1, 15, 16, 17, 37, 64, 100};
    const int Cs[] = {32, 96, 48};
    const int OCs[] = {16, 32, 45, 64, 261};
    uint64_t seed = 10;
    for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
        for (size_t b = 0; b < sizeof Cs / sizeof *Cs; b++)
            for (size_t c = 0; c < sizeof OCs / sizeof *OCs; c++, seed += 3)
                check(Ts[a], Cs[b], OCs[c], (int)(seed & 1), seed);
}

/* The first 20 rows give the same bits alone (T 20) as among 90 rows, and the 90 rows
 * the same bits on 1 and 2 threads. */
static void test_rows_independent(void) {
    enum { C = 256, OC = 200, TA = 20, TB = 90 };
    float *x = malloc(sizeof(float) * TB * C), *a = malloc(sizeof(float) * TA * OC);
    float *b = malloc(sizeof(float) * TB * OC), *one = malloc(sizeof(float) * TB * OC);
    uint16_t *w = make_w(OC, C, 77);
    tu_fill(x, (size_t)TB * C, 78, -2.0f, 2.0f);
    wview_t wv = wview_of(w, DT_BF16);
    int threads = backend_cpu_threads();
    for (int th = 1; th <= 2; th++) {
        backend_cpu_set_threads(th);
        tu_poison(a, (size_t)TA * OC);
        tu_poison(b, (size_t)TB * OC);
        amx_matmul_forward(a, x, &wv, NULL, TA, C, OC);
        amx_matmul_forward(b, x, &wv, NULL, TB, C, OC);
        CU_ASSERT(memcmp(a, b, sizeof(float) * TA * OC) == 0);
        if (th == 1)
            memcpy(one, b, sizeof(float) * TB * OC);
        else
            CU_ASSERT(memcmp(one, b, sizeof(float) * TB * OC) == 0);
    }
    backend_cpu_set_threads(threads);
    free(x), free(a), free(b), free(one), free(w);
}

/* Above the rows taken at a time (256): the product against the reference, and rows 250
 * to 279 (across the chunk boundary) the same bits as computed alone. */
static void test_row_chunks(void) {
    enum { C = 96, OC = 45, T = 300, R0 = 250, TA = 30 };
    check(T, C, OC, 1, 91);
    float *x = malloc(sizeof(float) * T * C), *a = malloc(sizeof(float) * TA * OC);
    float *b = malloc(sizeof(float) * T * OC);
    uint16_t *w = make_w(OC, C, 92);
    tu_fill(x, (size_t)T * C, 93, -2.0f, 2.0f);
    wview_t wv = wview_of(w, DT_BF16);
    tu_poison(a, (size_t)TA * OC);
    tu_poison(b, (size_t)T * OC);
    amx_matmul_forward(a, x + (size_t)R0 * C, &wv, NULL, TA, C, OC);
    amx_matmul_forward(b, x, &wv, NULL, T, C, OC);
    CU_ASSERT(memcmp(a, b + (size_t)R0 * OC, sizeof(float) * TA * OC) == 0);
    free(x), free(a), free(b), free(w);
}

/* Three weights (OC 45, 16, 70) packed back to back and run as one product, T rows: each
 * output against the double reference, the same bits as amx_matmul_bf16 on the weight
 * alone, and the first rows the same bits when computed alone. */
static void packed_case(int T, int C, int with_bias, uint64_t seed) {
    enum { NW = 3 };
    const int OC[NW] = {45, 16, 70};
    uint16_t *w[NW];
    float *out[NW], *plain[NW], *bias[NW], *alone[NW];
    double *ref[NW];
    amx_out_t o[NW], oa[NW];
    size_t pe = 0;
    for (int i = 0; i < NW; i++)
        pe += amx_packed_elems(OC[i], C);
    uint16_t *wp = malloc(sizeof(uint16_t) * pe);
    float *x = malloc(sizeof(float) * (size_t)T * C);
    tu_fill(x, (size_t)T * C, seed, -3.0f, 3.0f);
    for (size_t i = 0; i < (size_t)T * C; i += 5)
        x[i] *= 1e-3f;
    int TA = T < 5 ? T : 5;
    size_t at = 0;
    for (int i = 0; i < NW; i++) {
        size_t no = (size_t)T * OC[i];
        w[i] = make_w(OC[i], C, seed + 10 + (uint64_t)i);
        amx_pack_bf16(wp + at, w[i], OC[i], C);
        at += amx_packed_elems(OC[i], C);
        out[i] = malloc(sizeof(float) * no);
        plain[i] = malloc(sizeof(float) * no);
        alone[i] = malloc(sizeof(float) * no);
        ref[i] = malloc(sizeof(double) * no);
        bias[i] = malloc(sizeof(float) * (size_t)OC[i]);
        tu_fill(bias[i], (size_t)OC[i], seed + 20 + (uint64_t)i, -1.0f, 1.0f);
        tu_poison(out[i], no);
        tu_poison(alone[i], no);
        const float *b = with_bias && i != 1 ? bias[i] : NULL;
        o[i] = (amx_out_t){out[i], b, OC[i]};
        oa[i] = (amx_out_t){alone[i], b, OC[i]};
        amx_matmul_bf16(plain[i], x, w[i], b, T, C, OC[i]);
        reference(ref[i], x, w[i], b, T, C, OC[i]);
    }
    amx_matmul_packed(o, NW, x, wp, T, C);
    amx_matmul_packed(oa, NW, x, wp, TA, C);
    for (int i = 0; i < NW; i++) {
        size_t no = (size_t)T * OC[i];
        char what[96];
        snprintf(what, sizeof what, "packed T %d C %d OC %d bias %d", T, C, OC[i], with_bias);
        TU_ASSERT_CLOSE(tu_rel_err_fd(out[i], ref[i], no, 1.0), 2e-6, what);
        CU_ASSERT(memcmp(out[i], plain[i], sizeof(float) * no) == 0);
        CU_ASSERT(memcmp(out[i], alone[i], sizeof(float) * (size_t)TA * OC[i]) == 0);
        free(w[i]), free(out[i]), free(plain[i]), free(alone[i]), free(ref[i]), free(bias[i]);
    }
    free(wp), free(x);
}

static void test_packed(void) {
    if (!amx_matmul_available()) {
        tu_report("no AMX: packed products not run (the engine keeps the plain kernels)");
        return;
    }
    const int Ts[] = {1, 16, 17, 40, 300};
    const int Cs[] = {32, 96};
    uint64_t seed = 200;
    for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
        for (size_t b = 0; b < sizeof Cs / sizeof *Cs; b++, seed += 7)
            packed_case(Ts[a], Cs[b], (int)(seed & 1), seed);
    /* the same bits on one and two threads */
    enum { T = 70, C = 64, OC = 100 };
    uint16_t *w = make_w(OC, C, 300), *wp = malloc(sizeof(uint16_t) * amx_packed_elems(OC, C));
    float *x = malloc(sizeof(float) * T * C), *a = malloc(sizeof(float) * T * OC);
    float *b = malloc(sizeof(float) * T * OC);
    tu_fill(x, (size_t)T * C, 301, -2.0f, 2.0f);
    amx_pack_bf16(wp, w, OC, C);
    int threads = backend_cpu_threads();
    tu_poison(a, (size_t)T * OC);
    tu_poison(b, (size_t)T * OC);
    backend_cpu_set_threads(1);
    amx_matmul_packed(&(amx_out_t){a, NULL, OC}, 1, x, wp, T, C);
    backend_cpu_set_threads(2);
    amx_matmul_packed(&(amx_out_t){b, NULL, OC}, 1, x, wp, T, C);
    backend_cpu_set_threads(threads);
    CU_ASSERT(memcmp(a, b, sizeof(float) * T * OC) == 0);
    free(w), free(wp), free(x), free(a), free(b);
}

/* Gate and up as one product (amx_matmul_glu), T rows: h against the double reference
 * silu(g) u, g and u (h NULL) the same bits as amx_matmul_packed on gate and up packed
 * back to back, the first rows of h the same bits when computed alone, and amx_swiglu of
 * g and u the same bits as h. */
static void glu_case(int T, int C, int F, uint64_t seed) {
    size_t nx = (size_t)T * C, nf = (size_t)T * F, pe = amx_packed_elems(F, C);
    uint16_t *wg = make_w(F, C, seed), *wu = make_w(F, C, seed + 1);
    uint16_t *glu = malloc(sizeof(uint16_t) * 2 * pe), *seq = malloc(sizeof(uint16_t) * 2 * pe);
    float *x = malloc(sizeof(float) * nx), *h = malloc(sizeof(float) * nf);
    float *g = malloc(sizeof(float) * nf), *u = malloc(sizeof(float) * nf);
    float *g2 = malloc(sizeof(float) * nf), *u2 = malloc(sizeof(float) * nf);
    float *ha = malloc(sizeof(float) * nf);
    double *rg = malloc(sizeof(double) * nf), *ru = malloc(sizeof(double) * nf);
    tu_fill(x, nx, seed + 2, -1.0f, 1.0f);
    for (size_t i = 0; i < nx; i += 3)
        x[i] *= 1e-3f;
    amx_pack_bf16_glu(glu, wg, wu, F, C);
    amx_pack_bf16(seq, wg, F, C);
    amx_pack_bf16(seq + pe, wu, F, C);
    tu_poison(h, nf);
    tu_poison(g, nf);
    tu_poison(u, nf);
    tu_poison(ha, nf);
    amx_matmul_glu(h, NULL, NULL, x, glu, T, C, F);
    amx_matmul_glu(NULL, g, u, x, glu, T, C, F);
    int TA = T < 3 ? T : 3;
    amx_matmul_glu(ha, NULL, NULL, x, glu, TA, C, F);
    amx_out_t o[2] = {{g2, NULL, F}, {u2, NULL, F}};
    amx_matmul_packed(o, 2, x, seq, T, C);
    reference(rg, x, wg, NULL, T, C, F);
    reference(ru, x, wu, NULL, T, C, F);
    for (size_t i = 0; i < nf; i++)
        rg[i] = rg[i] / (1.0 + exp(-rg[i])) * ru[i];
    char what[96];
    snprintf(what, sizeof what, "glu T %d C %d F %d", T, C, F);
    TU_ASSERT_CLOSE(tu_rel_err_fd(h, rg, nf, 1.0), 1e-5, what);
    CU_ASSERT(memcmp(g, g2, sizeof(float) * nf) == 0);
    CU_ASSERT(memcmp(u, u2, sizeof(float) * nf) == 0);
    CU_ASSERT(memcmp(h, ha, sizeof(float) * (size_t)TA * F) == 0);
    /* SwiGLU of the separate g and u: the bits taken from the accumulators */
    tu_poison(ha, nf);
    amx_swiglu(ha, g, u, nf);
    CU_ASSERT(memcmp(h, ha, sizeof(float) * nf) == 0);
    free(wg), free(wu), free(glu), free(seq), free(x), free(h), free(g), free(u), free(g2);
    free(u2), free(ha), free(rg), free(ru);
}

static void test_glu(void) {
    if (!amx_matmul_available()) {
        tu_report("no AMX: gate and up products not run (the engine keeps the plain kernels)");
        return;
    }
    glu_case(1, 64, 40, 600);
    glu_case(33, 96, 48, 610);
    glu_case(300, 32, 20, 620);
}

/* Grouped products (amx_matmul_packed_groups, amx_matmul_glu_groups) on groups of 0, 1,
 * 17, 300 (more than one chunk), 64 and 5 rows with their own weights and a row between
 * two groups that belongs to none: every group's rows the same bits as the per-group
 * product, the free row untouched, on one and two threads (enough rows that two threads
 * share the work). */
enum { NG = 7, GC = 96, GOC = 40, GF = 48 };
static const int g_rows[NG] = {0, 1, 17, 300, 0, 64, 5};

static int group_layout(amx_group_t *g, uint16_t **wd, uint16_t **wglu, int *free_row) {
    int r = 0;
    for (int i = 0; i < NG; i++) {
        if (i == 3)
            *free_row = r++;
        uint16_t *w = make_w(GOC, GC, 700 + (uint64_t)i), *wg = make_w(GF, GC, 720 + (uint64_t)i);
        uint16_t *wu = make_w(GF, GC, 740 + (uint64_t)i);
        wd[i] = malloc(sizeof(uint16_t) * amx_packed_elems(GOC, GC));
        wglu[i] = malloc(sizeof(uint16_t) * 2 * amx_packed_elems(GF, GC));
        amx_pack_bf16(wd[i], w, GOC, GC);
        amx_pack_bf16_glu(wglu[i], wg, wu, GF, GC);
        free(w), free(wg), free(wu);
        g[i] = (amx_group_t){wd[i], r, g_rows[i]};
        r += g_rows[i];
    }
    return r;
}

/* Per group, the ungrouped products into a (rows, OC), h, gt and u (rows, F). */
static void groups_alone(float *a, float *h, float *gt, float *u, const float *x,
                         const amx_group_t *g, uint16_t *const *wglu) {
    for (int i = 0; i < NG; i++) {
        if (g[i].T == 0)
            continue;
        size_t r0 = (size_t)g[i].r0;
        amx_out_t o = {a + r0 * GOC, NULL, GOC};
        amx_matmul_packed(&o, 1, x + r0 * GC, g[i].w, g[i].T, GC);
        amx_matmul_glu(h + r0 * GF, NULL, NULL, x + r0 * GC, wglu[i], g[i].T, GC, GF);
        amx_matmul_glu(NULL, gt + r0 * GF, u + r0 * GF, x + r0 * GC, wglu[i], g[i].T, GC, GF);
    }
}

static void test_groups(void) {
    if (!amx_matmul_available()) {
        tu_report("no AMX: grouped products not run (the engine runs its experts one by one)");
        return;
    }
    amx_group_t g[NG], gg[NG];
    uint16_t *wd[NG], *wglu[NG];
    int fr = 0, T = group_layout(g, wd, wglu, &fr);
    for (int i = 0; i < NG; i++)
        gg[i] = (amx_group_t){wglu[i], g[i].r0, g[i].T};
    size_t no = (size_t)T * GOC, nf = (size_t)T * GF;
    float *x = malloc(sizeof(float) * (size_t)T * GC);
    float *a = malloc(sizeof(float) * no), *b = malloc(sizeof(float) * no);
    float *buf[6]; /* h, gt, u alone; h, gt, u grouped */
    for (int i = 0; i < 6; i++)
        buf[i] = malloc(sizeof(float) * nf);
    tu_fill(x, (size_t)T * GC, 760, -2.0f, 2.0f);
    for (size_t i = 0; i < (size_t)T * GC; i += 5)
        x[i] *= 1e-3f;
    int threads = backend_cpu_threads();
    for (int th = 1; th <= 2; th++) {
        backend_cpu_set_threads(th);
        tu_poison(a, no);
        tu_poison(b, no);
        for (int i = 0; i < 6; i++)
            tu_poison(buf[i], nf);
        groups_alone(a, buf[0], buf[1], buf[2], x, g, wglu);
        amx_matmul_packed_groups(b, x, g, NG, GC, GOC);
        amx_matmul_glu_groups(buf[3], NULL, NULL, x, gg, NG, GC, GF);
        amx_matmul_glu_groups(NULL, buf[4], buf[5], x, gg, NG, GC, GF);
        /* the free row stays poisoned on both sides, so whole buffers compare */
        CU_ASSERT(memcmp(a, b, sizeof(float) * no) == 0);
        for (int i = 0; i < 3; i++)
            CU_ASSERT(memcmp(buf[i], buf[i + 3], sizeof(float) * nf) == 0);
        CU_ASSERT(isnan(b[(size_t)fr * GOC]) && isnan(buf[3][(size_t)fr * GF + GF - 1]));
    }
    backend_cpu_set_threads(threads);
    for (int i = 0; i < NG; i++)
        free(wd[i]), free(wglu[i]);
    for (int i = 0; i < 6; i++)
        free(buf[i]);
    free(x), free(a), free(b);
}

/* The packed layout itself: output 16 b + n, column 32 kb + 2 k2 + q at [b][kb][k2][n][q],
 * zeros past OC. */
static void test_pack_layout(void) {
    enum { OC = 20, C = 64 };
    uint16_t *w = make_w(OC, C, 400), *wp = malloc(sizeof(uint16_t) * amx_packed_elems(OC, C));
    CU_ASSERT_EQUAL(amx_packed_elems(OC, C), (size_t)32 * C);
    memset(wp, 0xff, sizeof(uint16_t) * amx_packed_elems(OC, C));
    amx_pack_bf16(wp, w, OC, C);
    int bad = 0;
    for (int o = 0; o < 32; o++)
        for (int c = 0; c < C; c++) {
            int b = o / 16, n = o % 16, kb = c / 32, k2 = (c % 32) / 2, q = c % 2;
            uint16_t got = wp[((((size_t)b * (C / 32) + kb) * 16 + k2) * 16 + n) * 2 + q];
            bad += got != (o < OC ? w[(size_t)o * C + c] : 0);
        }
    CU_ASSERT_EQUAL(bad, 0);
    free(w), free(wp);
}

/* Forced off, the tiles are not used: amx_matmul_available answers 0 and
 * amx_matmul_forward is the CPU kernel (the same bits as cpu_matmul_forward). */
static void test_forced_off(void) {
    enum { T = 24, C = 64, OC = 40 };
    uint16_t *w = make_w(OC, C, 500);
    float *x = malloc(sizeof(float) * T * C), *a = malloc(sizeof(float) * T * OC);
    float *b = malloc(sizeof(float) * T * OC);
    tu_fill(x, (size_t)T * C, 501, -2.0f, 2.0f);
    wview_t wv = wview_of(w, DT_BF16);
    amx_matmul_force_off(1);
    CU_ASSERT_EQUAL(amx_matmul_available(), 0);
    CU_ASSERT_EQUAL(amx_matmul_fits(&wv, T, C), 0);
    tu_poison(a, (size_t)T * OC);
    tu_poison(b, (size_t)T * OC);
    amx_matmul_forward(a, x, &wv, NULL, T, C, OC);
    cpu_matmul_forward(b, x, &wv, NULL, T, C, OC);
    CU_ASSERT(memcmp(a, b, sizeof(float) * T * OC) == 0);
    check(37, 96, 45, 1, 502); /* the fallback against the reference */
    amx_matmul_force_off(0);
    free(w), free(x), free(a), free(b);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"products vs double reference", test_shapes},
        {"rows independent of the batch and threads", test_rows_independent},
        {"more rows than one chunk", test_row_chunks},
        {"packed weights: several outputs in one product", test_packed},
        {"packed layout", test_pack_layout},
        {"grouped products: each group's bits, one region", test_groups},
        {"gate and up as one product, SwiGLU from the accumulators", test_glu},
        {"tiles forced off: the CPU kernel", test_forced_off},
        CU_TEST_INFO_NULL,
    };
    return tu_main("amx_matmul", tests);
}
