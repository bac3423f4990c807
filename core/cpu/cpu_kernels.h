/* cpu_kernels: the CPU reference implementation of the kernel table
 * (see core/kernels.h for shapes and conventions). */
#ifndef MOERL_CORE_CPU_KERNELS_H
#define MOERL_CORE_CPU_KERNELS_H

#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

void cpu_matmul_forward(float *out, const float *inp, const wview_t *w, const float *bias, int T,
                        int C, int OC);
void cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                         const float *inp, const wview_t *w, int T, int C, int OC);
void cpu_embedding_forward(float *out, const int32_t *ids, const wview_t *wte, int T, int D);
void cpu_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T, int D);
void cpu_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int D,
                         float eps);
void cpu_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                          const float *w, const float *rstd, int N, int D);
void cpu_rope_forward(float *out, const float *x, const int32_t *pos, const float *inv_freq,
                      float mscale, int N, int H, int Dh, int rot);
void cpu_rope_backward(float *dx, const float *dout, const int32_t *pos, const float *inv_freq,
                       float mscale, int N, int H, int Dh, int rot);
void cpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                           const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                           int window);
void cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *out, const float *lse,
                            const int32_t *cu_seqlens, int B, int H, int Hkv, int Dh, float scale,
                            int window);
void cpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void cpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                         const float *up, size_t n);
void cpu_softmax_forward(float *out, const float *x, int N, int C);
void cpu_softmax_backward(float *dx, const float *dout, const float *out, int N, int C);
void cpu_topk_forward(int32_t *idx, float *val, const float *x, int N, int C, int K);
void cpu_topk_backward(float *dx, const float *dval, const int32_t *idx, int N, int C, int K);
void cpu_logprob_forward(float *logp, float *entropy, float *lse, const float *logits,
                         const int32_t *targets, int N, int V, float temperature);
void cpu_logprob_backward(float *dlogits, const float *dlogp, const float *dentropy,
                          const float *logits, const float *lse, const int32_t *targets, int N,
                          int V, float temperature);
void cpu_adamw_update(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, int step);

/* Converts rows [r0, r0 + nr) of a weight view (rows, cols) to f32 in dst
 * (nr, cols), applying fp8 block scales when present. */
void cpu_wview_rows_f32(float *dst, const wview_t *w, int r0, int nr, int cols);

#ifdef __cplusplus
}
#endif
#endif
