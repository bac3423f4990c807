/* gpu_attn_decode: decode attention over the paged KV cache on the device
 * (core/cuda/attn_decode.h) against the CPU's (rollout/attn_decode.c) on the same cache
 * memory: sequences of 1, 17, 40 and 600 tokens in 16-token blocks and a fork of the
 * 40-token one (its full blocks shared, its own positions after them), rows at the ends
 * and inside the sequences, GQA (G 4 and 12), MHA, head dims 64, 80 and 128, windows 0, 5
 * and 300, one pass and split contexts, and G 32 with Dh 256 (over 48 KiB of shared
 * memory). Outputs agree by normalised error within TOL_F32; the keys and values the
 * store-and-attend call writes equal the CPU's bit for bit (the whole cache compared);
 * repeated calls give the same bits; rows outside their tables give NaN and touch no cache
 * memory. Outputs are poisoned before each call.
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/attn_decode.h"
#include "core/status.h"
#include "rollout/attn_decode.h"
#include "rollout/kv_cache.h"
#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

enum { BS = 16, NL = 2, LAYER = 1, NSEQ = 5, FORK = 4, FORK_SRC = 2, FORK_LEN = 45 };

/* Sequence lengths; the last is the fork of sequence FORK_SRC, grown to FORK_LEN. */
static const int LENS[NSEQ] = {1, 17, 40, 600, FORK_LEN};

typedef struct dcase {
    int H, Hkv, Dh;
} dcase_t;

static const dcase_t CASES[] = {
    {8, 2, 64},   /* GQA, G 4 */
    {8, 2, 128},  /* GQA, Dh 128 */
    {4, 4, 128},  /* MHA */
    {12, 1, 80},  /* G 12: two register chunks of heads; Dh not a multiple of 32 */
    {32, 1, 256}, /* over 48 KiB of shared memory: the opt-in limit */
};
#define NCASES (int)(sizeof CASES / sizeof CASES[0])

typedef struct fx {
    dcase_t d;
    kv_cache_t c;
    kv_seq_t s[NSEQ];
    int64_t budget[NSEQ]; /* each sequence's reserved blocks not yet taken */
} fx_t;

static size_t cache_floats(const kv_cache_t *c) {
    return (size_t)c->L * (size_t)c->n_blocks * (size_t)c->parts * (size_t)c->block_tokens * c->row;
}

/* Random keys and values at positions t0 .. t1-1 of sequence b, in every layer. */
static void fill_positions(fx_t *f, int b, int t0, int t1, uint64_t seed) {
    size_t row = f->c.row;
    float *k = malloc(sizeof(float) * row), *v = malloc(sizeof(float) * row);
    for (int l = 0; l < NL; l++)
        for (int t = t0; t < t1; t++) {
            uint64_t sd = seed + 1000003u * (uint64_t)b + 7919u * (uint64_t)t + 101u * (uint64_t)l;
            tu_fill(k, row, sd, -1.0f, 1.0f);
            tu_fill(v, row, sd + 50000017u, -1.0f, 1.0f);
            kv_write(&f->c, &f->s[b], l, t, k, v);
        }
    free(k);
    free(v);
}

/* The sequences of LENS with random keys and values; each keeps one more position's room in
 * its reservation (a decode step). */
static void fx_init(fx_t *f, const dcase_t *d, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->d = *d;
    TU_CHECK_RC(kv_cache_init(&f->c, NL, d->Hkv, d->Dh, 64 * BS, BS));
    for (int b = 0; b < NSEQ; b++) {
        if (b == FORK)
            continue;
        f->budget[b] = kv_cache_blocks_for(&f->c, LENS[b] + 1);
        CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f->c, f->budget[b]), 1);
        TU_CHECK_RC(kv_seq_grow(&f->c, &f->s[b], LENS[b], &f->budget[b]));
        fill_positions(f, b, 0, LENS[b], seed);
    }
    /* The fork: blocks 0 and 1 shared with its source, block 2 its own copy, then its own
     * positions 40 .. 44 (still in block 2). */
    f->budget[FORK] = kv_cache_blocks_for(&f->c, FORK_LEN + 1) - LENS[FORK_SRC] / BS;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f->c, f->budget[FORK]), 1);
    TU_CHECK_RC(kv_seq_fork(&f->c, &f->s[FORK], &f->s[FORK_SRC], &f->budget[FORK]));
    CU_ASSERT_FATAL(f->s[FORK].blocks[0] == f->s[FORK_SRC].blocks[0] &&
                    f->s[FORK].blocks[1] == f->s[FORK_SRC].blocks[1] &&
                    f->s[FORK].blocks[2] != f->s[FORK_SRC].blocks[2]);
    TU_CHECK_RC(kv_seq_grow(&f->c, &f->s[FORK], FORK_LEN, &f->budget[FORK]));
    fill_positions(f, FORK, LENS[FORK_SRC], FORK_LEN, seed + 99);
}

static void fx_free(fx_t *f) {
    for (int b = 0; b < NSEQ; b++)
        kv_seq_release(&f->c, &f->s[b]);
    kv_cache_free(&f->c);
}

/* One attention call's rows: row i at position pos[i] of sequence seq[i]. */
typedef struct rows {
    int N;
    int seq[16];
    int32_t pos[16];
    const kv_seq_t *seqs[16];
} rows_t;

/* The device copies of a call's inputs. */
typedef struct dcall {
    float *cache, *q, *k, *v, *out;
    int32_t *tables, *pos;
    int max_blocks;
} dcall_t;

/* Uploads cache memory `mem`, the rows' block tables (padded with -1, never read) and
 * positions, q and, when given, the new keys and values; out poisoned. */
static void dev_init(dcall_t *g, const fx_t *f, const float *mem, const rows_t *r, const float *q,
                     const float *k, const float *v) {
    memset(g, 0, sizeof *g);
    g->max_blocks = 1;
    for (int i = 0; i < r->N; i++)
        if (r->seqs[i]->n_blocks > g->max_blocks)
            g->max_blocks = r->seqs[i]->n_blocks;
    size_t nt = (size_t)r->N * (size_t)g->max_blocks;
    int32_t *tab = malloc(sizeof(int32_t) * nt);
    for (size_t e = 0; e < nt; e++)
        tab[e] = -1;
    for (int i = 0; i < r->N; i++)
        memcpy(tab + (size_t)i * g->max_blocks, r->seqs[i]->blocks,
               sizeof(int32_t) * (size_t)r->seqs[i]->n_blocks);
    size_t nq = (size_t)r->N * f->d.H * f->d.Dh, nk = (size_t)r->N * f->c.row;
    g->cache = dput(mem, sizeof(float) * cache_floats(&f->c));
    g->tables = dput(tab, sizeof(int32_t) * nt);
    g->pos = dput(r->pos, sizeof(int32_t) * (size_t)r->N);
    g->q = dput(q, sizeof(float) * nq);
    g->k = k ? dput(k, sizeof(float) * nk) : NULL;
    g->v = v ? dput(v, sizeof(float) * nk) : NULL;
    g->out = dpoison(nq);
    free(tab);
}

static void dev_free(dcall_t *g) {
    dfree(g->cache), dfree(g->tables), dfree(g->pos), dfree(g->q), dfree(g->out);
    if (g->k)
        dfree(g->k), dfree(g->v);
}

static int dev_run(dcall_t *g, const fx_t *f, const rows_t *r, int store, float scale, int window,
                   int splits) {
    return cuda_attn_decode(g->out, g->q, store ? g->k : NULL, store ? g->v : NULL, g->cache, NL,
                            f->c.n_blocks, BS, f->d.Hkv, f->d.Dh, LAYER, g->tables, g->max_blocks,
                            g->pos, r->N, f->d.H, scale, window, splits);
}

static void rows_add(rows_t *r, const fx_t *f, int b, int pos) {
    r->seq[r->N] = b;
    r->pos[r->N] = pos;
    r->seqs[r->N] = &f->s[b];
    r->N++;
}

static const int SPLITS[] = {0, 1, 3, 7};
#define NSPLITS (int)(sizeof SPLITS / sizeof SPLITS[0])

/* Rows over the stored positions (no store): the ends of every sequence, block
 * boundaries, the middle of the long one, the fork. */
static void check_forward(const dcase_t *d, int window, uint64_t seed) {
    fx_t f;
    fx_init(&f, d, seed);
    rows_t r = {0};
    rows_add(&r, &f, 0, 0);
    rows_add(&r, &f, 1, 16);
    rows_add(&r, &f, 1, 15);
    rows_add(&r, &f, 2, 39);
    rows_add(&r, &f, 3, 599);
    rows_add(&r, &f, 3, 300);
    rows_add(&r, &f, 3, 255);
    rows_add(&r, &f, FORK, FORK_LEN - 1);
    rows_add(&r, &f, FORK, 20);
    int H = d->H, Dh = d->Dh;
    size_t nq = (size_t)r.N * H * Dh;
    float scale = 1.0f / sqrtf((float)Dh);
    float *q = hrand(nq, seed + 7, -2.0f, 2.0f), *ref = malloc(sizeof(float) * nq);
    tu_poison(ref, nq);
    attn_decode_forward(ref, q, &f.c, LAYER, r.seqs, r.pos, r.N, H, scale, window);
    dcall_t g;
    dev_init(&g, &f, f.c.mem, &r, q, NULL, NULL);
    for (int si = 0; si < NSPLITS; si++) {
        char w[160];
        snprintf(w, sizeof w, "forward H %d Hkv %d Dh %d window %d splits %d", H, d->Hkv, Dh,
                 window, SPLITS[si]);
        TU_CHECK_RC(dev_run(&g, &f, &r, 0, scale, window, SPLITS[si]));
        float *out = dget_f(g.out, nq);
        TU_ASSERT_CLOSE(err(out, ref, nq), TOL_F32, w);
        /* the same bits again, from a poisoned output */
        float *again = hcopy(out, nq);
        tu_poison(again, nq);
        dset(g.out, again, sizeof(float) * nq);
        TU_CHECK_RC(dev_run(&g, &f, &r, 0, scale, window, SPLITS[si]));
        dget(again, g.out, sizeof(float) * nq);
        int same = memcmp(out, again, sizeof(float) * nq) == 0;
        if (!same)
            tu_report("%s: a repeated call differs", w);
        CU_ASSERT(same);
        free(again);
        free(out);
    }
    float *mem = dget_f(g.cache, cache_floats(&f.c));
    CU_ASSERT(memcmp(mem, f.c.mem, sizeof(float) * cache_floats(&f.c)) == 0);
    free(mem);
    dev_free(&g);
    free(q), free(ref);
    fx_free(&f);
}

/* A decode step: every sequence grows by one position whose key and value the call stores,
 * rows in a shuffled order. The whole cache afterwards equals the CPU's. */
static void check_store(const dcase_t *d, int window, uint64_t seed) {
    fx_t f;
    fx_init(&f, d, seed);
    const int order[NSEQ] = {3, 0, FORK, 1, 2};
    rows_t r = {0};
    for (int i = 0; i < NSEQ; i++) {
        int b = order[i], len = f.s[b].len;
        TU_CHECK_RC(kv_seq_grow(&f.c, &f.s[b], len + 1, &f.budget[b]));
        rows_add(&r, &f, b, len);
    }
    int H = d->H, Dh = d->Dh;
    size_t nq = (size_t)r.N * H * Dh, nk = (size_t)r.N * f.c.row, nc = cache_floats(&f.c);
    float scale = 1.0f / sqrtf((float)Dh);
    float *q = hrand(nq, seed + 11, -2.0f, 2.0f);
    float *k = hrand(nk, seed + 12, -1.0f, 1.0f), *v = hrand(nk, seed + 13, -1.0f, 1.0f);
    float *pre = hcopy(f.c.mem, nc), *ref = malloc(sizeof(float) * nq);
    tu_poison(ref, nq);
    attn_decode_store_forward(ref, q, k, v, &f.c, LAYER, r.seqs, r.pos, r.N, H, scale, window);
    for (int si = 0; si < NSPLITS; si++) {
        char w[160];
        snprintf(w, sizeof w, "store H %d Hkv %d Dh %d window %d splits %d", H, d->Hkv, Dh, window,
                 SPLITS[si]);
        dcall_t g;
        dev_init(&g, &f, pre, &r, q, k, v);
        TU_CHECK_RC(dev_run(&g, &f, &r, 1, scale, window, SPLITS[si]));
        float *out = dget_f(g.out, nq), *mem = dget_f(g.cache, nc);
        TU_ASSERT_CLOSE(err(out, ref, nq), TOL_F32, w);
        int same = memcmp(mem, f.c.mem, sizeof(float) * nc) == 0;
        if (!same)
            tu_report("%s: the cache differs from the CPU's", w);
        CU_ASSERT(same);
        /* again over the stored cache: the same stores, the same bits */
        float *again = hcopy(out, nq);
        tu_poison(again, nq);
        dset(g.out, again, sizeof(float) * nq);
        TU_CHECK_RC(dev_run(&g, &f, &r, 1, scale, window, SPLITS[si]));
        dget(again, g.out, sizeof(float) * nq);
        same = memcmp(out, again, sizeof(float) * nq) == 0;
        if (!same)
            tu_report("%s: a repeated call differs", w);
        CU_ASSERT(same);
        free(again), free(out), free(mem);
        dev_free(&g);
    }
    free(q), free(k), free(v), free(pre), free(ref);
    fx_free(&f);
}

static void test_forward(void) {
    for (int c = 0; c < NCASES; c++)
        check_forward(&CASES[c], 0, 100 + 10 * (uint64_t)c);
}

static void test_forward_window(void) {
    for (int c = 0; c < NCASES; c++) {
        check_forward(&CASES[c], 5, 200 + 10 * (uint64_t)c);
        check_forward(&CASES[c], 300, 300 + 10 * (uint64_t)c);
    }
}

static void test_store(void) {
    for (int c = 0; c < NCASES; c++) {
        check_store(&CASES[c], 0, 400 + 10 * (uint64_t)c);
        check_store(&CASES[c], 5, 500 + 10 * (uint64_t)c);
    }
}

/* A row past its table and a row whose table names a block outside the cache: their
 * outputs are NaN and they store nothing; the good row beside them is unaffected. */
static void test_bad_rows(void) {
    const dcase_t d = {8, 2, 64};
    fx_t f;
    fx_init(&f, &d, 600);
    int len = f.s[1].len;
    TU_CHECK_RC(kv_seq_grow(&f.c, &f.s[1], len + 1, &f.budget[1]));
    rows_t r = {0};
    rows_add(&r, &f, 1, len);
    rows_add(&r, &f, 3, 600); /* seq 3 holds 38 blocks: 608 positions; set below */
    rows_add(&r, &f, 2, 39);
    int H = d.H, Dh = d.Dh;
    size_t nq = (size_t)r.N * H * Dh, nk = (size_t)r.N * f.c.row, nc = cache_floats(&f.c);
    size_t per = (size_t)H * Dh;
    float scale = 0.125f;
    float *q = hrand(nq, 601, -2.0f, 2.0f);
    float *k = hrand(nk, 602, -1.0f, 1.0f), *v = hrand(nk, 603, -1.0f, 1.0f);
    float *pre = hcopy(f.c.mem, nc), *ref = malloc(sizeof(float) * per);
    tu_poison(ref, per);
    attn_decode_store_forward(ref, q, k, v, &f.c, LAYER, r.seqs, r.pos, 1, H, scale, 0);
    dcall_t g;
    dev_init(&g, &f, pre, &r, q, k, v);
    /* row 1 past its table (max_blocks BS), row 2 naming block NB */
    int32_t bad_pos[3] = {r.pos[0], g.max_blocks * BS, r.pos[2]};
    dset(g.pos, bad_pos, sizeof bad_pos);
    int32_t nb = f.c.n_blocks;
    dset(g.tables + (size_t)2 * g.max_blocks + 1, &nb, sizeof nb);
    TU_CHECK_RC(dev_run(&g, &f, &r, 1, scale, 0, 0));
    float *out = dget_f(g.out, nq), *mem = dget_f(g.cache, nc);
    TU_ASSERT_CLOSE(err(out, ref, per), TOL_F32, "the good row");
    int nan = 1;
    for (size_t e = per; e < nq; e++)
        nan &= isnan(out[e]) != 0;
    CU_ASSERT(nan);
    CU_ASSERT(memcmp(mem, f.c.mem, sizeof(float) * nc) == 0);
    free(out), free(mem);
    dev_free(&g);
    free(q), free(k), free(v), free(pre), free(ref);
    fx_free(&f);
}

static void test_arguments(void) {
    float x = 0.0f;
    int32_t t = 0;
    /* H not a multiple of Hkv */
    CU_ASSERT_EQUAL(
        cuda_attn_decode(&x, &x, NULL, NULL, &x, 1, 1, 16, 4, 8, 0, &t, 1, &t, 1, 6, 1.0f, 0, 0),
        MO_EINVAL);
    /* layer outside the cache */
    CU_ASSERT_EQUAL(
        cuda_attn_decode(&x, &x, NULL, NULL, &x, 1, 1, 16, 2, 8, 1, &t, 1, &t, 1, 4, 1.0f, 0, 0),
        MO_EINVAL);
    /* a key without a value */
    CU_ASSERT_EQUAL(
        cuda_attn_decode(&x, &x, &x, NULL, &x, 1, 1, 16, 2, 8, 0, &t, 1, &t, 1, 4, 1.0f, 0, 0),
        MO_EINVAL);
    /* negative window, negative splits */
    CU_ASSERT_EQUAL(
        cuda_attn_decode(&x, &x, NULL, NULL, &x, 1, 1, 16, 2, 8, 0, &t, 1, &t, 1, 4, 1.0f, -1, 0),
        MO_EINVAL);
    CU_ASSERT_EQUAL(
        cuda_attn_decode(&x, &x, NULL, NULL, &x, 1, 1, 16, 2, 8, 0, &t, 1, &t, 1, 4, 1.0f, 0, -1),
        MO_EINVAL);
    /* no rows: nothing to do */
    CU_ASSERT_EQUAL(cuda_attn_decode(NULL, NULL, NULL, NULL, NULL, 1, 1, 16, 2, 8, 0, NULL, 1, NULL,
                                     0, 4, 1.0f, 0, 0),
                    MO_OK);
    CU_ASSERT_EQUAL(g_gpu->synchronize(g_gpu), 0);
}

static CU_TestInfo g_tests[] = {
    {"arguments", test_arguments},
    {"forward against the CPU", test_forward},
    {"forward with windows", test_forward_window},
    {"store and attend against the CPU", test_store},
    {"rows outside their tables", test_bad_rows},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!(g_gpu = gpu_suite_backend("gpu_attn_decode", &rc)))
        return rc;
    return tu_main("gpu_attn_decode", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_attn_decode"); }
#endif
