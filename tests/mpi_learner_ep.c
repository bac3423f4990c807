/* mpi_learner_ep: the expert-parallel learner under mpirun against one rank: on a tiny
 * Qwen3-MoE (8 experts) with LoRA on attention and experts, each rank's trainer (experts
 * and expert adapters sharded over the N ranks, sequences split) gives the single-rank
 * trainer's loss, gradient norm, gradients and adapter after each of three optimizer
 * steps, with and without routing replay, recompute, KL penalty and entropy bonus, and
 * with the routers and norms trained in full (replicated); the whole adapter
 * gathered on rank 0 equals the single-rank one; a checkpoint written by 2 ranks resumes
 * on one rank and on all N ranks to the same adapter and trains on identically; per-rank
 * expert weight memory is 1 / N; E not a multiple of N is refused naming both. In builds
 * with CUDA (and as host_mpi_learner_ep over the host twins of the device blocks) the
 * sharded trainer also runs on the device (run.device: cuda), with and without routing
 * replay, KL and entropy, against the same CPU rank, its rows exchanged over MPI
 * staged through host memory or over a device-memory communicator (NCCL; in the host
 * twin an MPI one that says so); a device communicator with other ranks is refused. Every
 * rank runs the suite; the process exits non-zero when any rank failed. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/comm.h"
#include "learner/actor_exec.h"
#include "learner/checkpoint.h"
#include "learner/ep_shard.h"
#include "tests/learner_fixture.h"

#define TOL 1e-5
/* Gradients after optimizer steps, in L2: the ranks sum the experts' rows and the
 * replicated gradients in another order than one rank does, and each AdamW step carries
 * those roundings into every parameter; with OpenBLAS's AVX-512 kernels the third step's
 * gradients part by 1.03e-5. */
#define TOL_LATER 2e-5

static comm_t *g_c; /* (created in main, shared by every test) */
static int g_rank, g_size;

/* ---- a host communicator over a part of the job (MPI_Comm_split) ---------------------- */

typedef struct {
    MPI_Comm comm;
    int *ib; /* (4, N) int counts and displacements */
} sub_impl_t;

static MPI_Comm sub_comm(const comm_t *c) {
    return ((const sub_impl_t *)c->impl)->comm;
}

static MPI_Datatype sub_type(dtype_t dt) {
    switch (dt) {
    case DT_F32: return MPI_FLOAT;
    case DT_F64: return MPI_DOUBLE;
    case DT_I64: return MPI_INT64_T;
    case DT_I32: return MPI_INT32_T;
    case DT_U16: return MPI_UINT16_T;
    default: return MPI_UINT8_T;
    }
}

static int sub_rc(int rc, const char *call) {
    return rc == MPI_SUCCESS ? MO_OK : mo_errorf(MO_EIO, "%s failed (%d)", call, rc);
}

static int *sub_ints(comm_t *c, int k, const int64_t *v) {
    int *o = ((sub_impl_t *)c->impl)->ib + (size_t)k * c->size;
    for (int p = 0; p < c->size; p++)
        o[p] = (int)v[p];
    return o;
}

static int sub_alltoallv(comm_t *c, const void *sb, const int64_t *sc, const int64_t *sd,
                         void *rb, const int64_t *rc, const int64_t *rd, dtype_t dt) {
    MPI_Datatype t = sub_type(dt);
    return sub_rc(MPI_Alltoallv(sb, sub_ints(c, 0, sc), sub_ints(c, 1, sd), t, rb,
                                sub_ints(c, 2, rc), sub_ints(c, 3, rd), t, sub_comm(c)),
                  "MPI_Alltoallv");
}

static int sub_exchange_counts(comm_t *c, const int64_t *sc, int64_t *rc) {
    return sub_rc(MPI_Alltoall(sc, 1, MPI_INT64_T, rc, 1, MPI_INT64_T, sub_comm(c)),
                  "MPI_Alltoall");
}

static int sub_allreduce(comm_t *c, const void *sb, void *rb, size_t n, dtype_t dt) {
    return sub_rc(MPI_Allreduce(sb == rb ? MPI_IN_PLACE : sb, rb, (int)n, sub_type(dt), MPI_SUM,
                                sub_comm(c)),
                  "MPI_Allreduce");
}

static int sub_bcast(comm_t *c, void *buf, size_t n, dtype_t dt, int root) {
    return sub_rc(MPI_Bcast(buf, (int)n, sub_type(dt), root, sub_comm(c)), "MPI_Bcast");
}

static int sub_allgatherv(comm_t *c, const void *sb, int64_t sc, void *rb, const int64_t *rc,
                          const int64_t *rd, dtype_t dt) {
    MPI_Datatype t = sub_type(dt);
    return sub_rc(MPI_Allgatherv(sb, (int)sc, t, rb, sub_ints(c, 0, rc), sub_ints(c, 1, rd), t,
                                 sub_comm(c)),
                  "MPI_Allgatherv");
}

static int sub_gatherv(comm_t *c, const void *sb, int64_t sc, void *rb, const int64_t *rc,
                       const int64_t *rd, dtype_t dt, int root) {
    MPI_Datatype t = sub_type(dt);
    int root_here = c->rank == root;
    return sub_rc(MPI_Gatherv(sb, (int)sc, t, rb, root_here ? sub_ints(c, 0, rc) : NULL,
                              root_here ? sub_ints(c, 1, rd) : NULL, t, root, sub_comm(c)),
                  "MPI_Gatherv");
}

static int sub_barrier(comm_t *c) {
    return sub_rc(MPI_Barrier(sub_comm(c)), "MPI_Barrier");
}

static int sub_destroy(comm_t *c) {
    sub_impl_t *m = c->impl;
    int rc = sub_rc(MPI_Comm_free(&m->comm), "MPI_Comm_free");
    free(m->ib);
    free(m);
    free(c);
    return rc;
}

static const comm_ops_t g_sub_ops = {"mpi-split",  sub_alltoallv, sub_exchange_counts,
                                     sub_allreduce, sub_bcast,     sub_allgatherv,
                                     sub_gatherv,   sub_barrier,   sub_destroy};

/* The ranks of the job with the same color, ordered by job rank (collective). */
static comm_t *sub_new(int color) {
    comm_t *c = calloc(1, sizeof *c);
    sub_impl_t *m = calloc(1, sizeof *m);
    CU_ASSERT_FATAL(c && m);
    CU_ASSERT_FATAL(MPI_Comm_split(MPI_COMM_WORLD, color, g_rank, &m->comm) == MPI_SUCCESS);
    MPI_Comm_rank(m->comm, &c->rank);
    MPI_Comm_size(m->comm, &c->size);
    m->ib = calloc(4 * (size_t)c->size, sizeof *m->ib);
    CU_ASSERT_FATAL(m->ib != NULL);
    c->ops = &g_sub_ops;
    c->local_rank = c->rank;
    c->local_size = c->size;
    c->device = DEV_CPU;
    c->impl = m;
    return c;
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* dc: the device path's exchanges over it (trainer_opts_t.device_comm), or NULL. */
static trainer_t *ep_trainer_dc(lf_t *f, comm_t *cm, comm_t *dc) {
    trainer_opts_t o = trainer_opts_default();
    o.comm = cm;
    o.device_comm = dc;
    trainer_t *t = NULL;
    int rc = trainer_new(&t, &f->cfg, NULL, &o);
    if (rc < 0)
        tu_report("rank %d: trainer_new over %d ranks: %s", g_rank, cm ? comm_size(cm) : 1,
                  mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    return t;
}

static trainer_t *ep_trainer(lf_t *f, comm_t *cm) {
    return ep_trainer_dc(f, cm, NULL);
}

/* Four groups of four samples with distinct rewards, rollout logprobs from ref. */
static void make_groups(trainer_t *ref, sample_group_t **g, int routing) {
    static const float rw[4][4] = {
        {1, 0, 0.5f, 0}, {0, 1, 1, 0.25f}, {0.75f, 0, 1, 0}, {0, 0.5f, 0, 1}};
    for (int i = 0; i < 4; i++)
        g[i] = lf_group(ref, 100 + (uint64_t)i, 4, rw[i], 0, routing);
}

/* ||a - b|| / ||b|| (L2). Parameters are compared in this norm: AdamW divides by
 * sqrt(v) + adam_eps, so an element whose gradient is near adam_eps (1e-8) moves by an
 * amount that float summation order (per-rank partial sums) changes visibly, while the
 * bulk of the adapter agrees to ~1e-6. The gradients of later steps, taken at those
 * parameters, are compared in L2 too; the first step's gradients in the max norm. */
static double l2_norm(const float *a, size_t n) {
    double r = 0.0;
    for (size_t i = 0; i < n; i++)
        r += (double)a[i] * a[i];
    return sqrt(r);
}

static double l2_rel(const float *a, const float *b, size_t n) {
    double d = 0.0;
    for (size_t i = 0; i < n; i++)
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    double r = l2_norm(b, n);
    return r > 0 ? sqrt(d) / r : sqrt(d);
}

/* got (ep's shard layout, or the whole layout without sharding) against want (whole):
 * tu_rel_err_ff, or when l2 the L2 distance over this rank's part relative to the whole
 * adapter's norm (each shard's share of the whole adapter's relative error, which
 * check_whole bounds as a whole). */
static void check_shard(const trainer_t *ep, const float *got, const float *want, size_t n_whole,
                        double tol, int l2, const char *what) {
    size_t n = ep->adapter->n_params;
    float *w = malloc(sizeof *w * (n ? n : 1));
    CU_ASSERT_FATAL(w != NULL);
    if (ep->ep)
        ep_shard_extract(ep->ep, want, w);
    else
        memcpy(w, want, sizeof *w * n_whole);
    double e = tu_rel_err_ff(got, w, n, 1e-6);
    if (l2) {
        double wn = l2_norm(want, n_whole);
        double d = 0.0;
        for (size_t i = 0; i < n; i++)
            d += ((double)got[i] - w[i]) * ((double)got[i] - w[i]);
        e = sqrt(d) / (wn > 0 ? wn : 1.0);
    }
    if (!(e <= tol))
        tu_report("rank %d of %d: %s: error %.3g > %.3g", g_rank, trainer_ranks(ep), what, e, tol);
    CU_ASSERT(e <= tol);
    free(w);
}

/* Rank 0's whole adapter of ep against want (every rank calls), in L2. */
static void check_whole(trainer_t *ep, const float *want, size_t n, double tol, const char *what) {
    const lora_adapter_t *whole = NULL;
    CU_ASSERT_EQUAL_FATAL(trainer_whole_adapter(ep, &whole), 0);
    if (trainer_rank(ep) != 0) {
        CU_ASSERT_PTR_NULL(whole);
        return;
    }
    CU_ASSERT_FATAL(whole != NULL);
    CU_ASSERT_EQUAL_FATAL(whole->n_params, n);
    double e = l2_rel(whole->params, want, n);
    if (!(e <= tol))
        tu_report("%s: whole adapter error %.3g > %.3g", what, e, tol);
    CU_ASSERT(e <= tol);
}

static void step_both(trainer_t *ref, trainer_t *ep, sample_group_t **g, int k) {
    trainer_metrics_t mr, me;
    int rc = trainer_step(ref, (const sample_group_t *const *)g, 4, &mr);
    if (rc < 0)
        tu_report("reference step: %s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    rc = trainer_step(ep, (const sample_group_t *const *)g, 4, &me);
    if (rc < 0)
        tu_report("rank %d: sharded step: %s", g_rank, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(mr.updates, 1);
    CU_ASSERT_EQUAL(me.updates, mr.updates);
    CU_ASSERT_EQUAL(me.trained_tokens, mr.trained_tokens);
    CU_ASSERT_EQUAL(me.micro_batches, mr.micro_batches);
    CU_ASSERT(mr.loss != 0.0 && mr.grad_norm > 0.0);
    /* GRPO's loss is a mean of terms of order |advantage| ~ 1 that nearly cancel (ratio
     * ~ 1, advantages summing to 0): its error is measured against max(|loss|, 1). */
    double el = fabs(me.loss - mr.loss) / fmax(fabs(mr.loss), 1.0);
    double eg = fabs(me.grad_norm - mr.grad_norm) / mr.grad_norm;
    if (!(el <= TOL && eg <= TOL))
        tu_report("rank %d, step %d: loss %.9g vs %.9g, grad norm %.9g vs %.9g", g_rank, k,
                  me.loss, mr.loss, me.grad_norm, mr.grad_norm);
    CU_ASSERT(el <= TOL);
    CU_ASSERT(eg <= TOL);
    for (int l = 0; l < mr.M; l++)
        CU_ASSERT(fabs(me.expert_imbalance[l] - mr.expert_imbalance[l]) < 1e-9);
}

/* Three optimizer steps, sharded over every rank against one rank; full: the routers
 * and norms trained in full too (replicated, gradients summed over the ranks); cuda: the
 * sharded trainer's model on the CUDA device (the reference stays on the CPU), its MoE
 * exchanges over dc when not NULL (a communicator on device memory: none then goes over
 * g_c), else over g_c staged through host memory. */
static void run_equal_on(int replay, int kl_entropy, int full, int cuda, comm_t *dc) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.minibatches", "1");
    lf_set(&f, "learner.micro_batch_tokens", "40");
    /* An element whose gradient is near adam_eps moves by an amount that summation order
     * changes visibly; 1e-6 keeps such elements rarer (see l2_rel). */
    lf_set(&f, "learner.adam_eps", "1e-6");
    /* Later steps' gradients are taken at parameters that already differ by that noise
     * times the learning rate: a moderate one keeps the comparison meaningful. */
    lf_set(&f, "learner.lr", "2e-3");
    if (replay) { /* and the backward recomputes each layer (the MoE exchanges again) */
        lf_set(&f, "model.routing_replay", "true");
        lf_set(&f, "model.recompute", "true");
    }
    if (kl_entropy) {
        lf_set(&f, "learner.kl_coef", "0.05");
        lf_set(&f, "learner.entropy_coef", "0.01");
    }
    if (full) {
        lf_set(&f, "lora.train_router", "true");
        lf_set(&f, "lora.train_norms", "true");
        lf_set(&f, "learner.weight_decay", "0.1"); /* the routers decay, the norms do not */
    }
    trainer_t *ref = lf_trainer(&f);
    if (cuda)
        lf_set(&f, "run.device", "cuda");
    trainer_t *ep = ep_trainer_dc(&f, g_c, dc);
    CU_ASSERT_EQUAL_FATAL(trainer_ranks(ep), g_size);
    CU_ASSERT_EQUAL(actor_exec_device(ep->exec), cuda ? DEV_CUDA : DEV_CPU);
    uint64_t host_x0 = comm_stats(g_c, COMM_OP_ALLTOALLV)->calls;
    uint64_t dev_x0 = dc ? comm_stats(dc, COMM_OP_ALLTOALLV)->calls : 0;
    CU_ASSERT_EQUAL(ep->adapter->n_full, ref->adapter->n_full);
    CU_ASSERT_EQUAL(ep->optim.n_nd, ref->optim.n_nd);
    if (full)
        CU_ASSERT(ref->adapter->n_full > 0 && ref->optim.n_nd > 0);
    size_t n = ref->adapter->n_params;
    if (g_size > 1)
        CU_ASSERT(ep->adapter->n_params < n);
    sample_group_t *g[4];
    make_groups(ref, g, replay);
    check_shard(ep, ep->adapter->params, ref->adapter->params, n, 0.0, 0, "initial adapter");
    for (int k = 0; k < 3; k++) {
        char what[64];
        step_both(ref, ep, g, k);
        snprintf(what, sizeof what, "gradients of step %d", k + 1);
        check_shard(ep, ep->adapter->grads, ref->adapter->grads, n, k > 0 ? TOL_LATER : TOL, k > 0,
                    what);
        snprintf(what, sizeof what, "adapter after step %d", k + 1);
        check_shard(ep, ep->adapter->params, ref->adapter->params, n, TOL, 1, what);
    }
    check_whole(ep, ref->adapter->params, n, TOL, "after 3 steps");
    CU_ASSERT_EQUAL(ep->version, ref->version);
    if (dc && g_size > 1) { /* every row exchange went over dc, none over g_c */
        uint64_t dev_x = comm_stats(dc, COMM_OP_ALLTOALLV)->calls - dev_x0;
        uint64_t host_x = comm_stats(g_c, COMM_OP_ALLTOALLV)->calls - host_x0;
        if (dev_x == 0 || host_x != 0)
            tu_report("rank %d: %llu exchanges over the device comm, %llu over the host one",
                      g_rank, (unsigned long long)dev_x, (unsigned long long)host_x);
        CU_ASSERT(dev_x > 0);
        CU_ASSERT_EQUAL(host_x, 0);
    }
    lf_free_groups(g, 4);
    trainer_destroy(&ep);
    trainer_destroy(&ref);
    lf_close(&f);
}

static void run_equal(int replay, int kl_entropy, int full) {
    run_equal_on(replay, kl_entropy, full, 0, NULL);
}

static void test_train_equal(void) {
    run_equal(0, 0, 0);
}

static void test_train_equal_replay_kl(void) {
    run_equal(1, 1, 0);
}

static void test_train_equal_full(void) {
    run_equal(0, 0, 1);
}

static void test_train_equal_full_replay(void) {
    run_equal(1, 0, 1);
}

/* Expert weights per rank fall as 1 / N; replicated adapter entries stay whole. */
static void test_expert_memory(void) {
    lf_t f;
    lf_open(&f);
    trainer_t *ref = lf_trainer(&f);
    trainer_t *ep = ep_trainer(&f, g_c);
    size_t all = model_expert_weight_bytes(ref->model), mine = model_expert_weight_bytes(ep->model);
    CU_ASSERT(all > 0);
    CU_ASSERT_EQUAL(mine * (size_t)g_size, all);
    int held = 0, l = 0;
    while (!ep->model->layers[l].moe)
        l++;
    for (int e = 0; e < ep->model->E; e++)
        held += ep->model->layers[l].experts[e].data != NULL;
    CU_ASSERT_EQUAL(held * g_size, ep->model->E);
    /* Every replicated entry is in the shard; expert entries only for owned experts. */
    int experts = 0;
    for (int i = 0; i < ep->adapter->n_entries; i++)
        experts += ep->adapter->entries[i].kind == LORA_KIND_EXPERT;
    int experts_all = 0;
    for (int i = 0; i < ref->adapter->n_entries; i++)
        experts_all += ref->adapter->entries[i].kind == LORA_KIND_EXPERT;
    CU_ASSERT(experts_all > 0);
    CU_ASSERT_EQUAL(experts * g_size, experts_all);
    CU_ASSERT_EQUAL(ep->adapter->n_entries - experts, ref->adapter->n_entries - experts_all);
    trainer_destroy(&ep);
    trainer_destroy(&ref);
    lf_close(&f);
}

/* Written by 2 ranks (ranks 0 and 1), resumed on 1 rank and on all g_size ranks; full:
 * with the routers and norms trained in full. */
static void run_checkpoint_reshard(int full) {
    lf_t f;
    lf_open(&f);
    lf_set(&f, "learner.minibatches", "1");
    if (full) {
        lf_set(&f, "lora.train_router", "true");
        lf_set(&f, "lora.train_norms", "true");
    }
    char run[600];
    snprintf(run, sizeof run, "%s", f.run_dir);
    CU_ASSERT_EQUAL_FATAL(comm_bcast(g_c, run, sizeof run, DT_U8, 0), 0); /* rank 0's */
    trainer_t *ref = lf_trainer(&f);
    size_t n = ref->adapter->n_params;
    sample_group_t *g[4];
    make_groups(ref, g, 0);
    float *want = malloc(sizeof *want * n);
    CU_ASSERT_FATAL(want != NULL);

    /* Two ranks write (with one rank in the job: that rank alone). */
    comm_t *two = g_size >= 2 ? sub_new(g_rank / 2) : NULL;
    trainer_t *t2 = ep_trainer(&f, two);
    for (int k = 0; k < 2; k++) {
        trainer_metrics_t m;
        CU_ASSERT_EQUAL_FATAL(trainer_step(t2, (const sample_group_t *const *)g, 4, &m), 0);
        CU_ASSERT_EQUAL(m.updates, 1);
    }
    if (g_rank < 2) {
        char name[64] = "";
        int rc = checkpoint_save_trainer(t2, run, NULL, NULL, name, sizeof name);
        if (rc < 0)
            tu_report("rank %d: save: %s", g_rank, mo_last_error());
        CU_ASSERT_EQUAL_FATAL(rc, 0);
    }
    const lora_adapter_t *whole = NULL;
    CU_ASSERT_EQUAL_FATAL(trainer_whole_adapter(t2, &whole), 0);
    if (g_rank == 0)
        memcpy(want, whole->params, sizeof *want * n);
    CU_ASSERT_EQUAL_FATAL(comm_bcast(g_c, want, n, DT_F32, 0), 0);
    trainer_destroy(&t2);
    CU_ASSERT_EQUAL(comm_destroy(&two), 0);

    /* One rank and all ranks resume the same adapter, step and optimizer state. */
    trainer_t *t1 = ep_trainer(&f, NULL), *tn = ep_trainer(&f, g_c);
    int rc = checkpoint_resume_trainer(t1, run, 0, NULL, NULL, 0, NULL);
    if (rc < 0)
        tu_report("rank %d: resume on 1 rank: %s", g_rank, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    rc = checkpoint_resume_trainer(tn, run, 0, NULL, NULL, 0, NULL);
    if (rc < 0)
        tu_report("rank %d: resume on %d ranks: %s", g_rank, g_size, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_EQUAL(t1->step, 2);
    CU_ASSERT_EQUAL(tn->step, 2);
    CU_ASSERT_EQUAL(tn->optim.step, 2);
    check_shard(t1, t1->adapter->params, want, n, 0.0, 0, "resumed on 1 rank");
    check_shard(tn, tn->adapter->params, want, n, 0.0, 0, "resumed on all ranks");
    check_whole(tn, want, n, 0.0, "resumed on all ranks");
    /* Both go on alike (the AdamW moments were re-sharded too). */
    step_both(t1, tn, g, 3);
    check_shard(tn, tn->adapter->params, t1->adapter->params, n, TOL, 1, "a step after resume");

    CU_ASSERT_EQUAL(comm_barrier(g_c), 0);
    free(want);
    lf_free_groups(g, 4);
    trainer_destroy(&t1);
    trainer_destroy(&tn);
    trainer_destroy(&ref);
    lf_close(&f);
}

static void test_checkpoint_reshard(void) {
    run_checkpoint_reshard(0);
}

static void test_checkpoint_reshard_full(void) {
    run_checkpoint_reshard(1);
}

/* E = N + 1 routed experts over N ranks: refused, naming both. */
static void test_uneven_experts(void) {
    if (g_size < 2)
        return;
    lf_t f;
    lf_open(&f);
    model_config_t c;
    CU_ASSERT_EQUAL_FATAL(init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_TINY, DT_F32), 0);
    c.num_experts = g_size + 1;
    char dir[700];
    snprintf(dir, sizeof dir, "%s/uneven", f.dir);
    init_model_opts_t io = {3, 0.1f};
    CU_ASSERT_EQUAL_FATAL(init_model_write(dir, &c, &io), 0);
    lf_set(&f, "model.path", dir);
    trainer_opts_t o = trainer_opts_default();
    o.comm = g_c;
    trainer_t *t = NULL;
    CU_ASSERT_EQUAL(trainer_new(&t, &f.cfg, NULL, &o), MO_ECONFIG);
    CU_ASSERT_PTR_NULL(t);
    char e[32], nn[32];
    snprintf(e, sizeof e, "E = %d", g_size + 1);
    snprintf(nn, sizeof nn, "N = %d", g_size);
    if (!strstr(mo_last_error(), e) || !strstr(mo_last_error(), nn))
        tu_report("message: %s", mo_last_error());
    CU_ASSERT(strstr(mo_last_error(), e) != NULL);
    CU_ASSERT(strstr(mo_last_error(), nn) != NULL);
    lf_close(&f);
}

/* A device communicator whose ranks differ from the expert-parallel one's is refused,
 * naming both. */
static void test_device_comm_mismatch(void) {
    if (g_size < 2)
        return;
    lf_t f;
    lf_open(&f);
    comm_t *one = sub_new(g_rank); /* each rank alone */
    trainer_opts_t o = trainer_opts_default();
    o.comm = g_c;
    o.device_comm = one;
    trainer_t *t = NULL;
    CU_ASSERT_EQUAL(trainer_new(&t, &f.cfg, NULL, &o), MO_EINVAL);
    CU_ASSERT_PTR_NULL(t);
    char mine[64], theirs[64];
    snprintf(mine, sizeof mine, "rank 0 of 1");
    snprintf(theirs, sizeof theirs, "rank %d of %d", g_rank, g_size);
    if (!strstr(mo_last_error(), mine) || !strstr(mo_last_error(), theirs))
        tu_report("message: %s", mo_last_error());
    CU_ASSERT(strstr(mo_last_error(), mine) != NULL);
    CU_ASSERT(strstr(mo_last_error(), theirs) != NULL);
    CU_ASSERT_EQUAL(comm_destroy(&one), 0);
    lf_close(&f);
}

#ifdef MOERL_HAVE_CUDA
/* 1 when every rank sees a CUDA device (the host twins see one), else 0 after saying why
 * the device cases are skipped (collective). */
static int all_have_device(void) {
    int n = 0;
    int64_t none = cudaGetDeviceCount(&n) != cudaSuccess || n < 1;
    CU_ASSERT_EQUAL_FATAL(comm_allreduce_sum(g_c, &none, &none, 1, DT_I64), 0);
    if (none && g_rank == 0)
        printf("\n  %lld rank(s) without a CUDA device: the device case is skipped\n",
               (long long)none);
    return none == 0;
}

/* The sharded trainer on the device (its MoE layers exchange rows over the MPI comm,
 * staged through host memory) against one CPU rank. */
static void test_train_equal_cuda(void) {
    if (all_have_device())
        run_equal_on(0, 0, 0, 1, NULL);
}

static void test_train_equal_cuda_replay_kl(void) {
    if (all_have_device())
        run_equal_on(1, 1, 0, 1, NULL);
}

/* A communicator on device memory with g_c's ranks, or NULL after saying why there is
 * none (collective). The host twin's device memory is host memory: there an MPI
 * communicator that says its buffers are on the device stands for NCCL, and the
 * exchanges go to it unstaged as they go to NCCL on GPUs. */
static comm_t *device_comm_new(void) {
    comm_t *dc = NULL;
#ifdef MOERL_HOST_TWIN
    CU_ASSERT_EQUAL_FATAL(comm_mpi_new(&dc), 0);
    dc->device = DEV_CUDA;
#elif defined(MOERL_HAVE_NCCL)
    int n = 0;
    int64_t short_of = cudaGetDeviceCount(&n) != cudaSuccess || n < comm_local_size(g_c);
    CU_ASSERT_EQUAL_FATAL(comm_allreduce_sum(g_c, &short_of, &short_of, 1, DT_I64), 0);
    if (short_of) {
        if (g_rank == 0)
            printf("\n  %lld rank(s) share a GPU: NCCL needs one each, the case is skipped\n",
                   (long long)short_of);
        return NULL;
    }
    int rc = comm_init_from_env(&dc, "nccl");
    if (rc < 0)
        tu_report("rank %d: the NCCL communicator: %s", g_rank, mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
#else
    if (g_rank == 0)
        printf("\n  this build has no NCCL: the case is skipped\n");
#endif
    return dc;
}

/* The same with the MoE layers' rows exchanged over a device-memory communicator (NCCL:
 * learner.comm nccl), with routing replay, KL and entropy. */
static void test_train_equal_cuda_device_comm(void) {
    if (!all_have_device())
        return;
    comm_t *dc = device_comm_new();
    if (!dc)
        return;
    run_equal_on(1, 1, 0, 1, dc);
    CU_ASSERT_EQUAL(comm_destroy(&dc), 0);
}
#endif

static CU_TestInfo g_tests[] = {
    {"train_equal", test_train_equal},
    {"train_equal_replay_kl", test_train_equal_replay_kl},
    {"train_equal_full", test_train_equal_full},
    {"train_equal_full_replay", test_train_equal_full_replay},
    {"expert_memory", test_expert_memory},
    {"checkpoint_reshard", test_checkpoint_reshard},
    {"checkpoint_reshard_full", test_checkpoint_reshard_full},
    {"uneven_experts", test_uneven_experts},
    {"device_comm_mismatch", test_device_comm_mismatch},
#ifdef MOERL_HAVE_CUDA
    {"train_equal_cuda", test_train_equal_cuda},
    {"train_equal_cuda_replay_kl", test_train_equal_cuda_replay_kl},
    {"train_equal_cuda_device_comm", test_train_equal_cuda_device_comm},
#endif
    CU_TEST_INFO_NULL,
};

#ifdef MOERL_HAVE_CUDA
static CU_TestInfo g_device_tests[] = {
    {"train_equal_cuda", test_train_equal_cuda},
    {"train_equal_cuda_replay_kl", test_train_equal_cuda_replay_kl},
    {"train_equal_cuda_device_comm", test_train_equal_cuda_device_comm},
    CU_TEST_INFO_NULL,
};
#endif

/* The host twin (tests/host_cuda) runs the device cases only: the rest is the CPU suite's. */
#ifdef MOERL_HOST_TWIN
#define DEVICE_CASES_ONLY 1
#else
#define DEVICE_CASES_ONLY 0
#endif

int main(void) {
    if (comm_init_from_env(&g_c, "auto") < 0) {
        fprintf(stderr, "mpi_learner_ep: %s\n", mo_last_error());
        return 1;
    }
    g_rank = comm_rank(g_c);
    g_size = comm_size(g_c);
#ifdef MOERL_HAVE_CUDA
    CU_TestInfo *tests = DEVICE_CASES_ONLY ? g_device_tests : g_tests;
#else
    CU_TestInfo *tests = g_tests;
#endif
    int64_t failed = tu_main("mpi_learner_ep", tests) != 0;
    /* Every rank exits with the verdict of all ranks. */
    if (comm_allreduce_sum(g_c, &failed, &failed, 1, DT_I64) < 0) {
        fprintf(stderr, "mpi_learner_ep rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    if (failed && g_rank == 0)
        fprintf(stderr, "mpi_learner_ep: %lld of %d ranks failed\n", (long long)failed, g_size);
    if (comm_destroy(&g_c) < 0) {
        fprintf(stderr, "mpi_learner_ep rank %d: %s\n", g_rank, mo_last_error());
        failed = 1;
    }
    return failed ? 1 : 0;
}
