/* testutil: the CUnit runner shared by every suite, random inputs, and
 * closeness checks for numerical tests. */
#ifndef MOERL_TESTS_TESTUTIL_H
#define MOERL_TESTS_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include <CUnit/CUnit.h>

struct model;
struct lora_adapter;

/* Runs one suite in CUnit's basic mode; returns the process exit status
 * (0 when every test passed). */
int tu_main(const char *suite, CU_TestInfo *tests);

/* Deterministic uniform fill in [lo, hi) from (seed, i). */
void tu_fill(float *x, size_t n, uint64_t seed, float lo, float hi);
void tu_fill_d(double *x, size_t n, uint64_t seed, double lo, double hi);
/* Poisons a buffer with NaN so a kernel that forgets to write is caught. */
void tu_poison(float *x, size_t n);

/* max |a - b| / max(max |b|, floor): a normalised error. */
double tu_rel_err_fd(const float *a, const double *b, size_t n, double floor);
double tu_rel_err_ff(const float *a, const float *b, size_t n, double floor);

/* Asserts a normalised error is within tol, printing the value on failure. */
#define TU_ASSERT_CLOSE(err, tol, what)                                                            \
    do {                                                                                           \
        double tu_e_ = (err);                                                                      \
        if (!(tu_e_ <= (tol)))                                                                     \
            tu_report("%s: error %.3g > %.3g", (what), tu_e_, (double)(tol));                     \
        CU_ASSERT(tu_e_ <= (tol));                                                                 \
    } while (0)

void tu_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Runs expr (a status-returning call) and stops the test unless it returns 0, printing
 * the call, the code and the last error message. */
#define TU_CHECK_RC(expr)                                                                          \
    do {                                                                                           \
        int tu_rc_ = (expr);                                                                       \
        if (tu_rc_ != 0)                                                                           \
            tu_report("%s: %d (%s)", #expr, tu_rc_, mo_last_error());                              \
        CU_ASSERT_FATAL(tu_rc_ == 0);                                                              \
    } while (0)

/* A fresh temporary directory (removed by tu_rmtree); path written to buf. */
int tu_tmpdir(char *buf, size_t cap);
void tu_rmtree(const char *path);

/* The environment a test runs in (set by ctest): source tree, build tree,
 * the moerl executable, Debian's python3. Fallbacks suit a manual run. */
const char *tu_source_dir(void);
const char *tu_moerl_exe(void);
const char *tu_python(void);

/* Every tensor of ad uniform in [-0.2, 0.2) (A) and [-0.3, 0.3) (B), so that every path of
 * the adapter computes (B is zero after lora_adapter_new). */
void tu_randomise_adapter(struct lora_adapter *ad, uint64_t seed);
/* The model's norm weights (its own f32 copies) uniform in [0.6, 1.4): ones would hide a
 * wrong norm vector. */
void tu_randomise_norms(struct model *m, uint64_t seed);

#endif
