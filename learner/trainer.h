/* trainer: one RL step of the learner: scored groups in, a better LoRA adapter out
 * (filters, advantages, micro-batching, old/reference logprobs, train/inference
 * mismatch and routing agreement, PPO epochs and minibatches, AdamW). */
#ifndef MOERL_LEARNER_TRAINER_H
#define MOERL_LEARNER_TRAINER_H

#include <stddef.h>
#include <stdint.h>

#include "actor/model.h"
#include "core/comm.h"
#include "core/config.h"
#include "learner/advantage.h"
#include "learner/optim.h"
#include "learner/policy_loss.h"
#include "learner/sample.h"
#include "lora/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: S samples trained in a step, T tokens of a packed micro-batch, M MoE layers,
 * E routed experts, K experts per token.
 *
 * A step (docs/rl.md, "Learner"):
 *   1. drop malformed groups (sample_group_check, counted) and samples more than
 *      learner.max_staleness versions behind the policy (counted);
 *   2. overlong handling (learner.overlong), flat groups (dynamic sampling drops them),
 *      advantages (learner.advantage);
 *   3. pack the kept samples into micro-batches of at most learner.micro_batch_tokens
 *      tokens (a sample never straddles two; a longer one runs alone);
 *   4. one pass without gradients: old logprobs (adapters on), the learner's own routing
 *      (compared with the recorded one: routing agreement), the rollout-vs-learner
 *      mismatch, expert load; reference logprobs (adapters off) when kl_coef > 0;
 *   5. ppo_epochs passes, each over a fresh permutation of the samples split into
 *      `minibatches` optimizer updates: per micro-batch forward (with routing replay when
 *      model.routing_replay), policy loss with the update's global normaliser, backward;
 *      then AdamW (grad clip, non-finite updates skipped);
 *   6. the policy version goes up by one when an update was applied.
 * Everything runs in a fixed order: with one CPU thread two runs give the same bits. */

/* learner.mismatch_kl_max > 0 acts per sample (the default, as the config key says:
 * samples whose mean k3 mismatch exceeds it are masked out) or on the whole batch (the
 * step is refused when the batch's mean k3 mismatch exceeds it). */
typedef enum {
    TRAINER_MISMATCH_DROP_SAMPLES = 0,
    TRAINER_MISMATCH_REFUSE_BATCH = 1,
} trainer_mismatch_mode_t;

typedef struct trainer_opts {
    const char *init_adapter; /* a PEFT directory to start from (e.g. `moerl sft`), or NULL */
    int mismatch_mode;        /* trainer_mismatch_mode_t */
    int measure_routing;      /* 1: measure routing agreement every step; with routing replay
                               * that costs one more forward without gradients */
    comm_t *comm;             /* expert parallelism over these ranks (borrowed), or NULL */
    comm_t *device_comm;      /* with comm and run.device cuda: the MoE layers' exchanges
                               * over this one (same ranks, device memory: NCCL; borrowed;
                               * model_set_device_comm), or NULL (over comm, staged) */
} trainer_opts_t;

/* Expert parallelism (opts.comm with N > 1 ranks; docs/parallelism.md): each rank holds
 * E / N routed experts of every MoE layer (model_set_comm) and an adapter shard with the
 * replicated entries and its experts' entries (learner/ep_shard.h); t->adapter and
 * t->optim are that shard. trainer_step, trainer_sample_logprobs and
 * trainer_whole_adapter are then collective: every rank calls them in the same order with
 * the same groups. Every rank does the same bookkeeping (filters, advantages, packing,
 * permutations); each micro-batch's sequences are split over the ranks in order
 * (contiguous runs of about B / N), each rank forwards and backpropagates its run, the
 * per-token outputs are all-gathered so the loss and its global normaliser are computed
 * on the whole micro-batch, replicated gradients are all-reduced, and AdamW runs on each
 * shard with the global gradient norm. Results match one rank up to float summation
 * order. */

/* init_adapter NULL, drop samples, measure_routing 1. */
trainer_opts_t trainer_opts_default(void);

/* What one step did. Per-layer arrays point into the trainer and stay valid until its
 * next step. Means over tokens count the trained (masked) tokens. */
typedef struct trainer_metrics {
    int64_t step;    /* learner steps done (after this one) */
    int64_t version; /* policy version (after this one) */
    int trained;     /* 1 when the batch reached the optimizer */
    int refused;     /* 1 when the mismatch gate refused the batch (see note) */

    /* Counts. */
    int groups, samples;    /* received */
    int malformed_groups;   /* dropped: failed sample_group_check (see note) */
    int stale_samples;      /* dropped: more than max_staleness versions old, or newer
                             * than the policy */
    int flat_groups;        /* groups without reward signal */
    int skipped_groups;     /* flat groups dropped by dynamic sampling */
    int overlong_truncated; /* samples that did not finish */
    int overlong_dropped;   /* ... dropped by the filter */
    int overlong_penalised; /* ... given a length penalty */
    int mismatch_dropped;   /* samples dropped by mismatch_kl_max */
    int trained_samples;
    int64_t trained_tokens; /* completion tokens with a gradient, per pass */
    int64_t tokens;         /* tokens of the trained sequences, per pass */
    int micro_batches;      /* per pass */
    int updates;            /* optimizer updates applied */
    int skipped_updates;    /* optimizer updates skipped (non-finite) */
    int last_skip;          /* optim_outcome_t of the last skipped update */

    /* Rewards of the valid samples (not malformed, not stale), before any filter. */
    double reward_mean, reward_std;
    double adv_abs_max;

    /* Loss (mean over the applied and skipped updates of each update's global value). */
    double loss, pg, kl, entropy;
    double clip_frac_low, clip_frac_high, ratio_mean, approx_kl;
    double grad_norm; /* mean over updates, before clipping */
    double grad_norm_max;
    double lr; /* of the last update */

    /* Staleness of the trained samples: policy version - version_first. */
    double staleness_mean;
    int staleness_max;

    /* Train/inference mismatch over the completion tokens of the kept samples (before the
     * mismatch filter): k3 estimate of KL(rollout || learner old policy), mean of
     * rollout_logp - old_logp, the largest per-sample mean k3. */
    double mismatch_k3, mismatch_k1, mismatch_k3_max;
    double entropy_old; /* mean entropy of the old policy on the trained tokens */

    /* Routing: M MoE layers. agreement[l]: fraction of recorded tokens whose experts in
     * layer l, as the learner routes them, equal the recorded set (-1 when no token of
     * the step carries routing); imbalance[l]: max / mean expert load of the old-policy
     * pass. */
    int M;
    const double *routing_agreement; /* (M) */
    double routing_agreement_mean;   /* over layers with recorded tokens; -1 when none */
    int64_t routed_tokens;           /* tokens with a recorded routing */
    const double *expert_imbalance;  /* (M) */

    double seconds;      /* wall time of the step */
    double tokens_per_s; /* tokens forwarded (every pass) per second */
    char note[256];      /* first malformed group's reason, or the refusal, or "" */
} trainer_metrics_t;

typedef struct trainer_work trainer_work_t; /* per-step buffers */

typedef struct trainer {
    model_t *model; /* borrowed, or owned when own_model */
    int own_model;
    lora_adapter_t *adapter; /* the policy's parameters and gradients */
    optim_t optim;
    pl_opts_t pl;
    adv_opts_t adv;
    config_learner_t lc; /* the learner section */
    trainer_opts_t opts;
    int max_new_tokens;     /* rollout.max_new_tokens */
    float temperature;      /* rollout.temperature (0 reads as 1) */
    int routing_replay;     /* model.routing_replay */
    uint64_t seed;          /* run.seed */
    uint64_t rng_counter;   /* permutations drawn so far */
    uint64_t config_hash;   /* trainer_config_hash of the job */
    int64_t step;           /* learner steps done */
    int64_t version;        /* policy version: updates of the weights, from 0 */
    int64_t reward_version; /* newest reward version seen */
    int M, E, K;
    double *agreement; /* (M) */
    double *imbalance; /* (M) */
    trainer_work_t *w;
    comm_t *comm;             /* expert parallelism (N > 1 ranks), or NULL */
    struct ep_shard *ep;      /* the shard plan with comm */
    lora_adapter_t *whole;    /* rank 0 with comm: the whole adapter (trainer_whole_adapter) */
    optim_t whole_optim;      /* ... and its AdamW state (trainer_whole_state) */
    struct actor_exec *exec;  /* where the model runs: run.device (learner/actor_exec.h) */
} trainer_t;

/* FNV-1a of the config keys that change what a step computes (run.seed, model.dtype,
 * model.routing_replay, the lora section, rollout.temperature and max_new_tokens, the
 * learner section except steps, checkpoint_every and keep_checkpoints), as
 * config_dump prints them: a checkpoint records it so a resume can tell. */
uint64_t trainer_config_hash(const moerl_config_t *cfg);

/* The adapter's init seed: lora.init_seed, or rng_stream_id("lora.init", run.seed, 0)
 * when that is 0. */
uint64_t trainer_lora_seed(const moerl_config_t *cfg);

/* Marks ad's one-column full tensors (the norm vectors model_adapter_add_full adds) as
 * taking no weight decay in o (optim_no_decay), whose buffer is ad's; the LoRA A and B
 * and the routers keep it. */
int trainer_no_decay(optim_t *o, const lora_adapter_t *ad);

/* Builds the trainer of a job: model NULL opens model.path (owned), else the model is
 * borrowed and must outlive the trainer. The adapter follows the lora section (and
 * opts->init_adapter), the optimizer the learner section. The trainer binds its adapter
 * to the model at every step. opts may be NULL (defaults). With run.device cuda the
 * model's forwards and backwards run on the GPU (learner/actor_exec.h: weights uploaded
 * here, the adapter copied to the device at the start of each step and after each
 * optimizer update); what the device path cannot run (a model feature, trainable routers
 * or norms, expert parallelism, a balance loss) is MO_ECONFIG here, and a missing device
 * MO_EDEVICE. The loss, AdamW and the bookkeeping stay on the CPU. */
int trainer_new(trainer_t **out, const moerl_config_t *cfg, model_t *model,
                const trainer_opts_t *opts);
void trainer_destroy(trainer_t **t);

/* One step over n_groups groups (read only; the caller keeps them). m (may be NULL) is
 * overwritten. A batch that keeps no sample, or that the mismatch gate refuses, trains
 * nothing (m->trained 0) and leaves step and version as they were; that is not an error.
 * Errors are model or memory failures (the weights are then unchanged unless an update
 * was already applied; the counters say so). */
int trainer_step(trainer_t *t, const sample_group_t *const *groups, int n_groups,
                 trainer_metrics_t *m);

/* The whole adapter (PEFT layout, every entry): t->adapter on one rank. With expert
 * parallelism this is collective and gathers the shards on rank 0: *out is the whole
 * adapter there (owned by the trainer, valid until the next call) and NULL elsewhere. */
int trainer_whole_adapter(trainer_t *t, const lora_adapter_t **out);

/* As trainer_whole_adapter, with the whole AdamW state (*o) too, for a checkpoint. */
int trainer_whole_state(trainer_t *t, const lora_adapter_t **ad, const optim_t **o);

/* Rank and size of the trainer's communicator (0 and 1 without one). */
int trainer_rank(const trainer_t *t);
int trainer_ranks(const trainer_t *t);

/* Per-token log-probabilities of sample s of group g under the current policy (adapters
 * on, routing replay as configured, the rollout temperature): out (n) for its n completion
 * tokens. For tests and diagnostics. */
int trainer_sample_logprobs(trainer_t *t, const sample_group_t *g, int s, float *out);

#ifdef __cplusplus
}
#endif
#endif
