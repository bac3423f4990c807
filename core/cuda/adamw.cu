/* adamw: CUDA AdamW step with decoupled weight decay, the CPU's arithmetic
 * (PyTorch's torch.optim.AdamW order): bias corrections computed once on the
 * host in double, the update elementwise in f32. */
#include "core/cuda/cuda_common.h"

#define ADAMW_THREADS 256

static __global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, size_t n,
                                    float beta1, float beta2, float eps, float decay,
                                    float step_size, float bc2_sqrt) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = grad[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        param[i] = param[i] * decay - step_size * mi / denom;
    }
}

extern "C" void cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                                  float lr, float beta1, float beta2, float eps, float weight_decay,
                                  int step) {
    if (cuda_enter() < 0)
        return;
    if (step < 1) {
        cuda_record(MO_EINVAL, "adamw_update: step counts from 1 (got %d)", step);
        return;
    }
    if (n == 0)
        return;
    float decay = 1.0f - lr * weight_decay;
    float step_size = (float)(lr / (1.0 - pow(beta1, step)));
    float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, step));
    adamw_kernel<<<cuda_grid(n, ADAMW_THREADS), ADAMW_THREADS, 0, cuda_stream()>>>(
        param, grad, m, v, n, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    LAUNCH_CHECK("adamw_kernel");
}
