/* run_report: the summary of a run: the reward mean of every step (from the learner's
 * metrics JSON lines) and the held-out greedy accuracy of the base model and of each
 * checkpoint's adapter (eval_greedy), printed as a table and drawn as an SVG plot. */
#ifndef MOERL_LEARNER_RUN_REPORT_H
#define MOERL_LEARNER_RUN_REPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One step of the run. Step 0 is the base model, before any update. */
typedef struct report_row {
    int64_t step;
    double reward_mean; /* mean reward of the step's samples; NaN when not recorded */
    double accuracy;    /* held-out greedy accuracy; NaN when not evaluated at this step */
} report_row_t;

typedef struct run_report {
    report_row_t *rows; /* (n) by increasing step */
    int n, cap;
    int eval_n; /* held-out prompts per evaluation (0 when none was made) */
} run_report_t;

void report_init(run_report_t *r);
void report_free(run_report_t *r);

/* The row of a step, added (with NaN values) when missing. NULL when out of memory. */
report_row_t *report_row(run_report_t *r, int64_t step);

/* Reads the reward mean of every "step" line of the learner's metrics JSON lines file
 * (a later line for the same step wins). MO_EIO when the file cannot be read; lines
 * that are not JSON objects are skipped. */
int report_read_metrics(run_report_t *r, const char *jsonl_path);

/* Called after each evaluation: step, accuracy, correct and n. */
typedef void (*report_progress_fn)(void *arg, int64_t step, double accuracy, int correct, int n);

/* Held-out greedy accuracy (the first eval_n eval prompts of the job's data, scored by
 * the task's verifier or reward.function, as `moerl sft` measures it) of the base model
 * (step 0) and of the adapter of every checkpoint in <run_dir>/checkpoints. c: the run's
 * config (model, data, rollout sampling limits). eval_n 0: data.eval_size. */
int report_eval_checkpoints(run_report_t *r, const moerl_config_t *c, const char *run_dir,
                            int eval_n, report_progress_fn progress, void *arg);

/* The table: one line per evaluated step (and the last step; about 20 evenly spaced
 * steps when nothing was evaluated) with the reward mean averaged over the steps since
 * the line above and the held-out accuracy ("-" when none); then the first and last
 * evaluated accuracy and their difference. */
void report_print(const run_report_t *r, FILE *out);

/* An SVG line plot of reward mean and held-out accuracy by step (written through a
 * temporary file renamed into place). MO_EINVAL when there is nothing to plot. */
int report_write_svg(const run_report_t *r, const char *title, const char *path);

/* The first and the last evaluated rows (NULL when none). */
const report_row_t *report_first_eval(const run_report_t *r);
const report_row_t *report_last_eval(const run_report_t *r);

#ifdef __cplusplus
}
#endif
#endif
