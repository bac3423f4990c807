/* runner: the run directory, checks before start, and the daemons' command lines of
 * `moerl run` (see runner.h). */
#include "learner/runner.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "core/status.h"
#include "learner/checkpoint.h"
#include "transport/zsock.h"

static int path_join(char *out, size_t cap, const char *a, const char *b) {
    int n = snprintf(out, cap, "%s/%s", a, b);
    if (n < 0 || (size_t)n >= cap)
        return mo_errorf(MO_EINVAL, "path %s/%s is longer than %zu bytes", a, b, cap - 1);
    return MO_OK;
}

int runner_paths(const moerl_config_t *c, runner_paths_t *p) {
    memset(p, 0, sizeof *p);
    TRY(config_run_dir(c, p->run_dir, sizeof p->run_dir));
    TRY(path_join(p->config, sizeof p->config, p->run_dir, "config.yaml"));
    TRY(path_join(p->logs, sizeof p->logs, p->run_dir, "logs"));
    TRY(path_join(p->metrics, sizeof p->metrics, p->run_dir, "metrics/learner.jsonl"));
    return MO_OK;
}

/* mkdir -p */
static int make_dirs(const char *path) {
    char buf[RUNNER_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *q = buf + 1;; q++) {
        char c = *q;
        if (c == '/' || c == 0) {
            *q = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return mo_errorf(MO_EIO, "cannot create directory %s: %s", buf, strerror(errno));
            struct stat st;
            if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
                return mo_errorf(MO_EIO, "%s is not a directory", buf);
            *q = c;
        }
        if (c == 0)
            break;
    }
    return MO_OK;
}

/* The latest checkpoint's name ("step-000050"), or "" when the run has none. */
static void latest_checkpoint(const char *run_dir, char *name, size_t cap) {
    char path[RUNNER_PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s/%s", run_dir, CKPT_DIR_NAME, CKPT_LATEST_NAME);
    name[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    if (fgets(name, (int)cap, f))
        name[strcspn(name, "\r\n")] = 0;
    fclose(f);
}

static int write_config(const moerl_config_t *c, const char *path) {
    char tmp[RUNNER_PATH_MAX + 32];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return mo_errorf(MO_EIO, "cannot write %s: %s", tmp, strerror(errno));
    fputs("# The resolved configuration of this run, written by `moerl run`: every\n"
          "# daemon of the job reads this file.\n",
          f);
    config_dump(c, f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        unlink(tmp);
        return mo_errorf(MO_EIO, "cannot write %s", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return mo_errorf(MO_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(e));
    }
    return MO_OK;
}

int runner_prepare(const moerl_config_t *c, bool resume, const runner_paths_t *p) {
    char latest[256];
    latest_checkpoint(p->run_dir, latest, sizeof latest);
    if (!resume && latest[0])
        return mo_errorf(MO_ESTATE,
                         "run directory %s already holds checkpoints (latest: %s): pass "
                         "--resume to continue that run, or set run.dir (or run.name) to "
                         "start a new one",
                         p->run_dir, latest);
    TRY(make_dirs(p->run_dir));
    TRY(make_dirs(p->logs));
    return write_config(c, p->config);
}

/* ---- Checks before start ---- */

typedef struct endpoint_use {
    char key[64];
    char endpoint[1024];
    bool bound; /* the job binds it (else it only connects) */
} endpoint_use_t;

static int collect_endpoints(const moerl_config_t *c, endpoint_use_t *e, int cap, int *n) {
    const config_transport_t *t = &c->transport;
    const struct {
        const char *key, *ep;
    } learner[] = {{"transport.control", t->control},
                   {"transport.work", t->work},
                   {"transport.trajectories", t->trajectories},
                   {"transport.weights", t->weights}};
    *n = 0;
    for (int i = 0; i < 4 && *n < cap; i++, (*n)++) {
        snprintf(e[*n].key, sizeof e[*n].key, "%s", learner[i].key);
        snprintf(e[*n].endpoint, sizeof e[*n].endpoint, "%s", learner[i].ep);
        e[*n].bound = true;
    }
    for (int i = 0; i < c->reward.workers && *n < cap; i++, (*n)++) {
        snprintf(e[*n].key, sizeof e[*n].key, "transport.reward (reward worker %d)", i);
        TRY(zsock_endpoint_nth(t->reward, i, e[*n].endpoint, sizeof e[*n].endpoint));
        e[*n].bound = true;
    }
    return MO_OK;
}

/* Binds a tcp endpoint for a moment: MO_EIO when another process holds it. */
static int probe_free(void *ctx, const endpoint_use_t *e, const zsock_opts_t *base) {
    if (strncmp(e->endpoint, "tcp://", 6) != 0)
        return MO_OK; /* ipc: binding would take the path over from a running job */
    zsock_opts_t o = *base;
    o.linger_ms = 0;
    o.curve = false; /* only the address matters here */
    o.allow_insecure_remote = true;
    void *s = NULL;
    int rc = zsock_bind(ctx, ZMQ_ROUTER, e->endpoint, &o, &s);
    zsock_close(&s);
    if (rc < 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", mo_last_error()); /* mo_errorf overwrites it */
        return mo_errorf(MO_EIO, "%s: %s; stop that process or give this job other ports", e->key,
                         why);
    }
    return MO_OK;
}

static int check_model_dir(const moerl_config_t *c) {
    char path[RUNNER_PATH_MAX + 32];
    struct stat st;
    if (!c->model.path || !*c->model.path || stat(c->model.path, &st) != 0 || !S_ISDIR(st.st_mode))
        return mo_errorf(MO_ECONFIG,
                         "model.path: '%s' is not a directory (make a model with `moerl "
                         "init-model`, or point model.path at a Hugging Face model directory)",
                         c->model.path ? c->model.path : "");
    snprintf(path, sizeof path, "%s/config.json", c->model.path);
    if (access(path, R_OK) != 0)
        return mo_errorf(MO_ECONFIG, "model.path: %s has no readable config.json", c->model.path);
    return MO_OK;
}

int runner_preflight(const moerl_config_t *c) {
    zsock_opts_t o;
    TRY(zsock_opts_from_config(&o, &c->transport));
    endpoint_use_t eps[4 + 256];
    int n = 0;
    TRY(collect_endpoints(c, eps, (int)(sizeof eps / sizeof eps[0]), &n));
    for (int i = 0; i < n; i++) {
        int rc = zsock_security_check(eps[i].endpoint, &o);
        if (rc < 0)
            return mo_error_wrap(rc, "%s", eps[i].key);
    }
    void *ctx = zmq_ctx_new();
    if (!ctx)
        return mo_errorf(MO_EIO, "cannot create a ZeroMQ context");
    int rc = MO_OK;
    for (int i = 0; i < n && rc == MO_OK; i++)
        if (eps[i].bound)
            rc = probe_free(ctx, &eps[i], &o);
    zmq_ctx_term(ctx); /* waits until every probe socket is closed */
    TRY(rc);
    return check_model_dir(c);
}

/* ---- Command lines ---- */

int runner_which(const char *prog, char *out, size_t cap) {
    if (strchr(prog, '/')) {
        if (access(prog, X_OK) != 0)
            return mo_errorf(MO_ENOTFOUND, "%s: not an executable file", prog);
        snprintf(out, cap, "%s", prog);
        return MO_OK;
    }
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        size_t len = strcspn(path, ":");
        int n = snprintf(out, cap, "%.*s/%s", (int)len, path, prog);
        if (len > 0 && n > 0 && (size_t)n < cap && access(out, X_OK) == 0)
            return MO_OK;
        path += len + (path[len] == ':');
    }
    out[0] = 0;
    return mo_errorf(MO_ENOTFOUND, "%s was not found in PATH", prog);
}

static char **argv_new(const char *const *words, int n) {
    char **v = calloc((size_t)n + 1, sizeof *v);
    for (int i = 0; v && i < n; i++) {
        if (!(v[i] = strdup(words[i]))) {
            for (int j = 0; j < i; j++)
                free(v[j]);
            free(v);
            return NULL;
        }
    }
    return v;
}

static int add_proc(runner_plan_t *p, const char *name, const char *const *words, int n,
                    bool primary) {
    runner_proc_t *q = &p->procs[p->n];
    snprintf(q->name, sizeof q->name, "%s", name);
    if (!(q->argv = argv_new(words, n)))
        return mo_errorf(MO_ENOMEM, "out of memory");
    q->primary = primary;
    q->restart = !primary;
    p->n++;
    return MO_OK;
}

static int plan_learner(const moerl_config_t *c, const runner_plan_opts_t *o, runner_plan_t *p) {
    const char *w[16];
    int n = 0;
    char np[16];
    if (c->learner.ranks > 1) {
        if (!o->mpirun || !*o->mpirun)
            return mo_errorf(MO_ECONFIG,
                             "learner.ranks is %d, which needs mpirun, and it was not found "
                             "(apt-get install openmpi-bin)",
                             c->learner.ranks);
        snprintf(np, sizeof np, "%d", c->learner.ranks);
        w[n++] = o->mpirun;
        w[n++] = "-np";
        w[n++] = np;
        if (o->as_root) {
            w[n++] = "--allow-run-as-root";
            w[n++] = "--oversubscribe";
        }
    }
    w[n++] = o->exe;
    w[n++] = "learner";
    w[n++] = o->config;
    if (o->resume)
        w[n++] = "--resume";
    return add_proc(p, "learner", w, n, true);
}

int runner_plan(const moerl_config_t *c, const runner_plan_opts_t *o, runner_plan_t *out) {
    memset(out, 0, sizeof *out);
    int total = 1 + c->rollout.workers + c->reward.workers;
    if (total > SUP_MAX_PROCS)
        return mo_errorf(MO_ECONFIG, "rollout.workers + reward.workers: %d processes, at most %d",
                         total - 1, SUP_MAX_PROCS - 1);
    out->procs = calloc((size_t)total, sizeof *out->procs);
    if (!out->procs)
        return mo_errorf(MO_ENOMEM, "out of memory");
    int rc = plan_learner(c, o, out);
    for (int i = 0; i < c->rollout.workers && rc == MO_OK; i++) {
        char name[SUP_NAME_MAX], id[16];
        snprintf(name, sizeof name, "rollout-%d", i);
        snprintf(id, sizeof id, "%d", i);
        const char *w[] = {o->exe, "rollout", o->config, "--worker-id", id};
        rc = add_proc(out, name, w, 5, false);
    }
    for (int i = 0; i < c->reward.workers && rc == MO_OK; i++) {
        char name[SUP_NAME_MAX], id[16];
        snprintf(name, sizeof name, "reward-%d", i);
        snprintf(id, sizeof id, "%d", i);
        const char *w[] = {o->exe, "reward", o->config, "--worker-id", id};
        rc = add_proc(out, name, w, 5, false);
    }
    if (rc < 0)
        runner_plan_free(out);
    return rc;
}

void runner_plan_free(runner_plan_t *p) {
    for (int i = 0; p->procs && i < p->n; i++) {
        for (int j = 0; p->procs[i].argv && p->procs[i].argv[j]; j++)
            free(p->procs[i].argv[j]);
        free(p->procs[i].argv);
    }
    free(p->procs);
    memset(p, 0, sizeof *p);
}

/* ---- The live status line ---- */

/* The metrics keys the status line reads, first match wins. */
static const char *const k_step[] = {"moerl_learner_step", NULL};
static const char *const k_reward[] = {"moerl_learner_reward_mean", NULL};
static const char *const k_accuracy[] = {"moerl_learner_accuracy", NULL}; /* of the samples */
static const char *const k_tps[] = {"moerl_rollout_tokens_per_s_total", NULL};
static const char *const k_sync[] = {"moerl_learner_weight_sync_ms", NULL};

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void runner_status_init(runner_status_t *st, const char *metrics_path, int64_t steps) {
    memset(st, 0, sizeof *st);
    snprintf(st->path, sizeof st->path, "%s", metrics_path);
    st->steps = steps;
    st->start_ms = mono_ms();
    st->step = -1;
    st->shown_step = -1;
    st->reward = st->accuracy = st->tokens_per_s = st->sync_ms = NAN;
}

/* The first of names that obj holds as a number; NaN when none. */
static double json_number(const cJSON *obj, const char *const *names) {
    for (int i = 0; names[i]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, names[i]);
        if (cJSON_IsNumber(v))
            return v->valuedouble;
    }
    return NAN;
}

static void status_line_json(runner_status_t *st, const char *line) {
    cJSON *o = cJSON_Parse(line);
    if (!o)
        return; /* not JSON (a torn write is completed later; anything else is ignored) */
    double step = json_number(o, k_step);
    if (isfinite(step) && step >= 0) {
        st->step = (int64_t)step;
        double v;
        if (isfinite(v = json_number(o, k_reward)))
            st->reward = v;
        if (isfinite(v = json_number(o, k_accuracy)))
            st->accuracy = v;
        if (isfinite(v = json_number(o, k_tps)))
            st->tokens_per_s = v;
        if (isfinite(v = json_number(o, k_sync)))
            st->sync_ms = v;
    }
    cJSON_Delete(o);
}

/* Feeds appended bytes, line by line. */
static void status_feed(runner_status_t *st, const char *data, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char c = data[i];
        if (c == '\n') {
            if (!st->skipping) {
                st->partial[st->plen] = 0;
                status_line_json(st, st->partial);
            }
            st->plen = 0;
            st->skipping = false;
        } else if (!st->skipping) {
            if (st->plen + 1 < sizeof st->partial)
                st->partial[st->plen++] = c;
            else
                st->skipping = true;
        }
    }
}

static void status_read(runner_status_t *st) {
    FILE *f = fopen(st->path, "r");
    if (!f)
        return;
    if (fseek(f, 0, SEEK_END) == 0 && ftell(f) < st->offset) { /* replaced: start over */
        st->offset = 0;
        st->plen = 0;
        st->skipping = false;
    }
    if (fseek(f, st->offset, SEEK_SET) == 0) {
        char buf[16384];
        size_t k;
        while ((k = fread(buf, 1, sizeof buf, f)) > 0) {
            status_feed(st, buf, k);
            st->offset += (long)k;
        }
    }
    fclose(f);
}

static void fmt_elapsed(double ms, char *buf, size_t cap) {
    long s = (long)(ms / 1000);
    if (s >= 3600)
        snprintf(buf, cap, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else
        snprintf(buf, cap, "%ldm%02lds", s / 60, s % 60);
}

static size_t append(char *buf, size_t cap, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static size_t append(char *buf, size_t cap, size_t len, const char *fmt, ...) {
    if (len >= cap)
        return len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
    return n < 0 ? len : len + (size_t)n;
}

int runner_status_poll(void *ud, char *buf, size_t cap) {
    runner_status_t *st = ud;
    status_read(st);
    char el[32];
    fmt_elapsed(mono_ms() - st->start_ms, el, sizeof el);
    if (st->step < 0) {
        snprintf(buf, cap, "waiting for the first step (model loading, first rollouts) %s", el);
        return SUP_STATUS_REDRAW;
    }
    size_t len = 0;
    if (st->steps > 0) {
        int fill = (int)(10 * (st->step < st->steps ? st->step : st->steps) / st->steps);
        len = append(buf, cap, len, "step %lld/%lld [%.*s%.*s]", (long long)st->step,
                     (long long)st->steps, fill, "##########", 10 - fill, "----------");
    } else {
        len = append(buf, cap, len, "step %lld", (long long)st->step);
    }
    if (isfinite(st->reward))
        len = append(buf, cap, len, " reward %.3f", st->reward);
    if (isfinite(st->accuracy))
        len = append(buf, cap, len, " | acc %.3f", st->accuracy);
    if (isfinite(st->tokens_per_s))
        len = append(buf, cap, len, st->tokens_per_s >= 1e4 ? " | %.1fk tok/s" : " | %.0f tok/s",
                     st->tokens_per_s >= 1e4 ? st->tokens_per_s / 1e3 : st->tokens_per_s);
    if (isfinite(st->sync_ms))
        len = append(buf, cap, len, " | sync %.0f ms", st->sync_ms);
    append(buf, cap, len, " | %s", el);
    if (st->step != st->shown_step) {
        st->shown_step = st->step;
        return SUP_STATUS_NEWS;
    }
    return SUP_STATUS_REDRAW;
}
