/* host_cuda: host twins of the device pieces the CUDA model path calls, so that the GPU
 * suites of that path (tests/gpu_model.c, tests/gpu_model_train.c, tests/gpu_learner.c)
 * also run, with the real actor/model_cuda.c and actor/model_cuda_train.c (and, for the
 * learner, learner/actor_exec.c), on a machine without a GPU.
 *
 * Built into host_gpu_model, host_gpu_model_train and host_gpu_learner (tests/CMakeLists.txt,
 * CPU-only builds) with MOERL_HAVE_CUDA defined and backend_get renamed to
 * host_cuda_backend_get: the "device" is host memory (pool blocks poisoned with NaN, so a
 * read of an unwritten buffer shows), its kernel table is the CPU's, and
 * core/cuda/moe_cuda.h and model_glue.h are implemented here as plain loops following their contracts (grouped products summed in
 * double; bf16 weights read exactly, without the device's bf16 rounding of the other
 * operand). What this checks is the model path's own work: buffer layouts and sizes, the
 * order of the layers' steps, pointer tables, routing and the gradient bookkeeping; the
 * device kernels themselves are checked by gpu_kernels.c and gpu_moe.c on a GPU. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/cuda/model_glue.h"
#include "core/cuda/moe_cuda.h"
#include "core/dtype.h"
#include "core/status.h"
#include "moe/moe.h"

/* ---- the backend: host memory, the CPU kernel table ---- */

static uint64_t g_allocs; /* pool blocks handed out */

static int h_alloc(const backend_t *be, void **p, size_t bytes) {
    (void)be;
    *p = malloc(bytes > 0 ? bytes : 1);
    if (!*p)
        return mo_errorf(MO_ENOMEM, "host_cuda: %zu bytes", bytes);
    memset(*p, 0xff, bytes); /* NaN in every float */
    g_allocs++;
    return MO_OK;
}

static void h_free(const backend_t *be, void *p) {
    (void)be;
    free(p);
}

static int h_copy(const backend_t *be, void *dst, device_t dst_dev, const void *src,
                  device_t src_dev, size_t bytes) {
    (void)be;
    (void)dst_dev;
    (void)src_dev;
    if (bytes > 0)
        memmove(dst, src, bytes);
    return MO_OK;
}

static int h_zero(const backend_t *be, void *p, size_t bytes) {
    (void)be;
    if (bytes > 0)
        memset(p, 0, bytes);
    return MO_OK;
}

static int h_sync(const backend_t *be) {
    (void)be;
    return MO_OK;
}

static void h_stream(const backend_t *be, void *stream) {
    (void)be;
    (void)stream;
}

const backend_t *host_cuda_backend_get(device_t dev);

const backend_t *host_cuda_backend_get(device_t dev) {
    static backend_t be;
    if (dev != DEV_CUDA)
        return backend_cpu();
    be.device = DEV_CUDA;
    be.name = "host twin of cuda";
    be.k = backend_cpu()->k;
    be.alloc = h_alloc;
    be.free = h_free;
    be.copy = h_copy;
    be.memset_zero = h_zero;
    be.synchronize = h_sync;
    be.set_stream = h_stream;
    return &be;
}

void backend_cuda_pool_stats(cuda_pool_stats_t *s) {
    memset(s, 0, sizeof *s);
    s->device_allocs = g_allocs;
    s->allocs = g_allocs;
}

int backend_cuda_select_device(int ordinal) {
    return ordinal < 0 ? mo_errorf(MO_EINVAL, "host twin: device %d", ordinal) : MO_OK;
}

void *backend_cuda_stream(void) {
    return NULL; /* the host twin runs in order */
}

/* Streams and graphs: the host twin runs in order and records nothing, so by default a
 * capture is refused and the decode step's graph path falls back to running its work as
 * it is. host_cuda_fake_graphs (tests/host_model_graph.c) makes captures succeed with
 * token graphs whose launches are only counted, or makes them fail at the end, so that
 * the graph path's bookkeeping can be followed step by step. */
static char g_stream_token;
static int g_fake_graphs; /* 0 refused, 1 recorded (token graphs), 2 failing at the end */
static int g_capturing;
static uint64_t g_graph_launches;

struct cuda_graph {
    int id;
};

void host_cuda_fake_graphs(int mode);
uint64_t host_cuda_graph_launches(void);

void host_cuda_fake_graphs(int mode) {
    g_fake_graphs = mode;
}

uint64_t host_cuda_graph_launches(void) {
    return g_graph_launches;
}

int backend_cuda_stream_new(void **out) {
    *out = &g_stream_token;
    return MO_OK;
}

void backend_cuda_stream_free(void *stream) {
    (void)stream;
}

uint64_t backend_cuda_memory_epoch(void) {
    return g_allocs;
}

int backend_cuda_capture_begin(void) {
    if (!g_fake_graphs)
        return mo_errorf(MO_EUNSUPPORTED, "host twin: no CUDA graphs");
    if (g_capturing)
        return mo_errorf(MO_ESTATE, "host twin: a capture is already in progress");
    g_capturing = 1;
    return MO_OK;
}

int backend_cuda_capture_end(cuda_graph_t **out, int discard) {
    static int next_id;
    *out = NULL;
    if (!g_capturing)
        return mo_errorf(MO_ESTATE, "host twin: no capture in progress");
    g_capturing = 0;
    if (discard)
        return MO_OK;
    if (g_fake_graphs == 2)
        return mo_errorf(MO_EDEVICE, "host twin: the capture failed");
    *out = calloc(1, sizeof **out);
    if (!*out)
        return mo_errorf(MO_ENOMEM, "host twin: graph");
    (*out)->id = ++next_id;
    return MO_OK;
}

int backend_cuda_graph_launch(const cuda_graph_t *g) {
    if (!g || g_capturing)
        return mo_errorf(MO_ESTATE, "host twin: no graph to launch");
    g_graph_launches++;
    return MO_OK;
}

void backend_cuda_graph_free(cuda_graph_t *g) {
    free(g);
}

int backend_cuda_device_info(cuda_device_info_t *info) {
    memset(info, 0, sizeof *info);
    strcpy(info->name, "host twin");
    return MO_OK;
}

/* ---- dispatch plan, gather and combine: moe/moe.c's ---- */

int moe_cuda_plan_alloc(moe_cuda_plan_t *p, int T, int K, int E) {
    memset(p, 0, sizeof *p);
    if (T < 0 || K < 1 || E < 1 || K > E)
        return mo_errorf(MO_EINVAL, "moe_cuda_plan_alloc: T=%d K=%d E=%d", T, K, E);
    size_t S = (size_t)T * K;
    int32_t *mem = malloc(sizeof(int32_t) * ((size_t)E + 1 + 2 * S));
    if (!mem)
        return mo_errorf(MO_ENOMEM, "moe_cuda_plan_alloc");
    p->T = T, p->K = K, p->E = E;
    p->offsets = mem;
    p->slot_of_row = mem + E + 1;
    p->row_of_slot = p->slot_of_row + S;
    p->mem = mem;
    return MO_OK;
}

void moe_cuda_plan_free(moe_cuda_plan_t *p) {
    free(p->mem);
    memset(p, 0, sizeof *p);
}

/* The stable counting sort of the slots by expert. */
int moe_cuda_plan_build(moe_cuda_plan_t *p, const int32_t *idx) {
    int S = p->T * p->K, E = p->E;
    for (int s = 0; s < S; s++)
        if (idx[s] < 0 || idx[s] >= E)
            return mo_errorf(MO_EINVAL, "moe_cuda_plan_build: slot %d names expert %d", s, idx[s]);
    memset(p->offsets, 0, sizeof(int32_t) * ((size_t)E + 1));
    for (int s = 0; s < S; s++)
        p->offsets[idx[s] + 1]++;
    for (int e = 0; e < E; e++)
        p->offsets[e + 1] += p->offsets[e];
    int32_t *next = malloc(sizeof(int32_t) * (size_t)(E > 0 ? E : 1));
    if (!next)
        return mo_errorf(MO_ENOMEM, "moe_cuda_plan_build");
    memcpy(next, p->offsets, sizeof(int32_t) * (size_t)E);
    for (int s = 0; s < S; s++) {
        int r = next[idx[s]]++;
        p->slot_of_row[r] = s;
        p->row_of_slot[s] = r;
    }
    free(next);
    return MO_OK;
}

int moe_cuda_plan_check(const moe_cuda_plan_t *p) {
    (void)p;
    return MO_OK;
}

static moe_dispatch_t plan_view(const moe_cuda_plan_t *p) {
    moe_dispatch_t d = {p->T, p->K, p->E, p->offsets, p->slot_of_row, p->row_of_slot};
    return d;
}

int moe_cuda_dispatch_forward(float *xg, const float *x, const moe_cuda_plan_t *p, int D) {
    moe_dispatch_t d = plan_view(p);
    moe_dispatch_forward(xg, x, &d, D);
    return MO_OK;
}

int moe_cuda_dispatch_backward(float *dx, const float *dxg, const moe_cuda_plan_t *p, int D) {
    moe_dispatch_t d = plan_view(p);
    moe_dispatch_backward(dx, dxg, &d, D);
    return MO_OK;
}

int moe_cuda_combine_forward(float *out, const float *yg, const float *weight,
                             const moe_cuda_plan_t *p, int D) {
    moe_dispatch_t d = plan_view(p);
    moe_combine_forward(out, yg, weight, &d, D);
    return MO_OK;
}

int moe_cuda_combine_backward(float *dyg, float *dweight, const float *dout, const float *yg,
                              const float *weight, const moe_cuda_plan_t *p, int D) {
    moe_dispatch_t d = plan_view(p);
    moe_combine_backward(dyg, dweight, dout, yg, weight, &d, D);
    return MO_OK;
}

/* ---- grouped products ---- */

static float w_at(const void *w, dtype_t dt, size_t i) {
    return dt == DT_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

static int wdt_ok(const char *op, dtype_t wdt) {
    if (wdt != DT_F32 && wdt != DT_BF16)
        return mo_errorf(MO_EUNSUPPORTED, "%s: weight dtype %s", op, dtype_name(wdt));
    return MO_OK;
}

/* out (rows, N) = alpha * a (rows, Q) @ op(W_e) (+ out); op(W) = W^T with W (N, Q) when not
 * bt, W with W (Q, N) when bt. */
static int gmm(float *out, const float *a, const void *const *w, dtype_t wdt, int bt,
               const int32_t *offsets, int n, int N, int Q, float alpha, int acc) {
    for (int e = 0; e < n; e++) {
        const void *W = w[e];
        for (int r = offsets[e]; r < offsets[e + 1]; r++)
            for (int j = 0; j < N; j++) {
                float *y = out + (size_t)r * N + j;
                if (!W) {
                    if (!acc)
                        *y = 0.0f;
                    continue;
                }
                double s = 0.0;
                for (int q = 0; q < Q; q++) {
                    size_t at = bt ? (size_t)q * N + j : (size_t)j * Q + q;
                    s += (double)a[(size_t)r * Q + q] * w_at(W, wdt, at);
                }
                *y = (float)(alpha * s) + (acc ? *y : 0.0f);
            }
    }
    return MO_OK;
}

int moe_cuda_gmm_forward(float *out, const float *x, const void *const *w, dtype_t wdt,
                         const int32_t *offsets, int n, int rows, int C, int OC, float alpha,
                         int accumulate) {
    (void)rows;
    TRY(wdt_ok("moe_cuda_gmm_forward", wdt));
    return gmm(out, x, w, wdt, 0, offsets, n, OC, C, alpha, accumulate);
}

int moe_cuda_gmm_backward_x(float *dx, const float *dout, const void *const *w, dtype_t wdt,
                            const int32_t *offsets, int n, int rows, int C, int OC, float alpha,
                            int accumulate) {
    (void)rows;
    TRY(wdt_ok("moe_cuda_gmm_backward_x", wdt));
    return gmm(dx, dout, w, wdt, 1, offsets, n, C, OC, alpha, accumulate);
}

int moe_cuda_gmm_backward_w(float *const *dw, const float *dout, const float *x,
                            const int32_t *offsets, int n, int rows, int C, int OC, float alpha) {
    (void)rows;
    for (int e = 0; e < n; e++) {
        float *W = dw[e];
        if (!W || offsets[e + 1] == offsets[e])
            continue;
        for (int o = 0; o < OC; o++)
            for (int c = 0; c < C; c++) {
                double s = 0.0;
                for (int r = offsets[e]; r < offsets[e + 1]; r++)
                    s += (double)dout[(size_t)r * OC + o] * x[(size_t)r * C + c];
                W[(size_t)o * C + c] += (float)(alpha * s);
            }
    }
    return MO_OK;
}

/* ---- LoRA and the expert MLP: core/cuda/moe_cuda.cu's steps on the products above ---- */

int moe_cuda_lora_forward(float *y, float *xa, const float *x, const moe_cuda_lora_t *l,
                          const int32_t *offsets, int n, int rows, int C, int OC) {
    if (!l->A || !l->B || l->R < 1)
        return mo_errorf(MO_EINVAL, "moe_cuda_lora_forward: no adapter tables");
    TRY(moe_cuda_gmm_forward(xa, x, (const void *const *)l->A, DT_F32, offsets, n, rows, C, l->R,
                             1.0f, 0));
    return moe_cuda_gmm_forward(y, xa, (const void *const *)l->B, DT_F32, offsets, n, rows, l->R,
                                OC, l->scale, 1);
}

int moe_cuda_lora_backward(float *dx, const float *dy, const float *x, const float *xa,
                           const moe_cuda_lora_t *l, const int32_t *offsets, int n, int rows, int C,
                           int OC, float *tmp) {
    if (!l->A || !l->B || l->R < 1)
        return mo_errorf(MO_EINVAL, "moe_cuda_lora_backward: no adapter tables");
    int R = l->R;
    if (l->dB)
        TRY(moe_cuda_gmm_backward_w(l->dB, dy, xa, offsets, n, rows, R, OC, l->scale));
    if (!dx && !l->dA)
        return MO_OK;
    TRY(moe_cuda_gmm_backward_x(tmp, dy, (const void *const *)l->B, DT_F32, offsets, n, rows, R, OC,
                                l->scale, 0));
    if (dx)
        TRY(moe_cuda_gmm_backward_x(dx, tmp, (const void *const *)l->A, DT_F32, offsets, n, rows, C,
                                    R, 1.0f, 1));
    if (l->dA)
        TRY(moe_cuda_gmm_backward_w(l->dA, tmp, x, offsets, n, rows, C, R, 1.0f));
    return MO_OK;
}

static int proj_forward(float *out, float *xa, const float *inp, const void *const *w, dtype_t dt,
                        const moe_cuda_lora_t *l, const int32_t *offsets, int n, int rows, int C,
                        int OC) {
    TRY(moe_cuda_gmm_forward(out, inp, w, dt, offsets, n, rows, C, OC, 1.0f, 0));
    if (l->A)
        TRY(moe_cuda_lora_forward(out, xa, inp, l, offsets, n, rows, C, OC));
    return MO_OK;
}

static int acts_ok(const char *op, const moe_cuda_experts_t *w, const moe_cuda_acts_t *a) {
    if ((w->lora_gate.A && !a->xa_gate) || (w->lora_up.A && !a->xa_up) ||
        (w->lora_down.A && !a->xa_down))
        return mo_errorf(MO_EINVAL, "%s: an adapted projection has no xa buffer", op);
    return MO_OK;
}

int moe_cuda_experts_forward(float *ye, const moe_cuda_acts_t *a, const float *xe,
                             const int32_t *offsets, int n, int rows, const moe_cuda_experts_t *w,
                             int D, int F) {
    TRY(acts_ok("moe_cuda_experts_forward", w, a));
    if (rows == 0 || n == 0)
        return MO_OK;
    dtype_t dt = w->dtype;
    TRY(proj_forward(a->g, a->xa_gate, xe, w->gate, dt, &w->lora_gate, offsets, n, rows, D, F));
    TRY(proj_forward(a->u, a->xa_up, xe, w->up, dt, &w->lora_up, offsets, n, rows, D, F));
    size_t nf = (size_t)rows * F;
    for (size_t i = 0; i < nf; i++) {
        float g = a->g[i];
        a->h[i] = g / (1.0f + expf(-g)) * a->u[i];
    }
    return proj_forward(ye, a->xa_down, a->h, w->down, dt, &w->lora_down, offsets, n, rows, F, D);
}

static int rank_of(const moe_cuda_lora_t *l) {
    return l->A ? l->R : 0;
}

size_t moe_cuda_experts_backward_scratch_floats(const moe_cuda_experts_t *w, int rows, int F) {
    int r = rank_of(&w->lora_gate);
    if (rank_of(&w->lora_up) > r)
        r = rank_of(&w->lora_up);
    if (rank_of(&w->lora_down) > r)
        r = rank_of(&w->lora_down);
    return (size_t)rows * (3 * (size_t)F + (size_t)r);
}

int moe_cuda_experts_backward(float *dxe, const float *dye, const float *xe,
                              const moe_cuda_acts_t *a, const int32_t *offsets, int n, int rows,
                              const moe_cuda_experts_t *w, int D, int F, float *scratch) {
    TRY(acts_ok("moe_cuda_experts_backward", w, a));
    if (rows == 0 || n == 0)
        return MO_OK;
    dtype_t dt = w->dtype;
    size_t nf = (size_t)rows * F;
    float *dh = scratch, *dg = dh + nf, *du = dg + nf, *tmp = du + nf;
    TRY(moe_cuda_gmm_backward_x(dh, dye, w->down, dt, offsets, n, rows, F, D, 1.0f, 0));
    if (w->lora_down.A)
        TRY(moe_cuda_lora_backward(dh, dye, a->h, a->xa_down, &w->lora_down, offsets, n, rows, F, D,
                                   tmp));
    for (size_t i = 0; i < nf; i++) {
        float g = a->g[i], s = 1.0f / (1.0f + expf(-g));
        dg[i] = dh[i] * a->u[i] * s * (1.0f + g * (1.0f - s));
        du[i] = dh[i] * g * s;
    }
    TRY(moe_cuda_gmm_backward_x(dxe, dg, w->gate, dt, offsets, n, rows, D, F, 1.0f, 1));
    if (w->lora_gate.A)
        TRY(moe_cuda_lora_backward(dxe, dg, xe, a->xa_gate, &w->lora_gate, offsets, n, rows, D, F,
                                   tmp));
    TRY(moe_cuda_gmm_backward_x(dxe, du, w->up, dt, offsets, n, rows, D, F, 1.0f, 1));
    if (w->lora_up.A)
        TRY(moe_cuda_lora_backward(dxe, du, xe, a->xa_up, &w->lora_up, offsets, n, rows, D, F,
                                   tmp));
    return MO_OK;
}

/* ---- model_glue: core/cuda/model_glue.cu's loops ---- */

int model_glue_add(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
    return MO_OK;
}

int model_glue_topk_weights(float *w, const float *val, int T, int K, int norm, float scale) {
    for (int t = 0; t < T; t++) {
        const float *v = val + (size_t)t * K;
        float *o = w + (size_t)t * K;
        float sum = 0.0f;
        for (int i = 0; i < K; i++) {
            o[i] = v[i];
            sum += v[i];
        }
        for (int i = 0; i < K; i++)
            o[i] = (norm ? o[i] / (sum + 0.0f) : o[i]) * scale;
    }
    return MO_OK;
}

int model_glue_take(float *val, const float *probs, const int32_t *idx, int T, int E, int K) {
    for (size_t i = 0; i < (size_t)T * K; i++) {
        int e = idx[i];
        val[i] = e >= 0 && e < E ? probs[(i / (size_t)K) * E + (size_t)e] : NAN;
    }
    return MO_OK;
}

int model_glue_router_backward(float *dlogits, const float *dweight, const int32_t *idx,
                               const float *probs, int T, int E, int K, int norm, float scale) {
    for (int t = 0; t < T; t++) {
        const float *s = probs + (size_t)t * E;
        const int32_t *ix = idx + (size_t)t * K;
        const float *dw = dweight + (size_t)t * K;
        float *dl = dlogits + (size_t)t * E;
        double a = scale, b = 0.0;
        if (norm) {
            float sumf = 0.0f;
            double dot = 0.0;
            for (int i = 0; i < K; i++)
                sumf += s[ix[i]];
            double den = (double)(sumf + 0.0f);
            for (int i = 0; i < K; i++)
                dot += (double)dw[i] * s[ix[i]];
            a = (double)scale / den;
            b = a * dot / den;
        }
        double dot = 0.0;
        for (int i = 0; i < K; i++)
            dot += (a * dw[i] - b) * s[ix[i]];
        for (int e = 0; e < E; e++)
            dl[e] = (float)(-(double)s[e] * dot);
        for (int i = 0; i < K; i++)
            dl[ix[i]] += (float)((a * dw[i] - b) * s[ix[i]]);
    }
    return MO_OK;
}
