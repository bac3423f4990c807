/* comm_mpi: the MPI backend (Open MPI) on host buffers; arguments were
 * checked by the comm front end, this file checks what MPI's int counts can
 * carry and turns MPI errors into statuses. */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"

typedef struct {
    MPI_Comm comm; /* a duplicate of MPI_COMM_WORLD that returns errors */
    int *ibuf;     /* (4, N) int counts and displacements handed to MPI */
} mpi_impl_t;

/* Communicators alive, and whether this module called MPI_Init_thread. */
static int g_live;
static int g_initialised_here;

static int mpi_fail(int err, const char *call) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "MPI error code %d", err);
    return mo_errorf(MO_EIO, "%s failed: %s", call, msg);
}

#define MPI_TRY(call, name)                                                                        \
    do {                                                                                           \
        int mpi_rc_ = (call);                                                                      \
        if (mpi_rc_ != MPI_SUCCESS)                                                                \
            return mpi_fail(mpi_rc_, name);                                                        \
    } while (0)

static MPI_Comm mcomm(const comm_t *c) {
    return ((const mpi_impl_t *)c->impl)->comm;
}

/* Data movement needs only the element size; sums need the real type. */
static MPI_Datatype mpi_type(dtype_t dt) {
    switch (dt) {
    case DT_F32: return MPI_FLOAT;
    case DT_F64: return MPI_DOUBLE;
    case DT_I64: return MPI_INT64_T;
    case DT_I32: return MPI_INT32_T;
    case DT_I16: return MPI_INT16_T;
    case DT_BF16:
    case DT_F16:
    case DT_U16: return MPI_UINT16_T;
    case DT_I8: return MPI_INT8_T;
    default: return MPI_UINT8_T; /* DT_U8, DT_BOOL, DT_F8E4M3 */
    }
}

/* MPI counts and displacements are int: refuse what does not fit. */
static int to_int(int64_t v, int *out, const char *fn, const char *what, int peer, dtype_t dt) {
    if (v > INT_MAX)
        return mo_errorf(MO_EUNSUPPORTED,
                         "%s (mpi): %s %lld for rank %d exceeds INT_MAX "
                         "elements of %s, the largest MPI count; split the operation",
                         fn, what, (long long)v, peer, dtype_name(dt));
    *out = (int)v;
    return MO_OK;
}

static int to_ints(const comm_t *c, const int64_t *v, int *out, const char *fn, const char *what,
                   dtype_t dt) {
    for (int p = 0; p < c->size; p++)
        TRY(to_int(v[p], &out[p], fn, what, p, dt));
    return MO_OK;
}

static int size_to_int(size_t n, const char *fn, dtype_t dt) {
    if (n > INT_MAX)
        return mo_errorf(MO_EUNSUPPORTED,
                         "%s (mpi): %zu elements of %s exceed INT_MAX, the "
                         "largest MPI count; split the operation",
                         fn, n, dtype_name(dt));
    return (int)n;
}

static int mpi_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                         const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                         const int64_t *recv_displs, dtype_t dt) {
    static const char fn[] = "comm_alltoallv";
    int n = c->size, *ib = ((mpi_impl_t *)c->impl)->ibuf;
    int *sc = ib, *sd = ib + n, *rc = ib + 2 * (size_t)n, *rd = ib + 3 * (size_t)n;
    TRY(to_ints(c, send_counts, sc, fn, "send count", dt));
    TRY(to_ints(c, send_displs, sd, fn, "send displacement", dt));
    TRY(to_ints(c, recv_counts, rc, fn, "recv count", dt));
    TRY(to_ints(c, recv_displs, rd, fn, "recv displacement", dt));
    MPI_Datatype t = mpi_type(dt);
    MPI_TRY(MPI_Alltoallv(sendbuf, sc, sd, t, recvbuf, rc, rd, t, mcomm(c)), "MPI_Alltoallv");
    return MO_OK;
}

static int mpi_exchange_counts(comm_t *c, const int64_t *send_counts, int64_t *recv_counts) {
    MPI_TRY(MPI_Alltoall(send_counts, 1, MPI_INT64_T, recv_counts, 1, MPI_INT64_T, mcomm(c)),
            "MPI_Alltoall (count exchange)");
    return MO_OK;
}

static int mpi_allreduce_sum(comm_t *c, const void *sendbuf, void *recvbuf, size_t n, dtype_t dt) {
    int cnt = size_to_int(n, "comm_allreduce_sum", dt);
    TRY(cnt);
    const void *src = sendbuf == recvbuf ? MPI_IN_PLACE : sendbuf;
    MPI_TRY(MPI_Allreduce(src, recvbuf, cnt, mpi_type(dt), MPI_SUM, mcomm(c)), "MPI_Allreduce");
    return MO_OK;
}

static int mpi_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root) {
    int cnt = size_to_int(n, "comm_bcast", dt);
    TRY(cnt);
    MPI_TRY(MPI_Bcast(buf, cnt, mpi_type(dt), root, mcomm(c)), "MPI_Bcast");
    return MO_OK;
}

static int mpi_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                          const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt) {
    static const char fn[] = "comm_allgatherv";
    int n = c->size, *ib = ((mpi_impl_t *)c->impl)->ibuf, sc = 0;
    int *rc = ib, *rd = ib + n;
    TRY(to_int(send_count, &sc, fn, "send count", c->rank, dt));
    TRY(to_ints(c, recv_counts, rc, fn, "recv count", dt));
    TRY(to_ints(c, recv_displs, rd, fn, "recv displacement", dt));
    MPI_Datatype t = mpi_type(dt);
    MPI_TRY(MPI_Allgatherv(sendbuf, sc, t, recvbuf, rc, rd, t, mcomm(c)), "MPI_Allgatherv");
    return MO_OK;
}

static int mpi_gatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                       const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt,
                       int root) {
    static const char fn[] = "comm_gatherv";
    int n = c->size, *ib = ((mpi_impl_t *)c->impl)->ibuf, sc = 0;
    int *rc = NULL, *rd = NULL;
    TRY(to_int(send_count, &sc, fn, "send count", c->rank, dt));
    if (c->rank == root) {
        rc = ib;
        rd = ib + n;
        TRY(to_ints(c, recv_counts, rc, fn, "recv count", dt));
        TRY(to_ints(c, recv_displs, rd, fn, "recv displacement", dt));
    }
    MPI_Datatype t = mpi_type(dt);
    MPI_TRY(MPI_Gatherv(sendbuf, sc, t, recvbuf, rc, rd, t, root, mcomm(c)), "MPI_Gatherv");
    return MO_OK;
}

static int mpi_barrier(comm_t *c) {
    MPI_TRY(MPI_Barrier(mcomm(c)), "MPI_Barrier");
    return MO_OK;
}

/* Ends MPI when this module started it and no communicator is left. */
static int release_mpi(void) {
    if (g_live > 0 || !g_initialised_here)
        return MO_OK;
    g_initialised_here = 0;
    MPI_TRY(MPI_Finalize(), "MPI_Finalize");
    return MO_OK;
}

static int mpi_destroy(comm_t *c) {
    mpi_impl_t *m = c->impl;
    int rc = MO_OK, err = MPI_Comm_free(&m->comm);
    if (err != MPI_SUCCESS)
        rc = mpi_fail(err, "MPI_Comm_free");
    free(m->ibuf);
    free(m);
    free(c);
    g_live--;
    int fin = release_mpi();
    return rc < 0 ? rc : fin;
}

static const comm_ops_t g_mpi_ops = {
    .name = "mpi",
    .alltoallv = mpi_alltoallv,
    .exchange_counts = mpi_exchange_counts,
    .allreduce_sum = mpi_allreduce_sum,
    .bcast = mpi_bcast,
    .allgatherv = mpi_allgatherv,
    .gatherv = mpi_gatherv,
    .barrier = mpi_barrier,
    .destroy = mpi_destroy,
};

static int ensure_mpi(void) {
    int inited = 0, finalized = 0;
    MPI_TRY(MPI_Finalized(&finalized), "MPI_Finalized");
    if (finalized)
        return mo_errorf(MO_ESTATE,
                         "comm_mpi_new: MPI was already finalised in this process (it "
                         "cannot restart; keep one MPI communicator for the process's lifetime)");
    MPI_TRY(MPI_Initialized(&inited), "MPI_Initialized");
    if (inited)
        return MO_OK;
    int provided = 0;
    MPI_TRY(MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    g_initialised_here = 1;
    MPI_TRY(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    return MO_OK;
}

/* Rank, size, and the ranks sharing this host, from MPI. */
static int fill_ranks(comm_t *c, MPI_Comm comm) {
    MPI_TRY(MPI_Comm_rank(comm, &c->rank), "MPI_Comm_rank");
    MPI_TRY(MPI_Comm_size(comm, &c->size), "MPI_Comm_size");
    MPI_Comm node;
    MPI_TRY(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
    int e1 = MPI_Comm_rank(node, &c->local_rank), e2 = MPI_Comm_size(node, &c->local_size);
    int e3 = MPI_Comm_free(&node);
    MPI_TRY(e1, "MPI_Comm_rank (node)");
    MPI_TRY(e2, "MPI_Comm_size (node)");
    MPI_TRY(e3, "MPI_Comm_free (node)");
    return MO_OK;
}

static int mpi_setup(comm_t *c, mpi_impl_t *m) {
    MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &m->comm), "MPI_Comm_dup");
    MPI_TRY(MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    TRY(fill_ranks(c, m->comm));
    m->ibuf = malloc(4 * (size_t)c->size * sizeof(int));
    if (!m->ibuf)
        return mo_errorf(MO_ENOMEM, "comm_mpi_new: out of memory for %d ranks", c->size);
    return MO_OK;
}

int comm_mpi_new(comm_t **out) {
    if (!out)
        return mo_errorf(MO_EINVAL, "comm_mpi_new: out is NULL");
    *out = NULL;
    comm_t *c = calloc(1, sizeof *c);
    mpi_impl_t *m = calloc(1, sizeof *m);
    if (!c || !m) {
        free(c);
        free(m);
        return mo_errorf(MO_ENOMEM, "comm_mpi_new: out of memory");
    }
    m->comm = MPI_COMM_NULL;
    int rc = ensure_mpi(), counted = 0;
    if (rc == MO_OK) {
        g_live++;
        counted = 1;
        rc = mpi_setup(c, m);
    }
    if (rc < 0) {
        if (m->comm != MPI_COMM_NULL)
            MPI_Comm_free(&m->comm);
        free(m->ibuf);
        free(m);
        free(c);
        g_live -= counted;
        if (g_live == 0 && g_initialised_here) { /* keep the first message */
            g_initialised_here = 0;
            MPI_Finalize();
        }
        return mo_error_wrap(rc, "comm_mpi_new");
    }
    c->ops = &g_mpi_ops;
    c->device = DEV_CPU;
    c->impl = m;
    *out = c;
    return MO_OK;
}
