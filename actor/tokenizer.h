/* tokenizer: Hugging Face tokenizer.json byte-level BPE (Qwen2/Qwen3, Llama 3,
 * GPT-2 shapes) and moerl's byte-level tokenizer for its built-in tiny models. */
#ifndef MOERL_ACTOR_TOKENIZER_H
#define MOERL_ACTOR_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The byte-level tokenizer written by tokenizer_write_bytelevel: ids 0..255
 * are the raw bytes, then the special tokens below. */
enum {
    TOK_BYTELEVEL_BOS = 256,      /* <|bos|> */
    TOK_BYTELEVEL_EOS = 257,      /* <|eos|> */
    TOK_BYTELEVEL_PAD = 258,      /* <|pad|> */
    TOK_BYTELEVEL_IM_START = 259, /* <|im_start|> */
    TOK_BYTELEVEL_IM_END = 260,   /* <|im_end|> */
    TOK_BYTELEVEL_VOCAB = 261,    /* vocabulary size */
};

typedef struct tokenizer tokenizer_t;

/* Loads `path`: a model directory (reads tokenizer.json and, when present,
 * tokenizer_config.json) or a tokenizer.json file (its directory's
 * tokenizer_config.json is read when present). Supported tokenizer.json:
 *   model: BPE over the ByteLevel alphabet; vocab; merges as "a b" strings or
 *     ["a", "b"] pairs; ignore_merges; byte_fallback false; no dropout.
 *   added_tokens: id, content, special, single_word, lstrip, rstrip, normalized.
 *   normalizer: null, NFC, or a Sequence of NFC.
 *   pre_tokenizer: ByteLevel, or a Sequence of Split{Regex or String,
 *     behavior Isolated, invert false} ending with ByteLevel.
 *   post_processor: null, ByteLevel, TemplateProcessing, or a Sequence of them.
 *   decoder: ByteLevel.
 * Anything else fails with a message naming the file and the JSON path
 * (MO_EMALFORMED for bad values, MO_EUNSUPPORTED for unsupported components,
 * MO_EIO when a file cannot be read). */
int tokenizer_load(const char *path, tokenizer_t **out);
void tokenizer_destroy(tokenizer_t **t);

/* Encodes text[0..len) (any bytes; invalid UTF-8 is kept byte for byte).
 * allow_special: special added tokens written in the text become their ids;
 * when false they are encoded as ordinary text (untrusted input). Added
 * tokens that are not special always match. Adds no BOS/EOS (see
 * tokenizer_affixes). *ids is malloc'd (free()); *n may be 0.
 * Thread-safe: one tokenizer can serve several threads. */
int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, bool allow_special,
                     int32_t **ids, size_t *n);
/* The same into a caller buffer of cap ids. *n receives the full count; when
 * it exceeds cap, MO_EINVAL is returned and ids holds the first cap. */
int tokenizer_encode_into(const tokenizer_t *t, const char *text, size_t len, bool allow_special,
                          int32_t *ids, size_t cap, size_t *n);

/* Decodes ids back to the exact bytes they stand for (special tokens as their
 * content). *out is malloc'd and NUL-terminated (free()); *out_len excludes
 * the NUL. MO_EINVAL names the first id that is not a token. */
int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, char **out,
                     size_t *out_len);
/* The bytes one token decodes to (borrowed, valid while t lives; a token may
 * hold part of a UTF-8 character). MO_EINVAL when id is not a token. */
int tokenizer_token_bytes(const tokenizer_t *t, int32_t id, const char **bytes, size_t *len);

/* Id of an added token by its content ("<|im_end|>"), else of a vocabulary
 * entry as tokenizer.json spells it; -1 when there is none. */
int32_t tokenizer_token_id(const tokenizer_t *t, const char *name);
/* True for added tokens marked special. */
bool tokenizer_is_special(const tokenizer_t *t, int32_t id);
/* 1 + the highest token id (model vocabulary and added tokens). */
size_t tokenizer_vocab_size(const tokenizer_t *t);
/* bos/eos/pad: from tokenizer_config.json (bos_token, eos_token, pad_token;
 * an explicit null means none); where it is absent, the first of the usual
 * names present among the added tokens (<|bos|>, <|begin_of_text|>, <s>;
 * <|eos|>, <|end_of_text|>, </s>, <|endoftext|>; <|pad|>, <pad>). -1: none. */
int32_t tokenizer_bos_id(const tokenizer_t *t);
int32_t tokenizer_eos_id(const tokenizer_t *t);
int32_t tokenizer_pad_id(const tokenizer_t *t);
/* The ids the post_processor's TemplateProcessing puts before and after a
 * single sequence when Hugging Face adds special tokens (Llama 3: prefix
 * <|begin_of_text|>, no suffix). Borrowed; counts may be 0. */
void tokenizer_affixes(const tokenizer_t *t, const int32_t **prefix, size_t *nprefix,
                       const int32_t **suffix, size_t *nsuffix);

/* Fills a prompt template: "{prompt}" is replaced by prompt, "{{" and "}}"
 * stand for single braces; any other "{...}" or an unpaired brace is
 * MO_EINVAL naming it. *out is malloc'd (free()). Example:
 * "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n". */
int tokenizer_apply_template(const char *tmpl, const char *prompt, char **out);

/* Writes dir/tokenizer.json and dir/tokenizer_config.json for the byte-level
 * tokenizer (TOK_BYTELEVEL_*), each atomically (temporary file, fsync,
 * rename, fsync of dir). Creates dir when missing (not its parents). */
int tokenizer_write_bytelevel(const char *dir);

#ifdef __cplusplus
}
#endif
#endif
