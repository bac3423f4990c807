/* sample: a scored group of completions as the learner receives it: the prompt, G
 * samples with their tokens, rollout logprobs, recorded routing, versions and rewards. */
#ifndef MOERL_LEARNER_SAMPLE_H
#define MOERL_LEARNER_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: P prompt tokens, n completion tokens of a sample, G samples of a group,
 * M MoE layers, K experts per token.
 *
 * Routing layout. A group may carry the experts the rollout routed each token to:
 *   prompt_routing (P, M, K): row i = the experts of prompt token i (once per group:
 *                             its G samples share the prompt's prefill);
 *   routing (n, M, K):        row i = the experts of completion token i, recorded when
 *                             the model read it (the last token is read once more, only
 *                             for its routing).
 * So prompt_routing rows followed by a sample's routing rows are the (P + n, M, K)
 * replay of the sequence prompt + completion, row for row, as model_batch_t.replay
 * takes it. Either part may be absent (NULL); the learner then uses its own routing for
 * the missing rows. Within a row the K experts are in the router's order; comparisons
 * treat them as a set. */

/* How a completion ended; the values equal rollout/engine.h's finish_reason_t. */
typedef enum {
    SAMPLE_FINISH_LENGTH = 1,      /* cut by max_new_tokens or max_seq_len: truncated */
    SAMPLE_FINISH_STOP_TOKEN = 2,  /* ended with a stop id (eos), the last token */
    SAMPLE_FINISH_STOP_STRING = 3, /* the text matched a stop string */
} sample_finish_t;

/* "length", "stop_token", "stop_string", or "invalid". */
const char *sample_finish_name(int finish);

/* One completion. Every pointer is its own malloc'd block owned by the group. */
typedef struct sample {
    int n_tokens;          /* n >= 1 */
    int32_t *tokens;       /* (n) completion ids, a final stop id included */
    float *logprobs;       /* (n) the rollout's log-probability of each token: after
                            * temperature, before truncation (docs/rl.md) */
    uint16_t *routing;     /* (n, M, K) or NULL */
    int finish;            /* sample_finish_t */
    int64_t version_first; /* policy (adapter) version that sampled the first token */
    int64_t version_last;  /* ... and the last one (>= version_first) */
    float reward;
    int64_t reward_version; /* version of the reward function that scored it */
} sample_t;

typedef struct sample_group {
    uint64_t id;              /* the prompt's id (lease), unique within a run */
    int prompt_len;           /* P >= 1 */
    int32_t *prompt;          /* (P) prompt ids, template and affixes applied */
    uint16_t *prompt_routing; /* (P, M, K) or NULL */
    int M, K;                 /* routing layout; 0, 0 when the group has no routing */
    int n_samples;            /* G >= 1 */
    sample_t *samples;        /* (G) */
} sample_group_t;

/* Allocates a group with every array (uninitialised values, NULL routing unless asked):
 * n_tokens (G) the completion lengths; prompt_routing / routing 1 to allocate them
 * (then M, K >= 1). Versions, rewards and finish are zero. MO_EINVAL for bad sizes. */
int sample_group_alloc(sample_group_t **out, uint64_t id, int prompt_len, const int *n_tokens,
                       int G, int M, int K, int prompt_routing, int routing);
/* Frees every array and the group; *g = NULL. */
void sample_group_destroy(sample_group_t **g);
/* A deep copy. */
int sample_group_copy(sample_group_t **out, const sample_group_t *g);

/* 1 when the completion finished (stop token or string), 0 when truncated. */
int sample_finished(const sample_t *s);

/* Checks a group against a model: ids in [0, V), P, n, G >= 1, logprobs finite and
 * <= 1e-3, a valid finish, version_last >= version_first, routing (when present) with
 * the model's M and K, experts < E and distinct within a row, a finite reward.
 * MO_EMALFORMED naming the group id, sample and field. V, M, K, E as in the model
 * (M = 0: the model has no MoE layer and the group must carry no routing). */
int sample_group_check(const sample_group_t *g, int V, int M, int K, int E);

/* Tokens of the sequence prompt + completion of sample s: P + n. */
static inline int sample_seq_len(const sample_group_t *g, int s) {
    return g->prompt_len + g->samples[s].n_tokens;
}

#ifdef __cplusplus
}
#endif
#endif
