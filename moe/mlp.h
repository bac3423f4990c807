/* mlp: the SwiGLU block y = down(silu(gate(x)) * up(x)) on frozen weights with optional
 * LoRA on each projection (dense layers, shared experts, routed experts). */
#ifndef MOERL_MOE_MLP_H
#define MOERL_MOE_MLP_H

#include <stddef.h>

#include "core/arena.h"
#include "core/kernels.h"
#include "lora/lora.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens (rows), D model width, F hidden width, R LoRA rank. */
typedef struct mlp_weights {
    wview_t gate;                 /* (F, D) gate_proj, frozen */
    wview_t up;                   /* (F, D) up_proj, frozen */
    wview_t down;                 /* (D, F) down_proj, frozen */
    const lora_pair_t *lora_gate; /* adapter of gate (OC = F, C = D), or NULL */
    const lora_pair_t *lora_up;   /* adapter of up (OC = F, C = D), or NULL */
    const lora_pair_t *lora_down; /* adapter of down (OC = D, C = F), or NULL */
} mlp_weights_t;

/* What the forward keeps for the backward. A buffer for an absent adapter may be NULL. */
typedef struct mlp_acts {
    float *g;       /* (T, F) gate projection (with its adapter) */
    float *u;       /* (T, F) up projection (with its adapter) */
    float *h;       /* (T, F) silu(g) * u, the input of down */
    float *xa_gate; /* (T, R_gate) x A_gate^T */
    float *xa_up;   /* (T, R_up) x A_up^T */
    float *xa_down; /* (T, R_down) h A_down^T */
} mlp_acts_t;

/* Fills a with buffers for T rows from the arena (xa_* only for present adapters).
 * MO_ENOMEM on failure. */
int mlp_acts_alloc(mlp_acts_t *a, arena_t *ar, const mlp_weights_t *w, int T, int F);

/* y (T, D) = the block applied to x (T, D); a receives the saved activations. T may be
 * 0 (nothing is done). */
void mlp_forward(const kernels_t *k, float *y, mlp_acts_t *a, const float *x,
                 const mlp_weights_t *w, int T, int D, int F);

/* Floats of scratch that mlp_backward needs for T rows. */
size_t mlp_backward_scratch_floats(const mlp_weights_t *w, int T, int F);

/* From dy (T, D): dx (T, D) += the input gradient (skipped when NULL), and each
 * present adapter's dA and dB (when not NULL) accumulate. x and a as the forward saw
 * and left them; scratch holds mlp_backward_scratch_floats(w, T, F) floats. Host
 * memory (the scratch is zeroed with memset). */
void mlp_backward(const kernels_t *k, float *dx, const float *dy, const float *x,
                  const mlp_acts_t *a, const mlp_weights_t *w, int T, int D, int F, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
