/* Tests for the run report: rows kept in step order, the reward of each step read from
 * metrics JSON lines (other events, bad lines and repeats), held-out accuracy of the base
 * and of every checkpoint equal to eval_greedy on the same adapter (a checkpoint with
 * B = 0 scores as the base), the table, and the SVG plot (both series, escaped title). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "learner/checkpoint.h"
#include "learner/dataset.h"
#include "learner/eval.h"
#include "learner/run_report.h"
#include "reward/reward.h"
#include "tests/learner_fixture.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

static int count(const char *s, const char *what) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)) != NULL; p++)
        n++;
    return n;
}

static void test_rows_and_metrics(void) {
    run_report_t r;
    report_init(&r);
    int64_t steps[] = {5, 1, 3, 1, 9, 0};
    for (int i = 0; i < 6; i++)
        CU_ASSERT_FATAL(report_row(&r, steps[i]) != NULL);
    CU_ASSERT_EQUAL(r.n, 5);
    for (int i = 1; i < r.n; i++)
        CU_ASSERT(r.rows[i - 1].step < r.rows[i].step);
    CU_ASSERT(isnan(r.rows[2].reward_mean) && isnan(r.rows[2].accuracy));
    report_free(&r);

    char dir[256], path[400];
    CU_ASSERT_FATAL(tu_tmpdir(dir, sizeof dir) == 0);
    snprintf(path, sizeof path, "%s/learner.jsonl", dir);
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
#define STEP "\"event\":\"step\",\"moerl_learner_step\":"
#define REWARD ",\"moerl_learner_reward_mean\":"
    fputs("{\"time\":1,\"event\":\"start\",\"moerl_learner_step\":0" REWARD "7}\n"
          "{" STEP "1" REWARD "0.25}\n"
          "garbage\n"
          "[1,2]\n"
          "{" STEP "2" REWARD "null}\n"
          "{" STEP "3" REWARD "0.5}\n"
          "{" STEP "3" REWARD "0.625}\n",
          f);
    fclose(f);
    report_init(&r);
    CU_ASSERT_FATAL(report_read_metrics(&r, path) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.n, 2); /* the start event and the null reward add nothing */
    CU_ASSERT(r.rows[0].step == 1 && r.rows[0].reward_mean == 0.25);
    CU_ASSERT(r.rows[1].step == 3 && r.rows[1].reward_mean == 0.625);
    report_row(&r, 0)->accuracy = 0.125;
    report_row(&r, 3)->accuracy = 0.5;
    r.eval_n = 8;
    FILE *out = tmpfile();
    report_print(&r, out);
    rewind(out);
    char text[2048] = "";
    size_t k = fread(text, 1, sizeof text - 1, out);
    text[k] = 0;
    fclose(out);
    /* Lines at the evaluated steps; the reward averaged over steps 1 and 3. */
    CU_ASSERT(strstr(text, "     0            -              0.125\n") != NULL);
    CU_ASSERT(strstr(text, "\n     1 ") == NULL);
    CU_ASSERT(strstr(text, "     3        0.438              0.500\n") != NULL);
    CU_ASSERT(strstr(text, "held-out greedy accuracy (8 prompts): 0.125 at step 0, 0.500 at "
                           "step 3 (+37.5 points)") != NULL);

    char svg[400];
    snprintf(svg, sizeof svg, "%s/plot.svg", dir);
    CU_ASSERT_FATAL(report_write_svg(&r, "a <b> & \"c\"", svg) == MO_OK);
    char *s = slurp(svg);
    CU_ASSERT_FATAL(s != NULL);
    CU_ASSERT(strstr(s, "<svg xmlns=\"http://www.w3.org/2000/svg\"") != NULL);
    CU_ASSERT(strstr(s, "a &lt;b&gt; &amp; &quot;c&quot;") != NULL);
    CU_ASSERT_EQUAL(count(s, "<polyline"), 2);
    CU_ASSERT_EQUAL(count(s, "<circle"), 2); /* the two evaluated steps */
    CU_ASSERT(strstr(s, "reward mean (sampled)") && strstr(s, "held-out greedy accuracy"));
    CU_ASSERT(strstr(s, "</svg>\n") != NULL);
    free(s);
    CU_ASSERT(report_read_metrics(&r, "/nonexistent/learner.jsonl") == MO_EIO);
    report_free(&r);

    /* Without evaluations: about 20 lines, each averaging the steps since the last, and a
     * smoothed reward curve beside the raw one. */
    report_init(&r);
    for (int i = 1; i <= 100; i++)
        report_row(&r, i)->reward_mean = i / 100.0;
    out = tmpfile();
    report_print(&r, out);
    rewind(out);
    k = fread(text, 1, sizeof text - 1, out);
    text[k] = 0;
    fclose(out);
    CU_ASSERT_EQUAL(count(text, "\n"), 1 + 20 + 1); /* header, every 5th step, the note */
    CU_ASSERT(strstr(text, "     5        0.030                  -\n") != NULL);
    CU_ASSERT(strstr(text, "   100        0.980                  -\n") != NULL);
    CU_ASSERT(strstr(text, "held-out greedy accuracy (") == NULL);
    CU_ASSERT_FATAL(report_write_svg(&r, "no eval", svg) == MO_OK);
    s = slurp(svg);
    CU_ASSERT_FATAL(s != NULL);
    /* The raw reward, its average over 4 steps, and the (empty) accuracy. */
    CU_ASSERT_EQUAL(count(s, "<polyline"), 3);
    CU_ASSERT(strstr(s, "thick: average of 4 steps") != NULL);
    CU_ASSERT_EQUAL(count(s, "<circle"), 0);
    free(s);
    report_free(&r);
    CU_ASSERT(report_write_svg(&r, "empty", svg) == MO_EINVAL);
    tu_rmtree(dir);
}

/* Direct eval_greedy of an adapter (NULL: the base) for comparison. */
static double direct_accuracy(lf_t *f, const lora_adapter_t *ad, int n) {
    model_t *m = NULL;
    tokenizer_t *tok = NULL;
    dataset_t *d = NULL;
    reward_fn_t *fn = NULL;
    model_opts_t mo = {0};
    CU_ASSERT_FATAL(model_open(&m, f->cfg.model.path, &mo) == MO_OK);
    CU_ASSERT_FATAL(tokenizer_load(f->cfg.model.path, &tok) == MO_OK);
    CU_ASSERT_FATAL(dataset_open_config(&f->cfg, &d) == MO_OK);
    CU_ASSERT_FATAL(reward_fn_from_config(f->cfg.reward.function, "", &fn) == MO_OK);
    eval_opts_t o;
    eval_opts_from_config(&o, &f->cfg);
    o.n = n;
    eval_result_t res;
    CU_ASSERT_FATAL(eval_greedy(m, ad, tok, d, fn, &o, &res) == MO_OK);
    model_set_adapter(m, NULL);
    model_destroy(&m);
    tokenizer_destroy(&tok);
    dataset_destroy(&d);
    reward_fn_destroy(&fn);
    return res.accuracy;
}

static void test_eval_checkpoints(void) {
    lf_t f;
    lf_open(&f);
    /* Eval prompts from a JSONL file, scored by a pattern a random model meets now and
     * then: the accuracies are not all 0 or all 1. */
    char data[700];
    snprintf(data, sizeof data, "%s/data.jsonl", f.dir);
    FILE *fp = fopen(data, "w");
    CU_ASSERT_FATAL(fp != NULL);
    for (int i = 0; i < 24; i++)
        fprintf(fp, "{\"prompt\": \"%d+%d=\", \"answer\": \"%d\"}\n", i, 2 * i, 3 * i);
    fclose(fp);
    lf_set(&f, "data.task", "jsonl");
    lf_set(&f, "data.path", data);
    lf_set(&f, "data.eval_size", "12");
    lf_set(&f, "reward.function", "regex:pattern=\"[a-m]\"");
    lf_set(&f, "rollout.max_new_tokens", "6");
    trainer_t *t = lf_trainer(&f);
    checkpoint_state_t st = {0};
    st.seed = 17;
    st.config_hash = t->config_hash;
    st.step = 2;
    st.adapter_checksum = 0;
    /* Step 2: B = 0, the base's outputs. Step 4: every parameter perturbed. */
    CU_ASSERT_FATAL(checkpoint_save(f.run_dir, t->adapter, &t->optim, &st, NULL, NULL, 0) == MO_OK);
    for (size_t i = 0; i < t->adapter->n_params; i++)
        t->adapter->params[i] += 0.5f * (rng_uniform(5, 9, i) - 0.5f);
    st.step = 4;
    CU_ASSERT_FATAL(checkpoint_save(f.run_dir, t->adapter, &t->optim, &st, NULL, NULL, 0) == MO_OK);
    double want_base = direct_accuracy(&f, NULL, 12);
    double want_4 = direct_accuracy(&f, t->adapter, 12);
    trainer_destroy(&t);

    run_report_t r;
    report_init(&r);
    CU_ASSERT_FATAL(report_eval_checkpoints(&r, &f.cfg, f.run_dir, 12, NULL, NULL) == MO_OK);
    CU_ASSERT_EQUAL_FATAL(r.n, 3);
    CU_ASSERT_EQUAL(r.eval_n, 12);
    CU_ASSERT(r.rows[0].step == 0 && r.rows[1].step == 2 && r.rows[2].step == 4);
    CU_ASSERT_DOUBLE_EQUAL(r.rows[0].accuracy, want_base, 0);
    CU_ASSERT_DOUBLE_EQUAL(r.rows[1].accuracy, want_base, 0);
    CU_ASSERT_DOUBLE_EQUAL(r.rows[2].accuracy, want_4, 0);
    for (int i = 0; i < 3; i++)
        CU_ASSERT(r.rows[i].accuracy >= 0 && r.rows[i].accuracy <= 1);
    report_free(&r);
    lf_close(&f);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"rows and metrics", test_rows_and_metrics},
        {"eval checkpoints", test_eval_checkpoints},
        CU_TEST_INFO_NULL,
    };
    return tu_main("run_report", tests);
}
