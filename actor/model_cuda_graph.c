/* model_cuda_graph: the decode step's device work recorded once as a CUDA graph and
 * replayed, one launch in place of the layers' hundreds (model_cuda_decode_graphs). */
#include "actor/model_cuda.h"

#ifdef MOERL_HAVE_CUDA

#include "actor/model_cuda_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cuda/backend_cuda.h"
#include "core/status.h"

/* Graphs kept: the least recently used goes when a new shape needs a place. */
#define MC_GRAPHS 32

/* One recorded shape of the step: its key, and the graph once recorded. */
typedef struct mc_graph {
    mc_graph_key_t key;
    int used;       /* the slot holds a key */
    int warm;       /* an ordinary step ran with this key at epoch */
    uint64_t epoch; /* backend_cuda_memory_epoch of the buffers g (or the warm step) used */
    uint64_t last;  /* the tick of its last use */
    cuda_graph_t *g;
} mc_graph_t;

struct mc_graphs {
    model_cuda_graph_stats_t st;
    uint64_t tick;
    mc_graph_t e[MC_GRAPHS];
};

static void drop_graph(mc_graph_t *e) {
    backend_cuda_graph_free(e->g); /* an in-flight graph is freed when it completes */
    e->g = NULL;
}

void mc_graphs_free(model_cuda_t *mc) {
    if (!mc->graphs)
        return;
    for (int i = 0; i < MC_GRAPHS; i++)
        drop_graph(&mc->graphs->e[i]);
    free(mc->graphs);
    mc->graphs = NULL;
}

int model_cuda_decode_graphs(model_cuda_t *mc, int on) {
    if (!mc)
        return mo_errorf(MO_EINVAL, "model_cuda_decode_graphs: no uploaded model");
    if (!on) {
        mc_graphs_free(mc);
        return MO_OK;
    }
    if (mc->graphs)
        return MO_OK;
    mc->graphs = calloc(1, sizeof *mc->graphs);
    if (!mc->graphs)
        return mo_errorf(MO_ENOMEM, "model_cuda_decode_graphs: out of memory");
    if (mc->ep)
        snprintf(mc->graphs->st.off_reason, sizeof mc->graphs->st.off_reason, "%s",
                 "expert parallelism waits on the host in every MoE layer");
    return MO_OK;
}

void model_cuda_graph_stats(const model_cuda_t *mc, model_cuda_graph_stats_t *s) {
    memset(s, 0, sizeof *s);
    if (mc && mc->graphs)
        *s = mc->graphs->st;
}

static int same_key(const mc_graph_key_t *a, const mc_graph_key_t *b) {
    return a->N == b->N && a->max_blocks == b->max_blocks && a->ad == b->ad && a->NB == b->NB &&
           a->BS == b->BS && a->kv == b->kv;
}

/* The slot of key: its own, else a free one, else the least recently used (emptied). */
static mc_graph_t *slot_of(struct mc_graphs *gs, const mc_graph_key_t *key) {
    mc_graph_t *lru = &gs->e[0];
    for (int i = 0; i < MC_GRAPHS; i++) {
        mc_graph_t *e = &gs->e[i];
        if (e->used && same_key(&e->key, key))
            return e;
        if (!e->used || (lru->used && e->last < lru->last))
            lru = e;
    }
    drop_graph(lru);
    memset(lru, 0, sizeof *lru);
    lru->key = *key;
    lru->used = 1;
    return lru;
}

/* Graphs off for good, saying why (the first reason is kept). */
static void give_up(struct mc_graphs *gs, const char *why) {
    if (!gs->st.off_reason[0])
        snprintf(gs->st.off_reason, sizeof gs->st.off_reason, "%s", why);
}

/* Records work into a graph and launches it, or runs it as it is when recording fails
 * (graphs then stay off, with the reason). */
static int capture(struct mc_graphs *gs, mc_graph_t *e, uint64_t epoch, mc_work_fn work,
                   model_cuda_t *mc, void *arg) {
    int rc = backend_cuda_capture_begin();
    if (rc < 0) {
        give_up(gs, mo_last_error());
        gs->st.eager++;
        return work(mc, arg);
    }
    rc = work(mc, arg);
    char why[sizeof gs->st.off_reason];
    snprintf(why, sizeof why, "%s", rc < 0 ? mo_last_error() : "");
    cuda_graph_t *g = NULL;
    int rc2 = backend_cuda_capture_end(&g, rc < 0);
    if (rc2 < 0)
        snprintf(why, sizeof why, "%s", mo_last_error());
    else if (rc == MO_OK && backend_cuda_memory_epoch() != epoch)
        snprintf(why, sizeof why, "%s", "the step allocated device memory while recorded");
    if (rc < 0 || rc2 < 0 || why[0]) {
        backend_cuda_graph_free(g);
        give_up(gs, why);
        gs->st.eager++;
        return work(mc, arg); /* nothing recorded ran */
    }
    e->g = g;
    e->epoch = epoch;
    gs->st.captured++;
    gs->st.replayed++;
    return backend_cuda_graph_launch(g);
}

int mc_graph_run(model_cuda_t *mc, const mc_graph_key_t *key, mc_work_fn work, void *arg) {
    struct mc_graphs *gs = mc->graphs;
    if (!gs || gs->st.off_reason[0]) {
        if (gs)
            gs->st.eager++;
        return work(mc, arg);
    }
    uint64_t epoch = backend_cuda_memory_epoch();
    mc_graph_t *e = slot_of(gs, key);
    e->last = ++gs->tick;
    if (e->g && e->epoch == epoch) {
        gs->st.replayed++;
        return backend_cuda_graph_launch(e->g);
    }
    if (e->g) { /* a buffer it holds may have moved */
        drop_graph(e);
        e->warm = 0;
        gs->st.invalidated++;
    }
    if (!e->warm || e->epoch != epoch) { /* an ordinary step first settles every buffer */
        int rc = work(mc, arg);
        e->warm = rc == MO_OK;
        e->epoch = backend_cuda_memory_epoch();
        gs->st.eager++;
        return rc;
    }
    return capture(gs, e, epoch, work, mc, arg);
}

#endif /* MOERL_HAVE_CUDA */
