/* peft: saving and loading adapters in the Hugging Face PEFT layout. */
#ifndef MOERL_LORA_PEFT_H
#define MOERL_LORA_PEFT_H

#include "core/dtype.h"
#include "lora/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An adapter directory holds two files:
 *
 * adapter_config.json: {"peft_type": "LORA", "task_type": "CAUSAL_LM",
 *   "r", "lora_alpha", "lora_dropout": 0.0, "use_rslora", "bias": "none",
 *   "target_modules": [suffixes from lora_adapter_suffixes],
 *   "base_model_name_or_path", "inference_mode": true,
 *   "fan_in_fan_out": false, "init_lora_weights": true, ...}
 *
 * adapter_model.safetensors: for every adapted module M (e.g.
 *   "model.layers.3.mlp.experts.17.gate_proj")
 *     base_model.model.M.lora_A.weight  (R, C)
 *     base_model.model.M.lora_B.weight  (OC, R)
 *   in the adapter's table order, F32 (or BF16/F16 on request). The
 *   __metadata__ map holds "format": "pt" and moerl's own fields, which PEFT
 *   ignores: "moerl.format" ("1"), "moerl.r", "moerl.alpha", "moerl.rslora"
 *   (copies of the config, to catch a directory whose two files do not
 *   belong together), "moerl.targets" (the target words, comma-separated),
 *   "moerl.seed", and "moerl.checksum": lora_adapter_checksum of the values
 *   as stored (after rounding to the file dtype), 16 hex digits. */

#define PEFT_CONFIG_NAME "adapter_config.json"
#define PEFT_WEIGHTS_NAME "adapter_model.safetensors"
#define PEFT_KEY_PREFIX "base_model.model."

typedef struct peft_save_opts {
    dtype_t dtype;          /* DT_F32, DT_BF16 or DT_F16 */
    const char *base_model; /* base_model_name_or_path; NULL writes null */
} peft_save_opts_t;

/* Writes the adapter to directory dir (opts NULL: F32, no base model name).
 * When dir does not exist, both files are written and fsynced in a sibling
 * "<dir>.tmp.<pid>" directory that is then renamed to dir: the directory
 * appears complete or not at all. When dir exists, each file is replaced
 * atomically (temporary file, fsync, rename, fsync of dir), weights first;
 * a crash between the two leaves a pair that the loader rejects if r, alpha
 * or rsLoRA changed. The parent of dir must exist. */
int peft_save(const lora_adapter_t *ad, const char *dir, const peft_save_opts_t *opts);

/* adapter_config.json as read. */
typedef struct peft_config {
    int r;
    float alpha;
    int rslora;
    float dropout;         /* read but not applied: moerl trains without dropout */
    char *base_model;      /* NULL when null or absent */
    char **target_modules; /* (n_target_modules) */
    int n_target_modules;
} peft_config_t;

/* Reads and validates dir/adapter_config.json. MO_EIO when it cannot be
 * read, MO_EMALFORMED for bad JSON or a field of the wrong type or range,
 * MO_EUNSUPPORTED for valid PEFT features moerl does not apply (bias other
 * than "none", fan_in_fan_out, use_dora, rank_pattern or alpha_pattern,
 * layers_to_transform, modules_to_save, a regex target_modules, a
 * peft_type other than "LORA"). Messages name the file and the field. */
int peft_read_config(const char *dir, peft_config_t *cfg);
void peft_config_free(peft_config_t *cfg);

/* Loads dir into an existing adapter. The file's r, lora_alpha and
 * use_rslora must equal the adapter's (MO_ECONFIG otherwise); the weights
 * must hold exactly the adapter's keys (MO_EMALFORMED naming the file and the
 * first missing or unexpected key, or a key with the wrong shape or a
 * non-float dtype); F32, BF16 and F16 are read. When the file carries
 * moerl.checksum and lists its tensors in the adapter's table order, the
 * loaded values must hash to it (MO_EMALFORMED otherwise). Nothing in the
 * adapter changes unless the whole load succeeds. Gradients are untouched. */
int peft_load(lora_adapter_t *ad, const char *dir);

/* Builds a new adapter from dir for the modules mods describes: rank,
 * alpha and rsLoRA from the config, the modules by PEFT's suffix rule on
 * target_modules (lora_select_suffixes), then loads it as peft_load does.
 * Works on adapters written by PEFT as well. no_grads as in lora_config_t. */
int peft_load_new(lora_adapter_t **out, const char *dir, const lora_module_desc_t *mods, int n_mods,
                  int no_grads);

#ifdef __cplusplus
}
#endif
#endif
