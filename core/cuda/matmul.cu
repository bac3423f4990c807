/* matmul: CUDA matrix products out = inp @ w^T (+ bias) and their backward
 * through cuBLAS, f32 accumulation throughout.
 *
 * The product's operand dtype follows the weight:
 *   f32 weight          f32 operands (SGEMM, no TF32): matches the CPU to ~1e-6
 *   bf16 weight         activations (or output gradients) rounded to bf16
 *   f16 weight          activations rounded to f16 (beyond +-65504 they become
 *                       +-inf, as in an f16 PyTorch product)
 *   fp8, or any weight  weight rows dequantised with their block scales into a
 *   with block scales   bf16 tile (f32 for an f32 weight), activations in bf16
 * so products with bf16/f16/fp8 weights differ from the CPU's f32 products by
 * the rounding of the operands: normalised error up to ~1e-2.
 *
 * cuBLAS is column-major: a row-major (rows, cols) matrix is its transpose, so
 * out (T, OC) = inp @ w^T is out^T (OC, T) = w (as C x OC)^T . inp^T.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda/cuda_common.h"

/* Dequantised weight elements per tile (64 MiB of bf16). */
#define MM_TILE_ELEMS ((size_t)32 << 20)
#define MM_THREADS 256

static __global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

static __global__ void to_f16_kernel(__half *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2half_rn(src[i]);
}

/* dst (m, C) = rows r0 .. r0+m-1 of the weight view in f32 (to_bf16 = 0) or
 * bf16 (to_bf16 = 1), block scales applied. */
static __global__ void dequant_kernel(void *dst, int to_bf16, const void *data, dtype_t dt,
                                      const float *scale, int block, int r0, int m, int C) {
    size_t n = (size_t)m * (size_t)C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t r = (size_t)r0 + e / (size_t)C, c = e % (size_t)C;
        float x = wview_at(data, dt, scale, block, r, c, (size_t)C);
        if (to_bf16)
            ((__nv_bfloat16 *)dst)[e] = __float2bfloat16_rn(x);
        else
            ((float *)dst)[e] = x;
    }
}

/* out (T, OC): every row = bias (OC). */
static __global__ void fill_rows_kernel(float *out, const float *bias, int T, int OC) {
    size_t n = (size_t)T * (size_t)OC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = bias[i % (size_t)OC];
}

/* dbias (OC) += column sums of dout (T, OC). Block (32, 8): 32 columns, 8 row
 * lanes summed in a fixed order (deterministic). */
static __global__ void colsum_kernel(float *dbias, const float *dout, int T, int OC) {
    __shared__ float sh[8][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < OC)
        for (int t = threadIdx.y; t < T; t += 8)
            s += dout[(size_t)t * (size_t)OC + (size_t)c];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < OC) {
        float a = 0.0f;
        for (int r = 0; r < 8; r++)
            a += sh[r][threadIdx.x];
        dbias[c] += a;
    }
}

/* The dtype of the product's operands for a weight view. */
static cudaDataType_t operand_type(const wview_t *w) {
    if (w->dtype == DT_F32)
        return CUDA_R_32F;
    if (w->dtype == DT_F16 && !w->scale)
        return CUDA_R_16F;
    return CUDA_R_16BF;
}

static size_t operand_size(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : 2;
}

/* True when the stored weight is used as the operand (no conversion). */
static int weight_direct(const wview_t *w) {
    return !w->scale && w->dtype != DT_F8E4M3;
}

static int check_weight(const char *op, const wview_t *w) {
    if (!cuda_wdtype_ok(w->dtype))
        return cuda_record(MO_EINVAL, "%s: weight dtype %s is not a float type", op,
                           dtype_name(w->dtype));
    if (w->scale && w->block <= 0)
        return cuda_record(MO_EINVAL, "%s: weight has block scales but block = %d", op, w->block);
    return MO_OK;
}

/* x (n) in the operand dtype: x itself for f32, else converted into scratch.
 * NULL after recording an error. */
static const void *as_operand(const float *x, size_t n, cudaDataType_t t, int slot) {
    if (t == CUDA_R_32F)
        return x;
    void *buf = cuda_scratch(slot, n * 2);
    if (!buf)
        return NULL;
    if (t == CUDA_R_16BF)
        to_bf16_kernel<<<cuda_grid(n, MM_THREADS), MM_THREADS, 0, cuda_stream()>>>(
            (__nv_bfloat16 *)buf, x, n);
    else
        to_f16_kernel<<<cuda_grid(n, MM_THREADS), MM_THREADS, 0, cuda_stream()>>>((__half *)buf, x,
                                                                                  n);
    return LAUNCH_OK("to_bf16_kernel/to_f16_kernel") ? buf : NULL;
}

/* Rows of the weight per tile. */
static int tile_rows(const wview_t *w, int C, int OC) {
    if (weight_direct(w))
        return OC;
    size_t r = MM_TILE_ELEMS / (size_t)C;
    if (r < 1)
        r = 1;
    return r < (size_t)OC ? (int)r : OC;
}

/* Weight rows o0 .. o0+m-1 (m, C) in the operand dtype t; NULL after
 * recording an error. */
static const void *weight_tile(const wview_t *w, cudaDataType_t t, int o0, int m, int C) {
    if (weight_direct(w))
        return (const char *)w->data + (size_t)o0 * (size_t)C * dtype_size(w->dtype);
    size_t n = (size_t)m * (size_t)C;
    void *buf = cuda_scratch(CUDA_SCRATCH_TILE, n * operand_size(t));
    if (!buf)
        return NULL;
    dequant_kernel<<<cuda_grid(n, MM_THREADS), MM_THREADS, 0, cuda_stream()>>>(
        buf, t == CUDA_R_16BF, w->data, w->dtype, w->scale, w->block, o0, m, C);
    return LAUNCH_OK("dequant_kernel") ? buf : NULL;
}

/* Column-major Cm (m, n) = op(A) op(B) + beta Cm, f32 Cm, f32 accumulation. */
static int gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb, float beta,
                float *Cm, int ldc) {
    cublasHandle_t h = cuda_blas();
    if (!h)
        return MO_EDEVICE;
    const float alpha = 1.0f;
    cublasStatus_t s = cublasGemmEx(h, ta, tb, m, n, k, &alpha, A, at, lda, B, bt, ldb, &beta, Cm,
                                    CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return cublas_fail(s, "cublasGemmEx", __FILE__, __LINE__);
    return MO_OK;
}

extern "C" void cuda_matmul_forward(float *out, const float *inp, const wview_t *w,
                                    const float *bias, int T, int C, int OC) {
    if (cuda_enter() < 0)
        return;
    if (T < 0 || C <= 0 || OC <= 0) {
        cuda_record(MO_EINVAL, "matmul_forward: bad shape T=%d C=%d OC=%d", T, C, OC);
        return;
    }
    if (T == 0 || check_weight("matmul_forward", w) < 0)
        return;
    cudaStream_t st = cuda_stream();
    float beta = 0.0f;
    if (bias) {
        size_t n = (size_t)T * (size_t)OC;
        fill_rows_kernel<<<cuda_grid(n, MM_THREADS), MM_THREADS, 0, st>>>(out, bias, T, OC);
        LAUNCH_CHECK("fill_rows_kernel");
        beta = 1.0f;
    }
    cudaDataType_t t = operand_type(w);
    const void *x = as_operand(inp, (size_t)T * (size_t)C, t, CUDA_SCRATCH_ACT);
    if (!x)
        return;
    int R = tile_rows(w, C, OC);
    for (int o0 = 0; o0 < OC; o0 += R) {
        int m = OC - o0 < R ? OC - o0 : R;
        const void *A = weight_tile(w, t, o0, m, C);
        /* out[:, o0 .. o0+m) ^T (m, T) = A (C, m)^T . x (C, T) */
        if (!A || gemm(CUBLAS_OP_T, CUBLAS_OP_N, m, T, C, A, t, C, x, t, C, beta, out + o0, OC) < 0)
            return;
    }
}

/* dinp (T, C) += dout (T, OC) @ w, tile by tile of weight rows. */
static void backward_inp(float *dinp, const float *dout, const wview_t *w, int T, int C, int OC) {
    cudaDataType_t t = operand_type(w);
    const void *g = as_operand(dout, (size_t)T * (size_t)OC, t, CUDA_SCRATCH_GRAD);
    if (!g)
        return;
    int R = tile_rows(w, C, OC);
    for (int o0 = 0; o0 < OC; o0 += R) {
        int m = OC - o0 < R ? OC - o0 : R;
        const void *A = weight_tile(w, t, o0, m, C);
        const void *Bm = (const char *)g + (size_t)o0 * operand_size(t);
        /* dinp^T (C, T) += A (C, m) . dout[:, o0 .. o0+m)^T (m, T) */
        if (!A || gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, T, m, A, t, C, Bm, t, OC, 1.0f, dinp, C) < 0)
            return;
    }
}

extern "C" void cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                     const float *inp, const wview_t *w, int T, int C, int OC) {
    if (cuda_enter() < 0)
        return;
    if (T < 0 || C <= 0 || OC <= 0) {
        cuda_record(MO_EINVAL, "matmul_backward: bad shape T=%d C=%d OC=%d", T, C, OC);
        return;
    }
    if (check_weight("matmul_backward", w) < 0)
        return;
    if (dw && (w->dtype != DT_F32 || w->scale)) {
        cuda_record(MO_EINVAL,
                    "matmul_backward: dw needs an f32 weight without block scales (weight is %s%s)",
                    dtype_name(w->dtype), w->scale ? " with block scales" : "");
        return;
    }
    if (T == 0)
        return;
    if (dinp)
        backward_inp(dinp, dout, w, T, C, OC);
    /* dw^T (C, OC) += inp^T (C, T) . dout (T, OC) */
    if (dw && gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, T, inp, CUDA_R_32F, C, dout, CUDA_R_32F, OC,
                   1.0f, dw, C) < 0)
        return;
    if (dbias) {
        colsum_kernel<<<(unsigned)((OC + 31) / 32), dim3(32, 8), 0, cuda_stream()>>>(dbias, dout, T,
                                                                                     OC);
        LAUNCH_CHECK("colsum_kernel");
    }
}
