/* Tests for moe/moe: the dispatch plan, the whole layer against a naive per-token
 * double-precision reference (softmax and sigmoid-grouped routers, shared experts, LoRA,
 * f32 and bf16 weights), finite-difference gradients of the input and of every adapter
 * with the selection held fixed (balance loss included), replay, idle experts, all
 * tokens on one expert, K = 1 and K = E, and determinism. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/status.h"
#include "moe/moe.h"
#include "tests/testutil.h"

enum { T = 7, D = 8, F = 6, MAXE = 8, MAXK = 8, MAXS = 2, NFLAT = 4096, MAXP = 40 };

static const kernels_t *K_(void) {
    return backend_cpu()->k;
}

/* One layer's parameters: stored base weights (f32 values of what is stored), their
 * views, a flat adapter buffer with its gradient, and the tables moe_forward reads. */
typedef struct fx {
    int E, K, n_shared;
    dtype_t dt;
    moe_cfg_t cfg;
    float wr[MAXE * D];
    float wg[MAXE][F * D], wu[MAXE][F * D], wd[MAXE][D * F];
    float sg[MAXS * F * D], su[MAXS * F * D], sd[D * MAXS * F];
    uint16_t b16[(3 * MAXE + 3 * MAXS + 1) * F * D + MAXE * D];
    size_t n16;
    wview_t vg[MAXE], vu[MAXE], vd[MAXE];
    float bias[MAXE];
    float flat[NFLAT], dflat[NFLAT];
    int nflat;
    lora_pair_t pairs[MAXP];
    int npairs;
    const lora_pair_t *lg[MAXE], *lu[MAXE], *ld[MAXE];
    moe_weights_t w;
} fx_t;

/* Stores n random values as dt; master receives the f32 value of what is stored. */
static wview_t store(fx_t *f, float *master, size_t n, uint64_t seed, float amp) {
    tu_fill(master, n, seed, -amp, amp);
    if (f->dt != DT_BF16)
        return wview_f32(master);
    uint16_t *b = f->b16 + f->n16;
    f->n16 += n;
    MO_ASSERT(f->n16 <= sizeof f->b16 / sizeof f->b16[0]);
    convert_from_f32(b, DT_BF16, master, n);
    convert_to_f32(master, b, DT_BF16, n);
    return wview_of(b, DT_BF16);
}

static const lora_pair_t *add_pair(fx_t *f, int R, int C, int OC, uint64_t seed) {
    MO_ASSERT(f->npairs < MAXP && f->nflat + R * C + OC * R <= NFLAT);
    lora_pair_t *p = &f->pairs[f->npairs++];
    p->A = f->flat + f->nflat;
    p->dA = f->dflat + f->nflat;
    f->nflat += R * C;
    p->B = f->flat + f->nflat;
    p->dB = f->dflat + f->nflat;
    f->nflat += OC * R;
    p->R = R;
    p->scale = 0.5f;
    tu_fill(p->A, (size_t)R * C, seed, -0.5f, 0.5f);
    tu_fill(p->B, (size_t)OC * R, seed + 1, -0.5f, 0.5f); /* non-zero B */
    return p;
}

/* kind: router kind; E, K; n_shared; adapters on experts 0 and 2 (all), 3 (down only)
 * and on the shared expert. */
static void fx_init(fx_t *f, router_kind_t kind, int E, int K, int n_shared, dtype_t dt,
                    uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->E = E;
    f->K = K;
    f->n_shared = n_shared;
    f->dt = dt;
    f->cfg.D = D;
    f->cfg.F = F;
    f->cfg.n_shared = n_shared;
    router_cfg_init(&f->cfg.router, kind, E, K);
    f->w.router = store(f, f->wr, (size_t)E * D, seed, 1.0f);
    for (int e = 0; e < E; e++) {
        f->vg[e] = store(f, f->wg[e], F * D, seed + 10 + e, 0.4f);
        f->vu[e] = store(f, f->wu[e], F * D, seed + 30 + e, 0.4f);
        f->vd[e] = store(f, f->wd[e], D * F, seed + 50 + e, 0.4f);
    }
    f->w.gate = f->vg;
    f->w.up = f->vu;
    f->w.down = f->vd;
    for (int e = 0; e < E; e++) {
        int all = e == 0 || e == 2;
        f->lg[e] = all ? add_pair(f, 2, D, F, seed + 100 + e) : NULL;
        f->lu[e] = all ? add_pair(f, 3, D, F, seed + 120 + e) : NULL;
        f->ld[e] = all || e == 3 ? add_pair(f, 2, F, D, seed + 140 + e) : NULL;
    }
    f->w.lora_gate = f->lg;
    f->w.lora_up = f->lu;
    f->w.lora_down = f->ld;
    if (n_shared > 0) {
        int Fs = n_shared * F;
        f->w.shared.gate = store(f, f->sg, (size_t)Fs * D, seed + 200, 0.4f);
        f->w.shared.up = store(f, f->su, (size_t)Fs * D, seed + 201, 0.4f);
        f->w.shared.down = store(f, f->sd, (size_t)D * Fs, seed + 202, 0.4f);
        f->w.shared.lora_gate = add_pair(f, 2, D, Fs, seed + 210);
        f->w.shared.lora_up = add_pair(f, 2, D, Fs, seed + 212);
        f->w.shared.lora_down = add_pair(f, 3, Fs, D, seed + 214);
    }
}

static void fx_sigmoid(fx_t *f, int n_group, int topk_group, uint64_t seed) {
    router_cfg_t *r = &f->cfg.router;
    tu_fill(f->bias, (size_t)f->E, seed, -0.3f, 0.3f);
    r->e_score_correction_bias = f->bias;
    r->n_group = n_group;
    r->topk_group = topk_group;
    r->norm_topk_prob = 1;
    r->routed_scaling_factor = 2.5f;
}

/* ---- naive per-token reference in double --------------------------------------------- */

typedef struct {
    double v;
    int i;
} kv_t;

static int kv_cmp(const void *a, const void *b) {
    const kv_t *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->i - y->i;
}

static void ref_topk(int *idx, const double *v, int n, int k) {
    kv_t a[MAXE];
    for (int i = 0; i < n; i++)
        a[i] = (kv_t){v[i], i};
    qsort(a, (size_t)n, sizeof a[0], kv_cmp);
    for (int i = 0; i < k; i++)
        idx[i] = a[i].i;
}

static void ref_route(const router_cfg_t *c, double *s, int *idx, double *w, const double *l,
                      const int32_t *fixed) {
    int E = c->E, K = c->K;
    int sig = c->kind == ROUTER_SIGMOID_GROUPED;
    double mx = l[0], z = 0;
    for (int e = 0; e < E; e++)
        mx = l[e] > mx ? l[e] : mx;
    for (int e = 0; e < E; e++)
        z += exp(l[e] - mx);
    for (int e = 0; e < E; e++)
        s[e] = sig ? 1.0 / (1.0 + exp(-l[e])) : exp(l[e] - mx) / z;
    if (fixed) {
        for (int i = 0; i < K; i++)
            idx[i] = fixed[i];
    } else {
        double ch[MAXE];
        for (int e = 0; e < E; e++)
            ch[e] = s[e] + (c->e_score_correction_bias ? c->e_score_correction_bias[e] : 0);
        if (sig && c->n_group > 1) {
            int G = c->n_group, gs = E / G, top[MAXE], keep[MAXE] = {0};
            double gsc[MAXE];
            for (int g = 0; g < G; g++) {
                int o[MAXE];
                ref_topk(o, ch + g * gs, gs, 2);
                gsc[g] = ch[g * gs + o[0]] + ch[g * gs + o[1]];
            }
            ref_topk(top, gsc, G, c->topk_group);
            for (int i = 0; i < c->topk_group; i++)
                keep[top[i]] = 1;
            for (int e = 0; e < E; e++)
                if (!keep[e / gs])
                    ch[e] = 0.0;
        }
        ref_topk(idx, ch, E, K);
    }
    double sum = 0;
    for (int i = 0; i < K; i++)
        sum += s[idx[i]];
    for (int i = 0; i < K; i++)
        w[i] = (c->norm_topk_prob ? s[idx[i]] / (sum + (sig ? 1e-20 : 0)) : s[idx[i]]) *
               c->routed_scaling_factor;
}

/* out (OC) = W in + scale B (A in), adapter values read from pd (the flat buffer in
 * double) at the pair's offset. */
static void ref_proj(double *out, const double *in, const float *W, const lora_pair_t *p,
                     const fx_t *f, const double *pd, int C, int OC) {
    for (int o = 0; o < OC; o++) {
        double acc = 0;
        for (int c = 0; c < C; c++)
            acc += (double)W[o * C + c] * in[c];
        out[o] = acc;
    }
    if (!p)
        return;
    const double *A = pd + (p->A - f->flat), *B = pd + (p->B - f->flat);
    for (int r = 0; r < p->R; r++) {
        double xa = 0;
        for (int c = 0; c < C; c++)
            xa += A[r * C + c] * in[c];
        for (int o = 0; o < OC; o++)
            out[o] += (double)p->scale * B[o * p->R + r] * xa;
    }
}

static void ref_mlp(double *y, const double *x, const float *wg, const float *wu, const float *wd,
                    const mlp_weights_t *m, const fx_t *f, const double *pd, int Fw) {
    double g[MAXS * F], u[MAXS * F], h[MAXS * F];
    ref_proj(g, x, wg, m->lora_gate, f, pd, D, Fw);
    ref_proj(u, x, wu, m->lora_up, f, pd, D, Fw);
    for (int i = 0; i < Fw; i++)
        h[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
    ref_proj(y, h, wd, m->lora_down, f, pd, Fw, D);
}

/* out (T, D) for input x; chosen (T, K) receives the selection (or fixed is used);
 * *aux the balance loss with the selection's counts. */
static void ref_layer(double *out, double *aux, int32_t *chosen, const fx_t *f, const double *x,
                      const double *pd, const int32_t *fixed) {
    const router_cfg_t *c = &f->cfg.router;
    int E = f->E, K = f->K;
    double P[MAXE] = {0};
    int64_t counts[MAXE] = {0};
    for (int t = 0; t < T; t++) {
        const double *xt = x + t * D;
        double l[MAXE], s[MAXE], w[MAXK], z = 0;
        int idx[MAXK];
        for (int e = 0; e < E; e++) {
            l[e] = 0;
            for (int d = 0; d < D; d++)
                l[e] += (double)f->wr[e * D + d] * xt[d];
        }
        ref_route(c, s, idx, w, l, fixed ? fixed + t * K : NULL);
        for (int e = 0; e < E; e++)
            z += s[e];
        for (int e = 0; e < E; e++)
            P[e] += (c->kind == ROUTER_SIGMOID_GROUPED ? s[e] / z : s[e]) / T;
        double *o = out + t * D;
        for (int d = 0; d < D; d++)
            o[d] = 0;
        for (int i = 0; i < K; i++) {
            int e = idx[i];
            if (chosen)
                chosen[t * K + i] = e;
            counts[e]++;
            mlp_weights_t m = moe_expert_weights(&f->w, e);
            double y[D];
            ref_mlp(y, xt, f->wg[e], f->wu[e], f->wd[e], &m, f, pd, F);
            for (int d = 0; d < D; d++)
                o[d] += w[i] * y[d];
        }
        if (f->n_shared > 0) {
            double y[D];
            ref_mlp(y, xt, f->sg, f->su, f->sd, &f->w.shared, f, pd, f->n_shared * F);
            for (int d = 0; d < D; d++)
                o[d] += y[d];
        }
    }
    double L = 0;
    for (int e = 0; e < E; e++)
        L += (double)counts[e] / ((double)T * K) * P[e];
    *aux = f->cfg.aux_coef * E * L;
}

static double ref_objective(const fx_t *f, const double *x, const double *pd, const int32_t *fixed,
                            const float *dout) {
    double out[T * D], aux;
    ref_layer(out, &aux, NULL, f, x, pd, fixed);
    double L = aux;
    for (int i = 0; i < T * D; i++)
        L += dout[i] * out[i];
    return L;
}

/* ---- checks ------------------------------------------------------------------------- */

/* Forward (natural routing or replay) against the reference: same selection, close
 * output, load statistics and balance loss. */
static void check_forward(fx_t *f, const int32_t *replay, const char *what) {
    float x[T * D], out[T * D];
    double xd[T * D], ref[T * D], aux;
    int32_t chosen[T * MAXK];
    tu_fill(x, T * D, 900, -1, 1);
    for (int i = 0; i < T * D; i++)
        xd[i] = x[i];
    double *pd = malloc(sizeof(double) * NFLAT);
    for (int i = 0; i < f->nflat; i++)
        pd[i] = f->flat[i];
    arena_t ar;
    arena_init(&ar, 0);
    moe_state_t st;
    tu_poison(out, T * D);
    int rc = moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, T, replay, DT_I32);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    ref_layer(ref, &aux, chosen, f, xd, pd, replay);
    CU_ASSERT(memcmp(chosen, st.idx, sizeof(int32_t) * T * f->K) == 0);
    TU_ASSERT_CLOSE(tu_rel_err_fd(out, ref, T * D, 1e-3), 2e-5, what);
    int64_t sum = 0, mx = 0;
    for (int e = 0; e < f->E; e++) {
        int64_t n = 0;
        for (int i = 0; i < T * f->K; i++)
            n += chosen[i] == e;
        CU_ASSERT_EQUAL(st.load[e], n);
        sum += n;
        mx = n > mx ? n : mx;
    }
    CU_ASSERT_EQUAL(sum, T * f->K);
    CU_ASSERT_DOUBLE_EQUAL(st.imbalance, (double)mx * f->E / (T * f->K), 1e-5);
    TU_ASSERT_CLOSE(fabs(st.aux_loss - aux) / (fabs(aux) + 1e-6), 1e-5, "balance loss");
    arena_free(&ar);
    free(pd);
}

/* Whole-layer gradient of sum(dout * out) + balance loss, selection held fixed to the
 * one the forward made: dx and every adapter's dA and dB against central differences. */
static void check_backward(fx_t *f, const int32_t *replay, const char *what) {
    float x[T * D], out[T * D], dout[T * D], dx[T * D], pre[T * D];
    double xd[T * D], fd[T * D];
    tu_fill(x, T * D, 901, -1, 1);
    tu_fill(dout, T * D, 902, -1, 1);
    tu_fill(pre, T * D, 903, -1, 1);
    for (int i = 0; i < T * D; i++)
        xd[i] = x[i];
    float *dpre = malloc(sizeof(float) * NFLAT), *got = malloc(sizeof(float) * NFLAT);
    double *pd = malloc(sizeof(double) * NFLAT), *fdp = malloc(sizeof(double) * NFLAT);
    for (int i = 0; i < f->nflat; i++)
        pd[i] = f->flat[i];
    tu_fill(dpre, (size_t)f->nflat, 904, -1, 1);
    memcpy(f->dflat, dpre, sizeof(float) * f->nflat);
    memcpy(dx, pre, sizeof dx);

    arena_t ar;
    arena_init(&ar, 0);
    moe_state_t st;
    CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, T, replay, DT_I32),
                          0);
    CU_ASSERT_EQUAL_FATAL(moe_backward(K_(), &ar, dx, dout, &st, &f->cfg, &f->w), 0);
    int32_t fixed[T * MAXK];
    memcpy(fixed, st.idx, sizeof(int32_t) * T * f->K);
    for (int i = 0; i < T * D; i++)
        dx[i] -= pre[i];
    for (int i = 0; i < f->nflat; i++)
        got[i] = f->dflat[i] - dpre[i];

    const double h = 1e-5;
    for (int i = 0; i < T * D; i++) {
        double x0 = xd[i];
        xd[i] = x0 + h;
        double up = ref_objective(f, xd, pd, fixed, dout);
        xd[i] = x0 - h;
        double dn = ref_objective(f, xd, pd, fixed, dout);
        xd[i] = x0;
        fd[i] = (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(dx, fd, T * D, 1e-2), 3e-5, what);
    for (int i = 0; i < f->nflat; i++) {
        double p0 = pd[i];
        pd[i] = p0 + h;
        double up = ref_objective(f, xd, pd, fixed, dout);
        pd[i] = p0 - h;
        double dn = ref_objective(f, xd, pd, fixed, dout);
        pd[i] = p0;
        fdp[i] = (up - dn) / (2 * h);
    }
    TU_ASSERT_CLOSE(tu_rel_err_fd(got, fdp, (size_t)f->nflat, 1e-2), 3e-5, "adapter gradients");
    arena_free(&ar);
    free(dpre);
    free(got);
    free(pd);
    free(fdp);
}

/* ---- tests -------------------------------------------------------------------------- */

static void test_dispatch_plan(void) {
    enum { TT = 5, KK = 2, EE = 4 };
    int32_t idx[TT * KK] = {2, 0, 0, 2, 3, 0, 2, 3, 0, 2};
    arena_t ar;
    arena_init(&ar, 0);
    moe_dispatch_t p;
    CU_ASSERT_EQUAL_FATAL(moe_dispatch_plan(&p, &ar, idx, TT, KK, EE), 0);
    int32_t off[EE + 1] = {0, 4, 4, 8, 10}; /* expert 1 has no rows */
    for (int e = 0; e <= EE; e++)
        CU_ASSERT_EQUAL(p.offsets[e], off[e]);
    int32_t rows[TT * KK] = {1, 2, 5, 8, 0, 3, 6, 9, 4, 7}; /* slots, stable by expert */
    for (int r = 0; r < TT * KK; r++) {
        CU_ASSERT_EQUAL(p.slot_of_row[r], rows[r]);
        CU_ASSERT_EQUAL(p.row_of_slot[p.slot_of_row[r]], r);
    }
    /* Gather, then combine with unit weights of a row-index signature. */
    float x[TT * 3], xg[TT * KK * 3], w[TT * KK], out[TT * 3], dx[TT * 3];
    tu_fill(x, TT * 3, 1, -1, 1);
    moe_dispatch_forward(xg, x, &p, 3);
    for (int r = 0; r < TT * KK; r++)
        CU_ASSERT(memcmp(xg + r * 3, x + (rows[r] / KK) * 3, sizeof(float) * 3) == 0);
    for (int s = 0; s < TT * KK; s++)
        w[s] = 0.5f;
    tu_poison(out, TT * 3);
    moe_combine_forward(out, xg, w, &p, 3);
    for (int i = 0; i < TT * 3; i++)
        CU_ASSERT_DOUBLE_EQUAL(out[i], x[i], 1e-7);
    memset(dx, 0, sizeof dx);
    moe_dispatch_backward(dx, xg, &p, 3);
    for (int i = 0; i < TT * 3; i++)
        CU_ASSERT_DOUBLE_EQUAL(dx[i], 2 * x[i], 1e-7);
    idx[3] = EE;
    CU_ASSERT_EQUAL(moe_dispatch_plan(&p, &ar, idx, TT, KK, EE), MO_EINVAL);
    arena_free(&ar);
}

static void test_forward_softmax(void) {
    fx_t *f = malloc(sizeof *f);
    for (int dt = 0; dt < 2; dt++) {
        fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 2, 0, dt ? DT_BF16 : DT_F32, 10);
        f->cfg.router.norm_topk_prob = 1;
        f->cfg.aux_coef = 0.01f;
        check_forward(f, NULL, dt ? "softmax bf16" : "softmax f32");
    }
    free(f);
}

static void test_forward_sigmoid_shared(void) {
    fx_t *f = malloc(sizeof *f);
    for (int dt = 0; dt < 2; dt++) {
        fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 3, 2, dt ? DT_BF16 : DT_F32, 20);
        fx_sigmoid(f, 4, 2, 21);
        check_forward(f, NULL, dt ? "sigmoid shared bf16" : "sigmoid shared f32");
    }
    free(f);
}

static void test_backward_softmax_aux(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 2, 1, DT_F32, 30);
    f->cfg.router.norm_topk_prob = 1;
    f->cfg.aux_coef = 0.3f;
    check_backward(f, NULL, "softmax + aux + shared dx");
    fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 2, 0, DT_BF16, 31);
    check_backward(f, NULL, "softmax unnormalised bf16 dx");
    free(f);
}

static void test_backward_sigmoid(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 3, 2, DT_F32, 40);
    fx_sigmoid(f, 4, 2, 41);
    check_backward(f, NULL, "sigmoid grouped + shared dx");
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 2, 1, DT_BF16, 42);
    fx_sigmoid(f, 4, 2, 43);
    f->cfg.router.norm_topk_prob = 0;
    f->cfg.aux_coef = 0.2f;
    check_backward(f, NULL, "sigmoid unnormalised + aux bf16 dx");
    free(f);
}

static void test_k1_and_ke(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 1, 0, DT_F32, 50);
    check_forward(f, NULL, "K = 1");
    check_backward(f, NULL, "K = 1 dx");
    fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 6, 1, DT_F32, 51);
    f->cfg.router.norm_topk_prob = 1;
    check_forward(f, NULL, "K = E");
    check_backward(f, NULL, "K = E dx");
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 8, 0, DT_F32, 52);
    fx_sigmoid(f, 4, 4, 53);
    check_forward(f, NULL, "sigmoid K = E");
    check_backward(f, NULL, "sigmoid K = E dx");
    free(f);
}

/* A large selection bias sends every token to expert 5 (natural routing, K = 1); the
 * other experts get no rows and are skipped. */
static void test_all_tokens_one_expert(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 1, 1, DT_F32, 60);
    fx_sigmoid(f, 4, 2, 61);
    f->bias[5] = 10.0f;
    check_forward(f, NULL, "all tokens to one expert");
    check_backward(f, NULL, "all tokens to one expert dx");
    float x[T * D], out[T * D];
    tu_fill(x, T * D, 62, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    moe_state_t st;
    CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, T, NULL, DT_I32), 0);
    for (int e = 0; e < 8; e++) {
        CU_ASSERT_EQUAL(st.load[e], e == 5 ? T : 0);
        CU_ASSERT_EQUAL(st.acts[e].g == NULL, e != 5);
    }
    CU_ASSERT_DOUBLE_EQUAL(st.imbalance, 8.0, 1e-6);
    arena_free(&ar);
    free(f);
}

/* Replay: the forward's own selection reproduces the output bit for bit; another
 * selection (with an idle expert) gives the reference output for that selection. */
static void test_replay(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 2, 1, DT_F32, 70);
    fx_sigmoid(f, 4, 2, 71);
    float x[T * D], out[T * D], out2[T * D];
    tu_fill(x, T * D, 900, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    moe_state_t st, st2;
    CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, T, NULL, DT_I32), 0);
    uint16_t u16[T * 2];
    for (int i = 0; i < T * 2; i++)
        u16[i] = (uint16_t)st.idx[i];
    tu_poison(out2, T * D);
    CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st2, out2, x, &f->cfg, &f->w, T, u16, DT_U16), 0);
    CU_ASSERT(memcmp(out, out2, sizeof out) == 0);

    int32_t other[T * 2];
    for (int t = 0; t < T; t++) {
        other[t * 2] = (int32_t)((t * 3) % 7); /* expert 7 gets nothing */
        other[t * 2 + 1] = (int32_t)((t * 3 + 2) % 7);
    }
    check_forward(f, other, "replayed other experts");
    check_backward(f, other, "replayed other experts dx");
    CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st2, out2, x, &f->cfg, &f->w, T, other, DT_I32),
                          0);
    CU_ASSERT(memcmp(out, out2, sizeof out) != 0);
    CU_ASSERT_EQUAL(st2.load[7], 0);

    other[3] = 8; /* out of range */
    CU_ASSERT_EQUAL(moe_forward(K_(), &ar, &st2, out2, x, &f->cfg, &f->w, T, other, DT_I32),
                    MO_EMALFORMED);
    arena_free(&ar);
    free(f);
}

static void test_deterministic(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SIGMOID_GROUPED, 8, 3, 2, DT_BF16, 80);
    fx_sigmoid(f, 4, 2, 81);
    f->cfg.aux_coef = 0.1f;
    float x[T * D], dout[T * D], o1[T * D], o2[T * D], d1[T * D], d2[T * D];
    float *g1 = malloc(sizeof(float) * NFLAT);
    tu_fill(x, T * D, 82, -1, 1);
    tu_fill(dout, T * D, 83, -1, 1);
    arena_t ar;
    arena_init(&ar, 0);
    for (int run = 0; run < 2; run++) {
        moe_state_t st;
        float *o = run ? o2 : o1, *d = run ? d2 : d1;
        memset(d, 0, sizeof d1);
        memset(f->dflat, 0, sizeof f->dflat);
        CU_ASSERT_EQUAL_FATAL(moe_forward(K_(), &ar, &st, o, x, &f->cfg, &f->w, T, NULL, DT_I32),
                              0);
        CU_ASSERT_EQUAL_FATAL(moe_backward(K_(), &ar, d, dout, &st, &f->cfg, &f->w), 0);
        if (run == 0)
            memcpy(g1, f->dflat, sizeof(float) * NFLAT);
        arena_reset(&ar);
    }
    CU_ASSERT(memcmp(o1, o2, sizeof o1) == 0);
    CU_ASSERT(memcmp(d1, d2, sizeof d1) == 0);
    CU_ASSERT(memcmp(g1, f->dflat, sizeof(float) * NFLAT) == 0);
    free(g1);
    arena_free(&ar);
    free(f);
}

static void test_config_and_empty(void) {
    fx_t *f = malloc(sizeof *f);
    fx_init(f, ROUTER_SOFTMAX_TOPK, 6, 2, 1, DT_F32, 90);
    float x[D], out[D];
    arena_t ar;
    arena_init(&ar, 0);
    moe_state_t st;
    CU_ASSERT_EQUAL(moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, 0, NULL, DT_I32), 0);
    CU_ASSERT_EQUAL(st.load[0], 0);
    CU_ASSERT_EQUAL(moe_backward(K_(), &ar, x, out, &st, &f->cfg, &f->w), 0);
    f->cfg.router.K = 7;
    CU_ASSERT_EQUAL(moe_forward(K_(), &ar, &st, out, x, &f->cfg, &f->w, 1, NULL, DT_I32),
                    MO_ECONFIG);
    f->cfg.router.K = 2;
    f->cfg.n_shared = -1;
    CU_ASSERT_EQUAL(moe_cfg_check(&f->cfg), MO_ECONFIG);
    arena_free(&ar);
    free(f);
}

/* At sizes where the token loops run in parallel, dispatch, combine and the router
 * backward give the same bits on 1 and 2 threads. */
static void test_parallel_loops_thread_independent(void) {
    enum { TT = 1024, KK = 4, EE = 16, DD = 64 };
    size_t S = (size_t)TT * KK;
    int32_t *idx = malloc(sizeof(int32_t) * S);
    float *x = malloc(sizeof(float) * TT * DD), *w = malloc(sizeof(float) * S);
    float *logits = malloc(sizeof(float) * TT * EE), *p = malloc(sizeof(float) * TT * EE);
    float *buf[2][5];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 5; j++)
            buf[r][j] = malloc(sizeof(float) * S * DD);
    tu_fill(x, (size_t)TT * DD, 1, -1, 1);
    tu_fill(logits, (size_t)TT * EE, 2, -3, 3);
    router_cfg_t rc;
    router_cfg_init(&rc, ROUTER_SOFTMAX_TOPK, EE, KK);
    rc.norm_topk_prob = 1;
    CU_ASSERT_EQUAL_FATAL(router_forward(K_(), &rc, idx, w, p, logits, TT), 0);
    arena_t ar;
    arena_init(&ar, 0);
    moe_dispatch_t plan;
    CU_ASSERT_EQUAL_FATAL(moe_dispatch_plan(&plan, &ar, idx, TT, KK, EE), 0);
    int64_t counts[EE];
    router_load_stats(counts, NULL, idx, TT, KK, EE);
    int saved = backend_cpu_threads();
    for (int r = 0; r < 2; r++) {
        backend_cpu_set_threads(r + 1);
        float *xg = buf[r][0], *out = buf[r][1], *dyg = buf[r][2], *dx = buf[r][3];
        float *misc = buf[r][4]; /* dweight (S), then dlogits (T, E) */
        moe_dispatch_forward(xg, x, &plan, DD);
        moe_combine_forward(out, xg, w, &plan, DD);
        memset(dyg, 0, sizeof(float) * S * DD);
        memset(misc, 0, sizeof(float) * S * DD);
        moe_combine_backward(dyg, misc, out, xg, w, &plan, DD);
        memset(dx, 0, sizeof(float) * TT * DD);
        moe_dispatch_backward(dx, dyg, &plan, DD);
        router_backward(&rc, misc + S, misc, idx, p, TT);
        router_aux_loss_backward(&rc, misc + S, 1.0f, counts, p, TT, 0.5f);
    }
    backend_cpu_set_threads(saved);
    CU_ASSERT(memcmp(buf[0][0], buf[1][0], sizeof(float) * S * DD) == 0);
    CU_ASSERT(memcmp(buf[0][1], buf[1][1], sizeof(float) * TT * DD) == 0);
    CU_ASSERT(memcmp(buf[0][2], buf[1][2], sizeof(float) * S * DD) == 0);
    CU_ASSERT(memcmp(buf[0][3], buf[1][3], sizeof(float) * TT * DD) == 0);
    CU_ASSERT(memcmp(buf[0][4], buf[1][4], sizeof(float) * (S + (size_t)TT * EE)) == 0);
    /* The combine of gathered inputs with weights summing to 1 returns the input. */
    TU_ASSERT_CLOSE(tu_rel_err_ff(buf[0][1], x, (size_t)TT * DD, 1.0), 1e-6, "combine");
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 5; j++)
            free(buf[r][j]);
    arena_free(&ar);
    free(idx);
    free(x);
    free(w);
    free(logits);
    free(p);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"dispatch plan, gather, combine", test_dispatch_plan},
        {"forward softmax vs per-token reference", test_forward_softmax},
        {"forward sigmoid grouped + shared vs reference", test_forward_sigmoid_shared},
        {"backward softmax + balance loss (finite differences)", test_backward_softmax_aux},
        {"backward sigmoid grouped + shared (finite differences)", test_backward_sigmoid},
        {"K = 1 and K = E", test_k1_and_ke},
        {"all tokens to one expert", test_all_tokens_one_expert},
        {"routing replay", test_replay},
        {"deterministic", test_deterministic},
        {"configuration errors and empty batch", test_config_and_empty},
        {"parallel loops independent of threads", test_parallel_loops_thread_independent},
        CU_TEST_INFO_NULL,
    };
    return tu_main("moe", tests);
}
