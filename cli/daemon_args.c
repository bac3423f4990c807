/* daemon_args: command-line parsing shared by the daemon subcommands. */
#include "cli/daemon_args.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

static int usage(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "moerl %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl %s --help)\n", cmd);
    return 2;
}

static int parse_int(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        char msg[160];
        snprintf(msg, sizeof msg, "%%s: expected a whole number in %ld..%ld, got '%s'", lo, hi, v);
        return usage(cmd, msg, opt);
    }
    *out = (int)x;
    return 0;
}

/* Options with a value; returns -1 when o is not one of them. */
static int take_value(const char *cmd, const char *o, const char *v, unsigned accept,
                      daemon_args_t *a) {
    if (!strcmp(o, "--set")) {
        if (a->nsets == DAEMON_MAX_SETS)
            return usage(cmd, "%s: at most 64", o);
        a->sets[a->nsets++] = v;
        return 0;
    }
    if (!strcmp(o, "--ready-fd"))
        return parse_int(cmd, o, v, 0, 1 << 20, &a->ready_fd);
    if (!strcmp(o, "--metrics-port"))
        return parse_int(cmd, o, v, 0, 65535, &a->metrics_port);
    if ((accept & DA_WORKER_ID) && !strcmp(o, "--worker-id"))
        return parse_int(cmd, o, v, 0, 1023, &a->worker_id);
    if ((accept & DA_DRAIN) && !strcmp(o, "--drain-ms"))
        return parse_int(cmd, o, v, 1, 86400000, &a->drain_ms);
    if ((accept & DA_RESUME) && !strcmp(o, "--init-adapter")) {
        a->init_adapter = v;
        return 0;
    }
    return -1;
}

int daemon_args_parse(const char *cmd, int argc, char **argv, unsigned accept, daemon_args_t *a) {
    memset(a, 0, sizeof *a);
    a->worker_id = -1;
    a->ready_fd = -1;
    a->metrics_port = -1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if ((accept & DA_RESUME) && !strcmp(o, "--resume")) {
            a->resume = true;
            continue;
        }
        if ((accept & DA_RESUME) && !strcmp(o, "--allow-config-change")) {
            a->allow_config_change = true;
            continue;
        }
        if (!strncmp(o, "--set=", 6)) {
            if (take_value(cmd, "--set", o + 6, accept, a))
                return 2;
            continue;
        }
        if (o[0] != '-' || !o[1]) {
            if (a->config)
                return usage(cmd, "one CONFIG only, got a second: '%s'", o);
            a->config = o;
            continue;
        }
        if (i + 1 >= argc)
            return usage(cmd, "%s needs a value (or is unknown)", o);
        int rc = take_value(cmd, o, argv[i + 1], accept, a);
        if (rc < 0)
            return usage(cmd, "unknown option '%s'", o);
        if (rc)
            return rc;
        i++;
    }
    if (!a->config)
        return usage(cmd, "%s", "CONFIG is required");
    if ((accept & DA_WORKER_ID) && a->worker_id < 0 && strcmp(cmd, "reward") != 0)
        return usage(cmd, "%s is required", "--worker-id");
    return 0;
}

int daemon_args_config(const char *cmd, const daemon_args_t *a, moerl_config_t *c) {
    config_errors_t errs = {0};
    int rc = config_load(c, a->config, a->sets, a->nsets, &errs);
    if (rc < 0) {
        fprintf(stderr, "moerl %s: bad configuration %s:\n", cmd, a->config);
        for (int i = 0; i < errs.n; i++)
            fprintf(stderr, "  %s\n", errs.items[i]);
        if (errs.n == 0)
            fprintf(stderr, "  %s\n", *mo_last_error() ? mo_last_error() : mo_status_name(rc));
    }
    config_errors_free(&errs);
    return rc < 0 ? 1 : 0;
}

void daemon_args_help(FILE *out, unsigned accept) {
    fputs("  --set KEY=VALUE      override one config key (repeatable), e.g. --set "
          "learner.steps=10\n",
          out);
    if (accept & DA_WORKER_ID)
        fputs("  --worker-id N        this worker's index (0-based); its id on the wire is\n"
              "                       <role>-N\n",
              out);
    if (accept & DA_RESUME)
        fputs("  --resume             continue from <run dir>/checkpoints/latest (a run without\n"
              "                       checkpoints starts at step 0)\n"
              "  --allow-config-change  resume a checkpoint saved under other training settings\n"
              "  --init-adapter DIR   start from a PEFT adapter directory\n",
              out);
    if (accept & DA_DRAIN)
        fputs("  --drain-ms MS        at SIGTERM, wait at most MS for work in progress\n", out);
    fputs("  --ready-fd FD        write \"ready\\n\" to file descriptor FD once serving, then "
          "close it\n"
          "  --metrics-port PORT  Prometheus port (0 = off); default from metrics.http_port\n"
          "  -h, --help           this help\n",
          out);
}
