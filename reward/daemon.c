/* reward daemon: score_request -> score_reply on a worker thread, reward swaps,
 * registration and heartbeats with the learner. */
#include "reward/daemon.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "core/metrics.h"
#include "core/status.h"
#include "reward/reward.h"
#include "transport/codec.h"
#include "transport/loop.h"
#include "transport/zsock.h"

#define HELLO_RETRY_MS 2000
#define REWARD_METRICS_MS 5000 /* period of the JSON lines */

typedef enum { JOB_SCORE = 0, JOB_SWAP } job_kind_t;

typedef struct job {
    job_kind_t kind;
    zsock_peer_t peer;             /* JOB_SCORE: the rollout to answer */
    msg_t req;                     /* score_request, reward_swap or welcome (owned) */
    const msg_reward_spec_t *spec; /* JOB_SWAP: points into req */
    /* result */
    int status;
    char error[1024];
    msg_buf_t reply; /* JOB_SCORE: the encoded score_reply */
    uint64_t version;
    double score_ms, reward_sum;
    int n_samples;
} job_t;

typedef struct ids {
    int groups, samples, failures, dropped, version, swaps, swap_failures, score_ms, inflight,
        reward_mean, up;
} ids_t;

typedef struct rd {
    const reward_daemon_opts_t *o;
    const moerl_config_t *cfg;
    char id[MSG_MAX_ID + 1];
    loop_t *loop;
    metrics_t *m;
    ids_t k;
    zsock_ctx_t zc;
    void *server, *control;
    uint64_t refused_seen; /* CURVE clients refused, as last logged */
    char endpoint[512];
    loop_worker_t *w;
    reward_holder_t *holder;
    bool welcomed;
    uint64_t last_hello_ms;
    int heartbeat_ms;
    loop_learner_watch_t lw; /* the learner's liveness */
    int fail_rc;             /* the loop stopped on an error (the learner gone) */
    char fail_msg[512];
    int refused_id;          /* counter of CURVE clients refused */
    loop_timer_t *hb, *drain_timer;
    int inflight;
    bool stopping, hard_exit;
    uint64_t stop_deadline;
} rd_t;

void reward_daemon_opts_default(reward_daemon_opts_t *o, const moerl_config_t *cfg) {
    memset(o, 0, sizeof *o);
    o->cfg = cfg;
    o->ready_fd = -1;
    o->metrics_port = -1;
}

static void job_free(void *p) {
    job_t *j = p;
    if (!j)
        return;
    msg_free(&j->req);
    msg_buf_free(&j->reply);
    free(j);
}

/* ---- Worker thread ---- */

static int finish_of(msg_finish_t f) {
    return f == MSG_FINISH_LENGTH  ? MOERL_FINISH_LENGTH
           : f == MSG_FINISH_ABORT ? MOERL_FINISH_ABORT
                                   : MOERL_FINISH_STOP;
}

/* Encodes the reply of a scored group: rewards (G), parts (G, np) named by fn. */
static int encode_reply(job_t *j, const reward_fn_t *fn, const double *rewards, const double *parts,
                        int np) {
    const msg_score_request_t *r = &j->req.score_request;
    int G = (int)r->n_samples;
    float *rf = malloc(sizeof *rf * (size_t)G);
    msg_metrics_t *det = calloc((size_t)G, sizeof *det);
    msg_metric_t *items = calloc((size_t)G * (size_t)(np ? np : 1), sizeof *items);
    int rc = rf && det && items ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    bool parts_ok = np > 0;
    for (int i = 0; i < G && rc == MO_OK; i++) {
        rf[i] = (float)rewards[i];
        if (!isfinite(rf[i]))
            rc = mo_errorf(MO_EINVAL, "sample %d: reward %g does not fit a float", i, rewards[i]);
        j->reward_sum += rewards[i];
        for (int k = 0; k < np; k++) {
            items[(size_t)i * np + k].key = reward_fn_part_name(fn, k);
            items[(size_t)i * np + k].value = parts[(size_t)i * np + k];
            parts_ok = parts_ok && isfinite(parts[(size_t)i * np + k]);
        }
        det[i].items = items + (size_t)i * np;
        det[i].n = (uint32_t)np;
    }
    if (rc == MO_OK) {
        msg_t m;
        msg_init(&m);
        m.type = MSG_SCORE_REPLY;
        m.score_reply.group_id = r->group_id;
        m.score_reply.reward_version = j->version;
        m.score_reply.rewards = rf;
        m.score_reply.n_samples = (uint32_t)G;
        m.score_reply.details = parts_ok ? det : NULL;
        m.score_reply.has_score_ms = true;
        m.score_reply.score_ms = j->score_ms;
        rc = msg_encode(&m, &j->reply);
    }
    free(rf);
    free(det);
    free(items);
    return rc;
}

static int score(rd_t *d, job_t *j) {
    const msg_score_request_t *r = &j->req.score_request;
    int G = (int)r->n_samples;
    reward_lease_t lease;
    reward_holder_acquire(d->holder, &lease);
    j->version = lease.version;
    int np = reward_fn_n_parts(lease.fn);
    reward_input_t *in = calloc((size_t)G, sizeof *in);
    double *rewards = calloc((size_t)G, sizeof *rewards);
    double *parts = calloc((size_t)G * (size_t)(np > 0 ? np : 1), sizeof *parts);
    moerl_reward_kv_t *extra = calloc(r->extra.n + 1, sizeof *extra);
    int rc = in && rewards && parts && extra ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    for (uint32_t e = 0; rc == MO_OK && e < r->extra.n; e++) {
        extra[e].key = r->extra.items[e].key;
        extra[e].value = r->extra.items[e].value;
    }
    for (int i = 0; rc == MO_OK && i < G; i++) {
        reward_input_init(&in[i], r->prompt, r->samples[i].text, r->answer);
        in[i].extra = extra;
        in[i].n_extra = r->extra.n;
        in[i].finish_reason = finish_of(r->samples[i].finish);
        in[i].completion_tokens = r->samples[i].n_tokens;
        in[i].sample_index = i;
        in[i].group_size = G;
    }
    double t0 = loop_clock_ms();
    if (rc == MO_OK)
        rc = reward_fn_score_group(lease.fn, in, G, rewards, parts, NULL, 0);
    j->score_ms = loop_clock_ms() - t0;
    j->n_samples = G;
    if (rc == MO_OK)
        rc = encode_reply(j, lease.fn, rewards, parts, np);
    if (rc < 0)
        mo_error_wrap(rc, "group %llu, reward version %llu", (unsigned long long)r->group_id,
                      (unsigned long long)lease.version);
    reward_holder_release(d->holder, &lease);
    free(in);
    free(rewards);
    free(parts);
    free(extra);
    return rc;
}

static int swap(rd_t *d, job_t *j) {
    const msg_reward_spec_t *s = j->spec;
    uint64_t cur = reward_holder_version(d->holder);
    if (s->version <= cur) { /* already held (a welcome after a swap, a repeat) */
        j->version = cur;
        return 1;
    }
    int rc = reward_holder_swap_config(d->holder, s->function, s->plugin ? s->plugin : "",
                                       s->version, &j->version);
    if (rc < 0)
        mo_error_wrap(rc, "reward version %llu (%s%s%s)", (unsigned long long)s->version,
                      s->function, s->plugin ? ", plugin " : "", s->plugin ? s->plugin : "");
    return rc;
}

static void body(loop_worker_t *w, void *arg) {
    rd_t *d = arg;
    void *item;
    while (loop_worker_next(w, &item, -1) == 1) {
        job_t *j = item;
        mo_clear_error();
        j->status = j->kind == JOB_SCORE ? score(d, j) : swap(d, j);
        if (j->status < 0)
            snprintf(j->error, sizeof j->error, "%s", mo_last_error());
        if (loop_worker_post(w, j) < 0)
            job_free(j);
    }
}

/* ---- Loop thread ---- */

static void maybe_finish(rd_t *d) {
    if (d->stopping && (d->inflight == 0 || loop_now_ms(d->loop) >= d->stop_deadline))
        loop_stop(d->loop);
}

static void on_drain_tick(void *arg) {
    maybe_finish(arg);
}

static void begin_stop(rd_t *d, const char *why) {
    if (d->stopping)
        return;
    d->stopping = true;
    int ms = d->o->drain_ms > 0 ? d->o->drain_ms : 5000;
    d->stop_deadline = loop_now_ms(d->loop) + (uint64_t)ms;
    metrics_log(d->m, "stopping (%s); %d request(s) being scored", why, d->inflight);
    loop_timer_start(d->loop, 20, 20, on_drain_tick, d, &d->drain_timer);
    maybe_finish(d);
}

static void on_signal(int signum, void *arg) {
    rd_t *d = arg;
    if (d->stopping) {
        metrics_log(d->m, "second signal %d: exiting now", signum);
        d->hard_exit = true;
        loop_stop(d->loop);
        return;
    }
    begin_stop(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void send_control(rd_t *d, const msg_t *m) {
    int rc = zsock_send_msg(d->control, NULL, m, ZMQ_DONTWAIT);
    if (rc < 0)
        metrics_log(d->m, "send %s to the learner: %s", msg_type_name(m->type), mo_last_error());
}

static void send_hello(rd_t *d) {
    msg_t m;
    loop_hello(&m, MSG_ROLE_REWARD, d->id);
    send_control(d, &m);
    d->last_hello_ms = loop_now_ms(d->loop);
}

static void send_heartbeat(rd_t *d) {
    msg_t m;
    msg_init(&m);
    m.type = MSG_HEARTBEAT;
    msg_heartbeat_t *h = &m.heartbeat;
    h->worker_id = d->id;
    h->role = MSG_ROLE_REWARD;
    h->has_reward_version = true;
    h->reward_version = reward_holder_version(d->holder);
    h->inflight = (uint32_t)d->inflight;
    h->tokens_per_s = 0;
    h->queue_depth = (uint32_t)(d->inflight > 0 ? d->inflight - 1 : 0);
    send_control(d, &m);
}

static void on_heartbeat_timer(void *arg) {
    rd_t *d = arg;
    uint64_t now = loop_now_ms(d->loop);
    if (!d->fail_rc && loop_learner_check(&d->lw, now, d->cfg->transport.control) < 0) {
        d->fail_rc = MO_ESTATE;
        snprintf(d->fail_msg, sizeof d->fail_msg, "%s", mo_last_error());
        metrics_log(d->m, "%s", d->fail_msg);
        d->stopping = true;
        loop_stop(d->loop);
        return;
    }
    loop_note_refused(d->m, d->refused_id, &d->zc, &d->refused_seen);
    if (!d->welcomed) {
        if (loop_now_ms(d->loop) >= d->last_hello_ms + HELLO_RETRY_MS)
            send_hello(d);
    } else {
        send_heartbeat(d);
    }
    metrics_set(d->m, d->k.inflight, d->inflight);
    maybe_finish(d);
}

static void on_metrics_timer(void *arg) {
    rd_t *d = arg;
    metrics_jsonl_write(d->m, "periodic");
}

static void restart_heartbeats(rd_t *d, int ms) {
    d->heartbeat_ms = ms;
    loop_timer_close(&d->hb);
    loop_timer_start(d->loop, (uint64_t)ms, (uint64_t)ms, on_heartbeat_timer, d, &d->hb);
}

static int submit(rd_t *d, job_t *j) {
    int rc = loop_worker_submit(d->w, j);
    if (rc < 0) {
        job_free(j);
        return rc;
    }
    d->inflight++;
    return MO_OK;
}

/* Moves a decoded message into a new job. */
static job_t *job_from(msg_t *m, job_kind_t kind) {
    job_t *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->kind = kind;
    j->req = *m;
    msg_init(m);
    msg_buf_init(&j->reply);
    return j;
}

static void swap_to(rd_t *d, msg_t *m, const char *from) {
    job_t *j = job_from(m, JOB_SWAP);
    if (!j)
        return;
    j->spec = j->req.type == MSG_WELCOME ? &j->req.welcome.reward : &j->req.reward_swap.spec;
    metrics_log(d->m, "loading reward version %llu from %s: %s",
                (unsigned long long)j->spec->version, from, j->spec->function);
    submit(d, j);
}

static void send_error(rd_t *d, void *sock, const zsock_peer_t *to, int code, const char *message,
                       const char *about, bool has_id, uint64_t id) {
    msg_t e;
    msg_init(&e);
    e.type = MSG_ERROR;
    e.error.code = code < -1000 || code > -1 ? MO_EINVAL : code;
    e.error.message = message && *message ? message : "failed";
    e.error.about = about;
    e.error.has_id = has_id;
    e.error.id = id;
    char msgbuf[1024];
    size_t len = strlen(e.error.message);
    if (len >= sizeof msgbuf) { /* keep replies short: cut long messages */
        size_t n = sizeof msgbuf - 1;
        while (n > 0 && ((unsigned char)e.error.message[n] & 0xC0) == 0x80)
            n--; /* do not split a UTF-8 sequence */
        memcpy(msgbuf, e.error.message, n);
        msgbuf[n] = '\0';
        e.error.message = msgbuf;
    }
    int rc = zsock_send_msg(sock, to, &e, ZMQ_DONTWAIT);
    if (rc < 0 && rc != MO_ENOTFOUND)
        metrics_log(d->m, "send error reply: %s", mo_last_error());
}

static void on_control_msg(rd_t *d, msg_t *m) {
    loop_learner_heard(&d->lw, loop_now_ms(d->loop), m->type == MSG_WELCOME);
    switch (m->type) {
    case MSG_HEARTBEAT: break; /* the learner's answer: it is alive */
    case MSG_WELCOME:
        if (d->cfg->transport.learner_timeout_ms == 0) /* 10 of the learner's intervals */
            d->lw.timeout_ms = 10u * (uint64_t)m->welcome.heartbeat_ms;
        if (!d->welcomed)
            metrics_log(d->m, "registered with the learner (job %s, policy version %llu)",
                        m->welcome.job, (unsigned long long)m->welcome.policy_version);
        d->welcomed = true;
        if ((int)m->welcome.heartbeat_ms != d->heartbeat_ms)
            restart_heartbeats(d, (int)m->welcome.heartbeat_ms);
        send_heartbeat(d);
        if (m->welcome.has_reward && m->welcome.reward.version > reward_holder_version(d->holder) &&
            !d->stopping)
            swap_to(d, m, "the learner's welcome");
        break;
    case MSG_REWARD_SWAP:
        if (!d->stopping)
            swap_to(d, m, "reward_swap");
        break;
    case MSG_CTL_REQUEST:
        if (m->ctl_request.command == MSG_CTL_STOP)
            begin_stop(d, "the learner asked to stop");
        break;
    case MSG_ERROR:
        if (m->error.code == MO_ENOTFOUND && m->error.about &&
            !strcmp(m->error.about, "heartbeat")) {
            metrics_log(d->m, "the learner does not know this worker: registering again");
            d->welcomed = false;
            send_hello(d);
        } else {
            metrics_log(d->m, "learner error about %s: %s", m->error.about ? m->error.about : "?",
                        m->error.message);
        }
        break;
    default:
        metrics_malformed(d->m, msg_type_name(m->type), "learner", "unexpected message type",
                          loop_now_ms(d->loop));
    }
}

static void on_control(void *sock, void *arg) {
    rd_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == 1)
        on_control_msg(d, &m);
    else if (rc == MO_EMALFORMED)
        metrics_malformed(d->m, msg_type_name(t), "learner", mo_last_error(), loop_now_ms(d->loop));
    else if (rc < 0)
        metrics_log(d->m, "control socket: %s", mo_last_error());
    msg_free(&m);
}

static void on_server(void *sock, void *arg) {
    rd_t *d = arg;
    msg_t m;
    msg_type_t t;
    zsock_peer_t from;
    char peer[MSG_MAX_ID + 1];
    int rc = loop_recv_msg(sock, &from, &m, &t);
    if (rc == 0)
        return;
    loop_peer_name(&from, peer, sizeof peer);
    if (rc == 1 && m.type != MSG_SCORE_REQUEST)
        rc = mo_errorf(MO_EMALFORMED, "%s on the reward socket: expected score_request",
                       msg_type_name(m.type));
    if (rc < 0) {
        if (rc == MO_EMALFORMED) {
            metrics_malformed(d->m, msg_type_name(t != MSG_NONE ? t : MSG_SCORE_REQUEST), peer,
                              mo_last_error(), loop_now_ms(d->loop));
            if (from.len)
                send_error(d, sock, &from, MO_EMALFORMED, mo_last_error(), "score_request", false,
                           0);
        } else {
            metrics_log(d->m, "reward socket: %s", mo_last_error());
        }
        msg_free(&m);
        return;
    }
    uint64_t gid = m.score_request.group_id;
    if (d->stopping) {
        metrics_inc(d->m, d->k.dropped, 1);
        send_error(d, sock, &from, MO_ESTATE, "this reward worker is stopping", "score_request",
                   true, gid);
        msg_free(&m);
        return;
    }
    job_t *j = job_from(&m, JOB_SCORE);
    if (!j) {
        send_error(d, sock, &from, MO_ENOMEM, "out of memory", "score_request", true, gid);
        msg_free(&m);
        return;
    }
    j->peer = from;
    if (submit(d, j) < 0)
        send_error(d, sock, &from, MO_ESTATE, mo_last_error(), "score_request", true, gid);
}

static void on_result(void *item, void *arg) {
    rd_t *d = arg;
    job_t *j = item;
    d->inflight--;
    if (j->kind == JOB_SCORE) {
        uint64_t gid = j->req.score_request.group_id;
        if (j->status == MO_OK) {
            int rc = zsock_send_buf(d->server, &j->peer, &j->reply, ZMQ_DONTWAIT);
            if (rc <= 0)
                metrics_log(d->m, "reply to group %llu: %s", (unsigned long long)gid,
                            rc == 0 ? "send queue full" : mo_last_error());
            metrics_inc(d->m, d->k.groups, 1);
            metrics_inc(d->m, d->k.samples, j->n_samples);
            metrics_set(d->m, d->k.score_ms, j->score_ms);
            metrics_set(d->m, d->k.reward_mean, j->reward_sum / (j->n_samples ? j->n_samples : 1));
        } else {
            metrics_inc(d->m, d->k.failures, 1);
            metrics_log(d->m, "scoring failed: %s", j->error);
            send_error(d, d->server, &j->peer, j->status, j->error, "score_request", true, gid);
        }
    } else if (j->status >= 0) {
        if (j->status == MO_OK) {
            char desc[512];
            uint64_t v;
            reward_holder_describe(d->holder, desc, sizeof desc, &v);
            metrics_inc(d->m, d->k.swaps, 1);
            metrics_log(d->m, "reward version %llu installed: %s", (unsigned long long)v, desc);
        }
        metrics_set(d->m, d->k.version, (double)reward_holder_version(d->holder));
        if (d->welcomed)
            send_heartbeat(d);
    } else {
        metrics_inc(d->m, d->k.swap_failures, 1);
        metrics_log(d->m, "reward swap refused, keeping version %llu: %s",
                    (unsigned long long)reward_holder_version(d->holder), j->error);
        send_error(d, d->control, NULL, j->status, j->error, "reward_swap", true, j->spec->version);
    }
    job_free(j);
    maybe_finish(d);
}

/* ---- Setup ---- */

static void register_metrics(rd_t *d) {
    metrics_t *m = d->m;
    d->k.up = metrics_gauge(m, "moerl_up", "1 while the daemon runs.");
    d->k.groups = metrics_counter(m, "moerl_reward_groups_total", "Groups scored.");
    d->k.samples = metrics_counter(m, "moerl_reward_samples_total", "Completions scored.");
    d->k.failures = metrics_counter(m, "moerl_reward_failures_total",
                                    "Groups whose scoring failed (answered with an error).");
    d->k.dropped = metrics_counter(m, "moerl_reward_refused_total",
                                   "Requests refused because the worker was stopping.");
    d->k.version = metrics_gauge(m, "moerl_reward_version", "Reward function version held.");
    d->k.swaps = metrics_counter(m, "moerl_reward_swaps_total", "Reward versions installed.");
    d->k.swap_failures =
        metrics_counter(m, "moerl_reward_swap_failures_total", "Reward swaps refused.");
    d->k.score_ms = metrics_gauge(m, "moerl_reward_score_ms", "Wall time of the last group.");
    d->k.inflight = metrics_gauge(m, "moerl_reward_inflight", "Requests being scored.");
    d->k.reward_mean = metrics_gauge(m, "moerl_reward_last_mean", "Mean reward of the last group.");
    d->refused_id = metrics_counter(m, "moerl_transport_refused_clients_total",
                                    "CURVE clients refused by transport.curve_allowed_clients.");
    metrics_set(m, d->k.up, 1);
}

static int open_sockets(rd_t *d) {
    const config_transport_t *t = &d->cfg->transport;
    TRY(zsock_endpoint_nth(t->reward, d->o->index, d->endpoint, sizeof d->endpoint));
    TRY(zsock_ctx_open(&d->zc, t, d->id, true));
    TRY(zsock_ctx_socket(&d->zc, ZS_REWARD_SERVER, d->o->index, &d->server));
    return zsock_ctx_socket(&d->zc, ZS_WORKER_CONTROL, 0, &d->control);
}

static int start_metrics(rd_t *d) {
    const moerl_config_t *c = d->cfg;
    char path[4200], run[4096];
    if (c->metrics.jsonl) {
        TRY(config_run_dir(c, run, sizeof run));
        snprintf(path, sizeof path, "%s/metrics/%s.jsonl", run, d->id);
        TRY(metrics_jsonl_open(d->m, path));
    }
    int port = d->o->metrics_port;
    if (port < 0)
        port = c->metrics.http_port > 0
                   ? c->metrics.http_port + 1 + c->rollout.workers + d->o->index
                   : 0;
    if (port > 65535)
        return mo_errorf(MO_ECONFIG, "metrics port %d (metrics.http_port + offset) is past 65535",
                         port);
    if (port > 0)
        TRY(metrics_http_start(d->m, port, c->transport.allow_insecure_remote));
    return MO_OK;
}

static int setup(rd_t *d) {
    const moerl_config_t *c = d->cfg;
    if (d->o->index < 0 || d->o->index >= c->reward.workers)
        return mo_errorf(MO_ECONFIG, "--index %d: reward.workers is %d (indexes 0..%d)",
                         d->o->index, c->reward.workers, c->reward.workers - 1);
    TRY(metrics_new(&d->m, d->id));
    register_metrics(d);
    reward_fn_t *fn = NULL;
    int rc = reward_fn_from_config(c->reward.function, c->reward.plugin, &fn);
    if (rc < 0)
        return mo_error_wrap(rc, "reward.function '%s'", c->reward.function);
    rc = reward_holder_new(&fn, 1, &d->holder);
    reward_fn_destroy(&fn);
    TRY(rc);
    metrics_set(d->m, d->k.version, 1);
    TRY(open_sockets(d));
    TRY(start_metrics(d));
    TRY(loop_new(&d->loop));
    TRY(loop_on_signals(d->loop, on_signal, d));
    TRY(loop_watch_socket(d->loop, d->server, on_server, d));
    TRY(loop_watch_socket(d->loop, d->control, on_control, d));
    loop_worker_opts_t wo = {body, on_result, NULL, job_free, job_free, d};
    TRY(loop_worker_start(d->loop, &wo, &d->w));
    loop_learner_watch_init(&d->lw, &c->transport);
    restart_heartbeats(d, c->transport.heartbeat_ms);
    TRY(loop_timer_start(d->loop, REWARD_METRICS_MS, REWARD_METRICS_MS, on_metrics_timer, d, NULL));
    send_hello(d);
    return MO_OK;
}

static void teardown(rd_t *d) {
    loop_destroy(&d->loop);
    zsock_ctx_close(&d->zc);
    reward_holder_destroy(&d->holder);
    metrics_destroy(&d->m);
}

static void notify_ready(rd_t *d) {
    char desc[512];
    uint64_t v;
    reward_holder_describe(d->holder, desc, sizeof desc, &v);
    metrics_log(d->m, "ready: serving %s (reward version %llu: %s), learner %s, pid %d",
                d->endpoint, (unsigned long long)v, desc, d->cfg->transport.control, (int)getpid());
    if (d->o->ready_fd >= 0) {
        ssize_t n = write(d->o->ready_fd, "ready\n", 6);
        (void)n;
        close(d->o->ready_fd);
    }
}

int reward_daemon_run(const reward_daemon_opts_t *o) {
    rd_t d;
    memset(&d, 0, sizeof d);
    d.o = o;
    d.cfg = o->cfg;
    if (o->worker_id)
        snprintf(d.id, sizeof d.id, "%s", o->worker_id);
    else
        snprintf(d.id, sizeof d.id, "reward-%d", o->index);
    int rc = setup(&d);
    if (rc == MO_OK) {
        notify_ready(&d);
        rc = loop_run(d.loop);
        if (rc == MO_OK && d.fail_rc < 0)
            rc = mo_errorf(d.fail_rc, "%s", d.fail_msg);
    }
    if (d.m && d.loop) {
        metrics_set(d.m, d.k.up, 0);
        metrics_jsonl_write(d.m, "final");
        metrics_log(d.m, "exiting: %.0f groups scored, %.0f failed", metrics_value(d.m, d.k.groups),
                    metrics_value(d.m, d.k.failures));
    }
    int hard = d.hard_exit;
    if (rc < 0) {
        char msg[2048];
        snprintf(msg, sizeof msg, "%s", mo_last_error());
        teardown(&d);
        return mo_errorf(rc, "%s", msg);
    }
    teardown(&d);
    return hard ? mo_errorf(MO_ESTATE, "stopped by a second signal") : MO_OK;
}
