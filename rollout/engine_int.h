/* engine_int: the rollout engine's state, shared by engine.c (requests, admission,
 * steps on the CPU) and engine_cuda.c (the same steps on the CUDA device). */
#ifndef MOERL_ROLLOUT_ENGINE_INT_H
#define MOERL_ROLLOUT_ENGINE_INT_H
#include "actor/model_cuda.h"
#include "core/arena.h"
#include "core/status.h"
#include "rollout/decode.h"
#include "rollout/engine.h"
#include "rollout/kv_cache.h"

typedef struct engine_cuda engine_cuda_t;

typedef enum { ST_WAIT = 0, ST_RUN, ST_TAIL, ST_DONE } sample_state_t;

typedef struct eng_group eng_group_t;

/* A running sample; its results accumulate in out. */
typedef struct eng_sample {
    eng_group_t *g;
    gen_sample_t *out;
    sample_state_t state;
    kv_seq_t kv;
    int64_t budget; /* reserved KV blocks not taken yet */
    int cap;        /* capacity of out's token arrays */
    size_t text_cap;
    int max_new; /* max_new_tokens within max_seq_len */
} eng_sample_t;

struct eng_group {
    eng_group_t *next;
    gen_group_t *out;
    gen_params_t params; /* stop lists point at the copies below */
    int32_t *stop_ids;   /* (n_stop_ids) the engine's defaults and the request's */
    int n_stop_ids;
    char **stops;     /* (n_stops) */
    size_t *stop_len; /* (n_stops) */
    int n_stops;
    size_t max_stop_len;
    eng_sample_t *s; /* (G) */
    int G, P, n_done;
    int listed; /* engine_destroy's mark */
};

typedef struct queue {
    eng_group_t *head, *tail;
} queue_t;

struct engine {
    model_t *m;
    engine_opts_t opts;
    int M, K;
    rl_weights_t w;
    kv_cache_t kv;
    arena_t step_ar;     /* a step's rows and outputs */
    arena_t layer_ar;    /* a layer's temporaries */
    sampler_t *samplers; /* (n_threads) */
    int n_threads;
    int32_t *eos; /* (n_eos) default stop ids */
    int n_eos;
    const lora_adapter_t *adapter;
    int64_t version;
    int bound; /* 1: engine_set_adapter bound adapter to the model (unmerged) */
    queue_t waiting;       /* submitted, not admitted */
    queue_t prefill;       /* admitted, prompt not run yet */
    queue_t done;          /* finished, to collect */
    eng_sample_t **active; /* (n_active) samples in ST_RUN or ST_TAIL */
    int n_active, cap_active;
    int n_running; /* admitted samples not finished (max_batch counts these) */
    int n_pending; /* submitted and not collected */
    uint64_t next_ticket;
    engine_stats_t stats;
    engine_cuda_t *dev; /* device mode (opts.device DEV_CUDA): the model and KV on the GPU */
};

#define ALLOC(ptr, ar, n)                                                                          \
    do {                                                                                           \
        (ptr) = arena_alloc((ar), sizeof(*(ptr)) * (size_t)(n));                                   \
        if (!(ptr))                                                                                \
            return mo_error_wrap(MO_ENOMEM, "rollout step");                                       \
    } while (0)

#ifdef MOERL_HAVE_CUDA
/* Device mode (engine_cuda.c). open uploads e->m and the KV cache's memory (the host
 * cache keeps only its bookkeeping: kv_cache_drop_memory); close frees them. */
int engine_cuda_open(engine_t *e);
void engine_cuda_close(engine_t *e);
/* After model_set_adapter: the device takes the model's bound adapter. */
int engine_cuda_bind(engine_t *e);
/* Block src's keys and values into block dst, every layer (a fork's partial block). */
int engine_cuda_copy_block(engine_t *e, int32_t src, int32_t dst);
#ifdef MOERL_HAVE_CUDA
/* The decode steps' CUDA graphs (zeros without them). */
void engine_cuda_graph_stats(const engine_t *e, model_cuda_graph_stats_t *s);
#endif
/* The prefill of S prompt copies (tokens, cu as prefill_rows leaves them; sequence i's
 * blocks in seqs[cu[i]]) with routing (N, M, K) or NULL, and n_jobs draws: draw j for
 * sample smp[j] from the last row of sequence seq[j]. tok, lp, rc (n_jobs) receive them. */
int engine_cuda_prefill(engine_t *e, int N, int S, const int32_t *tokens, const int32_t *cu,
                        kv_seq_t *const *seqs, uint16_t *routing, int n_jobs, const int *seq,
                        eng_sample_t *const *smp, int32_t *tok, float *lp, int *rc);
/* One decode step of the active samples (rows as decode_rows leaves them), drawing every
 * row's next token: tok, lp, rc (N). */
int engine_cuda_decode(engine_t *e, int N, const int32_t *tokens, const int32_t *pos,
                       kv_seq_t *const *seqs, uint16_t *routing, int32_t *tok, float *lp,
                       int *rc);
#endif
#endif
