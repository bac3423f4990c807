/* model_cuda_ep: the CUDA model's MoE layers expert-parallel over a communicator
 * (model_set_comm): moe/moe_ep.c's exchanges on the device's dispatch plan and grouped
 * expert blocks. Each rank routes its own tokens over all E experts and gathers the rows
 * by expert (so the rows for one owner are contiguous); the owners receive them, group
 * them by local expert, run their experts and send the outputs back; the backward sends
 * the output-row gradients the same way and the input-row gradients back. */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/comm.h"
#include "core/cuda/backend_cuda.h"
#include "core/status.h"

/* One MoE layer's exchange: where the rows go, and the owner side's buffers. Float counts
 * are rows times D. */
typedef struct ep_xchg {
    int64_t *sc, *sd; /* (N) floats of the local rows sent to each owner, and their start */
    int64_t *rc, *rd; /* (N) floats received from each source, and their start */
    int R;            /* rows received for the local experts */
    void *mem;        /* pool block: off, perm, inv, then xe and the experts' activations */
    size_t cap;
    /* The grouping as a one-slot-per-row plan over R rows: offsets (n + 1) the local
     * experts' rows, slot_of_row (R) = perm (row j of xe is row perm[j] as received),
     * row_of_slot (R) its inverse. */
    moe_cuda_plan_t grp;
    float *xe;            /* (R, D) the local experts' inputs, grouped by expert */
    moe_cuda_acts_t acts; /* (R, F) g, u, h; (R, R) adapter inputs where adapted */
} ep_xchg_t;

struct mc_ep {
    comm_t *cm;
    int N, rank, e0, n; /* ranks, this rank, its experts e0 .. e0 + n - 1 */
    int direct;         /* 1: the comm's buffers are the backend's memory (no staging) */
    int keep;           /* 1 while the training forward runs: each layer keeps its exchange */
    void *fmem;         /* pool block of zoff and roff */
    int32_t *zoff;      /* (E + 1) zeros: the plan offsets of a rank without tokens */
    int32_t *roff;      /* (N, n + 1) each source's plan offsets of the local experts */
    int32_t *hoff;      /* host (E + 1 + N (n + 1)): this rank's offsets, then roff */
    int64_t *ocnt;      /* host (3 N): counts, send and receive starts of the offsets */
    ep_xchg_t score;    /* the scoring forward's and decode's, used by every layer in turn */
    ep_xchg_t *kept;    /* (n_moe) the training forward's, read by its backward */
    void *tmem;         /* pool block of the temporaries below */
    size_t tcap;
    float *buf, *y, *dxe, *escr; /* (R, D) x 3 as received, grouped, input gradient; scratch */
    int32_t *hidx;               /* host staging of off, perm and inv */
    size_t hidx_cap;             /* its bytes */
    char *stage;                 /* host rows for a comm on host memory */
    size_t stage_cap;
};

/* ------------------------------------------------------------------------ */
/* Host index arithmetic.                                                    */

void mc_ep_range(const model_t *m, int *e0, int *n) {
    *e0 = m->ep_n > 0 ? m->ep_e0 : 0;
    *n = m->ep_n > 0 ? m->ep_n : m->E;
}

/* 0 when o (n + 1) is nondecreasing from a value >= 0. */
static int offsets_ok(const int32_t *o, int n) {
    if (o[0] < 0)
        return 0;
    for (int i = 0; i < n; i++)
        if (o[i + 1] < o[i])
            return 0;
    return 1;
}

int64_t mc_ep_counts(int N, int n, int D, const int32_t *own, const int32_t *src, int64_t *sc,
                     int64_t *sd, int64_t *rc, int64_t *rd) {
    if (own[0] != 0 || !offsets_ok(own, N * n))
        return mo_errorf(MO_EINVAL, "model_cuda_ep: this rank's dispatch offsets are not "
                                    "nondecreasing from 0");
    int64_t R = 0;
    for (int p = 0; p < N; p++) {
        const int32_t *o = src + (size_t)p * (n + 1);
        if (!offsets_ok(o, n))
            return mo_errorf(MO_EINVAL,
                             "model_cuda_ep: the dispatch offsets rank %d sent are not "
                             "nondecreasing from a value >= 0",
                             p);
        sc[p] = (int64_t)(own[(p + 1) * n] - own[p * n]) * D;
        sd[p] = (int64_t)own[p * n] * D;
        rc[p] = (int64_t)(o[n] - o[0]) * D;
        rd[p] = R * D;
        R += o[n] - o[0];
    }
    if (R > INT32_MAX)
        return mo_errorf(MO_EINVAL, "model_cuda_ep: %lld rows received, above the int32 plan",
                         (long long)R);
    return R;
}

void mc_ep_group(int N, int n, const int32_t *src, int32_t *off, int32_t *perm, int32_t *inv) {
    int32_t j = 0;
    for (int i = 0; i < n; i++) {
        off[i] = j;
        int32_t base = 0; /* the first row source p's block occupies as received */
        for (int p = 0; p < N; p++) {
            const int32_t *o = src + (size_t)p * (n + 1);
            for (int32_t q = o[i] - o[0]; q < o[i + 1] - o[0]; q++) {
                perm[j] = base + q;
                inv[base + q] = j;
                j++;
            }
            base += o[n] - o[0];
        }
    }
    off[n] = j;
}

/* ------------------------------------------------------------------------ */
/* Buffers.                                                                  */

/* *mem (a pool block of *cap bytes) holds at least need bytes (contents not kept). */
static int dev_ready(const backend_t *be, void **mem, size_t *cap, size_t need) {
    if (need <= *cap)
        return MO_OK;
    if (*mem)
        be->free(be, *mem);
    *mem = NULL;
    *cap = 0;
    TRY(be->alloc(be, mem, need));
    *cap = need;
    return MO_OK;
}

static int host_ready(void **mem, size_t *cap, size_t need) {
    if (need <= *cap)
        return MO_OK;
    free(*mem);
    *cap = 0;
    *mem = malloc(need > 0 ? need : 1);
    if (!*mem)
        return mo_errorf(MO_ENOMEM, "model_cuda_ep: %zu bytes of host staging", need);
    *cap = need;
    return MO_OK;
}

/* Carves x's buffers for x->R rows of layer ly from base (NULL: only measures). */
static size_t xchg_layout(const model_cuda_t *mc, ep_xchg_t *x, const mc_layer_t *ly, char *base) {
    mc_bump_t b = {base, 0};
    size_t R = (size_t)x->R, n = (size_t)mc->ep->n, F = (size_t)ly->F;
    size_t r = (size_t)(mc->R > 0 ? mc->R : 1);
    int32_t *idx;
    MC_BUMP(idx, &b, n + 1 + 2 * R); /* one copy fills them */
    MC_BUMP(x->xe, &b, R * mc->D);
    MC_BUMP(x->acts.g, &b, R * F);
    MC_BUMP(x->acts.u, &b, R * F);
    MC_BUMP(x->acts.h, &b, R * F);
    MC_BUMP(x->acts.xa_gate, &b, R * r);
    MC_BUMP(x->acts.xa_up, &b, R * r);
    MC_BUMP(x->acts.xa_down, &b, R * r);
    x->grp.T = x->R;
    x->grp.K = 1;
    x->grp.E = mc->ep->n;
    x->grp.offsets = idx;
    x->grp.slot_of_row = idx ? idx + n + 1 : NULL;
    x->grp.row_of_slot = idx ? idx + n + 1 + R : NULL;
    x->grp.bad = NULL;
    x->grp.mem = base;
    return b.off;
}

/* The temporaries for R rows of layer ly. */
static size_t temps_layout(const model_cuda_t *mc, const mc_layer_t *ly, int R, char *base) {
    mc_ep_t *ep = mc->ep;
    mc_bump_t b = {base, 0};
    size_t RD = (size_t)R * mc->D;
    MC_BUMP(ep->buf, &b, RD);
    MC_BUMP(ep->y, &b, RD);
    MC_BUMP(ep->dxe, &b, RD);
    MC_BUMP(ep->escr, &b, moe_cuda_experts_backward_scratch_floats(&ly->ex, R, ly->F));
    return b.off;
}

static int temps_ready(const model_cuda_t *mc, const mc_layer_t *ly, int R) {
    mc_ep_t *ep = mc->ep;
    TRY(dev_ready(mc->be, &ep->tmem, &ep->tcap, temps_layout(mc, ly, R, NULL)));
    temps_layout(mc, ly, R, ep->tmem);
    return MO_OK;
}

/* x's buffers for its R rows, and its grouping (from ep->hoff) on the device. */
static int xchg_ready(const model_cuda_t *mc, ep_xchg_t *x, const mc_layer_t *ly) {
    mc_ep_t *ep = mc->ep;
    const backend_t *be = mc->be;
    int N = ep->N, n = ep->n;
    TRY(dev_ready(be, &x->mem, &x->cap, xchg_layout(mc, x, ly, NULL)));
    xchg_layout(mc, x, ly, x->mem);
    size_t ni = (size_t)n + 1 + 2 * (size_t)x->R;
    TRY(host_ready((void **)&ep->hidx, &ep->hidx_cap, ni * sizeof(int32_t)));
    int32_t *h = ep->hidx;
    mc_ep_group(N, n, ep->hoff + (size_t)N * n + 1, h, h + n + 1, h + n + 1 + x->R);
    TRY(be->copy(be, x->grp.offsets, DEV_CUDA, h, DEV_CPU, ni * sizeof(int32_t)));
    return temps_ready(mc, ly, x->R);
}

/* ------------------------------------------------------------------------ */
/* Exchanges.                                                                */

/* Elements from 0 to the end of the last block of (counts, displs) (N). */
static size_t extent(const int64_t *counts, const int64_t *displs, int N) {
    int64_t e = 0;
    for (int p = 0; p < N; p++)
        if (counts[p] > 0 && displs[p] + counts[p] > e)
            e = displs[p] + counts[p];
    return (size_t)e;
}

/* comm_alltoallv of send and recv in the backend's memory (elements of dt): straight for a
 * comm on that memory, else through host staging (the receive blocks cover their extent
 * without gaps, as every exchange here lays them out). */
static int xchg(const model_cuda_t *mc, void *recv, const int64_t *rc, const int64_t *rd,
                const void *send, const int64_t *sc, const int64_t *sd, dtype_t dt) {
    mc_ep_t *ep = mc->ep;
    const backend_t *be = mc->be;
    if (ep->direct) {
        comm_set_stream(ep->cm, backend_cuda_stream()); /* in order with the backend's work */
        return comm_alltoallv(ep->cm, send, sc, sd, recv, rc, rd, dt);
    }
    size_t es = dtype_size(dt), ns = extent(sc, sd, ep->N) * es, nr = extent(rc, rd, ep->N) * es;
    TRY(host_ready((void **)&ep->stage, &ep->stage_cap, ns + nr));
    if (ns > 0)
        TRY(be->copy(be, ep->stage, DEV_CPU, send, DEV_CUDA, ns));
    TRY(comm_alltoallv(ep->cm, ep->stage, sc, sd, ep->stage + ns, rc, rd, dt));
    return nr > 0 ? be->copy(be, recv, DEV_CUDA, ep->stage + ns, DEV_CPU, nr) : MO_OK;
}

/* Each source's dispatch offsets of the local experts into ep->roff from own (E + 1,
 * device), both to the host (the layer's one wait for the stream), and x's counts. */
static int plan_exchange(const model_cuda_t *mc, ep_xchg_t *x, const int32_t *own) {
    mc_ep_t *ep = mc->ep;
    const backend_t *be = mc->be;
    int N = ep->N, n = ep->n, E = N * n;
    const int64_t *oc = ep->ocnt, *osd = oc + N, *ord = osd + N;
    TRY(xchg(mc, ep->roff, oc, ord, own, oc, osd, DT_I32));
    TRY(be->copy(be, ep->hoff, DEV_CPU, own, DEV_CUDA, sizeof(int32_t) * ((size_t)E + 1)));
    TRY(be->copy(be, ep->hoff + E + 1, DEV_CPU, ep->roff, DEV_CUDA,
                 sizeof(int32_t) * (size_t)N * (n + 1)));
    int64_t R = mc_ep_counts(N, n, mc->D, ep->hoff, ep->hoff + E + 1, x->sc, x->sd, x->rc, x->rd);
    if (R < 0)
        return (int)R;
    x->R = (int)R;
    return MO_OK;
}

/* The grouping plan read backwards: row i as received is row inv[i] of the grouped rows. */
static moe_cuda_plan_t ungroup(const ep_xchg_t *x) {
    moe_cuda_plan_t p = x->grp;
    p.slot_of_row = x->grp.row_of_slot;
    p.row_of_slot = x->grp.slot_of_row;
    return p;
}

static moe_cuda_acts_t acts_for(const ep_xchg_t *x, const moe_cuda_experts_t *w) {
    moe_cuda_acts_t a = x->acts;
    a.xa_gate = w->lora_gate.A ? a.xa_gate : NULL;
    a.xa_up = w->lora_up.A ? a.xa_up : NULL;
    a.xa_down = w->lora_down.A ? a.xa_down : NULL;
    return a;
}

/* ------------------------------------------------------------------------ */
/* The layer.                                                                */

int mc_ep_experts_forward(model_cuda_t *mc, const mc_layer_t *ly, float *yg, const float *xg,
                          const int32_t *offsets, int ad) {
    mc_ep_t *ep = mc->ep;
    int D = mc->D;
    ep_xchg_t *x = ep->keep ? &ep->kept[ly->moe_index] : &ep->score;
    TRY(plan_exchange(mc, x, offsets ? offsets : ep->zoff));
    TRY(xchg_ready(mc, x, ly));
    TRY(xchg(mc, ep->buf, x->rc, x->rd, xg, x->sc, x->sd, DT_F32));
    TRY(moe_cuda_dispatch_forward(x->xe, ep->buf, &x->grp, D));
    moe_cuda_experts_t w = mc_experts_of(ly, ad);
    moe_cuda_acts_t a = acts_for(x, &w);
    TRY(moe_cuda_experts_forward(ep->y, &a, x->xe, x->grp.offsets, ep->n, x->R, &w, D, ly->F));
    moe_cuda_plan_t back = ungroup(x);
    TRY(moe_cuda_dispatch_forward(ep->buf, ep->y, &back, D));
    return xchg(mc, yg, x->sc, x->sd, ep->buf, x->rc, x->rd, DT_F32);
}

int mc_ep_experts_backward(const model_cuda_t *mc, const mc_layer_t *ly, float *dxg,
                           const float *dyg) {
    mc_ep_t *ep = mc->ep;
    int D = mc->D;
    const ep_xchg_t *x = &ep->kept[ly->moe_index];
    TRY(temps_ready(mc, ly, x->R));
    TRY(xchg(mc, ep->buf, x->rc, x->rd, dyg, x->sc, x->sd, DT_F32));
    TRY(moe_cuda_dispatch_forward(ep->y, ep->buf, &x->grp, D));
    if (x->R > 0)
        TRY(mc->be->memset_zero(mc->be, ep->dxe, sizeof(float) * (size_t)x->R * D));
    moe_cuda_acts_t a = acts_for(x, &ly->ex);
    TRY(moe_cuda_experts_backward(ep->dxe, ep->y, x->xe, &a, x->grp.offsets, ep->n, x->R, &ly->ex,
                                  D, ly->F, ep->escr));
    moe_cuda_plan_t back = ungroup(x);
    TRY(moe_cuda_dispatch_forward(ep->buf, ep->dxe, &back, D));
    return xchg(mc, dxg, x->sc, x->sd, ep->buf, x->rc, x->rd, DT_F32);
}

int mc_ep_empty_forward(model_cuda_t *mc, int ad) {
    for (int l = 0; l < mc->L; l++) {
        const mc_layer_t *ly = &mc->layers[l];
        if (!ly->moe)
            continue;
        int rc = mc_ep_experts_forward(mc, ly, NULL, NULL, NULL, ad);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d", l);
    }
    return mc->be->synchronize(mc->be);
}

int mc_ep_empty_backward(const model_cuda_t *mc) {
    for (int l = mc->L - 1; l >= 0; l--) {
        const mc_layer_t *ly = &mc->layers[l];
        if (!ly->moe)
            continue;
        int rc = mc_ep_experts_backward(mc, ly, NULL, NULL);
        if (rc < 0)
            return mo_error_wrap(rc, "layer %d backward", l);
    }
    return MO_OK;
}

void mc_ep_keep(model_cuda_t *mc, int keep) {
    if (mc->ep)
        mc->ep->keep = keep;
}

/* ------------------------------------------------------------------------ */
/* Life cycle.                                                               */

static int xchg_init(ep_xchg_t *x, int N) {
    x->sc = calloc(4 * (size_t)N, sizeof(int64_t));
    if (!x->sc)
        return mo_errorf(MO_ENOMEM, "model_cuda_ep: exchange counts");
    x->sd = x->sc + N;
    x->rc = x->sd + N;
    x->rd = x->rc + N;
    return MO_OK;
}

static void xchg_free(const backend_t *be, ep_xchg_t *x) {
    if (x->mem)
        be->free(be, x->mem);
    free(x->sc);
    memset(x, 0, sizeof *x);
}

/* The fixed buffers: zoff, roff, hoff, the offsets exchange's counts, every layer's
 * exchange counts. */
static int ep_buffers(model_cuda_t *mc, mc_ep_t *ep) {
    int N = ep->N, n = ep->n, E = mc->E;
    size_t nz = (size_t)E + 1, nr = (size_t)N * (n + 1);
    TRY(mc->be->alloc(mc->be, &ep->fmem, sizeof(int32_t) * (nz + nr)));
    ep->zoff = ep->fmem;
    ep->roff = ep->zoff + nz;
    TRY(mc->be->memset_zero(mc->be, ep->zoff, sizeof(int32_t) * nz));
    ep->hoff = malloc(sizeof(int32_t) * (nz + nr));
    ep->ocnt = malloc(sizeof(int64_t) * 3 * (size_t)N);
    ep->kept = calloc((size_t)mc->n_moe, sizeof *ep->kept);
    if (!ep->hoff || !ep->ocnt || !ep->kept)
        return mo_errorf(MO_ENOMEM, "model_cuda_ep: exchange state");
    for (int p = 0; p < N; p++) {
        ep->ocnt[p] = n + 1;                        /* offsets e0_p .. e0_p + n */
        ep->ocnt[N + p] = (int64_t)p * n;           /* from own[p n] */
        ep->ocnt[2 * N + p] = (int64_t)p * (n + 1); /* into roff[p] */
    }
    TRY(xchg_init(&ep->score, N));
    for (int i = 0; i < mc->n_moe; i++)
        TRY(xchg_init(&ep->kept[i], N));
    return MO_OK;
}

/* The communicator's ranks against the experts the model holds. */
static int ep_check(const model_t *m, const comm_t *cm, int e0, int n) {
    int N = comm_size(cm), r = comm_rank(cm);
    if (n * N != m->E || e0 != r * n)
        return mo_errorf(MO_ECONFIG,
                         "model_cuda: the model holds experts %d .. %d of %d, but rank %d "
                         "of %d owns experts %d .. %d (model_set_comm splits them)",
                         e0, e0 + n - 1, m->E, r, N, r * (m->E / N), (r + 1) * (m->E / N) - 1);
    return MO_OK;
}

int mc_ep_init(model_cuda_t *mc) {
    const model_t *m = mc->m;
    comm_t *cm = m->device_comm ? m->device_comm : m->comm;
    if (!cm || mc->n_moe == 0)
        return MO_OK;
    int e0, n;
    mc_ep_range(m, &e0, &n);
    TRY(ep_check(m, cm, e0, n));
    mc_ep_t *ep = calloc(1, sizeof *ep);
    if (!ep)
        return mo_errorf(MO_ENOMEM, "model_cuda_ep: state");
    mc->ep = ep;
    ep->cm = cm;
    ep->N = comm_size(cm);
    ep->rank = comm_rank(cm);
    ep->e0 = e0;
    ep->n = n;
    ep->direct = comm_device(cm) == mc->be->device;
    return ep_buffers(mc, ep);
}

void mc_ep_free(model_cuda_t *mc) {
    mc_ep_t *ep = mc->ep;
    if (!ep)
        return;
    const backend_t *be = mc->be;
    xchg_free(be, &ep->score);
    for (int i = 0; ep->kept && i < mc->n_moe; i++)
        xchg_free(be, &ep->kept[i]);
    if (ep->fmem)
        be->free(be, ep->fmem);
    if (ep->tmem)
        be->free(be, ep->tmem);
    free(ep->kept);
    free(ep->hoff);
    free(ep->ocnt);
    free(ep->hidx);
    free(ep->stage);
    free(ep);
    mc->ep = NULL;
}

#endif /* MOERL_HAVE_CUDA */
