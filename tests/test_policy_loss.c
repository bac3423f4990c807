/* Tests for the policy loss: every loss x aggregation x KL estimator x TIS
 * x entropy combination against a direct double reference (values and
 * metrics) and against central finite differences of it (gradients, with
 * stop-gradient quantities held fixed); worked values by hand; clip
 * fractions on crafted inputs; the mask; micro-batch splitting; errors; and
 * a cross-check against PyTorch autograd when it is available. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "core/rng.h"
#include "core/status.h"
#include "learner/policy_loss.h"
#include "tests/testutil.h"

#define MAXB 8
#define MAXT 96
#define FD_H 1e-5      /* central difference step in logp and entropy */
#define TOL_GRAD 1e-5  /* f32 gradients vs double finite differences, normalised */
#define TOL_VAL 1e-10  /* double loss parts and metrics vs the double reference, relative */
#define TOL_TORCH 1e-5 /* f32 gradients and loss vs PyTorch float64, normalised */
#define MARGIN 1e-3    /* no ratio within this of a clip bound */

typedef struct {
    int B;
    int32_t off[MAXB + 1];
    float logp[MAXT], old[MAXT], roll[MAXT], ref[MAXT], ent[MAXT], adv[MAXB];
    uint8_t mask[MAXT];
} fbatch_t;

/* Which optional inputs a case passes. */
typedef struct {
    int roll, ref, ent;
} inputs_t;

static int ntok(const fbatch_t *f) {
    return f->off[f->B];
}

static double u01(uint64_t seed, uint64_t stream, uint64_t i) {
    return rng_uniform(seed, stream, i);
}

/* Six samples of 2..10 tokens; the first one or two tokens of each (the
 * prompt's last) and ~10% of the rest are masked out, sample 3 entirely.
 * old_logp = logp - (per-sample shift + per-token noise) within +-dev. */
static void gen_batch(fbatch_t *f, uint64_t seed, double dev) {
    f->B = 6;
    f->off[0] = 0;
    for (int b = 0; b < f->B; b++)
        f->off[b + 1] = f->off[b] + 2 + (int)(u01(seed, 1, (uint64_t)b) * 9);
    for (int b = 0; b < f->B; b++) {
        double shift = dev * (2 * u01(seed, 2, (uint64_t)b) - 1) * 0.6;
        f->adv[b] = (float)(3 * u01(seed, 3, (uint64_t)b) - 1.5);
        for (int32_t t = f->off[b]; t < f->off[b + 1]; t++) {
            double lp = -0.05 - 2.95 * u01(seed, 4, (uint64_t)t);
            double d = shift + dev * (u01(seed, 5, (uint64_t)t) - 0.5) * 0.8;
            f->logp[t] = (float)lp;
            f->old[t] = (float)(lp - d);
            f->roll[t] = (float)(f->old[t] + (u01(seed, 6, (uint64_t)t) - 0.5));
            f->ref[t] = (float)(lp + 1.2 * (u01(seed, 7, (uint64_t)t) - 0.5));
            f->ent[t] = (float)(0.05 + 2.45 * u01(seed, 8, (uint64_t)t));
            int prompt = t - f->off[b] < 1 + (b % 2);
            f->mask[t] = (uint8_t)(b != 3 && !prompt && u01(seed, 9, (uint64_t)t) > 0.1);
        }
    }
}

static int masked_in(const fbatch_t *f, int b) {
    int k = 0;
    for (int32_t t = f->off[b]; t < f->off[b + 1]; t++)
        k += f->mask[t];
    return k;
}

static double seq_ratio(const fbatch_t *f, int b) {
    double s = 0;
    int k = masked_in(f, b);
    for (int32_t t = f->off[b]; t < f->off[b + 1]; t++)
        if (f->mask[t])
            s += (double)f->logp[t] - f->old[t];
    return exp(s / k);
}

/* The ratio each masked token's clip decision uses. */
static double used_ratio(const fbatch_t *f, cfg_loss_t loss, int b, int32_t t) {
    return loss == CFG_LOSS_GSPO ? seq_ratio(f, b) : exp((double)f->logp[t] - f->old[t]);
}

/* 1 when no ratio is within MARGIN of a bound and the batch has clipped-low,
 * clipped-high and unclipped tokens (cispo: above and below its one bound). */
static int usable(const fbatch_t *f, const pl_opts_t *o) {
    double lo = 1 - o->clip_low, hi = 1 + o->clip_high;
    int low = 0, high = 0, none = 0;
    for (int b = 0; b < f->B; b++) {
        for (int32_t t = f->off[b]; t < f->off[b + 1]; t++) {
            if (!f->mask[t])
                continue;
            double r = used_ratio(f, o->loss, b, t), A = f->adv[b];
            if (fabs(r - lo) < MARGIN || fabs(r - hi) < MARGIN)
                return 0;
            if (o->loss == CFG_LOSS_CISPO) {
                low += r < hi;
                high += r > hi;
                none = 1;
            } else {
                low += A < 0 && r < lo;
                high += A > 0 && r > hi;
                none += !(A < 0 && r < lo) && !(A > 0 && r > hi);
            }
        }
    }
    return low > 0 && high > 0 && none > 0;
}

static int pick_batch(fbatch_t *f, const pl_opts_t *o, uint64_t seed0) {
    double dev = o->loss == CFG_LOSS_GSPO ? 0.12 : 0.8;
    for (uint64_t seed = seed0; seed < seed0 + 10000; seed++) {
        gen_batch(f, seed, dev);
        if (usable(f, o))
            return 1;
    }
    return 0;
}

static pl_batch_t view(const fbatch_t *f, inputs_t in) {
    pl_batch_t b = {f->B,
                    f->off,
                    f->logp,
                    f->old,
                    in.roll ? f->roll : NULL,
                    in.ref ? f->ref : NULL,
                    in.ent ? f->ent : NULL,
                    f->adv,
                    f->mask};
    return b;
}

/* ---- The double reference ---- */

/* KL estimators of x = log(ref / current) = ref_logp - logp. */
static double kl_ref(cfg_kl_estimator_t e, double x) {
    if (e == CFG_KL_K1)
        return -x;
    if (e == CFG_KL_K2)
        return 0.5 * x * x;
    return exp(x) - x - 1;
}

static double clampd(double x, double lo, double hi) {
    return x < lo ? lo : x > hi ? hi : x;
}

/* The per-token policy term at logp lp; stop-gradient quantities (the cispo
 * weight, gspo's sequence ratio) come from sg_lp instead. */
static double ref_pg(const pl_opts_t *o, double A, double lp, double old, double sg_lp,
                     double sg_seq_logmean) {
    double lo = 1 - o->clip_low, hi = 1 + o->clip_high;
    if (o->loss == CFG_LOSS_CISPO)
        return -fmin(exp(sg_lp - old), hi) * A * lp;
    double r = o->loss == CFG_LOSS_GSPO ? exp(sg_seq_logmean + lp - sg_lp) : exp(lp - old);
    return -fmin(r * A, clampd(r, lo, hi) * A);
}

/* The loss at logp lp (T) and entropy ent (T), with stop-gradient values
 * from sg (T). Metrics (when rm is not NULL) come from the unperturbed
 * values. Aggregation: per-sample sums first, then the mode's formula. */
static double ref_loss(pl_metrics_t *rm, const fbatch_t *f, inputs_t in, const pl_opts_t *o,
                       const pl_norm_t *n, const double *lp, const double *ent, const double *sg) {
    double PG = 0, KL = 0, ENT = 0;
    pl_metrics_t m;
    memset(&m, 0, sizeof m);
    double lo = 1 - o->clip_low, hi = 1 + o->clip_high;
    for (int b = 0; b < f->B; b++) {
        int k = masked_in(f, b);
        if (k == 0)
            continue;
        m.seqs++;
        double A = f->adv[b], sg_mean = 0, spg = 0, skl = 0, sent = 0;
        for (int32_t t = f->off[b]; t < f->off[b + 1]; t++)
            if (f->mask[t])
                sg_mean += (sg[t] - f->old[t]) / k;
        for (int32_t t = f->off[b]; t < f->off[b + 1]; t++) {
            if (!f->mask[t])
                continue;
            double w = 1;
            if (in.roll && o->tis_cap > 0)
                w = fmin(exp((double)f->old[t] - f->roll[t]), o->tis_cap);
            spg += w * ref_pg(o, A, lp[t], f->old[t], sg[t], sg_mean);
            if (in.ref)
                skl += kl_ref(o->kl_estimator, (double)f->ref[t] - lp[t]);
            if (in.ent)
                sent += ent[t];
            /* metrics */
            double rt = exp((double)f->logp[t] - f->old[t]);
            double r = o->loss == CFG_LOSS_GSPO ? exp(sg_mean) : rt;
            m.tokens++;
            m.ratio += r;
            m.approx_kl += rt - 1 - log(rt);
            if (o->loss == CFG_LOSS_CISPO) {
                m.clip_high += r > hi;
            } else {
                m.clip_low += A < 0 && r < lo;
                m.clip_high += A > 0 && r > hi;
            }
            if (in.roll) {
                double rho = exp((double)f->old[t] - f->roll[t]);
                m.mismatch_k3 += rho - 1 - log(rho);
                m.mismatch_k1 += (double)f->roll[t] - f->old[t];
                m.tis_clipped += o->tis_cap > 0 && rho > o->tis_cap;
            }
            if (in.ent)
                m.entropy_sum += f->ent[t];
        }
        double div;
        if (o->agg == CFG_AGG_TOKEN_MEAN)
            div = n->tokens;
        else if (o->agg == CFG_AGG_SEQ_MEAN_TOKEN_SUM)
            div = n->seqs * (o->seq_norm_const > 0 ? o->seq_norm_const : 1);
        else
            div = n->seqs * k;
        PG += spg / div;
        KL += skl / div;
        ENT += sent / div;
    }
    double L = PG + o->kl_coef * KL - o->entropy_coef * ENT;
    if (rm) {
        m.loss = L, m.pg = PG, m.kl = KL, m.entropy = ENT;
        *rm = m;
    }
    return L;
}

/* dL/dlogp and dL/dentropy by central differences. sg_moves: the
 * stop-gradient inputs move with logp (the exact gradient of the value). */
static void fd_grads(double *glp, double *gent, const fbatch_t *f, inputs_t in, const pl_opts_t *o,
                     const pl_norm_t *n, int sg_moves) {
    int T = ntok(f);
    double lp[MAXT], ent[MAXT], sg[MAXT];
    for (int t = 0; t < T; t++)
        lp[t] = sg[t] = f->logp[t], ent[t] = f->ent[t];
    for (int t = 0; t < T; t++) {
        double x = lp[t];
        lp[t] = x + FD_H;
        if (sg_moves)
            sg[t] = lp[t];
        double Lp = ref_loss(NULL, f, in, o, n, lp, ent, sg);
        lp[t] = x - FD_H;
        if (sg_moves)
            sg[t] = lp[t];
        double Lm = ref_loss(NULL, f, in, o, n, lp, ent, sg);
        lp[t] = sg[t] = x;
        glp[t] = (Lp - Lm) / (2 * FD_H);
        x = ent[t];
        ent[t] = x + FD_H;
        Lp = ref_loss(NULL, f, in, o, n, lp, ent, sg);
        ent[t] = x - FD_H;
        Lm = ref_loss(NULL, f, in, o, n, lp, ent, sg);
        ent[t] = x;
        gent[t] = (Lp - Lm) / (2 * FD_H);
    }
}

static double rel_err_dd(const double *a, const double *b, int n, double floor) {
    double maxb = floor, maxd = 0;
    for (int i = 0; i < n; i++) {
        maxb = fmax(maxb, fabs(b[i]));
        double d = fabs(a[i] - b[i]);
        if (!(d <= maxd))
            maxd = isnan(d) ? INFINITY : d;
    }
    return maxd / maxb;
}

/* Runs the library with prefilled gradient buffers and returns what it
 * added, in double. */
static int run_lib(double *glp, double *gent, pl_metrics_t *m, const fbatch_t *f, inputs_t in,
                   const pl_opts_t *o, const pl_norm_t *n) {
    int T = ntok(f);
    float dl[MAXT], de[MAXT], pl[MAXT], pe[MAXT];
    tu_fill(pl, (size_t)T, 71, -0.05f, 0.05f);
    tu_fill(pe, (size_t)T, 72, -0.05f, 0.05f);
    memcpy(dl, pl, sizeof(float) * (size_t)T);
    memcpy(de, pe, sizeof(float) * (size_t)T);
    memset(m, 0, sizeof *m);
    pl_batch_t b = view(f, in);
    int rc = policy_loss(dl, de, m, &b, o, n);
    for (int t = 0; t < T; t++) {
        glp[t] = (double)dl[t] - pl[t];
        gent[t] = (double)de[t] - pe[t];
    }
    return rc;
}

static void compare_metrics(const pl_metrics_t *got, const pl_metrics_t *want, const char *what) {
    static const char *names[] = {"loss",        "pg",         "kl",          "entropy",
                                  "tokens",      "seqs",       "clip_low",    "clip_high",
                                  "ratio",       "approx_kl",  "entropy_sum", "mismatch_k3",
                                  "mismatch_k1", "tis_clipped"};
    const double *g = (const double *)got, *w = (const double *)want;
    CU_ASSERT_EQUAL_FATAL(sizeof names / sizeof *names, sizeof(pl_metrics_t) / sizeof(double));
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        double err = fabs(g[i] - w[i]) / fmax(fabs(w[i]), 1e-3);
        if (!(err <= TOL_VAL))
            tu_report("%s: %s = %.12g, reference %.12g", what, names[i], g[i], w[i]);
        CU_ASSERT(err <= TOL_VAL);
    }
}

static const char *loss_name[] = {"ppo", "gspo", "cispo"};
static const char *agg_name[] = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"};

static pl_opts_t base_opts(cfg_loss_t loss, cfg_loss_agg_t agg) {
    pl_opts_t o = {.loss = loss,
                   .agg = agg,
                   .clip_low = loss == CFG_LOSS_GSPO ? 0.03 : 0.2,
                   .clip_high = loss == CFG_LOSS_GSPO ? 0.04 : 0.28,
                   .kl_coef = 0,
                   .kl_estimator = CFG_KL_K3,
                   .entropy_coef = 0,
                   .tis_cap = 0,
                   .seq_norm_const = 0};
    return o;
}

static void check_case(const fbatch_t *f, inputs_t in, const pl_opts_t *o, const char *what) {
    int T = ntok(f);
    pl_norm_t n = {0, 0};
    pl_norm_add(&n, f->off, f->mask, f->B);
    double glp[MAXT], gent[MAXT], flp[MAXT], fent[MAXT], lp[MAXT], ent[MAXT];
    pl_metrics_t m, rm;
    CU_ASSERT_EQUAL_FATAL(run_lib(glp, gent, &m, f, in, o, &n), 0);
    for (int t = 0; t < T; t++)
        lp[t] = f->logp[t], ent[t] = f->ent[t];
    ref_loss(&rm, f, in, o, &n, lp, ent, lp);
    compare_metrics(&m, &rm, what);
    fd_grads(flp, fent, f, in, o, &n, 0);
    char w2[200];
    snprintf(w2, sizeof w2, "%s dlogp", what);
    TU_ASSERT_CLOSE(rel_err_dd(glp, flp, T, 1e-3), TOL_GRAD, w2);
    snprintf(w2, sizeof w2, "%s dentropy", what);
    TU_ASSERT_CLOSE(rel_err_dd(gent, fent, T, 1e-3), TOL_GRAD, w2);
}

static void test_all_combinations(void) {
    int cases = 0;
    for (int loss = 0; loss < 3; loss++) {
        fbatch_t f;
        pl_opts_t probe = base_opts((cfg_loss_t)loss, CFG_AGG_TOKEN_MEAN);
        CU_ASSERT_FATAL(pick_batch(&f, &probe, 1000 + 100 * (uint64_t)loss));
        for (int agg = 0; agg < 3; agg++)
            for (int kl = -1; kl < 3; kl++)
                for (int tis = 0; tis < 2; tis++)
                    for (int ent = 0; ent < 2; ent++) {
                        pl_opts_t o = base_opts((cfg_loss_t)loss, (cfg_loss_agg_t)agg);
                        /* optional inputs also arrive when their term is off:
                         * metrics only, no gradient */
                        inputs_t in = {tis || ent, kl >= 0 || tis, ent || tis};
                        if (kl >= 0) {
                            o.kl_coef = 0.3;
                            o.kl_estimator = (cfg_kl_estimator_t)kl;
                        }
                        o.tis_cap = tis ? 1.3 : 0;
                        o.entropy_coef = ent ? 0.05 : 0;
                        o.seq_norm_const = ent ? 16 : 0;
                        char what[160];
                        snprintf(what, sizeof what, "%s %s kl=%d tis=%d ent=%d", loss_name[loss],
                                 agg_name[agg], kl, tis, ent);
                        check_case(&f, in, &o, what);
                        cases++;
                    }
    }
    CU_ASSERT_EQUAL(cases, 144);
}

/* With uniform per-token weights inside a sample (no TIS), GSPO-token's
 * gradient is the exact gradient of the sequence-level loss value. */
static void test_gspo_token_is_exact(void) {
    fbatch_t f;
    pl_opts_t o = base_opts(CFG_LOSS_GSPO, CFG_AGG_TOKEN_MEAN);
    CU_ASSERT_FATAL(pick_batch(&f, &o, 4242));
    inputs_t in = {0, 0, 0};
    for (int agg = 0; agg < 3; agg++) {
        o.agg = (cfg_loss_agg_t)agg;
        pl_norm_t n = {0, 0};
        pl_norm_add(&n, f.off, f.mask, f.B);
        double glp[MAXT], gent[MAXT], flp[MAXT], fent[MAXT];
        pl_metrics_t m;
        CU_ASSERT_EQUAL(run_lib(glp, gent, &m, &f, in, &o, &n), 0);
        fd_grads(flp, fent, &f, in, &o, &n, 1);
        TU_ASSERT_CLOSE(rel_err_dd(glp, flp, ntok(&f), 1e-3), TOL_GRAD, agg_name[agg]);
    }
}

static void test_ppo_worked(void) {
    /* One sample of three tokens, the first a prompt token; A = 1,
     * ratios e^0.1 = 1.1051709 (inside) and e^0.4 = 1.4918247 (clipped at
     * 1.28): token-mean loss -(1.1051709 + 1.28) / 2 = -1.19258545,
     * dL/dlogp = (0, -1.1051709 / 2, 0). */
    int32_t off[2] = {0, 3};
    float logp[3] = {-9, -1.0f, -2.0f}, old[3] = {-9, -1.1f, -2.4f}, adv[1] = {1};
    uint8_t mask[3] = {0, 1, 1};
    pl_batch_t b = {1, off, logp, old, NULL, NULL, NULL, adv, mask};
    pl_opts_t o = base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN);
    pl_norm_t n = {2, 1};
    float dl[3] = {0.5f, 0.5f, 0.5f}; /* accumulates */
    pl_metrics_t m = {0};
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b, &o, &n), 0);
    double r1 = exp((double)logp[1] - old[1]);
    CU_ASSERT(fabs(m.loss - (-(r1 + 1.28) / 2)) < 1e-12);
    CU_ASSERT(fabs(m.loss - (-1.19258545)) < 1e-6);
    CU_ASSERT_EQUAL(dl[0], 0.5f);
    CU_ASSERT(fabs(dl[1] - (0.5 - r1 / 2)) < 1e-7);
    CU_ASSERT_EQUAL(dl[2], 0.5f);
    CU_ASSERT_EQUAL(m.clip_high, 1);
    CU_ASSERT_EQUAL(m.clip_low, 0);
    /* cispo on the same tokens: weights min(r, 1.28); loss -(w1 (-1) + 1.28 (-2)) / 2 */
    o.loss = CFG_LOSS_CISPO;
    memset(&m, 0, sizeof m);
    dl[1] = dl[2] = 0;
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b, &o, &n), 0);
    CU_ASSERT(fabs(m.loss - (r1 + 2.56) / 2) < 1e-12);
    CU_ASSERT(fabs(dl[1] + r1 / 2) < 1e-7 && fabs(dl[2] + 0.64) < 1e-7);
    /* seq-mean-token-sum with Dr. GRPO's constant 4: the ppo token sum / (1 * 4) */
    o.loss = CFG_LOSS_PPO;
    o.agg = CFG_AGG_SEQ_MEAN_TOKEN_SUM;
    o.seq_norm_const = 4;
    memset(&m, 0, sizeof m);
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b, &o, &n), 0);
    CU_ASSERT(fabs(m.loss - (-(r1 + 1.28) / 4)) < 1e-12);
}

static void test_clip_fractions(void) {
    /* six tokens in two samples, clip [0.8, 1.28]:
     *   r 0.5  A -1: low clip     r 0.5 A +1: none (min picks r A)
     *   r 1.5  A +1: high clip    r 1.5 A -1: none
     *   r 1.0  A +1: none         r 1.1 A -1: none */
    double r[6] = {0.5, 1.5, 1.0, 0.5, 1.5, 1.1};
    int32_t off[3] = {0, 3, 6};
    float logp[6], old[6];
    float advs[6] = {-1, 1, 1, 1, -1, -1};
    uint8_t mask[6] = {1, 1, 1, 1, 1, 1};
    /* one sample per token so each has its own advantage */
    int32_t off6[7] = {0, 1, 2, 3, 4, 5, 6};
    for (int t = 0; t < 6; t++) {
        logp[t] = -1.0f;
        old[t] = (float)(-1.0 - log(r[t]));
    }
    pl_batch_t b = {6, off6, logp, old, NULL, NULL, NULL, advs, mask};
    pl_opts_t o = base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN);
    pl_norm_t n = {6, 6};
    float dl[6] = {0};
    pl_metrics_t m = {0};
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b, &o, &n), 0);
    pl_summary_t s = pl_summarize(&m);
    CU_ASSERT(fabs(s.clip_frac_low - 1.0 / 6) < 1e-12);
    CU_ASSERT(fabs(s.clip_frac_high - 1.0 / 6) < 1e-12);
    CU_ASSERT_EQUAL(dl[0], 0.0f); /* clipped tokens: no gradient */
    CU_ASSERT_EQUAL(dl[1], 0.0f);
    for (int t = 2; t < 6; t++)
        CU_ASSERT(dl[t] != 0.0f);
    CU_ASSERT(fabs(s.ratio_mean - 6.1 / 6) < 1e-6);
    /* cispo: only the upper bound; both r = 1.5 tokens are truncated */
    o.loss = CFG_LOSS_CISPO;
    memset(&m, 0, sizeof m);
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b, &o, &n), 0);
    CU_ASSERT_EQUAL(m.clip_high, 2);
    CU_ASSERT_EQUAL(m.clip_low, 0);
    /* gspo: two samples of three tokens with sequence ratios 0.5 (A -1, low)
     * and 1.5 (A +1, high): every token clipped, no gradient */
    float logp2[6], old2[6], adv2[2] = {-1, 1};
    double dr[6] = {0.1, -0.3, 0.2, 0.25, -0.05, -0.2}; /* zero-mean noise */
    for (int t = 0; t < 6; t++) {
        logp2[t] = -1.0f;
        old2[t] = (float)(-1.0 - (t < 3 ? log(0.5) : log(1.5)) - dr[t]);
    }
    pl_batch_t b2 = {2, off, logp2, old2, NULL, NULL, NULL, adv2, mask};
    o = base_opts(CFG_LOSS_GSPO, CFG_AGG_TOKEN_MEAN);
    memset(&m, 0, sizeof m);
    float dl2[6] = {0};
    CU_ASSERT_EQUAL(policy_loss(dl2, NULL, &m, &b2, &o, &n), 0);
    CU_ASSERT_EQUAL(m.clip_low, 3);
    CU_ASSERT_EQUAL(m.clip_high, 3);
    for (int t = 0; t < 6; t++)
        CU_ASSERT_EQUAL(dl2[t], 0.0f);
    CU_ASSERT(fabs(m.ratio - 3 * (0.5 + 1.5)) < 1e-5);
    /* TIS: old - rollout = log 2 on two of six tokens, cap 1.5 */
    float roll[6];
    for (int t = 0; t < 6; t++)
        roll[t] = old[t] - (t % 3 == 0 ? (float)log(2.0) : 0.0f);
    pl_batch_t b3 = {6, off6, logp, old, roll, NULL, NULL, advs, mask};
    o = base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN);
    o.tis_cap = 1.5;
    memset(&m, 0, sizeof m);
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, &m, &b3, &o, &n), 0);
    s = pl_summarize(&m);
    CU_ASSERT(fabs(s.tis_clip_frac - 2.0 / 6) < 1e-12);
    /* k3 of rho = 2: 2 - 1 - log 2; k1: rollout - old = -log 2 */
    CU_ASSERT(fabs(s.mismatch_k3 - 2 * (1 - log(2.0)) / 6) < 1e-6);
    CU_ASSERT(fabs(s.mismatch_k1 + 2 * log(2.0) / 6) < 1e-6);
}

/* Tokens with mask 0 hold NaN everywhere: nothing may read them. */
static void test_mask_respected(void) {
    fbatch_t f;
    pl_opts_t o = base_opts(CFG_LOSS_PPO, CFG_AGG_SEQ_MEAN_TOKEN_MEAN);
    CU_ASSERT_FATAL(pick_batch(&f, &o, 777));
    int T = ntok(&f);
    for (int t = 0; t < T; t++)
        if (!f.mask[t])
            f.logp[t] = f.old[t] = f.roll[t] = f.ref[t] = f.ent[t] = NAN;
    o.kl_coef = 0.2;
    o.entropy_coef = 0.1;
    o.tis_cap = 1.2;
    for (int loss = 0; loss < 3; loss++) {
        o.loss = (cfg_loss_t)loss;
        o.clip_low = loss == CFG_LOSS_GSPO ? 0.03 : 0.2;
        o.clip_high = loss == CFG_LOSS_GSPO ? 0.04 : 0.28;
        pl_norm_t n = {0, 0};
        pl_norm_add(&n, f.off, f.mask, f.B);
        float dl[MAXT], de[MAXT];
        for (int t = 0; t < T; t++)
            dl[t] = de[t] = 0.25f;
        pl_metrics_t m = {0};
        pl_batch_t b = view(&f, (inputs_t){1, 1, 1});
        CU_ASSERT_EQUAL(policy_loss(dl, de, &m, &b, &o, &n), 0);
        CU_ASSERT(isfinite(m.loss) && isfinite(m.mismatch_k3) && isfinite(m.entropy_sum));
        int untouched = 1, touched = 1;
        for (int t = 0; t < T; t++) {
            if (!f.mask[t])
                untouched &= dl[t] == 0.25f && de[t] == 0.25f;
            else
                touched &= isfinite(dl[t]) && dl[t] != 0.25f && de[t] != 0.25f;
        }
        CU_ASSERT(untouched);
        CU_ASSERT(touched);
        CU_ASSERT_EQUAL(m.tokens, n.tokens);
        CU_ASSERT_EQUAL(m.seqs, 5); /* sample 3 has no masked token */
    }
}

/* Two micro-batches with the global normaliser give the one-batch result. */
static void test_micro_batches(void) {
    fbatch_t f;
    pl_opts_t o = base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN);
    CU_ASSERT_FATAL(pick_batch(&f, &o, 31337));
    o.kl_coef = 0.1;
    o.entropy_coef = 0.02;
    o.tis_cap = 1.4;
    int T = ntok(&f);
    for (int agg = 0; agg < 3; agg++) {
        o.agg = (cfg_loss_agg_t)agg;
        pl_batch_t whole = view(&f, (inputs_t){1, 1, 1});
        pl_batch_t parts[2] = {whole, whole};
        parts[0].B = 2;
        parts[1].B = f.B - 2;
        parts[1].off = f.off + 2;
        parts[1].adv = f.adv + 2;
        pl_norm_t n = {0, 0}, n2 = {0, 0};
        pl_norm_add(&n, f.off, f.mask, f.B);
        pl_norm_add(&n2, parts[0].off, f.mask, parts[0].B);
        pl_norm_add(&n2, parts[1].off, f.mask, parts[1].B);
        CU_ASSERT(n.tokens == n2.tokens && n.seqs == n2.seqs);
        float dl1[MAXT] = {0}, de1[MAXT] = {0}, dl2[MAXT] = {0}, de2[MAXT] = {0};
        pl_metrics_t m1 = {0}, m2 = {0};
        CU_ASSERT_EQUAL(policy_loss(dl1, de1, &m1, &whole, &o, &n), 0);
        CU_ASSERT_EQUAL(policy_loss(dl2, de2, &m2, &parts[0], &o, &n), 0);
        CU_ASSERT_EQUAL(policy_loss(dl2, de2, &m2, &parts[1], &o, &n), 0);
        CU_ASSERT_EQUAL(memcmp(dl1, dl2, sizeof(float) * (size_t)T), 0);
        CU_ASSERT_EQUAL(memcmp(de1, de2, sizeof(float) * (size_t)T), 0);
        const double *a = (const double *)&m1, *b = (const double *)&m2;
        for (size_t i = 0; i < sizeof(pl_metrics_t) / sizeof(double); i++)
            CU_ASSERT(fabs(a[i] - b[i]) <= 1e-12 * fmax(1, fabs(a[i])));
        /* pl_metrics_add of two halves equals the accumulated struct */
        pl_metrics_t h0 = {0}, h1 = {0}, sum = {0};
        CU_ASSERT_EQUAL(policy_loss(dl2, de2, &h0, &parts[0], &o, &n), 0);
        CU_ASSERT_EQUAL(policy_loss(dl2, de2, &h1, &parts[1], &o, &n), 0);
        pl_metrics_add(&sum, &h0);
        pl_metrics_add(&sum, &h1);
        CU_ASSERT(memcmp(&sum, &m2, sizeof sum) == 0);
    }
}

static void test_errors(void) {
    fbatch_t f;
    gen_batch(&f, 5, 0.5);
    pl_opts_t o = base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN);
    pl_norm_t n = {0, 0};
    pl_norm_add(&n, f.off, f.mask, f.B);
    float dl[MAXT] = {0}, de[MAXT] = {0};
    pl_batch_t b = view(&f, (inputs_t){0, 0, 0});
    pl_norm_t small = {n.tokens - 1, n.seqs};
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &small), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "token normaliser") != NULL);
    o.agg = CFG_AGG_SEQ_MEAN_TOKEN_MEAN;
    small = (pl_norm_t){n.tokens, n.seqs - 1};
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &small), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "sequence normaliser") != NULL);
    o.kl_coef = 0.1;
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &n), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "ref_logp") != NULL);
    o.kl_coef = 0;
    o.entropy_coef = 0.1;
    b = view(&f, (inputs_t){0, 0, 1});
    CU_ASSERT_EQUAL(policy_loss(dl, NULL, NULL, &b, &o, &n), MO_EINVAL);
    o.entropy_coef = 0;
    o.clip_low = 1.0;
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &n), MO_EINVAL);
    o.clip_low = 0.2;
    o.tis_cap = NAN;
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &n), MO_EINVAL);
    o.tis_cap = 0;
    int32_t bad[3] = {0, 4, 2};
    b.B = 2;
    b.off = bad;
    CU_ASSERT_EQUAL(policy_loss(dl, de, NULL, &b, &o, &n), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "off[2]") != NULL);
    /* nothing was written by the refused calls */
    for (int t = 0; t < ntok(&f); t++)
        CU_ASSERT(dl[t] == 0.0f && de[t] == 0.0f);
}

static void test_opts_from_config(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    c.learner.advantage = CFG_ADV_DR_GRPO;
    c.learner.loss_agg = CFG_AGG_SEQ_MEAN_TOKEN_SUM;
    c.learner.clip_high = 0.31;
    pl_opts_t o = pl_opts_from_config(&c);
    CU_ASSERT_EQUAL(o.seq_norm_const, c.rollout.max_new_tokens);
    CU_ASSERT_EQUAL(o.clip_high, 0.31);
    CU_ASSERT_EQUAL(o.tis_cap, c.learner.tis_cap);
    c.learner.advantage = CFG_ADV_GRPO;
    o = pl_opts_from_config(&c);
    CU_ASSERT_EQUAL(o.seq_norm_const, 0);
    config_free(&c);
}

static void test_mismatch_filter(void) {
    /* sample 0: rollout = old; sample 1: old - rollout = 0.5 on its masked
     * tokens, k3 = e^0.5 - 1.5 = 0.1487213; sample 2: no masked token */
    int32_t off[4] = {0, 2, 5, 6};
    float old[6] = {-1, -2, -1, -0.5f, -3, -1}, roll[6];
    uint8_t mask[6] = {1, 1, 0, 1, 1, 0};
    for (int t = 0; t < 6; t++)
        roll[t] = old[t] - (t >= 2 && t < 5 ? 0.5f : 0.0f);
    roll[2] = NAN; /* unmasked: never read */
    double kl[3];
    CU_ASSERT_EQUAL(pl_mismatch_filter(kl, mask, off, old, roll, 3, 0), 0);
    CU_ASSERT(kl[0] == 0 && fabs(kl[1] - (exp(0.5) - 1.5)) < 1e-7 && kl[2] == 0);
    CU_ASSERT(mask[3] == 1);
    CU_ASSERT_EQUAL(pl_mismatch_filter(kl, mask, off, old, roll, 3, 0.2), 0);
    CU_ASSERT_EQUAL(pl_mismatch_filter(kl, mask, off, old, roll, 3, 0.1), 1);
    uint8_t want[6] = {1, 1, 0, 0, 0, 0};
    CU_ASSERT_EQUAL(memcmp(mask, want, 6), 0);
}

/* ---- PyTorch cross-check ---- */

static const char *torch_script =
    "import sys\n"
    "try:\n"
    "    import torch\n"
    "except Exception:\n"
    "    sys.exit(77)\n"
    "torch.set_default_dtype(torch.float64)\n"
    "tok = open(sys.argv[1]).read().split()\n"
    "pos = 0\n"
    "def nxt(k, f=float):\n"
    "    global pos\n"
    "    v = [f(x) for x in tok[pos:pos + k]]\n"
    "    pos += k\n"
    "    return v\n"
    "B, T = nxt(2, int)\n"
    "off = nxt(B + 1, int)\n"
    "adv = torch.tensor(nxt(B))\n"
    "cols = [torch.tensor(nxt(T)) for _ in range(6)]\n"
    "mask, logp0, old, roll, ref, ent0 = cols\n"
    "sid = torch.tensor(sum([[b] * (off[b + 1] - off[b]) for b in range(B)], []))\n"
    "A = adv[sid]\n"
    "ncase = nxt(1, int)[0]\n"
    "for _ in range(ncase):\n"
    "    loss, agg, est, klc, entc, cap, cl, ch, C = nxt(9)\n"
    "    lp = logp0.clone().requires_grad_(True)\n"
    "    ent = ent0.clone().requires_grad_(True)\n"
    "    n_i = torch.zeros(B).index_add_(0, sid, mask)\n"
    "    if loss == 0:\n"
    "        r = torch.exp(lp - old)\n"
    "        pg = torch.maximum(-A * r, -A * torch.clamp(r, 1 - cl, 1 + ch))\n"
    "    elif loss == 1:\n"
    "        sm = torch.zeros(B).index_add_(0, sid, (lp - old) * mask) / n_i.clamp(min=1)\n"
    "        s = torch.exp(lp - lp.detach() + sm.detach()[sid])\n"
    "        pg = torch.maximum(-A * s, -A * torch.clamp(s, 1 - cl, 1 + ch))\n"
    "    else:\n"
    "        w = torch.clamp(torch.exp(lp - old), max=1 + ch).detach()\n"
    "        pg = -w * A * lp\n"
    "    if cap > 0:\n"
    "        pg = pg * torch.clamp(torch.exp(old - roll), max=cap)\n"
    "    x = ref - lp\n"
    "    kl = [-x, 0.5 * x * x, torch.exp(x) - x - 1][int(est)]\n"
    "    t = (pg + klc * kl - entc * ent) * mask\n"
    "    per = torch.zeros(B).index_add_(0, sid, t)\n"
    "    nseq = (n_i > 0).sum()\n"
    "    if agg == 0:\n"
    "        L = t.sum() / mask.sum()\n"
    "    elif agg == 1:\n"
    "        L = per.sum() / (nseq * (C if C > 0 else 1))\n"
    "    else:\n"
    "        L = (per / n_i.clamp(min=1)).sum() / nseq\n"
    "    L.backward()\n"
    "    print('%.17g' % L.item())\n"
    "    print(' '.join('%.17g' % v for v in lp.grad.tolist()))\n"
    "    print(' '.join('%.17g' % v for v in ent.grad.tolist()))\n";

static void write_floats(FILE *fp, const float *x, int n) {
    for (int i = 0; i < n; i++)
        fprintf(fp, "%.17g ", (double)x[i]); /* exact */
    fprintf(fp, "\n");
}

static int write_torch_input(const char *path, const fbatch_t *f, const pl_opts_t *cases, int nc) {
    FILE *fp = fopen(path, "w");
    if (!fp)
        return -1;
    int T = ntok(f);
    fprintf(fp, "%d %d\n", f->B, T);
    for (int b = 0; b <= f->B; b++)
        fprintf(fp, "%d ", (int)f->off[b]);
    fprintf(fp, "\n");
    write_floats(fp, f->adv, f->B);
    for (int t = 0; t < T; t++)
        fprintf(fp, "%d ", f->mask[t]);
    fprintf(fp, "\n");
    write_floats(fp, f->logp, T);
    write_floats(fp, f->old, T);
    write_floats(fp, f->roll, T);
    write_floats(fp, f->ref, T);
    write_floats(fp, f->ent, T);
    fprintf(fp, "%d\n", nc);
    for (int c = 0; c < nc; c++) {
        const pl_opts_t *o = &cases[c];
        fprintf(fp, "%d %d %d %.17g %.17g %.17g %.17g %.17g %.17g\n", (int)o->loss, (int)o->agg,
                (int)o->kl_estimator, o->kl_coef, o->entropy_coef, o->tis_cap, o->clip_low,
                o->clip_high, o->seq_norm_const);
    }
    return fclose(fp);
}

static void test_torch_cross_check(void) {
    char dir[512], in[600], py[600], out[600], cmd[2400];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(in, sizeof in, "%s/batch.txt", dir);
    snprintf(py, sizeof py, "%s/ref.py", dir);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    /* a batch usable by every loss: pick with ppo's clips, check gspo's */
    fbatch_t f;
    pl_opts_t cases[6] = {base_opts(CFG_LOSS_PPO, CFG_AGG_TOKEN_MEAN),
                          base_opts(CFG_LOSS_PPO, CFG_AGG_SEQ_MEAN_TOKEN_MEAN),
                          base_opts(CFG_LOSS_GSPO, CFG_AGG_SEQ_MEAN_TOKEN_MEAN),
                          base_opts(CFG_LOSS_GSPO, CFG_AGG_TOKEN_MEAN),
                          base_opts(CFG_LOSS_CISPO, CFG_AGG_TOKEN_MEAN),
                          base_opts(CFG_LOSS_CISPO, CFG_AGG_SEQ_MEAN_TOKEN_SUM)};
    for (int c = 0; c < 6; c++) {
        cases[c].kl_coef = 0.2 + 0.1 * c;
        cases[c].kl_estimator = (cfg_kl_estimator_t)(c % 3);
        cases[c].entropy_coef = c % 2 ? 0.03 : 0;
        cases[c].tis_cap = c % 3 == 0 ? 1.25 : 0;
        cases[c].seq_norm_const = c == 5 ? 32 : 0;
        cases[c].clip_low = 0.2, cases[c].clip_high = 0.28; /* gspo on a wide range here */
    }
    CU_ASSERT_FATAL(pick_batch(&f, &cases[0], 99));
    FILE *fp = fopen(py, "w");
    CU_ASSERT_FATAL(fp != NULL);
    fputs(torch_script, fp);
    fclose(fp);
    CU_ASSERT_FATAL(write_torch_input(in, &f, cases, 6) == 0);
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' > '%s' 2>/dev/null", tu_python(), py, in, out);
    int rc = system(cmd);
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
        fprintf(stderr, "\n    skipped: %s with torch is not available (status %d)\n", tu_python(),
                rc);
        tu_rmtree(dir);
        return;
    }
    fp = fopen(out, "r");
    CU_ASSERT_FATAL(fp != NULL);
    int T = ntok(&f);
    inputs_t all = {1, 1, 1};
    for (int c = 0; c < 6; c++) {
        double L, tl[MAXT], te[MAXT], glp[MAXT], gent[MAXT];
        int ok = fscanf(fp, "%lf", &L) == 1;
        for (int t = 0; t < T; t++)
            ok &= fscanf(fp, "%lf", &tl[t]) == 1;
        for (int t = 0; t < T; t++)
            ok &= fscanf(fp, "%lf", &te[t]) == 1;
        CU_ASSERT_FATAL(ok);
        pl_norm_t n = {0, 0};
        pl_norm_add(&n, f.off, f.mask, f.B);
        pl_metrics_t m;
        CU_ASSERT_EQUAL(run_lib(glp, gent, &m, &f, all, &cases[c], &n), 0);
        char what[96];
        snprintf(what, sizeof what, "torch case %d (%s %s) loss", c, loss_name[cases[c].loss],
                 agg_name[cases[c].agg]);
        TU_ASSERT_CLOSE(fabs(m.loss - L) / fmax(fabs(L), 1e-3), 1e-12, what);
        snprintf(what, sizeof what, "torch case %d dlogp", c);
        TU_ASSERT_CLOSE(rel_err_dd(glp, tl, T, 1e-3), TOL_TORCH, what);
        snprintf(what, sizeof what, "torch case %d dentropy", c);
        TU_ASSERT_CLOSE(rel_err_dd(gent, te, T, 1e-3), TOL_TORCH, what);
    }
    fclose(fp);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"all combinations vs reference and finite differences", test_all_combinations},
        {"gspo-token gradient is exact without tis", test_gspo_token_is_exact},
        {"ppo, cispo and Dr. GRPO worked values", test_ppo_worked},
        {"clip, tis and mismatch metrics on crafted inputs", test_clip_fractions},
        {"mask respected", test_mask_respected},
        {"micro-batches add up", test_micro_batches},
        {"errors", test_errors},
        {"options from config", test_opts_from_config},
        {"mismatch filter", test_mismatch_filter},
        {"pytorch cross-check", test_torch_cross_check},
        CU_TEST_INFO_NULL,
    };
    return tu_main("policy_loss", tests);
}
