/* msg: the wire protocol's message structs, their bounds, enums and ownership
 * (docs/protocol.md is the reference for every field). */
#ifndef MOERL_TRANSPORT_MSG_H
#define MOERL_TRANSPORT_MSG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/arena.h"
#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The protocol version every message carries in "v"; decoders reject others. */
#define MSG_PROTOCOL_VERSION 1

/* ---- Bounds, checked by encoders (MO_EINVAL) and decoders (MO_EMALFORMED).
 * String bounds are in bytes of UTF-8. */
#define MSG_MAX_ID 64                /* worker_id */
#define MSG_MAX_NAME 256             /* prompt_id, host, job, keys, tensor names, stop strings */
#define MSG_MAX_PATH 4096            /* model path, plugin path */
#define MSG_MAX_SPEC 4096            /* reward function spec, ctl argument values */
#define MSG_MAX_MESSAGE 65536        /* ctl_reply.message, error.message, status strings */
#define MSG_MAX_TEXT (1 << 24)       /* prompt, answer, completion text, extra values */
#define MSG_MAX_MAP 256              /* entries of extra, args, meta, reward details */
#define MSG_MAX_STATUS 4096          /* entries of ctl_reply.status */
#define MSG_MAX_STOP 32              /* stop strings */
#define MSG_MAX_ITEMS 4096           /* lease items, work_request credits */
#define MSG_MAX_SAMPLES 4096         /* samples per group (G) */
#define MSG_MAX_TOKENS (1 << 22)     /* tokens of one prompt or one completion */
#define MSG_MAX_LAYERS 1024          /* MoE layers in a routing record */
#define MSG_MAX_TOPK 64              /* experts per token in a routing record */
#define MSG_MAX_TOP_K (1 << 20)      /* sampling top_k */
#define MSG_MAX_DEADLINE_MS 86400000 /* lease deadline: one day */
#define MSG_MAX_DIMS 8               /* dimensions of a weights table entry */
#define MSG_MAX_DIM ((int64_t)1 << 40)
#define MSG_MAX_TENSORS (1 << 18) /* weights table entries */
#define MSG_MAX_CHUNKS (1 << 24)  /* chunks of one weights version */
#define MSG_MAX_WEIGHT_BYTES ((uint64_t)1 << 40)
#define MSG_MAX_SECONDS_MS 1e12   /* timings and rates: finite, >= 0, at most this */
#define MSG_MAX_LOGPROB 1e-3      /* logprobs are <= 0 up to rounding */
#define MSG_MAX_DEPTH 16          /* nesting of maps and arrays in one message */
#define MSG_MAX_OBJECTS (1 << 22) /* msgpack objects in one message */

typedef enum {
    MSG_NONE = 0, /* "any type" for msg_decode; the type of an empty msg_t */
    MSG_HELLO,
    MSG_WELCOME,
    MSG_HEARTBEAT,
    MSG_WORK_REQUEST,
    MSG_LEASE,
    MSG_TRAJECTORY_GROUP,
    MSG_SCORE_REQUEST,
    MSG_SCORE_REPLY,
    MSG_WEIGHTS_CHUNK,
    MSG_SNAPSHOT_REQUEST,
    MSG_CTL_REQUEST,
    MSG_CTL_REPLY,
    MSG_REWARD_SWAP,
    MSG_ERROR,
    MSG_TYPE_COUNT
} msg_type_t;

/* MSG_ROLE_LEARNER appears only in the learner's answers to heartbeats, never in hello. */
typedef enum {
    MSG_ROLE_ROLLOUT = 0,
    MSG_ROLE_REWARD,
    MSG_ROLE_CTL,
    MSG_ROLE_LEARNER,
    MSG_ROLE_COUNT
} msg_role_t;

typedef enum {
    MSG_FINISH_STOP = 0, /* a stop string or end-of-sequence token */
    MSG_FINISH_LENGTH,   /* max_new_tokens reached */
    MSG_FINISH_ABORT,    /* cut short (shutdown, lease expired) */
    MSG_FINISH_COUNT
} msg_finish_t;

typedef enum {
    MSG_CTL_STATUS = 0,
    MSG_CTL_SWAP_REWARD,
    MSG_CTL_CHECKPOINT,
    MSG_CTL_PAUSE,
    MSG_CTL_RESUME,
    MSG_CTL_STOP,
    MSG_CTL_COUNT
} msg_ctl_cmd_t;

/* Wire names: "hello", "rollout", "stop", "status", ... ("?" when out of range). */
const char *msg_type_name(msg_type_t t);
const char *msg_role_name(msg_role_t r);
const char *msg_finish_name(msg_finish_t f);
const char *msg_ctl_cmd_name(msg_ctl_cmd_t c);
/* The enum value for a wire name; MO_ENOTFOUND (no message set) when unknown. */
int msg_type_from_name(const char *name, msg_type_t *out);

/* ---- Building blocks. Every pointer below is owned by the msg_t's arena
 * after msg_decode, and borrowed from the caller for msg_encode. Optional
 * strings and tensors are NULL when absent; optional numbers have a has_
 * flag; absent maps and lists have n == 0. */

/* A map of string to string ("extra", "args", "meta"); keys are unique. */
typedef struct msg_kv {
    const char *key;
    const char *value;
} msg_kv_t;

typedef struct msg_strmap {
    const msg_kv_t *items; /* (n) */
    uint32_t n;
} msg_strmap_t;

/* A map of string to number (per-sample reward details). */
typedef struct msg_metric {
    const char *key;
    double value; /* finite */
} msg_metric_t;

typedef struct msg_metrics {
    const msg_metric_t *items; /* (n) */
    uint32_t n;
} msg_metrics_t;

/* ctl_reply.status: a map of string to integer, float, string or boolean. */
typedef enum { MSG_VAL_INT = 0, MSG_VAL_FLOAT, MSG_VAL_STR, MSG_VAL_BOOL } msg_val_kind_t;

typedef struct msg_stat {
    const char *key;
    msg_val_kind_t kind;
    int64_t i;     /* MSG_VAL_INT, and MSG_VAL_BOOL (0 or 1) */
    double f;      /* MSG_VAL_FLOAT (NaN and infinities allowed) */
    const char *s; /* MSG_VAL_STR */
} msg_stat_t;

/* Sampling parameters of the rollout engine. */
typedef struct msg_sampling {
    double temperature;      /* [0, 100]; 0 is greedy */
    double top_p;            /* (0, 1] */
    int32_t top_k;           /* 0 (off) .. MSG_MAX_TOP_K */
    double min_p;            /* [0, 1] */
    int32_t max_new_tokens;  /* 1 .. MSG_MAX_TOKENS */
    const char *const *stop; /* (n_stop) stop strings, 1 .. MSG_MAX_NAME bytes each */
    uint32_t n_stop;         /* 0 .. MSG_MAX_STOP */
    uint64_t seed;
} msg_sampling_t;

/* The reward function in force. */
typedef struct msg_reward_spec {
    uint64_t version;     /* bumped by every swap */
    const char *function; /* 1 .. MSG_MAX_SPEC: built-in name or spec string */
    const char *plugin;   /* shared library path, or NULL */
} msg_reward_spec_t;

/* ---- Messages ---- */

/* worker -> learner control: the first message of every peer. */
typedef struct msg_hello {
    msg_role_t role;
    const char *worker_id; /* 1 .. MSG_MAX_ID bytes of [A-Za-z0-9._:@-] */
    int64_t pid;           /* 1 .. 2^31-1 */
    const char *host;      /* 0 .. MSG_MAX_NAME */
    const char *software;  /* "moerl 0.1.0" or NULL */
} msg_hello_t;

/* learner -> worker: the reply to hello. */
typedef struct msg_welcome {
    const char *job; /* 1 .. MSG_MAX_NAME: the run name */
    uint64_t policy_version;
    const char *model_path; /* 0 .. MSG_MAX_PATH */
    uint32_t group_size;    /* 1 .. MSG_MAX_SAMPLES (G) */
    msg_sampling_t sampling;
    uint32_t heartbeat_ms; /* 10 .. 600000 */
    bool has_reward;
    msg_reward_spec_t reward; /* when has_reward */
} msg_welcome_t;

/* worker -> learner control, every heartbeat_ms; the learner answers each one from a
 * registered worker with its own (role learner, worker_id "learner"). */
typedef struct msg_heartbeat {
    const char *worker_id;
    msg_role_t role;
    bool has_adapter_version;
    uint64_t adapter_version; /* rollout: adapter version loaded */
    bool has_reward_version;
    uint64_t reward_version; /* reward: reward function version loaded */
    uint32_t inflight;       /* leases (rollout) or score requests (reward) in progress */
    double tokens_per_s;     /* [0, MSG_MAX_SECONDS_MS] */
    uint32_t queue_depth;    /* work waiting in the worker */
} msg_heartbeat_t;

/* rollout -> learner work ROUTER: credit-based pull. */
typedef struct msg_work_request {
    const char *worker_id;
    uint32_t credits; /* 1 .. MSG_MAX_ITEMS prompts the worker can take now */
} msg_work_request_t;

typedef struct msg_lease_item {
    uint64_t group_id;            /* unique per job: names the trajectory group */
    const char *prompt_id;        /* 1 .. MSG_MAX_NAME: dataset id of the prompt */
    const char *prompt;           /* prompt text or NULL */
    const int32_t *prompt_tokens; /* (P) token ids >= 0, or NULL; at least one of the two */
    uint32_t n_prompt_tokens;     /* P: 1 .. MSG_MAX_TOKENS when present */
    const char *answer;           /* reference answer for the reward, or NULL */
    msg_strmap_t extra;           /* passed to the reward function */
    uint32_t n;                   /* completions to generate (G), 1 .. MSG_MAX_SAMPLES */
} msg_lease_item_t;

/* learner -> rollout: prompts to generate for. */
typedef struct msg_lease {
    uint64_t lease_id;
    uint32_t deadline_ms; /* 1 .. MSG_MAX_DEADLINE_MS after sending; then handed out again */
    uint64_t policy_version;
    const msg_lease_item_t *items; /* (n_items) */
    uint32_t n_items;              /* 1 .. MSG_MAX_ITEMS */
} msg_lease_t;

/* One completion. T = n_tokens, L = MoE layers, K = experts per token. */
typedef struct msg_sample {
    const int32_t *tokens;   /* (T) generated token ids >= 0 */
    const float *logprobs;   /* (T) rollout logprob of each generated token */
    uint32_t n_tokens;       /* T: 0 .. MSG_MAX_TOKENS */
    const uint16_t *routing; /* (R, L, K) chosen experts, or NULL */
    uint32_t routing_rows;   /* R: T (row j is the step that sampled tokens[j]) or P + T - 1 */
    uint32_t routing_layers; /* L: 1 .. MSG_MAX_LAYERS */
    uint32_t routing_k;      /* K: 1 .. MSG_MAX_TOPK */
    msg_finish_t finish;
    uint64_t adapter_version_first; /* adapter version of the first token */
    uint64_t adapter_version_last;  /* of the last token (>= first: swapped mid-sequence) */
    const char *text;               /* decoded completion, 0 .. MSG_MAX_TEXT */
    /* (L, K) the experts of the step that read tokens[T-1] (the row after the last of
     * routing), or NULL; only with routing, same L and K */
    const uint16_t *routing_last;
} msg_sample_t;

/* rollout -> learner trajectory sink: G completions of one prompt. */
typedef struct msg_trajectory_group {
    uint64_t group_id;
    uint64_t lease_id;
    const char *prompt_id;
    const char *worker_id;
    const int32_t *prompt_tokens; /* (P) */
    uint32_t n_prompt_tokens;     /* P: 1 .. MSG_MAX_TOKENS */
    const char *prompt;           /* or NULL */
    const char *answer;           /* or NULL */
    msg_strmap_t extra;
    const msg_sample_t *samples;         /* (G) */
    uint32_t n_samples;                  /* G: 1 .. MSG_MAX_SAMPLES */
    const float *rewards;                /* (G) finite, or NULL when not scored */
    uint64_t reward_version;             /* when rewards != NULL */
    const msg_metrics_t *reward_details; /* (G) or NULL; only with rewards */
    bool has_gen_ms;
    double gen_ms; /* wall time of generation */
    bool has_score_ms;
    double score_ms; /* wall time of scoring */
} msg_trajectory_group_t;

/* What the reward function sees of one completion. */
typedef struct msg_score_sample {
    const char *text;  /* 0 .. MSG_MAX_TEXT */
    uint32_t n_tokens; /* 0 .. MSG_MAX_TOKENS */
    msg_finish_t finish;
} msg_score_sample_t;

/* rollout -> reward ROUTER: score one group (compact: no tensors). */
typedef struct msg_score_request {
    uint64_t group_id;
    const char *prompt_id;
    const char *prompt; /* or NULL */
    const char *answer; /* or NULL */
    msg_strmap_t extra;
    const msg_score_sample_t *samples; /* (G) */
    uint32_t n_samples;                /* G: 1 .. MSG_MAX_SAMPLES */
} msg_score_request_t;

/* reward -> rollout: the rewards of one group. */
typedef struct msg_score_reply {
    uint64_t group_id;
    uint64_t reward_version;
    const float *rewards;         /* (G) finite */
    uint32_t n_samples;           /* G: 1 .. MSG_MAX_SAMPLES */
    const msg_metrics_t *details; /* (G) or NULL: named parts of each reward */
    bool has_score_ms;
    double score_ms;
} msg_score_reply_t;

/* One tensor of a flat adapter buffer. */
typedef struct msg_tensor_entry {
    const char *name; /* 1 .. MSG_MAX_NAME, unique in the table */
    dtype_t dtype;
    uint32_t ndim;               /* 0 .. MSG_MAX_DIMS */
    int64_t shape[MSG_MAX_DIMS]; /* each 0 .. MSG_MAX_DIM */
    uint64_t offset;             /* bytes into the flat buffer, a multiple of the dtype size */
} msg_tensor_entry_t;

/* learner weight PUB (and control replies to snapshot_request): one chunk of
 * an adapter version's flat buffer. Chunk i holds bytes
 * [i * chunk_bytes, min((i + 1) * chunk_bytes, total_bytes)). */
typedef struct msg_weights_chunk {
    uint64_t version;
    uint64_t checksum;               /* weights_hash64 of the whole flat buffer */
    uint32_t chunk_index;            /* < n_chunks */
    uint32_t n_chunks;               /* ceil(total_bytes / chunk_bytes), 1 .. MSG_MAX_CHUNKS */
    uint64_t total_bytes;            /* 1 .. MSG_MAX_WEIGHT_BYTES */
    uint64_t chunk_bytes;            /* nominal chunk size, >= 1 */
    const msg_tensor_entry_t *table; /* (n_table): on chunk 0 only */
    uint32_t n_table;                /* 1 .. MSG_MAX_TENSORS on chunk 0, else 0 */
    msg_strmap_t meta;               /* chunk 0 only: adapter settings (rank, alpha, ...) */
    const void *data;                /* (nbytes) this chunk's bytes */
    uint64_t nbytes;
} msg_weights_chunk_t;

/* rollout -> learner control: send me the current adapter. */
typedef struct msg_snapshot_request {
    const char *worker_id;
    bool has_version;
    uint64_t have_version; /* the version the worker holds, when has_version */
} msg_snapshot_request_t;

/* moerl ctl -> learner control. */
typedef struct msg_ctl_request {
    msg_ctl_cmd_t command;
    msg_strmap_t args; /* values 0 .. MSG_MAX_SPEC bytes */
} msg_ctl_request_t;

/* learner -> moerl ctl. */
typedef struct msg_ctl_reply {
    bool ok;
    const char *message;      /* 0 .. MSG_MAX_MESSAGE */
    const msg_stat_t *status; /* (n_status) */
    uint32_t n_status;        /* 0 .. MSG_MAX_STATUS */
} msg_ctl_reply_t;

/* learner (or ctl) -> reward workers: load another reward function. */
typedef struct msg_reward_swap {
    msg_reward_spec_t spec;
} msg_reward_swap_t;

/* any -> any: a request failed. */
typedef struct msg_error {
    int32_t code;        /* a negative MO_E* status, -1000 .. -1 */
    const char *message; /* 1 .. MSG_MAX_MESSAGE */
    const char *about;   /* type name of the message that failed, or NULL */
    bool has_id;
    uint64_t id; /* its group_id / lease_id, when has_id */
} msg_error_t;

/* A message of any type. Encoding reads only `type` and the matching member;
 * a decoded message owns everything it points to in `arena`. */
typedef struct msg {
    msg_type_t type;
    union {
        msg_hello_t hello;
        msg_welcome_t welcome;
        msg_heartbeat_t heartbeat;
        msg_work_request_t work_request;
        msg_lease_t lease;
        msg_trajectory_group_t trajectory_group;
        msg_score_request_t score_request;
        msg_score_reply_t score_reply;
        msg_weights_chunk_t weights_chunk;
        msg_snapshot_request_t snapshot_request;
        msg_ctl_request_t ctl_request;
        msg_ctl_reply_t ctl_reply;
        msg_reward_swap_t reward_swap;
        msg_error_t error;
    };
    arena_t arena;
} msg_t;

/* An empty message (type MSG_NONE, no memory held). */
void msg_init(msg_t *m);
/* Frees a decoded message's memory and leaves it empty; safe on an empty or
 * zero-filled msg_t, and twice. */
void msg_free(msg_t *m);

/* The bytes of a tensor entry (product of the shape times the dtype size);
 * MO_EINVAL (with a message) on overflow or a bad dtype. */
int msg_tensor_entry_bytes(const msg_tensor_entry_t *e, uint64_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
