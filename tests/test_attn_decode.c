/* Tests for rollout/attn_decode: attention of new rows over a paged KV cache against the
 * packed causal attention kernel (GQA, sliding windows, sequences spanning several
 * blocks, shared blocks after a fork, one row per sequence and whole chunks), the
 * store-and-attend call, and the same bits on one and two threads. */
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
        {"store and attend in one call, 1 and 2 threads", test_store_forward},
        CU_TEST_INFO_NULL,
    };
    return tu_main("attn_decode", tests);
}
