/* cmd_rollout: `moerl rollout CONFIG --worker-id K`: a rollout worker daemon. */
#include <stdio.h>

#include "cli/commands.h"
#include "cli/daemon_args.h"
#include "core/status.h"
#include "rollout/daemon.h"

#define ROLLOUT_ACCEPT (DA_WORKER_ID | DA_DRAIN)

static void rollout_help(FILE *out) {
    fputs("usage: moerl rollout CONFIG --worker-id K [--set KEY=VALUE]... [options]\n"
          "\n"
          "Runs rollout worker K (0 <= K < rollout.workers, id \"rollout-K\"): loads\n"
          "model.path, asks the learner for prompts as it has room, generates\n"
          "rollout.group_size completions per prompt, has them scored by the reward\n"
          "workers and pushes the scored groups to the learner. New adapter versions are\n"
          "applied between decode steps. Connects transport.control, transport.work,\n"
          "transport.trajectories, transport.weights and every reward endpoint;\n"
          "docs/daemons.md has the details.\n"
          "\n"
          "options:\n",
          out);
    daemon_args_help(out, ROLLOUT_ACCEPT);
    fputs("\n"
          "Readiness: once the model and engine are loaded and the sockets connected it\n"
          "logs \"ready: ...\" and writes \"ready\\n\" to --ready-fd (it need not wait for\n"
          "the learner, which it keeps greeting until answered).\n"
          "Logs: stderr, \"<UTC time> rollout-K: <message>\". Metrics:\n"
          "<run dir>/metrics/rollout-K.jsonl every 5 s and at exit; Prometheus on\n"
          "metrics.http_port + 1 + K when metrics.http_port is set.\n"
          "Stopping: SIGTERM or SIGINT: no more work is requested; prompts not yet started\n"
          "are dropped (the learner hands them out again once this worker's heartbeats\n"
          "stop or their lease deadline passes); groups being generated are finished,\n"
          "scored and sent (at most --drain-ms, default 30000); exit 0. The learner's stop\n"
          "(end of the run) exits at once with 0. A second signal exits at once with 1.\n"
          "\n"
          "exit status: 0 stopped cleanly, 1 error (bad config, model, sockets, metrics\n"
          "port in use), 2 usage error\n",
          out);
}

static int rollout_run(int argc, char **argv) {
    daemon_args_t a;
    int rc = daemon_args_parse("rollout", argc, argv, ROLLOUT_ACCEPT, &a);
    if (rc)
        return rc;
    moerl_config_t c;
    if (daemon_args_config("rollout", &a, &c)) {
        config_free(&c);
        return 1;
    }
    rollout_daemon_opts_t o;
    rollout_daemon_opts_default(&o, &c);
    o.index = a.worker_id;
    o.ready_fd = a.ready_fd;
    o.metrics_port = a.metrics_port;
    o.drain_ms = a.drain_ms;
    rc = rollout_daemon_run(&o);
    if (rc < 0)
        fprintf(stderr, "moerl rollout: %s\n",
                *mo_last_error() ? mo_last_error() : mo_status_name(rc));
    config_free(&c);
    return rc < 0 ? 1 : 0;
}

const cli_command_t cmd_rollout = {
    "rollout",
    "run a rollout worker daemon (generation with hot-swapped adapters)",
    rollout_run,
    rollout_help,
};
