/* Integration: daemons and `moerl run` started with a bad config, an endpoint already in
 * use, or CURVE keys missing fail at once, exit 1 and say which key or endpoint is wrong;
 * `moerl run` starts nothing then. A learner whose learner.ranks does not divide the
 * experts goes through mpirun and its refusal is reported as the learner's error.
 * run.device cuda is refused by a build without the CUDA backend, and with expert
 * parallelism; learner.comm nccl with fewer GPUs than ranks stops the learner at startup. */
#include <sys/stat.h>

#ifdef MOERL_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

#include "tests/it_job.h"

#define FAST_MS (IT_ASAN ? 60000 : 30000) /* "at once": far below any training time */

typedef struct outcome {
    int code;
    char *out; /* the process's output (malloc'd) */
} outcome_t;

/* Runs argv to completion (at most FAST_MS) with its output in dir/<log>. */
static outcome_t run_to_end(it_job_t *j, const char *log, const char *const *argv) {
    outcome_t o = {-1, NULL};
    pid_t pid = it_spawn(j, log, argv);
    int st;
    if (it_wait(pid, FAST_MS, &st))
        o.code = it_exit_code(st);
    else
        tu_report("%s %s did not exit within %d ms", argv[1], argv[2], FAST_MS);
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, log);
    o.out = it_slurp(path);
    if (!o.out)
        o.out = strdup("");
    return o;
}

static void expect_fail(outcome_t o, const char *a, const char *b) {
    CU_ASSERT_EQUAL(o.code, 1);
    bool ok = strstr(o.out, a) != NULL && (!b || strstr(o.out, b) != NULL);
    if (!ok || o.code != 1)
        tu_report("exit %d, expected '%s'%s%s in:\n%s", o.code, a, b ? " and " : "", b ? b : "",
                  o.out);
    CU_ASSERT(ok);
    free(o.out);
}

static bool exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void test_bad_config(void) {
    it_job_t j;
    it_open(&j, "learner:\n  stepz: 5\n");
    const char *exe = tu_moerl_exe();
    const char *run[] = {exe, "run", j.config, NULL};
    expect_fail(run_to_end(&j, "run.out", run), "learner.stepz: unknown key", "learner.steps");
    CU_ASSERT(!exists(j.run)); /* nothing was started or created */
    const char *daemons[][6] = {{exe, "learner", j.config, NULL},
                                {exe, "rollout", j.config, "--worker-id", "0", NULL},
                                {exe, "reward", j.config, "--worker-id", "0", NULL}};
    for (int i = 0; i < 3; i++)
        expect_fail(run_to_end(&j, "daemon.out", daemons[i]), "stepz", NULL);
    /* A value out of range given with --set. */
    const char *set[] = {exe, "run", j.config, "--set", "rollout.workers=0", NULL};
    it_write_config(&j, j.config, "");
    expect_fail(run_to_end(&j, "set.out", set), "rollout.workers", "expected an integer");
    it_close(&j);
}

static void test_endpoint_in_use(void) {
    char extra[4096];
    it_knobs_t k = it_knobs_default();
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    /* Someone else holds the learner's work port and the reward worker's port. */
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    void *work = NULL, *reward = NULL;
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", j.port + 1);
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_ROUTER, ep, &o, &work) == MO_OK);
    char ep_r[64];
    snprintf(ep_r, sizeof ep_r, "tcp://127.0.0.1:%d", j.port + 4);
    CU_ASSERT_FATAL(zsock_bind(ctx, ZMQ_ROUTER, ep_r, &o, &reward) == MO_OK);
    const char *exe = tu_moerl_exe();
    const char *run[] = {exe, "run", j.config, NULL};
    expect_fail(run_to_end(&j, "run.out", run), "transport.work", ep);
    CU_ASSERT(!exists(j.run));
    const char *learner[] = {exe, "learner", j.config, NULL};
    expect_fail(run_to_end(&j, "learner.out", learner), ep, NULL);
    const char *rew[] = {exe, "reward", j.config, "--worker-id", "0", NULL};
    expect_fail(run_to_end(&j, "reward.out", rew), ep_r, NULL);
    zsock_close(&work);
    zsock_close(&reward);
    zmq_ctx_term(ctx);
    it_close(&j);
}

static void test_keys_missing(void) {
    char extra[4096];
    it_knobs_t k = it_knobs_default();
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    /* Key files that do not exist, given with --set. */
    char sk[IT_PATH + 64], pk[IT_PATH + 64], srv[IT_PATH + 64];
    snprintf(sk, sizeof sk, "transport.curve_secret_key=%s/keys/job.key", j.dir);
    snprintf(pk, sizeof pk, "transport.curve_public_key=%s/keys/job.pub", j.dir);
    snprintf(srv, sizeof srv, "transport.curve_server_key=%s/keys/job.pub", j.dir);
    const char *exe = tu_moerl_exe();
    const char *run[] = {exe, "run", j.config, "--set", sk, "--set", pk, "--set", srv, NULL};
    expect_fail(run_to_end(&j, "run.out", run), "transport.curve_secret_key", "job.key");
    CU_ASSERT(!exists(j.run));
    const char *daemons[][12] = {
        {exe, "learner", j.config, "--set", sk, "--set", pk, "--set", srv, NULL},
        {exe, "rollout", j.config, "--worker-id", "0", "--set", sk, "--set", pk, "--set", srv,
         NULL},
        {exe, "reward", j.config, "--worker-id", "0", "--set", sk, "--set", pk, "--set", srv,
         NULL}};
    for (int i = 0; i < 3; i++)
        expect_fail(run_to_end(&j, "daemon.out", daemons[i]), "curve_secret_key", "job.key");
    it_close(&j);
}

/* Keeps Open MPI on this host and inside the container (as tests/CMakeLists.txt does for
 * the MPI suites). */
static void local_mpi(void) {
    setenv("OMPI_MCA_plm", "isolated", 1);
    setenv("OMPI_MCA_btl", "self,vader", 1);
    setenv("OMPI_MCA_pml", "ob1", 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
}

static void test_ranks_through_mpirun(void) {
    char extra[4096];
    it_knobs_t k = it_knobs_default();
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    local_mpi();
    const char *exe = tu_moerl_exe();
    /* 3 ranks cannot share the tiny model's 8 experts: every rank refuses, and the
     * learner's own message is what the job failure names. */
    const char *run[] = {exe, "run", j.config, "--set", "learner.ranks=3", "--no-status", NULL};
    expect_fail(run_to_end(&j, "run.out", run), "the job failed: learner exited with status",
                "cannot be split evenly over N = 3 ranks");
    it_close(&j);
}

/* run.device cuda: without the CUDA backend the config check refuses it at once, naming
 * the file and the key; in any build, a merged rollout adapter with it is refused; with
 * NCCL, learner.comm nccl on fewer GPUs than ranks stops the learner at startup. */
static void test_device_cuda(void) {
    char extra[4096];
    it_knobs_t k = it_knobs_default();
    it_sections(extra, sizeof extra - 32, &k);
    strcat(extra, "run.device: cuda\n");
    it_job_t j;
    it_open(&j, extra);
    const char *exe = tu_moerl_exe();
#ifndef MOERL_HAVE_CUDA
    const char *no_cuda = "run.device: cuda: this build has no CUDA backend";
    const char *run[] = {exe, "run", j.config, NULL};
    expect_fail(run_to_end(&j, "run.out", run), "job.yaml:", no_cuda);
    CU_ASSERT(!exists(j.run));
    const char *learner[] = {exe, "learner", j.config, NULL};
    expect_fail(run_to_end(&j, "learner.out", learner), "job.yaml:", no_cuda);
#endif
    const char *merged[] = {exe, "learner", j.config, "--set", "rollout.merge_adapter=true", NULL};
    expect_fail(run_to_end(&j, "merged.out", merged),
                "rollout.merge_adapter: cuda runs the rollout engine's adapter unmerged", NULL);
#ifdef MOERL_HAVE_NCCL
    /* learner.comm nccl over 2 ranks with fewer than 2 GPUs: every rank stops at startup
     * saying why (none waits for the others), and the job failure names the learner. */
    int ngpu = 0;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess)
        ngpu = 0;
    if (ngpu < 2) {
        local_mpi();
        const char *nccl[] = {exe,
                              "run",
                              j.config,
                              "--set",
                              "learner.ranks=2",
                              "--set",
                              "learner.comm=nccl",
                              "--no-status",
                              NULL};
        expect_fail(run_to_end(&j, "nccl.out", nccl), "the job failed: learner exited with status",
                    "learner.comm nccl");
    }
#endif
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"bad config", test_bad_config},       {"endpoint in use", test_endpoint_in_use},
        {"keys missing", test_keys_missing},   {"ranks through mpirun", test_ranks_through_mpirun},
        {"run.device cuda", test_device_cuda}, CU_TEST_INFO_NULL,
    };
    return tu_main("it_startup_errors", tests);
}
