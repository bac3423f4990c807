/* Tests for rollout/kv_cache: budget accounting in blocks, reservations that wait when
 * the cache is full and fail when they never fit, growing, rows stored and read back,
 * forks that share full blocks and copy the partial one, and freeing with the last
 * holder; the latent (keys-only) cache of MLA: its size per token, rows and forks, and
 * attention over it with absorbed up-projections against the expanded keys and values. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "rollout/attn_decode.h"
#include "rollout/kv_cache.h"
#include "tests/testutil.h"

enum { L = 3, HKV = 2, DH = 4, BS = 4 };

/* Writes a recognisable row for (seq tag, layer, pos). */
static void fill_row(float *r, int tag, int l, int pos) {
    for (int i = 0; i < HKV * DH; i++)
        r[i] = (float)(tag * 10000 + l * 1000 + pos * 10 + i % 10) + 0.5f;
}

static int row_is(const float *r, int tag, int l, int pos) {
    float want[HKV * DH];
    fill_row(want, tag, l, pos);
    return memcmp(r, want, sizeof want) == 0;
}

static void write_rows(kv_cache_t *c, kv_seq_t *s, int tag, int from, int to) {
    float k[HKV * DH], v[HKV * DH];
    for (int l = 0; l < L; l++)
        for (int p = from; p < to; p++) {
            fill_row(k, tag, l, p);
            fill_row(v, -tag, l, p);
            kv_write(c, s, l, p, k, v);
        }
}

static int rows_ok(kv_cache_t *c, kv_seq_t *s, int tag, int from, int to) {
    int ok = 1;
    float k[HKV * DH], v[HKV * DH];
    for (int l = 0; l < L; l++)
        for (int p = from; p < to; p++) {
            tu_poison(k, HKV * DH);
            tu_poison(v, HKV * DH);
            kv_read(c, s, l, p, k, v);
            ok &= row_is(k, tag, l, p) && row_is(v, -tag, l, p);
        }
    return ok;
}

static void test_budget(void) {
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&c, L, HKV, DH, 30, BS), 0);
    CU_ASSERT_EQUAL(c.n_blocks, 8); /* ceil(30 / 4) */
    CU_ASSERT_EQUAL(kv_cache_blocks_for(&c, 0), 0);
    CU_ASSERT_EQUAL(kv_cache_blocks_for(&c, 1), 1);
    CU_ASSERT_EQUAL(kv_cache_blocks_for(&c, 4), 1);
    CU_ASSERT_EQUAL(kv_cache_blocks_for(&c, 5), 2);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 8);
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 5), 1);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 3);
    /* Does not fit now: refused without change (the request waits). */
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 4), 0);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 3);
    /* Never fits: an error naming the sizes. */
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 9), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "8 blocks"));
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 3), 1);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 0);
    kv_cache_unreserve(&c, 4);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 4);
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 4), 1);
    kv_cache_unreserve(&c, 8);
    CU_ASSERT_EQUAL(c.reserved, 0);
    kv_cache_free(&c);
    CU_ASSERT_EQUAL(kv_cache_init(&c, L, HKV, DH, 0, BS), MO_EINVAL);
    CU_ASSERT_EQUAL(kv_cache_init(&c, 0, HKV, DH, 10, BS), MO_EINVAL);
}

static void test_grow_rows(void) {
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&c, L, HKV, DH, 64, BS), 0);
    int64_t budget = 3;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, budget), 1);
    kv_seq_t a = {0};
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &a, 6, &budget), 0);
    CU_ASSERT_EQUAL(a.len, 6);
    CU_ASSERT_EQUAL(a.n_blocks, 2);
    CU_ASSERT_EQUAL(budget, 1);
    CU_ASSERT_EQUAL(c.reserved, 1);
    CU_ASSERT_EQUAL(kv_cache_used_tokens(&c), 8);
    write_rows(&c, &a, 1, 0, 6);
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &a, 8, &budget), 0); /* same block */
    CU_ASSERT_EQUAL(budget, 1);
    write_rows(&c, &a, 1, 6, 8);
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &a, 12, &budget), 0);
    CU_ASSERT_EQUAL(budget, 0);
    write_rows(&c, &a, 1, 8, 12);
    /* Past the reservation: a state error, nothing taken. */
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &a, 13, &budget), MO_ESTATE);
    CU_ASSERT_EQUAL(kv_cache_used_tokens(&c), 12);
    CU_ASSERT(rows_ok(&c, &a, 1, 0, 12));
    /* Position p is slot p % BS of block p / BS: keys (Hkv, Dh, BS), values (Hkv, BS, Dh). */
    float want[HKV * DH];
    fill_row(want, 1, 1, 5);
    CU_ASSERT_EQUAL(kv_k_block(&c, 1, a.blocks[1])[1 * DH * BS + 2 * BS + 1], want[DH + 2]);
    fill_row(want, -1, 1, 5);
    CU_ASSERT_EQUAL(kv_v_block(&c, 1, a.blocks[1])[(1 * BS + 1) * DH + 2], want[DH + 2]);
    kv_seq_release(&c, &a);
    CU_ASSERT_EQUAL(c.n_free, c.n_blocks);
    CU_ASSERT_EQUAL(a.len, 0);
    CU_ASSERT_PTR_NULL(a.blocks);
    kv_cache_free(&c);
}

static void test_fork_share(void) {
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&c, L, HKV, DH, 64, BS), 0);
    int64_t b0 = 4, b1 = 2, b2 = 1;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, b0 + b1 + b2), 1);
    kv_seq_t src = {0}, d1 = {0}, d2 = {0};
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &src, 10, &b0), 0); /* blocks: full, full, partial */
    write_rows(&c, &src, 7, 0, 10);
    CU_ASSERT_EQUAL(kv_seq_fork(&c, &d1, &src, &b1), 0);
    CU_ASSERT_EQUAL(d1.len, 10);
    CU_ASSERT_EQUAL(b1, 1); /* the partial block's copy */
    CU_ASSERT_EQUAL(d1.blocks[0], src.blocks[0]);
    CU_ASSERT_EQUAL(d1.blocks[1], src.blocks[1]);
    CU_ASSERT(d1.blocks[2] != src.blocks[2]);
    CU_ASSERT_EQUAL(c.ref[src.blocks[0]], 2);
    CU_ASSERT_EQUAL(c.ref[src.blocks[2]], 1);
    CU_ASSERT(rows_ok(&c, &d1, 7, 0, 10));
    /* Writes after the fork stay private. */
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &d1, 12, &b1), 0);
    write_rows(&c, &d1, 8, 10, 12);
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &src, 12, &b0), 0);
    write_rows(&c, &src, 9, 10, 12);
    CU_ASSERT(rows_ok(&c, &d1, 8, 10, 12));
    CU_ASSERT(rows_ok(&c, &src, 9, 10, 12));
    CU_ASSERT(rows_ok(&c, &d1, 7, 0, 10));
    /* A fork at a block boundary copies nothing; budget is untouched. */
    kv_seq_t edge = {0};
    int64_t be = 2;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, be), 1);
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &edge, 8, &be), 0);
    CU_ASSERT_EQUAL(kv_seq_fork(&c, &d2, &edge, &b2), 0);
    CU_ASSERT_EQUAL(b2, 1);
    CU_ASSERT_EQUAL(c.ref[edge.blocks[1]], 2);
    /* A block is freed with its last holder. */
    int free0 = c.n_free;
    kv_seq_release(&c, &src); /* its 3 blocks: 2 shared with d1, 1 private */
    CU_ASSERT_EQUAL(c.n_free, free0 + 1);
    CU_ASSERT(rows_ok(&c, &d1, 7, 0, 10));
    kv_seq_release(&c, &d1);
    CU_ASSERT_EQUAL(c.n_free, free0 + 1 + 3);
    kv_seq_release(&c, &edge);
    kv_seq_release(&c, &d2);
    CU_ASSERT_EQUAL(c.n_free, c.n_blocks);
    kv_cache_unreserve(&c, b0 + b1 + b2);
    CU_ASSERT_EQUAL(c.reserved, 0);
    CU_ASSERT_EQUAL(kv_cache_available(&c), c.n_blocks);
    kv_cache_free(&c);
}

/* A full cache makes the next reservation wait until a sequence is released. */
/* Without memory (kv_cache_drop_memory, the device's cache): the same bookkeeping. */
static void test_no_memory(void) {
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&c, L, HKV, DH, 64, BS), 0);
    kv_cache_drop_memory(&c);
    CU_ASSERT_PTR_NULL(c.mem);
    CU_ASSERT_EQUAL(c.n_free, c.n_blocks);
    int64_t b0 = 3, b1 = 1;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, b0 + b1), 1);
    kv_seq_t src = {0}, d = {0};
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &src, 10, &b0), 0);
    CU_ASSERT_EQUAL(kv_seq_fork(&c, &d, &src, &b1), 0);
    CU_ASSERT_EQUAL(b1, 0);
    CU_ASSERT_EQUAL(d.n_blocks, 3);
    CU_ASSERT_EQUAL(d.blocks[1], src.blocks[1]);
    CU_ASSERT(d.blocks[2] != src.blocks[2]); /* the caller copies it */
    CU_ASSERT_EQUAL(c.ref[src.blocks[0]], 2);
    kv_seq_release(&c, &src);
    kv_seq_release(&c, &d);
    CU_ASSERT_EQUAL(c.n_free, c.n_blocks);
    kv_cache_unreserve(&c, b0);
    CU_ASSERT_EQUAL(c.reserved, 0);
    kv_cache_free(&c);
}

static void test_wait_until_freed(void) {
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&c, L, HKV, DH, 16, BS), 0);
    int64_t b = 4;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, b), 1);
    kv_seq_t s = {0};
    CU_ASSERT_EQUAL(kv_seq_grow(&c, &s, 16, &b), 0);
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 1), 0);
    CU_ASSERT_EQUAL(kv_cache_available(&c), 0);
    kv_seq_release(&c, &s);
    CU_ASSERT_EQUAL(kv_cache_reserve(&c, 4), 1);
    kv_cache_unreserve(&c, 4);
    kv_cache_free(&c);
}

/* Latent cache: one row of W floats per token and layer, no values. */
static void test_latent_rows(void) {
    enum { W = 7 };
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init_latent(&c, L, W, 20, BS), 0);
    CU_ASSERT_EQUAL(c.parts, 1);
    CU_ASSERT_PTR_NULL(kv_v_block(&c, 0, 0));
    CU_ASSERT_EQUAL(kv_cache_token_bytes(&c), sizeof(float) * L * W);
    kv_cache_t e;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init(&e, L, HKV, DH, 20, BS), 0);
    CU_ASSERT_EQUAL(kv_cache_token_bytes(&e), 2 * sizeof(float) * L * HKV * DH);
    kv_cache_free(&e);
    CU_ASSERT_EQUAL(kv_cache_init_latent(&e, L, 0, 20, BS), MO_EINVAL);
    int64_t b = 5;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, b), 1);
    kv_seq_t s = {0}, f = {0};
    CU_ASSERT_EQUAL_FATAL(kv_seq_grow(&c, &s, 6, &b), 0);
    float r[W], got[W];
    for (int l = 0; l < L; l++)
        for (int p = 0; p < 6; p++) {
            for (int i = 0; i < W; i++)
                r[i] = (float)(l * 100 + p * 10 + i) + 0.25f;
            kv_write(&c, &s, l, p, r, NULL);
        }
    CU_ASSERT_EQUAL_FATAL(kv_seq_fork(&c, &f, &s, &b), 0); /* the partial block copied */
    CU_ASSERT_EQUAL(f.blocks[0], s.blocks[0]);
    CU_ASSERT_NOT_EQUAL(f.blocks[1], s.blocks[1]);
    int ok = 1;
    for (int l = 0; l < L; l++)
        for (int p = 0; p < 6; p++) {
            for (int k = 0; k < 2; k++) {
                tu_poison(got, W);
                kv_read(&c, k ? &f : &s, l, p, got, NULL);
                for (int i = 0; i < W; i++)
                    ok &= got[i] == (float)(l * 100 + p * 10 + i) + 0.25f;
            }
        }
    CU_ASSERT(ok);
    kv_seq_release(&c, &f);
    kv_seq_release(&c, &s);
    kv_cache_unreserve(&c, b);
    CU_ASSERT_EQUAL(kv_cache_used_tokens(&c), 0);
    kv_cache_free(&c);
}

/* MLA decode attention two ways on random numbers: expanded, per head keys [W_UK c_j |
 * k_pe_j] and values W_UV c_j scored by [q_nope | q_pe] (double precision); absorbed,
 * [W_UK^T q_nope | q_pe] attended over the latent rows [c_j | k_pe_j] in the cache, the
 * result times W_UV. Relative error within 1e-5. */
enum { LH = 3, RKV = 10, DN = 6, DR = 4, DV = 5, LW = RKV + DR, NQ = 3 };

static void expanded_ref(double *out, const float *q, const float *lat, const float *wkvb, int h,
                         int n, float scale) {
    double sc[64], mx = -INFINITY, sum = 0.0;
    const float *wk = wkvb + (size_t)h * (DN + DV) * RKV, *wv = wk + (size_t)DN * RKV;
    for (int j = 0; j < n; j++) {
        const float *cj = lat + (size_t)j * LW;
        double a = 0.0;
        for (int d = 0; d < DN; d++) {
            double k = 0.0;
            for (int cc = 0; cc < RKV; cc++)
                k += (double)wk[d * RKV + cc] * cj[cc];
            a += (double)q[d] * k;
        }
        for (int d = 0; d < DR; d++)
            a += (double)q[DN + d] * cj[RKV + d];
        sc[j] = a * scale;
        mx = fmax(mx, sc[j]);
    }
    for (int v = 0; v < DV; v++)
        out[v] = 0.0;
    for (int j = 0; j < n; j++) {
        double e = exp(sc[j] - mx);
        sum += e;
        for (int v = 0; v < DV; v++) {
            double x = 0.0;
            for (int cc = 0; cc < RKV; cc++)
                x += (double)wv[v * RKV + cc] * lat[(size_t)j * LW + cc];
            out[v] += e * x;
        }
    }
    for (int v = 0; v < DV; v++)
        out[v] /= sum;
}

static void test_latent_attention(void) {
    const int len[NQ] = {1, 9, 23}; /* within one block, across blocks, partial last */
    float lat[23 * LW], q[NQ * LH * (DN + DR)], wkvb[LH * (DN + DV) * RKV];
    tu_fill(lat, sizeof lat / sizeof *lat, 11, -1.0f, 1.0f);
    tu_fill(q, sizeof q / sizeof *q, 12, -1.0f, 1.0f);
    tu_fill(wkvb, sizeof wkvb / sizeof *wkvb, 13, -0.5f, 0.5f);
    kv_cache_t c;
    CU_ASSERT_EQUAL_FATAL(kv_cache_init_latent(&c, 2, LW, 96, BS), 0);
    int64_t b =
        kv_cache_blocks_for(&c, 1) + kv_cache_blocks_for(&c, 9) + kv_cache_blocks_for(&c, 23);
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&c, b), 1);
    kv_seq_t s[NQ] = {{0}};
    const kv_seq_t *sp[NQ];
    int32_t pos[NQ];
    for (int i = 0; i < NQ; i++) {
        CU_ASSERT_EQUAL_FATAL(kv_seq_grow(&c, &s[i], len[i], &b), 0);
        for (int p = 0; p < len[i]; p++)
            kv_write(&c, &s[i], 1, p, lat + (size_t)p * LW, NULL); /* a shared prefix */
        sp[i] = &s[i];
        pos[i] = len[i] - 1;
    }
    float ql[NQ * LH * LW], ctx[NQ * LH * RKV];
    for (int ih = 0; ih < NQ * LH; ih++) { /* absorb W_UK */
        const float *qh = q + (size_t)ih * (DN + DR);
        const float *wk = wkvb + (size_t)(ih % LH) * (DN + DV) * RKV;
        for (int cc = 0; cc < RKV; cc++) {
            float a = 0.0f;
            for (int d = 0; d < DN; d++)
                a += qh[d] * wk[d * RKV + cc];
            ql[(size_t)ih * LW + cc] = a;
        }
        memcpy(ql + (size_t)ih * LW + RKV, qh + DN, sizeof(float) * DR);
    }
    tu_poison(ctx, NQ * LH * RKV);
    attn_decode_latent(ctx, ql, &c, 1, sp, pos, NQ, LH, RKV, 0.4f);
    double err = 0.0;
    for (int ih = 0; ih < NQ * LH; ih++) {
        int h = ih % LH;
        double want[DV];
        expanded_ref(want, q + (size_t)ih * (DN + DR), lat, wkvb, h, len[ih / LH], 0.4f);
        const float *wv = wkvb + ((size_t)h * (DN + DV) + DN) * RKV;
        for (int v = 0; v < DV; v++) {
            double x = 0.0;
            for (int cc = 0; cc < RKV; cc++)
                x += (double)wv[v * RKV + cc] * ctx[(size_t)ih * RKV + cc];
            err = fmax(err, fabs(x - want[v]) / fmax(fabs(want[v]), 1e-2));
        }
    }
    TU_ASSERT_CLOSE(err, 1e-5, "absorbed vs expanded MLA attention (relative)");
    for (int i = 0; i < NQ; i++)
        kv_seq_release(&c, &s[i]);
    kv_cache_unreserve(&c, b);
    kv_cache_free(&c);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"budget and reservations", test_budget},
        {"grow, rows, release", test_grow_rows},
        {"fork: shared full blocks, private partial block", test_fork_share},
        {"waiting until a sequence is freed", test_wait_until_freed},
        {"bookkeeping without memory", test_no_memory},
        {"latent cache: size, rows, fork", test_latent_rows},
        {"latent attention with absorbed up-projections vs expanded", test_latent_attention},
        CU_TEST_INFO_NULL,
    };
    return tu_main("kv_cache", tests);
}
