/* codec_weights: weights_chunk, and the checks of a flat buffer's tensor table. */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

static const char *dt_nm(int i) {
    return dtype_name((dtype_t)i);
}

typedef struct span {
    uint64_t offset, bytes;
    uint32_t index;
} span_t;

static int cmp_span(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* One entry's byte size; -1 when a dimension is out of range or the size
 * passes MSG_MAX_WEIGHT_BYTES. */
static int entry_bytes(const msg_tensor_entry_t *e, uint64_t *bytes, uint32_t *bad_dim) {
    uint64_t n = dtype_size(e->dtype);
    for (uint32_t i = 0; i < e->ndim; i++) {
        int64_t d = e->shape[i];
        *bad_dim = i;
        if (d < 0 || d > MSG_MAX_DIM || (d && n > MSG_MAX_WEIGHT_BYTES / (uint64_t)d))
            return -1;
        n *= (uint64_t)d;
    }
    *bytes = n;
    return 0;
}

static int entry_check(cx_t *c, const msg_tensor_entry_t *e, uint64_t total, uint64_t *bytes) {
    TRY(ck_str(c, "name", e->name, 1, MSG_MAX_NAME));
    TRY(ck_enum(c, "dtype", (int)e->dtype, DT_COUNT));
    if (e->ndim > MSG_MAX_DIMS)
        return cx_fail(c, "shape", "%u dimensions, at most %d", e->ndim, MSG_MAX_DIMS);
    uint32_t dim = 0;
    if (entry_bytes(e, bytes, &dim) < 0)
        return cx_fail(c, "shape", "dimension %u (%lld) makes the tensor exceed 2^40 bytes", dim,
                       (long long)e->shape[dim]);
    size_t es = dtype_size(e->dtype);
    if (e->offset % es)
        return cx_fail(c, "offset", "%llu is not a multiple of the %s size %zu",
                       (unsigned long long)e->offset, dtype_name(e->dtype), es);
    if (*bytes > total || e->offset > total - *bytes)
        return cx_fail(c, "offset", "%llu + %llu bytes passes total_bytes %llu",
                       (unsigned long long)e->offset, (unsigned long long)*bytes,
                       (unsigned long long)total);
    return MO_OK;
}

int ck_weights_table(cx_t *c, const char *field, const msg_tensor_entry_t *t, uint32_t n,
                     uint64_t total) {
    if (n < 1 || n > MSG_MAX_TENSORS)
        return cx_fail(c, field, "%u tensors, expected 1 .. %d", n, MSG_MAX_TENSORS);
    if (!t)
        return cx_fail(c, field, "%u tensors but no array", n);
    span_t *sp = malloc(n * sizeof *sp);
    const char **names = malloc(n * sizeof *names);
    if (!sp || !names) {
        free(sp);
        free(names);
        return mo_errorf(MO_ENOMEM, "%s: out of memory checking the tensor table", c->type);
    }
    int rc = MO_OK;
    for (uint32_t i = 0; i < n && rc == MO_OK; i++) {
        size_t old = cx_push(c, ".%s[%u]", field, i);
        rc = entry_check(c, &t[i], total, &sp[i].bytes);
        cx_pop(c, old);
        sp[i].offset = t[i].offset;
        sp[i].index = i;
        names[i] = t[i].name;
    }
    if (rc == MO_OK)
        rc = ck_unique(c, field, names, n);
    if (rc == MO_OK) {
        qsort(sp, n, sizeof *sp, cmp_span);
        uint64_t end = 0; /* end of the furthest-reaching tensor so far */
        uint32_t owner = 0;
        for (uint32_t i = 0; i < n && rc == MO_OK; i++) {
            if (sp[i].bytes == 0)
                continue;
            if (sp[i].offset < end)
                rc = cx_fail(c, field, "'%s' overlaps '%s'", t[sp[i].index].name, t[owner].name);
            if (sp[i].offset + sp[i].bytes > end) {
                end = sp[i].offset + sp[i].bytes;
                owner = sp[i].index;
            }
        }
    }
    free(sp);
    free(names);
    return rc;
}

static int entry_decode(cx_t *c, const msgpack_object *o, msg_tensor_entry_t *e) {
    fld_t f[4] = {FLD("name"), FLD("dtype"), FLD("shape"), FLD("offset")};
    TRY(dec_fields(c, o, NULL, f, 4));
    TRY(dec_str(c, &f[0], MSG_MAX_NAME, &e->name));
    int dt = 0;
    TRY(dec_enum(c, &f[1], dt_nm, DT_COUNT, &dt));
    e->dtype = (dtype_t)dt;
    const msgpack_object *dims = NULL;
    TRY(dec_array(c, &f[2], MSG_MAX_DIMS, &dims, &e->ndim));
    for (uint32_t i = 0; i < e->ndim; i++) {
        char nm[24];
        snprintf(nm, sizeof nm, "shape[%u]", i);
        fld_t fd = {nm, &dims[i]};
        TRY(dec_i64(c, &fd, 0, MSG_MAX_DIM, &e->shape[i]));
    }
    return dec_u64(c, &f[3], &e->offset);
}

static int table_decode(cx_t *c, const fld_t *f, msg_weights_chunk_t *w) {
    w->table = NULL;
    w->n_table = 0;
    if (!fld_has(f))
        return MO_OK;
    const msgpack_object *items = NULL;
    uint32_t n = 0;
    TRY(dec_array(c, f, MSG_MAX_TENSORS, &items, &n));
    msg_tensor_entry_t *t;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *t, (void **)&t));
    memset(t, 0, (n ? n : 1) * sizeof *t);
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".table[%u]", i);
        int rc = entry_decode(c, &items[i], &t[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    w->table = t;
    w->n_table = n;
    return MO_OK;
}

enum { W_VERSION, W_CHECKSUM, W_INDEX, W_NCHUNKS, W_TOTAL, W_CHUNK, W_TABLE, W_META, W_DATA, W_N };

static int chunk_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_weights_chunk_t *w = &m->weights_chunk;
    fld_t f[W_N] = {FLD("version"),  FLD("checksum"),    FLD("chunk_index"),
                    FLD("n_chunks"), FLD("total_bytes"), FLD("chunk_bytes"),
                    FLD("table"),    FLD("meta"),        FLD("data")};
    TRY(dec_fields(c, o, NULL, f, W_N));
    TRY(dec_u64(c, &f[W_VERSION], &w->version));
    TRY(dec_u64(c, &f[W_CHECKSUM], &w->checksum));
    TRY(dec_u32(c, &f[W_INDEX], &w->chunk_index));
    TRY(dec_u32(c, &f[W_NCHUNKS], &w->n_chunks));
    TRY(dec_u64(c, &f[W_TOTAL], &w->total_bytes));
    TRY(dec_u64(c, &f[W_CHUNK], &w->chunk_bytes));
    TRY(table_decode(c, &f[W_TABLE], w));
    TRY(dec_strmap_opt(c, &f[W_META], MSG_MAX_SPEC, &w->meta));
    if (!f[W_DATA].v)
        return cx_fail(c, "data", "missing");
    if (f[W_DATA].v->type != MSGPACK_OBJECT_BIN)
        return cx_fail(c, "data", "expected binary, got %s", mp_kind(f[W_DATA].v));
    uint32_t n = f[W_DATA].v->via.bin.size;
    void *p;
    TRY(cx_alloc(c, n, &p));
    if (n)
        memcpy(p, f[W_DATA].v->via.bin.ptr, n);
    w->data = p;
    w->nbytes = n;
    return MO_OK;
}

int ck_weights_chunk(cx_t *c, const msg_weights_chunk_t *w) {
    TRY(ck_u64(c, "total_bytes", w->total_bytes, 1, MSG_MAX_WEIGHT_BYTES));
    TRY(ck_u64(c, "chunk_bytes", w->chunk_bytes, 1, UINT32_MAX)); /* one msgpack bin */
    uint64_t need = (w->total_bytes + w->chunk_bytes - 1) / w->chunk_bytes;
    if (w->n_chunks != need)
        return cx_fail(c, "n_chunks", "%u, but total_bytes %llu in chunks of %llu makes %llu",
                       w->n_chunks, (unsigned long long)w->total_bytes,
                       (unsigned long long)w->chunk_bytes, (unsigned long long)need);
    if (w->n_chunks > MSG_MAX_CHUNKS)
        return cx_fail(c, "n_chunks", "%u, at most %d", w->n_chunks, MSG_MAX_CHUNKS);
    if (w->chunk_index >= w->n_chunks)
        return cx_fail(c, "chunk_index", "%u, but there are %u chunks", w->chunk_index,
                       w->n_chunks);
    uint64_t start = (uint64_t)w->chunk_index * w->chunk_bytes;
    uint64_t len =
        w->total_bytes - start < w->chunk_bytes ? w->total_bytes - start : w->chunk_bytes;
    if (w->nbytes != len)
        return cx_fail(c, "data", "%llu bytes, chunk %u of %u holds %llu",
                       (unsigned long long)w->nbytes, w->chunk_index, w->n_chunks,
                       (unsigned long long)len);
    if (len && !w->data)
        return cx_fail(c, "data", "missing");
    if (w->chunk_index != 0) {
        if (w->n_table || w->meta.n)
            return cx_fail(c, w->n_table ? "table" : "meta", "only chunk 0 carries it");
        return MO_OK;
    }
    TRY(ck_weights_table(c, "table", w->table, w->n_table, w->total_bytes));
    return ck_strmap(c, "meta", &w->meta, MSG_MAX_SPEC);
}

static int chunk_check(cx_t *c, const msg_t *m) {
    return ck_weights_chunk(c, &m->weights_chunk);
}

static void chunk_encode(enc_t *e, const msg_t *m) {
    const msg_weights_chunk_t *w = &m->weights_chunk;
    enc_key(e, "version");
    enc_u64(e, w->version);
    enc_key(e, "checksum");
    enc_u64(e, w->checksum);
    enc_key(e, "chunk_index");
    enc_u64(e, w->chunk_index);
    enc_key(e, "n_chunks");
    enc_u64(e, w->n_chunks);
    enc_key(e, "total_bytes");
    enc_u64(e, w->total_bytes);
    enc_key(e, "chunk_bytes");
    enc_u64(e, w->chunk_bytes);
    if (w->n_table) {
        enc_key(e, "table");
        msgpack_pack_array(&e->pk, w->n_table);
        for (uint32_t i = 0; i < w->n_table; i++) {
            const msg_tensor_entry_t *t = &w->table[i];
            msgpack_pack_map(&e->pk, 4);
            enc_str(e, "name");
            enc_str(e, t->name);
            enc_str(e, "dtype");
            enc_str(e, dtype_name(t->dtype));
            enc_str(e, "shape");
            msgpack_pack_array(&e->pk, t->ndim);
            for (uint32_t d = 0; d < t->ndim; d++)
                enc_i64(e, t->shape[d]);
            enc_str(e, "offset");
            enc_u64(e, t->offset);
        }
    }
    if (w->meta.n) {
        enc_key(e, "meta");
        enc_strmap(e, &w->meta);
    }
    enc_key(e, "data");
    msgpack_pack_bin_with_body(&e->pk, w->data, (size_t)w->nbytes);
}

const msg_codec_t codec_weights_chunk = {chunk_decode, chunk_check, chunk_encode};
