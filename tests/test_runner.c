/* Tests for the runner of `moerl run`: run directory paths and preparation (the
 * resolved config written and read back, checkpoints refused without --resume), the
 * checks before start (an endpoint in use, a remote endpoint without CURVE, a missing
 * key file, a missing model directory), the daemons' command lines (mpirun for
 * ranks > 1, with the root flags), PATH lookup, and the status line from metrics JSON
 * lines appended piece by piece. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "core/config.h"
#include "core/status.h"
#include "learner/runner.h"
#include "tests/testutil.h"
#include "transport/zsock.h"

static char g_dir[256];
static int g_port; /* control; work +1, trajectories +2, weights +3, reward +4 and +5 */

/* Six consecutive ports on 127.0.0.1 that are free now. */
static int free_ports(void) {
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    for (int attempt = 0; attempt < 200; attempt++) {
        int base = 20000 + (int)(((unsigned)getpid() * 61u + (unsigned)attempt * 997u) % 30000u);
        int ok = 1;
        for (int i = 0; i < 6 && ok; i++) {
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

/* A config whose run dir and model live in the test's directory, on free ports. */
static void make_config(moerl_config_t *c, const char *extra_set) {
    char run[400], model[400], ep[5][64];
    snprintf(run, sizeof run, "run.dir=%s/run", g_dir);
    snprintf(model, sizeof model, "model.path=%s/model", g_dir);
    const char *keys[5] = {"control", "work", "trajectories", "weights", "reward"};
    if (g_port <= 0)
        g_port = free_ports();
    CU_ASSERT_FATAL(g_port > 0);
    for (int i = 0; i < 5; i++)
        snprintf(ep[i], sizeof ep[i], "transport.%s=tcp://127.0.0.1:%d", keys[i], g_port + i);
    const char *sets[] = {run,
                          model,
                          ep[0],
                          ep[1],
                          ep[2],
                          ep[3],
                          ep[4],
                          "reward.workers=2",
                          "rollout.workers=3",
                          "learner.steps=40",
                          extra_set};
    int n = extra_set ? 11 : 10;
    CU_ASSERT_FATAL(config_load(c, NULL, sets, n, NULL) == MO_OK);
}

static void make_model_dir(void) {
    char path[400];
    snprintf(path, sizeof path, "%s/model", g_dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/model/config.json", g_dir);
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs("{}\n", f);
    fclose(f);
}

static void test_paths_and_prepare(void) {
    CU_ASSERT_FATAL(tu_tmpdir(g_dir, sizeof g_dir) == 0);
    moerl_config_t c;
    make_config(&c, "learner.lr=3e-4");
    runner_paths_t p;
    CU_ASSERT_FATAL(runner_paths(&c, &p) == MO_OK);
    char want[600];
    snprintf(want, sizeof want, "%s/run/metrics/learner.jsonl", g_dir);
    CU_ASSERT_STRING_EQUAL(p.metrics, want);
    snprintf(want, sizeof want, "%s/run/logs", g_dir);
    CU_ASSERT_STRING_EQUAL(p.logs, want);
    CU_ASSERT_FATAL(runner_prepare(&c, false, &p) == MO_OK);
    struct stat st;
    CU_ASSERT(stat(p.logs, &st) == 0 && S_ISDIR(st.st_mode));
    /* The resolved config reads back with the override in it. */
    moerl_config_t back;
    CU_ASSERT_FATAL(config_load(&back, p.config, NULL, 0, NULL) == MO_OK);
    CU_ASSERT_DOUBLE_EQUAL(back.learner.lr, 3e-4, 0);
    CU_ASSERT_EQUAL(back.reward.workers, 2);
    CU_ASSERT_STRING_EQUAL(back.run.dir, c.run.dir);
    config_free(&back);
    /* A second start over an existing run is fine until it has a checkpoint. */
    CU_ASSERT(runner_prepare(&c, false, &p) == MO_OK);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/run/checkpoints", g_dir);
    CU_ASSERT_FATAL(mkdir(ck, 0755) == 0);
    snprintf(ck, sizeof ck, "%s/run/checkpoints/latest", g_dir);
    FILE *f = fopen(ck, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs("step-000020\n", f);
    fclose(f);
    CU_ASSERT(runner_prepare(&c, false, &p) == MO_ESTATE);
    CU_ASSERT(strstr(mo_last_error(), "latest: step-000020") != NULL);
    CU_ASSERT(strstr(mo_last_error(), "--resume") != NULL);
    CU_ASSERT(runner_prepare(&c, true, &p) == MO_OK);
    config_free(&c);
    /* runs/<name> when run.dir is empty. */
    const char *sets[] = {"run.name=quick", "run.dir="};
    CU_ASSERT_FATAL(config_load(&c, NULL, sets, 2, NULL) == MO_OK);
    CU_ASSERT_FATAL(runner_paths(&c, &p) == MO_OK);
    CU_ASSERT_STRING_EQUAL(p.run_dir, "runs/quick");
    CU_ASSERT_STRING_EQUAL(p.config, "runs/quick/config.yaml");
    config_free(&c);
    tu_rmtree(g_dir);
}

static void test_preflight(void) {
    CU_ASSERT_FATAL(tu_tmpdir(g_dir, sizeof g_dir) == 0);
    g_port = free_ports();
    CU_ASSERT_FATAL(g_port > 0);
    moerl_config_t c;
    make_config(&c, NULL);
    CU_ASSERT(runner_preflight(&c) == MO_ECONFIG); /* no model directory yet */
    CU_ASSERT(strstr(mo_last_error(), "model.path") != NULL);
    make_model_dir();
    CU_ASSERT(runner_preflight(&c) == MO_OK);
    config_free(&c);

    /* The second reward worker's port taken by someone else. */
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    void *s = NULL;
    char taken[64];
    snprintf(taken, sizeof taken, "tcp://127.0.0.1:%d", g_port + 5);
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_ROUTER, taken, &o, &s) == MO_OK);
    make_config(&c, NULL);
    CU_ASSERT(runner_preflight(&c) == MO_EIO);
    CU_ASSERT(strstr(mo_last_error(), "transport.reward (reward worker 1)") != NULL);
    CU_ASSERT(strstr(mo_last_error(), taken) != NULL);
    config_free(&c);
    zsock_close(&s);
    zmq_ctx_term(ctx);
    make_config(&c, NULL);
    CU_ASSERT(runner_preflight(&c) == MO_OK); /* free again */
    config_free(&c);

    /* A remote endpoint without CURVE (set past the config's own cross-key check). */
    make_config(&c, NULL);
    CU_ASSERT_FATAL(config_set(&c, "transport.weights", "tcp://0.0.0.0:5573") == MO_OK);
    CU_ASSERT(runner_preflight(&c) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "transport.weights") != NULL);
    config_free(&c);

    /* CURVE keys that do not exist: refused before anything binds. */
    char key[600], pub[600];
    snprintf(key, sizeof key, "%s/keys/none.key", g_dir);
    snprintf(pub, sizeof pub, "%s/keys/none.pub", g_dir);
    make_config(&c, NULL);
    CU_ASSERT_FATAL(config_set(&c, "transport.curve_secret_key", key) == MO_OK);
    CU_ASSERT_FATAL(config_set(&c, "transport.curve_public_key", pub) == MO_OK);
    CU_ASSERT(runner_preflight(&c) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "transport.curve_secret_key") != NULL);
    CU_ASSERT(strstr(mo_last_error(), "none.key") != NULL);
    config_free(&c);
    tu_rmtree(g_dir);
}

static void test_plan(void) {
    const char *sets[] = {"rollout.workers=2", "reward.workers=1"};
    moerl_config_t c;
    CU_ASSERT_FATAL(config_load(&c, NULL, sets, 2, NULL) == MO_OK);
    runner_plan_opts_t o = {"/opt/moerl", "runs/x/config.yaml", false, "/usr/bin/mpirun", false};
    runner_plan_t p;
    CU_ASSERT_FATAL(runner_plan(&c, &o, &p) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(p.n, 4);
    const char *want[4][6] = {
        {"/opt/moerl", "learner", "runs/x/config.yaml", NULL},
        {"/opt/moerl", "rollout", "runs/x/config.yaml", "--worker-id", "0", NULL},
        {"/opt/moerl", "rollout", "runs/x/config.yaml", "--worker-id", "1", NULL},
        {"/opt/moerl", "reward", "runs/x/config.yaml", "--worker-id", "0", NULL},
    };
    const char *names[4] = {"learner", "rollout-0", "rollout-1", "reward-0"};
    for (int i = 0; i < 4; i++) {
        CU_ASSERT_STRING_EQUAL(p.procs[i].name, names[i]);
        CU_ASSERT_EQUAL(p.procs[i].primary, i == 0);
        CU_ASSERT_EQUAL(p.procs[i].restart, i != 0);
        int j = 0;
        for (; want[i][j]; j++)
            CU_ASSERT(p.procs[i].argv[j] && !strcmp(p.procs[i].argv[j], want[i][j]));
        CU_ASSERT(p.procs[i].argv[j] == NULL);
    }
    runner_plan_free(&p);
    CU_ASSERT(p.procs == NULL && p.n == 0);

    CU_ASSERT_FATAL(config_set(&c, "learner.ranks", "4") == MO_OK);
    o.resume = true;
    o.as_root = true;
    CU_ASSERT_FATAL(runner_plan(&c, &o, &p) == MO_OK);
    const char *mpi[] = {"/usr/bin/mpirun", "-np",        "4",       "--allow-run-as-root",
                         "--oversubscribe", "/opt/moerl", "learner", "runs/x/config.yaml",
                         "--resume",        NULL};
    int j = 0;
    for (; mpi[j]; j++)
        CU_ASSERT(p.procs[0].argv[j] && !strcmp(p.procs[0].argv[j], mpi[j]));
    CU_ASSERT(p.procs[0].argv[j] == NULL);
    runner_plan_free(&p);
    o.as_root = false;
    CU_ASSERT_FATAL(runner_plan(&c, &o, &p) == MO_OK);
    CU_ASSERT_STRING_EQUAL(p.procs[0].argv[3], "/opt/moerl");
    runner_plan_free(&p);
    o.mpirun = "";
    CU_ASSERT(runner_plan(&c, &o, &p) == MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "mpirun") != NULL);
    config_free(&c);

    char path[4096];
    CU_ASSERT(runner_which("sh", path, sizeof path) == MO_OK);
    CU_ASSERT(access(path, X_OK) == 0 && strstr(path, "/sh") != NULL);
    CU_ASSERT(runner_which("moerl-no-such-program", path, sizeof path) == MO_ENOTFOUND);
    CU_ASSERT(runner_which("/bin/sh", path, sizeof path) == MO_OK);
    CU_ASSERT(runner_which("/no/such/file", path, sizeof path) == MO_ENOTFOUND);
}

static void append_file(const char *path, const char *text) {
    FILE *f = fopen(path, "a");
    CU_ASSERT_FATAL(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_status_line(void) {
    CU_ASSERT_FATAL(tu_tmpdir(g_dir, sizeof g_dir) == 0);
    char path[400];
    snprintf(path, sizeof path, "%s/learner.jsonl", g_dir);
    runner_status_t st;
    runner_status_init(&st, path, 40);
    char line[512];
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_REDRAW);
    CU_ASSERT(strstr(line, "waiting for the first step") == line);
    /* A start event without a step, then a step line arriving in two pieces. */
    append_file(path, "{\"time\":1.5,\"daemon\":\"learner\",\"event\":\"start\"}\n"
                      "{\"time\":2,\"event\":\"step\",\"moerl_learner_step\":10,"
                      "\"moerl_learner_reward_mean\":0.4125,");
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_REDRAW);
    CU_ASSERT(strstr(line, "waiting") == line);
    append_file(path, "\"moerl_rollout_tokens_per_s_total\":1234.4,"
                      "\"moerl_learner_weight_sync_ms\":35.2,\"moerl_learner_accuracy\":null}\n");
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_NEWS);
    CU_ASSERT(strstr(line, "step 10/40 [##--------] reward 0.412 | 1234 tok/s | sync 35 ms | ") ==
              line);
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_REDRAW);
    /* Garbage lines are skipped; accuracy and larger throughput formats. */
    append_file(path, "not json\n{\"moerl_learner_step\":40,\"moerl_learner_reward_mean\":0.9,"
                      "\"moerl_learner_accuracy\":0.75,"
                      "\"moerl_rollout_tokens_per_s_total\":25000}\n");
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_NEWS);
    CU_ASSERT(strstr(line, "step 40/40 [##########] reward 0.900 | acc 0.750 | 25.0k tok/s | "
                           "sync 35 ms") == line);
    /* A file replaced by a shorter one is read again from the start. */
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs("{\"moerl_learner_step\":3}\n", f);
    fclose(f);
    CU_ASSERT_EQUAL(runner_status_poll(&st, line, sizeof line), SUP_STATUS_NEWS);
    CU_ASSERT(strstr(line, "step 3/40 [----------]") == line);
    tu_rmtree(g_dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"paths and prepare", test_paths_and_prepare},
        {"preflight", test_preflight},
        {"plan", test_plan},
        {"status line", test_status_line},
        CU_TEST_INFO_NULL,
    };
    return tu_main("runner", tests);
}
