/* attn_decode: attention of new tokens over a paged KV cache on the CPU. */
#include "rollout/attn_decode.h"

#include <math.h>
#include <string.h>

#include "core/cpu/scratch.h"
#include "core/status.h"

/* The scratch slot of the score rows (matmuls use 0, LoRA 3). */
#define ATTN_SCRATCH_SLOT 1
/* Work (keys times heads) below which the loop stays on one thread. */
#define PAR_MIN 4096
/* Accumulators kept in registers: 16 floats (two AVX2 or one AVX-512 vector). */
#define LANES 16

/* The inner loops are compiled for AVX2+FMA as well as the baseline, and the loader
 * picks one (GCC function multi-versioning on x86-64). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT_KERNEL                                                                                 \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"),                   \
                   optimize("fp-contract=fast")))
#else
#define HOT_KERNEL
#endif

/* a (BS) = the dot products of x (Dh) with the BS keys of a block, kt (Dh, BS). For
 * BS = LANES, four partial sums (dimensions d mod 4) run in registers side by side. */
HOT_KERNEL static void block_dots(float *restrict a, const float *restrict x,
                                  const float *restrict kt, int Dh, int BS) {
    if (BS == LANES) {
        float p0[LANES] = {0}, p1[LANES] = {0}, p2[LANES] = {0}, p3[LANES] = {0};
        int d = 0;
        for (; d + 4 <= Dh; d += 4) {
            const float *restrict k = kt + (size_t)d * LANES;
            float x0 = x[d], x1 = x[d + 1], x2 = x[d + 2], x3 = x[d + 3];
#pragma omp simd
            for (int t = 0; t < LANES; t++) {
                p0[t] += x0 * k[t];
                p1[t] += x1 * k[LANES + t];
                p2[t] += x2 * k[2 * LANES + t];
                p3[t] += x3 * k[3 * LANES + t];
            }
        }
        for (; d < Dh; d++) {
            const float *restrict k = kt + (size_t)d * LANES;
            float x0 = x[d];
#pragma omp simd
            for (int t = 0; t < LANES; t++)
                p0[t] += x0 * k[t];
        }
#pragma omp simd
        for (int t = 0; t < LANES; t++)
            a[t] = (p0[t] + p1[t]) + (p2[t] + p3[t]);
        return;
    }
    for (int t = 0; t < BS; t++)
        a[t] = 0.0f;
    for (int d = 0; d < Dh; d++) {
        const float *restrict kd = kt + (size_t)d * BS;
        float xd = x[d];
#pragma omp simd
        for (int t = 0; t < BS; t++)
            a[t] += xd * kd[t];
    }
}

/* s (G, n): s[g, j - lo] = scale * q_g . k_j for keys lo .. lo + n - 1 of kv head kvh
 * (q_g at q + g sq). The scores of all of a block's slots are computed; those outside
 * the range are dropped. acc: (BS) scratch. */
static void scores(float *s, const float *q, int G, size_t sq, const kv_cache_t *c, int l,
                   const kv_seq_t *seq, int kvh, int lo, int n, float scale, float *acc) {
    int Dh = c->Dh, BS = c->block_tokens;
    for (int j = lo; j < lo + n;) {
        int b = j / BS, o = j % BS;
        int cnt = BS - o < lo + n - j ? BS - o : lo + n - j;
        const float *kt = kv_k_block(c, l, seq->blocks[b]) + (size_t)kvh * Dh * BS;
        for (int g = 0; g < G; g++) {
            block_dots(acc, q + (size_t)g * sq, kt, Dh, BS);
            float *sg = s + (size_t)g * (size_t)n + (size_t)(j - lo);
            for (int t = 0; t < cnt; t++)
                sg[t] = scale * acc[o + t];
        }
        j += cnt;
    }
}

/* Softmax of row (n) in place, as the packed attention kernel forms it. */
static void softmax_row(float *row, int n) {
    float m = row[0];
    for (int j = 1; j < n; j++)
        m = row[j] > m ? row[j] : m;
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        float e = expf(row[j] - m);
        row[j] = e;
        sum += e;
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < n; j++)
        row[j] *= inv;
}

/* o[d0 .. d0 + w) = sum over keys lo .. lo + n - 1 of p[j - lo] v_j[d0 ..], w <= LANES,
 * the values of kv head kvh; four partial sums (slots mod 4) in registers. */
HOT_KERNEL static void values_span(float *restrict o, const float *restrict p, const kv_cache_t *c,
                                   int l, const kv_seq_t *seq, int kvh, int lo, int n, int d0,
                                   int w) {
    int Dh = c->Dh, BS = c->block_tokens;
    float a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
    for (int j = lo; j < lo + n;) {
        int b = j / BS, off = j % BS;
        int cnt = BS - off < lo + n - j ? BS - off : lo + n - j;
        const float *vb = kv_v_block(c, l, seq->blocks[b]) + ((size_t)kvh * BS + off) * Dh + d0;
        const float *pj = p + (j - lo);
        if (w == LANES) {
            int t = 0;
            for (; t + 4 <= cnt; t += 4) {
                const float *restrict v0 = vb + (size_t)t * Dh, *restrict v1 = v0 + Dh;
                const float *restrict v2 = v1 + Dh, *restrict v3 = v2 + Dh;
                float q0 = pj[t], q1 = pj[t + 1], q2 = pj[t + 2], q3 = pj[t + 3];
#pragma omp simd
                for (int x = 0; x < LANES; x++) {
                    a0[x] += q0 * v0[x];
                    a1[x] += q1 * v1[x];
                    a2[x] += q2 * v2[x];
                    a3[x] += q3 * v3[x];
                }
            }
            for (; t < cnt; t++) {
                const float *restrict v0 = vb + (size_t)t * Dh;
                float q0 = pj[t];
#pragma omp simd
                for (int x = 0; x < LANES; x++)
                    a0[x] += q0 * v0[x];
            }
        } else {
            for (int t = 0; t < cnt; t++)
                for (int x = 0; x < w; x++)
                    a0[x] += pj[t] * vb[(size_t)t * Dh + x];
        }
        j += cnt;
    }
    for (int x = 0; x < w; x++)
        o[d0 + x] = (a0[x] + a1[x]) + (a2[x] + a3[x]);
}

void attn_decode_forward(float *out, const float *q, const kv_cache_t *c, int l,
                         const kv_seq_t *const *seqs, const int32_t *pos, int N, int H, float scale,
                         int window) {
    int Hkv = c->Hkv, Dh = c->Dh, BS = c->block_tokens;
    MO_ASSERT(H > 0 && H % Hkv == 0 && window >= 0 && l >= 0 && l < c->L);
    int G = H / Hkv;
    size_t sq = (size_t)H * (size_t)Dh;
    size_t work = 0;
    for (int i = 0; i < N; i++)
        work += (size_t)(pos[i] + 1) * (size_t)H;
    int tasks = N * Hkv;
#pragma omp parallel for schedule(dynamic, 4) if (work > PAR_MIN)
    for (int t = 0; t < tasks; t++) {
        int i = t / Hkv, kvh = t % Hkv;
        const kv_seq_t *seq = seqs[i];
        MO_ASSERT(pos[i] >= 0 && pos[i] < seq->len);
        int lo = (window > 0 && pos[i] - window + 1 > 0) ? pos[i] - window + 1 : 0;
        int n = pos[i] - lo + 1;
        /* (G, n) scores, then (BS) accumulators */
        float *s = cpu_scratch_floats(ATTN_SCRATCH_SLOT, (size_t)G * (size_t)n + (size_t)BS);
        const float *qi = q + (size_t)i * sq + (size_t)kvh * (size_t)G * (size_t)Dh;
        scores(s, qi, G, (size_t)Dh, c, l, seq, kvh, lo, n, scale, s + (size_t)G * n);
        float *oi = out + (size_t)i * sq + (size_t)kvh * (size_t)G * (size_t)Dh;
        for (int g = 0; g < G; g++) {
            float *pg = s + (size_t)g * (size_t)n;
            softmax_row(pg, n);
            for (int d0 = 0; d0 < Dh; d0 += LANES)
                values_span(oi + (size_t)g * Dh, pg, c, l, seq, kvh, lo, n, d0,
                            Dh - d0 < LANES ? Dh - d0 : LANES);
        }
    }
}
