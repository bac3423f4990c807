/* weights: xxHash64 checksum, chunk splitter and order-free assembler of
 * adapter versions. */
#include "transport/weights.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

/* ---- xxHash64 (seed 0) ---- */

#define XP1 0x9E3779B185EBCA87ULL
#define XP2 0xC2B2AE3D27D4EB4FULL
#define XP3 0x165667B19E3779F9ULL
#define XP4 0x85EBCA77C2B2AE63ULL
#define XP5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian host (checked in codec_internal.h) */
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t xround(uint64_t acc, uint64_t in) {
    acc += in * XP2;
    acc = rotl64(acc, 31);
    return acc * XP1;
}

static inline uint64_t xmerge(uint64_t acc, uint64_t v) {
    acc ^= xround(0, v);
    return acc * XP1 + XP4;
}

uint64_t weights_hash64(const void *data, size_t n) {
    const uint8_t *p = data, *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = XP1 + XP2, v2 = XP2, v3 = 0, v4 = 0 - XP1;
        const uint8_t *limit = end - 32;
        do {
            v1 = xround(v1, rd64(p));
            v2 = xround(v2, rd64(p + 8));
            v3 = xround(v3, rd64(p + 16));
            v4 = xround(v4, rd64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xmerge(h, v1);
        h = xmerge(h, v2);
        h = xmerge(h, v3);
        h = xmerge(h, v4);
    } else {
        h = XP5;
    }
    h += (uint64_t)n;
    while (end - p >= 8) {
        h ^= xround(0, rd64(p));
        h = rotl64(h, 27) * XP1 + XP4;
        p += 8;
    }
    if (end - p >= 4) {
        h ^= (uint64_t)rd32(p) * XP1;
        h = rotl64(h, 23) * XP2 + XP3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * XP5;
        h = rotl64(h, 11) * XP1;
        p++;
    }
    h ^= h >> 33;
    h *= XP2;
    h ^= h >> 29;
    h *= XP3;
    h ^= h >> 32;
    return h;
}

/* ---- Splitter ---- */

int weights_split_init(weights_split_t *s, const void *flat, uint64_t total_bytes,
                       const msg_tensor_entry_t *table, uint32_t n_table, const msg_strmap_t *meta,
                       uint64_t version, uint64_t chunk_bytes) {
    memset(s, 0, sizeof *s);
    cx_t c;
    cx_init(&c, MO_EINVAL, "weights_split", NULL);
    TRY(ck_u64(&c, "total_bytes", total_bytes, 1, MSG_MAX_WEIGHT_BYTES));
    TRY(ck_u64(&c, "chunk_bytes", chunk_bytes, 1, UINT32_MAX));
    if (!flat)
        return cx_fail(&c, "flat", "NULL buffer of %llu bytes", (unsigned long long)total_bytes);
    if (total_bytes > SIZE_MAX)
        return cx_fail(&c, "total_bytes", "too large for this host");
    uint64_t n = (total_bytes + chunk_bytes - 1) / chunk_bytes;
    if (n > MSG_MAX_CHUNKS)
        return cx_fail(&c, "chunk_bytes", "%llu makes %llu chunks, at most %d",
                       (unsigned long long)chunk_bytes, (unsigned long long)n, MSG_MAX_CHUNKS);
    TRY(ck_weights_table(&c, "table", table, n_table, total_bytes));
    if (meta)
        TRY(ck_strmap(&c, "meta", meta, MSG_MAX_SPEC));
    s->flat = flat;
    s->total_bytes = total_bytes;
    s->chunk_bytes = chunk_bytes;
    s->n_chunks = (uint32_t)n;
    s->version = version;
    s->checksum = weights_hash64(flat, (size_t)total_bytes);
    s->table = table;
    s->n_table = n_table;
    if (meta)
        s->meta = *meta;
    return MO_OK;
}

void weights_split_chunk(const weights_split_t *s, uint32_t i, msg_t *out) {
    MO_ASSERT(i < s->n_chunks);
    msg_init(out);
    out->type = MSG_WEIGHTS_CHUNK;
    msg_weights_chunk_t *w = &out->weights_chunk;
    uint64_t start = (uint64_t)i * s->chunk_bytes;
    uint64_t left = s->total_bytes - start;
    w->version = s->version;
    w->checksum = s->checksum;
    w->chunk_index = i;
    w->n_chunks = s->n_chunks;
    w->total_bytes = s->total_bytes;
    w->chunk_bytes = s->chunk_bytes;
    w->data = s->flat + start;
    w->nbytes = left < s->chunk_bytes ? left : s->chunk_bytes;
    if (i == 0) {
        w->table = s->table;
        w->n_table = s->n_table;
        w->meta = s->meta;
    }
}

/* ---- Adapter ---- */

void weights_adapter_free(weights_adapter_t *a) {
    free(a->data);
    arena_free(&a->arena);
    memset(a, 0, sizeof *a);
}

const msg_tensor_entry_t *weights_adapter_find(const weights_adapter_t *a, const char *name) {
    for (uint32_t i = 0; i < a->n_table; i++)
        if (strcmp(a->table[i].name, name) == 0)
            return &a->table[i];
    return NULL;
}

/* ---- Assembler ---- */

struct weights_assembler {
    uint64_t max_total;
    int active; /* a version is being assembled (or complete, waiting for take) */
    int done;
    uint64_t version, checksum, total, chunk_bytes;
    uint32_t n_chunks, received;
    uint8_t *bits; /* (ceil(n_chunks / 8)) chunks received */
    uint8_t *data; /* (total) */
    int has_table;
    msg_tensor_entry_t *table; /* (n_table), in arena */
    uint32_t n_table;
    msg_strmap_t meta;
    arena_t arena;
    int has_latest;
    uint64_t latest;
};

int weights_assembler_new(weights_assembler_t **out, uint64_t max_total_bytes) {
    *out = calloc(1, sizeof **out);
    if (!*out)
        return mo_errorf(MO_ENOMEM, "weights assembler: out of memory");
    (*out)->max_total = max_total_bytes;
    arena_init(&(*out)->arena, 4096);
    return MO_OK;
}

/* Drops the version in progress (or the completed one not taken). */
static void drop(weights_assembler_t *a) {
    free(a->bits);
    free(a->data);
    arena_free(&a->arena);
    uint64_t max = a->max_total, latest = a->latest;
    int has_latest = a->has_latest;
    memset(a, 0, sizeof *a);
    arena_init(&a->arena, 4096);
    a->max_total = max;
    a->latest = latest;
    a->has_latest = has_latest;
}

void weights_assembler_destroy(weights_assembler_t **a) {
    if (!*a)
        return;
    drop(*a);
    arena_free(&(*a)->arena);
    free(*a);
    *a = NULL;
}

static int start(weights_assembler_t *a, const msg_weights_chunk_t *c) {
    drop(a);
    size_t bytes = (size_t)((c->total_bytes + 63) / 64 * 64);
    a->data = aligned_alloc(64, bytes);
    a->bits = calloc((c->n_chunks + 7) / 8, 1);
    if (!a->data || !a->bits) {
        drop(a);
        return mo_errorf(MO_ENOMEM, "weights_chunk: cannot allocate %llu bytes for version %llu",
                         (unsigned long long)c->total_bytes, (unsigned long long)c->version);
    }
    a->active = 1;
    a->version = c->version;
    a->checksum = c->checksum;
    a->total = c->total_bytes;
    a->chunk_bytes = c->chunk_bytes;
    a->n_chunks = c->n_chunks;
    return MO_OK;
}

/* A chunk of the version in progress that disagrees with earlier ones. */
static int inconsistent(const weights_assembler_t *a, const msg_weights_chunk_t *c) {
    const char *what = c->checksum != a->checksum         ? "checksum"
                       : c->total_bytes != a->total       ? "total_bytes"
                       : c->chunk_bytes != a->chunk_bytes ? "chunk_bytes"
                       : c->n_chunks != a->n_chunks       ? "n_chunks"
                                                          : NULL;
    if (!what)
        return MO_OK;
    return mo_errorf(MO_EMALFORMED,
                     "weights_chunk.%s: chunk %u of version %llu disagrees with the version's "
                     "earlier chunks",
                     what, c->chunk_index, (unsigned long long)c->version);
}

/* Copies chunk 0's table and meta into the assembler's arena. */
static int keep_table(weights_assembler_t *a, const msg_weights_chunk_t *c) {
    size_t tb = (size_t)c->n_table * sizeof *a->table;
    size_t mb = (size_t)c->meta.n * sizeof(msg_kv_t);
    msg_tensor_entry_t *t = arena_alloc(&a->arena, tb);
    msg_kv_t *kv = arena_alloc(&a->arena, mb ? mb : 1);
    if (!t || !kv)
        return mo_errorf(MO_ENOMEM, "weights_chunk: out of memory keeping the table");
    for (uint32_t i = 0; i < c->n_table; i++) {
        t[i] = c->table[i];
        size_t n = strlen(c->table[i].name) + 1;
        char *s = arena_alloc(&a->arena, n);
        if (!s)
            return mo_errorf(MO_ENOMEM, "weights_chunk: out of memory keeping the table");
        memcpy(s, c->table[i].name, n);
        t[i].name = s;
    }
    for (uint32_t i = 0; i < c->meta.n; i++) {
        size_t nk = strlen(c->meta.items[i].key) + 1, nv = strlen(c->meta.items[i].value) + 1;
        char *k = arena_alloc(&a->arena, nk), *v = arena_alloc(&a->arena, nv);
        if (!k || !v)
            return mo_errorf(MO_ENOMEM, "weights_chunk: out of memory keeping the meta map");
        memcpy(k, c->meta.items[i].key, nk);
        memcpy(v, c->meta.items[i].value, nv);
        kv[i].key = k;
        kv[i].value = v;
    }
    a->table = t;
    a->n_table = c->n_table;
    a->meta.items = c->meta.n ? kv : NULL;
    a->meta.n = c->meta.n;
    a->has_table = 1;
    return MO_OK;
}

int weights_assembler_add(weights_assembler_t *a, const msg_weights_chunk_t *c) {
    cx_t cx;
    cx_init(&cx, MO_EMALFORMED, "weights_chunk", NULL);
    TRY(ck_weights_chunk(&cx, c));
    if (c->total_bytes > a->max_total)
        return mo_errorf(MO_EMALFORMED,
                         "weights_chunk.total_bytes: version %llu is %llu bytes, more than the "
                         "%llu this worker accepts",
                         (unsigned long long)c->version, (unsigned long long)c->total_bytes,
                         (unsigned long long)a->max_total);
    if (a->has_latest && c->version <= a->latest)
        return WEIGHTS_STALE;
    if (a->active && c->version < a->version)
        return WEIGHTS_STALE;
    if (!a->active || c->version > a->version)
        TRY(start(a, c));
    TRY(inconsistent(a, c));
    uint32_t i = c->chunk_index;
    uint8_t *dst = a->data + (uint64_t)i * a->chunk_bytes;
    if (a->bits[i / 8] & (1u << (i % 8))) {
        if (memcmp(dst, c->data, (size_t)c->nbytes) != 0)
            return mo_errorf(MO_EMALFORMED,
                             "weights_chunk.data: chunk %u of version %llu arrived twice with "
                             "different bytes",
                             i, (unsigned long long)c->version);
        return WEIGHTS_DUPLICATE;
    }
    if (i == 0)
        TRY(keep_table(a, c));
    if (c->nbytes)
        memcpy(dst, c->data, (size_t)c->nbytes);
    a->bits[i / 8] |= (uint8_t)(1u << (i % 8));
    a->received++;
    if (a->received < a->n_chunks)
        return WEIGHTS_MORE;
    uint64_t got = weights_hash64(a->data, (size_t)a->total);
    if (got != a->checksum) {
        uint64_t v = a->version;
        drop(a);
        return mo_errorf(MO_EMALFORMED,
                         "weights_chunk.checksum: version %llu reassembled to xxh64 %016llx, the "
                         "chunks say %016llx; version dropped",
                         (unsigned long long)v, (unsigned long long)got,
                         (unsigned long long)c->checksum);
    }
    a->done = 1;
    a->has_latest = 1;
    a->latest = a->version;
    return WEIGHTS_DONE;
}

int weights_assembler_take(weights_assembler_t *a, weights_adapter_t *out) {
    memset(out, 0, sizeof *out);
    if (!a->done)
        return mo_errorf(MO_ESTATE, "weights assembler: no complete version to take");
    out->version = a->version;
    out->checksum = a->checksum;
    out->data = a->data;
    out->total_bytes = a->total;
    out->table = a->table;
    out->n_table = a->n_table;
    out->meta = a->meta;
    out->arena = a->arena;
    a->data = NULL;
    arena_init(&a->arena, 4096); /* the adapter owns the old one now */
    drop(a);
    return MO_OK;
}

void weights_assembler_progress(const weights_assembler_t *a, uint64_t *version, uint32_t *have,
                                uint32_t *n_chunks) {
    *version = a->active ? a->version : 0;
    *have = a->active ? a->received : 0;
    *n_chunks = a->active ? a->n_chunks : 0;
}

void weights_assembler_latest(const weights_assembler_t *a, int *has, uint64_t *version) {
    *has = a->has_latest;
    *version = a->latest;
}
