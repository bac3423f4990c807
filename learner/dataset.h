/* dataset: the prompt stream: JSONL records or a built-in task, an eval split,
 * per-epoch shuffling from the run seed, and a cursor saved for resume. */
#ifndef MOERL_LEARNER_DATASET_H
#define MOERL_LEARNER_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/config.h"
#include "learner/tasks.h"
#include "reward/moerl_reward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* JSONL: one JSON object per line,
 *   {"prompt": "...", "answer": "...", "any": "string", "n": 3, "flag": true}
 * "prompt" is a non-empty string (required); "answer" a string or number
 * (optional, "" when absent); every other field is an extra key/value handed
 * to the reward, strings as they are, numbers in their shortest round-trip
 * spelling, booleans as "true"/"false". Null, arrays and objects, repeated
 * keys, text after the object and invalid JSON are malformed; blank lines are
 * ignored. A malformed line fails the open with "FILE:LINE: what" (MO_EMALFORMED)
 * unless skip_malformed, which skips and counts it.
 *
 * Splits: eval_size records picked by a permutation drawn from the seed
 * (stream "data.eval") are held out, listed in file order; the rest are the
 * training stream. Epoch e of the training stream is a permutation drawn from
 * (seed, "data.shuffle", e), a different one per epoch, or file order when
 * shuffle is off. A built-in task is an infinite training stream (problem
 * index = cursor position, epoch always 0) with eval problems 0 .. eval_size-1
 * of its disjoint eval split. */

typedef struct dataset_opts {
    uint64_t seed;       /* run.seed */
    bool shuffle;        /* data.shuffle */
    bool skip_malformed; /* data.skip_malformed */
    int64_t eval_size;   /* data.eval_size */
} dataset_opts_t;

/* Where the training stream stands: the next item is position pos of epoch. */
typedef struct dataset_cursor {
    uint64_t epoch;
    uint64_t pos;
} dataset_cursor_t;

/* One prompt. The strings stay valid while the dataset lives; for a task they
 * point into item->task, so copy the strings, not the struct. */
typedef struct dataset_item {
    uint64_t id;   /* JSONL: 0-based record number in file order; task: problem index */
    uint64_t line; /* JSONL: 1-based line in the file; 0 for a task */
    const char *prompt;
    const char *answer;             /* "" when none */
    const moerl_reward_kv_t *extra; /* (n_extra) */
    size_t n_extra;
    task_item_t task; /* storage for a task's prompt and answer */
} dataset_item_t;

typedef struct dataset_stats {
    uint64_t lines;        /* lines read */
    uint64_t records;      /* valid records (train + eval) */
    uint64_t blank;        /* blank lines ignored */
    uint64_t skipped;      /* malformed lines skipped */
    char first_error[256]; /* "FILE:LINE: what" of the first skipped line, "" when none */
} dataset_stats_t;

typedef struct dataset dataset_t;

/* Reads a whole JSONL file. MO_EIO when it cannot be read, MO_EMALFORMED on a
 * malformed line (without skip_malformed), MO_EINVAL when it has no record
 * or eval_size leaves no training record. */
int dataset_open_jsonl(const char *path, const dataset_opts_t *o, dataset_t **out);
/* A built-in task as a dataset. */
int dataset_open_task(const task_opts_t *t, const dataset_opts_t *o, dataset_t **out);
/* The data section and run.seed of a job: data.task jsonl reads data.path,
 * arith and sort use task_opts_default. */
int dataset_open_config(const moerl_config_t *cfg, dataset_t **out);
void dataset_destroy(dataset_t **d);

/* Training items per epoch; UINT64_MAX for a task (infinite). */
uint64_t dataset_train_size(const dataset_t *d);
uint64_t dataset_eval_size(const dataset_t *d);
/* The reward spec a task's completions are scored by; NULL for JSONL. */
const char *dataset_verifier(const dataset_t *d);
const dataset_stats_t *dataset_stats(const dataset_t *d);
/* FNV-1a of the file's bytes, or of the task and its options: stored with a
 * saved cursor so that a resume can tell it reads the same data. */
uint64_t dataset_fingerprint(const dataset_t *d);

/* The next training item; advances the cursor, into the next epoch after the
 * last position. Not thread-safe (one consumer owns the stream). */
int dataset_next(dataset_t *d, dataset_item_t *item);
/* The training item at a cursor, without moving. MO_EINVAL when pos is past
 * the epoch's end. */
int dataset_at(dataset_t *d, dataset_cursor_t c, dataset_item_t *item);
/* Eval item i in [0, dataset_eval_size). */
int dataset_eval(const dataset_t *d, uint64_t i, dataset_item_t *item);

dataset_cursor_t dataset_tell(const dataset_t *d);
/* Restores a cursor from dataset_tell. pos equal to the epoch size means the
 * start of the next epoch. MO_EINVAL when it cannot come from this dataset. */
int dataset_seek(dataset_t *d, dataset_cursor_t c);

#ifdef __cplusplus
}
#endif
#endif
