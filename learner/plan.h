/* plan: memory and communication planning for LoRA RL on mixture-of-experts models:
 * per-GPU learner memory, per-step all-to-all and all-reduce bytes, adapter weight sync
 * and rollout KV-cache capacity, as pure functions of a model config and a layout. */
#ifndef MOERL_LEARNER_PLAN_H
#define MOERL_LEARNER_PLAN_H

#include <stdint.h>

#include "actor/model_config.h"
#include "lora/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Layout model. A learner job is dp replicas of an expert-parallel group of ep GPUs
 * (gpus = ep x dp). Within the group, GPU r owns routed experts r E/ep .. (r+1) E/ep - 1
 * of every MoE layer (their frozen weights and their LoRA adapters); everything else
 * (embeddings, lm_head, attention, norms, routers, shared experts, dense layers and
 * their adapters) is replicated on every GPU. Each GPU feeds its own T tokens per
 * micro-batch; a step is one forward and backward of T tokens on every GPU.
 *
 * Memory model, per GPU (bytes):
 *   base       every frozen tensor in its stored type (plan_wtype_t says which
 *              tensors the type applies to), routed experts divided by ep;
 *   LoRA       params, gradients and AdamW's two moments, 4 bytes each (f32);
 *   activations what the actor keeps for backward in its step arena (arena peak) and
 *              its per-layer temporaries (scratch peak), counted allocation by
 *              allocation from actor/model.c, actor/mla.c, moe/moe.c, moe/mlp.c
 *              (ep = 1) or moe/moe_ep.c (ep > 1), f32, each rounded to the arena's
 *              64-byte alignment. `imbalance` (1: uniform) sizes the busiest expert's
 *              rows, imbalance x T K x ep / E, and the busiest GPU's received rows,
 *              min(imbalance, ep) x T K (all its experts that busy: an upper bound).
 *   reserve    a fixed allowance for the runtime (CUDA context, library workspaces).
 * The actor's fixed bookkeeping (a few hundred bytes of structs per layer) is left out. */

/* Storage of the frozen base:
 *   F32, BF16  every tensor in that type;
 *   FP8        as DeepSeek-V3 / Kimi K2 ship: every projection inside the decoder layers
 *              (attention, routed and shared experts, dense MLPs) float8-e4m3 with one
 *              f32 scale per 128 x 128 block; embeddings, lm_head, router and norms bf16;
 *   INT4       as Kimi K2 Thinking ships: routed experts int4 with one bf16 scale per
 *              group of 32 inputs; everything else bf16.
 * DeepSeek's e_score_correction_bias is f32 in every case. (The actor loads f32, bf16,
 * f16 and fp8 checkpoints; int4 is a planning option.) */
typedef enum { PLAN_W_F32 = 0, PLAN_W_BF16, PLAN_W_FP8, PLAN_W_INT4, PLAN_W_COUNT } plan_wtype_t;

const char *plan_wtype_name(plan_wtype_t t); /* "f32", "bf16", "fp8", "int4" */
int plan_wtype_from_name(const char *name, plan_wtype_t *out);
/* Bytes of a (rows, cols) matrix stored as t, scales included. */
double plan_matrix_bytes(plan_wtype_t t, int64_t rows, int64_t cols);

typedef struct plan_layout {
    int ep, dp;                 /* expert-parallel degree (divides E) and data-parallel replicas */
    double gpu_mem_gib;         /* memory of one GPU */
    int lora_rank;              /* R */
    const char *const *targets; /* (n_targets) target words (lora/adapter.h), borrowed */
    int n_targets;
    plan_wtype_t base;     /* storage of the frozen base */
    int seq_len;           /* tokens per sequence */
    int64_t tokens;        /* T: tokens per GPU per micro-batch */
    int recompute;         /* the mode the fit check uses: 1 recompute on, 0 off */
    int logits_chunk_rows; /* 0: the actor's default, (1 << 22) / V */
    double imbalance;      /* busiest expert's load / mean load, >= 1 */
    int a2a_bytes;         /* bytes per element of exchanged rows: 4 (f32, as moe_ep) or 2 */
    double reserve_gib;    /* runtime allowance per GPU, learner and rollout */
    int rollout_gpus;      /* GPUs of one rollout engine (experts sharded over them) */
    int64_t kv_tokens;     /* KV tokens per rollout GPU asked for (0: none) */
    plan_wtype_t kv;       /* KV-cache element type: F32, BF16 or FP8 */
} plan_layout_t;

/* ep 8, dp 1, 80 GiB, rank 16 on "attention", bf16 base, seq 4096, T 4096, recompute
 * on, imbalance 1, f32 rows, 2 GiB reserve, 8 rollout GPUs, bf16 KV. */
void plan_layout_default(plan_layout_t *l);

/* Activation bytes of one micro-batch on one GPU. */
typedef struct plan_acts {
    double kept;  /* the step arena's peak: kept for backward, plus backward buffers */
    double temps; /* the scratch arena's peak: one layer's temporaries, logits chunks */
    double a2a;   /* of kept + temps at their peaks, the all-to-all row buffers */
} plan_acts_t;

typedef struct plan {
    plan_layout_t layout;
    int gpus;            /* ep x dp */
    int experts_per_gpu; /* E / ep */
    int n_moe;           /* MoE layers */

    /* Parameters of the model (model_config_param_counts) and the split. */
    int64_t params_total, params_active;
    int64_t params_experts; /* routed experts, all of them */

    /* Learner memory per GPU, bytes. */
    double base_replicated;          /* everything but the routed experts */
    double base_experts;             /* the E / ep routed experts of each MoE layer */
    int64_t lora_params;             /* the whole adapter */
    int64_t lora_params_experts;     /* of which routed-expert adapters (all experts) */
    int64_t lora_params_gpu;         /* held per GPU: replicated + own experts' */
    int n_lora_modules;              /* adapted projections */
    double lora_bytes, grad_bytes;   /* 4 bytes each per GPU-held parameter */
    double adam_bytes;               /* 2 x 4 bytes */
    double reserve;                  /* reserve_gib in bytes */
    plan_acts_t acts[2];             /* [0] recompute off, [1] recompute on */
    double total[2];                 /* everything above, per mode */
    int fits[2];                     /* total <= gpu_mem */
    double layer_bytes_per_token[2]; /* kept bytes per token of one layer without recompute:
                                      * [0] a dense layer (0 if none), [1] a MoE layer */

    /* Communication per GPU per step, bytes. */
    double a2a_step[2];       /* all-to-all bytes sent, uniform routing: [0] forward + backward,
                               * [1] with recompute (the forward's exchanges run twice) */
    double allreduce_payload; /* replicated LoRA gradients, f32 */
    double allreduce_ring;    /* what a ring all-reduce sends: 2 (G - 1) / G x payload */
    double expert_allreduce_payload; /* own experts' LoRA gradients, summed over dp */
    double expert_allreduce_ring;

    /* Weight sync per version, bytes. */
    double sync_f32, sync_bf16; /* the whole adapter */
    double full_base;           /* the whole base in its stored type */
    double full_bf16;           /* the whole base in bf16 */

    /* Rollout, per GPU of an engine of rollout_gpus GPUs, bytes. */
    double roll_base;          /* base with experts / rollout_gpus */
    double roll_adapter;       /* the adapter (f32), experts' share / rollout_gpus */
    double roll_workspace;     /* the actor's inference forward over T tokens */
    double roll_left;          /* gpu_mem - base - adapter - workspace - reserve */
    double kv_bytes_per_token; /* GQA: 2 L Hkv Dh b; MLA: L (kv_lora_rank + qk_rope) b */
    int64_t kv_capacity;       /* tokens that fit in roll_left (0 when nothing is left) */
    int kv_fits;               /* kv_tokens <= kv_capacity */
} plan_t;

/* Published models by name: "kimi-k2", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b",
 * "mixtral-8x7b", "olmoe-1b-7b" (NULL-terminated), from their Hugging Face config.json
 * (learner/plan_presets.c). */
extern const char *const plan_preset_names[];
/* Fills c with a preset; *note (may be NULL) receives a caveat about how the plan treats
 * the model, or NULL. MO_ENOTFOUND naming the presets for an unknown name. */
int plan_preset(model_config_t *c, const char *name, const char **note);

/* Computes the plan. MO_EINVAL naming the field for a bad layout (ep not dividing E,
 * rank < 1, T < 1, ...), MO_ECONFIG for a target word that selects nothing,
 * MO_ENOMEM. */
int plan_compute(plan_t *p, const model_config_t *c, const plan_layout_t *l);

/* The smallest ep (a divisor of E, dp 1, the rest of l kept) whose learner total in
 * l->recompute's mode fits; *ep_out = 0 when none does. */
int plan_smallest_ep(const model_config_t *c, const plan_layout_t *l, int *ep_out);

/* Activations of one micro-batch on one GPU: for_backward 1 as plan_t.acts[recompute];
 * for_backward 0 the inference forward (kept: the arena's peak, temps: the scratch's). */
int plan_activations(plan_acts_t *a, const model_config_t *c, const plan_layout_t *l, int recompute,
                     int for_backward);

/* The MoE block of layer `layer` alone, router to combine with the shared experts: fwd
 * the bytes its forward allocates, bwd its backward's temporaries (a2a_*: of which
 * all-to-all rows), as moe_forward / moe_backward (ep_layer 0) or as moe_ep_forward /
 * moe_ep_backward on the busiest of l->ep ranks (ep_layer 1, also for ep 1). */
typedef struct plan_block {
    double fwd, bwd, a2a_fwd, a2a_bwd;
} plan_block_t;
int plan_moe_block(plan_block_t *b, const model_config_t *c, const plan_layout_t *l, int layer,
                   int ep_layer);

/* The projections the actor offers to adapters for config c, in model_t.modules' order
 * (names, proj, kind, C, OC as model_open builds them). Free with plan_modules_free. */
int plan_modules(lora_module_desc_t **mods, int *n, const model_config_t *c);
void plan_modules_free(lora_module_desc_t **mods, int n);

/* All-to-all of one forward plus backward through the expert-parallel layer, on rank
 * `rank` of N, for a routing given as counts (N, E): counts[p E + e] token slots of
 * rank p routed to expert e. Rows of D elements of elem_bytes each; the forward's count
 * exchange sends n = E / N int64 per peer. The same fields as moe_ep_traffic_t. */
typedef struct plan_a2a {
    int64_t rows_out, rows_in, rows_local;
    uint64_t bytes_sent, bytes_recv, bytes_local;
} plan_a2a_t;
void plan_a2a_exact(plan_a2a_t *t, const int64_t *counts, int N, int E, int D, int elem_bytes,
                    int rank);
/* Its expectation per MoE layer under uniform routing, rows only:
 * T K D elem_bytes x 2 directions x 2 passes x (N - 1) / N. */
double plan_a2a_uniform(int64_t T, int K, int D, int N, int elem_bytes);

#ifdef __cplusplus
}
#endif
#endif
