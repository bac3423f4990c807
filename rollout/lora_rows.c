/* lora_rows: y += (x A^T) (scale B)^T row by row, without BLAS. */
#include "rollout/lora_rows.h"

#include <stdlib.h>
#include <string.h>

#include "core/cpu/scratch.h"
#include "core/status.h"

#define LANES 16
/* Work (T R (C + OC) multiply-adds) below which lora_rows_par stays on one thread. Rows
 * go to the threads eight at a time. */
#define PAR_MIN 65536
#define BT_SLOT (CPU_SCRATCH_SLOTS - 1)

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define LR_HOT                                                                                     \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"),                   \
                   optimize("fp-contract=fast")))
#else
#define LR_HOT
#endif

/* at (C, Rp) = A^T with the ranks padded with zeros to Rp (a multiple of 16). */
static void padded_at(float *at, const float *A, int R, int Rp, int C) {
    for (int c = 0; c < C; c++) {
        float *d = at + (size_t)c * Rp;
        for (int r = 0; r < R; r++)
            d[r] = A[(size_t)r * C + c];
        for (int r = R; r < Rp; r++)
            d[r] = 0.0f;
    }
}

/* M(0); ... M(7); the eight accumulators of a block of rows or outputs */
#define EIGHT(M)                                                                                   \
    M(0);                                                                                          \
    M(1);                                                                                          \
    M(2);                                                                                          \
    M(3);                                                                                          \
    M(4);                                                                                          \
    M(5);                                                                                          \
    M(6);                                                                                          \
    M(7)
#define ACC(i) float s##i[LANES] = {0}
#define FMA_X(i) FMA_LANES(s##i, x[(size_t)(i)*C + c], a)
#define FMA_LANES(s, v, b)                                                                         \
    do {                                                                                           \
        float v_ = (v);                                                                            \
        _Pragma("omp simd") for (int j = 0; j < LANES; j++) s[j] += v_ * (b)[j];                   \
    } while (0)
#define PUT_XA(i) put_lanes(xa + (size_t)(i)*R + r0, s##i, w)

static inline void put_lanes(float *restrict d, const float *restrict s, int w) {
    if (w == LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++)
            d[j] = s[j];
        return;
    }
    for (int j = 0; j < w; j++)
        d[j] = s[j];
}

/* xa (8, R) = x (8, C) A^T, ranks 16 at a time in lanes, each sum over c in order. */
LR_HOT static void xa8(float *xa, const float *x, const float *at, int R, int Rp, int C) {
    for (int r0 = 0; r0 < R; r0 += LANES) {
        int w = R - r0 < LANES ? R - r0 : LANES;
        EIGHT(ACC);
        for (int c = 0; c < C; c++) {
            const float *a = at + (size_t)c * Rp + r0;
            EIGHT(FMA_X);
        }
        EIGHT(PUT_XA);
    }
}

/* The same for one row (the same sums in the same order). */
LR_HOT static void xa1(float *xa, const float *x, const float *at, int R, int Rp, int C) {
    for (int r0 = 0; r0 < R; r0 += LANES) {
        int w = R - r0 < LANES ? R - r0 : LANES;
        ACC(0);
        for (int c = 0; c < C; c++) {
            const float *a = at + (size_t)c * Rp + r0;
            FMA_X(0);
        }
        PUT_XA(0);
    }
}

#define FMA_B(k) FMA_LANES(s##k, v, b + (k)*LANES)
#define ADD_Y(k)                                                                                   \
    do {                                                                                           \
        float *restrict d_ = y + o + (k)*LANES;                                                    \
        _Pragma("omp simd") for (int j = 0; j < LANES; j++) d_[j] += s##k[j];                      \
    } while (0)

/* y (OC) += xa (R) bt (R, OC): each output's sum over r in order, then added to y; eight
 * blocks of 16 outputs at a time (independent chains), then one block, then one output. */
LR_HOT static void row_y(float *y, const float *xa, const float *bt, int R, int OC) {
    int o = 0;
    for (; o + 8 * LANES <= OC; o += 8 * LANES) {
        EIGHT(ACC);
        for (int r = 0; r < R; r++) {
            const float *b = bt + (size_t)r * OC + o;
            float v = xa[r];
            EIGHT(FMA_B);
        }
        EIGHT(ADD_Y);
    }
    for (; o + LANES <= OC; o += LANES) {
        ACC(0);
        for (int r = 0; r < R; r++) {
            const float *b = bt + (size_t)r * OC + o;
            float v = xa[r];
            FMA_B(0);
        }
        ADD_Y(0);
    }
    for (; o < OC; o++) {
        float t = 0.0f;
        for (int r = 0; r < R; r++)
            t += xa[r] * bt[(size_t)r * OC + o];
        y[o] += t;
    }
}

/* Rows t0 .. t1 - 1: xa eight rows at a time, then one at a time; then y row by row. */
static void rows(float *y, float *xa, const float *x, const float *at, const float *bt, int t0,
                 int t1, int R, int Rp, int C, int OC) {
    int t = t0;
    for (; t + 8 <= t1; t += 8)
        xa8(xa + (size_t)t * R, x + (size_t)t * C, at, R, Rp, C);
    for (; t < t1; t++)
        xa1(xa + (size_t)t * R, x + (size_t)t * C, at, R, Rp, C);
    for (t = t0; t < t1; t++)
        row_y(y + (size_t)t * OC, xa + (size_t)t * R, bt, R, OC);
}

/* at (C, Rp) and bt (R, OC): from lc when it holds p's, else formed in the calling
 * thread's scratch slot. */
static void operands(const lora_pair_t *p, const lora_rows_cache_t *lc, int C, int OC, float **at,
                     float **bt, int *Rp) {
    int R = p->R;
    *Rp = (R + LANES - 1) / LANES * LANES;
    if (lc && lc->buf && p->A >= lc->base && p->A < lc->base + lc->n && p->scale == lc->scale) {
        size_t off = (size_t)(p->A - lc->base);
        int lo = 0, hi = lc->n_entries - 1;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (lc->off_A[mid] < off)
                lo = mid + 1;
            else
                hi = mid;
        }
        const int *d = lc->dims + 3 * (size_t)lo;
        if (lc->n_entries > 0 && lc->off_A[lo] == off && p->B == lc->base + lc->off_B[lo] &&
            d[0] == R && d[1] == C && d[2] == OC) {
            *at = lc->at[lo];
            *bt = lc->bt[lo];
            return;
        }
    }
    float *buf = cpu_scratch_floats(BT_SLOT, (size_t)*Rp * C + (size_t)R * OC);
    *at = buf;
    *bt = buf + (size_t)*Rp * C;
    padded_at(*at, p->A, R, *Rp, C);
    lora_scaled_bt(*bt, p, OC);
}

void lora_rows_cache_free(lora_rows_cache_t *c) {
    free(c->off_A);
    free(c->off_B);
    free(c->dims);
    free(c->at);
    free(c->bt);
    free(c->buf);
    memset(c, 0, sizeof *c);
}

void lora_rows_cache_build(lora_rows_cache_t *c, const lora_adapter_t *ad) {
    lora_rows_cache_free(c);
    if (!ad || ad->n_entries <= 0)
        return;
    int n = ad->n_entries;
    size_t total = 0;
    for (int e = 0; e < n; e++) {
        const lora_entry_t *en = &ad->entries[e];
        total += (size_t)(en->R + LANES - 1) / LANES * LANES * (size_t)en->C +
                 (size_t)en->R * (size_t)en->OC;
        if (e > 0 && en->off_A <= ad->entries[e - 1].off_A)
            return; /* not ascending: no cache */
    }
    c->off_A = malloc(sizeof *c->off_A * (size_t)n);
    c->off_B = malloc(sizeof *c->off_B * (size_t)n);
    c->dims = malloc(sizeof *c->dims * 3 * (size_t)n);
    c->at = malloc(sizeof *c->at * (size_t)n);
    c->bt = malloc(sizeof *c->bt * (size_t)n);
    c->buf = malloc(sizeof *c->buf * total);
    if (!c->off_A || !c->off_B || !c->dims || !c->at || !c->bt || !c->buf) {
        lora_rows_cache_free(c);
        return;
    }
    float *d = c->buf;
    for (int e = 0; e < n; e++) {
        const lora_entry_t *en = &ad->entries[e];
        int Rp = (en->R + LANES - 1) / LANES * LANES;
        lora_pair_t p = {
            ad->params + en->off_A, ad->params + en->off_B, NULL, NULL, en->R, ad->scale};
        c->off_A[e] = en->off_A;
        c->off_B[e] = en->off_B;
        c->dims[3 * e] = en->R;
        c->dims[3 * e + 1] = en->C;
        c->dims[3 * e + 2] = en->OC;
        c->at[e] = d;
        c->bt[e] = d + (size_t)Rp * en->C;
        padded_at(c->at[e], p.A, en->R, Rp, en->C);
        lora_scaled_bt(c->bt[e], &p, en->OC);
        d = c->bt[e] + (size_t)en->R * en->OC;
    }
    c->base = ad->params;
    c->n = ad->n_params;
    c->scale = ad->scale;
    c->n_entries = n;
}

void lora_rows(float *y, float *xa, const float *x, const lora_pair_t *p,
               const lora_rows_cache_t *lc, int T, int C, int OC) {
    MO_ASSERT(y && xa && x && p && p->A && p->B && p->R > 0 && C > 0 && OC > 0);
    if (T <= 0)
        return;
    float *at, *bt;
    int Rp;
    operands(p, lc, C, OC, &at, &bt, &Rp);
    rows(y, xa, x, at, bt, 0, T, p->R, Rp, C, OC);
}

void lora_rows_par(float *y, float *xa, const float *x, const lora_pair_t *p,
                   const lora_rows_cache_t *lc, int T, int C, int OC) {
    MO_ASSERT(y && xa && x && p && p->A && p->B && p->R > 0 && C > 0 && OC > 0);
    if (T <= 0)
        return;
    float *at, *bt;
    int Rp, R = p->R, nb = (T + 7) / 8;
    operands(p, lc, C, OC, &at, &bt, &Rp);
    size_t work = (size_t)T * (size_t)R * (size_t)(C + OC);
#pragma omp parallel for schedule(static) if (work > PAR_MIN && nb > 1)
    for (int b = 0; b < nb; b++)
        rows(y, xa, x, at, bt, 8 * b, 8 * b + 8 < T ? 8 * b + 8 : T, R, Rp, C, OC);
}
