/* Integration: malformed and oversized messages of every type sent at every socket a job
 * binds (the learner's control, work and trajectory sockets, the reward worker's socket)
 * from raw ZeroMQ sockets while `moerl run` trains: truncated encodings, a wrong protocol
 * version, a repeated key, bytes after the map, an unknown type name, garbage, containers
 * claiming more entries than there are bytes, nesting past the limit, bad frame layouts,
 * and messages over transport.max_msg_bytes. Every daemon stays up, the malformed
 * counters rise, and training goes on to the last step with every process exiting 0.
 * (The rollout workers bind nothing: they are reached only through these sockets.) */
#include "core/rng.h"
#include "tests/it_job.h"
#include "transport/codec.h"

/* One valid message of each type (encoded by the codec, so the variants below are wrong
 * in exactly one way). */
static void build(msg_type_t t, msg_t *m) {
    static const int32_t prompt[3] = {1, 2, 3}, toks[2] = {4, 5};
    static const float logp[2] = {-1.0f, -2.0f}, rewards[1] = {1.0f}, half[1] = {0.5f};
    static const msg_sample_t sample = {toks, logp, 2, NULL, 0, 0, 0, MSG_FINISH_STOP, 0, 0, "ab", NULL};
    static const msg_lease_item_t item = {1, "p1", "1+1=", NULL, 0, "2", {NULL, 0}, 4};
    static const msg_score_sample_t ss = {"ab", 2, MSG_FINISH_STOP};
    static const msg_tensor_entry_t entry = {"w", DT_F32, 1, {2}, 0};
    static const uint8_t bytes[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    msg_init(m);
    m->type = t;
    switch (t) {
    case MSG_HELLO: m->hello = (msg_hello_t){MSG_ROLE_ROLLOUT, "evil-0", 4242, "host", NULL}; break;
    case MSG_WELCOME:
        m->welcome.job = "x";
        m->welcome.model_path = "";
        m->welcome.group_size = 4;
        m->welcome.sampling = (msg_sampling_t){1.0, 1.0, 0, 0.0, 8, NULL, 0, 1};
        m->welcome.heartbeat_ms = 1000;
        break;
    case MSG_HEARTBEAT:
        m->heartbeat = (msg_heartbeat_t){"evil-0", MSG_ROLE_ROLLOUT, false, 0, false, 0, 0, 0.0, 0};
        break;
    case MSG_WORK_REQUEST: m->work_request = (msg_work_request_t){"evil-0", 1}; break;
    case MSG_LEASE: m->lease = (msg_lease_t){1, 1000, 0, &item, 1}; break;
    case MSG_TRAJECTORY_GROUP:
        m->trajectory_group.group_id = 999999;
        m->trajectory_group.lease_id = 1;
        m->trajectory_group.prompt_id = "p1";
        m->trajectory_group.worker_id = "evil-0";
        m->trajectory_group.prompt_tokens = prompt;
        m->trajectory_group.n_prompt_tokens = 3;
        m->trajectory_group.samples = &sample;
        m->trajectory_group.n_samples = 1;
        m->trajectory_group.rewards = rewards;
        m->trajectory_group.reward_version = 1;
        break;
    case MSG_SCORE_REQUEST:
        m->score_request = (msg_score_request_t){1, "p1", NULL, NULL, {NULL, 0}, &ss, 1};
        break;
    case MSG_SCORE_REPLY:
        m->score_reply = (msg_score_reply_t){1, 1, half, 1, NULL, false, 0};
        break;
    case MSG_WEIGHTS_CHUNK:
        m->weights_chunk = (msg_weights_chunk_t){1, 7, 0, 1, 8, 8, &entry, 1, {NULL, 0}, bytes, 8};
        break;
    case MSG_SNAPSHOT_REQUEST:
        m->snapshot_request = (msg_snapshot_request_t){"evil-0", false, 0};
        break;
    case MSG_CTL_REQUEST: m->ctl_request = (msg_ctl_request_t){MSG_CTL_STATUS, {NULL, 0}}; break;
    case MSG_CTL_REPLY: m->ctl_reply = (msg_ctl_reply_t){true, "ok", NULL, 0}; break;
    case MSG_REWARD_SWAP: m->reward_swap.spec = (msg_reward_spec_t){1, "constant", NULL}; break;
    case MSG_ERROR: m->error = (msg_error_t){MO_EMALFORMED, "bad", NULL, false, 0}; break;
    default: break;
    }
}

/* A list of byte strings to send. */
typedef struct blobs {
    uint8_t *data[256];
    size_t len[256];
    int n;
} blobs_t;

static void add(blobs_t *b, const void *data, size_t len) {
    CU_ASSERT_FATAL(b->n < 256);
    b->data[b->n] = malloc(len ? len : 1);
    CU_ASSERT_FATAL(b->data[b->n] != NULL);
    memcpy(b->data[b->n], data, len);
    b->len[b->n++] = len;
}

static void blobs_free(blobs_t *b) {
    for (int i = 0; i < b->n; i++)
        free(b->data[i]);
    b->n = 0;
}

/* Position of needle in hay, or -1. */
static long find(const uint8_t *hay, size_t n, const char *needle, size_t k) {
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(hay + i, needle, k))
            return (long)i;
    return -1;
}

/* Six ways to break one valid encoding. */
static void add_variants(blobs_t *b, const uint8_t *enc, size_t n) {
    uint8_t buf[4096];
    CU_ASSERT_FATAL(n + 8 <= sizeof buf);
    add(b, enc, n / 2); /* cut in the middle */
    add(b, enc, n - 1); /* one byte short */
    memcpy(buf, enc, n);
    long v = find(buf, n, "\xa1v\x01", 3);
    CU_ASSERT_FATAL(v >= 0);
    buf[v + 2] = 2; /* protocol version 2 */
    add(b, buf, n);
    memcpy(buf, enc, n); /* "v" twice: one more entry in the map header, then "v": 1 */
    if ((buf[0] & 0xf0) == 0x80 && (buf[0] & 0x0f) < 15) {
        buf[0]++;
        memcpy(buf + n, "\xa1v\x01", 3);
        add(b, buf, n + 3);
    } else if (buf[0] == 0xde) {
        buf[2]++;
        memcpy(buf + n, "\xa1v\x01", 3);
        add(b, buf, n + 3);
    }
    memcpy(buf, enc, n);
    buf[n] = 0x01; /* a byte after the map */
    add(b, buf, n + 1);
    memcpy(buf, enc, n);
    long t = find(buf, n, "\xa4type", 5);
    CU_ASSERT_FATAL(t >= 0);
    int len = buf[t + 5] & 0x1f;
    buf[t + 5 + len] = 'x'; /* "hellx": no such type */
    add(b, buf, n);
}

static void all_malformed(blobs_t *b) {
    for (int t = MSG_HELLO; t < MSG_TYPE_COUNT; t++) {
        msg_t m;
        build((msg_type_t)t, &m);
        msg_buf_t enc;
        msg_buf_init(&enc);
        int rc = msg_encode(&m, &enc);
        if (rc < 0)
            tu_report("encode %s: %s", msg_type_name((msg_type_t)t), mo_last_error());
        CU_ASSERT_FATAL(rc == MO_OK);
        add_variants(b, enc.data, enc.len);
        msg_buf_free(&enc);
    }
    uint8_t junk[64];
    for (int i = 0; i < 64; i++)
        junk[i] = (uint8_t)(rng_uniform(3, 4, (uint64_t)i) * 256);
    add(b, "", 0);                                  /* nothing */
    add(b, junk, sizeof junk);                      /* noise */
    add(b, "\x93\x01\x02\x03", 4);                  /* an array, not a map */
    add(b, "\x81\xa4type\xa5hello", 12);            /* no "v" */
    add(b, "\xdf\x7f\xff\xff\xff\x01\x02", 7);      /* a map of 2^31 entries in 7 bytes */
    add(b, "\x81\xa4type\xc6\x40\x00\x00\x00", 11); /* a 1 GiB bin in 11 bytes */
    uint8_t deep[64];
    memset(deep, 0x91, 60); /* 60 nested arrays */
    deep[60] = 0x01;
    add(b, deep, 61);
}

/* Sends every blob, and a few bad frame layouts, on a fresh socket of `type`. */
static void barrage(void *ctx, int type, const char *endpoint, const blobs_t *b) {
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 2000;
    o.routing_id = type == ZMQ_DEALER ? "evil-0" : NULL;
    void *s = NULL;
    CU_ASSERT_FATAL(zsock_connect(ctx, type, endpoint, &o, &s) == MO_OK);
    for (int i = 0; i < b->n; i++)
        CU_ASSERT(zsock_send(s, NULL, b->data[i], b->len[i], 0) == 1);
    if (type == ZMQ_DEALER) { /* [a][b][c] and [][][x]: not [(empty)][body] */
        zmq_send(s, "a", 1, ZMQ_SNDMORE);
        zmq_send(s, "b", 1, ZMQ_SNDMORE);
        zmq_send(s, "c", 1, 0);
        zmq_send(s, "", 0, ZMQ_SNDMORE);
        zmq_send(s, "", 0, ZMQ_SNDMORE);
        zmq_send(s, "x", 1, 0);
    }
    zsock_close(&s); /* lingers until sent */
    /* Over transport.max_msg_bytes (1 MiB): ZeroMQ drops the connection it came on. */
    zsock_opts_t big = o;
    big.max_msg_bytes = -1;
    big.routing_id = type == ZMQ_DEALER ? "evil-1" : NULL; /* not a handover of evil-0 */
    CU_ASSERT_FATAL(zsock_connect(ctx, type, endpoint, &big, &s) == MO_OK);
    size_t n = (size_t)2 << 20;
    uint8_t *huge = calloc(1, n);
    CU_ASSERT_FATAL(huge != NULL);
    huge[0] = 0x82;
    CU_ASSERT(zmq_send(s, huge, n, 0) == (int)n);
    free(huge);
    zsock_close(&s);
}

static double malformed_sum(const cJSON *o) {
    return it_sum_prefix(o, "moerl_malformed_messages_total");
}

static void test_malformed_everywhere(void) {
    int steps = IT_ASAN ? 8 : 12;
    it_job_t j;
    /* Paused, the job cannot finish before every malformed message is counted. */
    pid_t run = it_start_paused(&j, steps, 2);
    const cJSON *st = NULL;
    cJSON *root = it_ctl_status(&j, &st);
    CU_ASSERT_FATAL(root != NULL);
    double before = malformed_sum(st);
    cJSON_Delete(root);
    int step_before = it_step(&j);

    blobs_t b = {0};
    all_malformed(&b);
    void *ctx = zmq_ctx_new();
    const struct {
        int type, port;
    } targets[] = {{ZMQ_DEALER, j.port},      /* learner control */
                   {ZMQ_DEALER, j.port + 1},  /* learner work */
                   {ZMQ_PUSH, j.port + 2},    /* learner trajectory sink */
                   {ZMQ_DEALER, j.port + 4}}; /* reward worker 0 */
    for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
        char ep[64];
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", targets[i].port);
        barrage(ctx, targets[i].type, ep, &b);
    }
    zmq_ctx_term(ctx);
    int sent = b.n;
    blobs_free(&b);

    /* The learner still answers and counted every one: `sent` on each of its three
     * sockets and the two bad frame layouts on each of its two ROUTERs (the oversized
     * messages never reach it: ZeroMQ drops them with their connection). */
    double want = before + 3 * sent + 4, after = before, end = it_now_ms() + 20000;
    while (after < want && it_now_ms() < end) {
        root = it_ctl_status(&j, &st);
        if (root)
            after = malformed_sum(st);
        cJSON_Delete(root);
        it_sleep_ms(100);
    }
    if (after != want)
        tu_report("learner malformed count %g -> %g, expected %g", before, after, want);
    CU_ASSERT_EQUAL(after, want);
    CU_ASSERT_EQUAL_FATAL(it_ctl(&j, "resume"), 0);

    int status;
    int ok = it_wait(run, IT_ASAN ? 300000 : 120000, &status);
    if (!ok || it_exit_code(status) != 0)
        it_dump(&j, "run.out");
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(status), 0);
    cJSON *fin = it_last_event(j.metrics, "final");
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_step"), steps);
    CU_ASSERT(steps > step_before);
    CU_ASSERT_EQUAL(it_num(fin, "moerl_learner_groups_trained_total"), steps * 4);
    cJSON_Delete(fin);
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/metrics/reward-0.jsonl", j.run);
    cJSON *rw = it_last_event(path, NULL);
    double rw_bad = malformed_sum(rw);
    if (rw_bad != sent + 2)
        tu_report("reward worker malformed count %g after %d messages", rw_bad, sent + 2);
    CU_ASSERT_EQUAL(rw_bad, sent + 2);
    cJSON_Delete(rw);
    /* Nobody was restarted: every process of the job exited 0 once. */
    snprintf(path, sizeof path, "%s/logs/run.log", j.run);
    char *log = it_slurp(path);
    CU_ASSERT_FATAL(log != NULL);
    bool clean = strstr(log, "restarting in") == NULL;
    const char *procs[] = {"learner", "rollout-0", "rollout-1", "reward-0"};
    for (int i = 0; i < 4; i++) {
        char want[64];
        snprintf(want, sizeof want, "  %-12s exit 0\n", procs[i]);
        clean = clean && strstr(log, want) != NULL;
    }
    if (!clean)
        tu_report("run.log:\n%s", log);
    CU_ASSERT(clean);
    free(log);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"malformed everywhere", test_malformed_everywhere},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_malformed", tests);
}
