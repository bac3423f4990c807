/* sampler: next-token sampling from logits with the token's log-probability. */
#include "rollout/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/rng_hd.h"
#include "core/status.h"

typedef sampler_cand_t cand_t;

sampling_params_t sampling_params_default(void) {
    sampling_params_t p = {1.0f, 1.0f, 0, 0.0f};
    return p;
}

int sampling_params_check(const sampling_params_t *p) {
    if (!p)
        return mo_errorf(MO_EINVAL, "sampling: no parameters");
    if (!isfinite(p->temperature) || p->temperature < 0.0f)
        return mo_errorf(MO_EINVAL, "sampling: temperature %g must be finite and >= 0 (0 = greedy)",
                         (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return mo_errorf(MO_EINVAL, "sampling: top_p %g must be in (0, 1] (1 = off)",
                         (double)p->top_p);
    if (p->top_k < 0)
        return mo_errorf(MO_EINVAL, "sampling: top_k %d must be >= 0 (0 = off)", p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p < 1.0f))
        return mo_errorf(MO_EINVAL, "sampling: min_p %g must be in [0, 1) (0 = off)",
                         (double)p->min_p);
    return MO_OK;
}

int sampler_init(sampler_t *s, int V) {
    memset(s, 0, sizeof *s);
    if (V < 1)
        return mo_errorf(MO_EINVAL, "sampler: vocabulary size %d must be >= 1", V);
    s->V = V;
    s->e = malloc(sizeof(float) * (size_t)V);
    s->cand = malloc(sizeof(cand_t) * (size_t)V);
    if (!s->e || !s->cand) {
        sampler_free(s);
        return mo_errorf(MO_ENOMEM, "sampler: out of memory for a vocabulary of %d", V);
    }
    return MO_OK;
}

void sampler_free(sampler_t *s) {
    free(s->e);
    free(s->cand);
    s->e = NULL;
    s->cand = NULL;
}

double sampler_uniform(uint64_t seed, uint64_t request_id, uint64_t sample_index,
                       uint64_t token_index) {
    return rng_hd_sample_uniform(seed, request_id, sample_index, token_index);
}

/* Strict "a comes before b": larger weight first, then the lower id. */
static inline int before(const cand_t *a, const cand_t *b) {
    return a->e > b->e || (a->e == b->e && a->id < b->id);
}

static int cand_cmp(const void *pa, const void *pb) {
    const cand_t *a = pa, *b = pb;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

static void swap(cand_t *a, cand_t *b) {
    cand_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorders c (n) so that its first k are the k first in sorted order (any order among
 * them): quickselect with a median-of-three pivot under a total order. */
static void select_first(cand_t *c, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (before(&c[mid], &c[lo]))
            swap(&c[mid], &c[lo]);
        if (before(&c[hi], &c[lo]))
            swap(&c[hi], &c[lo]);
        if (before(&c[hi], &c[mid]))
            swap(&c[hi], &c[mid]);
        cand_t piv = c[mid];
        int i = lo, j = hi;
        while (i <= j) {
            while (before(&c[i], &piv))
                i++;
            while (before(&piv, &c[j]))
                j--;
            if (i <= j) {
                swap(&c[i], &c[j]);
                i++;
                j--;
            }
        }
        /* [lo, j] precede the pivot value, [i, hi] follow it; j < i. */
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            return;
    }
}

/* Fills s->e with exp(l / T - m) and returns through *lz the log-sum-exp of l / T, as
 * the logprob kernel forms it (m = max l / T; sum in double). MO_EMALFORMED for NaN or
 * +inf logits or when all are -inf. */
static int weights(sampler_t *s, const float *l, float T, double *lz) {
    int V = s->V;
    float mx = -INFINITY;
    for (int j = 0; j < V; j++) {
        if (isnan(l[j]) || l[j] == INFINITY)
            return mo_errorf(MO_EMALFORMED, "sampler: logit %d is %g", j, (double)l[j]);
        mx = l[j] > mx ? l[j] : mx;
    }
    if (mx == -INFINITY)
        return mo_errorf(MO_EMALFORMED, "sampler: every logit is -infinity");
    float m = mx / T;
    double sum = 0.0;
    for (int j = 0; j < V; j++) {
        float e = expf(l[j] / T - m);
        s->e[j] = e;
        sum += e;
    }
    *lz = (double)m + log(sum);
    return MO_OK;
}

static int32_t argmax(const float *l, int V) {
    int32_t best = 0;
    for (int j = 1; j < V; j++)
        if (l[j] > l[best])
            best = j;
    return best;
}

/* The kept candidates in draw order in s->cand[0 .. *n); *none = 1 when nothing is
 * truncated (the draw then walks ids 0 .. V-1 over s->e). */
static void truncate_cands(sampler_t *s, const sampling_params_t *p, int *n_out, int *none) {
    int V = s->V;
    *none = !(p->top_k > 0 && p->top_k < V) && p->top_p >= 1.0f && p->min_p <= 0.0f;
    if (*none) {
        *n_out = V;
        return;
    }
    cand_t *c = s->cand;
    for (int j = 0; j < V; j++) {
        c[j].e = s->e[j];
        c[j].id = j;
    }
    int n = V;
    double mass = 0.0; /* the top-k set's mass: top-p renormalises over it */
    if (p->top_k > 0 && p->top_k < V) {
        select_first(c, V, p->top_k);
        n = p->top_k;
    }
    for (int i = 0; i < n; i++)
        mass += c[i].e;
    /* Tokens below cut cannot be in the nucleus: every token before them leaves less
     * than n * cut = (1 - top_p) / 2 of the mass behind. */
    float cut = 0.0f;
    if (p->top_p < 1.0f)
        cut = (float)(0.5 * (1.0 - (double)p->top_p) * mass / n);
    if (p->min_p > 0.0f && p->min_p > cut) /* the largest weight is exp(0) = 1 */
        cut = p->min_p;
    if (cut > 0.0f) {
        int w = 0;
        for (int i = 0; i < n; i++)
            if (c[i].e >= cut)
                c[w++] = c[i];
        n = w;
    }
    qsort(c, (size_t)n, sizeof *c, cand_cmp);
    if (p->top_p < 1.0f) {
        double cum = 0.0, lim = (double)p->top_p * mass;
        int keep = 0;
        while (keep < n && cum < lim)
            cum += c[keep++].e;
        n = keep;
    }
    /* min-p removes a suffix of the sorted order, so its cut commutes with top-p's. */
    if (p->min_p > 0.0f) {
        int keep = 0;
        while (keep < n && c[keep].e >= p->min_p)
            keep++;
        n = keep;
    }
    *n_out = n;
}

int sampler_sample(sampler_t *s, const float *logits, const sampling_params_t *p, double u,
                   int32_t *token, float *logp) {
    TRY(sampling_params_check(p));
    double lz;
    if (p->temperature == 0.0f) {
        TRY(weights(s, logits, 1.0f, &lz));
        *token = argmax(logits, s->V);
        *logp = (float)((double)logits[*token] - lz);
        return MO_OK;
    }
    float T = p->temperature;
    TRY(weights(s, logits, T, &lz));
    int n, none;
    truncate_cands(s, p, &n, &none);
    int32_t pick = -1;
    if (none) {
        double total = 0.0;
        for (int j = 0; j < s->V; j++)
            total += s->e[j];
        double target = u * total, cum = 0.0;
        for (int j = 0; j < s->V && pick < 0; j++) {
            cum += s->e[j];
            if (target < cum)
                pick = j;
        }
        for (int j = s->V - 1; pick < 0 && j >= 0; j--) /* rounding at the very end */
            if (s->e[j] > 0.0f)
                pick = j;
    } else {
        const cand_t *c = s->cand;
        double total = 0.0;
        for (int i = 0; i < n; i++)
            total += c[i].e;
        double target = u * total, cum = 0.0;
        for (int i = 0; i < n && pick < 0; i++) {
            cum += c[i].e;
            if (target < cum)
                pick = c[i].id;
        }
        if (pick < 0)
            pick = c[n - 1].id;
    }
    *token = pick;
    *logp = (float)((double)(logits[pick] / T) - lz);
    return MO_OK;
}

int sampler_distribution(sampler_t *s, const float *logits, const sampling_params_t *p,
                         float *dist) {
    TRY(sampling_params_check(p));
    double lz;
    int V = s->V;
    if (p->temperature == 0.0f) {
        TRY(weights(s, logits, 1.0f, &lz));
        memset(dist, 0, sizeof(float) * (size_t)V);
        dist[argmax(logits, V)] = 1.0f;
        return 1;
    }
    TRY(weights(s, logits, p->temperature, &lz));
    int n, none;
    truncate_cands(s, p, &n, &none);
    double total = 0.0;
    if (none) {
        for (int j = 0; j < V; j++)
            total += s->e[j];
        for (int j = 0; j < V; j++)
            dist[j] = (float)(s->e[j] / total);
        return V;
    }
    const cand_t *c = s->cand;
    memset(dist, 0, sizeof(float) * (size_t)V);
    for (int i = 0; i < n; i++)
        total += c[i].e;
    for (int i = 0; i < n; i++)
        dist[c[i].id] = (float)(c[i].e / total);
    return n;
}
