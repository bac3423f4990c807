/* Integration: the routing record on the wire covers every token the learner trains on,
 * the read of the last generated token included (routing_last). Without routing replay
 * and with weights that do not move (a learning rate of 1e-12), the learner's own routing
 * of every recorded position matches the rollout's record: the routing agreement of every
 * step is 1 up to rare near-ties between the two forward paths, where a record that
 * repeated the previous row for the last token would disagree on most samples' last
 * position. */
#include "tests/it_job.h"

static void test_agreement(void) {
    int steps = IT_ASAN ? 3 : 5;
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    /* lr: weights that stay put; a key set twice is an error, so patch the value */
    char *lr = strstr(extra, "lr: 1.0e-3");
    CU_ASSERT_FATAL(lr != NULL);
    memcpy(lr, "lr: 1e-12 ", 10);
    it_base_t b = it_base_default();
    b.routing_replay = 0;
    it_job_t j;
    it_open_ex(&j, extra, &b);
    const char *argv[] = {tu_moerl_exe(), "run", j.config, "--no-status", NULL};
    pid_t run = it_spawn(&j, "run.out", argv);
    int st = 0;
    int ok = it_wait(run, IT_ASAN ? 300000 : 120000, &st);
    if (!ok || it_exit_code(st) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL_FATAL(it_exit_code(st), 0);

    FILE *f = fopen(j.metrics, "r");
    CU_ASSERT_FATAL(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int n = 0;
    double sum = 0, lo = 2;
    while (getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        if (o && cJSON_IsString(ev) && !strcmp(ev->valuestring, "step")) {
            double a = it_num(o, "moerl_learner_routing_agreement");
            CU_ASSERT(isfinite(a));
            if (isfinite(a)) {
                sum += a;
                lo = a < lo ? a : lo;
                n++;
            }
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    CU_ASSERT_EQUAL(n, steps);
    tu_report("routing agreement over %d steps: mean %.5f, lowest %.5f", n, n ? sum / n : NAN,
              lo);
    CU_ASSERT(n > 0 && sum / n >= 0.995);
    CU_ASSERT(lo >= 0.99);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"routing agreement is 1 without replay and weight changes", test_agreement},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_routing_wire", tests);
}
