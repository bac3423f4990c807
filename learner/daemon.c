/* learner daemon: prompt leases, scored groups in, training on a worker thread, adapter
 * versions out, checkpoints, ctl requests. */
#include "learner/daemon.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "core/backend.h"
#include "core/metrics.h"
#include "core/status.h"
#include "learner/actor_exec.h"
#include "learner/checkpoint.h"
#include "learner/daemon_internal.h"
#include "learner/dataset.h"
#include "learner/ep_learner.h"
#include "learner/sample.h"
#include "learner/trainer.h"
#include "reward/reward.h"
#include "transport/codec.h"
#include "transport/loop.h"
#include "transport/weights.h"
#include "transport/zsock.h"

void learner_daemon_opts_default(learner_daemon_opts_t *o, const moerl_config_t *cfg) {
    memset(o, 0, sizeof *o);
    o->cfg = cfg;
    o->ready_fd = -1;
    o->metrics_port = -1;
}

/* ---- Training ---- */

static void tjob_free(void *p) {
    tjob_t *j = p;
    if (!j)
        return;
    for (int i = 0; i < j->n; i++)
        sample_group_destroy(&j->groups[i]);
    free(j->groups);
    free(j->imbalance);
    free(j->agreement);
    free(j->params);
    free(j);
}

static int save(ld_t *d, tjob_t *j) {
    const moerl_config_t *c = d->cfg;
    checkpoint_save_opts_t so = {c->learner.keep_checkpoints, c->model.path, CKPT_CRASH_NONE};
    int rc = ep_lead_save(d->t, d->run_dir, &j->data, &so, j->ckpt, sizeof j->ckpt);
    j->ckpt_status = rc;
    j->saved = rc == MO_OK;
    if (rc < 0)
        snprintf(j->ckpt_error, sizeof j->ckpt_error, "%s", mo_last_error());
    return rc;
}

/* Worker thread: one job. */
static void run_job(ld_t *d, tjob_t *j) {
    trainer_t *t = d->t;
    if (j->kind == J_CHECKPOINT) {
        save(d, j);
    } else {
        j->status = ep_lead_step(t, (const sample_group_t *const *)j->groups, j->n, &j->tm);
        if (j->status < 0) {
            snprintf(j->error, sizeof j->error, "%s", mo_last_error());
        } else {
            j->M = j->tm.M;
            j->imbalance = calloc((size_t)j->M + 1, sizeof *j->imbalance);
            j->agreement = calloc((size_t)j->M + 1, sizeof *j->agreement);
            for (int l = 0; l < j->M && j->imbalance && j->agreement; l++) {
                j->imbalance[l] = j->tm.expert_imbalance[l];
                j->agreement[l] = j->tm.routing_agreement[l];
            }
            j->tm.expert_imbalance = j->tm.routing_agreement = NULL;
            if (j->tm.trained) {
                j->params = malloc(sizeof(float) * (d->n_params ? d->n_params : 1));
                if (j->params)
                    memcpy(j->params, ep_lead_params(t), sizeof(float) * d->n_params);
                const config_learner_t *lc = &d->cfg->learner;
                if (checkpoint_due(t, lc->checkpoint_every) || t->step >= lc->steps)
                    save(d, j);
            }
        }
    }
    j->step = t->step;
    j->version = t->version;
}

static void t_body(loop_worker_t *w, void *arg) {
    ld_t *d = arg;
    backend_cpu_set_threads(d->cfg->run.threads);
    void *p;
    while (loop_worker_next(w, &p, -1) == 1) {
        run_job(d, p);
        if (loop_worker_post(w, p) < 0)
            tjob_free(p);
    }
}

static checkpoint_data_t cursor(const ld_t *d) {
    dataset_cursor_t c = dataset_tell(d->ds);
    checkpoint_data_t x = {c.epoch, c.pos, dataset_fingerprint(d->ds)};
    return x;
}

static int submit_job(ld_t *d, tjob_t *j) {
    int rc = loop_worker_submit(d->w, j);
    if (rc < 0)
        tjob_free(j);
    return rc;
}

void ld_maybe_step(ld_t *d) {
    if (d->training || d->paused || d->stopping || d->finishing)
        return;
    int k = 0;
    for (int i = 0; i < d->n_waiting; i++) {
        if (ld_group_stale(d, d->waiting[i])) {
            metrics_inc(d->m, d->k.stale_groups, 1);
            sample_group_destroy(&d->waiting[i]);
        } else {
            d->waiting[k++] = d->waiting[i];
        }
    }
    d->n_waiting = k;
    int pps = d->cfg->rollout.prompts_per_step;
    if (d->n_waiting < pps)
        return;
    tjob_t *j = calloc(1, sizeof *j);
    if (j)
        j->groups = malloc(sizeof *j->groups * (size_t)pps);
    if (!j || !j->groups) {
        free(j);
        return;
    }
    j->kind = J_STEP;
    j->n = pps;
    memcpy(j->groups, d->waiting, sizeof *j->groups * (size_t)pps);
    memmove(d->waiting, d->waiting + pps, sizeof *d->waiting * (size_t)(d->n_waiting - pps));
    d->n_waiting -= pps;
    j->data = cursor(d);
    d->training = true;
    d->n_training = pps;
    if (submit_job(d, j) < 0) {
        d->training = false;
        d->n_training = 0;
    }
    metrics_set(d->m, d->k.waiting, d->n_waiting);
}

/* ---- Weights ---- */

/* Serves params (n_params floats, taken) as the current version; broadcast on the PUB
 * socket unless quiet. */
static int publish(ld_t *d, float *params, uint64_t version, bool quiet) {
    weights_split_t s;
    int rc = weights_split_init(&s, params, (uint64_t)d->n_params * sizeof(float), d->table,
                                d->n_table, &(msg_strmap_t){d->meta, 4}, version, d->chunk_bytes);
    if (rc < 0) {
        free(params);
        return rc;
    }
    free(d->pub.flat);
    d->pub.flat = params;
    d->pub.split = s;
    d->pub.split.flat = (const uint8_t *)params;
    d->pub.split.meta = (msg_strmap_t){d->meta, 4};
    d->pub.version = version;
    d->pub.t_publish = loop_clock_ms();
    d->pub.synced = quiet;
    for (uint32_t i = 0; i < s.n_chunks && !quiet; i++) {
        msg_t m;
        weights_split_chunk(&d->pub.split, i, &m);
        ld_send_to(d, d->weights, NULL, &m);
    }
    return MO_OK;
}

static void check_sync(ld_t *d) {
    if (d->pub.synced)
        return;
    int n = 0;
    for (int i = 0; i < d->n_peers; i++) {
        const peer_t *p = &d->peers[i];
        if (p->role != MSG_ROLE_ROLLOUT)
            continue;
        if (!p->has_adapter || p->adapter_version < d->pub.version)
            return;
        n++;
    }
    if (n == 0)
        return;
    d->pub.synced = true;
    metrics_set(d->m, d->k.sync_ms, loop_clock_ms() - d->pub.t_publish);
}

static void send_chunks(ld_t *d, const zsock_peer_t *to) {
    for (uint32_t i = 0; i < d->pub.split.n_chunks; i++) {
        msg_t m;
        weights_split_chunk(&d->pub.split, i, &m);
        if (ld_send_to(d, d->control, to, &m) != 1)
            return;
    }
}

/* ---- Stopping ---- */

/* Tells every registered worker to stop and ends the loop. */
static void finish(ld_t *d, const char *why) {
    if (d->finishing)
        return;
    d->finishing = true;
    metrics_log(d->m, "finishing: %s; telling %d worker(s) to stop", why, d->n_peers);
    msg_kv_t reason = {"reason", why};
    msg_t m;
    msg_init(&m);
    m.type = MSG_CTL_REQUEST;
    m.ctl_request.command = MSG_CTL_STOP;
    m.ctl_request.args = (msg_strmap_t){&reason, 1};
    for (int i = 0; i < d->n_peers; i++)
        ld_send_to(d, d->control, &d->peers[i].route, &m);
    loop_stop(d->loop);
}

static void fail(ld_t *d, int rc, const char *msg) {
    d->fail_rc = rc;
    snprintf(d->fail_msg, sizeof d->fail_msg, "%s", msg);
    metrics_log(d->m, "fatal: %s", msg);
    finish(d, "training failed");
}

/* The stop path: once no step runs, a checkpoint when steps were trained since the last,
 * then finish. */
static void stop_when_idle(ld_t *d) {
    if (d->training || d->stop_ckpt || d->finishing)
        return;
    if (!d->hard_exit && d->step > 0 && d->step > d->ckpt_step) {
        tjob_t *j = calloc(1, sizeof *j);
        if (j) {
            j->kind = J_CHECKPOINT;
            j->final = true;
            j->data = cursor(d);
            if (submit_job(d, j) == MO_OK) {
                d->stop_ckpt = true;
                return;
            }
        }
    }
    finish(d, "stopped");
}

static void begin_stop(ld_t *d, const char *why) {
    if (d->stopping)
        return;
    d->stopping = true;
    metrics_log(d->m, "stopping (%s): no more leases%s", why,
                d->training ? "; the step in progress finishes first" : "");
    stop_when_idle(d);
}

static void on_signal(int signum, void *arg) {
    ld_t *d = arg;
    if (d->stopping) {
        metrics_log(d->m, "second signal %d: exiting without a checkpoint", signum);
        d->hard_exit = true;
        finish(d, "second signal");
        return;
    }
    begin_stop(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- Step results ---- */

/* Fraction of samples with reward 1 when every reward of the batch is 0 or 1 (a
 * verifier's correct / wrong); NaN otherwise. */
static double accuracy(const tjob_t *j) {
    int64_t n = 0, ok = 0;
    for (int i = 0; i < j->n; i++)
        for (int s = 0; s < j->groups[i]->n_samples; s++) {
            float r = j->groups[i]->samples[s].reward;
            if (r != 0.0f && r != 1.0f)
                return NAN;
            n++;
            ok += r == 1.0f;
        }
    return n ? (double)ok / (double)n : NAN;
}

static void record_step(ld_t *d, const tjob_t *j) {
    const trainer_metrics_t *t = &j->tm;
    metrics_t *m = d->m;
    ids_t *k = &d->k;
    metrics_set(m, k->step, (double)j->step);
    metrics_set(m, k->version, (double)j->version);
    metrics_set(m, k->reward_mean, t->reward_mean);
    metrics_set(m, k->reward_std, t->reward_std);
    metrics_set(m, k->accuracy, accuracy(j));
    metrics_set(m, k->loss, t->loss);
    metrics_set(m, k->pg, t->pg);
    metrics_set(m, k->kl, t->kl);
    metrics_set(m, k->entropy, t->entropy);
    metrics_set(m, k->clip, t->clip_frac_low + t->clip_frac_high);
    metrics_set(m, k->clip_low, t->clip_frac_low);
    metrics_set(m, k->clip_high, t->clip_frac_high);
    metrics_set(m, k->grad_norm, t->grad_norm);
    metrics_set(m, k->lr, t->lr);
    metrics_set(m, k->learner_tps, t->tokens_per_s);
    metrics_set(m, k->step_s, t->seconds);
    metrics_set(m, k->staleness, t->staleness_mean);
    metrics_set(m, k->staleness_max, t->staleness_max);
    metrics_set(m, k->agreement, t->routing_agreement_mean >= 0 ? t->routing_agreement_mean : NAN);
    metrics_set(m, k->mismatch, t->mismatch_k3);
    metrics_inc(m, k->groups_trained, t->groups);
    metrics_inc(m, k->stale_samples, t->stale_samples);
    metrics_inc(m, k->samples_trained, t->trained_samples);
    for (int l = 0; l < j->M && j->imbalance; l++) {
        char layer[16];
        snprintf(layer, sizeof layer, "%d", l);
        const char *labels[] = {"layer", layer, NULL};
        int id;
        if (metrics_series(m, METRIC_GAUGE, "moerl_learner_expert_imbalance",
                           "Max / mean expert load per MoE layer in the last step.", labels,
                           &id) == MO_OK)
            metrics_set(m, id, j->imbalance[l]);
    }
    ld_count_peers(d);
}

static void status_line(ld_t *d, const tjob_t *j) {
    const trainer_metrics_t *t = &j->tm;
    double acc = metrics_value(d->m, d->k.accuracy), sync = metrics_value(d->m, d->k.sync_ms);
    char accs[32] = "", syncs[32] = "";
    if (isfinite(acc))
        snprintf(accs, sizeof accs, " | acc %.3f", acc);
    if (isfinite(sync))
        snprintf(syncs, sizeof syncs, " | sync %.0f ms", sync);
    metrics_log(d->m,
                "step %lld/%lld | v%lld | reward %.4f ± %.4f%s | loss %.4g | kl %.3g | ent %.3f "
                "| clip %.3f | gnorm %.3g | %.0f tok/s learner, %.0f rollout | stale %.2f%s | "
                "%.2f s",
                (long long)j->step, (long long)d->cfg->learner.steps, (long long)j->version,
                t->reward_mean, t->reward_std, accs, t->loss, t->kl, t->entropy,
                t->clip_frac_low + t->clip_frac_high, t->grad_norm, t->tokens_per_s,
                metrics_value(d->m, d->k.rollout_tps), t->staleness_mean, syncs, t->seconds);
}

static void after_checkpoint(ld_t *d, tjob_t *j) {
    if (j->saved) {
        d->ckpt_step = j->step;
        metrics_inc(d->m, d->k.checkpoints, 1);
        metrics_log(d->m, "checkpoint %s/%s/%s saved", d->run_dir, CKPT_DIR_NAME, j->ckpt);
    } else if (j->ckpt_status < 0) {
        metrics_log(d->m, "checkpoint at step %lld FAILED: %s", (long long)j->step, j->ckpt_error);
    }
    if (j->has_reply) {
        char text[700];
        snprintf(text, sizeof text, "%s %s",
                 j->saved ? "saved" : "failed:", j->saved ? j->ckpt : j->ckpt_error);
        msg_t m;
        msg_init(&m);
        m.type = MSG_CTL_REPLY;
        m.ctl_reply = (msg_ctl_reply_t){j->saved, text, NULL, 0};
        ld_send_to(d, d->control, &j->reply_to, &m);
    }
}

static void step_done(ld_t *d, tjob_t *j) {
    d->n_training = 0;
    if (j->status < 0) {
        fail(d, j->status, j->error);
        return;
    }
    d->step = j->step;
    d->version = j->version;
    after_checkpoint(d, j);
    if (j->tm.trained) {
        float *params = j->params;
        j->params = NULL;
        if (params && publish(d, params, (uint64_t)j->version, false) < 0)
            metrics_log(d->m, "publishing version %lld: %s", (long long)j->version,
                        mo_last_error());
        record_step(d, j);
        metrics_jsonl_write(d->m, "step");
        if (d->cfg->metrics.status_line)
            status_line(d, j);
        check_sync(d);
    } else {
        metrics_log(d->m, "batch of %d groups not trained (%s): collecting another", j->n,
                    j->tm.note[0] ? j->tm.note : "no sample kept");
    }
}

static void on_result(void *item, void *arg) {
    ld_t *d = arg;
    tjob_t *j = item;
    bool final = j->final;
    if (j->kind == J_STEP) {
        d->training = false;
        step_done(d, j);
    } else {
        after_checkpoint(d, j);
    }
    tjob_free(j);
    if (d->finishing)
        return;
    if (d->step >= d->cfg->learner.steps) {
        char why[64];
        snprintf(why, sizeof why, "all %lld steps done", (long long)d->cfg->learner.steps);
        finish(d, why);
    } else if (final) {
        finish(d, "stopped");
    } else if (d->stopping) {
        stop_when_idle(d);
    } else {
        ld_serve_work(d);
        ld_maybe_step(d);
    }
}

/* ---- Control socket ---- */

static void welcome(ld_t *d, const zsock_peer_t *to) {
    const moerl_config_t *c = d->cfg;
    const config_rollout_t *r = &c->rollout;
    msg_t m;
    msg_init(&m);
    m.type = MSG_WELCOME;
    msg_welcome_t *w = &m.welcome;
    w->job = c->run.name;
    w->policy_version = (uint64_t)d->version;
    w->model_path = c->model.path;
    w->group_size = (uint32_t)r->group_size;
    w->sampling = (msg_sampling_t){
        r->temperature,
        r->top_p,
        r->top_k,
        r->min_p,
        r->max_new_tokens,
        (const char *const *)r->stop_strings.items,
        (uint32_t)(r->stop_strings.n < MSG_MAX_STOP ? r->stop_strings.n : MSG_MAX_STOP),
        (uint64_t)c->run.seed};
    w->heartbeat_ms = (uint32_t)c->transport.heartbeat_ms;
    w->has_reward = true;
    w->reward =
        (msg_reward_spec_t){d->reward_version, d->reward_function,
                            d->reward_plugin && *d->reward_plugin ? d->reward_plugin : NULL};
    ld_send_to(d, d->control, to, &m);
}

static void on_hello(ld_t *d, const msg_hello_t *h, const zsock_peer_t *from) {
    if (h->role != MSG_ROLE_CTL) {
        peer_t *p = ld_find_peer(d, h->worker_id);
        bool fresh = !p;
        if (p && h->role == MSG_ROLE_ROLLOUT) {
            /* A registered worker says hello only when it starts (a worker that was never
             * welcomed has no leases): a new incarnation, so the old one's leases go back
             * to the queue now rather than at their deadline. */
            int before = d->n_leased;
            ld_reclaim(d, h->worker_id, loop_now_ms(d->loop));
            if (d->n_leased < before)
                metrics_log(d->m,
                            "%s registered again (pid %lld): %d prompt(s) it held are handed "
                            "out again",
                            h->worker_id, (long long)h->pid, before - d->n_leased);
        }
        p = ld_add_peer(d, h->worker_id, h->role);
        if (!p)
            return;
        p->role = h->role;
        p->route = *from;
        p->last_seen_ms = loop_now_ms(d->loop);
        if (fresh)
            metrics_log(d->m, "%s %s joined (pid %lld on %s)", msg_role_name(h->role), h->worker_id,
                        (long long)h->pid, h->host);
        ld_count_peers(d);
    }
    welcome(d, from);
}

static void on_heartbeat(ld_t *d, const msg_heartbeat_t *h, const zsock_peer_t *from) {
    peer_t *p = ld_find_peer(d, h->worker_id);
    if (!p) {
        char why[160];
        snprintf(why, sizeof why, "unknown worker %s: send hello", h->worker_id);
        ld_send_error(d, d->control, from, MO_ENOTFOUND, why, "heartbeat", false, 0);
        return;
    }
    p->route = *from;
    p->last_seen_ms = loop_now_ms(d->loop);
    p->has_adapter = h->has_adapter_version;
    p->adapter_version = h->adapter_version;
    p->has_reward = h->has_reward_version;
    p->reward_version = h->reward_version;
    p->tps = h->tokens_per_s;
    p->inflight = h->inflight;
    p->queue_depth = h->queue_depth;
    msg_t ack; /* the worker's proof that the learner is alive */
    loop_learner_heartbeat(&ack, (uint32_t)d->n_leased, (uint32_t)d->n_waiting);
    ld_send_to(d, d->control, from, &ack);
    check_sync(d);
}

static void on_snapshot(ld_t *d, const msg_snapshot_request_t *s, const zsock_peer_t *from) {
    peer_t *p = ld_find_peer(d, s->worker_id);
    if (p)
        p->last_seen_ms = loop_now_ms(d->loop);
    if (s->has_version && s->have_version >= d->pub.version)
        return;
    send_chunks(d, from);
}

static void ctl_reply(ld_t *d, const zsock_peer_t *to, bool ok, const char *text,
                      const msg_stat_t *st, uint32_t n) {
    msg_t m;
    msg_init(&m);
    m.type = MSG_CTL_REPLY;
    m.ctl_reply = (msg_ctl_reply_t){ok, text, st, n};
    ld_send_to(d, d->control, to, &m);
}

typedef struct stats {
    msg_stat_t *s; /* (n) */
    uint32_t n, cap;
    char (*keys)[96]; /* (cap) storage of the keys made here */
} stats_t;

static msg_stat_t *stat_add(stats_t *st) {
    if (st->n == st->cap)
        return NULL;
    msg_stat_t *x = &st->s[st->n++];
    memset(x, 0, sizeof *x);
    return x;
}

static void stat_metric(const char *key, metric_kind_t kind, double v, void *arg) {
    (void)kind;
    msg_stat_t *x = stat_add(arg);
    if (x && strlen(key) <= MSG_MAX_NAME)
        *x = (msg_stat_t){.key = key, .kind = MSG_VAL_FLOAT, .f = v};
    else if (x)
        ((stats_t *)arg)->n--;
}

static void stat_int(stats_t *st, const char *key, int64_t v, bool boolean) {
    msg_stat_t *x = stat_add(st);
    if (x)
        *x = (msg_stat_t){.key = key, .kind = boolean ? MSG_VAL_BOOL : MSG_VAL_INT, .i = v};
}

static void stat_peer(stats_t *st, const peer_t *p, const char *field, double v) {
    msg_stat_t *x = stat_add(st);
    if (!x)
        return;
    char *k = st->keys[st->n - 1];
    snprintf(k, sizeof st->keys[0], "%s.%s", p->id, field);
    *x = (msg_stat_t){.key = k, .kind = MSG_VAL_FLOAT, .f = v};
}

static void reply_status(ld_t *d, const zsock_peer_t *to) {
    stats_t st = {0};
    st.cap = MSG_MAX_STATUS;
    st.s = calloc(st.cap, sizeof *st.s);
    st.keys = calloc(st.cap, sizeof *st.keys);
    if (!st.s || !st.keys) {
        free(st.s);
        free(st.keys);
        ctl_reply(d, to, false, "out of memory", NULL, 0);
        return;
    }
    ld_count_peers(d);
    stat_int(&st, "step", d->step, false);
    stat_int(&st, "steps", d->cfg->learner.steps, false);
    stat_int(&st, "policy_version", d->version, false);
    stat_int(&st, "reward_version", (int64_t)d->reward_version, false);
    stat_int(&st, "paused", d->paused, true);
    stat_int(&st, "stopping", d->stopping, true);
    stat_int(&st, "training", d->training, true);
    uint64_t now = loop_now_ms(d->loop);
    for (int i = 0; i < d->n_peers; i++) {
        const peer_t *p = &d->peers[i];
        stat_peer(&st, p, "last_seen_ms_ago", (double)(now - p->last_seen_ms));
        stat_peer(&st, p, "inflight", p->inflight);
        if (p->role == MSG_ROLE_ROLLOUT) {
            stat_peer(&st, p, "adapter_version", p->has_adapter ? (double)p->adapter_version : NAN);
            stat_peer(&st, p, "tokens_per_s", p->tps);
            stat_peer(&st, p, "queue_depth", p->queue_depth);
        } else {
            stat_peer(&st, p, "reward_version", p->has_reward ? (double)p->reward_version : NAN);
        }
    }
    metrics_foreach(d->m, stat_metric, &st);
    char text[1024];
    snprintf(text, sizeof text, "step %lld/%lld, policy version %lld, %d worker(s)%s%s%s%s",
             (long long)d->step, (long long)d->cfg->learner.steps, (long long)d->version,
             d->n_peers, d->paused ? ", paused" : "", d->stopping ? ", stopping" : "",
             d->last_swap_error[0] ? "; last reward swap failed: " : "", d->last_swap_error);
    ctl_reply(d, to, true, text, st.s, st.n);
    free(st.s);
    free(st.keys);
}

static const char *arg_of(const msg_strmap_t *a, const char *key) {
    for (uint32_t i = 0; i < a->n; i++)
        if (!strcmp(a->items[i].key, key))
            return a->items[i].value;
    return NULL;
}

static void swap_reward(ld_t *d, const msg_strmap_t *args, const zsock_peer_t *to) {
    const char *fn = arg_of(args, "function"), *plugin = arg_of(args, "plugin");
    char text[1200];
    if (!fn || !*fn) {
        ctl_reply(d, to, false, "swap_reward needs the argument function", NULL, 0);
        return;
    }
    if (!plugin || !*plugin) { /* a spec: check it here so a typo is refused at once */
        reward_fn_t *f = NULL;
        if (reward_fn_parse(fn, &f) < 0) {
            snprintf(text, sizeof text, "reward function refused: %s", mo_last_error());
            ctl_reply(d, to, false, text, NULL, 0);
            return;
        }
        reward_fn_destroy(&f);
    }
    char *nf = ld_dup_str(fn), *np = ld_dup_str(plugin ? plugin : "");
    if (!nf || !np) {
        free(nf);
        free(np);
        ctl_reply(d, to, false, "out of memory", NULL, 0);
        return;
    }
    free(d->reward_function);
    free(d->reward_plugin);
    d->reward_function = nf;
    d->reward_plugin = np;
    d->reward_version++;
    d->last_swap_error[0] = '\0';
    metrics_set(d->m, d->k.reward_version, (double)d->reward_version);
    msg_t m;
    msg_init(&m);
    m.type = MSG_REWARD_SWAP;
    m.reward_swap.spec = (msg_reward_spec_t){d->reward_version, nf, *np ? np : NULL};
    int n = 0;
    for (int i = 0; i < d->n_peers; i++)
        if (d->peers[i].role == MSG_ROLE_REWARD &&
            ld_send_to(d, d->control, &d->peers[i].route, &m) == 1)
            n++;
    snprintf(text, sizeof text,
             "reward version %llu (%s) sent to %d reward worker(s); their heartbeats report it "
             "once installed",
             (unsigned long long)d->reward_version, nf, n);
    metrics_log(d->m, "%s", text);
    ctl_reply(d, to, true, text, NULL, 0);
}

static void on_ctl(ld_t *d, const msg_ctl_request_t *c, const zsock_peer_t *from) {
    switch (c->command) {
    case MSG_CTL_STATUS: reply_status(d, from); break;
    case MSG_CTL_SWAP_REWARD: swap_reward(d, &c->args, from); break;
    case MSG_CTL_CHECKPOINT: {
        tjob_t *j = calloc(1, sizeof *j);
        if (!j || d->finishing) {
            free(j);
            ctl_reply(d, from, false, "cannot checkpoint now", NULL, 0);
            break;
        }
        j->kind = J_CHECKPOINT;
        j->has_reply = true;
        j->reply_to = *from;
        j->data = cursor(d);
        if (submit_job(d, j) < 0)
            ctl_reply(d, from, false, "cannot checkpoint now: the trainer is stopping", NULL, 0);
        break; /* answered when saved */
    }
    case MSG_CTL_PAUSE:
        d->paused = true;
        metrics_set(d->m, d->k.paused, 1);
        metrics_log(d->m, "paused: no new leases or steps");
        ctl_reply(d, from, true, "paused", NULL, 0);
        break;
    case MSG_CTL_RESUME:
        d->paused = false;
        metrics_set(d->m, d->k.paused, 0);
        metrics_log(d->m, "resumed");
        ctl_reply(d, from, true, "resumed", NULL, 0);
        ld_serve_work(d);
        ld_maybe_step(d);
        break;
    case MSG_CTL_STOP:
        ctl_reply(d, from, true, d->training ? "stopping after the step in progress" : "stopping",
                  NULL, 0);
        begin_stop(d, "moerl ctl stop");
        break;
    default: ctl_reply(d, from, false, "unknown command", NULL, 0);
    }
}

static void on_control(void *sock, void *arg) {
    ld_t *d = arg;
    msg_t m;
    msg_type_t t;
    zsock_peer_t from;
    int rc = loop_recv_msg(sock, &from, &m, &t);
    if (rc == 0)
        return;
    char peer[MSG_MAX_ID + 1];
    loop_peer_name(&from, peer, sizeof peer);
    if (rc < 0) {
        if (rc == MO_EMALFORMED) {
            metrics_malformed(d->m, msg_type_name(t), peer, mo_last_error(), loop_now_ms(d->loop));
            if (from.len)
                ld_send_error(d, sock, &from, MO_EMALFORMED, mo_last_error(), msg_type_name(t),
                              false, 0);
        } else {
            metrics_log(d->m, "control socket: %s", mo_last_error());
        }
        return;
    }
    switch (m.type) {
    case MSG_HELLO: on_hello(d, &m.hello, &from); break;
    case MSG_HEARTBEAT: on_heartbeat(d, &m.heartbeat, &from); break;
    case MSG_SNAPSHOT_REQUEST: on_snapshot(d, &m.snapshot_request, &from); break;
    case MSG_CTL_REQUEST: on_ctl(d, &m.ctl_request, &from); break;
    case MSG_ERROR:
        if (m.error.about && !strcmp(m.error.about, "reward_swap")) {
            metrics_inc(d->m, d->k.swap_failures, 1);
            snprintf(d->last_swap_error, sizeof d->last_swap_error, "%s: %s", peer,
                     m.error.message);
        }
        metrics_log(d->m, "error from %s about %s: %s", peer, m.error.about ? m.error.about : "?",
                    m.error.message);
        break;
    default:
        metrics_malformed(d->m, msg_type_name(m.type), peer,
                          "unexpected message type on the control socket", loop_now_ms(d->loop));
        ld_send_error(d, sock, &from, MO_EUNSUPPORTED,
                      "unexpected message type on the control socket", msg_type_name(m.type), false,
                      0);
    }
    msg_free(&m);
}

/* ---- Work and trajectory sockets ---- */

static void on_work(void *sock, void *arg) {
    ld_t *d = arg;
    msg_t m;
    msg_type_t t;
    zsock_peer_t from;
    int rc = loop_recv_msg(sock, &from, &m, &t);
    if (rc == 0)
        return;
    char peer[MSG_MAX_ID + 1];
    loop_peer_name(&from, peer, sizeof peer);
    if (rc < 0) {
        if (rc == MO_EMALFORMED)
            metrics_malformed(d->m, msg_type_name(t != MSG_NONE ? t : MSG_WORK_REQUEST), peer,
                              mo_last_error(), loop_now_ms(d->loop));
        return;
    }
    if (m.type == MSG_WORK_REQUEST) {
        peer_t *p = ld_find_peer(d, m.work_request.worker_id);
        if (!p || p->role != MSG_ROLE_ROLLOUT) {
            ld_send_error(d, sock, &from, MO_ENOTFOUND, "unknown rollout worker: send hello first",
                          "work_request", false, 0);
        } else {
            p->credits = m.work_request.credits;
            p->work_route = from;
            p->has_work_route = true;
            p->last_seen_ms = loop_now_ms(d->loop);
            ld_serve_work(d);
        }
    } else if (m.type == MSG_ERROR && m.error.has_id && m.error.about &&
               !strcmp(m.error.about, "lease")) {
        group_t *g = ld_find_group(d, m.error.id);
        if (g && g->state == G_LEASED && g->lease && !strcmp(g->lease->worker, peer)) {
            char why[600];
            snprintf(why, sizeof why, "%s: %s", peer, m.error.message);
            ld_attempt_failed(d, g, why);
            ld_serve_work(d);
        }
    } else {
        metrics_malformed(d->m, msg_type_name(m.type), peer,
                          "unexpected message type on the work socket", loop_now_ms(d->loop));
    }
    msg_free(&m);
}

static void on_sink(void *sock, void *arg) {
    ld_t *d = arg;
    msg_t m;
    msg_type_t t;
    int rc = loop_recv_msg(sock, NULL, &m, &t);
    if (rc == MO_EMALFORMED) {
        metrics_inc(d->m, d->k.malformed, 1);
        metrics_malformed(d->m, "trajectory_group", "", mo_last_error(), loop_now_ms(d->loop));
    } else if (rc == 1 && m.type == MSG_TRAJECTORY_GROUP) {
        if (!d->finishing)
            ld_on_trajectory(d, &m.trajectory_group);
    } else if (rc == 1) {
        metrics_malformed(d->m, msg_type_name(m.type), "",
                          "unexpected message type on the trajectory sink", loop_now_ms(d->loop));
    }
    msg_free(&m);
}

/* ---- Liveness ---- */

static void on_tick(void *arg) {
    ld_t *d = arg;
    if (d->finishing)
        return;
    uint64_t now = loop_now_ms(d->loop);
    ld_reclaim(d, NULL, now);
    uint64_t dead_ms = (uint64_t)d->cfg->transport.heartbeat_ms * 7 / 2;
    for (int i = 0; i < d->n_peers;) {
        peer_t *p = &d->peers[i];
        if (now <= p->last_seen_ms + dead_ms) {
            i++;
            continue;
        }
        metrics_log(d->m,
                    "%s missed 3 heartbeats: presumed gone; its leased prompts are handed "
                    "out again",
                    p->id);
        metrics_inc(d->m, d->k.lost_workers, 1);
        ld_reclaim(d, p->id, now);
        d->peers[i] = d->peers[--d->n_peers];
    }
    ld_count_peers(d);
    loop_note_refused(d->m, d->refused_id, &d->zc, &d->refused_seen);
    check_sync(d);
    ld_serve_work(d);
    ld_maybe_step(d);
    metrics_set(d->m, d->k.pending, d->n_pending);
    metrics_set(d->m, d->k.leased, d->n_leased);
    metrics_set(d->m, d->k.waiting, d->n_waiting);
}

/* ---- Setup ---- */

static void register_metrics(ld_t *d) {
    metrics_t *m = d->m;
    ids_t *k = &d->k;
    k->up = metrics_gauge(m, "moerl_up", "1 while the daemon runs.");
    k->step = metrics_gauge(m, "moerl_learner_step", "Learner steps done.");
    k->steps = metrics_gauge(m, "moerl_learner_steps", "Steps of the run (learner.steps).");
    k->version = metrics_gauge(m, "moerl_learner_policy_version", "Policy (adapter) version.");
    k->reward_mean = metrics_gauge(m, "moerl_learner_reward_mean", "Mean reward of the step.");
    k->reward_std = metrics_gauge(m, "moerl_learner_reward_std", "Reward std of the step.");
    k->accuracy = metrics_gauge(m, "moerl_learner_accuracy",
                                "Fraction of samples with reward 1 when rewards are 0/1.");
    k->loss = metrics_gauge(m, "moerl_learner_loss", "Total loss of the step.");
    k->pg = metrics_gauge(m, "moerl_learner_policy_loss", "Policy-gradient loss.");
    k->kl = metrics_gauge(m, "moerl_learner_kl", "KL to the reference policy.");
    k->entropy = metrics_gauge(m, "moerl_learner_entropy", "Mean token entropy.");
    k->clip = metrics_gauge(m, "moerl_learner_clip_frac", "Fraction of clipped ratios.");
    k->clip_low = metrics_gauge(m, "moerl_learner_clip_frac_low", "Ratios clipped below.");
    k->clip_high = metrics_gauge(m, "moerl_learner_clip_frac_high", "Ratios clipped above.");
    k->grad_norm = metrics_gauge(m, "moerl_learner_grad_norm", "Gradient norm before clipping.");
    k->lr = metrics_gauge(m, "moerl_learner_lr", "Learning rate of the last update.");
    k->learner_tps = metrics_gauge(m, "moerl_learner_tokens_per_s", "Learner tokens per second.");
    k->rollout_tps = metrics_gauge(m, "moerl_rollout_tokens_per_s_total",
                                   "Sum of the rollout workers' reported tokens per second.");
    k->step_s = metrics_gauge(m, "moerl_learner_step_seconds", "Wall time of the step.");
    k->staleness = metrics_gauge(m, "moerl_learner_staleness", "Mean versions behind, trained.");
    k->staleness_max = metrics_gauge(m, "moerl_learner_staleness_max", "Most versions behind.");
    k->sync_ms = metrics_gauge(m, "moerl_learner_weight_sync_ms",
                               "Publish to applied on every rollout worker, last version.");
    k->agreement = metrics_gauge(m, "moerl_learner_routing_agreement",
                                 "Recorded vs learner routing agreement.");
    k->mismatch = metrics_gauge(m, "moerl_learner_mismatch_k3", "Rollout vs learner KL (k3).");
    k->groups_rx = metrics_counter(m, "moerl_learner_groups_received_total", "Groups accepted.");
    k->groups_trained = metrics_counter(m, "moerl_learner_groups_trained_total",
                                        "Groups passed to training steps.");
    k->duplicates = metrics_counter(m, "moerl_learner_duplicate_groups_total",
                                    "Groups received again after one was accepted (dropped).");
    k->stale_groups = metrics_counter(m, "moerl_learner_stale_groups_total",
                                      "Groups dropped: too many versions behind.");
    k->stale_samples = metrics_counter(m, "moerl_learner_stale_samples_total",
                                       "Samples the trainer dropped as stale.");
    k->unknown = metrics_counter(m, "moerl_learner_unknown_groups_total",
                                 "Groups this learner never leased (dropped).");
    k->failed = metrics_counter(m, "moerl_learner_failed_groups_total",
                                "Prompts given up after repeated generation or scoring failures.");
    k->malformed = metrics_counter(m, "moerl_learner_malformed_groups_total",
                                   "Trajectory groups refused as malformed.");
    k->leases = metrics_counter(m, "moerl_learner_leases_total", "Leases sent.");
    k->expired =
        metrics_counter(m, "moerl_learner_leases_expired_total", "Leases past their deadline.");
    k->reissued =
        metrics_counter(m, "moerl_learner_groups_reissued_total", "Prompts handed out again.");
    k->lost_workers = metrics_counter(m, "moerl_learner_workers_lost_total",
                                      "Workers presumed gone after 3 missed heartbeats.");
    k->checkpoints = metrics_counter(m, "moerl_learner_checkpoints_total", "Checkpoints saved.");
    k->samples_trained =
        metrics_counter(m, "moerl_learner_samples_trained_total", "Samples trained on.");
    k->rollouts = metrics_gauge(m, "moerl_learner_rollout_workers", "Registered rollout workers.");
    k->rewards = metrics_gauge(m, "moerl_learner_reward_workers", "Registered reward workers.");
    d->refused_id = metrics_counter(m, "moerl_transport_refused_clients_total",
                                    "CURVE clients refused by transport.curve_allowed_clients.");
    k->pending = metrics_gauge(m, "moerl_learner_pending_groups", "Prompts waiting for credits.");
    k->leased = metrics_gauge(m, "moerl_learner_leased_groups", "Prompts leased.");
    k->waiting = metrics_gauge(m, "moerl_learner_waiting_groups", "Groups waiting for a step.");
    k->paused = metrics_gauge(m, "moerl_learner_paused", "1 while paused.");
    k->reward_version = metrics_gauge(m, "moerl_learner_reward_version", "Reward version sent.");
    k->swap_failures = metrics_counter(m, "moerl_learner_reward_swap_failures_total",
                                       "Reward swaps a worker refused.");
    metrics_set(m, k->up, 1);
    metrics_set(m, k->steps, (double)d->cfg->learner.steps);
    for (int i = k->reward_mean; i <= k->mismatch; i++)
        metrics_set(m, i, NAN);
}

/* The tensor table and meta of the published adapter, and the chunk size. */
static int build_table(ld_t *d) {
    const lora_adapter_t *ad = NULL;
    TRY(ep_lead_whole(d->t, &ad)); /* expert parallelism: gathered from every rank */
    d->n_params = ad->n_params;
    d->n_table = (uint32_t)ad->n_tensors;
    d->table = calloc(d->n_table + 1, sizeof *d->table);
    if (!d->table)
        return mo_errorf(MO_ENOMEM, "out of memory");
    uint64_t est = 4096;
    for (uint32_t i = 0; i < d->n_table; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        d->table[i] = (msg_tensor_entry_t){.name = t->name,
                                           .dtype = DT_F32,
                                           .ndim = 2,
                                           .offset = (uint64_t)t->offset * sizeof(float)};
        d->table[i].shape[0] = t->shape[0];
        d->table[i].shape[1] = t->shape[1];
        est += strlen(t->name) + 64;
    }
    static const char *const keys[4] = {"rank", "alpha", "rslora", "format"};
    snprintf(d->meta_val[0], sizeof d->meta_val[0], "%d", ad->R);
    snprintf(d->meta_val[1], sizeof d->meta_val[1], "%.9g", (double)ad->alpha);
    snprintf(d->meta_val[2], sizeof d->meta_val[2], "%d", ad->rslora);
    snprintf(d->meta_val[3], sizeof d->meta_val[3], "moerl-lora-f32");
    for (int i = 0; i < 4; i++)
        d->meta[i] = (msg_kv_t){keys[i], d->meta_val[i]};
    int64_t room = d->cfg->transport.max_msg_bytes - (int64_t)est;
    if (room < 4096)
        return mo_errorf(MO_ECONFIG,
                         "transport.max_msg_bytes (%lld) leaves no room for adapter chunks "
                         "beside its %u-tensor table (about %llu bytes)",
                         (long long)d->cfg->transport.max_msg_bytes, d->n_table,
                         (unsigned long long)est);
    d->chunk_bytes = (uint64_t)room < CHUNK_MAX ? (uint64_t)room : CHUNK_MAX;
    float *flat = malloc(sizeof(float) * (d->n_params ? d->n_params : 1));
    if (!flat)
        return mo_errorf(MO_ENOMEM, "out of memory");
    memcpy(flat, ad->params, sizeof(float) * d->n_params);
    return publish(d, flat, (uint64_t)d->t->version, true);
}

static int resume(ld_t *d) {
    checkpoint_data_t data = {0, 0, 0};
    char name[64] = "";
    int fell_back = 0;
    int rc = ep_lead_resume(d->t, d->run_dir, d->o->allow_config_change, &data, name,
                                       sizeof name, &fell_back);
    if (rc == MO_ENOTFOUND) {
        metrics_log(d->m, "--resume: no checkpoint in %s/%s yet: starting from step 0", d->run_dir,
                    CKPT_DIR_NAME);
        return MO_OK;
    }
    if (rc < 0)
        return mo_error_wrap(rc, "--resume from %s", d->run_dir);
    if (data.fingerprint && data.fingerprint != dataset_fingerprint(d->ds) &&
        !d->o->allow_config_change)
        return mo_errorf(MO_ECONFIG,
                         "--resume: checkpoint %s was saved reading other prompts (data "
                         "fingerprint %016llx, now %016llx); pass --allow-config-change to go on",
                         name, (unsigned long long)data.fingerprint,
                         (unsigned long long)dataset_fingerprint(d->ds));
    dataset_cursor_t c = {data.epoch, data.pos};
    rc = dataset_seek(d->ds, c);
    if (rc < 0)
        return mo_error_wrap(rc, "--resume: prompt cursor of %s", name);
    metrics_log(d->m, "resumed from %s%s: step %lld, policy version %lld", name,
                fell_back ? " (latest was damaged: the newest loadable one)" : "",
                (long long)d->t->step, (long long)d->t->version);
    return MO_OK;
}

static int open_sockets(ld_t *d) {
    zsock_ctx_t *c = &d->zc;
    TRY(zsock_ctx_open(c, &d->cfg->transport, NULL, true));
    d->ctx = c->ctx;
    TRY(zsock_ctx_socket(c, ZS_LEARNER_CONTROL, 0, &d->control));
    TRY(zsock_ctx_socket(c, ZS_LEARNER_WORK, 0, &d->work));
    TRY(zsock_ctx_socket(c, ZS_LEARNER_SINK, 0, &d->sink));
    return zsock_ctx_socket(c, ZS_LEARNER_WEIGHTS, 0, &d->weights);
}

static int start_metrics(ld_t *d) {
    const moerl_config_t *c = d->cfg;
    if (c->metrics.jsonl) {
        char path[4200];
        snprintf(path, sizeof path, "%s/metrics/learner.jsonl", d->run_dir);
        TRY(metrics_jsonl_open(d->m, path));
    }
    int port = d->o->metrics_port < 0 ? c->metrics.http_port : d->o->metrics_port;
    if (port > 0)
        TRY(metrics_http_start(d->m, port, c->transport.allow_insecure_remote));
    return MO_OK;
}

static int load(ld_t *d) {
    const moerl_config_t *c = d->cfg;
    trainer_opts_t to = trainer_opts_default();
    to.init_adapter = d->o->init_adapter;
    to.comm = d->o->comm;
    to.device_comm = d->o->device_comm;
    int rc = trainer_new(&d->t, c, NULL, &to);
    if (rc < 0)
        return mo_error_wrap(rc, "trainer (model.path %s)", c->model.path);
    char where[320];
    actor_exec_describe(d->t->exec, where, sizeof where);
    metrics_log(d->m, "%s", where);
    const model_t *m = d->t->model;
    d->V = m->V;
    d->M = m->n_moe;
    d->K = m->K;
    d->E = m->E;
    TRY(dataset_open_config(c, &d->ds));
    if (d->o->resume)
        TRY(resume(d));
    d->step = d->ckpt_step = d->t->step;
    d->version = d->t->version;
    d->id_prefix = (uint64_t)d->step << 32;
    d->reward_version = d->t->reward_version > 1 ? (uint64_t)d->t->reward_version : 1;
    d->reward_function = ld_dup_str(c->reward.function);
    d->reward_plugin = ld_dup_str(c->reward.plugin);
    if (!d->reward_function || !d->reward_plugin)
        return mo_errorf(MO_ENOMEM, "out of memory");
    metrics_set(d->m, d->k.reward_version, (double)d->reward_version);
    metrics_set(d->m, d->k.step, (double)d->step);
    metrics_set(d->m, d->k.version, (double)d->version);
    return build_table(d);
}

static int setup(ld_t *d) {
    const moerl_config_t *c = d->cfg;
    TRY(config_run_dir(c, d->run_dir, sizeof d->run_dir));
    TRY(metrics_new(&d->m, "learner"));
    register_metrics(d);
    TRY(open_sockets(d)); /* first: a busy endpoint fails before the model loads */
    TRY(load(d));
    TRY(start_metrics(d));
    TRY(loop_new(&d->loop));
    TRY(loop_on_signals(d->loop, on_signal, d));
    TRY(loop_watch_socket(d->loop, d->control, on_control, d));
    TRY(loop_watch_socket(d->loop, d->work, on_work, d));
    TRY(loop_watch_socket(d->loop, d->sink, on_sink, d));
    loop_worker_opts_t wo = {t_body, on_result, NULL, tjob_free, tjob_free, d};
    TRY(loop_worker_start(d->loop, &wo, &d->w));
    TRY(loop_timer_start(d->loop, LEARNER_TICK_MS, LEARNER_TICK_MS, on_tick, d, NULL));
    return MO_OK;
}

static void teardown(ld_t *d) {
    loop_destroy(&d->loop); /* joins the worker: a step in progress finishes */
    zsock_ctx_close(&d->zc); /* every socket, the ZAP handler, the context */
    d->ctx = NULL;
    while (d->leases)
        ld_lease_unlink(d, d->leases);
    while (d->active) {
        group_t *g = d->active;
        d->active = g->next;
        ld_group_free(g);
    }
    for (int i = 0; i < d->n_waiting; i++)
        sample_group_destroy(&d->waiting[i]);
    free(d->waiting);
    free(d->peers);
    free(d->done);
    free(d->pub.flat);
    free(d->table);
    free(d->reward_function);
    free(d->reward_plugin);
    dataset_destroy(&d->ds);
    trainer_destroy(&d->t);
    metrics_destroy(&d->m);
}

static void notify_ready(ld_t *d) {
    const config_transport_t *t = &d->cfg->transport;
    metrics_log(d->m,
                "ready: control %s, work %s, trajectories %s, weights %s; step %lld/%lld, "
                "policy version %lld, pid %d",
                t->control, t->work, t->trajectories, t->weights, (long long)d->step,
                (long long)d->cfg->learner.steps, (long long)d->version, (int)getpid());
    if (d->o->ready_fd >= 0) {
        ssize_t n = write(d->o->ready_fd, "ready\n", 6);
        (void)n;
        close(d->o->ready_fd);
    }
}

int learner_daemon_run(const learner_daemon_opts_t *o) {
    ld_t *d = calloc(1, sizeof *d);
    if (!d)
        return mo_errorf(MO_ENOMEM, "out of memory");
    d->o = o;
    d->cfg = o->cfg;
    int rc = setup(d);
    if (rc == MO_OK && d->step >= d->cfg->learner.steps) {
        metrics_log(d->m, "nothing to do: step %lld of %lld already done", (long long)d->step,
                    (long long)d->cfg->learner.steps);
    } else if (rc == MO_OK) {
        notify_ready(d);
        rc = loop_run(d->loop);
    }
    if (rc == MO_OK && d->fail_rc < 0)
        rc = mo_errorf(d->fail_rc, "%s", d->fail_msg);
    if (d->m && d->loop) {
        metrics_set(d->m, d->k.up, 0);
        ld_count_peers(d);
        metrics_set(d->m, d->k.pending, d->n_pending);
        metrics_set(d->m, d->k.leased, d->n_leased);
        metrics_set(d->m, d->k.waiting, d->n_waiting);
        metrics_jsonl_write(d->m, "final");
        metrics_log(d->m,
                    "exiting at step %lld: %.0f groups received, %.0f trained, %.0f duplicate, "
                    "%.0f stale, %.0f failed, %.0f reissued",
                    (long long)d->step, metrics_value(d->m, d->k.groups_rx),
                    metrics_value(d->m, d->k.groups_trained), metrics_value(d->m, d->k.duplicates),
                    metrics_value(d->m, d->k.stale_groups), metrics_value(d->m, d->k.failed),
                    metrics_value(d->m, d->k.reissued));
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
