/* optim: AdamW with global grad-norm clipping, the learning-rate schedule,
 * non-finite step skipping, and atomic save/load of the state. */
#include "learner/optim.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/backend.h"
#include "core/status.h"

#define OPTIM_MAGIC "MOERLOPT"
#define OPTIM_VERSION 1u
#define OPTIM_HEADER 48u
#define CLIP_EPS 1e-6 /* torch.nn.utils.clip_grad_norm_ */
#define PI_D 3.14159265358979323846

optim_hp_t optim_hp_from_config(const config_learner_t *l) {
    optim_hp_t hp = {.lr = l->lr,
                     .schedule = l->lr_schedule,
                     .warmup_steps = l->warmup_steps,
                     .total_steps = l->steps * l->ppo_epochs * l->minibatches,
                     .min_lr_ratio = l->min_lr_ratio,
                     .beta1 = l->beta1,
                     .beta2 = l->beta2,
                     .eps = l->adam_eps,
                     .weight_decay = l->weight_decay,
                     .grad_clip = l->grad_clip};
    return hp;
}

double optim_lr(const optim_hp_t *hp, int64_t s) {
    int64_t W = hp->warmup_steps;
    if (s < W)
        return hp->lr * (double)(s + 1) / (double)W;
    if (hp->schedule == CFG_LR_CONSTANT)
        return hp->lr;
    int64_t span = hp->total_steps - 1 - W;
    double p = (double)(s - W) / (double)(span > 1 ? span : 1);
    p = p < 1.0 ? p : 1.0;
    double r = hp->min_lr_ratio;
    return hp->lr * (r + (1.0 - r) * 0.5 * (1.0 + cos(PI_D * p)));
}

double optim_grad_sqsum(const float *grad, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)grad[i] * grad[i];
    return s;
}

double optim_clip_coef(double norm, double max_norm) {
    if (max_norm <= 0)
        return 1.0;
    double c = max_norm / (norm + CLIP_EPS);
    return c < 1.0 ? c : 1.0;
}

static int check_hp(const optim_hp_t *hp) {
#define HP_CHECK(cond, field)                                                                      \
    if (!(cond))                                                                                   \
        return mo_errorf(MO_EINVAL, "optimizer: %s = %g is out of range (%s)", #field,             \
                         (double)hp->field, #cond);
    HP_CHECK(hp->lr > 0 && isfinite(hp->lr), lr)
    HP_CHECK(hp->beta1 >= 0 && hp->beta1 < 1, beta1)
    HP_CHECK(hp->beta2 >= 0 && hp->beta2 < 1, beta2)
    HP_CHECK(hp->eps > 0 && isfinite(hp->eps), eps)
    HP_CHECK(hp->weight_decay >= 0 && isfinite(hp->weight_decay), weight_decay)
    HP_CHECK(hp->grad_clip >= 0 && isfinite(hp->grad_clip), grad_clip)
    HP_CHECK(hp->min_lr_ratio >= 0 && hp->min_lr_ratio <= 1, min_lr_ratio)
    HP_CHECK(hp->warmup_steps >= 0, warmup_steps)
    HP_CHECK(hp->total_steps >= 0, total_steps)
    HP_CHECK(hp->schedule == CFG_LR_CONSTANT || hp->schedule == CFG_LR_COSINE, schedule)
#undef HP_CHECK
    return MO_OK;
}

int optim_init(optim_t *o, size_t n, const optim_hp_t *hp, const kernels_t *k) {
    memset(o, 0, sizeof *o);
    if (hp == NULL)
        return mo_errorf(MO_EINVAL, "optimizer: hyperparameters are NULL");
    TRY(check_hp(hp));
    o->m = calloc(n ? n : 1, sizeof(float));
    o->v = calloc(n ? n : 1, sizeof(float));
    if (!o->m || !o->v) {
        optim_free(o);
        return mo_errorf(MO_ENOMEM, "optimizer: cannot allocate moments of %zu floats", n);
    }
    o->k = k ? k : backend_cpu()->k;
    o->hp = *hp;
    o->n = n;
    return MO_OK;
}

void optim_free(optim_t *o) {
    free(o->m);
    free(o->v);
    free(o->nd_off);
    free(o->nd_len);
    memset(o, 0, sizeof *o);
}

int optim_no_decay(optim_t *o, size_t off, size_t len) {
    if (len == 0)
        return MO_OK;
    if (off > o->n || len > o->n - off)
        return mo_errorf(MO_EINVAL,
                         "optimizer: no-decay range [%zu, %zu) reaches past the %zu parameters",
                         off, off + len, o->n);
    int i = 0;
    while (i < o->n_nd && o->nd_off[i] < off)
        i++;
    size_t prev_end = i > 0 ? o->nd_off[i - 1] + o->nd_len[i - 1] : 0;
    if ((i > 0 && prev_end > off) || (i < o->n_nd && o->nd_off[i] < off + len)) {
        int j = i > 0 && prev_end > off ? i - 1 : i;
        return mo_errorf(MO_EINVAL,
                         "optimizer: no-decay range [%zu, %zu) overlaps [%zu, %zu) added before",
                         off, off + len, o->nd_off[j], o->nd_off[j] + o->nd_len[j]);
    }
    size_t *a = realloc(o->nd_off, sizeof *a * (size_t)(o->n_nd + 1));
    if (a)
        o->nd_off = a;
    size_t *b = a ? realloc(o->nd_len, sizeof *b * (size_t)(o->n_nd + 1)) : NULL;
    if (!b)
        return mo_errorf(MO_ENOMEM, "optimizer: out of memory for no-decay ranges");
    o->nd_len = b;
    memmove(o->nd_off + i + 1, o->nd_off + i, sizeof *a * (size_t)(o->n_nd - i));
    memmove(o->nd_len + i + 1, o->nd_len + i, sizeof *b * (size_t)(o->n_nd - i));
    o->nd_off[i] = off;
    o->nd_len[i] = len;
    o->n_nd++;
    return MO_OK;
}

/* AdamW on [off, off + len) with weight decay wd. */
static void update_range(optim_t *o, float *param, float *grad, size_t off, size_t len, float lr,
                         double wd) {
    if (len == 0)
        return;
    o->k->adamw_update(param + off, grad + off, o->m + off, o->v + off, len, lr, (float)o->hp.beta1,
                       (float)o->hp.beta2, (float)o->hp.eps, (float)wd, (int)(o->step + 1));
}

/* AdamW on the whole buffer: the no-decay ranges without weight decay, the gaps with. */
static void update_all(optim_t *o, float *param, float *grad, float lr) {
    size_t at = 0;
    for (int i = 0; i < o->n_nd; i++) {
        update_range(o, param, grad, at, o->nd_off[i] - at, lr, o->hp.weight_decay);
        update_range(o, param, grad, o->nd_off[i], o->nd_len[i], lr, 0.0);
        at = o->nd_off[i] + o->nd_len[i];
    }
    update_range(o, param, grad, at, o->n - at, lr, o->hp.weight_decay);
}

const char *optim_outcome_name(optim_outcome_t r) {
    switch (r) {
    case OPTIM_APPLIED: return "applied";
    case OPTIM_SKIP_LOSS: return "non-finite loss";
    case OPTIM_SKIP_GRAD: return "non-finite gradient";
    case OPTIM_SKIP_NORM: return "non-finite grad norm";
    }
    return "unknown";
}

static int64_t first_nonfinite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return (int64_t)i;
    return -1;
}

int optim_step(optim_t *o, float *param, float *grad, double loss, const double *global_sqsum,
               optim_result_t *res) {
    if (!o || !o->m || ((!param || !grad) && o->n > 0))
        return mo_errorf(MO_EINVAL, "optimizer step: NULL optimizer, parameters or gradient");
    optim_result_t r = {OPTIM_APPLIED, 0.0, 1.0, 0.0, -1, o->step};
    double local = optim_grad_sqsum(grad, o->n);
    double sq = global_sqsum ? *global_sqsum : local;
    r.grad_norm = sqrt(sq);
    if (!isfinite(loss))
        r.outcome = OPTIM_SKIP_LOSS;
    else if (!isfinite(local)) {
        r.outcome = OPTIM_SKIP_GRAD;
        r.bad_index = first_nonfinite(grad, o->n);
    } else if (!isfinite(r.grad_norm))
        r.outcome = OPTIM_SKIP_NORM;
    if (r.outcome != OPTIM_APPLIED) {
        o->skipped++;
        if (res)
            *res = r;
        return MO_OK;
    }
    r.clip_coef = optim_clip_coef(r.grad_norm, o->hp.grad_clip);
    if (r.clip_coef < 1.0)
        for (size_t i = 0; i < o->n; i++)
            grad[i] = (float)(grad[i] * r.clip_coef);
    r.lr = optim_lr(&o->hp, o->step);
    MO_ASSERT(o->step < INT_MAX);
    update_all(o, param, grad, (float)r.lr);
    o->step++;
    r.step = o->step;
    if (res)
        *res = r;
    return MO_OK;
}

/* ---- Save and load ---- */

/* FNV-1a over 64-bit little-endian words (bytes past the last whole word
 * one at a time): any change of a single word changes the result. */
#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

static uint64_t checksum(uint64_t h, const void *p, size_t bytes) {
    const unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w = 0;
        for (int j = 7; j >= 0; j--)
            w = (w << 8) | b[i + (size_t)j];
        h = (h ^ w) * FNV_PRIME;
    }
    for (; i < bytes; i++)
        h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

static void put_u32(unsigned char *p, uint32_t x) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(x >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t x) {
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(x >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p) {
    uint32_t x = 0;
    for (int i = 3; i >= 0; i--)
        x = (x << 8) | p[i];
    return x;
}

static uint64_t get_u64(const unsigned char *p) {
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | p[i];
    return x;
}

static int host_little_endian(void) {
    uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static uint64_t state_checksum(const unsigned char *hdr, const float *m, const float *v, size_t n) {
    uint64_t h = checksum(FNV_OFFSET, hdr, 40);
    h = checksum(h, m, n * sizeof(float));
    return checksum(h, v, n * sizeof(float));
}

static int write_all(int fd, const void *p, size_t bytes) {
    const char *c = p;
    while (bytes > 0) {
        ssize_t w = write(fd, c, bytes);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        bytes -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t bytes) {
    char *c = p;
    while (bytes > 0) {
        ssize_t r = read(fd, c, bytes);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        bytes -= (size_t)r;
    }
    return 0;
}

/* fsync of the directory holding path, so a rename into it is durable. */
static int sync_parent(const char *path) {
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (slash == NULL)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

static int write_state(int fd, const optim_t *o) {
    unsigned char hdr[OPTIM_HEADER];
    memcpy(hdr, OPTIM_MAGIC, 8);
    put_u32(hdr + 8, OPTIM_VERSION);
    put_u32(hdr + 12, OPTIM_HEADER);
    put_u64(hdr + 16, (uint64_t)o->n);
    put_u64(hdr + 24, (uint64_t)o->step);
    put_u64(hdr + 32, (uint64_t)o->skipped);
    put_u64(hdr + 40, state_checksum(hdr, o->m, o->v, o->n));
    if (write_all(fd, hdr, sizeof hdr) || write_all(fd, o->m, o->n * sizeof(float)) ||
        write_all(fd, o->v, o->n * sizeof(float)) || fsync(fd))
        return -1;
    return 0;
}

int optim_save(const optim_t *o, const char *path) {
    if (!host_little_endian())
        return mo_errorf(MO_EUNSUPPORTED, "optimizer state: big-endian hosts are not supported");
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return mo_errorf(MO_EINVAL, "optimizer state: path too long: %s", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return mo_errorf(MO_EIO, "optimizer state: cannot create %s: %s", tmp, strerror(errno));
    int rc = write_state(fd, o);
    int err = errno;
    if (close(fd) != 0 && rc == 0) {
        rc = -1;
        err = errno;
    }
    if (rc != 0) {
        unlink(tmp);
        return mo_errorf(MO_EIO, "optimizer state: cannot write %s: %s", tmp, strerror(err));
    }
    if (rename(tmp, path) != 0) {
        err = errno;
        unlink(tmp);
        return mo_errorf(MO_EIO, "optimizer state: cannot rename %s to %s: %s", tmp, path,
                         strerror(err));
    }
    if (sync_parent(path) != 0)
        return mo_errorf(MO_EIO, "optimizer state: cannot sync the directory of %s: %s", path,
                         strerror(errno));
    return MO_OK;
}

/* Checks the header against o and the file size; fills *step, *skipped. */
static int check_header(const unsigned char *hdr, off_t size, const optim_t *o, const char *path,
                        int64_t *step, int64_t *skipped) {
    if (memcmp(hdr, OPTIM_MAGIC, 8) != 0)
        return mo_errorf(MO_EMALFORMED, "optimizer state %s: bad magic (not an optimizer state)",
                         path);
    uint32_t version = get_u32(hdr + 8), hbytes = get_u32(hdr + 12);
    if (version != OPTIM_VERSION)
        return mo_errorf(MO_EUNSUPPORTED, "optimizer state %s: version %u, this build reads %u",
                         path, version, OPTIM_VERSION);
    if (hbytes != OPTIM_HEADER)
        return mo_errorf(MO_EMALFORMED, "optimizer state %s: header of %u bytes, expected %u", path,
                         hbytes, OPTIM_HEADER);
    uint64_t n = get_u64(hdr + 16);
    if (n != (uint64_t)o->n)
        return mo_errorf(MO_EINVAL,
                         "optimizer state %s: holds %llu parameters, the optimizer has %zu", path,
                         (unsigned long long)n, o->n);
    uint64_t want = OPTIM_HEADER + 2 * (uint64_t)o->n * sizeof(float);
    if ((uint64_t)size != want)
        return mo_errorf(MO_EMALFORMED, "optimizer state %s: %lld bytes, expected %llu", path,
                         (long long)size, (unsigned long long)want);
    *step = (int64_t)get_u64(hdr + 24);
    *skipped = (int64_t)get_u64(hdr + 32);
    if (*step < 0 || *step >= INT_MAX || *skipped < 0)
        return mo_errorf(MO_EMALFORMED, "optimizer state %s: step %lld or skipped %lld invalid",
                         path, (long long)*step, (long long)*skipped);
    return MO_OK;
}

static int load_fd(optim_t *o, int fd, const char *path) {
    struct stat sb;
    unsigned char hdr[OPTIM_HEADER];
    if (fstat(fd, &sb) != 0)
        return mo_errorf(MO_EIO, "optimizer state %s: %s", path, strerror(errno));
    if (sb.st_size < (off_t)OPTIM_HEADER)
        return mo_errorf(MO_EMALFORMED,
                         "optimizer state %s: %lld bytes, shorter than the %u-byte header",
                         path, (long long)sb.st_size, OPTIM_HEADER);
    if (read_all(fd, hdr, sizeof hdr) != 0)
        return mo_errorf(MO_EIO, "optimizer state %s: cannot read: %s", path, strerror(errno));
    int64_t step = 0, skipped = 0;
    TRY(check_header(hdr, sb.st_size, o, path, &step, &skipped));
    size_t n = o->n;
    float *m = malloc(n ? n * sizeof(float) : 1), *v = malloc(n ? n * sizeof(float) : 1);
    int rc = MO_OK;
    if (!m || !v)
        rc = mo_errorf(MO_ENOMEM, "optimizer state %s: cannot allocate %zu floats", path, 2 * n);
    else if (read_all(fd, m, n * sizeof(float)) || read_all(fd, v, n * sizeof(float)))
        rc = mo_errorf(MO_EIO, "optimizer state %s: cannot read the moments: %s", path,
                       strerror(errno));
    else if (state_checksum(hdr, m, v, n) != get_u64(hdr + 40))
        rc = mo_errorf(MO_EMALFORMED, "optimizer state %s: checksum mismatch (file corrupt)", path);
    if (rc != MO_OK) {
        free(m);
        free(v);
        return rc;
    }
    free(o->m);
    free(o->v);
    o->m = m;
    o->v = v;
    o->step = step;
    o->skipped = skipped;
    return MO_OK;
}

int optim_load(optim_t *o, const char *path) {
    if (!host_little_endian())
        return mo_errorf(MO_EUNSUPPORTED, "optimizer state: big-endian hosts are not supported");
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return mo_errorf(MO_EIO, "optimizer state: cannot open %s: %s", path, strerror(errno));
    int rc = load_fd(o, fd, path);
    close(fd);
    return rc;
}
