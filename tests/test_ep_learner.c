/* test_ep_learner: the expert-parallel learner's pieces that run in one process: groups
 * through bytes and back (with and without routing, a sample without routing among
 * others), truncated and trailing bytes refused, and the rank-0 calls without a
 * communicator being the plain trainer calls. The led protocol over several ranks is
 * in tests/mpi_learner_ep.c and tests/it_learner_ep.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "learner/ep_learner.h"
#include "tests/learner_fixture.h"

static sample_group_t *make(uint64_t id, int routing) {
    int lens[3] = {4, 1, 6};
    sample_group_t *g = NULL;
    CU_ASSERT_EQUAL_FATAL(sample_group_alloc(&g, id, 5, lens, 3, 2, 2, routing, routing), 0);
    for (int i = 0; i < 5; i++)
        g->prompt[i] = (int32_t)(id * 10 + (uint64_t)i);
    for (int i = 0; routing && i < 5 * 4; i++)
        g->prompt_routing[i] = (uint16_t)(i % 7);
    for (int s = 0; s < 3; s++) {
        sample_t *x = &g->samples[s];
        for (int i = 0; i < x->n_tokens; i++) {
            x->tokens[i] = 100 + s * 10 + i;
            x->logprobs[i] = -0.25f * (float)(i + 1);
        }
        for (int i = 0; x->routing && i < x->n_tokens * 4; i++)
            x->routing[i] = (uint16_t)((i + s) % 5);
        x->finish = s;
        x->version_first = 3 + s;
        x->version_last = 4 + s;
        x->reward = 0.5f * (float)s - 0.25f;
        x->reward_version = 2;
    }
    if (routing) { /* one sample without a recorded routing */
        free(g->samples[1].routing);
        g->samples[1].routing = NULL;
    }
    return g;
}

static void same_group(const sample_group_t *a, const sample_group_t *b) {
    CU_ASSERT_EQUAL(a->id, b->id);
    CU_ASSERT_EQUAL_FATAL(a->prompt_len, b->prompt_len);
    CU_ASSERT_EQUAL_FATAL(a->n_samples, b->n_samples);
    CU_ASSERT_EQUAL(a->M, b->M);
    CU_ASSERT_EQUAL(a->K, b->K);
    size_t row = (size_t)a->M * a->K;
    CU_ASSERT(!memcmp(a->prompt, b->prompt, sizeof(int32_t) * (size_t)a->prompt_len));
    CU_ASSERT_EQUAL_FATAL(a->prompt_routing == NULL, b->prompt_routing == NULL);
    if (a->prompt_routing)
        CU_ASSERT(!memcmp(a->prompt_routing, b->prompt_routing,
                          sizeof(uint16_t) * (size_t)a->prompt_len * row));
    for (int s = 0; s < a->n_samples; s++) {
        const sample_t *x = &a->samples[s], *y = &b->samples[s];
        CU_ASSERT_EQUAL_FATAL(x->n_tokens, y->n_tokens);
        CU_ASSERT(!memcmp(x->tokens, y->tokens, sizeof(int32_t) * (size_t)x->n_tokens));
        CU_ASSERT(!memcmp(x->logprobs, y->logprobs, sizeof(float) * (size_t)x->n_tokens));
        CU_ASSERT_EQUAL_FATAL(x->routing == NULL, y->routing == NULL);
        if (x->routing)
            CU_ASSERT(!memcmp(x->routing, y->routing, sizeof(uint16_t) * x->n_tokens * row));
        CU_ASSERT_EQUAL(x->finish, y->finish);
        CU_ASSERT_EQUAL(x->version_first, y->version_first);
        CU_ASSERT_EQUAL(x->version_last, y->version_last);
        CU_ASSERT_EQUAL(x->reward, y->reward);
        CU_ASSERT_EQUAL(x->reward_version, y->reward_version);
    }
}

static void test_groups_round_trip(void) {
    sample_group_t *g[2] = {make(7, 1), make(8, 0)};
    uint8_t *buf = NULL;
    size_t len = 0;
    CU_ASSERT_EQUAL_FATAL(ep_groups_pack((const sample_group_t *const *)g, 2, &buf, &len), 0);
    CU_ASSERT(len > 0);
    sample_group_t **back = NULL;
    CU_ASSERT_EQUAL_FATAL(ep_groups_unpack(buf, len, 2, &back), 0);
    same_group(g[0], back[0]);
    same_group(g[1], back[1]);
    ep_groups_free(back, 2);
    /* Every truncation, and a byte too many, is refused. */
    for (size_t cut = 0; cut < len; cut += 7) {
        CU_ASSERT_EQUAL(ep_groups_unpack(buf, cut, 2, &back), MO_EMALFORMED);
        CU_ASSERT_PTR_NULL(back);
    }
    CU_ASSERT_EQUAL(ep_groups_unpack(buf, len, 1, &back), MO_EMALFORMED);
    free(buf);
    sample_group_t *none = NULL;
    CU_ASSERT_EQUAL(ep_groups_pack((const sample_group_t *const *)&none, 1, &buf, &len),
                    MO_EINVAL);
    sample_group_destroy(&g[0]);
    sample_group_destroy(&g[1]);
}

/* Without a communicator the led calls are the trainer's own. */
static void test_one_rank_calls(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *a = lf_trainer(&f), *b = lf_trainer(&f);
    static const float rw[4] = {1, 0, 0.5f, 0};
    sample_group_t *g[2] = {lf_group(a, 1, 4, rw, 0, 0), lf_group(a, 2, 4, rw, 0, 0)};
    trainer_metrics_t ma, mb;
    CU_ASSERT_EQUAL_FATAL(trainer_step(a, (const sample_group_t *const *)g, 2, &ma), 0);
    CU_ASSERT_EQUAL_FATAL(ep_lead_step(b, (const sample_group_t *const *)g, 2, &mb), 0);
    CU_ASSERT_EQUAL(ma.trained, 1);
    CU_ASSERT_EQUAL(mb.updates, ma.updates);
    CU_ASSERT(!memcmp(a->adapter->params, b->adapter->params,
                      sizeof(float) * a->adapter->n_params));
    const lora_adapter_t *whole = NULL;
    CU_ASSERT_EQUAL(ep_lead_whole(b, &whole), 0);
    CU_ASSERT_PTR_EQUAL(whole, b->adapter);
    CU_ASSERT_PTR_EQUAL(ep_lead_params(b), b->adapter->params);
    CU_ASSERT_EQUAL(ep_lead_save(b, f.run_dir, NULL, NULL, NULL, 0), 0);
    CU_ASSERT_EQUAL(ep_lead_resume(a, f.run_dir, 0, NULL, NULL, 0, NULL), 0);
    CU_ASSERT(!memcmp(a->adapter->params, b->adapter->params,
                      sizeof(float) * a->adapter->n_params));
    CU_ASSERT_EQUAL(ep_lead_stop(NULL, 0), 0);
    CU_ASSERT_EQUAL(ep_follow(b), MO_EINVAL);
    char line[512];
    ep_describe(b, line, sizeof line);
    CU_ASSERT(strstr(line, "rank 0 of 1 holds experts 0..7 of 8") != NULL);
    lf_free_groups(g, 2);
    trainer_destroy(&a);
    trainer_destroy(&b);
    lf_close(&f);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"groups_round_trip", test_groups_round_trip},
        {"one_rank_calls", test_one_rank_calls},
        CU_TEST_INFO_NULL,
    };
    return tu_main("ep_learner", tests);
}
