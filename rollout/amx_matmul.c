/* amx_matmul: f32 x bf16 products on AMX tiles with exactly split activations. */
#include "rollout/amx_matmul.h"

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
/* Steps of 32 columns ahead that the weight rows are prefetched. */
#define PF_K 4

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The loops below are compiled for AVX-512 and AVX2 as well as the baseline, and the
 * loader picks one (GCC function multi-versioning on x86-64). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT_KERNEL
#endif

/* Row x (C) as three bf16 parts, as pairs of adjacent columns: hw, mw, lw (C / 2), the
 * even column in the low half. */
HOT_KERNEL static void split_row(uint32_t *restrict hw, uint32_t *restrict mw,
                                 uint32_t *restrict lw, const float *restrict x, int C) {
    for (int j = 0; j < C / 2; j++) {
        uint32_t h[2], m[2], l[2];
        for (int q = 0; q < 2; q++) {
            float v = x[2 * j + q];
            uint32_t hb = f2u(v) & 0xffff0000u;
            float r = v - u2f(hb);
            uint32_t mb = f2u(r) & 0xffff0000u;
            h[q] = hb;
            m[q] = mb;
            l[q] = f2u(r - u2f(mb)) & 0xffff0000u; /* at most 8 significant bits are left */
        }
        hw[j] = h[0] >> 16 | h[1];
        mw[j] = m[0] >> 16 | m[1];
        lw[j] = l[0] >> 16 | l[1];
    }
}

/* The activations as three bf16 parts in the tile layout of the B operand:
 * xp (3, nTB, nKB, 16, 16, 2): part p, rows tb*16 + n, columns kb*32 + 2*k2 + q at
 * [p][tb][kb][k2][n][q]. Rows from T up to nTB*16 are zero. */
static void split_rows(uint16_t *xp, const float *inp, int T, int Tp, int C) {
    int nKB = C / KB, nTB = Tp / TR;
    size_t part = (size_t)nTB * nKB * TILE_BF16; /* bf16 per part */
#pragma omp parallel if ((size_t)Tp * (size_t)C > PAR_MIN / 16)
    {
        /* (3, 16, C / 2) the parts of 16 rows, as pairs */
        uint32_t *rw = (uint32_t *)cpu_scratch_floats(2, 3 * TR * (size_t)C / 2);
        size_t ph = (size_t)TR * (C / 2);
#pragma omp for schedule(static)
        for (int tb = 0; tb < nTB; tb++) {
            for (int n = 0; n < TR; n++) {
                int t = tb * TR + n;
                uint32_t *r = rw + (size_t)n * (C / 2);
                if (t < T)
                    split_row(r, r + ph, r + 2 * ph, inp + (size_t)t * (size_t)C, C);
                else
                    for (int p = 0; p < 3; p++)
                        memset(r + p * ph, 0, sizeof(uint32_t) * (size_t)(C / 2));
            }
            for (int p = 0; p < 3; p++) {
                /* pair j = kb*16 + k2 of row n goes to [kb][k2][n]: offset j*16 + n */
                uint32_t *d = (uint32_t *)(xp + (size_t)p * part) + (size_t)tb * nKB * TR * TR;
                const uint32_t *src = rw + (size_t)p * ph;
                for (int j = 0; j < C / 2; j++)
                    for (int n = 0; n < TR; n++)
                        d[(size_t)j * TR + n] = src[(size_t)n * (C / 2) + j];
            }
        }
    }
}

#if HAVE_AMX

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

int amx_matmul_available(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ok;
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

void amx_matmul_bf16(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                     int C, int OC) {
    MO_ASSERT(amx_ok && T >= 0 && C > 0 && C % KB == 0 && OC > 0);
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

#else /* no AMX */

int amx_matmul_available(void) {
    return 0;
}

void amx_matmul_bf16(float *out, const float *inp, const uint16_t *w, const float *bias, int T,
                     int C, int OC) {
    (void)out, (void)inp, (void)w, (void)bias, (void)T, (void)C, (void)OC;
    (void)split_rows;
    MO_ASSERT(!"amx_matmul_bf16 without AMX");
}

#endif

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
