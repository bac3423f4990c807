/* model_config: Hugging Face config.json of the MoE families: parse, validate, write, count. */
#ifndef MOERL_ACTOR_MODEL_CONFIG_H
#define MOERL_ACTOR_MODEL_CONFIG_H

#include <stdint.h>

#include "core/dtype.h"
#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Supported "architectures" (Kimi K2 ships as DeepseekV3ForCausalLM).
 * Qwen2MoeForCausalLM is refused: its q/k/v projections carry biases and its
 * shared expert has a sigmoid gate, neither of which the actor implements. */
typedef enum {
    ARCH_QWEN3_MOE = 0, /* Qwen3MoeForCausalLM: GQA with q/k RMSNorm, softmax top-k */
    ARCH_MIXTRAL,       /* MixtralForCausalLM: GQA, softmax top-k, every layer MoE */
    ARCH_DEEPSEEK_V3,   /* DeepseekV3ForCausalLM: MLA, sigmoid + bias routing, shared experts */
    ARCH_COUNT
} model_arch_t;

typedef enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID } score_func_t;
typedef enum { TOPK_GREEDY = 0, TOPK_GROUP_LIMITED_GREEDY, TOPK_NOAUX_TC } topk_method_t;

#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_TOKEN_IDS 16

/* Dimension letters as in core/kernels.h. Fields a family does not have hold
 * the value that makes them inert (0 shared experts, n_group 1, ...). */
typedef struct model_config {
    model_arch_t arch;
    char model_type[32];       /* "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2", ... */
    int64_t vocab_size;        /* V */
    int hidden_size;           /* D */
    int intermediate_size;     /* F of dense MLPs (Mixtral: of each expert) */
    int moe_intermediate_size; /* F of each routed expert (Mixtral: = intermediate_size) */
    int num_hidden_layers;     /* L */
    int num_attention_heads;   /* H */
    int num_key_value_heads;   /* Hkv (MLA: = H) */
    int head_dim;              /* Dh of q and k (MLA: qk_nope_head_dim + qk_rope_head_dim) */
    int num_experts;           /* E (num_experts / num_local_experts / n_routed_experts) */
    int num_experts_per_tok;   /* K */
    int norm_topk_prob;        /* renormalise the K routing weights to sum 1 */
    /* Qwen3-MoE: layer l is MoE iff !mlp_only_layers[l] and (l + 1) % decoder_sparse_step == 0. */
    int decoder_sparse_step;
    unsigned char mlp_only_layers[MODEL_MAX_LAYERS]; /* (L) flags */
    /* DeepSeek: layer l is MoE iff l >= first_k_dense_replace and l % moe_layer_freq == 0. */
    int first_k_dense_replace;
    int moe_layer_freq;
    int n_shared_experts;         /* one shared MLP of n_shared_experts * moe_intermediate_size */
    double routed_scaling_factor; /* multiplies the routed experts' weights (1 when absent) */
    score_func_t scoring_func;
    topk_method_t topk_method;
    int n_group, topk_group; /* group-limited routing: E in n_group groups, keep topk_group */
    double rms_norm_eps;
    double rope_theta;
    rope_scaling_t rope_scaling; /* type ROPE_DEFAULT when absent */
    int rope_interleave;         /* DeepSeek: rope dims stored interleaved (HF default 1) */
    int64_t max_position_embeddings;
    int tie_word_embeddings;
    /* Sliding-window attention (see model_config_window): Mixtral windows every
     * layer when sliding_window is set; Qwen3 only with use_sliding_window, on
     * layers l >= max_window_layers, or on those "layer_types" marks sliding. */
    int sliding_window; /* 0: none */
    int use_sliding_window;
    int max_window_layers;
    int has_layer_types;                                 /* Qwen3 config carried "layer_types" */
    unsigned char layer_types_sliding[MODEL_MAX_LAYERS]; /* (L) 1 = "sliding_attention" */
    /* MLA (DeepSeek-V3 / Kimi K2). */
    int q_lora_rank; /* 0: q_proj instead of q_a_proj / q_a_layernorm / q_b_proj */
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    int num_nextn_predict_layers; /* MTP layers in the checkpoint; the actor does not run them */
    /* Special tokens: n_* == 0 when null or absent. */
    int n_bos, n_eos, n_pad;
    int32_t bos_token_id[MODEL_MAX_TOKEN_IDS];
    int32_t eos_token_id[MODEL_MAX_TOKEN_IDS];
    int32_t pad_token_id[MODEL_MAX_TOKEN_IDS];
    dtype_t torch_dtype;         /* "torch_dtype" or "dtype"; DT_BF16 when absent */
    double router_aux_loss_coef; /* DeepSeek: aux_loss_alpha */
    int output_router_logits;
    int fp8_block; /* quantization_config fp8 weight_block_size edge; 0 when unquantised */
} model_config_t;

/* Parses a config.json. dir_or_file is the file or the directory holding it.
 * Errors (MO_EIO, MO_ECONFIG) name the file, the field and what was expected.
 * Fields that fix tensor shapes are required; the others take the family's
 * Hugging Face defaults. Known fields with values this code cannot honour are
 * errors; fields without effect on the model (use_cache, initializer_range,
 * ...) are ignored. */
int model_config_load(model_config_t *c, const char *dir_or_file);
int model_config_parse_json(model_config_t *c, const char *json_text, const char *display_name);

/* Re-checks every bound and cross-field rule (for configs built in code). */
int model_config_validate(const model_config_t *c, const char *display_name);

/* 1 when layer's feed-forward is a mixture of experts, 0 when a dense MLP. */
int model_config_is_moe_layer(const model_config_t *c, int layer);
/* The attention window of layer (0: full causal attention). */
int model_config_window(const model_config_t *c, int layer);

/* Writes config.json in its family's Hugging Face layout, atomically
 * (temporary file, fsync, rename, directory fsync). Loading it gives back c. */
int model_config_write_json(const model_config_t *c, const char *path);

/* Parameters of the model (MTP layers excluded): *total all of them, *active
 * those one token uses (K routed experts, shared experts, everything else). */
void model_config_param_counts(const model_config_t *c, int64_t *total, int64_t *active);

const char *model_arch_name(model_arch_t a); /* "Qwen3MoeForCausalLM", ... */

#ifdef __cplusplus
}
#endif
#endif
