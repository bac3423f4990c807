/* engine_cuda: the rollout engine's steps on the CUDA device: the model and its adapter
 * uploaded once (actor/model_cuda.h), the KV cache's memory on the device in the host
 * cache's layout (the host keeps the block tables, references and reservations), prefill
 * and decode with the next tokens drawn on the device. */
#include "rollout/engine_int.h"

#ifdef MOERL_HAVE_CUDA
#include <stdlib.h>
#include <string.h>

#include "actor/model_cuda.h"

struct engine_cuda {
    model_cuda_t *mc;
    float *kv; /* (L, NB, 2, BS Hkv Dh) device */
};

int engine_cuda_open(engine_t *e) {
    engine_cuda_t *d = calloc(1, sizeof *d);
    if (!d)
        return mo_errorf(MO_ENOMEM, "rollout engine: out of memory");
    e->dev = d;
    int rc = model_cuda_upload(&d->mc, e->m);
    if (rc == MO_OK)
        rc = model_cuda_kv_alloc(d->mc, e->kv.n_blocks, e->kv.block_tokens, &d->kv);
    if (rc < 0)
        return mo_error_wrap(rc, "rollout engine on device cuda");
    kv_cache_drop_memory(&e->kv);
    return MO_OK;
}

void engine_cuda_close(engine_t *e) {
    if (!e->dev)
        return;
    model_cuda_free(&e->dev->mc);
    free(e->dev);
    e->dev = NULL;
}

int engine_cuda_bind(engine_t *e) {
    int rc = model_cuda_rebind_adapter(e->dev->mc);
    return rc < 0 ? mo_error_wrap(rc, "rollout engine on device cuda: adapter") : MO_OK;
}

int engine_cuda_copy_block(engine_t *e, int32_t src, int32_t dst) {
    return model_cuda_kv_copy_block(e->dev->mc, src, dst);
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
                              .NB = e->kv.n_blocks, .BS = e->kv.block_tokens,
                              .routing = routing, .n_jobs = n_jobs, .job_seq = job_seq};
    TRY(model_cuda_prefill_sample(d->mc, &b, req, tok, lp, status,
                                  model_cuda_has_adapter(d->mc)));
    for (int j = 0; j < n_jobs; j++)
        rc[j] = status[j];
    return MO_OK;
}

int engine_cuda_decode(engine_t *e, int N, const int32_t *tokens, const int32_t *pos,
                       kv_seq_t *const *seqs, uint16_t *routing, int32_t *tok, float *lp,
                       int *rc) {
    engine_cuda_t *d = e->dev;
    int32_t *tables, *status;
    cuda_sample_req_t *req;
    int mb = 0;
    TRY(block_tables(e, seqs, N, &tables, &mb));
    TRY(draw_reqs(e, e->active, N, &req, &status));
    model_cuda_decode_t b = {.N = N, .tokens = tokens, .pos = pos, .block_tables = tables,
                             .max_blocks = mb, .kv = d->kv, .NB = e->kv.n_blocks,
                             .BS = e->kv.block_tokens, .routing = routing};
    TRY(model_cuda_decode_sample(d->mc, &b, req, tok, lp, status,
                                 model_cuda_has_adapter(d->mc)));
    for (int i = 0; i < N; i++)
        rc[i] = status[i];
    return MO_OK;
}
#endif /* MOERL_HAVE_CUDA */
