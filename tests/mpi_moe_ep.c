/* mpi_moe_ep: the expert-parallel MoE layer under mpirun against the single-process layer
 * (moe_forward / moe_backward over the whole global batch, run on every rank): each
 * rank's outputs and input gradients, expert adapter gradients on their owners, shared
 * expert gradients after the all-reduce, three AdamW steps, all-to-all bytes against
 * their formula, per-rank expert weight memory; balanced and skewed routing (every token
 * to one rank's experts, a rank whose experts receive nothing), a rank without tokens,
 * routing replay, the balance loss, a routing error on one rank, and E not a multiple of
 * N. Every rank runs the suite; the process exits non-zero when any rank failed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/comm.h"
#include "core/rng.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "moe/moe.h"
#include "moe/moe_ep.h"
#include "tests/testutil.h"

enum { D = 16, F = 8, K = 2, MAXE = 8, MAXM = 3 * MAXE + 3, STEPS = 3 };

#define TOL 1e-5
#define LR 1e-2f
#define WD 0.01f

static comm_t *g_c; /* (created in main, shared by every test) */
static int g_rank, g_size;

static const kernels_t *kern(void) {
    return backend_cpu()->k;
}

/* ---- one MoE layer, built the same way on every rank ---------------------------------- */

typedef enum { BIAS_NONE = 0, BIAS_TO_RANK0, BIAS_AWAY_FROM_LAST } bias_mode_t;

typedef struct layer {
    int E, e0, n;
    moe_cfg_t cfg;
    float bias[MAXE];
    float wr[MAXE * D];                            /* (E, D) router */
    uint16_t wx[MAXE][3][F * D];                   /* bf16 gate (F, D), up (F, D), down (D, F) */
    float sg[F * D], su[F * D], sd[D * F];         /* shared expert, width F */
    wview_t g_all[MAXE], u_all[MAXE], d_all[MAXE]; /* every expert: the reference */
    wview_t g_own[MAXE], u_own[MAXE], d_own[MAXE]; /* owned experts only, others empty */
    char names[MAXM][80];
    lora_module_desc_t mods[MAXM]; /* 3 shared projections, then 3 per expert */
    int n_mods;
    lora_adapter_t *ad_ref, *ad_ep; /* every module / shared + owned experts */
    lora_pair_t pairs_ref[MAXM], pairs_ep[MAXM];
    const lora_pair_t *tab_ref[3][MAXE], *tab_ep[3][MAXE];
    moe_weights_t w_ref, w_ep;
    float *m_ref, *v_ref, *m_ep, *v_ep; /* AdamW moments */
} layer_t;

static const char *const g_proj[3] = {"gate_proj", "up_proj", "down_proj"};

static void add_module(layer_t *L, lora_kind_t kind, int p, int e) {
    int i = L->n_mods++;
    if (kind == LORA_KIND_SHARED_EXPERT)
        snprintf(L->names[i], sizeof L->names[i], "model.layers.1.mlp.shared_experts.%s",
                 g_proj[p]);
    else
        snprintf(L->names[i], sizeof L->names[i], "model.layers.1.mlp.experts.%d.%s", e, g_proj[p]);
    L->mods[i] = (lora_module_desc_t){L->names[i], g_proj[p], kind, p == 2 ? F : D, p == 2 ? D : F};
}

/* Pairs and per-expert tables for an adapter; B gets values keyed by the module name, so
 * both adapters agree wherever they hold the same module. */
static void wire_adapter(layer_t *L, lora_adapter_t *ad, lora_pair_t *pairs,
                         const lora_pair_t *tab[3][MAXE], mlp_weights_t *shared) {
    for (int i = 0; i < ad->n_entries; i++) {
        const lora_entry_t *en = &ad->entries[i];
        float *B = ad->params + en->off_B;
        rng_fill_uniform(B, (size_t)en->OC * en->R, lora_hash64(en->name, strlen(en->name)), 3,
                         -0.3f, 0.3f);
    }
    for (int m = 0; m < L->n_mods; m++) {
        int i = lora_adapter_find(ad, L->names[m]);
        if (i < 0)
            continue;
        pairs[m] = lora_adapter_pair(ad, i, 1);
        if (m < 3) {
            const lora_pair_t **slot[3] = {&shared->lora_gate, &shared->lora_up,
                                           &shared->lora_down};
            *slot[m] = &pairs[m];
        } else {
            tab[(m - 3) % 3][(m - 3) / 3] = &pairs[m];
        }
    }
}

static void store_bf16(uint16_t *dst, size_t n, uint64_t seed, float amp) {
    float tmp[F * D];
    tu_fill(tmp, n, seed, -amp, amp);
    convert_from_f32(dst, DT_BF16, tmp, n);
}

static int layer_init(layer_t *L, int E, router_kind_t kind, bias_mode_t bias, float aux) {
    memset(L, 0, sizeof *L);
    L->E = E;
    if (moe_ep_check(E, g_size) == 0)
        moe_ep_experts(E, g_size, g_rank, &L->e0, &L->n);
    moe_cfg_t *c = &L->cfg;
    c->D = D;
    c->F = F;
    c->n_shared = 1;
    c->aux_coef = aux;
    router_cfg_init(&c->router, kind, E, K);
    c->router.norm_topk_prob = 1;
    if (kind == ROUTER_SIGMOID_GROUPED) {
        tu_fill(L->bias, (size_t)E, 31, -0.3f, 0.3f);
        for (int e = 0; e < E && bias != BIAS_NONE && L->n > 0; e++) {
            if (bias == BIAS_TO_RANK0 && e < L->n)
                L->bias[e] += 8.0f;
            if (bias == BIAS_AWAY_FROM_LAST && e >= E - L->n)
                L->bias[e] -= 8.0f;
        }
        c->router.e_score_correction_bias = L->bias;
        c->router.routed_scaling_factor = 2.0f;
    }
    tu_fill(L->wr, (size_t)E * D, 11, -1.0f, 1.0f);
    for (int e = 0; e < E; e++) {
        for (int p = 0; p < 3; p++)
            store_bf16(L->wx[e][p], F * D, 100 + 3 * (uint64_t)e + p, 0.4f);
        L->g_all[e] = wview_of(L->wx[e][0], DT_BF16);
        L->u_all[e] = wview_of(L->wx[e][1], DT_BF16);
        L->d_all[e] = wview_of(L->wx[e][2], DT_BF16);
        int own = e >= L->e0 && e < L->e0 + L->n;
        L->g_own[e] = own ? L->g_all[e] : (wview_t){0};
        L->u_own[e] = own ? L->u_all[e] : (wview_t){0};
        L->d_own[e] = own ? L->d_all[e] : (wview_t){0};
    }
    tu_fill(L->sg, F * D, 200, -0.4f, 0.4f);
    tu_fill(L->su, F * D, 201, -0.4f, 0.4f);
    tu_fill(L->sd, D * F, 202, -0.4f, 0.4f);

    for (int p = 0; p < 3; p++)
        add_module(L, LORA_KIND_SHARED_EXPERT, p, -1);
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++)
            add_module(L, LORA_KIND_EXPERT, p, e);
    unsigned char sel_ref[MAXM], sel_ep[MAXM];
    for (int m = 0; m < L->n_mods; m++) {
        int e = m < 3 ? -1 : (m - 3) / 3;
        sel_ref[m] = 1;
        sel_ep[m] = e < 0 || (e >= L->e0 && e < L->e0 + L->n);
    }
    const char *targets[] = {"experts", "shared_experts"};
    lora_config_t lc = {.rank = 4, .alpha = 8.0f, .seed = 7, .targets = targets, .n_targets = 2};
    if (lora_adapter_new_selected(&L->ad_ref, &lc, L->mods, L->n_mods, sel_ref) < 0 ||
        lora_adapter_new_selected(&L->ad_ep, &lc, L->mods, L->n_mods, sel_ep) < 0)
        return -1;

    moe_weights_t *w[2] = {&L->w_ref, &L->w_ep};
    for (int i = 0; i < 2; i++) {
        w[i]->router = wview_f32(L->wr);
        w[i]->shared.gate = wview_f32(L->sg);
        w[i]->shared.up = wview_f32(L->su);
        w[i]->shared.down = wview_f32(L->sd);
    }
    L->w_ref.gate = L->g_all, L->w_ref.up = L->u_all, L->w_ref.down = L->d_all;
    L->w_ep.gate = L->g_own, L->w_ep.up = L->u_own, L->w_ep.down = L->d_own;
    wire_adapter(L, L->ad_ref, L->pairs_ref, L->tab_ref, &L->w_ref.shared);
    wire_adapter(L, L->ad_ep, L->pairs_ep, L->tab_ep, &L->w_ep.shared);
    L->w_ref.lora_gate = L->tab_ref[0], L->w_ref.lora_up = L->tab_ref[1];
    L->w_ref.lora_down = L->tab_ref[2];
    L->w_ep.lora_gate = L->tab_ep[0], L->w_ep.lora_up = L->tab_ep[1];
    L->w_ep.lora_down = L->tab_ep[2];
    L->m_ref = calloc(L->ad_ref->n_params, sizeof(float));
    L->v_ref = calloc(L->ad_ref->n_params, sizeof(float));
    L->m_ep = calloc(L->ad_ep->n_params, sizeof(float));
    L->v_ep = calloc(L->ad_ep->n_params, sizeof(float));
    return 0;
}

static void layer_free(layer_t *L) {
    lora_adapter_destroy(&L->ad_ref);
    lora_adapter_destroy(&L->ad_ep);
    free(L->m_ref), free(L->v_ref), free(L->m_ep), free(L->v_ep);
}

/* ---- checks ------------------------------------------------------------------------- */

static int close_enough(const float *got, const float *want, size_t n, const char *cs,
                        const char *what) {
    if (n == 0)
        return 1;
    double e = tu_rel_err_ff(got, want, n, 1e-6);
    if (!(e <= TOL))
        tu_report("rank %d, %s: %s error %.3g > %.3g", g_rank, cs, what, e, TOL);
    return e <= TOL;
}

/* The floats of entry i of ad (its A then B, contiguous). */
static size_t entry_span(const lora_adapter_t *ad, int i, size_t *first) {
    const lora_entry_t *en = &ad->entries[i];
    *first = en->off_A;
    return en->off_B + (size_t)en->OC * en->R - en->off_A;
}

/* Every entry the rank holds, from buffer `which` (0 params, 1 grads), against the
 * reference adapter's entry of the same name; kind_only selects one kind (or -1). */
static int compare_entries(const layer_t *L, int which, int kind_only, const char *cs,
                           const char *what) {
    int ok = 1;
    for (int i = 0; i < L->ad_ep->n_entries; i++) {
        const lora_entry_t *en = &L->ad_ep->entries[i];
        if (kind_only >= 0 && (int)en->kind != kind_only)
            continue;
        int j = lora_adapter_find(L->ad_ref, en->name);
        CU_ASSERT(j >= 0);
        if (j < 0)
            continue;
        size_t a, b, n = entry_span(L->ad_ep, i, &a), m = entry_span(L->ad_ref, j, &b);
        CU_ASSERT_EQUAL(n, m);
        const float *got = which ? L->ad_ep->grads : L->ad_ep->params;
        const float *want = which ? L->ad_ref->grads : L->ad_ref->params;
        char label[160];
        snprintf(label, sizeof label, "%s of %s", what, en->name);
        ok &= close_enough(got + a, want + b, n, cs, label);
    }
    return ok;
}

/* ---- one case: reference and expert-parallel steps side by side ------------------------ */

typedef struct ep_case {
    const char *name;
    int E;
    router_kind_t kind;
    bias_mode_t bias;
    int empty_last; /* the last rank gets no tokens (when N > 1) */
    int replay;     /* routing replay instead of the router's choice */
    float aux;      /* balance loss coefficient */
    int TG;         /* global tokens */
} ep_case_t;

/* Rank r's tokens: first[r] .. first[r] + count[r] - 1 of the global batch. */
static void split_tokens(int *first, int *count, int TG, int empty_last) {
    int parts = empty_last && g_size > 1 ? g_size - 1 : g_size;
    int at = 0;
    for (int r = 0; r < g_size; r++) {
        count[r] = r < parts ? TG / parts + (r < TG % parts) : 0;
        first[r] = at;
        at += count[r];
    }
}

typedef struct step_io {
    float *x, *dout, *pre;   /* (TG, D) inputs, output gradient, dx's prior value */
    int32_t *replay;         /* (TG, K) or NULL */
    float *out_ref, *dx_ref; /* (TG, D) */
    float *out_ep, *dx_ep;   /* (T, D) this rank's rows */
    int *first, *count;      /* (N) */
} step_io_t;

/* The all-to-all counters of this step against moe_ep_traffic and against the rows the
 * reference routing implies; rank 0 prints the global sum against the formula. */
static void check_traffic(const layer_t *L, const ep_case_t *cs, const moe_ep_state_t *st,
                          const moe_state_t *ref, const step_io_t *io, int print) {
    int64_t out = 0, in = 0, local = 0;
    int lo = io->first[g_rank], hi = lo + io->count[g_rank];
    for (int t = 0; t < cs->TG; t++)
        for (int k = 0; k < K; k++) {
            int owner = moe_ep_owner(L->E, g_size, ref->idx[t * K + k]);
            int mine = t >= lo && t < hi;
            out += mine && owner != g_rank;
            local += mine && owner == g_rank;
            in += !mine && owner == g_rank;
        }
    moe_ep_traffic_t tr;
    moe_ep_traffic(&tr, st, &L->cfg);
    CU_ASSERT_EQUAL(tr.rows_out, out);
    CU_ASSERT_EQUAL(tr.rows_in, in);
    CU_ASSERT_EQUAL(tr.rows_local, local);
    uint64_t row = D * sizeof(float), cnt = (uint64_t)L->n * 8;
    uint64_t want_sent = 2 * (uint64_t)(out + in) * row + (uint64_t)(g_size - 1) * cnt;
    uint64_t want_local = 4 * (uint64_t)local * row + cnt;
    const comm_stats_t *s = comm_stats(g_c, COMM_OP_ALLTOALLV);
    CU_ASSERT_EQUAL(s->calls, 5);
    CU_ASSERT_EQUAL(s->bytes_sent, want_sent);
    CU_ASSERT_EQUAL(s->bytes_recv, want_sent);
    CU_ASSERT_EQUAL(s->bytes_local, want_local);
    CU_ASSERT_EQUAL(tr.bytes_sent, s->bytes_sent);
    CU_ASSERT_EQUAL(tr.bytes_recv, s->bytes_recv);
    CU_ASSERT_EQUAL(tr.bytes_local, s->bytes_local);
    CU_ASSERT_EQUAL(tr.calls, s->calls);

    int64_t sum[3] = {(int64_t)s->bytes_sent, local, (int64_t)s->bytes_local};
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, sum, sum, 3, DT_I64), 0);
    int64_t rows_all = (int64_t)cs->TG * K, counts = (int64_t)g_size * (g_size - 1) * 8 * L->n;
    int64_t formula = (rows_all - sum[1]) * D * 4 * 2 * 2;
    CU_ASSERT_EQUAL(sum[0], formula + counts);
    if (print && g_rank == 0)
        printf("\n  %s, N = %d: all-to-all bytes sent per step (all ranks) %lld = "
               "tokens %d x K %d x D %d x 4 B x 2 directions x 2 passes - %lld local rows' "
               "%lld B = %lld, + %lld B of per-expert counts; local copies %lld B\n",
               cs->name, g_size, (long long)sum[0], cs->TG, K, D, (long long)sum[1],
               (long long)sum[1] * D * 16, (long long)formula, (long long)counts,
               (long long)sum[2]);
}

/* Forward and backward of both layers; returns 1 when every check passed. */
static int one_step(layer_t *L, const ep_case_t *cs, step_io_t *io, int step) {
    const kernels_t *k = kern();
    int TG = cs->TG, T = io->count[g_rank], t0 = io->first[g_rank];
    arena_t ar_ref, ar_ep;
    arena_init(&ar_ref, 0);
    arena_init(&ar_ep, 0);
    lora_adapter_zero_grads(L->ad_ref);
    lora_adapter_zero_grads(L->ad_ep);
    tu_poison(io->out_ref, (size_t)TG * D);
    tu_poison(io->out_ep, (size_t)(T > 0 ? T : 1) * D);
    memcpy(io->dx_ref, io->pre, sizeof(float) * (size_t)TG * D);
    memcpy(io->dx_ep, io->pre + (size_t)t0 * D, sizeof(float) * (size_t)T * D);

    moe_state_t ref;
    CU_ASSERT_EQUAL_FATAL(moe_forward(k, &ar_ref, &ref, io->out_ref, io->x, &L->cfg, &L->w_ref, TG,
                                      io->replay, DT_I32),
                          0);
    CU_ASSERT_EQUAL_FATAL(moe_backward(k, &ar_ref, io->dx_ref, io->dout, &ref, &L->cfg, &L->w_ref),
                          0);

    moe_ep_state_t st;
    comm_stats_reset(g_c);
    const int32_t *rp = io->replay ? io->replay + (size_t)t0 * K : NULL;
    int rc = moe_ep_forward(k, &ar_ep, g_c, &st, io->out_ep, io->x + (size_t)t0 * D, &L->cfg,
                            &L->w_ep, T, rp, DT_I32);
    if (rc < 0)
        tu_report("rank %d: moe_ep_forward: %s", g_rank, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    rc = moe_ep_backward(k, &ar_ep, g_c, io->dx_ep, io->dout + (size_t)t0 * D, &st, &L->cfg,
                         &L->w_ep);
    if (rc < 0)
        tu_report("rank %d: moe_ep_backward: %s", g_rank, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    check_traffic(L, cs, &st, &ref, io, step == 1);
    CU_ASSERT_EQUAL(moe_ep_allreduce_replicated(g_c, L->ad_ep), 0);

    int ok = 1;
    ok &= memcmp(st.loc.idx, ref.idx + (size_t)t0 * K, sizeof(int32_t) * (size_t)T * K) == 0;
    ok &= memcmp(st.loc.load, ref.load, sizeof(int64_t) * (size_t)L->E) == 0;
    ok &= st.T_global == TG && fabsf(st.loc.imbalance - ref.imbalance) <= 1e-6f * ref.imbalance;
    ok &= fabsf(st.loc.aux_loss - ref.aux_loss) <= (float)TOL * fabsf(ref.aux_loss);
    if (!ok)
        tu_report("rank %d, %s: routing, load or balance loss differ (aux %g vs %g)", g_rank,
                  cs->name, (double)st.loc.aux_loss, (double)ref.aux_loss);
    ok &= close_enough(io->out_ep, io->out_ref + (size_t)t0 * D, (size_t)T * D, cs->name, "out");
    ok &= close_enough(io->dx_ep, io->dx_ref + (size_t)t0 * D, (size_t)T * D, cs->name, "dx");
    ok &= compare_entries(L, 1, LORA_KIND_EXPERT, cs->name, "expert gradient");
    ok &= compare_entries(L, 1, LORA_KIND_SHARED_EXPERT, cs->name, "shared gradient");
    CU_ASSERT(ok);
    if (step == 1 && g_size > 1) {
        /* the skewed cases: who receives nothing */
        if (cs->bias == BIAS_TO_RANK0)
            CU_ASSERT(g_rank == 0 ? st.R == TG * K : st.R == 0);
        if (cs->bias == BIAS_AWAY_FROM_LAST && g_rank == g_size - 1)
            CU_ASSERT_EQUAL(st.R, 0);
    }
    if (step == 1 && cs->empty_last && g_size > 1 && g_rank == g_size - 1) {
        CU_ASSERT_EQUAL(T, 0);
        CU_ASSERT(st.R > 0); /* it still serves its experts */
    }

    k->adamw_update(L->ad_ref->params, L->ad_ref->grads, L->m_ref, L->v_ref, L->ad_ref->n_params,
                    LR, 0.9f, 0.999f, 1e-6f, WD, step);
    k->adamw_update(L->ad_ep->params, L->ad_ep->grads, L->m_ep, L->v_ep, L->ad_ep->n_params, LR,
                    0.9f, 0.999f, 1e-6f, WD, step);
    arena_free(&ar_ref);
    arena_free(&ar_ep);
    return ok;
}

static void run_case(const ep_case_t *cs) {
    layer_t *L = malloc(sizeof *L);
    CU_ASSERT_EQUAL_FATAL(layer_init(L, cs->E, cs->kind, cs->bias, cs->aux), 0);
    int TG = cs->TG;
    step_io_t io;
    io.first = malloc(sizeof(int) * (size_t)g_size);
    io.count = malloc(sizeof(int) * (size_t)g_size);
    split_tokens(io.first, io.count, TG, cs->empty_last);
    size_t n = (size_t)TG * D, T = (size_t)io.count[g_rank];
    io.x = malloc(sizeof(float) * n);
    io.dout = malloc(sizeof(float) * n);
    io.pre = malloc(sizeof(float) * n);
    io.out_ref = malloc(sizeof(float) * n);
    io.dx_ref = malloc(sizeof(float) * n);
    io.out_ep = malloc(sizeof(float) * (T > 0 ? T : 1) * D);
    io.dx_ep = malloc(sizeof(float) * (T > 0 ? T : 1) * D);
    tu_fill(io.x, n, 301, -1.0f, 1.0f);
    /* the gradient of a loss normalised by the global token count */
    tu_fill(io.dout, n, 302, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++)
        io.dout[i] /= (float)TG;
    tu_fill(io.pre, n, 303, -0.01f, 0.01f);
    io.replay = NULL;
    if (cs->replay) {
        io.replay = malloc(sizeof(int32_t) * (size_t)TG * K);
        for (int t = 0; t < TG; t++) {
            io.replay[t * K] = (5 * t + 1) % cs->E;
            io.replay[t * K + 1] = (io.replay[t * K] + 1 + t % 3) % cs->E;
        }
    }
    int ok = 1;
    for (int step = 1; step <= STEPS; step++)
        ok &= one_step(L, cs, &io, step);
    ok &= compare_entries(L, 0, -1, cs->name, "adapter after 3 AdamW steps");
    CU_ASSERT(ok);
    free(io.first), free(io.count), free(io.x), free(io.dout), free(io.pre);
    free(io.out_ref), free(io.dx_ref), free(io.out_ep), free(io.dx_ep), free(io.replay);
    layer_free(L);
    free(L);
}

/* ---- tests -------------------------------------------------------------------------- */

static void test_balanced_e8(void) {
    ep_case_t cs = {
        "balanced, E = 8, balance loss", 8, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0, 0, 0.01f, 24};
    run_case(&cs);
}

static void test_balanced_e4(void) {
    ep_case_t cs = {
        "balanced, E = 4, uneven token split", 4, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0, 0, 0.0f, 21};
    run_case(&cs);
}

static void test_all_to_rank0(void) {
    ep_case_t cs = {"every token to rank 0's experts",
                    8,
                    ROUTER_SIGMOID_GROUPED,
                    BIAS_TO_RANK0,
                    0,
                    0,
                    0.01f,
                    20};
    run_case(&cs);
}

static void test_last_rank_idle(void) {
    ep_case_t cs = {"no token for the last rank's experts",
                    8,
                    ROUTER_SIGMOID_GROUPED,
                    BIAS_AWAY_FROM_LAST,
                    0,
                    0,
                    0.0f,
                    20};
    run_case(&cs);
}

static void test_rank_without_tokens(void) {
    ep_case_t cs = {
        "last rank without tokens, replay", 8, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 1, 1, 0.01f, 18};
    run_case(&cs);
}

/* E = 6: rejected with N = 4 (checked directly on every run), valid with N = 1 or 2. */
static void test_uneven_experts(void) {
    mo_clear_error();
    CU_ASSERT_EQUAL(moe_ep_check(6, 4), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "E = 6"));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "N = 4"));
    CU_ASSERT_EQUAL(moe_ep_check(6, 2), 0);
    CU_ASSERT_EQUAL(moe_ep_check(6, 1), 0);
    CU_ASSERT_EQUAL(moe_ep_check(8, 4), 0);
    CU_ASSERT_EQUAL(moe_ep_check(4, 8), MO_ECONFIG);
    CU_ASSERT_EQUAL(moe_ep_check(8, 0), MO_ECONFIG);
    if (6 % g_size == 0) {
        ep_case_t cs = {"E = 6", 6, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0, 0, 0.0f, 15};
        run_case(&cs);
        return;
    }
    /* Every rank refuses before any exchange, so none is left waiting. */
    layer_t *L = malloc(sizeof *L);
    CU_ASSERT_EQUAL_FATAL(layer_init(L, 6, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0.0f), 0);
    float x[4 * D], out[4 * D];
    tu_fill(x, 4 * D, 5, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    moe_ep_state_t st;
    mo_clear_error();
    CU_ASSERT_EQUAL(
        moe_ep_forward(kern(), &ar, g_c, &st, out, x, &L->cfg, &L->w_ep, 4, NULL, DT_I32),
        MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "E = 6"));
    CU_ASSERT_EQUAL(comm_barrier(g_c), 0);
    arena_free(&ar);
    layer_free(L);
    free(L);
}

/* A bad replay index on rank 0 only: rank 0 reports it, every other rank learns of it
 * at the first exchange, and the communicator stays in step. */
static void test_routing_error_shared(void) {
    layer_t *L = malloc(sizeof *L);
    CU_ASSERT_EQUAL_FATAL(layer_init(L, 8, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0.0f), 0);
    enum { TT = 3 };
    float x[TT * D], out[TT * D];
    int32_t rp[TT * K] = {0, 1, 2, 3, 4, 5};
    if (g_rank == 0)
        rp[3] = 8; /* outside [0, E) */
    tu_fill(x, TT * D, 6, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    moe_ep_state_t st;
    mo_clear_error();
    int rc = moe_ep_forward(kern(), &ar, g_c, &st, out, x, &L->cfg, &L->w_ep, TT, rp, DT_I32);
    CU_ASSERT_EQUAL(rc, g_rank == 0 ? MO_EMALFORMED : MO_ESTATE);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), g_rank == 0 ? "8" : "other rank"));
    int64_t one = 1;
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, &one, &one, 1, DT_I64), 0);
    CU_ASSERT_EQUAL(one, g_size);
    arena_free(&ar);
    layer_free(L);
    free(L);
}

/* No token on any rank: every exchange is empty, nothing is written, the counters hold
 * only the per-expert counts. */
static void test_no_tokens_anywhere(void) {
    layer_t *L = malloc(sizeof *L);
    CU_ASSERT_EQUAL_FATAL(layer_init(L, 8, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0.01f), 0);
    float x[D], out[D], dx[D], dout[D];
    tu_fill(x, D, 7, -1, 1);
    tu_fill(dout, D, 8, -1, 1);
    tu_poison(out, D);
    tu_poison(dx, D);
    arena_t ar;
    arena_init(&ar, 0);
    moe_ep_state_t st;
    comm_stats_reset(g_c);
    CU_ASSERT_EQUAL(
        moe_ep_forward(kern(), &ar, g_c, &st, out, x, &L->cfg, &L->w_ep, 0, NULL, DT_I32), 0);
    CU_ASSERT_EQUAL(moe_ep_backward(kern(), &ar, g_c, dx, dout, &st, &L->cfg, &L->w_ep), 0);
    CU_ASSERT_EQUAL(st.T_global, 0);
    CU_ASSERT_EQUAL(st.R, 0);
    CU_ASSERT_EQUAL(st.loc.aux_loss, 0.0f);
    CU_ASSERT(isnan(out[0]) && isnan(dx[0]));
    moe_ep_traffic_t tr;
    moe_ep_traffic(&tr, &st, &L->cfg);
    const comm_stats_t *s = comm_stats(g_c, COMM_OP_ALLTOALLV);
    CU_ASSERT_EQUAL(s->bytes_sent, (uint64_t)(g_size - 1) * 8 * L->n);
    CU_ASSERT_EQUAL(s->bytes_local, (uint64_t)8 * L->n);
    CU_ASSERT_EQUAL(tr.bytes_sent, s->bytes_sent);
    CU_ASSERT_EQUAL(tr.bytes_local, s->bytes_local);
    CU_ASSERT_EQUAL(tr.calls, s->calls);
    arena_free(&ar);
    layer_free(L);
    free(L);
}

/* Per-rank expert weight bytes fall as 1 / N; rank 0 prints every rank's. */
static void test_expert_memory(void) {
    layer_t *L = malloc(sizeof *L);
    CU_ASSERT_EQUAL_FATAL(layer_init(L, 8, ROUTER_SOFTMAX_TOPK, BIAS_NONE, 0.0f), 0);
    size_t full = moe_ep_expert_weight_bytes(&L->cfg, &L->w_ref, 0, L->E);
    size_t mine = moe_ep_expert_weight_bytes(&L->cfg, &L->w_ep, L->e0, L->n);
    CU_ASSERT_EQUAL(full, (size_t)L->E * 3 * F * D * 2);
    CU_ASSERT_EQUAL(mine * (size_t)g_size, full);
    int64_t *all = calloc((size_t)g_size, sizeof(int64_t));
    all[g_rank] = (int64_t)mine;
    CU_ASSERT_EQUAL(comm_allreduce_sum(g_c, all, all, (size_t)g_size, DT_I64), 0);
    if (g_rank == 0) {
        printf("\n  expert weights per rank, E = 8, bf16 (full layer %zu B):", full);
        for (int r = 0; r < g_size; r++)
            printf(" rank %d %lld B%s", r, (long long)all[r], r + 1 == g_size ? "\n" : "");
    }
    for (int r = 0; r < g_size; r++)
        CU_ASSERT_EQUAL(all[r], (int64_t)(full / (size_t)g_size));
    free(all);
    layer_free(L);
    free(L);
}

/* The list all-reduce sums exactly representable values. */
static void test_allreduce_grads(void) {
    float a[5], b[3], c0[1];
    for (int i = 0; i < 5; i++)
        a[i] = (float)(g_rank + 1) * (i + 0.5f);
    for (int i = 0; i < 3; i++)
        b[i] = -(float)g_rank * 0.25f - (float)i;
    c0[0] = NAN; /* zero-length entry: never touched */
    float *bufs[3] = {a, b, c0};
    size_t counts[3] = {5, 3, 0};
    CU_ASSERT_EQUAL(moe_ep_allreduce_grads(g_c, bufs, counts, 3), 0);
    float tri = (float)g_size * (g_size + 1) / 2, lin = (float)g_size * (g_size - 1) / 2;
    for (int i = 0; i < 5; i++)
        CU_ASSERT_EQUAL(a[i], tri * (i + 0.5f));
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(b[i], -lin * 0.25f - (float)g_size * i);
    CU_ASSERT(isnan(c0[0]));
}

static CU_TestInfo g_tests[] = {
    {"allreduce_grads", test_allreduce_grads},
    {"expert_memory", test_expert_memory},
    {"balanced_e8", test_balanced_e8},
    {"balanced_e4", test_balanced_e4},
    {"all_to_rank0", test_all_to_rank0},
    {"last_rank_idle", test_last_rank_idle},
    {"rank_without_tokens", test_rank_without_tokens},
    {"uneven_experts", test_uneven_experts},
    {"routing_error_shared", test_routing_error_shared},
    {"no_tokens_anywhere", test_no_tokens_anywhere},
    CU_TEST_INFO_NULL,
};

int main(void) {
    if (comm_init_from_env(&g_c, "auto") < 0) {
        fprintf(stderr, "mpi_moe_ep: %s\n", mo_last_error());
        return 1;
    }
    g_rank = comm_rank(g_c);
    g_size = comm_size(g_c);
    int64_t failed = tu_main("mpi_moe_ep", g_tests) != 0;
    /* Every rank exits with the verdict of all ranks. */
    if (comm_allreduce_sum(g_c, &failed, &failed, 1, DT_I64) < 0) {
        fprintf(stderr, "mpi_moe_ep rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    if (failed && g_rank == 0)
        fprintf(stderr, "mpi_moe_ep: %lld of %d ranks failed\n", (long long)failed, g_size);
    if (comm_destroy(&g_c) < 0) {
        fprintf(stderr, "mpi_moe_ep rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    return failed ? 1 : 0;
}
