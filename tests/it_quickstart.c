/* Integration: a shortened quickstart: configs/quickstart.yaml through `moerl run` with a
 * few steps on a tiny random model (overrides with --set, a reward a random model earns
 * about half the time: "the completion holds a digit or a lowercase letter"). Every
 * daemon exits 0, the resolved config and every daemon's metrics are written, every
 * checkpoint loads (the learner's checkpoint API and `moerl score --adapter`), the
 * reward does not collapse, and `moerl report` prints the table and writes the plot. */
#include "core/config.h"
#include "learner/checkpoint.h"
#include "learner/trainer.h"
#include "tests/it_job.h"

static int run_capture(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return st == -1 ? -1 : it_exit_code(st);
}

/* The reward mean of every step line, in order; returns how many. */
static int step_rewards(it_job_t *j, double *r, int cap, int *last_step) {
    FILE *f = fopen(j->metrics, "r");
    if (!f)
        return 0;
    char *line = NULL;
    size_t lc = 0;
    int n = 0;
    *last_step = 0;
    while (getline(&line, &lc, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        if (cJSON_IsString(ev) && !strcmp(ev->valuestring, "step") && n < cap) {
            int s = (int)it_num(o, "moerl_learner_step");
            CU_ASSERT_EQUAL(s, *last_step + 1); /* one line per step, in order */
            *last_step = s;
            r[n++] = it_num(o, "moerl_learner_reward_mean");
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    return n;
}

static void test_short_quickstart(void) {
    int steps = 6;
    it_job_t j;
    it_open(&j, "");
    char qs[IT_PATH], sets[12][IT_PATH + 64];
    snprintf(qs, sizeof qs, "%s/configs/quickstart.yaml", tu_source_dir());
    const char *keys[] = {"model.path",
                          "run.dir",
                          "transport.control",
                          "transport.work",
                          "transport.trajectories",
                          "transport.weights",
                          "transport.reward"};
    const char *vals[7] = {j.model, j.run};
    char eps[5][64];
    for (int i = 0; i < 5; i++) {
        snprintf(eps[i], sizeof eps[i], "tcp://127.0.0.1:%d", j.port + i);
        vals[2 + i] = eps[i];
    }
    int ns = 0;
    for (int i = 0; i < 7; i++)
        snprintf(sets[ns++], sizeof sets[0], "%s=%s", keys[i], vals[i]);
    snprintf(sets[ns++], sizeof sets[0], "learner.steps=%d", steps);
    snprintf(sets[ns++], sizeof sets[0], "learner.checkpoint_every=2");
    snprintf(sets[ns++], sizeof sets[0], "rollout.group_size=8");
    snprintf(sets[ns++], sizeof sets[0], "rollout.prompts_per_step=8");
    snprintf(sets[ns++], sizeof sets[0], "reward.function=regex:pattern=\"[0-9a-z]\"");
    const char *argv[2 * 12 + 8];
    int na = 0;
    argv[na++] = tu_moerl_exe();
    argv[na++] = "run";
    argv[na++] = qs;
    for (int i = 0; i < ns; i++) {
        argv[na++] = "--set";
        argv[na++] = sets[i];
    }
    argv[na] = NULL;
    pid_t run = it_spawn(&j, "run.out", argv);
    int status;
    int ok = it_wait(run, IT_ASAN ? 300000 : 120000, &status);
    if (!ok || it_exit_code(status) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL_FATAL(it_exit_code(status), 0);

    /* Every daemon exited 0, once. */
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/logs/run.log", j.run);
    char *log = it_slurp(path);
    CU_ASSERT_FATAL(log != NULL);
    const char *procs[] = {"learner", "rollout-0", "rollout-1", "reward-0"};
    for (int i = 0; i < 4; i++) {
        char want[64];
        snprintf(want, sizeof want, "  %-12s exit 0\n", procs[i]);
        CU_ASSERT(strstr(log, want) != NULL);
        snprintf(path, sizeof path, "%s/logs/%s.log", j.run, procs[i]);
        CU_ASSERT(access(path, R_OK) == 0);
    }
    CU_ASSERT(strstr(log, "restarting in") == NULL);
    free(log);

    /* The resolved config holds the overrides; metrics of every daemon were written. */
    moerl_config_t c;
    snprintf(path, sizeof path, "%s/config.yaml", j.run);
    CU_ASSERT_FATAL(config_load(&c, path, NULL, 0, NULL) == MO_OK);
    CU_ASSERT_EQUAL(c.learner.steps, steps);
    CU_ASSERT_EQUAL(c.rollout.workers, 2);
    CU_ASSERT_STRING_EQUAL(c.model.path, j.model);
    double r[64];
    int last = 0, n = step_rewards(&j, r, 64, &last);
    CU_ASSERT_EQUAL(n, steps);
    CU_ASSERT_EQUAL(last, steps);
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/metrics/%s.jsonl", j.run, procs[i]);
        cJSON *fin = it_last_event(path, "final");
        CU_ASSERT(fin != NULL);
        cJSON_Delete(fin);
    }
    /* The reward did not collapse: the second half of the steps earns at least half of
     * what the first half did (64 samples a step, 192 a half). */
    double first = 0, tail = 0;
    for (int i = 0; i < n; i++) {
        CU_ASSERT(isfinite(r[i]) && r[i] >= 0 && r[i] <= 1);
        if (i < n / 2)
            first += r[i] / (n / 2);
        else
            tail += r[i] / (n - n / 2);
    }
    if (!(first > 0 && tail >= 0.5 * first))
        tu_report("reward mean: first half %.3f, second half %.3f", first, tail);
    CU_ASSERT(first > 0);
    CU_ASSERT(tail >= 0.5 * first);

    /* Every checkpoint loads: the newest through the learner's resume path, each adapter
     * with `moerl score`. */
    trainer_t *t = NULL;
    CU_ASSERT_FATAL(trainer_new(&t, &c, NULL, NULL) == MO_OK);
    char name[64];
    int fell_back = -1;
    int rc = checkpoint_resume_trainer(t, j.run, 0, NULL, name, sizeof name, &fell_back);
    if (rc < 0)
        tu_report("resume: %s", mo_last_error());
    CU_ASSERT(rc == MO_OK && fell_back == 0);
    CU_ASSERT_EQUAL(t->step, steps);
    trainer_destroy(&t);
    int64_t *ck = NULL;
    int nck = 0;
    CU_ASSERT_FATAL(checkpoint_list(j.run, &ck, &nck) == MO_OK);
    CU_ASSERT_EQUAL(nck, (steps + 1) / 2); /* every 2 steps, and at the end */
    for (int i = 0; i < nck; i++) {
        char step_name[64], cmd[3 * IT_PATH], out[8192];
        checkpoint_step_name(step_name, sizeof step_name, ck[i]);
        snprintf(cmd, sizeof cmd,
                 "'%s' score --model '%s' --adapter '%s/checkpoints/%s/adapter' "
                 "--text '12+34=' --threads 1 2>&1",
                 tu_moerl_exe(), j.model, j.run, step_name);
        int code = run_capture(cmd, out, sizeof out);
        cJSON *o = cJSON_Parse(out);
        double sum = it_num(o, "sum");
        if (code != 0 || !isfinite(sum) || sum >= 0)
            tu_report("%s: exit %d: %s", step_name, code, out);
        CU_ASSERT(code == 0 && isfinite(sum) && sum < 0);
        cJSON_Delete(o);
    }
    free(ck);
    config_free(&c);

    /* The report: base and checkpoints evaluated, a table, a plot. */
    char cmd[3 * IT_PATH], out[16384];
    snprintf(cmd, sizeof cmd, "'%s' report '%s' --eval-n 4 2>&1", tu_moerl_exe(), j.run);
    int code = run_capture(cmd, out, sizeof out);
    if (code != 0)
        tu_report("moerl report: %s", out);
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT(strstr(out, "held-out greedy accuracy (4 prompts)") != NULL);
    CU_ASSERT(strstr(out, "evaluated the base model, step 0") != NULL);
    snprintf(path, sizeof path, "%s/report.svg", j.run);
    char *svg = it_slurp(path);
    CU_ASSERT(svg && strstr(svg, "<polyline") && strstr(svg, "</svg>"));
    free(svg);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"short quickstart", test_short_quickstart},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_quickstart", tests);
}
