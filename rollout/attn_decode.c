/* attn_decode: attention of new tokens over a paged KV cache on the CPU. */
#include "rollout/attn_decode.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "core/cpu/scratch.h"
#include "core/status.h"

/* The scratch slot of the score rows (matmuls use 0, LoRA 3). */
#define ATTN_SCRATCH_SLOT 1
/* Work (keys times heads) below which the loop stays on one thread. */
#define PAR_MIN 4096
/* Accumulators kept in registers: 16 floats (two AVX2 or one AVX-512 vector). */
#define LANES 16
/* Rows attended together over their shared blocks (bounds the scores kept at once). */
#define GROUP_MAX 16

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

/* a (2, BS) = the dot products of two queries x0, x1 (Dh) with the BS keys of a block,
 * kt (Dh, BS): each key vector loaded once for both. For BS = LANES, four partial sums
 * per query (dimensions d mod 4). */
HOT_KERNEL static void block_dots2(float *restrict a, const float *restrict x0,
                                   const float *restrict x1, const float *restrict kt, int Dh,
                                   int BS) {
    if (BS != LANES) {
        block_dots(a, x0, kt, Dh, BS);
        block_dots(a + BS, x1, kt, Dh, BS);
        return;
    }
    float p0[LANES] = {0}, p1[LANES] = {0}, p2[LANES] = {0}, p3[LANES] = {0};
    float r0[LANES] = {0}, r1[LANES] = {0}, r2[LANES] = {0}, r3[LANES] = {0};
    int d = 0;
    for (; d + 4 <= Dh; d += 4) {
        const float *restrict k = kt + (size_t)d * LANES;
        float x00 = x0[d], x01 = x0[d + 1], x02 = x0[d + 2], x03 = x0[d + 3];
        float x10 = x1[d], x11 = x1[d + 1], x12 = x1[d + 2], x13 = x1[d + 3];
#pragma omp simd
        for (int t = 0; t < LANES; t++) {
            float k0 = k[t], k1 = k[LANES + t], k2 = k[2 * LANES + t], k3 = k[3 * LANES + t];
            p0[t] += x00 * k0;
            p1[t] += x01 * k1;
            p2[t] += x02 * k2;
            p3[t] += x03 * k3;
            r0[t] += x10 * k0;
            r1[t] += x11 * k1;
            r2[t] += x12 * k2;
            r3[t] += x13 * k3;
        }
    }
    for (; d < Dh; d++) {
        const float *restrict k = kt + (size_t)d * LANES;
        float x00 = x0[d], x10 = x1[d];
#pragma omp simd
        for (int t = 0; t < LANES; t++) {
            p0[t] += x00 * k[t];
            r0[t] += x10 * k[t];
        }
    }
#pragma omp simd
    for (int t = 0; t < LANES; t++) {
        a[t] = (p0[t] + p1[t]) + (p2[t] + p3[t]);
        a[LANES + t] = (r0[t] + r1[t]) + (r2[t] + r3[t]);
    }
}

/* acc (G, BS) = the dot products of the G queries q_g (at q + g sq) with a block's keys:
 * in pairs (g, g + 1), the last alone when G is odd. */
static void block_dots_g(float *acc, const float *q, size_t sq, int G, const float *kt, int Dh,
                         int BS) {
    int g = 0;
    for (; g + 2 <= G; g += 2)
        block_dots2(acc + (size_t)g * BS, q + (size_t)g * sq, q + (size_t)(g + 1) * sq, kt, Dh, BS);
    if (g < G)
        block_dots(acc + (size_t)g * BS, q + (size_t)g * sq, kt, Dh, BS);
}

/* e^x for x <= 0 (a score minus its row's maximum), within 2 ulp of expf; 0 below -87
 * (where e^x < 2e-38), NaN for NaN. Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a
 * polynomial of degree 7, 2^n from the exponent bits. */
static inline float exp_neg(float x) {
    const float magic = 12582912.0f;    /* 1.5 2^23: adding it rounds to an integer */
    float xc = x > -87.0f ? x : -87.0f; /* NaN too: the conversion below stays defined */
    float n = (xc * 1.44269504088896341f + magic) - magic;
    float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return x >= -87.0f ? y * two_n : (x < -87.0f ? 0.0f : x); /* NaN stays NaN */
}

/* Softmax of row (n) in place: the maximum, then e^(s - max) and their sum in 16 lanes
 * (element j in lane j mod 16), the lanes summed in order. */
HOT_KERNEL static void softmax_row(float *restrict row, int n) {
    float mx[LANES], sm[LANES];
    for (int t = 0; t < LANES; t++) {
        mx[t] = -INFINITY;
        sm[t] = 0.0f;
    }
    int full = n / LANES * LANES;
    for (int j = 0; j < full; j += LANES)
#pragma omp simd
        for (int t = 0; t < LANES; t++)
            mx[t] = row[j + t] > mx[t] ? row[j + t] : mx[t];
    for (int j = full; j < n; j++)
        mx[j - full] = row[j] > mx[j - full] ? row[j] : mx[j - full];
    float m = mx[0];
    for (int t = 1; t < LANES; t++)
        m = mx[t] > m ? mx[t] : m;
    for (int j = 0; j < full; j += LANES)
#pragma omp simd
        for (int t = 0; t < LANES; t++) {
            float e = exp_neg(row[j + t] - m);
            row[j + t] = e;
            sm[t] += e;
        }
    for (int j = full; j < n; j++) {
        float e = exp_neg(row[j] - m);
        row[j] = e;
        sm[j - full] += e;
    }
    double sum = 0.0;
    for (int t = 0; t < LANES; t++)
        sum += sm[t];
    float inv = (float)(1.0 / sum);
#pragma omp simd
    for (int j = 0; j < n; j++)
        row[j] *= inv;
}

/* o (Dh) += sum over the cnt slots t of p[t] v_t, vb (cnt, Dh) the slots' values (stride
 * Dh): per span of LANES dimensions, four partial sums (slots mod 4) in registers. The
 * same arithmetic for a row whatever rows it is computed with. */
HOT_KERNEL static void block_values(float *restrict o, const float *restrict p,
                                    const float *restrict vb, int cnt, int Dh) {
    for (int d0 = 0; d0 < Dh; d0 += LANES) {
        int w = Dh - d0 < LANES ? Dh - d0 : LANES;
        float a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
        const float *v = vb + d0;
        if (w == LANES) {
            int t = 0;
            for (; t + 4 <= cnt; t += 4) {
                const float *restrict v0 = v + (size_t)t * Dh, *restrict v1 = v0 + Dh;
                const float *restrict v2 = v1 + Dh, *restrict v3 = v2 + Dh;
                float q0 = p[t], q1 = p[t + 1], q2 = p[t + 2], q3 = p[t + 3];
#pragma omp simd
                for (int x = 0; x < LANES; x++) {
                    a0[x] += q0 * v0[x];
                    a1[x] += q1 * v1[x];
                    a2[x] += q2 * v2[x];
                    a3[x] += q3 * v3[x];
                }
            }
            for (; t < cnt; t++) {
                const float *restrict v0 = v + (size_t)t * Dh;
                float q0 = p[t];
#pragma omp simd
                for (int x = 0; x < LANES; x++)
                    a0[x] += q0 * v0[x];
            }
        } else {
            for (int t = 0; t < cnt; t++)
                for (int x = 0; x < w; x++)
                    a0[x] += p[t] * v[(size_t)t * Dh + x];
        }
        for (int x = 0; x < w; x++)
            o[d0 + x] += (a0[x] + a1[x]) + (a2[x] + a3[x]);
    }
}

/* block_values for two queries at once (o0 with p0, o1 with p1), each value vector
 * loaded once for both; two partial sums per query (slots mod 2). */
HOT_KERNEL static void block_values2(float *restrict o0, float *restrict o1,
                                     const float *restrict p0, const float *restrict p1,
                                     const float *restrict vb, int cnt, int Dh) {
    if (Dh % LANES) {
        block_values(o0, p0, vb, cnt, Dh);
        block_values(o1, p1, vb, cnt, Dh);
        return;
    }
    for (int d0 = 0; d0 < Dh; d0 += LANES) {
        float a0[LANES] = {0}, a1[LANES] = {0}, b0[LANES] = {0}, b1[LANES] = {0};
        const float *v = vb + d0;
        int t = 0;
        for (; t + 2 <= cnt; t += 2) {
            const float *restrict v0 = v + (size_t)t * Dh, *restrict v1 = v0 + Dh;
            float q0 = p0[t], q1 = p0[t + 1], r0 = p1[t], r1 = p1[t + 1];
#pragma omp simd
            for (int x = 0; x < LANES; x++) {
                a0[x] += q0 * v0[x];
                a1[x] += q1 * v1[x];
                b0[x] += r0 * v0[x];
                b1[x] += r1 * v1[x];
            }
        }
        if (t < cnt) {
            const float *restrict v0 = v + (size_t)t * Dh;
            float q0 = p0[t], r0 = p1[t];
#pragma omp simd
            for (int x = 0; x < LANES; x++) {
                a0[x] += q0 * v0[x];
                b0[x] += r0 * v0[x];
            }
        }
#pragma omp simd
        for (int x = 0; x < LANES; x++) {
            o0[d0 + x] += a0[x] + a1[x];
            o1[d0 + x] += b0[x] + b1[x];
        }
    }
}

/* o (G, Dh) += the G queries' weighted values of one block's cnt slots vb (cnt, Dh),
 * probabilities p_g at p + g ld: in pairs (g, g + 1), the last alone when G is odd. */
static void block_values_g(float *o, const float *p, size_t ld, int G, const float *vb, int cnt,
                           int Dh) {
    int g = 0;
    for (; g + 2 <= G; g += 2)
        block_values2(o + (size_t)g * Dh, o + (size_t)(g + 1) * Dh, p + (size_t)g * ld,
                      p + (size_t)(g + 1) * ld, vb, cnt, Dh);
    if (g < G)
        block_values(o + (size_t)g * Dh, p + (size_t)g * ld, vb, cnt, Dh);
}

/* The first position row i attends to. */
static int row_lo(const int32_t *pos, int i, int window) {
    return (window > 0 && pos[i] - window + 1 > 0) ? pos[i] - window + 1 : 0;
}

/* The new rows' keys and values (N, Hkv, Dh), stored by the task that attends over them. */
typedef struct kv_new {
    const float *k, *v;
} kv_new_t;

/* One call: out (N, H, Dh) from the rows' queries q (N, H, Dh); kn the rows' new keys and
 * values to store first (NULL: already stored). */
typedef struct call {
    float *out;
    const float *q;
    const kv_new_t *kn;
    const kv_cache_t *c;
    const kv_seq_t *const *seqs;
    const int32_t *pos;
    int l, H, window;
    float scale;
} call_t;

/* One task: rows r0 .. r1-1, kv heads k0 .. k1-1. The rows hold blocks b0 .. b1-1 in
 * common, each full and inside every row's range (b0 = b1 = 0: none shared). */
typedef struct task {
    int r0, r1, k0, k1, b0, b1;
} task_t;

/* sh[g, x] (row stride n) = scale * q_g . k_(o + x) for x < cnt: the G queries qh (G, Dh)
 * of one kv head against slots o .. o + cnt - 1 of a block's keys kh (Dh, BS). acc: (G,
 * BS) scratch. */
static void head_scores(float *sh, size_t n, const float *qh, const float *kh, int G, int Dh,
                        int BS, int o, int cnt, float scale, float *acc) {
    block_dots_g(acc, qh, (size_t)Dh, G, kh, Dh, BS);
    for (int g = 0; g < G; g++)
        for (int x = 0; x < cnt; x++)
            sh[(size_t)g * n + x] = scale * acc[(size_t)g * BS + o + x];
}

/* si (H, n), head-major: si[h, j - lo] = scale * q_h . k_j for row i's keys j0 .. j1-1 (its
 * range lo .. lo + n - 1), block by block, the task's kv heads of a block in turn (one
 * sequential read of the block's keys). acc: (G, BS) scratch. */
static void row_scores(const call_t *a, const task_t *t, int i, float *si, int j0, int j1,
                       float *acc) {
    const kv_cache_t *c = a->c;
    int Dh = c->Dh, BS = c->block_tokens, G = a->H / c->Hkv;
    int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
    const float *qi = a->q + (size_t)i * a->H * Dh;
    for (int j = j0; j < j1;) {
        int o = j % BS, cnt = BS - o < j1 - j ? BS - o : j1 - j;
        const float *kb = kv_k_block(c, a->l, a->seqs[i]->blocks[j / BS]);
        for (int kvh = t->k0; kvh < t->k1; kvh++)
            head_scores(si + (size_t)kvh * G * n + (size_t)(j - lo), (size_t)n,
                        qi + (size_t)kvh * G * Dh, kb + (size_t)kvh * Dh * BS, G, Dh, BS, o, cnt,
                        a->scale, acc);
        j += cnt;
    }
}

/* row_scores of the task's shared blocks for all its rows (s: their score rows in turn):
 * each kv head's keys of a block read once for every row's queries. */
static void shared_scores(const call_t *a, const task_t *t, float *s, float *acc) {
    const kv_cache_t *c = a->c;
    int Dh = c->Dh, BS = c->block_tokens, G = a->H / c->Hkv;
    for (int b = t->b0; b < t->b1; b++) {
        const float *kb = kv_k_block(c, a->l, a->seqs[t->r0]->blocks[b]);
        for (int kvh = t->k0; kvh < t->k1; kvh++) {
            float *si = s;
            for (int i = t->r0; i < t->r1; i++) {
                int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
                head_scores(si + (size_t)kvh * G * n + (size_t)(b * BS - lo), (size_t)n,
                            a->q + ((size_t)i * a->H + (size_t)kvh * G) * Dh,
                            kb + (size_t)kvh * Dh * BS, G, Dh, BS, 0, BS, a->scale, acc);
                si += (size_t)a->H * n;
            }
        }
    }
}

/* Row i's output (H, Dh) += its values j0 .. j1-1 weighted by its probabilities si (H, n),
 * block by block, the task's kv heads of a block in turn. */
static void row_values(const call_t *a, const task_t *t, int i, const float *si, int j0, int j1) {
    const kv_cache_t *c = a->c;
    int Dh = c->Dh, BS = c->block_tokens, G = a->H / c->Hkv;
    int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
    float *oi = a->out + (size_t)i * a->H * Dh;
    for (int j = j0; j < j1;) {
        int off = j % BS, cnt = BS - off < j1 - j ? BS - off : j1 - j;
        const float *vb = kv_v_block(c, a->l, a->seqs[i]->blocks[j / BS]);
        for (int kvh = t->k0; kvh < t->k1; kvh++)
            block_values_g(oi + (size_t)kvh * G * Dh, si + (size_t)kvh * G * n + (j - lo),
                           (size_t)n, G, vb + ((size_t)kvh * BS + off) * Dh, cnt, Dh);
        j += cnt;
    }
}

/* row_values of the task's shared blocks for all its rows (s: their probabilities in
 * turn): each kv head's values of a block read once for every row. */
static void shared_values(const call_t *a, const task_t *t, const float *s) {
    const kv_cache_t *c = a->c;
    int Dh = c->Dh, BS = c->block_tokens, G = a->H / c->Hkv;
    for (int b = t->b0; b < t->b1; b++) {
        const float *vb = kv_v_block(c, a->l, a->seqs[t->r0]->blocks[b]);
        for (int kvh = t->k0; kvh < t->k1; kvh++) {
            const float *si = s;
            for (int i = t->r0; i < t->r1; i++) {
                int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
                block_values_g(a->out + ((size_t)i * a->H + (size_t)kvh * G) * Dh,
                               si + (size_t)kvh * G * n + (size_t)(b * BS - lo), (size_t)n, G,
                               vb + (size_t)kvh * BS * Dh, BS, Dh);
                si += (size_t)a->H * n;
            }
        }
    }
}

/* Each of the task's rows' values over its own blocks: those before the shared ones
 * (after 0; the row's output zeroed first) or those after them (after 1). s: the rows'
 * probabilities in turn. */
static void own_values(const call_t *a, const task_t *t, const float *s, int after) {
    int Dh = a->c->Dh, BS = a->c->block_tokens, G = a->H / a->c->Hkv;
    const float *si = s;
    for (int i = t->r0; i < t->r1; i++) {
        int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
        if (!after) {
            memset(a->out + ((size_t)i * a->H + (size_t)t->k0 * G) * Dh, 0,
                   sizeof(float) * (size_t)(t->k1 - t->k0) * G * Dh);
            row_values(a, t, i, si, lo, t->b0 * BS);
        } else {
            row_values(a, t, i, si, t->b1 * BS > lo ? t->b1 * BS : lo, lo + n);
        }
        si += (size_t)a->H * n;
    }
}

/* A task's rows, its kv heads: with a->kn, the rows' new keys and values are stored first.
 * The shared blocks are read once for all the rows; each row sees its blocks in order
 * with the same arithmetic as on its own. Scores: row i's (H, n_i), head-major, after the
 * rows before it. */
static void group_task(const call_t *a, const task_t *t) {
    const kv_cache_t *c = a->c;
    int BS = c->block_tokens, G = a->H / c->Hkv, H = a->H;
    size_t tot = 0;
    for (int i = t->r0; a->kn && i < t->r1; i++)
        kv_write_heads(c, a->seqs[i], a->l, a->pos[i], a->kn->k + (size_t)i * c->row,
                       a->kn->v + (size_t)i * c->row, t->k0, t->k1);
    for (int i = t->r0; i < t->r1; i++)
        tot += (size_t)H * (size_t)(a->pos[i] - row_lo(a->pos, i, a->window) + 1);
    /* scores, then (G, BS) */
    float *s = cpu_scratch_floats(ATTN_SCRATCH_SLOT, tot + (size_t)G * BS), *acc = s + tot;
    shared_scores(a, t, s, acc);
    float *si = s; /* each row's own blocks before and after the shared ones; the softmax */
    for (int i = t->r0; i < t->r1; i++) {
        int lo = row_lo(a->pos, i, a->window), n = a->pos[i] - lo + 1;
        row_scores(a, t, i, si, lo, t->b0 * BS, acc);
        row_scores(a, t, i, si, t->b1 * BS > lo ? t->b1 * BS : lo, lo + n, acc);
        for (int h = t->k0 * G; h < t->k1 * G; h++)
            softmax_row(si + (size_t)h * n, n);
        si += (size_t)H * n;
    }
    /* values, in each row's block order */
    own_values(a, t, s, 0);
    shared_values(a, t, s);
    own_values(a, t, s, 1);
}

/* Sets t's shared blocks: the leading blocks all its rows hold, from the first inside
 * every row's range to the last full one of every row; none for a single row. */
static void shared_blocks(const call_t *a, task_t *t) {
    int BS = a->c->block_tokens, b0 = 0, b1 = a->seqs[t->r0]->n_blocks;
    for (int i = t->r0; i < t->r1; i++) {
        int first = (row_lo(a->pos, i, a->window) + BS - 1) / BS, full = (a->pos[i] + 1) / BS;
        b0 = first > b0 ? first : b0;
        b1 = full < b1 ? full : b1;
        for (int b = 0; b < b1; b++)
            if (a->seqs[i]->blocks[b] != a->seqs[t->r0]->blocks[b])
                b1 = b;
    }
    int shared = t->r1 - t->r0 > 1 && b1 > b0;
    t->b0 = shared ? b0 : 0;
    t->b1 = shared ? b1 : 0;
}

static void decode_attention(const call_t *a, int N) {
    int Hkv = a->c->Hkv, H = a->H;
    MO_ASSERT(H > 0 && H % Hkv == 0 && a->window >= 0 && a->l >= 0 && a->l < a->c->L);
    const kv_seq_t *const *seqs = a->seqs;
    size_t work = 0;
    for (int i = 0; i < N; i++) {
        MO_ASSERT(a->pos[i] >= 0 && a->pos[i] < seqs[i]->len);
        work += (size_t)(a->pos[i] + 1) * (size_t)H;
    }
    /* Groups: runs of adjacent rows whose sequences start with the same block (the
     * samples of one prompt), at most GROUP_MAX rows. start (n_groups + 1). */
    int32_t *start = (int32_t *)cpu_scratch_floats(2, (size_t)N + 1);
    int ng = 0;
    for (int i = 0; i < N; i++) {
        int same = i > 0 && i - start[ng - 1] < GROUP_MAX && seqs[i]->n_blocks > 0 &&
                   seqs[i - 1]->n_blocks > 0 && seqs[i]->blocks[0] == seqs[i - 1]->blocks[0];
        if (!same)
            start[ng++] = i;
    }
    start[ng] = N;
    /* Each group's kv heads in one task (a block is one read), or split in parts when
     * there are fewer groups than twice the threads. */
    int parts = 1, nth = work > PAR_MIN ? omp_get_max_threads() : 1;
    while (parts < Hkv && ng * parts < 2 * nth)
        parts++;
#pragma omp parallel for schedule(dynamic, 1) if (work > PAR_MIN)
    for (int t = 0; t < ng * parts; t++) {
        int gi = t / parts, p = t % parts;
        task_t tk = {start[gi], start[gi + 1], p * Hkv / parts, (p + 1) * Hkv / parts, 0, 0};
        shared_blocks(a, &tk);
        group_task(a, &tk);
    }
}

void attn_decode_forward(float *out, const float *q, const kv_cache_t *c, int l,
                         const kv_seq_t *const *seqs, const int32_t *pos, int N, int H, float scale,
                         int window) {
    call_t a = {out, q, NULL, c, seqs, pos, l, H, window, scale};
    decode_attention(&a, N);
}

void attn_decode_store_forward(float *out, const float *q, const float *k, const float *v,
                               const kv_cache_t *c, int l, const kv_seq_t *const *seqs,
                               const int32_t *pos, int N, int H, float scale, int window) {
    MO_ASSERT(c->parts == 2);
    for (int i = 1; i < N; i++)
        MO_ASSERT(seqs[i] != seqs[i - 1]);
    kv_new_t kn = {k, v};
    call_t a = {out, q, &kn, c, seqs, pos, l, H, window, scale};
    decode_attention(&a, N);
}

/* Slots scored at once by attn_decode_latent (a block is taken in chunks of this). */
#define LAT_CHUNK 64

/* out (Dc) = the latent attention of one query q (W) over positions 0 .. p of seq, with
 * an online softmax over chunks of slots: m the running max, sum the running denominator;
 * out holds the unnormalised weighted sum until the end. */
static void latent_task(float *out, const float *q, const kv_cache_t *c, int l, const kv_seq_t *seq,
                        int p, int Dc, float scale) {
    size_t BS = (size_t)c->block_tokens, W = (size_t)c->Dh;
    float m = -INFINITY, sum = 0.0f, s[LAT_CHUNK];
    memset(out, 0, sizeof(float) * (size_t)Dc);
    for (int j0 = 0; j0 <= p; j0 += LAT_CHUNK) {
        int n = p + 1 - j0 < LAT_CHUNK ? p + 1 - j0 : LAT_CHUNK;
        float cm = -INFINITY;
        for (int o = 0; o < n; o++) {
            int j = j0 + o;
            const float *kt = kv_k_block(c, l, seq->blocks[j / (int)BS]) + (size_t)(j % (int)BS);
            float a = 0.0f;
            for (size_t d = 0; d < W; d++)
                a += q[d] * kt[d * BS];
            s[o] = a * scale;
            cm = s[o] > cm ? s[o] : cm;
        }
        if (cm > m) {
            float r = expf(m - cm); /* 0 on the first chunk */
            sum *= r;
            for (int d = 0; d < Dc; d++)
                out[d] *= r;
            m = cm;
        }
        for (int o = 0; o < n; o++) {
            int j = j0 + o;
            const float *kt = kv_k_block(c, l, seq->blocks[j / (int)BS]) + (size_t)(j % (int)BS);
            float e = expf(s[o] - m);
            sum += e;
            for (int d = 0; d < Dc; d++)
                out[d] += e * kt[(size_t)d * BS];
        }
    }
    float inv = 1.0f / sum;
    for (int d = 0; d < Dc; d++)
        out[d] *= inv;
}

void attn_decode_latent(float *out, const float *q, const kv_cache_t *c, int l,
                        const kv_seq_t *const *seqs, const int32_t *pos, int N, int H, int Dc,
                        float scale) {
    MO_ASSERT(c->Hkv == 1 && c->parts == 1 && Dc >= 1 && Dc <= c->Dh && l >= 0 && l < c->L);
    size_t work = 0, W = (size_t)c->Dh;
    for (int i = 0; i < N; i++) {
        MO_ASSERT(pos[i] >= 0 && pos[i] < seqs[i]->len);
        work += (size_t)(pos[i] + 1) * (size_t)H;
    }
    int tasks = N * H;
#pragma omp parallel for schedule(dynamic, 1) if (work > PAR_MIN)
    for (int t = 0; t < tasks; t++) {
        int i = t / H;
        latent_task(out + (size_t)t * Dc, q + (size_t)t * W, c, l, seqs[i], pos[i], Dc, scale);
    }
}
