/* swiglu: CUDA gated activation out = silu(gate) * up and its backward,
 * elementwise with the CPU's expressions. */
#include "core/cuda/cuda_common.h"

#define SWIGLU_THREADS 256

static __global__ void swiglu_forward_kernel(float *out, const float *gate, const float *up,
                                             size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* With s = sigmoid(g): d silu(g) / dg = s * (1 + g * (1 - s)). */
static __global__ void swiglu_backward_kernel(float *dgate, float *dup, const float *dout,
                                              const float *gate, const float *up, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        float s = 1.0f / (1.0f + expf(-g));
        if (dgate)
            dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        if (dup)
            dup[i] += dout[i] * g * s;
    }
}

extern "C" void cuda_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    if (cuda_enter() < 0 || n == 0)
        return;
    swiglu_forward_kernel<<<cuda_grid(n, SWIGLU_THREADS), SWIGLU_THREADS, 0, cuda_stream()>>>(
        out, gate, up, n);
    LAUNCH_CHECK("swiglu_forward_kernel");
}

extern "C" void cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                                     const float *up, size_t n) {
    if (cuda_enter() < 0 || n == 0 || (!dgate && !dup))
        return;
    swiglu_backward_kernel<<<cuda_grid(n, SWIGLU_THREADS), SWIGLU_THREADS, 0, cuda_stream()>>>(
        dgate, dup, dout, gate, up, n);
    LAUNCH_CHECK("swiglu_backward_kernel");
}
