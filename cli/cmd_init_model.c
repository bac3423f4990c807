/* cmd_init_model: `moerl init-model`: write a randomly initialised Hugging Face model
 * directory of a supported family (config.json, model.safetensors, tokenizer). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "cli/commands.h"
#include "core/status.h"

static void init_model_help(FILE *out) {
    fputs("usage: moerl init-model --arch ARCH --size SIZE --out DIR [--seed S] [--dtype DTYPE]\n"
          "\n"
          "Writes a randomly initialised model in the Hugging Face layout: DIR/config.json,\n"
          "DIR/model.safetensors and a byte-level tokenizer (DIR/tokenizer.json and\n"
          "DIR/tokenizer_config.json: ids 0-255 are bytes, then <|bos|> <|eos|> <|pad|>\n"
          "<|im_start|> <|im_end|>, 261 tokens). Matrices are drawn from normal(0, 0.02)\n"
          "(Hugging Face's initializer_range), norm weights are 1. DIR is created when\n"
          "missing (its parent must exist); files in it are replaced.\n"
          "\n"
          "options:\n"
          "  --arch ARCH    qwen3_moe (Qwen3MoeForCausalLM), mixtral (MixtralForCausalLM)\n"
          "                 or deepseek_v3 (DeepseekV3ForCausalLM: MLA attention, sigmoid\n"
          "                 routing with a correction bias, a shared expert, a leading\n"
          "                 dense layer; the actor loads and trains it, the rollout\n"
          "                 engine does not decode MLA models yet)\n"
          "  --size SIZE    tiny:  2 layers, width 64, 4 heads (2 kv), head dim 16,\n"
          "                        8 experts, 2 per token, expert width 32\n"
          "                 small: 8 layers, width 512, 8 heads (4 kv), head dim 64,\n"
          "                        16 experts, 2 per token, expert width 256\n"
          "  --out DIR      output directory\n"
          "  --seed S       seed of the random weights (default 0); the same seed writes\n"
          "                 the same bytes\n"
          "  --dtype DTYPE  storage of the weights: bf16 (default) or f32\n"
          "  -h, --help     this help\n"
          "\n"
          "Check the result with: moerl score --model DIR --text \"hello\"\n"
          "\n"
          "exit status: 0 written, 1 error, 2 usage error\n",
          out);
}

typedef struct init_args {
    const char *arch, *size, *out, *dtype;
    unsigned long long seed;
} init_args_t;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl init-model: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl init-model --help)\n");
    return 2;
}

static int parse_seed(const char *s, unsigned long long *out) {
    char *end;
    if (!s || !*s || *s == '-')
        return -1;
    *out = strtoull(s, &end, 0);
    return *end ? -1 : 0;
}

static int parse_args(int argc, char **argv, init_args_t *a) {
    memset(a, 0, sizeof *a);
    a->dtype = "bf16";
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char **dst = !strcmp(o, "--arch")    ? &a->arch
                           : !strcmp(o, "--size")  ? &a->size
                           : !strcmp(o, "--out")   ? &a->out
                           : !strcmp(o, "--dtype") ? &a->dtype
                                                   : NULL;
        int is_seed = !strcmp(o, "--seed");
        if (!dst && !is_seed)
            return usage_error("unknown argument '%s'", o);
        if (i + 1 >= argc)
            return usage_error("%s needs a value", o);
        if (is_seed) {
            if (parse_seed(argv[++i], &a->seed) < 0)
                return usage_error("--seed '%s' is not a non-negative integer", argv[i]);
        } else {
            *dst = argv[++i];
        }
    }
    if (!a->arch)
        return usage_error("%s is required", "--arch");
    if (!a->size)
        return usage_error("%s is required", "--size");
    if (!a->out)
        return usage_error("%s is required", "--out");
    return 0;
}

static int init_model_run(int argc, char **argv) {
    init_args_t a;
    int st = parse_args(argc, argv, &a);
    if (st)
        return st;
    model_arch_t arch;
    init_size_t size;
    dtype_t dt;
    if (init_model_arch_from_name(a.arch, &arch) < 0 ||
        init_model_size_from_name(a.size, &size) < 0)
        return usage_error("%s", mo_last_error());
    if (!strcmp(a.dtype, "bf16"))
        dt = DT_BF16;
    else if (!strcmp(a.dtype, "f32"))
        dt = DT_F32;
    else
        return usage_error("--dtype '%s' is not bf16 or f32", a.dtype);
    model_config_t c;
    int rc = init_model_config(&c, arch, size, dt);
    init_model_opts_t o = {(uint64_t)a.seed, 0.0f};
    if (rc == MO_OK)
        rc = init_model_write(a.out, &c, &o);
    if (rc < 0)
        return cli_fail("init-model", rc);
    int64_t total, active;
    model_config_param_counts(&c, &total, &active);
    printf("%s: %s %s, %d layers, %d experts (%d per token), %lld parameters (%lld active), "
           "%s, seed %llu\n",
           a.out, model_arch_name(arch), a.size, c.num_hidden_layers, c.num_experts,
           c.num_experts_per_tok, (long long)total, (long long)active, a.dtype, a.seed);
    return 0;
}

const cli_command_t cmd_init_model = {
    "init-model",
    "write a randomly initialised model directory (qwen3_moe, mixtral, deepseek_v3)",
    init_model_run,
    init_model_help,
};
