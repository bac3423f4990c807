/* actor_exec: where the learner runs its policy model: on the host (model_forward,
 * model_backward) or on the CUDA device (actor/model_cuda.h), behind one set of calls. */
#ifndef MOERL_LEARNER_ACTOR_EXEC_H
#define MOERL_LEARNER_ACTOR_EXEC_H

#include <stddef.h>

#include "actor/model.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: T tokens of a packed batch, M MoE layers, E routed experts, K experts per token.
 *
 * DEV_CPU: every call is the model's own, nothing else happens.
 * DEV_CUDA: the frozen weights and the bound adapter are uploaded once
 * (model_cuda_upload); training forwards and backwards run model_cuda_forward_train and
 * model_cuda_backward (the LoRA gradients are added into the host adapter's grads, where
 * the optimizer reads them), scoring forwards model_cuda_logprobs, and actor_exec_sync
 * copies the host adapter's parameters to the device after they change. */
typedef struct actor_exec actor_exec_t;

/* Runs m on dev. m must stay loaded, with the adapter it has bound (the one the caller
 * trains) alive, while *out is used. DEV_CUDA: m's bound adapter is uploaded with the
 * weights; MO_ECONFIG in a build without the CUDA backend, for a model feature or adapter
 * that model_cuda refuses (the reason named: MLA, sigmoid or group-limited routers, shared
 * experts, fp8 weights, trainable routers or norms), or for a balance loss
 * (model_opts_t.aux_coef > 0); MO_EDEVICE without a usable CUDA device. With expert
 * parallelism (model_set_comm before this) the upload holds this rank's experts and its
 * MoE layers exchange rows over m's communicator (actor/model_cuda.h); the ranks on one
 * host take the visible GPUs in turn (local rank modulo their count). */
int actor_exec_new(actor_exec_t **out, model_t *m, device_t dev);
/* Frees the device copy; safe on NULL and *x == NULL. */
void actor_exec_destroy(actor_exec_t **x);

device_t actor_exec_device(const actor_exec_t *x);

/* model_forward's contract (actor/model.h). for_backward = 1 is a training forward: on
 * the device the bound adapter must be the uploaded one (MO_ESTATE otherwise).
 * for_backward = 0 scores with the bound adapter, or the base model when none is bound
 * (the reference policy). On the device, model_t.stats' load and imbalance of each MoE
 * layer are set from the experts used, summed over the ranks under expert parallelism
 * (a collective call then, as model_forward is); prob_mean and aux_loss are not formed. */
int actor_exec_forward(actor_exec_t *x, const model_batch_t *b, float *logp, float *entropy,
                       int for_backward);

/* model_backward's contract: the bound adapter's grads ACCUMULATE (the caller zeroes
 * them), from the last training forward. */
int actor_exec_backward(actor_exec_t *x, const float *dlogp, const float *dentropy);

/* The adapter's parameters changed on the host (an optimizer step, a load or a resume):
 * copies them to the device (model_cuda_sync_adapter), which ends a pending training
 * step. Nothing to do on the CPU. */
int actor_exec_sync(actor_exec_t *x);

/* One line for the logs: what runs where (the model on the CPU or the GPU; the rollout
 * engine always on the CPU). */
void actor_exec_describe(const actor_exec_t *x, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
