/* ep_learner: rank 0 leads, the other ranks follow, in the expert-parallel learner. */
#include "learner/ep_learner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "learner/ep_shard.h"

/* ---- Groups as bytes -------------------------------------------------------- */

typedef struct wbuf {
    uint8_t *p;
    size_t n, cap;
    int oom;
} wbuf_t;

static void put(wbuf_t *w, const void *src, size_t n) {
    if (w->oom || n == 0)
        return;
    if (w->n + n > w->cap) {
        size_t cap = w->cap ? w->cap : 4096;
        while (cap < w->n + n)
            cap *= 2;
        uint8_t *p = realloc(w->p, cap);
        if (!p) {
            w->oom = 1;
            return;
        }
        w->p = p;
        w->cap = cap;
    }
    memcpy(w->p + w->n, src, n);
    w->n += n;
}

static void put_i64(wbuf_t *w, int64_t v) {
    put(w, &v, sizeof v);
}

static void pack_group(wbuf_t *w, const sample_group_t *g) {
    size_t row = (size_t)g->M * (size_t)g->K;
    put_i64(w, (int64_t)g->id);
    put_i64(w, g->prompt_len);
    put_i64(w, g->M);
    put_i64(w, g->K);
    put_i64(w, g->n_samples);
    put_i64(w, g->prompt_routing != NULL);
    for (int s = 0; s < g->n_samples; s++) {
        const sample_t *x = &g->samples[s];
        put_i64(w, x->n_tokens);
        put_i64(w, x->finish);
        put_i64(w, x->version_first);
        put_i64(w, x->version_last);
        put_i64(w, x->reward_version);
        put_i64(w, x->routing != NULL);
        put(w, &x->reward, sizeof x->reward);
    }
    put(w, g->prompt, sizeof(int32_t) * (size_t)g->prompt_len);
    if (g->prompt_routing)
        put(w, g->prompt_routing, sizeof(uint16_t) * (size_t)g->prompt_len * row);
    for (int s = 0; s < g->n_samples; s++) {
        const sample_t *x = &g->samples[s];
        put(w, x->tokens, sizeof(int32_t) * (size_t)x->n_tokens);
        put(w, x->logprobs, sizeof(float) * (size_t)x->n_tokens);
        if (x->routing)
            put(w, x->routing, sizeof(uint16_t) * (size_t)x->n_tokens * row);
    }
}

int ep_groups_pack(const sample_group_t *const *g, int n, uint8_t **buf, size_t *len) {
    wbuf_t w = {NULL, 0, 0, 0};
    for (int i = 0; i < n; i++) {
        if (!g[i] || g[i]->prompt_len < 1 || g[i]->n_samples < 1 || !g[i]->samples) {
            free(w.p);
            return mo_errorf(MO_EINVAL, "ep_learner: group %d has no prompt or no samples", i);
        }
        pack_group(&w, g[i]);
    }
    if (w.oom) {
        free(w.p);
        return mo_errorf(MO_ENOMEM, "ep_learner: out of memory packing %d groups", n);
    }
    *buf = w.p;
    *len = w.n;
    return MO_OK;
}

typedef struct rbuf {
    const uint8_t *p;
    size_t n, at;
    int bad;
} rbuf_t;

static void get(rbuf_t *r, void *dst, size_t n) {
    if (r->bad || n > r->n - r->at) {
        r->bad = 1;
        return;
    }
    memcpy(dst, r->p + r->at, n);
    r->at += n;
}

static int64_t get_i64(rbuf_t *r) {
    int64_t v = 0;
    get(r, &v, sizeof v);
    return v;
}

/* The sample headers of a group: lens (G) and the scalar fields into a scratch group. */
static int unpack_group(rbuf_t *r, sample_group_t **out) {
    uint64_t id = (uint64_t)get_i64(r);
    int64_t P = get_i64(r), M = get_i64(r), K = get_i64(r), G = get_i64(r);
    int64_t has_pr = get_i64(r);
    if (r->bad || P < 1 || P > INT32_MAX / 2 || G < 1 || G > 65536 || M < 0 || K < 0 ||
        M > 65536 || K > 65536)
        return mo_errorf(MO_EMALFORMED, "ep_learner: a group header is malformed");
    sample_t *hdr = calloc((size_t)G, sizeof *hdr);
    int *lens = calloc((size_t)G, sizeof *lens);
    int any_routing = 0;
    if (!hdr || !lens) {
        free(hdr);
        free(lens);
        return mo_errorf(MO_ENOMEM, "ep_learner: out of memory");
    }
    for (int64_t s = 0; s < G; s++) {
        int64_t n = get_i64(r);
        hdr[s].n_tokens = lens[s] = n > 0 && n < INT32_MAX / 2 ? (int)n : 0;
        hdr[s].finish = (int)get_i64(r);
        hdr[s].version_first = get_i64(r);
        hdr[s].version_last = get_i64(r);
        hdr[s].reward_version = get_i64(r);
        hdr[s].routing = get_i64(r) ? (uint16_t *)1 : NULL; /* a flag here */
        get(r, &hdr[s].reward, sizeof hdr[s].reward);
        any_routing |= hdr[s].routing != NULL;
    }
    sample_group_t *g = NULL;
    int rc = r->bad ? mo_errorf(MO_EMALFORMED, "ep_learner: a group is truncated")
                    : sample_group_alloc(&g, id, (int)P, lens, (int)G, (int)M, (int)K,
                                         has_pr != 0, any_routing);
    size_t row = (size_t)M * (size_t)K;
    if (rc == MO_OK) {
        get(r, g->prompt, sizeof(int32_t) * (size_t)P);
        if (g->prompt_routing)
            get(r, g->prompt_routing, sizeof(uint16_t) * (size_t)P * row);
        for (int64_t s = 0; s < G; s++) {
            sample_t *x = &g->samples[s];
            get(r, x->tokens, sizeof(int32_t) * (size_t)x->n_tokens);
            get(r, x->logprobs, sizeof(float) * (size_t)x->n_tokens);
            if (hdr[s].routing)
                get(r, x->routing, sizeof(uint16_t) * (size_t)x->n_tokens * row);
            else {
                free(x->routing);
                x->routing = NULL;
            }
            x->finish = hdr[s].finish;
            x->version_first = hdr[s].version_first;
            x->version_last = hdr[s].version_last;
            x->reward_version = hdr[s].reward_version;
            x->reward = hdr[s].reward;
        }
        if (r->bad) {
            sample_group_destroy(&g);
            rc = mo_errorf(MO_EMALFORMED, "ep_learner: a group is truncated");
        }
    }
    free(hdr);
    free(lens);
    *out = g;
    return rc;
}

void ep_groups_free(sample_group_t **g, int n) {
    if (!g)
        return;
    for (int i = 0; i < n; i++)
        sample_group_destroy(&g[i]);
    free(g);
}

int ep_groups_unpack(const uint8_t *buf, size_t len, int n, sample_group_t ***out) {
    *out = NULL;
    sample_group_t **g = calloc((size_t)(n > 0 ? n : 1), sizeof *g);
    if (!g)
        return mo_errorf(MO_ENOMEM, "ep_learner: out of memory for %d groups", n);
    rbuf_t r = {buf, len, 0, 0};
    for (int i = 0; i < n; i++) {
        int rc = unpack_group(&r, &g[i]);
        if (rc < 0) {
            ep_groups_free(g, n);
            return mo_error_wrap(rc, "group %d of %d", i, n);
        }
    }
    if (r.at != len) {
        ep_groups_free(g, n);
        return mo_errorf(MO_EMALFORMED, "ep_learner: %zu bytes after %d groups", len - r.at, n);
    }
    *out = g;
    return MO_OK;
}

/* ---- Rank 0 ------------------------------------------------------------------ */

/* 1 while an ep_lead_* call is between its header and the end of its collectives. */
static int g_inside;

static int send_header(comm_t *cm, int64_t cmd, int64_t a, int64_t b) {
    int64_t h[4] = {cmd, a, b, 0};
    g_inside = 1;
    return comm_bcast(cm, h, 4, DT_I64, 0);
}

/* The end of a led call: rc passes through, and a clean end clears g_inside. */
static int done(int rc) {
    if (rc == MO_OK)
        g_inside = 0;
    return rc;
}

int ep_lead_step(trainer_t *t, const sample_group_t *const *groups, int n, trainer_metrics_t *m) {
    if (!t->comm)
        return trainer_step(t, groups, n, m);
    uint8_t *buf = NULL;
    size_t len = 0;
    TRY(ep_groups_pack(groups, n, &buf, &len));
    int rc = send_header(t->comm, EP_CMD_STEP, n, (int64_t)len);
    if (rc == MO_OK)
        rc = comm_bcast(t->comm, buf, len, DT_U8, 0);
    free(buf);
    trainer_metrics_t local;
    if (!m)
        m = &local;
    if (rc == MO_OK)
        rc = trainer_step(t, groups, n, m);
    if (rc == MO_OK && m->trained) {
        const lora_adapter_t *whole;
        rc = trainer_whole_adapter(t, &whole);
    }
    return done(rc);
}

void ep_describe(const trainer_t *t, char *buf, size_t cap) {
    const model_t *m = t->model;
    int N = trainer_ranks(t), e0 = m->ep_n > 0 ? m->ep_e0 : 0, n = m->ep_n > 0 ? m->ep_n : m->E;
    size_t mine = model_expert_weight_bytes(m);
    snprintf(buf, cap,
             "expert parallel: rank %d of %d holds experts %d..%d of %d in each of %d MoE "
             "layers: %.1f MiB of expert weights (whole model %.1f MiB), %zu of %zu adapter "
             "parameters",
             trainer_rank(t), N, e0, e0 + n - 1, m->E, m->n_moe, (double)mine / (1 << 20),
             (double)mine * N / (1 << 20), t->adapter->n_params,
             t->ep ? t->ep->full_params : t->adapter->n_params);
}

int ep_lead_whole(trainer_t *t, const lora_adapter_t **out) {
    if (!t->comm)
        return trainer_whole_adapter(t, out);
    if (!t->whole) {
        char line[512];
        ep_describe(t, line, sizeof line);
        fprintf(stderr, "learner: %s\n", line);
    }
    TRY(send_header(t->comm, EP_CMD_WHOLE, 0, 0));
    return done(trainer_whole_adapter(t, out));
}

const float *ep_lead_params(const trainer_t *t) {
    return t->comm ? t->whole->params : t->adapter->params;
}

int ep_lead_save(trainer_t *t, const char *run_dir, const checkpoint_data_t *data,
                 const checkpoint_save_opts_t *opts, char *name, size_t cap) {
    if (!t->comm)
        return checkpoint_save_trainer(t, run_dir, data, opts, name, cap);
    TRY(send_header(t->comm, EP_CMD_SAVE, 0, 0));
    /* A save that fails on rank 0 is reported to every rank by the save itself. */
    int rc = checkpoint_save_trainer(t, run_dir, data, opts, name, cap);
    g_inside = 0;
    return rc;
}

int ep_lead_resume(trainer_t *t, const char *run_dir, int allow_config_change,
                   checkpoint_data_t *data, char *name, size_t cap, int *fell_back) {
    if (!t->comm)
        return checkpoint_resume_trainer(t, run_dir, allow_config_change, data, name, cap,
                                         fell_back);
    size_t len = strlen(run_dir) + 1;
    TRY(send_header(t->comm, EP_CMD_RESUME, allow_config_change, (int64_t)len));
    TRY(comm_bcast(t->comm, (void *)run_dir, len, DT_U8, 0));
    /* Every rank agrees on the outcome (checkpoint_resume_trainer). */
    int rc = checkpoint_resume_trainer(t, run_dir, allow_config_change, data, name, cap,
                                       fell_back);
    g_inside = 0;
    return rc;
}

int ep_lead_stop(comm_t *cm, int failed) {
    if (!cm || comm_size(cm) == 1)
        return MO_OK;
    if (g_inside)
        return mo_errorf(MO_ESTATE, "learner: rank 0 failed inside a collective step; the other "
                                    "ranks cannot be stopped cleanly");
    int64_t h[4] = {EP_CMD_STOP, failed ? 1 : 0, 0, 0};
    return comm_bcast(cm, h, 4, DT_I64, 0);
}

/* ---- Followers ---------------------------------------------------------------- */

static int follow_step(trainer_t *t, int64_t n, int64_t len) {
    if (n < 0 || n > INT32_MAX || len < 0)
        return mo_errorf(MO_EMALFORMED, "ep_learner: step of %lld groups, %lld bytes",
                         (long long)n, (long long)len);
    uint8_t *buf = malloc((size_t)(len > 0 ? len : 1));
    if (!buf)
        return mo_errorf(MO_ENOMEM, "ep_learner: out of memory for %lld bytes", (long long)len);
    int rc = comm_bcast(t->comm, buf, (size_t)len, DT_U8, 0);
    sample_group_t **g = NULL;
    if (rc == MO_OK)
        rc = ep_groups_unpack(buf, (size_t)len, (int)n, &g);
    free(buf);
    trainer_metrics_t m;
    if (rc == MO_OK)
        rc = trainer_step(t, (const sample_group_t *const *)g, (int)n, &m);
    ep_groups_free(g, (int)n);
    if (rc == MO_OK && m.trained) {
        const lora_adapter_t *whole;
        rc = trainer_whole_adapter(t, &whole);
    }
    return rc;
}

static int follow_resume(trainer_t *t, int64_t allow, int64_t len) {
    if (len < 1 || len > 65536)
        return mo_errorf(MO_EMALFORMED, "ep_learner: run directory of %lld bytes",
                         (long long)len);
    char *dir = malloc((size_t)len);
    if (!dir)
        return mo_errorf(MO_ENOMEM, "ep_learner: out of memory");
    int rc = comm_bcast(t->comm, dir, (size_t)len, DT_U8, 0);
    dir[len - 1] = '\0';
    if (rc == MO_OK)
        rc = checkpoint_resume_trainer(t, dir, (int)allow, NULL, NULL, 0, NULL);
    free(dir);
    return rc;
}

int ep_follow(trainer_t *t) {
    if (!t->comm)
        return mo_errorf(MO_EINVAL, "ep_learner: a follower needs a communicator of > 1 ranks");
    for (;;) {
        int64_t h[4];
        TRY(comm_bcast(t->comm, h, 4, DT_I64, 0));
        const lora_adapter_t *whole;
        switch (h[0]) {
        case EP_CMD_STOP:
            return h[1] ? mo_errorf(MO_ESTATE, "learner rank 0 failed; rank %d stops",
                                    trainer_rank(t))
                        : MO_OK;
        case EP_CMD_STEP: TRY(follow_step(t, h[1], h[2])); break;
        case EP_CMD_WHOLE: TRY(trainer_whole_adapter(t, &whole)); break;
        case EP_CMD_SAVE: {
            int rc = checkpoint_save_trainer(t, "", NULL, NULL, NULL, 0);
            if (rc < 0) /* rank 0's failure: it decides whether the job goes on */
                fprintf(stderr, "learner rank %d: %s\n", trainer_rank(t), mo_last_error());
            break;
        }
        case EP_CMD_RESUME: {
            int rc = follow_resume(t, h[1], h[2]);
            if (rc < 0) /* every rank fails alike; rank 0 then stops the job */
                fprintf(stderr, "learner rank %d: %s\n", trainer_rank(t), mo_last_error());
            break;
        }
        default:
            return mo_errorf(MO_EMALFORMED, "ep_learner: unknown command %lld", (long long)h[0]);
        }
    }
}
