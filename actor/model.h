/* model: the policy model, a mixture-of-experts transformer on a frozen Hugging Face
 * checkpoint with LoRA adapters: loading, forward (per-token logprob and entropy over a
 * packed batch) and backward (LoRA gradients). */
#ifndef MOERL_ACTOR_MODEL_H
#define MOERL_ACTOR_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "actor/mla.h"
#include "actor/model_config.h"
#include "core/arena.h"
#include "core/comm.h"
#include "core/kernels.h"
#include "core/safetensors.h"
#include "lora/adapter.h"
#include "lora/lora.h"
#include "moe/mlp.h"
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: B sequences, T tokens of a packed batch, D model width, H query heads, Hkv kv
 * heads, Dh head dim, E routed experts, K experts per token, F expert hidden width, V
 * vocabulary, L layers, M MoE layers.
 *
 * Layer l computes, on the residual stream x (T, D):
 *   a = rmsnorm(x) ; q, k, v = a Wq^T, a Wk^T, a Wv^T (+ LoRA)
 *   (Qwen3) per-head rmsnorm of q and k ; RoPE (rotate-half) on q and k
 *   o = causal GQA attention (sliding window on some layers) ; h = x + o Wo^T (+ LoRA)
 *   x' = h + ffn(rmsnorm(h)), ffn = the MoE layer or a dense SwiGLU MLP.
 * DeepSeek-V3 / Kimi K2 layers replace q, k, v, o by multi-head latent attention on
 * rmsnorm(x) (actor/mla.h; model_t.mla = 1, weights in model_layer_t.mla).
 * Then the final rmsnorm, lm_head (in chunks of rows: the (T, V) logits are never kept)
 * and the log-probability of each target and the entropy at temperature tau.
 *
 * Everything runs on the host through the CPU kernel table. Frozen matrices stay in the
 * checkpoint's dtype as views into its mapping; norm vectors are f32 copies. */

/* Options for model_open. Zero-initialised options are the defaults. */
typedef struct model_opts {
    int recompute;         /* 1: forward keeps each layer's input only; backward recomputes
                            * the layer (same gradients, less memory) */
    int logits_chunk_rows; /* rows of logits formed at a time; 0: (1 << 22) / V, >= 1 */
    float aux_coef;        /* load-balancing loss coefficient (moe_cfg_t.aux_coef): 0 = off.
                            * Hugging Face's Mixtral loss is aux_coef = K * router_aux_loss_coef */
} model_opts_t;

/* One decoder layer's frozen weights and the adapters bound to them. */
typedef struct model_layer {
    int moe;       /* 1: mixture of experts, 0: dense MLP */
    int moe_index; /* index among the MoE layers (routing layout), -1 for a dense layer */
    int window;    /* attention window (0: full causal) */

    const float *attn_norm; /* (D) input_layernorm */
    wview_t wq;             /* (H Dh, D) q_proj */
    wview_t wk;             /* (Hkv Dh, D) k_proj */
    wview_t wv;             /* (Hkv Dh, D) v_proj */
    wview_t wo;             /* (D, H Dh) o_proj */
    const float *q_norm;    /* (Dh) per-head q RMSNorm (Qwen3), or NULL */
    const float *k_norm;    /* (Dh) per-head k RMSNorm (Qwen3), or NULL */
    const lora_pair_t *lora_q, *lora_k, *lora_v, *lora_o; /* bound adapters, or NULL */
    const float *mlp_norm;                                /* (D) post_attention_layernorm */
    /* Gradients of the norm weights made trainable (model_adapter_add_full), accumulated
     * by the backward, or NULL (frozen); the router's is moe_w.drouter. */
    float *d_attn_norm, *d_mlp_norm; /* (D) */
    float *d_q_norm, *d_k_norm;      /* (Dh) */

    /* MLA attention (model_t.mla = 1); wq, wk, wv, wo, q_norm, k_norm and lora_q..lora_o
     * are then unset (NULL data) and every attention weight and adapter is here. */
    mla_weights_t mla;

    /* MoE layer: moe_w.gate/up/down point into experts, moe_w.lora_* into expert_lora;
     * moe_w.shared holds the shared experts when moe_cfg.n_shared > 0. */
    moe_cfg_t moe_cfg;
    moe_weights_t moe_w;
    wview_t *experts;                /* (3, E) gate, up, down of each expert */
    const lora_pair_t **expert_lora; /* (3, E) adapters of gate, up, down, or NULL */
    const float *e_bias;             /* (E) e_score_correction_bias (DeepSeek), or NULL */

    /* Dense layer: width F = intermediate_size. */
    mlp_weights_t dense;
} model_layer_t;

/* Load statistics of one MoE layer from the last forward. */
typedef struct model_moe_stats {
    int layer;        /* decoder layer index */
    int64_t *load;    /* (E) token slots routed to each expert */
    float imbalance;  /* max / mean of load */
    float aux_loss;   /* balance loss value (0 when aux_coef is 0); with aux_pool this
                       * layer's share of the pooled loss (the shares sum to it) */
    float *prob_mean; /* (E) mean router probability of each expert over the tokens */
} model_moe_stats_t;

typedef struct model_step model_step_t; /* what the last forward kept, in the arena */

typedef struct model {
    model_config_t cfg;
    model_opts_t opts;
    char *path;          /* the directory or file it was loaded from */
    st_checkpoint_t *ck; /* owns the mapped weights */
    const kernels_t *k;  /* CPU kernel table */
    int L, D, H, Hkv, Dh, E, K;
    int V;
    int n_moe;               /* M: MoE layers */
    wview_t embed;           /* (V, D) model.embed_tokens */
    wview_t lm_head;         /* (V, D) lm_head, or embed when tied */
    const float *final_norm; /* (D) model.norm */
    float *d_final_norm;     /* (D) its gradient when trainable, or NULL */
    model_layer_t *layers;   /* (L) */
    float *inv_freq;         /* (Dh / 2) RoPE frequencies; MLA: (qk_rope_head_dim / 2) */
    float rope_mscale;       /* cos/sin multiplier from the RoPE scaling */
    float attn_scale;        /* 1 / sqrt(Dh); MLA: mla_cfg.scale */
    int mla;                 /* 1: multi-head latent attention (DeepSeek-V3 / Kimi K2); Dh is
                              * then qk_nope + qk_rope and Hkv = H */
    mla_cfg_t mla_cfg;       /* MLA dimensions when mla */
    float eps;               /* rms_norm_eps */

    /* Projections offered to adapters, in layer order: q, k, v, o (MLA: q_a_proj, q_b_proj
     * or q_proj, then kv_a_proj_with_mqa, kv_b_proj, o_proj); then each routed
     * expert's gate, up, down (expert by expert); the shared experts' gate, up, down;
     * or the dense MLP's gate, up, down. */
    int n_modules;
    lora_module_desc_t *modules;      /* (n_modules) */
    const lora_pair_t ***module_slot; /* (n_modules) where each module's adapter is bound */
    lora_pair_t *pairs;               /* (n_modules) views into the bound adapter */
    const lora_adapter_t *adapter;    /* bound adapter or NULL */
    struct model_full *full;          /* (n_full) the weights an adapter may train in full,
                                       * with their frozen values (model_adapter_add_full) */
    int n_full;

    model_moe_stats_t *stats; /* (M) from the last forward */
    int aux_pool;             /* model_set_aux_pool */

    arena_t arena;   /* the step: activations kept for backward */
    arena_t scratch; /* per-layer temporaries, reset after each layer */
    model_step_t *step;

    float *vecs;                   /* f32 copies of the norm vectors and biases, inv_freq */
    wview_t *views;                /* expert weight views of every MoE layer */
    const lora_pair_t **lora_ptrs; /* expert adapter slots of every MoE layer */
    float **scales;                /* (n_scales) fp8 block scales (malloc'd) */
    int n_scales, cap_scales;

    /* Expert parallelism (model_set_comm): the communicator, or NULL, and the routed
     * experts this rank holds, ep_e0 .. ep_e0 + ep_n - 1 (ep_n 0: all E). */
    comm_t *comm;
    int ep_e0, ep_n;
    /* model_set_device_comm: the communicator the device path's exchanges use, or NULL
     * (they use comm). */
    comm_t *device_comm;
} model_t;

/* Loads a Hugging Face model directory: config.json (model_config_load) and the
 * weights (model.safetensors or a sharded model.safetensors.index.json). opts may be
 * NULL. Errors name the file and the tensor with the expected shape: a missing tensor
 * is MO_ENOTFOUND, a wrong shape or dtype MO_EMALFORMED. DeepSeek-V3 / Kimi K2
 * checkpoints load with their MLA attention (model_t.mla = 1). */
int model_open(model_t **out, const char *dir, const model_opts_t *opts);
/* The same from a config built in code and a checkpoint path (as st_checkpoint_open
 * takes it). */
int model_open_config(model_t **out, const model_config_t *cfg, const char *weights,
                      const model_opts_t *opts);
void model_destroy(model_t **m);

/* Binds an adapter (its entries must name modules of this model with matching shapes,
 * its full tensors weights that model_adapter_add_full offers, with matching shapes;
 * MO_EINVAL naming the first that does not), or NULL for the base model (the reference
 * policy). The adapter must outlive the binding. Gradients flow into the adapter's grad
 * buffer when it has one. Invalidates the last forward. */
int model_set_adapter(model_t *m, const lora_adapter_t *ad);

/* Trainable router and norm weights. Appends to ad (lora_adapter_add_full) full f32
 * copies of the model's current frozen values of
 *   router = 1: every MoE layer's router "model.layers.<l>.mlp.gate.weight" (E, D)
 *               ("block_sparse_moe.gate" in Mixtral);
 *   norms = 1:  every layer's "input_layernorm.weight" (D, 1), Qwen3's
 *               "self_attn.q_norm.weight" and "k_norm.weight" (Dh, 1), MLA's
 *               "self_attn.q_a_layernorm.weight" (q_lora_rank, 1; when q_lora_rank > 0)
 *               and "self_attn.kv_a_layernorm.weight" (kv_lora_rank, 1), then
 *               "post_attention_layernorm.weight" (D, 1); last "model.norm.weight" (D, 1).
 * DeepSeek's e_score_correction_bias, the embeddings and lm_head stay frozen. Once ad is
 * bound (model_set_adapter), the forward reads these weights from ad->params and the
 * backward accumulates their gradients into ad->grads; binding another adapter or NULL
 * restores the frozen values. Call it before binding ad. Under expert parallelism the
 * weights are replicated: each rank's backward accumulates the share of its own tokens,
 * and the caller sums the gradients over the ranks (as for the attention adapters).
 * MO_EINVAL when router is asked of a model without MoE layers, or for a router stored
 * with fp8 block scales. */
int model_adapter_add_full(model_t *m, lora_adapter_t *ad, int router, int norms);

/* Expert parallelism over cm (borrowed; it must outlive the model). With N = comm_size(cm)
 * > 1 ranks, this rank keeps only its E / N routed experts (moe_ep_experts) of every MoE
 * layer: the other experts' weight views and fp8 scales are dropped, so their part of the
 * mapped checkpoint is never read, and the MoE layers run moe_ep_forward / moe_ep_backward.
 * model_forward and model_backward are then collective: every rank calls them in the same
 * order, each with its own sequences (T = 0 is fine), the same options and adapter
 * targets; an error on one rank leaves the others waiting (treat it as fatal for the
 * job). Routing stats (model_t.stats) then describe the global batch. cm NULL or of size
 * 1 changes nothing. MO_ECONFIG when E is not a multiple of N (naming both), MO_ESTATE
 * when another communicator of size > 1 was set before. */
int model_set_comm(model_t *m, comm_t *cm);

/* The communicator for the device path's MoE exchanges (actor/model_cuda.h), in place of
 * model_set_comm's: one on device memory (NCCL) moves the rows between the GPUs without
 * host staging, while model_set_comm's host communicator keeps everything else (the CPU
 * forward and backward, the callers' reductions of host buffers). Borrowed; it must
 * outlive the model and any upload; set it before model_cuda_upload. cm NULL clears it.
 * MO_ESTATE without an expert-parallel communicator (model_set_comm with N > 1);
 * MO_EINVAL when cm's rank or size differs from that one's (naming both). */
int model_set_device_comm(model_t *m, comm_t *cm);

/* Bytes of frozen routed-expert weights (every MoE layer, fp8 scales included) the model
 * holds: all E experts, or this rank's E / N after model_set_comm. */
size_t model_expert_weight_bytes(const model_t *m);

/* A packed batch of B sequences: sequence b holds tokens cu_seqlens[b] ..
 * cu_seqlens[b+1]-1. Read during model_forward only (what backward needs is copied). */
typedef struct model_batch {
    int T;                     /* tokens */
    int B;                     /* sequences */
    const int32_t *tokens;     /* (T) input ids in [0, V) */
    const int32_t *positions;  /* (T) >= 0, each token's position in its sequence (RoPE) */
    const int32_t *cu_seqlens; /* (B + 1) 0 = cu[0] <= cu[1] <= ... <= cu[B] = T */
    const int32_t *targets;    /* (T) id whose logprob is wanted at each token; -1: none */
    float temperature;         /* > 0: logits are divided by it */
    const uint16_t *replay;    /* (T, M, K) experts to use (routing replay), or NULL */
    uint16_t *routing;         /* (T, M, K) receives the experts used, or NULL */
} model_batch_t;

/* positions[t] = t - cu[b] and targets[t] = tokens[t + 1] within each sequence, -1 at
 * each sequence's last token: the usual next-token scoring of packed sequences. */
void model_batch_next_token(int32_t *positions, int32_t *targets, const int32_t *tokens,
                            const int32_t *cu_seqlens, int B);

/* Forward over a batch: logp (T) the log-probability of each target (0 where the
 * target is -1), entropy (T, or NULL) of each token's next-token distribution, both at
 * the batch's temperature. for_backward = 1 keeps what model_backward needs (in the
 * model's arena, until the next forward); 0 keeps nothing (inference, less memory).
 * Bad inputs (ids, cu_seqlens, replay indices) are MO_EINVAL / MO_EMALFORMED with the
 * position named. Deterministic: the same inputs give the same bits on a fixed thread
 * count. */
int model_forward(model_t *m, const model_batch_t *b, float *logp, float *entropy,
                  int for_backward);

/* Backward of the last forward (made with for_backward = 1 and the same adapter): from
 * dlogp (T) and dentropy (T, or NULL) the bound adapter's dA and dB ACCUMULATE (the
 * caller zeroes them: lora_adapter_zero_grads). dlogp is ignored where the target is
 * -1. With aux_coef > 0 the balance losses are taken as added to the objective.
 * MO_ESTATE when there is no such forward. */
int model_backward(model_t *m, const float *dlogp, const float *dentropy);

/* Sum of the MoE layers' balance losses from the last forward (0 when aux_coef is 0). */
float model_aux_loss(const model_t *m);

/* pool = 0 (the default): one balance loss per MoE layer, summed. pool = 1: one loss over
 * the token slots of all M MoE layers together, as Hugging Face's load_balancing_loss_func
 * computes it (times router_aux_loss_coef = aux_coef / K):
 *     aux_coef E sum_e F_e P_e,
 * F_e = (slots routed to e in all layers) / (M T K), P_e = the router probability of e
 * averaged over the M T (layer, token) pairs (sigmoid scores normalised per token to sum
 * 1). Each layer's stats then hold its share of it (P_e's terms of that layer). Not with
 * expert parallelism: MO_EINVAL after model_set_comm, and model_set_comm refuses it. */
int model_set_aux_pool(model_t *m, int pool);

/* Pieces for other decoding paths (e.g. a KV-cache engine). */
/* x (T, D) = embedding rows of ids (which must be in [0, V)). */
void model_embed(const model_t *m, float *x, const int32_t *ids, int T);
/* logits (n, V) = lm_head(rmsnorm(x)) for n rows of the residual stream x (n, D);
 * normed (n, D) and rstd (n) receive the final norm's output and scales. */
void model_logits(const model_t *m, float *logits, float *normed, float *rstd, const float *x,
                  int n);

#ifdef __cplusplus
}
#endif
#endif
