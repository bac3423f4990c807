/* Tests for the message codecs: round trips of every message with every
 * optional field present and absent, every kind of validation failure
 * (wrong type, missing field, bad version, over-long strings and arrays,
 * tensor byte counts, out-of-range numbers) naming the field, every
 * truncation, random byte mutation, and the wire format as a Python
 * MessagePack peer sees it. */
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/msg.h"

/* ---- Sample messages ---- */

#define P_TOK 7 /* prompt tokens */
#define N_SAMPLES 3
#define L_MOE 2
#define K_TOP 2

static int32_t g_prompt[P_TOK];
static int32_t g_tok[N_SAMPLES][8];
static float g_lp[N_SAMPLES][8];
static uint16_t g_route[N_SAMPLES][(P_TOK + 8) * L_MOE * K_TOP];
static const uint32_t g_ntok[N_SAMPLES] = {5, 6, 0};
static float g_rewards[N_SAMPLES] = {1.0f, -0.5f, 0.25f};
static uint8_t g_flat[37];

static void init_data(void) {
    for (int i = 0; i < P_TOK; i++)
        g_prompt[i] = 100 + 13 * i;
    for (int s = 0; s < N_SAMPLES; s++) {
        for (int i = 0; i < 8; i++) {
            g_tok[s][i] = 1000 * (s + 1) + 7 * i;
            g_lp[s][i] = -0.1f - 0.37f * (float)i - (float)s;
        }
        for (size_t i = 0; i < sizeof g_route[s] / sizeof g_route[s][0]; i++)
            g_route[s][i] = (uint16_t)((i * 5 + (size_t)s) % 64);
    }
    for (size_t i = 0; i < sizeof g_flat; i++)
        g_flat[i] = (uint8_t)(i * 29 + 3);
}

static const msg_kv_t g_extra[] = {{"task", "arith"}, {"difficulty", "3"}};
static const msg_kv_t g_args[] = {{"function", "exact_match"}, {"plugin", "/opt/r.so"}};
static const msg_kv_t g_meta[] = {{"rank", "8"}, {"alpha", "16"}};
static const char *const g_stop[] = {"</answer>", "\n\n"};
static const msg_metric_t g_det0[] = {{"correct", 1.0}, {"format", 0.5}};
static const msg_metric_t g_det1[] = {{"correct", 0.0}};
static const msg_metrics_t g_details[N_SAMPLES] = {{g_det0, 2}, {g_det1, 1}, {NULL, 0}};
static msg_stat_t g_status[5];
static msg_sample_t g_samples[N_SAMPLES];
static msg_score_sample_t g_ssamples[N_SAMPLES];
static msg_lease_item_t g_items[2];
static msg_tensor_entry_t g_table[3];

/* Fills m with a valid message of type t; full: every optional field set. */
static void build(msg_t *m, msg_type_t t, int full) {
    msg_init(m);
    m->type = t;
    switch (t) {
    case MSG_HELLO:
        m->hello = (msg_hello_t){MSG_ROLE_ROLLOUT, "rollout-3", 4242, "node7.example",
                                 full ? "moerl 0.1.0" : NULL};
        break;
    case MSG_WELCOME: {
        msg_welcome_t *w = &m->welcome;
        w->job = "grpo-tiny";
        w->policy_version = 17;
        w->model_path = full ? "/models/qwen3-moe-tiny" : "";
        w->group_size = 8;
        w->sampling = (msg_sampling_t){
            0.7, 0.95, 50, 0.05, 256, full ? g_stop : NULL, full ? 2 : 0, 0xfeedbeefcafeULL};
        w->heartbeat_ms = 1000;
        w->has_reward = full;
        w->reward = (msg_reward_spec_t){3, "exact_match", "/opt/reward.so"};
        break;
    }
    case MSG_HEARTBEAT:
        m->heartbeat =
            (msg_heartbeat_t){"reward-0", MSG_ROLE_REWARD, full, 9, full, 4, 2, 1234.5, 7};
        break;
    case MSG_WORK_REQUEST: m->work_request = (msg_work_request_t){"rollout-1", 16}; break;
    case MSG_LEASE:
        g_items[0] = (msg_lease_item_t){0x1234567890ULL, "arith/42", "What is 2+3?", g_prompt,
                                        P_TOK,           "5",        {g_extra, 2},   8};
        g_items[1] =
            (msg_lease_item_t){0x1234567891ULL, "arith/43", NULL, g_prompt, 3, NULL, {NULL, 0}, 4};
        if (!full) {
            g_items[0].prompt_tokens = NULL;
            g_items[0].n_prompt_tokens = 0;
            g_items[0].answer = NULL;
            g_items[0].extra.n = 0;
        }
        m->lease = (msg_lease_t){77, 60000, 17, g_items, full ? 2 : 1};
        break;
    case MSG_TRAJECTORY_GROUP: {
        for (int s = 0; s < N_SAMPLES; s++) {
            msg_sample_t *x = &g_samples[s];
            *x = (msg_sample_t){g_tok[s],
                                g_lp[s],
                                g_ntok[s],
                                NULL,
                                0,
                                0,
                                0,
                                (msg_finish_t)(s % 3),
                                16,
                                17,
                                s == 1 ? "" : "the answer is 5",
                                NULL};
            if (full) {
                x->routing = g_route[s];
                x->routing_rows = s == 1 ? P_TOK + g_ntok[s] - 1 : g_ntok[s];
                x->routing_layers = L_MOE;
                x->routing_k = K_TOP;
                if (s == 0) /* the read of the last token, after the routing rows */
                    x->routing_last = g_route[s] + (size_t)x->routing_rows * L_MOE * K_TOP;
            }
        }
        msg_trajectory_group_t *g = &m->trajectory_group;
        g->group_id = 0x1234567890ULL;
        g->lease_id = 77;
        g->prompt_id = "arith/42";
        g->worker_id = "rollout-3";
        g->prompt_tokens = g_prompt;
        g->n_prompt_tokens = P_TOK;
        g->prompt = full ? "What is 2+3?" : NULL;
        g->answer = full ? "5" : NULL;
        g->extra = full ? (msg_strmap_t){g_extra, 2} : (msg_strmap_t){NULL, 0};
        g->samples = g_samples;
        g->n_samples = N_SAMPLES;
        g->rewards = full ? g_rewards : NULL;
        g->reward_version = full ? 3 : 0;
        g->reward_details = full ? g_details : NULL;
        g->has_gen_ms = full;
        g->gen_ms = 812.25;
        g->has_score_ms = full;
        g->score_ms = 3.5;
        break;
    }
    case MSG_SCORE_REQUEST:
        for (int s = 0; s < N_SAMPLES; s++)
            g_ssamples[s] = (msg_score_sample_t){s == 2 ? "" : "the answer is 5", g_ntok[s],
                                                 (msg_finish_t)(s % 3)};
        m->score_request =
            (msg_score_request_t){0x1234567890ULL,
                                  "arith/42",
                                  full ? "What is 2+3?" : NULL,
                                  full ? "5" : NULL,
                                  full ? (msg_strmap_t){g_extra, 2} : (msg_strmap_t){NULL, 0},
                                  g_ssamples,
                                  N_SAMPLES};
        break;
    case MSG_SCORE_REPLY:
        m->score_reply = (msg_score_reply_t){0x1234567890ULL,         3,    g_rewards, N_SAMPLES,
                                             full ? g_details : NULL, full, 2.75};
        break;
    case MSG_WEIGHTS_CHUNK: {
        g_table[0] = (msg_tensor_entry_t){"layers.0.q_proj.lora_A", DT_F32, 2, {2, 3}, 0};
        g_table[1] = (msg_tensor_entry_t){"layers.0.q_proj.lora_B", DT_BF16, 1, {4}, 24};
        g_table[2] = (msg_tensor_entry_t){"scale", DT_U8, 1, {5}, 32};
        msg_weights_chunk_t *w = &m->weights_chunk;
        w->version = 5;
        w->checksum = 0x0123456789abcdefULL;
        w->n_chunks = 3;
        w->total_bytes = sizeof g_flat;
        w->chunk_bytes = 16;
        w->chunk_index = full ? 0 : 1;
        w->table = full ? g_table : NULL;
        w->n_table = full ? 3 : 0;
        w->meta = full ? (msg_strmap_t){g_meta, 2} : (msg_strmap_t){NULL, 0};
        w->data = g_flat + (full ? 0 : 16);
        w->nbytes = 16;
        break;
    }
    case MSG_SNAPSHOT_REQUEST:
        m->snapshot_request = (msg_snapshot_request_t){"rollout-0", full, 12};
        break;
    case MSG_CTL_REQUEST:
        m->ctl_request = (msg_ctl_request_t){MSG_CTL_SWAP_REWARD, full ? (msg_strmap_t){g_args, 2}
                                                                       : (msg_strmap_t){NULL, 0}};
        break;
    case MSG_CTL_REPLY:
        g_status[0] = (msg_stat_t){"step", MSG_VAL_INT, 120, 0, NULL};
        g_status[1] = (msg_stat_t){"loss", MSG_VAL_FLOAT, 0, 0.125, NULL};
        g_status[2] = (msg_stat_t){"state", MSG_VAL_STR, 0, 0, "training"};
        g_status[3] = (msg_stat_t){"paused", MSG_VAL_BOOL, 1, 0, NULL};
        g_status[4] = (msg_stat_t){"grad_norm", MSG_VAL_FLOAT, 0, NAN, NULL};
        m->ctl_reply = (msg_ctl_reply_t){true, full ? "ok: step 120" : "", full ? g_status : NULL,
                                         full ? 5 : 0};
        break;
    case MSG_REWARD_SWAP:
        m->reward_swap.spec = (msg_reward_spec_t){4, "math_verify", full ? "/opt/r.so" : NULL};
        break;
    case MSG_ERROR:
        m->error = (msg_error_t){MO_EMALFORMED, "lease.items[0].n: 0 is out of range",
                                 full ? "lease" : NULL, full, 77};
        break;
    default: break;
    }
}

static int encode_ok(const msg_t *m, msg_buf_t *b) {
    msg_buf_init(b);
    int rc = msg_encode(m, b);
    if (rc != MO_OK)
        tu_report("encode %s: %s", msg_type_name(m->type), mo_last_error());
    return rc;
}

/* ---- Field-by-field comparison of a decoded message with its source ---- */

static int str_eq(const char *a, const char *b) {
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static int strmap_eq(const msg_strmap_t *a, const msg_strmap_t *b) {
    if (a->n != b->n)
        return 0;
    for (uint32_t i = 0; i < a->n; i++)
        if (!str_eq(a->items[i].key, b->items[i].key) ||
            !str_eq(a->items[i].value, b->items[i].value))
            return 0;
    return 1;
}

static int metrics_eq(const msg_metrics_t *a, const msg_metrics_t *b, uint32_t n) {
    if (!a || !b)
        return a == b;
    for (uint32_t s = 0; s < n; s++) {
        if (a[s].n != b[s].n)
            return 0;
        for (uint32_t i = 0; i < a[s].n; i++)
            if (!str_eq(a[s].items[i].key, b[s].items[i].key) ||
                a[s].items[i].value != b[s].items[i].value)
                return 0;
    }
    return 1;
}

static int mem_eq(const void *a, const void *b, size_t n) {
    if (!a || !b)
        return a == b;
    return n == 0 || memcmp(a, b, n) == 0;
}

static void expect_same_trajectory(const msg_trajectory_group_t *a,
                                   const msg_trajectory_group_t *b) {
    CU_ASSERT(a->group_id == b->group_id && a->lease_id == b->lease_id);
    CU_ASSERT(str_eq(a->prompt_id, b->prompt_id) && str_eq(a->worker_id, b->worker_id));
    CU_ASSERT(a->n_prompt_tokens == b->n_prompt_tokens);
    CU_ASSERT(mem_eq(a->prompt_tokens, b->prompt_tokens, (size_t)4 * a->n_prompt_tokens));
    CU_ASSERT(str_eq(a->prompt, b->prompt) && str_eq(a->answer, b->answer));
    CU_ASSERT(strmap_eq(&a->extra, &b->extra));
    CU_ASSERT_FATAL(a->n_samples == b->n_samples);
    for (uint32_t s = 0; s < a->n_samples; s++) {
        const msg_sample_t *x = &a->samples[s], *y = &b->samples[s];
        CU_ASSERT(x->n_tokens == y->n_tokens);
        CU_ASSERT(mem_eq(x->tokens, y->tokens, (size_t)4 * x->n_tokens) || x->n_tokens == 0);
        CU_ASSERT(mem_eq(x->logprobs, y->logprobs, (size_t)4 * x->n_tokens) || x->n_tokens == 0);
        CU_ASSERT((x->routing == NULL) == (y->routing == NULL));
        if (x->routing && y->routing) {
            CU_ASSERT(x->routing_rows == y->routing_rows &&
                      x->routing_layers == y->routing_layers && x->routing_k == y->routing_k);
            CU_ASSERT(mem_eq(x->routing, y->routing,
                             2 * (size_t)x->routing_rows * x->routing_layers * x->routing_k) ||
                      x->routing_rows == 0);
        }
        CU_ASSERT(x->finish == y->finish);
        CU_ASSERT(x->adapter_version_first == y->adapter_version_first &&
                  x->adapter_version_last == y->adapter_version_last);
        CU_ASSERT(str_eq(x->text, y->text));
    }
    CU_ASSERT((a->rewards == NULL) == (b->rewards == NULL));
    if (a->rewards && b->rewards) {
        CU_ASSERT(mem_eq(a->rewards, b->rewards, (size_t)4 * a->n_samples));
        CU_ASSERT(a->reward_version == b->reward_version);
    }
    CU_ASSERT(metrics_eq(a->reward_details, b->reward_details, a->n_samples));
    CU_ASSERT(a->has_gen_ms == b->has_gen_ms && a->has_score_ms == b->has_score_ms);
    CU_ASSERT(!a->has_gen_ms || a->gen_ms == b->gen_ms);
    CU_ASSERT(!a->has_score_ms || a->score_ms == b->score_ms);
}

static void expect_same(const msg_t *a, const msg_t *b) {
    CU_ASSERT_FATAL(a->type == b->type);
    switch (a->type) {
    case MSG_HELLO:
        CU_ASSERT(a->hello.role == b->hello.role && a->hello.pid == b->hello.pid);
        CU_ASSERT(str_eq(a->hello.worker_id, b->hello.worker_id));
        CU_ASSERT(str_eq(a->hello.host, b->hello.host));
        CU_ASSERT(str_eq(a->hello.software, b->hello.software));
        break;
    case MSG_WELCOME: {
        const msg_welcome_t *x = &a->welcome, *y = &b->welcome;
        CU_ASSERT(str_eq(x->job, y->job) && str_eq(x->model_path, y->model_path));
        CU_ASSERT(x->policy_version == y->policy_version && x->group_size == y->group_size);
        CU_ASSERT(x->heartbeat_ms == y->heartbeat_ms);
        const msg_sampling_t *s = &x->sampling, *t = &y->sampling;
        CU_ASSERT(s->temperature == t->temperature && s->top_p == t->top_p);
        CU_ASSERT(s->top_k == t->top_k && s->min_p == t->min_p);
        CU_ASSERT(s->max_new_tokens == t->max_new_tokens && s->seed == t->seed);
        CU_ASSERT_FATAL(s->n_stop == t->n_stop);
        for (uint32_t i = 0; i < s->n_stop; i++)
            CU_ASSERT(str_eq(s->stop[i], t->stop[i]));
        CU_ASSERT(x->has_reward == y->has_reward);
        if (x->has_reward) {
            CU_ASSERT(x->reward.version == y->reward.version);
            CU_ASSERT(str_eq(x->reward.function, y->reward.function));
            CU_ASSERT(str_eq(x->reward.plugin, y->reward.plugin));
        }
        break;
    }
    case MSG_HEARTBEAT: {
        const msg_heartbeat_t *x = &a->heartbeat, *y = &b->heartbeat;
        CU_ASSERT(str_eq(x->worker_id, y->worker_id) && x->role == y->role);
        CU_ASSERT(x->has_adapter_version == y->has_adapter_version);
        CU_ASSERT(!x->has_adapter_version || x->adapter_version == y->adapter_version);
        CU_ASSERT(x->has_reward_version == y->has_reward_version);
        CU_ASSERT(!x->has_reward_version || x->reward_version == y->reward_version);
        CU_ASSERT(x->inflight == y->inflight && x->queue_depth == y->queue_depth);
        CU_ASSERT(x->tokens_per_s == y->tokens_per_s);
        break;
    }
    case MSG_WORK_REQUEST:
        CU_ASSERT(str_eq(a->work_request.worker_id, b->work_request.worker_id));
        CU_ASSERT(a->work_request.credits == b->work_request.credits);
        break;
    case MSG_LEASE: {
        const msg_lease_t *x = &a->lease, *y = &b->lease;
        CU_ASSERT(x->lease_id == y->lease_id && x->deadline_ms == y->deadline_ms);
        CU_ASSERT(x->policy_version == y->policy_version);
        CU_ASSERT_FATAL(x->n_items == y->n_items);
        for (uint32_t i = 0; i < x->n_items; i++) {
            const msg_lease_item_t *p = &x->items[i], *q = &y->items[i];
            CU_ASSERT(p->group_id == q->group_id && p->n == q->n);
            CU_ASSERT(str_eq(p->prompt_id, q->prompt_id) && str_eq(p->prompt, q->prompt));
            CU_ASSERT(str_eq(p->answer, q->answer) && strmap_eq(&p->extra, &q->extra));
            CU_ASSERT(p->n_prompt_tokens == q->n_prompt_tokens);
            CU_ASSERT(mem_eq(p->prompt_tokens, q->prompt_tokens, (size_t)4 * p->n_prompt_tokens));
        }
        break;
    }
    case MSG_TRAJECTORY_GROUP:
        expect_same_trajectory(&a->trajectory_group, &b->trajectory_group);
        break;
    case MSG_SCORE_REQUEST: {
        const msg_score_request_t *x = &a->score_request, *y = &b->score_request;
        CU_ASSERT(x->group_id == y->group_id && str_eq(x->prompt_id, y->prompt_id));
        CU_ASSERT(str_eq(x->prompt, y->prompt) && str_eq(x->answer, y->answer));
        CU_ASSERT(strmap_eq(&x->extra, &y->extra));
        CU_ASSERT_FATAL(x->n_samples == y->n_samples);
        for (uint32_t i = 0; i < x->n_samples; i++) {
            CU_ASSERT(str_eq(x->samples[i].text, y->samples[i].text));
            CU_ASSERT(x->samples[i].n_tokens == y->samples[i].n_tokens);
            CU_ASSERT(x->samples[i].finish == y->samples[i].finish);
        }
        break;
    }
    case MSG_SCORE_REPLY: {
        const msg_score_reply_t *x = &a->score_reply, *y = &b->score_reply;
        CU_ASSERT(x->group_id == y->group_id && x->reward_version == y->reward_version);
        CU_ASSERT_FATAL(x->n_samples == y->n_samples);
        CU_ASSERT(mem_eq(x->rewards, y->rewards, (size_t)4 * x->n_samples));
        CU_ASSERT(metrics_eq(x->details, y->details, x->n_samples));
        CU_ASSERT(x->has_score_ms == y->has_score_ms);
        CU_ASSERT(!x->has_score_ms || x->score_ms == y->score_ms);
        break;
    }
    case MSG_WEIGHTS_CHUNK: {
        const msg_weights_chunk_t *x = &a->weights_chunk, *y = &b->weights_chunk;
        CU_ASSERT(x->version == y->version && x->checksum == y->checksum);
        CU_ASSERT(x->chunk_index == y->chunk_index && x->n_chunks == y->n_chunks);
        CU_ASSERT(x->total_bytes == y->total_bytes && x->chunk_bytes == y->chunk_bytes);
        CU_ASSERT_FATAL(x->nbytes == y->nbytes);
        CU_ASSERT(mem_eq(x->data, y->data, x->nbytes));
        CU_ASSERT(strmap_eq(&x->meta, &y->meta));
        CU_ASSERT_FATAL(x->n_table == y->n_table);
        for (uint32_t i = 0; i < x->n_table; i++) {
            const msg_tensor_entry_t *p = &x->table[i], *q = &y->table[i];
            CU_ASSERT(str_eq(p->name, q->name) && p->dtype == q->dtype);
            CU_ASSERT(p->ndim == q->ndim && p->offset == q->offset);
            CU_ASSERT(memcmp(p->shape, q->shape, p->ndim * sizeof p->shape[0]) == 0);
        }
        break;
    }
    case MSG_SNAPSHOT_REQUEST:
        CU_ASSERT(str_eq(a->snapshot_request.worker_id, b->snapshot_request.worker_id));
        CU_ASSERT(a->snapshot_request.has_version == b->snapshot_request.has_version);
        CU_ASSERT(!a->snapshot_request.has_version ||
                  a->snapshot_request.have_version == b->snapshot_request.have_version);
        break;
    case MSG_CTL_REQUEST:
        CU_ASSERT(a->ctl_request.command == b->ctl_request.command);
        CU_ASSERT(strmap_eq(&a->ctl_request.args, &b->ctl_request.args));
        break;
    case MSG_CTL_REPLY: {
        const msg_ctl_reply_t *x = &a->ctl_reply, *y = &b->ctl_reply;
        CU_ASSERT(x->ok == y->ok && str_eq(x->message, y->message));
        CU_ASSERT_FATAL(x->n_status == y->n_status);
        for (uint32_t i = 0; i < x->n_status; i++) {
            const msg_stat_t *p = &x->status[i], *q = &y->status[i];
            CU_ASSERT(str_eq(p->key, q->key) && p->kind == q->kind);
            if (p->kind == MSG_VAL_INT || p->kind == MSG_VAL_BOOL)
                CU_ASSERT(p->i == q->i);
            if (p->kind == MSG_VAL_FLOAT)
                CU_ASSERT(p->f == q->f || (isnan(p->f) && isnan(q->f)));
            if (p->kind == MSG_VAL_STR)
                CU_ASSERT(str_eq(p->s, q->s));
        }
        break;
    }
    case MSG_REWARD_SWAP:
        CU_ASSERT(a->reward_swap.spec.version == b->reward_swap.spec.version);
        CU_ASSERT(str_eq(a->reward_swap.spec.function, b->reward_swap.spec.function));
        CU_ASSERT(str_eq(a->reward_swap.spec.plugin, b->reward_swap.spec.plugin));
        break;
    case MSG_ERROR:
        CU_ASSERT(a->error.code == b->error.code && str_eq(a->error.message, b->error.message));
        CU_ASSERT(str_eq(a->error.about, b->error.about) && a->error.has_id == b->error.has_id);
        CU_ASSERT(!a->error.has_id || a->error.id == b->error.id);
        break;
    default: CU_FAIL("unexpected type");
    }
}

/* ---- Round trips ---- */

static void test_roundtrip(void) {
    for (int t = MSG_NONE + 1; t < MSG_TYPE_COUNT; t++) {
        for (int full = 0; full < 2; full++) {
            msg_t m, d;
            build(&m, (msg_type_t)t, full);
            msg_buf_t a, b;
            CU_ASSERT_FATAL(encode_ok(&m, &a) == MO_OK);
            int rc = msg_decode(&d, a.data, a.len, (msg_type_t)t);
            if (rc != MO_OK)
                tu_report("decode %s (full=%d): %s", msg_type_name((msg_type_t)t), full,
                          mo_last_error());
            CU_ASSERT_FATAL(rc == MO_OK);
            expect_same(&m, &d);
            msg_type_t peek = MSG_NONE;
            CU_ASSERT(msg_peek_type(a.data, a.len, &peek) == MO_OK && (int)peek == t);
            /* Re-encoding the decoded message gives the same bytes. */
            CU_ASSERT_FATAL(encode_ok(&d, &b) == MO_OK);
            CU_ASSERT(a.len == b.len && memcmp(a.data, b.data, a.len) == 0);
            msg_free(&d);
            msg_free(&d); /* twice is safe */
            msg_buf_free(&a);
            msg_buf_free(&b);
        }
    }
}

/* Optional fields really are absent from the minimal encodings and present in the full ones. */
static void test_optional_presence(void) {
    msg_t m, d;
    msg_buf_t a;
    build(&m, MSG_TRAJECTORY_GROUP, 0);
    CU_ASSERT_FATAL(encode_ok(&m, &a) == MO_OK);
    CU_ASSERT_FATAL(msg_decode(&d, a.data, a.len, MSG_NONE) == MO_OK);
    const msg_trajectory_group_t *g = &d.trajectory_group;
    CU_ASSERT(g->prompt == NULL && g->answer == NULL && g->extra.n == 0);
    CU_ASSERT(g->rewards == NULL && g->reward_details == NULL);
    CU_ASSERT(!g->has_gen_ms && !g->has_score_ms && g->samples[0].routing == NULL);
    msg_free(&d);
    msg_buf_free(&a);

    build(&m, MSG_TRAJECTORY_GROUP, 1);
    CU_ASSERT_FATAL(encode_ok(&m, &a) == MO_OK);
    CU_ASSERT_FATAL(msg_decode(&d, a.data, a.len, MSG_TRAJECTORY_GROUP) == MO_OK);
    g = &d.trajectory_group;
    CU_ASSERT(g->rewards && g->rewards[1] == -0.5f && g->reward_version == 3);
    CU_ASSERT(g->samples[1].routing_rows == P_TOK + 6 - 1);
    CU_ASSERT(g->samples[1].routing[3] == g_route[1][3]);
    CU_ASSERT_FATAL(g->samples[0].routing_last != NULL);
    CU_ASSERT(g->samples[1].routing_last == NULL);
    for (int i = 0; i < L_MOE * K_TOP; i++)
        CU_ASSERT(g->samples[0].routing_last[i] ==
                  g_route[0][(size_t)g->samples[0].routing_rows * L_MOE * K_TOP + (size_t)i]);
    CU_ASSERT(g->samples[2].n_tokens == 0 && g->samples[2].finish == MSG_FINISH_ABORT);
    CU_ASSERT(g->reward_details[0].n == 2 && g->reward_details[0].items[1].value == 0.5);
    msg_free(&d);
    msg_buf_free(&a);
}

/* routing_last: only with routing, and of routing's (L, K). */
static void test_routing_last(void) {
    msg_t m, d;
    msg_buf_t a;
    msg_buf_init(&a);
    build(&m, MSG_TRAJECTORY_GROUP, 1);
    msg_sample_t *x = (msg_sample_t *)&m.trajectory_group.samples[1];
    x->routing_last = g_route[1];
    x->routing = NULL;
    CU_ASSERT(msg_encode(&m, &a) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "samples[1].routing_last: sent without routing") != NULL);
    /* an encoding with routing_last, then its routing dropped: the decoder refuses */
    build(&m, MSG_TRAJECTORY_GROUP, 1);
    CU_ASSERT_FATAL(msg_encode(&m, &a) == MO_OK);
    static const char key[] = "\xa7routing\x83";
    uint8_t *at = NULL;
    for (size_t i = 0; i + sizeof key - 1 <= a.len && !at; i++)
        if (memcmp(a.data + i, key, sizeof key - 1) == 0)
            at = a.data + i;
    CU_ASSERT_FATAL(at != NULL);
    at[1] = 'X'; /* "routing" becomes "Xouting", an unknown key */
    CU_ASSERT(msg_decode(&d, a.data, a.len, MSG_NONE) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "samples[0].routing_last: sent without routing") != NULL);
    msg_free(&d);
    msg_buf_free(&a);
}

/* ---- Editing encoded messages as MessagePack object trees ---- */

typedef struct tmem {
    void *p[1024];
    int n;
} tmem_t;
static tmem_t g_tm;

static void *tm_alloc(size_t n) {
    CU_ASSERT_FATAL(g_tm.n < 1024);
    void *p = calloc(1, n ? n : 1);
    CU_ASSERT_FATAL(p != NULL);
    g_tm.p[g_tm.n++] = p;
    return p;
}

static void tm_free_all(void) {
    for (int i = 0; i < g_tm.n; i++)
        free(g_tm.p[i]);
    g_tm.n = 0;
}

static msgpack_object o_str(const char *s) {
    msgpack_object o = {.type = MSGPACK_OBJECT_STR};
    o.via.str.ptr = s;
    o.via.str.size = (uint32_t)strlen(s);
    return o;
}

static msgpack_object o_strn(const char *s, size_t n) {
    msgpack_object o = {.type = MSGPACK_OBJECT_STR};
    o.via.str.ptr = s;
    o.via.str.size = (uint32_t)n;
    return o;
}

static msgpack_object o_long(size_t n) { /* a string of n 'x' */
    char *s = tm_alloc(n);
    memset(s, 'x', n);
    return o_strn(s, n);
}

static msgpack_object o_int(int64_t v) {
    msgpack_object o;
    if (v >= 0) {
        o.type = MSGPACK_OBJECT_POSITIVE_INTEGER;
        o.via.u64 = (uint64_t)v;
    } else {
        o.type = MSGPACK_OBJECT_NEGATIVE_INTEGER;
        o.via.i64 = v;
    }
    return o;
}

static msgpack_object o_uint(uint64_t v) {
    msgpack_object o = {.type = MSGPACK_OBJECT_POSITIVE_INTEGER};
    o.via.u64 = v;
    return o;
}

static msgpack_object o_f64(double v) {
    msgpack_object o = {.type = MSGPACK_OBJECT_FLOAT64};
    o.via.f64 = v;
    return o;
}

static msgpack_object o_bool(bool v) {
    msgpack_object o = {.type = MSGPACK_OBJECT_BOOLEAN};
    o.via.boolean = v;
    return o;
}

static msgpack_object o_nil(void) {
    msgpack_object o = {.type = MSGPACK_OBJECT_NIL};
    return o;
}

static msgpack_object o_bin(const void *p, size_t n) {
    msgpack_object o = {.type = MSGPACK_OBJECT_BIN};
    o.via.bin.ptr = p;
    o.via.bin.size = (uint32_t)n;
    return o;
}

/* An array of n copies of item. */
static msgpack_object o_array(size_t n, msgpack_object item) {
    msgpack_object o = {.type = MSGPACK_OBJECT_ARRAY};
    msgpack_object *a = tm_alloc(n * sizeof *a);
    for (size_t i = 0; i < n; i++)
        a[i] = item;
    o.via.array.ptr = a;
    o.via.array.size = (uint32_t)n;
    return o;
}

static msgpack_object o_map0(void) {
    msgpack_object o = {.type = MSGPACK_OBJECT_MAP};
    o.via.map.ptr = NULL;
    o.via.map.size = 0;
    return o;
}

/* A tensor map {dtype, shape [n], data}; bytes may disagree with n. */
static msgpack_object o_tensor(const char *dtype, const int64_t *shape, int ndim, const void *data,
                               size_t bytes) {
    msgpack_object_kv *kv = tm_alloc(3 * sizeof *kv);
    kv[0].key = o_str("dtype");
    kv[0].val = o_str(dtype);
    kv[1].key = o_str("shape");
    msgpack_object sh = o_array((size_t)ndim, o_int(0));
    for (int i = 0; i < ndim; i++)
        sh.via.array.ptr[i] = o_int(shape[i]);
    kv[1].val = sh;
    kv[2].key = o_str("data");
    kv[2].val = o_bin(data, bytes);
    msgpack_object o = {.type = MSGPACK_OBJECT_MAP};
    o.via.map.ptr = kv;
    o.via.map.size = 3;
    return o;
}

/* The object at path ("samples[1].logprobs"; "" is the root); NULL when
 * absent. With parent/key set, also the map that holds the last key. */
static msgpack_object *obj_at(msgpack_object *root, const char *path, msgpack_object **parent,
                              char *key) {
    msgpack_object *o = root;
    const char *p = path;
    if (parent)
        *parent = root;
    while (*p) {
        if (*p == '.')
            p++;
        if (*p == '[') {
            int idx = atoi(p + 1);
            p = strchr(p, ']') + 1;
            if (o->type != MSGPACK_OBJECT_ARRAY || idx >= (int)o->via.array.size)
                return NULL;
            o = &o->via.array.ptr[idx];
            continue;
        }
        size_t n = strcspn(p, ".[");
        if (o->type != MSGPACK_OBJECT_MAP)
            return NULL;
        if (parent)
            *parent = o;
        if (key) {
            memcpy(key, p, n);
            key[n] = '\0';
        }
        msgpack_object *next = NULL;
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            msgpack_object *k = &o->via.map.ptr[i].key;
            if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
                memcmp(k->via.str.ptr, p, n) == 0)
                next = &o->via.map.ptr[i].val;
        }
        p += n;
        if (!next)
            return NULL;
        o = next;
    }
    return o;
}

enum { E_SET, E_DEL, E_ADD };
typedef struct edit {
    int op;
    const char *path;
    msgpack_object val;
} edit_t;

static void apply(msgpack_object *root, const edit_t *e) {
    msgpack_object *parent = NULL;
    char key[128];
    msgpack_object *o = obj_at(root, e->path, &parent, key);
    if (e->op == E_SET) {
        if (!o)
            tu_report("edit: no object at %s", e->path);
        CU_ASSERT_FATAL(o != NULL);
        *o = e->val;
        return;
    }
    CU_ASSERT_FATAL(parent && parent->type == MSGPACK_OBJECT_MAP);
    uint32_t n = parent->via.map.size;
    msgpack_object_kv *kv = tm_alloc((n + 1) * sizeof *kv);
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *ki = &parent->via.map.ptr[i].key;
        bool match = ki->type == MSGPACK_OBJECT_STR && ki->via.str.size == strlen(key) &&
                     memcmp(ki->via.str.ptr, key, strlen(key)) == 0;
        if (e->op == E_DEL && match)
            continue;
        kv[k++] = parent->via.map.ptr[i];
    }
    if (e->op == E_DEL)
        CU_ASSERT_FATAL(k == n - 1);
    if (e->op == E_ADD) {
        char *kc = tm_alloc(strlen(key) + 1);
        memcpy(kc, key, strlen(key) + 1);
        kv[k].key = o_str(kc);
        kv[k].val = e->val;
        k++;
    }
    parent->via.map.ptr = kv;
    parent->via.map.size = k;
}

/* Encodes m, applies the edits, decodes; returns the status (message in mo_last_error). */
static int edit_decode(const msg_t *m, const edit_t *edits, int n, msg_t *out) {
    msg_buf_t b;
    CU_ASSERT_FATAL(encode_ok(m, &b) == MO_OK);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    CU_ASSERT_FATAL(msgpack_unpack_next(&up, (const char *)b.data, b.len, &off) ==
                    MSGPACK_UNPACK_SUCCESS);
    for (int i = 0; i < n; i++)
        apply(&up.data, &edits[i]);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_object(&pk, up.data);
    int rc = msg_decode(out, sb.data, sb.size, MSG_NONE);
    msgpack_sbuffer_destroy(&sb);
    msgpack_unpacked_destroy(&up);
    msg_buf_free(&b);
    return rc;
}

typedef struct bad_case {
    msg_type_t type;
    int full;
    edit_t edits[2];
    int n;
    const char *needle; /* expected in the error message */
} bad_case_t;

static int run_bad(const bad_case_t *c) {
    msg_t m, d;
    build(&m, c->type, c->full);
    mo_clear_error();
    int rc = edit_decode(&m, c->edits, c->n, &d);
    int ok =
        rc == MO_EMALFORMED && strstr(mo_last_error(), c->needle) != NULL && d.type == MSG_NONE;
    if (!ok)
        tu_report("%s %s: rc %d, message '%s', expected '%s'", msg_type_name(c->type),
                  c->edits[0].path, rc, mo_last_error(), c->needle);
    msg_free(&d);
    return ok;
}

#define SET(p, v)                                                                                  \
    { E_SET, (p), (v) }
#define DEL(p)                                                                                     \
    {                                                                                              \
        E_DEL, (p), {                                                                              \
            0                                                                                      \
        }                                                                                          \
    }
#define ADD(p, v)                                                                                  \
    { E_ADD, (p), (v) }
#define BAD1(t, full, e, needle)                                                                   \
    { (t), (full), {e}, 1, (needle) }
#define BAD2(t, full, e1, e2, needle)                                                              \
    { (t), (full), {e1, e2}, 2, (needle) }

static void test_bad_fields(void) {
    static const int32_t toks4[4] = {1, 2, 3, 4};
    static const int32_t neg[5] = {-3, 2, 3, 4, 5};
    static const float lp_pos[5] = {0.5f, -1, -1, -1, -1};
    static const float two[2] = {1, 2};
    static const float nan1[3] = {NAN, 0, 0};
    static const uint16_t route[4 * L_MOE * K_TOP] = {1};
    static const uint8_t bytes15[15] = {1};
    int64_t s4[1] = {4}, s5[1] = {5}, s2[1] = {2}, s3[1] = {3}, s22[2] = {2, 2};
    int64_t sr[3] = {4, L_MOE, K_TOP};
    bad_case_t cases[] = {
        /* envelope */
        BAD1(MSG_HELLO, 1, SET("v", o_int(2)), "hello.v: protocol version 2, this build speaks 1"),
        BAD1(MSG_HELLO, 1, SET("v", o_str("1")), "hello.v: expected an unsigned integer"),
        BAD1(MSG_HELLO, 1, DEL("v"), "hello.v: missing"),
        BAD1(MSG_HELLO, 1, SET("type", o_str("helo")), "message.type: unknown message type 'helo'"),
        BAD1(MSG_HELLO, 1, SET("type", o_int(1)), "message.type: expected a string"),
        BAD1(MSG_HELLO, 1, DEL("type"), "message.type: missing"),
        /* hello */
        BAD1(MSG_HELLO, 1, DEL("role"), "hello.role: missing"),
        BAD1(MSG_HELLO, 1, SET("role", o_str("worker")), "hello.role: unknown value 'worker'"),
        BAD1(MSG_HELLO, 1, SET("pid", o_int(-5)), "hello.pid: -5 is out of range"),
        BAD1(MSG_HELLO, 1, SET("pid", o_uint((uint64_t)1 << 40)), "hello.pid"),
        BAD1(MSG_HELLO, 1, SET("pid", o_str("42")), "hello.pid: expected an integer, got a string"),
        BAD1(MSG_HELLO, 1, SET("pid", o_f64(42)), "hello.pid: expected an integer, got a float"),
        BAD1(MSG_HELLO, 1, SET("worker_id", o_long(65)), "hello.worker_id: 65 bytes, at most 64"),
        BAD1(MSG_HELLO, 1, SET("worker_id", o_str("a b")), "hello.worker_id: byte 1 is not one of"),
        BAD1(MSG_HELLO, 1, SET("worker_id", o_str("")), "hello.worker_id: empty"),
        BAD1(MSG_HELLO, 1, SET("host", o_strn("ab\xff", 3)),
             "hello.host: not valid UTF-8 at byte 2"),
        BAD1(MSG_HELLO, 1, SET("host", o_strn("a\0b", 3)), "hello.host: contains a NUL byte"),
        BAD1(MSG_HELLO, 1, SET("host", o_long(257)), "hello.host: 257 bytes, at most 256"),
        BAD1(MSG_HELLO, 1, SET("host", o_nil()), "hello.host: expected a string, got nil"),
        BAD1(MSG_HELLO, 1, SET("software", o_int(3)), "hello.software: expected a string"),
        /* welcome */
        BAD1(MSG_WELCOME, 1, SET("sampling.top_p", o_f64(1.5)), "welcome.sampling.top_p: 1.5"),
        BAD1(MSG_WELCOME, 1, SET("sampling.top_p", o_f64(0)), "welcome.sampling.top_p"),
        BAD1(MSG_WELCOME, 1, SET("sampling.temperature", o_f64(NAN)),
             "welcome.sampling.temperature: nan is not finite"),
        BAD1(MSG_WELCOME, 1, SET("sampling.top_k", o_int(-1)), "welcome.sampling.top_k"),
        BAD1(MSG_WELCOME, 1, SET("sampling.max_new_tokens", o_int(0)),
             "welcome.sampling.max_new_tokens: 0 is out of range"),
        BAD1(MSG_WELCOME, 1, SET("sampling.stop", o_array(33, o_str("x"))),
             "welcome.sampling.stop: 33 elements, at most 32"),
        BAD1(MSG_WELCOME, 1, SET("sampling.stop[1]", o_str("")), "welcome.sampling.stop[1]: empty"),
        BAD1(MSG_WELCOME, 1, SET("sampling.stop[0]", o_int(1)),
             "welcome.sampling.stop[0]: expected a string"),
        BAD1(MSG_WELCOME, 1, DEL("sampling.seed"), "welcome.sampling.seed: missing"),
        BAD1(MSG_WELCOME, 1, DEL("sampling"), "welcome.sampling: missing"),
        BAD1(MSG_WELCOME, 1, SET("sampling", o_int(5)), "welcome.sampling: expected a map"),
        BAD1(MSG_WELCOME, 1, SET("group_size", o_int(0)), "welcome.group_size: 0 is out of range"),
        BAD1(MSG_WELCOME, 1, SET("group_size", o_int(4097)), "welcome.group_size"),
        BAD1(MSG_WELCOME, 1, SET("heartbeat_ms", o_int(5)), "welcome.heartbeat_ms"),
        BAD1(MSG_WELCOME, 1, SET("reward.function", o_str("")), "welcome.reward.function: empty"),
        BAD1(MSG_WELCOME, 1, DEL("reward.version"), "welcome.reward.version: missing"),
        BAD1(MSG_WELCOME, 1, SET("model_path", o_long(4097)), "welcome.model_path: 4097 bytes"),
        /* heartbeat */
        BAD1(MSG_HEARTBEAT, 1, SET("tokens_per_s", o_f64(-1)), "heartbeat.tokens_per_s: -1"),
        BAD1(MSG_HEARTBEAT, 1, SET("tokens_per_s", o_f64(INFINITY)), "heartbeat.tokens_per_s: inf"),
        BAD1(MSG_HEARTBEAT, 1, SET("inflight", o_int(-1)), "heartbeat.inflight: negative value -1"),
        BAD1(MSG_HEARTBEAT, 1, SET("queue_depth", o_uint((uint64_t)1 << 33)),
             "heartbeat.queue_depth: 8589934592 is out of range"),
        BAD1(MSG_HEARTBEAT, 1, SET("adapter_version", o_int(-2)),
             "heartbeat.adapter_version: negative"),
        BAD1(MSG_HEARTBEAT, 1, SET("role", o_bool(true)), "heartbeat.role: expected a string"),
        /* work_request */
        BAD1(MSG_WORK_REQUEST, 1, SET("credits", o_int(0)), "work_request.credits: 0"),
        BAD1(MSG_WORK_REQUEST, 1, SET("credits", o_int(4097)), "work_request.credits: 4097"),
        BAD1(MSG_WORK_REQUEST, 1, DEL("worker_id"), "work_request.worker_id: missing"),
        /* lease */
        BAD1(MSG_LEASE, 1, SET("items", o_array(0, o_nil())), "lease.items: 0 is out of range"),
        BAD1(MSG_LEASE, 1, SET("items", o_array(4097, o_nil())),
             "lease.items: 4097 elements, at most 4096"),
        BAD1(MSG_LEASE, 1, SET("items[1]", o_int(3)), "lease.items[1]: expected a map"),
        BAD1(MSG_LEASE, 1, SET("items[0].n", o_int(0)), "lease.items[0].n: 0 is out of range"),
        BAD1(MSG_LEASE, 1, SET("deadline_ms", o_int(0)), "lease.deadline_ms: 0"),
        BAD1(MSG_LEASE, 1, SET("deadline_ms", o_int(86400001)), "lease.deadline_ms"),
        BAD1(MSG_LEASE, 1, SET("lease_id", o_f64(1.0)),
             "lease.lease_id: expected an unsigned integer"),
        BAD2(MSG_LEASE, 1, DEL("items[0].prompt"), DEL("items[0].prompt_tokens"),
             "lease.items[0]: neither prompt nor prompt_tokens"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens", o_tensor("F32", s4, 1, toks4, 16)),
             "lease.items[0].prompt_tokens.dtype: expected I32, got F32"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens", o_tensor("I32", s5, 1, toks4, 16)),
             "lease.items[0].prompt_tokens.data: 16 bytes, but shape [5] of I32 needs 20"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens", o_tensor("I32", s22, 2, toks4, 16)),
             "lease.items[0].prompt_tokens.shape: 2 dimensions, expected 1"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens", o_tensor("Q4", s4, 1, toks4, 16)),
             "lease.items[0].prompt_tokens.dtype: unknown dtype 'Q4'"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens.data", o_str("abcd")),
             "lease.items[0].prompt_tokens.data: expected binary, got a string"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens.shape[0]", o_int(-1)),
             "lease.items[0].prompt_tokens.shape[0]: negative value -1"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_tokens", o_tensor("I32", s4, 1, neg, 16)),
             "lease.items[0].prompt_tokens: token 0 is -3"),
        BAD1(MSG_LEASE, 1, SET("items[0].extra.task", o_int(1)),
             "lease.items[0].extra.task: expected a string, got an integer"),
        BAD1(MSG_LEASE, 1, ADD("items[0].extra.task", o_str("again")),
             "lease.items[0].extra: repeated name 'task'"),
        BAD1(MSG_LEASE, 1, SET("items[0].extra", o_str("x")),
             "lease.items[0].extra: expected a map"),
        BAD1(MSG_LEASE, 1, SET("items[0].prompt_id", o_long(257)),
             "lease.items[0].prompt_id: 257 bytes"),
        /* trajectory_group */
        BAD1(MSG_TRAJECTORY_GROUP, 1,
             SET("samples[1].logprobs", o_tensor("F32", s5, 1, g_lp[1], 20)),
             "trajectory_group.samples[1].logprobs: 5 values for 6 tokens"),
        BAD1(MSG_TRAJECTORY_GROUP, 1,
             SET("samples[0].logprobs", o_tensor("F32", s5, 1, lp_pos, 20)),
             "trajectory_group.samples[0].logprobs: value 0 is 0.5"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("samples[0].tokens", o_tensor("I32", s5, 1, neg, 20)),
             "trajectory_group.samples[0].tokens: token 0 is -3"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("samples[0].finish_reason", o_str("done")),
             "trajectory_group.samples[0].finish_reason: unknown value 'done'"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("samples[0].adapter_version_first", o_int(18)),
             "trajectory_group.samples[0].adapter_version_last: 17 is before"),
        BAD1(MSG_TRAJECTORY_GROUP, 1,
             SET("samples[0].routing", o_tensor("U16", sr, 3, route, sizeof route)),
             "trajectory_group.samples[0].routing: 4 rows for 5 tokens"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("samples[0].routing.dtype", o_str("I32")),
             "trajectory_group.samples[0].routing.dtype: expected U16, got I32"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, DEL("samples[2].text"),
             "trajectory_group.samples[2].text: missing"),
        BAD1(MSG_TRAJECTORY_GROUP, 0, SET("samples", o_array(0, o_nil())),
             "trajectory_group.samples: 0 samples"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("samples", o_array(4097, o_nil())),
             "trajectory_group.samples: 4097 elements"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("rewards", o_tensor("F32", s2, 1, two, 8)),
             "trajectory_group.rewards: 2 values for 3 samples"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("rewards", o_tensor("F32", s3, 1, nan1, 12)),
             "trajectory_group.rewards: value 0 is nan"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, DEL("reward_version"),
             "trajectory_group.reward_version: missing (required with rewards)"),
        BAD1(MSG_TRAJECTORY_GROUP, 0, ADD("reward_version", o_int(3)),
             "trajectory_group.reward_version: present without rewards"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("reward_details[0].format", o_str("x")),
             "trajectory_group.reward_details[0].format: expected a number"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("reward_details", o_array(2, o_map0())),
             "trajectory_group.reward_details: 2 entries for 3 samples"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("gen_ms", o_f64(-1)), "trajectory_group.gen_ms: -1"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("prompt_id", o_long(257)),
             "trajectory_group.prompt_id: 257 bytes"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("prompt_tokens", o_tensor("I32", s4, 1, toks4, 0)),
             "trajectory_group.prompt_tokens.data: 0 bytes, but shape [4] of I32 needs 16"),
        BAD1(MSG_TRAJECTORY_GROUP, 1, SET("group_id", o_int(-1)),
             "trajectory_group.group_id: negative"),
        /* score_request / score_reply */
        BAD1(MSG_SCORE_REQUEST, 1, SET("samples[0].n_tokens", o_uint(1u << 23)),
             "score_request.samples[0].n_tokens: 8388608 is out of range"),
        BAD1(MSG_SCORE_REQUEST, 1, DEL("samples"), "score_request.samples: missing"),
        BAD1(MSG_SCORE_REQUEST, 1, SET("extra", o_array(1, o_nil())),
             "score_request.extra: expected a map"),
        BAD1(MSG_SCORE_REPLY, 1, SET("rewards", o_tensor("F32", s2, 1, two, 0)),
             "score_reply.rewards.data: 0 bytes"),
        BAD1(MSG_SCORE_REPLY, 1, SET("details", o_array(1, o_map0())),
             "score_reply.details: 1 entries for 3 samples"),
        BAD1(MSG_SCORE_REPLY, 1, SET("score_ms", o_str("3")),
             "score_reply.score_ms: expected a number"),
        /* weights_chunk */
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("n_chunks", o_int(4)),
             "weights_chunk.n_chunks: 4, but total_bytes 37 in chunks of 16 makes 3"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("chunk_index", o_int(3)), "weights_chunk.chunk_index: 3"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("data", o_bin(bytes15, 15)), "weights_chunk.data: 15 bytes"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[1].offset", o_int(25)),
             "weights_chunk.table[1].offset: 25 is not a multiple"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[2].offset", o_int(33)),
             "weights_chunk.table[2].offset: 33 + 5 bytes passes total_bytes 37"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[1].offset", o_int(20)), "overlaps"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[1].name", o_str("layers.0.q_proj.lora_A")),
             "weights_chunk.table: repeated name"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[0].dtype", o_str("Q8")),
             "weights_chunk.table[0].dtype: unknown value 'Q8'"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("table[0].shape", o_array(9, o_int(1))),
             "weights_chunk.table[0].shape: 9 elements"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, DEL("table"), "weights_chunk.table: 0 tensors"),
        BAD1(MSG_WEIGHTS_CHUNK, 0, ADD("table", o_array(1, o_nil())),
             "weights_chunk.table[0]: expected a map"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("total_bytes", o_int(0)), "weights_chunk.total_bytes: 0"),
        BAD1(MSG_WEIGHTS_CHUNK, 1, SET("chunk_bytes", o_uint((uint64_t)1 << 33)),
             "weights_chunk.chunk_bytes"),
        /* snapshot, ctl, reward_swap, error */
        BAD1(MSG_SNAPSHOT_REQUEST, 1, SET("have_version", o_int(-1)),
             "snapshot_request.have_version: negative"),
        BAD1(MSG_CTL_REQUEST, 1, SET("command", o_str("explode")),
             "ctl_request.command: unknown value 'explode'"),
        BAD1(MSG_CTL_REQUEST, 1, SET("args", o_int(5)), "ctl_request.args: expected a map"),
        BAD1(MSG_CTL_REQUEST, 1, SET("args.function", o_long(4097)),
             "ctl_request.args.function: 4097 bytes"),
        BAD1(MSG_CTL_REPLY, 1, SET("ok", o_int(1)), "ctl_reply.ok: expected a boolean"),
        BAD1(MSG_CTL_REPLY, 1, SET("status.step", o_array(0, o_nil())),
             "ctl_reply.status.step: expected a number, string or boolean"),
        BAD1(MSG_REWARD_SWAP, 1, DEL("function"), "reward_swap.function: missing"),
        BAD1(MSG_REWARD_SWAP, 1, SET("plugin", o_long(4097)), "reward_swap.plugin: 4097 bytes"),
        BAD1(MSG_ERROR, 1, SET("code", o_int(5)), "error.code: 5 is out of range [-1000, -1]"),
        BAD1(MSG_ERROR, 1, SET("message", o_str("")), "error.message: empty"),
    };
    int n = (int)(sizeof cases / sizeof cases[0]), good = 0;
    for (int i = 0; i < n; i++)
        good += run_bad(&cases[i]);
    tm_free_all(); /* the cases' objects live until every case ran */
    CU_ASSERT(good == n);
}

/* Unknown fields are ignored at every level; nil reads as absent for optional fields. */
static void test_forward_compat(void) {
    msg_t m, d;
    build(&m, MSG_TRAJECTORY_GROUP, 1);
    edit_t e0[3] = {{E_ADD, "zz_future", o_map0()},
                    {E_ADD, "samples[0].zz_next", o_array(3, o_str("later"))},
                    {E_ADD, "samples[0].routing.zz_layout", o_str("row-major")}};
    int rc = edit_decode(&m, e0, 3, &d);
    if (rc != MO_OK)
        tu_report("unknown fields: %s", mo_last_error());
    CU_ASSERT(rc == MO_OK);
    msg_free(&d);
    edit_t e1[2] = {{E_ADD, "extra_map", o_int(1)}, {E_SET, "prompt", o_nil()}};
    rc = edit_decode(&m, e1, 2, &d);
    CU_ASSERT_FATAL(rc == MO_OK);
    CU_ASSERT(d.trajectory_group.prompt == NULL && d.trajectory_group.answer != NULL);
    msg_free(&d);
    tm_free_all();
}

/* Bytes that are not a valid message at the MessagePack level. */
static void test_bad_bytes(void) {
    static const struct {
        const char *bytes;
        size_t len;
        const char *needle;
    } cases[] = {
        {"", 0, "message: empty"},
        {"\x93\x01\x02\x03", 4, "message: expected a map, got an array"},
        {"\x81\x01\x02", 3, "key 0 is an integer; keys must be strings"},
        {"\x82\xa4type\xa5hello\xa4type\xa5hello", 23, "message.type: repeated key"},
        {"\x81\xa1v\x01\xc0", 5, "1 bytes after the end"},
        {"\xc1", 1, "byte 0xc1 at 0 is not MessagePack"},
        {"\xdd\xff\xff\xff\xff\x01", 6, "array at byte 0 claims 4294967295 entries in 1 bytes"},
        {"\xdf\x7f\xff\xff\xff\x01\x01", 7, "map at byte 0 claims"},
        {"\xc6\xff\xff\xff\xff", 5, "truncated"},
        {"\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\x91\xc0", 20,
         "nested deeper than 16"},
        {"\x82\xa4type\xa5hello\xa1v\x02", 15, "hello.v: protocol version 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        msg_t d;
        int rc = msg_decode(&d, cases[i].bytes, cases[i].len, MSG_NONE);
        int ok = rc == MO_EMALFORMED && strstr(mo_last_error(), cases[i].needle);
        if (!ok)
            tu_report("bytes case %zu: rc %d '%s', expected '%s'", i, rc, mo_last_error(),
                      cases[i].needle);
        CU_ASSERT(ok);
        /* peeking reads only "type": those two cases have a good one */
        msg_type_t t = MSG_NONE;
        int peek = msg_peek_type(cases[i].bytes, cases[i].len, &t);
        bool peek_ok = i == 3 || i == 10;
        CU_ASSERT(peek_ok ? (peek == MO_OK && t == MSG_HELLO) : peek == MO_EMALFORMED);
    }
    /* peeking reads "type" in any string format */
    static const char str8[] = "\x82\xd9\x04type\xd9\x05hello\xa1v\x01";
    msg_type_t pt = MSG_NONE;
    CU_ASSERT(msg_peek_type(str8, sizeof str8 - 1, &pt) == MO_OK && pt == MSG_HELLO);
    /* The expected type is enforced. */
    msg_t m, d;
    msg_buf_t b;
    build(&m, MSG_HELLO, 1);
    CU_ASSERT_FATAL(encode_ok(&m, &b) == MO_OK);
    CU_ASSERT(msg_decode(&d, b.data, b.len, MSG_LEASE) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "hello: unexpected message type (expected lease)") != NULL);
    msg_buf_free(&b);
}

/* msg_encode refuses what a decoder would refuse, naming the field. */
static void test_encode_checks(void) {
    msg_t m;
    msg_buf_t b;
    msg_buf_init(&b);
    struct {
        msg_type_t t;
        const char *needle;
    } cases[] = {
        {MSG_HELLO, "hello.worker_id: byte 3"},
        {MSG_WELCOME, "welcome.sampling.top_p"},
        {MSG_LEASE, "lease.items[0].n"},
        {MSG_TRAJECTORY_GROUP, "trajectory_group.samples[0].logprobs: value 2"},
        {MSG_WEIGHTS_CHUNK, "weights_chunk.data: 15 bytes"},
        {MSG_CTL_REPLY, "ctl_reply.status: repeated name 'step'"},
        {MSG_SCORE_REPLY, "score_reply.rewards: value 1 is inf"},
        {MSG_ERROR, "error.code: 0 is out of range"},
    };
    float lp[5], rw[N_SAMPLES];
    msg_stat_t st[2] = {{"step", MSG_VAL_INT, 1, 0, NULL}, {"step", MSG_VAL_INT, 2, 0, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        build(&m, cases[i].t, 1);
        switch (cases[i].t) {
        case MSG_HELLO: m.hello.worker_id = "bad id"; break;
        case MSG_WELCOME: m.welcome.sampling.top_p = 2; break;
        case MSG_LEASE: g_items[0].n = 0; break;
        case MSG_TRAJECTORY_GROUP:
            memcpy(lp, g_lp[0], sizeof lp);
            lp[2] = NAN;
            g_samples[0].logprobs = lp;
            break;
        case MSG_WEIGHTS_CHUNK: m.weights_chunk.nbytes = 15; break;
        case MSG_CTL_REPLY: m.ctl_reply.status = st, m.ctl_reply.n_status = 2; break;
        case MSG_SCORE_REPLY:
            memcpy(rw, g_rewards, sizeof rw);
            rw[1] = INFINITY;
            m.score_reply.rewards = rw;
            break;
        case MSG_ERROR: m.error.code = 0; break;
        default: break;
        }
        int rc = msg_encode(&m, &b);
        int ok = rc == MO_EINVAL && strstr(mo_last_error(), cases[i].needle);
        if (!ok)
            tu_report("encode check %zu: rc %d '%s', expected '%s'", i, rc, mo_last_error(),
                      cases[i].needle);
        CU_ASSERT(ok);
    }
    m.type = MSG_NONE;
    CU_ASSERT(msg_encode(&m, &b) == MO_EINVAL);
    msg_buf_free(&b);
}

/* Every proper prefix of every encoding is refused, never crashes. */
static void test_truncation(void) {
    int bad = 0, total = 0;
    for (int t = MSG_NONE + 1; t < MSG_TYPE_COUNT; t++) {
        for (int full = 0; full < 2; full++) {
            msg_t m, d;
            msg_buf_t b;
            build(&m, (msg_type_t)t, full);
            CU_ASSERT_FATAL(encode_ok(&m, &b) == MO_OK);
            for (size_t n = 0; n < b.len; n++) {
                /* a copy of exactly n bytes so ASan sees any over-read */
                uint8_t *p = malloc(n ? n : 1);
                memcpy(p, b.data, n);
                int rc = msg_decode(&d, p, n, MSG_NONE);
                bad += rc != MO_EMALFORMED || d.type != MSG_NONE;
                total++;
                free(p);
            }
            msg_buf_free(&b);
        }
    }
    CU_ASSERT(total > 1000);
    CU_ASSERT(bad == 0);
}

/* Random byte mutations: the decoder either refuses with MO_EMALFORMED or
 * returns a message that encodes again and decodes to the same bytes. */
static void test_mutation(void) {
    uint64_t seed = 0x5eed;
    int accepted = 0, refused = 0, other = 0, unstable = 0;
    for (int t = MSG_NONE + 1; t < MSG_TYPE_COUNT; t++) {
        for (int full = 0; full < 2; full++) {
            msg_t m, d;
            msg_buf_t b;
            build(&m, (msg_type_t)t, full);
            CU_ASSERT_FATAL(encode_ok(&m, &b) == MO_OK);
            for (int it = 0; it < 1500; it++) {
                uint32_t r[4];
                rng_block(r, seed, (uint64_t)t * 2 + (uint64_t)full, (uint64_t)it);
                size_t n = b.len;
                uint8_t *p = malloc(n + 8);
                memcpy(p, b.data, n);
                int nmut = 1 + (int)(r[0] % 3);
                for (int k = 0; k < nmut; k++) {
                    uint32_t q[4];
                    rng_block(q, seed + 1 + (uint64_t)k, (uint64_t)t * 2 + (uint64_t)full,
                              (uint64_t)it);
                    size_t at = q[0] % n;
                    switch (q[1] % 5) {
                    case 0: p[at] ^= (uint8_t)(1u << (q[2] % 8)); break;
                    case 1: p[at] = (uint8_t)q[2]; break;
                    case 2:
                        p[at] = (uint8_t[]){0x00, 0x7f, 0x80, 0xc0, 0xc1, 0xcc,
                                            0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0xff}[q[2] % 12];
                        break;
                    case 3: n = at + 1; break; /* truncate */
                    default:                   /* duplicate a byte */
                        memmove(p + at + 1, p + at, n - at);
                        n++;
                        break;
                    }
                    if (n > b.len + 4)
                        break;
                }
                int rc = msg_decode(&d, p, n, MSG_NONE);
                if (rc == MO_OK) {
                    accepted++;
                    msg_buf_t e1, e2;
                    msg_t d2;
                    msg_buf_init(&e1);
                    msg_buf_init(&e2);
                    int ok = msg_encode(&d, &e1) == MO_OK &&
                             msg_decode(&d2, e1.data, e1.len, MSG_NONE) == MO_OK;
                    ok = ok && msg_encode(&d2, &e2) == MO_OK && e1.len == e2.len &&
                         memcmp(e1.data, e2.data, e1.len) == 0;
                    if (!ok) {
                        tu_report("unstable %s: %s", msg_type_name(d.type), mo_last_error());
                        unstable++;
                    }
                    msg_free(&d2);
                    msg_buf_free(&e1);
                    msg_buf_free(&e2);
                    msg_free(&d);
                } else if (rc == MO_EMALFORMED) {
                    refused++;
                } else {
                    other++;
                }
                free(p);
            }
            msg_buf_free(&b);
        }
    }
    CU_ASSERT(refused > 1000);
    CU_ASSERT(accepted > 0);
    CU_ASSERT(other == 0);
    CU_ASSERT(unstable == 0);
}

/* ---- The wire format as Python's msgpack reads and writes it ---- */

static const char *g_py =
    "import msgpack, struct, sys\n"
    "d = msgpack.unpackb(open(sys.argv[1], 'rb').read(), raw=False)\n"
    "assert d['type'] == 'trajectory_group' and d['v'] == 1, d['type']\n"
    "assert d['group_id'] == 0x1234567890 and d['worker_id'] == 'rollout-3'\n"
    "pt = d['prompt_tokens']\n"
    "assert pt['dtype'] == 'I32' and pt['shape'] == [7]\n"
    "assert list(struct.unpack('<7i', pt['data'])) == [100 + 13 * i for i in range(7)]\n"
    "s = d['samples'][1]\n"
    "assert s['finish_reason'] == 'length' and s['text'] == ''\n"
    "assert s['logprobs']['dtype'] == 'F32' and s['logprobs']['shape'] == [6]\n"
    "assert abs(struct.unpack('<6f', s['logprobs']['data'])[2] - (-0.1 - 0.74 - 1)) < 1e-6\n"
    "assert s['routing']['dtype'] == 'U16' and s['routing']['shape'] == [12, 2, 2]\n"
    "assert d['extra'] == {'task': 'arith', 'difficulty': '3'}\n"
    "assert list(struct.unpack('<3f', d['rewards']['data'])) == [1.0, -0.5, 0.25]\n"
    "assert d['reward_details'][0] == {'correct': 1.0, 'format': 0.5}\n"
    "rw = {'dtype': 'F32', 'shape': [3], 'data': struct.pack('<3f', 0.5, 1.0, -2.0)}\n"
    "reply = {'type': 'score_reply', 'v': 1, 'group_id': 99, 'reward_version': 2,\n"
    "         'rewards': rw, 'details': [{'ok': 1}, {'ok': 0.5}, {}],\n"
    "         'score_ms': 4, 'from_the_future': [1, {'x': None}]}\n"
    "open(sys.argv[2], 'wb').write(msgpack.packb(reply, use_bin_type=True))\n"
    "hello = {'v': 1, 'type': 'hello', 'role': 'reward', 'worker_id': 'py-reward',\n"
    "         'pid': 31337, 'host': 'h\\u00e9te', 'software': None}\n"
    "open(sys.argv[3], 'wb').write(msgpack.packb(hello, use_bin_type=True))\n";

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    uint8_t *p = malloc(1 << 16);
    *n = fread(p, 1, 1 << 16, f);
    fclose(f);
    return p;
}

static void test_python_peer(void) {
    char dir[512], in[600], out1[600], out2[600], script[600], cmd[3000];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(in, sizeof in, "%s/group.mp", dir);
    snprintf(out1, sizeof out1, "%s/reply.mp", dir);
    snprintf(out2, sizeof out2, "%s/hello.mp", dir);
    snprintf(script, sizeof script, "%s/peer.py", dir);
    msg_t m, d;
    msg_buf_t b;
    build(&m, MSG_TRAJECTORY_GROUP, 1);
    CU_ASSERT_FATAL(encode_ok(&m, &b) == MO_OK);
    FILE *f = fopen(in, "wb");
    CU_ASSERT_FATAL(f != NULL);
    fwrite(b.data, 1, b.len, f);
    fclose(f);
    msg_buf_free(&b);
    f = fopen(script, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs(g_py, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' '%s' '%s'", tu_python(), script, in, out1, out2);
    int rc = system(cmd);
    if (rc != 0)
        tu_report("python peer failed (%d): %s", rc, cmd);
    CU_ASSERT_FATAL(rc == 0);

    size_t n = 0;
    uint8_t *p = slurp(out1, &n);
    CU_ASSERT_FATAL(p != NULL);
    rc = msg_decode(&d, p, n, MSG_SCORE_REPLY);
    if (rc != MO_OK)
        tu_report("python score_reply: %s", mo_last_error());
    CU_ASSERT_FATAL(rc == MO_OK);
    CU_ASSERT(d.score_reply.group_id == 99 && d.score_reply.reward_version == 2);
    CU_ASSERT(d.score_reply.n_samples == 3 && d.score_reply.rewards[2] == -2.0f);
    CU_ASSERT(d.score_reply.details[1].n == 1 && d.score_reply.details[1].items[0].value == 0.5);
    CU_ASSERT(d.score_reply.details[2].n == 0);
    CU_ASSERT(d.score_reply.has_score_ms && d.score_reply.score_ms == 4.0);
    msg_free(&d);
    free(p);

    p = slurp(out2, &n);
    CU_ASSERT_FATAL(p != NULL);
    rc = msg_decode(&d, p, n, MSG_NONE);
    CU_ASSERT_FATAL(rc == MO_OK && d.type == MSG_HELLO);
    CU_ASSERT(d.hello.role == MSG_ROLE_REWARD && d.hello.pid == 31337);
    CU_ASSERT(strcmp(d.hello.host, "h\xc3\xa9te") == 0 && d.hello.software == NULL);
    msg_free(&d);
    free(p);
    tu_rmtree(dir);
}

int main(void) {
    init_data();
    CU_TestInfo tests[] = {
        {"round trip of every message, optional fields present and absent", test_roundtrip},
        {"optional fields absent and present", test_optional_presence},
        {"routing_last needs routing", test_routing_last},
        {"every validation failure names its field", test_bad_fields},
        {"unknown fields ignored, nil is absent", test_forward_compat},
        {"malformed MessagePack bytes", test_bad_bytes},
        {"encoder refuses invalid messages", test_encode_checks},
        {"every truncation of every message", test_truncation},
        {"random byte mutations", test_mutation},
        {"Python msgpack peer reads and writes the format", test_python_peer},
        CU_TEST_INFO_NULL,
    };
    return tu_main("codec", tests);
}
