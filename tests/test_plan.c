/* test_plan: the memory and communication plan against what moerl measures: published
 * parameter counts of the presets; the actor's adapter module list; checkpoint bytes,
 * adapter size and arena peaks of forward + backward on tiny and small models (recompute
 * off and on, and the inference forward); the MoE block's allocations, single-process
 * and expert-parallel; all-to-all bytes against moe_ep_traffic and the communicator's
 * counters; the fit search, KV capacity, bad layouts, and the `moerl plan` command. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/backend.h"
#include "core/comm.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "learner/plan.h"
#include "moe/moe.h"
#include "moe/moe_ep.h"
#include "tests/testutil.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* Tolerances. Published counts are rounded (totals to 3 significant digits, active
 * counts to 2): totals within 1.5%, active counts within 3%. The plan counts the actor's
 * allocations one by one; what it cannot know is how the routing spreads rows over
 * experts (it assumes an even spread) and a few hundred bytes of bookkeeping structs
 * per layer: arena peaks within 2%, the MoE block alone within 1%, and the learner total
 * (weights + adapter + optimizer + activations) within the 15% the plan promises. (On
 * these cases they agree to 0.4%; the exact all-to-all count is checked for equality.) */
#define TOL_TOTAL 0.015
#define TOL_ACTIVE 0.03
#define TOL_ARENA 0.02
#define TOL_BLOCK 0.01
#define TOL_LEARNER 0.15

static const kernels_t *kern(void) {
    return backend_cpu()->k;
}

static double rel(double got, double want) {
    return fabs(got - want) / (fabs(want) > 0.0 ? fabs(want) : 1.0);
}

/* ---- (1) published parameter counts ------------------------------------------------- */

static void test_published_counts(void) {
    static const struct {
        const char *name;
        double total, active;
    } pub[] = {
        {"kimi-k2", 1.03e12, 32e9},       {"deepseek-v3", 671e9, 37e9},
        {"qwen3-235b-a22b", 235e9, 22e9}, {"qwen3-30b-a3b", 30.5e9, 3.3e9},
        {"mixtral-8x7b", 46.7e9, 12.9e9}, {"olmoe-1b-7b", 6.9e9, 1.3e9},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof pub / sizeof pub[0]; i++) {
        model_config_t c;
        const char *note = NULL;
        CU_ASSERT_EQUAL_FATAL(plan_preset(&c, pub[i].name, &note), 0);
        CU_ASSERT_PTR_NOT_NULL_FATAL(plan_preset_names[i]);
        CU_ASSERT_STRING_EQUAL(plan_preset_names[i], pub[i].name);
        CU_ASSERT((note != NULL) == (strcmp(pub[i].name, "olmoe-1b-7b") == 0));
        plan_layout_t l;
        plan_layout_default(&l);
        l.base = PLAN_W_F32;
        l.ep = l.rollout_gpus = 1;
        plan_t p;
        CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
        TU_ASSERT_CLOSE(rel((double)p.params_total, pub[i].total), TOL_TOTAL, pub[i].name);
        TU_ASSERT_CLOSE(rel((double)p.params_active, pub[i].active), TOL_ACTIVE, pub[i].name);
        /* The plan's tensor walk holds exactly the parameters model_config counts. */
        CU_ASSERT_EQUAL(p.base_replicated + p.base_experts, 4.0 * (double)p.params_total);
        printf("  %-16s %.4g total, %.4g active (published %.3g, %.2g)\n", pub[i].name,
               (double)p.params_total, (double)p.params_active, pub[i].total, pub[i].active);
        n++;
    }
    CU_ASSERT_PTR_NULL(plan_preset_names[n]);
    model_config_t c;
    CU_ASSERT_EQUAL(plan_preset(&c, "gpt-5", NULL), MO_ENOTFOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "kimi-k2"));
}

/* ---- the module list is the actor's ------------------------------------------------- */

static int write_model(char *dir, size_t cap, model_arch_t arch, init_size_t size, dtype_t dt,
                       model_config_t *c) {
    if (tu_tmpdir(dir, cap) < 0 || init_model_config(c, arch, size, dt) < 0)
        return -1;
    init_model_opts_t o = {7, 0.0f};
    return init_model_write(dir, c, &o);
}

static void test_modules_match_actor(void) {
    for (int arch = 0; arch < ARCH_COUNT; arch++) {
        char dir[512];
        model_config_t c;
        CU_ASSERT_EQUAL_FATAL(
            write_model(dir, sizeof dir, (model_arch_t)arch, INIT_SIZE_TINY, DT_F32, &c), 0);
        model_t *m = NULL;
        int rc = model_open(&m, dir, NULL);
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        lora_module_desc_t *mods = NULL;
        int n = 0;
        CU_ASSERT_EQUAL_FATAL(plan_modules(&mods, &n, &c), 0);
        CU_ASSERT_EQUAL(n, m->n_modules);
        int same = n == m->n_modules;
        for (int i = 0; same && i < n; i++) {
            const lora_module_desc_t *a = &mods[i], *b = &m->modules[i];
            same = !strcmp(a->name, b->name) && !strcmp(a->proj, b->proj) && a->kind == b->kind &&
                   a->C == b->C && a->OC == b->OC;
            if (!same)
                tu_report("module %d: plan %s (%s, %d x %d), actor %s (%s, %d x %d)", i, a->name,
                          a->proj, a->OC, a->C, b->name, b->proj, b->OC, b->C);
        }
        CU_ASSERT(same);
        plan_modules_free(&mods, n);
        CU_ASSERT_PTR_NULL(mods);
        model_destroy(&m);
        tu_rmtree(dir);
    }
    /* MLA without q_lora_rank: q_proj instead of q_a_proj and q_b_proj. */
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_DEEPSEEK_V3, INIT_SIZE_TINY, DT_F32), 0);
    c.q_lora_rank = 0;
    lora_module_desc_t *mods = NULL;
    int n = 0;
    CU_ASSERT_EQUAL_FATAL(plan_modules(&mods, &n, &c), 0);
    CU_ASSERT_STRING_EQUAL(mods[0].name, "model.layers.0.self_attn.q_proj");
    CU_ASSERT_EQUAL(mods[0].OC, c.num_attention_heads * c.head_dim);
    CU_ASSERT_STRING_EQUAL(mods[1].proj, "kv_a_proj_with_mqa");
    plan_modules_free(&mods, n);
}

/* ---- (2) memory against measurement -------------------------------------------------- */

typedef struct mcase {
    const char *name;
    model_arch_t arch;
    init_size_t size;
    dtype_t dtype;
    const char *targets[3];
    int n_targets, R, T, B;
} mcase_t;

typedef struct measured {
    double weights;   /* checkpoint tensor bytes */
    int64_t n_params; /* adapter parameters */
    double arena, scratch;
    float imbalance; /* the busiest MoE layer's max / mean load */
} measured_t;

static double checkpoint_bytes(const model_t *m) {
    double b = 0.0;
    for (int i = 0; i < st_checkpoint_num_tensors(m->ck); i++) {
        const st_info_t *in = st_checkpoint_info(m->ck, i);
        b += (double)(in->end - in->begin);
    }
    return b;
}

/* Opens the model, binds a random adapter and runs one step: forward(for_backward) and,
 * with for_backward, backward. */
static void measure(const char *dir, const mcase_t *mc, int recompute, int for_backward,
                    measured_t *out) {
    memset(out, 0, sizeof *out);
    model_opts_t o = {recompute, 0, 0.0f};
    model_t *m = NULL;
    int rc = model_open(&m, dir, &o);
    if (rc < 0)
        tu_report("%s: %s", mc->name, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    lora_config_t lc = {mc->R, 2.0f * mc->R, 0, 0.0f, 5, 0, mc->targets, mc->n_targets};
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &lc, m->modules, m->n_modules), 0);
    for (int i = 0; i < ad->n_tensors; i++)
        rng_fill_uniform(ad->params + ad->tensors[i].offset, ad->tensors[i].numel, 9, (uint64_t)i,
                         -0.1f, 0.1f);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, ad), 0);
    int T = mc->T, B = mc->B;
    int32_t *tok = malloc(sizeof(int32_t) * 4 * (size_t)T), *pos = tok + T, *tgt = pos + T;
    int32_t cu[17];
    float *logp = malloc(sizeof(float) * 2 * (size_t)T), *dl = logp + T;
    CU_ASSERT_FATAL(tok && logp && B <= 16);
    for (int b = 0; b <= B; b++)
        cu[b] = b * T / B;
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rng_uniform(3, 1, (uint64_t)t) * (float)m->V) % m->V;
        dl[t] = 2.0f * rng_uniform(3, 2, (uint64_t)t) - 1.0f;
    }
    model_batch_next_token(pos, tgt, tok, cu, B);
    model_batch_t bt = {T, B, tok, pos, cu, tgt, 1.0f, NULL, NULL};
    tu_poison(logp, (size_t)T);
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &bt, logp, NULL, for_backward), 0);
    int finite = 1;
    for (int t = 0; t < T; t++)
        finite &= isfinite(logp[t]) != 0;
    CU_ASSERT(finite);
    if (for_backward) {
        lora_adapter_zero_grads(ad);
        CU_ASSERT_EQUAL_FATAL(model_backward(m, dl, NULL), 0);
        double g = 0.0;
        for (size_t i = 0; i < ad->n_params; i++)
            g += (double)fabsf(ad->grads[i]);
        CU_ASSERT(g > 0.0 && isfinite(g));
    }
    out->weights = checkpoint_bytes(m);
    out->n_params = (int64_t)ad->n_params;
    out->arena = (double)m->arena.peak;
    out->scratch = (double)m->scratch.peak;
    out->imbalance = 1.0f;
    for (int i = 0; i < m->n_moe; i++)
        out->imbalance = fmaxf(out->imbalance, m->stats[i].imbalance);
    free(tok);
    free(logp);
    model_destroy(&m);
    lora_adapter_destroy(&ad);
}

static void case_layout(plan_layout_t *l, const mcase_t *mc, float imbalance, int recompute) {
    plan_layout_default(l);
    l->ep = l->dp = l->rollout_gpus = 1;
    l->base = mc->dtype == DT_F32 ? PLAN_W_F32 : PLAN_W_BF16;
    l->lora_rank = mc->R;
    l->targets = mc->targets;
    l->n_targets = mc->n_targets;
    l->seq_len = mc->T / mc->B;
    l->tokens = mc->T;
    l->recompute = recompute;
    l->imbalance = imbalance;
    l->reserve_gib = 0.0;
}

static void check_case(const mcase_t *mc) {
    char dir[512];
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(write_model(dir, sizeof dir, mc->arch, mc->size, mc->dtype, &c), 0);
    for (int rec = 0; rec < 2; rec++) {
        measured_t ms;
        measure(dir, mc, rec, 1, &ms);
        plan_layout_t l;
        case_layout(&l, mc, ms.imbalance, rec);
        plan_t p;
        CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
        double weights = p.base_replicated + p.base_experts;
        CU_ASSERT_EQUAL(weights, ms.weights);
        CU_ASSERT_EQUAL(p.lora_params, ms.n_params);
        CU_ASSERT_EQUAL(p.lora_params_gpu, ms.n_params);
        double opt = 16.0 * (double)ms.n_params; /* params, grads, two moments */
        CU_ASSERT_EQUAL(p.lora_bytes + p.grad_bytes + p.adam_bytes, opt);
        double got = ms.weights + opt + ms.arena + ms.scratch;
        double want = p.total[rec] - p.reserve;
        printf("  %-22s recompute %-3s arena %9.0f plan %9.0f (%+.2f%%)  scratch %9.0f plan "
               "%9.0f (%+.2f%%)  total %+.2f%%\n",
               mc->name, rec ? "on" : "off", ms.arena, p.acts[rec].kept,
               100.0 * (p.acts[rec].kept - ms.arena) / ms.arena, ms.scratch, p.acts[rec].temps,
               100.0 * (p.acts[rec].temps - ms.scratch) / ms.scratch, 100.0 * (want - got) / got);
        TU_ASSERT_CLOSE(rel(p.acts[rec].kept, ms.arena), TOL_ARENA, mc->name);
        TU_ASSERT_CLOSE(rel(p.acts[rec].temps, ms.scratch), TOL_ARENA, mc->name);
        TU_ASSERT_CLOSE(rel(want, got), TOL_LEARNER, mc->name);
    }
    /* The inference forward (the rollout workspace's model). */
    measured_t ms;
    measure(dir, mc, 0, 0, &ms);
    plan_layout_t l;
    case_layout(&l, mc, ms.imbalance, 0);
    plan_acts_t a;
    CU_ASSERT_EQUAL_FATAL(plan_activations(&a, &c, &l, 0, 0), 0);
    printf("  %-22s inference     arena %9.0f plan %9.0f (%+.2f%%)  scratch %9.0f plan %9.0f "
           "(%+.2f%%)\n",
           mc->name, ms.arena, a.kept, 100.0 * (a.kept - ms.arena) / ms.arena, ms.scratch, a.temps,
           100.0 * (a.temps - ms.scratch) / ms.scratch);
    TU_ASSERT_CLOSE(rel(a.kept, ms.arena), TOL_ARENA, mc->name);
    TU_ASSERT_CLOSE(rel(a.temps, ms.scratch), TOL_ARENA, mc->name);
    tu_rmtree(dir);
}

static void test_memory_tiny(void) {
    static const mcase_t cases[] = {
        {"tiny qwen3 f32", ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32, {"all-linear"}, 1, 8, 96, 3},
        {"tiny mixtral f32",
         ARCH_MIXTRAL,
         INIT_SIZE_TINY,
         DT_F32,
         {"q_proj", "v_proj", "experts"},
         3,
         4,
         80,
         2},
        {"tiny deepseek f32",
         ARCH_DEEPSEEK_V3,
         INIT_SIZE_TINY,
         DT_F32,
         {"all-linear"},
         1,
         8,
         96,
         2},
        {"tiny deepseek bf16",
         ARCH_DEEPSEEK_V3,
         INIT_SIZE_TINY,
         DT_BF16,
         {"attention", "shared_experts"},
         2,
         4,
         64,
         4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(&cases[i]);
}

static void test_memory_small(void) {
    static const mcase_t cases[] = {
        {"small qwen3 bf16",
         ARCH_QWEN3_MOE,
         INIT_SIZE_SMALL,
         DT_BF16,
         {"attention", "experts"},
         2,
         8,
         64,
         2},
        {"small deepseek bf16",
         ARCH_DEEPSEEK_V3,
         INIT_SIZE_SMALL,
         DT_BF16,
         {"all-linear"},
         1,
         8,
         64,
         1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(&cases[i]);
}

/* ---- the MoE block alone, single-process and expert-parallel ------------------------ */

enum { BT = 50 }; /* tokens */

typedef struct block {
    model_config_t c;
    moe_cfg_t cfg;
    moe_weights_t w;
    float *buf; /* every weight and activation */
    wview_t *views;
    float *x, *dout, *out, *dx; /* (BT, D) */
} block_t;

/* The MoE block of the tiny DeepSeek-V3 preset (D 64, E 8, K 2, F 32, one shared expert),
 * softmax top-k routing, f32 weights, no adapters. */
static void block_init(block_t *b) {
    memset(b, 0, sizeof *b);
    CU_ASSERT_EQUAL_FATAL(init_model_config(&b->c, ARCH_DEEPSEEK_V3, INIT_SIZE_TINY, DT_F32), 0);
    int D = b->c.hidden_size, E = b->c.num_experts, F = b->c.moe_intermediate_size;
    b->cfg.D = D;
    b->cfg.F = F;
    b->cfg.n_shared = b->c.n_shared_experts;
    router_cfg_init(&b->cfg.router, ROUTER_SOFTMAX_TOPK, E, b->c.num_experts_per_tok);
    b->cfg.router.norm_topk_prob = 1;
    size_t mat = (size_t)F * D, n = (size_t)E * D + (3 * (size_t)E + 3) * mat + 4 * (size_t)BT * D;
    b->buf = malloc(sizeof(float) * n);
    b->views = calloc(3 * (size_t)E, sizeof *b->views);
    CU_ASSERT_FATAL(b->buf && b->views);
    tu_fill(b->buf, n, 17, -0.5f, 0.5f);
    float *p = b->buf;
    b->w.router = wview_f32(p);
    p += (size_t)E * D;
    for (int i = 0; i < 3 * E; i++, p += mat)
        b->views[i] = wview_f32(p);
    b->w.gate = b->views;
    b->w.up = b->views + E;
    b->w.down = b->views + 2 * (size_t)E;
    b->w.shared.gate = wview_f32(p);
    b->w.shared.up = wview_f32(p + mat);
    b->w.shared.down = wview_f32(p + 2 * mat);
    p += 3 * mat;
    b->x = p;
    b->dout = p + (size_t)BT * D;
    b->out = p + 2 * (size_t)BT * D;
    b->dx = p + 3 * (size_t)BT * D;
    tu_poison(b->out, (size_t)BT * D);
    memset(b->dx, 0, sizeof(float) * (size_t)BT * D);
}

static void block_free(block_t *b) {
    free(b->buf);
    free(b->views);
}

static float load_imbalance(const int64_t *load, int E, int S) {
    int64_t mx = 0;
    for (int e = 0; e < E; e++)
        mx = load[e] > mx ? load[e] : mx;
    return (float)((double)mx * E / S);
}

static void block_check(const block_t *b, int ep_layer, const arena_t *fa, const arena_t *ba,
                        float imbalance) {
    plan_layout_t l;
    static const char *const attn[1] = {"attention"};
    plan_layout_default(&l);
    l.ep = l.rollout_gpus = 1;
    l.tokens = BT;
    l.targets = attn;
    l.imbalance = imbalance;
    plan_block_t pb;
    CU_ASSERT_EQUAL_FATAL(plan_moe_block(&pb, &b->c, &l, 1, ep_layer), 0);
    printf("  MoE block %-15s forward %7zu plan %7.0f (%+.2f%%)  backward %7zu plan %7.0f "
           "(%+.2f%%)\n",
           ep_layer ? "expert-parallel" : "single-process", fa->peak, pb.fwd,
           100.0 * (pb.fwd - (double)fa->peak) / (double)fa->peak, ba->peak, pb.bwd,
           100.0 * (pb.bwd - (double)ba->peak) / (double)ba->peak);
    TU_ASSERT_CLOSE(rel(pb.fwd, (double)fa->peak), TOL_BLOCK, "block forward");
    TU_ASSERT_CLOSE(rel(pb.bwd, (double)ba->peak), TOL_BLOCK, "block backward");
    CU_ASSERT(ep_layer ? pb.a2a_fwd > 0.0 && pb.a2a_bwd > 0.0 : pb.a2a_fwd == 0.0);
    CU_ASSERT_EQUAL(plan_moe_block(&pb, &b->c, &l, 0, ep_layer), MO_EINVAL); /* dense layer */
}

static void test_moe_block_local(void) {
    block_t b;
    block_init(&b);
    arena_t fa, ba;
    arena_init(&fa, 1 << 12);
    arena_init(&ba, 1 << 12);
    moe_state_t st;
    CU_ASSERT_EQUAL_FATAL(moe_forward(kern(), &fa, &st, b.out, b.x, &b.cfg, &b.w, BT, NULL, DT_U16),
                          0);
    CU_ASSERT(isfinite(b.out[0]) && isfinite(b.out[BT * b.cfg.D - 1]));
    CU_ASSERT_EQUAL_FATAL(moe_backward(kern(), &ba, b.dx, b.dout, &st, &b.cfg, &b.w), 0);
    CU_ASSERT(isfinite(b.dx[0]) && b.dx[0] != 0.0f);
    int E = b.cfg.router.E, S = BT * b.cfg.router.K;
    block_check(&b, 0, &fa, &ba, load_imbalance(st.load, E, S));
    arena_free(&fa);
    arena_free(&ba);
    block_free(&b);
}

/* One rank: the expert-parallel layer's allocations, and its all-to-all bytes counted by
 * the communicator against plan_a2a_exact and moe_ep_traffic. */
static void test_moe_block_ep_single_rank(void) {
    block_t b;
    block_init(&b);
    comm_t *cm = NULL;
    CU_ASSERT_EQUAL_FATAL(comm_single_new(&cm), 0);
    arena_t fa, ba;
    arena_init(&fa, 1 << 12);
    arena_init(&ba, 1 << 12);
    moe_ep_state_t st;
    CU_ASSERT_EQUAL_FATAL(
        moe_ep_forward(kern(), &fa, cm, &st, b.out, b.x, &b.cfg, &b.w, BT, NULL, DT_U16), 0);
    CU_ASSERT(isfinite(b.out[0]));
    CU_ASSERT_EQUAL_FATAL(moe_ep_backward(kern(), &ba, cm, b.dx, b.dout, &st, &b.cfg, &b.w), 0);
    CU_ASSERT(isfinite(b.dx[0]) && b.dx[0] != 0.0f);
    int E = b.cfg.router.E, D = b.cfg.D, S = BT * b.cfg.router.K;
    block_check(&b, 1, &fa, &ba, load_imbalance(st.loc.load, E, S));

    int64_t counts[64];
    for (int e = 0; e < E; e++)
        counts[e] = st.loc.plan.offsets[e + 1] - st.loc.plan.offsets[e];
    plan_a2a_t pa;
    plan_a2a_exact(&pa, counts, 1, E, D, 4, 0);
    const comm_stats_t *cs = comm_stats(cm, COMM_OP_ALLTOALLV);
    moe_ep_traffic_t tr;
    moe_ep_traffic(&tr, &st, &b.cfg);
    CU_ASSERT_EQUAL(pa.rows_local, S);
    CU_ASSERT_EQUAL(pa.bytes_local, cs->bytes_local);
    CU_ASSERT_EQUAL(pa.bytes_sent, cs->bytes_sent);
    CU_ASSERT_EQUAL(pa.bytes_recv, cs->bytes_recv);
    CU_ASSERT_EQUAL(pa.bytes_local, tr.bytes_local);
    CU_ASSERT_EQUAL(cs->calls, tr.calls);
    CU_ASSERT_EQUAL(plan_a2a_uniform(BT, 2, D, 1, 4), 0.0);
    arena_free(&fa);
    arena_free(&ba);
    CU_ASSERT_EQUAL(comm_destroy(&cm), 0);
    block_free(&b);
}

/* ---- (3) all-to-all bytes against the expert-parallel layer's count ----------------- */

enum { AN = 4, AE = 16, AK = 2, AD = 24, AMAXT = 64 };

/* Every rank's routing (distinct experts per token) and its dispatch plan, as the
 * expert-parallel layer builds it; counts (N, E) from the plans. */
typedef struct routing {
    int T[AN];
    int32_t idx[AN][AMAXT * AK];
    moe_dispatch_t plan[AN];
    int64_t counts[AN * AE];
    arena_t ar;
} routing_t;

static void routing_build(routing_t *r, uint64_t seed, int skew) {
    arena_init(&r->ar, 1 << 14);
    for (int p = 0; p < AN; p++) {
        r->T[p] = 40 + 7 * p;
        for (int t = 0; t < r->T[p]; t++) {
            uint64_t at = (uint64_t)p * AMAXT + (uint64_t)t;
            int e0 = (int)(rng_uniform(seed, 1, at) * AE) % AE;
            if (skew && rng_uniform(seed, 3, at) < 0.5f)
                e0 = 0; /* half the tokens to rank 0's first expert */
            int e1 = (e0 + 1 + (int)(rng_uniform(seed, 2, at) * (AE - 1))) % AE;
            r->idx[p][(size_t)t * AK] = e0;
            r->idx[p][(size_t)t * AK + 1] = e1;
        }
        CU_ASSERT_EQUAL_FATAL(moe_dispatch_plan(&r->plan[p], &r->ar, r->idx[p], r->T[p], AK, AE),
                              0);
        for (int e = 0; e < AE; e++)
            r->counts[p * AE + e] = r->plan[p].offsets[e + 1] - r->plan[p].offsets[e];
    }
}

/* Rank r's moe_ep_state_t exchange fields from the dispatch plans, as exchange_plan
 * derives them. */
static void rank_state(moe_ep_state_t *st, int64_t *buf, const routing_t *r, int rank) {
    int n = AE / AN;
    memset(st, 0, sizeof *st);
    st->N = AN;
    st->rank = rank;
    st->n = n;
    st->e0 = rank * n;
    st->send_counts = buf;
    st->recv_counts = buf + AN;
    for (int p = 0; p < AN; p++) {
        const int32_t *mine = r->plan[rank].offsets, *theirs = r->plan[p].offsets;
        size_t lo = (size_t)p * n, hi = lo + (size_t)n, mlo = (size_t)rank * n;
        st->send_counts[p] = (int64_t)(mine[hi] - mine[lo]) * AD;
        st->recv_counts[p] = (int64_t)(theirs[mlo + (size_t)n] - theirs[mlo]) * AD;
    }
}

static void test_alltoall_exact(void) {
    moe_cfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.D = AD;
    cfg.F = 8;
    router_cfg_init(&cfg.router, ROUTER_SOFTMAX_TOPK, AE, AK);
    for (int skew = 0; skew < 2; skew++) {
        routing_t r;
        routing_build(&r, 21 + (uint64_t)skew, skew);
        uint64_t sum_sent = 0;
        int64_t local = 0, slots = 0;
        for (int rank = 0; rank < AN; rank++) {
            moe_ep_state_t st;
            int64_t buf[2 * AN];
            rank_state(&st, buf, &r, rank);
            moe_ep_traffic_t tr;
            moe_ep_traffic(&tr, &st, &cfg);
            plan_a2a_t pa;
            plan_a2a_exact(&pa, r.counts, AN, AE, AD, 4, rank);
            CU_ASSERT_EQUAL(pa.rows_out, tr.rows_out);
            CU_ASSERT_EQUAL(pa.rows_in, tr.rows_in);
            CU_ASSERT_EQUAL(pa.rows_local, tr.rows_local);
            CU_ASSERT_EQUAL(pa.bytes_sent, tr.bytes_sent);
            CU_ASSERT_EQUAL(pa.bytes_recv, tr.bytes_recv);
            CU_ASSERT_EQUAL(pa.bytes_local, tr.bytes_local);
            CU_ASSERT(pa.rows_out > 0 && pa.rows_in > 0);
            sum_sent += pa.bytes_sent;
            local += pa.rows_local;
            slots += (int64_t)r.T[rank] * AK;
            /* bf16 rows: the row part halves, the int64 count exchange does not. */
            plan_a2a_t half;
            plan_a2a_exact(&half, r.counts, AN, AE, AD, 2, rank);
            uint64_t cnt = (uint64_t)(AN - 1) * 8u * (AE / AN);
            CU_ASSERT_EQUAL(2 * (half.bytes_sent - cnt), pa.bytes_sent - cnt);
        }
        /* Summed over ranks: (slots - local) D 4 x 2 directions x 2 passes + counts. */
        uint64_t want =
            (uint64_t)(slots - local) * AD * 4 * 2 * 2 + (uint64_t)AN * (AN - 1) * 8 * (AE / AN);
        CU_ASSERT_EQUAL(sum_sent, want);
        arena_free(&r.ar);
    }
}

/* The uniform estimate is the expectation: exactly uniform counts give it exactly, and
 * random uniform routings average to it. */
static void test_alltoall_uniform(void) {
    int64_t counts[AN * AE];
    int T = 64; /* T K / E = 8 slots per expert from every rank */
    for (int i = 0; i < AN * AE; i++)
        counts[i] = (int64_t)T * AK / AE;
    plan_a2a_t pa;
    plan_a2a_exact(&pa, counts, AN, AE, AD, 4, 1);
    uint64_t cnt = (uint64_t)(AN - 1) * 8u * (AE / AN);
    CU_ASSERT_EQUAL((double)(pa.bytes_sent - cnt), plan_a2a_uniform(T, AK, AD, AN, 4));
    double sum = 0.0, want = 0.0;
    int draws = 200;
    for (int d = 0; d < draws; d++) {
        for (int i = 0; i < AN * AE; i++)
            counts[i] = 0;
        for (int p = 0; p < AN; p++)
            for (int s = 0; s < T * AK; s++)
                counts[p * AE +
                       (int)(rng_uniform(99, (uint64_t)d, (uint64_t)p * T * AK + (uint64_t)s) *
                             AE) %
                           AE]++;
        plan_a2a_exact(&pa, counts, AN, AE, AD, 4, 2);
        sum += (double)(pa.bytes_sent - cnt);
        want += plan_a2a_uniform(T, AK, AD, AN, 4);
    }
    printf("  uniform routing: mean exact %.1f bytes, estimate %.1f\n", sum / draws, want / draws);
    TU_ASSERT_CLOSE(rel(sum, want), 0.02, "uniform all-to-all mean");
}

/* ---- layouts, fit search, KV, errors -------------------------------------------------- */

static void k2_layout(plan_layout_t *l, int ep, plan_wtype_t base) {
    plan_layout_default(l);
    l->ep = ep;
    l->gpu_mem_gib = 139.0;
    l->base = base;
    l->rollout_gpus = 16;
}

static void test_k2_plan(void) {
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(plan_preset(&c, "kimi-k2", NULL), 0);
    plan_layout_t l;
    k2_layout(&l, 64, PLAN_W_FP8);
    plan_t p, p8;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
    CU_ASSERT_EQUAL(p.gpus, 64);
    CU_ASSERT_EQUAL(p.experts_per_gpu, 6);
    CU_ASSERT_EQUAL(p.n_moe, 60);
    CU_ASSERT(p.fits[1] && !p.fits[0]);
    CU_ASSERT(p.acts[0].kept > 10.0 * p.acts[1].kept);
    /* Experts shard as 1 / ep; the replicated part does not move. */
    k2_layout(&l, 8, PLAN_W_FP8);
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p8, &c, &l), 0);
    TU_ASSERT_CLOSE(rel(8.0 * p8.base_experts, 64.0 * p.base_experts), 1e-12, "1 / ep");
    CU_ASSERT_EQUAL(p8.base_replicated, p.base_replicated);
    /* fp8: one byte per expert weight plus a 4-byte scale per 128 x 128 block. */
    double ew = 3.0 * 7168.0 * 2048.0, sc = 3.0 * 4.0 * 56.0 * 16.0;
    CU_ASSERT_EQUAL(p.base_experts, 60.0 * 6.0 * (ew + sc));
    /* int4 experts: half a byte plus a bf16 scale per 32 inputs. */
    k2_layout(&l, 64, PLAN_W_INT4);
    plan_t p4;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p4, &c, &l), 0);
    double i4 = 2.0 * (0.5 * 2048 * 7168 + 2.0 * 2048 * 224) + 0.5 * 7168 * 2048 + 2.0 * 7168 * 64;
    CU_ASSERT_EQUAL(p4.base_experts, 60.0 * 6.0 * i4);
    CU_ASSERT(p4.base_replicated > p.base_replicated); /* attention stays bf16 */
    /* Adapter-only sync: attention LoRA in f32 against a full base in fp8. */
    CU_ASSERT_EQUAL(p.sync_f32, 4.0 * (double)p.lora_params);
    CU_ASSERT(p.full_base > 1000.0 * p.sync_f32);
    /* All-to-all per step: T K D 4 x 4 x 63/64 per MoE layer, + counts; recompute adds
     * the forward's half again. */
    double rows = 60.0 * 4096.0 * 8 * 7168 * 4 * 4 * 63.0 / 64.0, counts = 60.0 * 63 * 8 * 6;
    CU_ASSERT_EQUAL(p.a2a_step[0], rows + counts);
    CU_ASSERT_EQUAL(p.a2a_step[1], 1.5 * rows + 2.0 * counts);
    /* The replicated adapter is all-reduced over all 64 GPUs by a ring. */
    CU_ASSERT_EQUAL(p.allreduce_payload, 4.0 * (double)p.lora_params);
    TU_ASSERT_CLOSE(rel(p.allreduce_ring, 2.0 * 63.0 / 64.0 * p.allreduce_payload), 1e-12, "ring");
    CU_ASSERT_EQUAL(p.expert_allreduce_payload, 0.0);
    /* MLA caches the latent: (512 + 64) x 61 layers x 2 bytes per token. */
    CU_ASSERT_EQUAL(p.kv_bytes_per_token, 61.0 * 576.0 * 2.0);
    CU_ASSERT(p.roll_left > 0.0);
    CU_ASSERT_EQUAL(p.kv_capacity, (int64_t)floor(p.roll_left / p.kv_bytes_per_token));
}

static void test_expert_adapters_shard(void) {
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(plan_preset(&c, "qwen3-30b-a3b", NULL), 0);
    static const char *const words[2] = {"attention", "experts"};
    plan_layout_t l;
    plan_layout_default(&l);
    l.targets = words;
    l.n_targets = 2;
    l.ep = 8;
    l.dp = 2;
    plan_t p;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
    int64_t expert = 16LL * (2048 + 768) * 3 * 128 * 48, attn = p.lora_params - expert;
    CU_ASSERT_EQUAL(p.lora_params_experts, expert);
    CU_ASSERT_EQUAL(p.lora_params_gpu, attn + expert / 8);
    CU_ASSERT_EQUAL(p.expert_allreduce_payload, 4.0 * (double)expert / 8.0);
    TU_ASSERT_CLOSE(rel(p.expert_allreduce_ring, p.expert_allreduce_payload), 1e-12, "dp 2");
    CU_ASSERT_EQUAL(p.allreduce_payload, 4.0 * (double)attn);
    /* GQA KV: 2 x 48 layers x 4 kv heads x 128 x 2 bytes. */
    CU_ASSERT_EQUAL(p.kv_bytes_per_token, 2.0 * 48 * 4 * 128 * 2);
}

static void test_smallest_ep(void) {
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(plan_preset(&c, "kimi-k2", NULL), 0);
    plan_layout_t l;
    k2_layout(&l, 8, PLAN_W_FP8);
    plan_t p;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
    CU_ASSERT(!p.fits[1]);
    int ep = 0;
    CU_ASSERT_EQUAL_FATAL(plan_smallest_ep(&c, &l, &ep), 0);
    CU_ASSERT(ep > 8 && 384 % ep == 0);
    l.ep = ep;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
    CU_ASSERT(p.fits[1]);
    int prev = ep - 1;
    while (384 % prev != 0)
        prev--;
    l.ep = prev;
    CU_ASSERT_EQUAL_FATAL(plan_compute(&p, &c, &l), 0);
    CU_ASSERT(!p.fits[1]);
    printf("  Kimi K2 fp8 on 139 GiB GPUs, recompute on: smallest EP %d\n", ep);
    /* Nothing fits on a 16 GiB GPU: the replicated base alone is larger. */
    l.gpu_mem_gib = 16.0;
    CU_ASSERT_EQUAL_FATAL(plan_smallest_ep(&c, &l, &ep), 0);
    CU_ASSERT_EQUAL(ep, 0);
}

static void test_bad_layouts(void) {
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(plan_preset(&c, "deepseek-v3", NULL), 0);
    plan_layout_t l;
    plan_t p;
    plan_layout_default(&l);
    l.ep = 3;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "ep 3"));
    plan_layout_default(&l);
    static const char *const gqa[1] = {"k_proj"}; /* MLA has no k_proj */
    l.targets = gqa;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "k_proj"));
    plan_layout_default(&l);
    l.lora_rank = 0;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_EINVAL);
    plan_layout_default(&l);
    l.imbalance = 0.5;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_EINVAL);
    plan_layout_default(&l);
    l.kv = PLAN_W_INT4;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_EINVAL);
    plan_layout_default(&l);
    l.rollout_gpus = 5;
    CU_ASSERT_EQUAL(plan_compute(&p, &c, &l), MO_EINVAL);
    plan_wtype_t t;
    CU_ASSERT_EQUAL(plan_wtype_from_name("int4", &t), 0);
    CU_ASSERT_EQUAL(t, PLAN_W_INT4);
    CU_ASSERT_EQUAL(plan_wtype_from_name("fp4", &t), MO_EINVAL);
    CU_ASSERT_EQUAL(plan_matrix_bytes(PLAN_W_FP8, 129, 256), 129.0 * 256 + 4.0 * 2 * 2);
    CU_ASSERT_EQUAL(plan_matrix_bytes(PLAN_W_INT4, 3, 33), 3.0 * 33 / 2 + 2.0 * 3 * 2);
}

/* ---- the command ---------------------------------------------------------------------- */

static int run_moerl(const char *args, char **out) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", tu_moerl_exe(), args);
    *out = NULL;
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n - 1, p);
        n += got;
        if (got == 0)
            break;
        if (n == cap - 1) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger)
                break;
            buf = bigger;
            cap *= 2;
        }
    }
    int st = pclose(p);
    if (buf)
        buf[n] = '\0';
    *out = buf;
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static double jnum(const cJSON *o, const char *a, const char *b) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    x = b ? cJSON_GetObjectItemCaseSensitive(x, b) : x;
    return cJSON_IsNumber(x) ? x->valuedouble : NAN;
}

static void test_cli(void) {
    char *out = NULL;
    int st = run_moerl("plan --model kimi-k2 --gpus 64 --gpu-mem 139 --base-dtype fp8 "
                       "--rollout-gpus 16 --json",
                       &out);
    CU_ASSERT_EQUAL(st, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    cJSON *j = cJSON_Parse(out);
    if (!j)
        tu_report("not JSON:\n%s", out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    CU_ASSERT_EQUAL(jnum(j, "model", "params_total"), 1026408232448.0);
    CU_ASSERT_EQUAL(jnum(j, "model", "params_active"), 32861500928.0);
    CU_ASSERT_EQUAL(jnum(j, "layout", "ep"), 64.0);
    CU_ASSERT_EQUAL(jnum(j, "layout", "experts_per_gpu"), 6.0);
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(j, "learner");
    CU_ASSERT(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(ln, "fits")));
    CU_ASSERT(jnum(ln, "recompute_on", "total") < 139.0 * GIB);
    CU_ASSERT(jnum(j, "rollout", "kv_capacity_tokens") > 0.0);
    cJSON_Delete(j);
    free(out);

    /* The table: units, the verdict, the smallest GPU count when it does not fit. */
    st = run_moerl("plan --model kimi-k2 --gpus 8 --gpu-mem 139 --base-dtype fp8", &out);
    CU_ASSERT_EQUAL(st, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, " GiB"));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, " GB/step"));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "smallest GPU count that fits is"));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "MLA latent"));
    free(out);

    /* A model directory. */
    char dir[512], args[1024];
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(write_model(dir, sizeof dir, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32, &c),
                          0);
    snprintf(args, sizeof args, "plan --model '%s' --gpus 4 --lora-targets q_proj,experts --json",
             dir);
    st = run_moerl(args, &out);
    CU_ASSERT_EQUAL(st, 0);
    j = out ? cJSON_Parse(out) : NULL;
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    CU_ASSERT_EQUAL(jnum(j, "layout", "ep"), 4.0);
    CU_ASSERT(jnum(j, "learner", "lora_params_routed_experts") > 0.0);
    cJSON_Delete(j);
    free(out);
    tu_rmtree(dir);

    static const struct {
        const char *args;
        int status;
        const char *want;
    } bad[] = {
        {"plan", 2, "--model is required"},
        {"plan --model kimi-k2 --ep 5", 2, "ep 5"},
        {"plan --model kimi-k2 --base-dtype fp4", 2, "fp4"},
        {"plan --model no-such-model", 1, "neither a model directory nor a preset"},
        {"plan --model kimi-k2 --frobnicate 1", 2, "unknown argument"},
        {"plan --model kimi-k2 --lora-targets k_proj", 1, "k_proj"},
        {"plan --help", 0, "usage: moerl plan"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        st = run_moerl(bad[i].args, &out);
        CU_ASSERT_PTR_NOT_NULL_FATAL(out);
        if (st != bad[i].status || !strstr(out, bad[i].want))
            tu_report("moerl %s: status %d (want %d):\n%s", bad[i].args, st, bad[i].status, out);
        CU_ASSERT_EQUAL(st, bad[i].status);
        CU_ASSERT_PTR_NOT_NULL(strstr(out, bad[i].want));
        free(out);
    }
}

int main(void) {
    CU_TestInfo tests[] = {
        {"published parameter counts", test_published_counts},
        {"module list is the actor's", test_modules_match_actor},
        {"memory: tiny models", test_memory_tiny},
        {"memory: small models", test_memory_small},
        {"MoE block, single-process", test_moe_block_local},
        {"MoE block, expert-parallel on one rank", test_moe_block_ep_single_rank},
        {"all-to-all bytes, exact routing", test_alltoall_exact},
        {"all-to-all bytes, uniform estimate", test_alltoall_uniform},
        {"Kimi K2 plan", test_k2_plan},
        {"expert adapters shard", test_expert_adapters_shard},
        {"smallest EP that fits", test_smallest_ep},
        {"bad layouts", test_bad_layouts},
        {"moerl plan", test_cli},
        CU_TEST_INFO_NULL,
    };
    return tu_main("plan", tests);
}
