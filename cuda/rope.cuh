/* RoPE's arithmetic, shared by the rope kernels (ops.cu) and the
 * matrix-vector kernels that rotate q and k as they write them (matmul.cu),
 * so that both give the same bits. */
#ifndef LUMA_CUDA_ROPE_CUH
#define LUMA_CUDA_ROPE_CUH

#include <stdint.h>

#include "norm.cuh"

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

/* The same tables in device memory (luma_cuda_rope_table), for a kernel
 * whose lanes read different frequencies at once: from a kernel parameter
 * each distinct address is a separate read, from memory one. */
typedef struct rope_tab {
    const float *pw, *ff;
    float pos_scale;
    bool neox;
} rope_tab;

template <typename R>
static __device__ __forceinline__ float rope_angle(const R &a, float p, int i)
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

/* 1 / RMS of a head of D columns whose squares sum to ss (qk_rope's norm). */
template <int D>
static __device__ __forceinline__ float qk_inv_rms(float ss, float eps)
{
    return 1.0f / sqrtf(ss / (float)D + eps);
}

/* The sines and cosines of the 4 rotation angles (at most) that lane l
 * of a warp holding a head as qk_head does needs, in qk_head_rotate's
 * order: NORM, the pairs of float4 f = j / 2 (frequency 2 (l + 32 f) + j %
 * 2); NEOX, frequency 4 l + j (D = 256) or 4 (l % 16) + j (D = 128). They
 * depend on the position only, so a kernel may make them early. */
template <int D, typename R>
static __device__ __forceinline__ void qk_head_angles(const R &a, float p, int lane, float (&sn)[4], float (&cs)[4])
{
    constexpr int F = D / 128;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int i = !a.neox ? 2 * (lane + 32 * (j / 2 < F ? j / 2 : 0)) + j % 2 : F == 2 ? 4 * lane + j : 4 * (lane % 16) + j;
        float ang = rope_angle(a, p, i);
        sn[j] = sinf(ang);
        cs[j] = cosf(ang);
    }
}

/* One head of q or k (D = 128 or 256 columns, every one rotated) held by a
 * warp as qk_rope_kernel (ops.cu) holds it: lane l has the float4s l, l +
 * 32, ... of the head. Normalized when norm (RMSNorm by the gains gw, held
 * alike: the squares summed as rmsnorm_kernel<32> sums them, so the same
 * bits), then rotated as rope_kernel rotates each pair, by the angles of
 * qk_head_angles: NORM pairs (2i, 2i + 1) sit in one float4, NEOX pairs (i,
 * i + D/2) in the lane's two float4s (D = 256) or in lanes l and l ^ 16
 * (D = 128). Shared by qk_rope_kernel and decode_lean_kernel (the row's
 * own k), so that both give the same bits. */
template <int D>
static __device__ __forceinline__ void qk_head_rotate(float4 (&v)[D / 128], const float4 (&gw)[D / 128], bool norm,
                                                      float eps, bool neox, const float (&sn)[4],
                                                      const float (&cs)[4], int lane)
{
    constexpr int F = D / 128;
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int f = 0; f < F; f++) ss += sq4(v[f]);
        for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float s = qk_inv_rms<D>(ss, eps);
#pragma unroll
        for (int f = 0; f < F; f++)
            v[f] = make_float4(v[f].x * s * gw[f].x, v[f].y * s * gw[f].y, v[f].z * s * gw[f].z, v[f].w * s * gw[f].w);
    }
    if (!neox) {
#pragma unroll
        for (int f = 0; f < F; f++) {
            float4 u = v[f];
            rope_rotate(u.x, u.y, sn[2 * f], cs[2 * f], v[f].x, v[f].y);
            rope_rotate(u.z, u.w, sn[2 * f + 1], cs[2 * f + 1], v[f].z, v[f].w);
        }
    } else if (F == 2) {
        float *lo = (float *)&v[0], *hi = (float *)&v[F - 1];
#pragma unroll
        for (int e = 0; e < 4; e++) rope_rotate(lo[e], hi[e], sn[e], cs[e], lo[e], hi[e]);
    } else {
        float *u = (float *)&v[0];
        bool first = lane < 16;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float other = __shfl_xor_sync(0xffffffffu, u[e], 16);
            float x0 = first ? u[e] : other, x1 = first ? other : u[e], y0, y1;
            rope_rotate(x0, x1, sn[e], cs[e], y0, y1);
            u[e] = first ? y0 : y1;
        }
    }
}

#endif
