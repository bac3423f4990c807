/* gpu_model_decode: the CUDA decode step (model_cuda_decode, actor/model_cuda.h) and
 * prefill against the CPU engine's decode_forward + model_logits (rollout/decode.h) on tiny
 * random Qwen3-MoE models (3 layers, the middle one a dense MLP), f32 and bf16, and a tiny
 * Mixtral (sliding window 4, f32), with random norm weights and a random LoRA adapter on every
 * linear projection. Four sequences in a paged cache of 4-token blocks (prompts of 6, 1 and 11
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
 * The device prefill (model_cuda_prefill_sample) of prompts of 6, 3 and 11 tokens into the
 * upload's cache (model_cuda_kv_alloc, filled with a random pattern first) against the CPU
 * engine's prefill, on the three models, with and without the adapter: every stored key
 * and value within the tolerance, the rest of the cache bitwise the pattern; nine draws
 * (three per prompt, greedy and at temperature 1 with top-k and top-p off and on) equal to
 * the CPU sampler's on the CPU's last-row logits; the routing (f32: equal); then a decode
 * step on the device cache against the CPU's. Bad prefills are refused on the host with
 * the cache and the outputs untouched. model_cuda_kv_copy_block copies one block of every
 * layer and nothing else. model_cuda_rebind_adapter: another adapter of the same layout
 * (no device allocation), none, one of another rank and the first again, each followed by
 * check_decode against the CPU model with that adapter; an adapter with full weights is
 * refused and the previous one kept.
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

/* S packed prompts (at most NSEQ, 32 tokens) of random tokens tok_of(seed, row). */
typedef struct prompts {
    int S, N;
    int32_t tok[32], cu[NSEQ + 1];
} prompts_t;

static void make_prompts(prompts_t *q, const model_t *m, uint64_t seed, const int *lens, int S) {
    q->S = S;
    q->cu[0] = 0;
    for (int s = 0; s < S; s++)
        q->cu[s + 1] = q->cu[s] + lens[s];
    q->N = q->cu[S];
    CU_ASSERT_FATAL(q->N <= 32);
    for (int t = 0; t < q->N; t++)
        q->tok[t] = tok_of(m, seed, (uint64_t)t);
}

/* A fresh CPU engine with prompts q prefilled (one prefill batch) into sequences 0 .. S-1:
 * x (N, D) receives the last layer's rows, routing (N, M, K) their experts when not NULL. */
static void cpu_prefill(cpu_t *p, const model_t *m, const prompts_t *q, float *x,
                        uint16_t *routing) {
    memset(p, 0, sizeof *p);
    TU_CHECK_RC(decode_kv_cache_init(&p->c, m, BUDGET, BS));
    TU_CHECK_RC(rl_weights_init(&p->w, m, 0));
    arena_init(&p->ar, 1 << 20);
    p->budget = p->c.n_blocks;
    CU_ASSERT_EQUAL_FATAL(kv_cache_reserve(&p->c, p->budget), 1);
    int32_t pos[32];
    kv_seq_t *seqs[32];
    for (int s = 0; s < q->S; s++) {
        TU_CHECK_RC(kv_seq_grow(&p->c, &p->seq[s], q->cu[s + 1] - q->cu[s], &p->budget));
        for (int t = q->cu[s]; t < q->cu[s + 1]; t++) {
            pos[t] = t - q->cu[s];
            seqs[t] = &p->seq[s];
        }
        p->len[s] = q->cu[s + 1] - q->cu[s];
    }
    decode_batch_t db = {q->N, q->tok, pos, seqs, 1, q->S, q->cu, routing};
    TU_CHECK_RC(decode_forward(m, &p->w, &p->c, &p->ar, &db, x));
}

/* Prefills the three prompts (one prefill batch) and forks the first into the fourth. */
static void cpu_open(cpu_t *p, const model_t *m, uint64_t seed) {
    prompts_t q;
    make_prompts(&q, m, seed, g_prompt, NSEQ - 1);
    float *x = malloc(sizeof(float) * (size_t)q.N * m->D);
    cpu_prefill(p, m, &q, x, NULL);
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

/* One decode step of sequences 0 .. n-1 on the CPU: logits (n, V) and routing. The
 * sequences must already hold the positions pos. */
static void cpu_step(cpu_t *p, const model_t *m, int n, const int32_t *tok, const int32_t *pos,
                     float *logits, uint16_t *routing) {
    kv_seq_t *seqs[NSEQ];
    for (int s = 0; s < n; s++)
        seqs[s] = &p->seq[s];
    float *x = malloc(sizeof(float) * NSEQ * m->D);
    float *hf = malloc(sizeof(float) * NSEQ * m->D);
    float rstd[NSEQ];
    decode_batch_t db = {n, tok, pos, seqs, 0, 0, NULL, routing};
    TU_CHECK_RC(decode_forward(m, &p->w, &p->c, &p->ar, &db, x));
    model_logits(m, logits, hf, rstd, x, n);
    free(x);
    free(hf);
}

/* tables (n, MAXB) of sequences 0 .. n-1, unused entries -1. */
static void tables_of(const cpu_t *p, int n, int32_t *tables) {
    for (int s = 0; s < n; s++)
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
        tables_of(&p, NSEQ, tables);
        /* The fork holds the first sequence's full blocks and its own last one. */
        CU_ASSERT_EQUAL(tables[(NSEQ - 1) * MAXB], tables[0]);
        CU_ASSERT_NOT_EQUAL(tables[(NSEQ - 1) * MAXB + pos[0] / BS], tables[pos[0] / BS]);
        model_cuda_decode_t b = {NSEQ, tok, pos, tables, MAXB, dkv, p.c.n_blocks, BS, rg};
        tu_poison(lg, (size_t)NSEQ * V);
        TU_CHECK_RC(model_cuda_decode(mc, &b, lg, ad));
        cpu_step(&p, m, NSEQ, tok, pos, lc, rc);
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
        tables_of(&p, NSEQ, tables);
        model_cuda_decode_t b = {NSEQ, tok, pos, tables, MAXB, dkv, p.c.n_blocks, BS, NULL};
        TU_CHECK_RC(model_cuda_decode(mc, &b, lg, 1));
        cpu_step(&p, m, NSEQ, tok, pos, lc, NULL);
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

/* ---- the device prefill ---- */

#define NPF 3 /* prompts */
#define NJ 9  /* draws: three of each prompt */
/* One prompt crossing a block boundary, one shorter than a block, one of three blocks. */
static const int g_pf[NPF] = {6, 3, 11};

typedef struct pf_drawn {
    int32_t tok[NJ], st[NJ];
    float lp[NJ];
} pf_drawn_t;

/* n random floats: the cache's contents before a prefill, to see what it leaves alone. */
static float *pattern(size_t n, uint64_t seed) {
    float *h = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        h[i] = rng_uniform(seed, 5, (uint64_t)i) - 0.5f;
    return h;
}

/* The keys and values the prefill stored (every position of every prompt, every layer) in
 * got against the CPU's; then, with the pattern put back at those positions, got must be
 * the pattern: nothing else was written. */
static void check_prefilled(const cpu_t *p, const prompts_t *q, float *got, const float *pat,
                            double tol) {
    kv_cache_t gv = p->c, pv = p->c;
    gv.mem = got;
    pv.mem = (float *)pat;
    size_t row = p->c.row;
    float *kg = malloc(sizeof(float) * row), *vg = malloc(sizeof(float) * row);
    float *kc = malloc(sizeof(float) * row), *vc = malloc(sizeof(float) * row);
    double ek = 0.0, ev = 0.0;
    for (int l = 0; l < p->c.L; l++)
        for (int s = 0; s < q->S; s++)
            for (int t = 0; t < p->len[s]; t++) {
                kv_read(&gv, &p->seq[s], l, t, kg, vg);
                kv_read(&p->c, &p->seq[s], l, t, kc, vc);
                ek = fmax(ek, tu_rel_err_ff(kg, kc, row, 1e-6));
                ev = fmax(ev, tu_rel_err_ff(vg, vc, row, 1e-6));
                kv_read(&pv, &p->seq[s], l, t, kc, vc);
                kv_write(&gv, &p->seq[s], l, t, kc, vc);
            }
    printf("    prefill stored k err %.2e, v err %.2e\n", ek, ev);
    CU_ASSERT(ek <= tol);
    CU_ASSERT(ev <= tol);
    CU_ASSERT_EQUAL(memcmp(got, pat, sizeof(float) * cache_floats(&p->c)), 0);
    free(kg);
    free(vg);
    free(kc);
    free(vc);
}

/* Draw j: prompt j % NPF, greedy for the first NPF, then temperature 1 with top-k and top-p
 * off and on; sample j / NPF, the prompt's first new token. */
static void prefill_draws(int32_t *job_seq, cuda_sample_req_t *req) {
    for (int j = 0; j < NJ; j++) {
        job_seq[j] = j % NPF;
        req[j] = req_of(&g_sp[j < NPF ? 0 : 1 + j % (NSP - 1)], job_seq[j], g_pf[job_seq[j]]);
        req[j].sample_index = (uint64_t)(j / NPF);
    }
}

/* log p(t) under softmax(row / T) (T 0: 1), in double. */
static double log_softmax_at(const float *row, int V, float T, int32_t t) {
    double inv = T > 0 ? 1.0 / T : 1.0, mx = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; v++)
        mx = fmax(mx, row[v] * inv);
    for (int v = 0; v < V; v++)
        sum += exp(row[v] * inv - mx);
    return row[t] * inv - mx - log(sum);
}

/* Each draw against the CPU sampler on the CPU's last-row logits lc (NPF, V): the token,
 * and the log-probability within 1e-5 plus twice the logits' tolerance. With bf16 weights
 * (tol above 1e-4) the device's logits may reorder two candidates that close, so the
 * tokens are counted, not asserted, and each log-probability is checked against the CPU's
 * log-probability of the token the device drew. */
static void check_prefill_draws(const pf_drawn_t *d, const int32_t *job_seq,
                                const cuda_sample_req_t *req, const float *lc, int V, double tol) {
    sampler_t sm;
    TU_CHECK_RC(sampler_init(&sm, V));
    double worst = 0.0;
    int exact = tol <= 1e-4, same = 0;
    for (int j = 0; j < NJ; j++) {
        const cuda_sample_req_t *r = &req[j];
        const float *row = lc + (size_t)job_seq[j] * V;
        sampling_params_t sp = {r->temperature, r->top_p, r->top_k, r->min_p};
        double u = sampler_uniform(r->seed, r->request_id, r->sample_index, r->token_index);
        int32_t tc;
        float pc;
        TU_CHECK_RC(sampler_sample(&sm, row, &sp, u, &tc, &pc));
        float big = 0.0f;
        for (int v = 0; v < V; v++)
            big = fmaxf(big, fabsf(row[v]));
        CU_ASSERT_EQUAL(d->st[j], MO_OK);
        CU_ASSERT_FATAL(d->tok[j] >= 0 && d->tok[j] < V);
        same += d->tok[j] == tc;
        if (!exact)
            pc = (float)log_softmax_at(row, V, r->temperature, d->tok[j]);
        double e = fabs((double)d->lp[j] - pc) / fmax(fabs(pc), 1.0);
        worst = fmax(worst, e);
        if (exact)
            CU_ASSERT_EQUAL(d->tok[j], tc);
        CU_ASSERT(e <= 1e-5 + 2.0 * tol * big);
    }
    if (!exact)
        printf("    %d of %d draws equal to the CPU sampler's\n", same, NJ);
    printf("    draws %d %d %d | %d %d %d | %d %d %d, worst logp err %.2e\n", d->tok[0], d->tok[1],
           d->tok[2], d->tok[3], d->tok[4], d->tok[5], d->tok[6], d->tok[7], d->tok[8], worst);
    sampler_free(&sm);
}

/* lc (NPF, V) = the CPU's next-token logits after each prompt's last row of x (N, D). */
static void last_row_logits(const model_t *m, const prompts_t *q, const float *x, float *lc) {
    int D = m->D;
    float *xl = malloc(sizeof(float) * NPF * D), *hf = malloc(sizeof(float) * NPF * D);
    float rstd[NPF];
    for (int s = 0; s < NPF; s++)
        memcpy(xl + (size_t)s * D, x + (size_t)(q->cu[s + 1] - 1) * D, sizeof(float) * D);
    model_logits(m, lc, hf, rstd, xl, NPF);
    free(xl);
    free(hf);
}

/* One decode step of every prompt after the prefill, on the device cache dkv and on the
 * CPU's: the logits agree. */
static void check_decode_after(cpu_t *p, model_cuda_t *mc, const model_t *m, float *dkv, int ad,
                               double tol) {
    int V = m->V;
    int32_t tok[NPF], pos[NPF], tables[NPF * MAXB];
    for (int s = 0; s < NPF; s++) {
        tok[s] = tok_of(m, 300, (uint64_t)s);
        pos[s] = p->len[s];
        TU_CHECK_RC(kv_seq_grow(&p->c, &p->seq[s], ++p->len[s], &p->budget));
    }
    tables_of(p, NPF, tables);
    float *lg = malloc(sizeof(float) * NPF * V), *lc = malloc(sizeof(float) * NPF * V);
    model_cuda_decode_t b = {NPF, tok, pos, tables, MAXB, dkv, p->c.n_blocks, BS, NULL};
    tu_poison(lg, (size_t)NPF * V);
    TU_CHECK_RC(model_cuda_decode(mc, &b, lg, ad));
    cpu_step(p, m, NPF, tok, pos, lc, NULL);
    double el = tu_rel_err_ff(lg, lc, (size_t)NPF * V, 1e-6);
    printf("    decode step after the prefill: logits err %.2e\n", el);
    CU_ASSERT(el <= tol);
    free(lg);
    free(lc);
}

/* The device prefill of the three prompts into the upload's cache (a random pattern first)
 * against the CPU engine's, with (ad = 1) or without the adapter. */
static void check_prefill(fx_t *f, model_cuda_t *mc, int ad, double tol, int exact_routing) {
    const model_t *m = f->m;
    int V = m->V;
    size_t MK = (size_t)m->n_moe * m->K;
    TU_CHECK_RC(model_set_adapter(f->m, ad ? f->ad : NULL));
    prompts_t q;
    make_prompts(&q, m, 51, g_pf, NPF);
    cpu_t p;
    float *x = malloc(sizeof(float) * (size_t)q.N * m->D), *lc = malloc(sizeof(float) * NPF * V);
    uint16_t *rg = calloc(q.N * MK + 1, sizeof *rg), *rc = calloc(q.N * MK + 1, sizeof *rc);
    cpu_prefill(&p, m, &q, x, rc);
    last_row_logits(m, &q, x, lc);
    size_t nc = cache_floats(&p.c);
    float *dkv = NULL, *pat = pattern(nc, 61);
    TU_CHECK_RC(model_cuda_kv_alloc(mc, p.c.n_blocks, BS, &dkv));
    dset(dkv, pat, sizeof(float) * nc);
    int32_t tables[NPF * MAXB], job_seq[NJ];
    cuda_sample_req_t req[NJ];
    tables_of(&p, NPF, tables);
    prefill_draws(job_seq, req);
    model_cuda_prefill_t b = {q.N, NPF, q.tok, q.cu, tables, MAXB, dkv, p.c.n_blocks, BS, rg,
                              NJ, job_seq};
    pf_drawn_t d;
    for (int j = 0; j < NJ; j++)
        d.tok[j] = -2, d.st[j] = 12345, d.lp[j] = NAN;
    TU_CHECK_RC(model_cuda_prefill_sample(mc, &b, req, d.tok, d.lp, d.st, ad));
    printf("  %s:\n", ad ? "adapter" : "no adapter");
    float *got = dget_f(dkv, nc);
    check_prefilled(&p, &q, got, pat, tol);
    check_prefill_draws(&d, job_seq, req, lc, V, tol);
    if (exact_routing)
        CU_ASSERT_EQUAL(memcmp(rg, rc, sizeof *rg * q.N * MK), 0);
    for (size_t i = 0; i < q.N * MK; i++)
        CU_ASSERT(rg[i] < m->E);
    check_decode_after(&p, mc, m, dkv, ad, tol);
    free(got);
    free(pat);
    free(x);
    free(lc);
    free(rg);
    free(rc);
    cpu_close(&p);
    TU_CHECK_RC(model_set_adapter(f->m, f->ad));
}

static void check_prefill_model(model_arch_t arch, dtype_t dt, double tol) {
    fx_t f;
    fx_open(&f, arch, dt, dt == DT_F32 ? 7 : 8);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    check_prefill(&f, mc, 1, tol, dt == DT_F32);
    check_prefill(&f, mc, 0, tol, dt == DT_F32);
    model_cuda_free(&mc);
    fx_close(&f);
}

static void test_prefill_f32(void) {
    check_prefill_model(ARCH_QWEN3_MOE, DT_F32, TOL_F32);
}

static void test_prefill_bf16(void) {
    check_prefill_model(ARCH_QWEN3_MOE, DT_BF16, TOL_BF16);
}

/* Prompts of 6 and 11 tokens against a window of 4. */
static void test_prefill_mixtral(void) {
    check_prefill_model(ARCH_MIXTRAL, DT_F32, TOL_F32);
}

/* A refused prefill: MO_EINVAL naming the fault, the cache dkv (nc floats, pat before) and
 * the outputs untouched. */
static void expect_bad_prefill(model_cuda_t *mc, const model_cuda_prefill_t *b,
                               const cuda_sample_req_t *req, int ad, const float *dkv,
                               const float *pat, size_t nc, const char *needle) {
    int32_t tok[2] = {-2, -2}, st[2] = {7, 7};
    float lp[2] = {5.0f, 5.0f};
    CU_ASSERT_EQUAL(model_cuda_prefill_sample(mc, b, req, tok, lp, st, ad), MO_EINVAL);
    if (!strstr(mo_last_error(), needle))
        tu_report("expected \"%s\" in: %s", needle, mo_last_error());
    CU_ASSERT(strstr(mo_last_error(), needle) != NULL);
    CU_ASSERT(tok[0] == -2 && tok[1] == -2 && st[0] == 7 && st[1] == 7 && lp[1] == 5.0f);
    float *got = dget_f(dkv, nc);
    CU_ASSERT_EQUAL(memcmp(got, pat, sizeof(float) * nc), 0);
    free(got);
}

/* Prefills the host refuses before any device work: prompts of 5 and 2 tokens in blocks
 * {0, 1} and {2}, two draws. */
static void test_bad_prefill(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32, 9);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    int NB = 8;
    size_t nc = (size_t)f.m->L * NB * 2 * BS * f.m->Hkv * f.m->Dh;
    float *dkv = NULL, *pat = pattern(nc, 62);
    TU_CHECK_RC(model_cuda_kv_alloc(mc, NB, BS, &dkv));
    dset(dkv, pat, sizeof(float) * nc);
    int32_t tok[7] = {1, 2, 3, 4, 5, 6, 7}, cu[3] = {0, 5, 7}, tables[2 * 2] = {0, 1, 2, -1};
    int32_t job_seq[2] = {1, 0}, otok[2], ost[2];
    float olp[2];
    cuda_sample_req_t req[2] = {req_of(&g_sp[0], 1, 2), req_of(&g_sp[1], 0, 5)};
    model_cuda_prefill_t b = {7, 2, tok, cu, tables, 2, dkv, NB, BS, NULL, 2, job_seq};
    tok[6] = f.m->V;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "row 6 is token");
    tok[6] = 7;
    tables[2] = 1; /* prompt 1 in prompt 0's second block */
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "prompts 0 and 1 both hold block 1");
    tables[2] = NB;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "names block 8");
    tables[2] = 2;
    job_seq[1] = 2;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "draw 1 reads prompt 2");
    job_seq[1] = -1;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "draw 1 reads prompt -1");
    job_seq[1] = 0;
    cu[1] = 0;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "prompt 0 is rows 0 .. -1");
    cu[1] = 5;
    cu[2] = 8;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "cu_seqlens must run from 0 to N = 7");
    cu[2] = 7;
    b.max_blocks = 1;
    expect_bad_prefill(mc, &b, req, 1, dkv, pat, nc, "prompt 0 has 5 tokens");
    b.max_blocks = 2;
    expect_bad_prefill(mc, &b, req, 2, dkv, pat, nc, "use_adapter 2");
    expect_bad_prefill(mc, &b, NULL, 1, dkv, pat, nc, "the draws req");
    model_cuda_prefill_t none = b;
    none.kv = NULL;
    expect_bad_prefill(mc, &none, req, 1, dkv, pat, nc, "device cache kv");
    /* The same prefill, right: it runs, and writes blocks 0, 1 and 2 only. */
    TU_CHECK_RC(model_cuda_prefill_sample(mc, &b, req, otok, olp, ost, 1));
    CU_ASSERT(ost[0] == MO_OK && ost[1] == MO_OK);
    float *got = dget_f(dkv, nc);
    size_t blk = (size_t)2 * BS * f.m->Hkv * f.m->Dh;
    for (int l = 0; l < f.m->L; l++) {
        size_t o = (size_t)l * NB * blk;
        CU_ASSERT(memcmp(got + o, pat + o, sizeof(float) * blk) != 0);
        CU_ASSERT(memcmp(got + o + 2 * blk, pat + o + 2 * blk, sizeof(float) * blk) != 0);
        CU_ASSERT_EQUAL(memcmp(got + o + 3 * blk, pat + o + 3 * blk, sizeof(float) * 5 * blk), 0);
    }
    /* No draws: only the cache. */
    b.n_jobs = 0;
    TU_CHECK_RC(model_cuda_prefill_sample(mc, &b, NULL, NULL, NULL, NULL, 1));
    free(got);
    free(pat);
    model_cuda_free(&mc);
    fx_close(&f);
}

/* ---- the upload's cache ---- */

/* model_cuda_kv_alloc gives zeroed memory; a block copy writes that block of every layer
 * and nothing else; bad blocks and a missing cache are refused. */
static void test_kv_copy_block(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32, 9);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    CU_ASSERT_EQUAL(model_cuda_kv_copy_block(mc, 0, 1), MO_EINVAL); /* no cache yet */
    float *dkv = NULL;
    CU_ASSERT_EQUAL(model_cuda_kv_alloc(mc, 0, BS, &dkv), MO_EINVAL);
    int NB = 6, L = f.m->L;
    size_t blk = (size_t)2 * BS * f.m->Hkv * f.m->Dh, nc = (size_t)L * NB * blk;
    TU_CHECK_RC(model_cuda_kv_alloc(mc, NB, BS, &dkv));
    float *got = dget_f(dkv, nc), *zero = calloc(nc, sizeof(float));
    CU_ASSERT_EQUAL(memcmp(got, zero, sizeof(float) * nc), 0);
    free(got);
    float *pat = pattern(nc, 63);
    dset(dkv, pat, sizeof(float) * nc);
    TU_CHECK_RC(model_cuda_kv_copy_block(mc, 1, 4));
    for (int l = 0; l < L; l++) /* the expected cache */
        memcpy(pat + ((size_t)l * NB + 4) * blk, pat + ((size_t)l * NB + 1) * blk,
               sizeof(float) * blk);
    got = dget_f(dkv, nc);
    CU_ASSERT_EQUAL(memcmp(got, pat, sizeof(float) * nc), 0);
    free(got);
    CU_ASSERT_EQUAL(model_cuda_kv_copy_block(mc, -1, 2), MO_EINVAL);
    CU_ASSERT_EQUAL(model_cuda_kv_copy_block(mc, 2, NB), MO_EINVAL);
    /* Another shape: new memory, zeroed. */
    float *dkv2 = NULL;
    TU_CHECK_RC(model_cuda_kv_alloc(mc, 3, BS, &dkv2));
    got = dget_f(dkv2, (size_t)L * 3 * blk);
    CU_ASSERT_EQUAL(memcmp(got, zero, sizeof(float) * L * 3 * blk), 0);
    CU_ASSERT_EQUAL(model_cuda_kv_copy_block(mc, 2, 3), MO_EINVAL);
    free(got);
    free(pat);
    free(zero);
    model_cuda_free(&mc);
    fx_close(&f);
}

/* ---- rebinding the adapter ---- */

/* A rank-R all-linear adapter with random values (seed), not bound. */
static lora_adapter_t *new_adapter(const model_t *m, int R, uint64_t seed) {
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {R, 8.0f, 0, 0.0f, 11, 0, targets, 1};
    lora_adapter_t *ad = NULL;
    TU_CHECK_RC(lora_adapter_new(&ad, &lc, m->modules, m->n_modules));
    tu_randomise_adapter(ad, seed);
    return ad;
}

/* f->m bound to ad, the upload rebound to it, then check_decode with it (ad NULL: the base
 * model). */
static void rebind_and_check(fx_t *f, model_cuda_t *mc, lora_adapter_t *ad) {
    TU_CHECK_RC(model_set_adapter(f->m, ad));
    TU_CHECK_RC(model_cuda_rebind_adapter(mc));
    CU_ASSERT_EQUAL(model_cuda_has_adapter(mc), ad != NULL);
    lora_adapter_t *keep = f->ad;
    if (ad)
        f->ad = ad;
    check_decode(f, mc, ad != NULL, TOL_F32, 1, NULL);
    f->ad = keep;
}

/* Another adapter of the same layout (buffers reused: no device allocation), none (the
 * base; use_adapter 1 refused), one of another rank (rebuilt), the first again; an adapter
 * with full weights refused, the previous one kept. */
static void test_rebind(void) {
    fx_t f;
    fx_open(&f, ARCH_QWEN3_MOE, DT_F32, 7);
    model_cuda_t *mc = NULL;
    TU_CHECK_RC(model_cuda_upload(&mc, f.m));
    lora_adapter_t *ad2 = new_adapter(f.m, 4, 90), *ad8 = new_adapter(f.m, 8, 91);
    cuda_pool_stats_t ps0, ps1;
    TU_CHECK_RC(model_set_adapter(f.m, ad2));
    backend_cuda_pool_stats(&ps0);
    TU_CHECK_RC(model_cuda_rebind_adapter(mc));
    backend_cuda_pool_stats(&ps1);
    CU_ASSERT_EQUAL(ps1.allocs, ps0.allocs);
    printf("  second adapter, same layout:\n");
    rebind_and_check(&f, mc, ad2);
    printf("  no adapter:\n");
    rebind_and_check(&f, mc, NULL);
    float *dkv = dzeros((size_t)f.m->L * 2 * 2 * BS * f.m->Hkv * f.m->Dh);
    float *logits = malloc(sizeof(float) * f.m->V);
    int32_t tok[1] = {1}, pos[1] = {0}, tables[1] = {0};
    model_cuda_decode_t b = {1, tok, pos, tables, 1, dkv, 2, BS, NULL};
    TU_CHECK_RC(model_set_adapter(f.m, NULL));
    CU_ASSERT_EQUAL(model_cuda_decode(mc, &b, logits, 1), MO_EINVAL);
    printf("  rank 8:\n");
    rebind_and_check(&f, mc, ad8);
    printf("  the first adapter again:\n");
    rebind_and_check(&f, mc, f.ad);
    /* Full weights: refused, the upload keeps the adapter it has. */
    lora_adapter_t *full = new_adapter(f.m, 4, 92);
    TU_CHECK_RC(model_adapter_add_full(f.m, full, 0, 1));
    TU_CHECK_RC(model_set_adapter(f.m, full));
    CU_ASSERT_EQUAL(model_cuda_rebind_adapter(mc), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "full weights") != NULL);
    CU_ASSERT(model_cuda_has_adapter(mc));
    TU_CHECK_RC(model_set_adapter(f.m, f.ad));
    check_decode(&f, mc, 1, TOL_F32, 1, NULL);
    dfree(dkv);
    free(logits);
    model_cuda_free(&mc);
    lora_adapter_destroy(&ad2);
    lora_adapter_destroy(&ad8);
    lora_adapter_destroy(&full);
    fx_close(&f);
}

static CU_TestInfo g_tests[] = {
    {"f32", test_f32},
    {"bf16", test_bf16},
    {"mixtral_window", test_mixtral_window},
    {"bad_step", test_bad_step},
    {"sample", test_sample},
    {"prefill_f32", test_prefill_f32},
    {"prefill_bf16", test_prefill_bf16},
    {"prefill_mixtral", test_prefill_mixtral},
    {"bad_prefill", test_bad_prefill},
    {"kv_copy_block", test_kv_copy_block},
    {"rebind", test_rebind},
    CU_TEST_INFO_NULL,
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
