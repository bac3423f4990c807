/* lora: low-rank adapters on frozen projections: y = W x + scale * B (A x). */
#include "lora/lora.h"

#include <stdlib.h>
#include <string.h>

#include "core/cpu/scratch.h"
#include "core/status.h"

/* The scratch slot lora_forward holds; CPU ops it calls with f32 weights
 * take lower slots or none. */
#define LORA_SCRATCH_SLOT (CPU_SCRATCH_SLOTS - 1)

void lora_scaled_bt(float *bt, const lora_pair_t *p, int OC) {
    int R = p->R;
    for (int o = 0; o < OC; o++)
        for (int r = 0; r < R; r++)
            bt[(size_t)r * OC + o] = p->scale * p->B[(size_t)o * R + r];
}

static void scale_inplace(float *x, size_t n, float s) {
    if (s == 1.0f)
        return;
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

void lora_forward(const kernels_t *k, float *y, float *xa, const float *x, const lora_pair_t *p,
                  int T, int C, int OC) {
    MO_ASSERT(k && y && xa && x && p && p->A && p->B && p->R > 0);
    if (T <= 0)
        return;
    int R = p->R;
    /* xa (T, R) = x A^T */
    wview_t wa = wview_f32(p->A);
    k->matmul_forward(xa, x, &wa, NULL, T, C, R);
    /* y (T, OC) += xa (T, R) @ (scale B^T) (R, OC): the accumulating input
     * gradient product of a layer with weight (R, OC). */
    float *bt = cpu_scratch_floats(LORA_SCRATCH_SLOT, (size_t)R * OC); /* (R, OC) */
    lora_scaled_bt(bt, p, OC);
    wview_t wbt = wview_f32(bt);
    k->matmul_backward(y, NULL, NULL, xa, NULL, &wbt, T, OC, R);
}

void lora_backward(const kernels_t *k, float *dx, const float *dy, const float *x, const float *xa,
                   const lora_pair_t *p, int T, int C, int OC, float *tmp) {
    MO_ASSERT(k && dy && x && xa && p && p->A && p->B && p->R > 0 && tmp);
    if (T <= 0)
        return;
    int R = p->R;
    size_t TR = (size_t)T * R;
    wview_t wa = wview_f32(p->A);
    wview_t wb = wview_f32(p->B);
    /* dB (OC, R) += dy^T (OC, T) @ (scale xa) (T, R) */
    if (p->dB) {
        memcpy(tmp, xa, TR * sizeof *tmp);
        scale_inplace(tmp, TR, p->scale);
        k->matmul_backward(NULL, p->dB, NULL, dy, tmp, &wb, T, R, OC);
    }
    if (!dx && !p->dA)
        return;
    /* tmp (T, R) = scale * dy (T, OC) @ B (OC, R) */
    memset(tmp, 0, TR * sizeof *tmp);
    k->matmul_backward(tmp, NULL, NULL, dy, NULL, &wb, T, R, OC);
    scale_inplace(tmp, TR, p->scale);
    /* dx (T, C) += tmp @ A (R, C); dA (R, C) += tmp^T @ x (T, C) */
    k->matmul_backward(dx, p->dA, NULL, tmp, x, &wa, T, C, R);
}

/* w += sign * scale * B A, through an f32 staging buffer for low precision. */
static int merge_signed(const kernels_t *k, void *w, dtype_t dt, const lora_pair_t *p, int C,
                        int OC, float sign) {
    MO_ASSERT(k && w && p && p->A && p->B && p->R > 0 && C > 0 && OC > 0);
    if (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16)
        return mo_errorf(MO_EUNSUPPORTED,
                         "lora merge: weight dtype %s is not supported (F32, BF16 or F16)",
                         dtype_name(dt));
    int R = p->R;
    float *sb = malloc((size_t)OC * R * sizeof *sb); /* (OC, R) = sign * scale * B */
    if (!sb)
        return mo_errorf(MO_ENOMEM, "lora merge: cannot allocate %d x %d floats", OC, R);
    for (size_t i = 0; i < (size_t)OC * R; i++)
        sb[i] = sign * p->scale * p->B[i];
    wview_t wa = wview_f32(p->A);
    if (dt == DT_F32) {
        /* w (OC, C) += sb (OC, R) @ A (R, C) */
        k->matmul_backward(w, NULL, NULL, sb, NULL, &wa, OC, C, R);
        free(sb);
        return MO_OK;
    }
    int rows = (1 << 20) / C; /* about 4 MiB of staging */
    if (rows < 1)
        rows = 1;
    if (rows > OC)
        rows = OC;
    float *stage = malloc((size_t)rows * C * sizeof *stage); /* (rows, C) */
    if (!stage) {
        free(sb);
        return mo_errorf(MO_ENOMEM, "lora merge: cannot allocate %d x %d floats", rows, C);
    }
    size_t esz = dtype_size(dt);
    for (int r0 = 0; r0 < OC; r0 += rows) {
        int nr = OC - r0 < rows ? OC - r0 : rows;
        char *wr = (char *)w + (size_t)r0 * C * esz;
        convert_to_f32(stage, wr, dt, (size_t)nr * C);
        k->matmul_backward(stage, NULL, NULL, sb + (size_t)r0 * R, NULL, &wa, nr, C, R);
        convert_from_f32(wr, dt, stage, (size_t)nr * C);
    }
    free(stage);
    free(sb);
    return MO_OK;
}

int lora_merge(const kernels_t *k, void *w, dtype_t dt, const lora_pair_t *p, int C, int OC) {
    return merge_signed(k, w, dt, p, C, OC, 1.0f);
}

int lora_unmerge(const kernels_t *k, void *w, dtype_t dt, const lora_pair_t *p, int C, int OC) {
    return merge_signed(k, w, dt, p, C, OC, -1.0f);
}
