/* cmd_reward: `moerl reward CONFIG`: a reward worker daemon. */
#include <stdio.h>

#include "cli/commands.h"
#include "cli/daemon_args.h"
#include "core/status.h"
#include "reward/daemon.h"

#define REWARD_ACCEPT (DA_WORKER_ID | DA_DRAIN)

static void reward_help(FILE *out) {
    fputs("usage: moerl reward CONFIG [--worker-id I] [--set KEY=VALUE]... [options]\n"
          "\n"
          "Runs reward worker I (default 0, id \"reward-I\"): builds reward.function\n"
          "(and reward.plugin) as reward version 1, binds the I-th endpoint of\n"
          "transport.reward (the tcp port plus I, or the ipc path with \".I\"), answers\n"
          "score_request with score_reply, and registers with the learner, which can swap\n"
          "the reward function while the job runs (a failed swap keeps the old one).\n"
          "docs/daemons.md has the details.\n"
          "\n"
          "options:\n",
          out);
    daemon_args_help(out, REWARD_ACCEPT);
    fputs("\n"
          "Readiness: once bound with its reward function loaded it logs \"ready: ...\"\n"
          "and writes \"ready\\n\" to --ready-fd.\n"
          "Logs: stderr, \"<UTC time> reward-I: <message>\". Metrics:\n"
          "<run dir>/metrics/reward-I.jsonl every 5 s and at exit; Prometheus on\n"
          "metrics.http_port + 1 + rollout.workers + I when metrics.http_port is set.\n"
          "Stopping: SIGTERM, SIGINT or the learner's stop: new requests are refused\n"
          "(the rollout sends them to another reward worker), requests being scored are\n"
          "answered (at most --drain-ms, default 5000), exit 0. A second signal exits at\n"
          "once with 1.\n"
          "\n"
          "exit status: 0 stopped cleanly, 1 error (bad config or reward function,\n"
          "endpoint in use, missing CURVE keys), 2 usage error\n",
          out);
}

static int reward_run(int argc, char **argv) {
    daemon_args_t a;
    int rc = daemon_args_parse("reward", argc, argv, REWARD_ACCEPT, &a);
    if (rc)
        return rc;
    moerl_config_t c;
    if (daemon_args_config("reward", &a, &c)) {
        config_free(&c);
        return 1;
    }
    reward_daemon_opts_t o;
    reward_daemon_opts_default(&o, &c);
    o.index = a.worker_id < 0 ? 0 : a.worker_id;
    o.ready_fd = a.ready_fd;
    o.metrics_port = a.metrics_port;
    o.drain_ms = a.drain_ms;
    rc = reward_daemon_run(&o);
    if (rc < 0)
        fprintf(stderr, "moerl reward: %s\n",
                *mo_last_error() ? mo_last_error() : mo_status_name(rc));
    config_free(&c);
    return rc < 0 ? 1 : 0;
}

const cli_command_t cmd_reward = {
    "reward",
    "run a reward worker daemon (scores groups, swappable reward function)",
    reward_run,
    reward_help,
};
