/* model_cuda_prefill: the rollout engine's prefill on the CUDA backend: whole prompts through
 * the scoring forward's layers with every row's keys and values stored in a paged KV cache in
 * device memory, and the first token of each sample drawn on the device from its prompt's
 * last row; plus the upload's own cache (its memory, block copies for forks). */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/cuda/attn_decode.h"
#include "core/cuda/sampler.h"
#include "core/status.h"

/* The prefill's own device buffers beside mc->did and the draws, in the decode block. */
typedef struct pf_bufs {
    int32_t *slot;  /* (N) each row's cache slot: block BS + pos % BS */
    int32_t *rows;  /* (J) the row each draw reads: its prompt's last */
    float *xj, *hf; /* (J, D) those rows of the residual stream, their final norm */
    float *rstd;    /* (J) */
} pf_bufs_t;

/* The prefill's attention core: layer l's keys and values of every row stored at its slot,
 * then causal attention within each prompt (the layer's window honoured). */
static int attend_store(model_cuda_t *mc, int l, const mc_acts_t *a, int T) {
    const mc_kv_t *kv = &mc->kv;
    TRY(cuda_kv_store(kv->mem, a->kr, a->v, mc->L, kv->NB, kv->BS, mc->Hkv, mc->Dh, l, kv->slot,
                      T));
    mc->be->k->attention_forward(a->att, a->lse, a->qr, a->kr, a->v, mc->id->cu, kv->B, mc->H,
                                 mc->Hkv, mc->Dh, mc->m->attn_scale, mc->layers[l].window);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Checks.                                                                   */

static int check_shape(const model_cuda_prefill_t *b, int out, const char *fn) {
    if (!b || b->S < 1 || b->N < 1 || b->n_jobs < 0)
        return mo_errorf(MO_EINVAL,
                         "%s: a prefill needs S >= 1 prompts, N >= 1 rows and "
                         "n_jobs >= 0 draws",
                         fn);
    if (!b->tokens || !b->cu_seqlens || !b->block_tables || !b->kv)
        return mo_errorf(MO_EINVAL,
                         "%s: a prefill needs tokens, cu_seqlens, block_tables and the device "
                         "cache kv",
                         fn);
    if (b->n_jobs > 0 && (!b->job_seq || !out))
        return mo_errorf(MO_EINVAL,
                         "%s: %d draws need job_seq, the draws req and token, logp and status "
                         "outputs",
                         fn, b->n_jobs);
    if (b->NB < 1 || b->BS < 1 || b->max_blocks < 1 ||
        (int64_t)b->max_blocks * b->BS > (int64_t)1 << 30)
        return mo_errorf(MO_EINVAL,
                         "%s: NB=%d blocks of BS=%d tokens with max_blocks=%d per prompt (need "
                         "each >= 1, max_blocks BS < 2^30)",
                         fn, b->NB, b->BS, b->max_blocks);
    return MO_OK;
}

/* Prompt s: non-empty, within its table, the table entries it covers inside the cache. */
static int check_prompt(const model_cuda_prefill_t *b, int s, const char *fn) {
    const int32_t *cu = b->cu_seqlens;
    int len = cu[s + 1] - cu[s];
    if (len < 1)
        return mo_errorf(MO_EINVAL, "%s: prompt %d is rows %d .. %d: cu_seqlens must increase", fn,
                         s, cu[s], cu[s + 1] - 1);
    if (len > b->max_blocks * b->BS)
        return mo_errorf(MO_EINVAL,
                         "%s: prompt %d has %d tokens, more than its table's %d (max_blocks %d "
                         "of BS %d)",
                         fn, s, len, b->max_blocks * b->BS, b->max_blocks, b->BS);
    const int32_t *tab = b->block_tables + (size_t)s * b->max_blocks;
    for (int j = 0; j <= (len - 1) / b->BS; j++)
        if (tab[j] < 0 || tab[j] >= b->NB)
            return mo_errorf(MO_EINVAL,
                             "%s: prompt %d names block %d at table entry %d, outside the "
                             "cache's [0, %d)",
                             fn, s, tab[j], j, b->NB);
    return MO_OK;
}

/* No block named twice: every covered table entry, sorted with its prompt. */
static int check_blocks(const model_cuda_prefill_t *b, const char *fn) {
    size_t n = 0, cap = (size_t)b->S * b->max_blocks;
    int64_t *w = malloc(sizeof *w * cap);
    if (!w)
        return mo_errorf(MO_ENOMEM, "%s: %d prompts", fn, b->S);
    for (int s = 0; s < b->S; s++) {
        int nb = (b->cu_seqlens[s + 1] - b->cu_seqlens[s] - 1) / b->BS + 1;
        for (int j = 0; j < nb; j++)
            w[n++] = (int64_t)b->block_tables[(size_t)s * b->max_blocks + j] << 32 | s;
    }
    int p1 = 0, p2 = 0, blk = 0, rc = MO_OK;
    if (mc_shared_block(w, n, &p1, &p2, &blk))
        rc = mo_errorf(MO_EINVAL,
                       "%s: prompts %d and %d both hold block %d (every prompt needs blocks of "
                       "its own)",
                       fn, p1, p2, blk);
    free(w);
    return rc;
}

static int check_prefill(const model_cuda_t *mc, const model_cuda_prefill_t *b, int out,
                         const char *fn) {
    TRY(check_shape(b, out, fn));
    const int32_t *cu = b->cu_seqlens;
    if (cu[0] != 0 || cu[b->S] != b->N)
        return mo_errorf(MO_EINVAL, "%s: cu_seqlens must run from 0 to N = %d, got %d to %d", fn,
                         b->N, cu[0], cu[b->S]);
    for (int s = 0; s < b->S; s++)
        TRY(check_prompt(b, s, fn));
    for (int t = 0; t < b->N; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= mc->V)
            return mo_errorf(MO_EINVAL, "%s: row %d is token %d, outside [0, %d)", fn, t,
                             b->tokens[t], mc->V);
    for (int j = 0; j < b->n_jobs; j++)
        if (b->job_seq[j] < 0 || b->job_seq[j] >= b->S)
            return mo_errorf(MO_EINVAL, "%s: draw %d reads prompt %d, outside [0, %d)", fn, j,
                             b->job_seq[j], b->S);
    return check_blocks(b, fn);
}

/* ------------------------------------------------------------------------ */
/* The prefill.                                                              */

/* The decode block for N rows of S prompts and J draws: the draws, slots, draw rows and
 * mc_ids_layout's ids up to off1 (one host-to-device copy), then the results (token,
 * status, logp: one device-to-host copy) and the draws' rows. Returns the bytes (base NULL:
 * only measures). */
static size_t pf_layout(model_cuda_t *mc, pf_bufs_t *p, char *base, int N, int S, int J) {
    mc_bump_t bp = {base, 0};
    MC_BUMP(mc->dreq, &bp, J);
    MC_BUMP(p->slot, &bp, N);
    MC_BUMP(p->rows, &bp, J);
    mc_ids_layout(mc, &bp, &mc->did, N, S);
    MC_BUMP(mc->dtok, &bp, J);
    MC_BUMP(mc->dstatus, &bp, J);
    MC_BUMP(mc->dlogp, &bp, J);
    MC_BUMP(p->xj, &bp, (size_t)J * mc->D);
    MC_BUMP(p->hf, &bp, (size_t)J * mc->D);
    MC_BUMP(p->rstd, &bp, J);
    mc->dtables = NULL;
    return bp.off;
}

/* The staged ids (h, from mc->dreq): draws, slots, draw rows, tokens, positions, cu. */
static void stage(const model_cuda_t *mc, const pf_bufs_t *p, char *h,
                  const model_cuda_prefill_t *b, const cuda_sample_req_t *req) {
    const char *lo = (const char *)mc->dreq;
#define STAGED(ptr) ((int32_t *)(h + ((const char *)(ptr)-lo)))
    int32_t *slot = STAGED(p->slot), *rows = STAGED(p->rows), *pos = STAGED(mc->did.pos);
    int32_t *off1 = STAGED(mc->did.off1);
    if (b->n_jobs > 0)
        memcpy(h, req, sizeof *req * (size_t)b->n_jobs);
    memcpy(STAGED(mc->did.tok), b->tokens, sizeof(int32_t) * (size_t)b->N);
    memcpy(STAGED(mc->did.cu), b->cu_seqlens, sizeof(int32_t) * (size_t)(b->S + 1));
#undef STAGED
    for (int s = 0; s < b->S; s++) {
        const int32_t *tab = b->block_tables + (size_t)s * b->max_blocks;
        for (int t = b->cu_seqlens[s]; t < b->cu_seqlens[s + 1]; t++) {
            pos[t] = t - b->cu_seqlens[s];
            slot[t] = tab[pos[t] / b->BS] * b->BS + pos[t] % b->BS;
        }
    }
    for (int j = 0; j < b->n_jobs; j++)
        rows[j] = b->cu_seqlens[b->job_seq[j] + 1] - 1;
    off1[0] = 0;
    off1[1] = b->N; /* tgt stays 0: no logprobs are formed */
}

static int upload(model_cuda_t *mc, pf_bufs_t *p, const model_cuda_prefill_t *b,
                  const cuda_sample_req_t *req, const char *fn) {
    int N = b->N, S = b->S, J = b->n_jobs;
    TRY(mc_block_ready(mc, &mc->dmem, &mc->dcap, pf_layout(mc, p, NULL, N, S, J)));
    pf_layout(mc, p, mc->dmem, N, S, J);
    size_t n = (size_t)((const char *)(mc->did.off1 + 2) - (const char *)mc->dreq);
    char *h = calloc(1, n);
    if (!h)
        return mo_errorf(MO_ENOMEM, "%s: %zu bytes of staging", fn, n);
    stage(mc, p, h, b, req);
    int rc = mc->be->copy(mc->be, mc->dreq, DEV_CUDA, h, DEV_CPU, n);
    free(h);
    return rc;
}

/* The layers over the packed prompts, storing into the cache, then each draw's row through
 * the head and sampled: all queued with no host sync. */
static int run(model_cuda_t *mc, const model_cuda_prefill_t *b, const cuda_sample_req_t *req,
               int ad, const char *fn) {
    const kernels_t *k = mc->be->k;
    int N = b->N, J = b->n_jobs, D = mc->D;
    TRY(mc_scratch_ready(mc, N, b->S));
    pf_bufs_t p;
    TRY(upload(mc, &p, b, req, fn));
    mc->replay = 0;
    mc->id = &mc->did;
    mc->cur_plan = &mc->plan;
    mc_kv_t kv = {b->kv, b->NB, b->BS, NULL, b->max_blocks, p.slot, b->S};
    mc->kv = kv;
    mc->attend = attend_store;
    const mc_scratch_t *s = &mc->s;
    k->embedding_forward(s->x, mc->did.tok, &mc->embed, N, D);
    mc_acts_t a = mc_scoring_acts(s);
    for (int l = 0; l < mc->L; l++) {
        int rc = mc_layer_forward(mc, l, &a, N, b->S, ad);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
    }
    if (J == 0)
        return mc->be->synchronize(mc->be);
    wview_t xv = wview_f32(s->x);
    k->embedding_forward(p.xj, p.rows, &xv, J, D); /* gathers the draws' rows */
    /* Chunks no larger than the scratch's logits buffer (sized for N rows). */
    int rows = mc_logits_rows(mc, J), most = mc_logits_rows(mc, N);
    return mc_head_out(mc, p.hf, p.rstd, p.xj, J, rows < most ? rows : most, NULL);
}

int model_cuda_prefill_sample(model_cuda_t *mc, const model_cuda_prefill_t *b,
                              const cuda_sample_req_t *req, int32_t *token, float *logp,
                              int32_t *status, int use_adapter) {
    static const char fn[] = "model_cuda_prefill_sample";
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    TRY(check_prefill(mc, b, req && token && logp && status, fn));
    TRY(mc_check_use_adapter(mc, use_adapter, fn));
    int rc = run(mc, b, req, use_adapter, fn);
    return mc_paged_finish(mc, rc, b->n_jobs, token, logp, status, b->routing, b->N, fn);
}

/* ------------------------------------------------------------------------ */
/* The upload's cache.                                                       */

/* Floats of one block of one layer: keys and values. */
static size_t block_floats(const model_cuda_t *mc, int BS) {
    return (size_t)2 * BS * mc->Hkv * mc->Dh;
}

int model_cuda_kv_alloc(model_cuda_t *mc, int NB, int BS, float **kv) {
    static const char fn[] = "model_cuda_kv_alloc";
    if (kv)
        *kv = NULL;
    if (!mc || !kv)
        return mo_errorf(MO_EINVAL, "%s: needs an uploaded model and an output", fn);
    if (NB < 1 || BS < 1)
        return mo_errorf(MO_EINVAL, "%s: NB=%d blocks of BS=%d tokens (need both >= 1)", fn, NB,
                         BS);
    size_t bytes = sizeof(float) * (size_t)mc->L * (size_t)NB * block_floats(mc, BS);
    if (mc->kvmem && (mc->kv_NB != NB || mc->kv_BS != BS)) {
        TRY(mc->be->synchronize(mc->be)); /* no queued work still uses the old cache */
        mc->be->free(mc->be, mc->kvmem);
        mc->kvmem = NULL;
        mc->kv_NB = mc->kv_BS = 0;
    }
    if (!mc->kvmem) {
        void *p = NULL;
        int rc = mc->be->alloc(mc->be, &p, bytes);
        if (rc < 0)
            return mo_error_wrap(rc, "%s: %zu bytes for %d blocks of %d tokens", fn, bytes, NB, BS);
        mc->kvmem = p;
        mc->kv_NB = NB;
        mc->kv_BS = BS;
    }
    TRY(mc->be->memset_zero(mc->be, mc->kvmem, bytes));
    /* Zeroed when the call returns: the engine may make its cache on one thread and run its
     * steps on another (another stream). */
    TRY(mc->be->synchronize(mc->be));
    *kv = mc->kvmem;
    return MO_OK;
}

int model_cuda_kv_copy_block(model_cuda_t *mc, int32_t src, int32_t dst) {
    static const char fn[] = "model_cuda_kv_copy_block";
    if (!mc || !mc->kvmem)
        return mo_errorf(MO_EINVAL, "%s: the upload has no cache (model_cuda_kv_alloc)", fn);
    if (src < 0 || src >= mc->kv_NB || dst < 0 || dst >= mc->kv_NB)
        return mo_errorf(MO_EINVAL, "%s: blocks %d -> %d, outside the cache's [0, %d)", fn, src,
                         dst, mc->kv_NB);
    int rc = cuda_kv_copy_block(mc->kvmem, mc->L, mc->kv_NB, block_floats(mc, mc->kv_BS), src, dst);
    return rc < 0 ? mo_error_wrap(rc, "%s", fn) : MO_OK;
}

#endif /* MOERL_HAVE_CUDA */
