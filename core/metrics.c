/* metrics: counters and gauges, status sections, JSON lines, Prometheus over HTTP, logs. */
#include "core/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>

#include <microhttpd.h>

#include "core/status.h"

typedef struct series {
    char name[METRICS_MAX_NAME + 1];
    char *help;
    metric_kind_t kind;
    int n_labels;
    char *lkey[METRICS_MAX_LABELS];
    char *lval[METRICS_MAX_LABELS];
    char *key; /* name or name{k=v,...} */
    double value;
} series_t;

typedef struct peer_log {
    char *peer;
    uint64_t last_ms;
    bool logged;
} peer_log_t;

struct metrics {
    pthread_mutex_t mu;
    char daemon[128];
    series_t *s; /* (n) */
    int n, cap;
    FILE *jsonl;
    char *jsonl_path;
    FILE *log;
    peer_log_t *peers; /* (n_peers) */
    int n_peers, cap_peers;
    struct MHD_Daemon *http;
    int http_port;
};

int metrics_new(metrics_t **out, const char *daemon) {
    *out = NULL;
    metrics_t *m = calloc(1, sizeof *m);
    if (!m)
        return mo_errorf(MO_ENOMEM, "metrics: out of memory");
    pthread_mutex_init(&m->mu, NULL);
    snprintf(m->daemon, sizeof m->daemon, "%s", daemon ? daemon : "moerl");
    *out = m;
    return MO_OK;
}

static void series_free(series_t *s) {
    free(s->help);
    free(s->key);
    for (int i = 0; i < s->n_labels; i++) {
        free(s->lkey[i]);
        free(s->lval[i]);
    }
}

void metrics_destroy(metrics_t **pm) {
    metrics_t *m = pm ? *pm : NULL;
    if (!m)
        return;
    *pm = NULL;
    if (m->http)
        MHD_stop_daemon(m->http);
    if (m->jsonl)
        fclose(m->jsonl);
    free(m->jsonl_path);
    for (int i = 0; i < m->n; i++)
        series_free(&m->s[i]);
    free(m->s);
    for (int i = 0; i < m->n_peers; i++)
        free(m->peers[i].peer);
    free(m->peers);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const char *metrics_daemon(const metrics_t *m) {
    return m->daemon;
}

/* ---- Registration ---- */

static bool name_ok(const char *s, bool colon) {
    size_t n = strlen(s);
    if (n == 0 || n > METRICS_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        bool ok = alpha || (i > 0 && c >= '0' && c <= '9') || (colon && c == ':');
        if (!ok)
            return false;
    }
    return true;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static int count_labels(const char *const *labels, const char *name) {
    int n = 0;
    if (!labels)
        return 0;
    while (labels[2 * n]) {
        if (n == METRICS_MAX_LABELS)
            return mo_errorf(MO_EINVAL, "metric %s: more than %d labels", name, METRICS_MAX_LABELS);
        const char *k = labels[2 * n], *v = labels[2 * n + 1];
        if (!name_ok(k, false))
            return mo_errorf(MO_EINVAL, "metric %s: bad label name '%s'", name, k);
        if (!v || strlen(v) > METRICS_MAX_LABEL)
            return mo_errorf(MO_EINVAL, "metric %s: label %s: missing or over-long value", name, k);
        n++;
    }
    return n;
}

static bool same_labels(const series_t *s, const char *const *labels, int n) {
    if (s->n_labels != n)
        return false;
    for (int i = 0; i < n; i++)
        if (strcmp(s->lkey[i], labels[2 * i]) || strcmp(s->lval[i], labels[2 * i + 1]))
            return false;
    return true;
}

/* name{k=v,...} */
static char *make_key(const char *name, const char *const *labels, int n) {
    size_t len = strlen(name) + 3;
    for (int i = 0; i < n; i++)
        len += strlen(labels[2 * i]) + strlen(labels[2 * i + 1]) + 2;
    char *k = malloc(len);
    if (!k)
        return NULL;
    size_t o = (size_t)snprintf(k, len, "%s", name);
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(k + o, len - o, "%s%s=%s", i ? "," : "{", labels[2 * i],
                              labels[2 * i + 1]);
    if (n)
        snprintf(k + o, len - o, "}");
    return k;
}

static int add_series(metrics_t *m, metric_kind_t kind, const char *name, const char *help,
                      const char *const *labels, int n) {
    if (m->n == METRICS_MAX_SERIES)
        return mo_errorf(MO_EINVAL, "metrics: more than %d series", METRICS_MAX_SERIES);
    if (m->n == m->cap) {
        int cap = m->cap ? 2 * m->cap : 64;
        series_t *s = realloc(m->s, sizeof *s * (size_t)cap);
        if (!s)
            return mo_errorf(MO_ENOMEM, "metrics: out of memory");
        m->s = s;
        m->cap = cap;
    }
    series_t *s = &m->s[m->n];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    s->kind = kind;
    s->help = dup_str(help ? help : "");
    s->key = make_key(name, labels, n);
    bool ok = s->help && s->key;
    for (int i = 0; i < n && ok; i++) {
        s->lkey[i] = dup_str(labels[2 * i]);
        s->lval[i] = dup_str(labels[2 * i + 1]);
        s->n_labels = i + 1;
        ok = s->lkey[i] && s->lval[i];
    }
    if (!ok) {
        series_free(s);
        return mo_errorf(MO_ENOMEM, "metrics: out of memory");
    }
    return m->n++;
}

int metrics_series(metrics_t *m, metric_kind_t kind, const char *name, const char *help,
                   const char *const *labels, int *id) {
    *id = -1;
    if (!name_ok(name, true))
        return mo_errorf(MO_EINVAL, "metrics: bad metric name '%s'", name);
    if (kind != METRIC_COUNTER && kind != METRIC_GAUGE)
        return mo_errorf(MO_EINVAL, "metrics: %s: bad kind %d", name, (int)kind);
    int n = count_labels(labels, name);
    if (n < 0)
        return n;
    pthread_mutex_lock(&m->mu);
    int rc = MO_OK, found = -1;
    for (int i = 0; i < m->n && found < 0 && rc == MO_OK; i++) {
        if (strcmp(m->s[i].name, name) != 0)
            continue;
        if (m->s[i].kind != kind)
            rc = mo_errorf(MO_EINVAL, "metrics: %s is registered as a %s", name,
                           m->s[i].kind == METRIC_COUNTER ? "counter" : "gauge");
        else if (same_labels(&m->s[i], labels, n))
            found = i;
    }
    if (rc == MO_OK)
        rc = found >= 0 ? found : add_series(m, kind, name, help, labels, n);
    pthread_mutex_unlock(&m->mu);
    if (rc < 0)
        return rc;
    *id = rc;
    return MO_OK;
}

int metrics_counter(metrics_t *m, const char *name, const char *help) {
    int id;
    return metrics_series(m, METRIC_COUNTER, name, help, NULL, &id) < 0 ? -1 : id;
}

int metrics_gauge(metrics_t *m, const char *name, const char *help) {
    int id;
    return metrics_series(m, METRIC_GAUGE, name, help, NULL, &id) < 0 ? -1 : id;
}

void metrics_inc(metrics_t *m, int id, double delta) {
    if (!(delta > 0))
        return;
    pthread_mutex_lock(&m->mu);
    if (id >= 0 && id < m->n)
        m->s[id].value += delta;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set(metrics_t *m, int id, double value) {
    pthread_mutex_lock(&m->mu);
    if (id >= 0 && id < m->n)
        m->s[id].value = value;
    pthread_mutex_unlock(&m->mu);
}

double metrics_value(metrics_t *m, int id) {
    pthread_mutex_lock(&m->mu);
    double v = id >= 0 && id < m->n ? m->s[id].value : NAN;
    pthread_mutex_unlock(&m->mu);
    return v;
}

void metrics_foreach(metrics_t *m, metrics_visit_fn fn, void *arg) {
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n; i++)
        fn(m->s[i].key, m->s[i].kind, m->s[i].value, arg);
    pthread_mutex_unlock(&m->mu);
}

/* ---- Output ---- */

static void put_number(FILE *f, double v, bool json) {
    if (isnan(v))
        fputs(json ? "null" : "NaN", f);
    else if (isinf(v))
        fputs(json ? "null" : (v > 0 ? "+Inf" : "-Inf"), f);
    else if (v == floor(v) && fabs(v) < 1e15)
        fprintf(f, "%.0f", v);
    else
        fprintf(f, "%.9g", v);
}

void metrics_print(metrics_t *m, FILE *out) {
    pthread_mutex_lock(&m->mu);
    fprintf(out, "# %s\n", m->daemon);
    for (int i = 0; i < m->n; i++) {
        fprintf(out, "%s ", m->s[i].key);
        put_number(out, m->s[i].value, false);
        fputc('\n', out);
    }
    pthread_mutex_unlock(&m->mu);
}

/* Escapes for a Prometheus label value or HELP text (quote only in label values). */
static void put_escaped(FILE *f, const char *s, bool quote) {
    for (; *s; s++) {
        if (*s == '\\')
            fputs("\\\\", f);
        else if (*s == '\n')
            fputs("\\n", f);
        else if (quote && *s == '"')
            fputs("\\\"", f);
        else
            fputc(*s, f);
    }
}

static void prom_series(FILE *f, const series_t *s) {
    fputs(s->name, f);
    for (int i = 0; i < s->n_labels; i++) {
        fprintf(f, "%s%s=\"", i ? "," : "{", s->lkey[i]);
        put_escaped(f, s->lval[i], true);
        fputc('"', f);
    }
    if (s->n_labels)
        fputc('}', f);
    fputc(' ', f);
    put_number(f, s->value, false);
    fputc('\n', f);
}

int metrics_prometheus(metrics_t *m, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    FILE *f = open_memstream(out, len);
    if (!f)
        return mo_errorf(MO_ENOMEM, "metrics: out of memory");
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = !strcmp(m->s[j].name, m->s[i].name);
        if (seen)
            continue;
        fprintf(f, "# HELP %s ", m->s[i].name);
        put_escaped(f, m->s[i].help, false);
        fprintf(f, "\n# TYPE %s %s\n", m->s[i].name,
                m->s[i].kind == METRIC_COUNTER ? "counter" : "gauge");
        for (int j = i; j < m->n; j++)
            if (!strcmp(m->s[j].name, m->s[i].name))
                prom_series(f, &m->s[j]);
    }
    pthread_mutex_unlock(&m->mu);
    if (fclose(f) != 0 || !*out) {
        free(*out);
        *out = NULL;
        return mo_errorf(MO_ENOMEM, "metrics: out of memory");
    }
    return MO_OK;
}

static int mkdir_parent(const char *path) {
    char dir[4096];
    if (snprintf(dir, sizeof dir, "%s", path) >= (int)sizeof dir)
        return mo_errorf(MO_EINVAL, "%s: path too long", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return MO_OK;
    *slash = '\0';
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(dir, 0755) != 0 && errno != EEXIST)
            return mo_errorf(MO_EIO, "%s: cannot create: %s", dir, strerror(errno));
        *p = '/';
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return mo_errorf(MO_EIO, "%s: cannot create: %s", dir, strerror(errno));
    return MO_OK;
}

int metrics_jsonl_open(metrics_t *m, const char *path) {
    TRY(mkdir_parent(path));
    FILE *f = fopen(path, "a");
    if (!f)
        return mo_errorf(MO_EIO, "%s: cannot open for appending: %s", path, strerror(errno));
    char *p = dup_str(path);
    if (!p) {
        fclose(f);
        return mo_errorf(MO_ENOMEM, "metrics: out of memory");
    }
    pthread_mutex_lock(&m->mu);
    if (m->jsonl)
        fclose(m->jsonl);
    free(m->jsonl_path);
    m->jsonl = f;
    m->jsonl_path = p;
    pthread_mutex_unlock(&m->mu);
    return MO_OK;
}

static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

int metrics_jsonl_write(metrics_t *m, const char *event) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    pthread_mutex_lock(&m->mu);
    FILE *f = m->jsonl;
    int rc = MO_OK;
    if (f) {
        fprintf(f, "{\"time\": %lld.%03ld, \"daemon\": ", (long long)ts.tv_sec,
                ts.tv_nsec / 1000000L);
        put_json_string(f, m->daemon);
        fputs(", \"event\": ", f);
        put_json_string(f, event ? event : "");
        for (int i = 0; i < m->n; i++) {
            fputs(", ", f);
            put_json_string(f, m->s[i].key);
            fputs(": ", f);
            put_number(f, m->s[i].value, true);
        }
        fputs("}\n", f);
        if (fflush(f) != 0 || ferror(f))
            rc = mo_errorf(MO_EIO, "%s: write failed: %s", m->jsonl_path, strerror(errno));
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

/* ---- HTTP ---- */

static enum MHD_Result on_http(void *cls, struct MHD_Connection *c, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **state) {
    (void)version;
    (void)upload;
    (void)upload_size;
    (void)state;
    metrics_t *m = cls;
    unsigned code = MHD_HTTP_OK;
    char *body = NULL;
    size_t len = 0;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        code = MHD_HTTP_METHOD_NOT_ALLOWED;
    } else if (strcmp(url, "/metrics") != 0) {
        code = MHD_HTTP_NOT_FOUND;
    } else if (metrics_prometheus(m, &body, &len) < 0) {
        code = MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
    if (code != MHD_HTTP_OK) {
        static const char *const texts[] = {"method not allowed\n", "not found\n", "error\n"};
        const char *t = code == MHD_HTTP_METHOD_NOT_ALLOWED ? texts[0]
                        : code == MHD_HTTP_NOT_FOUND        ? texts[1]
                                                            : texts[2];
        body = dup_str(t);
        len = body ? strlen(body) : 0;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type",
                            code == MHD_HTTP_OK ? "text/plain; version=0.0.4; charset=utf-8"
                                                : "text/plain");
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

int metrics_http_start(metrics_t *m, int port, bool any_interface) {
    if (port < 1 || port > 65535)
        return mo_errorf(MO_EINVAL, "metrics: port %d out of 1..65535", port);
    if (m->http)
        return mo_errorf(MO_ESTATE, "metrics: already serving on port %d", m->http_port);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(any_interface ? INADDR_ANY : INADDR_LOOPBACK);
    m->http = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, (uint16_t)port, NULL, NULL, on_http,
                               m, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                               MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!m->http)
        return mo_errorf(MO_EIO,
                         "metrics.http_port: cannot serve on %s:%d (the port is in use, or not "
                         "permitted)",
                         any_interface ? "0.0.0.0" : "127.0.0.1", port);
    m->http_port = port;
    return MO_OK;
}

int metrics_http_port(const metrics_t *m) {
    return m->http ? m->http_port : 0;
}

/* ---- Logging ---- */

void metrics_set_log(metrics_t *m, FILE *out) {
    pthread_mutex_lock(&m->mu);
    m->log = out;
    pthread_mutex_unlock(&m->mu);
}

static void vlog(metrics_t *m, const char *fmt, va_list ap) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char line[2048];
    size_t o = strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
    o += (size_t)snprintf(line + o, sizeof line - o, ".%03ldZ %s: ", ts.tv_nsec / 1000000L,
                          m->daemon);
    if (o < sizeof line)
        vsnprintf(line + o, sizeof line - o, fmt, ap);
    FILE *f = m->log ? m->log : stderr;
    fprintf(f, "%s\n", line);
    fflush(f);
}

void metrics_log(metrics_t *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&m->mu);
    vlog(m, fmt, ap);
    pthread_mutex_unlock(&m->mu);
    va_end(ap);
}

static peer_log_t *peer_slot(metrics_t *m, const char *peer) {
    for (int i = 0; i < m->n_peers; i++)
        if (!strcmp(m->peers[i].peer, peer))
            return &m->peers[i];
    if (m->n_peers == m->cap_peers) {
        int cap = m->cap_peers ? 2 * m->cap_peers : 16;
        peer_log_t *p = realloc(m->peers, sizeof *p * (size_t)cap);
        if (!p)
            return NULL;
        m->peers = p;
        m->cap_peers = cap;
    }
    peer_log_t *p = &m->peers[m->n_peers];
    p->peer = dup_str(peer);
    if (!p->peer)
        return NULL;
    p->last_ms = 0;
    p->logged = false;
    m->n_peers++;
    return p;
}

static void log_locked(metrics_t *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_locked(metrics_t *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(m, fmt, ap);
    va_end(ap);
}

int metrics_malformed(metrics_t *m, const char *type, const char *peer, const char *why,
                      uint64_t now_ms) {
    const char *labels[] = {"type", type ? type : "?", "peer", peer ? peer : "", NULL};
    int id;
    double count = 1;
    if (metrics_series(m, METRIC_COUNTER, "moerl_malformed_messages_total",
                       "Malformed messages received and dropped, by expected type and peer.",
                       labels, &id) == MO_OK) {
        metrics_inc(m, id, 1);
        count = metrics_value(m, id);
    }
    pthread_mutex_lock(&m->mu);
    peer_log_t *p = peer_slot(m, labels[3]);
    int logged = 0;
    if (!p || !p->logged || now_ms >= p->last_ms + METRICS_LOG_EVERY_MS) {
        log_locked(m, "malformed %s from %s dropped (%.0f of this kind so far): %s", labels[1],
                   *labels[3] ? labels[3] : "an unknown peer", count, why ? why : "");
        if (p) {
            p->logged = true;
            p->last_ms = now_ms;
        }
        logged = 1;
    }
    pthread_mutex_unlock(&m->mu);
    return logged;
}
