/* router: MoE expert selection and combine weights from router logits (softmax top-k,
 * sigmoid with selection bias and group limit, routing replay), their backward, the
 * load-balancing loss and load statistics. */
#ifndef MOERL_MOE_ROUTER_H
#define MOERL_MOE_ROUTER_H

#include <stdint.h>

#include "core/dtype.h"
#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens, E routed experts, K experts per token, G expert groups.
 *
 * Every kind computes per-token scores s (E) from the logits, picks K experts, and
 * gives the picked experts the weights
 *     w_k = scale * s[idx_k] / (sum_j s[idx_j] + eps)   when norm_topk_prob,
 *     w_k = scale * s[idx_k]                             otherwise,
 * with scale = routed_scaling_factor and eps = 0 for ROUTER_SOFTMAX_TOPK, 1e-20 for
 * the grouped kinds (as Hugging Face writes each).
 *
 * Selection breaks ties toward the lower index everywhere (expert and group top-k);
 * a NaN score counts as -infinity for selection. idx rows come out in descending order
 * of the score used for choosing. All buffers are host memory. */
typedef enum router_kind {
    /* s = softmax(logits); top-K of s. Qwen3-MoE / Qwen2-MoE (norm_topk_prob from the
     * config) and Mixtral (norm_topk_prob = 1: softmax over the selected logits equals
     * softmax over all E renormalised over the selected). */
    ROUTER_SOFTMAX_TOPK = 0,
    /* s = sigmoid(logits); choosing uses s + e_score_correction_bias; with n_group > 1
     * the group score is the sum of the two largest biased scores of the group, the
     * topk_group best groups are kept and the others' experts masked before the top-K.
     * DeepSeek-V3 / Kimi K2 (topk_method "noaux_tc"). */
    ROUTER_SIGMOID_GROUPED,
    /* s = softmax(logits); with n_group > 1 the group score is the largest s of the
     * group (DeepSeek-V2 "group_limited_greedy"). DeepSeek-V2 scales by
     * routed_scaling_factor only when it does not normalise: a loader sets scale = 1
     * when norm_topk_prob is on. */
    ROUTER_SOFTMAX_GROUPED,
} router_kind_t;

typedef struct router_cfg {
    router_kind_t kind;
    int E;                                /* routed experts */
    int K;                                /* experts per token, 1..E */
    int norm_topk_prob;                   /* 1: the K weights are renormalised (see above) */
    float routed_scaling_factor;          /* multiplies every weight (1 for Qwen3 and Mixtral) */
    int n_group;                          /* expert groups; <= 1 means no group limit */
    int topk_group;                       /* groups kept per token when n_group > 1 */
    const float *e_score_correction_bias; /* (E) added for choosing only; NULL = zeros
                                           * (ROUTER_SIGMOID_GROUPED only) */
    /* Value given to the experts of dropped groups before the final top-K: 0 fills
     * 0.0 as Hugging Face's DeepseekV3TopkRouter and vLLM do (a dropped expert can
     * then beat a kept one whose biased score is negative); 1 fills -infinity as
     * DeepSeek's own inference code does. */
    int group_mask_neg_inf;
} router_cfg_t;

/* Defaults for a kind: no renormalisation, scale 1, no groups, no bias. */
void router_cfg_init(router_cfg_t *c, router_kind_t kind, int E, int K);
/* MO_ECONFIG with the offending field when the configuration is inconsistent. */
int router_cfg_check(const router_cfg_t *c);

/* Natural routing. probs (T, E) receives the scores s (softmax probabilities or
 * sigmoid scores), kept for backward; idx (T, K) the chosen experts, weight (T, K)
 * their combine weights. logits (T, E) = x @ gate^T computed by the caller in f32.
 * Uses k->softmax_forward for the softmax kinds. MO_ENOMEM or MO_ECONFIG on failure. */
int router_forward(const kernels_t *k, const router_cfg_t *c, int32_t *idx, float *weight,
                   float *probs, const float *logits, int T);

/* Routing replay: the experts are given (T, K) as recorded by a rollout, in DT_U16 or
 * DT_I32; idx (T, K) receives them as int32 and weight (T, K) the weights computed as
 * in router_forward for those experts. An index outside [0, E) or an expert listed
 * twice for one token is MO_EMALFORMED (nothing is read out of bounds). */
int router_replay(const kernels_t *k, const router_cfg_t *c, int32_t *idx, float *weight,
                  float *probs, const float *logits, const void *given, dtype_t given_dt, int T);

/* dlogits (T, E) += the gradient of the weights' loss given dweight (T, K), with the
 * selection idx held fixed; probs and idx as the forward (or replay) left them. */
void router_backward(const router_cfg_t *c, float *dlogits, const float *dweight,
                     const int32_t *idx, const float *probs, int T);

/* counts (E) = token slots routed to each expert; *imbalance = max / mean of counts
 * (mean = T K / E); 0 when T is 0. */
void router_load_stats(int64_t *counts, float *imbalance, const int32_t *idx, int T, int K, int E);

/* Load-balancing loss, Switch / Mixtral style:
 *     L = coef * E * sum_e f_e P_e,
 * f_e = counts[e] / (T K) the fraction of token slots routed to e (held constant),
 * P_e = mean over tokens of the router probability of e: the softmax probabilities
 * for the softmax kinds, the sigmoid scores normalised per token to sum 1 for
 * ROUTER_SIGMOID_GROUPED (DeepSeek-V3's balance-loss form). Hugging Face's Mixtral and
 * Qwen3-MoE loss uses counts[e] / T, i.e. K times this one: pass coef =
 * K * router_aux_loss_coef to match it. Returns 0 when T is 0. */
float router_aux_loss(const router_cfg_t *c, const int64_t *counts, const float *probs, int T,
                      float coef);
/* dlogits (T, E) += dloss * dL/dlogits for the loss above (counts held fixed). */
void router_aux_loss_backward(const router_cfg_t *c, float *dlogits, float dloss,
                              const int64_t *counts, const float *probs, int T, float coef);

#ifdef __cplusplus
}
#endif
#endif
