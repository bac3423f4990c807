/* optim: AdamW over the flat LoRA buffer with global grad-norm clipping,
 * the learning-rate schedule, non-finite step skipping, and the optimizer
 * state's save and load. */
#ifndef MOERL_LEARNER_OPTIM_H
#define MOERL_LEARNER_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "core/config.h"
#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct optim_hp {
    double lr; /* peak learning rate */
    cfg_lr_schedule_t schedule;
    int64_t warmup_steps;
    int64_t total_steps; /* optimizer updates in the run (cosine decays over them) */
    double min_lr_ratio; /* cosine: the last update's lr / lr */
    double beta1, beta2, eps, weight_decay;
    double grad_clip; /* max global grad norm; 0 = off */
} optim_hp_t;

/* The learner section's values; total_steps = steps * ppo_epochs * minibatches. */
optim_hp_t optim_hp_from_config(const config_learner_t *l);

/* The learning rate of the update that follows s applied updates (s >= 0):
 *   s < W:          lr * (s + 1) / W                           (linear warmup)
 *   constant:       lr
 *   cosine:         lr * (r + (1 - r) * (1 + cos(pi * p)) / 2),
 *                   p = min(1, (s - W) / max(1, S - 1 - W)), r = min_lr_ratio
 * W = warmup_steps, S = total_steps: the first update after warmup takes lr,
 * the last planned one (s = S - 1) takes r * lr, later ones stay there. */
double optim_lr(const optim_hp_t *hp, int64_t s);

/* The sum of squares of grad (n) in double, in index order. */
double optim_grad_sqsum(const float *grad, size_t n);

/* PyTorch's clip_grad_norm_ coefficient: min(1, max_norm / (norm + 1e-6));
 * 1 when max_norm is 0 (off). */
double optim_clip_coef(double norm, double max_norm);

/* AdamW state. m and v are the flat moment buffers, step the number of
 * updates applied (bias correction and the schedule use it); skipped the
 * number of updates skipped for non-finite values. A checkpoint holds
 * m, v, step and skipped. */
typedef struct optim {
    const kernels_t *k; /* adamw_update comes from here */
    optim_hp_t hp;
    size_t n;
    float *m; /* (n) */
    float *v; /* (n) */
    int64_t step;
    int64_t skipped;
    /* Parameters that take no weight decay (optim_no_decay): n_nd ranges
     * [nd_off[i], nd_off[i] + nd_len[i]), sorted and disjoint. */
    size_t *nd_off, *nd_len; /* (n_nd) */
    int n_nd;
} optim_t;

/* Zero moments, step 0. k NULL means the CPU backend's table. MO_EINVAL for
 * bad hyperparameters (naming the field), MO_ENOMEM. */
int optim_init(optim_t *o, size_t n, const optim_hp_t *hp, const kernels_t *k);
void optim_free(optim_t *o);

/* Excludes the parameters [off, off + len) from weight decay (the usual treatment of
 * norm gains and other one-dimensional parameters); they still take the Adam update.
 * Ranges are added in any order; MO_EINVAL when one reaches past n or overlaps one
 * added before (naming both), MO_ENOMEM. A zero-length range is ignored. The ranges
 * are configuration, not state: optim_save and optim_load leave them alone. */
int optim_no_decay(optim_t *o, size_t off, size_t len);

typedef enum {
    OPTIM_APPLIED = 0,
    OPTIM_SKIP_LOSS, /* the loss is NaN or infinite */
    OPTIM_SKIP_GRAD, /* an element of this buffer's gradient is NaN or infinite */
    OPTIM_SKIP_NORM, /* the global norm is not finite (another rank's gradient) */
} optim_outcome_t;

/* "applied", "non-finite loss", "non-finite gradient", "non-finite grad norm". */
const char *optim_outcome_name(optim_outcome_t r);

typedef struct optim_result {
    optim_outcome_t outcome;
    double grad_norm;  /* global, before clipping */
    double clip_coef;  /* multiplier applied to the gradient (1 when not clipped) */
    double lr;         /* learning rate used (0 when skipped) */
    int64_t bad_index; /* OPTIM_SKIP_GRAD: first non-finite element, else -1 */
    int64_t step;      /* o->step after the call */
} optim_result_t;

/* One update of param (n) from grad (n), host memory. global_sqsum is the
 * gradient's sum of squares over every rank (the caller all-reduces
 * optim_grad_sqsum of each rank's distinct gradients), or NULL for this
 * buffer's own. When loss, any element of grad or the global norm is not
 * finite, nothing is changed except o->skipped (incremented) and res says
 * why. Otherwise grad is scaled in place by the clip coefficient, AdamW is
 * applied with lr = optim_lr(hp, step) (weight decay 0 on the optim_no_decay
 * ranges), and step is incremented. A skip is not an error: the return value
 * is 0 either way (MO_EINVAL only for NULL arguments). res may be NULL. */
int optim_step(optim_t *o, float *param, float *grad, double loss, const double *global_sqsum,
               optim_result_t *res);

/* The state as a binary file written atomically (path.tmp, fsync, rename,
 * fsync of the directory). Layout, little-endian:
 *   0  char[8] "MOERLOPT"     8  u32 version (1)   12 u32 header bytes (48)
 *   16 u64 n                  24 i64 step          32 i64 skipped
 *   40 u64 checksum of bytes 0..39 and the payload
 *   48 f32 m[n], then f32 v[n]
 * MO_EIO (with the path and the system's reason) on failure; MO_EUNSUPPORTED
 * on a big-endian host. */
int optim_save(const optim_t *o, const char *path);
/* Reads a file written by optim_save into o (whose n must match). The file
 * is checked whole before o changes: MO_EIO when it cannot be read,
 * MO_EMALFORMED for a bad magic, header size, length, step or checksum,
 * MO_EUNSUPPORTED for another version, MO_EINVAL when n differs. */
int optim_load(optim_t *o, const char *path);

#ifdef __cplusplus
}
#endif
#endif
