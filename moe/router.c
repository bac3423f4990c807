/* router: MoE expert selection, combine weights, their backward, balance loss and load. */
#include "moe/router.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

/* Token loops run in parallel above this many logits; each token is independent. */
#define ROUTER_PAR_MIN 32768

static const char *kind_name(router_kind_t k) {
    switch (k) {
    case ROUTER_SOFTMAX_TOPK: return "softmax_topk";
    case ROUTER_SIGMOID_GROUPED: return "sigmoid_grouped";
    case ROUTER_SOFTMAX_GROUPED: return "softmax_grouped";
    }
    return "?";
}

static int is_softmax(const router_cfg_t *c) {
    return c->kind != ROUTER_SIGMOID_GROUPED;
}

static float norm_eps(const router_cfg_t *c) {
    return c->kind == ROUTER_SOFTMAX_TOPK ? 0.0f : 1e-20f;
}

static int grouped(const router_cfg_t *c) {
    return c->kind != ROUTER_SOFTMAX_TOPK && c->n_group > 1;
}

void router_cfg_init(router_cfg_t *c, router_kind_t kind, int E, int K) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->E = E;
    c->K = K;
    c->routed_scaling_factor = 1.0f;
    c->n_group = 1;
    c->topk_group = 1;
}

int router_cfg_check(const router_cfg_t *c) {
    if (c->kind != ROUTER_SOFTMAX_TOPK && c->kind != ROUTER_SIGMOID_GROUPED &&
        c->kind != ROUTER_SOFTMAX_GROUPED)
        return mo_errorf(MO_ECONFIG, "router: unknown kind %d", (int)c->kind);
    if (c->E < 1)
        return mo_errorf(MO_ECONFIG, "router: E (routed experts) must be >= 1, got %d", c->E);
    if (c->K < 1 || c->K > c->E)
        return mo_errorf(MO_ECONFIG, "router: K (experts per token) must be in 1..%d, got %d", c->E,
                         c->K);
    if (!isfinite(c->routed_scaling_factor) || c->routed_scaling_factor <= 0.0f)
        return mo_errorf(MO_ECONFIG, "router: routed_scaling_factor must be > 0, got %g",
                         (double)c->routed_scaling_factor);
    if (c->e_score_correction_bias && c->kind != ROUTER_SIGMOID_GROUPED)
        return mo_errorf(MO_ECONFIG,
                         "router: e_score_correction_bias is used only by "
                         "sigmoid_grouped, not %s",
                         kind_name(c->kind));
    if (!grouped(c))
        return MO_OK;
    if (c->E % c->n_group != 0)
        return mo_errorf(MO_ECONFIG, "router: E = %d is not a multiple of n_group = %d", c->E,
                         c->n_group);
    int gs = c->E / c->n_group;
    if (c->kind == ROUTER_SIGMOID_GROUPED && gs < 2)
        return mo_errorf(MO_ECONFIG,
                         "router: sigmoid_grouped scores a group by its two best experts; "
                         "E / n_group = %d / %d leaves %d per group",
                         c->E, c->n_group, gs);
    if (c->topk_group < 1 || c->topk_group > c->n_group)
        return mo_errorf(MO_ECONFIG, "router: topk_group must be in 1..%d (n_group), got %d",
                         c->n_group, c->topk_group);
    if (c->K > c->topk_group * gs)
        return mo_errorf(MO_ECONFIG,
                         "router: K = %d exceeds the %d experts of topk_group = %d groups", c->K,
                         c->topk_group * gs, c->topk_group);
    return MO_OK;
}

/* Selection key: NaN ranks below everything. */
static inline float sel_key(float v) {
    return v == v ? v : -INFINITY;
}

/* idx (K) = the K largest of v (n), descending, ties to the lower index. */
static void topk_row(int32_t *idx, const float *v, int n, int K) {
    int m = 0;
    for (int e = 0; e < n; e++) {
        float x = sel_key(v[e]);
        if (m == K && !(x > sel_key(v[idx[K - 1]])))
            continue;
        int j = m < K ? m++ : K - 1;
        while (j > 0 && x > sel_key(v[idx[j - 1]])) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = e;
    }
}

/* Per-row selection scratch. */
typedef struct sel_scratch {
    float *choice;       /* (E) scores used for choosing */
    float *gscore;       /* (G) */
    int32_t *gidx;       /* (topk_group) */
    unsigned char *keep; /* (G) */
} sel_scratch_t;

static float group_score(const router_cfg_t *c, const float *v, int gs) {
    if (c->kind == ROUTER_SOFTMAX_GROUPED) {
        float best = sel_key(v[0]);
        for (int i = 1; i < gs; i++)
            if (sel_key(v[i]) > best)
                best = sel_key(v[i]);
        return best;
    }
    int32_t two[2];
    topk_row(two, v, gs, 2);
    return sel_key(v[two[0]]) + sel_key(v[two[1]]);
}

/* idx (K) for one token with scores s (E). */
static void select_row(const router_cfg_t *c, int32_t *idx, const float *s, sel_scratch_t *w) {
    int E = c->E;
    const float *b = c->e_score_correction_bias;
    for (int e = 0; e < E; e++)
        w->choice[e] = b ? s[e] + b[e] : s[e];
    if (grouped(c)) {
        int G = c->n_group, gs = E / G;
        for (int g = 0; g < G; g++)
            w->gscore[g] = group_score(c, w->choice + (size_t)g * gs, gs);
        topk_row(w->gidx, w->gscore, G, c->topk_group);
        memset(w->keep, 0, (size_t)G);
        for (int i = 0; i < c->topk_group; i++)
            w->keep[w->gidx[i]] = 1;
        float fill = c->group_mask_neg_inf ? -INFINITY : 0.0f;
        for (int g = 0; g < G; g++)
            if (!w->keep[g])
                for (int i = 0; i < gs; i++)
                    w->choice[(size_t)g * gs + i] = fill;
    }
    topk_row(idx, w->choice, E, c->K);
}

/* weight (K) from scores s (E) for the experts idx (K). */
static void weights_row(const router_cfg_t *c, float *weight, const int32_t *idx, const float *s) {
    int K = c->K;
    float sum = 0.0f;
    for (int i = 0; i < K; i++) {
        weight[i] = s[idx[i]];
        sum += weight[i];
    }
    if (c->norm_topk_prob) {
        float den = sum + norm_eps(c);
        for (int i = 0; i < K; i++)
            weight[i] /= den;
    }
    for (int i = 0; i < K; i++)
        weight[i] *= c->routed_scaling_factor;
}

static void scores(const kernels_t *k, const router_cfg_t *c, float *probs, const float *logits,
                   int T) {
    size_t n = (size_t)T * c->E;
    if (is_softmax(c)) {
        k->softmax_forward(probs, logits, T, c->E);
        return;
    }
    for (size_t i = 0; i < n; i++)
        probs[i] = 1.0f / (1.0f + expf(-logits[i]));
}

int router_forward(const kernels_t *k, const router_cfg_t *c, int32_t *idx, float *weight,
                   float *probs, const float *logits, int T) {
    TRY(router_cfg_check(c));
    if (T <= 0)
        return MO_OK;
    scores(k, c, probs, logits, T);
    int E = c->E, G = c->n_group > 1 ? c->n_group : 1;
    size_t bytes =
        sizeof(float) * ((size_t)E + (size_t)G) + sizeof(int32_t) * (size_t)G + (size_t)G;
    void *mem = calloc(1, bytes);
    if (!mem)
        return mo_errorf(MO_ENOMEM, "router: cannot allocate %zu bytes of selection scratch",
                         bytes);
    sel_scratch_t w;
    w.choice = mem;
    w.gscore = w.choice + E;
    w.gidx = (int32_t *)(w.gscore + G);
    w.keep = (unsigned char *)(w.gidx + G);
    for (int t = 0; t < T; t++) {
        const float *s = probs + (size_t)t * E;
        select_row(c, idx + (size_t)t * c->K, s, &w);
        weights_row(c, weight + (size_t)t * c->K, idx + (size_t)t * c->K, s);
    }
    free(mem);
    return MO_OK;
}

/* Copies the given experts into idx, checking range and repeats. */
static int take_given(const router_cfg_t *c, int32_t *idx, const void *given, dtype_t dt, int T) {
    if (dt != DT_U16 && dt != DT_I32)
        return mo_errorf(MO_EINVAL, "router replay: expert indices must be U16 or I32, got %s",
                         dtype_name(dt));
    int K = c->K;
    for (int t = 0; t < T; t++) {
        int32_t *row = idx + (size_t)t * K;
        for (int i = 0; i < K; i++) {
            size_t at = (size_t)t * K + i;
            int64_t e = dt == DT_U16 ? (int64_t)((const uint16_t *)given)[at]
                                     : (int64_t)((const int32_t *)given)[at];
            if (e < 0 || e >= c->E)
                return mo_errorf(MO_EMALFORMED,
                                 "router replay: token %d slot %d names expert %lld, outside "
                                 "[0, %d)",
                                 t, i, (long long)e, c->E);
            for (int j = 0; j < i; j++)
                if (row[j] == e)
                    return mo_errorf(MO_EMALFORMED,
                                     "router replay: token %d names expert %lld twice (slots %d "
                                     "and %d)",
                                     t, (long long)e, j, i);
            row[i] = (int32_t)e;
        }
    }
    return MO_OK;
}

int router_replay(const kernels_t *k, const router_cfg_t *c, int32_t *idx, float *weight,
                  float *probs, const float *logits, const void *given, dtype_t given_dt, int T) {
    TRY(router_cfg_check(c));
    if (T <= 0)
        return MO_OK;
    TRY(take_given(c, idx, given, given_dt, T));
    scores(k, c, probs, logits, T);
    for (int t = 0; t < T; t++)
        weights_row(c, weight + (size_t)t * c->K, idx + (size_t)t * c->K, probs + (size_t)t * c->E);
    return MO_OK;
}

/* The gradient of the weights with respect to the selected scores of one token:
 * ds_i = a * dw_i - b (see weights_row). */
typedef struct sel_grad {
    double a, b;
} sel_grad_t;

static sel_grad_t sel_grad_row(const router_cfg_t *c, const float *dw, const int32_t *ix,
                               const float *s) {
    sel_grad_t g = {c->routed_scaling_factor, 0.0};
    if (!c->norm_topk_prob)
        return g;
    float sumf = 0.0f;
    for (int i = 0; i < c->K; i++)
        sumf += s[ix[i]];
    double den = (double)(sumf + norm_eps(c)), dot = 0.0;
    for (int i = 0; i < c->K; i++)
        dot += (double)dw[i] * s[ix[i]];
    g.a = c->routed_scaling_factor / den;
    g.b = g.a * dot / den;
    return g;
}

void router_backward(const router_cfg_t *c, float *dlogits, const float *dweight,
                     const int32_t *idx, const float *probs, int T) {
    int K = c->K, E = c->E;
#pragma omp parallel for schedule(static) if ((size_t)T * E > ROUTER_PAR_MIN)
    for (int t = 0; t < T; t++) {
        const float *s = probs + (size_t)t * E;
        const int32_t *ix = idx + (size_t)t * K;
        const float *dw = dweight + (size_t)t * K;
        float *dl = dlogits + (size_t)t * E;
        sel_grad_t g = sel_grad_row(c, dw, ix, s);
        if (is_softmax(c)) {
            double dot = 0.0;
            for (int i = 0; i < K; i++)
                dot += (g.a * dw[i] - g.b) * s[ix[i]];
            for (int e = 0; e < E; e++)
                dl[e] += (float)(-(double)s[e] * dot);
            for (int i = 0; i < K; i++)
                dl[ix[i]] += (float)((g.a * dw[i] - g.b) * s[ix[i]]);
        } else {
            for (int i = 0; i < K; i++) {
                double si = s[ix[i]];
                dl[ix[i]] += (float)((g.a * dw[i] - g.b) * si * (1.0 - si));
            }
        }
    }
}

void router_load_stats(int64_t *counts, float *imbalance, const int32_t *idx, int T, int K, int E) {
    memset(counts, 0, sizeof(int64_t) * (size_t)E);
    size_t n = (size_t)T * K;
    for (size_t i = 0; i < n; i++)
        counts[idx[i]]++;
    if (!imbalance)
        return;
    if (n == 0) {
        *imbalance = 0.0f;
        return;
    }
    int64_t mx = 0;
    for (int e = 0; e < E; e++)
        if (counts[e] > mx)
            mx = counts[e];
    *imbalance = (float)((double)mx * E / (double)n);
}

/* Per-token normaliser of the balance loss's probabilities: 1 for softmax, sum s. */
static double prob_norm(const router_cfg_t *c, const float *s) {
    if (is_softmax(c))
        return 1.0;
    double sum = 0.0;
    for (int e = 0; e < c->E; e++)
        sum += s[e];
    return sum;
}

float router_aux_loss(const router_cfg_t *c, const int64_t *counts, const float *probs, int T,
                      float coef) {
    if (T <= 0)
        return 0.0f;
    int E = c->E;
    double slots = (double)T * c->K, loss = 0.0;
    for (int t = 0; t < T; t++) {
        const float *s = probs + (size_t)t * E;
        double z = prob_norm(c, s), acc = 0.0;
        for (int e = 0; e < E; e++)
            acc += (double)counts[e] / slots * s[e];
        loss += acc / z;
    }
    return (float)(coef * (double)E * loss / T);
}

void router_aux_loss_backward(const router_cfg_t *c, float *dlogits, float dloss,
                              const int64_t *counts, const float *probs, int T, float coef) {
    if (T <= 0)
        return;
    int E = c->E;
    double slots = (double)T * c->K, g0 = (double)dloss * coef * E / T;
#pragma omp parallel for schedule(static) if ((size_t)T * E > ROUTER_PAR_MIN)
    for (int t = 0; t < T; t++) {
        const float *s = probs + (size_t)t * E;
        float *dl = dlogits + (size_t)t * E;
        double z = prob_norm(c, s), dot = 0.0;
        /* g_e = g0 f_e is dL/dP-term per token; dot = sum_e g_e q_e with q = s / z. */
        for (int e = 0; e < E; e++)
            dot += g0 * ((double)counts[e] / slots) * s[e] / z;
        for (int e = 0; e < E; e++) {
            double g = g0 * ((double)counts[e] / slots);
            double se = s[e];
            if (is_softmax(c))
                dl[e] += (float)(se * (g - dot));
            else
                dl[e] += (float)((g - dot) / z * se * (1.0 - se));
        }
    }
}
