/* bench_gpu_kernels: timings of the CUDA kernel table on one GPU. First the
 * two ceilings measured on the device itself (a large device-to-device copy
 * and a large cuBLAS bf16 matrix product, plus f32 SGEMM for f32 products),
 * then each kernel at a training-sized shape: median of timed runs after
 * warm-up, timed with CUDA events on the default stream, on random data. The
 * table printed last gives each kernel's rate against its ceiling. The
 * mixture-of-experts rows (core/cuda/moe_cuda.h) run a Qwen3-30B-A3B-like
 * expert layer (D 2048, F 768, E 128, K 8, T 4096 tokens on uniform random
 * routing) and also give tokens per second. Last, the policy model (actor/model_cuda.h)
 * on a 4-layer Qwen3-MoE: its LoRA training step in tokens per second and MFU, and decode
 * steps with device sampling at batch 1 and 64 in tokens per second and the bytes they
 * must read against the copy bandwidth.
 * Exits 77 (skipped) without CUDA support or without a device. */
#include <stdio.h>

#ifdef MOERL_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>
#include <unistd.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "actor/model_cuda.h"
#include "bench/step_flops.h"
#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/cuda/moe_cuda.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/status.h"

#define WARM 3
#define REPS 10
#define MAX_ROWS 48

static const backend_t *g_be;

typedef struct row {
    char name[48], shape[64];
    double ms;
    double work;    /* flops or bytes per run */
    int is_flops;   /* 1: work is flops, 0: bytes */
    double ceiling; /* the matching ceiling: flop/s or byte/s */
    const char *ceil_name;
    char note[24]; /* tokens per second where it applies */
} row_t;

static row_t g_rows[MAX_ROWS];
static int g_nrows;
static double g_copy_bw, g_bf16_peak, g_f32_peak; /* measured ceilings */

static void die(const char *what) {
    fprintf(stderr, "bench_gpu_kernels: %s: %s\n", what, mo_last_error());
    exit(1);
}

static void cuda_ok(cudaError_t e, const char *what) {
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_gpu_kernels: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static void *dalloc(size_t bytes) {
    void *p = NULL;
    if (g_be->alloc(g_be, &p, bytes) < 0)
        die("alloc");
    return p;
}

/* n elements of dtype dt, uniform in [lo, hi): one random block uploaded and
 * repeated (timings do not depend on the values beyond their being random). */
static void *drand(size_t n, dtype_t dt, uint64_t seed, float lo, float hi) {
    size_t es = dtype_size(dt), blk = n < ((size_t)1 << 22) ? n : ((size_t)1 << 22);
    float *f = malloc(blk * sizeof(float));
    void *h = malloc(blk * es);
    rng_fill_uniform(f, blk, seed, 0xbe9c, lo, hi);
    convert_from_f32(h, dt, f, blk);
    char *d = dalloc(n * es);
    if (g_be->copy(g_be, d, DEV_CUDA, h, DEV_CPU, blk * es) < 0)
        die("upload");
    for (size_t off = blk; off < n; off += blk) {
        size_t m = n - off < blk ? n - off : blk;
        if (g_be->copy(g_be, d + off * es, DEV_CUDA, d, DEV_CUDA, m * es) < 0)
            die("replicate");
    }
    free(f);
    free(h);
    return d;
}

static int32_t *dids(size_t n, uint64_t seed, int hi) {
    float *u = malloc(n * sizeof(float));
    int32_t *ids = malloc(n * sizeof(int32_t));
    rng_fill_uniform(u, n, seed, 0x1d5, 0.0f, 1.0f);
    for (size_t i = 0; i < n; i++) {
        int v = (int)(u[i] * (float)hi);
        ids[i] = v < hi ? v : hi - 1;
    }
    int32_t *d = dalloc(n * sizeof(int32_t));
    if (g_be->copy(g_be, d, DEV_CUDA, ids, DEV_CPU, n * sizeof(int32_t)) < 0)
        die("upload ids");
    free(u);
    free(ids);
    return d;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef void (*run_fn)(void *ctx);

/* Median milliseconds of REPS runs after WARM runs, each run between two
 * events on the default stream. */
static double time_ms(run_fn f, void *ctx) {
    cudaEvent_t a, b;
    cuda_ok(cudaEventCreate(&a), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&b), "cudaEventCreate");
    for (int i = 0; i < WARM; i++)
        f(ctx);
    if (g_be->synchronize(g_be) < 0)
        die("warm-up");
    double t[REPS];
    for (int i = 0; i < REPS; i++) {
        cuda_ok(cudaEventRecord(a, 0), "cudaEventRecord");
        f(ctx);
        cuda_ok(cudaEventRecord(b, 0), "cudaEventRecord");
        cuda_ok(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms = 0.0f;
        cuda_ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        t[i] = ms;
    }
    if (g_be->synchronize(g_be) < 0)
        die("timed runs");
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    qsort(t, REPS, sizeof t[0], cmp_double);
    return 0.5 * (t[(REPS - 1) / 2] + t[REPS / 2]);
}

static void add_row(const char *name, const char *shape, double ms, double work, int is_flops,
                    double ceiling, const char *ceil_name) {
    if (g_nrows == MAX_ROWS)
        return;
    row_t *r = &g_rows[g_nrows++];
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(r->shape, sizeof r->shape, "%s", shape);
    r->ms = ms, r->work = work, r->is_flops = is_flops;
    r->ceiling = ceiling, r->ceil_name = ceil_name;
    r->note[0] = '\0';
    double rate = work / (ms * 1e-3);
    printf("  %-28s %-34s %9.3f ms  %8.1f %s\n", name, shape, ms,
           is_flops ? rate / 1e12 : rate / 1e9, is_flops ? "TFLOP/s" : "GB/s");
    fflush(stdout);
}

/* ---- ceilings ---- */

typedef struct {
    void *dst, *src;
    size_t bytes;
} copy_ctx_t;

static void run_copy(void *p) {
    copy_ctx_t *c = p;
    cuda_ok(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, 0),
            "cudaMemcpyAsync");
}

typedef struct {
    cublasHandle_t h;
    int n;
    const void *A, *B;
    void *C;
    cudaDataType_t t; /* operands and output */
} gemm_ctx_t;

static void run_gemm(void *p) {
    gemm_ctx_t *g = p;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s =
        cublasGemmEx(g->h, CUBLAS_OP_T, CUBLAS_OP_N, g->n, g->n, g->n, &one, g->A, g->t, g->n, g->B,
                     g->t, g->n, &zero, g->C, g->t, g->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_gpu_kernels: cublasGemmEx: %s\n", cublasGetStatusString(s));
        exit(1);
    }
}

static void ceilings(void) {
    copy_ctx_t c = {NULL, NULL, (size_t)2 << 30};
    c.src = drand(c.bytes / 4, DT_F32, 1, -1, 1);
    c.dst = dalloc(c.bytes);
    double ms = time_ms(run_copy, &c);
    g_copy_bw = 2.0 * (double)c.bytes / (ms * 1e-3);
    add_row("copy (device to device)", "2 GiB, read + write", ms, 2.0 * (double)c.bytes, 0,
            g_copy_bw, "copy");
    g_be->free(g_be, c.src);
    g_be->free(g_be, c.dst);

    gemm_ctx_t g = {NULL, 8192, NULL, NULL, NULL, CUDA_R_16BF};
    if (cublasCreate(&g.h) != CUBLAS_STATUS_SUCCESS)
        die("cublasCreate");
    size_t n2 = (size_t)g.n * g.n;
    g.A = drand(n2, DT_BF16, 2, -1, 1);
    g.B = drand(n2, DT_BF16, 3, -1, 1);
    g.C = dalloc(n2 * 2);
    double flops = 2.0 * g.n * (double)g.n * g.n;
    ms = time_ms(run_gemm, &g);
    g_bf16_peak = flops / (ms * 1e-3);
    add_row("cuBLAS bf16 GEMM (peak)", "8192^3, f32 accumulate", ms, flops, 1, g_bf16_peak,
            "bf16 GEMM");
    g_be->free(g_be, (void *)g.A);
    g_be->free(g_be, (void *)g.B);
    g_be->free(g_be, g.C);

    g.n = 4096, g.t = CUDA_R_32F;
    n2 = (size_t)g.n * g.n;
    g.A = drand(n2, DT_F32, 4, -1, 1);
    g.B = drand(n2, DT_F32, 5, -1, 1);
    g.C = dalloc(n2 * 4);
    flops = 2.0 * g.n * (double)g.n * g.n;
    ms = time_ms(run_gemm, &g);
    g_f32_peak = flops / (ms * 1e-3);
    add_row("cuBLAS f32 SGEMM (no TF32)", "4096^3", ms, flops, 1, g_f32_peak, "f32 GEMM");
    g_be->free(g_be, (void *)g.A);
    g_be->free(g_be, (void *)g.B);
    g_be->free(g_be, g.C);
    cublasDestroy(g.h);
}

/* ---- matmul ---- */

typedef struct {
    float *out, *inp, *dout, *dinp, *dw;
    wview_t w;
    int T, C, OC, backward;
} mm_ctx_t;

static void run_mm(void *p) {
    mm_ctx_t *m = p;
    if (m->backward)
        g_be->k->matmul_backward(m->dinp, m->dw, NULL, m->dout, m->inp, &m->w, m->T, m->C, m->OC);
    else
        g_be->k->matmul_forward(m->out, m->inp, &m->w, NULL, m->T, m->C, m->OC);
}

static void bench_matmul(const char *label, dtype_t dt, int block, int T, int C, int OC,
                         int backward, int with_dw) {
    mm_ctx_t m;
    memset(&m, 0, sizeof m);
    m.T = T, m.C = C, m.OC = OC, m.backward = backward;
    void *w = drand((size_t)OC * C, dt, 10, -1, 1);
    float *scale = NULL;
    if (block) {
        size_t ns = (size_t)((OC + block - 1) / block) * ((C + block - 1) / block);
        scale = drand(ns, DT_F32, 11, 0.5f, 2.0f);
    }
    m.w = wview_of(w, dt);
    m.w.scale = scale, m.w.block = block;
    m.inp = drand((size_t)T * C, DT_F32, 12, -1, 1);
    m.out = dalloc((size_t)T * OC * 4);
    m.dout = drand((size_t)T * OC, DT_F32, 13, -1, 1);
    if (backward) {
        m.dinp = with_dw ? NULL : dalloc((size_t)T * C * 4);
        m.dw = with_dw ? dalloc((size_t)OC * C * 4) : NULL;
        if (m.dinp && g_be->memset_zero(g_be, m.dinp, (size_t)T * C * 4) < 0)
            die("memset");
        if (m.dw && g_be->memset_zero(g_be, m.dw, (size_t)OC * C * 4) < 0)
            die("memset");
    }
    char shape[64];
    snprintf(shape, sizeof shape, "T=%d C=%d OC=%d", T, C, OC);
    double ms = time_ms(run_mm, &m);
    double flops = 2.0 * T * (double)C * OC;
    int f32 = dt == DT_F32 && !block;
    add_row(label, shape, ms, flops, 1, f32 ? g_f32_peak : g_bf16_peak,
            f32 ? "f32 GEMM" : "bf16 GEMM");
    g_be->free(g_be, w);
    g_be->free(g_be, scale);
    g_be->free(g_be, m.inp);
    g_be->free(g_be, m.out);
    g_be->free(g_be, m.dout);
    g_be->free(g_be, m.dinp);
    g_be->free(g_be, m.dw);
}

/* ---- attention ---- */

typedef struct {
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    int32_t *cu;
    int B, H, Hkv, Dh, window, backward;
    float scale;
} att_ctx_t;

static void run_att(void *p) {
    att_ctx_t *a = p;
    if (a->backward)
        g_be->k->attention_backward(a->dq, a->dk, a->dv, a->dout, a->q, a->k, a->v, a->out, a->lse,
                                    a->cu, a->B, a->H, a->Hkv, a->Dh, a->scale, a->window);
    else
        g_be->k->attention_forward(a->out, a->lse, a->q, a->k, a->v, a->cu, a->B, a->H, a->Hkv,
                                   a->Dh, a->scale, a->window);
}

static void bench_attention(int B, int L, int H, int Hkv, int Dh) {
    att_ctx_t a;
    memset(&a, 0, sizeof a);
    a.B = B, a.H = H, a.Hkv = Hkv, a.Dh = Dh, a.scale = 1.0f / sqrtf((float)Dh);
    size_t T = (size_t)B * L, nq = T * H * Dh, nkv = T * Hkv * Dh;
    int32_t cu[65];
    for (int b = 0; b <= B && b < 65; b++)
        cu[b] = b * L;
    a.cu = dalloc(sizeof(int32_t) * (B + 1));
    if (g_be->copy(g_be, a.cu, DEV_CUDA, cu, DEV_CPU, sizeof(int32_t) * (B + 1)) < 0)
        die("upload cu_seqlens");
    a.q = drand(nq, DT_F32, 20, -1, 1);
    a.k = drand(nkv, DT_F32, 21, -1, 1);
    a.v = drand(nkv, DT_F32, 22, -1, 1);
    a.dout = drand(nq, DT_F32, 23, -1, 1);
    a.out = dalloc(nq * 4);
    a.lse = dalloc(T * H * 4);
    a.dq = dalloc(nq * 4);
    a.dk = dalloc(nkv * 4);
    a.dv = dalloc(nkv * 4);
    if (g_be->memset_zero(g_be, a.dq, nq * 4) < 0 || g_be->memset_zero(g_be, a.dk, nkv * 4) < 0 ||
        g_be->memset_zero(g_be, a.dv, nkv * 4) < 0)
        die("memset");
    /* causal: each query sees on average (L + 1) / 2 keys; 2 products forward */
    double fwd = 4.0 * H * Dh * (double)B * L * (L + 1) / 2.0;
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d L=%d H=%d Hkv=%d Dh=%d", B, L, H, Hkv, Dh);
    double ms = time_ms(run_att, &a);
    add_row("attention_forward (f32)", shape, ms, fwd, 1, g_f32_peak, "f32 GEMM");
    a.backward = 1;
    ms = time_ms(run_att, &a);
    add_row("attention_backward (f32)", shape, ms, 2.5 * fwd, 1, g_f32_peak, "f32 GEMM");
    void *bufs[] = {a.cu, a.q, a.k, a.v, a.dout, a.out, a.lse, a.dq, a.dk, a.dv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g_be->free(g_be, bufs[i]);
}

/* ---- logprob and the memory-bound ops ---- */

typedef struct {
    float *logits, *logp, *ent, *lse, *dlogp, *dent, *dlogits;
    int32_t *targets;
    int N, V, backward;
} lp_ctx_t;

static void run_lp(void *p) {
    lp_ctx_t *l = p;
    if (l->backward)
        g_be->k->logprob_backward(l->dlogits, l->dlogp, l->dent, l->logits, l->lse, l->targets,
                                  l->N, l->V, 1.0f);
    else
        g_be->k->logprob_forward(l->logp, l->ent, l->lse, l->logits, l->targets, l->N, l->V, 1.0f);
}

static void bench_logprob(int N, int V) {
    lp_ctx_t l;
    memset(&l, 0, sizeof l);
    l.N = N, l.V = V;
    size_t n = (size_t)N * V;
    l.logits = drand(n, DT_F32, 30, -8, 8);
    l.targets = dids(N, 31, V);
    l.logp = dalloc(N * 4), l.ent = dalloc(N * 4), l.lse = dalloc(N * 4);
    l.dlogp = drand(N, DT_F32, 32, -1, 1);
    l.dent = drand(N, DT_F32, 33, -1, 1);
    l.dlogits = dalloc(n * 4);
    if (g_be->memset_zero(g_be, l.dlogits, n * 4) < 0)
        die("memset");
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d V=%d", N, V);
    double ms = time_ms(run_lp, &l);
    /* the fewest bytes: logits read once */
    add_row("logprob_forward (+entropy)", shape, ms, 4.0 * n, 0, g_copy_bw, "copy");
    l.backward = 1;
    ms = time_ms(run_lp, &l);
    /* logits read, dlogits read and written */
    add_row("logprob_backward (both)", shape, ms, 12.0 * n, 0, g_copy_bw, "copy");
    void *bufs[] = {l.logits, l.targets, l.logp, l.ent, l.lse, l.dlogp, l.dent, l.dlogits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g_be->free(g_be, bufs[i]);
}

typedef struct {
    float *x, *w, *out, *rstd, *a, *b;
    int32_t *idx;
    int N, D, K, op;
} ew_ctx_t;

enum { OP_RMSNORM, OP_SWIGLU, OP_SOFTMAX, OP_TOPK };

static void run_ew(void *p) {
    ew_ctx_t *e = p;
    switch (e->op) {
    case OP_RMSNORM:
        g_be->k->rmsnorm_forward(e->out, e->rstd, e->x, e->w, e->N, e->D, 1e-6f);
        break;
    case OP_SWIGLU: g_be->k->swiglu_forward(e->out, e->a, e->b, (size_t)e->N * e->D); break;
    case OP_SOFTMAX: g_be->k->softmax_forward(e->out, e->x, e->N, e->D); break;
    default: g_be->k->topk_forward(e->idx, e->out, e->x, e->N, e->D, e->K); break;
    }
}

static void bench_small_ops(void) {
    ew_ctx_t e;
    memset(&e, 0, sizeof e);
    char shape[64];
    e.N = 16384, e.D = 4096, e.op = OP_RMSNORM;
    size_t n = (size_t)e.N * e.D;
    e.x = drand(n, DT_F32, 40, -2, 2);
    e.w = drand(e.D, DT_F32, 41, 0.5f, 1.5f);
    e.out = dalloc(n * 4), e.rstd = dalloc(e.N * 4);
    snprintf(shape, sizeof shape, "N=%d D=%d", e.N, e.D);
    add_row("rmsnorm_forward", shape, time_ms(run_ew, &e), 8.0 * n, 0, g_copy_bw, "copy");
    g_be->free(g_be, e.x), g_be->free(g_be, e.w), g_be->free(g_be, e.out);
    g_be->free(g_be, e.rstd);

    e.N = 16384, e.D = 14336, e.op = OP_SWIGLU;
    n = (size_t)e.N * e.D;
    e.a = drand(n, DT_F32, 42, -4, 4), e.b = drand(n, DT_F32, 43, -2, 2), e.out = dalloc(n * 4);
    snprintf(shape, sizeof shape, "n=%d*%d", e.N, e.D);
    add_row("swiglu_forward", shape, time_ms(run_ew, &e), 12.0 * n, 0, g_copy_bw, "copy");
    g_be->free(g_be, e.a), g_be->free(g_be, e.b), g_be->free(g_be, e.out);

    e.N = 16384, e.D = 128, e.K = 8, e.op = OP_SOFTMAX;
    n = (size_t)e.N * e.D;
    e.x = drand(n, DT_F32, 44, -4, 4), e.out = dalloc(n * 4);
    e.idx = dalloc((size_t)e.N * e.K * 4);
    snprintf(shape, sizeof shape, "N=%d E=%d", e.N, e.D);
    add_row("softmax_forward (router)", shape, time_ms(run_ew, &e), 8.0 * n, 0, g_copy_bw, "copy");
    e.op = OP_TOPK;
    snprintf(shape, sizeof shape, "N=%d E=%d K=%d", e.N, e.D, e.K);
    add_row("topk_forward (router)", shape, time_ms(run_ew, &e), 4.0 * n, 0, g_copy_bw, "copy");
    g_be->free(g_be, e.x), g_be->free(g_be, e.out), g_be->free(g_be, e.idx);
}

/* ---- mixture-of-experts blocks ---- */

enum { MOE_PLAN, MOE_DISPATCH, MOE_COMBINE, MOE_GMM, MOE_GMM_DX, MOE_GMM_DW, MOE_MLP, MOE_MLP_BWD };

typedef struct {
    int op, T, D, F, E, K, S;
    dtype_t dt; /* weights of MOE_GMM */
    moe_cuda_plan_t plan;
    int32_t *idx;             /* (T, K) */
    float *x, *xg, *out, *wt; /* (T, D), (S, D), (T, D), (T, K) */
    float *h, *dh, *ye, *dxe; /* (S, F), (S, F), (S, D), (S, D) */
    void *w_f32, *w_bf16;     /* tables (E) of (F, D) gate weights */
    void *dw;                 /* table (E) of (F, D) f32 gradients */
    moe_cuda_experts_t ex;    /* bf16 gate, up, down */
    moe_cuda_acts_t acts;
    float *scratch;
} moe_ctx_t;

static void run_moe(void *p) {
    moe_ctx_t *m = p;
    const int32_t *off = m->plan.offsets;
    int rc = 0;
    switch (m->op) {
    case MOE_PLAN: rc = moe_cuda_plan_build(&m->plan, m->idx); break;
    case MOE_DISPATCH: rc = moe_cuda_dispatch_forward(m->xg, m->x, &m->plan, m->D); break;
    case MOE_COMBINE: rc = moe_cuda_combine_forward(m->out, m->xg, m->wt, &m->plan, m->D); break;
    case MOE_GMM:
        rc = moe_cuda_gmm_forward(m->h, m->xg, m->dt == DT_F32 ? m->w_f32 : m->w_bf16, m->dt, off,
                                  m->E, m->S, m->D, m->F, 1.0f, 0);
        break;
    case MOE_GMM_DX:
        rc = moe_cuda_gmm_backward_x(m->dxe, m->dh, m->w_bf16, DT_BF16, off, m->E, m->S, m->D, m->F,
                                     1.0f, 0);
        break;
    case MOE_GMM_DW:
        rc = moe_cuda_gmm_backward_w(m->dw, m->dh, m->xg, off, m->E, m->S, m->D, m->F, 1.0f);
        break;
    case MOE_MLP:
        rc = moe_cuda_experts_forward(m->ye, &m->acts, m->xg, off, m->E, m->S, &m->ex, m->D, m->F);
        break;
    default:
        rc = moe_cuda_experts_backward(m->dxe, m->ye, m->xg, &m->acts, off, m->E, m->S, &m->ex,
                                       m->D, m->F, m->scratch);
    }
    if (rc < 0)
        die("moe");
}

/* A device table of n pointers base + i * stride bytes. */
static void *dtable(void *base, int n, size_t stride) {
    void **h = malloc((size_t)n * sizeof(void *));
    for (int i = 0; i < n; i++)
        h[i] = (char *)base + (size_t)i * stride;
    void *d = dalloc((size_t)n * sizeof(void *));
    if (g_be->copy(g_be, d, DEV_CUDA, h, DEV_CPU, (size_t)n * sizeof(void *)) < 0)
        die("upload table");
    free(h);
    return d;
}

static void moe_row(moe_ctx_t *m, int op, const char *name, double work, int is_flops,
                    double ceiling, const char *ceil_name) {
    char shape[64];
    snprintf(shape, sizeof shape, "T=%d D=%d F=%d E=%d K=%d", m->T, m->D, m->F, m->E, m->K);
    m->op = op;
    double ms = time_ms(run_moe, m);
    add_row(name, shape, ms, work, is_flops, ceiling, ceil_name);
    snprintf(g_rows[g_nrows - 1].note, sizeof g_rows[g_nrows - 1].note, "%.2f Mtok/s",
             m->T / (ms * 1e-3) / 1e6);
}

static void bench_moe(int T, int D, int F, int E, int K) {
    moe_ctx_t m;
    memset(&m, 0, sizeof m);
    m.T = T, m.D = D, m.F = F, m.E = E, m.K = K, m.S = T * K;
    size_t S = (size_t)m.S, fd = (size_t)F * D;
    if (moe_cuda_plan_alloc(&m.plan, T, K, E) < 0)
        die("moe plan");
    m.idx = dids(S, 30, E);
    m.x = drand((size_t)T * D, DT_F32, 31, -1, 1);
    m.wt = drand(S, DT_F32, 32, 0, 1);
    m.xg = dalloc(S * D * 4), m.out = dalloc((size_t)T * D * 4), m.ye = dalloc(S * D * 4);
    m.dxe = dalloc(S * D * 4), m.h = dalloc(S * F * 4);
    m.dh = drand(S * F, DT_F32, 33, -1, 1);
    void *wf = drand((size_t)E * fd, DT_F32, 34, -0.05f, 0.05f);
    void *wb[3], *dwb = dalloc((size_t)E * fd * 4);
    for (int i = 0; i < 3; i++)
        wb[i] = drand((size_t)E * fd, DT_BF16, 35 + (uint64_t)i, -0.05f, 0.05f);
    if (g_be->memset_zero(g_be, dwb, (size_t)E * fd * 4) < 0)
        die("memset");
    m.w_f32 = dtable(wf, E, fd * 4), m.w_bf16 = dtable(wb[0], E, fd * 2);
    m.dw = dtable(dwb, E, fd * 4);
    m.ex.dtype = DT_BF16, m.ex.gate = m.w_bf16;
    void *tu = dtable(wb[1], E, fd * 2), *td = dtable(wb[2], E, fd * 2);
    m.ex.up = tu, m.ex.down = td;
    m.acts.g = dalloc(S * F * 4), m.acts.u = dalloc(S * F * 4), m.acts.h = dalloc(S * F * 4);
    m.scratch = dalloc(moe_cuda_experts_backward_scratch_floats(&m.ex, m.S, F) * 4);

    double gemm = 2.0 * (double)S * D * F; /* one expert projection over all rows */
    moe_row(&m, MOE_PLAN, "moe dispatch plan", 3.0 * S * 4, 0, g_copy_bw, "copy");
    moe_row(&m, MOE_DISPATCH, "moe dispatch (gather)", ((double)T + S) * D * 4, 0, g_copy_bw,
            "copy");
    moe_row(&m, MOE_COMBINE, "moe combine", ((double)T + S) * D * 4, 0, g_copy_bw, "copy");
    m.dt = DT_BF16;
    moe_row(&m, MOE_GMM, "moe grouped mm bf16 w", gemm, 1, g_bf16_peak, "bf16 GEMM");
    m.dt = DT_F32;
    moe_row(&m, MOE_GMM, "moe grouped mm f32 w", gemm, 1, g_f32_peak, "f32 GEMM");
    moe_row(&m, MOE_GMM_DX, "moe grouped mm dx bf16 w", gemm, 1, g_bf16_peak, "bf16 GEMM");
    moe_row(&m, MOE_GMM_DW, "moe grouped mm dw f32", gemm, 1, g_f32_peak, "f32 GEMM");
    moe_row(&m, MOE_MLP, "moe experts fwd bf16 w", 3 * gemm, 1, g_bf16_peak, "bf16 GEMM");
    moe_row(&m, MOE_MLP_BWD, "moe experts bwd dx bf16 w", 3 * gemm, 1, g_bf16_peak, "bf16 GEMM");

    moe_cuda_plan_free(&m.plan);
    void *bufs[] = {m.idx, m.x, m.wt,  m.xg,     m.out,    m.ye,     m.dxe,    m.h,
                    m.dh,  wf,  wb[0], wb[1],    wb[2],    dwb,      m.w_f32,  m.w_bf16,
                    m.dw,  tu,  td,    m.acts.g, m.acts.u, m.acts.h, m.scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g_be->free(g_be, bufs[i]);
}

/* ---- the policy model's training step (actor/model_cuda.h) ---- */

typedef struct {
    model_cuda_t *mc;
    model_batch_t b;
    float *logp, *dlogp;
} step_ctx_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Median wall milliseconds of REPS steps after WARM; a step ends with its logprobs and the
 * adapter's gradients on the host, so the wall clock covers all of it. */
static double step_ms(step_ctx_t *s) {
    double t[REPS];
    for (int i = 0; i < WARM + REPS; i++) {
        double t0 = now_s();
        if (model_cuda_forward_train(s->mc, &s->b, s->logp, NULL) < 0 ||
            model_cuda_backward(s->mc, s->dlogp, NULL) < 0)
            die("model_cuda training step");
        if (i >= WARM)
            t[i - WARM] = (now_s() - t0) * 1e3;
    }
    qsort(t, REPS, sizeof t[0], cmp_double);
    return 0.5 * (t[(REPS - 1) / 2] + t[REPS / 2]);
}

/* The benchmark's model: a 4-layer Qwen3-MoE with layers shaped like Qwen3-30B-A3B's but
 * 64 experts (D 2048, H 32, Hkv 4, Dh 128, E 64, K 8, F 768), bf16 weights, the byte-level
 * vocabulary, rank-16 LoRA on every linear module (B random too, so every path computes),
 * written to dir and uploaded. */
typedef struct {
    char dir[32];
    model_t *m;
    lora_adapter_t *ad;
    model_cuda_t *mc;
} bench_model_t;

#define BENCH_SEQ 1024

static void bench_model_open(bench_model_t *bm) {
    snprintf(bm->dir, sizeof bm->dir, "%s", "/tmp/moerl-gpu-bench-XXXXXX");
    if (!mkdtemp(bm->dir))
        die("mkdtemp");
    model_config_t c;
    if (init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_SMALL, DT_BF16) < 0)
        die("model config");
    c.num_hidden_layers = 4;
    c.max_window_layers = 4;
    c.hidden_size = 2048;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.num_experts = 64;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    c.intermediate_size = 6144;
    if (c.max_position_embeddings < BENCH_SEQ)
        c.max_position_embeddings = BENCH_SEQ;
    init_model_opts_t io = {7, 0.02f};
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {16, 32.0f, 0, 0.0f, 3, 0, targets, 1};
    if (model_config_validate(&c, "bench") < 0 || init_model_write(bm->dir, &c, &io) < 0 ||
        model_open(&bm->m, bm->dir, NULL) < 0 ||
        lora_adapter_new(&bm->ad, &lc, bm->m->modules, bm->m->n_modules) < 0 ||
        model_set_adapter(bm->m, bm->ad) < 0)
        die("model");
    lora_adapter_t *ad = bm->ad;
    for (int i = 0; i < ad->n_tensors; i++)
        rng_fill_uniform(ad->params + ad->tensors[i].offset, ad->tensors[i].numel, 5,
                         (uint64_t)i, -0.01f, 0.01f);
    if (model_cuda_upload(&bm->mc, bm->m) < 0)
        die("model_cuda_upload");
}

static void bench_model_close(bench_model_t *bm) {
    model_cuda_free(&bm->mc);
    model_destroy(&bm->m);
    lora_adapter_destroy(&bm->ad);
    char path[sizeof bm->dir + 32];
    const char *files[4] = {"config.json", "model.safetensors", "tokenizer.json",
                            "tokenizer_config.json"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", bm->dir, files[i]);
        unlink(path);
    }
    rmdir(bm->dir);
}

/* The LoRA training step on 4 sequences of 1024 tokens. The row's rate is the model's
 * FLOPs (bench/step_flops.h) per second against the measured cuBLAS bf16 peak (the MFU). */
static void bench_train_step(bench_model_t *bm) {
    enum { NSEQ = 4, T = BENCH_SEQ * NSEQ };
    static int32_t tok[T], pos[T], tgt[T], cu[NSEQ + 1];
    static float logp[T], dlogp[T];
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rng_uniform(11, 0, (uint64_t)t) * 256.0f) % 256;
        dlogp[t] = rng_uniform(12, 0, (uint64_t)t) - 0.5f;
    }
    for (int b = 0; b <= NSEQ; b++)
        cu[b] = b * BENCH_SEQ;
    model_batch_next_token(pos, tgt, tok, cu, NSEQ);
    step_ctx_t s = {bm->mc, {T, NSEQ, tok, pos, cu, tgt, 1.0f, NULL, NULL}, logp, dlogp};
    double ms = step_ms(&s), fwd, bwd;
    step_flops(bm->m, bm->ad, pos, T, &fwd, &bwd);
    add_row("model train step (LoRA)", "L4 D2048 E64 K8 F768, 4x1024 tok", ms, fwd + bwd, 1,
            g_bf16_peak, "bf16 GEMM");
    snprintf(g_rows[g_nrows - 1].note, sizeof g_rows[0].note, "%.0f tok/s", T / (ms * 1e-3));
}

/* The bytes a decode step of N rows at context ctx must read at least: every layer's
 * attention matrices (bf16) and f32 router, the experts N K rows can reach (at most E),
 * the lm_head, the adapter (f32) and the rows' keys and values (f32). */
static double decode_bytes(const model_t *m, const lora_adapter_t *ad, int N, int ctx) {
    double D = m->D, qd = (double)m->H * m->Dh, kvd = (double)m->Hkv * m->Dh, w = 0.0;
    for (int l = 0; l < m->L; l++) {
        const model_layer_t *ly = &m->layers[l];
        w += 2.0 * (2 * D * qd + 2 * D * kvd);
        if (ly->moe) {
            int touched = N * m->K < m->E ? N * m->K : m->E;
            w += 4.0 * D * m->E + 2.0 * touched * 3 * D * ly->moe_cfg.F;
        } else {
            w += 2.0 * 3 * D * m->cfg.intermediate_size;
        }
    }
    w += 2.0 * (double)m->V * D + 4.0 * (double)ad->n_params;
    return w + 4.0 * 2 * kvd * ctx * (double)N * m->L;
}

/* Median wall milliseconds of REPS decode steps (sampling on the device) after WARM. */
static double decode_ms(model_cuda_t *mc, const model_cuda_decode_t *b,
                        const cuda_sample_req_t *req, int32_t *tok, float *lp, int32_t *st) {
    double t[REPS];
    for (int i = 0; i < WARM + REPS; i++) {
        double t0 = now_s();
        if (model_cuda_decode_sample(mc, b, req, tok, lp, st, 1) < 0)
            die("model_cuda_decode_sample");
        if (i >= WARM)
            t[i - WARM] = (now_s() - t0) * 1e3;
    }
    qsort(t, REPS, sizeof t[0], cmp_double);
    return 0.5 * (t[(REPS - 1) / 2] + t[REPS / 2]);
}

/* Decode steps of N = 1 and 64 sequences, each at position 1023 (1024 keys attended) of a
 * paged device cache of 16-token blocks, the next token sampled on the device at
 * temperature 1. Each step stores its rows' keys and values at the same position again.
 * The row's rate is decode_bytes per second against the measured copy bandwidth. */
static void bench_decode(bench_model_t *bm) {
    enum { NMAX = 64, BS = 16, MAXB = BENCH_SEQ / BS };
    const model_t *m = bm->m;
    int NB = NMAX * MAXB;
    size_t floats = (size_t)m->L * NB * 2 * BS * (size_t)m->Hkv * m->Dh;
    float *kv = dalloc(floats * sizeof(float));
    cuda_ok(cudaMemset(kv, 0, floats * sizeof(float)), "cudaMemset");
    static int32_t tok[NMAX], pos[NMAX], tables[NMAX * MAXB], out_tok[NMAX], status[NMAX];
    static float out_lp[NMAX];
    static cuda_sample_req_t req[NMAX];
    for (int i = 0; i < NMAX; i++) {
        tok[i] = (int32_t)(rng_uniform(13, 0, (uint64_t)i) * 256.0f) % 256;
        pos[i] = BENCH_SEQ - 1;
        for (int j = 0; j < MAXB; j++)
            tables[i * MAXB + j] = i * MAXB + j;
        req[i] = (cuda_sample_req_t){1.0f, 1.0f, 0, 0.0f, 1, (uint64_t)i, 0, 0};
    }
    static const int ns[2] = {1, NMAX};
    for (int k = 0; k < 2; k++) {
        int N = ns[k];
        model_cuda_decode_t b = {N, tok, pos, tables, MAXB, kv, NB, BS, NULL};
        double ms = decode_ms(bm->mc, &b, req, out_tok, out_lp, status);
        for (int i = 0; i < N; i++)
            if (status[i] != MO_OK)
                die("decode: a row's sampling status");
        char name[48], shape[64];
        snprintf(name, sizeof name, "model decode step, batch %d", N);
        snprintf(shape, sizeof shape, "same model, ctx 1024, sampled");
        add_row(name, shape, ms, decode_bytes(m, bm->ad, N, BENCH_SEQ), 0, g_copy_bw,
                "copy");
        snprintf(g_rows[g_nrows - 1].note, sizeof g_rows[0].note, "%.0f tok/s",
                 N / (ms * 1e-3));
    }
    g_be->free(g_be, kv);
}

static void bench_model(void) {
    bench_model_t bm;
    memset(&bm, 0, sizeof bm);
    bench_model_open(&bm);
    bench_train_step(&bm);
    bench_decode(&bm);
    bench_model_close(&bm);
}

static void print_table(void) {
    printf("\n%-28s %-34s %10s %12s %8s  %-10s %s\n", "kernel", "shape", "median ms", "rate",
           "of ceil", "ceiling", "tokens");
    for (int i = 0; i < g_nrows; i++) {
        row_t *r = &g_rows[i];
        double rate = r->work / (r->ms * 1e-3);
        char rs[32];
        if (r->is_flops)
            snprintf(rs, sizeof rs, "%.1f TF/s", rate / 1e12);
        else
            snprintf(rs, sizeof rs, "%.0f GB/s", rate / 1e9);
        printf("%-28s %-34s %10.3f %12s %7.0f%%  %-10s %s\n", r->name, r->shape, r->ms, rs,
               100.0 * rate / r->ceiling, r->ceil_name, r->note);
    }
}

int main(void) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("bench_gpu_kernels: no CUDA device (%s), skipped\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "none present");
        return 77;
    }
    g_be = backend_get(DEV_CUDA);
    if (!g_be)
        die("backend");
    cuda_device_info_t info;
    if (backend_cuda_device_info(&info) < 0)
        die("device info");
    printf("device %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB\n", info.ordinal, info.name,
           info.cc_major, info.cc_minor, info.sm_count, (double)info.total_mem / (1 << 30),
           (double)info.l2_bytes / (1 << 20));
    printf("median of %d runs after %d warm-up runs, CUDA events, random data\n", REPS, WARM);
    ceilings();
    bench_matmul("matmul_forward bf16 w", DT_BF16, 0, 4096, 4096, 14336, 0, 0);
    bench_matmul("matmul_backward dinp bf16 w", DT_BF16, 0, 4096, 4096, 14336, 1, 0);
    bench_matmul("matmul_forward fp8 w b128", DT_F8E4M3, 128, 4096, 4096, 14336, 0, 0);
    bench_matmul("matmul_forward f32 w", DT_F32, 0, 4096, 4096, 4096, 0, 0);
    bench_matmul("matmul_forward LoRA A f32", DT_F32, 0, 4096, 4096, 16, 0, 0);
    bench_matmul("matmul_backward dw LoRA A", DT_F32, 0, 4096, 4096, 16, 1, 1);
    bench_attention(2, 4096, 32, 8, 128);
    bench_logprob(4096, 151936);
    bench_small_ops();
    bench_moe(4096, 2048, 768, 128, 8);
    bench_model();
    cuda_pool_stats_t ps;
    backend_cuda_pool_stats(&ps);
    printf("pool: %.2f GiB reserved, %llu cudaMalloc calls for %llu allocations\n",
           (double)ps.reserved / (1 << 30), (unsigned long long)ps.device_allocs,
           (unsigned long long)ps.allocs);
    print_table();
    return 0;
}

#else
int main(void) {
    printf("bench_gpu_kernels: this build has no CUDA backend, skipped\n");
    return 77;
}
#endif
