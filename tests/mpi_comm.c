/* mpi_comm: the MPI backend under mpirun with any number of ranks: routing of
 * variable all-to-all (zero counts, a rank that receives nothing), exact
 * sums, broadcast, gathers, the count exchange, byte counters against their
 * formulas, and MPI's int limits. Every rank runs the suite; the process
 * exits non-zero when any rank saw a failure. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"

static comm_t *g_c; /* (created in main, shared by every test) */
static int g_rank, g_size;

/* Elements rank s sends rank d: zero for several pairs, and nothing at all
 * to the last rank when there are several. */
static int64_t a2a_count(int s, int d) {
    if (g_size > 1 && d == g_size - 1)
        return 0;
    return (int64_t)((3 * s + d) % 4) * 5;
}

/* The value element i of the block from s to d carries: (s, d, i) packed so
 * that any misrouted element differs (exact in f32 for up to 64 ranks). */
static uint64_t code(int s, int d, int64_t i) {
    return ((uint64_t)s * 64 + (uint64_t)d) * 64 + (uint64_t)i + 1;
}

static void put(void *buf, int64_t k, dtype_t dt, uint64_t v) {
    switch (dt) {
    case DT_F32: ((float *)buf)[k] = (float)v; break;
    case DT_I32: ((int32_t *)buf)[k] = (int32_t)v; break;
    case DT_I64: ((int64_t *)buf)[k] = (int64_t)v * -7; break; /* negative, past 32 bits */
    case DT_BF16: /* moved as 2-byte elements, like U16 */
    case DT_U16: ((uint16_t *)buf)[k] = (uint16_t)(v * 2654435761u >> 7); break;
    default: ((uint8_t *)buf)[k] = (uint8_t)(v * 2654435761u >> 11); break;
    }
}

static int equals(const void *buf, int64_t k, dtype_t dt, uint64_t v) {
    switch (dt) {
    case DT_F32: return ((const float *)buf)[k] == (float)v;
    case DT_I32: return ((const int32_t *)buf)[k] == (int32_t)v;
    case DT_I64: return ((const int64_t *)buf)[k] == (int64_t)v * -7;
    case DT_BF16:
    case DT_U16: return ((const uint16_t *)buf)[k] == (uint16_t)(v * 2654435761u >> 7);
    default: return ((const uint8_t *)buf)[k] == (uint8_t)(v * 2654435761u >> 11);
    }
}

/* Integer poison; float buffers get NaN. Neither equals any code. */
static void poison(void *buf, int64_t n, dtype_t dt) {
    if (dt == DT_F32)
        tu_poison(buf, (size_t)n);
    else
        memset(buf, 0xa5, (size_t)n * dtype_size(dt));
}

static int is_poison(const void *buf, int64_t k, dtype_t dt) {
    if (dt == DT_F32)
        return isnan(((const float *)buf)[k]);
    size_t es = dtype_size(dt);
    const uint8_t *b = (const uint8_t *)buf + (size_t)k * es;
    for (size_t j = 0; j < es; j++)
        if (b[j] != 0xa5)
            return 0;
    return 1;
}

static void test_ranks(void) {
    CU_ASSERT_STRING_EQUAL(comm_backend_name(g_c), "mpi");
    CU_ASSERT(g_size >= 1 && g_rank >= 0 && g_rank < g_size);
    const char *env_size = getenv("OMPI_COMM_WORLD_SIZE"),
               *env_rank = getenv("OMPI_COMM_WORLD_RANK");
    if (env_size && env_rank) {
        CU_ASSERT_EQUAL(atoi(env_size), g_size);
        CU_ASSERT_EQUAL(atoi(env_rank), g_rank);
    }
    /* mpirun here starts every rank on this host. */
    CU_ASSERT_EQUAL(comm_local_size(g_c), g_size);
    CU_ASSERT_EQUAL(comm_local_rank(g_c), g_rank);
    CU_ASSERT_EQUAL(comm_device(g_c), DEV_CPU);
}

static void test_exchange_counts(void) {
    int64_t *sc = malloc(sizeof(int64_t) * g_size), *rc = malloc(sizeof(int64_t) * g_size);
    for (int d = 0; d < g_size; d++) {
        sc[d] = (int64_t)g_rank * 1000000007LL + (int64_t)d * 13 + (1LL << 33); /* past 32 bits */
        rc[d] = -1;
    }
    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(comm_exchange_counts(g_c, sc, rc), 0);
    for (int s = 0; s < g_size; s++)
        CU_ASSERT_EQUAL(rc[s], (int64_t)s * 1000000007LL + (int64_t)g_rank * 13 + (1LL << 33));
    const comm_stats_t *st = comm_stats(g_c, COMM_OP_COUNTS);
    CU_ASSERT_EQUAL(st->calls, 1);
    CU_ASSERT_EQUAL(st->bytes_sent, (uint64_t)(g_size - 1) * 8);
    CU_ASSERT_EQUAL(st->bytes_recv, (uint64_t)(g_size - 1) * 8);
    CU_ASSERT_EQUAL(st->bytes_local, 8);
    free(sc);
    free(rc);
}

/* One variable all-to-all in dtype dt. Send blocks sit in destination order
 * with a one-element gap before each; receive blocks sit in reverse source
 * order with a two-element gap, so that displacements are honoured. */
static void alltoallv_once(dtype_t dt) {
    int n = g_size, r = g_rank;
    size_t es = dtype_size(dt);
    int64_t *sc = calloc(n, 8), *sd = calloc(n, 8), *rc = calloc(n, 8), *rd = calloc(n, 8);
    int64_t stotal = 0, rtotal = 0;
    for (int d = 0; d < n; d++) {
        sc[d] = a2a_count(r, d);
        sd[d] = stotal + 1;
        stotal += sc[d] + 1;
    }
    CU_ASSERT_EQUAL(comm_exchange_counts(g_c, sc, rc), 0);
    for (int s = n - 1; s >= 0; s--) {
        CU_ASSERT_EQUAL(rc[s], a2a_count(s, r));
        rd[s] = rtotal + 2;
        rtotal += rc[s] + 2;
    }
    int receives_nothing = n > 1 && r == n - 1;
    void *send = malloc((size_t)stotal * es);
    void *recv = receives_nothing ? NULL : malloc((size_t)rtotal * es);
    poison(send, stotal, dt);
    if (recv)
        poison(recv, rtotal, dt);
    for (int d = 0; d < n; d++)
        for (int64_t i = 0; i < sc[d]; i++)
            put(send, sd[d] + i, dt, code(r, d, i));
    if (receives_nothing)
        memset(rc, 0, sizeof(int64_t) * n); /* and recvbuf is NULL */

    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(comm_alltoallv(g_c, send, sc, sd, recv, rc, rd, dt), 0);
    int64_t bad = 0, checked = 0;
    for (int s = 0; s < n && recv; s++) {
        for (int64_t i = 0; i < rc[s]; i++, checked++)
            bad += !equals(recv, rd[s] + i, dt, code(s, r, i));
        for (int64_t g = rd[s] - 2; g < rd[s]; g++) /* the gap stays poisoned */
            bad += !is_poison(recv, g, dt);
    }
    if (bad)
        tu_report("rank %d %s: %lld misrouted or clobbered elements", r, dtype_name(dt),
                  (long long)bad);
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(receives_nothing || rtotal == 2 * (int64_t)n + checked);

    uint64_t sent = 0, got = 0;
    for (int p = 0; p < n; p++) {
        if (p == r)
            continue;
        sent += (uint64_t)a2a_count(r, p) * es;
        got += (uint64_t)a2a_count(p, r) * es;
    }
    const comm_stats_t *st = comm_stats(g_c, COMM_OP_ALLTOALLV);
    CU_ASSERT_EQUAL(st->calls, 1);
    CU_ASSERT_EQUAL(st->bytes_sent, sent);
    CU_ASSERT_EQUAL(st->bytes_recv, got);
    CU_ASSERT_EQUAL(st->bytes_local, (uint64_t)a2a_count(r, r) * es);
    free(send);
    free(recv);
    free(sc), free(sd), free(rc), free(rd);
}

static void test_alltoallv(void) {
    const dtype_t dts[] = {DT_F32, DT_I64, DT_I32, DT_U8, DT_BF16};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++)
        alltoallv_once(dts[i]);
}

/* Sums whose every partial sum is exact, so any order gives one answer. */
#define NSUM 1000
static void test_allreduce(void) {
    float *xf = malloc(NSUM * sizeof(float)), *yf = malloc(NSUM * sizeof(float));
    double *xd = malloc(NSUM * sizeof(double));
    int64_t *xi = malloc(NSUM * sizeof(int64_t));
    for (int i = 0; i < NSUM; i++) {
        /* multiples of 1/64 up to 1000 in f32; of 2^-24 below 2^24 in f64 */
        xf[i] = (float)((int64_t)(rng_uniform(7, (uint64_t)g_rank, (uint64_t)i) * 128000) - 64000) /
                64.0f;
        xd[i] = ldexp((double)(g_rank + 1) * (i + 1), -24) + 1048576.0 * (g_rank + 1);
        xi[i] = ((int64_t)(g_rank + 1) << 40) - (int64_t)i * (g_rank + 3);
    }
    tu_poison(yf, NSUM);
    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, xf, yf, NSUM, DT_F32), 0); /* out of place */
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, xd, xd, NSUM, DT_F64), 0); /* in place */
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, xi, xi, NSUM, DT_I64), 0);
    int64_t bad = 0, tri = (int64_t)g_size * (g_size + 1) / 2;
    for (int i = 0; i < NSUM; i++) {
        double want_f = 0;
        for (int s = 0; s < g_size; s++)
            want_f +=
                (double)((int64_t)(rng_uniform(7, (uint64_t)s, (uint64_t)i) * 128000) - 64000) /
                64.0;
        bad += yf[i] != (float)want_f;
        bad += xd[i] != ldexp((double)tri * (i + 1), -24) + 1048576.0 * tri;
        int64_t want_i = (tri << 40) - (int64_t)i * (tri + 2 * (int64_t)g_size);
        bad += xi[i] != want_i;
    }
    if (bad)
        tu_report("rank %d: %lld sums differ from the exact value", g_rank, (long long)bad);
    CU_ASSERT_EQUAL(bad, 0);
    const comm_stats_t *st = comm_stats(g_c, COMM_OP_ALLREDUCE);
    uint64_t nb = (uint64_t)NSUM * (4 + 8 + 8);
    CU_ASSERT_EQUAL(st->calls, 3);
    CU_ASSERT_EQUAL(st->bytes_sent, g_size > 1 ? nb : 0);
    CU_ASSERT_EQUAL(st->bytes_recv, g_size > 1 ? nb : 0);
    CU_ASSERT_EQUAL(st->bytes_local, g_size > 1 ? 0 : nb);
    free(xf), free(yf), free(xd), free(xi);
}

static void test_bcast(void) {
    int roots[2] = {0, g_size - 1};
    for (int k = 0; k < 2; k++) {
        int root = roots[k];
        double b[37];
        uint8_t u[5];
        for (int i = 0; i < 37; i++)
            b[i] = g_rank == root ? (root + 1) * 0.25 + i * 1.5 : NAN;
        memset(u, g_rank == root ? 0x3c + root : 0, sizeof u);
        comm_stats_reset(g_c);
        CU_ASSERT_EQUAL(comm_bcast(g_c, b, 37, DT_F64, root), 0);
        CU_ASSERT_EQUAL(comm_bcast(g_c, u, 5, DT_U8, root), 0);
        int bad = 0;
        for (int i = 0; i < 37; i++)
            bad += b[i] != (root + 1) * 0.25 + i * 1.5;
        for (int i = 0; i < 5; i++)
            bad += u[i] != 0x3c + root;
        CU_ASSERT_EQUAL(bad, 0);
        const comm_stats_t *st = comm_stats(g_c, COMM_OP_BCAST);
        uint64_t nb = 37 * 8 + 5;
        CU_ASSERT_EQUAL(st->calls, 2);
        CU_ASSERT_EQUAL(st->bytes_sent, g_rank == root ? (uint64_t)(g_size - 1) * nb : 0);
        CU_ASSERT_EQUAL(st->bytes_recv, g_rank == root ? 0 : nb);
        CU_ASSERT_EQUAL(st->bytes_local, g_rank == root ? nb : 0);
    }
}

/* Rank s contributes gather_count(s) elements (zero for rank 1). */
static int64_t gather_count(int s) {
    return s == 1 ? 0 : 2 + (s * 5) % 7;
}
static float gather_value(int s, int64_t i) {
    return (float)((int64_t)s * 100 + i) + 0.5f;
}

/* Gather layout: blocks in rank order after a one-element gap each. */
static int64_t gather_layout(int64_t *rc, int64_t *rd) {
    int64_t total = 0;
    for (int s = 0; s < g_size; s++) {
        rc[s] = gather_count(s);
        rd[s] = total + 1;
        total += rc[s] + 1;
    }
    return total;
}

static int64_t gather_check(const float *recv, const int64_t *rc, const int64_t *rd) {
    int64_t bad = 0;
    for (int s = 0; s < g_size; s++) {
        bad += !isnan(recv[rd[s] - 1]);
        for (int64_t i = 0; i < rc[s]; i++)
            bad += recv[rd[s] + i] != gather_value(s, i);
    }
    return bad;
}

static void test_gatherv(void) {
    int64_t *rc = malloc(sizeof(int64_t) * (size_t)g_size),
            *rd = malloc(sizeof(int64_t) * (size_t)g_size);
    int64_t total = gather_layout(rc, rd), mine = gather_count(g_rank);
    float send[8], *recv = malloc(sizeof(float) * total);
    for (int64_t i = 0; i < mine; i++)
        send[i] = gather_value(g_rank, i);
    int roots[2] = {0, g_size - 1};
    for (int k = 0; k < 2; k++) {
        int root = roots[k], is_root = g_rank == root;
        tu_poison(recv, (size_t)total);
        comm_stats_reset(g_c);
        /* receive arguments are not read off the root */
        int rc_g = is_root ? comm_gatherv(g_c, send, mine, recv, rc, rd, DT_F32, root)
                           : comm_gatherv(g_c, send, mine, NULL, NULL, NULL, DT_F32, root);
        CU_ASSERT_EQUAL(rc_g, 0);
        CU_ASSERT(!is_root || gather_check(recv, rc, rd) == 0);
        uint64_t others = 0;
        for (int s = 0; s < g_size; s++)
            others += s == root ? 0 : (uint64_t)gather_count(s) * 4;
        const comm_stats_t *st = comm_stats(g_c, COMM_OP_GATHERV);
        CU_ASSERT_EQUAL(st->bytes_sent, is_root ? 0 : (uint64_t)mine * 4);
        CU_ASSERT_EQUAL(st->bytes_recv, is_root ? others : 0);
        CU_ASSERT_EQUAL(st->bytes_local, is_root ? (uint64_t)mine * 4 : 0);
    }
    free(rc), free(rd), free(recv);
}

static void test_allgatherv(void) {
    int64_t *rc = malloc(sizeof(int64_t) * (size_t)g_size),
            *rd = malloc(sizeof(int64_t) * (size_t)g_size);
    int64_t total = gather_layout(rc, rd), mine = gather_count(g_rank);
    float send[8], *recv = malloc(sizeof(float) * total);
    for (int64_t i = 0; i < mine; i++)
        send[i] = gather_value(g_rank, i);
    tu_poison(recv, (size_t)total);
    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(comm_allgatherv(g_c, send, mine, recv, rc, rd, DT_F32), 0);
    CU_ASSERT_EQUAL(gather_check(recv, rc, rd), 0);
    const comm_stats_t *st = comm_stats(g_c, COMM_OP_ALLGATHERV);
    uint64_t others = 0;
    for (int s = 0; s < g_size; s++)
        others += s == g_rank ? 0 : (uint64_t)gather_count(s) * 4;
    CU_ASSERT_EQUAL(st->bytes_sent, (uint64_t)(g_size - 1) * mine * 4);
    CU_ASSERT_EQUAL(st->bytes_recv, others);
    CU_ASSERT_EQUAL(st->bytes_local, (uint64_t)mine * 4);
    free(rc), free(rd), free(recv);
}

/* Counts past INT_MAX fail cleanly on every rank before any message moves;
 * the communicator stays usable. */
static void test_int_limits(void) {
    int n = g_size, r = g_rank;
    int64_t *sc = calloc(n, 8), *rc = calloc(n, 8), *z = calloc(n, 8);
    sc[(r + 1) % n] = (int64_t)INT_MAX + 1;
    rc[(r + n - 1) % n] = (int64_t)INT_MAX + 1;
    char dummy[8]; /* never touched: the count is refused first */
    mo_clear_error();
    CU_ASSERT_EQUAL(comm_alltoallv(g_c, dummy, sc, z, dummy, rc, z, DT_U8), MO_EUNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "INT_MAX"));
    mo_clear_error();
    CU_ASSERT_EQUAL(comm_bcast(g_c, dummy, (size_t)INT_MAX + 1, DT_U8, 0), MO_EUNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "INT_MAX"));
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, dummy, dummy, (size_t)INT_MAX + 1, DT_F32),
                    MO_EUNSUPPORTED);
    /* on root the NULL receive arguments are refused, elsewhere the count */
    CU_ASSERT(comm_gatherv(g_c, dummy, (int64_t)INT_MAX + 1, NULL, NULL, NULL, DT_U8, 0) < 0);
    CU_ASSERT_EQUAL(comm_bcast(g_c, dummy, 1, DT_U8, n), MO_EINVAL); /* root out of range */
    CU_ASSERT_EQUAL(comm_barrier(g_c), 0);
    CU_ASSERT_EQUAL(comm_stats(g_c, COMM_OP_BARRIER)->calls >= 1, 1);
    free(sc), free(rc), free(z);
}

static CU_TestInfo g_tests[] = {
    {"ranks", test_ranks},
    {"exchange_counts", test_exchange_counts},
    {"alltoallv", test_alltoallv},
    {"allreduce", test_allreduce},
    {"bcast", test_bcast},
    {"gatherv", test_gatherv},
    {"allgatherv", test_allgatherv},
    {"int_limits", test_int_limits},
    CU_TEST_INFO_NULL,
};

int main(void) {
    if (comm_init_from_env(&g_c, "auto") < 0) {
        fprintf(stderr, "mpi_comm: %s\n", mo_last_error());
        return 1;
    }
    g_rank = comm_rank(g_c);
    g_size = comm_size(g_c);
    int64_t failed = tu_main("mpi_comm", g_tests) != 0;
    /* Every rank exits with the verdict of all ranks. */
    if (comm_allreduce_sum(g_c, &failed, &failed, 1, DT_I64) < 0) {
        fprintf(stderr, "mpi_comm rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    if (failed && g_rank == 0)
        fprintf(stderr, "mpi_comm: %lld of %d ranks failed\n", (long long)failed, g_size);
    if (comm_destroy(&g_c) < 0) {
        fprintf(stderr, "mpi_comm rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    return failed ? 1 : 0;
}
