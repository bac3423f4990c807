/* cuda_common: what the CUDA backend's .cu files share (included by them only,
 * so it may use CUDA types): error capture, the calling thread's stream,
 * cuBLAS handle and scratch, launch sizes, warp/block reductions, dtype
 * conversions, and the kernel-table functions each .cu file defines.
 *
 * Errors: kernel-table functions return void, so a failed CUDA or cuBLAS call
 * is recorded in the backend (the first one since the last synchronize wins)
 * and synchronize() returns it. Bad inputs found on the device (a negative
 * token id, a target outside the vocabulary) set a device error flag that
 * synchronize() turns into a status as well.
 */
#ifndef MOERL_CORE_CUDA_COMMON_H
#define MOERL_CORE_CUDA_COMMON_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "core/kernels.h"
#include "core/status.h"

/* ---- error capture ---- */

/* Records a CUDA or cuBLAS failure as the backend's pending error (if none is
 * pending) and also sets the calling thread's message; returns MO_EDEVICE. The
 * message names the function called (text of `call` up to its '('), the error
 * and file:line. */
int cuda_fail(cudaError_t e, const char *call, const char *file, int line);
int cublas_fail(cublasStatus_t s, const char *call, const char *file, int line);
/* Records a pending error with a printf-style message; returns code. */
int cuda_record(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* For void functions: record and return. */
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t cuda_e_ = (call);                                                              \
        if (cuda_e_ != cudaSuccess) {                                                              \
            cuda_fail(cuda_e_, #call, __FILE__, __LINE__);                                         \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define CUBLAS_CHECK(call)                                                                         \
    do {                                                                                           \
        cublasStatus_t cublas_s_ = (call);                                                         \
        if (cublas_s_ != CUBLAS_STATUS_SUCCESS) {                                                  \
            cublas_fail(cublas_s_, #call, __FILE__, __LINE__);                                     \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* After a kernel launch: a bad configuration shows here, not at the launch. */
static inline int cuda_launched(const char *what, const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? MO_OK : cuda_fail(e, what, file, line);
}
#define LAUNCH_CHECK(kernel_name)                                                                  \
    do {                                                                                           \
        if (cuda_launched("launch of " kernel_name, __FILE__, __LINE__) < 0)                       \
            return;                                                                                \
    } while (0)
/* The same as an expression, for functions that return a status. */
#define LAUNCH_OK(kernel_name)                                                                     \
    (cuda_launched("launch of " kernel_name, __FILE__, __LINE__) == MO_OK)

/* Codes kernels write into the device error flag (first nonzero stays until
 * synchronize reads it); see cuda_flag_message. */
enum {
    CUDA_FLAG_NONE = 0,
    CUDA_FLAG_EMBEDDING_ID = 1,   /* embedding: a token id < 0 */
    CUDA_FLAG_LOGPROB_TARGET = 2, /* logprob: a target outside [0, V) */
    CUDA_FLAG_CU_SEQLENS = 3,     /* attention: cu_seqlens decreases */
    CUDA_FLAG_TOPK_INDEX = 4,     /* topk_backward: an index outside [0, C) */
    CUDA_FLAG_MOE_EXPERT = 5,     /* moe dispatch plan: an expert index outside [0, E) */
};

/* Sets the flag from a kernel (a plain store: any one of several concurrent
 * codes is reported). */
__device__ __forceinline__ void cuda_flag_set(int *flag, int code) {
    *(volatile int *)flag = code;
}

/* ---- the calling thread's device context ---- */

/* Makes the backend's device current on this thread (once per thread);
 * returns 0, or records the failure and returns it. Every entry point calls it. */
int cuda_enter(void);
/* The thread's current stream (set by backend set_stream; 0 = default). */
cudaStream_t cuda_stream(void);
/* The device pointer of the error flag. */
int *cuda_flag(void);
/* Multiprocessor count and the opt-in shared memory limit per block. */
int cuda_sm_count(void);
size_t cuda_smem_optin(void);

/* The thread's cuBLAS handle bound to its current stream with the workspace of
 * that stream; NULL after recording an error. */
cublasHandle_t cuda_blas(void);

/* Scratch slots: per (thread, stream), grow-only, contents undefined between
 * calls. Work queued on the stream that used the old buffer finishes before a
 * slot grows. NULL after recording an error. */
enum {
    CUDA_SCRATCH_ACT = 0,    /* activations converted for a matrix product */
    CUDA_SCRATCH_GRAD = 1,   /* output gradients converted for a matrix product */
    CUDA_SCRATCH_TILE = 2,   /* dequantised weight rows */
    CUDA_SCRATCH_ATT = 3,    /* attention tile prefix */
    CUDA_SCRATCH_SAMPLE = 4, /* the sampler's weights exp(z - max z) */
    CUDA_SCRATCH_SLOTS = 5
};
void *cuda_scratch(int slot, size_t bytes);

/* Device memory from the backend's caching pool (reused by size class; given
 * back to CUDA only when cudaMalloc runs out). On failure *out is NULL and the
 * status (MO_ENOMEM, MO_EDEVICE) is returned with a message, not recorded. */
int cuda_pool_alloc(void **out, size_t bytes);
void cuda_pool_free(void *p);

/* ---- launch sizes ---- */

/* Blocks for a grid-stride loop over n items with `threads` per block. */
static inline unsigned cuda_grid(size_t n, int threads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    size_t cap = (size_t)cuda_sm_count() * 32;
    if (b > cap)
        b = cap;
    return b ? (unsigned)b : 1u;
}

/* ---- reductions (blockDim.x a multiple of 32, at most 1024) ---- */

#define FULL_MASK 0xffffffffu

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

/* The sum over the block, returned to every thread; sh holds 32 T. The same
 * order on every run (deterministic). */
template <typename T> __device__ T block_sum(T v, T *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads(); /* sh may still be read by a previous reduction */
    if (lane == 0)
        sh[w] = v;
    __syncthreads();
    T r = lane < nw ? sh[lane] : T(0);
    return warp_sum(r);
}

__device__ inline float block_max(float v, float *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0)
        sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(r);
}

/* ---- dtype conversions (bit-exact with the CPU's, core/cpu/matmul.c) ---- */

__device__ __forceinline__ float bf16_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ float f16_f32(uint16_t h) {
    uint32_t u = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t e = u & 0x0f800000u;
    uint32_t special = 0u - (uint32_t)(e == 0x0f800000u);
    uint32_t sub = 0u - (uint32_t)(e == 0);
    u += (uint32_t)(127 - 15) << 23;
    u += special & ((uint32_t)(128 - 16) << 23);
    u += sub & (1u << 23);
    float f = __uint_as_float(u) - __uint_as_float(sub & (113u << 23));
    return __uint_as_float(__float_as_uint(f) | ((uint32_t)(h & 0x8000u) << 16));
}

__device__ __forceinline__ float fp8_f32(uint8_t b) {
    uint32_t m = b & 0x7fu;
    uint32_t sub = 0u - (uint32_t)((m & 0x78u) == 0);
    uint32_t nan = 0u - (uint32_t)(m == 0x7fu);
    uint32_t u = (m << 20) + ((uint32_t)(127 - 7) << 23) + (sub & (1u << 23));
    float f = __uint_as_float(u) - __uint_as_float(sub & (121u << 23));
    u = (__float_as_uint(f) & ~nan) | (nan & 0x7fc00000u);
    return __uint_as_float(u | ((uint32_t)(b & 0x80u) << 24));
}

/* Element i of a float weight array of dtype dt, in f32. */
__device__ __forceinline__ float wload(const void *data, dtype_t dt, size_t i) {
    switch (dt) {
    case DT_BF16: return bf16_f32(((const uint16_t *)data)[i]);
    case DT_F16: return f16_f32(((const uint16_t *)data)[i]);
    case DT_F8E4M3: return fp8_f32(((const uint8_t *)data)[i]);
    default: return ((const float *)data)[i];
    }
}

/* Element (r, c) of a weight view (rows, cols) in f32, block scale applied as
 * the CPU applies it (a separate f32 multiply). */
__device__ __forceinline__ float wview_at(const void *data, dtype_t dt, const float *scale,
                                          int block, size_t r, size_t c, size_t cols) {
    float x = wload(data, dt, r * cols + c);
    if (scale) {
        size_t nbc = (cols + (size_t)block - 1) / (size_t)block;
        x *= scale[(r / (size_t)block) * nbc + c / (size_t)block];
    }
    return x;
}

/* True for the dtypes a weight view may hold. */
static inline int cuda_wdtype_ok(dtype_t dt) {
    return dt == DT_F32 || dt == DT_BF16 || dt == DT_F16 || dt == DT_F8E4M3;
}

/* ---- the kernel table (shapes and conventions in core/kernels.h) ---- */

extern "C" {
void cuda_matmul_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                         int C, int OC);
void cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp,
                          const wview_t *w, int T, int C, int OC);
void cuda_embedding_forward(float *out, const int32_t *ids, const wview_t *wte, int T, int D);
void cuda_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T, int D);
void cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int D,
                          float eps);
void cuda_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x, const float *w,
                           const float *rstd, int N, int D);
void cuda_rope_forward(float *out, const float *x, const int32_t *pos, const float *inv_freq,
                       float mscale, int N, int H, int Dh, int rot);
void cuda_rope_backward(float *dx, const float *dout, const int32_t *pos, const float *inv_freq,
                        float mscale, int N, int H, int Dh, int rot);
void cuda_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                            const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                            int window);
void cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                             const float *k, const float *v, const float *out, const float *lse,
                             const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                             int window);
void cuda_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                          const float *up, size_t n);
void cuda_softmax_forward(float *out, const float *x, int N, int C);
void cuda_softmax_backward(float *dx, const float *dout, const float *out, int N, int C);
void cuda_topk_forward(int32_t *idx, float *val, const float *x, int N, int C, int K);
void cuda_topk_backward(float *dx, const float *dval, const int32_t *idx, int N, int C, int K);
void cuda_logprob_forward(float *logp, float *entropy, float *lse, const float *logits,
                          const int32_t *targets, int N, int V, float temperature);
void cuda_logprob_backward(float *dlogits, const float *dlogp, const float *dentropy,
                           const float *logits, const float *lse, const int32_t *targets, int N,
                           int V, float temperature);
void cuda_adamw_update(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int step);
}

#endif
