/* rng_hd: the one implementation of Philox4x32-10, the stream ids and the sampler's uniform
 * draw, as inline functions that compile as C on the host and as CUDA host/device code;
 * core/rng.c and rollout/sampler.c call them, so the CPU and the GPU draw the same bits. */
#ifndef MOERL_CORE_RNG_HD_H
#define MOERL_CORE_RNG_HD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define RNG_HD __host__ __device__
#else
#define RNG_HD
#endif

/* One Philox4x32 round-10 block: out = philox(counter, key), as philox4x32_10(). */
static inline RNG_HD void rng_hd_philox(uint32_t out[4], const uint32_t ctr[4],
                                        const uint32_t key[2]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, n3 = (uint32_t)p0;
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* Block `index` of `stream` under `seed`, as rng_block(). */
static inline RNG_HD void rng_hd_block(uint32_t out[4], uint64_t seed, uint64_t stream,
                                       uint64_t index) {
    uint32_t ctr[4] = {(uint32_t)index, (uint32_t)(index >> 32), (uint32_t)stream,
                       (uint32_t)(stream >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    rng_hd_philox(out, ctr, key);
}

/* FNV-1a over a name and two numbers, as rng_stream_id(). */
static inline RNG_HD uint64_t rng_hd_stream_id(const char *name, uint64_t a, uint64_t b) {
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((a >> (8 * i)) & 0xff)) * 1099511628211ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((b >> (8 * i)) & 0xff)) * 1099511628211ull;
    return h;
}

/* The 53 random bits behind sampler_uniform(): lanes 0 and 1 of Philox block token_index
 * of stream rng_stream_id("rollout.sample", request_id, sample_index). */
static inline RNG_HD uint64_t rng_hd_sample_bits(uint64_t seed, uint64_t request_id,
                                                 uint64_t sample_index, uint64_t token_index) {
    uint32_t r[4];
    rng_hd_block(r, seed, rng_hd_stream_id("rollout.sample", request_id, sample_index),
                 token_index);
    return ((uint64_t)(r[0] >> 5) << 26) | (uint64_t)(r[1] >> 6); /* 27 + 26 bits */
}

/* sampler_uniform(): the bits times 2^-53, a double in [0, 1). */
static inline RNG_HD double rng_hd_sample_uniform(uint64_t seed, uint64_t request_id,
                                                  uint64_t sample_index, uint64_t token_index) {
    return (double)rng_hd_sample_bits(seed, request_id, sample_index, token_index) *
           (1.0 / 9007199254740992.0);
}

#ifdef __cplusplus
}
#endif
#endif
