/* embedding: CPU token-embedding lookup and its scatter-add backward. */
#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

/* Work (elements) below which a loop stays on one thread. */
#define PAR_MIN 32768

void cpu_embedding_forward(float *out, const int32_t *ids, const wview_t *wte, int T, int D) {
    MO_ASSERT(T >= 0 && D > 0);
#pragma omp parallel for schedule(static) if ((size_t)T * (size_t)D > PAR_MIN)
    for (int t = 0; t < T; t++) {
        MO_ASSERT(ids[t] >= 0);
        cpu_wview_rows_f32(out + (size_t)t * (size_t)D, wte, ids[t], 1, D);
    }
}

/* Threads own column ranges, so repeated ids never race and the sum order
 * does not depend on the thread count. */
void cpu_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T, int D) {
    enum { W = 256 };
    MO_ASSERT(T >= 0 && D > 0);
    if (!dwte)
        return;
    int ntask = (D + W - 1) / W;
#pragma omp parallel for schedule(static) if ((size_t)T * (size_t)D > PAR_MIN)
    for (int k = 0; k < ntask; k++) {
        int c0 = k * W, n = D - c0 < W ? D - c0 : W;
        for (int t = 0; t < T; t++) {
            float *restrict dst = dwte + (size_t)ids[t] * (size_t)D + c0;
            const float *restrict src = dout + (size_t)t * (size_t)D + c0;
            for (int c = 0; c < n; c++)
                dst[c] += src[c];
        }
    }
}
