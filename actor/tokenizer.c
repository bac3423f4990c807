/* tokenizer: tokenizer.json loading, the encode pipeline (added tokens, NFC,
 * regex pre-tokenization, BPE), decoding, and prompt templates. The writer of
 * the byte-level tokenizer lives in tokenizer_bytelevel.c. */
#include "actor/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actor/bpe.h"
#include "actor/unicode.h"
#include "core/status.h"

/* GPT-2's pre-tokenizer regex, used by ByteLevel with use_regex true. */
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* A word character as Rust's Unicode \w sees it (added tokens' single_word). */
static const char WORD_REGEX[] = "[\\p{L}\\p{Nl}\\p{Nd}\\p{M}\\p{Pc}\\x{200C}\\x{200D}]";

#define MAX_STEPS 16
#define PATH_CAP 4096

typedef struct {
    char *content; /* (len) NUL-terminated */
    size_t len;
    char *norm; /* content after the normalizer, for normalized tokens; else NULL */
    size_t norm_len;
    int32_t id;
    bool special, single_word, lstrip, rstrip, normalized;
} added_tok_t;

typedef struct {
    const char *s; /* the text to match (borrowed from an added_tok_t) */
    uint32_t len, tok;
} mentry_t;

/* Added tokens grouped by first byte, longest first inside a group, so the
 * first hit at a position is the longest. */
typedef struct {
    mentry_t *e; /* (n) */
    size_t n;
    uint32_t start[257]; /* entries with first byte c: [start[c], start[c + 1]) */
} match_set_t;

typedef struct {
    pcre2_code *re;    /* NULL: the step does not split */
    bool prefix_space; /* ByteLevel add_prefix_space */
} pt_step_t;

struct tokenizer {
    bpe_t *bpe;
    added_tok_t *added; /* (nadded) */
    size_t nadded;
    int32_t *added_of; /* (vocab_size) index into added, or -1 */
    size_t vocab_size;
    match_set_t raw, norm; /* added tokens matched before / after normalization */
    bool nfc;
    pt_step_t steps[MAX_STEPS]; /* pre-tokenizer, ByteLevel last */
    size_t nsteps;
    pcre2_code *word_re; /* for single_word tokens, else NULL */
    int32_t bos, eos, pad;
    int32_t *prefix, *suffix; /* (nprefix), (nsuffix) post-processor ids */
    size_t nprefix, nsuffix;
};

/* ---- JSON helpers: every failure names the file and the JSON path ---- */

typedef struct {
    const char *file;
} jctx_t;

__attribute__((format(printf, 4, 5))) static int jfail(const jctx_t *j, int code, const char *path,
                                                       const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return mo_errorf(code, "%s: %s: %s", j->file, path, msg);
}

static const char *jtype(const cJSON *v) {
    if (!v)
        return "nothing";
    if (cJSON_IsNull(v))
        return "null";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsArray(v))
        return "an array";
    return "an object";
}

static const cJSON *jget(const cJSON *obj, const char *key) {
    return cJSON_IsObject(obj) ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
}

static void jpath(char *buf, const char *parent, const char *key) {
    snprintf(buf, PATH_CAP, "%.3000s.%.900s", parent, key);
}

static void jindex(char *buf, const char *parent, size_t i) {
    snprintf(buf, PATH_CAP, "%.4000s[%zu]", parent, i);
}

/* Optional boolean (absent or null: dflt). */
static int jbool(const jctx_t *j, const cJSON *obj, const char *parent, const char *key, bool dflt,
                 bool *out) {
    const cJSON *v = jget(obj, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsBool(v)) {
        char p[PATH_CAP];
        jpath(p, parent, key);
        return jfail(j, MO_EMALFORMED, p, "expected true or false, got %s", jtype(v));
    }
    *out = cJSON_IsTrue(v);
    return 0;
}

static int jint(const jctx_t *j, const cJSON *v, const char *path, int32_t *out) {
    if (!cJSON_IsNumber(v))
        return jfail(j, MO_EMALFORMED, path, "expected a token id, got %s", jtype(v));
    double d = v->valuedouble;
    if (!(d >= 0 && d < BPE_MAX_ID) || d != floor(d))
        return jfail(j, MO_EMALFORMED, path, "expected a token id in [0, %d), got %g", BPE_MAX_ID,
                     d);
    *out = (int32_t)d;
    return 0;
}

/* A component's "type" string. */
static int jcomponent(const jctx_t *j, const cJSON *v, const char *path, const char **type) {
    if (!cJSON_IsObject(v))
        return jfail(j, MO_EMALFORMED, path, "expected an object, got %s", jtype(v));
    const cJSON *ty = jget(v, "type");
    char p[PATH_CAP];
    jpath(p, path, "type");
    if (!cJSON_IsString(ty))
        return jfail(j, MO_EMALFORMED, p, "expected a string, got %s", jtype(ty));
    *type = ty->valuestring;
    return 0;
}

static int unsupported(const jctx_t *j, const char *path, const char *type, const char *supported) {
    char p[PATH_CAP];
    jpath(p, path, "type");
    return jfail(j, MO_EUNSUPPORTED, p, "unsupported \"%.80s\" (supported: %s)", type, supported);
}

static int read_file(const char *path, char **buf, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return mo_errorf(MO_EIO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap);
    int rc = b ? 0 : mo_errorf(MO_ENOMEM, "out of memory reading %s", path);
    while (rc == 0) {
        if (n == cap) {
            char *nb = cap < ((size_t)1 << 31) ? realloc(b, 2 * cap) : NULL;
            if (!nb) {
                rc = mo_errorf(MO_ENOMEM, "%s: too large to read (%zu bytes so far)", path, n);
                break;
            }
            b = nb, cap *= 2;
        }
        size_t got = fread(b + n, 1, cap - n, f);
        n += got;
        if (got == 0) {
            if (ferror(f))
                rc = mo_errorf(MO_EIO, "cannot read %s: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (rc < 0) {
        free(b);
        return rc;
    }
    *buf = b;
    *len = n;
    return 0;
}

static int parse_json_file(const char *path, const char *name, cJSON **out) {
    char *buf = NULL;
    size_t len = 0;
    TRY(read_file(path, &buf, &len));
    const char *end = NULL;
    *out = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!*out) {
        size_t off = end && end >= buf && end <= buf + len ? (size_t)(end - buf) : 0, line = 1;
        for (size_t i = 0; i < off; i++)
            line += buf[i] == '\n';
        free(buf);
        return mo_errorf(MO_EMALFORMED, "%s: not valid JSON (error near byte %zu, line %zu)", name,
                         off, line);
    }
    free(buf);
    if (!cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return mo_errorf(MO_EMALFORMED, "%s: expected a JSON object at the top level", name);
    }
    return 0;
}

/* ---- model ---- */

static int parse_vocab(const jctx_t *j, const cJSON *vocab, bpe_t *bpe) {
    if (!cJSON_IsObject(vocab))
        return jfail(j, MO_EMALFORMED, "model.vocab", "expected an object of token -> id, got %s",
                     jtype(vocab));
    for (const cJSON *e = vocab->child; e; e = e->next) {
        char p[PATH_CAP];
        snprintf(p, sizeof p, "model.vocab[\"%.80s\"]", e->string);
        int32_t id = -1;
        TRY(jint(j, e, p, &id));
        int rc = bpe_add_token(bpe, e->string, strlen(e->string), id);
        if (rc < 0)
            return mo_error_wrap(rc == MO_ENOMEM ? rc : MO_EMALFORMED, "%s: %s", j->file, p);
    }
    return 0;
}

static int parse_merge(const jctx_t *j, const cJSON *m, size_t i, bpe_t *bpe) {
    char p[PATH_CAP];
    jindex(p, "model.merges", i);
    int rc;
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring, *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return jfail(j, MO_EMALFORMED, p,
                         "expected \"left right\" with one space, got \"%.80s\"", s);
        rc = bpe_add_merge(bpe, s, (size_t)(sp - s), sp + 1, strlen(sp + 1));
    } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
               cJSON_IsString(m->child->next)) {
        const char *l = m->child->valuestring, *r = m->child->next->valuestring;
        rc = bpe_add_merge(bpe, l, strlen(l), r, strlen(r));
    } else {
        return jfail(j, MO_EMALFORMED, p,
                     "expected \"left right\" or [\"left\", \"right\"], got %s", jtype(m));
    }
    return rc < 0 ? mo_error_wrap(rc == MO_ENOMEM ? rc : MO_EMALFORMED, "%s: %s", j->file, p) : 0;
}

static int parse_model(const jctx_t *j, const cJSON *model, bpe_t *bpe) {
    if (!cJSON_IsObject(model))
        return jfail(j, MO_EMALFORMED, "model", "expected an object, got %s", jtype(model));
    const cJSON *type = jget(model, "type");
    if (type && !cJSON_IsString(type))
        return jfail(j, MO_EMALFORMED, "model.type", "expected a string, got %s", jtype(type));
    if (type && strcmp(type->valuestring, "BPE") != 0)
        return unsupported(j, "model", type->valuestring, "BPE");
    bool fallback, ignore;
    TRY(jbool(j, model, "model", "byte_fallback", false, &fallback));
    if (fallback)
        return jfail(j, MO_EUNSUPPORTED, "model.byte_fallback",
                     "true is unsupported (a byte-level BPE covers every byte; expected false)");
    TRY(jbool(j, model, "model", "ignore_merges", false, &ignore));
    const cJSON *drop = jget(model, "dropout");
    if (drop && !cJSON_IsNull(drop) && !(cJSON_IsNumber(drop) && drop->valuedouble == 0))
        return jfail(j, MO_EUNSUPPORTED, "model.dropout",
                     "BPE dropout is unsupported (expected null)");
    static const char *affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        const cJSON *v = jget(model, affix[k]);
        char p[PATH_CAP];
        jpath(p, "model", affix[k]);
        if (v && !cJSON_IsNull(v) && !cJSON_IsString(v))
            return jfail(j, MO_EMALFORMED, p, "expected a string or null, got %s", jtype(v));
        if (v && cJSON_IsString(v) && v->valuestring[0])
            return jfail(j, MO_EUNSUPPORTED, p, "\"%.40s\" is unsupported (expected null)",
                         v->valuestring);
    }
    const cJSON *vocab = jget(model, "vocab");
    if (!vocab)
        return jfail(j, MO_EMALFORMED, "model.vocab",
                     "missing (expected an object of token -> id)");
    TRY(parse_vocab(j, vocab, bpe));
    const cJSON *merges = jget(model, "merges");
    if (!cJSON_IsArray(merges))
        return jfail(j, MO_EMALFORMED, "model.merges", "expected an array, got %s", jtype(merges));
    size_t i = 0;
    for (const cJSON *m = merges->child; m; m = m->next, i++)
        TRY(parse_merge(j, m, i, bpe));
    if (bpe_finish(bpe, ignore) < 0)
        return mo_error_wrap(MO_EMALFORMED, "%s", j->file);
    return 0;
}

/* ---- added tokens ---- */

static int parse_added_one(const jctx_t *j, const cJSON *a, const char *p, added_tok_t *t) {
    if (!cJSON_IsObject(a))
        return jfail(j, MO_EMALFORMED, p, "expected an object, got %s", jtype(a));
    char q[PATH_CAP];
    jpath(q, p, "id");
    TRY(jint(j, jget(a, "id"), q, &t->id));
    const cJSON *c = jget(a, "content");
    jpath(q, p, "content");
    if (!cJSON_IsString(c) || !c->valuestring[0])
        return jfail(j, MO_EMALFORMED, q, "expected a non-empty string, got %s", jtype(c));
    TRY(jbool(j, a, p, "special", false, &t->special));
    TRY(jbool(j, a, p, "single_word", false, &t->single_word));
    TRY(jbool(j, a, p, "lstrip", false, &t->lstrip));
    TRY(jbool(j, a, p, "rstrip", false, &t->rstrip));
    TRY(jbool(j, a, p, "normalized", !t->special, &t->normalized));
    t->len = strlen(c->valuestring);
    if (!(t->content = strdup(c->valuestring)))
        return mo_errorf(MO_ENOMEM, "out of memory");
    return 0;
}

static int parse_added(const jctx_t *j, const cJSON *arr, tokenizer_t *t) {
    if (!arr || cJSON_IsNull(arr))
        return 0;
    if (!cJSON_IsArray(arr))
        return jfail(j, MO_EMALFORMED, "added_tokens", "expected an array, got %s", jtype(arr));
    size_t n = (size_t)cJSON_GetArraySize(arr);
    if (n && !(t->added = calloc(n, sizeof *t->added)))
        return mo_errorf(MO_ENOMEM, "out of memory for %zu added tokens", n);
    for (const cJSON *a = arr->child; a; a = a->next) {
        char p[PATH_CAP];
        jindex(p, "added_tokens", t->nadded);
        added_tok_t *tok = &t->added[t->nadded++];
        TRY(parse_added_one(j, a, p, tok));
        for (size_t k = 0; k + 1 < t->nadded; k++) {
            if (t->added[k].id == tok->id)
                return jfail(j, MO_EMALFORMED, p, "id %d repeats added_tokens[%zu]", tok->id, k);
            if (strcmp(t->added[k].content, tok->content) == 0)
                return jfail(j, MO_EMALFORMED, p, "content \"%.80s\" repeats added_tokens[%zu]",
                             tok->content, k);
        }
    }
    return 0;
}

static int mentry_cmp(const void *x, const void *y) {
    const mentry_t *a = x, *b = y;
    uint8_t ca = (uint8_t)a->s[0], cb = (uint8_t)b->s[0];
    if (ca != cb)
        return ca < cb ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return a->tok < b->tok ? -1 : a->tok > b->tok;
}

/* Builds the raw set (normalized == false) and the normalized set. */
static int build_match_sets(tokenizer_t *t) {
    for (size_t i = 0; i < t->nadded; i++) {
        added_tok_t *a = &t->added[i];
        if (a->normalized && t->nfc)
            TRY(uni_nfc(a->content, a->len, &a->norm, &a->norm_len));
    }
    match_set_t *sets[2] = {&t->raw, &t->norm};
    for (int k = 0; k < 2; k++) {
        match_set_t *m = sets[k];
        if (t->nadded && !(m->e = calloc(t->nadded, sizeof *m->e)))
            return mo_errorf(MO_ENOMEM, "out of memory");
        for (size_t i = 0; i < t->nadded; i++) {
            const added_tok_t *a = &t->added[i];
            if (a->normalized != (k == 1))
                continue;
            const char *s = a->norm ? a->norm : a->content;
            size_t len = a->norm ? a->norm_len : a->len;
            if (len > 0)
                m->e[m->n++] = (mentry_t){s, (uint32_t)len, (uint32_t)i};
        }
        if (m->n)
            qsort(m->e, m->n, sizeof *m->e, mentry_cmp);
        size_t pos = 0;
        for (unsigned c = 0; c < 257; c++) {
            m->start[c] = (uint32_t)pos;
            while (pos < m->n && (uint8_t)m->e[pos].s[0] == c)
                pos++;
        }
    }
    return 0;
}

/* ---- normalizer, pre-tokenizer, decoder, post-processor ---- */

static int parse_normalizer(const jctx_t *j, const cJSON *v, const char *path, bool *nfc) {
    if (!v || cJSON_IsNull(v))
        return 0;
    const char *type = "";
    TRY(jcomponent(j, v, path, &type));
    if (strcmp(type, "NFC") == 0) {
        *nfc = true;
        return 0;
    }
    if (strcmp(type, "Sequence") != 0)
        return unsupported(j, path, type, "NFC, Sequence");
    const cJSON *list = jget(v, "normalizers");
    char p[PATH_CAP];
    jpath(p, path, "normalizers");
    if (!cJSON_IsArray(list))
        return jfail(j, MO_EMALFORMED, p, "expected an array, got %s", jtype(list));
    size_t i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        char q[PATH_CAP];
        jindex(q, p, i);
        TRY(parse_normalizer(j, e, q, nfc));
    }
    return 0;
}

static int compile_regex(const jctx_t *j, const char *path, const char *pat, bool literal,
                         pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    uint32_t opt = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    *out = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opt, &err, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return jfail(j, MO_EMALFORMED, path, "bad regex at offset %zu: %s", (size_t)off,
                     (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE); /* the interpreter serves when JIT is absent */
    return 0;
}

static int parse_split(const jctx_t *j, const cJSON *v, const char *path, pt_step_t *st) {
    const cJSON *pat = jget(v, "pattern");
    char p[PATH_CAP];
    jpath(p, path, "pattern");
    const cJSON *re = jget(pat, "Regex"), *str = jget(pat, "String");
    if (!cJSON_IsObject(pat) || (!re == !str))
        return jfail(j, MO_EMALFORMED, p, "expected {\"Regex\": ...} or {\"String\": ...}, got %s",
                     jtype(pat));
    const cJSON *s = re ? re : str;
    char q[PATH_CAP];
    jpath(q, p, re ? "Regex" : "String");
    if (!cJSON_IsString(s))
        return jfail(j, MO_EMALFORMED, q, "expected a string, got %s", jtype(s));
    const cJSON *beh = jget(v, "behavior");
    jpath(p, path, "behavior");
    if (!cJSON_IsString(beh))
        return jfail(j, MO_EMALFORMED, p, "expected a string, got %s", jtype(beh));
    if (strcmp(beh->valuestring, "Isolated") != 0)
        return jfail(j, MO_EUNSUPPORTED, p, "unsupported \"%.40s\" (supported: Isolated)",
                     beh->valuestring);
    bool invert;
    TRY(jbool(j, v, path, "invert", false, &invert));
    if (invert) {
        jpath(p, path, "invert");
        return jfail(j, MO_EUNSUPPORTED, p, "true is unsupported (expected false)");
    }
    return compile_regex(j, q, s->valuestring, str != NULL, &st->re);
}

static int parse_bytelevel(const jctx_t *j, const cJSON *v, const char *path, pt_step_t *st) {
    const cJSON *aps = jget(v, "add_prefix_space");
    char p[PATH_CAP];
    jpath(p, path, "add_prefix_space");
    if (!cJSON_IsBool(aps))
        return jfail(j, MO_EMALFORMED, p, "expected true or false, got %s", jtype(aps));
    st->prefix_space = cJSON_IsTrue(aps);
    bool use_regex;
    TRY(jbool(j, v, path, "use_regex", true, &use_regex));
    jpath(p, path, "use_regex");
    return use_regex ? compile_regex(j, p, GPT2_REGEX, false, &st->re) : 0;
}

static int parse_pretokenizer(const jctx_t *j, const cJSON *v, tokenizer_t *t) {
    const char *path = "pre_tokenizer", *type = "";
    if (!v || cJSON_IsNull(v))
        return jfail(j, MO_EUNSUPPORTED, path,
                     "null is unsupported (a byte-level BPE needs ByteLevel, alone or last in a "
                     "Sequence)");
    TRY(jcomponent(j, v, path, &type));
    if (strcmp(type, "ByteLevel") == 0) {
        t->nsteps = 1;
        return parse_bytelevel(j, v, path, &t->steps[0]);
    }
    if (strcmp(type, "Sequence") != 0)
        return unsupported(j, path, type, "ByteLevel, Sequence");
    const cJSON *list = jget(v, "pretokenizers");
    if (!cJSON_IsArray(list))
        return jfail(j, MO_EMALFORMED, "pre_tokenizer.pretokenizers", "expected an array, got %s",
                     jtype(list));
    bool last_is_bl = false;
    for (const cJSON *e = list->child; e; e = e->next) {
        char p[PATH_CAP];
        jindex(p, "pre_tokenizer.pretokenizers", t->nsteps);
        if (t->nsteps == MAX_STEPS)
            return jfail(j, MO_EUNSUPPORTED, p, "more than %d pre-tokenizers", MAX_STEPS);
        if (last_is_bl)
            return jfail(j, MO_EUNSUPPORTED, p, "nothing may follow ByteLevel");
        TRY(jcomponent(j, e, p, &type));
        pt_step_t *st = &t->steps[t->nsteps++];
        if (strcmp(type, "Split") == 0) {
            TRY(parse_split(j, e, p, st));
        } else if (strcmp(type, "ByteLevel") == 0) {
            TRY(parse_bytelevel(j, e, p, st));
            last_is_bl = true;
        } else {
            return unsupported(j, p, type, "Split, ByteLevel");
        }
    }
    if (!last_is_bl)
        return jfail(j, MO_EUNSUPPORTED, "pre_tokenizer.pretokenizers",
                     "a byte-level BPE needs ByteLevel as the last pre-tokenizer");
    return 0;
}

static int parse_decoder(const jctx_t *j, const cJSON *v) {
    const char *type = "";
    if (!v || cJSON_IsNull(v))
        return jfail(j, MO_EUNSUPPORTED, "decoder", "null is unsupported (supported: ByteLevel)");
    TRY(jcomponent(j, v, "decoder", &type));
    return strcmp(type, "ByteLevel") == 0 ? 0 : unsupported(j, "decoder", type, "ByteLevel");
}

static int ids_append(int32_t **v, size_t *n, const int32_t *src, size_t k) {
    int32_t *nv = realloc(*v, (*n + k + 1) * sizeof *nv);
    if (!nv)
        return mo_errorf(MO_ENOMEM, "out of memory");
    memcpy(nv + *n, src, k * sizeof *src);
    *v = nv;
    *n += k;
    return 0;
}

/* One SpecialToken item of TemplateProcessing.single: its ids from special_tokens. */
static int template_special(const jctx_t *j, const cJSON *tp, const cJSON *st, const char *path,
                            tokenizer_t *t, bool after) {
    const cJSON *name = jget(st, "id");
    char p[PATH_CAP];
    jpath(p, path, "id");
    if (!cJSON_IsString(name))
        return jfail(j, MO_EMALFORMED, p, "expected a string, got %s", jtype(name));
    const cJSON *def = jget(jget(tp, "special_tokens"), name->valuestring);
    const cJSON *ids = jget(def, "ids");
    if (!cJSON_IsArray(ids))
        return jfail(j, MO_EMALFORMED, p, "\"%.80s\" has no ids in special_tokens",
                     name->valuestring);
    size_t i = 0;
    for (const cJSON *e = ids->child; e; e = e->next, i++) {
        char q[PATH_CAP];
        snprintf(q, sizeof q, "post_processor.special_tokens[\"%.80s\"].ids[%zu]",
                 name->valuestring, i);
        int32_t id = -1;
        TRY(jint(j, e, q, &id));
        if ((size_t)id >= t->vocab_size)
            return jfail(j, MO_EMALFORMED, q, "id %d is not a token (vocabulary size %zu)", id,
                         t->vocab_size);
        TRY(after ? ids_append(&t->suffix, &t->nsuffix, &id, 1)
                  : ids_append(&t->prefix, &t->nprefix, &id, 1));
    }
    return 0;
}

static int parse_template(const jctx_t *j, const cJSON *tp, const char *path, tokenizer_t *t) {
    const cJSON *single = jget(tp, "single");
    char p[PATH_CAP];
    jpath(p, path, "single");
    if (!cJSON_IsArray(single))
        return jfail(j, MO_EMALFORMED, p, "expected an array, got %s", jtype(single));
    if (t->nprefix || t->nsuffix)
        return jfail(j, MO_EUNSUPPORTED, path, "only one TemplateProcessing is supported");
    bool seen_seq = false;
    size_t i = 0;
    for (const cJSON *e = single->child; e; e = e->next, i++) {
        char q[PATH_CAP];
        jindex(q, p, i);
        const cJSON *sp = jget(e, "SpecialToken"), *sq = jget(e, "Sequence");
        if (sp) {
            char r[PATH_CAP];
            jpath(r, q, "SpecialToken");
            TRY(template_special(j, tp, sp, r, t, seen_seq));
        } else if (sq) {
            const cJSON *id = jget(sq, "id");
            if (seen_seq || !cJSON_IsString(id) || strcmp(id->valuestring, "A") != 0)
                return jfail(j, MO_EUNSUPPORTED, q, "a single template holds one Sequence \"A\"");
            seen_seq = true;
        } else {
            return jfail(j, MO_EMALFORMED, q,
                         "expected {\"SpecialToken\": ...} or "
                         "{\"Sequence\": ...}");
        }
    }
    if (!seen_seq)
        return jfail(j, MO_EMALFORMED, p, "no Sequence \"A\"");
    return 0;
}

static int parse_postprocessor(const jctx_t *j, const cJSON *v, const char *path, tokenizer_t *t) {
    const char *type = "";
    if (!v || cJSON_IsNull(v))
        return 0;
    TRY(jcomponent(j, v, path, &type));
    if (strcmp(type, "ByteLevel") == 0)
        return 0;
    if (strcmp(type, "TemplateProcessing") == 0)
        return parse_template(j, v, path, t);
    if (strcmp(type, "Sequence") != 0)
        return unsupported(j, path, type, "ByteLevel, TemplateProcessing, Sequence");
    const cJSON *list = jget(v, "processors");
    char p[PATH_CAP];
    jpath(p, path, "processors");
    if (!cJSON_IsArray(list))
        return jfail(j, MO_EMALFORMED, p, "expected an array, got %s", jtype(list));
    size_t i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        char q[PATH_CAP];
        jindex(q, p, i);
        TRY(parse_postprocessor(j, e, q, t));
    }
    return 0;
}

/* ---- tokenizer_config.json: bos/eos/pad ---- */

static int32_t added_by_content(const tokenizer_t *t, const char *s) {
    for (size_t i = 0; i < t->nadded; i++)
        if (strcmp(t->added[i].content, s) == 0)
            return t->added[i].id;
    return -1;
}

static int32_t first_present(const tokenizer_t *t, const char *const *names) {
    for (; *names; names++) {
        int32_t id = added_by_content(t, *names);
        if (id >= 0)
            return id;
    }
    return -1;
}

static int config_token(const jctx_t *j, const cJSON *cfg, const char *key,
                        const char *const *fallback, const tokenizer_t *t, int32_t *out) {
    const cJSON *v = jget(cfg, key);
    *out = -1;
    if (!v) {
        *out = first_present(t, fallback);
        return 0;
    }
    if (cJSON_IsNull(v))
        return 0;
    const cJSON *s = cJSON_IsObject(v) ? jget(v, "content") : v;
    if (!cJSON_IsString(s))
        return jfail(j, MO_EMALFORMED, key,
                     "expected a string, an object with \"content\", or "
                     "null; got %s",
                     jtype(v));
    *out = tokenizer_token_id(t, s->valuestring);
    if (*out < 0)
        return jfail(j, MO_EMALFORMED, key, "\"%.80s\" is not a token of tokenizer.json",
                     s->valuestring);
    return 0;
}

static int parse_config(const char *path, tokenizer_t *t) {
    static const char *const bos[] = {"<|bos|>", "<|begin_of_text|>", "<s>", NULL};
    static const char *const eos[] = {"<|eos|>", "<|end_of_text|>", "</s>", "<|endoftext|>", NULL};
    static const char *const pad[] = {"<|pad|>", "<pad>", NULL};
    cJSON *cfg = NULL;
    if (access(path, F_OK) == 0)
        TRY(parse_json_file(path, path, &cfg));
    jctx_t j = {path};
    int rc = config_token(&j, cfg, "bos_token", bos, t, &t->bos);
    if (rc == 0)
        rc = config_token(&j, cfg, "eos_token", eos, t, &t->eos);
    if (rc == 0)
        rc = config_token(&j, cfg, "pad_token", pad, t, &t->pad);
    cJSON_Delete(cfg);
    return rc;
}

/* ---- load ---- */

static int index_added(const jctx_t *j, tokenizer_t *t) {
    t->vocab_size = bpe_size(t->bpe);
    for (size_t i = 0; i < t->nadded; i++)
        if ((size_t)t->added[i].id + 1 > t->vocab_size)
            t->vocab_size = (size_t)t->added[i].id + 1;
    if (!(t->added_of = malloc(t->vocab_size * sizeof *t->added_of)))
        return mo_errorf(MO_ENOMEM, "out of memory for %zu tokens", t->vocab_size);
    memset(t->added_of, 0xff, t->vocab_size * sizeof *t->added_of);
    bool single_word = false;
    for (size_t i = 0; i < t->nadded; i++) {
        t->added_of[t->added[i].id] = (int32_t)i;
        single_word |= t->added[i].single_word;
    }
    return single_word ? compile_regex(j, "added_tokens", WORD_REGEX, false, &t->word_re) : 0;
}

static int load_json(tokenizer_t *t, const char *file) {
    cJSON *root;
    TRY(parse_json_file(file, file, &root));
    jctx_t j = {file};
    int rc = bpe_new(&t->bpe);
    if (rc == 0)
        rc = parse_model(&j, jget(root, "model"), t->bpe);
    if (rc == 0)
        rc = parse_added(&j, jget(root, "added_tokens"), t);
    if (rc == 0)
        rc = index_added(&j, t);
    if (rc == 0)
        rc = parse_normalizer(&j, jget(root, "normalizer"), "normalizer", &t->nfc);
    if (rc == 0)
        rc = build_match_sets(t);
    if (rc == 0)
        rc = parse_pretokenizer(&j, jget(root, "pre_tokenizer"), t);
    if (rc == 0)
        rc = parse_decoder(&j, jget(root, "decoder"));
    if (rc == 0)
        rc = parse_postprocessor(&j, jget(root, "post_processor"), "post_processor", t);
    cJSON_Delete(root);
    return rc;
}

int tokenizer_load(const char *path, tokenizer_t **out) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return mo_errorf(MO_EIO, "tokenizer: cannot open %s: %s", path, strerror(errno));
    char file[PATH_CAP], cfg[PATH_CAP];
    if (S_ISDIR(st.st_mode)) {
        snprintf(file, sizeof file, "%s/tokenizer.json", path);
        snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", path);
    } else {
        snprintf(file, sizeof file, "%s", path);
        const char *slash = strrchr(path, '/');
        if (slash)
            snprintf(cfg, sizeof cfg, "%.*s/tokenizer_config.json", (int)(slash - path), path);
        else
            snprintf(cfg, sizeof cfg, "tokenizer_config.json");
    }
    tokenizer_t *t = calloc(1, sizeof *t);
    if (!t)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = load_json(t, file);
    if (rc == 0)
        rc = parse_config(cfg, t);
    if (rc < 0) {
        tokenizer_destroy(&t);
        return rc;
    }
    *out = t;
    return 0;
}

void tokenizer_destroy(tokenizer_t **tp) {
    tokenizer_t *t = *tp;
    if (!t)
        return;
    bpe_destroy(&t->bpe);
    for (size_t i = 0; i < t->nadded; i++) {
        free(t->added[i].content);
        free(t->added[i].norm);
    }
    free(t->added);
    free(t->added_of);
    free(t->raw.e);
    free(t->norm.e);
    for (size_t i = 0; i < MAX_STEPS; i++)
        pcre2_code_free(t->steps[i].re);
    pcre2_code_free(t->word_re);
    free(t->prefix);
    free(t->suffix);
    free(t);
    *tp = NULL;
}

/* ---- encode ---- */

typedef struct {
    const tokenizer_t *t;
    bool allow_special;
    bpe_ids_t *out;
    pcre2_match_data *md[MAX_STEPS + 1]; /* per pre-tokenizer step; the last for word_re */
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
} enc_t;

static int regex_error(int rc) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return mo_errorf(MO_EINVAL, "tokenizer: regex match failed: %s", (const char *)msg);
}

static int enc_pretok(enc_t *e, size_t step, const char *s, size_t n);

/* Split with behavior Isolated: every match and every gap is a piece. */
static int split_regex(enc_t *e, size_t step, const char *s, size_t n) {
    const pcre2_code *re = e->t->steps[step].re;
    pcre2_match_data *md = e->md[step];
    size_t gap = 0, at = 0;
    while (at < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, at, 0, md, e->mctx);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0)
            return regex_error(rc);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0] < gap ? gap : ov[0], me = ov[1];
        if (me <= ms) { /* an empty match splits nothing: step over one character */
            if (ms >= n)
                break;
            size_t l;
            uni_next(s + ms, n - ms, &l);
            at = ms + l;
            continue;
        }
        if (ms > gap)
            TRY(enc_pretok(e, step + 1, s + gap, ms - gap));
        TRY(enc_pretok(e, step + 1, s + ms, me - ms));
        gap = at = me;
    }
    return gap < n ? enc_pretok(e, step + 1, s + gap, n - gap) : 0;
}

static int enc_pretok(enc_t *e, size_t step, const char *s, size_t n) {
    if (n == 0)
        return 0;
    if (step == e->t->nsteps)
        return bpe_encode(e->t->bpe, s, n, e->out);
    const pt_step_t *st = &e->t->steps[step];
    char *tmp = NULL;
    if (st->prefix_space && s[0] != ' ') {
        if (!(tmp = malloc(n + 1)))
            return mo_errorf(MO_ENOMEM, "tokenizer: out of memory");
        tmp[0] = ' ';
        memcpy(tmp + 1, s, n);
        s = tmp, n++;
    }
    int rc = st->re ? split_regex(e, step, s, n) : enc_pretok(e, step + 1, s, n);
    free(tmp);
    return rc;
}

static bool word_char_at(enc_t *e, const char *s, size_t n, size_t pos) {
    int rc = pcre2_match(e->t->word_re, (PCRE2_SPTR)s, n, pos, PCRE2_ANCHORED, e->md[MAX_STEPS],
                         e->mctx);
    return rc >= 0;
}

/* Start of the character that ends at pos (pos > 0); an invalid byte counts alone. */
static size_t char_before(const char *s, size_t pos) {
    for (size_t back = 2; back <= 4 && back <= pos; back++) {
        if (((uint8_t)s[pos - back + 1] & 0xC0) != 0x80)
            break;
        size_t l;
        if (uni_next(s + pos - back, back, &l) != UNI_INVALID && l == back)
            return pos - back;
    }
    return pos - 1;
}

static bool single_word_ok(enc_t *e, const char *s, size_t n, size_t ms, size_t me) {
    if (ms > 0 && word_char_at(e, s, ms, char_before(s, ms)))
        return false;
    return me == n || !word_char_at(e, s, n, me);
}

static size_t space_before(const char *s, size_t lo, size_t pos) {
    while (pos > lo) {
        size_t c = char_before(s, pos), l;
        uint32_t cp = uni_next(s + c, pos - c, &l);
        if (c < lo || cp == UNI_INVALID || !uni_is_space(cp))
            break;
        pos = c;
    }
    return pos;
}

static size_t space_after(const char *s, size_t n, size_t pos) {
    while (pos < n) {
        size_t l;
        uint32_t cp = uni_next(s + pos, n - pos, &l);
        if (cp == UNI_INVALID || !uni_is_space(cp))
            break;
        pos += l;
    }
    return pos;
}

/* The leftmost-longest added token at or after *pos; NULL when none. */
static const added_tok_t *find_added(const tokenizer_t *t, const match_set_t *m, const char *s,
                                     size_t n, size_t *pos, size_t *len) {
    for (size_t p = *pos; p < n; p++) {
        uint8_t c = (uint8_t)s[p];
        for (uint32_t k = m->start[c]; k < m->start[c + 1]; k++) {
            const mentry_t *me = &m->e[k];
            if (me->len <= n - p && memcmp(s + p, me->s, me->len) == 0) {
                *pos = p;
                *len = me->len;
                return &t->added[me->tok];
            }
        }
    }
    return NULL;
}

typedef int (*piece_fn)(enc_t *e, const char *s, size_t n);

/* Splits s on the added tokens of m (as Hugging Face's AddedVocabulary does:
 * a skipped match is stepped over whole) and hands the gaps to gap(). */
static int split_added(enc_t *e, const match_set_t *m, const char *s, size_t n, piece_fn gap) {
    size_t start_off = 0, at = 0;
    while (m->n && at < n) {
        size_t ms = at, len;
        const added_tok_t *a = find_added(e->t, m, s, n, &ms, &len);
        if (!a)
            break;
        size_t me = ms + len;
        at = me;
        if (a->special && !e->allow_special)
            continue;
        if (a->single_word && !single_word_ok(e, s, n, ms, me))
            continue;
        if (a->lstrip)
            ms = space_before(s, start_off, ms);
        if (a->rstrip)
            at = me = space_after(s, n, me);
        if (ms > start_off)
            TRY(gap(e, s + start_off, ms - start_off));
        TRY(bpe_ids_push(e->out, a->id));
        start_off = me;
    }
    return start_off < n ? gap(e, s + start_off, n - start_off) : 0;
}

static int enc_pretok_first(enc_t *e, const char *s, size_t n) {
    return enc_pretok(e, 0, s, n);
}

static int enc_normalized(enc_t *e, const char *s, size_t n) {
    if (!e->t->nfc)
        return split_added(e, &e->t->norm, s, n, enc_pretok_first);
    char *buf;
    size_t len;
    TRY(uni_nfc(s, n, &buf, &len));
    int rc = split_added(e, &e->t->norm, buf, len, enc_pretok_first);
    free(buf);
    return rc;
}

static int encode_ids(const tokenizer_t *t, const char *text, size_t len, bool allow_special,
                      bpe_ids_t *out) {
    enc_t e = {.t = t, .allow_special = allow_special, .out = out};
    int rc = 0;
    if (!(e.mctx = pcre2_match_context_create(NULL)))
        rc = mo_errorf(MO_ENOMEM, "tokenizer: out of memory");
    if (rc == 0 && (e.jit = pcre2_jit_stack_create((size_t)32 << 10, (size_t)8 << 20, NULL)))
        pcre2_jit_stack_assign(e.mctx, NULL, e.jit);
    for (size_t i = 0; i <= MAX_STEPS && rc == 0; i++) {
        const pcre2_code *re = i < MAX_STEPS ? t->steps[i].re : t->word_re;
        if (re && !(e.md[i] = pcre2_match_data_create_from_pattern(re, NULL)))
            rc = mo_errorf(MO_ENOMEM, "tokenizer: out of memory");
    }
    if (rc == 0 && len > 0)
        rc = split_added(&e, &t->raw, text, len, enc_normalized);
    for (size_t i = 0; i <= MAX_STEPS; i++)
        pcre2_match_data_free(e.md[i]);
    pcre2_jit_stack_free(e.jit);
    pcre2_match_context_free(e.mctx);
    return rc;
}

int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, bool allow_special,
                     int32_t **ids, size_t *n) {
    bpe_ids_t out = {0};
    *ids = NULL;
    *n = 0;
    int rc = encode_ids(t, text, len, allow_special, &out);
    if (rc < 0) {
        bpe_ids_free(&out);
        return rc;
    }
    if (!out.v && !(out.v = malloc(sizeof *out.v)))
        return mo_errorf(MO_ENOMEM, "tokenizer: out of memory");
    *ids = out.v;
    *n = out.n;
    return 0;
}

int tokenizer_encode_into(const tokenizer_t *t, const char *text, size_t len, bool allow_special,
                          int32_t *ids, size_t cap, size_t *n) {
    bpe_ids_t out = {0};
    *n = 0;
    int rc = encode_ids(t, text, len, allow_special, &out);
    if (rc == 0) {
        *n = out.n;
        if (out.n && cap)
            memcpy(ids, out.v, (out.n < cap ? out.n : cap) * sizeof *ids);
        if (out.n > cap)
            rc = mo_errorf(MO_EINVAL, "tokenizer: %zu ids do not fit a buffer of %zu", out.n, cap);
    }
    bpe_ids_free(&out);
    return rc;
}

/* ---- decode and lookups ---- */

int tokenizer_token_bytes(const tokenizer_t *t, int32_t id, const char **bytes, size_t *len) {
    if (id >= 0 && (size_t)id < t->vocab_size && t->added_of[id] >= 0) {
        const added_tok_t *a = &t->added[t->added_of[id]];
        *bytes = a->content;
        *len = a->len;
        return 0;
    }
    if (id < 0 || (size_t)id >= t->vocab_size || bpe_token_bytes(t->bpe, id, bytes, len) < 0)
        return mo_errorf(MO_EINVAL, "tokenizer: id %d is not a token (vocabulary size %zu)", id,
                         t->vocab_size);
    return 0;
}

int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, char **out,
                     size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b = NULL;
        size_t l = 0;
        if (tokenizer_token_bytes(t, ids[i], &b, &l) < 0)
            return mo_error_wrap(MO_EINVAL, "tokenizer_decode: ids[%zu]", i);
        total += l;
    }
    char *s = malloc(total + 1);
    if (!s)
        return mo_errorf(MO_ENOMEM, "tokenizer: out of memory for %zu bytes", total);
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b = NULL;
        size_t l = 0;
        tokenizer_token_bytes(t, ids[i], &b, &l); /* checked above */
        memcpy(s + pos, b, l);
        pos += l;
    }
    s[pos] = 0;
    *out = s;
    *out_len = pos;
    return 0;
}

int32_t tokenizer_token_id(const tokenizer_t *t, const char *name) {
    int32_t id = added_by_content(t, name);
    return id >= 0 ? id : bpe_key_id(t->bpe, name, strlen(name));
}

bool tokenizer_is_special(const tokenizer_t *t, int32_t id) {
    return id >= 0 && (size_t)id < t->vocab_size && t->added_of[id] >= 0 &&
           t->added[t->added_of[id]].special;
}

size_t tokenizer_vocab_size(const tokenizer_t *t) {
    return t->vocab_size;
}

int32_t tokenizer_bos_id(const tokenizer_t *t) {
    return t->bos;
}

int32_t tokenizer_eos_id(const tokenizer_t *t) {
    return t->eos;
}

int32_t tokenizer_pad_id(const tokenizer_t *t) {
    return t->pad;
}

void tokenizer_affixes(const tokenizer_t *t, const int32_t **prefix, size_t *nprefix,
                       const int32_t **suffix, size_t *nsuffix) {
    *prefix = t->prefix;
    *nprefix = t->nprefix;
    *suffix = t->suffix;
    *nsuffix = t->nsuffix;
}

/* ---- prompt templates ---- */

/* Walks the template; with out == NULL only measures and validates. */
static int template_pass(const char *tmpl, const char *prompt, char *out, size_t *len) {
    static const char key[] = "{prompt}";
    size_t plen = strlen(prompt), n = 0;
    for (size_t i = 0; tmpl[i];) {
        if ((tmpl[i] == '{' && tmpl[i + 1] == '{') || (tmpl[i] == '}' && tmpl[i + 1] == '}')) {
            if (out)
                out[n] = tmpl[i];
            n++, i += 2;
        } else if (strncmp(tmpl + i, key, sizeof key - 1) == 0) {
            if (out)
                memcpy(out + n, prompt, plen);
            n += plen, i += sizeof key - 1;
        } else if (tmpl[i] == '{') {
            const char *close = strchr(tmpl + i, '}');
            if (!close)
                return mo_errorf(MO_EINVAL, "template: unclosed \"{\" at offset %zu", i);
            return mo_errorf(MO_EINVAL,
                             "template: unknown placeholder \"%.*s\" at offset %zu (supported: "
                             "{prompt}; write {{ and }} for literal braces)",
                             (int)(close - (tmpl + i) + 1 > 80 ? 80 : close - (tmpl + i) + 1),
                             tmpl + i, i);
        } else if (tmpl[i] == '}') {
            return mo_errorf(MO_EINVAL,
                             "template: single \"}\" at offset %zu (write }} for a literal brace)",
                             i);
        } else {
            if (out)
                out[n] = tmpl[i];
            n++, i++;
        }
    }
    *len = n;
    return 0;
}

int tokenizer_apply_template(const char *tmpl, const char *prompt, char **out) {
    size_t len = 0;
    *out = NULL;
    TRY(template_pass(tmpl, prompt, NULL, &len));
    char *s = malloc(len + 1);
    if (!s)
        return mo_errorf(MO_ENOMEM, "template: out of memory for %zu bytes", len);
    template_pass(tmpl, prompt, s, &len);
    s[len] = 0;
    *out = s;
    return 0;
}
