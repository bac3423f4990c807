/* host_model_graph: the decode step's CUDA-graph bookkeeping (actor/model_cuda_graph.c)
 * over the host twins (tests/host_cuda), whose captures are made to succeed with token
 * graphs (launches only counted) or to fail: a shape's first step runs as usual, the
 * second is recorded and launched, later ones replay without running the work; a device
 * allocation drops the graphs (the next step as usual, then recorded anew); shapes are
 * kept apart and the least recently used of 33 goes; a failed recording, failing work, an
 * allocation while recording and expert parallelism turn graphs off with the reason, the
 * work then running as usual. What a real graph computes is checked on a GPU by
 * tests/gpu_engine.c. Built only in builds without CUDA (the twins stand in for it). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "actor/model_cuda.h"
#include "actor/model_cuda_int.h"
#include "core/backend.h"
#include "core/status.h"
#include "tests/testutil.h"

void host_cuda_fake_graphs(int mode);
uint64_t host_cuda_graph_launches(void);

/* What the step's work does when called: counts, and optionally fails or allocates. */
typedef struct {
    int calls;
    int fail;  /* 1: returns MO_EDEVICE */
    int alloc; /* 1: takes (and gives back) a device block */
} work_t;

static int work(model_cuda_t *mc, void *arg) {
    work_t *w = arg;
    w->calls++;
    if (w->alloc) {
        void *p = NULL;
        TRY(mc->be->alloc(mc->be, &p, 64));
        mc->be->free(mc->be, p);
    }
    return w->fail ? mo_errorf(MO_EDEVICE, "the work failed") : MO_OK;
}

typedef struct {
    model_cuda_t mc;
    work_t w;
    uint64_t launches0;
} gx_t;

static void gx_open(gx_t *g, int fake) {
    memset(g, 0, sizeof *g);
    g->mc.be = backend_get(DEV_CUDA);
    host_cuda_fake_graphs(fake);
    CU_ASSERT_EQUAL_FATAL(model_cuda_decode_graphs(&g->mc, 1), 0);
    g->launches0 = host_cuda_graph_launches();
}

static void gx_close(gx_t *g) {
    CU_ASSERT_EQUAL(model_cuda_decode_graphs(&g->mc, 0), 0);
    CU_ASSERT_PTR_NULL(g->mc.graphs);
    host_cuda_fake_graphs(0);
}

static mc_graph_key_t key(int N) {
    mc_graph_key_t k = {N, 4, 1, 100, 16, (const float *)(uintptr_t)0x1000};
    return k;
}

static int step(gx_t *g, int N) {
    mc_graph_key_t k = key(N);
    return mc_graph_run(&g->mc, &k, work, &g->w);
}

static model_cuda_graph_stats_t stats(const gx_t *g) {
    model_cuda_graph_stats_t s;
    model_cuda_graph_stats(&g->mc, &s);
    return s;
}

static uint64_t launches(const gx_t *g) {
    return host_cuda_graph_launches() - g->launches0;
}

/* As usual, recorded, then replayed: the work runs twice in five steps. */
static void test_record_replay(void) {
    gx_t g;
    gx_open(&g, 1);
    for (int i = 0; i < 5; i++)
        CU_ASSERT_EQUAL(step(&g, 8), 0);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT_EQUAL(g.w.calls, 2); /* the first step, and the recording */
    CU_ASSERT_EQUAL(s.eager, 1);
    CU_ASSERT_EQUAL(s.captured, 1);
    CU_ASSERT_EQUAL(s.replayed, 4);
    CU_ASSERT_EQUAL(launches(&g), 4);
    CU_ASSERT_STRING_EQUAL(s.off_reason, "");
    gx_close(&g);
}

/* A device allocation between steps drops the graph: as usual, recorded, replayed again. */
static void test_allocation_drops(void) {
    gx_t g;
    gx_open(&g, 1);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(step(&g, 8), 0);
    void *p = NULL;
    CU_ASSERT_EQUAL_FATAL(g.mc.be->alloc(g.mc.be, &p, 128), 0); /* the epoch moves */
    g.mc.be->free(g.mc.be, p);
    int before = g.w.calls;
    CU_ASSERT_EQUAL(step(&g, 8), 0); /* as usual */
    CU_ASSERT_EQUAL(g.w.calls, before + 1);
    CU_ASSERT_EQUAL(step(&g, 8), 0); /* recorded */
    CU_ASSERT_EQUAL(g.w.calls, before + 2);
    CU_ASSERT_EQUAL(step(&g, 8), 0); /* replayed */
    CU_ASSERT_EQUAL(g.w.calls, before + 2);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT_EQUAL(s.invalidated, 1);
    CU_ASSERT_EQUAL(s.captured, 2);
    CU_ASSERT_EQUAL(s.eager, 2);
    CU_ASSERT_EQUAL(s.replayed, 4);
    gx_close(&g);
}

/* Shapes are recorded apart; with 33 the least recently used goes and starts over. */
static void test_shapes_and_eviction(void) {
    gx_t g;
    gx_open(&g, 1);
    for (int r = 0; r < 3; r++) /* 1 and 2 alternate: each as usual, recorded, replayed */
        for (int N = 1; N <= 2; N++)
            CU_ASSERT_EQUAL(step(&g, N), 0);
    CU_ASSERT_EQUAL(stats(&g).captured, 2);
    CU_ASSERT_EQUAL(stats(&g).replayed, 4);
    for (int N = 3; N <= 32; N++) /* 30 more shapes fill the 32 places */
        CU_ASSERT_EQUAL(step(&g, N), 0);
    int before = g.w.calls;
    CU_ASSERT_EQUAL(step(&g, 2), 0); /* still held: replayed */
    CU_ASSERT_EQUAL(g.w.calls, before);
    CU_ASSERT_EQUAL(step(&g, 33), 0); /* a new shape: N = 1 (least recent) gives way */
    before = g.w.calls;
    CU_ASSERT_EQUAL(step(&g, 1), 0); /* as usual again */
    CU_ASSERT_EQUAL(g.w.calls, before + 1);
    gx_close(&g);
}

/* A recording that fails turns graphs off with the reason; the step's work still runs. */
static void test_capture_fails(void) {
    gx_t g;
    gx_open(&g, 2);
    CU_ASSERT_EQUAL(step(&g, 8), 0);
    CU_ASSERT_EQUAL(step(&g, 8), 0); /* recorded (work runs), fails, then runs as usual */
    CU_ASSERT_EQUAL(g.w.calls, 3);
    CU_ASSERT_EQUAL(step(&g, 8), 0);
    CU_ASSERT_EQUAL(g.w.calls, 4);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT(strstr(s.off_reason, "the capture failed") != NULL);
    CU_ASSERT_EQUAL(s.captured, 0);
    CU_ASSERT_EQUAL(s.eager, 3);
    CU_ASSERT_EQUAL(launches(&g), 0);
    gx_close(&g);
}

/* Work that fails while recorded: thrown away, graphs off with its message, and the
 * failure reaches the caller from the work run as usual. */
static void test_work_fails(void) {
    gx_t g;
    gx_open(&g, 1);
    CU_ASSERT_EQUAL(step(&g, 8), 0);
    g.w.fail = 1;
    CU_ASSERT_EQUAL(step(&g, 8), MO_EDEVICE);
    CU_ASSERT_EQUAL(g.w.calls, 3);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT(strstr(s.off_reason, "the work failed") != NULL);
    CU_ASSERT_EQUAL(s.captured, 0);
    CU_ASSERT_EQUAL(launches(&g), 0);
    gx_close(&g);
}

/* Work that allocates while recorded (the graph would hold a block not settled). */
static void test_allocation_while_recorded(void) {
    gx_t g;
    gx_open(&g, 1);
    CU_ASSERT_EQUAL(step(&g, 8), 0);
    g.w.alloc = 1;
    CU_ASSERT_EQUAL(step(&g, 8), 0);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT(strstr(s.off_reason, "allocated device memory") != NULL);
    CU_ASSERT_EQUAL(s.captured, 0);
    CU_ASSERT_EQUAL(launches(&g), 0);
    gx_close(&g);
}

/* Captures refused (the twin's default, as on the default stream): off with the reason. */
static void test_refused(void) {
    gx_t g;
    gx_open(&g, 0);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(step(&g, 8), 0);
    CU_ASSERT_EQUAL(g.w.calls, 3);
    CU_ASSERT(strstr(stats(&g).off_reason, "no CUDA graphs") != NULL);
    gx_close(&g);
}

/* Expert parallelism waits on the host in every MoE layer: graphs stay off. */
static void test_expert_parallel(void) {
    gx_t g;
    memset(&g, 0, sizeof g);
    g.mc.be = backend_get(DEV_CUDA);
    g.mc.ep = (mc_ep_t *)&g; /* only tested for NULL */
    host_cuda_fake_graphs(1);
    CU_ASSERT_EQUAL_FATAL(model_cuda_decode_graphs(&g.mc, 1), 0);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(step(&g, 8), 0);
    CU_ASSERT_EQUAL(g.w.calls, 3);
    CU_ASSERT(strstr(stats(&g).off_reason, "expert parallelism") != NULL);
    g.mc.ep = NULL;
    gx_close(&g);
}

/* Without graphs turned on: the work as usual, zero counts. */
static void test_off(void) {
    gx_t g;
    memset(&g, 0, sizeof g);
    g.mc.be = backend_get(DEV_CUDA);
    host_cuda_fake_graphs(1);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(step(&g, 8), 0);
    CU_ASSERT_EQUAL(g.w.calls, 3);
    model_cuda_graph_stats_t s = stats(&g);
    CU_ASSERT_EQUAL(s.eager + s.captured + s.replayed, 0);
    host_cuda_fake_graphs(0);
}

static CU_TestInfo g_tests[] = {
    {"record_replay", test_record_replay},
    {"allocation_drops", test_allocation_drops},
    {"shapes_and_eviction", test_shapes_and_eviction},
    {"capture_fails", test_capture_fails},
    {"work_fails", test_work_fails},
    {"allocation_while_recorded", test_allocation_while_recorded},
    {"refused", test_refused},
    {"expert_parallel", test_expert_parallel},
    {"off", test_off},
    CU_TEST_INFO_NULL,
};

int main(void) {
    return tu_main("host_model_graph", g_tests);
}
