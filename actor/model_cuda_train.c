/* model_cuda_train: the policy model's training step on the CUDA backend: the forward that
 * keeps its activations and the backward to the adapter's gradients, mirroring
 * model_forward(for_backward = 1) and model_backward of actor/model.c layer by layer. */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <stdlib.h>
#include <string.h>

#include "core/cuda/model_glue.h"
#include "core/status.h"

/* The step: what the forward kept and the backward's buffers, all in one pool block (mem),
 * carved by train_layout. Shapes: S = T K slots; rows_ex = max(S if some layer is MoE,
 * T if some layer is dense); Vr = mc_logits_rows(T) rows of logits. */
struct mc_train {
    void *mem;  /* the pool block */
    size_t cap; /* its bytes */
    int valid;  /* 1: a forward_train is pending for backward */
    int T, B;   /* the kept batch */
    float temperature;
    const lora_adapter_t *ad; /* bound at the forward */
    mc_ids_t id;              /* the batch's ids and every MoE layer's routing */
    moe_cuda_plan_t plan;     /* for up to plan_T tokens (plan.T: this call's) */
    int plan_T;
    mc_acts_t *acts;          /* (L) host array: each layer's kept buffers on the device */
    float *x0;                /* (T, D) embedding output, the input of layer 0 */
    float *hf, *rstd_f, *lse; /* (T, D) final norm output, (T), (T) of the logits */
    /* Backward. */
    float *dl, *dent;        /* (T) each, adjacent: dlogp (0 without target), dentropy */
    float *dxa, *dxb;        /* (T, D) gradients at a layer's output and input */
    float *dln;              /* (T, D) at a norm's output (mlp, then attention) */
    float *dhf;              /* (T, D) at the final norm's output */
    float *datt, *dqr, *dq;  /* (T, H Dh) */
    float *dn;               /* (T, H Dh) at a per-head norm's output */
    float *dkr, *dk, *dv;    /* (T, Hkv Dh) */
    float *tmp;              /* (T, R) adapter backward scratch */
    float *drl;              /* (T, E) router logit gradient */
    float *dweight;          /* (S) combine weight gradient */
    float *xg, *dxg, *dyg;   /* (rows_ex, D) */
    float *escr;             /* expert backward scratch (escr_floats(T)) */
    float *logits, *dlogits; /* (Vr, V) */
    /* Host. */
    unsigned char *has_tgt; /* (T) */
    float *hbuf;            /* (2 T) staging of dl, dent */
    int hcap;               /* T the two above hold */
    float *hgrads;          /* (ad->n_params) staging of the device gradients */
};

/* ------------------------------------------------------------------------ */
/* Layout.                                                                   */

static int rows_of(const model_cuda_t *mc, const mc_layer_t *ly, int T) {
    return ly->moe ? T * mc->K : T;
}

/* Floats of expert (or dense MLP) backward scratch for T tokens: the most any layer needs. */
static size_t escr_floats(const model_cuda_t *mc, int T) {
    size_t n = 1;
    for (int l = 0; l < mc->L; l++) {
        const mc_layer_t *ly = &mc->layers[l];
        size_t s = moe_cuda_experts_backward_scratch_floats(&ly->ex, rows_of(mc, ly, T), ly->F);
        n = s > n ? s : n;
    }
    return n;
}

/* (n) floats, or NULL (nothing carved) when present is 0. */
static float *maybe(mc_bump_t *b, int present, size_t n) {
    float *p = NULL;
    if (present)
        MC_BUMP(p, b, n);
    return p;
}

/* Layer l's kept buffers; a->x and a->out are set by the caller. */
static void layer_layout(const model_cuda_t *mc, mc_bump_t *b, mc_acts_t *a, int l, int T) {
    const mc_layer_t *ly = &mc->layers[l];
    size_t TD = (size_t)T * mc->D, qd = (size_t)T * mc->H * mc->Dh;
    size_t kvd = (size_t)T * mc->Hkv * mc->Dh, S = (size_t)T * mc->K, R = (size_t)mc->R;
    size_t rows = (size_t)rows_of(mc, ly, T), F = (size_t)ly->F;
    MC_BUMP(a->ln1, b, TD);
    MC_BUMP(a->rstd1, b, T);
    a->q = maybe(b, ly->q_norm != NULL, qd);
    a->rstd_q = maybe(b, ly->q_norm != NULL, (size_t)T * mc->H);
    a->k = maybe(b, ly->k_norm != NULL, kvd);
    a->rstd_k = maybe(b, ly->k_norm != NULL, (size_t)T * mc->Hkv);
    MC_BUMP(a->qr, b, qd);
    MC_BUMP(a->kr, b, kvd);
    MC_BUMP(a->v, b, kvd);
    MC_BUMP(a->att, b, qd);
    MC_BUMP(a->lse, b, (size_t)T * mc->H);
    a->xa_q = maybe(b, ly->lq.A != NULL, (size_t)T * R);
    a->xa_k = maybe(b, ly->lk.A != NULL, (size_t)T * R);
    a->xa_v = maybe(b, ly->lv.A != NULL, (size_t)T * R);
    a->xa_o = maybe(b, ly->lo.A != NULL, (size_t)T * R);
    MC_BUMP(a->h1, b, TD);
    MC_BUMP(a->ln2, b, TD);
    MC_BUMP(a->rstd2, b, T);
    a->probs = maybe(b, ly->moe, (size_t)T * mc->E);
    a->wt = maybe(b, ly->moe, S);
    a->yg = maybe(b, ly->moe, S * mc->D);
    MC_BUMP(a->g, b, rows * F);
    MC_BUMP(a->u, b, rows * F);
    MC_BUMP(a->h, b, rows * F);
    a->xa_g = maybe(b, ly->ex.lora_gate.A != NULL, rows * R);
    a->xa_u = maybe(b, ly->ex.lora_up.A != NULL, rows * R);
    a->xa_d = maybe(b, ly->ex.lora_down.A != NULL, rows * R);
}

/* Carves the step's buffers for T tokens of B sequences from base (NULL: only measures);
 * returns the bytes. The ids come first (mc_upload_batch fills them with one copy). */
static size_t train_layout(const model_cuda_t *mc, mc_train_t *tr, char *base, int T, int B) {
    mc_bump_t b = {base, 0};
    size_t TD = (size_t)T * mc->D, qd = (size_t)T * mc->H * mc->Dh;
    size_t kvd = (size_t)T * mc->Hkv * mc->Dh, S = (size_t)T * mc->K;
    size_t rows_ex = mc_expert_rows(mc, T);
    mc_ids_layout(mc, &b, &tr->id, T, B);
    MC_BUMP(tr->x0, &b, TD);
    for (int l = 0; l < mc->L; l++) {
        mc_acts_t *a = &tr->acts[l];
        layer_layout(mc, &b, a, l, T);
        a->x = l == 0 ? tr->x0 : tr->acts[l - 1].out;
        MC_BUMP(a->out, &b, TD);
    }
    MC_BUMP(tr->hf, &b, TD);
    MC_BUMP(tr->rstd_f, &b, T);
    MC_BUMP(tr->lse, &b, T);
    MC_BUMP(tr->dl, &b, 2 * (size_t)T); /* dl then dent: one upload */
    tr->dent = tr->dl ? tr->dl + T : NULL;
    MC_BUMP(tr->dxa, &b, TD);
    MC_BUMP(tr->dxb, &b, TD);
    MC_BUMP(tr->dln, &b, TD);
    MC_BUMP(tr->dhf, &b, TD);
    MC_BUMP(tr->datt, &b, qd);
    MC_BUMP(tr->dqr, &b, qd);
    MC_BUMP(tr->dq, &b, qd);
    MC_BUMP(tr->dn, &b, qd);
    MC_BUMP(tr->dkr, &b, kvd);
    MC_BUMP(tr->dk, &b, kvd);
    MC_BUMP(tr->dv, &b, kvd);
    MC_BUMP(tr->tmp, &b, (size_t)T * mc->R);
    MC_BUMP(tr->drl, &b, (size_t)T * mc->E);
    MC_BUMP(tr->dweight, &b, S);
    MC_BUMP(tr->xg, &b, rows_ex * mc->D);
    MC_BUMP(tr->dxg, &b, rows_ex * mc->D);
    MC_BUMP(tr->dyg, &b, rows_ex * mc->D);
    MC_BUMP(tr->escr, &b, escr_floats(mc, T));
    size_t nl = (size_t)mc_logits_rows(mc, T) * mc->V;
    MC_BUMP(tr->logits, &b, nl);
    MC_BUMP(tr->dlogits, &b, nl);
    return b.off;
}

void mc_train_invalidate(model_cuda_t *mc) {
    if (mc && mc->tr)
        mc->tr->valid = 0;
}

void mc_train_free(model_cuda_t *mc) {
    mc_train_t *tr = mc->tr;
    if (!tr)
        return;
    moe_cuda_plan_free(&tr->plan);
    if (tr->mem)
        mc->be->free(mc->be, tr->mem);
    free(tr->acts);
    free(tr->has_tgt);
    free(tr->hbuf);
    free(tr->hgrads);
    free(tr);
    mc->tr = NULL;
}

/* The step's state, its block and plan ready for T tokens of B sequences. */
static int train_ready(model_cuda_t *mc, int T, int B) {
    static const char fn[] = "model_cuda_forward_train";
    if (!mc->tr) {
        mc_train_t *tr = calloc(1, sizeof *tr);
        if (tr) {
            tr->plan_T = -1;
            tr->acts = calloc((size_t)(mc->L > 0 ? mc->L : 1), sizeof *tr->acts);
            tr->hgrads = malloc(sizeof(float) * (mc->ad->n_params > 0 ? mc->ad->n_params : 1));
        }
        if (!tr || !tr->acts || !tr->hgrads) {
            if (tr) {
                free(tr->acts);
                free(tr->hgrads);
                free(tr);
            }
            return mo_errorf(MO_ENOMEM, "%s: step state", fn);
        }
        mc->tr = tr;
    }
    mc_train_t *tr = mc->tr;
    TRY(mc_block_ready(mc, &tr->mem, &tr->cap, train_layout(mc, tr, NULL, T, B)));
    train_layout(mc, tr, tr->mem, T, B);
    TRY(mc_plan_ready(mc, &tr->plan, &tr->plan_T, T));
    if (T > tr->hcap) {
        free(tr->has_tgt);
        free(tr->hbuf);
        tr->hcap = 0;
        tr->has_tgt = malloc((size_t)T);
        tr->hbuf = malloc(sizeof(float) * 2 * (size_t)T);
        if (!tr->has_tgt || !tr->hbuf)
            return mo_errorf(MO_ENOMEM, "%s: %d tokens of host staging", fn, T);
        tr->hcap = T;
    }
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Forward.                                                                  */

static int forward_train(model_cuda_t *mc, const model_batch_t *b) {
    mc_train_t *tr = mc->tr;
    int T = b->T;
    mc->replay = b->replay != NULL;
    TRY(mc_scratch_ready(mc, T, b->B)); /* the temporaries the forward does not keep */
    mc->id = &tr->id;
    mc->cur_plan = &tr->plan;
    TRY(mc_upload_batch(mc, mc->id, b, "model_cuda_forward_train"));
    mc->be->k->embedding_forward(tr->x0, tr->id.tok, &mc->embed, T, mc->D);
    int rc = MO_OK;
    mc_ep_keep(mc, 1); /* the MoE layers' exchanges stay for the backward */
    for (int l = 0; l < mc->L && rc == MO_OK; l++) {
        rc = mc_layer_forward(mc, l, &tr->acts[l], T, b->B, 1);
        if (rc < 0)
            rc = mo_error_wrap(rc, "layer %d", l);
    }
    mc_ep_keep(mc, 0);
    TRY(rc);
    const float *xL = mc->L > 0 ? tr->acts[mc->L - 1].out : tr->x0;
    mc_head_forward(mc, tr->hf, tr->rstd_f, tr->lse, mc->s.logp, mc->s.ent, xL, T, b->temperature);
    return mc->be->synchronize(mc->be);
}

int model_cuda_forward_train(model_cuda_t *mc, const model_batch_t *b, float *logp,
                             float *entropy) {
    static const char fn[] = "model_cuda_forward_train";
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    mc_train_invalidate(mc);
    if (mc->R == 0)
        return mo_errorf(MO_EINVAL,
                         "%s: the upload holds no adapter (bind one with "
                         "model_set_adapter before model_cuda_upload)",
                         fn);
    if (mc->m->adapter != mc->ad)
        return mo_errorf(MO_ESTATE, "%s: the adapter uploaded is no longer bound to the model", fn);
    if (mc->m->opts.aux_coef > 0.0f)
        return mo_errorf(MO_ECONFIG,
                         "%s: the balance loss (aux_coef %g > 0) is not supported by the CUDA "
                         "training step (%s)",
                         fn, (double)mc->m->opts.aux_coef, mc->m->path ? mc->m->path : "model");
    TRY(mc_check_batch(mc, b, logp, fn));
    TRY(train_ready(mc, b->T, b->B));
    mc_train_t *tr = mc->tr;
    int T = b->T;
    if (T > 0) {
        int rc = forward_train(mc, b);
        if (rc < 0)
            return mc_fail(mc, rc, fn);
        TRY(mc_results_out(mc, b, logp, entropy, tr->id.route, fn));
    } else if (mc->ep) { /* no tokens: this rank still serves its experts */
        mc_ep_keep(mc, 1);
        int rc = mc_ep_empty_forward(mc, 1);
        mc_ep_keep(mc, 0);
        if (rc < 0)
            return mc_fail(mc, rc, fn);
    }
    for (int t = 0; t < T; t++)
        tr->has_tgt[t] = b->targets[t] >= 0;
    tr->T = T;
    tr->B = b->B;
    tr->temperature = b->temperature;
    tr->ad = mc->ad;
    tr->valid = 1;
    return MO_OK;
}

/* ------------------------------------------------------------------------ */
/* Backward: actor/model.c's, in the same order.                            */

/* Zeroes n floats at p (queued). */
static int zero(const model_cuda_t *mc, float *p, size_t n) {
    return n > 0 ? mc->be->memset_zero(mc->be, p, sizeof(float) * n) : MO_OK;
}

/* dinp (T, C) += from dout (T, OC) through W (when dinp) and its adapter l (when present:
 * its dA, dB accumulate). model.c's proj_backward. */
static int proj_backward(const model_cuda_t *mc, float *dinp, const float *dout, const float *inp,
                         const float *xa, const wview_t *w, const moe_cuda_lora_t *l, int T, int C,
                         int OC) {
    if (dinp)
        mc->be->k->matmul_backward(dinp, NULL, NULL, dout, inp, w, T, C, OC);
    if (l->A)
        TRY(moe_cuda_lora_backward(dinp, dout, inp, xa, l, mc->tr->id.off1, 1, T, C, OC,
                                   mc->tr->tmp));
    return MO_OK;
}

/* draw (T, nh, Dh) += from dout through RoPE and (when w) the per-head norm of raw with
 * scales rstd. */
static int norm_rope_backward(const model_cuda_t *mc, float *draw, const float *dout,
                              const float *raw, const float *rstd, const float *w, int nh) {
    const kernels_t *k = mc->be->k;
    const mc_train_t *tr = mc->tr;
    int T = tr->T, Dh = mc->Dh;
    if (!w) {
        k->rope_backward(draw, dout, tr->id.pos, mc->inv_freq, mc->m->rope_mscale, T, nh, Dh, Dh);
        return MO_OK;
    }
    TRY(zero(mc, tr->dn, (size_t)T * nh * Dh));
    k->rope_backward(tr->dn, dout, tr->id.pos, mc->inv_freq, mc->m->rope_mscale, T, nh, Dh, Dh);
    k->rmsnorm_backward(draw, NULL, tr->dn, raw, w, rstd, T * nh, Dh);
    return MO_OK;
}

/* dx (T, D) += from dh (T, D) at the attention block's output (dh may be dx: it is read
 * before dx is written); need_dx 0 skips the input gradient (layer 0). */
static int attention_backward(const model_cuda_t *mc, float *dx, const float *dh,
                              const mc_acts_t *a, const mc_layer_t *ly, int need_dx) {
    const kernels_t *k = mc->be->k;
    const mc_train_t *tr = mc->tr;
    int T = tr->T, D = mc->D, qd = mc->H * mc->Dh, kvd = mc->Hkv * mc->Dh;
    TRY(zero(mc, tr->datt, (size_t)T * qd));
    TRY(proj_backward(mc, tr->datt, dh, a->att, a->xa_o, &ly->wo, &ly->lo, T, qd, D));
    TRY(zero(mc, tr->dqr, (size_t)T * qd));
    TRY(zero(mc, tr->dkr, (size_t)T * kvd));
    TRY(zero(mc, tr->dv, (size_t)T * kvd));
    k->attention_backward(tr->dqr, tr->dkr, tr->dv, tr->datt, a->qr, a->kr, a->v, a->att, a->lse,
                          tr->id.cu, tr->B, mc->H, mc->Hkv, mc->Dh, mc->m->attn_scale, ly->window);
    TRY(zero(mc, tr->dq, (size_t)T * qd));
    TRY(zero(mc, tr->dk, (size_t)T * kvd));
    TRY(norm_rope_backward(mc, tr->dq, tr->dqr, a->q, a->rstd_q, ly->q_norm, mc->H));
    TRY(norm_rope_backward(mc, tr->dk, tr->dkr, a->k, a->rstd_k, ly->k_norm, mc->Hkv));
    float *dln1 = need_dx ? tr->dln : NULL;
    if (dln1)
        TRY(zero(mc, dln1, (size_t)T * D));
    TRY(proj_backward(mc, dln1, tr->dq, a->ln1, a->xa_q, &ly->wq, &ly->lq, T, D, qd));
    TRY(proj_backward(mc, dln1, tr->dk, a->ln1, a->xa_k, &ly->wk, &ly->lk, T, D, kvd));
    TRY(proj_backward(mc, dln1, tr->dv, a->ln1, a->xa_v, &ly->wv, &ly->lv, T, D, kvd));
    if (dln1)
        k->rmsnorm_backward(dx, NULL, dln1, a->x, ly->attn_norm, a->rstd1, T, D);
    return MO_OK;
}

/* dln (T, D) += from dy (T, D) at the MoE layer's output: combine, experts, dispatch, then
 * the router (frozen: only its input gradient). moe_backward's order. */
static int moe_layer_backward(const model_cuda_t *mc, float *dln, const float *dy,
                              const mc_acts_t *a, const mc_layer_t *ly) {
    mc_train_t *tr = mc->tr;
    int T = tr->T, D = mc->D, E = mc->E, K = mc->K, S = T * K;
    const int32_t *idx = tr->id.route + (size_t)ly->moe_index * S; /* (T, K) */
    moe_cuda_plan_t *p = &tr->plan;
    /* The forward's plan of this layer again (the same stable sort of the same experts),
     * and its gathered input (an exact copy). */
    TRY(moe_cuda_plan_build(p, idx));
    TRY(moe_cuda_dispatch_forward(tr->xg, a->ln2, p, D));
    TRY(zero(mc, tr->dyg, (size_t)S * D));
    TRY(zero(mc, tr->dweight, (size_t)S));
    TRY(zero(mc, tr->dxg, (size_t)S * D));
    TRY(moe_cuda_combine_backward(tr->dyg, tr->dweight, dy, a->yg, a->wt, p, D));
    if (mc->ep) { /* expert parallelism: through the owners the forward sent the rows to */
        TRY(mc_ep_experts_backward(mc, ly, tr->dxg, tr->dyg));
    } else {
        moe_cuda_acts_t e = mc_expert_acts(a, &ly->ex);
        TRY(moe_cuda_experts_backward(tr->dxg, tr->dyg, tr->xg, &e, p->offsets, E, S, &ly->ex, D,
                                      ly->F, tr->escr));
    }
    TRY(moe_cuda_dispatch_backward(dln, tr->dxg, p, D));
    TRY(model_glue_router_backward(tr->drl, tr->dweight, idx, a->probs, T, E, K, ly->norm_topk,
                                   ly->route_scale));
    mc->be->k->matmul_backward(dln, NULL, NULL, tr->drl, a->ln2, &ly->router, T, D, E);
    return MO_OK;
}

/* dx (T, D) = the gradient at layer l's input from dy (T, D) at its output. */
static int layer_backward(const model_cuda_t *mc, float *dx, const float *dy, int l, int need_dx) {
    const mc_layer_t *ly = &mc->layers[l];
    mc_train_t *tr = mc->tr;
    const mc_acts_t *a = &tr->acts[l];
    int T = tr->T, D = mc->D;
    size_t TD = (size_t)T * D;
    /* The residual: dh1 starts as dy. */
    TRY(mc->be->copy(mc->be, dx, DEV_CUDA, dy, DEV_CUDA, sizeof(float) * TD));
    TRY(zero(mc, tr->dln, TD));
    if (ly->moe) {
        TRY(moe_layer_backward(mc, tr->dln, dy, a, ly));
    } else {
        moe_cuda_acts_t e = mc_expert_acts(a, &ly->ex);
        TRY(moe_cuda_experts_backward(tr->dln, dy, a->ln2, &e, tr->id.off1, 1, T, &ly->ex, D, ly->F,
                                      tr->escr));
    }
    mc->be->k->rmsnorm_backward(dx, NULL, tr->dln, a->h1, ly->mlp_norm, a->rstd2, T, D);
    /* dx now holds dh1: the attention block's output gradient and the residual's. */
    return attention_backward(mc, dx, dx, a, ly, need_dx);
}

/* dx (T, D) = the gradient at the final norm's input: the lm_head chunks recomputed from
 * the kept final norm output. */
static int head_backward(const model_cuda_t *mc, float *dx, int has_dent) {
    const kernels_t *k = mc->be->k;
    const mc_train_t *tr = mc->tr;
    int T = tr->T, D = mc->D, V = mc->V, rows = mc_logits_rows(mc, T);
    TRY(zero(mc, tr->dhf, (size_t)T * D));
    for (int r0 = 0; r0 < T; r0 += rows) {
        int n = T - r0 < rows ? T - r0 : rows;
        const float *hf = tr->hf + (size_t)r0 * D;
        k->matmul_forward(tr->logits, hf, &mc->lm_head, NULL, n, D, V);
        TRY(zero(mc, tr->dlogits, (size_t)n * V));
        k->logprob_backward(tr->dlogits, tr->dl + r0, has_dent ? tr->dent + r0 : NULL, tr->logits,
                            tr->lse + r0, tr->id.tgt + r0, n, V, tr->temperature);
        k->matmul_backward(tr->dhf + (size_t)r0 * D, NULL, NULL, tr->dlogits, hf, &mc->lm_head, n,
                           D, V);
    }
    TRY(zero(mc, dx, (size_t)T * D));
    const float *xL = mc->L > 0 ? tr->acts[mc->L - 1].out : tr->x0;
    k->rmsnorm_backward(dx, NULL, tr->dhf, xL, mc->final_norm, tr->rstd_f, T, D);
    return MO_OK;
}

/* Queues the whole backward into mc->dgrads. */
static int backward(model_cuda_t *mc, int has_dent) {
    mc_train_t *tr = mc->tr;
    TRY(zero(mc, mc->dgrads, mc->ad->n_params));
    if (tr->T == 0) { /* expert parallelism: only the local experts' part */
        TRY(mc_ep_empty_backward(mc));
        return mc->be->synchronize(mc->be);
    }
    float *dxa = tr->dxa, *dxb = tr->dxb;
    TRY(head_backward(mc, dxa, has_dent));
    for (int l = mc->L - 1; l >= 0; l--) {
        int rc = layer_backward(mc, dxb, dxa, l, l > 0);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d backward", l);
        float *t = dxa;
        dxa = dxb;
        dxb = t;
    }
    return mc->be->synchronize(mc->be);
}

int model_cuda_backward(model_cuda_t *mc, const float *dlogp, const float *dentropy) {
    static const char fn[] = "model_cuda_backward";
    if (!mc)
        return mo_errorf(MO_EINVAL, "%s: no uploaded model", fn);
    mc_train_t *tr = mc->tr;
    if (!tr || !tr->valid || tr->ad != mc->ad || mc->m->adapter != mc->ad)
        return mo_errorf(MO_ESTATE,
                         "%s: no model_cuda_forward_train with the bound adapter since "
                         "the upload, the last failure, adapter sync or change",
                         fn);
    if (!dlogp)
        return mo_errorf(MO_EINVAL, "%s: dlogp is required", fn);
    if (!mc->ad->grads)
        return mo_errorf(MO_EINVAL, "%s: the adapter has no gradient buffer (made with no_grads)",
                         fn);
    int T = tr->T;
    if (T == 0 && !mc->ep)
        return MO_OK;
    float *h = tr->hbuf; /* (2 T): dl then dent, as tr->dl and tr->dent lie */
    for (int t = 0; t < T; t++) {
        h[t] = tr->has_tgt[t] ? dlogp[t] : 0.0f;
        h[T + t] = dentropy ? dentropy[t] : 0.0f;
    }
    const backend_t *be = mc->be;
    size_t hb = sizeof(float) * 2 * (size_t)T;
    int rc = T > 0 ? be->copy(be, tr->dl, DEV_CUDA, h, DEV_CPU, hb) : MO_OK;
    if (rc == MO_OK)
        rc = backward(mc, dentropy != NULL);
    size_t n = mc->ad->n_params;
    if (rc == MO_OK)
        rc = be->copy(be, tr->hgrads, DEV_CPU, mc->dgrads, DEV_CUDA, sizeof(float) * n);
    if (rc < 0) {
        tr->valid = 0;
        return mc_fail(mc, rc, fn);
    }
    float *g = mc->ad->grads;
    for (size_t i = 0; i < n; i++)
        g[i] += tr->hgrads[i];
    return MO_OK;
}

#endif /* MOERL_HAVE_CUDA */
