/* moe_cuda: the mixture-of-experts layer's device building blocks (API and shapes in
 * moe_cuda.h).
 *
 * Dispatch plan: a stable counting sort in three kernels over tiles of PLAN_TILE slots:
 *   count  per tile, a shared-memory histogram of its slots' experts -> hist (tiles, E)
 *   scan   one block: per expert, the exclusive prefix of its counts over the tiles
 *          (hist becomes each tile's base within the expert), then offsets (E + 1)
 *   place  per slot: row = offsets[e] + hist[tile, e] + (earlier slots of the tile with
 *          the same expert), which is exactly the CPU's running cursor.
 * The histogram lives in the thread's CUDA_SCRATCH_ACT slot only for the call.
 *
 * Grouped products: f32 weights run a SIMT kernel, f32 fused multiply-adds in a fixed order
 * (no TF32: they must match the CPU's f32 products to ~1e-6); bf16 weights run a tensor-core
 * kernel (WMMA 16x16x16 bf16 fragments, f32 accumulators) with the activation operand
 * rounded to bf16 as core/cuda/matmul.cu rounds it for cuBLAS. cuBLAS cannot serve this
 * without reading the offsets on the host: its grouped GEMM takes the group sizes in host
 * arrays and its batched GEMMs need equal shapes. Instead the grid has an upper bound of
 * row tiles, ceil(rows / BM) + n (each expert adds at most one partial tile), and each
 * block finds its (expert, row tile) by walking the device offsets; blocks past the last
 * tile exit. Weight gradients run one grid slice per expert (blockIdx.z), reducing over
 * that expert's rows.
 *
 * Tiles: BM x BN = 64 x 64 outputs per block. SIMT: 256 threads, BK = 16 reduction steps
 * staged in shared memory; thread (tx, ty) owns rows ty + 16 i and columns tx + 16 j
 * (i, j < 4), so stores of a warp cover 16 consecutive floats. Tensor cores: 4 warps each
 * own a 32 x 32 quarter (2 x 2 fragments), BK = 32 staged as bf16, the result staged in
 * shared memory for the bounds-checked, coalesced store. All global loads are
 * bounds-checked (zero fill); no alignment of the caller's buffers is assumed. */
#include <cuda_bf16.h>
#include <mma.h>
#include <string.h>

#include <type_traits>

#include "core/cuda/cuda_common.h"
#include "core/cuda/moe_cuda.h"

#define MOE_THREADS 256
#define PLAN_TILE 256 /* slots per block of the plan kernels, = its threads */
#define PLAN_SCAN_THREADS 1024

#define GG_BM 64
#define GG_BN 64
#define GG_BK 16
#define GG_PAD 4
#define GG_THREADS 256
#define TC_BK 32
#define TC_THREADS 128     /* 4 warps, 2 x 2 over the tile */
#define TC_LDA (TC_BK + 8) /* bf16 row stride of a staged (row, q) tile: 80 bytes */
#define TC_LDB (GG_BN + 8) /* bf16 row stride of a staged (q, c) weight tile: 144 bytes */
#define TC_LDC (GG_BN + 4) /* f32 row stride of the staged result */
/* The weight tile: (c, q) rows of TC_LDA, or (q, c) rows of TC_LDB. */
#define TC_BS_ELEMS (GG_BN * TC_LDA > TC_BK * TC_LDB ? GG_BN * TC_LDA : TC_BK * TC_LDB)
#define GG_MAX_GRID_YZ 65535

/* For functions returning a status: record the failed call and return MO_EDEVICE. */
#define MOE_CUDA_TRY(call)                                                                         \
    do {                                                                                           \
        cudaError_t moe_e_ = (call);                                                               \
        if (moe_e_ != cudaSuccess)                                                                 \
            return cuda_fail(moe_e_, #call, __FILE__, __LINE__);                                   \
    } while (0)

#define MOE_LAUNCHED(kernel_name) TRY(cuda_launched("launch of " kernel_name, __FILE__, __LINE__))

static __device__ __forceinline__ int clampi(int v, int lo, int hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

/* Threads per block for a loop over D columns of one row. */
static int row_threads(int D) {
    int t = (D + 31) / 32 * 32;
    return t < MOE_THREADS ? t : MOE_THREADS;
}

/* ---- dispatch plan ---- */

static __global__ void plan_count_kernel(int32_t *hist, const int32_t *idx, int S, int E) {
    extern __shared__ int cnt[]; /* (E) */
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    int s = blockIdx.x * PLAN_TILE + threadIdx.x;
    if (s < S)
        atomicAdd(&cnt[clampi(idx[s], 0, E - 1)], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[(size_t)blockIdx.x * E + e] = cnt[e];
}

/* One block. hist (tiles, E): counts in, each tile's base within its expert out. */
static __global__ void plan_scan_kernel(int32_t *offsets, int32_t *hist, unsigned long long *bad,
                                        int tiles, int E) {
    extern __shared__ int tot[]; /* (E) */
    if (threadIdx.x == 0)
        *bad = ~0ull;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int b = 0; b < tiles; b++) {
            size_t i = (size_t)b * E + e;
            int c = hist[i];
            hist[i] = run;
            run += c;
        }
        tot[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; e++) {
            int c = tot[e];
            tot[e] = acc;
            acc += c;
        }
        offsets[E] = acc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        offsets[e] = tot[e];
}

static __global__ void plan_place_kernel(int32_t *slot_of_row, int32_t *row_of_slot,
                                         unsigned long long *bad, int *flag, const int32_t *idx,
                                         const int32_t *hist, const int32_t *offsets, int S,
                                         int E) {
    __shared__ int sv[PLAN_TILE];
    int s = blockIdx.x * PLAN_TILE + threadIdx.x;
    int v = -1;
    if (s < S) {
        int raw = idx[s];
        v = clampi(raw, 0, E - 1);
        if (v != raw) {
            atomicMin(bad, ((unsigned long long)s << 32) | (unsigned long long)(unsigned)raw);
            if (flag)
                cuda_flag_set(flag, CUDA_FLAG_MOE_EXPERT);
        }
    }
    sv[threadIdx.x] = v;
    __syncthreads();
    if (s < S) {
        int rank = 0;
        for (int j = 0; j < (int)threadIdx.x; j++)
            rank += sv[j] == v;
        int r = offsets[v] + hist[(size_t)blockIdx.x * E + v] + rank;
        slot_of_row[r] = s;
        row_of_slot[s] = r;
    }
}

extern "C" int moe_cuda_plan_alloc(moe_cuda_plan_t *p, int T, int K, int E) {
    memset(p, 0, sizeof *p);
    if (T < 0 || K < 1 || E < 1 || E > MOE_CUDA_MAX_EXPERTS)
        return mo_errorf(MO_EINVAL,
                         "moe_cuda plan: bad shape T = %d, K = %d, E = %d (need T >= 0, K >= 1, "
                         "1 <= E <= %d)",
                         T, K, E, MOE_CUDA_MAX_EXPERTS);
    size_t S = (size_t)T * (size_t)K;
    if (S > INT32_MAX)
        return mo_errorf(MO_EINVAL, "moe_cuda plan: %zu token slots exceed the int32 plan", S);
    size_t bytes = sizeof(uint64_t) + sizeof(int32_t) * ((size_t)E + 1 + 2 * S);
    void *mem = NULL;
    int rc = cuda_pool_alloc(&mem, bytes);
    if (rc < 0)
        return mo_error_wrap(rc, "moe_cuda plan (T = %d, K = %d, E = %d)", T, K, E);
    p->T = T;
    p->K = K;
    p->E = E;
    p->mem = mem;
    p->bad = (uint64_t *)mem;
    p->offsets = (int32_t *)((char *)mem + sizeof(uint64_t));
    p->slot_of_row = p->offsets + E + 1;
    p->row_of_slot = p->slot_of_row + S;
    return MO_OK;
}

extern "C" void moe_cuda_plan_free(moe_cuda_plan_t *p) {
    if (p->mem)
        cuda_pool_free(p->mem);
    memset(p, 0, sizeof *p);
}

static int plan_ok(const char *op, const moe_cuda_plan_t *p) {
    if (!p || !p->mem)
        return mo_errorf(MO_EINVAL, "%s: the plan is not allocated (moe_cuda_plan_alloc)", op);
    return MO_OK;
}

extern "C" int moe_cuda_plan_build(moe_cuda_plan_t *p, const int32_t *idx) {
    TRY(cuda_enter());
    TRY(plan_ok("moe_cuda_plan_build", p));
    int S = p->T * p->K, E = p->E;
    int tiles = (S + PLAN_TILE - 1) / PLAN_TILE;
    size_t smem = sizeof(int) * (size_t)E;
    cudaStream_t st = cuda_stream();
    unsigned long long *bad = (unsigned long long *)p->bad;
    int32_t *hist = NULL; /* (tiles, E) */
    if (tiles > 0) {
        hist = (int32_t *)cuda_scratch(CUDA_SCRATCH_ACT, sizeof(int32_t) * (size_t)tiles * E);
        if (!hist)
            return mo_error_wrap(MO_EDEVICE, "moe_cuda plan histogram (%d x %d)", tiles, E);
        plan_count_kernel<<<tiles, PLAN_TILE, smem, st>>>(hist, idx, S, E);
        MOE_LAUNCHED("plan_count_kernel");
    }
    plan_scan_kernel<<<1, PLAN_SCAN_THREADS, smem, st>>>(p->offsets, hist, bad, tiles, E);
    MOE_LAUNCHED("plan_scan_kernel");
    if (tiles > 0) {
        plan_place_kernel<<<tiles, PLAN_TILE, 0, st>>>(p->slot_of_row, p->row_of_slot, bad,
                                                       cuda_flag(), idx, hist, p->offsets, S, E);
        MOE_LAUNCHED("plan_place_kernel");
    }
    return MO_OK;
}

extern "C" int moe_cuda_plan_check(const moe_cuda_plan_t *p) {
    TRY(cuda_enter());
    TRY(plan_ok("moe_cuda_plan_check", p));
    cudaStream_t st = cuda_stream();
    unsigned long long bad = 0;
    MOE_CUDA_TRY(cudaMemcpyAsync(&bad, p->bad, sizeof bad, cudaMemcpyDeviceToHost, st));
    MOE_CUDA_TRY(cudaStreamSynchronize(st));
    if (bad == ~0ull)
        return MO_OK;
    return mo_errorf(MO_EINVAL, "moe dispatch: slot %d names expert %d, outside [0, %d)",
                     (int)(bad >> 32), (int)(unsigned)(bad & 0xffffffffu), p->E);
}

/* ---- gather and combine ---- */

static __global__ void dispatch_forward_kernel(float *xg, const float *x,
                                               const int32_t *slot_of_row, int S, int K, int D) {
    for (int r = blockIdx.x; r < S; r += gridDim.x) {
        const float *src = x + (size_t)(slot_of_row[r] / K) * D;
        float *dst = xg + (size_t)r * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x)
            dst[i] = src[i];
    }
}

static __global__ void dispatch_backward_kernel(float *dx, const float *dxg,
                                                const int32_t *row_of_slot, int T, int K, int D) {
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const int32_t *rows = row_of_slot + (size_t)t * K;
        float *d = dx + (size_t)t * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            float v = d[i];
            for (int k = 0; k < K; k++)
                v += dxg[(size_t)rows[k] * D + i];
            d[i] = v;
        }
    }
}

/* Products and sums rounded separately (no fused multiply-add), as the CPU computes. */
static __global__ void combine_forward_kernel(float *out, const float *yg, const float *weight,
                                              const int32_t *row_of_slot, int T, int K, int D) {
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const int32_t *rows = row_of_slot + (size_t)t * K;
        const float *w = weight + (size_t)t * K;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            float o = 0.0f;
            for (int k = 0; k < K; k++)
                o = __fadd_rn(o, __fmul_rn(w[k], yg[(size_t)rows[k] * D + i]));
            out[(size_t)t * D + i] = o;
        }
    }
}

/* One block per token (grid-stride); the dot of each slot summed in double. */
static __global__ void combine_backward_kernel(float *dyg, float *dweight, const float *dout,
                                               const float *yg, const float *weight,
                                               const int32_t *row_of_slot, int T, int K, int D) {
    __shared__ double sh[32];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *g = dout + (size_t)t * D;
        for (int k = 0; k < K; k++) {
            size_t s = (size_t)t * K + k;
            size_t r = (size_t)row_of_slot[s];
            double dot = 0.0;
            if (dyg) {
                float wk = weight[s];
                float *dy = dyg + r * D;
                for (int i = threadIdx.x; i < D; i += blockDim.x)
                    dy[i] = __fadd_rn(dy[i], __fmul_rn(wk, g[i]));
            }
            if (dweight) {
                const float *y = yg + r * D;
                for (int i = threadIdx.x; i < D; i += blockDim.x)
                    dot += (double)g[i] * (double)y[i];
                dot = block_sum(dot, sh);
                if (threadIdx.x == 0)
                    dweight[s] += (float)dot;
            }
        }
    }
}

static int rows_ok(const char *op, const moe_cuda_plan_t *p, int D) {
    TRY(plan_ok(op, p));
    if (D < 1)
        return mo_errorf(MO_EINVAL, "%s: D must be >= 1, got %d", op, D);
    return MO_OK;
}

extern "C" int moe_cuda_dispatch_forward(float *xg, const float *x, const moe_cuda_plan_t *p,
                                         int D) {
    TRY(cuda_enter());
    TRY(rows_ok("moe_cuda_dispatch_forward", p, D));
    int S = p->T * p->K;
    if (S == 0)
        return MO_OK;
    dispatch_forward_kernel<<<cuda_grid((size_t)S, 1), row_threads(D), 0, cuda_stream()>>>(
        xg, x, p->slot_of_row, S, p->K, D);
    MOE_LAUNCHED("dispatch_forward_kernel");
    return MO_OK;
}

extern "C" int moe_cuda_dispatch_backward(float *dx, const float *dxg, const moe_cuda_plan_t *p,
                                          int D) {
    TRY(cuda_enter());
    TRY(rows_ok("moe_cuda_dispatch_backward", p, D));
    if (p->T == 0)
        return MO_OK;
    dispatch_backward_kernel<<<cuda_grid((size_t)p->T, 1), row_threads(D), 0, cuda_stream()>>>(
        dx, dxg, p->row_of_slot, p->T, p->K, D);
    MOE_LAUNCHED("dispatch_backward_kernel");
    return MO_OK;
}

extern "C" int moe_cuda_combine_forward(float *out, const float *yg, const float *weight,
                                        const moe_cuda_plan_t *p, int D) {
    TRY(cuda_enter());
    TRY(rows_ok("moe_cuda_combine_forward", p, D));
    if (p->T == 0)
        return MO_OK;
    combine_forward_kernel<<<cuda_grid((size_t)p->T, 1), row_threads(D), 0, cuda_stream()>>>(
        out, yg, weight, p->row_of_slot, p->T, p->K, D);
    MOE_LAUNCHED("combine_forward_kernel");
    return MO_OK;
}

extern "C" int moe_cuda_combine_backward(float *dyg, float *dweight, const float *dout,
                                         const float *yg, const float *weight,
                                         const moe_cuda_plan_t *p, int D) {
    TRY(cuda_enter());
    TRY(rows_ok("moe_cuda_combine_backward", p, D));
    if (p->T == 0 || (!dyg && !dweight))
        return MO_OK;
    combine_backward_kernel<<<cuda_grid((size_t)p->T, 1), row_threads(D), 0, cuda_stream()>>>(
        dyg, dweight, dout, yg, weight, p->row_of_slot, p->T, p->K, D);
    MOE_LAUNCHED("combine_backward_kernel");
    return MO_OK;
}

/* ---- grouped products ---- */

/* One (GG_BM, GG_BN) tile at (m0, c0) of C (M, N) = alpha * A (M, Q) B (Q, N), plus the
 * old C when acc, with
 *   A(m, q) = A[m lda + q] (A_T false) or A[q lda + m] (A_T true);
 *   B(q, c) = B[c ldb + q] (B_T false) or B[q ldb + c] (B_T true).
 * Needs GG_THREADS threads, all of which must call it (it holds barriers). */
template <bool A_T, bool B_T>
static __device__ void gg_tile(float *C, size_t ldc, const float *A, size_t lda, const float *B,
                               size_t ldb, int M, int N, int Q, int m0, int c0, float alpha,
                               int acc) {
    __shared__ float As[GG_BK][GG_BM + GG_PAD];
    __shared__ float Bs[GG_BK][GG_BN + GG_PAD];
    int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float sum[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            sum[i][j] = 0.0f;
    for (int q0 = 0; q0 < Q; q0 += GG_BK) {
        for (int l = tid; l < GG_BM * GG_BK; l += GG_THREADS) {
            int mm = A_T ? l % GG_BM : l / GG_BK;
            int qq = A_T ? l / GG_BM : l % GG_BK;
            int gm = m0 + mm, gq = q0 + qq;
            float v = 0.0f;
            if (gm < M && gq < Q)
                v = A_T ? A[(size_t)gq * lda + gm] : A[(size_t)gm * lda + gq];
            As[qq][mm] = v;
        }
        for (int l = tid; l < GG_BN * GG_BK; l += GG_THREADS) {
            int cc = B_T ? l % GG_BN : l / GG_BK;
            int qq = B_T ? l / GG_BN : l % GG_BK;
            int gc = c0 + cc, gq = q0 + qq;
            float v = 0.0f;
            if (gc < N && gq < Q)
                v = B_T ? B[(size_t)gq * ldb + gc] : B[(size_t)gc * ldb + gq];
            Bs[qq][cc] = v;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < GG_BK; q++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                a[i] = As[q][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++)
                b[j] = Bs[q][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    sum[i][j] = fmaf(a[i], b[j], sum[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int gm = m0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int gc = c0 + tx + 16 * j;
            if (gm < M && gc < N) {
                float *o = C + (size_t)gm * ldc + gc;
                float v = alpha * sum[i][j];
                *o = acc ? *o + v : v;
            }
        }
    }
}

/* The tensor-core form of gg_tile for bf16 weights (their bits in B) and rows of A:
 * rows 0 .. M-1 of C (M, N) = alpha * bf16(A (M, Q)) op(B) (+ C), with op(B)(q, c) =
 * B[c ldb + q] (B_T false) or B[q ldb + c] (B_T true), columns c0 .. c0 + GG_BN - 1.
 * Needs TC_THREADS threads, all of which must call it. Fragment pointers are 32-byte
 * aligned and strides multiples of 16 bytes, as WMMA requires. */
template <bool B_T>
static __device__ void tc_tile(float *C, size_t ldc, const float *A, size_t lda, const uint16_t *B,
                               size_t ldb, int M, int N, int Q, int c0, float alpha, int acc) {
    using namespace nvcuda;
    using BLayout = typename std::conditional<B_T, wmma::row_major, wmma::col_major>::type;
    __shared__ __align__(32) __nv_bfloat16 As[GG_BM * TC_LDA]; /* (m, q) */
    __shared__ __align__(32) __nv_bfloat16 Bs[TC_BS_ELEMS];    /* (c, q) or (q, c) */
    __shared__ __align__(32) float Cs[GG_BM * TC_LDC];         /* (m, c) */
    int tid = threadIdx.x, warp = tid / 32, wm = warp / 2, wn = warp % 2;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_f[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc_f[i][j], 0.0f);
    for (int q0 = 0; q0 < Q; q0 += TC_BK) {
        for (int l = tid; l < GG_BM * TC_BK; l += TC_THREADS) {
            int mm = l / TC_BK, qq = l % TC_BK, gq = q0 + qq;
            float v = mm < M && gq < Q ? A[(size_t)mm * lda + gq] : 0.0f;
            As[mm * TC_LDA + qq] = __float2bfloat16_rn(v);
        }
        for (int l = tid; l < GG_BN * TC_BK; l += TC_THREADS) {
            int cc = B_T ? l % GG_BN : l / TC_BK;
            int qq = B_T ? l / GG_BN : l % TC_BK;
            int gc = c0 + cc, gq = q0 + qq;
            unsigned short v = 0;
            if (gc < N && gq < Q)
                v = B_T ? B[(size_t)gq * ldb + gc] : B[(size_t)gc * ldb + gq];
            Bs[B_T ? qq * TC_LDB + cc : cc * TC_LDA + qq] = __ushort_as_bfloat16(v);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TC_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> b[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * TC_LDA + kk, TC_LDA);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int col = wn * 32 + j * 16;
                if (B_T)
                    wmma::load_matrix_sync(b[j], Bs + kk * TC_LDB + col, TC_LDB);
                else
                    wmma::load_matrix_sync(b[j], Bs + col * TC_LDA + kk, TC_LDA);
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    wmma::mma_sync(acc_f[i][j], a[i], b[j], acc_f[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * TC_LDC + wn * 32 + j * 16,
                                    acc_f[i][j], TC_LDC, wmma::mem_row_major);
    __syncthreads();
    for (int l = tid; l < GG_BM * GG_BN; l += TC_THREADS) {
        int m = l / GG_BN, cc = l % GG_BN, gc = c0 + cc;
        if (m < M && gc < N) {
            float *o = C + (size_t)m * ldc + gc;
            float v = alpha * Cs[m * TC_LDC + cc];
            *o = acc ? *o + v : v;
        }
    }
}

/* The expert of row tile `tile` (tiles numbered expert by expert, GG_BM rows each, the
 * last of an expert partial), its first row in *r0 and the expert's end in *r1; -1 past
 * the last tile. Offsets are clamped into [0, rows]. */
static __device__ int find_tile(const int32_t *offsets, int n, int rows, int tile, int *r0,
                                int *r1) {
    int seen = 0;
    for (int i = 0; i < n; i++) {
        int lo = clampi(offsets[i], 0, rows), hi = clampi(offsets[i + 1], lo, rows);
        int nt = (hi - lo + GG_BM - 1) / GG_BM;
        if (tile < seen + nt) {
            *r0 = lo + (tile - seen) * GG_BM;
            *r1 = hi;
            return i;
        }
        seen += nt;
    }
    return -1;
}

/* C (rows, N) = alpha * A (rows, Q) @ op(W_e) (+ C), W_e = Btab[e] stored (N, Q) (B_T
 * false: the forward) or (Q, N) (B_T true: the input gradient). Grid: (row tile slots,
 * column tiles). */
template <typename TB, bool B_T>
static __global__ void __launch_bounds__(sizeof(TB) == 2 ? TC_THREADS : GG_THREADS)
    gmm_rows_kernel(float *C, const float *A, const void *const *Btab, const int32_t *offsets,
                    int n, int rows, int N, int Q, float alpha, int acc) {
    int r0 = 0, r1 = 0;
    int e = find_tile(offsets, n, rows, (int)blockIdx.x, &r0, &r1);
    if (e < 0)
        return;
    int M = r1 - r0 < GG_BM ? r1 - r0 : GG_BM;
    int c0 = (int)blockIdx.y * GG_BN;
    float *Ct = C + (size_t)r0 * N;
    const TB *B = (const TB *)Btab[e];
    if (!B) { /* no matrix for this expert: zeros, or nothing to add */
        if (acc)
            return;
        for (int l = threadIdx.x; l < GG_BM * GG_BN; l += (int)blockDim.x) {
            int m = l / GG_BN, c = c0 + l % GG_BN;
            if (m < M && c < N)
                Ct[(size_t)m * N + c] = 0.0f;
        }
        return;
    }
    const float *At = A + (size_t)r0 * Q;
    size_t ldb = B_T ? (size_t)N : (size_t)Q;
    if constexpr (sizeof(TB) == 2)
        tc_tile<B_T>(Ct, (size_t)N, At, (size_t)Q, B, ldb, M, N, Q, c0, alpha, acc);
    else
        gg_tile<false, B_T>(Ct, (size_t)N, At, (size_t)Q, B, ldb, M, N, Q, 0, c0, alpha, acc);
}

/* dw[e] (OC, C) += alpha * dout_e^T x_e over expert e's rows. Grid: (C tiles, OC tiles, n). */
static __global__ void __launch_bounds__(GG_THREADS)
    gmm_dw_kernel(float *const *dw, const float *dout, const float *x, const int32_t *offsets,
                  int rows, int C, int OC, float alpha) {
    int e = (int)blockIdx.z;
    int lo = clampi(offsets[e], 0, rows), hi = clampi(offsets[e + 1], lo, rows);
    float *W = dw[e];
    if (hi == lo || !W)
        return;
    gg_tile<true, true>(W, (size_t)C, dout + (size_t)lo * OC, (size_t)OC, x + (size_t)lo * C,
                        (size_t)C, OC, C, hi - lo, (int)blockIdx.y * GG_BM, (int)blockIdx.x * GG_BN,
                        alpha, 1);
}

static int gmm_args(const char *op, const void *tab, const int32_t *offsets, int n, int rows, int C,
                    int OC) {
    if (n < 0 || n > GG_MAX_GRID_YZ || rows < 0 || C < 1 || OC < 1)
        return mo_errorf(MO_EINVAL, "%s: bad shape n = %d, rows = %d, C = %d, OC = %d", op, n, rows,
                         C, OC);
    if ((C + GG_BN - 1) / GG_BN > GG_MAX_GRID_YZ || (OC + GG_BN - 1) / GG_BN > GG_MAX_GRID_YZ)
        return mo_errorf(MO_EINVAL, "%s: C = %d or OC = %d exceeds the grid", op, C, OC);
    if ((size_t)(rows + GG_BM - 1) / GG_BM + (size_t)n > INT32_MAX)
        return mo_errorf(MO_EINVAL, "%s: %d rows exceed the grid", op, rows);
    if (n > 0 && (!tab || !offsets))
        return mo_errorf(MO_EINVAL, "%s: the %s is NULL", op, tab ? "offsets" : "matrix table");
    return MO_OK;
}

static int wdt_ok(const char *op, dtype_t wdt) {
    if (wdt != DT_F32 && wdt != DT_BF16)
        return mo_errorf(MO_EUNSUPPORTED, "%s: weight dtype %s (F32 or BF16 here)", op,
                         dtype_name(wdt));
    return MO_OK;
}

/* out (rows, N) = alpha * a (rows, Q) @ op(W_e) (+ out). */
static int gmm_rows(float *out, const float *a, const void *const *w, dtype_t wdt, int bt,
                    const int32_t *offsets, int n, int rows, int N, int Q, float alpha, int acc) {
    if (rows == 0 || n == 0)
        return MO_OK;
    dim3 grid((unsigned)((rows + GG_BM - 1) / GG_BM + n), (unsigned)((N + GG_BN - 1) / GG_BN));
    cudaStream_t st = cuda_stream();
    if (wdt == DT_F32 && !bt)
        gmm_rows_kernel<float, false>
            <<<grid, GG_THREADS, 0, st>>>(out, a, w, offsets, n, rows, N, Q, alpha, acc);
    else if (wdt == DT_F32)
        gmm_rows_kernel<float, true>
            <<<grid, GG_THREADS, 0, st>>>(out, a, w, offsets, n, rows, N, Q, alpha, acc);
    else if (!bt)
        gmm_rows_kernel<uint16_t, false>
            <<<grid, TC_THREADS, 0, st>>>(out, a, w, offsets, n, rows, N, Q, alpha, acc);
    else
        gmm_rows_kernel<uint16_t, true>
            <<<grid, TC_THREADS, 0, st>>>(out, a, w, offsets, n, rows, N, Q, alpha, acc);
    MOE_LAUNCHED("gmm_rows_kernel");
    return MO_OK;
}

extern "C" int moe_cuda_gmm_forward(float *out, const float *x, const void *const *w, dtype_t wdt,
                                    const int32_t *offsets, int n, int rows, int C, int OC,
                                    float alpha, int accumulate) {
    TRY(cuda_enter());
    TRY(gmm_args("moe_cuda_gmm_forward", w, offsets, n, rows, C, OC));
    TRY(wdt_ok("moe_cuda_gmm_forward", wdt));
    return gmm_rows(out, x, w, wdt, 0, offsets, n, rows, OC, C, alpha, accumulate);
}

extern "C" int moe_cuda_gmm_backward_x(float *dx, const float *dout, const void *const *w,
                                       dtype_t wdt, const int32_t *offsets, int n, int rows, int C,
                                       int OC, float alpha, int accumulate) {
    TRY(cuda_enter());
    TRY(gmm_args("moe_cuda_gmm_backward_x", w, offsets, n, rows, C, OC));
    TRY(wdt_ok("moe_cuda_gmm_backward_x", wdt));
    return gmm_rows(dx, dout, w, wdt, 1, offsets, n, rows, C, OC, alpha, accumulate);
}

extern "C" int moe_cuda_gmm_backward_w(float *const *dw, const float *dout, const float *x,
                                       const int32_t *offsets, int n, int rows, int C, int OC,
                                       float alpha) {
    TRY(cuda_enter());
    TRY(gmm_args("moe_cuda_gmm_backward_w", dw, offsets, n, rows, C, OC));
    if (rows == 0 || n == 0)
        return MO_OK;
    dim3 grid((unsigned)((C + GG_BN - 1) / GG_BN), (unsigned)((OC + GG_BM - 1) / GG_BM),
              (unsigned)n);
    gmm_dw_kernel<<<grid, GG_THREADS, 0, cuda_stream()>>>(dw, dout, x, offsets, rows, C, OC, alpha);
    MOE_LAUNCHED("gmm_dw_kernel");
    return MO_OK;
}

/* ---- LoRA ---- */

static int lora_ok(const char *op, const moe_cuda_lora_t *l) {
    if (!l->A || !l->B || l->R < 1)
        return mo_errorf(MO_EINVAL, "%s: adapter tables A = %p, B = %p with R = %d", op,
                         (const void *)l->A, (const void *)l->B, l->R);
    return MO_OK;
}

extern "C" int moe_cuda_lora_forward(float *y, float *xa, const float *x, const moe_cuda_lora_t *l,
                                     const int32_t *offsets, int n, int rows, int C, int OC) {
    TRY(lora_ok("moe_cuda_lora_forward", l));
    /* xa (rows, R) = x A_e^T;  y (rows, OC) += scale xa B_e^T */
    TRY(moe_cuda_gmm_forward(xa, x, (const void *const *)l->A, DT_F32, offsets, n, rows, C, l->R,
                             1.0f, 0));
    return moe_cuda_gmm_forward(y, xa, (const void *const *)l->B, DT_F32, offsets, n, rows, l->R,
                                OC, l->scale, 1);
}

extern "C" int moe_cuda_lora_backward(float *dx, const float *dy, const float *x, const float *xa,
                                      const moe_cuda_lora_t *l, const int32_t *offsets, int n,
                                      int rows, int C, int OC, float *tmp) {
    TRY(lora_ok("moe_cuda_lora_backward", l));
    int R = l->R;
    /* dB_e (OC, R) += scale dy_e^T xa_e */
    if (l->dB)
        TRY(moe_cuda_gmm_backward_w(l->dB, dy, xa, offsets, n, rows, R, OC, l->scale));
    if (!dx && !l->dA)
        return MO_OK;
    /* tmp (rows, R) = scale dy B_e */
    TRY(moe_cuda_gmm_backward_x(tmp, dy, (const void *const *)l->B, DT_F32, offsets, n, rows, R, OC,
                                l->scale, 0));
    /* dx (rows, C) += tmp A_e;  dA_e (R, C) += tmp_e^T x_e */
    if (dx)
        TRY(moe_cuda_gmm_backward_x(dx, tmp, (const void *const *)l->A, DT_F32, offsets, n, rows, C,
                                    R, 1.0f, 1));
    if (l->dA)
        TRY(moe_cuda_gmm_backward_w(l->dA, tmp, x, offsets, n, rows, C, R, 1.0f));
    return MO_OK;
}

/* ---- the expert MLP ---- */

static __global__ void moe_swiglu_forward_kernel(float *h, const float *g, const float *u,
                                                 size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gv = g[i];
        h[i] = gv / (1.0f + expf(-gv)) * u[i];
    }
}

/* dg = dh * u * s * (1 + g (1 - s)), du = dh * g * s with s = sigmoid(g) (overwrites). */
static __global__ void moe_swiglu_backward_kernel(float *dg, float *du, const float *dh,
                                                  const float *g, const float *u, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gv = g[i];
        float s = 1.0f / (1.0f + expf(-gv));
        dg[i] = dh[i] * u[i] * s * (1.0f + gv * (1.0f - s));
        du[i] = dh[i] * gv * s;
    }
}

static int experts_ok(const char *op, const moe_cuda_experts_t *w, const moe_cuda_acts_t *a, int D,
                      int F) {
    TRY(wdt_ok(op, w->dtype));
    if (D < 1 || F < 1)
        return mo_errorf(MO_EINVAL, "%s: D = %d, F = %d", op, D, F);
    if ((w->lora_gate.A && !a->xa_gate) || (w->lora_up.A && !a->xa_up) ||
        (w->lora_down.A && !a->xa_down))
        return mo_errorf(MO_EINVAL, "%s: an adapted projection has no xa buffer", op);
    return MO_OK;
}

/* out (rows, OC) = inp @ W_e^T plus the adapter's product when present. */
static int proj_forward(float *out, float *xa, const float *inp, const void *const *w, dtype_t dt,
                        const moe_cuda_lora_t *l, const int32_t *offsets, int n, int rows, int C,
                        int OC) {
    TRY(moe_cuda_gmm_forward(out, inp, w, dt, offsets, n, rows, C, OC, 1.0f, 0));
    if (l->A)
        TRY(moe_cuda_lora_forward(out, xa, inp, l, offsets, n, rows, C, OC));
    return MO_OK;
}

extern "C" int moe_cuda_experts_forward(float *ye, const moe_cuda_acts_t *a, const float *xe,
                                        const int32_t *offsets, int n, int rows,
                                        const moe_cuda_experts_t *w, int D, int F) {
    TRY(cuda_enter());
    TRY(experts_ok("moe_cuda_experts_forward", w, a, D, F));
    if (rows == 0 || n == 0)
        return MO_OK;
    dtype_t dt = w->dtype;
    TRY(proj_forward(a->g, a->xa_gate, xe, w->gate, dt, &w->lora_gate, offsets, n, rows, D, F));
    TRY(proj_forward(a->u, a->xa_up, xe, w->up, dt, &w->lora_up, offsets, n, rows, D, F));
    size_t nf = (size_t)rows * F;
    moe_swiglu_forward_kernel<<<cuda_grid(nf, MOE_THREADS), MOE_THREADS, 0, cuda_stream()>>>(
        a->h, a->g, a->u, nf);
    MOE_LAUNCHED("moe_swiglu_forward_kernel");
    return proj_forward(ye, a->xa_down, a->h, w->down, dt, &w->lora_down, offsets, n, rows, F, D);
}

static int rank_of(const moe_cuda_lora_t *l) {
    return l->A ? l->R : 0;
}

extern "C" size_t moe_cuda_experts_backward_scratch_floats(const moe_cuda_experts_t *w, int rows,
                                                           int F) {
    int r = rank_of(&w->lora_gate);
    if (rank_of(&w->lora_up) > r)
        r = rank_of(&w->lora_up);
    if (rank_of(&w->lora_down) > r)
        r = rank_of(&w->lora_down);
    return (size_t)rows * (3 * (size_t)F + (size_t)r);
}

extern "C" int moe_cuda_experts_backward(float *dxe, const float *dye, const float *xe,
                                         const moe_cuda_acts_t *a, const int32_t *offsets, int n,
                                         int rows, const moe_cuda_experts_t *w, int D, int F,
                                         float *scratch) {
    TRY(cuda_enter());
    TRY(experts_ok("moe_cuda_experts_backward", w, a, D, F));
    if (rows == 0 || n == 0)
        return MO_OK;
    dtype_t dt = w->dtype;
    size_t nf = (size_t)rows * F;
    float *dh = scratch;  /* (rows, F) */
    float *dg = dh + nf;  /* (rows, F) */
    float *du = dg + nf;  /* (rows, F) */
    float *tmp = du + nf; /* (rows, R) */
    TRY(moe_cuda_gmm_backward_x(dh, dye, w->down, dt, offsets, n, rows, F, D, 1.0f, 0));
    if (w->lora_down.A)
        TRY(moe_cuda_lora_backward(dh, dye, a->h, a->xa_down, &w->lora_down, offsets, n, rows, F, D,
                                   tmp));
    moe_swiglu_backward_kernel<<<cuda_grid(nf, MOE_THREADS), MOE_THREADS, 0, cuda_stream()>>>(
        dg, du, dh, a->g, a->u, nf);
    MOE_LAUNCHED("moe_swiglu_backward_kernel");
    TRY(moe_cuda_gmm_backward_x(dxe, dg, w->gate, dt, offsets, n, rows, D, F, 1.0f, 1));
    if (w->lora_gate.A)
        TRY(moe_cuda_lora_backward(dxe, dg, xe, a->xa_gate, &w->lora_gate, offsets, n, rows, D, F,
                                   tmp));
    TRY(moe_cuda_gmm_backward_x(dxe, du, w->up, dt, offsets, n, rows, D, F, 1.0f, 1));
    if (w->lora_up.A)
        TRY(moe_cuda_lora_backward(dxe, du, xe, a->xa_up, &w->lora_up, offsets, n, rows, D, F,
                                   tmp));
    return MO_OK;
}
