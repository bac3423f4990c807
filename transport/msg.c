/* msg: wire names of the enums, and message ownership. */
#include "transport/msg.h"

#include <string.h>

#include "core/status.h"

static const char *const g_type_names[MSG_TYPE_COUNT] = {
    [MSG_NONE] = "none",
    [MSG_HELLO] = "hello",
    [MSG_WELCOME] = "welcome",
    [MSG_HEARTBEAT] = "heartbeat",
    [MSG_WORK_REQUEST] = "work_request",
    [MSG_LEASE] = "lease",
    [MSG_TRAJECTORY_GROUP] = "trajectory_group",
    [MSG_SCORE_REQUEST] = "score_request",
    [MSG_SCORE_REPLY] = "score_reply",
    [MSG_WEIGHTS_CHUNK] = "weights_chunk",
    [MSG_SNAPSHOT_REQUEST] = "snapshot_request",
    [MSG_CTL_REQUEST] = "ctl_request",
    [MSG_CTL_REPLY] = "ctl_reply",
    [MSG_REWARD_SWAP] = "reward_swap",
    [MSG_ERROR] = "error",
};

static const char *const g_role_names[MSG_ROLE_COUNT] = {"rollout", "reward", "ctl",
                                                                    "learner"};
static const char *const g_finish_names[MSG_FINISH_COUNT] = {"stop", "length", "abort"};
static const char *const g_ctl_names[MSG_CTL_COUNT] = {"status", "swap_reward", "checkpoint",
                                                       "pause",  "resume",      "stop"};

const char *msg_type_name(msg_type_t t) {
    return (unsigned)t < MSG_TYPE_COUNT ? g_type_names[t] : "?";
}

const char *msg_role_name(msg_role_t r) {
    return (unsigned)r < MSG_ROLE_COUNT ? g_role_names[r] : "?";
}

const char *msg_finish_name(msg_finish_t f) {
    return (unsigned)f < MSG_FINISH_COUNT ? g_finish_names[f] : "?";
}

const char *msg_ctl_cmd_name(msg_ctl_cmd_t c) {
    return (unsigned)c < MSG_CTL_COUNT ? g_ctl_names[c] : "?";
}

int msg_type_from_name(const char *name, msg_type_t *out) {
    for (int t = MSG_NONE + 1; t < MSG_TYPE_COUNT; t++) {
        if (strcmp(name, g_type_names[t]) == 0) {
            *out = (msg_type_t)t;
            return MO_OK;
        }
    }
    return MO_ENOTFOUND;
}

void msg_init(msg_t *m) {
    memset(m, 0, sizeof *m);
}

void msg_free(msg_t *m) {
    arena_free(&m->arena);
    memset(m, 0, sizeof *m);
}

int msg_tensor_entry_bytes(const msg_tensor_entry_t *e, uint64_t *bytes) {
    if ((unsigned)e->dtype >= DT_COUNT)
        return mo_errorf(MO_EINVAL, "tensor '%s': bad dtype %d", e->name ? e->name : "",
                         (int)e->dtype);
    if (e->ndim > MSG_MAX_DIMS)
        return mo_errorf(MO_EINVAL, "tensor '%s': %u dimensions, at most %d",
                         e->name ? e->name : "", e->ndim, MSG_MAX_DIMS);
    uint64_t n = dtype_size(e->dtype);
    for (uint32_t i = 0; i < e->ndim; i++) {
        int64_t d = e->shape[i];
        if (d < 0 || d > MSG_MAX_DIM)
            return mo_errorf(MO_EINVAL, "tensor '%s': dimension %u is %lld, not in [0, 2^40]",
                             e->name ? e->name : "", i, (long long)d);
        if (d != 0 && n > MSG_MAX_WEIGHT_BYTES / (uint64_t)d)
            return mo_errorf(MO_EINVAL, "tensor '%s': more than 2^40 bytes",
                             e->name ? e->name : "");
        n *= (uint64_t)d;
    }
    *bytes = n;
    return MO_OK;
}
