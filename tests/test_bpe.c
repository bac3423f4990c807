/* Tests for actor/bpe: the GPT-2 byte mapping, the vocabulary, and the merge
 * loop against a plain quadratic reference on random merge tables. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/bpe.h"
#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"

static void test_byte_map(void) {
    /* values any GPT-2 vocabulary shows: Ġ for space, Ċ for newline, ... */
    CU_ASSERT(bpe_byte_char(' ') == 0x120);
    CU_ASSERT(bpe_byte_char('\n') == 0x10A);
    CU_ASSERT(bpe_byte_char(0x00) == 0x100);
    CU_ASSERT(bpe_byte_char(0x7F) == 0x121);
    CU_ASSERT(bpe_byte_char(0xAD) == 0x143);
    CU_ASSERT(bpe_byte_char('!') == '!');
    CU_ASSERT(bpe_byte_char(0xFF) == 0xFF);
    bool seen[256 + 68] = {false};
    for (int b = 0; b < 256; b++) {
        uint32_t c = bpe_byte_char((uint8_t)b);
        CU_ASSERT(c < 256 + 68 && !seen[c]);
        if (c < 256 + 68)
            seen[c] = true;
        CU_ASSERT(bpe_char_byte(c) == b);
    }
    CU_ASSERT(bpe_char_byte(' ') == -1);
    CU_ASSERT(bpe_char_byte(0x144) == -1);
    CU_ASSERT(bpe_char_byte(0x4E00) == -1);
    char all[256], m[512], back[512];
    for (int b = 0; b < 256; b++)
        all[b] = (char)b;
    size_t ml = bpe_map(all, 256, m), bl = 0;
    CU_ASSERT(ml == 94 + 2 * (12 + 82) + 2 * 68); /* ASCII in 1 byte, the rest in 2 */
    CU_ASSERT(bpe_unmap(m, ml, back, &bl) && bl == 256 && memcmp(back, all, 256) == 0);
    CU_ASSERT(!bpe_unmap("a b", 3, back, &bl)); /* U+0020 stands for no byte */
    CU_ASSERT(!bpe_unmap("\xe4\xbd\xa0", 3, back, &bl));
}

static void add_bytes(bpe_t *b) {
    for (int i = 0; i < 256; i++) {
        char c = (char)i, key[4];
        size_t n = bpe_map(&c, 1, key);
        CU_ASSERT_FATAL(bpe_add_token(b, key, n, i) == 0);
    }
}

static int add_raw(bpe_t *b, const char *raw, int32_t id) {
    char key[256];
    size_t n = bpe_map(raw, strlen(raw), key);
    return bpe_add_token(b, key, n, id);
}

static int merge_raw(bpe_t *b, const char *l, const char *r) {
    char kl[256], kr[256];
    size_t nl = bpe_map(l, strlen(l), kl), nr = bpe_map(r, strlen(r), kr);
    return bpe_add_merge(b, kl, nl, kr, nr);
}

static void test_vocab_errors(void) {
    bpe_t *b = NULL;
    CU_ASSERT_FATAL(bpe_new(&b) == 0);
    add_bytes(b);
    CU_ASSERT(bpe_finish(b, false) == 0);
    CU_ASSERT(add_raw(b, "ab", 256) == 0);
    CU_ASSERT(add_raw(b, "cd", 256) == MO_EINVAL); /* id taken */
    CU_ASSERT(add_raw(b, "ab", 257) == MO_EINVAL); /* key repeated */
    CU_ASSERT(add_raw(b, "ef", -1) == MO_EINVAL);
    CU_ASSERT(add_raw(b, "ef", BPE_MAX_ID) == MO_EINVAL);
    CU_ASSERT(merge_raw(b, "a", "b") == 0);
    CU_ASSERT(merge_raw(b, "ab", "c") == MO_ENOTFOUND); /* "abc" absent */
    CU_ASSERT(strstr(mo_last_error(), "abc") != NULL);
    CU_ASSERT(merge_raw(b, "xy", "z") == MO_ENOTFOUND); /* "xy" absent */
    /* a key that is not all mapped: kept for decoding, unreachable by bytes */
    CU_ASSERT(bpe_add_token(b, "a b", 3, 300) == 0);
    CU_ASSERT(bpe_key_id(b, "a b", 3) == 300);
    CU_ASSERT(bpe_bytes_id(b, "a b", 3) == -1);
    const char *bytes;
    size_t len;
    CU_ASSERT(bpe_token_bytes(b, 300, &bytes, &len) == 0 && len == 3 &&
              memcmp(bytes, "a b", 3) == 0);
    CU_ASSERT(bpe_token_bytes(b, 299, &bytes, &len) == MO_ENOTFOUND);
    CU_ASSERT(bpe_key_id(b, "\xc4\xa0", 2) == ' '); /* "Ġ" */
    CU_ASSERT(bpe_size(b) == 301 && bpe_num_merges(b) == 1);
    bpe_destroy(&b);
    CU_ASSERT(b == NULL);

    CU_ASSERT_FATAL(bpe_new(&b) == 0);
    for (int i = 0; i < 256; i++) {
        char c = (char)i, key[4];
        if (i != 'q')
            CU_ASSERT(bpe_add_token(b, key, bpe_map(&c, 1, key), i) == 0);
    }
    CU_ASSERT(bpe_finish(b, false) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "0x71") != NULL);
    bpe_destroy(&b);
}

/* ---- random merge tables against a reference ---- */

#define NTOK_MAX 400

typedef struct {
    char s[NTOK_MAX][64]; /* raw bytes of token id (byte tokens: one byte) */
    int ntok;
    int ml[NTOK_MAX], mr[NTOK_MAX]; /* merge k joins ids ml[k], mr[k] */
    int nmerge;
} table_t;

static uint32_t draw(uint64_t stream, uint64_t i) {
    uint32_t r[4];
    rng_block(r, 99, stream, i);
    return r[0];
}

static int find_tok(const table_t *t, const char *s) {
    for (int i = 0; i < t->ntok; i++)
        if (strcmp(t->s[i], s) == 0 && (i >= 256 || strlen(s) == 1))
            return i;
    return -1;
}

/* Merges over the alphabet "abcd" drawn like a BPE trainer would produce them:
 * each joins two existing tokens into a new one. */
static bpe_t *random_table(table_t *t, uint64_t seed, bool ignore_merges) {
    bpe_t *b = NULL;
    CU_ASSERT_FATAL(bpe_new(&b) == 0);
    add_bytes(b);
    memset(t, 0, sizeof *t);
    for (int i = 0; i < 256; i++)
        t->s[i][0] = (char)i;
    t->ntok = 256;
    int pool[NTOK_MAX] = {'a', 'b', 'c', 'd'}, npool = 4;
    for (uint64_t k = 0; t->nmerge < 80 && k < 10000; k++) {
        int l = pool[draw(seed, 2 * k) % (uint32_t)npool];
        int r = pool[draw(seed, 2 * k + 1) % (uint32_t)npool];
        char cat[64];
        size_t nl = strlen(t->s[l]), nr = strlen(t->s[r]);
        if (nl + nr >= sizeof cat)
            continue;
        memcpy(cat, t->s[l], nl);
        memcpy(cat + nl, t->s[r], nr + 1);
        if (find_tok(t, cat) >= 0)
            continue;
        strcpy(t->s[t->ntok], cat);
        CU_ASSERT_FATAL(add_raw(b, cat, t->ntok) == 0);
        CU_ASSERT_FATAL(merge_raw(b, t->s[l], t->s[r]) == 0);
        t->ml[t->nmerge] = l;
        t->mr[t->nmerge++] = r;
        pool[npool++] = t->ntok++;
    }
    CU_ASSERT_FATAL(bpe_finish(b, ignore_merges) == 0);
    return b;
}

/* Quadratic BPE: repeatedly merge the lowest-ranked adjacent pair, leftmost first. */
static size_t reference(const table_t *t, const char *w, size_t n, bool ignore, int *out) {
    if (ignore) {
        char s[512];
        memcpy(s, w, n);
        s[n] = 0;
        int id = n < 64 ? find_tok(t, s) : -1;
        if (id >= 0) {
            out[0] = id;
            return 1;
        }
    }
    size_t m = n;
    for (size_t i = 0; i < n; i++)
        out[i] = (uint8_t)w[i];
    for (;;) {
        int best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < m; i++)
            for (int k = 0; k < t->nmerge; k++)
                if (t->ml[k] == out[i] && t->mr[k] == out[i + 1] && (best < 0 || k < best)) {
                    best = k;
                    at = i;
                }
        if (best < 0)
            return m;
        out[at] = 256 + best;
        memmove(out + at + 1, out + at + 2, (m - at - 2) * sizeof *out);
        m--;
    }
}

static void check_random(bool ignore) {
    for (uint64_t seed = 1; seed <= 4; seed++) {
        table_t *t = malloc(sizeof *t);
        bpe_t *b = random_table(t, seed + (ignore ? 100 : 0), ignore);
        int mismatches = 0;
        for (uint64_t w = 0; w < 300; w++) {
            /* lengths up to 300: the stack path, the heap path, past the cache limit */
            size_t n = 1 + draw(1000 + seed, w) % (w % 10 == 0 ? 300 : 24);
            char word[300];
            for (size_t i = 0; i < n; i++)
                word[i] = (char)("abcd"[draw(2000 + seed, w * 300 + i) % 4]);
            int ref[300];
            size_t nref = reference(t, word, n, ignore, ref);
            for (int pass = 0; pass < 2; pass++) { /* the second pass hits the cache */
                bpe_ids_t got = {0};
                CU_ASSERT(bpe_encode(b, word, n, &got) == 0);
                bool same = got.n == nref;
                for (size_t i = 0; same && i < nref; i++)
                    same = got.v[i] == ref[i];
                if (!same && mismatches++ < 3)
                    tu_report("seed %d word %d (%zu bytes): %zu ids, reference %zu", (int)seed,
                              (int)w, n, got.n, nref);
                CU_ASSERT(same);
                bpe_ids_free(&got);
            }
        }
        bpe_destroy(&b);
        free(t);
    }
}

static void test_against_reference(void) {
    check_random(false);
}

static void test_against_reference_ignore_merges(void) {
    check_random(true);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"GPT-2 byte mapping", test_byte_map},
        {"vocabulary and merge errors", test_vocab_errors},
        {"merges match the reference", test_against_reference},
        {"ignore_merges matches the reference", test_against_reference_ignore_merges},
        CU_TEST_INFO_NULL,
    };
    return tu_main("bpe", tests);
}
