/* test_init_model: `moerl init-model` presets and writer read back by the model loader
 * (every supported family, bf16 and f32, sharded checkpoints), the DeepSeek-V3 MLA layout,
 * broken checkpoints, and the `moerl init-model` / `moerl score` commands as processes. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "lora/peft.h"
#include "tests/testutil.h"

/* Writes a tiny preset into a fresh directory. */
static void write_tiny(char *dir, size_t cap, model_arch_t arch, dtype_t dt, uint64_t seed,
                       model_config_t *c) {
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, cap), 0);
    CU_ASSERT_EQUAL_FATAL(init_model_config(c, arch, INIT_SIZE_TINY, dt), 0);
    init_model_opts_t o = {seed, 0.0f};
    int rc = init_model_write(dir, c, &o);
    if (rc < 0)
        tu_report("init_model_write: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* Scores a fixed sequence; logp (n - 1). */
static int score_seq(model_t *m, float *logp, float *ent) {
    enum { N = 12 };
    int32_t tok[N], pos[N], tgt[N], cu[2] = {0, N};
    for (int i = 0; i < N; i++)
        tok[i] = (int32_t)((i * 37 + 11) % 261);
    model_batch_next_token(pos, tgt, tok, cu, 1);
    model_batch_t b = {N, 1, tok, pos, cu, tgt, 1.0f, NULL, NULL};
    tu_poison(logp, N);
    tu_poison(ent, N);
    return model_forward(m, &b, logp, ent, 0);
}

static int file_equal(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
        if (ca == EOF || cb == EOF)
            break;
    }
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    return same;
}

static void round_trip(model_arch_t arch, dtype_t dt) {
    char dir[512], path[600];
    model_config_t c, back;
    write_tiny(dir, sizeof dir, arch, dt, 3, &c);
    CU_ASSERT_EQUAL_FATAL(model_config_load(&back, dir), 0);
    CU_ASSERT_EQUAL(back.arch, arch);
    CU_ASSERT_EQUAL(back.torch_dtype, dt);
    CU_ASSERT_EQUAL(back.hidden_size, 64);
    CU_ASSERT_EQUAL(back.num_experts, 8);
    CU_ASSERT_EQUAL(back.vocab_size, 261);
    model_t *m = NULL;
    int rc = model_open(&m, dir, NULL);
    if (rc < 0)
        tu_report("model_open: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(m->embed.dtype, dt);
    CU_ASSERT_EQUAL(m->layers[1].experts[0].dtype, dt);
    CU_ASSERT_EQUAL(m->n_moe, 2);
    CU_ASSERT_EQUAL(m->layers[0].q_norm != NULL, arch == ARCH_QWEN3_MOE);
    /* The views point at the file's bytes: q_proj[0][0] as written. */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path), 0);
    tensor_t t;
    CU_ASSERT_EQUAL_FATAL(st_get(f, "model.layers.1.self_attn.o_proj.weight", &t), 0);
    CU_ASSERT(memcmp(t.data, m->layers[1].wo.data, dtype_size(dt) * 64) == 0);
    float w[64];
    convert_to_f32(w, t.data, dt, 64);
    double ss = 0;
    for (int i = 0; i < 64; i++)
        ss += (double)w[i] * w[i];
    CU_ASSERT(sqrt(ss / 64) > 0.01 && sqrt(ss / 64) < 0.04); /* normal(0, 0.02) */
    st_close(&f);
    float logp[12], ent[12];
    CU_ASSERT_EQUAL_FATAL(score_seq(m, logp, ent), 0);
    for (int i = 0; i < 11; i++) {
        CU_ASSERT(logp[i] < -4.5f && logp[i] > -7.0f); /* near -log(261) = -5.56 */
        CU_ASSERT(ent[i] > 5.0f && ent[i] <= logf(261.0f) + 1e-4f);
    }
    model_destroy(&m);
    tu_rmtree(dir);
}

static void test_round_trip(void) {
    round_trip(ARCH_QWEN3_MOE, DT_BF16);
    round_trip(ARCH_QWEN3_MOE, DT_F32);
    round_trip(ARCH_MIXTRAL, DT_BF16);
    round_trip(ARCH_MIXTRAL, DT_F32);
}

static void test_deterministic_writer(void) {
    char d1[512], d2[512], d3[512], p1[600], p2[600], p3[600];
    model_config_t c;
    write_tiny(d1, sizeof d1, ARCH_MIXTRAL, DT_BF16, 5, &c);
    write_tiny(d2, sizeof d2, ARCH_MIXTRAL, DT_BF16, 5, &c);
    write_tiny(d3, sizeof d3, ARCH_MIXTRAL, DT_BF16, 6, &c);
    snprintf(p1, sizeof p1, "%s/model.safetensors", d1);
    snprintf(p2, sizeof p2, "%s/model.safetensors", d2);
    snprintf(p3, sizeof p3, "%s/model.safetensors", d3);
    CU_ASSERT(file_equal(p1, p2));
    CU_ASSERT(!file_equal(p1, p3));
    /* The bf16 file holds the f32 file's values rounded. */
    char d4[512], p4[600];
    write_tiny(d4, sizeof d4, ARCH_MIXTRAL, DT_F32, 5, &c);
    snprintf(p4, sizeof p4, "%s/model.safetensors", d4);
    st_file_t *fb = NULL, *ff = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&fb, p1), 0);
    CU_ASSERT_EQUAL_FATAL(st_open(&ff, p4), 0);
    tensor_t tb, tf;
    const char *name = "model.layers.0.block_sparse_moe.experts.3.w2.weight";
    CU_ASSERT_EQUAL_FATAL(st_get(fb, name, &tb), 0);
    CU_ASSERT_EQUAL_FATAL(st_get(ff, name, &tf), 0);
    CU_ASSERT_EQUAL(tb.dtype, DT_BF16);
    CU_ASSERT_EQUAL(tf.dtype, DT_F32);
    int64_t n = tensor_numel(&tf);
    int same = 1;
    for (int64_t i = 0; i < n; i++)
        same &= ((const uint16_t *)tb.data)[i] == f32_to_bf16(((const float *)tf.data)[i]);
    CU_ASSERT(same);
    st_close(&fb);
    st_close(&ff);
    tu_rmtree(d1);
    tu_rmtree(d2);
    tu_rmtree(d3);
    tu_rmtree(d4);
}

static void test_deepseek_mla(void) {
    char dir[512], path[600];
    model_config_t c;
    write_tiny(dir, sizeof dir, ARCH_DEEPSEEK_V3, DT_BF16, 1, &c);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path), 0);
    tensor_t t;
    CU_ASSERT_EQUAL(st_get(f, "model.layers.1.self_attn.q_a_proj.weight", &t), 0);
    CU_ASSERT(t.ndim == 2 && t.shape[0] == 32 && t.shape[1] == 64);
    CU_ASSERT_EQUAL(st_get(f, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", &t), 0);
    CU_ASSERT(t.shape[0] == 32 + 8 && t.shape[1] == 64);
    CU_ASSERT_EQUAL(st_get(f, "model.layers.1.self_attn.kv_b_proj.weight", &t), 0);
    CU_ASSERT(t.shape[0] == 4 * (16 + 16) && t.shape[1] == 32);
    CU_ASSERT_EQUAL(st_get(f, "model.layers.1.mlp.gate.e_score_correction_bias", &t), 0);
    CU_ASSERT_EQUAL(t.dtype, DT_F32);
    CU_ASSERT_EQUAL(st_get(f, "model.layers.1.mlp.shared_experts.down_proj.weight", &t), 0);
    CU_ASSERT(t.shape[0] == 64 && t.shape[1] == 32);
    CU_ASSERT_EQUAL(st_get(f, "model.layers.0.mlp.gate_proj.weight", &t), 0); /* dense layer 0 */
    CU_ASSERT(t.shape[0] == 128);
    /* The loader's views are the file's bytes. */
    CU_ASSERT_EQUAL_FATAL(st_get(f, "model.layers.1.self_attn.kv_b_proj.weight", &t), 0);
    model_t *m = NULL;
    int rc = model_open(&m, dir, NULL);
    if (rc < 0)
        tu_report("deepseek_v3: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(m->mla, 1);
    CU_ASSERT(memcmp(t.data, m->layers[1].mla.kv_b.data, 2 * 64) == 0);
    st_close(&f);
    CU_ASSERT_EQUAL(m->n_moe, 1);
    CU_ASSERT_PTR_NULL(m->layers[1].wq.data); /* no GQA weights */
    CU_ASSERT_STRING_EQUAL(m->modules[0].name, "model.layers.0.self_attn.q_a_proj");
    CU_ASSERT_STRING_EQUAL(m->modules[3].proj, "kv_b_proj");
    CU_ASSERT_EQUAL(m->modules[3].kind, LORA_KIND_ATTENTION);
    float logp[12], ent[12];
    CU_ASSERT_EQUAL_FATAL(score_seq(m, logp, ent), 0);
    for (int i = 0; i < 11; i++) {
        CU_ASSERT(logp[i] < -4.5f && logp[i] > -7.0f); /* near -log(261) = -5.56 */
        CU_ASSERT(ent[i] > 5.0f && ent[i] <= logf(261.0f) + 1e-4f);
    }
    model_destroy(&m);
    tu_rmtree(dir);
}

/* ------------------------------------------------------------------------ */
/* Broken and sharded checkpoints.                                           */

/* Rewrites dir/model.safetensors without `drop` and with `reshape` given shape (r, c). */
static void rewrite(const char *dir, const char *drop, const char *reshape, int64_t r, int64_t c) {
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path), 0);
    int n = st_count(f), k = 0;
    st_item_t *items = calloc((size_t)n, sizeof *items);
    for (int i = 0; i < n; i++) {
        const st_info_t *in = st_info(f, i);
        if (drop && !strcmp(in->name, drop))
            continue;
        items[k].name = in->name;
        items[k].tensor = st_tensor(f, i);
        if (reshape && !strcmp(in->name, reshape)) {
            items[k].tensor.shape[0] = r;
            items[k].tensor.shape[1] = c;
        }
        k++;
    }
    CU_ASSERT_EQUAL(st_write(path, items, k, NULL, 0), 0);
    free(items);
    st_close(&f);
}

static void expect_open_error(const char *dir, int code, const char *a, const char *b) {
    model_t *m = NULL;
    int rc = model_open(&m, dir, NULL);
    if (rc != code || !strstr(mo_last_error(), a) || (b && !strstr(mo_last_error(), b)))
        tu_report("model_open: %d (want %d): %s", rc, code, mo_last_error());
    CU_ASSERT_EQUAL(rc, code);
    CU_ASSERT_PTR_NULL(m);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), a));
    if (b)
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), b));
}

static void test_bad_checkpoints(void) {
    char dir[512], path[600];
    model_config_t c;
    write_tiny(dir, sizeof dir, ARCH_QWEN3_MOE, DT_BF16, 2, &c);
    rewrite(dir, "model.layers.1.self_attn.k_proj.weight", NULL, 0, 0);
    expect_open_error(dir, MO_ENOTFOUND, "\"model.layers.1.self_attn.k_proj.weight\" is missing",
                      "expected shape (32, 64)");
    tu_rmtree(dir);
    write_tiny(dir, sizeof dir, ARCH_QWEN3_MOE, DT_BF16, 2, &c);
    rewrite(dir, NULL, "model.layers.0.mlp.experts.5.down_proj.weight", 32, 64);
    expect_open_error(dir, MO_EMALFORMED, "model.layers.0.mlp.experts.5.down_proj.weight",
                      "has shape (32, 64), expected (64, 32)");
    tu_rmtree(dir);
    write_tiny(dir, sizeof dir, ARCH_MIXTRAL, DT_BF16, 2, &c);
    rewrite(dir, "model.norm.weight", NULL, 0, 0);
    expect_open_error(dir, MO_ENOTFOUND, "\"model.norm.weight\" is missing", "expected shape (64)");
    tu_rmtree(dir);
    write_tiny(dir, sizeof dir, ARCH_MIXTRAL, DT_BF16, 2, &c);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CU_ASSERT_EQUAL(truncate(path, 50000), 0);
    model_t *m = NULL;
    CU_ASSERT(model_open(&m, dir, NULL) < 0);
    CU_ASSERT_PTR_NULL(m);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "model.safetensors"));
    snprintf(path, sizeof path, "%s/config.json", dir);
    CU_ASSERT_EQUAL(unlink(path), 0);
    expect_open_error(dir, MO_EIO, "config.json", NULL);
    tu_rmtree(dir);
}

/* The same weights split over two shards with an index give the same numbers. */
static void test_sharded(void) {
    char dir[512], path[700];
    model_config_t c;
    write_tiny(dir, sizeof dir, ARCH_QWEN3_MOE, DT_BF16, 4, &c);
    model_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(model_open(&m, dir, NULL), 0);
    float l0[12], e0[12], l1[12], e1[12];
    CU_ASSERT_EQUAL_FATAL(score_seq(m, l0, e0), 0);
    model_destroy(&m);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file_t *f = NULL;
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path), 0);
    int n = st_count(f), half = n / 2;
    st_item_t *items = calloc((size_t)n, sizeof *items);
    cJSON *map = cJSON_CreateObject();
    for (int i = 0; i < n; i++) {
        items[i].name = st_info(f, i)->name;
        items[i].tensor = st_tensor(f, i);
        cJSON_AddStringToObject(map, items[i].name,
                                i < half ? "model-00001-of-00002.safetensors"
                                         : "model-00002-of-00002.safetensors");
    }
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    CU_ASSERT_EQUAL(st_write(path, items, half, NULL, 0), 0);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    CU_ASSERT_EQUAL(st_write(path, items + half, n - half, NULL, 0), 0);
    free(items);
    st_close(&f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CU_ASSERT_EQUAL(unlink(path), 0);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "metadata", cJSON_CreateObject());
    cJSON_AddItemToObject(root, "weight_map", map);
    char *text = cJSON_Print(root);
    snprintf(path, sizeof path, "%s/" ST_INDEX_NAME, dir);
    FILE *fp = fopen(path, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    fputs(text, fp);
    fclose(fp);
    free(text);
    cJSON_Delete(root);
    int rc = model_open(&m, dir, NULL);
    if (rc < 0)
        tu_report("sharded: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL_FATAL(score_seq(m, l1, e1), 0);
    CU_ASSERT(memcmp(l0, l1, sizeof l0) == 0);
    CU_ASSERT(memcmp(e0, e1, sizeof e0) == 0);
    model_destroy(&m);
    tu_rmtree(dir);
}

/* ------------------------------------------------------------------------ */
/* The commands as processes.                                                */

/* Runs `moerl ARGS`; stdout (and stderr when merge) into *out. */
static int run_moerl(const char *args, int merge, char **out) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s %s", tu_moerl_exe(), args, merge ? "2>&1" : "2>/dev/null");
    *out = NULL;
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += got;
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

static void expect_run(const char *args, int status, const char *want) {
    char *out = NULL;
    int st = run_moerl(args, 1, &out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    if (st != status || !strstr(out, want))
        tu_report("moerl %s: status %d (want %d), output:\n%s\n(want \"%s\")", args, st, status,
                  out, want);
    CU_ASSERT_EQUAL(st, status);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, want));
    free(out);
}

/* Runs score and checks the JSON's shape; logp (n - 1) receives logprobs[1..]. */
static int run_score(const char *args, int32_t *tok, float *logp, int cap) {
    char *out = NULL;
    int st = run_moerl(args, 0, &out);
    CU_ASSERT_EQUAL(st, 0);
    if (st != 0 || !out) {
        free(out);
        return -1;
    }
    cJSON *j = cJSON_Parse(out);
    free(out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(j);
    cJSON *t = cJSON_GetObjectItem(j, "tokens"), *l = cJSON_GetObjectItem(j, "logprobs");
    cJSON *s = cJSON_GetObjectItem(j, "sum");
    int n = cJSON_GetArraySize(t);
    CU_ASSERT(cJSON_IsArray(t) && cJSON_IsArray(l) && cJSON_IsNumber(s));
    CU_ASSERT_EQUAL(cJSON_GetArraySize(l), n);
    CU_ASSERT(cJSON_IsNull(cJSON_GetArrayItem(l, 0)));
    double sum = 0.0;
    for (int i = 0; i < n && i < cap; i++) {
        tok[i] = (int32_t)cJSON_GetArrayItem(t, i)->valuedouble;
        if (i > 0) {
            cJSON *v = cJSON_GetArrayItem(l, i);
            CU_ASSERT(cJSON_IsNumber(v) && v->valuedouble < 0.0);
            logp[i - 1] = (float)v->valuedouble;
            sum += v->valuedouble;
        }
    }
    CU_ASSERT(fabs(sum - s->valuedouble) <= 1e-9 * fabs(sum));
    cJSON_Delete(j);
    return n;
}

static void test_cli_init_and_score(void) {
    char dir[512], args[2048], adir[700];
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    expect_run("init-model --help", 0, "usage: moerl init-model --arch ARCH");
    expect_run("init-model --help", 0, "deepseek_v3 (DeepseekV3ForCausalLM: MLA attention");
    expect_run("score --help", 0, "usage: moerl score --model DIR");
    expect_run("init-model --arch llama --size tiny --out /nonexistent", 2,
               "unknown architecture 'llama'");
    expect_run("init-model --arch mixtral --size tiny", 2, "--out is required");
    snprintf(args, sizeof args, "init-model --arch qwen3_moe --size tiny --seed 9 --out '%s/m'",
             dir);
    expect_run(args, 0, "Qwen3MoeForCausalLM tiny");
    snprintf(args, sizeof args, "score --model '%s/m' --tokens \"5, 6 7 8\" --text hi", dir);
    expect_run(args, 2, "exactly one of --tokens and --text");
    snprintf(args, sizeof args, "score --model '%s/m' --tokens \"5 6 x\"", dir);
    expect_run(args, 2, "'x' is not a token id");
    snprintf(args, sizeof args, "score --model '%s/m' --tokens \"5 261\"", dir);
    expect_run(args, 1, "token 1 is id 261, outside [0, 261)");
    snprintf(args, sizeof args, "score --model '%s/none' --tokens 1", dir);
    expect_run(args, 1, "none");

    /* Scores equal the library's, with and without an adapter. */
    model_t *m = NULL;
    snprintf(adir, sizeof adir, "%s/m", dir);
    CU_ASSERT_EQUAL_FATAL(model_open(&m, adir, NULL), 0);
    int32_t tok[16], want_tok[4] = {104, 105, 33, 10};
    float cli[16], lib[16], ent[16];
    snprintf(args, sizeof args, "score --model '%s/m' --text 'hi!'", dir);
    CU_ASSERT_EQUAL(run_score(args, tok, cli, 16), 3);
    CU_ASSERT(memcmp(tok, want_tok, sizeof(int32_t) * 3) == 0); /* the bytes of "hi!" */
    snprintf(args, sizeof args, "score --model '%s/m' --tokens \"104 105 33 10\"", dir);
    CU_ASSERT_EQUAL_FATAL(run_score(args, tok, cli, 16), 4);
    int32_t pos[4], tgt[4], cu[2] = {0, 4};
    model_batch_next_token(pos, tgt, want_tok, cu, 1);
    model_batch_t b = {4, 1, want_tok, pos, cu, tgt, 1.0f, NULL, NULL};
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, lib, ent, 0), 0);
    TU_ASSERT_CLOSE(tu_rel_err_ff(cli, lib, 3, 1.0), 1e-6, "score vs library");

    const char *targets[3] = {"q_proj", "v_proj", "experts"};
    lora_config_t lc = {4, 8.0f, 0, 0.0f, 3, 1, targets, 3};
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_new(&ad, &lc, m->modules, m->n_modules), 0);
    rng_fill_uniform(ad->params, ad->n_params, 8, 1, -0.5f, 0.5f);
    snprintf(adir, sizeof adir, "%s/adapter", dir);
    CU_ASSERT_EQUAL_FATAL(peft_save(ad, adir, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, ad), 0);
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, lib + 4, ent, 0), 0);
    snprintf(args, sizeof args, "score --model '%s/m' --adapter '%s' --tokens \"104 105 33 10\"",
             dir, adir);
    CU_ASSERT_EQUAL_FATAL(run_score(args, tok, cli + 4, 12), 4);
    TU_ASSERT_CLOSE(tu_rel_err_ff(cli + 4, lib + 4, 3, 1.0), 1e-6, "score with adapter");
    CU_ASSERT(tu_rel_err_ff(cli + 4, cli, 3, 1.0) > 1e-3); /* the adapter changed the scores */
    snprintf(args, sizeof args, "score --model '%s/m' --adapter '%s/none' --tokens 1", dir, dir);
    expect_run(args, 1, "adapter_config.json");

    lora_adapter_destroy(&ad);
    model_destroy(&m);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"round_trip", test_round_trip},
        {"deterministic_writer", test_deterministic_writer},
        {"deepseek_mla", test_deepseek_mla},
        {"bad_checkpoints", test_bad_checkpoints},
        {"sharded", test_sharded},
        {"cli_init_and_score", test_cli_init_and_score},
        CU_TEST_INFO_NULL,
    };
    return tu_main("init_model", tests);
}
