/* advantage: per-sample advantages from scalar rewards, zero-signal groups,
 * and overlong handling. Sums run in double. */
#include "learner/advantage.h"

#include <math.h>
#include <stddef.h>

#include "core/status.h"

adv_opts_t adv_opts_default(cfg_advantage_t kind) {
    adv_opts_t o = {kind, ADV_STD_EPS, ADV_EQUAL_TOL};
    return o;
}

static int kept(const uint8_t *keep, int i) {
    return keep == NULL || keep[i] != 0;
}

static int check_groups(const int32_t *group_off, int n_groups) {
    if (n_groups < 0)
        return mo_errorf(MO_EINVAL, "advantage: n_groups is %d, expected >= 0", n_groups);
    if (group_off == NULL || group_off[0] != 0)
        return mo_errorf(MO_EINVAL, "advantage: group_off[0] must be 0");
    for (int g = 0; g < n_groups; g++)
        if (group_off[g + 1] < group_off[g])
            return mo_errorf(MO_EINVAL, "advantage: group_off[%d] = %d < group_off[%d] = %d", g + 1,
                             (int)group_off[g + 1], g, (int)group_off[g]);
    return MO_OK;
}

/* Kept count, mean and the (max - min) span of samples lo .. hi-1. */
typedef struct {
    int n;
    double mean, span;
} moments_t;

static moments_t group_moments(const float *r, const uint8_t *keep, int lo, int hi) {
    moments_t m = {0, 0.0, 0.0};
    double sum = 0, mn = INFINITY, mx = -INFINITY;
    for (int i = lo; i < hi; i++) {
        if (!kept(keep, i))
            continue;
        m.n++;
        sum += r[i];
        mn = fmin(mn, r[i]);
        mx = fmax(mx, r[i]);
    }
    if (m.n > 0) {
        m.mean = sum / m.n;
        m.span = mx - mn;
    }
    return m;
}

static int is_flat(moments_t m, double tol) {
    return m.n < 2 || m.span <= tol;
}

/* Sample standard deviation (divides by n - 1) of kept samples about mean. */
static double sample_std(const float *r, const uint8_t *keep, int lo, int hi, moments_t m) {
    double ss = 0;
    for (int i = lo; i < hi; i++)
        if (kept(keep, i))
            ss += ((double)r[i] - m.mean) * ((double)r[i] - m.mean);
    return sqrt(ss / (m.n - 1));
}

/* Advantages of group lo .. hi-1 under a group estimator. */
static void group_adv(float *adv, const float *r, const uint8_t *keep, int lo, int hi,
                      const adv_opts_t *o) {
    moments_t m = group_moments(r, keep, lo, hi);
    int flat = is_flat(m, o->equal_tol);
    double scale = 1.0;
    if (!flat && o->kind == CFG_ADV_GRPO)
        scale = 1.0 / (sample_std(r, keep, lo, hi, m) + o->std_eps);
    else if (!flat && o->kind == CFG_ADV_RLOO)
        scale = (double)m.n / (m.n - 1);
    for (int i = lo; i < hi; i++)
        adv[i] = (flat || !kept(keep, i)) ? 0.0f : (float)(((double)r[i] - m.mean) * scale);
}

static int check_rewards(const float *reward, const uint8_t *keep, int N) {
    for (int i = 0; i < N; i++)
        if (kept(keep, i) && !isfinite(reward[i]))
            return mo_errorf(MO_EINVAL, "advantage: reward of sample %d is %g", i,
                             (double)reward[i]);
    return MO_OK;
}

static int check_opts(const adv_opts_t *o) {
    if (o == NULL)
        return mo_errorf(MO_EINVAL, "advantage: options are NULL");
    if ((int)o->kind < CFG_ADV_GRPO || o->kind > CFG_ADV_REINFORCE)
        return mo_errorf(MO_EINVAL, "advantage: unknown estimator %d", (int)o->kind);
    if (!(o->std_eps >= 0) || !(o->equal_tol >= 0) || isinf(o->std_eps) || isinf(o->equal_tol))
        return mo_errorf(MO_EINVAL, "advantage: std_eps %g and equal_tol %g must be finite, >= 0",
                         o->std_eps, o->equal_tol);
    return MO_OK;
}

static void fill_stats(adv_stats_t *st, const float *adv, const float *reward, const uint8_t *keep,
                       int N, int n_groups, int flat) {
    adv_stats_t s = {n_groups, flat, N, 0, 0, 0, 0, 0};
    moments_t m = group_moments(reward, keep, 0, N);
    s.kept = m.n;
    s.reward_mean = m.mean;
    double ss = 0, asum = 0;
    for (int i = 0; i < N; i++) {
        if (!kept(keep, i))
            continue;
        ss += ((double)reward[i] - m.mean) * ((double)reward[i] - m.mean);
        asum += adv[i];
        s.adv_abs_max = fmax(s.adv_abs_max, fabs((double)adv[i]));
    }
    if (m.n > 0) {
        s.reward_std = sqrt(ss / m.n);
        s.adv_mean = asum / m.n;
    }
    *st = s;
}

int adv_flat_groups(uint8_t *flat, const float *reward, const uint8_t *keep,
                    const int32_t *group_off, int n_groups, double tol) {
    TRY(check_groups(group_off, n_groups));
    int count = 0;
    for (int g = 0; g < n_groups; g++) {
        int f = is_flat(group_moments(reward, keep, group_off[g], group_off[g + 1]), tol);
        count += f;
        if (flat)
            flat[g] = (uint8_t)f;
    }
    return count;
}

int adv_compute(float *adv, const float *reward, const uint8_t *keep, const int32_t *group_off,
                int n_groups, const adv_opts_t *o, adv_stats_t *st) {
    TRY(check_opts(o));
    TRY(check_groups(group_off, n_groups));
    int N = group_off[n_groups];
    TRY(check_rewards(reward, keep, N));
    int flat = adv_flat_groups(NULL, reward, keep, group_off, n_groups, o->equal_tol);
    if (o->kind == CFG_ADV_REINFORCE) {
        moments_t m = group_moments(reward, keep, 0, N);
        int batch_flat = is_flat(m, o->equal_tol);
        for (int i = 0; i < N; i++)
            adv[i] = (batch_flat || !kept(keep, i)) ? 0.0f : (float)((double)reward[i] - m.mean);
    } else {
        for (int g = 0; g < n_groups; g++)
            group_adv(adv, reward, keep, group_off[g], group_off[g + 1], o);
    }
    if (st)
        fill_stats(st, adv, reward, keep, N, n_groups, flat);
    return MO_OK;
}

double overlong_penalty(int len, int max_new_tokens, int buffer) {
    int start = max_new_tokens - buffer;
    if (len <= start)
        return 0.0;
    if (len > max_new_tokens)
        return -1.0;
    return -(double)(len - start) / buffer;
}

int overlong_apply(float *reward, uint8_t *keep, const int32_t *len, const uint8_t *finished, int N,
                   cfg_overlong_t mode, int max_new_tokens, int buffer, overlong_stats_t *st) {
    overlong_stats_t s = {0, 0, 0, 0.0};
    if (max_new_tokens < 1)
        return mo_errorf(MO_EINVAL, "overlong: max_new_tokens is %d, expected >= 1",
                         max_new_tokens);
    if (mode == CFG_OVERLONG_PENALTY && (buffer < 1 || buffer > max_new_tokens))
        return mo_errorf(MO_EINVAL, "overlong: penalty buffer %d outside [1, max_new_tokens = %d]",
                         buffer, max_new_tokens);
    for (int i = 0; i < N; i++)
        if (len[i] < 0)
            return mo_errorf(MO_EINVAL, "overlong: sample %d has length %d", i, (int)len[i]);
    for (int i = 0; i < N; i++) {
        int truncated = !finished[i];
        s.truncated += truncated;
        if (mode == CFG_OVERLONG_FILTER && truncated && keep[i]) {
            keep[i] = 0;
            s.dropped++;
        } else if (mode == CFG_OVERLONG_PENALTY) {
            double p = overlong_penalty(len[i], max_new_tokens, buffer);
            reward[i] = (float)((double)reward[i] + p);
            s.penalised += p < 0;
            s.penalty_sum += p;
        }
    }
    if (st)
        *st = s;
    return MO_OK;
}

void adv_mask_dropped(uint8_t *mask, const int32_t *off, const uint8_t *keep, int B) {
    for (int b = 0; b < B; b++)
        if (!keep[b])
            for (int32_t t = off[b]; t < off[b + 1]; t++)
                mask[t] = 0;
}
