/* Fixtures shared by the whole-model GPU suites (gpu_model.c, gpu_model_train.c): a model
 * directory with its model and adapter, and packed batches of random sequences. */
#ifndef MOERL_TESTS_MODEL_GPU_FIXTURE_H
#define MOERL_TESTS_MODEL_GPU_FIXTURE_H

#include <stdint.h>
#include <string.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/rng.h"
#include "lora/adapter.h"
#include "core/status.h"
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

typedef struct fx_opts {
    float std_f32, std_bf16; /* the matrices' initial std with f32 and with bf16 weights */
    int chunk_rows;          /* model_opts_t.logits_chunk_rows */
    float aux_coef;          /* model_opts_t.aux_coef */
    int no_grads;            /* the adapter without gradient buffers */
} fx_opts_t;

/* A tiny model in dtype dt: Qwen3-MoE with 3 layers, the middle one dense, or Mixtral (2
 * MoE layers) with a sliding window of 4; random norm weights; a rank-4 "all-linear"
 * adapter with random A and B, bound. */
static inline void fx_open_model(fx_t *f, model_arch_t arch, dtype_t dt, uint64_t seed,
                                 const fx_opts_t *o) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, arch, INIT_SIZE_TINY, dt), 0);
    if (arch == ARCH_QWEN3_MOE) {
        c.num_hidden_layers = 3;
        c.max_window_layers = 3;
        c.mlp_only_layers[1] = 1;
    } else {
        c.sliding_window = 4;
    }
    CU_ASSERT_EQUAL_FATAL(model_config_validate(&c, "fixture"), 0);
    init_model_opts_t io = {seed, dt == DT_F32 ? o->std_f32 : o->std_bf16};
    model_opts_t mo = {0, o->chunk_rows, o->aux_coef};
    int rc = init_model_write(f->dir, &c, &io);
    if (rc == 0)
        rc = model_open(&f->m, f->dir, &mo);
    if (rc < 0)
        tu_report("fixture: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL_FATAL(f->m->layers[0].moe, 1);
    CU_ASSERT_EQUAL_FATAL(f->m->layers[1].moe, arch == ARCH_QWEN3_MOE ? 0 : 1);
    CU_ASSERT_EQUAL_FATAL(f->m->layers[0].window, arch == ARCH_QWEN3_MOE ? 0 : 4);
    tu_randomise_norms(f->m, seed + 1);
    const char *targets[1] = {"all-linear"};
    lora_config_t lc = {4, 8.0f, 0, 0.0f, 11, o->no_grads, targets, 1};
    TU_CHECK_RC(lora_adapter_new(&f->ad, &lc, f->m->modules, f->m->n_modules));
    tu_randomise_adapter(f->ad, seed + 2);
    TU_CHECK_RC(model_set_adapter(f->m, f->ad));
}

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
