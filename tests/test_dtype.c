/* Tests of dtype: names and sizes, bit-exact conversions between f32 and
 * bf16, f16 and fp8-e4m3fn (known values, rounding to nearest even, specials),
 * exhaustive round trips, and the bulk converters. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"

static float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void test_names_and_sizes(void) {
    CU_ASSERT_EQUAL(dtype_size(DT_F32), 4);
    CU_ASSERT_EQUAL(dtype_size(DT_BF16), 2);
    CU_ASSERT_EQUAL(dtype_size(DT_F16), 2);
    CU_ASSERT_EQUAL(dtype_size(DT_F8E4M3), 1);
    CU_ASSERT_EQUAL(dtype_size(DT_I64), 8);
    CU_ASSERT_EQUAL(dtype_size(DT_COUNT), 0);
    for (int i = 0; i < DT_COUNT; i++) {
        dtype_t back = DT_COUNT;
        CU_ASSERT_EQUAL(dtype_from_name(dtype_name((dtype_t)i), &back), MO_OK);
        CU_ASSERT_EQUAL(back, (dtype_t)i);
        CU_ASSERT(dtype_size((dtype_t)i) > 0);
    }
    CU_ASSERT_STRING_EQUAL(dtype_name(DT_F8E4M3), "F8_E4M3");
    dtype_t dt;
    CU_ASSERT_EQUAL(dtype_from_name("F24", &dt), MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "F24") != NULL);
    CU_ASSERT(dtype_is_float(DT_BF16) && dtype_is_float(DT_F8E4M3));
    CU_ASSERT(!dtype_is_float(DT_I32) && !dtype_is_float(DT_F64));
}

static void test_bf16_known(void) {
    CU_ASSERT_EQUAL(f32_to_bf16(1.0f), 0x3f80);
    CU_ASSERT_EQUAL(bf16_to_f32(0x3f80), 1.0f);
    CU_ASSERT_EQUAL(f32_to_bf16(-2.0f), 0xc000);
    /* Ties to even both ways, and just off the tie. */
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x3f808000u)), 0x3f80);
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x3f818000u)), 0x3f82);
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x3f808001u)), 0x3f81);
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x3f807fffu)), 0x3f80);
    /* Largest finite bf16, and f32 values past it overflow to infinity. */
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x7f7f7fffu)), 0x7f7f);
    CU_ASSERT_EQUAL(bf16_to_f32(0x7f7f), bits_f(0x7f7f0000u));
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x7f7fffffu)), 0x7f80);
    CU_ASSERT_EQUAL(f32_to_bf16(-bits_f(0x7f7fffffu)), 0xff80);
    CU_ASSERT_EQUAL(f32_to_bf16(INFINITY), 0x7f80);
    CU_ASSERT_EQUAL(f32_to_bf16(-INFINITY), 0xff80);
    CU_ASSERT(isinf(bf16_to_f32(0x7f80)) && bf16_to_f32(0xff80) < 0);
    CU_ASSERT_EQUAL(f32_to_bf16(-0.0f), 0x8000);
    CU_ASSERT(signbit(bf16_to_f32(0x8000)) && bf16_to_f32(0x8000) == 0.0f);
    /* Subnormals: exact, tie to even down, tie to even up. */
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x00010000u)), 0x0001);
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x00008000u)), 0x0000);
    CU_ASSERT_EQUAL(f32_to_bf16(bits_f(0x00018000u)), 0x0002);
    CU_ASSERT_EQUAL(f_bits(bf16_to_f32(0x0001)), 0x00010000u);
    /* NaN stays NaN, including one whose payload sits in the low bits only. */
    CU_ASSERT(isnan(bf16_to_f32(f32_to_bf16(NAN))));
    CU_ASSERT(isnan(bf16_to_f32(f32_to_bf16(bits_f(0x7f800001u)))));
    CU_ASSERT(isnan(bf16_to_f32(f32_to_bf16(bits_f(0xff800001u)))));
}

static void test_f16_known(void) {
    CU_ASSERT_EQUAL(f32_to_f16(1.0f), 0x3c00);
    CU_ASSERT_EQUAL(f16_to_f32(0x3c00), 1.0f);
    CU_ASSERT_EQUAL(f32_to_f16(-2.0f), 0xc000);
    CU_ASSERT_EQUAL(f32_to_f16(65504.0f), 0x7bff);
    CU_ASSERT_EQUAL(f16_to_f32(0x7bff), 65504.0f);
    CU_ASSERT_EQUAL(f32_to_f16(bits_f(f_bits(65520.0f) - 1)), 0x7bff);
    CU_ASSERT_EQUAL(f32_to_f16(65520.0f), 0x7c00);
    CU_ASSERT_EQUAL(f32_to_f16(-65520.0f), 0xfc00);
    CU_ASSERT_EQUAL(f32_to_f16(1e10f), 0x7c00);
    CU_ASSERT_EQUAL(f32_to_f16(INFINITY), 0x7c00);
    CU_ASSERT_EQUAL(f32_to_f16(-INFINITY), 0xfc00);
    CU_ASSERT(isinf(f16_to_f32(0x7c00)) && f16_to_f32(0xfc00) < 0);
    CU_ASSERT_EQUAL(f32_to_f16(-0.0f), 0x8000);
    /* Subnormals: the smallest, ties to even, the carry into the first normal. */
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(1.0f, -24)), 0x0001);
    CU_ASSERT_EQUAL(f16_to_f32(0x0001), ldexpf(1.0f, -24));
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(1.0f, -25)), 0x0000);
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(3.0f, -25)), 0x0002);
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(-3.0f, -25)), 0x8002);
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(1023.5f, -24)), 0x0400);
    CU_ASSERT_EQUAL(f32_to_f16(ldexpf(1.0f, -14)), 0x0400);
    CU_ASSERT_EQUAL(f16_to_f32(0x03ff), ldexpf(1023.0f, -24));
    /* Ties to even among normals. */
    CU_ASSERT_EQUAL(f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00);
    CU_ASSERT_EQUAL(f32_to_f16(1.0f + ldexpf(3.0f, -11)), 0x3c02);
    CU_ASSERT(isnan(f16_to_f32(f32_to_f16(NAN))));
    CU_ASSERT(isnan(f16_to_f32(f32_to_f16(bits_f(0x7f800001u)))));
    CU_ASSERT(isnan(f16_to_f32(0x7e00)) && isnan(f16_to_f32(0xfc01)));
}

static void test_fp8_known(void) {
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(1.0f), 0x38);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(-1.0f), 0xb8);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(0.5f), 0x30);
    CU_ASSERT_EQUAL(fp8e4m3_to_f32(0xb8), -1.0f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(448.0f), 0x7e);
    CU_ASSERT_EQUAL(fp8e4m3_to_f32(0x7e), 448.0f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(-448.0f), 0xfe);
    /* 464 is halfway between 448 and the NaN code: ties to even gives 448;
     * anything larger rounds onto the NaN code (no infinities in e4m3fn). */
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(464.0f), 0x7e);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(bits_f(f_bits(464.0f) + 1)), 0x7f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(480.0f), 0x7f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(1e6f), 0x7f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(INFINITY), 0x7f);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(-INFINITY), 0xff);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(NAN), 0x7f);
    CU_ASSERT(isnan(fp8e4m3_to_f32(0x7f)) && isnan(fp8e4m3_to_f32(0xff)));
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(-0.0f), 0x80);
    CU_ASSERT(signbit(fp8e4m3_to_f32(0x80)));
    /* Subnormals 2^-9 .. 7 * 2^-9 and the first normal 2^-6. */
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(ldexpf(1.0f, -9)), 0x01);
    CU_ASSERT_EQUAL(fp8e4m3_to_f32(0x01), ldexpf(1.0f, -9));
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(ldexpf(1.0f, -6)), 0x08);
    CU_ASSERT_EQUAL(fp8e4m3_to_f32(0x07), ldexpf(7.0f, -9));
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(ldexpf(1.0f, -10)), 0x00);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(ldexpf(3.0f, -10)), 0x02);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(ldexpf(15.0f, -10)), 0x08);
    /* Ties to even among normals: 1 + 1/16 -> 1, 1 + 3/16 -> 1.25. */
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(1.0625f), 0x38);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(1.1875f), 0x3a);
    CU_ASSERT_EQUAL(f32_to_fp8e4m3(1.0626f), 0x39);
}

/* Every code decodes and encodes back to itself; NaN codes stay NaN. */
static void test_round_trip_exhaustive(void) {
    int bad_bf16 = 0, bad_f16 = 0, bad_fp8 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = bf16_to_f32((uint16_t)h);
        uint16_t back = f32_to_bf16(f);
        if (isnan(f) ? !isnan(bf16_to_f32(back)) : back != h)
            bad_bf16++;
        f = f16_to_f32((uint16_t)h);
        back = f32_to_f16(f);
        if (isnan(f) ? !isnan(f16_to_f32(back)) : back != h)
            bad_f16++;
    }
    for (uint32_t b = 0; b < 256; b++) {
        float f = fp8e4m3_to_f32((uint8_t)b);
        uint8_t back = f32_to_fp8e4m3(f);
        if (isnan(f) ? !isnan(fp8e4m3_to_f32(back)) : back != b)
            bad_fp8++;
    }
    CU_ASSERT_EQUAL(bad_bf16, 0);
    CU_ASSERT_EQUAL(bad_f16, 0);
    CU_ASSERT_EQUAL(bad_fp8, 0);
    /* The NaN codes: e4m3fn has exactly two (S.1111.111). */
    int nan_fp8 = 0;
    for (uint32_t b = 0; b < 256; b++)
        nan_fp8 += isnan(fp8e4m3_to_f32((uint8_t)b)) != 0;
    CU_ASSERT_EQUAL(nan_fp8, 2);
}

typedef struct fmt {
    const char *name;
    unsigned bits;         /* code width */
    uint32_t maxfin;       /* largest finite magnitude code */
    double lo_exp, hi_exp; /* log2 range of the random magnitudes */
    double (*dec)(uint32_t);
    uint32_t (*enc)(float);
} fmt_t;

static double dec_bf16(uint32_t h) {
    return bf16_to_f32((uint16_t)h);
}
static uint32_t enc_bf16(float f) {
    return f32_to_bf16(f);
}
static double dec_f16(uint32_t h) {
    return f16_to_f32((uint16_t)h);
}
static uint32_t enc_f16(float f) {
    return f32_to_f16(f);
}
static double dec_fp8(uint32_t h) {
    return fp8e4m3_to_f32((uint8_t)h);
}
static uint32_t enc_fp8(float f) {
    return f32_to_fp8e4m3(f);
}

/* For random f32 values inside a format's range, the code chosen is a
 * nearest one, and on a tie the even one. */
static void check_nearest_even(const fmt_t *F, uint64_t seed) {
    uint32_t sign = 1u << (F->bits - 1);
    double vmax = F->dec(F->maxfin);
    int bad = 0, ties = 0;
    for (uint64_t i = 0; i < 400000; i++) {
        uint32_t r[4];
        rng_block(r, seed, 5, i);
        /* Log-uniform magnitudes across the format's range, subnormals included. */
        double u = (double)(r[0] >> 8) / 16777216.0;
        float mag = (float)fmin(vmax, exp2(F->lo_exp + u * (F->hi_exp - F->lo_exp)));
        if (r[2] % 8 == 0) /* exact midpoints between neighbouring codes */
            mag = (float)(0.5 * (F->dec(r[3] % F->maxfin) + F->dec(r[3] % F->maxfin + 1)));
        float x = (r[1] & 1) ? -mag : mag;
        uint32_t h = F->enc(x);
        uint32_t m = h & (sign - 1);
        if (m > F->maxfin || ((h & sign) != 0) != (signbit(x) != 0)) {
            bad++;
            continue;
        }
        double e = fabs(F->dec(h) - x);
        double lo = m > 0 ? fabs(F->dec((h & sign) | (m - 1)) - x) : INFINITY;
        double hi = m < F->maxfin ? fabs(F->dec((h & sign) | (m + 1)) - x) : INFINITY;
        if (e > lo || e > hi)
            bad++;
        if (e == lo || e == hi) {
            ties++;
            if (m & 1)
                bad++;
        }
    }
    if (bad)
        tu_report("%s: %d codes not nearest-even", F->name, bad);
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(ties > 1000); /* the midpoints were exercised */
}

static void test_nearest_even_random(void) {
    const fmt_t fmts[] = {
        {"bf16", 16, 0x7f7f, -136.0, 128.0, dec_bf16, enc_bf16},
        {"f16", 16, 0x7bff, -26.0, 16.0, dec_f16, enc_f16},
        {"fp8e4m3", 8, 0x7e, -11.0, 9.0, dec_fp8, enc_fp8},
    };
    for (int i = 0; i < 3; i++)
        check_nearest_even(&fmts[i], 40 + i);
}

/* The bulk converters agree with the scalar ones. */
static void test_bulk_convert(void) {
    enum { N = 1000 };
    float src[N], back[N];
    uint16_t h[N];
    uint8_t b[N];
    tu_fill(src, N, 3, -500.0f, 500.0f);
    src[0] = NAN, src[1] = -0.0f, src[2] = 1e-30f;
    const dtype_t dts[] = {DT_BF16, DT_F16, DT_F8E4M3, DT_F32};
    for (int t = 0; t < 4; t++) {
        void *dst = dts[t] == DT_F8E4M3 ? (void *)b : dts[t] == DT_F32 ? (void *)back : (void *)h;
        convert_from_f32(dst, dts[t], src, N);
        float out[N];
        tu_poison(out, N);
        convert_to_f32(out, dst, dts[t], N);
        int bad = 0;
        for (int i = 0; i < N; i++) {
            float want;
            switch (dts[t]) {
            case DT_BF16: want = bf16_to_f32(f32_to_bf16(src[i])); break;
            case DT_F16: want = f16_to_f32(f32_to_f16(src[i])); break;
            case DT_F8E4M3: want = fp8e4m3_to_f32(f32_to_fp8e4m3(src[i])); break;
            default: want = src[i];
            }
            if (isnan(want) ? !isnan(out[i]) : f_bits(want) != f_bits(out[i]))
                bad++;
        }
        CU_ASSERT_EQUAL(bad, 0);
    }
}

int main(void) {
    CU_TestInfo tests[] = {
        {"names and sizes", test_names_and_sizes},
        {"bf16 known values", test_bf16_known},
        {"f16 known values", test_f16_known},
        {"fp8 e4m3fn known values", test_fp8_known},
        {"exhaustive round trips", test_round_trip_exhaustive},
        {"nearest-even on random values", test_nearest_even_random},
        {"bulk converters", test_bulk_convert},
        CU_TEST_INFO_NULL,
    };
    return tu_main("dtype", tests);
}
