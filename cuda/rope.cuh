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

/* One warp's head of q or of k (D = 128 or 256 columns, all rotated), read
 * from in (device or shared memory) and written to out: lane l holds the
 * float4s l, l + 32, ... of the head, as rmsnorm_kernel<32> reads them, and
 * normalizes them with gains g (NULL: no norm) with the same sums in the same
 * order (so the same bits); then each pair rotates as rope_kernel rotates it
 * at position p (the same angle expression): NORM pairs (2i, 2i + 1) sit in
 * one float4, NEOX pairs (i, i + D/2) in the lane's two float4s (D = 256) or
 * in lanes l and l ^ 16 (D = 128). In two parts: qk_head_prep (the gains
 * and the lane's sines and cosines, which do not depend on the head) and
 * qk_head_apply. qk_rope_kernel's, and the q/k/v products' that make whole
 * heads (matmul.cu, mmv_heads), which prepare before their wait. */
template <int D>
struct qk_prep {
    float4 gw[D / 128];
    float sn[4], cs[4];        /* the lane's angles, in the order apply takes them */
};

/* The lane's gains (g: NULL, none). */
template <int D>
static __device__ __forceinline__ void qk_head_gains(qk_prep<D> &q, const float4 *g)
{
    constexpr int F = D / 128;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int f = 0; f < F; f++)
        if (g) q.gw[f] = g[lane + 32 * f];
}

template <int D>
static __device__ __forceinline__ void qk_head_prep(qk_prep<D> &q, const float4 *g, float p, const rope_args &a)
{
    constexpr int F = D / 128;
    const int lane = threadIdx.x % 32;
    qk_head_gains<D>(q, g);
    if (!a.neox) {
#pragma unroll
        for (int f = 0; f < F; f++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float ang = rope_angle(a, p, 2 * (lane + 32 * f) + e);
                q.sn[2 * f + e] = sinf(ang);
                q.cs[2 * f + e] = cosf(ang);
            }
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float ang = rope_angle(a, p, F == 2 ? 4 * lane + e : 4 * (lane % 16) + e);
            q.sn[e] = sinf(ang);
            q.cs[e] = cosf(ang);
        }
    }
}

template <int D>
static __device__ __forceinline__ void qk_head_apply(float4 *out, const float4 *in, const qk_prep<D> &q, bool norm,
                                                     float eps, const rope_args &a)
{
    constexpr int F = D / 128;
    const int lane = threadIdx.x % 32;
    float4 v[F];
#pragma unroll
    for (int f = 0; f < F; f++) v[f] = in[lane + 32 * f];
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int f = 0; f < F; f++) ss += v[f].x * v[f].x + v[f].y * v[f].y + v[f].z * v[f].z + v[f].w * v[f].w;
        for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        float s = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
        for (int f = 0; f < F; f++)
            v[f] = make_float4(v[f].x * s * q.gw[f].x, v[f].y * s * q.gw[f].y, v[f].z * s * q.gw[f].z,
                               v[f].w * s * q.gw[f].w);
    }
    if (!a.neox) {
#pragma unroll
        for (int f = 0; f < F; f++) {
            float4 u = v[f];
            rope_rotate(u.x, u.y, q.sn[2 * f], q.cs[2 * f], v[f].x, v[f].y);
            rope_rotate(u.z, u.w, q.sn[2 * f + 1], q.cs[2 * f + 1], v[f].z, v[f].w);
        }
    } else if (F == 2) {
        float *lo = (float *)&v[0], *hi = (float *)&v[F - 1];
#pragma unroll
        for (int e = 0; e < 4; e++) rope_rotate(lo[e], hi[e], q.sn[e], q.cs[e], lo[e], hi[e]);
    } else {
        float *u = (float *)&v[0];
        bool first = lane < 16;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float other = __shfl_xor_sync(0xffffffffu, u[e], 16);
            float x0 = first ? u[e] : other, x1 = first ? other : u[e], y0, y1;
            rope_rotate(x0, x1, q.sn[e], q.cs[e], y0, y1);
            u[e] = first ? y0 : y1;
        }
    }
#pragma unroll
    for (int f = 0; f < F; f++) out[lane + 32 * f] = v[f];
}

template <int D>
static __device__ __forceinline__ void qk_head(float4 *out, const float4 *in, const float4 *g, float eps, float p,
                                               const rope_args &a)
{
    qk_prep<D> q;
    qk_head_prep<D>(q, g, p, a);
    qk_head_apply<D>(out, in, q, g != NULL, eps, a);
}

#endif
