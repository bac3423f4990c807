/* bad_plugin: broken reward plugins that the plugin tests load to check the
 * host's errors. One source, three libraries:
 *   BAD_ABI     reports ABI version 999
 *   BAD_NOSYM   has no moerl_reward_fini
 *   otherwise   loads fine, but scoring misbehaves on request: a completion
 *               containing "nan" gets NaN, "inf" gets +infinity, "fail" a
 *               negative return with a reason, "positive" the return 7. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "moerl_reward.h"

#ifdef BAD_ABI
int moerl_reward_abi_version(void) {
    return 999;
}
#else
int moerl_reward_abi_version(void) {
    return MOERL_REWARD_ABI_VERSION;
}
#endif

int moerl_reward_init(const char *args, void **state, char *err, size_t errcap) {
    (void)args;
    (void)err;
    (void)errcap;
    *state = NULL;
    return 0;
}

int moerl_reward_score(void *state, const moerl_reward_input_t *in, double *reward, char *info,
                       size_t infocap) {
    (void)state;
    const char *c = in->completion;
    if (strstr(c, "nan")) {
        *reward = NAN;
    } else if (strstr(c, "inf")) {
        *reward = INFINITY;
    } else if (strstr(c, "fail")) {
        snprintf(info, infocap, "asked to fail");
        return -3;
    } else if (strstr(c, "positive")) {
        *reward = 1.0;
        return 7;
    } else {
        *reward = 0.5;
    }
    return 0;
}

#ifndef BAD_NOSYM
void moerl_reward_fini(void *state) {
    (void)state;
}
#endif
