/* eval: held-out accuracy: greedy generation with the rollout engine for a dataset's eval
 * prompts, scored by a reward function; and the prompt encoding shared with training. */
#ifndef MOERL_LEARNER_EVAL_H
#define MOERL_LEARNER_EVAL_H

#include <stddef.h>
#include <stdint.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/config.h"
#include "learner/dataset.h"
#include "lora/adapter.h"
#include "reward/reward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The ids of a prompt as the model reads it: the template applied (NULL: the text as it
 * is), encoded with special tokens recognised, between the tokenizer's affixes (as
 * `moerl generate` does). *ids malloc'd (free()). MO_EINVAL for an empty result. */
int eval_encode_prompt(const tokenizer_t *tok, const char *tmpl, const char *text, int32_t **ids,
                       int *n);

/* Called for every scored prompt (i in eval order), e.g. to print examples. */
typedef void (*eval_sample_fn)(void *arg, int i, const char *prompt, const char *completion,
                               const char *answer, double reward);

typedef struct eval_opts {
    int n;                           /* prompts: the first n of the eval split; 0 = all */
    int max_new_tokens;              /* >= 1 */
    int max_batch;                   /* prompts generated together; 0 = 64 */
    const char *prompt_template;     /* NULL: the prompt as it is */
    const char *const *stop_strings; /* (n_stop_strings) */
    int n_stop_strings;
    double correct_at;        /* a reward >= this is correct; 0 means 1 */
    eval_sample_fn on_sample; /* may be NULL */
    void *arg;
} eval_opts_t;

/* max_new_tokens, prompt template and stop strings from the rollout section (pointers
 * into c), every eval prompt, batches of rollout.max_batch. */
void eval_opts_from_config(eval_opts_t *o, const moerl_config_t *c);

typedef struct eval_result {
    int n;           /* prompts scored */
    int correct;     /* reward >= correct_at */
    double accuracy; /* correct / n */
    double reward_mean;
    double tokens_mean; /* generated tokens per prompt */
    int truncated;      /* stopped by max_new_tokens */
} eval_result_t;

/* Greedy (temperature 0) generation for eval items 0 .. n-1 of d with the model and
 * adapter ad (NULL: the base), on a rollout engine made for the call; each completion is
 * scored by fn against the item's answer. The engine leaves its adapter bound to the
 * model. MO_EINVAL when d has no eval item. */
int eval_greedy(model_t *m, const lora_adapter_t *ad, const tokenizer_t *tok, const dataset_t *d,
                const reward_fn_t *fn, const eval_opts_t *o, eval_result_t *r);

#ifdef __cplusplus
}
#endif
#endif
