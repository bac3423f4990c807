/* config: a job's settings, loaded from YAML through one table of known keys
 * that also serves validation, --set overrides, dump and the reference docs. */
#ifndef MOERL_CORE_CONFIG_H
#define MOERL_CORE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A list of heap strings owned by the config. */
typedef struct cfg_strlist {
    char **items; /* (n) */
    int n;
} cfg_strlist_t;

/* Enumerations: the value is the index of the name in the key's choices. */
typedef enum { CFG_DTYPE_AUTO = 0, CFG_DTYPE_BF16, CFG_DTYPE_F32 } cfg_dtype_t;
typedef enum { CFG_ADV_GRPO = 0, CFG_ADV_DR_GRPO, CFG_ADV_RLOO, CFG_ADV_REINFORCE } cfg_advantage_t;
typedef enum { CFG_LOSS_PPO = 0, CFG_LOSS_GSPO, CFG_LOSS_CISPO } cfg_loss_t;
typedef enum {
    CFG_AGG_TOKEN_MEAN = 0,
    CFG_AGG_SEQ_MEAN_TOKEN_SUM,
    CFG_AGG_SEQ_MEAN_TOKEN_MEAN
} cfg_loss_agg_t;
typedef enum { CFG_KL_K1 = 0, CFG_KL_K2, CFG_KL_K3 } cfg_kl_estimator_t;
typedef enum { CFG_LR_CONSTANT = 0, CFG_LR_COSINE } cfg_lr_schedule_t;
typedef enum { CFG_OVERLONG_KEEP = 0, CFG_OVERLONG_FILTER, CFG_OVERLONG_PENALTY } cfg_overlong_t;
typedef enum { CFG_TASK_ARITH = 0, CFG_TASK_SORT, CFG_TASK_JSONL } cfg_task_t;
typedef enum { CFG_COMM_MPI = 0, CFG_COMM_NCCL } cfg_comm_t;

typedef struct config_run {
    char *name;         /* run name: logs, metrics, checkpoint metadata */
    char *dir;          /* run directory; "" means runs/<name> */
    int64_t seed;       /* master seed */
    int threads;        /* CPU threads per process; 0 = all cores */
    device_t device;    /* DEV_CPU or DEV_CUDA */
    bool deterministic; /* bit-reproducible reductions */
} config_run_t;

typedef struct config_model {
    char *path;          /* Hugging Face model directory */
    cfg_dtype_t dtype;   /* storage of the frozen base */
    bool recompute;      /* recompute activations in backward */
    bool routing_replay; /* learner replays the rollout's expert choices */
    int max_seq_len;     /* prompt + completion tokens */
} config_model_t;

typedef struct config_lora {
    int rank;
    double alpha;
    cfg_strlist_t targets; /* names from cfg_lora_targets */
    bool rslora;           /* scale alpha / sqrt(rank) instead of alpha / rank */
    double dropout;        /* always 0 */
    int64_t init_seed;     /* 0 = derived from run.seed */
    bool train_router;     /* also train the MoE routers (mlp.gate, (E, D)) in full */
    bool train_norms;      /* also train the RMSNorm weights in full */
} config_lora_t;

typedef struct config_rollout {
    int workers;
    int group_size; /* G completions per prompt */
    int prompts_per_step;
    int max_new_tokens;
    double temperature;
    double top_p;
    int top_k; /* 0 = off */
    double min_p;
    cfg_strlist_t stop_strings;
    int64_t kv_cache_tokens; /* 0 = max_batch * model.max_seq_len */
    int max_batch;
    char *prompt_template; /* contains "{prompt}" once */
    bool merge_adapter;
    bool packed_weights;
    bool cuda_graphs; /* device decode steps replayed as CUDA graphs */
    bool record_prompt_routing;
} config_rollout_t;

typedef struct config_reward {
    int workers;
    char *function;
    char *plugin; /* "" = none */
    int timeout_ms;
} config_reward_t;

typedef struct config_learner {
    int64_t steps;
    cfg_advantage_t advantage;
    cfg_loss_t loss;
    cfg_loss_agg_t loss_agg;
    double clip_low, clip_high;
    double kl_coef;
    cfg_kl_estimator_t kl_estimator;
    double entropy_coef;
    double lr;
    cfg_lr_schedule_t lr_schedule;
    int64_t warmup_steps;
    double min_lr_ratio;
    double weight_decay, beta1, beta2, adam_eps;
    double grad_clip; /* 0 = off */
    int ppo_epochs;
    int minibatches;
    int64_t micro_batch_tokens;
    int max_staleness;
    double tis_cap; /* 0 = off */
    bool dynamic_sampling;
    cfg_overlong_t overlong;
    int overlong_buffer;
    double mismatch_kl_max; /* 0 = off */
    int64_t checkpoint_every;
    int keep_checkpoints; /* 0 = keep all */
    int ranks;
    cfg_comm_t comm; /* the device path's MoE exchanges between ranks */
} config_learner_t;

typedef struct config_data {
    cfg_task_t task;
    char *path; /* the JSONL file when task is jsonl */
    int arith_min_digits, arith_max_digits; /* task arith: digits per operand */
    char *arith_ops;                        /* task arith: operators, a subset of "+-*" */
    int eval_size;
    bool shuffle;
    bool skip_malformed;
} config_data_t;

typedef struct config_transport {
    char *control, *work, *trajectories, *weights, *reward; /* endpoints */
    int64_t max_msg_bytes;
    int heartbeat_ms;
    int lease_timeout_ms;
    char *curve_secret_key, *curve_public_key, *curve_server_key; /* "" = none */
    bool allow_insecure_remote;
    char *curve_allowed_clients; /* file or directory of client public keys; "" = any */
    int learner_timeout_ms;      /* workers exit after this long without the learner; 0 = 10 beats */
} config_transport_t;

typedef struct config_metrics {
    int http_port; /* 0 = off */
    bool jsonl;
    bool status_line;
} config_metrics_t;

typedef struct moerl_config {
    config_run_t run;
    config_model_t model;
    config_lora_t lora;
    config_rollout_t rollout;
    config_reward_t reward;
    config_learner_t learner;
    config_data_t data;
    config_transport_t transport;
    config_metrics_t metrics;
} moerl_config_t;

/* Every error found while loading, one "origin: key: what" line each, in
 * the order found. */
typedef struct config_errors {
    char **items; /* (n) */
    int n, cap;
    int oom; /* an allocation failed while recording */
} config_errors_t;

/* Fills c with the defaults (any earlier contents are ignored, not freed). */
int config_defaults(moerl_config_t *c);
/* Defaults, then the file, then the cross-key checks. On MO_ECONFIG the
 * message lists the errors ("path:line: key: what"); c holds what could be
 * applied and must still be freed. */
int config_load_file(moerl_config_t *c, const char *path);
/* The same from text in memory; name stands for the file in messages. */
int config_load_string(moerl_config_t *c, const char *text, const char *name);
/* Defaults, the file (path may be NULL), the "key=value" overrides in order,
 * then the cross-key checks. errs (may be NULL) receives every error. */
int config_load(moerl_config_t *c, const char *path, const char *const *sets, int nsets,
                config_errors_t *errs);
void config_errors_free(config_errors_t *e);

/* Sets one key ("learner.lr") from text as given on a command line:
 * "1e-5", "true", "cosine"; lists as "a,b" or a YAML flow list "[a, b]";
 * strings verbatim. Range and type are checked; cross-key checks are not. */
int config_set(moerl_config_t *c, const char *key, const char *value);
/* The cross-key checks (distinct endpoints, group size for the advantage,
 * ...), for a config changed by config_set. */
int config_validate(const moerl_config_t *c);

/* Fully resolved YAML that config_load_string reads back to the same dump. */
void config_dump(const moerl_config_t *c, FILE *out);
/* The markdown reference of every section and key (docs/config.md). */
void config_doc_markdown(FILE *out);
void config_free(moerl_config_t *c);

/* runs/<run.name> when run.dir is empty, else run.dir. */
int config_run_dir(const moerl_config_t *c, char *buf, size_t cap);
/* True when lora.targets holds name. */
bool config_lora_has_target(const moerl_config_t *c, const char *name);

/* ---- The key table (core/config_schema.c) ---- */

typedef enum {
    CFG_BOOL,
    CFG_INT,      /* int or int64_t field (size says which), int64 bounds */
    CFG_FLOAT,    /* double field, double bounds, open or closed */
    CFG_STRING,   /* char * */
    CFG_PATH,     /* char *, a file or directory name */
    CFG_ENDPOINT, /* char *, tcp://HOST:PORT or ipc://PATH */
    CFG_ENUM,     /* int-sized enum field; value = index into choices */
    CFG_STRLIST,  /* cfg_strlist_t; elements from choices when it is set */
} cfg_type_t;

enum {
    CFG_MIN_OPEN = 1 << 0, /* CFG_FLOAT: the lower bound is excluded */
    CFG_MAX_OPEN = 1 << 1, /* CFG_FLOAT: the upper bound is excluded */
    CFG_NONEMPTY = 1 << 2, /* strings: "" is not allowed */
};

typedef struct cfg_key {
    const char *section; /* "learner" */
    const char *name;    /* "lr" */
    cfg_type_t type;
    size_t offset; /* of the field in moerl_config_t */
    size_t size;   /* of the field */
    int64_t imin, imax;
    double fmin, fmax;
    unsigned flags;
    const char *const *choices; /* NULL-terminated */
    const char *def;            /* the default, in config_set's syntax */
    const char *doc;            /* one line */
} cfg_key_t;

typedef struct cfg_section {
    const char *name;
    const char *doc;
} cfg_section_t;

extern const cfg_key_t cfg_keys[];
extern const int cfg_nkeys;
extern const cfg_section_t cfg_sections[];
extern const int cfg_nsections;
extern const char *const cfg_lora_targets[];

/* ---- Shared by config.c and config_yaml.c ---- */

/* The key named "section.name", or NULL. */
const cfg_key_t *cfg_find(const char *section, const char *name);
/* The closest known "section.key" (or section when key is NULL) within a
 * small edit distance, or NULL. */
const char *cfg_suggest(const char *section, const char *key, char *buf, size_t cap);
/* Assigns a scalar to a non-list key. quoted: the text was a quoted YAML
 * scalar (a null-looking quoted string stays a string). On a bad value
 * writes "expected ..., got ..." to why and returns MO_ECONFIG. */
int cfg_assign_scalar(moerl_config_t *c, const cfg_key_t *k, const char *text, bool quoted,
                      char *why, size_t cap);
/* Checks one list element against the key's choices (any text when the key
 * has none) and against the elements before it (prev (nprev)): no repeats. */
int cfg_check_element(const cfg_key_t *k, const char *text, char *const *prev, int nprev, char *why,
                      size_t cap);
/* Replaces a list key's value with a copy of items (n). */
int cfg_assign_list(moerl_config_t *c, const cfg_key_t *k, char **items, int n);
/* "expected ..." for a key, as used in messages and docs. */
void cfg_expected(const cfg_key_t *k, char *buf, size_t cap);
/* Parses a YAML flow list "[a, 'b c']" into heap strings (freed by the
 * caller with cfg_strings_free). */
int cfg_parse_flow_list(const char *text, char ***items, int *n, char *why, size_t cap);
void cfg_strings_free(char **items, int n);

/* Appends one formatted error; sets e->oom instead of failing. */
void cfg_error_add(config_errors_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Where each key's value came from, for messages of the cross-key checks:
 * lines[i] > 0 a line of file, 0 the default, -1 a --set override. */
typedef struct cfg_origin {
    const char *file; /* NULL when no file was read */
    int *lines;       /* (cfg_nkeys) or NULL: every value is unattributed */
} cfg_origin_t;
/* Applies a file's text (file names it in messages) onto c, recording
 * every error in errs and each key's line in org->lines. */
int cfg_apply_yaml(moerl_config_t *c, const char *text, size_t len, const char *file,
                   config_errors_t *errs, cfg_origin_t *org);
/* 0 when e holds no error; else MO_ECONFIG (MO_ENOMEM if recording failed)
 * with a message listing as many errors as fit. */
int cfg_errors_status(const config_errors_t *e);
/* The cross-key checks, reporting into errs with origins. */
void cfg_validate_into(const moerl_config_t *c, const cfg_origin_t *org, config_errors_t *errs);

#ifdef __cplusplus
}
#endif
#endif
