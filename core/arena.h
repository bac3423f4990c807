/* arena: bump allocation of per-step activations, reset (not freed) each step. */
#ifndef MOERL_CORE_ARENA_H
#define MOERL_CORE_ARENA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct arena_block arena_block_t;

typedef struct arena {
    arena_block_t *head; /* newest block first */
    size_t block_size;   /* minimum size of a new block */
    size_t used;         /* bytes handed out since the last reset */
    size_t peak;         /* largest `used` ever seen */
    size_t reserved;     /* bytes held from the system */
} arena_t;

/* block_size: the first block's size; later blocks grow as needed. */
void arena_init(arena_t *a, size_t block_size);
/* 64-byte aligned, uninitialised; NULL (with an error message) when out of memory. */
void *arena_alloc(arena_t *a, size_t bytes);
float *arena_floats(arena_t *a, size_t n);
/* Zero-filled. */
void *arena_calloc(arena_t *a, size_t bytes);
/* Forgets every allocation; keeps one block as large as the peak so the
 * next step allocates nothing from the system. */
void arena_reset(arena_t *a);
void arena_free(arena_t *a);

#ifdef __cplusplus
}
#endif
#endif
