/* ep_shard: the expert-parallel learner's LoRA adapter shards: which entries a rank
 * holds, the global gradient norm, gathering a whole adapter (and its AdamW moments) on
 * rank 0, and cutting a rank's shard out of a whole adapter. */
#ifndef MOERL_LEARNER_EP_SHARD_H
#define MOERL_LEARNER_EP_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "learner/optim.h"
#include "lora/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: n_full entries of the whole adapter, P floats of its flat buffer, N ranks, E
 * routed experts.
 *
 * The whole adapter is what lora_adapter_new builds from the model's module list. Rank r
 * holds a shard: every entry that is not a routed expert's (attention, shared experts,
 * dense MLPs: replicated, the same on every rank) and the entries of its own experts
 * moe_ep_experts(E, N, r) of every layer. A shard is a lora_adapter_t in its own right
 * (the same entry order, without the other experts' entries), so the model binds it and
 * the optimizer runs on its flat buffer. Entries are initialised by module name
 * (lora_adapter_new), so a shard starts equal to the matching part of a whole adapter. */

typedef struct ep_shard {
    comm_t *comm; /* borrowed */
    int N, rank, E;
    int n_full;         /* entries of the whole adapter: LoRA entries, then full tensors */
    int n_lora;         /* the LoRA entries (first n_lora); the rest: ep_shard_add_full */
    size_t full_params; /* P */
    size_t *full_off;   /* (n_full) entry i's first float in the whole buffer */
    size_t *size;       /* (n_full) entry i's floats, R (C + OC): its A then its B */
    int *owner;         /* (n_full) the rank holding entry i alone, -1 when replicated */
    int64_t *shard_off; /* (n_full) entry i's first float in this rank's shard, -1 */
    int64_t *counts;    /* (N) floats of owned expert entries per rank */
    int64_t *displs;    /* (N) */
    lora_config_t lcfg; /* the whole adapter's config (no grads), targets borrowed */
    const lora_module_desc_t *mods; /* (n_mods) the model's module list, borrowed */
    int n_mods;
    unsigned char *sel;          /* (n_mods) the whole adapter's selection */
    const lora_adapter_t *shard; /* borrowed: names and shapes of the full tensors */
} ep_shard_t;

/* The routed expert a module name belongs to ("....experts.17.gate_proj" -> 17), or -1
 * (attention, shared experts, dense MLP, router). */
int ep_shard_expert_of(const char *module);

/* Builds the shard plan and this rank's shard adapter (*shard, with gradients) for the
 * modules cfg->targets selects from mods (which, like cfg's targets, must outlive the
 * plan). MO_ECONFIG when E is not a multiple of the communicator's size (naming both)
 * or a target selects nothing. */
int ep_shard_new(ep_shard_t **out, comm_t *cm, const lora_config_t *cfg,
                 const lora_module_desc_t *mods, int n_mods, int E, lora_adapter_t **shard);
void ep_shard_destroy(ep_shard_t **ep);

/* Adds shard's full tensors (model_adapter_add_full: routers and norms trained in full,
 * the same on every rank) to the plan as replicated entries after the LoRA entries: the
 * whole adapter (ep_shard_full_new) then carries them in the same order, gathers take
 * them from rank 0, and ep_shard_grad_sqsum counts them once. Their gradients are
 * per-rank partial sums to be all-reduced like the replicated LoRA entries'. Call it
 * once, after the full tensors are added to shard, which must outlive the plan. */
int ep_shard_add_full(ep_shard_t *ep, const lora_adapter_t *shard);

/* A whole adapter (every entry and full tensor, no gradient buffer); its parameters are
 * then overwritten by ep_shard_gather or a load. */
int ep_shard_full_new(const ep_shard_t *ep, lora_adapter_t **full);

/* Collective: full (P floats, written on rank 0 only, NULL elsewhere is fine) = the whole
 * buffer assembled from every rank's shard-layout buffer shard (its params, or AdamW m
 * or v): replicated entries from rank 0, expert entries from their owners (gatherv). */
int ep_shard_gather(const ep_shard_t *ep, const float *shard, float *full);

/* shard (this rank's layout) = its entries of the whole buffer full (P floats). */
void ep_shard_extract(const ep_shard_t *ep, const float *full, float *shard);

/* Collective: the sum of squares of the whole adapter's gradient, from each rank's shard
 * gradient g (shard layout; replicated entries already all-reduced, counted once); the
 * same on every rank, for optim_step's global_sqsum. */
int ep_shard_grad_sqsum(const ep_shard_t *ep, const float *g, double *out);

/* Collective: on rank 0, full receives the whole adapter and full_o (n = P, may be NULL)
 * the whole AdamW state (moments gathered, step and skipped copied) of shard and o. */
int ep_shard_gather_state(const ep_shard_t *ep, const lora_adapter_t *shard, const optim_t *o,
                          lora_adapter_t *full, optim_t *full_o);

/* This rank's part of a whole adapter and AdamW state (full_o and o may be NULL). */
void ep_shard_extract_state(const ep_shard_t *ep, const lora_adapter_t *full,
                            const optim_t *full_o, lora_adapter_t *shard, optim_t *o);

/* Collective: 1 on every rank when rc < 0 on any rank, else 0 (a status all ranks agree
 * on). A communication failure also reads as 1. */
int ep_shard_any_failed(const ep_shard_t *ep, int rc);

#ifdef __cplusplus
}
#endif
#endif
