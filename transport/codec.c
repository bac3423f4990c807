/* codec: the message buffer, the MessagePack structure scan, typed field
 * getters, bound checks shared by encoders and decoders, the packer, and
 * msg_encode / msg_decode dispatch. The per-type codecs live in
 * codec_control.c, codec_work.c, codec_trajectory.c and codec_weights.c. */
#include "transport/codec.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

/* ---- Buffer ---- */

void msg_buf_init(msg_buf_t *b) {
    memset(b, 0, sizeof *b);
}

void msg_buf_free(msg_buf_t *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

uint8_t *msg_buf_steal(msg_buf_t *b, size_t *len) {
    uint8_t *p = b->data;
    *len = b->len;
    memset(b, 0, sizeof *b);
    return p;
}

/* msgpack_packer_write: appends, growing by doubling; sets oom instead of
 * failing so the encoders need not check every call. */
static int buf_write(void *data, const char *p, size_t n) {
    msg_buf_t *b = data;
    if (b->oom)
        return -1;
    if (n == 0)
        return 0;
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2) {
                b->oom = 1;
                return -1;
            }
            cap *= 2;
        }
        uint8_t *q = realloc(b->data, cap);
        if (!q) {
            b->oom = 1;
            return -1;
        }
        b->data = q;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

/* ---- Context ---- */

void cx_init(cx_t *c, int code, const char *type, arena_t *arena) {
    c->code = code;
    c->type = type;
    c->path[0] = '\0';
    c->plen = 0;
    c->arena = arena;
}

int cx_fail(cx_t *c, const char *field, const char *fmt, ...) {
    char what[512], name[81] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    /* a field may be a map key from the wire: printable ASCII only */
    for (size_t i = 0; field && field[i] && i < sizeof name - 1; i++) {
        name[i] = (field[i] >= 0x20 && field[i] < 0x7f) ? field[i] : '?';
        name[i + 1] = '\0';
    }
    return mo_errorf(c->code, "%s%s%s%s: %s", c->type, c->path, field ? "." : "", name, what);
}

size_t cx_push(cx_t *c, const char *fmt, ...) {
    size_t old = c->plen;
    if (old < sizeof c->path - 1) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(c->path + old, sizeof c->path - old, fmt, ap);
        va_end(ap);
        if (n > 0)
            c->plen = old + (size_t)n < sizeof c->path ? old + (size_t)n : sizeof c->path - 1;
    }
    return old;
}

void cx_pop(cx_t *c, size_t old) {
    c->plen = old;
    c->path[old] = '\0';
}

int cx_alloc(cx_t *c, size_t bytes, void **out) {
    *out = arena_alloc(c->arena, bytes);
    if (!*out)
        return mo_errorf(MO_ENOMEM, "%s%s: out of memory (%zu bytes)", c->type, c->path, bytes);
    return MO_OK;
}

/* ---- Structure scan ---- */

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Header of the object at p[0]: bytes of fixed payload (after any length
 * field) in *skip, length-field width in *lenw, element count multiplier
 * in *per (1 array, 2 map, 0 not a container), count or byte length from
 * the header itself in *inl. Returns 0, or -1 for the unused byte 0xc1. */
static int mp_header(uint8_t b, int *lenw, uint64_t *skip, int *per, uint64_t *inl) {
    *lenw = 0;
    *skip = 0;
    *per = 0;
    *inl = 0;
    if (b <= 0x7f || b >= 0xe0)
        return 0;
    if (b <= 0x8f) {
        *per = 2, *inl = b & 0x0f;
        return 0;
    }
    if (b <= 0x9f) {
        *per = 1, *inl = b & 0x0f;
        return 0;
    }
    if (b <= 0xbf) {
        *skip = b & 0x1f;
        return 0;
    }
    switch (b) {
    case 0xc0:
    case 0xc2:
    case 0xc3: return 0;
    case 0xc1: return -1;
    case 0xc4:
    case 0xd9: *lenw = 1; return 0;
    case 0xc5:
    case 0xda: *lenw = 2; return 0;
    case 0xc6:
    case 0xdb: *lenw = 4; return 0;
    case 0xc7: *lenw = 1, *skip = 1; return 0; /* ext: the type byte */
    case 0xc8: *lenw = 2, *skip = 1; return 0;
    case 0xc9: *lenw = 4, *skip = 1; return 0;
    case 0xca: *skip = 4; return 0;
    case 0xcb: *skip = 8; return 0;
    case 0xcc:
    case 0xd0: *skip = 1; return 0;
    case 0xcd:
    case 0xd1: *skip = 2; return 0;
    case 0xce:
    case 0xd2: *skip = 4; return 0;
    case 0xcf:
    case 0xd3: *skip = 8; return 0;
    case 0xd4: *skip = 2; return 0;
    case 0xd5: *skip = 3; return 0;
    case 0xd6: *skip = 5; return 0;
    case 0xd7: *skip = 9; return 0;
    case 0xd8: *skip = 17; return 0;
    case 0xdc: *lenw = 2, *per = 1; return 0;
    case 0xdd: *lenw = 4, *per = 1; return 0;
    case 0xde: *lenw = 2, *per = 2; return 0;
    default: *lenw = 4, *per = 2; return 0; /* 0xdf */
    }
}

/* Walks one object starting at *pos. */
static int mp_walk(const uint8_t *p, size_t len, size_t *pos, char *why, size_t cap) {
    uint64_t remain[MSG_MAX_DEPTH + 1];
    int depth = 0;
    size_t objects = 0, at = *pos;
    remain[0] = 1;
    while (depth >= 0) {
        if (remain[depth] == 0) {
            depth--;
            continue;
        }
        remain[depth]--;
        if (++objects > MSG_MAX_OBJECTS) {
            snprintf(why, cap, "more than %d objects", MSG_MAX_OBJECTS);
            return -1;
        }
        if (at >= len) {
            snprintf(why, cap, "truncated at byte %zu", at);
            return -1;
        }
        size_t start = at;
        int lenw, per;
        uint64_t skip, n;
        if (mp_header(p[at++], &lenw, &skip, &per, &n) < 0) {
            snprintf(why, cap, "byte 0x%02x at %zu is not MessagePack", p[start], start);
            return -1;
        }
        if ((size_t)lenw > len - at) {
            snprintf(why, cap, "truncated at byte %zu", at);
            return -1;
        }
        if (lenw) {
            n = be(p + at, lenw);
            at += (size_t)lenw;
        }
        if (per == 0) {
            uint64_t body = skip + (lenw ? n : 0);
            if (body > len - at) {
                snprintf(why, cap, "truncated: object at byte %zu needs %llu bytes, %zu left",
                         start, (unsigned long long)body, len - at);
                return -1;
            }
            at += (size_t)body;
            continue;
        }
        uint64_t items = n * (uint64_t)per;
        if (items > len - at) { /* every entry takes at least one byte */
            snprintf(why, cap, "%s at byte %zu claims %llu entries in %zu bytes",
                     per == 2 ? "map" : "array", start, (unsigned long long)n, len - at);
            return -1;
        }
        if (items == 0)
            continue;
        if (depth + 1 > MSG_MAX_DEPTH) {
            snprintf(why, cap, "nested deeper than %d", MSG_MAX_DEPTH);
            return -1;
        }
        remain[++depth] = items;
    }
    *pos = at;
    return 0;
}

int mp_scan(const uint8_t *p, size_t len, char *why, size_t cap) {
    size_t pos = 0;
    if (len == 0) {
        snprintf(why, cap, "empty");
        return -1;
    }
    if (mp_walk(p, len, &pos, why, cap) < 0)
        return -1;
    if (pos != len) {
        snprintf(why, cap, "%zu bytes after the end of the message", len - pos);
        return -1;
    }
    return 0;
}

/* ---- Decoding helpers ---- */

const char *mp_kind(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "a boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "an integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "a negative integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "a float";
    case MSGPACK_OBJECT_STR: return "a string";
    case MSGPACK_OBJECT_ARRAY: return "an array";
    case MSGPACK_OBJECT_MAP: return "a map";
    case MSGPACK_OBJECT_BIN: return "binary";
    case MSGPACK_OBJECT_EXT: return "an extension";
    default: return "an unknown object";
    }
}

/* Printable excerpt of untrusted bytes for messages (at most 40 bytes,
 * anything outside printable ASCII shown as '?'). */
static const char *excerpt(const char *s, size_t n, char buf[48]) {
    size_t k = n < 40 ? n : 40;
    for (size_t i = 0; i < k; i++)
        buf[i] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (n > 40) {
        memcpy(buf + 40, "...", 4);
    } else {
        buf[k] = '\0';
    }
    return buf;
}

bool fld_has(const fld_t *f) {
    return f->v && f->v->type != MSGPACK_OBJECT_NIL;
}

int dec_fields(cx_t *c, const msgpack_object *o, const char *what, fld_t *f, int nf) {
    for (int i = 0; i < nf; i++)
        f[i].v = NULL;
    if (o->type != MSGPACK_OBJECT_MAP)
        return cx_fail(c, what, "expected a map, got %s", mp_kind(o));
    const msgpack_object_kv *kv = o->via.map.ptr;
    for (uint32_t k = 0; k < o->via.map.size; k++) {
        const msgpack_object *key = &kv[k].key;
        if (key->type != MSGPACK_OBJECT_STR)
            return cx_fail(c, what, "key %u is %s; keys must be strings", k, mp_kind(key));
        for (int i = 0; i < nf; i++) {
            size_t n = strlen(f[i].name);
            if (key->via.str.size != n || memcmp(key->via.str.ptr, f[i].name, n) != 0)
                continue;
            if (f[i].v) {
                size_t old = what ? cx_push(c, ".%s", what) : c->plen;
                int rc = cx_fail(c, f[i].name, "repeated key");
                cx_pop(c, old);
                return rc;
            }
            f[i].v = &kv[k].val;
            break;
        }
    }
    return MO_OK;
}

static int missing(cx_t *c, const fld_t *f) {
    return cx_fail(c, f->name, "missing");
}

int dec_u64(cx_t *c, const fld_t *f, uint64_t *out) {
    if (!f->v)
        return missing(c, f);
    if (f->v->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *out = f->v->via.u64;
        return MO_OK;
    }
    if (f->v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return cx_fail(c, f->name, "negative value %lld", (long long)f->v->via.i64);
    return cx_fail(c, f->name, "expected an unsigned integer, got %s", mp_kind(f->v));
}

int dec_u64_opt(cx_t *c, const fld_t *f, bool *has, uint64_t *out) {
    *has = false;
    *out = 0;
    if (!fld_has(f))
        return MO_OK;
    TRY(dec_u64(c, f, out));
    *has = true;
    return MO_OK;
}

int dec_u32(cx_t *c, const fld_t *f, uint32_t *out) {
    uint64_t v = 0;
    TRY(dec_u64(c, f, &v));
    if (v > UINT32_MAX)
        return cx_fail(c, f->name, "%llu is out of range (at most %u)", (unsigned long long)v,
                       UINT32_MAX);
    *out = (uint32_t)v;
    return MO_OK;
}

int dec_i64(cx_t *c, const fld_t *f, int64_t lo, int64_t hi, int64_t *out) {
    if (!f->v)
        return missing(c, f);
    if (f->v->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (f->v->via.u64 > (uint64_t)hi)
            return cx_fail(c, f->name, "%llu is out of range [%lld, %lld]",
                           (unsigned long long)f->v->via.u64, (long long)lo, (long long)hi);
        *out = (int64_t)f->v->via.u64;
    } else if (f->v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = f->v->via.i64;
    } else {
        return cx_fail(c, f->name, "expected an integer, got %s", mp_kind(f->v));
    }
    if (*out < lo || *out > hi)
        return cx_fail(c, f->name, "%lld is out of range [%lld, %lld]", (long long)*out,
                       (long long)lo, (long long)hi);
    return MO_OK;
}

int dec_f64(cx_t *c, const fld_t *f, double *out) {
    if (!f->v)
        return missing(c, f);
    switch (f->v->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *out = f->v->via.f64; return MO_OK;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)f->v->via.u64; return MO_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)f->v->via.i64; return MO_OK;
    default: return cx_fail(c, f->name, "expected a number, got %s", mp_kind(f->v));
    }
}

int dec_f64_opt(cx_t *c, const fld_t *f, bool *has, double *out) {
    *has = false;
    *out = 0;
    if (!fld_has(f))
        return MO_OK;
    TRY(dec_f64(c, f, out));
    *has = true;
    return MO_OK;
}

int dec_bool(cx_t *c, const fld_t *f, bool *out) {
    if (!f->v)
        return missing(c, f);
    if (f->v->type != MSGPACK_OBJECT_BOOLEAN)
        return cx_fail(c, f->name, "expected a boolean, got %s", mp_kind(f->v));
    *out = f->v->via.boolean;
    return MO_OK;
}

/* Copies a str object (checked: at most max bytes, no NUL). */
static int copy_str(cx_t *c, const char *field, const msgpack_object *o, size_t max,
                    const char **out) {
    if (o->type != MSGPACK_OBJECT_STR)
        return cx_fail(c, field, "expected a string, got %s", mp_kind(o));
    size_t n = o->via.str.size;
    if (n > max)
        return cx_fail(c, field, "%zu bytes, at most %zu", n, max);
    if (n && memchr(o->via.str.ptr, '\0', n))
        return cx_fail(c, field, "contains a NUL byte");
    char *s;
    TRY(cx_alloc(c, n + 1, (void **)&s));
    if (n)
        memcpy(s, o->via.str.ptr, n);
    s[n] = '\0';
    *out = s;
    return MO_OK;
}

int dec_str(cx_t *c, const fld_t *f, size_t max, const char **out) {
    if (!f->v)
        return missing(c, f);
    return copy_str(c, f->name, f->v, max, out);
}

int dec_str_opt(cx_t *c, const fld_t *f, size_t max, const char **out) {
    *out = NULL;
    if (!fld_has(f))
        return MO_OK;
    return copy_str(c, f->name, f->v, max, out);
}

int dec_enum(cx_t *c, const fld_t *f, const char *(*name)(int), int n, int *out) {
    if (!f->v)
        return missing(c, f);
    if (f->v->type != MSGPACK_OBJECT_STR)
        return cx_fail(c, f->name, "expected a string, got %s", mp_kind(f->v));
    const char *s = f->v->via.str.ptr;
    size_t len = f->v->via.str.size;
    char choices[256] = "";
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = name(i);
        if (strlen(nm) == len && memcmp(nm, s, len) == 0) {
            *out = i;
            return MO_OK;
        }
        int w = snprintf(choices + used, sizeof choices - used, "%s%s", i ? ", " : "", nm);
        if (w > 0 && used + (size_t)w < sizeof choices)
            used += (size_t)w;
    }
    char ex[48];
    return cx_fail(c, f->name, "unknown value '%s' (expected one of: %s)", excerpt(s, len, ex),
                   choices);
}

int dec_array(cx_t *c, const fld_t *f, uint32_t max, const msgpack_object **items, uint32_t *n) {
    if (!f->v)
        return missing(c, f);
    if (f->v->type != MSGPACK_OBJECT_ARRAY)
        return cx_fail(c, f->name, "expected an array, got %s", mp_kind(f->v));
    if (f->v->via.array.size > max)
        return cx_fail(c, f->name, "%u elements, at most %u", f->v->via.array.size, max);
    *items = f->v->via.array.ptr;
    *n = f->v->via.array.size;
    return MO_OK;
}

/* The key of a map entry, copied ("key 3" in errors). */
static int map_key(cx_t *c, const msgpack_object *key, uint32_t k, const char **out) {
    char at[32];
    snprintf(at, sizeof at, "key %u", k);
    return copy_str(c, at, key, MSG_MAX_NAME, out);
}

int dec_strmap_opt(cx_t *c, const fld_t *f, size_t maxval, msg_strmap_t *out) {
    out->items = NULL;
    out->n = 0;
    if (!fld_has(f))
        return MO_OK;
    const msgpack_object *o = f->v;
    if (o->type != MSGPACK_OBJECT_MAP)
        return cx_fail(c, f->name, "expected a map of strings, got %s", mp_kind(o));
    if (o->via.map.size > MSG_MAX_MAP)
        return cx_fail(c, f->name, "%u entries, at most %d", o->via.map.size, MSG_MAX_MAP);
    if (o->via.map.size == 0)
        return MO_OK;
    msg_kv_t *kv;
    TRY(cx_alloc(c, o->via.map.size * sizeof *kv, (void **)&kv));
    size_t old = cx_push(c, ".%s", f->name);
    int rc = MO_OK;
    for (uint32_t k = 0; k < o->via.map.size && rc == MO_OK; k++) {
        rc = map_key(c, &o->via.map.ptr[k].key, k, &kv[k].key);
        if (rc == MO_OK)
            rc = copy_str(c, kv[k].key, &o->via.map.ptr[k].val, maxval, &kv[k].value);
    }
    cx_pop(c, old);
    TRY(rc);
    out->items = kv;
    out->n = o->via.map.size;
    return MO_OK;
}

int dec_metrics_obj(cx_t *c, const msgpack_object *o, msg_metrics_t *out) {
    out->items = NULL;
    out->n = 0;
    if (o->type != MSGPACK_OBJECT_MAP)
        return cx_fail(c, NULL, "expected a map of numbers, got %s", mp_kind(o));
    if (o->via.map.size > MSG_MAX_MAP)
        return cx_fail(c, NULL, "%u entries, at most %d", o->via.map.size, MSG_MAX_MAP);
    if (o->via.map.size == 0)
        return MO_OK;
    msg_metric_t *m;
    TRY(cx_alloc(c, o->via.map.size * sizeof *m, (void **)&m));
    for (uint32_t k = 0; k < o->via.map.size; k++) {
        TRY(map_key(c, &o->via.map.ptr[k].key, k, &m[k].key));
        fld_t f = {m[k].key, &o->via.map.ptr[k].val};
        TRY(dec_f64(c, &f, &m[k].value));
    }
    out->items = m;
    out->n = o->via.map.size;
    return MO_OK;
}

static void shape_str(char *buf, size_t cap, const int64_t *shape, uint32_t ndim) {
    size_t used = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < ndim && used < cap; i++) {
        int w = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
        if (w > 0)
            used += (size_t)w;
    }
}

/* The tensor map's fields, after the field itself is known present. */
static int tensor_body(cx_t *c, const msgpack_object *o, dtype_t want_dt, uint32_t ndim,
                       int64_t *shape, const void **data) {
    fld_t f[3] = {{"dtype", NULL}, {"shape", NULL}, {"data", NULL}};
    TRY(dec_fields(c, o, NULL, f, 3));
    if (!f[0].v)
        return missing(c, &f[0]);
    if (f[0].v->type != MSGPACK_OBJECT_STR)
        return cx_fail(c, "dtype", "expected a string, got %s", mp_kind(f[0].v));
    char name[16], ex[48];
    size_t nl = f[0].v->via.str.size;
    dtype_t dt = DT_COUNT;
    if (nl < sizeof name) {
        memcpy(name, f[0].v->via.str.ptr, nl);
        name[nl] = '\0';
        if (!memchr(name, '\0', nl) && dtype_from_name(name, &dt) < 0)
            dt = DT_COUNT;
    }
    if (dt == DT_COUNT)
        return cx_fail(c, "dtype", "unknown dtype '%s'", excerpt(f[0].v->via.str.ptr, nl, ex));
    if (dt != want_dt)
        return cx_fail(c, "dtype", "expected %s, got %s", dtype_name(want_dt), dtype_name(dt));
    const msgpack_object *dims = NULL;
    uint32_t nd = 0;
    TRY(dec_array(c, &f[1], MSG_MAX_DIMS, &dims, &nd));
    if (nd != ndim)
        return cx_fail(c, "shape", "%u dimensions, expected %u", nd, ndim);
    uint64_t bytes = dtype_size(dt);
    for (uint32_t i = 0; i < nd; i++) {
        char nm[24];
        snprintf(nm, sizeof nm, "shape[%u]", i);
        fld_t fd = {nm, &dims[i]};
        uint64_t d = 0;
        TRY(dec_u64(c, &fd, &d));
        if (d > (uint64_t)MSG_MAX_DIM)
            return cx_fail(c, nm, "%llu is out of range (at most 2^40)", (unsigned long long)d);
        shape[i] = (int64_t)d;
        bytes = (d && bytes > UINT64_MAX / d) ? UINT64_MAX : bytes * d;
    }
    if (!f[2].v)
        return missing(c, &f[2]);
    if (f[2].v->type != MSGPACK_OBJECT_BIN)
        return cx_fail(c, "data", "expected binary, got %s", mp_kind(f[2].v));
    uint32_t have = f[2].v->via.bin.size;
    if (bytes != have) {
        char sh[128];
        shape_str(sh, sizeof sh, shape, nd);
        return cx_fail(c, "data", "%u bytes, but shape [%s] of %s needs %llu", have, sh,
                       dtype_name(dt), (unsigned long long)bytes);
    }
    void *p;
    TRY(cx_alloc(c, have, &p));
    if (have)
        memcpy(p, f[2].v->via.bin.ptr, have);
    *data = p;
    return MO_OK;
}

int dec_tensor(cx_t *c, const fld_t *f, dtype_t want_dt, uint32_t ndim, int64_t *shape,
               const void **data) {
    if (!f->v)
        return missing(c, f);
    size_t old = cx_push(c, ".%s", f->name);
    int rc = tensor_body(c, f->v, want_dt, ndim, shape, data);
    cx_pop(c, old);
    return rc;
}

int dec_tensor_opt(cx_t *c, const fld_t *f, dtype_t want_dt, uint32_t ndim, int64_t *shape,
                   const void **data) {
    *data = NULL;
    if (!fld_has(f))
        return MO_OK;
    return dec_tensor(c, f, want_dt, ndim, shape, data);
}

int dec_vector(cx_t *c, const fld_t *f, dtype_t want_dt, uint32_t max, const void **data,
               uint32_t *n) {
    int64_t shape[1];
    shape[0] = 0;
    TRY(dec_tensor(c, f, want_dt, 1, shape, data));
    if (shape[0] > (int64_t)max)
        return cx_fail(c, f->name, "%lld values, at most %u", (long long)shape[0], max);
    *n = (uint32_t)shape[0];
    return MO_OK;
}

int dec_vector_opt(cx_t *c, const fld_t *f, dtype_t want_dt, uint32_t max, const void **data,
                   uint32_t *n) {
    *data = NULL;
    *n = 0;
    if (!fld_has(f))
        return MO_OK;
    return dec_vector(c, f, want_dt, max, data, n);
}

/* ---- Checks ---- */

bool utf8_valid(const char *str, size_t n, size_t *bad) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned char b = s[i];
        if (b < 0x80) {
            i++;
            continue;
        }
        size_t k;
        uint32_t cp, min;
        if (b >= 0xc2 && b <= 0xdf)
            k = 1, cp = b & 0x1f, min = 0x80;
        else if (b >= 0xe0 && b <= 0xef)
            k = 2, cp = b & 0x0f, min = 0x800;
        else if (b >= 0xf0 && b <= 0xf4)
            k = 3, cp = b & 0x07, min = 0x10000;
        else
            goto invalid;
        if (k > n - i - 1)
            goto invalid;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                goto invalid;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            goto invalid;
        i += k + 1;
    }
    return true;
invalid:
    *bad = i;
    return false;
}

int ck_str(cx_t *c, const char *field, const char *s, size_t min, size_t max) {
    if (!s)
        return cx_fail(c, field, "missing");
    size_t n = strlen(s), bad;
    if (n == 0 && min > 0)
        return cx_fail(c, field, "empty");
    if (n < min)
        return cx_fail(c, field, "%zu bytes, at least %zu", n, min);
    if (n > max)
        return cx_fail(c, field, "%zu bytes, at most %zu", n, max);
    if (!utf8_valid(s, n, &bad))
        return cx_fail(c, field, "not valid UTF-8 at byte %zu", bad);
    return MO_OK;
}

int ck_str_opt(cx_t *c, const char *field, const char *s, size_t max) {
    return s ? ck_str(c, field, s, 0, max) : MO_OK;
}

int ck_id(cx_t *c, const char *field, const char *s) {
    TRY(ck_str(c, field, s, 1, MSG_MAX_ID));
    for (const char *p = s; *p; p++) {
        char ch = *p;
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == ':' || ch == '@' || ch == '-'))
            return cx_fail(c, field, "byte %zu is not one of [A-Za-z0-9._:@-]", (size_t)(p - s));
    }
    return MO_OK;
}

int ck_u64(cx_t *c, const char *field, uint64_t v, uint64_t lo, uint64_t hi) {
    if (v < lo || v > hi)
        return cx_fail(c, field, "%llu is out of range [%llu, %llu]", (unsigned long long)v,
                       (unsigned long long)lo, (unsigned long long)hi);
    return MO_OK;
}

int ck_f64(cx_t *c, const char *field, double v, double lo, double hi) {
    if (!isfinite(v))
        return cx_fail(c, field, "%g is not finite", v);
    if (v < lo || v > hi)
        return cx_fail(c, field, "%g is out of range [%g, %g]", v, lo, hi);
    return MO_OK;
}

int ck_enum(cx_t *c, const char *field, int v, int n) {
    if (v < 0 || v >= n)
        return cx_fail(c, field, "bad value %d", v);
    return MO_OK;
}

int ck_strmap(cx_t *c, const char *field, const msg_strmap_t *m, size_t maxval) {
    if (m->n > MSG_MAX_MAP)
        return cx_fail(c, field, "%u entries, at most %d", m->n, MSG_MAX_MAP);
    if (m->n && !m->items)
        return cx_fail(c, field, "%u entries but no items", m->n);
    size_t old = cx_push(c, ".%s", field);
    int rc = MO_OK;
    for (uint32_t i = 0; i < m->n && rc == MO_OK; i++) {
        char at[32];
        snprintf(at, sizeof at, "key %u", i);
        rc = ck_str(c, at, m->items[i].key, 1, MSG_MAX_NAME);
        if (rc == MO_OK)
            rc = ck_str(c, m->items[i].key, m->items[i].value, 0, maxval);
    }
    if (rc == MO_OK)
        rc = ck_unique_keys(c, NULL, m->items, m->n, sizeof *m->items);
    cx_pop(c, old);
    return rc;
}

int ck_metrics(cx_t *c, const char *field, const msg_metrics_t *m) {
    if (m->n > MSG_MAX_MAP)
        return cx_fail(c, field, "%u entries, at most %d", m->n, MSG_MAX_MAP);
    if (m->n && !m->items)
        return cx_fail(c, field, "%u entries but no items", m->n);
    size_t old = cx_push(c, "%s%s", field ? "." : "", field ? field : "");
    int rc = MO_OK;
    for (uint32_t i = 0; i < m->n && rc == MO_OK; i++) {
        char at[32];
        snprintf(at, sizeof at, "key %u", i);
        rc = ck_str(c, at, m->items[i].key, 1, MSG_MAX_NAME);
        if (rc == MO_OK && !isfinite(m->items[i].value))
            rc = cx_fail(c, m->items[i].key, "%g is not finite", m->items[i].value);
    }
    if (rc == MO_OK)
        rc = ck_unique_keys(c, NULL, m->items, m->n, sizeof *m->items);
    cx_pop(c, old);
    return rc;
}

int ck_tokens(cx_t *c, const char *field, const int32_t *p, uint32_t n, uint32_t min,
              uint32_t max) {
    if (n < min || n > max)
        return cx_fail(c, field, "%u tokens, expected %u .. %u", n, min, max);
    if (n && !p)
        return cx_fail(c, field, "%u tokens but no data", n);
    for (uint32_t i = 0; i < n; i++) {
        int32_t t;
        memcpy(&t, p + i, sizeof t);
        if (t < 0)
            return cx_fail(c, field, "token %u is %d, token ids are >= 0", i, (int)t);
    }
    return MO_OK;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int ck_unique(cx_t *c, const char *field, const char **keys, uint32_t n) {
    if (n < 2)
        return MO_OK;
    qsort(keys, n, sizeof *keys, cmp_str);
    for (uint32_t i = 1; i < n; i++) {
        if (strcmp(keys[i - 1], keys[i]) == 0) {
            char ex[48];
            return cx_fail(c, field, "repeated name '%s'", excerpt(keys[i], strlen(keys[i]), ex));
        }
    }
    return MO_OK;
}

int ck_unique_keys(cx_t *c, const char *field, const void *items, uint32_t n, size_t stride) {
    if (n < 2)
        return MO_OK;
    const char **keys = malloc(n * sizeof *keys);
    if (!keys)
        return mo_errorf(MO_ENOMEM, "%s: out of memory checking keys", c->type);
    for (uint32_t i = 0; i < n; i++)
        memcpy(&keys[i], (const char *)items + i * stride, sizeof keys[i]);
    int rc = ck_unique(c, field, keys, n);
    free(keys);
    return rc;
}

int ck_finite(cx_t *c, const char *field, const float *p, uint32_t n) {
    if (n && !p)
        return cx_fail(c, field, "%u values but no data", n);
    for (uint32_t i = 0; i < n; i++)
        if (!isfinite(p[i]))
            return cx_fail(c, field, "value %u is %g, not finite", i, (double)p[i]);
    return MO_OK;
}

/* ---- Encoding helpers ---- */

void enc_init(enc_t *e, msg_buf_t *b) {
    e->buf = b;
    e->depth = 0;
    msgpack_packer_init(&e->pk, b, buf_write);
}

void enc_map_begin(enc_t *e) {
    MO_ASSERT(e->depth < MSG_MAX_DEPTH);
    e->pos[e->depth] = e->buf->len;
    e->count[e->depth] = 0;
    e->depth++;
    static const char hdr[3] = {(char)0xde, 0, 0}; /* map16, size patched later */
    buf_write(e->buf, hdr, 3);
}

void enc_map_end(enc_t *e) {
    MO_ASSERT(e->depth > 0);
    e->depth--;
    uint32_t n = e->count[e->depth];
    MO_ASSERT(n <= 0xffff);
    if (!e->buf->oom) {
        e->buf->data[e->pos[e->depth] + 1] = (uint8_t)(n >> 8);
        e->buf->data[e->pos[e->depth] + 2] = (uint8_t)n;
    }
}

void enc_key(enc_t *e, const char *k) {
    MO_ASSERT(e->depth > 0);
    e->count[e->depth - 1]++;
    enc_str(e, k);
}

void enc_str(enc_t *e, const char *s) {
    msgpack_pack_str_with_body(&e->pk, s, strlen(s));
}
void enc_u64(enc_t *e, uint64_t v) {
    msgpack_pack_uint64(&e->pk, v);
}
void enc_i64(enc_t *e, int64_t v) {
    msgpack_pack_int64(&e->pk, v);
}
void enc_f64(enc_t *e, double v) {
    msgpack_pack_double(&e->pk, v);
}
void enc_bool(enc_t *e, bool v) {
    v ? msgpack_pack_true(&e->pk) : msgpack_pack_false(&e->pk);
}

void enc_tensor(enc_t *e, dtype_t dt, uint32_t ndim, const int64_t *shape, const void *data) {
    uint64_t bytes = dtype_size(dt);
    msgpack_pack_map(&e->pk, 3);
    msgpack_pack_str_with_body(&e->pk, "dtype", 5);
    enc_str(e, dtype_name(dt));
    msgpack_pack_str_with_body(&e->pk, "shape", 5);
    msgpack_pack_array(&e->pk, ndim);
    for (uint32_t i = 0; i < ndim; i++) {
        msgpack_pack_uint64(&e->pk, (uint64_t)shape[i]);
        bytes *= (uint64_t)shape[i];
    }
    msgpack_pack_str_with_body(&e->pk, "data", 4);
    msgpack_pack_bin_with_body(&e->pk, data, (size_t)bytes);
}

void enc_vector(enc_t *e, dtype_t dt, uint32_t n, const void *data) {
    int64_t shape[1] = {n};
    enc_tensor(e, dt, 1, shape, data);
}

void enc_strmap(enc_t *e, const msg_strmap_t *m) {
    msgpack_pack_map(&e->pk, m->n);
    for (uint32_t i = 0; i < m->n; i++) {
        enc_str(e, m->items[i].key);
        enc_str(e, m->items[i].value);
    }
}

void enc_metrics(enc_t *e, const msg_metrics_t *m) {
    msgpack_pack_map(&e->pk, m->n);
    for (uint32_t i = 0; i < m->n; i++) {
        enc_str(e, m->items[i].key);
        enc_f64(e, m->items[i].value);
    }
}

/* ---- Dispatch ---- */

static const msg_codec_t *codec_of(msg_type_t t) {
    switch (t) {
    case MSG_HELLO: return &codec_hello;
    case MSG_WELCOME: return &codec_welcome;
    case MSG_HEARTBEAT: return &codec_heartbeat;
    case MSG_WORK_REQUEST: return &codec_work_request;
    case MSG_LEASE: return &codec_lease;
    case MSG_TRAJECTORY_GROUP: return &codec_trajectory_group;
    case MSG_SCORE_REQUEST: return &codec_score_request;
    case MSG_SCORE_REPLY: return &codec_score_reply;
    case MSG_WEIGHTS_CHUNK: return &codec_weights_chunk;
    case MSG_SNAPSHOT_REQUEST: return &codec_snapshot_request;
    case MSG_CTL_REQUEST: return &codec_ctl_request;
    case MSG_CTL_REPLY: return &codec_ctl_reply;
    case MSG_REWARD_SWAP: return &codec_reward_swap;
    case MSG_ERROR: return &codec_error;
    default: return NULL;
    }
}

int msg_encode(const msg_t *m, msg_buf_t *out) {
    const msg_codec_t *codec = codec_of(m->type);
    if (!codec)
        return mo_errorf(MO_EINVAL, "msg_encode: bad message type %d", (int)m->type);
    cx_t c;
    cx_init(&c, MO_EINVAL, msg_type_name(m->type), NULL);
    TRY(codec->check(&c, m));
    out->len = 0;
    out->oom = 0;
    enc_t e;
    enc_init(&e, out);
    enc_map_begin(&e);
    enc_key(&e, "type");
    enc_str(&e, msg_type_name(m->type));
    enc_key(&e, "v");
    enc_u64(&e, MSG_PROTOCOL_VERSION);
    codec->encode(&e, m);
    enc_map_end(&e);
    if (out->oom) {
        out->len = 0;
        return mo_errorf(MO_ENOMEM, "%s: out of memory while encoding", msg_type_name(m->type));
    }
    return MO_OK;
}

/* The "type" field of a top-level map: its name checked and looked up. */
static int top_type(cx_t *c, const fld_t *f, msg_type_t *t) {
    if (!f->v)
        return cx_fail(c, "type", "missing");
    if (f->v->type != MSGPACK_OBJECT_STR)
        return cx_fail(c, "type", "expected a string, got %s", mp_kind(f->v));
    char name[32], ex[48];
    size_t n = f->v->via.str.size;
    if (n < sizeof name) {
        memcpy(name, f->v->via.str.ptr, n);
        name[n] = '\0';
        if (strlen(name) == n && msg_type_from_name(name, t) == MO_OK)
            return MO_OK;
    }
    return cx_fail(c, "type", "unknown message type '%s'", excerpt(f->v->via.str.ptr, n, ex));
}

static int decode_top(const msgpack_object *o, size_t len, msg_type_t expect, msg_t *out) {
    cx_t c;
    cx_init(&c, MO_EMALFORMED, "message", NULL);
    fld_t f[2] = {{"type", NULL}, {"v", NULL}};
    TRY(dec_fields(&c, o, NULL, f, 2));
    msg_type_t t = MSG_NONE;
    TRY(top_type(&c, &f[0], &t));
    c.type = msg_type_name(t);
    if (expect != MSG_NONE && t != expect)
        return cx_fail(&c, NULL, "unexpected message type (expected %s)", msg_type_name(expect));
    uint64_t v = 0;
    TRY(dec_u64(&c, &f[1], &v));
    if (v != MSG_PROTOCOL_VERSION)
        return cx_fail(&c, "v", "protocol version %llu, this build speaks %d",
                       (unsigned long long)v, MSG_PROTOCOL_VERSION);
    size_t block = len + 4096 < ((size_t)1 << 20) ? len + 4096 : ((size_t)1 << 20);
    arena_init(&out->arena, block);
    c.arena = &out->arena;
    out->type = t;
    const msg_codec_t *codec = codec_of(t);
    TRY(codec->decode(&c, o, out));
    return codec->check(&c, out);
}

/* Checks the bytes and builds msgpack-c's object tree for them. */
static int unpack(const void *buf, size_t len, msgpack_unpacked *up) {
    char why[160];
    if (!buf && len)
        return mo_errorf(MO_EINVAL, "msg_decode: NULL buffer of %zu bytes", len);
    if (mp_scan(buf, len, why, sizeof why) < 0)
        return mo_errorf(MO_EMALFORMED, "message: %s", why);
    size_t off = 0;
    msgpack_unpack_return r = msgpack_unpack_next(up, buf, len, &off);
    if (r == MSGPACK_UNPACK_SUCCESS && off == len)
        return MO_OK;
    if (r == MSGPACK_UNPACK_NOMEM_ERROR)
        return mo_errorf(MO_ENOMEM, "message: out of memory unpacking %zu bytes", len);
    return mo_errorf(MO_EMALFORMED, "message: not one MessagePack object (%d)", (int)r);
}

int msg_decode(msg_t *out, const void *buf, size_t len, msg_type_t expect) {
    msg_init(out);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    int rc = unpack(buf, len, &up);
    if (rc == MO_OK)
        rc = decode_top(&up.data, len, expect, out);
    msgpack_unpacked_destroy(&up);
    if (rc < 0)
        msg_free(out);
    return rc;
}

/* The string at p[at] (any str format): its bytes and length; false when
 * the object there is not a string. The bytes were checked by mp_scan. */
static bool str_at(const uint8_t *p, size_t at, const uint8_t **s, size_t *n) {
    uint8_t b = p[at];
    if (b >= 0xa0 && b <= 0xbf) {
        *n = b & 0x1f, *s = p + at + 1;
        return true;
    }
    int w = b == 0xd9 ? 1 : b == 0xda ? 2 : b == 0xdb ? 4 : 0;
    if (!w)
        return false;
    *n = (size_t)be(p + at + 1, w);
    *s = p + at + 1 + w;
    return true;
}

int msg_peek_type(const void *buf, size_t len, msg_type_t *type) {
    char why[160];
    const uint8_t *p = buf;
    if (!buf || mp_scan(p, len, why, sizeof why) < 0)
        return mo_errorf(MO_EMALFORMED, "message: %s", buf ? why : "empty");
    int lenw, per;
    uint64_t skip, n;
    size_t at = 1;
    mp_header(p[0], &lenw, &skip, &per, &n);
    if (per != 2)
        return mo_errorf(MO_EMALFORMED, "message: expected a map");
    if (lenw) {
        n = be(p + 1, lenw);
        at += (size_t)lenw;
    }
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *s;
        size_t sl;
        bool is_type = str_at(p, at, &s, &sl) && sl == 4 && memcmp(s, "type", 4) == 0;
        mp_walk(p, len, &at, why, sizeof why); /* the key; cannot fail after mp_scan */
        size_t val = at;
        mp_walk(p, len, &at, why, sizeof why);
        if (!is_type)
            continue;
        char name[32];
        if (str_at(p, val, &s, &sl) && sl < sizeof name) {
            memcpy(name, s, sl);
            name[sl] = '\0';
            if (strlen(name) == sl && msg_type_from_name(name, type) == MO_OK)
                return MO_OK;
        }
        return mo_errorf(MO_EMALFORMED, "message.type: not a known message type");
    }
    return mo_errorf(MO_EMALFORMED, "message.type: missing");
}
