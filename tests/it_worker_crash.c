/* Integration: a job under `moerl run` with 2 rollout workers, one of them frozen while
 * it holds leases (SIGSTOP) until the learner counts it lost, then killed with SIGKILL.
 * The learner hands its prompts out again, the supervisor restarts it, and the job
 * reaches its step count with every step trained on exactly prompts_per_step groups
 * (none lost, none trained twice). */
#include "tests/it_job.h"

#define PPS 4 /* rollout.prompts_per_step */

static void test_rollout_killed(void) {
    int steps = IT_ASAN ? 24 : 40; /* long enough to see the worker restarted */
    /* Groups of 8 long generations, so that a worker holds its leases for a while. */
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    k.group_size = 8;
    k.max_new_tokens = 24;
    k.stop = "[]";
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    const char *argv[] = {tu_moerl_exe(), "run", j.config, "--no-status", NULL};
    pid_t run = it_spawn(&j, "run.out", argv);
    int ok = it_wait_step(&j, 2, 120000, run);
    if (!ok)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);

    /* Freeze rollout-1 while it holds several prompts (its last heartbeat says so: more
     * work than it finishes between two heartbeats), wait until the learner counts it
     * lost (no heartbeats) and has handed its prompts out again, then kill it. */
    pid_t victim = 0;
    double end = it_now_ms() + 30000;
    while (!victim && it_now_ms() < end) {
        const cJSON *st = NULL;
        cJSON *root = it_ctl_status(&j, &st);
        if (it_num(st, "rollout-1.inflight") >= 2) {
            victim = it_logged_pid(&j, "rollout-1");
            if (victim > 0)
                kill(victim, SIGSTOP);
        }
        cJSON_Delete(root);
    }
    CU_ASSERT_FATAL(victim > 0);
    double lost = 0;
    end = it_now_ms() + 20000;
    while (lost < 1 && it_now_ms() < end) {
        const cJSON *st = NULL;
        cJSON *root = it_ctl_status(&j, &st);
        lost = it_num(st, "moerl_learner_workers_lost_total");
        cJSON_Delete(root);
        it_sleep_ms(50);
    }
    CU_ASSERT(lost >= 1);
    CU_ASSERT_FATAL(kill(victim, SIGKILL) == 0);
    int killed_at = it_step(&j);

    int status;
    ok = it_wait(run, IT_ASAN ? 300000 : 120000, &status);
    if (!ok || it_exit_code(status) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(status), 0);
    CU_ASSERT(killed_at < steps); /* it died mid-run */

    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_FATAL(fin != NULL);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_step"), steps);
    /* Every step trained on prompts_per_step distinct groups: nothing lost, and no
     * duplicate (the learner drops a group id it has seen) trained. */
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_groups_trained_total"), steps * PPS);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_samples_trained_total"), steps * PPS * 8);
    double reissued = it_num(fin, "moerl_learner_groups_reissued_total");
    lost = it_num(fin, "moerl_learner_workers_lost_total");
    if (!(reissued >= 2 && lost >= 1))
        tu_report("reissued %g, workers lost %g", reissued, lost);
    CU_ASSERT(reissued >= 2); /* the prompts it held */
    CU_ASSERT(lost >= 1);
    CU_ASSERT(it_num(fin, "moerl_learner_failed_groups_total") == 0);
    cJSON_Delete(fin);

    /* The supervisor saw the crash and restarted the worker; every process ended 0. */
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/logs/run.log", j.run);
    char *log = it_slurp(path);
    CU_ASSERT_FATAL(log != NULL);
    CU_ASSERT(strstr(log, "rollout-1 was killed by SIGKILL; restarting in") != NULL);
    CU_ASSERT(strstr(log, "restarted rollout-1 (pid") != NULL);
    CU_ASSERT(strstr(log, "learner finished") != NULL);
    free(log);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"rollout killed mid-run", test_rollout_killed},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_worker_crash", tests);
}
