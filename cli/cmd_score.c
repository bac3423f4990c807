/* cmd_score: `moerl score`: the log-probability of each token of a sequence given its
 * prefix under a model (and optionally an adapter), printed as JSON. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "cli/commands.h"
#include "core/backend.h"
#include "core/status.h"
#include "lora/peft.h"

static void score_help(FILE *out) {
    fputs("usage: moerl score --model DIR (--tokens \"ID ID ...\" | --text TEXT)\n"
          "                   [--adapter DIR] [--temperature T] [--threads N]\n"
          "\n"
          "Runs the model over one sequence and prints, as one line of JSON,\n"
          "  {\"tokens\": [...], \"logprobs\": [null, ...], \"sum\": ...}\n"
          "where logprobs[i] is log p(tokens[i] | tokens[0..i-1]) (the first token has no\n"
          "prefix: null) and sum adds the others. A quick check that a checkpoint loads\n"
          "and computes: a randomly initialised model gives about -log(vocab size) per\n"
          "token, a trained one much more on natural text.\n"
          "\n"
          "options:\n"
          "  --model DIR        Hugging Face model directory (config.json, model.safetensors\n"
          "                     or model.safetensors.index.json, tokenizer.json for --text)\n"
          "  --tokens \"1 2 3\"   token ids, separated by spaces or commas\n"
          "  --text TEXT        text, encoded by DIR's tokenizer (special tokens written in\n"
          "                     the text are recognised; the tokenizer's own prefix and\n"
          "                     suffix, such as a BOS token, are added as Hugging Face does)\n"
          "  --adapter DIR      a LoRA adapter in the PEFT layout (adapter_config.json,\n"
          "                     adapter_model.safetensors) applied to the model\n"
          "  --temperature T    divide the logits by T > 0 (default 1)\n"
          "  --threads N        CPU threads (default: one per core)\n"
          "  -h, --help         this help\n"
          "\n"
          "exit status: 0 scored, 1 error, 2 usage error\n",
          out);
}

typedef struct score_args {
    const char *model, *adapter, *tokens, *text;
    float temperature;
    int threads;
} score_args_t;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl score: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl score --help)\n");
    return 2;
}

static int parse_number(const char *opt, const char *s, double lo, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(*out) || !(*out > lo))
        return usage_error("%s: not a valid value", opt);
    return 0;
}

static int parse_args(int argc, char **argv, score_args_t *a) {
    memset(a, 0, sizeof *a);
    a->temperature = 1.0f;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char **dst = !strcmp(o, "--model")     ? &a->model
                           : !strcmp(o, "--adapter") ? &a->adapter
                           : !strcmp(o, "--tokens")  ? &a->tokens
                           : !strcmp(o, "--text")    ? &a->text
                                                     : NULL;
        int num = !strcmp(o, "--temperature") || !strcmp(o, "--threads");
        if (!dst && !num)
            return usage_error("unknown argument '%s'", o);
        if (i + 1 >= argc)
            return usage_error("%s needs a value", o);
        const char *v = argv[++i];
        double d;
        if (dst) {
            *dst = v;
        } else if (parse_number(o, v, 0.0, &d)) {
            return 2;
        } else if (!strcmp(o, "--threads")) {
            if (d != floor(d) || d > 4096)
                return usage_error("%s: expected a whole number of threads", o);
            a->threads = (int)d;
        } else {
            a->temperature = (float)d;
        }
    }
    if (!a->model)
        return usage_error("%s is required", "--model");
    if (!a->tokens == !a->text)
        return usage_error("%s", "give exactly one of --tokens and --text");
    return 0;
}

/* Parses "1 2, 3" into ids (malloc'd). */
static int parse_tokens(const char *s, int32_t **ids, int *n) {
    size_t cap = strlen(s) / 2 + 1;
    int32_t *v = malloc(sizeof *v * cap);
    if (!v)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int k = 0;
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n')
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX ||
            (*end && *end != ' ' && *end != ',' && *end != '\t' && *end != '\n')) {
            free(v);
            return mo_errorf(MO_EINVAL, "--tokens: '%.*s' is not a token id", (int)strcspn(p, " ,"),
                             p);
        }
        v[k++] = (int32_t)x;
        p = end;
    }
    if (k == 0) {
        free(v);
        return mo_errorf(MO_EINVAL, "--tokens: no token ids given");
    }
    *ids = v;
    *n = k;
    return MO_OK;
}

/* Encodes text with the model directory's tokenizer, adding its prefix and suffix. */
static int encode_text(const char *dir, const char *text, int32_t **ids, int *n) {
    tokenizer_t *tok = NULL;
    TRY(tokenizer_load(dir, &tok));
    int32_t *body = NULL;
    size_t nb = 0;
    int rc = tokenizer_encode(tok, text, strlen(text), true, &body, &nb);
    const int32_t *pre, *suf;
    size_t np = 0, ns = 0;
    if (rc == MO_OK) {
        tokenizer_affixes(tok, &pre, &np, &suf, &ns);
        *n = (int)(np + nb + ns);
        *ids = malloc(sizeof **ids * (size_t)(*n > 0 ? *n : 1));
        if (!*ids)
            rc = mo_errorf(MO_ENOMEM, "out of memory");
    }
    if (rc == MO_OK) {
        if (np)
            memcpy(*ids, pre, sizeof **ids * np);
        if (nb)
            memcpy(*ids + np, body, sizeof **ids * nb);
        if (ns)
            memcpy(*ids + np + nb, suf, sizeof **ids * ns);
        if (*n == 0)
            rc = mo_errorf(MO_EINVAL, "--text: the text encodes to no tokens");
    }
    free(body);
    tokenizer_destroy(&tok);
    return rc;
}

static void print_json(const int32_t *ids, int n, const float *logp) {
    double sum = 0.0;
    printf("{\"tokens\": [");
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? ", " : "", ids[i]);
    printf("], \"logprobs\": [null");
    for (int i = 1; i < n; i++) {
        printf(", %.9g", (double)logp[i - 1]);
        sum += logp[i - 1];
    }
    printf("], \"sum\": %.17g}\n", sum);
}

/* Scores ids with the model (and adapter) and prints the JSON line. */
static int score(const score_args_t *a, model_t *m, const int32_t *ids, int n) {
    int32_t cu[2] = {0, n};
    int32_t *pos = malloc(sizeof *pos * (size_t)n), *tgt = malloc(sizeof *tgt * (size_t)n);
    float *logp = malloc(sizeof *logp * (size_t)n);
    int rc = pos && tgt && logp ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    if (rc == MO_OK) {
        model_batch_next_token(pos, tgt, ids, cu, 1);
        model_batch_t b = {n, 1, ids, pos, cu, tgt, a->temperature, NULL, NULL};
        rc = model_forward(m, &b, logp, NULL, 0);
    }
    for (int i = 0; rc == MO_OK && i + 1 < n; i++)
        if (!isfinite(logp[i]))
            rc = mo_errorf(MO_EMALFORMED,
                           "%s: the log-probability of token %d is not finite (the checkpoint "
                           "may hold non-finite weights)",
                           a->model, i + 1);
    if (rc == MO_OK)
        print_json(ids, n, logp);
    free(pos);
    free(tgt);
    free(logp);
    return rc;
}

static int score_run(int argc, char **argv) {
    score_args_t a;
    int st = parse_args(argc, argv, &a);
    if (st)
        return st;
    if (a.threads > 0)
        backend_cpu_set_threads(a.threads);
    int32_t *ids = NULL;
    int n = 0;
    int rc = a.tokens ? parse_tokens(a.tokens, &ids, &n) : MO_OK;
    if (rc < 0)
        return usage_error("%s", mo_last_error());
    model_t *m = NULL;
    lora_adapter_t *ad = NULL;
    rc = model_open(&m, a.model, NULL);
    if (rc == MO_OK && a.text)
        rc = encode_text(a.model, a.text, &ids, &n);
    if (rc == MO_OK && a.adapter) {
        rc = peft_load_new(&ad, a.adapter, m->modules, m->n_modules, 1);
        if (rc == MO_OK)
            rc = model_set_adapter(m, ad);
        if (rc < 0)
            mo_error_wrap(rc, "adapter %s", a.adapter);
    }
    if (rc == MO_OK)
        rc = score(&a, m, ids, n);
    model_destroy(&m);
    lora_adapter_destroy(&ad);
    free(ids);
    if (rc < 0) {
        cli_fail("score", rc);
        return 1;
    }
    return fflush(stdout) == 0 ? 0 : 1;
}

const cli_command_t cmd_score = {
    "score",
    "print each token's log-probability under a model (and adapter) as JSON",
    score_run,
    score_help,
};
