/* moe_ep: expert-parallel MoE layer: route locally, all-to-all to the experts' owners,
 * expert compute, all-to-all back, combine; and the backward. */
#include "moe/moe_ep.h"

#include <stdint.h>
#include <string.h>

#include "core/status.h"

/* Row copies below run in parallel above this many floats. */
#define MOE_EP_PAR_MIN 32768

int moe_ep_check(int E, int N) {
    if (N < 1)
        return mo_errorf(MO_ECONFIG, "moe_ep: the number of ranks must be >= 1, got %d", N);
    if (E < 1 || E % N != 0)
        return mo_errorf(MO_ECONFIG,
                         "moe_ep: E = %d routed experts cannot be split evenly over N = %d ranks "
                         "(E must be a positive multiple of N; use a rank count that divides %d)",
                         E, N, E);
    return MO_OK;
}

void moe_ep_experts(int E, int N, int rank, int *e0, int *n) {
    MO_ASSERT(N >= 1 && E % N == 0 && rank >= 0 && rank < N);
    *n = E / N;
    *e0 = rank * *n;
}

int moe_ep_owner(int E, int N, int e) {
    MO_ASSERT(N >= 1 && E % N == 0 && e >= 0 && e < E);
    return e / (E / N);
}

static size_t view_bytes(const wview_t *v, int rows, int cols) {
    size_t b = (size_t)rows * cols * dtype_size(v->dtype);
    if (v->scale && v->block > 0) {
        size_t br = ((size_t)rows + v->block - 1) / v->block;
        size_t bc = ((size_t)cols + v->block - 1) / v->block;
        b += br * bc * sizeof(float);
    }
    return b;
}

size_t moe_ep_expert_weight_bytes(const moe_cfg_t *c, const moe_weights_t *w, int e0, int n) {
    size_t b = 0;
    for (int e = e0; e < e0 + n; e++) {
        b += view_bytes(&w->gate[e], c->F, c->D);
        b += view_bytes(&w->up[e], c->F, c->D);
        b += view_bytes(&w->down[e], c->D, c->F);
    }
    return b;
}

static void *alloc_or_fail(arena_t *ar, size_t bytes, const char *what) {
    void *p = arena_alloc(ar, bytes);
    if (!p)
        mo_error_wrap(MO_ENOMEM, "moe_ep %s", what);
    return p;
}

#define ARENA_ARRAY(ptr, ar, n, what)                                                              \
    do {                                                                                           \
        (ptr) = alloc_or_fail((ar), sizeof(*(ptr)) * (size_t)(n), (what));                         \
        if (!(ptr))                                                                                \
            return MO_ENOMEM;                                                                      \
    } while (0)

/* ---- local routing ------------------------------------------------------------------ */

/* Router logits, routing (or replay), local load counts (into loc->load) and the plan. */
static int route_local(const kernels_t *k, arena_t *ar, moe_state_t *loc, const moe_cfg_t *c,
                       const moe_weights_t *w, const void *replay, dtype_t replay_dt) {
    const router_cfg_t *rc = &c->router;
    int T = loc->T, E = rc->E, K = rc->K;
    if (T < 0)
        return mo_errorf(MO_EINVAL, "moe_ep: T must be >= 0, got %d", T);
    ARENA_ARRAY(loc->logits, ar, (size_t)T * E, "router logits");
    ARENA_ARRAY(loc->probs, ar, (size_t)T * E, "router scores");
    ARENA_ARRAY(loc->idx, ar, (size_t)T * K, "routing");
    ARENA_ARRAY(loc->weight, ar, (size_t)T * K, "routing weights");
    ARENA_ARRAY(loc->load, ar, E, "load");
    if (T > 0)
        k->matmul_forward(loc->logits, loc->x, &w->router, NULL, T, c->D, E);
    if (replay)
        TRY(router_replay(k, rc, loc->idx, loc->weight, loc->probs, loc->logits, replay, replay_dt,
                          T));
    else
        TRY(router_forward(k, rc, loc->idx, loc->weight, loc->probs, loc->logits, T));
    router_load_stats(loc->load, NULL, loc->idx, T, K, E);
    return moe_dispatch_plan(&loc->plan, ar, loc->idx, T, K, E);
}

/* The balance loss's per-expert probability mass of this rank's tokens: sum over tokens
 * of s[t, e] / z_t (z_t = 1 for the softmax kinds, sum_e s[t, e] for sigmoid scores), as
 * router_aux_loss defines P_e (before dividing by the token count). */
static void prob_mass(double *mass, const moe_state_t *loc, const router_cfg_t *rc) {
    int E = rc->E;
    for (int e = 0; e < E; e++)
        mass[e] = 0.0;
    for (int t = 0; t < loc->T; t++) {
        const float *s = loc->probs + (size_t)t * E;
        double z = 1.0;
        if (rc->kind == ROUTER_SIGMOID_GROUPED) {
            z = 0.0;
            for (int e = 0; e < E; e++)
                z += s[e];
        }
        for (int e = 0; e < E; e++)
            mass[e] += s[e] / z;
    }
}

/* One all-reduce of [failed, T, counts (E), mass (E when the balance loss is on)] in f64
 * (exact for counts below 2^53): shares a local routing failure with every rank, and
 * turns load, imbalance and aux_loss into global-batch values. */
static int global_stats(comm_t *cm, arena_t *ar, moe_ep_state_t *st, const moe_cfg_t *c,
                        int local_rc) {
    moe_state_t *loc = &st->loc;
    int E = c->router.E, K = c->router.K, aux = c->aux_coef > 0.0f;
    size_t n = 2 + (size_t)E * (aux ? 2 : 1);
    double *v;
    ARENA_ARRAY(v, ar, n, "load statistics");
    memset(v, 0, sizeof(double) * n);
    if (local_rc < 0) {
        v[0] = 1.0;
    } else {
        v[1] = loc->T;
        for (int e = 0; e < E; e++)
            v[2 + e] = (double)loc->load[e];
        if (aux)
            prob_mass(v + 2 + E, loc, &c->router);
    }
    TRY(comm_allreduce_sum(cm, v, v, n, DT_F64));
    if (local_rc < 0)
        return local_rc;
    if (v[0] > 0.0)
        return mo_errorf(MO_ESTATE, "moe_ep: %d other rank(s) failed to route their tokens",
                         (int)v[0]);
    st->T_global = (int64_t)v[1];
    int64_t mx = 0;
    for (int e = 0; e < E; e++) {
        loc->load[e] = (int64_t)v[2 + e];
        mx = loc->load[e] > mx ? loc->load[e] : mx;
    }
    double slots = (double)st->T_global * K;
    loc->imbalance = slots > 0 ? (float)((double)mx * E / slots) : 0.0f;
    loc->aux_loss = 0.0f;
    if (aux && st->T_global > 0) {
        double L = 0.0;
        for (int e = 0; e < E; e++)
            L += (double)loc->load[e] / slots * v[2 + E + e];
        loc->aux_loss = (float)(c->aux_coef * (double)E * L / (double)st->T_global);
    }
    return MO_OK;
}

/* ---- the exchange plan -------------------------------------------------------------- */

/* Counts per owned expert from every source, the row blocks of both directions, and the
 * owner-side permutation that groups received rows by expert. */
static int exchange_plan(comm_t *cm, arena_t *ar, moe_ep_state_t *st, int D) {
    int N = st->N, n = st->n, E = N * n;
    const int32_t *off = st->loc.plan.offsets;
    int64_t *cnt, *nc, *nd;
    ARENA_ARRAY(cnt, ar, E, "count exchange");
    ARENA_ARRAY(nc, ar, N, "count exchange");
    ARENA_ARRAY(nd, ar, N, "count exchange");
    ARENA_ARRAY(st->split, ar, (size_t)N * n, "count exchange");
    for (int e = 0; e < E; e++)
        cnt[e] = off[e + 1] - off[e];
    for (int p = 0; p < N; p++) {
        nc[p] = n;
        nd[p] = (int64_t)p * n;
    }
    TRY(comm_alltoallv(cm, cnt, nc, nd, st->split, nc, nd, DT_I64));

    ARENA_ARRAY(st->send_counts, ar, N, "exchange blocks");
    ARENA_ARRAY(st->send_displs, ar, N, "exchange blocks");
    ARENA_ARRAY(st->recv_counts, ar, N, "exchange blocks");
    ARENA_ARRAY(st->recv_displs, ar, N, "exchange blocks");
    int64_t R = 0;
    for (int p = 0; p < N; p++) {
        st->send_counts[p] = (int64_t)(off[(p + 1) * n] - off[p * n]) * D;
        st->send_displs[p] = (int64_t)off[p * n] * D;
        int64_t rows = 0;
        for (int i = 0; i < n; i++)
            rows += st->split[(size_t)p * n + i];
        st->recv_displs[p] = R * D;
        st->recv_counts[p] = rows * D;
        R += rows;
    }
    if (R > INT32_MAX)
        return mo_errorf(MO_EINVAL, "moe_ep: rank %d receives %lld rows, above the int32 plan",
                         st->rank, (long long)R);
    st->R = (int)R;

    /* Expert i's rows: source 0's rows for it, then source 1's, ...; a cursor per source
     * walks that source's block, which is sorted by expert. */
    int64_t *cursor;
    ARENA_ARRAY(cursor, ar, N, "permutation cursors");
    ARENA_ARRAY(st->offsets, ar, n + 1, "owner offsets");
    ARENA_ARRAY(st->perm, ar, R, "owner permutation");
    for (int p = 0; p < N; p++)
        cursor[p] = st->recv_displs[p] / D;
    int32_t j = 0;
    for (int i = 0; i < n; i++) {
        st->offsets[i] = j;
        for (int p = 0; p < N; p++)
            for (int64_t q = 0; q < st->split[(size_t)p * n + i]; q++)
                st->perm[j++] = (int32_t)cursor[p]++;
    }
    st->offsets[n] = j;
    return MO_OK;
}

/* Sends src's blocks (sc, sd) and receives into dst's blocks (rc, rd), floats. */
static int exchange(comm_t *cm, float *dst, const int64_t *rc, const int64_t *rd, const float *src,
                    const int64_t *sc, const int64_t *sd) {
    return comm_alltoallv(cm, src, sc, sd, dst, rc, rd, DT_F32);
}

/* dst row j = src row perm[j] */
static void gather_rows(float *dst, const float *src, const int32_t *perm, int R, int D) {
#pragma omp parallel for schedule(static) if ((size_t)R * D > MOE_EP_PAR_MIN)
    for (int j = 0; j < R; j++)
        memcpy(dst + (size_t)j * D, src + (size_t)perm[j] * D, sizeof(float) * (size_t)D);
}

/* dst row perm[j] = src row j */
static void scatter_rows(float *dst, const float *src, const int32_t *perm, int R, int D) {
#pragma omp parallel for schedule(static) if ((size_t)R * D > MOE_EP_PAR_MIN)
    for (int j = 0; j < R; j++)
        memcpy(dst + (size_t)perm[j] * D, src + (size_t)j * D, sizeof(float) * (size_t)D);
}

static int check_comm(const comm_t *cm) {
    if (!cm)
        return mo_errorf(MO_EINVAL, "moe_ep: communicator is NULL");
    if (comm_device(cm) != DEV_CPU)
        return mo_errorf(MO_EUNSUPPORTED,
                         "moe_ep: the '%s' communicator's buffers are device memory; this layer "
                         "exchanges host rows (use the mpi or single backend)",
                         comm_backend_name(cm));
    return MO_OK;
}

/* ---- forward ------------------------------------------------------------------------ */

/* Owner side: received rows -> grouped by expert -> experts -> back into buf's layout. */
static int owner_forward(const kernels_t *k, arena_t *ar, moe_ep_state_t *st, float *buf,
                         const moe_cfg_t *c, const moe_weights_t *w) {
    int D = c->D;
    float *ye;
    ARENA_ARRAY(st->xe, ar, (size_t)st->R * D, "owner inputs");
    ARENA_ARRAY(ye, ar, (size_t)st->R * D, "owner outputs");
    ARENA_ARRAY(st->acts, ar, st->n, "owner activations");
    gather_rows(st->xe, buf, st->perm, st->R, D);
    TRY(moe_experts_forward(k, ar, ye, st->acts, st->xe, st->offsets, st->n, st->e0, w, D, c->F));
    scatter_rows(buf, ye, st->perm, st->R, D);
    return MO_OK;
}

static int shared_forward(const kernels_t *k, arena_t *ar, moe_state_t *loc, float *out,
                          const moe_cfg_t *c, const moe_weights_t *w) {
    int T = loc->T, D = c->D, Fs = c->n_shared * c->F;
    if (c->n_shared == 0 || T == 0)
        return MO_OK;
    float *ys;
    ARENA_ARRAY(ys, ar, (size_t)T * D, "shared expert output");
    TRY(mlp_acts_alloc(&loc->shared_acts, ar, &w->shared, T, Fs));
    mlp_forward(k, ys, &loc->shared_acts, loc->x, &w->shared, T, D, Fs);
    for (size_t i = 0; i < (size_t)T * D; i++)
        out[i] += ys[i];
    return MO_OK;
}

int moe_ep_forward(const kernels_t *k, arena_t *ar, comm_t *cm, moe_ep_state_t *st, float *out,
                   const float *x, const moe_cfg_t *c, const moe_weights_t *w, int T,
                   const void *replay, dtype_t replay_dt) {
    TRY(moe_cfg_check(c));
    TRY(check_comm(cm));
    int N = comm_size(cm), D = c->D, E = c->router.E;
    TRY(moe_ep_check(E, N));
    memset(st, 0, sizeof *st);
    st->N = N;
    st->rank = comm_rank(cm);
    moe_ep_experts(E, N, st->rank, &st->e0, &st->n);
    moe_state_t *loc = &st->loc;
    loc->T = T;
    loc->x = x;
    /* A local failure is not returned yet: the all-reduce tells every rank about it. */
    int rc = route_local(k, ar, loc, c, w, replay, replay_dt);
    TRY(global_stats(cm, ar, st, c, rc));

    size_t S = (size_t)T * c->router.K;
    ARENA_ARRAY(loc->xg, ar, S * D, "rows to send");
    ARENA_ARRAY(loc->yg, ar, S * D, "returned rows");
    moe_dispatch_forward(loc->xg, x, &loc->plan, D);
    TRY(exchange_plan(cm, ar, st, D));
    float *buf;
    ARENA_ARRAY(buf, ar, (size_t)st->R * D, "received rows");
    TRY(exchange(cm, buf, st->recv_counts, st->recv_displs, loc->xg, st->send_counts,
                 st->send_displs));
    TRY(owner_forward(k, ar, st, buf, c, w));
    TRY(exchange(cm, loc->yg, st->send_counts, st->send_displs, buf, st->recv_counts,
                 st->recv_displs));
    moe_combine_forward(out, loc->yg, loc->weight, &loc->plan, D);
    return shared_forward(k, ar, loc, out, c, w);
}

/* ---- backward ----------------------------------------------------------------------- */

/* Owner side: buf holds the output-row gradients in receive layout; on return it holds
 * the input-row gradients in the same layout. */
static int owner_backward(const kernels_t *k, arena_t *ar, const moe_ep_state_t *st, float *buf,
                          const moe_cfg_t *c, const moe_weights_t *w) {
    int D = c->D;
    size_t n = (size_t)st->R * D;
    float *dye, *dxe;
    ARENA_ARRAY(dye, ar, n, "owner output gradient");
    ARENA_ARRAY(dxe, ar, n, "owner input gradient");
    gather_rows(dye, buf, st->perm, st->R, D);
    memset(dxe, 0, sizeof(float) * n);
    TRY(moe_experts_backward(k, ar, dxe, dye, st->xe, st->acts, st->offsets, st->n, st->e0, w, D,
                             c->F));
    scatter_rows(buf, dxe, st->perm, st->R, D);
    return MO_OK;
}

static int shared_backward(const kernels_t *k, arena_t *ar, float *dx, const float *dout,
                           const moe_state_t *loc, const moe_cfg_t *c, const moe_weights_t *w) {
    int Fs = c->n_shared * c->F;
    if (c->n_shared == 0 || loc->T == 0)
        return MO_OK;
    float *scratch;
    ARENA_ARRAY(scratch, ar, mlp_backward_scratch_floats(&w->shared, loc->T, Fs),
                "shared expert backward scratch");
    mlp_backward(k, dx, dout, loc->x, &loc->shared_acts, &w->shared, loc->T, c->D, Fs, scratch);
    return MO_OK;
}

/* Router and balance-loss gradients of this rank's tokens into dx. */
static int router_grads(const kernels_t *k, arena_t *ar, float *dx, const float *dweight,
                        const moe_ep_state_t *st, const moe_cfg_t *c, const moe_weights_t *w) {
    const moe_state_t *loc = &st->loc;
    int T = loc->T, E = c->router.E;
    if (T == 0)
        return MO_OK;
    float *dlogits;
    ARENA_ARRAY(dlogits, ar, (size_t)T * E, "router logit gradient");
    memset(dlogits, 0, sizeof(float) * (size_t)T * E);
    router_backward(&c->router, dlogits, dweight, loc->idx, loc->probs, T);
    if (c->aux_coef > 0.0f) {
        /* router_aux_loss_backward normalises by the T it is given, twice (the slot
         * fraction and the mean probability); the global loss divides by T_global, so
         * the local share is the local gradient scaled by (T / T_global)^2. */
        double share = (double)T / (double)st->T_global;
        router_aux_loss_backward(&c->router, dlogits, (float)(share * share), loc->load, loc->probs,
                                 T, c->aux_coef);
    }
    k->matmul_backward(dx, w->drouter, NULL, dlogits, loc->x, &w->router, T, c->D, E);
    return MO_OK;
}

int moe_ep_backward(const kernels_t *k, arena_t *ar, comm_t *cm, float *dx, const float *dout,
                    const moe_ep_state_t *st, const moe_cfg_t *c, const moe_weights_t *w) {
    TRY(check_comm(cm));
    if (comm_size(cm) != st->N || comm_rank(cm) != st->rank)
        return mo_errorf(MO_EINVAL,
                         "moe_ep_backward: communicator is rank %d of %d, the forward ran as "
                         "rank %d of %d",
                         comm_rank(cm), comm_size(cm), st->rank, st->N);
    const moe_state_t *loc = &st->loc;
    int D = c->D;
    size_t S = (size_t)loc->T * c->router.K;
    TRY(shared_backward(k, ar, dx, dout, loc, c, w));
    float *dyg, *dweight, *dxg, *buf;
    ARENA_ARRAY(dyg, ar, S * D, "expert output gradient");
    ARENA_ARRAY(dweight, ar, S, "routing weight gradient");
    ARENA_ARRAY(dxg, ar, S * D, "gathered input gradient");
    ARENA_ARRAY(buf, ar, (size_t)st->R * D, "owner gradient rows");
    memset(dyg, 0, sizeof(float) * S * D);
    memset(dweight, 0, sizeof(float) * S);
    moe_combine_backward(dyg, dweight, dout, loc->yg, loc->weight, &loc->plan, D);
    TRY(exchange(cm, buf, st->recv_counts, st->recv_displs, dyg, st->send_counts, st->send_displs));
    TRY(owner_backward(k, ar, st, buf, c, w));
    TRY(exchange(cm, dxg, st->send_counts, st->send_displs, buf, st->recv_counts, st->recv_displs));
    moe_dispatch_backward(dx, dxg, &loc->plan, D);
    return router_grads(k, ar, dx, dweight, st, c, w);
}

/* ---- accounting and gradients ------------------------------------------------------- */

void moe_ep_traffic(moe_ep_traffic_t *t, const moe_ep_state_t *st, const moe_cfg_t *c) {
    int D = c->D, r = st->rank, N = st->N;
    memset(t, 0, sizeof *t);
    for (int p = 0; p < N; p++) {
        int64_t out = st->send_counts[p] / D, in = st->recv_counts[p] / D;
        if (p == r) {
            t->rows_local = out;
        } else {
            t->rows_out += out;
            t->rows_in += in;
        }
    }
    uint64_t row = (uint64_t)D * sizeof(float), cnt = (uint64_t)st->n * sizeof(int64_t);
    t->bytes_sent = 2 * (uint64_t)(t->rows_out + t->rows_in) * row + (uint64_t)(N - 1) * cnt;
    t->bytes_recv = t->bytes_sent;
    t->bytes_local = 4 * (uint64_t)t->rows_local * row + cnt;
    t->calls = 5;
}

int moe_ep_allreduce_grads(comm_t *cm, float *const *bufs, const size_t *counts, int n) {
    for (int i = 0; i < n; i++) {
        if (counts[i] == 0)
            continue;
        int rc = comm_allreduce_sum(cm, bufs[i], bufs[i], counts[i], DT_F32);
        if (rc < 0)
            return mo_error_wrap(rc, "moe_ep: gradient buffer %d of %d", i, n);
    }
    return MO_OK;
}

int moe_ep_allreduce_replicated(comm_t *cm, lora_adapter_t *ad) {
    if (!ad->grads)
        return mo_errorf(MO_EINVAL, "moe_ep: the adapter has no gradient buffer");
    size_t start = 0, end = 0; /* the pending run of replicated floats */
    /* The LoRA entries, then the full tensors (routers, norms: replicated, contiguous at
     * the end of the buffer) as one more run. */
    size_t full = ad->n_full > 0 ? ad->tensors[ad->n_tensors - ad->n_full].offset : 0;
    for (int i = 0; i <= ad->n_entries + 1; i++) {
        const lora_entry_t *en = i < ad->n_entries ? &ad->entries[i] : NULL;
        int is_full = i == ad->n_entries && ad->n_full > 0;
        int replicated = (en && en->kind != LORA_KIND_EXPERT) || is_full;
        size_t a = en ? en->off_A : is_full ? full : 0;
        size_t b = en ? en->off_B + (size_t)en->OC * en->R : is_full ? ad->n_params : 0;
        if (replicated && end > start && a == end) {
            end = b;
            continue;
        }
        if (end > start) {
            float *p = ad->grads + start;
            size_t cnt = end - start;
            TRY(moe_ep_allreduce_grads(cm, &p, &cnt, 1));
        }
        start = end = 0;
        if (replicated) {
            start = a;
            end = b;
        }
    }
    return MO_OK;
}
