/* adamw: CPU AdamW step with decoupled weight decay (PyTorch's torch.optim.AdamW). */
#include <math.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

/* Elements below which a loop stays on one thread. */
#define PAR_MIN 65536

/* p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
 * p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  (as PyTorch orders it:
 * denominator sqrt(v) / sqrt(1 - b2^t) + eps, step size lr / (1 - b1^t)). */
void cpu_adamw_update(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, int step) {
    MO_ASSERT(step >= 1);
    float decay = 1.0f - lr * weight_decay;
    float step_size = (float)(lr / (1.0 - pow(beta1, step)));
    float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, step));
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = grad[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        param[i] = param[i] * decay - step_size * mi / denom;
    }
}
