/* Fixtures shared by the whole-model GPU suites (gpu_model.c, gpu_model_train.c): a model
 * directory with its model and adapter, and packed batches of random sequences. */
#ifndef MOERL_TESTS_MODEL_GPU_FIXTURE_H
#define MOERL_TESTS_MODEL_GPU_FIXTURE_H

#include <stdint.h>

#include "actor/model.h"
#include "core/rng.h"
#include "lora/adapter.h"
#include "tests/testutil.h"

#define MAXT 96

typedef struct fx {
    char dir[512];
    model_t *m;
    lora_adapter_t *ad;
} fx_t;

typedef struct batch {
    int T, B;
    int32_t tok[MAXT], pos[MAXT], tgt[MAXT], cu[16];
    float temperature;
} batch_t;

static inline void fx_close(fx_t *f) {
    model_destroy(&f->m);
    lora_adapter_destroy(&f->ad);
    tu_rmtree(f->dir);
}

/* Sequences of the given lengths with random tokens, next-token targets, a target -1
 * inside the first sequence. */
static inline void make_batch(batch_t *b, const model_t *m, const int *lens, int B, uint64_t seed,
                              float temperature) {
    b->B = B;
    b->cu[0] = 0;
    for (int i = 0; i < B; i++)
        b->cu[i + 1] = b->cu[i] + lens[i];
    b->T = b->cu[B];
    CU_ASSERT_FATAL(b->T <= MAXT);
    for (int t = 0; t < b->T; t++)
        b->tok[t] = (int32_t)(rng_uniform(seed, 1, (uint64_t)t) * (float)m->V) % m->V;
    model_batch_next_token(b->pos, b->tgt, b->tok, b->cu, B);
    if (b->T > 3)
        b->tgt[2] = -1;
    b->temperature = temperature;
}

static inline model_batch_t view(batch_t *b) {
    model_batch_t v = {b->T, b->B, b->tok, b->pos, b->cu, b->tgt, b->temperature, NULL, NULL};
    return v;
}

#endif
