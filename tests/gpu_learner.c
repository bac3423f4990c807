/* gpu_learner: the learner with run.device cuda (learner/actor_exec.h: the model's
 * forwards and backwards on the GPU, the loss and AdamW on the CPU) against run.device cpu
 * on the tiny random Qwen3-MoE of tests/learner_fixture.h (f32 weights), from the same
 * seed and the same scored groups: after each of a few steps (two AdamW updates each) the
 * loss, its parts, the gradient norm, the old policy's entropy and the expert load agree,
 * and so do the last update's gradients and the adapter parameters, within 1e-5
 * (normalised by the largest value; AdamW's eps raised to 1e-3, see ADAM_EPS). Once with
 * the defaults (own routing, no KL), once with routing replay, a KL penalty (the reference
 * policy scored with the adapter off) and an entropy bonus (dentropy). Also: adapter
 * parameters changed on the host between steps (as a resume does) reach the device;
 * moerl sft's step agrees the same way; the refusals at trainer_new (trainable norms, a
 * balance loss) name the reason. Exits 77 (skipped) without CUDA support in the build or
 * without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "learner/actor_exec.h"
#include "learner/sft.h"
#include "tests/learner_fixture.h"

/* f32 weights: f32 products, other summation orders (as in gpu_model_train.c). */
#define TOL_F32 1e-5
#define STEPS 3
/* AdamW divides each gradient by its own running RMS plus eps: with the default eps 1e-8
 * a gradient of ~1e-8 (an entry the batch barely touches, where the two sides' sums of
 * cancelling terms differ in their last digits) moves its parameter by a fraction of lr
 * that differs visibly between them, and the runs drift apart by up to ~1e-3 lr per
 * update whatever the device computes. With eps 1e-3 an update responds smoothly to
 * such gradients, so the parameters can be held to TOL_F32; the gradients themselves are
 * compared at TOL_F32 as well. */
#define ADAM_EPS "1e-3"

static const float k_rewards[4][4] = {
    {1, 0, 0, 1}, {0, 0, 1, 0}, {1, 1, 0, 0.5f}, {0.2f, 0.9f, 0.4f, 0}};

static trainer_t *trainer_on(lf_t *f, const char *device) {
    lf_set(f, "run.device", device);
    return lf_trainer(f);
}

/* The loss parts are sums of terms of both signs that may nearly cancel: their error is
 * taken relative to 1e-2 at least (the terms are ~1e-1). */
static double rel(double a, double b) {
    return fabs(a - b) / (fabs(b) > 1e-2 ? fabs(b) : 1e-2);
}

static void check_metric(const char *what, int step, double gpu, double cpu) {
    char w[128];
    snprintf(w, sizeof w, "step %d %s (gpu %.9g, cpu %.9g)", step, what, gpu, cpu);
    TU_ASSERT_CLOSE(rel(gpu, cpu), TOL_F32, w);
}

static void check_params(const char *what, int step, const trainer_t *g, const trainer_t *c) {
    CU_ASSERT_EQUAL_FATAL(g->adapter->n_params, c->adapter->n_params);
    char w[128];
    snprintf(w, sizeof w, "step %d %s", step, what);
    TU_ASSERT_CLOSE(
        tu_rel_err_ff(g->adapter->params, c->adapter->params, g->adapter->n_params, 1e-6), TOL_F32,
        w);
}

static void step_both(trainer_t *tg, trainer_t *tc, sample_group_t **g, int n, int s) {
    trainer_metrics_t mg, mc;
    int rc = trainer_step(tg, (const sample_group_t *const *)g, n, &mg);
    if (rc < 0)
        tu_report("trainer_step (cuda): %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    rc = trainer_step(tc, (const sample_group_t *const *)g, n, &mc);
    if (rc < 0)
        tu_report("trainer_step (cpu): %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(mg.trained, 1);
    CU_ASSERT_EQUAL(mg.trained, mc.trained);
    CU_ASSERT_EQUAL(mg.updates, mc.updates);
    CU_ASSERT_EQUAL(mg.skipped_updates, mc.skipped_updates);
    CU_ASSERT_EQUAL(mg.trained_samples, mc.trained_samples);
    CU_ASSERT_EQUAL(mg.micro_batches, mc.micro_batches);
    CU_ASSERT_EQUAL(mg.version, mc.version);
    check_metric("loss", s, mg.loss, mc.loss);
    check_metric("pg", s, mg.pg, mc.pg);
    check_metric("kl", s, mg.kl, mc.kl);
    check_metric("entropy", s, mg.entropy, mc.entropy);
    check_metric("entropy_old", s, mg.entropy_old, mc.entropy_old);
    check_metric("grad_norm", s, mg.grad_norm, mc.grad_norm);
    check_metric("ratio_mean", s, mg.ratio_mean, mc.ratio_mean);
    CU_ASSERT(fabs(mg.mismatch_k3 - mc.mismatch_k3) < 1e-6);
    CU_ASSERT_EQUAL_FATAL(mg.M, mc.M);
    for (int l = 0; l < mg.M; l++) {
        /* The device records the expert load from the experts it used. */
        CU_ASSERT(mg.expert_imbalance[l] > 0);
        CU_ASSERT(fabs(mg.expert_imbalance[l] - mc.expert_imbalance[l]) < 1e-9);
        CU_ASSERT(fabs(mg.routing_agreement[l] - mc.routing_agreement[l]) < 1e-9);
    }
    /* The last update's gradients (after the same clip), then the parameters. */
    char w[128];
    snprintf(w, sizeof w, "step %d gradients", s);
    TU_ASSERT_CLOSE(
        tu_rel_err_ff(tg->adapter->grads, tc->adapter->grads, tg->adapter->n_params, 1e-6), TOL_F32,
        w);
    check_params("adapter parameters", s, tg, tc);
}

/* STEPS steps on the same four groups (built once with the CPU trainer's policy). */
static void run_steps(lf_t *f, int with_routing) {
    trainer_t *tc = trainer_on(f, "cpu");
    trainer_t *tg = trainer_on(f, "cuda");
    CU_ASSERT_EQUAL(actor_exec_device(tg->exec), DEV_CUDA);
    CU_ASSERT_EQUAL(actor_exec_device(tc->exec), DEV_CPU);
    char line[400];
    actor_exec_describe(tg->exec, line, sizeof line);
    CU_ASSERT_PTR_NOT_NULL(strstr(line, "runs on the GPU (cuda:"));
    CU_ASSERT_PTR_NOT_NULL(strstr(line, "the rollout workers' engines run on the GPU"));
    check_params("initial adapter", 0, tg, tc);
    sample_group_t *g[4];
    for (int i = 0; i < 4; i++)
        g[i] = lf_group(tc, 10 + (uint64_t)i, 4, k_rewards[i], 0, with_routing);
    for (int s = 1; s <= STEPS; s++)
        step_both(tg, tc, g, 4, s);
    lf_free_groups(g, 4);
    trainer_destroy(&tg);
    trainer_destroy(&tc);
}

static void test_steps(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.adam_eps", ADAM_EPS);
    run_steps(&f, 0);
    lf_close(&f);
}

static void test_steps_replay_kl_entropy(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.adam_eps", ADAM_EPS);
    lf_set(&f, "model.routing_replay", "true");
    lf_set(&f, "learner.kl_coef", "0.05");
    lf_set(&f, "learner.entropy_coef", "0.01");
    run_steps(&f, 1);
    lf_close(&f);
}

/* The host adapter changed between steps (a resume, an initial adapter): the next step
 * and trainer_sample_logprobs see it on the device. */
static void test_host_change_reaches_device(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.adam_eps", ADAM_EPS);
    trainer_t *tc = trainer_on(&f, "cpu");
    trainer_t *tg = trainer_on(&f, "cuda");
    sample_group_t *g[4];
    for (int i = 0; i < 4; i++)
        g[i] = lf_group(tc, 20 + (uint64_t)i, 4, k_rewards[i], 0, 0);
    step_both(tg, tc, g, 4, 1);
    size_t n = tc->adapter->n_params;
    tu_fill(tc->adapter->params, n, 99, -0.05f, 0.05f); /* B no longer zero */
    memcpy(tg->adapter->params, tc->adapter->params, sizeof(float) * n);
    int T = g[0]->samples[0].n_tokens;
    float *lc = malloc(sizeof *lc * (size_t)T), *lg = malloc(sizeof *lg * (size_t)T);
    TU_CHECK_RC(trainer_sample_logprobs(tc, g[0], 0, lc));
    TU_CHECK_RC(trainer_sample_logprobs(tg, g[0], 0, lg));
    TU_ASSERT_CLOSE(tu_rel_err_ff(lg, lc, (size_t)T, 1e-6), TOL_F32, "logprobs after a change");
    step_both(tg, tc, g, 4, 2);
    free(lc);
    free(lg);
    lf_free_groups(g, 4);
    trainer_destroy(&tg);
    trainer_destroy(&tc);
    lf_close(&f);
}

/* moerl sft's step (learner/sft.h) with run.device cuda against cpu: loss, gradient norm
 * and adapter parameters after a few steps on the same pairs. */
static sft_t *sft_on(lf_t *f, const char *device) {
    lf_set(f, "run.device", device);
    sft_opts_t o = sft_opts_default();
    o.lr = 1e-2;
    o.steps = STEPS;
    o.warmup = 0;
    sft_t *s = NULL;
    int rc = sft_new(&s, &f->cfg, &o);
    if (rc < 0)
        tu_report("sft_new (%s): %s", device, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return s;
}

static void test_sft(void) {
    static const sft_pair_t pairs[4] = {
        {"12+34=", "46"}, {"7-5=", "2"}, {"100+1=", "101"}, {"9-9=", "0"}};
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.adam_eps", ADAM_EPS);
    lf_set(&f, "data.task", "arith");
    lf_set(&f, "data.eval_size", "8");
    lf_set(&f, "learner.micro_batch_tokens", "40");
    sft_t *sc = sft_on(&f, "cpu");
    sft_t *sg = sft_on(&f, "cuda");
    CU_ASSERT_EQUAL(actor_exec_device(sg->exec), DEV_CUDA);
    for (int s = 1; s <= STEPS; s++) {
        sft_step_result_t rg, rc;
        TU_CHECK_RC(sft_step(sg, pairs, 4, &rg));
        TU_CHECK_RC(sft_step(sc, pairs, 4, &rc));
        CU_ASSERT_EQUAL(rg.applied, 1);
        CU_ASSERT_EQUAL(rg.tokens, rc.tokens);
        check_metric("sft loss", s, rg.loss, rc.loss);
        check_metric("sft grad_norm", s, rg.grad_norm, rc.grad_norm);
        char w[64];
        snprintf(w, sizeof w, "sft step %d adapter parameters", s);
        TU_ASSERT_CLOSE(tu_rel_err_ff(sg->ad->params, sc->ad->params, sg->ad->n_params, 1e-6),
                        TOL_F32, w);
    }
    sft_destroy(&sg);
    sft_destroy(&sc);
    lf_close(&f);
}

static void expect_refused(const moerl_config_t *cfg, model_t *m, const char *want) {
    trainer_t *t = NULL;
    int rc = trainer_new(&t, cfg, m, NULL);
    CU_ASSERT_EQUAL(rc, MO_ECONFIG);
    CU_ASSERT_PTR_NULL(t);
    if (!strstr(mo_last_error(), want))
        tu_report("expected \"%s\" in: %s", want, mo_last_error());
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), want));
    trainer_destroy(&t);
}

static void test_refusals(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "run.device", "cuda");
    lf_set(&f, "lora.train_norms", "true");
    expect_refused(&f.cfg, NULL, "trainable full weights");
    lf_set(&f, "lora.train_norms", "false");
    model_opts_t mo = {.aux_coef = 0.01f};
    model_t *m = NULL;
    TU_CHECK_RC(model_open(&m, f.model_dir, &mo));
    expect_refused(&f.cfg, m, "balance loss");
    model_destroy(&m);
    lf_close(&f);
}

static CU_TestInfo g_tests[] = {
    {"steps", test_steps},
    {"steps_replay_kl_entropy", test_steps_replay_kl_entropy},
    {"host_change_reaches_device", test_host_change_reaches_device},
    {"sft", test_sft},
    {"refusals", test_refusals},
    CU_TEST_INFO_NULL,
};

int main(void) {
    int rc = 0;
    if (!gpu_suite_backend("gpu_learner", &rc))
        return rc;
    backend_cpu_set_threads(1);
    return tu_main("gpu_learner", g_tests);
}

#else
int main(void) { return gpu_suite_absent("gpu_learner"); }
#endif
