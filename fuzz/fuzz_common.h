/* fuzz_common: the message families the fuzz targets cover (the first input
 * byte selects the expected type), and the property every target checks. */
#ifndef MOERL_FUZZ_COMMON_H
#define MOERL_FUZZ_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec.h"
#include "transport/msg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Index 0 of every family is MSG_NONE: any type. */
static const msg_type_t fuzz_control_types[] = {
    MSG_NONE,        MSG_HELLO,     MSG_WELCOME,     MSG_HEARTBEAT, MSG_SNAPSHOT_REQUEST,
    MSG_CTL_REQUEST, MSG_CTL_REPLY, MSG_REWARD_SWAP, MSG_ERROR,
};
static const msg_type_t fuzz_work_types[] = {MSG_NONE, MSG_WORK_REQUEST, MSG_LEASE};
static const msg_type_t fuzz_trajectory_types[] = {MSG_NONE, MSG_TRAJECTORY_GROUP,
                                                   MSG_SCORE_REQUEST, MSG_SCORE_REPLY};

#define FUZZ_COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Decodes; the result must be MO_OK or MO_EMALFORMED, and an accepted
 * message must encode again, decode again, and encode to the same bytes.
 * Returns the status; the decoded message is left in *out (msg_free it). */
static inline int fuzz_decode(const uint8_t *data, size_t len, msg_type_t expect, msg_t *out) {
    int rc = msg_decode(out, data, len, expect);
    if (rc != MO_OK) {
        if (rc != MO_EMALFORMED || out->type != MSG_NONE)
            abort();
        return rc;
    }
    if (expect != MSG_NONE && out->type != expect)
        abort();
    msg_type_t peek = MSG_NONE;
    if (msg_peek_type(data, len, &peek) != MO_OK || peek != out->type)
        abort();
    msg_buf_t a, b;
    msg_t again;
    msg_buf_init(&a);
    msg_buf_init(&b);
    if (msg_encode(out, &a) != MO_OK)
        abort();
    if (msg_decode(&again, a.data, a.len, out->type) != MO_OK)
        abort();
    if (msg_encode(&again, &b) != MO_OK || a.len != b.len || memcmp(a.data, b.data, a.len) != 0)
        abort();
    msg_free(&again);
    msg_buf_free(&a);
    msg_buf_free(&b);
    return rc;
}

/* One input: selector byte, then the message. */
static inline int fuzz_family(const uint8_t *data, size_t size, const msg_type_t *types,
                              size_t ntypes) {
    if (size < 1)
        return 0;
    msg_t m;
    fuzz_decode(data + 1, size - 1, types[data[0] % ntypes], &m);
    msg_free(&m);
    return 0;
}

#ifdef __cplusplus
}
#endif
#endif
