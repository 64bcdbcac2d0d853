/* RoPE's arithmetic, shared by the rope kernels (ops.cu) and the
 * matrix-vector kernels that rotate q and k as they write them (matmul.cu),
 * so that both give the same bits. */
#ifndef LUMA_CUDA_ROPE_CUH
#define LUMA_CUDA_ROPE_CUH

#include <stdint.h>

/* RoPE's per-frequency tables travel as kernel parameters: head_dim <= 512. */
#define ROPE_MAX_HALF 256

/* The angle of frequency i at position p, as the CPU's tables make it:
 * (p * pos_scale) * pw[i] / ff[i], pw[i] = base^(-2i/n_dims) computed on the
 * host with powf; ff[i] is 1 when the model has no frequency factors
 * (dividing by 1 is exact). */
typedef struct rope_args {
    float ff[ROPE_MAX_HALF];
    float pw[ROPE_MAX_HALF];
    float pos_scale;
    int32_t half, head_dim, heads;
    bool neox;
} rope_args;

static __device__ __forceinline__ float rope_angle(const rope_args &a, float p, int i)
{
    return p * a.pos_scale * a.pw[i] / a.ff[i];
}

/* The pair (x0, x1) rotated by the angle whose sine and cosine are sn, cs,
 * the roundings written out. */
static __device__ __forceinline__ void rope_rotate(float x0, float x1, float sn, float cs, float &y0, float &y1)
{
    y0 = fmaf(x0, cs, -(x1 * sn));
    y1 = fmaf(x0, sn, x1 * cs);
}

#endif
