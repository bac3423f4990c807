/* reward: the spec parser, reward function objects (a weighted list of
 * built-in or plugin terms), single and group scoring, and the holder that
 * swaps functions under scoring. */
#include "reward/reward.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "reward/reward_internal.h"

#define SPEC_MAX_TERMS 64
#define SPEC_MAX_OPTS 32
#define LABEL_CAP 80

typedef struct term {
    const reward_builtin_t *def;
    void *state;
    double weight;
    bool weighted;         /* written with "w*" */
    char label[LABEL_CAP]; /* "0.8*numeric" or "numeric", for messages and details */
    char part[LABEL_CAP];  /* "numeric", "numeric#2": the part's name */
} term_t;

struct reward_fn {
    char *desc;
    int n;
    term_t *terms; /* (n) */
};

void reward_input_init(reward_input_t *in, const char *prompt, const char *completion,
                       const char *answer) {
    memset(in, 0, sizeof *in);
    in->prompt = prompt ? prompt : "";
    in->prompt_len = strlen(in->prompt);
    in->completion = completion ? completion : "";
    in->completion_len = strlen(in->completion);
    in->answer = answer ? answer : "";
    in->answer_len = strlen(in->answer);
    in->finish_reason = MOERL_FINISH_STOP;
    in->completion_tokens = -1;
    in->sample_index = 0;
    in->group_size = 1;
}

void reward_detailf(char *detail, size_t cap, const char *fmt, ...) {
    if (!detail || cap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, cap, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------------
 * Parser
 * ---------------------------------------------------------------------- */

typedef struct parser {
    const char *s; /* the spec */
    size_t i;      /* next character */
} parser_t;

static int parse_error(const parser_t *p, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int parse_error(const parser_t *p, size_t at, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return mo_errorf(MO_EINVAL, "reward spec \"%.200s\": column %zu: %s", p->s, at + 1, what);
}

static void skip_ws(parser_t *p) {
    while (p->s[p->i] == ' ' || p->s[p->i] == '\t')
        p->i++;
}

static size_t ident_len(const char *s) {
    size_t n = 0;
    if (!(isalpha((unsigned char)s[0]) || s[0] == '_'))
        return 0;
    while (isalnum((unsigned char)s[n]) || s[n] == '_')
        n++;
    return n;
}

static bool starts_weight(const char *s) {
    return isdigit((unsigned char)s[0]) || s[0] == '.' || s[0] == '-';
}

/* Does s[j..] (after spaces) begin a term: "weight *" or a built-in name
 * followed by ':', '+' or the end? Decides whether a '+' in a bare value
 * separates terms. */
static bool term_starts_at(const char *s, size_t j) {
    while (s[j] == ' ' || s[j] == '\t')
        j++;
    if (starts_weight(s + j)) {
        char *end;
        strtod(s + j, &end);
        if (end == s + j)
            return false;
        while (*end == ' ' || *end == '\t')
            end++;
        return *end == '*';
    }
    size_t n = ident_len(s + j);
    if (n == 0 || !reward_builtin_find(s + j, n))
        return false;
    j += n;
    while (s[j] == ' ' || s[j] == '\t')
        j++;
    return s[j] == ':' || s[j] == '+' || s[j] == '\0';
}

static int parse_quoted(parser_t *p, char **out) {
    size_t open = p->i++;
    size_t cap = strlen(p->s + p->i) + 1, n = 0;
    char *v = malloc(cap);
    if (!v)
        return mo_errorf(MO_ENOMEM, "reward spec: out of memory");
    for (;;) {
        char c = p->s[p->i];
        if (c == '\0') {
            free(v);
            return parse_error(p, open, "unterminated quote");
        }
        p->i++;
        if (c == '"')
            break;
        if (c == '\\' && (p->s[p->i] == '"' || p->s[p->i] == '\\'))
            c = p->s[p->i++];
        v[n++] = c;
    }
    v[n] = '\0';
    *out = v;
    return MO_OK;
}

static int parse_bare(parser_t *p, char **out) {
    size_t b = p->i, e = p->i;
    for (;;) {
        char c = p->s[e];
        if (c == '\0' || c == ',' || (c == '+' && term_starts_at(p->s, e + 1)))
            break;
        e++;
    }
    p->i = e;
    while (e > b && (p->s[e - 1] == ' ' || p->s[e - 1] == '\t'))
        e--;
    char *v = malloc(e - b + 1);
    if (!v)
        return mo_errorf(MO_ENOMEM, "reward spec: out of memory");
    memcpy(v, p->s + b, e - b);
    v[e - b] = '\0';
    *out = v;
    return MO_OK;
}

static void free_opts(reward_opt_t *o, int n) {
    for (int i = 0; i < n; i++) {
        free(o[i].key);
        free(o[i].value);
    }
}

static int parse_option(parser_t *p, reward_opt_t *opts, int n) {
    skip_ws(p);
    size_t kb = p->i, kn = ident_len(p->s + kb);
    if (kn == 0)
        return p->s[kb] ? parse_error(p, kb, "expected an option name, got '%c'", p->s[kb])
                        : parse_error(p, kb, "expected an option name, got the end of the spec");
    for (int k = 0; k < n; k++)
        if (strlen(opts[k].key) == kn && !strncmp(opts[k].key, p->s + kb, kn))
            return parse_error(p, kb, "option '%s' given twice", opts[k].key);
    if (n == SPEC_MAX_OPTS)
        return parse_error(p, kb, "more than %d options", SPEC_MAX_OPTS);
    p->i += kn;
    skip_ws(p);
    if (p->s[p->i] != '=')
        return parse_error(p, p->i, "expected '=' after option '%.*s'", (int)kn, p->s + kb);
    p->i++;
    skip_ws(p);
    reward_opt_t *o = &opts[n];
    memset(o, 0, sizeof *o);
    o->key_col = (int)kb + 1;
    o->quoted = p->s[p->i] == '"';
    o->value_col = (int)p->i + 1 + o->quoted;
    if (!(o->key = strndup(p->s + kb, kn)))
        return mo_errorf(MO_ENOMEM, "reward spec: out of memory");
    int rc = o->quoted ? parse_quoted(p, &o->value) : parse_bare(p, &o->value);
    if (rc < 0) {
        free(o->key);
        return rc;
    }
    skip_ws(p);
    return MO_OK;
}

/* "w*" before a name: *weighted stays false when the term has none. */
static int parse_weight(parser_t *p, double *w, bool *weighted) {
    *weighted = false;
    *w = 1.0;
    if (!starts_weight(p->s + p->i))
        return MO_OK;
    size_t at = p->i;
    char *end;
    double v = strtod(p->s + at, &end);
    if (end == p->s + at)
        return parse_error(p, at, "expected a weight or a reward function name");
    if (!isfinite(v))
        return parse_error(p, at, "weight is not finite");
    p->i = (size_t)(end - p->s);
    skip_ws(p);
    if (p->s[p->i] != '*')
        return parse_error(p, p->i, "expected '*' after the weight %.*s", (int)(end - (p->s + at)),
                           p->s + at);
    p->i++;
    skip_ws(p);
    *w = v;
    *weighted = true;
    return MO_OK;
}

static int unknown_name(const parser_t *p, size_t at, size_t n) {
    char list[512];
    size_t len = 0;
    list[0] = '\0';
    for (int i = 0; i < reward_n_builtins && len < sizeof list; i++)
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "",
                                reward_builtins[i].name);
    return parse_error(p, at, "unknown reward function '%.*s' (built-ins: %s)", (int)n, p->s + at,
                       list);
}

static int parse_options(parser_t *p, reward_opt_t *opts, int *n) {
    for (;;) {
        TRY(parse_option(p, opts, *n));
        (*n)++;
        if (p->s[p->i] != ',')
            return MO_OK;
        p->i++;
    }
}

static int parse_term(parser_t *p, term_t *t) {
    skip_ws(p);
    TRY(parse_weight(p, &t->weight, &t->weighted));
    size_t nb = p->i, nn = ident_len(p->s + nb);
    if (nn == 0)
        return p->s[nb]
                   ? parse_error(p, nb, "expected a reward function name, got '%c'", p->s[nb])
                   : parse_error(p, nb, "expected a reward function name, got the end of the spec");
    const reward_builtin_t *def = reward_builtin_find(p->s + nb, nn);
    if (!def)
        return unknown_name(p, nb, nn);
    p->i += nn;
    skip_ws(p);
    reward_opt_t opts[SPEC_MAX_OPTS];
    int n = 0, rc = MO_OK;
    if (p->s[p->i] == ':') {
        p->i++;
        rc = parse_options(p, opts, &n);
    }
    int bad = -1;
    if (rc == MO_OK && (rc = def->make(opts, n, &t->state, &bad)) < 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", mo_last_error());
        rc =
            parse_error(p, bad >= 0 ? (size_t)opts[bad].key_col - 1 : nb, "%s: %s", def->name, why);
    }
    free_opts(opts, n);
    if (rc < 0)
        return rc;
    t->def = def;
    if (t->weighted)
        snprintf(t->label, LABEL_CAP, "%g*%s", t->weight, def->name);
    else
        snprintf(t->label, LABEL_CAP, "%s", def->name);
    return MO_OK;
}

static int fn_alloc(const char *desc, int cap, reward_fn_t **out) {
    reward_fn_t *fn = calloc(1, sizeof *fn);
    if (!fn || !(fn->desc = strdup(desc)) || !(fn->terms = calloc((size_t)cap, sizeof(term_t)))) {
        if (fn)
            free(fn->desc);
        free(fn);
        return mo_errorf(MO_ENOMEM, "reward function: out of memory");
    }
    *out = fn;
    return MO_OK;
}

/* Part names: the term's function, "#k" on its k-th repeat. */
static void name_parts(reward_fn_t *fn) {
    for (int i = 0; i < fn->n; i++) {
        int k = 1;
        for (int j = 0; j < i; j++)
            k += fn->terms[j].def == fn->terms[i].def;
        if (k == 1)
            snprintf(fn->terms[i].part, LABEL_CAP, "%s", fn->terms[i].def->name);
        else
            snprintf(fn->terms[i].part, LABEL_CAP, "%s#%d", fn->terms[i].def->name, k);
    }
}

int reward_fn_parse(const char *spec, reward_fn_t **out) {
    *out = NULL;
    if (!spec)
        return mo_errorf(MO_EINVAL, "reward spec: NULL");
    parser_t p = {spec, 0};
    skip_ws(&p);
    if (spec[p.i] == '\0')
        return mo_errorf(MO_EINVAL, "reward spec is empty: name a reward function (e.g. exact)");
    reward_fn_t *fn = NULL;
    TRY(fn_alloc(spec, SPEC_MAX_TERMS, &fn));
    int rc = MO_OK;
    for (;;) {
        if (fn->n == SPEC_MAX_TERMS) {
            rc = parse_error(&p, p.i, "more than %d terms", SPEC_MAX_TERMS);
            break;
        }
        if ((rc = parse_term(&p, &fn->terms[fn->n])) < 0)
            break;
        fn->n++;
        skip_ws(&p);
        if (spec[p.i] == '\0')
            break;
        if (spec[p.i] != '+') {
            rc = parse_error(&p, p.i, "expected '+' or the end of the spec, got '%c'", spec[p.i]);
            break;
        }
        p.i++;
    }
    if (rc < 0) {
        reward_fn_destroy(&fn);
        return rc;
    }
    name_parts(fn);
    *out = fn;
    return MO_OK;
}

int reward_fn_plugin(const char *path, const char *args, reward_fn_t **out) {
    *out = NULL;
    char desc[1024];
    snprintf(desc, sizeof desc, "plugin %s %s", path ? path : "", args ? args : "");
    reward_plugin_t *pl;
    TRY(reward_plugin_open(path, args, &pl));
    reward_fn_t *fn = NULL;
    int rc = fn_alloc(desc, 1, &fn);
    if (rc < 0) {
        reward_plugin_close(&pl);
        return rc;
    }
    fn->n = 1;
    fn->terms[0].def = reward_builtin_find("plugin", 6);
    fn->terms[0].state = pl;
    fn->terms[0].weight = 1.0;
    snprintf(fn->terms[0].label, LABEL_CAP, "plugin");
    snprintf(fn->terms[0].part, LABEL_CAP, "plugin");
    *out = fn;
    return MO_OK;
}

int reward_fn_from_config(const char *function, const char *plugin, reward_fn_t **out) {
    if (plugin && plugin[0])
        return reward_fn_plugin(plugin, function ? function : "", out);
    return reward_fn_parse(function, out);
}

void reward_fn_destroy(reward_fn_t **pfn) {
    reward_fn_t *fn = *pfn;
    if (!fn)
        return;
    for (int i = 0; i < fn->n; i++)
        fn->terms[i].def->free(fn->terms[i].state);
    free(fn->terms);
    free(fn->desc);
    free(fn);
    *pfn = NULL;
}

const char *reward_fn_describe(const reward_fn_t *fn) {
    return fn->desc;
}

int reward_fn_n_parts(const reward_fn_t *fn) {
    return fn->n;
}

const char *reward_fn_part_name(const reward_fn_t *fn, int i) {
    return i >= 0 && i < fn->n ? fn->terms[i].part : NULL;
}

/* ------------------------------------------------------------------------
 * Scoring
 * ---------------------------------------------------------------------- */

static int score_term(const term_t *t, const reward_input_t *in, double *r, char *detail,
                      size_t cap) {
    if (detail && cap)
        detail[0] = '\0';
    double v = NAN;
    int rc = t->def->score(t->state, in, &v, detail, cap);
    if (rc < 0)
        return mo_error_wrap(rc, "%s", t->label);
    if (!isfinite(v))
        return mo_errorf(MO_EINVAL, "%s: non-finite reward %g", t->label, v);
    *r = v;
    return MO_OK;
}

/* Appends "label=r (detail)" for one term of a sum. */
static size_t sum_detail(char *detail, size_t cap, size_t len, const term_t *t, double r,
                         const char *d) {
    if (!detail || len + 1 >= cap)
        return len;
    int w = snprintf(detail + len, cap - len, "%s%s=%g%s%s%s", len ? "; " : "", t->label, r,
                     d[0] ? " (" : "", d, d[0] ? ")" : "");
    return w < 0 ? len : len + (size_t)w;
}

int reward_fn_score(const reward_fn_t *fn, const reward_input_t *in, double *reward, double *parts,
                    char *detail, size_t cap) {
    if (fn->n == 1 && !fn->terms[0].weighted) {
        TRY(score_term(&fn->terms[0], in, reward, detail, cap));
        if (parts)
            parts[0] = *reward;
        return MO_OK;
    }
    if (detail && cap)
        detail[0] = '\0';
    double total = 0.0;
    size_t len = 0;
    for (int i = 0; i < fn->n; i++) {
        char d[REWARD_DETAIL_CAP];
        double r = 0.0;
        TRY(score_term(&fn->terms[i], in, &r, d, sizeof d));
        total += fn->terms[i].weight * r;
        if (parts)
            parts[i] = r;
        len = sum_detail(detail, cap, len, &fn->terms[i], r, d);
    }
    if (!isfinite(total))
        return mo_errorf(MO_EINVAL, "reward %s: the weighted sum is not finite (%g)", fn->desc,
                         total);
    *reward = total;
    return MO_OK;
}

int reward_fn_score_group(const reward_fn_t *fn, const reward_input_t *in, int n, double *rewards,
                          double *parts, char *details, size_t cap) {
    if (n < 0)
        return mo_errorf(MO_EINVAL, "reward group: negative size %d", n);
    for (int i = 0; i < n; i++) {
        double *p = parts ? parts + (size_t)i * (size_t)fn->n : NULL;
        char *d = details ? details + (size_t)i * cap : NULL;
        int rc = reward_fn_score(fn, &in[i], &rewards[i], p, d, details ? cap : 0);
        if (rc < 0)
            return mo_error_wrap(rc, "sample %d of %d", i, n);
    }
    return MO_OK;
}

int reward_builtin_count(void) {
    return reward_n_builtins;
}

const char *reward_builtin_name(int i) {
    return i >= 0 && i < reward_n_builtins ? reward_builtins[i].name : NULL;
}

const char *reward_builtin_summary(int i) {
    return i >= 0 && i < reward_n_builtins ? reward_builtins[i].summary : NULL;
}

/* ------------------------------------------------------------------------
 * Holder
 * ---------------------------------------------------------------------- */

typedef struct slot {
    reward_fn_t *fn;
    uint64_t version;
    int refs; /* scoring calls holding this slot */
} slot_t;

struct reward_holder {
    pthread_mutex_t lock;
    slot_t *cur;
};

static void slot_destroy(slot_t *s) {
    reward_fn_destroy(&s->fn);
    free(s);
}

int reward_holder_new(reward_fn_t **fn, uint64_t version, reward_holder_t **out) {
    *out = NULL;
    if (version == 0)
        return mo_errorf(MO_EINVAL, "reward holder: versions start at 1");
    reward_holder_t *h = calloc(1, sizeof *h);
    slot_t *s = calloc(1, sizeof *s);
    if (!h || !s || pthread_mutex_init(&h->lock, NULL) != 0) {
        free(h);
        free(s);
        return mo_errorf(MO_ENOMEM, "reward holder: out of memory");
    }
    s->fn = *fn;
    *fn = NULL;
    s->version = version;
    h->cur = s;
    *out = h;
    return MO_OK;
}

void reward_holder_destroy(reward_holder_t **ph) {
    reward_holder_t *h = *ph;
    if (!h)
        return;
    MO_ASSERT(h->cur->refs == 0);
    slot_destroy(h->cur);
    pthread_mutex_destroy(&h->lock);
    free(h);
    *ph = NULL;
}

int reward_holder_swap(reward_holder_t *h, reward_fn_t **fn, uint64_t version,
                       uint64_t *installed) {
    slot_t *s = calloc(1, sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "reward holder: out of memory");
    pthread_mutex_lock(&h->lock);
    slot_t *old = h->cur;
    if (version != 0 && version <= old->version) {
        pthread_mutex_unlock(&h->lock);
        free(s);
        return mo_errorf(MO_ESTATE, "reward version %llu is not newer than version %llu in place",
                         (unsigned long long)version, (unsigned long long)old->version);
    }
    s->fn = *fn;
    *fn = NULL;
    s->version = version ? version : old->version + 1;
    h->cur = s;
    bool dead = old->refs == 0;
    if (installed)
        *installed = s->version;
    pthread_mutex_unlock(&h->lock);
    if (dead)
        slot_destroy(old);
    return MO_OK;
}

int reward_holder_swap_config(reward_holder_t *h, const char *function, const char *plugin,
                              uint64_t version, uint64_t *installed) {
    reward_fn_t *fn;
    int rc = reward_fn_from_config(function, plugin, &fn);
    if (rc == MO_OK)
        rc = reward_holder_swap(h, &fn, version, installed);
    reward_fn_destroy(&fn);
    if (rc < 0)
        return mo_error_wrap(rc, "reward swap refused, version %llu stays in place",
                             (unsigned long long)reward_holder_version(h));
    return MO_OK;
}

uint64_t reward_holder_version(reward_holder_t *h) {
    pthread_mutex_lock(&h->lock);
    uint64_t v = h->cur->version;
    pthread_mutex_unlock(&h->lock);
    return v;
}

void reward_holder_acquire(reward_holder_t *h, reward_lease_t *lease) {
    pthread_mutex_lock(&h->lock);
    slot_t *s = h->cur;
    s->refs++;
    pthread_mutex_unlock(&h->lock);
    lease->fn = s->fn;
    lease->version = s->version;
    lease->slot = s;
}

void reward_holder_release(reward_holder_t *h, reward_lease_t *lease) {
    slot_t *s = lease->slot;
    MO_ASSERT(s != NULL);
    pthread_mutex_lock(&h->lock);
    MO_ASSERT(s->refs > 0);
    s->refs--;
    bool dead = s->refs == 0 && s != h->cur;
    pthread_mutex_unlock(&h->lock);
    if (dead)
        slot_destroy(s);
    lease->fn = NULL;
    lease->slot = NULL;
}

void reward_holder_describe(reward_holder_t *h, char *buf, size_t cap, uint64_t *version) {
    reward_lease_t l;
    reward_holder_acquire(h, &l);
    reward_detailf(buf, cap, "%s", reward_fn_describe(l.fn));
    if (version)
        *version = l.version;
    reward_holder_release(h, &l);
}

int reward_holder_score_group(reward_holder_t *h, const reward_input_t *in, int n, double *rewards,
                              char *details, size_t cap, uint64_t *version) {
    reward_lease_t l;
    reward_holder_acquire(h, &l);
    int rc = reward_fn_score_group(l.fn, in, n, rewards, NULL, details, cap);
    if (version)
        *version = l.version;
    if (rc < 0)
        mo_error_wrap(rc, "reward version %llu", (unsigned long long)l.version);
    reward_holder_release(h, &l);
    return rc;
}
