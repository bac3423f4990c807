/* metrics: a daemon's counters and gauges in one registry, printed as a status
 * section, appended as JSON lines, served as Prometheus text over HTTP, plus the
 * daemon's log lines and the malformed-message counters. */
#ifndef MOERL_CORE_METRICS_H
#define MOERL_CORE_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A series is a name ([a-zA-Z_:][a-zA-Z0-9_:]*, at most METRICS_MAX_NAME bytes) with
 * optional labels (names like metric names without ':', values any text up to
 * METRICS_MAX_LABEL bytes). Its key, used in JSON lines, status sections and
 * metrics_foreach, is the name alone or name{k1=v1,k2=v2} in registration order.
 *
 * Threads: every function may be called from any thread (one mutex guards the
 * registry; the HTTP server reads it from its own thread). */

#define METRICS_MAX_NAME 128
#define METRICS_MAX_LABELS 4
#define METRICS_MAX_LABEL 128
#define METRICS_MAX_SERIES 4096
#define METRICS_LOG_EVERY_MS 60000 /* malformed messages: one log line per peer per minute */

typedef enum { METRIC_COUNTER = 0, METRIC_GAUGE } metric_kind_t;

typedef struct metrics metrics_t;

/* daemon: the name in log lines and JSON lines ("learner", "rollout-0"). */
int metrics_new(metrics_t **out, const char *daemon);
/* Stops the HTTP server, closes the JSON lines file. Safe on NULL. */
void metrics_destroy(metrics_t **m);
const char *metrics_daemon(const metrics_t *m);

/* Registers a series, or finds it when name and labels are already registered (the
 * kind must then agree). labels: NULL, or key, value, key, value, ..., NULL (at most
 * METRICS_MAX_LABELS pairs). help: one line (the first registration's is kept). *id
 * receives the series' index. MO_EINVAL for a bad name, label or kind; MO_ENOMEM. */
int metrics_series(metrics_t *m, metric_kind_t kind, const char *name, const char *help,
                   const char *const *labels, int *id);
/* Shorthands without labels; -1 on failure (the message is set) and then every
 * operation on -1 is ignored. */
int metrics_counter(metrics_t *m, const char *name, const char *help);
int metrics_gauge(metrics_t *m, const char *name, const char *help);

/* Counters only grow: a negative delta is ignored. */
void metrics_inc(metrics_t *m, int id, double delta);
/* Gauges (and counters, to restore them) take any value; NaN means "unknown" (null in
 * JSON, NaN in Prometheus text). */
void metrics_set(metrics_t *m, int id, double value);
double metrics_value(metrics_t *m, int id);

/* Calls fn for every series in registration order (under the registry's lock: fn must
 * not call back into m). */
typedef void (*metrics_visit_fn)(const char *key, metric_kind_t kind, double value, void *arg);
void metrics_foreach(metrics_t *m, metrics_visit_fn fn, void *arg);

/* ---- Output ---- */

/* The status section: "# <daemon>" then one "key value" line per series. */
void metrics_print(metrics_t *m, FILE *out);

/* Prometheus text exposition (version 0.0.4): # HELP and # TYPE per name, one line
 * per series. *out is malloc'd (free()). */
int metrics_prometheus(metrics_t *m, char **out, size_t *len);

/* Opens path for appending JSON lines, creating its parent directory when missing.
 * MO_EIO naming the path. */
int metrics_jsonl_open(metrics_t *m, const char *path);
/* Appends one line {"time": unix seconds, "daemon": name, "event": event, key: value,
 * ...} with every series and flushes it. Nothing when no file is open. MO_EIO. */
int metrics_jsonl_write(metrics_t *m, const char *event);

/* Serves GET /metrics (Prometheus text) on port (1..65535) from a thread of its own,
 * on 127.0.0.1, or on every interface when any_interface. MO_EIO naming the port when
 * it cannot listen (in use). Other paths get 404. */
int metrics_http_start(metrics_t *m, int port, bool any_interface);
/* The port being served, 0 when none. */
int metrics_http_port(const metrics_t *m);

/* ---- Logging ---- */

/* Log lines go to stderr unless set here (NULL: stderr again). */
void metrics_set_log(metrics_t *m, FILE *out);
/* One line: "2024-05-01T12:34:56.789Z <daemon>: <message>". */
void metrics_log(metrics_t *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Counts a malformed message in moerl_malformed_messages_total{type, peer} and logs it,
 * at most once per peer per METRICS_LOG_EVERY_MS of now_ms (the caller's monotonic
 * clock). type: the expected message type ("?" when unknown); peer: the sender's id
 * ("" when unknown); why: the decoder's message. Returns 1 when a line was logged. */
int metrics_malformed(metrics_t *m, const char *type, const char *peer, const char *why,
                      uint64_t now_ms);

#ifdef __cplusplus
}
#endif
#endif
