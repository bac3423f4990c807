/* tasks: arithmetic and sorting problems drawn from counter-based random
 * streams, split into train and eval by a hash of the prompt. */
#include "learner/tasks.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"

#define TASK_MAX_ATTEMPTS (1u << 16) /* candidates drawn before a split counts as empty */
#define TASK_BLOCKS 16               /* Philox blocks a candidate may use: 64 words */
#define TASK_SPLIT_SALT 0x6d6f65726c2d7370ull

task_opts_t task_opts_default(cfg_task_t kind) {
    task_opts_t o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.min_digits = 1;
    o.max_digits = 3;
    strcpy(o.ops, "+-");
    o.negative = 0;
    o.min_len = 2;
    o.max_len = 8;
    strcpy(o.alphabet, "0123456789");
    o.eval_permille = 50;
    return o;
}

static int check_alphabet(const char *a) {
    size_t n = strnlen(a, TASK_MAX_ALPHABET + 1);
    if (n == 0 || n > TASK_MAX_ALPHABET)
        return mo_errorf(MO_ECONFIG, "task sort: alphabet must hold 1..%d characters, got %zu",
                         TASK_MAX_ALPHABET, n);
    for (size_t i = 0; i < n; i++) {
        if (!isalnum((unsigned char)a[i]))
            return mo_errorf(MO_ECONFIG,
                             "task sort: alphabet may hold only letters and digits, "
                             "got byte 0x%02x at %zu",
                             (unsigned char)a[i], i);
        if (memchr(a, a[i], i))
            return mo_errorf(MO_ECONFIG, "task sort: alphabet repeats '%c'", a[i]);
    }
    return MO_OK;
}

int task_opts_check(const task_opts_t *o) {
    if (o->eval_permille < 0 || o->eval_permille > 1000)
        return mo_errorf(MO_ECONFIG, "task: eval_permille must be in [0, 1000], got %d",
                         o->eval_permille);
    if (o->kind == CFG_TASK_ARITH) {
        if (o->min_digits < 1 || o->max_digits > TASK_MAX_DIGITS || o->min_digits > o->max_digits)
            return mo_errorf(MO_ECONFIG,
                             "task arith: digits must satisfy 1 <= min (%d) <= max (%d) "
                             "<= %d",
                             o->min_digits, o->max_digits, TASK_MAX_DIGITS);
        size_t n = strnlen(o->ops, sizeof o->ops);
        if (n == 0 || n == sizeof o->ops || strspn(o->ops, "+-*") != n)
            return mo_errorf(MO_ECONFIG, "task arith: ops must be a non-empty subset of \"+-*\"");
        return MO_OK;
    }
    if (o->kind == CFG_TASK_SORT) {
        if (o->min_len < 1 || o->max_len > TASK_MAX_SORT_LEN || o->min_len > o->max_len)
            return mo_errorf(MO_ECONFIG,
                             "task sort: lengths must satisfy 1 <= min (%d) <= max (%d) "
                             "<= %d",
                             o->min_len, o->max_len, TASK_MAX_SORT_LEN);
        return check_alphabet(o->alphabet);
    }
    return mo_errorf(MO_ECONFIG, "task: kind %d is not a built-in task (arith or sort)",
                     (int)o->kind);
}

int task_opts_from_config(const moerl_config_t *cfg, task_opts_t *out) {
    const config_data_t *d = &cfg->data;
    *out = task_opts_default(d->task);
    if (d->task != CFG_TASK_ARITH)
        return task_opts_check(out);
    const char *ops = d->arith_ops ? d->arith_ops : "";
    size_t n = strlen(ops);
    if (n == 0 || n >= sizeof out->ops)
        return mo_errorf(MO_ECONFIG, "data.arith_ops: expected 1 to %zu operators, got \"%s\"",
                         sizeof out->ops - 1, ops);
    memcpy(out->ops, ops, n + 1);
    out->min_digits = d->arith_min_digits;
    out->max_digits = d->arith_max_digits;
    int rc = task_opts_check(out);
    if (rc < 0) {
        char why[256];
        snprintf(why, sizeof why, "%s", mo_last_error());
        return mo_errorf(rc, "data.arith_min_digits %d, data.arith_max_digits %d, data.arith_ops "
                             "\"%s\": %s",
                         d->arith_min_digits, d->arith_max_digits, ops, why);
    }
    return MO_OK;
}

/* The draws of one candidate: up to TASK_BLOCKS Philox blocks, made as
 * they are needed. */
typedef struct draws {
    uint64_t seed, stream, base;
    uint32_t w[4];
    int used;   /* words of w consumed */
    int blocks; /* blocks made */
} draws_t;

static void draws_init(draws_t *d, uint64_t seed, task_split_t split, cfg_task_t kind,
                       uint64_t index, uint32_t attempt) {
    d->seed = seed;
    d->stream = rng_stream_id(split == TASK_SPLIT_EVAL ? "task.eval" : "task.train", (uint64_t)kind,
                              attempt);
    d->base = index * TASK_BLOCKS;
    d->used = 4;
    d->blocks = 0;
}

static uint32_t draw_word(draws_t *d) {
    if (d->used == 4) {
        MO_ASSERT(d->blocks < TASK_BLOCKS);
        rng_block(d->w, d->seed, d->stream, d->base + (uint64_t)d->blocks++);
        d->used = 0;
    }
    return d->w[d->used++];
}

/* Uniform in [lo, hi] from 64 bits (bias below 2^-32 for any range used here). */
static uint64_t draw_range(draws_t *d, uint64_t lo, uint64_t hi) {
    uint64_t x = (uint64_t)draw_word(d) << 32;
    x |= draw_word(d);
    return lo + x % (hi - lo + 1);
}

static uint64_t pow10u(int e) {
    uint64_t p = 1;
    while (e-- > 0)
        p *= 10;
    return p;
}

/* Each operand uniform over every number with min_digits..max_digits digits,
 * [lo, 10^max_digits - 1] with lo 0 for one digit, else 10^(min_digits-1): one
 * draw per operand, so every problem is equally likely (a one-digit operand is
 * no likelier than a two-digit one). */
static void arith_candidate(const task_opts_t *o, draws_t *d, task_item_t *it) {
    size_t nops = strlen(o->ops);
    char op = o->ops[draw_range(d, 0, nops - 1)];
    uint64_t lo = o->min_digits == 1 ? 0 : pow10u(o->min_digits - 1);
    uint64_t hi = pow10u(o->max_digits) - 1;
    int64_t v[2];
    for (int k = 0; k < 2; k++)
        v[k] = (int64_t)draw_range(d, lo, hi);
    if (op == '-' && !o->negative && v[0] < v[1]) {
        int64_t t = v[0];
        v[0] = v[1];
        v[1] = t;
    }
    int64_t r = op == '+' ? v[0] + v[1] : op == '-' ? v[0] - v[1] : v[0] * v[1];
    snprintf(it->prompt, TASK_PROMPT_CAP, "%" PRId64 "%c%" PRId64 "=", v[0], op, v[1]);
    snprintf(it->answer, TASK_ANSWER_CAP, "%" PRId64, r);
}

static void sort_candidate(const task_opts_t *o, draws_t *d, task_item_t *it) {
    size_t na = strlen(o->alphabet);
    int len = (int)draw_range(d, (uint64_t)o->min_len, (uint64_t)o->max_len);
    char items[TASK_MAX_SORT_LEN];
    for (int i = 0; i < len; i++)
        items[i] = o->alphabet[draw_range(d, 0, na - 1)];
    snprintf(it->prompt, TASK_PROMPT_CAP, "sort:%.*s=", len, items);
    for (int i = 1; i < len; i++) { /* insertion sort by byte value */
        char c = items[i];
        int j = i - 1;
        for (; j >= 0 && (unsigned char)items[j] > (unsigned char)c; j--)
            items[j + 1] = items[j];
        items[j + 1] = c;
    }
    snprintf(it->answer, TASK_ANSWER_CAP, "%.*s", len, items);
}

task_split_t task_split_of(const char *prompt, int eval_permille) {
    uint64_t h = 0xcbf29ce484222325ull ^ TASK_SPLIT_SALT;
    for (const unsigned char *p = (const unsigned char *)prompt; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    h ^= h >> 33; /* murmur3 finaliser: spread the low bits */
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return (int)(h % 1000) < eval_permille ? TASK_SPLIT_EVAL : TASK_SPLIT_TRAIN;
}

int task_generate(const task_opts_t *o, uint64_t seed, task_split_t split, uint64_t index,
                  task_item_t *out) {
    TRY(task_opts_check(o));
    if (index > UINT64_MAX / TASK_BLOCKS)
        return mo_errorf(MO_EINVAL, "task: index %" PRIu64 " too large", index);
    for (uint32_t a = 0; a < TASK_MAX_ATTEMPTS; a++) {
        draws_t d;
        draws_init(&d, seed, split, o->kind, index, a);
        memset(out, 0, sizeof *out);
        out->index = index;
        if (o->kind == CFG_TASK_ARITH)
            arith_candidate(o, &d, out);
        else
            sort_candidate(o, &d, out);
        if (task_split_of(out->prompt, o->eval_permille) == split)
            return MO_OK;
    }
    return mo_errorf(MO_EINVAL,
                     "task %s: no %s problem in %u draws (eval_permille %d; widen the problem "
                     "space or change eval_permille)",
                     o->kind == CFG_TASK_ARITH ? "arith" : "sort",
                     split == TASK_SPLIT_EVAL ? "eval" : "train", TASK_MAX_ATTEMPTS,
                     o->eval_permille);
}

const char *task_verifier(cfg_task_t kind) {
    switch (kind) {
    case CFG_TASK_ARITH: return "arith_exact";
    case CFG_TASK_SORT: return "sort_exact";
    default: return NULL;
    }
}

int task_sft_pair(const task_opts_t *o, uint64_t seed, uint64_t index, char *prompt, size_t pcap,
                  char *response, size_t rcap) {
    task_item_t it;
    TRY(task_generate(o, seed, TASK_SPLIT_TRAIN, index, &it));
    size_t pn = strlen(it.prompt), rn = strlen(it.answer);
    if (pn >= pcap || rn >= rcap)
        return mo_errorf(MO_EINVAL, "task_sft_pair: buffers of %zu and %zu bytes, need %zu and %zu",
                         pcap, rcap, pn + 1, rn + 1);
    memcpy(prompt, it.prompt, pn + 1);
    memcpy(response, it.answer, rn + 1);
    return MO_OK;
}
