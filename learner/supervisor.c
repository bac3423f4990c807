/* supervisor: a job's processes on one libuv loop (see supervisor.h). */
#include "learner/supervisor.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "core/status.h"

extern char **environ;

typedef struct sup_proc sup_proc_t;

/* One output pipe of a running instance, split into lines. */
typedef struct sup_stream {
    uv_pipe_t pipe;
    struct sup_inst *inst;
    bool is_err;
    size_t len;
    char buf[SUP_LINE_MAX];
} sup_stream_t;

/* One started instance of a process: freed when its three handles are closed. */
typedef struct sup_inst {
    uv_process_t proc;
    sup_stream_t out, err;
    sup_proc_t *owner;
    int open;                     /* handles not yet closed */
    uint64_t start_ms;            /* uv_now at spawn */
    struct sup_inst *prev, *next; /* the supervisor's list of instances with open handles */
} sup_inst_t;

struct sup_proc {
    char name[SUP_NAME_MAX];
    char **argv; /* (argc + 1) */
    bool primary, restart;
    supervisor_t *sup;
    sup_inst_t *inst; /* the live instance, or NULL */
    uv_timer_t timer; /* restart backoff */
    int in_a_row;     /* failures since the last stable run */
    FILE *log;
    char last_err[512]; /* last stderr line with a letter or digit (stdout when none) */
    char last_out[512];
    char last_moerl[512]; /* last line from a moerl command's failure: "moerl <cmd>: ..." */
    sup_proc_info_t info;
};

enum { ST_IDLE = 0, ST_RUNNING, ST_STOPPING, ST_CLOSING, ST_DONE };

struct supervisor {
    sup_opts_t o;
    sup_proc_t *procs; /* (n) */
    int n, cap;
    int state;
    uv_loop_t loop;
    bool loop_ok;
    uv_signal_t sig[3];
    int n_sig;
    uv_timer_t status_timer, grace_timer;
    bool term_sent;    /* SIGTERM went out (after the settle time, if any) */
    int live;          /* instances with open handles */
    int running;       /* instances whose process has not exited */
    sup_inst_t *insts; /* the live instances */
    FILE *runlog;
    char **env; /* merged environment, or NULL to inherit */
    char status[1024];
    bool status_drawn;
    sup_result_t res;
    bool res_set;
};

/* ---- Output ---- */

static int term_cols(const supervisor_t *s) {
    struct winsize ws;
    if (s->o.term && ioctl(fileno(s->o.term), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 8)
        return ws.ws_col;
    return 0;
}

static void status_clear(supervisor_t *s) {
    if (s->status_drawn && s->o.term) {
        fputs("\r\033[K", s->o.term);
        s->status_drawn = false;
    }
}

static void status_draw(supervisor_t *s) {
    if (!s->o.term || !s->o.term_is_tty || !s->status[0] || s->state >= ST_CLOSING)
        return;
    int cols = term_cols(s);
    int len = (int)strlen(s->status);
    if (cols > 0 && len > cols - 1)
        len = cols - 1;
    fprintf(s->o.term, "\r\033[K%.*s", len, s->status);
    fflush(s->o.term);
    s->status_drawn = true;
}

/* One line from a process (name) or the supervisor (name "run"). */
static void emit_line(supervisor_t *s, const char *name, FILE *log, const char *line, size_t n) {
    if (s->o.term) {
        status_clear(s);
        fprintf(s->o.term, "[%s] %.*s\n", name, (int)n, line);
        status_draw(s);
        fflush(s->o.term);
    }
    if (log) {
        fprintf(log, "%.*s\n", (int)n, line);
        fflush(log);
    }
}

static void say_v(supervisor_t *s, const char *fmt, va_list ap) {
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    emit_line(s, "run", s->runlog, line, strlen(line));
}

void supervisor_say(supervisor_t *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    say_v(s, fmt, ap);
    va_end(ap);
}

/* ---- Construction ---- */

void sup_opts_default(sup_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->max_restarts = 5;
    o->backoff_ms = 500;
    o->backoff_max_ms = 30000;
    o->stable_ms = 60000;
    o->grace_ms = 10000;
    o->settle_ms = 3000;
    o->status_ms = 1000;
    o->handle_signals = true;
}

int supervisor_new(const sup_opts_t *o, supervisor_t **out) {
    *out = NULL;
    if (!o || o->max_restarts < 0 || o->backoff_ms < 0 || o->backoff_max_ms < o->backoff_ms ||
        o->grace_ms < 0 || o->settle_ms < 0 || o->status_ms < 0 || o->stable_ms < 0)
        return mo_errorf(MO_EINVAL, "supervisor: bad options (negative time, or backoff_max_ms "
                                    "below backoff_ms)");
    supervisor_t *s = calloc(1, sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "supervisor: out of memory");
    s->o = *o;
    *out = s;
    return MO_OK;
}

static bool name_ok(const char *n) {
    size_t len = n ? strlen(n) : 0;
    if (len == 0 || len >= SUP_NAME_MAX || !strcmp(n, "run") || n[0] == '.')
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = n[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static void argv_free(char **v) {
    for (int i = 0; v && v[i]; i++)
        free(v[i]);
    free(v);
}

static char **argv_copy(const char *const *argv) {
    int n = 0;
    while (argv[n])
        n++;
    char **v = calloc((size_t)n + 1, sizeof *v);
    for (int i = 0; v && i < n; i++) {
        if (!(v[i] = strdup(argv[i]))) {
            argv_free(v);
            return NULL;
        }
    }
    return v;
}

int supervisor_add(supervisor_t *s, const sup_proc_spec_t *spec) {
    if (s->state != ST_IDLE)
        return mo_errorf(MO_ESTATE, "supervisor_add: the supervisor has already run");
    if (!name_ok(spec->name))
        return mo_errorf(MO_EINVAL,
                         "supervisor_add: process name '%s' must be 1..%d bytes of "
                         "[A-Za-z0-9._-], not starting with '.', and not 'run'",
                         spec->name ? spec->name : "(null)", SUP_NAME_MAX - 1);
    if (!spec->argv || !spec->argv[0] || !spec->argv[0][0])
        return mo_errorf(MO_EINVAL, "supervisor_add: %s: empty command line", spec->name);
    for (int i = 0; i < s->n; i++) {
        if (!strcmp(s->procs[i].name, spec->name))
            return mo_errorf(MO_EINVAL, "supervisor_add: two processes named '%s'", spec->name);
        if (spec->primary && s->procs[i].primary)
            return mo_errorf(MO_EINVAL, "supervisor_add: %s: '%s' is already the primary process",
                             spec->name, s->procs[i].name);
    }
    if (s->n == SUP_MAX_PROCS)
        return mo_errorf(MO_EINVAL, "supervisor_add: more than %d processes", SUP_MAX_PROCS);
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 8;
        sup_proc_t *p = realloc(s->procs, sizeof *p * (size_t)cap);
        if (!p)
            return mo_errorf(MO_ENOMEM, "supervisor_add: out of memory");
        s->procs = p;
        s->cap = cap;
    }
    sup_proc_t *p = &s->procs[s->n];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", spec->name);
    if (!(p->argv = argv_copy(spec->argv)))
        return mo_errorf(MO_ENOMEM, "supervisor_add: out of memory");
    p->primary = spec->primary;
    p->restart = spec->restart;
    s->n++;
    return MO_OK;
}

static void close_logs(supervisor_t *s) {
    for (int i = 0; i < s->n; i++) {
        if (s->procs[i].log)
            fclose(s->procs[i].log);
        s->procs[i].log = NULL;
    }
    if (s->runlog)
        fclose(s->runlog);
    s->runlog = NULL;
}

void supervisor_destroy(supervisor_t **sp) {
    supervisor_t *s = *sp;
    if (!s)
        return;
    close_logs(s);
    for (int i = 0; i < s->n; i++)
        argv_free(s->procs[i].argv);
    free(s->procs);
    argv_free(s->env);
    free(s);
    *sp = NULL;
}

int supervisor_nprocs(const supervisor_t *s) {
    return s->n;
}

int supervisor_proc_info(const supervisor_t *s, int i, sup_proc_info_t *out) {
    if (i < 0 || i >= s->n)
        return mo_errorf(MO_EINVAL, "supervisor_proc_info: no process %d (of %d)", i, s->n);
    *out = s->procs[i].info;
    out->name = s->procs[i].name;
    return MO_OK;
}

/* ---- Environment and logs ---- */

static size_t env_key_len(const char *kv) {
    const char *eq = strchr(kv, '=');
    return eq ? (size_t)(eq - kv) : strlen(kv);
}

static int build_env(supervisor_t *s) {
    if (!s->o.env || !s->o.env[0])
        return MO_OK;
    int n_env = 0, n_add = 0;
    while (environ && environ[n_env])
        n_env++;
    while (s->o.env[n_add])
        n_add++;
    char **v = calloc((size_t)(n_env + n_add) + 1, sizeof *v);
    if (!v)
        return mo_errorf(MO_ENOMEM, "supervisor: out of memory");
    int k = 0;
    for (int i = 0; i < n_env; i++) {
        bool replaced = false;
        for (int j = 0; j < n_add && !replaced; j++)
            replaced = env_key_len(environ[i]) == env_key_len(s->o.env[j]) &&
                       !strncmp(environ[i], s->o.env[j], env_key_len(environ[i]));
        if (!replaced && !(v[k++] = strdup(environ[i])))
            goto oom;
    }
    for (int j = 0; j < n_add; j++)
        if (!(v[k++] = strdup(s->o.env[j])))
            goto oom;
    s->env = v;
    return MO_OK;
oom:
    argv_free(v);
    return mo_errorf(MO_ENOMEM, "supervisor: out of memory");
}

static int open_log(const char *dir, const char *name, FILE **out) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s.log", dir, name);
    *out = fopen(path, "a");
    if (!*out)
        return mo_errorf(MO_EIO, "supervisor: cannot open log file %s: %s", path, strerror(errno));
    return MO_OK;
}

static int open_logs(supervisor_t *s) {
    if (!s->o.log_dir)
        return MO_OK;
    if (mkdir(s->o.log_dir, 0755) != 0 && errno != EEXIST)
        return mo_errorf(MO_EIO, "supervisor: cannot create log directory %s: %s", s->o.log_dir,
                         strerror(errno));
    TRY(open_log(s->o.log_dir, "run", &s->runlog));
    for (int i = 0; i < s->n; i++)
        TRY(open_log(s->o.log_dir, s->procs[i].name, &s->procs[i].log));
    return MO_OK;
}

/* ---- Ending ---- */

static void set_result(supervisor_t *s, sup_outcome_t oc, int sig, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void set_result(supervisor_t *s, sup_outcome_t oc, int sig, const char *fmt, ...) {
    if (s->res_set)
        return;
    s->res_set = true;
    s->res.outcome = oc;
    s->res.signal = sig;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->res.why, sizeof s->res.why, fmt, ap);
    va_end(ap);
}

static const char *sig_name(int sig, char *buf, size_t cap) {
    static const struct {
        int sig;
        const char *name;
    } names[] = {{SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},
                 {SIGILL, "SIGILL"},   {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},
                 {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"}, {SIGSEGV, "SIGSEGV"},
                 {SIGPIPE, "SIGPIPE"}, {SIGTERM, "SIGTERM"}, {SIGUSR1, "SIGUSR1"},
                 {SIGUSR2, "SIGUSR2"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].sig == sig)
            return names[i].name;
    snprintf(buf, cap, "signal %d", sig);
    return buf;
}

/* "exited with status 3", "was killed by SIGSEGV", "exited 0". */
static void describe_exit(int64_t status, int sig, char *buf, size_t cap) {
    char tmp[32];
    if (sig)
        snprintf(buf, cap, "was killed by %s", sig_name(sig, tmp, sizeof tmp));
    else if (status == 0)
        snprintf(buf, cap, "exited 0");
    else
        snprintf(buf, cap, "exited with status %lld", (long long)status);
}

static void noop_close(uv_handle_t *h) {
    (void)h;
}

static void close_if_open(uv_handle_t *h, uv_close_cb cb) {
    if (!uv_is_closing(h))
        uv_close(h, cb);
}

/* Every process has exited and its output is read (or the drain time is over):
 * closes the remaining handles so that uv_run returns. */
static void close_all(supervisor_t *s) {
    if (s->state == ST_DONE)
        return;
    s->state = ST_DONE;
    for (int i = 0; i < s->n_sig; i++)
        close_if_open((uv_handle_t *)&s->sig[i], noop_close);
    close_if_open((uv_handle_t *)&s->status_timer, noop_close);
    close_if_open((uv_handle_t *)&s->grace_timer, noop_close);
    for (int i = 0; i < s->n; i++)
        close_if_open((uv_handle_t *)&s->procs[i].timer, noop_close);
}

static void inst_handle_closed(uv_handle_t *h) {
    /* A process handle's data is its instance; a pipe's is its stream. */
    sup_inst_t *in = h->type == UV_PROCESS ? h->data : ((sup_stream_t *)h->data)->inst;
    supervisor_t *s = in->owner->sup;
    if (--in->open > 0)
        return;
    if (in->prev)
        in->prev->next = in->next;
    else
        s->insts = in->next;
    if (in->next)
        in->next->prev = in->prev;
    free(in);
    s->live--;
    if (s->state == ST_CLOSING && s->live == 0)
        close_all(s);
}

/* The drain time after the last exit is over: closes pipes a grandchild still holds. */
static void on_drain_timeout(uv_timer_t *t) {
    supervisor_t *s = t->data;
    for (sup_inst_t *in = s->insts; in; in = in->next) {
        close_if_open((uv_handle_t *)&in->out.pipe, inst_handle_closed);
        close_if_open((uv_handle_t *)&in->err.pipe, inst_handle_closed);
    }
    if (s->live == 0)
        close_all(s);
}

/* Called after every exit while stopping: once nothing runs, waits for the pipes. */
static void check_all_exited(supervisor_t *s) {
    if (s->state != ST_STOPPING || s->running > 0)
        return;
    s->state = ST_CLOSING;
    uv_timer_stop(&s->grace_timer);
    if (s->live == 0) {
        close_all(s);
        return;
    }
    uv_timer_start(&s->grace_timer, on_drain_timeout, 500, 0);
}

static void kill_all(supervisor_t *s, int sig) {
    for (int i = 0; i < s->n; i++) {
        sup_proc_t *p = &s->procs[i];
        if (!p->inst)
            continue;
        int pid = (int)p->info.pid;
        if (sig == SIGKILL) {
            p->info.killed = true;
            kill(-pid, SIGKILL); /* its process group: mpirun's ranks too */
        }
        kill(pid, sig);
    }
}

static void on_grace_timeout(uv_timer_t *t) {
    supervisor_t *s = t->data;
    for (int i = 0; i < s->n; i++)
        if (s->procs[i].inst)
            supervisor_say(s, "%s did not stop within %.1f s: sending SIGKILL", s->procs[i].name,
                           s->o.grace_ms / 1000.0);
    kill_all(s, SIGKILL);
}

static void send_term(supervisor_t *s) {
    s->term_sent = true;
    if (s->running == 0)
        return;
    supervisor_say(s, "stopping %d process%s (SIGTERM, SIGKILL after %.1f s)", s->running,
                   s->running == 1 ? "" : "es", s->o.grace_ms / 1000.0);
    kill_all(s, SIGTERM);
    uv_timer_start(&s->grace_timer, on_grace_timeout, (uint64_t)s->o.grace_ms, 0);
}

static void on_settle_timeout(uv_timer_t *t) {
    send_term(t->data);
}

/* Ends the job: no more restarts, SIGTERM to every process, SIGKILL after the grace
 * period. When the primary finished, the others first get settle_ms to exit by
 * themselves (it tells them to). The result must be set before. */
static void begin_stop(supervisor_t *s) {
    if (s->state != ST_RUNNING)
        return;
    s->state = ST_STOPPING;
    for (int i = 0; i < s->n; i++)
        uv_timer_stop(&s->procs[i].timer);
    if (s->running > 0 && s->res.outcome == SUP_DONE && s->o.settle_ms > 0)
        uv_timer_start(&s->grace_timer, on_settle_timeout, (uint64_t)s->o.settle_ms, 0);
    else
        send_term(s);
    check_all_exited(s);
}

/* ---- Output of the processes ---- */

static void proc_line(sup_stream_t *st, char *line, size_t n) {
    sup_proc_t *p = st->inst->owner;
    while (n > 0 && line[n - 1] == '\r')
        n--;
    bool text = false;
    for (size_t i = 0; i < n && !text; i++)
        text = (line[i] >= 'a' && line[i] <= 'z') || (line[i] >= 'A' && line[i] <= 'Z') ||
               (line[i] >= '0' && line[i] <= '9');
    if (text) {
        char *dst = n > 6 && !strncmp(line, "moerl ", 6) ? p->last_moerl
                    : st->is_err                         ? p->last_err
                                                         : p->last_out;
        size_t k = n < sizeof p->last_err - 1 ? n : sizeof p->last_err - 1;
        memcpy(dst, line, k);
        dst[k] = 0;
    }
    emit_line(p->sup, p->name, p->log, line, n);
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *b) {
    (void)hint;
    sup_stream_t *st = h->data;
    if (st->len == sizeof st->buf) { /* a line longer than the buffer: emit what we have */
        proc_line(st, st->buf, st->len);
        st->len = 0;
    }
    b->base = st->buf + st->len;
    b->len = sizeof st->buf - st->len;
}

static void on_read(uv_stream_t *h, ssize_t n, const uv_buf_t *b) {
    (void)b;
    sup_stream_t *st = h->data;
    if (n > 0) {
        size_t start = 0, end = st->len + (size_t)n;
        for (size_t i = st->len; i < end; i++) {
            if (st->buf[i] == '\n') {
                proc_line(st, st->buf + start, i - start);
                start = i + 1;
            }
        }
        memmove(st->buf, st->buf + start, end - start);
        st->len = end - start;
    } else if (n < 0) { /* end of file, or an error: either way the stream is done */
        if (st->len > 0)
            proc_line(st, st->buf, st->len);
        st->len = 0;
        close_if_open((uv_handle_t *)h, inst_handle_closed);
    }
}

/* ---- Starting and restarting ---- */

static void on_proc_exit(uv_process_t *h, int64_t status, int sig);

static int spawn(sup_proc_t *p) {
    supervisor_t *s = p->sup;
    sup_inst_t *in = calloc(1, sizeof *in);
    if (!in)
        return mo_errorf(MO_ENOMEM, "out of memory");
    in->owner = p;
    in->proc.data = in;
    in->out.inst = in->err.inst = in;
    in->err.is_err = true;
    uv_pipe_init(&s->loop, &in->out.pipe, 0);
    uv_pipe_init(&s->loop, &in->err.pipe, 0);
    in->out.pipe.data = &in->out;
    in->err.pipe.data = &in->err;
    uv_stdio_container_t io[3];
    memset(io, 0, sizeof io);
    io[0].flags = UV_IGNORE;
    io[1].flags = (uv_stdio_flags)(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
    io[1].data.stream = (uv_stream_t *)&in->out.pipe;
    io[2].flags = (uv_stdio_flags)(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
    io[2].data.stream = (uv_stream_t *)&in->err.pipe;
    uv_process_options_t po;
    memset(&po, 0, sizeof po);
    po.exit_cb = on_proc_exit;
    po.file = p->argv[0];
    po.args = p->argv;
    po.env = s->env;
    po.stdio_count = 3;
    po.stdio = io;
    /* Its own session and process group: a Ctrl-C on the terminal reaches only the
     * supervisor, which stops the job in order; SIGKILL reaches the whole group. */
    po.flags = UV_PROCESS_DETACHED;
    int rc = uv_spawn(&s->loop, &in->proc, &po);
    in->open = 3;
    in->next = s->insts;
    if (s->insts)
        s->insts->prev = in;
    s->insts = in;
    s->live++;
    if (rc != 0) {
        uv_close((uv_handle_t *)&in->proc, inst_handle_closed);
        uv_close((uv_handle_t *)&in->out.pipe, inst_handle_closed);
        uv_close((uv_handle_t *)&in->err.pipe, inst_handle_closed);
        return mo_errorf(MO_EIO, "cannot start %s (%s): %s", p->name, p->argv[0], uv_strerror(rc));
    }
    in->start_ms = uv_now(&s->loop);
    p->inst = in;
    p->last_err[0] = p->last_out[0] = p->last_moerl[0] = 0;
    s->running++;
    p->info.starts++;
    p->info.restarts = p->info.starts - 1;
    p->info.pid = in->proc.pid;
    p->info.exited = false;
    p->info.exit_status = 0;
    p->info.term_signal = 0;
    p->info.killed = false;
    uv_read_start((uv_stream_t *)&in->out.pipe, on_alloc, on_read);
    uv_read_start((uv_stream_t *)&in->err.pipe, on_alloc, on_read);
    return MO_OK;
}

static void on_restart_timer(uv_timer_t *t) {
    sup_proc_t *p = t->data;
    supervisor_t *s = p->sup;
    if (s->state != ST_RUNNING)
        return;
    if (spawn(p) < 0) {
        set_result(s, SUP_FAILED, 0, "%s", mo_last_error());
        supervisor_say(s, "%s", mo_last_error());
        begin_stop(s);
        return;
    }
    s->res.restarts++;
    supervisor_say(s, "restarted %s (pid %lld, restart %d)", p->name, (long long)p->info.pid,
                   p->in_a_row);
}

/* The line that best says why a process failed: its own failure message ("moerl
 * learner: ..."), else its last line of text on stderr, else on stdout. */
static const char *last_words(const sup_proc_t *p) {
    return p->last_moerl[0] ? p->last_moerl : p->last_err[0] ? p->last_err : p->last_out;
}

/* A worker failed while the job runs: restart it after a backoff, or give up. */
static void worker_failed(sup_proc_t *p, const char *how, uint64_t ran_ms) {
    supervisor_t *s = p->sup;
    const char *last = last_words(p);
    if (!p->restart) {
        set_result(s, SUP_FAILED, 0, "%s %s%s%s", p->name, how, last[0] ? ": " : "", last);
        supervisor_say(s, "%s %s; the job cannot continue without it", p->name, how);
        begin_stop(s);
        return;
    }
    if (ran_ms >= (uint64_t)s->o.stable_ms)
        p->in_a_row = 0;
    if (p->in_a_row >= s->o.max_restarts) {
        set_result(s, SUP_FAILED, 0, "%s failed %d times in a row (last: %s%s%s); giving up",
                   p->name, p->in_a_row + 1, how, last[0] ? ": " : "", last);
        supervisor_say(s, "%s", s->res.why);
        begin_stop(s);
        return;
    }
    uint64_t delay = (uint64_t)s->o.backoff_ms;
    for (int i = 0; i < p->in_a_row && delay < (uint64_t)s->o.backoff_max_ms; i++)
        delay *= 2;
    if (delay > (uint64_t)s->o.backoff_max_ms)
        delay = (uint64_t)s->o.backoff_max_ms;
    p->in_a_row++;
    supervisor_say(s, "%s %s; restarting in %.1f s (%d of at most %d in a row)", p->name, how,
                   delay / 1000.0, p->in_a_row, s->o.max_restarts);
    uv_timer_start(&p->timer, on_restart_timer, delay, 0);
}

static void on_proc_exit(uv_process_t *h, int64_t status, int sig) {
    sup_inst_t *in = h->data;
    sup_proc_t *p = in->owner;
    supervisor_t *s = p->sup;
    s->running--;
    if (p->inst == in)
        p->inst = NULL;
    p->info.exited = true;
    p->info.exit_status = status;
    p->info.term_signal = sig;
    uint64_t ran = uv_now(&s->loop) - in->start_ms;
    uv_close((uv_handle_t *)h, inst_handle_closed);
    char how[64];
    describe_exit(status, sig, how, sizeof how);
    bool ok = status == 0 && sig == 0;
    if (s->state != ST_RUNNING) {
        supervisor_say(s, "%s %s", p->name, how);
        check_all_exited(s);
    } else if (p->primary) {
        const char *last = last_words(p);
        if (ok)
            set_result(s, SUP_DONE, 0, "%s finished", p->name);
        else
            set_result(s, SUP_FAILED, 0, "%s %s%s%s", p->name, how, last[0] ? ": " : "", last);
        supervisor_say(s, "%s %s", p->name, how);
        begin_stop(s);
    } else if (ok) {
        supervisor_say(s, "%s exited 0; not restarted", p->name);
    } else {
        worker_failed(p, how, ran);
    }
}

/* ---- Signals and the status line ---- */

static void on_signal(uv_signal_t *h, int sig) {
    supervisor_t *s = h->data;
    char tmp[32];
    if (s->state == ST_RUNNING) {
        set_result(s, SUP_INTERRUPTED, sig, "interrupted by %s", sig_name(sig, tmp, sizeof tmp));
        supervisor_say(s, "%s: stopping the job (send it again to kill at once)",
                       sig_name(sig, tmp, sizeof tmp));
        begin_stop(s);
    } else if (s->state == ST_STOPPING && !s->term_sent) {
        uv_timer_stop(&s->grace_timer); /* the settle time: the job is done, stop now */
        send_term(s);
    } else if (s->state == ST_STOPPING) {
        supervisor_say(s, "%s again: killing every process", sig_name(sig, tmp, sizeof tmp));
        kill_all(s, SIGKILL);
    }
}

static void on_status_timer(uv_timer_t *t) {
    supervisor_t *s = t->data;
    char line[sizeof s->status];
    line[0] = 0;
    int kind = s->o.status(s->o.status_ud, line, sizeof line);
    if (kind == SUP_STATUS_NONE || !line[0])
        return;
    if (s->o.term_is_tty) {
        memcpy(s->status, line, sizeof line);
        status_draw(s);
    } else if (kind == SUP_STATUS_NEWS && strcmp(line, s->status) != 0) {
        memcpy(s->status, line, sizeof line);
        emit_line(s, "run", s->runlog, line, strlen(line));
    }
}

/* ---- Running ---- */

static int loop_setup(supervisor_t *s) {
    if (uv_loop_init(&s->loop) != 0)
        return mo_errorf(MO_EIO, "supervisor: cannot create the event loop");
    s->loop_ok = true;
    uv_timer_init(&s->loop, &s->status_timer);
    uv_timer_init(&s->loop, &s->grace_timer);
    s->status_timer.data = s->grace_timer.data = s;
    for (int i = 0; i < s->n; i++) {
        s->procs[i].sup = s;
        uv_timer_init(&s->loop, &s->procs[i].timer);
        s->procs[i].timer.data = &s->procs[i];
    }
    if (s->o.handle_signals) {
        static const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
        for (int i = 0; i < 3; i++) {
            uv_signal_init(&s->loop, &s->sig[i]);
            s->sig[i].data = s;
            s->n_sig++;
            if (uv_signal_start(&s->sig[i], on_signal, sigs[i]) != 0)
                return mo_errorf(MO_EIO, "supervisor: cannot handle signal %d", sigs[i]);
        }
    }
    if (s->o.status && s->o.status_ms > 0)
        uv_timer_start(&s->status_timer, on_status_timer, (uint64_t)s->o.status_ms,
                       (uint64_t)s->o.status_ms);
    return MO_OK;
}

/* Closes whatever loop_setup opened when the job never started. */
static void loop_teardown(supervisor_t *s) {
    s->state = ST_CLOSING;
    close_all(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
}

int supervisor_run(supervisor_t *s, sup_result_t *res) {
    memset(res, 0, sizeof *res);
    if (s->state != ST_IDLE)
        return mo_errorf(MO_ESTATE, "supervisor_run: runs once");
    if (s->n == 0)
        return mo_errorf(MO_EINVAL, "supervisor_run: no process to run");
    s->state = ST_RUNNING;
    int rc = build_env(s);
    if (rc == MO_OK)
        rc = open_logs(s);
    if (rc == MO_OK)
        rc = loop_setup(s);
    if (rc < 0) {
        if (s->loop_ok) {
            loop_teardown(s);
            uv_loop_close(&s->loop);
        }
        s->state = ST_DONE;
        close_logs(s);
        return rc;
    }
    /* A terminal or pipe that goes away must not kill the supervisor (and orphan the
     * job): writes then fail quietly. Children start with default dispositions. */
    struct sigaction ign, old_pipe;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &old_pipe);
    for (int i = 0; i < s->n && s->state == ST_RUNNING; i++) {
        if (spawn(&s->procs[i]) < 0) {
            set_result(s, SUP_FAILED, 0, "%s", mo_last_error());
            supervisor_say(s, "%s", mo_last_error());
            begin_stop(s);
        } else {
            supervisor_say(s, "started %s (pid %lld)", s->procs[i].name,
                           (long long)s->procs[i].info.pid);
        }
    }
    uv_run(&s->loop, UV_RUN_DEFAULT);
    sigaction(SIGPIPE, &old_pipe, NULL);
    if (s->o.term && s->status_drawn) {
        fputc('\n', s->o.term); /* keep the last status line */
        s->status_drawn = false;
    }
    rc = uv_loop_close(&s->loop);
    MO_ASSERT(rc == 0);
    if (!s->res_set)
        set_result(s, SUP_FAILED, 0, "the event loop ended before the job did");
    supervisor_say(s, "%s", s->res.why);
    if (s->o.term)
        fflush(s->o.term);
    *res = s->res;
    return MO_OK;
}
