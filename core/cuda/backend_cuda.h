/* backend_cuda: the CUDA backend's own controls beside core/backend.h: which
 * device it uses, what its memory pool holds, and facts about the device. */
#ifndef MOERL_CORE_CUDA_BACKEND_CUDA_H
#define MOERL_CORE_CUDA_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Chooses the device ordinal the backend binds to (default 0). Call before the
 * first backend_cuda() / backend_get(DEV_CUDA); MO_ESTATE once the backend is
 * bound to another device, MO_EINVAL for a negative ordinal. */
int backend_cuda_select_device(int ordinal);

/* The pool behind alloc/free and the kernels' scratch. Freed blocks stay in
 * the pool and serve later requests of the same size class, so a step loop
 * that repeats its allocations calls cudaMalloc only in its first step. */
typedef struct cuda_pool_stats {
    size_t reserved;        /* bytes obtained from cudaMalloc and held */
    size_t in_use;          /* bytes handed out and not yet freed */
    uint64_t device_allocs; /* cudaMalloc calls made by the pool */
    uint64_t allocs;        /* requests served (from the pool or cudaMalloc) */
} cuda_pool_stats_t;

void backend_cuda_pool_stats(cuda_pool_stats_t *s);

typedef struct cuda_device_info {
    int ordinal;
    char name[256];
    int cc_major, cc_minor; /* compute capability */
    int sm_count;
    size_t total_mem;  /* bytes of device memory */
    size_t l2_bytes;   /* L2 cache size */
    size_t smem_optin; /* shared memory a block may opt in to */
} cuda_device_info_t;

/* Facts about the bound device; fails (MO_EDEVICE, with a message) when the
 * backend has no device. */
int backend_cuda_device_info(cuda_device_info_t *info);
/* The stream the backend queues the calling thread's work on (a cudaStream_t; NULL is the
 * default stream): what set_stream last set on this thread. Other libraries' work that
 * must be ordered with the backend's (NCCL through comm_set_stream) goes there. */
void *backend_cuda_stream(void);

#ifdef __cplusplus
}
#endif
#endif
