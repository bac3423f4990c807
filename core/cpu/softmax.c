/* softmax: row softmax of (N, C) on the CPU, max-subtracted, sums in double. */
#include <math.h>
#include <stddef.h>

#include "core/cpu/cpu_kernels.h"

/* Rows per parallel chunk are whole rows; small problems stay on one thread. */
#define SOFTMAX_PAR_MIN 32768

void cpu_softmax_forward(float *out, const float *x, int N, int C) {
#pragma omp parallel for schedule(static) if ((long)N * C > SOFTMAX_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C; /* (C) */
        float *o = out + (size_t)n * C;      /* (C) */
        float m = -INFINITY;
        for (int c = 0; c < C; c++)
            m = xr[c] > m ? xr[c] : m;
        double s = 0.0;
        for (int c = 0; c < C; c++) {
            float e = expf(xr[c] - m);
            o[c] = e;
            s += e;
        }
        float inv = (float)(1.0 / s);
        for (int c = 0; c < C; c++)
            o[c] *= inv;
    }
}

/* dx_c += y_c (dy_c - sum_j dy_j y_j). */
void cpu_softmax_backward(float *dx, const float *dout, const float *out, int N, int C) {
    if (!dx)
        return;
#pragma omp parallel for schedule(static) if ((long)N * C > SOFTMAX_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *dy = dout + (size_t)n * C; /* (C) */
        const float *y = out + (size_t)n * C;   /* (C) */
        float *g = dx + (size_t)n * C;          /* (C) */
        double s = 0.0;
        for (int c = 0; c < C; c++)
            s += (double)dy[c] * y[c];
        float sf = (float)s;
        for (int c = 0; c < C; c++)
            g[c] += y[c] * (dy[c] - sf);
    }
}
