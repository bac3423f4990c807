/* codec_trajectory: trajectory_group, score_request and score_reply (the
 * trajectory sink's and the reward socket's messages). */
#include <math.h>
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

static const char *finish_nm(int i) {
    return msg_finish_name((msg_finish_t)i);
}

/* A per-sample array of metric maps (reward details), n entries exactly. */
static int details_decode(cx_t *c, const fld_t *f, uint32_t n, const msg_metrics_t **out) {
    *out = NULL;
    if (!fld_has(f))
        return MO_OK;
    const msgpack_object *items = NULL;
    uint32_t k = 0;
    TRY(dec_array(c, f, MSG_MAX_SAMPLES, &items, &k));
    if (k != n)
        return cx_fail(c, f->name, "%u entries for %u samples", k, n);
    msg_metrics_t *d;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *d, (void **)&d));
    memset(d, 0, (n ? n : 1) * sizeof *d);
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".%s[%u]", f->name, i);
        int rc = dec_metrics_obj(c, &items[i], &d[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    *out = d;
    return MO_OK;
}

static int details_check(cx_t *c, const char *field, const msg_metrics_t *d, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".%s[%u]", field, i);
        int rc = ck_metrics(c, NULL, &d[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    return MO_OK;
}

static void details_encode(enc_t *e, const msg_metrics_t *d, uint32_t n) {
    msgpack_pack_array(&e->pk, n);
    for (uint32_t i = 0; i < n; i++)
        enc_metrics(e, &d[i]);
}

/* Optional rewards: exactly n F32 values when present. */
static int rewards_decode(cx_t *c, const fld_t *f, uint32_t n, const float **out) {
    const void *p = NULL;
    uint32_t k = 0;
    TRY(dec_vector_opt(c, f, DT_F32, MSG_MAX_SAMPLES, &p, &k));
    if (p && k != n)
        return cx_fail(c, f->name, "%u values for %u samples", k, n);
    *out = p;
    return MO_OK;
}

/* ---- trajectory_group ---- */

static int sample_decode(cx_t *c, const msgpack_object *o, msg_sample_t *s) {
    fld_t f[8] = {FLD("tokens"),
                  FLD("logprobs"),
                  FLD("routing"),
                  FLD("finish_reason"),
                  FLD("adapter_version_first"),
                  FLD("adapter_version_last"),
                  FLD("text"),
                  FLD("routing_last")};
    TRY(dec_fields(c, o, NULL, f, 8));
    const void *p = NULL;
    TRY(dec_vector(c, &f[0], DT_I32, MSG_MAX_TOKENS, &p, &s->n_tokens));
    s->tokens = p;
    uint32_t nl = 0;
    TRY(dec_vector(c, &f[1], DT_F32, MSG_MAX_TOKENS, &p, &nl));
    if (nl != s->n_tokens)
        return cx_fail(c, "logprobs", "%u values for %u tokens", nl, s->n_tokens);
    s->logprobs = p;
    int64_t shape[3];
    TRY(dec_tensor_opt(c, &f[2], DT_U16, 3, shape, &p));
    s->routing = p;
    if (p) {
        if (shape[0] > 2 * (int64_t)MSG_MAX_TOKENS || shape[1] > MSG_MAX_LAYERS ||
            shape[2] > MSG_MAX_TOPK)
            return cx_fail(c, "routing", "shape [%lld, %lld, %lld] exceeds [%d, %d, %d]",
                           (long long)shape[0], (long long)shape[1], (long long)shape[2],
                           2 * MSG_MAX_TOKENS, MSG_MAX_LAYERS, MSG_MAX_TOPK);
        s->routing_rows = (uint32_t)shape[0];
        s->routing_layers = (uint32_t)shape[1];
        s->routing_k = (uint32_t)shape[2];
    }
    int64_t last[2];
    TRY(dec_tensor_opt(c, &f[7], DT_U16, 2, last, &p));
    s->routing_last = p;
    if (p && !s->routing)
        return cx_fail(c, "routing_last", "sent without routing");
    if (p && (last[0] != s->routing_layers || last[1] != s->routing_k))
        return cx_fail(c, "routing_last", "shape [%lld, %lld], but routing has [%u, %u]",
                       (long long)last[0], (long long)last[1], s->routing_layers,
                       s->routing_k);
    int fin = 0;
    TRY(dec_enum(c, &f[3], finish_nm, MSG_FINISH_COUNT, &fin));
    s->finish = (msg_finish_t)fin;
    TRY(dec_u64(c, &f[4], &s->adapter_version_first));
    TRY(dec_u64(c, &f[5], &s->adapter_version_last));
    return dec_str(c, &f[6], MSG_MAX_TEXT, &s->text);
}

static int sample_check(cx_t *c, const msg_sample_t *s, uint32_t n_prompt) {
    TRY(ck_tokens(c, "tokens", s->tokens, s->n_tokens, 0, MSG_MAX_TOKENS));
    if (s->n_tokens && !s->logprobs)
        return cx_fail(c, "logprobs", "missing for %u tokens", s->n_tokens);
    for (uint32_t i = 0; i < s->n_tokens; i++) {
        float lp = s->logprobs[i];
        if (!isfinite(lp) || lp > MSG_MAX_LOGPROB)
            return cx_fail(c, "logprobs", "value %u is %g; logprobs are finite and <= 0", i,
                           (double)lp);
    }
    if (s->routing) {
        uint32_t full = n_prompt + s->n_tokens - 1;
        if (s->routing_rows != s->n_tokens && s->routing_rows != full)
            return cx_fail(c, "routing",
                           "%u rows for %u tokens (expected %u, or %u with the "
                           "prompt)",
                           s->routing_rows, s->n_tokens, s->n_tokens, full);
        TRY(ck_u64(c, "routing.layers", s->routing_layers, 1, MSG_MAX_LAYERS));
        TRY(ck_u64(c, "routing.k", s->routing_k, 1, MSG_MAX_TOPK));
    } else if (s->routing_last) {
        return cx_fail(c, "routing_last", "sent without routing");
    }
    TRY(ck_enum(c, "finish_reason", (int)s->finish, MSG_FINISH_COUNT));
    if (s->adapter_version_last < s->adapter_version_first)
        return cx_fail(c, "adapter_version_last", "%llu is before adapter_version_first %llu",
                       (unsigned long long)s->adapter_version_last,
                       (unsigned long long)s->adapter_version_first);
    return ck_str(c, "text", s->text, 0, MSG_MAX_TEXT);
}

static void sample_encode(enc_t *e, const msg_sample_t *s) {
    enc_map_begin(e);
    enc_key(e, "tokens");
    enc_vector(e, DT_I32, s->n_tokens, s->tokens);
    enc_key(e, "logprobs");
    enc_vector(e, DT_F32, s->n_tokens, s->logprobs);
    if (s->routing) {
        int64_t shape[3] = {s->routing_rows, s->routing_layers, s->routing_k};
        enc_key(e, "routing");
        enc_tensor(e, DT_U16, 3, shape, s->routing);
        if (s->routing_last) {
            enc_key(e, "routing_last");
            enc_tensor(e, DT_U16, 2, shape + 1, s->routing_last);
        }
    }
    enc_key(e, "finish_reason");
    enc_str(e, msg_finish_name(s->finish));
    enc_key(e, "adapter_version_first");
    enc_u64(e, s->adapter_version_first);
    enc_key(e, "adapter_version_last");
    enc_u64(e, s->adapter_version_last);
    enc_key(e, "text");
    enc_str(e, s->text);
    enc_map_end(e);
}

enum {
    G_GROUP_ID,
    G_LEASE_ID,
    G_PROMPT_ID,
    G_WORKER_ID,
    G_PROMPT_TOKENS,
    G_PROMPT,
    G_ANSWER,
    G_EXTRA,
    G_SAMPLES,
    G_REWARDS,
    G_REWARD_VERSION,
    G_REWARD_DETAILS,
    G_GEN_MS,
    G_SCORE_MS,
    G_COUNT
};

static int samples_decode(cx_t *c, const fld_t *f, msg_trajectory_group_t *g) {
    const msgpack_object *items = NULL;
    uint32_t n = 0;
    TRY(dec_array(c, f, MSG_MAX_SAMPLES, &items, &n));
    msg_sample_t *s;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *s, (void **)&s));
    memset(s, 0, (n ? n : 1) * sizeof *s);
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".samples[%u]", i);
        int rc = sample_decode(c, &items[i], &s[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    g->samples = s;
    g->n_samples = n;
    return MO_OK;
}

static int group_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_trajectory_group_t *g = &m->trajectory_group;
    fld_t f[G_COUNT] = {FLD("group_id"),  FLD("lease_id"),       FLD("prompt_id"),
                        FLD("worker_id"), FLD("prompt_tokens"),  FLD("prompt"),
                        FLD("answer"),    FLD("extra"),          FLD("samples"),
                        FLD("rewards"),   FLD("reward_version"), FLD("reward_details"),
                        FLD("gen_ms"),    FLD("score_ms")};
    TRY(dec_fields(c, o, NULL, f, G_COUNT));
    TRY(dec_u64(c, &f[G_GROUP_ID], &g->group_id));
    TRY(dec_u64(c, &f[G_LEASE_ID], &g->lease_id));
    TRY(dec_str(c, &f[G_PROMPT_ID], MSG_MAX_NAME, &g->prompt_id));
    TRY(dec_str(c, &f[G_WORKER_ID], MSG_MAX_ID, &g->worker_id));
    const void *p = NULL;
    TRY(dec_vector(c, &f[G_PROMPT_TOKENS], DT_I32, MSG_MAX_TOKENS, &p, &g->n_prompt_tokens));
    g->prompt_tokens = p;
    TRY(dec_str_opt(c, &f[G_PROMPT], MSG_MAX_TEXT, &g->prompt));
    TRY(dec_str_opt(c, &f[G_ANSWER], MSG_MAX_TEXT, &g->answer));
    TRY(dec_strmap_opt(c, &f[G_EXTRA], MSG_MAX_TEXT, &g->extra));
    TRY(samples_decode(c, &f[G_SAMPLES], g));
    TRY(rewards_decode(c, &f[G_REWARDS], g->n_samples, &g->rewards));
    bool has_version = false;
    TRY(dec_u64_opt(c, &f[G_REWARD_VERSION], &has_version, &g->reward_version));
    if (g->rewards && !has_version)
        return cx_fail(c, "reward_version", "missing (required with rewards)");
    if (!g->rewards && has_version)
        return cx_fail(c, "reward_version", "present without rewards");
    if (!g->rewards && fld_has(&f[G_REWARD_DETAILS]))
        return cx_fail(c, "reward_details", "present without rewards");
    TRY(details_decode(c, &f[G_REWARD_DETAILS], g->n_samples, &g->reward_details));
    TRY(dec_f64_opt(c, &f[G_GEN_MS], &g->has_gen_ms, &g->gen_ms));
    return dec_f64_opt(c, &f[G_SCORE_MS], &g->has_score_ms, &g->score_ms);
}

static int group_check(cx_t *c, const msg_t *m) {
    const msg_trajectory_group_t *g = &m->trajectory_group;
    TRY(ck_str(c, "prompt_id", g->prompt_id, 1, MSG_MAX_NAME));
    TRY(ck_id(c, "worker_id", g->worker_id));
    TRY(ck_tokens(c, "prompt_tokens", g->prompt_tokens, g->n_prompt_tokens, 1, MSG_MAX_TOKENS));
    TRY(ck_str_opt(c, "prompt", g->prompt, MSG_MAX_TEXT));
    TRY(ck_str_opt(c, "answer", g->answer, MSG_MAX_TEXT));
    TRY(ck_strmap(c, "extra", &g->extra, MSG_MAX_TEXT));
    if (g->n_samples < 1 || g->n_samples > MSG_MAX_SAMPLES)
        return cx_fail(c, "samples", "%u samples, expected 1 .. %d", g->n_samples, MSG_MAX_SAMPLES);
    if (!g->samples)
        return cx_fail(c, "samples", "%u samples but no array", g->n_samples);
    for (uint32_t i = 0; i < g->n_samples; i++) {
        size_t old = cx_push(c, ".samples[%u]", i);
        int rc = sample_check(c, &g->samples[i], g->n_prompt_tokens);
        cx_pop(c, old);
        TRY(rc);
    }
    TRY(ck_finite(c, "rewards", g->rewards, g->rewards ? g->n_samples : 0));
    if (g->reward_details && !g->rewards)
        return cx_fail(c, "reward_details", "present without rewards");
    if (g->reward_details)
        TRY(details_check(c, "reward_details", g->reward_details, g->n_samples));
    if (g->has_gen_ms)
        TRY(ck_f64(c, "gen_ms", g->gen_ms, 0, MSG_MAX_SECONDS_MS));
    if (g->has_score_ms)
        TRY(ck_f64(c, "score_ms", g->score_ms, 0, MSG_MAX_SECONDS_MS));
    return MO_OK;
}

static void group_encode(enc_t *e, const msg_t *m) {
    const msg_trajectory_group_t *g = &m->trajectory_group;
    enc_key(e, "group_id");
    enc_u64(e, g->group_id);
    enc_key(e, "lease_id");
    enc_u64(e, g->lease_id);
    enc_key(e, "prompt_id");
    enc_str(e, g->prompt_id);
    enc_key(e, "worker_id");
    enc_str(e, g->worker_id);
    enc_key(e, "prompt_tokens");
    enc_vector(e, DT_I32, g->n_prompt_tokens, g->prompt_tokens);
    if (g->prompt) {
        enc_key(e, "prompt");
        enc_str(e, g->prompt);
    }
    if (g->answer) {
        enc_key(e, "answer");
        enc_str(e, g->answer);
    }
    if (g->extra.n) {
        enc_key(e, "extra");
        enc_strmap(e, &g->extra);
    }
    enc_key(e, "samples");
    msgpack_pack_array(&e->pk, g->n_samples);
    for (uint32_t i = 0; i < g->n_samples; i++)
        sample_encode(e, &g->samples[i]);
    if (g->rewards) {
        enc_key(e, "rewards");
        enc_vector(e, DT_F32, g->n_samples, g->rewards);
        enc_key(e, "reward_version");
        enc_u64(e, g->reward_version);
        if (g->reward_details) {
            enc_key(e, "reward_details");
            details_encode(e, g->reward_details, g->n_samples);
        }
    }
    if (g->has_gen_ms) {
        enc_key(e, "gen_ms");
        enc_f64(e, g->gen_ms);
    }
    if (g->has_score_ms) {
        enc_key(e, "score_ms");
        enc_f64(e, g->score_ms);
    }
}

const msg_codec_t codec_trajectory_group = {group_decode, group_check, group_encode};

/* ---- score_request ---- */

static int score_sample_decode(cx_t *c, const msgpack_object *o, msg_score_sample_t *s) {
    fld_t f[3] = {FLD("text"), FLD("n_tokens"), FLD("finish_reason")};
    TRY(dec_fields(c, o, NULL, f, 3));
    TRY(dec_str(c, &f[0], MSG_MAX_TEXT, &s->text));
    TRY(dec_u32(c, &f[1], &s->n_tokens));
    int fin = 0;
    TRY(dec_enum(c, &f[2], finish_nm, MSG_FINISH_COUNT, &fin));
    s->finish = (msg_finish_t)fin;
    return MO_OK;
}

static int score_request_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_score_request_t *r = &m->score_request;
    fld_t f[6] = {FLD("group_id"), FLD("prompt_id"), FLD("prompt"),
                  FLD("answer"),   FLD("extra"),     FLD("samples")};
    TRY(dec_fields(c, o, NULL, f, 6));
    TRY(dec_u64(c, &f[0], &r->group_id));
    TRY(dec_str(c, &f[1], MSG_MAX_NAME, &r->prompt_id));
    TRY(dec_str_opt(c, &f[2], MSG_MAX_TEXT, &r->prompt));
    TRY(dec_str_opt(c, &f[3], MSG_MAX_TEXT, &r->answer));
    TRY(dec_strmap_opt(c, &f[4], MSG_MAX_TEXT, &r->extra));
    const msgpack_object *items = NULL;
    uint32_t n = 0;
    TRY(dec_array(c, &f[5], MSG_MAX_SAMPLES, &items, &n));
    msg_score_sample_t *s;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *s, (void **)&s));
    memset(s, 0, (n ? n : 1) * sizeof *s);
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".samples[%u]", i);
        int rc = score_sample_decode(c, &items[i], &s[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    r->samples = s;
    r->n_samples = n;
    return MO_OK;
}

static int score_request_check(cx_t *c, const msg_t *m) {
    const msg_score_request_t *r = &m->score_request;
    TRY(ck_str(c, "prompt_id", r->prompt_id, 1, MSG_MAX_NAME));
    TRY(ck_str_opt(c, "prompt", r->prompt, MSG_MAX_TEXT));
    TRY(ck_str_opt(c, "answer", r->answer, MSG_MAX_TEXT));
    TRY(ck_strmap(c, "extra", &r->extra, MSG_MAX_TEXT));
    if (r->n_samples < 1 || r->n_samples > MSG_MAX_SAMPLES)
        return cx_fail(c, "samples", "%u samples, expected 1 .. %d", r->n_samples, MSG_MAX_SAMPLES);
    if (!r->samples)
        return cx_fail(c, "samples", "%u samples but no array", r->n_samples);
    for (uint32_t i = 0; i < r->n_samples; i++) {
        const msg_score_sample_t *s = &r->samples[i];
        size_t old = cx_push(c, ".samples[%u]", i);
        int rc = ck_str(c, "text", s->text, 0, MSG_MAX_TEXT);
        if (rc == MO_OK)
            rc = ck_u64(c, "n_tokens", s->n_tokens, 0, MSG_MAX_TOKENS);
        if (rc == MO_OK)
            rc = ck_enum(c, "finish_reason", (int)s->finish, MSG_FINISH_COUNT);
        cx_pop(c, old);
        TRY(rc);
    }
    return MO_OK;
}

static void score_request_encode(enc_t *e, const msg_t *m) {
    const msg_score_request_t *r = &m->score_request;
    enc_key(e, "group_id");
    enc_u64(e, r->group_id);
    enc_key(e, "prompt_id");
    enc_str(e, r->prompt_id);
    if (r->prompt) {
        enc_key(e, "prompt");
        enc_str(e, r->prompt);
    }
    if (r->answer) {
        enc_key(e, "answer");
        enc_str(e, r->answer);
    }
    if (r->extra.n) {
        enc_key(e, "extra");
        enc_strmap(e, &r->extra);
    }
    enc_key(e, "samples");
    msgpack_pack_array(&e->pk, r->n_samples);
    for (uint32_t i = 0; i < r->n_samples; i++) {
        const msg_score_sample_t *s = &r->samples[i];
        enc_map_begin(e);
        enc_key(e, "text");
        enc_str(e, s->text);
        enc_key(e, "n_tokens");
        enc_u64(e, s->n_tokens);
        enc_key(e, "finish_reason");
        enc_str(e, msg_finish_name(s->finish));
        enc_map_end(e);
    }
}

const msg_codec_t codec_score_request = {score_request_decode, score_request_check,
                                         score_request_encode};

/* ---- score_reply ---- */

static int score_reply_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_score_reply_t *r = &m->score_reply;
    fld_t f[5] = {FLD("group_id"), FLD("reward_version"), FLD("rewards"), FLD("details"),
                  FLD("score_ms")};
    TRY(dec_fields(c, o, NULL, f, 5));
    TRY(dec_u64(c, &f[0], &r->group_id));
    TRY(dec_u64(c, &f[1], &r->reward_version));
    const void *p = NULL;
    TRY(dec_vector(c, &f[2], DT_F32, MSG_MAX_SAMPLES, &p, &r->n_samples));
    r->rewards = p;
    TRY(details_decode(c, &f[3], r->n_samples, &r->details));
    return dec_f64_opt(c, &f[4], &r->has_score_ms, &r->score_ms);
}

static int score_reply_check(cx_t *c, const msg_t *m) {
    const msg_score_reply_t *r = &m->score_reply;
    if (r->n_samples < 1 || r->n_samples > MSG_MAX_SAMPLES)
        return cx_fail(c, "rewards", "%u values, expected 1 .. %d", r->n_samples, MSG_MAX_SAMPLES);
    if (!r->rewards)
        return cx_fail(c, "rewards", "missing");
    TRY(ck_finite(c, "rewards", r->rewards, r->n_samples));
    if (r->details)
        TRY(details_check(c, "details", r->details, r->n_samples));
    if (r->has_score_ms)
        TRY(ck_f64(c, "score_ms", r->score_ms, 0, MSG_MAX_SECONDS_MS));
    return MO_OK;
}

static void score_reply_encode(enc_t *e, const msg_t *m) {
    const msg_score_reply_t *r = &m->score_reply;
    enc_key(e, "group_id");
    enc_u64(e, r->group_id);
    enc_key(e, "reward_version");
    enc_u64(e, r->reward_version);
    enc_key(e, "rewards");
    enc_vector(e, DT_F32, r->n_samples, r->rewards);
    if (r->details) {
        enc_key(e, "details");
        details_encode(e, r->details, r->n_samples);
    }
    if (r->has_score_ms) {
        enc_key(e, "score_ms");
        enc_f64(e, r->score_ms);
    }
}

const msg_codec_t codec_score_reply = {score_reply_decode, score_reply_check, score_reply_encode};
