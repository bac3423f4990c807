/* moe_cuda: the mixture-of-experts layer's device building blocks: the dispatch plan,
 * gather/combine, grouped expert products, the expert SwiGLU MLP and per-expert LoRA,
 * each matching its CPU counterpart in moe/moe.c, moe/mlp.c and lora/lora.c. */
#ifndef MOERL_CORE_CUDA_MOE_CUDA_H
#define MOERL_CORE_CUDA_MOE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens, D model width, F expert hidden width, E routed experts, K experts per
 * token, R LoRA rank; S = T * K token slots, slot t * K + k being token t's k-th expert.
 * "rows" is the number of rows of a buffer grouped by expert.
 *
 * Every pointer below is DEVICE memory unless said otherwise; tables of per-expert
 * matrices are device arrays of device pointers, built once by the caller. All work is
 * queued on the calling thread's stream of the CUDA backend (backend set_stream); nothing
 * here waits for the device or copies to the host, except moe_cuda_plan_check.
 *
 * Status: every function returns 0 or a negative MO_* code with a message. MO_EINVAL for
 * bad arguments (checked on the host); MO_EDEVICE when a CUDA call fails, the message
 * naming the call, the CUDA error and file:line (the failure is also recorded as the
 * backend's pending error, which its synchronize() returns). Errors in the data itself
 * (an expert index outside [0, E)) are found by the kernels: see moe_cuda_plan_build.
 *
 * Grouped rows: a buffer of rows sorted by expert, expert i of a table owning rows
 * offsets[i] .. offsets[i+1]-1, offsets (n + 1) on the device, nondecreasing from 0 to
 * rows. The host never reads the offsets: the kernels map their blocks onto experts on
 * the device. Offsets outside [0, rows] are clamped (memory stays safe; results are then
 * meaningless). */

/* ---- dispatch plan ---- */

/* The plan of moe_dispatch_t (moe/moe.h) on the device: the slots sorted by expert with a
 * stable counting sort (slots of one expert keep token order), identical to
 * moe_dispatch_plan's. */
typedef struct moe_cuda_plan {
    int T, K, E;
    int32_t *offsets;     /* (E + 1) offsets[E] = S */
    int32_t *slot_of_row; /* (S) the slot that gathered row r holds */
    int32_t *row_of_slot; /* (S) the gathered row of slot s */
    uint64_t *bad;        /* (1) first bad slot << 32 | its index, UINT64_MAX when none */
    void *mem;            /* the pool block behind the arrays */
} moe_cuda_plan_t;

/* The largest E the plan supports (its histograms live in shared memory). */
#define MOE_CUDA_MAX_EXPERTS 8192

/* Allocates the plan's arrays for T tokens, K of E experts from the backend's pool.
 * MO_EINVAL for T < 0, K < 1, E < 1, E > MOE_CUDA_MAX_EXPERTS, K > E or S > INT32_MAX;
 * MO_ENOMEM / MO_EDEVICE when the pool cannot serve it. */
int moe_cuda_plan_alloc(moe_cuda_plan_t *p, int T, int K, int E);
/* Gives the arrays back to the pool (work on another stream that still reads them must be
 * synchronised first) and zeroes *p. Safe on a zeroed or already freed plan. */
void moe_cuda_plan_free(moe_cuda_plan_t *p);

/* Queues the plan for idx (T, K) int32 (device): three kernels, no host sync. An index
 * outside [0, E) sets the backend's device error flag (CUDA_FLAG_MOE_EXPERT), so the
 * caller's next synchronize() returns MO_EINVAL, and records the first bad slot in
 * p->bad; the plan is then still a permutation (a bad index placed as if clamped into
 * [0, E)), so later kernels stay in bounds, but its contents are meaningless. */
int moe_cuda_plan_build(moe_cuda_plan_t *p, const int32_t *idx);
/* Waits for the calling thread's stream and reads p->bad: MO_EINVAL naming the first bad
 * slot and its index (the message of moe_dispatch_plan), else 0. Optional: the flag
 * already makes synchronize() fail; this gives the precise message. */
int moe_cuda_plan_check(const moe_cuda_plan_t *p);

/* xg (S, D): row r = x (T, D) [token of slot_of_row[r]]. An exact copy. */
int moe_cuda_dispatch_forward(float *xg, const float *x, const moe_cuda_plan_t *p, int D);
/* dx (T, D) += the rows of dxg (S, D) added back to their tokens, k = 0 .. K-1 in order
 * (the CPU's order: bit-identical). */
int moe_cuda_dispatch_backward(float *dx, const float *dxg, const moe_cuda_plan_t *p, int D);
/* out (T, D) = sum_k weight (T, K) [t, k] * yg (S, D) [row_of_slot[t K + k]], k in order. */
int moe_cuda_combine_forward(float *out, const float *yg, const float *weight,
                             const moe_cuda_plan_t *p, int D);
/* dyg (S, D) += weight * dout (T, D) [token]; dweight (T, K) += dot(dout[t], yg[row]) (the
 * dot in double, as on the CPU). Either output may be NULL. */
int moe_cuda_combine_backward(float *dyg, float *dweight, const float *dout, const float *yg,
                              const float *weight, const moe_cuda_plan_t *p, int D);

/* ---- grouped products ----
 * Expert e's weight W_e = w[e] (OC, C), row-major, of dtype wdt: DT_F32 (f32 products, no
 * TF32: within ~1e-6 of the CPU) or DT_BF16 (the activation or gradient operand rounded
 * to bf16 as in core/cuda/matmul.cu, bf16 products summed in f32 on tensor cores). A NULL
 * entry w[e] means expert e has no such matrix: its output rows are written as zeros when
 * overwriting and left alone when accumulating. Sums run in f32 in a fixed order
 * (deterministic run to run). Weight tables may be offset (tab + e0) to serve experts
 * e0 .. e0 + n - 1, as under expert parallelism. */

/* out (rows, OC) = alpha * x (rows, C) @ W_e^T for each expert's rows, plus the old out
 * when accumulate is nonzero. */
int moe_cuda_gmm_forward(float *out, const float *x, const void *const *w, dtype_t wdt,
                         const int32_t *offsets, int n, int rows, int C, int OC, float alpha,
                         int accumulate);
/* dx (rows, C) = alpha * dout (rows, OC) @ W_e, plus the old dx when accumulate. */
int moe_cuda_gmm_backward_x(float *dx, const float *dout, const void *const *w, dtype_t wdt,
                            const int32_t *offsets, int n, int rows, int C, int OC, float alpha,
                            int accumulate);
/* dw[e] (OC, C) += alpha * dout_e^T (OC, rows_e) @ x_e (rows_e, C) for each expert with
 * rows and a non-NULL dw[e] (f32). In f32 throughout. */
int moe_cuda_gmm_backward_w(float *const *dw, const float *dout, const float *x,
                            const int32_t *offsets, int n, int rows, int C, int OC, float alpha);

/* ---- per-expert LoRA on grouped rows ---- */

/* The adapters of one projection W (OC, C) for n experts; A == NULL: none at all. Entry
 * e of A and B is NULL for an expert without an adapter; all present adapters share R
 * and scale. */
typedef struct moe_cuda_lora {
    const float *const *A; /* (n) each (R, C), or NULL */
    const float *const *B; /* (n) each (OC, R) */
    float *const *dA;      /* (n) each (R, C) accumulated, or NULL (table or entry) */
    float *const *dB;      /* (n) each (OC, R) accumulated, or NULL (table or entry) */
    int R;
    float scale; /* alpha / R, or alpha / sqrt(R) with rsLoRA */
} moe_cuda_lora_t;

/* y (rows, OC) += scale * (x A_e^T) B_e^T; xa (rows, R) receives x A_e^T (zeros for rows
 * of experts without an adapter), kept for the backward. */
int moe_cuda_lora_forward(float *y, float *xa, const float *x, const moe_cuda_lora_t *l,
                          const int32_t *offsets, int n, int rows, int C, int OC);
/* From dy (rows, OC): dB_e += scale dy_e^T xa_e; tmp (rows, R) = scale dy B_e;
 * dx (rows, C) += tmp A_e (skipped when dx is NULL); dA_e += tmp_e^T x_e. */
int moe_cuda_lora_backward(float *dx, const float *dy, const float *x, const float *xa,
                           const moe_cuda_lora_t *l, const int32_t *offsets, int n, int rows, int C,
                           int OC, float *tmp);

/* ---- the expert SwiGLU MLP on grouped rows ---- */

/* n experts' weights: gate and up (F, D), down (D, F), one dtype (DT_F32 or DT_BF16). */
typedef struct moe_cuda_experts {
    dtype_t dtype;
    const void *const *gate;                       /* (n) each (F, D) */
    const void *const *up;                         /* (n) each (F, D) */
    const void *const *down;                       /* (n) each (D, F) */
    moe_cuda_lora_t lora_gate, lora_up, lora_down; /* lora_*.A == NULL: not adapted */
} moe_cuda_experts_t;

/* What the forward keeps, row for row like the CPU's per-expert mlp_acts_t stacked. */
typedef struct moe_cuda_acts {
    float *g;       /* (rows, F) gate projection (with its adapter) */
    float *u;       /* (rows, F) up projection (with its adapter) */
    float *h;       /* (rows, F) silu(g) * u, the input of down */
    float *xa_gate; /* (rows, R_gate), or NULL without gate adapters */
    float *xa_up;   /* (rows, R_up), or NULL */
    float *xa_down; /* (rows, R_down), or NULL */
} moe_cuda_acts_t;

/* ye (rows, D) = each expert's MLP on its rows of xe (rows, D); a receives the
 * activations. moe_experts_forward's function. */
int moe_cuda_experts_forward(float *ye, const moe_cuda_acts_t *a, const float *xe,
                             const int32_t *offsets, int n, int rows, const moe_cuda_experts_t *w,
                             int D, int F);
/* Floats of device scratch moe_cuda_experts_backward needs. */
size_t moe_cuda_experts_backward_scratch_floats(const moe_cuda_experts_t *w, int rows, int F);
/* dxe (rows, D) += the input gradients from dye (rows, D); adapter gradients accumulate.
 * xe and a as the forward saw and left them. moe_experts_backward's function. */
int moe_cuda_experts_backward(float *dxe, const float *dye, const float *xe,
                              const moe_cuda_acts_t *a, const int32_t *offsets, int n, int rows,
                              const moe_cuda_experts_t *w, int D, int F, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
