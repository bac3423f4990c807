/* Tests for safetensors: write/read round trips (several dtypes, metadata,
 * fp8 block scales), sharded checkpoints, and every kind of malformed input
 * (each truncation, corrupt headers, random byte flips) failing cleanly. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "tests/testutil.h"

/* ---- helpers ---- */

static char g_dir[512];

static void path_in(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", g_dir, name);
}

static int write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = n ? fwrite(p, 1, n, f) : 0;
    fclose(f);
    return w == n ? 0 : -1;
}

static void *read_bytes(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc((size_t)len + 1);
    *n = fread(p, 1, (size_t)len, f);
    fclose(f);
    return p;
}

/* A raw file: 8-byte length (the header's own, or forced_len when nonzero),
 * the header text, then data_len bytes of a pattern. */
static void write_raw(const char *path, const char *header, size_t data_len, uint64_t forced_len) {
    size_t h = strlen(header);
    uint64_t n = forced_len ? forced_len : h;
    uint8_t *buf = malloc(8 + h + data_len + 1);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(n >> (8 * i));
    memcpy(buf + 8, header, h);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + h + i] = (uint8_t)(i * 37 + 11);
    CU_ASSERT_FATAL(write_bytes(path, buf, 8 + h + data_len) == 0);
    free(buf);
}

static void fill_bytes(void *p, size_t n, uint64_t seed) {
    uint8_t *b = p;
    for (size_t i = 0; i < n; i += 16) {
        uint32_t r[4];
        rng_block(r, seed, 0x5afe, i / 16);
        for (size_t j = 0; j < 16 && i + j < n; j++)
            b[i + j] = (uint8_t)(r[j / 4] >> (8 * (j % 4)));
    }
}

/* Float data in any float dtype from uniform values in [-2, 2). */
static void *make_float(dtype_t dt, size_t n, uint64_t seed) {
    float *f = malloc(n * sizeof *f + 4);
    tu_fill(f, n, seed, -2.0f, 2.0f);
    void *out = malloc(n * dtype_size(dt) + 8);
    convert_from_f32(out, dt, f, n);
    free(f);
    return out;
}

static int err_has(const char *s) {
    int ok = strstr(mo_last_error(), s) != NULL;
    if (!ok)
        tu_report("expected '%s' in error: %s", s, mo_last_error());
    return ok;
}

/* ---- round trip ---- */

enum { NT = 8 };

typedef struct {
    const char *name;
    dtype_t dt;
    int ndim;
    int64_t shape[3];
} spec_t;

static const spec_t g_specs[NT] = {
    {"model.embed_tokens.weight", DT_BF16, 2, {8, 16}},
    {"a.f32", DT_F32, 2, {3, 4}},
    {"b.f16", DT_F16, 1, {5}},
    {"c.fp8.weight", DT_F8E4M3, 2, {3, 7}}, /* odd byte count, placed after the wider ones */
    {"d.i64", DT_I64, 1, {3}},
    {"e.i32", DT_I32, 3, {2, 2, 2}},
    {"f.empty", DT_U8, 2, {0, 4}},
    {"g.scalar", DT_F32, 0, {0}},
};

static void make_items(st_item_t *items, void **bufs, uint64_t seed) {
    for (int i = 0; i < NT; i++) {
        const spec_t *s = &g_specs[i];
        tensor_t t = tensor_view(NULL, s->dt, DEV_CPU, s->ndim, s->shape);
        size_t nb = tensor_nbytes(&t);
        bufs[i] = dtype_is_float(s->dt) ? make_float(s->dt, (size_t)tensor_numel(&t), seed + i)
                                        : malloc(nb + 1);
        if (!dtype_is_float(s->dt))
            fill_bytes(bufs[i], nb, seed + i);
        t.data = bufs[i];
        items[i] = (st_item_t){s->name, t};
    }
}

static void free_bufs(void **bufs, int n) {
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

static void test_roundtrip(void) {
    st_item_t items[NT];
    void *bufs[NT];
    make_items(items, bufs, 100);
    st_meta_t meta[2] = {{"format", "pt"}, {"note", "quote \" backslash \\ tab\t"}};
    char p1[600], p2[600];
    path_in(p1, sizeof p1, "rt1.safetensors");
    path_in(p2, sizeof p2, "rt2.safetensors");
    CU_ASSERT_FATAL(st_write(p1, items, NT, meta, 2) == MO_OK);
    CU_ASSERT_FATAL(st_write(p2, items, NT, meta, 2) == MO_OK);

    size_t n1, n2;
    uint8_t *b1 = read_bytes(p1, &n1), *b2 = read_bytes(p2, &n2);
    CU_ASSERT(n1 == n2 && memcmp(b1, b2, n1) == 0); /* deterministic */
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | b1[i];
    CU_ASSERT(hlen % 8 == 0);
    free(b1);
    free(b2);

    st_file_t *f = NULL;
    CU_ASSERT_FATAL(st_open(&f, p1) == MO_OK);
    CU_ASSERT(st_count(f) == NT);
    for (int i = 0; i < NT; i++) {
        const spec_t *s = &g_specs[i];
        int k = st_find(f, s->name);
        CU_ASSERT_FATAL(k >= 0);
        const st_info_t *in = st_info(f, k);
        CU_ASSERT(strcmp(in->name, s->name) == 0);
        CU_ASSERT(in->dtype == s->dt && in->ndim == s->ndim);
        for (int d = 0; d < s->ndim; d++)
            CU_ASSERT(in->shape[d] == s->shape[d]);
        tensor_t t;
        CU_ASSERT(st_get(f, s->name, &t) == MO_OK);
        CU_ASSERT(t.dtype == s->dt && t.device == DEV_CPU && !t.owned);
        CU_ASSERT(tensor_same_shape(&t, &items[i].tensor));
        CU_ASSERT(memcmp(t.data, bufs[i], tensor_nbytes(&t)) == 0);
        CU_ASSERT((uintptr_t)t.data % dtype_size(s->dt) == 0); /* aligned layout */
    }
    /* File order: offsets ascend, element sizes never grow. */
    for (int i = 1; i < NT; i++) {
        CU_ASSERT(st_info(f, i)->begin == st_info(f, i - 1)->end);
        CU_ASSERT(dtype_size(st_info(f, i)->dtype) <= dtype_size(st_info(f, i - 1)->dtype));
    }
    CU_ASSERT(strcmp(st_info(f, 0)->name, "d.i64") == 0);
    CU_ASSERT(st_find(f, "absent") == -1);
    tensor_t t;
    CU_ASSERT(st_get(f, "absent", &t) == MO_ENOTFOUND);
    CU_ASSERT(err_has("rt1.safetensors: no tensor 'absent'"));

    CU_ASSERT(st_metadata_count(f) == 2);
    const char *k, *v;
    st_metadata_at(f, 1, &k, &v);
    CU_ASSERT(strcmp(k, "note") == 0 && strcmp(v, meta[1].value) == 0);
    CU_ASSERT(strcmp(st_metadata(f, "format"), "pt") == 0);
    CU_ASSERT(st_metadata(f, "nope") == NULL);
    st_close(&f);
    CU_ASSERT(f == NULL);
    free_bufs(bufs, NT);

    /* No temporary file is left behind. */
    DIR *d = opendir(g_dir);
    struct dirent *e;
    while ((e = readdir(d)))
        CU_ASSERT(strstr(e->d_name, ".rt") != e->d_name);
    closedir(d);
}

static void test_empty_file(void) {
    char p[600];
    path_in(p, sizeof p, "empty.safetensors");
    CU_ASSERT_FATAL(st_write(p, NULL, 0, NULL, 0) == MO_OK);
    st_file_t *f;
    CU_ASSERT_FATAL(st_open(&f, p) == MO_OK);
    CU_ASSERT(st_count(f) == 0 && st_metadata_count(f) == 0);
    st_close(&f);
}

static void test_write_errors(void) {
    float x[4] = {1, 2, 3, 4};
    int64_t sh[1] = {4};
    tensor_t t = tensor_view(x, DT_F32, DEV_CPU, 1, sh);
    char p[600];
    path_in(p, sizeof p, "bad.safetensors");
    st_item_t dup[2] = {{"w", t}, {"w", t}};
    CU_ASSERT(st_write(p, dup, 2, NULL, 0) == MO_EINVAL);
    CU_ASSERT(err_has("tensor 'w' given twice"));
    st_item_t reserved[1] = {{"__metadata__", t}};
    CU_ASSERT(st_write(p, reserved, 1, NULL, 0) == MO_EINVAL);
    tensor_t g = t;
    g.device = DEV_CUDA;
    st_item_t gpu[1] = {{"w", g}};
    CU_ASSERT(st_write(p, gpu, 1, NULL, 0) == MO_EINVAL);
    CU_ASSERT(err_has("is on cuda, expected cpu"));
    st_meta_t m[2] = {{"k", "1"}, {"k", "2"}};
    st_item_t one[1] = {{"w", t}};
    CU_ASSERT(st_write(p, one, 1, m, 2) == MO_EINVAL);
    CU_ASSERT(st_write("/nonexistent-dir-moerl/x.safetensors", one, 1, NULL, 0) == MO_EIO);
    CU_ASSERT(err_has("/nonexistent-dir-moerl/x.safetensors"));
    struct stat sb;
    CU_ASSERT(stat(p, &sb) != 0); /* nothing was written */
}

/* ---- fp8 weights with block scales ---- */

/* Quantises w (rows, cols) in blocks of b: q = fp8(w / s), s = amax / 448. */
static void quantize_fp8(uint8_t *q, float *s, const float *w, int rows, int cols, int b) {
    int sr = (rows + b - 1) / b, sc = (cols + b - 1) / b;
    for (int i = 0; i < sr; i++)
        for (int j = 0; j < sc; j++) {
            float amax = 0;
            for (int r = i * b; r < rows && r < (i + 1) * b; r++)
                for (int c = j * b; c < cols && c < (j + 1) * b; c++)
                    amax = fmaxf(amax, fabsf(w[r * cols + c]));
            s[i * sc + j] = amax / 448.0f;
            for (int r = i * b; r < rows && r < (i + 1) * b; r++)
                for (int c = j * b; c < cols && c < (j + 1) * b; c++)
                    q[r * cols + c] = f32_to_fp8e4m3(w[r * cols + c] / s[i * sc + j]);
        }
}

typedef struct {
    float *w;
    uint8_t *q;
    float *s;
    tensor_t tq, ts;
} fp8w_t;

static void make_fp8(fp8w_t *x, int rows, int cols, int b, uint64_t seed) {
    int sr = (rows + b - 1) / b, sc = (cols + b - 1) / b;
    x->w = malloc(sizeof(float) * (size_t)rows * cols);
    x->q = malloc((size_t)rows * cols);
    x->s = malloc(sizeof(float) * (size_t)sr * sc);
    /* Each block gets its own magnitude so the scales differ. */
    tu_fill(x->w, (size_t)rows * cols, seed, -1.0f, 1.0f);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            x->w[r * cols + c] *= (float)(1 + (r / b) * 3 + (c / b));
    quantize_fp8(x->q, x->s, x->w, rows, cols, b);
    int64_t wsh[2] = {rows, cols}, ssh[2] = {sr, sc};
    x->tq = tensor_view(x->q, DT_F8E4M3, DEV_CPU, 2, wsh);
    x->ts = tensor_view(x->s, DT_F32, DEV_CPU, 2, ssh);
}

static void free_fp8(fp8w_t *x) {
    free(x->w);
    free(x->q);
    free(x->s);
}

/* max |deq - w| / max |w| where deq uses the returned view. */
static double fp8_err(const wview_t *v, const float *w, int rows, int cols) {
    const uint8_t *q = v->data;
    int sc = (cols + v->block - 1) / v->block;
    double maxd = 0, maxw = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            double deq = fp8e4m3_to_f32(q[r * cols + c]) *
                         (double)v->scale[(r / v->block) * sc + c / v->block];
            maxd = fmax(maxd, fabs(deq - w[r * cols + c]));
            maxw = fmax(maxw, fabs((double)w[r * cols + c]));
        }
    return maxd / maxw;
}

/* fp8 e4m3 keeps 3 mantissa bits: round-to-nearest error is at most 2^-4
 * relative to each value, so at most 1/16 of the largest magnitude. */
#define TOL_FP8 (1.0 / 16.0)

static void test_fp8_scales(void) {
    fp8w_t a, b;
    make_fp8(&a, 300, 200, 128, 7);
    make_fp8(&b, 40, 24, 8, 8);
    uint16_t bf[6] = {0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0};
    int64_t bsh[2] = {2, 3};
    tensor_t tb = tensor_view(bf, DT_BF16, DEV_CPU, 2, bsh);
    float nan_s[4] = {NAN, 1, 1, 1};
    int64_t nsh[2] = {1, 1};
    uint8_t q1[4] = {0x38, 0x40, 0x44, 0x48};
    int64_t q1sh[2] = {2, 2};
    st_item_t items[] = {
        {"l.a.weight", a.tq},
        {"l.a.weight_scale_inv", a.ts},
        {"l.b.weight", b.tq},
        {"l.b.weight_scale_inv", b.ts},
        {"l.bf.weight", tb},
        {"l.bf.weight_scale_inv", tensor_view(nan_s, DT_F32, DEV_CPU, 2, nsh)},
        {"l.noscale.weight", tensor_view(q1, DT_F8E4M3, DEV_CPU, 2, q1sh)},
        {"l.nan.weight", tensor_view(q1, DT_F8E4M3, DEV_CPU, 2, q1sh)},
        {"l.nan.weight_scale_inv", tensor_view(nan_s, DT_F32, DEV_CPU, 2, nsh)},
    };
    char p[600];
    path_in(p, sizeof p, "fp8.safetensors");
    CU_ASSERT_FATAL(st_write(p, items, 9, NULL, 0) == MO_OK);
    st_file_t *f;
    CU_ASSERT_FATAL(st_open(&f, p) == MO_OK);

    tensor_t wt;
    wview_t v;
    float *scale = NULL;
    CU_ASSERT_FATAL(st_file_weight(f, "l.a.weight", 0, &wt, &v, &scale) == MO_OK);
    CU_ASSERT(v.block == 128 && v.scale == scale && v.dtype == DT_F8E4M3);
    CU_ASSERT(wt.shape[0] == 300 && wt.shape[1] == 200);
    CU_ASSERT(memcmp(scale, a.s, 6 * sizeof(float)) == 0);
    TU_ASSERT_CLOSE(fp8_err(&v, a.w, 300, 200), TOL_FP8, "fp8 dequant block 128");
    free(scale);

    /* Block 8 derived from the shapes, and the same block given explicitly. */
    for (int blk = 0; blk <= 8; blk += 8) {
        scale = NULL;
        CU_ASSERT_FATAL(st_file_weight(f, "l.b.weight", blk, &wt, &v, &scale) == MO_OK);
        CU_ASSERT(v.block == 8);
        TU_ASSERT_CLOSE(fp8_err(&v, b.w, 40, 24), TOL_FP8, "fp8 dequant block 8");
        free(scale);
    }
    CU_ASSERT(st_file_weight(f, "l.b.weight", 16, &wt, &v, &scale) == MO_EMALFORMED);
    CU_ASSERT(err_has("scale 'l.b.weight_scale_inv' is (5, 3) but weight (40, 24) with 16x16 "
                      "blocks needs (3, 2)"));
    CU_ASSERT(scale == NULL);
    CU_ASSERT(st_file_weight(f, "l.bf.weight", 0, &wt, &v, &scale) == MO_EMALFORMED);
    CU_ASSERT(err_has("weight 'l.bf.weight' is BF16 but has a scale tensor"));
    CU_ASSERT(st_file_weight(f, "l.noscale.weight", 0, &wt, &v, &scale) == MO_EMALFORMED);
    CU_ASSERT(err_has("fp8 weight 'l.noscale.weight' has no scale tensor "
                      "'l.noscale.weight_scale_inv'"));
    CU_ASSERT(st_file_weight(f, "l.nan.weight", 0, &wt, &v, &scale) == MO_EMALFORMED);
    CU_ASSERT(err_has("expected a finite number"));
    CU_ASSERT(st_file_weight(f, "l.a.weight_scale_inv", 0, &wt, &v, &scale) == MO_OK);
    CU_ASSERT(v.dtype == DT_F32 && v.scale == NULL && scale == NULL);
    CU_ASSERT(st_file_weight(f, "missing.weight", 0, &wt, &v, &scale) == MO_ENOTFOUND);
    st_close(&f);
    free_fp8(&a);
    free_fp8(&b);
}

/* ---- sharded checkpoints ---- */

static void write_index(const char *dir, const char *body) {
    char p[700];
    snprintf(p, sizeof p, "%s/%s", dir, ST_INDEX_NAME);
    CU_ASSERT_FATAL(write_bytes(p, body, strlen(body)) == 0);
}

/* Two shards: shard 1 holds the fp8 weight, shard 2 its scale and a bf16
 * tensor. */
static void make_shards(const char *dir, fp8w_t *x, void **bf) {
    char p[700];
    make_fp8(x, 130, 260, 128, 21);
    *bf = make_float(DT_BF16, 12, 22);
    int64_t sh[2] = {3, 4};
    st_item_t s1[1] = {{"m.w.weight", x->tq}};
    st_item_t s2[2] = {{"m.w.weight_scale_inv", x->ts},
                       {"m.n.weight", tensor_view(*bf, DT_BF16, DEV_CPU, 2, sh)}};
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    CU_ASSERT_FATAL(st_write(p, s1, 1, NULL, 0) == MO_OK);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    CU_ASSERT_FATAL(st_write(p, s2, 2, NULL, 0) == MO_OK);
}

static const char *g_good_index =
    "{\"metadata\": {\"total_size\": 33824},\n \"weight_map\": {\n"
    "  \"m.n.weight\": \"model-00002-of-00002.safetensors\",\n"
    "  \"m.w.weight\": \"model-00001-of-00002.safetensors\",\n"
    "  \"m.w.weight_scale_inv\": \"model-00002-of-00002.safetensors\"}}";

static void test_sharded(void) {
    char dir[600];
    path_in(dir, sizeof dir, "sharded");
    CU_ASSERT_FATAL(mkdir(dir, 0755) == 0);
    fp8w_t x;
    void *bf;
    make_shards(dir, &x, &bf);
    write_index(dir, g_good_index);

    st_checkpoint_t *ck = NULL;
    CU_ASSERT_FATAL(st_checkpoint_open(&ck, dir) == MO_OK);
    CU_ASSERT(st_checkpoint_num_shards(ck) == 2);
    CU_ASSERT(st_checkpoint_num_tensors(ck) == 3);
    CU_ASSERT(strstr(st_path(st_checkpoint_shard(ck, 0)), "model-00001-of-00002") != NULL);
    CU_ASSERT(strcmp(st_checkpoint_info(ck, 0)->name, "m.w.weight") == 0);
    /* Shard 2 in file order: the f32 scale (4-byte elements) before the bf16 tensor. */
    CU_ASSERT(strcmp(st_checkpoint_info(ck, 1)->name, "m.w.weight_scale_inv") == 0);
    CU_ASSERT(strcmp(st_checkpoint_info(ck, 2)->name, "m.n.weight") == 0);
    for (int i = 0; i < 3; i++)
        CU_ASSERT(st_checkpoint_find(ck, st_checkpoint_info(ck, i)->name) == i);
    tensor_t t;
    CU_ASSERT(st_checkpoint_get(ck, "m.n.weight", &t) == MO_OK);
    CU_ASSERT(t.dtype == DT_BF16 && memcmp(t.data, bf, 24) == 0);
    tensor_t t2 = st_checkpoint_tensor(ck, 2);
    CU_ASSERT(t2.data == t.data);
    CU_ASSERT(st_checkpoint_get(ck, "nope", &t) == MO_ENOTFOUND);
    CU_ASSERT(err_has("sharded: no tensor 'nope'"));

    /* Weight and scale live in different shards. */
    wview_t v;
    float *scale = NULL;
    CU_ASSERT_FATAL(st_checkpoint_weight(ck, "m.w.weight", 128, &t, &v, &scale) == MO_OK);
    CU_ASSERT(v.block == 128 && memcmp(scale, x.s, 2 * 3 * sizeof(float)) == 0);
    TU_ASSERT_CLOSE(fp8_err(&v, x.w, 130, 260), TOL_FP8, "sharded fp8 dequant");
    free(scale);
    st_checkpoint_close(&ck);
    CU_ASSERT(ck == NULL);

    /* The index file itself can be opened too. */
    char ip[700];
    snprintf(ip, sizeof ip, "%s/%s", dir, ST_INDEX_NAME);
    CU_ASSERT(st_checkpoint_open(&ck, ip) == MO_OK);
    st_checkpoint_close(&ck);
    free_fp8(&x);
    free(bf);
}

static void test_single_checkpoint(void) {
    char dir[600], p[700];
    path_in(dir, sizeof dir, "single");
    CU_ASSERT_FATAL(mkdir(dir, 0755) == 0);
    st_checkpoint_t *ck = NULL;
    CU_ASSERT(st_checkpoint_open(&ck, dir) == MO_ENOTFOUND);
    CU_ASSERT(err_has("holds neither model.safetensors.index.json nor model.safetensors"));
    float w[6] = {1.5f, -2, 3, 0.25f, 5, -6};
    int64_t sh[2] = {2, 3};
    st_item_t it[1] = {{"lm_head.weight", tensor_view(w, DT_F32, DEV_CPU, 2, sh)}};
    snprintf(p, sizeof p, "%s/%s", dir, ST_SINGLE_NAME);
    CU_ASSERT_FATAL(st_write(p, it, 1, NULL, 0) == MO_OK);
    for (int k = 0; k < 2; k++) {
        CU_ASSERT_FATAL(st_checkpoint_open(&ck, k ? p : dir) == MO_OK);
        CU_ASSERT(st_checkpoint_num_shards(ck) == 1 && st_checkpoint_num_tensors(ck) == 1);
        tensor_t t;
        wview_t v;
        float *scale = (float *)w;
        CU_ASSERT(st_checkpoint_weight(ck, "lm_head.weight", 0, &t, &v, &scale) == MO_OK);
        CU_ASSERT(scale == NULL && v.dtype == DT_F32 && memcmp(v.data, w, sizeof w) == 0);
        st_checkpoint_close(&ck);
    }
}

typedef struct {
    const char *index;           /* NULL: leave the good index */
    const char *shard2_override; /* non-NULL: rewrite shard 2 with an extra tensor */
    const char *expect;
    int code;
} index_case_t;

static void test_index_errors(void) {
    static const index_case_t cases[] = {
        {"{\"weight_map\": {\"m.w.weight\": \"model-00001-of-00002.safetensors\", "
         "\"m.w.weight_scale_inv\": \"model-00003-of-00002.safetensors\", "
         "\"m.n.weight\": \"model-00002-of-00002.safetensors\"}}",
         NULL, "shard 'model-00003-of-00002.safetensors'", MO_EIO},
        {"{\"weight_map\": {\"m.w.weight\": \"model-00001-of-00002.safetensors\", "
         "\"m.w.weight_scale_inv\": \"model-00002-of-00002.safetensors\", "
         "\"m.gone.weight\": \"model-00002-of-00002.safetensors\", "
         "\"m.n.weight\": \"model-00002-of-00002.safetensors\"}}",
         NULL, "tensor 'm.gone.weight' is not in its shard 'model-00002-of-00002.safetensors'",
         MO_EMALFORMED},
        {"{\"weight_map\": {\"m.w.weight\": \"model-00001-of-00002.safetensors\", "
         "\"m.w.weight_scale_inv\": \"model-00002-of-00002.safetensors\"}}",
         NULL,
         "shard 'model-00002-of-00002.safetensors' holds tensor 'm.n.weight' that the "
         "index does not name",
         MO_EMALFORMED},
        {"{\"weight_map\": {\"m.w.weight\": \"model-00001-of-00002.safetensors\", "
         "\"m.w.weight\": \"model-00001-of-00002.safetensors\", "
         "\"m.w.weight_scale_inv\": \"model-00002-of-00002.safetensors\", "
         "\"m.n.weight\": \"model-00002-of-00002.safetensors\"}}",
         NULL, "weight_map names tensor 'm.w.weight' twice", MO_EMALFORMED},
        {"{\"weight_map\": {\"m.w.weight\": \"../model-00001-of-00002.safetensors\"}}", NULL,
         "expected a file name in the same directory", MO_EMALFORMED},
        {"{\"weight_map\": {\"m.w.weight\": 3}}", NULL,
         "weight_map['m.w.weight'] is 3, expected a shard file name", MO_EMALFORMED},
        {"{\"metadata\": {}}", NULL, "missing \"weight_map\"", MO_EMALFORMED},
        {"{\"weight_map\": []}", NULL, "\"weight_map\" is not a non-empty object", MO_EMALFORMED},
        {"{\"weight_map\": {\"a\": ", NULL, "not valid JSON", MO_EMALFORMED},
        {NULL, "m.w.weight", "holds tensor 'm.w.weight' that the index assigns to another shard",
         MO_EMALFORMED},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        char dir[600], name[32];
        snprintf(name, sizeof name, "badidx%d", i);
        path_in(dir, sizeof dir, name);
        CU_ASSERT_FATAL(mkdir(dir, 0755) == 0);
        fp8w_t x;
        void *bf;
        make_shards(dir, &x, &bf);
        write_index(dir, cases[i].index ? cases[i].index : g_good_index);
        if (cases[i].shard2_override) {
            char p[700];
            snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
            st_item_t s2[2] = {{"m.w.weight_scale_inv", x.ts}, {cases[i].shard2_override, x.tq}};
            CU_ASSERT_FATAL(st_write(p, s2, 2, NULL, 0) == MO_OK);
            write_index(dir,
                        "{\"weight_map\": {\"m.w.weight\": \"model-00001-of-00002.safetensors\","
                        " \"m.w.weight_scale_inv\": \"model-00002-of-00002.safetensors\"}}");
        }
        st_checkpoint_t *ck = (st_checkpoint_t *)dir;
        int rc = st_checkpoint_open(&ck, dir);
        if (rc != cases[i].code)
            tu_report("index case %d: rc %d, expected %d (%s)", i, rc, cases[i].code,
                      mo_last_error());
        CU_ASSERT(rc == cases[i].code);
        CU_ASSERT(ck == NULL);
        CU_ASSERT(err_has(cases[i].expect));
        CU_ASSERT(err_has(name)); /* the message names the checkpoint's files */
        free_fp8(&x);
        free(bf);
    }
}

/* ---- malformed files ---- */

typedef struct {
    const char *header;
    size_t data_len;
    uint64_t forced_len; /* 0: the header's real length */
    const char *expect;
} bad_case_t;

#define T_(name, rest) "\"" name "\":{" rest "}"

static const bad_case_t g_bad[] = {
    {"{" T_("model.layers.0.mlp.gate.weight",
            "\"dtype\":\"BF16\",\"shape\":[8,16],\"data_offsets\":[0,100]") "}",
     100, 0,
     "model.safetensors: tensor 'model.layers.0.mlp.gate.weight': data_offsets [0, 100] hold 100 "
     "bytes but BF16 (8, 16) needs 256"},
    {"{}", 0, (uint64_t)1 << 40, "header length 1099511627776 exceeds the limit"},
    {"{}", 0, 1000, "header length 1000 runs past the end of the file"},
    {"{}", 0, 1, "header length 1 is below the minimum"},
    {"{\"a\":", 0, 0, "header is not valid JSON"},
    {"[1, 2]", 0, 0, "header does not start with '{'"},
    {"{} x", 0, 0, "header has data after its JSON object"},
    {"{}\x01 ", 0, 0, "is not valid UTF-8 JSON text"},
    {"{\"\xff\":1}", 0, 0, "header byte 2 (0xff) is not valid UTF-8"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]") "}", 8, 0,
     "tensor 'a': data_offsets [0, 16] run past the data section (8 bytes)"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]") "}", 8, 0,
     "tensor 'a': data_offsets [8, 0] end before they begin"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "," T_(
         "b", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]") "}",
     12, 0, "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "," T_(
         "b", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]") "}",
     20, 0, "data bytes [8, 12) belong to no tensor (a hole before tensor 'b')"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]") "}", 12, 0,
     "data bytes [0, 4) belong to no tensor"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "}", 12, 0,
     "data bytes [8, 12) after the last tensor belong to no tensor"},
    {"{" T_("a", "\"dtype\":\"F8_E5M2\",\"shape\":[2],\"data_offsets\":[0,2]") "}", 2, 0,
     "tensor 'a': unknown dtype 'F8_E5M2' (supported: F32, BF16, F16, F8_E4M3"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2,-3],\"data_offsets\":[0,0]") "}", 0, 0,
     "tensor 'a': shape[1] is -3, expected a non-negative integer"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,0]") "}", 0, 0,
     "shape[0] is 2.5, expected a non-negative integer"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,0]") "}", 0, 0,
     "shape[0] is the string \"2\""},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,4]") "}", 4, 0,
     "shape has 7 dimensions, at most 6"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],"
                 "\"data_offsets\":[0,4]") "}",
     4, 0, "tensor 'a': F32 (1099511627776, 1099511627776) is too large"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18014398509481984]") "}", 4,
     0, "data_offsets[1] is 18014398509481984, expected a non-negative integer"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]") "}", 4, 0,
     "\"data_offsets\" is not an array of 2 integers"},
    {"{" T_("a", "\"shape\":[1],\"data_offsets\":[0,4]") "}", 4, 0,
     "tensor 'a': missing \"dtype\""},
    {"{" T_("a", "\"dtype\":\"F32\",\"data_offsets\":[0,4]") "}", 4, 0, "missing \"shape\""},
    {"{" T_("a", "\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]") "}", 4, 0,
     "\"dtype\" is not a string"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1") "}", 4, 0,
     "tensor 'a': unexpected key 'x'"},
    {"{" T_("a", "\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]") "}", 4,
     0, "tensor 'a': key 'dtype' appears twice"},
    {"{\"a\":[1]}", 0, 0, "tensor 'a': entry is not an object"},
    {"{" T_("", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]") "}", 4, 0,
     "a tensor has an empty name"},
    {"{" T_("a", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]") "," T_(
         "a", "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]") "}",
     8, 0, "tensor 'a' appears twice in the header"},
    {"{\"__metadata__\":{\"k\":1}}", 0, 0, "\"__metadata__\" key 'k' is 1, expected a string"},
    {"{\"__metadata__\":[]}", 0, 0, "\"__metadata__\" is not an object"},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, 0, "\"__metadata__\" appears twice"},
    {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, 0, "key 'k' appears twice"},
    {"{}", 5, 0, "data bytes [0, 5) after the last tensor"},
};

static void test_bad_headers(void) {
    char p[600];
    path_in(p, sizeof p, "model.safetensors");
    int n = (int)(sizeof g_bad / sizeof g_bad[0]);
    for (int i = 0; i < n; i++) {
        write_raw(p, g_bad[i].header, g_bad[i].data_len, g_bad[i].forced_len);
        st_file_t *f = (st_file_t *)p;
        mo_clear_error();
        int rc = st_open(&f, p);
        if (rc != MO_EMALFORMED)
            tu_report("bad case %d: rc %d (%s)", i, rc, mo_last_error());
        CU_ASSERT(rc == MO_EMALFORMED);
        CU_ASSERT(f == NULL);
        CU_ASSERT(err_has(g_bad[i].expect));
        CU_ASSERT(err_has(p));
    }
    /* Too short for the length, and missing altogether. */
    CU_ASSERT_FATAL(write_bytes(p, "\x02\0\0", 3) == 0);
    st_file_t *f;
    CU_ASSERT(st_open(&f, p) == MO_EMALFORMED && err_has("file is 3 bytes, too short"));
    CU_ASSERT(st_open(&f, g_dir) == MO_EIO && err_has("not a regular file"));
    path_in(p, sizeof p, "missing.safetensors");
    CU_ASSERT(st_open(&f, p) == MO_EIO && err_has("missing.safetensors: cannot open"));
}

/* A small valid image for the truncation and fuzz loops. */
static uint8_t *valid_image(size_t *n) {
    st_item_t items[NT];
    void *bufs[NT];
    make_items(items, bufs, 300);
    st_meta_t meta[1] = {{"format", "pt"}};
    char p[600];
    path_in(p, sizeof p, "fuzzbase.safetensors");
    CU_ASSERT_FATAL(st_write(p, items, NT, meta, 1) == MO_OK);
    free_bufs(bufs, NT);
    return read_bytes(p, n);
}

/* Reads every byte of every tensor an accepted image exposes (ASan checks the bounds). */
static unsigned touch_all(const st_file_t *f) {
    unsigned sum = 0;
    for (int i = 0; i < st_count(f); i++) {
        tensor_t t = st_tensor(f, i);
        const uint8_t *b = t.data;
        for (size_t k = 0; k < tensor_nbytes(&t); k++)
            sum += b[k];
    }
    return sum;
}

static void test_truncation(void) {
    size_t n;
    uint8_t *img = valid_image(&n);
    CU_ASSERT_FATAL(img != NULL && n > 64);
    char p[600];
    path_in(p, sizeof p, "trunc.safetensors");
    int failures = 0;
    for (size_t len = 0; len < n; len++) {
        /* Exactly sized heap copy, so any read past the end trips ASan. */
        uint8_t *copy = malloc(len ? len : 1);
        memcpy(copy, img, len);
        st_file_t *f = NULL;
        int rc = st_open_buffer(&f, copy, len, "trunc");
        failures += rc == MO_EMALFORMED && f == NULL && strstr(mo_last_error(), "trunc") != NULL;
        free(copy);
        CU_ASSERT_FATAL(write_bytes(p, img, len) == 0);
        rc = st_open(&f, p);
        failures += rc == MO_EMALFORMED && f == NULL && strstr(mo_last_error(), p) != NULL;
    }
    CU_ASSERT(failures == (int)(2 * n));
    st_file_t *f;
    CU_ASSERT(st_open_buffer(&f, img, n, "whole") == MO_OK);
    CU_ASSERT(st_count(f) == NT && touch_all(f) > 0);
    st_close(&f);
    free(img);
}

/* Random byte flips in the length and header: open must fail cleanly or
 * succeed with every view in bounds; never crash. */
static void test_fuzz_header(void) {
    size_t n;
    uint8_t *img = valid_image(&n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | img[i];
    size_t span = 8 + (size_t)hlen;
    int ok = 0, bad = 0;
    unsigned sink = 0;
    for (uint64_t it = 0; it < 4000; it++) {
        uint8_t *copy = malloc(n);
        memcpy(copy, img, n);
        uint32_t r[4];
        rng_block(r, 2024, 0xf022, it);
        int flips = 1 + (int)(r[0] % 4);
        for (int k = 0; k < flips; k++) {
            uint32_t q[4];
            rng_block(q, 2024, 0xf023, it * 8 + (uint64_t)k);
            size_t pos = q[0] % 5 == 0 ? q[1] % 8 : q[1] % span; /* 1 in 5 hits the length */
            copy[pos] = (q[2] & 1) ? (uint8_t)(copy[pos] ^ (1u << (q[3] % 8))) : (uint8_t)q[3];
        }
        st_file_t *f = NULL;
        mo_clear_error();
        int rc = st_open_buffer(&f, copy, n, "fuzz");
        if (rc == MO_OK) {
            ok++;
            sink += touch_all(f);
            st_close(&f);
        } else {
            bad += rc == MO_EMALFORMED && mo_last_error()[0] != '\0' && f == NULL;
        }
        free(copy);
    }
    CU_ASSERT(ok + bad == 4000); /* every rejection is MO_EMALFORMED with a message */
    CU_ASSERT(bad > 1000);       /* the flips do reach the validator */
    (void)sink;
    free(img);
}

int main(void) {
    if (tu_tmpdir(g_dir, sizeof g_dir) != 0)
        return 2;
    CU_TestInfo tests[] = {
        {"roundtrip of several dtypes and metadata", test_roundtrip},
        {"empty file", test_empty_file},
        {"writer rejects bad input", test_write_errors},
        {"fp8 block scales", test_fp8_scales},
        {"sharded checkpoint", test_sharded},
        {"single-file checkpoint", test_single_checkpoint},
        {"index errors", test_index_errors},
        {"malformed headers", test_bad_headers},
        {"every truncation", test_truncation},
        {"header byte flips", test_fuzz_header},
        CU_TEST_INFO_NULL,
    };
    int rc = tu_main("safetensors", tests);
    tu_rmtree(g_dir);
    return rc;
}
