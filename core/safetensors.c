/* safetensors: validated memory-mapped reading, sharded checkpoints, and atomic writing. */
#include "core/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

#define MAX_INDEX_BYTES (512u << 20)    /* a generous bound for model.safetensors.index.json */
#define JSON_MAX_INT 9007199254740992.0 /* 2^53: larger JSON numbers lose integer precision */

/* ------------------------------------------------------------------------ */
/* Name lookup: open addressing over FNV-1a hashes. Slots hold index + 1.   */

typedef const char *(*key_fn)(const void *ctx, int i);

typedef struct name_map {
    int32_t *slots; /* (cap) */
    size_t cap;     /* power of two, at least twice the entries */
} name_map_t;

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static int map_init(name_map_t *m, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 1)
        cap *= 2;
    m->slots = calloc(cap, sizeof *m->slots);
    m->cap = cap;
    return m->slots ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory for a name table of %zu", n);
}

static void map_free(name_map_t *m) {
    free(m->slots);
    m->slots = NULL;
    m->cap = 0;
}

static int map_find(const name_map_t *m, const char *name, key_fn key, const void *ctx) {
    if (!m->slots)
        return -1;
    size_t mask = m->cap - 1;
    for (size_t j = (size_t)fnv1a(name) & mask;; j = (j + 1) & mask) {
        int32_t s = m->slots[j];
        if (s == 0)
            return -1;
        if (strcmp(key(ctx, s - 1), name) == 0)
            return s - 1;
    }
}

/* Inserts idx under name; returns -1, or the index already stored under name. */
static int map_insert(name_map_t *m, const char *name, int idx, key_fn key, const void *ctx) {
    size_t mask = m->cap - 1;
    for (size_t j = (size_t)fnv1a(name) & mask;; j = (j + 1) & mask) {
        int32_t s = m->slots[j];
        if (s == 0) {
            m->slots[j] = idx + 1;
            return -1;
        }
        if (strcmp(key(ctx, s - 1), name) == 0)
            return s - 1;
    }
}

/* ------------------------------------------------------------------------ */
/* Small helpers.                                                            */

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Offset of the first byte that breaks UTF-8 or is a raw control character
 * other than tab, newline or carriage return; len when the text is clean. */
static size_t text_check(const uint8_t *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) {
            if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
                return i;
            i++;
            continue;
        }
        size_t k;
        uint32_t cp;
        if ((c & 0xe0) == 0xc0) {
            k = 1;
            cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            k = 2;
            cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            k = 3;
            cp = c & 0x07;
        } else {
            return i;
        }
        if (len - i <= k)
            return i;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return i;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return i;
        i += k + 1;
    }
    return len;
}

/* A JSON number that is a non-negative integer exactly representable. */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v))
        return 0;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > JSON_MAX_INT || d != floor(d))
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* "a number" or the value itself, for messages. */
static const char *json_describe(const cJSON *v, char *buf, size_t cap) {
    if (cJSON_IsNumber(v))
        snprintf(buf, cap, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v))
        snprintf(buf, cap, "the string \"%.40s\"", v->valuestring);
    else if (cJSON_IsNull(v))
        snprintf(buf, cap, "null");
    else if (cJSON_IsBool(v))
        snprintf(buf, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsArray(v))
        snprintf(buf, cap, "an array");
    else
        snprintf(buf, cap, "an object");
    return buf;
}

static void dtype_list(char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i < DT_COUNT && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? ", " : "", dtype_name((dtype_t)i));
}

static void shape_str(char *buf, size_t cap, dtype_t dt, int ndim, const int64_t *shape) {
    tensor_t t = tensor_view(NULL, dt, DEV_CPU, ndim, shape);
    tensor_shape_str(&t, buf, cap);
}

/* Bytes of numel(shape) elements of size esize; 0 on overflow past 2^62. */
static int shape_bytes(int ndim, const int64_t *shape, size_t esize, uint64_t *out) {
    const uint64_t limit = (uint64_t)1 << 62;
    uint64_t n = 1;
    int zero = 0;
    for (int i = 0; i < ndim; i++)
        zero |= shape[i] == 0;
    if (zero) {
        *out = 0;
        return 1;
    }
    for (int i = 0; i < ndim; i++) {
        uint64_t d = (uint64_t)shape[i];
        if (n > limit / d)
            return 0;
        n *= d;
    }
    if (n > limit / esize)
        return 0;
    *out = n * esize;
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Reading one file.                                                         */

struct st_file {
    char *path;
    const uint8_t *base; /* the whole file */
    size_t size;
    void *mapping;       /* NULL when the buffer is borrowed */
    const uint8_t *data; /* the data section */
    uint64_t data_len;
    st_info_t *info; /* (n), file order */
    int n;
    st_meta_t *meta; /* (n_meta), strings owned */
    int n_meta;
    name_map_t names;
};

static const char *file_key(const void *ctx, int i) {
    return ((const st_file_t *)ctx)->info[i].name;
}

#define BAD(...) mo_errorf(MO_EMALFORMED, __VA_ARGS__)

static int parse_metadata(st_file_t *f, const cJSON *m) {
    if (f->meta)
        return BAD("%s: \"__metadata__\" appears twice", f->path);
    if (!cJSON_IsObject(m))
        return BAD("%s: \"__metadata__\" is not an object", f->path);
    int n = cJSON_GetArraySize(m);
    f->meta = calloc((size_t)n + 1, sizeof *f->meta);
    if (!f->meta)
        return mo_errorf(MO_ENOMEM, "%s: out of memory for metadata", f->path);
    const cJSON *e;
    cJSON_ArrayForEach(e, m) {
        if (!cJSON_IsString(e)) {
            char b[64];
            return BAD("%s: \"__metadata__\" key '%s' is %s, expected a string", f->path, e->string,
                       json_describe(e, b, sizeof b));
        }
        for (int i = 0; i < f->n_meta; i++)
            if (strcmp(f->meta[i].key, e->string) == 0)
                return BAD("%s: \"__metadata__\" key '%s' appears twice", f->path, e->string);
        st_meta_t *kv = &f->meta[f->n_meta++];
        kv->key = dup_str(e->string);
        kv->value = dup_str(e->valuestring);
        if (!kv->key || !kv->value)
            return mo_errorf(MO_ENOMEM, "%s: out of memory for metadata", f->path);
    }
    return MO_OK;
}

static int parse_shape(const st_file_t *f, const char *name, const cJSON *s, st_info_t *t) {
    if (!cJSON_IsArray(s))
        return BAD("%s: tensor '%s': \"shape\" is not an array", f->path, name);
    int nd = cJSON_GetArraySize(s);
    if (nd > TENSOR_MAX_DIMS)
        return BAD("%s: tensor '%s': shape has %d dimensions, at most %d are supported", f->path,
                   name, nd, TENSOR_MAX_DIMS);
    t->ndim = nd;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, s) {
        uint64_t v;
        if (!json_u64(d, &v)) {
            char b[64];
            return BAD("%s: tensor '%s': shape[%d] is %s, expected a non-negative integer", f->path,
                       name, i, json_describe(d, b, sizeof b));
        }
        t->shape[i++] = (int64_t)v;
    }
    return MO_OK;
}

static int parse_offsets(const st_file_t *f, const char *name, const cJSON *o, st_info_t *t) {
    if (!cJSON_IsArray(o) || cJSON_GetArraySize(o) != 2)
        return BAD("%s: tensor '%s': \"data_offsets\" is not an array of 2 integers", f->path,
                   name);
    const cJSON *b = cJSON_GetArrayItem(o, 0), *e = cJSON_GetArrayItem(o, 1);
    char buf[64];
    if (!json_u64(b, &t->begin))
        return BAD("%s: tensor '%s': data_offsets[0] is %s, expected a non-negative integer",
                   f->path, name, json_describe(b, buf, sizeof buf));
    if (!json_u64(e, &t->end))
        return BAD("%s: tensor '%s': data_offsets[1] is %s, expected a non-negative integer",
                   f->path, name, json_describe(e, buf, sizeof buf));
    if (t->begin > t->end)
        return BAD("%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] end before they begin",
                   f->path, name, t->begin, t->end);
    if (t->end > f->data_len)
        return BAD("%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                   "] run past the data section (%" PRIu64 " bytes)",
                   f->path, name, t->begin, t->end, f->data_len);
    return MO_OK;
}

static int parse_entry(const st_file_t *f, const cJSON *e, st_info_t *t) {
    const char *name = e->string;
    if (!name[0])
        return BAD("%s: a tensor has an empty name", f->path);
    if (!cJSON_IsObject(e))
        return BAD("%s: tensor '%s': entry is not an object", f->path, name);
    const cJSON *dt = NULL, *shape = NULL, *off = NULL, *k;
    cJSON_ArrayForEach(k, e) {
        const cJSON **slot = strcmp(k->string, "dtype") == 0          ? &dt
                             : strcmp(k->string, "shape") == 0        ? &shape
                             : strcmp(k->string, "data_offsets") == 0 ? &off
                                                                      : NULL;
        if (!slot)
            return BAD("%s: tensor '%s': unexpected key '%s' (expected dtype, shape, data_offsets)",
                       f->path, name, k->string);
        if (*slot)
            return BAD("%s: tensor '%s': key '%s' appears twice", f->path, name, k->string);
        *slot = k;
    }
    if (!dt || !shape || !off)
        return BAD("%s: tensor '%s': missing \"%s\"", f->path, name,
                   !dt      ? "dtype"
                   : !shape ? "shape"
                            : "data_offsets");
    if (!cJSON_IsString(dt))
        return BAD("%s: tensor '%s': \"dtype\" is not a string", f->path, name);
    if (dtype_from_name(dt->valuestring, &t->dtype) < 0) {
        char list[160];
        dtype_list(list, sizeof list);
        return BAD("%s: tensor '%s': unknown dtype '%s' (supported: %s)", f->path, name,
                   dt->valuestring, list);
    }
    TRY(parse_shape(f, name, shape, t));
    TRY(parse_offsets(f, name, off, t));
    uint64_t need;
    char sh[160];
    shape_str(sh, sizeof sh, t->dtype, t->ndim, t->shape);
    if (!shape_bytes(t->ndim, t->shape, dtype_size(t->dtype), &need))
        return BAD("%s: tensor '%s': %s %s is too large", f->path, name, dtype_name(t->dtype), sh);
    if (need != t->end - t->begin)
        return BAD("%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64
                   " bytes but %s %s needs %" PRIu64,
                   f->path, name, t->begin, t->end, t->end - t->begin, dtype_name(t->dtype), sh,
                   need);
    t->name = dup_str(name);
    return t->name ? MO_OK : mo_errorf(MO_ENOMEM, "%s: out of memory", f->path);
}

typedef struct span {
    uint64_t begin, end;
    int idx;
} span_t;

static int span_cmp(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* Puts the tensors in file order. */
static int sort_entries(st_file_t *f) {
    if (f->n == 0)
        return MO_OK;
    span_t *sp = malloc((size_t)f->n * sizeof *sp);
    st_info_t *tmp = malloc((size_t)f->n * sizeof *tmp);
    if (!sp || !tmp) {
        free(sp);
        free(tmp);
        return mo_errorf(MO_ENOMEM, "%s: out of memory", f->path);
    }
    for (int i = 0; i < f->n; i++)
        sp[i] = (span_t){f->info[i].begin, f->info[i].end, i};
    qsort(sp, (size_t)f->n, sizeof *sp, span_cmp);
    for (int i = 0; i < f->n; i++)
        tmp[i] = f->info[sp[i].idx];
    memcpy(f->info, tmp, (size_t)f->n * sizeof *tmp);
    free(sp);
    free(tmp);
    return MO_OK;
}

/* Tensors must tile the data section exactly. */
static int check_coverage(const st_file_t *f) {
    uint64_t cursor = 0;
    for (int i = 0; i < f->n; i++) {
        const st_info_t *t = &f->info[i];
        if (t->begin < cursor) {
            const st_info_t *p = &f->info[i - 1];
            return BAD("%s: tensor '%s' data_offsets [%" PRIu64 ", %" PRIu64
                       "] overlap tensor '%s' [%" PRIu64 ", %" PRIu64 "]",
                       f->path, t->name, t->begin, t->end, p->name, p->begin, p->end);
        }
        if (t->begin > cursor)
            return BAD("%s: data bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor (a hole "
                       "before tensor '%s')",
                       f->path, cursor, t->begin, t->name);
        cursor = t->end;
    }
    if (cursor != f->data_len)
        return BAD("%s: data bytes [%" PRIu64 ", %" PRIu64 ") after the last tensor belong to no "
                   "tensor",
                   f->path, cursor, f->data_len);
    return MO_OK;
}

static int parse_header_json(st_file_t *f, const char *text, size_t n) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    if (!root) {
        size_t at = end && end >= text && end <= text + n ? (size_t)(end - text) : 0;
        return BAD("%s: header is not valid JSON (error near header byte %zu)", f->path, at);
    }
    for (const char *p = end; p < text + n; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return BAD("%s: header has data after its JSON object (header byte %zu)", f->path,
                       (size_t)(p - text));
        }
    int rc = MO_OK;
    if (!cJSON_IsObject(root)) {
        rc = BAD("%s: header is not a JSON object", f->path);
        goto done;
    }
    f->info = calloc((size_t)cJSON_GetArraySize(root) + 1, sizeof *f->info);
    if (!f->info) {
        rc = mo_errorf(MO_ENOMEM, "%s: out of memory", f->path);
        goto done;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (strcmp(e->string, "__metadata__") == 0)
            rc = parse_metadata(f, e);
        else
            rc = parse_entry(f, e, &f->info[f->n]);
        if (rc < 0)
            goto done;
        if (strcmp(e->string, "__metadata__") != 0)
            f->n++;
    }
done:
    cJSON_Delete(root);
    return rc;
}

static int build_names(st_file_t *f) {
    TRY(map_init(&f->names, (size_t)f->n));
    for (int i = 0; i < f->n; i++)
        if (map_insert(&f->names, f->info[i].name, i, file_key, f) >= 0)
            return BAD("%s: tensor '%s' appears twice in the header", f->path, f->info[i].name);
    return MO_OK;
}

static int st_parse(st_file_t *f) {
    if (f->size < 8)
        return BAD("%s: file is %zu bytes, too short for the 8-byte header length", f->path,
                   f->size);
    uint64_t n = le64(f->base);
    if (n < 2)
        return BAD("%s: header length %" PRIu64 " is below the minimum of 2 (\"{}\")", f->path, n);
    if (n > ST_MAX_HEADER_BYTES)
        return BAD("%s: header length %" PRIu64 " exceeds the limit of %u bytes", f->path, n,
                   ST_MAX_HEADER_BYTES);
    if (n > f->size - 8)
        return BAD("%s: header length %" PRIu64 " runs past the end of the file (%zu bytes)",
                   f->path, n, f->size);
    const uint8_t *h = f->base + 8;
    if (h[0] != '{')
        return BAD("%s: header does not start with '{'", f->path);
    size_t bad = text_check(h, (size_t)n);
    if (bad != n)
        return BAD("%s: header byte %zu (0x%02x) is not valid UTF-8 JSON text", f->path, bad,
                   h[bad]);
    f->data = h + n;
    f->data_len = f->size - 8 - n;
    char *text = malloc((size_t)n + 1);
    if (!text)
        return mo_errorf(MO_ENOMEM, "%s: out of memory for a %" PRIu64 "-byte header", f->path, n);
    memcpy(text, h, (size_t)n);
    text[n] = '\0';
    int rc = parse_header_json(f, text, (size_t)n);
    free(text);
    TRY(rc);
    TRY(sort_entries(f));
    TRY(build_names(f));
    return check_coverage(f);
}

static st_file_t *file_new(const char *display) {
    st_file_t *f = calloc(1, sizeof *f);
    if (f && !(f->path = dup_str(display))) {
        free(f);
        f = NULL;
    }
    if (!f)
        mo_errorf(MO_ENOMEM, "out of memory opening %s", display);
    return f;
}

int st_open_buffer(st_file_t **out, const void *buf, size_t size, const char *display_name) {
    *out = NULL;
    st_file_t *f = file_new(display_name ? display_name : "(buffer)");
    if (!f)
        return MO_ENOMEM;
    f->base = buf;
    f->size = size;
    int rc = st_parse(f);
    if (rc < 0) {
        st_close(&f);
        return rc;
    }
    *out = f;
    return MO_OK;
}

int st_open(st_file_t **out, const char *path) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return mo_errorf(MO_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        int rc = mo_errorf(MO_EIO, "%s: not a regular file", path);
        close(fd);
        return rc;
    }
    st_file_t *f = file_new(path);
    if (!f) {
        close(fd);
        return MO_ENOMEM;
    }
    f->size = (size_t)sb.st_size;
    if (f->size > 0) {
        void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int rc =
                mo_errorf(MO_EIO, "%s: cannot map %zu bytes: %s", path, f->size, strerror(errno));
            close(fd);
            st_close(&f);
            return rc;
        }
        f->mapping = p;
        f->base = p;
    }
    close(fd);
    int rc = st_parse(f);
    if (rc < 0) {
        st_close(&f);
        return rc;
    }
    *out = f;
    return MO_OK;
}

void st_close(st_file_t **fp) {
    st_file_t *f = *fp;
    if (!f)
        return;
    if (f->mapping)
        munmap(f->mapping, f->size);
    if (f->info)
        for (int i = 0; i < f->n; i++)
            free((void *)f->info[i].name);
    free(f->info);
    for (int i = 0; i < f->n_meta; i++) {
        free((void *)f->meta[i].key);
        free((void *)f->meta[i].value);
    }
    free(f->meta);
    map_free(&f->names);
    free(f->path);
    free(f);
    *fp = NULL;
}

const char *st_path(const st_file_t *f) {
    return f->path;
}
int st_count(const st_file_t *f) {
    return f->n;
}

const st_info_t *st_info(const st_file_t *f, int i) {
    MO_ASSERT(i >= 0 && i < f->n);
    return &f->info[i];
}

tensor_t st_tensor(const st_file_t *f, int i) {
    const st_info_t *t = st_info(f, i);
    return tensor_view((void *)(f->data + t->begin), t->dtype, DEV_CPU, t->ndim, t->shape);
}

int st_find(const st_file_t *f, const char *name) {
    return map_find(&f->names, name, file_key, f);
}

int st_get(const st_file_t *f, const char *name, tensor_t *out) {
    int i = st_find(f, name);
    if (i < 0)
        return mo_errorf(MO_ENOTFOUND, "%s: no tensor '%s'", f->path, name);
    *out = st_tensor(f, i);
    return MO_OK;
}

int st_metadata_count(const st_file_t *f) {
    return f->n_meta;
}

void st_metadata_at(const st_file_t *f, int i, const char **key, const char **value) {
    MO_ASSERT(i >= 0 && i < f->n_meta);
    *key = f->meta[i].key;
    *value = f->meta[i].value;
}

const char *st_metadata(const st_file_t *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0)
            return f->meta[i].value;
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Writing.                                                                  */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf_t;

static void sb_put(sbuf_t *b, const char *s, size_t n) {
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    MO_ASSERT(n >= 0 && (size_t)n < sizeof tmp);
    sb_put(b, tmp, (size_t)n);
}

/* A JSON string: quotes, backslashes and control bytes escaped, UTF-8 kept. */
static void sb_json_str(sbuf_t *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_put(b, e, 2);
        } else if (c < 0x20) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static int check_item(const st_item_t *it, const char *path) {
    const tensor_t *t = &it->tensor;
    if (!it->name || !it->name[0])
        return mo_errorf(MO_EINVAL, "%s: a tensor has no name", path);
    if (strcmp(it->name, "__metadata__") == 0)
        return mo_errorf(MO_EINVAL, "%s: '__metadata__' cannot name a tensor", path);
    if (text_check((const uint8_t *)it->name, strlen(it->name)) != strlen(it->name))
        return mo_errorf(MO_EINVAL, "%s: tensor name '%s' is not valid UTF-8 text", path, it->name);
    if ((unsigned)t->dtype >= DT_COUNT || t->ndim < 0 || t->ndim > TENSOR_MAX_DIMS)
        return mo_errorf(MO_EINVAL, "%s: tensor '%s' has a bad dtype or rank", path, it->name);
    if (t->device != DEV_CPU)
        return mo_errorf(MO_EINVAL, "%s: tensor '%s' is on %s, expected cpu", path, it->name,
                         device_name(t->device));
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0)
            return mo_errorf(MO_EINVAL, "%s: tensor '%s' has negative dimension %lld", path,
                             it->name, (long long)t->shape[d]);
    uint64_t nb;
    if (!shape_bytes(t->ndim, t->shape, dtype_size(t->dtype), &nb))
        return mo_errorf(MO_EINVAL, "%s: tensor '%s' is too large", path, it->name);
    if (nb > 0 && !t->data)
        return mo_errorf(MO_EINVAL, "%s: tensor '%s' has no data", path, it->name);
    return MO_OK;
}

typedef struct chunk {
    const void *p;
    size_t n;
} chunk_t;

static int write_all(int fd, const void *p, size_t n, const char *path) {
    const char *c = p;
    while (n > 0) {
        size_t step = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = write(fd, c, step);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return mo_errorf(MO_EIO, "%s: write failed: %s", path, w < 0 ? strerror(errno) : "0");
        c += w;
        n -= (size_t)w;
    }
    return MO_OK;
}

static int fsync_dir(const char *path) {
    char *dir = dup_str(path);
    if (!dir)
        return mo_errorf(MO_ENOMEM, "out of memory");
    char *slash = strrchr(dir, '/');
    if (!slash)
        strcpy(dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = MO_OK;
    if (fd < 0 || fsync(fd) != 0)
        rc = mo_errorf(MO_EIO, "%s: cannot sync directory: %s", dir, strerror(errno));
    if (fd >= 0)
        close(fd);
    free(dir);
    return rc;
}

/* Writes the chunks to a temporary file beside path, syncs it and renames it
 * into place, then syncs the directory. */
static int atomic_write(const char *path, const chunk_t *ch, int n) {
    size_t len = strlen(path);
    char *tmp = malloc(len + 16);
    if (!tmp)
        return mo_errorf(MO_ENOMEM, "out of memory");
    const char *slash = strrchr(path, '/');
    size_t dlen = slash ? (size_t)(slash - path) + 1 : 0;
    snprintf(tmp, len + 16, "%.*s.%s.XXXXXX", (int)dlen, path, path + dlen);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int rc = mo_errorf(MO_EIO, "%s: cannot create a temporary file: %s", path, strerror(errno));
        free(tmp);
        return rc;
    }
    int rc =
        fchmod(fd, 0644) == 0 ? MO_OK : mo_errorf(MO_EIO, "%s: chmod: %s", tmp, strerror(errno));
    for (int i = 0; i < n && rc == MO_OK; i++)
        rc = write_all(fd, ch[i].p, ch[i].n, tmp);
    if (rc == MO_OK && fsync(fd) != 0)
        rc = mo_errorf(MO_EIO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "%s: close failed: %s", tmp, strerror(errno));
    if (rc == MO_OK && rename(tmp, path) != 0)
        rc = mo_errorf(MO_EIO, "%s: cannot rename into place: %s", path, strerror(errno));
    if (rc < 0)
        unlink(tmp);
    free(tmp);
    return rc < 0 ? rc : fsync_dir(path);
}

static const char *item_key(const void *ctx, int i) {
    return ((const st_item_t *)ctx)[i].name;
}

static int check_items(const char *path, const st_item_t *items, int n, const st_meta_t *meta,
                       int n_meta) {
    if (n < 0 || n_meta < 0 || (n > 0 && !items) || (n_meta > 0 && !meta))
        return mo_errorf(MO_EINVAL, "%s: bad tensor or metadata list", path);
    for (int i = 0; i < n; i++)
        TRY(check_item(&items[i], path));
    for (int i = 0; i < n_meta; i++) {
        if (!meta[i].key || !meta[i].value)
            return mo_errorf(MO_EINVAL, "%s: metadata entry %d is incomplete", path, i);
        for (int j = 0; j < i; j++)
            if (strcmp(meta[i].key, meta[j].key) == 0)
                return mo_errorf(MO_EINVAL, "%s: metadata key '%s' given twice", path, meta[i].key);
    }
    name_map_t m;
    TRY(map_init(&m, (size_t)n));
    int rc = MO_OK;
    for (int i = 0; i < n && rc == MO_OK; i++)
        if (map_insert(&m, items[i].name, i, item_key, items) >= 0)
            rc = mo_errorf(MO_EINVAL, "%s: tensor '%s' given twice", path, items[i].name);
    map_free(&m);
    return rc;
}

/* Item indices by element size, largest first, stable. */
static void write_order(const st_item_t *items, int n, int *order) {
    int k = 0;
    for (size_t sz = 8; sz >= 1; sz /= 2)
        for (int i = 0; i < n; i++)
            if (dtype_size(items[i].tensor.dtype) == sz)
                order[k++] = i;
    MO_ASSERT(k == n);
}

static void build_header(sbuf_t *b, const st_item_t *items, const int *order, int n,
                         const st_meta_t *meta, int n_meta) {
    sb_put(b, "{", 1);
    if (n_meta > 0) {
        sb_put(b, "\"__metadata__\":{", 16);
        for (int i = 0; i < n_meta; i++) {
            if (i)
                sb_put(b, ",", 1);
            sb_json_str(b, meta[i].key);
            sb_put(b, ":", 1);
            sb_json_str(b, meta[i].value);
        }
        sb_put(b, "}", 1);
    }
    uint64_t off = 0;
    for (int k = 0; k < n; k++) {
        const st_item_t *it = &items[order[k]];
        uint64_t nb = tensor_nbytes(&it->tensor);
        if (k || n_meta > 0)
            sb_put(b, ",", 1);
        sb_json_str(b, it->name);
        sb_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", dtype_name(it->tensor.dtype));
        for (int d = 0; d < it->tensor.ndim; d++)
            sb_printf(b, "%s%lld", d ? "," : "", (long long)it->tensor.shape[d]);
        sb_printf(b, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + nb);
        off += nb;
    }
    sb_put(b, "}", 1);
    while (b->len % 8 != 0)
        sb_put(b, " ", 1);
}

int st_write(const char *path, const st_item_t *items, int n, const st_meta_t *meta, int n_meta) {
    TRY(check_items(path, items, n, meta, n_meta));
    int *order = malloc(((size_t)n + 1) * sizeof *order);
    chunk_t *ch = malloc(((size_t)n + 2) * sizeof *ch);
    sbuf_t hdr = {0};
    int rc = MO_OK;
    if (!order || !ch) {
        rc = mo_errorf(MO_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    write_order(items, n, order);
    build_header(&hdr, items, order, n, meta, n_meta);
    if (hdr.oom) {
        rc = mo_errorf(MO_ENOMEM, "%s: out of memory for the header", path);
        goto done;
    }
    if (hdr.len > ST_MAX_HEADER_BYTES) {
        rc = mo_errorf(MO_EINVAL, "%s: header of %zu bytes exceeds the format's limit", path,
                       hdr.len);
        goto done;
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (uint8_t)((uint64_t)hdr.len >> (8 * i));
    ch[0] = (chunk_t){lenb, 8};
    ch[1] = (chunk_t){hdr.p, hdr.len};
    for (int k = 0; k < n; k++)
        ch[2 + k] = (chunk_t){items[order[k]].tensor.data, tensor_nbytes(&items[order[k]].tensor)};
    rc = atomic_write(path, ch, n + 2);
done:
    free(order);
    free(ch);
    free(hdr.p);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Checkpoints.                                                              */

struct st_checkpoint {
    char *path;         /* what was opened, for messages */
    st_file_t **shards; /* (n_shards), file-name order */
    int n_shards;
    int *first;       /* (n_shards + 1): global index of each shard's first tensor */
    name_map_t names; /* name -> global index */
};

static int ck_locate(const st_checkpoint_t *ck, int g, int *local) {
    int lo = 0, hi = ck->n_shards - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ck->first[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    *local = g - ck->first[lo];
    return lo;
}

static const char *ck_key(const void *ctx, int g) {
    const st_checkpoint_t *ck = ctx;
    int local;
    int s = ck_locate(ck, g, &local);
    return ck->shards[s]->info[local].name;
}

static int read_text_file(const char *path, size_t max, char **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return mo_errorf(MO_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    int rc = MO_OK;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        rc = mo_errorf(MO_EIO, "%s: not a regular file", path);
    else if ((uint64_t)sb.st_size > max)
        rc = mo_errorf(MO_EMALFORMED, "%s: %lld bytes exceeds the limit of %zu", path,
                       (long long)sb.st_size, max);
    char *buf = rc == MO_OK ? malloc((size_t)sb.st_size + 1) : NULL;
    if (rc == MO_OK && !buf)
        rc = mo_errorf(MO_ENOMEM, "%s: out of memory", path);
    size_t got = 0;
    while (rc == MO_OK && got < (size_t)sb.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)sb.st_size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            rc = mo_errorf(MO_EIO, "%s: read failed: %s", path, r < 0 ? strerror(errno) : "EOF");
        else
            got += (size_t)r;
    }
    close(fd);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    buf[got] = '\0';
    *out = buf;
    return MO_OK;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static char *dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        return dup_str(".");
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, path, n);
        d[n] = '\0';
    }
    return d;
}

static int str_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The distinct shard names of the weight map, sorted; validates each entry. */
static int index_shard_names(const char *ipath, const cJSON *wm, const char ***names, int *n) {
    int cap = cJSON_GetArraySize(wm), k = 0;
    const char **v = calloc((size_t)cap + 1, sizeof *v);
    if (!v)
        return mo_errorf(MO_ENOMEM, "%s: out of memory", ipath);
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e)) {
            char b[64];
            free(v);
            return BAD("%s: weight_map['%s'] is %s, expected a shard file name", ipath, e->string,
                       json_describe(e, b, sizeof b));
        }
        const char *s = e->valuestring;
        if (!s[0] || strchr(s, '/') || strcmp(s, ".") == 0 || strcmp(s, "..") == 0) {
            free(v);
            return BAD("%s: weight_map['%s'] is '%s', expected a file name in the same directory",
                       ipath, e->string, s);
        }
        v[k++] = s;
    }
    qsort(v, (size_t)k, sizeof *v, str_cmp);
    int u = 0;
    for (int i = 0; i < k; i++)
        if (u == 0 || strcmp(v[u - 1], v[i]) != 0)
            v[u++] = v[i];
    *names = v;
    *n = u;
    return MO_OK;
}

static int shard_of(const char *const *names, int n, const char *s) {
    const char *const *p = bsearch(&s, names, (size_t)n, sizeof *names, str_cmp);
    return p ? (int)(p - names) : -1;
}

static int ck_alloc_shards(st_checkpoint_t *ck, int n) {
    ck->shards = calloc((size_t)n, sizeof *ck->shards);
    ck->first = calloc((size_t)n + 1, sizeof *ck->first);
    if (!ck->shards || !ck->first)
        return mo_errorf(MO_ENOMEM, "%s: out of memory", ck->path);
    ck->n_shards = n;
    return MO_OK;
}

static int ck_count(st_checkpoint_t *ck) {
    for (int s = 0; s < ck->n_shards; s++) {
        if ((int64_t)ck->first[s] + ck->shards[s]->n > INT32_MAX)
            return BAD("%s: too many tensors", ck->path);
        ck->first[s + 1] = ck->first[s] + ck->shards[s]->n;
    }
    return map_init(&ck->names, (size_t)ck->first[ck->n_shards]);
}

/* Every tensor of every shard must be named by the index for that shard. */
static int ck_check_unindexed(const st_checkpoint_t *ck, const char *ipath,
                              const char *const *snames) {
    for (int s = 0; s < ck->n_shards; s++)
        for (int i = 0; i < ck->shards[s]->n; i++) {
            const char *name = ck->shards[s]->info[i].name;
            int g = map_find(&ck->names, name, ck_key, ck);
            if (g != ck->first[s] + i)
                return BAD("%s: shard '%s' holds tensor '%s' that the index %s", ipath, snames[s],
                           name, g < 0 ? "does not name" : "assigns to another shard");
        }
    return MO_OK;
}

static int ck_map_index(st_checkpoint_t *ck, const char *ipath, const cJSON *wm,
                        const char *const *snames) {
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        int s = shard_of(snames, ck->n_shards, e->valuestring);
        int local = st_find(ck->shards[s], e->string);
        if (local < 0)
            return BAD("%s: tensor '%s' is not in its shard '%s'", ipath, e->string, snames[s]);
        if (map_insert(&ck->names, e->string, ck->first[s] + local, ck_key, ck) >= 0)
            return BAD("%s: weight_map names tensor '%s' twice", ipath, e->string);
    }
    return ck_check_unindexed(ck, ipath, snames);
}

static int ck_open_shards(st_checkpoint_t *ck, const char *ipath, const char *const *snames) {
    char *dir = dir_of(ipath);
    if (!dir)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = MO_OK;
    for (int s = 0; s < ck->n_shards && rc == MO_OK; s++) {
        char *p = path_join(dir, snames[s]);
        rc = p ? st_open(&ck->shards[s], p) : mo_errorf(MO_ENOMEM, "out of memory");
        if (rc < 0)
            rc = mo_error_wrap(rc, "%s: shard '%s'", ipath, snames[s]);
        free(p);
    }
    free(dir);
    return rc;
}

static int ck_open_index(st_checkpoint_t *ck, const char *ipath) {
    char *text = NULL;
    TRY(read_text_file(ipath, MAX_INDEX_BYTES, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    const char **snames = NULL;
    int n = 0, rc = MO_OK;
    const cJSON *wm = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!root)
        rc = BAD("%s: not valid JSON", ipath);
    else if (!cJSON_IsObject(root))
        rc = BAD("%s: not a JSON object", ipath);
    else if (!wm)
        rc = BAD("%s: missing \"weight_map\"", ipath);
    else if (!cJSON_IsObject(wm) || cJSON_GetArraySize(wm) == 0)
        rc = BAD("%s: \"weight_map\" is not a non-empty object", ipath);
    if (rc == MO_OK)
        rc = index_shard_names(ipath, wm, &snames, &n);
    if (rc == MO_OK)
        rc = ck_alloc_shards(ck, n);
    if (rc == MO_OK)
        rc = ck_open_shards(ck, ipath, snames);
    if (rc == MO_OK)
        rc = ck_count(ck);
    if (rc == MO_OK)
        rc = ck_map_index(ck, ipath, wm, snames);
    free(snames);
    cJSON_Delete(root);
    return rc;
}

static int ck_open_single(st_checkpoint_t *ck, const char *fpath) {
    TRY(ck_alloc_shards(ck, 1));
    TRY(st_open(&ck->shards[0], fpath));
    TRY(ck_count(ck));
    for (int i = 0; i < ck->shards[0]->n; i++)
        map_insert(&ck->names, ck->shards[0]->info[i].name, i, ck_key, ck);
    return MO_OK;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int ck_open_path(st_checkpoint_t *ck, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0)
        return mo_errorf(MO_EIO, "%s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return ends_with(path, ".json") ? ck_open_index(ck, path) : ck_open_single(ck, path);
    char *ip = path_join(path, ST_INDEX_NAME), *sp = path_join(path, ST_SINGLE_NAME);
    int rc;
    if (!ip || !sp)
        rc = mo_errorf(MO_ENOMEM, "out of memory");
    else if (stat(ip, &sb) == 0)
        rc = ck_open_index(ck, ip);
    else if (stat(sp, &sb) == 0)
        rc = ck_open_single(ck, sp);
    else
        rc = mo_errorf(MO_ENOTFOUND, "%s: holds neither %s nor %s", path, ST_INDEX_NAME,
                       ST_SINGLE_NAME);
    free(ip);
    free(sp);
    return rc;
}

int st_checkpoint_open(st_checkpoint_t **out, const char *path) {
    *out = NULL;
    st_checkpoint_t *ck = calloc(1, sizeof *ck);
    if (!ck || !(ck->path = dup_str(path))) {
        free(ck);
        return mo_errorf(MO_ENOMEM, "out of memory opening %s", path);
    }
    int rc = ck_open_path(ck, path);
    if (rc < 0) {
        st_checkpoint_close(&ck);
        return rc;
    }
    *out = ck;
    return MO_OK;
}

void st_checkpoint_close(st_checkpoint_t **ckp) {
    st_checkpoint_t *ck = *ckp;
    if (!ck)
        return;
    for (int s = 0; s < ck->n_shards; s++)
        st_close(&ck->shards[s]);
    free(ck->shards);
    free(ck->first);
    map_free(&ck->names);
    free(ck->path);
    free(ck);
    *ckp = NULL;
}

int st_checkpoint_num_shards(const st_checkpoint_t *ck) {
    return ck->n_shards;
}

const st_file_t *st_checkpoint_shard(const st_checkpoint_t *ck, int i) {
    MO_ASSERT(i >= 0 && i < ck->n_shards);
    return ck->shards[i];
}

int st_checkpoint_num_tensors(const st_checkpoint_t *ck) {
    return ck->first[ck->n_shards];
}

const st_info_t *st_checkpoint_info(const st_checkpoint_t *ck, int i) {
    MO_ASSERT(i >= 0 && i < st_checkpoint_num_tensors(ck));
    int local;
    int s = ck_locate(ck, i, &local);
    return st_info(ck->shards[s], local);
}

tensor_t st_checkpoint_tensor(const st_checkpoint_t *ck, int i) {
    MO_ASSERT(i >= 0 && i < st_checkpoint_num_tensors(ck));
    int local;
    int s = ck_locate(ck, i, &local);
    return st_tensor(ck->shards[s], local);
}

int st_checkpoint_find(const st_checkpoint_t *ck, const char *name) {
    return map_find(&ck->names, name, ck_key, ck);
}

int st_checkpoint_get(const st_checkpoint_t *ck, const char *name, tensor_t *out) {
    int g = st_checkpoint_find(ck, name);
    if (g < 0)
        return mo_errorf(MO_ENOTFOUND, "%s: no tensor '%s'", ck->path, name);
    *out = st_checkpoint_tensor(ck, g);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* fp8 weights with block scales.                                            */

static int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

static int block_fits(int64_t b, int64_t rows, int64_t cols, const tensor_t *s) {
    return ceil_div(rows, b) == s->shape[0] && ceil_div(cols, b) == s->shape[1];
}

static int pick_block(const char *where, const char *sname, const tensor_t *wt, const tensor_t *s,
                      int block, int *out) {
    int64_t rows = wt->shape[0], cols = wt->shape[1];
    char ws[64], ss[64];
    tensor_shape_str(wt, ws, sizeof ws);
    tensor_shape_str(s, ss, sizeof ss);
    if (block > 0) {
        if (!block_fits(block, rows, cols, s))
            return BAD("%s: scale '%s' is %s but weight %s with %dx%d blocks needs (%lld, %lld)",
                       where, sname, ss, ws, block, block, (long long)ceil_div(rows, block),
                       (long long)ceil_div(cols, block));
        *out = block;
        return MO_OK;
    }
    if (block_fits(128, rows, cols, s)) {
        *out = 128;
        return MO_OK;
    }
    for (int64_t b = 1; b <= ((int64_t)1 << 30); b *= 2)
        if (block_fits(b, rows, cols, s)) {
            *out = (int)b;
            return MO_OK;
        }
    return BAD("%s: scale '%s' is %s, which fits no power-of-two block size for weight %s", where,
               sname, ss, ws);
}

/* Converts the scale tensor to a fresh f32 buffer and checks it is finite. */
static int load_scale(const char *where, const char *sname, const tensor_t *s, float **out) {
    size_t n = (size_t)tensor_numel(s), nb = tensor_nbytes(s);
    float *f = malloc(n * sizeof *f + 1);
    void *raw = malloc(nb + 1);
    if (!f || !raw) {
        free(f);
        free(raw);
        return mo_errorf(MO_ENOMEM, "%s: out of memory for scale '%s'", where, sname);
    }
    memcpy(raw, s->data, nb); /* the mapping need not be aligned for the element type */
    convert_to_f32(f, raw, s->dtype, n);
    free(raw);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(f[i])) {
            int rc = BAD("%s: scale '%s' element %zu is %g, expected a finite number", where, sname,
                         i, (double)f[i]);
            free(f);
            return rc;
        }
    *out = f;
    return MO_OK;
}

static int weight_view(const char *where, const char *name, const tensor_t *wt, const tensor_t *s,
                       const char *sname, int block, wview_t *w, float **scale) {
    char ws[64];
    tensor_shape_str(wt, ws, sizeof ws);
    if (wt->ndim != 2)
        return BAD("%s: weight '%s' is %s, expected 2-D", where, name, ws);
    if (!dtype_is_float(wt->dtype))
        return BAD("%s: weight '%s' has dtype %s, expected a float type", where, name,
                   dtype_name(wt->dtype));
    *w = wview_of(wt->data, wt->dtype);
    *scale = NULL;
    if (wt->dtype != DT_F8E4M3) {
        if (s)
            return BAD("%s: weight '%s' is %s but has a scale tensor '%s'", where, name,
                       dtype_name(wt->dtype), sname);
        return MO_OK;
    }
    if (!s)
        return BAD("%s: fp8 weight '%s' has no scale tensor '%s'", where, name, sname);
    char ss[64];
    tensor_shape_str(s, ss, sizeof ss);
    if (s->ndim != 2 || !dtype_is_float(s->dtype) || s->dtype == DT_F8E4M3)
        return BAD("%s: scale '%s' is %s %s, expected a 2-D F32, BF16 or F16 tensor", where, sname,
                   dtype_name(s->dtype), ss);
    int b = 0;
    TRY(pick_block(where, sname, wt, s, block, &b));
    float *f = NULL;
    TRY(load_scale(where, sname, s, &f));
    w->scale = f;
    w->block = b;
    *scale = f;
    return MO_OK;
}

static char *scale_name(const char *name) {
    size_t n = strlen(name);
    char *s = malloc(n + sizeof "_scale_inv");
    if (s) {
        memcpy(s, name, n);
        memcpy(s + n, "_scale_inv", sizeof "_scale_inv");
    }
    return s;
}

int st_checkpoint_weight(const st_checkpoint_t *ck, const char *name, int block, tensor_t *wt,
                         wview_t *w, float **scale) {
    *scale = NULL;
    TRY(st_checkpoint_get(ck, name, wt));
    char *sname = scale_name(name);
    if (!sname)
        return mo_errorf(MO_ENOMEM, "out of memory");
    tensor_t s;
    int has = st_checkpoint_get(ck, sname, &s) == MO_OK;
    int rc = weight_view(ck->path, name, wt, has ? &s : NULL, sname, block, w, scale);
    free(sname);
    return rc;
}

int st_file_weight(const st_file_t *f, const char *name, int block, tensor_t *wt, wview_t *w,
                   float **scale) {
    *scale = NULL;
    TRY(st_get(f, name, wt));
    char *sname = scale_name(name);
    if (!sname)
        return mo_errorf(MO_ENOMEM, "out of memory");
    tensor_t s;
    int has = st_get(f, sname, &s) == MO_OK;
    int rc = weight_view(f->path, name, wt, has ? &s : NULL, sname, block, w, scale);
    free(sname);
    return rc;
}
