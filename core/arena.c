/* arena: bump allocation of per-step activations. */
#include "core/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

#define ARENA_ALIGN 64

struct arena_block {
    arena_block_t *next;
    size_t cap;
    size_t off;
    unsigned char *mem;
};

void arena_init(arena_t *a, size_t block_size) {
    memset(a, 0, sizeof *a);
    a->block_size = block_size ? block_size : ((size_t)1 << 20);
}

static arena_block_t *block_new(size_t cap) {
    arena_block_t *b = malloc(sizeof *b);
    if (!b)
        return NULL;
    b->mem = aligned_alloc(ARENA_ALIGN, cap);
    if (!b->mem) {
        free(b);
        return NULL;
    }
    b->cap = cap;
    b->off = 0;
    b->next = NULL;
    return b;
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

void *arena_alloc(arena_t *a, size_t bytes) {
    if (bytes > SIZE_MAX - ARENA_ALIGN) { /* rounding up would wrap around */
        mo_errorf(MO_ENOMEM, "arena: cannot allocate %zu bytes", bytes);
        return NULL;
    }
    size_t need = round_up(bytes ? bytes : 1, ARENA_ALIGN);
    arena_block_t *b = a->head;
    if (!b || b->cap - b->off < need) {
        size_t cap = round_up(need > a->block_size ? need : a->block_size, ARENA_ALIGN);
        arena_block_t *nb = block_new(cap);
        if (!nb) {
            mo_errorf(MO_ENOMEM, "arena: cannot allocate %zu bytes", cap);
            return NULL;
        }
        nb->next = a->head;
        a->head = nb;
        a->reserved += cap;
        b = nb;
    }
    void *p = b->mem + b->off;
    b->off += need;
    a->used += need;
    if (a->used > a->peak)
        a->peak = a->used;
    return p;
}

float *arena_floats(arena_t *a, size_t n) {
    if (n > SIZE_MAX / sizeof(float)) {
        mo_errorf(MO_ENOMEM, "arena: cannot allocate %zu floats", n);
        return NULL;
    }
    return arena_alloc(a, n * sizeof(float));
}

void *arena_calloc(arena_t *a, size_t bytes) {
    void *p = arena_alloc(a, bytes);
    if (p)
        memset(p, 0, bytes);
    return p;
}

static void free_blocks(arena_block_t *b) {
    while (b) {
        arena_block_t *next = b->next;
        free(b->mem);
        free(b);
        b = next;
    }
}

void arena_reset(arena_t *a) {
    if (a->head && a->head->next) {
        /* Several blocks: replace them by one that holds the whole peak. */
        free_blocks(a->head);
        a->head = NULL;
        a->reserved = 0;
        size_t cap = round_up(a->peak > a->block_size ? a->peak : a->block_size, ARENA_ALIGN);
        a->head = block_new(cap);
        if (a->head)
            a->reserved = cap;
    } else if (a->head) {
        a->head->off = 0;
    }
    a->used = 0;
}

void arena_free(arena_t *a) {
    free_blocks(a->head);
    memset(a, 0, sizeof *a);
}
