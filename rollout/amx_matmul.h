/* amx_matmul: the rollout engine's products of f32 activations with bf16 weights on
 * the CPU's AMX tiles, the activations split exactly into three bf16 parts. */
#ifndef MOERL_ROLLOUT_AMX_MATMUL_H
#define MOERL_ROLLOUT_AMX_MATMUL_H

#include <stdint.h>

#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out (T, OC) = inp (T, C) w^T (+ bias), w (OC, C) bf16.
 *
 * Each activation x is written as h + m + l, three bf16 numbers (the top 8, next 8 and
 * last 8 significant bits of x: the sum is exact), so x w = h w + m w + l w where every
 * product of two bf16 numbers is exact in f32; the tiles accumulate in f32. The result
 * is an f32 product with its own summation order (blocks of 32 along C), the same for a
 * row whatever the other rows are: it depends neither on T nor on the thread count.
 * Three bf16 tile products cost about a fifth of one f32 product on the vector units.
 * The weights are read where they are (no converted or packed copy); the activations
 * are split per call (vectorised, AVX-512), up to 256 rows at a time so that their
 * parts stay in L2 while the weights pass over them. */

/* The rows of T below which the products stay on the vector units (a matrix-vector
 * product reads the weights once either way). */
#define AMX_MIN_ROWS 4

/* 1 when this CPU has AMX-BF16 and the kernel lets the process use the tiles (asked
 * once, on the first call; thread-safe). */
int amx_matmul_available(void);

/* 1 when amx_matmul_bf16 takes this product: available, w bf16 without block scales,
 * C a multiple of 32, T >= AMX_MIN_ROWS. */
int amx_matmul_fits(const wview_t *w, int T, int C);

/* The product above; requires amx_matmul_available() and C % 32 == 0. bias (OC) or
 * NULL. Temporaries in scratch slots 0 to 2. */
void amx_matmul_bf16(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                     int C, int OC);

/* Same signature as kernels_t.matmul_forward: amx_matmul_bf16 where it fits, the CPU
 * kernel (cpu_matmul_forward) otherwise. */
void amx_matmul_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                        int C, int OC);

#ifdef __cplusplus
}
#endif
#endif
