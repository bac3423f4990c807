/* topk: the K largest entries of each row on the CPU, in descending order,
 * ties to the lower index, NaN after every number. */
#include <math.h>
#include <stdlib.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/status.h"

/* Up to this K, insertion into the running top K; beyond it, a full sort. */
#define TOPK_INSERT_MAX 32

/* A total order: a (value va, index ia) comes before b. */
static inline int before(float va, int ia, float vb, int ib) {
    int na = isnan(va), nb = isnan(vb);
    if (na || nb)
        return na != nb ? nb : ia < ib;
    return va > vb || (va == vb && ia < ib);
}

static void topk_insert(int32_t *idx, float *val, const float *x, int C, int K) {
    int n = 0;
    for (int c = 0; c < C; c++) {
        float xc = x[c];
        if (n == K && !before(xc, c, val[K - 1], idx[K - 1]))
            continue;
        int p = n < K ? n++ : K - 1; /* the slot freed at the end */
        while (p > 0 && before(xc, c, val[p - 1], idx[p - 1])) {
            val[p] = val[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        val[p] = xc;
        idx[p] = c;
    }
}

typedef struct topk_item {
    float v;
    int32_t i;
} topk_item_t;

static int cmp_item(const void *pa, const void *pb) {
    const topk_item_t *a = pa, *b = pb;
    if (before(a->v, a->i, b->v, b->i))
        return -1;
    return before(b->v, b->i, a->v, a->i) ? 1 : 0;
}

static void topk_sort(int32_t *idx, float *val, const float *x, int C, int K) {
    /* Scratch memory has no declared type; it holds (value, index) pairs here. */
    topk_item_t *it = (topk_item_t *)(void *)cpu_scratch_floats(0, 2 * (size_t)C);
    for (int c = 0; c < C; c++) {
        it[c].v = x[c];
        it[c].i = c;
    }
    qsort(it, (size_t)C, sizeof *it, cmp_item);
    for (int j = 0; j < K; j++) {
        val[j] = it[j].v;
        idx[j] = it[j].i;
    }
}

void cpu_topk_forward(int32_t *idx, float *val, const float *x, int N, int C, int K) {
    MO_ASSERT(K >= 1 && K <= C);
#pragma omp parallel for schedule(static) if ((long)N * C > 16384)
    for (int n = 0; n < N; n++) {
        int32_t *ir = idx + (size_t)n * K; /* (K) */
        float *vr = val + (size_t)n * K;   /* (K) */
        const float *xr = x + (size_t)n * C;
        if (K <= TOPK_INSERT_MAX)
            topk_insert(ir, vr, xr, C, K);
        else
            topk_sort(ir, vr, xr, C, K);
    }
}

void cpu_topk_backward(float *dx, const float *dval, const int32_t *idx, int N, int C, int K) {
    if (!dx)
        return;
#pragma omp parallel for schedule(static) if ((long)N * K > 16384)
    for (int n = 0; n < N; n++) {
        float *g = dx + (size_t)n * C;
        for (int j = 0; j < K; j++) {
            int32_t c = idx[(size_t)n * K + j];
            MO_ASSERT(c >= 0 && c < C);
            g[c] += dval[(size_t)n * K + j];
        }
    }
}
