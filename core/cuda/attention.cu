/* attention: causal grouped-query attention over packed sequences on CUDA,
 * flash-style: no (T, T) matrix is stored, the forward keeps each row's
 * log-sum-exp and the backward recomputes probabilities from it:
 *   D_i = dout_i . out_i,  dS_ij = P_ij (dout_i . v_j - D_i),
 *   dq_i += scale sum_j dS_ij k_j,  dk_j += scale sum_i dS_ij q_i,  dv_j += sum_i P_ij dout_i.
 *
 * Work is cut into tiles of ATT_TILE rows of one sequence. A tile prefix over
 * cu_seqlens is computed on the device, so no sequence length is read on the
 * host. Each block loops over (tile, head) items; every item owns the rows it
 * writes (query rows for out, lse and dq; key rows of one kv head for dk and
 * dv, summing its query heads in order), so there are no atomics and results
 * do not depend on scheduling. Inside an item a warp owns ATT_RPW rows and
 * the other side is streamed through shared memory ATT_KB rows at a time,
 * one per lane. f32 throughout (CUDA cores); head dim up to ATT_MAX_DH.
 */
#include "core/cuda/cuda_common.h"

#define ATT_TILE 16                    /* rows an item owns */
#define ATT_WARPS 4                    /* warps per block */
#define ATT_RPW (ATT_TILE / ATT_WARPS) /* owned rows per warp */
#define ATT_KB 32                      /* streamed rows per step, one per lane */
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_MAX_DH 256
#define PREFIX_THREADS 256

typedef struct att_geom {
    const int32_t *cu;    /* (B + 1) */
    const int32_t *pre;   /* (B + 1): tiles before each sequence; pre[B] in all */
    int B, H, Hkv, G, Dh; /* G = H / Hkv */
    float scale;
    int window; /* 0: unlimited */
} att_geom_t;

/* pre (B + 1): pre[0] = 0, pre[b + 1] = pre[b] + ceil(len_b / ATT_TILE). One
 * block: each thread sums a run of sequences, then a shared-memory scan. */
static __global__ void tile_prefix_kernel(int32_t *pre, const int32_t *cu, int B, int *flag) {
    __shared__ int sh[PREFIX_THREADS];
    int t = threadIdx.x;
    int per = (B + PREFIX_THREADS - 1) / PREFIX_THREADS;
    int b0 = t * per, b1 = min(b0 + per, B);
    int sum = 0;
    for (int b = b0; b < b1; b++) {
        int len = cu[b + 1] - cu[b];
        if (len < 0) {
            cuda_flag_set(flag, CUDA_FLAG_CU_SEQLENS);
            len = 0;
        }
        sum += (len + ATT_TILE - 1) / ATT_TILE;
    }
    sh[t] = sum;
    __syncthreads();
    for (int off = 1; off < PREFIX_THREADS; off <<= 1) {
        int add = t >= off ? sh[t - off] : 0;
        __syncthreads();
        sh[t] += add;
        __syncthreads();
    }
    int base = t > 0 ? sh[t - 1] : 0;
    if (t == 0)
        pre[0] = 0;
    for (int b = b0; b < b1; b++) {
        int len = max(cu[b + 1] - cu[b], 0);
        base += (len + ATT_TILE - 1) / ATT_TILE;
        pre[b + 1] = base;
    }
}

/* The sequence holding tile f: the largest b with pre[b] <= f. */
static __device__ int seq_of_tile(const int32_t *pre, int B, int f) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (pre[mid] <= f)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* First key that query i of a sequence starting at s0 sees. */
static __device__ __forceinline__ int first_key(int window, int s0, int i) {
    return (window > 0 && i - s0 >= window) ? i - window + 1 : s0;
}

/* Last query of a sequence ending before s1 that sees key j. */
static __device__ __forceinline__ int last_query(int window, int s1, int j) {
    return (window > 0 && s1 - 1 - j >= window) ? j + window - 1 : s1 - 1;
}

static __device__ __forceinline__ bool visible(int window, int i, int j) {
    return j <= i && (window <= 0 || i - j < window);
}

/* Rows [r0, r0 + n) of a (T, heads, Dh) tensor at head hh into dst (rows, ld),
 * zeros for rows >= n, by the whole block. */
static __device__ __forceinline__ void stage_rows(float *dst, int ld, int rows, const float *src,
                                                  size_t stride, int hh, int r0, int n, int Dh) {
    for (int e = threadIdx.x; e < rows * Dh; e += blockDim.x) {
        int r = e / Dh, d = e - r * Dh;
        dst[r * ld + d] = r < n ? src[(size_t)(r0 + r) * stride + (size_t)hh * Dh + d] : 0.0f;
    }
}

/* ---- forward: an item is ATT_TILE query rows of one head ---- */

template <int NP>
static __global__ void __launch_bounds__(ATT_THREADS)
    att_forward_kernel(float *out, float *lse, const float *q, const float *k, const float *v,
                       att_geom_t a) {
    extern __shared__ float sm[];
    const int Dh = a.Dh, ks = Dh | 1; /* odd stride: lane-per-row reads hit distinct banks */
    float *Qs = sm;                   /* (ATT_TILE, Dh) */
    float *Ks = Qs + ATT_TILE * Dh;   /* (ATT_KB, ks) */
    float *Vs = Ks + ATT_KB * ks;     /* (ATT_KB, Dh) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t sq = (size_t)a.H * Dh, skv = (size_t)a.Hkv * Dh;
    const long long items = (long long)a.pre[a.B] * a.H;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        long long it = items - 1 - w; /* later tiles see more keys: start them first */
        int h = (int)(it % a.H), f = (int)(it / a.H);
        int b = seq_of_tile(a.pre, a.B, f);
        int s0 = a.cu[b], s1 = a.cu[b + 1];
        int i0 = s0 + (f - a.pre[b]) * ATT_TILE, i1 = min(i0 + ATT_TILE, s1), nq = i1 - i0;
        int kvh = h / a.G;
        __syncthreads(); /* the previous item is done with shared memory */
        stage_rows(Qs, Dh, ATT_TILE, q, sq, h, i0, nq, Dh);
        float m[ATT_RPW], l[ATT_RPW], o[ATT_RPW][NP];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            m[rr] = -INFINITY;
            l[rr] = 0.0f;
#pragma unroll
            for (int p = 0; p < NP; p++)
                o[rr][p] = 0.0f;
        }
        int jlo = first_key(a.window, s0, i0), jhi = i1 - 1;
        for (int j0 = jlo; j0 <= jhi; j0 += ATT_KB) {
            int nk = min(ATT_KB, jhi + 1 - j0);
            __syncthreads(); /* Qs staged; the previous keys consumed */
            stage_rows(Ks, ks, ATT_KB, k, skv, kvh, j0, nk, Dh);
            stage_rows(Vs, Dh, ATT_KB, v, skv, kvh, j0, nk, Dh);
            __syncthreads();
            float s[ATT_RPW];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; rr++)
                s[rr] = 0.0f;
            const float *kr = Ks + lane * ks; /* this lane's key */
            for (int d = 0; d < Dh; d++) {
                float kd = kr[d];
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++)
                    s[rr] += Qs[(warp * ATT_RPW + rr) * Dh + d] * kd;
            }
            float p[ATT_RPW];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; rr++) {
                int r = warp * ATT_RPW + rr;
                bool ok = r < nq && lane < nk && visible(a.window, i0 + r, j0 + lane);
                float sc = ok ? a.scale * s[rr] : -INFINITY;
                float mt = warp_max(sc); /* the same in every lane */
                p[rr] = 0.0f;
                if (mt != -INFINITY) {
                    float mn = fmaxf(m[rr], mt);
                    float alpha = expf(m[rr] - mn); /* 0 on the first visible tile */
                    p[rr] = ok ? expf(sc - mn) : 0.0f;
                    l[rr] = l[rr] * alpha + warp_sum(p[rr]);
#pragma unroll
                    for (int pp = 0; pp < NP; pp++)
                        o[rr][pp] *= alpha;
                    m[rr] = mn;
                }
            }
            for (int jj = 0; jj < nk; jj++) {
                float vv[NP];
#pragma unroll
                for (int pp = 0; pp < NP; pp++) {
                    int d = lane + 32 * pp;
                    vv[pp] = d < Dh ? Vs[jj * Dh + d] : 0.0f;
                }
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++) {
                    float pj = __shfl_sync(FULL_MASK, p[rr], jj);
#pragma unroll
                    for (int pp = 0; pp < NP; pp++)
                        o[rr][pp] += pj * vv[pp];
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp * ATT_RPW + rr;
            if (r >= nq)
                continue;
            size_t row = (size_t)(i0 + r);
            float inv = 1.0f / l[rr];
#pragma unroll
            for (int pp = 0; pp < NP; pp++) {
                int d = lane + 32 * pp;
                if (d < Dh)
                    out[row * sq + (size_t)h * Dh + d] = o[rr][pp] * inv;
            }
            if (lane == 0)
                lse[row * a.H + h] = m[rr] + logf(l[rr]);
        }
    }
}

/* ---- backward dq: an item is ATT_TILE query rows of one head ---- */

template <int NP>
static __global__ void __launch_bounds__(ATT_THREADS)
    att_dq_kernel(float *dq, const float *dout, const float *q, const float *k, const float *v,
                  const float *out, const float *lse, att_geom_t a) {
    extern __shared__ float sm[];
    const int Dh = a.Dh, ks = Dh | 1;
    float *Qs = sm;                 /* (ATT_TILE, Dh) */
    float *Gs = Qs + ATT_TILE * Dh; /* (ATT_TILE, Dh) dout rows */
    float *Ks = Gs + ATT_TILE * Dh; /* (ATT_KB, ks) */
    float *Vs = Ks + ATT_KB * ks;   /* (ATT_KB, ks) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t sq = (size_t)a.H * Dh, skv = (size_t)a.Hkv * Dh;
    const long long items = (long long)a.pre[a.B] * a.H;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        long long it = items - 1 - w;
        int h = (int)(it % a.H), f = (int)(it / a.H);
        int b = seq_of_tile(a.pre, a.B, f);
        int s0 = a.cu[b], s1 = a.cu[b + 1];
        int i0 = s0 + (f - a.pre[b]) * ATT_TILE, i1 = min(i0 + ATT_TILE, s1), nq = i1 - i0;
        int kvh = h / a.G;
        __syncthreads();
        stage_rows(Qs, Dh, ATT_TILE, q, sq, h, i0, nq, Dh);
        stage_rows(Gs, Dh, ATT_TILE, dout, sq, h, i0, nq, Dh);
        float Dr[ATT_RPW], Lr[ATT_RPW], acc[ATT_RPW][NP];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp * ATT_RPW + rr;
            float part = 0.0f;
            if (r < nq) {
                size_t base = (size_t)(i0 + r) * sq + (size_t)h * Dh;
                for (int d = lane; d < Dh; d += 32)
                    part += dout[base + d] * out[base + d];
            }
            Dr[rr] = warp_sum(part);
            Lr[rr] = r < nq ? lse[(size_t)(i0 + r) * a.H + h] : 0.0f;
#pragma unroll
            for (int pp = 0; pp < NP; pp++)
                acc[rr][pp] = 0.0f;
        }
        for (int j0 = first_key(a.window, s0, i0); j0 < i1; j0 += ATT_KB) {
            int nk = min(ATT_KB, i1 - j0);
            __syncthreads();
            stage_rows(Ks, ks, ATT_KB, k, skv, kvh, j0, nk, Dh);
            stage_rows(Vs, ks, ATT_KB, v, skv, kvh, j0, nk, Dh);
            __syncthreads();
            float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; rr++)
                s[rr] = dp[rr] = 0.0f;
            const float *kr = Ks + lane * ks, *vr = Vs + lane * ks; /* this lane's key */
            for (int d = 0; d < Dh; d++) {
                float kd = kr[d], vd = vr[d];
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++) {
                    int off = (warp * ATT_RPW + rr) * Dh + d;
                    s[rr] += Qs[off] * kd;
                    dp[rr] += Gs[off] * vd;
                }
            }
            float ds[ATT_RPW];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; rr++) {
                int r = warp * ATT_RPW + rr;
                bool ok = r < nq && lane < nk && visible(a.window, i0 + r, j0 + lane);
                float pr = ok ? expf(a.scale * s[rr] - Lr[rr]) : 0.0f;
                ds[rr] = ok ? pr * (dp[rr] - Dr[rr]) : 0.0f;
            }
            for (int jj = 0; jj < nk; jj++) {
                float kv[NP];
#pragma unroll
                for (int pp = 0; pp < NP; pp++) {
                    int d = lane + 32 * pp;
                    kv[pp] = d < Dh ? Ks[jj * ks + d] : 0.0f;
                }
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++) {
                    float dsj = __shfl_sync(FULL_MASK, ds[rr], jj);
#pragma unroll
                    for (int pp = 0; pp < NP; pp++)
                        acc[rr][pp] += dsj * kv[pp];
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp * ATT_RPW + rr;
            if (r >= nq)
                continue;
            size_t base = (size_t)(i0 + r) * sq + (size_t)h * Dh;
#pragma unroll
            for (int pp = 0; pp < NP; pp++) {
                int d = lane + 32 * pp;
                if (d < Dh)
                    dq[base + d] += a.scale * acc[rr][pp];
            }
        }
    }
}

/* ---- backward dk, dv: an item is ATT_TILE key rows of one kv head ---- */

template <int NP>
static __global__ void __launch_bounds__(ATT_THREADS)
    att_dkdv_kernel(float *dk, float *dv, const float *dout, const float *q, const float *k,
                    const float *v, const float *out, const float *lse, att_geom_t a) {
    extern __shared__ float sm[];
    const int Dh = a.Dh, ks = Dh | 1;
    float *Ks = sm;                 /* (ATT_TILE, Dh) */
    float *Vs = Ks + ATT_TILE * Dh; /* (ATT_TILE, Dh) */
    float *Qs = Vs + ATT_TILE * Dh; /* (ATT_KB, ks) */
    float *Gs = Qs + ATT_KB * ks;   /* (ATT_KB, ks) dout rows */
    float *Ls = Gs + ATT_KB * ks;   /* (ATT_KB) lse of the staged queries */
    float *Ds = Ls + ATT_KB;        /* (ATT_KB) dout . out of the staged queries */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t sq = (size_t)a.H * Dh, skv = (size_t)a.Hkv * Dh;
    const long long items = (long long)a.pre[a.B] * a.Hkv;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        int kvh = (int)(w % a.Hkv), f = (int)(w / a.Hkv); /* early keys (more queries) first */
        int b = seq_of_tile(a.pre, a.B, f);
        int s0 = a.cu[b], s1 = a.cu[b + 1];
        int j0 = s0 + (f - a.pre[b]) * ATT_TILE, j1 = min(j0 + ATT_TILE, s1), nk = j1 - j0;
        __syncthreads();
        stage_rows(Ks, Dh, ATT_TILE, k, skv, kvh, j0, nk, Dh);
        stage_rows(Vs, Dh, ATT_TILE, v, skv, kvh, j0, nk, Dh);
        float ak[ATT_RPW][NP], av[ATT_RPW][NP];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++)
#pragma unroll
            for (int pp = 0; pp < NP; pp++)
                ak[rr][pp] = av[rr][pp] = 0.0f;
        int ilast = last_query(a.window, s1, j1 - 1);
        for (int g = 0; g < a.G; g++) {
            int h = kvh * a.G + g;
            for (int qi0 = j0; qi0 <= ilast; qi0 += ATT_KB) {
                int nq = min(ATT_KB, ilast + 1 - qi0);
                __syncthreads(); /* keys staged; the previous queries consumed */
                stage_rows(Qs, ks, ATT_KB, q, sq, h, qi0, nq, Dh);
                stage_rows(Gs, ks, ATT_KB, dout, sq, h, qi0, nq, Dh);
                for (int r = warp; r < ATT_KB; r += ATT_WARPS) {
                    float part = 0.0f;
                    if (r < nq) {
                        size_t base = (size_t)(qi0 + r) * sq + (size_t)h * Dh;
                        for (int d = lane; d < Dh; d += 32)
                            part += dout[base + d] * out[base + d];
                    }
                    part = warp_sum(part);
                    if (lane == 0) {
                        Ds[r] = part;
                        Ls[r] = r < nq ? lse[(size_t)(qi0 + r) * a.H + h] : 0.0f;
                    }
                }
                __syncthreads();
                float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++)
                    s[rr] = dp[rr] = 0.0f;
                const float *qr = Qs + lane * ks, *gr = Gs + lane * ks; /* this lane's query */
                for (int d = 0; d < Dh; d++) {
                    float qd = qr[d], gd = gr[d];
#pragma unroll
                    for (int rr = 0; rr < ATT_RPW; rr++) {
                        int off = (warp * ATT_RPW + rr) * Dh + d;
                        s[rr] += qd * Ks[off];
                        dp[rr] += gd * Vs[off];
                    }
                }
                float p[ATT_RPW], ds[ATT_RPW];
                int i = qi0 + lane;
#pragma unroll
                for (int rr = 0; rr < ATT_RPW; rr++) {
                    int kr = warp * ATT_RPW + rr;
                    bool ok = lane < nq && kr < nk && visible(a.window, i, j0 + kr);
                    float pr = ok ? expf(a.scale * s[rr] - Ls[lane]) : 0.0f;
                    p[rr] = pr;
                    ds[rr] = ok ? pr * (dp[rr] - Ds[lane]) : 0.0f;
                }
                for (int r = 0; r < nq; r++) {
                    float qv[NP], gv[NP];
#pragma unroll
                    for (int pp = 0; pp < NP; pp++) {
                        int d = lane + 32 * pp;
                        qv[pp] = d < Dh ? Qs[r * ks + d] : 0.0f;
                        gv[pp] = d < Dh ? Gs[r * ks + d] : 0.0f;
                    }
#pragma unroll
                    for (int rr = 0; rr < ATT_RPW; rr++) {
                        float pr = __shfl_sync(FULL_MASK, p[rr], r);
                        float dsr = __shfl_sync(FULL_MASK, ds[rr], r);
#pragma unroll
                        for (int pp = 0; pp < NP; pp++) {
                            av[rr][pp] += pr * gv[pp];
                            ak[rr][pp] += dsr * qv[pp];
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int kr = warp * ATT_RPW + rr;
            if (kr >= nk)
                continue;
            size_t base = (size_t)(j0 + kr) * skv + (size_t)kvh * Dh;
#pragma unroll
            for (int pp = 0; pp < NP; pp++) {
                int d = lane + 32 * pp;
                if (d >= Dh)
                    continue;
                if (dk)
                    dk[base + d] += a.scale * ak[rr][pp];
                if (dv)
                    dv[base + d] += av[rr][pp];
            }
        }
    }
}

/* ---- host side ---- */

static size_t fwd_smem(int Dh) {
    return sizeof(float) *
           ((size_t)ATT_TILE * Dh + (size_t)ATT_KB * (Dh | 1) + (size_t)ATT_KB * Dh);
}

static size_t dq_smem(int Dh) {
    return sizeof(float) * (2 * (size_t)ATT_TILE * Dh + 2 * (size_t)ATT_KB * (Dh | 1));
}

static size_t dkdv_smem(int Dh) {
    return sizeof(float) *
           (2 * (size_t)ATT_TILE * Dh + 2 * (size_t)ATT_KB * (Dh | 1) + 2 * (size_t)ATT_KB);
}

/* Validates the geometry; records and returns an error. */
static int att_check(const char *op, int B, int H, int Hkv, int Dh, int window) {
    if (B < 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || Dh <= 0 || window < 0)
        return cuda_record(MO_EINVAL, "%s: bad geometry B=%d H=%d Hkv=%d Dh=%d window=%d", op, B, H,
                           Hkv, Dh, window);
    if (Dh > ATT_MAX_DH)
        return cuda_record(MO_EUNSUPPORTED, "%s: head dim %d is above the CUDA kernels' %d", op, Dh,
                           ATT_MAX_DH);
    return MO_OK;
}

/* The geometry with its tile prefix computed on the stream; pre NULL after
 * recording an error. */
static att_geom_t att_geom(const int32_t *cu, int B, int H, int Hkv, int Dh, float scale,
                           int window) {
    att_geom_t a;
    a.cu = cu, a.B = B, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.Dh = Dh;
    a.scale = scale, a.window = window;
    int32_t *pre = (int32_t *)cuda_scratch(CUDA_SCRATCH_ATT, ((size_t)B + 1) * sizeof(int32_t));
    a.pre = pre;
    if (!pre)
        return a;
    tile_prefix_kernel<<<1, PREFIX_THREADS, 0, cuda_stream()>>>(pre, cu, B, cuda_flag());
    if (!LAUNCH_OK("tile_prefix_kernel"))
        a.pre = NULL;
    return a;
}

/* Grid of a persistent kernel: as many blocks as fit on the device at once.
 * Raises the kernel's dynamic shared memory limit first. */
static int persistent_grid(const void *kernel, size_t smem, unsigned *grid) {
    if (smem > cuda_smem_optin())
        return cuda_record(MO_EUNSUPPORTED,
                           "attention: %zu bytes of shared memory needed, the device allows %zu",
                           smem, cuda_smem_optin());
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaFuncSetAttribute", __FILE__, __LINE__);
    int per_sm = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ATT_THREADS, smem);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", __FILE__, __LINE__);
    *grid = (unsigned)((per_sm > 0 ? per_sm : 1) * cuda_sm_count());
    return MO_OK;
}

template <int NP>
static void launch_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                           const att_geom_t &a) {
    size_t smem = fwd_smem(a.Dh);
    unsigned grid = 0;
    if (persistent_grid((const void *)att_forward_kernel<NP>, smem, &grid) < 0)
        return;
    att_forward_kernel<NP><<<grid, ATT_THREADS, smem, cuda_stream()>>>(out, lse, q, k, v, a);
    LAUNCH_CHECK("att_forward_kernel");
}

template <int NP>
static void launch_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *out, const float *lse,
                            const att_geom_t &a) {
    unsigned grid = 0;
    if (dk || dv) {
        size_t smem = dkdv_smem(a.Dh);
        if (persistent_grid((const void *)att_dkdv_kernel<NP>, smem, &grid) < 0)
            return;
        att_dkdv_kernel<NP>
            <<<grid, ATT_THREADS, smem, cuda_stream()>>>(dk, dv, dout, q, k, v, out, lse, a);
        LAUNCH_CHECK("att_dkdv_kernel");
    }
    if (dq) {
        size_t smem = dq_smem(a.Dh);
        if (persistent_grid((const void *)att_dq_kernel<NP>, smem, &grid) < 0)
            return;
        att_dq_kernel<NP>
            <<<grid, ATT_THREADS, smem, cuda_stream()>>>(dq, dout, q, k, v, out, lse, a);
        LAUNCH_CHECK("att_dq_kernel");
    }
}

/* Registers per lane for a head dim: Dh <= 32 * NP. */
static int lanes_np(int Dh) {
    return Dh <= 32 ? 1 : Dh <= 64 ? 2 : Dh <= 128 ? 4 : 8;
}

extern "C" void cuda_attention_forward(float *out, float *lse, const float *q, const float *k,
                                       const float *v, const int32_t *cu_seqlens, int B, int H,
                                       int Hkv, int Dh, float scale, int window) {
    if (cuda_enter() < 0 || att_check("attention_forward", B, H, Hkv, Dh, window) < 0 || B == 0)
        return;
    att_geom_t a = att_geom(cu_seqlens, B, H, Hkv, Dh, scale, window);
    if (!a.pre)
        return;
    switch (lanes_np(Dh)) {
    case 1: launch_forward<1>(out, lse, q, k, v, a); break;
    case 2: launch_forward<2>(out, lse, q, k, v, a); break;
    case 4: launch_forward<4>(out, lse, q, k, v, a); break;
    default: launch_forward<8>(out, lse, q, k, v, a); break;
    }
}

extern "C" void cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                        const float *q, const float *k, const float *v,
                                        const float *out, const float *lse,
                                        const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh,
                                        float scale, int window) {
    if (cuda_enter() < 0 || att_check("attention_backward", B, H, Hkv, Dh, window) < 0 || B == 0)
        return;
    if (!dq && !dk && !dv)
        return;
    att_geom_t a = att_geom(cu_seqlens, B, H, Hkv, Dh, scale, window);
    if (!a.pre)
        return;
    switch (lanes_np(Dh)) {
    case 1: launch_backward<1>(dq, dk, dv, dout, q, k, v, out, lse, a); break;
    case 2: launch_backward<2>(dq, dk, dv, dout, q, k, v, out, lse, a); break;
    case 4: launch_backward<4>(dq, dk, dv, dout, q, k, v, out, lse, a); break;
    default: launch_backward<8>(dq, dk, dv, dout, q, k, v, out, lse, a); break;
    }
}
