/* supervisor: runs a job's processes on one libuv loop: spawns them with their output
 * piped, prefixed ("[rollout-0] ...") onto the terminal and copied into per-process log
 * files, restarts crashed workers with bounded retries and exponential backoff, keeps a
 * live status line, and stops everything cleanly (SIGTERM, grace period, SIGKILL) on
 * SIGINT/SIGTERM or when the primary process (the learner) exits. */
#ifndef MOERL_LEARNER_SUPERVISOR_H
#define MOERL_LEARNER_SUPERVISOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SUP_MAX_PROCS 1024
#define SUP_NAME_MAX 64   /* process names: [A-Za-z0-9._-], 1..63 bytes */
#define SUP_LINE_MAX 4096 /* longer output lines are split */

/* One process of the job. The strings are copied by supervisor_add. */
typedef struct sup_proc_spec {
    const char *name;        /* "learner", "rollout-0": the log prefix and <name>.log */
    const char *const *argv; /* NULL-terminated; argv[0] is the program (PATH searched) */
    bool primary;            /* its exit ends the job: 0 done, anything else failed */
    bool restart;            /* restarted when it fails while the job runs */
} sup_proc_spec_t;

/* What the status callback returns. */
enum {
    SUP_STATUS_NONE = 0,   /* nothing to show */
    SUP_STATUS_NEWS = 1,   /* a line with news: drawn on a terminal, printed otherwise */
    SUP_STATUS_REDRAW = 2, /* the same news, refreshed (elapsed time): terminal only */
};

typedef struct sup_opts {
    const char *log_dir;    /* <name>.log of each process and run.log are appended here
                             * (created when missing); NULL = no log files */
    FILE *term;             /* where prefixed lines go; NULL = nowhere */
    bool term_is_tty;       /* keep the status line on the terminal's last row */
    int max_restarts;       /* restarts of one process in a row before the job fails (5) */
    int backoff_ms;         /* delay before the first restart, doubling after (500) */
    int backoff_max_ms;     /* longest delay (30000) */
    int stable_ms;          /* a process that ran this long starts counting again (60000) */
    int grace_ms;           /* after SIGTERM, SIGKILL to whatever still runs (10000) */
    int settle_ms;          /* after the primary exits 0, time the others get to exit by
                             * themselves before SIGTERM (3000) */
    int status_ms;          /* status callback period; 0 = no status line (1000) */
    bool handle_signals;    /* SIGINT, SIGTERM and SIGHUP stop the job (true) */
    const char *const *env; /* NULL-terminated "KEY=VALUE" added to (or replacing in) the
                             * inherited environment of every process; may be NULL */
    /* Called every status_ms on the loop: writes one line (no newline) into buf and
     * returns SUP_STATUS_*. */
    int (*status)(void *ud, char *buf, size_t cap);
    void *status_ud;
} sup_opts_t;

/* The values in parentheses above; no log dir, no terminal, no status. */
void sup_opts_default(sup_opts_t *o);

typedef enum {
    SUP_DONE = 0,        /* the primary exited 0 */
    SUP_FAILED = 1,      /* the primary failed, a worker failed too often, or a spawn failed */
    SUP_INTERRUPTED = 2, /* a signal stopped the job */
} sup_outcome_t;

typedef struct sup_result {
    sup_outcome_t outcome;
    int signal;     /* SUP_INTERRUPTED: the signal received */
    int restarts;   /* restarts of all processes */
    char why[1024]; /* one line: what ended the job */
} sup_result_t;

/* What became of one process (its latest instance). */
typedef struct sup_proc_info {
    const char *name;
    int starts;   /* instances started */
    int restarts; /* starts - 1, unless a spawn failed */
    int64_t pid;  /* of the latest instance; 0 when none started */
    bool exited;  /* the latest instance has exited */
    int64_t exit_status;
    int term_signal; /* 0 when it exited by itself */
    bool killed;     /* the supervisor sent it SIGKILL */
} sup_proc_info_t;

typedef struct supervisor supervisor_t;

/* A supervisor with options o (copied; the strings must outlive it). */
int supervisor_new(const sup_opts_t *o, supervisor_t **out);
void supervisor_destroy(supervisor_t **s);
/* Adds a process (before supervisor_run). MO_EINVAL for a bad name, a duplicate name,
 * an empty argv or a second primary. */
int supervisor_add(supervisor_t *s, const sup_proc_spec_t *spec);
/* Starts every process, in the order added, and runs until the job ends and every
 * process has exited. Returns 0 with *res describing the outcome (failures of the job
 * are outcomes, not errors); errors are for the supervisor itself (log files, the
 * event loop). Runs once per supervisor. */
int supervisor_run(supervisor_t *s, sup_result_t *res);
int supervisor_nprocs(const supervisor_t *s);
/* Process i (in the order added); MO_EINVAL when out of range. */
int supervisor_proc_info(const supervisor_t *s, int i, sup_proc_info_t *out);
/* Prints "[run] " + the message on the terminal (above the status line) and into
 * run.log (which stays open until supervisor_destroy), during and after the run. */
void supervisor_say(supervisor_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif
#endif
