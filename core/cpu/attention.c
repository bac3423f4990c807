/* attention: causal grouped-query attention over packed sequences on the CPU.
 *
 * Forward keeps each softmax row's log-sum-exp; backward recomputes the
 * probabilities from it tile by tile (the flash-attention recipe):
 *   D_i = dout_i . out_i,  dS_ij = P_ij (dout_i . v_j - D_i),
 *   dq_i += scale sum_j dS_ij k_j,  dk_j += scale sum_i dS_ij q_i,  dv_j += sum_i P_ij dout_i.
 * Work is cut into blocks of ATT_BLK rows. Every block owns the rows it writes
 * (query blocks for out and dq, key blocks of a kv head for dk and dv, summing
 * the query heads of its group in a fixed order), so results are the same
 * bits on any number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/status.h"

#define ATT_BLK 32 /* rows per query block, key block and inner tile */

typedef struct att_args {
    float *out, *lse_out;        /* forward outputs: (T, H, Dh), (T, H) */
    float *dq, *dk, *dv;         /* (T, H, Dh), (T, Hkv, Dh), (T, Hkv, Dh); may be NULL */
    const float *q, *k, *v;      /* (T, H, Dh), (T, Hkv, Dh), (T, Hkv, Dh) */
    const float *o, *dout, *lse; /* backward inputs: (T, H, Dh), (T, H, Dh), (T, H) */
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

static inline int visible(const att_args_t *a, int i, int j) {
    return j <= i && (a->window <= 0 || i - j < a->window);
}

static inline const float *qrow(const att_args_t *a, const float *base, int i, int h) {
    return base + (size_t)i * a->sq + (size_t)h * a->Dh;
}

static inline const float *kvrow(const att_args_t *a, const float *base, int j, int kvh) {
    return base + (size_t)j * a->skv + (size_t)kvh * a->Dh;
}

static inline float dot(const float *restrict x, const float *restrict y, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++)
        s += x[d] * y[d];
    return s;
}

/* S (na, ld)[r, c] = alpha * x_r . y_c for r < na, c < ny; rows of Dh floats
 * with strides sx and sy. Four rows of x share each load of y. */
static void dot_tile(float *restrict S, int ld, const float *x, size_t sx, int na, const float *y,
                     size_t sy, int ny, int Dh, float alpha) {
    for (int c0 = 0; c0 < ny; c0 += ATT_BLK) {
        int c1 = imin(c0 + ATT_BLK, ny);
        int r = 0;
        for (; r + 4 <= na; r += 4) {
            const float *x0 = x + (size_t)r * sx, *x1 = x0 + sx, *x2 = x1 + sx, *x3 = x2 + sx;
            for (int c = c0; c < c1; c++) {
                const float *yc = y + (size_t)c * sy;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int d = 0; d < Dh; d++) {
                    float t = yc[d];
                    s0 += x0[d] * t;
                    s1 += x1[d] * t;
                    s2 += x2[d] * t;
                    s3 += x3[d] * t;
                }
                float *o = S + (size_t)r * ld + c;
                o[0] = alpha * s0;
                o[(size_t)ld] = alpha * s1;
                o[2 * (size_t)ld] = alpha * s2;
                o[3 * (size_t)ld] = alpha * s3;
            }
        }
        for (; r < na; r++)
            for (int c = c0; c < c1; c++)
                S[(size_t)r * ld + c] = alpha * dot(x + (size_t)r * sx, y + (size_t)c * sy, Dh);
    }
}

/* C (nx, Dh)[x] += sum_{y < ny} W[x * wx + y * wy] * Y_y, rows of Y of Dh
 * floats with stride sy. Zero weights (masked entries) are skipped four at a time. */
static void acc_tile(float *restrict C, const float *W, int wx, int wy, int nx, const float *Y,
                     size_t sy, int ny, int Dh) {
    for (int b0 = 0; b0 < ny; b0 += ATT_BLK) {
        int b1 = imin(b0 + ATT_BLK, ny);
        for (int x = 0; x < nx; x++) {
            float *restrict cx = C + (size_t)x * Dh;
            const float *wr = W + (size_t)x * wx;
            int y = b0;
            for (; y + 4 <= b1; y += 4) {
                float w0 = wr[(size_t)y * wy], w1 = wr[(size_t)(y + 1) * wy];
                float w2 = wr[(size_t)(y + 2) * wy], w3 = wr[(size_t)(y + 3) * wy];
                if (w0 == 0.0f && w1 == 0.0f && w2 == 0.0f && w3 == 0.0f)
                    continue;
                const float *y0 = Y + (size_t)y * sy, *y1 = y0 + sy, *y2 = y1 + sy, *y3 = y2 + sy;
#pragma omp simd
                for (int d = 0; d < Dh; d++)
                    cx[d] += w0 * y0[d] + w1 * y1[d] + w2 * y2[d] + w3 * y3[d];
            }
            for (; y < b1; y++) {
                float w = wr[(size_t)y * wy];
                if (w == 0.0f)
                    continue;
                const float *yy = Y + (size_t)y * sy;
#pragma omp simd
                for (int d = 0; d < Dh; d++)
                    cx[d] += w * yy[d];
            }
        }
    }
}

/* Softmax of row (L) over entries lo..hi (inclusive), zero elsewhere;
 * returns the log-sum-exp of the entries. */
static float softmax_row(float *row, int lo, int hi, int L) {
    float m = row[lo];
    for (int c = lo + 1; c <= hi; c++)
        m = row[c] > m ? row[c] : m;
    double s = 0.0;
    for (int c = lo; c <= hi; c++) {
        float e = expf(row[c] - m);
        row[c] = e;
        s += e;
    }
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
static int32_t *block_prefix(const int32_t *cu, int B) {
    /* Scratch memory has no declared type; it holds int32 here. */
    int32_t *pre = (int32_t *)(void *)cpu_scratch_floats(3, (size_t)B + 1);
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
    int jlo = first_key(a, s0, i0), L = i1 - jlo;
    float *S = cpu_scratch_floats(0, (size_t)nq * L);    /* (nq, L) */
    float *acc = cpu_scratch_floats(1, (size_t)nq * Dh); /* (nq, Dh) */
    dot_tile(S, L, qrow(a, a->q, i0, h), a->sq, nq, kvrow(a, a->k, jlo, kvh), a->skv, L, Dh,
             a->scale);
    for (int r = 0; r < nq; r++) {
        int i = i0 + r;
        a->lse_out[(size_t)i * a->H + h] =
            softmax_row(S + (size_t)r * L, first_key(a, s0, i) - jlo, i - jlo, L);
    }
    memset(acc, 0, (size_t)nq * Dh * sizeof(float));
    acc_tile(acc, S, L, 1, nq, kvrow(a, a->v, jlo, kvh), a->skv, L, Dh);
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
    const int32_t *pre = block_prefix(cu_seqlens, B);
    long items = (long)pre[B] * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (long w = 0; w < items; w++) {
        long it = items - 1 - w; /* later blocks see more keys: start them first */
        int h = (int)(it % H), i0, i1;
        int b = block_rows(&a, pre, (int)(it / H), &i0, &i1);
        fwd_block(&a, cu_seqlens[b], i0, i1, h);
    }
}

/* For query rows i0 .. i1 of head h and keys j0 .. j1: P (nq, nk) the
 * probabilities and dS (nq, nk) = P * (dP - D), zero where a key is hidden. */
static void bwd_tile(float *P, float *dS, const att_args_t *a, int i0, int i1, int j0, int j1,
                     int h) {
    int Dh = a->Dh, kvh = h / a->G, nq = i1 - i0, nk = j1 - j0;
    dot_tile(P, nk, qrow(a, a->q, i0, h), a->sq, nq, kvrow(a, a->k, j0, kvh), a->skv, nk, Dh,
             a->scale);
    dot_tile(dS, nk, qrow(a, a->dout, i0, h), a->sq, nq, kvrow(a, a->v, j0, kvh), a->skv, nk, Dh,
             1.0f);
    for (int r = 0; r < nq; r++) {
        int i = i0 + r;
        float D = dot(qrow(a, a->dout, i, h), qrow(a, a->o, i, h), Dh);
        float l = a->lse[(size_t)i * a->H + h];
        float *pr = P + (size_t)r * nk, *dr = dS + (size_t)r * nk;
        for (int c = 0; c < nk; c++) {
            if (visible(a, i, j0 + c)) {
                float p = expf(pr[c] - l);
                pr[c] = p;
                dr[c] = p * (dr[c] - D);
            } else {
                pr[c] = 0.0f;
                dr[c] = 0.0f;
            }
        }
    }
}

/* dk and dv of keys j0 .. j1 of kv head kvh (sequence ending before s1). */
static void dkdv_block(const att_args_t *a, int s1, int j0, int j1, int kvh) {
    int Dh = a->Dh, nk = j1 - j0;
    float *P = cpu_scratch_floats(0, 2 * ATT_BLK * ATT_BLK);    /* (ATT_BLK, nk) */
    float *dS = P + ATT_BLK * ATT_BLK;                          /* (ATT_BLK, nk) */
    float *dk_acc = cpu_scratch_floats(1, 2 * (size_t)nk * Dh); /* (nk, Dh) */
    float *dv_acc = dk_acc + (size_t)nk * Dh;                   /* (nk, Dh) */
    memset(dk_acc, 0, 2 * (size_t)nk * Dh * sizeof(float));
    int ilast = last_query(a, s1, j1 - 1);
    for (int g = 0; g < a->G; g++) {
        int h = kvh * a->G + g;
        for (int i0 = j0; i0 <= ilast; i0 += ATT_BLK) {
            int i1 = imin(i0 + ATT_BLK, ilast + 1), nq = i1 - i0;
            bwd_tile(P, dS, a, i0, i1, j0, j1, h);
            if (a->dv)
                acc_tile(dv_acc, P, 1, nk, nk, qrow(a, a->dout, i0, h), a->sq, nq, Dh);
            if (a->dk)
                acc_tile(dk_acc, dS, 1, nk, nk, qrow(a, a->q, i0, h), a->sq, nq, Dh);
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
    float *P = cpu_scratch_floats(0, 2 * ATT_BLK * ATT_BLK); /* (nq, ATT_BLK) */
    float *dS = P + ATT_BLK * ATT_BLK;                       /* (nq, ATT_BLK) */
    float *acc = cpu_scratch_floats(1, (size_t)nq * Dh);     /* (nq, Dh) */
    memset(acc, 0, (size_t)nq * Dh * sizeof(float));
    for (int j0 = first_key(a, s0, i0); j0 < i1; j0 += ATT_BLK) {
        int j1 = imin(j0 + ATT_BLK, i1), nk = j1 - j0;
        bwd_tile(P, dS, a, i0, i1, j0, j1, h);
        acc_tile(acc, dS, nk, 1, nq, kvrow(a, a->k, j0, kvh), a->skv, nk, Dh);
    }
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
    const int32_t *pre = block_prefix(cu_seqlens, B);
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
