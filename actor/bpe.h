/* bpe: byte-level BPE model: vocabulary, merge ranks, GPT-2's byte<->unicode
 * mapping, and the rank-ordered merge loop with a per-pre-token cache. */
#ifndef MOERL_ACTOR_BPE_H
#define MOERL_ACTOR_BPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A growable array of token ids. */
typedef struct bpe_ids {
    int32_t *v; /* (n) token ids, room for cap */
    size_t n, cap;
} bpe_ids_t;

int bpe_ids_push(bpe_ids_t *ids, int32_t id);
void bpe_ids_free(bpe_ids_t *ids);

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
 * other 68 bytes for U+0100.. in byte order. */
uint32_t bpe_byte_char(uint8_t b);
/* The byte code point cp stands for, or -1 when it stands for none. */
int bpe_char_byte(uint32_t cp);
/* Raw bytes -> mapped UTF-8 (out has room for 2 * n bytes); returns its length. */
size_t bpe_map(const char *bytes, size_t n, char *out);
/* Mapped UTF-8 -> raw bytes (out has room for n bytes). False when some
 * character stands for no byte (out is then unspecified). */
bool bpe_unmap(const char *s, size_t n, char *out, size_t *out_len);

typedef struct bpe bpe_t;

/* Token ids must lie in [0, BPE_MAX_ID). */
#define BPE_MAX_ID (1 << 24)

int bpe_new(bpe_t **out);
void bpe_destroy(bpe_t **b);

/* Adds the vocabulary entry `key` (spelled as tokenizer.json spells it, i.e.
 * mapped) with `id`. A key whose characters are not all mapped is kept for
 * decoding (its UTF-8 bytes) but no merge or lookup by bytes can reach it.
 * Errors: MO_EINVAL for a bad id, a repeated id, or a repeated key. */
int bpe_add_token(bpe_t *b, const char *key, size_t len, int32_t id);
/* Appends the next merge (its rank is the number of merges added before it);
 * both sides and their concatenation must be vocabulary keys (MO_ENOTFOUND).
 * A repeated pair takes the later rank. */
int bpe_add_merge(bpe_t *b, const char *left, size_t nl, const char *right, size_t nr);
/* Ends loading: every byte must have its single-byte token (MO_EMALFORMED).
 * ignore_merges: a pre-token that is itself a vocabulary token is emitted
 * whole (Llama 3). */
int bpe_finish(bpe_t *b, bool ignore_merges);

/* Id of a vocabulary key (mapped spelling), or -1. */
int32_t bpe_key_id(const bpe_t *b, const char *key, size_t len);
/* Id of the token whose bytes are exactly bytes[0..n), or -1. */
int32_t bpe_bytes_id(const bpe_t *b, const char *bytes, size_t n);
/* The bytes a token decodes to: the unmapped key, or for a key that is not all
 * mapped its UTF-8 spelling. MO_ENOTFOUND when no token has that id. */
int bpe_token_bytes(const bpe_t *b, int32_t id, const char **bytes, size_t *len);
/* 1 + the highest id in the vocabulary (0 when empty). */
size_t bpe_size(const bpe_t *b);
size_t bpe_num_merges(const bpe_t *b);

/* Appends the tokens of one pre-token word[0..n) (raw bytes): merges the
 * lowest-ranked adjacent pair first, leftmost among equals, until none
 * applies. Thread-safe: the cache behind it is locked. */
int bpe_encode(const bpe_t *b, const char *word, size_t n, bpe_ids_t *out);

#ifdef __cplusplus
}
#endif
#endif
