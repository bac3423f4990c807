/* Tests of rng_hd: the header-only Philox, stream ids and sampler uniform (the code the CUDA
 * sampler runs on the device) give the same bits as core/rng.c and rollout/sampler.c. */
#include <string.h>

#include "core/cuda/rng_hd.h"
#include "core/rng.h"
#include "rollout/sampler.h"
#include "tests/testutil.h"

/* A 64-bit value with high and low halves both non-trivial. */
static uint64_t mix(uint64_t i) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    return z ^ (z >> 31);
}

static void test_philox_equal(void) {
    int bad = 0;
    for (uint64_t t = 0; t < 20000; t++) {
        uint32_t a[4], b[4];
        uint64_t seed = mix(3 * t), stream = mix(3 * t + 1), index = mix(3 * t + 2) >> (t % 64);
        rng_block(a, seed, stream, index);
        rng_hd_block(b, seed, stream, index);
        bad += memcmp(a, b, sizeof a) != 0;
    }
    CU_ASSERT_EQUAL(bad, 0);
    /* Random123's first known answer through the header's round function. */
    uint32_t ctr[4] = {0, 0, 0, 0}, key[2] = {0, 0}, out[4];
    rng_hd_philox(out, ctr, key);
    CU_ASSERT_EQUAL(out[0], 0x6627e8d5u);
    CU_ASSERT_EQUAL(out[3], 0x9b00dbd8u);
}

static void test_stream_ids_equal(void) {
    const char *names[] = {"rollout.sample", "init", "", "a longer stream name"};
    int bad = 0;
    for (int n = 0; n < 4; n++)
        for (uint64_t t = 0; t < 1000; t++)
            bad += rng_stream_id(names[n], mix(t), mix(t + 7) >> (t % 64)) !=
                   rng_hd_stream_id(names[n], mix(t), mix(t + 7) >> (t % 64));
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_sample_uniform_equal(void) {
    int bad = 0, distinct = 0;
    double prev = -1.0;
    for (uint64_t t = 0; t < 20000; t++) {
        uint64_t seed = t % 7 ? mix(t) : t, req = mix(t + 1) >> (t % 64), smp = t % 16,
                 tok = t % 3 ? t : mix(t + 2);
        double a = sampler_uniform(seed, req, smp, tok);
        double b = rng_hd_sample_uniform(seed, req, smp, tok);
        bad += memcmp(&a, &b, sizeof a) != 0 || !(b >= 0.0 && b < 1.0);
        distinct += b != prev;
        prev = b;
    }
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT_EQUAL(distinct, 20000);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"Philox blocks equal rng_block", test_philox_equal},
        {"stream ids equal rng_stream_id", test_stream_ids_equal},
        {"sample uniform equals sampler_uniform bit for bit", test_sample_uniform_equal},
        CU_TEST_INFO_NULL,
    };
    return tu_main("rng_hd", tests);
}
