/* model_glue: the residual sum and the router's combine weights on CUDA. */
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
