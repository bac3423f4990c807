/* gpu_model_decode: the CUDA decode step (model_cuda_decode, actor/model_cuda.h) against the
 * CPU engine's decode_forward + model_logits (rollout/decode.h) on tiny random Qwen3-MoE
 * models (3 layers, the middle one a dense MLP), f32 and bf16, and a tiny Mixtral (sliding
 * window 4, f32), with random norm weights and a random LoRA adapter on every linear
 * projection. Four sequences in a paged cache of 4-token blocks (prompts of 6, 1 and 11
 * tokens, and a fork of the first sharing its full blocks) are prefilled on the CPU; the
 * cache memory is copied to the device and two decode steps run there and on the CPU, with
 * and without the adapter. Compared by normalised error max|gpu - cpu| / max|cpu|: the
 * logits, and each new key and value the step stored in every layer; the rest of the cache
 * must be bitwise unchanged. Also: the routing output (f32: equal to the CPU's), a repeated
 * step gives the same bits and makes no new device allocations, and bad steps are refused
 * on the host. The sampling step (model_cuda_decode_sample, f32 Qwen3-MoE with the adapter)
 * against the CPU sampler (rollout/sampler.h) on the CPU step's logits, greedy and at
 * temperature 1 with top-k and top-p off and on: the tokens equal, the log-probabilities
 * within 1e-5 * max(|logp|, 1) plus twice the row's largest logit difference; and against
 * the CPU sampler on the device step's own logits within 1e-5 * max(|logp|, 1); bad
 * parameters give that row's status.
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "actor/model_cuda.h"
#include "core/arena.h"
#include "core/backend.h"
#include "core/cuda/backend_cuda.h"
#include "core/status.h"
#include "rollout/decode.h"
#include "rollout/kv_cache.h"
#include "rollout/sampler.h"
#include "tests/model_gpu_fixture.h"
#include "tests/testutil.h"

#include "tests/gpu_testutil.h"

/* bf16 weights: the device rounds the activations of bf16 products to bf16. */
#define TOL_BF16 1e-2
#define INIT_STD_F32 0.25f
#define INIT_STD_BF16 0.15f

#define NSEQ 4    /* sequences: three prompts and a fork of the first */
#define BS 4      /* tokens per cache block */
#define MAXB 8    /* table entries per row */
#define BUDGET 96 /* cache tokens: 24 blocks */
#define STEPS 2   /* decode steps */

static const int g_prompt[NSEQ - 1] = {6, 1, 11};

/* fx_open_model with logits in chunks of 3 rows (two chunks for 4 rows). */
static void fx_open(fx_t *f, model_arch_t arch, dtype_t dt, uint64_t seed) {
    fx_opts_t o = {INIT_STD_F32, INIT_STD_BF16, 3, 0.0f, 0};
    fx_open_model(f, arch, dt, seed, &o);
}

static int32_t tok_of(const model_t *m, uint64_t seed, uint64_t i) {
    return (int32_t)(rng_uniform(seed, 3, i) * (float)m->V) % m->V;
}

/* The CPU engine's state: the cache with the sequences, their weights and an arena. */
typedef struct cpu {
    kv_cache_t c;
    kv_seq_t seq[NSEQ];
    rl_weights_t w;
    arena_t ar;
    int64_t budget;
    int len[NSEQ];   /* tokens stored */
    int start[NSEQ]; /* the first position a decode step stored */
} cpu_t;

/* Prefills the three prompts (one prefill batch) and forks the first into the fourth. */
static void cpu_open(cpu_t *p, const model_t *m, uint64_t seed) {
    memset(p, 0, sizeof *p);
    TU_CHECK_RC(decode_kv_cache_init(&p->c, m, BUDGET, BS));
    TU_CHECK_RC(rl_weights_init(&p->w, m, 0));
    arena_init(&p->ar, 1 << 20);
    p->budget = p->c.n_blocks;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&p->c, p->budget), 1);
    int32_t tok[32], pos[32], cu[NSEQ];
    kv_seq_t *seqs[32];
    int N = 0;
    cu[0] = 0;
    for (int s = 0; s < NSEQ - 1; s++) {
        TU_CHECK_RC(kv_seq_grow(&p->c, &p->seq[s], g_prompt[s], &p->budget));
        for (int t = 0; t < g_prompt[s]; t++, N++) {
            tok[N] = tok_of(m, seed, (uint64_t)N);
            pos[N] = t;
            seqs[N] = &p->seq[s];
        }
        cu[s + 1] = N;
        p->len[s] = g_prompt[s];
    }
    float *x = malloc(sizeof(float) * (size_t)N * m->D);
    decode_batch_t db = {N, tok, pos, seqs, 1, NSEQ - 1, cu, NULL};
    TU_CHECK_RC(decode_forward(m, &p->w, &p->c, &p->ar, &db, x));
    free(x);
    TU_CHECK_RC(kv_seq_fork(&p->c, &p->seq[NSEQ - 1], &p->seq[0], &p->budget));
    p->len[NSEQ - 1] = p->len[0];
    memcpy(p->start, p->len, sizeof p->start);
}

static void cpu_close(cpu_t *p) {
    for (int s = 0; s < NSEQ; s++)
        kv_seq_release(&p->c, &p->seq[s]);
    kv_cache_free(&p->c);
    rl_weights_free(&p->w);
    arena_free(&p->ar);
}

static size_t cache_floats(const kv_cache_t *c) {
    return (size_t)c->L * c->n_blocks * c->parts * c->block_tokens * c->row;
}

/* cpu_open (seed 41) with room for every step's token, then the cache memory on the device
 * (*nc floats). The room is taken before the upload: kv_seq_grow zeroes the keys of a block
 * it takes, in host memory. */
static float *cpu_open_upload(cpu_t *p, const model_t *m, size_t *nc) {
    cpu_open(p, m, 41);
    for (int s = 0; s < NSEQ; s++)
        TU_CHECK_RC(kv_seq_grow(&p->c, &p->seq[s], p->len[s] + STEPS, &p->budget));
    *nc = cache_floats(&p->c);
    return dput(p->c.mem, sizeof(float) * *nc);
}

/* One decode step of every sequence on the CPU: logits (NSEQ, V) and routing. The
 * sequences must already hold the positions pos. */
static void cpu_step(cpu_t *p, const model_t *m, const int32_t *tok, const int32_t *pos,
                     float *logits, uint16_t *routing) {
    kv_seq_t *seqs[NSEQ];
    for (int s = 0; s < NSEQ; s++)
        seqs[s] = &p->seq[s];
    float *x = malloc(sizeof(float) * NSEQ * m->D);
    float *hf = malloc(sizeof(float) * NSEQ * m->D);
    float rstd[NSEQ];
    decode_batch_t db = {NSEQ, tok, pos, seqs, 0, 0, NULL, routing};
    TU_CHECK_RC(decode_forward(m, &p->w, &p->c, &p->ar, &db, x));
    model_logits(m, logits, hf, rstd, x, NSEQ);
    free(x);
    free(hf);
}

/* tables (NSEQ, MAXB) of the sequences, unused entries -1. */
static void tables_of(const cpu_t *p, int32_t *tables) {
    for (int s = 0; s < NSEQ; s++)
        for (int j = 0; j < MAXB; j++)
            tables[s * MAXB + j] = j < p->seq[s].n_blocks ? p->seq[s].blocks[j] : -1;
}

/* The new keys and values the step stored (pos of every sequence, every layer) against the
 * CPU's; then, with the CPU's copied over every position the decode steps stored so far,
 * the whole cache must be the CPU's bits. */
static void check_cache(const cpu_t *p, float *got, const int32_t *pos, double tol) {
    kv_cache_t view = p->c;
    view.mem = got;
    size_t row = p->c.row;
    float *kg = malloc(sizeof(float) * row), *vg = malloc(sizeof(float) * row);
    float *kc = malloc(sizeof(float) * row), *vc = malloc(sizeof(float) * row);
    double ek = 0.0, ev = 0.0;
    for (int l = 0; l < p->c.L; l++)
        for (int s = 0; s < NSEQ; s++) {
            kv_read(&view, &p->seq[s], l, pos[s], kg, vg);
            kv_read(&p->c, &p->seq[s], l, pos[s], kc, vc);
            double a = tu_rel_err_ff(kg, kc, row, 1e-6), b = tu_rel_err_ff(vg, vc, row, 1e-6);
            ek = a > ek ? a : ek;
            ev = b > ev ? b : ev;
            for (int t = p->start[s]; t <= pos[s]; t++) {
                kv_read(&p->c, &p->seq[s], l, t, kc, vc);
                kv_write(&view, &p->seq[s], l, t, kc, vc);
            }
        }
    printf("    stored k err %.2e, v err %.2e\n", ek, ev);
    CU_ASSERT(ek <= tol);
    CU_ASSERT(ev <= tol);
    CU_ASSERT_EQUAL(memcmp(got, p->c.mem, sizeof(float) * cache_floats(&p->c)), 0);

    free(kg);
    free(vg);
    free(kc);
    free(vc);
}

/* Two decode steps on the device and on the CPU from the same prefilled cache, with
 * (ad = 1) or without the adapter; returns the first step's device logits in first (NSEQ,
 * V) when not NULL. */
static void check_decode(fx_t *f, model_cuda_t *mc, int ad, double tol, int exact_routing,
                         float *first) {
    const model_t *m = f->m;
    int V = m->V;
    size_t MK = (size_t)m->n_moe * m->K;
    TU_CHECK_RC(model_set_adapter(f->m, ad ? f->ad : NULL));
    cpu_t p;
    size_t nc;
    float *dkv = cpu_open_upload(&p, m, &nc);
    float *lg = malloc(sizeof(float) * NSEQ * V), *lc = malloc(sizeof(float) * NSEQ * V);
    float *again = malloc(sizeof(float) * NSEQ * V);
    uint16_t *rg = calloc(NSEQ * MK + 1, sizeof *rg), *rc = calloc(NSEQ * MK + 1, sizeof *rc);
    for (int step = 0; step < STEPS; step++) {
        int32_t tok[NSEQ], pos[NSEQ], tables[NSEQ * MAXB];
        for (int s = 0; s < NSEQ; s++) {
            tok[s] = tok_of(m, 100 + (uint64_t)step, (uint64_t)s);
            pos[s] = p.len[s]++;
        }
        tables_of(&p, tables);
        /* The fork holds the first sequence's full blocks and its own last one. */
        CU_ASSERT_EQUAL(tables[(NSEQ - 1) * MAXB], tables[0]);
        CU_ASSERT_NOT_EQUAL(tables[(NSEQ - 1) * MAXB + pos[0] / BS], tables[pos[0] / BS]);
        model_cuda_decode_t b = {NSEQ, tok, pos, tables, MAXB, dkv, p.c.n_blocks, BS, rg};
        tu_poison(lg, (size_t)NSEQ * V);
        TU_CHECK_RC(model_cuda_decode(mc, &b, lg, ad));
        cpu_step(&p, m, tok, pos, lc, rc);
        double el = tu_rel_err_ff(lg, lc, (size_t)NSEQ * V, 1e-6);
        printf("  %s, step %d (positions %d %d %d %d): logits err %.2e\n",
               ad ? "adapter" : "no adapter", step, pos[0], pos[1], pos[2], pos[3], el);
        CU_ASSERT(el <= tol);
        if (exact_routing)
            CU_ASSERT_EQUAL(memcmp(rg, rc, sizeof *rg * NSEQ * MK), 0);
        for (size_t i = 0; i < NSEQ * MK; i++)
            CU_ASSERT(rg[i] < m->E);
        float *got = dget_f(dkv, nc);
        check_cache(&p, got, pos, tol);
        if (step == 0 && first)
            memcpy(first, lg, sizeof(float) * NSEQ * V);
        if (step == STEPS - 1) {
            /* The same step again on the cache it left (its rows are stored again with
             * the same values): the same bits, no new device allocation. */
            cuda_pool_stats_t ps0, ps1;
            backend_cuda_pool_stats(&ps0);
            TU_CHECK_RC(model_cuda_decode(mc, &b, again, ad));
            backend_cuda_pool_stats(&ps1);
            CU_ASSERT_EQUAL(ps1.device_allocs, ps0.device_allocs);
            CU_ASSERT_EQUAL(memcmp(again, lg, sizeof(float) * NSEQ * V), 0);
        }
        free(got);
    }
    dfree(dkv);
    free(lg);
    free(lc);
    free(again);
    free(rg);
    free(rc);
    cpu_close(&p);
    TU_CHECK_RC(model_set_adapter(f->m, f->ad));
}

static void check_model(model_arch_t arch, dtype_t dt, double tol) {
    fx_t f;
    fx_open(&f, arch, dt, dt == DT_F32 ? 7 : 8);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    size_t n = (size_t)NSEQ * f.m->V;
    float *with = malloc(sizeof(float) * n), *without = malloc(sizeof(float) * n);
    check_decode(&f, mc, 1, tol, dt == DT_F32, with);
    check_decode(&f, mc, 0, tol, dt == DT_F32, without);
    /* The adapter moves the logits far more than the tolerance: the comparisons see it. */
    double moved = tu_rel_err_ff(with, without, n, 1e-6);
    printf("  adapter effect on the logits: %.2e\n", moved);
    CU_ASSERT(moved > 10.0 * tol);
    free(with);
    free(without);
    model_cuda_free(&mc);
    fx_close(&f);
}

static void test_f32(void) {
    check_model(ARCH_QWEN3_MOE, DT_F32, TOL_F32);
}

static void test_bf16(void) {
    check_model(ARCH_QWEN3_MOE, DT_BF16, TOL_BF16);
}

/* Positions up to 12 against a window of 4: the attention sees only the window. */
static void test_mixtral_window(void) {
    check_model(ARCH_MIXTRAL, DT_F32, TOL_F32);
}

static void expect_bad(model_cuda_t *mc, const model_cuda_decode_t *b, float *logits, int ad,
                       const char *needle) {
    int rc = model_cuda_decode(mc, b, logits, ad);
    CU_ASSERT_EQUAL(rc, MO_EINVAL);
    if (!strstr(mo_last_error(), needle))
        tu_report("expected \"%s\" in: %s", needle, mo_last_error());
    CU_ASSERT(strstr(mo_last_error(), needle) != NULL);
}

/* Steps the host refuses before any device work, naming the row. */
static void test_bad_step(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32, 9);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    int NB = 8;
    size_t nc = (size_t)f.m->L * NB * 2 * BS * f.m->Hkv * f.m->Dh;
    float *dkv = dzeros(nc);
    float *logits = malloc(sizeof(float) * 2 * f.m->V);
    int32_t tok[2] = {1, 2}, pos[2] = {5, 2}, tables[2 * 2] = {0, 1, 2, -1};
    model_cuda_decode_t b = {2, tok, pos, tables, 2, dkv, NB, BS, NULL};
    TU_CHECK_RC(model_cuda_decode(mc, &b, logits, 1));
    tok[1] = f.m->V;
    expect_bad(mc, &b, logits, 1, "row 1 is token");
    tok[1] = 2;
    pos[0] = 2 * BS;
    expect_bad(mc, &b, logits, 1, "row 0 is at position 8");
    pos[0] = 5;
    tables[1] = NB;
    expect_bad(mc, &b, logits, 1, "names block 8");
    tables[1] = 2; /* row 0's new token in row 1's block */
    expect_bad(mc, &b, logits, 1, "rows 0 and 1 both store");
    tables[1] = 1;
    expect_bad(mc, &b, logits, 2, "use_adapter 2");
    model_cuda_decode_t none = b;
    none.kv = NULL;
    expect_bad(mc, &none, logits, 1, "device cache");
    none.N = 0; /* nothing to do */
    TU_CHECK_RC(model_cuda_decode(mc, &none, logits, 1));
    model_cuda_free(&mc);
    /* Without an adapter in the upload, use_adapter = 1 is refused. */
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    expect_bad(mc, &b, logits, 1, "holds no adapter");
    TU_CHECK_RC(model_cuda_decode(mc, &b, logits, 0));
    model_cuda_free(&mc);
    dfree(dkv);
    free(logits);
    fx_close(&f);
}

/* The sampling parameters of the sampling step: greedy, then temperature 1 with top-k and
 * top-p off and on. */
#define NSP 5
static const sampling_params_t g_sp[NSP] = {
    {0.0f, 1.0f, 0, 0.0f}, {1.0f, 1.0f, 0, 0.0f}, {1.0f, 1.0f, 5, 0.0f},
    {1.0f, 0.8f, 0, 0.0f}, {1.0f, 0.8f, 5, 0.0f},
};

/* Row s of a step under parameters p: seed 77, request s, sample 0, token pos. */
static cuda_sample_req_t req_of(const sampling_params_t *p, int s, int32_t pos) {
    cuda_sample_req_t r;
    memset(&r, 0, sizeof r);
    r.temperature = p->temperature, r.top_p = p->top_p, r.top_k = p->top_k, r.min_p = p->min_p;
    r.seed = 77, r.request_id = (uint64_t)s, r.token_index = (uint64_t)pos;
    return r;
}

static float max_abs_diff(const float *a, const float *b, int n) {
    float d = 0.0f;
    for (int j = 0; j < n; j++)
        d = fabsf(a[j] - b[j]) > d ? fabsf(a[j] - b[j]) : d;
    return d;
}

typedef struct drawn {
    int32_t tok[NSEQ], st[NSEQ];
    float lp[NSEQ];
} drawn_t;

/* model_cuda_decode_sample on b under req, outputs poisoned first. */
static void sample_step(model_cuda_t *mc, const model_cuda_decode_t *b,
                        const cuda_sample_req_t *req, drawn_t *d) {
    for (int s = 0; s < NSEQ; s++)
        d->tok[s] = -2, d->st[s] = 12345, d->lp[s] = NAN;
    TU_CHECK_RC(model_cuda_decode_sample(mc, b, req, d->tok, d->lp, d->st, 1));
}

/* Each row of d against the CPU sampler on the CPU's logits lc and the device's lg. */
static int check_drawn(sampler_t *sm, const drawn_t *d, const cuda_sample_req_t *req,
                       const float *lg, const float *lc, int V, double *worst) {
    int off_argmax = 0;
    for (int s = 0; s < NSEQ; s++) {
        const cuda_sample_req_t *r = &req[s];
        sampling_params_t p = {r->temperature, r->top_p, r->top_k, r->min_p};
        double u = sampler_uniform(r->seed, r->request_id, r->sample_index, r->token_index);
        const float *rg = lg + (size_t)s * V, *rc = lc + (size_t)s * V;
        int32_t tc, tg;
        float pc, pg;
        TU_CHECK_RC(sampler_sample(sm, rc, &p, u, &tc, &pc));
        TU_CHECK_RC(sampler_sample(sm, rg, &p, u, &tg, &pg));
        CU_ASSERT_EQUAL(d->st[s], MO_OK);
        CU_ASSERT_EQUAL(d->tok[s], tc);
        CU_ASSERT_EQUAL(d->tok[s], tg);
        double ec = fabs((double)d->lp[s] - pc) / fmax(fabs(pc), 1.0);
        double eg = fabs((double)d->lp[s] - pg) / fmax(fabs(pg), 1.0);
        CU_ASSERT(ec <= 1e-5 + 2.0 * max_abs_diff(rg, rc, V));
        CU_ASSERT(eg <= 1e-5);
        *worst = fmax(*worst, fmax(ec, eg));
        int32_t am = 0;
        for (int j = 1; j < V; j++)
            am = rc[j] > rc[am] ? j : am;
        off_argmax += d->tok[s] != am;
    }
    return off_argmax;
}

/* Two decode steps from the same prefill as check_decode, each sampled on the device under
 * every parameter set and a mix of them (row s under set (s + step) % NSP) after a plain
 * step gave the device's logits (the sampling steps store the same keys and values again). */
static void test_sample(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32, 7);
    const model_t *m = f.m;
    int V = m->V;
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    cpu_t p;
    size_t nc;
    float *dkv = cpu_open_upload(&p, m, &nc);
    float *lg = malloc(sizeof(float) * NSEQ * V), *lc = malloc(sizeof(float) * NSEQ * V);
    sampler_t sm;
    TU_CHECK_RC(sampler_init(&sm, V));
    int off_argmax = 0, greedy_off = 0;
    double worst = 0.0;
    for (int step = 0; step < STEPS; step++) {
        int32_t tok[NSEQ], pos[NSEQ], tables[NSEQ * MAXB];
        for (int s = 0; s < NSEQ; s++) {
            tok[s] = tok_of(m, 200 + (uint64_t)step, (uint64_t)s);
            pos[s] = p.len[s]++;
        }
        tables_of(&p, tables);
        model_cuda_decode_t b = {NSEQ, tok, pos, tables, MAXB, dkv, p.c.n_blocks, BS, NULL};
        TU_CHECK_RC(model_cuda_decode(mc, &b, lg, 1));
        cpu_step(&p, m, tok, pos, lc, NULL);
        cuda_sample_req_t req[NSEQ];
        drawn_t d, again;
        for (int k = 0; k <= NSP; k++) {
            for (int s = 0; s < NSEQ; s++)
                req[s] = req_of(&g_sp[k < NSP ? k : (s + step) % NSP], s, pos[s]);
            sample_step(mc, &b, req, &d);
            int off = check_drawn(&sm, &d, req, lg, lc, V, &worst);
            if (k == 0)
                greedy_off += off;
            else if (k < NSP)
                off_argmax += off;
        }
        /* The mixed step again: the same bits, no new device allocation. */
        cuda_pool_stats_t ps0, ps1;
        backend_cuda_pool_stats(&ps0);
        sample_step(mc, &b, req, &again);
        backend_cuda_pool_stats(&ps1);
        CU_ASSERT_EQUAL(ps1.device_allocs, ps0.device_allocs);
        CU_ASSERT_EQUAL(memcmp(&again, &d, sizeof d), 0);
        /* Bad parameters on one row: its status, token -1 and logp NaN; the others drawn
         * as before. */
        req[2].top_p = 0.0f;
        sample_step(mc, &b, req, &again);
        for (int s = 0; s < NSEQ; s++) {
            CU_ASSERT_EQUAL(again.st[s], s == 2 ? MO_EINVAL : MO_OK);
            CU_ASSERT_EQUAL(again.tok[s], s == 2 ? -1 : d.tok[s]);
            CU_ASSERT(s == 2 ? isnan(again.lp[s]) : again.lp[s] == d.lp[s]);
        }
        float *got = dget_f(dkv, nc);
        check_cache(&p, got, pos, TOL_F32);
        free(got);
        printf("  step %d: tokens %d %d %d %d (mixed parameters)\n", step, d.tok[0], d.tok[1],
               d.tok[2], d.tok[3]);
        if (step == 0) {
            model_cuda_decode_t none = b;
            none.kv = NULL;
            CU_ASSERT_EQUAL(model_cuda_decode_sample(mc, &b, NULL, d.tok, d.lp, d.st, 1),
                            MO_EINVAL);
            CU_ASSERT(strstr(mo_last_error(), "the draws req") != NULL);
            CU_ASSERT_EQUAL(model_cuda_decode_sample(mc, &none, req, d.tok, d.lp, d.st, 1),
                            MO_EINVAL);
        }
    }
    /* Greedy takes the argmax; temperature 1 draws other tokens too. */
    printf("  worst logp error %.2e, %d of %d drawn tokens not the argmax\n", worst, off_argmax,
           STEPS * (NSP - 1) * NSEQ);
    CU_ASSERT_EQUAL(greedy_off, 0);
    CU_ASSERT(off_argmax > 0);
    sampler_free(&sm);
    dfree(dkv);
    free(lg);
    free(lc);
    cpu_close(&p);
    model_cuda_free(&mc);
    fx_close(&f);
}

static CU_TestInfo g_tests[] = {
    {"f32", test_f32},           {"bf16", test_bf16},     {"mixtral_window", test_mixtral_window},
    {"bad_step", test_bad_step}, {"sample", test_sample}, CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!(g_gpu = gpu_suite_backend("gpu_model_decode", &rc)))
        return rc;
    backend_cpu_set_threads(0);
    return tu_main("gpu_model_decode", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_model_decode"); }
#endif
