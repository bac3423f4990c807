/* backend: a device's memory operations and kernel table; ops dispatch
 * through the backend of the device that holds their tensors. */
#ifndef MOERL_CORE_BACKEND_H
#define MOERL_CORE_BACKEND_H

#include <stddef.h>

#include "core/kernels.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct backend backend_t;

struct backend {
    device_t device;
    const char *name;
    const kernels_t *k;
    int (*alloc)(const backend_t *be, void **ptr, size_t bytes);
    void (*free)(const backend_t *be, void *ptr);
    /* Copies between this device and host or within this device. */
    int (*copy)(const backend_t *be, void *dst, device_t dst_dev, const void *src,
                device_t src_dev, size_t bytes);
    int (*memset_zero)(const backend_t *be, void *ptr, size_t bytes);
    /* Waits for queued work; returns the first error since the last call. */
    int (*synchronize)(const backend_t *be);
    /* Sets the stream for this thread's later ops (NULL: the default stream);
     * a no-op on the CPU. */
    void (*set_stream)(const backend_t *be, void *stream);
};

/* The backend for a device, or NULL (with an error message) when this build
 * or machine has none (no CUDA support compiled in, or no GPU present). */
const backend_t *backend_get(device_t dev);
const backend_t *backend_cpu(void);

/* Sets the threads the CPU backend uses (OpenMP and the BLAS pool);
 * n <= 0 means one per core. n == 1 gives the bit-reproducible mode. */
void backend_cpu_set_threads(int n);
int backend_cpu_threads(void);

#ifdef MOERL_HAVE_CUDA
/* Provided by core/cuda when compiled in; NULL if no device is present. */
const backend_t *backend_cuda(void);
#endif

#ifdef __cplusplus
}
#endif
#endif
