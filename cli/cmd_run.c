/* cmd_run: `moerl run`: launches a whole job on this machine from one config (the
 * learner, the rollout and reward workers), supervises it and shows its progress. */
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/commands.h"
#include "core/config.h"
#include "core/status.h"
#include "learner/runner.h"
#include "learner/supervisor.h"

#define RUN_MAX_SETS 64

static void run_help(FILE *out) {
    fputs("usage: moerl run CONFIG [--resume] [--set key=value ...] [options]\n"
          "\n"
          "Runs a whole job on this machine: validates the config, creates the run\n"
          "directory (run.dir, or runs/<run.name>), writes the resolved config there\n"
          "(config.yaml, which every daemon reads), and starts\n"
          "  learner              moerl learner (through mpirun -np N when learner.ranks > 1)\n"
          "  rollout-0 .. K-1     moerl rollout --worker-id k   (rollout.workers)\n"
          "  reward-0 .. M-1      moerl reward --worker-id i    (reward.workers)\n"
          "Their output is shown prefixed with the process name and kept in\n"
          "<run>/logs/<name>.log; the supervisor's own lines go to <run>/logs/run.log.\n"
          "A status line (step, reward mean, share of sampled completions scored 1,\n"
          "rollout tokens/s, weight-sync latency) follows the learner's metrics\n"
          "(<run>/metrics/learner.jsonl).\n"
          "\n"
          "A rollout or reward worker that crashes is restarted after a delay that\n"
          "doubles each time (0.5 s, 1 s, 2 s, ...); after --max-restarts failures in a\n"
          "row the job fails. The job is done when the learner exits 0 (its steps are\n"
          "done, or `moerl ctl stop`); it fails when the learner fails. Ctrl-C or SIGTERM\n"
          "stops every process: SIGTERM, then SIGKILL after the grace period (a second\n"
          "Ctrl-C kills at once).\n"
          "\n"
          "Before anything starts the CURVE keys, the endpoints (free, and allowed by the\n"
          "loopback-or-CURVE policy) and model.path are checked.\n"
          "\n"
          "options:\n"
          "  --resume           continue the run in the run directory from its latest\n"
          "                     checkpoint (a run without one starts at step 0); without\n"
          "                     it, a run directory that holds checkpoints is refused\n"
          "  --set key=value    override a config key (repeatable)\n"
          "  --max-restarts N   restarts of one worker in a row before the job fails\n"
          "                     (default 5; a worker that ran 60 s counts from 0 again)\n"
          "  --grace-ms N       wait after SIGTERM before SIGKILL (default 60000: the\n"
          "                     learner finishes its step and saves a checkpoint)\n"
          "  --no-status        no status line\n"
          "  -h, --help         this help\n"
          "\n"
          "exit status: 0 the job finished, 1 it failed (the reason is printed), 2 usage\n"
          "error, 128+N stopped by signal N (130 for Ctrl-C)\n",
          out);
}

typedef struct run_args {
    const char *config;
    const char *sets[RUN_MAX_SETS];
    int nsets;
    bool resume, no_status;
    int max_restarts, grace_ms;
} run_args_t;

static int run_usage(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl run --help)\n");
    return 2;
}

static int parse_int(const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_args(int argc, char **argv, run_args_t *a) {
    memset(a, 0, sizeof *a);
    a->max_restarts = 5;
    a->grace_ms = 60000;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        bool takes =
            !strcmp(o, "--set") || !strcmp(o, "--max-restarts") || !strcmp(o, "--grace-ms");
        if (takes && i + 1 >= argc)
            return run_usage("%s needs a value", o);
        if (!strcmp(o, "--set")) {
            if (a->nsets == RUN_MAX_SETS)
                return run_usage("more than %s --set options", "64");
            a->sets[a->nsets++] = argv[++i];
        } else if (!strcmp(o, "--resume")) {
            a->resume = true;
        } else if (!strcmp(o, "--no-status")) {
            a->no_status = true;
        } else if (!strcmp(o, "--max-restarts")) {
            if (parse_int(argv[++i], 0, 1000, &a->max_restarts))
                return run_usage("--max-restarts: '%s' is not a count in 0..1000", argv[i]);
        } else if (!strcmp(o, "--grace-ms")) {
            if (parse_int(argv[++i], 0, 3600000, &a->grace_ms))
                return run_usage("--grace-ms: '%s' is not a number of milliseconds", argv[i]);
        } else if (o[0] == '-' && o[1]) {
            return run_usage("unknown option '%s'", o);
        } else if (!a->config) {
            a->config = o;
        } else {
            return run_usage("unexpected argument '%s'", o);
        }
    }
    if (!a->config)
        return run_usage("%s", "a job config is required: moerl run CONFIG");
    return 0;
}

/* Loads the config, printing every error (file:line: key: what). */
static int load_config(const run_args_t *a, moerl_config_t *c) {
    config_errors_t errs;
    memset(&errs, 0, sizeof errs);
    int rc = config_load(c, a->config, a->sets, a->nsets, &errs);
    if (rc < 0) {
        if (errs.n == 0)
            fprintf(stderr, "moerl run: %s\n", mo_last_error());
        for (int i = 0; i < errs.n; i++)
            fprintf(stderr, "moerl run: %s\n", errs.items[i]);
        if (errs.n > 0)
            fprintf(stderr, "moerl run: %d configuration error%s; nothing was started\n", errs.n,
                    errs.n == 1 ? "" : "s");
    }
    config_errors_free(&errs);
    return rc;
}

/* The exit of every process, one line each. */
static void print_exits(supervisor_t *s) {
    for (int i = 0; i < supervisor_nprocs(s); i++) {
        sup_proc_info_t p;
        if (supervisor_proc_info(s, i, &p) < 0)
            continue;
        char how[96];
        if (p.starts == 0)
            snprintf(how, sizeof how, "not started");
        else if (!p.exited)
            snprintf(how, sizeof how, "still running");
        else if (p.term_signal)
            snprintf(how, sizeof how, "killed by signal %d (%s)%s", p.term_signal,
                     strsignal(p.term_signal), p.killed ? " after the grace period" : "");
        else
            snprintf(how, sizeof how, "exit %lld", (long long)p.exit_status);
        supervisor_say(s, "  %-12s %s%s", p.name, how,
                       p.restarts > 0 ? (p.restarts == 1 ? ", restarted once" : ", restarted")
                                      : "");
    }
}

static int supervise(const run_args_t *a, const moerl_config_t *c, const runner_paths_t *paths,
                     const runner_plan_t *plan) {
    runner_status_t st;
    runner_status_init(&st, paths->metrics, c->learner.steps);
    sup_opts_t o;
    sup_opts_default(&o);
    o.log_dir = paths->logs;
    o.term = stdout;
    o.term_is_tty = isatty(STDOUT_FILENO) == 1;
    o.max_restarts = a->max_restarts;
    o.grace_ms = a->grace_ms;
    if (!a->no_status && c->metrics.status_line) {
        o.status = runner_status_poll;
        o.status_ud = &st;
    }
    supervisor_t *s = NULL;
    int rc = supervisor_new(&o, &s);
    for (int i = 0; i < plan->n && rc == MO_OK; i++) {
        const runner_proc_t *p = &plan->procs[i];
        sup_proc_spec_t spec = {p->name, (const char *const *)p->argv, p->primary, p->restart};
        rc = supervisor_add(s, &spec);
    }
    sup_result_t res;
    if (rc == MO_OK)
        rc = supervisor_run(s, &res);
    if (rc < 0) {
        supervisor_destroy(&s);
        return cli_fail("run", rc);
    }
    print_exits(s);
    supervisor_destroy(&s);
    if (res.outcome == SUP_DONE) {
        printf("[run] job done: run directory %s\n", paths->run_dir);
        return 0;
    }
    if (res.outcome == SUP_INTERRUPTED) {
        printf("[run] job stopped (%s); continue it with: moerl run %s --resume\n", res.why,
               a->config);
        return 128 + res.signal;
    }
    fprintf(stderr, "moerl run: the job failed: %s (logs in %s)\n", res.why, paths->logs);
    return 1;
}

static int run_run(int argc, char **argv) {
    run_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    moerl_config_t c;
    if (load_config(&a, &c) < 0) {
        config_free(&c);
        return 1;
    }
    runner_paths_t paths;
    runner_plan_t plan = {0};
    char exe[PATH_MAX], mpirun[PATH_MAX] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        rc = mo_errorf(MO_EIO, "cannot find this program's path (/proc/self/exe): %s",
                       strerror(errno));
    else
        exe[n] = 0;
    if (rc == MO_OK)
        rc = runner_paths(&c, &paths);
    if (rc == MO_OK)
        rc = runner_preflight(&c);
    if (rc == MO_OK && c.learner.ranks > 1 && runner_which("mpirun", mpirun, sizeof mpirun) < 0)
        mpirun[0] = 0; /* runner_plan says what is missing */
    runner_plan_opts_t po = {exe, paths.config, a.resume, mpirun, geteuid() == 0};
    if (rc == MO_OK)
        rc = runner_plan(&c, &po, &plan);
    if (rc == MO_OK)
        rc = runner_prepare(&c, a.resume, &paths);
    int status;
    if (rc < 0) {
        status = cli_fail("run", rc);
    } else {
        printf("[run] %s: run directory %s, %d rollout and %d reward worker%s, %lld steps\n",
               c.run.name, paths.run_dir, c.rollout.workers, c.reward.workers,
               c.reward.workers == 1 ? "" : "s", (long long)c.learner.steps);
        fflush(stdout);
        status = supervise(&a, &c, &paths, &plan);
    }
    runner_plan_free(&plan);
    config_free(&c);
    return status;
}

const cli_command_t cmd_run = {
    "run",
    "run a whole job on this machine: learner, rollout and reward workers, supervised",
    run_run,
    run_help,
};
