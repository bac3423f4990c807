/* test_ep_shard: adapter shards of the expert-parallel learner in one process: expert ids
 * from module names, what each of N ranks holds (replicated entries everywhere, each
 * expert's entries on its owner only, values equal to the whole adapter's), extracting
 * and reassembling a whole buffer, the one-rank gather and gradient norm, routers and
 * norms trained in full as replicated entries, and E not a multiple of N. Collectives over several
 * ranks are in tests/mpi_learner_ep.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/status.h"
#include "learner/ep_shard.h"
#include "tests/testutil.h"

enum { L = 2, E = 4, NMOD = L * (4 + 3 * E + 3) };

static char g_names[NMOD][80];
static lora_module_desc_t g_mods[NMOD];
static int g_n;

static void add(const char *name, const char *proj, lora_kind_t kind, int C, int OC) {
    snprintf(g_names[g_n], sizeof g_names[g_n], "%s", name);
    g_mods[g_n] = (lora_module_desc_t){g_names[g_n], proj, kind, C, OC};
    g_n++;
}

/* Two layers: q k v o, E experts' gate up down, a shared expert's gate up down. */
static void build_modules(void) {
    static const char *const att[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    static const char *const mlp[3] = {"gate_proj", "up_proj", "down_proj"};
    char n[80];
    g_n = 0;
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < 4; i++) {
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s", l, att[i]);
            add(n, att[i], LORA_KIND_ATTENTION, 16, 16);
        }
        for (int e = 0; e < E; e++)
            for (int p = 0; p < 3; p++) {
                snprintf(n, sizeof n, "model.layers.%d.mlp.experts.%d.%s", l, e, mlp[p]);
                add(n, mlp[p], LORA_KIND_EXPERT, p == 2 ? 8 : 16, p == 2 ? 16 : 8);
            }
        for (int p = 0; p < 3; p++) {
            snprintf(n, sizeof n, "model.layers.%d.mlp.shared_experts.%s", l, mlp[p]);
            add(n, mlp[p], LORA_KIND_SHARED_EXPERT, p == 2 ? 8 : 16, p == 2 ? 16 : 8);
        }
    }
}

static lora_config_t config(void) {
    static const char *const targets[] = {"q_proj", "v_proj", "experts", "shared_experts"};
    lora_config_t c = {4, 8.0f, 0, 0.0f, 99, 0, targets, 4};
    return c;
}

/* A stand-in for rank r of N: ep_shard_new reads only the rank and the size. */
static comm_t fake_comm(int r, int N) {
    comm_t c;
    memset(&c, 0, sizeof c);
    c.rank = r;
    c.size = N;
    return c;
}

static void test_expert_of(void) {
    CU_ASSERT_EQUAL(ep_shard_expert_of("model.layers.3.mlp.experts.17.gate_proj"), 17);
    CU_ASSERT_EQUAL(ep_shard_expert_of("model.layers.0.block_sparse_moe.experts.0.w1"), 0);
    CU_ASSERT_EQUAL(ep_shard_expert_of("model.layers.3.mlp.shared_experts.up_proj"), -1);
    CU_ASSERT_EQUAL(ep_shard_expert_of("model.layers.3.self_attn.q_proj"), -1);
    CU_ASSERT_EQUAL(ep_shard_expert_of("model.layers.3.mlp.experts.gate_proj"), -1);
}

/* Every rank of N = 1, 2, 4: replicated entries on all, expert entries on their owner,
 * values as in the whole adapter; extracting and putting back gives the whole buffer. */
static void test_shards_cover_whole(void) {
    build_modules();
    lora_config_t lc = config();
    lora_adapter_t *whole = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&whole, &lc, g_mods, g_n), 0);
    size_t P = whole->n_params;
    float *ref = malloc(sizeof *ref * P), *back = malloc(sizeof *back * P);
    CU_ASSERT_FATAL(ref && back);
    tu_fill(ref, P, 5, -1.0f, 1.0f);
    for (int N = 1; N <= 4; N *= 2) {
        tu_poison(back, P);
        for (int r = 0; r < N; r++) {
            comm_t c = fake_comm(r, N);
            ep_shard_t *ep = NULL;
            lora_adapter_t *sh = NULL;
            CU_ASSERT_EQUAL_FATAL(ep_shard_new(&ep, &c, &lc, g_mods, g_n, E, &sh), 0);
            CU_ASSERT_EQUAL(ep->full_params, P);
            CU_ASSERT_EQUAL(ep->n_full, whole->n_entries);
            /* Initial values: the whole adapter's, entry by entry. */
            for (int i = 0; i < sh->n_entries; i++) {
                int k = lora_adapter_find(whole, sh->entries[i].name);
                CU_ASSERT_FATAL(k >= 0);
                size_t n = (size_t)sh->R * (sh->entries[i].C + sh->entries[i].OC);
                CU_ASSERT(!memcmp(sh->params + sh->entries[i].off_A,
                                  whole->params + whole->entries[k].off_A, sizeof(float) * n));
            }
            int experts = 0;
            for (int i = 0; i < sh->n_entries; i++) {
                const lora_entry_t *en = &sh->entries[i];
                if (en->kind != LORA_KIND_EXPERT)
                    continue;
                experts++;
                int e = ep_shard_expert_of(en->name);
                CU_ASSERT(e >= r * E / N && e < (r + 1) * E / N);
            }
            CU_ASSERT_EQUAL(experts, L * 3 * E / N);
            CU_ASSERT_EQUAL(sh->n_entries - experts, L * (2 + 3));
            CU_ASSERT_PTR_NOT_NULL(sh->grads);
            ep_shard_extract(ep, ref, sh->params);
            for (int i = 0; i < ep->n_full; i++)
                if (ep->shard_off[i] >= 0 && (ep->owner[i] == r || r == 0))
                    memcpy(back + ep->full_off[i], sh->params + ep->shard_off[i],
                           sizeof(float) * ep->size[i]);
            lora_adapter_t *w2 = NULL;
            CU_ASSERT_EQUAL_FATAL(ep_shard_full_new(ep, &w2), 0);
            CU_ASSERT_EQUAL(w2->n_params, P);
            CU_ASSERT_PTR_NULL(w2->grads);
            lora_adapter_destroy(&w2);
            lora_adapter_destroy(&sh);
            ep_shard_destroy(&ep);
        }
        CU_ASSERT(!memcmp(back, ref, sizeof(float) * P));
    }
    free(ref);
    free(back);
    lora_adapter_destroy(&whole);
}

/* One rank: the gather is the identity, the gradient norm the buffer's own. */
static void test_one_rank_gather(void) {
    build_modules();
    lora_config_t lc = config();
    comm_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(comm_single_new(&c), 0);
    ep_shard_t *ep = NULL;
    lora_adapter_t *sh = NULL;
    CU_ASSERT_EQUAL_FATAL(ep_shard_new(&ep, c, &lc, g_mods, g_n, E, &sh), 0);
    tu_fill(sh->params, sh->n_params, 6, -1.0f, 1.0f);
    tu_fill(sh->grads, sh->n_params, 7, -1.0f, 1.0f);
    lora_adapter_t *whole = NULL;
    CU_ASSERT_EQUAL_FATAL(ep_shard_full_new(ep, &whole), 0);
    tu_poison(whole->params, whole->n_params);
    CU_ASSERT_EQUAL(ep_shard_gather_state(ep, sh, NULL, whole, NULL), 0);
    CU_ASSERT(!memcmp(whole->params, sh->params, sizeof(float) * sh->n_params));
    double sq = -1.0;
    CU_ASSERT_EQUAL(ep_shard_grad_sqsum(ep, sh->grads, &sq), 0);
    double want = optim_grad_sqsum(sh->grads, sh->n_params);
    CU_ASSERT(fabs(sq - want) <= 1e-12 * want);
    CU_ASSERT_EQUAL(ep_shard_any_failed(ep, MO_OK), 0);
    CU_ASSERT_EQUAL(ep_shard_any_failed(ep, MO_EIO), 1);
    lora_adapter_destroy(&whole);
    lora_adapter_destroy(&sh);
    ep_shard_destroy(&ep);
    comm_destroy(&c);
}

/* Full tensors (routers, norms) in the plan, for N = 2: replicated after the LoRA
 * entries, in the whole adapter under the same names and shapes, extracted into the
 * shard, gathered on one rank, counted once in the norm; a second add is refused. */
static void test_full_tensors(void) {
    build_modules();
    lora_config_t lc = config();
    float v[2 * 16];
    tu_fill(v, 32, 8, 0.5f, 1.5f);
    for (int N = 1; N <= 2; N++) {
        comm_t fc = fake_comm(N - 1, N), *one = NULL;
        comm_t *c = &fc;
        if (N == 1) {
            CU_ASSERT_EQUAL_FATAL(comm_single_new(&one), 0);
            c = one;
        }
        ep_shard_t *ep = NULL;
        lora_adapter_t *sh = NULL;
        CU_ASSERT_EQUAL_FATAL(ep_shard_new(&ep, c, &lc, g_mods, g_n, E, &sh), 0);
        size_t P0 = ep->full_params;
        int n0 = ep->n_full;
        CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(sh, "model.layers.0.mlp.gate.weight", 2, 16, v),
                              0);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(sh, "model.norm.weight", 16, 1, v + 16), 0);
        CU_ASSERT_EQUAL_FATAL(ep_shard_add_full(ep, sh), 0);
        CU_ASSERT_EQUAL(ep_shard_add_full(ep, sh), MO_ESTATE);
        CU_ASSERT_EQUAL(ep->n_lora, n0);
        CU_ASSERT_EQUAL(ep->n_full, n0 + 2);
        CU_ASSERT_EQUAL(ep->full_params, P0 + 48);
        CU_ASSERT(ep->owner[n0] == -1 && ep->owner[n0 + 1] == -1);
        CU_ASSERT(ep->full_off[n0 + 1] == P0 + 32 && ep->size[n0 + 1] == 16);
        lora_adapter_t *whole = NULL;
        CU_ASSERT_EQUAL_FATAL(ep_shard_full_new(ep, &whole), 0);
        CU_ASSERT_EQUAL(whole->n_full, 2);
        CU_ASSERT_EQUAL(whole->n_params, P0 + 48);
        int t = lora_adapter_find_full(whole, "model.norm.weight");
        CU_ASSERT_FATAL(t >= 0);
        CU_ASSERT(whole->tensors[t].shape[0] == 16 && whole->tensors[t].shape[1] == 1);
        CU_ASSERT(whole->tensors[t].offset == P0 + 32);
        /* The whole buffer's full tensors land at the shard's. */
        float *ref = malloc(sizeof *ref * whole->n_params);
        CU_ASSERT_FATAL(ref != NULL);
        tu_fill(ref, whole->n_params, 9, -1.0f, 1.0f);
        tu_poison(sh->params, sh->n_params);
        ep_shard_extract(ep, ref, sh->params);
        size_t so = sh->tensors[sh->n_tensors - 2].offset;
        CU_ASSERT(!memcmp(sh->params + so, ref + P0, sizeof(float) * 48));
        if (N == 1) {
            tu_poison(whole->params, whole->n_params);
            CU_ASSERT_EQUAL(ep_shard_gather_state(ep, sh, NULL, whole, NULL), 0);
            CU_ASSERT(!memcmp(whole->params, ref, sizeof(float) * whole->n_params));
            tu_fill(sh->grads, sh->n_params, 10, -1.0f, 1.0f);
            double sq = -1.0, want = optim_grad_sqsum(sh->grads, sh->n_params);
            CU_ASSERT_EQUAL(ep_shard_grad_sqsum(ep, sh->grads, &sq), 0);
            CU_ASSERT(fabs(sq - want) <= 1e-12 * want);
        }
        free(ref);
        lora_adapter_destroy(&whole);
        lora_adapter_destroy(&sh);
        ep_shard_destroy(&ep);
        comm_destroy(&one);
    }
}

static void test_uneven(void) {
    build_modules();
    lora_config_t lc = config();
    comm_t c = fake_comm(0, 3);
    ep_shard_t *ep = NULL;
    lora_adapter_t *sh = NULL;
    CU_ASSERT_EQUAL(ep_shard_new(&ep, &c, &lc, g_mods, g_n, E, &sh), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(ep);
    CU_ASSERT_PTR_NULL(sh);
    CU_ASSERT(strstr(mo_last_error(), "E = 4") && strstr(mo_last_error(), "N = 3"));
}

int main(void) {
    CU_TestInfo tests[] = {
        {"expert_of", test_expert_of},
        {"shards_cover_whole", test_shards_cover_whole},
        {"one_rank_gather", test_one_rank_gather},
        {"full_tensors", test_full_tensors},
        {"uneven", test_uneven},
        CU_TEST_INFO_NULL,
    };
    return tu_main("ep_shard", tests);
}
