/* model_glue: small device kernels the whole-model CUDA forward and backward need beside the
 * kernel table: the residual sum, the softmax top-k router's combine weights (natural or
 * replayed routing) and their gradient at the router logits. */
#ifndef MOERL_CORE_CUDA_MODEL_GLUE_H
#define MOERL_CORE_CUDA_MODEL_GLUE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every pointer is device memory; work is queued on the calling thread's stream of the
 * CUDA backend, nothing waits. Returns 0, MO_EINVAL for bad arguments, or MO_EDEVICE
 * when a launch fails (recorded as the backend's pending error too). */

/* out (n) = a (n) + b (n); out may alias a or b. */
int model_glue_add(float *out, const float *a, const float *b, size_t n);

/* The combine weights of the softmax top-k router from the selected probabilities
 * val (T, K) (top-k of the softmax, descending): w = val / sum_k val when norm (the sum in
 * k order, in f32, as router.c forms it), then times scale. w may alias val. */
int model_glue_topk_weights(float *w, const float *val, int T, int K, int norm, float scale);

/* val (T, K) = probs (T, E) [t, idx[t, k]]: the scores of given experts (routing replay),
 * for model_glue_topk_weights. idx must lie in [0, E) (checked by the caller); an index
 * outside gives NaN (nothing is read out of bounds). */
int model_glue_take(float *val, const float *probs, const int32_t *idx, int T, int E, int K);

/* dlogits (T, E) = the gradient at the softmax top-k router's logits from dweight (T, K),
 * the gradient at the combine weights of the experts idx (T, K), with probs (T, E) the
 * router's softmax: router_backward of moe/router.c for the softmax top-k kind (through
 * the weights' normalisation when norm, their scale and the softmax; in double where it
 * sums), for the training step. Overwrites dlogits. idx must lie in [0, E); an index
 * outside is skipped. */
int model_glue_router_backward(float *dlogits, const float *dweight, const int32_t *idx,
                               const float *probs, int T, int E, int K, int norm, float scale);

#ifdef __cplusplus
}
#endif
#endif
