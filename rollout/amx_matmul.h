/* amx_matmul: the rollout engine's products of f32 activations with bf16 weights on
 * the CPU's AMX tiles, the activations split exactly into three bf16 parts. */
#ifndef MOERL_ROLLOUT_AMX_MATMUL_H
#define MOERL_ROLLOUT_AMX_MATMUL_H

#include <stddef.h>
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
 * amx_matmul_bf16 reads the weights where they are; amx_matmul_packed and
 * amx_matmul_glu read a packed copy made ahead (amx_pack_bf16). The activations are
 * split per call (vectorised, AVX-512), up to 256 rows at a time so that their parts
 * stay in L2 while the weights pass over them. */

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

/* Pre-packed weights. amx_pack_bf16 copies w (OC, C) bf16 into the layout the tiles read
 * as their B operand, in blocks of 16 outputs: wp (ceil(OC / 16), C / 32, 16, 16, 2),
 * output 16 b + n, column 32 kb + 2 k2 + q at [b][kb][k2][n][q]; outputs from OC up to
 * the next multiple of 16 are zero. Weights with the same C packed one after the other
 * (each at the sum of amx_packed_elems of those before) run as one product. The copy
 * costs one more set of the weights' bytes; the product then loads every tile with one
 * contiguous read, takes the activations as the A operand (row-major parts, no
 * transpose) and stores its accumulators straight into the outputs. */
size_t amx_packed_elems(int OC, int C);
/* C % 32 == 0; dst holds amx_packed_elems(OC, C) bf16. Any CPU (no tiles used). */
void amx_pack_bf16(uint16_t *dst, const uint16_t *w, int OC, int C);

/* One output of a packed product. */
typedef struct amx_out {
    float *out;        /* (T, OC) */
    const float *bias; /* (OC) or NULL */
    int OC;
} amx_out_t;

/* outs[i].out (T, OC_i) = inp (T, C) w_i^T (+ bias_i) for the n weights packed back to back
 * in wp: one split of the activations for all of them. The same sums in the same order
 * as amx_matmul_bf16 (the same bits: blocks of 32 along C, the three parts in turn),
 * independent of T, of the other rows and of the thread count. Requires
 * amx_matmul_available(); temporaries in scratch slots 0 and 1. */
void amx_matmul_packed(const amx_out_t *outs, int n, const float *inp, const uint16_t *wp, int T,
                       int C);

/* gate and up (F, C) bf16 packed for amx_matmul_glu: blocks of 16 outputs in turn, gate's
 * block j then up's block j, each as amx_pack_bf16 packs it; 2 amx_packed_elems(F, C)
 * elements. */
void amx_pack_bf16_glu(uint16_t *dst, const uint16_t *gate, const uint16_t *up, int F, int C);

/* The gate and up products of an MLP on inp (T, C), wp from amx_pack_bf16_glu: with h
 * (T, F) not NULL, h = silu(g) * u = g / (1 + e^-g) * u straight from the accumulators
 * (g and u the products' bits as amx_matmul_packed gives them; e^x in 16 lanes within 2
 * ulp of expf; the g and u arguments are not used); with h NULL, g (T, F) = inp gate^T
 * and u (T, F) = inp up^T.
 * Requires amx_matmul_available(); temporaries in scratch slots 0 and 1. */
void amx_matmul_glu(float *h, float *g, float *u, const float *inp, const uint16_t *wp, int T,
                    int C, int F);

/* One group of a grouped product: rows r0 .. r0 + T - 1 of the input and of the outputs,
 * through the packed weights w. */
typedef struct amx_group {
    const uint16_t *w;
    int r0, T;
} amx_group_t;

/* Grouped products, as a mixture of experts runs its experts on their dispatched rows:
 * for each of the ng groups, its rows of out (rows, OC) = its rows of inp (rows, C) times
 * its weights (amx_pack_bf16, OC outputs), each row's bits those amx_matmul_packed gives
 * it. One parallel region for all the groups: the threads split every group's activations,
 * then share the (group, pair of output blocks) products, about equal work each, instead
 * of a region (and a split on one thread) per group. Groups may be empty; their rows must
 * not overlap. Requires amx_matmul_available(); temporaries in scratch slots 0 to 2. */
void amx_matmul_packed_groups(float *out, const float *inp, const amx_group_t *g, int ng, int C,
                              int OC);

/* The same for gate and up (amx_pack_bf16_glu weights, F outputs each): h (rows, F) =
 * silu(g) * u when h is not NULL, else gt and u (rows, F), each row's bits those
 * amx_matmul_glu gives it. */
void amx_matmul_glu_groups(float *h, float *gt, float *u, const float *inp, const amx_group_t *g,
                           int ng, int C, int F);

/* h = silu(g) * u over n elements, each as amx_matmul_glu's SwiGLU from the accumulators
 * computes it (e^x in 16 lanes within 2 ulp of expf): for gate and up that come out
 * separately (an adapter added to them). Requires amx_matmul_available(). */
void amx_swiglu(float *h, const float *g, const float *u, size_t n);

/* Tests: 1 turns the tiles off for this process (amx_matmul_available() then answers 0,
 * as on a CPU without AMX), 0 turns them back on where the CPU has them. Not for use
 * while products run. */
void amx_matmul_force_off(int off);

#ifdef __cplusplus
}
#endif
#endif
