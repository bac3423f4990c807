/* plugin: loads a reward plugin with dlopen, checks its ABI version and
 * symbols, and calls it under the contract of moerl_reward.h. */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "reward/reward_internal.h"

#define PLUGIN_ERR_CAP 512

typedef int (*abi_version_fn)(void);
typedef int (*init_fn)(const char *, void **, char *, size_t);
typedef int (*score_fn)(void *, const moerl_reward_input_t *, double *, char *, size_t);
typedef void (*fini_fn)(void *);
typedef unsigned (*flags_fn)(void);

struct reward_plugin {
    char *path;
    void *handle; /* from dlopen */
    void *state;  /* from moerl_reward_init */
    score_fn score;
    fini_fn fini;
    unsigned flags;
    pthread_mutex_t lock; /* serialises score unless MOERL_REWARD_THREAD_SAFE */
};

/* dlsym through a union: ISO C has no conversion from object to function
 * pointers, POSIX guarantees the representation. */
static void *plugin_sym(void *handle, const char *name, const char **why) {
    dlerror();
    void *p = dlsym(handle, name);
    const char *e = dlerror();
    *why = e ? e : "symbol is NULL";
    return e ? NULL : p;
}

#define PLUGIN_FN(type, ptr)                                                                       \
    (((union {                                                                                     \
         void *obj;                                                                                \
         type fn;                                                                                  \
     }){.obj = (ptr)})                                                                             \
         .fn)

static int plugin_resolve(reward_plugin_t *p, init_fn *init) {
    static const char *const required[] = {"moerl_reward_abi_version", "moerl_reward_init",
                                           "moerl_reward_score", "moerl_reward_fini"};
    void *sym[4];
    for (int i = 0; i < 4; i++) {
        const char *why;
        sym[i] = plugin_sym(p->handle, required[i], &why);
        if (!sym[i])
            return mo_errorf(MO_ENOTFOUND, "reward plugin %s: missing required symbol %s (%s)",
                             p->path, required[i], why);
    }
    int version = PLUGIN_FN(abi_version_fn, sym[0])();
    if (version != MOERL_REWARD_ABI_VERSION)
        return mo_errorf(MO_EUNSUPPORTED,
                         "reward plugin %s: ABI version %d, but this moerl loads version %d "
                         "(rebuild the plugin against this moerl's reward/moerl_reward.h)",
                         p->path, version, MOERL_REWARD_ABI_VERSION);
    *init = PLUGIN_FN(init_fn, sym[1]);
    p->score = PLUGIN_FN(score_fn, sym[2]);
    p->fini = PLUGIN_FN(fini_fn, sym[3]);
    const char *why;
    void *flags = plugin_sym(p->handle, "moerl_reward_flags", &why);
    p->flags = flags ? PLUGIN_FN(flags_fn, flags)() : 0u;
    return MO_OK;
}

static int plugin_init(reward_plugin_t *p, init_fn init, const char *args) {
    char err[PLUGIN_ERR_CAP];
    err[0] = '\0';
    void *state = NULL;
    int rc = init(args, &state, err, sizeof err);
    err[sizeof err - 1] = '\0';
    if (rc != 0)
        return mo_errorf(MO_EINVAL,
                         "reward plugin %s: moerl_reward_init(\"%.200s\") failed (%d): %s", p->path,
                         args, rc, err[0] ? err : "no reason given");
    p->state = state;
    return MO_OK;
}

int reward_plugin_open(const char *path, const char *args, reward_plugin_t **out) {
    *out = NULL;
    if (!path || !path[0])
        return mo_errorf(MO_EINVAL, "reward plugin: empty library path");
    if (!args)
        args = "";
    reward_plugin_t *p = calloc(1, sizeof *p);
    if (!p || !(p->path = strdup(path))) {
        free(p);
        return mo_errorf(MO_ENOMEM, "reward plugin %s: out of memory", path);
    }
    dlerror();
    p->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    int rc = MO_OK;
    init_fn init = NULL;
    if (!p->handle) {
        const char *e = dlerror();
        rc = mo_errorf(MO_EIO, "reward plugin %s: cannot load: %s", path, e ? e : "unknown error");
    }
    if (rc == MO_OK)
        rc = plugin_resolve(p, &init);
    if (rc == MO_OK)
        rc = plugin_init(p, init, args);
    if (rc == MO_OK && pthread_mutex_init(&p->lock, NULL) != 0) {
        p->fini(p->state);
        rc = mo_errorf(MO_ENOMEM, "reward plugin %s: cannot create its lock", path);
    }
    if (rc != MO_OK) {
        if (p->handle)
            dlclose(p->handle);
        free(p->path);
        free(p);
        return rc;
    }
    *out = p;
    return MO_OK;
}

int reward_plugin_score(reward_plugin_t *p, const reward_input_t *in, double *reward, char *detail,
                        size_t cap) {
    char info[REWARD_DETAIL_CAP];
    info[0] = '\0';
    double r = NAN;
    int locked = !(p->flags & MOERL_REWARD_THREAD_SAFE);
    if (locked)
        pthread_mutex_lock(&p->lock);
    int rc = p->score(p->state, in, &r, info, sizeof info);
    if (locked)
        pthread_mutex_unlock(&p->lock);
    info[sizeof info - 1] = '\0';
    if (rc < 0)
        return mo_errorf(MO_EINVAL, "reward plugin %s: score failed (%d): %s", p->path, rc,
                         info[0] ? info : "no reason given");
    if (rc > 0)
        return mo_errorf(MO_EINVAL,
                         "reward plugin %s: score returned %d (positive values are reserved)",
                         p->path, rc);
    if (!isfinite(r))
        return mo_errorf(MO_EINVAL, "reward plugin %s: non-finite reward %g", p->path, r);
    *reward = r;
    reward_detailf(detail, cap, "%s", info);
    return MO_OK;
}

void reward_plugin_close(reward_plugin_t **pp) {
    reward_plugin_t *p = *pp;
    if (!p)
        return;
    p->fini(p->state);
    pthread_mutex_destroy(&p->lock);
    dlclose(p->handle);
    free(p->path);
    free(p);
    *pp = NULL;
}
