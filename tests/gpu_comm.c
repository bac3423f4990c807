/* gpu_comm: the NCCL backend of the comm layer on one GPU (size 1, bootstrapped
 * over the single backend): every operation on device buffers, the byte
 * counters, and a stream set by the caller. Exits 77 (skipped) without NCCL
 * or without a device. */
#include <stdio.h>

#ifdef MOERL_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"
#include "tests/testutil.h"

static comm_t *g_c; /* (created in main) */

static void *to_device(const void *host, size_t nb) {
    void *d = NULL;
    CU_ASSERT_EQUAL_FATAL(cudaMalloc(&d, nb), cudaSuccess);
    CU_ASSERT_EQUAL_FATAL(cudaMemcpy(d, host, nb, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void to_host(void *host, const void *d, size_t nb) {
    CU_ASSERT_EQUAL_FATAL(cudaDeviceSynchronize(), cudaSuccess);
    CU_ASSERT_EQUAL_FATAL(cudaMemcpy(host, d, nb, cudaMemcpyDeviceToHost), cudaSuccess);
}

static void test_properties(void) {
    CU_ASSERT_STRING_EQUAL(comm_backend_name(g_c), "nccl");
    CU_ASSERT_EQUAL(comm_rank(g_c), 0);
    CU_ASSERT_EQUAL(comm_size(g_c), 1);
    CU_ASSERT_EQUAL(comm_device(g_c), DEV_CUDA);
}

static void test_alltoallv(void) {
    float send[9], recv[12]; /* (9), (12) */
    tu_fill(send, 9, 21, -2.0f, 2.0f);
    tu_poison(recv, 12);
    void *ds = to_device(send, sizeof send), *dr = to_device(recv, sizeof recv);
    int64_t sc[1] = {5}, sd[1] = {3}, rd[1] = {6};
    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(comm_alltoallv(g_c, ds, sc, sd, dr, sc, rd, DT_F32), 0);
    to_host(recv, dr, sizeof recv);
    int bad = 0;
    for (int i = 0; i < 12; i++)
        bad += (i >= 6 && i < 11) ? recv[i] != send[i - 3] : !isnan(recv[i]);
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT_EQUAL(comm_stats(g_c, COMM_OP_ALLTOALLV)->bytes_local, 5 * 4);
    cudaFree(ds);
    cudaFree(dr);
}

static void test_exchange_counts_barrier(void) {
    int64_t sc[1] = {(1LL << 40) + 3}, rc[1] = {-1};
    CU_ASSERT_EQUAL(comm_exchange_counts(g_c, sc, rc), 0);
    CU_ASSERT_EQUAL(rc[0], sc[0]);
    CU_ASSERT_EQUAL(comm_barrier(g_c), 0);
}

static void test_allreduce(void) {
    float x[300], y[300]; /* (300) */
    tu_fill(x, 300, 22, -1.0f, 1.0f);
    tu_poison(y, 300);
    void *dx = to_device(x, sizeof x), *dy = to_device(y, sizeof y);
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, dx, dy, 300, DT_F32), 0);
    to_host(y, dy, sizeof y);
    CU_ASSERT_EQUAL(memcmp(x, y, sizeof x), 0);
    int64_t xi[3] = {1LL << 45, -3, 17}, yi[3];
    void *di = to_device(xi, sizeof xi);
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, di, di, 3, DT_I64), 0); /* in place */
    to_host(yi, di, sizeof yi);
    CU_ASSERT_EQUAL(memcmp(xi, yi, sizeof xi), 0);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(di);
}

static void test_bcast_gathers(void) {
    double b[5] = {1.5, -2.0, 3.25, 4.0, -5.5}, back[5];
    void *db = to_device(b, sizeof b);
    CU_ASSERT_EQUAL(comm_bcast(g_c, db, 5, DT_F64, 0), 0);
    to_host(back, db, sizeof back);
    CU_ASSERT_EQUAL(memcmp(b, back, sizeof b), 0);

    float send[4], recv[7]; /* (4), (7) */
    tu_fill(send, 4, 23, -1.0f, 1.0f);
    tu_poison(recv, 7);
    void *ds = to_device(send, sizeof send), *dr = to_device(recv, sizeof recv);
    int64_t rc[1] = {4}, rd[1] = {2};
    CU_ASSERT_EQUAL(comm_allgatherv(g_c, ds, 4, dr, rc, rd, DT_F32), 0);
    to_host(recv, dr, sizeof recv);
    CU_ASSERT(isnan(recv[0]) && isnan(recv[1]) && isnan(recv[6]));
    CU_ASSERT_EQUAL(memcmp(recv + 2, send, sizeof send), 0);

    rd[0] = 3;
    CU_ASSERT_EQUAL(comm_gatherv(g_c, ds, 4, dr, rc, rd, DT_F32, 0), 0);
    to_host(recv, dr, sizeof recv);
    CU_ASSERT(isnan(recv[0]) && isnan(recv[1]));
    CU_ASSERT_EQUAL(memcmp(recv + 3, send, sizeof send), 0);
    cudaFree(db);
    cudaFree(ds);
    cudaFree(dr);
}

/* Operations queue on the caller's stream. */
static void test_stream(void) {
    cudaStream_t st;
    CU_ASSERT_EQUAL_FATAL(cudaStreamCreate(&st), cudaSuccess);
    float x[64], y[64]; /* (64) */
    tu_fill(x, 64, 24, -1.0f, 1.0f);
    tu_poison(y, 64);
    void *dx = to_device(x, sizeof x), *dy = to_device(y, sizeof y);
    comm_set_stream(g_c, st);
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, dx, dy, 64, DT_F32), 0);
    CU_ASSERT_EQUAL(cudaStreamSynchronize(st), cudaSuccess);
    comm_set_stream(g_c, NULL);
    to_host(y, dy, sizeof y);
    CU_ASSERT_EQUAL(memcmp(x, y, sizeof x), 0);
    cudaFree(dx);
    cudaFree(dy);
    cudaStreamDestroy(st);
}

static CU_TestInfo g_tests[] = {
    {"properties", test_properties},
    {"alltoallv", test_alltoallv},
    {"exchange_counts_barrier", test_exchange_counts_barrier},
    {"allreduce", test_allreduce},
    {"bcast_gathers", test_bcast_gathers},
    {"stream", test_stream},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("gpu_comm: no CUDA device, skipped\n");
        return 77;
    }
    comm_t *boot = NULL;
    if (comm_single_new(&boot) < 0 || comm_nccl_new(&g_c, &boot, 0) < 0) {
        fprintf(stderr, "gpu_comm: %s\n", mo_last_error());
        return 1;
    }
    int rc = tu_main("gpu_comm", g_tests);
    if (comm_destroy(&g_c) < 0) {
        fprintf(stderr, "gpu_comm: %s\n", mo_last_error());
        rc = 1;
    }
    return rc;
}

#else
int main(void) {
    printf("gpu_comm: this build has no NCCL, skipped\n");
    return 77;
}
#endif
