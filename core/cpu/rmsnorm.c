/* rmsnorm: CPU root-mean-square normalisation (f32, as Hugging Face's RMSNorm). */
#include <math.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

/* Work (elements) below which a loop stays on one thread. */
#define PAR_MIN 32768

/* One row: out = x * r (* w), r = (mean(x^2) + eps)^-1/2 summed in double (each
 * square exact, so only the order of the additions depends on the vector width). Compiled
 * for AVX-512 and AVX2 too: the qk norms run this on every head of every token. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static float norm_row(float *restrict oi, const float *restrict xi, const float *restrict w, int D,
                      float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; d++)
        ss += (double)xi[d] * (double)xi[d];
    float r = 1.0f / sqrtf((float)(ss / D) + eps);
    if (w) {
        for (int d = 0; d < D; d++)
            oi[d] = w[d] * (xi[d] * r);
    } else {
        for (int d = 0; d < D; d++)
            oi[d] = xi[d] * r;
    }
    return r;
}

void cpu_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int D,
                         float eps) {
    MO_ASSERT(N >= 0 && D > 0);
#pragma omp parallel for schedule(static) if ((size_t)N * (size_t)D > PAR_MIN)
    for (int i = 0; i < N; i++)
        rstd[i] = norm_row(out + (size_t)i * (size_t)D, x + (size_t)i * (size_t)D, w, D, eps);
}

/* y = x * r * w with r = (mean(x^2) + eps)^-1/2:
 * dx_d = r * w_d * g_d - x_d * r^3 / D * sum_j g_j w_j x_j,  dw_d = sum_i g_id x_id r_i. */
void cpu_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x, const float *w,
                          const float *rstd, int N, int D) {
    MO_ASSERT(N >= 0 && D > 0);
    if (dx) {
#pragma omp parallel for schedule(static) if ((size_t)N * (size_t)D > PAR_MIN)
        for (int i = 0; i < N; i++) {
            const float *restrict xi = x + (size_t)i * (size_t)D;
            const float *restrict gi = dout + (size_t)i * (size_t)D;
            float *restrict di = dx + (size_t)i * (size_t)D;
            float r = rstd[i];
            double dot = 0.0;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++)
                dot += (double)gi[d] * (w ? w[d] : 1.0f) * xi[d];
            float k = (float)(dot * r * r * r / D);
            for (int d = 0; d < D; d++)
                di[d] += r * (w ? w[d] : 1.0f) * gi[d] - k * xi[d];
        }
    }
    if (dw) {
        enum { W = 256 };
        int ntask = (D + W - 1) / W;
#pragma omp parallel for schedule(static) if ((size_t)N * (size_t)D > PAR_MIN)
        for (int k = 0; k < ntask; k++) {
            int c0 = k * W, n = D - c0 < W ? D - c0 : W;
            float acc[W];
            for (int c = 0; c < n; c++)
                acc[c] = 0.0f;
            for (int i = 0; i < N; i++) {
                const float *restrict xi = x + (size_t)i * (size_t)D + c0;
                const float *restrict gi = dout + (size_t)i * (size_t)D + c0;
                float r = rstd[i];
                for (int c = 0; c < n; c++)
                    acc[c] += gi[c] * xi[c] * r;
            }
            for (int c = 0; c < n; c++)
                dw[c0 + c] += acc[c];
        }
    }
}
