/* Tests for the optimizer: AdamW steps with clipping and the schedule
 * against a double reference, the clip coefficient, schedule values at
 * chosen steps, non-finite skipping (bit-identical state), the ranges kept
 * free of weight decay, and the state file's round trip and corruption errors. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/status.h"
#include "learner/optim.h"
#include "tests/testutil.h"

#define TOL_REF 3e-6 /* f32 state over a few steps vs double, normalised */

static optim_hp_t hp_base(void) {
    optim_hp_t hp = {.lr = 1e-2,
                     .schedule = CFG_LR_COSINE,
                     .warmup_steps = 3,
                     .total_steps = 10,
                     .min_lr_ratio = 0.1,
                     .beta1 = 0.9,
                     .beta2 = 0.95,
                     .eps = 1e-8,
                     .weight_decay = 0.05,
                     .grad_clip = 0.5};
    return hp;
}

/* The schedule, written from its definition: update k = s + 1 of S. */
static double ref_lr(const optim_hp_t *hp, int s) {
    double W = (double)hp->warmup_steps, S = (double)hp->total_steps;
    if (s + 1 <= W)
        return hp->lr * (s + 1) / W;
    if (hp->schedule == CFG_LR_CONSTANT)
        return hp->lr;
    double span = S - 1 - W < 1 ? 1 : S - 1 - W;
    double p = fmin(1.0, (s - W) / span);
    double r = hp->min_lr_ratio;
    return hp->lr * r + hp->lr * (1 - r) * (1 + cos(3.14159265358979323846 * p)) / 2;
}

static void test_adamw_vs_reference(void) {
    enum { N = 1000, STEPS = 12 };
    optim_hp_t hp = hp_base();
    optim_t o;
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, N, &hp, NULL), 0);
    float *p = malloc(N * sizeof(float)), *g = malloc(N * sizeof(float));
    double *pd = malloc(N * sizeof(double)), *md = calloc(N, sizeof(double));
    double *vd = calloc(N, sizeof(double));
    tu_fill(p, N, 3, -1, 1);
    for (int i = 0; i < N; i++)
        pd[i] = p[i];
    int clipped = 0;
    for (int s = 0; s < STEPS; s++) {
        /* norms from ~0.1 to ~2.3 so that some steps clip at 0.5 */
        tu_fill(g, N, 100 + (uint64_t)s, -1, 1);
        double scale = 0.006 * (1 + (s * 7) % 13), sq = 0;
        for (int i = 0; i < N; i++) {
            g[i] = (float)(g[i] * scale);
            sq += (double)g[i] * g[i];
        }
        double norm = sqrt(sq), coef = fmin(1.0, hp.grad_clip / (norm + 1e-6));
        clipped += coef < 1;
        double lr = ref_lr(&hp, s), b1 = hp.beta1, b2 = hp.beta2;
        for (int i = 0; i < N; i++) {
            double gi = g[i] * coef;
            pd[i] *= 1 - lr * hp.weight_decay;
            md[i] = b1 * md[i] + (1 - b1) * gi;
            vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
            double mh = md[i] / (1 - pow(b1, s + 1)), vh = vd[i] / (1 - pow(b2, s + 1));
            pd[i] -= lr * mh / (sqrt(vh) + hp.eps);
        }
        optim_result_t r;
        CU_ASSERT_EQUAL(optim_step(&o, p, g, 1.5, NULL, &r), 0);
        CU_ASSERT_EQUAL(r.outcome, OPTIM_APPLIED);
        CU_ASSERT(fabs(r.grad_norm - norm) <= 1e-12 * norm);
        CU_ASSERT(fabs(r.clip_coef - coef) <= 1e-12);
        CU_ASSERT(fabs(r.lr - lr) <= 1e-15);
        CU_ASSERT_EQUAL(r.step, s + 1);
    }
    CU_ASSERT(clipped > 0 && clipped < STEPS);
    CU_ASSERT_EQUAL(o.step, STEPS);
    TU_ASSERT_CLOSE(tu_rel_err_fd(p, pd, N, 1e-3), TOL_REF, "params");
    TU_ASSERT_CLOSE(tu_rel_err_fd(o.m, md, N, 1e-3), TOL_REF, "m");
    TU_ASSERT_CLOSE(tu_rel_err_fd(o.v, vd, N, 1e-9), TOL_REF, "v");
    optim_free(&o);
    free(p), free(g), free(pd), free(md), free(vd);
}

static void test_clip_coefficient(void) {
    CU_ASSERT_EQUAL(optim_clip_coef(5.0, 0), 1.0);
    CU_ASSERT_EQUAL(optim_clip_coef(5.0, 10.0), 1.0);
    CU_ASSERT(fabs(optim_clip_coef(5.0, 1.0) - 1.0 / (5.0 + 1e-6)) < 1e-15);
    /* grads (3, 4, 0, ...) have norm 5; a clip of 1 scales them in place */
    optim_hp_t hp = hp_base();
    hp.grad_clip = 1.0;
    optim_t o;
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, 3, &hp, NULL), 0);
    float p[3] = {0.1f, 0.2f, 0.3f}, g[3] = {3, 4, 0};
    CU_ASSERT(fabs(optim_grad_sqsum(g, 3) - 25.0) < 1e-12);
    optim_result_t r;
    CU_ASSERT_EQUAL(optim_step(&o, p, g, 0, NULL, &r), 0);
    CU_ASSERT(fabs(r.grad_norm - 5) < 1e-12);
    CU_ASSERT(fabs(g[0] - 0.6) < 1e-6 && fabs(g[1] - 0.8) < 1e-6 && g[2] == 0);
    /* the global norm, not the local one, decides: local norm 0.5, global 50 */
    float g2[3] = {0.3f, 0.4f, 0};
    double global = 2500;
    CU_ASSERT_EQUAL(optim_step(&o, p, g2, 0, &global, &r), 0);
    CU_ASSERT(fabs(r.grad_norm - 50) < 1e-12);
    CU_ASSERT(fabs(g2[0] - 0.3 / (50 + 1e-6)) < 1e-8);
    /* clipping off */
    o.hp.grad_clip = 0;
    float g3[3] = {30, 40, 0};
    CU_ASSERT_EQUAL(optim_step(&o, p, g3, 0, NULL, &r), 0);
    CU_ASSERT(r.clip_coef == 1.0 && g3[0] == 30 && g3[1] == 40);
    optim_free(&o);
}

static void test_schedule_values(void) {
    /* lr 1e-3, W 4, S 13: warmup lr (s+1)/4; cosine over s = 4 .. 12 (span 8) */
    optim_hp_t hp = hp_base();
    hp.lr = 1e-3;
    hp.warmup_steps = 4;
    hp.total_steps = 13;
    hp.min_lr_ratio = 0.1;
    struct {
        int s;
        double lr;
    } want[] = {
        {0, 2.5e-4},
        {1, 5.0e-4},
        {3, 1.0e-3},
        {4, 1.0e-3},                                   /* p = 0 */
        {6, 1e-3 * (0.1 + 0.9 * (1 + sqrt(0.5)) / 2)}, /* p = 1/4: 8.6819805e-4 */
        {8, 5.5e-4},                                   /* p = 1/2 */
        {12, 1.0e-4},                                  /* p = 1: the last update */
        {40, 1.0e-4},                                  /* past the plan */
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        double got = optim_lr(&hp, want[i].s);
        if (!(fabs(got - want[i].lr) < 1e-15))
            tu_report("cosine s=%d: %.10g, want %.10g", want[i].s, got, want[i].lr);
        CU_ASSERT(fabs(got - want[i].lr) < 1e-15);
    }
    CU_ASSERT(fabs(optim_lr(&hp, 6) - 8.6819805e-4) < 1e-11);
    hp.schedule = CFG_LR_CONSTANT;
    CU_ASSERT(fabs(optim_lr(&hp, 1) - 5e-4) < 1e-15);
    CU_ASSERT_EQUAL(optim_lr(&hp, 4), 1e-3);
    CU_ASSERT_EQUAL(optim_lr(&hp, 1000), 1e-3);
    /* no warmup: the first update takes the peak */
    hp.warmup_steps = 0;
    hp.schedule = CFG_LR_COSINE;
    CU_ASSERT_EQUAL(optim_lr(&hp, 0), 1e-3);
    CU_ASSERT(fabs(optim_lr(&hp, 12) - 1e-4) < 1e-15);
}

static void fill_state(optim_t *o, float *p, float *g, size_t n, int steps) {
    for (int s = 0; s < steps; s++) {
        tu_fill(g, n, 500 + (uint64_t)s, -0.1f, 0.1f);
        CU_ASSERT_EQUAL(optim_step(o, p, g, 1.0, NULL, NULL), 0);
    }
}

static void test_nonfinite_skips(void) {
    enum { N = 64 };
    optim_hp_t hp = hp_base();
    optim_t o;
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, N, &hp, NULL), 0);
    float p[N], g[N], p0[N], m0[N], v0[N], g0[N];
    tu_fill(p, N, 9, -1, 1);
    fill_state(&o, p, g, N, 3);
    memcpy(p0, p, sizeof p), memcpy(m0, o.m, sizeof m0), memcpy(v0, o.v, sizeof v0);
    struct {
        float bad;
        double loss;
        int global_inf;
        optim_outcome_t want;
    } cases[] = {
        {NAN, 1.0, 0, OPTIM_SKIP_GRAD},       {INFINITY, 1.0, 0, OPTIM_SKIP_GRAD},
        {-INFINITY, 1.0, 0, OPTIM_SKIP_GRAD}, {0.0f, NAN, 0, OPTIM_SKIP_LOSS},
        {0.0f, INFINITY, 0, OPTIM_SKIP_LOSS}, {0.0f, 1.0, 1, OPTIM_SKIP_NORM},
    };
    int ncase = (int)(sizeof cases / sizeof *cases);
    for (int c = 0; c < ncase; c++) {
        tu_fill(g, N, 900 + (uint64_t)c, -5, 5); /* large: would clip */
        if (cases[c].bad != 0.0f)
            g[17] = cases[c].bad;
        memcpy(g0, g, sizeof g);
        double inf = INFINITY;
        optim_result_t r;
        CU_ASSERT_EQUAL(optim_step(&o, p, g, cases[c].loss, cases[c].global_inf ? &inf : NULL, &r),
                        0);
        CU_ASSERT_EQUAL(r.outcome, cases[c].want);
        CU_ASSERT_EQUAL(r.bad_index, cases[c].want == OPTIM_SKIP_GRAD ? 17 : -1);
        CU_ASSERT_EQUAL(o.step, 3);
        CU_ASSERT_EQUAL(o.skipped, c + 1);
        CU_ASSERT_EQUAL(memcmp(p, p0, sizeof p), 0);
        CU_ASSERT_EQUAL(memcmp(o.m, m0, sizeof m0), 0);
        CU_ASSERT_EQUAL(memcmp(o.v, v0, sizeof v0), 0);
        CU_ASSERT_EQUAL(memcmp(g, g0, sizeof g), 0); /* not clipped either */
    }
    CU_ASSERT(strcmp(optim_outcome_name(OPTIM_SKIP_GRAD), "non-finite gradient") == 0);
    /* the next good step is step 4 (bias correction counts applied steps) */
    optim_t twin;
    float pt[N];
    CU_ASSERT_EQUAL_FATAL(optim_init(&twin, N, &hp, NULL), 0);
    tu_fill(pt, N, 9, -1, 1);
    fill_state(&twin, pt, g, N, 3);
    tu_fill(g, N, 4242, -0.1f, 0.1f);
    memcpy(g0, g, sizeof g);
    CU_ASSERT_EQUAL(optim_step(&o, p, g, 1.0, NULL, NULL), 0);
    CU_ASSERT_EQUAL(optim_step(&twin, pt, g0, 1.0, NULL, NULL), 0);
    CU_ASSERT_EQUAL(o.step, 4);
    CU_ASSERT_EQUAL(memcmp(p, pt, sizeof p), 0);
    optim_free(&twin);
    optim_free(&o);
}

static void test_init_errors(void) {
    optim_t o;
    optim_hp_t hp = hp_base();
    hp.beta1 = 1.0;
    CU_ASSERT_EQUAL(optim_init(&o, 4, &hp, NULL), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "beta1") != NULL);
    hp = hp_base();
    hp.lr = NAN;
    CU_ASSERT_EQUAL(optim_init(&o, 4, &hp, NULL), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "lr") != NULL);
    hp = hp_base();
    hp.min_lr_ratio = 1.5;
    CU_ASSERT_EQUAL(optim_init(&o, 4, &hp, NULL), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "min_lr_ratio") != NULL);
}

static void test_hp_from_config(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    c.learner.steps = 7;
    c.learner.ppo_epochs = 2;
    c.learner.minibatches = 3;
    c.learner.adam_eps = 1e-6;
    optim_hp_t hp = optim_hp_from_config(&c.learner);
    CU_ASSERT_EQUAL(hp.total_steps, 42);
    CU_ASSERT_EQUAL(hp.eps, 1e-6);
    CU_ASSERT_EQUAL(hp.lr, c.learner.lr);
    CU_ASSERT_EQUAL(hp.grad_clip, c.learner.grad_clip);
    config_free(&c);
}

/* ---- save and load ---- */

static int read_file(const char *path, unsigned char **buf, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    *buf = malloc(*len + 16);
    size_t got = fread(*buf, 1, *len, f);
    fclose(f);
    return got == *len ? 0 : -1;
}

static int write_file(const char *path, const unsigned char *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t put = fwrite(buf, 1, len, f);
    fclose(f);
    return put == len ? 0 : -1;
}

static void test_save_load_round_trip(void) {
    enum { N = 300 };
    char dir[512], path[600], tmp[620];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(path, sizeof path, "%s/optim.bin", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    optim_hp_t hp = hp_base();
    optim_t a, b;
    float pa[N], pb[N], g[N];
    CU_ASSERT_EQUAL_FATAL(optim_init(&a, N, &hp, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(optim_init(&b, N, &hp, NULL), 0);
    tu_fill(pa, N, 1, -1, 1);
    fill_state(&a, pa, g, N, 5);
    g[3] = NAN;
    CU_ASSERT_EQUAL(optim_step(&a, pa, g, 1.0, NULL, NULL), 0); /* skipped 1 */
    CU_ASSERT_EQUAL(optim_save(&a, path), 0);
    CU_ASSERT(access(tmp, F_OK) != 0); /* renamed away */
    unsigned char *buf = NULL;
    size_t len = 0;
    CU_ASSERT_FATAL(read_file(path, &buf, &len) == 0);
    CU_ASSERT_EQUAL(len, 48 + 8 * N);
    CU_ASSERT(memcmp(buf, "MOERLOPT", 8) == 0);
    CU_ASSERT_EQUAL(optim_load(&b, path), 0);
    CU_ASSERT_EQUAL(b.step, 5);
    CU_ASSERT_EQUAL(b.skipped, 1);
    CU_ASSERT_EQUAL(memcmp(a.m, b.m, N * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(a.v, b.v, N * sizeof(float)), 0);
    /* both continue identically */
    memcpy(pb, pa, sizeof pa);
    float g2[N];
    tu_fill(g, N, 77, -0.1f, 0.1f);
    memcpy(g2, g, sizeof g);
    CU_ASSERT_EQUAL(optim_step(&a, pa, g, 1.0, NULL, NULL), 0);
    CU_ASSERT_EQUAL(optim_step(&b, pb, g2, 1.0, NULL, NULL), 0);
    CU_ASSERT_EQUAL(memcmp(pa, pb, sizeof pa), 0);
    free(buf);
    optim_free(&a);
    optim_free(&b);
    tu_rmtree(dir);
}

/* Loads a modified copy of a good file; the target's state must not change. */
static void expect_load_error(optim_t *o, const char *path, const unsigned char *buf, size_t len,
                              int want_rc, const char *want_msg) {
    CU_ASSERT_FATAL(write_file(path, buf, len) == 0);
    float m0 = o->m[0];
    int64_t step0 = o->step;
    int rc = optim_load(o, path);
    if (rc != want_rc || strstr(mo_last_error(), want_msg) == NULL)
        tu_report("load: rc %d (%s), want %d and \"%s\"", rc, mo_last_error(), want_rc, want_msg);
    CU_ASSERT_EQUAL(rc, want_rc);
    CU_ASSERT(strstr(mo_last_error(), want_msg) != NULL);
    CU_ASSERT(o->m[0] == m0 && o->step == step0);
}

static void test_corrupt_files(void) {
    enum { N = 40 };
    char dir[512], good[600], bad[600];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(good, sizeof good, "%s/good.bin", dir);
    snprintf(bad, sizeof bad, "%s/bad.bin", dir);
    optim_hp_t hp = hp_base();
    optim_t a, b, c;
    float p[N], g[N];
    CU_ASSERT_EQUAL_FATAL(optim_init(&a, N, &hp, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(optim_init(&b, N, &hp, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(optim_init(&c, N + 1, &hp, NULL), 0);
    tu_fill(p, N, 2, -1, 1);
    fill_state(&a, p, g, N, 2);
    fill_state(&b, p, g, N, 1); /* b holds other values, to see it unchanged */
    CU_ASSERT_EQUAL_FATAL(optim_save(&a, good), 0);
    unsigned char *buf = NULL, *mod;
    size_t len = 0;
    CU_ASSERT_FATAL(read_file(good, &buf, &len) == 0);
    mod = malloc(len + 16);

    memcpy(mod, buf, len);
    mod[48 + 4 * N + 5] ^= 0x10; /* a bit of v */
    expect_load_error(&b, bad, mod, len, MO_EMALFORMED, "checksum");
    memcpy(mod, buf, len);
    mod[24] ^= 0x01; /* step */
    expect_load_error(&b, bad, mod, len, MO_EMALFORMED, "checksum");
    memcpy(mod, buf, len);
    mod[0] = 'X';
    expect_load_error(&b, bad, mod, len, MO_EMALFORMED, "magic");
    memcpy(mod, buf, len);
    mod[8] = 2;
    expect_load_error(&b, bad, mod, len, MO_EUNSUPPORTED, "version 2");
    memcpy(mod, buf, len);
    mod[12] = 64;
    expect_load_error(&b, bad, mod, len, MO_EMALFORMED, "header of 64 bytes");
    expect_load_error(&b, bad, buf, len - 4, MO_EMALFORMED, "expected");
    expect_load_error(&b, bad, buf, 20, MO_EMALFORMED, "shorter than");
    memcpy(mod, buf, len);
    memset(mod + len, 0, 8);
    expect_load_error(&b, bad, mod, len + 8, MO_EMALFORMED, "expected");
    memcpy(mod, buf, len);
    mod[31] = 0x80; /* negative step; checked before the checksum */
    expect_load_error(&b, bad, mod, len, MO_EMALFORMED, "step");
    /* another optimizer size */
    CU_ASSERT_EQUAL(optim_load(&c, good), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "holds 40 parameters") != NULL);
    /* missing file, unwritable place */
    char missing[640];
    snprintf(missing, sizeof missing, "%s/none/optim.bin", dir);
    CU_ASSERT_EQUAL(optim_load(&b, missing), MO_EIO);
    CU_ASSERT(strstr(mo_last_error(), "none/optim.bin") != NULL);
    CU_ASSERT_EQUAL(optim_save(&a, missing), MO_EIO);
    /* the good file still loads */
    CU_ASSERT_EQUAL(optim_load(&b, good), 0);
    CU_ASSERT_EQUAL(memcmp(a.v, b.v, N * sizeof(float)), 0);
    free(buf);
    free(mod);
    optim_free(&a);
    optim_free(&b);
    optim_free(&c);
    tu_rmtree(dir);
}

/* Weight decay off on chosen ranges (optim_no_decay): over a few clipped steps with
 * weight decay, those elements move exactly as with weight decay 0 and the others
 * exactly as with no range set; the decay did change the others. Bad ranges are
 * refused with both named. */
static void test_no_decay_ranges(void) {
    enum { N = 64, STEPS = 3 };
    optim_hp_t hp = hp_base(), hp0 = hp_base();
    hp.weight_decay = 0.2;
    hp0.weight_decay = 0.0;
    optim_t a, b, c; /* ranges with decay, no decay, decay everywhere */
    CU_ASSERT_EQUAL_FATAL(optim_init(&a, N, &hp, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(optim_init(&b, N, &hp0, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(optim_init(&c, N, &hp, NULL), 0);
    CU_ASSERT_EQUAL(optim_no_decay(&a, 40, 5), 0);
    CU_ASSERT_EQUAL(optim_no_decay(&a, 10, 10), 0); /* before the first: kept sorted */
    CU_ASSERT_EQUAL(optim_no_decay(&a, 30, 0), 0);  /* empty: ignored */
    CU_ASSERT_EQUAL(optim_no_decay(&a, 60, 4), 0);  /* up to the end */
    CU_ASSERT_EQUAL(optim_no_decay(&a, 15, 10), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "[15, 25)") && strstr(mo_last_error(), "[10, 20)"));
    CU_ASSERT_EQUAL(optim_no_decay(&a, 38, 3), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "[40, 45)") != NULL);
    CU_ASSERT_EQUAL(optim_no_decay(&a, 62, 4), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "64") != NULL);
    CU_ASSERT_EQUAL_FATAL(a.n_nd, 3);
    CU_ASSERT(a.nd_off[0] == 10 && a.nd_off[1] == 40 && a.nd_off[2] == 60);
    float pa[N], pb[N], pc[N], g[N], ga[N], gb[N], gc[N];
    tu_fill(pa, N, 1, -1.0f, 1.0f);
    memcpy(pb, pa, sizeof pa);
    memcpy(pc, pa, sizeof pa);
    for (int s = 0; s < STEPS; s++) {
        tu_fill(g, N, 10 + (uint64_t)s, -1.0f, 1.0f);
        memcpy(ga, g, sizeof g);
        memcpy(gb, g, sizeof g);
        memcpy(gc, g, sizeof g);
        CU_ASSERT_EQUAL_FATAL(optim_step(&a, pa, ga, 1.0, NULL, NULL), 0);
        CU_ASSERT_EQUAL_FATAL(optim_step(&b, pb, gb, 1.0, NULL, NULL), 0);
        CU_ASSERT_EQUAL_FATAL(optim_step(&c, pc, gc, 1.0, NULL, NULL), 0);
    }
    int in_range_ok = 1, outside_ok = 1, decayed = 0;
    for (int i = 0; i < N; i++) {
        int nd = (i >= 10 && i < 20) || (i >= 40 && i < 45) || i >= 60;
        if (nd)
            in_range_ok &= pa[i] == pb[i] && a.m[i] == b.m[i] && a.v[i] == b.v[i];
        else
            outside_ok &= pa[i] == pc[i], decayed += pa[i] != pb[i];
    }
    CU_ASSERT(in_range_ok);
    CU_ASSERT(outside_ok);
    CU_ASSERT_EQUAL(decayed, N - 19);
    optim_free(&a);
    CU_ASSERT_PTR_NULL(a.nd_off);
    CU_ASSERT_EQUAL(a.n_nd, 0);
    optim_free(&b);
    optim_free(&c);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"adamw with clipping and schedule vs reference", test_adamw_vs_reference},
        {"clip coefficient", test_clip_coefficient},
        {"schedule values", test_schedule_values},
        {"non-finite values skip the step", test_nonfinite_skips},
        {"init errors", test_init_errors},
        {"hyperparameters from config", test_hp_from_config},
        {"save and load round trip", test_save_load_round_trip},
        {"corrupt files", test_corrupt_files},
        {"no weight decay on chosen ranges", test_no_decay_ranges},
        CU_TEST_INFO_NULL,
    };
    return tu_main("optim", tests);
}
