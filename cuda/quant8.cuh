/* The 8-bit quantization of activation rows for the block formats'
 * integer products: the matrix-vector path's quantizers (matmul.cu) and
 * decode attention writing o's input itself (attention.cu) make the same
 * bits with it. */
#ifndef LUMA_CUDA_QUANT8_CUH
#define LUMA_CUDA_QUANT8_CUH

/* The activations a block-format weight multiplies, quantized exactly as
 * the CPU backend quantizes them for that weight (src/quant.c), so that the
 * two backends multiply the same int8 values:
 *   ACT_Q8_0 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights): blocks of 32, d =
 *     max|x| / 127, q = round(x / d) half away from zero, and d itself
 *     rounded to f16 as Q8_0 stores it;
 *   ACT_Q8_K (the K formats): super-blocks of 256 sharing one scale: the
 *     first element of largest magnitude maps to -127 (iscale = -127 / x),
 *     the others round half to even and clamp at 127, d = 1 / iscale.
 * A thread takes 8 consecutive values (unit i: x[8 i .. 8 i + 7]), so 4
 * threads hold a block of 32 and a warp a super-block of 256 (the caller's
 * n is a multiple of the block: whole warps are live or dead together for
 * ACT_Q8_K, whole quads for ACT_Q8_0). Writes either the int8 values (q)
 * with each block of 32's (d, d * sum of its q) (ds; the minimum terms of
 * Q4_1/Q5_1/Q2_K/Q4_K/Q5_K need the sum, as Q8_1 and Q8_K's bsums keep
 * it), or, for the tensor-core paths, the f16 of d * q (xh): every path
 * multiplies the same values. */
enum act_scheme { ACT_Q8_0, ACT_Q8_K };

/* The first element of largest magnitude of the warp's N values a lane
 * (lanes in order, then each lane's values): its magnitude, returned, and
 * its signed value into vmax, in every lane. A lane's largest magnitude
 * is never negative nor NaN, so its bits order as the floats do: the
 * warp's is the largest of the lanes' bit patterns and its lane the lowest
 * holding it, two warp reductions (redux.sync) where a butterfly of
 * shuffles took five dependent rounds of three (cuda/NOTES.md: 0.3 us of
 * a 4,096-wide norm's chain). */
template <int N>
static __device__ __forceinline__ float warp_first_max(const float *v, int lane, float &vmax)
{
    float amax = 0.0f;
    vmax = 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++)
        if (fabsf(v[j]) > amax) {
            amax = fabsf(v[j]);
            vmax = v[j];
        }
    const unsigned top = __reduce_max_sync(0xffffffffu, __float_as_uint(amax));
    const unsigned from = __reduce_min_sync(0xffffffffu, __float_as_uint(amax) == top ? (unsigned)lane : 32u);
    vmax = __shfl_sync(0xffffffffu, vmax, (int)from);
    return __uint_as_float(top);
}

/* ACT_Q8_K's int8 values of N of a super-block's values, given its
 * largest magnitude amax and the value vmax of its first element of it;
 * the super-block's d. */
template <int N>
static __device__ __forceinline__ float q8k_values(const float *v, float amax, float vmax, int *iq)
{
    const float iscale = amax == 0.0f ? 0.0f : -127.0f / vmax;
#pragma unroll
    for (int j = 0; j < N; j++) iq[j] = min(127, __float2int_rn(__fmul_rn(iscale, v[j])));
    return amax == 0.0f ? 0.0f : 1.0f / iscale;
}

/* ACT_Q8_0's int8 values of N of a block's values, given its largest
 * magnitude; the block's d (rounded to f16, as Q8_0 stores it). */
template <int N>
static __device__ __forceinline__ float q8_0_values(const float *v, float amax, int *iq)
{
    const float dq = amax / 127.0f, id = dq != 0.0f ? 1.0f / dq : 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++) iq[j] = max(-127, min(127, (int)roundf(__fmul_rn(v[j], id))));
    return __half2float(__float2half_rn(dq));
}

/* ACT_Q8_K for the super-block a warp holds, 8 consecutive values a lane:
 * the lane's int8 values into iq, and the super-block's d. */
static __device__ __forceinline__ float q8k_warp(const float v[8], int lane, int iq[8])
{
    float vmax;
    const float amax = warp_first_max<8>(v, lane, vmax);
    return q8k_values<8>(v, amax, vmax, iq);
}

/* The int8 values of a unit of 8 as quantize_act stores them (two words),
 * and the sum its block of 32 keeps: the 4 lanes of the block add theirs. */
static __device__ __forceinline__ uint2 pack_q8(const int iq[8])
{
    uint32_t lo = (uint32_t)(iq[0] & 255) | (uint32_t)(iq[1] & 255) << 8 | (uint32_t)(iq[2] & 255) << 16 |
                  (uint32_t)(iq[3] & 255) << 24;
    uint32_t hi = (uint32_t)(iq[4] & 255) | (uint32_t)(iq[5] & 255) << 8 | (uint32_t)(iq[6] & 255) << 16 |
                  (uint32_t)(iq[7] & 255) << 24;
    return make_uint2(lo, hi);
}

static __device__ __forceinline__ int quad_sum(const int iq[8])
{
    int sum = iq[0] + iq[1] + iq[2] + iq[3] + iq[4] + iq[5] + iq[6] + iq[7];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    return sum;
}

/* The int8 values iq of a unit of 8 activations v and their block's scale
 * d: Q8_0's blocks of 32 (4 lanes), Q8_K's of 256 (the warp). */
template <int SCHEME>
static __device__ __forceinline__ float q8_scale(const float v[8], int lane, int iq[8])
{
    if (SCHEME == ACT_Q8_0) {
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        return q8_0_values<8>(v, amax, iq);
    }
    return q8k_warp(v, lane, iq);
}

/* Unit i's int8 values (two words) into q and its block's (d, d * sum)
 * into ds (the block's first lane); every lane takes part in the sum's
 * shuffles, only live ones store. The values, packed. */
static __device__ __forceinline__ uint2 q8_put(const int iq[8], float d, int64_t i, bool live, int lane,
                                               int8_t *__restrict__ q, float2 *__restrict__ ds)
{
    const int sum = quad_sum(iq);
    const uint2 packed = pack_q8(iq);
    if (live) {
        ((uint2 *)q)[i] = packed;
        if (lane % 4 == 0) ds[i / 4] = make_float2(d, d * (float)sum);
    }
    return packed;
}

#endif
