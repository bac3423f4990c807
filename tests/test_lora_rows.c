/* test_lora_rows: the rollout engine's LoRA products (rollout/lora_rows.h) against a double
 * reference over ranks and widths with and without tails; a row's bits independent of the
 * rows with it, of the thread count and of whether the operands come from the cache; the
 * cache built from an adapter, refusing pairs it does not hold. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "rollout/lora_rows.h"
#include "tests/testutil.h"

/* y0 + scale (x A^T) B^T in double. */
static void reference(double *ref, const float *y0, const float *x, const lora_pair_t *p, int T,
                      int C, int OC) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double s = 0.0;
            for (int r = 0; r < p->R; r++) {
                double xa = 0.0;
                for (int c = 0; c < C; c++)
                    xa += (double)x[(size_t)t * C + c] * p->A[(size_t)r * C + c];
                s += xa * p->B[(size_t)o * p->R + r];
            }
            ref[(size_t)t * OC + o] = y0[(size_t)t * OC + o] + p->scale * s;
        }
}

/* T rows of shape (C -> OC) at rank R: against the reference; the first rows alone, and the
 * whole on one and two threads, give the same bits. */
static void rows_case(int T, int C, int OC, int R, uint64_t seed) {
    float *x = malloc(sizeof(float) * (size_t)T * C), *A = malloc(sizeof(float) * (size_t)R * C);
    float *B = malloc(sizeof(float) * (size_t)OC * R), *y0 = malloc(sizeof(float) * (size_t)T * OC);
    float *y[3], *xa = malloc(sizeof(float) * (size_t)T * R);
    double *ref = malloc(sizeof(double) * (size_t)T * OC);
    tu_fill(x, (size_t)T * C, seed, -1.0f, 1.0f);
    tu_fill(A, (size_t)R * C, seed + 1, -0.5f, 0.5f);
    tu_fill(B, (size_t)OC * R, seed + 2, -0.5f, 0.5f);
    tu_fill(y0, (size_t)T * OC, seed + 3, -1.0f, 1.0f);
    lora_pair_t p = {A, B, NULL, NULL, R, 0.75f};
    for (int i = 0; i < 3; i++) {
        y[i] = malloc(sizeof(float) * (size_t)T * OC);
        memcpy(y[i], y0, sizeof(float) * (size_t)T * OC);
    }
    int threads = backend_cpu_threads();
    lora_rows(y[0], xa, x, &p, NULL, T, C, OC);
    backend_cpu_set_threads(2);
    lora_rows_par(y[1], xa, x, &p, NULL, T, C, OC);
    backend_cpu_set_threads(threads);
    int TA = T < 3 ? T : 3;
    lora_rows(y[2], xa, x, &p, NULL, TA, C, OC);
    reference(ref, y0, x, &p, T, C, OC);
    char what[96];
    snprintf(what, sizeof what, "lora rows T %d C %d OC %d R %d", T, C, OC, R);
    TU_ASSERT_CLOSE(tu_rel_err_fd(y[0], ref, (size_t)T * OC, 1.0), 2e-6, what);
    CU_ASSERT(memcmp(y[0], y[1], sizeof(float) * (size_t)T * OC) == 0);
    CU_ASSERT(memcmp(y[0], y[2], sizeof(float) * (size_t)TA * OC) == 0);
    for (int i = 0; i < 3; i++)
        free(y[i]);
    free(x), free(A), free(B), free(y0), free(xa), free(ref);
}

static void test_rows(void) {
    rows_case(1, 64, 48, 16, 10);
    rows_case(9, 96, 200, 16, 20);   /* one block of 8 rows and one more; OC with tails */
    rows_case(33, 40, 130, 5, 30);   /* rank below one lane block, C not a multiple of 16 */
    rows_case(20, 128, 256, 20, 40); /* rank across two lane blocks */
    rows_case(64, 512, 256, 16, 50); /* an expert's shape */
}

/* The cache of an adapter over two modules: the products read the cached operands (the
 * same bits as forming them per call); pairs it does not hold (other memory, another
 * scale, other dimensions) fall back to forming them, with the same bits. */
static void test_cache(void) {
    enum { T = 17, C = 64, OC = 96 };
    lora_module_desc_t mods[2] = {
        {"model.layers.0.self_attn.q_proj", "q_proj", LORA_KIND_ATTENTION, C, OC},
        {"model.layers.0.self_attn.o_proj", "o_proj", LORA_KIND_ATTENTION, OC, C}};
    const char *targets[1] = {"attention"};
    lora_config_t lc = {8, 16.0f, 0, 0.0f, 3, 0, targets, 1};
    lora_adapter_t *ad = NULL;
    TU_CHECK_RC(lora_adapter_new(&ad, &lc, mods, 2));
    tu_fill(ad->params, ad->n_params, 60, -0.5f, 0.5f);
    lora_rows_cache_t cache;
    memset(&cache, 0, sizeof cache);
    lora_rows_cache_build(&cache, ad);
    CU_ASSERT_EQUAL(cache.n_entries, 2);
    float *x = malloc(sizeof(float) * T * OC), *xa = malloc(sizeof(float) * T * 8);
    float *a = calloc((size_t)T * OC, sizeof(float)), *b = calloc((size_t)T * OC, sizeof(float));
    tu_fill(x, (size_t)T * OC, 61, -1.0f, 1.0f);
    for (int e = 0; e < 2; e++) {
        lora_pair_t p = lora_adapter_pair(ad, e, 0);
        int c = e ? OC : C, oc = e ? C : OC;
        memset(a, 0, sizeof(float) * T * OC);
        memset(b, 0, sizeof(float) * T * OC);
        lora_rows_par(a, xa, x, &p, &cache, T, c, oc);
        lora_rows_par(b, xa, x, &p, NULL, T, c, oc);
        CU_ASSERT(memcmp(a, b, sizeof(float) * (size_t)T * oc) == 0);
    }
    /* the products read the cache: after a change to the values that the cache was not
     * built again for, the cached pair gives the old result */
    {
        lora_pair_t p0 = lora_adapter_pair(ad, 0, 0);
        float keep = p0.B[0];
        p0.B[0] += 1.0f;
        memset(a, 0, sizeof(float) * T * OC);
        memset(b, 0, sizeof(float) * T * OC);
        lora_rows(a, xa, x, &p0, &cache, T, C, OC);
        lora_rows(b, xa, x, &p0, NULL, T, C, OC);
        CU_ASSERT(memcmp(a, b, sizeof(float) * T * OC) != 0);
        p0.B[0] = keep;
    }
    /* another scale: the cached operands (scaled by the adapter's) must not be used */
    lora_pair_t p = lora_adapter_pair(ad, 0, 0);
    p.scale *= 2.0f;
    memset(a, 0, sizeof(float) * T * OC);
    memset(b, 0, sizeof(float) * T * OC);
    lora_rows(a, xa, x, &p, &cache, T, C, OC);
    lora_rows(b, xa, x, &p, NULL, T, C, OC);
    CU_ASSERT(memcmp(a, b, sizeof(float) * T * OC) == 0);
    /* a copy of the values elsewhere: not the cache's memory */
    lora_pair_t q = lora_adapter_pair(ad, 0, 0);
    float *A2 = malloc(sizeof(float) * 8 * C);
    memcpy(A2, q.A, sizeof(float) * 8 * C);
    A2[0] += 1.0f;
    q.A = A2;
    memset(a, 0, sizeof(float) * T * OC);
    memset(b, 0, sizeof(float) * T * OC);
    lora_rows(a, xa, x, &q, &cache, T, C, OC);
    lora_rows(b, xa, x, &q, NULL, T, C, OC);
    CU_ASSERT(memcmp(a, b, sizeof(float) * T * OC) == 0);
    lora_rows_cache_build(&cache, NULL); /* empties it */
    CU_ASSERT_EQUAL(cache.n_entries, 0);
    CU_ASSERT_PTR_NULL(cache.buf);
    lora_rows_cache_free(&cache);
    lora_adapter_destroy(&ad);
    free(x), free(xa), free(a), free(b), free(A2);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"products vs double reference; rows and threads independent", test_rows},
        {"operands cached from the adapter", test_cache},
        CU_TEST_INFO_NULL,
    };
    return tu_main("lora_rows", tests);
}
