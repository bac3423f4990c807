/* Tests for rollout/attn_decode: attention of new rows over a paged KV cache against the
 * packed causal attention kernel (GQA, sliding windows, sequences spanning several
 * blocks, shared blocks after a fork, one row per sequence and whole chunks), rows
 * attended in groups over shared blocks against each row alone, the store-and-attend
 * call, and the same bits on one and two threads. */
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cpu/cpu_kernels.h"
#include "rollout/attn_decode.h"
#include "tests/testutil.h"

enum { H = 4, HKV = 2, DH = 8, BS = 4, NSEQ = 3 };

typedef struct fx {
    int lens[NSEQ];
    int32_t cu[NSEQ + 1];
    int T;
    float *q, *k, *v, *ref, *lse; /* (T, H, DH), (T, HKV, DH) x2, (T, H, DH), (T, H) */
    kv_cache_t c;
    kv_seq_t s[NSEQ];
} fx_t;

/* Sequences of lengths 1, 9 and 22 with random q, k, v; the reference packed attention;
 * their keys and values written into layer 1 of a cache with 4-token blocks. */
static void fx_init(fx_t *f, int window) {
    const int lens[NSEQ] = {1, 9, 22};
    memcpy(f->lens, lens, sizeof lens);
    f->cu[0] = 0;
    for (int b = 0; b < NSEQ; b++)
        f->cu[b + 1] = f->cu[b] + lens[b];
    f->T = f->cu[NSEQ];
    size_t nq = (size_t)f->T * H * DH, nk = (size_t)f->T * HKV * DH;
    f->q = malloc(sizeof(float) * nq);
    f->k = malloc(sizeof(float) * nk);
    f->v = malloc(sizeof(float) * nk);
    f->ref = malloc(sizeof(float) * nq);
    f->lse = malloc(sizeof(float) * (size_t)f->T * H);
    tu_fill(f->q, nq, 1, -1.5f, 1.5f);
    tu_fill(f->k, nk, 2, -1.5f, 1.5f);
    tu_fill(f->v, nk, 3, -1.0f, 1.0f);
    tu_poison(f->ref, nq);
    cpu_attention_forward(f->ref, f->lse, f->q, f->k, f->v, f->cu, NSEQ, H, HKV, DH, 0.35f, window);
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&f->c, 2, HKV, DH, 256, BS), 0);
    for (int b = 0; b < NSEQ; b++) {
        int64_t budget = 16;
        CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f->c, budget), 1);
        memset(&f->s[b], 0, sizeof f->s[b]);
        CU_ASSERT_EQUAL_FATAL(kv_seq_grow(&f->c, &f->s[b], lens[b], &budget), 0);
        kv_cache_unreserve(&f->c, budget);
        for (int t = 0; t < lens[b]; t++) {
            size_t r = (size_t)(f->cu[b] + t) * HKV * DH;
            kv_write(&f->c, &f->s[b], 1, t, f->k + r, f->v + r);
        }
    }
}

static void fx_free(fx_t *f) {
    for (int b = 0; b < NSEQ; b++)
        kv_seq_release(&f->c, &f->s[b]);
    kv_cache_free(&f->c);
    free(f->q);
    free(f->k);
    free(f->v);
    free(f->ref);
    free(f->lse);
}

/* Every token of every sequence as a row (a whole chunk per sequence). */
static void check_all_rows(int window) {
    fx_t f;
    fx_init(&f, window);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)f.T);
    const kv_seq_t **seqs = malloc(sizeof *seqs * (size_t)f.T);
    for (int b = 0; b < NSEQ; b++)
        for (int t = 0; t < f.lens[b]; t++) {
            pos[f.cu[b] + t] = t;
            seqs[f.cu[b] + t] = &f.s[b];
        }
    size_t nq = (size_t)f.T * H * DH;
    float *out = malloc(sizeof(float) * nq);
    tu_poison(out, nq);
    attn_decode_forward(out, f.q, &f.c, 1, seqs, pos, f.T, H, 0.35f, window);
    TU_ASSERT_CLOSE(tu_rel_err_ff(out, f.ref, nq, 1.0), 2e-6, "all rows vs packed attention");
    free(out);
    free(pos);
    free(seqs);
    fx_free(&f);
}

static void test_all_rows(void) {
    check_all_rows(0);
}

static void test_window(void) {
    check_all_rows(5);
    check_all_rows(1);
}

/* The last token of each sequence only, in a shuffled order, on 1 and 2 threads. */
static void test_last_rows_threads(void) {
    fx_t f;
    fx_init(&f, 6);
    int order[NSEQ] = {2, 0, 1};
    int32_t pos[NSEQ];
    const kv_seq_t *seqs[NSEQ];
    float q[NSEQ * H * DH], ref[NSEQ * H * DH], out[2][NSEQ * H * DH];
    for (int i = 0; i < NSEQ; i++) {
        int b = order[i], row = f.cu[b + 1] - 1;
        pos[i] = f.lens[b] - 1;
        seqs[i] = &f.s[b];
        memcpy(q + i * H * DH, f.q + (size_t)row * H * DH, sizeof(float) * H * DH);
        memcpy(ref + i * H * DH, f.ref + (size_t)row * H * DH, sizeof(float) * H * DH);
    }
    int threads = backend_cpu_threads();
    for (int r = 0; r < 2; r++) {
        backend_cpu_set_threads(r + 1);
        tu_poison(out[r], NSEQ * H * DH);
        attn_decode_forward(out[r], q, &f.c, 1, seqs, pos, NSEQ, H, 0.35f, 6);
    }
    backend_cpu_set_threads(threads);
    TU_ASSERT_CLOSE(tu_rel_err_ff(out[0], ref, NSEQ * H * DH, 1.0), 2e-6, "last rows");
    CU_ASSERT(memcmp(out[0], out[1], sizeof out[0]) == 0);
    fx_free(&f);
}

/* A fork reads the shared blocks and its private copy of the partial one. */
static void test_forked_sequence(void) {
    fx_t f;
    fx_init(&f, 0);
    kv_seq_t fork = {0};
    int64_t budget = 1;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f.c, budget), 1);
    CU_ASSERT_EQUAL_FATAL(kv_seq_fork(&f.c, &fork, &f.s[2], &budget), 0);
    int b = 2, row = f.cu[b + 1] - 1;
    int32_t pos = f.lens[b] - 1;
    const kv_seq_t *seqs[1] = {&fork};
    float out[H * DH];
    tu_poison(out, H * DH);
    attn_decode_forward(out, f.q + (size_t)row * H * DH, &f.c, 1, seqs, &pos, 1, H, 0.35f, 0);
    TU_ASSERT_CLOSE(tu_rel_err_ff(out, f.ref + (size_t)row * H * DH, H * DH, 1.0), 2e-6,
                    "forked sequence");
    kv_seq_release(&f.c, &fork);
    fx_free(&f);
}

/* Forks of a sequence next to it in a batch (their full blocks shared, read once for
 * all of them) give the bits each row gives on its own, and the reference. */
static void test_shared_prefix_batch(void) {
    fx_t f;
    fx_init(&f, 0);
    enum { NF = 3, NR = NF + 2 };
    kv_seq_t forks[NF];
    memset(forks, 0, sizeof forks);
    int64_t budget = NF;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f.c, budget), 1);
    for (int k = 0; k < NF; k++)
        CU_ASSERT_EQUAL_FATAL(kv_seq_fork(&f.c, &forks[k], &f.s[2], &budget), 0);
    const kv_seq_t *seqs[NR] = {&f.s[1], &f.s[2], &forks[0], &forks[1], &forks[2]};
    /* rows: last token of sequence 1; then sequence 2 and its forks at positions 21, 21,
     * 19 and 8 (the last two inside the shared blocks), with queries of other rows */
    int32_t pos[NR] = {8, 21, 21, 19, 8};
    int qrow[NR] = {f.cu[2] - 1, f.cu[3] - 1, 3, f.cu[2] + 19, f.cu[2] + 8};
    float q[NR * H * DH], out[NR * H * DH], alone[H * DH];
    for (int i = 0; i < NR; i++)
        memcpy(q + i * H * DH, f.q + (size_t)qrow[i] * H * DH, sizeof(float) * H * DH);
    tu_poison(out, NR * H * DH);
    attn_decode_forward(out, q, &f.c, 1, seqs, pos, NR, H, 0.35f, 0);
    for (int i = 0; i < NR; i++) {
        tu_poison(alone, H * DH);
        attn_decode_forward(alone, q + i * H * DH, &f.c, 1, seqs + i, pos + i, 1, H, 0.35f, 0);
        CU_ASSERT(memcmp(alone, out + i * H * DH, sizeof alone) == 0);
    }
    TU_ASSERT_CLOSE(tu_rel_err_ff(out + H * DH, f.ref + (size_t)qrow[1] * H * DH, H * DH, 1.0),
                    2e-6, "sequence 2 among its forks");
    TU_ASSERT_CLOSE(
        tu_rel_err_ff(out + 4 * H * DH, f.ref + (size_t)(f.cu[2] + 8) * H * DH, H * DH, 1.0), 2e-6,
        "fork at position 8");
    for (int k = 0; k < NF; k++)
        kv_seq_release(&f.c, &forks[k]);
    fx_free(&f);
}

/* dst becomes a fork of src grown to len, its new positions holding keys and values of
 * its own (from seed). */
static void fork_grown(fx_t *f, kv_seq_t *dst, const kv_seq_t *src, int len, uint64_t seed,
                       int64_t *budget) {
    CU_ASSERT_EQUAL_FATAL(kv_seq_fork(&f->c, dst, src, budget), 0);
    int from = dst->len;
    CU_ASSERT_EQUAL_FATAL(kv_seq_grow(&f->c, dst, len, budget), 0);
    float k[HKV * DH], v[HKV * DH];
    for (int p = from; p < len; p++) {
        tu_fill(k, HKV * DH, seed + 2 * (uint64_t)p, -1.5f, 1.5f);
        tu_fill(v, HKV * DH, seed + 2 * (uint64_t)p + 1, -1.0f, 1.0f);
        kv_write(&f->c, dst, 1, p, k, v);
    }
}

/* The n rows (seqs, pos, queries q) attended together, on 1 and 2 threads, give each row
 * the bits it gets attended alone. */
static void check_rows_alone(const kv_cache_t *c, const kv_seq_t *const *seqs, const int32_t *pos,
                             int n, const float *q, int window) {
    size_t row = (size_t)H * DH;
    float *out = malloc(sizeof(float) * row * (size_t)n), alone[H * DH];
    int threads = backend_cpu_threads(), same = 1;
    for (int r = 1; r <= 2; r++) {
        backend_cpu_set_threads(r);
        tu_poison(out, row * (size_t)n);
        attn_decode_forward(out, q, c, 1, seqs, pos, n, H, 0.35f, window);
        for (int i = 0; i < n; i++) {
            tu_poison(alone, H * DH);
            attn_decode_forward(alone, q + (size_t)i * row, c, 1, seqs + i, pos + i, 1, H, 0.35f,
                                window);
            same &= memcmp(alone, out + (size_t)i * row, sizeof alone) == 0;
        }
    }
    backend_cpu_set_threads(threads);
    if (!same)
        tu_report("window %d: a row differs from the row alone", window);
    CU_ASSERT(same);
    free(out);
}

/* Groups of forks that share leading blocks and then go on with blocks of their own (of
 * different lengths, some rows inside the shared blocks), runs of forks longer than one
 * group, and rows that share nothing between them: every row's output is the bits it gets
 * alone, with and without sliding windows, on 1 and 2 threads. */
static void test_shared_groups(void) {
    fx_t f;
    fx_init(&f, 0);
    enum { NX = 17, NR = NX + 8 };
    kv_seq_t forks[NX + 5];
    memset(forks, 0, sizeof forks);
    int64_t budget = 48;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f.c, budget), 1);
    fork_grown(&f, &forks[0], &f.s[1], 14, 100, &budget);
    fork_grown(&f, &forks[1], &f.s[1], 9, 200, &budget);
    fork_grown(&f, &forks[2], &f.s[2], 31, 300, &budget);
    fork_grown(&f, &forks[3], &f.s[2], 26, 400, &budget);
    fork_grown(&f, &forks[4], &f.s[2], 22, 500, &budget);
    for (int k = 0; k < NX; k++)
        fork_grown(&f, &forks[5 + k], &f.s[2], 22 + k % 3, 600 + 100 * (uint64_t)k, &budget);
    /* sequence 0 alone, sequence 1 with a fork, sequence 2 with a fork, then the other
     * fork of sequence 1 between them, then the rest of sequence 2's forks */
    const kv_seq_t *seqs[NR] = {
        &f.s[0], &f.s[1], &forks[0], &f.s[2], &forks[2], &forks[1], &forks[3], &forks[4],
    };
    int32_t pos[NR];
    for (int i = 0; i < NR; i++) {
        if (i >= 8)
            seqs[i] = &forks[5 + i - 8];
        pos[i] = seqs[i]->len - 1;
    }
    pos[6] = 12; /* inside the shared blocks */
    pos[9] = 5;
    /* then three groups of sequence 2's family alone, enough work for two threads: fewer
     * groups than twice the threads, so each group's kv heads are split between tasks */
    enum { NFAM = NX + 4, NG = 48 };
    const kv_seq_t *fam[NG];
    int32_t fpos[NG];
    for (int i = 0; i < NG; i++) {
        int k = i % NFAM;
        fam[i] = k == 0 ? &f.s[2] : &forks[1 + k]; /* forks 2 .. NX + 4 */
        fpos[i] = fam[i]->len - 1;
    }
    float q[NG * H * DH];
    tu_fill(q, NG * H * DH, 11, -1.5f, 1.5f);
    const int windows[] = {0, 1, 3, 6, 13, 64};
    for (size_t w = 0; w < sizeof windows / sizeof windows[0]; w++) {
        check_rows_alone(&f.c, seqs, pos, NR, q, windows[w]);
        check_rows_alone(&f.c, fam, fpos, NG, q, windows[w]);
    }
    for (int k = 0; k < NX + 5; k++)
        kv_seq_release(&f.c, &forks[k]);
    kv_cache_unreserve(&f.c, budget);
    fx_free(&f);
}

/* attn_decode_store_forward stores each row's new key and value at its position, then
 * gives the bits attn_decode_forward gives over the stored cache, on 1 and 2 threads (with
 * fewer groups than twice the threads, a group's kv heads are split among tasks). */
static void test_store_forward(void) {
    fx_t f;
    fx_init(&f, 0);
    enum { NF = 2, NR = NF + 2 };
    kv_seq_t forks[NF];
    memset(forks, 0, sizeof forks);
    int64_t budget = 4 * NR;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&f.c, budget), 1);
    for (int k = 0; k < NF; k++)
        CU_ASSERT_EQUAL_FATAL(kv_seq_fork(&f.c, &forks[k], &f.s[2], &budget), 0);
    kv_seq_t *seqs[NR] = {&f.s[1], &f.s[2], &forks[0], &forks[1]};
    int32_t pos[NR];
    for (int i = 0; i < NR; i++) {
        pos[i] = seqs[i]->len;
        CU_ASSERT_EQUAL_FATAL(kv_seq_grow(&f.c, seqs[i], pos[i] + 1, &budget), 0);
    }
    float q[NR * H * DH], k[NR * HKV * DH], v[NR * HKV * DH];
    float out[2][NR * H * DH], again[NR * H * DH], kb[HKV * DH], vb[HKV * DH];
    tu_fill(q, NR * H * DH, 7, -1.5f, 1.5f);
    tu_fill(k, NR * HKV * DH, 8, -1.5f, 1.5f);
    tu_fill(v, NR * HKV * DH, 9, -1.0f, 1.0f);
    int threads = backend_cpu_threads();
    for (int r = 0; r < 2; r++) {
        backend_cpu_set_threads(r + 1);
        tu_poison(out[r], NR * H * DH);
        attn_decode_store_forward(out[r], q, k, v, &f.c, 1, (const kv_seq_t *const *)seqs, pos,
                                  NR, H, 0.35f, 0);
        for (int i = 0; i < NR; i++) {
            kv_read(&f.c, seqs[i], 1, pos[i], kb, vb);
            CU_ASSERT(memcmp(kb, k + i * HKV * DH, sizeof kb) == 0);
            CU_ASSERT(memcmp(vb, v + i * HKV * DH, sizeof vb) == 0);
        }
        tu_poison(again, NR * H * DH);
        attn_decode_forward(again, q, &f.c, 1, (const kv_seq_t *const *)seqs, pos, NR, H, 0.35f,
                            0);
        CU_ASSERT(memcmp(again, out[r], sizeof again) == 0);
    }
    backend_cpu_set_threads(threads);
    CU_ASSERT(memcmp(out[0], out[1], sizeof out[0]) == 0);
    for (int k2 = 0; k2 < NF; k2++)
        kv_seq_release(&f.c, &forks[k2]);
    fx_free(&f);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"all rows vs packed causal attention (GQA)", test_all_rows},
        {"sliding windows", test_window},
        {"last rows, shuffled, 1 vs 2 threads", test_last_rows_threads},
        {"forked sequence", test_forked_sequence},
        {"forks batched over shared blocks", test_shared_prefix_batch},
        {"groups sharing leading blocks vs each row alone", test_shared_groups},
        {"store and attend in one call, 1 and 2 threads", test_store_forward},
        CU_TEST_INFO_NULL,
    };
    return tu_main("attn_decode", tests);
}
