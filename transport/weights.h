/* weights: streaming an adapter version as weights_chunk messages: the
 * 64-bit checksum, a splitter of a flat buffer into chunks, and an
 * assembler that takes chunks in any order and verifies the result. */
#ifndef MOERL_TRANSPORT_WEIGHTS_H
#define MOERL_TRANSPORT_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#include "core/arena.h"
#include "transport/msg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* XXH64 with seed 0 (the public xxHash64 algorithm) of n bytes: the
 * checksum of a whole flat adapter buffer, carried in every weights_chunk.
 * The learner computes it with this function; anyone can recompute it with
 * any xxHash64 implementation. */
uint64_t weights_hash64(const void *data, size_t n);

/* ---- Splitter: one adapter version, chunk by chunk, nothing copied ---- */

typedef struct weights_split {
    const uint8_t *flat; /* (total_bytes), borrowed */
    uint64_t total_bytes;
    uint64_t chunk_bytes; /* every chunk but the last holds this many */
    uint32_t n_chunks;
    uint64_t version;
    uint64_t checksum;               /* weights_hash64(flat, total_bytes) */
    const msg_tensor_entry_t *table; /* (n_table), borrowed */
    uint32_t n_table;
    msg_strmap_t meta; /* borrowed */
} weights_split_t;

/* Checks the table against the buffer (MO_EINVAL naming the tensor: unknown
 * dtype, misaligned offset, out of the buffer, overlapping, repeated name),
 * computes the checksum and the chunk count. chunk_bytes: the most data
 * bytes per chunk, 1 .. 2^32-1 (leave room under transport.max_msg_bytes
 * for the table that chunk 0 also carries). meta may be NULL. */
int weights_split_init(weights_split_t *s, const void *flat, uint64_t total_bytes,
                       const msg_tensor_entry_t *table, uint32_t n_table, const msg_strmap_t *meta,
                       uint64_t version, uint64_t chunk_bytes);
/* Chunk i (< n_chunks) as a MSG_WEIGHTS_CHUNK message that points into the
 * flat buffer and the table; ready for msg_encode, needs no msg_free. */
void weights_split_chunk(const weights_split_t *s, uint32_t i, msg_t *out);

/* ---- Assembler ---- */

/* A complete, verified adapter version. */
typedef struct weights_adapter {
    uint64_t version;
    uint64_t checksum;
    uint8_t *data; /* (total_bytes), 64-byte aligned */
    uint64_t total_bytes;
    msg_tensor_entry_t *table; /* (n_table) */
    uint32_t n_table;
    msg_strmap_t meta;
    arena_t arena; /* owns table, names and meta */
} weights_adapter_t;

void weights_adapter_free(weights_adapter_t *a);
/* The table entry called name, or NULL. */
const msg_tensor_entry_t *weights_adapter_find(const weights_adapter_t *a, const char *name);

/* Results of weights_assembler_add besides errors. */
enum {
    WEIGHTS_MORE = 0,      /* accepted; more chunks are needed */
    WEIGHTS_DONE = 1,      /* accepted; the version is complete and its checksum matches */
    WEIGHTS_DUPLICATE = 2, /* this chunk was already here with the same bytes: ignored */
    WEIGHTS_STALE = 3,     /* older than the version being assembled or last completed: ignored */
};

typedef struct weights_assembler weights_assembler_t;

/* max_total_bytes: the largest adapter accepted (memory is allocated when a
 * version's first chunk arrives). */
int weights_assembler_new(weights_assembler_t **out, uint64_t max_total_bytes);
void weights_assembler_destroy(weights_assembler_t **a);

/* Adds one chunk of any version, in any order. A newer version than the
 * one in progress abandons it. MO_EMALFORMED (nothing changes) for a chunk
 * that fails the weights_chunk checks, is larger than max_total_bytes,
 * disagrees with the version's earlier chunks (checksum, sizes, chunk
 * count), or repeats a chunk with different bytes; MO_EMALFORMED also when
 * the last chunk completes a buffer whose checksum does not match, and then
 * the whole version is dropped. */
int weights_assembler_add(weights_assembler_t *a, const msg_weights_chunk_t *c);
/* After WEIGHTS_DONE: moves the adapter into *out (free with
 * weights_adapter_free); MO_ESTATE when no complete version is waiting. */
int weights_assembler_take(weights_assembler_t *a, weights_adapter_t *out);
/* The version in progress (0 when none), chunks received and expected. */
void weights_assembler_progress(const weights_assembler_t *a, uint64_t *version, uint32_t *have,
                                uint32_t *n_chunks);
/* The last version completed (has = 0 when none yet). */
void weights_assembler_latest(const weights_assembler_t *a, int *has, uint64_t *version);

#ifdef __cplusplus
}
#endif
#endif
