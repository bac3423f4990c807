/* ep_learner: the expert-parallel learner job under mpirun: rank 0 runs the learner
 * daemon and leads (the ep_lead_* calls tell the other ranks what comes before each
 * collective trainer call), the other ranks follow (ep_follow) until rank 0 stops them. */
#ifndef MOERL_LEARNER_EP_LEARNER_H
#define MOERL_LEARNER_EP_LEARNER_H

#include <stddef.h>
#include <stdint.h>

#include "core/comm.h"
#include "learner/checkpoint.h"
#include "learner/sample.h"
#include "learner/trainer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Protocol (host broadcasts from rank 0 over the trainer's communicator): a command
 * header of 4 int64 {command, a, b, c}, then the command's payload, then the collective
 * trainer call itself on every rank:
 *   EP_CMD_STEP    a groups, b payload bytes: the groups (ep_groups_pack), trainer_step;
 *                  when the step trained, trainer_whole_adapter (the version rank 0
 *                  publishes)
 *   EP_CMD_WHOLE   trainer_whole_adapter
 *   EP_CMD_SAVE    checkpoint_save_trainer (rank 0 writes)
 *   EP_CMD_RESUME  a allow_config_change, b run directory bytes, then the directory:
 *                  checkpoint_resume_trainer
 *   EP_CMD_STOP    a 0: the followers return MO_OK; a 1: rank 0 failed, they return an
 *                  error
 * Without a communicator (one rank) each ep_lead_* call is the plain trainer call. */
typedef enum {
    EP_CMD_STOP = 0,
    EP_CMD_STEP,
    EP_CMD_WHOLE,
    EP_CMD_SAVE,
    EP_CMD_RESUME,
} ep_cmd_t;

/* Groups <-> a flat byte buffer (every field trainer_step reads). ep_groups_pack: *buf
 * malloc'd (free()), *len its bytes. ep_groups_unpack: *out (n) malloc'd groups, freed
 * with ep_groups_free; MO_EMALFORMED when the buffer does not hold n groups. */
int ep_groups_pack(const sample_group_t *const *g, int n, uint8_t **buf, size_t *len);
int ep_groups_unpack(const uint8_t *buf, size_t len, int n, sample_group_t ***out);
void ep_groups_free(sample_group_t **g, int n);

/* Rank 0's side. */
int ep_lead_step(trainer_t *t, const sample_group_t *const *groups, int n, trainer_metrics_t *m);
/* The whole adapter (rank 0); logs the expert placement the first time. */
int ep_lead_whole(trainer_t *t, const lora_adapter_t **out);
/* The parameters of the whole adapter as of the last ep_lead_step or ep_lead_whole. */
const float *ep_lead_params(const trainer_t *t);
int ep_lead_save(trainer_t *t, const char *run_dir, const checkpoint_data_t *data,
                 const checkpoint_save_opts_t *opts, char *name, size_t cap);
int ep_lead_resume(trainer_t *t, const char *run_dir, int allow_config_change,
                   checkpoint_data_t *data, char *name, size_t cap, int *fell_back);
/* Ends the followers' loop: failed 0 (clean) or 1. MO_ESTATE, sending nothing, when an
 * ep_lead_* call failed part-way through its collectives (the other ranks may be inside
 * one; the job must end without finalising the communicator). */
int ep_lead_stop(comm_t *cm, int failed);

/* Followers (ranks 1 .. N - 1): runs commands on t until EP_CMD_STOP. MO_OK on a clean
 * stop; an error when a command fails here or rank 0 reports a failure. */
int ep_follow(trainer_t *t);

/* One line describing this rank's share: ranks, experts held, expert weight bytes held
 * and of the whole model, adapter parameters held. */
void ep_describe(const trainer_t *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
