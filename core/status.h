/* status: error codes, the thread-local error message, and the TRY macro. */
#ifndef MOERL_CORE_STATUS_H
#define MOERL_CORE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* 0 is success; every error is negative. MO_EMALFORMED is distinct so that
 * decoders of outside input can be told apart from internal failures. */
enum {
    MO_OK = 0,
    MO_EINVAL = -1,       /* bad argument or value */
    MO_ENOMEM = -2,       /* allocation failed */
    MO_EIO = -3,          /* file or socket I/O failed */
    MO_EMALFORMED = -4,   /* input from outside failed validation */
    MO_EUNSUPPORTED = -5, /* a valid request this build cannot serve */
    MO_ECONFIG = -6,      /* configuration error */
    MO_EDEVICE = -7,      /* accelerator or backend error */
    MO_ENOTFOUND = -8,    /* a named thing does not exist */
    MO_ESTATE = -9,       /* operation invalid in the current state */
};

/* Records a printf-style message for the calling thread and returns code. */
int mo_errorf(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends "prefix: " to the current message (adds context while unwinding). */
int mo_error_wrap(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's last message ("" if none). */
const char *mo_last_error(void);
void mo_clear_error(void);
/* A short name for a status code ("invalid argument", ...). */
const char *mo_status_name(int code);

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        int try_rc_ = (expr);                                                                      \
        if (try_rc_ < 0)                                                                           \
            return try_rc_;                                                                        \
    } while (0)

/* Programmer errors only: never for input from files, network or users. */
#define MO_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond))                                                                               \
            mo_assert_fail(#cond, __FILE__, __LINE__);                                             \
    } while (0)
void mo_assert_fail(const char *what, const char *file, int line) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
#endif
