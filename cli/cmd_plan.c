/* cmd_plan: `moerl plan`: per-GPU memory and per-step communication of LoRA RL on a
 * mixture-of-experts model for a parallel layout (learner/plan.h), as a table or JSON. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "cli/commands.h"
#include "core/status.h"
#include "learner/plan.h"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_TARGETS 32
#define BW_A 25e9 /* 25 GB/s */
#define BW_B 50e9 /* 400 Gb/s */

static void plan_help(FILE *out) {
    fputs("usage: moerl plan --model (DIR | PRESET) [--gpus N] [--gpu-mem GIB] [--ep N] [--dp N]\n"
          "                  [--lora-rank R] [--lora-targets LIST] [--base-dtype TYPE]\n"
          "                  [--seq-len L] [--micro-batch-tokens T] [--recompute on|off]\n"
          "                  [--imbalance X] [--a2a-dtype f32|bf16] [--reserve GIB]\n"
          "                  [--rollout-gpus N] [--kv-tokens T] [--kv-dtype TYPE] [--json]\n"
          "\n"
          "Plans LoRA RL on a mixture-of-experts model: learner memory per GPU, broken down\n"
          "(frozen base, LoRA parameters, gradients, AdamW moments, activations with and\n"
          "without recomputation, all-to-all buffers), whether it fits, all-to-all and\n"
          "all-reduce bytes per step, adapter weight-sync bytes per version against full\n"
          "weights, and the rollout side's KV-cache capacity.\n"
          "\n"
          "Layout: GPUS = EP x DP. Within an expert-parallel group of EP GPUs each GPU owns\n"
          "E / EP routed experts of every MoE layer (their weights and adapters); everything\n"
          "else is replicated on every GPU; DP replicates the group. Each GPU runs T tokens\n"
          "per micro-batch; a step is one forward and backward on every GPU. Activations are\n"
          "counted allocation by allocation from the actor (f32, as it keeps them), checked\n"
          "against measured arena peaks on models that run on a CPU.\n"
          "\n"
          "options:\n"
          "  --model M             a Hugging Face model directory (config.json) or a preset:\n"
          "                        kimi-k2, deepseek-v3, qwen3-235b-a22b, qwen3-30b-a3b,\n"
          "                        mixtral-8x7b, olmoe-1b-7b\n"
          "  --gpus N              learner GPUs (default 8); EP defaults to the largest\n"
          "                        divisor of E that divides N, DP to N / EP\n"
          "  --gpu-mem GIB         memory of one GPU in GiB (default 80; an H200 is 140)\n"
          "  --ep N, --dp N        expert-parallel degree (divides E) and replicas\n"
          "  --lora-rank R         adapter rank (default 16)\n"
          "  --lora-targets LIST   comma-separated target words (default attention): q_proj,\n"
          "                        ..., gate_proj, up_proj, down_proj, attention, experts,\n"
          "                        shared_experts, dense_mlp, all-linear\n"
          "  --base-dtype TYPE     frozen base storage: bf16 (default), fp8 (every layer\n"
          "                        projection, 128x128 block scales, as DeepSeek-V3 and Kimi\n"
          "                        K2 ship), int4 (routed experts, a bf16 scale per 32, as\n"
          "                        Kimi K2 Thinking ships), f32\n"
          "  --seq-len L           tokens per sequence (default 4096)\n"
          "  --micro-batch-tokens T  tokens per GPU per micro-batch (default: L)\n"
          "  --recompute on|off    the mode the fit check uses (default on); both are shown\n"
          "  --imbalance X         busiest expert's load over the mean, >= 1 (default 1)\n"
          "  --a2a-dtype TYPE      element type of exchanged rows: f32 (default, as the\n"
          "                        expert-parallel layer sends them) or bf16\n"
          "  --reserve GIB         runtime allowance per GPU (default 2)\n"
          "  --rollout-gpus N      GPUs of one rollout engine, experts sharded over them\n"
          "                        (default 8, or the largest divisor of E below it)\n"
          "  --kv-tokens T         KV-cache tokens per rollout GPU to check (default none)\n"
          "  --kv-dtype TYPE       KV-cache element type: bf16 (default), fp8, f32\n"
          "  --json                print the plan as JSON (bytes as integers)\n"
          "  -h, --help            this help\n"
          "\n"
          "exit status: 0 planned (whether or not it fits), 1 error, 2 usage error\n",
          out);
}

typedef struct plan_args {
    const char *model, *targets, *base, *a2a, *kv, *recompute;
    double gpu_mem, imbalance, reserve;
    long long gpus, ep, dp, rank, seq_len, tokens, rollout, kv_tokens;
    int json;
} plan_args_t;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl plan: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl plan --help)\n");
    return 2;
}

static int parse_int(const char *s, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < 0)
        return -1;
    *out = v;
    return 0;
}

static int parse_real(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(v) || v < 0.0)
        return -1;
    *out = v;
    return 0;
}

/* The option's destination: a string, an integer or a real. */
static int set_option(plan_args_t *a, const char *o, const char *v) {
    const char **str = !strcmp(o, "--model")          ? &a->model
                       : !strcmp(o, "--lora-targets") ? &a->targets
                       : !strcmp(o, "--base-dtype")   ? &a->base
                       : !strcmp(o, "--a2a-dtype")    ? &a->a2a
                       : !strcmp(o, "--kv-dtype")     ? &a->kv
                       : !strcmp(o, "--recompute")    ? &a->recompute
                                                      : NULL;
    long long *num = !strcmp(o, "--gpus")                 ? &a->gpus
                     : !strcmp(o, "--ep")                 ? &a->ep
                     : !strcmp(o, "--dp")                 ? &a->dp
                     : !strcmp(o, "--lora-rank")          ? &a->rank
                     : !strcmp(o, "--seq-len")            ? &a->seq_len
                     : !strcmp(o, "--micro-batch-tokens") ? &a->tokens
                     : !strcmp(o, "--rollout-gpus")       ? &a->rollout
                     : !strcmp(o, "--kv-tokens")          ? &a->kv_tokens
                                                          : NULL;
    double *real = !strcmp(o, "--gpu-mem")     ? &a->gpu_mem
                   : !strcmp(o, "--imbalance") ? &a->imbalance
                   : !strcmp(o, "--reserve")   ? &a->reserve
                                               : NULL;
    if (str) {
        *str = v;
        return 0;
    }
    if (num)
        return parse_int(v, num) < 0 ? usage_error("%s needs a non-negative integer", o) : 0;
    if (real)
        return parse_real(v, real) < 0 ? usage_error("%s needs a non-negative number", o) : 0;
    return usage_error("unknown argument '%s'", o);
}

static int parse_args(int argc, char **argv, plan_args_t *a) {
    memset(a, 0, sizeof *a);
    a->gpu_mem = 80.0;
    a->imbalance = 1.0;
    a->reserve = 2.0;
    a->rank = 16;
    a->seq_len = 4096;
    a->kv_tokens = -1;
    a->gpus = a->ep = a->dp = a->tokens = a->rollout = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            a->json = 1;
            continue;
        }
        if (i + 1 >= argc)
            return usage_error("%s needs a value", argv[i]);
        int rc = set_option(a, argv[i], argv[i + 1]);
        if (rc)
            return rc;
        i++;
    }
    if (!a->model)
        return usage_error("%s is required", "--model");
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Model and layout.                                                         */

static int is_path(const char *s) {
    struct stat sb;
    return stat(s, &sb) == 0;
}

static int load_model(model_config_t *c, const char *model, const char **note) {
    *note = NULL;
    for (int i = 0; plan_preset_names[i]; i++)
        if (!strcmp(model, plan_preset_names[i]) && !is_path(model))
            return plan_preset(c, model, note);
    if (!is_path(model))
        return mo_errorf(MO_ENOTFOUND,
                         "'%s' is neither a model directory nor a preset (kimi-k2, deepseek-v3, "
                         "qwen3-235b-a22b, qwen3-30b-a3b, mixtral-8x7b, olmoe-1b-7b)",
                         model);
    return model_config_load(c, model);
}

/* The largest divisor of E that divides n. */
static int largest_common(int E, long long n) {
    for (long long d = n; d >= 1; d--)
        if (E % d == 0 && n % d == 0)
            return (int)d;
    return 1;
}

static int resolve_parallel(const plan_args_t *a, int E, plan_layout_t *l) {
    long long gpus = a->gpus;
    if (a->ep > 0 && a->dp > 0) {
        if (gpus > 0 && gpus != a->ep * a->dp)
            return mo_errorf(MO_EINVAL, "--gpus %lld is not --ep %lld x --dp %lld", gpus, a->ep,
                             a->dp);
        l->ep = (int)a->ep;
        l->dp = (int)a->dp;
    } else if (a->ep > 0 || a->dp > 0) {
        long long given = a->ep > 0 ? a->ep : a->dp;
        if (gpus < 1)
            gpus = a->ep > 0 ? a->ep : 8;
        if (gpus % given != 0)
            return mo_errorf(MO_EINVAL, "--gpus %lld is not a multiple of %s %lld", gpus,
                             a->ep > 0 ? "--ep" : "--dp", given);
        l->ep = (int)(a->ep > 0 ? a->ep : gpus / a->dp);
        l->dp = (int)(gpus / l->ep);
    } else {
        if (gpus < 1)
            gpus = 8;
        l->ep = largest_common(E, gpus);
        l->dp = (int)(gpus / l->ep);
    }
    if (a->ep == 0 || a->dp == 0 || a->gpus == 0 || (double)l->ep * l->dp > 1e6)
        return mo_errorf(MO_EINVAL, "--gpus, --ep and --dp must be >= 1 (and at most 10^6 GPUs)");
    long long r = a->rollout > 0 ? a->rollout : largest_common(E, 8);
    if (a->rollout == 0 || r > 1 << 20)
        return mo_errorf(MO_EINVAL, "--rollout-gpus must be in [1, 2^20]");
    l->rollout_gpus = (int)r;
    return MO_OK;
}

/* Splits the comma-separated list into words (pointers into buf). */
static int split_targets(char *buf, const char **words, int *n) {
    *n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        while (*tok == ' ')
            tok++;
        if (!*tok)
            continue;
        if (*n == MAX_TARGETS)
            return mo_errorf(MO_EINVAL, "--lora-targets: more than %d words", MAX_TARGETS);
        words[(*n)++] = tok;
    }
    return *n > 0 ? MO_OK : mo_errorf(MO_EINVAL, "--lora-targets is empty");
}

static int kind_type(const char *s, const char *opt, plan_wtype_t *out) {
    int rc = plan_wtype_from_name(s, out);
    return rc < 0 ? mo_error_wrap(rc, "%s", opt) : MO_OK;
}

static int build_layout(const plan_args_t *a, const model_config_t *c, plan_layout_t *l, char *tbuf,
                        const char **words) {
    plan_layout_default(l);
    TRY(resolve_parallel(a, c->num_experts, l));
    l->gpu_mem_gib = a->gpu_mem;
    if (a->rank < 1 || a->rank > 65536 || a->seq_len < 1 || a->seq_len > INT32_MAX / 2 ||
        a->tokens == 0 || a->tokens > INT32_MAX / 2)
        return mo_errorf(MO_EINVAL, "--lora-rank, --seq-len and --micro-batch-tokens must be "
                                    ">= 1 (rank at most 65536)");
    l->lora_rank = (int)a->rank;
    l->seq_len = (int)a->seq_len;
    l->tokens = a->tokens > 0 ? a->tokens : a->seq_len;
    if (a->targets) {
        snprintf(tbuf, 1024, "%s", a->targets);
        TRY(split_targets(tbuf, words, &l->n_targets));
        l->targets = words;
    }
    if (a->base)
        TRY(kind_type(a->base, "--base-dtype", &l->base));
    if (a->kv)
        TRY(kind_type(a->kv, "--kv-dtype", &l->kv));
    if (a->a2a && strcmp(a->a2a, "f32") != 0 && strcmp(a->a2a, "bf16") != 0)
        return mo_errorf(MO_EINVAL, "--a2a-dtype '%s' must be f32 or bf16", a->a2a);
    l->a2a_bytes = a->a2a && strcmp(a->a2a, "bf16") == 0 ? 2 : 4;
    if (a->recompute && strcmp(a->recompute, "on") != 0 && strcmp(a->recompute, "off") != 0)
        return mo_errorf(MO_EINVAL, "--recompute '%s' must be on or off", a->recompute);
    l->recompute = !a->recompute || strcmp(a->recompute, "on") == 0;
    l->imbalance = a->imbalance;
    l->reserve_gib = a->reserve;
    l->kv_tokens = a->kv_tokens > 0 ? a->kv_tokens : 0;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Text.                                                                     */

static const char *gib(char *b, double bytes) {
    snprintf(b, 32, "%.2f GiB", bytes / GIB);
    return b;
}

/* Decimal units: B, kB, MB, GB, TB. */
static const char *dec(char *b, double bytes) {
    static const char *const u[5] = {"B", "kB", "MB", "GB", "TB"};
    int i = 0;
    while (i < 4 && fabs(bytes) >= 1000.0) {
        bytes /= 1000.0;
        i++;
    }
    snprintf(b, 32, i == 0 ? "%.0f %s" : "%.2f %s", bytes, u[i]);
    return b;
}

static const char *count(char *b, double n) {
    if (n >= 1e12)
        snprintf(b, 32, "%.3f T", n / 1e12);
    else if (n >= 1e9)
        snprintf(b, 32, "%.2f B", n / 1e9);
    else if (n >= 1e6)
        snprintf(b, 32, "%.2f M", n / 1e6);
    else
        snprintf(b, 32, "%.0f", n);
    return b;
}

static const char *secs(char *b, double s) {
    if (s >= 1.0)
        snprintf(b, 32, "%.1f s", s);
    else
        snprintf(b, 32, "%.1f ms", s * 1e3);
    return b;
}

static void print_model(const model_config_t *c, const plan_t *p, const char *name,
                        const char *note) {
    char a[32], b[32], d[32];
    int L = c->num_hidden_layers;
    printf("model     %s: %s (%s), %d layers (%d MoE), D %d, V %lld\n", name,
           model_arch_name(c->arch), c->model_type, L, p->n_moe, c->hidden_size,
           (long long)c->vocab_size);
    printf("          %d routed experts of width %d, %d per token, %d shared; ", c->num_experts,
           c->moe_intermediate_size, c->num_experts_per_tok, c->n_shared_experts);
    if (c->arch == ARCH_DEEPSEEK_V3)
        printf("MLA (%d heads, kv_lora_rank %d, qk_rope_head_dim %d)\n", c->num_attention_heads,
               c->kv_lora_rank, c->qk_rope_head_dim);
    else
        printf("GQA (%d heads, %d kv heads of %d)\n", c->num_attention_heads,
               c->num_key_value_heads, c->head_dim);
    if (note)
        printf("          note: %s\n", note);
    printf("params    %s total, %s active per token (routed experts %s)\n",
           count(a, (double)p->params_total), count(b, (double)p->params_active),
           count(d, (double)p->params_experts));
}

static void print_setup(const model_config_t *c, const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    char a[32], b[32], d[32];
    printf("layout    %d GPUs = EP %d x DP %d: each GPU owns %d of %d routed experts of every MoE "
           "layer;\n          everything else is replicated on every GPU (DP replicates the EP "
           "group)\n",
           p->gpus, l->ep, l->dp, p->experts_per_gpu, c->num_experts);
    printf("LoRA      rank %d on", l->lora_rank);
    for (int i = 0; i < l->n_targets; i++)
        printf("%s%s", i ? "," : " ", l->targets[i]);
    printf(": %d projections, %s parameters (routed experts %s), %s per GPU\n", p->n_lora_modules,
           count(a, (double)p->lora_params), count(b, (double)p->lora_params_experts),
           count(d, (double)p->lora_params_gpu));
    printf("batch     T = %lld tokens per GPU per micro-batch, sequences of %d; activations f32\n",
           (long long)l->tokens, l->seq_len);
}

static void row2(const char *what, double off, double on) {
    char a[32], b[32];
    printf("  %-48s %13s %14s\n", what, gib(a, off), gib(b, on));
}

/* How the replicated part is stored (plan_wtype_t's rule). */
static const char *replicated_label(plan_wtype_t t) {
    return t == PLAN_W_FP8 ? "fp8 layers, bf16 embeddings" : t == PLAN_W_F32 ? "f32" : "bf16";
}

static void print_memory(const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    char w[96], a[32], b[32];
    printf("\nlearner memory per GPU %43s %14s\n", "recompute off", "recompute on");
    snprintf(w, sizeof w, "frozen base, replicated (%s)", replicated_label(l->base));
    row2(w, p->base_replicated, p->base_replicated);
    snprintf(w, sizeof w, "frozen base, %d routed experts x %d layers (%s)", p->experts_per_gpu,
             p->n_moe, plan_wtype_name(l->base));
    row2(w, p->base_experts, p->base_experts);
    row2("LoRA parameters (f32)", p->lora_bytes, p->lora_bytes);
    row2("LoRA gradients (f32)", p->grad_bytes, p->grad_bytes);
    row2("AdamW moments (2 x f32)", p->adam_bytes, p->adam_bytes);
    row2("activations kept for backward", p->acts[0].kept, p->acts[1].kept);
    row2("temporaries (one layer's backward, logits)", p->acts[0].temps, p->acts[1].temps);
    row2("  of which all-to-all row buffers", p->acts[0].a2a, p->acts[1].a2a);
    row2("runtime reserve", p->reserve, p->reserve);
    row2("total", p->total[0], p->total[1]);
    snprintf(w, sizeof w, "fits in %.2f GiB", l->gpu_mem_gib);
    printf("  %-48s %13s %14s\n", w, p->fits[0] ? "yes" : "no", p->fits[1] ? "yes" : "no");
    printf("  activations kept per token of one layer (no recompute): MoE %s",
           dec(a, p->layer_bytes_per_token[1]));
    if (p->layer_bytes_per_token[0] > 0.0)
        printf(", dense %s", dec(b, p->layer_bytes_per_token[0]));
    printf("\n");
}

static void print_verdict(const plan_t *p, int smallest) {
    const plan_layout_t *l = &p->layout;
    int m = l->recompute ? 1 : 0;
    if (p->fits[m]) {
        printf("  verdict: fits with recompute %s\n", m ? "on" : "off");
        return;
    }
    printf("  verdict: does not fit with recompute %s; ", m ? "on" : "off");
    if (smallest > 0)
        printf("the smallest GPU count that fits is %d (EP %d, DP 1)\n", smallest, smallest);
    else
        printf("no EP degree fits (the replicated part and activations alone exceed it)\n");
}

static void print_comm(const model_config_t *c, const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    char a[32], b[32], d[32], e[32];
    printf("\ncommunication per GPU per step (one forward + backward of T tokens)\n");
    printf("  all-to-all, uniform routing (%s rows)          %s/step (recompute on: %s/step)\n",
           l->a2a_bytes == 2 ? "bf16" : "f32", dec(a, p->a2a_step[0]), dec(b, p->a2a_step[1]));
    printf("    = T K D x %d B x 2 directions x 2 passes x (N-1)/N x %d MoE layers, + counts;\n"
           "      recompute runs the forward's 2 exchanges again\n",
           l->a2a_bytes, p->n_moe);
    printf("    at 25 GB/s %s, at 400 Gb/s %s (recompute off)\n", secs(a, p->a2a_step[0] / BW_A),
           secs(b, p->a2a_step[0] / BW_B));
    printf("  all-reduce, replicated LoRA gradients (f32)  payload %s, ring sends %s/step\n",
           dec(a, p->allreduce_payload), dec(b, p->allreduce_ring));
    printf("  all-reduce, own experts' LoRA gradients over DP %d: payload %s, ring sends %s/step\n",
           l->dp, dec(d, p->expert_allreduce_payload), dec(e, p->expert_allreduce_ring));
    (void)c;
}

static void sync_row(const char *what, double bytes) {
    char a[32], b[32], d[32];
    printf("  %-30s %12s   %10s at 25 GB/s   %10s at 400 Gb/s\n", what, dec(a, bytes),
           secs(b, bytes / BW_A), secs(d, bytes / BW_B));
}

static void print_sync(const plan_t *p) {
    char w[64];
    printf("\nweight sync per policy version\n");
    sync_row("adapter (f32)", p->sync_f32);
    sync_row("adapter (bf16)", p->sync_bf16);
    snprintf(w, sizeof w, "full base (%s)", plan_wtype_name(p->layout.base));
    sync_row(w, p->full_base);
    if (p->layout.base != PLAN_W_BF16)
        sync_row("full base (bf16)", p->full_bf16);
    printf("  adapter-only sync moves %.0fx fewer bytes than the %s base\n",
           p->full_base / p->sync_f32, plan_wtype_name(p->layout.base));
}

static void print_rollout(const model_config_t *c, const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    char a[32], b[32];
    printf("\nrollout per GPU (an engine of %d GPUs, %d routed experts per GPU, %s base)\n",
           l->rollout_gpus, c->num_experts / l->rollout_gpus, plan_wtype_name(l->base));
    printf("  %-48s %13s\n", "frozen base", gib(a, p->roll_base));
    printf("  %-48s %13s\n", "adapter (f32)", gib(a, p->roll_adapter));
    printf("  %-48s %13s\n", "workspace (inference forward of T tokens)",
           gib(a, p->roll_workspace));
    printf("  %-48s %13s\n", "runtime reserve", gib(a, p->reserve));
    printf("  %-48s %13s\n", "left for the KV cache", gib(a, p->roll_left));
    if (c->arch == ARCH_DEEPSEEK_V3)
        printf("  KV per token: MLA latent (kv_lora_rank %d + qk_rope_head_dim %d) x %d layers x "
               "%s = %s\n",
               c->kv_lora_rank, c->qk_rope_head_dim, c->num_hidden_layers, plan_wtype_name(l->kv),
               dec(a, p->kv_bytes_per_token));
    else
        printf("  KV per token: 2 (k, v) x %d layers x %d kv heads x %d x %s = %s\n",
               c->num_hidden_layers, c->num_key_value_heads, c->head_dim, plan_wtype_name(l->kv),
               dec(a, p->kv_bytes_per_token));
    printf("  KV capacity: %lld tokens per GPU (%.1f sequences of %d)\n", (long long)p->kv_capacity,
           (double)p->kv_capacity / l->seq_len, l->seq_len);
    if (l->kv_tokens > 0)
        printf("  asked for %lld tokens: %s\n", (long long)l->kv_tokens,
               p->kv_fits ? "fits" : "does not fit");
    (void)b;
}

/* ------------------------------------------------------------------------ */
/* JSON.                                                                     */

static void num(cJSON *o, const char *k, double v) {
    cJSON_AddNumberToObject(o, k, v);
}

static void bytes(cJSON *o, const char *k, double v) {
    cJSON_AddNumberToObject(o, k, floor(v + 0.5));
}

static cJSON *json_mode(const plan_t *p, int m) {
    cJSON *o = cJSON_CreateObject();
    bytes(o, "activations_kept", p->acts[m].kept);
    bytes(o, "temporaries", p->acts[m].temps);
    bytes(o, "alltoall_buffers", p->acts[m].a2a);
    bytes(o, "total", p->total[m]);
    cJSON_AddBoolToObject(o, "fits", p->fits[m]);
    return o;
}

static cJSON *json_model(const model_config_t *c, const plan_t *p, const char *name,
                         const char *note) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "architecture", model_arch_name(c->arch));
    cJSON_AddStringToObject(o, "model_type", c->model_type);
    num(o, "layers", c->num_hidden_layers);
    num(o, "moe_layers", p->n_moe);
    num(o, "hidden_size", c->hidden_size);
    num(o, "experts", c->num_experts);
    num(o, "experts_per_token", c->num_experts_per_tok);
    num(o, "shared_experts", c->n_shared_experts);
    num(o, "params_total", (double)p->params_total);
    num(o, "params_active", (double)p->params_active);
    num(o, "params_routed_experts", (double)p->params_experts);
    if (note)
        cJSON_AddStringToObject(o, "note", note);
    return o;
}

static cJSON *json_layout(const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    cJSON *o = cJSON_CreateObject();
    num(o, "gpus", p->gpus);
    num(o, "ep", l->ep);
    num(o, "dp", l->dp);
    num(o, "experts_per_gpu", p->experts_per_gpu);
    num(o, "gpu_mem_gib", l->gpu_mem_gib);
    cJSON_AddStringToObject(o, "base_dtype", plan_wtype_name(l->base));
    num(o, "lora_rank", l->lora_rank);
    cJSON *t = cJSON_AddArrayToObject(o, "lora_targets");
    for (int i = 0; i < l->n_targets; i++)
        cJSON_AddItemToArray(t, cJSON_CreateString(l->targets[i]));
    num(o, "seq_len", l->seq_len);
    num(o, "micro_batch_tokens", (double)l->tokens);
    cJSON_AddBoolToObject(o, "recompute", l->recompute);
    num(o, "imbalance", l->imbalance);
    cJSON_AddStringToObject(o, "a2a_dtype", l->a2a_bytes == 2 ? "bf16" : "f32");
    num(o, "reserve_gib", l->reserve_gib);
    return o;
}

static cJSON *json_learner(const plan_t *p, int smallest) {
    cJSON *o = cJSON_CreateObject();
    bytes(o, "base_replicated", p->base_replicated);
    bytes(o, "base_experts", p->base_experts);
    num(o, "lora_params", (double)p->lora_params);
    num(o, "lora_params_routed_experts", (double)p->lora_params_experts);
    num(o, "lora_params_per_gpu", (double)p->lora_params_gpu);
    num(o, "lora_modules", p->n_lora_modules);
    bytes(o, "lora_param_bytes", p->lora_bytes);
    bytes(o, "lora_grad_bytes", p->grad_bytes);
    bytes(o, "adamw_bytes", p->adam_bytes);
    bytes(o, "reserve", p->reserve);
    cJSON_AddItemToObject(o, "recompute_off", json_mode(p, 0));
    cJSON_AddItemToObject(o, "recompute_on", json_mode(p, 1));
    bytes(o, "moe_layer_bytes_per_token", p->layer_bytes_per_token[1]);
    bytes(o, "dense_layer_bytes_per_token", p->layer_bytes_per_token[0]);
    cJSON_AddBoolToObject(o, "fits", p->fits[p->layout.recompute ? 1 : 0]);
    if (smallest > 0)
        num(o, "smallest_fitting_gpus", smallest);
    else
        cJSON_AddNullToObject(o, "smallest_fitting_gpus");
    return o;
}

static cJSON *json_comm(const plan_t *p) {
    cJSON *o = cJSON_CreateObject();
    bytes(o, "alltoall_per_step", p->a2a_step[0]);
    bytes(o, "alltoall_per_step_recompute", p->a2a_step[1]);
    bytes(o, "allreduce_replicated_payload", p->allreduce_payload);
    bytes(o, "allreduce_replicated_ring", p->allreduce_ring);
    bytes(o, "allreduce_experts_payload", p->expert_allreduce_payload);
    bytes(o, "allreduce_experts_ring", p->expert_allreduce_ring);
    return o;
}

static cJSON *json_sync(const plan_t *p) {
    cJSON *o = cJSON_CreateObject();
    bytes(o, "adapter_f32", p->sync_f32);
    bytes(o, "adapter_bf16", p->sync_bf16);
    bytes(o, "full_base", p->full_base);
    bytes(o, "full_bf16", p->full_bf16);
    num(o, "adapter_f32_seconds_25GBps", p->sync_f32 / BW_A);
    num(o, "adapter_f32_seconds_400Gbps", p->sync_f32 / BW_B);
    num(o, "full_base_seconds_25GBps", p->full_base / BW_A);
    num(o, "full_base_seconds_400Gbps", p->full_base / BW_B);
    return o;
}

static cJSON *json_rollout(const plan_t *p) {
    const plan_layout_t *l = &p->layout;
    cJSON *o = cJSON_CreateObject();
    num(o, "gpus", l->rollout_gpus);
    bytes(o, "base", p->roll_base);
    bytes(o, "adapter", p->roll_adapter);
    bytes(o, "workspace", p->roll_workspace);
    bytes(o, "reserve", p->reserve);
    bytes(o, "left_for_kv", p->roll_left);
    cJSON_AddStringToObject(o, "kv_dtype", plan_wtype_name(l->kv));
    bytes(o, "kv_bytes_per_token", p->kv_bytes_per_token);
    num(o, "kv_capacity_tokens", (double)p->kv_capacity);
    if (l->kv_tokens > 0) {
        num(o, "kv_tokens_asked", (double)l->kv_tokens);
        cJSON_AddBoolToObject(o, "kv_fits", p->kv_fits);
    }
    return o;
}

static int print_json(const model_config_t *c, const plan_t *p, const char *name, const char *note,
                      int smallest) {
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return mo_errorf(MO_ENOMEM, "plan: out of memory for JSON");
    cJSON_AddItemToObject(root, "model", json_model(c, p, name, note));
    cJSON_AddItemToObject(root, "layout", json_layout(p));
    cJSON_AddItemToObject(root, "learner", json_learner(p, smallest));
    cJSON_AddItemToObject(root, "communication", json_comm(p));
    cJSON_AddItemToObject(root, "weight_sync", json_sync(p));
    cJSON_AddItemToObject(root, "rollout", json_rollout(p));
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    if (!s)
        return mo_errorf(MO_ENOMEM, "plan: out of memory for JSON");
    printf("%s\n", s);
    free(s);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */

static int run_plan(const plan_args_t *a) {
    model_config_t c;
    memset(&c, 0, sizeof c);
    const char *note;
    TRY(load_model(&c, a->model, &note));
    plan_layout_t l;
    char tbuf[1024];
    const char *words[MAX_TARGETS];
    TRY(build_layout(a, &c, &l, tbuf, words));
    plan_t p;
    TRY(plan_compute(&p, &c, &l));
    int smallest = 0;
    if (!p.fits[l.recompute ? 1 : 0])
        TRY(plan_smallest_ep(&c, &l, &smallest));
    if (a->json)
        return print_json(&c, &p, a->model, note, smallest);
    print_model(&c, &p, a->model, note);
    print_setup(&c, &p);
    print_memory(&p);
    print_verdict(&p, smallest);
    print_comm(&c, &p);
    print_sync(&p);
    print_rollout(&c, &p);
    return MO_OK;
}

static int plan_main(int argc, char **argv) {
    plan_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    rc = run_plan(&a);
    return rc < 0 ? cli_fail("plan", rc) : 0;
}

const cli_command_t cmd_plan = {"plan", "per-GPU memory and communication plan for a model",
                                plan_main, plan_help};
