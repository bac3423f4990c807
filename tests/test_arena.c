/* Tests of arena: alignment, growth past a block, reset into one block that
 * holds the peak, zero-filled allocation, usage and peak accounting. */
#include <stdint.h>
#include <string.h>

#include "core/arena.h"
#include "core/status.h"
#include "tests/testutil.h"

static size_t up64(size_t n) {
    return (n + 63) / 64 * 64;
}

static void test_alignment_and_disjoint(void) {
    arena_t a;
    arena_init(&a, 4096);
    static const size_t sizes[] = {1, 0, 63, 64, 65, 100, 3000, 5000, 7, 129};
    unsigned char *p[10];
    for (int i = 0; i < 10; i++) {
        p[i] = arena_alloc(&a, sizes[i]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(p[i]);
        CU_ASSERT_EQUAL((uintptr_t)p[i] % 64, 0);
        memset(p[i], i + 1, sizes[i]);
    }
    /* No allocation overwrote another. */
    for (int i = 0; i < 10; i++)
        for (size_t j = 0; j < sizes[i]; j++)
            if (p[i][j] != (unsigned char)(i + 1)) {
                CU_FAIL("allocations overlap");
                break;
            }
    CU_ASSERT(p[0] != p[1]); /* a zero-byte request still gets its own address */
    float *f = arena_floats(&a, 33);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL((uintptr_t)f % 64, 0);
    for (int i = 0; i < 33; i++)
        f[i] = (float)i;
    arena_free(&a);
    CU_ASSERT_PTR_NULL(a.head);
    CU_ASSERT_EQUAL(a.reserved, 0);
}

static void test_growth_and_accounting(void) {
    arena_t a;
    arena_init(&a, 1000);
    CU_ASSERT_EQUAL(a.reserved, 0); /* nothing held before the first allocation */
    void *p1 = arena_alloc(&a, 600);
    CU_ASSERT_EQUAL(a.used, 640);
    CU_ASSERT_EQUAL(a.reserved, 1024); /* the first block: block_size rounded to 64 */
    void *p2 = arena_alloc(&a, 600);   /* does not fit the 384 bytes left */
    CU_ASSERT_PTR_NOT_NULL(p1);
    CU_ASSERT_PTR_NOT_NULL(p2);
    CU_ASSERT_EQUAL(a.used, 1280);
    CU_ASSERT_EQUAL(a.reserved, 2048);
    void *p3 = arena_alloc(&a, 5000); /* larger than a block: a block of its own size */
    CU_ASSERT_PTR_NOT_NULL(p3);
    CU_ASSERT_EQUAL(a.used, 1280 + up64(5000));
    CU_ASSERT_EQUAL(a.reserved, 2048 + up64(5000));
    CU_ASSERT_EQUAL(a.peak, a.used);
    memset(p3, 0x5a, 5000);
    size_t peak = a.peak;

    /* Reset: one block as large as the peak replaces the three. */
    arena_reset(&a);
    CU_ASSERT_EQUAL(a.used, 0);
    CU_ASSERT_EQUAL(a.peak, peak);
    CU_ASSERT_EQUAL(a.reserved, up64(peak));
    arena_block_t *head = a.head;
    CU_ASSERT_PTR_NOT_NULL(head);

    /* The same step again takes nothing from the system. */
    for (int step = 0; step < 3; step++) {
        CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, 600));
        CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, 600));
        CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, 5000));
        CU_ASSERT_EQUAL(a.used, peak);
        CU_ASSERT_PTR_EQUAL(a.head, head);
        CU_ASSERT_EQUAL(a.reserved, up64(peak));
        arena_reset(&a);
        CU_ASSERT_PTR_EQUAL(a.head, head);
        CU_ASSERT_EQUAL(a.peak, peak);
    }

    /* A smaller step leaves the peak alone; a larger one raises it. */
    CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, 100));
    CU_ASSERT_EQUAL(a.used, 128);
    CU_ASSERT_EQUAL(a.peak, peak);
    CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, peak));
    CU_ASSERT_EQUAL(a.used, 128 + up64(peak));
    CU_ASSERT_EQUAL(a.peak, 128 + up64(peak));
    arena_reset(&a);
    CU_ASSERT_EQUAL(a.reserved, up64(128 + up64(peak)));
    arena_free(&a);
}

static void test_calloc_zeroes(void) {
    arena_t a;
    arena_init(&a, 0); /* 0 picks the default block size */
    CU_ASSERT(a.block_size > 0);
    unsigned char *p = arena_alloc(&a, 777);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    memset(p, 0xab, 777);
    arena_reset(&a);
    unsigned char *z = arena_calloc(&a, 777);
    CU_ASSERT_PTR_EQUAL(z, p); /* the dirty memory is handed out again */
    int nonzero = 0;
    for (int i = 0; i < 777; i++)
        nonzero += z[i] != 0;
    CU_ASSERT_EQUAL(nonzero, 0);
    arena_free(&a);
}

static void test_impossible_sizes(void) {
    arena_t a;
    arena_init(&a, 256);
    mo_clear_error();
    CU_ASSERT_PTR_NULL(arena_alloc(&a, SIZE_MAX));
    CU_ASSERT(strstr(mo_last_error(), "arena") != NULL);
    CU_ASSERT_PTR_NULL(arena_alloc(&a, SIZE_MAX - 10));
    CU_ASSERT_PTR_NULL(arena_floats(&a, SIZE_MAX / 2));
    CU_ASSERT_EQUAL(a.used, 0);
    CU_ASSERT_EQUAL(a.reserved, 0);
    CU_ASSERT_PTR_NOT_NULL(arena_alloc(&a, 10)); /* still usable */
    arena_free(&a);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"alignment and disjoint allocations", test_alignment_and_disjoint},
        {"growth, reset into one block, peak accounting", test_growth_and_accounting},
        {"calloc zeroes reused memory", test_calloc_zeroes},
        {"sizes that overflow fail cleanly", test_impossible_sizes},
        CU_TEST_INFO_NULL,
    };
    return tu_main("arena", tests);
}
