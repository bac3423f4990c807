/* test_trainer: one RL step on a tiny random MoE model: updates, the loss going down on
 * a fixed batch, staleness and flat-group filters, non-finite skips, micro-batching,
 * single-thread determinism, routing agreement, the mismatch gate, and run.device cuda
 * refused without the CUDA backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "tests/learner_fixture.h"

static const float k_rewards[4][4] = {
    {1, 0, 0, 1}, {0, 0, 1, 0}, {1, 1, 0, 0.5f}, {0.2f, 0.9f, 0.4f, 0}};

/* Four groups of four samples at version 0. */
static void make_batch(trainer_t *t, sample_group_t **g, int with_routing) {
    for (int i = 0; i < 4; i++)
        g[i] = lf_group(t, 10 + (uint64_t)i, 4, k_rewards[i], 0, with_routing);
}

static float *copy_params(const trainer_t *t) {
    float *p = malloc(sizeof *p * t->adapter->n_params);
    memcpy(p, t->adapter->params, sizeof *p * t->adapter->n_params);
    return p;
}

static int params_equal(const trainer_t *t, const float *p) {
    return memcmp(p, t->adapter->params, sizeof *p * t->adapter->n_params) == 0;
}

static int step(trainer_t *t, sample_group_t **g, int n, trainer_metrics_t *m) {
    int rc = trainer_step(t, (const sample_group_t *const *)g, n, m);
    if (rc < 0)
        tu_report("trainer_step: %s", mo_last_error());
    return rc;
}

static void test_step_updates(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[4];
    make_batch(t, g, 0);
    float *before = copy_params(t);
    trainer_metrics_t m;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
    CU_ASSERT_EQUAL(m.trained, 1);
    CU_ASSERT_EQUAL(m.updates, 2); /* two minibatches */
    CU_ASSERT_EQUAL(m.skipped_updates, 0);
    CU_ASSERT_EQUAL(m.step, 1);
    CU_ASSERT_EQUAL(m.version, 1);
    CU_ASSERT_EQUAL(m.groups, 4);
    CU_ASSERT_EQUAL(m.samples, 16);
    CU_ASSERT_EQUAL(m.trained_samples, 16);
    CU_ASSERT(m.micro_batches > 2); /* 48-token micro-batches */
    CU_ASSERT(!params_equal(t, before));
    CU_ASSERT(m.grad_norm > 0 && isfinite(m.grad_norm));
    CU_ASSERT(m.lr > 0);
    /* Rollout logprobs are the policy's own: no mismatch, ratio 1 on the first update. */
    CU_ASSERT(fabs(m.mismatch_k3) < 1e-6);
    CU_ASSERT(fabs(m.mismatch_k1) < 1e-4);
    CU_ASSERT(m.entropy_old > 0);
    CU_ASSERT(m.reward_mean > 0.3 && m.reward_mean < 0.6);
    CU_ASSERT_EQUAL(m.M, 2);
    for (int l = 0; l < m.M; l++) {
        CU_ASSERT(m.expert_imbalance[l] >= 1.0);
        CU_ASSERT(m.routing_agreement[l] == -1.0); /* nothing recorded */
    }
    CU_ASSERT(m.tokens_per_s > 0);
    lf_free_groups(g, 4);
    free(before);
    trainer_destroy(&t);
    lf_close(&f);
}

/* -sum_i A_i * mean_t logp_it / n: the REINFORCE surrogate of the batch. */
static double surrogate(trainer_t *t, sample_group_t **g, int n) {
    double L = 0;
    for (int i = 0; i < n; i++) {
        double mean = 0;
        for (int s = 0; s < g[i]->n_samples; s++)
            mean += g[i]->samples[s].reward / g[i]->n_samples;
        for (int s = 0; s < g[i]->n_samples; s++) {
            const sample_t *x = &g[i]->samples[s];
            float lp[32];
            CU_ASSERT_EQUAL_FATAL(trainer_sample_logprobs(t, g[i], s, lp), 0);
            double sum = 0;
            for (int k = 0; k < x->n_tokens; k++)
                sum += lp[k];
            L -= (x->reward - mean) * sum / x->n_tokens;
        }
    }
    return L;
}

/* lora.train_router and lora.train_norms: the routers and norms join the flat buffer
 * after the LoRA tensors, start at the model's values, and one step moves every one. */
static void test_full_tensors_move(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "lora.train_router", "true");
    lf_set(&f, "lora.train_norms", "true");
    trainer_t *t = lf_trainer(&f);
    const lora_adapter_t *ad = t->adapter;
    model_t *m = t->model;
    int want = 1;
    for (int l = 0; l < m->L; l++)
        want += 2 + (m->layers[l].q_norm ? 2 : 0) + m->layers[l].moe;
    CU_ASSERT_EQUAL_FATAL(ad->n_full, want);
    int t0 = ad->n_tensors - ad->n_full;
    CU_ASSERT(t0 == 2 * ad->n_entries);
    int rt = lora_adapter_find_full(ad, "model.layers.1.mlp.gate.weight");
    CU_ASSERT_FATAL(rt >= 0);
    CU_ASSERT(m->layers[1].moe_w.router.data == ad->params + ad->tensors[rt].offset);
    CU_ASSERT(m->layers[1].moe_w.drouter == ad->grads + ad->tensors[rt].offset);
    CU_ASSERT(m->final_norm == ad->params + ad->tensors[ad->n_tensors - 1].offset);
    sample_group_t *g[4];
    make_batch(t, g, 0);
    float *before = copy_params(t);
    trainer_metrics_t mt;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &mt), 0);
    CU_ASSERT_EQUAL(mt.updates, 2);
    CU_ASSERT(mt.grad_norm > 0 && isfinite(mt.grad_norm));
    for (int i = t0; i < ad->n_tensors; i++) {
        const lora_tensor_t *lt = &ad->tensors[i];
        int moved =
            memcmp(before + lt->offset, ad->params + lt->offset, sizeof(float) * lt->numel) != 0;
        if (!moved)
            tu_report("%s did not move", lt->name);
        CU_ASSERT(moved);
    }
    free(before);
    lf_free_groups(g, 4);
    trainer_destroy(&t);
    lf_close(&f);
}

/* learner.weight_decay spares the norm vectors: one update with weight decay moves every
 * trained norm exactly as the same update without it, while the routers and the LoRA A
 * matrices decay. */
static void test_norms_no_decay(void) {
    trainer_t *t[2];
    lf_t f[2];
    float *after[2];
    for (int k = 0; k < 2; k++) {
        lf_open(&f[k]);
        lf_set(&f[k], "lora.train_router", "true");
        lf_set(&f[k], "lora.train_norms", "true");
        lf_set(&f[k], "learner.minibatches", "1");
        lf_set(&f[k], "learner.weight_decay", k ? "0.5" : "0");
        t[k] = lf_trainer(&f[k]);
        sample_group_t *g[4];
        make_batch(t[k], g, 0);
        trainer_metrics_t mt;
        CU_ASSERT_EQUAL_FATAL(step(t[k], g, 4, &mt), 0);
        CU_ASSERT_EQUAL(mt.updates, 1);
        after[k] = copy_params(t[k]);
        lf_free_groups(g, 4);
    }
    const lora_adapter_t *ad = t[1]->adapter;
    int norms = 0;
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *lt = &ad->tensors[i];
        int same =
            memcmp(after[0] + lt->offset, after[1] + lt->offset, sizeof(float) * lt->numel) == 0;
        int is_norm = i >= ad->n_tensors - ad->n_full && lt->shape[1] == 1;
        int lora_b = i < 2 * ad->n_entries && i % 2 == 1; /* B starts at 0: nothing to decay */
        norms += is_norm;
        if (is_norm != same && !lora_b)
            tu_report("%s: %s", lt->name, same ? "not decayed" : "decayed");
        if (!lora_b)
            CU_ASSERT(is_norm == same);
    }
    CU_ASSERT(norms == t[1]->optim.n_nd && norms > 0);
    for (int k = 0; k < 2; k++) {
        free(after[k]);
        trainer_destroy(&t[k]);
        lf_close(&f[k]);
    }
}

static void test_loss_decreases(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.lr", "5e-3");
    lf_set(&f, "learner.minibatches", "1");
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[4];
    make_batch(t, g, 0);
    double L0 = surrogate(t, g, 4), prev = L0;
    for (int k = 0; k < 5; k++) {
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
        CU_ASSERT_EQUAL(m.updates, 1);
        double L = surrogate(t, g, 4);
        if (!(L < prev))
            tu_report("step %d: surrogate %g did not fall below %g", k, L, prev);
        CU_ASSERT(L < prev);
        prev = L;
    }
    CU_ASSERT(prev < L0 - 0.1);
    lf_free_groups(g, 4);
    trainer_destroy(&t);
    lf_close(&f);
}

static void test_staleness(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.max_staleness", "1");
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[4];
    make_batch(t, g, 0);
    trainer_metrics_t m;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0); /* version 0 -> 1 */
    CU_ASSERT_EQUAL(m.stale_samples, 0);
    CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0); /* lag 1: still fine */
    CU_ASSERT_EQUAL(m.stale_samples, 0);
    CU_ASSERT_EQUAL(m.staleness_max, 1);
    /* lag 2 for the old groups; one group refreshed to the current version. */
    for (int s = 0; s < 4; s++)
        g[3]->samples[s].version_first = g[3]->samples[s].version_last = t->version;
    g[3]->samples[1].version_first = g[3]->samples[1].version_last = t->version + 1; /* ahead */
    CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
    CU_ASSERT_EQUAL(m.stale_samples, 12 + 1);
    CU_ASSERT_EQUAL(m.trained_samples, 3);
    CU_ASSERT_EQUAL(m.staleness_max, 0);
    /* Every sample stale: nothing trains, nothing changes. */
    float *before = copy_params(t);
    int64_t v = t->version, st = t->step;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 3, &m), 0);
    CU_ASSERT_EQUAL(m.trained, 0);
    CU_ASSERT_EQUAL(t->version, v);
    CU_ASSERT_EQUAL(t->step, st);
    CU_ASSERT(params_equal(t, before));
    free(before);
    lf_free_groups(g, 4);
    trainer_destroy(&t);
    lf_close(&f);
}

static void test_flat_groups(void) {
    static const float flat[4] = {1, 1, 1, 1};
    for (int dyn = 0; dyn < 2; dyn++) {
        lf_t f;
        lf_open(&f);
        lf_set(&f, "learner.dynamic_sampling", dyn ? "true" : "false");
        trainer_t *t = lf_trainer(&f);
        sample_group_t *g[3];
        g[0] = lf_group(t, 1, 4, k_rewards[0], 0, 0);
        g[1] = lf_group(t, 2, 4, flat, 0, 0);
        g[2] = lf_group(t, 3, 4, k_rewards[1], 0, 0);
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(step(t, g, 3, &m), 0);
        CU_ASSERT_EQUAL(m.flat_groups, 1);
        CU_ASSERT_EQUAL(m.skipped_groups, dyn ? 1 : 0);
        CU_ASSERT_EQUAL(m.trained_samples, dyn ? 8 : 12);
        /* Only flat groups with dynamic sampling: nothing to train. */
        float *before = copy_params(t);
        CU_ASSERT_EQUAL_FATAL(step(t, g + 1, 1, &m), 0);
        CU_ASSERT_EQUAL(m.trained, !dyn);
        if (dyn)
            CU_ASSERT(params_equal(t, before));
        free(before);
        lf_free_groups(g, 3);
        trainer_destroy(&t);
        lf_close(&f);
    }
}

static void test_nonfinite(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f), *t2 = lf_trainer(&f);
    sample_group_t *g[2], *g2[1];
    g[0] = lf_group(t, 5, 4, k_rewards[0], 0, 0);
    g[1] = lf_group(t, 6, 4, k_rewards[1], 0, 0);
    CU_ASSERT_EQUAL_FATAL(sample_group_copy(&g2[0], g[0]), 0);
    g[1]->samples[2].reward = NAN;
    /* A NaN reward drops its group (counted); the rest trains exactly as alone. */
    trainer_metrics_t m, m2;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 2, &m), 0);
    CU_ASSERT_EQUAL_FATAL(step(t2, g2, 1, &m2), 0);
    CU_ASSERT_EQUAL(m.malformed_groups, 1);
    CU_ASSERT(strstr(m.note, "reward") != NULL);
    CU_ASSERT_EQUAL(m.trained_samples, 4);
    CU_ASSERT(params_equal(t, t2->adapter->params));
    /* Only the NaN group: skipped, weights bit-identical. */
    float *before = copy_params(t);
    int64_t v = t->version;
    CU_ASSERT_EQUAL_FATAL(step(t, g + 1, 1, &m), 0);
    CU_ASSERT_EQUAL(m.trained, 0);
    CU_ASSERT_EQUAL(t->version, v);
    CU_ASSERT(params_equal(t, before));
    /* A huge adapter weight makes the forward non-finite: the update is skipped and the
     * weights and optimizer state stay bit-identical. */
    size_t ib = t->adapter->tensors[1].offset; /* the first B */
    t->adapter->params[ib] = 3e38f;
    t->adapter->params[ib + 1] = -3e38f;
    memcpy(before, t->adapter->params, sizeof *before * t->adapter->n_params);
    size_t n = t->optim.n;
    float *mom = malloc(sizeof *mom * 2 * n);
    memcpy(mom, t->optim.m, sizeof *mom * n);
    memcpy(mom + n, t->optim.v, sizeof *mom * n);
    int64_t skipped = t->optim.skipped;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 1, &m), 0);
    CU_ASSERT_EQUAL(m.trained, 1);
    CU_ASSERT_EQUAL(m.updates, 0);
    CU_ASSERT_EQUAL(m.skipped_updates, 2);
    CU_ASSERT_EQUAL(t->optim.skipped, skipped + 2);
    CU_ASSERT_EQUAL(t->version, v);
    CU_ASSERT(params_equal(t, before));
    CU_ASSERT(memcmp(mom, t->optim.m, sizeof *mom * n) == 0);
    CU_ASSERT(memcmp(mom + n, t->optim.v, sizeof *mom * n) == 0);
    free(mom);
    free(before);
    lf_free_groups(g, 2);
    lf_free_groups(g2, 1);
    trainer_destroy(&t);
    trainer_destroy(&t2);
    lf_close(&f);
}

/* Huge opposite advantages (REINFORCE on rewards of +-3e38) overflow the backward: a
 * non-finite gradient with a finite loss, skipped. */
static void test_nonfinite_grad(void) {
    static const float huge[4] = {3e38f, -3e38f, 3e38f, -3e38f};
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.advantage", "reinforce");
    lf_set(&f, "learner.minibatches", "1");
    lf_set(&f, "learner.loss_agg", "seq-mean-token-sum");
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[1];
    g[0] = lf_group(t, 9, 4, huge, 0, 0);
    float *before = copy_params(t);
    trainer_metrics_t m;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 1, &m), 0);
    CU_ASSERT_EQUAL(m.trained, 1);
    CU_ASSERT_EQUAL(m.updates, 0);
    CU_ASSERT_EQUAL(m.skipped_updates, 1);
    CU_ASSERT_EQUAL(m.last_skip, OPTIM_SKIP_GRAD); /* the loss itself is finite */
    CU_ASSERT(isfinite(m.loss));
    CU_ASSERT(params_equal(t, before));
    CU_ASSERT_EQUAL(t->version, 0);
    free(before);
    lf_free_groups(g, 1);
    trainer_destroy(&t);
    lf_close(&f);
}

/* The micro-batch size changes only rounding: one update with 48-token micro-batches
 * equals one with a single micro-batch. */
static void test_micro_batches(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.minibatches", "1");
    lf_set(&f, "learner.lr", "1e-3");
    trainer_t *a = lf_trainer(&f);
    lf_set(&f, "learner.micro_batch_tokens", "100000");
    trainer_t *b = lf_trainer(&f);
    sample_group_t *g[4];
    make_batch(a, g, 0);
    trainer_metrics_t ma, mb;
    CU_ASSERT_EQUAL_FATAL(step(a, g, 4, &ma), 0);
    CU_ASSERT_EQUAL_FATAL(step(b, g, 4, &mb), 0);
    CU_ASSERT(ma.micro_batches > 1);
    CU_ASSERT_EQUAL(mb.micro_batches, 1);
    CU_ASSERT(fabs(ma.grad_norm - mb.grad_norm) <= 1e-4 * mb.grad_norm);
    TU_ASSERT_CLOSE(
        tu_rel_err_ff(a->adapter->params, b->adapter->params, a->adapter->n_params, 1e-3), 1e-4,
        "params, micro-batched vs one batch");
    lf_free_groups(g, 4);
    trainer_destroy(&a);
    trainer_destroy(&b);
    lf_close(&f);
}

static void run_three_steps(lf_t *f, float **params, float **mom) {
    trainer_t *t = lf_trainer(f);
    sample_group_t *g[4];
    make_batch(t, g, 1);
    for (int k = 0; k < 3; k++) {
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
    }
    *params = copy_params(t);
    *mom = malloc(sizeof **mom * 2 * t->optim.n);
    memcpy(*mom, t->optim.m, sizeof **mom * t->optim.n);
    memcpy(*mom + t->optim.n, t->optim.v, sizeof **mom * t->optim.n);
    lf_free_groups(g, 4);
    trainer_destroy(&t);
}

static void test_determinism(void) {
    int threads = backend_cpu_threads();
    backend_cpu_set_threads(1);
    lf_t f;
    lf_open(&f);
    lf_set(&f, "model.routing_replay", "true");
    lf_set(&f, "learner.ppo_epochs", "2");
    lf_set(&f, "learner.kl_coef", "0.1");
    lf_set(&f, "learner.entropy_coef", "0.01");
    float *p1, *p2, *m1, *m2;
    run_three_steps(&f, &p1, &m1);
    run_three_steps(&f, &p2, &m2);
    trainer_t *t = lf_trainer(&f);
    size_t n = t->adapter->n_params;
    trainer_destroy(&t);
    CU_ASSERT(memcmp(p1, p2, sizeof *p1 * n) == 0);
    CU_ASSERT(memcmp(m1, m2, sizeof *m1 * 2 * n) == 0);
    free(p1);
    free(p2);
    free(m1);
    free(m2);
    lf_close(&f);
    backend_cpu_set_threads(threads);
}

static void test_routing_agreement(void) {
    for (int replay = 0; replay < 2; replay++) {
        lf_t f;
        lf_open(&f);
        lf_set(&f, "model.routing_replay", replay ? "true" : "false");
        trainer_t *t = lf_trainer(&f);
        sample_group_t *g[4];
        make_batch(t, g, 1);
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
        CU_ASSERT(m.routed_tokens > 0);
        for (int l = 0; l < m.M; l++) {
            if (m.routing_agreement[l] != 1.0)
                tu_report("replay %d layer %d: agreement %g", replay, l, m.routing_agreement[l]);
            CU_ASSERT(m.routing_agreement[l] == 1.0);
        }
        CU_ASSERT(m.routing_agreement_mean == 1.0);
        /* Shift the recorded experts of layer 1: agreement falls there only. */
        for (int i = 0; i < 4; i++)
            for (int s = 0; s < 4; s++) {
                sample_t *x = &g[i]->samples[s];
                for (int k = 0; k < x->n_tokens; k++) {
                    uint16_t *r = x->routing + ((size_t)k * 2 + 1) * 2;
                    r[0] = (uint16_t)((r[0] + 1) % 8);
                    r[1] = (uint16_t)((r[1] + 1) % 8);
                    if (r[0] == r[1])
                        r[1] = (uint16_t)((r[1] + 1) % 8);
                }
            }
        trainer_t *t2 = lf_trainer(&f); /* the policy that recorded them */
        CU_ASSERT_EQUAL_FATAL(step(t2, g, 4, &m), 0);
        CU_ASSERT(m.routing_agreement[0] == 1.0);
        CU_ASSERT(m.routing_agreement[1] < 0.8);
        lf_free_groups(g, 4);
        trainer_destroy(&t);
        trainer_destroy(&t2);
        lf_close(&f);
    }
}

static void test_mismatch(void) {
    for (int gate = 0; gate < 2; gate++) {
        lf_t f;
        lf_open(&f);
        lf_set(&f, "learner.mismatch_kl_max", "0.02");
        trainer_opts_t o = trainer_opts_default();
        o.mismatch_mode = gate ? TRAINER_MISMATCH_REFUSE_BATCH : TRAINER_MISMATCH_DROP_SAMPLES;
        trainer_t *t = NULL;
        CU_ASSERT_EQUAL_FATAL(trainer_new(&t, &f.cfg, NULL, &o), 0);
        sample_group_t *g[4];
        make_batch(t, g, 0);
        /* Sample 1 of group 0 drifts far from the learner: k3 of a 1-nat shift = 0.72. */
        for (int k = 0; k < g[0]->samples[1].n_tokens; k++)
            g[0]->samples[1].logprobs[k] -= 1.0f;
        float *before = copy_params(t);
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(step(t, g, 4, &m), 0);
        CU_ASSERT(m.mismatch_k3_max > 0.5);
        CU_ASSERT(m.mismatch_k3 > 0.02 && m.mismatch_k3 < 0.2);
        if (gate) {
            CU_ASSERT_EQUAL(m.refused, 1);
            CU_ASSERT_EQUAL(m.trained, 0);
            CU_ASSERT(strstr(m.note, "mismatch_kl_max") != NULL);
            CU_ASSERT(params_equal(t, before));
        } else {
            CU_ASSERT_EQUAL(m.refused, 0);
            CU_ASSERT_EQUAL(m.mismatch_dropped, 1);
            CU_ASSERT_EQUAL(m.trained_samples, 15);
        }
        free(before);
        lf_free_groups(g, 4);
        trainer_destroy(&t);
        lf_close(&f);
    }
}

static void test_malformed(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[4];
    make_batch(t, g, 0);
    g[1]->samples[0].tokens[0] = 9999;
    trainer_metrics_t m;
    CU_ASSERT_EQUAL_FATAL(step(t, g, 2, &m), 0);
    CU_ASSERT_EQUAL(m.malformed_groups, 1);
    CU_ASSERT(strstr(m.note, "9999") != NULL);
    CU_ASSERT_EQUAL(m.trained_samples, 4);
    lf_free_groups(g, 4);
    trainer_destroy(&t);
    lf_close(&f);
}

/* run.device cuda in a build without the CUDA backend: refused when the trainer is built,
 * naming the key (the config check refuses it first; tests/test_config.c). With the
 * backend, tests/gpu_learner.c runs it. */
static void test_device_cuda(void) {
#ifndef MOERL_HAVE_CUDA
    lf_t f;
    lf_open(&f);
    lf_set(&f, "run.device", "cuda");
    trainer_t *t = NULL;
    CU_ASSERT_EQUAL(trainer_new(&t, &f.cfg, NULL, NULL), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(t);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "run.device: cuda: this build has no CUDA"));
    lf_close(&f);
#endif
}

int main(void) {
    backend_cpu_set_threads(1); /* tiny shapes: threads only add overhead */
    CU_TestInfo tests[] = {
        {"one step updates the adapter", test_step_updates},
        {"the loss falls on a fixed batch", test_loss_decreases},
        {"trained routers and norms move", test_full_tensors_move},
        {"no weight decay on the trained norms", test_norms_no_decay},
        {"stale samples are dropped", test_staleness},
        {"flat groups and dynamic sampling", test_flat_groups},
        {"non-finite rewards and forwards skip", test_nonfinite},
        {"a non-finite gradient skips the update", test_nonfinite_grad},
        {"micro-batching keeps the update", test_micro_batches},
        {"single-thread runs are bit-identical", test_determinism},
        {"routing agreement", test_routing_agreement},
        {"mismatch filter and gate", test_mismatch},
        {"malformed groups are dropped", test_malformed},
        {"run.device cuda", test_device_cuda},
        CU_TEST_INFO_NULL,
    };
    return tu_main("trainer", tests);
}
