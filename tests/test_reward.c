/* Tests of reward: every built-in verifier on worked examples (number formats,
 * extraction, regex), the spec grammar and its column-naming errors, weighted
 * sums, non-finite rejection, group scoring, and holder swaps (versions, a
 * failed swap keeps the old function, concurrent scoring never mixes
 * versions within a group). */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "reward/reward.h"
#include "tests/testutil.h"

/* Scores one completion of length len under spec; NAN when anything fails. */
static double score_n(const char *spec, const char *completion, size_t len, const char *answer,
                      char *detail) {
    reward_fn_t *fn = NULL;
    if (reward_fn_parse(spec, &fn) < 0) {
        tu_report("parse \"%s\": %s", spec, mo_last_error());
        return NAN;
    }
    reward_input_t in;
    reward_input_init(&in, "prompt", completion, answer);
    in.completion_len = len;
    double r = NAN;
    char d[REWARD_DETAIL_CAP];
    if (reward_fn_score(fn, &in, &r, NULL, d, sizeof d) < 0) {
        tu_report("score \"%s\" on \"%s\": %s", spec, completion, mo_last_error());
        r = NAN;
    }
    if (detail)
        strcpy(detail, d);
    reward_fn_destroy(&fn);
    CU_ASSERT_PTR_NULL(fn);
    return r;
}

static double score(const char *spec, const char *completion, const char *answer) {
    return score_n(spec, completion, strlen(completion), answer, NULL);
}

/* A spec that must fail to parse with MO_EINVAL and a message holding want. */
static void parse_fails(const char *spec, const char *want) {
    reward_fn_t *fn = (reward_fn_t *)0x1;
    mo_clear_error();
    int rc = reward_fn_parse(spec, &fn);
    CU_ASSERT_EQUAL(rc, MO_EINVAL);
    CU_ASSERT_PTR_NULL(fn);
    if (!strstr(mo_last_error(), want))
        tu_report("spec \"%s\": message \"%s\" lacks \"%s\"", spec, mo_last_error(), want);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), want));
}

typedef struct case_ {
    const char *spec, *completion, *answer;
    double want;
} case_t;

static void run_cases(const case_t *c, int n) {
    for (int i = 0; i < n; i++) {
        double r = score(c[i].spec, c[i].completion, c[i].answer);
        if (!(r == c[i].want))
            tu_report("case %d: %s on \"%s\" (answer \"%s\"): got %g, want %g", i, c[i].spec,
                      c[i].completion, c[i].answer, r, c[i].want);
        CU_ASSERT_EQUAL(r, c[i].want);
    }
}

static void test_exact(void) {
    static const case_t c[] = {
        {"exact", "  42 \n", "42", 1},
        {"exact", "42", " 42\n", 1},
        {"exact", "43", "42", 0},
        {"exact", "Paris", "paris", 0},
        {"exact:icase=1", "Paris", "paris", 1},
        {"exact:extract=answer", "thinking...\nAnswer: Paris.", "Paris", 1},
        {"exact:extract=answer", "answer: Rome\nno wait, ANSWER:  Paris \n", "Paris", 1},
        {"exact:extract=answer", "Paris", "Paris", 0}, /* no marker */
        {"exact:extract=hash", "3 + 4 = 7\n#### 7", "7", 1},
        {"exact:extract=hash", "#### 1,234\n", "1,234", 1},
        {"exact:extract=boxed", "so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1},
        {"exact:extract=boxed", "\\boxed{1} then \\boxed{ {a}b }", "{a}b", 1},
        {"exact:extract=boxed", "\\boxed{unclosed", "unclosed", 0},
        {"exact:extract=last_number", "I think 12, no: 13.", "13", 1},
        {"exact:extract=last_number", "I think 12, no: 13.", "12", 0},
        {"exact:extract=auto", "#### 5 and \\boxed{6}", "6", 1},
        {"exact:extract=auto", "blah #### 5", "5", 1},
        {"exact:extract=auto", "just 5", "just 5", 1},
    };
    run_cases(c, (int)(sizeof c / sizeof c[0]));
    char d[REWARD_DETAIL_CAP];
    CU_ASSERT_EQUAL(score_n("exact:extract=boxed", "none here", 9, "x", d), 0.0);
    CU_ASSERT_PTR_NOT_NULL(strstr(d, "boxed"));
    CU_ASSERT_EQUAL(score_n("exact", "41", 2, "42", d), 0.0);
    CU_ASSERT_STRING_EQUAL(d, "no match: got \"41\", want \"42\"");
}

static void test_numeric_formats(void) {
    static const case_t c[] = {
        {"numeric", "The answer is 1,234.", "1234", 1},
        {"numeric", "1234", "1,234", 1},
        {"numeric", "total: $1,000,000", "1000000", 1},
        {"numeric", "-5", "-5", 1},
        {"numeric",
         "x = \xe2\x88\x92"
         "5",
         "-5", 1}, /* U+2212 minus sign */
        {"numeric", "so +7", "7", 1},
        {"numeric", "5-3", "3", 1}, /* '-' after a digit is not a sign */
        {"numeric", "5-3", "-3", 0},
        {"numeric", "1,23", "23", 1},      /* not a thousands group */
        {"numeric", "1234,567", "567", 1}, /* a first group of 4 digits takes no commas */
        {"numeric", "12,345,6", "6", 1},
        {"numeric", "1,234.5", "1234.5", 1},
        {"numeric", "about .5", "0.5", 1},
        {"numeric", "1e-3", "0.001", 1},
        {"numeric", "3e", "3", 1},
        {"numeric", "3/4", "0.75", 1},
        {"numeric", "-3/4", "-0.75", 1},
        {"numeric", "3/4", "3/4", 1},
        {"numeric:frac=0", "3/4", "0.75", 0}, /* reads 4 */
        {"numeric", "it is \\frac{3}{4}", "0.75", 1},
        {"numeric:extract=boxed", "\\boxed{\\dfrac{-1}{8}} and 7", "-0.125", 1},
        {"numeric", "7/0", "0", 1}, /* no fraction: 7 then 0 */
        {"numeric", "x2", "2", 1},
        {"numeric", "none", "1", 0},
        {"numeric:extract=hash", "12 apples... #### 72", "72", 1},
        {"numeric:extract=hash", "12 apples... #### 7 dollars", "7", 1},
        {"numeric:extract=none", "42 apples", "42", 0},
        {"numeric:extract=none", " 42 \n", "42", 1},
        {"numeric", "3.1416", "3.14159", 0},
        {"numeric:tol=1e-3", "3.1416", "3.14159", 1},
        {"numeric:tol=0,rel=1e-4", "3.1416", "3.14159", 1},
        {"numeric:tol=0,rel=1e-6", "3.1416", "3.14159", 0},
        {"numeric:tol=0", "0.1", "0.1", 1},
        {"numeric", "1.0000001", "1", 1},
        {"numeric", "1.00001", "1", 0},
    };
    run_cases(c, (int)(sizeof c / sizeof c[0]));
    char d[REWARD_DETAIL_CAP];
    CU_ASSERT_EQUAL(score_n("numeric", "eleven", 6, "11", d), 0.0);
    CU_ASSERT_PTR_NOT_NULL(strstr(d, "no number"));
    CU_ASSERT_EQUAL(score_n("numeric", "11.0", 4, "11", d), 1.0);
    CU_ASSERT_STRING_EQUAL(d, "match: got 11, want 11");
}

/* An answer without a number is a data error, not a zero reward. */
static void test_numeric_bad_answer(void) {
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("numeric", &fn), 0);
    reward_input_t in;
    reward_input_init(&in, "p", "42", "forty-two?");
    double r = -7;
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, NULL, 0), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "holds no number"));
    CU_ASSERT_EQUAL(r, -7);
    reward_fn_destroy(&fn);
}

static void test_regex_format(void) {
    static const case_t c[] = {
        {"regex:pattern=^\\d+$", "123", "", 1},
        {"regex:pattern=^\\d+$", "12a", "", 0},
        {"regex:pattern=\\d+", "ab12", "", 1},
        {"regex:pattern=\\d+,full=1", "ab12", "", 0},
        {"format:pattern=\\d+", "123", "", 1},
        {"format:pattern=\\d+", "123abc", "", 0},
        {"format:pattern=\\d+,full=0", "123abc", "", 1},
        {"regex:pattern=hello,icase=1", "HeLLo there", "", 1},
        {"regex:pattern=hello", "HeLLo there", "", 0},
        {"regex:pattern=^b$", "a\nb\nc", "", 0},
        {"regex:pattern=^b$,multiline=1", "a\nb\nc", "", 1},
        {"regex:pattern=a.b", "a\nb", "", 0},
        {"regex:pattern=a.b,dotall=1", "a\nb", "", 1},
        {"regex:pattern=\"a{1,3}b\"", "xaab", "", 1},
        {"format:pattern=\"say \\\"hi\\\"\"", "say \"hi\"", "", 1},
        {"regex:pattern=\"\\\\d\"", "\\d", "", 0}, /* \\ unescapes to one backslash: \d */
        {"regex:pattern=\\x{e9}", "caf\xc3\xa9", "", 1},
    };
    run_cases(c, (int)(sizeof c / sizeof c[0]));
    /* invalid UTF-8 and NUL bytes in a completion are matched, not errors */
    CU_ASSERT_EQUAL(score_n("regex:pattern=\\d+", "\xff\xfe 12", 5, "", NULL), 1.0);
    CU_ASSERT_EQUAL(score_n("regex:pattern=cd", "ab\0cd", 5, "", NULL), 1.0);
    CU_ASSERT_EQUAL(score_n("regex:pattern=cd", "ab\0cd", 2, "", NULL), 0.0);
}

static void test_length_penalty(void) {
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("length_penalty:max=200,coef=0.01", &fn), 0);
    reward_input_t in;
    reward_input_init(&in, "p", "some text", "");
    double r = NAN;
    in.completion_tokens = 250;
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, NULL, 0), 0);
    CU_ASSERT_DOUBLE_EQUAL(r, -0.5, 1e-12);
    in.completion_tokens = 200;
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, NULL, 0), 0);
    CU_ASSERT_EQUAL(r, 0.0);
    in.completion_tokens = -1; /* unknown */
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, NULL, 0), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "unit=bytes"));
    reward_fn_destroy(&fn);
    CU_ASSERT_DOUBLE_EQUAL(score("length_penalty:max=4,coef=0.5,unit=bytes", "123456789", ""), -2.5,
                           1e-12);
}

static void test_task_verifiers(void) {
    static const case_t c[] = {
        {"arith_exact", "357", "357", 1},    {"arith_exact", " 357 \nmore text", "357", 1},
        {"arith_exact", "0357", "357", 0},   {"arith_exact", "35", "357", 0},
        {"arith_exact", "3570", "357", 0},   {"arith_exact", "-12", "-12", 1},
        {"arith_exact", "\n357", "357", 0}, /* the first line is empty */
        {"sort_exact", "1234", "1234", 1},   {"sort_exact", "1243", "1234", 0},
        {"sort_exact", "abcd\n", "abcd", 1},
    };
    run_cases(c, (int)(sizeof c / sizeof c[0]));
    char d[REWARD_DETAIL_CAP];
    CU_ASSERT_EQUAL(score_n("sort_exact", "1243", 4, "1234", d), 0.0);
    CU_ASSERT_PTR_NOT_NULL(strstr(d, "same items, wrong order"));
    CU_ASSERT_EQUAL(score_n("sort_exact", "1235", 4, "1234", d), 0.0);
    CU_ASSERT_PTR_NOT_NULL(strstr(d, "different items"));
    /* a record without an answer cannot be verified */
    CU_ASSERT(isnan(score("arith_exact", "357", "")));
    CU_ASSERT_PTR_NOT_NULL(
        strstr(mo_last_error(), "arith_exact: needs an answer, and the record has none"));
}

static void test_spec_grammar(void) {
    /* spaces around every token; bare values keep a '+' that starts no term */
    CU_ASSERT_EQUAL(score("  numeric : tol = 0.5 , rel = 0 ", "3.4", "3"), 1.0);
    CU_ASSERT_EQUAL(score("regex:pattern=^\\d+$ + 0.5*constant", "12", ""), 1.5);
    CU_ASSERT_EQUAL(score("regex:pattern=^a+b$", "aab", ""), 1.0);
    CU_ASSERT_EQUAL(score("regex:pattern=x+constant", "x+constant", ""), 2.0);
    CU_ASSERT_EQUAL(score("regex:pattern=\"x+constant\"", "xxconstant", ""), 1.0);

    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("0.8*numeric+0.2*format:pattern=\\d+", &fn), 0);
    CU_ASSERT_STRING_EQUAL(reward_fn_describe(fn), "0.8*numeric+0.2*format:pattern=\\d+");
    reward_fn_destroy(&fn);

    parse_fails("", "empty");
    parse_fails("   ", "empty");
    parse_fails("foo", "column 1: unknown reward function 'foo' (built-ins: exact, numeric");
    parse_fails("numeric:tol=abc", "column 9: numeric: option tol: expected a finite number");
    parse_fails("numeric:tolerance=1",
                "column 9: numeric: unknown option 'tolerance' (options: tol");
    parse_fails("numeric:tol=-1", "column 9: numeric: option tol: must be >= 0");
    parse_fails("0.8 numeric", "column 5: expected '*' after the weight 0.8");
    parse_fails("0.8*numeric+", "column 13: expected a reward function name, got the end");
    parse_fails("numeric + + exact", "column 11: expected a reward function name, got '+'");
    parse_fails("numeric:,tol=1", "column 9: expected an option name, got ','");
    parse_fails("numeric:tol", "column 12: expected '=' after option 'tol'");
    parse_fails("numeric:", "column 9: expected an option name, got the end");
    parse_fails("exact:extract=\"boxed", "column 15: unterminated quote");
    parse_fails("numeric:tol=1,tol=2", "column 15: option 'tol' given twice");
    parse_fails("exact foo", "column 7: expected '+' or the end of the spec, got 'f'");
    parse_fails("exact:extract=first", "column 7: exact: option extract: expected one of none, "
                                       "last_number, answer, hash, boxed, auto");
    parse_fails("exact:icase=maybe", "column 7: exact: option icase: expected 1/0");
    parse_fails("1e999*exact", "column 1: weight is not finite");
    parse_fails("regex:icase=1", "regex: option pattern is required");
    parse_fails("regex:pattern=ab(c", "column 7: regex: option pattern: missing closing "
                                      "parenthesis at pattern offset 4 (column 19)");
    parse_fails("arith_exact:x=1", "column 13: arith_exact: unknown option 'x' (options: none)");
    parse_fails("constant:value=nan", "option value: expected a finite number");
    parse_fails("plugin:args=x", "option path is required");
}

static void test_weighted_sum(void) {
    const char *spec = "0.8*numeric + 0.2*format:pattern=\"^.*#### -?\\d+$\"";
    CU_ASSERT_DOUBLE_EQUAL(score(spec, "work #### 42", "42"), 1.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(score(spec, "work #### 41", "42"), 0.2, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(score(spec, "42", "42"), 0.8, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(score(spec, "none", "42"), 0.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(score("exact + -0.25*constant", "a", "a"), 0.75, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(score("2*exact", "a", "a"), 2.0, 1e-12);
    char d[REWARD_DETAIL_CAP];
    score_n(spec, "work #### 41", 12, "42", d);
    CU_ASSERT_STRING_EQUAL(d, "0.8*numeric=0 (no match: got 41, want 42); "
                              "0.2*format=1 (match at byte 0)");
    /* a detail buffer too small is cut, never overrun */
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse(spec, &fn), 0);
    reward_input_t in;
    reward_input_init(&in, "p", "work #### 41", "42");
    char small[12];
    memset(small, 'Z', sizeof small);
    double r;
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in, &r, NULL, small, 8), 0);
    CU_ASSERT_EQUAL(strlen(small), 7);
    CU_ASSERT_EQUAL(small[8], 'Z');
    reward_fn_destroy(&fn);
}

/* Parts: one per term, named after its function, valued before the weight. */
static void test_parts(void) {
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(
        reward_fn_parse("0.5*numeric + 0.25*regex:pattern=x + regex:pattern=y + exact", &fn), 0);
    CU_ASSERT_EQUAL(reward_fn_n_parts(fn), 4);
    CU_ASSERT_STRING_EQUAL(reward_fn_part_name(fn, 0), "numeric");
    CU_ASSERT_STRING_EQUAL(reward_fn_part_name(fn, 1), "regex");
    CU_ASSERT_STRING_EQUAL(reward_fn_part_name(fn, 2), "regex#2");
    CU_ASSERT_STRING_EQUAL(reward_fn_part_name(fn, 3), "exact");
    CU_ASSERT_PTR_NULL(reward_fn_part_name(fn, 4));
    reward_input_t in[2];
    reward_input_init(&in[0], "p", "x 7", "7");
    reward_input_init(&in[1], "p", "y", "5");
    double r[2], parts[2][4];
    for (int i = 0; i < 8; i++)
        parts[i / 4][i % 4] = NAN;
    CU_ASSERT_EQUAL_FATAL(reward_fn_score_group(fn, in, 2, r, &parts[0][0], NULL, 0), 0);
    CU_ASSERT_DOUBLE_EQUAL(r[0], 0.75, 1e-12);
    CU_ASSERT_EQUAL(parts[0][0], 1.0);
    CU_ASSERT_EQUAL(parts[0][1], 1.0);
    CU_ASSERT_EQUAL(parts[0][2], 0.0);
    CU_ASSERT_EQUAL(parts[0][3], 0.0);
    CU_ASSERT_DOUBLE_EQUAL(r[1], 1.0, 1e-12); /* only the y pattern */
    CU_ASSERT_EQUAL(parts[1][0], 0.0);
    CU_ASSERT_EQUAL(parts[1][1], 0.0);
    CU_ASSERT_EQUAL(parts[1][2], 1.0);
    CU_ASSERT_EQUAL(parts[1][3], 0.0);
    reward_fn_destroy(&fn);
    /* a single function is its own single part */
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("constant:value=3", &fn), 0);
    CU_ASSERT_EQUAL(reward_fn_n_parts(fn), 1);
    double one = NAN, part = NAN;
    CU_ASSERT_EQUAL(reward_fn_score(fn, &in[0], &one, &part, NULL, 0), 0);
    CU_ASSERT_EQUAL(part, 3.0);
    reward_fn_destroy(&fn);
}

static void test_non_finite(void) {
    CU_ASSERT(isnan(score("1e308*constant:value=1e308", "x", "")));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "not finite"));
    CU_ASSERT(isnan(score("length_penalty:coef=1e308,unit=bytes", "0123456789", "")));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "non-finite reward"));
    CU_ASSERT(isnan(score("exact + length_penalty:coef=1e308,unit=bytes", "0123", "")));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "length_penalty: non-finite reward -inf"));
}

static void test_group(void) {
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("numeric", &fn), 0);
    const char *comp[4] = {"7", "the answer is 7", "8", "seven"};
    reward_input_t in[4];
    for (int i = 0; i < 4; i++) {
        reward_input_init(&in[i], "3+4=", comp[i], "7");
        in[i].sample_index = i;
        in[i].group_size = 4;
    }
    double r[4];
    char det[4][REWARD_DETAIL_CAP];
    for (int i = 0; i < 4; i++)
        r[i] = NAN;
    CU_ASSERT_EQUAL(reward_fn_score_group(fn, in, 4, r, NULL, &det[0][0], REWARD_DETAIL_CAP), 0);
    CU_ASSERT_EQUAL(r[0], 1.0);
    CU_ASSERT_EQUAL(r[1], 1.0);
    CU_ASSERT_EQUAL(r[2], 0.0);
    CU_ASSERT_EQUAL(r[3], 0.0);
    CU_ASSERT_STRING_EQUAL(det[2], "no match: got 8, want 7");
    CU_ASSERT_PTR_NOT_NULL(strstr(det[3], "no number"));
    CU_ASSERT_EQUAL(reward_fn_score_group(fn, in, 4, r, NULL, NULL, 0), 0);
    reward_fn_destroy(&fn);

    /* one failing sample fails the group and is named */
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("length_penalty", &fn), 0);
    for (int i = 0; i < 4; i++)
        in[i].completion_tokens = 10;
    in[2].completion_tokens = -1;
    CU_ASSERT_EQUAL(reward_fn_score_group(fn, in, 4, r, NULL, NULL, 0), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "sample 2 of 4"));
    reward_fn_destroy(&fn);
}

static void test_builtin_list(void) {
    int n = reward_builtin_count();
    CU_ASSERT(n >= 9);
    bool seen_numeric = false;
    for (int i = 0; i < n; i++) {
        CU_ASSERT_PTR_NOT_NULL(reward_builtin_name(i));
        CU_ASSERT(strlen(reward_builtin_summary(i)) > 10);
        seen_numeric = seen_numeric || !strcmp(reward_builtin_name(i), "numeric");
    }
    CU_ASSERT(seen_numeric);
    CU_ASSERT_PTR_NULL(reward_builtin_name(n));
}

/* ------------------------------------------------------------------------
 * Holder
 * ---------------------------------------------------------------------- */

static reward_holder_t *holder_from(const char *spec) {
    reward_fn_t *fn;
    if (reward_fn_parse(spec, &fn) < 0)
        return NULL;
    reward_holder_t *h;
    if (reward_holder_new(&fn, 1, &h) < 0)
        return NULL;
    CU_ASSERT_PTR_NULL(fn);
    return h;
}

static void test_swap_versions(void) {
    reward_holder_t *h = holder_from("exact");
    CU_ASSERT_PTR_NOT_NULL_FATAL(h);
    CU_ASSERT_EQUAL(reward_holder_version(h), 1);
    reward_input_t in[2];
    reward_input_init(&in[0], "p", "a", "a");
    reward_input_init(&in[1], "p", "b", "a");
    double r[2];
    uint64_t v = 0;
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 1);
    CU_ASSERT_EQUAL(r[0], 1.0);
    CU_ASSERT_EQUAL(r[1], 0.0);

    uint64_t nv = 0;
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=0.5", "", 0, &nv), 0);
    CU_ASSERT_EQUAL(nv, 2);
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 2);
    CU_ASSERT_EQUAL(r[0], 0.5);
    CU_ASSERT_EQUAL(r[1], 0.5);

    /* a failed build leaves version 2 in place and says why */
    nv = 99;
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "numeric:tol=x", NULL, 0, &nv), MO_EINVAL);
    CU_ASSERT_EQUAL(nv, 99);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "version 2 stays in place"));
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "column 9"));
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "x", "/nonexistent/libnope.so", 0, &nv), MO_EIO);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "/nonexistent/libnope.so"));
    CU_ASSERT_EQUAL(reward_holder_version(h), 2);
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 2);
    CU_ASSERT_EQUAL(r[1], 0.5);
    char desc[64];
    reward_holder_describe(h, desc, sizeof desc, &v);
    CU_ASSERT_STRING_EQUAL(desc, "constant:value=0.5");
    CU_ASSERT_EQUAL(v, 2);

    /* explicit versions, as the job numbers them: only newer ones install */
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=0.25", "", 7, &nv), 0);
    CU_ASSERT_EQUAL(nv, 7);
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=9", "", 7, &nv), MO_ESTATE);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "version 7 stays in place: reward version 7 "
                                                   "is not newer than version 7 in place"));
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=9", "", 3, &nv), MO_ESTATE);
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 7);
    CU_ASSERT_EQUAL(r[0], 0.25);
    reward_fn_t *fn;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("constant:value=8", &fn), 0);
    CU_ASSERT_EQUAL(reward_holder_swap(h, &fn, 2, &nv), MO_ESTATE);
    CU_ASSERT_PTR_NOT_NULL(fn); /* still the caller's */
    CU_ASSERT_EQUAL(reward_holder_swap(h, &fn, 0, &nv), 0);
    CU_ASSERT_PTR_NULL(fn);
    CU_ASSERT_EQUAL(nv, 8);

    /* a lease keeps its function and version across swaps */
    reward_lease_t lease;
    reward_holder_acquire(h, &lease);
    CU_ASSERT_EQUAL(lease.version, 8);
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=10", "", 0, &nv), 0);
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "constant:value=11", "", 0, &nv), 0);
    CU_ASSERT_EQUAL(nv, 10);
    CU_ASSERT_EQUAL(reward_fn_score(lease.fn, &in[0], &r[0], NULL, NULL, 0), 0);
    CU_ASSERT_EQUAL(r[0], 8.0);
    CU_ASSERT_STRING_EQUAL(reward_fn_describe(lease.fn), "constant:value=8");
    reward_holder_release(h, &lease);
    CU_ASSERT_PTR_NULL(lease.fn);
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), 0);
    CU_ASSERT_EQUAL(v, 10);
    CU_ASSERT_EQUAL(r[0], 11.0);

    /* a scoring failure reports the version that failed */
    CU_ASSERT_EQUAL(reward_holder_swap_config(h, "length_penalty", "", 0, &nv), 0);
    CU_ASSERT_EQUAL(reward_holder_score_group(h, in, 2, r, NULL, 0, &v), MO_EINVAL);
    CU_ASSERT_EQUAL(v, 11);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "reward version 11: sample 0 of 2"));
    reward_holder_destroy(&h);
    CU_ASSERT_PTR_NULL(h);

    /* a holder can start at the job's version; 0 is no version */
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse("exact", &fn), 0);
    CU_ASSERT_EQUAL(reward_holder_new(&fn, 0, &h), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(fn);
    CU_ASSERT_EQUAL_FATAL(reward_holder_new(&fn, 42, &h), 0);
    CU_ASSERT_EQUAL(reward_holder_version(h), 42);
    reward_holder_destroy(&h);
    CU_ASSERT_PTR_NULL(h);
}

/* Version v of the holder scores every sample with v (plus a zero-weight
 * regex so that a group takes a while). The swapper paces itself by the
 * scorers' progress, about two swaps per group, so swaps land mid-group. */
enum { N_SWAPS = 60, GROUP = 32, SCORERS = 2, TEXT_LEN = 120 };
static char g_text[TEXT_LEN + 1];

typedef struct race {
    reward_holder_t *h;
    int done;          /* set by the swapper under lock */
    long total_groups; /* scored so far, under lock */
    pthread_mutex_t lock;
    int bad_swaps;
    long overlapped[SCORERS]; /* groups during which the version changed */
    long groups[SCORERS], mixed[SCORERS], wrong_version[SCORERS], failures[SCORERS];
    uint64_t max_version[SCORERS];
} race_t;

typedef struct scorer_arg {
    race_t *race;
    int id;
} scorer_arg_t;

static void *swapper(void *p) {
    race_t *race = p;
    for (int v = 2; v <= N_SWAPS + 1; v++) {
        for (;;) {
            pthread_mutex_lock(&race->lock);
            long g = race->total_groups;
            pthread_mutex_unlock(&race->lock);
            if (2 * g >= v - 2)
                break;
            sched_yield();
        }
        char spec[96];
        snprintf(spec, sizeof spec, "constant:value=%d + 0*regex:pattern=(?:a|b)*?\\d", v);
        uint64_t got = 0;
        if (reward_holder_swap_config(race->h, spec, "", 0, &got) < 0 || got != (uint64_t)v)
            race->bad_swaps++;
    }
    pthread_mutex_lock(&race->lock);
    race->done = 1;
    pthread_mutex_unlock(&race->lock);
    return NULL;
}

static void *scorer(void *p) {
    scorer_arg_t *a = p;
    race_t *race = a->race;
    reward_input_t in[GROUP];
    for (int i = 0; i < GROUP; i++) {
        reward_input_init(&in[i], "p", g_text, "");
        in[i].sample_index = i;
        in[i].group_size = GROUP;
    }
    for (;;) {
        pthread_mutex_lock(&race->lock);
        int done = race->done;
        pthread_mutex_unlock(&race->lock);
        double r[GROUP];
        uint64_t v = 0, before = reward_holder_version(race->h);
        int rc = reward_holder_score_group(race->h, in, GROUP, r, NULL, 0, &v);
        pthread_mutex_lock(&race->lock);
        race->total_groups++;
        pthread_mutex_unlock(&race->lock);
        if (reward_holder_version(race->h) != before)
            race->overlapped[a->id]++;
        if (rc < 0) {
            race->failures[a->id]++;
        } else {
            race->groups[a->id]++;
            for (int i = 1; i < GROUP; i++)
                if (r[i] != r[0])
                    race->mixed[a->id]++;
            if (r[0] != (double)v)
                race->wrong_version[a->id]++;
            if (v > race->max_version[a->id])
                race->max_version[a->id] = v;
        }
        if (done)
            return NULL;
    }
}

static void test_concurrent_swap(void) {
    memset(g_text, 'a', TEXT_LEN);
    race_t race;
    memset(&race, 0, sizeof race);
    race.h = holder_from("constant:value=1 + 0*regex:pattern=(?:a|b)*?\\d");
    CU_ASSERT_PTR_NOT_NULL_FATAL(race.h);
    pthread_mutex_init(&race.lock, NULL);
    pthread_t sw, sc[SCORERS];
    scorer_arg_t args[SCORERS];
    for (int i = 0; i < SCORERS; i++) {
        args[i] = (scorer_arg_t){&race, i};
        CU_ASSERT_EQUAL_FATAL(pthread_create(&sc[i], NULL, scorer, &args[i]), 0);
    }
    CU_ASSERT_EQUAL_FATAL(pthread_create(&sw, NULL, swapper, &race), 0);
    pthread_join(sw, NULL);
    for (int i = 0; i < SCORERS; i++)
        pthread_join(sc[i], NULL);
    CU_ASSERT_EQUAL(race.bad_swaps, 0);
    CU_ASSERT_EQUAL(reward_holder_version(race.h), N_SWAPS + 1);
    for (int i = 0; i < SCORERS; i++) {
        CU_ASSERT(race.groups[i] >= 1);
        printf("[scorer %d: %ld groups, %ld with a swap in flight] ", i, race.groups[i],
               race.overlapped[i]);
        CU_ASSERT_EQUAL(race.failures[i], 0);
        CU_ASSERT_EQUAL(race.mixed[i], 0);
        CU_ASSERT_EQUAL(race.wrong_version[i], 0);
        /* each scorer's last group started after the final swap */
        CU_ASSERT_EQUAL(race.max_version[i], N_SWAPS + 1);
    }
    pthread_mutex_destroy(&race.lock);
    reward_holder_destroy(&race.h);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"exact and extraction", test_exact},
        {"numeric formats and tolerances", test_numeric_formats},
        {"numeric bad answer", test_numeric_bad_answer},
        {"regex and format", test_regex_format},
        {"length penalty", test_length_penalty},
        {"task verifiers", test_task_verifiers},
        {"spec grammar and errors", test_spec_grammar},
        {"weighted sums", test_weighted_sum},
        {"parts", test_parts},
        {"non-finite rewards", test_non_finite},
        {"group scoring", test_group},
        {"built-in list", test_builtin_list},
        {"swap versions and failures", test_swap_versions},
        {"concurrent scoring and swaps", test_concurrent_swap},
        CU_TEST_INFO_NULL,
    };
    return tu_main("reward", tests);
}
