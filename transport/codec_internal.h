/* codec_internal: helpers shared by transport/codec*.c (field lookup, typed
 * getters, bound checks, the packer); not part of the public API. */
#ifndef MOERL_TRANSPORT_CODEC_INTERNAL_H
#define MOERL_TRANSPORT_CODEC_INTERNAL_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/codec.h"
#include "transport/msg.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format carries tensors as little-endian bytes; this host is big-endian"
#endif

/* ---- Context: which message and field an error is about ---- */

typedef struct cx {
    int code;         /* MO_EMALFORMED when decoding, MO_EINVAL when encoding */
    const char *type; /* message type name, the first word of every error */
    char path[256];   /* ".samples[3]": where inside the message */
    size_t plen;
    arena_t *arena; /* decoding: where decoded data is allocated */
} cx_t;

void cx_init(cx_t *c, int code, const char *type, arena_t *arena);
/* Sets "type<path>.field: what" (field may be NULL) and returns c->code. */
int cx_fail(cx_t *c, const char *field, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Appends to the path (".samples[3]"); returns the length to restore. */
size_t cx_push(cx_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cx_pop(cx_t *c, size_t old);
/* Arena allocation that reports MO_ENOMEM. */
int cx_alloc(cx_t *c, size_t bytes, void **out);

/* ---- Decoding: fields of a map, typed getters ---- */

typedef struct fld {
    const char *name;
    const msgpack_object *v; /* NULL when the key is absent */
} fld_t;
#define FLD(name)                                                                                  \
    { (name), NULL }

/* A short name of an object's type ("a string", "an integer", ...). */
const char *mp_kind(const msgpack_object *o);
/* Finds each named field of map o (unknown keys are skipped; keys must be
 * strings; a repeated known key is malformed). what names o in errors (NULL:
 * the current path). */
int dec_fields(cx_t *c, const msgpack_object *o, const char *what, fld_t *f, int nf);
/* True when the field is there and not nil (nil reads as absent). */
bool fld_has(const fld_t *f);

int dec_u64(cx_t *c, const fld_t *f, uint64_t *out);
int dec_u64_opt(cx_t *c, const fld_t *f, bool *has, uint64_t *out);
int dec_u32(cx_t *c, const fld_t *f, uint32_t *out);
int dec_i64(cx_t *c, const fld_t *f, int64_t lo, int64_t hi, int64_t *out);
int dec_f64(cx_t *c, const fld_t *f, double *out);
int dec_f64_opt(cx_t *c, const fld_t *f, bool *has, double *out);
int dec_bool(cx_t *c, const fld_t *f, bool *out);
/* A string of at most max bytes, no NUL byte, copied with a terminator. */
int dec_str(cx_t *c, const fld_t *f, size_t max, const char **out);
int dec_str_opt(cx_t *c, const fld_t *f, size_t max, const char **out);
/* A string that must be one of names[0..n). */
int dec_enum(cx_t *c, const fld_t *f, const char *(*name)(int), int n, int *out);
/* An array of at most max elements (never empty is not implied). */
int dec_array(cx_t *c, const fld_t *f, uint32_t max, const msgpack_object **items, uint32_t *n);
int dec_strmap_opt(cx_t *c, const fld_t *f, size_t maxval, msg_strmap_t *out);
/* A map of string to number, o itself (elements of reward details). */
int dec_metrics_obj(cx_t *c, const msgpack_object *o, msg_metrics_t *out);
/* A tensor {dtype, shape, data} of dtype want with ndim dimensions; the
 * data is copied into the arena (64-byte aligned). Optional form: *data is
 * NULL when absent. */
int dec_tensor(cx_t *c, const fld_t *f, dtype_t want, uint32_t ndim, int64_t *shape,
               const void **data);
int dec_tensor_opt(cx_t *c, const fld_t *f, dtype_t want, uint32_t ndim, int64_t *shape,
                   const void **data);
/* A 1-dimensional tensor of at most max elements. */
int dec_vector(cx_t *c, const fld_t *f, dtype_t want, uint32_t max, const void **data, uint32_t *n);
int dec_vector_opt(cx_t *c, const fld_t *f, dtype_t want, uint32_t max, const void **data,
                   uint32_t *n);

/* ---- Checks shared by encoder and decoder ---- */

/* Valid UTF-8 (no overlongs, surrogates or code points past U+10FFFF);
 * on failure *bad is the offset of the first bad byte. */
bool utf8_valid(const char *s, size_t n, size_t *bad);
int ck_str(cx_t *c, const char *field, const char *s, size_t min, size_t max);
int ck_str_opt(cx_t *c, const char *field, const char *s, size_t max);
/* worker_id: 1 .. MSG_MAX_ID bytes of [A-Za-z0-9._:@-]. */
int ck_id(cx_t *c, const char *field, const char *s);
int ck_u64(cx_t *c, const char *field, uint64_t v, uint64_t lo, uint64_t hi);
/* Finite and within [lo, hi]. */
int ck_f64(cx_t *c, const char *field, double v, double lo, double hi);
int ck_enum(cx_t *c, const char *field, int v, int n);
int ck_strmap(cx_t *c, const char *field, const msg_strmap_t *m, size_t maxval);
int ck_metrics(cx_t *c, const char *field, const msg_metrics_t *m);
/* n token ids (>= 0) at p, min <= n <= max. */
int ck_tokens(cx_t *c, const char *field, const int32_t *p, uint32_t n, uint32_t min, uint32_t max);
/* Sorts keys (n) and fails on the first repeated one. */
int ck_unique(cx_t *c, const char *field, const char **keys, uint32_t n);
/* The same for n items of stride bytes whose first member is the key. */
int ck_unique_keys(cx_t *c, const char *field, const void *items, uint32_t n, size_t stride);
/* n finite floats at p. */
int ck_finite(cx_t *c, const char *field, const float *p, uint32_t n);

/* ---- Encoding ---- */

typedef struct enc {
    msgpack_packer pk;
    msg_buf_t *buf;
    size_t pos[MSG_MAX_DEPTH];     /* offset of each open map's header */
    uint32_t count[MSG_MAX_DEPTH]; /* fields written into each open map */
    int depth;
} enc_t;

void enc_init(enc_t *e, msg_buf_t *b);
/* A map whose size is patched in by enc_map_end: every enc_key in between
 * counts one entry. */
void enc_map_begin(enc_t *e);
void enc_map_end(enc_t *e);
void enc_key(enc_t *e, const char *k);
void enc_str(enc_t *e, const char *s);
void enc_u64(enc_t *e, uint64_t v);
void enc_i64(enc_t *e, int64_t v);
void enc_f64(enc_t *e, double v);
void enc_bool(enc_t *e, bool v);
void enc_tensor(enc_t *e, dtype_t dt, uint32_t ndim, const int64_t *shape, const void *data);
void enc_vector(enc_t *e, dtype_t dt, uint32_t n, const void *data);
void enc_strmap(enc_t *e, const msg_strmap_t *m);
void enc_metrics(enc_t *e, const msg_metrics_t *m);

/* ---- Per-type codecs (codec_control.c, codec_work.c, codec_trajectory.c,
 * codec_weights.c) ---- */

typedef struct msg_codec {
    /* Reads the fields of the top-level map o into m's member. */
    int (*decode)(cx_t *c, const msgpack_object *o, msg_t *m);
    /* Value checks shared by encoding and decoding. */
    int (*check)(cx_t *c, const msg_t *m);
    /* Writes the fields after "type" and "v" (m has passed check). */
    void (*encode)(enc_t *e, const msg_t *m);
} msg_codec_t;

extern const msg_codec_t codec_hello, codec_welcome, codec_heartbeat, codec_snapshot_request,
    codec_ctl_request, codec_ctl_reply, codec_reward_swap, codec_error;
extern const msg_codec_t codec_work_request, codec_lease;
extern const msg_codec_t codec_trajectory_group, codec_score_request, codec_score_reply;
extern const msg_codec_t codec_weights_chunk;

/* Checks a weights table against the flat buffer size: known dtypes,
 * offsets aligned to the dtype size, every tensor inside total_bytes, no two
 * overlapping, names unique. */
int ck_weights_table(cx_t *c, const char *field, const msg_tensor_entry_t *t, uint32_t n,
                     uint64_t total_bytes);

/* Every check of one weights_chunk on its own (geometry, data length, the
 * table on chunk 0 only). */
int ck_weights_chunk(cx_t *c, const msg_weights_chunk_t *w);

/* Walks the MessagePack bytes without allocating: one complete object of
 * at most MSG_MAX_DEPTH nesting and MSG_MAX_OBJECTS objects, every
 * container's count within the bytes left, and nothing after it. */
int mp_scan(const uint8_t *p, size_t len, char *why, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
