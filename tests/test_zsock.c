/* Tests for the ZeroMQ helpers with real sockets in one process (tcp on
 * loopback, ipc): endpoint checks and the loopback-or-CURVE policy,
 * ROUTER/DEALER exchange (with REQ-style delimiters and bad frames),
 * ZMQ_MAXMSGSIZE refusing an oversized message while the socket keeps
 * working, CURVE with generated keys (and a wrong server key failing), an
 * endpoint already in use, every socket role from a config, a daemon's context
 * (zsock_ctx_t: options, routing id, one close for every socket), and
 * `moerl keys gen`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "core/config.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/zsock.h"

#define WAIT_MS 10000 /* generous: only reached when something is broken */

static void *g_ctx;
static char g_dir[512];

static void opts_fast(zsock_opts_t *o) {
    zsock_opts_default(o);
    o->linger_ms = 0;
    o->reconnect_ms = 20;
    o->reconnect_max_ms = 200;
}

static void hello(msg_t *m, const char *id) {
    msg_init(m);
    m->type = MSG_HELLO;
    m->hello = (msg_hello_t){MSG_ROLE_ROLLOUT, id, 1234, "localhost", NULL};
}

/* Waits for and decodes one message; 1 on success. */
static int recv_one(void *s, zsock_peer_t *from, msg_t *out, msg_type_t expect) {
    msg_init(out);
    if (zsock_wait(s, WAIT_MS) != 1)
        return 0;
    int rc = zsock_recv_msg(s, from, out, expect, ZMQ_DONTWAIT);
    if (rc != 1)
        tu_report("recv: %d %s", rc, mo_last_error());
    return rc == 1;
}

/* ---- Endpoints and policy ---- */

static void test_endpoints(void) {
    static const char *good_bind[] = {
        "tcp://127.0.0.1:5570", "tcp://*:5570",       "tcp://[::1]:5570", "tcp://localhost:1",
        "tcp://127.0.0.1:*",    "ipc:///tmp/moerl-x", "inproc://learner", "tcp://eth0:5570",
    };
    static const char *bad[] = {
        "",
        "udp://1.2.3.4:5",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65536",
        "tcp://:5570",
        "tcp://::1:5570",
        "tcp://[::1]5570",
        "tcp://[zz]:1",
        "tcp://a;127.0.0.1:1",
        "ipc://",
        "tcp://a b:1",
        "tcp://1.2.3.4:12a",
        "tcp://1.2.3.4:123456",
        "inproc://",
    };
    for (size_t i = 0; i < sizeof good_bind / sizeof *good_bind; i++) {
        int rc = zsock_endpoint_check(good_bind[i], true);
        if (rc != MO_OK)
            tu_report("%s: %s", good_bind[i], mo_last_error());
        CU_ASSERT(rc == MO_OK);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int rc = zsock_endpoint_check(bad[i], true);
        if (rc != MO_EINVAL)
            tu_report("'%s' was accepted", bad[i]);
        CU_ASSERT(rc == MO_EINVAL && strstr(mo_last_error(), "endpoint") != NULL);
    }
    CU_ASSERT(zsock_endpoint_check("tcp://*:5570", false) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "only works for binding") != NULL);
    CU_ASSERT(zsock_endpoint_check("tcp://127.0.0.1:*", false) == MO_EINVAL);

    static const char *local[] = {
        "tcp://127.0.0.1:1",          "tcp://127.9.8.7:1", "tcp://localhost:1", "tcp://[::1]:1",
        "tcp://[::ffff:127.0.0.1]:1", "tcp://lo:1",        "ipc:///tmp/a",      "inproc://a"};
    static const char *remote[] = {
        "tcp://0.0.0.0:1",     "tcp://*:1",    "tcp://10.0.0.1:1",          "tcp://[::]:1",
        "tcp://example.com:1", "tcp://eth0:1", "tcp://[::ffff:10.0.0.1]:1", "tcp://128.0.0.1:1"};
    for (size_t i = 0; i < sizeof local / sizeof *local; i++)
        CU_ASSERT(zsock_endpoint_is_local(local[i]));
    for (size_t i = 0; i < sizeof remote / sizeof *remote; i++)
        CU_ASSERT(!zsock_endpoint_is_local(remote[i]));

    char out[256];
    CU_ASSERT(zsock_endpoint_nth("tcp://127.0.0.1:5574", 2, out, sizeof out) == MO_OK &&
              strcmp(out, "tcp://127.0.0.1:5576") == 0);
    CU_ASSERT(zsock_endpoint_nth("tcp://[::1]:100", 1, out, sizeof out) == MO_OK &&
              strcmp(out, "tcp://[::1]:101") == 0);
    CU_ASSERT(zsock_endpoint_nth("ipc:///tmp/reward", 3, out, sizeof out) == MO_OK &&
              strcmp(out, "ipc:///tmp/reward.3") == 0);
    CU_ASSERT(zsock_endpoint_nth("ipc:///tmp/reward", 0, out, sizeof out) == MO_OK &&
              strcmp(out, "ipc:///tmp/reward") == 0);
    CU_ASSERT(zsock_endpoint_nth("tcp://127.0.0.1:65535", 1, out, sizeof out) == MO_EINVAL);
}

static void test_remote_policy(void) {
    zsock_opts_t o;
    opts_fast(&o);
    static const char *remote[] = {"tcp://0.0.0.0:*", "tcp://*:*", "tcp://[::]:*",
                                   "tcp://10.1.2.3:5570"};
    for (size_t i = 0; i < sizeof remote / sizeof *remote; i++) {
        void *s = (void *)1;
        int rc = zsock_bind(g_ctx, ZMQ_ROUTER, remote[i], &o, &s);
        CU_ASSERT(rc == MO_ECONFIG && s == NULL);
        CU_ASSERT(strstr(mo_last_error(), "reachable from other machines and CURVE is off") !=
                  NULL);
        CU_ASSERT(strstr(mo_last_error(), "allow_insecure_remote") != NULL);
        CU_ASSERT(zsock_connect(g_ctx, ZMQ_DEALER, "tcp://10.1.2.3:5570", &o, &s) == MO_ECONFIG);
    }
    CU_ASSERT(zsock_security_check("tcp://127.0.0.1:5570", &o) == MO_OK);
    CU_ASSERT(zsock_security_check("ipc:///tmp/x", &o) == MO_OK);
    o.allow_insecure_remote = true;
    CU_ASSERT(zsock_security_check("tcp://0.0.0.0:5570", &o) == MO_OK);
    o.allow_insecure_remote = false;
    o.curve = true;
    CU_ASSERT(zsock_security_check("tcp://0.0.0.0:5570", &o) == MO_OK);
}

/* ---- Exchange ---- */

static void test_router_dealer(void) {
    zsock_opts_t o;
    opts_fast(&o);
    void *router, *dealer, *dealer2;
    char ep[256];
    CU_ASSERT_FATAL(zsock_bind(g_ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &o, &router) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(router, ep, sizeof ep) == MO_OK);
    CU_ASSERT(strncmp(ep, "tcp://127.0.0.1:", 16) == 0);
    o.routing_id = "rollout-7";
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &o, &dealer) == MO_OK);
    o.routing_id = NULL;
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &o, &dealer2) == MO_OK);

    msg_t m, got;
    hello(&m, "rollout-7");
    CU_ASSERT(zsock_send_msg(dealer, NULL, &m, 0) == 1);
    zsock_peer_t from = {{0}, 0, false};
    CU_ASSERT_FATAL(recv_one(router, &from, &got, MSG_HELLO));
    CU_ASSERT(from.len == 9 && memcmp(from.id, "rollout-7", 9) == 0 && !from.delimited);
    CU_ASSERT(strcmp(got.hello.worker_id, "rollout-7") == 0 && got.hello.pid == 1234);
    msg_free(&got);

    /* reply to that peer only */
    msg_t w;
    msg_init(&w);
    w.type = MSG_WORK_REQUEST;
    w.work_request = (msg_work_request_t){"learner", 3};
    CU_ASSERT(zsock_send_msg(router, &from, &w, 0) == 1);
    CU_ASSERT_FATAL(recv_one(dealer, NULL, &got, MSG_WORK_REQUEST));
    CU_ASSERT(got.work_request.credits == 3);
    msg_free(&got);
    CU_ASSERT(zsock_wait(dealer2, 0) == 0);

    /* a peer that is not there */
    zsock_peer_t ghost = {{'n', 'o', 'b', 'o', 'd', 'y'}, 6, false};
    CU_ASSERT(zsock_send_msg(router, &ghost, &w, 0) == MO_ENOTFOUND);
    /* a ROUTER needs a peer; others refuse one */
    CU_ASSERT(zsock_send(router, NULL, "x", 1, 0) == MO_EINVAL);
    CU_ASSERT(zsock_send(dealer, &from, "x", 1, 0) == MO_EINVAL);

    /* bad frames are drained and refused; the next message is fine */
    CU_ASSERT(zmq_send(dealer2, "a", 1, ZMQ_SNDMORE) == 1 && zmq_send(dealer2, "b", 1, 0) == 1);
    CU_ASSERT_FATAL(zsock_wait(router, WAIT_MS) == 1);
    zsock_msg_t zm;
    CU_ASSERT(zsock_recv(router, &zm, ZMQ_DONTWAIT) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "[routing id][body]") != NULL);
    /* bad bytes: refused with the sender known, so it can be told */
    CU_ASSERT(zsock_send(dealer2, NULL, "\x81\xa4type\xa5hello", 12, 0) == 1);
    CU_ASSERT_FATAL(zsock_wait(router, WAIT_MS) == 1);
    CU_ASSERT(zsock_recv_msg(router, &from, &got, MSG_NONE, ZMQ_DONTWAIT) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "hello.v: missing") != NULL && from.len > 0);
    msg_t e;
    msg_init(&e);
    e.type = MSG_ERROR;
    e.error = (msg_error_t){MO_EMALFORMED, "hello.v: missing", "hello", false, 0};
    CU_ASSERT(zsock_send_msg(router, &from, &e, 0) == 1);
    CU_ASSERT_FATAL(recv_one(dealer2, NULL, &got, MSG_ERROR));
    CU_ASSERT(got.error.code == MO_EMALFORMED && strcmp(got.error.about, "hello") == 0);
    msg_free(&got);
    /* nothing waiting: 0 */
    CU_ASSERT(zsock_recv(router, &zm, ZMQ_DONTWAIT) == 0);

    /* a REQ peer puts an empty delimiter; the reply mirrors it */
    void *req = zmq_socket(g_ctx, ZMQ_REQ);
    int zero = 0;
    zmq_setsockopt(req, ZMQ_LINGER, &zero, sizeof zero);
    CU_ASSERT_FATAL(zmq_connect(req, ep) == 0);
    hello(&m, "ctl-1");
    CU_ASSERT(zsock_send_msg(req, NULL, &m, 0) == 1);
    CU_ASSERT_FATAL(recv_one(router, &from, &got, MSG_HELLO));
    CU_ASSERT(from.delimited);
    msg_free(&got);
    CU_ASSERT(zsock_send_msg(router, &from, &w, 0) == 1);
    CU_ASSERT_FATAL(recv_one(req, NULL, &got, MSG_WORK_REQUEST));
    msg_free(&got);
    zmq_close(req);

    int fd = -1;
    CU_ASSERT(zsock_fd(router, &fd) == MO_OK && fd >= 0);
    CU_ASSERT(!zsock_readable(router));
    zsock_close(&dealer);
    zsock_close(&dealer2);
    zsock_close(&router);
    CU_ASSERT(router == NULL);
    zsock_close(&router); /* NULL is fine */
}

/* ---- ZMQ_MAXMSGSIZE ---- */

static void test_max_msg_size(void) {
    zsock_opts_t o, big;
    opts_fast(&o);
    o.max_msg_bytes = 4096;
    opts_fast(&big);
    big.max_msg_bytes = -1; /* this sender does not check: the receiver must */
    void *router, *a, *b;
    char ep[256];
    CU_ASSERT_FATAL(zsock_bind(g_ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &o, &router) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(router, ep, sizeof ep) == MO_OK);
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &big, &a) == MO_OK);
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &o, &b) == MO_OK);

    char *payload = malloc(8192);
    memset(payload, 'z', 8192);
    /* a sender with the limit refuses before sending */
    CU_ASSERT(zsock_send(b, NULL, payload, 8192, 0) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "over the 4096-byte limit") != NULL);
    /* one from b first, so its connection is up before a's oversized message */
    CU_ASSERT(zsock_send(b, NULL, "first", 5, 0) == 1);
    zsock_msg_t zm;
    CU_ASSERT_FATAL(zsock_wait(router, WAIT_MS) == 1);
    CU_ASSERT(zsock_recv(router, &zm, ZMQ_DONTWAIT) == 1 && zsock_msg_size(&zm) == 5);
    zsock_msg_close(&zm);

    CU_ASSERT(zsock_send(a, NULL, payload, 8192, 0) == 1);
    /* small messages from a get through again once it has reconnected;
     * the oversized one never arrives */
    int small = 0, oversized = 0;
    for (int i = 0; i < 200 && !small; i++) {
        char ping[32];
        int n = snprintf(ping, sizeof ping, "ping %d", i);
        CU_ASSERT(zsock_send(a, NULL, ping, (size_t)n, 0) == 1);
        while (zsock_wait(router, 50) == 1) {
            CU_ASSERT_FATAL(zsock_recv(router, &zm, ZMQ_DONTWAIT) == 1);
            oversized += zsock_msg_size(&zm) > 4096;
            small += zsock_msg_size(&zm) <= 4096;
            zsock_msg_close(&zm);
        }
    }
    CU_ASSERT(small > 0);
    CU_ASSERT(oversized == 0);
    /* the other peer was never affected */
    CU_ASSERT(zsock_send(b, NULL, "still here", 10, 0) == 1);
    int found = 0;
    while (!found && zsock_wait(router, WAIT_MS) == 1) {
        CU_ASSERT_FATAL(zsock_recv(router, &zm, ZMQ_DONTWAIT) == 1);
        found = zsock_msg_size(&zm) == 10 && memcmp(zsock_msg_data(&zm), "still here", 10) == 0;
        zsock_msg_close(&zm);
    }
    CU_ASSERT(found);
    free(payload);
    zsock_close(&a);
    zsock_close(&b);
    zsock_close(&router);
}

/* ---- Address in use ---- */

static void test_in_use(void) {
    zsock_opts_t o;
    opts_fast(&o);
    void *r1, *r2 = (void *)1;
    char ep[256];
    CU_ASSERT_FATAL(zsock_bind(g_ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &o, &r1) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(r1, ep, sizeof ep) == MO_OK);
    int rc = zsock_bind(g_ctx, ZMQ_ROUTER, ep, &o, &r2);
    CU_ASSERT(rc == MO_EIO && r2 == NULL);
    CU_ASSERT(strstr(mo_last_error(), ep) != NULL);
    CU_ASSERT(strstr(mo_last_error(), "address already in use") != NULL);
    zsock_close(&r1);
}

/* ---- CURVE ---- */

static void key_path(char *buf, size_t cap, const char *name, const char *ext) {
    snprintf(buf, cap, "%s/keys/%s.%s", g_dir, name, ext);
}

static mode_t file_mode(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (st.st_mode & 0777) : 0;
}

/* Waits for a handshake failure on a monitored socket; 1 when one came. */
static int handshake_failed(void *mon) {
    const int failed = ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                       ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    while (zsock_wait(mon, WAIT_MS) == 1) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, mon, 0) < 0)
            return 0;
        uint16_t ev = 0;
        if (zmq_msg_size(&f) >= 2)
            memcpy(&ev, zmq_msg_data(&f), 2);
        int more = zmq_msg_more(&f);
        zmq_msg_close(&f);
        while (more) { /* the endpoint frame */
            zmq_msg_init(&f);
            zmq_msg_recv(&f, mon, 0);
            more = zmq_msg_more(&f);
            zmq_msg_close(&f);
        }
        if (ev & failed)
            return 1;
    }
    return 0;
}

static void test_curve(void) {
    char kdir[600], skey[700], spub[700], ckey[700], cpub[700], spub_z[41], cpub_z[41];
    snprintf(kdir, sizeof kdir, "%s/keys", g_dir);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "server", false, spub_z) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "client", false, cpub_z) == MO_OK);
    key_path(skey, sizeof skey, "server", "key");
    key_path(spub, sizeof spub, "server", "pub");
    key_path(ckey, sizeof ckey, "client", "key");
    key_path(cpub, sizeof cpub, "client", "pub");
    CU_ASSERT(file_mode(skey) == 0600 && file_mode(ckey) == 0600);
    CU_ASSERT(file_mode(spub) == 0644);
    char k[41];
    CU_ASSERT(zsock_curve_read_key(spub, false, k) == MO_OK && strcmp(k, spub_z) == 0);
    CU_ASSERT(strcmp(spub_z, cpub_z) != 0);
    /* no silent replacement */
    CU_ASSERT(zsock_curve_keygen(kdir, "server", false, NULL) == MO_ESTATE);
    CU_ASSERT(strstr(mo_last_error(), "use --force") != NULL);
    CU_ASSERT(zsock_curve_keygen(kdir, "bad/name", false, NULL) == MO_EINVAL);

    /* config -> options, and their errors */
    config_transport_t t;
    memset(&t, 0, sizeof t);
    t.max_msg_bytes = 1 << 20;
    t.curve_secret_key = skey;
    t.curve_public_key = spub;
    t.curve_server_key = "";
    zsock_opts_t srv, cli, wrong, plain;
    CU_ASSERT_FATAL(zsock_opts_from_config(&srv, &t) == MO_OK);
    CU_ASSERT(srv.curve && srv.max_msg_bytes == 1 << 20 && strcmp(srv.curve_public, spub_z) == 0);
    t.curve_public_key = cpub; /* not the server's pair */
    CU_ASSERT(zsock_opts_from_config(&cli, &t) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "does not belong to the secret key") != NULL);
    t.curve_secret_key = ckey;
    t.curve_public_key = "";
    t.curve_server_key = spub;
    CU_ASSERT_FATAL(zsock_opts_from_config(&cli, &t) == MO_OK);
    CU_ASSERT(strcmp(cli.curve_public, cpub_z) == 0 && strcmp(cli.curve_server, spub_z) == 0);
    t.curve_secret_key = "";
    CU_ASSERT(zsock_opts_from_config(&plain, &t) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "curve_server_key is set but") != NULL);
    chmod(ckey, 0640);
    t.curve_secret_key = ckey;
    CU_ASSERT(zsock_opts_from_config(&plain, &t) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "must not be readable by group or others") != NULL);
    chmod(ckey, 0600);
    srv.linger_ms = cli.linger_ms = 0;
    wrong = cli;
    memcpy(wrong.curve_server, cpub_z, sizeof cpub_z); /* the wrong server key */
    opts_fast(&plain);

    void *server, *good, *bad, *nocurve;
    char ep[256];
    CU_ASSERT_FATAL(zsock_bind(g_ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &srv, &server) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(server, ep, sizeof ep) == MO_OK);
    CU_ASSERT_FATAL(zmq_socket_monitor(server, "inproc://curve-monitor", ZMQ_EVENT_ALL) == 0);
    void *mon = zmq_socket(g_ctx, ZMQ_PAIR);
    CU_ASSERT_FATAL(zmq_connect(mon, "inproc://curve-monitor") == 0);

    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &cli, &good) == MO_OK);
    msg_t m, got;
    hello(&m, "rollout-0");
    CU_ASSERT(zsock_send_msg(good, NULL, &m, 0) == 1);
    zsock_peer_t from;
    CU_ASSERT_FATAL(recv_one(server, &from, &got, MSG_HELLO));
    msg_free(&got);
    hello(&m, "learner");
    CU_ASSERT(zsock_send_msg(server, &from, &m, 0) == 1);
    CU_ASSERT_FATAL(recv_one(good, NULL, &got, MSG_HELLO));
    CU_ASSERT(strcmp(got.hello.worker_id, "learner") == 0);
    msg_free(&got);

    /* the wrong server key: the handshake fails, nothing is delivered */
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &wrong, &bad) == MO_OK);
    hello(&m, "intruder");
    CU_ASSERT(zsock_send_msg(bad, NULL, &m, 0) == 1);
    CU_ASSERT(handshake_failed(mon));
    /* no CURVE at all: refused the same way */
    CU_ASSERT_FATAL(zsock_connect(g_ctx, ZMQ_DEALER, ep, &plain, &nocurve) == MO_OK);
    CU_ASSERT(zsock_send_msg(nocurve, NULL, &m, 0) == 1);
    CU_ASSERT(handshake_failed(mon));
    CU_ASSERT(zsock_wait(server, 200) == 0);
    /* the good client still talks */
    hello(&m, "rollout-0");
    CU_ASSERT(zsock_send_msg(good, NULL, &m, 0) == 1);
    CU_ASSERT(recv_one(server, &from, &got, MSG_HELLO) &&
              strcmp(got.hello.worker_id, "rollout-0") == 0);
    msg_free(&got);

    zmq_socket_monitor(server, NULL, 0);
    zmq_close(mon);
    zsock_close(&good);
    zsock_close(&bad);
    zsock_close(&nocurve);
    zsock_close(&server);
}

/* ---- Socket roles from a config ---- */

static void test_roles(void) {
    moerl_config_t cfg;
    CU_ASSERT_FATAL(config_defaults(&cfg) == MO_OK);
    static const char *keys[] = {"control", "work", "trajectories", "weights", "reward"};
    for (int i = 0; i < 5; i++) {
        char key[64], val[700];
        snprintf(key, sizeof key, "transport.%s", keys[i]);
        snprintf(val, sizeof val, "ipc://%s/%s", g_dir, keys[i]);
        CU_ASSERT_FATAL(config_set(&cfg, key, val) == MO_OK);
    }
    CU_ASSERT_FATAL(config_set(&cfg, "transport.max_msg_bytes", "65536") == MO_OK);
    zsock_opts_t o;
    CU_ASSERT_FATAL(zsock_opts_from_config(&o, &cfg.transport) == MO_OK);
    CU_ASSERT(!o.curve && o.max_msg_bytes == 65536);
    o.linger_ms = 0;
    const config_transport_t *t = &cfg.transport;
    void *s[ZS_ROLE_COUNT + 1] = {0};
    for (int r = 0; r < ZS_ROLE_COUNT; r++) {
        int arg = r == ZS_ROLLOUT_REWARD ? 2 : 0;
        int rc = zsock_open(g_ctx, (zsock_role_t)r, t, &o, arg, &s[r]);
        if (rc != MO_OK)
            tu_report("%s: %s", zsock_role_name((zsock_role_t)r), mo_last_error());
        CU_ASSERT_FATAL(rc == MO_OK);
    }
    CU_ASSERT_FATAL(zsock_open(g_ctx, ZS_REWARD_SERVER, t, &o, 1, &s[ZS_ROLE_COUNT]) == MO_OK);
    int64_t max = 0;
    size_t n = sizeof max;
    zmq_getsockopt(s[ZS_LEARNER_SINK], ZMQ_MAXMSGSIZE, &max, &n);
    CU_ASSERT(max == 65536);

    msg_t m, got;
    zsock_peer_t from;
    hello(&m, "rollout-0");
    CU_ASSERT(zsock_send_msg(s[ZS_WORKER_CONTROL], NULL, &m, 0) == 1);
    CU_ASSERT(recv_one(s[ZS_LEARNER_CONTROL], &from, &got, MSG_HELLO));
    msg_free(&got);
    msg_t wr;
    msg_init(&wr);
    wr.type = MSG_WORK_REQUEST;
    wr.work_request = (msg_work_request_t){"rollout-0", 2};
    CU_ASSERT(zsock_send_msg(s[ZS_ROLLOUT_WORK], NULL, &wr, 0) == 1);
    CU_ASSERT(recv_one(s[ZS_LEARNER_WORK], &from, &got, MSG_WORK_REQUEST));
    msg_free(&got);
    CU_ASSERT(zsock_send_msg(s[ZS_ROLLOUT_SINK], NULL, &m, 0) == 1);
    CU_ASSERT(recv_one(s[ZS_LEARNER_SINK], NULL, &got, MSG_HELLO));
    msg_free(&got);
    /* round robin over the two reward workers: one each */
    CU_ASSERT(zsock_send_msg(s[ZS_ROLLOUT_REWARD], NULL, &m, 0) == 1);
    CU_ASSERT(zsock_send_msg(s[ZS_ROLLOUT_REWARD], NULL, &m, 0) == 1);
    CU_ASSERT(recv_one(s[ZS_REWARD_SERVER], &from, &got, MSG_HELLO));
    msg_free(&got);
    CU_ASSERT(recv_one(s[ZS_ROLE_COUNT], &from, &got, MSG_HELLO));
    msg_free(&got);
    /* PUB/SUB: publish until the subscription has arrived */
    int received = 0;
    for (int i = 0; i < 200 && !received; i++) {
        CU_ASSERT(zsock_send_msg(s[ZS_LEARNER_WEIGHTS], NULL, &m, 0) == 1);
        if (zsock_wait(s[ZS_ROLLOUT_WEIGHTS], 50) == 1) {
            received = zsock_recv_msg(s[ZS_ROLLOUT_WEIGHTS], NULL, &got, MSG_HELLO, 0) == 1;
            msg_free(&got);
        }
    }
    CU_ASSERT(received);
    void *none = (void *)1;
    CU_ASSERT(zsock_open(g_ctx, ZS_ROLLOUT_REWARD, t, &o, 0, &none) == MO_EINVAL && !none);
    for (int r = 0; r <= ZS_ROLE_COUNT; r++)
        zsock_close(&s[r]);
    config_free(&cfg);
}

/* ---- A daemon's context ---- */

static void test_ctx(void) {
    moerl_config_t cfg;
    CU_ASSERT_FATAL(config_defaults(&cfg) == MO_OK);
    char val[700];
    snprintf(val, sizeof val, "ipc://%s/ctx-control", g_dir);
    CU_ASSERT_FATAL(config_set(&cfg, "transport.control", val) == MO_OK);
    snprintf(val, sizeof val, "ipc://%s/ctx-reward", g_dir);
    CU_ASSERT_FATAL(config_set(&cfg, "transport.reward", val) == MO_OK);
    CU_ASSERT_FATAL(config_set(&cfg, "transport.max_msg_bytes", "65536") == MO_OK);
    zsock_ctx_t srv, wrk;
    void *unopened = (void *)1;
    memset(&srv, 0, sizeof srv);
    CU_ASSERT(zsock_ctx_socket(&srv, ZS_LEARNER_CONTROL, 0, &unopened) == MO_ESTATE);
    CU_ASSERT(unopened == NULL);
    CU_ASSERT_FATAL(zsock_ctx_open(&srv, &cfg.transport, NULL, true) == MO_OK);
    CU_ASSERT(srv.zap == NULL && srv.opts.max_msg_bytes == 65536 && srv.opts.routing_id == NULL);
    CU_ASSERT_FATAL(zsock_ctx_open(&wrk, &cfg.transport, "reward-3", false) == MO_OK);
    CU_ASSERT(wrk.opts.routing_id && strcmp(wrk.opts.routing_id, "reward-3") == 0);
    void *control = NULL, *server = NULL, *dealer = NULL;
    srv.opts.linger_ms = wrk.opts.linger_ms = 0;
    CU_ASSERT_FATAL(zsock_ctx_socket(&srv, ZS_LEARNER_CONTROL, 0, &control) == MO_OK);
    CU_ASSERT_FATAL(zsock_ctx_socket(&wrk, ZS_REWARD_SERVER, 0, &server) == MO_OK);
    CU_ASSERT_FATAL(zsock_ctx_socket(&wrk, ZS_WORKER_CONTROL, 0, &dealer) == MO_OK);
    /* the DEALER carries the worker's routing id */
    msg_t m, got;
    zsock_peer_t from;
    hello(&m, "reward-3");
    CU_ASSERT(zsock_send_msg(dealer, NULL, &m, 0) == 1);
    CU_ASSERT_FATAL(recv_one(control, &from, &got, MSG_HELLO));
    CU_ASSERT(from.len == 8 && memcmp(from.id, "reward-3", 8) == 0);
    msg_free(&got);
    /* at most ZSOCK_CTX_MAX_SOCKETS */
    void *more[ZSOCK_CTX_MAX_SOCKETS];
    int opened = 0;
    for (int i = 0; i < ZSOCK_CTX_MAX_SOCKETS; i++)
        if (zsock_ctx_socket(&wrk, ZS_ROLLOUT_SINK, 0, &more[i]) == MO_OK)
            opened++;
    CU_ASSERT_EQUAL(opened, ZSOCK_CTX_MAX_SOCKETS - 2);
    CU_ASSERT(strstr(mo_last_error(), "more than 8 sockets") != NULL);
    /* one call closes every socket (pointers cleared) and the context */
    zsock_ctx_close(&wrk);
    CU_ASSERT(server == NULL && dealer == NULL && more[0] == NULL && wrk.ctx == NULL);
    zsock_ctx_close(&srv);
    CU_ASSERT(control == NULL && srv.ctx == NULL);
    zsock_ctx_close(&srv);
    /* a bad routing id, and an allow-list without CURVE, leave nothing open */
    char big[300];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    CU_ASSERT(zsock_ctx_open(&wrk, &cfg.transport, big, false) == MO_EINVAL && !wrk.ctx);
    CU_ASSERT_FATAL(config_set(&cfg, "transport.curve_allowed_clients", g_dir) == MO_OK);
    CU_ASSERT(zsock_ctx_open(&srv, &cfg.transport, NULL, true) == MO_ECONFIG && !srv.ctx);
    config_free(&cfg);
}

/* ---- moerl keys gen ---- */

static int run_cmd(const char *args) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' %s >/dev/null 2>&1", tu_moerl_exe(), args);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_keys_cli(void) {
    char args[1500], key[700], pub[700], k1[41], k2[41];
    snprintf(args, sizeof args, "keys gen --out '%s/cli' --name node1", g_dir);
    CU_ASSERT_FATAL(run_cmd(args) == 0);
    snprintf(key, sizeof key, "%s/cli/node1.key", g_dir);
    snprintf(pub, sizeof pub, "%s/cli/node1.pub", g_dir);
    CU_ASSERT(file_mode(key) == 0600 && file_mode(pub) == 0644);
    CU_ASSERT(zsock_curve_read_key(key, true, k1) == MO_OK);
    CU_ASSERT(zsock_curve_read_key(pub, false, k2) == MO_OK);
    char derived[41];
    CU_ASSERT(zmq_curve_public(derived, k1) == 0 && strcmp(derived, k2) == 0);
    CU_ASSERT(run_cmd(args) == 1); /* exists */
    snprintf(args, sizeof args, "keys gen --out '%s/cli' --name node1 --force", g_dir);
    CU_ASSERT(run_cmd(args) == 0);
    CU_ASSERT(zsock_curve_read_key(pub, false, derived) == MO_OK && strcmp(derived, k2) != 0);
    CU_ASSERT(run_cmd("keys gen") == 2);
    CU_ASSERT(run_cmd("keys") == 2);
    CU_ASSERT(run_cmd("keys --help") == 0);
}

int main(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0)
        return 1;
    g_ctx = zmq_ctx_new();
    CU_TestInfo tests[] = {
        {"endpoint syntax, locality, numbering", test_endpoints},
        {"binding beyond loopback needs CURVE", test_remote_policy},
        {"ROUTER/DEALER exchange", test_router_dealer},
        {"ZMQ_MAXMSGSIZE refuses oversized, socket keeps working", test_max_msg_size},
        {"endpoint already in use", test_in_use},
        {"CURVE handshake with generated keys; wrong key fails", test_curve},
        {"every socket role from a config", test_roles},
        {"a daemon's context: options, routing id, closing", test_ctx},
        {"moerl keys gen", test_keys_cli},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("zsock", tests);
    zmq_ctx_term(g_ctx);
    tu_rmtree(g_dir);
    return rc;
}
