/* rollout daemon: leases in, generation on a worker thread, scoring by the reward
 * workers, scored trajectory groups out, adapter versions applied between steps. */
#include "rollout/daemon.h"

#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "actor/unicode.h"
#include "core/backend.h"
#include "core/metrics.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "rollout/engine.h"
#include "transport/codec.h"
#include "transport/loop.h"
#include "transport/weights.h"
#include "transport/zsock.h"

#define HELLO_RETRY_MS 2000
#define SCORE_MAX_FAILURES 3 /* error replies before a group is sent unscored */
#define SCORE_MAX_TIMEOUTS 5 /* unanswered requests before a group is sent unscored */
#define ROLLOUT_METRICS_MS 5000
#define ADAPTER_MAX_BYTES ((uint64_t)1 << 34) /* largest adapter version accepted */

/* A lease message shared by its items. */
typedef struct lease_ref {
    msg_t m;
    int refs;
} lease_ref_t;

typedef enum { IT_QUEUED = 0, IT_SCORING, IT_PUSHING } item_state_t;

/* One lease item from arrival to the trajectory sink. While IT_QUEUED it belongs to the
 * worker thread (between W_GENERATE and W_GROUP); the loop thread owns it otherwise. */
typedef struct item {
    lease_ref_t *lease;
    const msg_lease_item_t *li;
    uint64_t lease_id, min_version;
    gen_params_t gp;
    /* worker thread */
    int32_t *tokens; /* (n_tokens) the templated prompt, when the lease sent text only */
    int n_tokens;
    double t_submit;
    struct item *wnext;
    /* results */
    gen_group_t *g;
    char *error;  /* generation failed or was dropped */
    bool dropped; /* dropped at stop: nothing is reported */
    double gen_ms;
    char **texts; /* (G) completions as valid UTF-8 */
    /* scoring and pushing */
    item_state_t state;
    uint64_t sent_ms;
    int failures, timeouts;
    msg_buf_t push; /* IT_PUSHING: the encoded trajectory_group */
    struct item *next, *prev;
} item_t;

typedef enum { W_GENERATE, W_ADAPTER, W_DRAIN, W_GROUP, W_APPLIED, W_DRAINED } wkind_t;

typedef struct wmsg {
    wkind_t kind;
    item_t *item;
    lora_adapter_t *ad; /* W_ADAPTER: the new one; W_APPLIED: the one it replaced */
    int64_t version;
    int status;
    char error[512];
} wmsg_t;

typedef struct ids {
    int up, version, leases, prompts, generated, pushed, gen_failures, tokens, tps, score_retries,
        score_failures, unscored, applied, snapshots, inflight, queued, gen_ms, score_ms, dropped;
} ids_t;

typedef struct ro {
    const rollout_daemon_opts_t *o;
    const moerl_config_t *cfg;
    char id[MSG_MAX_ID + 1];
    loop_t *loop;
    metrics_t *m;
    ids_t k;
    zsock_ctx_t zc;
    void *control, *work, *sink, *weights, *reward;
    loop_worker_t *w;
    model_t *model;
    tokenizer_t *tok;
    engine_t *e;
    gen_params_t gp;
    weights_assembler_t *as;
    lora_adapter_t *spares[2]; /* adapters not bound to the engine, for reuse */
    int n_spares;
    weights_adapter_t pending; /* newest version waiting while another is in transit */
    bool has_pending, in_transit;
    int64_t applied; /* adapter version in the engine; -1 before the first */
    uint64_t target; /* newest version known to exist */
    uint64_t last_snapshot_ms;
    bool welcomed;
    uint64_t last_hello_ms, last_hb_ms;
    int heartbeat_ms;
    loop_learner_watch_t lw; /* the learner's liveness */
    int fail_rc;             /* the loop stopped on an error (the learner gone) */
    char fail_msg[512];
    item_t *items; /* every item held, newest first */
    int n_items, n_queued, cap;
    int last_req_credits;
    uint64_t last_req_ms;
    atomic_llong generated; /* written by the worker thread */
    long long gen_last, gen_counted;
    uint64_t gen_last_ms;
    bool stopping, hard_exit;
    uint64_t stop_deadline;
    /* worker thread only */
    lora_adapter_t *bound;
    int64_t wversion;
    item_t *held, *running;
    bool draining, drained_sent;
} ro_t;

void rollout_daemon_opts_default(rollout_daemon_opts_t *o, const moerl_config_t *cfg) {
    memset(o, 0, sizeof *o);
    o->cfg = cfg;
    o->ready_fd = -1;
    o->metrics_port = -1;
}

/* ---- Items ---- */

static void item_free(item_t *it) {
    if (!it)
        return;
    if (it->texts) {
        for (int i = 0; it->g && i < it->g->n; i++)
            free(it->texts[i]);
        free(it->texts);
    }
    if (it->lease && --it->lease->refs == 0) {
        msg_free(&it->lease->m);
        free(it->lease);
    }
    free(it->tokens);
    gen_group_free(&it->g);
    free(it->error);
    msg_buf_free(&it->push);
    free(it);
}

static void wmsg_free(void *p) {
    wmsg_t *w = p;
    if (!w)
        return;
    lora_adapter_destroy(&w->ad);
    /* items of W_GENERATE / W_GROUP are freed with the daemon's list */
    free(w);
}

static void list_add(ro_t *d, item_t *it) {
    it->prev = NULL;
    it->next = d->items;
    if (d->items)
        d->items->prev = it;
    d->items = it;
    d->n_items++;
}

static void list_remove(ro_t *d, item_t *it) {
    if (it->prev)
        it->prev->next = it->next;
    else
        d->items = it->next;
    if (it->next)
        it->next->prev = it->prev;
    d->n_items--;
}

static item_t *find_item(ro_t *d, uint64_t group_id, item_state_t state) {
    for (item_t *it = d->items; it; it = it->next)
        if (it->li->group_id == group_id && it->state == state)
            return it;
    return NULL;
}

/* s (n bytes) as valid UTF-8 without NUL: bad bytes become U+FFFD. */
static char *clean_text(const char *s, size_t n) {
    char *out = malloc(3 * n + 1);
    if (!out)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len;
        uint32_t cp = uni_next(s + i, n - i, &len);
        if (cp == UNI_INVALID || cp == 0) {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        } else {
            memcpy(out + o, s + i, len);
            o += len;
        }
        i += len ? len : 1;
    }
    out[o] = '\0';
    return out;
}

/* ---- Worker thread ---- */

static int encode_prompt(const ro_t *d, const char *text, int32_t **ids, int *n) {
    char *full = NULL;
    TRY(tokenizer_apply_template(d->cfg->rollout.prompt_template, text, &full));
    int32_t *body = NULL;
    size_t nb = 0;
    int rc = tokenizer_encode(d->tok, full, strlen(full), true, &body, &nb);
    free(full);
    TRY(rc);
    const int32_t *pre, *suf;
    size_t np = 0, ns = 0;
    tokenizer_affixes(d->tok, &pre, &np, &suf, &ns);
    *n = (int)(np + nb + ns);
    *ids = malloc(sizeof **ids * (size_t)(*n + 1));
    if (!*ids) {
        free(body);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    if (np)
        memcpy(*ids, pre, sizeof **ids * np);
    if (nb)
        memcpy(*ids + np, body, sizeof **ids * nb);
    if (ns)
        memcpy(*ids + np + nb, suf, sizeof **ids * ns);
    free(body);
    return MO_OK;
}

static void w_post(loop_worker_t *w, wkind_t kind, item_t *it, lora_adapter_t *ad, int64_t version,
                   int status) {
    wmsg_t *m = calloc(1, sizeof *m);
    if (!m) {
        lora_adapter_destroy(&ad);
        return; /* out of memory: the item stays with the daemon's list, freed at exit */
    }
    m->kind = kind;
    m->item = it;
    m->ad = ad;
    m->version = version;
    m->status = status;
    if (status < 0)
        snprintf(m->error, sizeof m->error, "%s", mo_last_error());
    if (loop_worker_post(w, m) < 0)
        wmsg_free(m);
}

static void w_fail(loop_worker_t *w, item_t *it, const char *why, bool dropped) {
    it->error = malloc(strlen(why) + 1);
    if (it->error)
        strcpy(it->error, why);
    it->dropped = dropped;
    w_post(w, W_GROUP, it, NULL, 0, MO_OK);
}

static void w_generate(ro_t *d, loop_worker_t *w, item_t *it) {
    if (!it->li->prompt_tokens) {
        int rc = encode_prompt(d, it->li->prompt, &it->tokens, &it->n_tokens);
        if (rc < 0) {
            char why[600];
            snprintf(why, sizeof why, "prompt %s: %s", it->li->prompt_id, mo_last_error());
            w_fail(w, it, why, false);
            return;
        }
    }
    it->wnext = d->held;
    d->held = it;
}

static void w_adapter(ro_t *d, loop_worker_t *w, wmsg_t *m) {
    int rc = engine_set_adapter(d->e, m->ad, m->version);
    if (rc < 0) {
        w_post(w, W_APPLIED, NULL, m->ad, m->version, rc);
    } else {
        lora_adapter_t *old = d->bound;
        d->bound = m->ad;
        d->wversion = m->version;
        w_post(w, W_APPLIED, NULL, old, m->version, MO_OK);
    }
    m->ad = NULL;
}

static void w_handle(ro_t *d, loop_worker_t *w, wmsg_t *m) {
    if (m->kind == W_GENERATE) {
        w_generate(d, w, m->item);
    } else if (m->kind == W_ADAPTER) {
        w_adapter(d, w, m);
    } else if (m->kind == W_DRAIN) {
        d->draining = true;
        while (d->held) {
            item_t *it = d->held;
            d->held = it->wnext;
            w_fail(w, it, "dropped: the worker is stopping", true);
        }
    }
    wmsg_free(m);
}

/* Submits held items whose lease version the engine's adapter has reached. */
static void w_release(ro_t *d) {
    item_t **pp = &d->held;
    while (*pp) {
        item_t *it = *pp;
        if (d->wversion < 0 || (uint64_t)d->wversion < it->min_version) {
            pp = &it->wnext;
            continue;
        }
        *pp = it->wnext;
        gen_request_t r;
        memset(&r, 0, sizeof r);
        r.id = it->li->group_id;
        r.prompt = it->tokens ? it->tokens : it->li->prompt_tokens;
        r.prompt_len = it->tokens ? it->n_tokens : (int)it->li->n_prompt_tokens;
        r.n = (int)it->li->n;
        r.params = it->gp;
        it->t_submit = loop_clock_ms();
        it->wnext = d->running;
        d->running = it;
        engine_submit(d->e, &r); /* a refused request comes back through engine_collect */
    }
}

static void w_finish(ro_t *d, loop_worker_t *w, gen_group_t *g) {
    for (item_t **pp = &d->running; *pp; pp = &(*pp)->wnext) {
        item_t *it = *pp;
        if (it->li->group_id != g->id)
            continue;
        *pp = it->wnext;
        it->g = g;
        it->gen_ms = loop_clock_ms() - it->t_submit;
        w_post(w, W_GROUP, it, NULL, 0, MO_OK);
        return;
    }
    gen_group_free(&g);
}

static void w_body(loop_worker_t *w, void *arg) {
    ro_t *d = arg;
    backend_cpu_set_threads(d->cfg->run.threads);
    for (;;) {
        int timeout = engine_pending(d->e) > 0 ? 0 : -1;
        void *p;
        int rc;
        while ((rc = loop_worker_next(w, &p, timeout)) == 1) {
            w_handle(d, w, p);
            timeout = 0;
        }
        if (rc < 0)
            break;
        w_release(d);
        if (engine_pending(d->e) > 0) {
            engine_step(d->e);
            atomic_store(&d->generated, (long long)engine_get_stats(d->e).generated);
            gen_group_t *g;
            while (engine_collect(d->e, &g) == 1)
                w_finish(d, w, g);
        }
        if (d->draining && !d->held && engine_pending(d->e) == 0 && !d->drained_sent) {
            d->drained_sent = true;
            w_post(w, W_DRAINED, NULL, NULL, 0, MO_OK);
        }
    }
}

/* ---- Loop thread: sending ---- */

static void send_on(ro_t *d, void *sock, const msg_t *m) {
    int rc = zsock_send_msg(sock, NULL, m, ZMQ_DONTWAIT);
    if (rc < 0)
        metrics_log(d->m, "send %s: %s", msg_type_name(m->type), mo_last_error());
    else if (rc == 0)
        metrics_log(d->m, "send %s: queue full, dropped", msg_type_name(m->type));
}

static void send_hello(ro_t *d) {
    msg_t m;
    loop_hello(&m, MSG_ROLE_ROLLOUT, d->id);
    send_on(d, d->control, &m);
    d->last_hello_ms = loop_now_ms(d->loop);
}

/* Counts the tokens generated since the last call; the rate is refreshed every 500 ms. */
static double tokens_per_s(ro_t *d) {
    uint64_t now = loop_now_ms(d->loop);
    long long gen = atomic_load(&d->generated);
    metrics_inc(d->m, d->k.tokens, (double)(gen - d->gen_counted));
    d->gen_counted = gen;
    double tps = metrics_value(d->m, d->k.tps);
    if (d->gen_last_ms == 0 || now >= d->gen_last_ms + 500) {
        tps = d->gen_last_ms ? (double)(gen - d->gen_last) * 1000.0 / (double)(now - d->gen_last_ms)
                             : 0;
        d->gen_last = gen;
        d->gen_last_ms = now;
        metrics_set(d->m, d->k.tps, tps);
    }
    return isfinite(tps) && tps >= 0 ? tps : 0;
}

static void send_heartbeat(ro_t *d) {
    msg_t m;
    msg_init(&m);
    m.type = MSG_HEARTBEAT;
    msg_heartbeat_t *h = &m.heartbeat;
    h->worker_id = d->id;
    h->role = MSG_ROLE_ROLLOUT;
    h->has_adapter_version = d->applied >= 0;
    h->adapter_version = d->applied >= 0 ? (uint64_t)d->applied : 0;
    h->inflight = (uint32_t)d->n_items;
    h->tokens_per_s = tokens_per_s(d);
    h->queue_depth = (uint32_t)d->n_queued;
    send_on(d, d->control, &m);
    d->last_hb_ms = loop_now_ms(d->loop);
}

static void send_error(ro_t *d, void *sock, int code, const char *message, const char *about,
                       uint64_t id) {
    char buf[1024];
    size_t n = strlen(message);
    if (n >= sizeof buf)
        n = sizeof buf - 1;
    while (n > 0 && n < strlen(message) && ((unsigned char)message[n] & 0xC0) == 0x80)
        n--;
    memcpy(buf, message, n);
    buf[n] = '\0';
    msg_t m;
    msg_init(&m);
    m.type = MSG_ERROR;
    m.error = (msg_error_t){code < -1000 || code > -1 ? MO_EINVAL : code, n ? buf : "failed", about,
                            true, id};
    send_on(d, sock, &m);
}

static int credits(const ro_t *d) {
    return 2 * d->cap - d->n_queued;
}

static void want_work(ro_t *d) {
    if (!d->welcomed || d->applied < 0 || d->stopping)
        return;
    int c = credits(d);
    if (c <= 0)
        return;
    uint64_t now = loop_now_ms(d->loop);
    if (c <= d->last_req_credits && now < d->last_req_ms + (uint64_t)d->heartbeat_ms)
        return;
    msg_t m;
    msg_init(&m);
    m.type = MSG_WORK_REQUEST;
    m.work_request.worker_id = d->id;
    m.work_request.credits = (uint32_t)(c < MSG_MAX_ITEMS ? c : MSG_MAX_ITEMS);
    send_on(d, d->work, &m);
    d->last_req_credits = c;
    d->last_req_ms = now;
}

static void maybe_snapshot(ro_t *d, bool force) {
    if (!d->welcomed || d->in_transit || d->has_pending)
        return;
    if (d->applied >= 0 && (uint64_t)d->applied >= d->target)
        return;
    uint64_t now = loop_now_ms(d->loop);
    if (!force && now < d->last_snapshot_ms + 2 * (uint64_t)d->heartbeat_ms)
        return;
    msg_t m;
    msg_init(&m);
    m.type = MSG_SNAPSHOT_REQUEST;
    m.snapshot_request.worker_id = d->id;
    m.snapshot_request.has_version = d->applied >= 0;
    m.snapshot_request.have_version = d->applied >= 0 ? (uint64_t)d->applied : 0;
    send_on(d, d->control, &m);
    metrics_inc(d->m, d->k.snapshots, 1);
    d->last_snapshot_ms = now;
}

/* ---- Adapters ---- */

static double meta_number(const msg_strmap_t *meta, const char *key, double def) {
    for (uint32_t i = 0; i < meta->n; i++)
        if (!strcmp(meta->items[i].key, key)) {
            char *end;
            double v = strtod(meta->items[i].value, &end);
            return *end || end == meta->items[i].value ? def : v;
        }
    return def;
}

/* 1 when ad has exactly wa's tensors (names, F32, shapes) and R, alpha, rsLoRA. */
static int fits(const lora_adapter_t *ad, const weights_adapter_t *wa, int R, float alpha,
                int rslora) {
    if (ad->R != R || ad->alpha != alpha || ad->rslora != rslora ||
        (uint32_t)ad->n_tensors != wa->n_table)
        return 0;
    for (int i = 0; i < ad->n_tensors; i++) {
        const msg_tensor_entry_t *e = weights_adapter_find(wa, ad->tensors[i].name);
        if (!e || e->dtype != DT_F32 || e->ndim != 2 || e->shape[0] != ad->tensors[i].shape[0] ||
            e->shape[1] != ad->tensors[i].shape[1])
            return 0;
    }
    return 1;
}

/* An adapter of the model holding wa's values: a compatible spare, or a new one built
 * for the modules wa's table names. */
static int fill_adapter(ro_t *d, const weights_adapter_t *wa, lora_adapter_t **out) {
    const config_lora_t *lc = &d->cfg->lora;
    int R = (int)meta_number(&wa->meta, "rank", lc->rank);
    float alpha = (float)meta_number(&wa->meta, "alpha", lc->alpha);
    int rslora = meta_number(&wa->meta, "rslora", lc->rslora) != 0;
    lora_adapter_t *ad = NULL;
    while (d->n_spares > 0 && !ad) {
        lora_adapter_t *s = d->spares[--d->n_spares];
        if (fits(s, wa, R, alpha, rslora))
            ad = s;
        else
            lora_adapter_destroy(&s);
    }
    if (!ad) {
        model_t *m = d->model;
        unsigned char *sel = calloc((size_t)m->n_modules + 1, 1);
        if (!sel)
            return mo_errorf(MO_ENOMEM, "out of memory");
        for (int i = 0; i < m->n_modules; i++) {
            char name[600];
            snprintf(name, sizeof name, "%s.lora_A.weight", m->modules[i].name);
            sel[i] = weights_adapter_find(wa, name) != NULL;
        }
        lora_config_t c = {R, alpha, rslora, 0.0f, 0, 1, NULL, 0};
        int rc = lora_adapter_new_selected(&ad, &c, m->modules, m->n_modules, sel);
        free(sel);
        TRY(rc);
        /* The trained router and norm weights travel as full tensors after the pairs. */
        if (lc->train_router || lc->train_norms)
            rc = model_adapter_add_full(m, ad, lc->train_router, lc->train_norms);
        if (rc < 0) {
            lora_adapter_destroy(&ad);
            return rc;
        }
        if (!fits(ad, wa, R, alpha, rslora)) {
            lora_adapter_destroy(&ad);
            return mo_errorf(MO_EMALFORMED,
                             "adapter version %llu: its %u tensors do not match this model's "
                             "modules (rank %d)",
                             (unsigned long long)wa->version, wa->n_table, R);
        }
    }
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        const msg_tensor_entry_t *e = weights_adapter_find(wa, t->name);
        memcpy(ad->params + t->offset, wa->data + e->offset, sizeof(float) * t->numel);
    }
    *out = ad;
    return MO_OK;
}

static void keep_spare(ro_t *d, lora_adapter_t *ad) {
    if (!ad)
        return;
    if (d->n_spares < 2)
        d->spares[d->n_spares++] = ad;
    else
        lora_adapter_destroy(&ad);
}

/* Takes *wa (freed here): hands its values to the worker, or keeps it while another
 * version is on its way. */
static void adapter_ready(ro_t *d, weights_adapter_t *wa) {
    if (d->applied >= 0 && wa->version <= (uint64_t)d->applied) {
        weights_adapter_free(wa);
        return;
    }
    if (d->in_transit) {
        if (d->has_pending)
            weights_adapter_free(&d->pending);
        d->pending = *wa;
        d->has_pending = true;
        memset(wa, 0, sizeof *wa);
        return;
    }
    lora_adapter_t *ad = NULL;
    int rc = fill_adapter(d, wa, &ad);
    uint64_t version = wa->version;
    weights_adapter_free(wa);
    if (rc < 0) {
        metrics_log(d->m, "adapter version %llu cannot be used: %s", (unsigned long long)version,
                    mo_last_error());
        return;
    }
    wmsg_t *m = calloc(1, sizeof *m);
    if (!m) {
        lora_adapter_destroy(&ad);
        return;
    }
    m->kind = W_ADAPTER;
    m->ad = ad;
    m->version = (int64_t)version;
    if (loop_worker_submit(d->w, m) < 0) {
        wmsg_free(m);
        return;
    }
    d->in_transit = true;
}

static void on_chunk(ro_t *d, const msg_weights_chunk_t *c, const char *from) {
    if (c->version > d->target)
        d->target = c->version;
    int rc = weights_assembler_add(d->as, c);
    if (rc == WEIGHTS_DONE) {
        weights_adapter_t wa;
        memset(&wa, 0, sizeof wa);
        if (weights_assembler_take(d->as, &wa) == MO_OK)
            adapter_ready(d, &wa);
    } else if (rc < 0) {
        metrics_malformed(d->m, "weights_chunk", from, mo_last_error(), loop_now_ms(d->loop));
    }
}

static void on_applied(ro_t *d, wmsg_t *m) {
    d->in_transit = false;
    if (m->status < 0) {
        metrics_log(d->m, "adapter version %lld not applied: %s", (long long)m->version, m->error);
    } else {
        d->applied = m->version;
        metrics_set(d->m, d->k.version, (double)m->version);
        metrics_inc(d->m, d->k.applied, 1);
        metrics_log(d->m, "adapter version %lld applied", (long long)m->version);
        if (d->welcomed)
            send_heartbeat(d);
    }
    keep_spare(d, m->ad);
    m->ad = NULL;
    if (d->has_pending) {
        weights_adapter_t wa = d->pending;
        d->has_pending = false;
        memset(&d->pending, 0, sizeof d->pending);
        adapter_ready(d, &wa);
    }
    maybe_snapshot(d, false);
    want_work(d);
}

/* ---- Scoring and pushing ---- */

static msg_finish_t wire_finish(finish_reason_t f) {
    return f == FINISH_LENGTH                                  ? MSG_FINISH_LENGTH
           : f == FINISH_STOP_TOKEN || f == FINISH_STOP_STRING ? MSG_FINISH_STOP
                                                               : MSG_FINISH_ABORT;
}

static void send_score_request(ro_t *d, item_t *it) {
    const gen_group_t *g = it->g;
    msg_score_sample_t *ss = calloc((size_t)g->n, sizeof *ss);
    if (!ss)
        return;
    for (int i = 0; i < g->n; i++)
        ss[i] = (msg_score_sample_t){it->texts[i], (uint32_t)g->samples[i].n_tokens,
                                     wire_finish(g->samples[i].finish)};
    msg_t m;
    msg_init(&m);
    m.type = MSG_SCORE_REQUEST;
    msg_score_request_t *r = &m.score_request;
    r->group_id = it->li->group_id;
    r->prompt_id = it->li->prompt_id;
    r->prompt = it->li->prompt;
    r->answer = it->li->answer;
    r->extra = it->li->extra;
    r->samples = ss;
    r->n_samples = (uint32_t)g->n;
    int rc = zsock_send_msg(d->reward, NULL, &m, ZMQ_DONTWAIT);
    free(ss);
    it->sent_ms = rc == 1 ? loop_now_ms(d->loop) : 0; /* 0: resent at the next tick */
    if (rc < 0)
        metrics_log(d->m, "score_request %llu: %s", (unsigned long long)r->group_id,
                    mo_last_error());
}

/* The wire routing of sample s (docs/protocol.md): with prompt routing R = P + T - 1
 * rows (the prompt, then every generated token but the last); without, R = T rows (row
 * j: the step that sampled token j, row 0 the last prompt position). The read of the last
 * token goes separately as routing_last. NULL when the engine recorded none. */
static uint16_t *wire_routing(const gen_group_t *g, const gen_sample_t *s, bool with_prompt,
                              uint32_t *rows) {
    int P = g->prompt_len, T = s->n_tokens;
    if (!g->prompt_routing || !s->routing || T < 1 || g->M < 1 || g->K < 1)
        return NULL;
    size_t row = (size_t)g->M * (size_t)g->K;
    int R = with_prompt ? P + T - 1 : T;
    uint16_t *r = malloc(sizeof *r * row * (size_t)R);
    if (!r)
        return NULL;
    if (with_prompt) {
        memcpy(r, g->prompt_routing, sizeof *r * row * (size_t)P);
        memcpy(r + row * (size_t)P, s->routing, sizeof *r * row * (size_t)(T - 1));
    } else {
        memcpy(r, g->prompt_routing + row * (size_t)(P - 1), sizeof *r * row);
        memcpy(r + row, s->routing, sizeof *r * row * (size_t)(T - 1));
    }
    *rows = (uint32_t)R;
    return r;
}

/* Encodes the group with its rewards (rewards NULL: unscored) into it->push. */
static int encode_group(ro_t *d, item_t *it, const msg_score_reply_t *sr) {
    const gen_group_t *g = it->g;
    bool with_prompt = d->cfg->rollout.record_prompt_routing;
    msg_sample_t *ss = calloc((size_t)g->n, sizeof *ss);
    uint16_t **routes = calloc((size_t)g->n, sizeof *routes);
    int rc = ss && routes ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    for (int i = 0; i < g->n && rc == MO_OK; i++) {
        const gen_sample_t *s = &g->samples[i];
        msg_sample_t *x = &ss[i];
        x->tokens = s->tokens;
        x->logprobs = s->logprobs;
        x->n_tokens = (uint32_t)s->n_tokens;
        routes[i] = wire_routing(g, s, with_prompt, &x->routing_rows);
        x->routing = routes[i];
        x->routing_layers = (uint32_t)g->M;
        x->routing_k = (uint32_t)g->K;
        if (x->routing) /* the engine read the last token once more for its experts */
            x->routing_last = s->routing + (size_t)(s->n_tokens - 1) * (size_t)(g->M * g->K);
        x->finish = wire_finish(s->finish);
        x->adapter_version_first = (uint64_t)(s->version_first > 0 ? s->version_first : 0);
        x->adapter_version_last = (uint64_t)(s->version_last > 0 ? s->version_last : 0);
        x->text = it->texts[i];
    }
    if (rc == MO_OK) {
        msg_t m;
        msg_init(&m);
        m.type = MSG_TRAJECTORY_GROUP;
        msg_trajectory_group_t *t = &m.trajectory_group;
        t->group_id = it->li->group_id;
        t->lease_id = it->lease_id;
        t->prompt_id = it->li->prompt_id;
        t->worker_id = d->id;
        t->prompt_tokens = g->prompt;
        t->n_prompt_tokens = (uint32_t)g->prompt_len;
        t->prompt = it->li->prompt;
        t->answer = it->li->answer;
        t->extra = it->li->extra;
        t->samples = ss;
        t->n_samples = (uint32_t)g->n;
        t->rewards = sr ? sr->rewards : NULL;
        t->reward_version = sr ? sr->reward_version : 0;
        t->reward_details = sr ? sr->details : NULL;
        t->has_gen_ms = true;
        t->gen_ms = it->gen_ms;
        t->has_score_ms = sr && sr->has_score_ms;
        t->score_ms = sr ? sr->score_ms : 0;
        rc = msg_encode(&m, &it->push);
    }
    for (int i = 0; routes && i < g->n; i++)
        free(routes[i]);
    free(routes);
    free(ss);
    return rc;
}

static void item_done(ro_t *d, item_t *it) {
    list_remove(d, it);
    item_free(it);
}

/* Sends the encoded group; keeps it for another try when the queue is full. */
static void push(ro_t *d, item_t *it) {
    int rc = zsock_send(d->sink, NULL, it->push.data, it->push.len, ZMQ_DONTWAIT);
    if (rc == 0) {
        it->state = IT_PUSHING;
        return;
    }
    if (rc < 0)
        metrics_log(d->m, "trajectory_group %llu: %s", (unsigned long long)it->li->group_id,
                    mo_last_error());
    else
        metrics_inc(d->m, d->k.pushed, 1);
    item_done(d, it);
}

static void finish_group(ro_t *d, item_t *it, const msg_score_reply_t *sr) {
    if (encode_group(d, it, sr) < 0) {
        metrics_log(d->m, "trajectory_group %llu: %s", (unsigned long long)it->li->group_id,
                    mo_last_error());
        send_error(d, d->work, MO_EINVAL, mo_last_error(), "lease", it->li->group_id);
        item_done(d, it);
        return;
    }
    if (!sr)
        metrics_inc(d->m, d->k.unscored, 1);
    push(d, it);
}

static void on_group(ro_t *d, item_t *it) {
    d->n_queued--;
    if (it->error || !it->g || it->g->status < 0) {
        const char *why = it->error ? it->error : it->g && it->g->error ? it->g->error : "failed";
        if (it->dropped) {
            metrics_inc(d->m, d->k.dropped, 1);
        } else {
            metrics_inc(d->m, d->k.gen_failures, 1);
            metrics_log(d->m, "group %llu (prompt %s) failed: %s",
                        (unsigned long long)it->li->group_id, it->li->prompt_id, why);
            send_error(d, d->work, it->g ? it->g->status : MO_EINVAL, why, "lease",
                       it->li->group_id);
        }
        item_done(d, it);
        want_work(d);
        return;
    }
    metrics_inc(d->m, d->k.generated, 1);
    metrics_set(d->m, d->k.gen_ms, it->gen_ms);
    const gen_group_t *g = it->g;
    it->texts = calloc((size_t)g->n, sizeof *it->texts);
    bool ok = it->texts != NULL;
    for (int i = 0; ok && i < g->n; i++) {
        const gen_sample_t *s = &g->samples[i];
        it->texts[i] = clean_text(s->text ? s->text : "", s->text ? s->text_len : 0);
        ok = it->texts[i] != NULL;
    }
    if (!ok) {
        metrics_log(d->m, "group %llu: out of memory", (unsigned long long)it->li->group_id);
        item_done(d, it);
    } else {
        it->state = IT_SCORING;
        send_score_request(d, it);
    }
    want_work(d);
}

static void on_score_reply(ro_t *d, msg_t *m) {
    const msg_score_reply_t *sr = &m->score_reply;
    item_t *it = find_item(d, sr->group_id, IT_SCORING);
    if (!it)
        return; /* a late answer to a request that was sent again */
    if ((int)sr->n_samples != it->g->n) {
        char why[128];
        snprintf(why, sizeof why, "score_reply.rewards: %u values for %d samples", sr->n_samples,
                 it->g->n);
        metrics_malformed(d->m, "score_reply", "reward", why, loop_now_ms(d->loop));
        return;
    }
    if (sr->has_score_ms)
        metrics_set(d->m, d->k.score_ms, sr->score_ms);
    finish_group(d, it, sr);
    want_work(d);
}

static void on_score_error(ro_t *d, const msg_error_t *e) {
    item_t *it = e->has_id ? find_item(d, e->id, IT_SCORING) : NULL;
    if (!it)
        return;
    if (e->code != MO_ESTATE && ++it->failures >= SCORE_MAX_FAILURES) {
        metrics_inc(d->m, d->k.score_failures, 1);
        metrics_log(d->m, "group %llu: scoring failed %d times (%s): sent unscored",
                    (unsigned long long)e->id, it->failures, e->message);
        finish_group(d, it, NULL);
        return;
    }
    metrics_inc(d->m, d->k.score_retries, 1);
    if (e->code == MO_ESTATE)
        it->sent_ms = 0; /* a stopping worker: again at the next tick, maybe elsewhere */
    else
        send_score_request(d, it);
}

/* ---- Loop thread: receiving ---- */

static void maybe_finish(ro_t *d) {
    if (d->stopping && (d->n_items == 0 || loop_now_ms(d->loop) >= d->stop_deadline)) {
        if (d->n_items)
            metrics_log(d->m, "drain time is up: %d group(s) abandoned", d->n_items);
        loop_stop(d->loop);
    }
}

static void stop_now(ro_t *d, const char *why) {
    metrics_log(d->m, "stopping: %s", why);
    d->stopping = true;
    loop_stop(d->loop);
}

static void on_welcome(ro_t *d, const msg_welcome_t *w) {
    if (!d->welcomed)
        metrics_log(d->m, "registered with the learner (job %s, policy version %llu)", w->job,
                    (unsigned long long)w->policy_version);
    d->welcomed = true;
    d->gp.sampling.temperature = (float)w->sampling.temperature;
    d->gp.sampling.top_p = (float)w->sampling.top_p;
    d->gp.sampling.top_k = w->sampling.top_k;
    d->gp.sampling.min_p = (float)w->sampling.min_p;
    d->gp.max_new_tokens = w->sampling.max_new_tokens;
    d->gp.seed = w->sampling.seed;
    int mb = d->cfg->rollout.max_batch;
    d->cap = mb / (int)w->group_size > 0 ? mb / (int)w->group_size : 1;
    if (d->applied >= 0 && w->policy_version < (uint64_t)d->applied) {
        /* the learner went back (resumed from an older checkpoint): follow it */
        weights_assembler_destroy(&d->as);
        weights_assembler_new(&d->as, ADAPTER_MAX_BYTES);
        d->applied = -1;
    }
    d->target = w->policy_version > d->target || d->applied < 0 ? w->policy_version : d->target;
    if ((int)w->heartbeat_ms != d->heartbeat_ms) {
        d->heartbeat_ms = (int)w->heartbeat_ms;
    }
    if (d->cfg->transport.learner_timeout_ms == 0) /* 10 of the learner's intervals */
        d->lw.timeout_ms = 10u * (uint64_t)w->heartbeat_ms;
    send_heartbeat(d);
    maybe_snapshot(d, true);
    want_work(d);
}

static void on_control(void *sock, void *arg) {
    ro_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == MO_EMALFORMED)
        metrics_malformed(d->m, msg_type_name(t), "learner", mo_last_error(), loop_now_ms(d->loop));
    else if (rc < 0)
        metrics_log(d->m, "control socket: %s", mo_last_error());
    if (rc != 1) {
        msg_free(&m);
        return;
    }
    loop_learner_heard(&d->lw, loop_now_ms(d->loop), m.type == MSG_WELCOME);
    switch (m.type) {
    case MSG_WELCOME: on_welcome(d, &m.welcome); break;
    case MSG_HEARTBEAT: break; /* the learner's answer: it is alive */
    case MSG_WEIGHTS_CHUNK: on_chunk(d, &m.weights_chunk, "learner"); break;
    case MSG_CTL_REQUEST:
        if (m.ctl_request.command == MSG_CTL_STOP)
            stop_now(d, "the learner asked to stop");
        break;
    case MSG_ERROR:
        if (m.error.code == MO_ENOTFOUND && m.error.about && !strcmp(m.error.about, "heartbeat")) {
            metrics_log(d->m, "the learner does not know this worker: registering again");
            d->welcomed = false;
            send_hello(d);
        } else {
            metrics_log(d->m, "learner error about %s: %s", m.error.about ? m.error.about : "?",
                        m.error.message);
        }
        break;
    default:
        metrics_malformed(d->m, msg_type_name(m.type), "learner",
                          "unexpected message type on the control socket", loop_now_ms(d->loop));
    }
    msg_free(&m);
}

static void on_lease(ro_t *d, msg_t *m) {
    lease_ref_t *lr = calloc(1, sizeof *lr);
    if (!lr)
        return;
    lr->m = *m;
    msg_init(m);
    const msg_lease_t *L = &lr->m.lease;
    metrics_inc(d->m, d->k.leases, 1);
    if (L->policy_version > d->target)
        d->target = L->policy_version;
    d->last_req_credits -= (int)L->n_items;
    if (d->last_req_credits < 0)
        d->last_req_credits = 0;
    for (uint32_t i = 0; i < L->n_items && !d->stopping; i++) {
        item_t *it = calloc(1, sizeof *it);
        wmsg_t *w = calloc(1, sizeof *w);
        if (!it || !w) {
            free(it);
            free(w);
            break;
        }
        it->lease = lr;
        lr->refs++;
        it->li = &L->items[i];
        it->lease_id = L->lease_id;
        it->min_version = L->policy_version;
        it->gp = d->gp;
        msg_buf_init(&it->push);
        list_add(d, it);
        w->kind = W_GENERATE;
        w->item = it;
        if (loop_worker_submit(d->w, w) < 0) {
            free(w);
            item_done(d, it);
            continue;
        }
        d->n_queued++;
        metrics_inc(d->m, d->k.prompts, 1);
    }
    if (lr->refs == 0) {
        msg_free(&lr->m);
        free(lr);
    }
    maybe_snapshot(d, false);
}

static void on_work(void *sock, void *arg) {
    ro_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == MO_EMALFORMED)
        metrics_malformed(d->m, msg_type_name(t != MSG_NONE ? t : MSG_LEASE), "learner",
                          mo_last_error(), loop_now_ms(d->loop));
    else if (rc == 1 && m.type == MSG_LEASE)
        on_lease(d, &m);
    else if (rc == 1 && m.type == MSG_ERROR)
        metrics_log(d->m, "learner work error: %s", m.error.message);
    else if (rc == 1)
        metrics_malformed(d->m, msg_type_name(m.type), "learner",
                          "unexpected message type on the work socket", loop_now_ms(d->loop));
    msg_free(&m);
}

static void on_weights(void *sock, void *arg) {
    ro_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == MO_EMALFORMED)
        metrics_malformed(d->m, "weights_chunk", "learner", mo_last_error(), loop_now_ms(d->loop));
    else if (rc == 1 && m.type == MSG_WEIGHTS_CHUNK)
        on_chunk(d, &m.weights_chunk, "learner");
    else if (rc == 1)
        metrics_malformed(d->m, msg_type_name(m.type), "learner",
                          "unexpected message type on the weights socket", loop_now_ms(d->loop));
    msg_free(&m);
}

static void on_reward(void *sock, void *arg) {
    ro_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == MO_EMALFORMED)
        metrics_malformed(d->m, msg_type_name(t != MSG_NONE ? t : MSG_SCORE_REPLY), "reward",
                          mo_last_error(), loop_now_ms(d->loop));
    else if (rc == 1 && m.type == MSG_SCORE_REPLY)
        on_score_reply(d, &m);
    else if (rc == 1 && m.type == MSG_ERROR)
        on_score_error(d, &m.error);
    else if (rc == 1)
        metrics_malformed(d->m, msg_type_name(m.type), "reward",
                          "unexpected message type on the reward socket", loop_now_ms(d->loop));
    msg_free(&m);
    maybe_finish(d);
}

static void on_result(void *item, void *arg) {
    ro_t *d = arg;
    wmsg_t *m = item;
    if (m->kind == W_GROUP)
        on_group(d, m->item);
    else if (m->kind == W_APPLIED)
        on_applied(d, m);
    m->item = NULL;
    wmsg_free(m);
    maybe_finish(d);
}

/* Resends scoring requests that got no answer within reward.timeout_ms, and pushes
 * that found the queue full. */
static void retry_items(ro_t *d) {
    uint64_t now = loop_now_ms(d->loop);
    item_t *next;
    for (item_t *it = d->items; it; it = next) {
        next = it->next;
        if (it->state == IT_PUSHING) {
            push(d, it);
        } else if (it->state == IT_SCORING &&
                   (it->sent_ms == 0 || now >= it->sent_ms + (uint64_t)d->cfg->reward.timeout_ms)) {
            if (it->sent_ms && ++it->timeouts >= SCORE_MAX_TIMEOUTS) {
                metrics_inc(d->m, d->k.score_failures, 1);
                metrics_log(d->m, "group %llu: no score after %d tries: sent unscored",
                            (unsigned long long)it->li->group_id, it->timeouts);
                finish_group(d, it, NULL);
                continue;
            }
            if (it->sent_ms)
                metrics_inc(d->m, d->k.score_retries, 1);
            send_score_request(d, it);
        }
    }
}

static void on_tick(void *arg) {
    ro_t *d = arg;
    uint64_t now = loop_now_ms(d->loop);
    if (!d->welcomed) {
        if (now >= d->last_hello_ms + HELLO_RETRY_MS)
            send_hello(d);
    } else if (now >= d->last_hb_ms + (uint64_t)d->heartbeat_ms) {
        send_heartbeat(d);
    }
    if (!d->fail_rc && loop_learner_check(&d->lw, now, d->cfg->transport.control) < 0) {
        d->fail_rc = MO_ESTATE;
        snprintf(d->fail_msg, sizeof d->fail_msg, "%s", mo_last_error());
        metrics_log(d->m, "%s", d->fail_msg);
        d->stopping = true;
        loop_stop(d->loop);
        return;
    }
    retry_items(d);
    maybe_snapshot(d, false);
    want_work(d);
    metrics_set(d->m, d->k.inflight, d->n_items);
    metrics_set(d->m, d->k.queued, d->n_queued);
    maybe_finish(d);
}

static void on_metrics_timer(void *arg) {
    ro_t *d = arg;
    metrics_jsonl_write(d->m, "periodic");
}

static void on_signal(int signum, void *arg) {
    ro_t *d = arg;
    if (d->stopping) {
        metrics_log(d->m, "second signal %d: exiting now", signum);
        d->hard_exit = true;
        loop_stop(d->loop);
        return;
    }
    d->stopping = true;
    int ms = d->o->drain_ms > 0 ? d->o->drain_ms : 30000;
    d->stop_deadline = loop_now_ms(d->loop) + (uint64_t)ms;
    metrics_log(d->m, "%s: finishing %d group(s) in progress, then exiting",
                signum == SIGTERM ? "SIGTERM" : "SIGINT", d->n_items);
    wmsg_t *m = calloc(1, sizeof *m);
    if (m) {
        m->kind = W_DRAIN;
        if (loop_worker_submit(d->w, m) < 0)
            free(m);
    }
    maybe_finish(d);
}

/* ---- Setup ---- */

static void register_metrics(ro_t *d) {
    metrics_t *m = d->m;
    ids_t *k = &d->k;
    k->up = metrics_gauge(m, "moerl_up", "1 while the daemon runs.");
    k->version = metrics_gauge(m, "moerl_rollout_adapter_version", "Adapter version applied.");
    k->leases = metrics_counter(m, "moerl_rollout_leases_total", "Leases received.");
    k->prompts = metrics_counter(m, "moerl_rollout_prompts_total", "Lease items received.");
    k->generated = metrics_counter(m, "moerl_rollout_groups_generated_total",
                                   "Groups generated (G completions each).");
    k->pushed = metrics_counter(m, "moerl_rollout_groups_pushed_total",
                                "Trajectory groups sent to the learner.");
    k->gen_failures = metrics_counter(m, "moerl_rollout_generation_failures_total",
                                      "Lease items whose generation failed (reported).");
    k->dropped =
        metrics_counter(m, "moerl_rollout_dropped_total", "Lease items dropped unstarted at stop.");
    k->tokens = metrics_counter(m, "moerl_rollout_tokens_total", "Tokens generated.");
    k->tps = metrics_gauge(m, "moerl_rollout_tokens_per_s", "Recent generation throughput.");
    k->score_retries = metrics_counter(m, "moerl_rollout_score_retries_total",
                                       "Score requests sent again (timeout or refusal).");
    k->score_failures = metrics_counter(m, "moerl_rollout_score_failures_total",
                                        "Groups that could not be scored.");
    k->unscored = metrics_counter(m, "moerl_rollout_unscored_total",
                                  "Groups sent without rewards (scoring failed).");
    k->applied =
        metrics_counter(m, "moerl_rollout_adapters_applied_total", "Adapter versions applied.");
    k->snapshots =
        metrics_counter(m, "moerl_rollout_snapshot_requests_total", "Snapshot requests sent.");
    k->inflight = metrics_gauge(m, "moerl_rollout_inflight", "Lease items held.");
    k->queued =
        metrics_gauge(m, "moerl_rollout_queue_depth", "Lease items waiting for or in the engine.");
    k->gen_ms = metrics_gauge(m, "moerl_rollout_gen_ms", "Generation wall time of the last group.");
    k->score_ms = metrics_gauge(m, "moerl_rollout_score_ms", "Scoring time of the last group.");
    metrics_set(m, k->up, 1);
    metrics_set(m, k->version, NAN);
}

static int open_sockets(ro_t *d) {
    zsock_ctx_t *c = &d->zc;
    TRY(zsock_ctx_open(c, &d->cfg->transport, d->id, false)); /* binds nothing */
    TRY(zsock_ctx_socket(c, ZS_WORKER_CONTROL, 0, &d->control));
    TRY(zsock_ctx_socket(c, ZS_ROLLOUT_WORK, 0, &d->work));
    TRY(zsock_ctx_socket(c, ZS_ROLLOUT_REWARD, d->cfg->reward.workers, &d->reward));
    TRY(zsock_ctx_socket(c, ZS_ROLLOUT_SINK, 0, &d->sink));
    return zsock_ctx_socket(c, ZS_ROLLOUT_WEIGHTS, 0, &d->weights);
}

static int start_metrics(ro_t *d) {
    const moerl_config_t *c = d->cfg;
    char path[4200], run[4096];
    if (c->metrics.jsonl) {
        TRY(config_run_dir(c, run, sizeof run));
        snprintf(path, sizeof path, "%s/metrics/%s.jsonl", run, d->id);
        TRY(metrics_jsonl_open(d->m, path));
    }
    int port = d->o->metrics_port;
    if (port < 0)
        port = c->metrics.http_port > 0 ? c->metrics.http_port + 1 + d->o->index : 0;
    if (port > 65535)
        return mo_errorf(MO_ECONFIG, "metrics port %d (metrics.http_port + offset) is past 65535",
                         port);
    if (port > 0)
        TRY(metrics_http_start(d->m, port, c->transport.allow_insecure_remote));
    return MO_OK;
}

static int load_engine(ro_t *d) {
    const moerl_config_t *c = d->cfg;
    if (c->rollout.group_size > c->rollout.max_batch)
        return mo_errorf(MO_ECONFIG,
                         "rollout.group_size (%d) exceeds rollout.max_batch (%d): a group's "
                         "completions are decoded together",
                         c->rollout.group_size, c->rollout.max_batch);
    int rc = model_open(&d->model, c->model.path, NULL);
    if (rc < 0)
        return mo_error_wrap(rc, "model.path %s", c->model.path);
    rc = tokenizer_load(c->model.path, &d->tok);
    if (rc < 0)
        return mo_error_wrap(rc, "tokenizer of model.path %s", c->model.path);
    engine_opts_t eo;
    engine_opts_from_config(&eo, c);
    eo.tok = d->tok;
    TRY(engine_new(&d->e, d->model, &eo));
    gen_params_from_config(&d->gp, c);
    d->gp.record_routing = 1;
    d->gp.record_prompt_routing = 1; /* its last row starts the wire routing */
    return weights_assembler_new(&d->as, ADAPTER_MAX_BYTES);
}

static int setup(ro_t *d) {
    const moerl_config_t *c = d->cfg;
    if (d->o->index < 0 || d->o->index >= c->rollout.workers)
        return mo_errorf(MO_ECONFIG, "--worker-id %d: rollout.workers is %d (ids 0..%d)",
                         d->o->index, c->rollout.workers, c->rollout.workers - 1);
    TRY(metrics_new(&d->m, d->id));
    register_metrics(d);
    TRY(load_engine(d));
    TRY(open_sockets(d));
    TRY(start_metrics(d));
    d->heartbeat_ms = c->transport.heartbeat_ms;
    loop_learner_watch_init(&d->lw, &c->transport);
    d->cap = c->rollout.max_batch / c->rollout.group_size;
    TRY(loop_new(&d->loop));
    TRY(loop_on_signals(d->loop, on_signal, d));
    TRY(loop_watch_socket(d->loop, d->control, on_control, d));
    TRY(loop_watch_socket(d->loop, d->work, on_work, d));
    TRY(loop_watch_socket(d->loop, d->weights, on_weights, d));
    TRY(loop_watch_socket(d->loop, d->reward, on_reward, d));
    loop_worker_opts_t wo = {w_body, on_result, NULL, wmsg_free, wmsg_free, d};
    TRY(loop_worker_start(d->loop, &wo, &d->w));
    uint64_t tick = d->heartbeat_ms < 100 ? (uint64_t)d->heartbeat_ms : 100;
    TRY(loop_timer_start(d->loop, tick, tick, on_tick, d, NULL));
    TRY(loop_timer_start(d->loop, ROLLOUT_METRICS_MS, ROLLOUT_METRICS_MS, on_metrics_timer, d,
                         NULL));
    send_hello(d);
    return MO_OK;
}

static void teardown(ro_t *d) {
    loop_destroy(&d->loop); /* joins the worker thread */
    while (d->items)
        item_done(d, d->items);
    zsock_ctx_close(&d->zc);
    engine_destroy(&d->e);
    lora_adapter_destroy(&d->bound);
    for (int i = 0; i < d->n_spares; i++)
        lora_adapter_destroy(&d->spares[i]);
    if (d->has_pending)
        weights_adapter_free(&d->pending);
    weights_assembler_destroy(&d->as);
    tokenizer_destroy(&d->tok);
    model_destroy(&d->model);
    metrics_destroy(&d->m);
}

static void notify_ready(ro_t *d) {
    metrics_log(d->m, "ready: model %s on %s, learner %s, %d reward endpoint(s), pid %d",
                d->cfg->model.path, engine_get_opts(d->e).device == DEV_CUDA ? "cuda" : "cpu",
                d->cfg->transport.control, d->cfg->reward.workers, (int)getpid());
    if (d->o->ready_fd >= 0) {
        ssize_t n = write(d->o->ready_fd, "ready\n", 6);
        (void)n;
        close(d->o->ready_fd);
    }
}

int rollout_daemon_run(const rollout_daemon_opts_t *o) {
    ro_t *d = calloc(1, sizeof *d);
    if (!d)
        return mo_errorf(MO_ENOMEM, "out of memory");
    d->o = o;
    d->cfg = o->cfg;
    d->applied = -1;
    d->wversion = -1;
    atomic_init(&d->generated, 0);
    if (o->worker_id)
        snprintf(d->id, sizeof d->id, "%s", o->worker_id);
    else
        snprintf(d->id, sizeof d->id, "rollout-%d", o->index);
    int rc = setup(d);
    if (rc == MO_OK) {
        notify_ready(d);
        rc = loop_run(d->loop);
        if (rc == MO_OK && d->fail_rc < 0)
            rc = mo_errorf(d->fail_rc, "%s", d->fail_msg);
    }
    if (d->m && d->loop) {
        tokens_per_s(d);
        metrics_set(d->m, d->k.up, 0);
        metrics_jsonl_write(d->m, "final");
        metrics_log(d->m, "exiting: %.0f groups pushed, %.0f tokens generated",
                    metrics_value(d->m, d->k.pushed), metrics_value(d->m, d->k.tokens));
    }
    bool hard = d->hard_exit;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", rc < 0 ? mo_last_error() : "");
    teardown(d);
    free(d);
    if (rc < 0)
        return mo_errorf(rc, "%s", msg);
    return hard ? mo_errorf(MO_ESTATE, "stopped by a second signal") : MO_OK;
}
