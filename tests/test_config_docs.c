/* test_config_docs: docs/config.md is exactly what `moerl config docs`
 * generates, and the reference covers every key. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "tests/testutil.h"

/* The whole file as a heap string, or NULL. */
static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        char *bigger = realloc(buf, cap * 2);
        if (!bigger) {
            free(buf);
            buf = NULL;
        }
        buf = bigger;
        cap *= 2;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        *len = n;
    }
    return buf;
}

static char *generate(size_t *len) {
    char dir[512], path[700];
    if (tu_tmpdir(dir, sizeof dir) != 0)
        return NULL;
    snprintf(path, sizeof path, "%s/config.md", dir);
    FILE *f = fopen(path, "w");
    char *text = NULL;
    if (f) {
        config_doc_markdown(f);
        fclose(f);
        text = slurp(path, len);
    }
    tu_rmtree(dir);
    return text;
}

static void test_committed_docs_match(void) {
    char path[1024];
    size_t glen = 0, clen = 0;
    snprintf(path, sizeof path, "%s/docs/config.md", tu_source_dir());
    char *gen = generate(&glen), *committed = slurp(path, &clen);
    CU_ASSERT_PTR_NOT_NULL_FATAL(gen);
    if (!committed)
        tu_report("cannot read %s", path);
    CU_ASSERT_PTR_NOT_NULL_FATAL(committed);
    if (glen != clen || memcmp(gen, committed, glen) != 0) {
        size_t i = 0;
        while (i < glen && i < clen && gen[i] == committed[i])
            i++;
        tu_report("%s differs from the generator at byte %zu; regenerate it with "
                  "`moerl config docs > docs/config.md`",
                  path, i);
    }
    CU_ASSERT_EQUAL(glen, clen);
    CU_ASSERT(glen == clen && memcmp(gen, committed, glen) == 0);
    free(gen);
    free(committed);
}

static void test_docs_cover_every_key(void) {
    size_t len = 0;
    char *gen = generate(&len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(gen);
    for (int i = 0; i < cfg_nkeys; i++) {
        char row[256];
        snprintf(row, sizeof row, "\n| `%s.%s` | ", cfg_keys[i].section, cfg_keys[i].name);
        if (!strstr(gen, row))
            tu_report("no row for %s.%s", cfg_keys[i].section, cfg_keys[i].name);
        CU_ASSERT_PTR_NOT_NULL(strstr(gen, row));
    }
    for (int s = 0; s < cfg_nsections; s++) {
        char head[64];
        snprintf(head, sizeof head, "\n## %s\n", cfg_sections[s].name);
        CU_ASSERT_PTR_NOT_NULL(strstr(gen, head));
    }
    CU_ASSERT_PTR_NOT_NULL(strstr(gen, "| `learner.lr` | number in (0, 1] | `1e-05` | "));
    free(gen);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"committed_docs_match", test_committed_docs_match},
        {"docs_cover_every_key", test_docs_cover_every_key},
        CU_TEST_INFO_NULL,
    };
    return tu_main("config_docs", tests);
}
