/* model_config: Hugging Face config.json of the MoE families: parse, validate, write, count. */
#include "actor/model_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

#define CONFIG_MAX_BYTES (16u << 20)
#define BIG ((int64_t)1 << 30)

static const char *const g_arch_names[ARCH_COUNT] = {
    [ARCH_QWEN3_MOE] = "Qwen3MoeForCausalLM",
    [ARCH_MIXTRAL] = "MixtralForCausalLM",
    [ARCH_DEEPSEEK_V3] = "DeepseekV3ForCausalLM",
};

static const char *const g_default_model_type[ARCH_COUNT] = {
    [ARCH_QWEN3_MOE] = "qwen3_moe",
    [ARCH_MIXTRAL] = "mixtral",
    [ARCH_DEEPSEEK_V3] = "deepseek_v3",
};

const char *model_arch_name(model_arch_t a) {
    return (unsigned)a < ARCH_COUNT ? g_arch_names[a] : "?";
}

/* ------------------------------------------------------------------------ */
/* Reading typed fields. Every error names the file, the field and what was  */
/* expected. A JSON null counts as absent.                                   */

typedef struct jin {
    const cJSON *obj;   /* the object fields are read from */
    const char *file;   /* for messages */
    const char *prefix; /* "" or "rope_scaling." ... */
} jin_t;

static const cJSON *jget(const jin_t *j, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j->obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static const char *describe(const cJSON *v, char *buf, size_t cap) {
    if (cJSON_IsNumber(v))
        snprintf(buf, cap, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v))
        snprintf(buf, cap, "the string \"%.40s\"", v->valuestring);
    else if (cJSON_IsBool(v))
        snprintf(buf, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsArray(v))
        snprintf(buf, cap, "an array");
    else if (cJSON_IsObject(v))
        snprintf(buf, cap, "an object");
    else
        snprintf(buf, cap, "null");
    return buf;
}

static int bad_field(const jin_t *j, const char *key, const cJSON *v, const char *expected) {
    char b[96];
    return mo_errorf(MO_ECONFIG, "%s: field \"%s%s\" is %s, expected %s", j->file, j->prefix, key,
                     describe(v, b, sizeof b), expected);
}

static int missing(const jin_t *j, const char *key, const char *expected) {
    return mo_errorf(MO_ECONFIG, "%s: missing required field \"%s%s\" (expected %s)", j->file,
                     j->prefix, key, expected);
}

static int jint64(const jin_t *j, const char *key, int req, int64_t def, int64_t lo, int64_t hi,
                  int64_t *out) {
    char exp[96];
    snprintf(exp, sizeof exp, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    const cJSON *v = jget(j, key);
    if (!v) {
        if (req)
            return missing(j, key, exp);
        *out = def;
        return MO_OK;
    }
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d != floor(d) || d < (double)lo || d > (double)hi)
        return bad_field(j, key, v, exp);
    *out = (int64_t)d;
    return MO_OK;
}

static int jint(const jin_t *j, const char *key, int req, int def, int lo, int hi, int *out) {
    int64_t v;
    TRY(jint64(j, key, req, def, lo, hi, &v));
    *out = (int)v;
    return MO_OK;
}

/* A number in [lo, hi], or (lo, hi] when lo_open. */
static int jnum(const jin_t *j, const char *key, int req, double def, double lo, int lo_open,
                double hi, double *out) {
    char exp[96];
    snprintf(exp, sizeof exp, "a number in %c%g, %g]", lo_open ? '(' : '[', lo, hi);
    const cJSON *v = jget(j, key);
    if (!v) {
        if (req)
            return missing(j, key, exp);
        *out = def;
        return MO_OK;
    }
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || !isfinite(d) || d < lo || (lo_open && d == lo) || d > hi)
        return bad_field(j, key, v, exp);
    *out = d;
    return MO_OK;
}

static int jfloat(const jin_t *j, const char *key, int req, double def, double lo, int lo_open,
                  double hi, float *out) {
    double d;
    TRY(jnum(j, key, req, def, lo, lo_open, hi, &d));
    *out = (float)d;
    return MO_OK;
}

static int jbool(const jin_t *j, const char *key, int def, int *out) {
    const cJSON *v = jget(j, key);
    if (!v) {
        *out = def;
        return MO_OK;
    }
    if (!cJSON_IsBool(v))
        return bad_field(j, key, v, "true or false");
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return MO_OK;
}

/* A string among names (n of them); absent gives def. */
static int jenum(const jin_t *j, const char *key, int def, const char *const *names, int n,
                 int *out) {
    const cJSON *v = jget(j, key);
    if (!v) {
        *out = def;
        return MO_OK;
    }
    char exp[256];
    size_t len = (size_t)snprintf(exp, sizeof exp, "one of");
    for (int i = 0; i < n && len < sizeof exp; i++)
        len += (size_t)snprintf(exp + len, sizeof exp - len, "%s \"%s\"", i ? "," : "", names[i]);
    if (!cJSON_IsString(v))
        return bad_field(j, key, v, exp);
    for (int i = 0; i < n; i++)
        if (strcmp(v->valuestring, names[i]) == 0) {
            *out = i;
            return MO_OK;
        }
    return bad_field(j, key, v, exp);
}

/* Fields whose only supported value is a fixed one (false, 0, "silu"). */
static int jfixed_false(const jin_t *j, const char *key, const char *why) {
    int b;
    TRY(jbool(j, key, 0, &b));
    if (b)
        return mo_errorf(MO_ECONFIG, "%s: field \"%s\" is true, expected false (%s)", j->file, key,
                         why);
    return MO_OK;
}

static int jfixed_zero(const jin_t *j, const char *key, const char *why) {
    const cJSON *v = jget(j, key);
    if (v && (!cJSON_IsNumber(v) || v->valuedouble != 0.0))
        return bad_field(j, key, v, why);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Shared fields.                                                            */

static const char *const g_rope_types[] = {"default", "linear", "llama3", "yarn"};

/* Keys allowed in rope_scaling for each type (besides type / rope_type). */
static int rope_key_allowed(rope_type_t t, const char *k) {
    static const char *const linear[] = {"factor", NULL};
    static const char *const llama3[] = {"factor", "low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings", NULL};
    static const char *const yarn[] = {"factor",           "original_max_position_embeddings",
                                       "beta_fast",        "beta_slow",
                                       "mscale",           "mscale_all_dim",
                                       "attention_factor", NULL};
    static const char *const none[] = {NULL};
    const char *const *set = t == ROPE_LINEAR   ? linear
                             : t == ROPE_LLAMA3 ? llama3
                             : t == ROPE_YARN   ? yarn
                                                : none;
    for (int i = 0; set[i]; i++)
        if (strcmp(set[i], k) == 0)
            return 1;
    return 0;
}

static int rope_type_of(const jin_t *j, rope_type_t *out) {
    int a = -1, b = -1;
    const cJSON *ta = jget(j, "type"), *tb = jget(j, "rope_type");
    if (!ta && !tb)
        return missing(j, "rope_type", "\"default\", \"linear\", \"llama3\" or \"yarn\"");
    if (ta && (!cJSON_IsString(ta) || jenum(j, "type", 0, g_rope_types, 4, &a) < 0))
        return mo_errorf(MO_ECONFIG,
                         "%s: field \"%stype\": rope scaling type '%s' is not supported "
                         "(supported: default, linear, llama3, yarn)",
                         j->file, j->prefix, cJSON_IsString(ta) ? ta->valuestring : "?");
    if (tb && (!cJSON_IsString(tb) || jenum(j, "rope_type", 0, g_rope_types, 4, &b) < 0))
        return mo_errorf(MO_ECONFIG,
                         "%s: field \"%srope_type\": rope scaling type '%s' is not supported "
                         "(supported: default, linear, llama3, yarn)",
                         j->file, j->prefix, cJSON_IsString(tb) ? tb->valuestring : "?");
    if (ta && tb && a != b)
        return mo_errorf(MO_ECONFIG, "%s: \"%stype\" ('%s') and \"%srope_type\" ('%s') disagree",
                         j->file, j->prefix, ta->valuestring, j->prefix, tb->valuestring);
    *out = (rope_type_t)(ta ? a : b);
    return MO_OK;
}

/* rope_scaling (or rope_parameters, which may also carry rope_theta). */
static int parse_rope(const char *file, const cJSON *obj, const char *field, int64_t max_pos,
                      rope_scaling_t *r, double *theta) {
    char prefix[48];
    snprintf(prefix, sizeof prefix, "%s.", field);
    jin_t j = {obj, file, prefix};
    memset(r, 0, sizeof *r);
    if (!cJSON_IsObject(obj)) {
        jin_t top = {NULL, file, ""};
        return bad_field(&top, field, obj, "an object or null");
    }
    TRY(rope_type_of(&j, &r->type));
    const cJSON *k;
    cJSON_ArrayForEach(k, obj) {
        if (strcmp(k->string, "type") == 0 || strcmp(k->string, "rope_type") == 0)
            continue;
        if (theta && strcmp(k->string, "rope_theta") == 0)
            continue;
        if (!rope_key_allowed(r->type, k->string))
            return mo_errorf(MO_ECONFIG, "%s: field \"%s%s\" is not supported for rope type '%s'",
                             file, prefix, k->string, g_rope_types[r->type]);
    }
    if (theta)
        TRY(jnum(&j, "rope_theta", 0, *theta, 1.0, 1, 1e12, theta));
    if (r->type == ROPE_DEFAULT)
        return MO_OK;
    TRY(jfloat(&j, "factor", 1, 0, 0, 1, 1e6, &r->factor));
    int llama3 = r->type == ROPE_LLAMA3, yarn = r->type == ROPE_YARN;
    if (llama3) {
        TRY(jfloat(&j, "low_freq_factor", 1, 0, 0, 1, 1e6, &r->low_freq_factor));
        TRY(jfloat(&j, "high_freq_factor", 1, 0, 0, 1, 1e6, &r->high_freq_factor));
    }
    if (llama3 || yarn)
        TRY(jint(&j, "original_max_position_embeddings", llama3, (int)(max_pos < BIG ? max_pos : 0),
                 1, 1 << 30, &r->original_max_position));
    if (yarn) {
        TRY(jfloat(&j, "beta_fast", 0, 32, 0, 0, 1e6, &r->beta_fast));
        TRY(jfloat(&j, "beta_slow", 0, 1, 0, 0, 1e6, &r->beta_slow));
        TRY(jfloat(&j, "mscale", 0, 0, 0, 0, 1e6, &r->mscale));
        TRY(jfloat(&j, "mscale_all_dim", 0, 0, 0, 0, 1e6, &r->mscale_all_dim));
        TRY(jfloat(&j, "attention_factor", 0, 0, 0, 0, 1e6, &r->attention_factor));
    }
    return MO_OK;
}

static int parse_rope_fields(const jin_t *j, model_config_t *c) {
    const cJSON *rs = jget(j, "rope_scaling"), *rp = jget(j, "rope_parameters");
    if (rs && rp)
        return mo_errorf(MO_ECONFIG,
                         "%s: both \"rope_scaling\" and \"rope_parameters\" are set; "
                         "expected one",
                         j->file);
    if (rs)
        return parse_rope(j->file, rs, "rope_scaling", c->max_position_embeddings, &c->rope_scaling,
                          NULL);
    if (rp) {
        double top = c->rope_theta;
        TRY(parse_rope(j->file, rp, "rope_parameters", c->max_position_embeddings, &c->rope_scaling,
                       &c->rope_theta));
        if (jget(j, "rope_theta") && c->rope_theta != top)
            return mo_errorf(MO_ECONFIG,
                             "%s: \"rope_theta\" (%g) and \"rope_parameters.rope_theta\" "
                             "(%g) disagree",
                             j->file, top, c->rope_theta);
        return MO_OK;
    }
    memset(&c->rope_scaling, 0, sizeof c->rope_scaling);
    return MO_OK;
}

/* bos/eos/pad: null, an integer, or a list of integers, each in [0, V). */
static int parse_token_ids(const jin_t *j, const char *key, int64_t vocab, int32_t *ids, int *n) {
    const cJSON *v = jget(j, key);
    char exp[128];
    snprintf(exp, sizeof exp, "null, an integer in [0, %lld) or a list of up to %d of them",
             (long long)vocab, MODEL_MAX_TOKEN_IDS);
    *n = 0;
    if (!v)
        return MO_OK;
    if (cJSON_IsNumber(v)) {
        double d = v->valuedouble;
        if (d != floor(d) || d < 0 || d >= (double)vocab)
            return bad_field(j, key, v, exp);
        ids[(*n)++] = (int32_t)d;
        return MO_OK;
    }
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) > MODEL_MAX_TOKEN_IDS)
        return bad_field(j, key, v, exp);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || d != floor(d) || d < 0 || d >= (double)vocab) {
            char b[64];
            return mo_errorf(MO_ECONFIG, "%s: field \"%s\" holds %s, expected %s", j->file, key,
                             describe(e, b, sizeof b), exp);
        }
        ids[(*n)++] = (int32_t)d;
    }
    return MO_OK;
}

static int parse_dtype(const jin_t *j, model_config_t *c) {
    static const char *const names[] = {"bfloat16", "float16", "float32"};
    static const dtype_t dts[] = {DT_BF16, DT_F16, DT_F32};
    int a = 0, b = 0;
    TRY(jenum(j, "torch_dtype", 0, names, 3, &a));
    TRY(jenum(j, "dtype", a, names, 3, &b));
    if (jget(j, "torch_dtype") && jget(j, "dtype") && a != b)
        return mo_errorf(MO_ECONFIG, "%s: \"torch_dtype\" ('%s') and \"dtype\" ('%s') disagree",
                         j->file, names[a], names[b]);
    c->torch_dtype = dts[b];
    return MO_OK;
}

/* quantization_config: only DeepSeek-style fp8 with square weight blocks. */
static int parse_quant(const jin_t *top, model_config_t *c) {
    const cJSON *q = jget(top, "quantization_config");
    c->fp8_block = 0;
    if (!q)
        return MO_OK;
    if (!cJSON_IsObject(q))
        return bad_field(top, "quantization_config", q, "an object or null");
    jin_t j = {q, top->file, "quantization_config."};
    static const char *const allowed[] = {"quant_method",           "fmt",
                                          "activation_scheme",      "weight_block_size",
                                          "modules_to_not_convert", NULL};
    const cJSON *k;
    cJSON_ArrayForEach(k, q) {
        int ok = 0;
        for (int i = 0; allowed[i]; i++)
            ok |= strcmp(k->string, allowed[i]) == 0;
        if (!ok)
            return mo_errorf(MO_ECONFIG, "%s: field \"quantization_config.%s\" is not supported",
                             top->file, k->string);
    }
    static const char *const fp8[] = {"fp8"}, *const e4m3[] = {"e4m3"}, *const dyn[] = {"dynamic"};
    int dummy;
    if (!jget(&j, "quant_method"))
        return missing(&j, "quant_method", "\"fp8\"");
    TRY(jenum(&j, "quant_method", 0, fp8, 1, &dummy));
    TRY(jenum(&j, "fmt", 0, e4m3, 1, &dummy));
    TRY(jenum(&j, "activation_scheme", 0, dyn, 1, &dummy));
    const cJSON *bs = jget(&j, "weight_block_size");
    const char *exp = "[b, b] with one integer b in [1, 65536] (square blocks)";
    if (!bs)
        return missing(&j, "weight_block_size", exp);
    const cJSON *b0 = cJSON_GetArrayItem(bs, 0), *b1 = cJSON_GetArrayItem(bs, 1);
    if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 || !cJSON_IsNumber(b0) ||
        !cJSON_IsNumber(b1) || b0->valuedouble != b1->valuedouble || b0->valuedouble < 1 ||
        b0->valuedouble > 65536 || b0->valuedouble != floor(b0->valuedouble))
        return bad_field(&j, "weight_block_size", bs, exp);
    c->fp8_block = (int)b0->valuedouble;
    return MO_OK;
}

/* Fields every family reads the same way. */
static int parse_common(const jin_t *j, model_config_t *c, double eps_def, double theta_def,
                        int64_t maxpos_def) {
    TRY(jint64(j, "vocab_size", 1, 0, 1, INT32_MAX, &c->vocab_size));
    TRY(jint(j, "hidden_size", 1, 0, 1, 1 << 20, &c->hidden_size));
    TRY(jint(j, "num_hidden_layers", 1, 0, 1, MODEL_MAX_LAYERS, &c->num_hidden_layers));
    TRY(jint(j, "num_attention_heads", 1, 0, 1, 1 << 16, &c->num_attention_heads));
    TRY(jint(j, "num_key_value_heads", 0, c->num_attention_heads, 1, 1 << 16,
             &c->num_key_value_heads));
    TRY(jnum(j, "rms_norm_eps", 0, eps_def, 0, 1, 1, &c->rms_norm_eps));
    TRY(jnum(j, "rope_theta", 0, theta_def, 1, 1, 1e12, &c->rope_theta));
    TRY(jint64(j, "max_position_embeddings", 0, maxpos_def, 1, (int64_t)1 << 40,
               &c->max_position_embeddings));
    TRY(parse_rope_fields(j, c));
    TRY(jbool(j, "tie_word_embeddings", 0, &c->tie_word_embeddings));
    TRY(jbool(j, "output_router_logits", 0, &c->output_router_logits));
    static const char *const silu[] = {"silu"};
    int act;
    TRY(jenum(j, "hidden_act", 0, silu, 1, &act));
    TRY(jfixed_false(j, "attention_bias", "biased attention projections are not supported"));
    TRY(jfixed_false(j, "mlp_bias", "biased MLP projections are not supported"));
    TRY(jfixed_zero(j, "attention_dropout", "0 (dropout is not supported)"));
    TRY(jfixed_zero(j, "router_jitter_noise", "0 (router jitter is not supported)"));
    const cJSON *tp = jget(j, "pretraining_tp");
    if (tp && (!cJSON_IsNumber(tp) || tp->valuedouble != 1))
        return bad_field(j, "pretraining_tp", tp, "1");
    TRY(parse_dtype(j, c));
    TRY(parse_quant(j, c));
    TRY(parse_token_ids(j, "bos_token_id", c->vocab_size, c->bos_token_id, &c->n_bos));
    TRY(parse_token_ids(j, "eos_token_id", c->vocab_size, c->eos_token_id, &c->n_eos));
    TRY(parse_token_ids(j, "pad_token_id", c->vocab_size, c->pad_token_id, &c->n_pad));
    return MO_OK;
}

/* head_dim: explicit, or D / H when absent. */
static int parse_head_dim(const jin_t *j, model_config_t *c) {
    if (!jget(j, "head_dim") && c->hidden_size % c->num_attention_heads != 0)
        return mo_errorf(MO_ECONFIG,
                         "%s: hidden_size %d is not a multiple of num_attention_heads %d and "
                         "\"head_dim\" is absent; expected an explicit head_dim",
                         j->file, c->hidden_size, c->num_attention_heads);
    return jint(j, "head_dim", 0, c->hidden_size / c->num_attention_heads, 2, 1 << 16,
                &c->head_dim);
}

static int parse_sliding(const jin_t *j, model_config_t *c) {
    return jint(j, "sliding_window", 0, 0, 1, 1 << 30, &c->sliding_window);
}

/* ------------------------------------------------------------------------ */
/* Families.                                                                 */

static int parse_layer_list(const jin_t *j, const char *key, model_config_t *c) {
    const cJSON *v = jget(j, key);
    memset(c->mlp_only_layers, 0, sizeof c->mlp_only_layers);
    if (!v)
        return MO_OK;
    char exp[96];
    snprintf(exp, sizeof exp, "a list of distinct layer indices in [0, %d)", c->num_hidden_layers);
    if (!cJSON_IsArray(v))
        return bad_field(j, key, v, exp);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || d != floor(d) || d < 0 || d >= c->num_hidden_layers ||
            c->mlp_only_layers[(int)d]) {
            char b[64];
            return mo_errorf(MO_ECONFIG, "%s: field \"%s\" holds %s, expected %s", j->file, key,
                             describe(e, b, sizeof b), exp);
        }
        c->mlp_only_layers[(int)d] = 1;
    }
    return MO_OK;
}

static int parse_layer_types(const jin_t *j, model_config_t *c) {
    const cJSON *v = jget(j, "layer_types");
    memset(c->layer_types_sliding, 0, sizeof c->layer_types_sliding);
    c->has_layer_types = v != NULL;
    if (!v)
        return MO_OK;
    char exp[128];
    snprintf(exp, sizeof exp, "a list of %d \"full_attention\" or \"sliding_attention\"",
             c->num_hidden_layers);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != c->num_hidden_layers)
        return bad_field(j, "layer_types", v, exp);
    int l = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        int full = cJSON_IsString(e) && strcmp(e->valuestring, "full_attention") == 0;
        int slide = cJSON_IsString(e) && strcmp(e->valuestring, "sliding_attention") == 0;
        if (!full && !slide) {
            char b[96];
            return mo_errorf(MO_ECONFIG, "%s: field \"layer_types\"[%d] is %s, expected %s",
                             j->file, l, describe(e, b, sizeof b), exp);
        }
        c->layer_types_sliding[l++] = (unsigned char)slide;
    }
    return MO_OK;
}

static int parse_qwen3(const jin_t *j, model_config_t *c) {
    TRY(parse_common(j, c, 1e-6, 10000.0, 32768));
    TRY(parse_head_dim(j, c));
    TRY(jint(j, "intermediate_size", 1, 0, 1, 1 << 24, &c->intermediate_size));
    TRY(jint(j, "moe_intermediate_size", 1, 0, 1, 1 << 24, &c->moe_intermediate_size));
    TRY(jint(j, "num_experts", 1, 0, 1, 1 << 16, &c->num_experts));
    TRY(jint(j, "num_experts_per_tok", 1, 0, 1, 1 << 16, &c->num_experts_per_tok));
    TRY(jbool(j, "norm_topk_prob", 0, &c->norm_topk_prob));
    TRY(jint(j, "decoder_sparse_step", 0, 1, 1, MODEL_MAX_LAYERS, &c->decoder_sparse_step));
    TRY(parse_layer_list(j, "mlp_only_layers", c));
    TRY(parse_sliding(j, c));
    TRY(jbool(j, "use_sliding_window", 0, &c->use_sliding_window));
    TRY(jint(j, "max_window_layers", 0, 28, 0, 1 << 30, &c->max_window_layers));
    TRY(parse_layer_types(j, c));
    TRY(jnum(j, "router_aux_loss_coef", 0, 0.001, 0, 0, 1e6, &c->router_aux_loss_coef));
    return MO_OK;
}

static int parse_mixtral(const jin_t *j, model_config_t *c) {
    TRY(parse_common(j, c, 1e-5, 1e6, 4096 * 32));
    TRY(parse_head_dim(j, c));
    TRY(jint(j, "intermediate_size", 1, 0, 1, 1 << 24, &c->intermediate_size));
    c->moe_intermediate_size = c->intermediate_size;
    TRY(jint(j, "num_local_experts", 1, 0, 1, 1 << 16, &c->num_experts));
    TRY(jint(j, "num_experts_per_tok", 1, 0, 1, 1 << 16, &c->num_experts_per_tok));
    c->norm_topk_prob = 1;
    TRY(parse_sliding(j, c));
    TRY(jnum(j, "router_aux_loss_coef", 0, 0.001, 0, 0, 1e6, &c->router_aux_loss_coef));
    return MO_OK;
}

static int parse_mla(const jin_t *j, model_config_t *c) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(j->obj, "q_lora_rank");
    if (!q)
        return missing(j, "q_lora_rank", "an integer in [1, 65536] or null");
    TRY(jint(j, "q_lora_rank", 0, 0, 1, 1 << 16, &c->q_lora_rank));
    TRY(jint(j, "kv_lora_rank", 1, 0, 1, 1 << 16, &c->kv_lora_rank));
    TRY(jint(j, "qk_nope_head_dim", 1, 0, 0, 1 << 16, &c->qk_nope_head_dim));
    TRY(jint(j, "qk_rope_head_dim", 1, 0, 2, 1 << 16, &c->qk_rope_head_dim));
    TRY(jint(j, "v_head_dim", 1, 0, 1, 1 << 16, &c->v_head_dim));
    c->head_dim = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const cJSON *hd = jget(j, "head_dim");
    if (hd && (!cJSON_IsNumber(hd) ||
               (hd->valuedouble != c->qk_rope_head_dim && hd->valuedouble != c->head_dim))) {
        char exp[96];
        snprintf(exp, sizeof exp, "%d (qk_rope_head_dim) or %d (qk_nope + qk_rope) for MLA",
                 c->qk_rope_head_dim, c->head_dim);
        return bad_field(j, "head_dim", hd, exp);
    }
    if (c->num_key_value_heads != c->num_attention_heads)
        return mo_errorf(MO_ECONFIG,
                         "%s: field \"num_key_value_heads\" is %d, expected %d "
                         "(num_attention_heads; MLA has no kv-head grouping)",
                         j->file, c->num_key_value_heads, c->num_attention_heads);
    return MO_OK;
}

static int parse_deepseek(const jin_t *j, model_config_t *c) {
    static const char *const scores[] = {"softmax", "sigmoid"};
    static const char *const methods[] = {"greedy", "group_limited_greedy", "noaux_tc"};
    TRY(parse_common(j, c, 1e-6, 10000.0, 4096));
    TRY(parse_mla(j, c));
    TRY(jint(j, "intermediate_size", 1, 0, 1, 1 << 24, &c->intermediate_size));
    TRY(jint(j, "moe_intermediate_size", 1, 0, 1, 1 << 24, &c->moe_intermediate_size));
    TRY(jint(j, "n_routed_experts", 1, 0, 1, 1 << 16, &c->num_experts));
    TRY(jint(j, "num_experts_per_tok", 1, 0, 1, 1 << 16, &c->num_experts_per_tok));
    int has_shared = cJSON_GetObjectItemCaseSensitive(j->obj, "n_shared_experts") != NULL;
    TRY(jint(j, "n_shared_experts", 0, has_shared ? 0 : 1, 0, 1 << 10, &c->n_shared_experts));
    TRY(jint(j, "first_k_dense_replace", 0, 3, 0, MODEL_MAX_LAYERS, &c->first_k_dense_replace));
    TRY(jint(j, "moe_layer_freq", 0, 1, 1, MODEL_MAX_LAYERS, &c->moe_layer_freq));
    TRY(jnum(j, "routed_scaling_factor", 0, 2.5, 0, 1, 1e6, &c->routed_scaling_factor));
    int sf = 0, tm = 0;
    TRY(jenum(j, "scoring_func", 1, scores, 2, &sf));
    TRY(jenum(j, "topk_method", 2, methods, 3, &tm));
    c->scoring_func = (score_func_t)sf;
    c->topk_method = (topk_method_t)tm;
    TRY(jint(j, "n_group", 0, 8, 1, 1 << 16, &c->n_group));
    TRY(jint(j, "topk_group", 0, 4, 1, 1 << 16, &c->topk_group));
    TRY(jbool(j, "norm_topk_prob", 1, &c->norm_topk_prob));
    TRY(jbool(j, "rope_interleave", 1, &c->rope_interleave));
    TRY(jint(j, "num_nextn_predict_layers", 0, 0, 0, 1 << 10, &c->num_nextn_predict_layers));
    TRY(jnum(j, "aux_loss_alpha", 0, 0.001, 0, 0, 1e6, &c->router_aux_loss_coef));
    const cJSON *sw = jget(j, "sliding_window");
    if (sw)
        return bad_field(j, "sliding_window", sw, "null (no sliding window in this family)");
    return MO_OK;
}

/* Defaults that make family-specific fields inert. */
static void config_defaults(model_config_t *c) {
    memset(c, 0, sizeof *c);
    c->decoder_sparse_step = 1;
    c->moe_layer_freq = 1;
    c->routed_scaling_factor = 1.0;
    c->scoring_func = SCORE_SOFTMAX;
    c->topk_method = TOPK_GREEDY;
    c->n_group = 1;
    c->topk_group = 1;
    c->torch_dtype = DT_BF16;
}

/* architectures (one supported entry) and model_type, which must agree. */
static int parse_arch(const jin_t *j, model_config_t *c) {
    static const struct {
        const char *type;
        model_arch_t arch;
    } types[] = {{"qwen3_moe", ARCH_QWEN3_MOE},
                 {"mixtral", ARCH_MIXTRAL},
                 {"deepseek_v3", ARCH_DEEPSEEK_V3},
                 {"kimi_k2", ARCH_DEEPSEEK_V3}};
    const char *sup = "Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM";
    const cJSON *a = jget(j, "architectures"), *mt = jget(j, "model_type");
    if (mt && (!cJSON_IsString(mt) || strlen(mt->valuestring) >= sizeof c->model_type))
        return bad_field(j, "model_type", mt, "a string of at most 31 characters");
    int from_type = -1;
    for (size_t i = 0; mt && i < sizeof types / sizeof types[0]; i++)
        if (strcmp(mt->valuestring, types[i].type) == 0)
            from_type = (int)types[i].arch;
    if (!a && from_type < 0)
        return mo_errorf(MO_ECONFIG,
                         "%s: missing required field \"architectures\" (expected a "
                         "list holding one of %s)",
                         j->file, sup);
    int arch = from_type;
    if (a) {
        const cJSON *e = cJSON_GetArrayItem(a, 0);
        if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != 1 || !cJSON_IsString(e))
            return bad_field(j, "architectures", a, "a list of one architecture name");
        arch = -1;
        for (int i = 0; i < ARCH_COUNT; i++)
            if (strcmp(e->valuestring, g_arch_names[i]) == 0)
                arch = i;
        if (arch < 0 && strcmp(e->valuestring, "Qwen2MoeForCausalLM") == 0)
            return mo_errorf(MO_ECONFIG,
                             "%s: field \"architectures\": Qwen2MoeForCausalLM is not "
                             "supported (its q/k/v projections carry biases and its shared expert "
                             "has a sigmoid gate); supported: %s",
                             j->file, sup);
        if (arch < 0)
            return mo_errorf(MO_ECONFIG,
                             "%s: field \"architectures\": '%s' is not supported "
                             "(supported: %s)",
                             j->file, e->valuestring, sup);
        if (from_type >= 0 && from_type != arch)
            return mo_errorf(MO_ECONFIG,
                             "%s: field \"model_type\" '%s' does not match "
                             "architecture %s",
                             j->file, mt->valuestring, e->valuestring);
    }
    c->arch = (model_arch_t)arch;
    snprintf(c->model_type, sizeof c->model_type, "%s",
             mt ? mt->valuestring : g_default_model_type[arch]);
    return MO_OK;
}

int model_config_parse_json(model_config_t *c, const char *json_text, const char *display_name) {
    const char *file = display_name ? display_name : "config.json";
    config_defaults(c);
    cJSON *root = cJSON_Parse(json_text);
    if (!root)
        return mo_errorf(MO_ECONFIG, "%s: not valid JSON (error near byte %td)", file,
                         cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json_text : (ptrdiff_t)0);
    jin_t j = {root, file, ""};
    int rc = cJSON_IsObject(root) ? MO_OK : mo_errorf(MO_ECONFIG, "%s: not a JSON object", file);
    if (rc == MO_OK)
        rc = parse_arch(&j, c);
    if (rc == MO_OK) {
        switch (c->arch) {
        case ARCH_QWEN3_MOE: rc = parse_qwen3(&j, c); break;
        case ARCH_MIXTRAL: rc = parse_mixtral(&j, c); break;
        default: rc = parse_deepseek(&j, c); break;
        }
    }
    cJSON_Delete(root);
    if (rc == MO_OK)
        rc = model_config_validate(c, file);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Validation.                                                               */

#define CFGERR(...) mo_errorf(MO_ECONFIG, __VA_ARGS__)

static int validate_routing(const model_config_t *c, const char *f) {
    int E = c->num_experts, K = c->num_experts_per_tok;
    if (E < 1 || K < 1 || K > E)
        return CFGERR("%s: num_experts_per_tok %d is out of range, expected 1..%d (the number "
                      "of experts)",
                      f, K, E);
    if (c->n_group < 1 || E % c->n_group != 0)
        return CFGERR("%s: n_group %d does not divide the %d experts", f, c->n_group, E);
    if (c->topk_group < 1 || c->topk_group > c->n_group)
        return CFGERR("%s: topk_group %d is out of range, expected 1..%d (n_group)", f,
                      c->topk_group, c->n_group);
    if (c->topk_method != TOPK_GREEDY && K > c->topk_group * (E / c->n_group))
        return CFGERR("%s: num_experts_per_tok %d exceeds the %d experts of the topk_group %d "
                      "groups kept",
                      f, K, c->topk_group * (E / c->n_group), c->topk_group);
    if (c->topk_method == TOPK_NOAUX_TC && E / c->n_group < 2)
        return CFGERR("%s: topk_method \"noaux_tc\" scores groups by their top-2 experts but "
                      "groups hold %d",
                      f, E / c->n_group);
    if ((c->topk_method == TOPK_NOAUX_TC) != (c->scoring_func == SCORE_SIGMOID))
        return CFGERR("%s: scoring_func \"%s\" with topk_method \"%s\" is not supported "
                      "(expected sigmoid with noaux_tc, or softmax with greedy or "
                      "group_limited_greedy)",
                      f, c->scoring_func == SCORE_SIGMOID ? "sigmoid" : "softmax",
                      c->topk_method == TOPK_GREEDY                 ? "greedy"
                      : c->topk_method == TOPK_GROUP_LIMITED_GREEDY ? "group_limited_greedy"
                                                                    : "noaux_tc");
    if (c->arch != ARCH_DEEPSEEK_V3 &&
        (c->topk_method != TOPK_GREEDY || c->n_group != 1 || c->n_shared_experts != 0))
        return CFGERR("%s: grouped routing and shared experts belong to DeepseekV3ForCausalLM", f);
    if (!(c->routed_scaling_factor > 0))
        return CFGERR("%s: routed_scaling_factor %g must be > 0", f, c->routed_scaling_factor);
    return MO_OK;
}

static int validate_layers(const model_config_t *c, const char *f) {
    int L = c->num_hidden_layers, dense = 0;
    if (L < 1 || L > MODEL_MAX_LAYERS)
        return CFGERR("%s: num_hidden_layers %d is out of range, expected 1..%d", f, L,
                      MODEL_MAX_LAYERS);
    if (c->decoder_sparse_step < 1 || c->moe_layer_freq < 1)
        return CFGERR("%s: decoder_sparse_step and moe_layer_freq must be >= 1", f);
    if (c->first_k_dense_replace < 0 || c->first_k_dense_replace > L)
        return CFGERR("%s: first_k_dense_replace %d is out of range, expected 0..%d", f,
                      c->first_k_dense_replace, L);
    for (int l = L; l < MODEL_MAX_LAYERS; l++)
        if (c->mlp_only_layers[l] || c->layer_types_sliding[l])
            return CFGERR("%s: per-layer flags set beyond num_hidden_layers %d", f, L);
    for (int l = 0; l < L; l++) {
        if (c->arch != ARCH_QWEN3_MOE && (c->mlp_only_layers[l] || c->layer_types_sliding[l]))
            return CFGERR("%s: mlp_only_layers and layer_types belong to Qwen3MoeForCausalLM", f);
        dense += !model_config_is_moe_layer(c, l);
    }
    if (dense > 0 && c->intermediate_size < 1)
        return CFGERR("%s: %d dense layers need intermediate_size >= 1", f, dense);
    if (c->moe_intermediate_size < 1 || c->hidden_size < 1 || c->vocab_size < 1)
        return CFGERR("%s: hidden_size, vocab_size and moe_intermediate_size must be >= 1", f);
    if (c->sliding_window < 0 || (c->use_sliding_window && c->sliding_window == 0))
        return CFGERR("%s: use_sliding_window is true but sliding_window is not set", f);
    if (c->arch == ARCH_DEEPSEEK_V3 && c->sliding_window != 0)
        return CFGERR("%s: sliding_window is not part of DeepseekV3ForCausalLM", f);
    return MO_OK;
}

static int validate_attention(const model_config_t *c, const char *f) {
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads;
    if (H < 1 || Hkv < 1 || Hkv > H || H % Hkv != 0)
        return CFGERR("%s: num_attention_heads %d is not a multiple of num_key_value_heads %d", f,
                      H, Hkv);
    int rot = c->head_dim;
    if (c->arch == ARCH_DEEPSEEK_V3) {
        if (c->kv_lora_rank < 1 || c->v_head_dim < 1 || c->qk_nope_head_dim < 0 ||
            c->q_lora_rank < 0 || c->head_dim != c->qk_nope_head_dim + c->qk_rope_head_dim)
            return CFGERR("%s: MLA dimensions are inconsistent", f);
        if (Hkv != H)
            return CFGERR("%s: num_key_value_heads %d must equal num_attention_heads %d for MLA", f,
                          Hkv, H);
        rot = c->qk_rope_head_dim;
    }
    if (rot < 2 || rot % 2 != 0)
        return CFGERR("%s: the rotary dimension %d (%s) must be even and >= 2", f, rot,
                      c->arch == ARCH_DEEPSEEK_V3 ? "qk_rope_head_dim" : "head_dim");
    float *inv = malloc(sizeof(float) * (size_t)(rot / 2));
    if (!inv)
        return mo_errorf(MO_ENOMEM, "out of memory");
    float ms;
    int rc = rope_init(inv, &ms, rot, (float)c->rope_theta, &c->rope_scaling);
    free(inv);
    if (rc < 0)
        return mo_error_wrap(MO_ECONFIG, "%s", f);
    if (!(c->rms_norm_eps > 0) || !(c->rope_theta > 1) || c->max_position_embeddings < 1)
        return CFGERR("%s: rms_norm_eps, rope_theta or max_position_embeddings out of range", f);
    return MO_OK;
}

static int validate_ids(const model_config_t *c, const char *f) {
    const int32_t *ids[3] = {c->bos_token_id, c->eos_token_id, c->pad_token_id};
    const int ns[3] = {c->n_bos, c->n_eos, c->n_pad};
    for (int k = 0; k < 3; k++) {
        if (ns[k] < 0 || ns[k] > MODEL_MAX_TOKEN_IDS)
            return CFGERR("%s: too many special token ids", f);
        for (int i = 0; i < ns[k]; i++)
            if (ids[k][i] < 0 || ids[k][i] >= c->vocab_size)
                return CFGERR("%s: special token id %d is outside the vocabulary (%lld)", f,
                              ids[k][i], (long long)c->vocab_size);
    }
    if (c->torch_dtype != DT_BF16 && c->torch_dtype != DT_F16 && c->torch_dtype != DT_F32)
        return CFGERR("%s: torch_dtype must be bfloat16, float16 or float32", f);
    if (c->fp8_block < 0)
        return CFGERR("%s: fp8 block size %d must be >= 0", f, c->fp8_block);
    return MO_OK;
}

int model_config_validate(const model_config_t *c, const char *display_name) {
    const char *f = display_name ? display_name : "model config";
    if ((unsigned)c->arch >= ARCH_COUNT)
        return CFGERR("%s: unknown architecture %d", f, (int)c->arch);
    TRY(validate_attention(c, f));
    TRY(validate_layers(c, f));
    TRY(validate_routing(c, f));
    return validate_ids(c, f);
}

/* ------------------------------------------------------------------------ */
/* Layer rules and parameter counts.                                         */

int model_config_is_moe_layer(const model_config_t *c, int l) {
    if (l < 0 || l >= c->num_hidden_layers)
        return 0;
    switch (c->arch) {
    case ARCH_QWEN3_MOE: return !c->mlp_only_layers[l] && (l + 1) % c->decoder_sparse_step == 0;
    case ARCH_DEEPSEEK_V3: return l >= c->first_k_dense_replace && l % c->moe_layer_freq == 0;
    default: return 1;
    }
}

int model_config_window(const model_config_t *c, int l) {
    if (l < 0 || l >= c->num_hidden_layers || c->sliding_window <= 0)
        return 0;
    switch (c->arch) {
    case ARCH_MIXTRAL: return c->sliding_window;
    case ARCH_QWEN3_MOE: {
        int slide = c->has_layer_types ? c->layer_types_sliding[l] : l >= c->max_window_layers;
        return c->use_sliding_window && slide ? c->sliding_window : 0;
    }
    default: return 0;
    }
}

static int64_t attention_params(const model_config_t *c) {
    int64_t D = c->hidden_size, H = c->num_attention_heads;
    if (c->arch != ARCH_DEEPSEEK_V3) {
        int64_t Hkv = c->num_key_value_heads, Dh = c->head_dim;
        int64_t p = D * H * Dh + 2 * D * Hkv * Dh + H * Dh * D; /* q, k, v, o */
        if (c->arch == ARCH_QWEN3_MOE)
            p += 2 * Dh; /* q_norm, k_norm */
        return p;
    }
    int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim, r = c->kv_lora_rank;
    int64_t p = c->q_lora_rank > 0
                    ? D * c->q_lora_rank + c->q_lora_rank + (int64_t)c->q_lora_rank * H * qk
                    : D * H * qk;                       /* q_a, q_a_layernorm, q_b | q_proj */
    p += D * (r + c->qk_rope_head_dim) + r;             /* kv_a_proj_with_mqa, kv_a_layernorm */
    p += r * H * (c->qk_nope_head_dim + c->v_head_dim); /* kv_b_proj */
    p += H * c->v_head_dim * D;                         /* o_proj */
    return p;
}

void model_config_param_counts(const model_config_t *c, int64_t *total, int64_t *active) {
    int64_t D = c->hidden_size, V = c->vocab_size, E = c->num_experts;
    int64_t expert = 3 * D * c->moe_intermediate_size; /* gate, up, down */
    int64_t dense = 3 * D * c->intermediate_size;
    int64_t shared = c->n_shared_experts * expert;
    int64_t router = E * D + (c->topk_method == TOPK_NOAUX_TC ? E : 0); /* gate (+ bias) */
    int64_t fixed = V * D + D + (c->tie_word_embeddings ? 0 : V * D);   /* embed, norm, lm_head */
    int64_t t = fixed, a = fixed;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int64_t base = attention_params(c) + 2 * D; /* + input and post-attention norms */
        t += base;
        a += base;
        if (model_config_is_moe_layer(c, l)) {
            t += router + shared + E * expert;
            a += router + shared + c->num_experts_per_tok * expert;
        } else {
            t += dense;
            a += dense;
        }
    }
    *total = t;
    *active = a;
}

/* ------------------------------------------------------------------------ */
/* Writing.                                                                  */

typedef struct jout {
    cJSON *obj;
    int oom;
} jout_t;

static void put(jout_t *o, const char *key, cJSON *item) {
    if (!item || !cJSON_AddItemToObject(o->obj, key, item)) {
        cJSON_Delete(item);
        o->oom = 1;
    }
}

static void put_int(jout_t *o, const char *key, int64_t v) {
    char b[32];
    snprintf(b, sizeof b, "%lld", (long long)v);
    put(o, key, cJSON_CreateRaw(b));
}

/* The shortest decimal that reads back as the same value, with ".0" on
 * integral values as Python prints floats. */
static void fmt_real(char *b, size_t cap, double v, int is_float) {
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(b, cap, "%.1f", v);
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(b, cap, "%.*g", p, v);
        double back = strtod(b, NULL);
        if (is_float ? (float)back == (float)v : back == v)
            break;
    }
    if (!strpbrk(b, ".eEn"))
        strncat(b, ".0", cap - strlen(b) - 1);
}

static void put_real(jout_t *o, const char *key, double v) {
    char b[40];
    fmt_real(b, sizeof b, v, 0);
    put(o, key, cJSON_CreateRaw(b));
}

static void put_float(jout_t *o, const char *key, float v) {
    char b[40];
    fmt_real(b, sizeof b, v, 1);
    put(o, key, cJSON_CreateRaw(b));
}

static void put_bool(jout_t *o, const char *key, int v) {
    put(o, key, cJSON_CreateBool(v));
}
static void put_str(jout_t *o, const char *key, const char *s) {
    put(o, key, cJSON_CreateString(s));
}
static void put_null(jout_t *o, const char *key) {
    put(o, key, cJSON_CreateNull());
}

static void put_int_or_null(jout_t *o, const char *key, int v) {
    if (v > 0)
        put_int(o, key, v);
    else
        put_null(o, key);
}

static void put_ids(jout_t *o, const char *key, const int32_t *ids, int n) {
    if (n == 0) {
        put_null(o, key);
    } else if (n == 1) {
        put_int(o, key, ids[0]);
    } else {
        cJSON *a = cJSON_CreateIntArray(ids, n);
        put(o, key, a);
    }
}

static void put_rope(jout_t *o, const model_config_t *c, const char *type_key) {
    const rope_scaling_t *r = &c->rope_scaling;
    if (r->type == ROPE_DEFAULT) {
        put_null(o, "rope_scaling");
        return;
    }
    jout_t s = {cJSON_CreateObject(), 0};
    if (!s.obj) {
        o->oom = 1;
        return;
    }
    put_str(&s, type_key, g_rope_types[r->type]);
    put_float(&s, "factor", r->factor);
    if (r->type == ROPE_LLAMA3) {
        put_float(&s, "low_freq_factor", r->low_freq_factor);
        put_float(&s, "high_freq_factor", r->high_freq_factor);
    }
    if (r->type != ROPE_LINEAR)
        put_int(&s, "original_max_position_embeddings", r->original_max_position);
    if (r->type == ROPE_YARN) {
        put_float(&s, "beta_fast", r->beta_fast);
        put_float(&s, "beta_slow", r->beta_slow);
        if (r->mscale != 0)
            put_float(&s, "mscale", r->mscale);
        if (r->mscale_all_dim != 0)
            put_float(&s, "mscale_all_dim", r->mscale_all_dim);
        if (r->attention_factor != 0)
            put_float(&s, "attention_factor", r->attention_factor);
    }
    o->oom |= s.oom;
    put(o, "rope_scaling", s.obj);
}

static void put_quant(jout_t *o, const model_config_t *c) {
    if (c->fp8_block <= 0)
        return;
    jout_t q = {cJSON_CreateObject(), 0};
    if (!q.obj) {
        o->oom = 1;
        return;
    }
    put_str(&q, "activation_scheme", "dynamic");
    put_str(&q, "fmt", "e4m3");
    put_str(&q, "quant_method", "fp8");
    int bs[2] = {c->fp8_block, c->fp8_block};
    put(&q, "weight_block_size", cJSON_CreateIntArray(bs, 2));
    o->oom |= q.oom;
    put(o, "quantization_config", q.obj);
}

static const char *dtype_torch_name(dtype_t dt) {
    return dt == DT_F16 ? "float16" : dt == DT_F32 ? "float32" : "bfloat16";
}

static void put_head(jout_t *o, const model_config_t *c) {
    cJSON *a = cJSON_CreateArray();
    if (!a || !cJSON_AddItemToArray(a, cJSON_CreateString(g_arch_names[c->arch])))
        o->oom = 1;
    put(o, "architectures", a);
}

static void put_tail(jout_t *o, const model_config_t *c) {
    put_bool(o, "tie_word_embeddings", c->tie_word_embeddings);
    put_str(o, "torch_dtype", dtype_torch_name(c->torch_dtype));
    put_bool(o, "use_cache", 1);
    put_int(o, "vocab_size", c->vocab_size);
    put_quant(o, c);
}

static void put_ids_all(jout_t *o, const model_config_t *c) {
    put_ids(o, "bos_token_id", c->bos_token_id, c->n_bos);
    put_ids(o, "eos_token_id", c->eos_token_id, c->n_eos);
    if (c->n_pad)
        put_ids(o, "pad_token_id", c->pad_token_id, c->n_pad);
}

static void write_qwen3(jout_t *o, const model_config_t *c) {
    put_head(o, c);
    put_bool(o, "attention_bias", 0);
    put_real(o, "attention_dropout", 0.0);
    put_ids_all(o, c);
    put_int(o, "decoder_sparse_step", c->decoder_sparse_step);
    put_int(o, "head_dim", c->head_dim);
    put_str(o, "hidden_act", "silu");
    put_int(o, "hidden_size", c->hidden_size);
    put_int(o, "intermediate_size", c->intermediate_size);
    if (c->has_layer_types) {
        cJSON *a = cJSON_CreateArray();
        for (int l = 0; a && l < c->num_hidden_layers; l++)
            if (!cJSON_AddItemToArray(a, cJSON_CreateString(c->layer_types_sliding[l]
                                                                ? "sliding_attention"
                                                                : "full_attention")))
                o->oom = 1;
        put(o, "layer_types", a);
    }
    put_int(o, "max_position_embeddings", c->max_position_embeddings);
    put_int(o, "max_window_layers", c->max_window_layers);
    cJSON *m = cJSON_CreateArray();
    for (int l = 0; m && l < c->num_hidden_layers; l++)
        if (c->mlp_only_layers[l] && !cJSON_AddItemToArray(m, cJSON_CreateNumber(l)))
            o->oom = 1;
    put(o, "mlp_only_layers", m);
    put_str(o, "model_type", c->model_type[0] ? c->model_type : "qwen3_moe");
    put_int(o, "moe_intermediate_size", c->moe_intermediate_size);
    put_bool(o, "norm_topk_prob", c->norm_topk_prob);
    put_int(o, "num_attention_heads", c->num_attention_heads);
    put_int(o, "num_experts", c->num_experts);
    put_int(o, "num_experts_per_tok", c->num_experts_per_tok);
    put_int(o, "num_hidden_layers", c->num_hidden_layers);
    put_int(o, "num_key_value_heads", c->num_key_value_heads);
    put_bool(o, "output_router_logits", c->output_router_logits);
    put_real(o, "rms_norm_eps", c->rms_norm_eps);
    put_rope(o, c, "rope_type");
    put_real(o, "rope_theta", c->rope_theta);
    put_real(o, "router_aux_loss_coef", c->router_aux_loss_coef);
    put_int_or_null(o, "sliding_window", c->sliding_window);
    put_bool(o, "use_sliding_window", c->use_sliding_window);
    put_tail(o, c);
}

static void write_mixtral(jout_t *o, const model_config_t *c) {
    put_head(o, c);
    put_real(o, "attention_dropout", 0.0);
    put_ids_all(o, c);
    put_int(o, "head_dim", c->head_dim);
    put_str(o, "hidden_act", "silu");
    put_int(o, "hidden_size", c->hidden_size);
    put_int(o, "intermediate_size", c->moe_intermediate_size);
    put_int(o, "max_position_embeddings", c->max_position_embeddings);
    put_str(o, "model_type", c->model_type[0] ? c->model_type : "mixtral");
    put_int(o, "num_attention_heads", c->num_attention_heads);
    put_int(o, "num_experts_per_tok", c->num_experts_per_tok);
    put_int(o, "num_hidden_layers", c->num_hidden_layers);
    put_int(o, "num_key_value_heads", c->num_key_value_heads);
    put_int(o, "num_local_experts", c->num_experts);
    put_bool(o, "output_router_logits", c->output_router_logits);
    put_real(o, "rms_norm_eps", c->rms_norm_eps);
    if (c->rope_scaling.type != ROPE_DEFAULT)
        put_rope(o, c, "rope_type");
    put_real(o, "rope_theta", c->rope_theta);
    put_real(o, "router_aux_loss_coef", c->router_aux_loss_coef);
    put_int_or_null(o, "sliding_window", c->sliding_window);
    put_tail(o, c);
}

static void write_deepseek(jout_t *o, const model_config_t *c) {
    static const char *const methods[] = {"greedy", "group_limited_greedy", "noaux_tc"};
    put_head(o, c);
    put_bool(o, "attention_bias", 0);
    put_real(o, "attention_dropout", 0.0);
    put_real(o, "aux_loss_alpha", c->router_aux_loss_coef);
    put_ids_all(o, c);
    put_int(o, "first_k_dense_replace", c->first_k_dense_replace);
    put_str(o, "hidden_act", "silu");
    put_int(o, "hidden_size", c->hidden_size);
    put_int(o, "intermediate_size", c->intermediate_size);
    put_int(o, "kv_lora_rank", c->kv_lora_rank);
    put_int(o, "max_position_embeddings", c->max_position_embeddings);
    put_str(o, "model_type", c->model_type[0] ? c->model_type : "deepseek_v3");
    put_int(o, "moe_intermediate_size", c->moe_intermediate_size);
    put_int(o, "moe_layer_freq", c->moe_layer_freq);
    put_int(o, "n_group", c->n_group);
    put_int(o, "n_routed_experts", c->num_experts);
    put_int_or_null(o, "n_shared_experts", c->n_shared_experts);
    put_bool(o, "norm_topk_prob", c->norm_topk_prob);
    put_int(o, "num_attention_heads", c->num_attention_heads);
    put_int(o, "num_experts_per_tok", c->num_experts_per_tok);
    put_int(o, "num_hidden_layers", c->num_hidden_layers);
    put_int(o, "num_key_value_heads", c->num_key_value_heads);
    put_int(o, "num_nextn_predict_layers", c->num_nextn_predict_layers);
    put_int_or_null(o, "q_lora_rank", c->q_lora_rank);
    put_int(o, "qk_nope_head_dim", c->qk_nope_head_dim);
    put_int(o, "qk_rope_head_dim", c->qk_rope_head_dim);
    put_real(o, "rms_norm_eps", c->rms_norm_eps);
    put_bool(o, "rope_interleave", c->rope_interleave);
    put_rope(o, c, "type");
    put_real(o, "rope_theta", c->rope_theta);
    put_real(o, "routed_scaling_factor", c->routed_scaling_factor);
    put_str(o, "scoring_func", c->scoring_func == SCORE_SIGMOID ? "sigmoid" : "softmax");
    put_int(o, "topk_group", c->topk_group);
    put_str(o, "topk_method", methods[c->topk_method]);
    put_int(o, "v_head_dim", c->v_head_dim);
    put_tail(o, c);
}

static int fsync_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int ok = fd >= 0 && fsync(fd) == 0;
    if (fd >= 0)
        close(fd);
    return ok ? MO_OK : mo_errorf(MO_EIO, "%s: cannot sync directory: %s", dir, strerror(errno));
}

/* text to a temporary file beside path, fsync, rename, directory fsync. */
static int write_atomic(const char *path, const char *text) {
    char tmp[4096];
    const char *slash = strrchr(path, '/');
    int dl = slash ? (int)(slash - path) + 1 : 0;
    if (snprintf(tmp, sizeof tmp, "%.*s.%s.XXXXXX", dl, path, path + dl) >= (int)sizeof tmp)
        return mo_errorf(MO_EINVAL, "%s: path too long", path);
    int fd = mkstemp(tmp);
    if (fd < 0)
        return mo_errorf(MO_EIO, "%s: cannot create a temporary file: %s", path, strerror(errno));
    size_t n = strlen(text), off = 0;
    int rc =
        fchmod(fd, 0644) == 0 ? MO_OK : mo_errorf(MO_EIO, "%s: chmod: %s", tmp, strerror(errno));
    while (rc == MO_OK && off < n) {
        ssize_t w = write(fd, text + off, n - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            rc = mo_errorf(MO_EIO, "%s: write failed: %s", tmp, strerror(errno));
        else
            off += (size_t)w;
    }
    if (rc == MO_OK && fsync(fd) != 0)
        rc = mo_errorf(MO_EIO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "%s: close failed: %s", tmp, strerror(errno));
    if (rc == MO_OK && rename(tmp, path) != 0)
        rc = mo_errorf(MO_EIO, "%s: cannot rename into place: %s", path, strerror(errno));
    if (rc < 0) {
        unlink(tmp);
        return rc;
    }
    return fsync_parent(path);
}

static int key_cmp(const void *a, const void *b) {
    return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* Sorts an object's keys, and those of nested objects, as Hugging Face writes them. */
static int sort_keys(cJSON *o) {
    int n = cJSON_GetArraySize(o);
    if (!cJSON_IsObject(o) || n < 1)
        return MO_OK;
    cJSON **v = malloc((size_t)n * sizeof *v);
    if (!v)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int k = 0;
    for (cJSON *e = o->child; e; e = e->next)
        v[k++] = e;
    qsort(v, (size_t)n, sizeof *v, key_cmp);
    for (int i = 0; i < n; i++) {
        v[i]->next = i + 1 < n ? v[i + 1] : NULL;
        v[i]->prev = i > 0 ? v[i - 1] : v[n - 1]; /* cJSON keeps the tail in the head's prev */
    }
    o->child = v[0];
    free(v);
    for (cJSON *e = o->child; e; e = e->next)
        TRY(sort_keys(e));
    return MO_OK;
}

int model_config_write_json(const model_config_t *c, const char *path) {
    TRY(model_config_validate(c, path));
    jout_t o = {cJSON_CreateObject(), 0};
    if (!o.obj)
        return mo_errorf(MO_ENOMEM, "%s: out of memory", path);
    switch (c->arch) {
    case ARCH_QWEN3_MOE: write_qwen3(&o, c); break;
    case ARCH_MIXTRAL: write_mixtral(&o, c); break;
    default: write_deepseek(&o, c); break;
    }
    char *text = o.oom || sort_keys(o.obj) < 0 ? NULL : cJSON_Print(o.obj);
    cJSON_Delete(o.obj);
    if (!text)
        return mo_errorf(MO_ENOMEM, "%s: out of memory", path);
    size_t n = strlen(text);
    char *nl = realloc(text, n + 2); /* end with a newline */
    if (!nl) {
        free(text);
        return mo_errorf(MO_ENOMEM, "%s: out of memory", path);
    }
    nl[n] = '\n';
    nl[n + 1] = '\0';
    int rc = write_atomic(path, nl);
    free(nl);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Loading.                                                                  */

static int read_file(const char *path, char **out) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return mo_errorf(MO_EIO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = malloc(CONFIG_MAX_BYTES + 1);
    size_t n = buf ? fread(buf, 1, CONFIG_MAX_BYTES + 1, f) : 0;
    int err = ferror(f);
    fclose(f);
    if (!buf)
        return mo_errorf(MO_ENOMEM, "%s: out of memory", path);
    if (err || n > CONFIG_MAX_BYTES) {
        free(buf);
        return err ? mo_errorf(MO_EIO, "%s: read failed", path)
                   : mo_errorf(MO_ECONFIG, "%s: larger than %u bytes", path, CONFIG_MAX_BYTES);
    }
    buf[n] = '\0';
    if (strlen(buf) != n) {
        free(buf);
        return mo_errorf(MO_ECONFIG, "%s: holds a NUL byte; expected JSON text", path);
    }
    *out = buf;
    return MO_OK;
}

int model_config_load(model_config_t *c, const char *dir_or_file) {
    struct stat sb;
    char path[4096];
    if (stat(dir_or_file, &sb) != 0)
        return mo_errorf(MO_EIO, "%s: %s", dir_or_file, strerror(errno));
    if (snprintf(path, sizeof path, S_ISDIR(sb.st_mode) ? "%s/config.json" : "%s", dir_or_file) >=
        (int)sizeof path)
        return mo_errorf(MO_EINVAL, "%s: path too long", dir_or_file);
    char *text;
    TRY(read_file(path, &text));
    int rc = model_config_parse_json(c, text, path);
    free(text);
    return rc;
}
