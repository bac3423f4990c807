/* moe: route, dispatch, expert compute, combine; and the backward of each. */
#include "moe/moe.h"

#include <stdint.h>
#include <string.h>

#include "core/status.h"

/* Token loops below run in parallel above this many floats of work; each token's sums
 * keep a fixed order, so results do not depend on the thread count. */
#define MOE_PAR_MIN 32768

int moe_cfg_check(const moe_cfg_t *c) {
    if (c->D < 1 || c->F < 1)
        return mo_errorf(MO_ECONFIG, "moe: D and F must be >= 1, got D = %d, F = %d", c->D, c->F);
    if (c->n_shared < 0)
        return mo_errorf(MO_ECONFIG, "moe: n_shared must be >= 0, got %d", c->n_shared);
    if (!(c->aux_coef >= 0.0f))
        return mo_errorf(MO_ECONFIG, "moe: aux_coef must be >= 0, got %g", (double)c->aux_coef);
    int rc = router_cfg_check(&c->router);
    return rc < 0 ? mo_error_wrap(rc, "moe") : MO_OK;
}

static const lora_pair_t *entry(const lora_pair_t *const *tab, int e) {
    return tab ? tab[e] : NULL;
}

mlp_weights_t moe_expert_weights(const moe_weights_t *w, int e) {
    mlp_weights_t m;
    m.gate = w->gate[e];
    m.up = w->up[e];
    m.down = w->down[e];
    m.lora_gate = entry(w->lora_gate, e);
    m.lora_up = entry(w->lora_up, e);
    m.lora_down = entry(w->lora_down, e);
    return m;
}

static void *alloc_or_fail(arena_t *ar, size_t bytes, const char *what) {
    void *p = arena_alloc(ar, bytes);
    if (!p)
        mo_error_wrap(MO_ENOMEM, "moe %s", what);
    return p;
}

#define ARENA_ARRAY(ptr, ar, n, what)                                                              \
    do {                                                                                           \
        (ptr) = alloc_or_fail((ar), sizeof(*(ptr)) * (size_t)(n), (what));                         \
        if (!(ptr))                                                                                \
            return MO_ENOMEM;                                                                      \
    } while (0)

int moe_dispatch_plan(moe_dispatch_t *p, arena_t *ar, const int32_t *idx, int T, int K, int E) {
    size_t S = (size_t)T * K;
    if (S > INT32_MAX)
        return mo_errorf(MO_EINVAL, "moe dispatch: %zu token slots exceed the int32 plan", S);
    p->T = T;
    p->K = K;
    p->E = E;
    ARENA_ARRAY(p->offsets, ar, E + 1, "dispatch offsets");
    ARENA_ARRAY(p->slot_of_row, ar, S, "dispatch permutation");
    ARENA_ARRAY(p->row_of_slot, ar, S, "dispatch permutation");
    memset(p->offsets, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (size_t s = 0; s < S; s++) {
        if (idx[s] < 0 || idx[s] >= E)
            return mo_errorf(MO_EINVAL, "moe dispatch: slot %zu names expert %d, outside [0, %d)",
                             s, (int)idx[s], E);
        p->offsets[idx[s] + 1]++;
    }
    for (int e = 0; e < E; e++)
        p->offsets[e + 1] += p->offsets[e];
    /* Stable placement: a running cursor per expert takes slots in token order. */
    int32_t *cursor;
    ARENA_ARRAY(cursor, ar, E, "dispatch cursors");
    memcpy(cursor, p->offsets, sizeof(int32_t) * (size_t)E);
    for (size_t s = 0; s < S; s++) {
        int32_t r = cursor[idx[s]]++;
        p->slot_of_row[r] = (int32_t)s;
        p->row_of_slot[s] = r;
    }
    return MO_OK;
}

void moe_dispatch_forward(float *xg, const float *x, const moe_dispatch_t *p, int D) {
    size_t S = (size_t)p->T * p->K;
#pragma omp parallel for schedule(static) if (S * (size_t)D > MOE_PAR_MIN)
    for (size_t r = 0; r < S; r++) {
        int t = p->slot_of_row[r] / p->K;
        memcpy(xg + r * D, x + (size_t)t * D, sizeof(float) * (size_t)D);
    }
}

void moe_dispatch_backward(float *dx, const float *dxg, const moe_dispatch_t *p, int D) {
#pragma omp parallel for schedule(static) if ((size_t)p->T * p->K * D > MOE_PAR_MIN)
    for (int t = 0; t < p->T; t++) {
        float *d = dx + (size_t)t * D;
        for (int kk = 0; kk < p->K; kk++) {
            const float *g = dxg + (size_t)p->row_of_slot[(size_t)t * p->K + kk] * D;
            for (int i = 0; i < D; i++)
                d[i] += g[i];
        }
    }
}

void moe_combine_forward(float *out, const float *yg, const float *weight, const moe_dispatch_t *p,
                         int D) {
#pragma omp parallel for schedule(static) if ((size_t)p->T * p->K * D > MOE_PAR_MIN)
    for (int t = 0; t < p->T; t++) {
        float *o = out + (size_t)t * D;
        for (int i = 0; i < D; i++)
            o[i] = 0.0f;
        for (int kk = 0; kk < p->K; kk++) {
            size_t s = (size_t)t * p->K + kk;
            const float *y = yg + (size_t)p->row_of_slot[s] * D;
            float wk = weight[s];
            for (int i = 0; i < D; i++)
                o[i] += wk * y[i];
        }
    }
}

void moe_combine_backward(float *dyg, float *dweight, const float *dout, const float *yg,
                          const float *weight, const moe_dispatch_t *p, int D) {
#pragma omp parallel for schedule(static) if ((size_t)p->T * p->K * D > MOE_PAR_MIN)
    for (int t = 0; t < p->T; t++) {
        const float *g = dout + (size_t)t * D;
        for (int kk = 0; kk < p->K; kk++) {
            size_t s = (size_t)t * p->K + kk;
            size_t r = (size_t)p->row_of_slot[s];
            if (dyg) {
                float *dy = dyg + r * D;
                float wk = weight[s];
                for (int i = 0; i < D; i++)
                    dy[i] += wk * g[i];
            }
            if (dweight) {
                const float *y = yg + r * D;
                double dot = 0.0;
                for (int i = 0; i < D; i++)
                    dot += (double)g[i] * y[i];
                dweight[s] += (float)dot;
            }
        }
    }
}

int moe_experts_forward(const kernels_t *k, arena_t *ar, float *ye, mlp_acts_t *acts,
                        const float *xe, const int32_t *offsets, int n, int e0,
                        const moe_weights_t *w, int D, int F) {
    for (int i = 0; i < n; i++) {
        int rows = offsets[i + 1] - offsets[i];
        memset(&acts[i], 0, sizeof acts[i]);
        if (rows == 0)
            continue;
        mlp_weights_t mw = moe_expert_weights(w, e0 + i);
        int rc = mlp_acts_alloc(&acts[i], ar, &mw, rows, F);
        if (rc < 0)
            return mo_error_wrap(rc, "expert %d", e0 + i);
        size_t at = (size_t)offsets[i] * D;
        mlp_forward(k, ye + at, &acts[i], xe + at, &mw, rows, D, F);
    }
    return MO_OK;
}

int moe_experts_backward(const kernels_t *k, arena_t *ar, float *dxe, const float *dye,
                         const float *xe, const mlp_acts_t *acts, const int32_t *offsets, int n,
                         int e0, const moe_weights_t *w, int D, int F) {
    size_t need = 0;
    for (int i = 0; i < n; i++) {
        mlp_weights_t mw = moe_expert_weights(w, e0 + i);
        size_t s = mlp_backward_scratch_floats(&mw, offsets[i + 1] - offsets[i], F);
        if (s > need)
            need = s;
    }
    float *scratch;
    ARENA_ARRAY(scratch, ar, need, "expert backward scratch");
    for (int i = 0; i < n; i++) {
        int rows = offsets[i + 1] - offsets[i];
        if (rows == 0)
            continue;
        mlp_weights_t mw = moe_expert_weights(w, e0 + i);
        size_t at = (size_t)offsets[i] * D;
        mlp_backward(k, dxe + at, dye + at, xe + at, &acts[i], &mw, rows, D, F, scratch);
    }
    return MO_OK;
}

/* Router logits, routing (or replay) and load statistics. */
static int route(const kernels_t *k, arena_t *ar, moe_state_t *st, const moe_cfg_t *c,
                 const moe_weights_t *w, const void *replay, dtype_t replay_dt) {
    const router_cfg_t *rc = &c->router;
    int T = st->T, E = rc->E, K = rc->K;
    ARENA_ARRAY(st->logits, ar, (size_t)T * E, "router logits");
    ARENA_ARRAY(st->probs, ar, (size_t)T * E, "router scores");
    ARENA_ARRAY(st->idx, ar, (size_t)T * K, "routing");
    ARENA_ARRAY(st->weight, ar, (size_t)T * K, "routing weights");
    ARENA_ARRAY(st->load, ar, E, "load");
    if (T > 0)
        k->matmul_forward(st->logits, st->x, &w->router, NULL, T, c->D, E);
    if (replay)
        TRY(router_replay(k, rc, st->idx, st->weight, st->probs, st->logits, replay, replay_dt, T));
    else
        TRY(router_forward(k, rc, st->idx, st->weight, st->probs, st->logits, T));
    router_load_stats(st->load, &st->imbalance, st->idx, T, K, E);
    st->aux_loss =
        c->aux_coef > 0.0f ? router_aux_loss(rc, st->load, st->probs, T, c->aux_coef) : 0.0f;
    return MO_OK;
}

static int shared_width(const moe_cfg_t *c) {
    return c->n_shared * c->F;
}

int moe_forward(const kernels_t *k, arena_t *ar, moe_state_t *st, float *out, const float *x,
                const moe_cfg_t *c, const moe_weights_t *w, int T, const void *replay,
                dtype_t replay_dt) {
    TRY(moe_cfg_check(c));
    if (T < 0)
        return mo_errorf(MO_EINVAL, "moe: T must be >= 0, got %d", T);
    int D = c->D, E = c->router.E, K = c->router.K;
    size_t S = (size_t)T * K;
    memset(st, 0, sizeof *st);
    st->T = T;
    st->x = x;
    TRY(route(k, ar, st, c, w, replay, replay_dt));
    TRY(moe_dispatch_plan(&st->plan, ar, st->idx, T, K, E));
    ARENA_ARRAY(st->xg, ar, S * D, "gathered rows");
    ARENA_ARRAY(st->yg, ar, S * D, "expert outputs");
    ARENA_ARRAY(st->acts, ar, E, "expert activations");
    moe_dispatch_forward(st->xg, x, &st->plan, D);
    TRY(moe_experts_forward(k, ar, st->yg, st->acts, st->xg, st->plan.offsets, E, 0, w, D, c->F));
    moe_combine_forward(out, st->yg, st->weight, &st->plan, D);
    if (c->n_shared > 0 && T > 0) {
        int Fs = shared_width(c);
        float *ys;
        ARENA_ARRAY(ys, ar, (size_t)T * D, "shared expert output");
        TRY(mlp_acts_alloc(&st->shared_acts, ar, &w->shared, T, Fs));
        mlp_forward(k, ys, &st->shared_acts, x, &w->shared, T, D, Fs);
        for (size_t i = 0; i < (size_t)T * D; i++)
            out[i] += ys[i];
    }
    return MO_OK;
}

static int shared_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout,
                           const moe_state_t *st, const moe_cfg_t *c, const moe_weights_t *w) {
    int Fs = shared_width(c);
    float *scratch;
    ARENA_ARRAY(scratch, ar, mlp_backward_scratch_floats(&w->shared, st->T, Fs),
                "shared expert backward scratch");
    mlp_backward(k, dx, dout, st->x, &st->shared_acts, &w->shared, st->T, c->D, Fs, scratch);
    return MO_OK;
}

int moe_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout,
                 const moe_state_t *st, const moe_cfg_t *c, const moe_weights_t *w) {
    int T = st->T, D = c->D, E = c->router.E, K = c->router.K;
    size_t S = (size_t)T * K;
    if (T == 0)
        return MO_OK;
    if (c->n_shared > 0)
        TRY(shared_backward(k, ar, dx, dout, st, c, w));
    float *dyg, *dweight, *dxg, *dlogits;
    ARENA_ARRAY(dyg, ar, S * D, "expert output gradient");
    ARENA_ARRAY(dweight, ar, S, "routing weight gradient");
    ARENA_ARRAY(dxg, ar, S * D, "gathered input gradient");
    ARENA_ARRAY(dlogits, ar, (size_t)T * E, "router logit gradient");
    memset(dyg, 0, sizeof(float) * S * D);
    memset(dweight, 0, sizeof(float) * S);
    memset(dxg, 0, sizeof(float) * S * D);
    memset(dlogits, 0, sizeof(float) * (size_t)T * E);
    moe_combine_backward(dyg, dweight, dout, st->yg, st->weight, &st->plan, D);
    TRY(moe_experts_backward(k, ar, dxg, dyg, st->xg, st->acts, st->plan.offsets, E, 0, w, D,
                             c->F));
    moe_dispatch_backward(dx, dxg, &st->plan, D);
    router_backward(&c->router, dlogits, dweight, st->idx, st->probs, T);
    if (c->aux_coef > 0.0f)
        router_aux_loss_backward(&c->router, dlogits, 1.0f, st->load, st->probs, T, c->aux_coef);
    k->matmul_backward(dx, w->drouter, NULL, dlogits, st->x, &w->router, T, D, E);
    return MO_OK;
}
