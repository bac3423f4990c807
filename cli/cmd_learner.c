/* cmd_learner: `moerl learner CONFIG`: the learner daemon. */
#include <signal.h>
#include <stdio.h>

#include "cli/commands.h"
#include "cli/daemon_args.h"
#include "core/backend.h"
#include "core/comm.h"
#include "core/status.h"
#include "learner/daemon.h"
#include "learner/ep_learner.h"

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
          "Expert parallelism: with learner.ranks N > 1, launch N ranks with\n"
          "`mpirun -np N moerl learner CONFIG` (`moerl run` does): each rank holds E/N\n"
          "routed experts of every MoE layer and trains on its share of each batch; rank 0\n"
          "runs the daemon, the others follow it and exit when it stops. With run.device\n"
          "cuda each rank takes a GPU of its host; learner.comm nccl moves the MoE layers'\n"
          "rows between the GPUs over NCCL (one GPU per rank) instead of MPI.\n"
          "\n"
          "exit status: 0 finished or stopped cleanly, 1 error (bad config, endpoint in\n"
          "use, missing CURVE keys, learner.ranks not matching the ranks started, experts\n"
          "not divisible by learner.ranks, training failure), 2 usage error\n",
          out);
}

/* The job's communicators when learner.ranks > 1 (NULL otherwise): the host one (control,
 * gradient sums, the CPU path's exchanges) and, with learner.comm nccl, the device one for
 * the MoE layers' exchanges; 0 or 1 (error, nothing left open). */
static int open_comm(const moerl_config_t *c, comm_t **cm, comm_t **dcm) {
    *cm = *dcm = NULL;
    if (c->learner.ranks <= 1)
        return 0;
    if (comm_init_from_env(cm, "auto") < 0) {
        fprintf(stderr, "moerl learner: %s\n", mo_last_error());
        return 1;
    }
    if (comm_size(*cm) != c->learner.ranks) {
        if (comm_rank(*cm) == 0)
            fprintf(stderr,
                    "moerl learner: learner.ranks is %d but %d rank(s) were started: launch "
                    "`mpirun -np %d moerl learner CONFIG` (or use `moerl run`)\n",
                    c->learner.ranks, comm_size(*cm), c->learner.ranks);
        comm_destroy(cm);
        return 1;
    }
    if (c->learner.comm != CFG_COMM_NCCL)
        return 0;
    if (comm_init_from_env(dcm, "nccl") < 0) { /* collective: every rank learns of a failure */
        fprintf(stderr, "moerl learner rank %d: learner.comm nccl: %s\n", comm_rank(*cm),
                mo_last_error());
        comm_destroy(cm);
        return 1;
    }
    return 0;
}

/* The device communicator first: the host one may be MPI's last. */
static int close_comms(comm_t **cm, comm_t **dcm) {
    int a = comm_destroy(dcm), b = comm_destroy(cm);
    return a < 0 ? a : b;
}

/* Ranks 1 .. N - 1: the trainer's shard, following rank 0 until it stops. On an error
 * the communicator is left as it is (another rank may be inside a collective): the
 * non-zero exit makes the launcher end the job. */
static int follower_run(const moerl_config_t *c, const daemon_args_t *a, comm_t *cm, comm_t *dcm) {
    int r = comm_rank(cm);
    signal(SIGTERM, SIG_IGN); /* rank 0 handles stops and tells this rank */
    signal(SIGINT, SIG_IGN);
    backend_cpu_set_threads(c->run.threads);
    trainer_opts_t to = trainer_opts_default();
    to.init_adapter = a->init_adapter;
    to.comm = cm;
    to.device_comm = dcm;
    trainer_t *t = NULL;
    int rc = trainer_new(&t, c, NULL, &to);
    if (rc == MO_OK) {
        char line[512];
        ep_describe(t, line, sizeof line);
        fprintf(stderr, "learner rank %d: %s\n", r, line);
        rc = ep_follow(t);
    }
    if (rc < 0) {
        fprintf(stderr, "moerl learner rank %d: %s\n", r,
                *mo_last_error() ? mo_last_error() : mo_status_name(rc));
        return 1;
    }
    trainer_destroy(&t);
    return close_comms(&cm, &dcm) < 0 ? 1 : 0;
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
    comm_t *cm = NULL, *dcm = NULL;
    if (open_comm(&c, &cm, &dcm)) {
        config_free(&c);
        return 1;
    }
    if (cm && comm_rank(cm) > 0) {
        rc = follower_run(&c, &a, cm, dcm);
        config_free(&c);
        return rc;
    }
    learner_daemon_opts_t o;
    learner_daemon_opts_default(&o, &c);
    o.comm = cm;
    o.device_comm = dcm;
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
    if (cm && ep_lead_stop(cm, rc < 0) < 0) {
        fprintf(stderr, "moerl learner: %s\n", mo_last_error());
        return 1; /* the launcher ends the other ranks */
    }
    if (close_comms(&cm, &dcm) < 0)
        rc = rc < 0 ? rc : MO_EIO;
    return rc < 0 ? 1 : 0;
}

const cli_command_t cmd_learner = {
    "learner",
    "run the learner daemon of a job (training, leases, weight publishing)",
    learner_run,
    learner_help,
};
