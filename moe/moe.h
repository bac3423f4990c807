/* moe: the mixture-of-experts layer as route -> dispatch -> expert compute -> combine
 * (dropless), with shared experts, routing replay, load statistics, and its backward. */
#ifndef MOERL_MOE_MOE_H
#define MOERL_MOE_MOE_H

#include <stdint.h>

#include "core/arena.h"
#include "core/dtype.h"
#include "core/kernels.h"
#include "lora/lora.h"
#include "moe/mlp.h"
#include "moe/router.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens, D model width, F expert hidden width, E routed experts, K experts per
 * token; S = T * K token slots, slot t * K + k being token t's k-th expert.
 *
 * Forward:  logits (T, E) = x @ router^T;  route (or replay);  dispatch gathers the S
 * slots' rows sorted by expert;  each expert's MLP runs on its contiguous block;
 * combine: out[t] = sum_k weight[t, k] * y[row of slot (t, k)];  out += shared(x).
 * Backward mirrors it and also sends the router's gradient into dx through the router
 * matrix (and into the router weight's gradient when moe_weights_t.drouter is set).
 * Everything lives in host memory; matrix work goes through the kernel table. */
typedef struct moe_cfg {
    int D;               /* model width */
    int F;               /* hidden width of one routed expert */
    int n_shared;        /* shared experts, run as one MLP of width n_shared * F; 0 = none */
    router_cfg_t router; /* router.E and router.K are the layer's E and K */
    float aux_coef;      /* load-balancing loss coefficient (router_aux_loss); 0 = off */
} moe_cfg_t;

/* Frozen weights and adapters of one layer. Expert e's projections are gate[e] (F, D),
 * up[e] (F, D), down[e] (D, F), as Hugging Face stores
 * model.layers.N.mlp.experts.e.{gate,up,down}_proj.weight. */
typedef struct moe_weights {
    wview_t router;                      /* (E, D) gate weight, frozen */
    const wview_t *gate;                 /* (E) each (F, D) */
    const wview_t *up;                   /* (E) each (F, D) */
    const wview_t *down;                 /* (E) each (D, F) */
    const lora_pair_t *const *lora_gate; /* (E) or NULL; an entry is NULL when not adapted */
    const lora_pair_t *const *lora_up;   /* (E) or NULL */
    const lora_pair_t *const *lora_down; /* (E) or NULL */
    mlp_weights_t shared;                /* width n_shared * F; read when n_shared > 0 */
    float *drouter; /* (E, D) router weight gradient, ACCUMULATED by the backward (the router
                     * must then be f32), or NULL: the router is frozen. Under expert
                     * parallelism each rank adds its own tokens' share. */
} moe_weights_t;

/* The dispatch plan: token slots sorted by expert with a stable counting sort (slots of
 * one expert keep token order), so expert e's rows are rows offsets[e] .. offsets[e+1]-1
 * of the gathered buffer. Dispatch and combine are the only functions that read it. */
typedef struct moe_dispatch {
    int T, K, E;
    int32_t *offsets;     /* (E + 1) offsets[E] = S */
    int32_t *slot_of_row; /* (S) the slot that gathered row r holds */
    int32_t *row_of_slot; /* (S) the gathered row of slot s */
} moe_dispatch_t;

/* Everything the forward keeps for the backward, in the step's arena. */
typedef struct moe_state {
    int T;
    const float *x; /* (T, D) the layer input; the caller keeps it until backward */
    float *logits;  /* (T, E) router logits */
    float *probs;   /* (T, E) router scores (softmax or sigmoid) */
    int32_t *idx;   /* (T, K) experts of each token */
    float *weight;  /* (T, K) combine weights */
    moe_dispatch_t plan;
    float *xg;        /* (S, D) input rows gathered by expert */
    float *yg;        /* (S, D) expert outputs, same order */
    mlp_acts_t *acts; /* (E) per-expert saved activations (empty for idle experts) */
    mlp_acts_t shared_acts;
    int64_t *load;   /* (E) token slots routed to each expert */
    float imbalance; /* max / mean of load */
    float aux_loss;  /* the balance loss value (0 when aux_coef is 0) */
} moe_state_t;

/* MO_ECONFIG when the configuration is inconsistent. */
int moe_cfg_check(const moe_cfg_t *c);

/* The MLP weights of routed expert e. */
mlp_weights_t moe_expert_weights(const moe_weights_t *w, int e);

/* Builds the plan for idx (T, K) in the arena. MO_EINVAL for an index outside [0, E),
 * MO_ENOMEM when the arena cannot grow. */
int moe_dispatch_plan(moe_dispatch_t *p, arena_t *ar, const int32_t *idx, int T, int K, int E);
/* xg (S, D): row r = x[token of slot_of_row[r]]. */
void moe_dispatch_forward(float *xg, const float *x, const moe_dispatch_t *p, int D);
/* dx (T, D) += the rows of dxg (S, D) added back to their tokens (slot order). */
void moe_dispatch_backward(float *dx, const float *dxg, const moe_dispatch_t *p, int D);
/* out (T, D) = sum_k weight[t, k] * yg[row_of_slot[t K + k]]. */
void moe_combine_forward(float *out, const float *yg, const float *weight, const moe_dispatch_t *p,
                         int D);
/* dyg (S, D) += weight * dout[token]; dweight (T, K) += dot(dout[t], yg[row]). Either
 * output may be NULL. */
void moe_combine_backward(float *dyg, float *dweight, const float *dout, const float *yg,
                          const float *weight, const moe_dispatch_t *p, int D);

/* Expert compute on a buffer of rows grouped by expert: experts e0 .. e0 + n - 1 of the
 * table w own rows offsets[i] .. offsets[i+1]-1 (offsets (n + 1), relative to the
 * buffer) of xe (rows, D); ye (rows, D) receives their outputs, acts (n) the saved
 * activations (allocated in the arena; left empty for an expert without rows). */
int moe_experts_forward(const kernels_t *k, arena_t *ar, float *ye, mlp_acts_t *acts,
                        const float *xe, const int32_t *offsets, int n, int e0,
                        const moe_weights_t *w, int D, int F);
/* dxe (rows, D) += the experts' input gradients from dye (rows, D); adapters' gradients
 * accumulate. Scratch from the arena. */
int moe_experts_backward(const kernels_t *k, arena_t *ar, float *dxe, const float *dye,
                         const float *xe, const mlp_acts_t *acts, const int32_t *offsets, int n,
                         int e0, const moe_weights_t *w, int D, int F);

/* out (T, D) = the layer applied to x (T, D). replay: NULL for natural routing, or the
 * experts (T, K) recorded by a rollout in replay_dt (DT_U16 or DT_I32; a bad index is
 * MO_EMALFORMED). st receives the saved state and the load statistics; its buffers come
 * from ar, which the caller resets once per step after the backward. */
int moe_forward(const kernels_t *k, arena_t *ar, moe_state_t *st, float *out, const float *x,
                const moe_cfg_t *c, const moe_weights_t *w, int T, const void *replay,
                dtype_t replay_dt);

/* dx (T, D) += the input gradient from dout (T, D), through experts, shared experts,
 * the combine weights, the router (and the balance loss, taken as added to the
 * objective with gradient 1) and the router matrix; every present adapter's dA
 * and dB (when not NULL) accumulate, and w->drouter when not NULL. dx must not alias
 * dout. The temporaries (about 2 S D + T E floats) come from ar: the step arena, or a
 * scratch arena the caller resets after each layer's backward. st stays valid (it lives
 * in the forward's arena). */
int moe_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout,
                 const moe_state_t *st, const moe_cfg_t *c, const moe_weights_t *w);

#ifdef __cplusplus
}
#endif
#endif
