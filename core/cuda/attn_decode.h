/* cuda attn_decode: the rollout engine's decode attention on the CUDA device: grouped-query
 * attention of new tokens over a paged KV cache with sliding windows, the device twin of
 * rollout/attn_decode.c over the same cache layout (rollout/kv_cache.h). */
#ifndef MOERL_CORE_CUDA_ATTN_DECODE_H
#define MOERL_CORE_CUDA_ATTN_DECODE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes: N query rows, H query heads, Hkv kv heads, Dh head dim, L layers, NB cache
 * blocks, BS tokens per block; G = H / Hkv query heads per kv head.
 *
 * cache is the memory of a keys-and-values kv_cache_t (kv_cache_t.mem, parts 2) copied to
 * the device: (L, NB, 2, BS Hkv Dh) floats, block b of layer l one run at ((l NB + b) 2)
 * BS Hkv Dh holding its keys transposed per kv head (Hkv, Dh, BS), then its values
 * (Hkv, BS, Dh). block_tables (N, max_blocks): row i's sequence holds its position p in
 * slot p % BS of block block_tables[i, p / BS].
 *
 * Row i is a token at position pos[i] whose keys and values for positions 0 .. pos[i] are in
 * layer l of the cache. Query head h reads kv head h / G. out (N, H, Dh): out[i, h] =
 * sum_j softmax_j(scale * q[i, h] . k_j) v_j over lo <= j <= pos[i], lo = max(0, pos[i] -
 * window + 1) when window > 0, else 0: attn_decode_forward's result, within f32 rounding
 * (sums in another order). q (N, H, Dh).
 *
 * k_new, v_new (N, Hkv, Dh), both or neither: when given, row i's key and value are first
 * stored at pos[i] of its sequence (keys transposed as above), the same bits as kv_write:
 * attn_decode_store_forward's contract. Every row must then be a different sequence and
 * the block holding pos[i] held by that sequence alone (kv_seq_fork copies partial blocks),
 * which the device cannot check.
 *
 * Work: one thread block per (row, kv head, split): the G query heads of a kv head share
 * every key and value read, with an online softmax (running max and sum) over tiles of
 * positions. splits cuts each row's range into that many chunks attended in parallel
 * (flash-decoding) whose partial results a second kernel merges in split order; 0 lets the
 * call choose from the grid size and the longest context the tables allow (1 for short
 * contexts); at most 1024 are used, and no more than the positions a row may attend to
 * (max_blocks BS, or window). The result depends on the splits only in rounding.
 * Deterministic: fixed reduction order, no atomics; the same arguments give the
 * same bits on every call.
 *
 * A row whose pos[i] is negative or beyond its table (pos[i] >= max_blocks BS), or whose
 * table names a block outside [0, NB) within its range, reads and writes no cache memory:
 * its outputs are NaN (and its key and value are not stored).
 *
 * Every pointer is DEVICE memory; the work is queued on the calling thread's stream of the
 * CUDA backend (backend set_stream), like every device block, and nothing waits for it.
 * Returns MO_OK when queued; MO_EINVAL for a bad shape or a NULL pointer; MO_EUNSUPPORTED
 * when G and Dh need more shared memory than a block may have; MO_EDEVICE (also recorded
 * for backend synchronize) when a CUDA call or a launch fails. Device scratch (split
 * partial results, N H splits (Dh + 2) floats) is the backend's per-(thread, stream)
 * attention slot. */
int cuda_attn_decode(float *out, const float *q, const float *k_new, const float *v_new,
                     float *cache, int L, int NB, int BS, int Hkv, int Dh, int l,
                     const int32_t *block_tables, int max_blocks, const int32_t *pos, int N, int H,
                     float scale, int window, int splits);

/* A prefill's keys and values into the cache: row i of k and v (N, Hkv, Dh) stored in
 * slot[i] = b BS + p % BS (block b, position p of its sequence) of layer l, the same bits
 * as kv_write (keys transposed per kv head (Hkv, Dh, BS), values (Hkv, BS, Dh)). Slots
 * name distinct places and lie in [0, NB BS) (the caller checks: the device skips a row
 * outside). Queued on the calling thread's stream; MO_EINVAL for a bad shape or a NULL
 * pointer, MO_EDEVICE when the launch fails. */
int cuda_kv_store(float *cache, const float *k, const float *v, int L, int NB, int BS, int Hkv,
                  int Dh, int l, const int32_t *slot, int N);

/* Block src of every layer copied to block dst (blk = 2 BS Hkv Dh floats each): one kernel
 * over the L layers (a layer of a large cache lies further apart than a strided copy's
 * pitch may), queued on the calling thread's stream. MO_EINVAL for a block outside
 * [0, NB) or a bad shape, MO_EDEVICE when the launch fails. */
int cuda_kv_copy_block(float *cache, int L, int NB, size_t blk, int src, int dst);

#ifdef __cplusplus
}
#endif
#endif
