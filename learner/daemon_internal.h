/* daemon_internal: the learner daemon's state, shared by learner/daemon.c (training,
 * weights, control, setup) and learner/daemon_work.c (workers, prompts, leases, scored
 * groups). Not a public interface. */
#ifndef MOERL_LEARNER_DAEMON_INTERNAL_H
#define MOERL_LEARNER_DAEMON_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/metrics.h"
#include "learner/checkpoint.h"
#include "learner/daemon.h"
#include "learner/dataset.h"
#include "learner/sample.h"
#include "learner/trainer.h"
#include "transport/loop.h"
#include "transport/msg.h"
#include "transport/weights.h"
#include "transport/zsock.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MAX_ATTEMPTS 3     /* a prompt failing generation or scoring this often is dropped */
#define LEARNER_TICK_MS 50 /* lease deadlines, liveness, work */
#define CHUNK_MAX ((uint64_t)16 << 20)

/* ---- State ---- */

typedef enum { G_PENDING = 0, G_LEASED } gstate_t;

/* A prompt handed out and not yet received: pending (waiting for credits) or leased. */
typedef struct group {
    uint64_t id;
    char prompt_id[32];
    char *prompt, *answer;
    msg_kv_t *extra; /* (n_extra), strings owned */
    uint32_t n_extra;
    gstate_t state;
    struct lease *lease;
    int attempts;
    struct group *next, *prev; /* every active group */
    struct group *qnext;       /* the pending queue */
} group_t;

typedef struct lease {
    uint64_t id;
    char worker[MSG_MAX_ID + 1];
    uint64_t deadline_ms;
    group_t **groups; /* (n) NULL once received */
    uint32_t n, remaining;
    struct lease *next;
} lease_t;

typedef struct peer {
    char id[MSG_MAX_ID + 1];
    msg_role_t role;
    zsock_peer_t route; /* on the control socket */
    zsock_peer_t work_route;
    bool has_work_route;
    uint64_t last_seen_ms;
    bool has_adapter, has_reward;
    uint64_t adapter_version, reward_version;
    double tps;
    uint32_t inflight, queue_depth, credits;
} peer_t;

/* The adapter version being served: its flat copy and chunks. */
typedef struct pubver {
    uint64_t version;
    float *flat; /* (n_params) */
    weights_split_t split;
    double t_publish;
    bool synced;
} pubver_t;

typedef enum { J_STEP = 0, J_CHECKPOINT } jkind_t;

typedef struct tjob {
    jkind_t kind;
    sample_group_t **groups; /* (n) J_STEP */
    int n;
    checkpoint_data_t data;
    bool has_reply; /* answer a ctl request when done */
    bool final;     /* the checkpoint of the stop path: finish when done */
    zsock_peer_t reply_to;
    /* results */
    int status;
    char error[1024];
    trainer_metrics_t tm;
    double *imbalance, *agreement; /* (M) copies */
    int M;
    float *params; /* (n_params) after a trained step */
    int64_t step, version;
    bool saved;
    int ckpt_status;
    char ckpt[64], ckpt_error[512];
} tjob_t;

typedef struct ids {
    int up, step, steps, version, reward_mean, reward_std, accuracy, loss, pg, kl, entropy, clip,
        clip_low, clip_high, grad_norm, lr, learner_tps, rollout_tps, step_s, staleness,
        staleness_max, sync_ms, agreement, mismatch, groups_rx, groups_trained, duplicates,
        stale_groups, stale_samples, unknown, failed, malformed, leases, expired, reissued,
        lost_workers, checkpoints, samples_trained, rollouts, rewards, pending, leased, waiting,
        paused, reward_version, swap_failures;
} ids_t;

typedef struct ld {
    const learner_daemon_opts_t *o;
    const moerl_config_t *cfg;
    char run_dir[4096];
    loop_t *loop;
    metrics_t *m;
    ids_t k;
    void *ctx, *control, *work, *sink, *weights;
    zsock_ctx_t zc; /* the context (zc.ctx == ctx), its options and ZAP allow-list */
    uint64_t refused_seen; /* CURVE clients refused, as last logged */
    int refused_id;        /* their counter */
    loop_worker_t *w;
    trainer_t *t; /* the worker thread's while it runs */
    int V, M, K, E;
    size_t n_params;
    msg_tensor_entry_t *table; /* (n_table) names point into the trainer's adapter */
    uint32_t n_table;
    msg_kv_t meta[4];
    char meta_val[4][256];
    uint64_t chunk_bytes;
    dataset_t *ds;
    uint64_t id_prefix, next_seq;
    uint8_t *done; /* bit per sequence number: received (or given up) */
    size_t done_bytes;
    group_t *active, *q_head, *q_tail;
    int n_pending, n_leased;
    lease_t *leases;
    uint64_t next_lease;
    peer_t *peers;
    int n_peers, cap_peers, rr;
    sample_group_t **waiting; /* (n_waiting) received, not yet trained */
    int n_waiting, cap_waiting, n_training;
    bool training, stop_ckpt, paused, stopping, hard_exit, finishing;
    int64_t step, version, ckpt_step;
    pubver_t pub;
    uint64_t reward_version;
    char *reward_function, *reward_plugin;
    char last_swap_error[512];
    int fail_rc;
    char fail_msg[1024];
} ld_t;

/* ---- Shared by daemon.c and daemon_work.c ---- */

char *ld_dup_str(const char *s);
/* Sends m (to: the peer on a ROUTER); logs failures other than a departed peer. */
int ld_send_to(ld_t *d, void *sock, const zsock_peer_t *to, const msg_t *m);
void ld_send_error(ld_t *d, void *sock, const zsock_peer_t *to, int code, const char *message,
                   const char *about, bool has_id, uint64_t id);
peer_t *ld_find_peer(ld_t *d, const char *id);
peer_t *ld_add_peer(ld_t *d, const char *id, msg_role_t role);
/* Worker counts and the rollout throughput gauges. */
void ld_count_peers(ld_t *d);
group_t *ld_find_group(ld_t *d, uint64_t id);
void ld_group_free(group_t *g);
void ld_lease_unlink(ld_t *d, lease_t *l);
/* A worker reported that g could not be generated or scored: hand it out again, or
 * drop it after MAX_ATTEMPTS. */
void ld_attempt_failed(ld_t *d, group_t *g, const char *why);
/* Hands out again the prompts leased to worker, or (worker NULL) of leases past their
 * deadline. */
void ld_reclaim(ld_t *d, const char *worker, uint64_t now);
/* Tops up the pending prompts to the window and leases them against credits. */
void ld_serve_work(ld_t *d);
/* A scored group from the trajectory sink. */
void ld_on_trajectory(ld_t *d, const msg_trajectory_group_t *tg);
/* 1 when no sample of g may be trained at the current policy version. */
int ld_group_stale(const ld_t *d, const sample_group_t *g);
/* Starts a step when prompts_per_step fresh groups wait and nothing else runs. */
void ld_maybe_step(ld_t *d);

#ifdef __cplusplus
}
#endif
#endif
