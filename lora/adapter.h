/* adapter: the set of LoRA-adapted projections of a model, with their
 * parameters and gradients in one flat f32 buffer each. */
#ifndef MOERL_LORA_ADAPTER_H
#define MOERL_LORA_ADAPTER_H

#include <stddef.h>
#include <stdint.h>

#include "lora/lora.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What part of the model a projection belongs to. */
typedef enum {
    LORA_KIND_ATTENTION = 0, /* self-attention projections */
    LORA_KIND_EXPERT,        /* a routed expert's projection */
    LORA_KIND_SHARED_EXPERT, /* a shared (always active) expert's projection */
    LORA_KIND_DENSE_MLP,     /* the MLP of a dense (non-MoE) layer */
    LORA_KIND_COUNT
} lora_kind_t;

/* "attention", "experts", "shared_experts", "dense_mlp": the scope word of a kind. */
const char *lora_kind_word(lora_kind_t kind);

/* One projection the model offers for adaptation, W (OC, C). The model
 * passes a list of these; the adapter knows nothing else about the model. */
typedef struct lora_module_desc {
    const char *name; /* Hugging Face module path, no prefix:
                         "model.layers.3.self_attn.q_proj",
                         "model.layers.3.mlp.experts.17.gate_proj",
                         "model.layers.3.mlp.shared_experts.up_proj",
                         "model.layers.0.mlp.gate_proj" */
    const char *proj; /* projection name: "q_proj", "gate_proj", "w1", ... */
    lora_kind_t kind;
    int C;  /* in features */
    int OC; /* out features */
} lora_module_desc_t;

/* Target lists.
 *
 * A target list is a list of words. Four words are scope words, one per
 * kind: "attention", "experts" (routed experts), "shared_experts",
 * "dense_mlp"; "all-linear" stands for all four. Every other word is a
 * projection name and matches the modules whose `proj` equals it.
 *
 * Let P be the projection words and S the scope words. For each kind K,
 * with P_K the words of P that name a projection of some module of kind K:
 *   1. K's word is in S: select the modules of kind K whose proj is in P_K,
 *      or every module of kind K when P_K is empty.
 *   2. otherwise, if K is an MLP kind (experts, shared_experts, dense_mlp)
 *      and S holds an MLP scope word: select nothing of kind K.
 *   3. otherwise: select the modules of kind K whose proj is in P.
 * So projection words alone act as in PEFT (they match in every part of the
 * model), MLP scope words restrict the MLP projections to the named kinds,
 * and a scope word with no projection word for its kind selects all of that
 * kind's projections. Examples:
 *   q_proj k_proj v_proj o_proj        attention only
 *   experts                            every projection of every routed expert
 *   gate_proj up_proj experts          gate and up of routed experts only
 *   q_proj v_proj shared_experts       q, v and all shared-expert projections
 *   gate_proj up_proj down_proj        the MLP projections in every kind
 *   attention dense_mlp                all attention and dense-MLP projections
 * Every word must select at least one module (a typo is an error), and the
 * list must not be empty. */

/* Marks sel[i] = 1 for the selected modules, 0 otherwise. MO_ECONFIG names
 * a word that selects nothing, MO_EINVAL a bad module list. */
int lora_select_targets(unsigned char *sel, const lora_module_desc_t *mods, int n_mods,
                        const char *const *targets, int n_targets);

/* PEFT's rule for a target_modules list: a module is selected when its name
 * equals a suffix or ends with "." followed by it. MO_ECONFIG when nothing is
 * selected. */
int lora_select_suffixes(unsigned char *sel, const lora_module_desc_t *mods, int n_mods,
                         const char *const *suffixes, int n_suffixes);

typedef struct lora_config {
    int rank;                   /* R, >= 1 */
    float alpha;                /* > 0 */
    int rslora;                 /* 1: scale = alpha / sqrt(R); 0: alpha / R */
    float dropout;              /* must be 0: dropout is not supported */
    uint64_t seed;              /* initialisation of A */
    int no_grads;               /* 1: no gradient buffer (inference) */
    const char *const *targets; /* (n_targets) target words, see above */
    int n_targets;
} lora_config_t;

/* One adapted projection. Its A (R, C) is at params + off_A and its
 * B (OC, R) at params + off_B; the gradients at the same offsets in grads. */
typedef struct lora_entry {
    char *name; /* module name, as in lora_module_desc_t */
    char *proj;
    lora_kind_t kind;
    int C, OC, R;
    size_t off_A, off_B; /* in floats */
} lora_entry_t;

/* One tensor of the flat buffer: the {name, shape, offset} table that the
 * optimizer, checkpoint and all-reduce loop over. Entry e owns tensors 2e
 * (its A) and 2e + 1 (its B). */
typedef struct lora_tensor {
    char *name;       /* "<module>.lora_A.weight" or "<module>.lora_B.weight" */
    int64_t shape[2]; /* (R, C) for A, (OC, R) for B */
    size_t offset;    /* in floats */
    size_t numel;
} lora_tensor_t;

typedef struct lora_adapter {
    int R;
    float alpha;
    int rslora;
    float scale; /* alpha / R or alpha / sqrt(R) */
    uint64_t seed;
    char **targets; /* (n_targets) the words the adapter was built from */
    int n_targets;

    int n_entries;
    lora_entry_t *entries; /* (n_entries), in the order of the module list */
    int n_tensors;
    lora_tensor_t *tensors; /* (n_tensors) = 2 * n_entries + n_full, ascending offsets */
    int n_full;             /* full tensors (lora_adapter_add_full): tensors
                             * 2 n_entries .. n_tensors - 1, after every A and B */

    size_t n_params;
    float *params; /* (n_params) every entry's A then B, packed without gaps */
    float *grads;  /* (n_params) same layout, or NULL with no_grads */

    int *index;       /* (index_cap) open-addressing table of entry ids, -1 empty */
    size_t index_cap; /* a power of two */
} lora_adapter_t;

/* Builds the adapter for the modules cfg->targets selects from mods
 * (in mods' order). A of each entry is drawn uniform(-1/sqrt(C), 1/sqrt(C))
 * (PEFT's kaiming_uniform with a = sqrt(5)) from a Philox stream named by the
 * module name under cfg->seed, so it does not depend on thread count, on the
 * order of the list, or on which other modules are adapted; B is 0; grads 0.
 * MO_ECONFIG for a bad config (dropout != 0, rank < 1, alpha <= 0, a target
 * word that selects nothing), MO_EINVAL for a bad module list (empty or
 * duplicate name, C or OC < 1). */
int lora_adapter_new(lora_adapter_t **out, const lora_config_t *cfg, const lora_module_desc_t *mods,
                     int n_mods);
/* The same with an explicit selection sel (n_mods); cfg->targets is only
 * recorded. */
int lora_adapter_new_selected(lora_adapter_t **out, const lora_config_t *cfg,
                              const lora_module_desc_t *mods, int n_mods, const unsigned char *sel);
void lora_adapter_destroy(lora_adapter_t **ad);

/* Full-parameter tensors. Besides the LoRA pairs, an adapter may carry small frozen
 * weights of the model made trainable in full (the MoE router, the RMSNorm weights):
 * each is one tensor named by its Hugging Face parameter name
 * ("model.layers.3.mlp.gate.weight", "model.norm.weight"), with its values and
 * gradients in the same flat buffers, after every LoRA tensor, so that whatever loops
 * over the tensor table (optimizer, clipping, checkpoints, publishing) covers it. */

/* Appends the full tensor name of shape (rows, cols) (a vector of n is (n, 1)) with
 * params init (rows * cols) and zero gradients. The flat buffers move: add every full
 * tensor before binding the adapter or taking pointers into it. MO_EINVAL for an empty
 * or duplicate name or rows, cols < 1, MO_ENOMEM. */
int lora_adapter_add_full(lora_adapter_t *ad, const char *name, int rows, int cols,
                          const float *init);
/* The tensor index (into ad->tensors) of full tensor name, or -1. */
int lora_adapter_find_full(const lora_adapter_t *ad, const char *name);

/* The entry index of a module name, or -1. */
int lora_adapter_find(const lora_adapter_t *ad, const char *module);
/* Pointers into the buffers for entry e; dA and dB are NULL without
 * with_grads or without a gradient buffer. */
lora_pair_t lora_adapter_pair(const lora_adapter_t *ad, int e, int with_grads);
void lora_adapter_zero_grads(lora_adapter_t *ad);
size_t lora_adapter_num_params(const lora_adapter_t *ad);

/* The PEFT target_modules for this adapter: the distinct module names with
 * a leading "model.layers.<N>." removed, in first-seen order
 * ("self_attn.q_proj", "mlp.experts.17.gate_proj", ...). Under PEFT's suffix
 * rule they select exactly the adapted modules when every layer adapts the
 * same projections. *out is an array of n strings, freed with
 * lora_free_strings. */
int lora_adapter_suffixes(const lora_adapter_t *ad, char ***out, int *n);
void lora_free_strings(char **s, int n);

/* 64-bit XXH64 (seed 0) of n bytes. */
uint64_t lora_hash64(const void *data, size_t n);
/* XXH64 of the parameter buffer's bytes: the adapter's content version. */
uint64_t lora_adapter_checksum(const lora_adapter_t *ad);

#ifdef __cplusplus
}
#endif
#endif
