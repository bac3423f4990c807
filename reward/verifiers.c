/* verifiers: the built-in reward functions: exact and numeric answer match
 * (with answer extraction), regex and format checks (PCRE2), a length
 * penalty, the built-in tasks' verifiers, a constant, and the plugin term. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/status.h"
#include "reward/reward_internal.h"

/* ------------------------------------------------------------------------
 * Options
 * ---------------------------------------------------------------------- */

/* Fails on the first option whose key is not in known (NULL-terminated). */
static int opts_check(const reward_opt_t *o, int n, const char *const *known, int *bad) {
    for (int i = 0; i < n; i++) {
        bool ok = false;
        for (int k = 0; known[k] && !ok; k++)
            ok = !strcmp(o[i].key, known[k]);
        if (ok)
            continue;
        char list[256];
        size_t len = 0;
        list[0] = '\0';
        for (int k = 0; known[k] && len < sizeof list; k++)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", k ? ", " : "", known[k]);
        *bad = i;
        return mo_errorf(MO_EINVAL, "unknown option '%s' (options: %s)", o[i].key,
                         known[0] ? list : "none");
    }
    return MO_OK;
}

static int opt_number(const reward_opt_t *o, double *v) {
    char *end;
    errno = 0;
    double x = strtod(o->value, &end);
    if (end == o->value || *end != '\0' || !isfinite(x) || errno == ERANGE)
        return mo_errorf(MO_EINVAL, "option %s: expected a finite number, got \"%.100s\"", o->key,
                         o->value);
    *v = x;
    return MO_OK;
}

static int opt_nonneg(const reward_opt_t *o, double *v) {
    TRY(opt_number(o, v));
    if (*v < 0)
        return mo_errorf(MO_EINVAL, "option %s: must be >= 0, got %g", o->key, *v);
    return MO_OK;
}

static int opt_bool(const reward_opt_t *o, bool *v) {
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no",
                                                                                "off"};
    for (int i = 0; i < 4; i++) {
        if (!strcmp(o->value, yes[i]) || !strcmp(o->value, no[i])) {
            *v = !strcmp(o->value, yes[i]);
            return MO_OK;
        }
    }
    return mo_errorf(MO_EINVAL,
                     "option %s: expected 1/0, true/false, yes/no or on/off, got \"%.100s\"",
                     o->key, o->value);
}

static int opt_choice(const reward_opt_t *o, const char *const *names, int *v) {
    char list[256];
    size_t len = 0;
    for (int i = 0; names[i]; i++) {
        if (!strcmp(o->value, names[i])) {
            *v = i;
            return MO_OK;
        }
        if (len < sizeof list)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", names[i]);
    }
    return mo_errorf(MO_EINVAL, "option %s: expected one of %s, got \"%.100s\"", o->key, list,
                     o->value);
}

/* ------------------------------------------------------------------------
 * Text
 * ---------------------------------------------------------------------- */

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static void trim(const char **s, size_t *n) {
    while (*n && is_space(**s)) {
        (*s)++;
        (*n)--;
    }
    while (*n && is_space((*s)[*n - 1]))
        (*n)--;
}

static bool eq_bytes(const char *a, size_t an, const char *b, size_t bn, bool icase) {
    if (an != bn)
        return false;
    for (size_t i = 0; i < an; i++) {
        char x = a[i], y = b[i];
        if (icase) {
            x = (char)tolower((unsigned char)x);
            y = (char)tolower((unsigned char)y);
        }
        if (x != y)
            return false;
    }
    return true;
}

/* Start of the last occurrence of needle in s[0..n), or SIZE_MAX. */
static size_t find_last(const char *s, size_t n, const char *needle, bool icase) {
    size_t m = strlen(needle);
    if (m > n)
        return SIZE_MAX;
    for (size_t i = n - m + 1; i-- > 0;)
        if (eq_bytes(s + i, m, needle, m, icase))
            return i;
    return SIZE_MAX;
}

/* A printable excerpt of s[0..n) for detail lines: at most 40 bytes, quotes
 * and controls escaped, "..." when cut. */
static const char *snip(char *buf, size_t cap, const char *s, size_t n) {
    size_t o = 0, i = 0;
    for (; i < n && i < 40 && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') {
            buf[o++] = '\\';
            buf[o++] = 'n';
        } else if (c == '"' || c == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)c;
        } else {
            buf[o++] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
        }
    }
    if (i < n && o + 4 <= cap) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

/* ------------------------------------------------------------------------
 * Numbers: 42, -7, +3, 1,234,567 (thousands groups of exactly 3), 3.25,
 * .5, 1e-3, U+2212 minus, and with fractions on: 3/4, -3/4, 1.5/2,
 * \frac{3}{4} (also \dfrac, \tfrac). A sign counts only when the character
 * before it is not a letter or digit ("5-3" is 5 and 3).
 * ---------------------------------------------------------------------- */

typedef struct numctx {
    const char *s;
    size_t n;
    bool frac;
    char *scratch; /* at least n + 1 bytes */
} numctx_t;

static bool dig(const numctx_t *c, size_t j) {
    return j < c->n && isdigit((unsigned char)c->s[j]);
}

/* An unsigned numeral at j; its value through strtod on the digits without
 * thousands commas. */
static bool numeral_at(const numctx_t *c, size_t j, bool exp_ok, double *v, size_t *end) {
    const char *s = c->s;
    size_t k = j, len = 0;
    while (dig(c, k))
        c->scratch[len++] = s[k++];
    size_t int_digits = k - j;
    if (int_digits >= 1 && int_digits <= 3) {
        while (k < c->n && s[k] == ',' && dig(c, k + 1) && dig(c, k + 2) && dig(c, k + 3) &&
               !dig(c, k + 4)) {
            memcpy(c->scratch + len, s + k + 1, 3);
            len += 3;
            k += 4;
        }
    }
    bool frac_digits = false;
    if (k < c->n && s[k] == '.' && dig(c, k + 1)) {
        c->scratch[len++] = s[k++];
        while (dig(c, k))
            c->scratch[len++] = s[k++];
        frac_digits = true;
    }
    if (int_digits == 0 && !frac_digits)
        return false;
    if (exp_ok && k < c->n && (s[k] == 'e' || s[k] == 'E')) {
        size_t m = k + 1;
        if (m < c->n && (s[m] == '+' || s[m] == '-'))
            m++;
        if (dig(c, m)) {
            while (k < m)
                c->scratch[len++] = s[k++];
            while (dig(c, k))
                c->scratch[len++] = s[k++];
        }
    }
    c->scratch[len] = '\0';
    double x = strtod(c->scratch, NULL);
    if (!isfinite(x))
        return false;
    *v = x;
    *end = k;
    return true;
}

static bool num_at(const numctx_t *c, size_t i, double *v, size_t *end);

static bool lit_at(const numctx_t *c, size_t j, const char *lit) {
    size_t m = strlen(lit);
    return j + m <= c->n && !memcmp(c->s + j, lit, m);
}

/* \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b} with a and b numbers, b != 0. */
static bool latex_frac_at(const numctx_t *c, size_t j, double *v, size_t *end) {
    static const char *const cmds[] = {"\\frac{", "\\dfrac{", "\\tfrac{"};
    size_t k = SIZE_MAX;
    for (int t = 0; t < 3 && k == SIZE_MAX; t++)
        if (lit_at(c, j, cmds[t]))
            k = j + strlen(cmds[t]);
    if (k == SIZE_MAX)
        return false;
    numctx_t inner = *c;
    inner.frac = false;
    double a, b;
    if (!num_at(&inner, k, &a, &k) || !lit_at(c, k, "}{") || !num_at(&inner, k + 2, &b, &k) ||
        !lit_at(c, k, "}") || b == 0)
        return false;
    *v = a / b;
    *end = k + 1;
    return isfinite(*v);
}

static bool num_at(const numctx_t *c, size_t i, double *v, size_t *end) {
    const char *s = c->s;
    size_t j = i;
    bool neg = false;
    bool sign_ok = i == 0 || !isalnum((unsigned char)s[i - 1]);
    if (j < c->n && (s[j] == '-' || s[j] == '+')) {
        neg = s[j] == '-';
        j++;
    } else if (lit_at(c, j, "\xe2\x88\x92")) {
        neg = true;
        j += 3;
    }
    if (j != i && !sign_ok)
        return false;
    double x;
    size_t k;
    if (c->frac && latex_frac_at(c, j, &x, &k)) {
        /* value complete */
    } else if (numeral_at(c, j, true, &x, &k)) {
        double d;
        size_t k2;
        if (c->frac && k < c->n && s[k] == '/' && numeral_at(c, k + 1, false, &d, &k2) && d != 0) {
            x /= d;
            k = k2;
        }
    } else {
        return false;
    }
    if (!isfinite(x))
        return false;
    *v = neg ? -x : x;
    *end = k;
    return true;
}

/* The last number in c's text: value and span [*b, *e). */
static bool last_number(const numctx_t *c, double *v, size_t *b, size_t *e) {
    bool found = false;
    size_t i = 0;
    while (i < c->n) {
        double x;
        size_t end;
        if (num_at(c, i, &x, &end)) {
            found = true;
            *v = x;
            *b = i;
            *e = end;
            i = end;
        } else {
            i++;
        }
    }
    return found;
}

/* s[0..n) (trimmed) read as one number; failing that, its last number. */
static bool read_number(const char *s, size_t n, bool frac, bool whole_only, char *scratch,
                        double *v) {
    trim(&s, &n);
    numctx_t c = {s, n, frac, scratch};
    size_t end, b;
    if (n && num_at(&c, 0, v, &end) && end == n)
        return true;
    return !whole_only && last_number(&c, v, &b, &end);
}

/* ------------------------------------------------------------------------
 * Answer extraction
 * ---------------------------------------------------------------------- */

enum { EX_NONE, EX_LAST_NUMBER, EX_ANSWER, EX_HASH, EX_BOXED, EX_AUTO };
static const char *const extract_names[] = {"none",  "last_number", "answer", "hash",
                                            "boxed", "auto",        NULL};

/* The rest of the line after a marker, trimmed, one trailing '.' dropped. */
static void rest_of_line(const char *s, size_t n, size_t at, const char **out, size_t *outn) {
    size_t e = at;
    while (e < n && s[e] != '\n')
        e++;
    const char *r = s + at;
    size_t rn = e - at;
    trim(&r, &rn);
    if (rn && r[rn - 1] == '.') {
        rn--;
        trim(&r, &rn);
    }
    *out = r;
    *outn = rn;
}

/* The content of the last \boxed{...}, braces balanced. */
static bool boxed(const char *s, size_t n, const char **out, size_t *outn) {
    size_t at = find_last(s, n, "\\boxed{", false);
    if (at == SIZE_MAX)
        return false;
    size_t b = at + 7, e = b;
    int depth = 1;
    for (; e < n && depth > 0; e++) {
        if (s[e] == '{')
            depth++;
        else if (s[e] == '}')
            depth--;
    }
    if (depth > 0)
        return false;
    *out = s + b;
    *outn = e - 1 - b;
    trim(out, outn);
    return true;
}

/* Selects the text to compare. false (with *missing naming what) when the
 * completion lacks the marker. */
static bool extract(int mode, bool frac, char *scratch, const char *s, size_t n, const char **out,
                    size_t *outn, const char **missing) {
    size_t at;
    switch (mode) {
    case EX_LAST_NUMBER: {
        numctx_t c = {s, n, frac, scratch};
        double v;
        size_t b, e;
        *missing = "no number";
        if (!last_number(&c, &v, &b, &e))
            return false;
        *out = s + b;
        *outn = e - b;
        return true;
    }
    case EX_ANSWER:
        *missing = "no \"answer:\"";
        if ((at = find_last(s, n, "answer:", true)) == SIZE_MAX)
            return false;
        rest_of_line(s, n, at + 7, out, outn);
        return true;
    case EX_HASH:
        *missing = "no \"####\"";
        if ((at = find_last(s, n, "####", false)) == SIZE_MAX)
            return false;
        rest_of_line(s, n, at + 4, out, outn);
        return true;
    case EX_BOXED: *missing = "no complete \\boxed{}"; return boxed(s, n, out, outn);
    case EX_AUTO:
        if (extract(EX_BOXED, frac, scratch, s, n, out, outn, missing) ||
            extract(EX_HASH, frac, scratch, s, n, out, outn, missing) ||
            extract(EX_ANSWER, frac, scratch, s, n, out, outn, missing))
            return true;
        break;
    default: break;
    }
    *out = s;
    *outn = n;
    trim(out, outn);
    return true;
}

/* ------------------------------------------------------------------------
 * exact
 * ---------------------------------------------------------------------- */

typedef struct exact {
    int extract;
    bool icase;
} exact_t;

static int exact_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {"extract", "icase", NULL};
    TRY(opts_check(o, n, keys, bad));
    exact_t x = {EX_NONE, false};
    for (int i = 0; i < n; i++) {
        *bad = i;
        if (!strcmp(o[i].key, "extract"))
            TRY(opt_choice(&o[i], extract_names, &x.extract));
        else
            TRY(opt_bool(&o[i], &x.icase));
    }
    *bad = -1;
    exact_t *s = malloc(sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "out of memory");
    *s = x;
    *state = s;
    return MO_OK;
}

static int exact_score(void *state, const reward_input_t *in, double *reward, char *detail,
                       size_t cap) {
    const exact_t *x = state;
    char *scratch = malloc(in->completion_len + 1);
    if (!scratch)
        return mo_errorf(MO_ENOMEM, "out of memory");
    const char *got, *missing, *want = in->answer;
    size_t gotn, wantn = in->answer_len;
    trim(&want, &wantn);
    char a[64], b[64];
    if (!extract(x->extract, true, scratch, in->completion, in->completion_len, &got, &gotn,
                 &missing)) {
        *reward = 0.0;
        reward_detailf(detail, cap, "%s in the completion", missing);
    } else {
        bool ok = eq_bytes(got, gotn, want, wantn, x->icase);
        *reward = ok ? 1.0 : 0.0;
        reward_detailf(detail, cap, "%s: got \"%s\", want \"%s\"", ok ? "match" : "no match",
                       snip(a, sizeof a, got, gotn), snip(b, sizeof b, want, wantn));
    }
    free(scratch);
    return MO_OK;
}

/* ------------------------------------------------------------------------
 * numeric
 * ---------------------------------------------------------------------- */

typedef struct numeric {
    double tol, rel;
    int extract;
    bool frac;
} numeric_t;

static int numeric_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {"tol", "rel", "extract", "frac", NULL};
    TRY(opts_check(o, n, keys, bad));
    numeric_t x = {1e-6, 0.0, EX_LAST_NUMBER, true};
    for (int i = 0; i < n; i++) {
        *bad = i;
        if (!strcmp(o[i].key, "tol"))
            TRY(opt_nonneg(&o[i], &x.tol));
        else if (!strcmp(o[i].key, "rel"))
            TRY(opt_nonneg(&o[i], &x.rel));
        else if (!strcmp(o[i].key, "extract"))
            TRY(opt_choice(&o[i], extract_names, &x.extract));
        else
            TRY(opt_bool(&o[i], &x.frac));
    }
    *bad = -1;
    numeric_t *s = malloc(sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "out of memory");
    *s = x;
    *state = s;
    return MO_OK;
}

/* The completion's number under the extraction mode. */
static bool numeric_got(const numeric_t *x, const reward_input_t *in, char *scratch, double *v,
                        const char **missing) {
    const char *s;
    size_t n;
    if (!extract(x->extract, x->frac, scratch, in->completion, in->completion_len, &s, &n, missing))
        return false;
    *missing = "no number";
    return read_number(s, n, x->frac, x->extract == EX_NONE, scratch, v);
}

static int numeric_score(void *state, const reward_input_t *in, double *reward, char *detail,
                         size_t cap) {
    const numeric_t *x = state;
    size_t big = in->completion_len > in->answer_len ? in->completion_len : in->answer_len;
    char *scratch = malloc(big + 1);
    if (!scratch)
        return mo_errorf(MO_ENOMEM, "out of memory");
    double want, got;
    char a[64];
    if (!read_number(in->answer, in->answer_len, x->frac, false, scratch, &want)) {
        free(scratch);
        return mo_errorf(MO_EINVAL, "the answer \"%s\" holds no number",
                         snip(a, sizeof a, in->answer, in->answer_len));
    }
    const char *missing;
    if (!numeric_got(x, in, scratch, &got, &missing)) {
        *reward = 0.0;
        reward_detailf(detail, cap, "%s in the completion; want %.10g", missing, want);
    } else {
        double lim = fmax(x->tol, x->rel * fabs(want));
        bool ok = fabs(got - want) <= lim;
        *reward = ok ? 1.0 : 0.0;
        reward_detailf(detail, cap, "%s: got %.10g, want %.10g", ok ? "match" : "no match", got,
                       want);
    }
    free(scratch);
    return MO_OK;
}

/* ------------------------------------------------------------------------
 * regex, format
 * ---------------------------------------------------------------------- */

typedef struct regex {
    pcre2_code *code;
} rx_t;

static int regex_make_full(const reward_opt_t *o, int n, void **state, int *bad, bool full) {
    static const char *const keys[] = {"pattern", "full", "icase", "multiline", "dotall", NULL};
    TRY(opts_check(o, n, keys, bad));
    bool icase = false, multiline = false, dotall = false;
    int pat = -1;
    for (int i = 0; i < n; i++) {
        *bad = i;
        if (!strcmp(o[i].key, "pattern"))
            pat = i;
        else if (!strcmp(o[i].key, "full"))
            TRY(opt_bool(&o[i], &full));
        else if (!strcmp(o[i].key, "icase"))
            TRY(opt_bool(&o[i], &icase));
        else if (!strcmp(o[i].key, "multiline"))
            TRY(opt_bool(&o[i], &multiline));
        else
            TRY(opt_bool(&o[i], &dotall));
    }
    *bad = -1;
    if (pat < 0)
        return mo_errorf(MO_EINVAL, "option pattern is required");
    uint32_t flags = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
    flags |= (full ? PCRE2_ANCHORED | PCRE2_ENDANCHORED : 0) | (icase ? PCRE2_CASELESS : 0) |
             (multiline ? PCRE2_MULTILINE : 0) | (dotall ? PCRE2_DOTALL : 0);
    int err;
    PCRE2_SIZE off;
    pcre2_code *code =
        pcre2_compile((PCRE2_SPTR)o[pat].value, PCRE2_ZERO_TERMINATED, flags, &err, &off, NULL);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        *bad = pat;
        return mo_errorf(MO_EINVAL, "option pattern: %s at pattern offset %zu (column %zu)",
                         (const char *)msg, (size_t)off, (size_t)o[pat].value_col + off);
    }
    rx_t *s = malloc(sizeof *s);
    if (!s) {
        pcre2_code_free(code);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    s->code = code;
    *state = s;
    return MO_OK;
}

static int regex_make(const reward_opt_t *o, int n, void **state, int *bad) {
    return regex_make_full(o, n, state, bad, false);
}

static int format_make(const reward_opt_t *o, int n, void **state, int *bad) {
    return regex_make_full(o, n, state, bad, true);
}

static int regex_score(void *state, const reward_input_t *in, double *reward, char *detail,
                       size_t cap) {
    const rx_t *x = state;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(x->code, NULL);
    if (!md)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = pcre2_match(x->code, (PCRE2_SPTR)in->completion, in->completion_len, 0, 0, md, NULL);
    size_t at = rc >= 0 ? (size_t)pcre2_get_ovector_pointer(md)[0] : 0;
    pcre2_match_data_free(md);
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) {
        *reward = rc >= 0 ? 1.0 : 0.0;
        if (rc >= 0)
            reward_detailf(detail, cap, "match at byte %zu", at);
        else
            reward_detailf(detail, cap, "no match");
        return MO_OK;
    }
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
        rc == PCRE2_ERROR_HEAPLIMIT) {
        *reward = 0.0;
        reward_detailf(detail, cap, "no match (matching gave up: resource limit)");
        return MO_OK;
    }
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return mo_errorf(MO_EINVAL, "match failed: %s", (const char *)msg);
}

static void regex_free(void *state) {
    rx_t *x = state;
    if (x)
        pcre2_code_free(x->code);
    free(x);
}

/* ------------------------------------------------------------------------
 * length_penalty
 * ---------------------------------------------------------------------- */

typedef struct lenpen {
    double max, coef;
    int unit; /* 0 tokens, 1 bytes */
} lenpen_t;

static int lenpen_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {"max", "coef", "unit", NULL};
    static const char *const units[] = {"tokens", "bytes", NULL};
    TRY(opts_check(o, n, keys, bad));
    lenpen_t x = {0.0, 0.01, 0};
    for (int i = 0; i < n; i++) {
        *bad = i;
        if (!strcmp(o[i].key, "max"))
            TRY(opt_nonneg(&o[i], &x.max));
        else if (!strcmp(o[i].key, "coef"))
            TRY(opt_nonneg(&o[i], &x.coef));
        else
            TRY(opt_choice(&o[i], units, &x.unit));
    }
    *bad = -1;
    lenpen_t *s = malloc(sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "out of memory");
    *s = x;
    *state = s;
    return MO_OK;
}

static int lenpen_score(void *state, const reward_input_t *in, double *reward, char *detail,
                        size_t cap) {
    const lenpen_t *x = state;
    double len;
    if (x->unit == 1) {
        len = (double)in->completion_len;
    } else {
        if (in->completion_tokens < 0)
            return mo_errorf(MO_EINVAL, "the completion's token count is unknown (use unit=bytes)");
        len = (double)in->completion_tokens;
    }
    double over = len > x->max ? len - x->max : 0.0;
    *reward = -x->coef * over;
    reward_detailf(detail, cap, "%.0f %s, %.0f over %.0f", len, x->unit ? "bytes" : "tokens", over,
                   x->max);
    return MO_OK;
}

/* ------------------------------------------------------------------------
 * arith_exact, sort_exact: the first line of the completion, trimmed, must
 * equal the answer.
 * ---------------------------------------------------------------------- */

static int no_opts_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {NULL};
    TRY(opts_check(o, n, keys, bad));
    *state = NULL;
    return MO_OK;
}

static void first_line(const reward_input_t *in, const char **s, size_t *n) {
    size_t e = 0;
    while (e < in->completion_len && in->completion[e] != '\n')
        e++;
    *s = in->completion;
    *n = e;
    trim(s, n);
}

static int line_exact(const reward_input_t *in, double *reward, char *detail, size_t cap,
                      const char **got, size_t *gotn, const char **want, size_t *wantn) {
    *want = in->answer;
    *wantn = in->answer_len;
    trim(want, wantn);
    if (*wantn == 0)
        return mo_errorf(MO_EINVAL, "needs an answer, and the record has none");
    first_line(in, got, gotn);
    bool ok = eq_bytes(*got, *gotn, *want, *wantn, false);
    *reward = ok ? 1.0 : 0.0;
    char a[64], b[64];
    reward_detailf(detail, cap, "%s: got \"%s\", want \"%s\"", ok ? "correct" : "wrong",
                   snip(a, sizeof a, *got, *gotn), snip(b, sizeof b, *want, *wantn));
    return MO_OK;
}

static int arith_score(void *state, const reward_input_t *in, double *reward, char *detail,
                       size_t cap) {
    (void)state;
    const char *got, *want;
    size_t gotn, wantn;
    return line_exact(in, reward, detail, cap, &got, &gotn, &want, &wantn);
}

static int sort_score(void *state, const reward_input_t *in, double *reward, char *detail,
                      size_t cap) {
    (void)state;
    const char *got, *want;
    size_t gotn, wantn;
    TRY(line_exact(in, reward, detail, cap, &got, &gotn, &want, &wantn));
    if (*reward == 0.0 && detail && cap) {
        int count[256] = {0};
        for (size_t i = 0; i < gotn; i++)
            count[(unsigned char)got[i]]++;
        for (size_t i = 0; i < wantn; i++)
            count[(unsigned char)want[i]]--;
        bool same = true;
        for (int c = 0; c < 256; c++)
            same = same && count[c] == 0;
        size_t len = strlen(detail);
        reward_detailf(detail + len, cap - len, " (%s)",
                       same ? "same items, wrong order" : "different items");
    }
    return MO_OK;
}

/* ------------------------------------------------------------------------
 * constant, plugin
 * ---------------------------------------------------------------------- */

static int constant_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {"value", NULL};
    TRY(opts_check(o, n, keys, bad));
    double v = 1.0;
    for (int i = 0; i < n; i++) {
        *bad = i;
        TRY(opt_number(&o[i], &v));
    }
    *bad = -1;
    double *s = malloc(sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "out of memory");
    *s = v;
    *state = s;
    return MO_OK;
}

static int constant_score(void *state, const reward_input_t *in, double *reward, char *detail,
                          size_t cap) {
    (void)in;
    *reward = *(const double *)state;
    reward_detailf(detail, cap, "constant");
    return MO_OK;
}

static int plugin_make(const reward_opt_t *o, int n, void **state, int *bad) {
    static const char *const keys[] = {"path", "args", NULL};
    TRY(opts_check(o, n, keys, bad));
    const char *path = NULL, *args = "";
    for (int i = 0; i < n; i++) {
        if (!strcmp(o[i].key, "path"))
            path = o[i].value;
        else
            args = o[i].value;
    }
    if (!path)
        return mo_errorf(MO_EINVAL, "option path is required");
    reward_plugin_t *p;
    TRY(reward_plugin_open(path, args, &p));
    *state = p;
    return MO_OK;
}

static int plugin_score(void *state, const reward_input_t *in, double *reward, char *detail,
                        size_t cap) {
    return reward_plugin_score(state, in, reward, detail, cap);
}

static void plugin_free(void *state) {
    reward_plugin_t *p = state;
    reward_plugin_close(&p);
}

/* ------------------------------------------------------------------------
 * Table
 * ---------------------------------------------------------------------- */

const reward_builtin_t reward_builtins[] = {
    {"exact",
     "1 if the completion (or the part extract= selects: none, last_number, answer, hash, boxed, "
     "auto) equals the answer after trimming whitespace, else 0; icase=1 ignores ASCII case",
     exact_make, exact_score, free},
    {"numeric",
     "1 if the completion's number (extract=, default last_number) is within max(tol, "
     "rel*|answer|) "
     "of the answer's (tol=1e-6, rel=0), else 0; frac=0 turns off 3/4 and \\frac{3}{4}",
     numeric_make, numeric_score, free},
    {"regex",
     "1 if pattern= (PCRE2, UTF-8) matches somewhere in the completion, else 0; full=1 requires "
     "the whole completion; icase, multiline, dotall",
     regex_make, regex_score, regex_free},
    {"format", "as regex, but full=1 by default: the whole completion must match pattern=",
     format_make, regex_score, regex_free},
    {"length_penalty",
     "-coef * max(0, length - max) with length in unit=tokens (default) or bytes; max=0, "
     "coef=0.01",
     lenpen_make, lenpen_score, free},
    {"arith_exact",
     "1 if the completion's first line, trimmed, equals the answer of an arith task, else 0",
     no_opts_make, arith_score, free},
    {"sort_exact",
     "1 if the completion's first line, trimmed, equals the answer of a sort task, else 0",
     no_opts_make, sort_score, free},
    {"constant", "value= (default 1) for every completion", constant_make, constant_score, free},
    {"plugin",
     "the reward of a plugin library: path= (required), args= passed to its moerl_reward_init",
     plugin_make, plugin_score, plugin_free},
};
const int reward_n_builtins = (int)(sizeof reward_builtins / sizeof reward_builtins[0]);

const reward_builtin_t *reward_builtin_find(const char *name, size_t len) {
    for (int i = 0; i < reward_n_builtins; i++)
        if (strlen(reward_builtins[i].name) == len && !strncmp(reward_builtins[i].name, name, len))
            return &reward_builtins[i];
    return NULL;
}
