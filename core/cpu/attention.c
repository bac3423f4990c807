/* attention: causal grouped-query attention over packed sequences on the CPU.
 *
 * Forward keeps each softmax row's log-sum-exp; backward recomputes the
 * probabilities from it block by block (the flash-attention recipe):
 *   D_i = dout_i . out_i,  dS_ij = P_ij (dout_i . v_j - D_i),
 *   dq_i += scale sum_j dS_ij k_j,  dk_j += scale sum_i dS_ij q_i,  dv_j += sum_i P_ij dout_i.
 * Work is cut into blocks of ATT_BLK rows. Every block owns the rows it writes
 * (query blocks for out and dq, key blocks of a kv head for dk and dv, summing
 * the query heads of its group in a fixed order), so results are the same
 * bits on any number of threads.
 * The products (Q K^T, P V, dO V^T, dS K, P^T dO, dS^T Q) all run through one
 * register-blocked kernel, mm_acc, compiled for AVX-512, AVX2+FMA and the
 * baseline; it skips the part of each product that the causal mask and the
 * window make zero.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/status.h"

#define ATT_BLK 32  /* rows per query block and key block */
#define ATT_QCH 128 /* query rows per chunk of the dk/dv pass */
#define MR 4        /* rows of a micro-tile of mm_acc */
#define NR 16       /* columns of a micro-tile: one AVX-512 or two AVX2 registers */
#define NOLIM (INT_MAX / 4)

/* The hot loops are compiled for AVX-512 and AVX2+FMA as well as the baseline,
 * and the loader picks one (GCC function multi-versioning on x86-64). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT_KERNEL                                                                                 \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"),                   \
                   optimize("fp-contract=fast")))
#define INLINE_HOT __attribute__((always_inline)) inline
#else
#define HOT_KERNEL
#define INLINE_HOT inline
#endif

typedef struct att_args {
    float *out, *lse_out;        /* forward outputs: (T, H, Dh), (T, H) */
    float *dq, *dk, *dv;         /* (T, H, Dh), (T, Hkv, Dh), (T, Hkv, Dh); may be NULL */
    const float *q, *k, *v;      /* (T, H, Dh), (T, Hkv, Dh), (T, Hkv, Dh) */
    const float *o, *dout, *lse; /* backward inputs: (T, H, Dh), (T, H, Dh), (T, H) */
    float *dsum;                 /* backward: D_i = dout_i . out_i, (T, H) */
    const int32_t *cu;           /* (B + 1) */
    int B, H, Hkv, G, Dh;        /* G = H / Hkv query heads per kv head */
    size_t sq, skv;              /* row strides: H * Dh and Hkv * Dh */
    float scale;
    int window; /* 0: unlimited */
} att_args_t;

static inline int imin(int a, int b) {
    return a < b ? a : b;
}

/* The geometry of a call; the caller fills in the tensors it uses. */
static att_args_t args_make(const int32_t *cu, int B, int H, int Hkv, int Dh, float scale,
                            int window) {
    MO_ASSERT(B >= 0 && H > 0 && Hkv > 0 && H % Hkv == 0 && Dh > 0 && window >= 0);
    att_args_t a;
    memset(&a, 0, sizeof a);
    a.cu = cu, a.B = B, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.Dh = Dh;
    a.sq = (size_t)H * Dh, a.skv = (size_t)Hkv * Dh;
    a.scale = scale, a.window = window;
    return a;
}

/* First key that query i of a sequence starting at s0 sees. */
static inline int first_key(const att_args_t *a, int s0, int i) {
    return (a->window > 0 && i - s0 >= a->window) ? i - a->window + 1 : s0;
}

/* Last query of a sequence ending before s1 that sees key j. */
static inline int last_query(const att_args_t *a, int s1, int j) {
    return (a->window > 0 && s1 - 1 - j >= a->window) ? j + a->window - 1 : s1 - 1;
}

/* First key that query i sees, whatever its sequence (the caller clamps it
 * to the sequence's first key). */
static inline int first_key_of(const att_args_t *a, int i) {
    return a->window > 0 ? i - a->window + 1 : INT_MIN / 2;
}

static inline const float *qrow(const att_args_t *a, const float *base, int i, int h) {
    return base + (size_t)i * a->sq + (size_t)h * a->Dh;
}

static inline const float *kvrow(const att_args_t *a, const float *base, int j, int kvh) {
    return base + (size_t)j * a->skv + (size_t)kvh * a->Dh;
}

/* The part of a product that can be nonzero: for the rows r0 .. r0+mr-1 of a
 * micro-tile, inner index k in [r0 + klo, r0 + mr + khi) and column c in
 * [r0 + clo, r0 + mr + chi) (columns widened to whole micro-tiles). */
typedef struct band {
    int klo, khi, clo, chi;
} band_t;

static inline int imax(int a, int b) {
    return a > b ? a : b;
}

static inline int round_up(int n, int m) {
    return (n + m - 1) / m * m;
}

/* Rows are queries q0 + r, the keys k0 + c (off = q0 - k0) are the columns
 * (cols) or the inner index: row r sees c <= r + off and, with a window W,
 * c >= r + off - W + 1. */
static band_t band_queries(const att_args_t *a, int off, int cols) {
    int lo = a->window > 0 ? off - a->window + 1 : -NOLIM;
    band_t b = {-NOLIM, NOLIM, -NOLIM, NOLIM};
    if (cols)
        b.clo = lo, b.chi = off;
    else
        b.klo = lo, b.khi = off;
    return b;
}

/* Rows are keys k0 + c, the inner index queries q0 + i (off = q0 - k0): key c
 * is seen by i >= c - off and, with a window W, i <= c - off + W - 1. */
static band_t band_keys(const att_args_t *a, int off) {
    int hi = a->window > 0 ? a->window - 1 - off : NOLIM;
    band_t b = {-off, hi, -NOLIM, NOLIM};
    return b;
}

/* One row: o[c] (+)= sum_{k0 <= k < k1} a[k * ak] b[k * ldb + c] for c0 <= c < c1. */
static INLINE_HOT void mm_row(float *restrict o, const float *restrict a, size_t ak,
                              const float *restrict b, size_t ldb, int k0, int k1, int c0, int c1,
                              int zero) {
    int c = c0;
    for (; c + NR <= c1; c += NR) {
        float p[NR];
        for (int t = 0; t < NR; t++)
            p[t] = zero ? 0.0f : o[c + t];
        for (int k = k0; k < k1; k++) {
            const float *restrict bk = b + (size_t)k * ldb + c;
            float x = a[(size_t)k * ak];
#pragma omp simd
            for (int t = 0; t < NR; t++)
                p[t] += x * bk[t];
        }
        for (int t = 0; t < NR; t++)
            o[c + t] = p[t];
    }
    for (; c < c1; c++) {
        float s = zero ? 0.0f : o[c];
        for (int k = k0; k < k1; k++)
            s += a[(size_t)k * ak] * b[(size_t)k * ldb + c];
        o[c] = s;
    }
}

/* MR rows by NR columns from c: accumulators stay in registers over k. */
static INLINE_HOT void mm_tile(float *restrict o, size_t ldc, const float *restrict a, size_t ar,
                               size_t ak, const float *restrict b, size_t ldb, int k0, int k1,
                               int c, int zero) {
    float p0[NR], p1[NR], p2[NR], p3[NR];
    float *o0 = o + c, *o1 = o0 + ldc, *o2 = o1 + ldc, *o3 = o2 + ldc;
    for (int t = 0; t < NR; t++) {
        p0[t] = zero ? 0.0f : o0[t];
        p1[t] = zero ? 0.0f : o1[t];
        p2[t] = zero ? 0.0f : o2[t];
        p3[t] = zero ? 0.0f : o3[t];
    }
    for (int k = k0; k < k1; k++) {
        const float *restrict bk = b + (size_t)k * ldb + c;
        const float *ak0 = a + (size_t)k * ak;
        float x0 = ak0[0], x1 = ak0[ar], x2 = ak0[2 * ar], x3 = ak0[3 * ar];
#pragma omp simd
        for (int t = 0; t < NR; t++) {
            float y = bk[t];
            p0[t] += x0 * y;
            p1[t] += x1 * y;
            p2[t] += x2 * y;
            p3[t] += x3 * y;
        }
    }
    for (int t = 0; t < NR; t++) {
        o0[t] = p0[t];
        o1[t] = p1[t];
        o2[t] = p2[t];
        o3[t] = p3[t];
    }
}

/* 8 rows by NR columns from c, as mm_tile: eight accumulators of 16 floats fill
 * the AVX-512 register file without spilling (AVX2 would need 16 of its 16). */
static INLINE_HOT void mm_tile8(float *restrict o, size_t ldc, const float *restrict a, size_t ar,
                                size_t ak, const float *restrict b, size_t ldb, int k0, int k1,
                                int c, int zero) {
    float p0[NR], p1[NR], p2[NR], p3[NR], p4[NR], p5[NR], p6[NR], p7[NR];
    float *o0 = o + c, *o1 = o0 + ldc, *o2 = o1 + ldc, *o3 = o2 + ldc;
    float *o4 = o3 + ldc, *o5 = o4 + ldc, *o6 = o5 + ldc, *o7 = o6 + ldc;
    for (int t = 0; t < NR; t++) {
        p0[t] = zero ? 0.0f : o0[t], p1[t] = zero ? 0.0f : o1[t];
        p2[t] = zero ? 0.0f : o2[t], p3[t] = zero ? 0.0f : o3[t];
        p4[t] = zero ? 0.0f : o4[t], p5[t] = zero ? 0.0f : o5[t];
        p6[t] = zero ? 0.0f : o6[t], p7[t] = zero ? 0.0f : o7[t];
    }
    for (int k = k0; k < k1; k++) {
        const float *restrict bk = b + (size_t)k * ldb + c;
        const float *ak0 = a + (size_t)k * ak;
        float x0 = ak0[0], x1 = ak0[ar], x2 = ak0[2 * ar], x3 = ak0[3 * ar];
        float x4 = ak0[4 * ar], x5 = ak0[5 * ar], x6 = ak0[6 * ar], x7 = ak0[7 * ar];
#pragma omp simd
        for (int t = 0; t < NR; t++) {
            float y = bk[t];
            p0[t] += x0 * y, p1[t] += x1 * y, p2[t] += x2 * y, p3[t] += x3 * y;
            p4[t] += x4 * y, p5[t] += x5 * y, p6[t] += x6 * y, p7[t] += x7 * y;
        }
    }
    for (int t = 0; t < NR; t++) {
        o0[t] = p0[t], o1[t] = p1[t], o2[t] = p2[t], o3[t] = p3[t];
        o4[t] = p4[t], o5[t] = p5[t], o6[t] = p6[t], o7[t] = p7[t];
    }
}

/* C (m, n) (+)= A (m, K) B (K, n) with A[r, k] = A[r * ar + k * ak],
 * B[k, c] = B[k * ldb + c] and C's rows ldc apart; zero: overwrite C instead
 * of adding to it. Only the band bd is computed: entries of C outside it are
 * left as they were, and terms outside it must be zero. Rows go in groups of
 * tr (4 or 8; 8 only where mm_tile8 keeps its accumulators in registers).
 * Every entry is summed over k in order, whatever the tile, so the result
 * does not depend on tr. */
static INLINE_HOT void mm_rows(float *restrict C, size_t ldc, const float *restrict A, size_t ar,
                               size_t ak, const float *restrict B, size_t ldb, int m, int n, int K,
                               int zero, band_t bd, int tr) {
    for (int r0 = 0; r0 < m; r0 += tr) {
        int mr = imin(tr, m - r0);
        int k0 = imax(0, r0 + bd.klo), k1 = imin(K, r0 + mr + bd.khi);
        int c0 = imax(0, r0 + bd.clo) / NR * NR;
        int c1 = r0 + mr + bd.chi >= n ? n : imin(n, round_up(r0 + mr + bd.chi, NR));
        if (k1 < k0)
            k1 = k0;
        const float *a = A + (size_t)r0 * ar;
        float *o = C + (size_t)r0 * ldc;
        int r = 0;
        if (mr == 8 && tr == 8) {
            int c = c0;
            for (; c + NR <= c1; c += NR)
                mm_tile8(o, ldc, a, ar, ak, B, ldb, k0, k1, c, zero);
            for (; r < 8; r++)
                mm_row(o + (size_t)r * ldc, a + (size_t)r * ar, ak, B, ldb, k0, k1, c, c1, zero);
        }
        for (; r + MR <= mr; r += MR) {
            int c = c0;
            for (; c + NR <= c1; c += NR)
                mm_tile(o + (size_t)r * ldc, ldc, a + (size_t)r * ar, ar, ak, B, ldb, k0, k1, c,
                        zero);
            for (int i = r; i < r + MR; i++)
                mm_row(o + (size_t)i * ldc, a + (size_t)i * ar, ak, B, ldb, k0, k1, c, c1, zero);
        }
        for (; r < mr; r++)
            mm_row(o + (size_t)r * ldc, a + (size_t)r * ar, ak, B, ldb, k0, k1, c0, c1, zero);
    }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast"))) static void
mm_acc_v4(float *restrict C, size_t ldc, const float *restrict A, size_t ar, size_t ak,
          const float *restrict B, size_t ldb, int m, int n, int K, int zero, band_t bd) {
    mm_rows(C, ldc, A, ar, ak, B, ldb, m, n, K, zero, bd, 8);
}
#endif

HOT_KERNEL static void mm_acc4(float *restrict C, size_t ldc, const float *restrict A, size_t ar,
                               size_t ak, const float *restrict B, size_t ldb, int m, int n, int K,
                               int zero, band_t bd) {
    mm_rows(C, ldc, A, ar, ak, B, ldb, m, n, K, zero, bd, MR);
}

/* mm_rows in the widest form the CPU runs. */
static void mm_acc(float *C, size_t ldc, const float *A, size_t ar, size_t ak, const float *B,
                   size_t ldb, int m, int n, int K, int zero, band_t bd) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    if (__builtin_cpu_supports("x86-64-v4")) {
        mm_acc_v4(C, ldc, A, ar, ak, B, ldb, m, n, K, zero, bd);
        return;
    }
#endif
    mm_acc4(C, ldc, A, ar, ak, B, ldb, m, n, K, zero, bd);
}

/* dst (Dh, ld)[d, c] = src[c * s + d] for c < n, zero for n <= c < ld. */
static void transpose_rows(float *restrict dst, int ld, const float *restrict src, size_t s, int n,
                           int Dh) {
    for (int c0 = 0; c0 < n; c0 += NR) {
        int c1 = imin(c0 + NR, n);
        for (int d = 0; d < Dh; d++)
            for (int c = c0; c < c1; c++)
                dst[(size_t)d * ld + c] = src[(size_t)c * s + d];
    }
    for (int d = 0; d < Dh; d++)
        for (int c = n; c < ld; c++)
            dst[(size_t)d * ld + c] = 0.0f;
}

/* x . y summed in order, as each entry of mm_acc is: where P has a single
 * entry, dS = P (dP - D) then comes out exactly zero, as it should. */
HOT_KERNEL static float dot(const float *restrict x, const float *restrict y, int n) {
    float s = 0.0f;
    for (int d = 0; d < n; d++)
        s += x[d] * y[d];
    return s;
}

/* e^x for x <= 88 to 1.2 ulp (measured on [-87, 10]), 0 below -87 (as expf, without its call,
 * so that loops over it vectorise): x = n ln2 + r, e^r by its Taylor
 * polynomial of degree 7 on |r| <= ln2 / 2, 2^n built in the exponent bits;
 * n is rounded by adding and subtracting 1.5 * 2^23 (no floorf call). */
static inline float exp_poly(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    xc = x != x ? 0.0f : xc; /* NaN: computed on 0 (no undefined conversion), returned below */
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* rounded: 1.5 * 2^23 */
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f; /* ln2 = 0.693359375 - 2.12194440e-4 */
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        uint32_t u;
        float f;
    } two_n = {.u = (uint32_t)((int32_t)n + 127) << 23};
    float keep = x < -87.0f ? 0.0f : 1.0f;
    return x != x ? x : keep * (p * two_n.f);
}

/* Softmax of scale * row (L) over entries lo..hi (inclusive), zero elsewhere;
 * returns the log-sum-exp of the scaled entries. */
HOT_KERNEL static float softmax_row(float *restrict row, int lo, int hi, int L, float scale) {
#pragma omp simd
    for (int c = lo; c <= hi; c++)
        row[c] *= scale;
    float m = row[lo];
#pragma omp simd reduction(max : m)
    for (int c = lo; c <= hi; c++)
        m = row[c] > m ? row[c] : m;
#pragma omp simd
    for (int c = lo; c <= hi; c++)
        row[c] = exp_poly(row[c] - m);
    float part[NR] = {0};
    int c = lo;
    for (; c + NR <= hi + 1; c += NR)
        for (int t = 0; t < NR; t++)
            part[t] += row[c + t];
    double s = 0.0;
    for (; c <= hi; c++)
        s += (double)row[c];
    for (int t = 0; t < NR; t++)
        s += (double)part[t];
    float inv = (float)(1.0 / s);
    for (int c = lo; c <= hi; c++)
        row[c] *= inv;
    for (int c = 0; c < lo; c++)
        row[c] = 0.0f;
    for (int c = hi + 1; c < L; c++)
        row[c] = 0.0f;
    return m + (float)log(s);
}

/* Block index helpers: blocks of ATT_BLK rows over all sequences; pre (B + 1)
 * holds each sequence's first block, pre[B] the total. */
static int32_t *block_prefix(const int32_t *cu, int B, size_t extra) {
    /* Scratch memory has no declared type; it holds int32 here, then `extra`
     * floats for the caller (at pre + B + 1). */
    int32_t *pre = (int32_t *)(void *)cpu_scratch_floats(3, (size_t)B + 1 + extra);
    pre[0] = 0;
    for (int b = 0; b < B; b++) {
        int len = cu[b + 1] - cu[b];
        MO_ASSERT(len >= 0);
        pre[b + 1] = pre[b] + (len + ATT_BLK - 1) / ATT_BLK;
    }
    return pre;
}

/* The sequence holding flat block f: the largest b with pre[b] <= f. */
static int block_seq(const int32_t *pre, int B, int f) {
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

/* Rows r0 .. r1 of the sequence holding flat block f; returns the sequence. */
static int block_rows(const att_args_t *a, const int32_t *pre, int f, int *r0, int *r1) {
    int b = block_seq(pre, a->B, f);
    *r0 = a->cu[b] + (f - pre[b]) * ATT_BLK;
    *r1 = imin(*r0 + ATT_BLK, a->cu[b + 1]);
    return b;
}

/* Forward of query rows i0 .. i1 of head h (sequence starting at s0). */
static void fwd_block(const att_args_t *a, int s0, int i0, int i1, int h) {
    int Dh = a->Dh, kvh = h / a->G, nq = i1 - i0;
    int jlo = first_key(a, s0, i0), L = i1 - jlo, ld = round_up(L, NR);
    float *S = cpu_scratch_floats(0, (size_t)nq * ld);   /* (nq, ld) */
    float *kt = cpu_scratch_floats(1, (size_t)Dh * ld);  /* (Dh, ld) */
    float *acc = cpu_scratch_floats(2, (size_t)nq * Dh); /* (nq, Dh) */
    band_t bc = band_queries(a, i0 - jlo, 1), bk = band_queries(a, i0 - jlo, 0);
    transpose_rows(kt, ld, kvrow(a, a->k, jlo, kvh), a->skv, L, Dh);
    mm_acc(S, (size_t)ld, qrow(a, a->q, i0, h), a->sq, 1, kt, (size_t)ld, nq, ld, Dh, 1, bc);
    for (int r = 0; r < nq; r++) {
        int i = i0 + r;
        a->lse_out[(size_t)i * a->H + h] =
            softmax_row(S + (size_t)r * ld, first_key(a, s0, i) - jlo, i - jlo, L, a->scale);
    }
    memset(acc, 0, (size_t)nq * Dh * sizeof(float));
    mm_acc(acc, (size_t)Dh, S, (size_t)ld, 1, kvrow(a, a->v, jlo, kvh), a->skv, nq, Dh, L, 0, bk);
    for (int r = 0; r < nq; r++)
        memcpy(a->out + (size_t)(i0 + r) * a->sq + (size_t)h * Dh, acc + (size_t)r * Dh,
               (size_t)Dh * sizeof(float));
}

void cpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                           const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                           int window) {
    att_args_t a = args_make(cu_seqlens, B, H, Hkv, Dh, scale, window);
    a.out = out, a.lse_out = lse, a.q = q, a.k = k, a.v = v;
    if (B == 0)
        return;
    const int32_t *pre = block_prefix(cu_seqlens, B, 0);
    long items = (long)pre[B] * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (long w = 0; w < items; w++) {
        long it = items - 1 - w; /* later blocks see more keys: start them first */
        int h = (int)(it % H), i0, i1;
        int b = block_rows(&a, pre, (int)(it / H), &i0, &i1);
        fwd_block(&a, cu_seqlens[b], i0, i1, h);
    }
}

/* p[c] = exp(scale p[c] - l), d[c] = p[c] (d[c] - D) for c < n. */
HOT_KERNEL static void exp_grads(float *restrict p, float *restrict d, int n, float scale, float l,
                                 float D) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        p[c] = scale * p[c] - l;
#pragma omp simd
    for (int c = 0; c < n; c++)
        p[c] = exp_poly(p[c]);
#pragma omp simd
    for (int c = 0; c < n; c++)
        d[c] = p[c] * (d[c] - D);
}

/* Queries q0 .. q0+nq-1 of head h against keys k0 .. k0+nk-1: on entry P and
 * dS (nq, ld) hold q.k and dout.v where visible; on return the probabilities
 * and dS = P * (dP - D), zero where a key is hidden. */
static void probs_grads(float *restrict P, float *restrict dS, int ld, const att_args_t *a, int q0,
                        int nq, int k0, int nk, int h) {
    for (int r = 0; r < nq; r++) {
        int i = q0 + r;
        int lo = imax(0, first_key_of(a, i) - k0), hi = imin(nk - 1, i - k0);
        float D = a->dsum[(size_t)i * a->H + h], l = a->lse[(size_t)i * a->H + h];
        float *restrict pr = P + (size_t)r * ld, *restrict dr = dS + (size_t)r * ld;
        for (int c = 0; c < lo && c < nk; c++)
            pr[c] = dr[c] = 0.0f;
        exp_grads(pr + lo, dr + lo, hi - lo + 1, a->scale, l, D);
        for (int c = imax(lo, hi + 1); c < nk; c++)
            pr[c] = dr[c] = 0.0f;
    }
}

/* dk and dv of keys j0 .. j1 of kv head kvh (sequence ending before s1). */
static void dkdv_block(const att_args_t *a, int s1, int j0, int j1, int kvh) {
    int Dh = a->Dh, nk = j1 - j0, ld = round_up(nk, NR);
    float *P = cpu_scratch_floats(0, 2 * (size_t)ATT_QCH * ld); /* (ATT_QCH, ld) */
    float *dS = P + (size_t)ATT_QCH * ld;                       /* (ATT_QCH, ld) */
    float *kt = cpu_scratch_floats(1, 2 * (size_t)Dh * ld);     /* (Dh, ld) */
    float *vt = kt + (size_t)Dh * ld;                           /* (Dh, ld) */
    float *dk_acc = cpu_scratch_floats(2, 2 * (size_t)nk * Dh); /* (nk, Dh) */
    float *dv_acc = dk_acc + (size_t)nk * Dh;                   /* (nk, Dh) */
    memset(dk_acc, 0, 2 * (size_t)nk * Dh * sizeof(float));
    transpose_rows(kt, ld, kvrow(a, a->k, j0, kvh), a->skv, nk, Dh);
    transpose_rows(vt, ld, kvrow(a, a->v, j0, kvh), a->skv, nk, Dh);
    int ilast = last_query(a, s1, j1 - 1);
    for (int g = 0; g < a->G; g++) {
        int h = kvh * a->G + g;
        for (int q0 = j0; q0 <= ilast; q0 += ATT_QCH) {
            int nq = imin(ATT_QCH, ilast + 1 - q0);
            band_t bq = band_queries(a, q0 - j0, 1), bk = band_keys(a, q0 - j0);
            mm_acc(P, (size_t)ld, qrow(a, a->q, q0, h), a->sq, 1, kt, (size_t)ld, nq, ld, Dh, 1,
                   bq);
            mm_acc(dS, (size_t)ld, qrow(a, a->dout, q0, h), a->sq, 1, vt, (size_t)ld, nq, ld, Dh, 1,
                   bq);
            probs_grads(P, dS, ld, a, q0, nq, j0, nk, h);
            if (a->dv)
                mm_acc(dv_acc, (size_t)Dh, P, 1, (size_t)ld, qrow(a, a->dout, q0, h), a->sq, nk, Dh,
                       nq, 0, bk);
            if (a->dk)
                mm_acc(dk_acc, (size_t)Dh, dS, 1, (size_t)ld, qrow(a, a->q, q0, h), a->sq, nk, Dh,
                       nq, 0, bk);
        }
    }
    for (int c = 0; c < nk; c++) {
        size_t off = (size_t)(j0 + c) * a->skv + (size_t)kvh * Dh;
        const float *gk = dk_acc + (size_t)c * Dh, *gv = dv_acc + (size_t)c * Dh;
        if (a->dk)
            for (int d = 0; d < Dh; d++)
                a->dk[off + d] += a->scale * gk[d];
        if (a->dv)
            for (int d = 0; d < Dh; d++)
                a->dv[off + d] += gv[d];
    }
}

/* dq of query rows i0 .. i1 of head h (sequence starting at s0). */
static void dq_block(const att_args_t *a, int s0, int i0, int i1, int h) {
    int Dh = a->Dh, kvh = h / a->G, nq = i1 - i0;
    int jlo = first_key(a, s0, i0), L = i1 - jlo, ld = round_up(L, NR);
    float *P = cpu_scratch_floats(0, 2 * (size_t)nq * ld);  /* (nq, ld) */
    float *dS = P + (size_t)nq * ld;                        /* (nq, ld) */
    float *kt = cpu_scratch_floats(1, 2 * (size_t)Dh * ld); /* (Dh, ld) */
    float *vt = kt + (size_t)Dh * ld;                       /* (Dh, ld) */
    float *acc = cpu_scratch_floats(2, (size_t)nq * Dh);    /* (nq, Dh) */
    band_t bc = band_queries(a, i0 - jlo, 1), bk = band_queries(a, i0 - jlo, 0);
    transpose_rows(kt, ld, kvrow(a, a->k, jlo, kvh), a->skv, L, Dh);
    transpose_rows(vt, ld, kvrow(a, a->v, jlo, kvh), a->skv, L, Dh);
    mm_acc(P, (size_t)ld, qrow(a, a->q, i0, h), a->sq, 1, kt, (size_t)ld, nq, ld, Dh, 1, bc);
    mm_acc(dS, (size_t)ld, qrow(a, a->dout, i0, h), a->sq, 1, vt, (size_t)ld, nq, ld, Dh, 1, bc);
    probs_grads(P, dS, ld, a, i0, nq, jlo, L, h);
    memset(acc, 0, (size_t)nq * Dh * sizeof(float));
    mm_acc(acc, (size_t)Dh, dS, (size_t)ld, 1, kvrow(a, a->k, jlo, kvh), a->skv, nq, Dh, L, 0, bk);
    for (int r = 0; r < nq; r++) {
        float *dst = a->dq + (size_t)(i0 + r) * a->sq + (size_t)h * Dh;
        const float *src = acc + (size_t)r * Dh;
        for (int d = 0; d < Dh; d++)
            dst[d] += a->scale * src[d];
    }
}
void cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *out, const float *lse,
                            const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                            int window) {
    att_args_t a = args_make(cu_seqlens, B, H, Hkv, Dh, scale, window);
    a.dq = dq, a.dk = dk, a.dv = dv, a.q = q, a.k = k, a.v = v;
    a.o = out, a.dout = dout, a.lse = lse;
    if (B == 0)
        return;
    size_t rows = (size_t)cu_seqlens[B] * H;
    int32_t *pre = block_prefix(cu_seqlens, B, rows);
    a.dsum = (float *)(void *)(pre + B + 1);
#pragma omp parallel for schedule(static) if (rows * Dh > 65536)
    for (size_t r = 0; r < rows; r++)
        a.dsum[r] = dot(dout + r * Dh, out + r * Dh, Dh);
    if (dk || dv) {
        long items = (long)pre[B] * Hkv;
        /* Early key blocks are seen by more queries: they come first. */
#pragma omp parallel for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            int kvh = (int)(it % Hkv), j0, j1;
            int b = block_rows(&a, pre, (int)(it / Hkv), &j0, &j1);
            dkdv_block(&a, cu_seqlens[b + 1], j0, j1, kvh);
        }
    }
    if (dq) {
        long items = (long)pre[B] * H;
#pragma omp parallel for schedule(dynamic, 1)
        for (long w = 0; w < items; w++) {
            long it = items - 1 - w;
            int h = (int)(it % H), i0, i1;
            int b = block_rows(&a, pre, (int)(it / H), &i0, &i1);
            dq_block(&a, cu_seqlens[b], i0, i1, h);
        }
    }
}
