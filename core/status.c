/* status: error codes and the thread-local error message. */
#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MSG_CAP 1024
static _Thread_local char g_msg[MSG_CAP];

int mo_errorf(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, MSG_CAP, fmt, ap);
    va_end(ap);
    return code;
}

int mo_error_wrap(int code, const char *fmt, ...) {
    char prefix[MSG_CAP], old[MSG_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, MSG_CAP, fmt, ap);
    va_end(ap);
    memcpy(old, g_msg, MSG_CAP);
    if (old[0])
        snprintf(g_msg, MSG_CAP, "%.500s: %.500s", prefix, old);
    else
        snprintf(g_msg, MSG_CAP, "%s", prefix);
    return code;
}

const char *mo_last_error(void) { return g_msg; }

void mo_clear_error(void) { g_msg[0] = '\0'; }

const char *mo_status_name(int code) {
    switch (code) {
    case MO_OK: return "ok";
    case MO_EINVAL: return "invalid argument";
    case MO_ENOMEM: return "out of memory";
    case MO_EIO: return "I/O error";
    case MO_EMALFORMED: return "malformed input";
    case MO_EUNSUPPORTED: return "unsupported";
    case MO_ECONFIG: return "configuration error";
    case MO_EDEVICE: return "device error";
    case MO_ENOTFOUND: return "not found";
    case MO_ESTATE: return "invalid state";
    default: return "unknown error";
    }
}

void mo_assert_fail(const char *what, const char *file, int line) {
    fprintf(stderr, "moerl: assertion failed: %s (%s:%d)\n", what, file, line);
    abort();
}
