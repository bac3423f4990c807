/* Tests for the daemon event loop: ZeroMQ sockets drained past the per-pass budget,
 * request/reply ping-pong on one loop (the edge-triggered descriptor after sends),
 * repeating and one-shot timers, SIGTERM delivered to the callback, the worker thread
 * (results in order, coalesced wake-ups, on_exit, stop), and teardown freeing what is
 * left in the queues (checked by ASan's leak detector). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/loop.h"

#define WATCHDOG_MS 30000 /* only reached when something is broken: fail, do not hang */

static void on_watchdog(void *arg) {
    tu_report("watchdog fired");
    loop_stop(arg);
}

/* ---- Sockets ---- */

typedef struct sock_state {
    loop_t *l;
    void *a, *b;
    int want, got, order_ok;
    int pongs;
} sock_state_t;

static void on_pull(void *sock, void *arg) {
    sock_state_t *s = arg;
    int v = -1;
    int n = zmq_recv(sock, &v, sizeof v, ZMQ_DONTWAIT);
    if (n != (int)sizeof v)
        return;
    if (v != s->got)
        s->order_ok = 0;
    if (++s->got == s->want)
        loop_stop(s->l);
}

/* Messages queued before the loop runs, more than one pass's budget. */
static void test_socket_backlog(void) {
    void *ctx = zmq_ctx_new();
    void *push = zmq_socket(ctx, ZMQ_PUSH), *pull = zmq_socket(ctx, ZMQ_PULL);
    CU_ASSERT_EQUAL_FATAL(zmq_bind(pull, "inproc://backlog"), 0);
    CU_ASSERT_EQUAL_FATAL(zmq_connect(push, "inproc://backlog"), 0);
    sock_state_t s = {0};
    s.want = 5 * LOOP_SOCK_BUDGET + 3;
    s.order_ok = 1;
    for (int i = 0; i < s.want; i++)
        CU_ASSERT_EQUAL(zmq_send(push, &i, sizeof i, 0), (int)sizeof i);
    CU_ASSERT_EQUAL_FATAL(loop_new(&s.l), 0);
    CU_ASSERT_EQUAL(loop_watch_socket(s.l, pull, on_pull, &s), 0);
    CU_ASSERT_EQUAL(loop_timer_start(s.l, WATCHDOG_MS, 0, on_watchdog, s.l, NULL), 0);
    CU_ASSERT_EQUAL(loop_run(s.l), 0);
    CU_ASSERT_EQUAL(s.got, s.want);
    CU_ASSERT(s.order_ok);
    loop_destroy(&s.l);
    CU_ASSERT_PTR_NULL(s.l);
    zmq_close(push);
    zmq_close(pull);
    zmq_ctx_term(ctx);
}

/* ROUTER answers every request of a DEALER on the same loop; the DEALER sends the next
 * request from its callback: every wake-up depends on the re-check after sends. */
static void on_router(void *sock, void *arg) {
    (void)arg;
    char id[256], body[16];
    int n = zmq_recv(sock, id, sizeof id, ZMQ_DONTWAIT);
    if (n < 0)
        return;
    int b = zmq_recv(sock, body, sizeof body, 0);
    if (b < 0)
        return;
    zmq_send(sock, id, (size_t)n, ZMQ_SNDMORE);
    zmq_send(sock, body, (size_t)b, 0);
}

static void on_dealer(void *sock, void *arg) {
    sock_state_t *s = arg;
    int v = -1;
    if (zmq_recv(sock, &v, sizeof v, ZMQ_DONTWAIT) != (int)sizeof v)
        return;
    if (v != s->pongs)
        s->order_ok = 0;
    if (++s->pongs == s->want) {
        loop_stop(s->l);
        return;
    }
    zmq_send(sock, &s->pongs, sizeof s->pongs, 0);
}

static void test_socket_ping_pong(void) {
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER), *dealer = zmq_socket(ctx, ZMQ_DEALER);
    CU_ASSERT_EQUAL_FATAL(zmq_bind(router, "inproc://pingpong"), 0);
    CU_ASSERT_EQUAL_FATAL(zmq_connect(dealer, "inproc://pingpong"), 0);
    sock_state_t s = {0};
    s.want = 2000;
    s.order_ok = 1;
    CU_ASSERT_EQUAL_FATAL(loop_new(&s.l), 0);
    CU_ASSERT_EQUAL(loop_watch_socket(s.l, router, on_router, &s), 0);
    CU_ASSERT_EQUAL(loop_watch_socket(s.l, dealer, on_dealer, &s), 0);
    CU_ASSERT_EQUAL(loop_timer_start(s.l, WATCHDOG_MS, 0, on_watchdog, s.l, NULL), 0);
    int zero = 0;
    zmq_send(dealer, &zero, sizeof zero, 0);
    CU_ASSERT_EQUAL(loop_run(s.l), 0);
    CU_ASSERT_EQUAL(s.pongs, s.want);
    CU_ASSERT(s.order_ok);
    /* unwatching one socket keeps the other polled */
    loop_unwatch_socket(s.l, router);
    loop_destroy(&s.l);
    zmq_close(router);
    zmq_close(dealer);
    zmq_ctx_term(ctx);
}

/* ---- Timers and signals ---- */

typedef struct timer_state {
    loop_t *l;
    loop_timer_t *rep;
    int ticks, once, signals, last_sig;
} timer_state_t;

static void on_tick(void *arg) {
    timer_state_t *t = arg;
    if (++t->ticks == 5) {
        loop_timer_close(&t->rep);
        raise(SIGTERM); /* handled by the loop: the process must survive */
    }
}

static void on_once(void *arg) {
    ((timer_state_t *)arg)->once++;
}

static void on_sig(int signum, void *arg) {
    timer_state_t *t = arg;
    t->signals++;
    t->last_sig = signum;
    loop_stop(t->l);
}

static void test_timers_signals(void) {
    timer_state_t t = {0};
    CU_ASSERT_EQUAL_FATAL(loop_new(&t.l), 0);
    CU_ASSERT_EQUAL(loop_on_signals(t.l, on_sig, &t), 0);
    CU_ASSERT_EQUAL(loop_timer_start(t.l, 1, 2, on_tick, &t, &t.rep), 0);
    CU_ASSERT_PTR_NOT_NULL(t.rep);
    CU_ASSERT_EQUAL(loop_timer_start(t.l, 0, 0, on_once, &t, NULL), 0);
    CU_ASSERT_EQUAL(loop_timer_start(t.l, WATCHDOG_MS, 0, on_watchdog, t.l, NULL), 0);
    CU_ASSERT_EQUAL(loop_run(t.l), 0);
    CU_ASSERT_EQUAL(t.ticks, 5);
    CU_ASSERT_PTR_NULL(t.rep);
    CU_ASSERT_EQUAL(t.once, 1);
    CU_ASSERT_EQUAL(t.signals, 1);
    CU_ASSERT_EQUAL(t.last_sig, SIGTERM);
    CU_ASSERT(loop_now_ms(t.l) > 0 || t.ticks == 5);
    loop_destroy(&t.l);
    loop_destroy(&t.l); /* NULL: no-op */
}

/* ---- Worker ---- */

typedef struct work_state {
    loop_t *l;
    loop_worker_t *w;
    int n_in, n_out, order_ok, exits;
    long sum;
} work_state_t;

static void body_double(loop_worker_t *w, void *arg) {
    (void)arg;
    void *item;
    while (loop_worker_next(w, &item, -1) == 1) {
        int *v = item;
        *v *= 2;
        if (loop_worker_post(w, v) < 0)
            free(v);
    }
    CU_ASSERT(loop_worker_stopping(w));
}

static void on_doubled(void *item, void *arg) {
    work_state_t *s = arg;
    int *v = item;
    if (*v != 2 * s->n_out)
        s->order_ok = 0;
    s->sum += *v;
    s->n_out++;
    free(v);
    if (s->n_out == s->n_in)
        loop_worker_stop(s->w);
}

static void on_worker_exit(void *arg) {
    work_state_t *s = arg;
    s->exits++;
    CU_ASSERT_FALSE(loop_worker_alive(s->w));
    loop_stop(s->l);
}

static void submit_all(void *arg) {
    work_state_t *s = arg;
    for (int i = 0; i < s->n_in; i++) {
        int *v = malloc(sizeof *v);
        *v = i;
        CU_ASSERT_EQUAL(loop_worker_submit(s->w, v), 0);
    }
}

static void test_worker(void) {
    work_state_t s = {0};
    s.n_in = 1000;
    s.order_ok = 1;
    CU_ASSERT_EQUAL_FATAL(loop_new(&s.l), 0);
    loop_worker_opts_t o = {body_double, on_doubled, on_worker_exit, free, free, &s};
    CU_ASSERT_EQUAL_FATAL(loop_worker_start(s.l, &o, &s.w), 0);
    CU_ASSERT(loop_worker_alive(s.w));
    CU_ASSERT_EQUAL(loop_timer_start(s.l, 0, 0, submit_all, &s, NULL), 0);
    CU_ASSERT_EQUAL(loop_timer_start(s.l, WATCHDOG_MS, 0, on_watchdog, s.l, NULL), 0);
    CU_ASSERT_EQUAL(loop_run(s.l), 0);
    CU_ASSERT_EQUAL(s.n_out, s.n_in);
    CU_ASSERT(s.order_ok);
    CU_ASSERT_EQUAL(s.sum, (long)s.n_in * (s.n_in - 1));
    CU_ASSERT_EQUAL(s.exits, 1);
    int *late = malloc(sizeof *late);
    CU_ASSERT_EQUAL(loop_worker_submit(s.w, late), MO_ESTATE);
    free(late);
    loop_destroy(&s.l);
}

/* A worker that never takes its inputs and posts results nobody receives: teardown
 * frees both queues. */
static void body_post_and_wait(loop_worker_t *w, void *arg) {
    (void)arg;
    for (int i = 0; i < 3; i++)
        loop_worker_post(w, malloc(16));
    struct timespec ms = {0, 1000000L};
    while (!loop_worker_stopping(w))
        nanosleep(&ms, NULL);
}

static void on_ignored(void *item, void *arg) {
    (void)arg;
    free(item);
}

static void test_worker_teardown(void) {
    loop_t *l = NULL;
    loop_worker_t *w = NULL;
    CU_ASSERT_EQUAL_FATAL(loop_new(&l), 0);
    loop_worker_opts_t o = {body_post_and_wait, on_ignored, NULL, free, free, NULL};
    CU_ASSERT_EQUAL_FATAL(loop_worker_start(l, &o, &w), 0);
    for (int i = 0; i < 4; i++)
        CU_ASSERT_EQUAL(loop_worker_submit(w, malloc(8)), 0);
    timer_state_t ts = {0};
    loop_timer_t *t = NULL;
    CU_ASSERT_EQUAL(loop_timer_start(l, 1000000, 0, on_once, &ts, &t), 0);
    loop_destroy(&l); /* the loop never ran: the body is stopped and joined here */
    CU_ASSERT_PTR_NULL(l);
    CU_ASSERT_EQUAL(ts.once, 0);
}

/* The learner watch: silent only once armed, the limit from the config or 10 beats. */
static void test_learner_watch(void) {
    config_transport_t t;
    memset(&t, 0, sizeof t);
    t.heartbeat_ms = 250;
    loop_learner_watch_t w;
    loop_learner_watch_init(&w, &t);
    CU_ASSERT_EQUAL(w.timeout_ms, 2500);
    t.learner_timeout_ms = 700;
    loop_learner_watch_init(&w, &t);
    CU_ASSERT_EQUAL(w.timeout_ms, 700);
    /* not welcomed yet: waits without limit */
    CU_ASSERT_EQUAL(loop_learner_check(&w, 1000000, "tcp://h:1"), MO_OK);
    loop_learner_heard(&w, 5000, false); /* a message before the welcome arms nothing */
    CU_ASSERT_EQUAL(loop_learner_check(&w, 9000, "tcp://h:1"), MO_OK);
    loop_learner_heard(&w, 10000, true);
    CU_ASSERT_EQUAL(loop_learner_check(&w, 10700, "tcp://h:1"), MO_OK);
    CU_ASSERT_EQUAL(loop_learner_check(&w, 10701, "tcp://h:1"), MO_ESTATE);
    CU_ASSERT(strstr(mo_last_error(), "the learner at tcp://h:1 is gone") != NULL);
    CU_ASSERT(strstr(mo_last_error(), "701 ms (limit 700 ms") != NULL);
    loop_learner_heard(&w, 10600, false); /* a heartbeat answer refreshes it */
    CU_ASSERT_EQUAL(loop_learner_check(&w, 11200, "tcp://h:1"), MO_OK);
    /* the learner's answer encodes as a heartbeat of role learner, refused in a hello */
    msg_t m, d;
    msg_buf_t b;
    msg_buf_init(&b);
    loop_learner_heartbeat(&m, 3, 4);
    CU_ASSERT_FATAL(msg_encode(&m, &b) == MO_OK);
    CU_ASSERT_FATAL(msg_decode(&d, b.data, b.len, MSG_HEARTBEAT) == MO_OK);
    CU_ASSERT(d.heartbeat.role == MSG_ROLE_LEARNER && d.heartbeat.inflight == 3 &&
              d.heartbeat.queue_depth == 4 && strcmp(d.heartbeat.worker_id, "learner") == 0);
    msg_free(&d);
    loop_hello(&m, MSG_ROLE_LEARNER, "learner");
    CU_ASSERT(msg_encode(&m, &b) == MO_EINVAL);
    msg_buf_free(&b);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"learner watch and the learner's heartbeat", test_learner_watch},
        {"socket backlog past the budget", test_socket_backlog},
        {"request/reply on one loop", test_socket_ping_pong},
        {"timers and SIGTERM", test_timers_signals},
        {"worker results in order", test_worker},
        {"teardown frees queued items", test_worker_teardown},
        CU_TEST_INFO_NULL,
    };
    return tu_main("loop", tests);
}
