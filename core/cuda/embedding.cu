/* embedding: CUDA token-embedding lookup (any float weight dtype, block
 * scales applied as on the CPU, so values match bit for bit) and its
 * scatter-add backward. A negative id sets the device error flag and its row
 * is left unwritten. */
#include "core/cuda/cuda_common.h"

#define EMB_THREADS 256

/* out (T, D) = wte[ids[t]] in f32. */
static __global__ void embedding_forward_kernel(float *out, const int32_t *ids, const void *data,
                                                dtype_t dt, const float *scale, int block, int T,
                                                int D, int *flag) {
    size_t n = (size_t)T * (size_t)D;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / (size_t)D, d = i % (size_t)D;
        int32_t id = ids[t];
        if (id < 0) {
            cuda_flag_set(flag, CUDA_FLAG_EMBEDDING_ID);
            continue;
        }
        out[i] = wview_at(data, dt, scale, block, (size_t)id, d, (size_t)D);
    }
}

/* dwte (V, D) += dout (T, D) scattered by ids. Each thread owns one column
 * and walks the tokens in order, so repeated ids never race and the sums run
 * in the CPU's order. */
static __global__ void embedding_backward_kernel(float *dwte, const float *dout, const int32_t *ids,
                                                 int T, int D, int *flag) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D)
        return;
    for (int t = 0; t < T; t++) {
        int32_t id = ids[t];
        if (id < 0) {
            cuda_flag_set(flag, CUDA_FLAG_EMBEDDING_ID);
            continue;
        }
        dwte[(size_t)id * (size_t)D + (size_t)d] += dout[(size_t)t * (size_t)D + (size_t)d];
    }
}

extern "C" void cuda_embedding_forward(float *out, const int32_t *ids, const wview_t *wte, int T,
                                       int D) {
    if (cuda_enter() < 0)
        return;
    if (T < 0 || D <= 0) {
        cuda_record(MO_EINVAL, "embedding_forward: bad shape T=%d D=%d", T, D);
        return;
    }
    if (!cuda_wdtype_ok(wte->dtype) || (wte->scale && wte->block <= 0)) {
        cuda_record(MO_EINVAL, "embedding_forward: table dtype %s (block %d) is not usable",
                    dtype_name(wte->dtype), wte->block);
        return;
    }
    if (T == 0)
        return;
    size_t n = (size_t)T * (size_t)D;
    embedding_forward_kernel<<<cuda_grid(n, EMB_THREADS), EMB_THREADS, 0, cuda_stream()>>>(
        out, ids, wte->data, wte->dtype, wte->scale, wte->block, T, D, cuda_flag());
    LAUNCH_CHECK("embedding_forward_kernel");
}

extern "C" void cuda_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T,
                                        int D) {
    if (cuda_enter() < 0)
        return;
    if (T < 0 || D <= 0) {
        cuda_record(MO_EINVAL, "embedding_backward: bad shape T=%d D=%d", T, D);
        return;
    }
    if (!dwte || T == 0)
        return;
    embedding_backward_kernel<<<(unsigned)((D + EMB_THREADS - 1) / EMB_THREADS), EMB_THREADS, 0,
                                cuda_stream()>>>(dwte, dout, ids, T, D, cuda_flag());
    LAUNCH_CHECK("embedding_backward_kernel");
}
