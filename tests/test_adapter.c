/* test_adapter: target selection on a small MoE model's module list, the
 * flat-buffer layout and its table, initialisation, config validation, and
 * the checksum. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "tests/testutil.h"

/* A fake model: 3 layers, D = 16. Layer 0 is dense (MLP hidden 24); layers
 * 1 and 2 are MoE with 4 routed experts (hidden 8) and shared experts
 * (hidden 12). Attention: 4 heads of 4 for q and o, 2 kv heads of 4. */
#define NL 3
#define NE 4
#define D 16
#define MAX_MODS 128

typedef struct model {
    lora_module_desc_t m[MAX_MODS];
    char names[MAX_MODS][96];
    int n;
} model_t;

static void add(model_t *md, lora_kind_t kind, const char *proj, int C, int OC, const char *fmt,
                int layer, int expert) {
    int i = md->n++;
    if (expert >= 0)
        snprintf(md->names[i], sizeof md->names[i], fmt, layer, expert, proj);
    else
        snprintf(md->names[i], sizeof md->names[i], fmt, layer, proj);
    md->m[i] = (lora_module_desc_t){md->names[i], proj, kind, C, OC};
}

static void add_mlp(model_t *md, lora_kind_t kind, int F, const char *fmt, int layer, int e) {
    add(md, kind, "gate_proj", D, F, fmt, layer, e);
    add(md, kind, "up_proj", D, F, fmt, layer, e);
    add(md, kind, "down_proj", F, D, fmt, layer, e);
}

static void build_model(model_t *md) {
    md->n = 0;
    for (int l = 0; l < NL; l++) {
        const char *att = "model.layers.%d.self_attn.%s";
        add(md, LORA_KIND_ATTENTION, "q_proj", D, 16, att, l, -1);
        add(md, LORA_KIND_ATTENTION, "k_proj", D, 8, att, l, -1);
        add(md, LORA_KIND_ATTENTION, "v_proj", D, 8, att, l, -1);
        add(md, LORA_KIND_ATTENTION, "o_proj", 16, D, att, l, -1);
        if (l == 0) {
            add_mlp(md, LORA_KIND_DENSE_MLP, 24, "model.layers.%d.mlp.%s", l, -1);
            continue;
        }
        for (int e = 0; e < NE; e++)
            add_mlp(md, LORA_KIND_EXPERT, 8, "model.layers.%d.mlp.experts.%d.%s", l, e);
        add_mlp(md, LORA_KIND_SHARED_EXPERT, 12, "model.layers.%d.mlp.shared_experts.%s", l, -1);
    }
}

static model_t g_model;

/* Selects with words and returns the count; kinds[k] counts per kind. */
static int select_words(const char *const *w, int n, int kinds[LORA_KIND_COUNT], int *rc) {
    unsigned char sel[MAX_MODS];
    memset(sel, 0xAB, sizeof sel);
    *rc = lora_select_targets(sel, g_model.m, g_model.n, w, n);
    int cnt = 0;
    for (int k = 0; k < LORA_KIND_COUNT; k++)
        kinds[k] = 0;
    for (int i = 0; i < g_model.n && *rc == 0; i++) {
        CU_ASSERT(sel[i] == 0 || sel[i] == 1);
        cnt += sel[i];
        kinds[g_model.m[i].kind] += sel[i];
    }
    return cnt;
}

#define EXPECT_SEL(words, na, ne, ns, nd)                                                          \
    do {                                                                                           \
        int kinds_[LORA_KIND_COUNT], rc_;                                                          \
        int n_ = select_words(words, (int)(sizeof(words) / sizeof(words[0])), kinds_, &rc_);       \
        CU_ASSERT_EQUAL(rc_, 0);                                                                   \
        CU_ASSERT_EQUAL(n_, (na) + (ne) + (ns) + (nd));                                            \
        CU_ASSERT_EQUAL(kinds_[LORA_KIND_ATTENTION], na);                                          \
        CU_ASSERT_EQUAL(kinds_[LORA_KIND_EXPERT], ne);                                             \
        CU_ASSERT_EQUAL(kinds_[LORA_KIND_SHARED_EXPERT], ns);                                      \
        CU_ASSERT_EQUAL(kinds_[LORA_KIND_DENSE_MLP], nd);                                          \
    } while (0)

static void test_select_attention_only(void) {
    build_model(&g_model);
    const char *w[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    EXPECT_SEL(w, 4 * NL, 0, 0, 0);
    const char *w2[] = {"attention"};
    EXPECT_SEL(w2, 4 * NL, 0, 0, 0);
    const char *w3[] = {"q_proj", "v_proj"};
    EXPECT_SEL(w3, 2 * NL, 0, 0, 0);
    /* attention scope with a projection word keeps only that projection */
    const char *w4[] = {"attention", "q_proj"};
    EXPECT_SEL(w4, NL, 0, 0, 0);
}

static void test_select_experts(void) {
    build_model(&g_model);
    const char *w[] = {"experts"};
    EXPECT_SEL(w, 0, 2 * NE * 3, 0, 0);
    const char *w2[] = {"gate_proj", "up_proj", "experts"};
    EXPECT_SEL(w2, 0, 2 * NE * 2, 0, 0);
    const char *w3[] = {"q_proj", "v_proj", "experts"};
    EXPECT_SEL(w3, 2 * NL, 2 * NE * 3, 0, 0);
    /* exactly which modules: gate and up of every expert, nothing else */
    unsigned char sel[MAX_MODS];
    CU_ASSERT_EQUAL(lora_select_targets(sel, g_model.m, g_model.n, w2, 3), 0);
    for (int i = 0; i < g_model.n; i++) {
        const lora_module_desc_t *m = &g_model.m[i];
        int want = m->kind == LORA_KIND_EXPERT && strcmp(m->proj, "down_proj") != 0;
        CU_ASSERT_EQUAL(sel[i], want);
    }
}

static void test_select_shared_and_dense(void) {
    build_model(&g_model);
    const char *w[] = {"shared_experts"};
    EXPECT_SEL(w, 0, 0, 2 * 3, 0);
    const char *w2[] = {"q_proj", "v_proj", "shared_experts"};
    EXPECT_SEL(w2, 2 * NL, 0, 2 * 3, 0);
    const char *w3[] = {"dense_mlp"};
    EXPECT_SEL(w3, 0, 0, 0, 3);
    const char *w4[] = {"down_proj", "dense_mlp", "shared_experts"};
    EXPECT_SEL(w4, 0, 0, 2, 1);
    /* projection words alone match in every kind, as in PEFT */
    const char *w5[] = {"gate_proj", "up_proj", "down_proj"};
    EXPECT_SEL(w5, 0, 2 * NE * 3, 2 * 3, 3);
    const char *w6[] = {"attention", "dense_mlp"};
    EXPECT_SEL(w6, 4 * NL, 0, 0, 3);
    const char *w7[] = {"all-linear"};
    EXPECT_SEL(w7, 4 * NL, 2 * NE * 3, 2 * 3, 3);
}

static void test_select_errors(void) {
    build_model(&g_model);
    unsigned char sel[MAX_MODS];
    const char *typo[] = {"q_proj", "q_prj"};
    CU_ASSERT_EQUAL(lora_select_targets(sel, g_model.m, g_model.n, typo, 2), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "'q_prj'"));
    CU_ASSERT_EQUAL(lora_select_targets(sel, g_model.m, g_model.n, typo, 0), MO_ECONFIG);
    /* a scope word whose kind this model lacks */
    const char *dense[] = {"dense_mlp"};
    CU_ASSERT_EQUAL(lora_select_targets(sel, g_model.m + 7, 12, dense, 1), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "'dense_mlp'"));
    /* a projection word whose modules are all outside the scopes given */
    lora_module_desc_t two[2] = {
        {"model.layers.1.mlp.experts.0.w1", "w1", LORA_KIND_EXPERT, 8, 4},
        {"model.layers.0.mlp.gate_proj", "gate_proj", LORA_KIND_DENSE_MLP, 8, 4}};
    const char *out[] = {"experts", "gate_proj"};
    CU_ASSERT_EQUAL(lora_select_targets(sel, two, 2, out, 2), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "'gate_proj'"));
    CU_ASSERT_EQUAL(lora_select_targets(sel, two, 2, out, 1), 0);
    CU_ASSERT(sel[0] == 1 && sel[1] == 0);
    lora_module_desc_t bad = {"model.x", "x", LORA_KIND_ATTENTION, 0, 4};
    const char *x[] = {"x"};
    CU_ASSERT_EQUAL(lora_select_targets(sel, &bad, 1, x, 1), MO_EINVAL);
}

static lora_config_t cfg_of(const char *const *w, int n, uint64_t seed) {
    lora_config_t c = {.rank = 4, .alpha = 8.0f, .seed = seed, .targets = w, .n_targets = n};
    return c;
}

static void test_layout_and_table(void) {
    build_model(&g_model);
    const char *w[] = {"q_proj", "o_proj", "experts", "shared_experts"};
    lora_config_t c = cfg_of(w, 4, 1);
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), 0);
    CU_ASSERT_EQUAL(ad->n_entries, 2 * NL + 2 * NE * 3 + 2 * 3);
    CU_ASSERT_EQUAL(ad->n_tensors, 2 * ad->n_entries);
    CU_ASSERT_EQUAL(ad->scale, 2.0f);
    CU_ASSERT_EQUAL(ad->n_targets, 4);
    CU_ASSERT_STRING_EQUAL(ad->targets[2], "experts");
    size_t off = 0;
    int prev = -1;
    for (int e = 0; e < ad->n_entries; e++) {
        const lora_entry_t *en = &ad->entries[e];
        const lora_tensor_t *ta = &ad->tensors[2 * e], *tb = &ad->tensors[2 * e + 1];
        /* entries keep the module list's order */
        int mi = -1;
        for (int i = 0; i < g_model.n; i++)
            if (strcmp(g_model.m[i].name, en->name) == 0)
                mi = i;
        CU_ASSERT_FATAL(mi > prev);
        prev = mi;
        CU_ASSERT_EQUAL(en->C, g_model.m[mi].C);
        CU_ASSERT_EQUAL(en->OC, g_model.m[mi].OC);
        CU_ASSERT_EQUAL(en->kind, g_model.m[mi].kind);
        CU_ASSERT_STRING_EQUAL(en->proj, g_model.m[mi].proj);
        CU_ASSERT_EQUAL(en->R, 4);
        CU_ASSERT_EQUAL(en->off_A, off);
        CU_ASSERT_EQUAL(ta->offset, off);
        CU_ASSERT_EQUAL(ta->shape[0], 4);
        CU_ASSERT_EQUAL(ta->shape[1], en->C);
        CU_ASSERT_EQUAL(ta->numel, (size_t)4 * en->C);
        off += ta->numel;
        CU_ASSERT_EQUAL(en->off_B, off);
        CU_ASSERT_EQUAL(tb->offset, off);
        CU_ASSERT_EQUAL(tb->shape[0], en->OC);
        CU_ASSERT_EQUAL(tb->shape[1], 4);
        off += tb->numel;
        char want[160];
        snprintf(want, sizeof want, "%s.lora_A.weight", en->name);
        CU_ASSERT_STRING_EQUAL(ta->name, want);
        snprintf(want, sizeof want, "%s.lora_B.weight", en->name);
        CU_ASSERT_STRING_EQUAL(tb->name, want);
        CU_ASSERT_EQUAL(lora_adapter_find(ad, en->name), e);
        lora_pair_t p = lora_adapter_pair(ad, e, 1);
        CU_ASSERT_PTR_EQUAL(p.A, ad->params + en->off_A);
        CU_ASSERT_PTR_EQUAL(p.B, ad->params + en->off_B);
        CU_ASSERT_PTR_EQUAL(p.dA, ad->grads + en->off_A);
        CU_ASSERT_PTR_EQUAL(p.dB, ad->grads + en->off_B);
        CU_ASSERT_EQUAL(p.R, 4);
        CU_ASSERT_EQUAL(p.scale, 2.0f);
        CU_ASSERT_PTR_NULL(lora_adapter_pair(ad, e, 0).dA);
    }
    CU_ASSERT_EQUAL(off, ad->n_params);
    CU_ASSERT_EQUAL(lora_adapter_num_params(ad), off);
    CU_ASSERT_EQUAL(lora_adapter_find(ad, "model.layers.1.self_attn.k_proj"), -1);
    CU_ASSERT_EQUAL(lora_adapter_find(ad, "model.layers.1.mlp.experts.9.up_proj"), -1);
    CU_ASSERT_EQUAL(lora_adapter_find(ad, ""), -1);

    /* zero_grads clears what backward accumulated */
    for (size_t i = 0; i < ad->n_params; i++)
        CU_ASSERT_EQUAL_FATAL(ad->grads[i], 0.0f);
    tu_fill(ad->grads, ad->n_params, 3, 0.5f, 1.0f);
    lora_adapter_zero_grads(ad);
    int nz = 0;
    for (size_t i = 0; i < ad->n_params; i++)
        nz += ad->grads[i] != 0.0f;
    CU_ASSERT_EQUAL(nz, 0);
    lora_adapter_destroy(&ad);
    CU_ASSERT_PTR_NULL(ad);
    lora_adapter_destroy(&ad); /* NULL is fine */
}

static void test_suffixes(void) {
    build_model(&g_model);
    const char *w[] = {"q_proj", "experts", "dense_mlp"};
    lora_config_t c = cfg_of(w, 3, 1);
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), 0);
    char **s = NULL;
    int n = 0;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_suffixes(ad, &s, &n), 0);
    CU_ASSERT_EQUAL_FATAL(n, 1 + 3 + NE * 3);
    CU_ASSERT_STRING_EQUAL(s[0], "self_attn.q_proj");
    CU_ASSERT_STRING_EQUAL(s[1], "mlp.gate_proj");
    CU_ASSERT_STRING_EQUAL(s[3], "mlp.down_proj");
    CU_ASSERT_STRING_EQUAL(s[4], "mlp.experts.0.gate_proj");
    CU_ASSERT_STRING_EQUAL(s[n - 1], "mlp.experts.3.down_proj");
    /* PEFT's suffix rule on them gives back the same selection */
    unsigned char a[MAX_MODS], b[MAX_MODS];
    CU_ASSERT_EQUAL(lora_select_targets(a, g_model.m, g_model.n, w, 3), 0);
    CU_ASSERT_EQUAL(lora_select_suffixes(b, g_model.m, g_model.n, (const char *const *)s, n), 0);
    CU_ASSERT_EQUAL(memcmp(a, b, (size_t)g_model.n), 0);
    /* "mlp.gate_proj" must not catch shared experts' gate_proj */
    const char *one[] = {"mlp.gate_proj"};
    CU_ASSERT_EQUAL(lora_select_suffixes(b, g_model.m, g_model.n, one, 1), 0);
    int cnt = 0;
    for (int i = 0; i < g_model.n; i++)
        cnt += b[i];
    CU_ASSERT_EQUAL(cnt, 1);
    const char *none[] = {"proj"};
    CU_ASSERT_EQUAL(lora_select_suffixes(b, g_model.m, g_model.n, none, 1), MO_ECONFIG);
    lora_free_strings(s, n);
    lora_adapter_destroy(&ad);
}

static void test_init(void) {
    build_model(&g_model);
    const char *w[] = {"all-linear"};
    lora_config_t c = cfg_of(w, 1, 77);
    lora_adapter_t *a1 = NULL, *a2 = NULL, *a3 = NULL, *att = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a1, &c, g_model.m, g_model.n), 0);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a2, &c, g_model.m, g_model.n), 0);
    CU_ASSERT_EQUAL(memcmp(a1->params, a2->params, a1->n_params * 4), 0);
    c.seed = 78;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a3, &c, g_model.m, g_model.n), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(a1->params, a3->params, a1->n_params * 4), 0);
    for (int e = 0; e < a1->n_entries; e++) {
        lora_pair_t p = lora_adapter_pair(a1, e, 0);
        const lora_entry_t *en = &a1->entries[e];
        size_t na = (size_t)en->R * en->C, nb = (size_t)en->OC * en->R;
        double bound = 1.0 / sqrt((double)en->C), mx = 0, sum = 0;
        int zb = 0;
        for (size_t i = 0; i < na; i++) {
            CU_ASSERT_FATAL(fabs(p.A[i]) <= bound);
            mx = fmax(mx, fabs(p.A[i]));
            sum += p.A[i];
        }
        CU_ASSERT(mx > 0.5 * bound); /* spans the range, not all zero */
        CU_ASSERT(fabs(sum / na) < 0.5 * bound);
        for (size_t i = 0; i < nb; i++)
            zb += p.B[i] == 0.0f;
        CU_ASSERT_EQUAL(zb, (int)nb);
    }
    /* A of a module does not depend on what else is adapted */
    const char *wa[] = {"attention"};
    lora_config_t ca = cfg_of(wa, 1, 77);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&att, &ca, g_model.m, g_model.n), 0);
    for (int e = 0; e < att->n_entries; e++) {
        int e1 = lora_adapter_find(a1, att->entries[e].name);
        CU_ASSERT_FATAL(e1 >= 0);
        size_t na = (size_t)4 * att->entries[e].C;
        CU_ASSERT_EQUAL(
            memcmp(lora_adapter_pair(att, e, 0).A, lora_adapter_pair(a1, e1, 0).A, na * 4), 0);
    }
    lora_adapter_destroy(&a1);
    lora_adapter_destroy(&a2);
    lora_adapter_destroy(&a3);
    lora_adapter_destroy(&att);
}

/* A large A (filled by the threaded path) is the same on 1 and 2 threads. */
static void test_init_thread_independent(void) {
    lora_module_desc_t m = {"model.layers.0.mlp.down_proj", "down_proj", LORA_KIND_DENSE_MLP, 8192,
                            4};
    const char *w[] = {"down_proj"};
    lora_config_t c = {.rank = 16, .alpha = 16.0f, .seed = 5, .targets = w, .n_targets = 1};
    lora_adapter_t *a1 = NULL, *a2 = NULL;
    int threads = backend_cpu_threads();
    backend_cpu_set_threads(1);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a1, &c, &m, 1), 0);
    backend_cpu_set_threads(2);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a2, &c, &m, 1), 0);
    backend_cpu_set_threads(threads);
    CU_ASSERT_EQUAL(a1->n_params, (size_t)16 * 8192 + 4 * 16);
    CU_ASSERT_EQUAL(memcmp(a1->params, a2->params, a1->n_params * 4), 0);
    CU_ASSERT_EQUAL(lora_adapter_checksum(a1), lora_adapter_checksum(a2));
    lora_adapter_destroy(&a1);
    lora_adapter_destroy(&a2);
}

static void test_config_errors(void) {
    build_model(&g_model);
    const char *w[] = {"q_proj"};
    lora_adapter_t *ad = (lora_adapter_t *)&g_model; /* must be reset to NULL */
    lora_config_t c = cfg_of(w, 1, 1);
    c.dropout = 0.05f;
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(ad);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "dropout"));
    c.dropout = NAN;
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), MO_ECONFIG);
    c.dropout = 0.0f;
    c.rank = 0;
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), MO_ECONFIG);
    c.rank = 4;
    c.alpha = 0.0f;
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), MO_ECONFIG);
    c.alpha = 8.0f;
    /* duplicate module names */
    lora_module_desc_t dup[2] = {g_model.m[0], g_model.m[0]};
    CU_ASSERT_EQUAL(lora_adapter_new(&ad, &c, dup, 2), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "twice"));
    CU_ASSERT_PTR_NULL(ad);
    /* no_grads: no gradient buffer, pairs without gradients */
    c.no_grads = 1;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), 0);
    CU_ASSERT_PTR_NULL(ad->grads);
    CU_ASSERT_PTR_NULL(lora_adapter_pair(ad, 0, 1).dB);
    lora_adapter_zero_grads(ad);
    lora_adapter_destroy(&ad);
}

static void test_checksum(void) {
    CU_ASSERT_EQUAL(lora_hash64("", 0), 0xEF46DB3751D8E999ull);
    CU_ASSERT_EQUAL(lora_hash64("a", 1), 0xD24EC4F1A98C6E5Bull);
    CU_ASSERT_EQUAL(lora_hash64("abc", 3), 0x44BC2CF5AD770999ull);
    const char *s1 = "Nobody inspects the spammish repetition"; /* 32 + 4 + 3 bytes */
    CU_ASSERT_EQUAL(lora_hash64(s1, strlen(s1)), 0xFBCEA83C8A378BF1ull);
    const char *s2 = "The quick brown fox jumps over the lazy dog"; /* 32 + 8 + 3 */
    CU_ASSERT_EQUAL(lora_hash64(s2, strlen(s2)), 0x0B242D361FDA71BCull);

    build_model(&g_model);
    const char *w[] = {"attention"};
    lora_config_t c = cfg_of(w, 1, 9);
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &c, g_model.m, g_model.n), 0);
    uint64_t h0 = lora_adapter_checksum(ad);
    CU_ASSERT_EQUAL(h0, lora_hash64(ad->params, ad->n_params * 4));
    ad->params[ad->n_params - 1] = 1e-30f; /* one B element changes */
    CU_ASSERT_NOT_EQUAL(lora_adapter_checksum(ad), h0);
    ad->params[ad->n_params - 1] = 0.0f;
    CU_ASSERT_EQUAL(lora_adapter_checksum(ad), h0);
    lora_adapter_destroy(&ad);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"select attention only", test_select_attention_only},
        {"select experts", test_select_experts},
        {"select shared experts and dense mlp", test_select_shared_and_dense},
        {"selection errors", test_select_errors},
        {"flat layout and table", test_layout_and_table},
        {"peft suffixes", test_suffixes},
        {"init deterministic, B zero", test_init},
        {"init independent of threads", test_init_thread_independent},
        {"config errors", test_config_errors},
        {"checksum", test_checksum},
        CU_TEST_INFO_NULL,
    };
    return tu_main("adapter", tests);
}
