/* Integration: reward/examples/python_reward_server.py, an external reward server in
 * Python (python3-zmq, python3-msgpack), speaks the reward protocol: its score_reply and
 * error messages decode with this build's codec (rewards by its verifier, the reward
 * version it was given, field-naming errors for malformed requests, REQ-style frames);
 * and a job of `moerl learner` and two `moerl rollout` daemons whose only reward worker is
 * the Python server trains to the end on its scores (every step's mean reward is a mix of
 * its distinctive hit and miss values), after which the server, registered with the learner,
 * exits 0 on the learner's stop. */
#include "tests/it_job.h"
#include "transport/codec.h"

#define PY_HIT 0.75
#define PY_MISS (-0.3125)

static char g_script[IT_PATH];

/* Fails the suite with a clear message when python3-zmq or python3-msgpack is missing. */
static void require_python(void) {
    char cmd[IT_PATH + 64];
    snprintf(cmd, sizeof cmd, "'%s' -c 'import zmq, msgpack' 2>/dev/null", tu_python());
    int st = system(cmd);
    if (st != 0)
        tu_report("%s cannot import zmq and msgpack: install the Debian packages python3-zmq "
                  "and python3-msgpack (scripts/install-deps.sh)",
                  tu_python());
    CU_ASSERT_EQUAL_FATAL(st, 0);
    snprintf(g_script, sizeof g_script, "%s/reward/examples/python_reward_server.py",
             tu_source_dir());
    CU_ASSERT_FATAL(access(g_script, R_OK) == 0);
}

/* Starts the Python server on the job's reward endpoint; learner: register with it. */
static pid_t start_server(it_job_t *j, bool learner, const char *version) {
    static char bind[64], ctl[64], hit[32], miss[32];
    snprintf(bind, sizeof bind, "tcp://127.0.0.1:%d", j->port + 4);
    snprintf(ctl, sizeof ctl, "tcp://127.0.0.1:%d", j->port);
    snprintf(hit, sizeof hit, "%.17g", PY_HIT);
    snprintf(miss, sizeof miss, "%.17g", PY_MISS);
    const char *argv[] = {tu_python(),         g_script, "--bind", bind,  "--hit",
                          hit,                 "--miss", miss,     "--reward-version",
                          version,             learner ? "--learner" : NULL,
                          ctl,                 NULL};
    return it_spawn(j, "python.log", argv);
}

/* Waits until the log file `name` of job j contains `text`. */
static bool wait_log(it_job_t *j, const char *name, const char *text, int timeout_ms) {
    char path[IT_PATH + 64];
    snprintf(path, sizeof path, "%s/%s", j->dir, name);
    double end = it_now_ms() + timeout_ms;
    for (;;) {
        char *log = it_slurp(path);
        bool found = log && strstr(log, text);
        free(log);
        if (found)
            return true;
        if (it_now_ms() > end)
            return false;
        it_sleep_ms(20);
    }
}

/* Sends one frame on s and decodes the answer (1 s at most). */
static int ask(void *s, const void *buf, size_t len, msg_t *reply) {
    msg_init(reply);
    if (zsock_send(s, NULL, buf, len, 0) != 1)
        return MO_EIO;
    if (zsock_wait(s, 10000) != 1)
        return mo_errorf(MO_EIO, "no answer from the Python server in 10 s");
    int rc = zsock_recv_msg(s, NULL, reply, MSG_NONE, 0);
    return rc == 1 ? MO_OK : rc;
}

static int ask_msg(void *s, const msg_t *m, msg_t *reply) {
    msg_buf_t b;
    msg_buf_init(&b);
    int rc = msg_encode(m, &b);
    if (rc == MO_OK)
        rc = ask(s, b.data, b.len, reply);
    msg_buf_free(&b);
    return rc;
}

static void request(msg_t *m, msg_score_sample_t *ss, int n, uint64_t gid, const char *answer) {
    msg_init(m);
    m->type = MSG_SCORE_REQUEST;
    m->score_request.group_id = gid;
    m->score_request.prompt_id = "p-1";
    m->score_request.prompt = "12+345=";
    m->score_request.answer = answer;
    m->score_request.samples = ss;
    m->score_request.n_samples = (uint32_t)n;
}

static void test_protocol(void) {
    require_python();
    it_job_t j;
    it_open(&j, "");
    start_server(&j, false, "7");
    void *ctx = zmq_ctx_new();
    zsock_opts_t o;
    zsock_opts_default(&o);
    o.linger_ms = 0;
    o.routing_id = "rollout-9";
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", j.port + 4);
    void *s = NULL;
    CU_ASSERT_FATAL(zsock_connect(ctx, ZMQ_DEALER, ep, &o, &s) == MO_OK);

    /* A valid request: first line "357" is right, the others are wrong. */
    msg_score_sample_t ss[3] = {{"357\nmore text", 4, MSG_FINISH_STOP},
                                {"358", 2, MSG_FINISH_LENGTH},
                                {"", 0, MSG_FINISH_ABORT}};
    msg_t m, r;
    request(&m, ss, 3, 0x100000007ull, "357");
    int rc = ask_msg(s, &m, &r);
    if (rc < 0) {
        tu_report("score_reply: %s", mo_last_error());
        it_dump(&j, "python.log");
    }
    CU_ASSERT_FATAL(rc == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_SCORE_REPLY);
    CU_ASSERT_EQUAL(r.score_reply.group_id, 0x100000007ull);
    CU_ASSERT_EQUAL(r.score_reply.reward_version, 7);
    CU_ASSERT_EQUAL_FATAL(r.score_reply.n_samples, 3);
    CU_ASSERT_EQUAL(r.score_reply.rewards[0], (float)PY_HIT);
    CU_ASSERT_EQUAL(r.score_reply.rewards[1], (float)PY_MISS);
    CU_ASSERT_EQUAL(r.score_reply.rewards[2], (float)PY_MISS);
    CU_ASSERT_PTR_NOT_NULL_FATAL(r.score_reply.details);
    CU_ASSERT_EQUAL(r.score_reply.details[0].n, 1);
    CU_ASSERT_STRING_EQUAL(r.score_reply.details[0].items[0].key, "python_exact");
    CU_ASSERT_EQUAL(r.score_reply.details[0].items[0].value, 1.0);
    CU_ASSERT_EQUAL(r.score_reply.details[1].items[0].value, 0.0);
    msg_free(&r);

    /* No answer: every completion misses. */
    request(&m, ss, 1, 5, NULL);
    CU_ASSERT_FATAL(ask_msg(s, &m, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_SCORE_REPLY);
    CU_ASSERT_EQUAL(r.score_reply.rewards[0], (float)PY_MISS);
    msg_free(&r);

    /* A malformed request: an error naming the field, with the group id. */
    static const char bad[] = "\x84\xa4type\xadscore_request\xa1v\x01\xa8group_id\x2a"
                              "\xa7samples\x91\x83\xa4text\xa1x\xa8n_tokens\x01"
                              "\xad" "finish_reason\xa4oops";
    CU_ASSERT_FATAL(ask(s, bad, sizeof bad - 1, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_ERROR);
    CU_ASSERT_EQUAL(r.error.code, MO_EMALFORMED);
    CU_ASSERT_STRING_EQUAL(r.error.about, "score_request");
    CU_ASSERT(r.error.has_id && r.error.id == 42);
    CU_ASSERT(strstr(r.error.message, "prompt_id") != NULL); /* the first missing field */
    msg_free(&r);
    static const char bad2[] = "\x85\xa4type\xadscore_request\xa1v\x01\xa8group_id\x2a"
                               "\xa9prompt_id\xa1p\xa7samples\x91\x83\xa4text\xa1x\xa8n_tokens\x01"
                               "\xad" "finish_reason\xa4oops";
    CU_ASSERT_FATAL(ask(s, bad2, sizeof bad2 - 1, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_ERROR);
    CU_ASSERT(strstr(r.error.message, "samples[0].finish_reason") != NULL);
    msg_free(&r);
    /* Another protocol version, and a message that is not a score_request. */
    static const char v2[] = "\x82\xa4type\xadscore_request\xa1v\x02";
    CU_ASSERT_FATAL(ask(s, v2, sizeof v2 - 1, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_ERROR);
    CU_ASSERT(strstr(r.error.message, "protocol version") != NULL);
    msg_free(&r);
    CU_ASSERT_FATAL(ask(s, "\xc1", 1, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_ERROR);
    msg_free(&r);
    zsock_close(&s);

    /* A REQ client gets the delimiter frame back. */
    zsock_opts_default(&o);
    o.linger_ms = 0;
    CU_ASSERT_FATAL(zsock_connect(ctx, ZMQ_REQ, ep, &o, &s) == MO_OK);
    request(&m, ss, 2, 9, "358");
    CU_ASSERT_FATAL(ask_msg(s, &m, &r) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.type, MSG_SCORE_REPLY);
    CU_ASSERT_EQUAL(r.score_reply.rewards[0], (float)PY_MISS);
    CU_ASSERT_EQUAL(r.score_reply.rewards[1], (float)PY_HIT);
    msg_free(&r);
    zsock_close(&s);
    zmq_ctx_term(ctx);

    /* SIGTERM: exit 0 with a summary. */
    kill(j.pids[0], SIGTERM);
    int st;
    CU_ASSERT_FATAL(it_wait(j.pids[0], 20000, &st));
    CU_ASSERT_EQUAL(it_exit_code(st), 0);
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/python.log", j.dir);
    char *log = it_slurp(path);
    CU_ASSERT(log && strstr(log, "exiting: 3 groups, 6 samples scored") &&
              strstr(log, "4 malformed"));
    if (log && !strstr(log, "exiting: 3 groups"))
        tu_report("python.log: %s", log);
    free(log);
    it_close(&j);
}

static void test_job(void) {
    require_python();
    int steps = IT_ASAN ? 3 : 4;
    it_knobs_t k = it_knobs_default();
    k.steps = steps;
    char extra[4096];
    it_sections(extra, sizeof extra, &k);
    it_job_t j;
    it_open(&j, extra);
    pid_t py = start_server(&j, true, "1");
    const char *la[] = {tu_moerl_exe(), "learner", j.config, NULL};
    pid_t learner = it_spawn(&j, "learner.log", la);
    /* The rollouts start once the server has registered: a job this short could otherwise
     * end before a server that is slow to start says hello, and then nobody tells it to
     * stop (it keeps waiting for a learner, as a server started before its job does). */
    bool registered = wait_log(&j, "python.log", "registered with the learner", 30000);
    if (!registered) {
        it_dump(&j, "learner.log");
        it_dump(&j, "python.log");
    }
    CU_ASSERT_FATAL(registered);
    const char *r0[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "0", NULL};
    const char *r1[] = {tu_moerl_exe(), "rollout", j.config, "--worker-id", "1", NULL};
    it_spawn(&j, "rollout0.log", r0);
    it_spawn(&j, "rollout1.log", r1);
    int st = 0;
    int ok = it_wait(learner, IT_ASAN ? 400000 : 180000, &st);
    if (!ok || it_exit_code(st) != 0) {
        it_dump(&j, "learner.log");
        it_dump(&j, "rollout0.log");
        it_dump(&j, "python.log");
    }
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(st), 0);

    /* Every step trained on the Python scores: the mean of n rewards, each hit or miss. */
    FILE *f = fopen(j.metrics, "r");
    CU_ASSERT_FATAL(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int n_steps = 0;
    while (getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        if (o && cJSON_IsString(ev) && !strcmp(ev->valuestring, "step")) {
            double mean = it_num(o, "moerl_learner_reward_mean");
            double n = it_num(o, "moerl_learner_samples_trained_total");
            /* the fraction of hits, times the (at most 16) samples of the step */
            double hits16 = (mean - PY_MISS) / (PY_HIT - PY_MISS) * 16.0;
            CU_ASSERT(mean >= PY_MISS - 1e-6 && mean <= PY_HIT + 1e-6);
            CU_ASSERT(fabs(hits16 - round(hits16)) < 1e-3);
            if (!(mean >= PY_MISS - 1e-6 && mean <= PY_HIT + 1e-6))
                tu_report("step reward_mean %g (samples %g) is not a mix of %g and %g", mean, n,
                          PY_HIT, PY_MISS);
            n_steps++;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    CU_ASSERT_EQUAL(n_steps, steps);
    /* The random model misses nearly always: the first step's mean is the miss value. */
    cJSON *first = NULL;
    {
        FILE *g = fopen(j.metrics, "r");
        char *l = NULL;
        size_t c = 0;
        while (g && !first && getline(&l, &c, g) > 0) {
            cJSON *o = cJSON_Parse(l);
            const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
            if (o && cJSON_IsString(ev) && !strcmp(ev->valuestring, "step"))
                first = o;
            else
                cJSON_Delete(o);
        }
        free(l);
        if (g)
            fclose(g);
    }
    CU_ASSERT(fabs(it_num(first, "moerl_learner_reward_mean") - PY_MISS) < 0.2);
    cJSON_Delete(first);

    /* The server registered, scored every group and stopped with the run. */
    ok = it_wait(py, 20000, &st);
    if (!ok) {
        it_dump(&j, "learner.log");
        it_dump(&j, "python.log");
    }
    CU_ASSERT_FATAL(ok);
    CU_ASSERT_EQUAL(it_exit_code(st), 0);
    char path[IT_PATH + 32];
    snprintf(path, sizeof path, "%s/python.log", j.dir);
    char *log = it_slurp(path);
    int groups = -1;
    const char *ex = log ? strstr(log, "exiting: ") : NULL;
    if (ex)
        sscanf(ex, "exiting: %d groups", &groups);
    CU_ASSERT(log && strstr(log, "registered with the learner"));
    CU_ASSERT(log && strstr(log, "the learner asked to stop"));
    CU_ASSERT(groups >= 4 * steps);
    if (groups < 4 * steps)
        tu_report("python.log: %s", log ? log : "(none)");
    free(log);
    it_close(&j);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"python server speaks the reward protocol", test_protocol},
        {"job scored by the python server", test_job},
        CU_TEST_INFO_NULL,
    };
    return tu_main("it_python_reward", tests);
}
