/* Tests of dataset: JSONL parsing (fields, extras, blank lines, BOM, CRLF),
 * shuffle determinism and per-epoch difference, the eval split, cursor save
 * and restore, malformed lines (each error with its line, or skipped and
 * counted), and tasks and the config as sources. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "core/status.h"
#include "learner/dataset.h"
#include "tests/testutil.h"

static char g_dir[4096];

/* Writes text to <tmpdir>/name and returns the path (static buffer). */
static const char *write_file(const char *name, const char *text) {
    static char path[4200];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* n records {"prompt": "p<i>", "answer": "<i>"}. */
static const char *write_numbered(const char *name, int n) {
    size_t cap = (size_t)n * 48 + 1, len = 0;
    char *text = malloc(cap);
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(text + len, cap - len,
                                "{\"prompt\": \"p%d\", \"answer\": \"%d\"}\n", i, i);
    const char *p = write_file(name, text);
    free(text);
    return p;
}

static dataset_opts_t opts(uint64_t seed, bool shuffle, int64_t eval) {
    dataset_opts_t o = {seed, shuffle, false, eval};
    return o;
}

static const char *extra(const dataset_item_t *it, const char *key) {
    for (size_t i = 0; i < it->n_extra; i++)
        if (!strcmp(it->extra[i].key, key))
            return it->extra[i].value;
    return NULL;
}

static void test_parse(void) {
    const char *path = write_file(
        "a.jsonl", "\xef\xbb\xbf{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n"
                   "   \n"
                   "{\"prompt\": \"caf\\u00e9?\", \"answer\": \"Paris\", \"source\": \"geo\", "
                   "\"level\": 3, \"score\": 0.1, \"big\": 1e21, \"hard\": false}\r\n"
                   "{\"prompt\": \"no answer\"}\n"
                   "{\"answer\": 42, \"prompt\": \"num\"}");
    dataset_opts_t o = opts(1, false, 0);
    dataset_t *d = NULL;
    int rc = dataset_open_jsonl(path, &o, &d);
    if (rc < 0)
        tu_report("%s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(dataset_train_size(d), 4);
    CU_ASSERT_EQUAL(dataset_eval_size(d), 0);
    CU_ASSERT_PTR_NULL(dataset_verifier(d));
    const dataset_stats_t *st = dataset_stats(d);
    CU_ASSERT_EQUAL(st->lines, 5);
    CU_ASSERT_EQUAL(st->blank, 1);
    CU_ASSERT_EQUAL(st->records, 4);
    CU_ASSERT_EQUAL(st->skipped, 0);
    CU_ASSERT_STRING_EQUAL(st->first_error, "");

    dataset_item_t it;
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "2+2=");
    CU_ASSERT_STRING_EQUAL(it.answer, "4");
    CU_ASSERT_EQUAL(it.n_extra, 0);
    CU_ASSERT_EQUAL(it.id, 0);
    CU_ASSERT_EQUAL(it.line, 1);
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "caf\xc3\xa9?");
    CU_ASSERT_STRING_EQUAL(it.answer, "Paris");
    CU_ASSERT_EQUAL(it.line, 3);
    CU_ASSERT_EQUAL(it.n_extra, 5);
    CU_ASSERT_STRING_EQUAL(extra(&it, "source"), "geo");
    CU_ASSERT_STRING_EQUAL(extra(&it, "level"), "3");
    CU_ASSERT_STRING_EQUAL(extra(&it, "score"), "0.1");
    CU_ASSERT_STRING_EQUAL(extra(&it, "big"), "1e+21");
    CU_ASSERT_STRING_EQUAL(extra(&it, "hard"), "false");
    CU_ASSERT_STRING_EQUAL(it.extra[0].key, "source"); /* file order */
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "no answer");
    CU_ASSERT_STRING_EQUAL(it.answer, "");
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.answer, "42");
    CU_ASSERT_EQUAL(it.id, 3);
    CU_ASSERT_EQUAL(it.line, 5);
    /* the end of epoch 0 wraps to epoch 1, in file order without shuffle */
    dataset_cursor_t c = dataset_tell(d);
    CU_ASSERT_EQUAL(c.epoch, 1);
    CU_ASSERT_EQUAL(c.pos, 0);
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "2+2=");
    dataset_destroy(&d);
    CU_ASSERT_PTR_NULL(d);
}

/* The ids of one epoch read through dataset_next. */
static void read_epoch(dataset_t *d, uint64_t *ids, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        dataset_item_t it;
        ids[i] = UINT64_MAX;
        CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
        ids[i] = it.id;
        char want[16];
        snprintf(want, sizeof want, "p%" PRIu64, it.id);
        CU_ASSERT_STRING_EQUAL(it.prompt, want);
    }
}

static bool is_perm(const uint64_t *ids, uint64_t n) {
    char seen[256] = {0};
    for (uint64_t i = 0; i < n; i++) {
        if (ids[i] >= n || seen[ids[i]])
            return false;
        seen[ids[i]] = 1;
    }
    return true;
}

static void test_shuffle(void) {
    enum { N = 50 };
    const char *path = write_numbered("n.jsonl", N);
    dataset_opts_t o = opts(7, true, 0);
    uint64_t e0[N], e1[N], again0[N], again1[N], other[N];
    dataset_t *d;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    read_epoch(d, e0, N);
    read_epoch(d, e1, N);
    dataset_destroy(&d);
    CU_ASSERT(is_perm(e0, N));
    CU_ASSERT(is_perm(e1, N));
    CU_ASSERT(memcmp(e0, e1, sizeof e0) != 0); /* each epoch its own order */
    int in_place = 0;
    for (int i = 0; i < N; i++)
        in_place += e0[i] == (uint64_t)i;
    CU_ASSERT(in_place < 10); /* shuffled, not file order */

    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    read_epoch(d, again0, N);
    read_epoch(d, again1, N);
    dataset_destroy(&d);
    CU_ASSERT(memcmp(e0, again0, sizeof e0) == 0); /* same seed, same orders */
    CU_ASSERT(memcmp(e1, again1, sizeof e1) == 0);

    o.seed = 8;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    read_epoch(d, other, N);
    dataset_destroy(&d);
    CU_ASSERT(memcmp(e0, other, sizeof e0) != 0);

    o.shuffle = false;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    read_epoch(d, e0, N);
    read_epoch(d, e1, N);
    dataset_destroy(&d);
    for (int i = 0; i < N; i++) {
        CU_ASSERT_EQUAL(e0[i], (uint64_t)i);
        CU_ASSERT_EQUAL(e1[i], (uint64_t)i);
    }
}

static void test_eval_split(void) {
    enum { N = 50, E = 10 };
    const char *path = write_numbered("e.jsonl", N);
    dataset_opts_t o = opts(3, true, E);
    dataset_t *d;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    CU_ASSERT_EQUAL(dataset_train_size(d), N - E);
    CU_ASSERT_EQUAL(dataset_eval_size(d), E);
    char is_eval[N] = {0};
    uint64_t prev = 0;
    for (uint64_t i = 0; i < E; i++) {
        dataset_item_t it;
        CU_ASSERT_EQUAL_FATAL(dataset_eval(d, i, &it), 0);
        CU_ASSERT(i == 0 || it.id > prev); /* file order */
        prev = it.id;
        is_eval[it.id] = 1;
    }
    dataset_item_t it;
    CU_ASSERT_EQUAL(dataset_eval(d, E, &it), MO_EINVAL);
    CU_ASSERT(!(is_eval[0] && is_eval[1] && is_eval[2] && is_eval[3])); /* not just the head */
    /* three epochs of training never yield an eval record, and cover the rest */
    for (int e = 0; e < 3; e++) {
        char seen[N] = {0};
        for (int i = 0; i < N - E; i++) {
            CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
            CU_ASSERT(!is_eval[it.id]);
            CU_ASSERT(!seen[it.id]);
            seen[it.id] = 1;
        }
    }
    dataset_destroy(&d);
    /* the split follows the seed, not the shuffle flag */
    o.shuffle = false;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    for (uint64_t i = 0; i < E; i++) {
        CU_ASSERT_EQUAL_FATAL(dataset_eval(d, i, &it), 0);
        CU_ASSERT(is_eval[it.id]);
    }
    dataset_destroy(&d);
    o.eval_size = N;
    CU_ASSERT_EQUAL(dataset_open_jsonl(path, &o, &d), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "leaves no training record of 50"));
    CU_ASSERT_PTR_NULL(d);
}

static void test_cursor(void) {
    enum { N = 30, READ = 40 };
    const char *path = write_numbered("c.jsonl", N);
    dataset_opts_t o = opts(5, true, 4);
    dataset_t *d, *r;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    dataset_item_t it;
    for (int i = 0; i < 2 * (N - 4) + 7; i++)
        CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    dataset_cursor_t c = dataset_tell(d);
    CU_ASSERT_EQUAL(c.epoch, 2);
    CU_ASSERT_EQUAL(c.pos, 7);
    dataset_item_t at;
    CU_ASSERT_EQUAL_FATAL(dataset_at(d, c, &at), 0);
    uint64_t want[READ];
    for (int i = 0; i < READ; i++) {
        CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
        want[i] = it.id;
    }
    CU_ASSERT_EQUAL(at.id, want[0]);
    /* a fresh dataset restored to the cursor continues identically */
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &r), 0);
    CU_ASSERT_EQUAL(dataset_fingerprint(r), dataset_fingerprint(d));
    CU_ASSERT_EQUAL_FATAL(dataset_seek(r, c), 0);
    for (int i = 0; i < READ; i++) {
        CU_ASSERT_EQUAL_FATAL(dataset_next(r, &it), 0);
        CU_ASSERT_EQUAL(it.id, want[i]);
    }
    /* the end of an epoch is the start of the next */
    dataset_cursor_t end = {1, N - 4}, start = {2, 0};
    CU_ASSERT_EQUAL(dataset_seek(r, end), 0);
    CU_ASSERT_EQUAL(dataset_tell(r).epoch, 2);
    CU_ASSERT_EQUAL(dataset_tell(r).pos, 0);
    CU_ASSERT_EQUAL_FATAL(dataset_next(r, &it), 0);
    CU_ASSERT_EQUAL_FATAL(dataset_at(r, start, &at), 0);
    CU_ASSERT_EQUAL(it.id, at.id);
    dataset_cursor_t past = {0, N - 3};
    CU_ASSERT_EQUAL(dataset_seek(r, past), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "past the 26 training records"));
    CU_ASSERT_EQUAL(dataset_at(r, end, &at), MO_EINVAL);
    dataset_destroy(&r);
    /* another file has another fingerprint */
    const char *other = write_numbered("c2.jsonl", N + 1);
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(other, &o, &r), 0);
    CU_ASSERT(dataset_fingerprint(r) != dataset_fingerprint(d));
    dataset_destroy(&r);
    dataset_destroy(&d);
}

static void expect_malformed(const char *line, const char *want) {
    char text[512];
    snprintf(text, sizeof text, "{\"prompt\": \"fine\"}\n%s\n{\"prompt\": \"also fine\"}\n", line);
    const char *path = write_file("bad.jsonl", text);
    dataset_opts_t o = opts(1, false, 0);
    dataset_t *d = (dataset_t *)0x1;
    int rc = dataset_open_jsonl(path, &o, &d);
    CU_ASSERT_EQUAL(rc, MO_EMALFORMED);
    CU_ASSERT_PTR_NULL(d);
    char full[4400];
    snprintf(full, sizeof full, "%s:2: %s", path, want);
    if (!strstr(mo_last_error(), full))
        tu_report("line %s: message \"%s\" lacks \"%s\"", line, mo_last_error(), full);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), full));
    /* skipped and counted when asked */
    o.skip_malformed = true;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    CU_ASSERT_EQUAL(dataset_stats(d)->records, 2);
    CU_ASSERT_EQUAL(dataset_stats(d)->skipped, 1);
    CU_ASSERT_PTR_NOT_NULL(strstr(dataset_stats(d)->first_error, full));
    dataset_destroy(&d);
}

static void test_malformed(void) {
    expect_malformed("{\"prompt\": \"a\", }", "invalid JSON near column 18");
    expect_malformed("{\"prompt\": \"a", "invalid JSON near column");
    expect_malformed("[1, 2]", "expected a JSON object, got an array");
    expect_malformed("\"text\"", "expected a JSON object, got a string");
    expect_malformed("{\"answer\": \"x\"}", "no \"prompt\" field");
    expect_malformed("{\"prompt\": 3}", "\"prompt\" must be a string, got a number");
    expect_malformed("{\"prompt\": \"\"}", "\"prompt\" is empty");
    expect_malformed("{\"prompt\": \"a\", \"answer\": null}",
                     "\"answer\" must be a string or a number, got null");
    expect_malformed("{\"prompt\": \"a\", \"answer\": true}",
                     "\"answer\" must be a string or a number, got a boolean");
    expect_malformed(
        "{\"prompt\": \"a\", \"meta\": {\"x\": 1}}",
        "field \"meta\" is an object; extra fields must be strings, numbers or booleans");
    expect_malformed("{\"prompt\": \"a\", \"tags\": []}", "field \"tags\" is an array");
    expect_malformed("{\"prompt\": \"a\", \"prompt\": \"b\"}", "field \"prompt\" appears twice");
    expect_malformed("{\"prompt\": \"a\"} x", "text after the JSON value at column 17");
    expect_malformed("{\"prompt\": \"a\"}{\"prompt\": \"b\"}",
                     "text after the JSON value at column 16");

    /* several bad lines: counted, the first one remembered */
    const char *path = write_file("mixed.jsonl", "{\"prompt\": \"a\"}\n"
                                                 "oops\n"
                                                 "{\"prompt\": \"b\"}\n"
                                                 "{\"prompt\": 1}\n"
                                                 "\n"
                                                 "{\"prompt\": \"c\", \"x\": null}\n");
    dataset_opts_t o = opts(1, false, 0);
    o.skip_malformed = true;
    dataset_t *d;
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(path, &o, &d), 0);
    const dataset_stats_t *st = dataset_stats(d);
    CU_ASSERT_EQUAL(st->lines, 6);
    CU_ASSERT_EQUAL(st->records, 2);
    CU_ASSERT_EQUAL(st->skipped, 3);
    CU_ASSERT_EQUAL(st->blank, 1);
    CU_ASSERT_PTR_NOT_NULL(strstr(st->first_error, "mixed.jsonl:2: invalid JSON"));
    dataset_item_t it;
    CU_ASSERT_EQUAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "a");
    CU_ASSERT_EQUAL(dataset_next(d, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "b");
    CU_ASSERT_EQUAL(it.line, 3);
    dataset_destroy(&d);

    /* nothing usable at all */
    path = write_file("allbad.jsonl", "nope\n[]\n");
    CU_ASSERT_EQUAL(dataset_open_jsonl(path, &o, &d), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "no records (2 lines, 2 skipped"));
    path = write_file("empty.jsonl", "");
    CU_ASSERT_EQUAL(dataset_open_jsonl(path, &o, &d), MO_EINVAL);
    char missing[4200];
    snprintf(missing, sizeof missing, "%s/does-not-exist.jsonl", g_dir);
    CU_ASSERT_EQUAL(dataset_open_jsonl(missing, &o, &d), MO_EIO);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "cannot open"));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), missing));
}

static void test_task_source(void) {
    task_opts_t t = task_opts_default(CFG_TASK_ARITH);
    dataset_opts_t o = opts(21, true, 16);
    dataset_t *d;
    CU_ASSERT_EQUAL_FATAL(dataset_open_task(&t, &o, &d), 0);
    CU_ASSERT_EQUAL(dataset_train_size(d), UINT64_MAX);
    CU_ASSERT_EQUAL(dataset_eval_size(d), 16);
    CU_ASSERT_STRING_EQUAL(dataset_verifier(d), "arith_exact");
    for (uint64_t i = 0; i < 20; i++) {
        dataset_item_t it;
        task_item_t want;
        CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
        CU_ASSERT_EQUAL_FATAL(task_generate(&t, 21, TASK_SPLIT_TRAIN, i, &want), 0);
        CU_ASSERT_STRING_EQUAL(it.prompt, want.prompt);
        CU_ASSERT_STRING_EQUAL(it.answer, want.answer);
        CU_ASSERT_EQUAL(it.id, i);
        CU_ASSERT_EQUAL(it.n_extra, 0);
    }
    dataset_item_t it;
    task_item_t want;
    CU_ASSERT_EQUAL_FATAL(dataset_eval(d, 15, &it), 0);
    CU_ASSERT_EQUAL_FATAL(task_generate(&t, 21, TASK_SPLIT_EVAL, 15, &want), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, want.prompt);
    CU_ASSERT_EQUAL(dataset_eval(d, 16, &it), MO_EINVAL);
    dataset_cursor_t c = dataset_tell(d);
    CU_ASSERT_EQUAL(c.epoch, 0);
    CU_ASSERT_EQUAL(c.pos, 20);
    dataset_cursor_t far = {0, 1000000};
    CU_ASSERT_EQUAL(dataset_seek(d, far), 0);
    CU_ASSERT_EQUAL_FATAL(dataset_next(d, &it), 0);
    CU_ASSERT_EQUAL_FATAL(task_generate(&t, 21, TASK_SPLIT_TRAIN, 1000000, &want), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, want.prompt);
    dataset_cursor_t bad = {1, 0};
    CU_ASSERT_EQUAL(dataset_seek(d, bad), MO_EINVAL);
    dataset_t *s;
    task_opts_t st = task_opts_default(CFG_TASK_SORT);
    CU_ASSERT_EQUAL_FATAL(dataset_open_task(&st, &o, &s), 0);
    CU_ASSERT(dataset_fingerprint(s) != dataset_fingerprint(d));
    CU_ASSERT_STRING_EQUAL(dataset_verifier(s), "sort_exact");
    dataset_destroy(&s);
    dataset_destroy(&d);
    /* an eval split that cannot exist fails at open */
    t.eval_permille = 0;
    CU_ASSERT_EQUAL(dataset_open_task(&t, &o, &d), MO_EINVAL);
    o.eval_size = 0;
    CU_ASSERT_EQUAL(dataset_open_task(&t, &o, &d), 0);
    dataset_destroy(&d);
}

static void test_config_source(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    dataset_t *d;
    CU_ASSERT_EQUAL_FATAL(dataset_open_config(&c, &d), 0);
    CU_ASSERT_STRING_EQUAL(dataset_verifier(d), "arith_exact");
    CU_ASSERT_EQUAL(dataset_eval_size(d), (uint64_t)c.data.eval_size);
    dataset_destroy(&d);
    const char *path = write_numbered("cfg.jsonl", 100);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.task", "jsonl"), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.path", path), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.eval_size", "10"), 0);
    CU_ASSERT_EQUAL_FATAL(dataset_open_config(&c, &d), 0);
    CU_ASSERT_EQUAL(dataset_train_size(d), 90);
    CU_ASSERT_PTR_NULL(dataset_verifier(d));
    dataset_destroy(&d);
    config_free(&c);
}

int main(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0) {
        fprintf(stderr, "no temporary directory\n");
        return 1;
    }
    CU_TestInfo tests[] = {
        {"parse fields and extras", test_parse}, {"shuffle per epoch", test_shuffle},
        {"eval split", test_eval_split},         {"cursor save and restore", test_cursor},
        {"malformed lines", test_malformed},     {"task source", test_task_source},
        {"config source", test_config_source},   CU_TEST_INFO_NULL,
    };
    int rc = tu_main("dataset", tests);
    tu_rmtree(g_dir);
    return rc;
}
