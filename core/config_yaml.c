/* config_yaml: reading job configs with libfyaml: the walk over sections and
 * keys with file:line errors, and the load entry points. */
#include <errno.h>
#include <libfyaml.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "core/status.h"

#define NAME_CAP 128        /* longest section or key name shown in full */
#define FILE_MAX (16 << 20) /* config files are small; refuse anything huge */

typedef struct walker {
    moerl_config_t *c;
    const char *file;
    config_errors_t *errs;
    cfg_origin_t *org;
    int sec_line[32]; /* first line of each section seen */
    int rc;           /* first non-config failure (MO_ENOMEM) */
} walker_t;

/* ---- libfyaml plumbing ---- */

static struct fy_parser *parser_new(struct fy_diag **diag) {
    struct fy_diag_cfg dc;
    fy_diag_cfg_default(&dc);
    dc.fp = NULL;
    dc.colorize = false;
    *diag = fy_diag_create(&dc);
    if (!*diag)
        return NULL;
    fy_diag_set_collect_errors(*diag, true);
    /* Duplicate keys are found by the walk, which can name them. */
    struct fy_parse_cfg cfg = {NULL, FYPCF_QUIET | FYPCF_ALLOW_DUPLICATE_KEYS, NULL, *diag};
    struct fy_parser *p = fy_parser_create(&cfg);
    if (!p)
        fy_diag_destroy(*diag);
    return p;
}

static struct fy_node *deref(struct fy_node *n) {
    return n && fy_node_is_alias(n) ? fy_node_resolve_alias(n) : n;
}

/* 1-based line of a node (of its first scalar for collections), or 0. */
static int node_line(struct fy_node *n) {
    for (int depth = 0; n && depth < 64; depth++) {
        if (fy_node_is_scalar(n) || fy_node_is_alias(n)) {
            struct fy_token *t = fy_node_get_scalar_token(n);
            const struct fy_mark *m = t ? fy_token_start_mark(t) : NULL;
            return m ? m->line + 1 : 0;
        }
        void *it = NULL;
        if (fy_node_is_mapping(n)) {
            struct fy_node_pair *p = fy_node_mapping_iterate(n, &it);
            n = p ? fy_node_pair_key(p) : NULL;
        } else {
            n = fy_node_sequence_iterate(n, &it);
        }
    }
    return 0;
}

/* A scalar's text as a heap string (NULL on allocation failure). */
static char *scalar_dup(struct fy_node *n) {
    size_t len = 0;
    const char *s = fy_node_get_scalar(n, &len);
    char *out = malloc(len + 1);
    if (out) {
        if (len)
            memcpy(out, s, len);
        out[len] = '\0';
    }
    return out;
}

static bool scalar_quoted(struct fy_node *n) {
    return fy_node_get_style(n) != FYNS_PLAIN;
}

static bool is_null(struct fy_node *n) {
    if (!n)
        return true;
    if (!fy_node_is_scalar(n) || scalar_quoted(n))
        return false;
    size_t len = 0;
    const char *s = fy_node_get_scalar(n, &len);
    return len == 0 || (len == 1 && s[0] == '~') ||
           (len == 4 && (!memcmp(s, "null", 4) || !memcmp(s, "Null", 4) || !memcmp(s, "NULL", 4)));
}

static const char *kind_of(struct fy_node *n) {
    if (fy_node_is_mapping(n))
        return "a mapping";
    if (fy_node_is_sequence(n))
        return "a list";
    return "a scalar";
}

/* ---- The walk ---- */

static void werr(walker_t *w, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void werr(walker_t *w, int line, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0)
        cfg_error_add(w->errs, "%s:%d: %s", w->file, line, msg);
    else
        cfg_error_add(w->errs, "%s: %s", w->file, msg);
}

static void note_rc(walker_t *w, int rc) {
    if (rc < 0 && rc != MO_ECONFIG && w->rc == 0)
        w->rc = rc;
}

static void apply_list(walker_t *w, const cfg_key_t *k, struct fy_node *v, int line) {
    int cap = fy_node_sequence_item_count(v), n = 0, ok = 1;
    char **items = calloc((size_t)(cap > 0 ? cap : 1), sizeof *items);
    if (!items)
        return note_rc(w, MO_ENOMEM);
    void *it = NULL;
    for (int idx = 0; idx < cap; idx++) {
        struct fy_node *e = fy_node_sequence_iterate(v, &it), *el = deref(e);
        int el_line = node_line(e) ? node_line(e) : line;
        char why[700];
        if (!e)
            break;
        if (!el || !fy_node_is_scalar(el)) {
            werr(w, el_line, "%s.%s[%d]: expected a string, got %s", k->section, k->name, idx,
                 el ? kind_of(el) : "an undefined alias");
            ok = 0;
            continue;
        }
        if (!(items[n] = scalar_dup(el))) {
            note_rc(w, MO_ENOMEM);
            break;
        }
        if (cfg_check_element(k, items[n], items, n, why, sizeof why) < 0) {
            werr(w, el_line, "%s.%s[%d]: %s", k->section, k->name, idx, why);
            ok = 0;
        }
        n++;
    }
    if (ok && w->rc == 0)
        note_rc(w, cfg_assign_list(w->c, k, items, n));
    cfg_strings_free(items, n);
}

static void apply_value(walker_t *w, const cfg_key_t *k, struct fy_node *key_node,
                        struct fy_node *value) {
    int idx = (int)(k - cfg_keys), line = node_line(key_node);
    if (w->org->lines[idx] > 0) {
        werr(w, line, "%s.%s: duplicate key (first set at line %d)", k->section, k->name,
             w->org->lines[idx]);
        return;
    }
    w->org->lines[idx] = line > 0 ? line : 1;
    struct fy_node *v = deref(value);
    if (value && !v) {
        werr(w, line, "%s.%s: undefined alias", k->section, k->name);
        return;
    }
    char exp[600];
    cfg_expected(k, exp, sizeof exp);
    if (k->type == CFG_STRLIST) {
        if (is_null(v))
            note_rc(w, cfg_assign_list(w->c, k, NULL, 0));
        else if (fy_node_is_sequence(v))
            apply_list(w, k, v, line);
        else if (fy_node_is_scalar(v))
            werr(w, line, "%s.%s: expected %s (e.g. [a, b]), got a single value \"%.60s\"",
                 k->section, k->name, exp, fy_node_get_scalar0(v));
        else
            werr(w, line, "%s.%s: expected %s, got %s", k->section, k->name, exp, kind_of(v));
        return;
    }
    if (v && !fy_node_is_scalar(v)) {
        werr(w, line, "%s.%s: expected %s, got %s", k->section, k->name, exp, kind_of(v));
        return;
    }
    char *text = v ? scalar_dup(v) : strdup("");
    if (!text)
        return note_rc(w, MO_ENOMEM);
    char why[900];
    int rc = cfg_assign_scalar(w->c, k, text, v && scalar_quoted(v), why, sizeof why);
    if (rc == MO_ECONFIG)
        werr(w, v && node_line(v) ? node_line(v) : line, "%s.%s: %s", k->section, k->name, why);
    note_rc(w, rc);
    free(text);
}

/* Copies a key node's name into buf; false (after reporting) when it is not
 * a plain name. */
static bool key_name(walker_t *w, struct fy_node *key, const char *where, char *buf, size_t cap) {
    struct fy_node *k = deref(key);
    if (!k || !fy_node_is_scalar(k)) {
        werr(w, node_line(key), "%s: expected a key name, got %s", where,
             k ? kind_of(k) : "an undefined alias");
        return false;
    }
    size_t len = 0;
    const char *s = fy_node_get_scalar(k, &len);
    snprintf(buf, cap, "%.*s", (int)(len < cap ? len : cap - 1), s);
    if (!strcmp(buf, "<<")) {
        werr(w, node_line(key), "%s: merge keys (<<) are not supported", where);
        return false;
    }
    return true;
}

static void unknown_key(walker_t *w, int line, const char *sec, const char *name) {
    char sug[2 * NAME_CAP + 2];
    if (cfg_suggest(sec, name, sug, sizeof sug))
        werr(w, line, "%s.%s: unknown key; did you mean '%s'?", sec, name, sug);
    else
        werr(w, line, "%s.%s: unknown key (see docs/config.md for the keys of %s)", sec, name, sec);
}

static void walk_section(walker_t *w, int s, struct fy_node *key, struct fy_node *value) {
    const char *sec = cfg_sections[s].name;
    struct fy_node *v = deref(value);
    int line = node_line(key);
    if (w->sec_line[s] > 0) {
        werr(w, line, "%s: duplicate section (first at line %d); merge the two", sec,
             w->sec_line[s]);
        return;
    }
    w->sec_line[s] = line > 0 ? line : 1;
    if (is_null(v))
        return; /* an empty section */
    if (!fy_node_is_mapping(v)) {
        char q[80] = "";
        if (fy_node_is_scalar(v))
            snprintf(q, sizeof q, " \"%.60s\"", fy_node_get_scalar0(v));
        werr(w, line, "%s: expected a mapping of %s settings, got %s%s", sec, sec, kind_of(v), q);
        return;
    }
    void *it = NULL;
    for (struct fy_node_pair *p; (p = fy_node_mapping_iterate(v, &it));) {
        char name[NAME_CAP];
        struct fy_node *kn = fy_node_pair_key(p);
        if (!key_name(w, kn, sec, name, sizeof name))
            continue;
        const cfg_key_t *k = cfg_find(sec, name);
        if (!k)
            unknown_key(w, node_line(kn), sec, name);
        else
            apply_value(w, k, kn, fy_node_pair_value(p));
    }
}

static void walk_top(walker_t *w, struct fy_node *root) {
    struct fy_node *r = deref(root);
    if (is_null(r))
        return; /* an empty document: every default */
    if (!fy_node_is_mapping(r)) {
        werr(w, node_line(r), "expected a mapping of sections (run, model, lora, ...), got %s",
             kind_of(r));
        return;
    }
    void *it = NULL;
    for (struct fy_node_pair *p; (p = fy_node_mapping_iterate(r, &it));) {
        char name[NAME_CAP];
        struct fy_node *kn = fy_node_pair_key(p);
        int line = node_line(kn), s = 0;
        if (!key_name(w, kn, "top level", name, sizeof name))
            continue;
        for (; s < cfg_nsections && strcmp(name, cfg_sections[s].name); s++) {
        }
        if (s < cfg_nsections) {
            walk_section(w, s, kn, fy_node_pair_value(p));
            continue;
        }
        char *dot = strchr(name, '.'), sug[2 * NAME_CAP + 2];
        if (dot) { /* section.key at the top level */
            *dot = '\0';
            const cfg_key_t *k = cfg_find(name, dot + 1);
            if (k)
                apply_value(w, k, kn, fy_node_pair_value(p));
            else
                unknown_key(w, line, name, dot + 1);
        } else if (cfg_suggest(name, NULL, sug, sizeof sug)) {
            werr(w, line, "%s: unknown section; did you mean '%s'?", name, sug);
        } else {
            werr(w, line,
                 "%s: unknown section (sections: run, model, lora, rollout, reward, "
                 "learner, data, transport, metrics)",
                 name);
        }
    }
}

/* Reports libfyaml's own errors (syntax); true when there were any. */
static bool report_diag(walker_t *w, struct fy_diag *diag) {
    bool any = false;
    void *it = NULL;
    for (struct fy_diag_error *e; (e = fy_diag_errors_iterate(diag, &it));) {
        if (e->type < FYET_ERROR)
            continue;
        werr(w, e->line, "invalid YAML: %s (column %d)", e->msg ? e->msg : "syntax error",
             e->column);
        any = true;
    }
    return any;
}

int cfg_apply_yaml(moerl_config_t *c, const char *text, size_t len, const char *file,
                   config_errors_t *errs, cfg_origin_t *org) {
    walker_t w = {c, file, errs, org, {0}, 0};
    MO_ASSERT(cfg_nsections <= 32);
    struct fy_diag *diag = NULL;
    struct fy_parser *p = parser_new(&diag);
    if (!p)
        return mo_errorf(MO_ENOMEM, "%s: cannot create a YAML parser", file);
    if (fy_parser_set_string(p, text, len) != 0) {
        fy_parser_destroy(p);
        fy_diag_destroy(diag);
        return mo_errorf(MO_ENOMEM, "%s: cannot set up the YAML parser", file);
    }
    struct fy_document *doc = fy_parse_load_document(p);
    if (doc) {
        walk_top(&w, fy_document_root(doc));
        fy_parse_document_destroy(p, doc);
        struct fy_document *more = fy_parse_load_document(p);
        if (more) {
            werr(&w, node_line(fy_document_root(more)),
                 "a config file holds one YAML document; found a second one");
            fy_parse_document_destroy(p, more);
        }
    }
    if (!report_diag(&w, diag) && fy_parser_get_stream_error(p))
        werr(&w, 0, "invalid YAML");
    fy_parser_destroy(p);
    fy_diag_destroy(diag);
    return w.rc;
}

/* The file's bytes, NUL-terminated, or an error in errs. */
static char *read_file(const char *path, size_t *len, config_errors_t *errs) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        cfg_error_add(errs, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - 1 - n, f);
        if (n < cap - 1)
            break;
        char *bigger = cap > FILE_MAX ? NULL : realloc(buf, 2 * cap);
        if (!bigger) {
            cfg_error_add(errs, "%s: %s", path,
                          cap > FILE_MAX ? "too large for a config file" : "out of memory");
            free(buf);
            buf = NULL;
            break;
        }
        buf = bigger;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        cfg_error_add(errs, "%s: cannot read: %s", path, strerror(errno));
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        *len = n;
    }
    return buf;
}

static int load(moerl_config_t *c, const char *path, const char *text, const char *name,
                const char *const *sets, int nsets, config_errors_t *out) {
    config_errors_t local = {0}, *errs = out ? out : &local;
    memset(c, 0, sizeof *c);
    int *lines = calloc((size_t)cfg_nkeys, sizeof *lines);
    int rc = lines ? config_defaults(c) : mo_errorf(MO_ENOMEM, "out of memory");
    cfg_origin_t org = {path ? path : name, lines};
    char *owned = NULL;
    size_t len = text ? strlen(text) : 0;
    if (rc == 0 && path)
        text = owned = read_file(path, &len, errs);
    if (rc == 0 && text)
        rc = cfg_apply_yaml(c, text, len, org.file, errs, &org);
    for (int i = 0; rc == 0 && i < nsets; i++) {
        const char *eq = strchr(sets[i], '=');
        char key[256];
        if (!eq || eq == sets[i] || eq - sets[i] >= (long)sizeof key) {
            cfg_error_add(errs, "--set %s: expected key=value", sets[i]);
            continue;
        }
        memcpy(key, sets[i], (size_t)(eq - sets[i]));
        key[eq - sets[i]] = '\0';
        int r = config_set(c, key, eq + 1);
        if (r == MO_ECONFIG)
            cfg_error_add(errs, "--set: %s", mo_last_error());
        else if (r < 0)
            rc = r;
        for (int j = 0; r == 0 && j < cfg_nkeys; j++) {
            char full[256];
            snprintf(full, sizeof full, "%s.%s", cfg_keys[j].section, cfg_keys[j].name);
            if (!strcmp(full, key))
                lines[j] = -1;
        }
    }
    /* Cross-key checks only make sense once every single value was valid. */
    if (rc == 0 && errs->n == 0)
        cfg_validate_into(c, &org, errs);
    if (rc == 0)
        rc = cfg_errors_status(errs);
    free(owned);
    free(lines);
    config_errors_free(&local);
    return rc;
}

int config_load(moerl_config_t *c, const char *path, const char *const *sets, int nsets,
                config_errors_t *errs) {
    return load(c, path, NULL, NULL, sets, nsets, errs);
}

int config_load_file(moerl_config_t *c, const char *path) {
    return load(c, path, NULL, NULL, NULL, 0, NULL);
}

int config_load_string(moerl_config_t *c, const char *text, const char *name) {
    return load(c, NULL, text, name ? name : "<string>", NULL, 0, NULL);
}

int cfg_parse_flow_list(const char *text, char ***items, int *n, char *why, size_t cap) {
    struct fy_diag *diag = NULL;
    struct fy_parser *p = parser_new(&diag);
    *items = NULL;
    *n = 0;
    if (!p)
        return mo_errorf(MO_ENOMEM, "cannot create a YAML parser");
    int rc = MO_ECONFIG;
    struct fy_document *doc = NULL;
    if (fy_parser_set_string(p, text, strlen(text)) == 0)
        doc = fy_parse_load_document(p);
    struct fy_node *root = doc ? fy_document_root(doc) : NULL;
    if (!root || !fy_node_is_sequence(root)) {
        snprintf(why, cap, "expected a list like [a, b], got \"%.60s\"", text);
        goto done;
    }
    int cnt = fy_node_sequence_item_count(root);
    char **out = calloc((size_t)(cnt > 0 ? cnt : 1), sizeof *out);
    if (!out) {
        rc = mo_errorf(MO_ENOMEM, "out of memory");
        goto done;
    }
    void *it = NULL;
    int k = 0;
    for (struct fy_node *e; k < cnt && (e = deref(fy_node_sequence_iterate(root, &it))); k++) {
        if (!fy_node_is_scalar(e)) {
            snprintf(why, cap, "element %d: expected a string, got %s", k, kind_of(e));
            cfg_strings_free(out, k);
            goto done;
        }
        if (!(out[k] = scalar_dup(e))) {
            cfg_strings_free(out, k);
            rc = mo_errorf(MO_ENOMEM, "out of memory");
            goto done;
        }
    }
    *items = out;
    *n = k;
    rc = 0;
done:
    if (doc)
        fy_parse_document_destroy(p, doc);
    fy_parser_destroy(p);
    fy_diag_destroy(diag);
    return rc;
}
