/* cmd_generate: `moerl generate`: completions of prompts by the rollout engine, one
 * JSON line per completion (text, token ids, logprobs, finish reason, adapter version,
 * routing on request). */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "actor/unicode.h"
#include "cli/commands.h"
#include "core/backend.h"
#include "core/status.h"
#include "lora/peft.h"
#include "rollout/engine.h"

#define MAX_STOPS 16

static void generate_help(FILE *out) {
    fputs(
        "usage: moerl generate --model DIR (--prompt TEXT | --prompts FILE.jsonl) [options]\n"
        "\n"
        "Generates n completions of each prompt with the rollout engine (batched, KV cache)\n"
        "and prints one JSON line per completion, prompts in input order:\n"
        "  {\"prompt_id\", \"sample\", \"text\", \"token_ids\", \"logprobs\", \"finish_reason\",\n"
        "   \"adapter_version\", \"adapter_version_first\", \"prompt_tokens\"[, \"routing\"]\n"
        "   [, \"prompt_routing\"]}\n"
        "logprobs[i] is log p(token i) under the temperature-scaled distribution before\n"
        "top-k / top-p / min-p truncation (greedy, temperature 0: under temperature 1).\n"
        "finish_reason: length, stop_token (eos or --stop-id; it is the last token id),\n"
        "stop_string (the text ends before the stop string). Invalid UTF-8 in the text is\n"
        "written as U+FFFD; token_ids are exact. routing[i][m] lists the K experts token i\n"
        "was routed to in the m-th MoE layer. A request that cannot run gets one line\n"
        "{\"prompt_id\", \"error\"} and the others still run.\n"
        "\n"
        "options:\n"
        "  --model DIR          Hugging Face model directory (config.json, weights,\n"
        "                       tokenizer.json)\n"
        "  --adapter DIR        LoRA adapter in the PEFT layout\n"
        "  --adapter-version V  version recorded for the adapter (default 1 with --adapter,\n"
        "                       0 without)\n"
        "  --merge              fold the adapter into copies of the weights it adapts\n"
        "  --prompt TEXT        one prompt (prompt_id 0)\n"
        "  --prompts FILE       JSON lines: {\"prompt\": TEXT} or {\"prompt_ids\": [ids]}, with\n"
        "                       optional \"id\" (echoed as prompt_id; default: the line's\n"
        "                       index among prompts) and per-prompt \"n\", \"max_tokens\",\n"
        "                       \"temperature\", \"top_p\", \"top_k\", \"min_p\", \"seed\"\n"
        "  -n G                 completions per prompt (default 1)\n"
        "  --max-tokens N       most new tokens per completion (default 256)\n"
        "  --temperature T      0 = greedy (default 1)\n"
        "  --top-p P            nucleus mass in (0, 1] (default 1 = off)\n"
        "  --top-k K            keep the K most likely tokens (default 0 = off)\n"
        "  --min-p P            drop tokens below P times the top probability (default 0)\n"
        "  --seed S             draws are keyed on (seed, prompt index, sample, token)\n"
        "  --stop STR           stop string (repeatable, up to 16)\n"
        "  --stop-id ID         extra stop token id (repeatable, up to 16)\n"
        "  --ignore-eos         do not stop at the model's / tokenizer's eos\n"
        "  --routing            add each generated token's experts\n"
        "  --prompt-routing     add the prompt tokens' experts\n"
        "  --template STR       prompt template with {prompt} ({{ and }} are braces), e.g.\n"
        "                       "
        "\"<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n\"\n"
        "                       (special tokens in the templated text are recognised)\n"
        "  --max-batch N        samples decoded together (default 64)\n"
        "  --kv-tokens N        KV cache budget in tokens (default max-batch * max-seq-len)\n"
        "  --max-seq-len N      prompt + completion tokens (default min(2048, the model's))\n"
        "  --threads N          CPU threads (default: one per core)\n"
        "  --device D           cpu (default) or cuda: prefill, decode and sampling on the\n"
        "                       GPU (builds with the CUDA backend; not with --merge)\n"
        "  -h, --help           this help\n"
        "\n"
        "exit status: 0 all requests completed, 1 some failed (their lines say why) or a\n"
        "fatal error, 2 usage error\n",
        out);
}

typedef struct gen_args {
    const char *model, *adapter, *prompt, *prompts, *tmpl, *device;
    int n, max_tokens, top_k, threads, max_batch, max_seq_len;
    int routing, prompt_routing, ignore_eos, merge;
    int64_t kv_tokens, version;
    uint64_t seed;
    float temperature, top_p, min_p;
    const char *stops[MAX_STOPS];
    int n_stops;
    int32_t stop_ids[MAX_STOPS];
    int n_stop_ids;
} gen_args_t;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "moerl generate: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see moerl generate --help)\n");
    return 2;
}

static int parse_double(const char *opt, const char *s, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    if (!*s || *end || errno || isnan(*out))
        return usage_error("%s: not a number", opt);
    return 0;
}

/* A whole number in [lo, hi]. */
static int parse_int(const char *opt, const char *s, double lo, double hi, int64_t *out) {
    double d;
    if (parse_double(opt, s, &d))
        return 2;
    if (d != floor(d) || d < lo || d > hi)
        return usage_error("%s: expected a whole number in range", opt);
    *out = (int64_t)d;
    return 0;
}

static const char *const flag_opts[] = {"--routing", "--prompt-routing", "--ignore-eos", "--merge",
                                        NULL};

static int set_flag(gen_args_t *a, const char *o) {
    if (!strcmp(o, "--routing"))
        a->routing = 1;
    else if (!strcmp(o, "--prompt-routing"))
        a->prompt_routing = 1;
    else if (!strcmp(o, "--ignore-eos"))
        a->ignore_eos = 1;
    else
        a->merge = 1;
    return 0;
}

static int set_string(gen_args_t *a, const char *o, const char *v) {
    const char **dst = !strcmp(o, "--model")      ? &a->model
                       : !strcmp(o, "--adapter")  ? &a->adapter
                       : !strcmp(o, "--prompt")   ? &a->prompt
                       : !strcmp(o, "--prompts")  ? &a->prompts
                       : !strcmp(o, "--template") ? &a->tmpl
                       : !strcmp(o, "--device")   ? &a->device
                                                  : NULL;
    if (dst) {
        *dst = v;
        return 0;
    }
    if (strcmp(o, "--stop") != 0)
        return -1;
    if (a->n_stops == MAX_STOPS)
        return usage_error("%s: at most 16", o);
    a->stops[a->n_stops++] = v;
    return 0;
}

/* Numeric options; -1 when o is not one. Ranges the engine checks per request (sampling
 * values) are only parsed here. */
static int set_number(gen_args_t *a, const char *o, const char *v) {
    double d;
    int64_t x;
    if (!strcmp(o, "--temperature") || !strcmp(o, "--top-p") || !strcmp(o, "--min-p")) {
        if (parse_double(o, v, &d))
            return 2;
        float *dst = !strcmp(o, "--temperature") ? &a->temperature
                     : !strcmp(o, "--top-p")     ? &a->top_p
                                                 : &a->min_p;
        *dst = (float)d;
        return 0;
    }
    struct {
        const char *name;
        double lo, hi;
    } ints[] = {{"-n", -1e9, 1e9},
                {"--max-tokens", -1e9, 1e9},
                {"--top-k", -1e9, 1e9},
                {"--seed", 0, 9007199254740992.0},
                {"--threads", 1, 4096},
                {"--max-batch", 1, 1 << 20},
                {"--kv-tokens", 1, 1e15},
                {"--max-seq-len", 2, 1 << 24},
                {"--adapter-version", -9007199254740992.0, 9007199254740992.0},
                {"--stop-id", 0, 2147483647.0}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        if (strcmp(o, ints[i].name) != 0)
            continue;
        if (parse_int(o, v, ints[i].lo, ints[i].hi, &x))
            return 2;
        switch (i) {
        case 0: a->n = (int)x; break;
        case 1: a->max_tokens = (int)x; break;
        case 2: a->top_k = (int)x; break;
        case 3: a->seed = (uint64_t)x; break;
        case 4: a->threads = (int)x; break;
        case 5: a->max_batch = (int)x; break;
        case 6: a->kv_tokens = x; break;
        case 7: a->max_seq_len = (int)x; break;
        case 8: a->version = x; break;
        default:
            if (a->n_stop_ids == MAX_STOPS)
                return usage_error("%s: at most 16", o);
            a->stop_ids[a->n_stop_ids++] = (int32_t)x;
        }
        return 0;
    }
    return -1;
}

static int parse_args(int argc, char **argv, gen_args_t *a) {
    memset(a, 0, sizeof *a);
    a->n = 1;
    a->max_tokens = 256;
    a->temperature = 1.0f;
    a->top_p = 1.0f;
    a->version = -1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        int is_flag = 0;
        for (int f = 0; flag_opts[f]; f++)
            is_flag |= !strcmp(o, flag_opts[f]);
        if (is_flag) {
            set_flag(a, o);
            continue;
        }
        if (i + 1 >= argc)
            return usage_error("%s needs a value (or is unknown)", o);
        const char *v = argv[++i];
        int rc = set_string(a, o, v);
        if (rc < 0)
            rc = set_number(a, o, v);
        if (rc < 0)
            return usage_error("unknown argument '%s'", o);
        if (rc)
            return rc;
    }
    if (!a->model)
        return usage_error("%s is required", "--model");
    if (!a->prompt == !a->prompts)
        return usage_error("%s", "give exactly one of --prompt and --prompts");
    if (a->device && strcmp(a->device, "cpu") != 0 && strcmp(a->device, "cuda") != 0)
        return usage_error("--device: expected cpu or cuda, got '%s'", a->device);
    if (a->version < 0)
        a->version = a->adapter ? 1 : 0;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Prompts.                                                                  */

/* One prompt as read: its request (ids owned), the echoed id, or an error. */
typedef struct prompt_in {
    gen_request_t req;
    int32_t *ids;
    char *id_json; /* prompt_id as JSON text */
    char *error;   /* a message when the line could not be read */
} prompt_in_t;

static char *dup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *dup_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = malloc((size_t)n + 1);
    if (s) {
        va_start(ap, fmt);
        vsnprintf(s, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    return s;
}

/* Template, tokenizer prefix and suffix, encoding: ids malloc'd. */
static int encode_prompt(const tokenizer_t *tok, const char *tmpl, const char *text, int32_t **ids,
                         int *n) {
    char *full = NULL;
    if (tmpl)
        TRY(tokenizer_apply_template(tmpl, text, &full));
    int32_t *body = NULL;
    size_t nb = 0;
    const char *src = full ? full : text;
    int rc = tokenizer_encode(tok, src, strlen(src), true, &body, &nb);
    free(full);
    TRY(rc);
    const int32_t *pre, *suf;
    size_t np = 0, ns = 0;
    tokenizer_affixes(tok, &pre, &np, &suf, &ns);
    *n = (int)(np + nb + ns);
    *ids = malloc(sizeof **ids * (size_t)(*n + 1));
    if (!*ids) {
        free(body);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    if (np)
        memcpy(*ids, pre, sizeof **ids * np);
    if (nb)
        memcpy(*ids + np, body, sizeof **ids * nb);
    if (ns)
        memcpy(*ids + np + nb, suf, sizeof **ids * ns);
    free(body);
    return MO_OK;
}

/* Per-prompt overrides of a JSON line; MO_EMALFORMED names a bad field. */
static int line_overrides(const cJSON *o, gen_request_t *r) {
    static const char *const keys[] = {"n",     "max_tokens", "temperature", "top_p",
                                       "top_k", "min_p",      "seed"};
    for (int k = 0; k < 7; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[k]);
        if (!v)
            continue;
        if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
            ((k == 0 || k == 1 || k == 4 || k == 6) &&
             (v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > 2e9)))
            return mo_errorf(MO_EMALFORMED, "\"%s\" must be a %s", keys[k],
                             k == 2 || k == 3 || k == 5 ? "number" : "whole number");
        double d = v->valuedouble;
        switch (k) {
        case 0: r->n = (int)d; break;
        case 1: r->params.max_new_tokens = (int)d; break;
        case 2: r->params.sampling.temperature = (float)d; break;
        case 3: r->params.sampling.top_p = (float)d; break;
        case 4: r->params.sampling.top_k = (int)d; break;
        case 5: r->params.sampling.min_p = (float)d; break;
        default:
            if (d < 0)
                return mo_errorf(MO_EMALFORMED, "\"seed\" must be >= 0");
            r->params.seed = (uint64_t)d;
        }
    }
    return MO_OK;
}

/* prompt_ids: an array of whole numbers (range checked by the engine). */
static int line_ids(const cJSON *arr, prompt_in_t *p) {
    int n = cJSON_GetArraySize(arr);
    p->ids = malloc(sizeof *p->ids * (size_t)(n + 1));
    if (!p->ids)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
            fabs(v->valuedouble) > 2147483647.0)
            return mo_errorf(MO_EMALFORMED, "\"prompt_ids\"[%d] is not a token id", i);
        p->ids[i++] = (int32_t)v->valuedouble;
    }
    p->req.prompt_len = n;
    return MO_OK;
}

static int read_line(const char *line, const tokenizer_t *tok, const char *tmpl, prompt_in_t *p) {
    cJSON *o = cJSON_Parse(line);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return mo_errorf(MO_EMALFORMED, "not a JSON object");
    }
    int rc = MO_OK;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    if (id && (cJSON_IsString(id) || cJSON_IsNumber(id))) {
        char *s = cJSON_PrintUnformatted(id);
        if (s) {
            free(p->id_json);
            p->id_json = s;
        }
    } else if (id) {
        rc = mo_errorf(MO_EMALFORMED, "\"id\" must be a string or a number");
    }
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(o, "prompt_ids");
    if (rc == MO_OK && cJSON_IsString(text) && !ids)
        rc = encode_prompt(tok, tmpl, text->valuestring, &p->ids, &p->req.prompt_len);
    else if (rc == MO_OK && cJSON_IsArray(ids) && !text)
        rc = line_ids(ids, p);
    else if (rc == MO_OK)
        rc = mo_errorf(MO_EMALFORMED, "needs a string \"prompt\" or an array \"prompt_ids\"");
    if (rc == MO_OK)
        rc = line_overrides(o, &p->req);
    cJSON_Delete(o);
    return rc;
}

/* Reads the prompts (one for --prompt); per-line problems are kept in p->error. */
static int read_prompts(const gen_args_t *a, const tokenizer_t *tok, const gen_request_t *base,
                        prompt_in_t **out, int *n_out) {
    FILE *f = NULL;
    if (a->prompts && !(f = fopen(a->prompts, "r")))
        return mo_errorf(MO_EIO, "%s: cannot open: %s", a->prompts, strerror(errno));
    prompt_in_t *ps = NULL;
    int n = 0, cap = 0, rc = MO_OK;
    char *line = NULL;
    size_t lcap = 0;
    for (;;) {
        const char *text = a->prompt;
        if (f) {
            ssize_t len = getline(&line, &lcap, f);
            if (len < 0)
                break;
            if (strspn(line, " \t\r\n") == (size_t)len)
                continue;
            text = line;
        } else if (n == 1) {
            break;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            prompt_in_t *t = realloc(ps, sizeof *t * (size_t)cap);
            if (!t) {
                rc = mo_errorf(MO_ENOMEM, "out of memory");
                break;
            }
            ps = t;
        }
        prompt_in_t *p = &ps[n];
        memset(p, 0, sizeof *p);
        p->req = *base;
        p->req.id = (uint64_t)n;
        p->id_json = dup_printf("%d", n);
        n++;
        int r = f ? read_line(text, tok, a->tmpl, p)
                  : encode_prompt(tok, a->tmpl, text, &p->ids, &p->req.prompt_len);
        if (r < 0)
            p->error =
                dup_printf("%s: %s", f ? a->prompts : "--prompt", mo_last_error());
        p->req.prompt = p->ids;
    }
    free(line);
    if (f)
        fclose(f);
    *out = ps;
    *n_out = n;
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Output.                                                                   */

/* A JSON string: escapes, and U+FFFD for bytes that are not well-formed UTF-8. */
static void put_json_string(FILE *out, const char *s, size_t n) {
    fputc('"', out);
    for (size_t i = 0; i < n;) {
        size_t len;
        uint32_t cp = uni_next(s + i, n - i, &len);
        if (cp == UNI_INVALID)
            fputs("\\ufffd", out);
        else if (cp == '"' || cp == '\\')
            fprintf(out, "\\%c", (char)cp);
        else if (cp == '\n')
            fputs("\\n", out);
        else if (cp == '\t')
            fputs("\\t", out);
        else if (cp < 0x20 || cp == 0x7f)
            fprintf(out, "\\u%04x", cp);
        else
            fwrite(s + i, 1, len, out);
        i += len;
    }
    fputc('"', out);
}

/* rows (n, M, K) as nested arrays. */
static void put_routing(FILE *out, const uint16_t *r, int n, int M, int K) {
    fputc('[', out);
    for (int t = 0; t < n; t++) {
        fputs(t ? ", [" : "[", out);
        for (int m = 0; m < M; m++) {
            fputs(m ? ", [" : "[", out);
            for (int k = 0; k < K; k++)
                fprintf(out, "%s%u", k ? ", " : "", r[((size_t)t * M + m) * K + k]);
            fputc(']', out);
        }
        fputc(']', out);
    }
    fputc(']', out);
}

static void put_sample(FILE *out, const char *id, const gen_group_t *g, const gen_sample_t *s,
                       const gen_args_t *a) {
    fprintf(out, "{\"prompt_id\": %s, \"sample\": %d, \"text\": ", id, s->index);
    put_json_string(out, s->text ? s->text : "", s->text ? s->text_len : 0);
    fputs(", \"token_ids\": [", out);
    for (int i = 0; i < s->n_tokens; i++)
        fprintf(out, "%s%d", i ? ", " : "", s->tokens[i]);
    fputs("], \"logprobs\": [", out);
    for (int i = 0; i < s->n_tokens; i++)
        fprintf(out, "%s%.9g", i ? ", " : "", (double)s->logprobs[i]);
    fprintf(out,
            "], \"finish_reason\": \"%s\", \"adapter_version\": %lld, "
            "\"adapter_version_first\": %lld, \"prompt_tokens\": %d",
            finish_reason_name(s->finish), (long long)s->version_last, (long long)s->version_first,
            g->prompt_len);
    if (a->routing && s->routing) {
        fputs(", \"routing\": ", out);
        put_routing(out, s->routing, s->n_tokens, g->M, g->K);
    }
    if (a->prompt_routing && g->prompt_routing) {
        fputs(", \"prompt_routing\": ", out);
        put_routing(out, g->prompt_routing, g->prompt_len, g->M, g->K);
    }
    fputs("}\n", out);
}

static void put_error(FILE *out, const char *id, const char *msg) {
    fprintf(out, "{\"prompt_id\": %s, \"error\": ", id);
    put_json_string(out, msg, strlen(msg));
    fputs("}\n", out);
}

/* ------------------------------------------------------------------------ */
/* Run.                                                                      */

static int load(const gen_args_t *a, model_t **m, tokenizer_t **tok, lora_adapter_t **ad) {
    TRY(model_open(m, a->model, NULL));
    TRY(tokenizer_load(a->model, tok));
    if (a->adapter)
        TRY(peft_load_new(ad, a->adapter, (*m)->modules, (*m)->n_modules, 1));
    return MO_OK;
}

static gen_request_t base_request(const gen_args_t *a) {
    gen_request_t r;
    memset(&r, 0, sizeof r);
    r.n = a->n;
    r.params = gen_params_default();
    r.params.sampling.temperature = a->temperature;
    r.params.sampling.top_p = a->top_p;
    r.params.sampling.top_k = a->top_k;
    r.params.sampling.min_p = a->min_p;
    r.params.max_new_tokens = a->max_tokens;
    r.params.seed = a->seed;
    r.params.stop_strings = a->stops;
    r.params.n_stop_strings = a->n_stops;
    r.params.stop_ids = a->stop_ids;
    r.params.n_stop_ids = a->n_stop_ids;
    r.params.ignore_eos = a->ignore_eos;
    r.params.record_routing = a->routing;
    r.params.record_prompt_routing = a->prompt_routing;
    return r;
}

/* Runs the readable prompts and prints every line in input order; *failed counts the
 * requests that got an error line. */
static int run_prompts(engine_t *e, prompt_in_t *ps, int n, const gen_args_t *a, int *failed) {
    gen_request_t *reqs = malloc(sizeof *reqs * (size_t)(n + 1));
    int *which = malloc(sizeof *which * (size_t)(n + 1));
    gen_group_t **groups = calloc((size_t)n + 1, sizeof *groups);
    int rc = reqs && which && groups ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    int nr = 0;
    for (int i = 0; rc == MO_OK && i < n; i++)
        if (!ps[i].error) {
            which[nr] = i;
            reqs[nr++] = ps[i].req;
        }
    if (rc == MO_OK)
        rc = engine_generate(e, reqs, nr, groups);
    for (int i = 0, r = 0; i < n && groups; i++) {
        const prompt_in_t *p = &ps[i];
        if (p->error) {
            put_error(stdout, p->id_json, p->error);
            (*failed)++;
            continue;
        }
        gen_group_t *g = r < nr && which[r] == i ? groups[r++] : NULL;
        if (!g || g->status < 0) {
            put_error(stdout, p->id_json, g && g->error ? g->error : "not run");
            (*failed)++;
        } else {
            for (int j = 0; j < g->n; j++)
                put_sample(stdout, p->id_json, g, &g->samples[j], a);
        }
        fflush(stdout);
    }
    for (int i = 0; groups && i < nr; i++)
        gen_group_free(&groups[i]);
    free(groups);
    free(reqs);
    free(which);
    return rc;
}

static int generate_run(int argc, char **argv) {
    gen_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    if (a.threads > 0)
        backend_cpu_set_threads(a.threads);
    model_t *m = NULL;
    tokenizer_t *tok = NULL;
    lora_adapter_t *ad = NULL;
    engine_t *e = NULL;
    prompt_in_t *ps = NULL;
    int n = 0, failed = 0;
    rc = load(&a, &m, &tok, &ad);
    engine_opts_t eo;
    memset(&eo, 0, sizeof eo);
    eo.max_batch = a.max_batch;
    eo.kv_cache_tokens = a.kv_tokens;
    eo.max_seq_len = a.max_seq_len;
    eo.merge_adapter = a.merge;
    eo.device = a.device && !strcmp(a.device, "cuda") ? DEV_CUDA : DEV_CPU;
    eo.tok = tok;
    if (rc == MO_OK)
        rc = engine_new(&e, m, &eo);
    if (rc == MO_OK)
        rc = engine_set_adapter(e, ad, a.version);
    gen_request_t base = base_request(&a);
    if (rc == MO_OK)
        rc = read_prompts(&a, tok, &base, &ps, &n);
    if (rc == MO_OK)
        rc = run_prompts(e, ps, n, &a, &failed);
    int status = rc < 0 ? cli_fail("generate", rc) : failed ? 1 : 0;
    if (status == 1 && rc == MO_OK)
        fprintf(stderr, "moerl generate: %d of %d requests failed\n", failed, n);
    for (int i = 0; i < n; i++) {
        free(ps[i].ids);
        free(ps[i].id_json);
        free(ps[i].error);
    }
    free(ps);
    engine_destroy(&e);
    lora_adapter_destroy(&ad);
    tokenizer_destroy(&tok);
    model_destroy(&m);
    return status == 2 ? 1 : status;
}

const cli_command_t cmd_generate = {
    "generate",
    "generate completions of prompts with the rollout engine (JSON lines)",
    generate_run,
    generate_help,
};
