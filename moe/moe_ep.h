/* moe_ep: the expert-parallel MoE layer: each of N ranks owns E/N routed experts, and
 * dispatch and combine become all-to-all exchanges over a communicator. */
#ifndef MOERL_MOE_MOE_EP_H
#define MOERL_MOE_MOE_EP_H

#include <stddef.h>
#include <stdint.h>

#include "core/arena.h"
#include "core/comm.h"
#include "core/dtype.h"
#include "core/kernels.h"
#include "lora/adapter.h"
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes as in moe/moe.h: T this rank's tokens, D model width, F expert hidden width,
 * E routed experts, K experts per token, S = T K this rank's token slots; N ranks,
 * n = E / N experts per rank, R the rows this rank's experts receive from all ranks.
 *
 * Rank r owns experts e0 = r n .. e0 + n - 1 of every MoE layer. The router, the shared
 * experts and everything outside the layer are replicated, and every rank feeds its own
 * tokens (data parallel over tokens). A forward:
 *   1. routes its T tokens and builds the local dispatch plan (slots sorted by expert,
 *      hence by owner), gathering xg (S, D);
 *   2. all-reduces the load counts (and the balance loss's statistics) so that load,
 *      imbalance and aux_loss describe the global batch;
 *   3. exchanges per-expert row counts (an int64 all-to-all of n counts per peer), then
 *      sends each owner its block of xg (all-to-all-v, rows of D floats);
 *   4. on the owner, orders the received rows by local expert (for each expert: source
 *      rank by rank, each source's rows in its token order), runs moe_experts_forward,
 *      and sends the outputs back through the inverse permutation (all-to-all-v);
 *   5. combines with the routing weights and adds the shared experts.
 * The backward sends the combine's row gradients to the owners, runs the experts'
 * backward there (the owner's expert adapters accumulate their gradients), sends the
 * input-row gradients back, and finishes with the local router backward, as moe_backward.
 *
 * With tokens split over ranks in global order, each expert sees its rows in the same
 * order as moe_forward on the whole batch, so expert outputs and expert adapter gradients
 * match the single-process layer row for row.
 *
 * Weights: the layer reads w->gate[e], w->up[e], w->down[e] and the expert adapter tables
 * only for the owned experts; the arrays are indexed by the global expert id (E entries)
 * but the other entries may be left empty. Router and shared-expert weights must be the
 * same on every rank.
 *
 * Every function that takes a communicator is collective: all ranks call it in the same
 * order with the same configuration. A routing error on one rank (a bad replay index,
 * say) is shared with every rank at the first exchange, so all of them return an error;
 * a communication error, or running out of memory after that point, leaves the other
 * ranks waiting and must end the job (see core/comm.h). Host memory only: the
 * communicator's buffers must live on the CPU. */

/* MO_ECONFIG when E routed experts cannot be split evenly over N ranks (or either is
 * below 1); the message names both. */
int moe_ep_check(int E, int N);
/* The experts rank owns: e0 .. e0 + n - 1 (E a multiple of N). */
void moe_ep_experts(int E, int N, int rank, int *e0, int *n);
/* The rank that owns expert e. */
int moe_ep_owner(int E, int N, int e);

/* Bytes of frozen expert weights (gate, up and down of experts e0 .. e0 + n - 1, in their
 * stored dtypes, fp8 block scales included) that w holds for those experts: with
 * moe_ep_experts' range this falls as 1 / N. */
size_t moe_ep_expert_weight_bytes(const moe_cfg_t *c, const moe_weights_t *w, int e0, int n);

/* Everything the expert-parallel forward keeps for the backward (in the step's arena). */
typedef struct moe_ep_state {
    /* The local half, as moe_forward leaves it: T, x, logits, probs, idx, weight, plan,
     * xg (S, D) the rows sent to owners, yg (S, D) the expert outputs they returned,
     * shared_acts. load (E) and imbalance cover the global batch, and aux_loss is the
     * global batch's balance loss (the same value on every rank: add it once). acts is
     * NULL: the owned experts' activations are in acts below. */
    moe_state_t loc;
    int N, rank;          /* the communicator's size and this rank */
    int e0, n;            /* owned experts e0 .. e0 + n - 1 */
    int64_t T_global;     /* tokens over all ranks */
    int64_t *split;       /* (N, n) rows source rank p sends to local expert e0 + i */
    int64_t *send_counts; /* (N) floats of xg sent to each owner (rows times D) */
    int64_t *send_displs; /* (N) */
    int64_t *recv_counts; /* (N) floats received from each source rank */
    int64_t *recv_displs; /* (N) */
    int R;                /* rows received for the owned experts */
    int32_t *offsets;     /* (n + 1) local expert i owns rows offsets[i] .. offsets[i+1]-1 */
    int32_t *perm;        /* (R) row j of xe is row perm[j] of the receive buffer */
    float *xe;            /* (R, D) the owned experts' inputs, grouped by expert */
    mlp_acts_t *acts;     /* (n) saved activations of the owned experts */
} moe_ep_state_t;

/* out (T, D) = the layer applied to this rank's tokens x (T, D); T may be 0 on any rank.
 * replay, replay_dt and the arena as in moe_forward. MO_ECONFIG for a bad configuration
 * (moe_cfg_check, moe_ep_check), MO_EUNSUPPORTED for a communicator whose buffers are
 * not host memory. */
int moe_ep_forward(const kernels_t *k, arena_t *ar, comm_t *cm, moe_ep_state_t *st, float *out,
                   const float *x, const moe_cfg_t *c, const moe_weights_t *w, int T,
                   const void *replay, dtype_t replay_dt);

/* dx (T, D) += the input gradient from dout (T, D), as moe_backward, where dout is the
 * gradient of the global objective (normalise by the global token count, not by T, so
 * that results do not depend on N). The owned experts' adapters accumulate dA and dB
 * from every rank's tokens; the shared experts' adapters accumulate this rank's share
 * only and must be summed over ranks (moe_ep_allreduce_replicated). The balance loss
 * enters as the global loss with gradient 1. dx must not alias dout. */
int moe_ep_backward(const kernels_t *k, arena_t *ar, comm_t *cm, float *dx, const float *dout,
                    const moe_ep_state_t *st, const moe_cfg_t *c, const moe_weights_t *w);

/* What one forward plus its backward pass through comm_alltoallv on this rank. */
typedef struct moe_ep_traffic {
    int64_t rows_out;     /* this rank's slots whose expert lives on another rank */
    int64_t rows_in;      /* other ranks' slots for this rank's experts */
    int64_t rows_local;   /* this rank's slots for its own experts */
    uint64_t bytes_sent;  /* expected COMM_OP_ALLTOALLV bytes_sent */
    uint64_t bytes_recv;  /* expected bytes_recv */
    uint64_t bytes_local; /* expected bytes_local */
    uint64_t calls;       /* expected calls: 3 in the forward, 2 in the backward */
} moe_ep_traffic_t;

/* The traffic of the step st describes. Four row exchanges (forward dispatch and
 * combine, backward dispatch of the output gradient and combine of the input gradient)
 * of 4 D bytes per row, plus the forward's count exchange of 8 n bytes per peer:
 *   bytes_sent = bytes_recv = 2 (rows_out + rows_in) 4 D + (N - 1) 8 n
 *   bytes_local = 4 rows_local 4 D + 8 n
 * Summed over ranks, bytes_sent is (T_global K - local slots) x D x 4 bytes x 2
 * directions x 2 passes, plus N (N - 1) 8 n bytes of counts. The load all-reduce is
 * counted under COMM_OP_ALLREDUCE, not here. */
void moe_ep_traffic(moe_ep_traffic_t *t, const moe_ep_state_t *st, const moe_cfg_t *c);

/* Sums each of the n buffers bufs[i] (counts[i] floats, host memory) over the ranks, in
 * place: the gradients of replicated parameters after the backward. */
int moe_ep_allreduce_grads(comm_t *cm, float *const *bufs, const size_t *counts, int n);

/* moe_ep_allreduce_grads over the gradients of every entry of ad that is not a routed
 * expert's (LORA_KIND_EXPERT entries stay on their owner), and over the full tensors
 * (routers, norms trained in full), replicated on every rank; contiguous runs go in one
 * call. The adapter must hold the same replicated entries, in the same order, on every
 * rank. MO_EINVAL when ad has no gradient buffer. */
int moe_ep_allreduce_replicated(comm_t *cm, lora_adapter_t *ad);

#ifdef __cplusplus
}
#endif
#endif
