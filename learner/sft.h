/* sft: supervised warm start on prompt/response pairs (a built-in task or a JSONL file)
 * with the loss on response tokens only, training LoRA adapters or, with `full`, a
 * high-rank adapter on every projection that is merged into a new base model. */
#ifndef MOERL_LEARNER_SFT_H
#define MOERL_LEARNER_SFT_H

#include <stddef.h>
#include <stdint.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/config.h"
#include "learner/dataset.h"
#include "learner/eval.h"
#include "learner/optim.h"
#include "lora/adapter.h"
#include "reward/reward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A pair is the sequence  prompt ids (eval_encode_prompt with rollout.prompt_template)
 * + response ids (encoded as plain text) + the end-of-sequence id. The loss is the
 * negative mean log-probability of the response tokens and the end-of-sequence token
 * over the whole batch (token mean): dL/dlogp = -1/n on those tokens, 0 on the prompt.
 *
 * Full mode: the actor computes gradients for adapters only, so the whole model is
 * trained as an adapter of rank R (default: the model width, full rank for every
 * projection) on every projection (targets "all-linear"), at temperature 1/logit_scale;
 * saving merges it into the base weights (lora_merge, f32) and multiplies the final norm
 * (model.norm.weight) by logit_scale, so the saved model at temperature 1 is the trained
 * one. The embeddings and lm_head keep their initial values, and so do the routers and
 * norms unless lora.train_router / lora.train_norms train them (then in full, in both
 * modes: saved with the LoRA adapter as modules_to_save, or written by the merge in
 * place of the base's); the logit scale stands in for the confidence that training the
 * lm_head would give. Norm vectors take no weight decay (trainer_no_decay). */

typedef struct sft_opts {
    int64_t steps;     /* optimizer updates (for the schedule); >= 1 */
    int batch;         /* pairs per update; 0 = 32 */
    double lr;         /* peak learning rate; 0 = 2e-3 (full) or learner.lr (LoRA) */
    int64_t warmup;    /* warmup updates; -1 = steps / 20 */
    int full;          /* 1: full-model training through a merged adapter */
    int rank;          /* adapter rank; 0 = the model width (full) or lora.rank */
    float logit_scale; /* full mode; 0 = 16 */
    int eval_n;        /* eval prompts; 0 = every eval item (data.eval_size) */
} sft_opts_t;

/* steps 1000, the rest 0 (defaults), warmup -1. */
sft_opts_t sft_opts_default(void);

typedef struct sft_pair {
    const char *prompt;
    const char *response;
} sft_pair_t;

typedef struct sft_step_result {
    double loss;      /* mean negative logprob of the response tokens */
    double grad_norm; /* before clipping */
    double lr;
    int pairs;        /* pairs trained */
    int skipped_long; /* pairs longer than model.max_seq_len, left out */
    int64_t tokens;   /* response tokens (with end-of-sequence) */
    int applied;      /* 0 when the update was skipped as non-finite */
} sft_step_result_t;

typedef struct sft {
    const moerl_config_t *cfg; /* borrowed */
    sft_opts_t o;
    model_t *m;
    tokenizer_t *tok;
    int32_t eos;
    lora_adapter_t *ad;
    optim_t opt;
    dataset_t *d;      /* the eval split; the training pairs of a JSONL file */
    reward_fn_t *fn;   /* scores eval completions */
    int use_task;      /* training pairs from task_sft_pair */
    uint64_t next;     /* next task pair index */
    float temperature; /* 1 / logit_scale in full mode, else 1 */
    arena_t ar;        /* per-step buffers */
    int64_t step;
    struct actor_exec *exec; /* where the training step runs: run.device (learner/actor_exec.h) */
} sft_t;

/* Opens model.path, its tokenizer, the data section (dataset_open_config) and the eval
 * reward (the task's verifier, else reward.function), and builds the adapter: the lora
 * section (rank from opts), or rank R on "all-linear" with alpha = R in full mode, init
 * seed trainer_lora_seed, plus the routers and norms lora.train_router and
 * lora.train_norms ask for (model_adapter_add_full). With run.device cuda the training
 * step's forward and backward run on the GPU (learner/actor_exec.h; refused here, as
 * trainer_new refuses it, when the model or adapter cannot run there); evaluation and the
 * merge stay on the CPU. The config must outlive the sft. */
int sft_new(sft_t **out, const moerl_config_t *cfg, const sft_opts_t *opts);
void sft_destroy(sft_t **s);

/* Ids of a pair and the prompt's length: ids (P + R + 1). *ids malloc'd. */
int sft_encode_pair(const sft_t *s, const char *prompt, const char *response, int32_t **ids, int *n,
                    int *prompt_len);

/* Accumulates the SFT loss gradient of a packed batch: dlogp[t] = -1/n_total where mask[t],
 * 0 elsewhere; returns -sum(logp[t] over mask) / n_total. */
double sft_loss_grad(float *dlogp, const float *logp, const uint8_t *mask, int T, double n_total);

/* One update on n pairs, or (pairs NULL) on the next opts.batch pairs of the data. */
int sft_step(sft_t *s, const sft_pair_t *pairs, int n, sft_step_result_t *r);

/* Greedy held-out accuracy of the current weights (eval_greedy). */
int sft_eval(sft_t *s, const eval_opts_t *opts, eval_result_t *r);

/* LoRA mode: the adapter in PEFT layout at dir. Full mode: the merged model at dir. */
int sft_save(sft_t *s, const char *dir);

/* Writes the base model of m with adapter ad merged into it as a Hugging Face model
 * directory: config.json (torch_dtype float32), model.safetensors (every float tensor in
 * f32, adapted projections with scale * B A added, the tensors ad trains in full with
 * their trained values, model.norm.weight times logit_scale)
 * and the tokenizer files of m's directory. dir is created when missing. MO_EUNSUPPORTED
 * for an fp8 base. */
int sft_merge_model(const model_t *m, const lora_adapter_t *ad, float logit_scale, const char *dir);

#ifdef __cplusplus
}
#endif
#endif
