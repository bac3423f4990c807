/* sample: allocation, copying and validation of scored groups. */
#include "learner/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

const char *sample_finish_name(int finish) {
    switch (finish) {
    case SAMPLE_FINISH_LENGTH: return "length";
    case SAMPLE_FINISH_STOP_TOKEN: return "stop_token";
    case SAMPLE_FINISH_STOP_STRING: return "stop_string";
    }
    return "invalid";
}

int sample_finished(const sample_t *s) {
    return s->finish == SAMPLE_FINISH_STOP_TOKEN || s->finish == SAMPLE_FINISH_STOP_STRING;
}

void sample_group_destroy(sample_group_t **gp) {
    if (!gp || !*gp)
        return;
    sample_group_t *g = *gp;
    if (g->samples)
        for (int s = 0; s < g->n_samples; s++) {
            free(g->samples[s].tokens);
            free(g->samples[s].logprobs);
            free(g->samples[s].routing);
        }
    free(g->samples);
    free(g->prompt);
    free(g->prompt_routing);
    free(g);
    *gp = NULL;
}

static void *alloc_n(size_t n, size_t size, int *ok) {
    void *p = calloc(n ? n : 1, size);
    if (!p)
        *ok = 0;
    return p;
}

int sample_group_alloc(sample_group_t **out, uint64_t id, int prompt_len, const int *n_tokens,
                       int G, int M, int K, int prompt_routing, int routing) {
    *out = NULL;
    if (prompt_len < 1 || G < 1 || !n_tokens || ((prompt_routing || routing) && (M < 1 || K < 1)))
        return mo_errorf(MO_EINVAL,
                         "sample group: prompt_len %d and G %d must be >= 1, M %d and K %d >= 1 "
                         "with routing",
                         prompt_len, G, M, K);
    for (int s = 0; s < G; s++)
        if (n_tokens[s] < 1)
            return mo_errorf(MO_EINVAL, "sample group: sample %d has %d tokens, expected >= 1", s,
                             n_tokens[s]);
    sample_group_t *g = calloc(1, sizeof *g);
    if (!g)
        return mo_errorf(MO_ENOMEM, "sample group: out of memory");
    int ok = 1;
    size_t row = (size_t)M * (size_t)K;
    g->id = id;
    g->prompt_len = prompt_len;
    g->M = (prompt_routing || routing) ? M : 0;
    g->K = (prompt_routing || routing) ? K : 0;
    g->n_samples = G;
    g->prompt = alloc_n((size_t)prompt_len, sizeof *g->prompt, &ok);
    if (prompt_routing)
        g->prompt_routing = alloc_n((size_t)prompt_len * row, sizeof(uint16_t), &ok);
    g->samples = alloc_n((size_t)G, sizeof *g->samples, &ok);
    for (int s = 0; ok && s < G; s++) {
        sample_t *x = &g->samples[s];
        x->n_tokens = n_tokens[s];
        x->tokens = alloc_n((size_t)x->n_tokens, sizeof *x->tokens, &ok);
        x->logprobs = alloc_n((size_t)x->n_tokens, sizeof *x->logprobs, &ok);
        if (routing)
            x->routing = alloc_n((size_t)x->n_tokens * row, sizeof(uint16_t), &ok);
    }
    if (!ok) {
        sample_group_destroy(&g);
        return mo_errorf(MO_ENOMEM, "sample group: out of memory");
    }
    *out = g;
    return MO_OK;
}

int sample_group_copy(sample_group_t **out, const sample_group_t *g) {
    *out = NULL;
    int *lens = malloc(sizeof *lens * (size_t)(g->n_samples > 0 ? g->n_samples : 1));
    if (!lens)
        return mo_errorf(MO_ENOMEM, "sample group: out of memory");
    int any_routing = 0;
    for (int s = 0; s < g->n_samples; s++) {
        lens[s] = g->samples[s].n_tokens;
        any_routing |= g->samples[s].routing != NULL;
    }
    sample_group_t *c = NULL;
    int rc = sample_group_alloc(&c, g->id, g->prompt_len, lens, g->n_samples, g->M, g->K,
                                g->prompt_routing != NULL, any_routing);
    free(lens);
    TRY(rc);
    size_t row = (size_t)g->M * (size_t)g->K;
    memcpy(c->prompt, g->prompt, sizeof *c->prompt * (size_t)g->prompt_len);
    if (g->prompt_routing)
        memcpy(c->prompt_routing, g->prompt_routing,
               sizeof(uint16_t) * (size_t)g->prompt_len * row);
    for (int s = 0; s < g->n_samples; s++) {
        const sample_t *a = &g->samples[s];
        sample_t *b = &c->samples[s];
        memcpy(b->tokens, a->tokens, sizeof *b->tokens * (size_t)a->n_tokens);
        memcpy(b->logprobs, a->logprobs, sizeof *b->logprobs * (size_t)a->n_tokens);
        if (a->routing)
            memcpy(b->routing, a->routing, sizeof(uint16_t) * (size_t)a->n_tokens * row);
        else {
            free(b->routing);
            b->routing = NULL;
        }
        b->finish = a->finish;
        b->version_first = a->version_first;
        b->version_last = a->version_last;
        b->reward = a->reward;
        b->reward_version = a->reward_version;
    }
    *out = c;
    return MO_OK;
}

static int check_ids(const int32_t *ids, int n, int V, uint64_t gid, int s, const char *what) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V) {
            if (s < 0)
                return mo_errorf(MO_EMALFORMED, "group %llu: %s token %d is id %d, outside [0, %d)",
                                 (unsigned long long)gid, what, i, ids[i], V);
            return mo_errorf(MO_EMALFORMED,
                             "group %llu sample %d: %s token %d is id %d, outside [0, %d)",
                             (unsigned long long)gid, s, what, i, ids[i], V);
        }
    return MO_OK;
}

/* Rows of (rows, M, K) experts: each < E and distinct within its (token, layer). */
static int check_routing(const uint16_t *r, int rows, int M, int K, int E, uint64_t gid, int s) {
    for (int t = 0; t < rows; t++)
        for (int l = 0; l < M; l++) {
            const uint16_t *x = r + ((size_t)t * M + l) * K;
            for (int j = 0; j < K; j++) {
                int bad = x[j] >= E;
                for (int i = 0; i < j && !bad; i++)
                    bad = x[i] == x[j];
                if (bad)
                    return mo_errorf(MO_EMALFORMED,
                                     "group %llu %s%d: routing of token %d, MoE layer %d: expert "
                                     "%d is %s",
                                     (unsigned long long)gid, s < 0 ? "prompt" : "sample ",
                                     s < 0 ? 0 : s, t, l, x[j],
                                     x[j] >= E ? "out of range" : "repeated");
            }
        }
    return MO_OK;
}

static int check_sample(const sample_group_t *g, int s, int V, int M, int K, int E) {
    const sample_t *x = &g->samples[s];
    unsigned long long gid = (unsigned long long)g->id;
    if (x->n_tokens < 1 || !x->tokens || !x->logprobs)
        return mo_errorf(MO_EMALFORMED, "group %llu sample %d: %d tokens, expected >= 1", gid, s,
                         x->n_tokens);
    TRY(check_ids(x->tokens, x->n_tokens, V, g->id, s, "completion"));
    for (int i = 0; i < x->n_tokens; i++)
        if (!isfinite(x->logprobs[i]) || x->logprobs[i] > 1e-3f)
            return mo_errorf(MO_EMALFORMED,
                             "group %llu sample %d: logprob of token %d is %g, expected a finite "
                             "value <= 0",
                             gid, s, i, (double)x->logprobs[i]);
    if (x->finish < SAMPLE_FINISH_LENGTH || x->finish > SAMPLE_FINISH_STOP_STRING)
        return mo_errorf(MO_EMALFORMED,
                         "group %llu sample %d: finish reason %d is not one of "
                         "length, stop_token, stop_string",
                         gid, s, x->finish);
    if (x->version_last < x->version_first || x->version_first < 0)
        return mo_errorf(MO_EMALFORMED,
                         "group %llu sample %d: versions first %lld, last %lld (expected 0 <= "
                         "first <= last)",
                         gid, s, (long long)x->version_first, (long long)x->version_last);
    if (!isfinite(x->reward))
        return mo_errorf(MO_EMALFORMED, "group %llu sample %d: reward %g is not finite", gid, s,
                         (double)x->reward);
    if (x->routing)
        TRY(check_routing(x->routing, x->n_tokens, M, K, E, g->id, s));
    return MO_OK;
}

int sample_group_check(const sample_group_t *g, int V, int M, int K, int E) {
    if (!g)
        return mo_errorf(MO_EMALFORMED, "sample group: NULL");
    unsigned long long gid = (unsigned long long)g->id;
    if (g->prompt_len < 1 || !g->prompt)
        return mo_errorf(MO_EMALFORMED, "group %llu: prompt of %d tokens, expected >= 1", gid,
                         g->prompt_len);
    if (g->n_samples < 1 || !g->samples)
        return mo_errorf(MO_EMALFORMED, "group %llu: %d samples, expected >= 1", gid, g->n_samples);
    TRY(check_ids(g->prompt, g->prompt_len, V, g->id, -1, "prompt"));
    int has_routing = g->prompt_routing != NULL;
    for (int s = 0; s < g->n_samples; s++)
        has_routing |= g->samples[s].routing != NULL;
    if (has_routing && (g->M != M || g->K != K || M < 1))
        return mo_errorf(MO_EMALFORMED,
                         "group %llu: routing of %d MoE layers x %d experts, the model has %d x "
                         "%d",
                         gid, g->M, g->K, M, K);
    if (g->prompt_routing)
        TRY(check_routing(g->prompt_routing, g->prompt_len, M, K, E, g->id, -1));
    for (int s = 0; s < g->n_samples; s++)
        TRY(check_sample(g, s, V, M, K, E));
    return MO_OK;
}
