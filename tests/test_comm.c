/* test_comm: the comm front end on the single-rank backend: every operation,
 * the byte counters, backend selection from the environment, and rejected
 * arguments. The MPI backend is tested by mpi_comm.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"
#include "tests/testutil.h"

static const char *const g_launcher_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                              "PMI_SIZE", "SLURM_STEP_NUM_TASKS"};

static void clear_launcher_env(void) {
    for (size_t i = 0; i < sizeof g_launcher_vars / sizeof g_launcher_vars[0]; i++)
        unsetenv(g_launcher_vars[i]);
}

static comm_t *new_single(void) {
    comm_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(comm_single_new(&c), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    return c;
}

static void test_init_from_env(void) {
    clear_launcher_env();
    comm_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(comm_init_from_env(&c, "auto"), 0);
    CU_ASSERT_STRING_EQUAL(comm_backend_name(c), "single");
    CU_ASSERT_EQUAL(comm_rank(c), 0);
    CU_ASSERT_EQUAL(comm_size(c), 1);
    CU_ASSERT_EQUAL(comm_local_rank(c), 0);
    CU_ASSERT_EQUAL(comm_local_size(c), 1);
    CU_ASSERT_EQUAL(comm_device(c), DEV_CPU);
    CU_ASSERT_EQUAL(comm_destroy(&c), 0);
    CU_ASSERT_PTR_NULL(c);
    CU_ASSERT_EQUAL(comm_destroy(&c), 0); /* NULL is fine */
    CU_ASSERT_EQUAL(comm_destroy(NULL), 0);

    CU_ASSERT_EQUAL_FATAL(comm_init_from_env(&c, NULL), 0); /* NULL means auto */
    CU_ASSERT_STRING_EQUAL(comm_backend_name(c), "single");
    comm_destroy(&c);

    c = (comm_t *)&c; /* must be overwritten with NULL on failure */
    CU_ASSERT_EQUAL(comm_init_from_env(&c, "carrier-pigeon"), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(c);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "carrier-pigeon"));
    CU_ASSERT_EQUAL(comm_init_from_env(NULL, "single"), MO_EINVAL);

    /* A launcher that started several ranks makes "single" a mistake. */
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    CU_ASSERT_EQUAL(comm_init_from_env(&c, "single"), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(c);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "OMPI_COMM_WORLD_SIZE"));
    clear_launcher_env();
    setenv("SLURM_STEP_NUM_TASKS", "1", 1);
    CU_ASSERT_EQUAL(comm_init_from_env(&c, "single"), 0);
    CU_ASSERT_EQUAL(comm_size(c), 1);
    comm_destroy(&c);
    clear_launcher_env();

#ifndef MOERL_HAVE_NCCL
    CU_ASSERT_EQUAL(comm_init_from_env(&c, "nccl"), MO_EUNSUPPORTED);
    CU_ASSERT_PTR_NULL(c);
#else
    /* One rank on a GPU when there is one; a clean device error when not. */
    int rc = comm_init_from_env(&c, "nccl");
    if (rc == 0) {
        CU_ASSERT_STRING_EQUAL(comm_backend_name(c), "nccl");
        CU_ASSERT_EQUAL(comm_device(c), DEV_CUDA);
        CU_ASSERT_EQUAL(comm_destroy(&c), 0);
    } else {
        CU_ASSERT_EQUAL(rc, MO_EDEVICE);
        CU_ASSERT_PTR_NULL(c);
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "comm_nccl_new"));
    }
#endif
}

static void test_alltoallv(void) {
    comm_t *c = new_single();
    float send[9], recv[12]; /* (9), (12) */
    tu_fill(send, 9, 11, -2.0f, 2.0f);
    tu_poison(recv, 12);
    int64_t sc[1] = {5}, sd[1] = {3}, rc[1] = {5}, rd[1] = {6};
    CU_ASSERT_EQUAL_FATAL(comm_alltoallv(c, send, sc, sd, recv, rc, rd, DT_F32), 0);
    for (int i = 0; i < 12; i++) {
        if (i >= 6 && i < 11) {
            CU_ASSERT_EQUAL(recv[i], send[i - 3]);
        } else {
            CU_ASSERT(isnan(recv[i])); /* outside the block: untouched */
        }
    }
    /* Other element sizes: the displacement is in elements, not bytes. */
    int64_t s64[4] = {-5, 1LL << 40, 7, -(1LL << 50)}, r64[4] = {0, 0, 0, 0};
    int64_t sc2[1] = {3}, sd2[1] = {1}, rc2[1] = {3}, rd2[1] = {0};
    CU_ASSERT_EQUAL(comm_alltoallv(c, s64, sc2, sd2, r64, rc2, rd2, DT_I64), 0);
    CU_ASSERT(r64[0] == s64[1] && r64[1] == s64[2] && r64[2] == s64[3] && r64[3] == 0);
    uint8_t s8[4] = {9, 8, 7, 6}, r8[4] = {0xa5, 0xa5, 0xa5, 0xa5};
    CU_ASSERT_EQUAL(comm_alltoallv(c, s8, sc2, sd2, r8, rc2, rd2, DT_U8), 0);
    CU_ASSERT(r8[0] == 8 && r8[1] == 7 && r8[2] == 6 && r8[3] == 0xa5);
    int32_t s32[3] = {-1, 2, -3}, r32[3] = {0, 0, 0};
    int64_t sd3[1] = {0};
    CU_ASSERT_EQUAL(comm_alltoallv(c, s32, sc2, sd3, r32, rc2, rd2, DT_I32), 0);
    CU_ASSERT(r32[0] == -1 && r32[1] == 2 && r32[2] == -3);
    /* Zero elements with no buffers at all. */
    int64_t z[1] = {0};
    CU_ASSERT_EQUAL(comm_alltoallv(c, NULL, z, z, NULL, z, z, DT_F32), 0);
    comm_destroy(&c);
}

static void test_exchange_counts(void) {
    comm_t *c = new_single();
    int64_t sc[1] = {1234567890123LL}, rc[1] = {-1};
    CU_ASSERT_EQUAL(comm_exchange_counts(c, sc, rc), 0);
    CU_ASSERT_EQUAL(rc[0], sc[0]);
    comm_destroy(&c);
}

static void test_allreduce(void) {
    comm_t *c = new_single();
    float xf[5], yf[5]; /* (5) */
    tu_fill(xf, 5, 3, -1.0f, 1.0f);
    tu_poison(yf, 5);
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, xf, yf, 5, DT_F32), 0);
    CU_ASSERT_EQUAL(memcmp(xf, yf, sizeof xf), 0);
    double xd[4];
    tu_fill_d(xd, 4, 4, -3.0, 3.0);
    double keep[4];
    memcpy(keep, xd, sizeof xd);
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, xd, xd, 4, DT_F64), 0); /* in place */
    CU_ASSERT_EQUAL(memcmp(keep, xd, sizeof xd), 0);
    int64_t xi[3] = {1LL << 45, -3, 17}, yi[3] = {0, 0, 0};
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, xi, yi, 3, DT_I64), 0);
    CU_ASSERT(yi[0] == (1LL << 45) && yi[1] == -3 && yi[2] == 17);
    int32_t a32[2] = {-7, 9}, b32[2] = {0, 0};
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, a32, b32, 2, DT_I32), 0);
    CU_ASSERT(b32[0] == -7 && b32[1] == 9);
    comm_destroy(&c);
}

static void test_bcast_gather(void) {
    comm_t *c = new_single();
    double b[3] = {1.5, -2.25, 3.0};
    CU_ASSERT_EQUAL(comm_bcast(c, b, 3, DT_F64, 0), 0);
    CU_ASSERT(b[0] == 1.5 && b[1] == -2.25 && b[2] == 3.0);

    float send[4], recv[7]; /* (4), (7) */
    tu_fill(send, 4, 5, -1.0f, 1.0f);
    tu_poison(recv, 7);
    int64_t rc[1] = {4}, rd[1] = {2};
    CU_ASSERT_EQUAL(comm_allgatherv(c, send, 4, recv, rc, rd, DT_F32), 0);
    CU_ASSERT(isnan(recv[0]) && isnan(recv[1]) && isnan(recv[6]));
    CU_ASSERT_EQUAL(memcmp(recv + 2, send, sizeof send), 0);

    tu_poison(recv, 7);
    rd[0] = 3;
    CU_ASSERT_EQUAL(comm_gatherv(c, send, 4, recv, rc, rd, DT_F32, 0), 0);
    CU_ASSERT(isnan(recv[0]) && isnan(recv[1]) && isnan(recv[2]));
    CU_ASSERT_EQUAL(memcmp(recv + 3, send, sizeof send), 0);
    CU_ASSERT_EQUAL(comm_barrier(c), 0);
    comm_destroy(&c);
}

/* Counters follow the formulas in comm.h; on one rank everything is local. */
static void test_stats(void) {
    comm_t *c = new_single();
    float f[8] = {1, 2, 3, 4, 5, 6, 7, 8}, g[8];
    int64_t sc[1] = {6}, sd[1] = {1}, rd[1] = {0};
    CU_ASSERT_EQUAL(comm_alltoallv(c, f, sc, sd, g, sc, rd, DT_F32), 0);
    CU_ASSERT_EQUAL(comm_alltoallv(c, f, sc, sd, g, sc, rd, DT_F32), 0);
    int64_t cnt[1] = {3}, got[1];
    CU_ASSERT_EQUAL(comm_exchange_counts(c, cnt, got), 0);
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, f, f, 8, DT_F32), 0);
    CU_ASSERT_EQUAL(comm_bcast(c, f, 5, DT_U8, 0), 0);
    int64_t one[1] = {2}, zero[1] = {0};
    CU_ASSERT_EQUAL(comm_allgatherv(c, f, 2, g, one, zero, DT_F64), 0);
    CU_ASSERT_EQUAL(comm_gatherv(c, f, 2, g, one, zero, DT_I32, 0), 0);
    CU_ASSERT_EQUAL(comm_barrier(c), 0);
    /* A rejected call is not counted. */
    int64_t neg[1] = {-1};
    CU_ASSERT_EQUAL(comm_alltoallv(c, f, neg, sd, g, neg, rd, DT_F32), MO_EINVAL);

    const struct {
        comm_op_t op;
        uint64_t calls, local;
    } want[] = {
        {COMM_OP_ALLTOALLV, 2, 48}, {COMM_OP_COUNTS, 1, 8},      {COMM_OP_ALLREDUCE, 1, 32},
        {COMM_OP_BCAST, 1, 5},      {COMM_OP_ALLGATHERV, 1, 16}, {COMM_OP_GATHERV, 1, 8},
        {COMM_OP_BARRIER, 1, 0},
    };
    CU_ASSERT_EQUAL(sizeof want / sizeof want[0], COMM_OP_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const comm_stats_t *s = comm_stats(c, want[i].op);
        if (s->calls != want[i].calls || s->bytes_local != want[i].local)
            tu_report("%s: calls %llu local %llu, want %llu %llu", comm_op_name(want[i].op),
                      (unsigned long long)s->calls, (unsigned long long)s->bytes_local,
                      (unsigned long long)want[i].calls, (unsigned long long)want[i].local);
        CU_ASSERT_EQUAL(s->calls, want[i].calls);
        CU_ASSERT_EQUAL(s->bytes_local, want[i].local);
        CU_ASSERT_EQUAL(s->bytes_sent, 0);
        CU_ASSERT_EQUAL(s->bytes_recv, 0);
    }
    comm_stats_reset(c);
    for (int op = 0; op < COMM_OP_COUNT; op++)
        CU_ASSERT_EQUAL(comm_stats(c, (comm_op_t)op)->calls, 0);
    CU_ASSERT_STRING_EQUAL(comm_op_name(COMM_OP_ALLTOALLV), "alltoallv");
    CU_ASSERT_STRING_EQUAL(comm_op_name(COMM_OP_COUNT), "?");
    comm_destroy(&c);
}

/* Each rejected call returns MO_EINVAL and names the function. */
#define REJECT(call, fn)                                                                           \
    do {                                                                                           \
        mo_clear_error();                                                                          \
        CU_ASSERT_EQUAL((call), MO_EINVAL);                                                        \
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), fn));                                       \
    } while (0)

static void test_bad_arguments(void) {
    comm_t *c = new_single();
    float f[8] = {1, 2, 3, 4, 5, 6, 7, 8}, g[8] = {0};
    int64_t four[1] = {4}, zero[1] = {0}, neg[1] = {-2}, three[1] = {3};
    int64_t huge[1] = {INT64_MAX / 2};
    const char *a2a = "comm_alltoallv";
    REJECT(comm_alltoallv(NULL, f, four, zero, g, four, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, neg, zero, g, neg, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, four, neg, g, four, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, four, zero, g, four, neg, DT_F32), a2a);
    REJECT(comm_alltoallv(c, NULL, four, zero, g, four, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, four, zero, NULL, four, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, NULL, zero, g, four, zero, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, four, zero, g, four, NULL, DT_F32), a2a);
    REJECT(comm_alltoallv(c, f, four, zero, g, three, zero, DT_F32), a2a); /* self mismatch */
    REJECT(comm_alltoallv(c, f, four, zero, g, four, zero, (dtype_t)DT_COUNT), a2a);
    REJECT(comm_alltoallv(c, f, four, huge, g, four, zero, DT_F64), a2a); /* byte offset */
    CU_ASSERT_EQUAL(comm_stats(c, COMM_OP_ALLTOALLV)->calls, 0);
    CU_ASSERT(g[0] == 0.0f); /* nothing was copied */

    int64_t out[1];
    REJECT(comm_exchange_counts(c, neg, out), "comm_exchange_counts");
    REJECT(comm_exchange_counts(c, NULL, out), "comm_exchange_counts");
    REJECT(comm_exchange_counts(c, four, NULL), "comm_exchange_counts");

    const char *ar = "comm_allreduce_sum";
    REJECT(comm_allreduce_sum(c, f, g, 4, DT_BF16), ar); /* not summable */
    REJECT(comm_allreduce_sum(c, f, g, 4, DT_U8), ar);
    REJECT(comm_allreduce_sum(c, f, f + 1, 4, DT_F32), ar); /* partial overlap */
    REJECT(comm_allreduce_sum(c, f + 2, f, 4, DT_F32), ar);
    REJECT(comm_allreduce_sum(c, NULL, g, 4, DT_F32), ar);
    REJECT(comm_allreduce_sum(c, f, g, SIZE_MAX / 2, DT_F64), ar);
    CU_ASSERT_EQUAL(comm_allreduce_sum(c, f, f + 4, 4, DT_F32), 0); /* adjacent is fine */

    REJECT(comm_bcast(c, f, 4, DT_F32, 1), "comm_bcast"); /* root outside [0, 1) */
    REJECT(comm_bcast(c, f, 4, DT_F32, -1), "comm_bcast");
    REJECT(comm_bcast(c, NULL, 4, DT_F32, 0), "comm_bcast");
    REJECT(comm_bcast(NULL, f, 4, DT_F32, 0), "comm_bcast");

    REJECT(comm_allgatherv(c, f, 3, g, four, zero, DT_F32), "comm_allgatherv"); /* 3 != 4 */
    REJECT(comm_allgatherv(c, f, -1, g, neg, zero, DT_F32), "comm_allgatherv");
    REJECT(comm_allgatherv(c, f, 4, g, NULL, zero, DT_F32), "comm_allgatherv");
    REJECT(comm_allgatherv(c, f, 4, NULL, four, zero, DT_F32), "comm_allgatherv");
    REJECT(comm_gatherv(c, f, 4, g, four, zero, DT_F32, 2), "comm_gatherv");
    REJECT(comm_gatherv(c, f, 4, g, three, zero, DT_F32, 0), "comm_gatherv");
    REJECT(comm_gatherv(c, NULL, 4, g, four, zero, DT_F32, 0), "comm_gatherv");
    REJECT(comm_barrier(NULL), "comm_barrier");
    for (int op = 0; op < COMM_OP_COUNT; op++)
        CU_ASSERT_EQUAL(comm_stats(c, (comm_op_t)op)->calls, op == COMM_OP_ALLREDUCE ? 1 : 0);
    comm_destroy(&c);
}

static void test_displs_from_counts(void) {
    int64_t counts[4] = {3, 0, 5, 2}, displs[4] = {-1, -1, -1, -1};
    CU_ASSERT_EQUAL(comm_displs_from_counts(displs, counts, 4), 10);
    CU_ASSERT(displs[0] == 0 && displs[1] == 3 && displs[2] == 3 && displs[3] == 8);
    int64_t bad[2] = {1, -1};
    CU_ASSERT_EQUAL(comm_displs_from_counts(displs, bad, 2), -1);
    int64_t big[2] = {INT64_MAX, 1};
    CU_ASSERT_EQUAL(comm_displs_from_counts(displs, big, 2), -1);
}

static CU_TestInfo g_tests[] = {
    {"init_from_env", test_init_from_env},
    {"alltoallv", test_alltoallv},
    {"exchange_counts", test_exchange_counts},
    {"allreduce", test_allreduce},
    {"bcast_gather", test_bcast_gather},
    {"stats", test_stats},
    {"bad_arguments", test_bad_arguments},
    {"displs_from_counts", test_displs_from_counts},
    CU_TEST_INFO_NULL,
};

int main(void) {
    return tu_main("comm", g_tests);
}
