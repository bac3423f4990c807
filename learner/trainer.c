/* trainer: one RL step of the learner over scored groups. Pipeline: docs/rl.md, "Learner". */
#include "learner/trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/rng.h"
#include "core/status.h"
#include "learner/actor_exec.h"
#include "learner/ep_shard.h"
#include "lora/peft.h"
#include "moe/moe_ep.h"

/* One kept sample: the sequence prompt + completion. */
typedef struct seq {
    const sample_group_t *g;
    int s;       /* sample index in its group */
    int P, n, T; /* prompt, completion and sequence tokens */
    int32_t off; /* first token in the step arrays */
    float adv;
    int staleness;
} seq_t;

/* A packed micro-batch, gathered from the step arrays. */
typedef struct mb {
    int T, B;
    int32_t *tokens, *pos, *tgt;       /* (T) */
    int32_t *cu;                       /* (B + 1) */
    float *logp, *ent;                 /* (T) forward outputs */
    float *dlogp, *dent;               /* (T) loss gradients */
    float *old, *roll, *ref, *ent_old; /* (T) gathered per-token inputs of the loss */
    uint8_t *mask;                     /* (T) */
    uint8_t *has_rec;                  /* (T) */
    uint16_t *replay, *route, *rec;    /* (T, M, K) */
    float *adv;                        /* (B) */
    /* Expert parallelism: this rank's run of sequences b0 .. b1 - 1 (tokens t0 .. t1 - 1)
     * of the last forward, and staging buffers for the all-gathers. */
    int b0, b1, t0, t1;
    int32_t *cu_loc; /* (B + 1) */
    float *stage;    /* (T) */
    uint16_t *stage16; /* (T, M, K) */
} mb_t;

struct trainer_work {
    arena_t ar; /* everything below lives here; reset each step */
    /* The valid groups and their samples. */
    int ng, N;
    const sample_group_t **groups; /* (ng) */
    int32_t *group_off;            /* (ng + 1) */
    float *reward;                 /* (N) */
    uint8_t *keep;                 /* (N) */
    int32_t *len;                  /* (N) completion tokens */
    uint8_t *finished;             /* (N) */
    float *adv;                    /* (N) */
    uint8_t *flat;                 /* (ng) */
    int *staleness;                /* (N) */
    /* The kept sequences, concatenated. */
    int S;
    seq_t *seqs; /* (S) */
    int32_t Ttot;
    int32_t *tokens;                   /* (Ttot) */
    uint8_t *mask;                     /* (Ttot) 1 at positions that predict a completion token */
    float *roll, *old, *ref, *ent_old; /* (Ttot) */
    uint8_t *has_rec;                  /* (Ttot) the token carries a recorded routing */
    uint16_t *rec;               /* (Ttot, M, K) recorded routing (rows without a record: 0) */
    uint16_t *replay;            /* (Ttot, M, K) what training replays, or NULL */
    int *order;                  /* (S) */
    int *starts;                 /* (S + 1) micro-batch boundaries within order */
    int64_t *load;               /* (M, E) */
    int64_t *agree_n, *agree_ok; /* (M) */
    int64_t fwd_tokens;          /* tokens forwarded this step */
    mb_t mb;
    int mb_cap; /* tokens a micro-batch buffer holds */
};

#define ARENA_N(ptr, ar, n)                                                                        \
    do {                                                                                           \
        (ptr) = arena_alloc((ar), sizeof(*(ptr)) * (size_t)((n) > 0 ? (n) : 1));                   \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "trainer step buffers");                               \
    } while (0)

trainer_opts_t trainer_opts_default(void) {
    trainer_opts_t o = {NULL, TRAINER_MISMATCH_DROP_SAMPLES, 1, NULL, NULL};
    return o;
}

/* ---- Construction -------------------------------------------------------- */

static int hashed_key(const char *section, const char *key) {
    /* comm: how the ranks exchange rows, not what they compute */
    static const char *const learner_skip[] = {"steps", "checkpoint_every", "keep_checkpoints",
                                               "comm"};
    if (!strcmp(section, "run"))
        return !strcmp(key, "seed");
    if (!strcmp(section, "model"))
        return !strcmp(key, "dtype") || !strcmp(key, "routing_replay");
    if (!strcmp(section, "lora"))
        return 1;
    if (!strcmp(section, "rollout"))
        return !strcmp(key, "temperature") || !strcmp(key, "max_new_tokens");
    if (!strcmp(section, "learner")) {
        for (size_t i = 0; i < sizeof learner_skip / sizeof *learner_skip; i++)
            if (!strcmp(key, learner_skip[i]))
                return 0;
        return 1;
    }
    return 0;
}

static uint64_t fnv1a(uint64_t h, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

uint64_t trainer_config_hash(const moerl_config_t *cfg) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return 0;
    config_dump(cfg, f);
    fclose(f);
    uint64_t h = 14695981039346656037ull;
    char section[64] = "";
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        if (n > 0 && line[0] != '#' && line[0] != ' ') {
            size_t k = n < sizeof section ? n : sizeof section - 1;
            memcpy(section, line, k);
            section[k] = '\0';
            char *colon = strchr(section, ':');
            if (colon)
                *colon = '\0';
        } else if (n > 2 && line[0] == ' ') {
            char key[64];
            const char *p = line;
            while (*p == ' ')
                p++;
            size_t k = 0;
            while (k + 1 < sizeof key && p[k] && p[k] != ':' && p[k] != '\n') {
                key[k] = p[k];
                k++;
            }
            key[k] = '\0';
            if (hashed_key(section, key)) {
                h = fnv1a(h, section, strlen(section));
                h = fnv1a(h, ".", 1);
                h = fnv1a(h, p, n - (size_t)(p - line));
                h = fnv1a(h, "\n", 1);
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return h;
}

uint64_t trainer_lora_seed(const moerl_config_t *cfg) {
    if (cfg->lora.init_seed != 0)
        return (uint64_t)cfg->lora.init_seed;
    return rng_stream_id("lora.init", (uint64_t)cfg->run.seed, 0);
}

/* Expert parallelism: this rank's shard of the adapter (and of the initial one); the
 * routers and norms trained in full are replicated on every rank like the attention
 * adapters. */
static int make_shard(trainer_t *t, const lora_config_t *lc, int router, int norms) {
    model_t *m = t->model;
    TRY(ep_shard_new(&t->ep, t->comm, lc, m->modules, m->n_modules, m->n_moe > 0 ? m->E : 0,
                     &t->adapter));
    if (router || norms) {
        TRY(model_adapter_add_full(m, t->adapter, router, norms));
        TRY(ep_shard_add_full(t->ep, t->adapter));
    }
    if (!t->opts.init_adapter)
        return MO_OK;
    lora_adapter_t *whole = NULL;
    TRY(ep_shard_full_new(t->ep, &whole));
    int rc = peft_load(whole, t->opts.init_adapter);
    if (rc == MO_OK)
        ep_shard_extract(t->ep, whole->params, t->adapter->params);
    lora_adapter_destroy(&whole);
    return rc < 0 ? mo_error_wrap(rc, "trainer: initial adapter %s", t->opts.init_adapter)
                  : MO_OK;
}

static int make_adapter(trainer_t *t, const moerl_config_t *cfg) {
    lora_config_t lc = {.rank = cfg->lora.rank,
                        .alpha = (float)cfg->lora.alpha,
                        .rslora = cfg->lora.rslora,
                        .dropout = (float)cfg->lora.dropout,
                        .seed = trainer_lora_seed(cfg),
                        .no_grads = 0,
                        .targets = (const char *const *)cfg->lora.targets.items,
                        .n_targets = cfg->lora.targets.n};
    int full = cfg->lora.train_router || cfg->lora.train_norms;
    if (t->comm)
        return make_shard(t, &lc, cfg->lora.train_router, cfg->lora.train_norms);
    TRY(lora_adapter_new(&t->adapter, &lc, t->model->modules, t->model->n_modules));
    if (full)
        TRY(model_adapter_add_full(t->model, t->adapter, cfg->lora.train_router,
                                   cfg->lora.train_norms));
    if (t->opts.init_adapter) {
        int rc = peft_load(t->adapter, t->opts.init_adapter);
        if (rc < 0)
            return mo_error_wrap(rc, "trainer: initial adapter %s", t->opts.init_adapter);
    }
    return MO_OK;
}

int trainer_no_decay(optim_t *o, const lora_adapter_t *ad) {
    for (int i = ad->n_tensors - ad->n_full; i < ad->n_tensors; i++)
        if (ad->tensors[i].shape[1] == 1)
            TRY(optim_no_decay(o, ad->tensors[i].offset, ad->tensors[i].numel));
    return MO_OK;
}

int trainer_new(trainer_t **out, const moerl_config_t *cfg, model_t *model,
                const trainer_opts_t *opts) {
    *out = NULL;
    trainer_t *t = calloc(1, sizeof *t);
    if (!t)
        return mo_errorf(MO_ENOMEM, "trainer: out of memory");
    t->opts = opts ? *opts : trainer_opts_default();
    t->lc = cfg->learner;
    t->model = model;
    int rc = MO_OK;
    if (!model) {
        model_opts_t mo = {.recompute = cfg->model.recompute};
        rc = model_open(&t->model, cfg->model.path, &mo);
        t->own_model = rc == MO_OK;
    }
    if (rc == MO_OK && t->opts.comm && comm_size(t->opts.comm) > 1) {
        t->comm = t->opts.comm;
        rc = model_set_comm(t->model, t->comm);
        if (rc == MO_OK && t->opts.device_comm)
            rc = model_set_device_comm(t->model, t->opts.device_comm);
    }
    if (rc == MO_OK)
        rc = make_adapter(t, cfg);
    if (rc == MO_OK) {
        optim_hp_t hp = optim_hp_from_config(&cfg->learner);
        rc = optim_init(&t->optim, t->adapter->n_params, &hp, NULL);
    }
    if (rc == MO_OK)
        rc = trainer_no_decay(&t->optim, t->adapter);
    if (rc < 0) {
        trainer_destroy(&t);
        return rc;
    }
    model_t *m = t->model;
    t->pl = pl_opts_from_config(cfg);
    t->adv = adv_opts_default(cfg->learner.advantage);
    t->max_new_tokens = cfg->rollout.max_new_tokens;
    t->temperature = cfg->rollout.temperature > 0 ? (float)cfg->rollout.temperature : 1.0f;
    t->M = m->n_moe;
    t->E = m->n_moe > 0 ? m->E : 0;
    t->K = m->n_moe > 0 ? m->K : 0;
    t->routing_replay = cfg->model.routing_replay && t->M > 0;
    t->seed = (uint64_t)cfg->run.seed;
    t->config_hash = trainer_config_hash(cfg);
    t->agreement = calloc((size_t)t->M + 1, sizeof *t->agreement);
    t->imbalance = calloc((size_t)t->M + 1, sizeof *t->imbalance);
    t->w = calloc(1, sizeof *t->w);
    if (!t->agreement || !t->imbalance || !t->w) {
        trainer_destroy(&t);
        return mo_errorf(MO_ENOMEM, "trainer: out of memory");
    }
    arena_init(&t->w->ar, 0);
    rc = model_set_adapter(m, t->adapter);
    if (rc == MO_OK)
        rc = actor_exec_new(&t->exec, m, cfg->run.device);
    if (rc < 0) {
        trainer_destroy(&t);
        return rc;
    }
    *out = t;
    return MO_OK;
}

void trainer_destroy(trainer_t **tp) {
    if (!tp || !*tp)
        return;
    trainer_t *t = *tp;
    actor_exec_destroy(&t->exec);
    if (t->model && !t->own_model && t->model->adapter == t->adapter)
        model_set_adapter(t->model, NULL);
    if (t->own_model)
        model_destroy(&t->model);
    lora_adapter_destroy(&t->adapter);
    optim_free(&t->optim);
    lora_adapter_destroy(&t->whole);
    optim_free(&t->whole_optim);
    ep_shard_destroy(&t->ep);
    if (t->w) {
        arena_free(&t->w->ar);
        free(t->w);
    }
    free(t->agreement);
    free(t->imbalance);
    free(t);
    *tp = NULL;
}

/* ---- Collecting the batch ------------------------------------------------ */

static void note_once(trainer_metrics_t *m, const char *msg) {
    if (!m->note[0])
        snprintf(m->note, sizeof m->note, "%s", msg);
}

/* Valid groups into the sample arrays; malformed groups and stale samples counted. */
static int collect(trainer_t *t, const sample_group_t *const *groups, int n, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    const model_t *md = t->model;
    int N = 0;
    for (int i = 0; i < n; i++)
        N += groups[i] && groups[i]->n_samples > 0 ? groups[i]->n_samples : 0;
    ARENA_N(w->groups, &w->ar, n);
    ARENA_N(w->group_off, &w->ar, n + 1);
    ARENA_N(w->reward, &w->ar, N);
    ARENA_N(w->keep, &w->ar, N);
    ARENA_N(w->len, &w->ar, N);
    ARENA_N(w->finished, &w->ar, N);
    ARENA_N(w->adv, &w->ar, N);
    ARENA_N(w->flat, &w->ar, n);
    ARENA_N(w->staleness, &w->ar, N);
    w->ng = w->N = 0;
    w->group_off[0] = 0;
    double rs = 0, rss = 0;
    int valid = 0;
    for (int i = 0; i < n; i++) {
        m->groups++;
        const sample_group_t *g = groups[i];
        m->samples += g && g->n_samples > 0 ? g->n_samples : 0;
        if (sample_group_check(g, md->V, t->M, t->K, t->E) < 0) {
            m->malformed_groups++;
            note_once(m, mo_last_error());
            continue;
        }
        w->groups[w->ng++] = g;
        for (int s = 0; s < g->n_samples; s++) {
            const sample_t *x = &g->samples[s];
            int64_t lag = t->version - x->version_first;
            int j = w->N++;
            w->reward[j] = x->reward;
            w->len[j] = x->n_tokens;
            w->finished[j] = (uint8_t)sample_finished(x);
            w->staleness[j] = (int)(lag < 0 ? -1 : lag > 1000000 ? 1000000 : lag);
            w->keep[j] = lag >= 0 && lag <= t->lc.max_staleness;
            if (!w->keep[j]) {
                m->stale_samples++;
                continue;
            }
            if (x->reward_version > t->reward_version)
                t->reward_version = x->reward_version;
            rs += x->reward;
            rss += (double)x->reward * x->reward;
            valid++;
        }
        w->group_off[w->ng] = w->N;
    }
    if (valid > 0) {
        m->reward_mean = rs / valid;
        double var = rss / valid - m->reward_mean * m->reward_mean;
        m->reward_std = var > 0 ? sqrt(var) : 0.0;
    }
    return MO_OK;
}

/* Overlong handling, dynamic sampling and advantages on the kept samples. */
static int advantages(trainer_t *t, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    if (w->N == 0)
        return MO_OK;
    overlong_stats_t os;
    TRY(overlong_apply(w->reward, w->keep, w->len, w->finished, w->N, t->lc.overlong,
                       t->max_new_tokens, t->lc.overlong_buffer, &os));
    m->overlong_truncated = os.truncated;
    m->overlong_dropped = os.dropped;
    m->overlong_penalised = os.penalised;
    int nflat = adv_flat_groups(w->flat, w->reward, w->keep, w->group_off, w->ng, t->adv.equal_tol);
    TRY(nflat);
    m->flat_groups = nflat;
    if (t->lc.dynamic_sampling)
        for (int g = 0; g < w->ng; g++) {
            if (!w->flat[g])
                continue;
            int had = 0;
            for (int j = w->group_off[g]; j < w->group_off[g + 1]; j++) {
                had |= w->keep[j];
                w->keep[j] = 0;
            }
            m->skipped_groups += had;
        }
    adv_stats_t st;
    TRY(adv_compute(w->adv, w->reward, w->keep, w->group_off, w->ng, &t->adv, &st));
    m->adv_abs_max = st.adv_abs_max;
    return MO_OK;
}

/* The kept samples as sequences in the step arrays. */
static int layout(trainer_t *t) {
    trainer_work_t *w = t->w;
    int M = t->M, K = t->K;
    size_t row = (size_t)M * K;
    int S = 0;
    int64_t Ttot = 0;
    for (int j = 0; j < w->N; j++)
        S += w->keep[j];
    ARENA_N(w->seqs, &w->ar, S);
    w->S = 0;
    for (int g = 0; g < w->ng; g++)
        for (int j = w->group_off[g]; j < w->group_off[g + 1]; j++) {
            if (!w->keep[j])
                continue;
            const sample_group_t *gr = w->groups[g];
            seq_t *q = &w->seqs[w->S++];
            q->g = gr;
            q->s = j - w->group_off[g];
            q->P = gr->prompt_len;
            q->n = gr->samples[q->s].n_tokens;
            q->T = q->P + q->n;
            q->off = (int32_t)Ttot;
            q->adv = w->adv[j];
            q->staleness = w->staleness[j];
            Ttot += q->T;
            if (Ttot > INT32_MAX / 2)
                return mo_errorf(MO_EINVAL, "trainer: a step of more than %d tokens",
                                 INT32_MAX / 2);
        }
    w->Ttot = (int32_t)Ttot;
    ARENA_N(w->tokens, &w->ar, Ttot);
    ARENA_N(w->mask, &w->ar, Ttot);
    ARENA_N(w->roll, &w->ar, Ttot);
    ARENA_N(w->old, &w->ar, Ttot);
    ARENA_N(w->ref, &w->ar, Ttot);
    ARENA_N(w->ent_old, &w->ar, Ttot);
    ARENA_N(w->has_rec, &w->ar, Ttot);
    ARENA_N(w->rec, &w->ar, (size_t)Ttot * (row ? row : 1));
    w->replay = NULL;
    if (t->routing_replay)
        ARENA_N(w->replay, &w->ar, (size_t)Ttot * row);
    for (int i = 0; i < w->S; i++) {
        const seq_t *q = &w->seqs[i];
        const sample_t *x = &q->g->samples[q->s];
        int32_t *tok = w->tokens + q->off;
        memcpy(tok, q->g->prompt, sizeof *tok * (size_t)q->P);
        memcpy(tok + q->P, x->tokens, sizeof *tok * (size_t)q->n);
        memset(w->mask + q->off, 0, (size_t)q->T);
        memset(w->roll + q->off, 0, sizeof(float) * (size_t)q->T);
        memset(w->ref + q->off, 0, sizeof(float) * (size_t)q->T);
        for (int k = 0; k < q->n; k++) {
            w->mask[q->off + q->P - 1 + k] = 1;
            w->roll[q->off + q->P - 1 + k] = x->logprobs[k];
        }
        uint8_t *hr = w->has_rec + q->off;
        memset(hr, 0, (size_t)q->T);
        if (!row)
            continue;
        uint16_t *rec = w->rec + (size_t)q->off * row;
        memset(rec, 0, sizeof *rec * (size_t)q->T * row);
        if (q->g->prompt_routing) {
            memcpy(rec, q->g->prompt_routing, sizeof *rec * (size_t)q->P * row);
            memset(hr, 1, (size_t)q->P);
        }
        if (x->routing) {
            memcpy(rec + (size_t)q->P * row, x->routing, sizeof *rec * (size_t)q->n * row);
            memset(hr + q->P, 1, (size_t)q->n);
        }
        if (w->replay)
            memcpy(w->replay + (size_t)q->off * row, rec, sizeof *rec * (size_t)q->T * row);
    }
    return MO_OK;
}

/* ---- Micro-batches -------------------------------------------------------- */

/* Greedy packing of order[0..n) under micro_batch_tokens: starts (n + 1) receives the
 * boundaries; returns the number of micro-batches. */
static int pack(const trainer_t *t, const int *order, int n, int *starts) {
    const seq_t *seqs = t->w->seqs;
    int64_t cap = t->lc.micro_batch_tokens, used = 0;
    int nb = 0;
    for (int i = 0; i < n; i++) {
        int T = seqs[order[i]].T;
        if (i == 0 || used + T > cap) {
            starts[nb++] = i;
            used = 0;
        }
        used += T;
    }
    starts[nb] = n;
    return nb;
}

static int mb_alloc(trainer_t *t) {
    trainer_work_t *w = t->w;
    mb_t *b = &w->mb;
    int cap = (int)(t->lc.micro_batch_tokens < w->Ttot ? t->lc.micro_batch_tokens : w->Ttot);
    for (int i = 0; i < w->S; i++)
        if (w->seqs[i].T > cap)
            cap = w->seqs[i].T;
    size_t row = (size_t)t->M * t->K;
    w->mb_cap = cap;
    ARENA_N(b->tokens, &w->ar, cap);
    ARENA_N(b->pos, &w->ar, cap);
    ARENA_N(b->tgt, &w->ar, cap);
    ARENA_N(b->cu, &w->ar, w->S + 1);
    ARENA_N(b->logp, &w->ar, cap);
    ARENA_N(b->ent, &w->ar, cap);
    ARENA_N(b->dlogp, &w->ar, cap);
    ARENA_N(b->dent, &w->ar, cap);
    ARENA_N(b->old, &w->ar, cap);
    ARENA_N(b->roll, &w->ar, cap);
    ARENA_N(b->ref, &w->ar, cap);
    ARENA_N(b->ent_old, &w->ar, cap);
    ARENA_N(b->mask, &w->ar, cap);
    ARENA_N(b->has_rec, &w->ar, cap);
    ARENA_N(b->replay, &w->ar, (size_t)cap * (row ? row : 1));
    ARENA_N(b->route, &w->ar, (size_t)cap * (row ? row : 1));
    ARENA_N(b->rec, &w->ar, (size_t)cap * (row ? row : 1));
    ARENA_N(b->adv, &w->ar, w->S);
    ARENA_N(b->cu_loc, &w->ar, w->S + 1);
    ARENA_N(b->stage, &w->ar, cap);
    ARENA_N(b->stage16, &w->ar, (size_t)cap * (row ? row : 1));
    ARENA_N(w->order, &w->ar, w->S);
    ARENA_N(w->starts, &w->ar, w->S + 1);
    return MO_OK;
}

/* Gathers the sequences order[i0..i1) into the micro-batch buffers. */
static void mb_gather(trainer_t *t, const int *order, int i0, int i1) {
    trainer_work_t *w = t->w;
    mb_t *b = &w->mb;
    size_t row = (size_t)t->M * t->K;
    int T = 0;
    b->B = i1 - i0;
    b->cu[0] = 0;
    for (int i = i0; i < i1; i++) {
        const seq_t *q = &w->seqs[order[i]];
        size_t o = (size_t)q->off, n = (size_t)q->T;
        memcpy(b->tokens + T, w->tokens + o, sizeof(int32_t) * n);
        memcpy(b->mask + T, w->mask + o, n);
        memcpy(b->old + T, w->old + o, sizeof(float) * n);
        memcpy(b->roll + T, w->roll + o, sizeof(float) * n);
        memcpy(b->ref + T, w->ref + o, sizeof(float) * n);
        memcpy(b->ent_old + T, w->ent_old + o, sizeof(float) * n);
        memcpy(b->has_rec + T, w->has_rec + o, n);
        if (row) {
            memcpy(b->rec + (size_t)T * row, w->rec + o * row, sizeof(uint16_t) * n * row);
            if (w->replay)
                memcpy(b->replay + (size_t)T * row, w->replay + o * row,
                       sizeof(uint16_t) * n * row);
        }
        b->adv[i - i0] = q->adv;
        T += q->T;
        b->cu[i - i0 + 1] = T;
    }
    b->T = T;
    model_batch_next_token(b->pos, b->tgt, b->tokens, b->cu, b->B);
}

/* Rank r's run of the micro-batch's sequences: b0 .. b1 - 1. */
static void mb_run(const trainer_t *t, const mb_t *b, int r, int *b0, int *b1) {
    int N = t->comm ? comm_size(t->comm) : 1;
    *b0 = (int)((int64_t)b->B * r / N);
    *b1 = (int)((int64_t)b->B * (r + 1) / N);
}

/* Every rank's part of buf (T rows of `width` elements of dt, this rank's rows at t0 ..
 * t1 - 1) into buf on every rank, through stage. */
static int mb_allgather(trainer_t *t, void *buf, void *stage, size_t width, dtype_t dt) {
    mb_t *b = &t->w->mb;
    int N = comm_size(t->comm);
    int64_t *counts = malloc(sizeof *counts * 2 * (size_t)N), *displs = counts + N;
    if (!counts)
        return mo_errorf(MO_ENOMEM, "trainer: out of memory for %d ranks", N);
    for (int r = 0; r < N; r++) {
        int b0, b1;
        mb_run(t, b, r, &b0, &b1);
        counts[r] = (int64_t)(b->cu[b1] - b->cu[b0]) * (int64_t)width;
        displs[r] = (int64_t)b->cu[b0] * (int64_t)width;
    }
    size_t es = dtype_size(dt);
    int64_t mine = counts[comm_rank(t->comm)];
    memcpy(stage, (char *)buf + (size_t)displs[comm_rank(t->comm)] * es, (size_t)mine * es);
    int rc = comm_allgatherv(t->comm, stage, mine, buf, counts, displs, dt);
    free(counts);
    return rc;
}

/* Forward of the gathered micro-batch: replay (T, M, K) or NULL, routing out or NULL.
 * With expert parallelism this rank forwards its run of sequences and the outputs of
 * every rank's run are all-gathered into b->logp, ent and routing. */
static int mb_forward(trainer_t *t, const uint16_t *replay, uint16_t *routing, float *ent,
                      int for_backward) {
    mb_t *b = &t->w->mb;
    size_t row = (size_t)t->M * t->K;
    b->b0 = 0;
    b->b1 = b->B;
    if (t->comm)
        mb_run(t, b, comm_rank(t->comm), &b->b0, &b->b1);
    b->t0 = b->cu[b->b0];
    b->t1 = b->cu[b->b1];
    for (int i = b->b0; i <= b->b1; i++)
        b->cu_loc[i - b->b0] = b->cu[i] - b->t0;
    model_batch_t mbatch = {.T = b->t1 - b->t0,
                            .B = b->b1 - b->b0,
                            .tokens = b->tokens + b->t0,
                            .positions = b->pos + b->t0,
                            .cu_seqlens = b->cu_loc,
                            .targets = b->tgt + b->t0,
                            .temperature = t->temperature,
                            .replay = replay ? replay + (size_t)b->t0 * row : NULL,
                            .routing = routing ? routing + (size_t)b->t0 * row : NULL};
    t->w->fwd_tokens += b->T;
    TRY(actor_exec_forward(t->exec, &mbatch, b->logp + b->t0, ent ? ent + b->t0 : NULL,
                           for_backward));
    if (!t->comm)
        return MO_OK;
    TRY(mb_allgather(t, b->logp, b->stage, 1, DT_F32));
    if (ent)
        TRY(mb_allgather(t, ent, b->stage, 1, DT_F32));
    if (routing)
        TRY(mb_allgather(t, routing, b->stage16, row, DT_U16));
    return MO_OK;
}

static int same_set(const uint16_t *a, const uint16_t *b, int K) {
    for (int i = 0; i < K; i++) {
        int found = 0;
        for (int j = 0; j < K && !found; j++)
            found = a[i] == b[j];
        if (!found)
            return 0;
    }
    return 1;
}

/* Routing agreement of the learner's own routing (b->route) with the recorded one. */
static void count_agreement(trainer_t *t) {
    trainer_work_t *w = t->w;
    const mb_t *b = &w->mb;
    int M = t->M, K = t->K;
    for (int p = 0; p < b->T; p++) {
        if (!b->has_rec[p])
            continue;
        for (int l = 0; l < M; l++) {
            size_t o = ((size_t)p * M + l) * K;
            w->agree_n[l]++;
            w->agree_ok[l] += same_set(b->route + o, b->rec + o, K);
        }
    }
}

static void count_load(trainer_t *t) {
    const model_t *m = t->model;
    for (int l = 0; l < t->M; l++)
        for (int e = 0; e < t->E; e++)
            t->w->load[(size_t)l * t->E + e] += m->stats[l].load[e];
}

/* ---- The pass without gradients ----------------------------------------- */

/* Old logprobs, entropy, own routing and reference logprobs of the micro-batch of
 * order[i0..i1) (natural order: a contiguous range of the step arrays). */
static int old_pass_mb(trainer_t *t, int i0, int i1, int with_ref) {
    trainer_work_t *w = t->w;
    mb_t *b = &w->mb;
    size_t row = (size_t)t->M * t->K;
    mb_gather(t, w->order, i0, i1);
    int32_t base = w->seqs[w->order[i0]].off;
    int any_rec = 0, all_rec = 1;
    for (int p = 0; p < b->T; p++) {
        any_rec |= b->has_rec[p];
        all_rec &= b->has_rec[p];
    }
    int replay = w->replay != NULL;
    int need_free = !replay || !all_rec || (t->opts.measure_routing && any_rec);
    if (need_free) {
        TRY(mb_forward(t, NULL, row ? b->route : NULL, b->ent, 0));
        if (row)
            count_agreement(t);
        if (replay) /* rows without a record replay the learner's own routing */
            for (int p = 0; p < b->T; p++)
                if (!b->has_rec[p]) {
                    memcpy(w->replay + ((size_t)base + p) * row, b->route + (size_t)p * row,
                           sizeof(uint16_t) * row);
                    memcpy(b->replay + (size_t)p * row, b->route + (size_t)p * row,
                           sizeof(uint16_t) * row);
                }
    }
    if (replay)
        TRY(mb_forward(t, b->replay, NULL, b->ent, 0));
    count_load(t);
    memcpy(w->old + base, b->logp, sizeof(float) * (size_t)b->T);
    memcpy(w->ent_old + base, b->ent, sizeof(float) * (size_t)b->T);
    if (with_ref) {
        TRY(model_set_adapter(t->model, NULL));
        int rc = mb_forward(t, replay ? b->replay : NULL, NULL, NULL, 0);
        int rc2 = model_set_adapter(t->model, t->adapter);
        TRY(rc);
        TRY(rc2);
        memcpy(w->ref + base, b->logp, sizeof(float) * (size_t)b->T);
    }
    return MO_OK;
}

static int old_pass(trainer_t *t, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    for (int i = 0; i < w->S; i++)
        w->order[i] = i;
    int nb = pack(t, w->order, w->S, w->starts);
    for (int k = 0; k < nb; k++)
        TRY(old_pass_mb(t, w->starts[k], w->starts[k + 1], t->pl.kl_coef > 0));
    m->micro_batches = nb;
    for (int l = 0; l < t->M; l++) {
        const int64_t *ld = w->load + (size_t)l * t->E;
        int64_t mx = 0, sum = 0;
        for (int e = 0; e < t->E; e++) {
            sum += ld[e];
            mx = ld[e] > mx ? ld[e] : mx;
        }
        t->imbalance[l] = sum > 0 ? (double)mx * t->E / (double)sum : 0.0;
        t->agreement[l] = w->agree_n[l] > 0 ? (double)w->agree_ok[l] / w->agree_n[l] : -1.0;
    }
    return MO_OK;
}

/* Mismatch statistics, then the mismatch filter or gate. Returns 1 when the batch is
 * refused. Sequences left without a masked token leave the list. */
static int mismatch(trainer_t *t, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    double k3 = 0, k1 = 0, ent = 0;
    int64_t n = 0;
    for (int32_t p = 0; p < w->Ttot; p++) {
        if (!w->mask[p])
            continue;
        double rd = (double)w->old[p] - w->roll[p];
        k3 += exp(rd) - 1.0 - rd;
        k1 -= rd;
        ent += w->ent_old[p];
        n++;
    }
    m->mismatch_k3 = n ? k3 / n : 0;
    m->mismatch_k1 = n ? k1 / n : 0;
    m->entropy_old = n ? ent / n : 0;
    double *kl;
    int32_t *off;
    ARENA_N(kl, &w->ar, w->S);
    ARENA_N(off, &w->ar, w->S + 1);
    /* The sequences are contiguous in the step arrays, in order. */
    for (int i = 0; i < w->S; i++)
        off[i] = w->seqs[i].off;
    off[w->S] = w->Ttot;
    double kmax = t->lc.mismatch_kl_max;
    int gate = kmax > 0 && t->opts.mismatch_mode == TRAINER_MISMATCH_REFUSE_BATCH;
    int drop = kmax > 0 && !gate;
    m->mismatch_dropped =
        pl_mismatch_filter(kl, w->mask, off, w->old, w->roll, w->S, drop ? kmax : 0.0);
    for (int i = 0; i < w->S; i++)
        m->mismatch_k3_max = kl[i] > m->mismatch_k3_max ? kl[i] : m->mismatch_k3_max;
    if (gate && !(m->mismatch_k3 <= kmax)) {
        snprintf(m->note, sizeof m->note,
                 "batch refused: train/inference mismatch KL (k3) %.4g exceeds "
                 "learner.mismatch_kl_max %.4g",
                 m->mismatch_k3, kmax);
        return 1;
    }
    int S = 0;
    for (int i = 0; i < w->S; i++) {
        const seq_t *q = &w->seqs[i];
        int any = 0;
        for (int p = 0; p < q->T && !any; p++)
            any = w->mask[q->off + p];
        if (any)
            w->seqs[S++] = *q;
    }
    w->S = S;
    return 0;
}

/* ---- Training ------------------------------------------------------------ */

/* A permutation of 0..S-1 from the trainer's stream (Fisher-Yates). */
static void permute(trainer_t *t, int *order, int S) {
    uint64_t stream = rng_stream_id("learner.shuffle", t->rng_counter++, 0);
    for (int i = 0; i < S; i++)
        order[i] = i;
    for (int i = S - 1; i > 0; i--) {
        uint32_t r[4];
        rng_block(r, t->seed, stream, (uint64_t)i);
        int j = (int)(((uint64_t)r[0] * (uint64_t)(i + 1)) >> 32);
        int tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

/* Forward, loss and backward of the micro-batch order[i0..i1). */
static int train_mb(trainer_t *t, int i0, int i1, const pl_norm_t *norm, pl_metrics_t *um) {
    trainer_work_t *w = t->w;
    mb_t *b = &w->mb;
    mb_gather(t, w->order, i0, i1);
    int want_ent = t->pl.entropy_coef > 0;
    TRY(mb_forward(t, w->replay ? b->replay : NULL, NULL, want_ent ? b->ent : NULL, 1));
    memset(b->dlogp, 0, sizeof(float) * (size_t)b->T);
    memset(b->dent, 0, sizeof(float) * (size_t)b->T);
    pl_batch_t pb = {.B = b->B,
                     .off = b->cu,
                     .logp = b->logp,
                     .old_logp = b->old,
                     .rollout_logp = b->roll,
                     .ref_logp = t->pl.kl_coef > 0 ? b->ref : NULL,
                     .entropy = want_ent ? b->ent : b->ent_old,
                     .adv = b->adv,
                     .mask = b->mask};
    TRY(policy_loss(b->dlogp, want_ent ? b->dent : NULL, um, &pb, &t->pl, norm));
    /* This rank's run only (all of it on one rank). */
    return actor_exec_backward(t->exec, b->dlogp + b->t0, want_ent ? b->dent + b->t0 : NULL);
}

/* One optimizer update over the minibatch order[lo..hi). */
static int update(trainer_t *t, int lo, int hi, pl_metrics_t *tot, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    pl_norm_t norm = {0, 0};
    for (int i = lo; i < hi; i++) {
        const seq_t *q = &w->seqs[w->order[i]];
        int32_t off[2] = {0, q->T};
        pl_norm_add(&norm, off, w->mask + q->off, 1);
    }
    lora_adapter_zero_grads(t->adapter);
    int nb = pack(t, w->order + lo, hi - lo, w->starts);
    pl_metrics_t um = {0};
    for (int k = 0; k < nb; k++)
        TRY(train_mb(t, lo + w->starts[k], lo + w->starts[k + 1], &norm, &um));
    optim_result_t res;
    double sq = 0.0;
    if (t->comm) { /* replicated gradients summed, the norm over every shard */
        TRY(moe_ep_allreduce_replicated(t->comm, t->adapter));
        TRY(ep_shard_grad_sqsum(t->ep, t->adapter->grads, &sq));
    }
    TRY(optim_step(&t->optim, t->adapter->params, t->adapter->grads, um.loss,
                   t->comm ? &sq : NULL, &res));
    TRY(actor_exec_sync(t->exec)); /* the device copy of the adapter follows */
    pl_metrics_add(tot, &um);
    if (res.outcome == OPTIM_APPLIED) {
        m->updates++;
        m->lr = res.lr;
    } else {
        m->skipped_updates++;
        m->last_skip = (int)res.outcome;
    }
    if (isfinite(res.grad_norm)) {
        m->grad_norm += res.grad_norm;
        m->grad_norm_max = res.grad_norm > m->grad_norm_max ? res.grad_norm : m->grad_norm_max;
    }
    return MO_OK;
}

static int train(trainer_t *t, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    int S = w->S, nmb = t->lc.minibatches < S ? t->lc.minibatches : S;
    pl_metrics_t tot = {0};
    for (int e = 0; e < t->lc.ppo_epochs; e++) {
        permute(t, w->order, S);
        for (int u = 0; u < nmb; u++) {
            int lo = (int)((int64_t)u * S / nmb), hi = (int)((int64_t)(u + 1) * S / nmb);
            TRY(update(t, lo, hi, &tot, m));
        }
    }
    int n_up = m->updates + m->skipped_updates;
    pl_summary_t s = pl_summarize(&tot);
    m->loss = n_up ? tot.loss / n_up : 0;
    m->pg = n_up ? tot.pg / n_up : 0;
    m->kl = n_up ? tot.kl / n_up : 0;
    m->entropy = n_up ? tot.entropy / n_up : 0;
    m->clip_frac_low = s.clip_frac_low;
    m->clip_frac_high = s.clip_frac_high;
    m->ratio_mean = s.ratio_mean;
    m->approx_kl = s.approx_kl;
    m->grad_norm = n_up ? m->grad_norm / n_up : 0;
    return MO_OK;
}

/* ---- The step ------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void summarize_trained(trainer_t *t, trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    double st = 0;
    m->trained_samples = w->S;
    for (int i = 0; i < w->S; i++) {
        const seq_t *q = &w->seqs[i];
        st += q->staleness;
        m->staleness_max = q->staleness > m->staleness_max ? q->staleness : m->staleness_max;
        m->tokens += q->T;
        for (int p = 0; p < q->T; p++)
            m->trained_tokens += w->mask[q->off + p];
    }
    m->staleness_mean = w->S ? st / w->S : 0;
}

static int step_body(trainer_t *t, const sample_group_t *const *groups, int n,
                     trainer_metrics_t *m) {
    trainer_work_t *w = t->w;
    TRY(collect(t, groups, n, m));
    TRY(advantages(t, m));
    TRY(layout(t));
    if (w->S == 0)
        return MO_OK;
    TRY(mb_alloc(t));
    ARENA_N(w->load, &w->ar, (size_t)t->M * t->E);
    ARENA_N(w->agree_n, &w->ar, t->M);
    ARENA_N(w->agree_ok, &w->ar, t->M);
    memset(w->load, 0, sizeof *w->load * (size_t)t->M * t->E);
    memset(w->agree_n, 0, sizeof *w->agree_n * (size_t)t->M);
    memset(w->agree_ok, 0, sizeof *w->agree_ok * (size_t)t->M);
    TRY(old_pass(t, m));
    int64_t routed = 0;
    for (int32_t p = 0; p < w->Ttot; p++)
        routed += w->has_rec[p];
    m->routed_tokens = routed;
    if (mismatch(t, m)) {
        m->refused = 1;
        return MO_OK;
    }
    if (w->S == 0)
        return MO_OK;
    summarize_trained(t, m);
    m->trained = 1;
    return train(t, m);
}

int trainer_step(trainer_t *t, const sample_group_t *const *groups, int n_groups,
                 trainer_metrics_t *mo) {
    if (!t || (n_groups > 0 && !groups) || n_groups < 0)
        return mo_errorf(MO_EINVAL, "trainer step: NULL trainer or groups");
    trainer_metrics_t local, *m = mo ? mo : &local;
    memset(m, 0, sizeof *m);
    double t0 = now_s();
    for (int l = 0; l < t->M; l++)
        t->agreement[l] = -1.0, t->imbalance[l] = 0.0;
    arena_reset(&t->w->ar);
    t->w->fwd_tokens = 0;
    t->w->S = 0;
    TRY(model_set_adapter(t->model, t->adapter));
    TRY(actor_exec_sync(t->exec)); /* the adapter may have been loaded or resumed */
    int rc = step_body(t, groups, n_groups, m);
    if (m->trained) {
        t->step++;
        if (m->updates > 0)
            t->version++;
    }
    m->step = t->step;
    m->version = t->version;
    m->M = t->M;
    m->routing_agreement = t->agreement;
    m->expert_imbalance = t->imbalance;
    double sum = 0;
    int nl = 0;
    for (int l = 0; l < t->M; l++)
        if (t->agreement[l] >= 0) {
            sum += t->agreement[l];
            nl++;
        }
    m->routing_agreement_mean = nl ? sum / nl : -1.0;
    m->seconds = now_s() - t0;
    m->tokens_per_s = m->seconds > 0 ? (double)t->w->fwd_tokens / m->seconds : 0.0;
    return rc;
}

/* ---- Diagnostics --------------------------------------------------------- */

int trainer_sample_logprobs(trainer_t *t, const sample_group_t *g, int s, float *out) {
    TRY(sample_group_check(g, t->model->V, t->M, t->K, t->E));
    if (s < 0 || s >= g->n_samples)
        return mo_errorf(MO_EINVAL, "trainer: sample %d of a group of %d", s, g->n_samples);
    trainer_work_t *w = t->w;
    arena_reset(&w->ar);
    TRY(model_set_adapter(t->model, t->adapter));
    TRY(actor_exec_sync(t->exec));
    sample_t one = g->samples[s];
    sample_group_t sub = *g;
    sub.samples = &one;
    sub.n_samples = 1;
    w->ng = 1;
    w->N = 1;
    const sample_group_t *gp = &sub;
    ARENA_N(w->groups, &w->ar, 1);
    ARENA_N(w->group_off, &w->ar, 2);
    ARENA_N(w->keep, &w->ar, 1);
    ARENA_N(w->adv, &w->ar, 1);
    ARENA_N(w->staleness, &w->ar, 1);
    w->groups[0] = gp;
    w->group_off[0] = 0;
    w->group_off[1] = 1;
    w->keep[0] = 1;
    w->adv[0] = 0;
    w->staleness[0] = 0;
    TRY(layout(t));
    TRY(mb_alloc(t));
    ARENA_N(w->load, &w->ar, (size_t)t->M * t->E + 1);
    ARENA_N(w->agree_n, &w->ar, t->M + 1);
    ARENA_N(w->agree_ok, &w->ar, t->M + 1);
    memset(w->load, 0, sizeof *w->load * ((size_t)t->M * t->E + 1));
    memset(w->agree_n, 0, sizeof *w->agree_n * (size_t)(t->M + 1));
    memset(w->agree_ok, 0, sizeof *w->agree_ok * (size_t)(t->M + 1));
    w->order[0] = 0;
    TRY(old_pass_mb(t, 0, 1, 0));
    memcpy(out, w->old + g->prompt_len - 1, sizeof(float) * (size_t)one.n_tokens);
    w->S = 0;
    return MO_OK;
}

/* ---- Expert parallelism -------------------------------------------------- */

int trainer_rank(const trainer_t *t) {
    return t->comm ? comm_rank(t->comm) : 0;
}

int trainer_ranks(const trainer_t *t) {
    return t->comm ? comm_size(t->comm) : 1;
}

/* The whole adapter (and AdamW state when with_optim) on rank 0. */
static int gather_whole(trainer_t *t, int with_optim) {
    int root = comm_rank(t->comm) == 0;
    if (root && !t->whole)
        TRY(ep_shard_full_new(t->ep, &t->whole));
    if (root && with_optim && !t->whole_optim.m)
        TRY(optim_init(&t->whole_optim, t->whole->n_params, &t->optim.hp, t->optim.k));
    return ep_shard_gather_state(t->ep, t->adapter, with_optim ? &t->optim : NULL,
                                 root ? t->whole : NULL, root ? &t->whole_optim : NULL);
}

int trainer_whole_state(trainer_t *t, const lora_adapter_t **ad, const optim_t **o) {
    *ad = NULL;
    if (o)
        *o = NULL;
    if (!t->comm) {
        *ad = t->adapter;
        if (o)
            *o = &t->optim;
        return MO_OK;
    }
    TRY(gather_whole(t, o != NULL));
    if (comm_rank(t->comm) == 0) {
        *ad = t->whole;
        if (o)
            *o = &t->whole_optim;
    }
    return MO_OK;
}

int trainer_whole_adapter(trainer_t *t, const lora_adapter_t **out) {
    return trainer_whole_state(t, out, NULL);
}
