/* cuda_runtime_api: what the GPU suites ask of the CUDA runtime, for their host builds
 * (tests/host_cuda/host_cuda.c): one device, always present. */
#ifndef MOERL_TESTS_HOST_CUDA_RUNTIME_API_H
#define MOERL_TESTS_HOST_CUDA_RUNTIME_API_H

typedef int cudaError_t;
#define cudaSuccess 0

static inline cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}

static inline const char *cudaGetErrorString(cudaError_t e) {
    (void)e;
    return "host build";
}

#endif
