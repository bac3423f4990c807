/* Integration: CURVE client authentication with real daemons. The learner and the
 * reward worker hold the job's server keypair and an allow-list (transport.
 * curve_allowed_clients) naming rollout-0's public key and the server's; rollout-0, with
 * its own listed keypair, trains the job to the end, while rollout-1, whose key is not on
 * the list, is refused by the learner (counted in moerl_transport_refused_clients_total
 * and logged) and never registers. */
#include <sys/stat.h>

#include "tests/it_job.h"

static void test_allow_list(void) {
    int steps = IT_ASAN ? 3 : 4;
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    k.rollouts = 2;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    char keys[IT_PATH], spub[41], r0pub[41], r1pub[41];
    snprintf(keys, sizeof keys, "%s/keys", j.dir);
    CU_ASSERT_FATAL(zsock_curve_keygen(keys, "server", false, spub) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(keys, "rollout-0", false, r0pub) == MO_OK);
    CU_ASSERT_FATAL(zsock_curve_keygen(keys, "rollout-1", false, r1pub) == MO_OK);
    char allow[IT_PATH + 32], text[256];
    snprintf(allow, sizeof allow, "%s/allowed.txt", j.dir);
    snprintf(text, sizeof text, "# the job's clients\n%s\n%s\n", r0pub, spub);
    FILE *f = fopen(allow, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs(text, f);
    fclose(f);
    char more[4 * IT_PATH + 256];
    snprintf(more, sizeof more,
             "  curve_secret_key: %s/server.key\n  curve_public_key: %s/server.pub\n"
             "  curve_server_key: %s/server.pub\n  curve_allowed_clients: %s\n",
             keys, keys, keys, allow);
    it_base_t b = it_base_default();
    b.transport_more = more;
    it_write_config_ex(&j, j.config, extra, &b);

    char set0[IT_PATH + 64], set1[IT_PATH + 64], pub0[IT_PATH + 64], pub1[IT_PATH + 64];
    snprintf(set0, sizeof set0, "transport.curve_secret_key=%s/rollout-0.key", keys);
    snprintf(set1, sizeof set1, "transport.curve_secret_key=%s/rollout-1.key", keys);
    snprintf(pub0, sizeof pub0, "transport.curve_public_key=%s/rollout-0.pub", keys);
    snprintf(pub1, sizeof pub1, "transport.curve_public_key=%s/rollout-1.pub", keys);
    const char *la[] = {tu_moerl_exe(), "learner", j.config, NULL};
    const char *ra[] = {tu_moerl_exe(), "reward", j.config, "--worker-id", "0", NULL};
    const char *r0[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "0", "--set", set0,
                        "--set", pub0, NULL};
    const char *r1[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "1", "--set", set1,
                        "--set", pub1, NULL};
    pid_t learner = it_spawn(&j, "learner.log", la);
    it_spawn(&j, "reward.log", ra);
    it_spawn(&j, "rollout0.log", r0);
    it_spawn(&j, "rollout1.log", r1);
    int st = 0;
    int ok = it_wait(learner, IT_ASAN ? 300000 : 120000, &st);
    if (!ok || it_exit_code(st) != 0) {
        it_dump(&j, "learner.log");
        it_dump(&j, "rollout0.log");
        it_dump(&j, "rollout1.log");
    }
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(st), 0);
    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_FATAL(fin != NULL);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_step"), steps);
    CU_ASSERT(it_num(fin, "moerl_transport_refused_clients_total") >= 1);
    cJSON_Delete(fin);
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/learner.log", j.dir);
    char *log = it_slurp(path);
    CU_ASSERT(log && strstr(log, "rollout rollout-0 joined"));
    CU_ASSERT(log && !strstr(log, "rollout-1 joined"));
    CU_ASSERT(log && strstr(log, "not on transport.curve_allowed_clients") &&
              strstr(log, r1pub));
    free(log);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"an allow-list admits listed clients only", test_allow_list},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_curve_clients", tests);
}
