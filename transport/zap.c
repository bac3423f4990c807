/* zap: a ZAP handler thread admitting CURVE clients on an allow-list. */
#include "transport/zap.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <zmq.h>

#include "core/status.h"
#include "transport/zsock.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define ZAP_MAX_KEYS 65536

struct zap {
    void *rep;       /* bound on ZAP_ENDPOINT; the thread's */
    void *ctl_in;    /* PAIR, the thread's end of the stop channel */
    void *ctl_out;   /* PAIR, zap_stop's end */
    zap_key_t *keys; /* (n) sorted */
    int n;
    pthread_t thread;
    pthread_mutex_t mu;
    uint64_t admitted, refused; /* under mu */
    zap_key_t last_refused;     /* under mu */
};

/* ---- Allow-list ---- */

static int key_cmp(const void *a, const void *b) {
    return memcmp(a, b, ZAP_KEY_LEN);
}

/* Appends key (checked Z85 of 32 bytes) to the list. */
static int add_key(zap_key_t **keys, int *n, int *cap, const char *key, const char *where) {
    uint8_t raw[32];
    if (strlen(key) != ZAP_KEY_LEN || !zmq_z85_decode(raw, key))
        return mo_errorf(MO_ECONFIG, "%s: not a 40-character Z85 CURVE public key", where);
    if (*n >= ZAP_MAX_KEYS)
        return mo_errorf(MO_ECONFIG, "%s: more than %d keys", where, ZAP_MAX_KEYS);
    if (*n == *cap) {
        int nc = *cap ? 2 * *cap : 16;
        zap_key_t *k = realloc(*keys, sizeof *k * (size_t)nc);
        if (!k)
            return mo_errorf(MO_ENOMEM, "out of memory");
        *keys = k;
        *cap = nc;
    }
    memcpy((*keys)[(*n)++], key, ZAP_KEY_LEN + 1);
    return MO_OK;
}

/* A file of keys, one a line. */
static int load_file(const char *path, zap_key_t **keys, int *n, int *cap) {
    FILE *f = fopen(path, "r");
    if (!f)
        return mo_errorf(MO_ECONFIG, "%s: %s", path, strerror(errno));
    char line[512], where[4200];
    int rc = MO_OK, lineno = 0;
    while (rc == MO_OK && fgets(line, sizeof line, f)) {
        lineno++;
        snprintf(where, sizeof where, "%s:%d", path, lineno);
        if (!strchr(line, '\n') && !feof(f)) {
            rc = mo_errorf(MO_ECONFIG, "%s: line too long", where);
            break;
        }
        char *p = line, *e;
        while (*p == ' ' || *p == '\t')
            p++;
        e = p + strlen(p);
        while (e > p && (e[-1] == '\n' || e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t'))
            *--e = '\0';
        if (*p == '\0' || *p == '#')
            continue;
        rc = add_key(keys, n, cap, p, where);
    }
    fclose(f);
    return rc;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* A directory of NAME.pub files. */
static int load_dir(const char *path, zap_key_t **keys, int *n, int *cap) {
    DIR *dir = opendir(path);
    if (!dir)
        return mo_errorf(MO_ECONFIG, "%s: %s", path, strerror(errno));
    int rc = MO_OK;
    struct dirent *e;
    while (rc == MO_OK && (e = readdir(dir)) != NULL) {
        if (e->d_name[0] == '.' || !ends_with(e->d_name, ".pub"))
            continue;
        char file[4400];
        zap_key_t key;
        snprintf(file, sizeof file, "%s/%s", path, e->d_name);
        rc = zsock_curve_read_key(file, false, key);
        if (rc == MO_OK)
            rc = add_key(keys, n, cap, key, file);
    }
    closedir(dir);
    return rc;
}

int zap_allowlist_load(const char *path, zap_key_t **keys, int *n) {
    *keys = NULL;
    *n = 0;
    if (!path || !*path)
        return mo_errorf(MO_ECONFIG, "CURVE allow-list: no path");
    struct stat st;
    if (stat(path, &st) != 0)
        return mo_errorf(MO_ECONFIG, "%s: %s", path, strerror(errno));
    int cap = 0;
    int rc = S_ISDIR(st.st_mode) ? load_dir(path, keys, n, &cap) : load_file(path, keys, n, &cap);
    if (rc == MO_OK && *n == 0)
        rc = mo_errorf(MO_ECONFIG, "%s: no CURVE public key in the allow-list%s", path,
                       S_ISDIR(st.st_mode) ? " (no *.pub file)" : "");
    if (rc < 0) {
        free(*keys);
        *keys = NULL;
        *n = 0;
        return rc;
    }
    qsort(*keys, (size_t)*n, sizeof **keys, key_cmp);
    int w = 0; /* drop repeats */
    for (int i = 0; i < *n; i++)
        if (w == 0 || key_cmp((*keys)[w - 1], (*keys)[i]) != 0)
            memmove((*keys)[w++], (*keys)[i], sizeof **keys);
    *n = w;
    return MO_OK;
}

/* ---- The handler ---- */

/* The frames of one ZAP request (RFC 27): version, request id, domain, address,
 * identity, mechanism, then credentials. */
#define ZAP_FRAMES 8

typedef struct zreq {
    zmq_msg_t f[ZAP_FRAMES];
    int n;       /* frames received (at most ZAP_FRAMES kept) */
    bool extra;  /* more frames than kept */
} zreq_t;

static bool frame_is(zmq_msg_t *m, const char *s) {
    size_t n = strlen(s);
    return zmq_msg_size(m) == n && memcmp(zmq_msg_data(m), s, n) == 0;
}

static int recv_request(void *rep, zreq_t *r) {
    r->n = 0;
    r->extra = false;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, rep, 0) < 0) {
            zmq_msg_close(&part);
            return -1;
        }
        int more = zmq_msg_more(&part);
        if (r->n < ZAP_FRAMES) {
            zmq_msg_init(&r->f[r->n]);
            zmq_msg_move(&r->f[r->n++], &part);
        } else {
            r->extra = true;
        }
        zmq_msg_close(&part);
        if (!more)
            return 0;
    }
}

/* 200 with user id key, or 400/500 with the reason. */
static void send_reply(void *rep, zmq_msg_t *request_id, const char *code, const char *text,
                       const char *user) {
    zmq_send(rep, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(rep, request_id ? zmq_msg_data(request_id) : "",
             request_id ? zmq_msg_size(request_id) : 0, ZMQ_SNDMORE);
    zmq_send(rep, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(rep, user, strlen(user), ZMQ_SNDMORE);
    zmq_send(rep, "", 0, 0);
}

static void count(zap_t *z, bool ok, const char *key) {
    pthread_mutex_lock(&z->mu);
    if (ok) {
        z->admitted++;
    } else {
        z->refused++;
        snprintf(z->last_refused, sizeof z->last_refused, "%s", key);
    }
    pthread_mutex_unlock(&z->mu);
}

static void answer(zap_t *z, zreq_t *r) {
    if (r->n < 6 || r->extra || !frame_is(&r->f[0], "1.0")) {
        send_reply(z->rep, r->n >= 2 ? &r->f[1] : NULL, "500", "malformed ZAP request", "");
        return;
    }
    zmq_msg_t *mech = &r->f[5];
    if (frame_is(mech, "NULL")) {
        send_reply(z->rep, &r->f[1], "200", "OK", "");
        return;
    }
    zap_key_t key = "";
    if (frame_is(mech, "CURVE") && r->n == 7 && zmq_msg_size(&r->f[6]) == 32)
        zmq_z85_encode(key, zmq_msg_data(&r->f[6]), 32);
    bool ok = key[0] && bsearch(key, z->keys, (size_t)z->n, sizeof *z->keys, key_cmp) != NULL;
    count(z, ok, key[0] ? key : "(not a CURVE client)");
    if (ok)
        send_reply(z->rep, &r->f[1], "200", "OK", key);
    else
        send_reply(z->rep, &r->f[1], "400", "client key not on the allow-list", "");
}

static void *run(void *arg) {
    zap_t *z = arg;
    zmq_pollitem_t items[2] = {{z->rep, 0, ZMQ_POLLIN, 0}, {z->ctl_in, 0, ZMQ_POLLIN, 0}};
    for (;;) {
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break;
        }
        if (items[1].revents & ZMQ_POLLIN)
            break;
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        zreq_t r;
        if (recv_request(z->rep, &r) < 0)
            break;
        answer(z, &r);
        for (int i = 0; i < r.n; i++)
            zmq_msg_close(&r.f[i]);
    }
    zmq_close(z->rep);
    zmq_close(z->ctl_in);
    return NULL;
}

static void close_quietly(void *s) {
    if (!s)
        return;
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(s);
}

int zap_start(void *ctx, const zap_key_t *keys, int n, zap_t **out) {
    *out = NULL;
    if (!ctx || !keys || n < 1)
        return mo_errorf(MO_EINVAL, "zap_start: no context or no keys");
    zap_t *z = calloc(1, sizeof *z);
    if (!z || !(z->keys = malloc(sizeof *z->keys * (size_t)n))) {
        free(z);
        return mo_errorf(MO_ENOMEM, "out of memory");
    }
    memcpy(z->keys, keys, sizeof *z->keys * (size_t)n);
    qsort(z->keys, (size_t)n, sizeof *z->keys, key_cmp);
    z->n = n;
    pthread_mutex_init(&z->mu, NULL);
    char ctl[64];
    snprintf(ctl, sizeof ctl, "inproc://moerl-zap-stop-%p", (void *)z);
    int rc = MO_OK;
    z->rep = zmq_socket(ctx, ZMQ_REP);
    z->ctl_in = zmq_socket(ctx, ZMQ_PAIR);
    z->ctl_out = zmq_socket(ctx, ZMQ_PAIR);
    if (!z->rep || !z->ctl_in || !z->ctl_out)
        rc = mo_errorf(MO_EIO, "ZAP handler: zmq_socket: %s", zmq_strerror(zmq_errno()));
    else if (zmq_bind(z->rep, ZAP_ENDPOINT) != 0)
        rc = zmq_errno() == EADDRINUSE
                 ? mo_errorf(MO_ESTATE, "ZAP handler: this context already has one")
                 : mo_errorf(MO_EIO, "ZAP handler: bind %s: %s", ZAP_ENDPOINT,
                             zmq_strerror(zmq_errno()));
    else if (zmq_bind(z->ctl_in, ctl) != 0 || zmq_connect(z->ctl_out, ctl) != 0)
        rc = mo_errorf(MO_EIO, "ZAP handler: %s: %s", ctl, zmq_strerror(zmq_errno()));
    else if (pthread_create(&z->thread, NULL, run, z) != 0)
        rc = mo_errorf(MO_EIO, "ZAP handler: cannot start its thread");
    if (rc < 0) {
        close_quietly(z->rep);
        close_quietly(z->ctl_in);
        close_quietly(z->ctl_out);
        pthread_mutex_destroy(&z->mu);
        free(z->keys);
        free(z);
        return rc;
    }
    *out = z;
    return MO_OK;
}

void zap_stop(zap_t **zp) {
    zap_t *z = *zp;
    if (!z)
        return;
    zmq_send(z->ctl_out, "", 0, 0);
    pthread_join(z->thread, NULL);
    close_quietly(z->ctl_out);
    pthread_mutex_destroy(&z->mu);
    free(z->keys);
    free(z);
    *zp = NULL;
}

uint64_t zap_admitted(const zap_t *z) {
    pthread_mutex_lock((pthread_mutex_t *)&z->mu);
    uint64_t v = z->admitted;
    pthread_mutex_unlock((pthread_mutex_t *)&z->mu);
    return v;
}

uint64_t zap_refused(const zap_t *z) {
    pthread_mutex_lock((pthread_mutex_t *)&z->mu);
    uint64_t v = z->refused;
    pthread_mutex_unlock((pthread_mutex_t *)&z->mu);
    return v;
}

void zap_last_refused(const zap_t *z, zap_key_t out) {
    pthread_mutex_lock((pthread_mutex_t *)&z->mu);
    memcpy(out, z->last_refused, sizeof(zap_key_t));
    pthread_mutex_unlock((pthread_mutex_t *)&z->mu);
}
