/* gpu_model_ep: the CUDA model's MoE layers expert-parallel over a one-rank communicator
 * (actor/model_cuda.h; actor/model_cuda_ep.c). A tiny random Qwen3-MoE (f32, 3 layers, the
 * middle one dense, a random "all-linear" adapter) is uploaded twice, without a comm and
 * with one; with a single rank every row stays on this rank, so the exchanged path must
 * give the same bits: model_cuda_logprobs (with and without the adapter, natural routing
 * and a replay) and the training step (logp, entropy and every adapter gradient) are
 * asserted bitwise equal (memcmp), and the comm's byte counters show the rows and the
 * dispatch offsets went through comm_alltoallv: per MoE layer and forward one exchange of
 * E + 1 int32 offsets and two of S D floats, the backward two more of S D floats. A rank
 * without tokens still takes part in every exchange (logprobs, forward_train and backward
 * with T = 0). The host index arithmetic (counts, displacements, the owner-side grouping)
 * is checked for two ranks against hand-worked values, and two ranks run in one process
 * (a thread each, over a two-rank communicator on host memory written here): each uploads
 * the model after model_set_comm (its four of the eight experts), takes its sequences of a
 * batch of four (two each, then all four on rank 0 and none on rank 1), scores it and runs
 * the training step; logp and entropy within 1e-5 (normalised) of the model without a comm
 * on the whole batch, each routed expert's adapter gradients from its owner only (zero on
 * the other rank) and the others summed over the ranks, all within 1e-5 of the whole
 * batch's, with rows crossing between the ranks.
 *
 * Communicators: NCCL (size 1, bootstrapped over the single backend, as gpu_comm.c does)
 * when the build has it; the single backend on host memory (rows staged through the host);
 * and, in the host build (tests/host_cuda, where device memory is host memory), the single
 * backend marked as holding device buffers, so that the unstaged path runs there too.
 * Exits 77 (skipped) without CUDA support in the build or without a device. */
#include <stdio.h>

#include "tests/gpu_main.h"

#ifdef MOERL_HAVE_CUDA
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "actor/model.h"
#include "actor/model_cuda.h"
#include "actor/model_cuda_int.h" /* the host index arithmetic under test */
#include "core/comm.h"
#include "core/status.h"
#include "tests/model_gpu_fixture.h"
#include "tests/testutil.h"

#define NCOMM 3
static comm_t *g_comm[NCOMM]; /* (created in main; NULL where not available) */
static const char *const g_comm_name[NCOMM] = {"nccl", "single (host buffers)",
                                               "single (device buffers)"};

static void open_model(fx_t *f) {
    fx_opts_t o = {0.25f, 0.1f, 5, 0.0f, 0};
    fx_open_model(f, ARCH_QWEN3_MOE, DT_F32, 31, &o);
}

/* Binds cm as model_set_comm binds a communicator of several ranks. model_set_comm leaves
 * a one-rank communicator out (the CPU model has nothing to exchange); the device path
 * exchanges over any communicator the model holds. */
static void bind_comm(model_t *m, comm_t *cm) {
    m->comm = cm;
    m->ep_e0 = 0;
    m->ep_n = cm ? m->E : 0;
}

/* Uploads f's model without a comm (*ref) and with cm (*ep). */
static void upload_pair(fx_t *f, comm_t *cm, model_cuda_t **ref, model_cuda_t **ep) {
    TU_CHECK_RC(model_cuda_upload(ref, f->m));
    bind_comm(f->m, cm);
    int rc = model_cuda_upload(ep, f->m);
    bind_comm(f->m, NULL);
    if (rc < 0)
        tu_report("upload with a comm: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
}

/* The alltoallv counters of this (only) rank after fwd_calls forwards and bwd_calls
 * backwards of S slots: per MoE layer, each forward's offsets and two row exchanges, and
 * each backward's two row exchanges, all local. */
static void check_traffic(const comm_t *cm, const model_t *m, int S, int fwd_calls, int bwd_calls) {
    const comm_stats_t *st = comm_stats(cm, COMM_OP_ALLTOALLV);
    uint64_t M = (uint64_t)m->n_moe, row = sizeof(float) * (uint64_t)m->D;
    uint64_t offs = sizeof(int32_t) * ((uint64_t)m->E + 1);
    uint64_t local =
        M * (fwd_calls * (offs + 2 * (uint64_t)S * row) + bwd_calls * 2 * (uint64_t)S * row);
    CU_ASSERT_EQUAL(st->calls, M * (3 * (uint64_t)fwd_calls + 2 * (uint64_t)bwd_calls));
    CU_ASSERT_EQUAL(st->bytes_local, local);
    CU_ASSERT_EQUAL(st->bytes_sent, 0);
    CU_ASSERT_EQUAL(st->bytes_recv, 0);
    if (st->bytes_local != local)
        tu_report("alltoallv: %llu bytes local, expected %llu", (unsigned long long)st->bytes_local,
                  (unsigned long long)local);
}

/* Scoring and its routing, with and without the adapter, then replaying that routing. */
static void check_scoring(comm_t *cm) {
    fx_t f;
    open_model(&f);
    model_cuda_t *ref = NULL, *ep = NULL;
    upload_pair(&f, cm, &ref, &ep);
    int lens[4] = {5, 1, 7, 3};
    batch_t bt;
    make_batch(&bt, f.m, lens, 4, 41, 0.8f);
    model_batch_t v = view(&bt);
    int T = v.T, M = f.m->n_moe, K = f.m->K;
    size_t nr = (size_t)T * M * K;
    float lp[2][MAXT], en[2][MAXT];
    uint16_t *rt = calloc(2 * nr, sizeof *rt);
    CU_ASSERT_FATAL(rt != NULL);
    comm_stats_reset(cm);
    for (int pass = 0; pass < 3; pass++) { /* adapter; base model; adapter, replayed */
        int ad = pass != 1;
        v.replay = pass == 2 ? rt : NULL;
        for (int i = 0; i < 2; i++) {
            tu_poison(lp[i], MAXT);
            tu_poison(en[i], MAXT);
            v.routing = pass == 2 ? NULL : rt + (size_t)i * nr;
            TU_CHECK_RC(model_cuda_logprobs(i ? ep : ref, &v, lp[i], en[i], ad));
        }
        CU_ASSERT_EQUAL(memcmp(lp[0], lp[1], sizeof(float) * T), 0);
        CU_ASSERT_EQUAL(memcmp(en[0], en[1], sizeof(float) * T), 0);
        if (pass < 2)
            CU_ASSERT_EQUAL(memcmp(rt, rt + nr, sizeof *rt * nr), 0);
    }
    check_traffic(cm, f.m, T * K, 3, 0);
    free(rt);
    model_cuda_free(&ep);
    model_cuda_free(&ref);
    fx_close(&f);
}

/* One training step on mc: logp, entropy and the adapter's gradients. */
static void train_step(fx_t *f, model_cuda_t *mc, const model_batch_t *v, const float *dlogp,
                       const float *dent, float *lp, float *en, float *g) {
    lora_adapter_zero_grads(f->ad);
    tu_poison(lp, MAXT);
    tu_poison(en, MAXT);
    TU_CHECK_RC(model_cuda_forward_train(mc, v, lp, en));
    TU_CHECK_RC(model_cuda_backward(mc, dlogp, dent));
    memcpy(g, f->ad->grads, sizeof(float) * f->ad->n_params);
}

static void check_train(comm_t *cm) {
    fx_t f;
    open_model(&f);
    model_cuda_t *ref = NULL, *ep = NULL;
    upload_pair(&f, cm, &ref, &ep);
    int lens[3] = {6, 1, 9};
    batch_t bt;
    make_batch(&bt, f.m, lens, 3, 43, 1.0f);
    model_batch_t v = view(&bt);
    int T = v.T;
    float dlogp[MAXT], dent[MAXT], lp[2][MAXT], en[2][MAXT];
    rng_fill_uniform(dlogp, (size_t)T, 44, 1, -1.0f, 1.0f);
    rng_fill_uniform(dent, (size_t)T, 44, 2, -1.0f, 1.0f);
    size_t n = f.ad->n_params;
    float *g = malloc(sizeof(float) * 2 * n);
    CU_ASSERT_FATAL(g != NULL);
    train_step(&f, ref, &v, dlogp, dent, lp[0], en[0], g);
    comm_stats_reset(cm);
    train_step(&f, ep, &v, dlogp, dent, lp[1], en[1], g + n);
    check_traffic(cm, f.m, T * f.m->K, 1, 1);
    CU_ASSERT_EQUAL(memcmp(lp[0], lp[1], sizeof(float) * T), 0);
    CU_ASSERT_EQUAL(memcmp(en[0], en[1], sizeof(float) * T), 0);
    CU_ASSERT_EQUAL(memcmp(g, g + n, sizeof(float) * n), 0);
    double gmax = 0.0; /* the gradients are not all zero (experts included) */
    for (size_t i = 0; i < n; i++)
        gmax = fabs(g[i]) > gmax ? fabs(g[i]) : gmax;
    CU_ASSERT(gmax > 0.0);
    free(g);
    model_cuda_free(&ep);
    model_cuda_free(&ref);
    fx_close(&f);
}

/* T = 0: every MoE layer's exchanges still run (no rows), the gradients stay zero. */
static void check_empty(comm_t *cm) {
    fx_t f;
    open_model(&f);
    model_cuda_t *ref = NULL, *ep = NULL;
    upload_pair(&f, cm, &ref, &ep);
    int32_t cu[1] = {0};
    model_batch_t v = {0, 0, NULL, NULL, cu, NULL, 1.0f, NULL, NULL};
    float x[1], dl[1] = {0.0f};
    comm_stats_reset(cm);
    TU_CHECK_RC(model_cuda_logprobs(ep, &v, x, NULL, 1));
    lora_adapter_zero_grads(f.ad);
    TU_CHECK_RC(model_cuda_forward_train(ep, &v, x, NULL));
    TU_CHECK_RC(model_cuda_backward(ep, dl, NULL));
    check_traffic(cm, f.m, 0, 2, 1);
    int nz = 0;
    for (size_t i = 0; i < f.ad->n_params; i++)
        nz += f.ad->grads[i] != 0.0f;
    CU_ASSERT_EQUAL(nz, 0);
    model_cuda_free(&ep);
    model_cuda_free(&ref);
    fx_close(&f);
}

/* The experts the model holds must be the rank's share. */
static void check_refusal(comm_t *cm) {
    fx_t f;
    open_model(&f);
    bind_comm(f.m, cm);
    f.m->ep_n = f.m->E / 2;
    model_cuda_t *mc = NULL;
    CU_ASSERT_EQUAL(model_cuda_upload(&mc, f.m), MO_ECONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), "owns experts"));
    CU_ASSERT_PTR_NULL(mc);
    bind_comm(f.m, NULL);
    fx_close(&f);
}

static void run_all(void (*fn)(comm_t *)) {
    for (int i = 0; i < NCOMM; i++)
        if (g_comm[i]) {
            printf("\n  over %s ", g_comm_name[i]);
            fn(g_comm[i]);
        }
}

static void test_scoring(void) {
    run_all(check_scoring);
}

static void test_train(void) {
    run_all(check_train);
}

static void test_empty(void) {
    run_all(check_empty);
}

static void test_refusal(void) {
    run_all(check_refusal);
}

/* Rank 1 of 2, E = 4 (n = 2: experts 2 and 3), D = 3. Its own plan holds 1, 0, 1, 2 rows
 * for experts 0 .. 3; rank 0 sent its offsets of experts 2, 3: 3, 4, 6 (one row for expert
 * 2, two for 3). As received: rows 0 .. 2 from rank 0 (expert 2: row 0; expert 3: rows 1,
 * 2), rows 3 .. 5 from itself (expert 2: row 3; expert 3: rows 4, 5). */
static void test_index_arithmetic(void) {
    int32_t own[5] = {0, 1, 1, 2, 4};
    int32_t src[6] = {3, 4, 6, 1, 2, 4}; /* (2, 3) */
    int64_t sc[2], sd[2], rc[2], rd[2];
    CU_ASSERT_EQUAL(mc_ep_counts(2, 2, 3, own, src, sc, sd, rc, rd), 6);
    int64_t want[4][2] = {{1 * 3, 3 * 3}, {0, 1 * 3}, {3 * 3, 3 * 3}, {0, 3 * 3}};
    const int64_t *got[4] = {sc, sd, rc, rd};
    for (int a = 0; a < 4; a++)
        for (int p = 0; p < 2; p++)
            CU_ASSERT_EQUAL(got[a][p], want[a][p]);
    int32_t off[3], perm[6], inv[6];
    mc_ep_group(2, 2, src, off, perm, inv);
    int32_t want_off[3] = {0, 2, 6}, want_perm[6] = {0, 3, 1, 2, 4, 5};
    int32_t want_inv[6] = {0, 2, 3, 1, 4, 5};
    CU_ASSERT_EQUAL(memcmp(off, want_off, sizeof off), 0);
    CU_ASSERT_EQUAL(memcmp(perm, want_perm, sizeof perm), 0);
    CU_ASSERT_EQUAL(memcmp(inv, want_inv, sizeof inv), 0);
    /* Offsets that go down are refused. */
    int32_t bad[6] = {3, 2, 6, 1, 2, 4};
    CU_ASSERT_EQUAL(mc_ep_counts(2, 2, 3, own, bad, sc, sd, rc, rd), MO_EINVAL);
}

/* ---- two ranks in one process ---------------------------------------------------------- */

/* A two-rank communicator over threads, on host memory: each rank's comm_alltoallv posts
 * its send buffer, waits for the other, copies its blocks in, and waits again. Only
 * comm_alltoallv is served (all the CUDA model path calls); one thread per rank. */
typedef struct tc_hub {
    pthread_barrier_t bar;
    const char *send[2];
    const int64_t *sc[2], *sd[2];
} tc_hub_t;

static int tc_alltoallv(comm_t *c, const void *sendbuf, const int64_t *sc, const int64_t *sd,
                        void *recvbuf, const int64_t *rc, const int64_t *rd, dtype_t dt) {
    tc_hub_t *h = c->impl;
    int r = c->rank, bad = 0;
    size_t es = dtype_size(dt);
    h->send[r] = sendbuf;
    h->sc[r] = sc;
    h->sd[r] = sd;
    pthread_barrier_wait(&h->bar);
    for (int p = 0; p < 2; p++) {
        bad |= h->sc[p][r] != rc[p];
        if (h->sc[p][r] == rc[p] && rc[p] > 0)
            memcpy((char *)recvbuf + (size_t)rd[p] * es, h->send[p] + (size_t)h->sd[p][r] * es,
                   (size_t)rc[p] * es);
    }
    pthread_barrier_wait(&h->bar);
    return bad ? mo_errorf(MO_EINVAL, "two-rank comm: rank %d's receive counts disagree", r)
               : MO_OK;
}

static int tc_destroy(comm_t *c) {
    free(c);
    return MO_OK;
}

static const comm_ops_t g_tc_ops = {"threads", tc_alltoallv, NULL, NULL,      NULL,
                                    NULL,      NULL,         NULL, tc_destroy};

static comm_t *tc_new(tc_hub_t *h, int rank, device_t dev) {
    comm_t *c = calloc(1, sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    c->ops = &g_tc_ops;
    c->rank = c->local_rank = rank;
    c->size = c->local_size = 2;
    c->device = dev;
    c->impl = h;
    return c;
}

/* One rank's part: its model (its experts only), its sequences, what it computed. */
typedef struct rank_job {
    fx_t f;
    comm_t *cm;
    model_cuda_t *mc;
    model_batch_t v;
    int32_t cu[MAXT + 1];
    const float *dlogp, *dent; /* (T) its slice */
    float lp[MAXT], en[MAXT], ls[MAXT];
    float *g; /* (n_params) its adapter gradients */
    int rc;
    char msg[512];
} rank_job_t;

static void *rank_run(void *arg) {
    rank_job_t *j = arg;
    lora_adapter_zero_grads(j->f.ad);
    int rc = model_cuda_logprobs(j->mc, &j->v, j->ls, NULL, 1);
    if (rc == 0)
        rc = model_cuda_forward_train(j->mc, &j->v, j->lp, j->en);
    if (rc == 0)
        rc = model_cuda_backward(j->mc, j->dlogp, j->dent);
    if (rc < 0)
        snprintf(j->msg, sizeof j->msg, "%s", mo_last_error());
    memcpy(j->g, j->f.ad->grads, sizeof(float) * j->f.ad->n_params);
    j->rc = rc;
    return NULL;
}

/* Rank r's view of sequences s0 .. s1-1 of the whole batch w. */
static void rank_batch(rank_job_t *j, const batch_t *w, int s0, int s1, const float *dlogp,
                       const float *dent) {
    int t0 = w->cu[s0];
    for (int s = s0; s <= s1; s++)
        j->cu[s - s0] = w->cu[s] - t0;
    model_batch_t v = {w->cu[s1] - t0, s1 - s0,        w->tok + t0, w->pos + t0, j->cu,
                       w->tgt + t0,    w->temperature, NULL,        NULL};
    j->v = v;
    j->dlogp = dlogp + t0;
    j->dent = dent + t0;
}

/* The expert of entry e, or -1 for another kind of entry. */
static int entry_expert(const lora_entry_t *e) {
    const char *x = strstr(e->name, ".experts.");
    return e->kind == LORA_KIND_EXPERT && x ? atoi(x + 9) : -1;
}

/* The two ranks' gradients as one: a routed expert's from its owner (the other rank's
 * must be zero: *stray counts those that are not), the others summed as the learner's
 * all-reduce sums them. */
static void merge_grads(float *out, const lora_adapter_t *ad, const rank_job_t *j, int n,
                        int *stray) {
    for (int i = 0; i < ad->n_entries; i++) {
        const lora_entry_t *e = &ad->entries[i];
        int owner = entry_expert(e) >= 0 ? entry_expert(e) / n : -1;
        size_t off[2] = {e->off_A, e->off_B}, len[2] = {(size_t)e->R * e->C, (size_t)e->OC * e->R};
        for (int k = 0; k < 2; k++)
            for (size_t q = off[k]; q < off[k] + len[k]; q++) {
                out[q] = owner >= 0 ? j[owner].g[q] : j[0].g[q] + j[1].g[q];
                *stray += owner >= 0 && j[1 - owner].g[q] != 0.0f;
            }
    }
}

/* Two ranks, rank 0 holding sequences 0 .. split-1 of four, against the model without a
 * comm on all four: logp (scoring and training) and entropy within 1e-5 of the largest,
 * the merged adapter gradients within 1e-5 of the largest (other products, summed over
 * other rows: not bitwise), rows crossing between the ranks. */
static void check_two_ranks(device_t dev, int split) {
    fx_t f;
    open_model(&f);
    int lens[4] = {5, 3, 6, 2};
    batch_t w;
    make_batch(&w, f.m, lens, 4, 47, 1.0f);
    model_batch_t v = view(&w);
    int T = v.T;
    size_t np = f.ad->n_params;
    float dlogp[MAXT], dent[MAXT], lp[MAXT], en[MAXT], ls[MAXT];
    rng_fill_uniform(dlogp, (size_t)T, 48, 1, -1.0f, 1.0f);
    rng_fill_uniform(dent, (size_t)T, 48, 2, -1.0f, 1.0f);
    float *g = calloc(4 * np, sizeof(float)); /* ref, rank 0, rank 1, merged */
    CU_ASSERT_FATAL(g != NULL);
    model_cuda_t *ref = NULL;
    TU_CHECK_RC(model_cuda_upload(&ref, f.m));
    TU_CHECK_RC(model_cuda_logprobs(ref, &v, ls, NULL, 1));
    train_step(&f, ref, &v, dlogp, dent, lp, en, g);
    model_cuda_free(&ref);

    tc_hub_t hub;
    pthread_barrier_init(&hub.bar, NULL, 2);
    rank_job_t j[2];
    memset(j, 0, sizeof j);
    for (int r = 0; r < 2; r++) {
        open_model(&j[r].f);
        j[r].cm = tc_new(&hub, r, dev);
        TU_CHECK_RC(model_set_comm(j[r].f.m, j[r].cm));
        TU_CHECK_RC(model_cuda_upload(&j[r].mc, j[r].f.m));
        j[r].g = g + (size_t)(r + 1) * np;
        rank_batch(&j[r], &w, r == 0 ? 0 : split, r == 0 ? split : 4, dlogp, dent);
    }
    pthread_t th[2];
    for (int r = 0; r < 2; r++)
        CU_ASSERT_EQUAL_FATAL(pthread_create(&th[r], NULL, rank_run, &j[r]), 0);
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&hub.bar);
    for (int r = 0; r < 2; r++) {
        if (j[r].rc < 0)
            tu_report("rank %d: %s", r, j[r].msg);
        CU_ASSERT_EQUAL_FATAL(j[r].rc, 0);
        int t0 = w.cu[r == 0 ? 0 : split], n = j[r].v.T;
        TU_ASSERT_CLOSE(tu_rel_err_ff(j[r].ls, ls + t0, (size_t)n, 1.0), 1e-5, "scoring logp");
        TU_ASSERT_CLOSE(tu_rel_err_ff(j[r].lp, lp + t0, (size_t)n, 1.0), 1e-5, "training logp");
        TU_ASSERT_CLOSE(tu_rel_err_ff(j[r].en, en + t0, (size_t)n, 1.0), 1e-5, "entropy");
        /* Rows went both ways between the ranks (each holds half of the experts). */
        const comm_stats_t *st = comm_stats(j[r].cm, COMM_OP_ALLTOALLV);
        CU_ASSERT(st->bytes_sent > 0 || j[r].v.T == 0);
        CU_ASSERT(st->bytes_recv > 0);
        CU_ASSERT_EQUAL(st->calls, 8 * (uint64_t)f.m->n_moe); /* 2 forwards, 1 backward */
    }
    int stray = 0;
    merge_grads(g + 3 * np, f.ad, j, f.m->E / 2, &stray);
    CU_ASSERT_EQUAL(stray, 0);
    TU_ASSERT_CLOSE(tu_rel_err_ff(g + 3 * np, g, np, 1e-30), 1e-5, "adapter gradients");
    for (int r = 0; r < 2; r++) {
        model_cuda_free(&j[r].mc);
        fx_close(&j[r].f);
        comm_destroy(&j[r].cm);
    }
    free(g);
    fx_close(&f);
}

static void test_two_ranks(void) {
    check_two_ranks(DEV_CPU, 2); /* rows staged through host memory */
    check_two_ranks(DEV_CPU, 4); /* rank 1 without tokens */
#ifdef backend_get
    check_two_ranks(DEV_CUDA, 2); /* the host build: its device memory is host memory */
#endif
}

static CU_TestInfo g_tests[] = {
    {"index_arithmetic", test_index_arithmetic},
    {"scoring", test_scoring},
    {"train", test_train},
    {"empty", test_empty},
    {"refusal", test_refusal},
    {"two_ranks", test_two_ranks},
    CU_TEST_INFO_NULL,
};

/* The communicators this build offers; 1 when one fails to start. */
static int open_comms(void) {
    if (comm_single_new(&g_comm[1]) < 0)
        return 1;
#ifdef MOERL_HAVE_NCCL
    comm_t *boot = NULL;
    if (comm_single_new(&boot) < 0 || comm_nccl_new(&g_comm[0], &boot, 0) < 0)
        return 1;
#endif
#ifdef backend_get
    /* The host build: the twin's device memory is host memory, so a host communicator
     * serves as one on device buffers. */
    if (comm_single_new(&g_comm[2]) < 0)
        return 1;
    g_comm[2]->device = DEV_CUDA;
#endif
    return 0;
}

int main(void) {
    int rc = 0;
    if (!gpu_suite_backend("gpu_model_ep", &rc))
        return rc;
    backend_cpu_set_threads(0);
    if (open_comms()) {
        fprintf(stderr, "gpu_model_ep: %s\n", mo_last_error());
        rc = 1;
    } else {
        rc = tu_main("gpu_model_ep", g_tests);
    }
    for (int i = 0; i < NCOMM; i++)
        if (comm_destroy(&g_comm[i]) < 0) {
            fprintf(stderr, "gpu_model_ep: %s\n", mo_last_error());
            rc = 1;
        }
    return rc;
}

#else
int main(void) {
    return gpu_suite_absent("gpu_model_ep");
}
#endif
