/* comm_single: the one-rank backend; every operation is a copy in host
 * memory (arguments were checked by the comm front end). */
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"

/* Copies count elements between block offsets (regions may overlap). */
static void copy_block(void *dst, int64_t dst_displ, const void *src, int64_t src_displ,
                       int64_t count, size_t es) {
    if (count > 0)
        memmove((char *)dst + (size_t)dst_displ * es, (const char *)src + (size_t)src_displ * es,
                (size_t)count * es);
}

static int single_alltoallv(comm_t *c, const void *sendbuf, const int64_t *send_counts,
                            const int64_t *send_displs, void *recvbuf, const int64_t *recv_counts,
                            const int64_t *recv_displs, dtype_t dt) {
    (void)c;
    (void)recv_counts; /* equals send_counts[0], checked by the front end */
    copy_block(recvbuf, recv_displs[0], sendbuf, send_displs[0], send_counts[0], dtype_size(dt));
    return MO_OK;
}

static int single_exchange_counts(comm_t *c, const int64_t *send_counts, int64_t *recv_counts) {
    (void)c;
    recv_counts[0] = send_counts[0];
    return MO_OK;
}

static int single_allreduce_sum(comm_t *c, const void *sendbuf, void *recvbuf, size_t n,
                                dtype_t dt) {
    (void)c;
    if (n > 0 && sendbuf != recvbuf)
        memcpy(recvbuf, sendbuf, n * dtype_size(dt));
    return MO_OK;
}

static int single_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root) {
    (void)c, (void)buf, (void)n, (void)dt, (void)root; /* root's buffer is every rank's */
    return MO_OK;
}

static int single_allgatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                             const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt) {
    (void)c, (void)recv_counts;
    copy_block(recvbuf, recv_displs[0], sendbuf, 0, send_count, dtype_size(dt));
    return MO_OK;
}

static int single_gatherv(comm_t *c, const void *sendbuf, int64_t send_count, void *recvbuf,
                          const int64_t *recv_counts, const int64_t *recv_displs, dtype_t dt,
                          int root) {
    (void)root;
    return single_allgatherv(c, sendbuf, send_count, recvbuf, recv_counts, recv_displs, dt);
}

static int single_barrier(comm_t *c) {
    (void)c;
    return MO_OK;
}

static int single_destroy(comm_t *c) {
    free(c);
    return MO_OK;
}

static const comm_ops_t g_single_ops = {
    .name = "single",
    .alltoallv = single_alltoallv,
    .exchange_counts = single_exchange_counts,
    .allreduce_sum = single_allreduce_sum,
    .bcast = single_bcast,
    .allgatherv = single_allgatherv,
    .gatherv = single_gatherv,
    .barrier = single_barrier,
    .destroy = single_destroy,
};

int comm_single_new(comm_t **out) {
    if (!out)
        return mo_errorf(MO_EINVAL, "comm_single_new: out is NULL");
    comm_t *c = calloc(1, sizeof *c);
    if (!c) {
        *out = NULL;
        return mo_errorf(MO_ENOMEM, "comm_single_new: out of memory");
    }
    c->ops = &g_single_ops;
    c->rank = 0;
    c->size = 1;
    c->local_rank = 0;
    c->local_size = 1;
    c->device = DEV_CPU;
    *out = c;
    return MO_OK;
}
