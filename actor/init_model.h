/* init_model: randomly initialised Hugging Face model directories (config.json,
 * model.safetensors, the byte-level tokenizer) of the supported families. */
#ifndef MOERL_ACTOR_INIT_MODEL_H
#define MOERL_ACTOR_INIT_MODEL_H

#include <stdint.h>

#include "actor/model_config.h"
#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Presets (V = TOK_BYTELEVEL_VOCAB = 261 in both):
 *   tiny:  L 2, D 64, H 4, Hkv 2, Dh 16, E 8, K 2, F 32, dense F 128
 *   small: L 8, D 512, H 8, Hkv 4, Dh 64, E 16, K 2, F 256, dense F 1024
 * deepseek_v3 adds MLA (tiny: q_lora_rank 32, kv_lora_rank 32, qk_nope 16, qk_rope 8,
 * v_head 16; small: 192, 128, 64, 32, 64), one shared expert, one leading dense layer,
 * sigmoid routing with a correction bias (noaux_tc) and routed_scaling_factor 2.5. */
typedef enum { INIT_SIZE_TINY = 0, INIT_SIZE_SMALL, INIT_SIZE_COUNT } init_size_t;

/* "qwen3_moe", "mixtral", "deepseek_v3"; MO_EINVAL naming the choices otherwise. */
int init_model_arch_from_name(const char *name, model_arch_t *out);
/* "tiny", "small". */
int init_model_size_from_name(const char *name, init_size_t *out);

/* Fills c with a preset; torch_dtype = dtype (DT_BF16, DT_F16 or DT_F32). The result
 * passes model_config_validate. */
int init_model_config(model_config_t *c, model_arch_t arch, init_size_t size, dtype_t dtype);

typedef struct init_model_opts {
    uint64_t seed; /* Philox seed; each tensor draws from a stream named by its name */
    float std;     /* matrices ~ normal(0, std); 0 means 0.02 (initializer_range) */
} init_model_opts_t;

/* Writes the weights of config c to one safetensors file at path: matrices
 * normal(0, std) and norm weights 1 in c->torch_dtype, DeepSeek's
 * e_score_correction_bias 0 in F32. Hugging Face tensor names; Mixtral experts as
 * w1 / w2 / w3; DeepSeek attention as MLA (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
 * kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). Same inputs, same bytes. */
int init_model_write_weights(const char *path, const model_config_t *c, const init_model_opts_t *o);

/* Creates dir when missing (not its parents) and writes dir/config.json
 * (model_config_write_json), dir/model.safetensors and the byte-level tokenizer. */
int init_model_write(const char *dir, const model_config_t *c, const init_model_opts_t *o);

#ifdef __cplusplus
}
#endif
#endif
