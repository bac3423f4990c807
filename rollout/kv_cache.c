/* kv_cache: paged f32 key/value cache with reservations and shared blocks. */
#include "rollout/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"

/* values 0: a keys-only cache (no value array). */
static int cache_init(kv_cache_t *c, int L, int Hkv, int Dh, int64_t budget_tokens,
                      int block_tokens, int values) {
    memset(c, 0, sizeof *c);
    if (block_tokens == 0)
        block_tokens = KV_BLOCK_TOKENS;
    if (L < 1 || Hkv < 1 || Dh < 1 || block_tokens < 1 || budget_tokens < 1)
        return mo_errorf(MO_EINVAL,
                         "kv cache: layers %d, kv heads %d, head dim %d, block %d and budget "
                         "%lld tokens must all be >= 1",
                         L, Hkv, Dh, block_tokens, (long long)budget_tokens);
    int64_t nb = (budget_tokens + block_tokens - 1) / block_tokens;
    if (nb > INT32_MAX / 2)
        return mo_errorf(MO_EINVAL, "kv cache: budget of %lld tokens is too large",
                         (long long)budget_tokens);
    c->L = L;
    c->Hkv = Hkv;
    c->Dh = Dh;
    c->block_tokens = block_tokens;
    c->n_blocks = (int)nb;
    c->row = (size_t)Hkv * (size_t)Dh;
    c->parts = values ? 2 : 1;
    size_t floats = (size_t)L * (size_t)nb * (size_t)block_tokens * c->row * (size_t)c->parts;
    c->mem = malloc(sizeof(float) * floats);
    c->ref = calloc((size_t)nb, sizeof *c->ref);
    c->free_blocks = malloc(sizeof *c->free_blocks * (size_t)nb);
    if (!c->mem || !c->ref || !c->free_blocks) {
        kv_cache_free(c);
        return mo_errorf(MO_ENOMEM, "kv cache: out of memory for %lld tokens (%.1f MiB)",
                         (long long)budget_tokens, sizeof(float) * (double)floats / 1048576.0);
    }
    /* Popped from the end: block 0 first. */
    for (int i = 0; i < c->n_blocks; i++)
        c->free_blocks[i] = c->n_blocks - 1 - i;
    c->n_free = c->n_blocks;
    return MO_OK;
}

int kv_cache_init(kv_cache_t *c, int L, int Hkv, int Dh, int64_t budget_tokens, int block_tokens) {
    return cache_init(c, L, Hkv, Dh, budget_tokens, block_tokens, 1);
}

int kv_cache_init_latent(kv_cache_t *c, int L, int width, int64_t budget_tokens, int block_tokens) {
    return cache_init(c, L, 1, width, budget_tokens, block_tokens, 0);
}

size_t kv_cache_token_bytes(const kv_cache_t *c) {
    return sizeof(float) * (size_t)c->L * c->row * (size_t)c->parts;
}

void kv_cache_drop_memory(kv_cache_t *c) {
    free(c->mem);
    c->mem = NULL;
}

void kv_cache_free(kv_cache_t *c) {
    free(c->mem);
    free(c->ref);
    free(c->free_blocks);
    memset(c, 0, sizeof *c);
}

int64_t kv_cache_blocks_for(const kv_cache_t *c, int64_t tokens) {
    return tokens <= 0 ? 0 : (tokens + c->block_tokens - 1) / c->block_tokens;
}

int64_t kv_cache_available(const kv_cache_t *c) {
    return (int64_t)c->n_free - c->reserved;
}

int64_t kv_cache_used_tokens(const kv_cache_t *c) {
    return (int64_t)(c->n_blocks - c->n_free) * c->block_tokens;
}

int kv_cache_reserve(kv_cache_t *c, int64_t blocks) {
    if (blocks < 0 || blocks > c->n_blocks)
        return mo_errorf(MO_EINVAL,
                         "kv cache: %lld blocks (%lld tokens) requested, the whole cache holds "
                         "%d blocks (%lld tokens)",
                         (long long)blocks, (long long)blocks * c->block_tokens, c->n_blocks,
                         (long long)c->n_blocks * c->block_tokens);
    if (blocks > kv_cache_available(c))
        return 0;
    c->reserved += blocks;
    return 1;
}

void kv_cache_unreserve(kv_cache_t *c, int64_t blocks) {
    MO_ASSERT(blocks >= 0 && blocks <= c->reserved);
    c->reserved -= blocks;
}

/* A block from the reservation, charged to *budget. */
static int take_block(kv_cache_t *c, int64_t *budget, int32_t *out) {
    if (*budget < 1 || c->reserved < 1 || c->n_free < 1)
        return mo_errorf(MO_ESTATE,
                         "kv cache: a block was needed beyond the reservation (share %lld, "
                         "reserved %lld, free %d)",
                         (long long)*budget, (long long)c->reserved, c->n_free);
    int32_t b = c->free_blocks[--c->n_free];
    MO_ASSERT(c->ref[b] == 0);
    c->ref[b] = 1;
    c->reserved--;
    /* Scores read every slot of a block (the unused ones are discarded): keep them
     * finite and free of what an earlier sequence left. */
    for (int l = 0; c->mem && l < c->L; l++)
        memset(kv_k_block(c, l, b), 0, sizeof(float) * (size_t)c->block_tokens * c->row);
    (*budget)--;
    *out = b;
    return MO_OK;
}

static int table_room(kv_seq_t *s, int n) {
    if (n <= s->cap)
        return MO_OK;
    int cap = s->cap ? s->cap : 8;
    while (cap < n)
        cap *= 2;
    int32_t *t = realloc(s->blocks, sizeof *t * (size_t)cap);
    if (!t)
        return mo_errorf(MO_ENOMEM, "kv cache: out of memory for a block table of %d", cap);
    s->blocks = t;
    s->cap = cap;
    return MO_OK;
}

int kv_seq_grow(kv_cache_t *c, kv_seq_t *s, int new_len, int64_t *budget) {
    MO_ASSERT(new_len >= s->len);
    int need = (int)kv_cache_blocks_for(c, new_len);
    TRY(table_room(s, need));
    while (s->n_blocks < need) {
        int32_t b = -1;
        TRY(take_block(c, budget, &b));
        s->blocks[s->n_blocks++] = b;
    }
    s->len = new_len;
    return MO_OK;
}

int kv_seq_fork(kv_cache_t *c, kv_seq_t *dst, const kv_seq_t *src, int64_t *budget) {
    MO_ASSERT(dst->n_blocks == 0 && dst->len == 0);
    TRY(table_room(dst, src->n_blocks));
    int full = src->len / c->block_tokens;
    for (int i = 0; i < full; i++) {
        dst->blocks[i] = src->blocks[i];
        c->ref[src->blocks[i]]++;
    }
    dst->n_blocks = full;
    if (src->n_blocks > full) { /* the partial last block: a private copy */
        int32_t b = -1;
        int rc = take_block(c, budget, &b);
        if (rc < 0) {
            kv_seq_release(c, dst);
            return rc;
        }
        size_t n = (size_t)c->block_tokens * c->row; /* whole block: keys are transposed */
        for (int l = 0; c->mem && l < c->L; l++) {
            memcpy(kv_k_block(c, l, b), kv_k_block(c, l, src->blocks[full]), sizeof(float) * n);
            if (c->parts == 2)
                memcpy(kv_v_block(c, l, b), kv_v_block(c, l, src->blocks[full]), sizeof(float) * n);
        }
        dst->blocks[dst->n_blocks++] = b;
    }
    dst->len = src->len;
    return MO_OK;
}

void kv_seq_release(kv_cache_t *c, kv_seq_t *s) {
    for (int i = 0; i < s->n_blocks; i++) {
        int32_t b = s->blocks[i];
        MO_ASSERT(c->ref[b] > 0);
        if (--c->ref[b] == 0)
            c->free_blocks[c->n_free++] = b;
    }
    free(s->blocks);
    memset(s, 0, sizeof *s);
}

float *kv_k_block(const kv_cache_t *c, int l, int32_t b) {
    size_t blk = (size_t)c->block_tokens * c->row;
    return c->mem + ((size_t)l * (size_t)c->n_blocks + (size_t)b) * (size_t)c->parts * blk;
}

float *kv_v_block(const kv_cache_t *c, int l, int32_t b) {
    if (c->parts == 1)
        return NULL;
    return kv_k_block(c, l, b) + (size_t)c->block_tokens * c->row;
}

void kv_write_heads(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, const float *k,
                    const float *v, int h0, int h1) {
    MO_ASSERT(pos >= 0 && pos < s->len && h0 >= 0 && h0 <= h1 && h1 <= c->Hkv);
    int32_t b = s->blocks[pos / c->block_tokens];
    MO_ASSERT(c->ref[b] == 1);
    MO_ASSERT((v != NULL) == (c->parts == 2));
    size_t BS = (size_t)c->block_tokens, o = (size_t)(pos % c->block_tokens), Dh = (size_t)c->Dh;
    float *kb = kv_k_block(c, l, b), *vb = kv_v_block(c, l, b);
    for (size_t h = (size_t)h0; h < (size_t)h1; h++) {
        float *kt = kb + h * Dh * BS + o; /* column o of (Dh, BS) */
        const float *kh = k + h * Dh;
        for (size_t d = 0; d < Dh; d++)
            kt[d * BS] = kh[d];
        if (vb)
            memcpy(vb + (h * BS + o) * Dh, v + h * Dh, sizeof(float) * Dh);
    }
}

void kv_write(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, const float *k,
              const float *v) {
    kv_write_heads(c, s, l, pos, k, v, 0, c->Hkv);
}

void kv_read(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, float *k, float *v) {
    MO_ASSERT(pos >= 0 && pos < s->len);
    int32_t b = s->blocks[pos / c->block_tokens];
    size_t BS = (size_t)c->block_tokens, o = (size_t)(pos % c->block_tokens), Dh = (size_t)c->Dh;
    const float *kb = kv_k_block(c, l, b), *vb = kv_v_block(c, l, b);
    for (size_t h = 0; h < (size_t)c->Hkv; h++) {
        const float *kt = kb + h * Dh * BS + o;
        for (size_t d = 0; d < Dh; d++)
            k[h * Dh + d] = kt[d * BS];
        if (vb && v)
            memcpy(v + h * Dh, vb + (h * BS + o) * Dh, sizeof(float) * Dh);
    }
}
