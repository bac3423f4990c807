/* rope: CUDA rotary position embedding, rotate-half layout. One thread per
 * rotated pair (it reads both before writing, so out may equal x) or per
 * passed-through element; angles in f32 with full-precision cosf/sinf, as on
 * the CPU. */
#include "core/cuda/cuda_common.h"

#define ROPE_THREADS 256

/* Items per (token, head): half pairs, then the Dh - rot untouched dims when
 * `rest` is set. */
static __global__ void rope_forward_kernel(float *out, const float *x, const int32_t *pos,
                                           const float *inv_freq, float mscale, int N, int H,
                                           int Dh, int rot, int rest) {
    int half = rot / 2;
    size_t W = (size_t)half + (rest ? (size_t)(Dh - rot) : 0);
    size_t n_items = (size_t)N * (size_t)H * W;
    for (size_t it = blockIdx.x * (size_t)blockDim.x + threadIdx.x; it < n_items;
         it += (size_t)gridDim.x * blockDim.x) {
        size_t nh = it / W, j = it % W;
        size_t base = nh * (size_t)Dh;
        if (j < (size_t)half) {
            float a = (float)pos[nh / (size_t)H] * inv_freq[j];
            float cs = cosf(a) * mscale, sn = sinf(a) * mscale;
            float x1 = x[base + j], x2 = x[base + j + half];
            out[base + j] = x1 * cs - x2 * sn;
            out[base + j + half] = x2 * cs + x1 * sn;
        } else {
            size_t d = (size_t)rot + (j - (size_t)half);
            out[base + d] = x[base + d];
        }
    }
}

/* dx += R^T dout on the rotated pairs, dx += dout on the rest. */
static __global__ void rope_backward_kernel(float *dx, const float *dout, const int32_t *pos,
                                            const float *inv_freq, float mscale, int N, int H,
                                            int Dh, int rot) {
    int half = rot / 2;
    size_t W = (size_t)half + (size_t)(Dh - rot);
    size_t n_items = (size_t)N * (size_t)H * W;
    for (size_t it = blockIdx.x * (size_t)blockDim.x + threadIdx.x; it < n_items;
         it += (size_t)gridDim.x * blockDim.x) {
        size_t nh = it / W, j = it % W;
        size_t base = nh * (size_t)Dh;
        if (j < (size_t)half) {
            float a = (float)pos[nh / (size_t)H] * inv_freq[j];
            float cs = cosf(a) * mscale, sn = sinf(a) * mscale;
            float g1 = dout[base + j], g2 = dout[base + j + half];
            dx[base + j] += g1 * cs + g2 * sn;
            dx[base + j + half] += g2 * cs - g1 * sn;
        } else {
            size_t d = (size_t)rot + (j - (size_t)half);
            dx[base + d] += dout[base + d];
        }
    }
}

static int check_shape(const char *op, int N, int H, int Dh, int rot) {
    if (N < 0 || H <= 0 || rot <= 0 || rot % 2 != 0 || rot > Dh)
        return cuda_record(MO_EINVAL, "%s: bad shape N=%d H=%d Dh=%d rot=%d", op, N, H, Dh, rot);
    return MO_OK;
}

extern "C" void cuda_rope_forward(float *out, const float *x, const int32_t *pos,
                                  const float *inv_freq, float mscale, int N, int H, int Dh,
                                  int rot) {
    if (cuda_enter() < 0 || check_shape("rope_forward", N, H, Dh, rot) < 0 || N == 0)
        return;
    int rest = out != x && rot < Dh;
    size_t n = (size_t)N * (size_t)H * ((size_t)rot / 2 + (rest ? (size_t)(Dh - rot) : 0));
    rope_forward_kernel<<<cuda_grid(n, ROPE_THREADS), ROPE_THREADS, 0, cuda_stream()>>>(
        out, x, pos, inv_freq, mscale, N, H, Dh, rot, rest);
    LAUNCH_CHECK("rope_forward_kernel");
}

extern "C" void cuda_rope_backward(float *dx, const float *dout, const int32_t *pos,
                                   const float *inv_freq, float mscale, int N, int H, int Dh,
                                   int rot) {
    if (cuda_enter() < 0 || check_shape("rope_backward", N, H, Dh, rot) < 0 || N == 0 || !dx)
        return;
    if (dx == dout) {
        cuda_record(MO_EINVAL, "rope_backward: dx must not alias dout");
        return;
    }
    size_t n = (size_t)N * (size_t)H * ((size_t)rot / 2 + (size_t)(Dh - rot));
    rope_backward_kernel<<<cuda_grid(n, ROPE_THREADS), ROPE_THREADS, 0, cuda_stream()>>>(
        dx, dout, pos, inv_freq, mscale, N, H, Dh, rot);
    LAUNCH_CHECK("rope_backward_kernel");
}
