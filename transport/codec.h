/* codec: MessagePack encoding and validating decoding of every protocol
 * message (docs/protocol.md). */
#ifndef MOERL_TRANSPORT_CODEC_H
#define MOERL_TRANSPORT_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "transport/msg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A growable byte buffer that encodings are written into. */
typedef struct msg_buf {
    uint8_t *data; /* (cap) */
    size_t len;
    size_t cap;
    int oom; /* an allocation failed while writing */
} msg_buf_t;

void msg_buf_init(msg_buf_t *b);
void msg_buf_free(msg_buf_t *b);
/* Hands the bytes to the caller (free() them); the buffer is left empty. */
uint8_t *msg_buf_steal(msg_buf_t *b, size_t *len);

/* Encodes m into out (replacing its contents, keeping its capacity). The
 * message is first checked against the same bounds a decoder applies:
 * MO_EINVAL with "type.field: what" when it would be refused by the peer;
 * MO_ENOMEM when the buffer cannot grow. */
int msg_encode(const msg_t *m, msg_buf_t *out);

/* Decodes one message from buf (len bytes: exactly one MessagePack map).
 * expect: the only type accepted, or MSG_NONE for any. On success *out owns
 * all its memory (release with msg_free). On failure *out is empty and the
 * status is MO_EMALFORMED, with a message naming the message type and the
 * field ("trajectory_group.samples[3].logprobs: 17 values for 18 tokens"),
 * or MO_ENOMEM. Fields a decoder does not know are ignored. */
int msg_decode(msg_t *out, const void *buf, size_t len, msg_type_t expect);

/* The type of an encoded message, reading only its "type" field (cheap
 * routing before a full decode); MO_EMALFORMED when there is none. */
int msg_peek_type(const void *buf, size_t len, msg_type_t *type);

#ifdef __cplusplus
}
#endif
#endif
