/* codec_control: hello, welcome, heartbeat, snapshot_request, ctl_request,
 * ctl_reply, reward_swap and error (the control socket's messages). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

static const char *role_nm(int i) {
    return msg_role_name((msg_role_t)i);
}
static const char *ctl_nm(int i) {
    return msg_ctl_cmd_name((msg_ctl_cmd_t)i);
}

/* ---- reward spec: version, function, plugin (flat in reward_swap, the
 * "reward" map in welcome) ---- */

static int spec_decode(cx_t *c, const msgpack_object *o, const char *what, msg_reward_spec_t *s) {
    fld_t f[3] = {FLD("version"), FLD("function"), FLD("plugin")};
    TRY(dec_fields(c, o, what, f, 3));
    size_t old = what ? cx_push(c, ".%s", what) : c->plen;
    int rc = dec_u64(c, &f[0], &s->version);
    if (rc == MO_OK)
        rc = dec_str(c, &f[1], MSG_MAX_SPEC, &s->function);
    if (rc == MO_OK)
        rc = dec_str_opt(c, &f[2], MSG_MAX_PATH, &s->plugin);
    cx_pop(c, old);
    return rc;
}

static int spec_check(cx_t *c, const char *what, const msg_reward_spec_t *s) {
    size_t old = what ? cx_push(c, ".%s", what) : c->plen;
    int rc = ck_str(c, "function", s->function, 1, MSG_MAX_SPEC);
    if (rc == MO_OK)
        rc = ck_str_opt(c, "plugin", s->plugin, MSG_MAX_PATH);
    cx_pop(c, old);
    return rc;
}

static void spec_encode(enc_t *e, const msg_reward_spec_t *s) {
    enc_key(e, "version");
    enc_u64(e, s->version);
    enc_key(e, "function");
    enc_str(e, s->function);
    if (s->plugin) {
        enc_key(e, "plugin");
        enc_str(e, s->plugin);
    }
}

/* ---- hello ---- */

static int hello_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_hello_t *h = &m->hello;
    fld_t f[5] = {FLD("role"), FLD("worker_id"), FLD("pid"), FLD("host"), FLD("software")};
    TRY(dec_fields(c, o, NULL, f, 5));
    int role = 0;
    TRY(dec_enum(c, &f[0], role_nm, MSG_ROLE_LEARNER, &role)); /* no learner hello */
    h->role = (msg_role_t)role;
    TRY(dec_str(c, &f[1], MSG_MAX_ID, &h->worker_id));
    TRY(dec_i64(c, &f[2], 1, INT32_MAX, &h->pid));
    TRY(dec_str(c, &f[3], MSG_MAX_NAME, &h->host));
    return dec_str_opt(c, &f[4], MSG_MAX_NAME, &h->software);
}

static int hello_check(cx_t *c, const msg_t *m) {
    const msg_hello_t *h = &m->hello;
    TRY(ck_enum(c, "role", (int)h->role, MSG_ROLE_LEARNER));
    TRY(ck_id(c, "worker_id", h->worker_id));
    if (h->pid < 1 || h->pid > INT32_MAX)
        return cx_fail(c, "pid", "%lld is out of range [1, %d]", (long long)h->pid, INT32_MAX);
    TRY(ck_str(c, "host", h->host, 0, MSG_MAX_NAME));
    return ck_str_opt(c, "software", h->software, MSG_MAX_NAME);
}

static void hello_encode(enc_t *e, const msg_t *m) {
    const msg_hello_t *h = &m->hello;
    enc_key(e, "role");
    enc_str(e, msg_role_name(h->role));
    enc_key(e, "worker_id");
    enc_str(e, h->worker_id);
    enc_key(e, "pid");
    enc_i64(e, h->pid);
    enc_key(e, "host");
    enc_str(e, h->host);
    if (h->software) {
        enc_key(e, "software");
        enc_str(e, h->software);
    }
}

const msg_codec_t codec_hello = {hello_decode, hello_check, hello_encode};

/* ---- welcome ---- */

static int sampling_decode(cx_t *c, const msgpack_object *o, msg_sampling_t *s) {
    fld_t f[7] = {FLD("temperature"),    FLD("top_p"), FLD("top_k"), FLD("min_p"),
                  FLD("max_new_tokens"), FLD("stop"),  FLD("seed")};
    TRY(dec_fields(c, o, NULL, f, 7));
    TRY(dec_f64(c, &f[0], &s->temperature));
    TRY(dec_f64(c, &f[1], &s->top_p));
    int64_t v = 0;
    TRY(dec_i64(c, &f[2], 0, INT32_MAX, &v));
    s->top_k = (int32_t)v;
    TRY(dec_f64(c, &f[3], &s->min_p));
    TRY(dec_i64(c, &f[4], 0, INT32_MAX, &v));
    s->max_new_tokens = (int32_t)v;
    s->stop = NULL;
    s->n_stop = 0;
    if (fld_has(&f[5])) {
        const msgpack_object *items = NULL;
        uint32_t n = 0;
        TRY(dec_array(c, &f[5], MSG_MAX_STOP, &items, &n));
        const char **stop;
        TRY(cx_alloc(c, (n ? n : 1) * sizeof *stop, (void **)&stop));
        for (uint32_t i = 0; i < n; i++) {
            char nm[24];
            snprintf(nm, sizeof nm, "stop[%u]", i);
            fld_t fi = {nm, &items[i]};
            TRY(dec_str(c, &fi, MSG_MAX_NAME, &stop[i]));
        }
        s->stop = stop;
        s->n_stop = n;
    }
    return dec_u64(c, &f[6], &s->seed);
}

static int sampling_check(cx_t *c, const msg_sampling_t *s) {
    TRY(ck_f64(c, "temperature", s->temperature, 0, 100));
    TRY(ck_f64(c, "top_p", s->top_p, 0, 1));
    if (s->top_p <= 0)
        return cx_fail(c, "top_p", "%g is out of range (0, 1]", s->top_p);
    if (s->top_k < 0 || s->top_k > MSG_MAX_TOP_K)
        return cx_fail(c, "top_k", "%d is out of range [0, %d]", (int)s->top_k, MSG_MAX_TOP_K);
    TRY(ck_f64(c, "min_p", s->min_p, 0, 1));
    if (s->max_new_tokens < 1 || s->max_new_tokens > MSG_MAX_TOKENS)
        return cx_fail(c, "max_new_tokens", "%d is out of range [1, %d]", (int)s->max_new_tokens,
                       MSG_MAX_TOKENS);
    if (s->n_stop > MSG_MAX_STOP)
        return cx_fail(c, "stop", "%u strings, at most %d", s->n_stop, MSG_MAX_STOP);
    if (s->n_stop && !s->stop)
        return cx_fail(c, "stop", "%u strings but no array", s->n_stop);
    for (uint32_t i = 0; i < s->n_stop; i++) {
        char nm[24];
        snprintf(nm, sizeof nm, "stop[%u]", i);
        TRY(ck_str(c, nm, s->stop[i], 1, MSG_MAX_NAME));
    }
    return MO_OK;
}

static void sampling_encode(enc_t *e, const msg_sampling_t *s) {
    enc_map_begin(e);
    enc_key(e, "temperature");
    enc_f64(e, s->temperature);
    enc_key(e, "top_p");
    enc_f64(e, s->top_p);
    enc_key(e, "top_k");
    enc_i64(e, s->top_k);
    enc_key(e, "min_p");
    enc_f64(e, s->min_p);
    enc_key(e, "max_new_tokens");
    enc_i64(e, s->max_new_tokens);
    if (s->n_stop) {
        enc_key(e, "stop");
        msgpack_pack_array(&e->pk, s->n_stop);
        for (uint32_t i = 0; i < s->n_stop; i++)
            enc_str(e, s->stop[i]);
    }
    enc_key(e, "seed");
    enc_u64(e, s->seed);
    enc_map_end(e);
}

static int welcome_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_welcome_t *w = &m->welcome;
    fld_t f[7] = {FLD("job"),      FLD("policy_version"), FLD("model_path"), FLD("group_size"),
                  FLD("sampling"), FLD("heartbeat_ms"),   FLD("reward")};
    TRY(dec_fields(c, o, NULL, f, 7));
    TRY(dec_str(c, &f[0], MSG_MAX_NAME, &w->job));
    TRY(dec_u64(c, &f[1], &w->policy_version));
    TRY(dec_str(c, &f[2], MSG_MAX_PATH, &w->model_path));
    TRY(dec_u32(c, &f[3], &w->group_size));
    if (!f[4].v)
        return cx_fail(c, "sampling", "missing");
    size_t old = cx_push(c, ".sampling");
    int rc = sampling_decode(c, f[4].v, &w->sampling);
    cx_pop(c, old);
    TRY(rc);
    TRY(dec_u32(c, &f[5], &w->heartbeat_ms));
    w->has_reward = fld_has(&f[6]);
    if (w->has_reward)
        TRY(spec_decode(c, f[6].v, "reward", &w->reward));
    return MO_OK;
}

static int welcome_check(cx_t *c, const msg_t *m) {
    const msg_welcome_t *w = &m->welcome;
    TRY(ck_str(c, "job", w->job, 1, MSG_MAX_NAME));
    TRY(ck_str(c, "model_path", w->model_path, 0, MSG_MAX_PATH));
    TRY(ck_u64(c, "group_size", w->group_size, 1, MSG_MAX_SAMPLES));
    size_t old = cx_push(c, ".sampling");
    int rc = sampling_check(c, &w->sampling);
    cx_pop(c, old);
    TRY(rc);
    TRY(ck_u64(c, "heartbeat_ms", w->heartbeat_ms, 10, 600000));
    return w->has_reward ? spec_check(c, "reward", &w->reward) : MO_OK;
}

static void welcome_encode(enc_t *e, const msg_t *m) {
    const msg_welcome_t *w = &m->welcome;
    enc_key(e, "job");
    enc_str(e, w->job);
    enc_key(e, "policy_version");
    enc_u64(e, w->policy_version);
    enc_key(e, "model_path");
    enc_str(e, w->model_path);
    enc_key(e, "group_size");
    enc_u64(e, w->group_size);
    enc_key(e, "sampling");
    sampling_encode(e, &w->sampling);
    enc_key(e, "heartbeat_ms");
    enc_u64(e, w->heartbeat_ms);
    if (w->has_reward) {
        enc_key(e, "reward");
        enc_map_begin(e);
        spec_encode(e, &w->reward);
        enc_map_end(e);
    }
}

const msg_codec_t codec_welcome = {welcome_decode, welcome_check, welcome_encode};

/* ---- heartbeat ---- */

static int heartbeat_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_heartbeat_t *h = &m->heartbeat;
    fld_t f[7] = {FLD("worker_id"),      FLD("role"),     FLD("adapter_version"),
                  FLD("reward_version"), FLD("inflight"), FLD("tokens_per_s"),
                  FLD("queue_depth")};
    TRY(dec_fields(c, o, NULL, f, 7));
    TRY(dec_str(c, &f[0], MSG_MAX_ID, &h->worker_id));
    int role = 0;
    TRY(dec_enum(c, &f[1], role_nm, MSG_ROLE_COUNT, &role));
    h->role = (msg_role_t)role;
    TRY(dec_u64_opt(c, &f[2], &h->has_adapter_version, &h->adapter_version));
    TRY(dec_u64_opt(c, &f[3], &h->has_reward_version, &h->reward_version));
    TRY(dec_u32(c, &f[4], &h->inflight));
    TRY(dec_f64(c, &f[5], &h->tokens_per_s));
    return dec_u32(c, &f[6], &h->queue_depth);
}

static int heartbeat_check(cx_t *c, const msg_t *m) {
    const msg_heartbeat_t *h = &m->heartbeat;
    TRY(ck_id(c, "worker_id", h->worker_id));
    TRY(ck_enum(c, "role", (int)h->role, MSG_ROLE_COUNT));
    return ck_f64(c, "tokens_per_s", h->tokens_per_s, 0, MSG_MAX_SECONDS_MS);
}

static void heartbeat_encode(enc_t *e, const msg_t *m) {
    const msg_heartbeat_t *h = &m->heartbeat;
    enc_key(e, "worker_id");
    enc_str(e, h->worker_id);
    enc_key(e, "role");
    enc_str(e, msg_role_name(h->role));
    if (h->has_adapter_version) {
        enc_key(e, "adapter_version");
        enc_u64(e, h->adapter_version);
    }
    if (h->has_reward_version) {
        enc_key(e, "reward_version");
        enc_u64(e, h->reward_version);
    }
    enc_key(e, "inflight");
    enc_u64(e, h->inflight);
    enc_key(e, "tokens_per_s");
    enc_f64(e, h->tokens_per_s);
    enc_key(e, "queue_depth");
    enc_u64(e, h->queue_depth);
}

const msg_codec_t codec_heartbeat = {heartbeat_decode, heartbeat_check, heartbeat_encode};

/* ---- snapshot_request ---- */

static int snapshot_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_snapshot_request_t *s = &m->snapshot_request;
    fld_t f[2] = {FLD("worker_id"), FLD("have_version")};
    TRY(dec_fields(c, o, NULL, f, 2));
    TRY(dec_str(c, &f[0], MSG_MAX_ID, &s->worker_id));
    return dec_u64_opt(c, &f[1], &s->has_version, &s->have_version);
}

static int snapshot_check(cx_t *c, const msg_t *m) {
    return ck_id(c, "worker_id", m->snapshot_request.worker_id);
}

static void snapshot_encode(enc_t *e, const msg_t *m) {
    const msg_snapshot_request_t *s = &m->snapshot_request;
    enc_key(e, "worker_id");
    enc_str(e, s->worker_id);
    if (s->has_version) {
        enc_key(e, "have_version");
        enc_u64(e, s->have_version);
    }
}

const msg_codec_t codec_snapshot_request = {snapshot_decode, snapshot_check, snapshot_encode};

/* ---- ctl_request ---- */

static int ctl_request_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_ctl_request_t *r = &m->ctl_request;
    fld_t f[2] = {FLD("command"), FLD("args")};
    TRY(dec_fields(c, o, NULL, f, 2));
    int cmd = 0;
    TRY(dec_enum(c, &f[0], ctl_nm, MSG_CTL_COUNT, &cmd));
    r->command = (msg_ctl_cmd_t)cmd;
    return dec_strmap_opt(c, &f[1], MSG_MAX_SPEC, &r->args);
}

static int ctl_request_check(cx_t *c, const msg_t *m) {
    const msg_ctl_request_t *r = &m->ctl_request;
    TRY(ck_enum(c, "command", (int)r->command, MSG_CTL_COUNT));
    return ck_strmap(c, "args", &r->args, MSG_MAX_SPEC);
}

static void ctl_request_encode(enc_t *e, const msg_t *m) {
    const msg_ctl_request_t *r = &m->ctl_request;
    enc_key(e, "command");
    enc_str(e, msg_ctl_cmd_name(r->command));
    if (r->args.n) {
        enc_key(e, "args");
        enc_strmap(e, &r->args);
    }
}

const msg_codec_t codec_ctl_request = {ctl_request_decode, ctl_request_check, ctl_request_encode};

/* ---- ctl_reply ---- */

static int stat_value(cx_t *c, const char *key, const msgpack_object *v, msg_stat_t *s) {
    switch (v->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (v->via.u64 > INT64_MAX) {
            s->kind = MSG_VAL_FLOAT;
            s->f = (double)v->via.u64;
        } else {
            s->kind = MSG_VAL_INT;
            s->i = (int64_t)v->via.u64;
        }
        return MO_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: s->kind = MSG_VAL_INT, s->i = v->via.i64; return MO_OK;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: s->kind = MSG_VAL_FLOAT, s->f = v->via.f64; return MO_OK;
    case MSGPACK_OBJECT_BOOLEAN: s->kind = MSG_VAL_BOOL, s->i = v->via.boolean; return MO_OK;
    case MSGPACK_OBJECT_STR: {
        s->kind = MSG_VAL_STR;
        fld_t f = {key, v};
        return dec_str(c, &f, MSG_MAX_MESSAGE, &s->s);
    }
    default: return cx_fail(c, key, "expected a number, string or boolean, got %s", mp_kind(v));
    }
}

static int status_decode(cx_t *c, const fld_t *f, msg_ctl_reply_t *r) {
    r->status = NULL;
    r->n_status = 0;
    if (!fld_has(f))
        return MO_OK;
    if (f->v->type != MSGPACK_OBJECT_MAP)
        return cx_fail(c, "status", "expected a map, got %s", mp_kind(f->v));
    uint32_t n = f->v->via.map.size;
    if (n > MSG_MAX_STATUS)
        return cx_fail(c, "status", "%u entries, at most %d", n, MSG_MAX_STATUS);
    msg_stat_t *st;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *st, (void **)&st));
    memset(st, 0, (n ? n : 1) * sizeof *st);
    size_t old = cx_push(c, ".status");
    int rc = MO_OK;
    for (uint32_t k = 0; k < n && rc == MO_OK; k++) {
        char at[32];
        snprintf(at, sizeof at, "key %u", k);
        fld_t fk = {at, &f->v->via.map.ptr[k].key};
        rc = dec_str(c, &fk, MSG_MAX_NAME, &st[k].key);
        if (rc == MO_OK)
            rc = stat_value(c, st[k].key, &f->v->via.map.ptr[k].val, &st[k]);
    }
    cx_pop(c, old);
    TRY(rc);
    r->status = st;
    r->n_status = n;
    return MO_OK;
}

static int ctl_reply_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_ctl_reply_t *r = &m->ctl_reply;
    fld_t f[3] = {FLD("ok"), FLD("message"), FLD("status")};
    TRY(dec_fields(c, o, NULL, f, 3));
    TRY(dec_bool(c, &f[0], &r->ok));
    TRY(dec_str(c, &f[1], MSG_MAX_MESSAGE, &r->message));
    return status_decode(c, &f[2], r);
}

static int ctl_reply_check(cx_t *c, const msg_t *m) {
    const msg_ctl_reply_t *r = &m->ctl_reply;
    TRY(ck_str(c, "message", r->message, 0, MSG_MAX_MESSAGE));
    if (r->n_status > MSG_MAX_STATUS)
        return cx_fail(c, "status", "%u entries, at most %d", r->n_status, MSG_MAX_STATUS);
    if (r->n_status && !r->status)
        return cx_fail(c, "status", "%u entries but no items", r->n_status);
    size_t old = cx_push(c, ".status");
    int rc = MO_OK;
    for (uint32_t i = 0; i < r->n_status && rc == MO_OK; i++) {
        const msg_stat_t *s = &r->status[i];
        char at[32];
        snprintf(at, sizeof at, "key %u", i);
        rc = ck_str(c, at, s->key, 1, MSG_MAX_NAME);
        if (rc == MO_OK && (unsigned)s->kind > MSG_VAL_BOOL)
            rc = cx_fail(c, s->key, "bad value kind %d", (int)s->kind);
        if (rc == MO_OK && s->kind == MSG_VAL_STR)
            rc = ck_str(c, s->key, s->s, 0, MSG_MAX_MESSAGE);
        if (rc == MO_OK && s->kind == MSG_VAL_BOOL && s->i != 0 && s->i != 1)
            rc = cx_fail(c, s->key, "boolean value %lld", (long long)s->i);
    }
    cx_pop(c, old);
    TRY(rc);
    return ck_unique_keys(c, "status", r->status, r->n_status, sizeof *r->status);
}

static void ctl_reply_encode(enc_t *e, const msg_t *m) {
    const msg_ctl_reply_t *r = &m->ctl_reply;
    enc_key(e, "ok");
    enc_bool(e, r->ok);
    enc_key(e, "message");
    enc_str(e, r->message);
    if (!r->n_status)
        return;
    enc_key(e, "status");
    msgpack_pack_map(&e->pk, r->n_status);
    for (uint32_t i = 0; i < r->n_status; i++) {
        const msg_stat_t *s = &r->status[i];
        enc_str(e, s->key);
        switch (s->kind) {
        case MSG_VAL_INT: enc_i64(e, s->i); break;
        case MSG_VAL_FLOAT: enc_f64(e, s->f); break;
        case MSG_VAL_STR: enc_str(e, s->s); break;
        case MSG_VAL_BOOL: enc_bool(e, s->i != 0); break;
        }
    }
}

const msg_codec_t codec_ctl_reply = {ctl_reply_decode, ctl_reply_check, ctl_reply_encode};

/* ---- reward_swap ---- */

static int reward_swap_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    return spec_decode(c, o, NULL, &m->reward_swap.spec);
}

static int reward_swap_check(cx_t *c, const msg_t *m) {
    return spec_check(c, NULL, &m->reward_swap.spec);
}

static void reward_swap_encode(enc_t *e, const msg_t *m) {
    spec_encode(e, &m->reward_swap.spec);
}

const msg_codec_t codec_reward_swap = {reward_swap_decode, reward_swap_check, reward_swap_encode};

/* ---- error ---- */

static int error_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_error_t *r = &m->error;
    fld_t f[4] = {FLD("code"), FLD("message"), FLD("about"), FLD("id")};
    TRY(dec_fields(c, o, NULL, f, 4));
    int64_t code = 0;
    TRY(dec_i64(c, &f[0], -1000, -1, &code));
    r->code = (int32_t)code;
    TRY(dec_str(c, &f[1], MSG_MAX_MESSAGE, &r->message));
    TRY(dec_str_opt(c, &f[2], MSG_MAX_NAME, &r->about));
    return dec_u64_opt(c, &f[3], &r->has_id, &r->id);
}

static int error_check(cx_t *c, const msg_t *m) {
    const msg_error_t *r = &m->error;
    if (r->code < -1000 || r->code > -1)
        return cx_fail(c, "code", "%d is out of range [-1000, -1]", (int)r->code);
    TRY(ck_str(c, "message", r->message, 1, MSG_MAX_MESSAGE));
    return ck_str_opt(c, "about", r->about, MSG_MAX_NAME);
}

static void error_encode(enc_t *e, const msg_t *m) {
    const msg_error_t *r = &m->error;
    enc_key(e, "code");
    enc_i64(e, r->code);
    enc_key(e, "message");
    enc_str(e, r->message);
    if (r->about) {
        enc_key(e, "about");
        enc_str(e, r->about);
    }
    if (r->has_id) {
        enc_key(e, "id");
        enc_u64(e, r->id);
    }
}

const msg_codec_t codec_error = {error_decode, error_check, error_encode};
