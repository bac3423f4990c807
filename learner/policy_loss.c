/* policy_loss: the RL loss of a packed micro-batch with its per-token
 * gradients and metrics. Formulas: docs/rl.md. */
#include "learner/policy_loss.h"

#include <math.h>
#include <stddef.h>

#include "core/status.h"

pl_opts_t pl_opts_from_config(const moerl_config_t *c) {
    const config_learner_t *l = &c->learner;
    pl_opts_t o = {.loss = l->loss,
                   .agg = l->loss_agg,
                   .clip_low = l->clip_low,
                   .clip_high = l->clip_high,
                   .kl_coef = l->kl_coef,
                   .kl_estimator = l->kl_estimator,
                   .entropy_coef = l->entropy_coef,
                   .tis_cap = l->tis_cap,
                   .seq_norm_const = 0.0};
    if (l->advantage == CFG_ADV_DR_GRPO && l->loss_agg == CFG_AGG_SEQ_MEAN_TOKEN_SUM)
        o.seq_norm_const = c->rollout.max_new_tokens;
    return o;
}

static int masked_count(const uint8_t *mask, int32_t lo, int32_t hi) {
    int n = 0;
    for (int32_t t = lo; t < hi; t++)
        n += mask[t] != 0;
    return n;
}

void pl_norm_add(pl_norm_t *n, const int32_t *off, const uint8_t *mask, int B) {
    for (int b = 0; b < B; b++) {
        int k = masked_count(mask, off[b], off[b + 1]);
        n->tokens += k;
        n->seqs += k > 0;
    }
}

void pl_metrics_add(pl_metrics_t *dst, const pl_metrics_t *src) {
    double *d = (double *)dst;
    const double *s = (const double *)src;
    for (size_t i = 0; i < sizeof(pl_metrics_t) / sizeof(double); i++)
        d[i] += s[i];
}

pl_summary_t pl_summarize(const pl_metrics_t *m) {
    double inv = m->tokens > 0 ? 1.0 / m->tokens : 0.0;
    pl_summary_t s = {m->loss,
                      m->pg,
                      m->kl,
                      m->entropy,
                      m->tokens,
                      m->seqs,
                      m->clip_low * inv,
                      m->clip_high * inv,
                      m->ratio * inv,
                      m->approx_kl * inv,
                      m->entropy_sum * inv,
                      m->mismatch_k3 * inv,
                      m->mismatch_k1 * inv,
                      m->tis_clipped * inv};
    return s;
}

static int finite_nonneg(double x) {
    return x >= 0 && isfinite(x);
}

static int check_opts(const pl_opts_t *o) {
    if (o == NULL)
        return mo_errorf(MO_EINVAL, "policy loss: options are NULL");
    if ((int)o->loss < CFG_LOSS_PPO || o->loss > CFG_LOSS_CISPO)
        return mo_errorf(MO_EINVAL, "policy loss: unknown loss %d", (int)o->loss);
    if ((int)o->agg < CFG_AGG_TOKEN_MEAN || o->agg > CFG_AGG_SEQ_MEAN_TOKEN_MEAN)
        return mo_errorf(MO_EINVAL, "policy loss: unknown aggregation %d", (int)o->agg);
    if ((int)o->kl_estimator < CFG_KL_K1 || o->kl_estimator > CFG_KL_K3)
        return mo_errorf(MO_EINVAL, "policy loss: unknown KL estimator %d", (int)o->kl_estimator);
    if (!(o->clip_low >= 0 && o->clip_low < 1))
        return mo_errorf(MO_EINVAL, "policy loss: clip_low %g outside [0, 1)", o->clip_low);
    if (!finite_nonneg(o->clip_high))
        return mo_errorf(MO_EINVAL, "policy loss: clip_high %g must be finite and >= 0",
                         o->clip_high);
    if (!finite_nonneg(o->kl_coef) || !finite_nonneg(o->entropy_coef) ||
        !finite_nonneg(o->tis_cap) || !finite_nonneg(o->seq_norm_const))
        return mo_errorf(MO_EINVAL,
                         "policy loss: kl_coef %g, entropy_coef %g, tis_cap %g and "
                         "seq_norm_const %g must be finite and >= 0",
                         o->kl_coef, o->entropy_coef, o->tis_cap, o->seq_norm_const);
    return MO_OK;
}

static int check_batch(const pl_batch_t *b, const pl_opts_t *o, const float *dlogp,
                       const float *dentropy) {
    if (b == NULL || b->B < 0 || b->off == NULL)
        return mo_errorf(MO_EINVAL, "policy loss: batch or its offsets missing");
    if (b->off[0] < 0)
        return mo_errorf(MO_EINVAL, "policy loss: off[0] = %d < 0", (int)b->off[0]);
    for (int s = 0; s < b->B; s++)
        if (b->off[s + 1] < b->off[s])
            return mo_errorf(MO_EINVAL, "policy loss: off[%d] = %d < off[%d] = %d", s + 1,
                             (int)b->off[s + 1], s, (int)b->off[s]);
    if (b->B > 0 && (!b->logp || !b->old_logp || !b->adv || !b->mask || !dlogp))
        return mo_errorf(MO_EINVAL, "policy loss: logp, old_logp, adv, mask and dlogp are "
                                    "required");
    if (o->kl_coef > 0 && b->ref_logp == NULL)
        return mo_errorf(MO_EINVAL, "policy loss: kl_coef %g needs ref_logp", o->kl_coef);
    if (o->entropy_coef > 0 && (b->entropy == NULL || dentropy == NULL))
        return mo_errorf(MO_EINVAL, "policy loss: entropy_coef %g needs entropy and dentropy",
                         o->entropy_coef);
    return MO_OK;
}

static int check_norm(const pl_opts_t *o, const pl_norm_t *n, const pl_norm_t *local) {
    if (n == NULL)
        return mo_errorf(MO_EINVAL, "policy loss: normaliser is NULL");
    if (o->agg == CFG_AGG_TOKEN_MEAN && local->tokens > 0 && !(n->tokens >= local->tokens))
        return mo_errorf(MO_EINVAL,
                         "policy loss: token normaliser %g is below the %g masked tokens of "
                         "this micro-batch",
                         n->tokens, local->tokens);
    if (o->agg != CFG_AGG_TOKEN_MEAN && local->seqs > 0 && !(n->seqs >= local->seqs))
        return mo_errorf(MO_EINVAL,
                         "policy loss: sequence normaliser %g is below the %g samples with "
                         "masked tokens in this micro-batch",
                         n->seqs, local->seqs);
    return MO_OK;
}

/* The aggregation weight of every masked token of a sample with k of them. */
static double agg_weight(const pl_opts_t *o, const pl_norm_t *n, int k) {
    switch (o->agg) {
    case CFG_AGG_TOKEN_MEAN: return 1.0 / n->tokens;
    case CFG_AGG_SEQ_MEAN_TOKEN_SUM:
        return 1.0 / (n->seqs * (o->seq_norm_const > 0 ? o->seq_norm_const : 1.0));
    case CFG_AGG_SEQ_MEAN_TOKEN_MEAN: return 1.0 / (n->seqs * k);
    }
    return 0.0;
}

/* KL estimate of delta = logp - ref_logp, and its derivative in logp. */
static double kl_estimate(cfg_kl_estimator_t est, double delta, double *dk) {
    switch (est) {
    case CFG_KL_K1: *dk = 1.0; return delta;
    case CFG_KL_K2: *dk = delta; return 0.5 * delta * delta;
    case CFG_KL_K3: {
        double e = exp(-delta);
        *dk = 1.0 - e;
        return e + delta - 1.0;
    }
    }
    *dk = 0.0;
    return 0.0;
}

/* One token's policy term: value, derivative in logp, and which clip is
 * active (-1 low, 1 high, 0 none). */
typedef struct {
    double value, dlogp;
    int clip;
} pg_term_t;

/* PPO and GSPO-token: -min(r A, clip(r, lo, hi) A); the unclipped branch's
 * derivative is -A dr, with dr = d r / d logp_t (the ratio itself for both). */
static pg_term_t clipped_term(double r, double A, double lo, double hi) {
    pg_term_t p = {0, 0, 0};
    double u = r * A, v = fmin(fmax(r, lo), hi) * A;
    if (v < u) {
        p.value = -v;
        p.clip = r < lo ? -1 : 1;
    } else {
        p.value = -u;
        p.dlogp = -A * r;
    }
    return p;
}

/* CISPO: -sg(min(r, hi)) A logp. */
static pg_term_t cispo_term(double r, double A, double logp, double hi) {
    double w = fmin(r, hi);
    pg_term_t p = {-w * A * logp, -w * A, r > hi ? 1 : 0};
    return p;
}

/* The per-sample quantities shared by its tokens. */
typedef struct {
    double A;         /* advantage */
    double c;         /* aggregation weight */
    double seq_ratio; /* gspo: exp(mean over masked tokens of logp - old_logp) */
} sample_ctx_t;

static void token_loss(float *dlogp, float *dentropy, pl_metrics_t *acc, const pl_batch_t *b,
                       const pl_opts_t *o, const sample_ctx_t *sc, int32_t t) {
    double lp = b->logp[t], d = lp - (double)b->old_logp[t], ratio = exp(d);
    double w = 1.0; /* TIS weight */
    if (b->rollout_logp) {
        double rd = (double)b->old_logp[t] - b->rollout_logp[t], rho = exp(rd);
        acc->mismatch_k3 += rho - 1.0 - rd;
        acc->mismatch_k1 += -rd;
        if (o->tis_cap > 0) {
            w = fmin(rho, o->tis_cap);
            acc->tis_clipped += rho > o->tis_cap;
        }
    }
    double r = o->loss == CFG_LOSS_GSPO ? sc->seq_ratio : ratio;
    pg_term_t p = o->loss == CFG_LOSS_CISPO
                      ? cispo_term(r, sc->A, lp, 1.0 + o->clip_high)
                      : clipped_term(r, sc->A, 1.0 - o->clip_low, 1.0 + o->clip_high);
    double g = w * p.dlogp;
    acc->pg += sc->c * w * p.value;
    if (b->ref_logp) {
        double dk, k = kl_estimate(o->kl_estimator, lp - (double)b->ref_logp[t], &dk);
        acc->kl += sc->c * k;
        g += o->kl_coef * dk;
    }
    if (b->entropy) {
        acc->entropy += sc->c * b->entropy[t];
        acc->entropy_sum += b->entropy[t];
        if (o->entropy_coef > 0)
            dentropy[t] += (float)(-sc->c * o->entropy_coef);
    }
    dlogp[t] += (float)(sc->c * g);
    acc->tokens += 1;
    acc->clip_low += p.clip < 0;
    acc->clip_high += p.clip > 0;
    acc->ratio += r;
    acc->approx_kl += ratio - 1.0 - d;
}

static void sample_loss(float *dlogp, float *dentropy, pl_metrics_t *acc, const pl_batch_t *b,
                        const pl_opts_t *o, const pl_norm_t *n, int s) {
    int32_t lo = b->off[s], hi = b->off[s + 1];
    int k = masked_count(b->mask, lo, hi);
    if (k == 0)
        return;
    sample_ctx_t sc = {b->adv[s], agg_weight(o, n, k), 0.0};
    if (o->loss == CFG_LOSS_GSPO) {
        double sum = 0;
        for (int32_t t = lo; t < hi; t++)
            if (b->mask[t])
                sum += (double)b->logp[t] - b->old_logp[t];
        sc.seq_ratio = exp(sum / k);
    }
    acc->seqs += 1;
    for (int32_t t = lo; t < hi; t++)
        if (b->mask[t])
            token_loss(dlogp, dentropy, acc, b, o, &sc, t);
}

int policy_loss(float *dlogp, float *dentropy, pl_metrics_t *m, const pl_batch_t *b,
                const pl_opts_t *o, const pl_norm_t *norm) {
    TRY(check_opts(o));
    TRY(check_batch(b, o, dlogp, dentropy));
    pl_norm_t local = {0, 0};
    pl_norm_add(&local, b->off, b->mask, b->B);
    TRY(check_norm(o, norm, &local));
    pl_metrics_t acc = {0};
    for (int s = 0; s < b->B; s++)
        sample_loss(dlogp, dentropy, &acc, b, o, norm, s);
    acc.loss = acc.pg + o->kl_coef * acc.kl - o->entropy_coef * acc.entropy;
    if (m)
        pl_metrics_add(m, &acc);
    return MO_OK;
}

int pl_mismatch_filter(double *kl, uint8_t *mask, const int32_t *off, const float *old_logp,
                       const float *rollout_logp, int B, double max) {
    int dropped = 0;
    for (int s = 0; s < B; s++) {
        double sum = 0;
        int k = 0;
        for (int32_t t = off[s]; t < off[s + 1]; t++) {
            if (!mask[t])
                continue;
            double rd = (double)old_logp[t] - rollout_logp[t];
            sum += exp(rd) - 1.0 - rd;
            k++;
        }
        double v = k > 0 ? sum / k : 0.0;
        if (kl)
            kl[s] = v;
        if (max > 0 && v > max) {
            for (int32_t t = off[s]; t < off[s + 1]; t++)
                mask[t] = 0;
            dropped++;
        }
    }
    return dropped;
}
