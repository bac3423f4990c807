/* cuda sampler: next-token sampling for a batch of logit rows on the CUDA device, the same
 * draw as rollout/sampler.h's sampler_sample() with the uniform drawn on the device. */
#ifndef MOERL_CORE_CUDA_SAMPLER_H
#define MOERL_CORE_CUDA_SAMPLER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: B rows, V vocabulary.
 *
 * One row's request: the sampling parameters (meaning and bounds as sampling_params_t)
 * and the coordinates of its draw, u = sampler_uniform(seed, request_id, sample_index,
 * token_index), computed on the device with the same Philox bits. */
typedef struct cuda_sample_req {
    float temperature;     /* 0: greedy; otherwise finite and > 0 */
    float top_p;           /* (0, 1]; 1 = off */
    int32_t top_k;         /* >= 0; 0 = off */
    float min_p;           /* [0, 1); 0 = off */
    uint64_t seed;         /* the run's seed */
    uint64_t request_id;   /* the prompt */
    uint64_t sample_index; /* which of the prompt's samples */
    uint64_t token_index;  /* which token of that sample */
} cuda_sample_req_t;

/* Samples one token per row of logits (B, V) under req (B), every pointer in device memory,
 * queued on the calling thread's stream (backend set_stream). Per row: token (B) the id,
 * logp (B) its log-probability as sampler_sample() defines it, status (B) MO_OK,
 * MO_EINVAL for bad parameters or MO_EMALFORMED for logits holding a NaN or +infinity or
 * all -infinity (token -1, logp NaN then); u (B), optional (NULL), receives the uniform.
 *
 * Tokens and log-probabilities are those of the CPU sampler except in rounding: the
 * weights exp(z - max z) are float(exp(double)) (correctly rounded where the CPU's expf may
 * differ by an ulp) and the masses the truncation and the draw compare are sums of the
 * weights in fixed point (2^(62 - bits(V)) units, exact and order-free, so the result is
 * deterministic), which can move a draw whose cumulative mass lies within about 1e-8 of its
 * target.
 *
 * Returns MO_OK when queued, MO_EINVAL for a bad shape or a NULL output, MO_EDEVICE (also
 * recorded for backend synchronize) when the launch or its scratch failed. Device scratch:
 * B * V floats, kept per (thread, stream) by the backend. */
int cuda_sample(int32_t *token, float *logp, int32_t *status, double *u, const float *logits,
                const cuda_sample_req_t *req, int B, int V);

#ifdef __cplusplus
}
#endif
#endif
