/* Tests for the metrics registry: registration rules (names, labels, kinds, finding
 * an existing series), counter and gauge semantics, the status section, the exact
 * Prometheus text, JSON lines read back with cJSON (NaN as null), the malformed-message
 * counter and its once-per-peer-per-minute log, and GET /metrics over a real socket. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/metrics.h"
#include "core/status.h"
#include "tests/testutil.h"

static void test_register(void) {
    metrics_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(metrics_new(&m, "learner"), 0);
    CU_ASSERT_STRING_EQUAL(metrics_daemon(m), "learner");
    int c = metrics_counter(m, "moerl_groups_total", "Groups received.");
    int g = metrics_gauge(m, "moerl_step", "Steps done.");
    CU_ASSERT_EQUAL(c, 0);
    CU_ASSERT_EQUAL(g, 1);
    CU_ASSERT_EQUAL(metrics_counter(m, "moerl_groups_total", "other help"), c);
    CU_ASSERT_EQUAL(metrics_gauge(m, "moerl_groups_total", "x"), -1); /* kind differs */
    CU_ASSERT(strstr(mo_last_error(), "counter") != NULL);
    CU_ASSERT_EQUAL(metrics_gauge(m, "9bad", "x"), -1);
    CU_ASSERT_EQUAL(metrics_gauge(m, "", "x"), -1);
    CU_ASSERT_EQUAL(metrics_gauge(m, "a-b", "x"), -1);
    int id = -5;
    const char *bad_label[] = {"pe:er", "x", NULL};
    CU_ASSERT_EQUAL(metrics_series(m, METRIC_GAUGE, "moerl_l", "", bad_label, &id), MO_EINVAL);
    CU_ASSERT_EQUAL(id, -1);
    const char *l1[] = {"layer", "0", NULL}, *l2[] = {"layer", "1", NULL};
    int a, b, a2;
    CU_ASSERT_EQUAL(metrics_series(m, METRIC_GAUGE, "moerl_imbalance", "Imbalance.", l1, &a), 0);
    CU_ASSERT_EQUAL(metrics_series(m, METRIC_GAUGE, "moerl_imbalance", "Imbalance.", l2, &b), 0);
    CU_ASSERT_EQUAL(metrics_series(m, METRIC_GAUGE, "moerl_imbalance", NULL, l1, &a2), 0);
    CU_ASSERT_NOT_EQUAL(a, b);
    CU_ASSERT_EQUAL(a, a2);

    metrics_inc(m, c, 2);
    metrics_inc(m, c, 0.5);
    metrics_inc(m, c, -7); /* ignored */
    CU_ASSERT_DOUBLE_EQUAL(metrics_value(m, c), 2.5, 0);
    metrics_set(m, g, 3);
    metrics_set(m, g, -1.25);
    CU_ASSERT_DOUBLE_EQUAL(metrics_value(m, g), -1.25, 0);
    metrics_set(m, -1, 9); /* ignored */
    metrics_inc(m, 1000, 9);
    CU_ASSERT(isnan(metrics_value(m, -1)));
    metrics_destroy(&m);
    CU_ASSERT_PTR_NULL(m);
    metrics_destroy(&m);
}

static metrics_t *sample_registry(void) {
    metrics_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(metrics_new(&m, "rollout-1"), 0);
    int c = metrics_counter(m, "moerl_tokens_total", "Tokens generated.");
    int g = metrics_gauge(m, "moerl_tokens_per_s", "Recent throughput.");
    const char *l1[] = {"layer", "0", "kind", "a\"b", NULL};
    int s;
    CU_ASSERT_EQUAL(metrics_series(m, METRIC_GAUGE, "moerl_imbalance", "Load max/mean.", l1, &s),
                    0);
    int u = metrics_gauge(m, "moerl_unknown", "Not known yet.");
    metrics_inc(m, c, 1234);
    metrics_set(m, g, 17.5);
    metrics_set(m, s, 1.5);
    metrics_set(m, u, NAN);
    return m;
}

static void test_prometheus_and_status(void) {
    metrics_t *m = sample_registry();
    char *text = NULL;
    size_t len = 0;
    CU_ASSERT_EQUAL_FATAL(metrics_prometheus(m, &text, &len), 0);
    const char *want = "# HELP moerl_tokens_total Tokens generated.\n"
                       "# TYPE moerl_tokens_total counter\n"
                       "moerl_tokens_total 1234\n"
                       "# HELP moerl_tokens_per_s Recent throughput.\n"
                       "# TYPE moerl_tokens_per_s gauge\n"
                       "moerl_tokens_per_s 17.5\n"
                       "# HELP moerl_imbalance Load max/mean.\n"
                       "# TYPE moerl_imbalance gauge\n"
                       "moerl_imbalance{layer=\"0\",kind=\"a\\\"b\"} 1.5\n"
                       "# HELP moerl_unknown Not known yet.\n"
                       "# TYPE moerl_unknown gauge\n"
                       "moerl_unknown NaN\n";
    if (strcmp(text, want) != 0)
        tu_report("got:\n%s", text);
    CU_ASSERT_STRING_EQUAL(text, want);
    CU_ASSERT_EQUAL(len, strlen(want));
    free(text);

    char *status = NULL;
    size_t slen = 0;
    FILE *f = open_memstream(&status, &slen);
    metrics_print(m, f);
    fclose(f);
    CU_ASSERT_STRING_EQUAL(status, "# rollout-1\n"
                                   "moerl_tokens_total 1234\n"
                                   "moerl_tokens_per_s 17.5\n"
                                   "moerl_imbalance{layer=0,kind=a\"b} 1.5\n"
                                   "moerl_unknown NaN\n");
    free(status);
    metrics_destroy(&m);
}

static void test_jsonl(void) {
    char dir[512], path[700];
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    snprintf(path, sizeof path, "%s/run/metrics/rollout-1.jsonl", dir);
    metrics_t *m = sample_registry();
    CU_ASSERT_EQUAL(metrics_jsonl_write(m, "nothing open"), 0); /* no file: nothing */
    CU_ASSERT_EQUAL_FATAL(metrics_jsonl_open(m, path), 0);
    CU_ASSERT_EQUAL(metrics_jsonl_write(m, "periodic"), 0);
    metrics_set(m, 1, 20);
    CU_ASSERT_EQUAL(metrics_jsonl_write(m, "final"), 0);
    metrics_destroy(&m);

    FILE *f = fopen(path, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        cJSON *o = cJSON_Parse(line);
        CU_ASSERT_PTR_NOT_NULL_FATAL(o);
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "daemon");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "time");
        const cJSON *tps = cJSON_GetObjectItemCaseSensitive(o, "moerl_tokens_per_s");
        const cJSON *imb =
            cJSON_GetObjectItemCaseSensitive(o, "moerl_imbalance{layer=0,kind=a\"b}");
        const cJSON *unk = cJSON_GetObjectItemCaseSensitive(o, "moerl_unknown");
        CU_ASSERT(cJSON_IsString(ev) && !strcmp(ev->valuestring, n ? "final" : "periodic"));
        CU_ASSERT(cJSON_IsString(d) && !strcmp(d->valuestring, "rollout-1"));
        CU_ASSERT(cJSON_IsNumber(t) && t->valuedouble > 1.6e9);
        CU_ASSERT(cJSON_IsNumber(tps) && tps->valuedouble == (n ? 20 : 17.5));
        CU_ASSERT(cJSON_IsNumber(imb) && imb->valuedouble == 1.5);
        CU_ASSERT(cJSON_IsNull(unk));
        cJSON_Delete(o);
        n++;
    }
    fclose(f);
    CU_ASSERT_EQUAL(n, 2);

    /* a path that cannot be created */
    metrics_t *m2 = NULL;
    CU_ASSERT_EQUAL_FATAL(metrics_new(&m2, "x"), 0);
    snprintf(path, sizeof path, "%s/run/metrics/rollout-1.jsonl/sub/x.jsonl", dir);
    CU_ASSERT_EQUAL(metrics_jsonl_open(m2, path), MO_EIO);
    metrics_destroy(&m2);
    tu_rmtree(dir);
}

static int count_lines(FILE *f) {
    fflush(f);
    rewind(f);
    int n = 0, c;
    while ((c = fgetc(f)) != EOF)
        n += c == '\n';
    return n;
}

static void test_malformed(void) {
    metrics_t *m = NULL;
    CU_ASSERT_EQUAL_FATAL(metrics_new(&m, "learner"), 0);
    FILE *log = tmpfile();
    CU_ASSERT_PTR_NOT_NULL_FATAL(log);
    metrics_set_log(m, log);
    CU_ASSERT_EQUAL(metrics_malformed(m, "trajectory_group", "rollout-0", "bad logprobs", 5), 1);
    CU_ASSERT_EQUAL(metrics_malformed(m, "trajectory_group", "rollout-0", "again", 1000), 0);
    CU_ASSERT_EQUAL(metrics_malformed(m, "heartbeat", "rollout-0", "other type", 2000), 0);
    CU_ASSERT_EQUAL(metrics_malformed(m, "heartbeat", "reward-0", "first of peer", 2000), 1);
    CU_ASSERT_EQUAL(metrics_malformed(m, "trajectory_group", "rollout-0", "a minute later",
                                      5 + METRICS_LOG_EVERY_MS),
                    1);
    CU_ASSERT_EQUAL(count_lines(log), 3);
    const char *l[] = {"type", "trajectory_group", "peer", "rollout-0", NULL};
    int id;
    CU_ASSERT_EQUAL(
        metrics_series(m, METRIC_COUNTER, "moerl_malformed_messages_total", NULL, l, &id), 0);
    CU_ASSERT_DOUBLE_EQUAL(metrics_value(m, id), 3, 0);
    const char *l2[] = {"type", "heartbeat", "peer", "rollout-0", NULL};
    CU_ASSERT_EQUAL(
        metrics_series(m, METRIC_COUNTER, "moerl_malformed_messages_total", NULL, l2, &id), 0);
    CU_ASSERT_DOUBLE_EQUAL(metrics_value(m, id), 1, 0);
    rewind(log);
    char line[1024];
    CU_ASSERT_PTR_NOT_NULL(fgets(line, sizeof line, log));
    CU_ASSERT(strstr(line, "Z learner: malformed trajectory_group from rollout-0") != NULL);
    CU_ASSERT(strstr(line, "bad logprobs") != NULL);
    metrics_log(m, "plain %d", 42);
    CU_ASSERT_EQUAL(count_lines(log), 4);
    metrics_set_log(m, NULL);
    fclose(log);
    metrics_destroy(&m);
}

/* GET path on 127.0.0.1:port; returns the whole response (malloc'd) or NULL. */
static char *http_get(int port, const char *path) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return NULL;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return NULL;
    }
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && len + 1 < cap && (r = read(fd, buf + len, cap - len - 1)) > 0)
        len += (size_t)r;
    close(fd);
    if (buf)
        buf[len] = '\0';
    return buf;
}

static void test_http(void) {
    metrics_t *m = sample_registry();
    int port = 0;
    for (int i = 0; i < 50 && !port; i++) {
        int p = 20000 + (int)((getpid() * 7 + i * 131) % 30000);
        if (metrics_http_start(m, p, false) == MO_OK)
            port = p;
    }
    CU_ASSERT_FATAL(port != 0);
    CU_ASSERT_EQUAL(metrics_http_port(m), port);
    char *r = http_get(port, "/metrics");
    CU_ASSERT_PTR_NOT_NULL_FATAL(r);
    CU_ASSERT(strncmp(r, "HTTP/1.", 7) == 0 && strstr(r, " 200 ") != NULL);
    CU_ASSERT(strstr(r, "text/plain; version=0.0.4") != NULL);
    CU_ASSERT(strstr(r, "\nmoerl_tokens_total 1234\n") != NULL);
    free(r);
    r = http_get(port, "/other");
    CU_ASSERT(r && strstr(r, " 404 ") != NULL);
    free(r);

    /* the same port again: refused with a message naming it */
    metrics_t *m2 = NULL;
    CU_ASSERT_EQUAL_FATAL(metrics_new(&m2, "other"), 0);
    CU_ASSERT_EQUAL(metrics_http_start(m2, port, false), MO_EIO);
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%d", port);
    CU_ASSERT(strstr(mo_last_error(), want) != NULL);
    CU_ASSERT_EQUAL(metrics_http_start(m2, 0, false), MO_EINVAL);
    CU_ASSERT_EQUAL(metrics_http_port(m2), 0);
    metrics_destroy(&m2);
    metrics_destroy(&m);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"registration and values", test_register},
        {"prometheus text and status", test_prometheus_and_status},
        {"json lines", test_jsonl},
        {"malformed counter and log", test_malformed},
        {"http /metrics", test_http},
        CU_TEST_INFO_NULL,
    };
    return tu_main("metrics", tests);
}
