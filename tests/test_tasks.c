/* Tests of tasks: generation is deterministic and pinned, answers are right
 * for every generated problem, operands are uniform over their range, the
 * task verifiers accept the answer and reject wrong ones, train and eval never
 * share a problem, options are checked, and SFT pairs match the train split. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "learner/tasks.h"
#include "reward/reward.h"
#include "tests/testutil.h"

static int same_item(const task_item_t *a, const task_item_t *b) {
    return !strcmp(a->prompt, b->prompt) && !strcmp(a->answer, b->answer) && a->index == b->index;
}

static void test_determinism(void) {
    cfg_task_t kinds[2] = {CFG_TASK_ARITH, CFG_TASK_SORT};
    for (int k = 0; k < 2; k++) {
        task_opts_t o = task_opts_default(kinds[k]);
        int differ = 0;
        for (uint64_t i = 0; i < 200; i++) {
            task_item_t a, b, c;
            memset(&b, 0x5a, sizeof b);
            CU_ASSERT_EQUAL_FATAL(task_generate(&o, 1234, TASK_SPLIT_TRAIN, i, &a), 0);
            CU_ASSERT_EQUAL_FATAL(task_generate(&o, 1234, TASK_SPLIT_TRAIN, i, &b), 0);
            CU_ASSERT(same_item(&a, &b));
            CU_ASSERT_EQUAL(a.index, i);
            CU_ASSERT_EQUAL_FATAL(task_generate(&o, 99, TASK_SPLIT_TRAIN, i, &c), 0);
            differ += strcmp(a.prompt, c.prompt) != 0;
        }
        CU_ASSERT(differ > 150); /* another seed, other problems */
    }
}

/* The generator's output is part of a run's reproducibility: pinned. */
static void test_pinned(void) {
    task_opts_t a = task_opts_default(CFG_TASK_ARITH), s = task_opts_default(CFG_TASK_SORT);
    task_item_t it;
    CU_ASSERT_EQUAL_FATAL(task_generate(&a, 1234, TASK_SPLIT_TRAIN, 0, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "561-430=");
    CU_ASSERT_STRING_EQUAL(it.answer, "131");
    CU_ASSERT_EQUAL_FATAL(task_generate(&s, 1234, TASK_SPLIT_TRAIN, 0, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "sort:982=");
    CU_ASSERT_STRING_EQUAL(it.answer, "289");
    CU_ASSERT_EQUAL_FATAL(task_generate(&a, 1234, TASK_SPLIT_EVAL, 0, &it), 0);
    CU_ASSERT_STRING_EQUAL(it.prompt, "480+955=");
    CU_ASSERT_STRING_EQUAL(it.answer, "1435");
    CU_ASSERT_EQUAL(task_split_of("480+955=", a.eval_permille), TASK_SPLIT_EVAL);
}

/* Recomputes an arith answer from its prompt. */
static void check_arith(const task_opts_t *o, const task_item_t *it, int *neg_seen) {
    long long a, b;
    char op, eq;
    int used = 0;
    CU_ASSERT_EQUAL_FATAL(sscanf(it->prompt, "%lld%c%lld%c%n", &a, &op, &b, &eq, &used), 4);
    CU_ASSERT_EQUAL(used, (int)strlen(it->prompt));
    CU_ASSERT_EQUAL(eq, '=');
    CU_ASSERT_PTR_NOT_NULL(strchr(o->ops, op));
    long long want = op == '+' ? a + b : op == '-' ? a - b : a * b;
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", want);
    CU_ASSERT_STRING_EQUAL(it->answer, buf);
    long long lo = 1, hi = 1;
    for (int d = 1; d < o->min_digits; d++)
        lo *= 10;
    for (int d = 0; d < o->max_digits; d++)
        hi *= 10;
    if (o->min_digits == 1)
        lo = 0;
    CU_ASSERT(a >= lo && a < hi && b >= lo && b < hi);
    /* no leading zeros: the prompt spells the operands canonically */
    char canon[64];
    snprintf(canon, sizeof canon, "%lld%c%lld=", a, op, b);
    CU_ASSERT_STRING_EQUAL(canon, it->prompt);
    if (want < 0)
        (*neg_seen)++;
}

/* Operands drawn from 1..2 digits are uniform over 0..99 (one-digit ones
 * about 10%, not the half a digit-count-first draw would give); from 2..3
 * digits uniform over 10..999 (three-digit ones about 91%). */
static void test_operand_distribution(void) {
    task_opts_t a = task_opts_default(CFG_TASK_ARITH);
    strcpy(a.ops, "+");
    int mins[2] = {1, 2}, maxs[2] = {2, 3};
    double want[2] = {0.1, 900.0 / 990.0};
    for (int c = 0; c < 2; c++) {
        a.min_digits = mins[c];
        a.max_digits = maxs[c];
        long long cut = mins[c] == 1 ? 10 : 100; /* counted: x < 10 for 1..2, x >= 100 for 2..3 */
        int hits = 0, n = 0, neg = 0;
        for (uint64_t i = 0; i < 2000; i++) {
            task_item_t it;
            long long x, y;
            CU_ASSERT_EQUAL_FATAL(task_generate(&a, 7, TASK_SPLIT_TRAIN, i, &it), 0);
            check_arith(&a, &it, &neg);
            CU_ASSERT_EQUAL_FATAL(sscanf(it.prompt, "%lld+%lld", &x, &y), 2);
            hits += c == 0 ? (x < cut) + (y < cut) : (x >= cut) + (y >= cut);
            n += 2;
        }
        double share = (double)hits / n; /* binomial sd below 0.005 for n 4000 */
        CU_ASSERT_DOUBLE_EQUAL(share, want[c], 0.025);
    }
}

static void check_sort(const task_opts_t *o, const task_item_t *it) {
    size_t n = strlen(it->prompt);
    CU_ASSERT_FATAL(n >= 7 && !strncmp(it->prompt, "sort:", 5) && it->prompt[n - 1] == '=');
    const char *items = it->prompt + 5;
    size_t len = n - 6;
    CU_ASSERT(len >= (size_t)o->min_len && len <= (size_t)o->max_len);
    CU_ASSERT_EQUAL(strlen(it->answer), len);
    int count[256] = {0};
    for (size_t i = 0; i < len; i++) {
        CU_ASSERT_PTR_NOT_NULL(strchr(o->alphabet, items[i]));
        count[(unsigned char)items[i]]++;
        count[(unsigned char)it->answer[i]]--;
        if (i)
            CU_ASSERT((unsigned char)it->answer[i - 1] <= (unsigned char)it->answer[i]);
    }
    for (int c = 0; c < 256; c++)
        CU_ASSERT_EQUAL(count[c], 0);
}

static void test_answers(void) {
    task_opts_t a = task_opts_default(CFG_TASK_ARITH);
    int neg = 0;
    for (uint64_t i = 0; i < 500; i++) {
        task_item_t it;
        CU_ASSERT_EQUAL_FATAL(
            task_generate(&a, 7, i % 3 ? TASK_SPLIT_TRAIN : TASK_SPLIT_EVAL, i, &it), 0);
        check_arith(&a, &it, &neg);
    }
    CU_ASSERT_EQUAL(neg, 0); /* negative 0 orders a-b */

    /* the widest operands: 9 digits times 9 digits */
    a.min_digits = a.max_digits = 9;
    strcpy(a.ops, "*-");
    a.negative = 1;
    for (uint64_t i = 0; i < 300; i++) {
        task_item_t it;
        CU_ASSERT_EQUAL_FATAL(task_generate(&a, 7, TASK_SPLIT_TRAIN, i, &it), 0);
        check_arith(&a, &it, &neg);
    }
    CU_ASSERT(neg > 20);

    task_opts_t s = task_opts_default(CFG_TASK_SORT);
    for (uint64_t i = 0; i < 300; i++) {
        task_item_t it;
        CU_ASSERT_EQUAL_FATAL(task_generate(&s, 7, TASK_SPLIT_TRAIN, i, &it), 0);
        check_sort(&s, &it);
    }
    s.min_len = s.max_len = TASK_MAX_SORT_LEN;
    strcpy(s.alphabet, "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA9876543210");
    for (uint64_t i = 0; i < 100; i++) {
        task_item_t it;
        CU_ASSERT_EQUAL_FATAL(task_generate(&s, 7, TASK_SPLIT_EVAL, i, &it), 0);
        check_sort(&s, &it);
    }
}

static double verify(reward_fn_t *fn, const char *completion, const char *answer) {
    reward_input_t in;
    reward_input_init(&in, "p", completion, answer);
    double r = -1;
    if (reward_fn_score(fn, &in, &r, NULL, NULL, 0) < 0)
        tu_report("%s", mo_last_error());
    return r;
}

static void test_verifiers(void) {
    cfg_task_t kinds[2] = {CFG_TASK_ARITH, CFG_TASK_SORT};
    CU_ASSERT_STRING_EQUAL(task_verifier(CFG_TASK_ARITH), "arith_exact");
    CU_ASSERT_STRING_EQUAL(task_verifier(CFG_TASK_SORT), "sort_exact");
    CU_ASSERT_PTR_NULL(task_verifier(CFG_TASK_JSONL));
    for (int k = 0; k < 2; k++) {
        task_opts_t o = task_opts_default(kinds[k]);
        reward_fn_t *fn;
        CU_ASSERT_EQUAL_FATAL(reward_fn_parse(task_verifier(kinds[k]), &fn), 0);
        int rejected = 0;
        for (uint64_t i = 0; i < 100; i++) {
            task_item_t it;
            CU_ASSERT_EQUAL_FATAL(task_generate(&o, 5, TASK_SPLIT_TRAIN, i, &it), 0);
            CU_ASSERT_EQUAL(verify(fn, it.answer, it.answer), 1.0);
            char buf[64];
            snprintf(buf, sizeof buf, "%s\n", it.answer); /* stopped at a newline */
            CU_ASSERT_EQUAL(verify(fn, buf, it.answer), 1.0);
            snprintf(buf, sizeof buf, "%s0", it.answer); /* one character too many */
            CU_ASSERT_EQUAL(verify(fn, buf, it.answer), 0.0);
            snprintf(buf, sizeof buf, "%s", it.answer);
            size_t n = strlen(buf);
            buf[n - 1] = buf[n - 1] == '1' ? '2' : '1'; /* last character changed */
            CU_ASSERT_EQUAL(verify(fn, buf, it.answer), 0.0);
            CU_ASSERT_EQUAL(verify(fn, it.prompt, it.answer), 0.0); /* echoing the prompt */
            rejected += 3;
        }
        CU_ASSERT_EQUAL(rejected, 300);
        reward_fn_destroy(&fn);
    }
}

/* With 1-digit additions (100 problems) both splits draw from a small space,
 * so any overlap would show. */
static void test_disjoint(void) {
    task_opts_t o = task_opts_default(CFG_TASK_ARITH);
    o.max_digits = 1;
    strcpy(o.ops, "+");
    o.eval_permille = 100;
    static char train[100], eval[100]; /* problem a*10+b seen in a split */
    memset(train, 0, sizeof train);
    memset(eval, 0, sizeof eval);
    for (uint64_t i = 0; i < 2000; i++) {
        task_item_t t;
        CU_ASSERT_EQUAL_FATAL(task_generate(&o, 11, TASK_SPLIT_TRAIN, i, &t), 0);
        CU_ASSERT_EQUAL(task_split_of(t.prompt, o.eval_permille), TASK_SPLIT_TRAIN);
        train[(t.prompt[0] - '0') * 10 + (t.prompt[2] - '0')] = 1;
    }
    for (uint64_t i = 0; i < 300; i++) {
        task_item_t e;
        CU_ASSERT_EQUAL_FATAL(task_generate(&o, 11, TASK_SPLIT_EVAL, i, &e), 0);
        CU_ASSERT_EQUAL(task_split_of(e.prompt, o.eval_permille), TASK_SPLIT_EVAL);
        eval[(e.prompt[0] - '0') * 10 + (e.prompt[2] - '0')] = 1;
    }
    int n_train = 0, n_eval = 0, both = 0, hashed_eval = 0;
    for (int p = 0; p < 100; p++) {
        n_train += train[p];
        n_eval += eval[p];
        both += train[p] && eval[p];
        char prompt[8];
        snprintf(prompt, sizeof prompt, "%d+%d=", p / 10, p % 10);
        hashed_eval += task_split_of(prompt, o.eval_permille) == TASK_SPLIT_EVAL;
    }
    CU_ASSERT_EQUAL(both, 0);
    /* every problem of each split was drawn: the splits partition the space */
    CU_ASSERT_EQUAL(n_eval, hashed_eval);
    CU_ASSERT_EQUAL(n_train + n_eval, 100);
    CU_ASSERT(hashed_eval >= 2 && hashed_eval <= 25);
    /* the partition does not depend on the seed */
    task_item_t e;
    for (uint64_t i = 0; i < 50; i++) {
        CU_ASSERT_EQUAL_FATAL(task_generate(&o, 12345, TASK_SPLIT_EVAL, i, &e), 0);
        CU_ASSERT(eval[(e.prompt[0] - '0') * 10 + (e.prompt[2] - '0')]);
    }
}

static void test_options(void) {
    task_opts_t o = task_opts_default(CFG_TASK_ARITH);
    CU_ASSERT_EQUAL(task_opts_check(&o), 0);
    o.max_digits = 10;
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "digits"));
    o = task_opts_default(CFG_TASK_ARITH);
    strcpy(o.ops, "+/");
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "ops"));
    o = task_opts_default(CFG_TASK_ARITH);
    o.eval_permille = 1001;
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    task_item_t it;
    CU_ASSERT_EQUAL(task_generate(&o, 1, TASK_SPLIT_TRAIN, 0, &it), MO_ECONFIG);
    o.eval_permille = 0;
    CU_ASSERT_EQUAL(task_generate(&o, 1, TASK_SPLIT_TRAIN, 0, &it), 0);
    CU_ASSERT_EQUAL(task_generate(&o, 1, TASK_SPLIT_EVAL, 0, &it), MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "no eval problem"));

    o = task_opts_default(CFG_TASK_SORT);
    strcpy(o.alphabet, "abca");
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "repeats 'a'"));
    strcpy(o.alphabet, "ab=");
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    o = task_opts_default(CFG_TASK_SORT);
    o.min_len = 5;
    o.max_len = 4;
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
    o = task_opts_default(CFG_TASK_JSONL);
    CU_ASSERT_EQUAL(task_opts_check(&o), MO_ECONFIG);
}

static void test_sft_pairs(void) {
    task_opts_t o = task_opts_default(CFG_TASK_SORT);
    for (uint64_t i = 0; i < 50; i++) {
        char p[TASK_PROMPT_CAP], r[TASK_ANSWER_CAP];
        task_item_t it;
        CU_ASSERT_EQUAL_FATAL(task_sft_pair(&o, 3, i, p, sizeof p, r, sizeof r), 0);
        CU_ASSERT_EQUAL_FATAL(task_generate(&o, 3, TASK_SPLIT_TRAIN, i, &it), 0);
        CU_ASSERT_STRING_EQUAL(p, it.prompt);
        CU_ASSERT_STRING_EQUAL(r, it.answer);
    }
    char p[4], r[TASK_ANSWER_CAP];
    CU_ASSERT_EQUAL(task_sft_pair(&o, 3, 0, p, sizeof p, r, sizeof r), MO_EINVAL);
}

/* data.arith_* reach the generator; other tasks keep their defaults. */
static void test_from_config(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    task_opts_t o, d = task_opts_default(CFG_TASK_ARITH);
    memset(&o, 0x5a, sizeof o);
    CU_ASSERT_EQUAL_FATAL(task_opts_from_config(&c, &o), 0);
    CU_ASSERT_EQUAL(o.min_digits, d.min_digits);
    CU_ASSERT_EQUAL(o.max_digits, d.max_digits);
    CU_ASSERT_STRING_EQUAL(o.ops, d.ops);
    CU_ASSERT_EQUAL(o.eval_permille, d.eval_permille);

    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_min_digits", "2"), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_max_digits", "2"), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "*"), 0);
    CU_ASSERT_EQUAL_FATAL(task_opts_from_config(&c, &o), 0);
    CU_ASSERT_STRING_EQUAL(o.ops, "*");
    for (uint64_t i = 0; i < 100; i++) {
        task_item_t it;
        long long a, b;
        char op;
        CU_ASSERT_EQUAL_FATAL(task_generate(&o, 7, i % 2 ? TASK_SPLIT_EVAL : TASK_SPLIT_TRAIN, i,
                                            &it),
                              0);
        CU_ASSERT_EQUAL_FATAL(sscanf(it.prompt, "%lld%c%lld=", &a, &op, &b), 3);
        CU_ASSERT(op == '*' && a >= 10 && a <= 99 && b >= 10 && b <= 99);
        char want[TASK_ANSWER_CAP];
        snprintf(want, sizeof want, "%lld", a * b);
        CU_ASSERT_STRING_EQUAL(it.answer, want);
    }

    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "+/"), 0);
    CU_ASSERT_EQUAL(task_opts_from_config(&c, &o), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "data.arith_ops"));
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "+-*+"), 0);
    CU_ASSERT_EQUAL(task_opts_from_config(&c, &o), MO_ECONFIG);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "+"), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_min_digits", "3"), 0);
    CU_ASSERT_EQUAL(task_opts_from_config(&c, &o), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "data.arith_max_digits 2"));
    CU_ASSERT_EQUAL(config_validate(&c), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "data.arith_min_digits"));
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_min_digits", "1"), 0);
    CU_ASSERT_EQUAL(config_validate(&c), 0);
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "++"), 0);
    CU_ASSERT_EQUAL(config_validate(&c), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "data.arith_ops"));
    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.arith_ops", "+"), 0);

    CU_ASSERT_EQUAL_FATAL(config_set(&c, "data.task", "sort"), 0);
    CU_ASSERT_EQUAL_FATAL(task_opts_from_config(&c, &o), 0);
    d = task_opts_default(CFG_TASK_SORT);
    CU_ASSERT_EQUAL(o.kind, CFG_TASK_SORT);
    CU_ASSERT_EQUAL(o.min_len, d.min_len);
    CU_ASSERT_STRING_EQUAL(o.alphabet, d.alphabet);
    config_free(&c);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"determinism", test_determinism},
        {"pinned problems", test_pinned},
        {"answers are correct", test_answers},
        {"operands are uniform", test_operand_distribution},
        {"verifiers accept and reject", test_verifiers},
        {"train and eval are disjoint", test_disjoint},
        {"options", test_options},
        {"sft pairs", test_sft_pairs},
        {"options from the config", test_from_config},
        CU_TEST_INFO_NULL,
    };
    return tu_main("tasks", tests);
}
