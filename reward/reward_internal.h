/* reward_internal: what the reward module's files share and nothing outside
 * it uses: parsed spec options, the built-in table, the plugin loader. */
#ifndef MOERL_REWARD_REWARD_INTERNAL_H
#define MOERL_REWARD_REWARD_INTERNAL_H

#include <stddef.h>

#include "reward/reward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One `key=value` of a spec term, unescaped, with where it was written. */
typedef struct reward_opt {
    char *key;     /* NUL-terminated */
    char *value;   /* NUL-terminated, quotes and escapes removed */
    int key_col;   /* 1-based column of the key in the spec */
    int value_col; /* 1-based column of the value's first character (after a quote) */
    int quoted;    /* value was written in quotes */
} reward_opt_t;

/* A built-in: make parses options into a state (on error it sets *bad to the
 * index of the option at fault, or -1 when none is, and sets the message);
 * score must be safe to call from several threads on one state. */
typedef struct reward_builtin {
    const char *name;
    const char *summary; /* one line: what it rewards and its options */
    int (*make)(const reward_opt_t *opts, int n, void **state, int *bad);
    int (*score)(void *state, const reward_input_t *in, double *reward, char *detail, size_t cap);
    void (*free)(void *state);
} reward_builtin_t;

extern const reward_builtin_t reward_builtins[];
extern const int reward_n_builtins;

/* The built-in named name[0..len), or NULL. */
const reward_builtin_t *reward_builtin_find(const char *name, size_t len);

/* snprintf into detail[0..cap) that tolerates detail NULL with cap 0. */
void reward_detailf(char *detail, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A loaded plugin and its state (plugin.c). */
typedef struct reward_plugin reward_plugin_t;
int reward_plugin_open(const char *path, const char *args, reward_plugin_t **out);
/* Calls the plugin's score (under its lock unless it is thread-safe); a
 * negative or positive return, or a non-finite reward, is MO_EINVAL with the
 * plugin's path and reason. */
int reward_plugin_score(reward_plugin_t *p, const reward_input_t *in, double *reward, char *detail,
                        size_t cap);
void reward_plugin_close(reward_plugin_t **p);

#ifdef __cplusplus
}
#endif
#endif
