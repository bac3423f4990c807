/* lora: low-rank adapters on frozen projections: y = W x + scale * B (A x). */
#ifndef MOERL_LORA_LORA_H
#define MOERL_LORA_LORA_H

#include "core/dtype.h"
#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One adapted projection W (OC, C). A, B and their gradients live in the
 * adapter's flat buffers; this struct only points into them. */
typedef struct lora_pair {
    float *A;  /* (R, C) */
    float *B;  /* (OC, R) */
    float *dA; /* (R, C), or NULL when not training */
    float *dB; /* (OC, R), or NULL when not training */
    int R;
    float scale; /* alpha / R, or alpha / sqrt(R) with rsLoRA */
} lora_pair_t;

/* Every pointer of this file is host memory: the products go through the
 * kernel table k, the O(T R) and O(OC R) elementwise steps run here. */

/* bt (R, OC) = scale * B^T, the right operand of the adapter's second product. */
void lora_scaled_bt(float *bt, const lora_pair_t *p, int OC);

/* y (T, OC) += scale * (x (T, C) A^T) B^T. xa (T, R) receives x A^T, kept
 * for backward. Uses the last CPU scratch slot (R * OC floats) of the
 * calling thread for scale * B^T. */
void lora_forward(const kernels_t *k, float *y, float *xa, const float *x, const lora_pair_t *p,
                  int T, int C, int OC);

/* Accumulates dx (T, C) (if not NULL), p->dA and p->dB (if not NULL) from
 * dy (T, OC), given the forward's x and xa. tmp is scratch of (T, R) floats. */
void lora_backward(const kernels_t *k, float *dx, const float *dy, const float *x, const float *xa,
                   const lora_pair_t *p, int T, int C, int OC, float *tmp);

/* Merged apply: w (OC, C) += scale * B A, in place in a writable copy of the
 * base weight of dtype dt (F32, BF16 or F16). The update is formed in f32 and
 * added to w in f32, then rounded once to dt: an f32 w is within a few f32
 * ulps of the exact sum, a bf16 w within half a bf16 ulp (2^-8 relative) of
 * the f32 sum. MO_EUNSUPPORTED for other dtypes, MO_ENOMEM when the f32
 * staging buffer cannot be allocated. */
int lora_merge(const kernels_t *k, void *w, dtype_t dt, const lora_pair_t *p, int C, int OC);
/* The reverse: w -= scale * B A. After merge + unmerge an f32 w is back to
 * within a few f32 ulps of max(|w|, |scale B A|); a bf16 w to within one bf16
 * ulp of that (two roundings). */
int lora_unmerge(const kernels_t *k, void *w, dtype_t dt, const lora_pair_t *p, int C, int OC);

#ifdef __cplusplus
}
#endif
#endif
