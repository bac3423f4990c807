/* dataset: JSONL prompt records (parsed with cJSON into one string pool) and
 * built-in tasks behind one cursor-driven training stream and an eval split. */
#include "learner/dataset.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define WHY_CAP 200

typedef struct rec {
    uint64_t line; /* 1-based */
    size_t prompt; /* pool offsets */
    size_t answer;
    size_t kv; /* first entry in kv_off / kvs */
    size_t n_kv;
} rec_t;

struct dataset {
    bool is_task;
    task_opts_t task;
    dataset_opts_t opts;
    char *path;
    /* JSONL records */
    char *pool; /* NUL-terminated strings; offset 0 is "" */
    size_t pool_len, pool_cap;
    rec_t *recs; /* (n_recs) */
    size_t n_recs, recs_cap;
    size_t *kv_off; /* (n_kv, 2): key and value offsets */
    size_t n_kv, kv_cap;
    moerl_reward_kv_t *kvs; /* (n_kv), pointers into pool once loading is done */
    uint64_t *eval_ids;     /* (n_eval) record numbers, ascending */
    uint64_t *train_ids;    /* (n_train) record numbers, ascending */
    uint64_t *perm;         /* (n_train) the order of perm_epoch */
    uint64_t perm_epoch;
    bool perm_valid;
    uint64_t n_eval, n_train;
    /* stream */
    dataset_cursor_t cur;
    dataset_stats_t stats;
    uint64_t fingerprint;
};

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

/* ------------------------------------------------------------------------
 * Storage
 * ---------------------------------------------------------------------- */

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap)
        return MO_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return mo_errorf(MO_ENOMEM, "dataset: out of memory (%zu bytes)", c * elem);
    *p = q;
    *cap = c;
    return MO_OK;
}

static int pool_add(dataset_t *d, const char *s, size_t n, size_t *off) {
    TRY(grow((void **)&d->pool, &d->pool_cap, d->pool_len + n + 1, 1));
    memcpy(d->pool + d->pool_len, s, n);
    d->pool[d->pool_len + n] = '\0';
    *off = d->pool_len;
    d->pool_len += n + 1;
    return MO_OK;
}

/* ------------------------------------------------------------------------
 * One JSONL line
 * ---------------------------------------------------------------------- */

static const char *json_kind(const cJSON *v) {
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsNull(v))
        return "null";
    if (cJSON_IsArray(v))
        return "an array";
    return "an object";
}

/* The shortest %g spelling that reads back as v. */
static void fmt_number(double v, char *buf, size_t cap) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

/* A scalar field as text; false for null, arrays and objects. */
static bool scalar_text(const cJSON *v, bool allow_bool, const char **s, char *numbuf, size_t cap) {
    if (cJSON_IsString(v)) {
        *s = v->valuestring;
    } else if (cJSON_IsNumber(v)) {
        fmt_number(v->valuedouble, numbuf, cap);
        *s = numbuf;
    } else if (allow_bool && cJSON_IsBool(v)) {
        *s = cJSON_IsTrue(v) ? "true" : "false";
    } else {
        return false;
    }
    return true;
}

static int why(char *buf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int why(char *buf, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, WHY_CAP, fmt, ap);
    va_end(ap);
    return MO_EMALFORMED;
}

/* Checks the object's fields: prompt, answer, and the extra fields' types. */
static int check_fields(const cJSON *obj, char *reason) {
    const cJSON *prompt = NULL;
    for (const cJSON *f = obj->child; f; f = f->next) {
        for (const cJSON *g = obj->child; g != f; g = g->next)
            if (!strcmp(g->string, f->string))
                return why(reason, "field \"%.60s\" appears twice", f->string);
        if (!strcmp(f->string, "prompt")) {
            prompt = f;
            if (!cJSON_IsString(f))
                return why(reason, "\"prompt\" must be a string, got %s", json_kind(f));
            if (!f->valuestring[0])
                return why(reason, "\"prompt\" is empty");
        } else if (!strcmp(f->string, "answer")) {
            if (!cJSON_IsString(f) && !cJSON_IsNumber(f))
                return why(reason, "\"answer\" must be a string or a number, got %s", json_kind(f));
        } else if (!cJSON_IsString(f) && !cJSON_IsNumber(f) && !cJSON_IsBool(f)) {
            return why(reason,
                       "field \"%.60s\" is %s; extra fields must be strings, numbers or "
                       "booleans",
                       f->string, json_kind(f));
        }
    }
    if (!prompt)
        return why(reason, "no \"prompt\" field");
    return MO_OK;
}

static int store_record(dataset_t *d, const cJSON *obj, uint64_t lineno) {
    rec_t r = {lineno, 0, 0, d->n_kv, 0};
    char num[40];
    const char *s = "";
    for (const cJSON *f = obj->child; f; f = f->next) {
        scalar_text(f, true, &s, num, sizeof num);
        if (!strcmp(f->string, "prompt")) {
            TRY(pool_add(d, s, strlen(s), &r.prompt));
        } else if (!strcmp(f->string, "answer")) {
            TRY(pool_add(d, s, strlen(s), &r.answer));
        } else {
            TRY(grow((void **)&d->kv_off, &d->kv_cap, d->n_kv + 1, 2 * sizeof(size_t)));
            TRY(pool_add(d, f->string, strlen(f->string), &d->kv_off[2 * d->n_kv]));
            TRY(pool_add(d, s, strlen(s), &d->kv_off[2 * d->n_kv + 1]));
            d->n_kv++;
            r.n_kv++;
        }
    }
    TRY(grow((void **)&d->recs, &d->recs_cap, d->n_recs + 1, sizeof(rec_t)));
    d->recs[d->n_recs++] = r;
    return MO_OK;
}

static bool blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return false;
    return true;
}

/* MO_EMALFORMED with the reason in reason[0..WHY_CAP) for a bad line. */
static int parse_line(dataset_t *d, const char *line, size_t len, uint64_t lineno, char *reason) {
    const char *end = NULL;
    cJSON *obj = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    if (!obj) {
        size_t col = end && end >= line ? (size_t)(end - line) + 1 : 1;
        return why(reason, "invalid JSON near column %zu", col);
    }
    int rc = MO_OK;
    size_t at = (size_t)(end - line);
    while (at < len && blank(line + at, 1))
        at++;
    if (at < len)
        rc = why(reason, "text after the JSON value at column %zu", at + 1);
    else if (!cJSON_IsObject(obj))
        rc = why(reason, "expected a JSON object, got %s", json_kind(obj));
    else
        rc = check_fields(obj, reason);
    if (rc == MO_OK)
        rc = store_record(d, obj, lineno);
    cJSON_Delete(obj);
    return rc;
}

static int read_lines(dataset_t *d, FILE *f) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int rc = MO_OK;
    d->fingerprint = FNV_OFFSET;
    while (rc == MO_OK && (got = getline(&line, &cap, f)) >= 0) {
        size_t len = (size_t)got;
        d->fingerprint = fnv(d->fingerprint, line, len);
        uint64_t lineno = ++d->stats.lines;
        const char *s = line;
        if (lineno == 1 && len >= 3 && !memcmp(s, "\xef\xbb\xbf", 3)) { /* UTF-8 byte order mark */
            s += 3;
            len -= 3;
        }
        if (blank(s, len)) {
            d->stats.blank++;
            continue;
        }
        char reason[WHY_CAP];
        rc = parse_line(d, s, len, lineno, reason);
        if (rc == MO_EMALFORMED) {
            char msg[WHY_CAP + 64];
            snprintf(msg, sizeof msg, "%s:%" PRIu64 ": %s", d->path, lineno, reason);
            if (!d->opts.skip_malformed) {
                rc = mo_errorf(MO_EMALFORMED, "%s (data.skip_malformed skips such lines)", msg);
                break;
            }
            if (d->stats.skipped++ == 0) {
                size_t n = strlen(msg), cap = sizeof d->stats.first_error;
                n = n < cap ? n : cap - 1;
                memcpy(d->stats.first_error, msg, n);
                d->stats.first_error[n] = '\0';
            }
            rc = MO_OK;
        }
    }
    if (rc == MO_OK && ferror(f))
        rc = mo_errorf(MO_EIO, "dataset %s: read failed: %s", d->path, strerror(errno));
    free(line);
    return rc;
}

/* ------------------------------------------------------------------------
 * Splits and shuffling
 * ---------------------------------------------------------------------- */

/* Fisher-Yates over a[0..n) with draws from (seed, stream). */
static void shuffle(uint64_t *a, uint64_t n, uint64_t seed, uint64_t stream) {
    for (uint64_t i = n; i > 1; i--) {
        uint32_t b[4];
        rng_block(b, seed, stream, i);
        uint64_t j = (((uint64_t)b[0] << 32) | b[1]) % i;
        uint64_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static int make_splits(dataset_t *d) {
    uint64_t n = d->n_recs;
    if (n == 0)
        return mo_errorf(MO_EINVAL,
                         "dataset %s: no records (%" PRIu64 " lines, %" PRIu64
                         " skipped as malformed)",
                         d->path, d->stats.lines, d->stats.skipped);
    if (d->opts.eval_size < 0 || (uint64_t)d->opts.eval_size >= n)
        return mo_errorf(MO_EINVAL,
                         "dataset %s: data.eval_size %" PRId64 " leaves no training "
                         "record of %" PRIu64,
                         d->path, d->opts.eval_size, n);
    d->n_eval = (uint64_t)d->opts.eval_size;
    d->n_train = n - d->n_eval;
    uint64_t *order = malloc(n * sizeof *order);
    unsigned char *is_eval = calloc(n, 1);
    d->eval_ids = malloc((d->n_eval ? d->n_eval : 1) * sizeof(uint64_t));
    d->train_ids = malloc(d->n_train * sizeof(uint64_t));
    d->perm = malloc(d->n_train * sizeof(uint64_t));
    int rc = MO_OK;
    if (!order || !is_eval || !d->eval_ids || !d->train_ids || !d->perm) {
        rc = mo_errorf(MO_ENOMEM, "dataset %s: out of memory for %" PRIu64 " records", d->path, n);
    } else {
        for (uint64_t i = 0; i < n; i++)
            order[i] = i;
        shuffle(order, n, d->opts.seed, rng_stream_id("data.eval", 0, 0));
        for (uint64_t i = 0; i < d->n_eval; i++)
            is_eval[order[i]] = 1;
        uint64_t e = 0, t = 0;
        for (uint64_t i = 0; i < n; i++) {
            if (is_eval[i])
                d->eval_ids[e++] = i;
            else
                d->train_ids[t++] = i;
        }
    }
    free(order);
    free(is_eval);
    return rc;
}

static void ensure_perm(dataset_t *d, uint64_t epoch) {
    if (d->perm_valid && d->perm_epoch == epoch)
        return;
    for (uint64_t i = 0; i < d->n_train; i++)
        d->perm[i] = i;
    if (d->opts.shuffle)
        shuffle(d->perm, d->n_train, d->opts.seed, rng_stream_id("data.shuffle", epoch, 0));
    d->perm_epoch = epoch;
    d->perm_valid = true;
}

/* ------------------------------------------------------------------------
 * Open, close
 * ---------------------------------------------------------------------- */

static int finish_kvs(dataset_t *d) {
    d->kvs = malloc((d->n_kv ? d->n_kv : 1) * sizeof *d->kvs);
    if (!d->kvs)
        return mo_errorf(MO_ENOMEM, "dataset %s: out of memory", d->path);
    for (size_t i = 0; i < d->n_kv; i++) {
        d->kvs[i].key = d->pool + d->kv_off[2 * i];
        d->kvs[i].value = d->pool + d->kv_off[2 * i + 1];
    }
    return MO_OK;
}

static int dataset_alloc(const char *path, const dataset_opts_t *o, dataset_t **out) {
    dataset_t *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(path))) {
        free(d);
        return mo_errorf(MO_ENOMEM, "dataset: out of memory");
    }
    d->opts = *o;
    *out = d;
    return MO_OK;
}

int dataset_open_jsonl(const char *path, const dataset_opts_t *o, dataset_t **out) {
    *out = NULL;
    dataset_t *d = NULL;
    TRY(dataset_alloc(path, o, &d));
    size_t empty;
    int rc = pool_add(d, "", 0, &empty); /* offset 0: the "" of records without an answer */
    FILE *f = NULL;
    if (rc == MO_OK && !(f = fopen(path, "rb")))
        rc = mo_errorf(MO_EIO, "dataset %s: cannot open: %s", path, strerror(errno));
    if (rc == MO_OK)
        rc = read_lines(d, f);
    if (f)
        fclose(f);
    if (rc == MO_OK)
        rc = finish_kvs(d);
    if (rc == MO_OK)
        rc = make_splits(d);
    if (rc < 0) {
        dataset_destroy(&d);
        return rc;
    }
    d->stats.records = d->n_recs;
    *out = d;
    return MO_OK;
}

int dataset_open_task(const task_opts_t *t, const dataset_opts_t *o, dataset_t **out) {
    *out = NULL;
    TRY(task_opts_check(t));
    if (o->eval_size < 0)
        return mo_errorf(MO_EINVAL, "dataset: data.eval_size %" PRId64 " is negative",
                         o->eval_size);
    task_item_t probe;
    TRY(task_generate(t, o->seed, TASK_SPLIT_TRAIN, 0, &probe));
    if (o->eval_size > 0)
        TRY(task_generate(t, o->seed, TASK_SPLIT_EVAL, 0, &probe));
    dataset_t *d = NULL;
    TRY(dataset_alloc(t->kind == CFG_TASK_ARITH ? "task:arith" : "task:sort", o, &d));
    d->is_task = true;
    d->task = *t;
    d->n_eval = (uint64_t)o->eval_size;
    d->n_train = UINT64_MAX;
    char desc[256];
    int n = snprintf(desc, sizeof desc, "%d:%d:%d:%s:%d:%d:%d:%s:%d", (int)t->kind, t->min_digits,
                     t->max_digits, t->ops, t->negative, t->min_len, t->max_len, t->alphabet,
                     t->eval_permille);
    d->fingerprint = fnv(FNV_OFFSET, desc, (size_t)n);
    *out = d;
    return MO_OK;
}

int dataset_open_config(const moerl_config_t *cfg, dataset_t **out) {
    dataset_opts_t o = {(uint64_t)cfg->run.seed, cfg->data.shuffle, cfg->data.skip_malformed,
                        cfg->data.eval_size};
    if (cfg->data.task == CFG_TASK_JSONL) {
        if (!cfg->data.path || !cfg->data.path[0])
            return mo_errorf(MO_ECONFIG, "data.path: required when data.task is jsonl");
        return dataset_open_jsonl(cfg->data.path, &o, out);
    }
    task_opts_t t;
    TRY(task_opts_from_config(cfg, &t));
    return dataset_open_task(&t, &o, out);
}

void dataset_destroy(dataset_t **pd) {
    dataset_t *d = *pd;
    if (!d)
        return;
    free(d->path);
    free(d->pool);
    free(d->recs);
    free(d->kv_off);
    free(d->kvs);
    free(d->eval_ids);
    free(d->train_ids);
    free(d->perm);
    free(d);
    *pd = NULL;
}

/* ------------------------------------------------------------------------
 * Access
 * ---------------------------------------------------------------------- */

uint64_t dataset_train_size(const dataset_t *d) {
    return d->n_train;
}
uint64_t dataset_eval_size(const dataset_t *d) {
    return d->n_eval;
}
const dataset_stats_t *dataset_stats(const dataset_t *d) {
    return &d->stats;
}
uint64_t dataset_fingerprint(const dataset_t *d) {
    return d->fingerprint;
}

const char *dataset_verifier(const dataset_t *d) {
    return d->is_task ? task_verifier(d->task.kind) : NULL;
}

static void record_item(const dataset_t *d, uint64_t id, dataset_item_t *it) {
    const rec_t *r = &d->recs[id];
    memset(it, 0, sizeof *it);
    it->id = id;
    it->line = r->line;
    it->prompt = d->pool + r->prompt;
    it->answer = d->pool + r->answer;
    it->extra = d->kvs + r->kv;
    it->n_extra = r->n_kv;
}

static int task_item(const dataset_t *d, task_split_t split, uint64_t index, dataset_item_t *it) {
    memset(it, 0, sizeof *it);
    TRY(task_generate(&d->task, d->opts.seed, split, index, &it->task));
    it->id = index;
    it->prompt = it->task.prompt;
    it->answer = it->task.answer;
    it->extra = NULL;
    it->n_extra = 0;
    return MO_OK;
}

int dataset_at(dataset_t *d, dataset_cursor_t c, dataset_item_t *item) {
    if (d->is_task) {
        if (c.epoch != 0)
            return mo_errorf(MO_EINVAL, "dataset %s: a task stream has only epoch 0, got %" PRIu64,
                             d->path, c.epoch);
        return task_item(d, TASK_SPLIT_TRAIN, c.pos, item);
    }
    if (c.pos >= d->n_train)
        return mo_errorf(MO_EINVAL,
                         "dataset %s: position %" PRIu64 " past the %" PRIu64
                         " training records of an epoch",
                         d->path, c.pos, d->n_train);
    ensure_perm(d, c.epoch);
    record_item(d, d->train_ids[d->perm[c.pos]], item);
    return MO_OK;
}

int dataset_next(dataset_t *d, dataset_item_t *item) {
    TRY(dataset_at(d, d->cur, item));
    d->cur.pos++;
    if (!d->is_task && d->cur.pos == d->n_train) {
        d->cur.epoch++;
        d->cur.pos = 0;
    }
    return MO_OK;
}

int dataset_eval(const dataset_t *d, uint64_t i, dataset_item_t *item) {
    if (i >= d->n_eval)
        return mo_errorf(MO_EINVAL, "dataset %s: eval item %" PRIu64 " of %" PRIu64, d->path, i,
                         d->n_eval);
    if (d->is_task)
        return task_item(d, TASK_SPLIT_EVAL, i, item);
    record_item(d, d->eval_ids[i], item);
    return MO_OK;
}

dataset_cursor_t dataset_tell(const dataset_t *d) {
    return d->cur;
}

int dataset_seek(dataset_t *d, dataset_cursor_t c) {
    if (d->is_task) {
        if (c.epoch != 0)
            return mo_errorf(MO_EINVAL, "dataset %s: a task stream has only epoch 0, got %" PRIu64,
                             d->path, c.epoch);
        d->cur = c;
        return MO_OK;
    }
    if (c.pos > d->n_train)
        return mo_errorf(MO_EINVAL,
                         "dataset %s: cursor position %" PRIu64 " past the %" PRIu64
                         " training records of an epoch (a different file?)",
                         d->path, c.pos, d->n_train);
    if (c.pos == d->n_train) {
        c.epoch++;
        c.pos = 0;
    }
    d->cur = c;
    return MO_OK;
}
