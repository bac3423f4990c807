/* zsock: ZeroMQ sockets for the daemons: one constructor per socket role with
 * the transport limits (ZMQ_MAXMSGSIZE, linger, reconnect), endpoint checks,
 * the loopback-or-CURVE policy, CURVE key files, a daemon's context (options,
 * client allow-list, its sockets closed together), and framed send/receive
 * with routing ids. */
#ifndef MOERL_TRANSPORT_ZSOCK_H
#define MOERL_TRANSPORT_ZSOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "core/config.h"
#include "transport/codec.h"
#include "transport/msg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZSOCK_KEY_LEN 40 /* a CURVE key in Z85 */

typedef struct zsock_opts {
    int64_t max_msg_bytes;      /* ZMQ_MAXMSGSIZE: a larger inbound message is refused (the
                                 * connection that sent it is dropped); -1 = no limit */
    int linger_ms;              /* ZMQ_LINGER: how long close waits to flush (default 1000) */
    int reconnect_ms;           /* ZMQ_RECONNECT_IVL (default 100) */
    int reconnect_max_ms;       /* ZMQ_RECONNECT_IVL_MAX, exponential back-off (default 5000) */
    int sndhwm, rcvhwm;         /* high-water marks in messages; 0 = ZeroMQ's default (1000) */
    int heartbeat_ms;           /* ZMTP ping interval, timeout 3x; 0 = off (default) */
    const char *routing_id;     /* DEALER: ZMQ_ROUTING_ID (1..255 bytes, no leading NUL); NULL =
                                 * one the ROUTER makes up */
    bool allow_insecure_remote; /* permit tcp beyond loopback without CURVE */
    bool curve;                 /* CURVE on: curve_secret (and curve_public) are set */
    char curve_secret[ZSOCK_KEY_LEN + 1]; /* this process's secret key */
    char curve_public[ZSOCK_KEY_LEN + 1]; /* its public key */
    char curve_server[ZSOCK_KEY_LEN + 1]; /* the server's public key, for connecting; "" = none */
} zsock_opts_t;

/* Defaults: 256 MiB messages, linger 1000 ms, reconnect 100..5000 ms, no CURVE. */
void zsock_opts_default(zsock_opts_t *o);
/* From the transport section: max_msg_bytes, and the CURVE key files
 * (loaded and checked; MO_ECONFIG naming the key and file on any problem). */
int zsock_opts_from_config(zsock_opts_t *o, const config_transport_t *t);

/* ---- Endpoints ---- */

/* tcp://HOST:PORT (HOST: IPv4, [IPv6], a name or interface, or * when
 * binding; PORT: 1..65535, or * when binding for any free port),
 * ipc://PATH (at most 107 bytes) or inproc://NAME. MO_EINVAL saying what is
 * wrong. */
int zsock_endpoint_check(const char *endpoint, bool bind);
/* True for endpoints no other machine can reach: tcp on a loopback address
 * (127.0.0.0/8, ::1, localhost, lo), ipc and inproc. */
bool zsock_endpoint_is_local(const char *endpoint);
/* The policy: MO_ECONFIG when a tcp endpoint beyond loopback would be used
 * without CURVE keys and without allow_insecure_remote. */
int zsock_security_check(const char *endpoint, const zsock_opts_t *o);
/* The i-th endpoint of a family (reward worker i binds its own): tcp port
 * plus i, or ipc path with ".i" appended; i == 0 gives base itself. */
int zsock_endpoint_nth(const char *base, int i, char *out, size_t cap);

/* ---- Sockets ---- */

/* A socket of ZeroMQ type `type` (ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUB, ZMQ_SUB,
 * ZMQ_PUSH, ZMQ_PULL) with o's options, bound or connected. Bound sockets
 * with CURVE act as CURVE servers; connected ones as clients of
 * curve_server. ROUTERs get ZMQ_ROUTER_MANDATORY (sending to a departed
 * peer is an error) and ZMQ_ROUTER_HANDOVER (a reconnecting worker with the
 * same routing id takes over); SUBs subscribe to everything. Bind errors
 * (address in use, no such interface) are MO_EIO naming the endpoint. */
int zsock_bind(void *ctx, int type, const char *endpoint, const zsock_opts_t *o, void **out);
int zsock_connect(void *ctx, int type, const char *endpoint, const zsock_opts_t *o, void **out);
/* The endpoint actually bound (tcp port "*" resolved). */
int zsock_last_endpoint(void *s, char *buf, size_t cap);
/* Closes (after linger) and sets *s to NULL; safe on NULL. */
void zsock_close(void **s);

/* The sockets of a job (docs/protocol.md, socket map). */
typedef enum {
    ZS_LEARNER_CONTROL, /* ROUTER, binds transport.control */
    ZS_LEARNER_WORK,    /* ROUTER, binds transport.work */
    ZS_LEARNER_SINK,    /* PULL, binds transport.trajectories */
    ZS_LEARNER_WEIGHTS, /* PUB, binds transport.weights */
    ZS_REWARD_SERVER,   /* ROUTER, reward worker `arg` binds transport.reward's arg-th endpoint */
    ZS_WORKER_CONTROL,  /* DEALER, connects transport.control (rollout, reward, ctl) */
    ZS_ROLLOUT_WORK,    /* DEALER, connects transport.work */
    ZS_ROLLOUT_SINK,    /* PUSH, connects transport.trajectories */
    ZS_ROLLOUT_WEIGHTS, /* SUB, connects transport.weights */
    ZS_ROLLOUT_REWARD,  /* DEALER, connects to all `arg` reward endpoints (round robin) */
    ZS_ROLE_COUNT
} zsock_role_t;

const char *zsock_role_name(zsock_role_t r);
/* Opens the socket of a role on the endpoint(s) the transport section names. */
int zsock_open(void *ctx, zsock_role_t role, const config_transport_t *t, const zsock_opts_t *o,
               int arg, void **out);

/* ---- CURVE keys ---- */

/* Writes a new keypair: dir/name.key (the secret key, mode 0600) and
 * dir/name.pub (the public key, 0644), each through a temporary file that
 * is renamed into place. name: [A-Za-z0-9._-]. Without force an existing
 * file is not replaced (MO_ESTATE). public_z85 (may be NULL) receives the
 * public key. */
int zsock_curve_keygen(const char *dir, const char *name, bool force,
                       char public_z85[ZSOCK_KEY_LEN + 1]);
/* Reads a key file: one 40-character Z85 key, '#' comment lines and
 * whitespace allowed. secret: the file must not be readable by group or
 * others. MO_ECONFIG naming the file. */
int zsock_curve_read_key(const char *path, bool secret, char out[ZSOCK_KEY_LEN + 1]);

/* ---- A daemon's context ---- */

#define ZSOCK_CTX_MAX_SOCKETS 8

/* The ZeroMQ context of a daemon and its sockets: the socket options of its transport
 * section, the worker's routing id for its DEALERs, and, on a process that binds sockets
 * (server) with transport.curve_allowed_clients set, the ZAP handler admitting only
 * those CURVE clients (transport/zap.h). Not to be copied once open (opts points into
 * it). */
typedef struct zsock_ctx {
    void *ctx;
    zsock_opts_t opts; /* zsock_opts_from_config, routing_id set */
    const config_transport_t *t;
    char routing_id[256];
    struct zap *zap; /* NULL without an allow-list */
    int n_allowed;   /* keys on the allow-list */
    void **socks[ZSOCK_CTX_MAX_SOCKETS]; /* the callers' socket pointers, closed together */
    int n_socks;
} zsock_ctx_t;

/* Options from t, a new context and (server) the allow-list's ZAP handler, started
 * before any socket exists. routing_id (NULL: none) goes on every DEALER. t must outlive
 * c. MO_ECONFIG for bad keys or an allow-list without CURVE; on failure nothing is left
 * open. */
int zsock_ctx_open(zsock_ctx_t *c, const config_transport_t *t, const char *routing_id,
                   bool server);
/* zsock_open of role (arg as there) with c's options into *out, which c remembers and
 * closes (setting it NULL) in zsock_ctx_close. MO_ENOMEM past ZSOCK_CTX_MAX_SOCKETS. */
int zsock_ctx_socket(zsock_ctx_t *c, zsock_role_t role, int arg, void **out);
/* Clients refused by the allow-list so far (0 without one). */
uint64_t zsock_ctx_refused(const zsock_ctx_t *c);
/* Closes every socket opened with zsock_ctx_socket, stops the ZAP handler and terminates
 * the context; safe on a zeroed or closed c. */
void zsock_ctx_close(zsock_ctx_t *c);

/* ---- Messages ---- */

/* Who sent a message to a ROUTER, and how to address the reply. */
typedef struct zsock_peer {
    uint8_t id[255]; /* routing id */
    size_t len;
    bool delimited; /* the peer sent an empty delimiter frame (REQ-style); replies get one */
} zsock_peer_t;

typedef struct zsock_msg {
    zsock_peer_t from; /* ROUTER only */
    zmq_msg_t body;
    bool open;
} zsock_msg_t;

/* Sends one message: on a ROUTER to `to` as [id][(empty)][data]; on other
 * sockets `to` is NULL and the message is [data]. Returns 1 when sent, 0
 * when it would block (ZMQ_DONTWAIT with a full queue), MO_EINVAL when len
 * passes the socket's ZMQ_MAXMSGSIZE, MO_ENOTFOUND when a ROUTER's peer is
 * gone, MO_EIO otherwise. */
int zsock_send(void *s, const zsock_peer_t *to, const void *data, size_t len, int flags);
/* The same without copying: takes buf's bytes (buf is left empty whatever
 * the result). */
int zsock_send_buf(void *s, const zsock_peer_t *to, msg_buf_t *buf, int flags);
/* Encodes m and sends it (zero-copy). */
int zsock_send_msg(void *s, const zsock_peer_t *to, const msg_t *m, int flags);

/* Receives one message: 1 when m holds one (release with zsock_msg_close),
 * 0 when none is waiting (ZMQ_DONTWAIT) or a signal interrupted the wait,
 * MO_EMALFORMED when its frames are not [id][(empty)][body] on a ROUTER or
 * [body] elsewhere (every frame is drained; m->from is set), MO_EIO
 * otherwise. */
int zsock_recv(void *s, zsock_msg_t *m, int flags);
void *zsock_msg_data(zsock_msg_t *m);
size_t zsock_msg_size(zsock_msg_t *m);
void zsock_msg_close(zsock_msg_t *m);
/* Receives and decodes: 1 with *out holding the message (msg_free it), 0
 * as for zsock_recv, MO_EMALFORMED for bad frames or a bad message (*out
 * empty, *from set so an error can be sent back). from may be NULL. */
int zsock_recv_msg(void *s, zsock_peer_t *from, msg_t *out, msg_type_t expect, int flags);

/* Waits until s has a message: 1, 0 after timeout_ms (-1: no limit) or on
 * a signal, MO_EIO on error. */
int zsock_wait(void *s, int timeout_ms);
/* For event loops: the socket's ZMQ_FD (edge-triggered; after each wake-up
 * drain while zsock_readable says so). */
int zsock_fd(void *s, int *fd);
bool zsock_readable(void *s);

#ifdef __cplusplus
}
#endif
#endif
