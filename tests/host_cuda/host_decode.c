/* host_decode: the host twins of core/cuda/attn_decode.h and core/cuda/sampler.h, so that
 * the decode step and the prefill of the CUDA model path (actor/model_cuda_decode.c,
 * actor/model_cuda_prefill.c, suite gpu_model_decode.c) also run on a machine without a
 * GPU, next to the other twins (host_cuda.c). The prefill's store writes each row with
 * kv_write, the block copy copies each layer's block with memmove.
 *
 * The "device" cache is host memory in the same layout, so the twin views it as a
 * kv_cache_t and each row's block table as a kv_seq_t, and runs the CPU engine's
 * attn_decode_store_forward (attn_decode_forward without new keys and values) one row at a
 * time: a row's result does not depend on the other rows. Rows the device would skip (a
 * position outside the table, a block outside the cache) get NaN outputs and touch no
 * cache memory, as on the device. The device kernel itself is checked against the CPU by
 * gpu_attn_decode.c on a GPU.
 *
 * The sampler's twin draws each row with the CPU sampler (rollout/sampler.h) under the row's
 * parameters and the uniform sampler_uniform() gives for its coordinates, writing the
 * statuses, tokens and log-probabilities as the device does; the device sampler is checked
 * against the CPU one by gpu_sampler.c on a GPU. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/cuda/attn_decode.h"
#include "core/cuda/sampler.h"
#include "core/status.h"
#include "rollout/attn_decode.h"
#include "rollout/kv_cache.h"
#include "rollout/sampler.h"

/* 1 when row i's position and the blocks up to it are inside its table and the cache. */
static int row_ok(const int32_t *tab, int p, int max_blocks, int BS, int NB) {
    if (p < 0 || p >= max_blocks * BS)
        return 0;
    for (int j = 0; j <= p / BS; j++)
        if (tab[j] < 0 || tab[j] >= NB)
            return 0;
    return 1;
}

int cuda_attn_decode(float *out, const float *q, const float *k_new, const float *v_new,
                     float *cache, int L, int NB, int BS, int Hkv, int Dh, int l,
                     const int32_t *block_tables, int max_blocks, const int32_t *pos, int N, int H,
                     float scale, int window, int splits) {
    if (N < 0 || L < 1 || NB < 1 || BS < 1 || Hkv < 1 || Dh < 1 || l < 0 || l >= L ||
        max_blocks < 1 || H < 1 || H % Hkv != 0 || window < 0 || splits < 0)
        return mo_errorf(MO_EINVAL,
                         "cuda_attn_decode (host twin): bad shape N=%d L=%d NB=%d BS=%d Hkv=%d "
                         "Dh=%d l=%d max_blocks=%d H=%d window=%d splits=%d",
                         N, L, NB, BS, Hkv, Dh, l, max_blocks, H, window, splits);
    if (N == 0)
        return MO_OK;
    if (!out || !q || !cache || !block_tables || !pos || (!k_new) != (!v_new))
        return mo_errorf(MO_EINVAL, "cuda_attn_decode (host twin): out, q, cache, block_tables "
                                    "and pos must be given and k_new, v_new both or neither");
    kv_cache_t c;
    memset(&c, 0, sizeof c);
    c.L = L;
    c.Hkv = Hkv;
    c.Dh = Dh;
    c.block_tokens = BS;
    c.n_blocks = NB;
    c.row = (size_t)Hkv * Dh;
    c.parts = 2;
    c.mem = cache;
    /* Every block held once: the store's check (the block is its sequence's alone) is the
     * caller's contract on the device, not something the twin can see. */
    c.ref = malloc(sizeof(int32_t) * (size_t)NB);
    if (!c.ref)
        return mo_errorf(MO_ENOMEM, "cuda_attn_decode (host twin): %d blocks", NB);
    for (int b = 0; b < NB; b++)
        c.ref[b] = 1;
    size_t qd = (size_t)H * Dh, kvd = (size_t)Hkv * Dh;
    for (int i = 0; i < N; i++) {
        const int32_t *tab = block_tables + (size_t)i * max_blocks;
        float *o = out + (size_t)i * qd;
        if (!row_ok(tab, pos[i], max_blocks, BS, NB)) {
            for (size_t j = 0; j < qd; j++)
                o[j] = NAN;
            continue;
        }
        kv_seq_t s = {(int32_t *)tab, max_blocks, max_blocks, pos[i] + 1};
        const kv_seq_t *sp = &s;
        if (k_new)
            attn_decode_store_forward(o, q + (size_t)i * qd, k_new + (size_t)i * kvd,
                                      v_new + (size_t)i * kvd, &c, l, &sp, &pos[i], 1, H, scale,
                                      window);
        else
            attn_decode_forward(o, q + (size_t)i * qd, &c, l, &sp, &pos[i], 1, H, scale, window);
    }
    free(c.ref);
    return MO_OK;
}

/* Each row through kv_write, its block seen as a one-block sequence. */
int cuda_kv_store(float *cache, const float *k, const float *v, int L, int NB, int BS, int Hkv,
                  int Dh, int l, const int32_t *slot, int N) {
    if (N < 0 || L < 1 || NB < 1 || BS < 1 || Hkv < 1 || Dh < 1 || l < 0 || l >= L)
        return mo_errorf(MO_EINVAL,
                         "cuda_kv_store (host twin): bad shape N=%d L=%d NB=%d BS=%d Hkv=%d "
                         "Dh=%d l=%d",
                         N, L, NB, BS, Hkv, Dh, l);
    if (N == 0)
        return MO_OK;
    if (!cache || !k || !v || !slot)
        return mo_errorf(MO_EINVAL, "cuda_kv_store (host twin): cache, k, v and slot must be "
                                    "given");
    kv_cache_t c;
    memset(&c, 0, sizeof c);
    c.L = L, c.Hkv = Hkv, c.Dh = Dh, c.block_tokens = BS, c.n_blocks = NB;
    c.row = (size_t)Hkv * Dh;
    c.parts = 2;
    c.mem = cache;
    c.ref = malloc(sizeof(int32_t) * (size_t)NB); /* every block held once, as in kv_write */
    if (!c.ref)
        return mo_errorf(MO_ENOMEM, "cuda_kv_store (host twin): %d blocks", NB);
    for (int b = 0; b < NB; b++)
        c.ref[b] = 1;
    for (int i = 0; i < N; i++) {
        if (slot[i] < 0 || slot[i] >= NB * BS)
            continue; /* skipped, as on the device */
        int32_t blk = slot[i] / BS;
        kv_seq_t s = {&blk, 1, 1, BS};
        kv_write(&c, &s, l, slot[i] % BS, k + (size_t)i * c.row, v + (size_t)i * c.row);
    }
    free(c.ref);
    return MO_OK;
}

/* The device kernel's copy: one memmove per layer. */
int cuda_kv_copy_block(float *cache, int L, int NB, size_t blk, int src, int dst) {
    if (!cache || L < 1 || NB < 1 || blk < 1 || src < 0 || src >= NB || dst < 0 || dst >= NB)
        return mo_errorf(MO_EINVAL,
                         "cuda_kv_copy_block (host twin): blocks %d -> %d of a cache of L=%d "
                         "NB=%d blocks of %zu floats",
                         src, dst, L, NB, blk);
    for (int l = 0; l < L && src != dst; l++) {
        float *layer = cache + (size_t)l * NB * blk;
        memmove(layer + (size_t)dst * blk, layer + (size_t)src * blk, sizeof(float) * blk);
    }
    return MO_OK;
}

int cuda_sample(int32_t *token, float *logp, int32_t *status, double *u, const float *logits,
                const cuda_sample_req_t *req, int B, int V) {
    if (B < 0 || V < 1)
        return mo_errorf(MO_EINVAL, "cuda_sample (host twin): bad shape B=%d V=%d", B, V);
    if (B == 0)
        return MO_OK;
    if (!token || !logp || !status || !logits || !req)
        return mo_errorf(MO_EINVAL,
                         "cuda_sample (host twin): token, logp, status, logits and req must be "
                         "given");
    sampler_t s;
    if (sampler_init(&s, V) < 0)
        return mo_errorf(MO_EDEVICE, "cuda_sample (host twin): scratch for V=%d", V);
    for (int b = 0; b < B; b++) {
        const cuda_sample_req_t *r = &req[b];
        sampling_params_t p = {r->temperature, r->top_p, r->top_k, r->min_p};
        double ub = sampler_uniform(r->seed, r->request_id, r->sample_index, r->token_index);
        int32_t tok = -1;
        float lp = NAN;
        int rc = sampler_sample(&s, logits + (size_t)b * V, &p, ub, &tok, &lp);
        if (rc < 0) {
            tok = -1;
            lp = NAN;
        }
        token[b] = tok;
        logp[b] = lp;
        status[b] = rc < 0 ? rc : MO_OK;
        if (u)
            u[b] = ub;
    }
    sampler_free(&s);
    return MO_OK;
}
