/* test_sft: supervised warm start: pair encoding and the response-only loss, the loss
 * falling on a small batch, masking of prompt tokens, LoRA and merged full-model saves
 * (with routers and norms trained in full too), and greedy eval accuracy after
 * memorising the eval problems. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "actor/tokenizer.h"
#include "core/backend.h"
#include "core/status.h"
#include "learner/sft.h"
#include "lora/peft.h"
#include "tests/testutil.h"

typedef struct fx {
    char dir[512], model[600];
    moerl_config_t cfg;
} fx_t;

static void set(fx_t *f, const char *k, const char *v) {
    int rc = config_set(&f->cfg, k, v);
    if (rc < 0)
        tu_report("%s: %s", k, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

static void fx_open(fx_t *f) {
    memset(f, 0, sizeof *f);
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(f->dir, sizeof f->dir), 0);
    snprintf(f->model, sizeof f->model, "%s/model", f->dir);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32), 0);
    init_model_opts_t io = {11, 0.1f};
    CU_ASSERT_EQUAL_FATAL(init_model_write(f->model, &c, &io), 0);
    CU_ASSERT_EQUAL_FATAL(config_defaults(&f->cfg), 0);
    set(f, "model.path", f->model);
    set(f, "model.max_seq_len", "64");
    set(f, "run.seed", "5");
    set(f, "lora.rank", "8");
    set(f, "lora.alpha", "16");
    set(f, "lora.targets", "q_proj,k_proj,v_proj,o_proj,experts");
    set(f, "data.task", "arith");
    set(f, "data.eval_size", "8");
    set(f, "rollout.max_new_tokens", "6");
    set(f, "rollout.stop_strings", "[\"\\n\"]");
    set(f, "learner.micro_batch_tokens", "40");
}

static void fx_close(fx_t *f) {
    config_free(&f->cfg);
    tu_rmtree(f->dir);
}

static sft_t *fx_sft(fx_t *f, int full, double lr, int64_t steps) {
    sft_opts_t o = sft_opts_default();
    o.full = full;
    o.lr = lr;
    o.steps = steps;
    o.warmup = 0;
    o.rank = full ? 16 : 0;
    sft_t *s = NULL;
    int rc = sft_new(&s, &f->cfg, &o);
    if (rc < 0)
        tu_report("sft_new: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return s;
}

static const sft_pair_t k_pairs[4] = {
    {"12+34=", "46"}, {"7-5=", "2"}, {"100+1=", "101"}, {"9-9=", "0"}};

static void test_encode_and_loss(void) {
    fx_t f;
    fx_open(&f);
    set(&f, "rollout.prompt_template", "Q:{prompt}");
    sft_t *s = fx_sft(&f, 0, 1e-3, 10);
    int32_t *ids;
    int n, P;
    CU_ASSERT_EQUAL_FATAL(sft_encode_pair(s, "12+3=", "15", &ids, &n, &P), 0);
    CU_ASSERT_EQUAL(P, 7); /* "Q:12+3=" in bytes */
    CU_ASSERT_EQUAL_FATAL(n, 10);
    CU_ASSERT_EQUAL(ids[0], 'Q');
    CU_ASSERT_EQUAL(ids[6], '=');
    CU_ASSERT_EQUAL(ids[7], '1');
    CU_ASSERT_EQUAL(ids[8], '5');
    CU_ASSERT_EQUAL(ids[9], TOK_BYTELEVEL_EOS);
    free(ids);
    /* Positions P-1 .. n-2 predict the response and eos; the rest carry no loss. */
    float logp[10], dlogp[10];
    uint8_t mask[10];
    for (int t = 0; t < 10; t++) {
        logp[t] = -0.5f - 0.1f * (float)t;
        mask[t] = t >= P - 1 && t < n - 1;
    }
    tu_poison(dlogp, 10);
    double L = sft_loss_grad(dlogp, logp, mask, 10, 4.0);
    double want = -(logp[6] + logp[7] + logp[8]) / 4.0;
    CU_ASSERT(fabs(L - want) < 1e-6);
    for (int t = 0; t < 10; t++)
        CU_ASSERT_EQUAL(dlogp[t], mask[t] ? -0.25f : 0.0f);
    sft_destroy(&s);
    fx_close(&f);
}

static void test_loss_falls(void) {
    fx_t f;
    fx_open(&f);
    sft_t *s = fx_sft(&f, 0, 1e-2, 40);
    double first = 0, last = 0;
    for (int k = 0; k < 40; k++) {
        sft_step_result_t r;
        CU_ASSERT_EQUAL_FATAL(sft_step(s, k_pairs, 4, &r), 0);
        CU_ASSERT_EQUAL(r.pairs, 4);
        CU_ASSERT_EQUAL(r.tokens, 2 + 1 + 1 + 1 + 3 + 1 + 1 + 1);
        CU_ASSERT(r.applied);
        if (k == 0)
            first = r.loss;
        last = r.loss;
    }
    if (!(last < 0.3 * first))
        tu_report("loss %g -> %g", first, last);
    CU_ASSERT(last < 0.3 * first);
    /* Batches from the task stream train too. */
    sft_step_result_t r;
    CU_ASSERT_EQUAL_FATAL(sft_step(s, NULL, 0, &r), 0);
    CU_ASSERT_EQUAL(r.pairs, 32);
    CU_ASSERT(isfinite(r.loss) && r.loss > 0);
    CU_ASSERT_EQUAL(s->step, 41);
    sft_destroy(&s);
    fx_close(&f);
}

/* Mean logprob of prompt-token and response-token predictions of a pair. */
static void mean_logps(sft_t *s, const sft_pair_t *p, double *prompt, double *resp) {
    int32_t *ids, pos[64], tgt[64], cu[2];
    int n, P;
    float lp[64];
    CU_ASSERT_EQUAL_FATAL(sft_encode_pair(s, p->prompt, p->response, &ids, &n, &P), 0);
    CU_ASSERT_FATAL(n <= 64);
    cu[0] = 0;
    cu[1] = n;
    model_batch_next_token(pos, tgt, ids, cu, 1);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(s->m, s->ad), 0);
    model_batch_t b = {n, 1, ids, pos, cu, tgt, 1.0f, NULL, NULL};
    CU_ASSERT_EQUAL_FATAL(model_forward(s->m, &b, lp, NULL, 0), 0);
    *prompt = *resp = 0;
    for (int t = 0; t < P - 1; t++)
        *prompt += lp[t] / (P - 1);
    for (int t = P - 1; t < n - 1; t++)
        *resp += lp[t] / (n - P);
    free(ids);
}

static void test_response_only(void) {
    static const sft_pair_t pairs[3] = {
        {"qwertyuiop", "123"}, {"asdfghjkl", "456"}, {"zxcvbnmlk", "789"}};
    fx_t f;
    fx_open(&f);
    sft_t *s = fx_sft(&f, 0, 1e-2, 30);
    double p0 = 0, r0 = 0, p1 = 0, r1 = 0;
    for (int i = 0; i < 3; i++) {
        double p, r;
        mean_logps(s, &pairs[i], &p, &r);
        p0 += p / 3;
        r0 += r / 3;
    }
    for (int k = 0; k < 30; k++)
        CU_ASSERT_EQUAL_FATAL(sft_step(s, pairs, 3, NULL), 0);
    for (int i = 0; i < 3; i++) {
        double p, r;
        mean_logps(s, &pairs[i], &p, &r);
        p1 += p / 3;
        r1 += r / 3;
    }
    if (!(r1 - r0 > 2.0 && p1 - p0 < 0.1 * (r1 - r0)))
        tu_report("prompt %g -> %g, response %g -> %g", p0, p1, r0, r1);
    CU_ASSERT(r1 - r0 > 2.0);             /* the responses are learnt */
    CU_ASSERT(p1 - p0 < 0.1 * (r1 - r0)); /* the prompts are not */
    sft_destroy(&s);
    fx_close(&f);
}

/* LoRA SFT saves a PEFT adapter that loads back bit for bit; with lora.train_router and
 * lora.train_norms the routers and norms train next to the adapters (each one moves) and
 * are saved with it as modules_to_save. */
static void run_lora_save(int full_tensors) {
    fx_t f;
    fx_open(&f);
    if (full_tensors) {
        set(&f, "lora.train_router", "true");
        set(&f, "lora.train_norms", "true");
    }
    sft_t *s = fx_sft(&f, 0, 1e-2, 5);
    const model_t *m = s->m;
    int want = 0;
    for (int l = 0; full_tensors && l < m->L; l++)
        want += 2 + (m->layers[l].q_norm ? 2 : 0) + m->layers[l].moe;
    want += full_tensors;
    CU_ASSERT_EQUAL_FATAL(s->ad->n_full, want);
    float *before = malloc(sizeof(float) * s->ad->n_params);
    memcpy(before, s->ad->params, sizeof(float) * s->ad->n_params);
    for (int k = 0; k < 5; k++)
        CU_ASSERT_EQUAL_FATAL(sft_step(s, k_pairs, 4, NULL), 0);
    for (int i = s->ad->n_tensors - s->ad->n_full; i < s->ad->n_tensors; i++) {
        const lora_tensor_t *lt = &s->ad->tensors[i];
        int moved =
            memcmp(before + lt->offset, s->ad->params + lt->offset, sizeof(float) * lt->numel) != 0;
        if (!moved)
            tu_report("%s did not move", lt->name);
        CU_ASSERT(moved);
    }
    free(before);
    char dir[700];
    snprintf(dir, sizeof dir, "%s/adapter", f.dir);
    CU_ASSERT_EQUAL_FATAL(sft_save(s, dir), 0);
    lora_adapter_t *ad = NULL;
    CU_ASSERT_EQUAL_FATAL(peft_load_new(&ad, dir, s->m->modules, s->m->n_modules, 1), 0);
    CU_ASSERT_EQUAL(ad->n_params, s->ad->n_params);
    CU_ASSERT_EQUAL(ad->n_full, want);
    CU_ASSERT(!memcmp(ad->params, s->ad->params, sizeof(float) * ad->n_params));
    if (full_tensors) {
        CU_ASSERT(lora_adapter_find_full(ad, "model.layers.0.mlp.gate.weight") >= 0);
        CU_ASSERT(lora_adapter_find_full(ad, "model.norm.weight") >= 0);
    }
    lora_adapter_destroy(&ad);
    sft_destroy(&s);
    fx_close(&f);
}

static void test_lora_save(void) {
    run_lora_save(0);
}

static void test_lora_save_full_tensors(void) {
    run_lora_save(1);
}

/* Full-model SFT: the merged directory loads as a model, and at temperature 1 it computes
 * what the trained adapter computed at temperature 1 / logit_scale; with lora.train_norms
 * and lora.train_router the trained norms and routers are written in place of the base's. */
static void run_full_merge(int full_tensors) {
    fx_t f;
    fx_open(&f);
    if (full_tensors) {
        set(&f, "lora.train_router", "true");
        set(&f, "lora.train_norms", "true");
    }
    sft_t *s = fx_sft(&f, 1, 1e-2, 10);
    CU_ASSERT_EQUAL(s->ad->R, 16);
    CU_ASSERT_EQUAL(s->ad->n_entries, s->m->n_modules); /* every projection */
    for (int k = 0; k < 10; k++)
        CU_ASSERT_EQUAL_FATAL(sft_step(s, k_pairs, 4, NULL), 0);
    char dir[700];
    snprintf(dir, sizeof dir, "%s/merged", f.dir);
    int rc = sft_save(s, dir);
    if (rc < 0)
        tu_report("save: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    model_t *mm = NULL;
    rc = model_open(&mm, dir, NULL);
    if (rc < 0)
        tu_report("open merged: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(mm->cfg.torch_dtype, DT_F32);
    tokenizer_t *tok = NULL;
    CU_ASSERT_EQUAL(tokenizer_load(dir, &tok), 0);
    tokenizer_destroy(&tok);
    int32_t *ids, pos[64], tgt[64], cu[2];
    int n, P;
    CU_ASSERT_EQUAL_FATAL(sft_encode_pair(s, "123+456=", "579", &ids, &n, &P), 0);
    cu[0] = 0;
    cu[1] = n;
    model_batch_next_token(pos, tgt, ids, cu, 1);
    float a[64], b[64];
    tu_poison(a, 64);
    tu_poison(b, 64);
    CU_ASSERT_EQUAL_FATAL(model_set_adapter(s->m, s->ad), 0);
    model_batch_t ba = {n, 1, ids, pos, cu, tgt, s->temperature, NULL, NULL};
    CU_ASSERT_EQUAL_FATAL(model_forward(s->m, &ba, a, NULL, 0), 0);
    model_batch_t bb = ba;
    bb.temperature = 1.0f;
    CU_ASSERT_EQUAL_FATAL(model_forward(mm, &bb, b, NULL, 0), 0);
    TU_ASSERT_CLOSE(tu_rel_err_ff(b, a, (size_t)n, 1e-3), 1e-4, "merged vs adapter logprobs");
    if (full_tensors) {
        int t = lora_adapter_find_full(s->ad, "model.layers.1.post_attention_layernorm.weight");
        CU_ASSERT_FATAL(t >= 0);
        const float *w = s->ad->params + s->ad->tensors[t].offset;
        CU_ASSERT(w[0] != 1.0f); /* trained away from the initial ones */
        CU_ASSERT(!memcmp(mm->layers[1].mlp_norm, w, sizeof(float) * (size_t)mm->D));
        t = lora_adapter_find_full(s->ad, "model.layers.1.mlp.gate.weight");
        CU_ASSERT_FATAL(t >= 0);
        CU_ASSERT(mm->layers[1].moe_w.router.dtype == DT_F32);
        CU_ASSERT(!memcmp(mm->layers[1].moe_w.router.data, s->ad->params + s->ad->tensors[t].offset,
                          sizeof(float) * (size_t)mm->E * mm->D));
    }
    free(ids);
    model_destroy(&mm);
    sft_destroy(&s);
    fx_close(&f);
}

static void test_full_merge(void) {
    run_full_merge(0);
}

static void test_full_merge_full_tensors(void) {
    run_full_merge(1);
}

/* Training on the eval problems themselves: greedy eval then answers them. */
static void test_memorise_eval(void) {
    fx_t f;
    fx_open(&f);
    set(&f, "learner.micro_batch_tokens", "4096");
    sft_opts_t o = sft_opts_default();
    o.full = 1;
    o.lr = 1e-2;
    o.steps = 150;
    o.warmup = 0;
    sft_t *s = NULL;
    CU_ASSERT_EQUAL_FATAL(sft_new(&s, &f.cfg, &o), 0);
    eval_result_t r0, r1;
    CU_ASSERT_EQUAL_FATAL(sft_eval(s, NULL, &r0), 0);
    CU_ASSERT_EQUAL(r0.n, 8);
    sft_pair_t pairs[8];
    char store[8][2][32];
    for (int i = 0; i < 8; i++) {
        dataset_item_t it; /* its strings point into it.task: copy them */
        CU_ASSERT_EQUAL_FATAL(dataset_eval(s->d, (uint64_t)i, &it), 0);
        snprintf(store[i][0], sizeof store[i][0], "%s", it.prompt);
        snprintf(store[i][1], sizeof store[i][1], "%s", it.answer);
        pairs[i].prompt = store[i][0];
        pairs[i].response = store[i][1];
    }
    sft_step_result_t r;
    for (int k = 0; k < 150; k++)
        CU_ASSERT_EQUAL_FATAL(sft_step(s, pairs, 8, &r), 0);
    CU_ASSERT_EQUAL_FATAL(sft_eval(s, NULL, &r1), 0);
    if (!(r1.accuracy >= 0.75))
        tu_report("eval accuracy %g -> %g (loss %g)", r0.accuracy, r1.accuracy, r.loss);
    CU_ASSERT(r1.accuracy >= 0.75);
    CU_ASSERT(r1.accuracy > r0.accuracy);
    CU_ASSERT_EQUAL(r1.correct, (int)lround(r1.accuracy * 8));
    sft_destroy(&s);
    fx_close(&f);
}

/* The command: `moerl sft CONFIG --full` writes a model directory that loads. */
static void test_command(void) {
    fx_t f;
    fx_open(&f);
    char cfg[700], out[700], cmd[3000];
    snprintf(cfg, sizeof cfg, "%s/job.yaml", f.dir);
    snprintf(out, sizeof out, "%s/sft-model", f.dir);
    FILE *fp = fopen(cfg, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(fp);
    config_dump(&f.cfg, fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd,
             "'%s' sft '%s' --full --steps 4 --batch 4 --rank 8 --eval-every 2 --eval-n 2 "
             "--log-every 2 --out '%s' --set run.threads=1 > '%s/log.txt' 2>&1",
             tu_moerl_exe(), cfg, out, f.dir);
    int rc = system(cmd);
    if (rc != 0) {
        snprintf(cmd, sizeof cmd, "cat '%s/log.txt' >&2", f.dir);
        CU_ASSERT_EQUAL(system(cmd), 0);
    }
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    model_t *m = NULL;
    CU_ASSERT_EQUAL(model_open(&m, out, NULL), 0);
    model_destroy(&m);
    snprintf(cmd, sizeof cmd, "grep -q 'eval step 4: accuracy' '%s/log.txt'", f.dir);
    CU_ASSERT_EQUAL(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' sft '%s' --steps 0 > /dev/null 2>&1", tu_moerl_exe(), cfg);
    CU_ASSERT_EQUAL(WEXITSTATUS(system(cmd)), 2);
    fx_close(&f);
}

int main(void) {
    backend_cpu_set_threads(1); /* tiny shapes: threads only add overhead */
    CU_TestInfo tests[] = {
        {"pair encoding and the response-only loss", test_encode_and_loss},
        {"the loss falls on a small batch", test_loss_falls},
        {"prompt tokens are not trained", test_response_only},
        {"LoRA SFT saves a PEFT adapter", test_lora_save},
        {"LoRA SFT trains and saves routers and norms", test_lora_save_full_tensors},
        {"full SFT merges into a loadable model", test_full_merge},
        {"full SFT merges trained routers and norms", test_full_merge_full_tensors},
        {"memorised eval problems are answered", test_memorise_eval},
        {"the sft command", test_command},
        CU_TEST_INFO_NULL,
    };
    return tu_main("sft", tests);
}
