/* daemon_work: the learner daemon's workers, prompt stream, leases (credits, deadlines,
 * reissue) and the scored groups coming back (duplicates, routing, checks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "core/status.h"
#include "learner/daemon_internal.h"
#include "transport/codec.h"

char *ld_dup_str(const char *s) {
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

/* ---- Sending ---- */

int ld_send_to(ld_t *d, void *sock, const zsock_peer_t *to, const msg_t *m) {
    int rc = zsock_send_msg(sock, to, m, ZMQ_DONTWAIT);
    if (rc < 0 && rc != MO_ENOTFOUND)
        metrics_log(d->m, "send %s: %s", msg_type_name(m->type), mo_last_error());
    return rc;
}

void ld_send_error(ld_t *d, void *sock, const zsock_peer_t *to, int code, const char *message,
                   const char *about, bool has_id, uint64_t id) {
    char buf[1024];
    size_t n = strlen(message), full = n;
    if (n >= sizeof buf)
        n = sizeof buf - 1;
    while (n > 0 && n < full && ((unsigned char)message[n] & 0xC0) == 0x80)
        n--;
    memcpy(buf, message, n);
    buf[n] = '\0';
    msg_t m;
    msg_init(&m);
    m.type = MSG_ERROR;
    m.error = (msg_error_t){code < -1000 || code > -1 ? MO_EINVAL : code, n ? buf : "failed", about,
                            has_id, id};
    ld_send_to(d, sock, to, &m);
}

/* ---- Peers ---- */

peer_t *ld_find_peer(ld_t *d, const char *id) {
    for (int i = 0; i < d->n_peers; i++)
        if (!strcmp(d->peers[i].id, id))
            return &d->peers[i];
    return NULL;
}

peer_t *ld_add_peer(ld_t *d, const char *id, msg_role_t role) {
    peer_t *p = ld_find_peer(d, id);
    if (p)
        return p;
    if (d->n_peers == d->cap_peers) {
        int cap = d->cap_peers ? 2 * d->cap_peers : 16;
        peer_t *np = realloc(d->peers, sizeof *np * (size_t)cap);
        if (!np)
            return NULL;
        d->peers = np;
        d->cap_peers = cap;
    }
    p = &d->peers[d->n_peers++];
    memset(p, 0, sizeof *p);
    snprintf(p->id, sizeof p->id, "%s", id);
    p->role = role;
    return p;
}

void ld_count_peers(ld_t *d) {
    int r = 0, w = 0;
    double tps = 0;
    for (int i = 0; i < d->n_peers; i++) {
        if (d->peers[i].role == MSG_ROLE_ROLLOUT) {
            r++;
            tps += d->peers[i].tps;
        } else {
            w++;
        }
    }
    metrics_set(d->m, d->k.rollouts, r);
    metrics_set(d->m, d->k.rewards, w);
    metrics_set(d->m, d->k.rollout_tps, tps);
}

/* ---- Groups and leases ---- */

void ld_group_free(group_t *g) {
    free(g->prompt);
    free(g->answer);
    for (uint32_t i = 0; i < g->n_extra; i++) {
        free((char *)g->extra[i].key);
        free((char *)g->extra[i].value);
    }
    free(g->extra);
    free(g);
}

static void q_push(ld_t *d, group_t *g, bool front) {
    g->state = G_PENDING;
    g->lease = NULL;
    g->qnext = NULL;
    if (front) {
        g->qnext = d->q_head;
        d->q_head = g;
        if (!d->q_tail)
            d->q_tail = g;
    } else {
        if (d->q_tail)
            d->q_tail->qnext = g;
        else
            d->q_head = g;
        d->q_tail = g;
    }
    d->n_pending++;
}

static group_t *q_pop(ld_t *d) {
    group_t *g = d->q_head;
    if (!g)
        return NULL;
    d->q_head = g->qnext;
    if (!d->q_head)
        d->q_tail = NULL;
    d->n_pending--;
    return g;
}

static void q_remove(ld_t *d, group_t *g) {
    group_t *prev = NULL;
    for (group_t *x = d->q_head; x; prev = x, x = x->qnext) {
        if (x != g)
            continue;
        if (prev)
            prev->qnext = x->qnext;
        else
            d->q_head = x->qnext;
        if (d->q_tail == x)
            d->q_tail = prev;
        d->n_pending--;
        return;
    }
}

static bool is_done(const ld_t *d, uint64_t seq) {
    return seq / 8 < d->done_bytes && (d->done[seq / 8] >> (seq % 8)) & 1;
}

static void mark_done(ld_t *d, uint64_t seq) {
    if (seq / 8 >= d->done_bytes) {
        size_t n = d->done_bytes ? d->done_bytes : 64;
        while (seq / 8 >= n)
            n *= 2;
        uint8_t *b = realloc(d->done, n);
        if (!b)
            return;
        memset(b + d->done_bytes, 0, n - d->done_bytes);
        d->done = b;
        d->done_bytes = n;
    }
    d->done[seq / 8] |= (uint8_t)(1u << (seq % 8));
}

group_t *ld_find_group(ld_t *d, uint64_t id) {
    for (group_t *g = d->active; g; g = g->next)
        if (g->id == id)
            return g;
    return NULL;
}

void ld_lease_unlink(ld_t *d, lease_t *l) {
    for (lease_t **pp = &d->leases; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    free(l->groups);
    free(l);
}

/* Detaches g from its lease (if any); the lease goes when it has nothing left. */
static void leave_lease(ld_t *d, group_t *g) {
    lease_t *l = g->lease;
    if (g->state != G_LEASED || !l)
        return;
    for (uint32_t i = 0; i < l->n; i++)
        if (l->groups[i] == g)
            l->groups[i] = NULL;
    g->lease = NULL;
    d->n_leased--;
    if (--l->remaining == 0)
        ld_lease_unlink(d, l);
}

/* g is finished (received, or given up): out of the active set and marked done. */
static void retire(ld_t *d, group_t *g) {
    if (g->state == G_LEASED)
        leave_lease(d, g);
    else
        q_remove(d, g);
    if (g->prev)
        g->prev->next = g->next;
    else
        d->active = g->next;
    if (g->next)
        g->next->prev = g->prev;
    mark_done(d, g->id - d->id_prefix);
    ld_group_free(g);
}

/* Puts a leased prompt first in line again (a pending one already waits). */
static void reissue(ld_t *d, group_t *g) {
    if (g->state == G_PENDING)
        return;
    leave_lease(d, g);
    q_push(d, g, true);
    metrics_inc(d->m, d->k.reissued, 1);
}

/* A worker reported that g could not be generated or scored. */
void ld_attempt_failed(ld_t *d, group_t *g, const char *why) {
    if (++g->attempts >= MAX_ATTEMPTS) {
        metrics_log(d->m, "group %llu (prompt %s) failed %d times, dropped: %s",
                    (unsigned long long)g->id, g->prompt_id, g->attempts, why);
        metrics_inc(d->m, d->k.failed, 1);
        retire(d, g);
    } else {
        reissue(d, g);
    }
}

/* Hands out again every prompt still in lease l (which is then freed). */
static void reclaim_lease(ld_t *d, lease_t *l) {
    for (;;) {
        group_t *g = NULL;
        for (uint32_t i = 0; i < l->n && !g; i++)
            g = l->groups[i];
        bool last = l->remaining <= 1;
        if (g)
            reissue(d, g); /* the last one frees l */
        if (!g || last)
            return;
    }
}

/* Reclaims the leases of worker, or (worker NULL) those past their deadline. */
void ld_reclaim(ld_t *d, const char *worker, uint64_t now) {
    lease_t *next;
    for (lease_t *l = d->leases; l; l = next) {
        next = l->next;
        if (worker ? strcmp(l->worker, worker) != 0 : now < l->deadline_ms)
            continue;
        if (!worker) {
            metrics_inc(d->m, d->k.expired, 1);
            metrics_log(d->m, "lease %llu of %s passed its deadline: %u prompt(s) handed out again",
                        (unsigned long long)l->id, l->worker, l->remaining);
        }
        reclaim_lease(d, l);
    }
}

/* A fresh prompt from the stream. */
static group_t *new_group(ld_t *d) {
    dataset_item_t it;
    if (dataset_next(d->ds, &it) < 0) {
        metrics_log(d->m, "prompt stream: %s", mo_last_error());
        return NULL;
    }
    group_t *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->id = d->id_prefix + d->next_seq++;
    snprintf(g->prompt_id, sizeof g->prompt_id, "%llu", (unsigned long long)it.id);
    g->prompt = ld_dup_str(it.prompt);
    g->answer = ld_dup_str(it.answer);
    g->n_extra = (uint32_t)(it.n_extra < MSG_MAX_MAP ? it.n_extra : MSG_MAX_MAP);
    g->extra = calloc(g->n_extra + 1, sizeof *g->extra);
    bool ok = g->prompt && g->answer && g->extra;
    for (uint32_t i = 0; ok && i < g->n_extra; i++) {
        g->extra[i].key = ld_dup_str(it.extra[i].key);
        g->extra[i].value = ld_dup_str(it.extra[i].value);
        ok = g->extra[i].key && g->extra[i].value;
    }
    if (!ok) {
        ld_group_free(g);
        return NULL;
    }
    g->next = d->active;
    if (d->active)
        d->active->prev = g;
    d->active = g;
    return g;
}

/* Sends one lease of up to `credits` pending prompts to a rollout worker. */
static void send_lease(ld_t *d, peer_t *p, uint32_t k) {
    lease_t *l = calloc(1, sizeof *l);
    msg_lease_item_t *items = calloc(k, sizeof *items);
    if (l)
        l->groups = calloc(k, sizeof *l->groups);
    if (!l || !items || !l->groups) {
        if (l)
            free(l->groups);
        free(l);
        free(items);
        return;
    }
    l->id = ++d->next_lease;
    snprintf(l->worker, sizeof l->worker, "%s", p->id);
    l->deadline_ms = loop_now_ms(d->loop) + (uint64_t)d->cfg->transport.lease_timeout_ms;
    for (uint32_t i = 0; i < k; i++) {
        group_t *g = q_pop(d);
        l->groups[l->n++] = g;
        items[i] = (msg_lease_item_t){.group_id = g->id,
                                      .prompt_id = g->prompt_id,
                                      .prompt = g->prompt,
                                      .answer = g->answer,
                                      .extra = {g->extra, g->n_extra},
                                      .n = (uint32_t)d->cfg->rollout.group_size};
    }
    msg_t m;
    msg_init(&m);
    m.type = MSG_LEASE;
    m.lease = (msg_lease_t){l->id, (uint32_t)d->cfg->transport.lease_timeout_ms,
                            (uint64_t)d->version, items, k};
    int rc = ld_send_to(d, d->work, &p->work_route, &m);
    free(items);
    if (rc != 1) { /* gone or full: the prompts go back to the front */
        for (uint32_t i = k; i-- > 0;)
            q_push(d, l->groups[i], true);
        free(l->groups);
        free(l);
        p->credits = 0;
        return;
    }
    for (uint32_t i = 0; i < k; i++) {
        l->groups[i]->state = G_LEASED;
        l->groups[i]->lease = l;
    }
    l->remaining = k;
    d->n_leased += (int)k;
    l->next = d->leases;
    d->leases = l;
    p->credits -= k;
    metrics_inc(d->m, d->k.leases, 1);
}

/* Tops up the pending prompts to the window and leases them against credits. */
void ld_serve_work(ld_t *d) {
    if (d->paused || d->stopping || d->finishing)
        return;
    const moerl_config_t *c = d->cfg;
    int64_t pps = c->rollout.prompts_per_step;
    int64_t window = pps * (1 + c->learner.max_staleness);
    int64_t need = (c->learner.steps - d->step) * pps;
    int64_t limit = window < need ? window : need;
    int64_t have = d->n_pending + d->n_leased + d->n_waiting + d->n_training;
    while (have < limit) {
        group_t *g = new_group(d);
        if (!g)
            break;
        q_push(d, g, false);
        have++;
    }
    /* Rounds over the workers with credits, each taking a fair share of what waits. */
    while (d->q_head) {
        int askers = 0;
        for (int i = 0; i < d->n_peers; i++)
            askers += d->peers[i].role == MSG_ROLE_ROLLOUT && d->peers[i].has_work_route &&
                      d->peers[i].credits > 0;
        if (askers == 0)
            break;
        uint32_t share = (uint32_t)((d->n_pending + askers - 1) / askers);
        for (int i = 0; i < d->n_peers && d->q_head; i++) {
            peer_t *p = &d->peers[(d->rr + i) % d->n_peers];
            if (p->role != MSG_ROLE_ROLLOUT || !p->has_work_route || p->credits == 0)
                continue;
            uint32_t k = p->credits < share ? p->credits : share;
            if (k > (uint32_t)d->n_pending)
                k = (uint32_t)d->n_pending;
            send_lease(d, p, k < MSG_MAX_ITEMS ? k : MSG_MAX_ITEMS);
        }
        d->rr = (d->rr + 1) % d->n_peers;
    }
    metrics_set(d->m, d->k.pending, d->n_pending);
    metrics_set(d->m, d->k.leased, d->n_leased);
}

/* ---- Scored groups ---- */

/* Routing layout of a wire sample against P: 2 when R = P + T - 1 (prompt rows first),
 * 1 when R = T, 0 when it carries none or another layout. */
static int wire_layout(const msg_sample_t *x, uint32_t P, int M, int K) {
    if (!x->routing || x->n_tokens < 1 || (int)x->routing_layers != M || (int)x->routing_k != K)
        return 0;
    if (x->routing_rows == P + x->n_tokens - 1)
        return 2;
    return x->routing_rows == x->n_tokens ? 1 : 0;
}

/* Copies sample x's routing into row (T, M, K): row i holds the experts of the step that
 * read token i, which is wire row base + i + 1 (base P - 1 with prompt rows, 0 without)
 * for i < T - 1, and routing_last for the last token. A sender without routing_last
 * leaves the last token's read off the wire: its row then repeats the one before. */
static void copy_routing(uint16_t *dst, const msg_sample_t *x, uint32_t P, int layout, size_t row) {
    uint32_t T = x->n_tokens, base = layout == 2 ? P - 1 : 0;
    for (uint32_t i = 0; i < T; i++) {
        const uint16_t *src = i == T - 1 && x->routing_last
                                  ? x->routing_last
                                  : x->routing + (size_t)(base + (i + 1 < T - 1 ? i + 1 : T - 1)) * row;
        memcpy(dst + (size_t)i * row, src, sizeof *dst * row);
    }
}

/* A received trajectory_group as the trainer's sample group, checked against the
 * model. MO_EMALFORMED naming the group and field. */
static int to_sample_group(ld_t *d, const msg_trajectory_group_t *tg, sample_group_t **out) {
    *out = NULL;
    int G = (int)tg->n_samples;
    uint32_t P = tg->n_prompt_tokens;
    int *lens = malloc(sizeof *lens * (size_t)G);
    if (!lens)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int routed = d->M > 0, prompt_rows = d->M > 0;
    for (int s = 0; s < G; s++) {
        const msg_sample_t *x = &tg->samples[s];
        lens[s] = (int)x->n_tokens;
        int layout = wire_layout(x, P, d->M, d->K);
        routed &= layout != 0;
        prompt_rows &= layout == 2;
        if (x->n_tokens == 0) {
            free(lens);
            return mo_errorf(MO_EMALFORMED,
                             "trajectory_group %llu: sample %d has no tokens (nothing to train)",
                             (unsigned long long)tg->group_id, s);
        }
    }
    sample_group_t *sg = NULL;
    int rc = sample_group_alloc(&sg, tg->group_id, (int)P, lens, G, routed ? d->M : 0,
                                routed ? d->K : 0, routed && prompt_rows, routed);
    free(lens);
    TRY(rc);
    memcpy(sg->prompt, tg->prompt_tokens, sizeof *sg->prompt * P);
    size_t row = (size_t)d->M * (size_t)d->K;
    for (int s = 0; s < G; s++) {
        const msg_sample_t *x = &tg->samples[s];
        sample_t *y = &sg->samples[s];
        memcpy(y->tokens, x->tokens, sizeof *y->tokens * x->n_tokens);
        memcpy(y->logprobs, x->logprobs, sizeof *y->logprobs * x->n_tokens);
        y->finish = x->finish == MSG_FINISH_STOP ? SAMPLE_FINISH_STOP_TOKEN : SAMPLE_FINISH_LENGTH;
        y->version_first = (int64_t)x->adapter_version_first;
        y->version_last = (int64_t)x->adapter_version_last;
        y->reward = tg->rewards[s];
        y->reward_version = (int64_t)tg->reward_version;
        if (routed)
            copy_routing(y->routing, x, P, wire_layout(x, P, d->M, d->K), row);
    }
    if (routed && prompt_rows)
        memcpy(sg->prompt_routing, tg->samples[0].routing, sizeof(uint16_t) * row * P);
    rc = sample_group_check(sg, d->V, d->M, d->K, d->E);
    if (rc < 0) {
        sample_group_destroy(&sg);
        return rc;
    }
    *out = sg;
    return MO_OK;
}

/* 1 when no sample of g may be trained at the current version. */
int ld_group_stale(const ld_t *d, const sample_group_t *g) {
    for (int s = 0; s < g->n_samples; s++) {
        int64_t v = g->samples[s].version_first;
        if (v <= d->version && d->version - v <= d->cfg->learner.max_staleness)
            return 0;
    }
    return 1;
}

static int keep_waiting(ld_t *d, sample_group_t *sg) {
    if (d->n_waiting == d->cap_waiting) {
        int cap = d->cap_waiting ? 2 * d->cap_waiting : 64;
        sample_group_t **w = realloc(d->waiting, sizeof *w * (size_t)cap);
        if (!w)
            return mo_errorf(MO_ENOMEM, "out of memory");
        d->waiting = w;
        d->cap_waiting = cap;
    }
    d->waiting[d->n_waiting++] = sg;
    return MO_OK;
}

void ld_on_trajectory(ld_t *d, const msg_trajectory_group_t *tg) {
    uint64_t seq = tg->group_id - d->id_prefix;
    bool ours = tg->group_id >= d->id_prefix && seq < d->next_seq;
    if (ours && is_done(d, seq)) {
        metrics_inc(d->m, d->k.duplicates, 1);
        return;
    }
    group_t *g = ours ? ld_find_group(d, tg->group_id) : NULL;
    if (!g) {
        metrics_inc(d->m, d->k.unknown, 1);
        double n = metrics_value(d->m, d->k.unknown);
        if (n <= 5 || fmod(n, 100) == 0)
            metrics_log(d->m,
                        "group %llu from %s was never leased by this learner: dropped "
                        "(%.0f so far)",
                        (unsigned long long)tg->group_id, tg->worker_id, n);
        return;
    }
    if (!tg->rewards) {
        ld_attempt_failed(d, g, "sent without rewards (scoring failed)");
        return;
    }
    sample_group_t *sg = NULL;
    if (to_sample_group(d, tg, &sg) < 0) {
        metrics_inc(d->m, d->k.malformed, 1);
        metrics_malformed(d->m, "trajectory_group", tg->worker_id, mo_last_error(),
                          loop_now_ms(d->loop));
        ld_attempt_failed(d, g, mo_last_error());
        return;
    }
    retire(d, g);
    metrics_inc(d->m, d->k.groups_rx, 1);
    if (keep_waiting(d, sg) < 0) {
        sample_group_destroy(&sg);
        return;
    }
    metrics_set(d->m, d->k.waiting, d->n_waiting);
    ld_maybe_step(d);
    ld_serve_work(d);
}
