/* swiglu: CPU gated activation out = silu(gate) * up and its backward. */
#include <math.h>

#include "core/cpu/cpu_kernels.h"

/* Elements below which a loop stays on one thread. */
#define PAR_MIN 65536

void cpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* With s = sigmoid(g): d silu(g) / dg = s * (1 + g * (1 - s)). */
void cpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                         const float *up, size_t n) {
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        float s = 1.0f / (1.0f + expf(-g));
        if (dgate)
            dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        if (dup)
            dup[i] += dout[i] * g * s;
    }
}
