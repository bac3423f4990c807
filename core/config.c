/* config: values of the key table: defaults, parsing and checking of one
 * value, --set overrides, cross-key checks, dump, docs and freeing. */
#include "core/config.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

_Static_assert(sizeof(device_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_dtype_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_advantage_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_loss_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_loss_agg_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_kl_estimator_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_lr_schedule_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_overlong_t) == sizeof(int), "enum fields are stored as int");
_Static_assert(sizeof(cfg_task_t) == sizeof(int), "enum fields are stored as int");

#define KEY_CAP 128 /* longest "section.key" handled */

static void *field(moerl_config_t *c, const cfg_key_t *k) {
    return (char *)c + k->offset;
}
static const void *cfield(const moerl_config_t *c, const cfg_key_t *k) {
    return (const char *)c + k->offset;
}
static bool is_string_type(cfg_type_t t) {
    return t == CFG_STRING || t == CFG_PATH || t == CFG_ENDPOINT;
}

/* ---- Errors ---- */

void cfg_error_add(config_errors_t *e, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (e->n == e->cap) {
        int cap = e->cap ? 2 * e->cap : 8;
        char **items = realloc(e->items, (size_t)cap * sizeof *items);
        if (!items) {
            e->oom = 1;
            return;
        }
        e->items = items;
        e->cap = cap;
    }
    char *s = strdup(buf);
    if (!s) {
        e->oom = 1;
        return;
    }
    e->items[e->n++] = s;
}

void config_errors_free(config_errors_t *e) {
    for (int i = 0; i < e->n; i++)
        free(e->items[i]);
    free(e->items);
    memset(e, 0, sizeof *e);
}

/* Quotes text for a message: "text", escaped and cut at 60 characters. */
static const char *quote(const char *text, char *buf, size_t cap) {
    size_t o = 0, max = cap - 8;
    buf[o++] = '"';
    for (const char *p = text; *p && o < max; p++) {
        unsigned char ch = (unsigned char)*p;
        if (p - text >= 60) {
            o += (size_t)snprintf(buf + o, cap - o, "...");
            break;
        }
        if (ch == '"' || ch == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)ch;
        } else if (ch < 0x20 || ch == 0x7f) {
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
        } else {
            buf[o++] = (char)ch;
        }
    }
    buf[o++] = '"';
    buf[o] = '\0';
    return buf;
}

/* ---- Lookup and suggestions ---- */

const cfg_key_t *cfg_find(const char *section, const char *name) {
    for (int i = 0; i < cfg_nkeys; i++)
        if (!strcmp(cfg_keys[i].section, section) && !strcmp(cfg_keys[i].name, name))
            return &cfg_keys[i];
    return NULL;
}

static const cfg_key_t *find_dotted(const char *key) {
    const char *dot = strchr(key, '.');
    if (!dot || dot - key >= KEY_CAP)
        return NULL;
    char sec[KEY_CAP];
    memcpy(sec, key, (size_t)(dot - key));
    sec[dot - key] = '\0';
    return cfg_find(sec, dot + 1);
}

/* Levenshtein distance of the first 63 characters of a and b. */
static int edit_distance(const char *a, const char *b) {
    int row[64], na = (int)strnlen(a, 63), nb = (int)strnlen(b, 63);
    for (int j = 0; j <= nb; j++)
        row[j] = j;
    for (int i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= nb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[nb];
}

static int close_enough(int dist, const char *typed) {
    int len = (int)strlen(typed), lim = len / 3;
    if (lim < 1)
        lim = 1;
    if (lim > 3)
        lim = 3;
    return dist <= lim;
}

const char *cfg_suggest(const char *section, const char *key, char *buf, size_t cap) {
    int best = INT_MAX;
    buf[0] = '\0';
    if (!key) {
        /* An unknown section: a near section name, or a key written at the top. */
        for (int s = 0; s < cfg_nsections; s++) {
            int d = edit_distance(section, cfg_sections[s].name);
            if (d < best && close_enough(d, section)) {
                best = d;
                snprintf(buf, cap, "%s", cfg_sections[s].name);
            }
        }
        for (int i = 0; i < cfg_nkeys && best > 0; i++) {
            if (!strcmp(section, cfg_keys[i].name)) {
                best = 0;
                snprintf(buf, cap, "%s.%s", cfg_keys[i].section, cfg_keys[i].name);
            }
        }
        return buf[0] ? buf : NULL;
    }
    char typed[2 * KEY_CAP + 2];
    snprintf(typed, sizeof typed, "%s.%s", section, key);
    for (int i = 0; i < cfg_nkeys; i++) {
        char full[2 * KEY_CAP + 2];
        snprintf(full, sizeof full, "%s.%s", cfg_keys[i].section, cfg_keys[i].name);
        int d = edit_distance(typed, full);
        if (!strcmp(key, cfg_keys[i].name)) /* right key, wrong section */
            d = 1;
        if (d < best && close_enough(d, typed)) {
            best = d;
            snprintf(buf, cap, "%s", full);
        }
    }
    return buf[0] ? buf : NULL;
}

/* ---- One value ---- */

/* The shortest text that reads back as v; whole numbers without exponent. */
static void fmt_double(double v, char *buf, size_t cap) {
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, cap, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

static void range_text(const cfg_key_t *k, char *buf, size_t cap) {
    if (k->type == CFG_INT) {
        if (k->imin == k->imax)
            snprintf(buf, cap, "exactly %" PRId64, k->imin);
        else if (k->imax == INT64_MAX)
            snprintf(buf, cap, ">= %" PRId64, k->imin);
        else
            snprintf(buf, cap, "in [%" PRId64 ", %" PRId64 "]", k->imin, k->imax);
        return;
    }
    char lo[32], hi[32];
    fmt_double(k->fmin, lo, sizeof lo);
    fmt_double(k->fmax, hi, sizeof hi);
    if (k->fmin == k->fmax)
        snprintf(buf, cap, "exactly %s", lo);
    else
        snprintf(buf, cap, "in %c%s, %s%c", (k->flags & CFG_MIN_OPEN) ? '(' : '[', lo, hi,
                 (k->flags & CFG_MAX_OPEN) ? ')' : ']');
}

static void choices_text(const char *const *choices, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = '\0';
    for (int i = 0; choices[i] && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%s", i ? ", " : "", choices[i]);
}

void cfg_expected(const cfg_key_t *k, char *buf, size_t cap) {
    char r[256];
    switch (k->type) {
    case CFG_BOOL: snprintf(buf, cap, "true or false"); break;
    case CFG_INT: range_text(k, r, sizeof r), snprintf(buf, cap, "an integer %s", r); break;
    case CFG_FLOAT:
        range_text(k, r, sizeof r);
        snprintf(buf, cap, "%s%s", k->fmin == k->fmax ? "" : "a number ", r);
        break;
    case CFG_STRING:
        snprintf(buf, cap, "%s", (k->flags & CFG_NONEMPTY) ? "a non-empty string" : "a string");
        break;
    case CFG_PATH:
        snprintf(buf, cap, "%s", (k->flags & CFG_NONEMPTY) ? "a non-empty path" : "a path");
        break;
    case CFG_ENDPOINT: snprintf(buf, cap, "an endpoint tcp://HOST:PORT or ipc://PATH"); break;
    case CFG_ENUM: choices_text(k->choices, r, sizeof r), snprintf(buf, cap, "one of %s", r); break;
    case CFG_STRLIST:
        if (k->choices)
            choices_text(k->choices, r, sizeof r), snprintf(buf, cap, "a list of: %s", r);
        else
            snprintf(buf, cap, "a list of strings");
        break;
    }
}

static int parse_bool(const char *s, bool *out) {
    static const char *const yes[] = {"true", "True", "TRUE"}, *const no[] = {"false", "False",
                                                                              "FALSE"};
    for (int i = 0; i < 3; i++) {
        if (!strcmp(s, yes[i]))
            return *out = true, 0;
        if (!strcmp(s, no[i]))
            return *out = false, 0;
    }
    return -1;
}

static int parse_int(const char *s, int64_t *out) {
    char *end;
    if (!*s || (*s != '-' && *s != '+' && (*s < '0' || *s > '9')))
        return -1;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end)
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int parse_double(const char *s, double *out) {
    char *end;
    if (!*s || strchr(s, 'x') || strchr(s, 'X'))
        return -1;
    errno = 0;
    double v = strtod(s, &end);
    if (*end || !isfinite(v) || (errno == ERANGE && fabs(v) > 1))
        return -1;
    *out = v;
    return 0;
}

static bool in_range(const cfg_key_t *k, double v) {
    if (v < k->fmin || v > k->fmax)
        return false;
    if ((k->flags & CFG_MIN_OPEN) && v == k->fmin)
        return false;
    if ((k->flags & CFG_MAX_OPEN) && v == k->fmax)
        return false;
    return true;
}

/* tcp://HOST:PORT (HOST a name, an IPv4 address, [IPv6] or *; PORT 1-65535)
 * or ipc://PATH. */
static bool endpoint_ok(const char *s) {
    if (!strncmp(s, "ipc://", 6))
        return s[6] != '\0';
    if (strncmp(s, "tcp://", 6) != 0)
        return false;
    const char *host = s + 6, *colon = strrchr(host, ':');
    if (!colon || colon == host)
        return false;
    if (host[0] == '[') {
        if (colon[-1] != ']' || colon - host < 3)
            return false;
    } else {
        for (const char *p = host; p < colon; p++)
            if (!(*p == '.' || *p == '-' || *p == '_' || *p == '*' || (*p >= '0' && *p <= '9') ||
                  (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')))
                return false;
    }
    int64_t port;
    return parse_int(colon + 1, &port) == 0 && colon[1] != '+' && colon[1] != '-' && port >= 1 &&
           port <= 65535;
}

static bool null_like(const char *s) {
    return !*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL");
}

static int set_string(char **slot, const char *s) {
    char *copy = strdup(s);
    if (!copy)
        return mo_errorf(MO_ENOMEM, "out of memory");
    free(*slot);
    *slot = copy;
    return 0;
}

static int bad(const cfg_key_t *k, const char *text, bool quoted, char *why, size_t cap) {
    char exp[512], q[128];
    cfg_expected(k, exp, sizeof exp);
    snprintf(why, cap, "expected %s, got %s", exp,
             (!quoted && null_like(text)) ? "null" : quote(text, q, sizeof q));
    if (k->type == CFG_FLOAT && k->fmin == k->fmax) { /* a fixed value: the doc says why */
        size_t n = strlen(why);
        snprintf(why + n, cap - n, " (%s)", k->doc);
    }
    return MO_ECONFIG;
}

int cfg_assign_scalar(moerl_config_t *c, const cfg_key_t *k, const char *text, bool quoted,
                      char *why, size_t cap) {
    void *f = field(c, k);
    MO_ASSERT(k->type != CFG_STRLIST);
    switch (k->type) {
    case CFG_BOOL: {
        bool b;
        if (parse_bool(text, &b))
            return bad(k, text, quoted, why, cap);
        *(bool *)f = b;
        return 0;
    }
    case CFG_INT: {
        int64_t v;
        if (parse_int(text, &v) || v < k->imin || v > k->imax)
            return bad(k, text, quoted, why, cap);
        if (k->size == sizeof(int))
            *(int *)f = (int)v;
        else
            *(int64_t *)f = v;
        return 0;
    }
    case CFG_FLOAT: {
        double v;
        if (parse_double(text, &v) || !in_range(k, v))
            return bad(k, text, quoted, why, cap);
        *(double *)f = v;
        return 0;
    }
    case CFG_ENUM:
        for (int i = 0; k->choices[i]; i++)
            if (!strcmp(text, k->choices[i]))
                return *(int *)f = i, 0;
        return bad(k, text, quoted, why, cap);
    case CFG_STRING:
    case CFG_PATH:
    case CFG_ENDPOINT: {
        const char *s = (!quoted && null_like(text)) ? "" : text;
        if ((k->flags & CFG_NONEMPTY) && !*s)
            return bad(k, text, quoted, why, cap);
        if (k->type == CFG_ENDPOINT && !endpoint_ok(s))
            return bad(k, text, quoted, why, cap);
        return set_string((char **)f, s);
    }
    case CFG_STRLIST: break;
    }
    return MO_EINVAL;
}

int cfg_check_element(const cfg_key_t *k, const char *text, char *const *prev, int nprev, char *why,
                      size_t cap) {
    char q[128];
    if (k->choices) {
        int found = 0;
        for (int i = 0; k->choices[i] && !found; i++)
            found = !strcmp(text, k->choices[i]);
        if (!found) {
            char names[512];
            choices_text(k->choices, names, sizeof names);
            snprintf(why, cap, "expected one of %s, got %s", names, quote(text, q, sizeof q));
            return MO_ECONFIG;
        }
    }
    for (int i = 0; i < nprev; i++) {
        if (!strcmp(prev[i], text)) {
            snprintf(why, cap, "%s is listed twice", quote(text, q, sizeof q));
            return MO_ECONFIG;
        }
    }
    return 0;
}

void cfg_strings_free(char **items, int n) {
    for (int i = 0; i < n; i++)
        free(items[i]);
    free(items);
}

int cfg_assign_list(moerl_config_t *c, const cfg_key_t *k, char **items, int n) {
    MO_ASSERT(k->type == CFG_STRLIST);
    cfg_strlist_t *l = field(c, k), fresh = {NULL, 0};
    if (n > 0) {
        fresh.items = calloc((size_t)n, sizeof *fresh.items);
        if (!fresh.items)
            return mo_errorf(MO_ENOMEM, "out of memory");
        for (; fresh.n < n; fresh.n++) {
            if (!(fresh.items[fresh.n] = strdup(items[fresh.n]))) {
                cfg_strings_free(fresh.items, fresh.n);
                return mo_errorf(MO_ENOMEM, "out of memory");
            }
        }
    }
    cfg_strings_free(l->items, l->n);
    *l = fresh;
    return 0;
}

/* ---- Text as given to --set ---- */

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    return s;
}

/* "a, b" or "[a, 'b']" into heap strings. */
static int split_list(const char *value, char ***items, int *n, char *why, size_t cap) {
    char *copy = strdup(value), *v, **out = NULL;
    int cnt = 0;
    if (!copy)
        return mo_errorf(MO_ENOMEM, "out of memory");
    v = trim(copy);
    if (*v == '[') {
        int rc = cfg_parse_flow_list(v, items, n, why, cap);
        free(copy);
        return rc;
    }
    if (*v) {
        int parts = 1;
        for (const char *p = v; *p; p++)
            parts += *p == ',';
        if (!(out = calloc((size_t)parts, sizeof *out)))
            goto oom;
        for (char *save = NULL, *tok = strtok_r(v, ",", &save); tok;
             tok = strtok_r(NULL, ",", &save)) {
            if (!(out[cnt] = strdup(trim(tok))))
                goto oom;
            cnt++;
        }
    }
    free(copy);
    *items = out;
    *n = cnt;
    return 0;
oom:
    free(copy);
    cfg_strings_free(out, cnt);
    return mo_errorf(MO_ENOMEM, "out of memory");
}

static int set_text(moerl_config_t *c, const cfg_key_t *k, const char *value, char *why,
                    size_t cap) {
    why[0] = '\0';
    if (k->type != CFG_STRLIST) {
        if (is_string_type(k->type))
            return cfg_assign_scalar(c, k, value, true, why, cap);
        char *copy = strdup(value);
        if (!copy)
            return mo_errorf(MO_ENOMEM, "out of memory");
        int rc = cfg_assign_scalar(c, k, trim(copy), false, why, cap);
        free(copy);
        return rc;
    }
    char **items = NULL;
    int n = 0, rc = split_list(value, &items, &n, why, cap);
    for (int i = 0; rc == 0 && i < n; i++) {
        char el[512];
        if ((rc = cfg_check_element(k, items[i], items, i, el, sizeof el)) < 0)
            snprintf(why, cap, "element %d: %s", i, el);
    }
    if (rc == 0)
        rc = cfg_assign_list(c, k, items, n);
    cfg_strings_free(items, n);
    return rc;
}

int config_set(moerl_config_t *c, const char *key, const char *value) {
    const cfg_key_t *k = find_dotted(key);
    if (!k) {
        char sec[KEY_CAP], sug[2 * KEY_CAP + 2];
        const char *dot = strchr(key, '.');
        if (!dot || dot - key >= KEY_CAP) {
            if (!cfg_suggest(key, NULL, sug, sizeof sug))
                return mo_errorf(MO_ECONFIG, "%s: unknown key (keys are written section.key)", key);
            return mo_errorf(MO_ECONFIG, "%s: unknown key; did you mean '%s'?", key, sug);
        }
        memcpy(sec, key, (size_t)(dot - key));
        sec[dot - key] = '\0';
        if (!cfg_suggest(sec, dot + 1, sug, sizeof sug))
            return mo_errorf(MO_ECONFIG, "%s: unknown key", key);
        return mo_errorf(MO_ECONFIG, "%s: unknown key; did you mean '%s'?", key, sug);
    }
    char why[1024];
    int rc = set_text(c, k, value, why, sizeof why);
    if (rc == MO_ECONFIG)
        return mo_errorf(rc, "%s.%s: %s", k->section, k->name, why);
    return rc;
}

/* ---- Whole configs ---- */

int config_defaults(moerl_config_t *c) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < cfg_nkeys; i++) {
        char why[1024];
        int rc = set_text(c, &cfg_keys[i], cfg_keys[i].def, why, sizeof why);
        if (rc == MO_ECONFIG)
            return mo_errorf(rc, "default of %s.%s: %s", cfg_keys[i].section, cfg_keys[i].name,
                             why);
        TRY(rc);
    }
    return 0;
}

void config_free(moerl_config_t *c) {
    if (!c)
        return;
    for (int i = 0; i < cfg_nkeys; i++) {
        const cfg_key_t *k = &cfg_keys[i];
        if (is_string_type(k->type)) {
            free(*(char **)field(c, k));
        } else if (k->type == CFG_STRLIST) {
            cfg_strlist_t *l = field(c, k);
            cfg_strings_free(l->items, l->n);
        }
    }
    memset(c, 0, sizeof *c);
}

int config_run_dir(const moerl_config_t *c, char *buf, size_t cap) {
    int n = c->run.dir && *c->run.dir ? snprintf(buf, cap, "%s", c->run.dir)
                                      : snprintf(buf, cap, "runs/%s", c->run.name);
    if (n < 0 || (size_t)n >= cap)
        return mo_errorf(MO_EINVAL, "run directory name longer than %zu bytes", cap);
    return 0;
}

bool config_lora_has_target(const moerl_config_t *c, const char *name) {
    for (int i = 0; i < c->lora.targets.n; i++)
        if (!strcmp(c->lora.targets.items[i], name))
            return true;
    return false;
}

/* ---- Dump ---- */

static void dump_string(FILE *out, const char *s) {
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", out); break;
        case '\\': fputs("\\\\", out); break;
        case '\n': fputs("\\n", out); break;
        case '\t': fputs("\\t", out); break;
        case '\r': fputs("\\r", out); break;
        default:
            if (*p < 0x20 || *p == 0x7f)
                fprintf(out, "\\x%02x", *p);
            else
                fputc(*p, out);
        }
    }
    fputc('"', out);
}

static void dump_value(FILE *out, const moerl_config_t *c, const cfg_key_t *k) {
    const void *f = cfield(c, k);
    char num[40];
    switch (k->type) {
    case CFG_BOOL: fputs(*(const bool *)f ? "true" : "false", out); break;
    case CFG_INT:
        fprintf(out, "%" PRId64,
                k->size == sizeof(int) ? (int64_t) * (const int *)f : *(const int64_t *)f);
        break;
    case CFG_FLOAT: fmt_double(*(const double *)f, num, sizeof num), fputs(num, out); break;
    case CFG_STRING:
    case CFG_PATH:
    case CFG_ENDPOINT: dump_string(out, *(char *const *)f ? *(char *const *)f : ""); break;
    case CFG_ENUM: {
        int v = *(const int *)f, n = 0;
        while (k->choices[n])
            n++;
        MO_ASSERT(v >= 0 && v < n); /* only config_set and the loader write enums */
        fputs(k->choices[v], out);
        break;
    }
    case CFG_STRLIST: {
        const cfg_strlist_t *l = f;
        fputc('[', out);
        for (int i = 0; i < l->n; i++) {
            if (i)
                fputs(", ", out);
            if (k->choices)
                fputs(l->items[i], out);
            else
                dump_string(out, l->items[i]);
        }
        fputc(']', out);
        break;
    }
    }
}

void config_dump(const moerl_config_t *c, FILE *out) {
    fprintf(out, "# moerl configuration, fully resolved\n");
    for (int s = 0; s < cfg_nsections; s++) {
        fprintf(out, "%s:\n", cfg_sections[s].name);
        for (int i = 0; i < cfg_nkeys; i++) {
            if (strcmp(cfg_keys[i].section, cfg_sections[s].name) != 0)
                continue;
            fprintf(out, "  %s: ", cfg_keys[i].name);
            dump_value(out, c, &cfg_keys[i]);
            fputc('\n', out);
        }
    }
}

/* ---- Cross-key checks ---- */

static int key_index(const char *section, const char *name) {
    const cfg_key_t *k = cfg_find(section, name);
    MO_ASSERT(k != NULL);
    return (int)(k - cfg_keys);
}

/* The key of a and b whose value was given last (a --set beats a file line,
 * a later line an earlier one); a when neither was given. */
static int blame(const cfg_origin_t *org, int a, int b) {
    if (!org->lines)
        return a;
    int la = org->lines[a], lb = org->lines[b];
    int ra = la < 0 ? INT_MAX : la, rb = lb < 0 ? INT_MAX : lb;
    return rb > ra ? b : a;
}

static void report(config_errors_t *e, const cfg_origin_t *org, int key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void report(config_errors_t *e, const cfg_origin_t *org, int key, const char *fmt, ...) {
    char msg[768], where[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line = org->lines ? org->lines[key] : 0;
    if (line > 0)
        snprintf(where, sizeof where, "%s:%d: ", org->file, line);
    else if (line < 0)
        snprintf(where, sizeof where, "--set: ");
    else if (org->file)
        snprintf(where, sizeof where, "%s: ", org->file);
    else
        where[0] = '\0';
    cfg_error_add(e, "%s%s.%s: %s", where, cfg_keys[key].section, cfg_keys[key].name, msg);
}

static const char *endpoint_host(const char *ep, char *buf, size_t cap) {
    if (strncmp(ep, "tcp://", 6) != 0)
        return NULL;
    const char *colon = strrchr(ep + 6, ':');
    size_t n = colon ? (size_t)(colon - (ep + 6)) : strlen(ep + 6);
    if (n >= cap)
        n = cap - 1;
    memcpy(buf, ep + 6, n);
    buf[n] = '\0';
    return buf;
}

static bool loopback(const char *host) {
    return !strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "[::1]");
}

static void check_transport(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *e) {
    static const char *const names[] = {"control", "work", "trajectories", "weights", "reward"};
    const config_transport_t *t = &c->transport;
    const char *eps[] = {t->control, t->work, t->trajectories, t->weights, t->reward};
    int ix[5];
    for (int i = 0; i < 5; i++)
        ix[i] = key_index("transport", names[i]);
    bool secret = *t->curve_secret_key, pub = *t->curve_public_key;
    for (int i = 0; i < 5; i++) {
        for (int j = 0; j < i; j++)
            if (!strcmp(eps[i], eps[j]))
                report(e, org, blame(org, ix[i], ix[j]), "endpoint %s is also transport.%s's",
                       eps[i], names[blame(org, ix[i], ix[j]) == ix[i] ? j : i]);
        char host[256];
        if (endpoint_host(eps[i], host, sizeof host) && !loopback(host) && !(secret && pub) &&
            !t->allow_insecure_remote)
            report(e, org, ix[i],
                   "%s is reachable beyond this machine but CURVE keys are not set "
                   "(set transport.curve_secret_key and curve_public_key, or "
                   "transport.allow_insecure_remote: true)",
                   eps[i]);
    }
    if (secret != pub)
        report(e, org, key_index("transport", secret ? "curve_public_key" : "curve_secret_key"),
               "CURVE needs both curve_secret_key and curve_public_key");
}

static void check_rl(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *e) {
    int g = key_index("rollout", "group_size"), adv = key_index("learner", "advantage");
    if (c->rollout.group_size < 2 && c->learner.advantage != CFG_ADV_REINFORCE)
        report(e, org, blame(org, g, adv),
               "advantage %s compares completions of a group and needs rollout.group_size >= "
               "2, got %d",
               cfg_keys[adv].choices[c->learner.advantage], c->rollout.group_size);
    int mnt = key_index("rollout", "max_new_tokens"), msl = key_index("model", "max_seq_len");
    if (c->rollout.max_new_tokens >= c->model.max_seq_len)
        report(e, org, blame(org, mnt, msl),
               "rollout.max_new_tokens (%d) must be below model.max_seq_len (%d) to leave room "
               "for the prompt",
               c->rollout.max_new_tokens, c->model.max_seq_len);
    int64_t samples = (int64_t)c->rollout.prompts_per_step * c->rollout.group_size;
    int mb = key_index("learner", "minibatches");
    if (c->learner.minibatches > samples)
        report(e, org, mb,
               "%d minibatches exceed the %" PRId64 " samples of a step "
               "(rollout.prompts_per_step * rollout.group_size)",
               c->learner.minibatches, samples);
    int ob = key_index("learner", "overlong_buffer");
    if (c->learner.overlong == CFG_OVERLONG_PENALTY &&
        (c->learner.overlong_buffer < 1 || c->learner.overlong_buffer > c->rollout.max_new_tokens))
        report(e, org, blame(org, ob, key_index("learner", "overlong")),
               "overlong penalty needs learner.overlong_buffer in [1, rollout.max_new_tokens = "
               "%d], got %d",
               c->rollout.max_new_tokens, c->learner.overlong_buffer);
    if (c->learner.tis_cap > 0 && c->learner.tis_cap < 1)
        report(e, org, key_index("learner", "tis_cap"), "expected 0 (off) or a cap >= 1, got %g",
               c->learner.tis_cap);
}

/* run.device cuda: the learner's model (learner/actor_exec.h) and the rollout engine
 * (rollout/engine.h) on the GPU, in builds with the CUDA backend, without what the device
 * path cannot run. */
static void check_device(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *e) {
    if (c->run.device != DEV_CUDA && c->rollout.cuda_graphs)
        report(e, org, blame(org, key_index("rollout", "cuda_graphs"), key_index("run", "device")),
               "CUDA graphs replay the GPU's decode steps: they need run.device: cuda");
    if (c->run.device != DEV_CUDA)
        return;
    int dev = key_index("run", "device");
#ifndef MOERL_HAVE_CUDA
    report(e, org, dev,
           "cuda: this build has no CUDA backend (configure with -DMOERL_CUDA=ON on a machine "
           "with the CUDA Toolkit); use cpu");
#endif
    const char *full = c->lora.train_router ? "train_router" : "train_norms";
    if (c->lora.train_router || c->lora.train_norms)
        report(e, org, blame(org, dev, key_index("lora", full)),
               "cuda trains LoRA adapters only: lora.train_router and lora.train_norms run on "
               "the CPU only");
    if (c->rollout.merge_adapter)
        report(e, org, blame(org, dev, key_index("rollout", "merge_adapter")),
               "cuda runs the rollout engine's adapter unmerged: rollout.merge_adapter runs on "
               "the CPU only");
}

/* learner.comm nccl: device buffers, so run.device cuda and a build with NCCL. */
static void check_comm(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *e) {
    if (c->learner.comm != CFG_COMM_NCCL)
        return;
    int k = key_index("learner", "comm");
    if (c->run.device != DEV_CUDA)
        report(e, org, blame(org, k, key_index("run", "device")),
               "nccl exchanges the GPUs' memory: it needs run.device: cuda (the CPU path "
               "exchanges over MPI)");
#ifndef MOERL_HAVE_NCCL
    report(e, org, k,
           "nccl: this build has no NCCL (configure with -DMOERL_CUDA=ON where the CUDA "
           "Toolkit and NCCL are installed); use mpi");
#endif
}

static void check_misc(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *e) {
    const char *tpl = c->rollout.prompt_template, *at = strstr(tpl, "{prompt}");
    if (!at || strstr(at + 1, "{prompt}"))
        report(e, org, key_index("rollout", "prompt_template"),
               "must contain {prompt} exactly once, got %s", at ? "it more than once" : "none");
    int dp = key_index("data", "path");
    if (c->data.task == CFG_TASK_JSONL && !*c->data.path)
        report(e, org, blame(org, dp, key_index("data", "task")),
               "task jsonl needs data.path, the JSONL file of prompts");
    int amin = key_index("data", "arith_min_digits"), amax = key_index("data", "arith_max_digits");
    if (c->data.arith_min_digits > c->data.arith_max_digits)
        report(e, org, blame(org, amin, amax), "%d digits exceed data.arith_max_digits = %d",
               c->data.arith_min_digits, c->data.arith_max_digits);
    const char *ops = c->data.arith_ops;
    size_t nops = strlen(ops);
    bool dup = false;
    for (size_t i = 1; i < nops; i++)
        dup = dup || memchr(ops, ops[i], i) != NULL;
    if (nops > 3 || strspn(ops, "+-*") != nops || dup)
        report(e, org, key_index("data", "arith_ops"),
               "expected operators from + - * each at most once, got \"%s\"", ops);
    check_device(c, org, e);
    check_comm(c, org, e);
    int kv = key_index("rollout", "kv_cache_tokens");
    if (c->rollout.kv_cache_tokens > 0 && c->rollout.kv_cache_tokens < c->model.max_seq_len)
        report(e, org, blame(org, kv, key_index("model", "max_seq_len")),
               "%" PRId64 " tokens cannot hold one sequence of model.max_seq_len = %d",
               c->rollout.kv_cache_tokens, c->model.max_seq_len);
}

void cfg_validate_into(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *errs) {
    check_transport(c, org, errs);
    check_rl(c, org, errs);
    check_misc(c, org, errs);
}

int cfg_errors_status(const config_errors_t *e) {
    if (e->oom)
        return mo_errorf(MO_ENOMEM, "out of memory while collecting configuration errors");
    if (e->n == 0)
        return 0;
    char msg[1000];
    size_t o = 0;
    int shown = 0;
    for (; shown < e->n; shown++) {
        size_t len = strlen(e->items[shown]);
        if (shown > 0 && o + len + 40 >= sizeof msg)
            break;
        o += (size_t)snprintf(msg + o, sizeof msg - o, "%s%s", shown ? "\n" : "", e->items[shown]);
        if (o >= sizeof msg)
            o = sizeof msg - 1;
    }
    if (shown < e->n)
        snprintf(msg + o, sizeof msg - o, "\n(and %d more errors)", e->n - shown);
    return mo_errorf(MO_ECONFIG, "%s", msg);
}

int config_validate(const moerl_config_t *c) {
    config_errors_t e = {0};
    cfg_origin_t org = {NULL, NULL};
    cfg_validate_into(c, &org, &e);
    int rc = cfg_errors_status(&e);
    config_errors_free(&e);
    return rc;
}

/* ---- Reference docs ---- */

static void doc_cell(FILE *out, const char *s) {
    for (; *s; s++) {
        if (*s == '|')
            fputs("\\|", out);
        else if (*s == '<')
            fputs("&lt;", out);
        else if (*s == '>')
            fputs("&gt;", out);
        else
            fputc(*s, out);
    }
}

static void doc_type(FILE *out, const cfg_key_t *k) {
    char r[256];
    switch (k->type) {
    case CFG_BOOL: fputs("bool", out); break;
    case CFG_INT: range_text(k, r, sizeof r), fprintf(out, "integer %s", r); break;
    case CFG_FLOAT:
        range_text(k, r, sizeof r), fprintf(out, "number%s %s", k->fmin == k->fmax ? "," : "", r);
        break;
    case CFG_STRING: fputs((k->flags & CFG_NONEMPTY) ? "string, non-empty" : "string", out); break;
    case CFG_PATH: fputs("path", out); break;
    case CFG_ENDPOINT: fputs("endpoint", out); break;
    case CFG_ENUM:
    case CFG_STRLIST:
        if (!k->choices) {
            fputs("list of strings", out);
            break;
        }
        fputs(k->type == CFG_ENUM ? "one of" : "list of", out);
        for (int i = 0; k->choices[i]; i++)
            fprintf(out, "%s `%s`", i ? "," : "", k->choices[i]);
        break;
    }
}

static const char *const doc_intro =
    "# Configuration reference\n\n"
    "<!-- Generated by `moerl config docs` from core/config_schema.c. Do not edit by hand: "
    "tests/test_config_docs.c fails when this file and the generator disagree. -->\n\n"
    "A job is one YAML file of sections; each section is a mapping of keys. Every key is "
    "optional and takes the default below when absent. A key may also be written at the top "
    "level in dotted form (`learner.lr: 1e-5`).\n\n"
    "```yaml\nrun:\n  name: grpo-tiny\nlearner:\n  lr: 2e-5\n  lr_schedule: cosine\n"
    "lora:\n  targets: [q_proj, v_proj, experts]\n```\n\n"
    "Checking is strict. An unknown key, a value of the wrong type, a value out of range, a "
    "name outside an enumeration, invalid YAML, a repeated key, or a section that is not a "
    "mapping is an error naming the file, the line and the key; every error of a file is "
    "reported, not only the first:\n\n"
    "```\nconfigs/x.yaml:12: learner.lr: expected a number in (0, 1], got \"fast\"\n"
    "configs/x.yaml:14: learner.lrr: unknown key; did you mean 'learner.lr'?\n```\n\n"
    "Commands:\n\n"
    "- `moerl config check FILE` prints `FILE: ok` or the errors (exit status 1).\n"
    "- `moerl config dump FILE [--set key=value ...]` prints the fully resolved config as YAML; "
    "the dump loads back to the same dump.\n"
    "- `--set key=value` overrides one key after the file: `--set learner.lr=2e-5`, "
    "`--set lora.targets=q_proj,v_proj` or `--set 'lora.targets=[q_proj, v_proj]'`; strings "
    "are taken verbatim.\n\n"
    "Types: *bool* is `true` or `false`; *integer* and *number* give their allowed range, a "
    "parenthesis excluding the bound; an *endpoint* is `tcp://HOST:PORT` (port 1-65535) or "
    "`ipc://PATH`; a *path* is used as written (relative to the working directory); a null or "
    "empty string value means \"not set\".\n\n"
    "Checks across keys:\n\n"
    "- the five transport endpoints are distinct;\n"
    "- a tcp endpoint beyond loopback needs `transport.curve_secret_key` and "
    "`transport.curve_public_key`, or `transport.allow_insecure_remote: true`; the two CURVE "
    "keys are set together;\n"
    "- advantages other than `reinforce` need `rollout.group_size` >= 2;\n"
    "- `rollout.max_new_tokens` < `model.max_seq_len`;\n"
    "- `learner.minibatches` <= `rollout.prompts_per_step` * `rollout.group_size`;\n"
    "- `learner.overlong: penalty` needs `learner.overlong_buffer` in [1, "
    "`rollout.max_new_tokens`];\n"
    "- `learner.tis_cap` is 0 or >= 1;\n"
    "- `rollout.prompt_template` contains `{prompt}` exactly once;\n"
    "- `data.task: jsonl` needs `data.path`;\n"
    "- `data.arith_min_digits` <= `data.arith_max_digits`, and `data.arith_ops` holds each of "
    "`+`, `-`, `*` at most once;\n"
    "- a non-zero `rollout.kv_cache_tokens` holds at least `model.max_seq_len` tokens;\n"
    "- `run.device: cuda` needs a build with the CUDA backend (a build without it refuses the "
    "key), `rollout.merge_adapter: false`, and `lora.train_router` and `lora.train_norms` "
    "off. It runs the learner's forwards and backwards (training step, old and reference "
    "log-probabilities; `moerl sft`'s training step too; with `learner.ranks` > 1 every rank "
    "on a GPU of its host, the MoE layers exchanging rows over MPI, or over NCCL with "
    "`learner.comm: nccl`) and the rollout "
    "workers' engine (prefill, decode and sampling, with the KV cache in device memory) on "
    "the GPU; the loss, AdamW and evaluation stay on the CPU. A model the GPU path cannot run "
    "(multi-head latent attention, sigmoid or group-limited routers, shared experts, fp8 "
    "weights) stops the learner and the rollout workers at startup with the reason, and so "
    "does a missing CUDA device.\n"
    "- `learner.comm: nccl` needs `run.device: cuda` and a build with NCCL;\n"
    "- `rollout.cuda_graphs: true` needs `run.device: cuda`.\n";

void config_doc_markdown(FILE *out) {
    moerl_config_t def;
    int rc = config_defaults(&def);
    MO_ASSERT(rc == 0); /* the table's own defaults are checked by the tests */
    fputs(doc_intro, out);
    fputs("\n## Sections\n\n| section | contents |\n| --- | --- |\n", out);
    for (int s = 0; s < cfg_nsections; s++)
        fprintf(out, "| [`%s`](#%s) | %s |\n", cfg_sections[s].name, cfg_sections[s].name,
                cfg_sections[s].doc);
    for (int s = 0; s < cfg_nsections; s++) {
        fprintf(out, "\n## %s\n\n%s\n\n", cfg_sections[s].name, cfg_sections[s].doc);
        fputs("| key | type | default | description |\n| --- | --- | --- | --- |\n", out);
        for (int i = 0; i < cfg_nkeys; i++) {
            const cfg_key_t *k = &cfg_keys[i];
            if (strcmp(k->section, cfg_sections[s].name) != 0)
                continue;
            fprintf(out, "| `%s.%s` | ", k->section, k->name);
            doc_type(out, k);
            fputs(" | `", out);
            dump_value(out, &def, k);
            fputs("` | ", out);
            doc_cell(out, k->doc);
            fputs(" |\n", out);
        }
    }
    config_free(&def);
}
