/* loop: libuv event loop with ZeroMQ sockets, signals, timers and a worker thread. */
#include "transport/loop.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>
#include <zmq.h>

#include "core/metrics.h"
#include "core/status.h"
#include "transport/zap.h"

/* ---- Item queues ---- */

typedef struct qnode {
    void *item;
    struct qnode *next;
} qnode_t;

typedef struct queue {
    qnode_t *head, *tail;
} queue_t;

static int q_push(queue_t *q, void *item) {
    qnode_t *n = malloc(sizeof *n);
    if (!n)
        return mo_errorf(MO_ENOMEM, "loop: out of memory queueing an item");
    n->item = item;
    n->next = NULL;
    if (q->tail)
        q->tail->next = n;
    else
        q->head = n;
    q->tail = n;
    return MO_OK;
}

static void *q_pop(queue_t *q) {
    qnode_t *n = q->head;
    if (!n)
        return NULL;
    q->head = n->next;
    if (!q->head)
        q->tail = NULL;
    void *item = n->item;
    free(n);
    return item;
}

static void q_clear(queue_t *q, void (*free_item)(void *)) {
    void *item;
    while (q->head) {
        item = q_pop(q);
        if (free_item)
            free_item(item);
    }
}

/* ---- The loop ---- */

typedef struct sock_watch {
    uv_poll_t poll; /* first: the handle's address is the watch's */
    void *sock;
    loop_sock_fn fn;
    void *arg;
    bool closing;
} sock_watch_t;

struct loop_timer {
    uv_timer_t timer;
    loop_timer_fn fn;
    void *arg;
};

typedef struct sig_watch {
    uv_signal_t sig;
    loop_signal_fn fn;
    void *arg;
} sig_watch_t;

struct loop_worker {
    uv_async_t *async; /* freed in its close callback */
    loop_t *loop;
    loop_worker_opts_t o;
    pthread_t thread;
    bool started, joined;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    queue_t in, out;
    bool stop;   /* under mu */
    bool exited; /* body returned; under mu */
    bool dead;   /* loop thread: on_exit ran */
    loop_worker_t *next;
};

struct loop {
    uv_loop_t uv;
    uv_prepare_t *prepare;
    uv_idle_t *idle; /* keeps polling non-blocking while sockets have a backlog */
    bool idle_on;
    sock_watch_t **socks; /* (n_socks) */
    int n_socks, cap_socks;
    bool draining; /* inside drain_all: watches are compacted afterwards */
    loop_worker_t *workers;
};

static void free_handle(uv_handle_t *h) {
    free(h);
}

/* Calls a socket's callback while messages wait, within the budget; 1 when the budget
 * ran out with more waiting. */
static int drain_one(sock_watch_t *w) {
    for (int n = 0; n < LOOP_SOCK_BUDGET; n++) {
        if (w->closing)
            return 0;
        int ev = 0;
        size_t len = sizeof ev;
        if (zmq_getsockopt(w->sock, ZMQ_EVENTS, &ev, &len) != 0 || !(ev & ZMQ_POLLIN))
            return 0;
        w->fn(w->sock, w->arg);
    }
    return 1;
}

static void compact_socks(loop_t *l) {
    int k = 0;
    for (int i = 0; i < l->n_socks; i++)
        if (!l->socks[i]->closing)
            l->socks[k++] = l->socks[i];
    l->n_socks = k;
}

static void set_idle(loop_t *l, bool on);

/* Passes over every socket until none has a message waiting (a send in one callback
 * can make another socket readable), or a backlog remains past the budget. */
static void drain_all(loop_t *l) {
    if (l->draining)
        return;
    l->draining = true;
    int backlog = 0;
    for (int pass = 0; pass < 8; pass++) {
        int any = 0;
        backlog = 0;
        for (int i = 0; i < l->n_socks; i++) {
            sock_watch_t *w = l->socks[i];
            if (w->closing)
                continue;
            int ev = 0;
            size_t len = sizeof ev;
            if (zmq_getsockopt(w->sock, ZMQ_EVENTS, &ev, &len) != 0 || !(ev & ZMQ_POLLIN))
                continue;
            any = 1;
            backlog |= drain_one(w);
        }
        if (!any)
            break;
        backlog = 1; /* something ran: check once more before blocking */
    }
    l->draining = false;
    compact_socks(l);
    set_idle(l, backlog != 0);
}

static void on_prepare(uv_prepare_t *h) {
    drain_all(h->data);
}

static void on_idle(uv_idle_t *h) {
    (void)h; /* its presence makes the poll phase non-blocking; prepare drains */
}

static void set_idle(loop_t *l, bool on) {
    if (on == l->idle_on || !l->idle || uv_is_closing((uv_handle_t *)l->idle))
        return;
    if (on)
        uv_idle_start(l->idle, on_idle);
    else
        uv_idle_stop(l->idle);
    l->idle_on = on;
}

static void on_poll(uv_poll_t *h, int status, int events) {
    (void)status;
    (void)events;
    sock_watch_t *w = (sock_watch_t *)h;
    loop_t *l = h->loop->data;
    if (!w->closing)
        drain_all(l);
}

int loop_new(loop_t **out) {
    *out = NULL;
    loop_t *l = calloc(1, sizeof *l);
    if (!l)
        return mo_errorf(MO_ENOMEM, "loop: out of memory");
    int rc = uv_loop_init(&l->uv);
    if (rc != 0) {
        free(l);
        return mo_errorf(MO_EIO, "uv_loop_init: %s", uv_strerror(rc));
    }
    l->uv.data = l;
    l->prepare = calloc(1, sizeof *l->prepare);
    l->idle = calloc(1, sizeof *l->idle);
    if (!l->prepare || !l->idle) {
        free(l->prepare);
        free(l->idle);
        uv_loop_close(&l->uv);
        free(l);
        return mo_errorf(MO_ENOMEM, "loop: out of memory");
    }
    uv_prepare_init(&l->uv, l->prepare);
    l->prepare->data = l;
    uv_prepare_start(l->prepare, on_prepare);
    uv_unref((uv_handle_t *)l->prepare);
    uv_idle_init(&l->uv, l->idle);
    l->idle->data = l;
    *out = l;
    return MO_OK;
}

int loop_run(loop_t *l) {
    int rc = uv_run(&l->uv, UV_RUN_DEFAULT);
    (void)rc; /* nonzero: uv_stop was called with handles still active */
    return MO_OK;
}

void loop_stop(loop_t *l) {
    uv_stop(&l->uv);
}

uint64_t loop_now_ms(const loop_t *l) {
    return uv_now(&l->uv);
}

double loop_clock_ms(void) {
    return (double)uv_hrtime() / 1e6;
}

/* ---- Sockets ---- */

int loop_watch_socket(loop_t *l, void *sock, loop_sock_fn fn, void *arg) {
    int fd = -1;
    size_t len = sizeof fd;
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &len) != 0)
        return mo_errorf(MO_EIO, "loop: ZMQ_FD: %s", zmq_strerror(zmq_errno()));
    if (l->n_socks == l->cap_socks) {
        int cap = l->cap_socks ? 2 * l->cap_socks : 8;
        sock_watch_t **s = realloc(l->socks, sizeof *s * (size_t)cap);
        if (!s)
            return mo_errorf(MO_ENOMEM, "loop: out of memory");
        l->socks = s;
        l->cap_socks = cap;
    }
    sock_watch_t *w = calloc(1, sizeof *w);
    if (!w)
        return mo_errorf(MO_ENOMEM, "loop: out of memory");
    w->sock = sock;
    w->fn = fn;
    w->arg = arg;
    int rc = uv_poll_init(&l->uv, &w->poll, fd);
    if (rc != 0) {
        free(w);
        return mo_errorf(MO_EIO, "loop: uv_poll_init: %s", uv_strerror(rc));
    }
    rc = uv_poll_start(&w->poll, UV_READABLE, on_poll);
    if (rc != 0) {
        uv_close((uv_handle_t *)&w->poll, free_handle);
        return mo_errorf(MO_EIO, "loop: uv_poll_start: %s", uv_strerror(rc));
    }
    l->socks[l->n_socks++] = w;
    set_idle(l, true); /* messages may already wait: drain before the first block */
    return MO_OK;
}

void loop_unwatch_socket(loop_t *l, void *sock) {
    for (int i = 0; i < l->n_socks; i++) {
        sock_watch_t *w = l->socks[i];
        if (w->sock != sock || w->closing)
            continue;
        w->closing = true;
        uv_poll_stop(&w->poll);
        uv_close((uv_handle_t *)&w->poll, free_handle);
    }
    if (!l->draining)
        compact_socks(l);
}

int loop_recv_msg(void *sock, zsock_peer_t *from, msg_t *out, msg_type_t *type) {
    msg_init(out);
    if (type)
        *type = MSG_NONE;
    zsock_msg_t zm;
    int rc = zsock_recv(sock, &zm, ZMQ_DONTWAIT);
    if (from)
        *from = zm.from;
    if (rc <= 0)
        return rc;
    const void *data = zsock_msg_data(&zm);
    size_t len = zsock_msg_size(&zm);
    msg_type_t t = MSG_NONE;
    if (msg_peek_type(data, len, &t) < 0)
        t = MSG_NONE;
    if (type)
        *type = t;
    rc = msg_decode(out, data, len, MSG_NONE);
    zsock_msg_close(&zm);
    return rc < 0 ? rc : 1;
}

void loop_peer_name(const zsock_peer_t *p, char *buf, size_t cap) {
    if (cap == 0)
        return;
    size_t n = p->len < cap - 1 ? p->len : cap - 1;
    for (size_t i = 0; i < n; i++) {
        char c = (char)p->id[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == ':' || c == '@' || c == '-';
        buf[i] = ok ? c : '?';
    }
    buf[n] = '\0';
}

void loop_hello(msg_t *m, msg_role_t role, const char *worker_id) {
    static char host[256];
    if (!host[0] && gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    msg_init(m);
    m->type = MSG_HELLO;
    m->hello.role = role;
    m->hello.worker_id = worker_id;
    m->hello.pid = (int64_t)getpid();
    m->hello.host = host;
    m->hello.software = "moerl " MOERL_VERSION;
}

void loop_learner_watch_init(loop_learner_watch_t *w, const config_transport_t *t) {
    memset(w, 0, sizeof *w);
    w->timeout_ms = t->learner_timeout_ms > 0 ? (uint64_t)t->learner_timeout_ms
                                              : 10u * (uint64_t)t->heartbeat_ms;
}

void loop_learner_heard(loop_learner_watch_t *w, uint64_t now_ms, bool welcome) {
    w->last_ms = now_ms;
    w->armed = w->armed || welcome;
}

int loop_learner_check(const loop_learner_watch_t *w, uint64_t now_ms, const char *endpoint) {
    if (!w->armed || now_ms <= w->last_ms + w->timeout_ms)
        return MO_OK;
    return mo_errorf(MO_ESTATE,
                     "the learner at %s is gone: no message from it for %llu ms (limit %llu ms, "
                     "transport.learner_timeout_ms); exiting",
                     endpoint, (unsigned long long)(now_ms - w->last_ms),
                     (unsigned long long)w->timeout_ms);
}

void loop_learner_heartbeat(msg_t *m, uint32_t inflight, uint32_t queue_depth) {
    msg_init(m);
    m->type = MSG_HEARTBEAT;
    m->heartbeat.worker_id = "learner";
    m->heartbeat.role = MSG_ROLE_LEARNER;
    m->heartbeat.inflight = inflight;
    m->heartbeat.queue_depth = queue_depth;
}

void loop_note_refused(struct metrics *m, int counter, const zsock_ctx_t *c, uint64_t *seen) {
    uint64_t n = zsock_ctx_refused(c);
    if (n <= *seen)
        return;
    zap_key_t key;
    zap_last_refused(c->zap, key);
    metrics_inc(m, counter, (double)(n - *seen));
    metrics_log(m,
                "refused %llu CURVE client(s) not on transport.curve_allowed_clients (%llu so "
                "far; last key %s)",
                (unsigned long long)(n - *seen), (unsigned long long)n, key);
    *seen = n;
}

/* ---- Signals ---- */

static void on_signal(uv_signal_t *h, int signum) {
    sig_watch_t *s = (sig_watch_t *)h;
    s->fn(signum, s->arg);
}

int loop_on_signals(loop_t *l, loop_signal_fn fn, void *arg) {
    static const int sigs[2] = {SIGTERM, SIGINT};
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < 2; i++) {
        sig_watch_t *s = calloc(1, sizeof *s);
        if (!s)
            return mo_errorf(MO_ENOMEM, "loop: out of memory");
        s->fn = fn;
        s->arg = arg;
        uv_signal_init(&l->uv, &s->sig);
        int rc = uv_signal_start(&s->sig, on_signal, sigs[i]);
        if (rc != 0) {
            uv_close((uv_handle_t *)&s->sig, free_handle);
            return mo_errorf(MO_EIO, "loop: uv_signal_start: %s", uv_strerror(rc));
        }
        uv_unref((uv_handle_t *)&s->sig);
    }
    return MO_OK;
}

/* ---- Timers ---- */

static void on_timer(uv_timer_t *h) {
    loop_timer_t *t = (loop_timer_t *)h;
    t->fn(t->arg);
}

int loop_timer_start(loop_t *l, uint64_t first_ms, uint64_t repeat_ms, loop_timer_fn fn, void *arg,
                     loop_timer_t **out) {
    if (out)
        *out = NULL;
    loop_timer_t *t = calloc(1, sizeof *t);
    if (!t)
        return mo_errorf(MO_ENOMEM, "loop: out of memory");
    t->fn = fn;
    t->arg = arg;
    uv_timer_init(&l->uv, &t->timer);
    int rc = uv_timer_start(&t->timer, on_timer, first_ms, repeat_ms);
    if (rc != 0) {
        uv_close((uv_handle_t *)&t->timer, free_handle);
        return mo_errorf(MO_EIO, "loop: uv_timer_start: %s", uv_strerror(rc));
    }
    if (out)
        *out = t;
    return MO_OK;
}

void loop_timer_close(loop_timer_t **pt) {
    loop_timer_t *t = pt ? *pt : NULL;
    if (!t)
        return;
    *pt = NULL;
    if (uv_is_closing((uv_handle_t *)&t->timer))
        return;
    uv_timer_stop(&t->timer);
    uv_close((uv_handle_t *)&t->timer, free_handle);
}

/* ---- Worker ---- */

static void *worker_main(void *p) {
    loop_worker_t *w = p;
    w->o.body(w, w->o.arg);
    pthread_mutex_lock(&w->mu);
    w->exited = true;
    pthread_mutex_unlock(&w->mu);
    uv_async_send(w->async);
    return NULL;
}

static void join_worker(loop_worker_t *w) {
    if (w->started && !w->joined) {
        pthread_join(w->thread, NULL);
        w->joined = true;
    }
}

/* Delivers every queued result; then, once the body has returned, on_exit. */
static void on_async(uv_async_t *h) {
    loop_worker_t *w = h->data;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        void *item = q_pop(&w->out);
        bool exited = w->exited && !w->out.head;
        pthread_mutex_unlock(&w->mu);
        if (item) {
            w->o.on_result(item, w->o.arg);
            continue;
        }
        if (exited && !w->dead) {
            w->dead = true;
            join_worker(w);
            if (w->o.on_exit)
                w->o.on_exit(w->o.arg);
        }
        return;
    }
}

int loop_worker_start(loop_t *l, const loop_worker_opts_t *o, loop_worker_t **out) {
    *out = NULL;
    if (!o->body || !o->on_result)
        return mo_errorf(MO_EINVAL, "loop_worker_start: body and on_result are required");
    loop_worker_t *w = calloc(1, sizeof *w);
    uv_async_t *a = calloc(1, sizeof *a);
    if (!w || !a) {
        free(w);
        free(a);
        return mo_errorf(MO_ENOMEM, "loop: out of memory");
    }
    w->loop = l;
    w->o = *o;
    w->async = a;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    uv_async_init(&l->uv, a, on_async);
    a->data = w;
    w->next = l->workers;
    l->workers = w;
    int rc = pthread_create(&w->thread, NULL, worker_main, w);
    if (rc != 0) {
        w->dead = true;
        return mo_errorf(MO_EIO, "loop: cannot start the worker thread: %s", strerror(rc));
    }
    w->started = true;
    *out = w;
    return MO_OK;
}

int loop_worker_submit(loop_worker_t *w, void *item) {
    pthread_mutex_lock(&w->mu);
    int rc = w->stop ? mo_errorf(MO_ESTATE, "loop: the worker is stopping") : q_push(&w->in, item);
    if (rc == MO_OK)
        pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void loop_worker_stop(loop_worker_t *w) {
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

bool loop_worker_alive(const loop_worker_t *w) {
    return !w->dead;
}

static void deadline_after(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

int loop_worker_next(loop_worker_t *w, void **item, int timeout_ms) {
    *item = NULL;
    struct timespec until;
    if (timeout_ms > 0)
        deadline_after(&until, timeout_ms);
    pthread_mutex_lock(&w->mu);
    int rc = 0;
    for (;;) {
        if (w->stop) {
            rc = MO_ESTATE;
            break;
        }
        if (w->in.head) {
            *item = q_pop(&w->in);
            rc = 1;
            break;
        }
        if (timeout_ms == 0)
            break;
        if (timeout_ms < 0) {
            pthread_cond_wait(&w->cv, &w->mu);
        } else if (pthread_cond_timedwait(&w->cv, &w->mu, &until) != 0) {
            if (w->in.head || w->stop)
                continue;
            break;
        }
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

bool loop_worker_stopping(loop_worker_t *w) {
    pthread_mutex_lock(&w->mu);
    bool s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

int loop_worker_post(loop_worker_t *w, void *item) {
    pthread_mutex_lock(&w->mu);
    int rc = q_push(&w->out, item);
    pthread_mutex_unlock(&w->mu);
    if (rc == MO_OK)
        uv_async_send(w->async);
    return rc;
}

static void worker_free(loop_worker_t *w) {
    loop_worker_stop(w);
    join_worker(w);
    q_clear(&w->in, w->o.free_input);
    q_clear(&w->out, w->o.free_result);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

/* ---- Teardown ---- */

static void close_any(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, free_handle);
}

void loop_destroy(loop_t **pl) {
    loop_t *l = pl ? *pl : NULL;
    if (!l)
        return;
    *pl = NULL;
    for (loop_worker_t *w = l->workers; w; w = w->next) {
        loop_worker_stop(w);
        join_worker(w);
    }
    /* Every handle was allocated on its own (the watch, timer and signal structs start
     * with theirs), so closing with free_handle frees each. */
    for (int i = 0; i < l->n_socks; i++)
        l->socks[i]->closing = true;
    uv_walk(&l->uv, close_any, NULL);
    uv_run(&l->uv, UV_RUN_DEFAULT);
    while (l->workers) {
        loop_worker_t *w = l->workers;
        l->workers = w->next;
        worker_free(w);
    }
    uv_loop_close(&l->uv);
    free(l->socks);
    free(l);
}
