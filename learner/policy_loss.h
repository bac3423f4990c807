/* policy_loss: the RL loss of a packed micro-batch (PPO clip-higher, GSPO,
 * CISPO; three aggregations; KL to the reference, entropy bonus, truncated
 * importance sampling) with its per-token gradients and metrics. */
#ifndef MOERL_LEARNER_POLICY_LOSS_H
#define MOERL_LEARNER_POLICY_LOSS_H

#include <stdint.h>

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The formulas are in docs/rl.md. Every array is host memory; the batch
 * holds B whole samples (a sample never straddles two micro-batches), and
 * T = off[B] tokens. Per-token values are read in f32 and combined in
 * double. */
typedef struct pl_batch {
    int B;                     /* samples */
    const int32_t *off;        /* (B+1) sample b holds tokens off[b] .. off[b+1]-1 */
    const float *logp;         /* (T) the learner's current log-probability */
    const float *old_logp;     /* (T) the policy at the start of this batch's updates */
    const float *rollout_logp; /* (T) what the rollout reported, or NULL: equal to old_logp */
    const float *ref_logp;     /* (T) the reference (adapters off), or NULL; needed when
                                  kl_coef > 0 */
    const float *entropy;      /* (T) the learner's entropy, or NULL; needed when
                                  entropy_coef > 0 */
    const float *adv;          /* (B) advantage of each sample, broadcast to its tokens */
    const uint8_t *mask;       /* (T) 1 for a response token that trains, 0 otherwise */
} pl_batch_t;

typedef struct pl_opts {
    cfg_loss_t loss;
    cfg_loss_agg_t agg;
    double clip_low;  /* ppo, gspo: ratios below 1 - clip_low clip; cispo ignores it */
    double clip_high; /* ratios above 1 + clip_high clip */
    double kl_coef;   /* 0 = no KL term */
    cfg_kl_estimator_t kl_estimator;
    double entropy_coef;   /* 0 = no entropy bonus */
    double tis_cap;        /* truncated importance sampling cap; 0 = off */
    double seq_norm_const; /* seq-mean-token-sum: each sample's token sum is divided by
                              this constant (Dr. GRPO: max_new_tokens); 0 means 1 */
} pl_opts_t;

/* The learner section's options; seq_norm_const = rollout.max_new_tokens
 * when the advantage is dr_grpo and the aggregation seq-mean-token-sum,
 * else 0. */
pl_opts_t pl_opts_from_config(const moerl_config_t *c);

/* Global normalisers: sums over every micro-batch of the optimizer step
 * and, with expert parallelism, over every rank holding different samples. */
typedef struct pl_norm {
    double tokens; /* masked tokens (token-mean) */
    double seqs;   /* samples with at least one masked token (seq-mean-*) */
} pl_norm_t;

/* n += the masked tokens and the samples with a masked token of a batch. */
void pl_norm_add(pl_norm_t *n, const int32_t *off, const uint8_t *mask, int B);

/* Loss parts and metric sums. Every field is a double that adds across
 * micro-batches and ranks (pl_metrics_add, or an all-reduce of the struct as
 * an array of sizeof(pl_metrics_t) / sizeof(double) doubles). */
typedef struct pl_metrics {
    /* Aggregated with the global normaliser (their sum over micro-batches
     * is the step's value). */
    double loss;    /* pg + kl_coef * kl - entropy_coef * entropy */
    double pg;      /* policy term, TIS weights included */
    double kl;      /* KL estimate to the reference, before kl_coef (0 without ref_logp) */
    double entropy; /* entropy, before entropy_coef (0 without entropy) */
    /* Counts and sums over masked tokens. */
    double tokens;      /* masked tokens */
    double seqs;        /* samples with a masked token */
    double clip_low;    /* tokens whose policy term is clipped at 1 - clip_low */
    double clip_high;   /* tokens clipped at 1 + clip_high */
    double ratio;       /* importance ratio the loss uses (gspo: the sample's) */
    double approx_kl;   /* k3 estimate of KL(old || current) */
    double entropy_sum; /* token entropies (0 without entropy) */
    double mismatch_k3; /* k3 estimate of KL(rollout || old) */
    double mismatch_k1; /* rollout_logp - old_logp */
    double tis_clipped; /* tokens whose TIS weight hit the cap */
} pl_metrics_t;

void pl_metrics_add(pl_metrics_t *dst, const pl_metrics_t *src);

/* Means of the summed metrics (each divides by tokens; 0 when tokens is 0). */
typedef struct pl_summary {
    double loss, pg, kl, entropy; /* as in pl_metrics_t */
    double tokens, seqs;
    double clip_frac_low, clip_frac_high;
    double ratio_mean;
    double approx_kl;
    double entropy_mean;
    double mismatch_k3, mismatch_k1;
    double tis_clip_frac;
} pl_summary_t;

pl_summary_t pl_summarize(const pl_metrics_t *m);

/* Computes the batch's part of the loss: accumulates dL/dlogp into dlogp (T)
 * and dL/dentropy into dentropy (T; may be NULL when entropy_coef is 0), and
 * adds the loss parts and metrics into m (may be NULL). Tokens with mask 0
 * get no gradient and no metric. MO_EINVAL (with the reason) for bad
 * options, offsets, missing inputs, or a normaliser smaller than this
 * batch's own count. */
int policy_loss(float *dlogp, float *dentropy, pl_metrics_t *m, const pl_batch_t *b,
                const pl_opts_t *o, const pl_norm_t *norm);

/* Per-sample mismatch between rollout and old log-probabilities: kl (B)
 * receives the mean over the sample's masked tokens of the k3 estimate of
 * KL(rollout || old) (0 for a sample without masked tokens). When max > 0,
 * the mask of every sample with kl > max is zeroed (learner.mismatch_kl_max);
 * returns the number of samples so dropped. */
int pl_mismatch_filter(double *kl, uint8_t *mask, const int32_t *off, const float *old_logp,
                       const float *rollout_logp, int B, double max);

#ifdef __cplusplus
}
#endif
#endif
