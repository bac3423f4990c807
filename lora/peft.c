/* peft: saving and loading adapters in the Hugging Face PEFT layout. */
#include "lora/peft.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "core/status.h"

#define SUFFIX_A ".lora_A.weight"
#define SUFFIX_B ".lora_B.weight"
#define SUFFIX_SAVE ".modules_to_save.default.weight"
#define SUFFIX_WEIGHT ".weight"

/* ---- paths and files ---------------------------------------------------- */

static char *join(const char *a, const char *sep, const char *b) {
    size_t na = strlen(a), ns = strlen(sep), nb = strlen(b);
    char *s = malloc(na + ns + nb + 1);
    if (s) {
        memcpy(s, a, na);
        memcpy(s + na, sep, ns);
        memcpy(s + na + ns, b, nb + 1);
    }
    return s;
}

/* The directory holding path (path without trailing slashes). */
static char *parent_of(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    while (n > 0 && path[n - 1] != '/')
        n--;
    if (n == 0)
        return join(".", "", "");
    while (n > 1 && path[n - 1] == '/')
        n--;
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, path, n);
        s[n] = '\0';
    }
    return s;
}

static int fsync_path(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return mo_errorf(MO_EIO, "cannot open %s to sync it: %s", path, strerror(errno));
    int rc = fsync(fd) == 0 ? MO_OK : mo_errorf(MO_EIO, "fsync %s: %s", path, strerror(errno));
    close(fd);
    return rc;
}

/* Creates or truncates path with data, fsynced. */
static int write_synced(const char *path, const char *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return mo_errorf(MO_EIO, "cannot create %s: %s", path, strerror(errno));
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = errno;
            close(fd);
            return mo_errorf(MO_EIO, "cannot write %s: %s", path, strerror(e));
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return mo_errorf(MO_EIO, "fsync %s: %s", path, strerror(e));
    }
    if (close(fd) != 0)
        return mo_errorf(MO_EIO, "cannot close %s: %s", path, strerror(errno));
    return MO_OK;
}

/* dir/name replaced atomically: a synced temporary, rename, synced dir. */
static int write_atomic(const char *dir, const char *name, const char *data, size_t n) {
    char *path = join(dir, "/", name), tmp[64];
    snprintf(tmp, sizeof tmp, ".tmp.%ld", (long)getpid());
    char *tpath = path ? join(path, "", tmp) : NULL;
    int rc = MO_OK;
    if (!path || !tpath)
        rc = mo_errorf(MO_ENOMEM, "out of memory");
    if (rc == MO_OK)
        rc = write_synced(tpath, data, n);
    if (rc == MO_OK && rename(tpath, path) != 0)
        rc = mo_errorf(MO_EIO, "cannot rename %s to %s: %s", tpath, path, strerror(errno));
    if (rc == MO_OK)
        rc = fsync_path(dir);
    if (rc < 0 && tpath)
        unlink(tpath);
    free(path);
    free(tpath);
    return rc;
}

static int read_whole(const char *path, char **out, size_t *n) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return mo_errorf(MO_EIO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        len += fread(buf + len, 1, cap - len, fp);
        if (len < cap)
            break;
        if (cap >= ((size_t)64 << 20)) {
            free(buf);
            fclose(fp);
            return mo_errorf(MO_EMALFORMED, "%s: larger than 64 MiB, not an adapter config", path);
        }
        char *nb = realloc(buf, 2 * cap + 1);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    int err = ferror(fp);
    fclose(fp);
    if (!buf)
        return mo_errorf(MO_ENOMEM, "out of memory reading %s", path);
    if (err) {
        free(buf);
        return mo_errorf(MO_EIO, "cannot read %s", path);
    }
    buf[len] = '\0';
    *out = buf;
    *n = len;
    return MO_OK;
}

/* ---- adapter_config.json ------------------------------------------------ */

/* The shortest decimal that reads back as f, as a double. */
static double shortest(float f) {
    char b[40];
    for (int p = 6; p <= 9; p++) {
        snprintf(b, sizeof b, "%.*g", p, (double)f);
        if ((float)strtod(b, NULL) == f)
            break;
    }
    return strtod(b, NULL);
}

/* 1 when tensor t of ad is a full tensor (lora_adapter_add_full). */
static int is_full(const lora_adapter_t *ad, int t) {
    return t >= ad->n_tensors - ad->n_full;
}

/* The file key of tensor t: "base_model.model.<name>" for A and B; for a full tensor
 * "<module>.weight", PEFT's "base_model.model.<module>.modules_to_save.default.weight". */
static char *key_of(const lora_adapter_t *ad, int t) {
    const char *name = ad->tensors[t].name;
    if (!is_full(ad, t))
        return join(PEFT_KEY_PREFIX, "", name);
    size_t n = strlen(name), nw = strlen(SUFFIX_WEIGHT);
    if (n > nw && strcmp(name + n - nw, SUFFIX_WEIGHT) == 0)
        n -= nw;
    size_t np = strlen(PEFT_KEY_PREFIX), ns = strlen(SUFFIX_SAVE);
    char *k = malloc(np + n + ns + 1);
    if (!k)
        return NULL;
    memcpy(k, PEFT_KEY_PREFIX, np);
    memcpy(k + np, name, n);
    memcpy(k + np + n, SUFFIX_SAVE, ns + 1);
    return k;
}

/* The stored shape of tensor t: a full tensor (n, 1) is the vector (n). */
static int stored_shape(const lora_adapter_t *ad, int t, int64_t shape[2]) {
    const lora_tensor_t *lt = &ad->tensors[t];
    shape[0] = lt->shape[0];
    shape[1] = lt->shape[1];
    return is_full(ad, t) && lt->shape[1] == 1 ? 1 : 2;
}

/* The modules_to_save list: each full tensor's module path without ".weight" and
 * without a leading "model.layers.<N>." ("mlp.gate", "input_layernorm", "model.norm"),
 * distinct, in first-seen order; NULL (JSON null) when there are none. */
static cJSON *modules_to_save_json(const lora_adapter_t *ad) {
    if (ad->n_full == 0)
        return cJSON_CreateNull();
    cJSON *a = cJSON_CreateArray();
    for (int t = ad->n_tensors - ad->n_full; a && t < ad->n_tensors; t++) {
        const char *s = ad->tensors[t].name;
        if (strncmp(s, "model.layers.", 13) == 0) {
            const char *p = s + 13;
            while (*p >= '0' && *p <= '9')
                p++;
            if (p > s + 13 && *p == '.')
                s = p + 1;
        }
        char buf[512];
        size_t n = strlen(s), nw = strlen(SUFFIX_WEIGHT);
        if (n > nw && strcmp(s + n - nw, SUFFIX_WEIGHT) == 0)
            n -= nw;
        snprintf(buf, sizeof buf, "%.*s", (int)n, s);
        int dup = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, a) dup |= strcmp(it->valuestring, buf) == 0;
        if (!dup && !cJSON_AddItemToArray(a, cJSON_CreateString(buf))) {
            cJSON_Delete(a);
            a = NULL;
        }
    }
    return a;
}

static char *config_json(const lora_adapter_t *ad, const peft_save_opts_t *o) {
    char **sufs = NULL;
    int nsuf = 0;
    if (lora_adapter_suffixes(ad, &sufs, &nsuf) < 0)
        return NULL;
    cJSON *j = cJSON_CreateObject();
    cJSON *tm = cJSON_CreateStringArray((const char *const *)sufs, nsuf);
    lora_free_strings(sufs, nsuf);
    int ok = j && tm;
    ok = ok && cJSON_AddObjectToObject(j, "alpha_pattern");
    ok = ok && cJSON_AddNullToObject(j, "auto_mapping");
    ok = ok && (o->base_model ? cJSON_AddStringToObject(j, "base_model_name_or_path", o->base_model)
                              : cJSON_AddNullToObject(j, "base_model_name_or_path"));
    ok = ok && cJSON_AddStringToObject(j, "bias", "none");
    ok = ok && cJSON_AddFalseToObject(j, "fan_in_fan_out");
    ok = ok && cJSON_AddTrueToObject(j, "inference_mode");
    ok = ok && cJSON_AddTrueToObject(j, "init_lora_weights");
    ok = ok && cJSON_AddNullToObject(j, "layers_pattern");
    ok = ok && cJSON_AddNullToObject(j, "layers_to_transform");
    ok = ok && cJSON_AddNumberToObject(j, "lora_alpha", shortest(ad->alpha));
    ok = ok && cJSON_AddRawToObject(j, "lora_dropout", "0.0");
    cJSON *ms = ok ? modules_to_save_json(ad) : NULL;
    ok = ok && ms && cJSON_AddItemToObject(j, "modules_to_save", ms);
    ok = ok && cJSON_AddStringToObject(j, "peft_type", "LORA");
    ok = ok && cJSON_AddNumberToObject(j, "r", ad->R);
    ok = ok && cJSON_AddObjectToObject(j, "rank_pattern");
    ok = ok && cJSON_AddNullToObject(j, "revision");
    if (ok) {
        cJSON_AddItemToObject(j, "target_modules", tm);
        tm = NULL;
    }
    ok = ok && cJSON_AddStringToObject(j, "task_type", "CAUSAL_LM");
    ok = ok && cJSON_AddFalseToObject(j, "use_dora");
    ok = ok && cJSON_AddBoolToObject(j, "use_rslora", ad->rslora);
    char *s = ok ? cJSON_Print(j) : NULL;
    cJSON_Delete(tm);
    cJSON_Delete(j);
    return s;
}

/* ---- reading the config -------------------------------------------------- */

/* An optional field of the expected type; NULL when absent or null. */
static const cJSON *field(const cJSON *j, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static int unsupported_if(int cond, const char *path, const char *what) {
    return cond ? mo_errorf(MO_EUNSUPPORTED, "%s: %s is not supported", path, what) : MO_OK;
}

static int read_numbers(const cJSON *j, const char *path, peft_config_t *c) {
    const cJSON *r = field(j, "r"), *a = field(j, "lora_alpha"), *d = field(j, "lora_dropout");
    const cJSON *rs = field(j, "use_rslora");
    if (!cJSON_IsNumber(r) || r->valuedouble != floor(r->valuedouble) || r->valuedouble < 1 ||
        r->valuedouble > (1 << 20))
        return mo_errorf(MO_EMALFORMED, "%s: field 'r' must be a positive integer", path);
    c->r = (int)r->valuedouble;
    if (!cJSON_IsNumber(a) || !(a->valuedouble > 0) || !isfinite(a->valuedouble))
        return mo_errorf(MO_EMALFORMED, "%s: field 'lora_alpha' must be a positive number", path);
    c->alpha = (float)a->valuedouble;
    if (d && (!cJSON_IsNumber(d) || !(d->valuedouble >= 0 && d->valuedouble < 1)))
        return mo_errorf(MO_EMALFORMED, "%s: field 'lora_dropout' must be a number in [0, 1)",
                         path);
    c->dropout = d ? (float)d->valuedouble : 0.0f;
    if (rs && !cJSON_IsBool(rs))
        return mo_errorf(MO_EMALFORMED, "%s: field 'use_rslora' must be true or false", path);
    c->rslora = rs ? cJSON_IsTrue(rs) : 0;
    return MO_OK;
}

static int read_features(const cJSON *j, const char *path) {
    const cJSON *pt = field(j, "peft_type");
    if (!cJSON_IsString(pt))
        return mo_errorf(MO_EMALFORMED, "%s: field 'peft_type' must be a string", path);
    if (strcmp(pt->valuestring, "LORA") != 0)
        return mo_errorf(MO_EUNSUPPORTED, "%s: peft_type '%s' is not supported (want LORA)", path,
                         pt->valuestring);
    const cJSON *b = field(j, "bias"), *ff = field(j, "fan_in_fan_out"),
                *dora = field(j, "use_dora");
    const cJSON *rp = field(j, "rank_pattern"), *ap = field(j, "alpha_pattern");
    const cJSON *lt = field(j, "layers_to_transform"), *ms = field(j, "modules_to_save");
    TRY(unsupported_if(b && (!cJSON_IsString(b) || strcmp(b->valuestring, "none")), path,
                       "bias other than \"none\""));
    TRY(unsupported_if(ff && !cJSON_IsFalse(ff), path, "fan_in_fan_out"));
    TRY(unsupported_if(dora && !cJSON_IsFalse(dora), path, "use_dora (DoRA)"));
    TRY(unsupported_if(rp && cJSON_GetArraySize(rp) > 0, path, "a non-empty rank_pattern"));
    TRY(unsupported_if(ap && cJSON_GetArraySize(ap) > 0, path, "a non-empty alpha_pattern"));
    TRY(unsupported_if(lt != NULL, path, "layers_to_transform"));
    if (ms && !cJSON_IsNull(ms)) {
        const cJSON *it;
        if (!cJSON_IsArray(ms))
            return mo_errorf(MO_EMALFORMED, "%s: field 'modules_to_save' must be null or a list",
                             path);
        cJSON_ArrayForEach(it, ms) if (!cJSON_IsString(it)) return mo_errorf(
            MO_EMALFORMED, "%s: field 'modules_to_save' must hold strings", path);
    }
    return MO_OK;
}

static int read_targets(const cJSON *j, const char *path, peft_config_t *c) {
    const cJSON *tm = field(j, "target_modules");
    if (cJSON_IsString(tm))
        return mo_errorf(MO_EUNSUPPORTED,
                         "%s: target_modules as a regular expression is not "
                         "supported (use a list of module-name suffixes)",
                         path);
    int n = cJSON_IsArray(tm) ? cJSON_GetArraySize(tm) : 0;
    if (n == 0)
        return mo_errorf(MO_EMALFORMED, "%s: field 'target_modules' must be a non-empty list",
                         path);
    c->target_modules = calloc((size_t)n, sizeof *c->target_modules);
    if (!c->target_modules)
        return mo_errorf(MO_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        const cJSON *s = cJSON_GetArrayItem(tm, i);
        if (!cJSON_IsString(s) || !s->valuestring[0])
            return mo_errorf(MO_EMALFORMED, "%s: target_modules[%d] must be a non-empty string",
                             path, i);
        if (!(c->target_modules[i] = join(s->valuestring, "", "")))
            return mo_errorf(MO_ENOMEM, "out of memory");
        c->n_target_modules = i + 1;
    }
    return MO_OK;
}

static int parse_config(const char *text, size_t n, const char *path, peft_config_t *c) {
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    if (!j)
        return mo_errorf(MO_EMALFORMED, "%s: not valid JSON (near byte %td)", path,
                         end ? end - text : (ptrdiff_t)0);
    int rc = MO_OK;
    if (!cJSON_IsObject(j))
        rc = mo_errorf(MO_EMALFORMED, "%s: the top level must be a JSON object", path);
    if (rc == MO_OK)
        rc = read_features(j, path);
    if (rc == MO_OK)
        rc = read_numbers(j, path, c);
    if (rc == MO_OK)
        rc = read_targets(j, path, c);
    const cJSON *bm = field(j, "base_model_name_or_path");
    if (rc == MO_OK && bm && !cJSON_IsString(bm))
        rc = mo_errorf(MO_EMALFORMED, "%s: field 'base_model_name_or_path' must be a string", path);
    if (rc == MO_OK && bm && !(c->base_model = join(bm->valuestring, "", "")))
        rc = mo_errorf(MO_ENOMEM, "out of memory");
    cJSON_Delete(j);
    return rc;
}

int peft_read_config(const char *dir, peft_config_t *c) {
    memset(c, 0, sizeof *c);
    char *path = join(dir, "/", PEFT_CONFIG_NAME), *text = NULL;
    if (!path)
        return mo_errorf(MO_ENOMEM, "out of memory");
    size_t n = 0;
    int rc = read_whole(path, &text, &n);
    if (rc == MO_OK)
        rc = parse_config(text, n, path, c);
    free(text);
    free(path);
    if (rc < 0)
        peft_config_free(c);
    return rc;
}

void peft_config_free(peft_config_t *c) {
    free(c->base_model);
    lora_free_strings(c->target_modules, c->n_target_modules);
    memset(c, 0, sizeof *c);
}

/* ---- writing ---------------------------------------------------------------- */

/* The moerl.targets words joined by commas ("" when none). */
static char *join_targets(const lora_adapter_t *ad) {
    size_t n = 1;
    for (int t = 0; t < ad->n_targets; t++)
        n += strlen(ad->targets[t]) + 1;
    char *s = malloc(n), *p = s;
    if (!s)
        return NULL;
    for (int t = 0; t < ad->n_targets; t++) {
        size_t l = strlen(ad->targets[t]);
        if (t > 0)
            *p++ = ',';
        memcpy(p, ad->targets[t], l);
        p += l;
    }
    *p = '\0';
    return s;
}

/* The file's data in dtype dt: the params themselves for F32, else a rounded
 * copy in *buf (freed by the caller). *sum: the checksum of the values as
 * stored, read back to f32. */
static int stored_values(const lora_adapter_t *ad, dtype_t dt, void **buf, uint64_t *sum) {
    *buf = NULL;
    if (dt == DT_F32) {
        *sum = lora_adapter_checksum(ad);
        return MO_OK;
    }
    size_t n = ad->n_params;
    void *low = malloc(n * dtype_size(dt) + 1);
    float *back = malloc(n * sizeof *back + 1);
    if (!low || !back) {
        free(low);
        free(back);
        return mo_errorf(MO_ENOMEM, "lora save: cannot allocate %zu values", n);
    }
    convert_from_f32(low, dt, ad->params, n);
    convert_to_f32(back, low, dt, n);
    *sum = lora_hash64(back, n * sizeof *back);
    free(back);
    *buf = low;
    return MO_OK;
}

static int write_weights(const lora_adapter_t *ad, const char *path, dtype_t dt) {
    void *low = NULL;
    uint64_t sum = 0;
    TRY(stored_values(ad, dt, &low, &sum));
    int n = ad->n_tensors;
    st_item_t *items = calloc((size_t)n, sizeof *items);
    char *targets = join_targets(ad);
    int rc = items && targets ? MO_OK : mo_errorf(MO_ENOMEM, "lora save: out of memory");
    size_t esz = dtype_size(dt);
    for (int i = 0; i < n && rc == MO_OK; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        void *data = low ? (char *)low + t->offset * esz : (void *)(ad->params + t->offset);
        int64_t shape[2];
        int nd = stored_shape(ad, i, shape);
        items[i].tensor = tensor_view(data, dt, DEV_CPU, nd, shape);
        if (!(items[i].name = key_of(ad, i)))
            rc = mo_errorf(MO_ENOMEM, "lora save: out of memory");
    }
    char r[32], alpha[48], rs[8], seed[32], check[32];
    snprintf(r, sizeof r, "%d", ad->R);
    snprintf(alpha, sizeof alpha, "%.9g", (double)ad->alpha);
    snprintf(rs, sizeof rs, "%d", ad->rslora);
    snprintf(seed, sizeof seed, "%" PRIu64, ad->seed);
    snprintf(check, sizeof check, "%016" PRIx64, sum);
    st_meta_t meta[] = {{"format", "pt"},     {"moerl.format", "1"},
                        {"moerl.r", r},       {"moerl.alpha", alpha},
                        {"moerl.rslora", rs}, {"moerl.targets", targets ? targets : ""},
                        {"moerl.seed", seed}, {"moerl.checksum", check}};
    if (rc == MO_OK)
        rc = st_write(path, items, n, meta, (int)(sizeof meta / sizeof meta[0]));
    for (int i = 0; items && i < n; i++)
        free((char *)items[i].name);
    free(items);
    free(targets);
    free(low);
    return rc;
}

static void remove_stage(const char *stage) {
    char *c = join(stage, "/", PEFT_CONFIG_NAME), *w = join(stage, "/", PEFT_WEIGHTS_NAME);
    if (c)
        unlink(c);
    if (w)
        unlink(w);
    rmdir(stage);
    free(c);
    free(w);
}

/* dir does not exist: build it beside, then rename it into place. */
static int save_new_dir(const lora_adapter_t *ad, const char *dir, const char *json, dtype_t dt) {
    char pid[48];
    snprintf(pid, sizeof pid, ".tmp.%ld", (long)getpid());
    char *stage = join(dir, "", pid);
    char *cpath = stage ? join(stage, "/", PEFT_CONFIG_NAME) : NULL;
    char *wpath = stage ? join(stage, "/", PEFT_WEIGHTS_NAME) : NULL;
    char *parent = parent_of(dir);
    int rc = stage && cpath && wpath && parent ? MO_OK : mo_errorf(MO_ENOMEM, "out of memory");
    if (rc == MO_OK) {
        remove_stage(stage); /* a leftover of this pid's crashed attempt */
        if (mkdir(stage, 0755) != 0)
            rc = mo_errorf(MO_EIO, "cannot create directory %s: %s", stage, strerror(errno));
    }
    if (rc == MO_OK)
        rc = write_weights(ad, wpath, dt);
    if (rc == MO_OK)
        rc = write_synced(cpath, json, strlen(json));
    if (rc == MO_OK)
        rc = fsync_path(stage);
    if (rc == MO_OK && rename(stage, dir) != 0)
        rc = mo_errorf(MO_EIO, "cannot rename %s to %s: %s", stage, dir, strerror(errno));
    if (rc == MO_OK)
        rc = fsync_path(parent);
    else if (stage)
        remove_stage(stage);
    free(stage);
    free(cpath);
    free(wpath);
    free(parent);
    return rc;
}

int peft_save(const lora_adapter_t *ad, const char *dir, const peft_save_opts_t *opts) {
    peft_save_opts_t o = {DT_F32, NULL};
    if (opts)
        o = *opts;
    if (o.dtype != DT_F32 && o.dtype != DT_BF16 && o.dtype != DT_F16)
        return mo_errorf(MO_EINVAL, "lora save: dtype %s is not supported (F32, BF16 or F16)",
                         dtype_name(o.dtype));
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dl--;
    char *d = malloc(dl + 1);
    char *json = d ? config_json(ad, &o) : NULL;
    if (!json) {
        free(d);
        return mo_errorf(MO_ENOMEM, "lora save: cannot build %s", PEFT_CONFIG_NAME);
    }
    memcpy(d, dir, dl);
    d[dl] = '\0';
    dir = d;
    int rc;
    struct stat st;
    if (stat(dir, &st) != 0) {
        rc = errno == ENOENT ? save_new_dir(ad, dir, json, o.dtype)
                             : mo_errorf(MO_EIO, "cannot stat %s: %s", dir, strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
        rc = mo_errorf(MO_EINVAL, "lora save: %s exists and is not a directory", dir);
    } else {
        char *wpath = join(dir, "/", PEFT_WEIGHTS_NAME);
        rc = wpath ? write_weights(ad, wpath, o.dtype) : mo_errorf(MO_ENOMEM, "out of memory");
        if (rc == MO_OK)
            rc = write_atomic(dir, PEFT_CONFIG_NAME, json, strlen(json));
        free(wpath);
    }
    cJSON_free(json);
    free(d);
    return rc;
}

/* ---- loading ---------------------------------------------------------------- */

/* The metadata copies of r, alpha and rsLoRA must agree with the config. */
static int check_meta(const st_file_t *f, const char *path, const peft_config_t *c) {
    const char *r = st_metadata(f, "moerl.r"), *a = st_metadata(f, "moerl.alpha");
    const char *rs = st_metadata(f, "moerl.rslora");
    if (r && strtol(r, NULL, 10) != c->r)
        return mo_errorf(MO_EMALFORMED,
                         "%s: metadata moerl.r is %s but %s says r = %d: the two "
                         "files do not belong together",
                         path, r, PEFT_CONFIG_NAME, c->r);
    if (a && strtof(a, NULL) != c->alpha)
        return mo_errorf(MO_EMALFORMED,
                         "%s: metadata moerl.alpha is %s but %s says lora_alpha "
                         "= %g: the two files do not belong together",
                         path, a, PEFT_CONFIG_NAME, (double)c->alpha);
    if (rs && (strtol(rs, NULL, 10) != 0) != (c->rslora != 0))
        return mo_errorf(MO_EMALFORMED,
                         "%s: metadata moerl.rslora is %s but %s says use_rslora "
                         "= %s: the two files do not belong together",
                         path, rs, PEFT_CONFIG_NAME, c->rslora ? "true" : "false");
    return MO_OK;
}

/* The full tensor a modules_to_save key names, or -1. */
static int full_of_key(const lora_adapter_t *ad, const char *key) {
    size_t np = strlen(PEFT_KEY_PREFIX), ns = strlen(SUFFIX_SAVE), n = strlen(key);
    if (n <= np + ns || strcmp(key + n - ns, SUFFIX_SAVE) != 0)
        return -1;
    char *name = malloc(n - np - ns + strlen(SUFFIX_WEIGHT) + 1);
    if (!name)
        return -1;
    memcpy(name, key + np, n - np - ns);
    memcpy(name + n - np - ns, SUFFIX_WEIGHT, strlen(SUFFIX_WEIGHT) + 1);
    int t = lora_adapter_find_full(ad, name);
    free(name);
    return t;
}

/* The tensor index (2e or 2e + 1, or a full tensor's) a key names, or -1. */
static int tensor_of_key(const lora_adapter_t *ad, const char *key) {
    size_t np = strlen(PEFT_KEY_PREFIX), ns = strlen(SUFFIX_A), n = strlen(key);
    if (n <= np + ns || strncmp(key, PEFT_KEY_PREFIX, np) != 0)
        return -1;
    if (ad->n_full > 0 && n > strlen(SUFFIX_SAVE) &&
        strcmp(key + n - strlen(SUFFIX_SAVE), SUFFIX_SAVE) == 0)
        return full_of_key(ad, key);
    int isb = strcmp(key + n - ns, SUFFIX_B) == 0;
    if (!isb && strcmp(key + n - ns, SUFFIX_A) != 0)
        return -1;
    char *mod = malloc(n - np - ns + 1);
    if (!mod)
        return -1;
    memcpy(mod, key + np, n - np - ns);
    mod[n - np - ns] = '\0';
    int e = lora_adapter_find(ad, mod);
    free(mod);
    return e < 0 ? -1 : 2 * e + isb;
}

static int check_tensor(const lora_adapter_t *ad, const st_info_t *in, int t, const char *path) {
    int64_t sh[2];
    int nd = stored_shape(ad, t, sh);
    if (in->dtype != DT_F32 && in->dtype != DT_BF16 && in->dtype != DT_F16)
        return mo_errorf(MO_EMALFORMED, "%s: key '%s' has dtype %s; expected F32, BF16 or F16",
                         path, in->name, dtype_name(in->dtype));
    if (in->ndim != nd || in->shape[0] != sh[0] || (nd == 2 && in->shape[1] != sh[1])) {
        tensor_t v = tensor_view(NULL, in->dtype, DEV_CPU, in->ndim, in->shape);
        char got[96];
        tensor_shape_str(&v, got, sizeof got);
        return mo_errorf(MO_EMALFORMED,
                         "%s: key '%s' has shape %s; expected (%" PRId64 ", %" PRId64 ")%s", path,
                         in->name, got, sh[0], sh[1], nd == 1 ? " stored as a vector" : "");
    }
    return MO_OK;
}

/* Every key of the file is one of the adapter's, with the right shape, and
 * every one of the adapter's is there. *same_order: the file lists them in
 * the adapter's table order. map[i]: the adapter tensor of file tensor i. */
static int check_keys(const lora_adapter_t *ad, const st_file_t *f, const char *path, int *map,
                      int *same_order) {
    int n = st_count(f);
    unsigned char *seen = calloc((size_t)ad->n_tensors, 1);
    if (!seen)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = MO_OK;
    *same_order = n == ad->n_tensors;
    for (int i = 0; i < n && rc == MO_OK; i++) {
        const st_info_t *in = st_info(f, i);
        int t = tensor_of_key(ad, in->name);
        if (t < 0) {
            rc = mo_errorf(MO_EMALFORMED,
                           "%s: unexpected key '%s': not the lora_A or lora_B "
                           "weight of a module this adapter holds, nor one of its "
                           "modules_to_save weights",
                           path, in->name);
            break;
        }
        rc = check_tensor(ad, in, t, path);
        map[i] = t;
        seen[t] = 1;
        *same_order &= t == i;
    }
    for (int t = 0; t < ad->n_tensors && rc == MO_OK; t++)
        if (!seen[t]) {
            char *k = key_of(ad, t);
            rc = mo_errorf(MO_EMALFORMED, "%s: missing key '%s' (shape (%" PRId64 ", %" PRId64 "))",
                           path, k ? k : ad->tensors[t].name, ad->tensors[t].shape[0],
                           ad->tensors[t].shape[1]);
            free(k);
        }
    free(seen);
    return rc;
}

static int parse_hex64(const char *s, uint64_t *out) {
    if (strlen(s) != 16)
        return -1;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

/* Converts every file tensor into stage (n_params) and checks the values. */
static int read_values(const lora_adapter_t *ad, const st_file_t *f, const char *path,
                       const int *map, float *stage) {
    for (int i = 0; i < st_count(f); i++) {
        const lora_tensor_t *lt = &ad->tensors[map[i]];
        tensor_t v = st_tensor(f, i);
        float *dst = stage + lt->offset;
        convert_to_f32(dst, v.data, v.dtype, lt->numel);
        for (size_t k = 0; k < lt->numel; k++)
            if (!isfinite(dst[k]))
                return mo_errorf(MO_EMALFORMED,
                                 "%s: key '%s' holds a non-finite value at "
                                 "element %zu",
                                 path, st_info(f, i)->name, k);
    }
    return MO_OK;
}

static int verify_checksum(const st_file_t *f, const char *path, const float *stage, size_t n) {
    const char *cs = st_metadata(f, "moerl.checksum");
    if (!cs)
        return MO_OK;
    uint64_t want, got = lora_hash64(stage, n * sizeof *stage);
    if (parse_hex64(cs, &want) < 0)
        return mo_errorf(MO_EMALFORMED, "%s: metadata moerl.checksum '%s' is not 16 hex digits",
                         path, cs);
    if (want != got)
        return mo_errorf(MO_EMALFORMED,
                         "%s: checksum mismatch: the metadata says %016" PRIx64
                         ", the tensors hash to %016" PRIx64 " (corrupt file?)",
                         path, want, got);
    return MO_OK;
}

/* Validates f against ad and c, then replaces ad's parameters. */
static int load_file(lora_adapter_t *ad, const st_file_t *f, const char *path,
                     const peft_config_t *c) {
    TRY(check_meta(f, path, c));
    int n = st_count(f), same_order = 0;
    int *map = malloc(((size_t)n + 1) * sizeof *map);
    float *stage = malloc((ad->n_params + 1) * sizeof *stage);
    int rc = map && stage ? MO_OK : mo_errorf(MO_ENOMEM, "lora load: out of memory");
    if (rc == MO_OK)
        rc = check_keys(ad, f, path, map, &same_order);
    if (rc == MO_OK)
        rc = read_values(ad, f, path, map, stage);
    if (rc == MO_OK && same_order)
        rc = verify_checksum(f, path, stage, ad->n_params);
    if (rc == MO_OK)
        memcpy(ad->params, stage, ad->n_params * sizeof *stage);
    free(map);
    free(stage);
    return rc;
}

static int check_against(const lora_adapter_t *ad, const peft_config_t *c, const char *dir) {
    if (c->r != ad->R)
        return mo_errorf(MO_ECONFIG, "%s/%s: r is %d but the adapter has rank %d", dir,
                         PEFT_CONFIG_NAME, c->r, ad->R);
    if (c->alpha != ad->alpha)
        return mo_errorf(MO_ECONFIG, "%s/%s: lora_alpha is %g but the adapter has alpha %g", dir,
                         PEFT_CONFIG_NAME, (double)c->alpha, (double)ad->alpha);
    if ((c->rslora != 0) != (ad->rslora != 0))
        return mo_errorf(MO_ECONFIG, "%s/%s: use_rslora is %s but the adapter has rsLoRA %s", dir,
                         PEFT_CONFIG_NAME, c->rslora ? "true" : "false", ad->rslora ? "on" : "off");
    return MO_OK;
}

int peft_load(lora_adapter_t *ad, const char *dir) {
    peft_config_t c;
    TRY(peft_read_config(dir, &c));
    int rc = check_against(ad, &c, dir);
    char *path = join(dir, "/", PEFT_WEIGHTS_NAME);
    st_file_t *f = NULL;
    if (rc == MO_OK)
        rc = path ? st_open(&f, path) : mo_errorf(MO_ENOMEM, "out of memory");
    if (rc == MO_OK)
        rc = load_file(ad, f, path, &c);
    st_close(&f);
    free(path);
    peft_config_free(&c);
    return rc;
}

/* Splits moerl.targets at commas into *words (n); none when absent or empty. */
static int split_targets(const char *s, char ***words, int *n) {
    *words = NULL;
    *n = 0;
    if (!s || !*s)
        return MO_OK;
    int cnt = 1;
    for (const char *p = s; *p; p++)
        cnt += *p == ',';
    char **w = calloc((size_t)cnt, sizeof *w);
    if (!w)
        return mo_errorf(MO_ENOMEM, "out of memory");
    for (int i = 0; i < cnt; i++) {
        const char *e = strchr(s, ',');
        size_t l = e ? (size_t)(e - s) : strlen(s);
        if (!(w[i] = malloc(l + 1))) {
            lora_free_strings(w, i);
            return mo_errorf(MO_ENOMEM, "out of memory");
        }
        memcpy(w[i], s, l);
        w[i][l] = '\0';
        s += l + 1;
    }
    *words = w;
    *n = cnt;
    return MO_OK;
}

/* Adds to ad a full tensor for every modules_to_save key of f, with the file's shape
 * and values (load_file then checks and loads them like the others). */
static int add_saved_modules(lora_adapter_t *ad, const st_file_t *f) {
    size_t np = strlen(PEFT_KEY_PREFIX), ns = strlen(SUFFIX_SAVE);
    int rc = MO_OK;
    for (int i = 0; i < st_count(f) && rc == MO_OK; i++) {
        const st_info_t *in = st_info(f, i);
        size_t n = strlen(in->name);
        if (n <= np + ns || strncmp(in->name, PEFT_KEY_PREFIX, np) != 0 ||
            strcmp(in->name + n - ns, SUFFIX_SAVE) != 0)
            continue;
        if ((in->ndim != 1 && in->ndim != 2) || !dtype_is_float(in->dtype) || in->shape[0] < 1 ||
            in->shape[0] > INT32_MAX ||
            (in->ndim == 2 && (in->shape[1] < 1 || in->shape[1] > INT32_MAX)))
            return mo_errorf(MO_EMALFORMED,
                             "key '%s': a modules_to_save weight must be a "
                             "float vector or matrix",
                             in->name);
        int rows = (int)in->shape[0], cols = in->ndim == 2 ? (int)in->shape[1] : 1;
        char *name = malloc(n - np - ns + strlen(SUFFIX_WEIGHT) + 1);
        float *v = malloc((size_t)rows * cols * sizeof *v);
        if (!name || !v) {
            free(name);
            free(v);
            return mo_errorf(MO_ENOMEM, "out of memory");
        }
        memcpy(name, in->name + np, n - np - ns);
        memcpy(name + n - np - ns, SUFFIX_WEIGHT, strlen(SUFFIX_WEIGHT) + 1);
        tensor_t tv = st_tensor(f, i);
        convert_to_f32(v, tv.data, tv.dtype, (size_t)rows * cols);
        rc = lora_adapter_add_full(ad, name, rows, cols, v);
        free(name);
        free(v);
    }
    return rc;
}

/* Builds the adapter that c and f describe for mods. */
static int build_from(lora_adapter_t **out, const peft_config_t *c, const st_file_t *f,
                      const char *dir, const lora_module_desc_t *mods, int n_mods, int no_grads) {
    unsigned char *sel = malloc((size_t)n_mods + 1);
    if (!sel)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = lora_select_suffixes(sel, mods, n_mods, (const char *const *)c->target_modules,
                                  c->n_target_modules);
    if (rc < 0)
        mo_error_wrap(rc, "%s/%s", dir, PEFT_CONFIG_NAME);
    char **words = NULL;
    int nw = 0;
    if (rc == MO_OK)
        rc = split_targets(st_metadata(f, "moerl.targets"), &words, &nw);
    if (rc == MO_OK) {
        const char *seed = st_metadata(f, "moerl.seed");
        lora_config_t lc = {.rank = c->r,
                            .alpha = c->alpha,
                            .rslora = c->rslora,
                            .dropout = 0.0f,
                            .seed = seed ? strtoull(seed, NULL, 10) : 0,
                            .no_grads = no_grads};
        lc.targets = nw ? (const char *const *)words : (const char *const *)c->target_modules;
        lc.n_targets = nw ? nw : c->n_target_modules;
        rc = lora_adapter_new_selected(out, &lc, mods, n_mods, sel);
        if (rc == MO_OK)
            rc = add_saved_modules(*out, f);
        if (rc < 0)
            mo_error_wrap(rc, "%s", dir);
    }
    lora_free_strings(words, nw);
    free(sel);
    return rc;
}

int peft_load_new(lora_adapter_t **out, const char *dir, const lora_module_desc_t *mods, int n_mods,
                  int no_grads) {
    *out = NULL;
    peft_config_t c;
    TRY(peft_read_config(dir, &c));
    char *path = join(dir, "/", PEFT_WEIGHTS_NAME);
    st_file_t *f = NULL;
    lora_adapter_t *ad = NULL;
    int rc = path ? st_open(&f, path) : mo_errorf(MO_ENOMEM, "out of memory");
    if (rc == MO_OK)
        rc = build_from(&ad, &c, f, dir, mods, n_mods, no_grads);
    if (rc == MO_OK)
        rc = load_file(ad, f, path, &c);
    if (rc < 0)
        lora_adapter_destroy(&ad);
    *out = ad;
    st_close(&f);
    free(path);
    peft_config_free(&c);
    return rc;
}
