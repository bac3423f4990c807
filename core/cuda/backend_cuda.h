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

/* A stream of its own for a thread's work (backend set_stream), created after the device
 * has finished all work queued so far, and not synchronising with the default stream:
 * work another thread queues on the default stream is ordered before it only through a
 * wait (the backend's host copies wait for themselves). *out is a cudaStream_t.
 * MO_EDEVICE when CUDA fails. backend_cuda_stream_free waits for it and destroys it
 * (NULL is fine). */
int backend_cuda_stream_new(void **out);
void backend_cuda_stream_free(void *stream);

/* How many blocks the pool has handed out so far. A CUDA graph holds the addresses of
 * the buffers it was captured with: while this count is unchanged, no block was handed
 * out again, so the addresses a graph holds are still those of the buffers it used,
 * provided their owners still hold them. */
uint64_t backend_cuda_memory_epoch(void);

/* CUDA graphs of the calling thread's stream: capture_begin starts recording the
 * thread's stream (in thread-local mode: this thread may then make no call that waits
 * for the device or allocates, which breaks the capture), capture_end stops it and
 * instantiates what was recorded into *out, or with discard 1 throws it away (when the
 * recorded work failed part-way); graph_launch queues it on the thread's stream. The
 * graph replays exactly the recorded kernels with their recorded arguments. Errors a
 * failed capture records are dropped with it (a later synchronize does not report them).
 * MO_EUNSUPPORTED on the default stream (set a stream of its own first); MO_EDEVICE
 * naming the CUDA call when recording or instantiation fails (the stream is then no
 * longer capturing). */
typedef struct cuda_graph cuda_graph_t;
int backend_cuda_capture_begin(void);
int backend_cuda_capture_end(cuda_graph_t **out, int discard);
int backend_cuda_graph_launch(const cuda_graph_t *g);
void backend_cuda_graph_free(cuda_graph_t *g);

#ifdef __cplusplus
}
#endif
#endif
