/* main: `moerl <command> ...` dispatch. */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "core/status.h"

extern const cli_command_t cmd_config;
extern const cli_command_t cmd_keys;
extern const cli_command_t cmd_generate;
extern const cli_command_t cmd_init_model;
extern const cli_command_t cmd_score;
extern const cli_command_t cmd_learner;
extern const cli_command_t cmd_rollout;
extern const cli_command_t cmd_reward;
extern const cli_command_t cmd_sft;
extern const cli_command_t cmd_run;
extern const cli_command_t cmd_ctl;
extern const cli_command_t cmd_report;
extern const cli_command_t cmd_plan;

const cli_command_t *const cli_commands[] = {
    &cmd_config,
    &cmd_keys,
    &cmd_generate,
    &cmd_init_model,
    &cmd_score,
    &cmd_learner,
    &cmd_rollout,
    &cmd_reward,
    &cmd_sft,
    &cmd_run,
    &cmd_ctl,
    &cmd_report,
    &cmd_plan,
    NULL,
};

static void usage(FILE *out) {
    fprintf(out, "moerl %s: reinforcement-learning post-training for mixture-of-experts models\n\n"
                 "usage: moerl <command> [options]\n       moerl <command> --help\n"
                 "       moerl --version\n\ncommands:\n",
            MOERL_VERSION);
    for (int i = 0; cli_commands[i]; i++)
        fprintf(out, "  %-14s %s\n", cli_commands[i]->name, cli_commands[i]->summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("moerl %s\n", MOERL_VERSION);
        return 0;
    }
    for (int i = 0; cli_commands[i]; i++) {
        const cli_command_t *c = cli_commands[i];
        if (strcmp(argv[1], c->name) != 0)
            continue;
        if (cli_wants_help(argc - 1, argv + 1)) {
            c->help(stdout);
            return 0;
        }
        return c->run(argc - 1, argv + 1);
    }
    fprintf(stderr, "moerl: unknown command '%s' (see moerl --help)\n", argv[1]);
    return 2;
}
