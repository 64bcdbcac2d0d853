/* The residual add and RMSNorm of a row with the row in registers, shared
 * by ops.cu (add_rmsnorm_regs) and matmul.cu (norm_quantize, the same norm
 * followed by the activation quantizer of the product that reads it), so
 * that both give the same bits. */
#ifndef LUMA_CUDA_NORM_CUH
#define LUMA_CUDA_NORM_CUH

#include <stdint.h>

#define NORM_THREADS 256   /* a CTA a row */

/* The squares of a float4's elements summed, with every rounding written
 * out (left to contraction, x * x + y * y became fma(x, x, y * y) in one
 * kernel and fma(y, y, x * x) in another): the bits of a norm must not
 * depend on the kernel that computes it. */
static __device__ __forceinline__ float sq4(float4 v)
{
    return fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, v.x * v.x)));
}

/* 1 / RMS of a row of cols floats given each thread's sum of squares ss,
 * reduced over the CTA (NORM_THREADS) in a fixed order. */
static __device__ float block_inv_rms(float ss, int64_t cols, float eps, float *partial)
{
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __syncthreads();   /* partial may still be read by an earlier reduction */
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int w = 0; w < NORM_THREADS / 32; w++) ss += partial[w];
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

/* a + b * s * w for a post-norm residual, as one fused multiply-add of
 * (b * s) and w onto a: the same rounding in every kernel that adds one */
static __device__ __forceinline__ float4 add_scaled(float4 a, float4 b, float s, float4 w)
{
    return make_float4(fmaf(b.x * s, w.x, a.x), fmaf(b.y * s, w.y, a.y), fmaf(b.z * s, w.z, a.z),
                       fmaf(b.w * s, w.w, a.w));
}

/* The float4s a thread holds of a row of cols (a multiple of 4), where
 * NORM_THREADS x 4 x F covers it: 1, 2, 4 or 8; 0 past 8. */
static inline int norm_regs_f(int64_t cols)
{
    int64_t per = (cols / 4 + NORM_THREADS - 1) / NORM_THREADS;
    return per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : per <= 8 ? 8 : 0;
}

/* Row blockIdx.x (cols floats, all pointers 16-byte aligned): x += (yg ?
 * y * rms(y) * yg : y), out = x * rms(x) * g, and the thread's float4s of
 * out (threadIdx.x + f NORM_THREADS; zeros past the row) left in o. y NULL:
 * the norm alone, out = x * rms(x) * g, x left as it is (yg NULL then).
 * Every load of the row (x, y and both gains) is issued at once; the
 * caller has waited for the kernel before. */
template <int F>
static __device__ __forceinline__ void add_rmsnorm_row(float *x, const float *y, const float *yg, const float *g,
                                                       int64_t cols, float eps, float *out, float *partial,
                                                       float4 (&o)[F])
{
    size_t off = (size_t)blockIdx.x * (size_t)cols;
    float4 *xr = (float4 *)(x + off), *dst = (float4 *)(out + off);
    const float4 *yr = y ? (const float4 *)(y + off) : NULL, *ygr = (const float4 *)yg, *gr = (const float4 *)g;
    int64_t n4 = cols / 4;
    float4 a[F], b[F], w[F], gw[F];
#pragma unroll
    for (int f = 0; f < F; f++) {
        int64_t k = threadIdx.x + (int64_t)f * NORM_THREADS;
        a[f] = b[f] = w[f] = gw[f] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k < n4) {
            a[f] = xr[k];
            if (yr) b[f] = yr[k];
            gw[f] = gr[k];
            if (yg) w[f] = ygr[k];
        }
    }
    float ss = 0.0f;
    if (yg) {
#pragma unroll
        for (int f = 0; f < F; f++)
            if (threadIdx.x + (int64_t)f * NORM_THREADS < n4) ss += sq4(b[f]);
        float sy = block_inv_rms(ss, cols, eps, partial);
#pragma unroll
        for (int f = 0; f < F; f++) a[f] = add_scaled(a[f], b[f], sy, w[f]);
    } else if (yr) {
#pragma unroll
        for (int f = 0; f < F; f++) a[f] = make_float4(a[f].x + b[f].x, a[f].y + b[f].y, a[f].z + b[f].z, a[f].w + b[f].w);
    }
    ss = 0.0f;
#pragma unroll
    for (int f = 0; f < F; f++) {
        int64_t k = threadIdx.x + (int64_t)f * NORM_THREADS;
        if (k < n4) {
            if (yr) xr[k] = a[f];
            ss += sq4(a[f]);
        }
    }
    float sx = block_inv_rms(ss, cols, eps, partial);
#pragma unroll
    for (int f = 0; f < F; f++) {
        int64_t k = threadIdx.x + (int64_t)f * NORM_THREADS;
        o[f] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k < n4) {
            o[f] = make_float4(a[f].x * sx * gw[f].x, a[f].y * sx * gw[f].y, a[f].z * sx * gw[f].z,
                               a[f].w * sx * gw[f].w);
            dst[k] = o[f];
        }
    }
}

#endif
