/* cmd_ctl: `moerl ctl`: talks to a running job's learner on its control endpoint
 * (status, swap-reward, checkpoint, pause, resume, stop) with ctl_request/ctl_reply. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cli/commands.h"
#include "core/config.h"
#include "core/status.h"
#include "transport/codec.h"
#include "transport/msg.h"
#include "transport/zsock.h"

#define CTL_DEFAULT_TIMEOUT_MS 5000

static void ctl_help(FILE *out) {
    fputs("usage: moerl ctl [--endpoint E | --config CONFIG] COMMAND [options]\n"
          "\n"
          "Talks to the learner of a running job on its control endpoint.\n"
          "\n"
          "commands:\n"
          "  status                   workers, versions, queue depths, throughput and\n"
          "                           malformed-message counts, as the learner reports them\n"
          "  swap-reward SPEC         make the reward workers load another reward function\n"
          "    [--plugin PATH]        (a built-in name or spec, optionally from a plugin\n"
          "                           shared library); groups scored afterwards carry the\n"
          "                           new reward version\n"
          "  checkpoint               save a checkpoint now\n"
          "  pause                    stop handing out prompts (training stops after the\n"
          "                           groups in flight)\n"
          "  resume                   hand out prompts again\n"
          "  stop                     end the job: the learner saves a checkpoint and exits\n"
          "\n"
          "options:\n"
          "  --endpoint E             the learner's control endpoint (tcp://HOST:PORT or\n"
          "                           ipc://PATH)\n"
          "  --config CONFIG          take transport.control and the CURVE keys from a job\n"
          "                           config (with --endpoint: only the keys)\n"
          "  --set key=value          override a config key (repeatable; with --config)\n"
          "  --timeout MS             how long to wait for the answer (default 5000)\n"
          "  --json                   print the reply as one JSON object\n"
          "  -h, --help               this help\n"
          "\n"
          "Without --endpoint or --config the default endpoint of a job config is used\n"
          "(tcp://127.0.0.1:5570).\n"
          "\n"
          "exit status: 0 the learner carried the command out, 1 it refused, did not\n"
          "answer or an error occurred, 2 usage error\n",
          out);
}

#define CTL_MAX_SETS 64

typedef struct ctl_args {
    const char *endpoint, *config, *plugin, *spec;
    const char *sets[CTL_MAX_SETS];
    int nsets;
    int timeout_ms;
    bool json;
    msg_ctl_cmd_t cmd;
    bool have_cmd;
} ctl_args_t;

static int ctl_usage(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl ctl: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl ctl --help)\n");
    return 2;
}

static int parse_command(const char *word, msg_ctl_cmd_t *cmd) {
    static const struct {
        const char *word;
        msg_ctl_cmd_t cmd;
    } cmds[] = {{"status", MSG_CTL_STATUS},         {"swap-reward", MSG_CTL_SWAP_REWARD},
                {"checkpoint", MSG_CTL_CHECKPOINT}, {"pause", MSG_CTL_PAUSE},
                {"resume", MSG_CTL_RESUME},         {"stop", MSG_CTL_STOP}};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        if (!strcmp(word, cmds[i].word)) {
            *cmd = cmds[i].cmd;
            return 0;
        }
    }
    return -1;
}

static int parse_args(int argc, char **argv, ctl_args_t *a) {
    memset(a, 0, sizeof *a);
    a->timeout_ms = CTL_DEFAULT_TIMEOUT_MS;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        bool takes = !strcmp(o, "--endpoint") || !strcmp(o, "--config") || !strcmp(o, "--plugin") ||
                     !strcmp(o, "--timeout") || !strcmp(o, "--set");
        if (takes && i + 1 >= argc)
            return ctl_usage("%s needs a value", o);
        if (!strcmp(o, "--endpoint")) {
            a->endpoint = argv[++i];
        } else if (!strcmp(o, "--config")) {
            a->config = argv[++i];
        } else if (!strcmp(o, "--plugin")) {
            a->plugin = argv[++i];
        } else if (!strcmp(o, "--set")) {
            if (a->nsets == CTL_MAX_SETS)
                return ctl_usage("more than %s --set options", "64");
            a->sets[a->nsets++] = argv[++i];
        } else if (!strcmp(o, "--timeout")) {
            char *end;
            errno = 0;
            long v = strtol(argv[++i], &end, 10);
            if (!*argv[i] || *end || errno || v < 1 || v > 3600000)
                return ctl_usage("--timeout: '%s' is not a number of milliseconds (1..3600000)",
                                 argv[i]);
            a->timeout_ms = (int)v;
        } else if (!strcmp(o, "--json")) {
            a->json = true;
        } else if (o[0] == '-') {
            return ctl_usage("unknown option '%s'", o);
        } else if (!a->have_cmd) {
            if (parse_command(o, &a->cmd) != 0)
                return ctl_usage("unknown command '%s'", o);
            a->have_cmd = true;
        } else if (a->cmd == MSG_CTL_SWAP_REWARD && !a->spec) {
            a->spec = o;
        } else {
            return ctl_usage("unexpected argument '%s'", o);
        }
    }
    if (!a->have_cmd)
        return ctl_usage("%s", "a command is required");
    if (a->cmd == MSG_CTL_SWAP_REWARD && (!a->spec || !*a->spec))
        return ctl_usage("%s", "swap-reward needs the reward function: swap-reward SPEC");
    if (a->plugin && a->cmd != MSG_CTL_SWAP_REWARD)
        return ctl_usage("%s", "--plugin goes with swap-reward");
    if (a->nsets && !a->config)
        return ctl_usage("%s", "--set needs --config");
    return 0;
}

/* The endpoint and socket options: from the config (keys, limits), --endpoint on top. */
static int resolve_transport(const ctl_args_t *a, char *endpoint, size_t cap, zsock_opts_t *o) {
    moerl_config_t c;
    int rc;
    if (a->config) {
        rc = config_load(&c, a->config, a->sets, a->nsets, NULL);
    } else {
        rc = config_defaults(&c);
    }
    if (rc == MO_OK)
        rc = zsock_opts_from_config(o, &c.transport);
    if (rc == MO_OK)
        snprintf(endpoint, cap, "%s", a->endpoint ? a->endpoint : c.transport.control);
    config_free(&c);
    TRY(rc);
    o->linger_ms = 0;
    o->reconnect_ms = 100;
    o->reconnect_max_ms = 1000;
    return zsock_endpoint_check(endpoint, false);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Sends hello (role ctl) and the request, and waits for the ctl_reply (or an error),
 * skipping the welcome. *reply owns its memory (msg_free). */
static int exchange(const ctl_args_t *a, const char *endpoint, const zsock_opts_t *base,
                    msg_t *reply) {
    char id[32];
    snprintf(id, sizeof id, "ctl-%ld", (long)getpid());
    zsock_opts_t o = *base;
    o.routing_id = id;
    void *ctx = zmq_ctx_new();
    if (!ctx)
        return mo_errorf(MO_EIO, "cannot create a ZeroMQ context: %s", zmq_strerror(errno));
    void *s = NULL;
    int rc = zsock_connect(ctx, ZMQ_DEALER, endpoint, &o, &s);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    msg_t m;
    msg_init(&m);
    m.type = MSG_HELLO;
    m.hello = (msg_hello_t){MSG_ROLE_CTL, id, (int64_t)getpid(), host, "moerl " MOERL_VERSION};
    if (rc == MO_OK)
        rc = zsock_send_msg(s, NULL, &m, 0) == 1 ? MO_OK : mo_error_wrap(MO_EIO, "hello");
    msg_kv_t args[2];
    uint32_t nargs = 0;
    if (a->spec)
        args[nargs++] = (msg_kv_t){"function", a->spec};
    if (a->plugin)
        args[nargs++] = (msg_kv_t){"plugin", a->plugin};
    m.type = MSG_CTL_REQUEST;
    m.ctl_request = (msg_ctl_request_t){a->cmd, {args, nargs}};
    if (rc == MO_OK)
        rc = zsock_send_msg(s, NULL, &m, 0) == 1 ? MO_OK : mo_error_wrap(MO_EIO, "ctl_request");
    double deadline = now_ms() + a->timeout_ms;
    msg_init(reply);
    while (rc == MO_OK) {
        double left = deadline - now_ms();
        if (left < 1 || zsock_wait(s, (int)left) != 1) {
            rc = mo_errorf(MO_EIO,
                           "no answer from the learner at %s within %.1f s (is the job "
                           "running? is transport.control right%s?)",
                           endpoint, a->timeout_ms / 1000.0,
                           o.curve ? ", and are the CURVE keys the job's" : "");
            break;
        }
        int got = zsock_recv_msg(s, NULL, reply, MSG_NONE, ZMQ_DONTWAIT);
        if (got == 1 && (reply->type == MSG_CTL_REPLY || reply->type == MSG_ERROR))
            break;
        if (got < 0 && got != MO_EMALFORMED)
            rc = got;
        else if (got == MO_EMALFORMED)
            fprintf(stderr, "moerl ctl: ignored a malformed message: %s\n", mo_last_error());
        msg_free(reply); /* the welcome, or a stray */
    }
    zsock_close(&s);
    zmq_ctx_term(ctx);
    return rc;
}

static void print_value(FILE *out, const msg_stat_t *st) {
    switch (st->kind) {
    case MSG_VAL_INT: fprintf(out, "%lld", (long long)st->i); break;
    case MSG_VAL_BOOL: fputs(st->i ? "true" : "false", out); break;
    case MSG_VAL_FLOAT:
        if (isnan(st->f))
            fputs("nan", out);
        else
            fprintf(out, "%.6g", st->f);
        break;
    case MSG_VAL_STR: fputs(st->s, out); break;
    }
}

static void print_text(const msg_ctl_reply_t *r) {
    if (r->message && *r->message)
        printf("%s\n", r->message);
    int w = 0;
    for (uint32_t i = 0; i < r->n_status; i++) {
        int len = (int)strlen(r->status[i].key);
        if (len > w && len <= 48)
            w = len;
    }
    for (uint32_t i = 0; i < r->n_status; i++) {
        printf("  %-*s  ", w, r->status[i].key);
        print_value(stdout, &r->status[i]);
        putchar('\n');
    }
}

static int print_json(const msg_ctl_reply_t *r) {
    cJSON *root = cJSON_CreateObject(), *st = cJSON_CreateObject();
    if (!root || !st) {
        cJSON_Delete(root);
        cJSON_Delete(st);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    cJSON_AddBoolToObject(root, "ok", r->ok);
    cJSON_AddStringToObject(root, "message", r->message ? r->message : "");
    for (uint32_t i = 0; i < r->n_status; i++) {
        const msg_stat_t *s = &r->status[i];
        switch (s->kind) {
        case MSG_VAL_INT: cJSON_AddNumberToObject(st, s->key, (double)s->i); break;
        case MSG_VAL_BOOL: cJSON_AddBoolToObject(st, s->key, s->i != 0); break;
        case MSG_VAL_FLOAT:
            if (isfinite(s->f))
                cJSON_AddNumberToObject(st, s->key, s->f);
            else
                cJSON_AddNullToObject(st, s->key);
            break;
        case MSG_VAL_STR: cJSON_AddStringToObject(st, s->key, s->s); break;
        }
    }
    cJSON_AddItemToObject(root, "status", st);
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text)
        return mo_errorf(MO_ENOMEM, "out of memory");
    printf("%s\n", text);
    free(text);
    return MO_OK;
}

static int ctl_run(int argc, char **argv) {
    ctl_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    char endpoint[1024];
    zsock_opts_t o;
    rc = resolve_transport(&a, endpoint, sizeof endpoint, &o);
    if (rc < 0)
        return cli_fail("ctl", rc);
    msg_t reply;
    rc = exchange(&a, endpoint, &o, &reply);
    if (rc < 0)
        return cli_fail("ctl", rc);
    int status = 0;
    if (reply.type == MSG_ERROR) {
        fprintf(stderr, "moerl ctl: the learner answered %s with an error: %s\n",
                msg_ctl_cmd_name(a.cmd), reply.error.message);
        status = 1;
    } else if (a.json) {
        if (print_json(&reply.ctl_reply) < 0)
            status = cli_fail("ctl", MO_ENOMEM);
        else
            status = reply.ctl_reply.ok ? 0 : 1;
    } else if (!reply.ctl_reply.ok) {
        fprintf(stderr, "moerl ctl: the learner refused %s: %s\n", msg_ctl_cmd_name(a.cmd),
                reply.ctl_reply.message);
        status = 1;
    } else {
        print_text(&reply.ctl_reply);
    }
    fflush(stdout);
    msg_free(&reply);
    return status;
}

const cli_command_t cmd_ctl = {
    "ctl",
    "control a running job: status, swap-reward, checkpoint, pause, resume, stop",
    ctl_run,
    ctl_help,
};
