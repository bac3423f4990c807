/* softmax: CUDA row softmax of (N, C), one block per row, max-subtracted,
 * sums in double as on the CPU. */
#include "core/cuda/cuda_common.h"

#define SOFTMAX_THREADS 256

static __global__ void softmax_forward_kernel(float *out, const float *x, int C) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    size_t row = blockIdx.x;
    const float *xr = x + row * (size_t)C; /* (C) */
    float *o = out + row * (size_t)C;      /* (C) */
    float m = -INFINITY;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        m = fmaxf(m, xr[c]);
    m = block_max(m, shf);
    double s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        s += expf(xr[c] - m);
    s = block_sum(s, shd);
    float inv = (float)(1.0 / s);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        o[c] = expf(xr[c] - m) * inv;
}

/* dx_c += y_c (dy_c - sum_j dy_j y_j). */
static __global__ void softmax_backward_kernel(float *dx, const float *dout, const float *out,
                                               int C) {
    __shared__ double sh[32];
    size_t row = blockIdx.x;
    const float *dy = dout + row * (size_t)C; /* (C) */
    const float *y = out + row * (size_t)C;   /* (C) */
    float *g = dx + row * (size_t)C;          /* (C) */
    double s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        s += (double)dy[c] * y[c];
    float sf = (float)block_sum(s, sh);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        g[c] += y[c] * (dy[c] - sf);
}

extern "C" void cuda_softmax_forward(float *out, const float *x, int N, int C) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || C <= 0) {
        cuda_record(MO_EINVAL, "softmax_forward: bad shape N=%d C=%d", N, C);
        return;
    }
    if (N == 0)
        return;
    softmax_forward_kernel<<<(unsigned)N, SOFTMAX_THREADS, 0, cuda_stream()>>>(out, x, C);
    LAUNCH_CHECK("softmax_forward_kernel");
}

extern "C" void cuda_softmax_backward(float *dx, const float *dout, const float *out, int N,
                                      int C) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || C <= 0) {
        cuda_record(MO_EINVAL, "softmax_backward: bad shape N=%d C=%d", N, C);
        return;
    }
    if (N == 0 || !dx)
        return;
    softmax_backward_kernel<<<(unsigned)N, SOFTMAX_THREADS, 0, cuda_stream()>>>(dx, dout, out, C);
    LAUNCH_CHECK("softmax_backward_kernel");
}
