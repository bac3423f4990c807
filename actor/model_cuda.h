/* model_cuda: the policy model on the CUDA backend, from a device copy of a loaded model's
 * weights and adapter: the scoring forward (per-token logprob and entropy of a packed batch),
 * the training step (a forward that keeps its activations, and the backward to the
 * adapter's gradients) and the rollout engine's decode step over a paged KV cache. */
#ifndef MOERL_ACTOR_MODEL_CUDA_H
#define MOERL_ACTOR_MODEL_CUDA_H

#include "actor/model.h"
#include "core/cuda/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Built only with the CUDA backend (MOERL_HAVE_CUDA).
 *
 * Covered: GQA attention with optional per-head q/k RMSNorm (Qwen3), RoPE (any rope_scaling:
 * the model's inv_freq and mscale are used) and an optional sliding window (Mixtral, Qwen3's
 * use_sliding_window); MoE layers with the softmax top-k router (norm_topk_prob and
 * routed_scaling_factor as router.c applies them) and routed experts; dense SwiGLU layers
 * (mlp_only_layers); LoRA on q, k, v, o, routed experts and dense MLPs; tied or separate
 * lm_head; frozen matrices in f32 or bf16; routing replay and routing output. Every layer
 * runs as model_forward describes it (actor/model.h), through the CUDA kernel table and
 * core/cuda/moe_cuda.h. The router matrix is kept in f32 on the device (a bf16 router is
 * converted exactly), so the router logits are f32 products as on the CPU; the other bf16
 * products round their activations to bf16 (core/cuda/matmul.cu), so bf16 models agree with
 * the CPU to ~1e-2, f32 ones to ~1e-5.
 *
 * Refused at upload (MO_ECONFIG, naming the feature): multi-head latent attention, sigmoid
 * or group-limited routers and e_score_correction_bias, shared experts, weights other than
 * f32/bf16 (f16, fp8 with block scales), adapters with trainable full weights
 * (model_adapter_add_full). Neither forward updates model_t.stats or the aux loss; the
 * training step refuses a balance loss (aux_coef > 0).
 *
 * Expert parallelism: when the model holds a communicator (model_t.comm, model_set_comm;
 * the exchanges use model_set_device_comm's instead when one is set), the upload takes
 * only the routed experts this rank holds (model_t.ep_e0 .. + ep_n - 1, its E / N share;
 * MO_ECONFIG when they are not the comm rank's), and every MoE layer of the scoring
 * forward, the training step and the decode step runs moe/moe_ep.h's exchange on the device
 * (actor/model_cuda_ep.c): tokens are routed over all E experts and gathered
 * by expert as without a comm (so each owner's rows are contiguous); the dispatch offsets
 * (E + 1 int32) of the owners' experts go to every owner in one comm_alltoallv and both
 * ends' offsets are copied to the host: ONE HOST SYNC PER MoE LAYER, the only one inside
 * the layer loop; then the rows (D floats each) go to their owners (comm_alltoallv), are
 * grouped by local expert (sources in rank order, each source's rows in its order, as
 * moe_ep_forward groups them), run through the local experts' grouped blocks and go back
 * to their slots for the combine. The backward sends the combine's row gradients the same
 * way and the input-row gradients back; the local experts' adapter gradients come only
 * from this device, while those of replicated entries (attention, dense MLPs) hold this
 * rank's tokens only and are summed over the ranks by the caller, as after model_backward
 * (the learner's moe_ep_allreduce_replicated on the host gradients). Calls are then
 * collective, in the same order on every rank: a rank without tokens (T = 0) still runs
 * every MoE layer's exchanges in model_cuda_logprobs, model_cuda_forward_train and
 * model_cuda_backward (decode steps need rows on every rank). A communicator on device
 * memory (NCCL, comm_device DEV_CUDA) exchanges the device buffers directly, on the stream
 * the backend queues on for the calling thread (each exchange sets it as the comm's
 * stream: comm_set_stream with backend_cuda_stream()). A communicator
 * on host memory (single, MPI) works too, each exchange staged through host memory. The
 * exchanges' buffers are pool blocks that grow with the rows received, so the number of
 * allocations settles once the largest batch has come. With one rank (a one-rank comm set
 * in model_t.comm) every row stays local and the results are the same bits as without a
 * comm. */
typedef struct model_cuda model_cuda_t;

/* Copies m's frozen weights and, when an adapter is bound (model_set_adapter), its
 * parameters (the LoRA pairs), with room for their gradients, to device memory from the
 * CUDA backend's pool, once; builds the per-expert pointer tables. The copy is a snapshot: later
 * changes to m are not seen (upload again), nor changes to the adapter's parameters until
 * model_cuda_sync_adapter. m must stay loaded, and the adapter alive, while *out is used.
 * MO_EDEVICE without a CUDA device, MO_ECONFIG for an unsupported model (see above). */
int model_cuda_upload(model_cuda_t **out, const model_t *m);
/* Gives the device memory back; safe on NULL and *mc == NULL. */
void model_cuda_free(model_cuda_t **mc);

/* 1 when the upload holds an adapter. */
int model_cuda_has_adapter(const model_cuda_t *mc);

/* Copies the uploaded adapter's current parameters (all of lora_adapter_t.params, e.g. after
 * an optimizer step) to the device again, in one copy, and ends a pending training step
 * (its backward would see the new parameters). MO_EINVAL when the upload holds no adapter,
 * MO_ESTATE when that adapter is no longer the one bound to the model. */
int model_cuda_sync_adapter(model_cuda_t *mc);

/* Scores a packed batch of host arrays as model_forward does (tokens, positions,
 * cu_seqlens, targets, temperature, replay, routing): logp (T) and entropy (T, or NULL)
 * receive, in HOST memory, each target's log-probability (0 where the target is -1) and
 * each token's next-token entropy. With b->replay (T, M, K) the MoE layers use the given
 * experts with weights from the router's scores for them, as router_replay does (an index
 * outside [0, E) or an expert named twice for a token is MO_EMALFORMED); b->routing
 * (T, M, K), when not NULL, receives the experts used. use_adapter = 1 applies the
 * uploaded adapter (MO_EINVAL when there is none), 0 scores the base model. The batch is
 * checked on the host as model_forward checks it (MO_EINVAL naming the position). All
 * work is queued on the calling thread's stream with no host sync until the results are
 * copied back; the scratch comes from one pool block kept between calls (it grows when a
 * larger batch comes), so repeated calls make no new device allocations. */
int model_cuda_logprobs(model_cuda_t *mc, const model_batch_t *b, float *logp, float *entropy,
                        int use_adapter);

/* The training step: model_forward(for_backward = 1) and model_backward on the device.
 *
 * model_cuda_forward_train scores b as model_cuda_logprobs(mc, b, logp, entropy, 1) does
 * (the same checks, replay and routing; the same bits) and keeps, on the device, what the
 * backward needs: each layer's input, norms, q/k/v, attention output and log-sum-exp,
 * adapter inputs, router softmax, combine weights, expert outputs and MLP activations, the
 * final norm and the log-sum-exp of the logits, plus the batch's ids and routing. They live
 * in one pool block kept between calls (it grows when a larger batch comes), apart from
 * model_cuda_logprobs's scratch: scoring calls in between (e.g. the reference policy) do
 * not disturb a pending step. The upload must hold an adapter (MO_EINVAL otherwise) that is
 * still the one bound to the model (MO_ESTATE); MO_ECONFIG when the model has a balance
 * loss (model_opts_t.aux_coef > 0), which the device step does not form. A failed call
 * leaves no step pending.
 *
 * model_cuda_backward is model_backward's contract: from dlogp (T, host; ignored where the
 * target is -1) and dentropy (T, host, or NULL) of the last forward_train, it ACCUMULATES
 * the gradients of every adapter entry into the host adapter's grads (lora_adapter_t.grads,
 * the caller zeroes them first: lora_adapter_zero_grads), as model_backward adds into the
 * pairs' dA and dB. Gradients flow as on the CPU: through the frozen layers, the norms,
 * RoPE, attention, the experts, the combine weights and the router softmax into the hidden
 * state. On the device the gradients gather in a buffer laid out as lora_adapter_t.params
 * (zeroed at the start of each backward), copied back and added once at the end; the layer
 * loop queues its work with no host sync. MO_ESTATE when no successful forward_train came
 * since the upload, a failed forward_train, a backward that failed on the device,
 * model_cuda_sync_adapter, or a change of the bound adapter; MO_EINVAL (the step stays
 * pending) without dlogp or when the adapter has no gradient buffer (no_grads). The step
 * stays valid after a backward: a second backward adds the same gradients again. Repeated
 * steps on batches of one size make no new device allocations after the first, and the
 * same inputs give the same bits. */
int model_cuda_forward_train(model_cuda_t *mc, const model_batch_t *b, float *logp, float *entropy);
int model_cuda_backward(model_cuda_t *mc, const float *dlogp, const float *dentropy);

/* One decode step of the rollout engine: N rows, each the next token of a different
 * sequence whose keys and values for positions 0 .. pos[i] - 1 are in a paged KV cache in
 * device memory, in rollout/kv_cache.h's layout (kv_cache_t.mem of a keys-and-values cache
 * for this model, copied to the device: (L, NB, 2, BS Hkv Dh) floats). Host arrays except
 * kv. */
typedef struct model_cuda_decode {
    int N;                       /* rows */
    const int32_t *tokens;       /* (N) ids in [0, V) */
    const int32_t *pos;          /* (N) each row's position in its sequence, >= 0 */
    const int32_t *block_tables; /* (N, max_blocks): position p of row i's sequence is slot
                                  * p % BS of block block_tables[i, p / BS] */
    int max_blocks;              /* entries per row of block_tables */
    float *kv;                   /* DEVICE: the cache memory */
    int NB, BS;                  /* its blocks and tokens per block */
    uint16_t *routing;           /* (N, M, K) receives each row's experts, or NULL */
} model_cuda_decode_t;

/* logits (N, V, HOST) = the model's next-token logits for the rows of b, the CPU engine's
 * decode_forward then model_logits (rollout/decode.h) on the device: each layer runs the
 * scoring forward's code on the N rows (rmsnorm, q/k/v with the adapter, per-head norms,
 * RoPE at pos, o, MoE with natural routing or the dense MLP) with the attention replaced
 * by core/cuda/attn_decode.h's: each row's new key and value are stored at pos[i] of its
 * sequence in layer l of b->kv, then its query attends to positions 0 .. pos[i] (the
 * layer's sliding window honoured). The cache then holds the rows' keys and values of
 * every layer; nothing else in it is written. Results agree with the CPU as the scoring
 * forward's do (f32 ~1e-5, bf16 ~1e-2). use_adapter as in model_cuda_logprobs.
 *
 * Checked on the host (MO_EINVAL naming the row): tokens in [0, V), pos[i] < max_blocks
 * BS, the table entries of blocks 0 .. pos[i] / BS in [0, NB), and no two rows writing the
 * same block (the block holding pos[i]: one new token of different sequences, blocks
 * shared by forks must be full, as kv_seq_fork leaves them). The layer loop queues its
 * work on the calling thread's stream with no host sync; the logits are formed in chunks
 * (mc_logits_rows) and copied back chunk by chunk. Ids and tables go up in one copy into a
 * pool block kept between calls, the activations use model_cuda_logprobs's scratch:
 * repeated steps with the same N and max_blocks make no new device allocations after the
 * first. */
int model_cuda_decode(model_cuda_t *mc, const model_cuda_decode_t *b, float *logits,
                      int use_adapter);

/* model_cuda_decode with the next tokens sampled on the device (core/cuda/sampler.h's
 * cuda_sample), so no logits leave it: row i is drawn from its logits under req[i] (HOST,
 * (N): its sampling parameters and draw coordinates), and only token (N), logp (N) and status
 * (N), in HOST memory, come back, as cuda_sample defines them per row (MO_OK; MO_EINVAL for
 * bad parameters or MO_EMALFORMED for bad logits, token -1 and logp NaN then: a bad row is
 * not an error of the call). Tokens and log-probabilities are those of rollout/sampler.h's
 * sampler_sample() on model_cuda_decode's logits, to cuda_sample's rounding. The step, its
 * checks, the cache writes and routing are model_cuda_decode's; the logits are formed and
 * sampled chunk by chunk (mc_logits_rows) on the device; req goes up with the ids and
 * tables in one copy, and the results come back in one copy, from the same pool block.
 * Device scratch: cuda_sample's for one chunk. */
int model_cuda_decode_sample(model_cuda_t *mc, const model_cuda_decode_t *b,
                             const cuda_sample_req_t *req, int32_t *token, float *logp,
                             int32_t *status, int use_adapter);

/* CUDA graphs for model_cuda_decode_sample (off until turned on): the step's device work
 * (the layers, the head and the draws; not the copies in and out) is recorded once per
 * shape (N, max_blocks, use_adapter and the cache) into a graph and then replayed, one
 * launch in place of hundreds. A shape's first step runs as usual (it settles the
 * buffers), the second is recorded, later ones replay while the CUDA backend's pool hands
 * out no block (backend_cuda_memory_epoch): after any device allocation (a larger
 * prefill's scratch, an adapter of another layout) a shape runs once as usual and is
 * recorded again. A graph replays the recorded kernels, so the results are the ordinary
 * step's bits. 32 shapes are kept (least recently used replaced): a caller that pads its
 * rows and tables to a few sizes (the rollout engine does) replays nearly every step.
 * The calling thread must queue on a stream of its own (backend set_stream, with
 * backend_cuda_stream_new), as the default stream cannot be recorded. When recording
 * fails, or the upload is expert-parallel (host waits in every MoE layer), the steps run
 * as usual and model_cuda_graph_stats says why. on 0 drops every graph. */
int model_cuda_decode_graphs(model_cuda_t *mc, int on);

typedef struct model_cuda_graph_stats {
    uint64_t captured;    /* graphs recorded */
    uint64_t replayed;    /* steps launched as a graph (recording's own launch included) */
    uint64_t eager;       /* steps with graphs on that ran as usual */
    uint64_t invalidated; /* graphs dropped after a device allocation */
    char off_reason[256]; /* why graphs went off, "" while on */
} model_cuda_graph_stats_t;
/* Zeros when graphs were never turned on. */
void model_cuda_graph_stats(const model_cuda_t *mc, model_cuda_graph_stats_t *s);

/* The rollout engine's prefill on the device: S prompts, packed, each from position 0,
 * through every layer as model_cuda_logprobs runs them (causal attention within each
 * prompt, the layer's sliding window honoured), with every layer's keys and values of every
 * row also stored in a paged KV cache in device memory (model_cuda_decode_t's layout, the
 * same bits as the CPU's kv_write), then n_jobs draws, each from the next-token
 * distribution after the last row of one prompt (several draws may read the same prompt:
 * the G samples of a prompt whose prefill they share). Host arrays except kv. */
typedef struct model_cuda_prefill {
    int N;                       /* rows: every prompt token, packed */
    int S;                       /* prompts */
    const int32_t *tokens;       /* (N) ids in [0, V) */
    const int32_t *cu_seqlens;   /* (S + 1) prompt s is rows cu[s] .. cu[s+1]-1, positions 0 .. */
    const int32_t *block_tables; /* (S, max_blocks): position p of prompt s is slot p % BS of
                                  * block block_tables[s, p / BS] */
    int max_blocks;
    float *kv; /* DEVICE: the cache memory */
    int NB, BS;
    uint16_t *routing;      /* (N, M, K) receives each row's experts, or NULL */
    int n_jobs;             /* draws, >= 0 */
    const int32_t *job_seq; /* (n_jobs) the prompt whose last row draw j reads */
} model_cuda_prefill_t;
/* The prefill, then draw j taken from prompt job_seq[j]'s last-row logits under req[j] as
 * model_cuda_decode_sample draws (token, logp, status (n_jobs), HOST; a bad row is that
 * row's status, not an error of the call). Checked on the host before any device work
 * (MO_EINVAL naming the prompt, row or draw; nothing is then written): tokens in [0, V),
 * cu_seqlens strictly increasing from 0 to N (no empty prompt), S >= 1, each prompt's length
 * within max_blocks BS, the table entries it covers in [0, NB) and no block named twice
 * (by two prompts or one), job_seq in [0, S); with n_jobs > 0, req, token, logp and status
 * given (n_jobs 0: only the cache is written, they may be NULL). Only the slots of the
 * prompts' positions are written: the rest of a prompt's last block and every other block
 * keep their contents. b->routing (N, M, K) receives every row's experts.
 * use_adapter as in model_cuda_logprobs.
 *
 * Each layer runs the scoring forward's code on the N rows with an attention core that
 * first stores the rows' keys and values (after the per-head norm and RoPE) at their slots
 * (core/cuda/attn_decode.h's cuda_kv_store), then runs the packed causal attention. Draw
 * j reads row cu[job_seq[j] + 1] - 1 of the last layer's output; the n_jobs rows go through
 * the final norm, lm_head in chunks (mc_logits_rows, no larger than the N-row scratch's)
 * and cuda_sample, as model_cuda_decode_sample's rows do. The draws, slots, ids and
 * positions go up in one copy and the results come back in one copy, through the decode
 * step's pool block (kept between calls); the activations use model_cuda_logprobs's
 * scratch. Results agree with the CPU engine's prefill (decode_forward with prefill rows)
 * as the scoring forward's do (f32 ~1e-5, bf16 ~1e-2). */
int model_cuda_prefill_sample(model_cuda_t *mc, const model_cuda_prefill_t *b,
                              const cuda_sample_req_t *req, int32_t *token, float *logp,
                              int32_t *status, int use_adapter);
/* A paged KV cache for this model in device memory, owned by the upload: (L, NB, 2, BS Hkv
 * Dh) floats (rollout/kv_cache.h's layout) from the backend's pool, zeroed; *kv receives it.
 * A second call with the same shape zeroes the same memory again; with another shape it
 * gives the old memory back first (after the stream drains). The zeroing is done when the
 * call returns, so another thread (stream) may use the cache next. Freed with the upload.
 * MO_EINVAL for NB or BS < 1, MO_ENOMEM naming the bytes. */
int model_cuda_kv_alloc(model_cuda_t *mc, int NB, int BS, float **kv);
/* Copies block src of the upload's KV cache to block dst in every layer (the partial last
 * block of a prompt that kv_seq_fork gave to a new sample): one device kernel over the
 * layers (core/cuda/attn_decode.h's cuda_kv_copy_block), queued on the calling thread's
 * stream with no host sync. MO_EINVAL for a block outside [0, NB) or without a cache
 * (model_cuda_kv_alloc). */
int model_cuda_kv_copy_block(model_cuda_t *mc, int32_t src, int32_t dst);
/* Takes the adapter now bound to the model (model_set_adapter; NULL: none) in place of the
 * uploaded one, without uploading the frozen weights again: its parameters are copied to
 * the device. The adapter lives in a pool block of its own (parameters, room for their
 * gradients, the pointer tables of its pairs): when the new adapter's layout matches the
 * uploaded one's (the same entries with the same shapes, offsets, rank and scale) that
 * block and its tables are reused and only the parameters are copied (no device
 * allocation); otherwise a new block is built and the old one given back, and the training
 * step's state is freed (its buffers depend on the rank). With NULL the upload holds no
 * adapter (use_adapter = 1 is then refused). Waits for queued work first; ends a pending
 * training step. MO_EINVAL for an adapter the upload would refuse (full weights), naming
 * its first full tensor; the previous adapter then stays. */
int model_cuda_rebind_adapter(model_cuda_t *mc);
#ifdef __cplusplus
}
#endif
#endif
