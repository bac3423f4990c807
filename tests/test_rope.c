/* Tests for RoPE: rope_init against the formulas of transformers'
 * modeling_rope_utils (written out in double here, plus values that
 * PyTorch float32 gives for the same code), and the CPU rotation against a
 * double reference and central differences. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"
#include "tests/testutil.h"

/* Element-wise relative tolerances for frequencies (f32 rounding of a double
 * formula; PyTorch evaluates it in f32, hence the looser golden tolerance),
 * normalised tolerances for the rotation (angles in f32 as the kernel defines
 * them, then f32 cos/sin and products) and its gradient (linear in x). */
#define TOL_FREQ 1e-6
#define TOL_GOLDEN 1e-5
#define TOL_FWD 1e-6
#define TOL_GRAD 1e-6
#define FD_H 1e-3

/* max_i |a_i - b_i| / |b_i|. */
static double max_rel(const float *a, const double *b, int n) {
    double m = 0.0;
    for (int i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]) / fabs(b[i]);
        if (!(e <= m))
            m = isnan(e) ? INFINITY : e;
    }
    return m;
}

/* ---- reference formulas (modeling_rope_utils, in double) ---- */

/* _compute_default_rope_parameters */
static void ref_default(double *inv, int dim, double base) {
    for (int i = 0; i < dim / 2; i++)
        inv[i] = 1.0 / pow(base, (double)(2 * i) / dim);
}

/* _compute_llama3_parameters */
static void ref_llama3(double *inv, int dim, double base, double factor, double low_freq_factor,
                       double high_freq_factor, double old_context_len) {
    ref_default(inv, dim, base);
    double low_freq_wavelen = old_context_len / low_freq_factor;
    double high_freq_wavelen = old_context_len / high_freq_factor;
    for (int i = 0; i < dim / 2; i++) {
        double wavelen = 2.0 * M_PI / inv[i];
        double inv_llama = wavelen > low_freq_wavelen ? inv[i] / factor : inv[i];
        double smooth_factor =
            (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        double smoothed = (1.0 - smooth_factor) * inv_llama / factor + smooth_factor * inv_llama;
        int is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
        inv[i] = is_medium ? smoothed : inv_llama;
    }
}

static double get_mscale(double scale, double mscale) {
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

static double find_correction_dim(double num_rotations, int dim, double base, double max_pos) {
    return (dim * log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

/* _compute_yarn_parameters (truncate = True); returns attention_factor.
 * mscale, mscale_all_dim, attention_factor: 0 when absent. */
static double ref_yarn(double *inv, int dim, double base, double factor, double orig,
                       double beta_fast, double beta_slow, double mscale, double mscale_all_dim,
                       double attention_factor, int *low_out, int *high_out) {
    if (attention_factor == 0.0)
        attention_factor = (mscale != 0.0 && mscale_all_dim != 0.0)
                               ? get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                               : get_mscale(factor, 1.0);
    double low = floor(find_correction_dim(beta_fast, dim, base, orig));
    double high = ceil(find_correction_dim(beta_slow, dim, base, orig));
    low = low > 0.0 ? low : 0.0;
    high = high < dim - 1 ? high : dim - 1;
    *low_out = (int)low;
    *high_out = (int)high;
    if (low == high)
        high += 0.001;
    for (int i = 0; i < dim / 2; i++) {
        double pos_freq = pow(base, (double)(2 * i) / dim);
        double extra = 1.0 / pos_freq, inter = 1.0 / (factor * pos_freq);
        double ramp = ((double)i - low) / (high - low);
        ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
        double extra_factor = 1.0 - ramp;
        inv[i] = inter * (1.0 - extra_factor) + extra * extra_factor;
    }
    return attention_factor;
}

/* ---- rope_init ---- */

static void test_init_default_linear(void) {
    float inv[64], ms = NAN;
    double ref[64];
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 128, 10000.0f, NULL), MO_OK);
    ref_default(ref, 128, 10000.0);
    TU_ASSERT_CLOSE(max_rel(inv, ref, 64), TOL_FREQ, "default");
    CU_ASSERT(ms == 1.0f);
    CU_ASSERT(inv[0] == 1.0f);

    rope_scaling_t sc = {.type = ROPE_DEFAULT};
    tu_poison(inv, 64);
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 128, 10000.0f, &sc), MO_OK);
    TU_ASSERT_CLOSE(max_rel(inv, ref, 64), TOL_FREQ, "default (explicit)");

    sc.type = ROPE_LINEAR;
    sc.factor = 4.0f;
    ms = NAN;
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 64, 1e6f, &sc), MO_OK);
    ref_default(ref, 64, 1e6);
    for (int i = 0; i < 32; i++)
        ref[i] /= 4.0;
    TU_ASSERT_CLOSE(max_rel(inv, ref, 32), TOL_FREQ, "linear");
    CU_ASSERT(ms == 1.0f);
}

static void test_init_llama3(void) {
    /* Llama 3.1 8B: theta 500000, head dim 128, factor 8, 1 / 4, 8192. */
    rope_scaling_t sc = {.type = ROPE_LLAMA3,
                         .factor = 8.0f,
                         .low_freq_factor = 1.0f,
                         .high_freq_factor = 4.0f,
                         .original_max_position = 8192};
    float inv[64], ms = NAN;
    double ref[64];
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 128, 500000.0f, &sc), MO_OK);
    ref_llama3(ref, 128, 500000.0, 8.0, 1.0, 4.0, 8192.0);
    TU_ASSERT_CLOSE(max_rel(inv, ref, 64), TOL_FREQ, "llama3");
    CU_ASSERT(ms == 1.0f);
    /* PyTorch float32, same formula: high, medium (27..35) and low bands. */
    static const struct {
        int i;
        double v;
    } golden[] = {
        {0, 1.0},
        {5, 3.587302268e-01},
        {20, 1.656044088e-02},
        {27, 3.942275885e-03},
        {28, 3.211446106e-03},
        {29, 2.166570630e-03},
        {30, 1.371893683e-03},
        {31, 8.567514597e-04},
        {32, 5.248460220e-04},
        {33, 3.126936499e-04},
        {34, 1.785077911e-04},
        {35, 9.556212171e-05},
        {40, 3.428102355e-05},
        {47, 8.160727702e-06},
        {60, 5.677088097e-07},
        {63, 3.068925878e-07},
    };
    for (size_t k = 0; k < sizeof golden / sizeof golden[0]; k++)
        TU_ASSERT_CLOSE(max_rel(&inv[golden[k].i], &golden[k].v, 1), TOL_GOLDEN, "llama3 golden");
    /* Other factors and rot below the head dim. */
    rope_scaling_t sc2 = sc;
    sc2.factor = 32.0f;
    sc2.low_freq_factor = 0.5f;
    sc2.high_freq_factor = 3.0f;
    sc2.original_max_position = 4096;
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 48, 10000.0f, &sc2), MO_OK);
    ref_llama3(ref, 48, 10000.0, 32.0, 0.5, 3.0, 4096.0);
    TU_ASSERT_CLOSE(max_rel(inv, ref, 24), TOL_FREQ, "llama3 other");
}

static void check_yarn(const char *name, int rot, float theta, rope_scaling_t sc) {
    float inv[128], ms = NAN;
    double ref[128];
    int lo, hi;
    CU_ASSERT_EQUAL(rope_init(inv, &ms, rot, theta, &sc), MO_OK);
    double bf = sc.beta_fast != 0.0f ? sc.beta_fast : 32.0;
    double bs = sc.beta_slow != 0.0f ? sc.beta_slow : 1.0;
    double af = ref_yarn(ref, rot, theta, sc.factor, sc.original_max_position, bf, bs, sc.mscale,
                         sc.mscale_all_dim, sc.attention_factor, &lo, &hi);
    TU_ASSERT_CLOSE(max_rel(inv, ref, rot / 2), TOL_FREQ, name);
    TU_ASSERT_CLOSE(fabs(ms - af) / af, TOL_FREQ, name);
}

static void test_init_yarn(void) {
    /* DeepSeek-V3: rope dim 64, theta 10000, factor 40, original 4096,
     * mscale = mscale_all_dim = 1 (attention factor 1). */
    rope_scaling_t ds = {.type = ROPE_YARN,
                         .factor = 40.0f,
                         .original_max_position = 4096,
                         .beta_fast = 32.0f,
                         .beta_slow = 1.0f,
                         .mscale = 1.0f,
                         .mscale_all_dim = 1.0f};
    check_yarn("yarn deepseek-v3", 64, 10000.0f, ds);
    float inv[64], ms;
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 64, 10000.0f, &ds), MO_OK);
    CU_ASSERT(ms == 1.0f);
    /* PyTorch float32 values; the correction range is dims 10 .. 23. */
    static const struct {
        int i;
        double v;
    } golden[] = {
        {0, 1.0},
        {5, 2.371373624e-01},
        {10, 5.623412877e-02},
        {11, 3.900692612e-02},
        {12, 2.687936090e-02},
        {15, 8.334509097e-03},
        {16, 5.500000436e-03},
        {20, 7.905694074e-04},
        {22, 1.778279402e-04},
        {23, 3.333803397e-05},
        {31, 3.333803534e-06},
    };
    for (size_t k = 0; k < sizeof golden / sizeof golden[0]; k++)
        TU_ASSERT_CLOSE(max_rel(&inv[golden[k].i], &golden[k].v, 1), TOL_GOLDEN, "yarn golden");
    int lo, hi;
    double ref[32];
    ref_yarn(ref, 64, 10000.0, 40.0, 4096.0, 32.0, 1.0, 1.0, 1.0, 0.0, &lo, &hi);
    CU_ASSERT(lo == 10 && hi == 23);

    /* Qwen-style: factor 4, original 32768, no mscale: 0.1 ln 4 + 1. */
    rope_scaling_t qw = {.type = ROPE_YARN, .factor = 4.0f, .original_max_position = 32768};
    check_yarn("yarn qwen (default betas)", 128, 1e6f, qw);
    float inv2[64];
    CU_ASSERT_EQUAL(rope_init(inv2, &ms, 128, 1e6f, &qw), MO_OK);
    TU_ASSERT_CLOSE(fabs(ms - 1.13862944) / 1.13862944, TOL_GOLDEN, "yarn qwen mscale");
    double g40 = 4.445698505e-05, g25 = 4.131738096e-03;
    TU_ASSERT_CLOSE(max_rel(&inv2[40], &g40, 1), TOL_GOLDEN, "yarn qwen golden 40");
    TU_ASSERT_CLOSE(max_rel(&inv2[25], &g25, 1), TOL_GOLDEN, "yarn qwen golden 25");

    /* mscale != mscale_all_dim gives their ratio. */
    rope_scaling_t ms2 = ds;
    ms2.mscale = 0.707f;
    check_yarn("yarn mscale ratio", 64, 10000.0f, ms2);
    CU_ASSERT_EQUAL(rope_init(inv, &ms, 64, 10000.0f, &ms2), MO_OK);
    TU_ASSERT_CLOSE(fabs(ms - 0.921042355) / 0.921042355, TOL_GOLDEN, "yarn mscale ratio value");
    /* Only one of them set: the plain mscale. */
    rope_scaling_t ms1 = ds;
    ms1.mscale_all_dim = 0.0f;
    check_yarn("yarn mscale alone", 64, 10000.0f, ms1);
    /* An explicit attention factor wins. */
    rope_scaling_t af = qw;
    af.attention_factor = 0.8f;
    check_yarn("yarn attention_factor", 128, 1e6f, af);
    CU_ASSERT_EQUAL(rope_init(inv2, &ms, 128, 1e6f, &af), MO_OK);
    CU_ASSERT(ms == 0.8f);
    /* factor <= 1: no attention scaling; other betas; partial rotary dim. */
    rope_scaling_t f1 = {.type = ROPE_YARN,
                         .factor = 1.0f,
                         .original_max_position = 2048,
                         .beta_fast = 16.0f,
                         .beta_slow = 2.0f};
    check_yarn("yarn factor 1", 32, 10000.0f, f1);
    rope_scaling_t odd = {.type = ROPE_YARN,
                          .factor = 8.0f,
                          .original_max_position = 8192,
                          .beta_fast = 64.0f,
                          .beta_slow = 0.5f};
    check_yarn("yarn rot 40", 40, 50000.0f, odd);
    /* A correction range collapsed to one dimension (beta_fast = beta_slow). */
    rope_scaling_t eq = qw;
    eq.beta_fast = eq.beta_slow = 4.0f;
    check_yarn("yarn equal betas", 128, 1e6f, eq);
}

static void expect_einval(const char *case_name, int rot, float theta, rope_scaling_t sc,
                          const char *field) {
    float inv[64], ms;
    mo_clear_error();
    int rc = rope_init(inv, &ms, rot, theta, &sc);
    if (rc != MO_EINVAL || !strstr(mo_last_error(), field))
        tu_report("%s: rc %d, message '%s' (expected '%s')", case_name, rc, mo_last_error(), field);
    CU_ASSERT_EQUAL(rc, MO_EINVAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), field));
}

static void test_init_errors(void) {
    rope_scaling_t none = {.type = ROPE_DEFAULT};
    rope_scaling_t lin = {.type = ROPE_LINEAR, .factor = 2.0f};
    rope_scaling_t l3 = {.type = ROPE_LLAMA3,
                         .factor = 8.0f,
                         .low_freq_factor = 1.0f,
                         .high_freq_factor = 4.0f,
                         .original_max_position = 8192};
    rope_scaling_t yn = {.type = ROPE_YARN, .factor = 4.0f, .original_max_position = 4096};
    expect_einval("odd rot", 63, 10000.0f, none, "rotary dimension");
    expect_einval("zero rot", 0, 10000.0f, none, "rotary dimension");
    expect_einval("theta", 64, 0.0f, none, "rope_theta");
    rope_scaling_t b = lin;
    b.factor = 0.0f;
    expect_einval("linear factor 0", 64, 10000.0f, b, "factor");
    b.factor = -2.0f;
    expect_einval("linear factor < 0", 64, 10000.0f, b, "factor");
    b = l3;
    b.factor = -1.0f;
    expect_einval("llama3 factor", 64, 10000.0f, b, "factor");
    b = l3;
    b.low_freq_factor = 4.0f;
    expect_einval("llama3 low >= high", 64, 10000.0f, b, "low_freq_factor");
    b = l3;
    b.low_freq_factor = 0.0f;
    expect_einval("llama3 low 0", 64, 10000.0f, b, "low_freq_factor");
    b = l3;
    b.original_max_position = 0;
    expect_einval("llama3 original", 64, 10000.0f, b, "original_max_position_embeddings");
    b = yn;
    b.factor = 0.0f;
    expect_einval("yarn factor", 64, 10000.0f, b, "factor");
    b = yn;
    b.original_max_position = -5;
    expect_einval("yarn original", 64, 10000.0f, b, "original_max_position_embeddings");
    b = yn;
    b.beta_fast = 1.0f;
    b.beta_slow = 8.0f;
    expect_einval("yarn betas", 64, 10000.0f, b, "beta_fast");
    b = yn;
    b.mscale = -1.0f;
    expect_einval("yarn mscale", 64, 10000.0f, b, "mscale");
    b = yn;
    b.attention_factor = -0.5f;
    expect_einval("yarn attention_factor", 64, 10000.0f, b, "attention_factor");
    b = yn;
    b.type = (rope_type_t)17;
    expect_einval("type", 64, 10000.0f, b, "type");
}

/* ---- the rotation ---- */

typedef struct {
    int N, H, Dh, rot;
    float mscale;
} rshape_t;

static const rshape_t g_shapes[] = {
    {1, 1, 2, 2, 1.0f},   {3, 2, 8, 8, 1.0f},     {5, 3, 10, 6, 1.3f},
    {4, 2, 64, 32, 0.9f}, {2, 1, 260, 258, 1.0f}, {9, 4, 128, 64, 1.0f},
};
#define NSHAPES (int)(sizeof g_shapes / sizeof g_shapes[0])

/* out (N, H, Dh) = rotation of x; angles rounded to f32 as the kernel defines them. */
static void ref_rope(double *out, const double *x, const int32_t *pos, const float *inv_freq,
                     double mscale, int N, int H, int Dh, int rot) {
    int half = rot / 2;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const double *xi = x + ((size_t)n * H + h) * Dh;
            double *oi = out + ((size_t)n * H + h) * Dh;
            for (int i = 0; i < half; i++) {
                float a = (float)pos[n] * inv_freq[i];
                double c = cos((double)a) * mscale, s = sin((double)a) * mscale;
                oi[i] = xi[i] * c - xi[i + half] * s;
                oi[i + half] = xi[i + half] * c + xi[i] * s;
            }
            for (int d = rot; d < Dh; d++)
                oi[d] = xi[d];
        }
}

static void make_case(rshape_t s, uint64_t seed, float *inv, int32_t *pos) {
    float theta = 10000.0f, ms;
    CU_ASSERT_EQUAL(rope_init(inv, &ms, s.rot, theta, NULL), MO_OK);
    float *u = malloc((size_t)s.N * sizeof(float));
    tu_fill(u, (size_t)s.N, seed, 0.0f, 5000.0f);
    for (int n = 0; n < s.N; n++)
        pos[n] = n == 0 ? 0 : (int32_t)u[n];
    free(u);
}

static void test_forward(void) {
    for (int si = 0; si < NSHAPES; si++) {
        rshape_t s = g_shapes[si];
        size_t n = (size_t)s.N * s.H * s.Dh;
        float *inv = malloc((size_t)s.rot / 2 * sizeof(float));
        int32_t *pos = malloc((size_t)s.N * sizeof(int32_t));
        make_case(s, 70 + si, inv, pos);
        float *x = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));
        double *xd = malloc(n * sizeof(double)), *ref = malloc(n * sizeof(double));
        tu_fill(x, n, 80 + si, -1.0f, 1.0f);
        for (size_t i = 0; i < n; i++)
            xd[i] = x[i];
        tu_poison(out, n);
        cpu_rope_forward(out, x, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
        ref_rope(ref, xd, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
        char what[96];
        snprintf(what, sizeof what, "forward N=%d H=%d Dh=%d rot=%d", s.N, s.H, s.Dh, s.rot);
        TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, n, 1e-3), TOL_FWD, what);
        /* Token 0 sits at position 0: rotated dims scaled by mscale, others as is. */
        for (int h = 0; h < s.H; h++)
            for (int d = 0; d < s.Dh; d++) {
                float e = d < s.rot ? x[h * s.Dh + d] * s.mscale : x[h * s.Dh + d];
                CU_ASSERT(out[h * s.Dh + d] == e);
            }
        /* In place gives the same bits. */
        cpu_rope_forward(x, x, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
        CU_ASSERT(memcmp(x, out, n * sizeof(float)) == 0);
        free(inv), free(pos), free(x), free(out), free(xd), free(ref);
    }
}

/* All positions 0 and mscale 1: the identity. */
static void test_position_zero_identity(void) {
    enum { N = 3, H = 2, Dh = 12, rot = 8 };
    float inv[rot / 2], ms, x[N * H * Dh], out[N * H * Dh];
    int32_t pos[N] = {0, 0, 0};
    CU_ASSERT_EQUAL(rope_init(inv, &ms, rot, 10000.0f, NULL), MO_OK);
    tu_fill(x, N * H * Dh, 3, -1.0f, 1.0f);
    tu_poison(out, N * H * Dh);
    cpu_rope_forward(out, x, pos, inv, 1.0f, N, H, Dh, rot);
    CU_ASSERT(memcmp(out, x, sizeof x) == 0);
}

static double ref_loss(double *tmp, const double *x, const double *G, const int32_t *pos,
                       const float *inv, rshape_t s) {
    ref_rope(tmp, x, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
    double L = 0.0;
    for (size_t i = 0; i < (size_t)s.N * s.H * s.Dh; i++)
        L += tmp[i] * G[i];
    return L;
}

static void test_backward_fd(void) {
    for (int si = 0; si < NSHAPES; si++) {
        rshape_t s = g_shapes[si];
        size_t n = (size_t)s.N * s.H * s.Dh;
        float *inv = malloc((size_t)s.rot / 2 * sizeof(float));
        int32_t *pos = malloc((size_t)s.N * sizeof(int32_t));
        make_case(s, 90 + si, inv, pos);
        float *dout = malloc(n * sizeof(float)), *dx = malloc(n * sizeof(float));
        double *xd = malloc(n * sizeof(double)), *G = malloc(n * sizeof(double));
        double *tmp = malloc(n * sizeof(double)), *fd = malloc(n * sizeof(double));
        double *expect = malloc(n * sizeof(double));
        tu_fill(dout, n, 100 + si, -1.0f, 1.0f);
        tu_fill_d(xd, n, 110 + si, -1.0, 1.0);
        for (size_t i = 0; i < n; i++)
            G[i] = dout[i];
        for (size_t i = 0; i < n; i++) {
            double keep = xd[i];
            xd[i] = keep + FD_H;
            double lp = ref_loss(tmp, xd, G, pos, inv, s);
            xd[i] = keep - FD_H;
            double lm = ref_loss(tmp, xd, G, pos, inv, s);
            xd[i] = keep;
            fd[i] = (lp - lm) / (2.0 * FD_H);
        }
        for (int pre = 0; pre < 2; pre++) {
            if (pre)
                tu_fill(dx, n, 120 + si, -2.0f, 2.0f);
            else
                memset(dx, 0, n * sizeof(float));
            for (size_t i = 0; i < n; i++)
                expect[i] = dx[i] + fd[i];
            cpu_rope_backward(dx, dout, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
            char what[96];
            snprintf(what, sizeof what, "dx N=%d H=%d Dh=%d rot=%d prefilled=%d", s.N, s.H, s.Dh,
                     s.rot, pre);
            TU_ASSERT_CLOSE(tu_rel_err_fd(dx, expect, n, 1e-3), TOL_GRAD, what);
        }
        cpu_rope_backward(NULL, dout, pos, inv, s.mscale, s.N, s.H, s.Dh, s.rot);
        free(inv), free(pos), free(dout), free(dx), free(xd), free(G), free(tmp), free(fd);
        free(expect);
    }
}

int main(void) {
    CU_TestInfo tests[] = {
        {"init: default and linear", test_init_default_linear},
        {"init: llama3", test_init_llama3},
        {"init: yarn", test_init_yarn},
        {"init: bad fields name the field", test_init_errors},
        {"forward vs double reference, position 0, in place", test_forward},
        {"forward: position 0 is the identity", test_position_zero_identity},
        {"backward: finite differences, accumulation", test_backward_fd},
        CU_TEST_INFO_NULL,
    };
    return tu_main("rope", tests);
}
