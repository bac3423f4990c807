/* daemon_args: the command line shared by `moerl learner`, `moerl rollout` and
 * `moerl reward`: CONFIG, --set overrides and the daemon options. */
#ifndef MOERL_CLI_DAEMON_ARGS_H
#define MOERL_CLI_DAEMON_ARGS_H

#include <stdbool.h>
#include <stdio.h>

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAEMON_MAX_SETS 64

/* Options a command takes besides CONFIG, --set, --ready-fd and --metrics-port. */
enum {
    DA_WORKER_ID = 1 << 0, /* --worker-id N */
    DA_DRAIN = 1 << 1,     /* --drain-ms MS */
    DA_RESUME = 1 << 2,    /* --resume, --allow-config-change, --init-adapter DIR */
};

typedef struct daemon_args {
    const char *config;
    const char *sets[DAEMON_MAX_SETS];
    int nsets;
    int worker_id;    /* -1: not given */
    int ready_fd;     /* -1: not given */
    int metrics_port; /* -1: from the config */
    int drain_ms;     /* 0: the daemon's default */
    bool resume, allow_config_change;
    const char *init_adapter;
} daemon_args_t;

/* Parses argv (argv[0] is the command); prints a usage error naming cmd and returns 2,
 * or returns 0. */
int daemon_args_parse(const char *cmd, int argc, char **argv, unsigned accept, daemon_args_t *a);
/* Loads CONFIG with the --set overrides; prints every error and returns 1, or 0. c must
 * be freed with config_free either way. */
int daemon_args_config(const char *cmd, const daemon_args_t *a, moerl_config_t *c);
/* The help lines of the shared options. */
void daemon_args_help(FILE *out, unsigned accept);

#ifdef __cplusplus
}
#endif
#endif
