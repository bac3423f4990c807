/* Integration: the reward function swapped while a job runs (`moerl ctl swap-reward`):
 * the reward workers install the new version, the steps after it train on groups the new
 * function scored, the last checkpoint records the new version, and no group is scored
 * twice. A rollout worker that joins late, while the learner is paused, starts from the
 * learner's current adapter version (a snapshot) and then contributes groups. */
#include "tests/it_job.h"

/* The "final" line of a daemon's metrics file <run>/metrics/<name>.jsonl. */
static cJSON *daemon_final(it_job_t *j, const char *name) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/metrics/%s.jsonl", j->run, name);
    return it_last_event(path, NULL);
}

/* learner_state.json of the run's latest checkpoint. */
static cJSON *latest_state(it_job_t *j) {
    char path[IT_PATH + 128], name[64] = "";
    snprintf(path, sizeof path, "%s/checkpoints/latest", j->run);
    FILE *f = fopen(path, "r");
    if (!f || !fgets(name, sizeof name, f)) {
        if (f)
            fclose(f);
        return NULL;
    }
    fclose(f);
    name[strcspn(name, "\r\n")] = 0;
    snprintf(path, sizeof path, "%s/checkpoints/%s/learner_state.json", j->run, name);
    char *s = it_slurp(path);
    cJSON *o = s ? cJSON_Parse(s) : NULL;
    free(s);
    return o;
}

static void test_swap_mid_run(void) {
    int steps = IT_ASAN ? 10 : 14;
    it_job_t j;
    /* Paused, the job cannot finish while the swap and the refused swap are checked. */
    pid_t run = it_start_paused(&j, steps, 3);
    CU_ASSERT_EQUAL_FATAL(it_ctl(&j, "swap-reward 'constant:value=0.25'"), 0);
    /* The reward worker reports the new version in its heartbeats. */
    double version = 0, end = it_now_ms() + 20000;
    while (version != 2 && it_now_ms() < end) {
        const cJSON *st = NULL;
        cJSON *root = it_ctl_status(&j, &st);
        version = it_num(st, "reward-0.reward_version");
        cJSON_Delete(root);
        it_sleep_ms(50);
    }
    CU_ASSERT_EQUAL(version, 2);
    /* A bad spec is refused at once and the job goes on with version 2. */
    CU_ASSERT_NOT_EQUAL(it_ctl(&j, "swap-reward 'nosuchreward'"), 0);
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/ctl.log", j.dir);
    char *ctl = it_slurp(path);
    CU_ASSERT(ctl && strstr(ctl, "the learner refused swap_reward") && strstr(ctl, "nosuchreward"));
    if (ctl && !strstr(ctl, "the learner refused swap_reward"))
        tu_report("ctl.log: %s", ctl);
    free(ctl);
    int swapped_at = it_step(&j);
    CU_ASSERT_EQUAL_FATAL(it_ctl(&j, "resume"), 0);

    int status;
    int ok = it_wait(run, IT_ASAN ? 300000 : 120000, &status);
    if (!ok || it_exit_code(status) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(status), 0);
    CU_ASSERT(swapped_at < steps - 4);

    /* Steps well after the swap (past the groups in flight and max_staleness) saw only
     * the constant reward. */
    FILE *f = fopen(j.metrics, "r");
    CU_ASSERT_FATAL(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int checked = 0;
    while (getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        double step = it_num(o, "moerl_learner_step"),
               mean = it_num(o, "moerl_learner_reward_mean");
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        if (cJSON_IsString(ev) && !strcmp(ev->valuestring, "step") && step >= swapped_at + 4) {
            if (mean != 0.25)
                tu_report("step %g: reward mean %g after the swap at step %d", step, mean,
                          swapped_at);
            CU_ASSERT_EQUAL(mean, 0.25);
            CU_ASSERT_EQUAL(it_num(o, "moerl_learner_reward_std"), 0);
            checked++;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    CU_ASSERT(checked >= 2);
    cJSON *state = latest_state(&j);
    CU_ASSERT_EQUAL(it_num(state, "reward_version"), 2);
    cJSON_Delete(state);

    /* Every group was scored once: the reward worker scored no more groups than the
     * rollouts generated, none was sent twice, and the learner got them all. */
    cJSON *rw = daemon_final(&j, "reward-0"), *r0 = daemon_final(&j, "rollout-0"),
          *r1 = daemon_final(&j, "rollout-1"), *fin = it_last_event(j.metrics, "final");
    double scored = it_num(rw, "moerl_reward_groups_total");
    double generated = it_num(r0, "moerl_rollout_groups_generated_total") +
                       it_num(r1, "moerl_rollout_groups_generated_total");
    double retries = it_num(r0, "moerl_rollout_score_retries_total") +
                     it_num(r1, "moerl_rollout_score_retries_total");
    double received = it_num(fin, "moerl_learner_groups_received_total");
    if (!(scored <= generated && scored >= received))
        tu_report("scored %g, generated %g, received %g", scored, generated, received);
    CU_ASSERT(scored <= generated);
    CU_ASSERT(scored >= received);
    CU_ASSERT_EQUAL(retries, 0);
    CU_ASSERT_EQUAL(it_num(rw, "moerl_reward_version"), 2);
    CU_ASSERT_EQUAL(it_num(rw, "moerl_reward_swaps_total"), 1); /* the bad spec never left */
    CU_ASSERT_EQUAL(it_num(rw, "moerl_reward_swap_failures_total"), 0);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_groups_trained_total"), steps * 4);
    cJSON_Delete(rw);
    cJSON_Delete(r0);
    cJSON_Delete(r1);
    cJSON_Delete(fin);
    it_close(&j);
}

/* The first "adapter version N applied" of a log, -1 when none. */
static int first_applied(it_job_t *j, const char *log) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, log);
    char *s = it_slurp(path);
    const char *p = s ? strstr(s, "adapter version ") : NULL;
    int v = -1;
    while (p && sscanf(p, "adapter version %d applied", &v) != 1)
        p = strstr(p + 1, "adapter version ");
    free(s);
    return p ? v : -1;
}

static void test_late_joiner(void) {
    int steps = IT_ASAN ? 8 : 10;
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    const char *exe = tu_moerl_exe();
    const char *learner[] = {exe, "learner", j.config, NULL};
    const char *reward[] = {exe, "reward", j.config, "--worker-id", "0", NULL};
    const char *r0[] = {exe, "rollout", j.config, "--worker-id", "0", NULL};
    const char *r1[] = {exe, "rollout", j.config, "--worker-id", "1", NULL};
    pid_t pl = it_spawn(&j, "learner.log", learner);
    pid_t pr = it_spawn(&j, "reward.log", reward);
    pid_t p0 = it_spawn(&j, "rollout-0.log", r0);
    int ok = it_wait_step(&j, 3, 120000, pl);
    if (!ok)
        it_dump(&j, "learner.log");
    CU_ASSERT_FATAL(ok);
    /* Pause, and wait until nothing is leased or training: no new version is published
     * while the late worker joins. */
    CU_ASSERT_EQUAL_FATAL(it_pause_frozen(&j, &p0, 1), 0);
    double version = -1, end = it_now_ms() + 30000;
    bool quiet = false;
    while (!quiet && it_now_ms() < end) {
        const cJSON *st = NULL;
        cJSON *root = it_ctl_status(&j, &st);
        quiet = root && !cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(st, "training")) &&
                it_num(st, "moerl_learner_leased_groups") == 0;
        version = it_num(st, "policy_version");
        cJSON_Delete(root);
        if (!quiet)
            it_sleep_ms(50);
    }
    CU_ASSERT_FATAL(quiet);
    CU_ASSERT_FATAL(version >= 3);
    pid_t p1 = it_spawn(&j, "rollout-1.log", r1);
    double have = -1;
    end = it_now_ms() + 30000;
    while (have != version && it_now_ms() < end) {
        const cJSON *st = NULL;
        cJSON *root = it_ctl_status(&j, &st);
        have = it_num(st, "rollout-1.adapter_version");
        cJSON_Delete(root);
        it_sleep_ms(50);
    }
    CU_ASSERT_EQUAL(have, version);
    CU_ASSERT_EQUAL(first_applied(&j, "rollout-1.log"), (int)version);
    CU_ASSERT_EQUAL_FATAL(it_ctl(&j, "resume"), 0);

    pid_t all[4] = {pl, pr, p0, p1};
    const char *names[4] = {"learner.log", "reward.log", "rollout-0.log", "rollout-1.log"};
    for (int i = 0; i < 4; i++) {
        int st;
        ok = it_wait(all[i], IT_ASAN ? 300000 : 120000, &st);
        if (!ok || it_exit_code(st) != 0)
            it_dump(&j, names[i]);
        CU_ASSERT(ok && it_exit_code(st) == 0);
    }
    cJSON *late = daemon_final(&j, "rollout-1");
    CU_ASSERT(it_num(late, "moerl_rollout_snapshot_requests_total") >= 1);
    CU_ASSERT(it_num(late, "moerl_rollout_groups_pushed_total") >= 1);
    cJSON_Delete(late);
    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_step"), steps);
    cJSON_Delete(fin);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"swap mid-run", test_swap_mid_run},
        {"late joiner", test_late_joiner},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_reward_swap", tests);
}
