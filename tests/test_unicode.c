/* Tests for actor/unicode: strict UTF-8, White_Space, and NFC, the last both
 * on hand-picked cases and against Python's unicodedata over most of Unicode. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/unicode.h"
#include "core/status.h"
#include "tests/testutil.h"

static void test_utf8(void) {
    size_t len;
    CU_ASSERT(uni_next("A", 1, &len) == 'A' && len == 1);
    CU_ASSERT(uni_next("\xc3\xa9", 2, &len) == 0xE9 && len == 2);
    CU_ASSERT(uni_next("\xe4\xbd\xa0", 3, &len) == 0x4F60 && len == 3);
    CU_ASSERT(uni_next("\xf0\x9f\x98\x80", 4, &len) == 0x1F600 && len == 4);
    static const char *const bad[] = {
        "\x80",             /* stray continuation */
        "\xc0\xaf",         /* overlong '/' */
        "\xe0\x80\xaf",     /* overlong '/' */
        "\xed\xa0\x80",     /* surrogate D800 */
        "\xf4\x90\x80\x80", /* beyond U+10FFFF */
        "\xf8\x88\x80\x80", /* 5-byte form */
        "\xe4\xbd",         /* truncated */
        "\xe4"
        "A", /* lead byte, then no continuation */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CU_ASSERT(uni_next(bad[i], strlen(bad[i]), &len) == UNI_INVALID);
        CU_ASSERT(len == 1);
    }
    CU_ASSERT(uni_next("\xe4\xbd\xa0", 2, &len) == UNI_INVALID); /* n bounds the read */
    size_t bad_round_trips = 0;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            continue;
        char buf[4];
        size_t n = uni_put(cp, buf);
        bad_round_trips += uni_next(buf, n, &len) != cp || len != n;
    }
    CU_ASSERT(bad_round_trips == 0);
}

static void test_space(void) {
    static const uint32_t yes[] = {' ',    '\t',   '\n',   '\v',   '\f',   '\r',   0x85,   0xA0,
                                   0x1680, 0x2000, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
    static const uint32_t no[] = {'a', 0, 0x1F, 0x200B, 0x180E, 0xFEFF, 0x2060, UNI_INVALID};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        CU_ASSERT(uni_is_space(yes[i]));
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        CU_ASSERT(!uni_is_space(no[i]));
}

static void expect_nfc(const char *in, size_t n, const char *want, size_t wn) {
    char *out = NULL;
    size_t len = 0;
    CU_ASSERT_FATAL(uni_nfc(in, n, &out, &len) == 0);
    bool same = len == wn && memcmp(out, want, wn) == 0 && out[len] == 0;
    if (!same)
        tu_report("NFC of \"%.*s\" gave %zu bytes, expected %zu", (int)n, in, len, wn);
    CU_ASSERT(same);
    free(out);
}

#define NFC(in, want) expect_nfc((in), sizeof(in) - 1, (want), sizeof(want) - 1)

/* Expected values from Python's unicodedata.normalize("NFC", ...). */
static void test_nfc_cases(void) {
    NFC("", "");
    NFC("plain ascii\n", "plain ascii\n");
    NFC("e\xcc\x81", "\xc3\xa9");                                /* e + acute -> é */
    NFC("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xea\xb0\x81"); /* L V T -> 각 */
    NFC("\xea\xb0\x80\xe1\x86\xa8", "\xea\xb0\x81");             /* LV + T -> 각 */
    NFC("a\xcc\x81\xcc\xa3", "\xe1\xba\xa1\xcc\x81");            /* reorder, then compose */
    NFC("\xe1\xb8\x8b\xcc\xa3", "\xe1\xb8\x8d\xcc\x87");         /* ḋ + dot below */
    NFC("q\xcc\x87\xcc\xa3", "q\xcc\xa3\xcc\x87");               /* reorder only */
    NFC("\xe2\x84\xab", "\xc3\x85");                             /* Angstrom sign (singleton) */
    NFC("\xc3\x85\xcc\x81", "\xc7\xba");                         /* Å + acute -> Ǻ */
    NFC("\xe0\xa5\x98", "\xe0\xa4\x95\xe0\xa4\xbc");             /* excluded: stays apart */
    NFC("\xc3\xa9", "\xc3\xa9");                                 /* already NFC */
    NFC("\xcc\x81"
        "e",
        "\xcc\x81"
        "e"); /* leading mark */
    /* invalid bytes are kept and block composition across them */
    NFC("\xff"
        "e\xcc\x81\xfe",
        "\xff\xc3\xa9\xfe");
    NFC("e\xff\xcc\x81", "e\xff\xcc\x81");
    NFC("\xe4\xbd"
        "e\xcc\x81",
        "\xe4\xbd\xc3\xa9");
    /* a long run of marks in reverse class order (the counting-sort path) */
    char in[3 + 40 * 4], want[3 + 40 * 4];
    size_t n = 0;
    in[n++] = 'x';
    for (int i = 0; i < 20; i++) {
        memcpy(in + n, "\xcc\x81\xcc\xa3", 4); /* acute (230), dot below (220) */
        n += 4;
    }
    size_t w = 0;
    want[w++] = 'x';
    for (int i = 0; i < 20; i++, w += 2)
        memcpy(want + w, "\xcc\xa3", 2);
    for (int i = 0; i < 20; i++, w += 2)
        memcpy(want + w, "\xcc\x81", 2);
    expect_nfc(in, n, want, w);
}

/* ---- against Python over most of Unicode ---- */

static const char PY[] = "import sys, unicodedata as u\n"
                         "src = open(sys.argv[1], 'rb').read().decode('utf-8').split('\\n')\n"
                         "out = '\\n'.join(u.normalize('NFC', s) for s in src)\n"
                         "open(sys.argv[2], 'wb').write(out.encode('utf-8'))\n"
                         "print(u.unidata_version)\n";

static size_t put(char *buf, size_t n, uint32_t cp) {
    return n + uni_put(cp, buf + n);
}

/* Three lines per code point: cp + acute + dot below, A + cp + grave, and
 * Hangul L + cp + Hangul T. */
static size_t make_lines(char *buf, uint32_t *cps, size_t *ncp) {
    static const uint32_t ranges[][2] = {{0xA0, 0x3400},
                                         {0xA000, 0xD800},
                                         {0xF900, 0x10000},
                                         {0x10000, 0x20000},
                                         {0x2F800, 0x2FA20}};
    size_t n = 0, k = 0;
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        for (uint32_t cp = ranges[r][0]; cp < ranges[r][1]; cp++) {
            cps[k++] = cp;
            n = put(buf, n, cp), n = put(buf, n, 0x301), n = put(buf, n, 0x323);
            buf[n++] = '\n';
            n = put(buf, n, 'A'), n = put(buf, n, cp), n = put(buf, n, 0x300);
            buf[n++] = '\n';
            n = put(buf, n, 0x1100), n = put(buf, n, cp), n = put(buf, n, 0x11AE);
            buf[n++] = '\n';
        }
    }
    *ncp = k;
    return n - 1; /* no newline after the last line */
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *len = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

static void test_nfc_against_python(void) {
    char dir[512], in_path[600], out_path[600], py_path[600], cmd[2400];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(in_path, sizeof in_path, "%s/in.txt", dir);
    snprintf(out_path, sizeof out_path, "%s/out.txt", dir);
    snprintf(py_path, sizeof py_path, "%s/nfc.py", dir);
    size_t cap = 200000 * 3 * 13;
    char *buf = malloc(cap);
    uint32_t *cps = malloc(200000 * sizeof *cps);
    size_t ncp, n = make_lines(buf, cps, &ncp);
    FILE *f = fopen(in_path, "wb");
    CU_ASSERT_FATAL(f != NULL);
    fwrite(buf, 1, n, f);
    fclose(f);
    f = fopen(py_path, "wb");
    CU_ASSERT_FATAL(f != NULL);
    fputs(PY, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' '%s' > '%s/version.txt'", tu_python(), py_path,
             in_path, out_path, dir);
    int rc = system(cmd);
    if (rc != 0)
        tu_report("%s failed (%d); this test needs Python 3 with unicodedata", cmd, rc);
    CU_ASSERT_FATAL(rc == 0);
    size_t plen = 0, vlen = 0;
    char *py = slurp(out_path, &plen), *ver = NULL;
    char vpath[700];
    snprintf(vpath, sizeof vpath, "%s/version.txt", dir);
    ver = slurp(vpath, &vlen);
    CU_ASSERT_FATAL(py != NULL && ver != NULL);
    bool same_version = vlen > 0 && strncmp(ver, uni_version(), strlen(uni_version())) == 0;
    if (!same_version)
        tu_report("Python has Unicode %.*s, the tables %s: comparing anyway", (int)vlen, ver,
                  uni_version());
    size_t lines = 0, bad = 0, a = 0, b = 0;
    while (a <= n && b <= plen) {
        const char *ea = memchr(buf + a, '\n', n - a), *eb = memchr(py + b, '\n', plen - b);
        size_t la = ea ? (size_t)(ea - (buf + a)) : n - a,
               lb = eb ? (size_t)(eb - (py + b)) : plen - b;
        char *out;
        size_t olen;
        CU_ASSERT_FATAL(uni_nfc(buf + a, la, &out, &olen) == 0);
        if (olen != lb || memcmp(out, py + b, lb) != 0) {
            if (bad++ < 5)
                tu_report("line %zu (U+%04X context %zu) differs from Python", lines,
                          cps[lines / 3], lines % 3);
        }
        free(out);
        lines++;
        a += la + 1, b += lb + 1;
    }
    CU_ASSERT(lines == 3 * ncp);
    CU_ASSERT(bad == 0);
    free(py);
    free(ver);
    free(buf);
    free(cps);
    tu_rmtree(dir);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"strict UTF-8", test_utf8},
        {"White_Space", test_space},
        {"NFC hand-picked cases", test_nfc_cases},
        {"NFC agrees with Python", test_nfc_against_python},
        CU_TEST_INFO_NULL,
    };
    return tu_main("unicode", tests);
}
