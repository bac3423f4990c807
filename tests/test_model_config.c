/* Tests for model_config: the four published MoE configs parse into the
 * expected fields, their parameter counts match the published totals, the
 * layer rules hold, every malformed or unsupported field is refused with a
 * message naming the file and the field, and write -> load is exact. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "actor/model_config.h"
#include "core/status.h"
#include "tests/testutil.h"

static char g_dir[512];

/* ---- configs shaped like the published config.json files ---- */

static const char *QWEN3_30B_A3B = "{\n"
                                   "  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n"
                                   "  \"attention_bias\": false,\n"
                                   "  \"attention_dropout\": 0.0,\n"
                                   "  \"bos_token_id\": 151643,\n"
                                   "  \"decoder_sparse_step\": 1,\n"
                                   "  \"eos_token_id\": 151645,\n"
                                   "  \"head_dim\": 128,\n"
                                   "  \"hidden_act\": \"silu\",\n"
                                   "  \"hidden_size\": 2048,\n"
                                   "  \"initializer_range\": 0.02,\n"
                                   "  \"intermediate_size\": 6144,\n"
                                   "  \"max_position_embeddings\": 40960,\n"
                                   "  \"max_window_layers\": 48,\n"
                                   "  \"mlp_only_layers\": [],\n"
                                   "  \"model_type\": \"qwen3_moe\",\n"
                                   "  \"moe_intermediate_size\": 768,\n"
                                   "  \"norm_topk_prob\": true,\n"
                                   "  \"num_attention_heads\": 32,\n"
                                   "  \"num_experts\": 128,\n"
                                   "  \"num_experts_per_tok\": 8,\n"
                                   "  \"num_hidden_layers\": 48,\n"
                                   "  \"num_key_value_heads\": 4,\n"
                                   "  \"output_router_logits\": false,\n"
                                   "  \"rms_norm_eps\": 1e-06,\n"
                                   "  \"rope_scaling\": null,\n"
                                   "  \"rope_theta\": 1000000.0,\n"
                                   "  \"router_aux_loss_coef\": 0.001,\n"
                                   "  \"sliding_window\": null,\n"
                                   "  \"tie_word_embeddings\": false,\n"
                                   "  \"torch_dtype\": \"bfloat16\",\n"
                                   "  \"transformers_version\": \"4.51.0\",\n"
                                   "  \"use_cache\": true,\n"
                                   "  \"use_sliding_window\": false,\n"
                                   "  \"vocab_size\": 151936\n"
                                   "}\n";

static const char *MIXTRAL_8X7B = "{\n"
                                  "  \"architectures\": [\"MixtralForCausalLM\"],\n"
                                  "  \"attention_dropout\": 0.0,\n"
                                  "  \"bos_token_id\": 1,\n"
                                  "  \"eos_token_id\": 2,\n"
                                  "  \"hidden_act\": \"silu\",\n"
                                  "  \"hidden_size\": 4096,\n"
                                  "  \"initializer_range\": 0.02,\n"
                                  "  \"intermediate_size\": 14336,\n"
                                  "  \"max_position_embeddings\": 32768,\n"
                                  "  \"model_type\": \"mixtral\",\n"
                                  "  \"num_attention_heads\": 32,\n"
                                  "  \"num_experts_per_tok\": 2,\n"
                                  "  \"num_hidden_layers\": 32,\n"
                                  "  \"num_key_value_heads\": 8,\n"
                                  "  \"num_local_experts\": 8,\n"
                                  "  \"output_router_logits\": false,\n"
                                  "  \"rms_norm_eps\": 1e-05,\n"
                                  "  \"rope_theta\": 1000000.0,\n"
                                  "  \"router_aux_loss_coef\": 0.02,\n"
                                  "  \"sliding_window\": null,\n"
                                  "  \"tie_word_embeddings\": false,\n"
                                  "  \"torch_dtype\": \"bfloat16\",\n"
                                  "  \"transformers_version\": \"4.36.0.dev0\",\n"
                                  "  \"use_cache\": true,\n"
                                  "  \"vocab_size\": 32000\n"
                                  "}\n";

static const char *DEEPSEEK_V3 =
    "{\n"
    "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"auto_map\": {\"AutoConfig\": \"configuration_deepseek.DeepseekV3Config\",\n"
    "               \"AutoModelForCausalLM\": \"modeling_deepseek.DeepseekV3ForCausalLM\"},\n"
    "  \"aux_loss_alpha\": 0.001,\n"
    "  \"bos_token_id\": 0,\n"
    "  \"eos_token_id\": 1,\n"
    "  \"ep_size\": 1,\n"
    "  \"first_k_dense_replace\": 3,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 7168,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 18432,\n"
    "  \"kv_lora_rank\": 512,\n"
    "  \"max_position_embeddings\": 163840,\n"
    "  \"model_type\": \"deepseek_v3\",\n"
    "  \"moe_intermediate_size\": 2048,\n"
    "  \"moe_layer_freq\": 1,\n"
    "  \"n_group\": 8,\n"
    "  \"n_routed_experts\": 256,\n"
    "  \"n_shared_experts\": 1,\n"
    "  \"norm_topk_prob\": true,\n"
    "  \"num_attention_heads\": 128,\n"
    "  \"num_experts_per_tok\": 8,\n"
    "  \"num_hidden_layers\": 61,\n"
    "  \"num_key_value_heads\": 128,\n"
    "  \"num_nextn_predict_layers\": 1,\n"
    "  \"pretraining_tp\": 1,\n"
    "  \"q_lora_rank\": 1536,\n"
    "  \"qk_nope_head_dim\": 128,\n"
    "  \"qk_rope_head_dim\": 64,\n"
    "  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\",\n"
    "                          \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]},\n"
    "  \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, \"mscale\": 1.0,\n"
    "                   \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096,\n"
    "                   \"type\": \"yarn\"},\n"
    "  \"rope_theta\": 10000,\n"
    "  \"routed_scaling_factor\": 2.5,\n"
    "  \"scoring_func\": \"sigmoid\",\n"
    "  \"seq_aux\": true,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"topk_group\": 4,\n"
    "  \"topk_method\": \"noaux_tc\",\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.33.1\",\n"
    "  \"use_cache\": true,\n"
    "  \"v_head_dim\": 128,\n"
    "  \"vocab_size\": 129280\n"
    "}\n";

static const char *KIMI_K2 =
    "{\n"
    "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"aux_loss_alpha\": 0.001,\n"
    "  \"bos_token_id\": 163584,\n"
    "  \"eos_token_id\": 163585,\n"
    "  \"first_k_dense_replace\": 1,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 7168,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 18432,\n"
    "  \"kv_lora_rank\": 512,\n"
    "  \"max_position_embeddings\": 131072,\n"
    "  \"model_type\": \"kimi_k2\",\n"
    "  \"moe_intermediate_size\": 2048,\n"
    "  \"moe_layer_freq\": 1,\n"
    "  \"n_group\": 1,\n"
    "  \"n_routed_experts\": 384,\n"
    "  \"n_shared_experts\": 1,\n"
    "  \"norm_topk_prob\": true,\n"
    "  \"num_attention_heads\": 64,\n"
    "  \"num_experts_per_tok\": 8,\n"
    "  \"num_hidden_layers\": 61,\n"
    "  \"num_key_value_heads\": 64,\n"
    "  \"num_nextn_predict_layers\": 0,\n"
    "  \"pretraining_tp\": 1,\n"
    "  \"q_lora_rank\": 1536,\n"
    "  \"qk_nope_head_dim\": 128,\n"
    "  \"qk_rope_head_dim\": 64,\n"
    "  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\",\n"
    "                          \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]},\n"
    "  \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_scaling\": {\"beta_fast\": 1.0, \"beta_slow\": 1.0, \"factor\": 32.0, \"mscale\": "
    "1.0,\n"
    "                   \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096,\n"
    "                   \"type\": \"yarn\"},\n"
    "  \"rope_theta\": 50000.0,\n"
    "  \"routed_scaling_factor\": 2.827,\n"
    "  \"scoring_func\": \"sigmoid\",\n"
    "  \"seq_aux\": true,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"topk_group\": 1,\n"
    "  \"topk_method\": \"noaux_tc\",\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"use_cache\": true,\n"
    "  \"v_head_dim\": 128,\n"
    "  \"vocab_size\": 163840\n"
    "}\n";

/* ---- helpers ---- */

static int parse(model_config_t *c, const char *json) {
    int rc = model_config_parse_json(c, json, "config.json");
    if (rc != MO_OK)
        tu_report("parse failed: %s", mo_last_error());
    return rc;
}

/* The base config with key set to the JSON value (NULL deletes the key).
 * Nested keys use "outer.inner". Caller frees. */
static char *mutate(const char *base, const char *key, const char *value) {
    cJSON *root = cJSON_Parse(base);
    CU_ASSERT_FATAL(root != NULL);
    cJSON *obj = root;
    char k[128];
    snprintf(k, sizeof k, "%s", key);
    char *dot = strchr(k, '.');
    if (dot) {
        *dot = '\0';
        obj = cJSON_GetObjectItemCaseSensitive(root, k);
        CU_ASSERT_FATAL(cJSON_IsObject(obj));
        memmove(k, dot + 1, strlen(dot + 1) + 1);
    }
    cJSON_DeleteItemFromObjectCaseSensitive(obj, k);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        CU_ASSERT_FATAL(v != NULL);
        cJSON_AddItemToObject(obj, k, v);
    }
    char *out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

static int err_has(const char *s) {
    int ok = strstr(mo_last_error(), s) != NULL;
    if (!ok)
        tu_report("expected '%s' in error: %s", s, mo_last_error());
    return ok;
}

/* Field-by-field equality, reporting the first difference. */
static int cfg_equal(const model_config_t *a, const model_config_t *b) {
#define SAME(f, differs)                                                                           \
    do {                                                                                           \
        if (differs) {                                                                             \
            tu_report("field %s differs", #f);                                                     \
            return 0;                                                                              \
        }                                                                                          \
    } while (0)
#define VAL(f) SAME(f, a->f != b->f)
#define MEM(f) SAME(f, memcmp(&a->f, &b->f, sizeof a->f) != 0)
    VAL(arch);
    MEM(model_type);
    VAL(vocab_size);
    VAL(hidden_size);
    VAL(intermediate_size);
    VAL(moe_intermediate_size);
    VAL(num_hidden_layers);
    VAL(num_attention_heads);
    VAL(num_key_value_heads);
    VAL(head_dim);
    VAL(num_experts);
    VAL(num_experts_per_tok);
    VAL(norm_topk_prob);
    VAL(decoder_sparse_step);
    MEM(mlp_only_layers);
    VAL(first_k_dense_replace);
    VAL(moe_layer_freq);
    VAL(n_shared_experts);
    VAL(routed_scaling_factor);
    VAL(scoring_func);
    VAL(topk_method);
    VAL(n_group);
    VAL(topk_group);
    VAL(rms_norm_eps);
    VAL(rope_theta);
    MEM(rope_scaling);
    VAL(rope_interleave);
    VAL(max_position_embeddings);
    VAL(tie_word_embeddings);
    VAL(sliding_window);
    VAL(use_sliding_window);
    VAL(max_window_layers);
    VAL(has_layer_types);
    MEM(layer_types_sliding);
    VAL(q_lora_rank);
    VAL(kv_lora_rank);
    VAL(qk_nope_head_dim);
    VAL(qk_rope_head_dim);
    VAL(v_head_dim);
    VAL(num_nextn_predict_layers);
    VAL(n_bos);
    VAL(n_eos);
    VAL(n_pad);
    MEM(bos_token_id);
    MEM(eos_token_id);
    MEM(pad_token_id);
    VAL(torch_dtype);
    VAL(router_aux_loss_coef);
    VAL(output_router_logits);
    VAL(fp8_block);
    return 1;
#undef MEM
#undef VAL
#undef SAME
}

/* ---- the four families ---- */

/* Published sizes: Qwen3-30B-A3B 30.5B / 3.3B, Mixtral-8x7B 46.7B / 12.9B,
 * DeepSeek-V3 671B / 37B (without the MTP layer), Kimi K2 1.04T / 32B. The
 * published figures are rounded: totals to 3 significant digits, active
 * counts to 2 (37.55B is "37B", 32.86B is "32B"). Tolerances: totals within
 * 1.5%, active counts within 3%. The exact values are the sums of every
 * tensor's size, worked out by hand from the published module layouts. */
#define TOL_TOTAL 0.015
#define TOL_ACTIVE 0.03

static void check_counts(const model_config_t *c, int64_t exact_total, int64_t exact_active,
                         double pub_total, double pub_active, const char *what) {
    int64_t t = -1, a = -1;
    model_config_param_counts(c, &t, &a);
    if (t != exact_total || a != exact_active)
        tu_report("%s: counts %lld / %lld, expected %lld / %lld", what, (long long)t, (long long)a,
                  (long long)exact_total, (long long)exact_active);
    CU_ASSERT(t == exact_total);
    CU_ASSERT(a == exact_active);
    TU_ASSERT_CLOSE(fabs((double)t - pub_total) / pub_total, TOL_TOTAL, what);
    TU_ASSERT_CLOSE(fabs((double)a - pub_active) / pub_active, TOL_ACTIVE, what);
}

static void test_qwen3(void) {
    model_config_t c;
    CU_ASSERT_FATAL(parse(&c, QWEN3_30B_A3B) == MO_OK);
    CU_ASSERT(c.arch == ARCH_QWEN3_MOE && strcmp(c.model_type, "qwen3_moe") == 0);
    CU_ASSERT(c.vocab_size == 151936 && c.hidden_size == 2048 && c.intermediate_size == 6144);
    CU_ASSERT(c.moe_intermediate_size == 768 && c.num_hidden_layers == 48);
    CU_ASSERT(c.num_attention_heads == 32 && c.num_key_value_heads == 4 && c.head_dim == 128);
    CU_ASSERT(c.num_experts == 128 && c.num_experts_per_tok == 8 && c.norm_topk_prob == 1);
    CU_ASSERT(c.scoring_func == SCORE_SOFTMAX && c.topk_method == TOPK_GREEDY);
    CU_ASSERT(c.n_shared_experts == 0 && c.routed_scaling_factor == 1.0);
    CU_ASSERT(c.rms_norm_eps == 1e-6 && c.rope_theta == 1e6);
    CU_ASSERT(c.rope_scaling.type == ROPE_DEFAULT && c.max_position_embeddings == 40960);
    CU_ASSERT(c.tie_word_embeddings == 0 && c.sliding_window == 0 && c.use_sliding_window == 0);
    CU_ASSERT(c.n_bos == 1 && c.bos_token_id[0] == 151643);
    CU_ASSERT(c.n_eos == 1 && c.eos_token_id[0] == 151645 && c.n_pad == 0);
    CU_ASSERT(c.torch_dtype == DT_BF16 && c.router_aux_loss_coef == 0.001);
    CU_ASSERT(c.fp8_block == 0 && c.q_lora_rank == 0);
    for (int l = 0; l < 48; l++) {
        CU_ASSERT(model_config_is_moe_layer(&c, l) == 1);
        CU_ASSERT(model_config_window(&c, l) == 0);
    }
    CU_ASSERT(model_config_is_moe_layer(&c, 48) == 0 && model_config_is_moe_layer(&c, -1) == 0);
    check_counts(&c, 30532122624LL, 3353032704LL, 30.5e9, 3.3e9, "Qwen3-30B-A3B");
}

static void test_mixtral(void) {
    model_config_t c;
    CU_ASSERT_FATAL(parse(&c, MIXTRAL_8X7B) == MO_OK);
    CU_ASSERT(c.arch == ARCH_MIXTRAL && c.head_dim == 128);
    CU_ASSERT(c.intermediate_size == 14336 && c.moe_intermediate_size == 14336);
    CU_ASSERT(c.num_experts == 8 && c.num_experts_per_tok == 2 && c.norm_topk_prob == 1);
    CU_ASSERT(c.num_key_value_heads == 8 && c.rms_norm_eps == 1e-5);
    CU_ASSERT(c.router_aux_loss_coef == 0.02 && c.max_position_embeddings == 32768);
    CU_ASSERT(model_config_window(&c, 5) == 0);
    for (int l = 0; l < 32; l++)
        CU_ASSERT(model_config_is_moe_layer(&c, l));
    check_counts(&c, 46702792704LL, 12879925248LL, 46.7e9, 12.9e9, "Mixtral-8x7B");

    /* A set sliding_window windows every layer. */
    char *s = mutate(MIXTRAL_8X7B, "sliding_window", "4096");
    CU_ASSERT_FATAL(parse(&c, s) == MO_OK);
    for (int l = 0; l < 32; l++)
        CU_ASSERT(model_config_window(&c, l) == 4096);
    free(s);
}

static void test_deepseek_v3(void) {
    model_config_t c;
    CU_ASSERT_FATAL(parse(&c, DEEPSEEK_V3) == MO_OK);
    CU_ASSERT(c.arch == ARCH_DEEPSEEK_V3 && strcmp(c.model_type, "deepseek_v3") == 0);
    CU_ASSERT(c.q_lora_rank == 1536 && c.kv_lora_rank == 512 && c.qk_nope_head_dim == 128);
    CU_ASSERT(c.qk_rope_head_dim == 64 && c.v_head_dim == 128 && c.head_dim == 192);
    CU_ASSERT(c.num_experts == 256 && c.num_experts_per_tok == 8 && c.n_shared_experts == 1);
    CU_ASSERT(c.moe_intermediate_size == 2048 && c.intermediate_size == 18432);
    CU_ASSERT(c.first_k_dense_replace == 3 && c.moe_layer_freq == 1);
    CU_ASSERT(c.scoring_func == SCORE_SIGMOID && c.topk_method == TOPK_NOAUX_TC);
    CU_ASSERT(c.n_group == 8 && c.topk_group == 4 && c.routed_scaling_factor == 2.5);
    CU_ASSERT(c.norm_topk_prob == 1 && c.rope_interleave == 1 && c.num_nextn_predict_layers == 1);
    CU_ASSERT(c.fp8_block == 128 && c.router_aux_loss_coef == 0.001);
    const rope_scaling_t *r = &c.rope_scaling;
    CU_ASSERT(r->type == ROPE_YARN && r->factor == 40.0f && r->original_max_position == 4096);
    CU_ASSERT(r->beta_fast == 32.0f && r->beta_slow == 1.0f && r->mscale == 1.0f);
    CU_ASSERT(r->mscale_all_dim == 1.0f && r->attention_factor == 0.0f);
    CU_ASSERT(c.n_bos == 1 && c.bos_token_id[0] == 0 && c.eos_token_id[0] == 1);
    for (int l = 0; l < 61; l++)
        CU_ASSERT(model_config_is_moe_layer(&c, l) == (l >= 3));
    check_counts(&c, 671026419200LL, 37552297472LL, 671e9, 37e9, "DeepSeek-V3");

    /* moe_layer_freq 2: MoE on even layers from first_k_dense_replace on. */
    char *s = mutate(DEEPSEEK_V3, "moe_layer_freq", "2");
    CU_ASSERT_FATAL(parse(&c, s) == MO_OK);
    for (int l = 0; l < 61; l++)
        CU_ASSERT(model_config_is_moe_layer(&c, l) == (l >= 3 && l % 2 == 0));
    free(s);
    /* q_lora_rank null: a plain q_proj, D * H * (nope + rope) parameters per layer. */
    s = mutate(DEEPSEEK_V3, "q_lora_rank", "null");
    CU_ASSERT_FATAL(parse(&c, s) == MO_OK);
    CU_ASSERT(c.q_lora_rank == 0);
    int64_t t, a;
    model_config_param_counts(&c, &t, &a);
    int64_t dq = 7168LL * 128 * 192 - (7168LL * 1536 + 1536 + 1536LL * 128 * 192);
    CU_ASSERT(t == 671026419200LL + 61 * dq && a == 37552297472LL + 61 * dq);
    free(s);
    /* n_shared_experts null means none; absent means the default of 1. */
    s = mutate(DEEPSEEK_V3, "n_shared_experts", "null");
    CU_ASSERT_FATAL(parse(&c, s) == MO_OK);
    CU_ASSERT(c.n_shared_experts == 0);
    free(s);
    s = mutate(DEEPSEEK_V3, "n_shared_experts", NULL);
    CU_ASSERT_FATAL(parse(&c, s) == MO_OK);
    CU_ASSERT(c.n_shared_experts == 1);
    free(s);
}

static void test_kimi_k2(void) {
    model_config_t c;
    CU_ASSERT_FATAL(parse(&c, KIMI_K2) == MO_OK);
    CU_ASSERT(c.arch == ARCH_DEEPSEEK_V3 && strcmp(c.model_type, "kimi_k2") == 0);
    CU_ASSERT(c.num_experts == 384 && c.num_attention_heads == 64 && c.vocab_size == 163840);
    CU_ASSERT(c.n_group == 1 && c.topk_group == 1 && c.first_k_dense_replace == 1);
    CU_ASSERT(c.routed_scaling_factor == 2.827 && c.rope_theta == 50000.0);
    CU_ASSERT(c.rope_scaling.beta_fast == 1.0f && c.rope_scaling.factor == 32.0f);
    CU_ASSERT(c.bos_token_id[0] == 163584 && c.eos_token_id[0] == 163585);
    CU_ASSERT(!model_config_is_moe_layer(&c, 0) && model_config_is_moe_layer(&c, 1));
    check_counts(&c, 1026408232448LL, 32861500928LL, 1.04e12, 32e9, "Kimi K2");
}

/* ---- Qwen3 layer rules and optional fields ---- */

static void test_qwen3_layers(void) {
    model_config_t c;
    char *s1 = mutate(QWEN3_30B_A3B, "mlp_only_layers", "[0, 5]");
    char *s2 = mutate(s1, "decoder_sparse_step", "2");
    CU_ASSERT_FATAL(parse(&c, s2) == MO_OK);
    for (int l = 0; l < 48; l++)
        CU_ASSERT(model_config_is_moe_layer(&c, l) == (l != 0 && l != 5 && (l + 1) % 2 == 0));
    /* Dense layers count intermediate_size: 24 odd layers are MoE, less layer 5. */
    int64_t t, a;
    model_config_param_counts(&c, &t, &a);
    int64_t moe = 128LL * 2048 + 128LL * 3 * 2048 * 768, dense = 3LL * 2048 * 6144;
    CU_ASSERT(t == 30532122624LL - 25 * (moe - dense));
    free(s1);
    free(s2);

    /* Sliding window only with use_sliding_window, from max_window_layers on. */
    s1 = mutate(QWEN3_30B_A3B, "sliding_window", "4096");
    CU_ASSERT_FATAL(parse(&c, s1) == MO_OK);
    CU_ASSERT(model_config_window(&c, 47) == 0); /* use_sliding_window is false */
    s2 = mutate(s1, "use_sliding_window", "true");
    char *s3 = mutate(s2, "max_window_layers", "40");
    CU_ASSERT_FATAL(parse(&c, s3) == MO_OK);
    CU_ASSERT(model_config_window(&c, 39) == 0 && model_config_window(&c, 40) == 4096);
    free(s1);
    free(s2);
    /* layer_types, when given, decides which layers slide. */
    char types[48 * 24] = "[";
    for (int l = 0; l < 48; l++)
        strcat(types, l % 3 == 2 ? "\"sliding_attention\"," : "\"full_attention\",");
    types[strlen(types) - 1] = ']';
    s1 = mutate(s3, "layer_types", types);
    CU_ASSERT_FATAL(parse(&c, s1) == MO_OK);
    CU_ASSERT(c.has_layer_types == 1);
    for (int l = 0; l < 48; l++)
        CU_ASSERT(model_config_window(&c, l) == (l % 3 == 2 ? 4096 : 0));
    free(s1);
    free(s3);
}

static void test_optional_fields(void) {
    model_config_t c;
    /* eos as a list, pad set, tied embeddings, float16, head_dim derived. */
    char *s1 = mutate(QWEN3_30B_A3B, "eos_token_id", "[151645, 151643]");
    char *s2 = mutate(s1, "pad_token_id", "151643");
    char *s3 = mutate(s2, "tie_word_embeddings", "true");
    char *s4 = mutate(s3, "torch_dtype", "\"float16\"");
    char *s5 = mutate(s4, "head_dim", NULL);
    CU_ASSERT_FATAL(parse(&c, s5) == MO_OK);
    CU_ASSERT(c.n_eos == 2 && c.eos_token_id[0] == 151645 && c.eos_token_id[1] == 151643);
    CU_ASSERT(c.n_pad == 1 && c.pad_token_id[0] == 151643);
    CU_ASSERT(c.tie_word_embeddings == 1 && c.torch_dtype == DT_F16 && c.head_dim == 64);
    free(s1), free(s2), free(s3), free(s4), free(s5);

    /* rope scaling types, with "rope_type" or "type". */
    s1 = mutate(QWEN3_30B_A3B, "rope_scaling",
                "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                "\"original_max_position_embeddings\": 32768}");
    CU_ASSERT_FATAL(parse(&c, s1) == MO_OK);
    CU_ASSERT(c.rope_scaling.type == ROPE_YARN && c.rope_scaling.factor == 4.0f);
    CU_ASSERT(c.rope_scaling.original_max_position == 32768);
    CU_ASSERT(c.rope_scaling.beta_fast == 32.0f && c.rope_scaling.beta_slow == 1.0f);
    free(s1);
    s1 = mutate(QWEN3_30B_A3B, "rope_scaling",
                "{\"type\": \"llama3\", \"rope_type\": \"llama3\", \"factor\": 8.0, "
                "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                "\"original_max_position_embeddings\": 8192}");
    CU_ASSERT_FATAL(parse(&c, s1) == MO_OK);
    CU_ASSERT(c.rope_scaling.type == ROPE_LLAMA3 && c.rope_scaling.low_freq_factor == 1.0f);
    CU_ASSERT(c.rope_scaling.high_freq_factor == 4.0f);
    free(s1);
    s1 = mutate(QWEN3_30B_A3B, "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.5}");
    CU_ASSERT_FATAL(parse(&c, s1) == MO_OK);
    CU_ASSERT(c.rope_scaling.type == ROPE_LINEAR && c.rope_scaling.factor == 2.5f);
    free(s1);
    /* The newer "rope_parameters" form carries rope_theta too. */
    s1 = mutate(QWEN3_30B_A3B, "rope_scaling", NULL);
    s2 = mutate(s1, "rope_theta", NULL);
    s3 = mutate(s2, "rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 500000.0}");
    CU_ASSERT_FATAL(parse(&c, s3) == MO_OK);
    CU_ASSERT(c.rope_scaling.type == ROPE_DEFAULT && c.rope_theta == 500000.0);
    free(s1), free(s2), free(s3);
    /* "dtype" replaces "torch_dtype" in newer files; architectures may be absent. */
    s1 = mutate(MIXTRAL_8X7B, "torch_dtype", NULL);
    s2 = mutate(s1, "dtype", "\"float32\"");
    s3 = mutate(s2, "architectures", NULL);
    CU_ASSERT_FATAL(parse(&c, s3) == MO_OK);
    CU_ASSERT(c.arch == ARCH_MIXTRAL && c.torch_dtype == DT_F32);
    free(s1), free(s2), free(s3);
}

/* ---- errors ---- */

typedef struct {
    const char *const *base;
    const char *key;   /* NULL: value is the whole text */
    const char *value; /* NULL: delete key */
    const char *expect;
} err_case_t;

static const err_case_t g_errs[] = {
    {NULL, NULL, "{\"a\": ", "bad/config.json: not valid JSON"},
    {NULL, NULL, "[1]", "bad/config.json: not a JSON object"},
    {&QWEN3_30B_A3B, "architectures", "[\"LlamaForCausalLM\"]",
     "field \"architectures\": 'LlamaForCausalLM' is not supported (supported: "
     "Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM)"},
    {&QWEN3_30B_A3B, "architectures", "[\"Qwen2MoeForCausalLM\"]",
     "Qwen2MoeForCausalLM is not supported (its q/k/v projections carry biases"},
    {&QWEN3_30B_A3B, "architectures", "\"Qwen3MoeForCausalLM\"",
     "field \"architectures\" is the string \"Qwen3MoeForCausalLM\", expected a list of one "
     "architecture name"},
    {&QWEN3_30B_A3B, "model_type", "\"mixtral\"",
     "field \"model_type\" 'mixtral' does not match architecture Qwen3MoeForCausalLM"},
    {&QWEN3_30B_A3B, "hidden_size", NULL,
     "missing required field \"hidden_size\" (expected an integer in [1, 1048576])"},
    {&QWEN3_30B_A3B, "hidden_size", "\"2048\"",
     "field \"hidden_size\" is the string \"2048\", expected an integer in [1, 1048576]"},
    {&QWEN3_30B_A3B, "hidden_size", "2048.5", "field \"hidden_size\" is 2048.5, expected"},
    {&QWEN3_30B_A3B, "vocab_size", "0", "field \"vocab_size\" is 0, expected an integer in [1, "},
    {&QWEN3_30B_A3B, "num_experts", NULL, "missing required field \"num_experts\""},
    {&QWEN3_30B_A3B, "num_experts_per_tok", "200",
     "num_experts_per_tok 200 is out of range, expected 1..128"},
    {&QWEN3_30B_A3B, "num_key_value_heads", "5",
     "num_attention_heads 32 is not a multiple of num_key_value_heads 5"},
    {&QWEN3_30B_A3B, "attention_bias", "true",
     "field \"attention_bias\" is true, expected false (biased attention projections"},
    {&QWEN3_30B_A3B, "attention_bias", "1",
     "field \"attention_bias\" is 1, expected true or false"},
    {&QWEN3_30B_A3B, "hidden_act", "\"gelu\"",
     "field \"hidden_act\" is the string \"gelu\", expected one of \"silu\""},
    {&QWEN3_30B_A3B, "attention_dropout", "0.1", "field \"attention_dropout\" is 0.1"},
    {&QWEN3_30B_A3B, "mlp_bias", "true", "field \"mlp_bias\" is true, expected false"},
    {&QWEN3_30B_A3B, "rope_theta", "0", "field \"rope_theta\" is 0, expected a number in (1, "},
    {&QWEN3_30B_A3B, "rms_norm_eps", "-1", "field \"rms_norm_eps\" is -1, expected a number in (0"},
    {&QWEN3_30B_A3B, "rope_scaling", "{\"type\": \"dynamic\", \"factor\": 2.0}",
     "field \"rope_scaling.type\": rope scaling type 'dynamic' is not supported (supported: "
     "default, linear, llama3, yarn)"},
    {&QWEN3_30B_A3B, "rope_scaling", "{\"factor\": 2.0}",
     "missing required field \"rope_scaling.rope_type\""},
    {&QWEN3_30B_A3B, "rope_scaling", "{\"rope_type\": \"yarn\"}",
     "missing required field \"rope_scaling.factor\" (expected a number in (0, "},
    {&QWEN3_30B_A3B, "rope_scaling",
     "{\"rope_type\": \"linear\", \"factor\": 2.0, \"low_freq_factor\": 1.0}",
     "field \"rope_scaling.low_freq_factor\" is not supported for rope type 'linear'"},
    {&QWEN3_30B_A3B, "rope_scaling",
     "{\"type\": \"yarn\", \"rope_type\": \"linear\", \"factor\": 2.0}",
     "\"rope_scaling.type\" ('yarn') and \"rope_scaling.rope_type\" ('linear') disagree"},
    {&QWEN3_30B_A3B, "rope_scaling",
     "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4.0, "
     "\"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}",
     "low_freq_factor (4) must be below high_freq_factor (1)"},
    {&QWEN3_30B_A3B, "rope_scaling",
     "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
     "\"high_freq_factor\": 4.0}",
     "missing required field \"rope_scaling.original_max_position_embeddings\""},
    {&QWEN3_30B_A3B, "rope_scaling", "[1]",
     "field \"rope_scaling\" is an array, expected an "
     "object or null"},
    {&DEEPSEEK_V3, "rope_parameters", "{\"rope_type\": \"default\"}",
     "both \"rope_scaling\" and \"rope_parameters\" are set"},
    {&QWEN3_30B_A3B, "mlp_only_layers", "[48]",
     "field \"mlp_only_layers\" holds 48, expected a list of distinct layer indices in [0, 48)"},
    {&QWEN3_30B_A3B, "mlp_only_layers", "[3, 3]", "field \"mlp_only_layers\" holds 3"},
    {&QWEN3_30B_A3B, "use_sliding_window", "true",
     "use_sliding_window is true but sliding_window is not set"},
    {&QWEN3_30B_A3B, "layer_types", "[\"full_attention\"]",
     "field \"layer_types\" is an array, expected a list of 48"},
    {&QWEN3_30B_A3B, "decoder_sparse_step", "0", "field \"decoder_sparse_step\" is 0"},
    {&QWEN3_30B_A3B, "eos_token_id", "999999999",
     "field \"eos_token_id\" is 999999999, expected null, an integer in [0, 151936)"},
    {&QWEN3_30B_A3B, "eos_token_id", "[1, \"x\"]", "field \"eos_token_id\" holds the string \"x\""},
    {&QWEN3_30B_A3B, "torch_dtype", "\"float8\"",
     "field \"torch_dtype\" is the string \"float8\", expected one of \"bfloat16\", "
     "\"float16\", \"float32\""},
    {&QWEN3_30B_A3B, "dtype", "\"float32\"",
     "\"torch_dtype\" ('bfloat16') and \"dtype\" ('float32') disagree"},
    {&QWEN3_30B_A3B, "quantization_config", "{\"quant_method\": \"awq\", \"bits\": 4}",
     "field \"quantization_config.bits\" is not supported"},
    {&QWEN3_30B_A3B, "quantization_config", "{\"quant_method\": \"awq\"}",
     "field \"quantization_config.quant_method\" is the string \"awq\", expected one of \"fp8\""},
    {&QWEN3_30B_A3B, "quantization_config",
     "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 64]}",
     "field \"quantization_config.weight_block_size\" is an array, expected [b, b]"},
    {&QWEN3_30B_A3B, "quantization_config",
     "{\"quant_method\": \"fp8\", \"activation_scheme\": \"static\", "
     "\"weight_block_size\": [128, 128]}",
     "field \"quantization_config.activation_scheme\" is the string \"static\""},
    {&QWEN3_30B_A3B, "pretraining_tp", "2", "field \"pretraining_tp\" is 2, expected 1"},
    {&MIXTRAL_8X7B, "num_local_experts", NULL, "missing required field \"num_local_experts\""},
    {&MIXTRAL_8X7B, "router_jitter_noise", "0.01", "field \"router_jitter_noise\" is 0.01"},
    {&MIXTRAL_8X7B, "num_attention_heads", "24",
     "hidden_size 4096 is not a multiple of num_attention_heads 24 and \"head_dim\" is absent"},
    {&DEEPSEEK_V3, "q_lora_rank", NULL, "missing required field \"q_lora_rank\""},
    {&DEEPSEEK_V3, "kv_lora_rank", "-1", "field \"kv_lora_rank\" is -1, expected an integer"},
    {&DEEPSEEK_V3, "scoring_func", "\"softmax\"",
     "scoring_func \"softmax\" with topk_method \"noaux_tc\" is not supported"},
    {&DEEPSEEK_V3, "topk_method", "\"random\"",
     "field \"topk_method\" is the string \"random\", expected one of \"greedy\", "
     "\"group_limited_greedy\", \"noaux_tc\""},
    {&DEEPSEEK_V3, "n_group", "7", "n_group 7 does not divide the 256 experts"},
    {&DEEPSEEK_V3, "topk_group", "9", "topk_group 9 is out of range, expected 1..8 (n_group)"},
    {&DEEPSEEK_V3, "num_key_value_heads", "8",
     "field \"num_key_value_heads\" is 8, expected 128 (num_attention_heads; MLA"},
    {&DEEPSEEK_V3, "head_dim", "100",
     "field \"head_dim\" is 100, expected 64 (qk_rope_head_dim) or 192"},
    {&DEEPSEEK_V3, "qk_rope_head_dim", "63",
     "the rotary dimension 63 (qk_rope_head_dim) must be "
     "even"},
    {&DEEPSEEK_V3, "sliding_window", "4096", "field \"sliding_window\" is 4096, expected null"},
    {&DEEPSEEK_V3, "first_k_dense_replace", "62",
     "first_k_dense_replace 62 is out of range, expected 0..61"},
    {&DEEPSEEK_V3, "rope_scaling.type", "\"ntk\"", "rope scaling type 'ntk' is not supported"},
    {&DEEPSEEK_V3, "rope_scaling.beta_fast", "0.5",
     "beta_fast (0.5) must not be below beta_slow (1)"},
    {&DEEPSEEK_V3, "num_experts_per_tok", "200",
     "num_experts_per_tok 200 exceeds the 128 experts of the topk_group 4 groups kept"},
};

static void test_errors(void) {
    int n = (int)(sizeof g_errs / sizeof g_errs[0]);
    for (int i = 0; i < n; i++) {
        const err_case_t *e = &g_errs[i];
        char *text = e->base ? mutate(*e->base, e->key, e->value) : NULL;
        model_config_t c;
        mo_clear_error();
        int rc = model_config_parse_json(&c, text ? text : e->value, "bad/config.json");
        if (rc != MO_ECONFIG)
            tu_report("error case %d (%s): rc %d", i, e->key ? e->key : "text", rc);
        CU_ASSERT(rc == MO_ECONFIG);
        CU_ASSERT(err_has(e->expect));
        CU_ASSERT(err_has("bad/config.json"));
        free(text);
    }
}

/* ---- files ---- */

static void test_load_and_roundtrip(void) {
    const char *bases[4] = {QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, KIMI_K2};
    /* Extra variants that exercise the optional fields on the way back. */
    char *v1a = mutate(QWEN3_30B_A3B, "sliding_window", "4096");
    char *v1b = mutate(v1a, "use_sliding_window", "true");
    char *v1c = mutate(v1b, "eos_token_id", "[151645, 151643]");
    char *v1d = mutate(v1c, "mlp_only_layers", "[0, 47]");
    char *v1 = mutate(v1d, "rope_scaling",
                      "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"attention_factor\": 0.1}");
    char *v2 = mutate(MIXTRAL_8X7B, "rope_scaling",
                      "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                      "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}");
    char *v3 = mutate(DEEPSEEK_V3, "q_lora_rank", "null");
    const char *all[7] = {bases[0], bases[1], bases[2], bases[3], v1, v2, v3};
    for (int i = 0; i < 7; i++) {
        char dir[600], path[700];
        snprintf(dir, sizeof dir, "%s/m%d", g_dir, i);
        CU_ASSERT_FATAL(mkdir(dir, 0755) == 0);
        snprintf(path, sizeof path, "%s/config.json", dir);
        model_config_t a, b, d;
        CU_ASSERT_FATAL(parse(&a, all[i]) == MO_OK);
        CU_ASSERT_FATAL(model_config_write_json(&a, path) == MO_OK);
        CU_ASSERT_FATAL(model_config_load(&b, dir) == MO_OK); /* the directory */
        CU_ASSERT(cfg_equal(&a, &b));
        CU_ASSERT_FATAL(model_config_load(&d, path) == MO_OK); /* the file itself */
        CU_ASSERT(cfg_equal(&a, &d));
        /* Writing what was read gives the same bytes. */
        char path2[700];
        snprintf(path2, sizeof path2, "%s/again.json", dir);
        CU_ASSERT_FATAL(model_config_write_json(&b, path2) == MO_OK);
        FILE *f1 = fopen(path, "rb"), *f2 = fopen(path2, "rb");
        char b1[8192], b2[8192];
        size_t n1 = fread(b1, 1, sizeof b1, f1), n2 = fread(b2, 1, sizeof b2, f2);
        fclose(f1);
        fclose(f2);
        CU_ASSERT(n1 == n2 && n1 < sizeof b1 && memcmp(b1, b2, n1) == 0);
    }
    /* The written file is laid out like the family's: a few spot checks. */
    char path[700];
    snprintf(path, sizeof path, "%s/m2/config.json", g_dir);
    FILE *f = fopen(path, "rb");
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    CU_ASSERT(strstr(text, "\"n_routed_experts\":\t256") != NULL);
    CU_ASSERT(strstr(text, "\"rms_norm_eps\":\t1e-06") != NULL);
    CU_ASSERT(strstr(text, "\"rope_theta\":\t10000.0") != NULL);
    CU_ASSERT(strstr(text, "\"weight_block_size\":\t[128, 128]") != NULL);
    free(v1a), free(v1b), free(v1c), free(v1d), free(v1), free(v2), free(v3);
}

static void test_file_errors(void) {
    model_config_t c;
    char path[700];
    snprintf(path, sizeof path, "%s/nothing", g_dir);
    CU_ASSERT(model_config_load(&c, path) == MO_EIO);
    CU_ASSERT(err_has("nothing"));
    snprintf(path, sizeof path, "%s/emptydir", g_dir);
    CU_ASSERT_FATAL(mkdir(path, 0755) == 0);
    CU_ASSERT(model_config_load(&c, path) == MO_EIO);
    CU_ASSERT(err_has("emptydir/config.json: cannot open"));
    /* A bad config is refused before anything is written. */
    CU_ASSERT_FATAL(parse(&c, MIXTRAL_8X7B) == MO_OK);
    c.num_experts_per_tok = 9;
    snprintf(path, sizeof path, "%s/emptydir/config.json", g_dir);
    CU_ASSERT(model_config_write_json(&c, path) == MO_ECONFIG);
    CU_ASSERT(err_has("num_experts_per_tok 9 is out of range, expected 1..8"));
    struct stat sb;
    CU_ASSERT(stat(path, &sb) != 0);
    CU_ASSERT_FATAL(parse(&c, MIXTRAL_8X7B) == MO_OK);
    c.n_shared_experts = 1;
    CU_ASSERT(model_config_validate(&c, "code") == MO_ECONFIG);
    CU_ASSERT(err_has("shared experts belong to DeepseekV3ForCausalLM"));
    CU_ASSERT(strcmp(model_arch_name(ARCH_MIXTRAL), "MixtralForCausalLM") == 0);
}

int main(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0)
        return 2;
    CU_TestInfo tests[] = {
        {"Qwen3-30B-A3B", test_qwen3},
        {"Mixtral-8x7B", test_mixtral},
        {"DeepSeek-V3", test_deepseek_v3},
        {"Kimi K2", test_kimi_k2},
        {"Qwen3 layer rules", test_qwen3_layers},
        {"optional fields", test_optional_fields},
        {"errors name file and field", test_errors},
        {"write and load round trip", test_load_and_roundtrip},
        {"file errors", test_file_errors},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("model_config", tests);
    tu_rmtree(g_dir);
    return rc;
}
