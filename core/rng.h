/* rng: counter-based Philox4x32-10, so any element of any stream can be drawn
 * independently (same numbers on any thread count, and on CUDA). */
#ifndef MOERL_CORE_RNG_H
#define MOERL_CORE_RNG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One Philox4x32 round-10 block: out = philox(counter, key). */
void philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]);

/* Four raw 32-bit draws for block `index` of `stream` under `seed`.
 * counter = (index lo, index hi, stream lo, stream hi), key = (seed lo, seed hi). */
void rng_block(uint32_t out[4], uint64_t seed, uint64_t stream, uint64_t index);

/* 24-bit uniform in [0, 1) from a raw draw. */
static inline float rng_u32_to_unit(uint32_t x) { return (float)(x >> 8) * (1.0f / 16777216.0f); }

/* Element `index` of a stream: uniform in [0, 1), lane 0 of block `index`. */
float rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);
/* Standard normal by Box-Muller on lanes 0 and 1 of block `index`. */
float rng_normal(uint64_t seed, uint64_t stream, uint64_t index);

/* out[i] = rng_uniform(seed, stream, i) scaled to [lo, hi). */
void rng_fill_uniform(float *out, size_t n, uint64_t seed, uint64_t stream, float lo, float hi);
/* out[i] = mean + std * rng_normal(seed, stream, i). */
void rng_fill_normal(float *out, size_t n, uint64_t seed, uint64_t stream, float mean, float std);

/* A 64-bit stream id derived from a name and numbers (FNV-1a), so call sites
 * can name their streams: rng_stream_id("init", layer, tensor). */
uint64_t rng_stream_id(const char *name, uint64_t a, uint64_t b);

#ifdef __cplusplus
}
#endif
#endif
