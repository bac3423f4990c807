/* scratch: grow-only per-thread scratch buffers for CPU ops. */
#ifndef MOERL_CORE_CPU_SCRATCH_H
#define MOERL_CORE_CPU_SCRATCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Slots per thread, so that one op can hold several buffers at once. */
#define CPU_SCRATCH_SLOTS 4

/* A buffer of at least n floats, 64-byte aligned, owned by the calling
 * thread. Slot `slot` (0 .. CPU_SCRATCH_SLOTS-1) keeps its allocation between
 * calls and only grows, so the pointer is valid until the same thread asks the
 * same slot for more, or calls cpu_scratch_release. Contents are undefined.
 * Never returns NULL: running out of memory here aborts with a message (CPU
 * ops have no status to return).
 * Convention: an op uses its scratch only while it runs and never across a
 * call to another op (cpu_matmul_* use slot 0), so ops may share slots. */
float *cpu_scratch_floats(int slot, size_t n);

/* Frees the calling thread's buffers. Buffers of other threads are freed when
 * those threads exit; the main thread's are also freed at exit(). */
void cpu_scratch_release(void);

/* Bytes the calling thread holds in scratch buffers. */
size_t cpu_scratch_bytes(void);

#ifdef __cplusplus
}
#endif
#endif
