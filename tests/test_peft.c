/* test_peft: PEFT-layout save and load: round trips, the config fields, the
 * key names, bad files, PEFT-written adapters, and a check of the file from
 * Python with torch. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/backend.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "lora/peft.h"
#include "tests/testutil.h"

/* 2 MoE layers, D = 16: attention q k v o, 3 routed experts (hidden 8) and
 * shared experts (hidden 12). */
#define MAX_MODS 64
static lora_module_desc_t g_m[MAX_MODS];
static char g_names[MAX_MODS][96];
static int g_n;

static void add(lora_kind_t kind, const char *proj, int C, int OC, const char *name) {
    snprintf(g_names[g_n], sizeof g_names[g_n], "%s", name);
    g_m[g_n] = (lora_module_desc_t){g_names[g_n], proj, kind, C, OC};
    g_n++;
}

static void build_model(void) {
    static const char *att[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    static const int att_oc[] = {16, 8, 8, 16};
    static const char *mlp[] = {"gate_proj", "up_proj", "down_proj"};
    char nm[96];
    g_n = 0;
    for (int l = 0; l < 2; l++) {
        for (int i = 0; i < 4; i++) {
            snprintf(nm, sizeof nm, "model.layers.%d.self_attn.%s", l, att[i]);
            add(LORA_KIND_ATTENTION, att[i], i == 3 ? 16 : 16, att_oc[i], nm);
        }
        for (int e = 0; e < 3; e++)
            for (int i = 0; i < 3; i++) {
                snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.%s", l, e, mlp[i]);
                add(LORA_KIND_EXPERT, mlp[i], i == 2 ? 8 : 16, i == 2 ? 16 : 8, nm);
            }
        for (int i = 0; i < 3; i++) {
            snprintf(nm, sizeof nm, "model.layers.%d.mlp.shared_experts.%s", l, mlp[i]);
            add(LORA_KIND_SHARED_EXPERT, mlp[i], i == 2 ? 12 : 16, i == 2 ? 16 : 12, nm);
        }
    }
}

static const char *g_words[] = {"q_proj", "v_proj", "experts", "shared_experts"};

/* A trained-looking adapter: A and B both random (B non-zero). */
static lora_adapter_t *make_adapter(int rank, float alpha, int rslora, uint64_t seed) {
    build_model();
    lora_config_t c = {.rank = rank,
                       .alpha = alpha,
                       .rslora = rslora,
                       .seed = seed,
                       .targets = g_words,
                       .n_targets = 4};
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &c, g_m, g_n), 0);
    tu_fill(ad->params, ad->n_params, seed + 100, -0.3f, 0.3f);
    return ad;
}

static char *path2(const char *a, const char *b) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    char t[sizeof buf[0]];
    size_t na = strlen(a), nb = strlen(b);
    CU_ASSERT_FATAL(na + nb + 2 <= sizeof t);
    memcpy(t, a, na);
    t[na] = '/';
    memcpy(t + na + 1, b, nb + 1);
    memcpy(buf[k], t, na + nb + 2);
    return buf[k];
}

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d)
        closedir(d);
    return n;
}

/* y (T, OC) = lora(x) for entry e: the forward an adapter gives. */
static void forward_of(const lora_adapter_t *ad, int e, const float *x, float *y, int T) {
    const lora_entry_t *en = &ad->entries[e];
    float xa[8 * 16];
    lora_pair_t p = lora_adapter_pair(ad, e, 0);
    memset(y, 0, sizeof(float) * T * en->OC);
    lora_forward(backend_cpu()->k, y, xa, x, &p, T, en->C, en->OC);
}

static void test_roundtrip(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(4, 8.0f, 0, 1);
    const char *dir = path2(tmp, "adapter");
    peft_save_opts_t o = {DT_F32, "Qwen/Qwen3-30B-A3B"};
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, &o), 0);
    CU_ASSERT_EQUAL(count_entries(tmp), 1); /* no staging directory left */
    CU_ASSERT_EQUAL(count_entries(dir), 2);

    /* into an existing adapter (other seed, so its A differs before loading) */
    lora_adapter_t *b = make_adapter(4, 8.0f, 0, 2);
    CU_ASSERT_NOT_EQUAL(memcmp(ad->params, b->params, ad->n_params * 4), 0);
    tu_fill(b->grads, b->n_params, 5, 1.0f, 2.0f);
    CU_ASSERT_EQUAL_FATAL(peft_load(b, dir), 0);
    CU_ASSERT_EQUAL(memcmp(ad->params, b->params, ad->n_params * 4), 0);
    CU_ASSERT_EQUAL(b->grads[0] >= 1.0f, 1); /* gradients untouched */
    CU_ASSERT_EQUAL(lora_adapter_checksum(b), lora_adapter_checksum(ad));

    /* a new adapter from the directory alone */
    lora_adapter_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(peft_load_new(&c, dir, g_m, g_n, 0), 0);
    CU_ASSERT_EQUAL(c->R, 4);
    CU_ASSERT_EQUAL(c->alpha, 8.0f);
    CU_ASSERT_EQUAL(c->rslora, 0);
    CU_ASSERT_EQUAL(c->scale, ad->scale);
    CU_ASSERT_EQUAL(c->seed, 1);
    CU_ASSERT_EQUAL_FATAL(c->n_entries, ad->n_entries);
    CU_ASSERT_EQUAL(c->n_params, ad->n_params);
    CU_ASSERT_EQUAL(memcmp(ad->params, c->params, ad->n_params * 4), 0);
    CU_ASSERT_EQUAL_FATAL(c->n_targets, 4);
    for (int t = 0; t < 4; t++)
        CU_ASSERT_STRING_EQUAL(c->targets[t], g_words[t]);
    for (int e = 0; e < c->n_entries; e++)
        CU_ASSERT_STRING_EQUAL(c->entries[e].name, ad->entries[e].name);

    /* identical forward outputs on every entry */
    float x[5 * 16], y1[5 * 16], y2[5 * 16], y3[5 * 16];
    tu_fill(x, sizeof x / 4, 7, -1.0f, 1.0f);
    int same = 1;
    for (int e = 0; e < ad->n_entries; e++) {
        int T = 5, OC = ad->entries[e].OC;
        forward_of(ad, e, x, y1, T);
        forward_of(b, e, x, y2, T);
        forward_of(c, e, x, y3, T);
        same &= !memcmp(y1, y2, sizeof(float) * T * OC) && !memcmp(y1, y3, sizeof(float) * T * OC);
        int nz = 0;
        for (int i = 0; i < T * OC; i++)
            nz += y1[i] != 0.0f;
        CU_ASSERT(nz > 0);
    }
    CU_ASSERT(same);

    /* saving again over the directory replaces its contents */
    ad->params[3] += 0.25f;
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, &o), 0);
    CU_ASSERT_EQUAL(count_entries(dir), 2);
    CU_ASSERT_EQUAL(peft_load(b, dir), 0);
    CU_ASSERT_EQUAL(memcmp(ad->params, b->params, ad->n_params * 4), 0);
    lora_adapter_destroy(&ad);
    lora_adapter_destroy(&b);
    lora_adapter_destroy(&c);
    tu_rmtree(tmp);
}

static char *slurp(const char *path);

/* Router and norm weights trained in full travel as PEFT modules_to_save. */
static void add_full_tensors(lora_adapter_t *ad, uint64_t seed) {
    float v[3 * 16];
    char nm[96];
    for (int l = 0; l < 2; l++) {
        tu_fill(v, 16, seed + 10 * l, 0.5f, 1.5f);
        snprintf(nm, sizeof nm, "model.layers.%d.input_layernorm.weight", l);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(ad, nm, 16, 1, v), 0);
        tu_fill(v, 3 * 16, seed + 10 * l + 1, -0.5f, 0.5f);
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.gate.weight", l);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(ad, nm, 3, 16, v), 0);
    }
    tu_fill(v, 16, seed + 99, 0.5f, 1.5f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_add_full(ad, "model.norm.weight", 16, 1, v), 0);
}

static void test_modules_to_save(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(4, 8.0f, 0, 11);
    size_t lora_params = ad->n_params;
    add_full_tensors(ad, 3);
    CU_ASSERT_EQUAL(ad->n_full, 5);
    CU_ASSERT_EQUAL(ad->n_tensors, 2 * ad->n_entries + 5);
    CU_ASSERT_EQUAL(ad->n_params, lora_params + 2 * 16 + 2 * 3 * 16 + 16);
    const char *dir = path2(tmp, "adapter");
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, NULL), 0);

    /* the keys and shapes PEFT uses: 1-D norm vectors, (E, D) routers */
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path2(dir, PEFT_WEIGHTS_NAME)), 0);
    int i = st_find(f, "base_model.model.model.layers.1.input_layernorm.modules_to_save.default."
                       "weight");
    CU_ASSERT_FATAL(i >= 0);
    CU_ASSERT(st_info(f, i)->ndim == 1 && st_info(f, i)->shape[0] == 16);
    i = st_find(f, "base_model.model.model.layers.0.mlp.gate.modules_to_save.default.weight");
    CU_ASSERT_FATAL(i >= 0);
    CU_ASSERT(st_info(f, i)->ndim == 2 && st_info(f, i)->shape[0] == 3 &&
              st_info(f, i)->shape[1] == 16);
    CU_ASSERT(st_find(f, "base_model.model.model.norm.modules_to_save.default.weight") >= 0);
    CU_ASSERT_EQUAL(st_count(f), ad->n_tensors);
    st_close(&f);
    char *cfg = slurp(path2(dir, PEFT_CONFIG_NAME));
    cJSON *j = cJSON_Parse(cfg);
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(j, "modules_to_save");
    CU_ASSERT_FATAL(cJSON_IsArray(ms));
    CU_ASSERT_EQUAL_FATAL(cJSON_GetArraySize(ms), 3);
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(ms, 0)->valuestring, "input_layernorm");
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(ms, 1)->valuestring, "mlp.gate");
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(ms, 2)->valuestring, "model.norm");
    cJSON_Delete(j);
    free(cfg);

    /* into an adapter with the same full tensors (other values) */
    lora_adapter_t *b = make_adapter(4, 8.0f, 0, 12);
    add_full_tensors(b, 4);
    CU_ASSERT_NOT_EQUAL(memcmp(ad->params, b->params, ad->n_params * 4), 0);
    CU_ASSERT_EQUAL_FATAL(peft_load(b, dir), 0);
    CU_ASSERT_EQUAL(memcmp(ad->params, b->params, ad->n_params * 4), 0);
    CU_ASSERT_EQUAL(lora_adapter_checksum(b), lora_adapter_checksum(ad));

    /* a new adapter from the directory: the full tensors come from the file */
    lora_adapter_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(peft_load_new(&c, dir, g_m, g_n, 0), 0);
    CU_ASSERT_EQUAL(c->n_full, 5);
    CU_ASSERT_EQUAL_FATAL(c->n_params, ad->n_params);
    CU_ASSERT_EQUAL(memcmp(ad->params, c->params, ad->n_params * 4), 0);
    for (int t = 0; t < ad->n_tensors; t++) {
        CU_ASSERT_STRING_EQUAL(c->tensors[t].name, ad->tensors[t].name);
        CU_ASSERT(c->tensors[t].shape[0] == ad->tensors[t].shape[0] &&
                  c->tensors[t].shape[1] == ad->tensors[t].shape[1]);
    }

    /* an adapter without them refuses the file, naming the extra key */
    lora_adapter_t *plain = make_adapter(4, 8.0f, 0, 13);
    CU_ASSERT_EQUAL(peft_load(plain, dir), MO_EMALFORMED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "modules_to_save.default.weight"));
    /* ... and an adapter with them refuses a file without them */
    const char *dir2 = path2(tmp, "plain");
    CU_ASSERT_EQUAL_FATAL(peft_save(plain, dir2, NULL), 0);
    CU_ASSERT_EQUAL(peft_load(b, dir2), MO_EMALFORMED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "missing key"));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "modules_to_save.default.weight"));
    lora_adapter_destroy(&ad);
    lora_adapter_destroy(&b);
    lora_adapter_destroy(&c);
    lora_adapter_destroy(&plain);
    tu_rmtree(tmp);
}

static void test_rslora_bf16(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(16, 32.0f, 1, 3);
    const char *dir = path2(tmp, "a16/");
    peft_save_opts_t o = {DT_BF16, NULL};
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, &o), 0);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path2(tmp, "a16/" PEFT_WEIGHTS_NAME)), 0);
    CU_ASSERT_EQUAL(st_info(f, 0)->dtype, DT_BF16);
    st_close(&f);
    lora_adapter_t *c = NULL;
    CU_ASSERT_EQUAL_FATAL(peft_load_new(&c, dir, g_m, g_n, 1), 0);
    CU_ASSERT_EQUAL(c->rslora, 1);
    CU_ASSERT_EQUAL(c->scale, 8.0f);
    CU_ASSERT_PTR_NULL(c->grads);
    int bad = 0;
    for (size_t i = 0; i < ad->n_params; i++)
        bad += c->params[i] != bf16_to_f32(f32_to_bf16(ad->params[i]));
    CU_ASSERT_EQUAL(bad, 0);
    lora_adapter_destroy(&ad);
    lora_adapter_destroy(&c);
    tu_rmtree(tmp);
}

static const cJSON *get(const cJSON *j, const char *k) {
    return cJSON_GetObjectItemCaseSensitive(j, k);
}

static char *slurp(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, fp);
    s[got] = '\0';
    fclose(fp);
    return s;
}

static void test_config_fields(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(8, 16.0f, 0, 4);
    const char *dir = path2(tmp, "cfg");
    peft_save_opts_t o = {DT_F32, "org/model"};
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, &o), 0);
    char *text = slurp(path2(dir, PEFT_CONFIG_NAME));
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    cJSON *j = cJSON_Parse(text);
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    CU_ASSERT_STRING_EQUAL(get(j, "peft_type")->valuestring, "LORA");
    CU_ASSERT_STRING_EQUAL(get(j, "task_type")->valuestring, "CAUSAL_LM");
    CU_ASSERT_EQUAL(get(j, "r")->valuedouble, 8.0);
    CU_ASSERT_EQUAL(get(j, "lora_alpha")->valuedouble, 16.0);
    CU_ASSERT(cJSON_IsNumber(get(j, "lora_dropout")) && get(j, "lora_dropout")->valuedouble == 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "\"lora_dropout\":\t0.0"));
    CU_ASSERT(cJSON_IsFalse(get(j, "use_rslora")));
    CU_ASSERT_STRING_EQUAL(get(j, "bias")->valuestring, "none");
    CU_ASSERT_STRING_EQUAL(get(j, "base_model_name_or_path")->valuestring, "org/model");
    CU_ASSERT(cJSON_IsTrue(get(j, "inference_mode")));
    CU_ASSERT(cJSON_IsFalse(get(j, "fan_in_fan_out")));
    CU_ASSERT(cJSON_IsTrue(get(j, "init_lora_weights")));
    const cJSON *tm = get(j, "target_modules");
    CU_ASSERT_FATAL(cJSON_IsArray(tm));
    /* q, v, then experts 0..2 x 3, then shared x 3 */
    CU_ASSERT_EQUAL(cJSON_GetArraySize(tm), 2 + 9 + 3);
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(tm, 0)->valuestring, "self_attn.q_proj");
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(tm, 1)->valuestring, "self_attn.v_proj");
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(tm, 2)->valuestring, "mlp.experts.0.gate_proj");
    CU_ASSERT_STRING_EQUAL(cJSON_GetArrayItem(tm, 13)->valuestring, "mlp.shared_experts.down_proj");
    cJSON_Delete(j);
    free(text);

    peft_config_t pc;
    CU_ASSERT_EQUAL_FATAL(peft_read_config(dir, &pc), 0);
    CU_ASSERT_EQUAL(pc.r, 8);
    CU_ASSERT_EQUAL(pc.alpha, 16.0f);
    CU_ASSERT_EQUAL(pc.n_target_modules, 14);
    CU_ASSERT_STRING_EQUAL(pc.base_model, "org/model");
    peft_config_free(&pc);
    lora_adapter_destroy(&ad);
    tu_rmtree(tmp);
}

static void test_key_names(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(4, 8.0f, 0, 5);
    const char *dir = path2(tmp, "keys");
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, NULL), 0);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path2(dir, PEFT_WEIGHTS_NAME)), 0);
    CU_ASSERT_EQUAL_FATAL(st_count(f), ad->n_tensors);
    const char *want[] = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_B.weight",
    };
    for (int i = 0; i < 4; i++)
        CU_ASSERT(st_find(f, want[i]) >= 0);
    tensor_t t;
    CU_ASSERT_EQUAL(st_get(f, want[2], &t), 0);
    CU_ASSERT(t.ndim == 2 && t.shape[0] == 4 && t.shape[1] == 8 && t.dtype == DT_F32);
    CU_ASSERT_EQUAL(st_get(f, want[3], &t), 0);
    CU_ASSERT(t.ndim == 2 && t.shape[0] == 12 && t.shape[1] == 4);
    for (int i = 0; i < st_count(f); i++) {
        char k[256];
        snprintf(k, sizeof k, "base_model.model.%s", ad->tensors[i].name);
        CU_ASSERT_STRING_EQUAL(st_info(f, i)->name, k);
        tensor_t v = st_tensor(f, i);
        CU_ASSERT_EQUAL(
            memcmp(v.data, ad->params + ad->tensors[i].offset, ad->tensors[i].numel * 4), 0);
    }
    CU_ASSERT_STRING_EQUAL(st_metadata(f, "format"), "pt");
    char sum[32];
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)lora_adapter_checksum(ad));
    CU_ASSERT_STRING_EQUAL(st_metadata(f, "moerl.checksum"), sum);
    CU_ASSERT_STRING_EQUAL(st_metadata(f, "moerl.targets"), "q_proj,v_proj,experts,shared_experts");
    st_close(&f);
    lora_adapter_destroy(&ad);
    tu_rmtree(tmp);
}

/* Rewrites dir's weights from ad with one change: skip tensor `skip`,
 * reshape tensor `reshape` to (R, C + 1) worth of data, or add an extra key. */
static void write_weights(const lora_adapter_t *ad, const char *dir, int skip, int reshape,
                          const char *extra) {
    int n = ad->n_tensors, k = 0;
    st_item_t *items = calloc((size_t)n + 1, sizeof *items);
    char(*names)[256] = calloc((size_t)n + 1, sizeof *names);
    static float big[4096];
    tu_fill(big, 4096, 8, -1.0f, 1.0f);
    for (int i = 0; i < n; i++) {
        if (i == skip)
            continue;
        const lora_tensor_t *t = &ad->tensors[i];
        snprintf(names[k], 256, "base_model.model.%s", t->name);
        int64_t shape[2] = {t->shape[0], t->shape[1] + (i == reshape)};
        void *data = i == reshape ? (void *)big : (void *)(ad->params + t->offset);
        items[k].name = names[k];
        items[k].tensor = tensor_view(data, DT_F32, DEV_CPU, 2, shape);
        k++;
    }
    if (extra) {
        int64_t shape[2] = {2, 2};
        items[k].name = extra;
        items[k].tensor = tensor_view(big, DT_F32, DEV_CPU, 2, shape);
        k++;
    }
    CU_ASSERT_EQUAL(st_write(path2(dir, PEFT_WEIGHTS_NAME), items, k, NULL, 0), 0);
    free(items);
    free(names);
}

static void write_text(const char *path, const char *text) {
    FILE *fp = fopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    fputs(text, fp);
    fclose(fp);
}

/* peft_load must fail with code and a message holding both strings, and
 * leave the adapter as it was. */
static void expect_fail(lora_adapter_t *b, const char *dir, int code, const char *s1,
                        const char *s2) {
    float *keep = malloc(b->n_params * 4);
    memcpy(keep, b->params, b->n_params * 4);
    int rc = peft_load(b, dir);
    CU_ASSERT_EQUAL(rc, code);
    const char *msg = mo_last_error();
    if (rc != code || !strstr(msg, s1) || (s2 && !strstr(msg, s2)))
        tu_report("load: rc %d, message: %s (want %d, '%s', '%s')", rc, msg, code, s1,
                  s2 ? s2 : "");
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, s1));
    if (s2)
        CU_ASSERT_PTR_NOT_NULL(strstr(msg, s2));
    CU_ASSERT_EQUAL(memcmp(keep, b->params, b->n_params * 4), 0);
    free(keep);
}

static void test_bad_files(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(4, 8.0f, 0, 6);
    lora_adapter_t *b = make_adapter(4, 8.0f, 0, 7);
    char dir[600], wpath[700], cpath[700];
    snprintf(dir, sizeof dir, "%s/bad", tmp);
    snprintf(wpath, sizeof wpath, "%s/%s", dir, PEFT_WEIGHTS_NAME);
    snprintf(cpath, sizeof cpath, "%s/%s", dir, PEFT_CONFIG_NAME);
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, NULL), 0);
    char *good_cfg = slurp(cpath);

    /* missing key: the B of entry 3 */
    write_weights(ad, dir, 7, -1, NULL);
    char key[256];
    snprintf(key, sizeof key, "missing key 'base_model.model.%s'", ad->tensors[7].name);
    expect_fail(b, dir, MO_EMALFORMED, wpath, key);
    /* wrong shape */
    write_weights(ad, dir, -1, 4, NULL);
    snprintf(key, sizeof key, "'base_model.model.%s' has shape (%d, %d); expected (%d, %d)",
             ad->tensors[4].name, (int)ad->tensors[4].shape[0], (int)ad->tensors[4].shape[1] + 1,
             (int)ad->tensors[4].shape[0], (int)ad->tensors[4].shape[1]);
    expect_fail(b, dir, MO_EMALFORMED, wpath, key);
    /* extra keys: a module the adapter lacks, and a non-LoRA tensor */
    write_weights(ad, dir, -1, -1,
                  "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight");
    expect_fail(b, dir, MO_EMALFORMED, wpath,
                "unexpected key 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'");
    write_weights(ad, dir, -1, -1, "base_model.model.lm_head.weight");
    expect_fail(b, dir, MO_EMALFORMED, "unexpected key 'base_model.model.lm_head.weight'", NULL);
    /* a corrupt weights file */
    {
        static const char trunc[] = "\x10\0\0\0\0\0\0\0{\"a\": [1, 2";
        FILE *fp = fopen(wpath, "wb");
        CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
        fwrite(trunc, 1, sizeof trunc - 1, fp);
        fclose(fp);
    }
    expect_fail(b, dir, MO_EMALFORMED, wpath, NULL);
    /* flipped bit in the data: the checksum catches it */
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, NULL), 0);
    {
        FILE *fp = fopen(wpath, "r+b");
        CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
        fseek(fp, -3, SEEK_END);
        int ch = fgetc(fp);
        fseek(fp, -3, SEEK_END);
        fputc(ch ^ 0x01, fp);
        fclose(fp);
    }
    expect_fail(b, dir, MO_EMALFORMED, wpath, "checksum mismatch");
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, dir, NULL), 0);

    /* corrupt json, wrong types, unsupported features, a torn pair */
    write_text(cpath, "{\"peft_type\": \"LORA\", \"r\": 4,");
    expect_fail(b, dir, MO_EMALFORMED, cpath, "not valid JSON");
    write_text(cpath, "[1, 2]");
    expect_fail(b, dir, MO_EMALFORMED, cpath, "object");
    write_text(cpath, "{\"peft_type\": \"LORA\", \"r\": \"4\", \"lora_alpha\": 8, "
                      "\"target_modules\": [\"q_proj\"]}");
    expect_fail(b, dir, MO_EMALFORMED, cpath, "'r'");
    write_text(cpath, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, "
                      "\"target_modules\": \".*q_proj\"}");
    expect_fail(b, dir, MO_EUNSUPPORTED, cpath, "regular expression");
    write_text(cpath, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_dora\": true, "
                      "\"target_modules\": [\"q_proj\"]}");
    expect_fail(b, dir, MO_EUNSUPPORTED, cpath, "use_dora");
    write_text(cpath, "{\"peft_type\": \"PREFIX_TUNING\"}");
    expect_fail(b, dir, MO_EUNSUPPORTED, cpath, "PREFIX_TUNING");
    write_text(cpath, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 16, "
                      "\"target_modules\": [\"q_proj\"]}");
    expect_fail(b, dir, MO_ECONFIG, cpath, "lora_alpha is 16");
    {
        /* the config says alpha 16 and so does the adapter, but the weights
         * were written for alpha 8 */
        const char *w[] = {"q_proj", "v_proj", "experts", "shared_experts"};
        lora_config_t c16 = {.rank = 4, .alpha = 16.0f, .seed = 1, .targets = w, .n_targets = 4};
        lora_adapter_t *a16 = NULL;
        CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&a16, &c16, g_m, g_n), 0);
        expect_fail(a16, dir, MO_EMALFORMED, wpath, "do not belong together");
        lora_adapter_destroy(&a16);
    }
    write_text(cpath, good_cfg);
    CU_ASSERT_EQUAL(peft_load(b, dir), 0);

    /* rank mismatch against the adapter */
    lora_adapter_t *r8 = make_adapter(8, 8.0f, 0, 6);
    expect_fail(r8, dir, MO_ECONFIG, cpath, "r is 4 but the adapter has rank 8");
    lora_adapter_destroy(&r8);

    /* missing files */
    unlink(wpath);
    expect_fail(b, dir, MO_EIO, wpath, NULL);
    unlink(cpath);
    expect_fail(b, dir, MO_EIO, cpath, NULL);
    lora_adapter_t *none = (lora_adapter_t *)&g_n;
    CU_ASSERT_EQUAL(peft_load_new(&none, dir, g_m, g_n, 0), MO_EIO);
    CU_ASSERT_PTR_NULL(none);
    free(good_cfg);
    lora_adapter_destroy(&ad);
    lora_adapter_destroy(&b);
    tu_rmtree(tmp);
}

/* An adapter as PEFT writes it: proj-name target_modules, F16, no metadata,
 * a dropout that moerl does not apply. */
static void test_peft_written(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    build_model();
    const char *dir = tmp;
    write_text(path2(dir, PEFT_CONFIG_NAME),
               "{\"base_model_name_or_path\": null, \"bias\": \"none\", \"fan_in_fan_out\": false,"
               " \"inference_mode\": true, \"lora_alpha\": 16, \"lora_dropout\": 0.05,"
               " \"modules_to_save\": null, \"peft_type\": \"LORA\", \"r\": 2,"
               " \"rank_pattern\": {}, \"alpha_pattern\": {},"
               " \"target_modules\": [\"v_proj\", \"q_proj\"], \"task_type\": \"CAUSAL_LM\"}");
    /* keys in PEFT's (sorted) order, not the model's */
    st_item_t items[8];
    char names[8][128];
    uint16_t data[8][32];
    float want[8][32];
    int k = 0;
    for (int l = 1; l >= 0; l--)
        for (int pj = 0; pj < 2; pj++)
            for (int ab = 0; ab < 2; ab++) {
                const char *proj = pj ? "v_proj" : "q_proj";
                int OC = 16 >> pj; /* q: 16, v: 8 */
                snprintf(names[k], 128,
                         "base_model.model.model.layers.%d.self_attn.%s.lora_%c.weight", l, proj,
                         ab ? 'B' : 'A');
                int64_t shape[2] = {ab ? OC : 2, ab ? 2 : 16};
                tu_fill(want[k], 32, 200 + k, -1.0f, 1.0f);
                convert_from_f32(data[k], DT_F16, want[k], 32);
                convert_to_f32(want[k], data[k], DT_F16, 32);
                items[k].name = names[k];
                items[k].tensor = tensor_view(data[k], DT_F16, DEV_CPU, 2, shape);
                k++;
            }
    CU_ASSERT_EQUAL_FATAL(st_write(path2(dir, PEFT_WEIGHTS_NAME), items, k, NULL, 0), 0);
    lora_adapter_t *ad = NULL;
    int rc = peft_load_new(&ad, dir, g_m, g_n, 0);
    if (rc)
        tu_report("%s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(ad->n_entries, 4);
    CU_ASSERT_EQUAL(ad->scale, 8.0f);
    CU_ASSERT_STRING_EQUAL(ad->entries[0].name, "model.layers.0.self_attn.q_proj");
    CU_ASSERT_STRING_EQUAL(ad->entries[3].name, "model.layers.1.self_attn.v_proj");
    for (int i = 0; i < k; i++) {
        int t = -1;
        for (int j = 0; j < ad->n_tensors; j++)
            if (strcmp(names[i] + strlen("base_model.model."), ad->tensors[j].name) == 0)
                t = j;
        CU_ASSERT_FATAL(t >= 0);
        size_t n = ad->tensors[t].numel;
        CU_ASSERT_EQUAL(memcmp(ad->params + ad->tensors[t].offset, want[i], n * 4), 0);
    }
    lora_adapter_destroy(&ad);
    tu_rmtree(tmp);
}

/* Reads the saved file from Python: header by json + struct, data by torch. */
static const char *g_py =
    "import json, struct, sys\n"
    "try:\n"
    "    import torch\n"
    "except Exception as e:\n"
    "    print('torch import failed:', e); sys.exit(77)\n"
    "d = sys.argv[1]\n"
    "raw = open(d + '/adapter_model.safetensors', 'rb').read()\n"
    "n = struct.unpack('<Q', raw[:8])[0]\n"
    "hdr = json.loads(raw[8:8 + n])\n"
    "meta = hdr.pop('__metadata__')\n"
    "assert meta['format'] == 'pt', meta\n"
    "body = raw[8 + n:]\n"
    "want = [l.split() for l in open(d + '/expect.txt')]\n"
    "assert len(want) == len(hdr), (len(want), len(hdr))\n"
    "for key, r, c, s in want:\n"
    "    h = hdr[key]\n"
    "    assert h['dtype'] == 'F32', h\n"
    "    assert h['shape'] == [int(r), int(c)], (key, h['shape'])\n"
    "    b, e = h['data_offsets']\n"
    "    t = torch.frombuffer(bytearray(body[b:e]), dtype=torch.float32).reshape(int(r), int(c))\n"
    "    got = t.double().sum().item()\n"
    "    assert abs(got - float(s)) <= 1e-9 * max(1.0, abs(float(s))), (key, got, s)\n"
    "cfg = json.load(open(d + '/adapter_config.json'))\n"
    "assert cfg['peft_type'] == 'LORA' and cfg['r'] == 4 and cfg['lora_dropout'] == 0.0\n"
    "tm = cfg['target_modules']\n"
    "for key in hdr:\n"
    "    mod = key[len('base_model.model.'):-len('.lora_A.weight')]\n"
    "    assert any(mod == t or mod.endswith('.' + t) for t in tm), mod\n"
    "print('python checked', len(hdr), 'tensors')\n";

static void test_python_reads_file(void) {
    char tmp[512];
    CU_ASSERT_FATAL(tu_tmpdir(tmp, sizeof tmp) == 0);
    lora_adapter_t *ad = make_adapter(4, 8.0f, 0, 9);
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, path2(tmp, "py"), NULL), 0);
    FILE *fp = fopen(path2(tmp, "py/expect.txt"), "w");
    for (int t = 0; t < ad->n_tensors; t++) {
        double s = 0;
        for (size_t i = 0; i < ad->tensors[t].numel; i++)
            s += ad->params[ad->tensors[t].offset + i];
        fprintf(fp, "base_model.model.%s %d %d %.17g\n", ad->tensors[t].name,
                (int)ad->tensors[t].shape[0], (int)ad->tensors[t].shape[1], s);
    }
    fclose(fp);
    write_text(path2(tmp, "check.py"), g_py);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' 2>&1", tu_python(), path2(tmp, "check.py"),
             path2(tmp, "py"));
    int st = system(cmd);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (code == 77 || code == 127)
        fprintf(stderr, "\n    skipped: %s cannot import torch\n", tu_python());
    else
        CU_ASSERT_EQUAL(code, 0);
    lora_adapter_destroy(&ad);
    tu_rmtree(tmp);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"save, load, identical buffers and outputs", test_roundtrip},
        {"rsLoRA, bf16 file", test_rslora_bf16},
        {"modules_to_save: router and norm weights", test_modules_to_save},
        {"adapter_config.json fields", test_config_fields},
        {"key names and metadata", test_key_names},
        {"bad files", test_bad_files},
        {"adapter written by PEFT", test_peft_written},
        {"python reads the file", test_python_reads_file},
        CU_TEST_INFO_NULL,
    };
    return tu_main("peft", tests);
}
