/* Integration tests of the daemons as real processes (`moerl learner`, `moerl rollout`,
 * `moerl reward`) on a tiny random MoE model, talking over ipc:// sockets in a temporary
 * directory: a 3-step job with 2 rollout workers and 1 reward worker completes with every
 * daemon exiting 0, 3 step lines in the learner's metrics, no duplicate and no lost group,
 * and a final checkpoint, and `--resume` continues it for two more steps; a bad configuration, a
 * missing option, a bad reward function and an endpoint already in use fail at once with the
 * reason; SIGTERM to the learner mid-run stops every daemon cleanly (exit 0) after a checkpoint;
 * `ctl` requests on the control socket (status, reward swaps that succeed and fail, pause, resume)
 * are answered while a rollout worker stopped by SIGTERM drains and the job finishes with the other
 * one. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <zmq.h>

#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/zsock.h"

/* Limits that only a broken run reaches; they turn a hang into a failure. */
#define JOB_LIMIT_MS 240000
#define QUICK_LIMIT_MS 60000

static char g_dir[512];   /* the suite's temporary directory */
static char g_model[700]; /* tiny model, written once */
static int g_job;         /* jobs written so far: each gets its own directory */

/* ---- Processes ---- */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Starts `moerl args...` with stdout and stderr into log. */
static pid_t spawn(const char *log, const char *const *args) {
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    const char *argv[32];
    int n = 0;
    argv[n++] = tu_moerl_exe();
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    execv(argv[0], (char *const *)argv);
    _exit(127);
}

/* The exit status of pid, or -1 (after killing it) when it outlives limit_ms. */
static int wait_exit(pid_t pid, int limit_ms) {
    double until = now_ms() + limit_ms;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_ms() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            tu_report("process %d still running after %d ms: killed", (int)pid, limit_ms);
            return -1;
        }
        sleep_ms(20);
    }
}

/* Waits for a worker that the learner should have told to stop. A worker that
 * started after the learner had already left was never told (workers wait for
 * a learner by design); it is stopped with SIGTERM, as moerl run does, and must
 * then drain and exit 0 too. */
static int wait_worker(pid_t pid) {
    double until = now_ms() + 10000;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_ms() > until)
            break;
        sleep_ms(20);
    }
    tu_report("worker %d still running 10 s after the learner: sending SIGTERM", (int)pid);
    kill(pid, SIGTERM);
    return wait_exit(pid, QUICK_LIMIT_MS);
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = '\0';
    fclose(f);
    return s;
}

/* 1 when the file at path contains text. */
static int file_has(const char *path, const char *text) {
    char *s = read_file(path);
    int ok = s && strstr(s, text) != NULL;
    if (!ok)
        tu_report("%s lacks \"%s\"; it holds:\n%s", path, text, s ? s : "(unreadable)");
    free(s);
    return ok;
}

/* Lines of a JSON lines file whose "event" is event. */
static int count_events(const char *path, const char *event) {
    char *s = read_file(path);
    char want[64];
    snprintf(want, sizeof want, "\"event\": \"%s\"", event);
    int n = 0;
    for (const char *p = s; p && (p = strstr(p, want)); p++)
        n++;
    free(s);
    return n;
}

/* A number from the last line of a JSON lines file; NaN when absent. */
static double last_value(const char *path, const char *key) {
    char *s = read_file(path);
    double v = 0.0 / 0.0;
    if (!s)
        return v;
    size_t n = strlen(s);
    while (n > 0 && s[n - 1] == '\n')
        s[--n] = '\0';
    char *line = strrchr(s, '\n');
    cJSON *o = cJSON_Parse(line ? line + 1 : s);
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsNumber(x))
        v = x->valuedouble;
    cJSON_Delete(o);
    free(s);
    return v;
}

/* ---- Jobs ---- */

typedef struct job {
    char dir[800], cfg[900], run[900], metrics[1000];
    pid_t learner, reward, rollout[2];
    char log_l[1000], log_w[1000], log_r[2][1000];
} job_t;

/* A job directory with its config: ipc:// endpoints inside it, `steps` steps. */
static void job_write(job_t *j, int steps, const char *extra) {
    memset(j, 0, sizeof *j);
    snprintf(j->dir, sizeof j->dir, "%s/j%d", g_dir, g_job++);
    CU_ASSERT_EQUAL_FATAL(mkdir(j->dir, 0755), 0);
    snprintf(j->cfg, sizeof j->cfg, "%s/job.yaml", j->dir);
    snprintf(j->run, sizeof j->run, "%s/run", j->dir);
    snprintf(j->metrics, sizeof j->metrics, "%s/metrics", j->run);
    snprintf(j->log_l, sizeof j->log_l, "%s/learner.log", j->dir);
    snprintf(j->log_w, sizeof j->log_w, "%s/reward.log", j->dir);
    for (int k = 0; k < 2; k++)
        snprintf(j->log_r[k], sizeof j->log_r[k], "%s/rollout-%d.log", j->dir, k);
    FILE *f = fopen(j->cfg, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fprintf(f,
            "run: {name: it, dir: %s, seed: 11, threads: 1}\n"
            "model: {path: %s, max_seq_len: 48}\n"
            "lora: {rank: 2, alpha: 4, targets: [q_proj, v_proj, experts]}\n"
            "rollout: {workers: 2, group_size: 2, prompts_per_step: 2, max_new_tokens: 4,\n"
            "          max_batch: 4, record_prompt_routing: true}\n"
            "reward: {workers: 1, function: arith_exact}\n"
            "learner: {steps: %d, checkpoint_every: 2, max_staleness: 1,\n"
            "          micro_batch_tokens: 256}\n"
            "data: {task: arith, eval_size: 0}\n"
            "transport:\n"
            "  control: ipc://%s/c\n  work: ipc://%s/w\n  trajectories: ipc://%s/t\n"
            "  weights: ipc://%s/p\n  reward: ipc://%s/r\n"
            "  heartbeat_ms: 200\n  lease_timeout_ms: 20000\n"
            "metrics: {http_port: 0}\n%s",
            j->run, g_model, steps, j->dir, j->dir, j->dir, j->dir, j->dir, extra ? extra : "");
    fclose(f);
}

static void job_start(job_t *j) {
    const char *l[] = {"learner", j->cfg, NULL};
    j->learner = spawn(j->log_l, l);
    const char *w[] = {"reward", j->cfg, "--worker-id", "0", NULL};
    j->reward = spawn(j->log_w, w);
    const char *r0[] = {"rollout", j->cfg, "--worker-id", "0", NULL};
    const char *r1[] = {"rollout", j->cfg, "--worker-id", "1", NULL};
    j->rollout[0] = spawn(j->log_r[0], r0);
    j->rollout[1] = spawn(j->log_r[1], r1);
}

/* Waits for every daemon; asserts each exited 0. */
static void job_wait_clean(job_t *j) {
    int sl = wait_exit(j->learner, JOB_LIMIT_MS);
    int sw = wait_worker(j->reward);
    int s0 = wait_worker(j->rollout[0]);
    int s1 = wait_worker(j->rollout[1]);
    const char *logs[4] = {j->log_l, j->log_w, j->log_r[0], j->log_r[1]};
    int st[4] = {sl, sw, s0, s1};
    for (int i = 0; i < 4; i++) {
        if (st[i] != 0) {
            char *s = read_file(logs[i]);
            tu_report("%s: exit status %d:\n%s", logs[i], st[i], s ? s : "");
            free(s);
        }
        CU_ASSERT_EQUAL(st[i], 0);
    }
}

static void metrics_path(const job_t *j, const char *daemon, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s.jsonl", j->metrics, daemon);
}

/* ---- Tests ---- */

static job_t g_done; /* the completed job, resumed by test_resume */

static void test_job_completes(void) {
    job_t j;
    job_write(&j, 3, NULL);
    job_start(&j);
    job_wait_clean(&j);
    char lm[1100], rm[2][1100], wm[1100], latest[1100];
    metrics_path(&j, "learner", lm, sizeof lm);
    metrics_path(&j, "rollout-0", rm[0], sizeof rm[0]);
    metrics_path(&j, "rollout-1", rm[1], sizeof rm[1]);
    metrics_path(&j, "reward-0", wm, sizeof wm);
    CU_ASSERT_EQUAL(count_events(lm, "step"), 3);
    CU_ASSERT_EQUAL(count_events(lm, "final"), 1);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_step"), 3);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_policy_version"), 3);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_duplicate_groups_total"), 0);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_failed_groups_total"), 0);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_unknown_groups_total"), 0);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_malformed_groups_total"), 0);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_groups_trained_total"), 6);
    /* no group lost: everything accepted was trained or still waits; everything the
     * rollouts sent was accepted, or was a counted duplicate or stale group */
    double rx = last_value(lm, "moerl_learner_groups_received_total");
    double waiting = last_value(lm, "moerl_learner_waiting_groups");
    double stale = last_value(lm, "moerl_learner_stale_groups_total");
    CU_ASSERT_EQUAL(rx, 6 + waiting + stale);
    double pushed = last_value(rm[0], "moerl_rollout_groups_pushed_total") +
                    last_value(rm[1], "moerl_rollout_groups_pushed_total");
    CU_ASSERT(pushed >= rx);
    CU_ASSERT_EQUAL(last_value(wm, "moerl_reward_failures_total"), 0);
    CU_ASSERT(last_value(wm, "moerl_reward_groups_total") >= rx);
    CU_ASSERT(last_value(rm[0], "moerl_rollout_adapter_version") >= 2);
    CU_ASSERT(file_has(j.log_l, "learner: ready: "));
    CU_ASSERT(file_has(j.log_l, "all 3 steps done"));
    CU_ASSERT(file_has(j.log_r[0], "the learner asked to stop"));
    CU_ASSERT(file_has(j.log_w, "reward version 1"));
    snprintf(latest, sizeof latest, "%s/checkpoints/latest", j.run);
    CU_ASSERT(file_has(latest, "step-000003"));
    g_done = j;
}

/* lora.train_router and lora.train_norms: the learner publishes the routers and norms
 * with the adapter, the rollouts (unmerged) apply them, the checkpoint holds them as
 * PEFT modules_to_save. */
static void test_full_tensors_job(void) {
    job_t j;
    job_write(&j, 2, NULL);
#define FULL_SETS "--set", "lora.train_router=true", "--set", "lora.train_norms=true"
    const char *l[] = {"learner", j.cfg, FULL_SETS, NULL};
    const char *w[] = {"reward", j.cfg, "--worker-id", "0", NULL};
    const char *r0[] = {"rollout", j.cfg, "--worker-id", "0", FULL_SETS, NULL};
    const char *r1[] = {"rollout", j.cfg, "--worker-id", "1", FULL_SETS, NULL};
#undef FULL_SETS
    j.learner = spawn(j.log_l, l);
    j.reward = spawn(j.log_w, w);
    j.rollout[0] = spawn(j.log_r[0], r0);
    j.rollout[1] = spawn(j.log_r[1], r1);
    job_wait_clean(&j);
    char lm[1100], rm[2][1100], acfg[1200];
    metrics_path(&j, "learner", lm, sizeof lm);
    metrics_path(&j, "rollout-0", rm[0], sizeof rm[0]);
    metrics_path(&j, "rollout-1", rm[1], sizeof rm[1]);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_step"), 2);
    CU_ASSERT(last_value(rm[0], "moerl_rollout_adapter_version") >= 1 ||
              last_value(rm[1], "moerl_rollout_adapter_version") >= 1);
    snprintf(acfg, sizeof acfg, "%s/checkpoints/step-000002/adapter/adapter_config.json", j.run);
    CU_ASSERT(file_has(acfg, "\"modules_to_save\""));
    CU_ASSERT(file_has(acfg, "\"input_layernorm\""));
    CU_ASSERT(file_has(acfg, "\"mlp.gate\""));
    CU_ASSERT(file_has(acfg, "\"model.norm\""));
}

/* The finished job again with --resume and two more steps: it goes on from step 3. */
static void test_resume(void) {
    job_t j = g_done;
    CU_ASSERT_FATAL(j.cfg[0] != '\0');
    const char *l[] = {"learner", j.cfg, "--resume", "--set", "learner.steps=5", NULL};
    j.learner = spawn(j.log_l, l);
    const char *w[] = {"reward", j.cfg, NULL};
    j.reward = spawn(j.log_w, w);
    const char *r0[] = {"rollout", j.cfg, "--worker-id", "0", NULL};
    const char *r1[] = {"rollout", j.cfg, "--worker-id", "1", NULL};
    j.rollout[0] = spawn(j.log_r[0], r0);
    j.rollout[1] = spawn(j.log_r[1], r1);
    job_wait_clean(&j);
    char lm[1100], latest[1100];
    metrics_path(&j, "learner", lm, sizeof lm);
    CU_ASSERT_EQUAL(count_events(lm, "step"), 5); /* appended: 3 before, 2 now */
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_step"), 5);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_policy_version"), 5);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_groups_trained_total"), 4);
    CU_ASSERT(file_has(j.log_l, "resumed from step-000003"));
    CU_ASSERT(file_has(j.log_r[0], "policy version 3"));
    snprintf(latest, sizeof latest, "%s/checkpoints/latest", j.run);
    CU_ASSERT(file_has(latest, "step-000005"));
}

/* A command that must fail at once: exit status want, stderr holding text. */
static void expect_failure(const char *log, const char *const *args, int want, const char *text) {
    pid_t pid = spawn(log, args);
    int st = wait_exit(pid, QUICK_LIMIT_MS);
    if (st != want)
        tu_report("%s %s: exit status %d, want %d", args[0], args[1] ? args[1] : "", st, want);
    CU_ASSERT_EQUAL(st, want);
    CU_ASSERT(file_has(log, text));
}

static void test_bad_start(void) {
    job_t j;
    job_write(&j, 3, NULL);
    char bad[1000], log[1000];
    snprintf(bad, sizeof bad, "%s/bad.yaml", j.dir);
    FILE *f = fopen(bad, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs("learner: {stepz: 3}\n", f);
    fclose(f);
    snprintf(log, sizeof log, "%s/bad.log", j.dir);
    const char *a1[] = {"learner", bad, NULL};
    expect_failure(log, a1, 1, "stepz");
    const char *a2[] = {"rollout", bad, "--worker-id", "0", NULL};
    expect_failure(log, a2, 1, "bad configuration");
    const char *a3[] = {"rollout", j.cfg, NULL}; /* --worker-id is required */
    expect_failure(log, a3, 2, "--worker-id is required");
    const char *a4[] = {"learner", "/nonexistent/job.yaml", NULL};
    expect_failure(log, a4, 1, "/nonexistent/job.yaml");
    const char *a5[] = {"learner", bad, "--frobnicate", "1", NULL};
    expect_failure(log, a5, 2, "unknown option '--frobnicate'");
    /* beyond loopback without CURVE keys */
    job_t k;
    job_write(&k, 3, NULL);
    const char *a6[] = {"reward", k.cfg, "--set", "transport.reward=tcp://0.0.0.0:45999", NULL};
    expect_failure(log, a6, 1, "CURVE");
    const char *a7[] = {"reward", k.cfg, "--set", "reward.function=no_such_reward", NULL};
    expect_failure(log, a7, 1, "no_such_reward");
    const char *a8[] = {"learner", k.cfg, "--set", "learner.ranks=2", NULL};
    expect_failure(log, a8, 1, "learner.ranks is 2 but 1 rank(s) were started");
    const char *a9[] = {"learner", "--help", NULL};
    expect_failure(log, a9, 0, "--resume");
}

static void test_busy_endpoint(void) {
    job_t j;
    job_write(&j, 3, NULL);
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    int port = 0;
    char ep[64];
    for (int i = 0; i < 50 && !port; i++) {
        int p = 20000 + (int)(((unsigned)getpid() * 13u + (unsigned)i * 977u) % 40000u);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", p);
        if (zmq_bind(s, ep) == 0)
            port = p;
    }
    CU_ASSERT_FATAL(port != 0);
    char set[96], log[1000];
    snprintf(log, sizeof log, "%s/busy.log", j.dir);
    snprintf(set, sizeof set, "transport.control=%s", ep);
    const char *a1[] = {"learner", j.cfg, "--set", set, NULL};
    expect_failure(log, a1, 1, "address already in use");
    snprintf(set, sizeof set, "transport.reward=%s", ep);
    const char *a2[] = {"reward", j.cfg, "--set", set, NULL};
    expect_failure(log, a2, 1, "address already in use");
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

static void test_sigterm_learner(void) {
    job_t j;
    job_write(&j, 500, NULL);
    job_start(&j);
    char lm[1100];
    metrics_path(&j, "learner", lm, sizeof lm);
    double until = now_ms() + JOB_LIMIT_MS;
    while (count_events(lm, "step") < 1 && now_ms() < until)
        sleep_ms(20);
    CU_ASSERT(count_events(lm, "step") >= 1);
    kill(j.learner, SIGTERM);
    job_wait_clean(&j);
    int steps = count_events(lm, "step");
    CU_ASSERT(steps >= 1 && steps < 500);
    CU_ASSERT_EQUAL(count_events(lm, "final"), 1);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_step"), steps);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_duplicate_groups_total"), 0);
    CU_ASSERT(file_has(j.log_l, "stopping (SIGTERM)"));
    CU_ASSERT(file_has(j.log_r[1], "the learner asked to stop"));
    char latest[1100], want[32];
    snprintf(latest, sizeof latest, "%s/checkpoints/latest", j.run);
    snprintf(want, sizeof want, "step-%06d", steps);
    CU_ASSERT(file_has(latest, want));
}

/* One ctl request on the job's control socket; 1 with *reply holding the ctl_reply. */
static int ctl(const job_t *j, msg_ctl_cmd_t cmd, const msg_kv_t *args, uint32_t nargs,
               msg_t *reply) {
    msg_init(reply);
    char ep[1000];
    snprintf(ep, sizeof ep, "ipc://%s/c", j->dir);
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    void *s = NULL;
    int ok = zsock_connect(ctx, ZMQ_DEALER, ep, &o, &s) == MO_OK;
    msg_t m;
    msg_init(&m);
    m.type = MSG_CTL_REQUEST;
    m.ctl_request.command = cmd;
    m.ctl_request.args = (msg_strmap_t){args, nargs};
    ok = ok && zsock_send_msg(s, NULL, &m, 0) == 1;
    ok = ok && zsock_wait(s, QUICK_LIMIT_MS) == 1;
    ok = ok && zsock_recv_msg(s, NULL, reply, MSG_CTL_REPLY, ZMQ_DONTWAIT) == 1;
    if (!ok)
        tu_report("ctl %s: %s", msg_ctl_cmd_name(cmd), mo_last_error());
    zsock_close(&s);
    zmq_ctx_term(ctx);
    return ok;
}

/* Sends raw bytes on the job's control socket; the decoded answer goes to *reply. */
static int raw_request(const job_t *j, const void *bytes, size_t len, msg_t *reply) {
    msg_init(reply);
    char ep[1000];
    snprintf(ep, sizeof ep, "ipc://%s/c", j->dir);
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    o.routing_id = "prober";
    void *s = NULL;
    int ok = zsock_connect(ctx, ZMQ_DEALER, ep, &o, &s) == MO_OK;
    ok = ok && zsock_send(s, NULL, bytes, len, 0) == 1;
    ok = ok && zsock_wait(s, QUICK_LIMIT_MS) == 1;
    ok = ok && zsock_recv_msg(s, NULL, reply, MSG_NONE, ZMQ_DONTWAIT) == 1;
    zsock_close(&s);
    zmq_ctx_term(ctx);
    return ok;
}

static double stat_value(const msg_t *r, const char *key) {
    for (uint32_t i = 0; i < r->ctl_reply.n_status; i++) {
        const msg_stat_t *x = &r->ctl_reply.status[i];
        if (strcmp(x->key, key) != 0)
            continue;
        return x->kind == MSG_VAL_FLOAT ? x->f : (double)x->i;
    }
    return 0.0 / 0.0;
}

/* Polls status until key reaches want (or the message holds text); 1 when it did. */
static int wait_status(const job_t *j, const char *key, double want, const char *text) {
    double until = now_ms() + JOB_LIMIT_MS;
    while (now_ms() < until) {
        msg_t r;
        if (!ctl(j, MSG_CTL_STATUS, NULL, 0, &r))
            return 0;
        int done = key ? stat_value(&r, key) == want : strstr(r.ctl_reply.message, text) != NULL;
        msg_free(&r);
        if (done)
            return 1;
        sleep_ms(50);
    }
    tu_report("status never showed %s", key ? key : text);
    return 0;
}

static void test_ctl_and_rollout_sigterm(void) {
    job_t j;
    job_write(&j, 6, NULL);
    job_start(&j);
    char lm[1100];
    metrics_path(&j, "learner", lm, sizeof lm);
    /* pause as soon as both rollout workers registered: the job cannot end meanwhile */
    CU_ASSERT_FATAL(wait_status(&j, "moerl_learner_rollout_workers", 2, NULL));
    msg_t r;
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_PAUSE, NULL, 0, &r));
    CU_ASSERT(r.ctl_reply.ok && !strcmp(r.ctl_reply.message, "paused"));
    msg_free(&r);
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_STATUS, NULL, 0, &r));
    CU_ASSERT(r.ctl_reply.ok);
    CU_ASSERT_EQUAL(stat_value(&r, "paused"), 1);
    CU_ASSERT_EQUAL(stat_value(&r, "steps"), 6);
    CU_ASSERT(stat_value(&r, "step") < 6);
    msg_free(&r);

    /* malformed messages are answered with an error, counted, and change nothing */
    static const unsigned char no_fields[] = {0x82, 0xa4, 't', 'y', 'p',  'e', 0xa5, 'h',
                                              'e',  'l',  'l', 'o', 0xa1, 'v', 0x01};
    static const unsigned char garbage[] = {0xc1, 0xff, 0x00};
    CU_ASSERT_FATAL(raw_request(&j, no_fields, sizeof no_fields, &r));
    CU_ASSERT_EQUAL(r.type, MSG_ERROR);
    CU_ASSERT(r.type == MSG_ERROR && strstr(r.error.message, "hello") != NULL);
    msg_free(&r);
    CU_ASSERT_FATAL(raw_request(&j, garbage, sizeof garbage, &r));
    CU_ASSERT_EQUAL(r.type, MSG_ERROR);
    msg_free(&r);
    CU_ASSERT(wait_status(&j, "moerl_malformed_messages_total{type=hello,peer=prober}", 1, NULL));

    msg_kv_t good[] = {{"function", "0.5*arith_exact"}};
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_SWAP_REWARD, good, 1, &r));
    CU_ASSERT(r.ctl_reply.ok);
    CU_ASSERT(strstr(r.ctl_reply.message, "reward version 2") != NULL);
    msg_free(&r);
    CU_ASSERT(wait_status(&j, "reward-0.reward_version", 2, NULL));
    msg_kv_t typo[] = {{"function", "arith_exactt"}};
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_SWAP_REWARD, typo, 1, &r));
    CU_ASSERT_FALSE(r.ctl_reply.ok); /* refused by the learner: nothing sent */
    msg_free(&r);
    msg_kv_t missing[] = {{"function", "x"}, {"plugin", "/nonexistent/libreward.so"}};
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_SWAP_REWARD, missing, 2, &r));
    CU_ASSERT(r.ctl_reply.ok); /* sent; the worker refuses it and keeps version 2 */
    msg_free(&r);
    CU_ASSERT(wait_status(&j, NULL, 0, "last reward swap failed"));
    CU_ASSERT(wait_status(&j, "reward-0.reward_version", 2, NULL));

    kill(j.rollout[1], SIGTERM);
    int st = wait_exit(j.rollout[1], QUICK_LIMIT_MS);
    CU_ASSERT_EQUAL(st, 0);
    CU_ASSERT(file_has(j.log_r[1], "SIGTERM"));
    CU_ASSERT_FATAL(ctl(&j, MSG_CTL_RESUME, NULL, 0, &r));
    CU_ASSERT(r.ctl_reply.ok);
    msg_free(&r);

    int sl = wait_exit(j.learner, JOB_LIMIT_MS);
    int sw = wait_exit(j.reward, QUICK_LIMIT_MS);
    int s0 = wait_exit(j.rollout[0], QUICK_LIMIT_MS);
    CU_ASSERT(sl == 0 && sw == 0 && s0 == 0);
    if (sl || sw || s0)
        tu_report("exit statuses: learner %d, reward %d, rollout-0 %d", sl, sw, s0);
    CU_ASSERT_EQUAL(count_events(lm, "step"), 6);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_groups_trained_total"), 12);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_failed_groups_total"), 0);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_reward_swap_failures_total"), 1);
    CU_ASSERT_EQUAL(last_value(lm, "moerl_learner_reward_version"), 3);
    CU_ASSERT(file_has(j.log_w, "reward swap refused, keeping version 2"));
}

static int suite_init(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0)
        return 1;
    snprintf(g_model, sizeof g_model, "%s/model", g_dir);
    char log[700];
    snprintf(log, sizeof log, "%s/init-model.log", g_dir);
    const char *a[] = {"init-model", "--arch", "qwen3_moe", "--size", "tiny",
                       "--dtype",    "f32",    "--out",     g_model,  NULL};
    return wait_exit(spawn(log, a), QUICK_LIMIT_MS) == 0 ? 0 : 1;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (suite_init() != 0) {
        fprintf(stderr, "it_daemons: cannot write the tiny model in %s\n", g_dir);
        return 1;
    }
    CU_TestInfo tests[] = {
        {"3-step job with 2 rollout and 1 reward workers", test_job_completes},
        {"routers and norms trained in full, published and applied", test_full_tensors_job},
        {"--resume goes on from the last checkpoint", test_resume},
        {"bad config, options, reward and CURVE fail at once", test_bad_start},
        {"an endpoint in use fails at once", test_busy_endpoint},
        {"SIGTERM to the learner stops every daemon", test_sigterm_learner},
        {"ctl requests; a rollout worker stopped mid-run", test_ctl_and_rollout_sigterm},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("daemons", tests);
    if (rc == 0)
        tu_rmtree(g_dir);
    return rc;
}
