/* test_checkpoint: save/load round trips, resume giving the same bits as an unbroken
 * run, crashes at each stage of a save, damaged files, retention, config checks. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/backend.h"
#include "learner/checkpoint.h"
#include "lora/peft.h"
#include "tests/learner_fixture.h"

static const float k_rewards[3][4] = {{1, 0, 0, 1}, {0, 0, 1, 0}, {1, 1, 0, 0.5f}};

static void make_batch(trainer_t *t, sample_group_t **g) {
    for (int i = 0; i < 3; i++)
        g[i] = lf_group(t, 20 + (uint64_t)i, 4, k_rewards[i], 0, 1);
}

static void steps(trainer_t *t, sample_group_t **g, int n) {
    for (int k = 0; k < n; k++) {
        trainer_metrics_t m;
        int rc = trainer_step(t, (const sample_group_t *const *)g, 3, &m);
        if (rc < 0)
            tu_report("step: %s", mo_last_error());
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        CU_ASSERT_EQUAL_FATAL(m.trained, 1);
        CU_ASSERT_EQUAL_FATAL(m.skipped_updates, 0);
    }
}

static int same_state(const trainer_t *a, const trainer_t *b) {
    size_t n = a->adapter->n_params;
    return a->adapter->n_params == b->adapter->n_params &&
           !memcmp(a->adapter->params, b->adapter->params, sizeof(float) * n) &&
           !memcmp(a->optim.m, b->optim.m, sizeof(float) * n) &&
           !memcmp(a->optim.v, b->optim.v, sizeof(float) * n) && a->optim.step == b->optim.step &&
           a->step == b->step && a->version == b->version && a->rng_counter == b->rng_counter;
}

static void save(trainer_t *t, const char *run, const checkpoint_save_opts_t *o, int expect) {
    checkpoint_data_t d = {3, (uint64_t)t->step * 10, 0xfeedu};
    char name[64];
    int rc = checkpoint_save_trainer(t, run, &d, o, name, sizeof name);
    if (rc != expect)
        tu_report("save: %d %s", rc, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, expect);
}

static void test_round_trip(void) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.ppo_epochs", "2");
    trainer_t *a = lf_trainer(&f), *b = lf_trainer(&f);
    sample_group_t *g[3];
    make_batch(a, g);
    steps(a, g, 2);
    a->reward_version = 7;
    CU_ASSERT(!same_state(a, b));
    save(a, f.run_dir, NULL, 0);
    char latest[64];
    CU_ASSERT_EQUAL(checkpoint_latest(f.run_dir, latest, sizeof latest), 0);
    CU_ASSERT_STRING_EQUAL(latest, "step-000002");
    checkpoint_data_t d;
    char name[64];
    int fb = -1;
    int rc = checkpoint_resume_trainer(b, f.run_dir, 0, &d, name, sizeof name, &fb);
    if (rc < 0)
        tu_report("resume: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(fb, 0);
    CU_ASSERT_STRING_EQUAL(name, "step-000002");
    CU_ASSERT(same_state(a, b));
    CU_ASSERT_EQUAL(b->optim.skipped, a->optim.skipped);
    CU_ASSERT_EQUAL(b->reward_version, 7);
    CU_ASSERT_EQUAL(d.epoch, 3);
    CU_ASSERT_EQUAL(d.pos, 20);
    CU_ASSERT_EQUAL(d.fingerprint, 0xfeedu);
    /* The adapter directory is a PEFT adapter any loader reads. */
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/checkpoints/step-000002/adapter", f.run_dir);
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(peft_load_new(&ad, dir, a->model->modules, a->model->n_modules, 1), 0);
    CU_ASSERT(!memcmp(ad->params, a->adapter->params, sizeof(float) * ad->n_params));
    lora_adapter_destroy(&ad);
    lf_free_groups(g, 3);
    trainer_destroy(&a);
    trainer_destroy(&b);
    lf_close(&f);
}

/* 4 steps straight == 2 steps, save, load into a fresh trainer, 2 steps. */
static void test_resume_bit_identical(void) {
    int threads = backend_cpu_threads();
    backend_cpu_set_threads(1);
    lf_t f;
    lf_open(&f);
    lf_set(&f, "model.routing_replay", "true");
    lf_set(&f, "learner.lr_schedule", "cosine");
    lf_set(&f, "learner.warmup_steps", "2");
    lf_set(&f, "learner.steps", "4");
    trainer_t *a = lf_trainer(&f), *b = lf_trainer(&f);
    sample_group_t *g[3];
    make_batch(a, g);
    steps(a, g, 4);
    steps(b, g, 2);
    save(b, f.run_dir, NULL, 0);
    trainer_destroy(&b);
    trainer_t *c = lf_trainer(&f);
    CU_ASSERT_EQUAL_FATAL(checkpoint_resume_trainer(c, f.run_dir, 0, NULL, NULL, 0, NULL), 0);
    CU_ASSERT_EQUAL(c->step, 2);
    steps(c, g, 2);
    CU_ASSERT(same_state(a, c));
    lf_free_groups(g, 3);
    trainer_destroy(&a);
    trainer_destroy(&c);
    lf_close(&f);
    backend_cpu_set_threads(threads);
}

static int count_prefix(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d)
        closedir(d);
    return n;
}

static void truncate_file(const char *path) {
    struct stat sb;
    CU_ASSERT_EQUAL_FATAL(stat(path, &sb), 0);
    CU_ASSERT_EQUAL_FATAL(truncate(path, sb.st_size / 2), 0);
}

/* Loads the run into a fresh trainer; returns its step (-1 on failure). */
static int64_t load_step(lf_t *f, int *fell_back) {
    trainer_t *t = lf_trainer(f);
    int rc = checkpoint_resume_trainer(t, f->run_dir, 0, NULL, NULL, 0, fell_back);
    int64_t s = rc == 0 ? t->step : -1;
    if (rc < 0)
        tu_report("load: %s", mo_last_error());
    trainer_destroy(&t);
    return s;
}

static void test_crashes(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f);
    sample_group_t *g[3];
    make_batch(t, g);
    char root[1200], p[1400];
    snprintf(root, sizeof root, "%s/checkpoints", f.run_dir);
    int fb;
    steps(t, g, 2);
    save(t, f.run_dir, NULL, 0);
    /* Crash before the rename: a temporary directory stays, latest is untouched. */
    steps(t, g, 2);
    checkpoint_save_opts_t crash = {0, NULL, CKPT_CRASH_BEFORE_RENAME};
    save(t, f.run_dir, &crash, MO_EIO);
    CU_ASSERT_EQUAL(count_prefix(root, ".tmp-step-000004"), 1);
    CU_ASSERT_EQUAL(load_step(&f, &fb), 2);
    CU_ASSERT_EQUAL(fb, 0);
    save(t, f.run_dir, NULL, 0); /* the next save clears the leftover */
    CU_ASSERT_EQUAL(count_prefix(root, ".tmp-step-"), 0);
    CU_ASSERT_EQUAL(load_step(&f, &fb), 4);
    /* Crash after the rename, before latest: latest still names step 4. */
    steps(t, g, 2);
    checkpoint_save_opts_t crash2 = {0, NULL, CKPT_CRASH_BEFORE_LATEST};
    save(t, f.run_dir, &crash2, MO_EIO);
    CU_ASSERT_EQUAL(count_prefix(root, "step-000006"), 1);
    CU_ASSERT_EQUAL(load_step(&f, &fb), 4);
    CU_ASSERT_EQUAL(fb, 0);
    save(t, f.run_dir, NULL, 0); /* replaces the unpublished step-000006 */
    CU_ASSERT_EQUAL(load_step(&f, &fb), 6);
    CU_ASSERT_EQUAL(count_prefix(root, ".old-"), 0);
    /* Damaged files in the newest checkpoint: the previous one loads instead. */
    static const char *const parts[] = {CKPT_OPTIM_NAME, CKPT_ADAPTER_DIR "/" PEFT_WEIGHTS_NAME,
                                        CKPT_ADAPTER_DIR "/" PEFT_CONFIG_NAME, CKPT_STATE_NAME};
    for (int i = 0; i < 4; i++) {
        steps(t, g, 1);
        save(t, f.run_dir, NULL, 0);
        steps(t, g, 1);
        save(t, f.run_dir, NULL, 0);
        int64_t good = t->step - 1;
        char sname[64];
        checkpoint_step_name(sname, sizeof sname, t->step);
        snprintf(p, sizeof p, "%s/%s/%s", root, sname, parts[i]);
        truncate_file(p);
        trainer_t *x = lf_trainer(&f);
        float *before = malloc(sizeof(float) * x->adapter->n_params);
        memcpy(before, x->adapter->params, sizeof(float) * x->adapter->n_params);
        snprintf(p, sizeof p, "%s/%s", root, sname);
        CU_ASSERT(checkpoint_load_dir(p, x->adapter, &x->optim, NULL) == MO_EMALFORMED);
        CU_ASSERT(!memcmp(before, x->adapter->params, sizeof(float) * x->adapter->n_params));
        CU_ASSERT_EQUAL(x->optim.step, 0);
        free(before);
        trainer_destroy(&x);
        int64_t got = load_step(&f, &fb);
        if (got != good)
            tu_report("damaged %s: loaded step %lld, expected %lld", parts[i], (long long)got,
                      (long long)good);
        CU_ASSERT_EQUAL(got, good);
        CU_ASSERT_EQUAL(fb, 1);
        /* Remove the damaged one so the next round's previous checkpoint is good. */
        snprintf(p, sizeof p, "rm -rf '%s/%s'", root, sname);
        CU_ASSERT_EQUAL(system(p), 0);
    }
    /* A torn latest pointer: the newest valid directory. */
    snprintf(p, sizeof p, "%s/latest", root);
    FILE *fp = fopen(p, "w");
    fputs("step-0", fp);
    fclose(fp);
    char name[64];
    CU_ASSERT_EQUAL(checkpoint_latest(f.run_dir, name, sizeof name), MO_EMALFORMED);
    CU_ASSERT_EQUAL(load_step(&f, &fb), t->step - 1);
    CU_ASSERT_EQUAL(fb, 1);
    lf_free_groups(g, 3);
    trainer_destroy(&t);
    lf_close(&f);
}

static void test_retention(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f);
    checkpoint_save_opts_t o = {2, NULL, CKPT_CRASH_NONE};
    for (int s = 1; s <= 5; s++) {
        t->step = s;
        t->adapter->params[0] = (float)s;
        save(t, f.run_dir, &o, 0);
    }
    int64_t *st;
    int n;
    CU_ASSERT_EQUAL_FATAL(checkpoint_list(f.run_dir, &st, &n), 0);
    CU_ASSERT_EQUAL_FATAL(n, 2);
    CU_ASSERT_EQUAL(st[0], 4);
    CU_ASSERT_EQUAL(st[1], 5);
    free(st);
    trainer_t *b = lf_trainer(&f);
    CU_ASSERT_EQUAL(checkpoint_resume_trainer(b, f.run_dir, 0, NULL, NULL, 0, NULL), 0);
    CU_ASSERT_EQUAL(b->adapter->params[0], 5.0f);
    /* keep 0 keeps everything */
    CU_ASSERT_EQUAL(checkpoint_prune(f.run_dir, 0), 0);
    CU_ASSERT_EQUAL(checkpoint_prune(f.run_dir, 1), 1);
    trainer_destroy(&b);
    trainer_destroy(&t);
    lf_close(&f);
}

static void test_config_check(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *t = lf_trainer(&f);
    CU_ASSERT_EQUAL(checkpoint_resume_trainer(t, f.run_dir, 0, NULL, NULL, 0, NULL), MO_ENOTFOUND);
    t->step = 3;
    t->adapter->params[0] = 42.0f;
    save(t, f.run_dir, NULL, 0);
    lf_set(&f, "learner.clip_high", "0.3");
    trainer_t *b = lf_trainer(&f);
    float p0 = b->adapter->params[0];
    CU_ASSERT_EQUAL(checkpoint_resume_trainer(b, f.run_dir, 0, NULL, NULL, 0, NULL), MO_ECONFIG);
    CU_ASSERT(strstr(mo_last_error(), "config hash") != NULL);
    CU_ASSERT_EQUAL(b->step, 0);
    CU_ASSERT_EQUAL(b->adapter->params[0], p0);
    CU_ASSERT_EQUAL(checkpoint_resume_trainer(b, f.run_dir, 1, NULL, NULL, 0, NULL), 0);
    CU_ASSERT_EQUAL(b->step, 3);
    CU_ASSERT_EQUAL(b->adapter->params[0], 42.0f);
    /* Keys that do not change a step's numbers keep the hash. */
    uint64_t h = trainer_config_hash(&f.cfg);
    lf_set(&f, "learner.steps", "999");
    lf_set(&f, "learner.keep_checkpoints", "7");
    lf_set(&f, "rollout.workers", "5");
    CU_ASSERT_EQUAL(trainer_config_hash(&f.cfg), h);
    lf_set(&f, "lora.alpha", "3");
    CU_ASSERT_NOT_EQUAL(trainer_config_hash(&f.cfg), h);
    CU_ASSERT_EQUAL(checkpoint_due(b, 3), 1);
    CU_ASSERT_EQUAL(checkpoint_due(b, 2), 0);
    CU_ASSERT_EQUAL(checkpoint_due(b, 0), 0);
    trainer_destroy(&b);
    trainer_destroy(&t);
    lf_close(&f);
}

int main(void) {
    backend_cpu_set_threads(1); /* tiny shapes: threads only add overhead */
    CU_TestInfo tests[] = {
        {"save and load round trip", test_round_trip},
        {"resume is bit-identical to an unbroken run", test_resume_bit_identical},
        {"crashes and damaged files", test_crashes},
        {"retention", test_retention},
        {"config hash check", test_config_check},
        CU_TEST_INFO_NULL,
    };
    return tu_main("checkpoint", tests);
}
