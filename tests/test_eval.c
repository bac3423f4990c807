/* test_eval: prompt encoding, and greedy eval matching the rollout engine's greedy
 * generation, scored and thresholded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/init_model.h"
#include "core/backend.h"
#include "core/status.h"
#include "learner/eval.h"
#include "rollout/engine.h"
#include "tests/testutil.h"

#define N_EVAL 6

typedef struct fx {
    char dir[512], model[600], jsonl[600];
    model_t *m;
    tokenizer_t *tok;
    dataset_t *d;
} fx_t;

static void fx_open(fx_t *f) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    snprintf(f->model, sizeof f->model, "%s/model", f->dir);
    snprintf(f->jsonl, sizeof f->jsonl, "%s/data.jsonl", f->dir);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32), 0);
    init_model_opts_t io = {4, 0.3f};
    CU_ASSERT_EQUAL_FATAL(init_model_write(f->model, &c, &io), 0);
    CU_ASSERT_EQUAL_FATAL(model_open(&f->m, f->model, NULL), 0);
    CU_ASSERT_EQUAL_FATAL(tokenizer_load(f->model, &f->tok), 0);
    FILE *fp = fopen(f->jsonl, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    for (int i = 0; i < N_EVAL + 1; i++)
        fprintf(fp, "{\"prompt\": \"q%d+%d=\", \"answer\": \"zzz\"}\n", i, 3 * i);
    fclose(fp);
    dataset_opts_t o = {9, false, false, N_EVAL};
    CU_ASSERT_EQUAL_FATAL(dataset_open_jsonl(f->jsonl, &o, &f->d), 0);
}

static void fx_close(fx_t *f) {
    dataset_destroy(&f->d);
    tokenizer_destroy(&f->tok);
    model_destroy(&f->m);
    tu_rmtree(f->dir);
}

static void test_encode(void) {
    fx_t f;
    fx_open(&f);
    int32_t *ids;
    int n;
    CU_ASSERT_EQUAL_FATAL(eval_encode_prompt(f.tok, "<|im_start|>{prompt}=", "12", &ids, &n), 0);
    CU_ASSERT_EQUAL_FATAL(n, 4);
    CU_ASSERT_EQUAL(ids[0], TOK_BYTELEVEL_IM_START);
    CU_ASSERT_EQUAL(ids[1], '1');
    CU_ASSERT_EQUAL(ids[2], '2');
    CU_ASSERT_EQUAL(ids[3], '=');
    free(ids);
    CU_ASSERT_EQUAL_FATAL(eval_encode_prompt(f.tok, NULL, "ab", &ids, &n), 0);
    CU_ASSERT_EQUAL(n, 2);
    free(ids);
    CU_ASSERT_EQUAL(eval_encode_prompt(f.tok, NULL, "", &ids, &n), MO_EINVAL);
    CU_ASSERT_EQUAL(eval_encode_prompt(f.tok, "{nope}", "x", &ids, &n), MO_EINVAL);
    fx_close(&f);
}

typedef struct seen {
    int n;
    char text[N_EVAL][64];
    double reward[N_EVAL];
} seen_t;

static void on_sample(void *arg, int i, const char *prompt, const char *completion,
                      const char *answer, double reward) {
    seen_t *s = arg;
    (void)prompt;
    CU_ASSERT_STRING_EQUAL(answer, "zzz");
    CU_ASSERT_FATAL(i >= 0 && i < N_EVAL);
    snprintf(s->text[i], sizeof s->text[i], "%s", completion);
    s->reward[i] = reward;
    s->n++;
}

/* Greedy completions straight from the engine, for comparison. */
static void engine_greedy(fx_t *f, const eval_opts_t *o, char out[N_EVAL][64]) {
    engine_opts_t eo;
    memset(&eo, 0, sizeof eo);
    eo.max_seq_len = 64;
    eo.tok = f->tok;
    engine_t *e = NULL;
    CU_ASSERT_EQUAL_FATAL(engine_new(&e, f->m, &eo), 0);
    for (int i = 0; i < N_EVAL; i++) {
        dataset_item_t it;
        CU_ASSERT_EQUAL_FATAL(dataset_eval(f->d, (uint64_t)i, &it), 0);
        int32_t *ids;
        int n;
        CU_ASSERT_EQUAL_FATAL(eval_encode_prompt(f->tok, o->prompt_template, it.prompt, &ids, &n),
                              0);
        gen_request_t r;
        memset(&r, 0, sizeof r);
        r.id = 100 + (uint64_t)i;
        r.prompt = ids;
        r.prompt_len = n;
        r.n = 1;
        r.params = gen_params_default();
        r.params.sampling.temperature = 0.0f;
        r.params.max_new_tokens = o->max_new_tokens;
        r.params.stop_strings = o->stop_strings;
        r.params.n_stop_strings = o->n_stop_strings;
        gen_group_t *g = NULL;
        CU_ASSERT_EQUAL_FATAL(engine_generate(e, &r, 1, &g), 0);
        snprintf(out[i], 64, "%s", g->samples[0].text ? g->samples[0].text : "");
        gen_group_free(&g);
        free(ids);
    }
    engine_destroy(&e);
}

static double run(fx_t *f, const char *spec, double correct_at, int n, seen_t *seen,
                  eval_result_t *r) {
    static const char *const stops[1] = {"\n"};
    reward_fn_t *fn = NULL;
    CU_ASSERT_EQUAL_FATAL(reward_fn_parse(spec, &fn), 0);
    eval_opts_t o;
    memset(&o, 0, sizeof o);
    o.n = n;
    o.max_new_tokens = 5;
    o.max_batch = 4; /* two engine rounds */
    o.prompt_template = "Q:{prompt}";
    o.stop_strings = stops;
    o.n_stop_strings = 1;
    o.correct_at = correct_at;
    o.on_sample = on_sample;
    o.arg = seen;
    int rc = eval_greedy(f->m, NULL, f->tok, f->d, fn, &o, r);
    if (rc < 0)
        tu_report("eval: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    reward_fn_destroy(&fn);
    return r->accuracy;
}

static void test_greedy(void) {
    fx_t f;
    fx_open(&f);
    seen_t seen;
    memset(&seen, 0, sizeof seen);
    eval_result_t r;
    CU_ASSERT_EQUAL(run(&f, "constant:value=1", 0, 0, &seen, &r), 1.0);
    CU_ASSERT_EQUAL(r.n, N_EVAL);
    CU_ASSERT_EQUAL(seen.n, N_EVAL);
    CU_ASSERT_EQUAL(r.correct, N_EVAL);
    CU_ASSERT_EQUAL(r.reward_mean, 1.0);
    CU_ASSERT(r.tokens_mean >= 1.0 && r.tokens_mean <= 5.0);
    /* The same completions as the engine's own greedy decoding. */
    static const char *const stops[1] = {"\n"};
    eval_opts_t o;
    memset(&o, 0, sizeof o);
    o.max_new_tokens = 5;
    o.prompt_template = "Q:{prompt}";
    o.stop_strings = stops;
    o.n_stop_strings = 1;
    char direct[N_EVAL][64];
    engine_greedy(&f, &o, direct);
    for (int i = 0; i < N_EVAL; i++)
        CU_ASSERT_STRING_EQUAL(seen.text[i], direct[i]);
    /* Thresholds and real scoring. */
    memset(&seen, 0, sizeof seen);
    CU_ASSERT_EQUAL(run(&f, "constant:value=0.3", 0.5, 0, &seen, &r), 0.0);
    CU_ASSERT(r.reward_mean > 0.29 && r.reward_mean < 0.31);
    CU_ASSERT_EQUAL(run(&f, "constant:value=0.3", 0.25, 3, &seen, &r), 1.0);
    CU_ASSERT_EQUAL(r.n, 3);
    int zzz = 0;
    for (int i = 0; i < N_EVAL; i++)
        zzz += strcmp(direct[i], "zzz") == 0;
    run(&f, "exact", 0, 0, &seen, &r);
    CU_ASSERT_EQUAL(r.correct, zzz);
    fx_close(&f);
}

int main(void) {
    backend_cpu_set_threads(1); /* tiny shapes: threads only add overhead */
    CU_TestInfo tests[] = {
        {"prompt encoding", test_encode},
        {"greedy eval", test_greedy},
        CU_TEST_INFO_NULL,
    };
    return tu_main("eval", tests);
}
