/* rng: counter-based Philox4x32-10 (Salmon et al., SC'11). */
#include "core/rng.h"
#include "core/rng_hd.h"

#include <math.h>

void philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]) {
    rng_hd_philox(out, ctr, key);
}

void rng_block(uint32_t out[4], uint64_t seed, uint64_t stream, uint64_t index) {
    rng_hd_block(out, seed, stream, index);
}

float rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t r[4];
    rng_block(r, seed, stream, index);
    return rng_u32_to_unit(r[0]);
}

float rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t r[4];
    rng_block(r, seed, stream, index);
    /* u1 in (0, 1] so the log is finite. */
    double u1 = ((double)(r[0] >> 8) + 1.0) / 16777216.0;
    double u2 = (double)(r[1] >> 8) / 16777216.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

void rng_fill_uniform(float *out, size_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        out[i] = lo + (hi - lo) * rng_uniform(seed, stream, i);
}

void rng_fill_normal(float *out, size_t n, uint64_t seed, uint64_t stream, float mean, float std) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        out[i] = mean + std * rng_normal(seed, stream, i);
}

uint64_t rng_stream_id(const char *name, uint64_t a, uint64_t b) {
    return rng_hd_stream_id(name, a, b);
}
