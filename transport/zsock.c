/* zsock: ZeroMQ socket helpers: options, endpoint policy, CURVE keys, a daemon's
 * context and framed messages. */
#include "transport/zsock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"
#include "transport/zap.h"

void zsock_opts_default(zsock_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->max_msg_bytes = (int64_t)1 << 28;
    o->linger_ms = 1000;
    o->reconnect_ms = 100;
    o->reconnect_max_ms = 5000;
}

/* ---- Endpoints ---- */

enum { EP_TCP, EP_IPC, EP_INPROC };

typedef struct ep {
    int kind;
    char host[256]; /* tcp: without brackets */
    int v6;         /* tcp host was [bracketed] */
    char port[8];   /* tcp: digits or "*" */
} ep_t;

static bool host_char_ok(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '.' || ch == '-' || ch == '_';
}

static int parse_tcp(const char *e, const char *rest, bool bind, ep_t *p) {
    const char *colon;
    if (rest[0] == '[') {
        const char *close = strchr(rest, ']');
        if (!close || close[1] != ':')
            return mo_errorf(MO_EINVAL, "endpoint '%s': expected tcp://[IPv6]:PORT", e);
        size_t n = (size_t)(close - rest - 1);
        if (n == 0 || n >= sizeof p->host)
            return mo_errorf(MO_EINVAL, "endpoint '%s': bad IPv6 address", e);
        memcpy(p->host, rest + 1, n);
        p->host[n] = '\0';
        struct in6_addr a6;
        if (inet_pton(AF_INET6, p->host, &a6) != 1)
            return mo_errorf(MO_EINVAL, "endpoint '%s': '%s' is not an IPv6 address", e, p->host);
        p->v6 = 1;
        colon = close + 1;
    } else {
        colon = strrchr(rest, ':');
        if (!colon)
            return mo_errorf(MO_EINVAL, "endpoint '%s': expected tcp://HOST:PORT", e);
        size_t n = (size_t)(colon - rest);
        if (n == 0 || n >= sizeof p->host)
            return mo_errorf(MO_EINVAL, "endpoint '%s': %s host", e, n ? "over-long" : "empty");
        memcpy(p->host, rest, n);
        p->host[n] = '\0';
        if (strcmp(p->host, "*") == 0) {
            if (!bind)
                return mo_errorf(MO_EINVAL, "endpoint '%s': host * only works for binding", e);
        } else {
            for (const char *h = p->host; *h; h++)
                if (!host_char_ok(*h))
                    return mo_errorf(MO_EINVAL,
                                     "endpoint '%s': host has '%c' (IPv6 needs [brackets])", e, *h);
        }
    }
    const char *port = colon + 1;
    if (strcmp(port, "*") == 0) {
        if (!bind)
            return mo_errorf(MO_EINVAL, "endpoint '%s': port * only works for binding", e);
    } else {
        size_t n = strlen(port);
        long v = 0;
        for (size_t i = 0; i < n; i++) {
            if (port[i] < '0' || port[i] > '9' || n > 5)
                return mo_errorf(MO_EINVAL, "endpoint '%s': port '%s' is not a number", e, port);
            v = v * 10 + (port[i] - '0');
        }
        if (n == 0 || v < 1 || v > 65535)
            return mo_errorf(MO_EINVAL, "endpoint '%s': port must be 1..65535", e);
    }
    snprintf(p->port, sizeof p->port, "%s", port);
    return MO_OK;
}

static int ep_parse(const char *e, bool bind, ep_t *p) {
    memset(p, 0, sizeof *p);
    if (!e || !*e)
        return mo_errorf(MO_EINVAL, "endpoint is empty");
    if (strchr(e, ';'))
        return mo_errorf(MO_EINVAL, "endpoint '%s': source-address syntax is not supported", e);
    if (strncmp(e, "tcp://", 6) == 0) {
        p->kind = EP_TCP;
        return parse_tcp(e, e + 6, bind, p);
    }
    if (strncmp(e, "ipc://", 6) == 0) {
        p->kind = EP_IPC;
        size_t n = strlen(e + 6);
        if (n == 0 || n > 107)
            return mo_errorf(MO_EINVAL, "endpoint '%s': ipc path must be 1..107 bytes", e);
        return MO_OK;
    }
    if (strncmp(e, "inproc://", 9) == 0) {
        p->kind = EP_INPROC;
        size_t n = strlen(e + 9);
        if (n == 0 || n > 255)
            return mo_errorf(MO_EINVAL, "endpoint '%s': inproc name must be 1..255 bytes", e);
        return MO_OK;
    }
    return mo_errorf(MO_EINVAL,
                     "endpoint '%s': unsupported transport (use tcp://, ipc:// or "
                     "inproc://)",
                     e);
}

int zsock_endpoint_check(const char *endpoint, bool bind) {
    ep_t p;
    return ep_parse(endpoint, bind, &p);
}

static bool host_is_loopback(const ep_t *p) {
    if (p->v6) {
        struct in6_addr a;
        if (inet_pton(AF_INET6, p->host, &a) != 1)
            return false;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (memcmp(a.s6_addr, mapped, 12) == 0)
            return a.s6_addr[12] == 127;
        for (int i = 0; i < 15; i++)
            if (a.s6_addr[i])
                return false;
        return a.s6_addr[15] == 1;
    }
    if (strcmp(p->host, "localhost") == 0 || strcmp(p->host, "lo") == 0)
        return true;
    struct in_addr a4;
    if (inet_pton(AF_INET, p->host, &a4) == 1)
        return ((const uint8_t *)&a4.s_addr)[0] == 127;
    return false;
}

bool zsock_endpoint_is_local(const char *endpoint) {
    ep_t p;
    if (ep_parse(endpoint, true, &p) < 0)
        return false;
    return p.kind != EP_TCP || host_is_loopback(&p);
}

int zsock_security_check(const char *endpoint, const zsock_opts_t *o) {
    ep_t p;
    TRY(ep_parse(endpoint, true, &p));
    if (p.kind != EP_TCP || host_is_loopback(&p) || o->curve || o->allow_insecure_remote)
        return MO_OK;
    return mo_errorf(MO_ECONFIG,
                     "endpoint '%s' is reachable from other machines and CURVE is off: create "
                     "keys with `moerl keys gen` and set transport.curve_secret_key (and "
                     "curve_server_key on clients), or set transport.allow_insecure_remote: true",
                     endpoint);
}

int zsock_endpoint_nth(const char *base, int i, char *out, size_t cap) {
    ep_t p;
    TRY(ep_parse(base, true, &p));
    if (i < 0)
        return mo_errorf(MO_EINVAL, "endpoint '%s': negative index %d", base, i);
    int n;
    if (i == 0) {
        n = snprintf(out, cap, "%s", base);
    } else if (p.kind == EP_TCP) {
        if (strcmp(p.port, "*") == 0) {
            n = snprintf(out, cap, "%s", base);
        } else {
            long port = strtol(p.port, NULL, 10) + i;
            if (port > 65535)
                return mo_errorf(MO_EINVAL, "endpoint '%s' + %d: port %ld is past 65535", base, i,
                                 port);
            n = snprintf(out, cap, "tcp://%s%s%s:%ld", p.v6 ? "[" : "", p.host, p.v6 ? "]" : "",
                         port);
        }
    } else {
        n = snprintf(out, cap, "%s.%d", base, i);
    }
    if (n < 0 || (size_t)n >= cap)
        return mo_errorf(MO_EINVAL, "endpoint '%s' + %d: does not fit in %zu bytes", base, i, cap);
    return zsock_endpoint_check(out, true);
}

/* ---- Sockets ---- */

static int setopt(void *s, int opt, const char *name, const void *v, size_t n) {
    if (zmq_setsockopt(s, opt, v, n) == 0)
        return MO_OK;
    return mo_errorf(MO_EIO, "zmq_setsockopt(%s): %s", name, zmq_strerror(zmq_errno()));
}

static int setint(void *s, int opt, const char *name, int v) {
    return setopt(s, opt, name, &v, sizeof v);
}

static int set_curve(void *s, const zsock_opts_t *o, bool server) {
    if (server) {
        TRY(setint(s, ZMQ_CURVE_SERVER, "ZMQ_CURVE_SERVER", 1));
        return setopt(s, ZMQ_CURVE_SECRETKEY, "ZMQ_CURVE_SECRETKEY", o->curve_secret,
                      ZSOCK_KEY_LEN);
    }
    if (strlen(o->curve_server) != ZSOCK_KEY_LEN)
        return mo_errorf(MO_ECONFIG, "CURVE is on but the server's public key is not set "
                                     "(transport.curve_server_key)");
    if (strlen(o->curve_public) != ZSOCK_KEY_LEN)
        return mo_errorf(MO_ECONFIG, "CURVE is on but this process's public key is not set");
    TRY(setopt(s, ZMQ_CURVE_SERVERKEY, "ZMQ_CURVE_SERVERKEY", o->curve_server, ZSOCK_KEY_LEN));
    TRY(setopt(s, ZMQ_CURVE_PUBLICKEY, "ZMQ_CURVE_PUBLICKEY", o->curve_public, ZSOCK_KEY_LEN));
    return setopt(s, ZMQ_CURVE_SECRETKEY, "ZMQ_CURVE_SECRETKEY", o->curve_secret, ZSOCK_KEY_LEN);
}

static int configure(void *s, int type, const zsock_opts_t *o, bool server, bool v6) {
    int64_t max = o->max_msg_bytes;
    TRY(setopt(s, ZMQ_MAXMSGSIZE, "ZMQ_MAXMSGSIZE", &max, sizeof max));
    TRY(setint(s, ZMQ_LINGER, "ZMQ_LINGER", o->linger_ms));
    TRY(setint(s, ZMQ_RECONNECT_IVL, "ZMQ_RECONNECT_IVL", o->reconnect_ms));
    TRY(setint(s, ZMQ_RECONNECT_IVL_MAX, "ZMQ_RECONNECT_IVL_MAX", o->reconnect_max_ms));
    if (o->sndhwm > 0)
        TRY(setint(s, ZMQ_SNDHWM, "ZMQ_SNDHWM", o->sndhwm));
    if (o->rcvhwm > 0)
        TRY(setint(s, ZMQ_RCVHWM, "ZMQ_RCVHWM", o->rcvhwm));
    if (o->heartbeat_ms > 0) {
        TRY(setint(s, ZMQ_HEARTBEAT_IVL, "ZMQ_HEARTBEAT_IVL", o->heartbeat_ms));
        TRY(setint(s, ZMQ_HEARTBEAT_TIMEOUT, "ZMQ_HEARTBEAT_TIMEOUT", 3 * o->heartbeat_ms));
    }
    if (v6)
        TRY(setint(s, ZMQ_IPV6, "ZMQ_IPV6", 1));
    if (type == ZMQ_ROUTER) {
        TRY(setint(s, ZMQ_ROUTER_MANDATORY, "ZMQ_ROUTER_MANDATORY", 1));
        TRY(setint(s, ZMQ_ROUTER_HANDOVER, "ZMQ_ROUTER_HANDOVER", 1));
    }
    if (type == ZMQ_SUB)
        TRY(setopt(s, ZMQ_SUBSCRIBE, "ZMQ_SUBSCRIBE", "", 0));
    if (type == ZMQ_DEALER && o->routing_id) {
        size_t n = strlen(o->routing_id);
        if (n == 0 || n > 255)
            return mo_errorf(MO_EINVAL, "routing id must be 1..255 bytes");
        TRY(setopt(s, ZMQ_ROUTING_ID, "ZMQ_ROUTING_ID", o->routing_id, n));
    }
    return o->curve ? set_curve(s, o, server) : MO_OK;
}

static const char *bind_hint(int err) {
    switch (err) {
    case EADDRINUSE:
        return "address already in use (another process, perhaps another job, is "
               "bound there)";
    case EADDRNOTAVAIL: return "address not available on this machine";
    case ENODEV: return "no such network interface";
    case EACCES: return "permission denied";
    default: return zmq_strerror(err);
    }
}

/* Opens a socket and binds or connects it to each of eps (n). */
static int sock_open(void *ctx, int type, const char *const *eps, int n, bool bind,
                     const zsock_opts_t *o, void **out) {
    *out = NULL;
    bool v6 = false;
    for (int i = 0; i < n; i++) {
        ep_t p;
        TRY(ep_parse(eps[i], bind, &p));
        TRY(zsock_security_check(eps[i], o));
        v6 = v6 || p.v6;
    }
    void *s = zmq_socket(ctx, type);
    if (!s)
        return mo_errorf(MO_EIO, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    int rc = configure(s, type, o, bind, v6);
    for (int i = 0; i < n && rc == MO_OK; i++) {
        if (bind && zmq_bind(s, eps[i]) != 0)
            rc = mo_errorf(MO_EIO, "bind %s: %s", eps[i], bind_hint(zmq_errno()));
        else if (!bind && zmq_connect(s, eps[i]) != 0)
            rc = mo_errorf(MO_EIO, "connect %s: %s", eps[i], zmq_strerror(zmq_errno()));
    }
    if (rc < 0) {
        int zero = 0;
        zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(s);
        return rc;
    }
    *out = s;
    return MO_OK;
}

int zsock_bind(void *ctx, int type, const char *endpoint, const zsock_opts_t *o, void **out) {
    return sock_open(ctx, type, &endpoint, 1, true, o, out);
}

int zsock_connect(void *ctx, int type, const char *endpoint, const zsock_opts_t *o, void **out) {
    return sock_open(ctx, type, &endpoint, 1, false, o, out);
}

int zsock_last_endpoint(void *s, char *buf, size_t cap) {
    size_t n = cap;
    if (zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, buf, &n) != 0)
        return mo_errorf(MO_EIO, "ZMQ_LAST_ENDPOINT: %s", zmq_strerror(zmq_errno()));
    return MO_OK;
}

void zsock_close(void **s) {
    if (*s)
        zmq_close(*s);
    *s = NULL;
}

static const struct {
    const char *name;
    int type;
    bool bind;
    size_t off; /* of the endpoint in config_transport_t */
} g_roles[ZS_ROLE_COUNT] = {
    [ZS_LEARNER_CONTROL] = {"learner control", ZMQ_ROUTER, true,
                            offsetof(config_transport_t, control)},
    [ZS_LEARNER_WORK] = {"learner work", ZMQ_ROUTER, true, offsetof(config_transport_t, work)},
    [ZS_LEARNER_SINK] = {"learner trajectory sink", ZMQ_PULL, true,
                         offsetof(config_transport_t, trajectories)},
    [ZS_LEARNER_WEIGHTS] = {"learner weights", ZMQ_PUB, true,
                            offsetof(config_transport_t, weights)},
    [ZS_REWARD_SERVER] = {"reward server", ZMQ_ROUTER, true, offsetof(config_transport_t, reward)},
    [ZS_WORKER_CONTROL] = {"worker control", ZMQ_DEALER, false,
                           offsetof(config_transport_t, control)},
    [ZS_ROLLOUT_WORK] = {"rollout work", ZMQ_DEALER, false, offsetof(config_transport_t, work)},
    [ZS_ROLLOUT_SINK] = {"rollout trajectories", ZMQ_PUSH, false,
                         offsetof(config_transport_t, trajectories)},
    [ZS_ROLLOUT_WEIGHTS] = {"rollout weights", ZMQ_SUB, false,
                            offsetof(config_transport_t, weights)},
    [ZS_ROLLOUT_REWARD] = {"rollout reward", ZMQ_DEALER, false,
                           offsetof(config_transport_t, reward)},
};

const char *zsock_role_name(zsock_role_t r) {
    return (unsigned)r < ZS_ROLE_COUNT ? g_roles[r].name : "?";
}

int zsock_open(void *ctx, zsock_role_t role, const config_transport_t *t, const zsock_opts_t *o,
               int arg, void **out) {
    *out = NULL;
    if ((unsigned)role >= ZS_ROLE_COUNT)
        return mo_errorf(MO_EINVAL, "zsock_open: bad role %d", (int)role);
    const char *base = *(char *const *)((const char *)t + g_roles[role].off);
    int n = 1;
    if (role == ZS_ROLLOUT_REWARD)
        n = arg;
    if (n < 1 || n > 1024)
        return mo_errorf(MO_EINVAL, "zsock_open(%s): %d endpoints", g_roles[role].name, n);
    char(*eps)[512] = calloc((size_t)n, sizeof *eps);
    const char **ptrs = calloc((size_t)n, sizeof *ptrs);
    if (!eps || !ptrs) {
        free(eps);
        free(ptrs);
        return mo_errorf(MO_ENOMEM, "zsock_open: out of memory");
    }
    int rc = MO_OK;
    for (int i = 0; i < n && rc == MO_OK; i++) {
        int index = role == ZS_REWARD_SERVER ? arg : i;
        rc = zsock_endpoint_nth(base, index, eps[i], sizeof eps[i]);
        ptrs[i] = eps[i];
    }
    if (rc == MO_OK)
        rc = sock_open(ctx, g_roles[role].type, ptrs, n, g_roles[role].bind, o, out);
    free(eps);
    free(ptrs);
    if (rc < 0)
        return mo_error_wrap(rc, "%s socket", g_roles[role].name);
    return MO_OK;
}

/* ---- CURVE keys ---- */

static void wipe(void *p, size_t n) {
    volatile uint8_t *v = p;
    while (n--)
        *v++ = 0;
}

/* Writes text to path through a temporary file in the same directory. */
static int write_atomic(const char *path, const char *text, mode_t mode, bool force) {
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.XXXXXX", path) >= sizeof tmp)
        return mo_errorf(MO_EINVAL, "%s: path too long", path);
    int fd = mkstemp(tmp); /* created 0600 */
    if (fd < 0)
        return mo_errorf(MO_EIO, "%s: cannot create a file there: %s", path, strerror(errno));
    size_t n = strlen(text), done = 0;
    int rc =
        fchmod(fd, mode) == 0 ? MO_OK : mo_errorf(MO_EIO, "%s: chmod: %s", tmp, strerror(errno));
    while (rc == MO_OK && done < n) {
        ssize_t w = write(fd, text + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            rc = mo_errorf(MO_EIO, "%s: write: %s", tmp, strerror(errno));
        else
            done += (size_t)w;
    }
    if (rc == MO_OK && fsync(fd) != 0)
        rc = mo_errorf(MO_EIO, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "%s: close: %s", tmp, strerror(errno));
    if (rc == MO_OK) {
        if (force) {
            if (rename(tmp, path) != 0)
                rc = mo_errorf(MO_EIO, "%s: rename: %s", path, strerror(errno));
        } else if (link(tmp, path) != 0) { /* fails if path exists: never replaces */
            rc = errno == EEXIST
                     ? mo_errorf(MO_ESTATE, "%s exists (use --force to replace it)", path)
                     : mo_errorf(MO_EIO, "%s: %s", path, strerror(errno));
        }
    }
    unlink(tmp); /* after link or a failure; a no-op after rename */
    return rc;
}

static bool key_name_ok(const char *name) {
    size_t n = strlen(name);
    if (n == 0 || n > 128 || name[0] == '.')
        return false;
    for (const char *p = name; *p; p++)
        if (!host_char_ok(*p))
            return false;
    return true;
}

int zsock_curve_keygen(const char *dir, const char *name, bool force,
                       char public_z85[ZSOCK_KEY_LEN + 1]) {
    if (!zmq_has("curve"))
        return mo_errorf(MO_EUNSUPPORTED, "this libzmq was built without CURVE");
    if (!key_name_ok(name))
        return mo_errorf(MO_EINVAL,
                         "key name '%s': use 1..128 of [A-Za-z0-9._-], not starting "
                         "with '.'",
                         name);
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno != ENOENT || mkdir(dir, 0700) != 0)
            return mo_errorf(MO_EIO, "%s: %s", dir, strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
        return mo_errorf(MO_EINVAL, "%s is not a directory", dir);
    }
    char pub[ZSOCK_KEY_LEN + 1], sec[ZSOCK_KEY_LEN + 1];
    if (zmq_curve_keypair(pub, sec) != 0)
        return mo_errorf(MO_EIO, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
    char kpath[4096], ppath[4096], text[128];
    if ((size_t)snprintf(kpath, sizeof kpath, "%s/%s.key", dir, name) >= sizeof kpath ||
        (size_t)snprintf(ppath, sizeof ppath, "%s/%s.pub", dir, name) >= sizeof ppath)
        return mo_errorf(MO_EINVAL, "%s/%s: path too long", dir, name);
    if (!force && (access(kpath, F_OK) == 0 || access(ppath, F_OK) == 0))
        return mo_errorf(MO_ESTATE, "%s exists (use --force to replace it)",
                         access(kpath, F_OK) == 0 ? kpath : ppath);
    snprintf(text, sizeof text, "# moerl CURVE secret key: keep it private\n%s\n", sec);
    int rc = write_atomic(kpath, text, 0600, force);
    wipe(text, sizeof text);
    wipe(sec, sizeof sec);
    if (rc < 0)
        return rc;
    snprintf(text, sizeof text, "# moerl CURVE public key\n%s\n", pub);
    TRY(write_atomic(ppath, text, 0644, force));
    if (public_z85)
        memcpy(public_z85, pub, sizeof pub);
    return MO_OK;
}

/* The one key token of a key file's text. */
static int parse_key(const char *path, const char *text, char out[ZSOCK_KEY_LEN + 1]) {
    int found = 0;
    const char *p = text;
    while (*p) {
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
            p++;
        if (*p == '#') {
            while (*p && *p != '\n')
                p++;
            continue;
        }
        if (!*p)
            break;
        const char *start = p;
        while (*p && *p != ' ' && *p != '\t' && *p != '\r' && *p != '\n')
            p++;
        if (found || p - start != ZSOCK_KEY_LEN)
            return mo_errorf(MO_ECONFIG, "%s: expected one 40-character Z85 key", path);
        memcpy(out, start, ZSOCK_KEY_LEN);
        out[ZSOCK_KEY_LEN] = '\0';
        found = 1;
    }
    if (!found)
        return mo_errorf(MO_ECONFIG, "%s: no key in the file", path);
    uint8_t raw[32];
    if (!zmq_z85_decode(raw, out))
        return mo_errorf(MO_ECONFIG, "%s: the key is not valid Z85", path);
    wipe(raw, sizeof raw);
    return MO_OK;
}

int zsock_curve_read_key(const char *path, bool secret, char out[ZSOCK_KEY_LEN + 1]) {
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return mo_errorf(MO_ECONFIG, "%s: %s", path, strerror(errno));
    struct stat st;
    char text[4097];
    int rc = MO_OK;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        rc = mo_errorf(MO_ECONFIG, "%s: not a regular file", path);
    else if (st.st_size > 4096)
        rc = mo_errorf(MO_ECONFIG, "%s: %lld bytes, too large for a key file", path,
                       (long long)st.st_size);
    else if (secret && (st.st_mode & 077))
        rc = mo_errorf(MO_ECONFIG,
                       "%s: a secret key must not be readable by group or others (mode %03o; "
                       "chmod 600 it)",
                       path, (unsigned)(st.st_mode & 0777));
    size_t got = 0;
    while (rc == MO_OK) {
        ssize_t r = read(fd, text + got, sizeof text - 1 - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            rc = mo_errorf(MO_ECONFIG, "%s: %s", path, strerror(errno));
        if (r <= 0 || got + (size_t)r >= sizeof text - 1) {
            got += r > 0 ? (size_t)r : 0;
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (rc == MO_OK) {
        text[got] = '\0';
        if (strlen(text) != got)
            rc = mo_errorf(MO_ECONFIG, "%s: contains a NUL byte", path);
        else
            rc = parse_key(path, text, out);
    }
    wipe(text, sizeof text);
    return rc;
}

int zsock_opts_from_config(zsock_opts_t *o, const config_transport_t *t) {
    zsock_opts_default(o);
    o->max_msg_bytes = t->max_msg_bytes;
    o->allow_insecure_remote = t->allow_insecure_remote;
    bool sec = t->curve_secret_key && *t->curve_secret_key;
    bool pub = t->curve_public_key && *t->curve_public_key;
    bool srv = t->curve_server_key && *t->curve_server_key;
    bool allow = t->curve_allowed_clients && *t->curve_allowed_clients;
    if (!sec) {
        if (allow)
            return mo_errorf(MO_ECONFIG,
                             "transport.curve_allowed_clients is set but "
                             "transport.curve_secret_key is empty (client authentication "
                             "needs CURVE)");
        if (pub || srv)
            return mo_errorf(MO_ECONFIG,
                             "transport.%s is set but transport.curve_secret_key is "
                             "empty (CURVE needs this process's secret key)",
                             pub ? "curve_public_key" : "curve_server_key");
        return MO_OK;
    }
    int rc = zsock_curve_read_key(t->curve_secret_key, true, o->curve_secret);
    if (rc < 0)
        return mo_error_wrap(rc, "transport.curve_secret_key");
    char derived[ZSOCK_KEY_LEN + 1];
    if (zmq_curve_public(derived, o->curve_secret) != 0)
        return mo_errorf(MO_ECONFIG, "transport.curve_secret_key: %s: not a usable secret key",
                         t->curve_secret_key);
    if (pub) {
        rc = zsock_curve_read_key(t->curve_public_key, false, o->curve_public);
        if (rc < 0)
            return mo_error_wrap(rc, "transport.curve_public_key");
        if (strcmp(derived, o->curve_public) != 0)
            return mo_errorf(MO_ECONFIG,
                             "transport.curve_public_key: %s does not belong to the "
                             "secret key in %s",
                             t->curve_public_key, t->curve_secret_key);
    } else {
        memcpy(o->curve_public, derived, sizeof derived);
    }
    if (srv) {
        rc = zsock_curve_read_key(t->curve_server_key, false, o->curve_server);
        if (rc < 0)
            return mo_error_wrap(rc, "transport.curve_server_key");
    }
    o->curve = true;
    return MO_OK;
}

/* ---- A daemon's context ---- */

int zsock_ctx_open(zsock_ctx_t *c, const config_transport_t *t, const char *routing_id,
                   bool server) {
    memset(c, 0, sizeof *c);
    TRY(zsock_opts_from_config(&c->opts, t));
    c->t = t;
    if (routing_id) {
        size_t n = strlen(routing_id);
        if (n == 0 || n >= sizeof c->routing_id)
            return mo_errorf(MO_EINVAL, "routing id must be 1..255 bytes");
        memcpy(c->routing_id, routing_id, n + 1);
        c->opts.routing_id = c->routing_id;
    }
    zap_key_t *keys = NULL;
    int n = 0;
    if (server && t->curve_allowed_clients && *t->curve_allowed_clients) {
        int rc = zap_allowlist_load(t->curve_allowed_clients, &keys, &n);
        if (rc < 0)
            return mo_error_wrap(rc, "transport.curve_allowed_clients");
    }
    c->ctx = zmq_ctx_new();
    if (!c->ctx) {
        free(keys);
        return mo_errorf(MO_EIO, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    }
    int rc = n > 0 ? zap_start(c->ctx, (const zap_key_t *)keys, n, &c->zap) : MO_OK;
    free(keys);
    if (rc < 0) {
        zsock_ctx_close(c);
        return rc;
    }
    c->n_allowed = n;
    return MO_OK;
}

int zsock_ctx_socket(zsock_ctx_t *c, zsock_role_t role, int arg, void **out) {
    *out = NULL;
    if (!c->ctx)
        return mo_errorf(MO_ESTATE, "zsock_ctx_socket(%s): the context is not open",
                         zsock_role_name(role));
    if (c->n_socks >= ZSOCK_CTX_MAX_SOCKETS)
        return mo_errorf(MO_ENOMEM, "zsock_ctx_socket(%s): more than %d sockets",
                         zsock_role_name(role), ZSOCK_CTX_MAX_SOCKETS);
    TRY(zsock_open(c->ctx, role, c->t, &c->opts, arg, out));
    c->socks[c->n_socks++] = out;
    return MO_OK;
}

uint64_t zsock_ctx_refused(const zsock_ctx_t *c) {
    return c->zap ? zap_refused(c->zap) : 0;
}

void zsock_ctx_close(zsock_ctx_t *c) {
    for (int i = 0; i < c->n_socks; i++)
        zsock_close(c->socks[i]);
    c->n_socks = 0;
    zap_stop(&c->zap);
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    c->ctx = NULL;
}

/* ---- Messages ---- */

static int sock_type(void *s) {
    int type = -1;
    size_t n = sizeof type;
    zmq_getsockopt(s, ZMQ_TYPE, &type, &n);
    return type;
}

static int size_check(void *s, size_t len) {
    int64_t max = -1;
    size_t n = sizeof max;
    if (zmq_getsockopt(s, ZMQ_MAXMSGSIZE, &max, &n) == 0 && max >= 0 &&
        (uint64_t)len > (uint64_t)max)
        return mo_errorf(MO_EINVAL,
                         "message of %zu bytes is over the %lld-byte limit "
                         "(transport.max_msg_bytes)",
                         len, (long long)max);
    return MO_OK;
}

static int send_failed(void) {
    int e = zmq_errno();
    if (e == EAGAIN || e == EINTR)
        return 0;
    if (e == EHOSTUNREACH)
        return mo_errorf(MO_ENOTFOUND, "send: no connected peer has that routing id");
    return mo_errorf(MO_EIO, "send: %s", zmq_strerror(e));
}

/* The routing frames before the body; 1 when sent (or none needed). */
static int send_envelope(void *s, const zsock_peer_t *to, int flags) {
    if (sock_type(s) != ZMQ_ROUTER) {
        if (to)
            return mo_errorf(MO_EINVAL, "send: only a ROUTER socket takes a peer");
        return 1;
    }
    if (!to || to->len == 0 || to->len > sizeof to->id)
        return mo_errorf(MO_EINVAL, "send on a ROUTER socket needs the peer's routing id");
    if (zmq_send(s, to->id, to->len, flags | ZMQ_SNDMORE) < 0)
        return send_failed();
    if (to->delimited && zmq_send(s, "", 0, flags | ZMQ_SNDMORE) < 0)
        return send_failed();
    return 1;
}

int zsock_send(void *s, const zsock_peer_t *to, const void *data, size_t len, int flags) {
    TRY(size_check(s, len));
    int rc = send_envelope(s, to, flags);
    if (rc <= 0)
        return rc;
    if (zmq_send(s, data, len, flags) < 0)
        return send_failed();
    return 1;
}

static void free_bytes(void *data, void *hint) {
    (void)hint;
    free(data);
}

int zsock_send_buf(void *s, const zsock_peer_t *to, msg_buf_t *buf, int flags) {
    size_t len;
    uint8_t *data = msg_buf_steal(buf, &len);
    int rc = size_check(s, len);
    if (rc == MO_OK)
        rc = send_envelope(s, to, flags);
    if (rc <= 0) {
        free(data);
        return rc;
    }
    zmq_msg_t m;
    if (!data) {
        zmq_msg_init(&m);
    } else if (zmq_msg_init_data(&m, data, len, free_bytes, NULL) != 0) {
        free(data);
        return mo_errorf(MO_ENOMEM, "send: %s", zmq_strerror(zmq_errno()));
    }
    if (zmq_msg_send(&m, s, flags) < 0) {
        rc = send_failed();
        zmq_msg_close(&m); /* frees data */
        return rc;
    }
    return 1;
}

int zsock_send_msg(void *s, const zsock_peer_t *to, const msg_t *m, int flags) {
    msg_buf_t b;
    msg_buf_init(&b);
    int rc = msg_encode(m, &b);
    if (rc < 0) {
        msg_buf_free(&b);
        return rc;
    }
    return zsock_send_buf(s, to, &b, flags);
}

int zsock_recv(void *s, zsock_msg_t *m, int flags) {
    memset(&m->from, 0, sizeof m->from);
    m->open = false;
    int stage = sock_type(s) == ZMQ_ROUTER ? 0 : 2; /* 0 id, 1 delimiter or body, 2 body */
    bool got = false, extra = false, first = true;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, s, first ? flags : 0) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&part);
            if (got)
                zmq_msg_close(&m->body);
            if (first && (e == EAGAIN || e == EINTR))
                return 0;
            return mo_errorf(MO_EIO, "receive: %s", zmq_strerror(e));
        }
        first = false;
        int more = zmq_msg_more(&part);
        size_t size = zmq_msg_size(&part);
        if (stage == 0) {
            m->from.len = size < sizeof m->from.id ? size : sizeof m->from.id;
            memcpy(m->from.id, zmq_msg_data(&part), m->from.len);
            zmq_msg_close(&part);
            stage = 1;
        } else if (stage == 1 && more && size == 0) {
            m->from.delimited = true;
            zmq_msg_close(&part);
            stage = 2;
        } else if (stage <= 2) {
            zmq_msg_init(&m->body);
            zmq_msg_move(&m->body, &part);
            zmq_msg_close(&part);
            got = true;
            stage = 3;
        } else {
            extra = true;
            zmq_msg_close(&part);
        }
        if (!more)
            break;
    }
    if (got && !extra) {
        m->open = true;
        return 1;
    }
    if (got)
        zmq_msg_close(&m->body);
    return mo_errorf(MO_EMALFORMED, "message frames: expected %s",
                     sock_type(s) == ZMQ_ROUTER ? "[routing id][body]" : "one frame");
}

void *zsock_msg_data(zsock_msg_t *m) {
    return zmq_msg_data(&m->body);
}

size_t zsock_msg_size(zsock_msg_t *m) {
    return zmq_msg_size(&m->body);
}

void zsock_msg_close(zsock_msg_t *m) {
    if (m->open)
        zmq_msg_close(&m->body);
    m->open = false;
}

int zsock_recv_msg(void *s, zsock_peer_t *from, msg_t *out, msg_type_t expect, int flags) {
    msg_init(out);
    zsock_msg_t zm;
    int rc = zsock_recv(s, &zm, flags);
    if (from)
        *from = zm.from;
    if (rc <= 0)
        return rc;
    rc = msg_decode(out, zsock_msg_data(&zm), zsock_msg_size(&zm), expect);
    zsock_msg_close(&zm);
    return rc < 0 ? rc : 1;
}

int zsock_wait(void *s, int timeout_ms) {
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc < 0) {
        if (zmq_errno() == EINTR)
            return 0;
        return mo_errorf(MO_EIO, "poll: %s", zmq_strerror(zmq_errno()));
    }
    return (it.revents & ZMQ_POLLIN) ? 1 : 0;
}

int zsock_fd(void *s, int *fd) {
    size_t n = sizeof *fd;
    if (zmq_getsockopt(s, ZMQ_FD, fd, &n) != 0)
        return mo_errorf(MO_EIO, "ZMQ_FD: %s", zmq_strerror(zmq_errno()));
    return MO_OK;
}

bool zsock_readable(void *s) {
    int ev = 0;
    size_t n = sizeof ev;
    if (zmq_getsockopt(s, ZMQ_EVENTS, &ev, &n) != 0)
        return false;
    return (ev & ZMQ_POLLIN) != 0;
}
