/* engine_cuda: the rollout engine's steps on the CUDA device: the model and its adapter
 * uploaded once (actor/model_cuda.h), the KV cache's memory on the device in the host
 * cache's layout (the host keeps the block tables, references and reservations), prefill
 * and decode with the next tokens drawn on the device. */
#include "rollout/engine_int.h"

#ifdef MOERL_HAVE_CUDA
#include <stdlib.h>
#include <string.h>

#include "actor/model_cuda.h"
#include "core/backend.h"
#include "core/cuda/backend_cuda.h"

/* The most padding rows a step gets (pad_rows). */
#define PAD_ROWS 7

struct engine_cuda {
    model_cuda_t *mc;
    float *kv;    /* (L, NB, 2, BS Hkv Dh) device */
    int NB;       /* the cache's blocks: the host cache's, with graphs PAD_ROWS more */
    void *stream; /* with graphs: the engine's own stream (a cudaStream_t), else NULL */
};

/* With graphs the engine's device work goes to its own stream (the default stream cannot
 * be recorded), set on whichever thread calls it. */
static void on_stream(engine_t *e) {
    if (e->dev->stream)
        backend_get(DEV_CUDA)->set_stream(backend_get(DEV_CUDA), e->dev->stream);
}

/* Decode steps recorded as CUDA graphs: a stream of their own and the padding block. */
static int graphs_open(engine_t *e) {
    engine_cuda_t *d = e->dev;
    TRY(backend_cuda_stream_new(&d->stream));
    on_stream(e);
    return model_cuda_decode_graphs(d->mc, 1);
}

int engine_cuda_open(engine_t *e) {
    engine_cuda_t *d = calloc(1, sizeof *d);
    if (!d)
        return mo_errorf(MO_ENOMEM, "rollout engine: out of memory");
    e->dev = d;
    /* With graphs, blocks n_blocks .. + PAD_ROWS - 1 are the padding rows' (one each: no
     * two rows may write one block), never in the host cache's tables. */
    d->NB = e->kv.n_blocks + (e->opts.cuda_graphs ? PAD_ROWS : 0);
    int rc = model_cuda_upload(&d->mc, e->m);
    if (rc == MO_OK)
        rc = model_cuda_kv_alloc(d->mc, d->NB, e->kv.block_tokens, &d->kv);
    if (rc == MO_OK && e->opts.cuda_graphs)
        rc = graphs_open(e);
    if (rc < 0)
        return mo_error_wrap(rc, "rollout engine on device cuda");
    kv_cache_drop_memory(&e->kv);
    return MO_OK;
}

void engine_cuda_close(engine_t *e) {
    if (!e->dev)
        return;
    on_stream(e);
    model_cuda_free(&e->dev->mc);
    if (e->dev->stream) {
        backend_get(DEV_CUDA)->set_stream(backend_get(DEV_CUDA), NULL);
        backend_cuda_stream_free(e->dev->stream);
    }
    free(e->dev);
    e->dev = NULL;
}

int engine_cuda_bind(engine_t *e) {
    on_stream(e);
    int rc = model_cuda_rebind_adapter(e->dev->mc);
    return rc < 0 ? mo_error_wrap(rc, "rollout engine on device cuda: adapter") : MO_OK;
}

int engine_cuda_copy_block(engine_t *e, int32_t src, int32_t dst) {
    on_stream(e);
    return model_cuda_kv_copy_block(e->dev->mc, src, dst);
}

void engine_cuda_graph_stats(const engine_t *e, model_cuda_graph_stats_t *s) {
    model_cuda_graph_stats(e->dev ? e->dev->mc : NULL, s);
}

/* (n, *max_blocks) block tables of n sequences, unused entries 0. */
static int block_tables(engine_t *e, kv_seq_t *const *seqs, int n, int32_t **out,
                        int *max_blocks) {
    int mb = 1;
    for (int i = 0; i < n; i++)
        mb = seqs[i]->n_blocks > mb ? seqs[i]->n_blocks : mb;
    int32_t *t;
    ALLOC(t, &e->step_ar, (size_t)n * mb);
    memset(t, 0, sizeof *t * (size_t)n * mb);
    for (int i = 0; i < n; i++)
        memcpy(t + (size_t)i * mb, seqs[i]->blocks, sizeof *t * (size_t)seqs[i]->n_blocks);
    *out = t;
    *max_blocks = mb;
    return MO_OK;
}

/* The device draw of sample s's next token: its parameters and draw coordinates, as the
 * CPU engine passes them to sampler_uniform and sampler_sample. */
static void sample_req(cuda_sample_req_t *r, const eng_sample_t *s) {
    const gen_params_t *p = &s->g->params;
    r->temperature = p->sampling.temperature;
    r->top_p = p->sampling.top_p;
    r->top_k = p->sampling.top_k;
    r->min_p = p->sampling.min_p;
    r->seed = p->seed;
    r->request_id = s->g->out->id;
    r->sample_index = (uint64_t)s->out->index;
    r->token_index = (uint64_t)s->out->n_tokens;
}

/* The draws' requests (n) and a status array for them. */
static int draw_reqs(engine_t *e, eng_sample_t *const *smp, int n, cuda_sample_req_t **req,
                     int32_t **status) {
    ALLOC(*req, &e->step_ar, n);
    ALLOC(*status, &e->step_ar, n);
    for (int j = 0; j < n; j++)
        sample_req(&(*req)[j], smp[j]);
    return MO_OK;
}

int engine_cuda_prefill(engine_t *e, int N, int S, const int32_t *tokens, const int32_t *cu,
                        kv_seq_t *const *seqs, uint16_t *routing, int n_jobs, const int *seq,
                        eng_sample_t *const *smp, int32_t *tok, float *lp, int *rc) {
    engine_cuda_t *d = e->dev;
    on_stream(e);
    kv_seq_t **ps;
    int32_t *tables, *job_seq, *status;
    cuda_sample_req_t *req;
    int mb = 0;
    ALLOC(ps, &e->step_ar, S);
    ALLOC(job_seq, &e->step_ar, n_jobs);
    for (int i = 0; i < S; i++)
        ps[i] = seqs[cu[i]];
    for (int j = 0; j < n_jobs; j++)
        job_seq[j] = seq[j];
    TRY(block_tables(e, ps, S, &tables, &mb));
    TRY(draw_reqs(e, smp, n_jobs, &req, &status));
    model_cuda_prefill_t b = {.N = N, .S = S, .tokens = tokens, .cu_seqlens = cu,
                              .block_tables = tables, .max_blocks = mb, .kv = d->kv,
                              .NB = d->NB, .BS = e->kv.block_tokens,
                              .routing = routing, .n_jobs = n_jobs, .job_seq = job_seq};
    TRY(model_cuda_prefill_sample(d->mc, &b, req, tok, lp, status,
                                  model_cuda_has_adapter(d->mc)));
    for (int j = 0; j < n_jobs; j++)
        rc[j] = status[j];
    return MO_OK;
}

/* Rows and table widths rounded up so that a few shapes cover every step (CUDA graphs
 * replay per shape): up to 8 a power of two, then a multiple of 8 (so at most PAD_ROWS
 * padding rows); widths a power of two. */
static int pad_rows(int n) {
    int p = 1;
    while (p < n && p < 8)
        p *= 2;
    return n <= 8 ? p : (n + 7) / 8 * 8;
}

static int pad_width(int w) {
    int p = 1;
    while (p < w)
        p *= 2;
    return p;
}

/* The decode step's host inputs, padded with rows that decode token 0 at position 0,
 * each in a padding block of its own (their draws greedy, their results dropped), when
 * graphs are on. */
typedef struct {
    int N, mb;
    const int32_t *tokens, *pos, *tables;
    cuda_sample_req_t *req;
    int32_t *status;
} dec_in_t;

static int pad_inputs(engine_t *e, dec_in_t *in) {
    int n = in->N, N = pad_rows(n), mb = pad_width(in->mb);
    int32_t *tok, *pos, *tab, *status;
    cuda_sample_req_t *req;
    ALLOC(tok, &e->step_ar, N);
    ALLOC(pos, &e->step_ar, N);
    ALLOC(tab, &e->step_ar, (size_t)N * mb);
    ALLOC(req, &e->step_ar, N);
    ALLOC(status, &e->step_ar, N);
    memset(tok, 0, sizeof *tok * (size_t)N);
    memset(pos, 0, sizeof *pos * (size_t)N);
    memset(tab, 0, sizeof *tab * (size_t)N * mb);
    memset(req, 0, sizeof *req * (size_t)N);
    memcpy(tok, in->tokens, sizeof *tok * (size_t)n);
    memcpy(pos, in->pos, sizeof *pos * (size_t)n);
    memcpy(req, in->req, sizeof *req * (size_t)n);
    for (int i = 0; i < n; i++)
        memcpy(tab + (size_t)i * mb, in->tables + (size_t)i * in->mb, sizeof *tab * in->mb);
    for (int i = n; i < N; i++) { /* greedy (temperature 0), every other filter off */
        tab[(size_t)i * mb] = e->kv.n_blocks + (i - n);
        req[i].top_p = 1.0f;
    }
    in->N = N;
    in->mb = mb;
    in->tokens = tok;
    in->pos = pos;
    in->tables = tab;
    in->req = req;
    in->status = status;
    return MO_OK;
}

int engine_cuda_decode(engine_t *e, int N, const int32_t *tokens, const int32_t *pos,
                       kv_seq_t *const *seqs, uint16_t *routing, int32_t *tok, float *lp,
                       int *rc) {
    engine_cuda_t *d = e->dev;
    on_stream(e);
    int32_t *tables, *status;
    cuda_sample_req_t *req;
    int mb = 0;
    TRY(block_tables(e, seqs, N, &tables, &mb));
    TRY(draw_reqs(e, e->active, N, &req, &status));
    dec_in_t in = {N, mb, tokens, pos, tables, req, status};
    int32_t *ptok = tok;
    float *plp = lp;
    uint16_t *proute = routing;
    if (d->stream) {
        TRY(pad_inputs(e, &in));
        size_t mk = (size_t)e->m->n_moe * (size_t)(e->m->n_moe > 0 ? e->m->K : 0);
        ALLOC(ptok, &e->step_ar, in.N);
        ALLOC(plp, &e->step_ar, in.N);
        if (routing && mk > 0)
            ALLOC(proute, &e->step_ar, (size_t)in.N * mk);
    }
    model_cuda_decode_t b = {.N = in.N, .tokens = in.tokens, .pos = in.pos,
                             .block_tables = in.tables, .max_blocks = in.mb, .kv = d->kv,
                             .NB = d->NB, .BS = e->kv.block_tokens, .routing = proute};
    TRY(model_cuda_decode_sample(d->mc, &b, in.req, ptok, plp, in.status,
                                 model_cuda_has_adapter(d->mc)));
    if (d->stream) { /* the real rows' results */
        memcpy(tok, ptok, sizeof *tok * (size_t)N);
        memcpy(lp, plp, sizeof *lp * (size_t)N);
        if (proute != routing)
            memcpy(routing, proute,
                   sizeof *routing * (size_t)N * (size_t)e->m->n_moe * (size_t)e->m->K);
    }
    for (int i = 0; i < N; i++)
        rc[i] = in.status[i];
    return MO_OK;
}
#endif /* MOERL_HAVE_CUDA */
