/* Tests for advantages: worked examples by hand for every estimator, flat
 * (equal-reward) groups, single-sample groups, dropped samples, a random
 * batch against direct double definitions, and overlong handling. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "learner/advantage.h"
#include "tests/testutil.h"

#define TOL 1e-6 /* f32 output of a double computation, relative */

static void check_vec(const float *got, const double *want, int n, const char *what) {
    TU_ASSERT_CLOSE(tu_rel_err_fd(got, want, (size_t)n, 1.0), TOL, what);
}

static int run(float *adv, const float *r, const uint8_t *keep, const int32_t *off, int ng,
               cfg_advantage_t kind, adv_stats_t *st) {
    adv_opts_t o = adv_opts_default(kind);
    tu_poison(adv, (size_t)off[ng]);
    return adv_compute(adv, r, keep, off, ng, &o, st);
}

static void test_grpo_worked(void) {
    /* group 0: {1, 0, 0, 1}: mean 1/2, sample std sqrt(4 * 1/4 / 3) = sqrt(1/3)
     * group 1: {0, 1, 2}:    mean 1,   sample std sqrt((1 + 0 + 1) / 2) = 1 */
    float r[7] = {1, 0, 0, 1, 0, 1, 2}, adv[7];
    int32_t off[3] = {0, 4, 7};
    double s0 = sqrt(1.0 / 3.0) + ADV_STD_EPS, s1 = 1.0 + ADV_STD_EPS;
    double want[7] = {0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / s1, 0, 1 / s1};
    adv_stats_t st;
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 2, CFG_ADV_GRPO, &st), 0);
    check_vec(adv, want, 7, "grpo");
    /* 0.5 / sqrt(1/3) = sqrt(3) / 2 = 0.8660254 */
    CU_ASSERT(fabs(adv[0] - 0.8660254) < 2e-6);
    CU_ASSERT_EQUAL(st.groups, 2);
    CU_ASSERT_EQUAL(st.flat_groups, 0);
    CU_ASSERT_EQUAL(st.kept, 7);
    CU_ASSERT(fabs(st.reward_mean - 5.0 / 7.0) < 1e-12);
    /* population std over the batch: mean 5/7, sum of squares 7 - 7 (5/7)^2 */
    CU_ASSERT(fabs(st.reward_std - sqrt((7.0 - 25.0 / 7.0) / 7.0)) < 1e-12);
    CU_ASSERT(fabs(st.adv_abs_max - 1 / s1) < 1e-6);
}

static void test_dr_grpo_worked(void) {
    float r[5] = {0, 1, 2, 3, 1}, adv[5];
    int32_t off[3] = {0, 3, 5};
    double want[5] = {-1, 0, 1, 1, -1};
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 2, CFG_ADV_DR_GRPO, NULL), 0);
    check_vec(adv, want, 5, "dr_grpo");
}

static void test_rloo_exact(void) {
    /* {1, 2, 6}: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5;
     * {0.25, 1}: 0.25 - 1 = -0.75, 1 - 0.25 = 0.75. */
    float r[5] = {1, 2, 6, 0.25f, 1}, adv[5];
    int32_t off[3] = {0, 3, 5};
    double want[5] = {-3, -1.5, 4.5, -0.75, 0.75};
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 2, CFG_ADV_RLOO, NULL), 0);
    for (int i = 0; i < 5; i++)
        CU_ASSERT_EQUAL(adv[i], (float)want[i]); /* exact in binary */
}

static void test_reinforce_worked(void) {
    /* batch mean of {1, 2, 3, 6} is 3, whatever the groups */
    float r[4] = {1, 2, 3, 6}, adv[4];
    int32_t off[3] = {0, 2, 4};
    double want[4] = {-2, -1, 0, 3};
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 2, CFG_ADV_REINFORCE, NULL), 0);
    check_vec(adv, want, 4, "reinforce");
    /* a group flat by itself still has signal against the batch */
    float r2[4] = {1, 1, 3, 3};
    double want2[4] = {-1, -1, 1, 1};
    adv_stats_t st;
    CU_ASSERT_EQUAL(run(adv, r2, NULL, off, 2, CFG_ADV_REINFORCE, &st), 0);
    check_vec(adv, want2, 4, "reinforce flat groups");
    CU_ASSERT_EQUAL(st.flat_groups, 2);
}

static void test_flat_groups(void) {
    /* exactly equal, equal within the tolerance, and just above it */
    float r[8] = {0.5f, 0.5f, 0.5f, 1.0f, 1.0f + 4e-7f, 1.0f, 1.0f, 1.01f};
    int32_t off[4] = {0, 3, 6, 8};
    float adv[8];
    cfg_advantage_t kinds[3] = {CFG_ADV_GRPO, CFG_ADV_DR_GRPO, CFG_ADV_RLOO};
    for (int k = 0; k < 3; k++) {
        adv_stats_t st;
        CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, kinds[k], &st), 0);
        for (int i = 0; i < 6; i++)
            CU_ASSERT_EQUAL(adv[i], 0.0f);
        CU_ASSERT(adv[6] < 0 && adv[7] > 0);
        CU_ASSERT_EQUAL(st.flat_groups, 2);
    }
    /* grpo on the last group: +-0.005 / (sample std 0.00707 + eps) = +-0.7071 */
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, CFG_ADV_GRPO, NULL), 0);
    CU_ASSERT(fabs(adv[7] - 0.70700) < 1e-3);
    uint8_t flat[3] = {9, 9, 9};
    CU_ASSERT_EQUAL(adv_flat_groups(flat, r, NULL, off, 3, ADV_EQUAL_TOL), 2);
    CU_ASSERT(flat[0] == 1 && flat[1] == 1 && flat[2] == 0);
    /* a tighter tolerance sees the 4e-7 spread */
    CU_ASSERT_EQUAL(adv_flat_groups(flat, r, NULL, off, 3, 1e-8), 1);
    CU_ASSERT(flat[0] == 1 && flat[1] == 0 && flat[2] == 0);
    /* reinforce over an entirely flat batch gives 0 */
    float rf[4] = {2, 2, 2, 2};
    int32_t off2[3] = {0, 2, 4};
    CU_ASSERT_EQUAL(run(adv, rf, NULL, off2, 2, CFG_ADV_REINFORCE, NULL), 0);
    for (int i = 0; i < 4; i++)
        CU_ASSERT_EQUAL(adv[i], 0.0f);
}

static void test_single_and_empty_groups(void) {
    /* a group of one, an empty group, a group of two */
    float r[3] = {5, 1, 2}, adv[3];
    int32_t off[4] = {0, 1, 1, 3};
    cfg_advantage_t kinds[3] = {CFG_ADV_GRPO, CFG_ADV_DR_GRPO, CFG_ADV_RLOO};
    for (int k = 0; k < 3; k++) {
        adv_stats_t st;
        CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, kinds[k], &st), 0);
        CU_ASSERT_EQUAL(adv[0], 0.0f);
        CU_ASSERT(adv[1] < 0 && adv[2] > 0);
        CU_ASSERT_EQUAL(st.flat_groups, 2);
    }
    /* rloo on {1, 2}: -1, 1; grpo: sample std of two values sqrt(0.5) */
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, CFG_ADV_RLOO, NULL), 0);
    CU_ASSERT(adv[1] == -1.0f && adv[2] == 1.0f);
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, CFG_ADV_GRPO, NULL), 0);
    CU_ASSERT(fabs(adv[2] - 0.5 / (sqrt(0.5) + ADV_STD_EPS)) < 1e-6);
    /* reinforce with G = 1 groups uses the batch: {5, 1, 2} mean 8/3 */
    CU_ASSERT_EQUAL(run(adv, r, NULL, off, 3, CFG_ADV_REINFORCE, NULL), 0);
    CU_ASSERT(fabs(adv[0] - 7.0 / 3.0) < 1e-6);
    /* an empty batch */
    int32_t off0[1] = {0};
    adv_stats_t st;
    adv_opts_t o = adv_opts_default(CFG_ADV_GRPO);
    CU_ASSERT_EQUAL(adv_compute(adv, r, NULL, off0, 0, &o, &st), 0);
    CU_ASSERT_EQUAL(st.samples, 0);
}

static void test_dropped_samples(void) {
    /* {1, 0, 0, 1} with the last dropped: kept {1, 0, 0}, mean 1/3,
     * sample std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) */
    float r[4] = {1, 0, 0, 1}, adv[4];
    uint8_t keep[4] = {1, 1, 1, 0};
    int32_t off[2] = {0, 4};
    double s = sqrt(1.0 / 3.0) + ADV_STD_EPS;
    double want_grpo[4] = {(2.0 / 3) / s, (-1.0 / 3) / s, (-1.0 / 3) / s, 0};
    double want_dr[4] = {2.0 / 3, -1.0 / 3, -1.0 / 3, 0};
    double want_rloo[4] = {1, -0.5, -0.5, 0};
    adv_stats_t st;
    CU_ASSERT_EQUAL(run(adv, r, keep, off, 1, CFG_ADV_GRPO, &st), 0);
    check_vec(adv, want_grpo, 4, "grpo dropped");
    CU_ASSERT_EQUAL(st.kept, 3);
    CU_ASSERT(fabs(st.reward_mean - 1.0 / 3) < 1e-12);
    CU_ASSERT_EQUAL(run(adv, r, keep, off, 1, CFG_ADV_DR_GRPO, NULL), 0);
    check_vec(adv, want_dr, 4, "dr_grpo dropped");
    CU_ASSERT_EQUAL(run(adv, r, keep, off, 1, CFG_ADV_RLOO, NULL), 0);
    check_vec(adv, want_rloo, 4, "rloo dropped");
    /* a NaN reward of a dropped sample is ignored; of a kept one, refused */
    r[3] = NAN;
    CU_ASSERT_EQUAL(run(adv, r, keep, off, 1, CFG_ADV_GRPO, NULL), 0);
    check_vec(adv, want_grpo, 4, "grpo dropped nan");
    keep[3] = 1;
    CU_ASSERT_EQUAL(run(adv, r, keep, off, 1, CFG_ADV_GRPO, NULL), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "sample 3") != NULL);
    /* only one kept sample left: no signal */
    uint8_t keep1[4] = {0, 0, 1, 0};
    r[3] = 1;
    CU_ASSERT_EQUAL(run(adv, r, keep1, off, 1, CFG_ADV_RLOO, &st), 0);
    for (int i = 0; i < 4; i++)
        CU_ASSERT_EQUAL(adv[i], 0.0f);
    CU_ASSERT_EQUAL(st.flat_groups, 1);
}

/* Direct double definitions, written independently of the library's forms. */
static void ref_adv(double *adv, const float *r, const uint8_t *keep, const int32_t *off, int ng,
                    cfg_advantage_t kind) {
    double bsum = 0;
    int bn = 0;
    for (int i = 0; i < off[ng]; i++)
        if (keep[i])
            bsum += r[i], bn++;
    for (int g = 0; g < ng; g++) {
        double sum = 0, ss = 0;
        int n = 0;
        for (int i = off[g]; i < off[g + 1]; i++)
            if (keep[i])
                sum += r[i], n++;
        double mean = n ? sum / n : 0;
        for (int i = off[g]; i < off[g + 1]; i++)
            if (keep[i])
                ss += (r[i] - mean) * (r[i] - mean);
        for (int i = off[g]; i < off[g + 1]; i++) {
            adv[i] = 0;
            if (!keep[i])
                continue;
            if (kind == CFG_ADV_REINFORCE) {
                adv[i] = r[i] - bsum / bn;
            } else if (n >= 2 && kind == CFG_ADV_RLOO) {
                double others = 0;
                for (int j = off[g]; j < off[g + 1]; j++)
                    if (keep[j] && j != i)
                        others += r[j];
                adv[i] = r[i] - others / (n - 1);
            } else if (n >= 2 && kind == CFG_ADV_GRPO) {
                adv[i] = (r[i] - mean) / (sqrt(ss / (n - 1)) + ADV_STD_EPS);
            } else if (n >= 2) {
                adv[i] = r[i] - mean;
            }
        }
    }
}

static void test_random_vs_reference(void) {
    enum { NG = 40, NMAX = 400 };
    int32_t off[NG + 1];
    float r[NMAX], adv[NMAX];
    uint8_t keep[NMAX];
    double want[NMAX];
    off[0] = 0;
    for (int g = 0; g < NG; g++)
        off[g + 1] = off[g] + 2 + (int)(rng_u32_to_unit((uint32_t)(g * 2654435761u)) * 8);
    int N = off[NG];
    CU_ASSERT_FATAL(N <= NMAX);
    tu_fill(r, (size_t)N, 11, -2.0f, 3.0f);
    float u[NMAX];
    tu_fill(u, (size_t)N, 12, 0.0f, 1.0f);
    for (int i = 0; i < N; i++) {
        keep[i] = u[i] > 0.15f;
        if (u[i] > 0.7f) /* binary rewards for some, as verifiers give */
            r[i] = r[i] > 0.5f ? 1.0f : 0.0f;
    }
    cfg_advantage_t kinds[4] = {CFG_ADV_GRPO, CFG_ADV_DR_GRPO, CFG_ADV_RLOO, CFG_ADV_REINFORCE};
    const char *names[4] = {"grpo random", "dr_grpo random", "rloo random", "reinforce random"};
    for (int k = 0; k < 4; k++) {
        CU_ASSERT_EQUAL(run(adv, r, keep, off, NG, kinds[k], NULL), 0);
        ref_adv(want, r, keep, off, NG, kinds[k]);
        check_vec(adv, want, N, names[k]);
    }
}

static void test_bad_input(void) {
    float r[3] = {1, 2, 3}, adv[3];
    int32_t off_bad[3] = {0, 2, 1}, off_nz[2] = {1, 3};
    adv_opts_t o = adv_opts_default(CFG_ADV_GRPO);
    CU_ASSERT_EQUAL(adv_compute(adv, r, NULL, off_bad, 2, &o, NULL), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "group_off[2]") != NULL);
    CU_ASSERT_EQUAL(adv_compute(adv, r, NULL, off_nz, 1, &o, NULL), MO_EINVAL);
    o.std_eps = -1;
    int32_t off[2] = {0, 3};
    CU_ASSERT_EQUAL(adv_compute(adv, r, NULL, off, 1, &o, NULL), MO_EINVAL);
    o = adv_opts_default((cfg_advantage_t)7);
    CU_ASSERT_EQUAL(adv_compute(adv, r, NULL, off, 1, &o, NULL), MO_EINVAL);
}

static void test_overlong_penalty_values(void) {
    /* L = 10, b = 4: no penalty up to 6 tokens, then -1/4 per token */
    CU_ASSERT_EQUAL(overlong_penalty(0, 10, 4), 0.0);
    CU_ASSERT_EQUAL(overlong_penalty(6, 10, 4), 0.0);
    CU_ASSERT_EQUAL(overlong_penalty(7, 10, 4), -0.25);
    CU_ASSERT_EQUAL(overlong_penalty(8, 10, 4), -0.5);
    CU_ASSERT_EQUAL(overlong_penalty(10, 10, 4), -1.0);
    CU_ASSERT_EQUAL(overlong_penalty(13, 10, 4), -1.0);
    /* b = L: the ramp spans the whole range */
    CU_ASSERT_EQUAL(overlong_penalty(5, 10, 10), -0.5);
}

static void test_overlong_apply(void) {
    float r[4] = {1, 0.5f, 1, 0};
    uint8_t keep[4] = {1, 1, 1, 1};
    int32_t len[4] = {3, 10, 8, 10};
    uint8_t fin[4] = {1, 0, 1, 0};
    overlong_stats_t st;
    /* keep: nothing changes */
    CU_ASSERT_EQUAL(overlong_apply(r, keep, len, fin, 4, CFG_OVERLONG_KEEP, 10, 4, &st), 0);
    CU_ASSERT(r[1] == 0.5f && keep[1] == 1 && st.truncated == 2 && st.dropped == 0);
    /* filter: the two unfinished samples are dropped, rewards untouched */
    CU_ASSERT_EQUAL(overlong_apply(r, keep, len, fin, 4, CFG_OVERLONG_FILTER, 10, 4, &st), 0);
    CU_ASSERT(keep[0] == 1 && keep[1] == 0 && keep[2] == 1 && keep[3] == 0);
    CU_ASSERT(st.dropped == 2 && r[1] == 0.5f);
    /* penalty: by length, finished or not */
    uint8_t keep2[4] = {1, 1, 1, 1};
    CU_ASSERT_EQUAL(overlong_apply(r, keep2, len, fin, 4, CFG_OVERLONG_PENALTY, 10, 4, &st), 0);
    CU_ASSERT(r[0] == 1.0f && r[1] == -0.5f && r[2] == 0.5f && r[3] == -1.0f);
    CU_ASSERT(st.penalised == 3 && fabs(st.penalty_sum + 2.5) < 1e-12);
    CU_ASSERT(keep2[1] == 1 && keep2[3] == 1);
    /* bad arguments */
    CU_ASSERT_EQUAL(overlong_apply(r, keep2, len, fin, 4, CFG_OVERLONG_PENALTY, 10, 0, NULL),
                    MO_EINVAL);
    CU_ASSERT_EQUAL(overlong_apply(r, keep2, len, fin, 4, CFG_OVERLONG_PENALTY, 10, 11, NULL),
                    MO_EINVAL);
    len[2] = -1;
    CU_ASSERT_EQUAL(overlong_apply(r, keep2, len, fin, 4, CFG_OVERLONG_FILTER, 10, 4, NULL),
                    MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "sample 2") != NULL);
}

static void test_mask_dropped(void) {
    int32_t off[4] = {0, 2, 5, 6};
    uint8_t keep[3] = {1, 0, 1};
    uint8_t mask[6] = {0, 1, 1, 1, 0, 1};
    adv_mask_dropped(mask, off, keep, 3);
    uint8_t want[6] = {0, 1, 0, 0, 0, 1};
    CU_ASSERT_EQUAL(memcmp(mask, want, 6), 0);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"grpo worked example", test_grpo_worked},
        {"dr_grpo worked example", test_dr_grpo_worked},
        {"rloo exact values", test_rloo_exact},
        {"reinforce worked example", test_reinforce_worked},
        {"flat groups", test_flat_groups},
        {"single and empty groups", test_single_and_empty_groups},
        {"dropped samples", test_dropped_samples},
        {"random batch vs reference", test_random_vs_reference},
        {"bad input", test_bad_input},
        {"overlong penalty values", test_overlong_penalty_values},
        {"overlong apply", test_overlong_apply},
        {"mask dropped samples", test_mask_dropped},
        CU_TEST_INFO_NULL,
    };
    return tu_main("advantage", tests);
}
