/* adapter: the set of LoRA-adapted projections of a model, with their
 * parameters and gradients in one flat f32 buffer each. */
#include "lora/adapter.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"

static const char *const g_kind_words[LORA_KIND_COUNT] = {"attention", "experts", "shared_experts",
                                                          "dense_mlp"};

const char *lora_kind_word(lora_kind_t kind) {
    return (unsigned)kind < LORA_KIND_COUNT ? g_kind_words[kind] : "?";
}

static int kind_of_word(const char *w) {
    for (int k = 0; k < LORA_KIND_COUNT; k++)
        if (strcmp(w, g_kind_words[k]) == 0)
            return k;
    return -1;
}

static int is_mlp_kind(int k) {
    return k != LORA_KIND_ATTENTION;
}

static int check_modules(const lora_module_desc_t *mods, int n_mods) {
    if (n_mods <= 0 || !mods)
        return mo_errorf(MO_EINVAL, "lora: the model describes no projection to adapt");
    for (int i = 0; i < n_mods; i++) {
        const lora_module_desc_t *m = &mods[i];
        if (!m->name || !*m->name)
            return mo_errorf(MO_EINVAL, "lora: module %d has no name", i);
        if (!m->proj || !*m->proj)
            return mo_errorf(MO_EINVAL, "lora: module '%s' has no projection name", m->name);
        if ((unsigned)m->kind >= LORA_KIND_COUNT)
            return mo_errorf(MO_EINVAL, "lora: module '%s' has an invalid kind %d", m->name,
                             (int)m->kind);
        if (m->C < 1 || m->OC < 1)
            return mo_errorf(MO_EINVAL, "lora: module '%s' has shape (%d, %d); want >= 1", m->name,
                             m->OC, m->C);
    }
    return MO_OK;
}

/* Parses the words into scope flags; proj words stay in the list. */
static int scan_words(const char *const *targets, int n_targets, int in_scope[LORA_KIND_COUNT],
                      int *mlp_scoped) {
    if (n_targets <= 0 || !targets)
        return mo_errorf(MO_ECONFIG, "lora: the target list is empty");
    memset(in_scope, 0, LORA_KIND_COUNT * sizeof *in_scope);
    *mlp_scoped = 0;
    for (int t = 0; t < n_targets; t++) {
        const char *w = targets[t];
        if (!w || !*w)
            return mo_errorf(MO_ECONFIG, "lora: target %d is an empty word", t);
        int k = kind_of_word(w);
        if (strcmp(w, "all-linear") == 0) {
            for (int j = 0; j < LORA_KIND_COUNT; j++)
                in_scope[j] = 1;
            *mlp_scoped = 1;
        } else if (k >= 0) {
            in_scope[k] = 1;
            *mlp_scoped |= is_mlp_kind(k);
        }
    }
    return MO_OK;
}

static int is_proj_word(const char *w) {
    return kind_of_word(w) < 0 && strcmp(w, "all-linear");
}

/* Whether module m is selected, by the rules in adapter.h; has_pk[k]: some
 * projection word names a projection of a module of kind k. */
static int selects(const lora_module_desc_t *m, const char *const *targets, int n_targets,
                   const int *in_scope, int mlp_scoped, const int *has_pk) {
    int k = (int)m->kind;
    if (!in_scope[k] && is_mlp_kind(k) && mlp_scoped)
        return 0;
    if (in_scope[k] && !has_pk[k])
        return 1;
    for (int t = 0; t < n_targets; t++)
        if (is_proj_word(targets[t]) && strcmp(targets[t], m->proj) == 0)
            return 1;
    return 0;
}

int lora_select_targets(unsigned char *sel, const lora_module_desc_t *mods, int n_mods,
                        const char *const *targets, int n_targets) {
    TRY(check_modules(mods, n_mods));
    int in_scope[LORA_KIND_COUNT] = {0}, mlp_scoped = 0;
    TRY(scan_words(targets, n_targets, in_scope, &mlp_scoped));
    int has_pk[LORA_KIND_COUNT] = {0};
    for (int i = 0; i < n_mods; i++)
        for (int t = 0; t < n_targets && !has_pk[mods[i].kind]; t++)
            has_pk[mods[i].kind] = is_proj_word(targets[t]) && !strcmp(targets[t], mods[i].proj);
    for (int i = 0; i < n_mods; i++)
        sel[i] = (unsigned char)selects(&mods[i], targets, n_targets, in_scope, mlp_scoped, has_pk);
    /* Every word must account for at least one selected module. */
    for (int t = 0; t < n_targets; t++) {
        const char *w = targets[t];
        int k = kind_of_word(w), used = 0;
        for (int i = 0; i < n_mods && !used; i++) {
            if (!sel[i])
                continue;
            if (strcmp(w, "all-linear") == 0)
                used = 1;
            else if (k >= 0)
                used = (int)mods[i].kind == k;
            else
                used = strcmp(mods[i].proj, w) == 0;
        }
        if (!used)
            return mo_errorf(MO_ECONFIG,
                             "lora: target '%s' selects no module of this model (projection "
                             "names are those the model describes, e.g. '%s'; scope words are "
                             "attention, experts, shared_experts, dense_mlp, all-linear)",
                             w, mods[0].proj);
    }
    return MO_OK;
}

static int suffix_match(const char *name, const char *suf) {
    size_t n = strlen(name), s = strlen(suf);
    if (s == 0 || s > n)
        return 0;
    if (s == n)
        return strcmp(name, suf) == 0;
    return name[n - s - 1] == '.' && strcmp(name + n - s, suf) == 0;
}

int lora_select_suffixes(unsigned char *sel, const lora_module_desc_t *mods, int n_mods,
                         const char *const *suffixes, int n_suffixes) {
    TRY(check_modules(mods, n_mods));
    int any = 0;
    for (int i = 0; i < n_mods; i++) {
        sel[i] = 0;
        for (int t = 0; t < n_suffixes && !sel[i]; t++)
            sel[i] = (unsigned char)suffix_match(mods[i].name, suffixes[t]);
        any |= sel[i];
    }
    if (!any)
        return mo_errorf(MO_ECONFIG,
                         "lora: target_modules (%d suffixes, first '%s') select no "
                         "module of this model",
                         n_suffixes, n_suffixes > 0 ? suffixes[0] : "");
    return MO_OK;
}

static int check_config(const lora_config_t *cfg) {
    if (!(cfg->dropout == 0.0f))
        return mo_errorf(MO_ECONFIG,
                         "lora: dropout must be 0 (got %g): adapters here have no "
                         "dropout",
                         (double)cfg->dropout);
    if (cfg->rank < 1)
        return mo_errorf(MO_ECONFIG, "lora: rank must be >= 1 (got %d)", cfg->rank);
    if (!(cfg->alpha > 0.0f) || !isfinite(cfg->alpha))
        return mo_errorf(MO_ECONFIG, "lora: alpha must be a positive number (got %g)",
                         (double)cfg->alpha);
    return MO_OK;
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    return h;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static char *cat3(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *d = malloc(na + nb + 1);
    if (d) {
        memcpy(d, a, na);
        memcpy(d + na, b, nb + 1);
    }
    return d;
}

/* Inserts entry e in the name index; -1 when the name is already there. */
static int index_insert(lora_adapter_t *ad, int e) {
    size_t mask = ad->index_cap - 1;
    for (size_t i = fnv1a(ad->entries[e].name) & mask;; i = (i + 1) & mask) {
        if (ad->index[i] < 0) {
            ad->index[i] = e;
            return 0;
        }
        if (strcmp(ad->entries[ad->index[i]].name, ad->entries[e].name) == 0)
            return -1;
    }
}

int lora_adapter_find(const lora_adapter_t *ad, const char *module) {
    size_t mask = ad->index_cap - 1;
    for (size_t i = fnv1a(module) & mask;; i = (i + 1) & mask) {
        int e = ad->index[i];
        if (e < 0 || strcmp(ad->entries[e].name, module) == 0)
            return e;
    }
}

static int alloc_tables(lora_adapter_t *ad, const lora_config_t *cfg, int n) {
    ad->entries = calloc((size_t)n, sizeof *ad->entries);
    ad->tensors = calloc((size_t)2 * n, sizeof *ad->tensors);
    size_t cap = 16;
    while (cap < (size_t)2 * n)
        cap *= 2;
    ad->index = malloc(cap * sizeof *ad->index);
    ad->index_cap = cap;
    if (cfg->n_targets > 0)
        ad->targets = calloc((size_t)cfg->n_targets, sizeof *ad->targets);
    if (!ad->entries || !ad->tensors || !ad->index || (cfg->n_targets > 0 && !ad->targets))
        return mo_errorf(MO_ENOMEM, "lora: cannot allocate the table of %d modules", n);
    for (size_t i = 0; i < cap; i++)
        ad->index[i] = -1;
    for (int t = 0; t < cfg->n_targets; t++) {
        if (!(ad->targets[t] = dup_str(cfg->targets[t])))
            return mo_errorf(MO_ENOMEM, "lora: out of memory");
        ad->n_targets = t + 1;
    }
    return MO_OK;
}

/* Fills entry and tensor rows for module m at flat offset *off. */
static int add_entry(lora_adapter_t *ad, const lora_module_desc_t *m, size_t *off) {
    int e = ad->n_entries;
    lora_entry_t *en = &ad->entries[e];
    en->name = dup_str(m->name);
    en->proj = dup_str(m->proj);
    lora_tensor_t *ta = &ad->tensors[2 * e], *tb = &ad->tensors[2 * e + 1];
    ta->name = cat3(m->name, ".lora_A.weight");
    tb->name = cat3(m->name, ".lora_B.weight");
    ad->n_entries = e + 1;
    ad->n_tensors = 2 * (e + 1);
    if (!en->name || !en->proj || !ta->name || !tb->name)
        return mo_errorf(MO_ENOMEM, "lora: out of memory");
    en->kind = m->kind;
    en->C = m->C;
    en->OC = m->OC;
    en->R = ad->R;
    en->off_A = *off;
    en->off_B = *off + (size_t)ad->R * m->C;
    *ta = (lora_tensor_t){ta->name, {ad->R, m->C}, en->off_A, (size_t)ad->R * m->C};
    *tb = (lora_tensor_t){tb->name, {m->OC, ad->R}, en->off_B, (size_t)m->OC * ad->R};
    *off = en->off_B + tb->numel;
    if (index_insert(ad, e) < 0)
        return mo_errorf(MO_EINVAL, "lora: module '%s' is listed twice", m->name);
    return MO_OK;
}

static void init_params(lora_adapter_t *ad) {
    memset(ad->params, 0, ad->n_params * sizeof *ad->params);
    for (int e = 0; e < ad->n_entries; e++) {
        const lora_entry_t *en = &ad->entries[e];
        float bound = 1.0f / sqrtf((float)en->C);
        uint64_t stream = rng_stream_id(en->name, 0x4c6f5241 /* "LoRA" */, 0);
        rng_fill_uniform(ad->params + en->off_A, (size_t)en->R * en->C, ad->seed, stream, -bound,
                         bound);
    }
}

static int build(lora_adapter_t *ad, const lora_config_t *cfg, const lora_module_desc_t *mods,
                 int n_mods, const unsigned char *sel) {
    int n = 0;
    for (int i = 0; i < n_mods; i++)
        n += sel[i] != 0;
    if (n == 0)
        return mo_errorf(MO_ECONFIG, "lora: no module selected");
    TRY(alloc_tables(ad, cfg, n));
    size_t off = 0;
    for (int i = 0; i < n_mods; i++)
        if (sel[i])
            TRY(add_entry(ad, &mods[i], &off));
    ad->n_params = off;
    ad->params = malloc(off * sizeof *ad->params);
    if (!ad->params)
        return mo_errorf(MO_ENOMEM, "lora: cannot allocate %zu parameters", off);
    if (!cfg->no_grads) {
        ad->grads = calloc(off, sizeof *ad->grads);
        if (!ad->grads)
            return mo_errorf(MO_ENOMEM, "lora: cannot allocate %zu gradients", off);
    }
    init_params(ad);
    return MO_OK;
}

int lora_adapter_new_selected(lora_adapter_t **out, const lora_config_t *cfg,
                              const lora_module_desc_t *mods, int n_mods,
                              const unsigned char *sel) {
    *out = NULL;
    TRY(check_config(cfg));
    TRY(check_modules(mods, n_mods));
    lora_adapter_t *ad = calloc(1, sizeof *ad);
    if (!ad)
        return mo_errorf(MO_ENOMEM, "lora: out of memory");
    ad->R = cfg->rank;
    ad->alpha = cfg->alpha;
    ad->rslora = cfg->rslora != 0;
    ad->scale = ad->rslora ? cfg->alpha / sqrtf((float)cfg->rank) : cfg->alpha / (float)cfg->rank;
    ad->seed = cfg->seed;
    int rc = build(ad, cfg, mods, n_mods, sel);
    if (rc < 0) {
        lora_adapter_destroy(&ad);
        return rc;
    }
    *out = ad;
    return MO_OK;
}

int lora_adapter_new(lora_adapter_t **out, const lora_config_t *cfg, const lora_module_desc_t *mods,
                     int n_mods) {
    *out = NULL;
    TRY(check_config(cfg));
    TRY(check_modules(mods, n_mods));
    unsigned char *sel = malloc((size_t)n_mods);
    if (!sel)
        return mo_errorf(MO_ENOMEM, "lora: out of memory");
    int rc = lora_select_targets(sel, mods, n_mods, cfg->targets, cfg->n_targets);
    if (rc == MO_OK)
        rc = lora_adapter_new_selected(out, cfg, mods, n_mods, sel);
    free(sel);
    return rc;
}

void lora_adapter_destroy(lora_adapter_t **pad) {
    lora_adapter_t *ad = pad ? *pad : NULL;
    if (!ad)
        return;
    for (int e = 0; e < ad->n_entries; e++) {
        free(ad->entries[e].name);
        free(ad->entries[e].proj);
    }
    for (int t = 0; t < ad->n_tensors; t++)
        free(ad->tensors[t].name);
    lora_free_strings(ad->targets, ad->n_targets);
    free(ad->entries);
    free(ad->tensors);
    free(ad->index);
    free(ad->params);
    free(ad->grads);
    free(ad);
    *pad = NULL;
}

int lora_adapter_find_full(const lora_adapter_t *ad, const char *name) {
    for (int t = ad->n_tensors - ad->n_full; t < ad->n_tensors; t++)
        if (strcmp(ad->tensors[t].name, name) == 0)
            return t;
    return -1;
}

int lora_adapter_add_full(lora_adapter_t *ad, const char *name, int rows, int cols,
                          const float *init) {
    if (!name || !name[0] || rows < 1 || cols < 1 || !init)
        return mo_errorf(MO_EINVAL,
                         "lora: full tensor \"%s\" needs a name, rows %d >= 1, "
                         "cols %d >= 1 and initial values",
                         name ? name : "", rows, cols);
    if (lora_adapter_find_full(ad, name) >= 0 || lora_adapter_find(ad, name) >= 0)
        return mo_errorf(MO_EINVAL, "lora: full tensor \"%s\" is added twice", name);
    size_t numel = (size_t)rows * (size_t)cols, n = ad->n_params + numel;
    lora_tensor_t *tabs = realloc(ad->tensors, sizeof *tabs * (size_t)(ad->n_tensors + 1));
    if (!tabs)
        return mo_errorf(MO_ENOMEM, "lora: out of memory adding \"%s\"", name);
    ad->tensors = tabs;
    float *p = realloc(ad->params, n * sizeof *p);
    if (!p)
        return mo_errorf(MO_ENOMEM, "lora: cannot grow the parameters to %zu for \"%s\"", n, name);
    ad->params = p;
    if (ad->grads) {
        float *g = realloc(ad->grads, n * sizeof *g);
        if (!g)
            return mo_errorf(MO_ENOMEM, "lora: cannot grow the gradients to %zu for \"%s\"", n,
                             name);
        ad->grads = g;
        memset(g + ad->n_params, 0, numel * sizeof *g);
    }
    char *nm = dup_str(name);
    if (!nm)
        return mo_errorf(MO_ENOMEM, "lora: out of memory adding \"%s\"", name);
    memcpy(p + ad->n_params, init, numel * sizeof *p);
    tabs[ad->n_tensors] = (lora_tensor_t){nm, {rows, cols}, ad->n_params, numel};
    ad->n_tensors++;
    ad->n_full++;
    ad->n_params = n;
    return MO_OK;
}

lora_pair_t lora_adapter_pair(const lora_adapter_t *ad, int e, int with_grads) {
    MO_ASSERT(e >= 0 && e < ad->n_entries);
    const lora_entry_t *en = &ad->entries[e];
    lora_pair_t p;
    p.A = ad->params + en->off_A;
    p.B = ad->params + en->off_B;
    p.dA = with_grads && ad->grads ? ad->grads + en->off_A : NULL;
    p.dB = with_grads && ad->grads ? ad->grads + en->off_B : NULL;
    p.R = en->R;
    p.scale = ad->scale;
    return p;
}

void lora_adapter_zero_grads(lora_adapter_t *ad) {
    if (ad->grads)
        memset(ad->grads, 0, ad->n_params * sizeof *ad->grads);
}

size_t lora_adapter_num_params(const lora_adapter_t *ad) {
    return ad->n_params;
}

/* name without a leading "model.layers.<digits>." */
static const char *strip_layer(const char *name) {
    static const char pre[] = "model.layers.";
    size_t np = sizeof pre - 1;
    if (strncmp(name, pre, np) != 0 || !isdigit((unsigned char)name[np]))
        return name;
    const char *p = name + np;
    while (isdigit((unsigned char)*p))
        p++;
    return *p == '.' && p[1] ? p + 1 : name;
}

void lora_free_strings(char **s, int n) {
    if (!s)
        return;
    for (int i = 0; i < n; i++)
        free(s[i]);
    free(s);
}

int lora_adapter_suffixes(const lora_adapter_t *ad, char ***out, int *n) {
    *out = NULL;
    *n = 0;
    char **list = calloc((size_t)ad->n_entries, sizeof *list);
    int *seen = malloc(ad->index_cap * sizeof *seen); /* open-addressing set of list ids */
    if (!list || !seen) {
        free(list);
        free(seen);
        return mo_errorf(MO_ENOMEM, "lora: out of memory");
    }
    for (size_t i = 0; i < ad->index_cap; i++)
        seen[i] = -1;
    size_t mask = ad->index_cap - 1;
    int cnt = 0;
    for (int e = 0; e < ad->n_entries; e++) {
        const char *s = strip_layer(ad->entries[e].name);
        size_t i = fnv1a(s) & mask;
        while (seen[i] >= 0 && strcmp(list[seen[i]], s) != 0)
            i = (i + 1) & mask;
        if (seen[i] >= 0)
            continue;
        if (!(list[cnt] = dup_str(s))) {
            lora_free_strings(list, cnt);
            free(seen);
            return mo_errorf(MO_ENOMEM, "lora: out of memory");
        }
        seen[i] = cnt++;
    }
    free(seen);
    *out = list;
    *n = cnt;
    return MO_OK;
}

/* XXH64, from the published specification. */
#define XP1 0x9E3779B185EBCA87ull
#define XP2 0xC2B2AE3D27D4EB4Full
#define XP3 0x165667B19E3779F9ull
#define XP4 0x85EBCA77C2B2AE63ull
#define XP5 0x27D4EB2F165667C5ull

static uint64_t rotl64(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

static uint64_t rd64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t xround(uint64_t acc, uint64_t in) {
    return rotl64(acc + in * XP2, 31) * XP1;
}

static uint64_t xmerge(uint64_t h, uint64_t v) {
    return (h ^ xround(0, v)) * XP1 + XP4;
}

uint64_t lora_hash64(const void *data, size_t n) {
    const unsigned char *p = data, *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = XP1 + XP2, v2 = XP2, v3 = 0, v4 = 0 - XP1;
        for (; end - p >= 32; p += 32) {
            v1 = xround(v1, rd64(p));
            v2 = xround(v2, rd64(p + 8));
            v3 = xround(v3, rd64(p + 16));
            v4 = xround(v4, rd64(p + 24));
        }
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xmerge(xmerge(xmerge(xmerge(h, v1), v2), v3), v4);
    } else {
        h = XP5;
    }
    h += (uint64_t)n;
    for (; end - p >= 8; p += 8)
        h = rotl64(h ^ xround(0, rd64(p)), 27) * XP1 + XP4;
    if (end - p >= 4) {
        h = rotl64(h ^ (uint64_t)rd32(p) * XP1, 23) * XP2 + XP3;
        p += 4;
    }
    for (; p < end; p++)
        h = rotl64(h ^ (uint64_t)*p * XP5, 11) * XP1;
    h ^= h >> 33;
    h *= XP2;
    h ^= h >> 29;
    h *= XP3;
    h ^= h >> 32;
    return h;
}

uint64_t lora_adapter_checksum(const lora_adapter_t *ad) {
    return lora_hash64(ad->params, ad->n_params * sizeof *ad->params);
}
