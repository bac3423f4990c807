/* backend_cuda: the CUDA backend: device binding, a caching device-memory
 * pool, copies, per-thread streams, cuBLAS handles and kernel scratch, and
 * error capture for the kernel table (core/kernels.h).
 *
 * Memory: alloc/free go through a pool of cudaMalloc blocks kept by size
 * class; free() makes a block reusable at once. Work already queued on the
 * calling thread's stream stays ordered before any later use on that stream;
 * a block another stream still reads must be synchronised before it is freed
 * (the rule of cudaFreeAsync).
 *
 * Streams: set_stream sets the calling thread's stream; scratch buffers and
 * the cuBLAS workspace belong to a (thread, stream) pair, so threads and
 * streams never share one. A stream handed to set_stream must stay alive
 * while this thread uses it.
 */
#include <mutex>
#include <unordered_map>
#include <vector>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/cuda/cuda_common.h"

/* Streams per thread that keep their own scratch; the oldest is dropped
 * (after a device synchronisation) when a thread uses more. */
#define TLS_SETS 8
/* The cuBLAS workspace per (thread, stream): what NVIDIA advises for Hopper. */
#define BLAS_WORKSPACE ((size_t)32 << 20)

typedef struct pool {
    std::mutex mu;
    std::unordered_map<void *, size_t> live;                /* block -> class size */
    std::unordered_map<size_t, std::vector<void *>> cached; /* class size -> free blocks */
    size_t reserved, in_use;
    uint64_t device_allocs, allocs;
} pool_t;

static struct cuda_global {
    std::once_flag once;
    std::mutex sel_mu;
    int requested; /* ordinal asked for by backend_cuda_select_device */
    int inited, ok, init_code;
    char init_msg[512];
    int dev;
    char name[256];
    int cc_major, cc_minor, sm_count;
    size_t total_mem, l2_bytes, smem_optin;
    int *flag_host, *flag_dev; /* mapped pinned int: the device error flag */
    std::mutex err_mu;
    int err_code; /* pending error, 0 when none */
    char err_msg[1024];
    pool_t pool;
} g;

/* ---- errors ---- */

static int cuda_status(cudaError_t e, const char *call, const char *file, int line) {
    return mo_errorf(MO_EDEVICE, "%.*s failed: %s (%s) at %s:%d", (int)strcspn(call, "("), call,
                     cudaGetErrorString(e), cudaGetErrorName(e), file, line);
}

/* For functions that return a status: set the message, do not record. */
#define CUDA_TRY(call)                                                                             \
    do {                                                                                           \
        cudaError_t cuda_e_ = (call);                                                              \
        if (cuda_e_ != cudaSuccess)                                                                \
            return cuda_status(cuda_e_, #call, __FILE__, __LINE__);                                \
    } while (0)

int cuda_record(int code, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    {
        std::lock_guard<std::mutex> lk(g.err_mu);
        if (g.err_code == 0) {
            g.err_code = code;
            snprintf(g.err_msg, sizeof g.err_msg, "%s", buf);
        }
    }
    return mo_errorf(code, "%s", buf);
}

int cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
    return cuda_record(MO_EDEVICE, "%.*s failed: %s (%s) at %s:%d", (int)strcspn(call, "("), call,
                       cudaGetErrorString(e), cudaGetErrorName(e), file, line);
}

int cublas_fail(cublasStatus_t s, const char *call, const char *file, int line) {
    return cuda_record(MO_EDEVICE, "%.*s failed: %s (%s) at %s:%d", (int)strcspn(call, "("), call,
                       cublasGetStatusString(s), cublasGetStatusName(s), file, line);
}

static const char *flag_message(int code) {
    switch (code) {
    case CUDA_FLAG_EMBEDDING_ID:
        return "embedding: a token id is negative (ids index rows of the embedding table)";
    case CUDA_FLAG_LOGPROB_TARGET: return "logprob: a target is outside [0, V)";
    case CUDA_FLAG_CU_SEQLENS:
        return "attention: cu_seqlens decreases (every sequence length must be >= 0)";
    case CUDA_FLAG_TOPK_INDEX: return "topk_backward: an index is outside [0, C)";
    case CUDA_FLAG_MOE_EXPERT: return "moe dispatch plan: an expert index is outside [0, E)";
    default: return "a kernel reported an unknown error code";
    }
}

/* Moves a code left in the device error flag into the pending error. */
static void take_flag(void) {
    if (!g.flag_host)
        return;
    int c = *(volatile int *)g.flag_host;
    if (c != 0) {
        *(volatile int *)g.flag_host = 0;
        cuda_record(MO_EINVAL, "%s (code %d)", flag_message(c), c);
    }
}

/* ---- the pool ---- */

/* Class sizes: multiples of 512 bytes below 1 MiB, of 2 MiB above. */
static size_t size_class(size_t n) {
    const size_t small = 512, large = (size_t)2 << 20;
    if (n == 0)
        n = 1;
    if (n < ((size_t)1 << 20))
        return (n + small - 1) / small * small;
    return (n + large - 1) / large * large;
}

/* Returns every cached block to CUDA after the device is idle (callers may
 * have freed blocks that queued work still uses). Holds pool.mu. */
static void release_cached_locked(void) {
    cudaDeviceSynchronize();
    for (auto &kv : g.pool.cached) {
        for (void *p : kv.second) {
            cudaFree(p);
            g.pool.reserved -= kv.first;
        }
        kv.second.clear();
    }
    cudaGetLastError(); /* errors here are not the caller's */
}

int cuda_pool_alloc(void **out, size_t bytes) {
    *out = NULL;
    TRY(cuda_enter());
    size_t cls = size_class(bytes);
    std::lock_guard<std::mutex> lk(g.pool.mu);
    auto it = g.pool.cached.find(cls);
    void *p = NULL;
    if (it != g.pool.cached.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
    } else {
        cudaError_t e = cudaMalloc(&p, cls);
        if (e == cudaErrorMemoryAllocation) {
            cudaGetLastError();
            release_cached_locked();
            e = cudaMalloc(&p, cls);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            return mo_errorf(e == cudaErrorMemoryAllocation ? MO_ENOMEM : MO_EDEVICE,
                             "cannot allocate %zu bytes on cuda:%d: cudaMalloc failed: %s (%zu "
                             "bytes held by the pool, %zu in use)",
                             bytes, g.dev, cudaGetErrorString(e), g.pool.reserved, g.pool.in_use);
        }
        g.pool.reserved += cls;
        g.pool.device_allocs++;
    }
    g.pool.live[p] = cls;
    g.pool.in_use += cls;
    g.pool.allocs++;
    *out = p;
    return MO_OK;
}

void cuda_pool_free(void *p) {
    if (!p)
        return;
    std::lock_guard<std::mutex> lk(g.pool.mu);
    auto it = g.pool.live.find(p);
    if (it == g.pool.live.end()) {
        cuda_record(MO_EINVAL, "free: %p was not allocated by the CUDA backend (or freed twice)",
                    p);
        return;
    }
    g.pool.cached[it->second].push_back(p);
    g.pool.in_use -= it->second;
    g.pool.live.erase(it);
}

/* ---- per-thread state ---- */

typedef struct scratch_set {
    cudaStream_t stream;
    int used;
    void *buf[CUDA_SCRATCH_SLOTS + 1]; /* the last one is the cuBLAS workspace */
    size_t cap[CUDA_SCRATCH_SLOTS + 1];
} scratch_set_t;

struct cuda_tls {
    int bound; /* cudaSetDevice done on this thread */
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaStream_t blas_stream;
    int blas_ready; /* blas bound to blas_stream and its workspace */
    scratch_set_t sets[TLS_SETS];
    int next_evict;
    ~cuda_tls();
};

static thread_local cuda_tls t_tls;

static void set_release(scratch_set_t *s) {
    for (int i = 0; i <= CUDA_SCRATCH_SLOTS; i++) {
        cuda_pool_free(s->buf[i]);
        s->buf[i] = NULL;
        s->cap[i] = 0;
    }
    s->used = 0;
}

/* A thread that ends returns its scratch once the device is idle. Errors are
 * ignored: at process exit the runtime may already be gone. */
cuda_tls::~cuda_tls() {
    int any = blas != NULL;
    for (int i = 0; i < TLS_SETS; i++)
        any |= sets[i].used;
    if (!any)
        return;
    if (cudaDeviceSynchronize() == cudaSuccess) {
        for (int i = 0; i < TLS_SETS; i++)
            if (sets[i].used)
                set_release(&sets[i]);
        if (blas)
            cublasDestroy(blas);
    }
    blas = NULL;
    cudaGetLastError();
}

int cuda_enter(void) {
    if (t_tls.bound)
        return MO_OK;
    cudaError_t e = cudaSetDevice(g.dev);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaSetDevice", __FILE__, __LINE__);
    t_tls.bound = 1;
    return MO_OK;
}

cudaStream_t cuda_stream(void) {
    return t_tls.stream;
}

int *cuda_flag(void) {
    return g.flag_dev;
}

int cuda_sm_count(void) {
    return g.sm_count;
}

size_t cuda_smem_optin(void) {
    return g.smem_optin;
}

/* The scratch set of the thread's current stream; NULL after recording an
 * error. */
static scratch_set_t *stream_set(cuda_tls *t) {
    for (int i = 0; i < TLS_SETS; i++)
        if (t->sets[i].used && t->sets[i].stream == t->stream)
            return &t->sets[i];
    scratch_set_t *s = NULL;
    for (int i = 0; i < TLS_SETS && !s; i++)
        if (!t->sets[i].used)
            s = &t->sets[i];
    if (!s) {
        s = &t->sets[t->next_evict];
        t->next_evict = (t->next_evict + 1) % TLS_SETS;
        cudaError_t e = cudaDeviceSynchronize(); /* the old stream may be gone */
        if (e != cudaSuccess) {
            cuda_fail(e, "cudaDeviceSynchronize", __FILE__, __LINE__);
            return NULL;
        }
        if (t->blas_stream == s->stream)
            t->blas_ready = 0; /* its workspace goes with the set */
        set_release(s);
    }
    s->used = 1;
    s->stream = t->stream;
    return s;
}

static void *set_slot(scratch_set_t *s, int slot, size_t bytes) {
    if (s->buf[slot] && s->cap[slot] >= bytes)
        return s->buf[slot];
    if (s->buf[slot]) {
        cudaError_t e = cudaStreamSynchronize(s->stream);
        if (e != cudaSuccess) {
            cuda_fail(e, "cudaStreamSynchronize", __FILE__, __LINE__);
            return NULL;
        }
        cuda_pool_free(s->buf[slot]);
        s->buf[slot] = NULL;
    }
    size_t want = bytes > s->cap[slot] + s->cap[slot] / 2 ? bytes : s->cap[slot] + s->cap[slot] / 2;
    void *p = NULL;
    int rc = cuda_pool_alloc(&p, want);
    if (rc < 0) {
        cuda_record(rc, "kernel scratch: %s", mo_last_error());
        s->cap[slot] = 0;
        return NULL;
    }
    s->buf[slot] = p;
    s->cap[slot] = want;
    return p;
}

void *cuda_scratch(int slot, size_t bytes) {
    if (cuda_enter() < 0)
        return NULL;
    scratch_set_t *s = stream_set(&t_tls);
    return s ? set_slot(s, slot, bytes) : NULL;
}

cublasHandle_t cuda_blas(void) {
    cuda_tls *t = &t_tls;
    if (cuda_enter() < 0)
        return NULL;
    if (!t->blas) {
        cublasStatus_t st = cublasCreate(&t->blas);
        if (st != CUBLAS_STATUS_SUCCESS) {
            t->blas = NULL;
            cublas_fail(st, "cublasCreate", __FILE__, __LINE__);
            return NULL;
        }
        t->blas_ready = 0;
        /* No TF32: f32 products keep f32 accuracy. */
        st = cublasSetMathMode(t->blas, CUBLAS_DEFAULT_MATH);
        if (st != CUBLAS_STATUS_SUCCESS) {
            cublas_fail(st, "cublasSetMathMode", __FILE__, __LINE__);
            return NULL;
        }
    }
    if (!t->blas_ready || t->blas_stream != t->stream) {
        scratch_set_t *s = stream_set(t);
        void *ws = s ? set_slot(s, CUDA_SCRATCH_SLOTS, BLAS_WORKSPACE) : NULL;
        if (!ws)
            return NULL;
        cublasStatus_t st = cublasSetStream(t->blas, t->stream);
        if (st == CUBLAS_STATUS_SUCCESS) /* SetStream resets the workspace: set it after */
            st = cublasSetWorkspace(t->blas, ws, BLAS_WORKSPACE);
        if (st != CUBLAS_STATUS_SUCCESS) {
            cublas_fail(st, "cublasSetStream/cublasSetWorkspace", __FILE__, __LINE__);
            return NULL;
        }
        t->blas_stream = t->stream;
        t->blas_ready = 1;
    }
    return t->blas;
}

/* ---- the backend's memory operations ---- */

static int cu_alloc(const backend_t *be, void **ptr, size_t bytes) {
    (void)be;
    return cuda_pool_alloc(ptr, bytes);
}

static void cu_free(const backend_t *be, void *ptr) {
    (void)be;
    cuda_pool_free(ptr);
}

static int cu_copy(const backend_t *be, void *dst, device_t dst_dev, const void *src,
                   device_t src_dev, size_t bytes) {
    (void)be;
    if ((dst_dev != DEV_CPU && dst_dev != DEV_CUDA) || (src_dev != DEV_CPU && src_dev != DEV_CUDA))
        return mo_errorf(MO_EINVAL, "cuda backend: cannot copy %s -> %s", device_name(src_dev),
                         device_name(dst_dev));
    if (bytes == 0)
        return MO_OK;
    if (dst_dev == DEV_CPU && src_dev == DEV_CPU) {
        memmove(dst, src, bytes);
        return MO_OK;
    }
    TRY(cuda_enter());
    cudaMemcpyKind kind = dst_dev == DEV_CUDA ? (src_dev == DEV_CUDA ? cudaMemcpyDeviceToDevice
                                                                     : cudaMemcpyHostToDevice)
                                              : cudaMemcpyDeviceToHost;
    cudaStream_t st = t_tls.stream;
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind, st));
    /* Host buffers are free to reuse (and read) when copy returns. */
    if (kind != cudaMemcpyDeviceToDevice)
        CUDA_TRY(cudaStreamSynchronize(st));
    return MO_OK;
}

static int cu_memset_zero(const backend_t *be, void *ptr, size_t bytes) {
    (void)be;
    if (bytes == 0)
        return MO_OK;
    TRY(cuda_enter());
    CUDA_TRY(cudaMemsetAsync(ptr, 0, bytes, t_tls.stream));
    return MO_OK;
}

/* Waits for the thread's stream, then returns (and clears) the first error
 * recorded since the last call, from any thread. */
static int cu_synchronize(const backend_t *be) {
    (void)be;
    if (cuda_enter() == MO_OK) {
        cudaError_t e = cudaStreamSynchronize(t_tls.stream);
        if (e != cudaSuccess)
            cuda_fail(e, "cudaStreamSynchronize", __FILE__, __LINE__);
    }
    take_flag();
    int code;
    char msg[sizeof g.err_msg];
    {
        std::lock_guard<std::mutex> lk(g.err_mu);
        code = g.err_code;
        memcpy(msg, g.err_msg, sizeof msg);
        g.err_code = 0;
        g.err_msg[0] = '\0';
    }
    if (code != 0)
        return mo_errorf(code, "%s", msg);
    return MO_OK;
}

void *backend_cuda_stream(void) {
    return (void *)t_tls.stream;
}

extern "C" int backend_cuda_stream_new(void **out) {
    *out = NULL;
    TRY(cuda_enter());
    CUDA_TRY(cudaDeviceSynchronize());
    cudaStream_t st = NULL;
    CUDA_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    *out = (void *)st;
    return MO_OK;
}

extern "C" void backend_cuda_stream_free(void *stream) {
    if (!stream || cuda_enter() < 0)
        return;
    cudaStream_t st = (cudaStream_t)stream;
    cudaError_t e = cudaStreamSynchronize(st);
    if (e == cudaSuccess)
        e = cudaStreamDestroy(st);
    if (e != cudaSuccess)
        cuda_fail(e, "cudaStreamDestroy", __FILE__, __LINE__);
}

extern "C" uint64_t backend_cuda_memory_epoch(void) {
    std::lock_guard<std::mutex> lk(g.pool.mu);
    return g.pool.allocs;
}

struct cuda_graph {
    cudaGraphExec_t exec;
};

/* Whether no error was recorded when this thread's capture began: a capture that fails
 * records the failing call's error, which belongs to the capture alone and is dropped
 * with it. */
static thread_local int t_capture_clean;

static int errors_recorded(void) {
    std::lock_guard<std::mutex> lk(g.err_mu);
    return g.err_code != 0;
}

/* Drops what a failed capture recorded (when nothing was recorded before it). */
static void drop_capture_errors(void) {
    cudaGetLastError();
    if (!t_capture_clean)
        return;
    std::lock_guard<std::mutex> lk(g.err_mu);
    g.err_code = 0;
    g.err_msg[0] = '\0';
}

extern "C" int backend_cuda_capture_begin(void) {
    TRY(cuda_enter());
    if (!t_tls.stream)
        return mo_errorf(MO_EUNSUPPORTED,
                         "cuda graphs: the default stream cannot be captured (set a stream)");
    t_capture_clean = !errors_recorded();
    cudaError_t e = cudaStreamBeginCapture(t_tls.stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        drop_capture_errors();
        return mo_errorf(MO_EDEVICE, "cuda graphs: cudaStreamBeginCapture: %s",
                         cudaGetErrorString(e));
    }
    return MO_OK;
}

extern "C" int backend_cuda_capture_end(cuda_graph_t **out, int discard) {
    *out = NULL;
    TRY(cuda_enter());
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(t_tls.stream, &graph);
    if (discard) {
        if (graph)
            cudaGraphDestroy(graph);
        drop_capture_errors();
        return MO_OK;
    }
    if (e != cudaSuccess) {
        drop_capture_errors(); /* the capture's error is reported here, not left for later */
        if (graph)
            cudaGraphDestroy(graph);
        return mo_errorf(MO_EDEVICE, "cuda graphs: cudaStreamEndCapture: %s",
                         cudaGetErrorString(e));
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        drop_capture_errors();
        return mo_errorf(MO_EDEVICE, "cuda graphs: cudaGraphInstantiate: %s",
                         cudaGetErrorString(e));
    }
    cuda_graph_t *g = (cuda_graph_t *)calloc(1, sizeof *g);
    if (!g) {
        cudaGraphExecDestroy(exec);
        return mo_errorf(MO_ENOMEM, "cuda graphs: out of memory");
    }
    g->exec = exec;
    *out = g;
    return MO_OK;
}

extern "C" int backend_cuda_graph_launch(const cuda_graph_t *g) {
    TRY(cuda_enter());
    CUDA_TRY(cudaGraphLaunch(g->exec, t_tls.stream));
    return MO_OK;
}

extern "C" void backend_cuda_graph_free(cuda_graph_t *g) {
    if (!g)
        return;
    cudaGraphExecDestroy(g->exec);
    free(g);
}

static void cu_set_stream(const backend_t *be, void *stream) {
    (void)be;
    t_tls.stream = (cudaStream_t)stream;
}

/* ---- the backend ---- */

/* Positional: the order of kernels_t in core/kernels.h. */
static const kernels_t g_cuda_kernels = {
    cuda_matmul_forward,     cuda_matmul_backward,  cuda_embedding_forward,
    cuda_embedding_backward, cuda_rmsnorm_forward,  cuda_rmsnorm_backward,
    cuda_rope_forward,       cuda_rope_backward,    cuda_attention_forward,
    cuda_attention_backward, cuda_swiglu_forward,   cuda_swiglu_backward,
    cuda_softmax_forward,    cuda_softmax_backward, cuda_topk_forward,
    cuda_topk_backward,      cuda_logprob_forward,  cuda_logprob_backward,
    cuda_adamw_update,
};

static const backend_t g_cuda_backend = {
    DEV_CUDA, "cuda",         &g_cuda_kernels, cu_alloc,      cu_free,
    cu_copy,  cu_memset_zero, cu_synchronize,  cu_set_stream,
};

static void init_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void init_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.init_msg, sizeof g.init_msg, fmt, ap);
    va_end(ap);
    g.init_code = code;
    cudaGetLastError();
}

static int dev_attr(cudaDeviceAttr a, int *out) {
    cudaError_t e = cudaDeviceGetAttribute(out, a, g.dev);
    if (e != cudaSuccess) {
        init_fail(MO_EDEVICE, "cudaDeviceGetAttribute(%d) failed on cuda:%d: %s", (int)a, g.dev,
                  cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

static void init_once(void) {
    std::lock_guard<std::mutex> lk(g.sel_mu);
    g.inited = 1;
    g.dev = g.requested;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        init_fail(MO_EDEVICE, "no usable CUDA device: cudaGetDeviceCount failed: %s (%s)",
                  cudaGetErrorString(e), cudaGetErrorName(e));
        return;
    }
    if (n == 0) {
        init_fail(MO_EDEVICE, "no CUDA device present");
        return;
    }
    if (g.dev >= n) {
        init_fail(MO_EDEVICE, "CUDA device %d requested but only %d present", g.dev, n);
        return;
    }
    e = cudaSetDevice(g.dev);
    cudaDeviceProp p;
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&p, g.dev);
    if (e != cudaSuccess) {
        init_fail(MO_EDEVICE, "cannot use CUDA device %d: %s", g.dev, cudaGetErrorString(e));
        return;
    }
    snprintf(g.name, sizeof g.name, "%s", p.name);
    g.total_mem = p.totalGlobalMem;
    int v = 0;
    if (dev_attr(cudaDevAttrComputeCapabilityMajor, &g.cc_major) < 0 ||
        dev_attr(cudaDevAttrComputeCapabilityMinor, &g.cc_minor) < 0 ||
        dev_attr(cudaDevAttrMultiProcessorCount, &g.sm_count) < 0 ||
        dev_attr(cudaDevAttrL2CacheSize, &v) < 0)
        return;
    g.l2_bytes = (size_t)v;
    if (dev_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &v) < 0)
        return;
    g.smem_optin = (size_t)v;
    e = cudaHostAlloc((void **)&g.flag_host, sizeof(int), cudaHostAllocMapped);
    if (e == cudaSuccess) {
        *(volatile int *)g.flag_host = 0;
        e = cudaHostGetDevicePointer((void **)&g.flag_dev, g.flag_host, 0);
    }
    if (e != cudaSuccess) {
        init_fail(MO_EDEVICE, "cannot map the error flag on cuda:%d: %s", g.dev,
                  cudaGetErrorString(e));
        return;
    }
    t_tls.bound = 1;
    g.ok = 1;
}

extern "C" const backend_t *backend_cuda(void) {
    std::call_once(g.once, init_once);
    if (!g.ok) {
        mo_errorf(g.init_code, "%s", g.init_msg);
        return NULL;
    }
    return &g_cuda_backend;
}

extern "C" int backend_cuda_select_device(int ordinal) {
    if (ordinal < 0)
        return mo_errorf(MO_EINVAL, "CUDA device ordinal must be >= 0 (got %d)", ordinal);
    std::lock_guard<std::mutex> lk(g.sel_mu);
    if (g.inited && g.dev != ordinal)
        return mo_errorf(MO_ESTATE, "the CUDA backend is already bound to device %d (asked %d)",
                         g.dev, ordinal);
    g.requested = ordinal;
    return MO_OK;
}

extern "C" void backend_cuda_pool_stats(cuda_pool_stats_t *s) {
    std::lock_guard<std::mutex> lk(g.pool.mu);
    s->reserved = g.pool.reserved;
    s->in_use = g.pool.in_use;
    s->device_allocs = g.pool.device_allocs;
    s->allocs = g.pool.allocs;
}

extern "C" int backend_cuda_device_info(cuda_device_info_t *info) {
    if (!backend_cuda())
        return MO_EDEVICE;
    memset(info, 0, sizeof *info);
    info->ordinal = g.dev;
    snprintf(info->name, sizeof info->name, "%s", g.name);
    info->cc_major = g.cc_major;
    info->cc_minor = g.cc_minor;
    info->sm_count = g.sm_count;
    info->total_mem = g.total_mem;
    info->l2_bytes = g.l2_bytes;
    info->smem_optin = g.smem_optin;
    return MO_OK;
}
