/* scratch: grow-only per-thread scratch buffers for CPU ops. */
#include "core/cpu/scratch.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/status.h"

typedef struct scratch {
    float *buf[CPU_SCRATCH_SLOTS];
    size_t cap[CPU_SCRATCH_SLOTS]; /* in floats */
} scratch_t;

/* The fast path reads the thread-local pointer; the pthread key only exists
 * so that a thread's buffers are freed when it exits. */
static _Thread_local scratch_t *t_scratch;
static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void scratch_free(scratch_t *s) {
    for (int i = 0; i < CPU_SCRATCH_SLOTS; i++)
        free(s->buf[i]);
    free(s);
}

static void thread_exit_cb(void *p) {
    scratch_free(p);
    t_scratch = NULL;
}

/* exit() runs no key destructor for the thread that calls it. */
static void process_exit_cb(void) {
    cpu_scratch_release();
}

static void scratch_once(void) {
    if (pthread_key_create(&g_key, thread_exit_cb) != 0)
        MO_ASSERT(!"cpu_scratch: pthread_key_create failed");
    atexit(process_exit_cb);
}

static _Noreturn void scratch_oom(size_t bytes) {
    fprintf(stderr, "moerl: out of memory allocating %zu bytes of CPU scratch\n", bytes);
    abort();
}

float *cpu_scratch_floats(int slot, size_t n) {
    MO_ASSERT(slot >= 0 && slot < CPU_SCRATCH_SLOTS);
    scratch_t *s = t_scratch;
    if (!s) {
        pthread_once(&g_once, scratch_once);
        s = calloc(1, sizeof *s);
        if (!s)
            scratch_oom(sizeof *s);
        t_scratch = s;
        pthread_setspecific(g_key, s);
    }
    if (n > s->cap[slot] || !s->buf[slot]) {
        size_t cap = n < 16 ? 16 : n;
        cap = (cap + 15) / 16 * 16; /* whole 64-byte lines */
        if (cap > s->cap[slot] && cap < s->cap[slot] + s->cap[slot] / 2)
            cap = (s->cap[slot] + s->cap[slot] / 2 + 15) / 16 * 16; /* grow geometrically */
        if (cap > ((size_t)-1) / sizeof(float))
            scratch_oom((size_t)-1);
        free(s->buf[slot]);
        s->buf[slot] = aligned_alloc(64, cap * sizeof(float));
        if (!s->buf[slot]) {
            s->cap[slot] = 0;
            scratch_oom(cap * sizeof(float));
        }
        s->cap[slot] = cap;
    }
    return s->buf[slot];
}

void cpu_scratch_release(void) {
    scratch_t *s = t_scratch;
    if (!s)
        return;
    t_scratch = NULL;
    pthread_setspecific(g_key, NULL);
    scratch_free(s);
}

size_t cpu_scratch_bytes(void) {
    scratch_t *s = t_scratch;
    size_t b = 0;
    if (s)
        for (int i = 0; i < CPU_SCRATCH_SLOTS; i++)
            b += s->cap[i] * sizeof(float);
    return b;
}
