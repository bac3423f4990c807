/* checkpoint: step directories written under a temporary name and renamed into place,
 * the `latest` pointer replaced last, validated loads with a fallback, retention. */
#include "learner/checkpoint.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"
#include "learner/ep_shard.h"
#include "lora/peft.h"

#define PATH_CAP 4096

/* The files a checkpoint lists in its state, relative to the step directory. */
static const char *const k_files[] = {CKPT_ADAPTER_DIR "/" PEFT_CONFIG_NAME,
                                      CKPT_ADAPTER_DIR "/" PEFT_WEIGHTS_NAME, CKPT_OPTIM_NAME};
#define N_FILES ((int)(sizeof k_files / sizeof *k_files))

/* ---- Files ---------------------------------------------------------------- */

static int path_join(char *out, const char *a, const char *b) {
    int n = snprintf(out, PATH_CAP, "%s/%s", a, b);
    if (n < 0 || n >= PATH_CAP)
        return mo_errorf(MO_EINVAL, "checkpoint: path %s/%s is too long", a, b);
    return MO_OK;
}

static int fsync_path(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return mo_errorf(MO_EIO, "checkpoint: cannot open %s: %s", path, strerror(errno));
    int rc = fsync(fd) == 0
                 ? MO_OK
                 : mo_errorf(MO_EIO, "checkpoint: cannot fsync %s: %s", path, strerror(errno));
    close(fd);
    return rc;
}

static int write_synced(const char *path, const void *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return mo_errorf(MO_EIO, "checkpoint: cannot create %s: %s", path, strerror(errno));
    const char *p = data;
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, p + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = errno;
            close(fd);
            return mo_errorf(MO_EIO, "checkpoint: cannot write %s: %s", path, strerror(e));
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return mo_errorf(MO_EIO, "checkpoint: cannot fsync %s: %s", path, strerror(e));
    }
    if (close(fd) != 0)
        return mo_errorf(MO_EIO, "checkpoint: cannot close %s: %s", path, strerror(errno));
    return MO_OK;
}

/* The whole file, NUL-terminated, malloc'd. */
static int read_all(const char *path, char **out, size_t *n) {
    *out = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return mo_errorf(errno == ENOENT ? MO_ENOTFOUND : MO_EIO, "checkpoint: cannot open %s: %s",
                         path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    int rc = buf ? MO_OK : mo_errorf(MO_ENOMEM, "checkpoint: out of memory");
    while (rc == MO_OK) {
        if (len == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (!nb) {
                rc = mo_errorf(MO_ENOMEM, "checkpoint: out of memory reading %s", path);
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) {
            if (ferror(f))
                rc = mo_errorf(MO_EIO, "checkpoint: cannot read %s", path);
            break;
        }
    }
    fclose(f);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    buf[len] = '\0';
    *out = buf;
    *n = len;
    return MO_OK;
}

static int mkdir_one(const char *path) {
    if (mkdir(path, 0755) == 0 || errno == EEXIST)
        return MO_OK;
    return mo_errorf(MO_EIO, "checkpoint: cannot create directory %s: %s", path, strerror(errno));
}

/* mkdir -p. */
static int mkdir_all(const char *path) {
    char buf[PATH_CAP];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return mo_errorf(MO_EINVAL, "checkpoint: path %s is too long", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            TRY(mkdir_one(buf));
            *p = '/';
        }
    return mkdir_one(buf);
}

/* rm -r of a directory this module wrote (plain files and directories only). */
static void remove_tree(const char *path) {
    DIR *d = opendir(path);
    if (!d) {
        unlink(path);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char sub[PATH_CAP];
        if (path_join(sub, path, e->d_name) < 0)
            continue;
        struct stat sb;
        if (lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode))
            remove_tree(sub);
        else
            unlink(sub);
    }
    closedir(d);
    rmdir(path);
}

static int ckpt_root(char *out, const char *run_dir) {
    return path_join(out, run_dir, CKPT_DIR_NAME);
}

void checkpoint_step_name(char *buf, size_t cap, int64_t step) {
    snprintf(buf, cap, "step-%06" PRId64, step);
}

/* The step of a "step-NNNNNN" name, or -1. */
static int64_t parse_step_name(const char *name) {
    if (strncmp(name, "step-", 5) != 0 || strlen(name) < 11 || strlen(name) > 24)
        return -1;
    int64_t v = 0;
    for (const char *p = name + 5; *p; p++) {
        if (*p < '0' || *p > '9')
            return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

/* ---- Learner state -------------------------------------------------------- */

static void hex64(char *buf, uint64_t v) {
    snprintf(buf, 17, "%016" PRIx64, v);
}

static int add_hex(cJSON *o, const char *key, uint64_t v) {
    char h[17];
    hex64(h, v);
    return cJSON_AddStringToObject(o, key, h) != NULL;
}

static int file_digest(const char *path, uint64_t *bytes, uint64_t *hash) {
    char *buf;
    size_t n;
    TRY(read_all(path, &buf, &n));
    *bytes = n;
    *hash = lora_hash64(buf, n);
    free(buf);
    return MO_OK;
}

static char *state_json(const char *dir, const checkpoint_state_t *st, int *rc) {
    cJSON *j = cJSON_CreateObject(), *data = NULL, *files = NULL;
    int ok = j != NULL;
    ok = ok && cJSON_AddStringToObject(j, "format", "moerl-learner-state");
    ok = ok && cJSON_AddNumberToObject(j, "format_version", CKPT_FORMAT);
    ok = ok && cJSON_AddNumberToObject(j, "step", (double)st->step);
    ok = ok && cJSON_AddNumberToObject(j, "policy_version", (double)st->version);
    ok = ok && add_hex(j, "seed", st->seed);
    ok = ok && add_hex(j, "rng_counter", st->rng_counter);
    ok = ok && (data = cJSON_AddObjectToObject(j, "dataset")) != NULL;
    ok = ok && add_hex(data, "epoch", st->data_epoch);
    ok = ok && add_hex(data, "position", st->data_pos);
    ok = ok && add_hex(data, "fingerprint", st->data_fingerprint);
    ok = ok && cJSON_AddNumberToObject(j, "reward_version", (double)st->reward_version);
    ok = ok && add_hex(j, "config_hash", st->config_hash);
    ok = ok && add_hex(j, "adapter_checksum", st->adapter_checksum);
    ok = ok && (files = cJSON_AddObjectToObject(j, "files")) != NULL;
    *rc = MO_OK;
    for (int i = 0; ok && i < N_FILES; i++) {
        char path[PATH_CAP];
        uint64_t bytes = 0, hash = 0;
        *rc = path_join(path, dir, k_files[i]);
        if (*rc == MO_OK)
            *rc = file_digest(path, &bytes, &hash);
        if (*rc < 0)
            break;
        cJSON *f = cJSON_AddObjectToObject(files, k_files[i]);
        ok = f && cJSON_AddNumberToObject(f, "bytes", (double)bytes) && add_hex(f, "xxh64", hash);
    }
    char *text = ok && *rc == MO_OK ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!text && *rc == MO_OK)
        *rc = mo_errorf(MO_ENOMEM, "checkpoint: out of memory writing the learner state");
    return text;
}

static int get_hex(const cJSON *o, const char *key, uint64_t *out, const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    const char *s = cJSON_IsString(v) ? v->valuestring : NULL;
    char *end = NULL;
    if (s && strlen(s) == 16) {
        errno = 0;
        *out = strtoull(s, &end, 16);
    }
    if (!s || strlen(s) != 16 || !end || *end || errno)
        return mo_errorf(MO_EMALFORMED, "%s: \"%s\" must be 16 hex digits", path, key);
    return MO_OK;
}

static int get_int(const cJSON *o, const char *key, int64_t *out, const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9007199254740992.0 ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return mo_errorf(MO_EMALFORMED, "%s: \"%s\" must be a non-negative integer", path, key);
    *out = (int64_t)v->valuedouble;
    return MO_OK;
}

/* Every listed file exists with the recorded size and hash. */
static int check_files(const cJSON *files, const char *dir, const char *path) {
    if (!cJSON_IsObject(files))
        return mo_errorf(MO_EMALFORMED, "%s: \"files\" must be an object", path);
    for (int i = 0; i < N_FILES; i++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(files, k_files[i]);
        int64_t bytes = 0;
        uint64_t hash = 0, got_bytes = 0, got_hash = 0;
        char fp[PATH_CAP];
        if (!cJSON_IsObject(f))
            return mo_errorf(MO_EMALFORMED, "%s: files lacks \"%s\"", path, k_files[i]);
        TRY(get_int(f, "bytes", &bytes, path));
        TRY(get_hex(f, "xxh64", &hash, path));
        TRY(path_join(fp, dir, k_files[i]));
        int rc = file_digest(fp, &got_bytes, &got_hash);
        if (rc < 0)
            return mo_error_wrap(MO_EMALFORMED, "checkpoint %s", dir);
        if ((int64_t)got_bytes != bytes || got_hash != hash)
            return mo_errorf(MO_EMALFORMED,
                             "checkpoint %s: %s has %" PRIu64 " bytes (xxh64 %016" PRIx64
                             "), the learner state recorded %" PRId64 " (%016" PRIx64 ")",
                             dir, k_files[i], got_bytes, got_hash, bytes, hash);
    }
    return MO_OK;
}

static int parse_state(const cJSON *j, checkpoint_state_t *st, const char *path) {
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "moerl-learner-state") != 0)
        return mo_errorf(MO_EMALFORMED, "%s: \"format\" is not \"moerl-learner-state\"", path);
    int64_t ver = 0, rv = 0;
    TRY(get_int(j, "format_version", &ver, path));
    if (ver != CKPT_FORMAT)
        return mo_errorf(MO_EUNSUPPORTED, "%s: format_version %" PRId64 ", this build reads %d",
                         path, ver, CKPT_FORMAT);
    TRY(get_int(j, "step", &st->step, path));
    TRY(get_int(j, "policy_version", &st->version, path));
    TRY(get_hex(j, "seed", &st->seed, path));
    TRY(get_hex(j, "rng_counter", &st->rng_counter, path));
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "dataset");
    if (!cJSON_IsObject(d))
        return mo_errorf(MO_EMALFORMED, "%s: \"dataset\" must be an object", path);
    TRY(get_hex(d, "epoch", &st->data_epoch, path));
    TRY(get_hex(d, "position", &st->data_pos, path));
    TRY(get_hex(d, "fingerprint", &st->data_fingerprint, path));
    TRY(get_int(j, "reward_version", &rv, path));
    st->reward_version = rv;
    TRY(get_hex(j, "config_hash", &st->config_hash, path));
    TRY(get_hex(j, "adapter_checksum", &st->adapter_checksum, path));
    return MO_OK;
}

int checkpoint_read_state(const char *step_dir, checkpoint_state_t *st) {
    char path[PATH_CAP];
    TRY(path_join(path, step_dir, CKPT_STATE_NAME));
    char *text;
    size_t n;
    int rc = read_all(path, &text, &n);
    if (rc < 0)
        return rc == MO_ENOTFOUND
                   ? mo_errorf(MO_EMALFORMED, "checkpoint %s has no %s", step_dir, CKPT_STATE_NAME)
                   : rc;
    cJSON *j = cJSON_ParseWithLength(text, n);
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return mo_errorf(MO_EMALFORMED, "%s: not a JSON object (truncated?)", path);
    }
    checkpoint_state_t s;
    memset(&s, 0, sizeof s);
    rc = parse_state(j, &s, path);
    if (rc == MO_OK)
        rc = check_files(cJSON_GetObjectItemCaseSensitive(j, "files"), step_dir, path);
    cJSON_Delete(j);
    if (rc == MO_OK)
        *st = s;
    return rc;
}

/* ---- Save ------------------------------------------------------------------ */

/* Removes ".tmp-step-*" directories left behind by crashed saves. */
static void remove_stale_tmp(const char *root) {
    DIR *d = opendir(root);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, ".tmp-step-", 10) != 0 && strncmp(e->d_name, ".old-step-", 10) != 0)
            continue;
        char p[PATH_CAP];
        if (path_join(p, root, e->d_name) == MO_OK)
            remove_tree(p);
    }
    closedir(d);
}

/* Writes the three parts into the (new, empty) directory tmp. */
static int write_parts(const char *tmp, const lora_adapter_t *ad, const optim_t *o,
                       const checkpoint_state_t *st, const char *base_model) {
    char p[PATH_CAP];
    TRY(path_join(p, tmp, CKPT_ADAPTER_DIR));
    peft_save_opts_t po = {DT_F32, base_model};
    TRY(peft_save(ad, p, &po));
    TRY(path_join(p, tmp, CKPT_OPTIM_NAME));
    TRY(optim_save(o, p));
    checkpoint_state_t s = *st;
    s.adapter_checksum = lora_adapter_checksum(ad);
    int rc;
    char *text = state_json(tmp, &s, &rc);
    TRY(rc);
    rc = path_join(p, tmp, CKPT_STATE_NAME);
    if (rc == MO_OK)
        rc = write_synced(p, text, strlen(text));
    cJSON_free(text);
    TRY(rc);
    return fsync_path(tmp);
}

/* Renames tmp to final; an existing final is moved aside first and removed after. */
static int publish_dir(const char *root, const char *tmp, const char *final, const char *name) {
    struct stat sb;
    char old[PATH_CAP];
    old[0] = '\0';
    if (stat(final, &sb) == 0) {
        char oname[256];
        snprintf(oname, sizeof oname, ".old-%s-%ld", name, (long)getpid());
        TRY(path_join(old, root, oname));
        remove_tree(old);
        if (rename(final, old) != 0)
            return mo_errorf(MO_EIO, "checkpoint: cannot move %s aside: %s", final,
                             strerror(errno));
    }
    if (rename(tmp, final) != 0)
        return mo_errorf(MO_EIO, "checkpoint: cannot rename %s to %s: %s", tmp, final,
                         strerror(errno));
    TRY(fsync_path(root));
    if (old[0])
        remove_tree(old);
    return MO_OK;
}

static int write_latest(const char *root, const char *name) {
    char tmp[PATH_CAP], dst[PATH_CAP], text[300];
    TRY(path_join(tmp, root, CKPT_LATEST_NAME ".tmp"));
    TRY(path_join(dst, root, CKPT_LATEST_NAME));
    int n = snprintf(text, sizeof text, "%s\n", name);
    TRY(write_synced(tmp, text, (size_t)n));
    if (rename(tmp, dst) != 0)
        return mo_errorf(MO_EIO, "checkpoint: cannot rename %s to %s: %s", tmp, dst,
                         strerror(errno));
    return fsync_path(root);
}

int checkpoint_save(const char *run_dir, const lora_adapter_t *ad, const optim_t *o,
                    const checkpoint_state_t *st, const checkpoint_save_opts_t *opts, char *name,
                    size_t cap) {
    checkpoint_save_opts_t so = {0, NULL, CKPT_CRASH_NONE};
    if (opts)
        so = *opts;
    if (!run_dir || !ad || !o || !st || st->step < 0)
        return mo_errorf(MO_EINVAL, "checkpoint save: NULL argument or negative step");
    if (o->n != ad->n_params)
        return mo_errorf(MO_EINVAL, "checkpoint save: optimizer of %zu values, adapter of %zu",
                         o->n, ad->n_params);
    char root[PATH_CAP], tmp[PATH_CAP], final[PATH_CAP], sname[64], tname[128];
    TRY(ckpt_root(root, run_dir));
    TRY(mkdir_all(root));
    remove_stale_tmp(root);
    checkpoint_step_name(sname, sizeof sname, st->step);
    snprintf(tname, sizeof tname, ".tmp-%s-%ld", sname, (long)getpid());
    TRY(path_join(tmp, root, tname));
    TRY(path_join(final, root, sname));
    TRY(mkdir_one(tmp));
    int rc = write_parts(tmp, ad, o, st, so.base_model);
    if (rc == MO_OK && so.crash == CKPT_CRASH_BEFORE_RENAME)
        return mo_errorf(MO_EIO, "checkpoint: simulated crash before renaming %s", tmp);
    if (rc == MO_OK)
        rc = publish_dir(root, tmp, final, sname);
    if (rc < 0) {
        remove_tree(tmp);
        return mo_error_wrap(rc, "checkpoint %s", final);
    }
    if (so.crash == CKPT_CRASH_BEFORE_LATEST)
        return mo_errorf(MO_EIO, "checkpoint: simulated crash before updating %s/%s", root,
                         CKPT_LATEST_NAME);
    TRY(write_latest(root, sname));
    if (name)
        snprintf(name, cap, "%s", sname);
    if (so.keep > 0)
        TRY(checkpoint_prune(run_dir, so.keep));
    return MO_OK;
}

/* ---- Load ------------------------------------------------------------------ */

int checkpoint_latest(const char *run_dir, char *name, size_t cap) {
    char root[PATH_CAP], path[PATH_CAP];
    TRY(ckpt_root(root, run_dir));
    TRY(path_join(path, root, CKPT_LATEST_NAME));
    char *text;
    size_t n;
    TRY(read_all(path, &text, &n));
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' '))
        text[--n] = '\0';
    int64_t step = parse_step_name(text);
    int rc = MO_OK;
    if (step < 0)
        rc = mo_errorf(MO_EMALFORMED, "%s: \"%.40s\" is not a step directory name", path, text);
    else if (strlen(text) + 1 > cap)
        rc = mo_errorf(MO_EINVAL, "checkpoint: name buffer of %zu bytes is too small", cap);
    else
        snprintf(name, cap, "%s", text);
    free(text);
    return rc;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int checkpoint_list(const char *run_dir, int64_t **steps, int *n) {
    *steps = NULL;
    *n = 0;
    char root[PATH_CAP];
    TRY(ckpt_root(root, run_dir));
    DIR *d = opendir(root);
    if (!d)
        return errno == ENOENT
                   ? MO_OK
                   : mo_errorf(MO_EIO, "checkpoint: cannot list %s: %s", root, strerror(errno));
    int cap = 0, rc = MO_OK;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int64_t s = parse_step_name(e->d_name);
        if (s < 0)
            continue;
        if (*n == cap) {
            int nc = cap ? 2 * cap : 16;
            int64_t *ns = realloc(*steps, sizeof *ns * (size_t)nc);
            if (!ns) {
                rc = mo_errorf(MO_ENOMEM, "checkpoint: out of memory listing %s", root);
                break;
            }
            *steps = ns;
            cap = nc;
        }
        (*steps)[(*n)++] = s;
    }
    closedir(d);
    if (rc < 0) {
        free(*steps);
        *steps = NULL;
        *n = 0;
        return rc;
    }
    if (*n > 1)
        qsort(*steps, (size_t)*n, sizeof **steps, cmp_i64);
    return MO_OK;
}

int checkpoint_load_dir(const char *step_dir, lora_adapter_t *ad, optim_t *o,
                        checkpoint_state_t *st) {
    checkpoint_state_t s;
    TRY(checkpoint_read_state(step_dir, &s));
    char ap[PATH_CAP], op[PATH_CAP];
    TRY(path_join(ap, step_dir, CKPT_ADAPTER_DIR));
    TRY(path_join(op, step_dir, CKPT_OPTIM_NAME));
    float *backup = malloc(sizeof *backup * (ad->n_params ? ad->n_params : 1));
    if (!backup)
        return mo_errorf(MO_ENOMEM, "checkpoint: out of memory");
    memcpy(backup, ad->params, sizeof *backup * ad->n_params);
    int rc = peft_load(ad, ap);
    if (rc == MO_OK && lora_adapter_checksum(ad) != s.adapter_checksum)
        rc = mo_errorf(MO_EMALFORMED,
                       "checkpoint %s: the adapter's checksum %016" PRIx64
                       " differs from the learner state's %016" PRIx64,
                       step_dir, lora_adapter_checksum(ad), s.adapter_checksum);
    if (rc == MO_OK)
        rc = optim_load(o, op);
    if (rc < 0)
        memcpy(ad->params, backup, sizeof *backup * ad->n_params);
    free(backup);
    if (rc < 0)
        return mo_error_wrap(rc, "checkpoint %s", step_dir);
    if (st)
        *st = s;
    return MO_OK;
}

int checkpoint_load(const char *run_dir, lora_adapter_t *ad, optim_t *o, checkpoint_state_t *st,
                    char *name, size_t cap, int *fell_back) {
    char root[PATH_CAP], dir[PATH_CAP], latest[64] = "";
    TRY(ckpt_root(root, run_dir));
    if (fell_back)
        *fell_back = 0;
    int first = checkpoint_latest(run_dir, latest, sizeof latest);
    if (first == MO_OK) {
        TRY(path_join(dir, root, latest));
        first = checkpoint_load_dir(dir, ad, o, st);
        if (first == MO_OK) {
            if (name)
                snprintf(name, cap, "%s", latest);
            return MO_OK;
        }
    }
    char first_msg[512];
    snprintf(first_msg, sizeof first_msg, "%s", mo_last_error());
    int64_t *steps;
    int n;
    TRY(checkpoint_list(run_dir, &steps, &n));
    int rc = MO_ENOTFOUND;
    for (int i = n - 1; i >= 0; i--) {
        char sname[64];
        checkpoint_step_name(sname, sizeof sname, steps[i]);
        if (first != MO_ENOTFOUND && !strcmp(sname, latest))
            continue;
        if (path_join(dir, root, sname) < 0 || checkpoint_load_dir(dir, ad, o, st) < 0)
            continue;
        if (name)
            snprintf(name, cap, "%s", sname);
        if (fell_back)
            *fell_back = 1;
        rc = MO_OK;
        break;
    }
    free(steps);
    if (rc == MO_OK)
        return MO_OK;
    if (first == MO_ENOTFOUND && n == 0)
        return mo_errorf(MO_ENOTFOUND, "checkpoint: %s holds no checkpoint", root);
    return mo_errorf(first < 0 && first != MO_ENOTFOUND ? first : MO_EMALFORMED,
                     "checkpoint: no usable checkpoint in %s (%s)", root, first_msg);
}

int checkpoint_prune(const char *run_dir, int keep) {
    if (keep <= 0)
        return 0;
    int64_t *steps;
    int n;
    TRY(checkpoint_list(run_dir, &steps, &n));
    char root[PATH_CAP], latest[64] = "";
    int rc = ckpt_root(root, run_dir);
    if (rc == MO_OK && checkpoint_latest(run_dir, latest, sizeof latest) < 0)
        latest[0] = '\0';
    int removed = 0;
    for (int i = 0; rc == MO_OK && i < n - keep; i++) {
        char sname[64], p[PATH_CAP];
        checkpoint_step_name(sname, sizeof sname, steps[i]);
        if (!strcmp(sname, latest) || path_join(p, root, sname) < 0)
            continue;
        remove_tree(p);
        removed++;
    }
    free(steps);
    if (rc < 0)
        return rc;
    if (removed > 0)
        TRY(fsync_path(root));
    return removed;
}

/* ---- The trainer ------------------------------------------------------------ */

int checkpoint_due(const trainer_t *t, int64_t every) {
    return every > 0 && t->step > 0 && t->step % every == 0;
}

int checkpoint_save_trainer(const trainer_t *t, const char *run_dir, const checkpoint_data_t *data,
                            const checkpoint_save_opts_t *opts, char *name, size_t cap) {
    checkpoint_state_t st = {.step = t->step,
                             .version = t->version,
                             .seed = t->seed,
                             .rng_counter = t->rng_counter,
                             .data_epoch = data ? data->epoch : 0,
                             .data_pos = data ? data->pos : 0,
                             .data_fingerprint = data ? data->fingerprint : 0,
                             .reward_version = t->reward_version,
                             .config_hash = t->config_hash,
                             .adapter_checksum = 0};
    checkpoint_save_opts_t so = {0, NULL, CKPT_CRASH_NONE};
    if (opts)
        so = *opts;
    if (!so.base_model && t->model)
        so.base_model = t->model->path;
    if (!t->comm)
        return checkpoint_save(run_dir, t->adapter, &t->optim, &st, &so, name, cap);
    /* Expert parallelism: the whole adapter and AdamW state gathered on rank 0, which
     * writes; every rank returns rank 0's outcome. */
    const lora_adapter_t *ad = NULL;
    const optim_t *o = NULL;
    int rc = trainer_whole_state((trainer_t *)t, &ad, &o);
    if (rc == MO_OK && ad)
        rc = checkpoint_save(run_dir, ad, o, &st, &so, name, cap);
    int32_t out = rc < 0 ? rc : 0;
    int rc2 = comm_bcast(t->comm, &out, 1, DT_I32, 0);
    if (rc2 < 0)
        return rc2;
    if (out < 0 && comm_rank(t->comm) != 0)
        return mo_errorf(out, "checkpoint: rank 0 failed to save the step %lld checkpoint",
                         (long long)t->step);
    return rc < 0 ? rc : out;
}

typedef struct optim_backup {
    float *m, *v;
    int64_t step, skipped;
} optim_backup_t;

static int backup_optim(optim_backup_t *b, const optim_t *o) {
    size_t n = o->n ? o->n : 1;
    b->m = malloc(sizeof *b->m * n);
    b->v = malloc(sizeof *b->v * n);
    if (!b->m || !b->v) {
        free(b->m);
        free(b->v);
        return mo_errorf(MO_ENOMEM, "checkpoint: out of memory");
    }
    memcpy(b->m, o->m, sizeof *b->m * o->n);
    memcpy(b->v, o->v, sizeof *b->v * o->n);
    b->step = o->step;
    b->skipped = o->skipped;
    return MO_OK;
}

static void restore_optim(optim_t *o, const optim_backup_t *b) {
    memcpy(o->m, b->m, sizeof *b->m * o->n);
    memcpy(o->v, b->v, sizeof *b->v * o->n);
    o->step = b->step;
    o->skipped = b->skipped;
}

/* Expert parallelism: every rank loads the whole checkpoint and keeps its shard (any rank
 * count that divides E). The run directory must be readable by every rank. */
static int resume_sharded(trainer_t *t, const char *run_dir, checkpoint_state_t *st, char *used,
                          size_t cap, int *fell_back) {
    lora_adapter_t *whole = NULL;
    optim_t wo = {0};
    int rc = ep_shard_full_new(t->ep, &whole);
    if (rc == MO_OK)
        rc = optim_init(&wo, whole->n_params, &t->optim.hp, t->optim.k);
    if (rc == MO_OK)
        rc = checkpoint_load(run_dir, whole, &wo, st, used, cap, fell_back);
    if (rc == MO_OK)
        ep_shard_extract_state(t->ep, whole, &wo, t->adapter, &t->optim);
    lora_adapter_destroy(&whole);
    optim_free(&wo);
    return rc;
}

int checkpoint_resume_trainer(trainer_t *t, const char *run_dir, int allow_config_change,
                              checkpoint_data_t *data, char *name, size_t cap, int *fell_back) {
    optim_backup_t ob = {NULL, NULL, 0, 0};
    TRY(backup_optim(&ob, &t->optim));
    float *pb = malloc(sizeof *pb * (t->adapter->n_params ? t->adapter->n_params : 1));
    if (!pb) {
        free(ob.m);
        free(ob.v);
        return mo_errorf(MO_ENOMEM, "checkpoint: out of memory");
    }
    memcpy(pb, t->adapter->params, sizeof *pb * t->adapter->n_params);
    checkpoint_state_t st;
    char used[64] = "";
    int rc = t->ep ? resume_sharded(t, run_dir, &st, used, sizeof used, fell_back)
                   : checkpoint_load(run_dir, t->adapter, &t->optim, &st, used, sizeof used,
                                     fell_back);
    if (rc == MO_OK && !allow_config_change &&
        (st.config_hash != t->config_hash || st.seed != t->seed))
        rc = mo_errorf(MO_ECONFIG,
                       "checkpoint %s was saved under run.seed %" PRIu64 " and config hash "
                       "%016" PRIx64 "; this job has run.seed %" PRIu64 " and %016" PRIx64
                       " (a learner, lora, rollout sampling or seed setting changed)",
                       used, st.seed, st.config_hash, t->seed, t->config_hash);
    if (t->ep && ep_shard_any_failed(t->ep, rc) && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "checkpoint: another rank failed to resume from %s", run_dir);
    if (rc < 0) {
        restore_optim(&t->optim, &ob);
        memcpy(t->adapter->params, pb, sizeof *pb * t->adapter->n_params);
    } else {
        t->step = st.step;
        t->version = st.version;
        t->rng_counter = st.rng_counter;
        t->reward_version = st.reward_version;
        if (data) {
            data->epoch = st.data_epoch;
            data->pos = st.data_pos;
            data->fingerprint = st.data_fingerprint;
        }
        if (name)
            snprintf(name, cap, "%s", used);
    }
    free(pb);
    free(ob.m);
    free(ob.v);
    return rc;
}
