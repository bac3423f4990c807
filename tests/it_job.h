/* it_job: helpers of the multi-process integration suites: a tiny random MoE model and a
 * job config on free loopback ports in a temporary directory, daemons and `moerl run`
 * started as real processes (output to log files), waits with deadlines, the learner's
 * metrics JSON lines, and `moerl ctl status --json`. */
#ifndef MOERL_TESTS_IT_JOB_H
#define MOERL_TESTS_IT_JOB_H

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "actor/init_model.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/zsock.h"

/* Under AddressSanitizer every process runs several times slower: fewer steps. */
#if defined(__SANITIZE_ADDRESS__)
#define IT_ASAN 1
#else
#define IT_ASAN 0
#endif

#define IT_PATH 512
#define IT_MAX_PROCS 16

typedef struct it_job {
    char dir[256];         /* the temporary directory */
    char model[IT_PATH];   /* dir/model: a tiny random Qwen3-MoE */
    char run[IT_PATH];     /* dir/run: run.dir */
    char config[IT_PATH];  /* dir/job.yaml */
    char metrics[IT_PATH]; /* dir/run/metrics/learner.jsonl */
    int port;              /* control; work +1, trajectories +2, weights +3, reward +4 + i */
    pid_t pids[IT_MAX_PROCS];
    int npids;
} it_job_t;

static inline double it_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static inline void it_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Every process and directory of the suite, so that a test that stops at a failed
 * CU_ASSERT_FATAL (before its it_close) leaves nothing running or behind: the exit
 * handler stops them. */
static struct {
    pid_t pids[64];
    int npids;
    char dirs[16][256];
    int ndirs;
    int registered;
} it_all;

static inline void it_stop_pid(pid_t pid) {
    if (pid <= 0 || waitpid(pid, NULL, WNOHANG) != 0)
        return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 1000; i++) { /* 20 s */
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return;
        struct timespec ts = {0, 20000000L};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    kill(-pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static inline void it_at_exit(void) {
    for (int i = 0; i < it_all.npids; i++)
        it_stop_pid(it_all.pids[i]);
    for (int i = 0; i < it_all.ndirs; i++)
        tu_rmtree(it_all.dirs[i]);
}

static inline void it_register(pid_t pid, const char *dir) {
    if (!it_all.registered) {
        atexit(it_at_exit);
        it_all.registered = 1;
    }
    if (pid > 0 && it_all.npids < 64)
        it_all.pids[it_all.npids++] = pid;
    if (dir && it_all.ndirs < 16)
        snprintf(it_all.dirs[it_all.ndirs++], sizeof it_all.dirs[0], "%s", dir);
}

/* n consecutive free tcp ports on 127.0.0.1, starting from a pid-dependent base. */
static inline int it_free_ports(int n) {
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    for (int attempt = 0; attempt < 200; attempt++) {
        int base = 20000 + (int)(((unsigned)getpid() * 131u + (unsigned)attempt * 977u) % 30000u);
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            char ep[64];
            snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", base + i);
            void *s = NULL;
            ok = zsock_bind(ctx, ZMQ_ROUTER, ep, &o, &s) == MO_OK;
            zsock_close(&s);
        }
        if (ok) {
            zmq_ctx_term(ctx);
            return base;
        }
    }
    zmq_ctx_term(ctx);
    return -1;
}

/* What the base sections of a job's YAML may vary. */
typedef struct it_base {
    int heartbeat_ms, lease_timeout_ms; /* transport */
    const char *transport_more;         /* more transport keys, "  key: value\n" lines */
    int routing_replay;                 /* model.routing_replay */
} it_base_t;

static inline it_base_t it_base_default(void) {
    return (it_base_t){200, 5000, "", 1};
}

/* The job's YAML: the base settings b, then `extra` (more sections, each at most once: a
 * section may not repeat). */
static inline void it_write_config_ex(it_job_t *j, const char *path, const char *extra,
                                      const it_base_t *b) {
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fprintf(f,
            "run:\n  name: it\n  dir: %s\n  seed: 11\n  threads: 1\n"
            "model:\n  path: %s\n  max_seq_len: 48\n  routing_replay: %s\n"
            "lora:\n  rank: 4\n  alpha: 8\n  targets: [q_proj, k_proj, v_proj, o_proj, experts]\n"
            "transport:\n  control: tcp://127.0.0.1:%d\n  work: tcp://127.0.0.1:%d\n"
            "  trajectories: tcp://127.0.0.1:%d\n  weights: tcp://127.0.0.1:%d\n"
            "  reward: tcp://127.0.0.1:%d\n  heartbeat_ms: %d\n  lease_timeout_ms: %d\n"
            "  max_msg_bytes: 1048576\n%s"
            "data:\n  task: arith\n  eval_size: 8\n",
            j->run, j->model, b->routing_replay ? "true" : "false", j->port, j->port + 1,
            j->port + 2, j->port + 3, j->port + 4, b->heartbeat_ms, b->lease_timeout_ms,
            b->transport_more ? b->transport_more : "");
    fputs(extra ? extra : "", f);
    fclose(f);
}

/* The job's YAML with the default base (heartbeat 200 ms, leases 5 s, routing replay). */
static inline void it_write_config(it_job_t *j, const char *path, const char *extra) {
    it_base_t b = it_base_default();
    it_write_config_ex(j, path, extra, &b);
}

/* The rollout, reward and learner sections of a test job. */
typedef struct it_knobs {
    int steps, rollouts, rewards, group_size, max_new_tokens;
    const char *reward_fn;
    const char *stop;         /* rollout.stop_strings as a flow list */
    const char *learner_more; /* more learner keys, "  key: value\n" lines, or "" */
} it_knobs_t;

static inline it_knobs_t it_knobs_default(void) {
    return (it_knobs_t){8, 2, 1, 4, 6, "regex:pattern=\"[0-9]\"", "[\"\\n\"]", ""};
}

static inline void it_sections(char *buf, size_t cap, const it_knobs_t *k) {
    snprintf(buf, cap,
             "rollout:\n  workers: %d\n  group_size: %d\n  prompts_per_step: 4\n"
             "  max_new_tokens: %d\n  stop_strings: %s\n  max_batch: 16\n"
             "reward:\n  workers: %d\n  function: '%s'\n"
             "learner:\n  steps: %d\n  lr: 1.0e-3\n  warmup_steps: 0\n  checkpoint_every: 2\n"
             "  keep_checkpoints: 0\n  max_staleness: 1\n  dynamic_sampling: false\n"
             "  overlong: keep\n  minibatches: 1\n%s",
             k->rollouts, k->group_size, k->max_new_tokens, k->stop, k->rewards, k->reward_fn,
             k->steps, k->learner_more);
}

/* A temporary directory with a tiny random model and a config (extra appended). */
static inline void it_open(it_job_t *j, const char *extra) {
    memset(j, 0, sizeof *j);
    CU_ASSERT_FATAL(tu_tmpdir(j->dir, sizeof j->dir) == 0);
    it_register(0, j->dir);
    snprintf(j->model, sizeof j->model, "%s/model", j->dir);
    snprintf(j->run, sizeof j->run, "%s/run", j->dir);
    snprintf(j->config, sizeof j->config, "%s/job.yaml", j->dir);
    snprintf(j->metrics, sizeof j->metrics, "%s/run/metrics/learner.jsonl", j->dir);
    model_config_t c;
    CU_ASSERT_FATAL(init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32) == MO_OK);
    init_model_opts_t io = {5, 0.1f};
    int rc = init_model_write(j->model, &c, &io);
    if (rc < 0)
        tu_report("init model: %s", mo_last_error());
    CU_ASSERT_FATAL(rc == MO_OK);
    j->port = it_free_ports(8);
    CU_ASSERT_FATAL(j->port > 0);
    it_write_config(j, j->config, extra);
}

/* it_open with base settings b instead of the defaults. */
static inline void it_open_ex(it_job_t *j, const char *extra, const it_base_t *b) {
    it_open(j, extra);
    it_write_config_ex(j, j->config, extra, b);
}

/* Starts argv (argv[0]: the program) with stdout and stderr appended to dir/<log>. */
static inline pid_t it_spawn(it_job_t *j, const char *log, const char *const *argv) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, log);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    if (j->npids < IT_MAX_PROCS)
        j->pids[j->npids++] = pid;
    it_register(pid, NULL);
    return pid;
}

/* Waits for pid at most timeout_ms: 1 with *status (waitpid's), 0 when it still runs. */
static inline int it_wait(pid_t pid, int timeout_ms, int *status) {
    double end = it_now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid)
            return 1;
        if (r < 0 || it_now_ms() > end)
            return 0;
        it_sleep_ms(20);
    }
}

/* Exit code of a process that exited (-1000 - signal when killed). */
static inline int it_exit_code(int status) {
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1000 - WTERMSIG(status);
}

/* Stops what is still running (SIGTERM: `moerl run` stops its daemons; SIGKILL after
 * 20 s) and removes the directory. */
static inline void it_close(it_job_t *j) {
    for (int i = 0; i < j->npids; i++)
        it_stop_pid(j->pids[i]);
    tu_rmtree(j->dir);
}

/* The whole text of a file (malloc'd) or NULL. */
static inline char *it_slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0, k;
    char *s = malloc(cap);
    while (s && (k = fread(s + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 == cap) {
            char *t = realloc(s, cap *= 2);
            if (!t) {
                free(s);
                s = NULL;
            }
            s = t;
        }
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

/* Prints the tail of a log file (for failures). */
static inline void it_dump(it_job_t *j, const char *log) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, log);
    char *s = it_slurp(path);
    if (!s)
        return;
    size_t n = strlen(s);
    fprintf(stderr, "\n---- %s (last 6000 bytes) ----\n%s\n----\n", log,
            n > 6000 ? s + n - 6000 : s);
    free(s);
}

/* The last line of a metrics JSON lines file whose "event" is event (NULL: any line),
 * parsed (cJSON_Delete it), or NULL. */
static inline cJSON *it_last_event(const char *path, const char *event) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *line = NULL;
    size_t cap = 0;
    cJSON *last = NULL;
    while (getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ev = o ? cJSON_GetObjectItemCaseSensitive(o, "event") : NULL;
        if (o && (!event || (cJSON_IsString(ev) && !strcmp(ev->valuestring, event)))) {
            cJSON_Delete(last);
            last = o;
        } else {
            cJSON_Delete(o);
        }
    }
    free(line);
    fclose(f);
    return last;
}

static inline double it_num(const cJSON *o, const char *key) {
    const cJSON *v = o ? cJSON_GetObjectItemCaseSensitive(o, key) : NULL;
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* The sum of every number whose key starts with prefix (labelled series). */
static inline double it_sum_prefix(const cJSON *o, const char *prefix) {
    double s = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, o) {
        if (v->string && !strncmp(v->string, prefix, strlen(prefix)) && cJSON_IsNumber(v))
            s += v->valuedouble;
    }
    return s;
}

/* The learner's step from its metrics file (-1 before the first step). */
static inline int it_step(it_job_t *j) {
    cJSON *o = it_last_event(j->metrics, "step");
    double s = it_num(o, "moerl_learner_step");
    cJSON_Delete(o);
    return isfinite(s) ? (int)s : -1;
}

/* Waits until the learner reached step (1), or timeout / pid exited (0). */
static inline int it_wait_step(it_job_t *j, int step, int timeout_ms, pid_t watch) {
    double end = it_now_ms() + timeout_ms;
    while (it_now_ms() < end) {
        if (it_step(j) >= step)
            return 1;
        if (watch > 0 && waitpid(watch, NULL, WNOHANG) == watch)
            return 0;
        it_sleep_ms(50);
    }
    return 0;
}

/* `moerl ctl --config CONFIG status --json`: the reply's status object (cJSON_Delete
 * the returned root; *status points into it), or NULL when nothing answered. */
static inline cJSON *it_ctl_status(it_job_t *j, const cJSON **status) {
    char cmd[2 * IT_PATH + 128];
    snprintf(cmd, sizeof cmd, "'%s' ctl --config '%s' --timeout 3000 status --json 2>/dev/null",
             tu_moerl_exe(), j->config);
    FILE *p = popen(cmd, "r");
    if (!p)
        return NULL;
    char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = 0;
    pclose(p);
    cJSON *root = cJSON_Parse(buf);
    *status = root ? cJSON_GetObjectItemCaseSensitive(root, "status") : NULL;
    if (!*status) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* Runs `moerl ctl --config CONFIG ARGS...` and returns its exit code. */
static inline int it_ctl(it_job_t *j, const char *args) {
    char cmd[2 * IT_PATH + 512];
    snprintf(cmd, sizeof cmd, "'%s' ctl --config '%s' %s >> '%s/ctl.log' 2>&1", tu_moerl_exe(),
             j->config, args, j->dir);
    int st = system(cmd);
    return st == -1 ? -1 : it_exit_code(st);
}

/* The pid `moerl run` logged for a process ("started NAME (pid N)" or "restarted NAME
 * (pid N", the latest), 0 when none. */
static inline pid_t it_logged_pid(it_job_t *j, const char *name) {
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/logs/run.log", j->run);
    char *s = it_slurp(path);
    if (!s)
        return 0;
    long pid = 0;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
        char who[64];
        long p;
        if ((sscanf(line, "started %63s (pid %ld)", who, &p) == 2 ||
             sscanf(line, "restarted %63s (pid %ld", who, &p) == 2) &&
            !strcmp(who, name))
            pid = p;
    }
    free(s);
    return (pid_t)pid;
}

/* Pauses the job without a race against its end: the rollout workers `pids` (n) are
 * stopped (SIGSTOP) while `moerl ctl pause` runs, so a short job on a fast machine cannot
 * train its last steps before the pause lands; they go on once it has (well within the
 * heartbeats they may miss). Returns the exit code of `moerl ctl pause`. */
static inline int it_pause_frozen(it_job_t *j, const pid_t *pids, int n) {
    for (int i = 0; i < n; i++)
        if (pids[i] > 0)
            kill(pids[i], SIGSTOP);
    int rc = it_ctl(j, "pause");
    for (int i = 0; i < n; i++)
        if (pids[i] > 0)
            kill(pids[i], SIGCONT);
    return rc;
}

/* Opens a job of `steps` steps (default sections), starts `moerl run` on it, waits
 * until the learner reached step `at` and pauses the job, so that it cannot finish while
 * the caller checks it. Returns the pid of `moerl run`, or 0 after a failed assertion. */
static inline pid_t it_start_paused(it_job_t *j, int steps, int at) {
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_open(j, extra);
    const char *argv[] = {tu_moerl_exe(), "run", j->config, "--no-status", NULL};
    pid_t run = it_spawn(j, "run.out", argv);
    int ok = it_wait_step(j, at, 120000, run);
    if (!ok)
        it_dump(j, "run.out");
    CU_ASSERT_FATAL(ok);
    pid_t rollouts[2] = {it_logged_pid(j, "rollout-0"), it_logged_pid(j, "rollout-1")};
    CU_ASSERT_FATAL(rollouts[0] > 0 && rollouts[1] > 0);
    CU_ASSERT_EQUAL_FATAL(it_pause_frozen(j, rollouts, 2), 0);
    return run;
}


#endif
