/* lora_rows: the rollout engine's LoRA products, row by row on the vector units. */
#ifndef MOERL_ROLLOUT_LORA_ROWS_H
#define MOERL_ROLLOUT_LORA_ROWS_H

#include <stddef.h>

#include "lora/adapter.h"
#include "lora/lora.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y (T, OC) += (x (T, C) A^T) (scale B)^T for the adapter p, on the calling thread; xa
 * (T, R) receives x A^T. Each row alone: each of its R sums over C in order (the ranks in
 * 16 lanes, eight rows sharing each load of A^T), then each of its OC sums over R in order,
 * added to y; so a row's bits depend neither on T nor on the other rows nor on the thread
 * that runs it. No BLAS call and no parallel region, so it can run inside one (the
 * engine's experts, one per thread). A^T and scale B^T are formed in the calling thread's
 * last scratch slot ((R rounded up to 16) * C + R * OC floats). */
/* The operands of an adapter's pairs formed once (A^T padded and scale B^T, about the
 * adapter's size again), for the products to read instead of forming them per call. */
typedef struct lora_rows_cache {
    const float *base; /* the adapter's params, n floats */
    size_t n;
    float scale;
    int n_entries;
    size_t *off_A;    /* (n_entries) ascending, as the adapter lays them out */
    size_t *off_B;    /* (n_entries) */
    int *dims;        /* (n_entries, 3) R, C, OC */
    float **at, **bt; /* (n_entries) */
    float *buf;
} lora_rows_cache_t;

/* c = the operands of every entry of ad (NULL: none), replacing what c held (c zeroed or
 * built before). Out of memory, c stays empty and the products form their operands per
 * call (the same bits). Build again whenever ad's values change. */
void lora_rows_cache_build(lora_rows_cache_t *c, const lora_adapter_t *ad);
void lora_rows_cache_free(lora_rows_cache_t *c);

/* lc (or NULL) is a cache to take p's operands from when it holds them. */
void lora_rows(float *y, float *xa, const float *x, const lora_pair_t *p,
               const lora_rows_cache_t *lc, int T, int C, int OC);

/* The same with the rows shared among the threads (the same bits: each row as above). */
void lora_rows_par(float *y, float *xa, const float *x, const lora_pair_t *p,
                   const lora_rows_cache_t *lc, int T, int C, int OC);

#ifdef __cplusplus
}
#endif
#endif
