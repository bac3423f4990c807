/* sft: supervised training on prompt/response pairs, and the merge of a full-model
 * adapter into a new base checkpoint. */
#include "learner/sft.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/backend.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "learner/actor_exec.h"
#include "learner/tasks.h"
#include "learner/trainer.h"
#include "lora/peft.h"

#define SFT_PATH_CAP 4096

sft_opts_t sft_opts_default(void) {
    sft_opts_t o;
    memset(&o, 0, sizeof o);
    o.steps = 1000;
    o.warmup = -1;
    return o;
}

/* ---- Construction ---------------------------------------------------------- */

static int make_adapter(sft_t *s) {
    const moerl_config_t *c = s->cfg;
    lora_config_t lc;
    memset(&lc, 0, sizeof lc);
    lc.seed = trainer_lora_seed(c);
    static const char *const all[] = {"all-linear"};
    if (s->o.full) {
        lc.rank = s->o.rank > 0 ? s->o.rank : s->m->D;
        lc.alpha = (float)lc.rank;
        lc.targets = all;
        lc.n_targets = 1;
    } else {
        lc.rank = s->o.rank > 0 ? s->o.rank : c->lora.rank;
        lc.alpha = (float)c->lora.alpha;
        lc.rslora = c->lora.rslora;
        lc.targets = (const char *const *)c->lora.targets.items;
        lc.n_targets = c->lora.targets.n;
    }
    TRY(lora_adapter_new(&s->ad, &lc, s->m->modules, s->m->n_modules));
    if (c->lora.train_router || c->lora.train_norms)
        TRY(model_adapter_add_full(s->m, s->ad, c->lora.train_router, c->lora.train_norms));
    return MO_OK;
}

static int make_optim(sft_t *s) {
    optim_hp_t hp = optim_hp_from_config(&s->cfg->learner);
    hp.lr = s->o.lr > 0 ? s->o.lr : s->o.full ? 2e-3 : s->cfg->learner.lr;
    hp.schedule = CFG_LR_COSINE;
    hp.total_steps = s->o.steps;
    hp.warmup_steps = s->o.warmup >= 0 ? s->o.warmup : s->o.steps / 20;
    hp.min_lr_ratio = 0.1;
    hp.weight_decay = 0.0;
    if (hp.grad_clip <= 0)
        hp.grad_clip = 1.0;
    TRY(optim_init(&s->opt, s->ad->n_params, &hp, NULL));
    return trainer_no_decay(&s->opt, s->ad);
}

static int make_eval_reward(sft_t *s) {
    const char *v = dataset_verifier(s->d);
    if (v)
        return reward_fn_parse(v, &s->fn);
    return reward_fn_from_config(s->cfg->reward.function, s->cfg->reward.plugin, &s->fn);
}

int sft_new(sft_t **out, const moerl_config_t *cfg, const sft_opts_t *opts) {
    *out = NULL;
    sft_opts_t o = opts ? *opts : sft_opts_default();
    if (o.steps < 1 || o.batch < 0 || o.rank < 0 || o.lr < 0 || !(o.logit_scale >= 0))
        return mo_errorf(MO_EINVAL,
                         "sft: steps %lld must be >= 1; batch %d, rank %d, lr %g and "
                         "logit_scale %g must be >= 0",
                         (long long)o.steps, o.batch, o.rank, o.lr, (double)o.logit_scale);
    if (o.batch == 0)
        o.batch = 32;
    if (o.logit_scale == 0)
        o.logit_scale = 16.0f;
    sft_t *s = calloc(1, sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "sft: out of memory");
    s->cfg = cfg;
    s->o = o;
    s->temperature = o.full ? 1.0f / o.logit_scale : 1.0f;
    s->use_task = cfg->data.task != CFG_TASK_JSONL;
    arena_init(&s->ar, 0);
    model_opts_t mo = {.recompute = cfg->model.recompute};
    int rc = model_open(&s->m, cfg->model.path, &mo);
    if (rc == MO_OK)
        rc = tokenizer_load(cfg->model.path, &s->tok);
    if (rc == MO_OK) {
        s->eos = tokenizer_eos_id(s->tok);
        if (s->eos < 0 && s->m->cfg.n_eos > 0)
            s->eos = s->m->cfg.eos_token_id[0];
        if (s->eos < 0)
            rc = mo_errorf(MO_ECONFIG, "sft: the model at %s has no end-of-sequence token",
                           cfg->model.path);
    }
    if (rc == MO_OK)
        rc = dataset_open_config(cfg, &s->d);
    if (rc == MO_OK)
        rc = make_eval_reward(s);
    if (rc == MO_OK)
        rc = make_adapter(s);
    if (rc == MO_OK)
        rc = make_optim(s);
    if (rc == MO_OK && cfg->run.device == DEV_CUDA) /* the upload copies the bound adapter */
        rc = model_set_adapter(s->m, s->ad);
    if (rc == MO_OK)
        rc = actor_exec_new(&s->exec, s->m, cfg->run.device);
    if (rc < 0) {
        sft_destroy(&s);
        return rc;
    }
    *out = s;
    return MO_OK;
}

void sft_destroy(sft_t **sp) {
    if (!sp || !*sp)
        return;
    sft_t *s = *sp;
    actor_exec_destroy(&s->exec);
    if (s->m)
        model_set_adapter(s->m, NULL);
    model_destroy(&s->m);
    tokenizer_destroy(&s->tok);
    lora_adapter_destroy(&s->ad);
    optim_free(&s->opt);
    dataset_destroy(&s->d);
    reward_fn_destroy(&s->fn);
    arena_free(&s->ar);
    free(s);
    *sp = NULL;
}

/* ---- Batches ---------------------------------------------------------------- */

int sft_encode_pair(const sft_t *s, const char *prompt, const char *response, int32_t **ids, int *n,
                    int *prompt_len) {
    *ids = NULL;
    int32_t *p = NULL, *r = NULL;
    int np = 0;
    size_t nr = 0;
    TRY(eval_encode_prompt(s->tok, s->cfg->rollout.prompt_template, prompt, &p, &np));
    int rc = tokenizer_encode(s->tok, response, strlen(response), false, &r, &nr);
    int32_t *all = rc == MO_OK ? malloc(sizeof *all * ((size_t)np + nr + 1)) : NULL;
    if (rc == MO_OK && !all)
        rc = mo_errorf(MO_ENOMEM, "sft: out of memory");
    if (rc == MO_OK) {
        memcpy(all, p, sizeof *all * (size_t)np);
        if (nr)
            memcpy(all + np, r, sizeof *all * nr);
        all[np + (int)nr] = s->eos;
        *ids = all;
        *n = np + (int)nr + 1;
        *prompt_len = np;
    }
    free(p);
    free(r);
    return rc;
}

double sft_loss_grad(float *dlogp, const float *logp, const uint8_t *mask, int T, double n_total) {
    double loss = 0, w = n_total > 0 ? 1.0 / n_total : 0.0;
    for (int t = 0; t < T; t++) {
        dlogp[t] = mask[t] ? (float)-w : 0.0f;
        if (mask[t])
            loss -= (double)logp[t] * w;
    }
    return loss;
}

/* The next training pair, copied into the arena. */
static int next_pair(sft_t *s, sft_pair_t *p) {
    char prompt[TASK_PROMPT_CAP], answer[TASK_ANSWER_CAP];
    const char *pr, *re;
    if (s->use_task) {
        task_opts_t t;
        TRY(task_opts_from_config(s->cfg, &t));
        TRY(task_sft_pair(&t, (uint64_t)s->cfg->run.seed, s->next++, prompt, sizeof prompt, answer,
                          sizeof answer));
        pr = prompt;
        re = answer;
    } else {
        dataset_item_t it;
        TRY(dataset_next(s->d, &it));
        pr = it.prompt;
        re = it.answer;
        for (size_t k = 0; k < it.n_extra; k++)
            if (!strcmp(it.extra[k].key, "response"))
                re = it.extra[k].value;
        if (!re[0])
            return mo_errorf(MO_EMALFORMED,
                             "sft: record %llu (line %llu) has no response or "
                             "answer",
                             (unsigned long long)it.id, (unsigned long long)it.line);
    }
    size_t a = strlen(pr) + 1, b = strlen(re) + 1;
    char *buf = arena_alloc(&s->ar, a + b);
    if (!buf)
        return mo_error_wrap(MO_ENOMEM, "sft pair");
    memcpy(buf, pr, a);
    memcpy(buf + a, re, b);
    p->prompt = buf;
    p->response = buf + a;
    return MO_OK;
}

/* The encoded batch: sequences back to back. */
typedef struct sft_batch {
    int S;
    int32_t *off;    /* (S + 1) */
    int32_t *tokens; /* (T) */
    uint8_t *mask;   /* (T) 1 where the next token is a response token */
    int64_t n_resp;
} sft_batch_t;

static int encode_batch(sft_t *s, const sft_pair_t *pairs, int n, sft_batch_t *b,
                        sft_step_result_t *r) {
    int32_t **ids = arena_alloc(&s->ar, sizeof *ids * (size_t)n);
    int *len = arena_alloc(&s->ar, sizeof *len * (size_t)n);
    int *pl = arena_alloc(&s->ar, sizeof *pl * (size_t)n);
    b->off = arena_alloc(&s->ar, sizeof *b->off * (size_t)(n + 1));
    if (!ids || !len || !pl || !b->off)
        return mo_error_wrap(MO_ENOMEM, "sft batch");
    int64_t T = 0;
    int rc = MO_OK, k = 0, max_len = s->cfg->model.max_seq_len;
    for (int i = 0; i < n && rc == MO_OK; i++) {
        rc = sft_encode_pair(s, pairs[i].prompt, pairs[i].response, &ids[k], &len[k], &pl[k]);
        if (rc == MO_OK && len[k] > max_len) {
            free(ids[k]);
            r->skipped_long++;
            continue;
        }
        if (rc == MO_OK)
            T += len[k++];
    }
    b->S = k;
    b->tokens = rc == MO_OK ? arena_alloc(&s->ar, sizeof *b->tokens * (size_t)(T + 1)) : NULL;
    b->mask = rc == MO_OK ? arena_alloc(&s->ar, (size_t)T + 1) : NULL;
    if (rc == MO_OK && (!b->tokens || !b->mask))
        rc = mo_error_wrap(MO_ENOMEM, "sft batch");
    b->off[0] = 0;
    b->n_resp = 0;
    for (int i = 0; i < k; i++) {
        if (rc == MO_OK) {
            int32_t o = b->off[i];
            memcpy(b->tokens + o, ids[i], sizeof(int32_t) * (size_t)len[i]);
            for (int t = 0; t < len[i]; t++)
                b->mask[o + t] = t >= pl[i] - 1 && t < len[i] - 1;
            b->n_resp += len[i] - pl[i];
            b->off[i + 1] = o + len[i];
        }
        free(ids[i]);
    }
    return rc;
}

/* Forward, loss and backward of sequences [i0, i1) of the batch. */
static int run_micro(sft_t *s, const sft_batch_t *b, int i0, int i1, double *loss) {
    int32_t base = b->off[i0], T = b->off[i1] - base, B = i1 - i0;
    int32_t *cu = arena_alloc(&s->ar, sizeof *cu * (size_t)(B + 1));
    int32_t *pos = arena_alloc(&s->ar, sizeof *pos * (size_t)T);
    int32_t *tgt = arena_alloc(&s->ar, sizeof *tgt * (size_t)T);
    float *lp = arena_floats(&s->ar, (size_t)T), *dl = arena_floats(&s->ar, (size_t)T);
    if (!cu || !pos || !tgt || !lp || !dl)
        return mo_error_wrap(MO_ENOMEM, "sft micro-batch");
    for (int i = 0; i <= B; i++)
        cu[i] = b->off[i0 + i] - base;
    model_batch_next_token(pos, tgt, b->tokens + base, cu, B);
    model_batch_t mb = {T, B, b->tokens + base, pos, cu, tgt, s->temperature, NULL, NULL};
    TRY(actor_exec_forward(s->exec, &mb, lp, NULL, 1));
    *loss += sft_loss_grad(dl, lp, b->mask + base, T, (double)b->n_resp);
    return actor_exec_backward(s->exec, dl, NULL);
}

int sft_step(sft_t *s, const sft_pair_t *pairs, int n, sft_step_result_t *r) {
    sft_step_result_t local, *res = r ? r : &local;
    memset(res, 0, sizeof *res);
    arena_reset(&s->ar);
    if (!pairs) {
        n = s->o.batch;
        sft_pair_t *p = arena_alloc(&s->ar, sizeof *p * (size_t)n);
        if (!p)
            return mo_error_wrap(MO_ENOMEM, "sft pairs");
        for (int i = 0; i < n; i++)
            TRY(next_pair(s, &p[i]));
        pairs = p;
    }
    sft_batch_t b;
    TRY(encode_batch(s, pairs, n, &b, res));
    res->pairs = b.S;
    res->tokens = b.n_resp;
    if (b.S == 0)
        return MO_OK;
    TRY(model_set_adapter(s->m, s->ad));
    TRY(actor_exec_sync(s->exec));
    lora_adapter_zero_grads(s->ad);
    int64_t cap = s->cfg->learner.micro_batch_tokens;
    double loss = 0;
    for (int i0 = 0; i0 < b.S;) {
        int i1 = i0 + 1;
        while (i1 < b.S && b.off[i1 + 1] - b.off[i0] <= cap)
            i1++;
        TRY(run_micro(s, &b, i0, i1, &loss));
        i0 = i1;
    }
    optim_result_t or ;
    TRY(optim_step(&s->opt, s->ad->params, s->ad->grads, loss, NULL, & or));
    TRY(actor_exec_sync(s->exec));
    res->loss = loss;
    res->grad_norm = or.grad_norm;
    res->lr = or.lr;
    res->applied = or.outcome == OPTIM_APPLIED;
    s->step++;
    return MO_OK;
}

int sft_eval(sft_t *s, const eval_opts_t *opts, eval_result_t *r) {
    eval_opts_t o;
    if (opts) {
        o = *opts;
    } else {
        eval_opts_from_config(&o, s->cfg);
        o.n = s->o.eval_n;
    }
    return eval_greedy(s->m, s->ad, s->tok, s->d, s->fn, &o, r);
}

int sft_save(sft_t *s, const char *dir) {
    if (s->o.full)
        return sft_merge_model(s->m, s->ad, s->o.logit_scale, dir);
    peft_save_opts_t po = {DT_F32, s->cfg->model.path};
    return peft_save(s->ad, dir, &po);
}

/* ---- Merging into a new base -------------------------------------------------- */

static int mkdir_p(const char *path) {
    char buf[SFT_PATH_CAP];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return mo_errorf(MO_EINVAL, "path %s is too long", path);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return mo_errorf(MO_EIO, "cannot create directory %s: %s", buf, strerror(errno));
            *p = c;
            if (!c)
                break;
        }
    }
    return MO_OK;
}

/* Copies src to dst (temporary file, rename); absent src is not an error. */
static int copy_file(const char *src, const char *dst) {
    FILE *in = fopen(src, "rb");
    if (!in)
        return errno == ENOENT ? MO_OK
                               : mo_errorf(MO_EIO, "cannot open %s: %s", src, strerror(errno));
    char tmp[SFT_PATH_CAP + 256];
    snprintf(tmp, sizeof tmp, "%s.tmp", dst);
    FILE *out = fopen(tmp, "wb");
    int rc = out ? MO_OK : mo_errorf(MO_EIO, "cannot create %s: %s", tmp, strerror(errno));
    char buf[65536];
    size_t n;
    while (rc == MO_OK && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n)
            rc = mo_errorf(MO_EIO, "cannot write %s", tmp);
    if (rc == MO_OK && ferror(in))
        rc = mo_errorf(MO_EIO, "cannot read %s", src);
    fclose(in);
    if (out && fclose(out) != 0 && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "cannot write %s", tmp);
    if (rc == MO_OK && rename(tmp, dst) != 0)
        rc = mo_errorf(MO_EIO, "cannot rename %s to %s: %s", tmp, dst, strerror(errno));
    if (rc < 0)
        remove(tmp);
    return rc;
}

/* The merged copy of checkpoint tensor i into item (f32 for float tensors). */
static int merged_tensor(const model_t *m, const lora_adapter_t *ad, float logit_scale, int i,
                         st_item_t *item) {
    const st_info_t *in = st_checkpoint_info(m->ck, i);
    tensor_t src = st_checkpoint_tensor(m->ck, i);
    int64_t numel = tensor_numel(&src);
    if (in->dtype == DT_F8E4M3)
        return mo_errorf(MO_EUNSUPPORTED,
                         "sft merge: %s is fp8; merging into an fp8 base is "
                         "not supported",
                         in->name);
    dtype_t dt = dtype_is_float(in->dtype) ? DT_F32 : in->dtype;
    int ft = ad && dt == DT_F32 ? lora_adapter_find_full(ad, in->name) : -1;
    if (ft >= 0 && (int64_t)ad->tensors[ft].numel != numel)
        return mo_errorf(MO_EINVAL, "sft merge: %s has %lld values, the trained copy %zu", in->name,
                         (long long)numel, ad->tensors[ft].numel);
    size_t bytes = (size_t)numel * dtype_size(dt);
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return mo_errorf(MO_ENOMEM, "sft merge: out of memory for %s", in->name);
    if (ft >= 0) /* a router or norm trained in full */
        memcpy(buf, ad->params + ad->tensors[ft].offset, bytes);
    else if (dt == DT_F32)
        convert_to_f32(buf, src.data, in->dtype, (size_t)numel);
    else
        memcpy(buf, src.data, bytes);
    item->name = in->name;
    item->tensor = tensor_view(buf, dt, DEV_CPU, src.ndim, src.shape);
    if (dt == DT_F32 && !strcmp(in->name, "model.norm.weight"))
        for (int64_t k = 0; k < numel; k++)
            ((float *)buf)[k] *= logit_scale;
    size_t nl = strlen(in->name);
    if (dt != DT_F32 || nl < 8 || strcmp(in->name + nl - 7, ".weight") != 0)
        return MO_OK;
    char module[1024];
    if (nl - 7 >= sizeof module)
        return MO_OK;
    memcpy(module, in->name, nl - 7);
    module[nl - 7] = '\0';
    int e = ad ? lora_adapter_find(ad, module) : -1;
    if (e < 0)
        return MO_OK;
    const lora_entry_t *en = &ad->entries[e];
    if (src.ndim != 2 || src.shape[0] != en->OC || src.shape[1] != en->C)
        return mo_errorf(MO_EINVAL, "sft merge: %s is not (%d, %d)", in->name, en->OC, en->C);
    lora_pair_t p = lora_adapter_pair(ad, e, 0);
    return lora_merge(m->k, buf, DT_F32, &p, en->C, en->OC);
}

static int write_weights(const model_t *m, const lora_adapter_t *ad, float logit_scale,
                         const char *path) {
    int n = st_checkpoint_num_tensors(m->ck);
    st_item_t *items = calloc((size_t)n + 1, sizeof *items);
    if (!items)
        return mo_errorf(MO_ENOMEM, "sft merge: out of memory");
    int rc = MO_OK, made = 0;
    for (int i = 0; i < n && rc == MO_OK; i++) {
        rc = merged_tensor(m, ad, logit_scale, i, &items[i]);
        made = i + 1;
    }
    st_meta_t meta[1] = {{"format", "pt"}};
    if (rc == MO_OK)
        rc = st_write(path, items, n, meta, 1);
    for (int i = 0; i < made; i++)
        free(items[i].tensor.data);
    free(items);
    return rc;
}

int sft_merge_model(const model_t *m, const lora_adapter_t *ad, float logit_scale,
                    const char *dir) {
    if (!m || !dir || !(logit_scale > 0) || !isfinite(logit_scale))
        return mo_errorf(MO_EINVAL, "sft merge: model, directory and a logit scale > 0 needed");
    TRY(mkdir_p(dir));
    char p[SFT_PATH_CAP + 64], src[SFT_PATH_CAP + 64];
    snprintf(p, sizeof p, "%s/%s", dir, ST_SINGLE_NAME);
    TRY(write_weights(m, ad, logit_scale, p));
    model_config_t c = m->cfg;
    c.torch_dtype = DT_F32;
    snprintf(p, sizeof p, "%s/config.json", dir);
    TRY(model_config_write_json(&c, p));
    static const char *const tok_files[] = {"tokenizer.json", "tokenizer_config.json",
                                            "special_tokens_map.json", "generation_config.json"};
    struct stat sb;
    int is_dir = stat(m->path, &sb) == 0 && S_ISDIR(sb.st_mode);
    for (size_t i = 0; is_dir && i < sizeof tok_files / sizeof *tok_files; i++) {
        snprintf(src, sizeof src, "%s/%s", m->path, tok_files[i]);
        snprintf(p, sizeof p, "%s/%s", dir, tok_files[i]);
        TRY(copy_file(src, p));
    }
    return MO_OK;
}
