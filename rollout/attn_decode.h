/* attn_decode: grouped-query attention of new tokens over their sequences' cached keys
 * and values (paged KV cache), with sliding windows, and multi-head latent attention over
 * a latent cache, on the CPU. */
#ifndef MOERL_ROLLOUT_ATTN_DECODE_H
#define MOERL_ROLLOUT_ATTN_DECODE_H

#include <stdint.h>

#include "rollout/kv_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: N query rows, H query heads, Hkv kv heads (the cache's), Dh head dim.
 *
 * Row i is a token at position pos[i] of sequence seqs[i], whose keys and values for
 * positions 0 .. pos[i] are already in layer l of the cache. Query head h reads kv head
 * h / (H / Hkv). out[i, h] = sum_j softmax_j(scale * q[i, h] . k_j) v_j over the
 * positions j with lo <= j <= pos[i], lo = max(0, pos[i] - window + 1) (window 0: lo =
 * 0), the same keys causal attention over the whole sequence gives that token. Rows of
 * one sequence may appear several times (a chunk of new tokens).
 * Adjacent rows whose sequences hold the same leading blocks (the samples of one prompt
 * after kv_seq_fork) are attended together, up to 16 rows: each shared block (full, and
 * inside every row's window) has its keys and values read once for all their queries
 * instead of once per row. A row's arithmetic is the same either way (scores per block,
 * values added block by block in order), so its result does not depend on the other rows.
 * Work is split over groups (all kv heads of a block read together), or (group, kv heads)
 * parts when groups are fewer than twice the threads, each part written by one thread: the
 * same bits on any thread count. */
void attn_decode_forward(float *out, const float *q, const kv_cache_t *c, int l,
                         const kv_seq_t *const *seqs, const int32_t *pos, int N, int H, float scale,
                         int window);

/* attn_decode_forward after storing each row's key and value, k and v (N, Hkv, Dh), at
 * pos[i] of its sequence (as kv_write does; positions up to pos[i] - 1 are already in the
 * cache). Each row's store is made by the task that then reads its block, while the block
 * is in cache. Every row must be a different sequence (one new token each: a decode step);
 * the results are the same bits as kv_write then attn_decode_forward. */
void attn_decode_store_forward(float *out, const float *q, const float *k, const float *v,
                               const kv_cache_t *c, int l, const kv_seq_t *const *seqs,
                               const int32_t *pos, int N, int H, float scale, int window);

/* Multi-head latent attention over a latent cache (kv_cache_init_latent: one row of
 * W = c->Dh floats per token). Row i, head h: out[i, h] (Dc) = sum_j softmax_j(scale *
 * q[i, h] . r_j) r_j[0 .. Dc-1] over the positions 0 <= j <= pos[i] of seqs[i], r_j the
 * cached row; q (N, H, W). With r_j = [c_kv | k_pe] and q = [q_nope W_UK | q_pe] this is
 * the absorbed form of MLA's attention, before the values' up-projection. Work is split
 * over (row, head) pairs; a pair's arithmetic does not depend on the thread count. */
void attn_decode_latent(float *out, const float *q, const kv_cache_t *c, int l,
                        const kv_seq_t *const *seqs, const int32_t *pos, int N, int H, int Dc,
                        float scale);

#ifdef __cplusplus
}
#endif
#endif
