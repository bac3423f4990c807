/* eval: greedy generation on the rollout engine for eval prompts, scored by a reward. */
#include "learner/eval.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "rollout/engine.h"

int eval_encode_prompt(const tokenizer_t *tok, const char *tmpl, const char *text, int32_t **ids,
                       int *n) {
    *ids = NULL;
    *n = 0;
    char *full = NULL;
    if (tmpl)
        TRY(tokenizer_apply_template(tmpl, text, &full));
    const char *src = full ? full : text;
    int32_t *body = NULL;
    size_t nb = 0;
    int rc = tokenizer_encode(tok, src, strlen(src), true, &body, &nb);
    free(full);
    TRY(rc);
    const int32_t *pre, *suf;
    size_t np = 0, ns = 0;
    tokenizer_affixes(tok, &pre, &np, &suf, &ns);
    size_t total = np + nb + ns;
    if (total == 0 || total > (size_t)1 << 30) {
        free(body);
        return mo_errorf(MO_EINVAL, "prompt \"%.40s\" encodes to %zu tokens", text, total);
    }
    int32_t *out = malloc(sizeof *out * total);
    if (!out) {
        free(body);
        return mo_errorf(MO_ENOMEM, "out of memory encoding a prompt");
    }
    if (np)
        memcpy(out, pre, sizeof *out * np);
    if (nb)
        memcpy(out + np, body, sizeof *out * nb);
    if (ns)
        memcpy(out + np + nb, suf, sizeof *out * ns);
    free(body);
    *ids = out;
    *n = (int)total;
    return MO_OK;
}

void eval_opts_from_config(eval_opts_t *o, const moerl_config_t *c) {
    memset(o, 0, sizeof *o);
    o->max_new_tokens = c->rollout.max_new_tokens;
    o->max_batch = c->rollout.max_batch;
    o->prompt_template = c->rollout.prompt_template;
    o->stop_strings = (const char *const *)c->rollout.stop_strings.items;
    o->n_stop_strings = c->rollout.stop_strings.n;
}

/* The encoded prompts of eval items [0, n). */
typedef struct eval_batch {
    int n;
    int32_t **ids; /* (n) */
    int *len;      /* (n) */
    int max_len;
} eval_batch_t;

static void batch_free(eval_batch_t *b) {
    for (int i = 0; b->ids && i < b->n; i++)
        free(b->ids[i]);
    free(b->ids);
    free(b->len);
}

static int batch_encode(eval_batch_t *b, const tokenizer_t *tok, const dataset_t *d,
                        const eval_opts_t *o, int n) {
    memset(b, 0, sizeof *b);
    b->ids = calloc((size_t)n, sizeof *b->ids);
    b->len = calloc((size_t)n, sizeof *b->len);
    if (!b->ids || !b->len)
        return mo_errorf(MO_ENOMEM, "eval: out of memory");
    b->n = n;
    for (int i = 0; i < n; i++) {
        dataset_item_t it;
        TRY(dataset_eval(d, (uint64_t)i, &it));
        TRY(eval_encode_prompt(tok, o->prompt_template, it.prompt, &b->ids[i], &b->len[i]));
        b->max_len = b->len[i] > b->max_len ? b->len[i] : b->max_len;
    }
    return MO_OK;
}

static int score_group(const gen_group_t *g, const dataset_t *d, int i, const reward_fn_t *fn,
                       const eval_opts_t *o, eval_result_t *r) {
    if (g->status < 0)
        return mo_errorf(g->status, "eval prompt %d: %s", i, g->error ? g->error : "failed");
    const gen_sample_t *s = &g->samples[0];
    dataset_item_t it;
    TRY(dataset_eval(d, (uint64_t)i, &it));
    reward_input_t in;
    reward_input_init(&in, it.prompt, s->text ? s->text : "", it.answer);
    in.extra = it.extra;
    in.n_extra = it.n_extra;
    in.finish_reason = s->finish == FINISH_LENGTH ? MOERL_FINISH_LENGTH : MOERL_FINISH_STOP;
    in.completion_tokens = s->n_tokens;
    double reward = 0;
    TRY(reward_fn_score(fn, &in, &reward, NULL, NULL, 0));
    double at = o->correct_at > 0 ? o->correct_at : 1.0;
    r->correct += reward >= at - 1e-9;
    r->reward_mean += reward;
    r->tokens_mean += s->n_tokens;
    r->truncated += s->finish == FINISH_LENGTH;
    r->n++;
    if (o->on_sample)
        o->on_sample(o->arg, i, it.prompt, s->text ? s->text : "", it.answer, reward);
    return MO_OK;
}

/* Requests [i0, i1) through the engine, scored. */
static int run_chunk(engine_t *e, const eval_batch_t *b, int i0, int i1, const dataset_t *d,
                     const reward_fn_t *fn, const eval_opts_t *o, eval_result_t *r) {
    int n = i1 - i0;
    gen_request_t *req = calloc((size_t)n, sizeof *req);
    gen_group_t **out = calloc((size_t)n, sizeof *out);
    int rc = req && out ? MO_OK : mo_errorf(MO_ENOMEM, "eval: out of memory");
    for (int k = 0; rc == MO_OK && k < n; k++) {
        gen_request_t *q = &req[k];
        q->id = (uint64_t)(i0 + k);
        q->prompt = b->ids[i0 + k];
        q->prompt_len = b->len[i0 + k];
        q->n = 1;
        q->params = gen_params_default();
        q->params.sampling.temperature = 0.0f;
        q->params.max_new_tokens = o->max_new_tokens;
        q->params.stop_strings = o->stop_strings;
        q->params.n_stop_strings = o->n_stop_strings;
        q->params.record_routing = 0;
    }
    if (rc == MO_OK)
        rc = engine_generate(e, req, n, out);
    for (int k = 0; rc == MO_OK && k < n; k++)
        rc = score_group(out[k], d, i0 + k, fn, o, r);
    for (int k = 0; out && k < n; k++)
        gen_group_free(&out[k]);
    free(out);
    free(req);
    return rc;
}

int eval_greedy(model_t *m, const lora_adapter_t *ad, const tokenizer_t *tok, const dataset_t *d,
                const reward_fn_t *fn, const eval_opts_t *o, eval_result_t *r) {
    memset(r, 0, sizeof *r);
    if (!m || !tok || !d || !fn || !o || o->max_new_tokens < 1)
        return mo_errorf(MO_EINVAL, "eval: model, tokenizer, dataset, reward and options with "
                                    "max_new_tokens >= 1 are required");
    uint64_t avail = dataset_eval_size(d);
    int n = o->n > 0 && (uint64_t)o->n < avail ? o->n : (int)(avail > 1000000 ? 1000000 : avail);
    if (n < 1)
        return mo_errorf(MO_EINVAL, "eval: the dataset has no eval item (data.eval_size)");
    eval_batch_t b;
    int rc = batch_encode(&b, tok, d, o, n);
    engine_t *e = NULL;
    int mb = o->max_batch > 0 ? o->max_batch : 64;
    if (rc == MO_OK) {
        engine_opts_t eo;
        memset(&eo, 0, sizeof eo);
        eo.max_batch = mb < n ? mb : n;
        eo.max_seq_len = b.max_len + o->max_new_tokens;
        eo.tok = tok;
        rc = engine_new(&e, m, &eo);
    }
    if (rc == MO_OK)
        rc = engine_set_adapter(e, ad, 0);
    for (int i0 = 0; rc == MO_OK && i0 < n; i0 += mb)
        rc = run_chunk(e, &b, i0, i0 + mb < n ? i0 + mb : n, d, fn, o, r);
    engine_destroy(&e);
    batch_free(&b);
    if (rc < 0)
        return rc;
    r->accuracy = (double)r->correct / r->n;
    r->reward_mean /= r->n;
    r->tokens_mean /= r->n;
    return MO_OK;
}
