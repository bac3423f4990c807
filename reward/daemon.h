/* reward daemon: `moerl reward`: serves score_request on the i-th reward endpoint with
 * a versioned, swappable reward function scored on a worker thread, and registers with
 * the learner's control socket (hello, heartbeats, reward_swap). */
#ifndef MOERL_REWARD_DAEMON_H
#define MOERL_REWARD_DAEMON_H

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lifecycle (docs/daemons.md):
 *   start: build the reward function from reward.function / reward.plugin (version 1),
 *          bind transport.reward's index-th endpoint, connect the learner's control
 *          socket, start serving; then "ready" (log line, and ready_fd).
 *   run:   hello until welcome (whose reward spec, when newer, is loaded), heartbeats
 *          every transport.heartbeat_ms, score requests on the worker thread, each
 *          group scored by one reward version that the reply carries; reward_swap
 *          installs a new version, or keeps the old one and answers the learner with
 *          an error saying why.
 *   stop:  SIGTERM/SIGINT or the learner's stop: no new requests are taken, requests
 *          being scored are answered (up to drain_ms), then exit. A second signal
 *          exits at once. */

typedef struct reward_daemon_opts {
    const moerl_config_t *cfg; /* borrowed; validated */
    int index;                 /* reward worker index i in [0, reward.workers) */
    const char *worker_id;     /* NULL: "reward-<index>" */
    int ready_fd;              /* >= 0: "ready\n" is written there once serving, then closed */
    int metrics_port;          /* -1: metrics.http_port + 1 + rollout.workers + index when
                                * http_port > 0; 0: off; else this port */
    int drain_ms;              /* longest wait for requests in progress at stop; 0: 5000 */
} reward_daemon_opts_t;

void reward_daemon_opts_default(reward_daemon_opts_t *o, const moerl_config_t *cfg);

/* Runs the daemon until it stops. MO_OK after a clean stop (signal, learner's stop);
 * an error (with its message) when it cannot start: bad reward function, endpoint in
 * use, metrics port in use, missing CURVE keys. A second signal returns MO_ESTATE. */
int reward_daemon_run(const reward_daemon_opts_t *o);

#ifdef __cplusplus
}
#endif
#endif
