/* loop: a daemon's event loop: libuv with ZeroMQ sockets polled through ZMQ_FD, SIGTERM
 * and SIGINT, timers, and a worker thread for compute whose results come back through
 * uv_async_send and a mutex-protected queue. */
#ifndef MOERL_TRANSPORT_LOOP_H
#define MOERL_TRANSPORT_LOOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/msg.h"
#include "transport/zsock.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Threads: everything here runs on the thread that calls loop_run (the loop thread),
 * except the worker functions marked "worker thread". ZeroMQ sockets are used on the
 * loop thread only.
 *
 * ZeroMQ sockets: ZMQ_FD is edge-triggered (it signals a change, not "a message is
 * waiting"), so the loop asks ZMQ_EVENTS after every wake-up and before it blocks, and
 * calls the socket's callback once per waiting message until none is left. A send can
 * make messages readable without the descriptor signalling; the check before blocking
 * covers sends made in any callback. At most LOOP_SOCK_BUDGET messages of one socket
 * are handled per pass, so one busy socket cannot starve the others.
 *
 * Handles (socket watches, timers, signals, the worker's async) are allocated here and
 * freed only in their libuv close callbacks. */

#define LOOP_SOCK_BUDGET 64

typedef struct loop loop_t;
typedef struct loop_timer loop_timer_t;
typedef struct loop_worker loop_worker_t;

int loop_new(loop_t **out);
/* Stops and joins the workers (freeing items left in their queues), closes every
 * handle, runs the loop until their close callbacks ran, and frees it. Close the
 * ZeroMQ sockets after this (their descriptors are polled until then). Safe on NULL. */
void loop_destroy(loop_t **l);

/* Runs until loop_stop. MO_EIO when libuv fails. */
int loop_run(loop_t *l);
/* Makes loop_run return at the end of the current iteration. */
void loop_stop(loop_t *l);
/* The loop's clock in milliseconds (monotonic, updated once per iteration). */
uint64_t loop_now_ms(const loop_t *l);
/* A monotonic clock in milliseconds, read now (any thread). */
double loop_clock_ms(void);

/* ---- ZeroMQ sockets ---- */

/* Called on the loop thread when sock has a message waiting: it must receive exactly
 * one (with ZMQ_DONTWAIT). */
typedef void (*loop_sock_fn)(void *sock, void *arg);

/* Polls sock (a ZeroMQ socket) and calls fn for each message. MO_EIO when its
 * descriptor cannot be read or polled. */
int loop_watch_socket(loop_t *l, void *sock, loop_sock_fn fn, void *arg);
/* Stops polling sock (its watch is closed, and freed in the close callback). */
void loop_unwatch_socket(loop_t *l, void *sock);

/* Receives one message without waiting and decodes it. 1 with *out holding it (msg_free
 * it); 0 when none is waiting; MO_EMALFORMED when its frames or fields are bad (*out
 * empty, *type the type its "type" field names or MSG_NONE, *from set so the sender
 * can be answered); MO_EIO. from and type may be NULL. */
int loop_recv_msg(void *sock, zsock_peer_t *from, msg_t *out, msg_type_t *type);
/* A routing id as text for logs and metrics labels: identifier bytes as they are,
 * others as '?', "" for an empty id. */
void loop_peer_name(const zsock_peer_t *p, char *buf, size_t cap);
/* A hello message for this process (pid, host name, "moerl <version>"); host points
 * into a static buffer. */
void loop_hello(msg_t *m, msg_role_t role, const char *worker_id);

/* A worker's watch on the learner: armed by the first welcome, refreshed by every
 * message from the learner's control socket (the learner answers each heartbeat). */
typedef struct loop_learner_watch {
    uint64_t timeout_ms; /* transport.learner_timeout_ms, or 10 heartbeat intervals */
    uint64_t last_ms;    /* the learner's last message */
    bool armed;          /* welcomed at least once */
} loop_learner_watch_t;

void loop_learner_watch_init(loop_learner_watch_t *w, const config_transport_t *t);
/* A message from the learner at now_ms; welcome arms the watch. */
void loop_learner_heard(loop_learner_watch_t *w, uint64_t now_ms, bool welcome);
/* MO_ESTATE with a message naming endpoint and the silence when the armed watch saw
 * nothing for longer than its timeout; MO_OK otherwise. */
int loop_learner_check(const loop_learner_watch_t *w, uint64_t now_ms, const char *endpoint);

/* The learner's answer to a worker's heartbeat (worker_id "learner", role learner). */
void loop_learner_heartbeat(msg_t *m, uint32_t inflight, uint32_t queue_depth);

struct metrics;
/* When c's allow-list refused clients since *seen: adds them to counter (a metrics_counter
 * of m), logs the count and the last refused key, and updates *seen. */
void loop_note_refused(struct metrics *m, int counter, const zsock_ctx_t *c, uint64_t *seen);

/* ---- Signals ---- */

typedef void (*loop_signal_fn)(int signum, void *arg);

/* fn runs on the loop thread for each SIGTERM and SIGINT (it decides what a second
 * one means). SIGPIPE is ignored from then on. */
int loop_on_signals(loop_t *l, loop_signal_fn fn, void *arg);

/* ---- Timers ---- */

typedef void (*loop_timer_fn)(void *arg);

/* fn runs after first_ms, then every repeat_ms (0: once). *out (may be NULL) receives
 * a handle for loop_timer_close; a one-shot timer stays allocated until then or until
 * loop_destroy. */
int loop_timer_start(loop_t *l, uint64_t first_ms, uint64_t repeat_ms, loop_timer_fn fn, void *arg,
                     loop_timer_t **out);
/* Stops the timer and closes it; *t = NULL. Safe on NULL. */
void loop_timer_close(loop_timer_t **t);

/* ---- The worker thread ---- */

/* Items are opaque pointers owned by whoever holds them: submit hands an input to the
 * worker, post hands a result to the loop thread. Several posts made before the loop
 * wakes up are delivered in one wake-up, in posting order. */
typedef struct loop_worker_opts {
    /* worker thread: the body; typically loops on loop_worker_next until it returns
     * MO_ESTATE. */
    void (*body)(loop_worker_t *w, void *arg);
    /* loop thread: one result (required). */
    void (*on_result)(void *item, void *arg);
    /* loop thread: the body returned and every result before that was delivered
     * (may be NULL). */
    void (*on_exit)(void *arg);
    /* inputs never taken and results never delivered, at loop_destroy (may be NULL). */
    void (*free_input)(void *item);
    void (*free_result)(void *item);
    void *arg;
} loop_worker_opts_t;

int loop_worker_start(loop_t *l, const loop_worker_opts_t *o, loop_worker_t **out);
/* Loop thread: queues an input. MO_ENOMEM; MO_ESTATE after loop_worker_stop (the item
 * stays the caller's). */
int loop_worker_submit(loop_worker_t *w, void *item);
/* Loop thread: asks the body to return: loop_worker_next then gives MO_ESTATE. Does not
 * wait (on_exit says when the body returned). */
void loop_worker_stop(loop_worker_t *w);
/* Loop thread: 1 until on_exit ran. */
bool loop_worker_alive(const loop_worker_t *w);

/* Worker thread: the next input. 1 with *item set; 0 when none came within timeout_ms
 * (0: do not wait; -1: wait without limit); MO_ESTATE once loop_worker_stop was called. */
int loop_worker_next(loop_worker_t *w, void **item, int timeout_ms);
/* Worker thread: 1 when loop_worker_stop was called. */
bool loop_worker_stopping(loop_worker_t *w);
/* Worker thread: hands a result to the loop thread. MO_ENOMEM. */
int loop_worker_post(loop_worker_t *w, void *item);

#ifdef __cplusplus
}
#endif
#endif
