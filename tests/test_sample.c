/* test_sample: allocation, deep copy and validation of scored groups. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "learner/sample.h"
#include "tests/testutil.h"

enum { V = 50, M = 2, K = 2, E = 4 };

/* A valid group: prompt 3 tokens, samples of 2 and 4 tokens, routing everywhere. */
static sample_group_t *valid_group(void) {
    static const int lens[2] = {2, 4};
    sample_group_t *g = NULL;
    CU_ASSERT_EQUAL_FATAL(sample_group_alloc(&g, 77, 3, lens, 2, M, K, 1, 1), 0);
    for (int i = 0; i < 3; i++)
        g->prompt[i] = 10 + i;
    for (int t = 0; t < 3 * M; t++) {
        g->prompt_routing[t * K] = (uint16_t)(t % E);
        g->prompt_routing[t * K + 1] = (uint16_t)((t + 1) % E);
    }
    for (int s = 0; s < 2; s++) {
        sample_t *x = &g->samples[s];
        for (int i = 0; i < x->n_tokens; i++) {
            x->tokens[i] = 20 + i + s;
            x->logprobs[i] = -0.5f * (float)(i + 1);
        }
        for (int t = 0; t < x->n_tokens * M; t++) {
            x->routing[t * K] = (uint16_t)((t + s) % E);
            x->routing[t * K + 1] = (uint16_t)((t + s + 2) % E);
        }
        x->finish = s ? SAMPLE_FINISH_LENGTH : SAMPLE_FINISH_STOP_TOKEN;
        x->version_first = 3;
        x->version_last = 4;
        x->reward = s ? 0.25f : 1.0f;
        x->reward_version = 2;
    }
    return g;
}

static void test_alloc_copy(void) {
    sample_group_t *g = valid_group(), *c = NULL;
    CU_ASSERT_EQUAL(sample_group_check(g, V, M, K, E), 0);
    CU_ASSERT_EQUAL(sample_seq_len(g, 0), 5);
    CU_ASSERT_EQUAL(sample_seq_len(g, 1), 7);
    CU_ASSERT_EQUAL(sample_finished(&g->samples[0]), 1);
    CU_ASSERT_EQUAL(sample_finished(&g->samples[1]), 0);
    CU_ASSERT_EQUAL_FATAL(sample_group_copy(&c, g), 0);
    CU_ASSERT(c->prompt != g->prompt);
    CU_ASSERT(!memcmp(c->prompt, g->prompt, sizeof(int32_t) * 3));
    CU_ASSERT(!memcmp(c->prompt_routing, g->prompt_routing, sizeof(uint16_t) * 3 * M * K));
    for (int s = 0; s < 2; s++) {
        const sample_t *a = &g->samples[s], *b = &c->samples[s];
        CU_ASSERT_EQUAL(a->n_tokens, b->n_tokens);
        CU_ASSERT(!memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n_tokens));
        CU_ASSERT(!memcmp(a->logprobs, b->logprobs, sizeof(float) * (size_t)a->n_tokens));
        CU_ASSERT(!memcmp(a->routing, b->routing, sizeof(uint16_t) * (size_t)a->n_tokens * M * K));
        CU_ASSERT_EQUAL(a->reward, b->reward);
        CU_ASSERT_EQUAL(a->version_last, b->version_last);
        CU_ASSERT_EQUAL(a->finish, b->finish);
    }
    CU_ASSERT_EQUAL(sample_group_check(c, V, M, K, E), 0);
    sample_group_destroy(&c);
    CU_ASSERT_PTR_NULL(c);
    /* A group without routing. */
    static const int one[1] = {1};
    CU_ASSERT_EQUAL_FATAL(sample_group_alloc(&c, 1, 1, one, 1, 0, 0, 0, 0), 0);
    CU_ASSERT_PTR_NULL(c->prompt_routing);
    CU_ASSERT_PTR_NULL(c->samples[0].routing);
    c->prompt[0] = 0;
    c->samples[0].tokens[0] = 1;
    c->samples[0].logprobs[0] = 0.0f;
    c->samples[0].finish = SAMPLE_FINISH_STOP_STRING;
    CU_ASSERT_EQUAL(sample_group_check(c, V, M, K, E), 0);
    CU_ASSERT_EQUAL(sample_group_check(c, V, 0, 0, 0), 0);
    sample_group_destroy(&c);
    CU_ASSERT_EQUAL(sample_group_alloc(&c, 1, 0, one, 1, 0, 0, 0, 0), MO_EINVAL);
    CU_ASSERT_EQUAL(sample_group_alloc(&c, 1, 1, one, 1, 0, 0, 1, 0), MO_EINVAL);
    CU_ASSERT_STRING_EQUAL(sample_finish_name(SAMPLE_FINISH_LENGTH), "length");
    CU_ASSERT_STRING_EQUAL(sample_finish_name(9), "invalid");
    sample_group_destroy(&g);
}

/* Each corruption is caught with a message naming it. */
static void test_check(void) {
    typedef struct {
        const char *what;
        const char *needle;
    } case_t;
    static const case_t cases[] = {
        {"prompt id", "prompt token 1"},
        {"completion id", "completion token 0"},
        {"nan logprob", "logprob of token 1"},
        {"positive logprob", "logprob of token 0"},
        {"finish", "finish reason"},
        {"versions", "versions"},
        {"reward", "reward"},
        {"expert range", "out of range"},
        {"expert repeat", "repeated"},
        {"layout", "routing of"},
    };
    for (int c = 0; c < (int)(sizeof cases / sizeof *cases); c++) {
        sample_group_t *g = valid_group();
        sample_t *x = &g->samples[1];
        switch (c) {
        case 0: g->prompt[1] = V; break;
        case 1: x->tokens[0] = -1; break;
        case 2: x->logprobs[1] = NAN; break;
        case 3: x->logprobs[0] = 0.5f; break;
        case 4: x->finish = 0; break;
        case 5: x->version_last = 2; break;
        case 6: x->reward = INFINITY; break;
        case 7: x->routing[3] = E; break;
        case 8: x->routing[5] = x->routing[4]; break;
        case 9: g->M = 3; break;
        }
        int rc = sample_group_check(g, V, M, K, E);
        CU_ASSERT_EQUAL(rc, MO_EMALFORMED);
        if (!strstr(mo_last_error(), cases[c].needle) || !strstr(mo_last_error(), "group 77"))
            tu_report("%s: message \"%s\"", cases[c].what, mo_last_error());
        CU_ASSERT(strstr(mo_last_error(), cases[c].needle) != NULL);
        sample_group_destroy(&g);
    }
    /* Routing on a model without MoE layers. */
    sample_group_t *g = valid_group();
    CU_ASSERT_EQUAL(sample_group_check(g, V, 0, 0, 0), MO_EMALFORMED);
    sample_group_destroy(&g);
    CU_ASSERT_EQUAL(sample_group_check(NULL, V, M, K, E), MO_EMALFORMED);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"alloc, copy, destroy", test_alloc_copy},
        {"validation", test_check},
        CU_TEST_INFO_NULL,
    };
    return tu_main("sample", tests);
}
