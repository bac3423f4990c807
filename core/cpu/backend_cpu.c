/* backend_cpu: host memory and the CPU kernel table. */
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <omp.h>

#include "core/backend.h"
#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

static const kernels_t g_cpu_kernels = {
    .matmul_forward = cpu_matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rope_forward = cpu_rope_forward,
    .rope_backward = cpu_rope_backward,
    .attention_forward = cpu_attention_forward,
    .attention_backward = cpu_attention_backward,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .softmax_forward = cpu_softmax_forward,
    .softmax_backward = cpu_softmax_backward,
    .topk_forward = cpu_topk_forward,
    .topk_backward = cpu_topk_backward,
    .logprob_forward = cpu_logprob_forward,
    .logprob_backward = cpu_logprob_backward,
    .adamw_update = cpu_adamw_update,
};

static int cpu_alloc(const backend_t *be, void **ptr, size_t bytes) {
    (void)be;
    size_t n = (bytes + 63) / 64 * 64;
    *ptr = aligned_alloc(64, n ? n : 64);
    if (!*ptr)
        return mo_errorf(MO_ENOMEM, "cannot allocate %zu bytes of host memory", bytes);
    return MO_OK;
}

static void cpu_free(const backend_t *be, void *ptr) {
    (void)be;
    free(ptr);
}

static int cpu_copy(const backend_t *be, void *dst, device_t dst_dev, const void *src,
                    device_t src_dev, size_t bytes) {
    (void)be;
    if (dst_dev != DEV_CPU || src_dev != DEV_CPU)
        return mo_errorf(MO_EINVAL, "cpu backend copies host memory only (asked %s -> %s)",
                         device_name(src_dev), device_name(dst_dev));
    memmove(dst, src, bytes);
    return MO_OK;
}

static int cpu_memset_zero(const backend_t *be, void *ptr, size_t bytes) {
    (void)be;
    memset(ptr, 0, bytes);
    return MO_OK;
}

static int cpu_synchronize(const backend_t *be) {
    (void)be;
    return MO_OK;
}

static void cpu_set_stream(const backend_t *be, void *stream) {
    (void)be;
    (void)stream;
}

static const backend_t g_cpu_backend = {
    .device = DEV_CPU,
    .name = "cpu",
    .k = &g_cpu_kernels,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .memset_zero = cpu_memset_zero,
    .synchronize = cpu_synchronize,
    .set_stream = cpu_set_stream,
};

const backend_t *backend_cpu(void) { return &g_cpu_backend; }

void backend_cpu_set_threads(int n) {
    if (n <= 0)
        n = omp_get_num_procs();
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

int backend_cpu_threads(void) { return omp_get_max_threads(); }
