/* kv_cache: the rollout engine's paged f32 key/value cache: fixed-size blocks under a
 * token budget, reservations that admitted requests draw from, and blocks shared by the
 * samples of one prompt. */
#ifndef MOERL_ROLLOUT_KV_CACHE_H
#define MOERL_ROLLOUT_KV_CACHE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: L layers, NB blocks, BS tokens per block, Hkv kv heads, Dh head dim.
 *
 * A sequence's token at position p lives in slot p % BS of block blocks[p / BS] of its
 * block table. Within a block, keys are stored transposed per kv head, (Hkv, Dh, BS),
 * so that the scores of a query against a whole block are one vector loop over the
 * slots; values are (Hkv, BS, Dh). A block's keys and values are adjacent in memory (one
 * run of 2 BS Hkv Dh floats per layer), so that reading a block is one long sequential
 * read rather than several page-sized ones. Blocks carry a reference count: kv_seq_fork
 * lets a new sequence hold the full blocks of another (the prompt shared by G samples) and
 * copies the last, partial one, so every write goes to a block only its sequence holds.
 *
 * Budget: the cache has NB = ceil(budget / BS) blocks. A request reserves, when it is
 * admitted, every block it may ever need (kv_cache_reserve); growing and forking take
 * blocks out of the reservation, so a running request never runs out. A reservation
 * that does not fit now is refused without error (the request waits); one larger than
 * the whole cache is an error. */
#define KV_BLOCK_TOKENS 16

typedef struct kv_cache {
    int L, Hkv, Dh;
    int block_tokens;     /* BS */
    int n_blocks;         /* NB */
    size_t row;           /* Hkv * Dh floats per token and layer */
    int parts;            /* 2: keys and values; 1: a latent (keys-only) cache */
    float *mem;           /* (L, NB, parts, BS * row): each block's keys (Hkv, Dh, BS), then
                           * its values (Hkv, BS, Dh) */
    int32_t *ref;         /* (NB) sequences holding each block; 0 = free */
    int32_t *free_blocks; /* (NB) stack of free block ids, n_free on it */
    int n_free;
    int64_t reserved; /* blocks promised to admitted requests and not yet taken */
} kv_cache_t;

/* One sequence's view of the cache. Zero-initialised = empty. */
typedef struct kv_seq {
    int32_t *blocks; /* (cap) block table */
    int n_blocks, cap;
    int len; /* positions 0 .. len-1 are stored */
} kv_seq_t;

/* budget_tokens >= 1; block_tokens 0 means KV_BLOCK_TOKENS. The memory is allocated
 * once (untouched pages cost nothing until used). MO_ENOMEM names the bytes. */
int kv_cache_init(kv_cache_t *c, int L, int Hkv, int Dh, int64_t budget_tokens, int block_tokens);
/* A keys-only cache of one row of `width` floats per token and layer, stored as keys
 * (1, width, BS) with no values (parts 1): the compressed latent of multi-head latent
 * attention, whose values are read from the same row (attn_decode_latent). kv_write and
 * kv_read take v NULL for it; kv_v_block returns NULL. */
int kv_cache_init_latent(kv_cache_t *c, int L, int width, int64_t budget_tokens, int block_tokens);
/* Bytes the cache holds per token over all layers: L * row floats for a latent cache,
 * twice that (keys and values) otherwise. */
size_t kv_cache_token_bytes(const kv_cache_t *c);
void kv_cache_free(kv_cache_t *c);
/* Gives the memory back and keeps the bookkeeping (blocks, references, reservations): for
 * a cache whose keys and values live elsewhere, in the same layout (a device copy). New
 * blocks are then not zeroed and forks copy no data (their caller copies the partial
 * block: kv_seq_fork leaves it in dst's last block when src->len % BS != 0); kv_write,
 * kv_read and the block pointers must not be used. */
void kv_cache_drop_memory(kv_cache_t *c);

/* Blocks needed to hold `tokens` positions: ceil(tokens / BS). */
int64_t kv_cache_blocks_for(const kv_cache_t *c, int64_t tokens);
/* Blocks that are free and not reserved. */
int64_t kv_cache_available(const kv_cache_t *c);
/* Tokens held by sequences (blocks in use times BS). */
int64_t kv_cache_used_tokens(const kv_cache_t *c);

/* Reserves `blocks`: 1 when done, 0 when they are not available now (nothing changes:
 * wait for sequences to be released), MO_EINVAL when blocks exceeds the whole cache
 * (it never fits; the message names both). */
int kv_cache_reserve(kv_cache_t *c, int64_t blocks);
/* Returns unused reserved blocks. */
void kv_cache_unreserve(kv_cache_t *c, int64_t blocks);

/* Makes room for positions up to new_len - 1, taking the blocks from the reservation;
 * *budget (the caller's share of it) is decreased by the blocks taken. MO_ESTATE when
 * *budget or the reservation is short (the caller reserved too little). len is
 * set to new_len: the caller writes the new positions. */
int kv_seq_grow(kv_cache_t *c, kv_seq_t *s, int new_len, int64_t *budget);
/* dst (empty) becomes a copy of src: full blocks shared, the partial last block copied
 * into a block from the reservation (charged to *budget). */
int kv_seq_fork(kv_cache_t *c, kv_seq_t *dst, const kv_seq_t *src, int64_t *budget);
/* Drops the sequence's hold on its blocks (a block is freed with its last holder) and
 * empties it. */
void kv_seq_release(kv_cache_t *c, kv_seq_t *s);

/* Stores k and v (Hkv, Dh) as position pos of layer l; pos < s->len, in a block only s
 * holds. */
void kv_write(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, const float *k,
              const float *v);
/* kv_write for kv heads h0 .. h1-1 only (k and v are still (Hkv, Dh)). */
void kv_write_heads(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, const float *k,
                    const float *v, int h0, int h1);
/* Reads position pos of layer l back into k and v (Hkv, Dh). */
void kv_read(const kv_cache_t *c, const kv_seq_t *s, int l, int pos, float *k, float *v);
/* Block b of layer l: keys (Hkv, Dh, BS), values (Hkv, BS, Dh). */
float *kv_k_block(const kv_cache_t *c, int l, int32_t b);
float *kv_v_block(const kv_cache_t *c, int l, int32_t b);

#ifdef __cplusplus
}
#endif
#endif
