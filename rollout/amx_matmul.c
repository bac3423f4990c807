/* amx_matmul: f32 x bf16 products on AMX tiles with exactly split activations. */
#include "rollout/amx_matmul.h"

#include <omp.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/cpu/scratch.h"
#include "core/status.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

/* Work (T * C * OC) above which the product is split across threads. */
#define PAR_MIN (1 << 20)

/* Tile geometry: a tile is 16 rows of 64 bytes (32 bf16 or 16 f32). Weight rows go in
 * blocks of 32 (two A tiles), activation rows in blocks of 32 (two B tiles; the last block may be
 * 16 rows), C in blocks of 32 (one tile row of bf16 pairs). */
#define TR 16
#define KB 32
#define TILE_BF16 (TR * KB)
/* Rows taken at a time: the split activations of a chunk (3 x 256 rows x C bf16, 768 KiB
 * for C = 512) stay in L2 while every block of 32 outputs passes over them. */
#define ROW_CHUNK 256
/* Steps of 32 columns ahead that the weight rows are prefetched. */
#define PF_K 4

#if HAVE_AMX

#define AVX512_FN __attribute__((target("avx512f,avx512bw")))

/* x with the low 16 bits of each element cleared. */
AVX512_FN static inline __m512 top16(__m512 x, __m512i hi) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), hi));
}

/* The top 16 bits of the 32 floats a (columns 0..15), b (16..31) as 16 pairs of columns. */
AVX512_FN static inline __m512i pairs(__m512 a, __m512 b, __m512i idx) {
    return _mm512_permutex2var_epi16(_mm512_castps_si512(a), idx, _mm512_castps_si512(b));
}

/* r[k] = column k of the 16 x 16 matrix of 32-bit words whose row n is r[n]. */
AVX512_FN static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4g + i], 128-bit lane L: rows 4g .. 4g+3 of column 4L + i */
    for (int i = 0; i < 4; i++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
        __m512i w0 = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd);
        __m512i v1 = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xdd);
        r[i] = _mm512_shuffle_i32x4(v0, v1, 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(v0, v1, 0xdd);
        r[4 + i] = _mm512_shuffle_i32x4(w0, w1, 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(w0, w1, 0xdd);
    }
}

/* Index for _mm512_permutex2var_epi16 in the activation splits: the odd 16-bit halves
 * (the bf16 tops) of two vectors of 16 floats. */
static const uint16_t split_top[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                       23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                       45, 47, 49, 51, 53, 55, 57, 59, 61, 63};

/* Rows tb*16 .. tb*16+15 of the activations as three bf16 parts in the tile layout of the
 * B operand, xp (3, nTB, nKB, 16, 16, 2): part p, row tb*16 + n, column kb*32 + 2*k2 + q
 * at [p][tb][kb][k2][n][q]; rows from T on are zero. x = h + m + l exactly: h is the top
 * 16 bits of x (8 significant bits), m the top 16 bits of r = x - h, l those of r - m (at
 * most 8 significant bits are left). Per block of 32 columns, each row's parts are packed
 * as pairs of columns (the even column in the low half), then the 16 x 16 pairs are
 * transposed to [k2][n]. On AVX-512, which every CPU with AMX has. */
AVX512_FN static void split_block16(uint16_t *xp, const float *inp, int T, int tb, int C,
                                    size_t part) {
    int nKB = C / KB, rows = T - tb * TR < TR ? T - tb * TR : TR;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i idx = _mm512_loadu_si512(split_top);
    const float *base = inp + (size_t)tb * TR * (size_t)C;
    uint32_t *d = (uint32_t *)xp + (size_t)tb * nKB * TR * TR; /* part 0 */
    size_t pw = part / 2;                                      /* uint32 per part */
    for (int kb = 0; kb < nKB; kb++) {
        __m512i ph[16], pm[16], pl[16];
        for (int n = 0; n < TR; n++) {
            __m512 a = _mm512_setzero_ps(), b = a;
            if (n < rows) {
                a = _mm512_loadu_ps(base + (size_t)n * C + (size_t)kb * KB);
                b = _mm512_loadu_ps(base + (size_t)n * C + (size_t)kb * KB + 16);
            }
            __m512 ra = _mm512_sub_ps(a, top16(a, hi)), rb = _mm512_sub_ps(b, top16(b, hi));
            __m512 la = _mm512_sub_ps(ra, top16(ra, hi)), lb = _mm512_sub_ps(rb, top16(rb, hi));
            ph[n] = pairs(a, b, idx);
            pm[n] = pairs(ra, rb, idx);
            pl[n] = pairs(la, lb, idx);
        }
        transpose16(ph);
        transpose16(pm);
        transpose16(pl);
        uint32_t *db = d + (size_t)kb * TR * TR;
        for (int k = 0; k < TR; k++) {
            _mm512_storeu_si512(db + (size_t)k * TR, ph[k]);
            _mm512_storeu_si512(db + pw + (size_t)k * TR, pm[k]);
            _mm512_storeu_si512(db + 2 * pw + (size_t)k * TR, pl[k]);
        }
    }
}

/* All rows: xp as above, nTB = Tp / 16 blocks of 16 rows. */
static void split_rows(uint16_t *xp, const float *inp, int T, int Tp, int C) {
    int nKB = C / KB, nTB = Tp / TR;
    size_t part = (size_t)nTB * nKB * TILE_BF16;
#pragma omp parallel for schedule(static) if ((size_t)Tp * (size_t)C > PAR_MIN / 16)
    for (int tb = 0; tb < nTB; tb++)
        split_block16(xp, inp, T, tb, C, part);
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) /* AMX-BF16, AMX-TILE */
        return;
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static int amx_forced_off;

int amx_matmul_available(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ok && !amx_forced_off;
}

typedef struct tilecfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

#define AMX_FN __attribute__((target("amx-tile,amx-bf16")))

AMX_FN static void tiles_on(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = TR;
        cfg.colsb[i] = 64;
    }
    /* (the header's _tile_loadconfig names only 8 bytes of the operand, so the
     * compiler may drop the stores to the rest) */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

AMX_FN static void tiles_off(void) {
    _tile_release();
}

/* acc tile (16, 16) -> out rows t0 .. (16 of them, below T), columns o0 .. (below OC). */
static void put(float *out, const float *acc, const float *bias, int t0, int o0, int T, int OC) {
    for (int n = 0; n < TR && t0 + n < T; n++) {
        float *o = out + (size_t)(t0 + n) * (size_t)OC;
        for (int mr = 0; mr < TR && o0 + mr < OC; mr++)
            o[o0 + mr] = acc[mr * TR + n] + (bias ? bias[o0 + mr] : 0.0f);
    }
}

/* Output columns o0 .. o0+31 (weights wb: 32 rows of C, stride C) for all rows. The
 * first pass over the rows also stores the weight tiles contiguously in wp (nKB, 2, 16,
 * 32), which the later passes read instead (strided tile loads are the slow ones). */
AMX_FN static void col_block(float *out, const uint16_t *wb, uint16_t *wp, const uint16_t *xp,
                             const float *bias, int o0, int T, int Tp, int C, int OC) {
    int nKB = C / KB, nTB = Tp / TR;
    size_t part = (size_t)nTB * nKB * TILE_BF16;
    long ws = (long)C * 2; /* weight row stride, bytes */
    float acc[4][TR * TR];
    for (int kb = 0; kb < PF_K && kb < nKB; kb++)
        for (int r = 0; r < 2 * TR; r++)
            __builtin_prefetch(wb + (size_t)r * C + (size_t)kb * KB);
    for (int tb = 0; tb < nTB; tb += 2) {
        int two = tb + 1 < nTB; /* a second block of 16 rows */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < nKB; kb++) {
            uint16_t *w2 = wp + (size_t)kb * 2 * TILE_BF16;
            if (tb == 0) {
                /* the weights come from memory once, 32 rows at a stride: ask for the
                 * tiles PF_K steps ahead so the loads do not wait on each line */
                if (kb + PF_K < nKB)
                    for (int r = 0; r < 2 * TR; r++)
                        __builtin_prefetch(wb + (size_t)r * C + (size_t)(kb + PF_K) * KB);
                _tile_loadd(4, wb + (size_t)kb * KB, ws);
                _tile_loadd(5, wb + (size_t)TR * C + (size_t)kb * KB, ws);
                if (nTB > 2) {
                    _tile_stored(4, w2, 64);
                    _tile_stored(5, w2 + TILE_BF16, 64);
                }
            } else {
                _tile_loadd(4, w2, 64);
                _tile_loadd(5, w2 + TILE_BF16, 64);
            }
            for (int p = 0; p < 3; p++) {
                const uint16_t *x0 = xp + (size_t)p * part + ((size_t)tb * nKB + kb) * TILE_BF16;
                _tile_loadd(6, x0, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                    _tile_loadd(7, x0 + (size_t)nKB * TILE_BF16, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(2, acc[2], 64);
        put(out, acc[0], bias, tb * TR, o0, T, OC);
        put(out, acc[2], bias, tb * TR, o0 + TR, T, OC);
        if (two) {
            _tile_stored(1, acc[1], 64);
            _tile_stored(3, acc[3], 64);
            put(out, acc[1], bias, (tb + 1) * TR, o0, T, OC);
            put(out, acc[3], bias, (tb + 1) * TR, o0 + TR, T, OC);
        }
    }
}

/* amx_matmul_bf16 for one chunk of at most ROW_CHUNK rows. */
static void product(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                    int C, int OC) {
    if (T == 0)
        return;
    int Tp = (T + TR - 1) / TR * TR;
    int full = OC / (2 * TR) * (2 * TR), tail = OC - full;
    size_t xp_n = 3 * (size_t)Tp * (size_t)C;    /* bf16 */
    size_t wt_n = tail ? 2 * TR * (size_t)C : 0; /* bf16 */
    uint16_t *xp = (uint16_t *)cpu_scratch_floats(0, (xp_n + wt_n + 1) / 2);
    uint16_t *wt = xp + xp_n; /* (32, C) the last rows of w, zero-padded */
    split_rows(xp, inp, T, Tp, C);
    if (tail) {
        memcpy(wt, w + (size_t)full * C, sizeof(uint16_t) * (size_t)tail * C);
        memset(wt + (size_t)tail * C, 0, sizeof(uint16_t) * (size_t)(2 * TR - tail) * C);
    }
    __asm__ volatile("" ::: "memory"); /* the tile loads below read xp and wt */
    int nob = (OC + 2 * TR - 1) / (2 * TR);
    int par = (size_t)T * (size_t)C * (size_t)OC > PAR_MIN && nob > 1;
#pragma omp parallel if (par)
    {
        tiles_on();
        /* (nKB, 2, 16, 32) this thread's packed weight tiles */
        uint16_t *wp = (uint16_t *)cpu_scratch_floats(1, (size_t)C * 2 * TR / 2);
#pragma omp for schedule(static)
        for (int ob = 0; ob < nob; ob++) {
            int o0 = ob * 2 * TR;
            const uint16_t *wb = o0 < full ? w + (size_t)o0 * C : wt;
            col_block(out, wb, wp, xp, bias, o0, T, Tp, C, OC);
        }
        tiles_off();
    }
}

void amx_matmul_bf16(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                     int C, int OC) {
    MO_ASSERT(amx_ok && T >= 0 && C > 0 && C % KB == 0 && OC > 0);
    for (int t0 = 0; t0 < T; t0 += ROW_CHUNK) {
        int n = T - t0 < ROW_CHUNK ? T - t0 : ROW_CHUNK;
        product(out + (size_t)t0 * OC, inp + (size_t)t0 * C, w, bias, n, C, OC);
    }
}

/* ------------------------------------------------------------------------ */
/* Products with pre-packed weights.                                         */

/* Rows tb*16 .. tb*16+15 of the activations as three bf16 parts in the tile layout of the
 * A operand, xa (nTB, nKB, 3, 16, 32): part p of row tb*16 + n, column kb*32 + j at
 * [tb][kb][p][n][j]; rows from T on are zero. The parts as in split_block16, each row's
 * 32 columns in order (no transpose). */
AVX512_FN static void split_block16_a(uint16_t *xa, const float *inp, int T, int tb, int C) {
    int nKB = C / KB, rows = T - tb * TR < TR ? T - tb * TR : TR;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i idx = _mm512_loadu_si512(split_top);
    uint16_t *d0 = xa + (size_t)tb * nKB * 3 * TILE_BF16;
    for (int n = 0; n < TR; n++) {
        const float *row = inp + ((size_t)tb * TR + (size_t)n) * (size_t)C;
        for (int kb = 0; kb < nKB; kb++) {
            __m512 a = _mm512_setzero_ps(), b = a;
            if (n < rows) {
                a = _mm512_loadu_ps(row + (size_t)kb * KB);
                b = _mm512_loadu_ps(row + (size_t)kb * KB + 16);
            }
            __m512 ra = _mm512_sub_ps(a, top16(a, hi)), rb = _mm512_sub_ps(b, top16(b, hi));
            __m512 la = _mm512_sub_ps(ra, top16(ra, hi)), lb = _mm512_sub_ps(rb, top16(rb, hi));
            uint16_t *d = d0 + (size_t)kb * 3 * TILE_BF16 + (size_t)n * KB;
            _mm512_storeu_si512(d, pairs(a, b, idx));
            _mm512_storeu_si512(d + TILE_BF16, pairs(ra, rb, idx));
            _mm512_storeu_si512(d + 2 * TILE_BF16, pairs(la, lb, idx));
        }
    }
}

/* Block b of 16 outputs of a packed product: output outs[seg].out columns o0 .. */
typedef struct pblock {
    int seg, o0;
} pblock_t;

/* acc (16, 16) f32 -> rows r0 + t0 .. (t0 + r below T) of output o's columns o0 .. (below
 * OC). */
static void put_rows(const amx_out_t *o, const float *acc, int r0, int t0, int o0, int T) {
    int nc = o->OC - o0 < TR ? o->OC - o0 : TR;
    for (int r = 0; r < TR && t0 + r < T; r++) {
        float *d = o->out + (size_t)(r0 + t0 + r) * (size_t)o->OC + o0;
        for (int c = 0; c < nc; c++)
            d[c] = acc[r * TR + c] + (o->bias ? o->bias[o0 + c] : 0.0f);
    }
}

/* Accumulator tile t (rows r0 + t0 .., block pb) into its output: straight into the
 * output when the 16 x 16 block lies inside it and there is no bias, through acc
 * otherwise. */
AMX_FN static void store_acc(int t, const amx_out_t *outs, const pblock_t *pb, int r0, int t0,
                             int T, float *acc) {
    const amx_out_t *o = &outs[pb->seg];
    float *d = o->out + (size_t)(r0 + t0) * (size_t)o->OC + pb->o0;
    long st = (long)o->OC * 4;
    int direct = !o->bias && t0 + TR <= T && pb->o0 + TR <= o->OC;
    switch (t) { /* tile numbers must be constants */
    case 0: _tile_stored(0, direct ? (void *)d : (void *)acc, direct ? st : 64); break;
    case 1: _tile_stored(1, direct ? (void *)d : (void *)acc, direct ? st : 64); break;
    case 2: _tile_stored(2, direct ? (void *)d : (void *)acc, direct ? st : 64); break;
    default: _tile_stored(3, direct ? (void *)d : (void *)acc, direct ? st : 64); break;
    }
    if (!direct)
        put_rows(o, acc, r0, t0, pb->o0, T);
}

/* Asks for the tile at t (1 KiB, 16 lines) ahead of use, into L2. */
static inline void prefetch_tile(const uint16_t *t) {
    for (int i = 0; i < TR; i++)
        __builtin_prefetch(t + (size_t)i * KB, 0, 2);
}

/* e^x in 16 lanes: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by the Cephes expf polynomial,
 * times 2^n (within 2 ulp of expf; x clamped to [-88, 88], where expf is finite). */
AVX512_FN static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Gate rows g and up rows u (16, 16) -> rows r0 + t0 .. (t0 + r below T) of o's columns
 * o0 .. (below OC): silu(g) * u = g / (1 + e^-g) * u, e^x by exp16. */
AVX512_FN static void put_glu(const amx_out_t *o, const float *g, const float *u, int r0, int t0,
                              int o0, int T) {
    int nc = o->OC - o0 < TR ? o->OC - o0 : TR;
    __mmask16 k = (__mmask16)((1u << nc) - 1u);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int r = 0; r < TR && t0 + r < T; r++) {
        float *d = o->out + (size_t)(r0 + t0 + r) * (size_t)o->OC + o0;
        __m512 x = _mm512_loadu_ps(g + r * TR), y = _mm512_loadu_ps(u + r * TR);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        __m512 h = _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), y);
        _mm512_mask_storeu_ps(d, k, h);
    }
}

/* h = silu(g) * u over n elements, as put_glu computes it. */
AVX512_FN static void swiglu16(float *h, const float *g, const float *u, size_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t i = 0; i < n; i += 16) {
        size_t m = n - i < 16 ? n - i : 16;
        __mmask16 k = (__mmask16)((1u << m) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(k, g + i), y = _mm512_maskz_loadu_ps(k, u + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_mask_storeu_ps(h + i, k, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), y));
    }
}

/* Blocks b0 and b1 (b1 < 0: none) of outputs for all rows: weight tiles 4, 5, activation
 * tiles 6, 7 (two blocks of 16 rows), accumulators 0 .. 3 (row block r, weight block c
 * in tile 2 r + c). Along C in blocks of 32, the three parts in turn, as col_block. The
 * weights come from memory once, as one stream; tile loads that miss wait on each line,
 * so the first pass over the rows asks for the next pair's tiles (wnext: its first
 * block's, or NULL) as it goes. */
AMX_FN static void packed_pair(const amx_out_t *outs, const pblock_t *pbs, int b0, int b1,
                               const uint16_t *wp, const uint16_t *wnext, const uint16_t *xa,
                               int r0, int T, int Tp, int C, int glu) {
    int nKB = C / KB, nTB = Tp / TR;
    const uint16_t *w0 = wp + (size_t)b0 * nKB * TILE_BF16;
    const uint16_t *w1 = b1 >= 0 ? wp + (size_t)b1 * nKB * TILE_BF16 : w0;
    float acc[TR * TR], acc2[TR * TR];
    for (int tb = 0; tb < nTB; tb += 2) {
        int two = tb + 1 < nTB;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *x0 = xa + (size_t)tb * nKB * 3 * TILE_BF16;
        const uint16_t *x1 = x0 + (size_t)nKB * 3 * TILE_BF16;
        for (int kb = 0; kb < nKB; kb++) {
            if (tb == 0 && wnext) {
                prefetch_tile(wnext + (size_t)kb * TILE_BF16);
                prefetch_tile(wnext + ((size_t)nKB + kb) * TILE_BF16);
            }
            _tile_loadd(4, w0 + (size_t)kb * TILE_BF16, 64);
            _tile_loadd(5, w1 + (size_t)kb * TILE_BF16, 64);
            for (int p = 0; p < 3; p++) {
                _tile_loadd(6, x0 + ((size_t)kb * 3 + p) * TILE_BF16, 64);
                _tile_dpbf16ps(0, 6, 4);
                _tile_dpbf16ps(1, 6, 5);
                if (two) {
                    _tile_loadd(7, x1 + ((size_t)kb * 3 + p) * TILE_BF16, 64);
                    _tile_dpbf16ps(2, 7, 4);
                    _tile_dpbf16ps(3, 7, 5);
                }
            }
        }
        if (glu) { /* b0 gate, b1 up of the same outputs */
            const pblock_t *pb = &pbs[b0];
            _tile_stored(0, acc, 64);
            _tile_stored(1, acc2, 64);
            put_glu(&outs[pb->seg], acc, acc2, r0, tb * TR, pb->o0, T);
            if (two) {
                _tile_stored(2, acc, 64);
                _tile_stored(3, acc2, 64);
                put_glu(&outs[pb->seg], acc, acc2, r0, (tb + 1) * TR, pb->o0, T);
            }
            continue;
        }
        store_acc(0, outs, &pbs[b0], r0, tb * TR, T, acc);
        if (b1 >= 0)
            store_acc(1, outs, &pbs[b1], r0, tb * TR, T, acc);
        if (two) {
            store_acc(2, outs, &pbs[b0], r0, (tb + 1) * TR, T, acc);
            if (b1 >= 0)
                store_acc(3, outs, &pbs[b1], r0, (tb + 1) * TR, T, acc);
        }
    }
}

/* amx_matmul_packed for rows r0 .. r0 + T - 1 (T at most ROW_CHUNK); pbs (nb) the output
 * blocks; glu: pairs of blocks are gate and up (amx_matmul_glu). */
static void packed_chunk(const amx_out_t *outs, const pblock_t *pbs, int nb, const float *inp,
                         const uint16_t *wp, int r0, int T, int C, int glu) {
    int Tp = (T + TR - 1) / TR * TR, nTB = Tp / TR;
    uint16_t *xa = (uint16_t *)cpu_scratch_floats(0, 3 * (size_t)Tp * (size_t)C / 2);
#pragma omp parallel for schedule(static) if ((size_t)Tp * (size_t)C > PAR_MIN / 16)
    for (int tb = 0; tb < nTB; tb++)
        split_block16_a(xa, inp + (size_t)r0 * C, T, tb, C);
    __asm__ volatile("" ::: "memory"); /* the tile loads below read xa */
    int npair = (nb + 1) / 2;
    int par = (size_t)T * (size_t)C * (size_t)nb * TR > PAR_MIN && npair > 1;
#pragma omp parallel if (par)
    {
        tiles_on();
#pragma omp for schedule(static)
        for (int q = 0; q < npair; q++) {
            const uint16_t *wnext =
                q + 1 < npair ? wp + (size_t)(2 * q + 2) * (C / KB) * TILE_BF16 : NULL;
            packed_pair(outs, pbs, 2 * q, 2 * q + 1 < nb ? 2 * q + 1 : -1, wp, wnext, xa, r0, T, Tp,
                        C, glu);
        }
        tiles_off();
    }
}

void amx_matmul_packed(const amx_out_t *outs, int n, const float *inp, const uint16_t *wp, int T,
                       int C) {
    MO_ASSERT(amx_ok && n > 0 && T >= 0 && C > 0 && C % KB == 0);
    int nb = 0;
    for (int i = 0; i < n; i++)
        nb += (outs[i].OC + TR - 1) / TR;
    /* (nb) the output blocks, in scratch slot 1 (floats hold the two ints) */
    pblock_t *pbs = (pblock_t *)cpu_scratch_floats(1, 2 * (size_t)nb);
    for (int i = 0, b = 0; i < n; i++)
        for (int o0 = 0; o0 < outs[i].OC; o0 += TR, b++) {
            pbs[b].seg = i;
            pbs[b].o0 = o0;
        }
    for (int t0 = 0; t0 < T; t0 += ROW_CHUNK) {
        int rows = T - t0 < ROW_CHUNK ? T - t0 : ROW_CHUNK;
        packed_chunk(outs, pbs, nb, inp, wp, t0, rows, C, 0);
    }
}

void amx_matmul_glu(float *h, float *g, float *u, const float *inp, const uint16_t *wp, int T,
                    int C, int F) {
    MO_ASSERT(amx_ok && T >= 0 && C > 0 && C % KB == 0 && F > 0 && (h || (g && u)));
    int nb = 2 * ((F + TR - 1) / TR);
    pblock_t *pbs = (pblock_t *)cpu_scratch_floats(1, 2 * (size_t)nb);
    for (int j = 0; j < nb / 2; j++) {
        pbs[2 * j] = (pblock_t){0, j * TR};
        pbs[2 * j + 1] = (pblock_t){1, j * TR};
    }
    amx_out_t outs[2] = {{h ? h : g, NULL, F}, {u, NULL, F}};
    for (int t0 = 0; t0 < T; t0 += ROW_CHUNK) {
        int rows = T - t0 < ROW_CHUNK ? T - t0 : ROW_CHUNK;
        packed_chunk(outs, pbs, nb, inp, wp, t0, rows, C, h != NULL);
    }
}

void amx_swiglu(float *h, const float *g, const float *u, size_t n) {
    MO_ASSERT(amx_ok);
    swiglu16(h, g, u, n);
}

/* A piece of a grouped product: at most ROW_CHUNK rows r0 .. r0 + T - 1 of one group,
 * its split activations at xa (Tp rows), its tiles from tile0 on in the split pass. */
typedef struct piece {
    const uint16_t *w;
    uint16_t *xa;
    int r0, T, Tp, tile0;
} piece_t;

/* The groups' pieces into ps (room for one per ROW_CHUNK rows of each group), their split
 * activations laid out from xa; returns the count, *ntile the tiles in all. */
static int make_pieces(piece_t *ps, uint16_t *xa, const amx_group_t *g, int ng, int C, int *ntile) {
    int np = 0, tiles = 0;
    for (int i = 0; i < ng; i++)
        for (int t0 = 0; t0 < g[i].T; t0 += ROW_CHUNK) {
            int T = g[i].T - t0 < ROW_CHUNK ? g[i].T - t0 : ROW_CHUNK;
            int Tp = (T + TR - 1) / TR * TR;
            ps[np++] = (piece_t){g[i].w, xa, g[i].r0 + t0, T, Tp, tiles};
            xa += 3 * (size_t)Tp * (size_t)C;
            tiles += Tp / TR;
        }
    *ntile = tiles;
    return np;
}

/* This thread's share of the n items (item i weighs wt(i)): those whose running sum of
 * weights starts in its part of the total, so the threads get about equal work and each a
 * run of neighbouring items (pieces' rows stay in the cache that split them). */
static void my_items(const piece_t *ps, int npair, int n, int *lo, int *hi) {
    int nt = omp_get_num_threads(), t = omp_get_thread_num();
    long long total = 0;
    for (int i = 0; i < n; i++)
        total += ps[i / npair].Tp;
    long long a = total * t / nt, b = total * (t + 1) / nt, run = 0;
    *lo = *hi = n;
    for (int i = 0; i < n; i++) {
        if (run >= a && *lo == n)
            *lo = i;
        if (run >= b) {
            *hi = i;
            break;
        }
        run += ps[i / npair].Tp;
    }
    if (*hi < *lo)
        *hi = *lo;
}

/* The grouped product: every piece's activations split (the threads share the tiles),
 * then every (piece, pair of output blocks) as packed_pair, in one parallel region. */
static void groups_run(const amx_out_t *outs, const pblock_t *pbs, int nb, const float *inp,
                       const amx_group_t *g, int ng, int C, int glu) {
    int rows = 0, maxp = 0;
    for (int i = 0; i < ng; i++) {
        MO_ASSERT(g[i].T >= 0 && g[i].r0 >= 0);
        rows += (g[i].T + TR - 1) / TR * TR + TR;
        maxp += (g[i].T + ROW_CHUNK - 1) / ROW_CHUNK;
    }
    if (maxp == 0)
        return;
    uint16_t *xa = (uint16_t *)cpu_scratch_floats(0, 3 * (size_t)rows * (size_t)C / 2);
    piece_t *ps = (piece_t *)cpu_scratch_floats(2, (sizeof(piece_t) * (size_t)maxp + 3) / 4);
    int ntile, np = make_pieces(ps, xa, g, ng, C, &ntile);
    int npair = (nb + 1) / 2, nitem = np * npair, nKB = C / KB;
    int par = (size_t)rows * (size_t)C * (size_t)nb * TR > PAR_MIN && nitem > 1;
#pragma omp parallel if (par)
    {
        int p = 0;
#pragma omp for schedule(static)
        for (int i = 0; i < ntile; i++) {
            while (p + 1 < np && ps[p + 1].tile0 <= i)
                p++;
            while (ps[p].tile0 > i)
                p--;
            split_block16_a(ps[p].xa, inp + (size_t)ps[p].r0 * C, ps[p].T, i - ps[p].tile0, C);
        }
        /* (the loop's barrier: every split is written before the tiles read it) */
        tiles_on();
        int lo, hi;
        my_items(ps, npair, nitem, &lo, &hi);
        for (int i = lo; i < hi; i++) {
            const piece_t *pc = &ps[i / npair];
            int q = i % npair;
            const uint16_t *wnext = q + 1 < npair   ? pc->w + (size_t)(2 * q + 2) * nKB * TILE_BF16
                                    : i + 1 < nitem ? ps[i / npair + 1].w
                                                    : NULL;
            packed_pair(outs, pbs, 2 * q, 2 * q + 1 < nb ? 2 * q + 1 : -1, pc->w, wnext, pc->xa,
                        pc->r0, pc->T, pc->Tp, C, glu);
        }
        tiles_off();
    }
}

void amx_matmul_packed_groups(float *out, const float *inp, const amx_group_t *g, int ng, int C,
                              int OC) {
    MO_ASSERT(amx_ok && ng >= 0 && C > 0 && C % KB == 0 && OC > 0);
    int nb = (OC + TR - 1) / TR;
    pblock_t *pbs = (pblock_t *)cpu_scratch_floats(1, 2 * (size_t)nb);
    for (int b = 0; b < nb; b++)
        pbs[b] = (pblock_t){0, b * TR};
    amx_out_t o = {out, NULL, OC};
    groups_run(&o, pbs, nb, inp, g, ng, C, 0);
}

void amx_matmul_glu_groups(float *h, float *gt, float *u, const float *inp, const amx_group_t *g,
                           int ng, int C, int F) {
    MO_ASSERT(amx_ok && ng >= 0 && C > 0 && C % KB == 0 && F > 0 && (h || (gt && u)));
    int nb = 2 * ((F + TR - 1) / TR);
    pblock_t *pbs = (pblock_t *)cpu_scratch_floats(1, 2 * (size_t)nb);
    for (int j = 0; j < nb / 2; j++) {
        pbs[2 * j] = (pblock_t){0, j * TR};
        pbs[2 * j + 1] = (pblock_t){1, j * TR};
    }
    amx_out_t outs[2] = {{h ? h : gt, NULL, F}, {u, NULL, F}};
    groups_run(outs, pbs, nb, inp, g, ng, C, h != NULL);
}

void amx_matmul_force_off(int off) {
    amx_forced_off = off;
}

#else /* no AMX */

int amx_matmul_available(void) {
    return 0;
}

void amx_matmul_force_off(int off) {
    (void)off;
}

void amx_matmul_packed(const amx_out_t *outs, int n, const float *inp, const uint16_t *wp, int T,
                       int C) {
    (void)outs, (void)n, (void)inp, (void)wp, (void)T, (void)C;
    MO_ASSERT(!"amx_matmul_packed without AMX");
}

void amx_matmul_glu(float *h, float *g, float *u, const float *inp, const uint16_t *wp, int T,
                    int C, int F) {
    (void)h, (void)g, (void)u, (void)inp, (void)wp, (void)T, (void)C, (void)F;
    MO_ASSERT(!"amx_matmul_glu without AMX");
}

void amx_swiglu(float *h, const float *g, const float *u, size_t n) {
    (void)h, (void)g, (void)u, (void)n;
    MO_ASSERT(!"amx_swiglu without AMX");
}

void amx_matmul_packed_groups(float *out, const float *inp, const amx_group_t *g, int ng, int C,
                              int OC) {
    (void)out, (void)inp, (void)g, (void)ng, (void)C, (void)OC;
    MO_ASSERT(!"amx_matmul_packed_groups without AMX");
}

void amx_matmul_glu_groups(float *h, float *gt, float *u, const float *inp, const amx_group_t *g,
                           int ng, int C, int F) {
    (void)h, (void)gt, (void)u, (void)inp, (void)g, (void)ng, (void)C, (void)F;
    MO_ASSERT(!"amx_matmul_glu_groups without AMX");
}

void amx_matmul_bf16(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                     int C, int OC) {
    (void)out, (void)inp, (void)w, (void)bias, (void)T, (void)C, (void)OC;
    MO_ASSERT(!"amx_matmul_bf16 without AMX");
}

#endif

size_t amx_packed_elems(int OC, int C) {
    return (size_t)((OC + TR - 1) / TR) * TR * (size_t)C;
}

void amx_pack_bf16(uint16_t *dst, const uint16_t *w, int OC, int C) {
    MO_ASSERT(OC > 0 && C > 0 && C % KB == 0);
    int nKB = C / KB, nb = (OC + TR - 1) / TR;
    for (int b = 0; b < nb; b++)
        for (int kb = 0; kb < nKB; kb++) {
            uint16_t *d = dst + ((size_t)b * nKB + kb) * TILE_BF16;
            for (int k2 = 0; k2 < TR; k2++)
                for (int n = 0; n < TR; n++) {
                    int o = b * TR + n;
                    const uint16_t *s = w + (size_t)o * C + (size_t)kb * KB + 2 * k2;
                    d[(k2 * TR + n) * 2] = o < OC ? s[0] : 0;
                    d[(k2 * TR + n) * 2 + 1] = o < OC ? s[1] : 0;
                }
        }
}

void amx_pack_bf16_glu(uint16_t *dst, const uint16_t *gate, const uint16_t *up, int F, int C) {
    MO_ASSERT(F > 0 && C > 0 && C % KB == 0);
    size_t blk = (size_t)TR * (size_t)C; /* one block of 16 outputs */
    uint16_t *tmp = dst;
    /* each block of 16 rows packs on its own (amx_pack_bf16 of its rows) */
    for (int j = 0; j * TR < F; j++) {
        int n = F - j * TR < TR ? F - j * TR : TR;
        amx_pack_bf16(tmp, gate + (size_t)j * blk, n, C);
        amx_pack_bf16(tmp + blk, up + (size_t)j * blk, n, C);
        tmp += 2 * blk;
    }
}

int amx_matmul_fits(const wview_t *w, int T, int C) {
    return w->dtype == DT_BF16 && !w->scale && C % KB == 0 && T >= AMX_MIN_ROWS &&
           amx_matmul_available();
}

void amx_matmul_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                        int C, int OC) {
    if (amx_matmul_fits(w, T, C))
        amx_matmul_bf16(out, inp, (const uint16_t *)w->data, bias, T, C, OC);
    else
        cpu_matmul_forward(out, inp, w, bias, T, C, OC);
}
