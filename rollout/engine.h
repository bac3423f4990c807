/* engine: the rollout generation engine: batched prefill and decode of many requests
 * with a paged KV cache, G samples per prompt sharing the prompt's prefill, sampling,
 * per-token logprobs, the routing record, stop conditions, and adapter hot-swap. */
#ifndef MOERL_ROLLOUT_ENGINE_H
#define MOERL_ROLLOUT_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/config.h"
#include "core/tensor.h"
#include "lora/adapter.h"
#include "rollout/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: P prompt tokens, G samples of a prompt, n generated tokens of a sample,
 * M MoE layers, K experts per token, V vocabulary.
 *
 * Life of a request: engine_submit checks it (a bad one comes back at once through
 * engine_collect with its error) and queues it; engine_step admits queued requests in
 * order while the KV budget and max_batch allow (a request reserves every KV block it
 * may need, so admitted work never runs out; the rest waits), then runs ONE iteration:
 * a prefill of admitted prompts (each prompt once; its K/V is then shared by its G
 * samples and each sample draws its first token), or else one decode of every running
 * sample (all rows through each matrix product together). A group is collected when
 * all its samples have finished.
 *
 * Randomness: token i of sample j of request id is drawn with
 * sampler_uniform(seed, id, j, i): results do not depend on what else is in the batch,
 * on scheduling, or on the thread count (beyond float rounding of batched products).
 *
 * Per generated token the engine reports the id, its log-probability (see sampler.h:
 * after temperature, before truncation; greedy reports the temperature-1 value), and
 * with record_routing the experts it was routed to when the model read it: row i of a
 * sample's routing belongs to generated token i (the last token is read once more, only
 * for its routing), so prompt_routing rows then routing rows form the (P + n, M, K)
 * replay of the whole sequence for model_batch_t.replay.
 *
 * The engine drives the model it is given: it binds adapters to it (engine_set_adapter)
 * and must be its only user while it runs. One thread calls the engine; the kernels use
 * the CPU backend's threads, or with device DEV_CUDA the calling thread's CUDA stream:
 * the same results to the rounding of the device's products (f32 weights ~1e-5, bf16
 * weights ~1e-2 in the logits, so a sampled token may differ where two candidates are
 * that close). */

typedef enum {
    FINISH_NONE = 0,    /* still running */
    FINISH_LENGTH,      /* max_new_tokens reached, or the sequence reached max_seq_len */
    FINISH_STOP_TOKEN,  /* a stop id (eos) was generated; it is the last token */
    FINISH_STOP_STRING, /* the text matched a stop string */
    FINISH_ERROR,       /* the request failed (see gen_group_t.error) */
} finish_reason_t;

/* "running", "length", "stop_token", "stop_string", "error". */
const char *finish_reason_name(finish_reason_t r);

typedef struct engine_opts {
    int max_batch;           /* samples running at once; 0 = 64 */
    int max_seq_len;         /* prompt + completion tokens; 0 = min(2048, the model's
                              * max_position_embeddings) */
    int64_t kv_cache_tokens; /* KV budget; 0 = max_batch * max_seq_len */
    int max_prefill_tokens;  /* prompt tokens per prefill step; 0 = 4096 (a longer prompt
                              * is prefilled alone) */
    int block_tokens;        /* KV block size; 0 = KV_BLOCK_TOKENS */
    int merge_adapter;       /* 1: fold adapters into copies of the weights they adapt
                              * (faster decode, base weights' rounding: logprobs then differ
                              * from the unmerged learner by the merge's rounding) */
    const tokenizer_t *tok;  /* for texts and stop strings; may be NULL (no text) */
    int no_default_stops;    /* 1: the model's eos ids and the tokenizer's eos are not stop
                              * ids (only each request's own) */
    int no_prefix_sharing;   /* 1: every sample runs its own prefill of the prompt (the
                              * default shares one prefill among a group's samples) */
    int no_packed_weights;   /* 1: no packed copy of the bf16 weights for the AMX tiles
                              * (saves one copy of them in memory; the products then read
                              * the weights in place, slower). No effect without AMX. */
    device_t device;         /* DEV_CPU (0), or DEV_CUDA: the model's weights, the adapter and
                              * the KV cache live on the GPU, and every prefill and decode
                              * step runs there (actor/model_cuda.h), sampling included; the
                              * requests, stop conditions and results stay on the host.
                              * Needs a build with CUDA and a device, and a model the CUDA path
                              * runs (MO_ECONFIG names what is missing); merge_adapter is
                              * refused there. */
    int cuda_graphs;         /* device mode: decode steps recorded as CUDA graphs and replayed
                              * (model_cuda_decode_graphs); their rows padded to 1, 2, 4, 8,
                              * then multiples of 8, and their tables to powers of two, so
                              * few shapes cover every step; the engine's device work runs
                              * on a stream of its own. Padding changes a real row's results
                              * only in rounding (the products' shapes change). */
} engine_opts_t;

/* The rollout section of a job config (and model.max_seq_len) as engine options. */
void engine_opts_from_config(engine_opts_t *o, const moerl_config_t *c);

typedef struct gen_params {
    sampling_params_t sampling;
    int max_new_tokens; /* >= 1 */
    uint64_t seed;
    const int32_t *stop_ids; /* (n_stop_ids) extra stop ids, copied at submit */
    int n_stop_ids;
    const char *const *stop_strings; /* (n_stop_strings) non-empty, copied at submit */
    int n_stop_strings;
    int include_stop_string;   /* 1: the text keeps the matched stop string */
    int ignore_eos;            /* 1: the engine's default stop ids do not apply */
    int record_routing;        /* 1: each generated token's experts */
    int record_prompt_routing; /* 1: the prompt's experts (once per group) */
} gen_params_t;

/* Sampling from the config's rollout section; stop strings point into the config. */
void gen_params_from_config(gen_params_t *p, const moerl_config_t *c);
/* temperature 1, no truncation, 256 new tokens, seed 0, routing recorded. */
gen_params_t gen_params_default(void);

typedef struct gen_request {
    uint64_t id;           /* the caller's; keys the random draws */
    const int32_t *prompt; /* (prompt_len) copied at submit */
    int prompt_len;
    int n; /* G samples */
    gen_params_t params;
} gen_request_t;

typedef struct gen_sample {
    int index; /* 0 .. G-1 */
    int n_tokens;
    int32_t *tokens;   /* (n_tokens) including a final stop id */
    float *logprobs;   /* (n_tokens) */
    uint16_t *routing; /* (n_tokens, M, K), or NULL */
    finish_reason_t finish;
    int64_t version_first; /* adapter version that sampled the first token */
    int64_t version_last;  /* ... and the last one */
    char *text;            /* the completion's text (NUL-terminated), or NULL without a
                            * tokenizer: the tokens' bytes without a final stop id's, cut
                            * before a matched stop string (or after it, include_stop_string) */
    size_t text_len;
} gen_sample_t;

typedef struct gen_group {
    uint64_t id;
    uint64_t ticket; /* submission order within the engine, from 0 */
    int status;      /* MO_OK, or the error that rejected or failed the request */
    char *error;     /* the message when status < 0, else NULL */
    int prompt_len;
    int32_t *prompt;          /* (prompt_len) */
    uint16_t *prompt_routing; /* (prompt_len, M, K), or NULL */
    int M, K;
    int n;
    gen_sample_t *samples; /* (n); 0 when rejected at submit */
} gen_group_t;

void gen_group_free(gen_group_t **g);

/* Counters since engine_new. */
typedef struct engine_stats {
    int64_t steps_prefill, steps_decode;
    int64_t prefill_tokens; /* prompt tokens run (each prompt once per group) */
    int64_t decode_rows;    /* rows of decode steps */
    int64_t generated;      /* tokens sampled */
    int64_t kv_peak_tokens; /* most KV tokens in use at once */
    int64_t waited;         /* admissions deferred for lack of KV or batch room */
} engine_stats_t;

typedef struct engine engine_t;

/* opts may be NULL (defaults). The KV cache is allocated here. */
int engine_new(engine_t **out, model_t *m, const engine_opts_t *opts);
/* Frees the engine and every request it holds; an adapter the engine bound to the model
 * (unmerged mode) is unbound. */
void engine_destroy(engine_t **e);

/* Replaces the adapter (NULL: the base) between steps; running samples continue with it
 * from their next token, keeping the keys and values already cached. version is
 * recorded in the samples (version_first / version_last). The adapter must outlive its
 * use, and its values must not change until the next engine_set_adapter (set it again
 * after changing them: MLA models keep the absorbed kv_b_proj built from them). MO_EINVAL when it does not fit the model (the previous adapter stays). */
int engine_set_adapter(engine_t *e, const lora_adapter_t *ad, int64_t version);

/* Queues a request. MO_OK when accepted. A bad request (empty prompt, an id outside
 * [0, V), a prompt that leaves no room within max_seq_len, n < 1 or > max_batch,
 * max_new_tokens < 1, bad sampling values, stop strings without a tokenizer, more KV
 * than the whole cache) returns its error AND comes back through engine_collect as a
 * group with that status and message, so every id submitted is answered once. */
int engine_submit(engine_t *e, const gen_request_t *r);

/* One iteration: 1 when work was done, 0 when there was nothing to do, a negative
 * status when the step failed (its groups are then finished with the error; the engine
 * stays usable). */
int engine_step(engine_t *e);

/* The next finished group (in order of finishing): 1 and *out set, or 0 when none. The
 * caller frees it with gen_group_free. */
int engine_collect(engine_t *e, gen_group_t **out);

/* Requests submitted and not yet collected. */
int engine_pending(const engine_t *e);
/* Bytes the engine's KV cache holds per token over all layers (kv_cache_token_bytes):
 * 2 L Hkv Dh floats, or L (kv_lora_rank + qk_rope_head_dim) floats for MLA. */
size_t engine_kv_token_bytes(const engine_t *e);

/* Runs n requests to completion on an idle engine (MO_ESTATE otherwise): out (n)
 * receives their groups in request order (per-request errors inside them). Returns
 * MO_OK, or the first step failure (out is then still filled). */
int engine_generate(engine_t *e, const gen_request_t *reqs, int n, gen_group_t **out);

engine_stats_t engine_get_stats(const engine_t *e);

/* Device mode with opts.cuda_graphs: the decode steps' CUDA graphs (actor/model_cuda.h's
 * model_cuda_graph_stats). Zeros without them. */
typedef struct engine_graph_stats {
    uint64_t captured;    /* graphs recorded */
    uint64_t replayed;    /* steps launched as a graph */
    uint64_t eager;       /* steps run kernel by kernel while graphs were on */
    uint64_t invalidated; /* graphs dropped after a device allocation */
    char off_reason[256]; /* why graphs went off ("" while they are on) */
} engine_graph_stats_t;
void engine_get_graph_stats(const engine_t *e, engine_graph_stats_t *s);
/* The effective options (defaults resolved). */
engine_opts_t engine_get_opts(const engine_t *e);

#ifdef __cplusplus
}
#endif
#endif
