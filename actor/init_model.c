/* init_model: presets and random weights for Hugging Face model directories. */
#include "actor/init_model.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "actor/tokenizer.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"

static const char *const g_arch_words[ARCH_COUNT] = {"qwen3_moe", "mixtral", "deepseek_v3"};
static const char *const g_size_words[INIT_SIZE_COUNT] = {"tiny", "small"};

int init_model_arch_from_name(const char *name, model_arch_t *out) {
    for (int i = 0; i < ARCH_COUNT; i++)
        if (name && strcmp(name, g_arch_words[i]) == 0) {
            *out = (model_arch_t)i;
            return MO_OK;
        }
    return mo_errorf(MO_EINVAL,
                     "unknown architecture '%s' (expected qwen3_moe, mixtral or "
                     "deepseek_v3)",
                     name ? name : "");
}

int init_model_size_from_name(const char *name, init_size_t *out) {
    for (int i = 0; i < INIT_SIZE_COUNT; i++)
        if (name && strcmp(name, g_size_words[i]) == 0) {
            *out = (init_size_t)i;
            return MO_OK;
        }
    return mo_errorf(MO_EINVAL, "unknown size '%s' (expected tiny or small)", name ? name : "");
}

/* Fields every preset shares. */
static void common(model_config_t *c, model_arch_t arch, int small, dtype_t dtype) {
    memset(c, 0, sizeof *c);
    c->arch = arch;
    snprintf(c->model_type, sizeof c->model_type, "%s", g_arch_words[arch]);
    c->vocab_size = TOK_BYTELEVEL_VOCAB;
    c->hidden_size = small ? 512 : 64;
    c->num_hidden_layers = small ? 8 : 2;
    c->num_attention_heads = small ? 8 : 4;
    c->num_key_value_heads = small ? 4 : 2;
    c->head_dim = small ? 64 : 16;
    c->num_experts = small ? 16 : 8;
    c->num_experts_per_tok = 2;
    c->moe_intermediate_size = small ? 256 : 32;
    c->intermediate_size = small ? 1024 : 128;
    c->norm_topk_prob = 1;
    c->decoder_sparse_step = 1;
    c->moe_layer_freq = 1;
    c->routed_scaling_factor = 1.0;
    c->scoring_func = SCORE_SOFTMAX;
    c->topk_method = TOPK_GREEDY;
    c->n_group = 1;
    c->topk_group = 1;
    c->rms_norm_eps = 1e-6;
    c->rope_theta = 1000000.0;
    c->max_position_embeddings = 4096;
    c->max_window_layers = c->num_hidden_layers;
    c->n_bos = c->n_eos = 1;
    c->bos_token_id[0] = TOK_BYTELEVEL_BOS;
    c->eos_token_id[0] = TOK_BYTELEVEL_EOS;
    c->torch_dtype = dtype;
    c->router_aux_loss_coef = 0.001;
}

static void deepseek(model_config_t *c, int small) {
    c->num_key_value_heads = c->num_attention_heads;
    c->q_lora_rank = small ? 192 : 32;
    c->kv_lora_rank = small ? 128 : 32;
    c->qk_nope_head_dim = small ? 64 : 16;
    c->qk_rope_head_dim = small ? 32 : 8;
    c->v_head_dim = small ? 64 : 16;
    c->head_dim = c->qk_nope_head_dim + c->qk_rope_head_dim;
    c->n_shared_experts = 1;
    c->first_k_dense_replace = 1;
    c->routed_scaling_factor = 2.5;
    c->scoring_func = SCORE_SIGMOID;
    c->topk_method = TOPK_NOAUX_TC;
    c->n_group = small ? 4 : 2;
    c->topk_group = small ? 2 : 1;
    c->rope_interleave = 1;
    c->rope_theta = 10000.0;
}

int init_model_config(model_config_t *c, model_arch_t arch, init_size_t size, dtype_t dtype) {
    if ((unsigned)arch >= ARCH_COUNT || (unsigned)size >= INIT_SIZE_COUNT)
        return mo_errorf(MO_EINVAL, "init model: unknown architecture %d or size %d", (int)arch,
                         (int)size);
    if (dtype != DT_BF16 && dtype != DT_F16 && dtype != DT_F32)
        return mo_errorf(MO_EINVAL, "init model: dtype %s is not one of BF16, F16, F32",
                         dtype_name(dtype));
    int small = size == INIT_SIZE_SMALL;
    common(c, arch, small, dtype);
    if (arch == ARCH_MIXTRAL) {
        c->intermediate_size = c->moe_intermediate_size;
        c->rms_norm_eps = 1e-5;
        c->router_aux_loss_coef = 0.02;
    } else if (arch == ARCH_DEEPSEEK_V3) {
        deepseek(c, small);
    }
    return model_config_validate(c, "init model");
}

/* ------------------------------------------------------------------------ */
/* Weights.                                                                  */

typedef enum { FILL_NORMAL = 0, FILL_ONES, FILL_ZEROS } fill_t;

typedef struct wlist {
    st_item_t *items;
    char **names;
    int n, cap;
    const model_config_t *c;
    const init_model_opts_t *o;
    int rc;
} wlist_t;

static int fill_tensor(void *dst, dtype_t dt, size_t n, fill_t fill, const char *name,
                       const init_model_opts_t *o) {
    float *tmp = malloc(sizeof(float) * (n ? n : 1));
    if (!tmp)
        return mo_errorf(MO_ENOMEM, "init model: out of memory for %s", name);
    float std = o->std > 0.0f ? o->std : 0.02f;
    if (fill == FILL_NORMAL)
        rng_fill_normal(tmp, n, o->seed, rng_stream_id(name, 0, 0), 0.0f, std);
    for (size_t i = 0; fill != FILL_NORMAL && i < n; i++)
        tmp[i] = fill == FILL_ONES ? 1.0f : 0.0f;
    convert_from_f32(dst, dt, tmp, n);
    free(tmp);
    return MO_OK;
}

/* Appends one tensor (rows, cols) or, with cols == 0, a vector (rows). */
static void add(wlist_t *w, fill_t fill, dtype_t dt, int64_t rows, int64_t cols, const char *fmt,
                ...) __attribute__((format(printf, 6, 7)));
static void add(wlist_t *w, fill_t fill, dtype_t dt, int64_t rows, int64_t cols, const char *fmt,
                ...) {
    if (w->rc < 0)
        return;
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 64;
        st_item_t *it = realloc(w->items, sizeof *it * (size_t)cap);
        if (it)
            w->items = it;
        char **nm = realloc(w->names, sizeof *nm * (size_t)cap);
        if (nm)
            w->names = nm;
        if (!it || !nm) {
            w->rc = mo_errorf(MO_ENOMEM, "init model: out of memory");
            return;
        }
        w->cap = cap;
    }
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    int64_t shape[2] = {rows, cols};
    int ndim = cols > 0 ? 2 : 1;
    size_t n = (size_t)rows * (size_t)(cols > 0 ? cols : 1);
    char *nm = malloc(strlen(name) + 1);
    void *data = malloc(n * dtype_size(dt));
    if (!nm || !data) {
        free(nm);
        free(data);
        w->rc = mo_errorf(MO_ENOMEM, "init model: out of memory for %s", name);
        return;
    }
    strcpy(nm, name);
    w->names[w->n] = nm;
    w->items[w->n].name = nm;
    w->items[w->n].tensor = tensor_view(data, dt, DEV_CPU, ndim, shape);
    w->n++;
    w->rc = fill_tensor(data, dt, n, fill, nm, w->o);
}

static void add_mlp(wlist_t *w, dtype_t dt, int64_t F, int64_t D, const char *prefix) {
    add(w, FILL_NORMAL, dt, F, D, "%sgate_proj.weight", prefix);
    add(w, FILL_NORMAL, dt, F, D, "%sup_proj.weight", prefix);
    add(w, FILL_NORMAL, dt, D, F, "%sdown_proj.weight", prefix);
}

static void add_attention(wlist_t *w, int l) {
    const model_config_t *c = w->c;
    dtype_t dt = c->torch_dtype;
    int64_t D = c->hidden_size, H = c->num_attention_heads, Dh = c->head_dim;
    int64_t kvd = (int64_t)c->num_key_value_heads * Dh;
    if (c->arch != ARCH_DEEPSEEK_V3) {
        add(w, FILL_NORMAL, dt, H * Dh, D, "model.layers.%d.self_attn.q_proj.weight", l);
        add(w, FILL_NORMAL, dt, kvd, D, "model.layers.%d.self_attn.k_proj.weight", l);
        add(w, FILL_NORMAL, dt, kvd, D, "model.layers.%d.self_attn.v_proj.weight", l);
        add(w, FILL_NORMAL, dt, D, H * Dh, "model.layers.%d.self_attn.o_proj.weight", l);
        if (c->arch == ARCH_QWEN3_MOE) {
            add(w, FILL_ONES, dt, Dh, 0, "model.layers.%d.self_attn.q_norm.weight", l);
            add(w, FILL_ONES, dt, Dh, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        }
        return;
    }
    int64_t qr = c->q_lora_rank, kvr = c->kv_lora_rank, rope = c->qk_rope_head_dim;
    if (qr > 0) {
        add(w, FILL_NORMAL, dt, qr, D, "model.layers.%d.self_attn.q_a_proj.weight", l);
        add(w, FILL_ONES, dt, qr, 0, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
        add(w, FILL_NORMAL, dt, H * Dh, qr, "model.layers.%d.self_attn.q_b_proj.weight", l);
    } else {
        add(w, FILL_NORMAL, dt, H * Dh, D, "model.layers.%d.self_attn.q_proj.weight", l);
    }
    add(w, FILL_NORMAL, dt, kvr + rope, D, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight",
        l);
    add(w, FILL_ONES, dt, kvr, 0, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    add(w, FILL_NORMAL, dt, H * (c->qk_nope_head_dim + c->v_head_dim), kvr,
        "model.layers.%d.self_attn.kv_b_proj.weight", l);
    add(w, FILL_NORMAL, dt, D, H * c->v_head_dim, "model.layers.%d.self_attn.o_proj.weight", l);
}

static void add_moe(wlist_t *w, int l) {
    const model_config_t *c = w->c;
    dtype_t dt = c->torch_dtype;
    int64_t D = c->hidden_size, F = c->moe_intermediate_size, E = c->num_experts;
    char p[160];
    if (c->arch == ARCH_MIXTRAL) {
        add(w, FILL_NORMAL, dt, E, D, "model.layers.%d.block_sparse_moe.gate.weight", l);
        for (int e = 0; e < E; e++) {
            add(w, FILL_NORMAL, dt, F, D, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight",
                l, e);
            add(w, FILL_NORMAL, dt, D, F, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight",
                l, e);
            add(w, FILL_NORMAL, dt, F, D, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight",
                l, e);
        }
        return;
    }
    add(w, FILL_NORMAL, dt, E, D, "model.layers.%d.mlp.gate.weight", l);
    if (c->scoring_func == SCORE_SIGMOID)
        add(w, FILL_ZEROS, DT_F32, E, 0, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
    for (int e = 0; e < E; e++) {
        snprintf(p, sizeof p, "model.layers.%d.mlp.experts.%d.", l, e);
        add_mlp(w, dt, F, D, p);
    }
    if (c->n_shared_experts > 0) {
        snprintf(p, sizeof p, "model.layers.%d.mlp.shared_experts.", l);
        add_mlp(w, dt, (int64_t)c->n_shared_experts * F, D, p);
    }
}

static void add_all(wlist_t *w) {
    const model_config_t *c = w->c;
    dtype_t dt = c->torch_dtype;
    int64_t D = c->hidden_size, V = c->vocab_size;
    add(w, FILL_NORMAL, dt, V, D, "model.embed_tokens.weight");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        add(w, FILL_ONES, dt, D, 0, "model.layers.%d.input_layernorm.weight", l);
        add_attention(w, l);
        add(w, FILL_ONES, dt, D, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        if (model_config_is_moe_layer(c, l)) {
            add_moe(w, l);
        } else {
            char p[96];
            snprintf(p, sizeof p, "model.layers.%d.mlp.", l);
            add_mlp(w, dt, c->intermediate_size, D, p);
        }
    }
    add(w, FILL_ONES, dt, D, 0, "model.norm.weight");
    if (!c->tie_word_embeddings)
        add(w, FILL_NORMAL, dt, V, D, "lm_head.weight");
}

int init_model_write_weights(const char *path, const model_config_t *c,
                             const init_model_opts_t *o) {
    TRY(model_config_validate(c, path));
    init_model_opts_t def = {0, 0.0f};
    wlist_t w = {NULL, NULL, 0, 0, c, o ? o : &def, MO_OK};
    add_all(&w);
    int rc = w.rc;
    if (rc == MO_OK) {
        st_meta_t meta[1] = {{"format", "pt"}};
        rc = st_write(path, w.items, w.n, meta, 1);
    }
    for (int i = 0; i < w.n; i++) {
        free(w.items[i].tensor.data);
        free(w.names[i]);
    }
    free(w.items);
    free(w.names);
    return rc;
}

int init_model_write(const char *dir, const model_config_t *c, const init_model_opts_t *o) {
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (mkdir(dir, 0755) != 0)
            return mo_errorf(MO_EIO, "%s: cannot create directory: %s", dir, strerror(errno));
    } else if (!S_ISDIR(sb.st_mode)) {
        return mo_errorf(MO_EIO, "%s: exists and is not a directory", dir);
    }
    size_t cap = strlen(dir) + 32;
    char *path = malloc(cap);
    if (!path)
        return mo_errorf(MO_ENOMEM, "init model: out of memory");
    snprintf(path, cap, "%s/config.json", dir);
    int rc = model_config_write_json(c, path);
    if (rc == MO_OK) {
        snprintf(path, cap, "%s/%s", dir, ST_SINGLE_NAME);
        rc = init_model_write_weights(path, c, o);
    }
    if (rc == MO_OK)
        rc = tokenizer_write_bytelevel(dir);
    free(path);
    return rc;
}
