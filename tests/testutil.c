/* testutil: the CUnit runner and numerical helpers shared by the suites. */
#include "tests/testutil.h"

#include <CUnit/Basic.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/model.h"
#include "core/rng.h"
#include "lora/adapter.h"

int tu_main(const char *suite, CU_TestInfo *tests) {
    if (CU_initialize_registry() != CUE_SUCCESS)
        return 2;
    CU_SuiteInfo suites[] = {{(char *)suite, NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};
    if (CU_register_suites(suites) != CUE_SUCCESS) {
        fprintf(stderr, "cannot register suite %s: %s\n", suite, CU_get_error_msg());
        CU_cleanup_registry();
        return 2;
    }
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_tests_failed();
    unsigned run = CU_get_number_of_tests_run();
    CU_cleanup_registry();
    if (run == 0) {
        fprintf(stderr, "suite %s ran no test\n", suite);
        return 1;
    }
    return failed ? 1 : 0;
}

void tu_fill(float *x, size_t n, uint64_t seed, float lo, float hi) {
    rng_fill_uniform(x, n, seed, 0x7e57, lo, hi);
}

void tu_fill_d(double *x, size_t n, uint64_t seed, double lo, double hi) {
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * rng_uniform(seed, 0x7e57, i);
}

void tu_poison(float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = NAN;
}

double tu_rel_err_fd(const float *a, const double *b, size_t n, double floor) {
    double maxb = floor, maxd = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(b[i]) > maxb)
            maxb = fabs(b[i]);
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= maxd)) /* NaN propagates as failure */
            maxd = isnan(d) ? INFINITY : d;
    }
    return maxd / maxb;
}

double tu_rel_err_ff(const float *a, const float *b, size_t n, double floor) {
    double maxb = floor, maxd = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs((double)b[i]) > maxb)
            maxb = fabs((double)b[i]);
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= maxd))
            maxd = isnan(d) ? INFINITY : d;
    }
    return maxd / maxb;
}

void tu_report(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\n    ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

int tu_tmpdir(char *buf, size_t cap) {
    const char *base = getenv("TMPDIR");
    snprintf(buf, cap, "%s/moerl-test-XXXXXX", base && *base ? base : "/tmp");
    return mkdtemp(buf) ? 0 : -1;
}

void tu_rmtree(const char *path) {
    char cmd[4200];
    if (!path || !*path || strstr(path, "moerl-test-") == NULL)
        return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0)
        fprintf(stderr, "warning: could not remove %s\n", path);
}

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

const char *tu_source_dir(void) { return env_or("MOERL_SOURCE_DIR", "."); }
const char *tu_moerl_exe(void) { return env_or("MOERL_EXE", "./moerl"); }
const char *tu_python(void) { return env_or("MOERL_PYTHON", "/usr/bin/python3"); }

void tu_randomise_adapter(lora_adapter_t *ad, uint64_t seed) {
    for (int i = 0; i < ad->n_tensors; i++) {
        const lora_tensor_t *t = &ad->tensors[i];
        float amp = (i % 2) ? 0.3f : 0.2f;
        rng_fill_uniform(ad->params + t->offset, t->numel, seed, 100 + (uint64_t)i, -amp, amp);
    }
}

void tu_randomise_norms(model_t *m, uint64_t seed) {
    for (int l = 0; l < m->L; l++) {
        model_layer_t *ly = &m->layers[l];
        rng_fill_uniform((float *)ly->attn_norm, (size_t)m->D, seed, 10 + 4 * (uint64_t)l, 0.6f,
                         1.4f);
        rng_fill_uniform((float *)ly->mlp_norm, (size_t)m->D, seed, 11 + 4 * (uint64_t)l, 0.6f,
                         1.4f);
        if (!ly->q_norm || !ly->k_norm)
            continue;
        rng_fill_uniform((float *)ly->q_norm, (size_t)m->Dh, seed, 12 + 4 * (uint64_t)l, 0.6f,
                         1.4f);
        rng_fill_uniform((float *)ly->k_norm, (size_t)m->Dh, seed, 13 + 4 * (uint64_t)l, 0.6f,
                         1.4f);
    }
    rng_fill_uniform((float *)m->final_norm, (size_t)m->D, seed, 9, 0.6f, 1.4f);
}
