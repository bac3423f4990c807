/* rng: counter-based Philox4x32-10 (Salmon et al., SC'11). */
#include "core/rng.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

void philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(PHILOX_M0, c0, &hi0, &lo0);
        mulhilo(PHILOX_M1, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

void rng_block(uint32_t out[4], uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t ctr[4] = {(uint32_t)index, (uint32_t)(index >> 32), (uint32_t)stream,
                       (uint32_t)(stream >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    philox4x32_10(out, ctr, key);
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
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((a >> (8 * i)) & 0xff)) * 1099511628211ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((b >> (8 * i)) & 0xff)) * 1099511628211ull;
    return h;
}
