/* rmsnorm: CUDA root-mean-square normalisation, one block per row, sums in
 * double as on the CPU; dw by column blocks summed in a fixed order. */
#include "core/cuda/cuda_common.h"

#define RMS_THREADS 256

/* out (N, D) = x * rstd * w; rstd (N). One block per row. */
static __global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *x,
                                              const float *w, int D, float eps) {
    __shared__ double sh[32];
    size_t row = blockIdx.x;
    const float *xi = x + row * (size_t)D; /* (D) */
    float *oi = out + row * (size_t)D;     /* (D) */
    double ss = 0.0;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        ss += (double)xi[d] * (double)xi[d];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf((float)(ss / D) + eps);
    if (threadIdx.x == 0)
        rstd[row] = r;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        oi[d] = w ? w[d] * (xi[d] * r) : xi[d] * r;
}

/* dx (N, D) += r w g - x r^3 / D sum_j g_j w_j x_j. One block per row. */
static __global__ void rmsnorm_dx_kernel(float *dx, const float *dout, const float *x,
                                         const float *w, const float *rstd, int D) {
    __shared__ double sh[32];
    size_t row = blockIdx.x;
    const float *xi = x + row * (size_t)D;    /* (D) */
    const float *gi = dout + row * (size_t)D; /* (D) */
    float *di = dx + row * (size_t)D;         /* (D) */
    float r = rstd[row];
    double dot = 0.0;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        dot += (double)gi[d] * (w ? w[d] : 1.0f) * xi[d];
    dot = block_sum(dot, sh);
    float k = (float)(dot * r * r * r / D);
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        di[d] += r * (w ? w[d] : 1.0f) * gi[d] - k * xi[d];
}

/* dw (D) += sum_i g_i x_i r_i. Block (32, 8): 32 columns, 8 row lanes summed
 * in a fixed order. */
static __global__ void rmsnorm_dw_kernel(float *dw, const float *dout, const float *x,
                                         const float *rstd, int N, int D) {
    __shared__ float sh[8][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (c < D)
        for (int i = threadIdx.y; i < N; i += 8) {
            size_t o = (size_t)i * (size_t)D + (size_t)c;
            acc += dout[o] * x[o] * rstd[i];
        }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < D) {
        float s = 0.0f;
        for (int r = 0; r < 8; r++)
            s += sh[r][threadIdx.x];
        dw[c] += s;
    }
}

extern "C" void cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N,
                                     int D, float eps) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || D <= 0) {
        cuda_record(MO_EINVAL, "rmsnorm_forward: bad shape N=%d D=%d", N, D);
        return;
    }
    if (N == 0)
        return;
    rmsnorm_forward_kernel<<<(unsigned)N, RMS_THREADS, 0, cuda_stream()>>>(out, rstd, x, w, D, eps);
    LAUNCH_CHECK("rmsnorm_forward_kernel");
}

extern "C" void cuda_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                                      const float *w, const float *rstd, int N, int D) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || D <= 0) {
        cuda_record(MO_EINVAL, "rmsnorm_backward: bad shape N=%d D=%d", N, D);
        return;
    }
    if (N == 0)
        return;
    if (dx) {
        rmsnorm_dx_kernel<<<(unsigned)N, RMS_THREADS, 0, cuda_stream()>>>(dx, dout, x, w, rstd, D);
        LAUNCH_CHECK("rmsnorm_dx_kernel");
    }
    if (dw) {
        rmsnorm_dw_kernel<<<(unsigned)((D + 31) / 32), dim3(32, 8), 0, cuda_stream()>>>(dw, dout, x,
                                                                                        rstd, N, D);
        LAUNCH_CHECK("rmsnorm_dw_kernel");
    }
}
