/* cmd_sft: `moerl sft`: supervised warm start of a job's model on prompt/response pairs
 * (LoRA adapter, or with --full a merged model directory), with a greedy eval curve. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/commands.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/status.h"
#include "learner/sft.h"

#define SFT_MAX_SETS 64

static void sft_help(FILE *out) {
    fputs("usage: moerl sft CONFIG [--out DIR] [--steps N] [--full] [options]\n"
          "\n"
          "Supervised training of the job's model (model.path) on prompt/response pairs:\n"
          "the built-in task's pairs (data.task arith or sort), or the JSONL file\n"
          "data.path (each line {\"prompt\": ..., \"response\": ...}; \"answer\" stands in when\n"
          "there is no \"response\"). The loss is the mean negative log-probability of\n"
          "the response tokens and the end-of-sequence token; prompts are read through\n"
          "rollout.prompt_template as the rollout reads them. Greedy accuracy on the\n"
          "eval split (data.eval_size prompts, scored by the task's verifier or\n"
          "reward.function) is printed as training goes.\n"
          "\n"
          "Default: trains a LoRA adapter as the lora section describes and writes it in\n"
          "the PEFT layout to DIR (default <run dir>/sft-adapter); start RL from it with\n"
          "the learner's initial adapter. lora.train_router and lora.train_norms train\n"
          "the routers and norms in full too, saved with the adapter.\n"
          "--full: trains every projection of the model (a full-rank adapter on all\n"
          "linear layers, merged into the weights at the end) and writes a new model\n"
          "directory to DIR (default <run dir>/sft-model: config.json, model.safetensors\n"
          "in f32, the tokenizer), to use as model.path. Embeddings and lm_head keep\n"
          "their values, routers and norms too unless lora.train_router / train_norms\n"
          "are set; a logit scale folded into the final norm gives the trained model\n"
          "its confidence.\n"
          "\n"
          "options:\n"
          "  --out DIR          output directory (created when missing)\n"
          "  --steps N          optimizer updates (default 1000)\n"
          "  --full             train the whole model, write a merged model directory\n"
          "  --batch N          pairs per update (default 32)\n"
          "  --lr X             peak learning rate, cosine schedule with 5% warmup\n"
          "                     (default 2e-3 with --full, else learner.lr)\n"
          "  --rank R           adapter rank (default: the model width with --full, else\n"
          "                     lora.rank)\n"
          "  --logit-scale S    --full: logits are multiplied by S (default 16)\n"
          "  --eval-every N     greedy eval every N updates (default 100; 0: only at the end)\n"
          "  --eval-n N         eval prompts (default: all of data.eval_size)\n"
          "  --log-every N      a loss line every N updates (default 50)\n"
          "  --set key=value    override a config key (repeatable)\n"
          "  -h, --help         this help\n"
          "\n"
          "Threads: run.threads (0 = every core).\n"
          "exit status: 0 trained and saved, 1 error, 2 usage error\n",
          out);
}

typedef struct sft_args {
    const char *config, *out;
    const char *sets[SFT_MAX_SETS];
    int nsets;
    sft_opts_t o;
    int64_t eval_every, log_every;
} sft_args_t;

static int usage(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl sft: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl sft --help)\n");
    return 2;
}

static int parse_i64(const char *s, int64_t lo, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < lo)
        return -1;
    *out = v;
    return 0;
}

static int parse_num(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !(v > 0))
        return -1;
    *out = v;
    return 0;
}

/* One "--opt VALUE" option; returns 0, or the usage status. */
static int parse_valued(sft_args_t *a, const char *o, const char *v) {
    int64_t i = 0;
    double d = 0;
    if (!strcmp(o, "--out")) {
        a->out = v;
    } else if (!strcmp(o, "--set")) {
        if (a->nsets == SFT_MAX_SETS)
            return usage("more than %s --set options", "64");
        a->sets[a->nsets++] = v;
    } else if (!strcmp(o, "--lr") || !strcmp(o, "--logit-scale")) {
        if (parse_num(v, &d) < 0)
            return usage("'%s' is not a positive number", v);
        if (!strcmp(o, "--lr"))
            a->o.lr = d;
        else
            a->o.logit_scale = (float)d;
    } else {
        int zero_ok = !strcmp(o, "--eval-every") || !strcmp(o, "--eval-n");
        if (parse_i64(v, zero_ok ? 0 : 1, &i) < 0 || i > 1000000000)
            return usage("'%s' is not a valid count", v);
        if (!strcmp(o, "--steps"))
            a->o.steps = i;
        else if (!strcmp(o, "--batch"))
            a->o.batch = (int)i;
        else if (!strcmp(o, "--rank"))
            a->o.rank = (int)i;
        else if (!strcmp(o, "--eval-every"))
            a->eval_every = i;
        else if (!strcmp(o, "--eval-n"))
            a->o.eval_n = (int)i;
        else if (!strcmp(o, "--log-every"))
            a->log_every = i;
        else
            return usage("unknown option '%s'", o);
    }
    return 0;
}

static int parse_args(int argc, char **argv, sft_args_t *a) {
    memset(a, 0, sizeof *a);
    a->o = sft_opts_default();
    a->eval_every = 100;
    a->log_every = 50;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--full")) {
            a->o.full = 1;
        } else if (!strncmp(o, "--", 2)) {
            if (i + 1 >= argc)
                return usage("%s needs a value", o);
            int st = parse_valued(a, o, argv[++i]);
            if (st)
                return st;
        } else if (!a->config) {
            a->config = o;
        } else {
            return usage("unexpected argument '%s'", o);
        }
    }
    if (!a->config)
        return usage("%s", "a CONFIG file is required");
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int run_eval(sft_t *s, int64_t step, double t0) {
    eval_result_t r;
    int rc = sft_eval(s, NULL, &r);
    if (rc < 0)
        return rc;
    printf("eval step %lld: accuracy %.3f (%d/%d), reward %.3f, %.1f tokens, %.1f s\n",
           (long long)step, r.accuracy, r.correct, r.n, r.reward_mean, r.tokens_mean, now_s() - t0);
    fflush(stdout);
    return MO_OK;
}

static int train(sft_t *s, const sft_args_t *a, const char *out) {
    double t0 = now_s(), loss_sum = 0;
    int64_t n_loss = 0;
    printf("sft: %s, %s, %lld updates of %d pairs, %zu trainable parameters\n", s->cfg->model.path,
           s->o.full ? "full model (merged adapter)" : "LoRA adapter", (long long)s->o.steps,
           s->o.batch, s->ad->n_params);
    fflush(stdout);
    for (int64_t k = 1; k <= s->o.steps; k++) {
        sft_step_result_t r;
        TRY(sft_step(s, NULL, 0, &r));
        loss_sum += r.loss;
        n_loss++;
        if ((a->log_every > 0 && k % a->log_every == 0) || k == s->o.steps) {
            printf("step %lld/%lld: loss %.4f, lr %.3g, grad norm %.3g, %.1f s\n", (long long)k,
                   (long long)s->o.steps, loss_sum / (double)n_loss, r.lr, r.grad_norm,
                   now_s() - t0);
            fflush(stdout);
            loss_sum = 0;
            n_loss = 0;
        }
        if (a->eval_every > 0 && k % a->eval_every == 0 && k != s->o.steps)
            TRY(run_eval(s, k, t0));
    }
    TRY(run_eval(s, s->o.steps, t0));
    TRY(sft_save(s, out));
    printf("sft: wrote %s %s (%.1f s)\n", s->o.full ? "model" : "adapter", out, now_s() - t0);
    return MO_OK;
}

static int sft_run(int argc, char **argv) {
    sft_args_t a;
    int st = parse_args(argc, argv, &a);
    if (st)
        return st;
    moerl_config_t cfg;
    config_errors_t errs = {0};
    int rc = config_load(&cfg, a.config, a.sets, a.nsets, &errs);
    config_errors_free(&errs);
    if (rc < 0) {
        config_free(&cfg);
        return cli_fail("sft", rc);
    }
    char out[4096], run[4000];
    if (a.out) {
        snprintf(out, sizeof out, "%s", a.out);
    } else {
        rc = config_run_dir(&cfg, run, sizeof run);
        snprintf(out, sizeof out, "%s/%s", run, a.o.full ? "sft-model" : "sft-adapter");
    }
    backend_cpu_set_threads(cfg.run.threads);
    sft_t *s = NULL;
    if (rc == MO_OK)
        rc = sft_new(&s, &cfg, &a.o);
    if (rc == MO_OK)
        rc = train(s, &a, out);
    sft_destroy(&s);
    config_free(&cfg);
    return rc < 0 ? cli_fail("sft", rc) : 0;
}

const cli_command_t cmd_sft = {
    "sft",
    "supervised warm start: train a LoRA adapter or (--full) the whole model on pairs",
    sft_run,
    sft_help,
};
