/* Integration: `moerl run` with learner.ranks 2 starts the learner through mpirun; the
 * two ranks hold 4 of the tiny model's 8 experts each, train the job's steps, checkpoint,
 * publish whole adapter versions that the rollout workers take, and every process exits
 * 0. */
#include <sys/stat.h>

#include "tests/it_job.h"

static void test_run_two_ranks(void) {
    char extra[4096];
    it_knobs_t k = it_knobs_default();
    k.steps = IT_ASAN ? 2 : 4;
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    /* Keep Open MPI on this host and inside the container (as tests/CMakeLists.txt does
     * for the MPI suites). */
    setenv("OMPI_MCA_plm", "isolated", 1);
    setenv("OMPI_MCA_btl", "self,vader", 1);
    setenv("OMPI_MCA_pml", "ob1", 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    if (IT_ASAN) { /* Open MPI's allocations kept past MPI_Finalize, as for the MPI suites */
        char lsan[IT_PATH + 128], asan[512];
        snprintf(lsan, sizeof lsan, "suppressions=%s/tests/lsan-mpi.supp:print_suppressions=0",
                 tu_source_dir());
        setenv("LSAN_OPTIONS", lsan, 1);
        const char *a = getenv("ASAN_OPTIONS");
        snprintf(asan, sizeof asan, "%s%sfast_unwind_on_malloc=0", a ? a : "", a && *a ? ":" : "");
        setenv("ASAN_OPTIONS", asan, 1);
    }
    const char *run[] = {tu_moerl_exe(), "run", j.config, "--set", "learner.ranks=2",
                         "--no-status", NULL};
    pid_t pid = it_spawn(&j, "run.out", run);
    int status = 0;
    int ok = it_wait(pid, IT_ASAN ? 400000 : 200000, &status);
    if (!ok || it_exit_code(status) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL_FATAL(it_exit_code(status), 0);

    /* The learner's ranks described their share; every daemon exited 0. */
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/logs/learner.log", j.run);
    char *log = it_slurp(path);
    CU_ASSERT_FATAL(log != NULL);
    int both = strstr(log, "rank 0 of 2 holds experts 0..3 of 8") != NULL &&
               strstr(log, "rank 1 of 2 holds experts 4..7 of 8") != NULL;
    if (!both)
        tu_report("learner log:\n%s", log);
    CU_ASSERT(both);
    free(log);
    snprintf(path, sizeof path, "%s/logs/run.log", j.run);
    log = it_slurp(path);
    CU_ASSERT_FATAL(log != NULL);
    const char *procs[] = {"learner", "rollout-0", "rollout-1", "reward-0"};
    for (int i = 0; i < 4; i++) {
        char want[64];
        snprintf(want, sizeof want, "  %-12s exit 0\n", procs[i]);
        CU_ASSERT(strstr(log, want) != NULL);
    }
    free(log);

    /* Every step trained and the last one was checkpointed. */
    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_FATAL(fin != NULL);
    CU_ASSERT_EQUAL((int)it_num(fin, "moerl_learner_step"), k.steps);
    cJSON_Delete(fin);
    struct stat st;
    snprintf(path, sizeof path, "%s/checkpoints/step-%06d/adapter/adapter_model.safetensors",
             j.run, k.steps);
    CU_ASSERT(stat(path, &st) == 0);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"run with two learner ranks", test_run_two_ranks},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_learner_ep", tests);
}
