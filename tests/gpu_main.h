/* gpu_main: how a GPU suite starts: skipped (exit 77) without a device or without the CUDA
 * backend in the build, failed (1) when the backend does not start. */
#ifndef MOERL_TESTS_GPU_MAIN_H
#define MOERL_TESTS_GPU_MAIN_H

#include <stdio.h>

#include "core/backend.h"
#include "core/status.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>

/* The CUDA backend; NULL after printing why the suite cannot run, with *rc its exit
 * status: 77 (skipped) without a device, 1 when the backend does not start. */
static inline const backend_t *gpu_suite_backend(const char *name, int *rc) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("%s: no CUDA device (%s), skipped\n", name,
               e != cudaSuccess ? cudaGetErrorString(e) : "none present");
        *rc = 77;
        return NULL;
    }
    const backend_t *be = backend_get(DEV_CUDA);
    if (!be) {
        fprintf(stderr, "%s: %s\n", name, mo_last_error());
        *rc = 1;
    }
    return be;
}
#else
/* Says the build has no CUDA backend; the suite's exit status (77, skipped). */
static inline int gpu_suite_absent(const char *name) {
    printf("%s: this build has no CUDA backend (configure with -DMOERL_CUDA=ON on a machine "
           "with the CUDA Toolkit), skipped\n",
           name);
    return 77;
}
#endif

#endif
