/* decode: the rollout engine's incremental forward: new tokens of many sequences, at
 * their positions, through every layer of the model with a paged KV cache, recording
 * the experts each token is routed to; plus merging an adapter into copies of the
 * weights it adapts. */
#ifndef MOERL_ROLLOUT_DECODE_H
#define MOERL_ROLLOUT_DECODE_H

#include <stdint.h>

#include "actor/model.h"
#include "core/arena.h"
#include "rollout/kv_cache.h"
#include "rollout/lora_rows.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes as in actor/model.h: N rows (new tokens), D width, H and Hkv heads, Dh head
 * dim, M MoE layers, K experts per token, V vocabulary, R LoRA rank.
 *
 * Each layer runs on the rows x (N, D) of the residual stream:
 *   a = rmsnorm(x); q, k, v = a Wq^T, a Wk^T, a Wv^T (+ LoRA); per-head q/k norm
 *   (Qwen3); RoPE at the rows' positions; k, v appended to each row's sequence in the
 *   cache; attention of q over the sequence's cached keys (sliding window honoured);
 *   h = x + o Wo^T (+ LoRA); x' = h + ffn(rmsnorm(h)), ffn the MoE layer with natural
 *   routing (experts recorded) or the dense MLP.
 * DeepSeek-V3 / Kimi K2 layers run multi-head latent attention (actor/mla.h) instead,
 * and the cache holds the compressed latent: per token and layer one row of Rkv + Dr
 * floats, c_kv after kv_a_layernorm and the rotated shared k_pe (kv_cache_init_latent),
 * instead of H (Dq + Dv) expanded keys and values. A prefill computes its output in the
 * expanded form (mla_forward over the whole sequences) and stores the latent; a decode
 * absorbs kv_b_proj = [W_UK; W_UV] per head: the query's nope part times W_UK scores
 * against c_kv (plus q_pe . k_pe), and the softmax-weighted latent times W_UV is the
 * head's output before o_proj. The absorbed weight is the effective one: W + scale B A
 * for an adapter bound on kv_b_proj, the merged copy in merged mode.
 * The same operations in the same order as model_forward, so a row's result equals the
 * learner's forward of the whole sequence up to float rounding (matrix products batch
 * rows differently). All rows of all sequences go through each matrix product at once. */

/* A weight, or several with the same input width run as one product, in the tiles'
 * packed layout (amx_pack_bf16, back to back), with the data each was packed from: the
 * packed copy stands in for the views only while they still point there (an adapter's
 * full-trained f32 router, for one, runs unpacked). */
typedef struct rl_pack {
    const uint16_t *w;  /* NULL: not packed */
    const void *src[3]; /* the views' data, in packing order */
} rl_pack_t;

/* One layer's weights as the engine runs them: the model's frozen views with its bound
 * adapters, or (merged mode) writable copies with the adapter folded in and no adapter
 * pointers. */
typedef struct rl_layer {
    const model_layer_t *ly; /* window, kind */
    /* Norm weights: the model's as bound, or in merged mode the merged adapter's full
     * tensors in place of the model's. MLA's are in mla. */
    const float *attn_norm, *q_norm, *k_norm, *mlp_norm;
    wview_t wq, wk, wv, wo;
    const lora_pair_t *lq, *lk, *lv, *lo;
    mla_weights_t mla; /* MLA layers: views and adapters (model_t.mla) */
    moe_cfg_t moe_cfg; /* the layer's, without the balance loss */
    moe_weights_t moe_w;
    mlp_weights_t dense;
    wview_t *experts; /* (3, E) merged mode: gate, up, down views; NULL otherwise */
    /* MLA: the effective kv_b_proj weight transposed, (Rkv, H (Dn + Dv)), built by the
     * first decode step that needs it and dropped whenever the layer is bound or merged
     * again (an adapter's values must not change between engine_set_adapter calls);
     * NULL until then. */
    float *absorbed;
    /* Packed copies of the bf16 weights (rl_weights_t.packed): q, k and v as one product,
     * o, the router, each expert's gate and up as one product and its down, the dense
     * MLP's or the shared experts' likewise; all in pbuf. */
    rl_pack_t qkv, o, router, mlp_gu, mlp_down;
    rl_pack_t *exp_gu, *exp_down; /* (E) */
    uint16_t *pbuf;
    const lora_rows_cache_t *lora; /* the bound adapter's LoRA operands (rl_weights_t) */
} rl_layer_t;

/* The layers of a model: views into the model's weights and bound adapter (call again
 * after model_set_adapter). */
typedef struct rl_weights {
    /* The kernels the engine runs: the model's, except that on the CPU backend, where
     * the CPU has AMX-BF16, products with bf16 weights run on the tiles
     * (rollout/amx_matmul.h: f32-exact activations, f32 accumulation). */
    kernels_t k;
    /* 1: the bf16 weights have packed copies for the tiles (made by rl_weights_init, and
     * again by rl_weights_merge for the merged copies); the products of
     * AMX_MIN_ROWS rows or more read them. Costs one more copy of those weights. */
    int packed;
    const float *final_norm; /* the model's as bound, or the merged adapter's */
    int L;
    rl_layer_t *layers; /* (L) */
    /* Merged mode: one writable copy per adapted projection, in the model's module
     * order (NULL where a module is not adapted). */
    int merged;
    int n_modules;
    void **copies;     /* (n_modules) */
    wview_t **targets; /* (n_modules) the rl_layer_t view each copy stands in for */
    /* Unmerged: the bound adapter's LoRA operands, formed when it is bound
     * (rl_weights_bind), for rollout/lora_rows.h's products. */
    lora_rows_cache_t lora;
} rl_weights_t;

/* pack 1: packed copies of the bf16 weights where the tiles run the products (one more
 * copy of those weights in memory); 0: none (the products read the weights in place). */
int rl_weights_init(rl_weights_t *w, const model_t *m, int pack);
/* *out = *m running on w's kernels (w->k): for model functions the engine calls. */
void rl_weights_model(const rl_weights_t *w, const model_t *m, model_t *out);
/* Unmerged: re-reads the model's views and bound adapters. */
void rl_weights_bind(rl_weights_t *w, const model_t *m);
/* Merged: the weights become base + scale B A for every module ad adapts (copies of the
 * base in its dtype, rounded once; see lora_merge), with no adapter applied at run time
 * (the model's own LoRA binding is ignored); the routers and norms ad trains in full
 * (model_adapter_add_full) replace the model's, as binding ad would; ad NULL restores
 * the base (the routers and norms the model has while no adapter is bound to it).
 * MO_EUNSUPPORTED for weights lora_merge cannot write (fp8), MO_EINVAL when ad does not
 * fit the model (a module, or a full tensor's name or shape). */
int rl_weights_merge(rl_weights_t *w, const model_t *m, const lora_adapter_t *ad);
void rl_weights_free(rl_weights_t *w);

/* c = the KV cache a model needs for budget_tokens tokens: keys and values of Hkv heads
 * of Dh, or for MLA the latent cache of Rkv + Dr floats per token and layer. */
int decode_kv_cache_init(kv_cache_t *c, const model_t *m, int64_t budget_tokens, int block_tokens);

/* The new rows of one forward. */
typedef struct decode_batch {
    int N;                 /* rows */
    const int32_t *tokens; /* (N) ids in [0, V) */
    const int32_t *pos;    /* (N) each row's position in its sequence */
    kv_seq_t *const *seqs; /* (N) row i's sequence; len > pos[i] (grown by the caller) */
    int prefill;           /* 1: the rows are B whole sequences from position 0 */
    int B;                 /* sequences when prefill */
    const int32_t *cu;     /* (B + 1) when prefill: sequence b is rows cu[b] .. cu[b+1]-1 */
    uint16_t *routing;     /* (N, M, K) receives each row's experts, or NULL */
} decode_batch_t;

/* x (N, D) = the residual stream after the last layer for the batch's rows; every
 * row's k and v (MLA: latent) are written into the cache; MLA layers' absorbed weights
 * are built into w's layers when missing. Temporaries come from ar (reset inside
 * after each layer: pass an arena that holds nothing the caller keeps). */
int decode_forward(const model_t *m, const rl_weights_t *w, kv_cache_t *c, arena_t *ar,
                   const decode_batch_t *b, float *x);

#ifdef __cplusplus
}
#endif
#endif
