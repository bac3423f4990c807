/* zap: CURVE client authentication: a ZAP handler (ZeroMQ RFC 27) on a context's
 * inproc://zeromq.zap.01 that admits only clients whose public key is on an
 * allow-list, and the allow-list file format. */
#ifndef MOERL_TRANSPORT_ZAP_H
#define MOERL_TRANSPORT_ZAP_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZAP_KEY_LEN 40 /* a CURVE public key in Z85 */

typedef char zap_key_t[ZAP_KEY_LEN + 1];

/* Reads an allow-list of CURVE public keys. path is either a file with one Z85 key a
 * line ('#' starts a comment line; blank lines and surrounding whitespace are ignored)
 * or a directory whose "*.pub" files (as `moerl keys gen` writes them) hold one key each.
 * *keys (malloc'd, free it) receives the n distinct keys. MO_ECONFIG naming the file
 * (and line) on an unreadable file, a bad key, or a list without any key. */
int zap_allowlist_load(const char *path, zap_key_t **keys, int *n);

typedef struct zap zap_t;

/* Starts a ZAP handler thread on ctx: CURVE handshakes with a server socket of ctx are
 * admitted when the client's public key is one of keys (n >= 1, copied) and refused
 * otherwise (the client's handshake fails and nothing it sends is delivered). NULL
 * mechanism handshakes (sockets without CURVE) are admitted, others refused. Only one
 * handler per context (MO_ESTATE when ctx has one). Stop it before zmq_ctx_term. */
int zap_start(void *ctx, const zap_key_t *keys, int n, zap_t **out);
/* Stops the thread and closes its sockets; safe on NULL. */
void zap_stop(zap_t **z);

/* Handshakes admitted and refused so far (any thread). */
uint64_t zap_admitted(const zap_t *z);
uint64_t zap_refused(const zap_t *z);
/* The public key (Z85) of the last refused client, "" when none (any thread). */
void zap_last_refused(const zap_t *z, zap_key_t out);

#ifdef __cplusplus
}
#endif
#endif
