/* tasks: the built-in verifiable tasks (multi-digit arithmetic, sorting) as
 * deterministic generators of (prompt, answer) from (seed, split, index), the
 * reward verifier that scores each, and SFT pairs for a warm start. */
#ifndef MOERL_LEARNER_TASKS_H
#define MOERL_LEARNER_TASKS_H

#include <stddef.h>
#include <stdint.h>

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Formats, short and regular for a byte-level model trained from scratch:
 *   arith  prompt "<a><op><b>=", answer the decimal result:
 *          "12+345=" -> "357", "907-48=" -> "859", "12*34=" -> "408"
 *   sort   prompt "sort:<items>=", answer the items in ascending byte order:
 *          "sort:3142=" -> "1234", "sort:dbca=" -> "abcd"
 * The model is to answer with the answer text and then stop (end-of-sequence
 * token or a newline); the verifiers read the completion's first line. */

#define TASK_PROMPT_CAP 32 /* bytes, NUL included; every prompt fits */
#define TASK_ANSWER_CAP 24 /* bytes, NUL included; every answer fits */
#define TASK_MAX_DIGITS 9  /* arith operands below 10^9: a*b fits int64 */
#define TASK_MAX_SORT_LEN 16
#define TASK_MAX_ALPHABET 62

typedef enum { TASK_SPLIT_TRAIN = 0, TASK_SPLIT_EVAL = 1 } task_split_t;

typedef struct task_opts {
    cfg_task_t kind;            /* CFG_TASK_ARITH or CFG_TASK_SORT */
    int min_digits, max_digits; /* arith: digits per operand, in [1, TASK_MAX_DIGITS]; each
                                 * operand is uniform over all numbers of those lengths */
    char ops[4];                /* arith: operators to draw from, a non-empty subset of "+-*" */
    int negative;               /* arith: 0 orders a-b so that a >= b; 1 allows negative results */
    int min_len, max_len;       /* sort: items per list, in [1, TASK_MAX_SORT_LEN] */
    char alphabet[TASK_MAX_ALPHABET + 1]; /* sort: distinct letters or digits to draw from */
    int eval_permille; /* share of the problem space held out for eval, in [0, 1000] */
} task_opts_t;

/* Defaults: arith 1..3 digits, ops "+-", negative 0; sort lengths 2..8 over
 * "0123456789"; eval_permille 50 (5% of all problems are eval-only). */
task_opts_t task_opts_default(cfg_task_t kind);
/* MO_ECONFIG naming the first bad field. */
int task_opts_check(const task_opts_t *o);
/* The options of data.task (arith or sort): the defaults, with data.arith_min_digits,
 * data.arith_max_digits and data.arith_ops for arith. MO_ECONFIG naming the key when
 * they do not make a valid task. */
int task_opts_from_config(const moerl_config_t *cfg, task_opts_t *out);

typedef struct task_item {
    uint64_t index;
    char prompt[TASK_PROMPT_CAP];
    char answer[TASK_ANSWER_CAP];
} task_item_t;

/* Problem `index` of a split under `seed`: the same arguments give the same
 * problem on any machine. The two splits are disjoint: a problem belongs to
 * eval when a hash of its prompt (with a fixed salt, not the seed) falls in
 * the eval share, so no seed ever trains on an eval problem. Each split draws
 * candidates from its own random stream and keeps the first that belongs to
 * it. MO_ECONFIG on bad options; MO_EINVAL when a split holds no problem
 * (e.g. eval_permille 0 for eval, or a problem space too small). */
int task_generate(const task_opts_t *o, uint64_t seed, task_split_t split, uint64_t index,
                  task_item_t *out);

/* The split a prompt belongs to under eval_permille. */
task_split_t task_split_of(const char *prompt, int eval_permille);

/* The reward spec that scores a task's completions: "arith_exact", "sort_exact";
 * NULL for other kinds. */
const char *task_verifier(cfg_task_t kind);

/* A supervised pair for warm-start training from the train split: prompt as
 * task_generate gives it, response the text the model should produce (the
 * answer; the trainer appends the end-of-sequence token). */
int task_sft_pair(const task_opts_t *o, uint64_t seed, uint64_t index, char *prompt, size_t pcap,
                  char *response, size_t rcap);

#ifdef __cplusplus
}
#endif
#endif
