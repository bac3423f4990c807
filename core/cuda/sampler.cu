/* sampler: batched next-token sampling on CUDA, one block per row of logits.
 *
 * A row: a pass for the max (and the argmax, and NaN / +inf detection); a pass writing the
 * weights e = exp(z - max z) to scratch, summed in double for the log-sum-exp and in fixed
 * point for the draw. Without truncation the draw walks the ids in order: per-warp segment
 * sums, then one warp scans the segment that holds the target. With truncation every cut
 * is a prefix of the sorted order (weight descending, ties to the lower id), so each is
 * found by a radix select over the weights' bits (11, 11, 10 bits; histograms of counts or
 * of fixed-point mass) that returns the element where the count or mass accumulated in
 * sorted order first exceeds a bound; inside a group of equal weights the element follows
 * from the rank, counted in id order. Masses are integers, so every sum is exact and
 * independent of the order the threads add in.
 */
#include "core/cuda/cuda_common.h"
#include "core/rng_hd.h"
#include "core/cuda/sampler.h"

#define SMP_THREADS 512
#define SMP_WARPS (SMP_THREADS / 32)
#define SMP_BINS 2048 /* 11-bit digits */

typedef unsigned long long u64;

struct smp_shared {
    u64 hist[SMP_BINS]; /* radix pass: count or mass per digit */
    u64 seg[SMP_WARPS]; /* id-order walk: weight per warp segment */
    u64 shu[32];
    double shd[32];
    float shf[32];
    int shi[32];
    u64 above;   /* radix pass: weight of the digits above the chosen one */
    u64 base;    /* id-order walk: weight before the chosen segment */
    int digit;   /* radix pass: the chosen digit */
    int segment; /* id-order walk: the segment holding the target, -1 for none */
    int pick;    /* id-order walk: the element found */
};

/* A cut of the sorted order as one key: kept elements are those whose key is >= it. */
static __device__ __forceinline__ u64 sort_key(uint32_t ebits, uint32_t id) {
    return ((u64)ebits << 32) | (u64)(0xffffffffu - id);
}

/* The fixed-point mass of a weight e in [0, 1]. */
static __device__ __forceinline__ u64 fx_mass(float e, double scale) {
    return __double2ull_rn((double)e * scale);
}

/* z - m with z = l / T, as the CPU rounds it (no contraction). */
static __device__ __forceinline__ float scaled(float l, float T, float m) {
    return __fsub_rn(__fdiv_rn(l, T), m);
}

/* exp of a float, correctly rounded but in the rarest cases (a double exp rounded once). */
static __device__ __forceinline__ float exp_rn(float x) {
    return __double2float_rn(exp((double)x));
}

/* Which weight an id-order walk accumulates. */
enum { WALK_MASS = 0, WALK_EQUAL = 1 };

/* The first id j whose weight accumulated in id order exceeds x: weight fx_mass(e[j]) for
 * WALK_MASS, [bits(e[j]) == v] for WALK_EQUAL. -1 when the total is <= x. */
static __device__ int walk_ids(const float *e, int V, int mode, uint32_t v, double scale, u64 x,
                               smp_shared *s) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int seg = ((V + SMP_WARPS - 1) / SMP_WARPS + 31) & ~31;
    int lo = w * seg, hi = min(lo + seg, V);
    u64 acc = 0;
    for (int j = lo + lane; j < hi; j += 32)
        acc += mode == WALK_MASS ? fx_mass(e[j], scale) : (u64)(__float_as_uint(e[j]) == v);
    acc = warp_sum(acc);
    if (lane == 0)
        s->seg[w] = acc;
    __syncthreads();
    if (w == 0) {
        u64 inc = lane < SMP_WARPS ? s->seg[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            u64 t = __shfl_up_sync(FULL_MASK, inc, o);
            if (lane >= o)
                inc += t;
        }
        unsigned over = __ballot_sync(FULL_MASK, inc > x);
        int c = over ? __ffs((int)over) - 1 : -1;
        u64 before = __shfl_sync(FULL_MASK, inc, c > 0 ? c - 1 : 0);
        if (lane == 0) {
            s->segment = c;
            s->base = c > 0 ? before : 0;
            s->pick = -1;
        }
    }
    __syncthreads();
    if (w == s->segment) {
        u64 base = s->base;
        for (int j0 = lo; j0 < hi; j0 += 32) {
            int j = j0 + lane;
            u64 inc = 0;
            if (j < hi)
                inc = mode == WALK_MASS ? fx_mass(e[j], scale)
                                        : (u64)(__float_as_uint(e[j]) == v);
            for (int o = 1; o < 32; o <<= 1) {
                u64 t = __shfl_up_sync(FULL_MASK, inc, o);
                if (lane >= o)
                    inc += t;
            }
            unsigned over = __ballot_sync(FULL_MASK, base + inc > x);
            if (over) {
                if (lane == __ffs((int)over) - 1)
                    s->pick = j;
                break;
            }
            base += __shfl_sync(FULL_MASK, inc, 31);
        }
    }
    __syncthreads();
    return s->pick;
}

/* Warp 0 picks the digit, scanning the bins from the top, where above + the weight of the
 * bins down to it first exceeds x; the rest of the block waits at the next barrier. */
static __device__ void pick_digit(smp_shared *s, int nbins, u64 above, u64 x) {
    int lane = threadIdx.x & 31;
    int per = nbins / 32, top = nbins - lane * per; /* lane covers digits [top - per, top) */
    u64 own = 0;
    for (int d = top - 1; d >= top - per; d--)
        own += s->hist[d];
    u64 inc = own;
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o)
            inc += t;
    }
    unsigned over = __ballot_sync(FULL_MASK, above + inc > x);
    int c = over ? __ffs((int)over) - 1 : 31; /* none only if x >= the total: not called so */
    if (lane == c) {
        u64 acc = above + inc - own;
        int d = top - 1;
        for (; d > top - per; d--) {
            if (acc + s->hist[d] > x)
                break;
            acc += s->hist[d];
        }
        s->digit = d;
        s->above = acc;
    }
}

/* The element where the weight accumulated in sorted order first exceeds x (x below the
 * total): weight 1 per element (by_mass 0) or its fixed-point mass. Returns its key. */
static __device__ u64 select_sorted(const float *e, int V, int by_mass, double scale, u64 x,
                                    smp_shared *s) {
    uint32_t prefix = 0, mask = 0;
    u64 above = 0;
    for (int p = 0; p < 3; p++) { /* digits: bits 31..21, 20..10, 9..0 */
        int shift = p == 0 ? 21 : p == 1 ? 10 : 0, nbins = p < 2 ? 2048 : 1024;
        for (int i = threadIdx.x; i < nbins; i += blockDim.x)
            s->hist[i] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            uint32_t b = __float_as_uint(e[j]);
            if ((b & mask) == prefix)
                atomicAdd(&s->hist[(b >> shift) & (uint32_t)(nbins - 1)],
                          by_mass ? fx_mass(e[j], scale) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x < 32)
            pick_digit(s, nbins, above, x);
        __syncthreads();
        prefix |= (uint32_t)s->digit << shift;
        mask |= (uint32_t)(nbins - 1) << shift;
        above = s->above;
    }
    /* Every element of the group weighs the same: the rank inside it, in id order. */
    u64 each = by_mass ? fx_mass(__uint_as_float(prefix), scale) : 1ull;
    u64 rank = (x - above) / each;
    int id = walk_ids(e, V, WALK_EQUAL, prefix, 0.0, rank, s);
    return sort_key(prefix, (uint32_t)id);
}

/* The fixed-point mass of the elements whose key is >= cut. */
static __device__ u64 kept_mass(const float *e, int V, u64 cut, double scale, smp_shared *s) {
    u64 acc = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        if (sort_key(__float_as_uint(e[j]), (uint32_t)j) >= cut)
            acc += fx_mass(e[j], scale);
    return block_sum(acc, s->shu);
}

/* The element of a draw at bound x = floor(u * total) clamped below total. */
static __device__ __forceinline__ u64 draw_bound(double u, u64 total) {
    double t = floor(u * (double)total);
    u64 x = t >= (double)total ? total : (u64)t;
    return x < total ? x : total - 1;
}

/* The sampled id of a row with temperature > 0, its weights in e. */
static __device__ int sample_row(const float *e, int V, const cuda_sample_req_t *r, double u,
                                 double scale, u64 total, smp_shared *s) {
    int topk = r->top_k > 0 && r->top_k < V;
    if (!topk && r->top_p >= 1.0f && r->min_p <= 0.0f) /* no truncation: walk in id order */
        return walk_ids(e, V, WALK_MASS, 0u, scale, draw_bound(u, total), s);
    u64 cut = 0, mass = total;
    if (topk) {
        cut = select_sorted(e, V, 0, scale, (u64)(r->top_k - 1), s);
        mass = kept_mass(e, V, cut, scale, s);
    }
    if (r->top_p < 1.0f) { /* keep up to the first element whose mass reaches top_p * mass */
        u64 lim = (u64)ceil((double)r->top_p * (double)mass);
        lim = lim < 1 ? 1 : lim > mass ? mass : lim;
        u64 k = select_sorted(e, V, 1, scale, lim - 1, s);
        cut = k > cut ? k : cut;
    }
    if (r->min_p > 0.0f) {
        u64 k = sort_key(__float_as_uint(r->min_p), 0xffffffffu);
        cut = k > cut ? k : cut;
    }
    u64 kept = kept_mass(e, V, cut, scale, s);
    u64 k = select_sorted(e, V, 1, scale, draw_bound(u, kept), s);
    return (int)(0xffffffffu - (uint32_t)k);
}

static __device__ bool req_ok(const cuda_sample_req_t *r) {
    return isfinite(r->temperature) && r->temperature >= 0.0f && r->top_p > 0.0f &&
           r->top_p <= 1.0f && r->top_k >= 0 && r->min_p >= 0.0f && r->min_p < 1.0f;
}

/* Max, argmax (ties to the lower id) and whether a NaN or +inf is present. */
static __device__ void row_max(const float *l, int V, float *mx, int *amax, int *bad,
                               smp_shared *s) {
    float bv = -INFINITY;
    int bi = -1, b = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = l[j];
        b |= isnan(x) || x == INFINITY;
        if (bi < 0 || x > bv) { /* ascending j: the first of equal maxima stays */
            bv = x;
            bi = j;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
            bv = ov;
            bi = oi;
        }
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        s->shf[w] = bv;
        s->shi[w] = bi;
    }
    *bad = __syncthreads_or(b);
    if (threadIdx.x == 0) {
        for (int k = 1; k < SMP_WARPS; k++) {
            float ov = s->shf[k];
            int oi = s->shi[k];
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        s->shf[0] = bv;
        s->shi[0] = bi;
    }
    __syncthreads();
    *mx = s->shf[0];
    *amax = s->shi[0];
}

static __global__ void __launch_bounds__(SMP_THREADS)
    sample_kernel(int32_t *token, float *logp, int32_t *status, double *uout, const float *logits,
                  const cuda_sample_req_t *req, float *ework, int V, double scale) {
    __shared__ smp_shared s;
    size_t row = blockIdx.x;
    const float *l = logits + row * (size_t)V; /* (V) */
    float *e = ework + row * (size_t)V;        /* (V) */
    cuda_sample_req_t r = req[row];
    double u = rng_hd_sample_uniform(r.seed, r.request_id, r.sample_index, r.token_index);
    if (threadIdx.x == 0 && uout)
        uout[row] = u;
    int code = MO_OK;
    float mx;
    int amax, bad;
    row_max(l, V, &mx, &amax, &bad, &s);
    if (!req_ok(&r))
        code = MO_EINVAL;
    else if (bad || mx == -INFINITY)
        code = MO_EMALFORMED;
    if (code != MO_OK) {
        if (threadIdx.x == 0) {
            status[row] = code;
            token[row] = -1;
            logp[row] = NAN;
        }
        return;
    }
    int greedy = r.temperature == 0.0f;
    float T = greedy ? 1.0f : r.temperature;
    float m = mx / T;
    double sum = 0.0;
    u64 total = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float ej = exp_rn(scaled(l[j], T, m));
        sum += ej;
        if (!greedy) {
            e[j] = ej;
            total += fx_mass(ej, scale);
        }
    }
    sum = block_sum(sum, s.shd);
    double lz = (double)m + log(sum);
    int pick = amax;
    if (!greedy) {
        total = block_sum(total, s.shu);
        __syncthreads(); /* e written by every thread */
        pick = sample_row(e, V, &r, u, scale, total, &s);
    }
    if (threadIdx.x == 0) {
        status[row] = MO_OK;
        token[row] = pick;
        logp[row] = (float)((double)(greedy ? l[pick] : __fdiv_rn(l[pick], T)) - lz);
    }
}

/* Bits needed for V. */
static int bit_length(unsigned v) {
    int n = 0;
    for (; v; v >>= 1)
        n++;
    return n;
}

extern "C" int cuda_sample(int32_t *token, float *logp, int32_t *status, double *u,
                           const float *logits, const cuda_sample_req_t *req, int B, int V) {
    TRY(cuda_enter());
    if (B < 0 || V < 1)
        return mo_errorf(MO_EINVAL, "cuda_sample: bad shape B=%d V=%d (need B >= 0, V >= 1)", B,
                         V);
    if (B == 0)
        return MO_OK;
    if (!token || !logp || !status || !logits || !req)
        return mo_errorf(MO_EINVAL, "cuda_sample: token, logp, status, logits and req must "
                                    "all be device pointers (one is NULL)");
    float *e = (float *)cuda_scratch(CUDA_SCRATCH_SAMPLE, (size_t)B * (size_t)V * sizeof(float));
    if (!e)
        return mo_error_wrap(MO_EDEVICE, "cuda_sample: scratch for %d x %d weights", B, V);
    /* Masses in units of 2^-fb: V weights <= 1 sum below 2^62. */
    double scale = ldexp(1.0, 62 - bit_length((unsigned)V));
    sample_kernel<<<(unsigned)B, SMP_THREADS, 0, cuda_stream()>>>(token, logp, status, u, logits,
                                                                   req, e, V, scale);
    return LAUNCH_OK("sample_kernel") ? MO_OK : MO_EDEVICE;
}
