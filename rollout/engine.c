/* engine: requests, admission under the KV budget, prefill and decode steps, sampling,
 * stop conditions and results. */
#include "rollout/engine.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "rollout/decode.h"
#include "rollout/engine_int.h"
#include "rollout/kv_cache.h"

const char *finish_reason_name(finish_reason_t r) {
    switch (r) {
    case FINISH_NONE: return "running";
    case FINISH_LENGTH: return "length";
    case FINISH_STOP_TOKEN: return "stop_token";
    case FINISH_STOP_STRING: return "stop_string";
    case FINISH_ERROR: return "error";
    }
    return "unknown";
}

/* ------------------------------------------------------------------------ */
/* Options and parameters.                                                   */

void engine_opts_from_config(engine_opts_t *o, const moerl_config_t *c) {
    memset(o, 0, sizeof *o);
    o->max_batch = c->rollout.max_batch;
    o->max_seq_len = c->model.max_seq_len;
    o->kv_cache_tokens = c->rollout.kv_cache_tokens;
    o->merge_adapter = c->rollout.merge_adapter;
    o->no_packed_weights = !c->rollout.packed_weights;
    o->cuda_graphs = c->rollout.cuda_graphs;
    o->device = c->run.device;
}

gen_params_t gen_params_default(void) {
    gen_params_t p;
    memset(&p, 0, sizeof p);
    p.sampling = sampling_params_default();
    p.max_new_tokens = 256;
    p.record_routing = 1;
    return p;
}

void gen_params_from_config(gen_params_t *p, const moerl_config_t *c) {
    const config_rollout_t *r = &c->rollout;
    *p = gen_params_default();
    p->sampling.temperature = (float)r->temperature;
    p->sampling.top_p = (float)r->top_p;
    p->sampling.top_k = r->top_k;
    p->sampling.min_p = (float)r->min_p;
    p->max_new_tokens = r->max_new_tokens;
    p->seed = (uint64_t)c->run.seed;
    p->stop_strings = (const char *const *)r->stop_strings.items;
    p->n_stop_strings = r->stop_strings.n;
    p->record_prompt_routing = r->record_prompt_routing;
}

static int resolve_opts(engine_opts_t *o, const model_t *m) {
    if (o->max_batch < 0 || o->max_seq_len < 0 || o->kv_cache_tokens < 0 ||
        o->max_prefill_tokens < 0 || o->block_tokens < 0)
        return mo_errorf(MO_EINVAL,
                         "rollout engine: max_batch %d, max_seq_len %d, "
                         "kv_cache_tokens %lld, max_prefill_tokens %d and "
                         "block_tokens %d must be >= 0 (0 = default)",
                         o->max_batch, o->max_seq_len, (long long)o->kv_cache_tokens,
                         o->max_prefill_tokens, o->block_tokens);
    if (o->max_batch == 0)
        o->max_batch = 64;
    if (o->max_seq_len == 0) {
        int64_t mp = m->cfg.max_position_embeddings;
        o->max_seq_len = mp > 0 && mp < 2048 ? (int)mp : 2048;
    }
    if (o->kv_cache_tokens == 0)
        o->kv_cache_tokens = (int64_t)o->max_batch * o->max_seq_len;
    if (o->max_prefill_tokens == 0)
        o->max_prefill_tokens = 4096;
    if (o->block_tokens == 0)
        o->block_tokens = KV_BLOCK_TOKENS;
    if (o->device != DEV_CPU && o->device != DEV_CUDA)
        return mo_errorf(MO_EINVAL, "rollout engine: device %d is neither cpu nor cuda",
                         (int)o->device);
    if (o->device == DEV_CUDA && o->merge_adapter)
        return mo_errorf(MO_ECONFIG, "rollout engine: merge_adapter is not available on "
                                     "device cuda (the adapter runs unmerged there)");
#ifndef MOERL_HAVE_CUDA
    if (o->device == DEV_CUDA)
        return mo_errorf(MO_ECONFIG, "rollout engine: device cuda needs a build with the "
                                     "CUDA backend (this one has none)");
#endif
    return MO_OK;
}

/* The model's eos ids and the tokenizer's, without repeats. */
static int default_stops(engine_t *e) {
    const model_config_t *c = &e->m->cfg;
    e->eos = malloc(sizeof *e->eos * (size_t)(c->n_eos + 1));
    if (!e->eos)
        return mo_errorf(MO_ENOMEM, "rollout engine: out of memory");
    for (int i = 0; i < c->n_eos; i++)
        e->eos[e->n_eos++] = c->eos_token_id[i];
    int32_t t = e->opts.tok ? tokenizer_eos_id(e->opts.tok) : -1;
    int seen = 0;
    for (int i = 0; i < e->n_eos; i++)
        seen |= e->eos[i] == t;
    if (t >= 0 && !seen)
        e->eos[e->n_eos++] = t;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Engine.                                                                   */

int engine_new(engine_t **out, model_t *m, const engine_opts_t *opts) {
    *out = NULL;
    engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return mo_errorf(MO_ENOMEM, "rollout engine: out of memory");
    e->m = m;
    if (opts)
        e->opts = *opts;
    e->M = m->n_moe;
    e->K = m->K;
    arena_init(&e->step_ar, (size_t)1 << 20);
    arena_init(&e->layer_ar, (size_t)1 << 20);
    int rc = resolve_opts(&e->opts, m);
    if (rc == MO_OK)
        rc = decode_kv_cache_init(&e->kv, m, e->opts.kv_cache_tokens, e->opts.block_tokens);
    int dev = e->opts.device == DEV_CUDA;
    if (rc == MO_OK)
        rc = rl_weights_init(&e->w, m, !e->opts.no_packed_weights && !dev);
    if (rc == MO_OK && e->opts.merge_adapter)
        rc = rl_weights_merge(&e->w, m, NULL);
    if (rc == MO_OK)
        rc = default_stops(e);
    if (rc == MO_OK) {
        e->n_threads = omp_get_max_threads();
        e->samplers = calloc((size_t)e->n_threads, sizeof *e->samplers);
        if (!e->samplers)
            rc = mo_errorf(MO_ENOMEM, "rollout engine: out of memory");
        for (int i = 0; rc == MO_OK && i < e->n_threads; i++)
            rc = sampler_init(&e->samplers[i], m->V);
    }
    if (rc == MO_OK && !e->opts.merge_adapter)
        e->adapter = m->adapter;
#ifdef MOERL_HAVE_CUDA
    if (rc == MO_OK && dev)
        rc = engine_cuda_open(e);
#endif
    if (rc < 0) {
        engine_destroy(&e);
        return rc;
    }
    *out = e;
    return MO_OK;
}

static void group_destroy(eng_group_t *g, kv_cache_t *kv);

void engine_destroy(engine_t **pe) {
    engine_t *e = pe ? *pe : NULL;
    if (!e)
        return;
    queue_t *qs[3] = {&e->waiting, &e->prefill, &e->done};
    for (int i = 0; i < 3; i++)
        while (qs[i]->head) {
            eng_group_t *g = qs[i]->head;
            qs[i]->head = g->next;
            gen_group_free(&g->out);
            group_destroy(g, &e->kv);
        }
    /* Groups of active samples are in none of the queues: list each once, then free. */
    eng_group_t *running = NULL;
    for (int i = 0; i < e->n_active; i++) {
        eng_group_t *g = e->active[i]->g;
        if (!g->listed) {
            g->listed = 1;
            g->next = running;
            running = g;
        }
    }
    while (running) {
        eng_group_t *g = running;
        running = g->next;
        gen_group_free(&g->out);
        group_destroy(g, &e->kv);
    }
    free(e->active);
#ifdef MOERL_HAVE_CUDA
    engine_cuda_close(e);
#endif
    if (e->bound && e->m->adapter == e->adapter)
        model_set_adapter(e->m, NULL); /* the binding the engine made */
    if (e->samplers)
        for (int i = 0; i < e->n_threads; i++)
            sampler_free(&e->samplers[i]);
    free(e->samplers);
    free(e->eos);
    rl_weights_free(&e->w);
    kv_cache_free(&e->kv);
    arena_free(&e->step_ar);
    arena_free(&e->layer_ar);
    free(e);
    *pe = NULL;
}

/* Device mode: the device takes the model's bound adapter. */
static int bind_device(engine_t *e) {
#ifdef MOERL_HAVE_CUDA
    if (e->dev)
        return engine_cuda_bind(e);
#else
    (void)e;
#endif
    return MO_OK;
}

/* kv_seq_fork, with the partial block's copy made on the device in device mode. */
static int fork_seq(engine_t *e, kv_seq_t *dst, const kv_seq_t *src, int64_t *budget) {
    TRY(kv_seq_fork(&e->kv, dst, src, budget));
#ifdef MOERL_HAVE_CUDA
    if (e->dev && src->len % e->kv.block_tokens != 0) {
        int rc = engine_cuda_copy_block(e, src->blocks[src->n_blocks - 1],
                                        dst->blocks[dst->n_blocks - 1]);
        if (rc < 0) {
            kv_seq_release(&e->kv, dst);
            return rc;
        }
    }
#endif
    return MO_OK;
}

int engine_set_adapter(engine_t *e, const lora_adapter_t *ad, int64_t version) {
    if (e->opts.merge_adapter) {
        int rc = rl_weights_merge(&e->w, e->m, ad);
        if (rc < 0) {
            /* back to the adapter that was merged (it merged before) */
            char msg[512];
            snprintf(msg, sizeof msg, "%s", mo_last_error());
            rl_weights_merge(&e->w, e->m, e->adapter);
            return mo_errorf(rc, "%s", msg);
        }
    } else {
        const lora_adapter_t *prev = e->m->adapter;
        int rc = model_set_adapter(e->m, ad);
        if (rc == MO_OK)
            rc = bind_device(e);
        if (rc < 0) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", mo_last_error());
            model_set_adapter(e->m, prev); /* rebinding what was bound succeeds */
            rl_weights_bind(&e->w, e->m);
            bind_device(e);
            return mo_errorf(rc, "%s", msg);
        }
        rl_weights_bind(&e->w, e->m);
        e->bound = ad != NULL;
    }
    e->adapter = ad;
    e->version = version;
    return MO_OK;
}

void engine_get_graph_stats(const engine_t *e, engine_graph_stats_t *s) {
    memset(s, 0, sizeof *s);
#ifdef MOERL_HAVE_CUDA
    if (!e || !e->dev)
        return;
    model_cuda_graph_stats_t g;
    engine_cuda_graph_stats(e, &g);
    s->captured = g.captured;
    s->replayed = g.replayed;
    s->eager = g.eager;
    s->invalidated = g.invalidated;
    snprintf(s->off_reason, sizeof s->off_reason, "%s", g.off_reason);
#else
    (void)e;
#endif
}

engine_stats_t engine_get_stats(const engine_t *e) {
    return e->stats;
}

engine_opts_t engine_get_opts(const engine_t *e) {
    return e->opts;
}

size_t engine_kv_token_bytes(const engine_t *e) {
    return kv_cache_token_bytes(&e->kv);
}

int engine_pending(const engine_t *e) {
    return e->n_pending;
}

/* ------------------------------------------------------------------------ */
/* Groups.                                                                   */

static void push(queue_t *q, eng_group_t *g) {
    g->next = NULL;
    if (q->tail)
        q->tail->next = g;
    else
        q->head = g;
    q->tail = g;
}

static eng_group_t *pop(queue_t *q) {
    eng_group_t *g = q->head;
    if (g) {
        q->head = g->next;
        if (!q->head)
            q->tail = NULL;
        g->next = NULL;
    }
    return g;
}

static void group_destroy(eng_group_t *g, kv_cache_t *kv) {
    if (!g)
        return;
    if (g->s)
        for (int j = 0; j < g->G; j++) {
            kv_seq_release(kv, &g->s[j].kv);
            if (g->s[j].budget > 0)
                kv_cache_unreserve(kv, g->s[j].budget);
        }
    free(g->s);
    free(g->stop_ids);
    for (int i = 0; i < g->n_stops; i++)
        free(g->stops[i]);
    free(g->stops);
    free(g->stop_len);
    free(g);
}

void gen_group_free(gen_group_t **pg) {
    gen_group_t *g = pg ? *pg : NULL;
    if (!g)
        return;
    for (int j = 0; g->samples && j < g->n; j++) {
        free(g->samples[j].tokens);
        free(g->samples[j].logprobs);
        free(g->samples[j].routing);
        free(g->samples[j].text);
    }
    free(g->samples);
    free(g->prompt);
    free(g->prompt_routing);
    free(g->error);
    free(g);
    *pg = NULL;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

/* The group shell and the copies of what the request points to. */
static int group_new(engine_t *e, const gen_request_t *r, eng_group_t **out) {
    *out = NULL;
    eng_group_t *g = calloc(1, sizeof *g);
    gen_group_t *o = calloc(1, sizeof *o);
    if (!g || !o) {
        free(g);
        free(o);
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for a request");
    }
    g->out = o;
    o->id = r->id;
    o->ticket = e->next_ticket++;
    o->M = e->M;
    o->K = e->K;
    g->params = r->params;
    g->P = r->prompt_len > 0 && r->prompt ? r->prompt_len : 0;
    int ok = 1;
    if (g->P > 0) {
        o->prompt = malloc(sizeof(int32_t) * (size_t)g->P);
        ok = o->prompt != NULL;
        if (ok)
            memcpy(o->prompt, r->prompt, sizeof(int32_t) * (size_t)g->P);
        o->prompt_len = g->P;
    }
    *out = g;
    return ok ? MO_OK : mo_errorf(MO_ENOMEM, "rollout: out of memory for a prompt");
}

/* KV blocks a group may need: the prompt's full blocks once, then per sample the rest
 * of prompt + completion (+ the last token read for its routing). */
static int64_t group_blocks(const engine_t *e, const eng_group_t *g, int64_t *shared,
                            int64_t *own) {
    int tail = g->params.record_routing && e->M > 0;
    int max_new = g->s ? g->s[0].max_new : 1;
    int64_t len = (int64_t)g->P + max_new - 1 + tail;
    *shared = e->opts.no_prefix_sharing ? 0 : g->P / e->kv.block_tokens;
    *own = kv_cache_blocks_for(&e->kv, len) - *shared;
    return *shared + (int64_t)g->G * *own;
}

static int validate_tokens(const engine_t *e, const gen_request_t *r) {
    if (r->prompt_len < 1 || !r->prompt)
        return mo_errorf(MO_EINVAL, "empty prompt (%d tokens)", r->prompt_len);
    for (int i = 0; i < r->prompt_len; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->m->V)
            return mo_errorf(MO_EINVAL, "prompt token %d is id %d, outside the vocabulary [0, %d)",
                             i, r->prompt[i], e->m->V);
    if (r->prompt_len >= e->opts.max_seq_len)
        return mo_errorf(MO_EINVAL,
                         "prompt of %d tokens leaves no room for a completion within max_seq_len "
                         "%d",
                         r->prompt_len, e->opts.max_seq_len);
    const gen_params_t *p = &r->params;
    for (int i = 0; i < p->n_stop_ids; i++)
        if (!p->stop_ids || p->stop_ids[i] < 0 || p->stop_ids[i] >= e->m->V)
            return mo_errorf(MO_EINVAL, "stop id %d is %d, outside the vocabulary [0, %d)", i,
                             p->stop_ids ? p->stop_ids[i] : -1, e->m->V);
    return MO_OK;
}

static int validate(const engine_t *e, const gen_request_t *r) {
    TRY(validate_tokens(e, r));
    const gen_params_t *p = &r->params;
    if (r->n < 1 || r->n > e->opts.max_batch)
        return mo_errorf(MO_EINVAL, "n = %d samples, expected 1 .. max_batch (%d)", r->n,
                         e->opts.max_batch);
    if (p->max_new_tokens < 1)
        return mo_errorf(MO_EINVAL, "max_new_tokens %d must be >= 1", p->max_new_tokens);
    TRY(sampling_params_check(&p->sampling));
    if (p->n_stop_strings < 0 || p->n_stop_ids < 0)
        return mo_errorf(MO_EINVAL, "negative count of stop strings or stop ids");
    if (p->n_stop_strings > 0 && !e->opts.tok)
        return mo_errorf(MO_EINVAL, "stop strings need a tokenizer (the engine has none)");
    for (int i = 0; i < p->n_stop_strings; i++)
        if (!p->stop_strings || !p->stop_strings[i] || !p->stop_strings[i][0])
            return mo_errorf(MO_EINVAL, "stop string %d is empty", i);
    return MO_OK;
}

/* The group's stop ids (defaults unless ignore_eos, then the request's) and strings. */
static int copy_stops(engine_t *e, eng_group_t *g) {
    const gen_params_t *p = &g->params;
    int n_def = p->ignore_eos || e->opts.no_default_stops ? 0 : e->n_eos;
    g->stop_ids = malloc(sizeof(int32_t) * (size_t)(n_def + p->n_stop_ids + 1));
    g->stops = calloc((size_t)p->n_stop_strings + 1, sizeof *g->stops);
    g->stop_len = calloc((size_t)p->n_stop_strings + 1, sizeof *g->stop_len);
    if (!g->stop_ids || !g->stops || !g->stop_len)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for stop lists");
    for (int i = 0; i < n_def; i++)
        g->stop_ids[g->n_stop_ids++] = e->eos[i];
    for (int i = 0; i < p->n_stop_ids; i++)
        g->stop_ids[g->n_stop_ids++] = p->stop_ids[i];
    for (int i = 0; i < p->n_stop_strings; i++) {
        if (!(g->stops[i] = dup_str(p->stop_strings[i])))
            return mo_errorf(MO_ENOMEM, "rollout: out of memory for stop strings");
        g->n_stops++;
        g->stop_len[i] = strlen(g->stops[i]);
        if (g->stop_len[i] > g->max_stop_len)
            g->max_stop_len = g->stop_len[i];
    }
    g->params.stop_ids = g->stop_ids;
    g->params.stop_strings = (const char *const *)g->stops;
    return MO_OK;
}

static int make_samples(engine_t *e, eng_group_t *g, int G) {
    g->G = G;
    g->s = calloc((size_t)G, sizeof *g->s);
    g->out->samples = calloc((size_t)G, sizeof *g->out->samples);
    if (!g->s || !g->out->samples)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for %d samples", G);
    g->out->n = G;
    int room = e->opts.max_seq_len - g->P;
    int max_new = g->params.max_new_tokens < room ? g->params.max_new_tokens : room;
    for (int j = 0; j < G; j++) {
        g->s[j].g = g;
        g->s[j].out = &g->out->samples[j];
        g->s[j].out->index = j;
        g->s[j].max_new = max_new;
    }
    return MO_OK;
}

static int check_fits(engine_t *e, eng_group_t *g) {
    int64_t shared, own, need = group_blocks(e, g, &shared, &own);
    if (need > e->kv.n_blocks)
        return mo_errorf(MO_EINVAL,
                         "needs up to %lld KV tokens (prompt %d, %d samples of up to %d tokens), "
                         "the cache holds %lld",
                         (long long)need * e->kv.block_tokens, g->P, g->G, g->s[0].max_new,
                         (long long)e->kv.n_blocks * e->kv.block_tokens);
    return MO_OK;
}

/* Moves a group to the done queue with status rc and the current error message. */
static void group_reject(engine_t *e, eng_group_t *g, int rc) {
    gen_group_t *o = g->out;
    o->status = rc;
    if (!o->error) {
        char buf[512];
        snprintf(buf, sizeof buf, "request %llu: %s", (unsigned long long)o->id, mo_last_error());
        o->error = dup_str(buf);
    }
    push(&e->done, g);
}

int engine_submit(engine_t *e, const gen_request_t *r) {
    eng_group_t *g;
    int rc = group_new(e, r, &g);
    if (rc < 0 && !g)
        return rc;
    e->n_pending++;
    if (rc == MO_OK)
        rc = validate(e, r);
    if (rc == MO_OK)
        rc = copy_stops(e, g);
    if (rc == MO_OK)
        rc = make_samples(e, g, r->n);
    if (rc == MO_OK)
        rc = check_fits(e, g);
    if (rc < 0) {
        /* A rejected group carries no samples. */
        free(g->out->samples);
        g->out->samples = NULL;
        g->out->n = 0;
        free(g->s);
        g->s = NULL;
        group_reject(e, g, rc);
        return rc;
    }
    push(&e->waiting, g);
    return MO_OK;
}

int engine_collect(engine_t *e, gen_group_t **out) {
    *out = NULL;
    eng_group_t *g = pop(&e->done);
    if (!g)
        return 0;
    gen_group_t *o = g->out;
    g->out = NULL;
    group_destroy(g, &e->kv);
    e->n_pending--;
    *out = o;
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Sample bookkeeping.                                                       */

static void sample_finish(engine_t *e, eng_sample_t *s) {
    if (s->state == ST_DONE)
        return;
    kv_seq_release(&e->kv, &s->kv);
    if (s->budget > 0)
        kv_cache_unreserve(&e->kv, s->budget);
    s->budget = 0;
    s->state = ST_DONE;
    e->n_running--;
    eng_group_t *g = s->g;
    if (++g->n_done == g->G) {
        for (int j = 0; j < g->G; j++) {
            gen_sample_t *o = g->s[j].out;
            if (o->text)
                o->text[o->text_len] = '\0';
        }
        push(&e->done, g);
    }
}

/* Fails every unfinished sample of g with rc (message from the current error). */
static void group_fail(engine_t *e, eng_group_t *g, int rc) {
    gen_group_t *o = g->out;
    if (o->status == MO_OK) {
        char buf[512];
        o->status = rc;
        snprintf(buf, sizeof buf, "request %llu: %s", (unsigned long long)o->id, mo_last_error());
        o->error = dup_str(buf);
    }
    for (int j = 0; j < g->G; j++)
        if (g->s[j].state != ST_DONE) {
            g->s[j].out->finish = FINISH_ERROR;
            sample_finish(e, &g->s[j]);
        }
}

static int grow_sample(engine_t *e, eng_sample_t *s, int need) {
    if (need <= s->cap)
        return MO_OK;
    int cap = s->cap ? 2 * s->cap : 16;
    if (cap < need)
        cap = need;
    if (cap > s->max_new)
        cap = s->max_new;
    gen_sample_t *o = s->out;
    int32_t *t = realloc(o->tokens, sizeof *t * (size_t)cap);
    if (t)
        o->tokens = t;
    float *lp = realloc(o->logprobs, sizeof *lp * (size_t)cap);
    if (lp)
        o->logprobs = lp;
    int ok = t && lp;
    if (ok && s->g->params.record_routing && e->M > 0) {
        uint16_t *r = realloc(o->routing, sizeof *r * (size_t)cap * e->M * e->K);
        if (r)
            o->routing = r;
        ok = r != NULL;
    }
    if (!ok)
        return mo_errorf(MO_ENOMEM, "rollout: out of memory for %d tokens", cap);
    s->cap = cap;
    return MO_OK;
}

/* Appends bytes to the sample's text. */
static int text_append(eng_sample_t *s, const char *b, size_t n) {
    gen_sample_t *o = s->out;
    if (o->text_len + n + 1 > s->text_cap) {
        size_t cap = s->text_cap ? 2 * s->text_cap : 64;
        while (cap < o->text_len + n + 1)
            cap *= 2;
        char *t = realloc(o->text, cap);
        if (!t)
            return mo_errorf(MO_ENOMEM, "rollout: out of memory for text");
        o->text = t;
        s->text_cap = cap;
    }
    memcpy(o->text + o->text_len, b, n);
    o->text_len += n;
    return MO_OK;
}

/* The first match of a stop string that ends in the last `added` bytes of text:
 * returns 1 with its offset and length. Earliest offset wins, then the list order. */
static int find_stop(const eng_group_t *g, const char *text, size_t len, size_t added, size_t *at,
                     size_t *slen) {
    size_t from = len - added;
    from = from + 1 > g->max_stop_len ? from + 1 - g->max_stop_len : 0;
    int found = 0;
    for (int i = 0; i < g->n_stops; i++) {
        size_t L = g->stop_len[i];
        for (size_t o = from; o + L <= len && (!found || o < *at); o++)
            if (!memcmp(text + o, g->stops[i], L)) {
                *at = o;
                *slen = L;
                found = 1;
                break;
            }
    }
    return found;
}

static int is_stop_id(const eng_group_t *g, int32_t t) {
    for (int i = 0; i < g->n_stop_ids; i++)
        if (g->stop_ids[i] == t)
            return 1;
    return 0;
}

/* The text and stop-string part of a new token; *fin may become FINISH_STOP_STRING. */
static int token_text(engine_t *e, eng_sample_t *s, int32_t tok, finish_reason_t *fin) {
    const char *b = "";
    size_t n = 0;
    if (tokenizer_token_bytes(e->opts.tok, tok, &b, &n) < 0) {
        b = ""; /* an id past the tokenizer's vocabulary (padded embedding): no text */
        n = 0;
    }
    TRY(text_append(s, b, n));
    size_t at = 0, slen = 0;
    gen_sample_t *o = s->out;
    if (s->g->n_stops > 0 && find_stop(s->g, o->text, o->text_len, n, &at, &slen)) {
        o->text_len = at + (s->g->params.include_stop_string ? slen : 0);
        *fin = FINISH_STOP_STRING;
    }
    return MO_OK;
}

/* Records a sampled token and applies the stop conditions. */
static int sample_push(engine_t *e, eng_sample_t *s, int32_t tok, float lp) {
    gen_sample_t *o = s->out;
    TRY(grow_sample(e, s, o->n_tokens + 1));
    o->tokens[o->n_tokens] = tok;
    o->logprobs[o->n_tokens] = lp;
    if (o->n_tokens == 0)
        o->version_first = e->version;
    o->version_last = e->version;
    o->n_tokens++;
    e->stats.generated++;
    finish_reason_t fin = FINISH_NONE;
    if (is_stop_id(s->g, tok)) {
        fin = FINISH_STOP_TOKEN;
        if (e->opts.tok && !o->text)
            TRY(text_append(s, "", 0)); /* an empty text, not none */
    } else if (e->opts.tok) {
        TRY(token_text(e, s, tok, &fin));
    }
    if (fin == FINISH_NONE && o->n_tokens >= s->max_new)
        fin = FINISH_LENGTH;
    if (fin == FINISH_NONE)
        return MO_OK;
    o->finish = fin;
    if (s->g->params.record_routing && e->M > 0)
        s->state = ST_TAIL; /* read the last token once more for its routing */
    else
        sample_finish(e, s);
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Steps.                                                                    */

static void admit(engine_t *e) {
    while (e->waiting.head) {
        eng_group_t *g = e->waiting.head;
        int64_t shared, own, need = group_blocks(e, g, &shared, &own);
        if (e->n_running + g->G > e->opts.max_batch || kv_cache_reserve(&e->kv, need) != 1) {
            e->stats.waited++;
            return;
        }
        pop(&e->waiting);
        for (int j = 0; j < g->G; j++)
            g->s[j].budget = own + (j == 0 ? shared : 0);
        e->n_running += g->G;
        push(&e->prefill, g);
    }
}

static int add_active(engine_t *e, eng_sample_t *s) {
    if (e->n_active == e->cap_active) {
        int cap = e->cap_active ? 2 * e->cap_active : 64;
        eng_sample_t **a = realloc(e->active, sizeof *a * (size_t)cap);
        if (!a)
            return mo_errorf(MO_ENOMEM, "rollout: out of memory for the batch");
        e->active = a;
        e->cap_active = cap;
    }
    e->active[e->n_active++] = s;
    s->state = ST_RUN;
    return MO_OK;
}

/* Records the draws of n_jobs samples (token, logprob, sampler status); a failed draw
 * fails its group. Samples already done (a failed group) are skipped. */
static void apply_draws(engine_t *e, eng_sample_t *const *smp, int n_jobs, const int32_t *tok,
                        const float *lp, const int *rc) {
    for (int j = 0; j < n_jobs; j++) {
        eng_sample_t *s = smp[j];
        if (s->state == ST_DONE)
            continue;
        int r = rc[j] < 0 ? mo_errorf(rc[j], "sampling failed (non-finite logits)") : MO_OK;
        if (r == MO_OK)
            r = sample_push(e, s, tok[j], lp[j]);
        if (r < 0)
            group_fail(e, s->g, r);
    }
}

/* Draws the next token of n_jobs samples: job i reads row rows[i] (ascending) of the
 * final hidden states xs (R, D). Logits are formed a chunk of rows at a time. */
static int sample_rows(engine_t *e, const float *xs, const int *rows, eng_sample_t **smp,
                       int n_jobs) {
    const model_t *m = e->m;
    model_t mk; /* the model on the engine's kernels */
    rl_weights_model(&e->w, m, &mk);
    int V = m->V, D = m->D;
    int chunk = (1 << 22) / V > 0 ? (1 << 22) / V : 1;
    int32_t *tok;
    float *lp;
    int *rc;
    ALLOC(tok, &e->step_ar, n_jobs);
    ALLOC(lp, &e->step_ar, n_jobs);
    ALLOC(rc, &e->step_ar, n_jobs);
    int R = n_jobs ? rows[n_jobs - 1] + 1 : 0;
    float *logits, *normed, *rstd;
    ALLOC(logits, &e->step_ar, (size_t)(chunk < R ? chunk : R) * V);
    ALLOC(normed, &e->step_ar, (size_t)(chunk < R ? chunk : R) * D);
    ALLOC(rstd, &e->step_ar, chunk < R ? chunk : R);
    int j0 = 0;
    for (int r0 = 0; r0 < R; r0 += chunk) {
        int nr = R - r0 < chunk ? R - r0 : chunk;
        model_logits(&mk, logits, normed, rstd, xs + (size_t)r0 * D, nr);
        int j1 = j0;
        while (j1 < n_jobs && rows[j1] < r0 + nr)
            j1++;
#pragma omp parallel for schedule(dynamic, 1) num_threads(e->n_threads) if (j1 - j0 > 1)
        for (int j = j0; j < j1; j++) {
            const eng_sample_t *s = smp[j];
            const gen_params_t *p = &s->g->params;
            double u = sampler_uniform(p->seed, s->g->out->id, (uint64_t)s->out->index,
                                       (uint64_t)s->out->n_tokens);
            rc[j] = sampler_sample(&e->samplers[omp_get_thread_num()],
                                   logits + (size_t)(rows[j] - r0) * V, &p->sampling, u, &tok[j],
                                   &lp[j]);
        }
        j0 = j1;
    }
    apply_draws(e, smp, n_jobs, tok, lp, rc);
    return MO_OK;
}

/* Prompt copies a group prefills: 1 (shared by its samples) or G. */
static int prefill_copies(const engine_t *e, const eng_group_t *g) {
    return e->opts.no_prefix_sharing ? g->G : 1;
}

/* Pops the admitted groups that fit max_prefill_tokens (at least one). */
static int prefill_groups(engine_t *e, eng_group_t ***out, int *B_out, int *S_out, int *N_out) {
    int B = 0, S = 0, N = 0;
    for (eng_group_t *g = e->prefill.head; g; g = g->next) {
        int rows = g->P * prefill_copies(e, g);
        if (B > 0 && N + rows > e->opts.max_prefill_tokens)
            break;
        B++;
        S += prefill_copies(e, g);
        N += rows;
    }
    eng_group_t **gs;
    ALLOC(gs, &e->step_ar, B);
    for (int b = 0; b < B; b++)
        gs[b] = pop(&e->prefill);
    *out = gs;
    *B_out = B;
    *S_out = S;
    *N_out = N;
    return MO_OK;
}

/* The draws a prefill makes: job j draws the first token of sample smp[j] from the last
 * row of prompt copy seq[j] (seq ascending). */
static int prefill_jobs(engine_t *e, eng_group_t **gs, int B, int **seq_out,
                        eng_sample_t ***smp_out, int *n_out) {
    int total = 0, n = 0;
    for (int b = 0; b < B; b++)
        total += gs[b]->G;
    int *seq;
    eng_sample_t **smp;
    ALLOC(seq, &e->step_ar, total);
    ALLOC(smp, &e->step_ar, total);
    for (int i = 0, b = 0; b < B; b++) {
        eng_group_t *g = gs[b];
        int copies = prefill_copies(e, g);
        for (int j = 0; j < g->G; j++) {
            seq[n] = i + (copies > 1 ? j : 0);
            smp[n++] = &g->s[j];
        }
        i += copies;
    }
    *seq_out = seq;
    *smp_out = smp;
    *n_out = n;
    return MO_OK;
}

/* After the prompts' forward (sequence i is rows cu[i] .. cu[i+1]-1): each group's prompt
 * routing, its samples' forks of the prompt, and their start. A group that fails here is
 * finished with its error (its draws are then skipped). */
static void prefill_start(engine_t *e, eng_group_t **gs, int B, const int32_t *cu,
                          const uint16_t *routing) {
    size_t MK = (size_t)e->M * e->K;
    for (int i = 0, b = 0; b < B; b++) {
        eng_group_t *g = gs[b];
        int copies = prefill_copies(e, g), first = i, rc = MO_OK;
        i += copies;
        if (routing && g->params.record_prompt_routing) {
            g->out->prompt_routing = malloc(sizeof(uint16_t) * (size_t)g->P * MK);
            if (g->out->prompt_routing)
                memcpy(g->out->prompt_routing, routing + (size_t)cu[first] * MK,
                       sizeof(uint16_t) * (size_t)g->P * MK);
            else
                rc = mo_errorf(MO_ENOMEM, "rollout: out of memory for prompt routing");
        }
        for (int j = copies; rc == MO_OK && j < g->G; j++)
            rc = fork_seq(e, &g->s[j].kv, &g->s[0].kv, &g->s[j].budget);
        for (int j = 0; rc == MO_OK && j < g->G; j++)
            rc = add_active(e, &g->s[j]);
        if (rc < 0)
            group_fail(e, g, rc);
    }
}

/* The CPU prefill's end: the groups start, then their first tokens are drawn from the
 * last rows of the forward's hidden states x (N, D). */
static int prefill_finish(engine_t *e, eng_group_t **gs, int B, int S, const int32_t *cu,
                          const float *x, const uint16_t *routing) {
    int D = e->m->D, n_jobs = 0, *seq = NULL;
    eng_sample_t **smp = NULL;
    float *xl; /* (S, D) the last row of each sequence */
    ALLOC(xl, &e->step_ar, (size_t)S * D);
    for (int i = 0; i < S; i++)
        memcpy(xl + (size_t)i * D, x + (size_t)(cu[i + 1] - 1) * D, sizeof(float) * D);
    TRY(prefill_jobs(e, gs, B, &seq, &smp, &n_jobs));
    prefill_start(e, gs, B, cu, routing);
    return sample_rows(e, xl, seq, smp, n_jobs);
}

#ifdef MOERL_HAVE_CUDA
/* The device prefill: the forward and the first draws in one call, then the groups start
 * (their forks copy the partial block after the prefill's stores, in stream order). */
static int prefill_device(engine_t *e, eng_group_t **gs, int B, int N, int S,
                          const int32_t *tokens, const int32_t *cu, kv_seq_t *const *seqs,
                          uint16_t *routing) {
    int n_jobs = 0, *seq = NULL, *rc;
    eng_sample_t **smp = NULL;
    int32_t *tok;
    float *lp;
    TRY(prefill_jobs(e, gs, B, &seq, &smp, &n_jobs));
    ALLOC(tok, &e->step_ar, n_jobs);
    ALLOC(lp, &e->step_ar, n_jobs);
    ALLOC(rc, &e->step_ar, n_jobs);
    TRY(engine_cuda_prefill(e, N, S, tokens, cu, seqs, routing, n_jobs, seq, smp, tok, lp, rc));
    prefill_start(e, gs, B, cu, routing);
    apply_draws(e, smp, n_jobs, tok, lp, rc);
    return MO_OK;
}
#endif

/* The rows of the prompts: tokens, positions, sequences and cu (S + 1); each
 * prefilled sequence grows to its prompt. */
static int prefill_rows(engine_t *e, eng_group_t **gs, int B, int32_t *tokens, int32_t *pos,
                        kv_seq_t **seqs, int32_t *cu) {
    int i = 0;
    cu[0] = 0;
    for (int b = 0; b < B; b++) {
        eng_group_t *g = gs[b];
        for (int j = 0; j < prefill_copies(e, g); j++, i++) {
            eng_sample_t *s = &g->s[j];
            cu[i + 1] = cu[i] + g->P;
            for (int t = 0; t < g->P; t++) {
                tokens[cu[i] + t] = g->out->prompt[t];
                pos[cu[i] + t] = t;
                seqs[cu[i] + t] = &s->kv;
            }
            TRY(kv_seq_grow(&e->kv, &s->kv, g->P, &s->budget));
        }
    }
    return MO_OK;
}

/* The prompts' forward and first draws, on the CPU or the device. */
static int prefill_run(engine_t *e, eng_group_t **gs, int B, int N, int S, int32_t *tokens,
                       int32_t *pos, kv_seq_t **seqs, int32_t *cu, uint16_t *routing) {
#ifdef MOERL_HAVE_CUDA
    if (e->dev)
        return prefill_device(e, gs, B, N, S, tokens, cu, seqs, routing);
#endif
    float *x;
    ALLOC(x, &e->step_ar, (size_t)N * e->m->D);
    decode_batch_t db = {N, tokens, pos, seqs, 1, S, cu, routing};
    TRY(decode_forward(e->m, &e->w, &e->kv, &e->layer_ar, &db, x));
    return prefill_finish(e, gs, B, S, cu, x, routing);
}

static int prefill_step(engine_t *e) {
    eng_group_t **gs = NULL;
    int B = 0, S = 0, N = 0, rc, want_routing = 0;
    arena_reset(&e->step_ar);
    TRY(prefill_groups(e, &gs, &B, &S, &N));
    int32_t *tokens, *pos, *cu;
    kv_seq_t **seqs;
    uint16_t *routing = NULL;
    ALLOC(tokens, &e->step_ar, N);
    ALLOC(pos, &e->step_ar, N);
    ALLOC(seqs, &e->step_ar, N);
    ALLOC(cu, &e->step_ar, S + 1);
    for (int b = 0; b < B; b++)
        want_routing |= gs[b]->params.record_prompt_routing;
    rc = prefill_rows(e, gs, B, tokens, pos, seqs, cu);
    if (rc == MO_OK && want_routing && e->M > 0) {
        routing = arena_alloc(&e->step_ar, sizeof(uint16_t) * (size_t)N * e->M * e->K);
        if (!routing)
            rc = mo_error_wrap(MO_ENOMEM, "rollout step");
    }
    if (rc == MO_OK)
        rc = prefill_run(e, gs, B, N, S, tokens, pos, seqs, cu, routing);
    if (rc == MO_OK) {
        e->stats.steps_prefill++;
        e->stats.prefill_tokens += N;
    }
    if (rc < 0)
        for (int b = 0; b < B; b++)
            group_fail(e, gs[b], rc);
    return rc < 0 ? rc : 1;
}

static int decode_rows(engine_t *e, int N, int32_t *tokens, int32_t *pos, kv_seq_t **seqs) {
    for (int i = 0; i < N; i++) {
        eng_sample_t *s = e->active[i];
        const gen_sample_t *o = s->out;
        tokens[i] = o->tokens[o->n_tokens - 1];
        pos[i] = s->g->P + o->n_tokens - 1;
        seqs[i] = &s->kv;
        MO_ASSERT(s->kv.len == pos[i]);
        TRY(kv_seq_grow(&e->kv, &s->kv, pos[i] + 1, &s->budget));
    }
    return MO_OK;
}

/* After a decode forward: each row's routing, the end of samples that were read once more
 * for it (ST_TAIL), and the rows that draw (rows, smp: n_jobs of them). */
static int decode_finish(engine_t *e, const uint16_t *routing, int *rows, eng_sample_t **smp) {
    size_t MK = (size_t)e->M * e->K;
    int n_jobs = 0;
    for (int i = 0; i < e->n_active; i++) {
        eng_sample_t *s = e->active[i];
        gen_sample_t *o = s->out;
        if (o->routing)
            memcpy(o->routing + (size_t)(o->n_tokens - 1) * MK, routing + (size_t)i * MK,
                   sizeof(uint16_t) * MK);
        if (s->state == ST_TAIL) {
            sample_finish(e, s);
        } else {
            /* Rows of ST_RUN samples; a sample that fails keeps its group's error. */
            rows[n_jobs] = i;
            smp[n_jobs++] = s;
        }
    }
    return n_jobs;
}

/* The decode forward and draws on the CPU: hidden states, then sample_rows. */
static int decode_cpu(engine_t *e, int N, int32_t *tokens, int32_t *pos, kv_seq_t **seqs,
                      uint16_t *routing, int *rows, eng_sample_t **smp) {
    float *x;
    ALLOC(x, &e->step_ar, (size_t)N * e->m->D);
    decode_batch_t db = {N, tokens, pos, seqs, 0, 0, NULL, routing};
    TRY(decode_forward(e->m, &e->w, &e->kv, &e->layer_ar, &db, x));
    int n_jobs = decode_finish(e, routing, rows, smp);
    return sample_rows(e, x, rows, smp, n_jobs);
}

#ifdef MOERL_HAVE_CUDA
/* The decode step on the device: every row draws there (a tail row's draw is dropped). */
static int decode_device(engine_t *e, int N, int32_t *tokens, int32_t *pos, kv_seq_t **seqs,
                         uint16_t *routing, int *rows, eng_sample_t **smp) {
    int32_t *tok;
    float *lp;
    int *rc;
    ALLOC(tok, &e->step_ar, N);
    ALLOC(lp, &e->step_ar, N);
    ALLOC(rc, &e->step_ar, N);
    TRY(engine_cuda_decode(e, N, tokens, pos, seqs, routing, tok, lp, rc));
    int n_jobs = decode_finish(e, routing, rows, smp);
    for (int j = 0; j < n_jobs; j++) { /* rows ascend: compact the draws in place */
        tok[j] = tok[rows[j]];
        lp[j] = lp[rows[j]];
        rc[j] = rc[rows[j]];
    }
    apply_draws(e, smp, n_jobs, tok, lp, rc);
    return MO_OK;
}
#endif

static int decode_step(engine_t *e) {
    int N = e->n_active, rc;
    arena_reset(&e->step_ar);
    int32_t *tokens, *pos;
    int *rows;
    kv_seq_t **seqs;
    eng_sample_t **smp;
    uint16_t *routing = NULL;
    ALLOC(tokens, &e->step_ar, N);
    ALLOC(pos, &e->step_ar, N);
    ALLOC(seqs, &e->step_ar, N);
    ALLOC(rows, &e->step_ar, N);
    ALLOC(smp, &e->step_ar, N);
    if (e->M > 0)
        ALLOC(routing, &e->step_ar, (size_t)N * e->M * e->K);
    rc = decode_rows(e, N, tokens, pos, seqs);
#ifdef MOERL_HAVE_CUDA
    if (rc == MO_OK && e->dev)
        rc = decode_device(e, N, tokens, pos, seqs, routing, rows, smp);
    else
#endif
        if (rc == MO_OK)
        rc = decode_cpu(e, N, tokens, pos, seqs, routing, rows, smp);
    if (rc < 0) {
        for (int i = 0; i < N; i++)
            if (e->active[i]->g->n_done < e->active[i]->g->G)
                group_fail(e, e->active[i]->g, rc);
        return rc;
    }
    e->stats.steps_decode++;
    e->stats.decode_rows += N;
    return 1;
}

/* Drops finished samples from the active list (keeping the order). */
static void compact(engine_t *e) {
    int w = 0;
    for (int i = 0; i < e->n_active; i++)
        if (e->active[i]->state != ST_DONE)
            e->active[w++] = e->active[i];
    e->n_active = w;
}

int engine_step(engine_t *e) {
    admit(e);
    int rc = 0;
    if (e->prefill.head)
        rc = prefill_step(e);
    else if (e->n_active > 0)
        rc = decode_step(e);
    if (rc != 0) {
        int64_t used = kv_cache_used_tokens(&e->kv);
        if (used > e->stats.kv_peak_tokens)
            e->stats.kv_peak_tokens = used;
        rc = rc < 0 ? rc : 1;
    }
    compact(e);
    return rc;
}

int engine_generate(engine_t *e, const gen_request_t *reqs, int n, gen_group_t **out) {
    if (e->n_pending > 0)
        return mo_errorf(MO_ESTATE,
                         "rollout: generate needs an idle engine (%d requests are "
                         "pending)",
                         e->n_pending);
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    uint64_t first = e->next_ticket;
    int first_err = MO_OK, collected = 0, expected = 0;
    for (int i = 0; i < n; i++) {
        uint64_t before = e->next_ticket;
        int rc = engine_submit(e, &reqs[i]);
        if (e->next_ticket == before) { /* not even queued: out of memory */
            first_err = first_err < 0 ? first_err : rc;
            e->next_ticket++; /* keep request i at ticket first + i */
        } else {
            expected++;
        }
    }
    while (collected < expected) {
        int rc = engine_step(e);
        if (rc < 0 && first_err == MO_OK)
            first_err = rc;
        gen_group_t *g;
        int got = 0;
        while (engine_collect(e, &g) == 1) {
            out[g->ticket - first] = g;
            collected++;
            got = 1;
        }
        if (rc == 0 && !got && collected < expected)
            return mo_errorf(MO_ESTATE, "rollout: engine idle with %d requests unfinished",
                             expected - collected);
    }
    return first_err;
}
