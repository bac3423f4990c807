/* comm: collective communication between the ranks of an expert-parallel job
 * (all-to-all-v, all-reduce, broadcast, gather), on a single-rank, an MPI or
 * an NCCL backend, with per-operation byte counters. */
#ifndef MOERL_CORE_COMM_H
#define MOERL_CORE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every operation is collective: all ranks of the communicator call it in the
 * same order with matching arguments (the root, the dtype, element counts
 * that agree pairwise). Counts and displacements are in elements of the
 * dtype, arrays of them have one entry per rank, `N` is the number of ranks,
 * and they always live in host memory. Data buffers live in the memory of
 * comm_device(): host memory for the single and MPI backends, device memory
 * for NCCL. A status error on one rank (a bad argument, say) does not reach
 * the others, which may then wait forever in the next operation: treat any
 * comm error as fatal for the whole job. Calls on one communicator must come
 * from one thread at a time. */

typedef struct comm comm_t;

/* Operation kinds, each with its own counters. */
typedef enum {
    COMM_OP_ALLTOALLV = 0,
    COMM_OP_COUNTS, /* comm_exchange_counts */
    COMM_OP_ALLREDUCE,
    COMM_OP_BCAST,
    COMM_OP_ALLGATHERV,
    COMM_OP_GATHERV,
    COMM_OP_BARRIER,
    COMM_OP_COUNT
} comm_op_t;

/* Counters of one operation kind on this rank. Bytes are the payload as the
 * interface defines it, with es = dtype_size(dt) and r this rank:
 *   alltoallv   sent = sum_{p != r} sc[p]*es, recv = sum_{p != r} rc[p]*es,
 *               local = sc[r]*es
 *   counts      sent = recv = (N-1)*8, local = 8
 *   allgatherv  sent = (N-1)*count*es, recv = sum_{p != r} rc[p]*es,
 *               local = count*es
 *   gatherv     root: sent = 0, recv = sum_{p != root} rc[p]*es,
 *               local = count*es; others: sent = count*es, recv = local = 0
 *   bcast       root: sent = (N-1)*n*es, recv = 0, local = n*es;
 *               others: sent = local = 0, recv = n*es
 *   allreduce   N > 1: sent = recv = n*es, local = 0; N == 1: local = n*es
 *               (a ring all-reduce moves 2(N-1)/N times that each way; the
 *               counters do not model the algorithm underneath)
 *   barrier     calls only
 * Only operations that returned 0 are counted. */
typedef struct {
    uint64_t calls;
    uint64_t bytes_sent;  /* addressed to other ranks */
    uint64_t bytes_recv;  /* received from other ranks */
    uint64_t bytes_local; /* this rank's block to itself */
} comm_stats_t;

/* A backend's operations. The front end (comm_alltoallv and the others)
 * validates arguments and counts bytes before and after calling these. */
typedef struct comm_ops {
    const char *name;
    int (*alltoallv)(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                     const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                     const int64_t *recv_displs, dtype_t dt);
    int (*exchange_counts)(comm_t *c, const int64_t *send_counts, int64_t *recv_counts);
    int (*allreduce_sum)(comm_t *c, const void *sendbuf, void *recvbuf, size_t n, dtype_t dt);
    int (*bcast)(comm_t *c, void *buf, size_t n, dtype_t dt, int root);
    int (*allgatherv)(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                      const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt);
    int (*gatherv)(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                   const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt, int root);
    int (*barrier)(comm_t *c);
    /* Releases the backend state and c itself; returns the first error. */
    int (*destroy)(comm_t *c);
} comm_ops_t;

/* Fields are read through the accessors below; backends fill them in. */
struct comm {
    const comm_ops_t *ops;
    int rank, size;             /* in the job */
    int local_rank, local_size; /* among the ranks on this host */
    device_t device;            /* where data buffers live */
    void *stream;               /* NCCL: the cudaStream_t ops are queued on (NULL: default) */
    comm_stats_t stats[COMM_OP_COUNT];
    void *impl; /* backend state */
};

/* Creates a communicator. backend: "single" (one rank), "mpi", "nccl"
 * (device buffers, bootstrapped over MPI when launched by a launcher, else
 * size 1), or "auto": "mpi" when a launcher started this process (any of
 * OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE, SLURM_STEP_NUM_TASKS is
 * set), "single" otherwise. "single" is refused when a launcher says it
 * started more than one rank. Rank and size come from MPI. */
int comm_init_from_env(comm_t **out, const char *backend);
/* Releases c (NULL is fine) and sets *c to NULL; the MPI backend finalises
 * MPI when it initialised it and this was its last communicator. Returns the
 * first error met while releasing (the memory is released regardless). */
int comm_destroy(comm_t **c);

int comm_single_new(comm_t **out);
/* Initialises MPI (thread level MPI_THREAD_SERIALIZED) unless something
 * already did; errors if MPI was already finalised. */
int comm_mpi_new(comm_t **out);

static inline int comm_rank(const comm_t *c) {
    return c->rank;
}
static inline int comm_size(const comm_t *c) {
    return c->size;
}
static inline int comm_local_rank(const comm_t *c) {
    return c->local_rank;
}
static inline int comm_local_size(const comm_t *c) {
    return c->local_size;
}
static inline device_t comm_device(const comm_t *c) {
    return c->device;
}
const char *comm_backend_name(const comm_t *c);
/* NCCL only: later operations are queued on this cudaStream_t (NULL: the
 * default stream) and complete asynchronously, except the count exchange
 * and the barrier, which wait for the stream. Ignored by host backends. */
void comm_set_stream(comm_t *c, void *stream);

/* Variable all-to-all: rank r sends send_counts[p] elements starting at
 * element send_displs[p] of sendbuf to rank p, which stores them at element
 * recv_displs[r] of its recvbuf; recv_counts[p] must equal what p sends to
 * r. The regions of recvbuf must not overlap each other or sendbuf. */
int comm_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                   const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                   const int64_t *recv_displs, dtype_t dt);
/* recv_counts[p] = the send_counts[r] that rank p passed (an all-to-all of
 * one int64 per peer), so that a comm_alltoallv can follow. Both (N), host. */
int comm_exchange_counts(comm_t *c, const int64_t *send_counts, int64_t *recv_counts);
/* recvbuf = elementwise sum over ranks of sendbuf; sendbuf == recvbuf is
 * in place. dt: DT_F32, DT_F64, DT_I32 or DT_I64. Float sums are not
 * reproducible across backends or rank counts (reduction order differs). */
int comm_allreduce_sum(comm_t *c, const void *sendbuf, void *recvbuf, size_t n, dtype_t dt);
/* Copies root's buf to every rank's buf. */
int comm_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root);
/* Every rank receives rank p's send_count elements at recv_displs[p] of its
 * recvbuf; recv_counts[r] must equal this rank's send_count. */
int comm_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                    const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt);
/* As comm_allgatherv, but only root receives; recvbuf, recv_counts and
 * recv_displs are read only on root (NULL elsewhere is fine). */
int comm_gatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                 const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt, int root);
int comm_barrier(comm_t *c);

/* displs[p] = counts[0] + ... + counts[p-1]; returns the total, or -1 when
 * a count is negative or the total overflows int64. */
int64_t comm_displs_from_counts(int64_t *displs, const int64_t *counts, int n);

const comm_stats_t *comm_stats(const comm_t *c, comm_op_t op);
void comm_stats_reset(comm_t *c);
/* "alltoallv", "counts", "allreduce", "bcast", "allgatherv", "gatherv",
 * "barrier". */
const char *comm_op_name(comm_op_t op);

#ifdef MOERL_HAVE_NCCL
/* An NCCL communicator with bootstrap's ranks, on CUDA device `device`
 * (-1: local_rank modulo the number of visible devices). The ncclUniqueId is
 * created on rank 0 and broadcast over bootstrap (a host communicator: MPI,
 * or single for one rank). Takes ownership of *bootstrap (set to NULL, also
 * on failure); comm_destroy releases it after the NCCL communicator. */
int comm_nccl_new(comm_t **out, comm_t **bootstrap, int device);
#endif

#ifdef __cplusplus
}
#endif
#endif
