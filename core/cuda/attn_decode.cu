/* cuda attn_decode: decode attention over the paged KV cache on CUDA.
 *
 * One thread block per (row, kv head, split). It loads the G queries of its kv head into
 * shared memory and walks its positions in tiles of DEC_TILE, one position per thread:
 *   scores  thread t: s[g, t] = scale * q_g . k_t for the G heads (one pass over the key's
 *           column of the transposed block, each key element read once for DEC_GC heads);
 *   softmax warp w owns heads w, w + DEC_WARPS, ...: tile max, new running max m, the
 *           factor r = exp(m_old - m), p = exp(s - m) in place, running sum l = l r + sum p;
 *   values  thread d owns dimension d of the G outputs: o[g, d] = o[g, d] r_g +
 *           sum_t p[g, t] v_t[d], each value element read once for DEC_GC heads.
 * One split writes out = o / l; several write (o, m, l) per split and merge_kernel
 * combines them in split order. Every sum has a fixed order: deterministic.
 *
 * With new keys and values, the block whose range holds pos[i] stores its kv head's slot
 * first; a barrier then makes the store visible to the block's own reads (no other block
 * reads that slot: it belongs to row i's sequence alone). */
#include "core/cuda/attn_decode.h"

#include "core/cuda/cuda_common.h"

#define DEC_TILE 128 /* positions per tile: one per thread */
#define DEC_THREADS DEC_TILE
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_GC 8            /* query heads accumulated in registers at once */
#define DEC_MIN_CHUNK 256   /* the fewest positions a split is given (auto splits) */
#define DEC_MAX_SPLITS 1024 /* splits at most */
#define MERGE_THREADS 128

/* For functions returning a status: record the failed call and return MO_EDEVICE. */
#define DEC_TRY(call)                                                                              \
    do {                                                                                           \
        cudaError_t dec_e_ = (call);                                                               \
        if (dec_e_ != cudaSuccess)                                                                 \
            return cuda_fail(dec_e_, #call, __FILE__, __LINE__);                                   \
    } while (0)

typedef struct dec_args {
    float *out;            /* (N, H, Dh), when splits == 1 */
    float *opart;          /* (N, H, splits, Dh) unnormalised outputs, when splits > 1 */
    float *mlpart;         /* (N, H, splits, 2) running max and sum, when splits > 1 */
    const float *q;        /* (N, H, Dh) */
    const float *knew;     /* (N, Hkv, Dh) or NULL */
    const float *vnew;     /* (N, Hkv, Dh) or NULL */
    float *cache;          /* (L, NB, 2, BS Hkv Dh) */
    const int32_t *tables; /* (N, max_blocks) */
    const int32_t *pos;    /* (N) */
    size_t layer_off;      /* l NB 2 BS Hkv Dh: layer l's first block */
    size_t blk;            /* 2 BS Hkv Dh: one block's keys and values */
    size_t vals;           /* BS Hkv Dh: a block's values after its keys */
    int NB, BS, Hkv, Dh, H, G, max_blocks, splits, chunk, window;
    float scale;
} dec_args_t;

/* Dynamic shared memory of decode_kernel: vrow (DEC_TILE) offsets, then q (G, Dh),
 * o (G, Dh), s (G, DEC_TILE), m, l, r (G) floats. */
static size_t dec_smem(int G, int Dh) {
    return sizeof(size_t) * DEC_TILE +
           sizeof(float) * ((size_t)2 * G * Dh + (size_t)G * DEC_TILE + (size_t)3 * G);
}

static __global__ void __launch_bounds__(DEC_THREADS) decode_kernel(dec_args_t a) {
    extern __shared__ __align__(16) unsigned char dec_sh[];
    const int G = a.G, Dh = a.Dh, BS = a.BS, tid = threadIdx.x;
    size_t *vrow = (size_t *)dec_sh; /* (DEC_TILE) value row offsets of the tile */
    float *qs = (float *)(vrow + DEC_TILE);
    float *os = qs + (size_t)G * Dh;
    float *ss = os + (size_t)G * Dh;
    float *ms = ss + (size_t)G * DEC_TILE;
    float *ls = ms + G;
    float *rs = ls + G;

    int item = blockIdx.x;
    const int s = item % a.splits;
    item /= a.splits;
    const int kvh = item % a.Hkv, i = item / a.Hkv;
    const int32_t *tab = a.tables + (size_t)i * a.max_blocks;
    const size_t head0 = (size_t)i * a.H + (size_t)kvh * G; /* the row's first head here */

    /* A position outside the table or a block outside the cache: no memory touched. */
    int p = a.pos[i];
    int bad = p < 0 || p / BS >= a.max_blocks;
    p = bad ? 0 : p;
    const int lo = (a.window > 0 && p - a.window + 1 > 0) ? p - a.window + 1 : 0;
    for (int b = lo / BS + tid; !bad && b <= p / BS; b += DEC_THREADS)
        bad = tab[b] < 0 || tab[b] >= a.NB;
    if (__syncthreads_or(bad)) {
        for (int e = tid; e < G * Dh; e += DEC_THREADS) {
            if (a.splits == 1)
                a.out[head0 * Dh + e] = NAN;
            else
                a.opart[((head0 + e / Dh) * a.splits + s) * Dh + e % Dh] = NAN;
        }
        if (a.splits > 1 && tid < G) {
            a.mlpart[((head0 + tid) * a.splits + s) * 2] = NAN;
            a.mlpart[((head0 + tid) * a.splits + s) * 2 + 1] = NAN;
        }
        return;
    }

    /* This split's positions j_begin .. j_end (empty when j_begin > j_end). */
    const int j_begin = lo + s * a.chunk;
    const int j_end = p - j_begin >= a.chunk ? j_begin + a.chunk - 1 : p;

    if (a.knew && j_begin <= p && p <= j_end) {
        const size_t base = a.layer_off + (size_t)tab[p / BS] * a.blk;
        const size_t src = ((size_t)i * a.Hkv + kvh) * Dh;
        float *kt = a.cache + base + (size_t)kvh * Dh * BS + p % BS; /* column p % BS */
        float *vr = a.cache + base + a.vals + ((size_t)kvh * BS + p % BS) * Dh;
        for (int d = tid; d < Dh; d += DEC_THREADS) {
            kt[(size_t)d * BS] = a.knew[src + d];
            vr[d] = a.vnew[src + d];
        }
    }
    for (int e = tid; e < G * Dh; e += DEC_THREADS) {
        qs[e] = a.q[head0 * Dh + e];
        os[e] = 0.0f;
    }
    if (tid < G) {
        ms[tid] = -INFINITY;
        ls[tid] = 0.0f;
    }
    __syncthreads(); /* the store, q and the state */

    for (int j0 = j_begin; j0 <= j_end; j0 += DEC_TILE) {
        const int cnt = j_end - j0 + 1 < DEC_TILE ? j_end - j0 + 1 : DEC_TILE;
        /* scores: thread tid for position j0 + tid */
        if (tid < cnt) {
            const int j = j0 + tid;
            const size_t base = a.layer_off + (size_t)tab[j / BS] * a.blk;
            const float *kt = a.cache + base + (size_t)kvh * Dh * BS + j % BS;
            vrow[tid] = base + a.vals + ((size_t)kvh * BS + j % BS) * Dh;
            for (int g0 = 0; g0 < G; g0 += DEC_GC) {
                float acc[DEC_GC];
#pragma unroll
                for (int u = 0; u < DEC_GC; u++)
                    acc[u] = 0.0f;
                for (int d = 0; d < Dh; d++) {
                    const float kd = kt[(size_t)d * BS];
#pragma unroll
                    for (int u = 0; u < DEC_GC; u++)
                        if (g0 + u < G)
                            acc[u] += qs[(size_t)(g0 + u) * Dh + d] * kd;
                }
#pragma unroll
                for (int u = 0; u < DEC_GC; u++)
                    if (g0 + u < G)
                        ss[(size_t)(g0 + u) * DEC_TILE + tid] = a.scale * acc[u];
            }
        }
        __syncthreads();
        /* online softmax: warp w for heads w, w + DEC_WARPS, ... (lane 0 keeps the state) */
        {
            const int w = tid >> 5, lane = tid & 31;
            for (int g = w; g < G; g += DEC_WARPS) {
                float *sg = ss + (size_t)g * DEC_TILE;
                float mx = -INFINITY;
                for (int t = lane; t < cnt; t += 32)
                    mx = fmaxf(mx, sg[t]);
                mx = warp_max(mx);
                const float m_old = __shfl_sync(FULL_MASK, lane == 0 ? ms[g] : 0.0f, 0);
                const float m_new = fmaxf(m_old, mx);
                float sum = 0.0f;
                for (int t = lane; t < cnt; t += 32) {
                    const float e = expf(sg[t] - m_new);
                    sg[t] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    const float r = expf(m_old - m_new); /* 0 on the first tile */
                    ms[g] = m_new;
                    ls[g] = ls[g] * r + sum;
                    rs[g] = r;
                }
            }
        }
        __syncthreads();
        /* values: thread for dimension d of every head */
        for (int d = tid; d < Dh; d += DEC_THREADS) {
            for (int g0 = 0; g0 < G; g0 += DEC_GC) {
                float acc[DEC_GC];
#pragma unroll
                for (int u = 0; u < DEC_GC; u++)
                    acc[u] = 0.0f;
                for (int t = 0; t < cnt; t++) {
                    const float vd = a.cache[vrow[t] + d];
#pragma unroll
                    for (int u = 0; u < DEC_GC; u++)
                        if (g0 + u < G)
                            acc[u] += ss[(size_t)(g0 + u) * DEC_TILE + t] * vd;
                }
#pragma unroll
                for (int u = 0; u < DEC_GC; u++)
                    if (g0 + u < G) {
                        float *o = os + (size_t)(g0 + u) * Dh + d;
                        *o = *o * rs[g0 + u] + acc[u];
                    }
            }
        }
        __syncthreads(); /* before the next tile's scores and offsets */
    }

    /* Each thread writes the dimensions it accumulated (os) after the last barrier (ms, ls). */
    for (int d = tid; d < Dh; d += DEC_THREADS)
        for (int g = 0; g < G; g++) {
            if (a.splits == 1)
                a.out[(head0 + g) * Dh + d] = os[(size_t)g * Dh + d] / ls[g];
            else
                a.opart[((head0 + g) * a.splits + s) * Dh + d] = os[(size_t)g * Dh + d];
        }
    if (a.splits > 1 && tid < G) {
        a.mlpart[((head0 + tid) * a.splits + s) * 2] = ms[tid];
        a.mlpart[((head0 + tid) * a.splits + s) * 2 + 1] = ls[tid];
    }
}

/* out (N, H, Dh) from the splits' partial results, one block per (row, head): M the max
 * of the splits' maxima, w_s = exp(m_s - M), out = sum_s w_s o_s / sum_s w_s l_s, summed in
 * split order. An empty split (m -inf, l 0, o 0) adds nothing; NaN propagates. */
static __global__ void __launch_bounds__(MERGE_THREADS)
    merge_kernel(float *out, const float *opart, const float *mlpart, int splits, int Dh) {
    extern __shared__ float mg_w[]; /* (splits) */
    const size_t ih = blockIdx.x;
    const float *ml = mlpart + ih * splits * 2;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++)
        M = fmaxf(M, ml[2 * s]);
    for (int s = threadIdx.x; s < splits; s += MERGE_THREADS)
        mg_w[s] = expf(ml[2 * s] - M);
    __syncthreads();
    float L = 0.0f;
    for (int s = 0; s < splits; s++)
        L += mg_w[s] * ml[2 * s + 1];
    const float *o = opart + ih * splits * Dh;
    for (int d = threadIdx.x; d < Dh; d += MERGE_THREADS) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++)
            acc += mg_w[s] * o[(size_t)s * Dh + d];
        out[ih * Dh + d] = acc / L;
    }
}

/* The splits for rows of at most ctx positions over `items` (row, kv head) blocks: enough
 * blocks for two per multiprocessor, each split DEC_MIN_CHUNK positions or more. */
static int auto_splits(int ctx, long long items) {
    long long want = (2LL * cuda_sm_count() + items - 1) / items;
    long long most = ((long long)ctx + DEC_MIN_CHUNK - 1) / DEC_MIN_CHUNK;
    long long n = want < most ? want : most;
    if (n > DEC_MAX_SPLITS)
        n = DEC_MAX_SPLITS;
    return n < 1 ? 1 : (int)n;
}

extern "C" int cuda_attn_decode(float *out, const float *q, const float *k_new, const float *v_new,
                                float *cache, int L, int NB, int BS, int Hkv, int Dh, int l,
                                const int32_t *block_tables, int max_blocks, const int32_t *pos,
                                int N, int H, float scale, int window, int splits) {
    TRY(cuda_enter());
    if (N < 0 || L < 1 || NB < 1 || BS < 1 || Hkv < 1 || Dh < 1 || l < 0 || l >= L ||
        max_blocks < 1 || H < 1 || H % Hkv != 0 || window < 0 || splits < 0)
        return mo_errorf(MO_EINVAL,
                         "cuda_attn_decode: bad shape N=%d L=%d NB=%d BS=%d Hkv=%d Dh=%d l=%d "
                         "max_blocks=%d H=%d window=%d splits=%d (need N >= 0, sizes >= 1, "
                         "0 <= l < L, H a multiple of Hkv, window and splits >= 0)",
                         N, L, NB, BS, Hkv, Dh, l, max_blocks, H, window, splits);
    if (N == 0)
        return MO_OK;
    if (!out || !q || !cache || !block_tables || !pos || (!k_new) != (!v_new))
        return mo_errorf(MO_EINVAL, "cuda_attn_decode: out, q, cache, block_tables and pos must "
                                    "be device pointers and k_new, v_new both given or both "
                                    "NULL");
    const int G = H / Hkv;
    const long long ctx_max = (long long)max_blocks * BS;
    const long long items = (long long)N * Hkv;
    if (ctx_max > INT32_MAX / 2 || (long long)N * H > INT32_MAX)
        return mo_errorf(MO_EINVAL,
                         "cuda_attn_decode: N=%d rows of H=%d heads or max_blocks=%d blocks of "
                         "BS=%d tokens are too many (need N H < 2^31, max_blocks BS < 2^30)",
                         N, H, max_blocks, BS);
    /* Positions a row attends to at most. */
    const int ctx = (int)(window > 0 && window < ctx_max ? window : ctx_max);
    int ns = splits ? splits : auto_splits(ctx, items);
    if (ns > ctx)
        ns = ctx; /* every split gets a position */
    if (ns > DEC_MAX_SPLITS)
        ns = DEC_MAX_SPLITS;
    int chunk = (ctx + ns - 1) / ns;
    if (splits == 0) { /* whole tiles per split */
        chunk = (chunk + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
        ns = (ctx + chunk - 1) / chunk;
    }
    if (items * ns > INT32_MAX)
        return mo_errorf(MO_EINVAL, "cuda_attn_decode: %lld blocks of %d splits exceed the grid",
                         items * ns, ns);
    const size_t smem = dec_smem(G, Dh);
    if (smem > cuda_smem_optin())
        return mo_errorf(MO_EUNSUPPORTED,
                         "cuda_attn_decode: %d query heads per kv head of dim %d need %zu bytes "
                         "of shared memory, a block may have %zu",
                         G, Dh, smem, cuda_smem_optin());
    if (smem > 48 * 1024)
        DEC_TRY(cudaFuncSetAttribute(decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));

    dec_args_t a;
    a.out = out;
    a.opart = NULL;
    a.mlpart = NULL;
    a.q = q;
    a.knew = k_new;
    a.vnew = v_new;
    a.cache = cache;
    a.tables = block_tables;
    a.pos = pos;
    a.vals = (size_t)BS * (size_t)Hkv * (size_t)Dh;
    a.blk = 2 * a.vals;
    a.layer_off = (size_t)l * (size_t)NB * a.blk;
    a.NB = NB;
    a.BS = BS;
    a.Hkv = Hkv;
    a.Dh = Dh;
    a.H = H;
    a.G = G;
    a.max_blocks = max_blocks;
    a.splits = ns;
    a.chunk = chunk;
    a.window = window;
    a.scale = scale;
    cudaStream_t st = cuda_stream();
    if (ns > 1) {
        const size_t heads = (size_t)N * (size_t)H * (size_t)ns;
        float *part = (float *)cuda_scratch(CUDA_SCRATCH_ATT, sizeof(float) * heads * (Dh + 2));
        if (!part)
            return mo_error_wrap(MO_EDEVICE, "cuda_attn_decode: scratch for %d splits", ns);
        a.opart = part;
        a.mlpart = part + heads * Dh;
    }
    decode_kernel<<<(unsigned)(items * ns), DEC_THREADS, smem, st>>>(a);
    TRY(cuda_launched("launch of decode_kernel", __FILE__, __LINE__));
    if (ns > 1) {
        merge_kernel<<<(unsigned)(N * H), MERGE_THREADS, sizeof(float) * ns, st>>>(
            out, a.opart, a.mlpart, ns, Dh);
        TRY(cuda_launched("launch of merge_kernel", __FILE__, __LINE__));
    }
    return MO_OK;
}

/* One thread per element (row, kv head, dimension) of k and v. */
static __global__ void store_kernel(float *cache, const float *k, const float *v,
                                    const int32_t *slot, size_t layer_off, size_t blk, size_t vals,
                                    int BS, int Hkv, int Dh, long long nslots, long long n) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(e % Dh);
        const long long ih = e / Dh;
        const int h = (int)(ih % Hkv);
        const long long i = ih / Hkv;
        const int32_t sl = slot[i];
        if (sl < 0 || sl >= nslots)
            continue;
        const size_t base = layer_off + (size_t)(sl / BS) * blk;
        const int p = sl % BS;
        cache[base + ((size_t)h * Dh + d) * BS + p] = k[e];
        cache[base + vals + ((size_t)h * BS + p) * Dh + d] = v[e];
    }
}

extern "C" int cuda_kv_store(float *cache, const float *k, const float *v, int L, int NB, int BS,
                             int Hkv, int Dh, int l, const int32_t *slot, int N) {
    TRY(cuda_enter());
    if (N < 0 || L < 1 || NB < 1 || BS < 1 || Hkv < 1 || Dh < 1 || l < 0 || l >= L)
        return mo_errorf(MO_EINVAL,
                         "cuda_kv_store: bad shape N=%d L=%d NB=%d BS=%d Hkv=%d Dh=%d l=%d (need "
                         "N >= 0, sizes >= 1, 0 <= l < L)",
                         N, L, NB, BS, Hkv, Dh, l);
    if (N == 0)
        return MO_OK;
    if (!cache || !k || !v || !slot)
        return mo_errorf(MO_EINVAL, "cuda_kv_store: cache, k, v and slot must be device pointers");
    const size_t vals = (size_t)BS * Hkv * Dh, blk = 2 * vals;
    const long long n = (long long)N * Hkv * Dh;
    store_kernel<<<cuda_grid((size_t)n, 256), 256, 0, cuda_stream()>>>(
        cache, k, v, slot, (size_t)l * NB * blk, blk, vals, BS, Hkv, Dh, (long long)NB * BS, n);
    return cuda_launched("launch of store_kernel", __FILE__, __LINE__);
}

/* One thread per float of the block in every layer (layer: NB blk floats apart). */
static __global__ void copy_block_kernel(float *cache, size_t layer, size_t blk, size_t src,
                                         size_t dst, long long n) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const size_t l = (size_t)e / blk, j = (size_t)e % blk;
        cache[l * layer + dst * blk + j] = cache[l * layer + src * blk + j];
    }
}

extern "C" int cuda_kv_copy_block(float *cache, int L, int NB, size_t blk, int src, int dst) {
    TRY(cuda_enter());
    if (!cache || L < 1 || NB < 1 || blk < 1 || src < 0 || src >= NB || dst < 0 || dst >= NB)
        return mo_errorf(MO_EINVAL,
                         "cuda_kv_copy_block: blocks %d -> %d of a cache of L=%d NB=%d blocks of "
                         "%zu floats (need a cache and both blocks in [0, NB))",
                         src, dst, L, NB, blk);
    if (src == dst)
        return MO_OK;
    /* A kernel, not cudaMemcpy2DAsync: a layer of a large cache is more bytes apart than
     * the copy's largest pitch allows. */
    const long long n = (long long)L * (long long)blk;
    copy_block_kernel<<<cuda_grid((size_t)n, 256), 256, 0, cuda_stream()>>>(
        cache, (size_t)NB * blk, blk, (size_t)src, (size_t)dst, n);
    return cuda_launched("launch of copy_block_kernel", __FILE__, __LINE__);
}
