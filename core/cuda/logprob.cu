/* logprob: log-probability of target tokens, entropy and log-sum-exp of
 * temperature-scaled logits on CUDA. One block per row over the vocabulary:
 * a max pass, then a pass of exp sums accumulated in double (the CPU's
 * arithmetic), block reductions in a fixed order. */
#include "core/cuda/cuda_common.h"

#define LP_THREADS 512

static __global__ void logprob_forward_kernel(float *logp, float *entropy, float *lse,
                                              const float *logits, const int32_t *targets, int V,
                                              float temperature, int *flag) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    size_t row = blockIdx.x;
    const float *l = logits + row * (size_t)V; /* (V) */
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        mx = fmaxf(mx, l[j]);
    float m = block_max(mx, shf) / temperature;
    /* s = sum e_j, a = sum e_j u_j with u_j = z_j - m, e_j = exp(u_j). */
    double s = 0.0, a = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float u = l[j] / temperature - m;
        float e = expf(u);
        s += e;
        a += (double)e * u;
    }
    s = block_sum(s, shd);
    if (entropy)
        a = block_sum(a, shd);
    if (threadIdx.x != 0)
        return;
    double logs = log(s);
    double lz = (double)m + logs;
    lse[row] = (float)lz;
    int32_t t = targets[row];
    if (t < 0 || t >= V) {
        cuda_flag_set(flag, CUDA_FLAG_LOGPROB_TARGET);
        logp[row] = NAN;
    } else {
        logp[row] = (float)((double)(l[t] / temperature) - lz);
    }
    if (entropy) /* H = -sum p log p = log s - a / s */
        entropy[row] = (float)(logs - a / s);
}

/* With z = logits / T, p = softmax(z):
 *   d logp / dz_j = [j == target] - p_j,   dH / dz_j = -p_j (log p_j + H),
 * and d / dlogits = (d / dz) / T. */
static __global__ void logprob_backward_kernel(float *dlogits, const float *dlogp,
                                               const float *dentropy, const float *logits,
                                               const float *lse, const int32_t *targets, int V,
                                               float temperature, float invT, int *flag) {
    __shared__ double shd[32];
    size_t row = blockIdx.x;
    const float *l = logits + row * (size_t)V; /* (V) */
    float *g = dlogits + row * (size_t)V;      /* (V) */
    float lz = lse[row];
    float gl = dlogp ? dlogp[row] : 0.0f;
    float ge = dentropy ? dentropy[row] : 0.0f;
    float H = 0.0f;
    if (ge != 0.0f) { /* the entropy recomputed from lse */
        double h = 0.0;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float lp = l[j] / temperature - lz;
            h -= (double)expf(lp) * lp;
        }
        H = (float)block_sum(h, shd);
    }
    int32_t t = -1;
    if (dlogp) {
        t = targets[row];
        if (t < 0 || t >= V) {
            if (threadIdx.x == 0)
                cuda_flag_set(flag, CUDA_FLAG_LOGPROB_TARGET);
            t = -1;
        }
    }
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float lp = l[j] / temperature - lz;
        float p = expf(lp);
        float gj = g[j] + invT * (-gl * p - ge * p * (lp + H));
        if (j == t)
            gj += invT * gl;
        g[j] = gj;
    }
}

static int check_args(const char *op, int N, int V, float temperature) {
    if (N < 0 || V <= 0 || !(temperature > 0.0f))
        return cuda_record(MO_EINVAL, "%s: bad arguments N=%d V=%d temperature=%g", op, N, V,
                           (double)temperature);
    return MO_OK;
}

extern "C" void cuda_logprob_forward(float *logp, float *entropy, float *lse, const float *logits,
                                     const int32_t *targets, int N, int V, float temperature) {
    if (cuda_enter() < 0 || check_args("logprob_forward", N, V, temperature) < 0 || N == 0)
        return;
    logprob_forward_kernel<<<(unsigned)N, LP_THREADS, 0, cuda_stream()>>>(
        logp, entropy, lse, logits, targets, V, temperature, cuda_flag());
    LAUNCH_CHECK("logprob_forward_kernel");
}

extern "C" void cuda_logprob_backward(float *dlogits, const float *dlogp, const float *dentropy,
                                      const float *logits, const float *lse, const int32_t *targets,
                                      int N, int V, float temperature) {
    if (cuda_enter() < 0 || check_args("logprob_backward", N, V, temperature) < 0 || N == 0)
        return;
    if (!dlogits || (!dlogp && !dentropy))
        return;
    float invT = 1.0f / temperature;
    logprob_backward_kernel<<<(unsigned)N, LP_THREADS, 0, cuda_stream()>>>(
        dlogits, dlogp, dentropy, logits, lse, targets, V, temperature, invT, cuda_flag());
    LAUNCH_CHECK("logprob_backward_kernel");
}
