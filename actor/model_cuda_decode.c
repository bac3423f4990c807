/* model_cuda_decode: the rollout engine's decode step on the CUDA backend: one new token per
 * sequence through the scoring forward's layers, attending over a paged KV cache in device
 * memory; its logits copied out, or the next tokens sampled from them on the device. */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/attn_decode.h"
#include "core/cuda/sampler.h"
#include "core/status.h"

/* The decode step's attention core: row i's new key and value stored at pos[i] of layer l,
 * then its query over positions 0 .. pos[i] of its sequence. */
static int attend_paged(model_cuda_t *mc, int l, const mc_acts_t *a, int T) {
    const mc_kv_t *kv = &mc->kv;
    return cuda_attn_decode(a->att, a->qr, a->kr, a->v, kv->mem, mc->L, kv->NB, kv->BS, mc->Hkv,
                            mc->Dh, l, kv->tables, kv->max_blocks, mc->id->pos, T, mc->H,
                            mc->m->attn_scale, mc->layers[l].window, 0);
}

static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

int mc_shared_block(int64_t *w, size_t n, int *o1, int *o2, int *blk) {
    qsort(w, n, sizeof *w, cmp_i64);
    for (size_t i = 1; i < n; i++)
        if (w[i] >> 32 == w[i - 1] >> 32) {
            *o1 = (int)(w[i - 1] & 0xffffffff);
            *o2 = (int)(w[i] & 0xffffffff);
            *blk = (int)(w[i] >> 32);
            return 1;
        }
    return 0;
}

/* No two rows write the same block: the block holding each row's pos, sorted with its row. */
static int check_writes(const model_cuda_decode_t *b, const char *fn) {
    int64_t *w = malloc(sizeof *w * (size_t)b->N);
    if (!w)
        return mo_errorf(MO_ENOMEM, "%s: %d rows", fn, b->N);
    for (int i = 0; i < b->N; i++) {
        int32_t blk = b->block_tables[(size_t)i * b->max_blocks + b->pos[i] / b->BS];
        w[i] = (int64_t)blk << 32 | (int64_t)i;
    }
    int r1 = 0, r2 = 0, blk = 0, rc = MO_OK;
    if (mc_shared_block(w, (size_t)b->N, &r1, &r2, &blk))
        rc = mo_errorf(MO_EINVAL,
                       "%s: rows %d and %d both store their new token in block %d (every row "
                       "must be a different sequence, in a block only it holds)",
                       fn, r1, r2, blk);
    free(w);
    return rc;
}

/* out: whether the step's outputs (named by outs) are all given. */
static int check_step(const model_cuda_t *mc, const model_cuda_decode_t *b, int out,
                      const char *outs, const char *fn) {
    if (!b || b->N < 0)
        return mo_errorf(MO_EINVAL, "%s: a step needs N >= 0 rows", fn);
    if (b->N == 0)
        return MO_OK;
    if (!b->tokens || !b->pos || !b->block_tables || !b->kv || !out)
        return mo_errorf(MO_EINVAL,
                         "%s: a step needs tokens, pos, block_tables, the device cache "
                         "kv and %s",
                         fn, outs);
    if (b->NB < 1 || b->BS < 1 || b->max_blocks < 1 ||
        (int64_t)b->max_blocks * b->BS > (int64_t)1 << 30)
        return mo_errorf(MO_EINVAL,
                         "%s: NB=%d blocks of BS=%d tokens with max_blocks=%d per row (need each "
                         ">= 1, max_blocks BS < 2^30)",
                         fn, b->NB, b->BS, b->max_blocks);
    for (int i = 0; i < b->N; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= mc->V)
            return mo_errorf(MO_EINVAL, "%s: row %d is token %d, outside [0, %d)", fn, i,
                             b->tokens[i], mc->V);
        int p = b->pos[i];
        if (p < 0 || p >= b->max_blocks * b->BS)
            return mo_errorf(MO_EINVAL,
                             "%s: row %d is at position %d, outside its table's [0, %d) "
                             "(max_blocks %d of BS %d)",
                             fn, i, p, b->max_blocks * b->BS, b->max_blocks, b->BS);
        const int32_t *tab = b->block_tables + (size_t)i * b->max_blocks;
        for (int j = 0; j <= p / b->BS; j++)
            if (tab[j] < 0 || tab[j] >= b->NB)
                return mo_errorf(MO_EINVAL,
                                 "%s: row %d (position %d) names block %d at table entry %d, "
                                 "outside the cache's [0, %d)",
                                 fn, i, p, tab[j], j, b->NB);
    }
    return check_writes(b, fn);
}

/* The step's inputs in the decode block (when sampling the draws, then the tables, then
 * mc_ids_layout's ids up to off1: one host-to-device copy), then, when sampling, the
 * results (token, status, logp: one device-to-host copy). Returns the bytes the block
 * needs (base NULL: only measures). */
static size_t ids_layout(model_cuda_t *mc, char *base, int N, int max_blocks, int sample) {
    mc_bump_t bp = {base, 0};
    mc->dreq = NULL;
    if (sample)
        MC_BUMP(mc->dreq, &bp, N);
    MC_BUMP(mc->dtables, &bp, (size_t)N * max_blocks);
    mc_ids_layout(mc, &bp, &mc->did, N, 1);
    mc->dtok = mc->dstatus = NULL;
    mc->dlogp = NULL;
    if (sample) {
        MC_BUMP(mc->dtok, &bp, N);
        MC_BUMP(mc->dstatus, &bp, N);
        MC_BUMP(mc->dlogp, &bp, N);
    }
    return bp.off;
}

static int upload_rows(model_cuda_t *mc, const model_cuda_decode_t *b, const cuda_sample_req_t *req,
                       const char *fn) {
    int N = b->N, sample = req != NULL;
    TRY(mc_block_ready(mc, &mc->dmem, &mc->dcap, ids_layout(mc, NULL, N, b->max_blocks, sample)));
    ids_layout(mc, mc->dmem, N, b->max_blocks, sample);
    char *lo = sample ? (char *)mc->dreq : (char *)mc->dtables;
    const char *hi = (const char *)(mc->did.off1 + 2);
    size_t n = (size_t)(hi - lo);
    char *h = calloc(1, n);
    if (!h)
        return mo_errorf(MO_ENOMEM, "%s: %zu bytes of staging", fn, n);
    if (sample)
        memcpy(h, req, sizeof *req * (size_t)N);
#define STAGED(p) ((int32_t *)(h + ((const char *)(p)-lo)))
    memcpy(STAGED(mc->dtables), b->block_tables, sizeof(int32_t) * (size_t)N * b->max_blocks);
    memcpy(STAGED(mc->did.tok), b->tokens, sizeof(int32_t) * (size_t)N);
    memcpy(STAGED(mc->did.pos), b->pos, sizeof(int32_t) * (size_t)N);
    int32_t *cu = STAGED(mc->did.cu), *off1 = STAGED(mc->did.off1);
#undef STAGED
    cu[0] = off1[0] = 0;
    cu[1] = off1[1] = N; /* tgt stays 0: no logprobs are formed */
    int rc = mc->be->copy(mc->be, lo, DEV_CUDA, h, DEV_CPU, n);
    free(h);
    return rc;
}

int mc_download_samples(model_cuda_t *mc, int N, int32_t *token, float *logp, int32_t *status,
                        const char *fn) {
    const char *lo = (const char *)mc->dtok, *hi = (const char *)(mc->dlogp + N);
    size_t n = (size_t)(hi - lo);
    char *h = malloc(n);
    if (!h)
        return mo_errorf(MO_ENOMEM, "%s: %zu bytes of staging", fn, n);
    int rc = mc->be->copy(mc->be, h, DEV_CPU, mc->dtok, DEV_CUDA, n);
    if (rc == MO_OK) {
        memcpy(token, h, sizeof *token * (size_t)N);
        memcpy(status, h + ((const char *)mc->dstatus - lo), sizeof *status * (size_t)N);
        memcpy(logp, h + ((const char *)mc->dlogp - lo), sizeof *logp * (size_t)N);
    }
    free(h);
    return rc;
}

int mc_head_out(model_cuda_t *mc, float *hf, float *rstd, const float *x, int n, int rows,
                float *logits) {
    const kernels_t *k = mc->be->k;
    int D = mc->D, V = mc->V;
    k->rmsnorm_forward(hf, rstd, x, mc->final_norm, n, D, mc->m->eps);
    for (int r0 = 0; r0 < n; r0 += rows) {
        int c = n - r0 < rows ? n - r0 : rows;
        k->matmul_forward(mc->s.logits, hf + (size_t)r0 * D, &mc->lm_head, NULL, c, D, V);
        if (logits)
            TRY(mc->be->copy(mc->be, logits + (size_t)r0 * V, DEV_CPU, mc->s.logits, DEV_CUDA,
                             sizeof(float) * (size_t)c * V));
        else
            TRY(cuda_sample(mc->dtok + r0, mc->dlogp + r0, mc->dstatus + r0, NULL, mc->s.logits,
                            mc->dreq + r0, c, V));
    }
    return MO_OK;
}

/* The step's device work after its inputs are up. */
typedef struct {
    int N, ad;
    float *logits; /* host: copied out chunk by chunk; NULL: sampled on the device */
} step_t;

/* The layers, queued with no host sync; then the head: the logits chunk by chunk, each
 * copied into host memory (logits) or sampled on the device. */
static int layers_and_head(model_cuda_t *mc, void *arg) {
    const step_t *st = arg;
    int N = st->N;
    const mc_scratch_t *s = &mc->s;
    mc->be->k->embedding_forward(s->x, mc->did.tok, &mc->embed, N, mc->D);
    mc_acts_t a = mc_scoring_acts(s);
    for (int l = 0; l < mc->L; l++) {
        int rc = mc_layer_forward(mc, l, &a, N, 1, st->ad);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
    }
    return mc_head_out(mc, s->hf, s->rstd, s->x, N, mc_logits_rows(mc, N), st->logits);
}

/* The inputs up, then the device work: through mc_graph_run when sampling (no host copy
 * inside), directly when the logits come out. */
static int run(model_cuda_t *mc, const model_cuda_decode_t *b, float *logits,
               const cuda_sample_req_t *req, int ad, const char *fn) {
    int N = b->N;
    TRY(mc_scratch_ready(mc, N, 1));
    TRY(upload_rows(mc, b, req, fn));
    mc->replay = 0;
    mc->id = &mc->did;
    mc->cur_plan = &mc->plan;
    mc_kv_t kv = {b->kv, b->NB, b->BS, mc->dtables, b->max_blocks, NULL, 1};
    mc->kv = kv;
    mc->attend = attend_paged;
    step_t st = {N, ad, logits};
    if (logits)
        return layers_and_head(mc, &st);
    mc_graph_key_t key = {N, b->max_blocks, ad, b->NB, b->BS, b->kv};
    return mc_graph_run(mc, &key, layers_and_head, &st);
}

/* The step with its logits copied out (sample 0: logits) or sampled (sample 1: req and
 * its outputs). */
static int decode_step(model_cuda_t *mc, const model_cuda_decode_t *b, int sample, float *logits,
                       const cuda_sample_req_t *req, int32_t *token, float *logp, int32_t *status,
                       int use_adapter, const char *fn) {
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    if (!sample)
        TRY(check_step(mc, b, logits != NULL, "a logits output", fn));
    else
        TRY(check_step(mc, b, req && token && logp && status,
                       "the draws req and token, logp and status outputs", fn));
    TRY(mc_check_use_adapter(mc, use_adapter, fn));
    if (b->N == 0)
        return MO_OK;
    int rc = run(mc, b, sample ? NULL : logits, sample ? req : NULL, use_adapter, fn);
    return mc_paged_finish(mc, rc, sample ? b->N : 0, token, logp, status, b->routing, b->N, fn);
}

int mc_paged_finish(model_cuda_t *mc, int rc, int n_draws, int32_t *token, float *logp,
                    int32_t *status, uint16_t *routing, int N, const char *fn) {
    mc->attend = NULL;
    memset(&mc->kv, 0, sizeof mc->kv);
    if (rc == MO_OK && n_draws > 0)
        rc = mc_download_samples(mc, n_draws, token, logp, status, fn);
    if (rc < 0)
        return mc_fail(mc, rc, fn);
    if (routing) {
        model_batch_t rb;
        memset(&rb, 0, sizeof rb);
        rb.T = N;
        rb.routing = routing;
        TRY(mc_routing_out(mc, mc->did.route, &rb, fn));
    }
    return MO_OK;
}

int model_cuda_decode(model_cuda_t *mc, const model_cuda_decode_t *b, float *logits,
                      int use_adapter) {
    return decode_step(mc, b, 0, logits, NULL, NULL, NULL, NULL, use_adapter, "model_cuda_decode");
}

int model_cuda_decode_sample(model_cuda_t *mc, const model_cuda_decode_t *b,
                             const cuda_sample_req_t *req, int32_t *token, float *logp,
                             int32_t *status, int use_adapter) {
    return decode_step(mc, b, 1, NULL, req, token, logp, status, use_adapter,
                       "model_cuda_decode_sample");
}

#endif /* MOERL_HAVE_CUDA */
