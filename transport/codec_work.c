/* codec_work: work_request and lease (the work socket's messages). */
#include <string.h>

#include "core/status.h"
#include "transport/codec_internal.h"

/* ---- work_request ---- */

static int work_request_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_work_request_t *w = &m->work_request;
    fld_t f[2] = {FLD("worker_id"), FLD("credits")};
    TRY(dec_fields(c, o, NULL, f, 2));
    TRY(dec_str(c, &f[0], MSG_MAX_ID, &w->worker_id));
    return dec_u32(c, &f[1], &w->credits);
}

static int work_request_check(cx_t *c, const msg_t *m) {
    const msg_work_request_t *w = &m->work_request;
    TRY(ck_id(c, "worker_id", w->worker_id));
    return ck_u64(c, "credits", w->credits, 1, MSG_MAX_ITEMS);
}

static void work_request_encode(enc_t *e, const msg_t *m) {
    const msg_work_request_t *w = &m->work_request;
    enc_key(e, "worker_id");
    enc_str(e, w->worker_id);
    enc_key(e, "credits");
    enc_u64(e, w->credits);
}

const msg_codec_t codec_work_request = {work_request_decode, work_request_check,
                                        work_request_encode};

/* ---- lease ---- */

static int item_decode(cx_t *c, const msgpack_object *o, msg_lease_item_t *it) {
    fld_t f[7] = {FLD("group_id"), FLD("prompt_id"), FLD("prompt"), FLD("prompt_tokens"),
                  FLD("answer"),   FLD("extra"),     FLD("n")};
    TRY(dec_fields(c, o, NULL, f, 7));
    TRY(dec_u64(c, &f[0], &it->group_id));
    TRY(dec_str(c, &f[1], MSG_MAX_NAME, &it->prompt_id));
    TRY(dec_str_opt(c, &f[2], MSG_MAX_TEXT, &it->prompt));
    const void *p = NULL;
    TRY(dec_vector_opt(c, &f[3], DT_I32, MSG_MAX_TOKENS, &p, &it->n_prompt_tokens));
    it->prompt_tokens = p;
    TRY(dec_str_opt(c, &f[4], MSG_MAX_TEXT, &it->answer));
    TRY(dec_strmap_opt(c, &f[5], MSG_MAX_TEXT, &it->extra));
    return dec_u32(c, &f[6], &it->n);
}

static int item_check(cx_t *c, const msg_lease_item_t *it) {
    TRY(ck_str(c, "prompt_id", it->prompt_id, 1, MSG_MAX_NAME));
    TRY(ck_str_opt(c, "prompt", it->prompt, MSG_MAX_TEXT));
    if (it->prompt_tokens)
        TRY(ck_tokens(c, "prompt_tokens", it->prompt_tokens, it->n_prompt_tokens, 1,
                      MSG_MAX_TOKENS));
    else if (it->n_prompt_tokens)
        return cx_fail(c, "prompt_tokens", "%u tokens but no data", it->n_prompt_tokens);
    if (!it->prompt && !it->prompt_tokens)
        return cx_fail(c, NULL, "neither prompt nor prompt_tokens");
    TRY(ck_str_opt(c, "answer", it->answer, MSG_MAX_TEXT));
    TRY(ck_strmap(c, "extra", &it->extra, MSG_MAX_TEXT));
    return ck_u64(c, "n", it->n, 1, MSG_MAX_SAMPLES);
}

static void item_encode(enc_t *e, const msg_lease_item_t *it) {
    enc_map_begin(e);
    enc_key(e, "group_id");
    enc_u64(e, it->group_id);
    enc_key(e, "prompt_id");
    enc_str(e, it->prompt_id);
    if (it->prompt) {
        enc_key(e, "prompt");
        enc_str(e, it->prompt);
    }
    if (it->prompt_tokens) {
        enc_key(e, "prompt_tokens");
        enc_vector(e, DT_I32, it->n_prompt_tokens, it->prompt_tokens);
    }
    if (it->answer) {
        enc_key(e, "answer");
        enc_str(e, it->answer);
    }
    if (it->extra.n) {
        enc_key(e, "extra");
        enc_strmap(e, &it->extra);
    }
    enc_key(e, "n");
    enc_u64(e, it->n);
    enc_map_end(e);
}

static int lease_decode(cx_t *c, const msgpack_object *o, msg_t *m) {
    msg_lease_t *l = &m->lease;
    fld_t f[4] = {FLD("lease_id"), FLD("deadline_ms"), FLD("policy_version"), FLD("items")};
    TRY(dec_fields(c, o, NULL, f, 4));
    TRY(dec_u64(c, &f[0], &l->lease_id));
    TRY(dec_u32(c, &f[1], &l->deadline_ms));
    TRY(dec_u64(c, &f[2], &l->policy_version));
    const msgpack_object *items = NULL;
    uint32_t n = 0;
    TRY(dec_array(c, &f[3], MSG_MAX_ITEMS, &items, &n));
    msg_lease_item_t *it;
    TRY(cx_alloc(c, (n ? n : 1) * sizeof *it, (void **)&it));
    memset(it, 0, (n ? n : 1) * sizeof *it);
    for (uint32_t i = 0; i < n; i++) {
        size_t old = cx_push(c, ".items[%u]", i);
        int rc = item_decode(c, &items[i], &it[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    l->items = it;
    l->n_items = n;
    return MO_OK;
}

static int lease_check(cx_t *c, const msg_t *m) {
    const msg_lease_t *l = &m->lease;
    TRY(ck_u64(c, "deadline_ms", l->deadline_ms, 1, MSG_MAX_DEADLINE_MS));
    TRY(ck_u64(c, "items", l->n_items, 1, MSG_MAX_ITEMS));
    if (!l->items)
        return cx_fail(c, "items", "%u items but no array", l->n_items);
    for (uint32_t i = 0; i < l->n_items; i++) {
        size_t old = cx_push(c, ".items[%u]", i);
        int rc = item_check(c, &l->items[i]);
        cx_pop(c, old);
        TRY(rc);
    }
    return MO_OK;
}

static void lease_encode(enc_t *e, const msg_t *m) {
    const msg_lease_t *l = &m->lease;
    enc_key(e, "lease_id");
    enc_u64(e, l->lease_id);
    enc_key(e, "deadline_ms");
    enc_u64(e, l->deadline_ms);
    enc_key(e, "policy_version");
    enc_u64(e, l->policy_version);
    enc_key(e, "items");
    msgpack_pack_array(&e->pk, l->n_items);
    for (uint32_t i = 0; i < l->n_items; i++)
        item_encode(e, &l->items[i]);
}

const msg_codec_t codec_lease = {lease_decode, lease_check, lease_encode};
