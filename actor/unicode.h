/* unicode: strict UTF-8 decoding and encoding, the White_Space property, and
 * canonical composition (NFC) for the tokenizers; invalid bytes pass through. */
#ifndef MOERL_ACTOR_UNICODE_H
#define MOERL_ACTOR_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Returned by uni_next for a byte that does not start a well-formed sequence
 * (stray continuation, overlong form, surrogate, beyond U+10FFFF, truncated). */
#define UNI_INVALID 0xFFFFFFFFu

/* Decodes the character at s (n > 0 bytes available). *len receives the bytes
 * it spans: 1..4 for a character, 1 for an invalid byte (UNI_INVALID). */
uint32_t uni_next(const char *s, size_t n, size_t *len);
/* Writes cp (<= U+10FFFF) as UTF-8 into out (room for 4); returns the length. */
size_t uni_put(uint32_t cp, char *out);
/* True for the Unicode White_Space property (what Rust's char::is_whitespace
 * and a Unicode-aware \s accept). */
bool uni_is_space(uint32_t cp);

/* NFC of s[0..n): canonical decomposition, canonical ordering, canonical
 * composition (Hangul computed, everything else from tables generated from the
 * Unicode Character Database; uni_version() names its version). Each invalid
 * byte is kept as is and blocks composition across it, so the result differs
 * from the input only where valid text changes under NFC. *out is malloc'd,
 * NUL-terminated, owned by the caller. */
int uni_nfc(const char *s, size_t n, char **out, size_t *out_len);
/* Unicode version of the tables ("14.0.0"). */
const char *uni_version(void);

#ifdef __cplusplus
}
#endif
#endif
