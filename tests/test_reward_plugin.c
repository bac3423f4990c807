/* Tests of reward plugins: the example plugin built by CMake scores through
 * every entry point (plugin, config pair, spec term, holder); bad paths,
 * missing symbols, a wrong ABI version, init failures and misbehaving score
 * calls fail with messages naming the cause, and leave nothing loaded. */
#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "reward/reward.h"
#include "tests/testutil.h"

static char g_example[4096];
static char g_dir[4096];

/* The example plugin: $MOERL_REWARD_EXAMPLE (set by ctest), else the build
 * tree's reward/examples. */
static const char *example_path(void) {
    if (g_example[0])
        return g_example;
    const char *e = getenv("MOERL_REWARD_EXAMPLE");
    const char *bin = getenv("MOERL_BINARY_DIR");
    if (e && e[0])
        snprintf(g_example, sizeof g_example, "%s", e);
    else
        snprintf(g_example, sizeof g_example, "%s/reward/examples/libmoerl_reward_example.so",
                 bin ? bin : ".");
    snprintf(g_dir, sizeof g_dir, "%s", g_example);
    char *slash = strrchr(g_dir, '/');
    if (slash)
        *slash = '\0';
    else
        strcpy(g_dir, ".");
    return g_example;
}

/* A sibling library of the example: the broken plugins. */
static const char *bad_path(const char *variant, char *buf, size_t cap) {
    example_path();
    snprintf(buf, cap, "%s/libmoerl_reward_bad_%s.so", g_dir, variant);
    return buf;
}

/* True when path is not loaded in this process any more. */
static bool unloaded(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (h)
        dlclose(h);
    return h == NULL;
}

static double score_with(reward_fn_t *fn, const char *completion, char *detail) {
    reward_input_t in;
    reward_input_init(&in, "prompt", completion, "");
    double r = NAN;
    char d[REWARD_DETAIL_CAP];
    if (reward_fn_score(fn, &in, &r, NULL, d, sizeof d) < 0) {
        tu_report("score \"%s\": %s", completion, mo_last_error());
        return NAN;
    }
    if (detail)
        strcpy(detail, d);
    return r;
}

static void test_example_scores(void) {
    const char *path = example_path();
    reward_fn_t *fn = NULL;
    int rc = reward_fn_plugin(path, "keyword=hello,miss=-0.5", &fn);
    if (rc < 0)
        tu_report("%s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    char d[REWARD_DETAIL_CAP];
    CU_ASSERT_EQUAL(score_with(fn, "say hello", d), 1.0);
    CU_ASSERT_STRING_EQUAL(d, "found \"hello\" at byte 4");
    CU_ASSERT_EQUAL(score_with(fn, "say HELLO", d), -0.5);
    CU_ASSERT_STRING_EQUAL(d, "no \"hello\"");
    char desc[4200];
    snprintf(desc, sizeof desc, "plugin %s keyword=hello,miss=-0.5", path);
    CU_ASSERT_STRING_EQUAL(reward_fn_describe(fn), desc);

    /* a group, with the sample's text at a NUL-holding length */
    reward_input_t in[3];
    reward_input_init(&in[0], "p", "hello", "");
    reward_input_init(&in[1], "p", "nothing", "");
    reward_input_init(&in[2], "p", "x\0hello", "");
    in[2].completion_len = 7;
    double r[3] = {NAN, NAN, NAN};
    CU_ASSERT_EQUAL(reward_fn_score_group(fn, in, 3, r, NULL, NULL, 0), 0);
    CU_ASSERT_EQUAL(r[0], 1.0);
    CU_ASSERT_EQUAL(r[1], -0.5);
    CU_ASSERT_EQUAL(r[2], 1.0);
    reward_fn_destroy(&fn);
    CU_ASSERT(unloaded(path));

    /* the configuration pair: reward.function is the plugin's argument string */
    CU_ASSERT_EQUAL_FATAL(reward_fn_from_config("keyword=Hi,icase=1", path, &fn), 0);
    CU_ASSERT_EQUAL(score_with(fn, "oh hI there", NULL), 1.0);
    reward_fn_destroy(&fn);

    /* a plugin term in a weighted sum with a built-in */
    char spec[4400];
    snprintf(spec, sizeof spec,
             "0.5*plugin:path=%s,args=\"keyword=ok,hit=2\" + 0.25*regex:pattern=!$", path);
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse(spec, &fn), 0);
    CU_ASSERT_DOUBLE_EQUAL(score_with(fn, "ok!", d), 1.25, 1e-12);
    CU_ASSERT_PTR_NOT_NULL(strstr(d, "0.5*plugin=2 (found \"ok\" at byte 0)"));
    CU_ASSERT_DOUBLE_EQUAL(score_with(fn, "no", NULL), 0.0, 1e-12);
    reward_fn_destroy(&fn);
    CU_ASSERT(unloaded(path));
}

static void expect_fail(const char *path, const char *args, int code, const char *want1,
                        const char *want2) {
    reward_fn_t *fn = (reward_fn_t *)0x1;
    mo_clear_error();
    int rc = reward_fn_plugin(path, args, &fn);
    CU_ASSERT_EQUAL(rc, code);
    CU_ASSERT_PTR_NULL(fn);
    const char *m = mo_last_error();
    if (!strstr(m, want1) || (want2 && !strstr(m, want2)))
        tu_report("load %s (%s): message \"%s\" lacks \"%s\" / \"%s\"", path, args, m, want1,
                  want2 ? want2 : "");
    CU_ASSERT_PTR_NOT_NULL(strstr(m, want1));
    if (want2)
        CU_ASSERT_PTR_NOT_NULL(strstr(m, want2));
    if (path[0]) /* dlopen("") names the program itself */
        CU_ASSERT(unloaded(path));
}

static void test_bad_path(void) {
    expect_fail("/nonexistent/dir/libnope.so", "", MO_EIO,
                "reward plugin /nonexistent/dir/libnope.so: cannot load: ", "No such file");
    char notlib[4200];
    snprintf(notlib, sizeof notlib, "%s/CMakeLists.txt", tu_source_dir());
    expect_fail(notlib, "", MO_EIO, "cannot load", notlib);
    expect_fail("", "", MO_EINVAL, "empty library path", NULL);
}

static void test_missing_symbol_and_abi(void) {
    char p[4200];
    expect_fail(bad_path("nosym", p, sizeof p), "", MO_ENOTFOUND,
                "missing required symbol moerl_reward_fini", p);
    expect_fail(bad_path("abi", p, sizeof p), "", MO_EUNSUPPORTED,
                "ABI version 999, but this moerl loads version 1", p);
}

static void test_init_failure(void) {
    const char *path = example_path();
    expect_fail(path, "", MO_EINVAL, "moerl_reward_init(\"\") failed (-1): no keyword", path);
    expect_fail(path, "keyword=x,hit=abc", MO_EINVAL, "hit: expected a finite number, got \"abc\"",
                NULL);
    expect_fail(path, "word=x", MO_EINVAL, "unknown argument \"word\"", NULL);
    /* through the spec: the error carries the column of the term's name */
    char spec[4400];
    snprintf(spec, sizeof spec, "exact + plugin:path=%s", path);
    reward_fn_t *fn;
    CU_ASSERT_EQUAL(reward_fn_parse(spec, &fn), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "column 9: plugin: reward plugin"));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "no keyword"));
    CU_ASSERT(unloaded(path));
}

static void test_misbehaving_score(void) {
    char p[4200];
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_plugin(bad_path("score", p, sizeof p), "", &fn), 0);
    CU_ASSERT_EQUAL(score_with(fn, "fine", NULL), 0.5);
    static const struct {
        const char *completion, *want;
    } c[] = {
        {"nan", "non-finite reward nan"},
        {"inf", "non-finite reward inf"},
        {"fail", "score failed (-3): asked to fail"},
        {"positive", "score returned 7 (positive values are reserved)"},
    };
    for (int i = 0; i < 4; i++) {
        reward_input_t in;
        reward_input_init(&in, "p", c[i].completion, "");
        double r = -9;
        CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, NULL, 0), MO_EINVAL);
        CU_ASSERT_EQUAL(r, -9);
        if (!strstr(mo_last_error(), c[i].want))
            tu_report("\"%s\": %s", c[i].completion, mo_last_error());
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), c[i].want));
        CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), p));
    }
    /* a NaN in a group fails the group, naming the sample */
    reward_input_t g[3];
    reward_input_init(&g[0], "p", "a", "");
    reward_input_init(&g[1], "p", "b", "");
    reward_input_init(&g[2], "p", "nan", "");
    double r[3];
    CU_ASSERT_EQUAL(reward_fn_score_group(fn, g, 3, r, NULL, NULL, 0), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "sample 2 of 3"));
    reward_fn_destroy(&fn);
}

static void test_holder_plugin_swap(void) {
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("constant:value=3", &fn), 0);
    reward_holder_t *h;
    CU_ASSERT_EQUAL_FATAL(reward_holder_new(&fn, 1, &h), 0);
    uint64_t v = 0;
    char p[4200];
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "", bad_path("abi", p, sizeof p), 0, &v),
                    MO_EUNSUPPORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "version 1 stays in place"));
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "keyword=zz", example_path(), 0, &v), 0);
    CU_ASSERT_EQUAL(v, 2);
    reward_input_t in[2];
    reward_input_init(&in[0], "p", "zz top", "");
    reward_input_init(&in[1], "p", "top", "");
    double r[2];
    char det[2][REWARD_DETAIL_CAP];
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, &det[0][0], REWARD_DETAIL_CAP, &v), 0);
    CU_ASSERT_EQUAL(v, 2);
    CU_ASSERT_EQUAL(r[0], 1.0);
    CU_ASSERT_EQUAL(r[1], 0.0);
    CU_ASSERT_STRING_EQUAL(det[1], "no \"zz\"");
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=4", NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 3);
    CU_ASSERT(unloaded(example_path()));
    reward_holder_destroy(&h);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"example plugin scores", test_example_scores},
        {"bad path", test_bad_path},
        {"missing symbol and ABI version", test_missing_symbol_and_abi},
        {"init failure", test_init_failure},
        {"misbehaving score", test_misbehaving_score},
        {"holder swaps to and from a plugin", test_holder_plugin_swap},
        CU_TEST_INFO_NULL,
    };
    return tu_main("reward_plugin", tests);
}
