/* gpu_kernels: the CUDA kernel table against the CPU table on random inputs,
 * every op forward and backward, small and medium shapes, by normalised error
 * max|gpu - cpu| / max|cpu| with the tolerances below; plus the CUDA backend's
 * memory pool, copies, streams, threads and error capture. Outputs are
 * poisoned with NaN before each kernel runs. Backward ops are run twice: from
 * zeroed gradients (the increments are compared with the CPU's) and from
 * random gradients (the result must be those plus the increments).
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/dtype.h"
#include "core/kernels.h"
#include "core/status.h"
#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

static const kernels_t *KG, *KC; /* CUDA and CPU tables */

/* ---- host helpers ---- */

/* Random ints in [0, hi). */
static int32_t *hids(size_t n, uint64_t seed, int hi) {
    float *u = hrand(n, seed, 0.0f, 1.0f);
    int32_t *ids = malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) {
        int v = (int)(u[i] * (float)hi);
        ids[i] = v < hi ? v : hi - 1;
    }
    free(u);
    return ids;
}

/* ---- the backend ---- */

static void test_backend_basics(void) {
    CU_ASSERT_PTR_EQUAL(backend_get(DEV_CUDA), g_gpu);
    CU_ASSERT_EQUAL(g_gpu->device, DEV_CUDA);
    CU_ASSERT_STRING_EQUAL(g_gpu->name, "cuda");
    cuda_device_info_t info;
    CU_ASSERT_EQUAL_FATAL(backend_cuda_device_info(&info), 0);
    CU_ASSERT(info.name[0] != '\0' && info.sm_count > 0 && info.total_mem > 0);
    CU_ASSERT_EQUAL(backend_cuda_select_device(info.ordinal), 0);
    CU_ASSERT_EQUAL(backend_cuda_select_device(info.ordinal + 1), MO_ESTATE);

    const size_t sizes[] = {1, 1000, 3u << 20};
    for (int s = 0; s < 3; s++) {
        size_t n = sizes[s];
        float *h = hrand(n, 100 + s, -5.0f, 5.0f), *back = malloc(n * sizeof(float));
        float *d1 = dput(h, n * sizeof(float)), *d2 = dpoison(n);
        CU_ASSERT_EQUAL(g_gpu->copy(g_gpu, d2, DEV_CUDA, d1, DEV_CUDA, n * sizeof(float)), 0);
        dget(back, d2, n * sizeof(float));
        CU_ASSERT_EQUAL(memcmp(back, h, n * sizeof(float)), 0);
        CU_ASSERT_EQUAL(g_gpu->memset_zero(g_gpu, d2, n * sizeof(float)), 0);
        dget(back, d2, n * sizeof(float));
        size_t nz = 0;
        for (size_t i = 0; i < n; i++)
            nz += back[i] != 0.0f;
        CU_ASSERT_EQUAL(nz, 0);
        dfree(d1);
        dfree(d2);
        free(h);
        free(back);
    }
    CU_ASSERT_EQUAL(g_gpu->copy(g_gpu, NULL, DEV_CPU, NULL, DEV_CUDA, 0), 0);
    CU_ASSERT_EQUAL(g_gpu->copy(g_gpu, NULL, DEV_COUNT, NULL, DEV_CUDA, 4), MO_EINVAL);
}

/* A repeated allocation is served from the pool: no new cudaMalloc. */
static void test_pool_reuse(void) {
    void *a = dnew(5u << 20), *b = dnew(1000);
    dfree(a);
    dfree(b);
    cuda_pool_stats_t s0, s1;
    backend_cuda_pool_stats(&s0);
    for (int it = 0; it < 3; it++) {
        a = dnew(5u << 20);
        b = dnew(1000);
        dfree(b);
        dfree(a);
    }
    backend_cuda_pool_stats(&s1);
    CU_ASSERT_EQUAL(s1.device_allocs, s0.device_allocs);
    CU_ASSERT_EQUAL(s1.in_use, s0.in_use);
    CU_ASSERT_EQUAL(s1.allocs, s0.allocs + 6);
    CU_ASSERT(s1.reserved >= (5u << 20));
}

/* Work queued on a caller's stream, cuBLAS included, then the default again. */
static void test_stream(void) {
    enum { T = 33, C = 70, OC = 45 };
    cudaStream_t st;
    CU_ASSERT_EQUAL_FATAL(cudaStreamCreate(&st), cudaSuccess);
    float *inp = hrand(T * C, 1, -1, 1), *w = hrand(OC * C, 2, -1, 1);
    float *want = malloc(T * OC * sizeof(float));
    wview_t wv = wview_f32(w);
    KC->matmul_forward(want, inp, &wv, NULL, T, C, OC);
    float *d_inp = dput(inp, sizeof(float) * T * C), *d_w = dput(w, sizeof(float) * OC * C);
    wview_t dwv = wview_f32(d_w);
    for (int pass = 0; pass < 2; pass++) {
        g_gpu->set_stream(g_gpu, pass == 0 ? (void *)st : NULL);
        float *d_out = dpoison(T * OC);
        KG->matmul_forward(d_out, d_inp, &dwv, NULL, T, C, OC);
        float *got = dget_f(d_out, T * OC);
        TU_ASSERT_CLOSE(err(got, want, T * OC), TOL_F32,
                        pass == 0 ? "matmul on a stream" : "matmul on the default");
        free(got);
        dfree(d_out);
    }
    g_gpu->set_stream(g_gpu, NULL);
    CU_ASSERT_EQUAL(cudaStreamDestroy(st), cudaSuccess);
    dfree(d_inp);
    dfree(d_w);
    free(inp), free(w), free(want);
}

typedef struct {
    const float *d_gate, *d_up;
    size_t n;
    float *got; /* (n) host */
    int rc;
} thread_job_t;

static void *thread_main(void *p) {
    thread_job_t *j = p;
    float *d_out = NULL;
    j->rc = g_gpu->alloc(g_gpu, (void **)&d_out, j->n * sizeof(float));
    if (j->rc == 0) {
        KG->swiglu_forward(d_out, j->d_gate, j->d_up, j->n);
        j->rc = g_gpu->synchronize(g_gpu);
    }
    if (j->rc == 0)
        j->rc = g_gpu->copy(g_gpu, j->got, DEV_CPU, d_out, DEV_CUDA, j->n * sizeof(float));
    g_gpu->free(g_gpu, d_out);
    return NULL;
}

/* Another thread binds the device on first use and gets its own scratch. */
static void test_thread(void) {
    enum { N = 4099 };
    float *gate = hrand(N, 5, -3, 3), *up = hrand(N, 6, -2, 2), want[N];
    KC->swiglu_forward(want, gate, up, N);
    thread_job_t j = {dput(gate, sizeof gate[0] * N), dput(up, sizeof up[0] * N), N,
                      malloc(N * sizeof(float)), -1};
    pthread_t th;
    CU_ASSERT_EQUAL_FATAL(pthread_create(&th, NULL, thread_main, &j), 0);
    pthread_join(th, NULL);
    CU_ASSERT_EQUAL(j.rc, 0);
    if (j.rc == 0)
        TU_ASSERT_CLOSE(err(j.got, want, N), TOL_EW, "swiglu on another thread");
    dfree((void *)j.d_gate);
    dfree((void *)j.d_up);
    free(j.got), free(gate), free(up);
}

/* synchronize returns the recorded error (code and message), then clears it. */
static void expect_error(int code, const char *needle, const char *what) {
    int rc = g_gpu->synchronize(g_gpu);
    if (rc != code || !strstr(mo_last_error(), needle))
        tu_report("%s: synchronize gave %d (%s), wanted %d with \"%s\"", what, rc, mo_last_error(),
                  code, needle);
    CU_ASSERT_EQUAL(rc, code);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), needle));
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), 0);
}

static void test_errors(void) {
    enum { T = 4, C = 8, OC = 6, V = 10 };
    CU_ASSERT_EQUAL_FATAL(synced(), 0);
    float *h = hrand(OC * C, 7, -1, 1);
    uint16_t wb[OC * C];
    convert_from_f32(wb, DT_BF16, h, OC * C);
    void *d_wb = dput(wb, sizeof wb);
    float *d_x = dput(h, sizeof(float) * T * C), *d_dw = dzeros(OC * C), *d_out = dpoison(T * OC);
    wview_t wv = wview_of(d_wb, DT_BF16);

    /* T = 0 writes nothing and is no error. */
    KG->matmul_forward(d_out, d_x, &wv, NULL, 0, C, OC);
    float *o = dget_f(d_out, T * OC);
    CU_ASSERT(isnan(o[0]) && isnan(o[T * OC - 1]));
    free(o);

    KG->matmul_backward(NULL, d_dw, NULL, d_x, d_x, &wv, T, C, OC);
    expect_error(MO_EINVAL, "dw needs an f32 weight", "dw on a bf16 weight");

    int32_t ids[T] = {1, -2, 3, 0};
    int32_t *d_ids = dput(ids, sizeof ids);
    wview_t fv = wview_f32(d_x);
    KG->embedding_forward(d_out, d_ids, &fv, T, 2);
    expect_error(MO_EINVAL, "token id is negative", "negative embedding id");

    int32_t tg[T] = {0, V, 2, 3};
    int32_t *d_tg = dput(tg, sizeof tg);
    float *d_l = dput(h, sizeof(float) * T * V), *d_lp = dpoison(T), *d_lse = dpoison(T);
    KG->logprob_forward(d_lp, NULL, d_lse, d_l, d_tg, T, V, 1.0f);
    expect_error(MO_EINVAL, "target is outside", "target out of range");

    int32_t cu_bad[3] = {0, 3, 1};
    int32_t *d_cu = dput(cu_bad, sizeof cu_bad);
    KG->attention_forward(d_out, d_lse, d_x, d_x, d_x, d_cu, 2, 1, 1, 2, 1.0f, 0);
    expect_error(MO_EINVAL, "cu_seqlens decreases", "decreasing cu_seqlens");

    KG->attention_forward(d_out, d_lse, d_x, d_x, d_x, d_cu, 1, 1, 1, 300, 1.0f, 0);
    expect_error(MO_EUNSUPPORTED, "head dim 300", "head dim above the limit");

    int32_t *d_idx = dnew(sizeof(int32_t) * T * 9);
    KG->topk_forward(d_idx, d_out, d_x, T, C, C + 1);
    expect_error(MO_EINVAL, "topk_forward", "K > C");

    g_gpu->free(g_gpu, (char *)d_out + 512);
    expect_error(MO_EINVAL, "not allocated by the CUDA backend", "free of a foreign pointer");

    dfree(d_wb), dfree(d_x), dfree(d_dw), dfree(d_out), dfree(d_ids), dfree(d_tg);
    dfree(d_l), dfree(d_lp), dfree(d_lse), dfree(d_cu), dfree(d_idx);
    free(h);
}

/* ---- matmul ---- */

typedef struct {
    dtype_t dt;
    int block; /* block-scale edge, 0 for none */
    const char *name;
} mkind_t;

static const mkind_t MKINDS[] = {
    {DT_F32, 0, "f32"},           {DT_BF16, 0, "bf16"},      {DT_F16, 0, "f16"},
    {DT_F8E4M3, 0, "fp8"},        {DT_F8E4M3, 4, "fp8 b4"},  {DT_F8E4M3, 7, "fp8 b7"},
    {DT_F8E4M3, 128, "fp8 b128"}, {DT_BF16, 16, "bf16 b16"}, {DT_F32, 8, "f32 b8"},
};
#define NMKINDS (int)(sizeof MKINDS / sizeof MKINDS[0])

typedef struct {
    int T, C, OC;
    int big; /* only for kinds that exercise the tiled or direct paths */
} mshape_t;

static const mshape_t MSHAPES[] = {
    {1, 7, 5, 0},      {3, 33, 17, 0},       {16, 31, 29, 0},   {24, 9, 70, 0},
    {64, 512, 384, 0}, {257, 1024, 1000, 0}, {1, 4096, 512, 0}, {8, 4096, 8200, 1},
};
#define NMSHAPES (int)(sizeof MSHAPES / sizeof MSHAPES[0])

/* A weight on host and device. Block scales are powers of two (exact in
 * bf16) but vary 8x, so a wrong block index shows. */
typedef struct {
    void *h, *d;
    float *hs, *ds; /* scales or NULL */
    wview_t hv, dv; /* host and device views */
} mweight_t;

static void mweight_make(mweight_t *w, const mkind_t *k, int OC, int C, uint64_t seed) {
    size_t n = (size_t)OC * C, es = dtype_size(k->dt);
    float *f = hrand(n, seed, -1.0f, 1.0f);
    w->h = malloc(n * es);
    convert_from_f32(w->h, k->dt, f, n);
    free(f);
    w->d = dput(w->h, n * es);
    w->hs = w->ds = NULL;
    if (k->block) {
        size_t ns = (size_t)((OC + k->block - 1) / k->block) * ((C + k->block - 1) / k->block);
        w->hs = hrand(ns, seed + 1, 0.0f, 4.0f);
        for (size_t i = 0; i < ns; i++)
            w->hs[i] = ldexpf(1.0f, (int)w->hs[i] - 2); /* 0.25, 0.5, 1 or 2 */
        w->ds = dput(w->hs, ns * sizeof(float));
    }
    w->hv = wview_of(w->h, k->dt);
    w->dv = wview_of(w->d, k->dt);
    w->hv.scale = w->hs, w->dv.scale = w->ds;
    w->hv.block = w->dv.block = k->block;
}

static void mweight_free(mweight_t *w) {
    free(w->h);
    free(w->hs);
    dfree(w->d);
    dfree(w->ds);
}

/* The dtype the CUDA product rounds activations to (DT_F32: none). */
static dtype_t operand_dtype(const mkind_t *k) {
    if (k->dt == DT_F32)
        return DT_F32;
    return k->dt == DT_F16 && !k->block ? DT_F16 : DT_BF16;
}

static float *rounded(const float *x, size_t n, dtype_t dt) {
    float *y = hcopy(x, n);
    if (dt != DT_F32) {
        void *tmp = malloc(n * dtype_size(dt));
        convert_from_f32(tmp, dt, x, n);
        convert_to_f32(y, tmp, dt, n);
        free(tmp);
    }
    return y;
}

/* Compares a low-precision product both ways, or an f32 one tightly. */
static void check_product(const char *what, const mkind_t *k, const float *got, const float *cpu,
                          const float *cpu_rounded, size_t n) {
    char w[200];
    if (operand_dtype(k) == DT_F32) {
        TU_ASSERT_CLOSE(err(got, cpu, n), TOL_F32, what);
        return;
    }
    TU_ASSERT_CLOSE(err(got, cpu, n), TOL_LOWP, what);
    snprintf(w, sizeof w, "%s vs rounded operands", what);
    TU_ASSERT_CLOSE(err(got, cpu_rounded, n), TOL_LOWP_ROUNDED, w);
}

static void matmul_case(const mkind_t *k, mshape_t s, int with_bias, uint64_t seed) {
    int T = s.T, C = s.C, OC = s.OC;
    size_t nin = (size_t)T * C, nout = (size_t)T * OC, nw = (size_t)OC * C; /* nw: of dw */
    mweight_t w;
    mweight_make(&w, k, OC, C, seed);
    dtype_t odt = operand_dtype(k);
    float *inp = hrand(nin, seed + 2, -1, 1), *bias = hrand(OC, seed + 3, -1, 1);
    float *dout = hrand(nout, seed + 4, -1, 1);
    float *inp_r = rounded(inp, nin, odt), *dout_r = rounded(dout, nout, odt);
    float *d_inp = dput(inp, nin * 4), *d_bias = dput(bias, OC * 4), *d_dout = dput(dout, nout * 4);
    const float *hb = with_bias ? bias : NULL, *db = with_bias ? d_bias : NULL;
    char what[200];

    /* forward */
    float *ref = malloc(nout * 4), *ref_r = malloc(nout * 4), *d_out = dpoison(nout);
    KC->matmul_forward(ref, inp, &w.hv, hb, T, C, OC);
    KC->matmul_forward(ref_r, inp_r, &w.hv, hb, T, C, OC);
    KG->matmul_forward(d_out, d_inp, &w.dv, db, T, C, OC);
    float *got = dget_f(d_out, nout);
    snprintf(what, sizeof what, "matmul forward %s T=%d C=%d OC=%d bias=%d", k->name, T, C, OC,
             with_bias);
    check_product(what, k, got, ref, ref_r, nout);

    /* backward from zero: dinp, dw (trainable f32 weights only), dbias */
    int train = k->dt == DT_F32 && !k->block;
    if (!train)
        nw = 1; /* a dw buffer that must stay untouched */
    float *e_in = hzeros(nin), *e_in_r = hzeros(nin), *e_w = hzeros(nw), *e_b = hzeros(OC);
    KC->matmul_backward(e_in, train ? e_w : NULL, e_b, dout, inp, &w.hv, T, C, OC);
    KC->matmul_backward(e_in_r, NULL, NULL, dout_r, inp, &w.hv, T, C, OC);
    float *d_gin = dzeros(nin), *d_gw = dzeros(nw), *d_gb = dzeros(OC);
    KG->matmul_backward(d_gin, train ? d_gw : NULL, d_gb, d_dout, d_inp, &w.dv, T, C, OC);
    float *g_in = dget_f(d_gin, nin), *g_w = dget_f(d_gw, nw), *g_b = dget_f(d_gb, OC);
    snprintf(what, sizeof what, "matmul dinp %s T=%d C=%d OC=%d", k->name, T, C, OC);
    check_product(what, k, g_in, e_in, e_in_r, nin);
    snprintf(what, sizeof what, "matmul dbias %s T=%d C=%d OC=%d", k->name, T, C, OC);
    TU_ASSERT_CLOSE(err(g_b, e_b, OC), TOL_F32, what);
    if (train) {
        snprintf(what, sizeof what, "matmul dw T=%d C=%d OC=%d", T, C, OC);
        TU_ASSERT_CLOSE(err(g_w, e_w, nw), TOL_F32, what);
    }

    /* backward onto prefilled gradients */
    float *p_in = hrand(nin, seed + 5, -1, 1), *p_w = hrand(nw, seed + 6, -1, 1);
    float *p_b = hrand(OC, seed + 7, -1, 1);
    dset(d_gin, p_in, nin * 4), dset(d_gw, p_w, nw * 4), dset(d_gb, p_b, OC * 4);
    KG->matmul_backward(d_gin, train ? d_gw : NULL, d_gb, d_dout, d_inp, &w.dv, T, C, OC);
    float *a_in = dget_f(d_gin, nin), *a_w = dget_f(d_gw, nw), *a_b = dget_f(d_gb, OC);
    snprintf(what, sizeof what, "matmul backward %s T=%d C=%d OC=%d", k->name, T, C, OC);
    check_acc(what, p_in, g_in, a_in, nin);
    check_acc(what, p_b, g_b, a_b, OC);
    if (train)
        check_acc(what, p_w, g_w, a_w, nw);
    else
        CU_ASSERT_EQUAL(memcmp(a_w, p_w, nw * 4), 0); /* dw NULL: untouched */

    free(got), free(ref), free(ref_r), free(e_in), free(e_in_r), free(e_w), free(e_b);
    free(g_in), free(g_w), free(g_b), free(p_in), free(p_w), free(p_b), free(a_in), free(a_w);
    free(a_b), free(inp), free(bias), free(dout), free(inp_r), free(dout_r);
    dfree(d_inp), dfree(d_bias), dfree(d_dout), dfree(d_out), dfree(d_gin), dfree(d_gw);
    dfree(d_gb);
    mweight_free(&w);
}

static void test_matmul(void) {
    for (int ki = 0; ki < NMKINDS; ki++)
        for (int si = 0; si < NMSHAPES; si++) {
            const mkind_t *k = &MKINDS[ki];
            if (MSHAPES[si].big && !(k->dt == DT_BF16 && !k->block) &&
                !(k->dt == DT_F8E4M3 && k->block == 128))
                continue;
            matmul_case(k, MSHAPES[si], si % 2, 1000 + 37 * ki + si);
        }
}

/* One gradient asked at a time: the others stay untouched. */
static void test_matmul_null_outputs(void) {
    enum { T = 20, C = 40, OC = 24 };
    float *inp = hrand(T * C, 11, -1, 1), *w = hrand(OC * C, 12, -1, 1);
    float *dout = hrand(T * OC, 13, -1, 1);
    wview_t hv = wview_f32(w);
    float *e_in = hzeros(T * C), *e_w = hzeros(OC * C), *e_b = hzeros(OC);
    KC->matmul_backward(e_in, e_w, e_b, dout, inp, &hv, T, C, OC);
    float *d_inp = dput(inp, sizeof(float) * T * C), *d_w = dput(w, sizeof(float) * OC * C);
    float *d_dout = dput(dout, sizeof(float) * T * OC);
    wview_t dv = wview_f32(d_w);
    for (int which = 0; which < 3; which++) {
        float *d_gin = dzeros(T * C), *d_gw = dzeros(OC * C), *d_gb = dzeros(OC);
        KG->matmul_backward(which == 0 ? d_gin : NULL, which == 1 ? d_gw : NULL,
                            which == 2 ? d_gb : NULL, d_dout, d_inp, &dv, T, C, OC);
        float *g_in = dget_f(d_gin, T * C), *g_w = dget_f(d_gw, OC * C), *g_b = dget_f(d_gb, OC);
        float *z_in = hzeros(T * C), *z_w = hzeros(OC * C), *z_b = hzeros(OC);
        TU_ASSERT_CLOSE(err(g_in, which == 0 ? e_in : z_in, T * C), TOL_F32, "dinp alone");
        TU_ASSERT_CLOSE(err(g_w, which == 1 ? e_w : z_w, OC * C), TOL_F32, "dw alone");
        TU_ASSERT_CLOSE(err(g_b, which == 2 ? e_b : z_b, OC), TOL_F32, "dbias alone");
        free(g_in), free(g_w), free(g_b), free(z_in), free(z_w), free(z_b);
        dfree(d_gin), dfree(d_gw), dfree(d_gb);
    }
    free(inp), free(w), free(dout), free(e_in), free(e_w), free(e_b);
    dfree(d_inp), dfree(d_w), dfree(d_dout);
}

/* ---- embedding ---- */

static void test_embedding(void) {
    const struct {
        int T, V, D;
    } shapes[] = {{5, 1, 1},   {11, 7, 1},   {11, 33, 20},
                  {3, 300, 9}, {40, 64, 64}, {1000, 5000, 256}};
    const mkind_t kinds[] = {{DT_F32, 0, "f32"},
                             {DT_BF16, 0, "bf16"},
                             {DT_F16, 0, "f16"},
                             {DT_F8E4M3, 0, "fp8"},
                             {DT_F8E4M3, 4, "fp8 b4"}};
    char what[160];
    for (int si = 0; si < 6; si++) {
        int T = shapes[si].T, V = shapes[si].V, D = shapes[si].D;
        size_t nout = (size_t)T * D, nw = (size_t)V * D;
        int32_t *ids = hids(T, 200 + si, V);
        int32_t *d_ids = dput(ids, T * sizeof(int32_t));
        for (int ki = 0; ki < 5; ki++) {
            mweight_t w;
            mweight_make(&w, &kinds[ki], V, D, 300 + 10 * si + ki);
            float *ref = malloc(nout * 4), *d_out = dpoison(nout);
            KC->embedding_forward(ref, ids, &w.hv, T, D);
            KG->embedding_forward(d_out, d_ids, &w.dv, T, D);
            float *got = dget_f(d_out, nout);
            snprintf(what, sizeof what, "embedding forward %s T=%d V=%d D=%d", kinds[ki].name, T, V,
                     D);
            TU_ASSERT_CLOSE(err(got, ref, nout), 0.0, what); /* the same conversions */
            free(ref), free(got);
            dfree(d_out);
            mweight_free(&w);
        }
        /* backward: repeated ids sum in token order on both sides */
        float *dout = hrand(nout, 400 + si, -1, 1), *d_dout = dput(dout, nout * 4);
        float *e = hzeros(nw), *d_g = dzeros(nw);
        KC->embedding_backward(e, dout, ids, T, D);
        KG->embedding_backward(d_g, d_dout, d_ids, T, D);
        float *g = dget_f(d_g, nw);
        snprintf(what, sizeof what, "embedding backward T=%d V=%d D=%d", T, V, D);
        TU_ASSERT_CLOSE(err(g, e, nw), 0.0, what);
        float *pre = hrand(nw, 500 + si, -1, 1);
        dset(d_g, pre, nw * 4);
        KG->embedding_backward(d_g, d_dout, d_ids, T, D);
        float *acc = dget_f(d_g, nw);
        check_acc(what, pre, g, acc, nw);
        free(dout), free(e), free(g), free(pre), free(acc), free(ids);
        dfree(d_dout), dfree(d_g), dfree(d_ids);
    }
}

/* ---- rmsnorm ---- */

static void test_rmsnorm(void) {
    const struct {
        int N, D;
        float eps;
    } shapes[] = {{1, 1, 0.1f},     {1, 7, 1e-5f},     {3, 64, 1e-6f},     {5, 33, 1e-6f},
                  {17, 300, 1e-5f}, {64, 1031, 1e-6f}, {512, 4096, 1e-5f}, {3, 8192, 1e-6f}};
    char what[160];
    for (int si = 0; si < 8; si++) {
        int N = shapes[si].N, D = shapes[si].D;
        size_t n = (size_t)N * D;
        for (int ww = 0; ww < 2; ww++) {
            uint64_t seed = 600 + 10 * si + ww;
            float *x = hrand(n, seed, -2, 2), *w = hrand(D, seed + 1, 0.5f, 1.5f);
            float *dout = hrand(n, seed + 2, -1, 1);
            float *d_x = dput(x, n * 4), *d_w = dput(w, D * 4), *d_dout = dput(dout, n * 4);
            const float *hw = ww ? w : NULL, *dw_in = ww ? d_w : NULL;
            float *ref = malloc(n * 4), *rstd = malloc(N * 4);
            float *d_out = dpoison(n), *d_rstd = dpoison(N);
            KC->rmsnorm_forward(ref, rstd, x, hw, N, D, shapes[si].eps);
            KG->rmsnorm_forward(d_out, d_rstd, d_x, dw_in, N, D, shapes[si].eps);
            float *got = dget_f(d_out, n), *grstd = dget_f(d_rstd, N);
            snprintf(what, sizeof what, "rmsnorm forward N=%d D=%d w=%d", N, D, ww);
            TU_ASSERT_CLOSE(err(got, ref, n), TOL_F32, what);
            TU_ASSERT_CLOSE(err(grstd, rstd, N), TOL_F32, what);
            /* backward from the CPU's rstd, each gradient alone and both */
            float *d_rs = dput(rstd, N * 4);
            float *e_x = hzeros(n), *e_w = hzeros(D);
            KC->rmsnorm_backward(e_x, e_w, dout, x, hw, rstd, N, D);
            for (int which = 0; which < 3; which++) {
                float *d_gx = dzeros(n), *d_gw = dzeros(D);
                KG->rmsnorm_backward(which != 1 ? d_gx : NULL, which != 0 ? d_gw : NULL, d_dout,
                                     d_x, dw_in, d_rs, N, D);
                float *gx = dget_f(d_gx, n), *gw = dget_f(d_gw, D);
                float *zx = hzeros(n), *zw = hzeros(D);
                snprintf(what, sizeof what, "rmsnorm backward N=%d D=%d w=%d (%s)", N, D, ww,
                         which == 0   ? "dx"
                         : which == 1 ? "dw"
                                      : "both");
                TU_ASSERT_CLOSE(err(gx, which != 1 ? e_x : zx, n), TOL_F32, what);
                TU_ASSERT_CLOSE(err(gw, which != 0 ? e_w : zw, D), TOL_F32, what);
                if (which == 2) {
                    float *px = hrand(n, seed + 3, -1, 1), *pw = hrand(D, seed + 4, -1, 1);
                    dset(d_gx, px, n * 4), dset(d_gw, pw, D * 4);
                    KG->rmsnorm_backward(d_gx, d_gw, d_dout, d_x, dw_in, d_rs, N, D);
                    float *ax = dget_f(d_gx, n), *aw = dget_f(d_gw, D);
                    check_acc(what, px, gx, ax, n);
                    check_acc(what, pw, gw, aw, D);
                    free(px), free(pw), free(ax), free(aw);
                }
                free(gx), free(gw), free(zx), free(zw);
                dfree(d_gx), dfree(d_gw);
            }
            free(x), free(w), free(dout), free(ref), free(rstd), free(got), free(grstd);
            free(e_x), free(e_w);
            dfree(d_x), dfree(d_w), dfree(d_dout), dfree(d_out), dfree(d_rstd), dfree(d_rs);
        }
    }
}

/* ---- rope ---- */

static void test_rope(void) {
    const struct {
        int N, H, Dh, rot;
        float mscale, theta;
        int maxpos;
    } shapes[] = {
        {1, 1, 2, 2, 1.0f, 10000.0f, 10},        {3, 2, 8, 8, 1.0f, 10000.0f, 10},
        {5, 3, 10, 6, 1.3f, 10000.0f, 100},      {4, 2, 64, 32, 0.9f, 10000.0f, 4096},
        {2, 1, 260, 258, 1.0f, 500000.0f, 9000}, {9, 4, 128, 64, 1.0f, 1e6f, 131072},
        {1000, 8, 128, 128, 1.0f, 1e6f, 100000}, {300, 4, 192, 64, 0.7f, 10000.0f, 32768}};
    char what[160];
    for (int si = 0; si < 8; si++) {
        int N = shapes[si].N, H = shapes[si].H, Dh = shapes[si].Dh, rot = shapes[si].rot;
        size_t n = (size_t)N * H * Dh;
        float inv_freq[256], ms0 = 0.0f;
        CU_ASSERT_FATAL(rope_init(inv_freq, &ms0, rot, shapes[si].theta, NULL) == 0);
        float ms = shapes[si].mscale * ms0;
        int32_t *pos = hids(N, 700 + si, shapes[si].maxpos);
        float *x = hrand(n, 710 + si, -1, 1), *dout = hrand(n, 720 + si, -1, 1);
        int32_t *d_pos = dput(pos, N * sizeof(int32_t));
        float *d_f = dput(inv_freq, sizeof(float) * (rot / 2)), *d_x = dput(x, n * 4);
        float *d_dout = dput(dout, n * 4), *d_out = dpoison(n);
        float *ref = malloc(n * 4);
        KC->rope_forward(ref, x, pos, inv_freq, ms, N, H, Dh, rot);
        KG->rope_forward(d_out, d_x, d_pos, d_f, ms, N, H, Dh, rot);
        float *got = dget_f(d_out, n);
        snprintf(what, sizeof what, "rope forward N=%d H=%d Dh=%d rot=%d", N, H, Dh, rot);
        TU_ASSERT_CLOSE(err(got, ref, n), TOL_EW, what);
        KG->rope_forward(d_x, d_x, d_pos, d_f, ms, N, H, Dh, rot); /* in place */
        float *inpl = dget_f(d_x, n);
        snprintf(what, sizeof what, "rope forward in place N=%d H=%d Dh=%d rot=%d", N, H, Dh, rot);
        TU_ASSERT_CLOSE(err(inpl, ref, n), TOL_EW, what);
        float *e = hzeros(n), *d_g = dzeros(n);
        KC->rope_backward(e, dout, pos, inv_freq, ms, N, H, Dh, rot);
        KG->rope_backward(d_g, d_dout, d_pos, d_f, ms, N, H, Dh, rot);
        float *g = dget_f(d_g, n);
        snprintf(what, sizeof what, "rope backward N=%d H=%d Dh=%d rot=%d", N, H, Dh, rot);
        TU_ASSERT_CLOSE(err(g, e, n), TOL_EW, what);
        float *pre = hrand(n, 730 + si, -1, 1);
        dset(d_g, pre, n * 4);
        KG->rope_backward(d_g, d_dout, d_pos, d_f, ms, N, H, Dh, rot);
        float *acc = dget_f(d_g, n);
        check_acc(what, pre, g, acc, n);
        free(pos), free(x), free(dout), free(ref), free(got), free(inpl), free(e), free(g);
        free(pre), free(acc);
        dfree(d_pos), dfree(d_f), dfree(d_x), dfree(d_dout), dfree(d_out), dfree(d_g);
    }
}

/* ---- attention ---- */

typedef struct {
    const char *name;
    int B;
    int32_t cu[6]; /* (B + 1) */
    int H, Hkv, Dh, window;
    float scale;
} acase_t;

static const acase_t ACASES[] = {
    /* the CPU suite's shapes */
    {"mha single", 1, {0, 9}, 2, 2, 5, 0, 0.6f},
    {"gqa varlen window", 3, {0, 6, 7, 11}, 8, 2, 3, 3, 0.8f},
    {"gqa varlen", 3, {0, 5, 6, 14}, 8, 2, 4, 0, 0.7f},
    {"mqa varlen", 3, {0, 1, 8, 13}, 3, 1, 4, 0, 0.7f},
    {"mha window", 1, {0, 10}, 2, 2, 7, 4, 0.5f},
    {"mqa multiblock window", 2, {0, 40, 75}, 2, 1, 3, 35, 0.9f},
    {"gqa 70/1/45", 3, {0, 70, 71, 116}, 4, 2, 16, 0, 0.25f},
    {"gqa 70/1/45 window 40", 3, {0, 70, 71, 116}, 4, 2, 16, 40, 0.25f},
    {"mqa 100 window 33 Dh 67", 1, {0, 100}, 2, 1, 67, 33, 0.12f},
    {"mha 64/33 window 32", 2, {0, 64, 97}, 4, 4, 8, 32, 0.35f},
    {"mha 1/1/1", 3, {0, 1, 2, 3}, 2, 2, 6, 0, 0.4f},
    /* medium, and the head-dim boundaries of the CUDA kernels */
    {"gqa Dh 128 varlen", 4, {0, 300, 301, 430, 942}, 8, 2, 128, 0, 0.0883883f},
    {"gqa Dh 128 window 100", 4, {0, 300, 301, 430, 942}, 8, 2, 128, 100, 0.0883883f},
    {"mqa Dh 64 window 64", 1, {0, 700}, 8, 1, 64, 64, 0.125f},
    {"mha Dh 256", 2, {0, 200, 333}, 4, 4, 256, 0, 0.0625f},
    {"gqa Dh 32 empty seq", 3, {0, 50, 50, 97}, 4, 2, 32, 0, 0.5f},
    {"gqa Dh 33 peaky", 2, {0, 129, 160}, 6, 3, 33, 0, 1.0f},
    {"mha Dh 65 window 1", 1, {0, 80}, 2, 2, 65, 1, 0.3f},
    {"gqa Dh 192", 2, {0, 97, 230}, 4, 1, 192, 17, 0.0721688f},
};
#define NACASES (int)(sizeof ACASES / sizeof ACASES[0])

/* True when every query sees exactly one key (window 1, or sequences of one
 * token): dq and dk are then exactly zero and both sides compute rounding noise
 * (~1e-7), so they are compared absolutely (normalised by 1) instead. */
static int single_key(const acase_t *c) {
    int longest = 0;
    for (int b = 0; b < c->B; b++)
        longest = c->cu[b + 1] - c->cu[b] > longest ? c->cu[b + 1] - c->cu[b] : longest;
    return c->window == 1 || longest <= 1;
}

static void attention_case(const acase_t *c, uint64_t seed) {
    int T = c->cu[c->B], B = c->B, H = c->H, Hkv = c->Hkv, Dh = c->Dh;
    size_t nq = (size_t)T * H * Dh, nkv = (size_t)T * Hkv * Dh, nl = (size_t)T * H;
    float *q = hrand(nq, seed, -1, 1), *k = hrand(nkv, seed + 1, -1, 1);
    float *v = hrand(nkv, seed + 2, -1, 1), *dout = hrand(nq, seed + 3, -1, 1);
    float *d_q = dput(q, nq * 4), *d_k = dput(k, nkv * 4), *d_v = dput(v, nkv * 4);
    float *d_dout = dput(dout, nq * 4);
    int32_t *d_cu = dput(c->cu, sizeof(int32_t) * (B + 1));
    double fl = single_key(c) ? 1.0 : 1e-6; /* floor of the dq and dk errors */
    char what[200];

    float *out = malloc(nq * 4), *lse = malloc(nl * 4), *d_out = dpoison(nq), *d_lse = dpoison(nl);
    KC->attention_forward(out, lse, q, k, v, c->cu, B, H, Hkv, Dh, c->scale, c->window);
    KG->attention_forward(d_out, d_lse, d_q, d_k, d_v, d_cu, B, H, Hkv, Dh, c->scale, c->window);
    float *g_out = dget_f(d_out, nq), *g_lse = dget_f(d_lse, nl);
    snprintf(what, sizeof what, "attention forward %s", c->name);
    TU_ASSERT_CLOSE(err(g_out, out, nq), TOL_F32, what);
    snprintf(what, sizeof what, "attention lse %s", c->name);
    TU_ASSERT_CLOSE(err(g_lse, lse, nl), TOL_F32, what);

    /* backward on the CPU's out and lse, from zero */
    float *c_out = dput(out, nq * 4), *c_lse = dput(lse, nl * 4);
    float *e_q = hzeros(nq), *e_k = hzeros(nkv), *e_v = hzeros(nkv);
    KC->attention_backward(e_q, e_k, e_v, dout, q, k, v, out, lse, c->cu, B, H, Hkv, Dh, c->scale,
                           c->window);
    float *d_gq = dzeros(nq), *d_gk = dzeros(nkv), *d_gv = dzeros(nkv);
    KG->attention_backward(d_gq, d_gk, d_gv, d_dout, d_q, d_k, d_v, c_out, c_lse, d_cu, B, H, Hkv,
                           Dh, c->scale, c->window);
    float *g_q = dget_f(d_gq, nq), *g_k = dget_f(d_gk, nkv), *g_v = dget_f(d_gv, nkv);
    snprintf(what, sizeof what, "attention dq %s", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_ff(g_q, e_q, nq, fl), TOL_F32, what);
    snprintf(what, sizeof what, "attention dk %s", c->name);
    TU_ASSERT_CLOSE(tu_rel_err_ff(g_k, e_k, nkv, fl), TOL_F32, what);
    snprintf(what, sizeof what, "attention dv %s", c->name);
    TU_ASSERT_CLOSE(err(g_v, e_v, nkv), TOL_F32, what);

    /* each gradient alone */
    for (int which = 0; which < 3; which++) {
        float *d_x = which == 0 ? dzeros(nq) : dzeros(nkv);
        KG->attention_backward(which == 0 ? d_x : NULL, which == 1 ? d_x : NULL,
                               which == 2 ? d_x : NULL, d_dout, d_q, d_k, d_v, c_out, c_lse, d_cu,
                               B, H, Hkv, Dh, c->scale, c->window);
        size_t n = which == 0 ? nq : nkv;
        float *x = dget_f(d_x, n);
        snprintf(what, sizeof what, "attention %s alone %s", which == 0 ? "dq" : "dk/dv", c->name);
        const float *e = which == 0 ? e_q : which == 1 ? e_k : e_v;
        TU_ASSERT_CLOSE(tu_rel_err_ff(x, e, n, which == 2 ? 1e-6 : fl), TOL_F32, what);
        free(x);
        dfree(d_x);
    }

    /* onto prefilled gradients */
    float *p_q = hrand(nq, seed + 4, -1, 1), *p_k = hrand(nkv, seed + 5, -1, 1);
    float *p_v = hrand(nkv, seed + 6, -1, 1);
    dset(d_gq, p_q, nq * 4), dset(d_gk, p_k, nkv * 4), dset(d_gv, p_v, nkv * 4);
    KG->attention_backward(d_gq, d_gk, d_gv, d_dout, d_q, d_k, d_v, c_out, c_lse, d_cu, B, H, Hkv,
                           Dh, c->scale, c->window);
    float *a_q = dget_f(d_gq, nq), *a_k = dget_f(d_gk, nkv), *a_v = dget_f(d_gv, nkv);
    snprintf(what, sizeof what, "attention backward %s", c->name);
    check_acc(what, p_q, g_q, a_q, nq);
    check_acc(what, p_k, g_k, a_k, nkv);
    check_acc(what, p_v, g_v, a_v, nkv);

    free(q), free(k), free(v), free(dout), free(out), free(lse), free(g_out), free(g_lse);
    free(e_q), free(e_k), free(e_v), free(g_q), free(g_k), free(g_v), free(p_q), free(p_k);
    free(p_v), free(a_q), free(a_k), free(a_v);
    dfree(d_q), dfree(d_k), dfree(d_v), dfree(d_dout), dfree(d_cu), dfree(d_out), dfree(d_lse);
    dfree(c_out), dfree(c_lse), dfree(d_gq), dfree(d_gk), dfree(d_gv);
}

static void test_attention(void) {
    for (int i = 0; i < NACASES; i++)
        attention_case(&ACASES[i], 800 + 10 * i);
}

/* ---- swiglu ---- */

static void test_swiglu(void) {
    const size_t sizes[] = {1, 7, 1000, 70001, 3000017};
    char what[120];
    for (int si = 0; si < 5; si++) {
        size_t n = sizes[si];
        float *gate = hrand(n, 900 + si, -6, 6), *up = hrand(n, 910 + si, -2, 2);
        float *dout = hrand(n, 920 + si, -1, 1);
        float *d_gate = dput(gate, n * 4), *d_up = dput(up, n * 4), *d_dout = dput(dout, n * 4);
        float *ref = malloc(n * 4), *d_out = dpoison(n);
        KC->swiglu_forward(ref, gate, up, n);
        KG->swiglu_forward(d_out, d_gate, d_up, n);
        float *got = dget_f(d_out, n);
        snprintf(what, sizeof what, "swiglu forward n=%zu", n);
        TU_ASSERT_CLOSE(err(got, ref, n), TOL_EW, what);
        float *e_g = hzeros(n), *e_u = hzeros(n);
        KC->swiglu_backward(e_g, e_u, dout, gate, up, n);
        for (int which = 0; which < 3; which++) {
            float *d_gg = dzeros(n), *d_gu = dzeros(n);
            KG->swiglu_backward(which != 1 ? d_gg : NULL, which != 0 ? d_gu : NULL, d_dout, d_gate,
                                d_up, n);
            float *gg = dget_f(d_gg, n), *gu = dget_f(d_gu, n), *z = hzeros(n);
            snprintf(what, sizeof what, "swiglu backward n=%zu (%d)", n, which);
            TU_ASSERT_CLOSE(err(gg, which != 1 ? e_g : z, n), TOL_EW, what);
            TU_ASSERT_CLOSE(err(gu, which != 0 ? e_u : z, n), TOL_EW, what);
            if (which == 2) {
                float *pg = hrand(n, 930 + si, -1, 1), *pu = hrand(n, 940 + si, -1, 1);
                dset(d_gg, pg, n * 4), dset(d_gu, pu, n * 4);
                KG->swiglu_backward(d_gg, d_gu, d_dout, d_gate, d_up, n);
                float *ag = dget_f(d_gg, n), *au = dget_f(d_gu, n);
                check_acc(what, pg, gg, ag, n);
                check_acc(what, pu, gu, au, n);
                free(pg), free(pu), free(ag), free(au);
            }
            free(gg), free(gu), free(z);
            dfree(d_gg), dfree(d_gu);
        }
        free(gate), free(up), free(dout), free(ref), free(got), free(e_g), free(e_u);
        dfree(d_gate), dfree(d_up), dfree(d_dout), dfree(d_out);
    }
}

/* ---- softmax ---- */

static void test_softmax(void) {
    const struct {
        int N, C;
    } shapes[] = {{3, 17}, {4, 9}, {2, 1}, {64, 1000}, {7, 50000}, {1000, 128}};
    char what[120];
    for (int si = 0; si < 6; si++) {
        int N = shapes[si].N, C = shapes[si].C;
        size_t n = (size_t)N * C;
        float *x = hrand(n, 1000 + si, -8, 8), *dout = hrand(n, 1010 + si, -1, 1);
        float *d_x = dput(x, n * 4), *d_dout = dput(dout, n * 4);
        float *ref = malloc(n * 4), *d_out = dpoison(n);
        KC->softmax_forward(ref, x, N, C);
        KG->softmax_forward(d_out, d_x, N, C);
        float *got = dget_f(d_out, n);
        snprintf(what, sizeof what, "softmax forward N=%d C=%d", N, C);
        TU_ASSERT_CLOSE(err(got, ref, n), TOL_F32, what);
        float *d_y = dput(ref, n * 4), *e = hzeros(n), *d_g = dzeros(n);
        KC->softmax_backward(e, dout, ref, N, C);
        KG->softmax_backward(d_g, d_dout, d_y, N, C);
        float *g = dget_f(d_g, n);
        snprintf(what, sizeof what, "softmax backward N=%d C=%d", N, C);
        TU_ASSERT_CLOSE(err(g, e, n), TOL_F32, what);
        float *pre = hrand(n, 1020 + si, -1, 1);
        dset(d_g, pre, n * 4);
        KG->softmax_backward(d_g, d_dout, d_y, N, C);
        float *acc = dget_f(d_g, n);
        check_acc(what, pre, g, acc, n);
        free(x), free(dout), free(ref), free(got), free(e), free(g), free(pre), free(acc);
        dfree(d_x), dfree(d_dout), dfree(d_out), dfree(d_y), dfree(d_g);
    }
}

/* ---- topk ---- */

static void test_topk(void) {
    const struct {
        int N, C, K;
    } shapes[] = {{4, 19, 5},   {3, 6, 6},     {5, 3, 1},      {1000, 128, 8},
                  {64, 384, 8}, {7, 1000, 64}, {2, 50000, 50}, {9, 33, 33}};
    char what[120];
    for (int si = 0; si < 8; si++) {
        int N = shapes[si].N, C = shapes[si].C, K = shapes[si].K;
        size_t n = (size_t)N * C, nk = (size_t)N * K;
        float *x = hrand(n, 1100 + si, -2, 2);
        for (size_t i = 0; i < n; i++)
            x[i] = floorf(x[i] * 4.0f) / 4.0f; /* many ties */
        for (int r = 0; r < N; r += 2) {       /* NaN, -0 and 0 in every other row */
            x[(size_t)r * C + (size_t)(r * 7) % C] = NAN;
            x[(size_t)r * C + (size_t)(r * 7 + 3) % C] = -0.0f;
            if (C > 5)
                x[(size_t)r * C + (size_t)(r * 7 + 5) % C] = NAN;
        }
        float *d_x = dput(x, n * 4), *d_val = dpoison(nk);
        int32_t *idx = malloc(nk * 4), *d_idx = dnew(nk * 4);
        float *val = malloc(nk * 4);
        KC->topk_forward(idx, val, x, N, C, K);
        KG->topk_forward(d_idx, d_val, d_x, N, C, K);
        int32_t *gi = malloc(nk * 4);
        float *gv = malloc(nk * 4);
        dget(gi, d_idx, nk * 4);
        dget(gv, d_val, nk * 4);
        snprintf(what, sizeof what, "topk N=%d C=%d K=%d", N, C, K);
        int same_i = memcmp(gi, idx, nk * 4) == 0, same_v = memcmp(gv, val, nk * 4) == 0;
        if (!same_i || !same_v)
            tu_report("%s: indices %s, values %s", what, same_i ? "equal" : "differ",
                      same_v ? "equal" : "differ");
        CU_ASSERT(same_i && same_v);
        /* backward: one add per entry on both sides, so bit-exact */
        float *dval = hrand(nk, 1120 + si, -1, 1), *pre = hrand(n, 1130 + si, -1, 1);
        float *d_dval = dput(dval, nk * 4), *d_g = dput(pre, n * 4), *e = hcopy(pre, n);
        int32_t *d_ci = dput(idx, nk * 4);
        KC->topk_backward(e, dval, idx, N, C, K);
        KG->topk_backward(d_g, d_dval, d_ci, N, C, K);
        float *g = dget_f(d_g, n);
        snprintf(what, sizeof what, "topk backward N=%d C=%d K=%d", N, C, K);
        TU_ASSERT_CLOSE(err(g, e, n), 0.0, what);
        free(x), free(idx), free(val), free(gi), free(gv), free(dval), free(pre), free(e), free(g);
        dfree(d_x), dfree(d_val), dfree(d_idx), dfree(d_dval), dfree(d_g), dfree(d_ci);
    }
}

/* ---- logprob ---- */

/* Normalised error over entries other than each row's target. */
static double err_off_target(const float *a, const float *b, const int32_t *t, int N, int V) {
    size_t n = (size_t)N * V;
    float *x = hcopy(a, n), *y = hcopy(b, n);
    for (int r = 0; r < N; r++)
        x[(size_t)r * V + t[r]] = y[(size_t)r * V + t[r]] = 0.0f;
    double e = tu_rel_err_ff(x, y, n, 1e-30);
    free(x), free(y);
    return e;
}

static void logprob_case(int N, int V, float temp, uint64_t seed) {
    size_t n = (size_t)N * V;
    float *l = hrand(n, seed, -4, 4);
    l[5 % V] = 40.0f; /* an outlier in row 0 */
    int32_t *t = hids(N, seed + 1, V);
    t[0] = 5 % V;
    float *dlp = hrand(N, seed + 2, -1, 1), *dent = hrand(N, seed + 3, -1, 1);
    dent[0] = 0.0f; /* the kernel skips the entropy pass for a zero weight */
    float *d_l = dput(l, n * 4), *d_dlp = dput(dlp, N * 4), *d_dent = dput(dent, N * 4);
    int32_t *d_t = dput(t, N * 4);
    char what[160];
    float *lp = malloc(N * 4), *ent = malloc(N * 4), *lse = malloc(N * 4);
    KC->logprob_forward(lp, ent, lse, l, t, N, V, temp);
    for (int with_ent = 0; with_ent < 2; with_ent++) {
        float *d_lp = dpoison(N), *d_ent = dpoison(N), *d_lse = dpoison(N);
        KG->logprob_forward(d_lp, with_ent ? d_ent : NULL, d_lse, d_l, d_t, N, V, temp);
        float *g_lp = dget_f(d_lp, N), *g_ent = dget_f(d_ent, N), *g_lse = dget_f(d_lse, N);
        snprintf(what, sizeof what, "logprob forward N=%d V=%d T=%g entropy=%d", N, V, temp,
                 with_ent);
        TU_ASSERT_CLOSE(err(g_lp, lp, N), TOL_F32, what);
        TU_ASSERT_CLOSE(err(g_lse, lse, N), TOL_F32, what);
        if (with_ent)
            TU_ASSERT_CLOSE(err(g_ent, ent, N), TOL_F32, what);
        else
            CU_ASSERT(isnan(g_ent[0])); /* NULL entropy: untouched */
        free(g_lp), free(g_ent), free(g_lse);
        dfree(d_lp), dfree(d_ent), dfree(d_lse);
    }
    float *d_lse = dput(lse, N * 4);
    for (int mode = 0; mode < 3; mode++) { /* dlogp, dentropy, both */
        const float *a = mode != 1 ? dlp : NULL, *b = mode != 0 ? dent : NULL;
        const float *da = mode != 1 ? d_dlp : NULL, *dbb = mode != 0 ? d_dent : NULL;
        float *e = hzeros(n), *d_g = dzeros(n);
        KC->logprob_backward(e, a, b, l, lse, t, N, V, temp);
        KG->logprob_backward(d_g, da, dbb, d_l, d_lse, d_t, N, V, temp);
        float *g = dget_f(d_g, n);
        snprintf(what, sizeof what, "logprob backward N=%d V=%d T=%g mode=%d", N, V, temp, mode);
        TU_ASSERT_CLOSE(err(g, e, n), TOL_F32, what);
        snprintf(what, sizeof what, "logprob backward off target N=%d V=%d T=%g mode=%d", N, V,
                 temp, mode);
        TU_ASSERT_CLOSE(err_off_target(g, e, t, N, V), TOL_F32, what);
        if (mode == 2) {
            float *pre = hrand(n, seed + 4, -1.0f, 1.0f);
            dset(d_g, pre, n * 4);
            KG->logprob_backward(d_g, da, dbb, d_l, d_lse, d_t, N, V, temp);
            float *acc = dget_f(d_g, n);
            check_acc(what, pre, g, acc, n);
            free(pre), free(acc);
        }
        free(e), free(g);
        dfree(d_g);
    }
    free(l), free(t), free(dlp), free(dent), free(lp), free(ent), free(lse);
    dfree(d_l), dfree(d_dlp), dfree(d_dent), dfree(d_t), dfree(d_lse);
}

static void test_logprob(void) {
    const struct { int N, V; } shapes[] = {{3, 40}, {33, 1000}, {64, 151936}, {4, 262145}, {1, 1}};
    const float temps[2] = {1.0f, 0.7f};
    for (int si = 0; si < 5; si++)
        for (int ti = 0; ti < 2; ti++)
            logprob_case(shapes[si].N, shapes[si].V, temps[ti], 1200 + 10 * si + ti);
}

/* ---- adamw ---- */

static void test_adamw(void) {
    const struct {
        float lr, b1, b2, eps, wd;
    } hp[] = {{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f},
              {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f},
              {3e-4f, 0.8f, 0.99f, 1e-6f, 0.0f}};
    const size_t sizes[] = {1, 13, 100003, 1u << 20};
    char what[120];
    for (int hi = 0; hi < 3; hi++)
        for (int si = 0; si < 4; si++) {
            size_t n = sizes[si];
            uint64_t seed = 1300 + 10 * hi + si;
            float *p = hrand(n, seed, -1, 1), *m = hrand(n, seed + 1, -0.1f, 0.1f);
            float *v = hrand(n, seed + 2, 0.0f, 0.01f);
            float *d_p = dput(p, n * 4), *d_m = dput(m, n * 4), *d_v = dput(v, n * 4);
            for (int step = 1; step <= 3; step++) {
                float *g = hrand(n, seed + 10 * step, -1, 1), *d_gr = dput(g, n * 4);
                KC->adamw_update(p, g, m, v, n, hp[hi].lr, hp[hi].b1, hp[hi].b2, hp[hi].eps,
                                 hp[hi].wd, step);
                KG->adamw_update(d_p, d_gr, d_m, d_v, n, hp[hi].lr, hp[hi].b1, hp[hi].b2,
                                 hp[hi].eps, hp[hi].wd, step);
                free(g);
                dfree(d_gr);
            }
            float *gp = dget_f(d_p, n), *gm = dget_f(d_m, n), *gv = dget_f(d_v, n);
            snprintf(what, sizeof what, "adamw n=%zu set %d", n, hi);
            TU_ASSERT_CLOSE(err(gp, p, n), TOL_EW, what);
            TU_ASSERT_CLOSE(err(gm, m, n), TOL_EW, what);
            TU_ASSERT_CLOSE(err(gv, v, n), TOL_EW, what);
            free(p), free(m), free(v), free(gp), free(gm), free(gv);
            dfree(d_p), dfree(d_m), dfree(d_v);
        }
}

static CU_TestInfo g_tests[] = {
    {"backend_basics", test_backend_basics},
    {"pool_reuse", test_pool_reuse},
    {"stream", test_stream},
    {"thread", test_thread},
    {"errors", test_errors},
    {"matmul", test_matmul},
    {"matmul_null_outputs", test_matmul_null_outputs},
    {"embedding", test_embedding},
    {"rmsnorm", test_rmsnorm},
    {"rope", test_rope},
    {"attention", test_attention},
    {"swiglu", test_swiglu},
    {"softmax", test_softmax},
    {"topk", test_topk},
    {"logprob", test_logprob},
    {"adamw", test_adamw},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!(g_gpu = gpu_suite_backend("gpu_kernels", &rc)))
        return rc;
    backend_cpu_set_threads(0);
    KG = g_gpu->k;
    KC = backend_cpu()->k;
    return tu_main("gpu_kernels", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_kernels"); }
#endif
