/* learner daemon: `moerl learner`: owns the prompt stream, leases prompts to rollout
 * workers, collects scored groups, trains on a worker thread, publishes each adapter
 * version, checkpoints, and answers `moerl ctl`. */
#ifndef MOERL_LEARNER_DAEMON_H
#define MOERL_LEARNER_DAEMON_H

#include <stdbool.h>

#include "core/comm.h"
#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lifecycle (docs/daemons.md):
 *   start: build the trainer (model, adapter, optimizer; with comm, rank 0's shard of an
 *          expert-parallel trainer whose other ranks run ep_follow, learner/ep_learner.h) and
 *          the prompt stream; with resume, load the run's latest checkpoint (adapter,
 *          optimizer, step, policy version, prompt cursor); bind the control ROUTER,
 *          work ROUTER, trajectory PULL and weights PUB; then "ready" (log line, and
 *          ready_fd).
 *   run:   welcome each hello; lease prompts against workers' credits, at most
 *          prompts_per_step x (1 + max_staleness) outstanding; hand out again the
 *          prompts of a lease whose deadline passes or whose worker misses 3 heartbeats;
 *          drop duplicate, unknown, malformed and stale groups (counted); train every
 *          prompts_per_step groups, publish the new adapter version, write one metrics
 *          line, checkpoint every learner.checkpoint_every steps.
 *   stop:  after learner.steps: checkpoint, a stop to every registered worker, exit.
 *          SIGTERM/SIGINT or `moerl ctl stop`: no more leases, the step in progress
 *          finishes, a checkpoint is saved when steps were trained since the last one,
 *          workers are told to stop, exit. A second signal skips the checkpoint. */

typedef struct learner_daemon_opts {
    const moerl_config_t *cfg; /* borrowed; validated */
    bool resume;               /* continue from the run's latest checkpoint (fresh if none) */
    bool allow_config_change;  /* resume a checkpoint saved under another config hash */
    const char *init_adapter;  /* PEFT directory to start from, or NULL */
    int ready_fd;              /* >= 0: "ready\n" is written there once bound, then closed */
    int metrics_port;          /* -1: metrics.http_port; 0: off; else this port */
    comm_t *comm;              /* learner.ranks > 1: the job's ranks (this is rank 0), or NULL */
    comm_t *device_comm;       /* learner.comm nccl: the MoE exchanges' ranks, or NULL */
} learner_daemon_opts_t;

void learner_daemon_opts_default(learner_daemon_opts_t *o, const moerl_config_t *cfg);

/* Runs the daemon until the run ends or it is stopped. MO_OK when it ended cleanly;
 * an error (with its message) when it cannot start (model, checkpoint,
 * endpoint in use, metrics port) or training fails. A second signal returns
 * MO_ESTATE. */
int learner_daemon_run(const learner_daemon_opts_t *o);

#ifdef __cplusplus
}
#endif
#endif
