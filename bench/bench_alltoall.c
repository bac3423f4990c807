/* bench_alltoall: the expert-parallel MoE layer's all-to-all traffic and time per training
 * step (forward and backward of one layer) under mpirun, with the bytes counted by
 * comm_stats against their formula and the expert weight bytes each rank holds.
 *
 * usage: mpirun -np 2 bench_alltoall [--tokens T] [--dim D] [--hidden F] [--experts E]
 *                                    [--topk K] [--steps S] [--warmup W] [--threads N]
 *   T tokens per rank (default 1024), D 512, F 256, E 8, K 2, S 10 timed steps after W 2
 *   warm-up steps, N 1 CPU thread per rank. Expert weights are bf16 and each rank stores
 *   only its own experts; the router is softmax top-K with norm_topk_prob, no shared
 *   expert, LoRA rank 8 on every owned expert's projections.
 *
 * As root in a container (see docs/parallelism.md for why each setting):
 *   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
 *   OMPI_MCA_pml=ob1 OMPI_MCA_plm=isolated OMPI_MCA_btl_vader_single_copy_mechanism=none \
 *   mpirun -np 2 --oversubscribe --bind-to none build/bench/bench_alltoall
 *
 * Reported per step: the all-to-all bytes every rank sent (comm_stats, all ranks summed)
 * against tokens x K x D x 4 B x 2 directions x 2 passes minus the rows that stay on
 * their rank, plus the per-expert count exchange; the step time (slowest rank); and the
 * time of the four row exchanges alone, replayed with the step's counts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/backend.h"
#include "core/comm.h"
#include "core/rng.h"
#include "core/status.h"
#include "moe/moe_ep.h"

typedef struct args {
    int T, D, F, E, K, steps, warmup, threads;
} args_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_args(args_t *a, int argc, char **argv) {
    *a = (args_t){1024, 512, 256, 8, 2, 10, 2, 1};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (i + 1 >= argc)
            return -1;
        const char *v = argv[++i];
        int *n = !strcmp(o, "--tokens")    ? &a->T
                 : !strcmp(o, "--dim")     ? &a->D
                 : !strcmp(o, "--hidden")  ? &a->F
                 : !strcmp(o, "--experts") ? &a->E
                 : !strcmp(o, "--topk")    ? &a->K
                 : !strcmp(o, "--steps")   ? &a->steps
                 : !strcmp(o, "--warmup")  ? &a->warmup
                 : !strcmp(o, "--threads") ? &a->threads
                                           : NULL;
        if (!n)
            return -1;
        char *end;
        long x = strtol(v, &end, 10);
        if (*end || x < 0 || x > (1 << 24))
            return -1;
        *n = (int)x;
    }
    if (a->T < 0 || a->D < 1 || a->F < 1 || a->E < 1 || a->K < 1 || a->K > a->E || a->steps < 1)
        return -1;
    return 0;
}

/* The layer's weights on this rank: router (E, D) in f32, the owned experts in bf16,
 * LoRA (R = 8) on each owned projection. */
typedef struct bench_layer {
    moe_cfg_t cfg;
    moe_weights_t w;
    float *router;             /* (E, D) */
    uint16_t *experts;         /* (n, 3, F * D) owned experts only */
    wview_t *gate, *up, *down; /* (E) views; other ranks' entries empty */
    float *lora;               /* A, B, dA, dB of every owned projection */
    lora_pair_t *pairs;        /* (3 n) */
    const lora_pair_t **tabs;  /* (3, E) */
} bench_layer_t;

enum { LORA_R = 8 };

static int layer_build(bench_layer_t *L, const args_t *a, int e0, int n) {
    memset(L, 0, sizeof *L);
    int D = a->D, F = a->F, E = a->E;
    L->cfg.D = D;
    L->cfg.F = F;
    router_cfg_init(&L->cfg.router, ROUTER_SOFTMAX_TOPK, E, a->K);
    L->cfg.router.norm_topk_prob = 1;
    size_t fd = (size_t)F * D, per_pair = 2 * (size_t)LORA_R * (D + F);
    L->router = malloc(sizeof(float) * (size_t)E * D);
    L->experts = malloc(sizeof(uint16_t) * 3 * fd * (size_t)(n > 0 ? n : 1));
    L->gate = calloc((size_t)E, sizeof(wview_t));
    L->up = calloc((size_t)E, sizeof(wview_t));
    L->down = calloc((size_t)E, sizeof(wview_t));
    L->lora = malloc(sizeof(float) * 3 * per_pair * (size_t)(n > 0 ? n : 1));
    L->pairs = calloc(3 * (size_t)(n > 0 ? n : 1), sizeof(lora_pair_t));
    L->tabs = calloc(3 * (size_t)E, sizeof(lora_pair_t *));
    float *tmp = malloc(sizeof(float) * fd);
    if (!L->router || !L->experts || !L->gate || !L->up || !L->down || !L->lora || !L->pairs ||
        !L->tabs || !tmp) {
        free(tmp);
        return mo_errorf(MO_ENOMEM, "bench_alltoall: cannot allocate the layer");
    }
    rng_fill_uniform(L->router, (size_t)E * D, 1, 0, -1.0f, 1.0f);
    float *lp = L->lora;
    for (int i = 0; i < n; i++) {
        for (int p = 0; p < 3; p++) {
            uint16_t *dst = L->experts + ((size_t)i * 3 + p) * fd;
            rng_fill_uniform(tmp, fd, 2, (uint64_t)(e0 + i) * 3 + p, -0.05f, 0.05f);
            convert_from_f32(dst, DT_BF16, tmp, fd);
            wview_t *v = p == 0 ? L->gate : p == 1 ? L->up : L->down;
            v[e0 + i] = wview_of(dst, DT_BF16);
            int C = p == 2 ? F : D, OC = p == 2 ? D : F;
            lora_pair_t *q = &L->pairs[i * 3 + p];
            q->R = LORA_R;
            q->scale = 2.0f;
            q->A = lp, lp += (size_t)LORA_R * C;
            q->B = lp, lp += (size_t)OC * LORA_R;
            q->dA = lp, lp += (size_t)LORA_R * C;
            q->dB = lp, lp += (size_t)OC * LORA_R;
            rng_fill_uniform(q->A, (size_t)LORA_R * C, 3, (uint64_t)(e0 + i) * 3 + p, -0.05f,
                             0.05f);
            rng_fill_uniform(q->B, (size_t)OC * LORA_R, 4, (uint64_t)(e0 + i) * 3 + p, -0.05f,
                             0.05f);
            memset(q->dA, 0, sizeof(float) * (size_t)LORA_R * C);
            memset(q->dB, 0, sizeof(float) * (size_t)OC * LORA_R);
            L->tabs[(size_t)p * E + e0 + i] = q;
        }
    }
    free(tmp);
    L->w.router = wview_f32(L->router);
    L->w.gate = L->gate;
    L->w.up = L->up;
    L->w.down = L->down;
    L->w.lora_gate = L->tabs;
    L->w.lora_up = L->tabs + E;
    L->w.lora_down = L->tabs + 2 * (size_t)E;
    return MO_OK;
}

static void layer_free(bench_layer_t *L) {
    free(L->router), free(L->experts), free(L->gate), free(L->up), free(L->down);
    free(L->lora), free(L->pairs), free(L->tabs);
}

/* One forward and backward; *traffic receives the step's expected counters. */
static int step(const bench_layer_t *L, comm_t *cm, arena_t *ar, const float *x, const float *dout,
                float *out, float *dx, int T, moe_ep_traffic_t *traffic, moe_ep_state_t *st) {
    const kernels_t *k = backend_cpu()->k;
    arena_reset(ar);
    memset(dx, 0, sizeof(float) * (size_t)T * L->cfg.D);
    TRY(moe_ep_forward(k, ar, cm, st, out, x, &L->cfg, &L->w, T, NULL, DT_I32));
    TRY(moe_ep_backward(k, ar, cm, dx, dout, st, &L->cfg, &L->w));
    moe_ep_traffic(traffic, st, &L->cfg);
    return MO_OK;
}

/* The four row exchanges of a step alone, with the step's counts (st lives in ar). */
static int exchanges_only(comm_t *cm, const moe_ep_state_t *st, float *a, float *b) {
    for (int i = 0; i < 2; i++) {
        TRY(comm_alltoallv(cm, a, st->send_counts, st->send_displs, b, st->recv_counts,
                           st->recv_displs, DT_F32));
        TRY(comm_alltoallv(cm, b, st->recv_counts, st->recv_displs, a, st->send_counts,
                           st->send_displs, DT_F32));
    }
    return MO_OK;
}

/* The largest v over the ranks: each rank puts v in its own slot of a summed vector. */
static double max_over_ranks(comm_t *cm, double v) {
    int N = comm_size(cm);
    double *all = calloc((size_t)N, sizeof(double)), mx = v;
    if (!all)
        return mx;
    all[comm_rank(cm)] = v;
    if (comm_allreduce_sum(cm, all, all, (size_t)N, DT_F64) == 0)
        for (int r = 0; r < N; r++)
            mx = all[r] > mx ? all[r] : mx;
    free(all);
    return mx;
}

static int run(comm_t *cm, const args_t *a) {
    int N = comm_size(cm), rank = comm_rank(cm), e0, n;
    TRY(moe_ep_check(a->E, N));
    moe_ep_experts(a->E, N, rank, &e0, &n);
    backend_cpu_set_threads(a->threads);
    bench_layer_t L;
    TRY(layer_build(&L, a, e0, n));
    size_t td = (size_t)a->T * a->D, sd = td * (size_t)a->K;
    float *x = malloc(sizeof(float) * (td ? td : 1)), *dout = malloc(sizeof(float) * (td ? td : 1));
    float *out = malloc(sizeof(float) * (td ? td : 1)), *dx = malloc(sizeof(float) * (td ? td : 1));
    float *ba = malloc(sizeof(float) * (sd ? sd : 1)), *bb = NULL;
    if (!x || !dout || !out || !dx || !ba)
        return mo_errorf(MO_ENOMEM, "bench_alltoall: cannot allocate the batch");
    rng_fill_uniform(x, td, 5, (uint64_t)rank, -1.0f, 1.0f);
    rng_fill_uniform(dout, td, 6, (uint64_t)rank, -1.0f, 1.0f);
    rng_fill_uniform(ba, sd, 7, (uint64_t)rank, -1.0f, 1.0f);
    arena_t ar;
    arena_init(&ar, 0);
    moe_ep_state_t st;
    moe_ep_traffic_t tr;
    for (int i = 0; i < a->warmup; i++)
        TRY(step(&L, cm, &ar, x, dout, out, dx, a->T, &tr, &st));

    TRY(comm_barrier(cm));
    comm_stats_reset(cm);
    double t0 = now_s();
    for (int i = 0; i < a->steps; i++)
        TRY(step(&L, cm, &ar, x, dout, out, dx, a->T, &tr, &st));
    double t_step = (now_s() - t0) / a->steps;
    comm_stats_t s = *comm_stats(cm, COMM_OP_ALLTOALLV);
    /* the last step's counts, replayed between ba (S, D) and bb (R, D) */
    bb = malloc(sizeof(float) * ((size_t)st.R * a->D + 1));
    if (!bb)
        return mo_errorf(MO_ENOMEM, "bench_alltoall: cannot allocate %d rows", st.R);
    TRY(comm_barrier(cm));
    double t1 = now_s();
    for (int i = 0; i < a->steps; i++)
        TRY(exchanges_only(cm, &st, ba, bb));
    double t_x = (now_s() - t1) / a->steps;

    /* [sent, local rows, counted local bytes, weight bytes] summed over ranks */
    size_t wb = moe_ep_expert_weight_bytes(&L.cfg, &L.w, e0, n);
    int64_t v[5] = {(int64_t)(s.bytes_sent / (uint64_t)a->steps), tr.rows_local,
                    (int64_t)(s.bytes_local / (uint64_t)a->steps), (int64_t)wb,
                    (int64_t)(s.bytes_sent == tr.bytes_sent * (uint64_t)a->steps)};
    TRY(comm_allreduce_sum(cm, v, v, 5, DT_I64));
    double step_max = max_over_ranks(cm, t_step), x_max = max_over_ranks(cm, t_x);
    int64_t TG = (int64_t)a->T * N, rows = TG * a->K;
    int64_t formula = (rows - v[1]) * a->D * 4 * 2 * 2;
    int64_t counts = (int64_t)N * (N - 1) * 8 * n;
    int match = v[0] == formula + counts && v[4] == N;
    if (rank == 0) {
        printf("bench_alltoall: N = %d ranks (%s), T = %d tokens per rank, D = %d, F = %d, "
               "E = %d, K = %d, %d thread(s) per rank, %d steps\n",
               N, comm_backend_name(cm), a->T, a->D, a->F, a->E, a->K, a->threads, a->steps);
        printf("  all-to-all bytes sent per step, all ranks: counted %lld; formula %lld x K %d "
               "x D %d x 4 B x 2 x 2 - %lld local rows = %lld, + %lld B of counts = %lld (%s)\n",
               (long long)v[0], (long long)TG, a->K, a->D, (long long)v[1], (long long)formula,
               (long long)counts, (long long)(formula + counts), match ? "match" : "MISMATCH");
        printf("  local (same-rank) copies per step, all ranks: %lld B\n", (long long)v[2]);
        printf("  expert weights per rank: %lld B (full layer %lld B)\n", (long long)v[3] / N,
               (long long)v[3]);
        printf("  step (forward + backward): %.3f ms; the four row exchanges alone: %.3f ms "
               "(%.0f%% of the step, %.2f GB/s sent per rank)\n",
               1e3 * step_max, 1e3 * x_max, 100.0 * x_max / step_max,
               x_max > 0 ? (double)formula / N / x_max * 1e-9 : 0.0);
    }
    arena_free(&ar);
    free(x), free(dout), free(out), free(dx), free(ba), free(bb);
    layer_free(&L);
    return match ? MO_OK
                 : mo_errorf(MO_ESTATE, "bench_alltoall: counted bytes differ from the formula");
}

int main(int argc, char **argv) {
    args_t a;
    if (parse_args(&a, argc, argv) < 0) {
        fprintf(stderr, "usage: mpirun -np 2 bench_alltoall [--tokens T] [--dim D] [--hidden F] "
                        "[--experts E] [--topk K] [--steps S] [--warmup W] [--threads N]\n");
        return 2;
    }
    comm_t *cm = NULL;
    if (comm_init_from_env(&cm, "auto") < 0) {
        fprintf(stderr, "bench_alltoall: %s\n", mo_last_error());
        return 1;
    }
    int rc = run(cm, &a);
    if (rc < 0)
        fprintf(stderr, "bench_alltoall rank %d: %s\n", comm_rank(cm), mo_last_error());
    comm_destroy(&cm);
    return rc < 0 ? 1 : 0;
}
