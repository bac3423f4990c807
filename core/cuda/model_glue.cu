/* model_glue: the residual sum, the router's combine weights and their backward on CUDA. */
#include "core/cuda/cuda_common.h"
#include "core/cuda/model_glue.h"

#define GLUE_THREADS 256

static __global__ void add_kernel(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

/* One thread per token; the same f32 operations in the same order as router.c's
 * weights_row (eps 0 for the softmax top-k kind). */
static __global__ void topk_weights_kernel(float *w, const float *val, int T, int K, int norm,
                                           float scale) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *v = val + (size_t)t * K;
        float *o = w + (size_t)t * K;
        float sum = 0.0f;
        for (int i = 0; i < K; i++) {
            float x = v[i];
            o[i] = x;
            sum = __fadd_rn(sum, x);
        }
        for (int i = 0; i < K; i++) {
            float x = o[i];
            if (norm)
                x = __fdiv_rn(x, __fadd_rn(sum, 0.0f));
            o[i] = __fmul_rn(x, scale);
        }
    }
}

static __global__ void take_kernel(float *val, const float *probs, const int32_t *idx, int T, int E,
                                   int K) {
    size_t n = (size_t)T * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int e = idx[i];
        val[i] = e >= 0 && e < E ? probs[(i / (size_t)K) * E + (size_t)e] : NAN;
    }
}

/* One thread per token: router_backward's sel_grad_row and softmax branch for the softmax
 * top-k kind (eps 0), the same operations in the same order; dlogits starts from zero as
 * the CPU's does. */
static __global__ void router_backward_kernel(float *dlogits, const float *dweight,
                                              const int32_t *idx, const float *probs, int T, int E,
                                              int K, int norm, float scale) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *s = probs + (size_t)t * E;    /* (E) */
        const int32_t *ix = idx + (size_t)t * K;   /* (K) */
        const float *dw = dweight + (size_t)t * K; /* (K) */
        float *dl = dlogits + (size_t)t * E;       /* (E) */
        double a = scale, b = 0.0;
        if (norm) {
            float sumf = 0.0f;
            double dot = 0.0;
            for (int i = 0; i < K; i++)
                if (ix[i] >= 0 && ix[i] < E)
                    sumf = __fadd_rn(sumf, s[ix[i]]);
            double den = (double)__fadd_rn(sumf, 0.0f);
            for (int i = 0; i < K; i++)
                if (ix[i] >= 0 && ix[i] < E)
                    dot += (double)dw[i] * s[ix[i]];
            a = (double)scale / den;
            b = a * dot / den;
        }
        double dot = 0.0;
        for (int i = 0; i < K; i++)
            if (ix[i] >= 0 && ix[i] < E)
                dot += (a * dw[i] - b) * s[ix[i]];
        for (int e = 0; e < E; e++)
            dl[e] = (float)(-(double)s[e] * dot);
        for (int i = 0; i < K; i++)
            if (ix[i] >= 0 && ix[i] < E)
                dl[ix[i]] = __fadd_rn(dl[ix[i]], (float)((a * dw[i] - b) * s[ix[i]]));
    }
}

extern "C" int model_glue_add(float *out, const float *a, const float *b, size_t n) {
    TRY(cuda_enter());
    if (!out || !a || !b)
        return mo_errorf(MO_EINVAL, "model_glue_add: NULL buffer");
    if (n == 0)
        return MO_OK;
    add_kernel<<<cuda_grid(n, GLUE_THREADS), GLUE_THREADS, 0, cuda_stream()>>>(out, a, b, n);
    return LAUNCH_OK("add_kernel") ? MO_OK : MO_EDEVICE;
}

extern "C" int model_glue_topk_weights(float *w, const float *val, int T, int K, int norm,
                                       float scale) {
    TRY(cuda_enter());
    if (!w || !val || T < 0 || K < 1)
        return mo_errorf(MO_EINVAL, "model_glue_topk_weights: bad arguments T=%d K=%d", T, K);
    if (T == 0)
        return MO_OK;
    topk_weights_kernel<<<cuda_grid((size_t)T, GLUE_THREADS), GLUE_THREADS, 0, cuda_stream()>>>(
        w, val, T, K, norm, scale);
    return LAUNCH_OK("topk_weights_kernel") ? MO_OK : MO_EDEVICE;
}

extern "C" int model_glue_take(float *val, const float *probs, const int32_t *idx, int T, int E,
                               int K) {
    TRY(cuda_enter());
    if (!val || !probs || !idx || T < 0 || E < 1 || K < 1 || K > E)
        return mo_errorf(MO_EINVAL, "model_glue_take: bad arguments T=%d E=%d K=%d", T, E, K);
    if (T == 0)
        return MO_OK;
    size_t n = (size_t)T * K;
    take_kernel<<<cuda_grid(n, GLUE_THREADS), GLUE_THREADS, 0, cuda_stream()>>>(val, probs, idx, T,
                                                                                E, K);
    return LAUNCH_OK("take_kernel") ? MO_OK : MO_EDEVICE;
}

extern "C" int model_glue_router_backward(float *dlogits, const float *dweight, const int32_t *idx,
                                          const float *probs, int T, int E, int K, int norm,
                                          float scale) {
    TRY(cuda_enter());
    if (!dlogits || !dweight || !idx || !probs || T < 0 || E < 1 || K < 1 || K > E)
        return mo_errorf(MO_EINVAL, "model_glue_router_backward: bad arguments T=%d E=%d K=%d", T,
                         E, K);
    if (T == 0)
        return MO_OK;
    router_backward_kernel<<<cuda_grid((size_t)T, GLUE_THREADS), GLUE_THREADS, 0, cuda_stream()>>>(
        dlogits, dweight, idx, probs, T, E, K, norm, scale);
    return LAUNCH_OK("router_backward_kernel") ? MO_OK : MO_EDEVICE;
}
