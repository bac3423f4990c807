/* cmd_report: `moerl report`: a run's reward and held-out greedy accuracy by step, as a
 * table and an SVG plot in the run directory. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/status.h"
#include "learner/run_report.h"

static void report_help(FILE *out) {
    fputs("usage: moerl report RUN_DIR [--eval-n N] [--no-eval] [--svg PATH]\n"
          "\n"
          "Summarises a run made by `moerl run`: the reward mean of every step (from\n"
          "RUN_DIR/metrics/learner.jsonl) and the held-out greedy accuracy of the base\n"
          "model (step 0) and of the adapter of every checkpoint in RUN_DIR/checkpoints\n"
          "(greedy decoding of the first N eval prompts of the job's data, scored by the\n"
          "task's verifier, as `moerl sft` measures it). Prints a table and the accuracy\n"
          "before and after, and draws both curves into RUN_DIR/report.svg.\n"
          "The job's settings come from RUN_DIR/config.yaml.\n"
          "\n"
          "options:\n"
          "  --eval-n N    held-out prompts per evaluation (default: data.eval_size)\n"
          "  --no-eval     no evaluation: the reward curve only\n"
          "  --svg PATH    where to write the plot (default RUN_DIR/report.svg)\n"
          "  -h, --help    this help\n"
          "\n"
          "Threads: run.threads (0 = every core).\n"
          "exit status: 0 written, 1 error, 2 usage error\n",
          out);
}

typedef struct report_args {
    const char *run_dir, *svg;
    int eval_n;
    bool no_eval;
} report_args_t;

static int report_usage(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl report: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl report --help)\n");
    return 2;
}

static int parse_args(int argc, char **argv, report_args_t *a) {
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if ((!strcmp(o, "--eval-n") || !strcmp(o, "--svg")) && i + 1 >= argc)
            return report_usage("%s needs a value", o);
        if (!strcmp(o, "--eval-n")) {
            char *end;
            errno = 0;
            long v = strtol(argv[++i], &end, 10);
            if (!*argv[i] || *end || errno || v < 1 || v > 1000000)
                return report_usage("--eval-n: '%s' is not a count of prompts", argv[i]);
            a->eval_n = (int)v;
        } else if (!strcmp(o, "--svg")) {
            a->svg = argv[++i];
        } else if (!strcmp(o, "--no-eval")) {
            a->no_eval = true;
        } else if (o[0] == '-') {
            return report_usage("unknown option '%s'", o);
        } else if (!a->run_dir) {
            a->run_dir = o;
        } else {
            return report_usage("unexpected argument '%s'", o);
        }
    }
    if (!a->run_dir)
        return report_usage("%s", "the run directory is required: moerl report RUN_DIR");
    return 0;
}

static void on_eval(void *arg, int64_t step, double accuracy, int correct, int n) {
    (void)arg;
    printf("evaluated %s %lld: held-out accuracy %.3f (%d/%d)\n",
           step == 0 ? "the base model, step" : "checkpoint step", (long long)step, accuracy,
           correct, n);
    fflush(stdout);
}

static int report_run(int argc, char **argv) {
    report_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    char cfg_path[4200], metrics[4200], svg[4200];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.yaml", a.run_dir);
    snprintf(metrics, sizeof metrics, "%s/metrics/learner.jsonl", a.run_dir);
    snprintf(svg, sizeof svg, "%s", a.svg ? a.svg : "");
    if (!a.svg)
        snprintf(svg, sizeof svg, "%s/report.svg", a.run_dir);
    moerl_config_t c;
    rc = config_load(&c, cfg_path, NULL, 0, NULL);
    run_report_t r;
    report_init(&r);
    if (rc == MO_OK)
        rc = report_read_metrics(&r, metrics);
    if (rc == MO_OK && !a.no_eval) {
        backend_cpu_set_threads(c.run.threads);
        rc = report_eval_checkpoints(&r, &c, a.run_dir, a.eval_n, on_eval, NULL);
    }
    if (rc == MO_OK) {
        report_print(&r, stdout);
        char title[512];
        snprintf(title, sizeof title, "%s: reward and held-out accuracy by step", c.run.name);
        rc = report_write_svg(&r, title, svg);
        if (rc == MO_OK)
            printf("plot: %s\n", svg);
    }
    report_free(&r);
    config_free(&c);
    return rc < 0 ? cli_fail("report", rc) : 0;
}

const cli_command_t cmd_report = {
    "report",
    "a run's reward and held-out accuracy by step: table and SVG plot",
    report_run,
    report_help,
};
