/* runner: what `moerl run` starts for a job config: the run directory (the resolved
 * config every daemon reads, logs/), the checks made before anything starts (CURVE keys,
 * endpoints free, the model directory, mpirun), the command line of every daemon
 * (mpirun for a multi-rank learner), and the live status line read from the learner's
 * metrics JSON lines. */
#ifndef MOERL_LEARNER_RUNNER_H
#define MOERL_LEARNER_RUNNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/config.h"
#include "learner/supervisor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RUNNER_PATH_MAX 4096

/* Where a run keeps its files. */
typedef struct runner_paths {
    char run_dir[RUNNER_PATH_MAX]; /* run.dir, or runs/<run.name> */
    char config[RUNNER_PATH_MAX];  /* <run>/config.yaml: the resolved config */
    char logs[RUNNER_PATH_MAX];    /* <run>/logs: <process>.log and run.log */
    char metrics[RUNNER_PATH_MAX]; /* <run>/metrics/learner.jsonl */
} runner_paths_t;

int runner_paths(const moerl_config_t *c, runner_paths_t *p);

/* Creates the run directory and logs/, and writes the resolved config (config_dump,
 * through a temporary file renamed into place). Without resume, a run directory that
 * already holds a checkpoint is refused (MO_ESTATE saying to pass --resume or choose
 * another run.dir); with resume, a run without one starts at step 0 (as the learner
 * does). */
int runner_prepare(const moerl_config_t *c, bool resume, const runner_paths_t *p);

/* Checks made before anything starts, each failing with MO_ECONFIG (or MO_EIO) and a
 * message naming the key: CURVE key files readable and consistent, every endpoint
 * allowed by the loopback-or-CURVE policy, every tcp endpoint the job
 * binds free on this machine (the learner's four, the reward workers' M), model.path a
 * directory with a config.json. */
int runner_preflight(const moerl_config_t *c);

/* One process of the job. */
typedef struct runner_proc {
    char name[SUP_NAME_MAX]; /* "learner", "rollout-0", "reward-0" */
    char **argv;             /* NULL-terminated, malloc'd */
    bool primary, restart;
} runner_proc_t;

typedef struct runner_plan {
    runner_proc_t *procs; /* (n): the learner, rollout-0..K-1, reward-0..M-1 */
    int n;
} runner_plan_t;

typedef struct runner_plan_opts {
    const char *exe;    /* the moerl executable */
    const char *config; /* the resolved config path every daemon reads */
    bool resume;        /* the learner continues from the latest checkpoint */
    const char *mpirun; /* mpirun's path, used when learner.ranks > 1 */
    bool as_root;       /* add --allow-run-as-root --oversubscribe to mpirun */
} runner_plan_opts_t;

/* The command lines: `EXE learner CONFIG [--resume]` (under `MPIRUN -np N [...]` when
 * learner.ranks > 1), `EXE rollout CONFIG --worker-id K`, `EXE reward CONFIG
 * --worker-id I`. The learner is the primary process; workers are restarted. */
int runner_plan(const moerl_config_t *c, const runner_plan_opts_t *o, runner_plan_t *out);
void runner_plan_free(runner_plan_t *p);

/* The full path of a program found in PATH (or a path as given when it has a '/'),
 * MO_ENOTFOUND when there is none. */
int runner_which(const char *prog, char *out, size_t cap);

/* ---- The live status line ---- */

/* Follows the learner's metrics JSON lines (appended as the job runs) and makes the
 * status line: "step 12/50 [#####-----] reward 0.41 | acc 0.62 | 1.2k tok/s | sync
 * 35 ms | 1m02s", or "waiting for the first step ..." before one was written. */
typedef struct runner_status {
    char path[RUNNER_PATH_MAX];
    long offset;        /* bytes of the file consumed */
    char partial[8192]; /* an incomplete last line, kept until its newline arrives */
    size_t plen;
    bool skipping;                                  /* inside a line longer than partial: dropped */
    int64_t steps;                                  /* learner.steps, for the bar */
    double start_ms;                                /* monotonic clock at init */
    int64_t step;                                   /* -1 until a step line was read */
    double reward, accuracy, tokens_per_s, sync_ms; /* NaN when not reported */
    int64_t shown_step;                             /* the step of the last SUP_STATUS_NEWS */
} runner_status_t;

void runner_status_init(runner_status_t *st, const char *metrics_path, int64_t steps);
/* Reads what was appended since the last call and writes the line into buf. Returns
 * SUP_STATUS_NEWS when the step changed, else SUP_STATUS_REDRAW (a sup_opts_t status
 * callback: ud is the runner_status_t). */
int runner_status_poll(void *ud, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
