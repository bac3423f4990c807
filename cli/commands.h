/* commands: the table of `moerl` subcommands. */
#ifndef MOERL_CLI_COMMANDS_H
#define MOERL_CLI_COMMANDS_H

#include <stdio.h>

typedef struct cli_command {
    const char *name;
    const char *summary; /* one line for `moerl --help` */
    /* argv[0] is the subcommand's name; returns the process exit status. */
    int (*run)(int argc, char **argv);
    /* Full help for `moerl <cmd> --help`. */
    void (*help)(FILE *out);
} cli_command_t;

/* NULL-terminated, defined in cli/main.c. */
extern const cli_command_t *const cli_commands[];

/* True when argv holds -h or --help. */
int cli_wants_help(int argc, char **argv);
/* Prints "moerl <cmd>: <message>" with the last error and returns 1 (or 2 for usage). */
int cli_fail(const char *cmd, int rc);

#endif
