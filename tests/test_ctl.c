/* Tests for `moerl ctl` against a stand-in learner (a ROUTER in a thread of this
 * process, on loopback): hello then the request, every command with its arguments, the
 * text and JSON output of status, refusals and error replies, CURVE keys from a
 * config (and the wrong key failing), no answer within the timeout, usage errors. */
#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cli/commands.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/zsock.h"

extern const cli_command_t cmd_ctl;

/* The stand-in learner: answers until it has served `serve` ctl requests. */
typedef struct fake {
    void *ctx, *sock;
    char endpoint[128];
    int serve;
    int hellos;
    int requests;
    msg_ctl_cmd_t last_cmd;
    char last_args[512]; /* "k=v;k=v;" */
    char hello_role[16];
    pthread_t th;
} fake_t;

static void reply_to(fake_t *f, const zsock_peer_t *to, const msg_ctl_request_t *rq) {
    msg_t r;
    msg_init(&r);
    msg_stat_t st[6];
    if (rq->command == MSG_CTL_CHECKPOINT) {
        r.type = MSG_ERROR;
        r.error = (msg_error_t){MO_EIO, "disk full", "ctl_request", false, 0};
    } else {
        r.type = MSG_CTL_REPLY;
        r.ctl_reply.ok = rq->command != MSG_CTL_PAUSE;
        r.ctl_reply.message = rq->command == MSG_CTL_PAUSE ? "already paused" : "ok: done";
        if (rq->command == MSG_CTL_STATUS) {
            st[0] = (msg_stat_t){"step", MSG_VAL_INT, 12, 0, NULL};
            st[1] = (msg_stat_t){"rollout.0.tokens_per_s", MSG_VAL_FLOAT, 0, 1234.5, NULL};
            st[2] = (msg_stat_t){"reward.version", MSG_VAL_INT, 3, 0, NULL};
            st[3] = (msg_stat_t){"paused", MSG_VAL_BOOL, 0, 0, NULL};
            st[4] = (msg_stat_t){"sync_latency_ms", MSG_VAL_FLOAT, 0, NAN, NULL};
            st[5] = (msg_stat_t){"job", MSG_VAL_STR, 0, 0, "quick"};
            r.ctl_reply.status = st;
            r.ctl_reply.n_status = 6;
        }
    }
    CU_ASSERT(zsock_send_msg(f->sock, to, &r, 0) == 1);
}

static void *fake_main(void *arg) {
    fake_t *f = arg;
    while (f->requests < f->serve) {
        if (zsock_wait(f->sock, 15000) != 1)
            break;
        zsock_peer_t from;
        msg_t m;
        if (zsock_recv_msg(f->sock, &from, &m, MSG_NONE, ZMQ_DONTWAIT) != 1)
            continue;
        if (m.type == MSG_HELLO) {
            f->hellos++;
            snprintf(f->hello_role, sizeof f->hello_role, "%s", msg_role_name(m.hello.role));
            msg_t w;
            msg_init(&w);
            w.type = MSG_WELCOME;
            w.welcome.job = "quick";
            w.welcome.model_path = "";
            w.welcome.group_size = 4;
            w.welcome.sampling = (msg_sampling_t){1.0, 1.0, 0, 0.0, 16, NULL, 0, 1};
            w.welcome.heartbeat_ms = 1000;
            CU_ASSERT(zsock_send_msg(f->sock, &from, &w, 0) == 1);
        } else if (m.type == MSG_CTL_REQUEST) {
            f->requests++;
            f->last_cmd = m.ctl_request.command;
            f->last_args[0] = 0;
            for (uint32_t i = 0; i < m.ctl_request.args.n; i++) {
                size_t len = strlen(f->last_args);
                snprintf(f->last_args + len, sizeof f->last_args - len, "%s=%s;",
                         m.ctl_request.args.items[i].key, m.ctl_request.args.items[i].value);
            }
            reply_to(f, &from, &m.ctl_request);
        }
        msg_free(&m);
    }
    return NULL;
}

static void fake_start(fake_t *f, int serve, const zsock_opts_t *o) {
    memset(f, 0, sizeof *f);
    f->serve = serve;
    f->ctx = zmq_ctx_new();
    CU_ASSERT_FATAL(f->ctx != NULL);
    zsock_opts_t plain;
    zsock_opts_default(&plain);
    plain.linger_ms = 0;
    CU_ASSERT_FATAL(zsock_bind(f->ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", o ? o : &plain, &f->sock) ==
                    MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(f->sock, f->endpoint, sizeof f->endpoint) == MO_OK);
    CU_ASSERT_FATAL(pthread_create(&f->th, NULL, fake_main, f) == 0);
}

static void fake_stop(fake_t *f) {
    pthread_join(f->th, NULL);
    zsock_close(&f->sock);
    zmq_ctx_term(f->ctx);
}

/* Runs `moerl ctl ARGS...` in this process, capturing stdout and stderr. */
typedef struct captured {
    int status;
    char out[8192], err[8192];
} captured_t;

static void read_fd(int fd, char *buf, size_t cap) {
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, buf, cap - 1);
    buf[n > 0 ? n : 0] = 0;
}

static void run_ctl(captured_t *c, const char *const *args) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "ctl";
    for (int i = 0; args[i] && argc < 31; i++)
        argv[argc++] = (char *)args[i];
    argv[argc] = NULL;
    FILE *fo = tmpfile(), *fe = tmpfile();
    CU_ASSERT_FATAL(fo && fe);
    fflush(stdout);
    fflush(stderr);
    int so = dup(1), se = dup(2);
    dup2(fileno(fo), 1);
    dup2(fileno(fe), 2);
    c->status = cmd_ctl.run(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(so);
    close(se);
    read_fd(fileno(fo), c->out, sizeof c->out);
    read_fd(fileno(fe), c->err, sizeof c->err);
    fclose(fo);
    fclose(fe);
}

static void test_commands(void) {
    fake_t f;
    fake_start(&f, 7, NULL);
    captured_t c;
    const char *status[] = {"--endpoint", f.endpoint, "status", NULL};
    run_ctl(&c, status);
    CU_ASSERT_EQUAL(c.status, 0);
    CU_ASSERT_EQUAL(f.last_cmd, MSG_CTL_STATUS);
    CU_ASSERT_STRING_EQUAL(f.hello_role, "ctl");
    CU_ASSERT(strstr(c.out, "ok: done\n") != NULL);
    CU_ASSERT(strstr(c.out, "  step                    12\n") != NULL);
    CU_ASSERT(strstr(c.out, "  rollout.0.tokens_per_s  1234.5\n") != NULL);
    CU_ASSERT(strstr(c.out, "  paused                  false\n") != NULL);
    CU_ASSERT(strstr(c.out, "  sync_latency_ms         nan\n") != NULL);
    CU_ASSERT(strstr(c.out, "  job                     quick\n") != NULL);

    const char *json[] = {"status", "--json", "--endpoint", f.endpoint, NULL};
    run_ctl(&c, json);
    CU_ASSERT_EQUAL(c.status, 0);
    cJSON *root = cJSON_Parse(c.out);
    CU_ASSERT_FATAL(root != NULL);
    cJSON *st = cJSON_GetObjectItem(root, "status");
    CU_ASSERT(cJSON_IsTrue(cJSON_GetObjectItem(root, "ok")));
    CU_ASSERT_EQUAL(cJSON_GetObjectItem(st, "step")->valuedouble, 12);
    CU_ASSERT(cJSON_IsNull(cJSON_GetObjectItem(st, "sync_latency_ms")));
    CU_ASSERT(cJSON_IsFalse(cJSON_GetObjectItem(st, "paused")));
    CU_ASSERT_STRING_EQUAL(cJSON_GetObjectItem(st, "job")->valuestring, "quick");
    cJSON_Delete(root);

    const char *swap[] = {"--endpoint", f.endpoint,   "swap-reward", "arith_partial",
                          "--plugin",   "/x/libr.so", NULL};
    run_ctl(&c, swap);
    CU_ASSERT_EQUAL(c.status, 0);
    CU_ASSERT_EQUAL(f.last_cmd, MSG_CTL_SWAP_REWARD);
    CU_ASSERT_STRING_EQUAL(f.last_args, "function=arith_partial;plugin=/x/libr.so;");

    const char *pause[] = {"--endpoint", f.endpoint, "pause", NULL};
    run_ctl(&c, pause);
    CU_ASSERT_EQUAL(c.status, 1);
    CU_ASSERT(strstr(c.err, "the learner refused pause: already paused") != NULL);

    const char *ckpt[] = {"--endpoint", f.endpoint, "checkpoint", NULL};
    run_ctl(&c, ckpt);
    CU_ASSERT_EQUAL(c.status, 1);
    CU_ASSERT(strstr(c.err, "answered checkpoint with an error: disk full") != NULL);

    const char *resume[] = {"--endpoint", f.endpoint, "resume", NULL};
    run_ctl(&c, resume);
    CU_ASSERT(c.status == 0 && f.last_cmd == MSG_CTL_RESUME && f.last_args[0] == 0);
    const char *stop[] = {"--endpoint", f.endpoint, "stop", NULL};
    run_ctl(&c, stop);
    CU_ASSERT(c.status == 0 && f.last_cmd == MSG_CTL_STOP);
    fake_stop(&f);
    CU_ASSERT_EQUAL(f.requests, 7);
    CU_ASSERT_EQUAL(f.hellos, 7);
}

static void test_no_answer_and_usage(void) {
    /* A port that was free a moment ago: nothing answers there. */
    void *ctx = zmq_ctx_new();
    void *s = NULL;
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    char ep[128];
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_ROUTER, "tcp://127.0.0.1:*", &o, &s) == MO_OK);
    CU_ASSERT_FATAL(zsock_last_endpoint(s, ep, sizeof ep) == MO_OK);
    zsock_close(&s);
    zmq_ctx_term(ctx);
    captured_t c;
    const char *none[] = {"--endpoint", ep, "--timeout", "300", "status", NULL};
    run_ctl(&c, none);
    CU_ASSERT_EQUAL(c.status, 1);
    CU_ASSERT(strstr(c.err, "no answer from the learner at") != NULL);
    CU_ASSERT(strstr(c.err, "within 0.3 s") != NULL);

    static const char *const bad[][5] = {
        {"status", "extra", NULL},
        {"swap-reward", NULL},
        {"frobnicate", NULL},
        {NULL},
        {"status", "--plugin", "x.so", NULL},
        {"status", "--timeout", "0", NULL},
        {"status", "--set", "run.seed=1", NULL},
        {"status", "--endpoint", NULL},
        {"--endpoint", "udp://1.2.3.4:5", "status", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        run_ctl(&c, bad[i]);
        if (c.status == 0)
            tu_report("case %zu accepted", i);
        CU_ASSERT(c.status != 0);
        CU_ASSERT(strstr(c.err, "moerl ctl: ") != NULL);
    }
}

static void test_curve_from_config(void) {
    char dir[256];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    char kdir[300];
    snprintf(kdir, sizeof kdir, "%s/keys", dir);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "server", false, NULL) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(kdir, "other", false, NULL) == MO_OK);
    char cfg[600], wrong[600], yaml[4096];
    snprintf(cfg, sizeof cfg, "%s/job.yaml", dir);
    snprintf(wrong, sizeof wrong, "%s/wrong.yaml", dir);
    /* The job's processes share one keypair; ctl connects as a client of it. */
    for (int k = 0; k < 2; k++) {
        snprintf(yaml, sizeof yaml,
                 "transport:\n  curve_secret_key: %s/server.key\n"
                 "  curve_public_key: %s/server.pub\n  curve_server_key: %s/%s.pub\n",
                 kdir, kdir, kdir, k == 0 ? "server" : "other");
        FILE *f = fopen(k == 0 ? cfg : wrong, "w");
        CU_ASSERT_FATAL(f != NULL);
        fputs(yaml, f);
        fclose(f);
    }
    moerl_config_t c;
    CU_ASSERT_FATAL(config_load(&c, cfg, NULL, 0, NULL) == MO_OK);
    zsock_opts_t server;
    CU_ASSERT_FATAL(zsock_opts_from_config(&server, &c.transport) == MO_OK);
    config_free(&c);
    server.linger_ms = 0;
    fake_t f;
    fake_start(&f, 1, &server);
    captured_t out;
    const char *bad_key[] = {"--config",  wrong, "--endpoint", f.endpoint,
                             "--timeout", "500", "status",     NULL};
    run_ctl(&out, bad_key);
    CU_ASSERT_EQUAL(out.status, 1);
    CU_ASSERT(strstr(out.err, "CURVE keys") != NULL);
    CU_ASSERT_EQUAL(f.requests, 0); /* nothing got through the handshake */
    const char *good[] = {"--config", cfg, "--endpoint", f.endpoint, "status", NULL};
    run_ctl(&out, good);
    CU_ASSERT_EQUAL(out.status, 0);
    fake_stop(&f);
    CU_ASSERT_EQUAL(f.requests, 1);
    /* A key file that is missing fails at once, naming the key. */
    char missing[700];
    snprintf(missing, sizeof missing, "transport.curve_secret_key=%s/nope.key", kdir);
    const char *nokey[] = {"--config", cfg, "--set", missing, "status", NULL};
    run_ctl(&out, nokey);
    CU_ASSERT_EQUAL(out.status, 1);
    CU_ASSERT(strstr(out.err, "curve_secret_key") != NULL);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"commands", test_commands},
        {"no answer and usage", test_no_answer_and_usage},
        {"curve from config", test_curve_from_config},
        CU_TEST_INFO_NULL,
    };
    return tu_main("ctl", tests);
}
