/* checkpoint: crash-safe learner checkpoints (adapter, optimizer, learner state) in
 * <run>/checkpoints/step-NNNNNN/, the `latest` pointer, validated resume and retention. */
#ifndef MOERL_LEARNER_CHECKPOINT_H
#define MOERL_LEARNER_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "learner/optim.h"
#include "learner/trainer.h"
#include "lora/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Layout of a run directory:
 *
 *   <run>/checkpoints/
 *     step-000123/
 *       adapter/adapter_config.json        PEFT adapter (peft_save, F32)
 *       adapter/adapter_model.safetensors
 *       optimizer.bin                      AdamW state (optim_save)
 *       learner_state.json                 written last; see checkpoint_state_t
 *     latest                               "step-000123\n"
 *
 * Saving writes everything into "checkpoints/.tmp-step-000123-<pid>", fsyncs every file
 * and the directory, renames it to step-000123, fsyncs checkpoints/, and only then
 * replaces `latest` atomically (temporary file, fsync, rename, fsync). A crash at any
 * moment leaves `latest` naming a complete checkpoint (or absent before the first).
 * learner_state.json records the size and XXH64 of every other file, so a damaged
 * directory is refused whole. */

#define CKPT_DIR_NAME "checkpoints"
#define CKPT_LATEST_NAME "latest"
#define CKPT_ADAPTER_DIR "adapter"
#define CKPT_OPTIM_NAME "optimizer.bin"
#define CKPT_STATE_NAME "learner_state.json"
#define CKPT_FORMAT 1

/* What learner_state.json holds besides the file list. */
typedef struct checkpoint_state {
    int64_t step;              /* learner steps done */
    int64_t version;           /* policy version */
    uint64_t seed;             /* run.seed */
    uint64_t rng_counter;      /* the trainer's permutations drawn */
    uint64_t data_epoch;       /* dataset cursor: the next prompt is position data_pos */
    uint64_t data_pos;         /*   of epoch data_epoch (dataset_tell) */
    uint64_t data_fingerprint; /* dataset_fingerprint, 0 when unknown */
    int64_t reward_version;    /* newest reward version trained on */
    uint64_t config_hash;      /* trainer_config_hash */
    uint64_t adapter_checksum; /* lora_adapter_checksum of the saved adapter */
} checkpoint_state_t;

/* Test hook: stop a save part-way, as a crash would (the call then returns MO_EIO
 * naming the stage). */
typedef enum {
    CKPT_CRASH_NONE = 0,
    CKPT_CRASH_BEFORE_RENAME, /* the temporary directory is complete, not renamed */
    CKPT_CRASH_BEFORE_LATEST, /* the step directory is in place, `latest` not updated */
} checkpoint_crash_t;

typedef struct checkpoint_save_opts {
    int keep;               /* newest step directories kept after the save; 0 keeps all */
    const char *base_model; /* recorded in adapter_config.json, or NULL */
    int crash;              /* checkpoint_crash_t; CKPT_CRASH_NONE outside tests */
} checkpoint_save_opts_t;

/* "step-000123" for step 123 (at least six digits). */
void checkpoint_step_name(char *buf, size_t cap, int64_t step);

/* Saves step st->step of a run: creates <run>/checkpoints (and <run>) when missing,
 * removes temporary directories left by earlier crashed saves, writes as described
 * above, then applies retention. A step directory that already exists is replaced.
 * name (cap bytes, may be NULL) receives the step directory's name. opts may be NULL
 * (keep all). */
int checkpoint_save(const char *run_dir, const lora_adapter_t *ad, const optim_t *o,
                    const checkpoint_state_t *st, const checkpoint_save_opts_t *opts, char *name,
                    size_t cap);

/* The step directory `latest` names. MO_ENOTFOUND when there is none, MO_EMALFORMED when
 * it does not hold a step directory's name. */
int checkpoint_latest(const char *run_dir, char *name, size_t cap);

/* Step numbers of the complete-looking step directories, ascending: *steps malloc'd
 * (free()), *n may be 0. */
int checkpoint_list(const char *run_dir, int64_t **steps, int *n);

/* Reads and validates one step directory's learner_state.json (format, fields, the
 * listed files' sizes and hashes) without loading anything. */
int checkpoint_read_state(const char *step_dir, checkpoint_state_t *st);

/* Loads a step directory into ad and o after validating everything (learner state, file
 * hashes, the adapter's shapes and checksum, the optimizer file); on failure neither ad
 * nor o changes. */
int checkpoint_load_dir(const char *step_dir, lora_adapter_t *ad, optim_t *o,
                        checkpoint_state_t *st);

/* Loads the checkpoint `latest` names; when `latest` is missing or damaged, or its
 * checkpoint fails validation, the newest step directory that loads is used instead and
 * *fell_back (may be NULL) is set to 1. MO_ENOTFOUND when the run has no checkpoint;
 * otherwise the first failure when none loads. name receives the directory used. */
int checkpoint_load(const char *run_dir, lora_adapter_t *ad, optim_t *o, checkpoint_state_t *st,
                    char *name, size_t cap, int *fell_back);

/* Removes all but the newest `keep` step directories (never the one `latest` names);
 * keep 0 removes nothing. Returns the number removed. */
int checkpoint_prune(const char *run_dir, int keep);

/* ---- The trainer --------------------------------------------------------- */

/* Where the prompt stream stands, saved beside the trainer's state. */
typedef struct checkpoint_data {
    uint64_t epoch, pos;  /* dataset_tell */
    uint64_t fingerprint; /* dataset_fingerprint */
} checkpoint_data_t;

/* 1 when step is a multiple of every (every > 0). */
int checkpoint_due(const trainer_t *t, int64_t every);

/* Saves the trainer's adapter, optimizer and counters (data may be NULL: zeros). With
 * expert parallelism (trainer_t.comm) this is collective: the whole adapter and AdamW
 * state are gathered on rank 0, which writes them in the single-rank layout; every rank
 * returns rank 0's outcome (name is filled on rank 0). */
int checkpoint_save_trainer(const trainer_t *t, const char *run_dir, const checkpoint_data_t *data,
                            const checkpoint_save_opts_t *opts, char *name, size_t cap);

/* Resumes a trainer from its run's checkpoint (checkpoint_load): adapter, optimizer,
 * step, version, RNG counter and reward version. A checkpoint saved under another
 * run.seed or config hash is refused (MO_ECONFIG naming both values) unless
 * allow_config_change. data (may be NULL) receives the saved cursor. Nothing changes on
 * failure. With expert parallelism this is collective: every rank reads the whole
 * checkpoint (the run directory must be visible to all) and keeps its shard, so a
 * checkpoint resumes under any rank count that divides E; it fails on every rank when it
 * fails on one. */
int checkpoint_resume_trainer(trainer_t *t, const char *run_dir, int allow_config_change,
                              checkpoint_data_t *data, char *name, size_t cap, int *fell_back);

#ifdef __cplusplus
}
#endif
#endif
