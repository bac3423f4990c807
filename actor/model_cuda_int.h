/* model_cuda_int: what the parts of the CUDA model share: the device layout of the
 * weights, the per-call buffers, and the layer forward the scoring forward (model_cuda.c),
 * the training step (model_cuda_train.c), the decode step (model_cuda_decode.c) and the
 * prefill (model_cuda_prefill.c) run.
 * Private to actor/. */
#ifndef MOERL_ACTOR_MODEL_CUDA_INT_H
#define MOERL_ACTOR_MODEL_CUDA_INT_H

#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "core/backend.h"
#include "core/cuda/moe_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Byte alignment of every buffer carved from a pool block. */
#define MC_ALIGN 256

/* One decoder layer's weights on the device. Adapter tables have A == NULL where the
 * projection has no adapter; their dA and dB tables point into model_cuda.dgrads. */
typedef struct mc_layer {
    int moe;                           /* 1: routed experts, 0: dense MLP */
    int moe_index;                     /* index among the MoE layers, -1 when dense */
    int window;                        /* attention window, 0: full causal */
    const float *attn_norm, *mlp_norm; /* (D) */
    const float *q_norm, *k_norm;      /* (Dh), or NULL */
    wview_t wq, wk, wv;                /* (H Dh, D), (Hkv Dh, D), (Hkv Dh, D) */
    wview_t wo;                        /* (D, H Dh) */
    moe_cuda_lora_t lq, lk, lv, lo;    /* one-entry tables */
    wview_t router;                    /* (E, D) f32 */
    int norm_topk;                     /* router_cfg_t.norm_topk_prob */
    float route_scale;                 /* router_cfg_t.routed_scaling_factor */
    moe_cuda_experts_t ex;             /* E routed experts, or the dense MLP as one */
    int n_ex;                          /* E, or 1 for a dense layer */
    int F;                             /* hidden width of one expert (or the dense MLP) */
} mc_layer_t;

/* A batch's ids on the device, carved in this order at the start of a block so that
 * mc_upload_batch fills them with one copy (mc_ids_layout). */
typedef struct mc_ids {
    int32_t *tok, *pos, *tgt; /* (T) targets -1 stored as 0 */
    int32_t *cu;              /* (B + 1) */
    int32_t *off1;            /* (2) {0, T}: the offsets of a one-expert group */
    int32_t *route;           /* (M, T, K) experts of each MoE layer's tokens */
} mc_ids_t;

/* Where one layer's forward reads its input and writes what it forms. The scoring forward
 * points every layer at the same scratch (several fields share a buffer there); the
 * training forward gives each layer its own buffers, kept for the backward. Shapes: S = T K
 * slots; rows = S for a MoE layer, T for a dense one; F the layer's hidden width. */
typedef struct mc_acts {
    const float *x;                   /* (T, D) layer input */
    float *out;                       /* (T, D) layer output (may be x) */
    float *ln1, *rstd1;               /* (T, D) rmsnorm(x), (T) */
    float *q, *k;                     /* (T, H Dh), (T, Hkv Dh) before the per-head norm
                                       * (used only with q_norm / k_norm) */
    float *rstd_q, *rstd_k;           /* (T H), (T Hkv) per-head norm scales */
    float *qr, *kr, *v;               /* (T, H Dh), (T, Hkv Dh), (T, Hkv Dh) */
    float *att, *lse;                 /* (T, H Dh) attention output, (T, H) */
    float *xa_q, *xa_k, *xa_v, *xa_o; /* (T, R) adapter inputs x A^T */
    float *h1;                        /* (T, D) x + attention */
    float *ln2, *rstd2;               /* (T, D) rmsnorm(h1), (T) */
    float *probs;                     /* (T, E) router softmax (MoE) */
    float *wt;                        /* (T, K) combine weights (MoE) */
    float *yg;                        /* (S, D) expert outputs grouped by expert (MoE) */
    float *g, *u, *h;                 /* (rows, F) expert MLP activations */
    float *xa_g, *xa_u, *xa_d;        /* (rows, R) expert adapter inputs */
} mc_acts_t;

/* The per-call device buffers of the scoring forward, carved from mc->smem; the training
 * step uses the ones it does not keep (o, rlogits, val, xg, logits, logp, ent). */
typedef struct mc_scratch {
    mc_ids_t id;
    float *x;                  /* (T, D) residual stream */
    float *h1;                 /* (T, D) x + attention */
    float *ln;                 /* (T, D) rmsnorm output */
    float *o;                  /* (T, D) attention output projection, then the ffn output */
    float *q, *qr, *att;       /* (T, H Dh) */
    float *k, *kr, *v;         /* (T, Hkv Dh) */
    float *lse_att;            /* (T, H) */
    float *rstd;               /* (T H) */
    float *xa;                 /* (T, R) adapter inputs of the attention projections */
    float *rlogits, *probs;    /* (T, E) */
    float *val, *wt;           /* (T, K) */
    float *xg, *yg;            /* (rows_ex, D) rows grouped by expert */
    float *g, *u, *h;          /* (rows_ex, F) */
    float *xa_g, *xa_u, *xa_d; /* (rows_ex, R) */
    float *hf;                 /* (T, D) final norm */
    float *lse, *logp, *ent;   /* (T) */
    float *logits;             /* (rows, V) one chunk of logits */
} mc_scratch_t;

typedef struct mc_train mc_train_t; /* the training step's state (model_cuda_train.c) */
typedef struct mc_ep mc_ep_t;       /* expert parallelism's state (model_cuda_ep.c) */

/* The attention core of layer l: a->att (T, H Dh) from a->qr, a->kr and a->v (after the
 * per-head norms and RoPE). */
typedef int (*mc_attend_fn)(model_cuda_t *mc, int l, const mc_acts_t *a, int T);

/* The paged KV cache a decode step attends over (model_cuda_decode.c), or a prefill
 * stores into (model_cuda_prefill.c). */
typedef struct mc_kv {
    float *mem;            /* (L, NB, 2, BS Hkv Dh) device, rollout/kv_cache.h's layout */
    int NB, BS;            /* blocks, tokens per block */
    const int32_t *tables; /* (T, max_blocks) device: row i's block table (decode) */
    int max_blocks;
    const int32_t *slot; /* (T) device: row t's slot, block BS + pos % BS (prefill) */
    int B;               /* sequences of the packed rows (prefill) */
} mc_kv_t;

struct model_cuda {
    const model_t *m;
    const backend_t *be;
    int L, D, H, Hkv, Dh, E, K, V;
    int R;                    /* adapter rank, 0 without an adapter */
    const lora_adapter_t *ad; /* the adapter uploaded, or NULL */
    float *dparams;           /* (ad->n_params) its parameters on the device */
    float *dgrads;            /* (ad->n_params) their gradients on the device, same layout */
    int Fmax;                 /* the widest expert or dense MLP */
    int n_moe;                /* MoE layers */
    int dense;                /* 1 when some layer is dense */
    wview_t embed, lm_head;   /* (V, D) */
    const float *final_norm;  /* (D) */
    const float *inv_freq;    /* (Dh / 2) */
    mc_layer_t *layers;       /* (L) */
    void *wmem;               /* the pool block of weights and tables */
    void *amem;               /* the pool block of the adapter: dparams, dgrads, its tables */
    float *kvmem;             /* model_cuda_kv_alloc's cache, (L, NB, 2, BS Hkv Dh), or NULL */
    int kv_NB, kv_BS;         /* its blocks and tokens per block */
    void *smem;               /* the pool block of scratch */
    size_t scap;              /* its bytes */
    moe_cuda_plan_t plan;     /* for up to plan_T tokens (plan.T: this call's) */
    int plan_T;
    int replay; /* 1: this call's batch replays its routing */
    mc_scratch_t s;
    /* This call's ids and dispatch plan: the scratch's for scoring, the training step's
     * own while it runs. */
    const mc_ids_t *id;
    moe_cuda_plan_t *cur_plan;
    mc_train_t *tr; /* NULL until the first model_cuda_forward_train */
    mc_ep_t *ep;    /* the MoE layers' exchanges over m->comm; NULL without one */
    /* This call's attention core: NULL runs causal attention over the packed sequences
     * (mc->id->cu); the decode step sets its own over kv while it runs. */
    mc_attend_fn attend;
    mc_kv_t kv;
    /* The decode step's ids (mc_ids_layout for its rows) and block tables, and when it
     * samples its draws and results, in their own pool block kept between calls; its
     * activations use the scoring scratch. */
    mc_ids_t did;
    int32_t *dtables;        /* (N, max_blocks) */
    cuda_sample_req_t *dreq; /* (N) the rows' draws, when sampling */
    int32_t *dtok, *dstatus; /* (N) sampled tokens and statuses */
    float *dlogp;            /* (N) their log-probabilities */
    void *dmem;
    size_t dcap;
    struct mc_graphs *graphs; /* model_cuda_decode_graphs' recorded steps, or NULL (off) */
};

/* ---- CUDA graphs of the decode step (model_cuda_graph.c) ---- */

/* What a recorded step's kernels and their arguments depend on besides the buffers'
 * addresses: the rows, the tables' width, the adapter, the cache. */
typedef struct mc_graph_key {
    int N, max_blocks, ad, NB, BS;
    const float *kv;
} mc_graph_key_t;

/* A step's device work, queued on the thread's stream without waiting or allocating. */
typedef int (*mc_work_fn)(model_cuda_t *mc, void *arg);

/* Runs work for a step of shape key: without graphs (or after they failed) as it is;
 * else the first step of a shape as it is (it settles the buffers), the next one recorded
 * into a graph and launched, later ones replaying that graph while
 * backend_cuda_memory_epoch is unchanged (a step after any device allocation is an
 * ordinary one again, then recorded anew). Replays read the inputs from the buffers the
 * recording read: the caller uploads them to the same places first. */
int mc_graph_run(model_cuda_t *mc, const mc_graph_key_t *key, mc_work_fn work, void *arg);
void mc_graphs_free(model_cuda_t *mc);

/* Grow-only carving of a pool block: base NULL only measures. */
typedef struct mc_bump {
    char *base;
    size_t off;
} mc_bump_t;

void *mc_bump(mc_bump_t *b, size_t bytes);
#define MC_BUMP(ptr, b, n) ((ptr) = mc_bump((b), sizeof(*(ptr)) * (size_t)(n)))

/* Carves the ids of T tokens, B sequences and M MoE layers at the start of b. */
void mc_ids_layout(const model_cuda_t *mc, mc_bump_t *b, mc_ids_t *id, int T, int B);
/* Rows of logits formed at a time for T tokens. */
int mc_logits_rows(const model_cuda_t *mc, int T);
/* The scoring scratch and mc->plan ready for T tokens of B sequences. */
int mc_scratch_ready(model_cuda_t *mc, int T, int B);
/* *mem (a pool block of *cap bytes) holds at least need bytes: a larger block replaces it
 * (its contents are not kept). */
int mc_block_ready(model_cuda_t *mc, void **mem, size_t *cap, size_t need);
/* *plan ready for T tokens when the model has MoE layers: *plan_T is the tokens its arrays
 * hold, grown (a new pool block) only for a larger T, so alternating prefills and decode
 * steps allocate nothing once the largest has come (CUDA graphs stay valid). */
int mc_plan_ready(const model_cuda_t *mc, moe_cuda_plan_t *plan, int *plan_T, int T);
/* The expert blocks' activation pointers of layer activations a (the LoRA inputs only for
 * the adapted projections of w). */
moe_cuda_acts_t mc_expert_acts(const mc_acts_t *a, const moe_cuda_experts_t *w);
/* Rows the expert blocks of a T-token batch may hold: T K slots when some layer is MoE,
 * at least T when some layer is a dense MLP. */
size_t mc_expert_rows(const model_cuda_t *mc, int T);
/* The experts (or dense MLP) table of ly, without its adapters when ad is 0. */
moe_cuda_experts_t mc_experts_of(const mc_layer_t *ly, int ad);
/* Sorts w (n entries, each a block << 32 | its holder) and finds a block with two holders:
 * 1 with them (o1, o2) and the block, 0 when every block has one (model_cuda_decode.c). */
int mc_shared_block(int64_t *w, size_t n, int *o1, int *o2, int *blk);
/* The end of a step over the paged cache (decode or prefill) whose device work returned
 * rc: the attention core back to the scoring forward's, then n_draws draws (token, logp,
 * status) and the N rows' routing (when routing) copied out; a failure through mc_fail. */
int mc_paged_finish(model_cuda_t *mc, int rc, int n_draws, int32_t *token, float *logp,
                    int32_t *status, uint16_t *routing, int N, const char *fn);
/* model_forward's checks of b (and of its replay), messages prefixed by fn. */
int mc_check_batch(const model_cuda_t *mc, const model_batch_t *b, const float *logp,
                   const char *fn);
/* Copies b's ids (and replayed experts) into id with one host-to-device copy. */
int mc_upload_batch(model_cuda_t *mc, const mc_ids_t *id, const model_batch_t *b, const char *fn);
/* a->out = layer l on a->x, with the adapter when ad; reads mc->id, mc->cur_plan,
 * mc->replay and mc->attend, uses mc->s.o, s.rlogits, s.val and s.xg as temporaries. */
int mc_layer_forward(model_cuda_t *mc, int l, const mc_acts_t *a, int T, int B, int ad);
/* The scoring forward's acts: every layer on the scratch s, in place on s->x (several
 * fields share a buffer). */
mc_acts_t mc_scoring_acts(const mc_scratch_t *s);
/* hf (T, D), rstd (T) = the final norm of x; lse, logp, ent (T) from the chunked lm_head
 * (mc->s.logits) at temperature. */
void mc_head_forward(const model_cuda_t *mc, float *hf, float *rstd, float *lse, float *logp,
                     float *ent, const float *x, int T, float temperature);
/* b->routing (T, M, K) from route (M, T, K) on the device. */
int mc_routing_out(model_cuda_t *mc, const int32_t *route, const model_batch_t *b, const char *fn);
/* MO_EINVAL unless use_adapter is 0, or 1 with an adapter in the upload. */
int mc_check_use_adapter(const model_cuda_t *mc, int use_adapter, const char *fn);
/* A forward's results to the host: logp and entropy (or NULL) from mc->s (T), 0 where the
 * target is -1, and the routing (b->routing) from route. */
int mc_results_out(model_cuda_t *mc, const model_batch_t *b, float *logp, float *entropy,
                   const int32_t *route, const char *fn);
/* hf (n, D), rstd (n) = the final norm of x (n, D); then the logits in chunks of rows
 * (<= mc_logits_rows(mc, T) of the scratch's T) in mc->s.logits, each copied into logits
 * (n, V, HOST) or, when logits is NULL, sampled on the device into mc->dtok, dlogp and
 * dstatus under mc->dreq (n). Queued with no host sync except the copies out
 * (model_cuda_decode.c). */
int mc_head_out(model_cuda_t *mc, float *hf, float *rstd, const float *x, int n, int rows,
                float *logits);
/* The n sampled rows (mc->dtok, dstatus, dlogp, carved in that order) into host memory in
 * one copy. */
int mc_download_samples(model_cuda_t *mc, int n, int32_t *token, float *logp, int32_t *status,
                        const char *fn);
/* Drains the stream after a failure, keeping its message under fn. */
int mc_fail(model_cuda_t *mc, int rc, const char *fn);
/* Frees the training step's state (model_cuda_train.c); safe when there is none. */
void mc_train_free(model_cuda_t *mc);
/* Ends a pending training step (its backward is then MO_ESTATE). */
void mc_train_invalidate(model_cuda_t *mc);

/* Expert parallelism (model_cuda_ep.c). */
/* The routed experts m holds: e0 .. e0 + n - 1 (all E without model_set_comm). */
void mc_ep_range(const model_t *m, int *e0, int *n);
/* mc->ep for m->comm (nothing without a comm or MoE layer); MO_ECONFIG when the experts
 * m holds are not the comm rank's share. */
int mc_ep_init(model_cuda_t *mc);
/* Frees mc->ep; safe without one. */
void mc_ep_free(model_cuda_t *mc);
/* 1: the MoE layers of the forward that follows keep their exchanges for the training
 * step's backward (set around the training forward, 0 after it). */
void mc_ep_keep(model_cuda_t *mc, int keep);
/* yg (S, D) = the experts' outputs of xg (S, D), this rank's rows grouped by expert with
 * the dispatch offsets (E + 1, device; NULL: no rows): the offsets exchanged, copied to the
 * host (one wait for the stream), the rows sent to their owners, grouped by local expert,
 * run through ly's local experts (with their adapters when ad) and sent back. Collective. */
int mc_ep_experts_forward(model_cuda_t *mc, const mc_layer_t *ly, float *yg, const float *xg,
                          const int32_t *offsets, int ad);
/* dxg (S, D) = the input-row gradients from dyg (S, D) at the expert outputs, through the
 * exchanges the training forward kept for ly; the local experts' adapter gradients
 * accumulate (mc->dgrads). Collective. */
int mc_ep_experts_backward(const model_cuda_t *mc, const mc_layer_t *ly, float *dxg,
                           const float *dyg);
/* A rank without tokens: every MoE layer's exchanges, in layer order (forward) or in
 * reverse (backward), serving the other ranks' rows for its experts. */
int mc_ep_empty_forward(model_cuda_t *mc, int ad);
int mc_ep_empty_backward(const model_cuda_t *mc);
/* The host side of one exchange, from this rank's dispatch offsets own (E + 1, E = N n)
 * and src (N, n + 1), the offsets of the local experts each rank sent: sc, sd (N) the
 * floats (rows times D) sent to each owner and their start, rc, rd (N) those received from
 * each source, packed in rank order; returns the rows received, or MO_EINVAL for offsets
 * that are not nondecreasing (or too many rows). */
int64_t mc_ep_counts(int N, int n, int D, const int32_t *own, const int32_t *src, int64_t *sc,
                     int64_t *sd, int64_t *rc, int64_t *rd);
/* The owner-side grouping of the rows received (rank by rank, each rank's by expert): off
 * (n + 1) local expert i owns grouped rows off[i] .. off[i+1]-1, sources in rank order,
 * each source's rows in its order; perm (R): grouped row j is received row perm[j]; inv
 * (R) its inverse. */
void mc_ep_group(int N, int n, const int32_t *src, int32_t *off, int32_t *perm, int32_t *inv);

#ifdef __cplusplus
}
#endif
#endif /* MOERL_HAVE_CUDA */
#endif
