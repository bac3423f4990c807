/* plan_presets: the published Hugging Face config.json of the models `moerl plan` knows by
 * name, parsed with model_config_parse_json. */
#include <stdio.h>
#include <string.h>

#include "core/status.h"
#include "learner/plan.h"

/* moonshotai/Kimi-K2-Instruct */
static const char KIMI_K2[] =
    "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"attention_bias\": false,"
    " \"aux_loss_alpha\": 0.001, \"bos_token_id\": 163584, \"eos_token_id\": 163585,"
    " \"first_k_dense_replace\": 1, \"hidden_act\": \"silu\", \"hidden_size\": 7168,"
    " \"intermediate_size\": 18432, \"kv_lora_rank\": 512, \"max_position_embeddings\": 131072,"
    " \"model_type\": \"kimi_k2\", \"moe_intermediate_size\": 2048, \"moe_layer_freq\": 1,"
    " \"n_group\": 1, \"n_routed_experts\": 384, \"n_shared_experts\": 1,"
    " \"norm_topk_prob\": true, \"num_attention_heads\": 64, \"num_experts_per_tok\": 8,"
    " \"num_hidden_layers\": 61, \"num_key_value_heads\": 64, \"num_nextn_predict_layers\": 0,"
    " \"q_lora_rank\": 1536, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
    " \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}, \"rms_norm_eps\": 1e-06,"
    " \"rope_scaling\": {\"beta_fast\": 1.0, \"beta_slow\": 1.0, \"factor\": 32.0,"
    " \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096,"
    " \"type\": \"yarn\"}, \"rope_theta\": 50000.0, \"routed_scaling_factor\": 2.827,"
    " \"scoring_func\": \"sigmoid\", \"seq_aux\": true, \"tie_word_embeddings\": false,"
    " \"topk_group\": 1, \"topk_method\": \"noaux_tc\", \"torch_dtype\": \"bfloat16\","
    " \"v_head_dim\": 128, \"vocab_size\": 163840}";

/* deepseek-ai/DeepSeek-V3 (its MTP layer is not counted: the actor does not run it) */
static const char DEEPSEEK_V3[] =
    "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"attention_bias\": false,"
    " \"aux_loss_alpha\": 0.001, \"bos_token_id\": 0, \"eos_token_id\": 1,"
    " \"first_k_dense_replace\": 3, \"hidden_act\": \"silu\", \"hidden_size\": 7168,"
    " \"intermediate_size\": 18432, \"kv_lora_rank\": 512, \"max_position_embeddings\": 163840,"
    " \"model_type\": \"deepseek_v3\", \"moe_intermediate_size\": 2048, \"moe_layer_freq\": 1,"
    " \"n_group\": 8, \"n_routed_experts\": 256, \"n_shared_experts\": 1,"
    " \"norm_topk_prob\": true, \"num_attention_heads\": 128, \"num_experts_per_tok\": 8,"
    " \"num_hidden_layers\": 61, \"num_key_value_heads\": 128, \"num_nextn_predict_layers\": 1,"
    " \"q_lora_rank\": 1536, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
    " \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}, \"rms_norm_eps\": 1e-06,"
    " \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, \"mscale\": 1.0,"
    " \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096, \"type\": \"yarn\"},"
    " \"rope_theta\": 10000, \"routed_scaling_factor\": 2.5, \"scoring_func\": \"sigmoid\","
    " \"seq_aux\": true, \"tie_word_embeddings\": false, \"topk_group\": 4,"
    " \"topk_method\": \"noaux_tc\", \"torch_dtype\": \"bfloat16\", \"v_head_dim\": 128,"
    " \"vocab_size\": 129280}";

/* Qwen/Qwen3-235B-A22B */
static const char QWEN3_235B_A22B[] =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false,"
    " \"bos_token_id\": 151643, \"decoder_sparse_step\": 1, \"eos_token_id\": 151645,"
    " \"head_dim\": 128, \"hidden_act\": \"silu\", \"hidden_size\": 4096,"
    " \"intermediate_size\": 12288, \"max_position_embeddings\": 40960,"
    " \"max_window_layers\": 94, \"mlp_only_layers\": [], \"model_type\": \"qwen3_moe\","
    " \"moe_intermediate_size\": 1536, \"norm_topk_prob\": true, \"num_attention_heads\": 64,"
    " \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 94,"
    " \"num_key_value_heads\": 4, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null,"
    " \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.001, \"sliding_window\": null,"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"use_sliding_window\": false, \"vocab_size\": 151936}";

/* Qwen/Qwen3-30B-A3B */
static const char QWEN3_30B_A3B[] =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false,"
    " \"bos_token_id\": 151643, \"decoder_sparse_step\": 1, \"eos_token_id\": 151645,"
    " \"head_dim\": 128, \"hidden_act\": \"silu\", \"hidden_size\": 2048,"
    " \"intermediate_size\": 6144, \"max_position_embeddings\": 40960,"
    " \"max_window_layers\": 48, \"mlp_only_layers\": [], \"model_type\": \"qwen3_moe\","
    " \"moe_intermediate_size\": 768, \"norm_topk_prob\": true, \"num_attention_heads\": 32,"
    " \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 48,"
    " \"num_key_value_heads\": 4, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null,"
    " \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.001, \"sliding_window\": null,"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"use_sliding_window\": false, \"vocab_size\": 151936}";

/* mistralai/Mixtral-8x7B-v0.1 */
static const char MIXTRAL_8X7B[] =
    "{\"architectures\": [\"MixtralForCausalLM\"], \"bos_token_id\": 1, \"eos_token_id\": 2,"
    " \"hidden_act\": \"silu\", \"hidden_size\": 4096, \"intermediate_size\": 14336,"
    " \"max_position_embeddings\": 32768, \"model_type\": \"mixtral\","
    " \"num_attention_heads\": 32, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 32,"
    " \"num_key_value_heads\": 8, \"num_local_experts\": 8, \"rms_norm_eps\": 1e-05,"
    " \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.02, \"sliding_window\": null,"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", \"vocab_size\": 32000}";

/* allenai/OLMoE-1B-7B-0924 is OlmoeForCausalLM, which model_config does not parse. Its
 * values (D 2048, 16 layers, 16 heads of 128, 64 experts of width 1024, 8 per token
 * without renormalisation, vocab 50304, no sliding window) written as the closest
 * supported family, Qwen3-MoE. */
static const char OLMOE_1B_7B[] =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false,"
    " \"bos_token_id\": null, \"decoder_sparse_step\": 1, \"eos_token_id\": 50279,"
    " \"pad_token_id\": 1, \"head_dim\": 128, \"hidden_act\": \"silu\", \"hidden_size\": 2048,"
    " \"intermediate_size\": 1024, \"max_position_embeddings\": 4096, \"max_window_layers\": 16,"
    " \"mlp_only_layers\": [], \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 1024,"
    " \"norm_topk_prob\": false, \"num_attention_heads\": 16, \"num_experts\": 64,"
    " \"num_experts_per_tok\": 8, \"num_hidden_layers\": 16, \"num_key_value_heads\": 16,"
    " \"rms_norm_eps\": 1e-05, \"rope_scaling\": null, \"rope_theta\": 10000.0,"
    " \"router_aux_loss_coef\": 0.01, \"sliding_window\": null, \"tie_word_embeddings\": false,"
    " \"torch_dtype\": \"bfloat16\", \"use_sliding_window\": false, \"vocab_size\": 50304}";

static const char OLMOE_NOTE[] =
    "OLMoE (OlmoeForCausalLM) is planned as a Qwen3-MoE model with the same dimensions: "
    "OLMoE's q/k norms span the whole projection (2 x 2048 weights per layer) where "
    "Qwen3's span one head (2 x 128), a difference of 61,440 parameters in 6.9 B; "
    "memory and communication are otherwise the same";

typedef struct preset {
    const char *name;
    const char *json;
    const char *note;
} preset_t;

static const preset_t g_presets[] = {
    {"kimi-k2", KIMI_K2, NULL},
    {"deepseek-v3", DEEPSEEK_V3, NULL},
    {"qwen3-235b-a22b", QWEN3_235B_A22B, NULL},
    {"qwen3-30b-a3b", QWEN3_30B_A3B, NULL},
    {"mixtral-8x7b", MIXTRAL_8X7B, NULL},
    {"olmoe-1b-7b", OLMOE_1B_7B, OLMOE_NOTE},
};

#define N_PRESETS ((int)(sizeof g_presets / sizeof g_presets[0]))

const char *const plan_preset_names[] = {
    "kimi-k2",     "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b",
    "olmoe-1b-7b", NULL};

int plan_preset(model_config_t *c, const char *name, const char **note) {
    if (note)
        *note = NULL;
    for (int i = 0; i < N_PRESETS; i++) {
        if (!name || strcmp(name, g_presets[i].name) != 0)
            continue;
        char display[64];
        snprintf(display, sizeof display, "preset %s", g_presets[i].name);
        TRY(model_config_parse_json(c, g_presets[i].json, display));
        if (note)
            *note = g_presets[i].note;
        return MO_OK;
    }
    return mo_errorf(MO_ENOTFOUND,
                     "unknown model preset '%s' (presets: kimi-k2, deepseek-v3, qwen3-235b-a22b, "
                     "qwen3-30b-a3b, mixtral-8x7b, olmoe-1b-7b)",
                     name ? name : "");
}
