/* rollout daemon: `moerl rollout`: takes prompt leases from the learner, generates G
 * completions per prompt with the engine on a worker thread, has them scored by the
 * reward workers, pushes scored trajectory groups to the learner, and applies each new
 * adapter version between decode steps. */
#ifndef MOERL_ROLLOUT_DAEMON_H
#define MOERL_ROLLOUT_DAEMON_H

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lifecycle (docs/daemons.md):
 *   start: load model.path (weights and tokenizer), build the engine, connect the
 *          learner's control, work, trajectory and weights sockets and every reward
 *          endpoint; then "ready" (log line, and ready_fd).
 *   run:   hello until welcome; snapshot_request until the learner's adapter version is
 *          applied; then work_request with credits = free capacity (2 x max(1,
 *          rollout.max_batch / G) prompts, less those waiting or generating); each lease
 *          item is generated once the adapter is at least the lease's policy version;
 *          scored groups go to the trajectory sink; heartbeats every
 *          transport.heartbeat_ms carry the applied adapter version, and one is sent as
 *          soon as a new version is applied.
 *   stop:  SIGTERM/SIGINT: no more work is requested; prompts not yet started are
 *          dropped (the learner hands them out again when this worker's heartbeats stop
 *          or their lease deadline passes); prompts being generated are finished,
 *          scored and pushed, up to drain_ms; then exit. The learner's stop (the run is
 *          over) exits at once. A second signal exits at once. */

typedef struct rollout_daemon_opts {
    const moerl_config_t *cfg; /* borrowed; validated */
    int index;                 /* worker index K in [0, rollout.workers) */
    const char *worker_id;     /* NULL: "rollout-<index>" */
    int ready_fd;              /* >= 0: "ready\n" is written there once started, then closed */
    int metrics_port;          /* -1: metrics.http_port + 1 + index when http_port > 0;
                                * 0: off; else this port */
    int drain_ms;              /* longest drain at SIGTERM; 0: 30000 */
} rollout_daemon_opts_t;

void rollout_daemon_opts_default(rollout_daemon_opts_t *o, const moerl_config_t *cfg);

/* Runs the daemon until it stops. MO_OK after a clean stop; an error (with its
 * message) when it cannot start (model, tokenizer, engine, sockets, metrics port) or the
 * engine fails for good. A second signal returns MO_ESTATE. */
int rollout_daemon_run(const rollout_daemon_opts_t *o);

#ifdef __cplusplus
}
#endif
#endif
