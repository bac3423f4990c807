/* advantage: per-sample advantages from scalar rewards (GRPO, Dr. GRPO,
 * RLOO, REINFORCE with a batch baseline), zero-signal groups for dynamic
 * sampling, and the overlong filter and penalty. */
#ifndef MOERL_LEARNER_ADVANTAGE_H
#define MOERL_LEARNER_ADVANTAGE_H

#include <stdint.h>

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A batch of N samples in groups: group g holds samples group_off[g] ..
 * group_off[g+1]-1 (the G completions of one prompt), group_off (n_groups+1),
 * group_off[0] = 0, non-decreasing. keep (N) marks the samples that count;
 * a sample with keep 0 (dropped, e.g. by the overlong filter) gets advantage
 * 0 and is left out of every mean and std. keep NULL keeps all. */

#define ADV_STD_EPS 1e-6   /* GRPO: (r - mean) / (std + eps), as verl */
#define ADV_EQUAL_TOL 1e-6 /* rewards within this of each other are equal */

typedef struct adv_opts {
    cfg_advantage_t kind;
    double std_eps;   /* GRPO only */
    double equal_tol; /* a group whose kept rewards span (max - min) <= this is flat */
} adv_opts_t;

/* Defaults for an estimator: std_eps ADV_STD_EPS, equal_tol ADV_EQUAL_TOL. */
adv_opts_t adv_opts_default(cfg_advantage_t kind);

typedef struct adv_stats {
    int groups;         /* groups in the batch */
    int flat_groups;    /* groups with no signal: fewer than 2 kept samples, or kept
                           rewards all equal within equal_tol */
    int samples;        /* N */
    int kept;           /* samples with keep 1 */
    double reward_mean; /* over kept samples */
    double reward_std;  /* over kept samples, population (divides by kept) */
    double adv_mean;    /* over kept samples */
    double adv_abs_max; /* over kept samples */
} adv_stats_t;

/* adv (N) from reward (N):
 *   grpo      (r - mean_g) / (std_g + std_eps), std_g the sample standard
 *             deviation (divides by G - 1, Bessel-corrected, as torch.std in
 *             TRL and verl)
 *   dr_grpo   r - mean_g
 *   rloo      r - mean of the other kept samples of the group
 *             (= G / (G - 1) * (r - mean_g))
 *   reinforce r - mean over every kept sample of the batch
 * G, mean_g and std_g count kept samples only. For the three group
 * estimators a flat group (see adv_stats_t) gets advantage 0 for every
 * sample, so rewards equal up to noise never turn into unit advantages; for
 * reinforce, a batch with fewer than 2 kept samples or a flat batch gets 0.
 * st (may be NULL) is overwritten. MO_EINVAL on bad offsets, a non-finite
 * kept reward (naming the sample) or bad options. */
int adv_compute(float *adv, const float *reward, const uint8_t *keep, const int32_t *group_off,
                int n_groups, const adv_opts_t *o, adv_stats_t *st);

/* Dynamic sampling: flat (n_groups) receives 1 for each group without
 * signal (as in adv_stats_t, with tolerance tol), 0 otherwise; flat may be
 * NULL. Returns the number of flat groups, or MO_EINVAL on bad offsets. */
int adv_flat_groups(uint8_t *flat, const float *reward, const uint8_t *keep,
                    const int32_t *group_off, int n_groups, double tol);

/* Overlong handling, applied to a batch before adv_compute.
 * A sample is truncated when it did not finish (no end-of-sequence token or
 * stop string: finished[i] == 0), whatever limit cut it. */
typedef struct overlong_stats {
    int truncated;      /* samples with finished 0 */
    int dropped;        /* samples whose keep this call set to 0 (filter) */
    int penalised;      /* samples given a penalty below 0 (penalty) */
    double penalty_sum; /* sum of the penalties added (<= 0) */
} overlong_stats_t;

/* DAPO's soft overlong punishment for a completion of len tokens, limit
 * L = max_new_tokens and buffer b (1 <= b <= L):
 *   0                      for len <= L - b
 *   -(len - (L - b)) / b   for L - b < len <= L   (reaches -1 at len = L)
 *   -1                     for len > L. */
double overlong_penalty(int len, int max_new_tokens, int buffer);

/* mode keep: nothing. filter: keep[i] = 0 for every truncated sample.
 * penalty: reward[i] += overlong_penalty(len[i], ...) for every sample.
 * reward, keep (N) are updated in place; len (N) completion tokens;
 * finished (N). st (may be NULL) is overwritten. MO_EINVAL for a negative
 * length, max_new_tokens < 1, or (penalty) buffer outside [1, max_new_tokens]. */
int overlong_apply(float *reward, uint8_t *keep, const int32_t *len, const uint8_t *finished, int N,
                   cfg_overlong_t mode, int max_new_tokens, int buffer, overlong_stats_t *st);

/* Zeroes the token mask (T) of every sample with keep 0; sample b holds
 * tokens off[b] .. off[b+1]-1, off (B+1). */
void adv_mask_dropped(uint8_t *mask, const int32_t *off, const uint8_t *keep, int B);

#ifdef __cplusplus
}
#endif
#endif
