/* rope: CPU rotary position embedding in the rotate-half layout. */
#include <math.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

/* Frequencies handled per pass; cos and sin of one token live on the stack. */
#define ROPE_CHUNK 128
/* Work (elements) below which a loop stays on one thread. */
#define PAR_MIN 32768

/* cs, sn (n) = mscale * cos, sin of (float)pos * inv_freq[i0 .. i0+n). */
static void angles(float *cs, float *sn, int32_t pos, const float *inv_freq, float mscale, int i0,
                   int n) {
    for (int i = 0; i < n; i++) {
        float a = (float)pos * inv_freq[i0 + i];
        cs[i] = cosf(a) * mscale;
        sn[i] = sinf(a) * mscale;
    }
}

/* out1 = x1 c - x2 s, out2 = x2 c + x1 s, for pairs (i, i + rot/2). */
void cpu_rope_forward(float *out, const float *x, const int32_t *pos, const float *inv_freq,
                      float mscale, int N, int H, int Dh, int rot) {
    MO_ASSERT(N >= 0 && H > 0 && rot > 0 && rot % 2 == 0 && rot <= Dh);
    int half = rot / 2;
#pragma omp parallel for schedule(static) if ((size_t)N * (size_t)H * (size_t)Dh > PAR_MIN)
    for (int n = 0; n < N; n++) {
        float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            int m = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            angles(cs, sn, pos[n], inv_freq, mscale, i0, m);
            for (int h = 0; h < H; h++) {
                size_t base = ((size_t)n * (size_t)H + (size_t)h) * (size_t)Dh + (size_t)i0;
                const float *x1 = x + base, *x2 = x + base + half;
                float *o1 = out + base, *o2 = out + base + half;
                for (int i = 0; i < m; i++) {
                    float a = x1[i], b = x2[i];
                    o1[i] = a * cs[i] - b * sn[i];
                    o2[i] = b * cs[i] + a * sn[i];
                }
            }
        }
        if (out != x && rot < Dh) {
            for (int h = 0; h < H; h++) {
                size_t base = ((size_t)n * (size_t)H + (size_t)h) * (size_t)Dh + (size_t)rot;
                memcpy(out + base, x + base, (size_t)(Dh - rot) * sizeof(float));
            }
        }
    }
}

/* The transpose of the rotation: dx1 += g1 c + g2 s, dx2 += g2 c - g1 s. */
void cpu_rope_backward(float *dx, const float *dout, const int32_t *pos, const float *inv_freq,
                       float mscale, int N, int H, int Dh, int rot) {
    MO_ASSERT(N >= 0 && H > 0 && rot > 0 && rot % 2 == 0 && rot <= Dh);
    MO_ASSERT(dx != dout || N == 0);
    if (!dx)
        return;
    int half = rot / 2;
#pragma omp parallel for schedule(static) if ((size_t)N * (size_t)H * (size_t)Dh > PAR_MIN)
    for (int n = 0; n < N; n++) {
        float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            int m = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            angles(cs, sn, pos[n], inv_freq, mscale, i0, m);
            for (int h = 0; h < H; h++) {
                size_t base = ((size_t)n * (size_t)H + (size_t)h) * (size_t)Dh + (size_t)i0;
                const float *restrict g1 = dout + base, *restrict g2 = dout + base + half;
                float *restrict d1 = dx + base, *restrict d2 = dx + base + half;
                for (int i = 0; i < m; i++) {
                    d1[i] += g1[i] * cs[i] + g2[i] * sn[i];
                    d2[i] += g2[i] * cs[i] - g1[i] * sn[i];
                }
            }
        }
        for (int h = 0; h < H; h++) {
            size_t base = ((size_t)n * (size_t)H + (size_t)h) * (size_t)Dh;
            for (int d = rot; d < Dh; d++)
                dx[base + d] += dout[base + d];
        }
    }
}
