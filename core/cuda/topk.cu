/* topk: the K largest entries of each row on CUDA, in descending order, ties
 * to the lower index, NaN after every number (the CPU's total order). One
 * block per row makes K passes; pass k picks the first element in that order
 * among those after pass k-1's pick, so no state is kept but the last pick
 * and the result is exact. */
#include "core/cuda/cuda_common.h"

#define TOPK_THREADS 128
#define TOPK_WARPS (TOPK_THREADS / 32)

/* (va, ia) comes before (vb, ib). */
static __device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    bool na = isnan(va), nb = isnan(vb);
    if (na || nb)
        return na != nb ? nb : ia < ib;
    return va > vb || (va == vb && ia < ib);
}

/* Keeps in (v, i) the earlier of itself and (ov, oi); an index < 0 is no
 * candidate. */
static __device__ __forceinline__ void keep_first(float &v, int &i, float ov, int oi) {
    if (oi >= 0 && (i < 0 || before(ov, oi, v, i))) {
        v = ov;
        i = oi;
    }
}

static __global__ void topk_forward_kernel(int32_t *idx, float *val, const float *x, int C, int K) {
    __shared__ float sv[TOPK_WARPS];
    __shared__ int si[TOPK_WARPS];
    __shared__ float pick_v;
    __shared__ int pick_i;
    size_t row = blockIdx.x;
    const float *xr = x + row * (size_t)C; /* (C) */
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float pv = 0.0f;
    int pi = -1; /* the previous pick; none before the first pass */
    for (int k = 0; k < K; k++) {
        float bv = 0.0f;
        int bi = -1;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float xv = xr[c];
            if (pi < 0 || before(pv, pi, xv, c))
                keep_first(bv, bi, xv, c);
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            keep_first(bv, bi, ov, oi);
        }
        if (lane == 0) {
            sv[w] = bv;
            si[w] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = sv[0];
            int i = si[0];
            for (int j = 1; j < TOPK_WARPS; j++)
                keep_first(v, i, sv[j], si[j]);
            pick_v = v;
            pick_i = i;
            idx[row * (size_t)K + k] = i;
            val[row * (size_t)K + k] = v;
        }
        __syncthreads();
        pv = pick_v;
        pi = pick_i;
    }
}

/* dx (N, C) += dval (N, K) scattered by idx; one thread per row, in order. */
static __global__ void topk_backward_kernel(float *dx, const float *dval, const int32_t *idx, int N,
                                            int C, int K, int *flag) {
    for (size_t n = blockIdx.x * (size_t)blockDim.x + threadIdx.x; n < (size_t)N;
         n += (size_t)gridDim.x * blockDim.x) {
        for (int j = 0; j < K; j++) {
            int32_t c = idx[n * (size_t)K + j];
            if (c < 0 || c >= C) {
                cuda_flag_set(flag, CUDA_FLAG_TOPK_INDEX);
                continue;
            }
            dx[n * (size_t)C + (size_t)c] += dval[n * (size_t)K + j];
        }
    }
}

extern "C" void cuda_topk_forward(int32_t *idx, float *val, const float *x, int N, int C, int K) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || C <= 0 || K < 1 || K > C) {
        cuda_record(MO_EINVAL, "topk_forward: bad shape N=%d C=%d K=%d (need 1 <= K <= C)", N, C,
                    K);
        return;
    }
    if (N == 0)
        return;
    topk_forward_kernel<<<(unsigned)N, TOPK_THREADS, 0, cuda_stream()>>>(idx, val, x, C, K);
    LAUNCH_CHECK("topk_forward_kernel");
}

extern "C" void cuda_topk_backward(float *dx, const float *dval, const int32_t *idx, int N, int C,
                                   int K) {
    if (cuda_enter() < 0)
        return;
    if (N < 0 || C <= 0 || K < 0) {
        cuda_record(MO_EINVAL, "topk_backward: bad shape N=%d C=%d K=%d", N, C, K);
        return;
    }
    if (N == 0 || K == 0 || !dx)
        return;
    topk_backward_kernel<<<cuda_grid((size_t)N, 128), 128, 0, cuda_stream()>>>(dx, dval, idx, N, C,
                                                                               K, cuda_flag());
    LAUNCH_CHECK("topk_backward_kernel");
}
