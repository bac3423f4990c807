/* actor_exec: the learner's policy model on the host or on the CUDA device. */
#include "learner/actor_exec.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

#ifdef MOERL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "actor/model_cuda.h"
#include "core/backend.h"
#include "core/comm.h"
#include "core/cuda/backend_cuda.h"
#endif

struct actor_exec {
    model_t *m;
    device_t dev;
#ifdef MOERL_HAVE_CUDA
    model_cuda_t *mc;
    char dev_name[300]; /* the device: "cuda:ORDINAL NAME" */
#endif
    uint16_t *route; /* (cap, M, K) the experts used, when the caller asks for none */
    int route_cap;   /* tokens route holds */
};

#ifdef MOERL_HAVE_CUDA
/* With expert parallelism the ranks on one host take the visible GPUs in turn (local rank
 * modulo their count; ranks may share one). Without devices the upload says so. */
static int select_rank_device(const model_t *m) {
    int n = 0;
    if (!m->comm || comm_size(m->comm) < 2 || cudaGetDeviceCount(&n) != cudaSuccess || n < 1)
        return MO_OK;
    int ord = comm_local_rank(m->comm) % n, rc = backend_cuda_select_device(ord);
    if (rc == MO_ESTATE) /* the backend is already bound (this process used it before) */
        return MO_OK;
    return rc < 0 ? mo_error_wrap(rc, "run.device: cuda: rank %d's GPU %d",
                                  comm_rank(m->comm), ord)
                  : MO_OK;
}
#endif

int actor_exec_new(actor_exec_t **out, model_t *m, device_t dev) {
    *out = NULL;
    if (!m)
        return mo_errorf(MO_EINVAL, "actor_exec: no model");
    if (dev != DEV_CPU && dev != DEV_CUDA)
        return mo_errorf(MO_EINVAL, "actor_exec: unknown device %d", (int)dev);
#ifndef MOERL_HAVE_CUDA
    if (dev == DEV_CUDA)
        return mo_errorf(MO_ECONFIG,
                         "run.device: cuda: this build has no CUDA backend (configure with "
                         "-DMOERL_CUDA=ON on a machine with the CUDA Toolkit), use cpu");
#else
    if (dev == DEV_CUDA)
        TRY(select_rank_device(m));
    if (dev == DEV_CUDA && m->opts.aux_coef > 0.0f)
        return mo_errorf(MO_ECONFIG,
                         "run.device: cuda: the balance loss (aux_coef %g > 0) is not formed by "
                         "the CUDA training step (%s); use cpu",
                         (double)m->opts.aux_coef, m->path ? m->path : "model");
#endif
    actor_exec_t *x = calloc(1, sizeof *x);
    if (!x)
        return mo_errorf(MO_ENOMEM, "actor_exec: out of memory");
    x->m = m;
    x->dev = dev;
#ifdef MOERL_HAVE_CUDA
    if (dev == DEV_CUDA) {
        int rc = model_cuda_upload(&x->mc, m);
        if (rc < 0) {
            free(x);
            if (rc == MO_EDEVICE)
                return mo_error_wrap(rc, "run.device: cuda: the learner's model cannot use "
                                         "the GPU");
            return mo_error_wrap(rc, "run.device: cuda: the model cannot run on the GPU%s",
                                 rc == MO_ECONFIG ? " (use cpu)" : "");
        }
        /* The learner steps on another thread than the one that builds it: the upload's
         * work, queued on this thread's stream, is done before that. */
        const backend_t *be = backend_get(DEV_CUDA);
        rc = be ? be->synchronize(be) : MO_EDEVICE;
        if (rc < 0) {
            actor_exec_destroy(&x);
            return mo_error_wrap(rc, "run.device: cuda: uploading the model");
        }
        cuda_device_info_t info;
        if (backend_cuda_device_info(&info) == MO_OK)
            snprintf(x->dev_name, sizeof x->dev_name, "cuda:%d %s", info.ordinal, info.name);
        else
            snprintf(x->dev_name, sizeof x->dev_name, "cuda");
    }
#endif
    *out = x;
    return MO_OK;
}

void actor_exec_destroy(actor_exec_t **px) {
    if (!px || !*px)
        return;
    actor_exec_t *x = *px;
#ifdef MOERL_HAVE_CUDA
    model_cuda_free(&x->mc);
#endif
    free(x->route);
    free(x);
    *px = NULL;
}

device_t actor_exec_device(const actor_exec_t *x) {
    return x ? x->dev : DEV_CPU;
}

void actor_exec_describe(const actor_exec_t *x, char *buf, size_t cap) {
    if (!cap)
        return;
    if (!x || x->dev == DEV_CPU) {
        snprintf(buf, cap,
                 "the model (training step and scoring) runs on the CPU, and so do the "
                 "rollout workers' engines");
        return;
    }
#ifdef MOERL_HAVE_CUDA
    snprintf(buf, cap,
             "the model (training step and scoring) runs on the GPU (%s); the loss, AdamW and "
             "evaluation run on the CPU; the rollout workers' engines run on the GPU",
             x->dev_name);
#else
    snprintf(buf, cap, "cuda, which this build lacks");
#endif
}

#ifdef MOERL_HAVE_CUDA
/* The loads of every layer (and the token count after them) summed over the ranks of
 * expert parallelism, as moe_ep_forward's stats describe the global batch (collective). */
static int global_loads(model_t *m, int64_t *T) {
    if (!m->comm || comm_size(m->comm) < 2)
        return MO_OK;
    size_t ME = (size_t)m->n_moe * m->E;
    int64_t *v = malloc(sizeof *v * (ME + 1));
    if (!v)
        return mo_errorf(MO_ENOMEM, "actor_exec: out of memory for the expert loads");
    for (int l = 0; l < m->n_moe; l++)
        memcpy(v + (size_t)l * m->E, m->stats[l].load, sizeof *v * (size_t)m->E);
    v[ME] = *T;
    int rc = comm_allreduce_sum(m->comm, v, v, ME + 1, DT_I64);
    for (int l = 0; rc == MO_OK && l < m->n_moe; l++)
        memcpy(m->stats[l].load, v + (size_t)l * m->E, sizeof *v * (size_t)m->E);
    *T = v[ME];
    free(v);
    return rc;
}

/* model_t.stats from the experts used, as the host forward records them. */
static int set_stats(model_t *m, const uint16_t *route, int T) {
    int M = m->n_moe, E = m->E, K = m->K;
    for (int l = 0; l < M; l++) {
        model_moe_stats_t *s = &m->stats[l];
        memset(s->load, 0, sizeof(int64_t) * (size_t)E);
        if (s->prob_mean)
            memset(s->prob_mean, 0, sizeof(float) * (size_t)E);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) {
                int e = route[((size_t)t * M + l) * K + j];
                if (e < E)
                    s->load[e]++;
            }
    }
    int64_t Tg = T;
    TRY(global_loads(m, &Tg));
    for (int l = 0; l < M; l++) {
        model_moe_stats_t *s = &m->stats[l];
        int64_t mx = 0, n = Tg * K;
        for (int e = 0; e < E; e++)
            mx = s->load[e] > mx ? s->load[e] : mx;
        s->imbalance = n > 0 ? (float)((double)mx * E / (double)n) : 0.0f;
        s->aux_loss = 0.0f;
    }
    return MO_OK;
}

static int route_ready(actor_exec_t *x, int T) {
    if (T <= x->route_cap)
        return MO_OK;
    size_t row = (size_t)x->m->n_moe * x->m->K;
    uint16_t *r = realloc(x->route, sizeof *r * row * (size_t)T);
    if (!r)
        return mo_errorf(MO_ENOMEM, "actor_exec: out of memory for %d tokens of routing", T);
    x->route = r;
    x->route_cap = T;
    return MO_OK;
}

static int forward_cuda(actor_exec_t *x, const model_batch_t *b, float *logp, float *entropy,
                        int for_backward) {
    model_t *m = x->m;
    model_batch_t bb = *b;
    if (m->n_moe > 0 && !bb.routing && b->T > 0) {
        TRY(route_ready(x, b->T));
        bb.routing = x->route;
    }
    if (for_backward) {
        TRY(model_cuda_forward_train(x->mc, &bb, logp, entropy));
    } else {
        int use_adapter = m->adapter != NULL;
        if (use_adapter && !model_cuda_has_adapter(x->mc))
            return mo_errorf(MO_ESTATE,
                             "actor_exec: the model was uploaded without an adapter; another "
                             "was bound since");
        TRY(model_cuda_logprobs(x->mc, &bb, logp, entropy, use_adapter));
    }
    return m->n_moe > 0 ? set_stats(m, bb.routing, b->T) : MO_OK;
}
#endif

int actor_exec_forward(actor_exec_t *x, const model_batch_t *b, float *logp, float *entropy,
                       int for_backward) {
    if (x->dev == DEV_CPU)
        return model_forward(x->m, b, logp, entropy, for_backward);
#ifdef MOERL_HAVE_CUDA
    return forward_cuda(x, b, logp, entropy, for_backward);
#else
    return mo_errorf(MO_ECONFIG, "actor_exec: this build has no CUDA backend");
#endif
}

int actor_exec_backward(actor_exec_t *x, const float *dlogp, const float *dentropy) {
    if (x->dev == DEV_CPU)
        return model_backward(x->m, dlogp, dentropy);
#ifdef MOERL_HAVE_CUDA
    return model_cuda_backward(x->mc, dlogp, dentropy);
#else
    return mo_errorf(MO_ECONFIG, "actor_exec: this build has no CUDA backend");
#endif
}

int actor_exec_sync(actor_exec_t *x) {
    if (x->dev == DEV_CPU)
        return MO_OK;
#ifdef MOERL_HAVE_CUDA
    if (!model_cuda_has_adapter(x->mc))
        return MO_OK;
    return model_cuda_sync_adapter(x->mc);
#else
    return mo_errorf(MO_ECONFIG, "actor_exec: this build has no CUDA backend");
#endif
}
