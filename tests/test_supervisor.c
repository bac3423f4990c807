/* Tests for the supervisor with small /bin/sh children that print, crash, exit, trap or
 * ignore signals: outcomes (done, failed, interrupted), restarts with backoff and their
 * bound, SIGTERM then SIGKILL after the grace period, prefixed and logged output (long
 * lines, partial last lines, carriage returns), the status line, the environment, spawn
 * failures and bad specs. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"
#include "learner/supervisor.h"
#include "tests/testutil.h"

static char g_dir[200];

static void setup_dir(void) {
    CU_ASSERT_FATAL(tu_tmpdir(g_dir, sizeof g_dir) == 0);
}

static void opts_fast(sup_opts_t *o, FILE *term) {
    sup_opts_default(o);
    o->term = term;
    o->backoff_ms = 20;
    o->backoff_max_ms = 1000;
    o->grace_ms = 3000;
    o->settle_ms = 50;
    o->status_ms = 0;
}

static int add_sh(supervisor_t *s, const char *name, const char *script, bool primary,
                  bool restart) {
    const char *argv[] = {"/bin/sh", "-c", script, NULL};
    sup_proc_spec_t spec = {name, argv, primary, restart};
    return supervisor_add(s, &spec);
}

/* The whole contents of a stream or file (malloc'd, NUL-terminated). */
static char *slurp(FILE *f) {
    fflush(f);
    rewind(f);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    size_t k;
    while (buf && (k = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (cap - n - 1 == 0) {
            char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                return NULL;
            }
            buf = b;
            cap *= 2;
        }
    }
    if (buf)
        buf[n] = 0;
    return buf;
}

static char *slurp_path(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *s = slurp(f);
    fclose(f);
    return s;
}

/* A worker that runs until SIGTERM, then exits 0. */
#define WORKER_LOOP "trap 'echo bye; exit 0' TERM; echo up; while :; do sleep 0.05; done"
/* Waits (at most ~30 s) for a file to exist. */
#define WAIT_FOR(f) "n=0; while [ ! -f " f " ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done; "

static void test_primary_done_stops_workers(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    char logdir[512];
    snprintf(logdir, sizeof logdir, "%s/logs", g_dir);
    o.log_dir = logdir;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char script[1024];
    /* The primary waits until both workers are up, then finishes. */
    snprintf(script, sizeof script,
             WAIT_FOR("%s/w0") WAIT_FOR("%s/w1") "echo 'learning done'; exit 0", g_dir, g_dir);
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    char w0[1024], w1[1024];
    snprintf(w0, sizeof w0, "touch %s/w0; " WORKER_LOOP, g_dir);
    snprintf(w1, sizeof w1, "touch %s/w1; " WORKER_LOOP, g_dir);
    CU_ASSERT(add_sh(s, "rollout-0", w0, false, true) == MO_OK);
    CU_ASSERT(add_sh(s, "rollout-1", w1, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    CU_ASSERT_EQUAL(r.restarts, 0);
    CU_ASSERT(strstr(r.why, "learner finished") != NULL);
    for (int i = 0; i < 3; i++) {
        sup_proc_info_t info;
        CU_ASSERT_FATAL(supervisor_proc_info(s, i, &info) == MO_OK);
        CU_ASSERT(info.exited);
        CU_ASSERT_EQUAL(info.exit_status, 0); /* workers trapped SIGTERM and exited 0 */
        CU_ASSERT_EQUAL(info.term_signal, 0);
        CU_ASSERT(!info.killed);
        CU_ASSERT_EQUAL(info.starts, 1);
    }
    char *out = slurp(term);
    CU_ASSERT_FATAL(out != NULL);
    CU_ASSERT(strstr(out, "[learner] learning done\n") != NULL);
    CU_ASSERT(strstr(out, "[rollout-0] up\n") != NULL);
    CU_ASSERT(strstr(out, "[rollout-1] bye\n") != NULL);
    CU_ASSERT(strstr(out, "[run] started learner (pid ") != NULL);
    free(out);
    char path[1024];
    snprintf(path, sizeof path, "%s/rollout-1.log", logdir);
    char *log = slurp_path(path);
    CU_ASSERT(log && !strcmp(log, "up\nbye\n")); /* log files hold the raw lines */
    free(log);
    snprintf(path, sizeof path, "%s/run.log", logdir);
    log = slurp_path(path);
    CU_ASSERT(log && strstr(log, "learner finished") != NULL);
    free(log);
    fclose(term);
    supervisor_destroy(&s);
    CU_ASSERT(s == NULL);
    tu_rmtree(g_dir);
}

/* After the primary finishes, workers that exit by themselves within the settle time
 * are not signalled. */
static void test_workers_settle(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    o.settle_ms = 20000;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char script[1024], w[1024];
    snprintf(script, sizeof script, WAIT_FOR("%s/w0") "touch %s/done; exit 0", g_dir, g_dir);
    snprintf(w, sizeof w,
             "trap 'echo term; exit 5' TERM; touch %s/w0; " WAIT_FOR("%s/done") "echo told; exit 0",
             g_dir, g_dir);
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    CU_ASSERT(add_sh(s, "rollout-0", w, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT(info.exited && info.exit_status == 0 && info.term_signal == 0);
    char *out = slurp(term);
    CU_ASSERT(out && strstr(out, "[rollout-0] told\n") != NULL);
    CU_ASSERT(out && strstr(out, "[rollout-0] term") == NULL);
    CU_ASSERT(out && strstr(out, "SIGTERM") == NULL);
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

static void test_primary_failure(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char script[1024];
    snprintf(script, sizeof script,
             WAIT_FOR("%s/w0") "echo 'moerl learner: transport.work: address in use' >&2; "
                               "echo '-----' >&2; echo '  Exit code: 3' >&2; echo done; exit 3",
             g_dir);
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    char w0[1024];
    snprintf(w0, sizeof w0, "touch %s/w0; " WORKER_LOOP, g_dir);
    CU_ASSERT(add_sh(s, "reward-0", w0, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_FAILED);
    CU_ASSERT(strstr(r.why, "learner exited with status 3") != NULL);
    /* The process's own failure line, not the decoration after it. */
    CU_ASSERT(strstr(r.why, "learner exited with status 3: moerl learner: transport.work: "
                            "address in use") != NULL);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 0, &info) == MO_OK);
    CU_ASSERT_EQUAL(info.exit_status, 3);
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT(info.exited && info.exit_status == 0 && info.starts == 1);
    CU_ASSERT(supervisor_proc_info(s, 2, &info) == MO_EINVAL);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

/* Reads the start times (ns) a script appended to a file, one per line. */
static int read_times(const char *path, double *t, int cap) {
    FILE *f = fopen(path, "r");
    int n = 0;
    if (!f)
        return 0;
    while (n < cap && fscanf(f, "%lf", &t[n]) == 1)
        n++;
    fclose(f);
    return n;
}

static void test_restart_bound_and_backoff(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    o.max_restarts = 3;
    o.backoff_ms = 50;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    CU_ASSERT(add_sh(s, "learner", WORKER_LOOP, true, false) == MO_OK);
    char crash[1024];
    snprintf(crash, sizeof crash,
             "date +%%s%%N >> %s/starts; echo 'reward: bad plugin' >&2; "
             "kill -SEGV $$",
             g_dir);
    CU_ASSERT(add_sh(s, "reward-0", crash, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_FAILED);
    CU_ASSERT_EQUAL(r.restarts, 3);
    CU_ASSERT(strstr(r.why, "reward-0 failed 4 times in a row") != NULL);
    CU_ASSERT(strstr(r.why, "SIGSEGV") != NULL);
    CU_ASSERT(strstr(r.why, "bad plugin") != NULL);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT_EQUAL(info.starts, 4);
    CU_ASSERT_EQUAL(info.restarts, 3);
    CU_ASSERT_EQUAL(info.term_signal, SIGSEGV);
    CU_ASSERT(supervisor_proc_info(s, 0, &info) == MO_OK);
    CU_ASSERT(info.exited && info.exit_status == 0); /* the learner was stopped cleanly */
    /* The delays double: 50, 100, 200 ms (lower bounds; a restart is never early by more
     * than the loop's cached clock lags, far below 10 ms). */
    char path[1024];
    snprintf(path, sizeof path, "%s/starts", g_dir);
    double t[8];
    CU_ASSERT_FATAL(read_times(path, t, 8) == 4);
    for (int i = 1; i < 4; i++) {
        double gap_ms = (t[i] - t[i - 1]) / 1e6, want = 50.0 * (1 << (i - 1));
        if (gap_ms < want - 10)
            tu_report("restart %d after %.1f ms, expected at least %.0f", i, gap_ms, want);
        CU_ASSERT(gap_ms >= want - 10);
    }
    char *out = slurp(term);
    CU_ASSERT(out && strstr(out, "[run] reward-0 was killed by SIGSEGV; restarting in 0.1 s "
                                 "(2 of at most 3 in a row)") != NULL);
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

static void test_restart_then_done(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char primary[1024], worker[1024], quitter[1024];
    /* The worker crashes on its first start and stays up on its second; the primary
     * finishes once the second instance is up. */
    snprintf(
        worker, sizeof worker,
        "if [ ! -f %s/crashed ]; then touch %s/crashed; exit 7; fi; touch %s/again; " WORKER_LOOP,
        g_dir, g_dir, g_dir);
    snprintf(primary, sizeof primary, WAIT_FOR("%s/again") WAIT_FOR("%s/quit") "exit 0", g_dir,
             g_dir);
    snprintf(quitter, sizeof quitter, "touch %s/quit; exit 0", g_dir);
    CU_ASSERT(add_sh(s, "learner", primary, true, false) == MO_OK);
    CU_ASSERT(add_sh(s, "rollout-0", worker, false, true) == MO_OK);
    /* A worker that exits 0 by itself is not restarted and does not end the job. */
    CU_ASSERT(add_sh(s, "rollout-1", quitter, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    CU_ASSERT_EQUAL(r.restarts, 1);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT_EQUAL(info.starts, 2);
    CU_ASSERT(info.exit_status == 0 && info.term_signal == 0);
    CU_ASSERT(supervisor_proc_info(s, 2, &info) == MO_OK);
    CU_ASSERT_EQUAL(info.starts, 1);
    char *out = slurp(term);
    CU_ASSERT(out && strstr(out, "rollout-0 exited with status 7; restarting in 0.0 s") != NULL);
    CU_ASSERT(out && strstr(out, "rollout-1 exited 0; not restarted") != NULL);
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

static void test_signal_stops_everything(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    o.grace_ms = 300;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char w0[1024], stubborn[1024], killer[1024];
    snprintf(w0, sizeof w0, "touch %s/w0; " WORKER_LOOP, g_dir);
    /* Ignores SIGTERM: only SIGKILL ends it. */
    snprintf(stubborn, sizeof stubborn, "trap '' TERM; touch %s/w1; while :; do sleep 0.05; done",
             g_dir);
    /* Sends SIGTERM to the supervisor (its parent) once the others are up. */
    snprintf(killer, sizeof killer,
             WAIT_FOR("%s/w0") WAIT_FOR("%s/w1") "kill -TERM $PPID; " WORKER_LOOP, g_dir, g_dir);
    CU_ASSERT(add_sh(s, "learner", w0, true, false) == MO_OK);
    CU_ASSERT(add_sh(s, "rollout-0", stubborn, false, true) == MO_OK);
    CU_ASSERT(add_sh(s, "reward-0", killer, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_INTERRUPTED);
    CU_ASSERT_EQUAL(r.signal, SIGTERM);
    CU_ASSERT(strstr(r.why, "interrupted by SIGTERM") != NULL);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 0, &info) == MO_OK);
    CU_ASSERT(info.exited && info.exit_status == 0 && !info.killed);
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT(info.exited && info.killed && info.term_signal == SIGKILL);
    CU_ASSERT_EQUAL(info.starts, 1); /* not restarted while stopping */
    CU_ASSERT(supervisor_proc_info(s, 2, &info) == MO_OK);
    CU_ASSERT(info.exited && info.exit_status == 0);
    char *out = slurp(term);
    CU_ASSERT(out && strstr(out, "rollout-0 did not stop within 0.3 s: sending SIGKILL") != NULL);
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

static void test_spawn_failure_and_bad_specs(void) {
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    const char *missing[] = {"/nonexistent/moerl", "learner", NULL};
    sup_proc_spec_t spec = {"learner", missing, true, false};
    CU_ASSERT(supervisor_add(s, &spec) == MO_OK);
    CU_ASSERT(add_sh(s, "learner", "exit 0", false, true) == MO_EINVAL); /* duplicate */
    CU_ASSERT(add_sh(s, "other", "exit 0", true, false) == MO_EINVAL);   /* 2nd primary */
    CU_ASSERT(strstr(mo_last_error(), "already the primary") != NULL);
    CU_ASSERT(add_sh(s, "bad name", "exit 0", false, true) == MO_EINVAL); /* space */
    CU_ASSERT(add_sh(s, "run", "exit 0", false, true) == MO_EINVAL);      /* reserved */
    CU_ASSERT(add_sh(s, "", "exit 0", false, true) == MO_EINVAL);
    const char *empty[] = {NULL};
    sup_proc_spec_t e = {"x", empty, false, true};
    CU_ASSERT(supervisor_add(s, &e) == MO_EINVAL);
    CU_ASSERT(add_sh(s, "rollout-0", WORKER_LOOP, false, true) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_FAILED);
    CU_ASSERT(strstr(r.why, "cannot start learner (/nonexistent/moerl)") != NULL);
    sup_proc_info_t info;
    CU_ASSERT(supervisor_proc_info(s, 1, &info) == MO_OK);
    CU_ASSERT_EQUAL(info.starts, 0); /* the job ended before it was started */
    CU_ASSERT(supervisor_run(s, &r) == MO_ESTATE);
    CU_ASSERT(add_sh(s, "late", "exit 0", false, true) == MO_ESTATE);
    supervisor_destroy(&s);
    fclose(term);

    sup_opts_default(&o);
    o.backoff_ms = 100;
    o.backoff_max_ms = 50;
    CU_ASSERT(supervisor_new(&o, &s) == MO_EINVAL);
    CU_ASSERT(s == NULL);
}

/* Output framing: a line longer than the buffer is split, a last line without a
 * newline is kept, carriage returns at line ends are dropped, stderr is prefixed too;
 * extra environment reaches the process. */
static void test_output_and_env(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    const char *env[] = {"MOERL_TEST_VAR=hello-env", "HOME=/moerl-test-home", NULL};
    o.env = env;
    char logdir[512];
    snprintf(logdir, sizeof logdir, "%s/logs", g_dir);
    o.log_dir = logdir;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    const char *script = "printf 'a%.0s' $(seq 1 5000); printf '\\n'; echo \"$MOERL_TEST_VAR\"; "
                         "echo \"home $HOME\"; printf 'crlf\\r\\n'; echo oops >&2; "
                         "printf 'tail-no-newline'";
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    char *out = slurp(term);
    CU_ASSERT_FATAL(out != NULL);
    CU_ASSERT(strstr(out, "[learner] hello-env\n") != NULL);
    CU_ASSERT(strstr(out, "[learner] home /moerl-test-home\n") != NULL);
    CU_ASSERT(strstr(out, "[learner] crlf\n") != NULL);
    CU_ASSERT(strstr(out, "[learner] oops\n") != NULL);
    CU_ASSERT(strstr(out, "[learner] tail-no-newline\n") != NULL);
    free(out);
    char path[1024];
    snprintf(path, sizeof path, "%s/learner.log", logdir);
    char *log = slurp_path(path);
    CU_ASSERT_FATAL(log != NULL);
    /* 5000 a's: one full buffer, then the rest. */
    size_t first = strspn(log, "a");
    CU_ASSERT_EQUAL(first, (size_t)SUP_LINE_MAX);
    CU_ASSERT_EQUAL(log[first], '\n');
    CU_ASSERT_EQUAL(strspn(log + first + 1, "a"), (size_t)(5000 - SUP_LINE_MAX));
    free(log);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

/* The supervisor ignores SIGPIPE while it runs; its processes start with the default
 * disposition (SIGPIPE ends them, as it would without a supervisor). */
static void test_sigpipe_default_in_children(void) {
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    CU_ASSERT(add_sh(s, "learner", "kill -PIPE $$; echo survived", true, false) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_FAILED);
    CU_ASSERT(strstr(r.why, "learner was killed by SIGPIPE") != NULL);
    struct sigaction now;
    CU_ASSERT(sigaction(SIGPIPE, NULL, &now) == 0 && now.sa_handler == SIG_DFL); /* restored */
    fclose(term);
    supervisor_destroy(&s);
}

/* A status callback that reports news three times, refreshes in between, then stops. */
typedef struct status_state {
    int calls;
    char done_file[1024];
} status_state_t;

static int status_cb(void *ud, char *buf, size_t cap) {
    status_state_t *st = ud;
    st->calls++;
    if (st->calls > 6) {
        FILE *f = fopen(st->done_file, "w");
        if (f)
            fclose(f);
        return SUP_STATUS_NONE;
    }
    snprintf(buf, cap, "step %d/3", (st->calls + 1) / 2);
    return st->calls % 2 ? SUP_STATUS_NEWS : SUP_STATUS_REDRAW;
}

static void test_status_line(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    o.status_ms = 10;
    status_state_t st = {0};
    snprintf(st.done_file, sizeof st.done_file, "%s/status-done", g_dir);
    o.status = status_cb;
    o.status_ud = &st;
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char script[1024];
    snprintf(script, sizeof script, WAIT_FOR("%s/status-done") "exit 0", g_dir);
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    CU_ASSERT(st.calls >= 7);
    char *out = slurp(term);
    CU_ASSERT_FATAL(out != NULL);
    /* Not a terminal: each piece of news once, as a line. */
    const char *p = out;
    for (int i = 1; i <= 3; i++) {
        char want[32];
        snprintf(want, sizeof want, "[run] step %d/3\n", i);
        const char *q = strstr(p, want);
        CU_ASSERT(q != NULL);
        if (q) {
            CU_ASSERT(strstr(q + 1, want) == NULL);
            p = q;
        }
    }
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

/* A process whose child keeps the output pipe open after it exits does not hold the
 * job up. */
static void test_grandchild_holding_pipe(void) {
    setup_dir();
    FILE *term = tmpfile();
    sup_opts_t o;
    opts_fast(&o, term);
    supervisor_t *s = NULL;
    CU_ASSERT_FATAL(supervisor_new(&o, &s) == MO_OK);
    char script[1024];
    snprintf(script, sizeof script, "sleep 20 & echo $! > %s/pid; echo started; exit 0", g_dir);
    CU_ASSERT(add_sh(s, "learner", script, true, false) == MO_OK);
    sup_result_t r;
    CU_ASSERT_FATAL(supervisor_run(s, &r) == MO_OK);
    CU_ASSERT_EQUAL(r.outcome, SUP_DONE);
    char path[1024];
    snprintf(path, sizeof path, "%s/pid", g_dir);
    FILE *f = fopen(path, "r");
    long pid = 0;
    CU_ASSERT(f && fscanf(f, "%ld", &pid) == 1 && pid > 1);
    if (f)
        fclose(f);
    if (pid > 1)
        kill((pid_t)pid, SIGKILL);
    char *out = slurp(term);
    CU_ASSERT(out && strstr(out, "[learner] started\n") != NULL);
    free(out);
    fclose(term);
    supervisor_destroy(&s);
    tu_rmtree(g_dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"primary done stops workers", test_primary_done_stops_workers},
        {"workers settle", test_workers_settle},
        {"primary failure", test_primary_failure},
        {"restart bound and backoff", test_restart_bound_and_backoff},
        {"restart then done", test_restart_then_done},
        {"signal stops everything", test_signal_stops_everything},
        {"spawn failure and bad specs", test_spawn_failure_and_bad_specs},
        {"output and env", test_output_and_env},
        {"sigpipe default in children", test_sigpipe_default_in_children},
        {"status line", test_status_line},
        {"grandchild holding pipe", test_grandchild_holding_pipe},
        CU_TEST_INFO_NULL,
    };
    return tu_main("supervisor", tests);
}
