/* logprob: log-probability of target tokens, entropy and log-sum-exp of
 * temperature-scaled logits on the CPU, streaming over the vocabulary. */
#include <math.h>
#include <stddef.h>

#include "core/cpu/cpu_kernels.h"
#include "core/status.h"

/* Scaled row max: max_j (logits_j / T) = (max_j logits_j) / T for T > 0. */
static float row_max(const float *l, int V) {
    float m = -INFINITY;
    for (int j = 0; j < V; j++)
        m = l[j] > m ? l[j] : m;
    return m;
}

void cpu_logprob_forward(float *logp, float *entropy, float *lse, const float *logits,
                         const int32_t *targets, int N, int V, float temperature) {
    MO_ASSERT(V > 0 && temperature > 0.0f);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *l = logits + (size_t)n * V; /* (V) */
        int32_t t = targets[n];
        MO_ASSERT(t >= 0 && t < V);
        float m = row_max(l, V) / temperature;
        /* s = sum e_j, a = sum e_j u_j with u_j = z_j - m, e_j = exp(u_j). */
        double s = 0.0, a = 0.0;
        if (entropy) {
            for (int j = 0; j < V; j++) {
                float u = l[j] / temperature - m;
                float e = expf(u);
                s += e;
                a += (double)e * u;
            }
        } else {
            for (int j = 0; j < V; j++)
                s += expf(l[j] / temperature - m);
        }
        double logs = log(s);
        double lz = (double)m + logs;
        lse[n] = (float)lz;
        logp[n] = (float)((double)(l[t] / temperature) - lz);
        if (entropy) /* H = -sum p log p = log s - a / s */
            entropy[n] = (float)(logs - a / s);
    }
}

/* Entropy recomputed from lse: H = -sum_j p_j (z_j - lse). */
static double row_entropy(const float *l, int V, float temperature, float lz) {
    double h = 0.0;
    for (int j = 0; j < V; j++) {
        float lp = l[j] / temperature - lz;
        h -= (double)expf(lp) * lp;
    }
    return h;
}

/* With z = logits / T, p = softmax(z):
 *   d logp / dz_j = [j == target] - p_j,   dH / dz_j = -p_j (log p_j + H),
 * and d / dlogits = (d / dz) / T. */
void cpu_logprob_backward(float *dlogits, const float *dlogp, const float *dentropy,
                          const float *logits, const float *lse, const int32_t *targets, int N,
                          int V, float temperature) {
    MO_ASSERT(V > 0 && temperature > 0.0f);
    if (!dlogits || (!dlogp && !dentropy))
        return;
    float invT = 1.0f / temperature;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *l = logits + (size_t)n * V; /* (V) */
        float *g = dlogits + (size_t)n * V;      /* (V) */
        float lz = lse[n];
        float gl = dlogp ? dlogp[n] : 0.0f;
        float ge = dentropy ? dentropy[n] : 0.0f;
        float H = ge != 0.0f ? (float)row_entropy(l, V, temperature, lz) : 0.0f;
        for (int j = 0; j < V; j++) {
            float lp = l[j] / temperature - lz;
            float p = expf(lp);
            g[j] += invT * (-gl * p - ge * p * (lp + H));
        }
        if (dlogp) {
            int32_t t = targets[n];
            MO_ASSERT(t >= 0 && t < V);
            g[t] += invT * gl;
        }
    }
}
