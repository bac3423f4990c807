/* example_plugin: a reward plugin that pays completions containing a keyword.
 *
 * args: comma-separated key=value pairs
 *   keyword=WORD   required: the text to look for (no commas)
 *   hit=X          reward when the keyword occurs (default 1)
 *   miss=X         reward when it does not (default 0)
 *   icase=1        compare ASCII letters without case (default 0)
 * e.g. "keyword=hello,hit=1,miss=-0.5".
 *
 * Built as libmoerl_reward_example.so; it needs nothing but moerl_reward.h. */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* strdup, strtok_r */
#endif
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moerl_reward.h"

typedef struct keyword_state {
    char *keyword;
    size_t len;
    double hit, miss;
    int icase;
} keyword_state_t;

int moerl_reward_abi_version(void) {
    return MOERL_REWARD_ABI_VERSION;
}

/* The state is read-only after init, so scoring may run on many threads. */
unsigned moerl_reward_flags(void) {
    return MOERL_REWARD_THREAD_SAFE;
}

static int parse_number(const char *v, double *out) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end != '\0' || !isfinite(x))
        return -1;
    *out = x;
    return 0;
}

/* Applies one "key=value" pair to s; on failure writes the reason to err. */
static int apply_arg(keyword_state_t *s, char *pair, char *err, size_t errcap) {
    char *eq = strchr(pair, '=');
    if (!eq) {
        snprintf(err, errcap, "argument \"%s\" is not key=value", pair);
        return -1;
    }
    *eq = '\0';
    const char *key = pair, *val = eq + 1;
    if (!strcmp(key, "keyword")) {
        free(s->keyword);
        s->keyword = strdup(val);
        if (!s->keyword) {
            snprintf(err, errcap, "out of memory");
            return -1;
        }
        s->len = strlen(val);
        return 0;
    }
    if (!strcmp(key, "hit") || !strcmp(key, "miss")) {
        if (parse_number(val, !strcmp(key, "hit") ? &s->hit : &s->miss) == 0)
            return 0;
        snprintf(err, errcap, "%s: expected a finite number, got \"%s\"", key, val);
        return -1;
    }
    if (!strcmp(key, "icase") && (!strcmp(val, "0") || !strcmp(val, "1"))) {
        s->icase = val[0] == '1';
        return 0;
    }
    snprintf(err, errcap, "unknown argument \"%s\" (keyword=WORD, hit=X, miss=X, icase=0|1)", key);
    return -1;
}

void moerl_reward_fini(void *state) {
    keyword_state_t *s = state;
    if (!s)
        return;
    free(s->keyword);
    free(s);
}

int moerl_reward_init(const char *args, void **state, char *err, size_t errcap) {
    keyword_state_t *s = calloc(1, sizeof *s);
    char *copy = strdup(args);
    if (!s || !copy) {
        free(s);
        free(copy);
        snprintf(err, errcap, "out of memory");
        return -1;
    }
    s->hit = 1.0;
    int rc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && rc == 0; tok = strtok_r(NULL, ",", &save))
        rc = apply_arg(s, tok, err, errcap);
    free(copy);
    if (rc == 0 && (!s->keyword || s->len == 0)) {
        snprintf(err, errcap, "no keyword: pass args \"keyword=WORD\"");
        rc = -1;
    }
    if (rc != 0) {
        moerl_reward_fini(s);
        return -1;
    }
    *state = s;
    return 0;
}

static int same(const char *a, const char *b, size_t n, int icase) {
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a[i], y = (unsigned char)b[i];
        if (icase) {
            x = (unsigned char)tolower(x);
            y = (unsigned char)tolower(y);
        }
        if (x != y)
            return 0;
    }
    return 1;
}

int moerl_reward_score(void *state, const moerl_reward_input_t *in, double *reward, char *info,
                       size_t infocap) {
    const keyword_state_t *s = state;
    for (size_t i = 0; i + s->len <= in->completion_len; i++) {
        if (same(in->completion + i, s->keyword, s->len, s->icase)) {
            *reward = s->hit;
            snprintf(info, infocap, "found \"%s\" at byte %zu", s->keyword, i);
            return 0;
        }
    }
    *reward = s->miss;
    snprintf(info, infocap, "no \"%s\"", s->keyword);
    return 0;
}
