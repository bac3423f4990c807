/* comm_nccl: the NCCL backend of the comm layer, on device buffers. Variable
 * exchanges are grouped ncclSend/ncclRecv per peer, the rank's own block a
 * device-to-device copy; the ncclUniqueId travels over a host bootstrap
 * communicator. Arguments were checked by the comm front end. */
#ifdef MOERL_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"

typedef struct {
    ncclComm_t nc;
    comm_t *boot;      /* the host communicator the id travelled over (owned) */
    int dev;           /* CUDA device ordinal, -1 before it is chosen */
    int64_t *d_counts; /* (2, N) device scratch: counts sent, counts received */
    float *d_zero;     /* (2) device scratch for the barrier: zero in, sum out */
} nccl_impl_t;

/* Messages name the function called (the text up to its '('), the error and
 * where it was called from. */
static int cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
    return mo_errorf(MO_EDEVICE, "%.*s failed: %s (%s) at %s:%d", (int)strcspn(call, "("), call,
                     cudaGetErrorString(e), cudaGetErrorName(e), file, line);
}

static int nccl_fail(ncclResult_t r, const char *call, const char *file, int line) {
    const char *last = ncclGetLastError(NULL);
    int more = last && last[0];
    return mo_errorf(MO_EDEVICE, "%.*s failed: %s%s%s at %s:%d", (int)strcspn(call, "("), call,
                     ncclGetErrorString(r), more ? ": " : "", more ? last : "", file, line);
}

#define CUDA_TRY(call)                                                                             \
    do {                                                                                           \
        cudaError_t cuda_e_ = (call);                                                              \
        if (cuda_e_ != cudaSuccess)                                                                \
            return cuda_fail(cuda_e_, #call, __FILE__, __LINE__);                                  \
    } while (0)

#define NCCL_TRY(call)                                                                             \
    do {                                                                                           \
        ncclResult_t nccl_r_ = (call);                                                             \
        if (nccl_r_ != ncclSuccess)                                                                \
            return nccl_fail(nccl_r_, #call, __FILE__, __LINE__);                                  \
    } while (0)

static nccl_impl_t *impl(const comm_t *c) {
    return (nccl_impl_t *)c->impl;
}
static cudaStream_t stream(const comm_t *c) {
    return (cudaStream_t)c->stream;
}
static char *at(void *buf, int64_t displ, size_t es) {
    return (char *)buf + (size_t)displ * es;
}
static const char *cat(const void *buf, int64_t displ, size_t es) {
    return (const char *)buf + (size_t)displ * es;
}

/* Every operation runs on the communicator's device, whatever is current. */
static int enter(const comm_t *c) {
    CUDA_TRY(cudaSetDevice(impl(c)->dev));
    return MO_OK;
}

/* Closes a group opened with ncclGroupStart whatever happened inside it;
 * returns the error from posting, else the one from ncclGroupEnd. */
static int end_group(int posted) {
    ncclResult_t r = ncclGroupEnd();
    if (posted < 0)
        return posted;
    if (r != ncclSuccess)
        return nccl_fail(r, "ncclGroupEnd", __FILE__, __LINE__);
    return MO_OK;
}

static int copy_self(const comm_t *c, void *dst, const void *src, int64_t count, size_t es) {
    if (count > 0)
        CUDA_TRY(
            cudaMemcpyAsync(dst, src, (size_t)count * es, cudaMemcpyDeviceToDevice, stream(c)));
    return MO_OK;
}

static int send_bytes(const comm_t *c, const void *buf, int64_t count, size_t es, int peer) {
    if (count > 0)
        NCCL_TRY(ncclSend(buf, (size_t)count * es, ncclUint8, peer, impl(c)->nc, stream(c)));
    return MO_OK;
}

static int recv_bytes(const comm_t *c, void *buf, int64_t count, size_t es, int peer) {
    if (count > 0)
        NCCL_TRY(ncclRecv(buf, (size_t)count * es, ncclUint8, peer, impl(c)->nc, stream(c)));
    return MO_OK;
}

static int post_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                          const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                          const int64_t *recv_displs, size_t es) {
    for (int p = 0; p < c->size; p++) {
        if (p == c->rank)
            continue;
        TRY(send_bytes(c, cat(sendbuf, send_displs[p], es), send_counts[p], es, p));
        TRY(recv_bytes(c, at(recvbuf, recv_displs[p], es), recv_counts[p], es, p));
    }
    return MO_OK;
}

static int nccl_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                          const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                          const int64_t *recv_displs, dtype_t dt) {
    size_t es = dtype_size(dt);
    int r = c->rank;
    TRY(enter(c));
    TRY(copy_self(c, at(recvbuf, recv_displs[r], es), cat(sendbuf, send_displs[r], es),
                  send_counts[r], es));
    NCCL_TRY(ncclGroupStart());
    return end_group(post_alltoallv(c, sendbuf, send_counts, send_displs, recvbuf, recv_counts,
                                    recv_displs, es));
}

static int post_counts(comm_t *c, const int64_t *d_send, int64_t *d_recv) {
    nccl_impl_t *m = impl(c);
    for (int p = 0; p < c->size; p++) {
        if (p == c->rank)
            continue;
        NCCL_TRY(ncclSend(d_send + p, 1, ncclInt64, p, m->nc, stream(c)));
        NCCL_TRY(ncclRecv(d_recv + p, 1, ncclInt64, p, m->nc, stream(c)));
    }
    return MO_OK;
}

/* Host counts in and out, through the device scratch; waits for the stream. */
static int nccl_exchange_counts(comm_t *c, const int64_t *send_counts, int64_t *recv_counts) {
    nccl_impl_t *m = impl(c);
    size_t nb = (size_t)c->size * sizeof(int64_t);
    int64_t *d_send = m->d_counts, *d_recv = m->d_counts + c->size;
    TRY(enter(c));
    CUDA_TRY(cudaMemcpyAsync(d_send, send_counts, nb, cudaMemcpyHostToDevice, stream(c)));
    NCCL_TRY(ncclGroupStart());
    TRY(end_group(post_counts(c, d_send, d_recv)));
    CUDA_TRY(cudaMemcpyAsync(recv_counts, d_recv, nb, cudaMemcpyDeviceToHost, stream(c)));
    CUDA_TRY(cudaStreamSynchronize(stream(c)));
    recv_counts[c->rank] = send_counts[c->rank];
    return MO_OK;
}

static ncclDataType_t nccl_sum_type(dtype_t dt) {
    switch (dt) {
    case DT_F64: return ncclFloat64;
    case DT_I32: return ncclInt32;
    case DT_I64: return ncclInt64;
    default: return ncclFloat32; /* the front end admits only these four */
    }
}

static int nccl_allreduce_sum(comm_t *c, const void *sendbuf, void *recvbuf, size_t n, dtype_t dt) {
    TRY(enter(c));
    NCCL_TRY(
        ncclAllReduce(sendbuf, recvbuf, n, nccl_sum_type(dt), ncclSum, impl(c)->nc, stream(c)));
    return MO_OK;
}

static int nccl_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root) {
    TRY(enter(c));
    NCCL_TRY(ncclBroadcast(buf, buf, n * dtype_size(dt), ncclUint8, root, impl(c)->nc, stream(c)));
    return MO_OK;
}

static int post_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                           const int64_t *recv_counts, const int64_t *recv_displs, size_t es) {
    for (int p = 0; p < c->size; p++) {
        if (p == c->rank)
            continue;
        TRY(send_bytes(c, sendbuf, send_count, es, p));
        TRY(recv_bytes(c, at(recvbuf, recv_displs[p], es), recv_counts[p], es, p));
    }
    return MO_OK;
}

static int nccl_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                           const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt) {
    size_t es = dtype_size(dt);
    TRY(enter(c));
    TRY(copy_self(c, at(recvbuf, recv_displs[c->rank], es), sendbuf, send_count, es));
    NCCL_TRY(ncclGroupStart());
    return end_group(
        post_allgatherv(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, es));
}

static int post_gatherv(comm_t *c, void *recvbuf, const int64_t *recv_counts,
                        const int64_t *recv_displs, size_t es) {
    for (int p = 0; p < c->size; p++)
        if (p != c->rank)
            TRY(recv_bytes(c, at(recvbuf, recv_displs[p], es), recv_counts[p], es, p));
    return MO_OK;
}

static int nccl_gatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                        const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt,
                        int root) {
    size_t es = dtype_size(dt);
    TRY(enter(c));
    if (c->rank != root)
        return send_bytes(c, sendbuf, send_count, es, root);
    TRY(copy_self(c, at(recvbuf, recv_displs[root], es), sendbuf, send_count, es));
    NCCL_TRY(ncclGroupStart());
    return end_group(post_gatherv(c, recvbuf, recv_counts, recv_displs, es));
}

/* A one-element all-reduce that the host waits for. */
static int nccl_barrier(comm_t *c) {
    nccl_impl_t *m = impl(c);
    TRY(enter(c));
    NCCL_TRY(ncclAllReduce(m->d_zero, m->d_zero + 1, 1, ncclFloat32, ncclSum, m->nc, stream(c)));
    CUDA_TRY(cudaStreamSynchronize(stream(c)));
    ncclResult_t async = ncclSuccess;
    NCCL_TRY(ncclCommGetAsyncError(m->nc, &async));
    if (async != ncclSuccess)
        return nccl_fail(async, "ncclCommGetAsyncError", __FILE__, __LINE__);
    return MO_OK;
}

/* Records the first failure only, so its message survives the cleanup. */
#define KEEP_CUDA(rc, call)                                                                        \
    do {                                                                                           \
        cudaError_t cuda_e_ = (call);                                                              \
        if (cuda_e_ != cudaSuccess && (rc) == MO_OK)                                               \
            (rc) = cuda_fail(cuda_e_, #call, __FILE__, __LINE__);                                  \
    } while (0)

#define KEEP_NCCL(rc, call)                                                                        \
    do {                                                                                           \
        ncclResult_t nccl_r_ = (call);                                                             \
        if (nccl_r_ != ncclSuccess && (rc) == MO_OK)                                               \
            (rc) = nccl_fail(nccl_r_, #call, __FILE__, __LINE__);                                  \
    } while (0)

/* Releases whatever was set up; a communicator with a pending asynchronous
 * error is aborted rather than finalised (finalising could wait forever). */
static int nccl_release(nccl_impl_t *m) {
    int rc = MO_OK;
    if (m->dev >= 0)
        KEEP_CUDA(rc, cudaSetDevice(m->dev));
    if (m->nc) {
        ncclResult_t async = ncclSuccess;
        KEEP_NCCL(rc, ncclCommGetAsyncError(m->nc, &async));
        if (async != ncclSuccess || rc < 0) {
            KEEP_NCCL(rc, ncclCommAbort(m->nc));
        } else {
            KEEP_NCCL(rc, ncclCommFinalize(m->nc));
            KEEP_NCCL(rc, ncclCommDestroy(m->nc));
        }
    }
    if (m->d_counts)
        KEEP_CUDA(rc, cudaFree(m->d_counts));
    if (m->d_zero)
        KEEP_CUDA(rc, cudaFree(m->d_zero));
    int brc = comm_destroy(&m->boot);
    free(m);
    return rc < 0 ? rc : brc;
}

static int nccl_destroy(comm_t *c) {
    int rc = nccl_release(impl(c));
    free(c);
    return rc;
}

static const comm_ops_t g_nccl_ops = {
    "nccl",          nccl_alltoallv, nccl_exchange_counts, nccl_allreduce_sum, nccl_bcast,
    nccl_allgatherv, nccl_gatherv,   nccl_barrier,         nccl_destroy,
};

/* Chooses and sets this rank's device (local to this process). */
static int pick_device(nccl_impl_t *m, int device) {
    int ndev = 0;
    CUDA_TRY(cudaGetDeviceCount(&ndev));
    if (ndev <= 0)
        return mo_errorf(MO_EDEVICE, "no CUDA device is visible");
    if (device >= ndev)
        return mo_errorf(MO_EINVAL, "device %d requested, %d visible", device, ndev);
    if (device < 0 && comm_local_size(m->boot) > ndev)
        return mo_errorf(MO_EDEVICE,
                         "%d ranks on this host share %d visible CUDA device(s): NCCL needs "
                         "one device per rank",
                         comm_local_size(m->boot), ndev);
    m->dev = device >= 0 ? device : comm_local_rank(m->boot) % ndev;
    CUDA_TRY(cudaSetDevice(m->dev));
    return MO_OK;
}

/* Rank 0's unique id, and whether rank 0 could create one. */
typedef struct {
    int32_t ok;
    ncclUniqueId id;
} id_msg_t;

static int share_id(comm_t *boot, ncclUniqueId *id) {
    id_msg_t msg;
    memset(&msg, 0, sizeof msg);
    int rc = MO_OK;
    if (comm_rank(boot) == 0) {
        KEEP_NCCL(rc, ncclGetUniqueId(&msg.id));
        msg.ok = rc == MO_OK;
    }
    TRY(comm_bcast(boot, &msg, sizeof msg, DT_U8, 0));
    if (rc < 0)
        return rc;
    if (!msg.ok)
        return mo_errorf(MO_EDEVICE, "rank 0 could not create the NCCL unique id");
    *id = msg.id;
    return MO_OK;
}

/* Every rank picks its device, then all learn whether every rank could, so
 * that one rank's failure does not leave the others waiting for it. */
static int nccl_setup(nccl_impl_t *m, int device) {
    comm_t *b = m->boot;
    int local = pick_device(m, device);
    int64_t failed = local < 0;
    TRY(comm_allreduce_sum(b, &failed, &failed, 1, DT_I64));
    if (local < 0)
        return local;
    if (failed)
        return mo_errorf(MO_EDEVICE, "%lld of %d ranks could not select a CUDA device",
                         (long long)failed, comm_size(b));
    ncclUniqueId id;
    TRY(share_id(b, &id));
    NCCL_TRY(ncclCommInitRank(&m->nc, comm_size(b), id, comm_rank(b)));
    size_t nb = 2 * (size_t)comm_size(b) * sizeof(int64_t);
    CUDA_TRY(cudaMalloc((void **)&m->d_counts, nb));
    CUDA_TRY(cudaMemset(m->d_counts, 0, nb));
    CUDA_TRY(cudaMalloc((void **)&m->d_zero, 2 * sizeof(float)));
    CUDA_TRY(cudaMemset(m->d_zero, 0, 2 * sizeof(float)));
    return MO_OK;
}

int comm_nccl_new(comm_t **out, comm_t **bootstrap, int device) {
    comm_t *boot = bootstrap ? *bootstrap : NULL;
    if (bootstrap)
        *bootstrap = NULL;
    if (out)
        *out = NULL;
    if (!out || !boot) {
        comm_destroy(&boot);
        return mo_errorf(MO_EINVAL, "comm_nccl_new: out or bootstrap communicator is NULL");
    }
    if (comm_device(boot) != DEV_CPU) {
        const char *name = comm_backend_name(boot);
        comm_destroy(&boot);
        return mo_errorf(MO_EINVAL,
                         "comm_nccl_new: the bootstrap must be a host communicator "
                         "(single or mpi), got '%s'",
                         name);
    }
    comm_t *c = (comm_t *)calloc(1, sizeof *c);
    nccl_impl_t *m = (nccl_impl_t *)calloc(1, sizeof *m);
    if (!c || !m) {
        free(c);
        free(m);
        comm_destroy(&boot);
        return mo_errorf(MO_ENOMEM, "comm_nccl_new: out of memory");
    }
    m->boot = boot;
    m->dev = -1;
    int rc = nccl_setup(m, device);
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", mo_last_error());
        nccl_release(m);
        free(c);
        return mo_errorf(rc, "comm_nccl_new: %s", msg);
    }
    c->ops = &g_nccl_ops;
    c->rank = comm_rank(boot);
    c->size = comm_size(boot);
    c->local_rank = comm_local_rank(boot);
    c->local_size = comm_local_size(boot);
    c->device = DEV_CUDA;
    c->stream = NULL;
    c->impl = m;
    *out = c;
    return MO_OK;
}

#endif /* MOERL_HAVE_NCCL */
