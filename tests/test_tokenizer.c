/* Tests for actor/tokenizer: tokenizer.json files built here by hand, with
 * token ids worked out by hand for small vocabularies. Unless a test says
 * otherwise the vocabulary is: ids 0..255 the single bytes (id = byte value),
 * then the listed extra tokens from 256 on. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/tokenizer.h"
#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"

#define QWEN2_REGEX                                                                                \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "                          \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define LLAMA3_REGEX                                                                               \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "                     \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* ---- building tokenizer.json ---- */

/* GPT-2's bytes_to_unicode, written out independently of the library. */
static uint32_t byte_cp(unsigned b) {
    static uint32_t tab[256];
    if (!tab['!']) {
        uint32_t next = 256;
        for (unsigned x = 0; x < 256; x++) {
            bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
            tab[x] = printable ? x : next++;
        }
    }
    return tab[b];
}

/* Raw bytes -> the mapped spelling used in tokenizer.json keys. */
static char *mapped(const char *raw, size_t n) {
    char *out = malloc(2 * n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = byte_cp((uint8_t)raw[i]);
        if (c < 0x80) {
            out[k++] = (char)c;
        } else {
            out[k++] = (char)(0xC0 | (c >> 6));
            out[k++] = (char)(0x80 | (c & 0x3F));
        }
    }
    out[k] = 0;
    return out;
}

typedef struct {
    const char *const *extra; /* raw tokens with ids 256, 257, ... */
    size_t nextra;
    const char *const (*merges)[2]; /* raw (left, right) pairs in rank order */
    size_t nmerges;
    bool pair_merges, ignore_merges;
} model_spec_t;

static cJSON *make_model(const model_spec_t *m) {
    cJSON *model = cJSON_CreateObject();
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddBoolToObject(model, "byte_fallback", 0);
    cJSON_AddBoolToObject(model, "ignore_merges", m->ignore_merges);
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        char c = (char)b, *k = mapped(&c, 1);
        cJSON_AddNumberToObject(vocab, k, b);
        free(k);
    }
    for (size_t i = 0; i < m->nextra; i++) {
        char *k = mapped(m->extra[i], strlen(m->extra[i]));
        cJSON_AddNumberToObject(vocab, k, 256 + (double)i);
        free(k);
    }
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    for (size_t i = 0; i < m->nmerges; i++) {
        char *l = mapped(m->merges[i][0], strlen(m->merges[i][0]));
        char *r = mapped(m->merges[i][1], strlen(m->merges[i][1]));
        if (m->pair_merges) {
            const char *pair[2] = {l, r};
            cJSON_AddItemToArray(merges, cJSON_CreateStringArray(pair, 2));
        } else {
            char *s = malloc(strlen(l) + strlen(r) + 2);
            sprintf(s, "%s %s", l, r);
            cJSON_AddItemToArray(merges, cJSON_CreateString(s));
            free(s);
        }
        free(l);
        free(r);
    }
    return model;
}

static cJSON *bytelevel(bool prefix_space, bool use_regex) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "type", "ByteLevel");
    cJSON_AddBoolToObject(c, "add_prefix_space", prefix_space);
    cJSON_AddBoolToObject(c, "trim_offsets", 1);
    cJSON_AddBoolToObject(c, "use_regex", use_regex);
    return c;
}

static cJSON *split(const char *regex) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "Split");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(s, "pattern"), "Regex", regex);
    cJSON_AddStringToObject(s, "behavior", "Isolated");
    cJSON_AddBoolToObject(s, "invert", 0);
    return s;
}

/* Sequence[Split(r) for r in regexes, ByteLevel(false, use_regex false)]: the
 * Qwen2 / Llama 3 shape. */
static cJSON *split_seq(const char *const *regexes, size_t n) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "type", "Sequence");
    cJSON *list = cJSON_AddArrayToObject(p, "pretokenizers");
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(list, split(regexes[i]));
    cJSON_AddItemToArray(list, bytelevel(false, false));
    return p;
}

static cJSON *split_pre(const char *regex) {
    return split_seq(&regex, 1);
}

enum { SPECIAL = 1, LSTRIP = 2, RSTRIP = 4, SINGLE_WORD = 8, NORMALIZED = 16 };

static void add_token(cJSON *root, int id, const char *content, int flags) {
    cJSON *arr = cJSON_GetObjectItem(root, "added_tokens");
    cJSON *a = cJSON_CreateObject();
    cJSON_AddNumberToObject(a, "id", id);
    cJSON_AddStringToObject(a, "content", content);
    cJSON_AddBoolToObject(a, "single_word", !!(flags & SINGLE_WORD));
    cJSON_AddBoolToObject(a, "lstrip", !!(flags & LSTRIP));
    cJSON_AddBoolToObject(a, "rstrip", !!(flags & RSTRIP));
    cJSON_AddBoolToObject(a, "normalized", !!(flags & NORMALIZED));
    cJSON_AddBoolToObject(a, "special", !!(flags & SPECIAL));
    cJSON_AddItemToArray(arr, a);
}

/* A whole tokenizer.json; pre (owned) may be NULL for ByteLevel without regex. */
static cJSON *make_doc(const model_spec_t *m, cJSON *pre) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddArrayToObject(root, "added_tokens");
    cJSON_AddNullToObject(root, "normalizer");
    cJSON_AddItemToObject(root, "pre_tokenizer", pre ? pre : bytelevel(false, false));
    cJSON_AddItemToObject(root, "post_processor", bytelevel(false, false));
    cJSON_AddItemToObject(root, "decoder", bytelevel(false, false));
    cJSON_AddItemToObject(root, "model", make_model(m));
    return root;
}

static void write_text(const char *dir, const char *name, const char *text) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CU_ASSERT_FATAL(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void write_doc(const char *dir, const char *name, cJSON *doc) {
    char *text = cJSON_Print(doc);
    write_text(dir, name, text);
    cJSON_free(text);
    cJSON_Delete(doc);
}

/* Writes doc (consumed) into a fresh directory and loads it. */
static tokenizer_t *load_doc(cJSON *doc, char *dir) {
    CU_ASSERT_FATAL(tu_tmpdir(dir, 512) == 0);
    write_doc(dir, "tokenizer.json", doc);
    tokenizer_t *t = NULL;
    int rc = tokenizer_load(dir, &t);
    if (rc != 0)
        tu_report("load failed: %s", mo_last_error());
    CU_ASSERT_FATAL(rc == 0);
    return t;
}

static void expect_ids(const tokenizer_t *t, const char *text, size_t len, bool allow,
                       const int32_t *exp, size_t nexp, int line) {
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = tokenizer_encode(t, text, len, allow, &ids, &n);
    if (rc != 0)
        tu_report("line %d: encode failed: %s", line, mo_last_error());
    CU_ASSERT(rc == 0);
    bool same = rc == 0 && n == nexp && memcmp(ids, exp, n * sizeof *ids) == 0;
    if (!same) {
        char got[2048] = "", want[2048] = "";
        for (size_t i = 0; i < n && strlen(got) < 2000; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), " %d", ids[i]);
        for (size_t i = 0; i < nexp && strlen(want) < 2000; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), " %d", exp[i]);
        tu_report("line %d: ids [%s ] expected [%s ]", line, got, want);
    }
    CU_ASSERT(same);
    free(ids);
}

#define EXPECT(t, text, allow, ...)                                                                \
    do {                                                                                           \
        const int32_t e_[] = {__VA_ARGS__};                                                        \
        expect_ids((t), (text), sizeof(text) - 1, (allow), e_, sizeof e_ / sizeof e_[0],           \
                   __LINE__);                                                                      \
    } while (0)

/* decode(encode(text)) must give text back byte for byte. */
static void expect_round_trip(const tokenizer_t *t, const char *text, size_t len, bool allow) {
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL;
    size_t blen = 0;
    CU_ASSERT_FATAL(tokenizer_encode(t, text, len, allow, &ids, &n) == 0);
    int rc = tokenizer_decode(t, ids, n, &back, &blen);
    CU_ASSERT(rc == 0);
    bool same = rc == 0 && blen == len && memcmp(back, text, len) == 0;
    if (!same)
        tu_report("round trip of %zu bytes gave %zu bytes (first 40: \"%.40s\")", len, blen,
                  back ? back : "");
    CU_ASSERT(same);
    free(ids);
    free(back);
}

#define ROUND_TRIP(t, text, allow) expect_round_trip((t), (text), sizeof(text) - 1, (allow))

static void finish(tokenizer_t **t, const char *dir) {
    tokenizer_destroy(t);
    CU_ASSERT(*t == NULL);
    tu_rmtree(dir);
}

/* ---- BPE merges ---- */

static const char *const MERGE_EXTRA[] = {"lo", "he", "ll", " t", "\n\n"};
static const char *const MERGE_PAIRS[][2] = {
    {"l", "o"}, {"h", "e"}, {"l", "l"}, {" ", "t"}, {"\n", "\n"}};

/* Ranks decide, not position: in "hello" the pair (l, o) ranks first, so the
 * result is he l lo, not he ll o. */
static void check_merges(bool pair_form) {
    model_spec_t m = {MERGE_EXTRA, 5, MERGE_PAIRS, 5, pair_form, false};
    char dir[512];
    tokenizer_t *t = load_doc(make_doc(&m, NULL), dir);
    EXPECT(t, "hello", true, 257, 'l', 256);
    EXPECT(t, "lol", true, 256, 'l');
    EXPECT(t, " t", true, 259);
    EXPECT(t, "\n\n\n", true, 260, '\n'); /* equal ranks: leftmost first */
    EXPECT(t, "xyz", true, 'x', 'y', 'z');
    CU_ASSERT(tokenizer_vocab_size(t) == 261);
    finish(&t, dir);
}

static void test_string_merges(void) {
    check_merges(false);
}

static void test_pair_merges(void) {
    check_merges(true);
}

/* Llama 3's ignore_merges: a pre-token that is a vocabulary token comes out
 * whole even when no merge sequence builds it. */
static void test_ignore_merges(void) {
    static const char *const extra[] = {"he", "hello"};
    static const char *const merges[][2] = {{"h", "e"}};
    for (int ignore = 0; ignore < 2; ignore++) {
        model_spec_t m = {extra, 2, merges, 1, false, ignore};
        char dir[512];
        tokenizer_t *t = load_doc(make_doc(&m, bytelevel(false, true)), dir);
        if (ignore)
            EXPECT(t, "hello world", true, 257, ' ', 'w', 'o', 'r', 'l', 'd');
        else
            EXPECT(t, "hello world", true, 256, 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd');
        finish(&t, dir);
    }
}

/* ---- added tokens ---- */

static tokenizer_t *added_tokenizer(char *dir) {
    model_spec_t m = {0};
    cJSON *doc = make_doc(&m, split_pre(QWEN2_REGEX));
    add_token(doc, 300, "<|im_start|>", SPECIAL);
    add_token(doc, 301, "<|im_end|>", SPECIAL);
    add_token(doc, 302, "<x>", SPECIAL);
    add_token(doc, 303, "<x>y", SPECIAL);
    add_token(doc, 304, "<think>", 0);
    add_token(doc, 305, "<mask>", LSTRIP | RSTRIP);
    add_token(doc, 306, "<w>", SINGLE_WORD);
    return load_doc(doc, dir);
}

static void test_added_tokens(void) {
    char dir[512];
    tokenizer_t *t = added_tokenizer(dir);
    /* matched before the regex split, adjacent ones included */
    EXPECT(t, "<|im_end|><|im_start|>", true, 301, 300);
    EXPECT(t, "hi<|im_end|>there", true, 'h', 'i', 301, 't', 'h', 'e', 'r', 'e');
    /* longest match first */
    EXPECT(t, "a<x>yz<x>", true, 'a', 303, 'z', 302);
    /* untrusted text: specials stay text, non-special added tokens still match */
    EXPECT(t, "<|im_end|>", false, '<', '|', 'i', 'm', '_', 'e', 'n', 'd', '|', '>');
    EXPECT(t, "<think>a<x>", false, 304, 'a', '<', 'x', '>');
    EXPECT(t, "<think>a<x>", true, 304, 'a', 302);
    CU_ASSERT(tokenizer_vocab_size(t) == 307);
    CU_ASSERT(tokenizer_token_id(t, "<|im_end|>") == 301);
    CU_ASSERT(tokenizer_token_id(t, "<think>") == 304);
    CU_ASSERT(tokenizer_token_id(t, "<|nope|>") == -1);
    CU_ASSERT(tokenizer_is_special(t, 300));
    CU_ASSERT(!tokenizer_is_special(t, 304));
    CU_ASSERT(!tokenizer_is_special(t, 'a'));
    finish(&t, dir);
}

static void test_added_strip_and_single_word(void) {
    char dir[512];
    tokenizer_t *t = added_tokenizer(dir);
    /* lstrip/rstrip swallow the whitespace around the token (U+2000 included) */
    EXPECT(t, "a <mask> b", true, 'a', 305, 'b');
    EXPECT(t,
           "a\t <mask>\xe2\x80\x80"
           "b",
           true, 'a', 305, 'b');
    EXPECT(t, "<mask>  <mask>", true, 305, 305);
    /* single_word: only where no word character touches it */
    EXPECT(t, "x<w>", true, 'x', '<', 'w', '>');
    EXPECT(t, "<w>x", true, '<', 'w', '>', 'x');
    EXPECT(t, " <w> ", true, ' ', 306, ' ');
    EXPECT(t, "-<w>", true, '-', 306);
    EXPECT(t, "\xc3\xa9<w>", true, 0xc3, 0xa9, '<', 'w', '>'); /* é is a letter */
    finish(&t, dir);
}

/* ---- pre-tokenizers: each expected pre-token is a vocabulary token and
 * ignore_merges is on, so every pre-token shows as one id (or its bytes). ---- */

static const char *const PRE_EXTRA[] = {
    "Hello",                     /* 256 */
    " world",                    /* 257 */
    "'s",                        /* 258 */
    " \n\n",                     /* 259 */
    " x",                        /* 260 */
    "!!\n",                      /* 261 */
    "123",                       /* 262 */
    "45",                        /* 263 */
    " 123",                      /* 264 */
    " \n\n ",                    /* 265 */
    "!!",                        /* 266 */
    "it",                        /* 267 */
    "'S",                        /* 268 */
    "up",                        /* 269 */
    "Sup",                       /* 270 */
    "h\xc3\xa9llo",              /* 271 */
    " \xe4\xbd\xa0\xe5\xa5\xbd", /* 272: " 你好" */
    "ab",                        /* 273 */
    "cd",                        /* 274 */
    " hello",                    /* 275 */
    "abc",                       /* 276 */
};
#define NPRE (sizeof PRE_EXTRA / sizeof PRE_EXTRA[0])

static tokenizer_t *pre_tokenizer(cJSON *pre, char *dir) {
    model_spec_t m = {PRE_EXTRA, NPRE, NULL, 0, false, true};
    cJSON *doc = make_doc(&m, pre);
    add_token(doc, 300, "<|im_end|>", SPECIAL);
    return load_doc(doc, dir);
}

static void test_qwen2_split(void) {
    char dir[512];
    tokenizer_t *t = pre_tokenizer(split_pre(QWEN2_REGEX), dir);
    /* Hello| world|'s| |1|2|3| \n\n| | x|!!\n */
    EXPECT(t, "Hello world's 123 \n\n  x!!\n", true, 256, 257, 258, ' ', '1', '2', '3', 259, ' ',
           260, 261);
    /* case-insensitive contractions: it|'S|up */
    EXPECT(t, "it'Sup", true, 267, 268, 269);
    EXPECT(t, "h\xc3\xa9llo \xe4\xbd\xa0\xe5\xa5\xbd", true, 271, 272);
    /* invalid and truncated UTF-8 never match; they stay as their own pieces */
    EXPECT(t,
           "ab\xff"
           "cd",
           true, 273, 0xff, 274);
    EXPECT(t, "ab\xe4\xbd", true, 273, 0xe4, 0xbd);
    EXPECT(t,
           "\xe4\xbd"
           "cd",
           true, 0xe4, 0xbd, 274);
    finish(&t, dir);
}

static void test_llama3_split(void) {
    char dir[512];
    tokenizer_t *t = pre_tokenizer(split_pre(LLAMA3_REGEX), dir);
    /* Hello| world|'s| |123|45| \n\n| | x|!!\n */
    EXPECT(t, "Hello world's 12345 \n\n  x!!\n", true, 256, 257, 258, ' ', 262, 263, 259, ' ', 260,
           261);
    EXPECT(t, "it'Sup", true, 267, 268, 269);
    finish(&t, dir);
}

static void test_gpt2_bytelevel_regex(void) {
    char dir[512];
    tokenizer_t *t = pre_tokenizer(bytelevel(false, true), dir);
    /* Hello| world|'s| 123| \n\n | x|!!|\n */
    EXPECT(t, "Hello world's 123 \n\n  x!!\n", true, 256, 257, 258, 264, 265, 260, 266, '\n');
    /* case-sensitive contractions: it|'|Sup */
    EXPECT(t, "it'Sup", true, 267, '\'', 270);
    finish(&t, dir);
}

static void test_prefix_space_and_two_splits(void) {
    char dir[512];
    tokenizer_t *t = pre_tokenizer(bytelevel(true, true), dir);
    /* each piece gets a leading space: " hello", then " world" as it is */
    EXPECT(t, "hello world", true, 275, 257);
    EXPECT(t, "<|im_end|>hello", true, 300, 275);
    finish(&t, dir);
    static const char *const two[] = {"[0-9]{1,3}", "\\s+"};
    t = pre_tokenizer(split_seq(two, 2), dir);
    /* abc | " " | 123 | 45 */
    EXPECT(t, "abc 12345", true, 276, ' ', 262, 263);
    finish(&t, dir);
}

/* A regex that also matches the empty string splits only where it matches
 * something; invalid bytes are stepped over safely. A String pattern is literal. */
static void test_empty_matches_and_literal(void) {
    static const char *const extra[] = {"xx", "a.b"};
    model_spec_t m = {extra, 2, NULL, 0, false, true};
    char dir[512];
    tokenizer_t *t = load_doc(make_doc(&m, split_pre("x*")), dir);
    /* a | xx | b\xff\xfe | xx */
    EXPECT(t, "axxb\xff\xfexx", true, 'a', 256, 'b', 0xff, 0xfe, 256);
    EXPECT(t,
           "\xe4\xbd"
           "xx\xe4",
           true, 0xe4, 0xbd, 256, 0xe4);
    finish(&t, dir);
    cJSON *pre = split_pre("unused");
    cJSON *sp = cJSON_GetArrayItem(cJSON_GetObjectItem(pre, "pretokenizers"), 0);
    cJSON *pat = cJSON_CreateObject();
    cJSON_AddStringToObject(pat, "String", ".");
    cJSON_ReplaceItemInObject(sp, "pattern", pat);
    t = load_doc(make_doc(&m, pre), dir);
    /* "." is literal: a.b is cut at the dot, not at every character */
    EXPECT(t, "a.b", true, 'a', '.', 'b');
    EXPECT(t, "axb", true, 'a', 'x', 'b');
    finish(&t, dir);
}

/* ---- NFC ---- */

static void test_nfc(void) {
    model_spec_t m = {0};
    cJSON *doc = make_doc(&m, NULL);
    cJSON *norm = cJSON_CreateObject();
    cJSON_AddStringToObject(norm, "type", "NFC");
    cJSON_ReplaceItemInObject(doc, "normalizer", norm);
    add_token(doc, 300, "\xc3\xa9", NORMALIZED); /* é, matched after NFC */
    add_token(doc, 301, "o\xcc\x81", 0);         /* o + U+0301, matched before NFC */
    char dir[512];
    tokenizer_t *t = load_doc(doc, dir);
    EXPECT(t, "e\xcc\x81", true, 300);       /* e + U+0301 -> é */
    EXPECT(t, "xo\xcc\x81", true, 'x', 301); /* raw match first */
    EXPECT(t, "\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", true, 0xea, 0xb0, 0x81); /* Hangul -> 각 */
    EXPECT(t, "a\xcc\x81\xcc\xa3", true, 0xe1, 0xba, 0xa1, 0xcc, 0x81); /* reorder: ạ + U+0301 */
    EXPECT(t, "\xe2\x84\xab", true, 0xc3, 0x85);                        /* U+212B -> Å */
    EXPECT(t,
           "\xff"
           "a\xcc\x8a\xfe",
           true, 0xff, 0xc3, 0xa5, 0xfe); /* invalid bytes kept */
    finish(&t, dir);
}

/* ---- round trips ---- */

static const char *const RT_EXTRA[] = {" t",           "he",       " the", "in",  "\xe4\xbd",
                                       "\xe4\xbd\xa0", "\xf0\x9f", "aa",   "aaaa"};
static const char *const RT_MERGES[][2] = {{" ", "t"},       {"h", "e"},       {" t", "he"},
                                           {"i", "n"},       {"\xe4", "\xbd"}, {"\xe4\xbd", "\xa0"},
                                           {"\xf0", "\x9f"}, {"a", "a"},       {"aa", "aa"}};

static tokenizer_t *rt_tokenizer(char *dir, bool nfc) {
    model_spec_t m = {RT_EXTRA, 9, RT_MERGES, 9, false, false};
    cJSON *doc = make_doc(&m, split_pre(QWEN2_REGEX));
    if (nfc) {
        cJSON *norm = cJSON_CreateObject();
        cJSON_AddStringToObject(norm, "type", "NFC");
        cJSON_ReplaceItemInObject(doc, "normalizer", norm);
    }
    add_token(doc, 300, "<|im_start|>", SPECIAL);
    add_token(doc, 301, "<|im_end|>", SPECIAL);
    return load_doc(doc, dir);
}

static void test_round_trip(void) {
    char dir[512];
    tokenizer_t *t = rt_tokenizer(dir, false);
    EXPECT(t, " the thin", true, 258, 256, 'h', 259);
    EXPECT(t, "\xe4\xbd\xa0\xe4\xbd", true, 261, 260);
    for (int allow = 0; allow < 2; allow++) {
        ROUND_TRIP(t, "", allow);
        ROUND_TRIP(t, "Hello, world! The thing's 1234 \n\n\t  x", allow);
        ROUND_TRIP(t, "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", allow); /* 你好世界 */
        ROUND_TRIP(t, "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 ok",
                   allow); /* family emoji, ZWJ sequence */
        ROUND_TRIP(t, "e\xcc\x81 a\xcc\x81\xcc\xa3 \xe1\x84\x80\xe1\x85\xa1", allow); /* marks */
        ROUND_TRIP(t, "\xff\xfe bad \x80 \xc0\xaf \xed\xa0\x80 \xe4\xbd", allow);     /* invalid */
        ROUND_TRIP(t, "\xf0\x9f\x98", allow); /* truncated emoji at the end */
        ROUND_TRIP(t, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", allow);
        ROUND_TRIP(t, "a\0b\0", allow); /* NUL bytes */
    }
    finish(&t, dir);
    /* with NFC, text already in NFC comes back unchanged */
    t = rt_tokenizer(dir, true);
    ROUND_TRIP(t, "caf\xc3\xa9 \xea\xb0\x81 \xe1\xba\xa1\xcc\x81 \xe4\xbd\xa0", true);
    finish(&t, dir);
}

static uint32_t draw(uint64_t i) {
    uint32_t r[4];
    rng_block(r, 1234, 7, i);
    return r[0];
}

/* ~100 KB of mixed text, the same on every run. */
static char *mixed_text(size_t *len) {
    static const char *const frag[] = {"the ",
                                       "in",
                                       " ",
                                       "\n",
                                       "\xe4\xbd\xa0\xe5\xa5\xbd",
                                       "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7",
                                       "e\xcc\x81",
                                       "\xff",
                                       "\xe4\xb8",
                                       "<|im_end|>",
                                       "123",
                                       "'s",
                                       "\t",
                                       "  ",
                                       "\xc4\x80",
                                       "aaaaa",
                                       "Hello",
                                       "!?",
                                       "\r\n"};
    size_t nf = sizeof frag / sizeof frag[0], cap = 30000 * 16, n = 0;
    char *s = malloc(cap);
    for (uint64_t i = 0; i < 30000; i++) {
        const char *f = frag[draw(i) % nf];
        memcpy(s + n, f, strlen(f));
        n += strlen(f);
    }
    *len = n;
    return s;
}

static void test_long_input(void) {
    char dir[512];
    tokenizer_t *t = rt_tokenizer(dir, false);
    size_t len;
    char *text = mixed_text(&len);
    CU_ASSERT(len > 80000);
    expect_round_trip(t, text, len, true);
    expect_round_trip(t, text, len, false);
    free(text);
    /* one 200000-byte pre-token: (a, a) then (aa, aa) give 50000 "aaaa" */
    size_t n = 200000;
    char *as = malloc(n);
    memset(as, 'a', n);
    int32_t *ids = NULL;
    size_t nids = 0;
    CU_ASSERT_FATAL(tokenizer_encode(t, as, n, true, &ids, &nids) == 0);
    CU_ASSERT(nids == 50000);
    size_t bad = 0;
    for (size_t i = 0; i < nids; i++)
        bad += ids[i] != 264;
    CU_ASSERT(bad == 0);
    free(ids);
    expect_round_trip(t, as, n, true);
    memset(as, ' ', n); /* one run of spaces, no merges apply */
    CU_ASSERT_FATAL(tokenizer_encode(t, as, n, true, &ids, &nids) == 0);
    CU_ASSERT(nids == n && ids[0] == ' ' && ids[n - 1] == ' ');
    free(ids);
    free(as);
    finish(&t, dir);
}

typedef struct {
    const tokenizer_t *t;
    const char *text;
    size_t len;
    int32_t *ids;
    size_t n;
    int rc;
} job_t;

static void *encode_job(void *arg) {
    job_t *j = arg;
    j->rc = tokenizer_encode(j->t, j->text, j->len, true, &j->ids, &j->n);
    return NULL;
}

/* Several threads share one tokenizer (and its cache) and agree. */
static void test_threads(void) {
    char dir[512];
    tokenizer_t *t = rt_tokenizer(dir, false);
    size_t len;
    char *text = mixed_text(&len);
    job_t jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (job_t){t, text, len, NULL, 0, -1};
        CU_ASSERT_FATAL(pthread_create(&th[i], NULL, encode_job, &jobs[i]) == 0);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) {
        CU_ASSERT(jobs[i].rc == 0);
        CU_ASSERT(jobs[i].n == jobs[0].n && jobs[i].n > 0);
        CU_ASSERT(memcmp(jobs[i].ids, jobs[0].ids, jobs[0].n * sizeof(int32_t)) == 0);
    }
    for (int i = 0; i < 4; i++)
        free(jobs[i].ids);
    free(text);
    finish(&t, dir);
}

static void test_encode_into_and_decode_errors(void) {
    char dir[512];
    tokenizer_t *t = rt_tokenizer(dir, false);
    int32_t buf[4] = {-7, -7, -7, -7};
    size_t n = 0;
    CU_ASSERT(tokenizer_encode_into(t, " the", 4, true, buf, 4, &n) == 0);
    CU_ASSERT(n == 1 && buf[0] == 258 && buf[1] == -7);
    CU_ASSERT(tokenizer_encode_into(t, "xyzxyz", 6, true, buf, 4, &n) == MO_EINVAL);
    CU_ASSERT(n == 6 && buf[0] == 'x' && buf[3] == 'x');
    const char *b;
    size_t l;
    CU_ASSERT(tokenizer_token_bytes(t, 258, &b, &l) == 0 && l == 4 && memcmp(b, " the", 4) == 0);
    CU_ASSERT(tokenizer_token_bytes(t, 301, &b, &l) == 0 && l == 10);
    CU_ASSERT(tokenizer_token_bytes(t, 290, &b, &l) == MO_EINVAL); /* a hole in the ids */
    CU_ASSERT(tokenizer_token_bytes(t, -1, &b, &l) == MO_EINVAL);
    int32_t ids[] = {'a', 100000};
    char *out = NULL;
    size_t olen;
    CU_ASSERT(tokenizer_decode(t, ids, 2, &out, &olen) == MO_EINVAL);
    CU_ASSERT(out == NULL);
    CU_ASSERT(strstr(mo_last_error(), "ids[1]") != NULL);
    CU_ASSERT(tokenizer_token_id(t, "\xc4\xa0the") == 258); /* "Ġthe" as tokenizer.json spells it */
    finish(&t, dir);
}

/* ---- bos / eos / pad and the post-processor ---- */

static void test_special_ids_and_affixes(void) {
    model_spec_t m = {0};
    cJSON *doc = make_doc(&m, NULL);
    add_token(doc, 300, "<|begin_of_text|>", SPECIAL);
    add_token(doc, 301, "<|endoftext|>", SPECIAL);
    add_token(doc, 302, "<|im_end|>", SPECIAL);
    cJSON *tp = cJSON_Parse("{\"type\": \"Sequence\", \"processors\": [{\"type\": \"ByteLevel\"},"
                            "{\"type\": \"TemplateProcessing\", \"single\": ["
                            "{\"SpecialToken\": {\"id\": \"<|begin_of_text|>\", \"type_id\": 0}},"
                            "{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],"
                            "\"special_tokens\": {\"<|begin_of_text|>\": {\"id\": "
                            "\"<|begin_of_text|>\", \"ids\": [300], \"tokens\": "
                            "[\"<|begin_of_text|>\"]}}}]}");
    cJSON_ReplaceItemInObject(doc, "post_processor", tp);
    char dir[512];
    tokenizer_t *t = load_doc(doc, dir);
    /* no tokenizer_config.json: the usual names */
    CU_ASSERT(tokenizer_bos_id(t) == 300);
    CU_ASSERT(tokenizer_eos_id(t) == 301);
    CU_ASSERT(tokenizer_pad_id(t) == -1);
    const int32_t *pre, *suf;
    size_t npre, nsuf;
    tokenizer_affixes(t, &pre, &npre, &suf, &nsuf);
    CU_ASSERT(npre == 1 && pre[0] == 300 && nsuf == 0);
    tokenizer_destroy(&t);
    /* tokenizer_config.json wins; an explicit null means none */
    write_text(dir, "tokenizer_config.json",
               "{\"bos_token\": null, \"eos_token\": {\"content\": \"<|im_end|>\"}, "
               "\"pad_token\": \"<|endoftext|>\"}");
    CU_ASSERT_FATAL(tokenizer_load(dir, &t) == 0);
    CU_ASSERT(tokenizer_bos_id(t) == -1);
    CU_ASSERT(tokenizer_eos_id(t) == 302);
    CU_ASSERT(tokenizer_pad_id(t) == 301);
    tokenizer_destroy(&t);
    /* the file path form reads the sibling config too */
    char file[600];
    snprintf(file, sizeof file, "%s/tokenizer.json", dir);
    CU_ASSERT_FATAL(tokenizer_load(file, &t) == 0);
    CU_ASSERT(tokenizer_eos_id(t) == 302);
    finish(&t, dir);
}

/* ---- the byte-level tokenizer ---- */

static cJSON *read_json(const char *dir, const char *name) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    return j;
}

static void test_bytelevel_writer(void) {
    char dir[512], sub[560];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(sub, sizeof sub, "%s/model", dir);
    CU_ASSERT_FATAL(tokenizer_write_bytelevel(sub) == 0);
    CU_ASSERT_FATAL(tokenizer_write_bytelevel(sub) == 0); /* rewriting replaces */
    /* exactly the two files, no temporary left behind */
    DIR *d = opendir(sub);
    CU_ASSERT_FATAL(d != NULL);
    int files = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.' || strstr(e->d_name, "tmp"))
            files++;
    closedir(d);
    CU_ASSERT(files == 2);
    cJSON *tj = read_json(sub, "tokenizer.json"), *cj = read_json(sub, "tokenizer_config.json");
    CU_ASSERT_FATAL(tj && cj);
    cJSON *model = cJSON_GetObjectItem(tj, "model");
    CU_ASSERT(strcmp(cJSON_GetObjectItem(model, "type")->valuestring, "BPE") == 0);
    CU_ASSERT(cJSON_GetArraySize(cJSON_GetObjectItem(model, "vocab")) == 256);
    CU_ASSERT(cJSON_GetArraySize(cJSON_GetObjectItem(model, "merges")) == 0);
    CU_ASSERT(cJSON_GetObjectItem(cJSON_GetObjectItem(model, "vocab"), "\xc4\xa0")->valueint ==
              ' ');
    cJSON *added = cJSON_GetObjectItem(tj, "added_tokens");
    CU_ASSERT(cJSON_GetArraySize(added) == 5);
    for (cJSON *a = added ? added->child : NULL; a; a = a->next)
        CU_ASSERT(cJSON_IsTrue(cJSON_GetObjectItem(a, "special")));
    CU_ASSERT(strcmp(cJSON_GetObjectItem(cj, "eos_token")->valuestring, "<|eos|>") == 0);
    CU_ASSERT(cJSON_GetObjectItem(cj, "chat_template") == NULL);
    cJSON_Delete(tj);
    cJSON_Delete(cj);

    tokenizer_t *t = NULL;
    CU_ASSERT_FATAL(tokenizer_load(sub, &t) == 0);
    CU_ASSERT(tokenizer_vocab_size(t) == TOK_BYTELEVEL_VOCAB);
    CU_ASSERT(tokenizer_bos_id(t) == TOK_BYTELEVEL_BOS);
    CU_ASSERT(tokenizer_eos_id(t) == TOK_BYTELEVEL_EOS);
    CU_ASSERT(tokenizer_pad_id(t) == TOK_BYTELEVEL_PAD);
    CU_ASSERT(tokenizer_token_id(t, "<|im_start|>") == TOK_BYTELEVEL_IM_START);
    CU_ASSERT(tokenizer_token_id(t, "<|im_end|>") == TOK_BYTELEVEL_IM_END);
    EXPECT(t, "<|im_start|>user\nhi \xc3\xa9<|im_end|>", true, 259, 'u', 's', 'e', 'r', '\n', 'h',
           'i', ' ', 0xc3, 0xa9, 260);
    EXPECT(t, "<|eos|>", false, '<', '|', 'e', 'o', 's', '|', '>');
    EXPECT(t, "\x00\xff", true, 0, 255);
    ROUND_TRIP(t, "<|bos|>any \xff\xfe bytes \xf0\x9f\x98\x80<|pad|>", true);
    ROUND_TRIP(t, "<|bos|>any \xff\xfe bytes \xf0\x9f\x98\x80<|pad|>", false);
    tokenizer_destroy(&t);
    tu_rmtree(dir);
}

/* ---- templates ---- */

static void test_template(void) {
    char *out = NULL;
    CU_ASSERT(tokenizer_apply_template("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>"
                                       "assistant\n",
                                       "2+2?", &out) == 0);
    CU_ASSERT(out && strcmp(out, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n") == 0);
    free(out);
    CU_ASSERT(tokenizer_apply_template("{{x}} {prompt}/{prompt} }}", "{p}", &out) == 0);
    CU_ASSERT(out && strcmp(out, "{x} {p}/{p} }") == 0);
    free(out);
    CU_ASSERT(tokenizer_apply_template("", "p", &out) == 0);
    CU_ASSERT(out && out[0] == 0);
    free(out);
    out = NULL;
    CU_ASSERT(tokenizer_apply_template("a {system} {prompt}", "p", &out) == MO_EINVAL);
    CU_ASSERT(out == NULL);
    CU_ASSERT(strstr(mo_last_error(), "\"{system}\"") != NULL);
    CU_ASSERT(tokenizer_apply_template("a {prompt", "p", &out) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "unclosed") != NULL);
    CU_ASSERT(tokenizer_apply_template("a } b", "p", &out) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "offset 2") != NULL);
}

/* ---- bad files ---- */

typedef void (*mutate_fn)(cJSON *doc);

static void expect_load_error(cJSON *doc, int code, const char *const *needles) {
    char dir[512];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    write_doc(dir, "tokenizer.json", doc);
    tokenizer_t *t = (tokenizer_t *)&t; /* must be reset to NULL */
    int rc = tokenizer_load(dir, &t);
    CU_ASSERT(rc == code);
    CU_ASSERT(t == NULL);
    for (; *needles; needles++) {
        bool found = strstr(mo_last_error(), *needles) != NULL;
        if (!found || rc != code)
            tu_report("error %d \"%s\" lacks \"%s\"", rc, mo_last_error(), *needles);
        CU_ASSERT(found);
    }
    tu_rmtree(dir);
}

#define LOAD_ERROR(doc, code, ...)                                                                 \
    do {                                                                                           \
        const char *const n_[] = {__VA_ARGS__, NULL};                                              \
        expect_load_error((doc), (code), n_);                                                      \
    } while (0)

static cJSON *good_doc(void) {
    static const char *const extra[] = {"he"};
    static const char *const merges[][2] = {{"h", "e"}};
    model_spec_t m = {extra, 1, merges, 1, false, false};
    return make_doc(&m, split_pre(QWEN2_REGEX));
}

static cJSON *model_of(cJSON *doc) {
    return cJSON_GetObjectItem(doc, "model");
}

static void test_bad_files(void) {
    cJSON *d = good_doc();
    cJSON_DeleteItemFromObject(model_of(d), "vocab");
    LOAD_ERROR(d, MO_EMALFORMED, "tokenizer.json: model.vocab: missing");

    d = good_doc();
    cJSON_AddItemToArray(cJSON_GetObjectItem(model_of(d), "merges"), cJSON_CreateString("h zz"));
    LOAD_ERROR(d, MO_EMALFORMED, "model.merges[1]", "\"zz\" is not in model.vocab");

    d = good_doc();
    cJSON_AddItemToArray(cJSON_GetObjectItem(model_of(d), "merges"), cJSON_CreateString("x y"));
    LOAD_ERROR(d, MO_EMALFORMED, "model.merges[1]", "\"xy\" is not in model.vocab");

    d = good_doc();
    cJSON_AddItemToArray(cJSON_GetObjectItem(model_of(d), "merges"), cJSON_CreateNumber(3));
    LOAD_ERROR(d, MO_EMALFORMED, "model.merges[1]", "got a number");

    d = good_doc();
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(model_of(d), "vocab"), "a",
                              cJSON_CreateString("97"));
    LOAD_ERROR(d, MO_EMALFORMED, "model.vocab[\"a\"]", "got a string");

    d = good_doc();
    cJSON_ReplaceItemInObject(model_of(d), "merges", cJSON_CreateObject());
    LOAD_ERROR(d, MO_EMALFORMED, "model.merges: expected an array, got an object");

    d = good_doc();
    cJSON_DeleteItemFromObject(cJSON_GetObjectItem(model_of(d), "vocab"), "A");
    LOAD_ERROR(d, MO_EMALFORMED, "byte 0x41");

    d = good_doc();
    cJSON_ReplaceItemInObject(model_of(d), "byte_fallback", cJSON_CreateTrue());
    LOAD_ERROR(d, MO_EUNSUPPORTED, "model.byte_fallback");

    d = good_doc();
    cJSON_ReplaceItemInObject(model_of(d), "type", cJSON_CreateString("WordPiece"));
    LOAD_ERROR(d, MO_EUNSUPPORTED, "model.type: unsupported \"WordPiece\" (supported: BPE)");

    d = good_doc();
    add_token(d, 300, "<|x|>", SPECIAL);
    cJSON *a0 = cJSON_GetArrayItem(cJSON_GetObjectItem(d, "added_tokens"), 0);
    cJSON_ReplaceItemInObject(a0, "special", cJSON_CreateString("yes"));
    LOAD_ERROR(d, MO_EMALFORMED, "added_tokens[0].special: expected true or false");

    d = good_doc();
    add_token(d, 300, "<|x|>", SPECIAL);
    add_token(d, 301, "<|x|>", SPECIAL);
    LOAD_ERROR(d, MO_EMALFORMED, "added_tokens[1]", "repeats added_tokens[0]");

    d = good_doc();
    cJSON *pre = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(d, "pre_tokenizer"), "pretokenizers"), 0);
    cJSON_ReplaceItemInObject(pre, "type", cJSON_CreateString("Metaspace"));
    LOAD_ERROR(d, MO_EUNSUPPORTED,
               "tokenizer.json: pre_tokenizer.pretokenizers[0].type: unsupported \"Metaspace\" "
               "(supported: Split, ByteLevel)");

    static const char *const bad_re = "(\\p{L}+";
    d = good_doc();
    cJSON_ReplaceItemInObject(d, "pre_tokenizer", split_seq(&bad_re, 1));
    LOAD_ERROR(d, MO_EMALFORMED, "pre_tokenizer.pretokenizers[0].pattern.Regex: bad regex");

    d = good_doc();
    pre = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(d, "pre_tokenizer"), "pretokenizers"), 0);
    cJSON_ReplaceItemInObject(pre, "behavior", cJSON_CreateString("Removed"));
    LOAD_ERROR(d, MO_EUNSUPPORTED, "pre_tokenizer.pretokenizers[0].behavior: unsupported");

    d = good_doc();
    cJSON_DeleteItemFromArray(
        cJSON_GetObjectItem(cJSON_GetObjectItem(d, "pre_tokenizer"), "pretokenizers"), 1);
    LOAD_ERROR(d, MO_EUNSUPPORTED, "ByteLevel as the last");

    d = good_doc();
    cJSON_ReplaceItemInObject(d, "pre_tokenizer", cJSON_CreateNull());
    LOAD_ERROR(d, MO_EUNSUPPORTED, "pre_tokenizer: null is unsupported");

    d = good_doc();
    cJSON *norm = cJSON_CreateObject();
    cJSON_AddStringToObject(norm, "type", "NFKC");
    cJSON_ReplaceItemInObject(d, "normalizer", norm);
    LOAD_ERROR(d, MO_EUNSUPPORTED, "normalizer.type: unsupported \"NFKC\"");

    d = good_doc();
    cJSON *dec = cJSON_CreateObject();
    cJSON_AddStringToObject(dec, "type", "WordPiece");
    cJSON_ReplaceItemInObject(d, "decoder", dec);
    LOAD_ERROR(d, MO_EUNSUPPORTED, "decoder.type: unsupported \"WordPiece\"");

    d = good_doc();
    cJSON *bl = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(d, "pre_tokenizer"), "pretokenizers"), 1);
    cJSON_DeleteItemFromObject(bl, "add_prefix_space");
    LOAD_ERROR(d, MO_EMALFORMED, "pretokenizers[1].add_prefix_space: expected true or false");

    /* not JSON; a missing file */
    char dir[512];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    write_text(dir, "tokenizer.json", "{\"model\": {\"vocab\": {\"a\": 1,}}");
    tokenizer_t *t = NULL;
    CU_ASSERT(tokenizer_load(dir, &t) == MO_EMALFORMED && t == NULL);
    CU_ASSERT(strstr(mo_last_error(), "not valid JSON") != NULL);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/nope", dir);
    CU_ASSERT(tokenizer_load(missing, &t) == MO_EIO && t == NULL);
    /* a config naming an unknown token */
    write_doc(dir, "tokenizer.json", good_doc());
    write_text(dir, "tokenizer_config.json", "{\"eos_token\": \"<|missing|>\"}");
    CU_ASSERT(tokenizer_load(dir, &t) == MO_EMALFORMED && t == NULL);
    CU_ASSERT(strstr(mo_last_error(), "tokenizer_config.json: eos_token") != NULL);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"string merges by rank", test_string_merges},
        {"pair merges by rank", test_pair_merges},
        {"ignore_merges", test_ignore_merges},
        {"added tokens before splitting", test_added_tokens},
        {"added tokens lstrip rstrip single_word", test_added_strip_and_single_word},
        {"Qwen2 split regex", test_qwen2_split},
        {"Llama 3 split regex", test_llama3_split},
        {"GPT-2 ByteLevel regex", test_gpt2_bytelevel_regex},
        {"prefix space and two splits", test_prefix_space_and_two_splits},
        {"empty regex matches, literal patterns", test_empty_matches_and_literal},
        {"NFC normalizer", test_nfc},
        {"round trips", test_round_trip},
        {"long input", test_long_input},
        {"threads share a tokenizer", test_threads},
        {"encode_into and lookups", test_encode_into_and_decode_errors},
        {"bos eos pad and affixes", test_special_ids_and_affixes},
        {"byte-level writer", test_bytelevel_writer},
        {"prompt templates", test_template},
        {"bad files name the field", test_bad_files},
        CU_TEST_INFO_NULL,
    };
    return tu_main("tokenizer", tests);
}
