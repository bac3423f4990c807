/* ep_shard: LoRA adapter shards of the expert-parallel learner. */
#include "learner/ep_shard.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "moe/moe_ep.h"

int ep_shard_expert_of(const char *module) {
    for (const char *p = strstr(module, ".experts."); p; p = strstr(p + 1, ".experts.")) {
        const char *d = p + strlen(".experts.");
        if (!isdigit((unsigned char)*d))
            continue;
        long e = strtol(d, NULL, 10);
        return e >= 0 && e < 1000000 ? (int)e : -1;
    }
    return -1;
}

void ep_shard_destroy(ep_shard_t **pe) {
    ep_shard_t *ep = pe ? *pe : NULL;
    if (!ep)
        return;
    free(ep->full_off);
    free(ep->size);
    free(ep->owner);
    free(ep->shard_off);
    free(ep->counts);
    free(ep->displs);
    free(ep->sel);
    free(ep);
    *pe = NULL;
}

/* The tables of the whole adapter's entries (mods selected by ep->sel, in order). */
static int build_tables(ep_shard_t *ep, const lora_adapter_t *shard, int R) {
    int n = 0;
    for (int i = 0; i < ep->n_mods; i++)
        n += ep->sel[i];
    ep->n_full = n;
    size_t cnt = (size_t)(n > 0 ? n : 1);
    ep->full_off = malloc(sizeof *ep->full_off * cnt);
    ep->size = malloc(sizeof *ep->size * cnt);
    ep->owner = malloc(sizeof *ep->owner * cnt);
    ep->shard_off = malloc(sizeof *ep->shard_off * cnt);
    ep->counts = calloc((size_t)ep->N, sizeof *ep->counts);
    ep->displs = calloc((size_t)ep->N, sizeof *ep->displs);
    if (!ep->full_off || !ep->size || !ep->owner || !ep->shard_off || !ep->counts || !ep->displs)
        return mo_errorf(MO_ENOMEM, "ep_shard: out of memory for %d entries", n);
    size_t off = 0;
    for (int i = 0, j = 0; i < ep->n_mods; i++) {
        if (!ep->sel[i])
            continue;
        const lora_module_desc_t *d = &ep->mods[i];
        int e = d->kind == LORA_KIND_EXPERT ? ep_shard_expert_of(d->name) : -1;
        if (d->kind == LORA_KIND_EXPERT && (e < 0 || e >= ep->E))
            return mo_errorf(MO_EINVAL, "ep_shard: routed expert module \"%s\" names no expert "
                                        "in [0, %d)",
                             d->name, ep->E);
        ep->full_off[j] = off;
        ep->size[j] = (size_t)R * ((size_t)d->C + (size_t)d->OC);
        ep->owner[j] = e < 0 ? -1 : moe_ep_owner(ep->E, ep->N, e);
        int k = lora_adapter_find(shard, d->name);
        ep->shard_off[j] = k < 0 ? -1 : (int64_t)shard->entries[k].off_A;
        if (ep->owner[j] >= 0)
            ep->counts[ep->owner[j]] += (int64_t)ep->size[j];
        off += ep->size[j];
        j++;
    }
    ep->full_params = off;
    ep->n_lora = n;
    comm_displs_from_counts(ep->displs, ep->counts, ep->N);
    return MO_OK;
}

/* Grows the (n_full) tables to cap rows. */
static int grow_tables(ep_shard_t *ep, int cap) {
    size_t c = (size_t)cap;
    size_t *fo = realloc(ep->full_off, sizeof *fo * c);
    if (fo)
        ep->full_off = fo;
    size_t *sz = fo ? realloc(ep->size, sizeof *sz * c) : NULL;
    if (sz)
        ep->size = sz;
    int *ow = sz ? realloc(ep->owner, sizeof *ow * c) : NULL;
    if (ow)
        ep->owner = ow;
    int64_t *so = ow ? realloc(ep->shard_off, sizeof *so * c) : NULL;
    if (!so)
        return mo_errorf(MO_ENOMEM, "ep_shard: out of memory for %d entries", cap);
    ep->shard_off = so;
    return MO_OK;
}

int ep_shard_add_full(ep_shard_t *ep, const lora_adapter_t *shard) {
    if (ep->n_full != ep->n_lora)
        return mo_errorf(MO_ESTATE, "ep_shard: the full tensors are already in the plan");
    if (shard->n_full == 0)
        return MO_OK;
    TRY(grow_tables(ep, ep->n_lora + shard->n_full));
    for (int j = 0; j < shard->n_full; j++) {
        const lora_tensor_t *lt = &shard->tensors[shard->n_tensors - shard->n_full + j];
        int i = ep->n_lora + j;
        ep->full_off[i] = ep->full_params;
        ep->size[i] = lt->numel;
        ep->owner[i] = -1;
        ep->shard_off[i] = (int64_t)lt->offset;
        ep->full_params += lt->numel;
    }
    ep->n_full = ep->n_lora + shard->n_full;
    ep->shard = shard;
    return MO_OK;
}

int ep_shard_new(ep_shard_t **out, comm_t *cm, const lora_config_t *cfg,
                 const lora_module_desc_t *mods, int n_mods, int E, lora_adapter_t **shard) {
    *out = NULL;
    *shard = NULL;
    if (E > 0)
        TRY(moe_ep_check(E, comm_size(cm)));
    ep_shard_t *ep = calloc(1, sizeof *ep);
    unsigned char *own = malloc((size_t)(n_mods > 0 ? n_mods : 1));
    if (!ep || !own) {
        free(ep);
        free(own);
        return mo_errorf(MO_ENOMEM, "ep_shard: out of memory");
    }
    ep->comm = cm;
    ep->N = comm_size(cm);
    ep->rank = comm_rank(cm);
    ep->E = E;
    ep->mods = mods;
    ep->n_mods = n_mods;
    ep->lcfg = *cfg;
    ep->lcfg.no_grads = 1;
    ep->sel = malloc((size_t)(n_mods > 0 ? n_mods : 1));
    int rc = ep->sel ? lora_select_targets(ep->sel, mods, n_mods, cfg->targets, cfg->n_targets)
                     : mo_errorf(MO_ENOMEM, "ep_shard: out of memory");
    int e0 = 0, n = 0;
    if (rc == MO_OK) {
        moe_ep_experts(E, ep->N, ep->rank, &e0, &n);
        for (int i = 0; i < n_mods; i++) {
            int e = mods[i].kind == LORA_KIND_EXPERT ? ep_shard_expert_of(mods[i].name) : -1;
            own[i] = ep->sel[i] && (mods[i].kind != LORA_KIND_EXPERT || (e >= e0 && e < e0 + n));
        }
        lora_config_t sc = *cfg;
        sc.no_grads = 0;
        rc = lora_adapter_new_selected(shard, &sc, mods, n_mods, own);
    }
    free(own);
    if (rc == MO_OK) {
        ep->lcfg.targets = (const char *const *)(*shard)->targets;
        rc = build_tables(ep, *shard, cfg->rank);
    }
    if (rc < 0) {
        lora_adapter_destroy(shard);
        ep_shard_destroy(&ep);
        return rc;
    }
    *out = ep;
    return MO_OK;
}

int ep_shard_full_new(const ep_shard_t *ep, lora_adapter_t **full) {
    TRY(lora_adapter_new_selected(full, &ep->lcfg, ep->mods, ep->n_mods, ep->sel));
    int rc = MO_OK;
    for (int i = ep->n_lora; i < ep->n_full && rc == MO_OK; i++) {
        const lora_adapter_t *s = ep->shard;
        const lora_tensor_t *lt = &s->tensors[s->n_tensors - s->n_full + (i - ep->n_lora)];
        rc = lora_adapter_add_full(*full, lt->name, (int)lt->shape[0], (int)lt->shape[1],
                                   s->params + lt->offset);
    }
    if (rc < 0) {
        lora_adapter_destroy(full);
        return rc;
    }
    MO_ASSERT((*full)->n_params == ep->full_params);
    return MO_OK;
}

int ep_shard_gather(const ep_shard_t *ep, const float *shard, float *full) {
    int64_t mine = ep->counts[ep->rank];
    float *send = malloc(sizeof *send * (size_t)(mine > 0 ? mine : 1));
    float *recv = NULL;
    int64_t total = ep->displs[ep->N - 1] + ep->counts[ep->N - 1];
    if (ep->rank == 0)
        recv = malloc(sizeof *recv * (size_t)(total > 0 ? total : 1));
    if (!send || (ep->rank == 0 && !recv)) {
        free(send);
        free(recv);
        return mo_errorf(MO_ENOMEM, "ep_shard: out of memory gathering %lld floats",
                         (long long)total);
    }
    size_t o = 0;
    for (int i = 0; i < ep->n_full; i++)
        if (ep->owner[i] == ep->rank) {
            memcpy(send + o, shard + ep->shard_off[i], sizeof(float) * ep->size[i]);
            o += ep->size[i];
        }
    int rc = comm_gatherv(ep->comm, send, mine, recv, ep->counts, ep->displs, DT_F32, 0);
    if (rc == MO_OK && ep->rank == 0 && full) {
        int64_t *pos = calloc((size_t)ep->N, sizeof *pos);
        if (!pos)
            rc = mo_errorf(MO_ENOMEM, "ep_shard: out of memory");
        for (int i = 0; rc == MO_OK && i < ep->n_full; i++) {
            int p = ep->owner[i];
            const float *src = p < 0 ? shard + ep->shard_off[i] : recv + ep->displs[p] + pos[p];
            memcpy(full + ep->full_off[i], src, sizeof(float) * ep->size[i]);
            if (p >= 0)
                pos[p] += (int64_t)ep->size[i];
        }
        free(pos);
    }
    free(send);
    free(recv);
    return rc;
}

void ep_shard_extract(const ep_shard_t *ep, const float *full, float *shard) {
    for (int i = 0; i < ep->n_full; i++)
        if (ep->shard_off[i] >= 0)
            memcpy(shard + ep->shard_off[i], full + ep->full_off[i], sizeof(float) * ep->size[i]);
}

int ep_shard_grad_sqsum(const ep_shard_t *ep, const float *g, double *out) {
    double s = 0.0;
    for (int i = 0; i < ep->n_full; i++)
        if (ep->shard_off[i] >= 0 && (ep->owner[i] >= 0 || ep->rank == 0))
            s += optim_grad_sqsum(g + ep->shard_off[i], ep->size[i]);
    TRY(comm_allreduce_sum(ep->comm, &s, out, 1, DT_F64));
    return MO_OK;
}

int ep_shard_gather_state(const ep_shard_t *ep, const lora_adapter_t *shard, const optim_t *o,
                          lora_adapter_t *full, optim_t *full_o) {
    int root = ep->rank == 0;
    TRY(ep_shard_gather(ep, shard->params, root ? full->params : NULL));
    if (!o)
        return MO_OK;
    TRY(ep_shard_gather(ep, o->m, root && full_o ? full_o->m : NULL));
    TRY(ep_shard_gather(ep, o->v, root && full_o ? full_o->v : NULL));
    if (root && full_o) {
        full_o->step = o->step;
        full_o->skipped = o->skipped;
    }
    return MO_OK;
}

void ep_shard_extract_state(const ep_shard_t *ep, const lora_adapter_t *full,
                            const optim_t *full_o, lora_adapter_t *shard, optim_t *o) {
    ep_shard_extract(ep, full->params, shard->params);
    if (!o || !full_o)
        return;
    ep_shard_extract(ep, full_o->m, o->m);
    ep_shard_extract(ep, full_o->v, o->v);
    o->step = full_o->step;
    o->skipped = full_o->skipped;
}

int ep_shard_any_failed(const ep_shard_t *ep, int rc) {
    int32_t bad = rc < 0, sum = 1;
    if (comm_allreduce_sum(ep->comm, &bad, &sum, 1, DT_I32) < 0)
        return 1;
    return sum > 0;
}
