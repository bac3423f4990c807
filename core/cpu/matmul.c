/* matmul: CPU matrix products out = inp @ w^T (+ bias) and their backward,
 * for f32 weights through BLAS and for bf16/f16/fp8 weights read in their
 * stored dtype. */
#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/status.h"

/* Below this many tokens a low-precision weight is read once, row by row, by
 * a fused dot-product kernel; from it on, blocks of rows are converted to f32
 * in scratch and multiplied by sgemm. */
#define SMALL_T 16
/* Columns of a weight row converted at a time by the fused forward kernel
 * (on the stack, so that they stay in L1). */
#define FWD_CHUNK 512
/* The fused input-gradient kernel accumulates a (T, width) tile of dinp on
 * the stack: at most BWD_ACC floats, width at most BWD_MAXW columns. */
#define BWD_ACC 4096
#define BWD_MAXW 1024
/* Floats of converted weight rows per sgemm block in the large-T path. */
#define BLOCK_FLOATS ((size_t)1 << 22)
/* Work (multiply-adds) below which a loop stays on one thread. */
#define PAR_MIN 32768

/* The fused kernels are compiled for AVX2+FMA as well as the baseline, and
 * the loader picks one (GCC function multi-versioning on x86-64). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT_KERNEL                                                                                 \
    __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define HOT_KERNEL
#endif

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16f(uint16_t h) {
    return u2f((uint32_t)h << 16);
}

/* Branch-free f16 -> f32: exact, vectorises (masks instead of branches), and
 * needs no arithmetic on f32 subnormals. */
static inline float f16f(uint16_t h) {
    uint32_t u = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t e = u & 0x0f800000u;
    uint32_t special = 0u - (uint32_t)(e == 0x0f800000u); /* inf, NaN */
    uint32_t sub = 0u - (uint32_t)(e == 0);               /* zero, subnormal */
    u += (uint32_t)(127 - 15) << 23;
    u += special & ((uint32_t)(128 - 16) << 23);
    u += sub & (1u << 23);
    float f = u2f(u) - u2f(sub & (113u << 23)); /* renormalises subnormals */
    return u2f(f2u(f) | ((uint32_t)(h & 0x8000u) << 16));
}

/* fp8 e4m3fn -> f32 the same way: bias 7, no infinities, S.1111.111 is NaN. */
static inline float fp8f(uint8_t b) {
    uint32_t m = b & 0x7fu;
    uint32_t sub = 0u - (uint32_t)((m & 0x78u) == 0);
    uint32_t nan = 0u - (uint32_t)(m == 0x7fu);
    uint32_t u = (m << 20) + ((uint32_t)(127 - 7) << 23) + (sub & (1u << 23));
    float f = u2f(u) - u2f(sub & (121u << 23));
    u = (f2u(f) & ~nan) | (nan & 0x7fc00000u);
    return u2f(u | ((uint32_t)(b & 0x80u) << 24));
}

/* Multiplies dst (n), the columns c0 .. c0+n-1 of row r, by their block scales. */
static void apply_block_scales(float *dst, const wview_t *w, size_t r, int c0, int n, int cols) {
    int b = w->block;
    MO_ASSERT(b > 0);
    size_t nbc = (size_t)(cols + b - 1) / (size_t)b;
    const float *srow = w->scale + (r / (size_t)b) * nbc;
    int c = c0, end = c0 + n;
    while (c < end) {
        int cb = c / b;
        int stop = (cb + 1) * b < end ? (cb + 1) * b : end;
        float s = srow[cb];
        for (int k = c; k < stop; k++)
            dst[k - c0] *= s;
        c = stop;
    }
}

/* dst (n) = columns c0 .. c0+n-1 of row r of w (rows, cols), in f32. */
static inline void span_f32(float *restrict dst, const wview_t *w, size_t r, int c0, int n,
                            int cols) {
    size_t off = r * (size_t)cols + (size_t)c0;
    switch (w->dtype) {
    case DT_F32: memcpy(dst, (const float *)w->data + off, (size_t)n * sizeof(float)); break;
    case DT_BF16: {
        const uint16_t *restrict s = (const uint16_t *)w->data + off;
        for (int i = 0; i < n; i++)
            dst[i] = bf16f(s[i]);
        break;
    }
    case DT_F16: {
        const uint16_t *restrict s = (const uint16_t *)w->data + off;
        for (int i = 0; i < n; i++)
            dst[i] = f16f(s[i]);
        break;
    }
    case DT_F8E4M3: {
        const uint8_t *restrict s = (const uint8_t *)w->data + off;
        for (int i = 0; i < n; i++)
            dst[i] = fp8f(s[i]);
        break;
    }
    default: MO_ASSERT(!"weight view: not a float dtype");
    }
    if (w->scale)
        apply_block_scales(dst, w, r, c0, n, cols);
}

HOT_KERNEL static void row_f32(float *dst, const wview_t *w, size_t r, int cols) {
    span_f32(dst, w, r, 0, cols, cols);
}

void cpu_wview_rows_f32(float *dst, const wview_t *w, int r0, int nr, int cols) {
#pragma omp parallel for schedule(static) if ((size_t)nr * (size_t)cols > PAR_MIN)
    for (int i = 0; i < nr; i++)
        row_f32(dst + (size_t)i * (size_t)cols, w, (size_t)r0 + (size_t)i, cols);
}

static int is_plain_f32(const wview_t *w) {
    return w->dtype == DT_F32 && !w->scale;
}

/* Rows of w per converted block in the large-T path. */
static int block_rows(int C, int OC) {
    size_t nb = BLOCK_FLOATS / (size_t)C;
    if (nb < 64)
        nb = 64;
    nb = nb / 16 * 16;
    return nb < (size_t)OC ? (int)nb : OC;
}

/* Rows of w that the fused forward kernel reads together (each input chunk
 * loaded once serves all of them). */
#define FWD_ROWS 4

/* acc (FWD_ROWS, T) = rows o0 .. o0+nr-1 of w times the T rows of inp (T, C). */
HOT_KERNEL static void rows_dot(float *acc, const wview_t *w, int o0, int nr, const float *inp,
                                int T, int C) {
    float wb[FWD_ROWS][FWD_CHUNK];
    for (int i = 0; i < FWD_ROWS * T; i++)
        acc[i] = 0.0f;
    for (int c0 = 0; c0 < C; c0 += FWD_CHUNK) {
        int n = C - c0 < FWD_CHUNK ? C - c0 : FWD_CHUNK;
        for (int r = 0; r < FWD_ROWS; r++) {
            if (r < nr)
                span_f32(wb[r], w, (size_t)(o0 + r), c0, n, C);
            else
                memset(wb[r], 0, (size_t)n * sizeof(float));
        }
        for (int t = 0; t < T; t++) {
            const float *restrict x = inp + (size_t)t * (size_t)C + c0;
            const float *restrict w0 = wb[0], *restrict w1 = wb[1];
            const float *restrict w2 = wb[2], *restrict w3 = wb[3];
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int c = 0; c < n; c++) {
                s0 += w0[c] * x[c];
                s1 += w1[c] * x[c];
                s2 += w2[c] * x[c];
                s3 += w3[c] * x[c];
            }
            acc[0 * T + t] += s0;
            acc[1 * T + t] += s1;
            acc[2 * T + t] += s2;
            acc[3 * T + t] += s3;
        }
    }
}

/* out (T, OC) = inp (T, C) @ w^T + bias, T < SMALL_T, each row of w read once. */
static void fused_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                          int C, int OC) {
    int ngroup = (OC + FWD_ROWS - 1) / FWD_ROWS;
#pragma omp parallel for schedule(static) if ((size_t)OC * (size_t)C * (size_t)T > PAR_MIN)
    for (int g = 0; g < ngroup; g++) {
        float acc[FWD_ROWS * SMALL_T]; /* (FWD_ROWS, T) */
        int o0 = g * FWD_ROWS;
        int nr = OC - o0 < FWD_ROWS ? OC - o0 : FWD_ROWS;
        rows_dot(acc, w, o0, nr, inp, T, C);
        for (int r = 0; r < nr; r++) {
            float b = bias ? bias[o0 + r] : 0.0f;
            for (int t = 0; t < T; t++)
                out[(size_t)t * (size_t)OC + (size_t)(o0 + r)] = acc[r * T + t] + b;
        }
    }
}

/* out (T, OC) = inp @ w^T (+ out when beta is 1), w converted block by block. */
static void blocked_forward(float *out, const float *inp, const wview_t *w, int T, int C, int OC,
                            float beta) {
    int nb = block_rows(C, OC);
    float *wbuf = cpu_scratch_floats(0, (size_t)nb * (size_t)C); /* (nb, C) */
    for (int o0 = 0; o0 < OC; o0 += nb) {
        int m = OC - o0 < nb ? OC - o0 : nb;
        cpu_wview_rows_f32(wbuf, w, o0, m, C);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, m, C, 1.0f, inp, C, wbuf, C, beta,
                    out + o0, OC);
    }
}

void cpu_matmul_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                        int C, int OC) {
    MO_ASSERT(T >= 0 && C > 0 && OC > 0);
    if (T == 0)
        return;
    if (!is_plain_f32(w) && T < SMALL_T) {
        fused_forward(out, inp, w, bias, T, C, OC);
        return;
    }
    float beta = 0.0f;
    if (bias) {
        for (int t = 0; t < T; t++)
            memcpy(out + (size_t)t * (size_t)OC, bias, (size_t)OC * sizeof(float));
        beta = 1.0f;
    }
    if (is_plain_f32(w))
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, OC, C, 1.0f, inp, C,
                    (const float *)w->data, C, beta, out, OC);
    else
        blocked_forward(out, inp, w, T, C, OC, beta);
}

/* Columns per task of the fused input-gradient kernel: about two tasks per
 * thread, a multiple of 16, within the stack tile. */
static int bwd_width(int T, int C) {
    int nth = omp_get_max_threads();
    int cap = BWD_ACC / T < BWD_MAXW ? BWD_ACC / T / 16 * 16 : BWD_MAXW;
    int per = (C + 2 * nth - 1) / (2 * nth);
    per = (per + 15) / 16 * 16;
    if (per < 32)
        per = 32;
    return per < cap ? per : cap;
}

/* dinp[:, c0 .. c0+n) (T, C) += dout (T, OC) @ w[:, c0 .. c0+n), T * n <= BWD_ACC;
 * rows of w are taken four at a time so that each accumulator load serves four
 * products. */
HOT_KERNEL static void cols_axpy(float *dinp, const float *dout, const wview_t *w, int c0, int n,
                                 int T, int C, int OC) {
    float wb[4][BWD_MAXW];
    float acc[BWD_ACC]; /* (T, n) */
    for (int i = 0; i < T * n; i++)
        acc[i] = 0.0f;
    for (int o = 0; o < OC; o += 4) {
        int nr = OC - o < 4 ? OC - o : 4;
        for (int r = 0; r < 4; r++) {
            if (r < nr)
                span_f32(wb[r], w, (size_t)(o + r), c0, n, C);
            else
                memset(wb[r], 0, (size_t)n * sizeof(float));
        }
        const float *restrict w0 = wb[0], *restrict w1 = wb[1];
        const float *restrict w2 = wb[2], *restrict w3 = wb[3];
        for (int t = 0; t < T; t++) {
            const float *d = dout + (size_t)t * (size_t)OC + o;
            float d0 = d[0], d1 = nr > 1 ? d[1] : 0.0f;
            float d2 = nr > 2 ? d[2] : 0.0f, d3 = nr > 3 ? d[3] : 0.0f;
            float *restrict a = acc + t * n;
#pragma omp simd
            for (int c = 0; c < n; c++)
                a[c] += d0 * w0[c] + d1 * w1[c] + d2 * w2[c] + d3 * w3[c];
        }
    }
    for (int t = 0; t < T; t++) {
        float *restrict dst = dinp + (size_t)t * (size_t)C + c0;
        const float *restrict a = acc + t * n;
        for (int c = 0; c < n; c++)
            dst[c] += a[c];
    }
}

/* dinp (T, C) += dout (T, OC) @ w, T < SMALL_T; threads own column ranges, so
 * the sum order does not depend on the thread count. */
static void fused_backward_inp(float *dinp, const float *dout, const wview_t *w, int T, int C,
                               int OC) {
    int width = bwd_width(T, C);
    int ntask = (C + width - 1) / width;
#pragma omp parallel for schedule(dynamic, 1) if ((size_t)OC * (size_t)C * (size_t)T > PAR_MIN)
    for (int k = 0; k < ntask; k++) {
        int c0 = k * width;
        cols_axpy(dinp, dout, w, c0, C - c0 < width ? C - c0 : width, T, C, OC);
    }
}

/* dinp (T, C) += dout (T, OC) @ w, w converted block by block. */
static void blocked_backward_inp(float *dinp, const float *dout, const wview_t *w, int T, int C,
                                 int OC) {
    int nb = block_rows(C, OC);
    float *wbuf = cpu_scratch_floats(0, (size_t)nb * (size_t)C); /* (nb, C) */
    for (int o0 = 0; o0 < OC; o0 += nb) {
        int m = OC - o0 < nb ? OC - o0 : nb;
        cpu_wview_rows_f32(wbuf, w, o0, m, C);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, C, m, 1.0f, dout + o0, OC, wbuf,
                    C, 1.0f, dinp, C);
    }
}

/* dbias (OC) += column sums of dout (T, OC). */
static void bias_backward(float *dbias, const float *dout, int T, int OC) {
    enum { W = 256 };
    int ntask = (OC + W - 1) / W;
#pragma omp parallel for schedule(static) if ((size_t)T * (size_t)OC > PAR_MIN)
    for (int k = 0; k < ntask; k++) {
        int o0 = k * W, n = OC - o0 < W ? OC - o0 : W;
        float acc[W];
        for (int i = 0; i < n; i++)
            acc[i] = 0.0f;
        for (int t = 0; t < T; t++) {
            const float *restrict d = dout + (size_t)t * (size_t)OC + o0;
            for (int i = 0; i < n; i++)
                acc[i] += d[i];
        }
        for (int i = 0; i < n; i++)
            dbias[o0 + i] += acc[i];
    }
}

void cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp,
                         const wview_t *w, int T, int C, int OC) {
    MO_ASSERT(T >= 0 && C > 0 && OC > 0);
    MO_ASSERT(!dw || is_plain_f32(w)); /* only f32 weights are trained */
    if (T == 0)
        return;
    if (dinp) {
        if (is_plain_f32(w))
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, C, OC, 1.0f, dout, OC,
                        (const float *)w->data, C, 1.0f, dinp, C);
        else if (T < SMALL_T)
            fused_backward_inp(dinp, dout, w, T, C, OC);
        else
            blocked_backward_inp(dinp, dout, w, T, C, OC);
    }
    if (dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, T, 1.0f, dout, OC, inp, C, 1.0f,
                    dw, C);
    if (dbias)
        bias_backward(dbias, dout, T, OC);
}
