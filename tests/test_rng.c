/* Tests of rng: Philox4x32-10 known answers, the counter layout, uniform and
 * normal statistics, fills independent of the thread count, distinct streams. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "tests/testutil.h"

/* Known-answer vectors of Random123 (kat_vectors, philox4x32 with 10 rounds). */
static void test_philox_known_answers(void) {
    static const struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
         {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int t = 0; t < 3; t++) {
        uint32_t out[4];
        philox4x32_10(out, kat[t].ctr, kat[t].key);
        for (int i = 0; i < 4; i++)
            CU_ASSERT_EQUAL(out[i], kat[t].out[i]);
    }
}

/* rng_block puts (index, stream) in the counter and the seed in the key. */
static void test_block_layout(void) {
    uint32_t b[4];
    uint64_t seed = ((uint64_t)0x299f31d0 << 32) | 0xa4093822;
    uint64_t stream = ((uint64_t)0x03707344 << 32) | 0x13198a2e;
    uint64_t index = ((uint64_t)0x85a308d3 << 32) | 0x243f6a88;
    rng_block(b, seed, stream, index);
    CU_ASSERT_EQUAL(b[0], 0xd16cfe09);
    CU_ASSERT_EQUAL(b[1], 0x94fdcceb);
    CU_ASSERT_EQUAL(b[2], 0x5001e420);
    CU_ASSERT_EQUAL(b[3], 0x24126ea1);
    /* rng_uniform is lane 0 of the block. */
    CU_ASSERT_EQUAL(rng_uniform(seed, stream, index), rng_u32_to_unit(0xd16cfe09));
}

static void test_uniform_statistics(void) {
    enum { N = 100000 };
    CU_ASSERT(rng_u32_to_unit(0xffffffffu) < 1.0f);
    CU_ASSERT_EQUAL(rng_u32_to_unit(0), 0.0f);
    double s = 0, s2 = 0;
    int out_of_range = 0, bins[10] = {0};
    for (int i = 0; i < N; i++) {
        float u = rng_uniform(1234, 7, (uint64_t)i);
        if (!(u >= 0.0f && u < 1.0f))
            out_of_range++;
        else
            bins[(int)(u * 10)]++;
        s += u;
        s2 += (double)u * u;
    }
    CU_ASSERT_EQUAL(out_of_range, 0);
    double mean = s / N, var = s2 / N - mean * mean;
    /* Standard error of the mean is 0.29 / sqrt(N) ~ 9e-4: bounds are ~5 sigma. */
    CU_ASSERT(fabs(mean - 0.5) < 0.005);
    CU_ASSERT(fabs(var - 1.0 / 12.0) < 0.002);
    for (int b = 0; b < 10; b++) /* expected 10000 each, sigma ~95 */
        CU_ASSERT(abs(bins[b] - N / 10) < 600);
}

static void test_normal_statistics(void) {
    enum { N = 100000 };
    double s = 0, s2 = 0, s4 = 0;
    int bad = 0, tail = 0;
    for (int i = 0; i < N; i++) {
        double z = rng_normal(99, 3, (uint64_t)i);
        if (!isfinite(z))
            bad++;
        s += z;
        s2 += z * z;
        s4 += z * z * z * z;
        tail += fabs(z) > 2.0;
    }
    CU_ASSERT_EQUAL(bad, 0);
    double mean = s / N, var = s2 / N - mean * mean;
    /* Standard errors: mean 3.2e-3, variance 4.5e-3, kurtosis ~0.03. */
    CU_ASSERT(fabs(mean) < 0.02);
    CU_ASSERT(fabs(var - 1.0) < 0.03);
    CU_ASSERT(fabs(s4 / N - 3.0) < 0.15);
    /* P(|z| > 2) = 0.0455. */
    CU_ASSERT(fabs((double)tail / N - 0.0455) < 0.004);
}

/* Large fills (the parallel path) give the same bits on 1 and 2 threads and
 * equal element-wise draws. */
static void test_fill_thread_independent(void) {
    enum { N = 200003 };
    float *a = malloc(sizeof(float) * N), *b = malloc(sizeof(float) * N);
    int saved = omp_get_max_threads();
    for (int kind = 0; kind < 2; kind++) {
        tu_poison(a, N);
        tu_poison(b, N);
        omp_set_num_threads(1);
        if (kind == 0)
            rng_fill_uniform(a, N, 42, 9, -2.0f, 3.0f);
        else
            rng_fill_normal(a, N, 42, 9, 0.5f, 2.0f);
        omp_set_num_threads(2);
        if (kind == 0)
            rng_fill_uniform(b, N, 42, 9, -2.0f, 3.0f);
        else
            rng_fill_normal(b, N, 42, 9, 0.5f, 2.0f);
        CU_ASSERT(memcmp(a, b, sizeof(float) * N) == 0);
        int bad = 0;
        for (size_t i = 0; i < N; i += 997) {
            float want = kind == 0 ? -2.0f + 5.0f * rng_uniform(42, 9, i)
                                   : 0.5f + 2.0f * rng_normal(42, 9, i);
            bad += a[i] != want;
        }
        CU_ASSERT_EQUAL(bad, 0);
    }
    omp_set_num_threads(saved);
    int outside = 0;
    rng_fill_uniform(a, N, 42, 9, -2.0f, 3.0f);
    for (size_t i = 0; i < N; i++)
        outside += !(a[i] >= -2.0f && a[i] < 3.0f);
    CU_ASSERT_EQUAL(outside, 0);
    free(a);
    free(b);
}

static int count_equal(uint64_t s1, uint64_t st1, uint64_t s2, uint64_t st2) {
    int eq = 0;
    for (uint64_t i = 0; i < 1000; i++) {
        uint32_t x[4], y[4];
        rng_block(x, s1, st1, i);
        rng_block(y, s2, st2, i);
        eq += memcmp(x, y, sizeof x) == 0;
    }
    return eq;
}

static void test_streams_distinct(void) {
    CU_ASSERT_EQUAL(count_equal(1, 1, 1, 1), 1000); /* same stream repeats */
    CU_ASSERT_EQUAL(count_equal(1, 1, 1, 2), 0);
    CU_ASSERT_EQUAL(count_equal(1, 1, 2, 1), 0);
    CU_ASSERT_EQUAL(count_equal(1, 1ull << 40, 1, 0), 0); /* high stream bits count */
    CU_ASSERT_EQUAL(count_equal(1ull << 40, 1, 0, 1), 0); /* high seed bits count */
    uint64_t ids[6] = {
        rng_stream_id("init", 0, 0),          rng_stream_id("init", 1, 0),
        rng_stream_id("init", 0, 1),          rng_stream_id("drop", 0, 0),
        rng_stream_id("init", 1ull << 40, 0), rng_stream_id("", 0, 0),
    };
    for (int i = 0; i < 6; i++)
        for (int j = i + 1; j < 6; j++)
            CU_ASSERT(ids[i] != ids[j]);
    CU_ASSERT_EQUAL(rng_stream_id("init", 3, 4), rng_stream_id("init", 3, 4));
}

int main(void) {
    CU_TestInfo tests[] = {
        {"Philox4x32-10 known answers", test_philox_known_answers},
        {"block counter and key layout", test_block_layout},
        {"uniform statistics", test_uniform_statistics},
        {"normal statistics", test_normal_statistics},
        {"fills independent of thread count", test_fill_thread_independent},
        {"streams and seeds are distinct", test_streams_distinct},
        CU_TEST_INFO_NULL,
    };
    return tu_main("rng", tests);
}
