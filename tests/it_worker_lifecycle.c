/* Integration: worker lifecycles against the learner, with real processes. A rollout
 * worker frozen while it holds leases, killed and restarted at once under the same id,
 * gets its old incarnation's leases handed out again when it says hello (no lease
 * deadline and no missed heartbeats are waited for: the job completes with neither
 * counted). Workers whose learner is gone
 * (SIGKILL) notice the silence (the learner answers every heartbeat) and exit with
 * status 1 and a message naming the learner: a rollout worker, a built-in reward worker
 * and the Python reward server. */
#include "tests/it_job.h"

/* The learner's log as text (free it). */
static char *read_log(it_job_t *j, const char *name) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, name);
    return it_slurp(path);
}

static void test_restart_same_id(void) {
    int steps = IT_ASAN ? 8 : 12;
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    k.rollouts = 1;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    /* Neither a lease deadline nor missed heartbeats can free the leases within the run. */
    it_base_t b = it_base_default();
    b.heartbeat_ms = 20000;
    b.lease_timeout_ms = 3600000;
    it_job_t j;
    it_open_ex(&j, extra, &b);
    const char *la[] = {tu_moerl_exe(), "learner", j.config, NULL};
    const char *ra[] = {tu_moerl_exe(), "reward", j.config, "--worker-id", "0", NULL};
    const char *ro[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "0", NULL};
    pid_t learner = it_spawn(&j, "learner.log", la);
    it_spawn(&j, "reward.log", ra);
    pid_t r0 = it_spawn(&j, "rollout0.log", ro);
    int ok = it_wait_step(&j, 1, IT_ASAN ? 300000 : 120000, learner);
    if (!ok)
        it_dump(&j, "learner.log");
    CU_ASSERT_FATAL(ok);
    /* Freeze the worker at a moment it holds leases (the learner's gauge: the only rollout
     * worker's), then kill it and start it again at once. */
    double leased = 0;
    for (int i = 0; i < 200 && !(leased > 0); i++) {
        kill(r0, SIGSTOP);
        it_sleep_ms(150); /* what it sent is received, and the learner's gauge ticked */
        const cJSON *status = NULL;
        cJSON *root = it_ctl_status(&j, &status);
        leased = it_num(status, "moerl_learner_leased_groups");
        cJSON_Delete(root);
        if (!(leased > 0)) {
            kill(r0, SIGCONT);
            it_sleep_ms(20);
        }
    }
    if (!(leased > 0))
        tu_report("rollout-0 never held a lease when looked at");
    CU_ASSERT_FATAL(leased > 0);
    kill(r0, SIGKILL);
    waitpid(r0, NULL, 0);
    it_spawn(&j, "rollout0b.log", ro);

    int st = 0;
    ok = it_wait(learner, IT_ASAN ? 300000 : 120000, &st);
    if (!ok || it_exit_code(st) != 0) {
        it_dump(&j, "learner.log");
        it_dump(&j, "rollout0b.log");
    }
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(st), 0);
    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_FATAL(fin != NULL);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_step"), steps);
    CU_ASSERT(it_num(fin, "moerl_learner_groups_reissued_total") >= 1);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_leases_expired_total"), 0);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_workers_lost_total"), 0);
    cJSON_Delete(fin);
    char *log = read_log(&j, "learner.log");
    CU_ASSERT(log && strstr(log, "rollout-0 registered again") &&
              strstr(log, "handed out again"));
    free(log);
    it_close(&j);
}

/* Waits for pid's exit: its exit code, or -1 when it still runs after limit_ms. */
static int exit_within(pid_t pid, int limit_ms) {
    int st;
    return it_wait(pid, limit_ms, &st) ? it_exit_code(st) : -1;
}

static void test_orphans_exit(void) {
    char py_check[IT_PATH + 64];
    snprintf(py_check, sizeof py_check, "'%s' -c 'import zmq, msgpack' 2>/dev/null", tu_python());
    int have_py = system(py_check) == 0;
    if (!have_py)
        tu_report("%s cannot import zmq and msgpack: install python3-zmq and python3-msgpack",
                  tu_python());
    CU_ASSERT_FATAL(have_py);
    it_knobs_t k = it_knobs_default();
    k.steps = 100000; /* the learner is killed long before */
    k.rollouts = 1;
    k.rewards = 2; /* reward-0 built in, reward-1 the Python server */
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_base_t b = it_base_default();
    b.transport_more = "  learner_timeout_ms: 1500\n";
    it_job_t j;
    it_open_ex(&j, extra, &b);
    const char *la[] = {tu_moerl_exe(), "learner", j.config, NULL};
    const char *ra[] = {tu_moerl_exe(), "reward", j.config, "--worker-id", "0", NULL};
    const char *ro[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "0", NULL};
    char script[IT_PATH], bind[64], ctl[64];
    snprintf(script, sizeof script, "%s/reward/examples/python_reward_server.py",
             tu_source_dir());
    snprintf(bind, sizeof bind, "tcp://127.0.0.1:%d", j.port + 5);
    snprintf(ctl, sizeof ctl, "tcp://127.0.0.1:%d", j.port);
    const char *pa[] = {tu_python(), script,      "--bind",    bind, "--learner",
                        ctl,         "--worker-id", "reward-1", "--learner-timeout-ms",
                        "1500",      NULL};
    pid_t learner = it_spawn(&j, "learner.log", la);
    pid_t rw = it_spawn(&j, "reward.log", ra);
    pid_t py = it_spawn(&j, "python.log", pa);
    pid_t r0 = it_spawn(&j, "rollout0.log", ro);
    int ok = it_wait_step(&j, 1, IT_ASAN ? 300000 : 120000, learner);
    if (!ok)
        it_dump(&j, "learner.log");
    CU_ASSERT_FATAL(ok);
    /* The Python server (slower to start) has registered too. */
    double until = it_now_ms() + (IT_ASAN ? 120000 : 60000);
    char *pylog = NULL;
    while (it_now_ms() < until) {
        free(pylog);
        pylog = read_log(&j, "python.log");
        if (pylog && strstr(pylog, "registered with the learner"))
            break;
        it_sleep_ms(50);
    }
    CU_ASSERT_FATAL(pylog && strstr(pylog, "registered with the learner"));
    free(pylog);
    /* Everyone is registered and working: nobody has left. */
    CU_ASSERT_EQUAL(waitpid(r0, NULL, WNOHANG), 0);
    CU_ASSERT_EQUAL(waitpid(rw, NULL, WNOHANG), 0);
    CU_ASSERT_EQUAL(waitpid(py, NULL, WNOHANG), 0);
    kill(learner, SIGKILL);
    waitpid(learner, NULL, 0);

    /* 1.5 s of silence, then exit 1; the limit only turns a hang into a failure. */
    int limit = IT_ASAN ? 60000 : 30000;
    int rc_r0 = exit_within(r0, limit), rc_rw = exit_within(rw, limit);
    int rc_py = exit_within(py, limit);
    CU_ASSERT_EQUAL(rc_r0, 1);
    CU_ASSERT_EQUAL(rc_rw, 1);
    CU_ASSERT_EQUAL(rc_py, 1);
    char want[128];
    snprintf(want, sizeof want, "the learner at tcp://127.0.0.1:%d is gone", j.port);
    const char *logs[] = {"rollout0.log", "reward.log"};
    for (int i = 0; i < 2; i++) {
        char *log = read_log(&j, logs[i]);
        CU_ASSERT(log && strstr(log, want));
        if (!log || !strstr(log, want))
            it_dump(&j, logs[i]);
        free(log);
    }
    char *log = read_log(&j, "python.log");
    CU_ASSERT(log && strstr(log, "no answer from the learner"));
    if (!log || !strstr(log, "no answer from the learner")) {
        it_dump(&j, "python.log");
        it_dump(&j, "learner.log");
    }
    free(log);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"restarted rollout worker: its old leases are reissued at once", test_restart_same_id},
        {"orphaned workers exit when the learner is gone", test_orphans_exit},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_worker_lifecycle", tests);
}
