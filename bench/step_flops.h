/* step_flops: the FLOPs of one LoRA training step of the policy model (multiply-add = 2),
 * counted on the model, not on what the code does:
 *   forward  = 2 T P_mm                      P_mm: matrix parameters one token uses
 *                                            (q, k, v, o, router, K experts or the dense
 *                                            MLP, lm_head; not the embedding lookup)
 *            + 4 H Dh sum_t ctx_t per layer   attention scores and values, ctx_t the keys
 *                                            token t sees (causal, window-limited)
 *            + 2 R (C + OC) n_m per adapted   LoRA A then B; n_m = T for attention
 *              module m                       modules, T K / E for each routed expert
 *   backward = 2 T P_mm                      input gradients through the frozen matrices
 *            + 2 x the attention term        dQ, dK, dV, dP
 *            + 2 x the LoRA term             dA, dB and the input gradient
 * Recomputation (the logits in the backward) is not counted. */
#ifndef MOERL_BENCH_STEP_FLOPS_H
#define MOERL_BENCH_STEP_FLOPS_H

#include <stdint.h>

#include "actor/model.h"

/* fwd and bwd of a step over T tokens at positions pos (T); ad may be NULL (no LoRA). */
void step_flops(const model_t *m, const lora_adapter_t *ad, const int32_t *pos, int T,
                double *fwd, double *bwd);

#endif
