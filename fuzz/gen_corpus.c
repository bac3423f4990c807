/* gen_corpus: writes the seed corpus of every fuzz target: valid encodings of
 * every message type, small, with and without optional fields.
 * usage: fuzz_gen_corpus OUTDIR (writes OUTDIR/<target>/<seed>). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/status.h"
#include "fuzz/fuzz_common.h"
#include "transport/codec.h"
#include "transport/weights.h"

static const char *g_out;

static int selector(const msg_type_t *types, size_t n, msg_type_t t) {
    for (size_t i = 0; i < n; i++)
        if (types[i] == t)
            return (int)i;
    return 0;
}

static void write_file(const char *target, const char *name, const uint8_t *p, size_t n) {
    char dir[1024], path[1200];
    snprintf(dir, sizeof dir, "%s/%s", g_out, target);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        perror(dir);
        exit(1);
    }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* Writes [selector][encoding of m]. */
static void seed(const char *target, const msg_type_t *types, size_t ntypes, const char *name,
                 const msg_t *m) {
    msg_buf_t b;
    msg_buf_init(&b);
    if (msg_encode(m, &b) != MO_OK) {
        fprintf(stderr, "%s: %s\n", name, mo_last_error());
        exit(1);
    }
    uint8_t *p = malloc(b.len + 1);
    p[0] = (uint8_t)selector(types, ntypes, m->type);
    memcpy(p + 1, b.data, b.len);
    write_file(target, name, p, b.len + 1);
    free(p);
    msg_buf_free(&b);
}

#define CONTROL "control", fuzz_control_types, FUZZ_COUNT(fuzz_control_types)
#define WORK "work", fuzz_work_types, FUZZ_COUNT(fuzz_work_types)
#define TRAJ "trajectory", fuzz_trajectory_types, FUZZ_COUNT(fuzz_trajectory_types)

static const msg_kv_t g_extra[] = {{"task", "arith"}, {"level", "2"}};
static const char *const g_stop[] = {"</answer>"};
static const int32_t g_prompt[4] = {11, 12, 13, 14};
static const int32_t g_tok[3] = {21, 22, 23};
static const float g_lp[3] = {-0.5f, -1.25f, -0.125f};
static const uint16_t g_route[3 * 2 * 2] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6};
static const float g_rewards[2] = {1.0f, 0.0f};
static const msg_metric_t g_det[] = {{"correct", 1.0}};
static const msg_metrics_t g_details[2] = {{g_det, 1}, {NULL, 0}};

static void control_seeds(void) {
    msg_t m;
    msg_init(&m);
    m.type = MSG_HELLO;
    m.hello = (msg_hello_t){MSG_ROLE_ROLLOUT, "rollout-0", 100, "localhost", "moerl 0.1.0"};
    seed(CONTROL, "hello", &m);
    m.hello.software = NULL;
    m.hello.role = MSG_ROLE_CTL;
    seed(CONTROL, "hello-min", &m);

    msg_init(&m);
    m.type = MSG_WELCOME;
    m.welcome = (msg_welcome_t){"job",
                                3,
                                "/m",
                                4,
                                {0.7, 0.9, 20, 0.0, 64, g_stop, 1, 7},
                                1000,
                                true,
                                {2, "exact_match", "/r.so"}};
    seed(CONTROL, "welcome", &m);
    m.welcome.has_reward = false;
    m.welcome.sampling.n_stop = 0;
    seed(CONTROL, "welcome-min", &m);

    msg_init(&m);
    m.type = MSG_HEARTBEAT;
    m.heartbeat = (msg_heartbeat_t){"reward-1", MSG_ROLE_REWARD, true, 3, true, 2, 1, 55.5, 4};
    seed(CONTROL, "heartbeat", &m);

    msg_init(&m);
    m.type = MSG_SNAPSHOT_REQUEST;
    m.snapshot_request = (msg_snapshot_request_t){"rollout-0", true, 2};
    seed(CONTROL, "snapshot_request", &m);

    msg_init(&m);
    m.type = MSG_CTL_REQUEST;
    m.ctl_request = (msg_ctl_request_t){MSG_CTL_SWAP_REWARD, {g_extra, 2}};
    seed(CONTROL, "ctl_request", &m);

    msg_stat_t st[4] = {{"step", MSG_VAL_INT, 12, 0, NULL},
                        {"loss", MSG_VAL_FLOAT, 0, 0.5, NULL},
                        {"state", MSG_VAL_STR, 0, 0, "training"},
                        {"paused", MSG_VAL_BOOL, 0, 0, NULL}};
    msg_init(&m);
    m.type = MSG_CTL_REPLY;
    m.ctl_reply = (msg_ctl_reply_t){true, "ok", st, 4};
    seed(CONTROL, "ctl_reply", &m);

    msg_init(&m);
    m.type = MSG_REWARD_SWAP;
    m.reward_swap.spec = (msg_reward_spec_t){5, "math_verify", "/r.so"};
    seed(CONTROL, "reward_swap", &m);

    msg_init(&m);
    m.type = MSG_ERROR;
    m.error = (msg_error_t){MO_EMALFORMED, "lease.items: missing", "lease", true, 9};
    seed(CONTROL, "error", &m);
}

static void work_seeds(void) {
    msg_t m;
    msg_init(&m);
    m.type = MSG_WORK_REQUEST;
    m.work_request = (msg_work_request_t){"rollout-2", 4};
    seed(WORK, "work_request", &m);

    msg_lease_item_t items[2] = {
        {101, "p/1", "1+2?", g_prompt, 4, "3", {g_extra, 2}, 2},
        {102, "p/2", NULL, g_prompt, 2, NULL, {NULL, 0}, 2},
    };
    msg_init(&m);
    m.type = MSG_LEASE;
    m.lease = (msg_lease_t){7, 60000, 3, items, 2};
    seed(WORK, "lease", &m);
    items[0].prompt_tokens = NULL;
    items[0].n_prompt_tokens = 0;
    m.lease.n_items = 1;
    seed(WORK, "lease-min", &m);
}

static void trajectory_seeds(void) {
    msg_sample_t s[2] = {
        {g_tok, g_lp, 3, g_route, 3, 2, 2, MSG_FINISH_STOP, 3, 3, "3", NULL},
        {g_tok, g_lp, 0, NULL, 0, 0, 0, MSG_FINISH_ABORT, 3, 4, "", NULL},
    };
    msg_t m;
    msg_init(&m);
    m.type = MSG_TRAJECTORY_GROUP;
    msg_trajectory_group_t *g = &m.trajectory_group;
    *g = (msg_trajectory_group_t){101,    7,         "p/1",        "rollout-0", g_prompt, 4,
                                  "1+2?", "3",       {g_extra, 2}, s,           2,        g_rewards,
                                  2,      g_details, true,         12.5,        true,     0.5};
    seed(TRAJ, "trajectory_group", &m);
    g->rewards = NULL;
    g->reward_details = NULL;
    g->has_gen_ms = g->has_score_ms = false;
    g->prompt = g->answer = NULL;
    g->extra.n = 0;
    s[0].routing = NULL;
    seed(TRAJ, "trajectory_group-min", &m);

    msg_score_sample_t ss[2] = {{"3", 3, MSG_FINISH_STOP}, {"", 0, MSG_FINISH_LENGTH}};
    msg_init(&m);
    m.type = MSG_SCORE_REQUEST;
    m.score_request = (msg_score_request_t){101, "p/1", "1+2?", "3", {g_extra, 2}, ss, 2};
    seed(TRAJ, "score_request", &m);

    msg_init(&m);
    m.type = MSG_SCORE_REPLY;
    m.score_reply = (msg_score_reply_t){101, 2, g_rewards, 2, g_details, true, 0.25};
    seed(TRAJ, "score_reply", &m);
    m.score_reply.details = NULL;
    m.score_reply.has_score_ms = false;
    seed(TRAJ, "score_reply-min", &m);
}

/* Appends [u16 length][encoding] of chunk i to buf. */
static size_t add_record(uint8_t *buf, size_t at, const weights_split_t *s, uint32_t i) {
    msg_t m;
    msg_buf_t b;
    msg_buf_init(&b);
    weights_split_chunk(s, i, &m);
    if (msg_encode(&m, &b) != MO_OK) {
        fprintf(stderr, "chunk %u: %s\n", i, mo_last_error());
        exit(1);
    }
    buf[at] = (uint8_t)b.len;
    buf[at + 1] = (uint8_t)(b.len >> 8);
    memcpy(buf + at + 2, b.data, b.len);
    at += 2 + b.len;
    msg_buf_free(&b);
    return at;
}

static void weights_seeds(void) {
    uint8_t flat[40];
    for (int i = 0; i < 40; i++)
        flat[i] = (uint8_t)(i * 37 + 5);
    msg_tensor_entry_t t[3] = {
        {"a.lora_A", DT_F32, 2, {2, 2}, 0},
        {"a.lora_B", DT_BF16, 1, {6}, 16},
        {"bias", DT_U8, 1, {7}, 30},
    };
    const msg_kv_t meta[] = {{"rank", "2"}};
    weights_split_t s, s2;
    if (weights_split_init(&s, flat, sizeof flat, t, 3, &(msg_strmap_t){meta, 1}, 4, 16) != MO_OK ||
        weights_split_init(&s2, flat, sizeof flat, t, 3, NULL, 5, 40) != MO_OK) {
        fprintf(stderr, "split: %s\n", mo_last_error());
        exit(1);
    }
    uint8_t buf[4096];
    size_t n = 1;
    buf[0] = 0;
    for (uint32_t i = 0; i < s.n_chunks; i++)
        n = add_record(buf, n, &s, i);
    write_file("weights", "in-order", buf, n);
    n = 1;
    for (uint32_t i = s.n_chunks; i-- > 0;)
        n = add_record(buf, n, &s, i);
    n = add_record(buf, n, &s, 1); /* a duplicate after completion */
    write_file("weights", "reverse-dup", buf, n);
    n = 1;
    n = add_record(buf, n, &s, 2);
    n = add_record(buf, n, &s2, 0); /* a newer version in one chunk */
    n = add_record(buf, n, &s, 0);
    write_file("weights", "versions", buf, n);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    g_out = argv[1];
    if (mkdir(g_out, 0755) != 0 && errno != EEXIST) {
        perror(g_out);
        return 1;
    }
    control_seeds();
    work_seeds();
    trajectory_seeds();
    weights_seeds();
    return 0;
}
