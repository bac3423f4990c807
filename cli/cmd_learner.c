/* cmd_learner: `moerl learner CONFIG`: the learner daemon. */
#include <stdio.h>

#include "cli/commands.h"
#include "cli/daemon_args.h"
#include "core/status.h"
#include "learner/daemon.h"

#define LEARNER_ACCEPT DA_RESUME

static void learner_help(FILE *out) {
    fputs("usage: moerl learner CONFIG [--set KEY=VALUE]... [--resume] [options]\n"
          "\n"
          "Runs the learner of a job: owns the prompt stream, leases prompts to rollout\n"
          "workers, trains on scored groups (rollout.prompts_per_step per step), publishes\n"
          "every adapter version, checkpoints, and answers `moerl ctl`. Binds\n"
          "transport.control (ROUTER), transport.work (ROUTER), transport.trajectories\n"
          "(PULL) and transport.weights (PUB); docs/daemons.md has the details.\n"
          "\n"
          "options:\n",
          out);
    daemon_args_help(out, LEARNER_ACCEPT);
    fputs("\n"
          "Readiness: once the sockets are bound and the model is loaded it logs\n"
          "\"ready: ...\" and writes \"ready\\n\" to --ready-fd.\n"
          "Logs: stderr, one line each: \"<UTC time> learner: <message>\", a status line\n"
          "per step (metrics.status_line). Metrics: <run dir>/metrics/learner.jsonl (one\n"
          "line per step, event \"step\", and a last one, event \"final\"), Prometheus at\n"
          "GET /metrics on metrics.http_port.\n"
          "Stopping: after learner.steps it saves a checkpoint, tells every worker to stop\n"
          "and exits 0. SIGTERM, SIGINT or `moerl ctl stop`: no new leases, the step in\n"
          "progress finishes, a checkpoint is saved, workers are told to stop, exit 0. A\n"
          "second signal skips the checkpoint (exit 1).\n"
          "\n"
          "exit status: 0 finished or stopped cleanly, 1 error (bad config, endpoint in\n"
          "use, missing CURVE keys, learner.ranks > 1, training failure), 2 usage error\n",
          out);
}

static int learner_run(int argc, char **argv) {
    daemon_args_t a;
    int rc = daemon_args_parse("learner", argc, argv, LEARNER_ACCEPT, &a);
    if (rc)
        return rc;
    moerl_config_t c;
    if (daemon_args_config("learner", &a, &c)) {
        config_free(&c);
        return 1;
    }
    learner_daemon_opts_t o;
    learner_daemon_opts_default(&o, &c);
    o.resume = a.resume;
    o.allow_config_change = a.allow_config_change;
    o.init_adapter = a.init_adapter;
    o.ready_fd = a.ready_fd;
    o.metrics_port = a.metrics_port;
    rc = learner_daemon_run(&o);
    if (rc < 0)
        fprintf(stderr, "moerl learner: %s\n",
                *mo_last_error() ? mo_last_error() : mo_status_name(rc));
    config_free(&c);
    return rc < 0 ? 1 : 0;
}

const cli_command_t cmd_learner = {
    "learner",
    "run the learner daemon of a job (training, leases, weight publishing)",
    learner_run,
    learner_help,
};
