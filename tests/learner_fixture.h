/* learner_fixture: a tiny random MoE model in a temporary directory, a job config on
 * it, and synthetic scored groups, shared by the learner suites. */
#ifndef MOERL_TESTS_LEARNER_FIXTURE_H
#define MOERL_TESTS_LEARNER_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/config.h"
#include "core/rng.h"
#include "core/status.h"
#include "learner/sample.h"
#include "learner/trainer.h"
#include "tests/testutil.h"

typedef struct lf {
    char dir[512];       /* the temporary directory */
    char model_dir[600]; /* dir/model */
    char run_dir[600];   /* dir/run */
    moerl_config_t cfg;
} lf_t;

static inline void lf_set(lf_t *f, const char *key, const char *value) {
    int rc = config_set(&f->cfg, key, value);
    if (rc < 0)
        tu_report("config_set %s=%s: %s", key, value, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* A tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2, D 64) in f32, weights normal(0, 0.1),
 * and a config: LoRA rank 4 on attention and experts, lr 1e-2, micro-batches of 48
 * tokens, 2 minibatches, no overlong filter. */
static inline void lf_open(lf_t *f) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    snprintf(f->model_dir, sizeof f->model_dir, "%s/model", f->dir);
    snprintf(f->run_dir, sizeof f->run_dir, "%s/run", f->dir);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32), 0);
    init_model_opts_t io = {3, 0.1f};
    int rc = init_model_write(f->model_dir, &c, &io);
    if (rc < 0)
        tu_report("init model: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL_FATAL(config_defaults(&f->cfg), 0);
    lf_set(f, "model.path", f->model_dir);
    lf_set(f, "run.dir", f->run_dir);
    lf_set(f, "run.seed", "17");
    lf_set(f, "lora.rank", "4");
    lf_set(f, "lora.alpha", "8");
    lf_set(f, "lora.targets", "q_proj,k_proj,v_proj,o_proj,experts");
    lf_set(f, "learner.lr", "1e-2");
    lf_set(f, "learner.micro_batch_tokens", "48");
    lf_set(f, "learner.minibatches", "2");
    lf_set(f, "learner.max_staleness", "1000");
    lf_set(f, "learner.overlong", "keep");
    lf_set(f, "learner.tis_cap", "0");
    lf_set(f, "learner.steps", "20");
    lf_set(f, "rollout.temperature", "1");
    lf_set(f, "rollout.max_new_tokens", "16");
    lf_set(f, "model.routing_replay", "false");
}

static inline void lf_close(lf_t *f) {
    config_free(&f->cfg);
    tu_rmtree(f->dir);
}

static inline trainer_t *lf_trainer(lf_t *f) {
    trainer_t *t = NULL;
    int rc = trainer_new(&t, &f->cfg, NULL, NULL);
    if (rc < 0)
        tu_report("trainer_new: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return t;
}

/* The routing the model (with its bound adapter) takes on sample s of g, written into
 * the group: prompt rows (from sample 0) and the sample's rows. */
static inline void lf_record_routing(model_t *m, sample_group_t *g, int s) {
    int P = g->prompt_len, n = g->samples[s].n_tokens, T = P + n, M = m->n_moe, K = m->K;
    int32_t *tok = malloc(sizeof *tok * (size_t)T), *pos = malloc(sizeof *pos * (size_t)T);
    int32_t *tgt = malloc(sizeof *tgt * (size_t)T), cu[2] = {0, T};
    float *lp = malloc(sizeof *lp * (size_t)T);
    uint16_t *r = malloc(sizeof *r * (size_t)T * M * K);
    memcpy(tok, g->prompt, sizeof *tok * (size_t)P);
    memcpy(tok + P, g->samples[s].tokens, sizeof *tok * (size_t)n);
    model_batch_next_token(pos, tgt, tok, cu, 1);
    model_batch_t b = {T, 1, tok, pos, cu, tgt, 1.0f, NULL, r};
    CU_ASSERT_EQUAL_FATAL(model_forward(m, &b, lp, NULL, 0), 0);
    size_t row = (size_t)M * K;
    if (s == 0 && g->prompt_routing)
        memcpy(g->prompt_routing, r, sizeof *r * (size_t)P * row);
    if (g->samples[s].routing)
        memcpy(g->samples[s].routing, r + (size_t)P * row, sizeof *r * (size_t)n * row);
    free(tok);
    free(pos);
    free(tgt);
    free(lp);
    free(r);
}

/* A group of G samples of random tokens, rewards[s], sampled at `version`, rollout
 * logprobs equal to the trainer's current policy, routing recorded by the model when
 * with_routing. */
static inline sample_group_t *lf_group(trainer_t *t, uint64_t id, int G, const float *rewards,
                                       int64_t version, int with_routing) {
    int lens[16];
    CU_ASSERT_FATAL(G <= 16);
    for (int s = 0; s < G; s++)
        lens[s] = 3 + (int)((id * 7 + (uint64_t)s * 5) % 6);
    int P = 4 + (int)(id % 3);
    model_t *m = t->model;
    sample_group_t *g = NULL;
    CU_ASSERT_EQUAL_FATAL(
        sample_group_alloc(&g, id, P, lens, G, m->n_moe, m->K, with_routing, with_routing), 0);
    for (int i = 0; i < P; i++)
        g->prompt[i] = (int32_t)(rng_uniform(id, 1, (uint64_t)i) * 250.0f);
    for (int s = 0; s < G; s++) {
        sample_t *x = &g->samples[s];
        for (int i = 0; i < x->n_tokens; i++)
            x->tokens[i] = (int32_t)(rng_uniform(id, 2 + (uint64_t)s, (uint64_t)i) * 250.0f);
        x->finish = SAMPLE_FINISH_STOP_TOKEN;
        x->version_first = x->version_last = version;
        x->reward = rewards[s];
        x->reward_version = 1;
        for (int i = 0; i < x->n_tokens; i++)
            x->logprobs[i] = -1.0f;
    }
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(m, t->adapter), 0);
    for (int s = 0; s < G && with_routing; s++)
        lf_record_routing(m, g, s);
    for (int s = 0; s < G; s++) {
        int rc = trainer_sample_logprobs(t, g, s, g->samples[s].logprobs);
        if (rc < 0)
            tu_report("logprobs: %s", mo_last_error());
        CU_ASSERT_EQUAL_FATAL(rc, 0);
    }
    return g;
}

static inline void lf_free_groups(sample_group_t **g, int n) {
    for (int i = 0; i < n; i++)
        sample_group_destroy(&g[i]);
}

#endif
