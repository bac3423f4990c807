/* sampler: next-token sampling from logits (temperature, top-k, top-p, min-p, greedy)
 * with the token's log-probability, and the counter-based uniform draw behind it. */
#ifndef MOERL_ROLLOUT_SAMPLER_H
#define MOERL_ROLLOUT_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: V vocabulary.
 *
 * With z = logits / temperature and p = softmax(z), the candidates are truncated in this
 * order, each step on the sorted order (probability descending, ties to the lower id):
 *   1. top-k: the k most probable tokens (k = 0: all V);
 *   2. top-p: the shortest prefix of those whose mass, renormalised over the top-k set,
 *      reaches top_p (a token is kept when the mass strictly before it is < top_p);
 *   3. min-p: tokens with p >= min_p * max(p).
 * The token is drawn from p restricted to what is left and renormalised. The most
 * probable token always survives. Without any truncation the draw walks the vocabulary
 * in id order; with truncation it walks the kept tokens in sorted order.
 *
 * The reported log-probability is log p[token]: under the temperature-scaled
 * distribution, BEFORE truncation (what a learner's forward at the same temperature
 * computes). Greedy decoding (temperature 0) takes the argmax (ties to the lower id)
 * and reports its log-probability under the temperature-1 softmax. */
typedef struct sampling_params {
    float temperature; /* 0: greedy; otherwise finite and > 0 */
    float top_p;       /* (0, 1]; 1 = off */
    int top_k;         /* >= 0; 0 = off */
    float min_p;       /* [0, 1); 0 = off */
} sampling_params_t;

/* temperature 1, top_p 1, top_k 0, min_p 0: plain sampling from the model. */
sampling_params_t sampling_params_default(void);

/* MO_EINVAL naming the first bad field and its value. */
int sampling_params_check(const sampling_params_t *p);

/* A candidate token: its weight exp(z - max z) and its id. */
typedef struct sampler_cand {
    float e;
    int32_t id;
} sampler_cand_t;

/* Work buffers for one vocabulary size; one sampler per thread. */
typedef struct sampler {
    int V;
    float *e;             /* (V) exp(z - max z) */
    sampler_cand_t *cand; /* (V) candidates, sorted for truncation */
} sampler_t;

int sampler_init(sampler_t *s, int V);
void sampler_free(sampler_t *s);

/* The draw for token `token_index` of sample `sample_index` of request `request_id`
 * under `seed`: a uniform double in [0, 1) with 53 random bits, from Philox block
 * token_index of the stream rng_stream_id("rollout.sample", request_id, sample_index).
 * It depends on nothing else (not the batch, not the thread count). */
double sampler_uniform(uint64_t seed, uint64_t request_id, uint64_t sample_index,
                       uint64_t token_index);

/* Draws a token from logits (V) with the uniform u in [0, 1); *logp receives its
 * log-probability as defined above. MO_EINVAL for bad parameters, MO_EMALFORMED when the
 * logits hold a NaN or +infinity or are all -infinity. */
int sampler_sample(sampler_t *s, const float *logits, const sampling_params_t *p, double u,
                   int32_t *token, float *logp);

/* The distribution a draw is made from: dist (V) = p truncated and renormalised (0 for
 * removed tokens; for greedy, 1 at the argmax). Returns the number of kept tokens, or a
 * negative status as sampler_sample. */
int sampler_distribution(sampler_t *s, const float *logits, const sampling_params_t *p,
                         float *dist);

#ifdef __cplusplus
}
#endif
#endif
