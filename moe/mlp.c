/* mlp: SwiGLU block forward and backward with optional LoRA on each projection. */
#include "moe/mlp.h"

#include <string.h>

#include "core/status.h"

static int rank_of(const lora_pair_t *p) {
    return p ? p->R : 0;
}

static int max_rank(const mlp_weights_t *w) {
    int r = rank_of(w->lora_gate);
    if (rank_of(w->lora_up) > r)
        r = rank_of(w->lora_up);
    if (rank_of(w->lora_down) > r)
        r = rank_of(w->lora_down);
    return r;
}

static int alloc_floats(float **p, arena_t *ar, size_t n) {
    *p = arena_floats(ar, n);
    return *p ? MO_OK : mo_error_wrap(MO_ENOMEM, "mlp activations (%zu floats)", n);
}

int mlp_acts_alloc(mlp_acts_t *a, arena_t *ar, const mlp_weights_t *w, int T, int F) {
    memset(a, 0, sizeof *a);
    size_t tf = (size_t)T * F;
    TRY(alloc_floats(&a->g, ar, tf));
    TRY(alloc_floats(&a->u, ar, tf));
    TRY(alloc_floats(&a->h, ar, tf));
    if (w->lora_gate)
        TRY(alloc_floats(&a->xa_gate, ar, (size_t)T * w->lora_gate->R));
    if (w->lora_up)
        TRY(alloc_floats(&a->xa_up, ar, (size_t)T * w->lora_up->R));
    if (w->lora_down)
        TRY(alloc_floats(&a->xa_down, ar, (size_t)T * w->lora_down->R));
    return MO_OK;
}

/* out (T, OC) = inp (T, C) @ W^T + its adapter (when present). */
static void proj_forward(const kernels_t *k, float *out, float *xa, const float *inp,
                         const wview_t *wt, const lora_pair_t *p, int T, int C, int OC) {
    k->matmul_forward(out, inp, wt, NULL, T, C, OC);
    if (p)
        lora_forward(k, out, xa, inp, p, T, C, OC);
}

void mlp_forward(const kernels_t *k, float *y, mlp_acts_t *a, const float *x,
                 const mlp_weights_t *w, int T, int D, int F) {
    if (T <= 0)
        return;
    proj_forward(k, a->g, a->xa_gate, x, &w->gate, w->lora_gate, T, D, F);
    proj_forward(k, a->u, a->xa_up, x, &w->up, w->lora_up, T, D, F);
    k->swiglu_forward(a->h, a->g, a->u, (size_t)T * F);
    proj_forward(k, y, a->xa_down, a->h, &w->down, w->lora_down, T, F, D);
}

size_t mlp_backward_scratch_floats(const mlp_weights_t *w, int T, int F) {
    return (size_t)T * (3 * (size_t)F + (size_t)max_rank(w));
}

/* dinp (T, C) += from dout (T, OC) through W and its adapter. */
static void proj_backward(const kernels_t *k, float *dinp, const float *dout, const float *inp,
                          const float *xa, const wview_t *wt, const lora_pair_t *p, int T, int C,
                          int OC, float *tmp) {
    k->matmul_backward(dinp, NULL, NULL, dout, inp, wt, T, C, OC);
    if (p)
        lora_backward(k, dinp, dout, inp, xa, p, T, C, OC, tmp);
}

void mlp_backward(const kernels_t *k, float *dx, const float *dy, const float *x,
                  const mlp_acts_t *a, const mlp_weights_t *w, int T, int D, int F,
                  float *scratch) {
    if (T <= 0)
        return;
    size_t tf = (size_t)T * F;
    float *dh = scratch;  /* (T, F) */
    float *dg = dh + tf;  /* (T, F) */
    float *du = dg + tf;  /* (T, F) */
    float *tmp = du + tf; /* (T, R) */
    memset(scratch, 0, sizeof(float) * 3 * tf);
    proj_backward(k, dh, dy, a->h, a->xa_down, &w->down, w->lora_down, T, F, D, tmp);
    k->swiglu_backward(dg, du, dh, a->g, a->u, tf);
    proj_backward(k, dx, dg, x, a->xa_gate, &w->gate, w->lora_gate, T, D, F, tmp);
    proj_backward(k, dx, du, x, a->xa_up, &w->up, w->lora_up, T, D, F, tmp);
}
