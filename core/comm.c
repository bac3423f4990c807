/* comm: argument checks, byte counters and backend selection shared by the
 * single, MPI and NCCL backends. */
#include "core/comm.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

static const char *const g_op_names[COMM_OP_COUNT] = {
    [COMM_OP_ALLTOALLV] = "alltoallv",   [COMM_OP_COUNTS] = "counts",
    [COMM_OP_ALLREDUCE] = "allreduce",   [COMM_OP_BCAST] = "bcast",
    [COMM_OP_ALLGATHERV] = "allgatherv", [COMM_OP_GATHERV] = "gatherv",
    [COMM_OP_BARRIER] = "barrier",
};

const char *comm_op_name(comm_op_t op) {
    return (unsigned)op < COMM_OP_COUNT ? g_op_names[op] : "?";
}

const char *comm_backend_name(const comm_t *c) {
    return c ? c->ops->name : "none";
}

void comm_set_stream(comm_t *c, void *stream) {
    if (c)
        c->stream = stream;
}

const comm_stats_t *comm_stats(const comm_t *c, comm_op_t op) {
    MO_ASSERT(c && (unsigned)op < COMM_OP_COUNT);
    return &c->stats[op];
}

void comm_stats_reset(comm_t *c) {
    if (c)
        memset(c->stats, 0, sizeof c->stats);
}

int64_t comm_displs_from_counts(int64_t *displs, const int64_t *counts, int n) {
    int64_t total = 0;
    for (int p = 0; p < n; p++) {
        if (counts[p] < 0 || counts[p] > INT64_MAX - total)
            return -1;
        displs[p] = total;
        total += counts[p];
    }
    return total;
}

/* ---- argument checks ---------------------------------------------------- */

static int check_comm(const comm_t *c, const char *fn) {
    if (!c)
        return mo_errorf(MO_EINVAL, "%s: communicator is NULL", fn);
    return MO_OK;
}

static int check_dtype(dtype_t dt, const char *fn) {
    if ((unsigned)dt >= DT_COUNT)
        return mo_errorf(MO_EINVAL, "%s: dtype %d is not a dtype_t", fn, (int)dt);
    return MO_OK;
}

static int check_root(const comm_t *c, int root, const char *fn) {
    if (root < 0 || root >= c->size)
        return mo_errorf(MO_EINVAL, "%s: root %d outside [0, %d)", fn, root, c->size);
    return MO_OK;
}

/* One block of `count` elements at element `displ` of buf. */
static int check_block(const void *buf, int64_t count, int64_t displ, size_t es, const char *fn,
                       const char *what, int peer) {
    if (count < 0)
        return mo_errorf(MO_EINVAL, "%s: %s count for rank %d is %lld (negative)", fn, what, peer,
                         (long long)count);
    if (displ < 0)
        return mo_errorf(MO_EINVAL, "%s: %s displacement for rank %d is %lld (negative)", fn, what,
                         peer, (long long)displ);
    if (count > 0 && !buf)
        return mo_errorf(MO_EINVAL, "%s: %s buffer is NULL but rank %d has %lld elements", fn, what,
                         peer, (long long)count);
    if (count > (int64_t)(INT64_MAX / es) - displ)
        return mo_errorf(MO_EINVAL,
                         "%s: %s block for rank %d (displacement %lld + count %lld) "
                         "overflows a byte offset",
                         fn, what, peer, (long long)displ, (long long)count);
    return MO_OK;
}

/* A per-peer description: counts and displacements (N) for buf. */
static int check_blocks(const comm_t *c, const void *buf, const int64_t *counts,
                        const int64_t *displs, size_t es, const char *fn, const char *what) {
    if (!counts || !displs)
        return mo_errorf(MO_EINVAL, "%s: %s counts or displacements are NULL", fn, what);
    for (int p = 0; p < c->size; p++)
        TRY(check_block(buf, counts[p], displs[p], es, fn, what, p));
    return MO_OK;
}

static uint64_t sum_others(const int64_t *counts, int n, int skip) {
    uint64_t s = 0;
    for (int p = 0; p < n; p++)
        if (p != skip)
            s += (uint64_t)counts[p];
    return s;
}

static void count_op(comm_t *c, comm_op_t op, uint64_t sent, uint64_t recv, uint64_t local) {
    comm_stats_t *s = &c->stats[op];
    s->calls++;
    s->bytes_sent += sent;
    s->bytes_recv += recv;
    s->bytes_local += local;
}

/* ---- operations --------------------------------------------------------- */

int comm_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                   const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                   const int64_t *recv_displs, dtype_t dt) {
    static const char fn[] = "comm_alltoallv";
    TRY(check_comm(c, fn));
    TRY(check_dtype(dt, fn));
    size_t es = dtype_size(dt);
    TRY(check_blocks(c, sendbuf, send_counts, send_displs, es, fn, "send"));
    TRY(check_blocks(c, recvbuf, recv_counts, recv_displs, es, fn, "recv"));
    int r = c->rank;
    if (send_counts[r] != recv_counts[r])
        return mo_errorf(MO_EINVAL, "%s: rank %d sends itself %lld elements but expects %lld", fn,
                         r, (long long)send_counts[r], (long long)recv_counts[r]);
    TRY(c->ops->alltoallv(c, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs,
                          dt));
    count_op(c, COMM_OP_ALLTOALLV, sum_others(send_counts, c->size, r) * es,
             sum_others(recv_counts, c->size, r) * es, (uint64_t)send_counts[r] * es);
    return MO_OK;
}

int comm_exchange_counts(comm_t *c, const int64_t *send_counts, int64_t *recv_counts) {
    static const char fn[] = "comm_exchange_counts";
    TRY(check_comm(c, fn));
    if (!send_counts || !recv_counts)
        return mo_errorf(MO_EINVAL, "%s: counts array is NULL", fn);
    for (int p = 0; p < c->size; p++)
        if (send_counts[p] < 0)
            return mo_errorf(MO_EINVAL, "%s: count for rank %d is %lld (negative)", fn, p,
                             (long long)send_counts[p]);
    TRY(c->ops->exchange_counts(c, send_counts, recv_counts));
    uint64_t others = (uint64_t)(c->size - 1) * sizeof(int64_t);
    count_op(c, COMM_OP_COUNTS, others, others, sizeof(int64_t));
    return MO_OK;
}

int comm_allreduce_sum(comm_t *c, const void *sendbuf, void *recvbuf, size_t n, dtype_t dt) {
    static const char fn[] = "comm_allreduce_sum";
    TRY(check_comm(c, fn));
    if (dt != DT_F32 && dt != DT_F64 && dt != DT_I32 && dt != DT_I64)
        return mo_errorf(MO_EINVAL, "%s: dtype %s not summable here (F32, F64, I32 or I64)", fn,
                         dtype_name(dt));
    size_t es = dtype_size(dt);
    if (n > INT64_MAX / es)
        return mo_errorf(MO_EINVAL, "%s: %zu elements overflow a byte count", fn, n);
    if (n > 0 && (!sendbuf || !recvbuf))
        return mo_errorf(MO_EINVAL, "%s: NULL buffer for %zu elements", fn, n);
    uintptr_t s = (uintptr_t)sendbuf, d = (uintptr_t)recvbuf, nb = n * es;
    if (n > 0 && s != d && s < d + nb && d < s + nb)
        return mo_errorf(MO_EINVAL, "%s: send and recv buffers overlap without being equal", fn);
    TRY(c->ops->allreduce_sum(c, sendbuf, recvbuf, n, dt));
    if (c->size > 1)
        count_op(c, COMM_OP_ALLREDUCE, nb, nb, 0);
    else
        count_op(c, COMM_OP_ALLREDUCE, 0, 0, nb);
    return MO_OK;
}

int comm_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root) {
    static const char fn[] = "comm_bcast";
    TRY(check_comm(c, fn));
    TRY(check_dtype(dt, fn));
    TRY(check_root(c, root, fn));
    size_t es = dtype_size(dt);
    if (n > INT64_MAX / es)
        return mo_errorf(MO_EINVAL, "%s: %zu elements overflow a byte count", fn, n);
    if (n > 0 && !buf)
        return mo_errorf(MO_EINVAL, "%s: NULL buffer for %zu elements", fn, n);
    TRY(c->ops->bcast(c, buf, n, dt, root));
    uint64_t nb = (uint64_t)n * es;
    if (c->rank == root)
        count_op(c, COMM_OP_BCAST, (uint64_t)(c->size - 1) * nb, 0, nb);
    else
        count_op(c, COMM_OP_BCAST, 0, nb, 0);
    return MO_OK;
}

/* The receive side of allgatherv/gatherv plus this rank's own block. */
static int check_gather(const comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                        const int64_t *recv_counts, const int64_t *recv_displs, size_t es,
                        int receives, const char *fn) {
    TRY(check_block(sendbuf, send_count, 0, es, fn, "send", c->rank));
    if (!receives)
        return MO_OK;
    TRY(check_blocks(c, recvbuf, recv_counts, recv_displs, es, fn, "recv"));
    if (recv_counts[c->rank] != send_count)
        return mo_errorf(MO_EINVAL, "%s: rank %d sends %lld elements but expects %lld from itself",
                         fn, c->rank, (long long)send_count, (long long)recv_counts[c->rank]);
    return MO_OK;
}

int comm_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                    const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt) {
    static const char fn[] = "comm_allgatherv";
    TRY(check_comm(c, fn));
    TRY(check_dtype(dt, fn));
    size_t es = dtype_size(dt);
    TRY(check_gather(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, es, 1, fn));
    TRY(c->ops->allgatherv(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, dt));
    uint64_t mine = (uint64_t)send_count * es;
    count_op(c, COMM_OP_ALLGATHERV, (uint64_t)(c->size - 1) * mine,
             sum_others(recv_counts, c->size, c->rank) * es, mine);
    return MO_OK;
}

int comm_gatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                 const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt, int root) {
    static const char fn[] = "comm_gatherv";
    TRY(check_comm(c, fn));
    TRY(check_dtype(dt, fn));
    TRY(check_root(c, root, fn));
    size_t es = dtype_size(dt);
    int is_root = c->rank == root;
    TRY(check_gather(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, es, is_root, fn));
    TRY(c->ops->gatherv(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, dt, root));
    uint64_t mine = (uint64_t)send_count * es;
    if (is_root)
        count_op(c, COMM_OP_GATHERV, 0, sum_others(recv_counts, c->size, root) * es, mine);
    else
        count_op(c, COMM_OP_GATHERV, mine, 0, 0);
    return MO_OK;
}

int comm_barrier(comm_t *c) {
    TRY(check_comm(c, "comm_barrier"));
    TRY(c->ops->barrier(c));
    count_op(c, COMM_OP_BARRIER, 0, 0, 0);
    return MO_OK;
}

/* ---- creation ----------------------------------------------------------- */

int comm_destroy(comm_t **c) {
    if (!c || !*c)
        return MO_OK;
    comm_t *x = *c;
    *c = NULL;
    return x->ops->destroy(x);
}

/* Environment variables through which launchers announce a started rank. */
static const char *const g_launcher_vars[] = {
    "OMPI_COMM_WORLD_SIZE", /* Open MPI's mpirun */
    "PMIX_RANK",            /* PMIx launchers (srun --mpi=pmix, prterun) */
    "PMI_RANK",             /* PMI-1/2 launchers (srun --mpi=pmi2, MPICH hydra) */
    "PMI_SIZE",
    "SLURM_STEP_NUM_TASKS", /* srun; absent in a batch script outside srun */
};

static int launched_by_launcher(void) {
    for (size_t i = 0; i < sizeof g_launcher_vars / sizeof g_launcher_vars[0]; i++) {
        const char *v = getenv(g_launcher_vars[i]);
        if (v && v[0])
            return 1;
    }
    return 0;
}

/* The number of ranks a launcher says it started, or 0 when none says. */
static long launcher_size(const char **which) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (!v || !v[0])
            continue;
        char *end;
        errno = 0;
        long n = strtol(v, &end, 10);
        if (errno == 0 && *end == '\0' && n > 0) {
            *which = vars[i];
            return n;
        }
    }
    return 0;
}

static int host_comm_from_env(comm_t **out) {
    return launched_by_launcher() ? comm_mpi_new(out) : comm_single_new(out);
}

int comm_init_from_env(comm_t **out, const char *backend) {
    if (!out)
        return mo_errorf(MO_EINVAL, "comm_init_from_env: out is NULL");
    *out = NULL;
    if (!backend || strcmp(backend, "auto") == 0)
        return host_comm_from_env(out);
    if (strcmp(backend, "single") == 0) {
        const char *which = NULL;
        long n = launcher_size(&which);
        if (n > 1)
            return mo_errorf(MO_ECONFIG,
                             "comm backend 'single' chosen but the launcher started "
                             "%ld ranks (%s): use 'mpi', 'nccl' or 'auto'",
                             n, which);
        return comm_single_new(out);
    }
    if (strcmp(backend, "mpi") == 0)
        return comm_mpi_new(out);
    if (strcmp(backend, "nccl") == 0) {
#ifdef MOERL_HAVE_NCCL
        comm_t *boot = NULL;
        TRY(host_comm_from_env(&boot));
        return comm_nccl_new(out, &boot, -1);
#else
        return mo_errorf(MO_EUNSUPPORTED, "comm backend 'nccl': this build has no NCCL (configure "
                                          "with CUDA and NCCL installed)");
#endif
    }
    return mo_errorf(MO_ECONFIG, "comm backend '%s' unknown (expected auto, single, mpi or nccl)",
                     backend);
}
