/* Tests for CURVE client authentication with real sockets on loopback: allow-list files
 * and directories (comments, repeats, bad keys naming file and line, empty lists), a
 * ZAP handler admitting a listed client's messages and refusing (and counting) an
 * unlisted client's, whose messages never arrive, one handler per context, and a
 * daemon context (zsock_ctx_open) built from a transport config with an allow-list. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "core/config.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/zap.h"
#include "transport/zsock.h"

#define WAIT_MS 10000 /* generous: only reached when something is broken */

static char g_dir[512];

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_allowlist(void) {
    char a_pub[41], a_sec[41], b_pub[41], b_sec[41];
    CU_ASSERT_FATAL(zmq_curve_keypair(a_pub, a_sec) == 0);
    CU_ASSERT_FATAL(zmq_curve_keypair(b_pub, b_sec) == 0);
    char path[700], text[512];
    /* a file: comments, blank lines, spaces, a repeat */
    snprintf(path, sizeof path, "%s/allowed.txt", g_dir);
    snprintf(text, sizeof text, "# rollout workers\n\n  %s  \n%s\r\n# again\n%s\n", a_pub, b_pub,
             a_pub);
    write_file(path, text);
    zap_key_t *keys = NULL;
    int n = -1;
    CU_ASSERT_FATAL(zap_allowlist_load(path, &keys, &n) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(n, 2);
    CU_ASSERT((!strcmp(keys[0], a_pub) && !strcmp(keys[1], b_pub)) ||
              (!strcmp(keys[0], b_pub) && !strcmp(keys[1], a_pub)));
    free(keys);
    /* a bad key: the file and line */
    snprintf(text, sizeof text, "%s\nnot-a-key\n", a_pub);
    write_file(path, text);
    CU_ASSERT(zap_allowlist_load(path, &keys, &n) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "allowed.txt:2") != NULL);
    CU_ASSERT(keys == NULL && n == 0);
    write_file(path, "# nobody\n");
    CU_ASSERT(zap_allowlist_load(path, &keys, &n) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "no CURVE public key") != NULL);
    /* a directory of .pub files (other files ignored) */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/clients", g_dir);
    CU_ASSERT_FATAL(zsock_curve_keygen(dir, "rollout-0", false, a_pub) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(dir, "reward-0", false, b_pub) == MO_OK);
    snprintf(path, sizeof path, "%s/README", dir);
    write_file(path, "not keys\n");
    CU_ASSERT_FATAL(zap_allowlist_load(dir, &keys, &n) == MO_OK);
    CU_ASSERT_EQUAL(n, 2);
    free(keys);
    snprintf(path, sizeof path, "%s/missing", g_dir);
    CU_ASSERT(zap_allowlist_load(path, &keys, &n) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "missing") != NULL);
}

static void curve_opts(zsock_opts_t *o, const char *pub, const char *sec, const char *server) {
    zsock_opts_default(o);
    o->linger_ms = 0;
    o->reconnect_ms = 20;
    o->reconnect_max_ms = 200;
    o->curve = true;
    snprintf(o->curve_public, sizeof o->curve_public, "%s", pub);
    snprintf(o->curve_secret, sizeof o->curve_secret, "%s", sec);
    snprintf(o->curve_server, sizeof o->curve_server, "%s", server);
}

/* Waits until the handler refused at least n handshakes; 1 when it did. */
static int wait_refused(const zap_t *z, uint64_t n) {
    for (int i = 0; i < WAIT_MS / 10; i++) {
        if (zap_refused(z) >= n)
            return 1;
        zmq_poll(NULL, 0, 10);
    }
    return 0;
}

static void test_handler(void) {
    char s_pub[41], s_sec[41], a_pub[41], a_sec[41], b_pub[41], b_sec[41];
    CU_ASSERT_FATAL(zmq_curve_keypair(s_pub, s_sec) == 0);
    CU_ASSERT_FATAL(zmq_curve_keypair(a_pub, a_sec) == 0);
    CU_ASSERT_FATAL(zmq_curve_keypair(b_pub, b_sec) == 0);
    void *ctx = zmq_ctx_new();
    zap_key_t allowed[1];
    memcpy(allowed[0], a_pub, 41);
    zap_t *z = NULL;
    CU_ASSERT_FATAL(zap_start(ctx, allowed, 1, &z) == MO_OK);
    zap_t *z2 = NULL;
    CU_ASSERT(zap_start(ctx, allowed, 1, &z2) == MO_ESTATE && z2 == NULL);

    zsock_opts_t so, ao, bo;
    curve_opts(&so, s_pub, s_sec, "");
    curve_opts(&ao, a_pub, a_sec, s_pub);
    curve_opts(&bo, b_pub, b_sec, s_pub);
    ao.routing_id = "allowed";
    bo.routing_id = "intruder";
    void *server = NULL, *a = NULL, *b = NULL;
    char ep[256];
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &so, &server) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(server, ep, sizeof ep) == MO_OK);

    /* the unlisted client first: refused and counted; its message never arrives */
    CU_ASSERT_FATAL(zsock_connect(ctx, ZMQ_DEALER, ep, &bo, &b) == MO_OK);
    CU_ASSERT(zsock_send(b, NULL, "from b", 6, ZMQ_DONTWAIT) == 1);
    CU_ASSERT_FATAL(wait_refused(z, 1));
    zap_key_t last;
    zap_last_refused(z, last);
    CU_ASSERT_STRING_EQUAL(last, b_pub);
    CU_ASSERT_EQUAL(zap_admitted(z), 0);
    /* the listed client: admitted, its message is the first one the server gets */
    CU_ASSERT_FATAL(zsock_connect(ctx, ZMQ_DEALER, ep, &ao, &a) == MO_OK);
    CU_ASSERT(zsock_send(a, NULL, "from a", 6, 0) == 1);
    CU_ASSERT_FATAL(zsock_wait(server, WAIT_MS) == 1);
    zsock_msg_t m;
    CU_ASSERT_FATAL(zsock_recv(server, &m, ZMQ_DONTWAIT) == 1);
    CU_ASSERT(m.from.len == 7 && memcmp(m.from.id, "allowed", 7) == 0);
    CU_ASSERT(zsock_msg_size(&m) == 6 && memcmp(zsock_msg_data(&m), "from a", 6) == 0);
    zsock_msg_close(&m);
    CU_ASSERT(zap_admitted(z) >= 1);
    /* and the server answers it */
    CU_ASSERT(zsock_send(server, &m.from, "ok", 2, 0) == 1);
    CU_ASSERT_FATAL(zsock_wait(a, WAIT_MS) == 1);
    CU_ASSERT_FATAL(zsock_recv(a, &m, ZMQ_DONTWAIT) == 1);
    zsock_msg_close(&m);
    /* nothing of the intruder was queued before or after */
    CU_ASSERT(!zsock_readable(server));
    CU_ASSERT_EQUAL(zap_refused(z), 1);

    /* a socket without CURVE in the same context still works (NULL mechanism) */
    void *p = NULL, *q = NULL;
    zsock_opts_t po;
    zsock_opts_default(&po);
    po.linger_ms = 0;
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_PULL, "tcp://127.0.0.1:*", &po, &p) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(p, ep, sizeof ep) == MO_OK);
    CU_ASSERT_FATAL(zsock_connect(ctx, ZMQ_PUSH, ep, &po, &q) == MO_OK);
    CU_ASSERT(zsock_send(q, NULL, "plain", 5, 0) == 1);
    CU_ASSERT(zsock_wait(p, WAIT_MS) == 1);

    zsock_close(&p);
    zsock_close(&q);
    zsock_close(&a);
    zsock_close(&b);
    zsock_close(&server);
    zap_stop(&z);
    CU_ASSERT(z == NULL);
    zap_stop(&z); /* safe twice */
    zmq_ctx_term(ctx);
}

static void test_ctx_from_config(void) {
    char kdir[600], skey[700], spub[700], ckey[700], allow[700];
    char s_pub[41], c_pub[41], x_pub[41];
    snprintf(kdir, sizeof kdir, "%s/ctxkeys", g_dir);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "server", false, s_pub) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "client", false, c_pub) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "other", false, x_pub) == MO_OK);
    snprintf(skey, sizeof skey, "%s/server.key", kdir);
    snprintf(spub, sizeof spub, "%s/server.pub", kdir);
    snprintf(ckey, sizeof ckey, "%s/client.key", kdir);
    snprintf(allow, sizeof allow, "%s/allowed", g_dir);
    char text[128];
    snprintf(text, sizeof text, "%s\n", c_pub);
    write_file(allow, text);

    config_transport_t t;
    memset(&t, 0, sizeof t);
    t.max_msg_bytes = 1 << 20;
    t.curve_public_key = "";
    t.curve_server_key = "";
    t.curve_secret_key = "";
    t.curve_allowed_clients = allow;
    zsock_ctx_t c;
    /* an allow-list needs CURVE */
    CU_ASSERT(zsock_ctx_open(&c, &t, NULL, true) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "curve_allowed_clients") != NULL);
    CU_ASSERT(c.ctx == NULL);
    t.curve_secret_key = skey;
    CU_ASSERT_FATAL(zsock_ctx_open(&c, &t, NULL, true) == MO_OK);
    CU_ASSERT(c.zap != NULL && c.n_allowed == 1 && c.opts.curve);
    CU_ASSERT(strcmp(c.opts.curve_public, s_pub) == 0);
    /* a client process does not load the list */
    zsock_ctx_t cc;
    t.curve_secret_key = ckey;
    t.curve_server_key = spub;
    CU_ASSERT_FATAL(zsock_ctx_open(&cc, &t, "rollout-1", false) == MO_OK);
    CU_ASSERT(cc.zap == NULL && cc.n_allowed == 0 && zsock_ctx_refused(&cc) == 0);

    /* the allowed client talks to a socket of the server context */
    void *server = NULL, *cli = NULL;
    char ep[256];
    c.opts.linger_ms = cc.opts.linger_ms = 0;
    CU_ASSERT_FATAL(zsock_bind(c.ctx, ZMQ_PULL, "tcp://127.0.0.1:*", &c.opts, &server) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(server, ep, sizeof ep) == MO_OK);
    CU_ASSERT_FATAL(zsock_connect(cc.ctx, ZMQ_PUSH, ep, &cc.opts, &cli) == MO_OK);
    CU_ASSERT(zsock_send(cli, NULL, "hi", 2, 0) == 1);
    CU_ASSERT(zsock_wait(server, WAIT_MS) == 1);
    CU_ASSERT_EQUAL(zsock_ctx_refused(&c), 0);
    zsock_close(&cli);
    zsock_close(&server);
    zsock_ctx_close(&cc);
    zsock_ctx_close(&c);
    CU_ASSERT(c.ctx == NULL && c.zap == NULL);
    zsock_ctx_close(&c); /* safe twice */
    /* a bad allow-list fails the open and leaves nothing behind */
    write_file(allow, "garbage\n");
    t.curve_secret_key = skey;
    t.curve_server_key = "";
    CU_ASSERT(zsock_ctx_open(&c, &t, NULL, true) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "transport.curve_allowed_clients") != NULL);
    CU_ASSERT(c.ctx == NULL);
}

int main(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0)
        return 1;
    CU_TestInfo tests[] = {
        {"allow-list files and directories", test_allowlist},
        {"ZAP handler admits listed clients, refuses others", test_handler},
        {"daemon context from a transport config", test_ctx_from_config},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("zap", tests);
    tu_rmtree(g_dir);
    return rc;
}
