/* Matrix products with quantized weights: y[i] = W x[i] for the m activation
 * rows of a step. W is rows x cols in its GGUF block format (rows contiguous,
 * row r at w->dev + r * luma_row_size(type, cols)); x is m x cols and y is
 * m x rows, f32, row-major, on the device.
 *
 * Two paths, chosen by m (cuda/NOTES.md has the napkin math):
 *
 * - m <= LUMA_MMV_MAX_M (decode, small batches): matrix-vector products,
 *   memory-bound, so each weight byte is read once for up to MMV_PASS_M
 *   activation rows. The activations are first quantized to int8 exactly
 *   as the CPU backend quantizes them for the weight's type (Q8_0 blocks
 *   of 32 for the legacy formats, Q8_K super-blocks of 256 for the K
 *   formats; quantize_act), with each block of 32's scale and sum; each
 *   weight block is decoded to int8 lanes in registers and one
 *   __dp4a does four multiply-adds. Float weights (F32, F16, BF16) meet the
 *   f32 activations directly. Activations are read through L1, where every
 *   warp of the SM finds them (m x cols bytes of int8: 32 KB for 8 rows of
 *   4096). Two kernels, chosen per weight (mmv_launch): the direct one, where
 *   a warp owns one or two weight rows and loads their blocks straight into
 *   registers, one block ahead of its use, and the staged one, where each
 *   warp copies pieces of its rows into shared memory with bulk copies
 *   (cp.async.bulk, a whole piece per instruction) and several warps may
 *   split a row; in both, lpb lanes share a block, accumulate, and reduce
 *   with shuffles at the end. Q6_K, Q4_0, Q5_0 and Q8_0 weights are read
 *   from a copy weight_load repacked into aligned blocks
 *   (luma_weight.dev_mmv: type_q6_K_mmv, type_x4) where it made one.
 *   Q4_K, Q5_K and Q6_K weights at 2 to 32 rows take a third kernel,
 *   mmv_tc, whose warps meet 16 weight rows and 8 activation rows in one
 *   int8 mma.sync per sub-block (Q6_K: per scale group), so that its cost
 *   hardly grows with m up to 16 (past 16 a tile's weights are read by a
 *   CTA for each 16 rows, the later ones from L2); it reads a copy of the
 *   blocks in tiles of 16 rows (weight_load's, where the device has room)
 *   and a copy of the activations interleaved by row (the quantizer's),
 *   whose loads read whole lines.
 *
 * - larger m (prefill, big batches): tensor cores through cuBLAS. The
 *   weights in f16 (the same values as luma_dequantize_row, rounded to f16)
 *   are the resident copy weight_load made when the device has room for the
 *   copies of all matrices (luma_weight.dev_f16), or else a panel of weight
 *   rows dequantized into scratch on every call; the activations are
 *   quantized as above and their values d * q converted to f16 once, and cublasGemmEx multiplies them with f32
 *   accumulation and f32 output. Before it, luma_cuda_mmq (mmq.cu: the
 *   quantized blocks fed straight to mma.sync, dequantized in registers to
 *   f16 or, for the K formats, as their integers against the int8
 *   activations; no f16 copy) takes the (type, m) for which it measured
 *   faster, its int8 route at m = 8..16 even before the matrix-vector
 *   kernels (luma_cuda_mmq_small). Weights of one matmul_many call that go
 *   to cuBLAS share one conversion of the activations, and those of one
 *   shape among them one batched GEMM (tensor_gemm_batched). */
#include "cuda_internal.h"
#include "blocks.cuh"
#include "launch.cuh"
#include "rope.cuh"
#include "act.cuh"
#include "quant8.cuh"
#include "program.cuh"
#include "norm.cuh"

#include <limits.h>
#include <cooperative_groups.h>
#include <type_traits>
#include <stdlib.h>
#include <string.h>

LUMA_TRACE_TU(matmul)

namespace cg = cooperative_groups;

/* The largest m that takes the matrix-vector path; above it the GEMM over f16
 * weights (2 bytes per element read, and first written when there is no
 * resident copy) costs less than reading the quantized weights once per
 * MMV_PASS_M rows. A resident copy makes the GEMM cheaper still, but one
 * 8-row pass already costs about what the GEMM does, so the switch stays
 * at 8 for both (cuda/NOTES.md). F16 weights need no dequantization, so
 * cuBLAS wins from m = 3 on (measured on an H100). */
#ifndef LUMA_MMV_MAX_M
#define LUMA_MMV_MAX_M 8
#endif
#define MMV_MAX_M_F16 2
#define MMV_DIRECT_WARPS 4     /* warps per CTA of the direct matrix-vector kernel */
#define MMV_STAGED_WARPS 8     /* and of the staged one */
#define MMV_PIECE_BYTES 4096   /* weight bytes a warp of the staged kernel copies at once, at most */
#define MMV_STAGED_MAX_ROWS 1024   /* matrices of at most this many rows take the staged kernel */
#define MMV_SMEM_MAX (200 << 10)   /* the staged kernel's dynamic shared memory, at most */
#define DEQ_THREADS 256
/* Weight elements dequantized per GEMM call: bounds the f16 scratch at
 * 128 MB (a 262144 x 640 output matrix takes three panels). */
#define PANEL_ELEMS ((int64_t)64 << 20)

/* ---- small helpers ---------------------------------------------------------- */

static __device__ __forceinline__ float ld_f16(const uint8_t *p)
{
    return f16_bits(*(const uint16_t *)p);
}

/* Four bytes at an address that is only 2-aligned (blocks of 18, 22, 34, 110
 * and 210 bytes). */
static __device__ __forceinline__ int ld_i32_a2(const uint8_t *p)
{
    const uint16_t *h = (const uint16_t *)p;
    return (int)((uint32_t)h[0] | (uint32_t)h[1] << 16);
}

static __device__ __forceinline__ int ld_i32(const uint8_t *p)
{
    return *(const int *)p;
}

static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ void scale_min_k4_bytes(int s, const uint8_t *q, int &sc, int &m)
{
    scale_min_k4(s, ld_i32(q), ld_i32(q + 4), ld_i32(q + 8), sc, m);
}

/* Q3_K's sixteen 6-bit scales (src/quant.c q3_k_scales), scale j. */
static __device__ __forceinline__ int q3_k_scale(const uint8_t *s, int j)
{
    int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* ---- block formats -------------------------------------------------------------
 *
 * One struct per weight type: qk elements and `bytes` bytes per block, lpb
 * lanes share a block in the matrix-vector kernel. Lane part p of a block:
 *   fetch  loads the raw bytes of the lane's share into raw_t;
 *   decode turns them into w_t (int8 lanes with any offset folded in,
 *          per-group float scales): once per weight row;
 *   loadx  reads the matching activations of one row into x_t;
 *   dot    their contribution to that row's output.
 * deq8 writes 8 consecutive elements from element e0 of a block, computed
 * operation by operation as src/quant.c does (no fused multiply-add), so the
 * f16 panel holds the reference values rounded once. */

/* One activation row as the kernels read it: int8 values (four to an int)
 * with (d, sum) per 32, or the f32 row itself for float weights. */
struct act_rows {
    const int *q;
    const float2 *ds;
    const float *f;
    int64_t q_stride, ds_stride, f_stride;   /* per row, in ints, float2s, floats */
    /* the int8 values again, interleaved for mmv_tc (quantize_act has the
     * layout), and the int4s from one octet of rows to the next; NULL
     * where not made */
    const int4 *qi;
    int64_t qi_octet;
};

#define LOW4 0x0F0F0F0F

struct type_q4_0 {
    static constexpr int qk = 32, bytes = 18, lpb = 2;
    struct raw_t { int q[2]; uint16_t d; };
    struct w_t { int lo[2], hi[2]; float d; };
    struct x_t { int2 lo, hi; float d; };
    /* part p: qs[8p .. 8p + 7], elements 8p.. (low nibbles) and 16 + 8p.. (high) */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.d = *(const uint16_t *)b;
        r.q[0] = ld_i32_a2(b + 2 + 8 * p);
        r.q[1] = ld_i32_a2(b + 6 + 8 * p);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.d = f16_bits(r.d);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            w.lo[i] = __vsub4(r.q[i] & LOW4, 0x08080808);
            w.hi[i] = __vsub4((r.q[i] >> 4) & LOW4, 0x08080808);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        const int *q = a.q + j * a.q_stride + ib * 8;
        x.lo = *(const int2 *)(q + 2 * p);
        x.hi = *(const int2 *)(q + 4 + 2 * p);
        x.d = a.ds[j * a.ds_stride + ib].x;
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        int s = __dp4a(w.lo[0], x.lo.x, __dp4a(w.lo[1], x.lo.y, 0));
        s = __dp4a(w.hi[0], x.hi.x, __dp4a(w.hi[1], x.hi.y, s));
        return w.d * x.d * (float)s;
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        float d = ld_f16(b);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = e0 + i, q = e < 16 ? b[2 + e] & 0xF : b[2 + e - 16] >> 4;
            v[i] = __fmul_rn(d, (float)(q - 8));
        }
    }
};

struct type_q4_1 {
    static constexpr int qk = 32, bytes = 20, lpb = 2;
    struct raw_t { int q[2]; uint32_t dm; };
    struct w_t { int lo[2], hi[2]; float d, m; };
    struct x_t { int2 lo, hi; float d, s; };
    /* the minimum times the sum of the block's activations is added by part 0 */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.dm = (uint32_t)ld_i32(b);
        r.q[0] = ld_i32(b + 4 + 8 * p);
        r.q[1] = ld_i32(b + 8 + 8 * p);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.d = f16_bits(r.dm & 0xffff);
        w.m = p == 0 ? f16_bits(r.dm >> 16) : 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            w.lo[i] = r.q[i] & LOW4;
            w.hi[i] = (r.q[i] >> 4) & LOW4;
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        const int *q = a.q + j * a.q_stride + ib * 8;
        x.lo = *(const int2 *)(q + 2 * p);
        x.hi = *(const int2 *)(q + 4 + 2 * p);
        float2 ds = a.ds[j * a.ds_stride + ib];
        x.d = ds.x;
        x.s = ds.y;
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        int s = __dp4a(w.lo[0], x.lo.x, __dp4a(w.lo[1], x.lo.y, 0));
        s = __dp4a(w.hi[0], x.hi.x, __dp4a(w.hi[1], x.hi.y, s));
        return w.d * x.d * (float)s + w.m * x.s;
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        float d = ld_f16(b), m = ld_f16(b + 2);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = e0 + i, q = e < 16 ? b[4 + e] & 0xF : b[4 + e - 16] >> 4;
            v[i] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    }
};

struct type_q5_0 {
    static constexpr int qk = 32, bytes = 22, lpb = 2;
    struct raw_t { int q[2]; uint32_t qh; uint16_t d; };
    typedef type_q4_0::w_t w_t;
    typedef type_q4_0::x_t x_t;
    /* element e's fifth bit is bit e of qh */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.d = *(const uint16_t *)b;
        r.qh = (uint32_t)ld_i32_a2(b + 2);
        r.q[0] = ld_i32_a2(b + 6 + 8 * p);
        r.q[1] = ld_i32_a2(b + 10 + 8 * p);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.d = f16_bits(r.d);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int e = 8 * p + 4 * i;
            w.lo[i] = __vsub4((r.q[i] & LOW4) | bits4_to_bytes(r.qh >> e), 0x10101010);
            w.hi[i] = __vsub4(((r.q[i] >> 4) & LOW4) | bits4_to_bytes(r.qh >> (e + 16)), 0x10101010);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        type_q4_0::loadx(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        int s = __dp4a(w.lo[0], x.lo.x, __dp4a(w.lo[1], x.lo.y, 0));
        s = __dp4a(w.hi[0], x.hi.x, __dp4a(w.hi[1], x.hi.y, s));
        return w.d * x.d * (float)s;
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        float d = ld_f16(b);
        uint32_t qh = (uint32_t)ld_i32_a2(b + 2);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = e0 + i, q = (e < 16 ? b[6 + e] & 0xF : b[6 + e - 16] >> 4) | (int)((qh >> e) & 1) << 4;
            v[i] = __fmul_rn(d, (float)(q - 16));
        }
    }
};

struct type_q5_1 {
    static constexpr int qk = 32, bytes = 24, lpb = 2;
    struct raw_t { int q[2]; uint32_t dm, qh; };
    typedef type_q4_1::w_t w_t;
    typedef type_q4_1::x_t x_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.dm = (uint32_t)ld_i32(b);
        r.qh = (uint32_t)ld_i32(b + 4);
        r.q[0] = ld_i32(b + 8 + 8 * p);
        r.q[1] = ld_i32(b + 12 + 8 * p);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.d = f16_bits(r.dm & 0xffff);
        w.m = p == 0 ? f16_bits(r.dm >> 16) : 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int e = 8 * p + 4 * i;
            w.lo[i] = (r.q[i] & LOW4) | bits4_to_bytes(r.qh >> e);
            w.hi[i] = ((r.q[i] >> 4) & LOW4) | bits4_to_bytes(r.qh >> (e + 16));
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        type_q4_1::loadx(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return type_q4_1::dot(w, x);
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        float d = ld_f16(b), m = ld_f16(b + 2);
        uint32_t qh = (uint32_t)ld_i32(b + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = e0 + i, q = (e < 16 ? b[8 + e] & 0xF : b[8 + e - 16] >> 4) | (int)((qh >> e) & 1) << 4;
            v[i] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    }
};

struct type_q8_0 {
    static constexpr int qk = 32, bytes = 34, lpb = 4;
    typedef type_q4_0::raw_t raw_t;
    struct w_t { int q[2]; float d; };
    struct x_t { int2 q; float d; };
    /* part p: elements 8p .. 8p + 7 */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        type_q4_0::fetch(b, p, r);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.d = f16_bits(r.d);
        w.q[0] = r.q[0];
        w.q[1] = r.q[1];
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        x.q = *(const int2 *)(a.q + j * a.q_stride + ib * 8 + 2 * p);
        x.d = a.ds[j * a.ds_stride + ib].x;
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return w.d * x.d * (float)__dp4a(w.q[0], x.q.x, __dp4a(w.q[1], x.q.y, 0));
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        float d = ld_f16(b);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(d, (float)(int8_t)b[2 + e0 + i]);
    }
};

/* The K formats with 2-, 3- and 6-bit values (src/quant.c): element
 * 128c + 32k + l takes bit pair k of byte l of half c and sub-block scale
 * 8c + 2k + l / 16. Lane part p takes half c = p / 8 and the four positions
 * l0 = 4 (p % 8) .. l0 + 3 of each k: four ints, four scales. */
struct k_act4 {
    int q[4];
    float d[4];
    static __device__ void load(const act_rows &a, int j, int64_t ib, int p, k_act4 &x)
    {
        int c = p / 8, l0 = 4 * (p % 8);
        const int *q = a.q + j * a.q_stride + ib * 64 + 32 * c + l0 / 4;
        const float2 *ds = a.ds + j * a.ds_stride + ib * 8 + 4 * c;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            x.q[k] = q[8 * k];
            x.d[k] = ds[k].x;
        }
    }
};

struct type_q2_K {
    static constexpr int qk = 256, bytes = 84, lpb = 16;
    struct raw_t { int q; uint32_t sc, dd; };
    struct w_t { int q[4]; float dl[4], ml[4]; };
    typedef k_act4 x_t;
    /* sc: the four sub-block scale bytes of k = 0..3 */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        int c = p / 8, l0 = 4 * (p % 8);
        const uint8_t *s = b + 8 * c + l0 / 16;
        r.dd = (uint32_t)ld_i32(b + 80);
        r.q = ld_i32(b + 16 + 32 * c + l0);
        r.sc = (uint32_t)s[0] | (uint32_t)s[2] << 8 | (uint32_t)s[4] << 16 | (uint32_t)s[6] << 24;
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        float d = f16_bits(r.dd & 0xffff), dmin = f16_bits(r.dd >> 16);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int sc = (r.sc >> (8 * k)) & 0xFF;
            w.q[k] = (r.q >> (2 * k)) & 0x03030303;
            w.dl[k] = d * (float)(sc & 0xF);
            w.ml[k] = dmin * (float)(sc >> 4);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act4::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        float r = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++)
            r += x.d[k] * (w.dl[k] * (float)__dp4a(w.q[k], x.q[k], 0) -
                           w.ml[k] * (float)__dp4a(0x01010101, x.q[k], 0));
        return r;
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        int c = e0 / 128, k = e0 % 128 / 32, l0 = e0 % 32, sc = b[8 * c + 2 * k + l0 / 16];
        float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
        float dl = __fmul_rn(d, (float)(sc & 0xF)), ml = __fmul_rn(dmin, (float)(sc >> 4));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int q = (b[16 + 32 * c + l0 + i] >> (2 * k)) & 3;
            v[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
        }
    }
};

struct type_q3_K {
    static constexpr int qk = 256, bytes = 110, lpb = 16;
    struct raw_t { int q, hm; uint32_t sc; uint16_t d; };
    struct w_t { int q[4]; float dl[4]; };
    typedef k_act4 x_t;
    /* value = 2 low bits - (high bit clear ? 4 : 0); the high bit of
     * element 128c + 32k + l is bit 4c + k of hmask[l]; sc: the four 6-bit
     * scales of k = 0..3, offset by 32 */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        int c = p / 8, l0 = 4 * (p % 8);
        r.d = *(const uint16_t *)(b + 108);
        r.q = ld_i32_a2(b + 32 + 32 * c + l0);
        r.hm = ld_i32_a2(b + l0);
        r.sc = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) r.sc |= (uint32_t)(q3_k_scale(b + 96, 8 * c + 2 * k + l0 / 16) + 32) << (8 * k);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        int c = p / 8;
        float d = f16_bits(r.d);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int lo = (r.q >> (2 * k)) & 0x03030303, hi = (r.hm >> (4 * c + k)) & 0x01010101;
            w.q[k] = __vsub4(lo | hi << 2, 0x04040404);
            w.dl[k] = d * (float)((int)((r.sc >> (8 * k)) & 0xFF) - 32);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act4::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        float r = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) r += x.d[k] * w.dl[k] * (float)__dp4a(w.q[k], x.q[k], 0);
        return r;
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        int c = e0 / 128, k = e0 % 128 / 32, l0 = e0 % 32;
        float dl = __fmul_rn(ld_f16(b + 108), (float)q3_k_scale(b + 96, 8 * c + 2 * k + l0 / 16));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int l = l0 + i, lo = (b[32 + 32 * c + l] >> (2 * k)) & 3;
            int q = (b[l] >> (4 * c + k)) & 1 ? lo : lo - 4;
            v[i] = __fmul_rn(dl, (float)q);
        }
    }
};

/* Q4_K and Q5_K: sub-block 2j + h (32 elements) is the low (h = 0) or high
 * (h = 1) nibbles of qs[32j .. 32j + 31]. Lane part p = 2j + h takes the
 * 16 bytes qs[32j + 16h ..], that is positions l = 16h .. 16h + 15 of
 * sub-blocks 2j and 2j + 1: 16-byte loads, since these blocks (144 and 176
 * bytes) keep 16-byte alignment. The minimums meet the float sums of the
 * activation blocks, added by the h = 0 lane. */
struct k_act32 {
    int4 a, b;                 /* sub-blocks 2j and 2j + 1 */
    float4 ds;                 /* their (d, sum) */
    static __device__ void load(const act_rows &x, int j, int64_t ib, int p, k_act32 &v)
    {
        int sj = p / 2, h = p % 2;
        const int *q = x.q + j * x.q_stride + ib * 64 + 16 * sj + 4 * h;
        v.a = *(const int4 *)q;
        v.b = *(const int4 *)(q + 8);
        v.ds = *(const float4 *)(x.ds + j * x.ds_stride + ib * 8 + 2 * sj);
    }
};

/* Four unsigned bytes of u times four signed ones of s, plus c. */
static __device__ __forceinline__ int dp4a_us(int u, int s, int c)
{
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(u), "r"(s), "r"(c));
    return r;
}

/* A weight load of the matrix-vector kernels: with CS, ld.global.cs, whose
 * lines L2 allocates evict-first. A step reads each weight byte once, and
 * a 7B's 4 GB pass through the 50-60 MB L2 a token; marked so, they evict
 * each other rather than what the step reads again (activations, its
 * metadata, the recent keys and values, the norms' gains): 7B at batch 1
 * 2.11-2.13 to 2.00-2.05 ms a token on an H200 (cuda/NOTES.md). Only for
 * global memory (the direct kernels, mmv_fetch). */
template <bool CS, class V> static __device__ __forceinline__ V ld_w(const uint8_t *p)
{
    if constexpr (CS) return __ldcs((const V *)p);
    else return *(const V *)p;
}

struct k_w32 {
    int lo[4], hi[4];          /* unsigned bytes */
    float da, db, ma, mb;      /* d * scale and dmin * minimum of the two sub-blocks */
    /* the scale pairs two to a word, each byte a float by byte_f: fewer
     * instructions than picking the four values apart */
    static __device__ void scales(const int4 &hdr, int p, k_w32 &w)
    {
        float d = f16_bits((uint32_t)hdr.x & 0xffff), dmin = f16_bits((uint32_t)hdr.x >> 16);
        uint32_t sp, mp;
        scale_min_k4_pair_packed(p / 2, hdr.y, hdr.z, hdr.w, sp, mp);
        w.da = d * byte_f(sp, 0);
        w.db = d * byte_f(sp, 1);
        const float dm = p % 2 == 0 ? dmin : 0.0f;
        w.ma = dm * byte_f(mp, 0);
        w.mb = dm * byte_f(mp, 1);
    }
    static __device__ float dot(const k_w32 &w, const k_act32 &x)
    {
        int sa = dp4a_us(w.lo[0], x.a.x, dp4a_us(w.lo[1], x.a.y, dp4a_us(w.lo[2], x.a.z, dp4a_us(w.lo[3], x.a.w, 0))));
        int sb = dp4a_us(w.hi[0], x.b.x, dp4a_us(w.hi[1], x.b.y, dp4a_us(w.hi[2], x.b.z, dp4a_us(w.hi[3], x.b.w, 0))));
        return x.ds.x * w.da * i2f(sa) + x.ds.z * w.db * i2f(sb) - (w.ma * x.ds.y + w.mb * x.ds.w);
    }
};

struct type_q4_K {
    static constexpr int qk = 256, bytes = 144, lpb = 8;
    struct raw_t { int4 hdr, q; };
    typedef k_w32 w_t;
    typedef k_act32 x_t;
    template <bool CS = false> static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.hdr = ld_w<CS, int4>(b);
        r.q = ld_w<CS, int4>(b + 16 + 16 * p);
    }
    /* lane part p's 4-bit values, four a word: sub-block 2 (p / 2) in lo,
     * 2 (p / 2) + 1 in hi (also the float kernel's, kf_q4_K) */
    static __device__ __forceinline__ void bits(const raw_t &r, int p, int *lo, int *hi)
    {
        int v[4] = { r.q.x, r.q.y, r.q.z, r.q.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = v[i] & LOW4;
            hi[i] = (v[i] >> 4) & LOW4;
        }
    }
    /* The high nibbles stay in place (16 times the value: one mask, no
     * shift) and the sub-block's d * scale takes the 1/16: a power of two,
     * so the products round as with the value itself. */
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        k_w32::scales(r.hdr, p, w);
        int v[4] = { r.q.x, r.q.y, r.q.z, r.q.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.lo[i] = v[i] & LOW4;
            w.hi[i] = v[i] & ~LOW4;
        }
        w.db *= 0.0625f;
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act32::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return k_w32::dot(w, x);
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        int s = e0 / 32, l0 = e0 % 32, sc, m;
        scale_min_k4_bytes(s, b + 4, sc, m);
        float d1 = __fmul_rn(ld_f16(b), (float)sc), m1 = __fmul_rn(ld_f16(b + 2), (float)m);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int q = (b[16 + 32 * (s / 2) + l0 + i] >> (4 * (s % 2))) & 0xF;
            v[i] = __fsub_rn(__fmul_rn(d1, (float)q), m1);
        }
    }
};

/* Q5_K: the fifth bit of element l of sub-block s is bit s of qh[l]. */
struct type_q5_K {
    static constexpr int qk = 256, bytes = 176, lpb = 8;
    struct raw_t { int4 hdr, qh, q; };
    typedef k_w32 w_t;
    typedef k_act32 x_t;
    template <bool CS = false> static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.hdr = ld_w<CS, int4>(b);
        r.qh = ld_w<CS, int4>(b + 16 + 16 * (p % 2));
        r.q = ld_w<CS, int4>(b + 48 + 16 * p);
    }
    /* lane part p's 5-bit values, as type_q4_K::bits (also kf_q5_K's) */
    static __device__ __forceinline__ void bits(const raw_t &r, int p, int *lo, int *hi)
    {
        int sj = p / 2;
        int v[4] = { r.q.x, r.q.y, r.q.z, r.q.w }, h[4] = { r.qh.x, r.qh.y, r.qh.z, r.qh.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (v[i] & LOW4) | ((h[i] >> (2 * sj)) & 0x01010101) << 4;
            hi[i] = ((v[i] >> 4) & LOW4) | ((h[i] >> (2 * sj + 1)) & 0x01010101) << 4;
        }
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        k_w32::scales(r.hdr, p, w);
        bits(r, p, w.lo, w.hi);
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act32::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return k_w32::dot(w, x);
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        int s = e0 / 32, l0 = e0 % 32, sc, m;
        scale_min_k4_bytes(s, b + 4, sc, m);
        float d1 = __fmul_rn(ld_f16(b), (float)sc), m1 = __fmul_rn(ld_f16(b + 2), (float)m);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int l = l0 + i;
            int q = ((b[48 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) | ((b[16 + l] >> s) & 1) << 4;
            v[i] = __fsub_rn(__fmul_rn(d1, (float)q), m1);
        }
    }
};

/* Q6_K: element 128c + 32k + l has its low 4 bits in ql[64c + 32(k % 2) + l]
 * (low nibble for k < 2, high for k >= 2), its top 2 bits at bit 2k of
 * qh[32c + l]; value = those 6 bits - 32, times the int8 scale. */
struct type_q6_K {
    static constexpr int qk = 256, bytes = 210, lpb = 16;
    struct raw_t { int ql[2], qh; uint32_t sc; uint16_t d; };
    typedef type_q3_K::w_t w_t;
    typedef k_act4 x_t;
    /* sc: the four int8 scales of k = 0..3 */
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        int c = p / 8, l0 = 4 * (p % 8);
        const uint8_t *s = b + 192 + 8 * c + l0 / 16;
        r.d = *(const uint16_t *)(b + 208);
        r.ql[0] = ld_i32_a2(b + 64 * c + l0);
        r.ql[1] = ld_i32_a2(b + 64 * c + 32 + l0);
        r.qh = ld_i32_a2(b + 128 + 32 * c + l0);
        r.sc = (uint32_t)s[0] | (uint32_t)s[2] << 8 | (uint32_t)s[4] << 16 | (uint32_t)s[6] << 24;
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        float d = f16_bits(r.d);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int lo = (r.ql[k % 2] >> (4 * (k / 2))) & LOW4, hi = ((r.qh >> (2 * k)) & 0x03030303) << 4;
            w.q[k] = __vsub4(lo | hi, 0x20202020);
            w.dl[k] = d * (float)(int8_t)((r.sc >> (8 * k)) & 0xFF);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act4::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return type_q3_K::dot(w, x);
    }
    static __device__ void deq8(const uint8_t *b, int e0, float *v)
    {
        int c = e0 / 128, k = e0 % 128 / 32, l0 = e0 % 32;
        float dl = __fmul_rn(ld_f16(b + 208), (float)(int8_t)b[192 + 8 * c + 2 * k + l0 / 16]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int l = l0 + i;
            int lo = (b[64 * c + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
            int hi = (b[128 + 32 * c + l] >> (2 * k)) & 3;
            v[i] = __fmul_rn(dl, (float)((lo | hi << 4) - 32));
        }
    }
};

/* Q6_K as weight_load repacks it for the matrix-vector kernels
 * (luma_cuda_repack_q6_K): the GGUF block's 210 bytes keep only 2-byte
 * alignment, so type_q6_K spends 11 loads on a lane's 16 weights; the
 * repacked block (LUMA_Q6_K_MMV_BYTES = 224) keeps 16-byte alignment and
 * a lane's 32 weights are 4 loads. Lane part p (8 a block) takes, as
 * k_act32 reads the activations, positions l = 16 h .. 16 h + 15 (h = p % 2)
 * of the 32-element sub-blocks s0 = 2 (p / 2) and s1 = s0 + 1; q(s, l) is
 * the 6-bit value (0..63) of element 32 s + l:
 *   [16 p, 16 p + 16)    byte 4 i + b: the low 4 bits of q(s0, l) | those
 *                        of q(s1, l) << 4, l = 16 h + 4 i + b;
 *   [128 + 8 p, + 8)     two words, s0's then s1's: bits 2 i and 2 i + 1 of
 *                        byte b are q(s, l) >> 4, the same l;
 *   [192 + 2 p, + 2)     the int8 scales of s0's and s1's 16 positions;
 *   [208, 212)           d as f32 (exact); then 12 zero bytes. */
struct type_q6_K_mmv {
    static constexpr int qk = 256, bytes = LUMA_Q6_K_MMV_BYTES, lpb = 8;
    struct raw_t { int4 q; int2 h; uint32_t sc; float d; };
    struct w_t { int lo[4], hi[4]; float da, db; };
    typedef k_act32 x_t;
    template <bool CS = false> static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r.q = ld_w<CS, int4>(b + 16 * p);
        r.h = ld_w<CS, int2>(b + 128 + 8 * p);
        r.sc = ld_w<CS, unsigned short>(b + 192 + 2 * p);
        r.d = ld_w<CS, float>(b + 208);
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        int v[4] = { r.q.x, r.q.y, r.q.z, r.q.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.lo[i] = __vsub4((v[i] & LOW4) | ((r.h.x >> (2 * i)) & 0x03030303) << 4, 0x20202020);
            w.hi[i] = __vsub4(((v[i] >> 4) & LOW4) | ((r.h.y >> (2 * i)) & 0x03030303) << 4, 0x20202020);
        }
        w.da = r.d * i2f((int8_t)(r.sc & 0xFF));
        w.db = r.d * i2f((int8_t)(r.sc >> 8));
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        k_act32::load(a, j, ib, p, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        int sa = __dp4a(w.lo[0], x.a.x, __dp4a(w.lo[1], x.a.y, __dp4a(w.lo[2], x.a.z, __dp4a(w.lo[3], x.a.w, 0))));
        int sb = __dp4a(w.hi[0], x.b.x, __dp4a(w.hi[1], x.b.y, __dp4a(w.hi[2], x.b.z, __dp4a(w.hi[3], x.b.w, 0))));
        return x.ds.x * w.da * i2f(sa) + x.ds.z * w.db * i2f(sb);
    }
};

/* The formats with blocks of 32 and one f16 scale (Q4_0, Q5_0, Q8_0) as
 * weight_load repacks them for the matrix-vector kernels (luma_cuda_repack):
 * their 18-, 22- and 34-byte blocks keep only 2-byte alignment, so the
 * file's layout is read two bytes at a time (and Q8_0 goes through the
 * staged kernel's shared memory instead). Four blocks make one repacked
 * block of 128 elements in the same bytes, 8-byte aligned (x4_layout):
 *   [0, 4 QS)           the four blocks' QS bytes of values, in order;
 *   [4 QS, 4 QS + 16)   Q5_0 only: their four 32-bit high-bit words;
 *   then 8 bytes        their four scales d (f16), in order.
 * Lane part p (8 a block) takes block k = p / 2 and its part h = p % 2 in
 * the file's type (elements 16 h .. 16 h + 15 of Q8_0; of Q4_0 and Q5_0 the
 * low and high nibbles of qs[8 h .. 8 h + 7]): its values with one or two
 * 8-byte loads, then the file's type decodes and multiplies them. */
template <int QS, int QH>
struct x4_layout {
    static constexpr int qs = 0, qh = 4 * QS, d = 4 * QS + 4 * QH, bytes = d + 8;
};
typedef x4_layout<16, 0> x4_q4_0;
typedef x4_layout<16, 4> x4_q5_0;
typedef x4_layout<32, 0> x4_q8_0;
static_assert(x4_q4_0::bytes == LUMA_X4_Q4_0_BYTES && x4_q5_0::bytes == LUMA_X4_Q5_0_BYTES &&
                  x4_q8_0::bytes == LUMA_X4_Q8_0_BYTES,
              "cuda_internal.h's sizes of the repacked blocks");

template <class T, class L>
struct type_x4 {
    static constexpr int qk = 128, bytes = L::bytes, lpb = 8;
    typedef typename T::raw_t raw_t;
    typedef typename T::w_t w_t;
    typedef typename T::x_t x_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r);
    static __device__ void decode(const raw_t &r, int p, w_t &w) { T::decode(r, p % 2, w); }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        T::loadx(a, j, ib * 4 + p / 2, p % 2, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x) { return T::dot(w, x); }
};

/* Q8_0 with 16 elements a part, where type_q8_0 has 8 (its lpb is 4) */
struct type_q8_0_16 {
    struct raw_t { int2 lo, hi; uint16_t d; };
    struct w_t { int q[4]; float d; };
    struct x_t { int4 q; float d; };
    static __device__ void decode(const raw_t &r, int, w_t &w)
    {
        w.d = f16_bits(r.d);
        w.q[0] = r.lo.x;
        w.q[1] = r.lo.y;
        w.q[2] = r.hi.x;
        w.q[3] = r.hi.y;
    }
    /* ib: the block of 32, h: its half */
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int h, x_t &x)
    {
        x.q = *(const int4 *)(a.q + j * a.q_stride + ib * 8 + 4 * h);
        x.d = a.ds[j * a.ds_stride + ib].x;
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        int s = __dp4a(w.q[0], x.q.x, __dp4a(w.q[1], x.q.y, __dp4a(w.q[2], x.q.z, __dp4a(w.q[3], x.q.w, 0))));
        return w.d * x.d * (float)s;
    }
};

template <>
__device__ void type_x4<type_q4_0, x4_q4_0>::fetch(const uint8_t *b, int p, raw_t &r)
{
    int2 q = *(const int2 *)(b + 8 * p);   /* block p / 2's qs[8 h ..] */
    r.q[0] = q.x;
    r.q[1] = q.y;
    r.d = *(const uint16_t *)(b + x4_q4_0::d + 2 * (p / 2));
}

template <>
__device__ void type_x4<type_q5_0, x4_q5_0>::fetch(const uint8_t *b, int p, raw_t &r)
{
    int2 q = *(const int2 *)(b + 8 * p);
    r.q[0] = q.x;
    r.q[1] = q.y;
    r.qh = *(const uint32_t *)(b + x4_q5_0::qh + 4 * (p / 2));
    r.d = *(const uint16_t *)(b + x4_q5_0::d + 2 * (p / 2));
}

template <>
__device__ void type_x4<type_q8_0_16, x4_q8_0>::fetch(const uint8_t *b, int p, raw_t &r)
{
    r.lo = *(const int2 *)(b + 16 * p);   /* block p / 2's qs[16 h ..] */
    r.hi = *(const int2 *)(b + 16 * p + 8);
    r.d = *(const uint16_t *)(b + x4_q8_0::d + 2 * (p / 2));
}

typedef type_x4<type_q4_0, x4_q4_0> type_q4_0_mmv;
typedef type_x4<type_q5_0, x4_q5_0> type_q5_0_mmv;
typedef type_x4<type_q8_0_16, x4_q8_0> type_q8_0_mmv;

/* Float activations for the K formats (Q4_K, Q5_K, and Q6_K in its
 * repacked layout), as block types of the direct kernel: the 8-bit types'
 * fetch and lane parts (part p of a block: positions 16 h .. 16 h + 15,
 * h = p % 2, of sub-blocks 2 (p / 2) and 2 (p / 2) + 1, as k_act32 reads
 * them), each weight's integer made a float exactly (ubyte_f: one byte
 * permute, one add), then the CPU's dequantized value operation by
 * operation (deq8's), 32 a lane, multiplied by the f32 activations, which
 * kf_order has put in the lanes' order (float4 q of part p at 4 (8 q + p)
 * of the block's 256, so that the 8 lanes of a block load 128 contiguous
 * bytes). */
static __device__ __forceinline__ float ubyte_f(uint32_t word, int b)
{
    /* 2^23 + byte b of word, as a float, minus 2^23 */
    return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (uint32_t)b)) - 8388608.0f;
}

/* The block types that take float activations (kf_base's and kf_x4): the
 * staged kernel, which takes 8-bit ones, is not for them. */
struct kf_float {};

/* What the three share: the decoded values of sub-block 2 (p / 2) (a) and
 * of the next (b), the activations in kf_order's order, and their dot. */
struct kf_base : kf_float {
    struct w_t { float a[16], b[16]; };
    struct x_t { float4 v[8]; };
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        const float4 *xq = (const float4 *)(a.f + j * a.f_stride + ib * 256) + p;
#pragma unroll
        for (int q = 0; q < 8; q++) x.v[q] = xq[8 * q];
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float4 a = x.v[q], b = x.v[q + 4];
            s = __fmaf_rn(w.a[4 * q], a.x, s);
            s = __fmaf_rn(w.a[4 * q + 1], a.y, s);
            s = __fmaf_rn(w.a[4 * q + 2], a.z, s);
            s = __fmaf_rn(w.a[4 * q + 3], a.w, s);
            s = __fmaf_rn(w.b[4 * q], b.x, s);
            s = __fmaf_rn(w.b[4 * q + 1], b.y, s);
            s = __fmaf_rn(w.b[4 * q + 2], b.z, s);
            s = __fmaf_rn(w.b[4 * q + 3], b.w, s);
        }
        return s;
    }
    /* d * scale * q - dmin * minimum, as deq8 (and src/quant.c) compute it,
     * from the Q4_K/Q5_K header and the 4 words of a part's values */
    static __device__ __forceinline__ void k_deq(const int4 &hdr, int p, const uint32_t *lo, const uint32_t *hi,
                                                 w_t &w)
    {
        float d = f16_bits((uint32_t)hdr.x & 0xffff), dmin = f16_bits((uint32_t)hdr.x >> 16);
        int s0, m0, s1, m1;
        scale_min_k4_pair(p / 2, hdr.y, hdr.z, hdr.w, s0, m0, s1, m1);
        float da = __fmul_rn(d, (float)s0), ma = __fmul_rn(dmin, (float)m0);
        float db = __fmul_rn(d, (float)s1), mb = __fmul_rn(dmin, (float)m1);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                w.a[4 * i + b] = __fsub_rn(__fmul_rn(da, ubyte_f(lo[i], b)), ma);
                w.b[4 * i + b] = __fsub_rn(__fmul_rn(db, ubyte_f(hi[i], b)), mb);
            }
    }
};

/* Q4_K and Q5_K (K: type_q4_K or type_q5_K): K's loads and bits, then
 * k_deq with the block's scales */
template <class K>
struct kf_k : kf_base {
    static constexpr int qk = 256, bytes = K::bytes, lpb = K::lpb;
    typedef typename K::raw_t raw_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r) { K::fetch(b, p, r); }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        int lo[4], hi[4];
        K::bits(r, p, lo, hi);
        k_deq(r.hdr, p, (const uint32_t *)lo, (const uint32_t *)hi, w);
    }
};
typedef kf_k<type_q4_K> kf_q4_K;
typedef kf_k<type_q5_K> kf_q5_K;

/* reads the repacked copy (w->dev_mmv), as type_q6_K_mmv */
struct kf_q6_K : kf_base {
    static constexpr int qk = 256, bytes = type_q6_K_mmv::bytes, lpb = type_q6_K_mmv::lpb;
    typedef type_q6_K_mmv::raw_t raw_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r) { type_q6_K_mmv::fetch(b, p, r); }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        int v[4] = { r.q.x, r.q.y, r.q.z, r.q.w };
        float da = r.d * (float)(int8_t)(r.sc & 0xFF), db = r.d * (float)(int8_t)(r.sc >> 8);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t lo = (uint32_t)((v[i] & LOW4) | ((r.h.x >> (2 * i)) & 0x03030303) << 4);
            uint32_t hi = (uint32_t)(((v[i] >> 4) & LOW4) | ((r.h.y >> (2 * i)) & 0x03030303) << 4);
#pragma unroll
            for (int b = 0; b < 4; b++) {
                w.a[4 * i + b] = __fmul_rn(da, ubyte_f(lo, b) - 32.0f);
                w.b[4 * i + b] = __fmul_rn(db, ubyte_f(hi, b) - 32.0f);
            }
        }
    }
};

/* Float activations for the repacked Q4_0, Q5_0 and Q8_0 copies, as block
 * types of the direct kernel: type_x4's loads and its file type's decode
 * into 16 int8 values (the offset folded in), each made the CPU's
 * dequantized value d * q (__fmul_rn, as deq8 and src/quant.c), then f32
 * multiply-adds with the activations, read in place: part p's two runs of
 * 8 values start at element 32 (p / 2) + STEP (p % 2) of the block and GAP
 * after it (Q8_0: 16 h and 16 h + 8; Q4_0 and Q5_0, whose part holds the
 * low and high nibbles of qs[8 h ..]: 8 h and 16 + 8 h). */
template <class T, class L, int STEP, int GAP>
struct kf_x4 : kf_float {
    static constexpr int qk = 128, bytes = L::bytes, lpb = 8;
    typedef typename type_x4<T, L>::raw_t raw_t;
    struct w_t { float v[16]; };
    struct x_t { float4 v[4]; };
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r) { type_x4<T, L>::fetch(b, p, r); }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        typename T::w_t t;
        T::decode(r, p % 2, t);
        const int *q = (const int *)&t;   /* the four words of values lead T::w_t, then d */
        float d = t.d;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int b = 0; b < 4; b++) w.v[4 * i + b] = __fmul_rn(d, (float)(int8_t)(q[i] >> (8 * b)));
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        const float *f = a.f + j * a.f_stride + ib * 128 + 32 * (p / 2) + STEP * (p % 2);
        x.v[0] = *(const float4 *)f;
        x.v[1] = *(const float4 *)(f + 4);
        x.v[2] = *(const float4 *)(f + GAP);
        x.v[3] = *(const float4 *)(f + GAP + 4);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            s = __fmaf_rn(w.v[4 * q], x.v[q].x, s);
            s = __fmaf_rn(w.v[4 * q + 1], x.v[q].y, s);
            s = __fmaf_rn(w.v[4 * q + 2], x.v[q].z, s);
            s = __fmaf_rn(w.v[4 * q + 3], x.v[q].w, s);
        }
        return s;
    }
};
static_assert(offsetof(type_q4_0::w_t, lo) == 0 && offsetof(type_q4_0::w_t, hi) == 8 &&
                  offsetof(type_q8_0_16::w_t, q) == 0,
              "kf_x4 reads a part's values as the first four words of its file type's w_t");
typedef kf_x4<type_q4_0, x4_q4_0, 8, 16> kf_q4_0;
typedef kf_x4<type_q5_0, x4_q5_0, 8, 16> kf_q5_0;
typedef kf_x4<type_q8_0_16, x4_q8_0, 16, 8> kf_q8_0;

/* Whether type T reads the repacked copy (w->dev_mmv) rather than the
 * file's blocks (w->dev). */
template <class T>
static constexpr bool reads_repacked()
{
    return std::is_same<T, type_q6_K_mmv>::value || std::is_same<T, kf_q6_K>::value ||
           std::is_same<T, type_q4_0_mmv>::value || std::is_same<T, type_q5_0_mmv>::value ||
           std::is_same<T, type_q8_0_mmv>::value || std::is_same<T, kf_q4_0>::value ||
           std::is_same<T, kf_q5_0>::value || std::is_same<T, kf_q8_0>::value;
}

/* Which copy of a weight the matrix-vector kernels read for type T (its
 * rows are cols / T::qk blocks of T::bytes either way). */
template <class T>
static const uint8_t *mmv_bytes(const luma_weight *w)
{
    return (const uint8_t *)(reads_repacked<T>() ? w->dev_mmv : w->dev);
}


/* Float weights: a "block" is one 16-byte load, lpb 1; the activations stay
 * f32. Their panels for the GEMM are converted element by element
 * (float_to_f16), so they have no deq8. */
static __device__ __forceinline__ float bf16_bits(uint32_t h)
{
    return __uint_as_float(h << 16);
}

struct float8_x {
    float4 a, b;
    static __device__ void load(const act_rows &x, int j, int64_t ib, float8_x &v)
    {
        const float4 *f = (const float4 *)(x.f + j * x.f_stride + ib * 8);
        v.a = f[0];
        v.b = f[1];
    }
};

struct float8_w {
    float f[8];
    static __device__ float dot(const float8_w &w, const float8_x &x)
    {
        return w.f[0] * x.a.x + w.f[1] * x.a.y + w.f[2] * x.a.z + w.f[3] * x.a.w +
               w.f[4] * x.b.x + w.f[5] * x.b.y + w.f[6] * x.b.z + w.f[7] * x.b.w;
    }
};

struct type_f16 {
    static constexpr int qk = 8, bytes = 16, lpb = 1;
    typedef uint4 raw_t;
    typedef float8_w w_t;
    typedef float8_x x_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r = *(const uint4 *)b;
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        uint32_t u[4] = { r.x, r.y, r.z, r.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(*(const __half2 *)&u[i]);
            w.f[2 * i] = f.x;
            w.f[2 * i + 1] = f.y;
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        float8_x::load(a, j, ib, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return float8_w::dot(w, x);
    }
};

struct type_bf16 {
    static constexpr int qk = 8, bytes = 16, lpb = 1;
    typedef uint4 raw_t;
    typedef float8_w w_t;
    typedef float8_x x_t;
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r = *(const uint4 *)b;
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        uint32_t u[4] = { r.x, r.y, r.z, r.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.f[2 * i] = bf16_bits(u[i] & 0xffff);
            w.f[2 * i + 1] = bf16_bits(u[i] >> 16);
        }
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        float8_x::load(a, j, ib, x);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return float8_w::dot(w, x);
    }
};

struct type_f32 {
    static constexpr int qk = 4, bytes = 16, lpb = 1;
    typedef float4 raw_t;
    struct w_t { float4 f; };
    struct x_t { float4 f; };
    static __device__ void fetch(const uint8_t *b, int p, raw_t &r)
    {
        r = *(const float4 *)b;
    }
    static __device__ void decode(const raw_t &r, int p, w_t &w)
    {
        w.f = r;
    }
    static __device__ void loadx(const act_rows &a, int j, int64_t ib, int p, x_t &x)
    {
        x.f = *(const float4 *)(a.f + j * a.f_stride + ib * 4);
    }
    static __device__ float dot(const w_t &w, const x_t &x)
    {
        return w.f.x * x.f.x + w.f.y * x.f.y + w.f.z * x.f.z + w.f.w * x.f.w;
    }
};

/* ---- matrix-vector path ------------------------------------------------------- */

#define MMV_TC_MAX_M 64  /* the most rows mmv_tc takes */

/* The n8 tiles (octets of activation rows) of an mmv_tc CTA at m rows: one
 * up to 8, two above */
static __host__ __device__ __forceinline__ int mmv_tc_nt(int m)
{
    return m <= 8 ? 1 : 2;
}

/* The groups of 8 NT activation rows that cover m: a tile's CTAs (each
 * reads the tile's weights; those after the first find them in L2) */
static __host__ __device__ __forceinline__ int mmv_tc_groups(int m, int NT)
{
    return (m + 8 * NT - 1) / (8 * NT);
}

/* Rows of the interleaved activations (put_qi) for m rows: every group's
 * octets, so that the last CTA of a tile finds all it reads. */
static __host__ __device__ __forceinline__ int tc_qi_rows(int m)
{
    return mmv_tc_groups(m, mmv_tc_nt(m)) * 8 * mmv_tc_nt(m);
}

/* The int8 values of rows of cols for mmv_tc (act_rows.qi; cols a
 * multiple of 256): octet o (rows 8 o .. 8 o + 7; past the last row up
 * to tc_qi_rows, the last row again), superblock ib (nb a row), load j
 * (0..3) and lane 4 g + t of a warp at int4 (o nb + ib) 128 + 32 j + 4 g
 * + t: row 8 o + g's bytes 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3 of
 * the superblock's 32-byte chunks 2 j (the int4's first 8 bytes) and 2 j
 * + 1. A warp's load of one superblock's chunk pair is 512 contiguous
 * bytes (against 8 rows' lines in the plain layout). This writes the 8
 * values of the plain layout's unit i (elements 8 i .. 8 i + 7) there: two
 * words, t and t + 1. */
static __device__ __forceinline__ void put_qi(uint32_t *qi, int64_t cols, int m, int64_t i, uint2 v)
{
    const int64_t e = 8 * i, j = e / cols, p = e % cols, nb = cols / 256;
    const int c = (int)(p % 256) / 32, w = (int)(p % 32), t = (w % 16) / 4;
    const int64_t last = j == m - 1 ? tc_qi_rows(m) : j + 1;   /* the last row fills its octet or group */
    for (int64_t r = j; r < last; r++) {
        const int64_t at = ((r / 8 * nb + p / 256) * 128 + 32 * (c / 2) + 4 * (r % 8) + t) * 4 + 2 * (c % 2) + w / 16;
        qi[at] = v.x;
        qi[at + 4] = v.y;   /* t + 1 */
    }
}

/* Unit i's int8 values into q and ds (q8_put) and, where qi is not NULL,
 * into the interleaved copy (put_qi: m rows of cols). */
static __device__ __forceinline__ void q8_store(const int iq[8], float d, int64_t i, bool live, int lane,
                                                int8_t *__restrict__ q, float2 *__restrict__ ds,
                                                uint32_t *__restrict__ qi, int64_t cols, int m)
{
    const uint2 packed = q8_put(iq, d, i, live, lane, q, ds);
    if (live && qi) put_qi(qi, cols, m, i, packed);
}

template <int SCHEME, bool F16, int ACT = -1, bool PERM = false>
static __global__ void quantize_act(const float *__restrict__ x, int64_t n8, int8_t *__restrict__ q,
                                    float2 *__restrict__ ds, __half *__restrict__ xh, const float *__restrict__ up,
                                    float *__restrict__ gated, bool early, uint32_t *__restrict__ qi, int64_t cols,
                                    int m)
{
    follow_previous_kernel(early);
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = i < n8;   /* every lane takes part in the shuffles */
    float v[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    if (live) {
        float4 a = ((const float4 *)x)[2 * i], b = ((const float4 *)x)[2 * i + 1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        if (ACT >= 0) {
            /* the gated activation first, stored as gelu_mul / silu_mul
             * store it */
            float4 c = ((const float4 *)up)[2 * i], e = ((const float4 *)up)[2 * i + 1];
            float u[8] = { c.x, c.y, c.z, c.w, e.x, e.y, e.z, e.w };
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = act_gated<ACT < 0 ? 0 : ACT>(v[j], u[j]);
            ((float4 *)gated)[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4 *)gated)[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
    int lane = threadIdx.x % 32, iq[8];
    float d = q8_scale<SCHEME>(v, lane, iq);
    if (F16 && PERM) {
        /* each half superblock in rs_kernel's k order (blocks.cuh) */
        if (live) {
            int64_t base = 8 * i & ~(int64_t)127;
            int l0 = (int)(8 * i & 127);
#pragma unroll
            for (int j = 0; j < 8; j++) xh[base + rs_q4k_pos(l0 + j)] = __float2half_rn(d * (float)iq[j]);
        }
        return;
    }
    if (F16) {
        if (live)
            ((uint4 *)xh)[i] = make_uint4(pack_h2(d * (float)iq[0], d * (float)iq[1]),
                                          pack_h2(d * (float)iq[2], d * (float)iq[3]),
                                          pack_h2(d * (float)iq[4], d * (float)iq[5]),
                                          pack_h2(d * (float)iq[6], d * (float)iq[7]));
        return;
    }
    q8_store(iq, d, i, live, lane, q, ds, qi, cols, m);
}

/* The 8-bit quantization of a normalized row as add_rmsnorm_row leaves it
 * in registers (a float4 a thread and round: float4 k = threadIdx.x + f
 * NORM_THREADS, elements 4 k .. 4 k + 3), making quantize_act's values
 * without storing the row and reading it back in units of 8: a block of
 * 32 is 8 lanes; a super-block of 256 (ACT_Q8_K) two warps, each finding
 * its half's first element of largest magnitude by warp reductions and
 * the pair meeting in shared memory (hm: a float2 a warp and round, the
 * magnitude and the signed value; the lower half wins a tie, so the first
 * element wins, as in q8k_warp). The same int8 values and scales as
 * quantize_act on the stored row: a block's values, its largest magnitude
 * and its first element of it, whatever lane holds what. */
template <int F, int SCHEME>
static __device__ __forceinline__ void quantize_regs(const float4 (&o)[F], int64_t cols, int8_t *__restrict__ q,
                                                     float2 *__restrict__ ds, float2 (*hm)[NORM_THREADS / 32])
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t n4 = cols / 4, row4 = (int64_t)blockIdx.x * n4;
    if (SCHEME == ACT_Q8_K) {
#pragma unroll
        for (int f = 0; f < F; f++) {
            const float v[4] = { o[f].x, o[f].y, o[f].z, o[f].w };
            float vmax;
            const float amax = warp_first_max<4>(v, lane, vmax);
            if (lane == 0) hm[f][warp] = make_float2(amax, vmax);
        }
        __syncthreads();
    }
#pragma unroll
    for (int f = 0; f < F; f++) {
        const int64_t k = threadIdx.x + (int64_t)f * NORM_THREADS;
        const float v[4] = { o[f].x, o[f].y, o[f].z, o[f].w };
        int iq[4];
        float d;
        if (SCHEME == ACT_Q8_K) {
            const float2 h0 = hm[f][warp & ~1], h1 = hm[f][warp | 1], h = h1.x > h0.x ? h1 : h0;
            d = q8k_values<4>(v, h.x, h.y, iq);
        } else {
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
            d = q8_0_values<4>(v, amax, iq);
        }
        int sum = iq[0] + iq[1] + iq[2] + iq[3];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (k < n4) {
            ((uint32_t *)q)[row4 + k] = (uint32_t)(iq[0] & 255) | (uint32_t)(iq[1] & 255) << 8 |
                                        (uint32_t)(iq[2] & 255) << 16 | (uint32_t)(iq[3] & 255) << 24;
            if (lane % 8 == 0) ds[(row4 + k) / 8] = make_float2(d, d * (float)sum);
        }
    }
}

/* A residual add and RMSNorm (norm.cuh, add_rmsnorm_row) of row blockIdx.x
 * into out, then out's quantization for a product, as quantize_act<SCHEME,
 * false> makes it (the int8 values into q, ds and, where not NULL, qi):
 * the same bits as add_rmsnorm_regs<F> followed by quantize_act. A row of
 * one float4 a thread is quantized from the registers (quantize_regs,
 * unless regs is false or qi is asked for); else the CTA's threads take
 * the stored row's units of 8 in turn. A row is whole blocks (32 or 256),
 * so the lanes of a block are all in the row or all past it. */
template <int F, int SCHEME>
static __global__ void __launch_bounds__(NORM_THREADS)
norm_quantize(float *x, const float *y, const float *yg, const float *g, int64_t cols, float eps, float *out,
              bool early, int8_t *__restrict__ q, float2 *__restrict__ ds, uint32_t *__restrict__ qi, int m, bool regs)
{
    follow_previous_kernel(early);
    __shared__ float partial[NORM_THREADS / 32];
    float4 o[F];
    add_rmsnorm_row<F>(x, y, yg, g, cols, eps, out, partial, o);
    if constexpr (F == 1) {
        if (!qi && regs) {
            __shared__ float2 hm[F][NORM_THREADS / 32];
            quantize_regs<F, SCHEME>(o, cols, q, ds, hm);
            return;
        }
    }
    /* the interleaved copy (put_qi) takes units of 8; rows past NORM_THREADS
     * float4s quantize faster so too (two to eight rounds of the
     * registers' quantizer cost more shuffles than the read-back saves:
     * cuda/NOTES.md) */
    __syncthreads();   /* the row's out, written by every thread, is read by others below */
    const int64_t n8 = cols / 8;
    const float *row = out + (size_t)blockIdx.x * (size_t)cols;
    int lane = threadIdx.x % 32;
    /* every round's units loaded before any is quantized: the stores of
     * one round's values could alias the next round's loads, so the
     * compiler would not move those above them */
    constexpr int R = (F + 1) / 2;   /* rounds of NORM_THREADS units: F x 4 x NORM_THREADS columns at most */
    float4 lo[R], hi[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int64_t u = (int64_t)r * NORM_THREADS + threadIdx.x;
        lo[r] = hi[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (u < n8) {
            lo[r] = ((const float4 *)row)[2 * u];
            hi[r] = ((const float4 *)row)[2 * u + 1];
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int64_t u = (int64_t)r * NORM_THREADS + threadIdx.x;
        float v[8] = { lo[r].x, lo[r].y, lo[r].z, lo[r].w, hi[r].x, hi[r].y, hi[r].z, hi[r].w };
        int iq[8];
        float d = q8_scale<SCHEME>(v, lane, iq);
        q8_store(iq, d, (int64_t)blockIdx.x * n8 + u, u < n8, lane, q, ds, qi, cols, m);
    }
}

/* Queues quantize_act for t's activation format: the f16 of d * q into xh
 * (in rs_kernel's k order when RS, for Q4_K), or the int8 values and scales
 * into q and ds, and where qi is not NULL (the callers pass it only with
 * the int8 values of Q8_K) also into qi, interleaved for mmv_tc (m rows of
 * cols: put_qi); with ACT >= 0 x is first replaced by act(x) * up (stored
 * in gated). With c->early the product after it starts before it waits
 * (cuda/launch.cuh): the product's CTAs are placed, and fetch their first
 * weights, while the kernel before the quantizer (decode attention before
 * o, the norm before q, k and v) still runs. */
template <int ACT, bool RS = false>
static void quantize_launch(cuda_backend *c, enum luma_type t, float *gated, const float *x, const float *up,
                            int64_t n, int8_t *q, float2 *ds, __half *xh, uint32_t *qi = NULL, int64_t cols = 0,
                            int m = 0)
{
    bool k = luma_type_get(t)->act_type == LUMA_Q8_K;
    if (n % (k ? 256 : 32) != 0 || ((uintptr_t)x & 15) != 0 || ((uintptr_t)up & 15) != 0) {
        luma_cuda_failf(c, "matmul: %lld activations at %p cannot be quantized for %s", (long long)n, (const void *)x,
                        luma_type_name(t));
        return;
    }
    int64_t n8 = n / 8;
    unsigned grid = (unsigned)((n8 + 255) / 256);
    const bool early = c->early >= 1;
    if constexpr (RS) {
        luma_launch(c, c->stream, grid, 256, 0, quantize_act<ACT_Q8_K, true, ACT, true>, x, n8, q, ds, xh, up, gated,
                    early, qi, cols, m);
    } else {
        if (xh && k)
            luma_launch(c, c->stream, grid, 256, 0, quantize_act<ACT_Q8_K, true, ACT>, x, n8, q, ds, xh, up, gated,
                        early, qi, cols, m);
        else if (xh)
            luma_launch(c, c->stream, grid, 256, 0, quantize_act<ACT_Q8_0, true, ACT>, x, n8, q, ds, xh, up, gated,
                        early, qi, cols, m);
    }
    if (!xh && k) luma_launch(c, c->stream, grid, 256, 0, quantize_act<ACT_Q8_K, false, ACT>, x, n8, q, ds, xh, up,
                              gated, early, qi, cols, m);
    else if (!xh) luma_launch(c, c->stream, grid, 256, 0, quantize_act<ACT_Q8_0, false, ACT>, x, n8, q, ds, xh, up,
                              gated, early, qi, cols, m);
    luma_cuda_fail(c, cudaGetLastError(), "matmul (quantizing activations)");
}

void luma_cuda_quantize_act(cuda_backend *c, enum luma_type t, const float *x, int64_t n, int8_t *q, float2 *ds,
                            __half *xh)
{
    quantize_launch<-1>(c, t, NULL, x, NULL, n, q, ds, xh);
}

void luma_cuda_quantize_act_rs(cuda_backend *c, const float *x, int64_t n, __half *xh)
{
    quantize_launch<-1, true>(c, LUMA_Q4_K, NULL, x, NULL, n, NULL, NULL, xh);
}

/* Weight rows per warp (direct kernel) or row group (staged kernel): two
 * when there are several activation rows, so that one activation load
 * serves both. */
static constexpr __host__ __device__ int mmv_rows(int maxm)
{
    return maxm == 1 ? 1 : 2;
}

/* -- the direct kernel: weights loaded straight into registers ------------- */

/* The weights of one direct launch: up to MMV_SEGS matrices of one type and
 * width multiplied by the same activations (q, k and v; gate and up), each
 * starting on a CTA of its own: segment i takes CTAs [cta0[i], cta0[i + 1])
 * (unused segments start past the grid). */
#define MMV_SEGS 3
struct mmv_segs {
    const uint8_t *w[MMV_SEGS];
    float *y[MMV_SEGS];
    int64_t rows[MMV_SEGS];
    unsigned cta0[MMV_SEGS];
    size_t row_bytes[MMV_SEGS];
    int nb[MMV_SEGS];          /* blocks of a row */
    unsigned cta_b;            /* the first CTA of a segment of the second type (UINT_MAX: none) */
};

/* q and k rotated as the direct kernel writes them (luma_cuda_matmul_qkv_rope):
 * the segments in mask (bit i: segment i) hold heads of head_dim rows, whose
 * pairs of rows (2i, 2i + 1) turn by frequency i of their head at pos[j] for
 * activation row j (RoPE NORM); a segment's bias (q's, k's or v's, NULL:
 * none) is added to each of its sums first, as add_bias adds it. Empty when
 * not ROPE. */
template <bool ROPE> struct mmv_rope {};
template <> struct mmv_rope<true> {
    const int32_t *pos;
    uint32_t mask;
    int32_t head_dim;
    rope_args a;
    const float *bias[MMV_SEGS];
};

/* The pending request of luma_cuda_matmul_qkv_rope: q, k and v's outputs
 * and biases, and the bits of the outputs a direct launch finished. */
struct mmv_rope_request {
    float *y[3];
    const float *b[3];
    const float *gq, *gk;      /* q's and k's norm gains (NULL: none), which only mmv_heads applies */
    float eps;
    mmv_rope<true> rp;
    int done;
};

/* Segment seg's bias (constant indices: rp stays a kernel parameter). */
template <bool ROPE>
static __device__ __forceinline__ const float *mmv_seg_bias(const mmv_rope<ROPE> &rp, int seg)
{
    const float *b = NULL;
    if constexpr (ROPE) {
#pragma unroll
        for (int i = 0; i < MMV_SEGS; i++)
            if (seg == i) b = rp.bias[i];
    }
    return b;
}

/* The direct kernels' weight fetch: evict-first loads (ld_w) for the types
 * whose fetch takes them (Q4_K, Q5_K, repacked Q6_K), unless built with
 * LUMA_CUDA_MMV_CS=0 (-DCMAKE_CUDA_FLAGS=-DLUMA_CUDA_MMV_CS=0, for
 * measuring). */
#ifndef LUMA_CUDA_MMV_CS
#define LUMA_CUDA_MMV_CS 1
#endif
template <class T, class = void> struct fetch_takes_cs : std::false_type {};
template <class T>
struct fetch_takes_cs<T, std::void_t<decltype(&T::template fetch<true>)>> : std::true_type {};

template <class T>
static __device__ __forceinline__ void mmv_fetch(const uint8_t *b, int p, typename T::raw_t &r)
{
    if constexpr (LUMA_CUDA_MMV_CS && fetch_takes_cs<T>::value) T::template fetch<true>(b, p, r);
    else T::fetch(b, p, r);
}

/* A lane's round over ROWS weight rows: decodes the raw bytes cur, lets
 * fetch() load the next round's (into cur itself or another buffer), then
 * adds each row's product with block ib of the m <= MAXM activation rows
 * to acc. */
template <class T, int MAXM, int ROWS, class Fetch>
static __device__ __forceinline__ void mmv_round(const typename T::raw_t (&cur)[ROWS], int p, const act_rows &a,
                                                 int m, int ib, Fetch fetch, float (&acc)[ROWS][MAXM])
{
    typename T::w_t wv[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) T::decode(cur[r], p, wv[r]);
    fetch();
#pragma unroll
    for (int j = 0; j < MAXM; j++) {
        if (j < m) {
            typename T::x_t xv;
            T::loadx(a, j, ib, p, xv);
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r][j] += T::dot(wv[r], xv);
        }
    }
}

/* y[j * rows + r] = W[r] . x[j] for the m <= MAXM activation rows; each warp
 * owns ROWS consecutive weight rows (from r0) and keeps ROWS x MAXM sums. A
 * lane takes blocks ib0, ib0 + stride, ...; the raw bytes of its next block
 * are fetched before the current one is decoded and used, so that a load
 * is in flight while the lane computes. TWO (one row, one activation row:
 * mmv_two_ok) alternates two fetch buffers; the sums are the same. */
template <class T, int MAXM, int ROWS, bool ROPE, bool TWO>
static __device__ __forceinline__ void mmv_direct_rows(const uint8_t *w, float *y, int64_t rows, int64_t r0,
                                                       size_t row_bytes, int nb, const act_rows &a, int m,
                                                       const mmv_rope<ROPE> &rp, bool rot, const float *bias)
{
    constexpr int stride = 32 / T::lpb;  /* blocks of a row covered by the warp at once */
    const int lane = threadIdx.x % 32, p = lane % T::lpb;
    const uint8_t *wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) wr[r] = w + (size_t)min(r0 + r, rows - 1) * row_bytes;
    typename T::raw_t raw[ROWS];
    int ib = lane / T::lpb;
    if (ib < nb)
#pragma unroll
        for (int r = 0; r < ROWS; r++) mmv_fetch<T>(wr[r] + (size_t)ib * T::bytes, p, raw[r]);
    wait_for_previous_kernel();
    let_next_kernel_start();
    float acc[ROWS][MAXM] = {};
    /* a round: decode the blocks at ib_ from cur, let fetch(nxt) fetch the
     * next round's, add the products */
    auto round = [&](typename T::raw_t(&cur)[ROWS], typename T::raw_t(&nxt)[ROWS], int ib_, auto fetch) {
        mmv_round<T, MAXM, ROWS>(cur, p, a, m, ib_, [&]() { fetch(nxt); }, acc);
    };
    if constexpr (TWO) {
        static_assert(MAXM == 1 && ROWS == 1, "two buffers at one row and one activation row");
        /* Two buffers in turn: a fetch lands in the one the round before
         * decoded, so the compiler copies nothing between rounds (one
         * buffer costs a move a word a round: cuda/NOTES.md, "Fewer
         * instructions a round"). Still one round in flight; past the
         * row's end a fetch reads the last block again (a cache hit), so
         * that no fetch is predicated. */
        typename T::raw_t other[ROWS];
        const int last = nb - 1;
        for (; ib < nb; ib += 2 * stride) {
            round(raw, other, ib, [&](typename T::raw_t(&n)[ROWS]) {
                mmv_fetch<T>(wr[0] + (size_t)min(ib + stride, last) * T::bytes, p, n[0]);
            });
            if (ib + stride >= nb) break;
            round(other, raw, ib + stride, [&](typename T::raw_t(&n)[ROWS]) {
                mmv_fetch<T>(wr[0] + (size_t)min(ib + 2 * stride, last) * T::bytes, p, n[0]);
            });
        }
    } else {
        for (; ib < nb; ib += stride)
            round(raw, raw, ib, [&](typename T::raw_t(&n)[ROWS]) {
                if (ib + stride < nb)
#pragma unroll
                    for (int r = 0; r < ROWS; r++) mmv_fetch<T>(wr[r] + (size_t)(ib + stride) * T::bytes, p, n[r]);
            });
    }
    if constexpr (ROPE) {
        if (rot) {   /* every warp of the CTA (its rows are whole pairs) */
            int32_t e = (int32_t)(r0 % rp.head_dim) & ~1;   /* the pair's first column in its head */
            if constexpr (ROWS == 2) {
                /* the warp holds rows r0 (even) and r0 + 1; lane j rotates
                 * activation row j's pair (every lane has every sum) */
                static_assert(MAXM <= 32, "a lane an activation row");
                float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
                for (int j = 0; j < MAXM; j++) {
                    const float s0 = warp_sum(acc[0][j]), s1 = warp_sum(acc[1][j]);
                    if (lane == j) {
                        v0 = s0;
                        v1 = s1;
                    }
                }
                if (lane < m) {
                    if (bias) {
                        v0 = v0 + bias[r0];
                        v1 = v1 + bias[r0 + 1];
                    }
                    float ang = rope_angle(rp.a, (float)rp.pos[lane], e / 2), y0, y1;
                    rope_rotate(v0, v1, sinf(ang), cosf(ang), y0, y1);
                    y[(int64_t)lane * rows + r0] = y0;
                    y[(int64_t)lane * rows + r0 + 1] = y1;
                }
            } else {
                /* one row a warp (m = 1): the pair's other row is the next
                 * or the previous warp's */
                static_assert(ROWS == 1 && MAXM == 1, "one row a warp at one activation row");
                __shared__ float pair[MMV_DIRECT_WARPS];
                int warp = threadIdx.x / 32;
                float v = warp_sum(acc[0][0]);
                if (bias) v = v + bias[r0];
                if (lane == 0) pair[warp] = v;
                __syncthreads();
                if (lane == 0) {
                    bool first = (r0 & 1) == 0;
                    float o = pair[warp ^ 1], ang = rope_angle(rp.a, (float)rp.pos[0], e / 2), y0, y1;
                    rope_rotate(first ? v : o, first ? o : v, sinf(ang), cosf(ang), y0, y1);
                    y[r0] = first ? y0 : y1;
                }
            }
            return;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < MAXM; j++) {
            float v = warp_sum(acc[r][j]);
            if (lane == 0 && j < m && r0 + r < rows) y[(int64_t)j * rows + r0 + r] = bias ? v + bias[r0 + r] : v;
        }
}

/* The weights of one launch, in segments of CTAs: a segment's rows as
 * mmv_direct_rows takes them, in type TA, or in type TB from CTA cta_b on
 * (q and k in one format, v in another of the same activation format); one
 * type when TA and TB are the same. */
/* The segment of mmv_segs that CTA cta works on (constant indices: the
 * segments stay kernel parameters). */
struct mmv_seg {
    const uint8_t *w;
    float *y;
    int64_t rows, cta0;
    size_t row_bytes;
    int nb, seg;
};

static __device__ __forceinline__ mmv_seg mmv_seg_of(const mmv_segs &sg, unsigned cta)
{
    mmv_seg s = { sg.w[0], sg.y[0], sg.rows[0], 0, sg.row_bytes[0], sg.nb[0], 0 };
#pragma unroll
    for (int i = 1; i < MMV_SEGS; i++)
        if (cta >= sg.cta0[i]) {
            s.seg = i;
            s.w = sg.w[i];
            s.y = sg.y[i];
            s.rows = sg.rows[i];
            s.cta0 = sg.cta0[i];
            s.row_bytes = sg.row_bytes[i];
            s.nb = sg.nb[i];
        }
    return s;
}

template <class TA, class TB, int MAXM, int ROWS, bool ROPE, bool TWO = false>
static __global__ void __launch_bounds__(MMV_DIRECT_WARPS * 32)
mmv_direct(mmv_segs sg, act_rows a, int m, const mmv_rope<ROPE> rp)
{
    const mmv_seg s = mmv_seg_of(sg, blockIdx.x);
    const int64_t r0 = (((int64_t)blockIdx.x - s.cta0) * MMV_DIRECT_WARPS + threadIdx.x / 32) * ROWS;
    if (r0 >= s.rows) return;
    bool rot = false;
    if constexpr (ROPE) rot = (rp.mask >> s.seg) & 1;
    const float *bias = mmv_seg_bias(rp, s.seg);
    if constexpr (std::is_same<TA, TB>::value) {
        mmv_direct_rows<TA, MAXM, ROWS, ROPE, TWO>(s.w, s.y, s.rows, r0, s.row_bytes, s.nb, a, m, rp, rot, bias);
    } else {
        if (blockIdx.x < sg.cta_b)
            mmv_direct_rows<TA, MAXM, ROWS, ROPE, TWO>(s.w, s.y, s.rows, r0, s.row_bytes, s.nb, a, m, rp, rot, bias);
        else
            mmv_direct_rows<TB, MAXM, ROWS, ROPE, TWO>(s.w, s.y, s.rows, r0, s.row_bytes, s.nb, a, m, rp, rot, bias);
    }
}

/* Short rows (fewer blocks than three of a warp's rounds: Gemma 3's 640
 * columns, 5 blocks of the repacked types where a warp covers 4 at once),
 * as the direct kernel would leave most lanes idle in a row's last round
 * and pay a warp's set-up and reduction for one round and a bit: each
 * group of T::lpb lanes owns ROWS rows of its own and walks their blocks
 * one at a time (the next block's bytes fetched before the current one is
 * used), so a warp owns 32 / T::lpb x ROWS consecutive rows from r0, every
 * lane busy at every round, and a row's sum is its group's. The same
 * blocks and order for any ROWS and m, so a row's bits do not depend on
 * the batch. */
template <class T, int MAXM, int ROWS>
static __device__ __forceinline__ void mmv_narrow_rows(const uint8_t *w, float *y, int64_t rows, int64_t r0,
                                                       size_t row_bytes, int nb, const act_rows &a, int m)
{
    static_assert(32 % T::lpb == 0, "whole groups of lanes in a warp");
    const int lane = threadIdx.x % 32, p = lane % T::lpb;
    const int64_t row = r0 + (int64_t)(lane / T::lpb) * ROWS;   /* the group's first row */
    const uint8_t *wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) wr[r] = w + (size_t)min(row + r, rows - 1) * row_bytes;
    typename T::raw_t raw[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) mmv_fetch<T>(wr[r], p, raw[r]);
    wait_for_previous_kernel();
    let_next_kernel_start();
    float acc[ROWS][MAXM] = {};
    for (int ib = 0; ib < nb; ib++)
        mmv_round<T, MAXM, ROWS>(raw, p, a, m, ib, [&]() {
            if (ib + 1 < nb)
#pragma unroll
                for (int r = 0; r < ROWS; r++) mmv_fetch<T>(wr[r] + (size_t)(ib + 1) * T::bytes, p, raw[r]);
        }, acc);
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < MAXM; j++) {
            float v = acc[r][j];
#pragma unroll
            for (int o = T::lpb / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (p == 0 && j < m && row + r < rows) y[(int64_t)j * rows + row + r] = v;
        }
}

/* The narrow kernel over mmv_segs (as mmv_direct): a group ROWS rows (two
 * when there are several activation rows, so that one activation load
 * serves both, as in the direct kernel), a warp 32 / lpb groups. */
template <class TA, class TB, int MAXM>
static __global__ void __launch_bounds__(MMV_DIRECT_WARPS * 32)
mmv_narrow(mmv_segs sg, act_rows a, int m)
{
    static_assert(TA::lpb == TB::lpb, "one group of lanes a row for both types");
    constexpr int ROWS = mmv_rows(MAXM);
    const mmv_seg s = mmv_seg_of(sg, blockIdx.x);
    const int64_t r0 = (((int64_t)blockIdx.x - s.cta0) * MMV_DIRECT_WARPS + threadIdx.x / 32) * (32 / TA::lpb) * ROWS;
    if (r0 >= s.rows) return;
    if (std::is_same<TA, TB>::value || blockIdx.x < sg.cta_b)
        mmv_narrow_rows<TA, MAXM, ROWS>(s.w, s.y, s.rows, r0, s.row_bytes, s.nb, a, m);
    else
        mmv_narrow_rows<TB, MAXM, ROWS>(s.w, s.y, s.rows, r0, s.row_bytes, s.nb, a, m);
}

/* -- the staged kernel: weights through shared memory by bulk copies -------- */

/* Bulk copies into shared memory (sm_90) complete on an mbarrier, whose
 * phase ends when all the bytes announced for it have landed. */
static __device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* How the staged kernel walks its weight (set by mmv_staged_launch). A CTA
 * has MMV_STAGED_WARPS warps; ks consecutive warps form a team, which owns
 * one row group (ROWS rows) at a time, each warp a slice of `slice` blocks
 * of every row of the group. The teams of the grid, which is sized to stay
 * resident, take the row groups in turn. Each warp has one shared-memory
 * buffer and streams its slices through it, `piece` blocks of each row of
 * the group at a time: the copy of the next piece starts as soon as the
 * warp has used the last one, and lands while the warp sums up its row
 * group or waits for its team. Shared memory: one mbarrier per warp, the
 * teams' partial sums, then the buffers. */
struct mmv_plan {
    const uint8_t *w;
    size_t row_bytes;
    size_t end16;              /* rows x row_bytes rounded down to 16: bulk copies stop there */
    int64_t rows, groups;
    int nb, ks, slice, piece;
    int stride;                /* bytes of a buffer per row: piece blocks, alignment slack, padding */
    int buf_off;               /* shared-memory offset of the first warp's buffer */
};

/* Byte offset of block kb of row r of group g; rows past the end (an odd
 * last group) read the last row again and write nothing. */
template <class T, int ROWS>
static __device__ __forceinline__ size_t mmv_offset(const mmv_plan &pl, int64_t g, int r, int kb)
{
    int64_t row = min(g * ROWS + r, pl.rows - 1);
    return (size_t)row * pl.row_bytes + (size_t)kb * T::bytes;
}

/* Starts the copy of blocks [kb, kb + n) of the rows of group g into buf,
 * row r at buf + r * stride. Bulk copies need 16-byte aligned ends, so each
 * row's piece is copied from its 16-byte boundary below (its data then
 * starts at offset % 16 of its place) to the one above, except past the
 * weight's last 16-byte boundary, where the lanes copy the few bytes
 * themselves. */
template <class T, int ROWS>
static __device__ void mmv_issue(const mmv_plan &pl, uint8_t *buf, uint64_t *bar, int64_t g, int kb, int n, int lane)
{
    size_t from[ROWS];
    uint32_t len[ROWS], total = 0;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        size_t off = mmv_offset<T, ROWS>(pl, g, r, kb), end = off + (size_t)n * T::bytes;
        size_t to = min((end + 15) & ~(size_t)15, pl.end16);
        from[r] = off & ~(size_t)15;
        len[r] = to > from[r] ? (uint32_t)(to - from[r]) : 0;
        total += len[r];
        if (end > to && lane < (int)(end - to)) {
            buf[r * pl.stride + (to - from[r]) + lane] = pl.w[to + lane];
            fence_proxy_async();
        }
    }
    if (lane == 0) {
        fence_proxy_async();
        mbar_expect(bar, total);
#pragma unroll
        for (int r = 0; r < ROWS; r++)
            if (len[r]) bulk_copy(buf + r * pl.stride, pl.w + from[r], len[r], bar);
    }
}

/* A warp's next piece to copy: piece jp of its gi-th row group. */
struct mmv_cursor {
    int gi, jp;
    __device__ void next(int np)
    {
        if (++jp == np) {
            jp = 0;
            gi++;
        }
    }
};

/* y[j * rows + row] = W[row] . x[j] for the m <= MAXM activation rows; see
 * mmv_plan for who reads what. Each warp's first copy is on its way before
 * the kernel waits for the quantizer (programmatic dependent launch). */
template <class T, int MAXM>
static __global__ void __launch_bounds__(MMV_STAGED_WARPS * 32)
mmv_staged(const mmv_plan pl, act_rows a, int m, float *__restrict__ y)
{
    constexpr int ROWS = mmv_rows(MAXM), BPI = 32 / T::lpb;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, p = lane % T::lpb;
    const int teams = MMV_STAGED_WARPS / pl.ks, team = warp / pl.ks, part = warp % pl.ks;
    uint64_t *bar = (uint64_t *)smem + warp;
    float *red = (float *)(smem + MMV_STAGED_WARPS * sizeof(uint64_t));   /* [2][warps][ROWS * MAXM] */
    uint8_t *buf = smem + pl.buf_off + warp * ROWS * pl.stride;

    const int k0 = min(part * pl.slice, pl.nb), k1 = min(k0 + pl.slice, pl.nb);
    const int np = (k1 - k0 + pl.piece - 1) / pl.piece;
    const int team0 = blockIdx.x * teams + team, nteams = gridDim.x * teams;
    const int ngroups = team0 < pl.groups ? (int)((pl.groups - 1 - team0) / nteams + 1) : 0;

    if (lane == 0) {
        mbar_init(bar);
        fence_proxy_async();
    }
    __syncwarp();
    mmv_cursor next = { 0, 0 };
    if (np > 0 && ngroups > 0) {
        int kb = k0;
        mmv_issue<T, ROWS>(pl, buf, bar, team0, kb, min(pl.piece, k1 - kb), lane);
        next.next(np);
    }
    wait_for_previous_kernel();
    let_next_kernel_start();

    uint32_t phase = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        const int64_t g = team0 + (int64_t)gi * nteams;
        float acc[ROWS][MAXM] = {};
        for (int jp = 0; jp < np; jp++) {
            mbar_wait(bar, phase);
            phase ^= 1;
            __syncwarp();   /* the lanes' own bytes of the piece */
            const int kb = k0 + jp * pl.piece, n = min(pl.piece, k1 - kb);
            const uint8_t *src[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                src[r] = buf + r * pl.stride + (mmv_offset<T, ROWS>(pl, g, r, kb) & 15);
            for (int ib = lane / T::lpb; ib < n; ib += BPI) {
                typename T::w_t wv[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    typename T::raw_t raw;
                    T::fetch(src[r] + ib * T::bytes, p, raw);
                    T::decode(raw, p, wv[r]);
                }
#pragma unroll
                for (int j = 0; j < MAXM; j++) {
                    if (j < m) {
                        typename T::x_t xv;
                        T::loadx(a, j, kb + ib, p, xv);
#pragma unroll
                        for (int r = 0; r < ROWS; r++) acc[r][j] += T::dot(wv[r], xv);
                    }
                }
            }
            __syncwarp();   /* every lane is done with the buffer */
            if (next.gi < ngroups) {
                int kb2 = k0 + next.jp * pl.piece;
                mmv_issue<T, ROWS>(pl, buf, bar, team0 + (int64_t)next.gi * nteams, kb2, min(pl.piece, k1 - kb2),
                                   lane);
                next.next(np);
            }
        }

        /* the row group's sums: straight out of a lone warp, or through the
         * team's slots of red (two sets, so that a warp may write the next
         * group's while the first warp still reads this one's) */
        float *mine = red + ((gi & 1) * MMV_STAGED_WARPS + warp) * ROWS * MAXM;
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int j = 0; j < MAXM; j++) {
                float v = j < m ? warp_sum(acc[r][j]) : 0.0f;
                int64_t row = g * ROWS + r;
                if (pl.ks == 1 && lane == 0 && j < m && row < pl.rows) y[(int64_t)j * pl.rows + row] = v;
                else if (pl.ks > 1 && lane == 0) mine[r * MAXM + j] = v;
            }
        if (pl.ks == 1) continue;
        team_barrier(1 + team, pl.ks * 32);
        if (part == 0 && lane < ROWS * MAXM) {
            const float *v = red + ((gi & 1) * MMV_STAGED_WARPS + warp) * ROWS * MAXM + lane;
            float sum = 0.0f;
            for (int q = 0; q < pl.ks; q++) sum += v[q * ROWS * MAXM];
            int j = lane % MAXM;
            int64_t row = g * ROWS + lane / MAXM;
            if (j < m && row < pl.rows) y[(int64_t)j * pl.rows + row] = sum;
        }
    }
}

/* The device's limits a matrix-vector kernel is planned with (the staged
 * kernels' shapes, the direct kernels' waves), read at the first use of
 * each (which runs eagerly: a step's first run is never recorded). */
struct mmv_limits {
    cudaError_t e;
    cudaFuncAttributes fa;     /* registers, static shared memory */
    int sm_threads, sm_regs, sm_smem, cta_reserved;
};

/* The limits of kernel fn, after allowing it smem_max bytes of dynamic
 * shared memory (none asked for when 0). */
static mmv_limits mmv_setup(const void *fn, int smem_max)
{
    mmv_limits l = {};
    int dev = 0;
    l.e = cudaGetDevice(&dev);
    if (l.e == cudaSuccess && smem_max > 0)
        l.e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
    if (l.e == cudaSuccess) l.e = cudaFuncGetAttributes(&l.fa, fn);
    if (l.e == cudaSuccess) l.e = cudaDeviceGetAttribute(&l.sm_threads, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
    if (l.e == cudaSuccess) l.e = cudaDeviceGetAttribute(&l.sm_regs, cudaDevAttrMaxRegistersPerMultiprocessor, dev);
    if (l.e == cudaSuccess)
        l.e = cudaDeviceGetAttribute(&l.sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    if (l.e == cudaSuccess)
        l.e = cudaDeviceGetAttribute(&l.cta_reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    return l;
}

/* CTAs of `warps` warps an SM holds of a kernel with smem bytes of dynamic
 * shared memory each (registers are allocated 256 to a warp); computed here
 * rather than asked of the runtime, which a recording stream may not allow. */
static int mmv_occupancy(const mmv_limits &l, size_t smem, int warps)
{
    const int threads = warps * 32;
    int by_threads = l.sm_threads / threads;
    int warp_regs = (l.fa.numRegs * 32 + 255) / 256 * 256;
    int by_regs = warp_regs > 0 ? l.sm_regs / warp_regs / warps : by_threads;
    size_t per_cta = smem + l.fa.sharedSizeBytes + (size_t)l.cta_reserved;
    int by_smem = smem > MMV_SMEM_MAX ? 0 : (int)((size_t)l.sm_smem / per_cta);
    int n = by_threads < by_regs ? by_threads : by_regs;
    return n < by_smem ? n : by_smem;
}

/* Plans and launches one staged kernel. A piece is at most MMV_PIECE_BYTES
 * of a row group. One activation row keeps a warp to each row group (ks = 1:
 * splitting rows measured slower); several split the rows between warps
 * until the row groups give every resident warp two. */
template <class T, int MAXM>
static void mmv_staged_launch(cuda_backend *c, const luma_weight *w, const act_rows &a, int m, float *y)
{
    constexpr int ROWS = mmv_rows(MAXM), BPI = 32 / T::lpb;
    static const mmv_limits lim = mmv_setup((const void *)mmv_staged<T, MAXM>, MMV_SMEM_MAX);
    if (luma_cuda_fail(c, lim.e, "matmul (matrix-vector kernel setup)")) return;
    mmv_plan pl;
    pl.w = mmv_bytes<T>(w);
    pl.row_bytes = (size_t)(w->cols / T::qk) * (size_t)T::bytes;
    pl.end16 = pl.row_bytes * (size_t)w->rows & ~(size_t)15;
    pl.rows = w->rows;
    pl.groups = (w->rows + ROWS - 1) / ROWS;
    pl.nb = (int)(w->cols / T::qk);
    pl.buf_off = (MMV_STAGED_WARPS * (int)sizeof(uint64_t) + 2 * MMV_STAGED_WARPS * ROWS * MAXM * (int)sizeof(float) +
                  127) & ~127;
    int iters = (pl.nb + BPI - 1) / BPI;   /* of a warp over a whole row */
    int piece_iters = MMV_PIECE_BYTES / ROWS / (BPI * T::bytes);
    if (piece_iters < 1) piece_iters = 1;
    /* ks from the occupancy of whole-row pieces, then the occupancy of its own pieces */
    int ks = 1, occ = 0;
    size_t smem = 0;
    for (int pass = 0; pass < 2; pass++) {
        int slice_iters = (iters + ks - 1) / ks;
        pl.ks = ks;
        pl.slice = slice_iters * BPI;
        pl.piece = (piece_iters < slice_iters ? piece_iters : slice_iters) * BPI;
        pl.stride = (pl.piece * T::bytes + 32 + 15) & ~15;
        smem = (size_t)pl.buf_off + (size_t)MMV_STAGED_WARPS * ROWS * pl.stride;
        occ = mmv_occupancy(lim, smem, MMV_STAGED_WARPS);
        if (occ < 1) {
            luma_cuda_failf(c, "matmul: the matrix-vector kernel does not fit an SM (%zu bytes of shared memory)",
                            smem);
            return;
        }
        int64_t resident = (int64_t)c->n_sm * occ * MMV_STAGED_WARPS;
        if (MAXM > 1)
            while (ks < MMV_STAGED_WARPS && 2 * ks <= iters && pl.groups * ks < 2 * resident) ks *= 2;
        if (ks == pl.ks) break;
    }
    int64_t teams = MMV_STAGED_WARPS / pl.ks, want = (pl.groups + teams - 1) / teams, most = (int64_t)c->n_sm * occ;

    cudaLaunchAttribute at[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, (unsigned)(want < most ? want : most),
                                                MMV_STAGED_WARPS * 32, smem, at);
    luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, mmv_staged<T, MAXM>, pl, a, m, y), "matmul (matrix-vector kernel)");
}

/* The CTAs a direct launch gives a weight of `rows` rows, ROWS rows a warp. */
template <int ROWS>
static unsigned mmv_direct_weight_ctas(int64_t rows)
{
    int64_t warps = (rows + ROWS - 1) / ROWS;
    return (unsigned)((warps + MMV_DIRECT_WARPS - 1) / MMV_DIRECT_WARPS);
}

/* The CTAs of a direct launch of the n weights ws with ROWS rows a warp. */
template <int ROWS>
static unsigned mmv_direct_ctas(const luma_weight *const *ws, int n)
{
    unsigned ctas = 0;
    for (int i = 0; i < n && i < MMV_SEGS; i++) ctas += mmv_direct_weight_ctas<ROWS>(ws[i]->rows);
    return ctas;
}

/* Two rows a warp at one activation row (below) for the K formats of a
 * Q4_K_M model, whose q, k and v launches it is for. */
template <class T>
static constexpr bool mmv_pairs_ok()
{
    return std::is_same<T, type_q4_K>::value || std::is_same<T, type_q5_K>::value ||
           std::is_same<T, type_q6_K_mmv>::value;
}

/* Two fetch buffers in turn (mmv_direct_rows) for one weight row a warp at
 * one activation row, in the K formats of a Q4_K_M model, where it was
 * measured. */
template <class TA, class TB, int MAXM, int ROWS>
static constexpr bool mmv_two_ok()
{
    return MAXM == 1 && ROWS == 1 && mmv_pairs_ok<TA>() && mmv_pairs_ok<TB>();
}

/* Whether a launch takes them: mmv_two_ok, unless LUMA_CUDA_MMV_TWO=0 in
 * the environment keeps one buffer (for measuring; read once). */
template <class TA, class TB, int MAXM, int ROWS>
static bool mmv_two_taken(void)
{
    static const bool on = luma_cuda_env_digit("LUMA_CUDA_MMV_TWO", 1) != 0;
    return mmv_two_ok<TA, TB, MAXM, ROWS>() && on;
}

/* What a launch of the n weights ws does for a pending
 * luma_cuda_matmul_qkv_rope, into *rp: the segments (bit i: ws[i]) that
 * add q's or k's bias and rotate them as they are written, where their
 * rows are whole heads and whole pair-holding CTAs of `unit` rows, and the
 * segment of v, which adds its bias; the bits of the request's outputs
 * they finish into *done. False: the launch does nothing of the request. */
static bool mmv_rope_take(const cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int64_t unit,
                          mmv_rope<true> *rp, int *done)
{
    const mmv_rope_request *rq = c->qkv_rope;
    if (!rq || rq->gq) return false;   /* norms first: mmv_heads alone */
    *rp = rq->rp;
    rp->mask = 0;
    bool any = false;
    for (int i = 0; i < MMV_SEGS; i++) rp->bias[i] = NULL;
    for (int i = 0; i < n && i < MMV_SEGS; i++)
        for (int o = 0; o < 3; o++) {
            if (ys[i] != rq->y[o]) continue;
            if (o < 2 && ws[i]->rows % unit == 0 && ws[i]->rows % rq->rp.head_dim == 0) {
                rp->mask |= 1u << i;
            } else if (o < 2 || !rq->b[o]) {
                continue;
            }
            rp->bias[i] = rq->b[o];
            *done |= 1 << o;
            any = true;
        }
    return any;
}

/* Segments with none in use (each starts past any grid), no second type. */
static mmv_segs mmv_segs_none(void)
{
    mmv_segs sg = {};
    for (int i = 0; i < MMV_SEGS; i++) sg.cta0[i] = UINT_MAX;
    sg.cta_b = UINT_MAX;
    return sg;
}

/* Segment i of sg: the weight's blocks at w (rows of row_bytes, nb blocks
 * a row), its output y, n_ctas CTAs from *ctas on (which it advances). */
static void mmv_seg_put(mmv_segs &sg, int i, const uint8_t *w, float *y, int64_t rows, int nb, size_t row_bytes,
                        unsigned n_ctas, unsigned *ctas)
{
    sg.w[i] = w;
    sg.y[i] = y;
    sg.rows[i] = rows;
    sg.cta0[i] = *ctas;
    sg.nb[i] = nb;
    sg.row_bytes[i] = row_bytes;
    *ctas += n_ctas;
}

/* The segments of a launch of the n weights ws (ws[i] in type TA below
 * n_a, else TB), ROWS rows a warp; their CTAs into *ctas. */
template <class TA, class TB, int ROWS>
static mmv_segs mmv_segs_of(const luma_weight *const *ws, float *const *ys, int n, int n_a, unsigned *ctas)
{
    mmv_segs sg = mmv_segs_none();
    *ctas = 0;
    for (int i = 0; i < n && i < MMV_SEGS; i++) {
        bool b = i >= n_a;
        if (b && sg.cta_b == UINT_MAX) sg.cta_b = *ctas;
        const int nb = (int)(ws[i]->cols / (b ? TB::qk : TA::qk));
        mmv_seg_put(sg, i, b ? mmv_bytes<TB>(ws[i]) : mmv_bytes<TA>(ws[i]), ys[i], ws[i]->rows, nb,
                    (size_t)nb * (size_t)(b ? TB::bytes : TA::bytes), mmv_direct_weight_ctas<ROWS>(ws[i]->rows), ctas);
    }
    return sg;
}

/* Launched as a programmatic dependent of the quantizer (cuda/launch.cuh):
 * the first weight loads go out before the wait. */
template <class TA, class TB, int MAXM, int ROWS>
static void mmv_direct_launch_rows(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int n_a,
                                   const act_rows &a, int m)
{
    unsigned ctas;
    mmv_segs sg = mmv_segs_of<TA, TB, ROWS>(ws, ys, n, n_a, &ctas);
    int done = 0;
    mmv_rope<true> rp;
    const bool rope = mmv_rope_take(c, ws, ys, n, 2 * MMV_DIRECT_WARPS, &rp, &done);
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, ctas, MMV_DIRECT_WARPS * 32, 0, attr);
    constexpr bool two = mmv_two_ok<TA, TB, MAXM, ROWS>();
    const bool take_two = mmv_two_taken<TA, TB, MAXM, ROWS>();
    if (rope) {
        auto *kernel = take_two ? mmv_direct<TA, TB, MAXM, ROWS, true, two> : mmv_direct<TA, TB, MAXM, ROWS, true>;
        if (luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, kernel, sg, a, m, rp),
                           "matmul (matrix-vector kernel, rotating q and k)"))
            return;
        c->qkv_rope->done |= done;
        return;
    }
    auto *kernel = take_two ? mmv_direct<TA, TB, MAXM, ROWS, false, two> : mmv_direct<TA, TB, MAXM, ROWS, false>;
    luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, kernel, sg, a, m, mmv_rope<false>()), "matmul (matrix-vector kernel)");
}

/* CTAs of mmv_direct<TA, TB, 1, ROWS, ROPE, TWO> the GPU holds at once. */
template <class TA, class TB, int ROWS, bool ROPE, bool TWO>
static int64_t mmv_direct_wave(const cuda_backend *c)
{
    static const mmv_limits lim = mmv_setup((const void *)mmv_direct<TA, TB, 1, ROWS, ROPE, TWO>, 0);
    return lim.e == cudaSuccess ? (int64_t)c->n_sm * mmv_occupancy(lim, 0, MMV_DIRECT_WARPS) : 0;
}

/* The same for the kernel mmv_direct_launch_rows takes. */
template <class TA, class TB, int ROWS, bool ROPE>
static int64_t mmv_direct_wave(const cuda_backend *c)
{
    constexpr bool two = mmv_two_ok<TA, TB, 1, ROWS>();
    return mmv_two_taken<TA, TB, 1, ROWS>() ? mmv_direct_wave<TA, TB, ROWS, ROPE, two>(c)
                                            : mmv_direct_wave<TA, TB, ROWS, ROPE, false>(c);
}

/* LUMA_CUDA_MMV_PAIRS in the environment: 0 keeps a row a warp everywhere
 * (for measuring), 2 takes two rows a warp for every launch that can (for
 * testing); otherwise the rule below. Read once. */
static int mmv_pairs_mode(void)
{
    static const int mode = luma_cuda_env_digit("LUMA_CUDA_MMV_PAIRS", 1);
    return mode;
}

/* LUMA_CUDA_MMV_NARROW in the environment: 0 never takes the narrow
 * kernel, 2 takes it for every launch of short rows (for testing);
 * otherwise the rule of mmv_narrow_taken. Read once. */
static int mmv_narrow_mode(void)
{
    static const int mode = luma_cuda_env_digit("LUMA_CUDA_MMV_NARROW", 1);
    return mode;
}

/* Whether the n weights ws take the narrow kernel (a group of lanes a
 * row): each row fewer blocks than MMV_NARROW_ROUNDS rounds of a warp
 * (LUMA_CUDA_MMV_NARROW_ROUNDS in the environment, for measuring), and so
 * many rows that a warp a row would be more than MMV_NARROW_WAVES waves of
 * the GPU (Gemma 3's output projection, 262,144 rows of 640: 65,536
 * CTAs). Small matrices keep a warp a row, whose rounds run side by side.
 * Measured (cuda/NOTES.md, "Many short rows"): rows of 5, 7 and 9 repacked
 * blocks (Gemma 3 270M, Qwen2 0.5B, Gemma 3 1B widths) gain, rows of 16
 * (2,048 wide) lose, hence 3 rounds. The rule
 * reads the weights' shapes only (the wave is the one-activation-row
 * kernel's at any m), so a row takes one kernel whatever the batch. The
 * narrow kernel rotates nothing: a pending q/k/v rotation it leaves to
 * the caller (luma_cuda_matmul_qkv_rope's done bits stay clear), which
 * gives the bits of matmul_many and qk_rope, as the rotating launches do. */
#define MMV_NARROW_WAVES 4
#define MMV_NARROW_ROUNDS 3
template <class TA, class TB>
static constexpr bool mmv_narrow_ok()
{
    return TA::lpb == TB::lpb && TA::lpb >= 4 && 32 % TA::lpb == 0 && !std::is_base_of<kf_float, TA>::value &&
           !std::is_base_of<kf_float, TB>::value;
}

template <class TA, class TB>
static bool mmv_narrow_taken(cuda_backend *c, const luma_weight *const *ws, int n, int n_a)
{
    if constexpr (!mmv_narrow_ok<TA, TB>()) {
        (void)c, (void)ws, (void)n, (void)n_a;
        return false;
    } else {
        const int mode = mmv_narrow_mode();
        if (!mode) return false;
        static const int rounds = luma_cuda_env_digit("LUMA_CUDA_MMV_NARROW_ROUNDS", MMV_NARROW_ROUNDS);
        for (int i = 0; i < n && i < MMV_SEGS; i++)
            if (ws[i]->cols / (i >= n_a ? TB::qk : TA::qk) * TA::lpb >= 32 * rounds) return false;
        if (mode == 2) return true;
        int64_t wave = mmv_direct_wave<TA, TB, 1, false, false>(c);
        return wave > 0 && (int64_t)mmv_direct_ctas<1>(ws, n) > MMV_NARROW_WAVES * wave;
    }
}

template <class TA, class TB, int MAXM>
static void mmv_narrow_launch(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int n_a,
                              const act_rows &a, int m)
{
    unsigned ctas;
    mmv_segs sg = mmv_segs_of<TA, TB, 32 / TA::lpb * mmv_rows(MAXM)>(ws, ys, n, n_a, &ctas);
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, ctas, MMV_DIRECT_WARPS * 32, 0, attr);
    luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, mmv_narrow<TA, TB, MAXM>, sg, a, m),
                   "matmul (matrix-vector kernel, short rows)");
}

/* -- q, k and v in clusters of whole heads (Gemma 3 at one row) -------------
 *
 * Gemma 3's q and k are normalized per head (q_norm, k_norm) before the
 * rotation, which needs every row of a head: the direct kernel's CTAs of 4
 * rows cannot, so qk_rope ran as a launch of its own, about 3 us a layer in
 * the graph on Gemma 3 270M (cuda/NOTES.md). Here a cluster of HEADS_CTAS
 * CTAs of HEADS_WARPS warps makes one head of HEADS_D rows at one
 * activation row, a row a warp exactly as the direct kernel's warp makes
 * it (a lane's blocks ib0, ib0 + stride, ... summed in that order, then the
 * butterfly: the same bits), all of a lane's blocks fetched at once; the
 * row sums meet in the first CTA's shared memory (distributed shared
 * memory), and one warp there normalizes and rotates them with qk_rope's
 * code (qk_head, rope.cuh); v's heads are stored as summed. The repacked
 * Q4_0, Q5_0 and Q8_0 (Gemma 3 270M's and 1B's 640 and 1,152 columns), up
 * to 3 rounds a row. */
#define HEADS_D 256
#define HEADS_CTAS 8
#define HEADS_WARPS (HEADS_D / HEADS_CTAS)

struct mmv_heads_args {
    const int32_t *pos;
    rope_args a;
    float eps;
    const float *g[MMV_SEGS];  /* a segment's norm gains (q's, k's); NULL: v, stored as summed */
    float4 *tab;               /* the step's table of this rotation's angles (heads_angles; NULL: none), */
    bool make;                 /* made by this launch (else read from it), */
    unsigned writer;           /* by the head warp of this CTA */
};

template <class T>
static constexpr bool heads_type()
{
    return std::is_same<T, type_q4_0_mmv>::value || std::is_same<T, type_q5_0_mmv>::value ||
           std::is_same<T, type_q8_0_mmv>::value;
}

/* A lane's blocks of row `row` of a weight at w (nb blocks a row of
 * row_bytes, R rounds at most) fetched into raw, all at once, as the direct
 * kernel's warp fetches them; mmv_heads_sum then makes the warp's sum with
 * the direct kernel's order and butterfly (the same bits). The caller waits
 * for the kernel before between the two. */
template <class T, int R>
static __device__ __forceinline__ void mmv_heads_fetch(const uint8_t *w, size_t row_bytes, int nb, int64_t row,
                                                       typename T::raw_t (&raw)[R])
{
    constexpr int stride = 32 / T::lpb;
    const int lane = threadIdx.x % 32, p = lane % T::lpb, ib0 = lane / T::lpb;
    const uint8_t *wr = w + (size_t)row * row_bytes;
#pragma unroll
    for (int k = 0; k < R; k++)
        if (ib0 + k * stride < nb) mmv_fetch<T>(wr + (size_t)(ib0 + k * stride) * T::bytes, p, raw[k]);
}

template <class T, int R>
static __device__ __forceinline__ float mmv_heads_sum(int nb, const typename T::raw_t (&raw)[R], const act_rows &a)
{
    constexpr int stride = 32 / T::lpb;
    const int lane = threadIdx.x % 32, p = lane % T::lpb, ib0 = lane / T::lpb;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < R; k++) {
        const int ib = ib0 + k * stride;
        if (ib < nb) {
            typename T::w_t wv;
            typename T::x_t xv;
            T::decode(raw[k], p, wv);
            T::loadx(a, 0, ib, p, xv);
            acc += T::dot(wv, xv);
        }
    }
    return warp_sum(acc);
}

/* Row `row` of segment s (R rounds at most), the warp's sum; before(),
 * between the weight fetches and the wait, is work that reads nothing the
 * step's kernels write; after(), right after the wait, work whose loads
 * go out beside the activations'. */
template <class T, int R, class Before, class After>
static __device__ __forceinline__ float mmv_heads_row(const mmv_seg &s, int64_t row, const act_rows &a, Before before,
                                                      After after)
{
    typename T::raw_t raw[R];
    mmv_heads_fetch<T, R>(s.w, s.row_bytes, s.nb, row, raw);
    before();
    wait_for_previous_kernel();
    let_next_kernel_start();
    after();
    return mmv_heads_sum<T, R>(s.nb, raw, a);
}

template <class TA, class TB, int R>
static __global__ void __launch_bounds__(HEADS_WARPS * 32, 1)
mmv_heads(mmv_segs sg, act_rows a, const mmv_heads_args h)
{
    __shared__ __align__(16) float head[HEADS_D];
    cg::cluster_group cl = cg::this_cluster();
    /* the first CTA's shared memory takes writes only once it has started:
     * every CTA arrives here and waits before its write, long after */
    cl.barrier_arrive();
    const mmv_seg s = mmv_seg_of(sg, blockIdx.x);
    const int warp = threadIdx.x / 32;
    const int64_t row = ((int64_t)blockIdx.x - s.cta0) * HEADS_WARPS + warp, r0 = row - row % HEADS_D;
    const float *g = NULL;
#pragma unroll
    for (int i = 0; i < MMV_SEGS; i++)
        if (s.seg == i) g = h.g[i];
    /* The head warp's gains and angles (the head's first warp, which also
     * makes a row). The angles are the same for every head of a rotation
     * in the step: the step's first launch of it makes them before its
     * wait (the step's positions and the gains: nothing the step's kernels
     * write), once the row's weights are on their way, and its writer
     * stores them in the step's table after the wait; the later launches
     * load them from there after theirs, beside the activations. Made at
     * every layer, they kept the head warp from its wait: 3.4% of Gemma 3
     * 270M's step (cuda/NOTES.md). */
    const bool rotates = g && warp == 0 && cl.block_rank() == 0, reads = rotates && h.tab && !h.make;
    const int lane = threadIdx.x % 32;
    qk_prep<HEADS_D> q;
    auto prep = [&]() {
        if (reads) qk_head_gains<HEADS_D>(q, (const float4 *)g);
        else if (rotates) qk_head_prep<HEADS_D>(q, (const float4 *)g, (float)h.pos[0], h.a);
    };
    auto after = [&]() {
        if (reads) {
            const float4 sn = h.tab[2 * lane], cs = h.tab[2 * lane + 1];
            q.sn[0] = sn.x, q.sn[1] = sn.y, q.sn[2] = sn.z, q.sn[3] = sn.w;
            q.cs[0] = cs.x, q.cs[1] = cs.y, q.cs[2] = cs.z, q.cs[3] = cs.w;
        } else if (rotates && h.tab && blockIdx.x == h.writer) {
            h.tab[2 * lane] = make_float4(q.sn[0], q.sn[1], q.sn[2], q.sn[3]);
            h.tab[2 * lane + 1] = make_float4(q.cs[0], q.cs[1], q.cs[2], q.cs[3]);
        }
    };
    const float v = std::is_same<TA, TB>::value || blockIdx.x < sg.cta_b
                        ? mmv_heads_row<TA, R>(s, row, a, prep, after)
                        : mmv_heads_row<TB, R>(s, row, a, prep, after);
    cl.barrier_wait();
    if (threadIdx.x % 32 == 0) cl.map_shared_rank(head, 0)[row % HEADS_D] = v;
    cl.sync();
    if (cl.block_rank() != 0) return;
    if (g) {
        if (rotates) qk_head_apply<HEADS_D>((float4 *)(s.y + r0), (const float4 *)head, q, true, h.eps, h.a);
    } else {
        for (int t = threadIdx.x; t < HEADS_D; t += blockDim.x) s.y[r0 + t] = head[t];
    }
}

/* The launch of ctas CTAs of HEADS_WARPS warps in clusters of HEADS_CTAS,
 * a programmatic dependent of the kernel before (launch.cuh); attr:
 * LUMA_LAUNCH_ATTRS of them. */
static cudaLaunchConfig_t heads_config(const cuda_backend *c, unsigned ctas, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, ctas, HEADS_WARPS * 32, 0, attr);
    cudaLaunchAttribute &cl = attr[cfg.numAttrs++];
    cl.id = cudaLaunchAttributeClusterDimension;
    cl.val.clusterDim.x = HEADS_CTAS;
    cl.val.clusterDim.y = cl.val.clusterDim.z = 1;
    return cfg;
}

/* Whether two rotations turn by the same angles at the same positions. */
static bool same_rotation(const rope_args &x, const rope_args &y)
{
    if (x.pos_scale != y.pos_scale || x.half != y.half || x.head_dim != y.head_dim || x.heads != y.heads ||
        x.neox != y.neox || x.half < 0 || x.half > ROPE_MAX_HALF)
        return false;
    const size_t n = (size_t)x.half * sizeof(float);
    return memcmp(x.pw, y.pw, n) == 0 && memcmp(x.ff, y.ff, n) == 0;
}

/* The step's table of h's angles (mmv_heads): made by this launch when it
 * is the step's first of its rotation and positions, else read; none
 * (each launch makes its own) past LUMA_ANGLE_SLOTS rotations a step. */
static void heads_angles(cuda_backend *c, mmv_heads_args &h)
{
    h.tab = NULL;
    h.make = true;
    if (!c->in_step || !c->angles || !c->angle_args || h.writer == UINT_MAX) return;
    for (int i = 0; i < c->n_angles; i++)
        if (c->angle_pos[i] == h.pos && same_rotation(c->angle_args[i], h.a)) {
            h.tab = (float4 *)(c->angles + (size_t)i * LUMA_ANGLE_SLOT_FLOATS);
            h.make = false;
            return;
        }
    if (c->n_angles == LUMA_ANGLE_SLOTS) return;
    const int i = c->n_angles++;
    c->angle_args[i] = h.a;
    c->angle_pos[i] = h.pos;
    h.tab = (float4 *)(c->angles + (size_t)i * LUMA_ANGLE_SLOT_FLOATS);
}

/* mmv_heads for the n weights ws of a pending norm request at one row,
 * where it covers them: q's and k's heads of HEADS_D rows with their gains,
 * v's whole heads, no biases, types heads_type, rows of at most 3 rounds.
 * LUMA_CUDA_QKV_HEADS=0 in the environment: never (for measuring; read
 * once). False: nothing launched. */
template <class TA, class TB>
static bool mmv_heads_launch(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int n_a,
                             const act_rows &a)
{
    if constexpr (!heads_type<TA>() || !heads_type<TB>()) {
        (void)c, (void)ws, (void)ys, (void)n, (void)n_a, (void)a;
        return false;
    } else {
        static const bool on = luma_cuda_env_digit("LUMA_CUDA_QKV_HEADS", 1) != 0;
        mmv_rope_request *rq = c->qkv_rope;
        if (!on || !rq || !rq->gq || !rq->gk || rq->rp.head_dim != HEADS_D || n > MMV_SEGS) return false;
        mmv_heads_args h;
        h.pos = rq->rp.pos;
        h.a = rq->rp.a;
        h.eps = rq->eps;
        h.writer = UINT_MAX;
        mmv_segs sg = mmv_segs_none();
        unsigned ctas = 0;
        int done = 0, rounds = 1;
        for (int i = 0; i < n; i++) {
            int o = 0;
            while (o < 3 && ys[i] != rq->y[o]) o++;
            const bool b = i >= n_a;
            const int nb = (int)(ws[i]->cols / (b ? TB::qk : TA::qk)), stride = 32 / (b ? TB::lpb : TA::lpb);
            const int r = (nb + stride - 1) / stride;
            if (o == 3 || rq->b[o] || ws[i]->rows % HEADS_D != 0 || r > 3) return false;
            rounds = r > rounds ? r : rounds;
            if (b && sg.cta_b == UINT_MAX) sg.cta_b = ctas;
            mmv_seg_put(sg, i, b ? mmv_bytes<TB>(ws[i]) : mmv_bytes<TA>(ws[i]), ys[i], ws[i]->rows, nb,
                        (size_t)nb * (size_t)(b ? TB::bytes : TA::bytes), (unsigned)(ws[i]->rows / HEADS_WARPS),
                        &ctas);
            h.g[i] = o == 0 ? rq->gq : o == 1 ? rq->gk : NULL;
            if (h.g[i] && h.writer == UINT_MAX) h.writer = (unsigned)sg.cta0[i];   /* its first CTA */
            done |= 1 << o;
        }
        heads_angles(c, h);
        cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
        const cudaLaunchConfig_t cfg = heads_config(c, ctas, attr);
        auto *kernel = rounds == 1 ? mmv_heads<TA, TB, 1> : rounds == 2 ? mmv_heads<TA, TB, 2> : mmv_heads<TA, TB, 3>;
        if (!luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, kernel, sg, a, h), "matmul (q, k and v by whole heads)")) {
            rq->done |= done;
            c->qkv_heads++;
        }
        return true;
    }
}

/* -- gate and up in clusters that also make the down's input (mmv_gated) ---
 *
 * Between gate and up's launch and the down, the gated quantizer
 * (quantize_act with ACT: act(gate) * up, quantized for the down product)
 * was a launch of its own: 3.4% of Gemma 3 270M's decode step and 6.5% of
 * Qwen2.5 0.5B's when left out (cuda/NOTES.md). At one activation row,
 * where gate and up are one type of heads_type (Gemma 3's and Qwen2's 640
 * to 1,152 columns, at most 3 rounds a row) and the feed-forward is whole
 * super-blocks of 256, a cluster of HEADS_CTAS CTAs of HEADS_WARPS warps
 * makes GATED_E * P consecutive entries: warp w of the cluster makes
 * entries w, w + GATED_E, ... (P of them), each entry's gate row and up row
 * as the direct kernel's warp makes them (mmv_heads_fetch / _sum, every
 * block fetched before the wait), then act(gate) * up as quantize_act makes
 * it; it stores up and act(gate) * up where matmul_many and gated_matmul
 * leave them, and puts act(gate) * up into the first CTA's shared memory.
 * After the cluster's barrier, P warps there quantize a super-block of 256
 * each as quantize_act does (q8_scale and q8_store over the same lanes, so
 * the same shuffles) into the down's activations. The bits of matmul_many
 * then gated_matmul. */
#define GATED_E (HEADS_CTAS * HEADS_WARPS)   /* entries a cluster makes per pair of rows a warp */

struct mmv_gated_args {
    const uint8_t *wg, *wu;    /* gate's and up's repacked blocks */
    size_t row_bytes;
    int nb;                    /* blocks of a row */
    int act;                   /* LUMA_ACT_GELU or LUMA_ACT_SILU */
    bool k;                    /* the down's activations ACT_Q8_K, else ACT_Q8_0 */
    int64_t n;                 /* entries: gate's and up's rows, a multiple of 256 */
    float *gate, *up;
    int8_t *q;                 /* the down's activations: int8 values and blocks' (d, d * sum) */
    float2 *ds;
};

template <class T, int R, int P>
static __global__ void __launch_bounds__(HEADS_WARPS * 32, 1)
mmv_gated(act_rows a, const mmv_gated_args g)
{
    __shared__ __align__(16) float vals[GATED_E * P];
    cg::cluster_group cl = cg::this_cluster();
    cl.barrier_arrive();   /* as in mmv_heads: the first CTA takes writes once started */
    const int w = (int)cl.block_rank() * HEADS_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t e0 = (int64_t)(blockIdx.x / HEADS_CTAS) * (GATED_E * P);
    typename T::raw_t rg[P][R], ru[P][R];
#pragma unroll
    for (int p = 0; p < P; p++)
        if (e0 + w + GATED_E * p < g.n) {
            mmv_heads_fetch<T, R>(g.wg, g.row_bytes, g.nb, e0 + w + GATED_E * p, rg[p]);
            mmv_heads_fetch<T, R>(g.wu, g.row_bytes, g.nb, e0 + w + GATED_E * p, ru[p]);
        }
    wait_for_previous_kernel();
    let_next_kernel_start();
    float v[P];
#pragma unroll
    for (int p = 0; p < P; p++) {
        const int64_t e = e0 + w + GATED_E * p;
        v[p] = 0.0f;
        if (e < g.n) {
            const float gs = mmv_heads_sum<T, R>(g.nb, rg[p], a), us = mmv_heads_sum<T, R>(g.nb, ru[p], a);
            v[p] = g.act == LUMA_ACT_GELU ? act_gated<LUMA_ACT_GELU>(gs, us) : act_gated<LUMA_ACT_SILU>(gs, us);
            if (lane == 0) {
                g.gate[e] = v[p];
                g.up[e] = us;
            }
        }
    }
    cl.barrier_wait();
    if (lane == 0) {
        float *first = cl.map_shared_rank(vals, 0);
#pragma unroll
        for (int p = 0; p < P; p++) first[w + GATED_E * p] = v[p];
    }
    cl.sync();
    const int sb = threadIdx.x / 32;   /* the super-block of 256 this warp quantizes */
    if (cl.block_rank() != 0 || sb >= GATED_E * P / 256 || e0 + 256 * sb >= g.n) return;
    float x[8];
    const float4 *u = (const float4 *)vals + (256 * sb + 8 * lane) / 4, lo = u[0], hi = u[1];
    x[0] = lo.x; x[1] = lo.y; x[2] = lo.z; x[3] = lo.w;
    x[4] = hi.x; x[5] = hi.y; x[6] = hi.z; x[7] = hi.w;
    int iq[8];
    const float d = g.k ? q8_scale<ACT_Q8_K>(x, lane, iq) : q8_scale<ACT_Q8_0>(x, lane, iq);
    q8_store(iq, d, (e0 + 256 * sb) / 8 + lane, true, lane, g.q, g.ds, NULL, 0, 1);
}

/* The most clusters of mmv_gated<T, R, P> the GPU holds at once (0: unknown). */
template <class T, int R, int P>
static int mmv_gated_clusters(cuda_backend *c)
{
    static int most = -1;   /* the same for every backend on one kind of GPU */
    if (most < 0) {
        cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
        const cudaLaunchConfig_t cfg = heads_config(c, HEADS_CTAS, attr);
        int n = 0;
        most = cudaOccupancyMaxActiveClusters(&n, mmv_gated<T, R, P>, &cfg) == cudaSuccess ? n : 0;
        (void)cudaGetLastError();
    }
    return most;
}

/* Whether the clusters of mmv_gated<T, R, P> for n entries fit on the GPU
 * at once; with go, launched (a: gate's and up's activations). */
template <class T, int R, int P>
static bool mmv_gated_go(cuda_backend *c, const act_rows &a, const mmv_gated_args &g, bool go)
{
    const int64_t clusters = (g.n + GATED_E * P - 1) / (GATED_E * P);
    if (clusters > mmv_gated_clusters<T, R, P>(c)) return false;
    if (!go) return true;
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    const cudaLaunchConfig_t cfg = heads_config(c, (unsigned)(clusters * HEADS_CTAS), attr);
    if (!luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, mmv_gated<T, R, P>, a, g), "matmul (gate and up, gated)"))
        c->ffn_gated++;
    return true;
}

/* The fewest pairs a warp (1 or 2) whose clusters fit at once. */
template <class T, int R>
static bool mmv_gated_launch(cuda_backend *c, const act_rows &a, const mmv_gated_args &g, bool go)
{
    return mmv_gated_go<T, R, 1>(c, a, g, go) || mmv_gated_go<T, R, 2>(c, a, g, go);
}

/* Matrices of many short rows take the narrow kernel (mmv_narrow_taken).
 * Otherwise, at one activation row a warp takes a row. Where that makes a launch a
 * little more than the CTAs the GPU holds at once (the 7B's q, k and v
 * where v is Q6_K: 1,536 CTAs where 1,320 fit), the few CTAs left over
 * run alone after the others, as long as a whole wave; a warp then takes
 * two rows, which makes it one wave. A row's sum is the same either way (the same blocks, lanes
 * and order), so the rule cannot change a result. */
template <class TA, class TB, int MAXM>
static void mmv_direct_launch(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int n_a,
                              const act_rows &a, int m)
{
    if constexpr (MAXM == 1) {
        if (mmv_heads_launch<TA, TB>(c, ws, ys, n, n_a, a)) return;
    }
    if constexpr (mmv_narrow_ok<TA, TB>()) {
        if (mmv_narrow_taken<TA, TB>(c, ws, n, n_a)) {
            mmv_narrow_launch<TA, TB, MAXM>(c, ws, ys, n, n_a, a, m);
            return;
        }
    }
    if constexpr (MAXM == 1 && mmv_pairs_ok<TA>() && mmv_pairs_ok<TB>()) {
        const int mode = mmv_pairs_mode();
        if (mode) {
            /* the waves of the rotating variants while a q/k/v request is
             * pending (a launch it does not cover takes the other: then the
             * rule counts with a neighbour's registers, results alike) */
            const bool rope = c->qkv_rope != NULL;
            int64_t ctas = mmv_direct_ctas<1>(ws, n), ctas2 = mmv_direct_ctas<2>(ws, n);
            int64_t wave = rope ? mmv_direct_wave<TA, TB, 1, true>(c) : mmv_direct_wave<TA, TB, 1, false>(c);
            int64_t wave2 = rope ? mmv_direct_wave<TA, TB, 2, true>(c) : mmv_direct_wave<TA, TB, 2, false>(c);
            if (mode == 2 || (wave > 0 && ctas > wave && ctas2 <= wave2)) {
                mmv_direct_launch_rows<TA, TB, 1, 2>(c, ws, ys, n, n_a, a, m);
                return;
            }
        }
    }
    mmv_direct_launch_rows<TA, TB, MAXM, mmv_rows(MAXM)>(c, ws, ys, n, n_a, a, m);
}

/* -- the tensor-core kernel: a few activation rows on mma.sync --------------
 *
 * Q4_K, Q5_K and Q6_K weights by 2 to 32 activation rows (decode of a few
 * sequences; Q6_K's scales per 16 elements take k16 mmas: tc_q6k). The
 * direct kernel's cost grows with m (a __dp4a per four weights and
 * activation row, the float scaling of every block and row); here a
 * warp's 16 weight rows meet 8 activation rows in one mma.sync.m16n8k32
 * per 32-element sub-block, so a step of 8 rows costs about what one row
 * does. Nothing is dequantized: as in the CPU's
 * dot_q4_K, a sub-block's integer sum times its 6-bit scale and the
 * minimums times the activations' integer sums add up in integers over a
 * superblock, which is then scaled once (y->d * (d * sumi - dmin * summ),
 * the CPU's roundings); only the order of the superblocks' float sums
 * differs from the CPU's.
 *
 * Thread (g, t) of a warp (g = lane / 4, t = lane % 4) holds weight rows g
 * and g + 8 of the CTA's 16, bytes 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t
 * + 3 of each 32-byte chunk of their quant bytes: the low nibbles are those
 * positions of sub-block 2 j, the high ones of 2 j + 1, and they are the A
 * fragment's k slots 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3. B's two
 * words are the activation row's bytes at the same positions, read from an
 * interleaved copy the quantizer writes beside the plain one (put_qi), in
 * which a warp's load of 8 rows' words is 512 contiguous bytes (in the
 * plain layout it touched 8 rows' lines: most of the L1's wavefronts). The
 * minimums take a second mma whose A is the rows' 6-bit minimum in every
 * byte: it adds m * (sum of the sub-block's activations) straight into an
 * accumulator. The CTA's W warps split a row's superblocks (warp w: w, w
 * + W, ...; each fetches its next superblock while it multiplies this
 * one) and add their partial sums in shared memory in warp order: W = 8
 * for one group of activation rows, 4 for two or more (mmv_tc_warps).
 * In the file's layout each of a warp's weight loads touches 8 rows (8
 * cache lines for 256 bytes), and the kernel was bound
 * by the L1's wavefronts; the tile copy (tc_k<..., true>) puts what a
 * warp's load takes in 512 contiguous bytes (cuda/NOTES.md). Past 16
 * activation rows a tile takes a CTA for each group of 16 (mmv_tc_groups),
 * the CTAs of a tile side by side, so that the later ones find its weights
 * in L2; a last group of 8 rows or fewer multiplies one n8 tile. */
#define MMV_TC_ROWS 16   /* weight rows of a CTA */

/* Tiles of MMV_TC_ROWS rows that cover rows (the tile copies' and mmv_tc's
 * CTAs a weight). */
static inline int64_t tc_tiles(int64_t rows)
{
    return (rows + MMV_TC_ROWS - 1) / MMV_TC_ROWS;
}

/* The eight 6-bit scales (sc) and minimums (mn) of a superblock from its
 * scale words y, z, w, four to a word (scale_min_k4's values: [0] holds
 * sub-blocks 0..3, [1] 4..7). */
static __device__ __forceinline__ void scale_min_k4_all(uint32_t y, uint32_t z, uint32_t w, uint32_t (&sc)[2],
                                                        uint32_t (&mn)[2])
{
    sc[0] = y & 0x3F3F3F3Fu;
    mn[0] = z & 0x3F3F3F3Fu;
    sc[1] = (w & 0x0F0F0F0Fu) | ((y >> 2) & 0x30303030u);
    mn[1] = ((w >> 4) & 0x0F0F0F0Fu) | ((z >> 2) & 0x30303030u);
}

/* A tile type of mmv_tc gives: raw_t (a thread's share of one superblock of
 * its rows g and g + 8), fetch (that share from the rows' superblock: b0
 * row g's, b1 row g + 8's, the same unit in a tile copy), mul (its products
 * with the activation rows added to acc: acc[i][k] is C fragment k of n8
 * tile i), tiled, bytes (a row's block in the file's layout) and unit (a
 * tile's superblock in the tile copy). Both types take, of each 32-element
 * chunk of a superblock, elements 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t
 * + 3 (the mma's own k order), so that B is read from the activations'
 * interleaved copy (put_qi): xq[i] is n8 tile i's octet at the thread's
 * lane, xq[i][128 ib + 32 j] the chunks 2 j and 2 j + 1 of superblock ib;
 * xd[i][e]: the scales of C's column 2 t + e. */

/* isum += an mma's C fragment c times the scale of its row: sc0 for row g
 * (c[0], c[1]), sc1 for row g + 8 */
static __device__ __forceinline__ void tc_add_scaled(int (&isum)[4], int sc0, int sc1, const int (&c)[4])
{
    isum[0] += sc0 * c[0];
    isum[1] += sc0 * c[1];
    isum[2] += sc1 * c[2];
    isum[3] += sc1 * c[3];
}

/* acc[i][k] += sb(dx, i, k, rr): superblock ib's scaled sum of C fragment
 * k of n8 tile i (weight row rr = k / 2 of the thread's two, activation
 * column 2 t + k % 2, whose superblock scale is dx) */
template <int NT, class F>
static __device__ __forceinline__ void tc_accumulate(float (&acc)[NT][4], const float2 *const (&xd)[NT][2], int ib,
                                                     F sb)
{
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float dx = xd[i][e][(int64_t)ib * 8].x;   /* Q8_K: one d for the superblock */
#pragma unroll
            for (int rr = 0; rr < 2; rr++)
                acc[i][2 * rr + e] = __fadd_rn(acc[i][2 * rr + e], sb(dx, i, 2 * rr + e, rr));
        }
}

/* Q4_K and Q5_K. A thread's share: the headers, and bytes 4 t .. 4 t + 3
 * and 16 + 4 t .. 16 + 4 t + 3 of each 32-byte chunk of quant bytes
 * (q[j].x, .y of row g, .z, .w of row g + 8; Q5_K also its high bits of
 * those positions in h, the same way).
 * Two layouts (cuda_internal.h): the file's (TILED false: two rows, a row
 * pointer each) and the tile copy weight_load makes (TILED: the 16 rows'
 * superblock in one unit of 16 blocks' bytes, each load of a warp 512
 * contiguous bytes). */
template <bool Q5, bool TILED>
struct tc_k {
    struct raw_t {
        int4 hdr[2], q[4], h;
    };
    static constexpr bool tiled = TILED;
    static constexpr int bytes = Q5 ? 176 : 144, qs = Q5 ? 48 : 16;
    static constexpr int unit = 16 * bytes;               /* a tile's superblock (TILED) */
    static constexpr int tile_qs = Q5 ? 768 : 256;        /* its quant bytes' offset */
    static constexpr size_t step = TILED ? unit : bytes;  /* from a superblock to the next */
    static __device__ __forceinline__ void fetch(const uint8_t *b0, const uint8_t *b1, int g, int t, raw_t &r)
    {
        constexpr bool CS = LUMA_CUDA_MMV_CS;
        if constexpr (TILED) {
            const int lane = 4 * g + t;
            r.hdr[0] = ld_w<CS, int4>(b0 + 16 * g);
            r.hdr[1] = ld_w<CS, int4>(b0 + 16 * (g + 8));
            if constexpr (Q5) r.h = ld_w<CS, int4>(b0 + 256 + 16 * lane);
#pragma unroll
            for (int j = 0; j < 4; j++) r.q[j] = ld_w<CS, int4>(b0 + tile_qs + 512 * j + 16 * lane);
        } else {
            r.hdr[0] = ld_w<CS, int4>(b0);
            r.hdr[1] = ld_w<CS, int4>(b1);
            /* the row's 4 bytes at off + 4 t and off + 16 + 4 t */
            auto two = [&](const uint8_t *b, int off) {
                return make_int2(ld_w<CS, int>(b + off + 4 * t), ld_w<CS, int>(b + off + 16 + 4 * t));
            };
            if constexpr (Q5) {
                const int2 h0 = two(b0, 16), h1 = two(b1, 16);
                r.h = make_int4(h0.x, h0.y, h1.x, h1.y);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int2 q0 = two(b0, qs + 32 * j), q1 = two(b1, qs + 32 * j);
                r.q[j] = make_int4(q0.x, q0.y, q1.x, q1.y);
            }
        }
    }
    /* sub-block s's A fragment: positions 4 t .. 4 t + 3 of row g (a[0]) and
     * g + 8 (a[1]), 16 + 4 t .. 16 + 4 t + 3 of each (a[2], a[3]) */
    static __device__ __forceinline__ void values(const raw_t &r, int s, uint32_t (&a)[4])
    {
        const int j = s / 2, sh = 4 * (s % 2);
        const uint32_t w[4] = { (uint32_t)r.q[j].x, (uint32_t)r.q[j].z, (uint32_t)r.q[j].y, (uint32_t)r.q[j].w };
        const uint32_t h[4] = { (uint32_t)r.h.x, (uint32_t)r.h.z, (uint32_t)r.h.y, (uint32_t)r.h.w };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a[i] = (w[i] >> sh) & LOW4;
            if constexpr (Q5) a[i] |= ((h[i] >> s) & 0x01010101u) << 4;
        }
    }
    template <int NT>
    static __device__ __forceinline__ void mul(const raw_t &r, const int4 *const (&xq)[NT],
                                               const float2 *const (&xd)[NT][2], int ib, float (&acc)[NT][4])
    {
        uint32_t sc[2][2], mn[2][2];
#pragma unroll
        for (int k = 0; k < 2; k++)
            scale_min_k4_all((uint32_t)r.hdr[k].y, (uint32_t)r.hdr[k].z, (uint32_t)r.hdr[k].w, sc[k], mn[k]);
        int isum[NT][4] = {}, imin[NT][4] = {};
#pragma unroll
        for (int sb = 0; sb < 8; sb++) {
            uint32_t av[4];
            values(r, sb, av);
            const uint32_t sel = (uint32_t)(sb % 4) * 0x1111u;
            const uint32_t m0 = __byte_perm(mn[0][sb / 4], 0, sel), m1 = __byte_perm(mn[1][sb / 4], 0, sel);
            const uint32_t am[4] = { m0, m1, m0, m1 };
            const int sc0 = (int)((sc[0][sb / 4] >> (8 * (sb % 4))) & 0xFF);
            const int sc1 = (int)((sc[1][sb / 4] >> (8 * (sb % 4))) & 0xFF);
#pragma unroll
            for (int i = 0; i < NT; i++) {
                const int4 x = xq[i][(int64_t)ib * 128 + 32 * (sb / 2)];   /* one load for sb and sb ^ 1 */
                const int2 b = sb % 2 ? make_int2(x.z, x.w) : make_int2(x.x, x.y);
                int c[4] = { 0, 0, 0, 0 };
                mma_s8_k32(c, av, (uint32_t)b.x, (uint32_t)b.y);
                tc_add_scaled(isum[i], sc0, sc1, c);
                mma_s8_k32(imin[i], am, (uint32_t)b.x, (uint32_t)b.y);
            }
        }
        float d[2], dmin[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            d[k] = f16_bits((uint32_t)r.hdr[k].x & 0xffff);
            dmin[k] = f16_bits((uint32_t)r.hdr[k].x >> 16);
        }
        tc_accumulate<NT>(acc, xd, ib, [&](float dx, int i, int k, int rr) {
            return __fmul_rn(dx,
                             __fsub_rn(__fmul_rn(d[rr], (float)isum[i][k]), __fmul_rn(dmin[rr], (float)imin[i][k])));
        });
    }
};

/* Q6_K, on its tile copy only (the file's 210-byte blocks allow 2-byte
 * loads). A superblock's 16 scale groups G (elements 16 G .. 16 G + 15,
 * one int8 scale) take one mma.sync.m16n8k16 each: thread (g, t) holds
 * elements 4 t .. 4 t + 3 of the group in rows g (a0) and g + 8 (a1), and
 * B is the activation row's 4 bytes at 16 G + 4 t (word G % 4 of the
 * interleaved copy's int4 for chunks G / 4 * 2 ..). As in the CPU's
 * dot_q6_K, the groups' integer sums times their scales add up in integers
 * over the superblock, scaled once by y->d * d. The unit of a tile's
 * superblock (16 x LUMA_Q6_K_TC_BYTES, cuda_internal.h):
 *   [0, 256)       row r's 16 scales at 16 r;
 *   [256, 320)     row r's d as f32 (exact) at 256 + 4 r;
 *   [320, 2368)    low nibbles, 4 chunks of 512 bytes;
 *   [2368, 3392)   high bits, 2 chunks of 512 bytes.
 * In chunk j lane 4 g + t finds at 16 lane four words: row g's words 2 j
 * and 2 j + 1, then row g + 8's. A row's nibble word n (0..7) holds in
 * byte b element 4 t + b of group n (low nibble) and of group n + 8 (high
 * nibble), the low 4 bits of its 6-bit value q (the weight is
 * d sc (q - 32)); its high-bit word u (0..3) holds in bits 2 i, 2 i + 1 of
 * byte b the top two bits of element 4 t + b of group u + 4 i. */
struct tc_q6k {
    struct raw_t {
        int4 sc[2], q[4], h[2];
        float d[2];
    };
    static constexpr bool tiled = true;
    static constexpr int bytes = 210;
    static constexpr int unit = 16 * LUMA_Q6_K_TC_BYTES;
    static constexpr size_t step = unit;
    static_assert(unit == 320 + 4 * 512 + 2 * 512, "LUMA_Q6_K_TC_BYTES");
    static __device__ __forceinline__ void fetch(const uint8_t *b0, const uint8_t *, int g, int t, raw_t &r)
    {
        constexpr bool CS = LUMA_CUDA_MMV_CS;
        const int lane = 4 * g + t;
        r.sc[0] = ld_w<CS, int4>(b0 + 16 * g);
        r.sc[1] = ld_w<CS, int4>(b0 + 16 * (g + 8));
        r.d[0] = ld_w<CS, float>(b0 + 256 + 4 * g);
        r.d[1] = ld_w<CS, float>(b0 + 256 + 4 * (g + 8));
#pragma unroll
        for (int j = 0; j < 4; j++) r.q[j] = ld_w<CS, int4>(b0 + 320 + 512 * j + 16 * lane);
#pragma unroll
        for (int j = 0; j < 2; j++) r.h[j] = ld_w<CS, int4>(b0 + 2368 + 512 * j + 16 * lane);
    }
    /* the int8 values q - 32 of group G from nibble word n (G = n or n + 8)
     * and high-bit word h: q + 0x60 stays within its byte, and flipping
     * bit 7 then gives q - 32 */
    static __device__ __forceinline__ uint32_t values(uint32_t n, uint32_t h, int G)
    {
        const uint32_t lo = (n >> (G / 8 * 4)) & LOW4, hi = (h >> (2 * (G / 4))) & 0x03030303u;
        return ((lo | hi << 4) + 0x60606060u) ^ 0x80808080u;
    }
    template <int NT>
    static __device__ __forceinline__ void mul(const raw_t &r, const int4 *const (&xq)[NT],
                                               const float2 *const (&xd)[NT][2], int ib, float (&acc)[NT][4])
    {
        const uint32_t n[2][8] = {
            { (uint32_t)r.q[0].x, (uint32_t)r.q[0].y, (uint32_t)r.q[1].x, (uint32_t)r.q[1].y, (uint32_t)r.q[2].x,
              (uint32_t)r.q[2].y, (uint32_t)r.q[3].x, (uint32_t)r.q[3].y },
            { (uint32_t)r.q[0].z, (uint32_t)r.q[0].w, (uint32_t)r.q[1].z, (uint32_t)r.q[1].w, (uint32_t)r.q[2].z,
              (uint32_t)r.q[2].w, (uint32_t)r.q[3].z, (uint32_t)r.q[3].w }
        };
        const uint32_t h[2][4] = { { (uint32_t)r.h[0].x, (uint32_t)r.h[0].y, (uint32_t)r.h[1].x, (uint32_t)r.h[1].y },
                                   { (uint32_t)r.h[0].z, (uint32_t)r.h[0].w, (uint32_t)r.h[1].z, (uint32_t)r.h[1].w } };
        const uint32_t sw[2][4] = {
            { (uint32_t)r.sc[0].x, (uint32_t)r.sc[0].y, (uint32_t)r.sc[0].z, (uint32_t)r.sc[0].w },
            { (uint32_t)r.sc[1].x, (uint32_t)r.sc[1].y, (uint32_t)r.sc[1].z, (uint32_t)r.sc[1].w }
        };
        int isum[NT][4] = {};
#pragma unroll
        for (int G4 = 0; G4 < 4; G4++) {
            /* one 16-byte load for 4 groups (read as a plain int4 of which
             * each group takes a word, it was compiled into four 4-byte
             * loads: four times the L1 wavefronts) */
            int4 x[NT];
#pragma unroll
            for (int i = 0; i < NT; i++) x[i] = __ldg(&xq[i][(int64_t)ib * 128 + 32 * G4]);
#pragma unroll
            for (int G = 4 * G4; G < 4 * G4 + 4; G++) {
                const uint32_t a0 = values(n[0][G % 8], h[0][G % 4], G), a1 = values(n[1][G % 8], h[1][G % 4], G);
                const int sc0 = (int)(int8_t)(sw[0][G / 4] >> (8 * (G % 4)));
                const int sc1 = (int)(int8_t)(sw[1][G / 4] >> (8 * (G % 4)));
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    const uint32_t b =
                        (uint32_t)(G % 4 == 0 ? x[i].x : G % 4 == 1 ? x[i].y : G % 4 == 2 ? x[i].z : x[i].w);
                    int c[4] = { 0, 0, 0, 0 };
                    mma_s8_k16(c, a0, a1, b);
                    tc_add_scaled(isum[i], sc0, sc1, c);
                }
            }
        }
        tc_accumulate<NT>(acc, xd, ib, [&](float dx, int i, int k, int rr) {
            return __fmul_rn(__fmul_rn(dx, r.d[rr]), (float)isum[i][k]);   /* y->d * d * sumi */
        });
    }
};

/* mmv_tc's CTA of W warps at NT n8 tiles: rows r0 .. r0 + 15 of segment
 * s (tile `tile`), activation rows j0 .. j0 + 8 NT - 1; part holds W x
 * NT * 4 x 32 floats. */
template <class T, int NT, bool ROPE, int W>
static __device__ __forceinline__ void mmv_tc_cta(const mmv_seg &s, int64_t tile, int j0, const act_rows &a, int m,
                                                  const mmv_rope<ROPE> &rp, float (*part)[NT * 4][32])
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t r0 = tile * MMV_TC_ROWS;
    const int nb = s.nb, last = nb - 1;
    /* the rows' first superblocks (row_bytes: a row's, or a tile's for the
     * tile copy) */
    const uint8_t *w0, *w1;
    if constexpr (T::tiled) {
        w0 = w1 = s.w + (size_t)tile * s.row_bytes;
    } else {
        w0 = s.w + (size_t)min(r0 + g, s.rows - 1) * s.row_bytes;
        w1 = s.w + (size_t)min(r0 + g + 8, s.rows - 1) * s.row_bytes;
    }
    /* tile i's activation rows j0 + 8 i ..: B's column g (the interleaved
     * copy's octet j0 / 8 + i), C's columns 2 t and 2 t + 1 (past m: the
     * last row, whose products are dropped) */
    const int4 *xq[NT];
    const float2 *xd[NT][2];
#pragma unroll
    for (int i = 0; i < NT; i++) {
        xq[i] = a.qi + (j0 / 8 + i) * a.qi_octet + lane;
#pragma unroll
        for (int e = 0; e < 2; e++) xd[i][e] = a.ds + (int64_t)min(j0 + 8 * i + 2 * t + e, m - 1) * a.ds_stride;
    }
    typename T::raw_t ra, rb;
    if (warp < nb) T::fetch(w0 + (size_t)warp * T::step, w1 + (size_t)warp * T::step, g, t, ra);
    wait_for_previous_kernel();
    let_next_kernel_start();
    float acc[NT][4] = {};
    /* a round: fetch the warp's next superblock into nxt (past the row's
     * end the last again: no fetch is predicated), multiply cur's */
    auto round = [&](const typename T::raw_t &cur, typename T::raw_t &nxt, int ib) {
        const size_t nx = (size_t)min(ib + W, last) * T::step;
        T::fetch(w0 + nx, w1 + nx, g, t, nxt);
        T::template mul<NT>(cur, xq, xd, ib, acc);
    };
    for (int ib = warp; ib < nb; ib += 2 * W) {
        round(ra, rb, ib);
        if (ib + W >= nb) break;
        round(rb, ra, ib + W);
    }
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int k = 0; k < 4; k++) part[warp][4 * i + k][lane] = acc[i][k];
    __syncthreads();
    /* output (row rr of the tile, activation row j0 + j): the warps'
     * partial sums in warp order */
    auto total = [&](int rr, int j) {
        const int k = 4 * (j / 8) + 2 * (rr / 8) + j % 2, l = 4 * (rr % 8) + (j % 8) / 2;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < W; w++) v += part[w][k][l];
        return v;
    };
    const int u = threadIdx.x;
    const float *bias = mmv_seg_bias(rp, s.seg);
    if constexpr (ROPE) {
        if ((rp.mask >> s.seg) & 1) {
            /* pairs of rows (2 p, 2 p + 1), p < 8, as the direct kernel
             * rotates them (W 32 / 8 >= 8 NT activation rows) */
            static_assert(W * 4 >= 8 * NT, "a thread a pair and activation row");
            const int pr = u % 8, j = u / 8;
            if (j0 + j < m && j < 8 * NT) {
                const int64_t row = r0 + 2 * pr;
                const int32_t e = (int32_t)(row % rp.head_dim);
                const float ang = rope_angle(rp.a, (float)rp.pos[j0 + j], e / 2);
                float y0, y1, v0 = total(2 * pr, j), v1 = total(2 * pr + 1, j);
                if (bias) {
                    v0 = v0 + bias[row];
                    v1 = v1 + bias[row + 1];
                }
                rope_rotate(v0, v1, sinf(ang), cosf(ang), y0, y1);
                s.y[(int64_t)(j0 + j) * s.rows + row] = y0;
                s.y[(int64_t)(j0 + j) * s.rows + row + 1] = y1;
            }
            return;
        }
    }
    const int rr = u % MMV_TC_ROWS;
    for (int j = u / MMV_TC_ROWS; j < 8 * NT; j += W * 32 / MMV_TC_ROWS)
        if (j0 + j < m && r0 + rr < s.rows) {
            const float v = total(rr, j);
            s.y[(int64_t)(j0 + j) * s.rows + r0 + rr] = bias ? v + bias[r0 + rr] : v;
        }
}

/* 24 warps an SM at one n8 tile (80 registers), 16 at two (128): against
 * one CTA an SM with the registers free (126-168), faster at 16 sequences
 * and within a few percent elsewhere (cuda/NOTES.md). At two n8 tiles, the
 * CTAs of a last group of 8 rows or fewer (17 to 24 rows, ...) take one
 * (LUMA_CUDA_MMV_TC_SHORT=0 in the environment: two, for measuring). */
template <class T, int NT, bool ROPE, int W>
static __global__ void __launch_bounds__(W * 32, (NT == 1 ? 24 : 16) / W)
mmv_tc(mmv_segs sg, act_rows a, int m, const mmv_rope<ROPE> rp, bool short_last)
{
    __shared__ float part[W][NT * 4][32];
    const mmv_seg s = mmv_seg_of(sg, blockIdx.x);
    /* the CTA's tile of weight rows and group of activation rows (from j0;
     * mmv_tc_groups of them, the CTAs of a tile side by side) */
    const int groups = mmv_tc_groups(m, NT);
    const int64_t cta = (int64_t)blockIdx.x - s.cta0, tile = cta / groups;
    const int j0 = (int)(cta % groups) * 8 * NT;
    if constexpr (NT == 2) {
        if (short_last && m - j0 <= 8) {
            mmv_tc_cta<T, 1, ROPE, W>(s, tile, j0, a, m, rp, (float(*)[4][32])part);
            return;
        }
    }
    mmv_tc_cta<T, NT, ROPE, W>(s, tile, j0, a, m, rp, part);
}

/* Thread id's place in a tile copy of T (tile type of mmv_tc) of rows of
 * nb superblocks: unit un (a tile's superblock ib), lane 4 g + t of its
 * warp; o the unit in the copy, block(r) row r's superblock ib in the
 * file's blocks (NULL past the weight's end). */
template <class T>
struct tc_repack_at {
    int64_t un, tile, rows, row_bytes;
    int lane, g, t, ib;
    const uint8_t *src;
    uint8_t *o;
    __device__ tc_repack_at(int64_t id, const uint8_t *src_, int64_t rows_, int nb, uint8_t *dst)
        : un(id / 32), tile(un / nb), rows(rows_), row_bytes((int64_t)nb * T::bytes), lane((int)(id % 32)),
          g(lane / 4), t(lane % 4), ib((int)(un % nb)), src(src_), o(dst + un * T::unit)
    {
    }
    __device__ const uint8_t *block(int64_t r) const
    {
        return r < rows ? src + r * row_bytes + (int64_t)ib * T::bytes : NULL;
    }
};

/* The tile copy of a Q4_K or Q5_K weight (weight_load's, cuda_internal.h):
 * thread (unit, lane) writes its 16-byte pieces of a tile's superblock
 * from the file's blocks (rows past the weight's end: zeros). */
template <bool Q5>
static __global__ void repack_tc(const uint8_t *__restrict__ src, int64_t rows, int nb, int64_t units,
                                 uint8_t *__restrict__ dst)
{
    typedef tc_k<Q5, true> T;
    follow_previous_kernel();
    const tc_repack_at<T> at((int64_t)blockIdx.x * blockDim.x + threadIdx.x, src, rows, nb, dst);
    if (at.un >= units) return;
    const int lane = at.lane, t = at.t;
    const int64_t tile = at.tile;
    uint8_t *o = at.o;
    /* the row's 4 bytes at off + 4 t and off + 16 + 4 t (tc_k's positions) */
    auto piece8 = [&](const uint8_t *b, int off) {
        return b ? make_uint2(*(const uint32_t *)(b + off + 4 * t), *(const uint32_t *)(b + off + 16 + 4 * t))
                 : make_uint2(0, 0);
    };
    const uint8_t *b0 = at.block(16 * tile + at.g), *b1 = at.block(16 * tile + at.g + 8);
    if (lane < 16) {
        const uint8_t *bh = at.block(16 * tile + lane);
        *(uint4 *)(o + 16 * lane) = bh ? *(const uint4 *)bh : make_uint4(0, 0, 0, 0);
    }
    if (Q5) {
        const uint2 h0 = piece8(b0, 16), h1 = piece8(b1, 16);
        *(uint4 *)(o + 256 + 16 * lane) = make_uint4(h0.x, h0.y, h1.x, h1.y);
    }
    for (int j = 0; j < 4; j++) {
        const uint2 q0 = piece8(b0, T::qs + 32 * j), q1 = piece8(b1, T::qs + 32 * j);
        *(uint4 *)(o + T::tile_qs + 512 * j + 16 * lane) = make_uint4(q0.x, q0.y, q1.x, q1.y);
    }
}

static bool has_mmv(const cuda_backend *c, const luma_weight *w);
static const uint8_t *q6k_tc(const cuda_backend *c, const luma_weight *w);

/* The most rows mmv_tc takes by its rule (mmv_tc_takes) */
#define MMV_TC_RULE_HI 32

/* LUMA_CUDA_MMV_TC=lo,hi from the environment (read once): the range of
 * rows mmv_tc takes instead of its rule, from 2 up to MMV_TC_MAX_M (for
 * measuring; "9999,0": never). False when it is not set. */
static bool mmv_tc_env(int64_t *lo, int64_t *hi)
{
    static env_rows env;
    if (!env_rows_set(env, "LUMA_CUDA_MMV_TC")) return false;
    *lo = env.lo > 2 ? env.lo : 2;   /* never one row: the quantizer writes the interleaved copy from 2 */
    *hi = env.hi < MMV_TC_MAX_M ? env.hi : MMV_TC_MAX_M;
    return true;
}

/* The most rows mmv_tc takes (the rule's, or the environment's) */
static int64_t mmv_tc_hi(void)
{
    int64_t lo, hi;
    return mmv_tc_env(&lo, &hi) ? hi : MMV_TC_RULE_HI;
}

/* Whether the tensor-core kernel takes w at m activation rows: Q4_K, Q5_K
 * and Q6_K outside batch-invariant mode (its sums are not the direct
 * kernel's) and with 8-bit activations, at 2 to MMV_TC_RULE_HI rows on
 * the tile copy, 3 to MMV_TC_RULE_HI on the file's blocks (Q4_K and Q5_K;
 * Q6_K needs its tile copy). Measured on an H200 (cuda/NOTES.md): on the
 * tile copy it beats the direct kernel from 2 rows and tied it at 1
 * (before the interleaved activations, which the quantizer writes from 2
 * rows only), on the file's blocks from 3; from 17 to 32 rows (two groups)
 * the 7B's aggregate decode beat mmq's and rs_kernel's routes by 7%, at 48
 * and 64 it lost by 20 and 33%. LUMA_CUDA_MMV_TC sets the range instead
 * (mmv_tc_env). */
static bool mmv_tc_takes(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    const bool k45 = w->type == LUMA_Q4_K || w->type == LUMA_Q5_K;
    if (!(k45 || (w->type == LUMA_Q6_K && q6k_tc(c, w))) || c->invariant || c->float_act) return false;
    int64_t lo, hi;
    if (!mmv_tc_env(&lo, &hi)) {
        lo = has_mmv(c, w) ? 2 : 3;
        hi = MMV_TC_RULE_HI;
    }
    return m >= lo && m <= hi && ((uintptr_t)w->dev & 15) == 0;
}

/* mmv_tc_takes for each of n weights */
static bool mmv_tc_takes_all(const cuda_backend *c, const luma_weight *const *ws, int n, int64_t m)
{
    for (int i = 0; i < n; i++)
        if (!mmv_tc_takes(c, ws[i], m)) return false;
    return n > 0;
}

/* The weight bytes mmv_tc<T> reads: the tile copy (T::tiled) or the
 * file's blocks. */
template <class T>
static const uint8_t *tc_weight(const cuda_backend *c, const luma_weight *w)
{
    if (w->type == LUMA_Q6_K) return q6k_tc(c, w);
    return (const uint8_t *)(T::tiled ? w->dev_mmv : w->dev);
}

/* Whether mmv_tc's last group of 8 rows or fewer takes one n8 tile: yes,
 * unless LUMA_CUDA_MMV_TC_SHORT=0 in the environment (read once) */
static bool mmv_tc_short(void)
{
    static int on = -1;
    if (on < 0) on = luma_cuda_env_digit("LUMA_CUDA_MMV_TC_SHORT", 1);
    return on != 0;
}

/* Warps of an mmv_tc CTA at m rows: 4 where a tile takes two groups or
 * more (17 to 32 rows), else 8. Against 8 everywhere (7B, H200): 10-12%
 * more tokens/s at 24 and 32 sequences, but 11% fewer at 16, 2% at 4
 * (cuda/NOTES.md). LUMA_CUDA_MMV_TC_W4=0 in the environment: 8 always,
 * for measuring (read once). */
static int mmv_tc_warps(int m)
{
    static int w4 = -1;
    if (w4 < 0) w4 = luma_cuda_env_digit("LUMA_CUDA_MMV_TC_W4", 1);
    return w4 && mmv_tc_groups(m, mmv_tc_nt(m)) >= 2 ? 4 : 8;
}

/* mmv_tc's launch at NT n8 tiles, CTAs of W warps */
template <class T, int NT, int W>
static void mmv_tc_launch_t(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n,
                            const act_rows &a, int m)
{
    static_assert(W == 8 || W == 4, "CTAs of 8 or 4 warps");
    if (!a.qi) {   /* act_rows_at makes it wherever mmv_tc_takes a product */
        luma_cuda_failf(c, "matmul: no interleaved activations for the tensor-core matrix-vector kernel");
        return;
    }
    mmv_segs sg = mmv_segs_none();
    unsigned ctas = 0;
    for (int i = 0; i < n && i < MMV_SEGS; i++) {
        const int nb = (int)(ws[i]->cols / 256);
        /* a row's bytes, or a tile's in the tile copy */
        mmv_seg_put(sg, i, tc_weight<T>(c, ws[i]), ys[i], ws[i]->rows, nb,
                    (size_t)nb * (T::tiled ? T::unit : T::bytes),
                    (unsigned)(tc_tiles(ws[i]->rows) * mmv_tc_groups(m, NT)), &ctas);
    }
    int done = 0;
    mmv_rope<true> rp;
    const bool rope = mmv_rope_take(c, ws, ys, n, MMV_TC_ROWS, &rp, &done);
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, ctas, W * 32, 0, attr);
    if (rope) {
        if (luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, mmv_tc<T, NT, true, W>, sg, a, m, rp, mmv_tc_short()),
                           "matmul (tensor-core matrix-vector kernel, rotating q and k)"))
            return;
        c->qkv_rope->done |= done;
        return;
    }
    luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, mmv_tc<T, NT, false, W>, sg, a, m, mmv_rope<false>(), mmv_tc_short()),
                   "matmul (tensor-core matrix-vector kernel)");
}

/* mmv_tc_launch_t at mmv_tc_nt's n8 tiles (groups of 16 rows past 16) */
template <class T>
static void mmv_tc_launch_n(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n,
                            const act_rows &a, int m)
{
    if (mmv_tc_nt(m) == 1) mmv_tc_launch_t<T, 1, 8>(c, ws, ys, n, a, m);
    else if (mmv_tc_warps(m) == 4) mmv_tc_launch_t<T, 2, 4>(c, ws, ys, n, a, m);
    else mmv_tc_launch_t<T, 2, 8>(c, ws, ys, n, a, m);
}

/* y_i = W_i x for n <= MMV_SEGS weights of one type and width that
 * mmv_tc_takes, in one launch: Q4_K and Q5_K on their tile copies where
 * all have one, else on the file's blocks; Q6_K on its tile copies. */
static void mmv_tc_launch(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, const act_rows &a,
                          int64_t m)
{
    bool tiled = true;
    for (int i = 0; i < n; i++) tiled = tiled && has_mmv(c, ws[i]);
    switch (ws[0]->type) {
    case LUMA_Q6_K: mmv_tc_launch_n<tc_q6k>(c, ws, ys, n, a, (int)m); break;
    case LUMA_Q5_K:
        if (tiled) mmv_tc_launch_n<tc_k<true, true>>(c, ws, ys, n, a, (int)m);
        else mmv_tc_launch_n<tc_k<true, false>>(c, ws, ys, n, a, (int)m);
        break;
    default:
        if (tiled) mmv_tc_launch_n<tc_k<false, true>>(c, ws, ys, n, a, (int)m);
        else mmv_tc_launch_n<tc_k<false, false>>(c, ws, ys, n, a, (int)m);
    }
}

/* Which kernel a weight takes (cuda/NOTES.md has the measurements): the
 * staged one where the direct one loses, that is Q8_0 in the file's layout
 * (its 34-byte blocks allow only 2-byte loads from device memory) and
 * matrices of few rows (the direct kernel gives them few warps, each with
 * one block in flight); the direct one elsewhere, which measured faster at
 * m = 1 on the other types (at m = 2 to 8 neither wins everywhere),
 * including the repacked copies of Q4_0, Q5_0 and Q8_0. */
/* LUMA_CUDA_MMV=direct or =staged in the environment forces one kernel
 * (for measuring); read once. */
static int mmv_forced(void)
{
    static int forced = -1;
    if (forced < 0) {
        const char *s = getenv("LUMA_CUDA_MMV");
        forced = s && strcmp(s, "direct") == 0 ? 1 : s && strcmp(s, "staged") == 0 ? 2 : 0;
    }
    return forced;
}

template <class T, int MAXM>
static void mmv_launch(cuda_backend *c, const luma_weight *w, const act_rows &a, int m, float *y)
{
    /* The staged kernel only for one row: with several it was measured to
     * give results that depend on m (a row shared by several warps), which
     * breaks batched = sequential. */
    int forced = mmv_forced();
    bool staged = forced ? forced == 2
                         : MAXM == 1 && (std::is_same<T, type_q8_0>::value || w->rows <= MMV_STAGED_MAX_ROWS);
    /* the staged kernel takes 8-bit activations; the repacked Q6_K on the
     * direct one measured faster than the file's on the staged one, at 1024
     * rows too (cuda/NOTES.md) */
    if (std::is_same<T, type_q6_K_mmv>::value || std::is_base_of<kf_float, T>::value) staged = false;
    /* a row sums as the direct kernel sums it, not the narrow one */
    if (staged && !forced && mmv_narrow_taken<T, T>(c, &w, 1, 1)) staged = false;
    if (staged) mmv_staged_launch<T, MAXM>(c, w, a, m, y);
    else mmv_direct_launch<T, T, MAXM>(c, &w, &y, 1, 1, a, m);
}

/* The activation rows from row j0 on. */
static act_rows act_rows_from(const act_rows &a, int64_t j0)
{
    act_rows aj = a;
    aj.f += j0 * a.f_stride;
    if (a.q) {
        aj.q += j0 * a.q_stride;
        aj.ds += j0 * a.ds_stride;
    }
    return aj;
}

/* A pending q/k/v rotation (luma_cuda_matmul_qkv_rope) held back while
 * the direct kernel runs more than one pass (batch invariance, or
 * LUMA_CUDA_MMV_MAX_M): its launches rotate one pass's rows only, so then
 * none rotates and the caller rotates the outputs afterwards. */
struct rope_hold {
    cuda_backend *c;
    mmv_rope_request *rq;
    rope_hold(cuda_backend *c_, int64_t m) : c(c_), rq(m > MMV_PASS_M ? c_->qkv_rope : NULL)
    {
        if (rq) c->qkv_rope = NULL;
    }
    ~rope_hold()
    {
        if (rq) c->qkv_rope = rq;
    }
};

/* Passes of up to MMV_PASS_M activation rows, each on the kernel sized for it. */
template <class T>
static void mmv_run(cuda_backend *c, const luma_weight *w, const act_rows &a, int64_t m, float *y)
{
    const rope_hold hold(c, m);
    for (int64_t j0 = 0; j0 < m && LUMA_CUDA_OK(c); j0 += MMV_PASS_M) {
        int n = (int)(m - j0 < MMV_PASS_M ? m - j0 : MMV_PASS_M);
        act_rows aj = act_rows_from(a, j0);
        float *yj = y + j0 * w->rows;
        if (n == 1) mmv_launch<T, 1>(c, w, aj, n, yj);
        else if (n == 2) mmv_launch<T, 2>(c, w, aj, n, yj);
        else if (n <= 4) mmv_launch<T, 4>(c, w, aj, n, yj);
        else mmv_launch<T, 8>(c, w, aj, n, yj);
    }
}

/* mmv_run for n <= MMV_SEGS weights of one type and width by the same
 * activations: one direct launch per pass for all of them. A row's sum is
 * the same in any launch, and the staged kernel (which mmv_run takes for
 * one row of a small matrix) sums a row as the direct one does. */
template <class TA, class TB = TA>
static void mmv_run_many(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, const act_rows &a,
                         int64_t m, int n_a = MMV_SEGS)
{
    const rope_hold hold(c, m);
    for (int64_t j0 = 0; j0 < m && LUMA_CUDA_OK(c); j0 += MMV_PASS_M) {
        int nj = (int)(m - j0 < MMV_PASS_M ? m - j0 : MMV_PASS_M);
        act_rows aj = act_rows_from(a, j0);
        float *yj[MMV_SEGS];
        for (int i = 0; i < n && i < MMV_SEGS; i++) yj[i] = ys[i] + j0 * ws[i]->rows;
        if (nj == 1) mmv_direct_launch<TA, TB, 1>(c, ws, yj, n, n_a, aj, nj);
        else if (nj == 2) mmv_direct_launch<TA, TB, 2>(c, ws, yj, n, n_a, aj, nj);
        else if (nj <= 4) mmv_direct_launch<TA, TB, 4>(c, ws, yj, n, n_a, aj, nj);
        else mmv_direct_launch<TA, TB, 8>(c, ws, yj, n, n_a, aj, nj);
    }
}

/* Float activations (c->float_act): a warp per weight row, its lanes over
 * units of 8 elements (T::deq8: the CPU's dequantized values, operation by
 * operation), each unit's 8 products added to the lane's sum for each
 * activation row by fused multiply-adds in a fixed order, then the warp's
 * sum. A row's result depends neither on m nor on the other rows. */
#define MMV_FLOAT_WARPS 4
/* Above this m, float activations take cuBLAS on the resident f16 copy:
 * at m = 8 the kf kernels took 72.5 us on Q4_K 14336 x 4096 (their f32
 * multiply-adds and activation loads grow with m) against about 47 for
 * cuBLAS, at m = 4 40.6 against about 47 (cuda/NOTES.md). */
#define MMV_FLOAT_MAX_M 4

template <class T>
static __global__ void __launch_bounds__(MMV_FLOAT_WARPS * 32)
mmv_float(const uint8_t *__restrict__ w, size_t row_bytes, int64_t rows, int64_t cols,
          const float *__restrict__ x, int m, float *__restrict__ y)
{
    follow_previous_kernel();
    int lane = threadIdx.x & 31;
    int64_t r = (int64_t)blockIdx.x * MMV_FLOAT_WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const uint8_t *wr = w + (size_t)r * row_bytes;
    float acc[MMV_PASS_M];
#pragma unroll
    for (int j = 0; j < MMV_PASS_M; j++) acc[j] = 0.0f;
    for (int64_t e = 8 * (int64_t)lane; e < cols; e += 8 * 32) {
        float v[8];
        T::deq8(wr + (size_t)(e / T::qk) * T::bytes, (int)(e % T::qk), v);
#pragma unroll
        for (int j = 0; j < MMV_PASS_M; j++) {
            if (j >= m) break;
            const float4 *xp = (const float4 *)(x + (size_t)j * (size_t)cols + e);
            float4 a = xp[0], b = xp[1];
            float s = acc[j];
            s = __fmaf_rn(v[0], a.x, s);
            s = __fmaf_rn(v[1], a.y, s);
            s = __fmaf_rn(v[2], a.z, s);
            s = __fmaf_rn(v[3], a.w, s);
            s = __fmaf_rn(v[4], b.x, s);
            s = __fmaf_rn(v[5], b.y, s);
            s = __fmaf_rn(v[6], b.z, s);
            s = __fmaf_rn(v[7], b.w, s);
            acc[j] = s;
        }
    }
#pragma unroll
    for (int j = 0; j < MMV_PASS_M; j++) {
        if (j >= m) break;
        float s = warp_sum(acc[j]);
        if (lane == 0) y[(size_t)j * (size_t)rows + r] = s;
    }
}

template <class T>
static void mmv_float_run(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    size_t rb = luma_row_size(w->type, w->cols);
    unsigned ctas = (unsigned)((w->rows + MMV_FLOAT_WARPS - 1) / MMV_FLOAT_WARPS);
    for (int64_t j0 = 0; j0 < m && LUMA_CUDA_OK(c); j0 += MMV_PASS_M) {
        int n = (int)(m - j0 < MMV_PASS_M ? m - j0 : MMV_PASS_M);
        luma_cuda_fail(c,
                       luma_launch(c, c->stream, ctas, MMV_FLOAT_WARPS * 32, 0, mmv_float<T>, (const uint8_t *)w->dev,
                                   rb, w->rows, w->cols, x + j0 * w->cols, n, y + j0 * w->rows),
                       "matmul (float activations)");
    }
}

/* xo = x (n floats, n a multiple of 256) in the kf types' order: float4 q
 * of lane part p of a block at float4 8 q + p; q < 4 from sub-block
 * 2 (p / 2), q >= 4 from the next, positions 16 (p % 2) + 4 (q % 4). */
static __global__ void kf_order(const float *__restrict__ x, int64_t n4, float *__restrict__ xo)
{
    follow_previous_kernel();
    int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n4) return;
    int within = (int)(o % 64), q = within / 8, p = within % 8;
    int64_t src = (o / 64) * 256 + 32 * (2 * (p / 2) + q / 4) + 16 * (p % 2) + 4 * (q % 4);
    ((float4 *)xo)[o] = *(const float4 *)(x + src);
}

/* Whether the kernels may read w's repacked copy: it has one, and the
 * backend has not dropped the copies since (dev_malloc in backend.cu). */
static bool has_mmv(const cuda_backend *c, const luma_weight *w)
{
    return c->mmv_on && w->dev_mmv != NULL;
}

/* Whether mm_float takes a kf type for w (which reads x through
 * kf_order). */
static bool kfloat_takes(const cuda_backend *c, const luma_weight *w)
{
    if (mmv_forced() || w->cols % 256 != 0) return false;
    if (w->type == LUMA_Q6_K) return has_mmv(c, w);
    return (w->type == LUMA_Q4_K || w->type == LUMA_Q5_K) && ((uintptr_t)w->dev & 15) == 0;
}

static unsigned blocks_for(int64_t n, int threads);

/* xo = x (m rows of cols) in kf_order's order (m x cols floats). */
static void kf_order_into(cuda_backend *c, const float *x, int64_t m, int64_t cols, float *xo)
{
    int64_t n4 = m * cols / 4;
    luma_cuda_fail(c, luma_launch(c, c->stream, blocks_for(n4, 256), 256, 0, kf_order, x, n4, xo),
                   "matmul (float activations, reordered)");
}

/* y = W x for a weight kfloat_takes, xo its activations through kf_order,
 * on the direct kernel. */
static void mm_kfloat(cuda_backend *c, const luma_weight *w, const float *xo, int64_t m, float *y)
{
    act_rows a = { NULL, NULL, xo, 0, 0, w->cols };
    if (w->type == LUMA_Q4_K) mmv_run<kf_q4_K>(c, w, a, m, y);
    else if (w->type == LUMA_Q5_K) mmv_run<kf_q5_K>(c, w, a, m, y);
    else mmv_run<kf_q6_K>(c, w, a, m, y);
}

/* The matrix-vector path with float activations, for the block formats:
 * the kf types where they read the weight (16-byte aligned rows, or the
 * repacked Q6_K copy), the kf_x4 types on the repacked Q4_0, Q5_0 and Q8_0
 * copies, mmv_float's element-wise kernel elsewhere. */
static void mm_float(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    if (kfloat_takes(c, w)) {
        float *xo = (float *)luma_cuda_scratch(c, (size_t)m * (size_t)w->cols * sizeof(float));
        if (xo) kf_order_into(c, x, m, w->cols, xo);
        if (xo && LUMA_CUDA_OK(c)) mm_kfloat(c, w, xo, m, y);
        return;
    }
    if (has_mmv(c, w) && (w->type == LUMA_Q4_0 || w->type == LUMA_Q5_0 || w->type == LUMA_Q8_0)) {
        /* the repacked Q4_0, Q5_0 and Q8_0: x as it is */
        act_rows a = { NULL, NULL, x, 0, 0, w->cols };
        if (w->type == LUMA_Q4_0) mmv_run<kf_q4_0>(c, w, a, m, y);
        else if (w->type == LUMA_Q5_0) mmv_run<kf_q5_0>(c, w, a, m, y);
        else mmv_run<kf_q8_0>(c, w, a, m, y);
        return;
    }
    switch (w->type) {
    case LUMA_Q4_0: mmv_float_run<type_q4_0>(c, w, x, m, y); break;
    case LUMA_Q4_1: mmv_float_run<type_q4_1>(c, w, x, m, y); break;
    case LUMA_Q5_0: mmv_float_run<type_q5_0>(c, w, x, m, y); break;
    case LUMA_Q5_1: mmv_float_run<type_q5_1>(c, w, x, m, y); break;
    case LUMA_Q8_0: mmv_float_run<type_q8_0>(c, w, x, m, y); break;
    case LUMA_Q2_K: mmv_float_run<type_q2_K>(c, w, x, m, y); break;
    case LUMA_Q3_K: mmv_float_run<type_q3_K>(c, w, x, m, y); break;
    case LUMA_Q4_K: mmv_float_run<type_q4_K>(c, w, x, m, y); break;
    case LUMA_Q5_K: mmv_float_run<type_q5_K>(c, w, x, m, y); break;
    case LUMA_Q6_K: mmv_float_run<type_q6_K>(c, w, x, m, y); break;
    default: luma_cuda_failf(c, "matmul: tensor type %s is not supported by the CUDA backend", luma_type_name(w->type));
    }
}

static size_t align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

static bool is_float_type(enum luma_type t)
{
    return t == LUMA_F32 || t == LUMA_F16 || t == LUMA_BF16;
}

/* Whether the matrix-vector kernels can read this weight and these
 * activations: float weights need whole 16-byte loads, and the staged
 * kernel's bulk copies a 16-byte aligned weight. */
static bool mmv_fits(const luma_weight *w, const float *x)
{
    if (!is_float_type(w->type)) return ((uintptr_t)w->dev & 15) == 0;
    int64_t per16 = w->type == LUMA_F32 ? 4 : 8;
    return w->cols % per16 == 0 && ((uintptr_t)w->dev & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

/* Rows of the interleaved copy mmv_tc reads (act_rows.qi): tc_qi_rows
 * where mmv_tc may take the product, else none. */
static int64_t tc_act_rows(int64_t m, int64_t cols)
{
    return m >= 2 && m <= mmv_tc_hi() && cols % 256 == 0 ? tc_qi_rows((int)m) : 0;
}

/* Bytes of the quantized activations of m rows of cols (int8 values, then
 * a (d, sum) per block of 32, then the interleaved copy of tc_act_rows). */
static size_t act_q_bytes(int64_t m, int64_t cols)
{
    return align256((size_t)m * (size_t)cols) + align256((size_t)(m * (cols / 32)) * sizeof(float2)) +
           align256((size_t)tc_act_rows(m, cols) * (size_t)cols);
}

/* The activation rows the matrix-vector kernels read: x itself for float
 * weights, else x quantized for w's type into s (act_q_bytes). */
static act_rows act_rows_at(const luma_weight *w, const float *x, int64_t m, uint8_t *s)
{
    act_rows a = { NULL, NULL, x, w->cols / 4, w->cols / 32, w->cols, NULL, 0 };
    if (s) {
        const size_t ds = align256((size_t)m * (size_t)w->cols);
        a.q = (const int *)s;
        a.ds = (const float2 *)(s + ds);
        if (tc_act_rows(m, w->cols) > 0 && luma_type_get(w->type)->act_type == LUMA_Q8_K) {
            a.qi = (const int4 *)(s + ds + align256((size_t)(m * (w->cols / 32)) * sizeof(float2)));
            a.qi_octet = w->cols / 256 * 128;
        }
    }
    return a;
}

/* The widest row of one activation row whose joined norm lets the product
 * after it be placed before its wait: measured on the synths (cuda/NOTES.md,
 * "The residual norms placed early at one row"), 640 to 1,152 columns gain
 * 4.7 to 7.7%, 2,048 to 4,096 lose 1 to 2%. */
#define NORM_EARLY_COLS 1536

/* Whether norm_quantize quantizes a row of at most NORM_THREADS float4s
 * from its registers (quantize_regs); LUMA_CUDA_NORMQ_REGS=0 in the
 * environment: from the stored row, in units of 8 (read once, for
 * measuring). */
static bool normq_regs_on(void)
{
    static const bool on = luma_cuda_env_digit("LUMA_CUDA_NORMQ_REGS", 1) != 0;
    return on;
}

/* The pending norm (cuda_backend.pend_norm) and the quantization of its
 * out for w into a, as one launch (norm_quantize), where x is that out;
 * false, launching nothing, otherwise. */
static bool norm_quant_into(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, const act_rows &a)
{
    const bool k = luma_type_get(w->type)->act_type == LUMA_Q8_K;
    const int f = norm_regs_f(w->cols);
    if (!c->pend_norm.on || c->pend_norm.out.data != x || c->pend_norm.x.rows != m || c->pend_norm.x.cols != w->cols ||
        w->cols % (k ? 256 : 32) != 0 || f == 0 || m > INT_MAX)
        return false;
    c->pend_norm.on = false;
    float *nx = c->pend_norm.x.data, *out = c->pend_norm.out.data;
    const float *ny = c->pend_norm.y.data, *yg = c->pend_norm.yg ? (const float *)c->pend_norm.yg->dev : NULL,
                *g = (const float *)c->pend_norm.g->dev;
    const float eps = c->pend_norm.eps;
    int8_t *q = (int8_t *)a.q;
    float2 *ds = (float2 *)a.ds;
    uint32_t *qi = (uint32_t *)a.qi;
    /* as the norm, not as the quantizer: the kernel before it is a product
     * or the attention, whose later CTAs the next product's, placed early
     * and waiting, would keep off the SMs (the 7B, 1.5-2% slower early);
     * at one row of at most NORM_EARLY_COLS the launches about it are a few
     * SMs' (a small model's) and early placing gains (cuda/NOTES.md) */
    const bool early = c->early >= 2 || (c->early == 1 && m == 1 && w->cols <= NORM_EARLY_COLS);
    const unsigned grid = (unsigned)m;
#define NQ_LAUNCH(F, S)                                                                                            \
    luma_launch(c, c->stream, grid, NORM_THREADS, 0, norm_quantize<F, S>, nx, ny, yg, g, w->cols, eps, out, early, q, \
                ds, qi, (int)m, normq_regs_on())
    switch (f * 2 + k) {
    case 2: NQ_LAUNCH(1, ACT_Q8_0); break;
    case 3: NQ_LAUNCH(1, ACT_Q8_K); break;
    case 4: NQ_LAUNCH(2, ACT_Q8_0); break;
    case 5: NQ_LAUNCH(2, ACT_Q8_K); break;
    case 8: NQ_LAUNCH(4, ACT_Q8_0); break;
    case 9: NQ_LAUNCH(4, ACT_Q8_K); break;
    case 16: NQ_LAUNCH(8, ACT_Q8_0); break;
    default: NQ_LAUNCH(8, ACT_Q8_K); break;
    }
#undef NQ_LAUNCH
    c->norm_quants++;
    luma_cuda_fail(c, cudaGetLastError(), "add_rmsnorm with the activations' quantization");
    return true;
}

/* The pending attention (cuda_backend.pend_attn), launched: where x is its
 * out, with its output quantized for w into a where its kernel can (true),
 * else alone (false: the caller quantizes). False, launching nothing,
 * where x is not its out. */
static bool attn_quant_into(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, const act_rows &a)
{
    if (!c->pend_attn.on || c->pend_attn.out.data != x) return false;
    c->pend_attn.on = false;
    const bool k = luma_type_get(w->type)->act_type == LUMA_Q8_K;
    const cuda_attn_quant aq = { (int8_t *)a.q, (float2 *)a.ds, k ? ACT_Q8_K : ACT_Q8_0 };
    /* one row of whole blocks, with no interleaved copy to make */
    const bool fits = m == 1 && !a.qi && c->pend_attn.out.cols == w->cols && w->cols % (k ? 256 : 32) == 0;
    const bool done = luma_cuda_attention_quant(c, &c->pend_attn.q, &c->pend_attn.k, &c->pend_attn.v,
                                                c->pend_attn.step, &c->pend_attn.at, &c->pend_attn.out,
                                                fits ? &aq : NULL);
    if (done) c->attn_quants++;
    return done;
}

static void quantize_into(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, uint8_t *s)
{
    act_rows a = act_rows_at(w, x, m, s);
    if (attn_quant_into(c, w, x, m, a)) return;
    if (norm_quant_into(c, w, x, m, a)) return;
    luma_cuda_pending_flush(c);
    quantize_launch<-1>(c, w->type, NULL, x, NULL, m * w->cols, (int8_t *)a.q, (float2 *)a.ds, NULL, (uint32_t *)a.qi,
                        w->cols, (int)m);
}

static void mm_vec_run(cuda_backend *c, const luma_weight *w, const act_rows &a, int64_t m, float *y);

/* How many of the n weights have a repacked copy the kernels may read. */
static int n_repacked(const cuda_backend *c, const luma_weight *const *ws, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) k += has_mmv(c, ws[i]);
    return k;
}

/* mmv_run on w's repacked copy (block type R) where the kernels may read
 * one, on the file's blocks (F) elsewhere. */
template <class R, class F>
static void mmv_run_either(cuda_backend *c, const luma_weight *w, const act_rows &a, int64_t m, float *y)
{
    if (has_mmv(c, w)) mmv_run<R>(c, w, a, m, y);
    else mmv_run<F>(c, w, a, m, y);
}

/* mmv_run_many on the repacked copies (R) when all n weights have one (rp
 * of them do), on the file's blocks (F) when none has; false, queuing
 * nothing, for a mix. */
template <class R, class F>
static bool mmv_run_many_either(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n,
                                const act_rows &a, int64_t m, int rp)
{
    if (rp == n) mmv_run_many<R>(c, ws, ys, n, a, m);
    else if (rp == 0) mmv_run_many<F>(c, ws, ys, n, a, m);
    else return false;
    return true;
}

/* One launch per pass for n weights of one block type and width (the
 * direct kernel); false, queuing nothing, for a type that keeps its own
 * kernel choice (Q8_0 without its repacked copy, whose 34-byte blocks the
 * direct kernel reads 2 bytes at a time) or when a kernel is forced
 * (LUMA_CUDA_MMV). */
static bool mm_vec_run_many(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n,
                            const act_rows &a, int64_t m)
{
    if (n <= MMV_SEGS && mmv_tc_takes_all(c, ws, n, m)) {
        mmv_tc_launch(c, ws, ys, n, a, m);
        return true;
    }
    if (mmv_forced()) return false;
    int rp = n_repacked(c, ws, n);
    switch (ws[0]->type) {
    case LUMA_Q4_0: return mmv_run_many_either<type_q4_0_mmv, type_q4_0>(c, ws, ys, n, a, m, rp);
    case LUMA_Q4_1: mmv_run_many<type_q4_1>(c, ws, ys, n, a, m); return true;
    case LUMA_Q5_0: return mmv_run_many_either<type_q5_0_mmv, type_q5_0>(c, ws, ys, n, a, m, rp);
    case LUMA_Q5_1: mmv_run_many<type_q5_1>(c, ws, ys, n, a, m); return true;
    case LUMA_Q2_K: mmv_run_many<type_q2_K>(c, ws, ys, n, a, m); return true;
    case LUMA_Q3_K: mmv_run_many<type_q3_K>(c, ws, ys, n, a, m); return true;
    case LUMA_Q4_K: mmv_run_many<type_q4_K>(c, ws, ys, n, a, m); return true;
    case LUMA_Q5_K: mmv_run_many<type_q5_K>(c, ws, ys, n, a, m); return true;
    case LUMA_Q6_K:
        if (rp == n) mmv_run_many<type_q6_K_mmv>(c, ws, ys, n, a, m);
        else mmv_run_many<type_q6_K>(c, ws, ys, n, a, m);
        return true;
    case LUMA_Q8_0:
        if (rp != n) return false;
        mmv_run_many<type_q8_0_mmv>(c, ws, ys, n, a, m);
        return true;
    default: return false;
    }
}

static void mm_vec(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    uint8_t *s = NULL;
    if (!is_float_type(w->type)) {
        s = (uint8_t *)luma_cuda_scratch(c, act_q_bytes(m, w->cols));
        if (!s) return;
        quantize_into(c, w, x, m, s);
        if (!LUMA_CUDA_OK(c)) return;
    }
    mm_vec_run(c, w, act_rows_at(w, x, m, s), m, y);
}

/* One launch per pass for weights of two block types that share an
 * activation format: ws[0 .. n_a) of one type, ws[n_a .. n) of another
 * (a Q4_K_M model's q and k with its Q6_K v; Q5_0 q and k with a Q8_0 v).
 * Each row gets the bits its own type's launch gives it. false, queuing
 * nothing, for a pair without a kernel or when a kernel is forced. */
static bool mm_vec_run_pair(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int n, int n_a,
                            const act_rows &a, int64_t m)
{
    /* the tensor-core kernel takes ws[0 .. n_a) alone */
    if (mmv_forced() || n > MMV_SEGS || mmv_tc_takes(c, ws[0], m)) return false;
    enum luma_type ta = ws[0]->type, tb = ws[n_a]->type;
    if (ta == LUMA_Q4_K && tb == LUMA_Q6_K && n_repacked(c, ws + n_a, n - n_a) == n - n_a)
        mmv_run_many<type_q4_K, type_q6_K_mmv>(c, ws, ys, n, a, m, n_a);
    else if (ta == LUMA_Q5_K && tb == LUMA_Q6_K && n_repacked(c, ws + n_a, n - n_a) == n - n_a)
        mmv_run_many<type_q5_K, type_q6_K_mmv>(c, ws, ys, n, a, m, n_a);
    else if (ta == LUMA_Q5_0 && tb == LUMA_Q8_0 && n_repacked(c, ws, n) == n)
        mmv_run_many<type_q5_0_mmv, type_q8_0_mmv>(c, ws, ys, n, a, m, n_a);
    else if (ta == LUMA_Q5_0 && tb == LUMA_Q8_0 && n_repacked(c, ws, n) == 0)
        mmv_run_many<type_q5_0, type_q8_0>(c, ws, ys, n, a, m, n_a);
    else
        return false;
    return true;
}

static void mm_vec_run(cuda_backend *c, const luma_weight *w, const act_rows &a, int64_t m, float *y)
{
    if (mmv_tc_takes(c, w, m)) {
        mmv_tc_launch(c, &w, &y, 1, a, m);
        return;
    }
    switch (w->type) {
    case LUMA_F32: mmv_run<type_f32>(c, w, a, m, y); break;
    case LUMA_F16: mmv_run<type_f16>(c, w, a, m, y); break;
    case LUMA_BF16: mmv_run<type_bf16>(c, w, a, m, y); break;
    case LUMA_Q4_0: mmv_run_either<type_q4_0_mmv, type_q4_0>(c, w, a, m, y); break;
    case LUMA_Q4_1: mmv_run<type_q4_1>(c, w, a, m, y); break;
    case LUMA_Q5_0: mmv_run_either<type_q5_0_mmv, type_q5_0>(c, w, a, m, y); break;
    case LUMA_Q5_1: mmv_run<type_q5_1>(c, w, a, m, y); break;
    case LUMA_Q8_0: mmv_run_either<type_q8_0_mmv, type_q8_0>(c, w, a, m, y); break;
    case LUMA_Q2_K: mmv_run<type_q2_K>(c, w, a, m, y); break;
    case LUMA_Q3_K: mmv_run<type_q3_K>(c, w, a, m, y); break;
    case LUMA_Q4_K: mmv_run<type_q4_K>(c, w, a, m, y); break;
    case LUMA_Q5_K: mmv_run<type_q5_K>(c, w, a, m, y); break;
    case LUMA_Q6_K: mmv_run_either<type_q6_K_mmv, type_q6_K>(c, w, a, m, y); break;
    default: luma_cuda_failf(c, "matmul: tensor type %s is not supported by the CUDA backend", luma_type_name(w->type));
    }
}

/* ---- tensor-core path ---------------------------------------------------------- */

/* Rows [0, rows) of a block-format weight to f16, 8 elements per thread:
 * out is rows x cols, row-major. */
template <class T>
static __global__ void dequant_f16(const uint8_t *__restrict__ w, size_t row_bytes, int64_t cols, int64_t units,
                                   __half *__restrict__ out)
{
    follow_previous_kernel();
    int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units) return;
    int64_t per_row = cols / 8, r = u / per_row, e = u % per_row * 8;
    float v[8];
    T::deq8(w + (size_t)r * row_bytes + (size_t)(e / T::qk) * T::bytes, (int)(e % T::qk), v);
    __half2 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *(uint4 *)(out + r * cols + e) = *(const uint4 *)h;
}

/* F32 or BF16 elements (n of them) to f16. */
template <enum luma_type TYPE>
static __global__ void float_to_f16(const void *__restrict__ src, int64_t n, __half *__restrict__ out)
{
    follow_previous_kernel();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float f = TYPE == LUMA_F32 ? ((const float *)src)[i] : bf16_bits(((const uint16_t *)src)[i]);
    out[i] = __float2half_rn(f);
}

static unsigned blocks_for(int64_t n, int threads)
{
    return (unsigned)((n + threads - 1) / threads);
}

template <class T>
static void dequant_launch(cuda_backend *c, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t cols,
                           __half *out)
{
    int64_t units = rows * (cols / 8);
    luma_launch(c, c->stream, blocks_for(units, DEQ_THREADS), DEQ_THREADS, 0, dequant_f16<T>, w, row_bytes, cols, units,
                out);
}

/* Rows [r0, r0 + n) of w as f16 into out (n x cols). */
static void dequant_rows(cuda_backend *c, const luma_weight *w, int64_t r0, int64_t n, __half *out)
{
    size_t row_bytes = luma_row_size(w->type, w->cols);
    const uint8_t *src = (const uint8_t *)w->dev + (size_t)r0 * row_bytes;
    int64_t cols = w->cols, elems = n * cols;
    switch (w->type) {
    case LUMA_F32:
        luma_launch(c, c->stream, blocks_for(elems, DEQ_THREADS), DEQ_THREADS, 0, float_to_f16<LUMA_F32>, src, elems,
                    out);
        break;
    case LUMA_BF16:
        luma_launch(c, c->stream, blocks_for(elems, DEQ_THREADS), DEQ_THREADS, 0, float_to_f16<LUMA_BF16>, src, elems,
                    out);
        break;
    case LUMA_Q4_0: dequant_launch<type_q4_0>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q4_1: dequant_launch<type_q4_1>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q5_0: dequant_launch<type_q5_0>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q5_1: dequant_launch<type_q5_1>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q8_0: dequant_launch<type_q8_0>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q2_K: dequant_launch<type_q2_K>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q3_K: dequant_launch<type_q3_K>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q4_K: dequant_launch<type_q4_K>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q5_K: dequant_launch<type_q5_K>(c, src, row_bytes, n, cols, out); break;
    case LUMA_Q6_K: dequant_launch<type_q6_K>(c, src, row_bytes, n, cols, out); break;
    default: luma_cuda_failf(c, "matmul: tensor type %s is not supported by the CUDA backend", luma_type_name(w->type));
             return;
    }
    luma_cuda_fail(c, cudaGetLastError(), "matmul (dequantize to f16)");
}

static const char *cublas_status_name(cublasStatus_t st)
{
    switch (st) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
    }
}

void luma_cuda_weight_to_f16(cuda_backend *c, const luma_weight *w, __half *out)
{
    dequant_rows(c, w, 0, w->rows, out);
}

/* The repacking of a GGUF Q6_K block b (ql[128], qh[64], scales[16], d):
 * the 6-bit value (0..63) of element 32 s + l (e = 128 c + 32 k + l), and d
 * as f32 (exact). */
static __device__ __forceinline__ int q6k_q(const uint8_t *b, int s, int l)
{
    int c = s / 4, k = s % 4;
    return ((b[64 * c + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF) | ((b[128 + 32 * c + l] >> (2 * k)) & 3) << 4;
}

static __device__ __forceinline__ float q6k_d(const uint8_t *b)
{
    return __half2float(__ushort_as_half((unsigned short)(b[208] | b[209] << 8)));
}

/* A repacked block made in registers (out) to dst, 16 bytes at a time. */
template <int BYTES>
static __device__ __forceinline__ void put_block(const uint32_t (&out)[BYTES / 4], uint8_t *dst)
{
    int4 *to = (int4 *)dst;
    for (int i = 0; i < BYTES / 16; i++)
        to[i] = make_int4((int)out[4 * i], (int)out[4 * i + 1], (int)out[4 * i + 2], (int)out[4 * i + 3]);
}

/* One thread per block: the GGUF Q6_K block to type_q6_K_mmv's layout. */
static __global__ void repack_q6_K(const uint8_t *__restrict__ src, int64_t n_blocks, uint8_t *__restrict__ dst)
{
    follow_previous_kernel();
    int64_t ib = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ib >= n_blocks) return;
    const uint8_t *b = src + ib * 210;
    uint32_t out[LUMA_Q6_K_MMV_BYTES / 4] = {};
    uint8_t *o = (uint8_t *)out;
    for (int p = 0; p < 8; p++) {
        int h = p % 2, s0 = 2 * (p / 2), s1 = s0 + 1;
        for (int i = 0; i < 4; i++)
            for (int e = 0; e < 4; e++) {
                int l = 16 * h + 4 * i + e, a = q6k_q(b, s0, l), z = q6k_q(b, s1, l);
                o[16 * p + 4 * i + e] = (uint8_t)((a & 0xF) | (z & 0xF) << 4);
                o[128 + 8 * p + e] |= (uint8_t)((a >> 4) << (2 * i));
                o[128 + 8 * p + 4 + e] |= (uint8_t)((z >> 4) << (2 * i));
            }
        o[192 + 2 * p] = b[192 + 2 * s0 + h];
        o[192 + 2 * p + 1] = b[192 + 2 * s1 + h];
    }
    float d = q6k_d(b);
    memcpy(o + 208, &d, 4);
    put_block<LUMA_Q6_K_MMV_BYTES>(out, dst + ib * LUMA_Q6_K_MMV_BYTES);
}

/* One thread per block: the GGUF Q6_K block to rs_kernel's layout
 * (LUMA_Q6_K_RS_BYTES), in which each 6-bit value q (0..63; the weight is
 * d sc (q - 32)) takes a byte, so that a PRMT makes two of them f16.
 * Consumer lane part p (8 a block: half p / 4 of the block, thread p % 4 of
 * rs_kernel's quad) takes the positions l = 16 h .. 16 h + 15 (h = p % 2) of
 * the 32-element sub-blocks s0 = 2 (p / 2) and s1 = s0 + 1, as
 * type_q6_K_mmv and Q4_K's quant bytes do (rs_q4k_pos):
 *   [32 p, 32 p + 32)   word 2 u + j (u = 0..3; j = 0: s0, 1: s1), byte b:
 *                       q(s, l) of s = s0 + j, l = 16 h + 4 u + b;
 *   [256 + 2 p, + 2)    the int8 scales of s0's and s1's 16 positions;
 *   [272, 276)          d as f32 (exact); then 12 zero bytes. */
static __global__ void repack_q6_K_rs(const uint8_t *__restrict__ src, int64_t n_blocks, uint8_t *__restrict__ dst)
{
    follow_previous_kernel();
    int64_t ib = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ib >= n_blocks) return;
    const uint8_t *b = src + ib * 210;
    uint32_t out[LUMA_Q6_K_RS_BYTES / 4] = {};
    uint8_t *o = (uint8_t *)out;
    for (int p = 0; p < 8; p++) {
        int h = p % 2, s0 = 2 * (p / 2);
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) o[32 * p + 4 * j + e] = (uint8_t)q6k_q(b, s0 + j % 2, 16 * h + 4 * (j / 2) + e);
        o[256 + 2 * p] = b[192 + 2 * s0 + h];
        o[256 + 2 * p + 1] = b[192 + 2 * (s0 + 1) + h];
    }
    float d = q6k_d(b);
    memcpy(o + 272, &d, 4);
    put_block<LUMA_Q6_K_RS_BYTES>(out, dst + ib * LUMA_Q6_K_RS_BYTES);
}

/* Q6_K's tile copy (tc_q6k): thread (unit, lane) writes lane 4 g + t's
 * 16-byte pieces of a tile's superblock, and lanes 0..15 row lane's scales
 * and d, from the file's blocks (rows past the weight's end: zeros). */
static __global__ void repack_tc_q6k(const uint8_t *__restrict__ src, int64_t rows, int nb, int64_t units,
                                     uint8_t *__restrict__ dst)
{
    follow_previous_kernel();
    const tc_repack_at<tc_q6k> at((int64_t)blockIdx.x * blockDim.x + threadIdx.x, src, rows, nb, dst);
    if (at.un >= units) return;
    const int lane = at.lane, g = at.g, t = at.t;
    const int64_t tile = at.tile;
    uint8_t *o = at.o;
    if (lane < 16) {
        const uint8_t *b = at.block(16 * tile + lane);
        uint32_t sc[4] = {};
        for (int G = 0; G < 16 && b; G++) sc[G / 4] |= (uint32_t)b[192 + G] << (8 * (G % 4));
        *(uint4 *)(o + 16 * lane) = make_uint4(sc[0], sc[1], sc[2], sc[3]);
        *(float *)(o + 256 + 4 * lane) = b ? q6k_d(b) : 0.0f;
    }
    /* element 4 t + e of group G: element 16 G + 4 t + e of the block, that
     * is l = 16 (G % 2) + 4 t + e of sub-block G / 2 */
    auto q = [&](const uint8_t *b, int G, int e) { return b ? q6k_q(b, G / 2, 16 * (G % 2) + 4 * t + e) : 0; };
    const uint8_t *rb[2] = { at.block(16 * tile + g), at.block(16 * tile + g + 8) };
    uint32_t nw[2][8] = {}, hw[2][4] = {};
    for (int r = 0; r < 2; r++)
        for (int G = 0; G < 16; G++)
            for (int e = 0; e < 4; e++) {
                const uint32_t v = (uint32_t)q(rb[r], G, e);
                nw[r][G % 8] |= (v & 0xF) << (8 * e + 4 * (G / 8));
                hw[r][G % 4] |= (v >> 4) << (8 * e + 2 * (G / 4));
            }
    for (int j = 0; j < 4; j++)
        *(uint4 *)(o + 320 + 512 * j + 16 * lane) =
            make_uint4(nw[0][2 * j], nw[0][2 * j + 1], nw[1][2 * j], nw[1][2 * j + 1]);
    for (int j = 0; j < 2; j++)
        *(uint4 *)(o + 2368 + 512 * j + 16 * lane) =
            make_uint4(hw[0][2 * j], hw[0][2 * j + 1], hw[1][2 * j], hw[1][2 * j + 1]);
}

/* One thread per repacked block: four GGUF blocks of sb bytes (d, then qh
 * of qh bytes, then qs of qs bytes) to x4_layout's [qs x 4][qh x 4][d x 4]. */
static __global__ void repack_x4(const uint8_t *__restrict__ src, int64_t n_blocks, int sb, int qh, int qs,
                                 uint8_t *__restrict__ dst)
{
    follow_previous_kernel();
    int64_t ib = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ib >= n_blocks) return;
    const uint8_t *b = src + ib * 4 * sb;
    uint8_t *o = dst + ib * (4 * (qs + qh) + 8);   /* 8-byte aligned: its bytes one at a time */
    for (int k = 0; k < 4; k++) {
        const uint8_t *bk = b + k * sb;
        for (int e = 0; e < qs; e++) o[k * qs + e] = bk[2 + qh + e];
        for (int e = 0; e < qh; e++) o[4 * qs + k * qh + e] = bk[2 + e];
        o[4 * (qs + qh) + 2 * k] = bk[0];
        o[4 * (qs + qh) + 2 * k + 1] = bk[1];
    }
}

/* The repacked layout of a type: elements and bytes of a repacked block,
 * 0 for a type without one. */
static void mmv_layout(enum luma_type t, int64_t *qk, size_t *bytes)
{
    *qk = t == LUMA_Q6_K ? 256 : t == LUMA_Q4_0 || t == LUMA_Q5_0 || t == LUMA_Q8_0 ? 128 : 0;
    *bytes = t == LUMA_Q6_K   ? LUMA_Q6_K_MMV_BYTES
             : t == LUMA_Q4_0 ? x4_q4_0::bytes
             : t == LUMA_Q5_0 ? x4_q5_0::bytes
                              : x4_q8_0::bytes;
}

/* Whether w's repacked copy has the rs layout after its matrix-vector
 * blocks (cuda_internal.h). */
static bool q6k_has_rs(const luma_weight *w)
{
    return w->type == LUMA_Q6_K && w->rows >= 2 && w->cols >= 2 * w->rows && w->cols % 256 == 0;
}

/* Bytes of w's matrix-vector blocks alone (0: none). */
static size_t mmv_part_bytes(const luma_weight *w)
{
    int64_t qk;
    size_t block, bytes;
    if (w->type == LUMA_Q4_K || w->type == LUMA_Q5_K) {   /* the tile copy: whole tiles of 16 rows */
        if (w->rows < 2 || w->cols % 256 != 0) return 0;
        if (luma_mul_size((size_t)tc_tiles(w->rows) * MMV_TC_ROWS, luma_row_size(w->type, w->cols), &bytes)) return 0;
        return bytes;
    }
    mmv_layout(w->type, &qk, &block);
    if (qk == 0 || w->rows < 2 || w->cols % qk != 0) return 0;
    if (luma_mul_size((size_t)w->rows, (size_t)(w->cols / qk) * block, &bytes)) return 0;
    return bytes;
}

/* Bytes of w's rs layout (0: none). */
static size_t q6k_rs_bytes(const luma_weight *w)
{
    size_t rs;
    if (!q6k_has_rs(w) || luma_mul_size((size_t)w->rows, (size_t)(w->cols / 256) * LUMA_Q6_K_RS_BYTES, &rs)) return 0;
    return rs;
}

/* Bytes of a Q6_K weight's tile copy (whole tiles of 16 rows). */
static size_t q6k_tc_bytes(const luma_weight *w)
{
    size_t bytes;
    if (luma_mul_size((size_t)tc_tiles(w->rows) * (size_t)(w->cols / 256), (size_t)MMV_TC_ROWS * LUMA_Q6_K_TC_BYTES,
                      &bytes))
        return 0;
    return bytes;
}

size_t luma_cuda_mmv_bytes(const cuda_backend *c, const luma_weight *w)
{
    size_t bytes = mmv_part_bytes(w), all;
    if (bytes == 0 || w->type != LUMA_Q6_K) return bytes;
    size_t rs = q6k_rs_bytes(w), tc = c->tc_q6k ? q6k_tc_bytes(w) : 0;
    if ((q6k_has_rs(w) && rs == 0) || (c->tc_q6k && tc == 0) || luma_add_size(bytes, rs, &all) ||
        luma_add_size(all, tc, &all))
        return 0;
    return all;
}

const uint8_t *luma_cuda_q6k_rs(const cuda_backend *c, const luma_weight *w)
{
    if (!c->mmv_on || !w->dev_mmv || !q6k_has_rs(w)) return NULL;
    return (const uint8_t *)w->dev_mmv + mmv_part_bytes(w);
}

/* A Q6_K weight's tile copy where the kernels may read it, else NULL. */
static const uint8_t *q6k_tc(const cuda_backend *c, const luma_weight *w)
{
    if (w->type != LUMA_Q6_K || !c->tc_q6k || !has_mmv(c, w)) return NULL;
    return (const uint8_t *)w->dev_mmv + mmv_part_bytes(w) + q6k_rs_bytes(w);
}

void luma_cuda_repack(cuda_backend *c, const luma_weight *w, uint8_t *out)
{
    int64_t qk;
    size_t block;
    /* a tile copy (Q4_K, Q5_K, Q6_K's last part): a warp a tile's superblock */
    const int tc_nb = (int)(w->cols / 256);
    const int64_t tc_units = tc_tiles(w->rows) * tc_nb;
    const unsigned tc_ctas = blocks_for(tc_units * 32, 128);
    if (w->type == LUMA_Q4_K || w->type == LUMA_Q5_K) {
        const uint8_t *src = (const uint8_t *)w->dev;
        if (w->type == LUMA_Q4_K)
            luma_launch(c, c->stream, tc_ctas, 128, 0, repack_tc<false>, src, w->rows, tc_nb, tc_units, out);
        else
            luma_launch(c, c->stream, tc_ctas, 128, 0, repack_tc<true>, src, w->rows, tc_nb, tc_units, out);
        luma_cuda_fail(c, cudaGetLastError(), "repacking a weight for the tensor-core matrix-vector kernel");
        return;
    }
    mmv_layout(w->type, &qk, &block);
    int64_t n = w->rows * (w->cols / qk);
    const uint8_t *src = (const uint8_t *)w->dev;
    unsigned ctas = blocks_for(n, 128);
    if (w->type == LUMA_Q6_K) luma_launch(c, c->stream, ctas, 128, 0, repack_q6_K, src, n, out);
    else if (w->type == LUMA_Q4_0) luma_launch(c, c->stream, ctas, 128, 0, repack_x4, src, n, 18, 0, 16, out);
    else if (w->type == LUMA_Q5_0) luma_launch(c, c->stream, ctas, 128, 0, repack_x4, src, n, 22, 4, 16, out);
    else luma_launch(c, c->stream, ctas, 128, 0, repack_x4, src, n, 34, 0, 32, out);
    if (q6k_has_rs(w)) luma_launch(c, c->stream, ctas, 128, 0, repack_q6_K_rs, src, n, out + mmv_part_bytes(w));
    if (w->type == LUMA_Q6_K && c->tc_q6k)
        luma_launch(c, c->stream, tc_ctas, 128, 0, repack_tc_q6k, src, w->rows, tc_nb, tc_units,
                    out + mmv_part_bytes(w) + q6k_rs_bytes(w));
    luma_cuda_fail(c, cudaGetLastError(), "repacking a weight for the matrix-vector kernels");
}

/* The whole weight as f16 with nothing to dequantize: F16 weights
 * themselves, or the resident copy while the backend keeps copies (a copy
 * freed since is still named by w->dev_f16: cuda_internal.h). */
static const __half *resident_f16(const cuda_backend *c, const luma_weight *w)
{
    if (w->type == LUMA_F16) return (const __half *)w->dev;
    return c->f16_mode == CUDA_F16_RESIDENT ? (const __half *)w->dev_f16 : NULL;
}

/* The activations as the tensor-core path multiplies w with them, into xh
 * (m x cols f16). Block formats: the activations' 8-bit values, as every
 * path multiplies them, so that a row's result does not depend on the
 * size of its step. Float weights, and every weight with float activations,
 * meet the activations unquantized, as on the matrix-vector path. */
static void tensor_act(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, __half *xh)
{
    int64_t cols = w->cols;
    if (c->float_act || is_float_type(w->type) || cols % 32 != 0)
        luma_launch(c, c->stream, blocks_for(m * cols, DEQ_THREADS), DEQ_THREADS, 0, float_to_f16<LUMA_F32>, x,
                    m * cols, xh);
    else
        luma_cuda_quantize_act(c, w->type, x, m * cols, NULL, NULL, xh);
    luma_cuda_fail(c, cudaGetLastError(), "matmul (activations to f16)");
}

/* Two weights whose tensor-core activations are the same values: the same
 * width, and both float (or float activations), or both block formats of
 * one activation format. */
static bool same_tensor_act(const cuda_backend *c, const luma_weight *a, const luma_weight *b)
{
    if (a->cols != b->cols) return false;
    if (c->float_act) return true;
    bool fa = is_float_type(a->type) || a->cols % 32 != 0, fb = is_float_type(b->type) || b->cols % 32 != 0;
    if (fa || fb) return fa && fb;
    return luma_type_get(a->type)->act_type == luma_type_get(b->type)->act_type;
}

static bool tensor_fits(cuda_backend *c, const luma_weight *w, int64_t m)
{
    if (w->rows <= INT_MAX && w->cols <= INT_MAX && m <= INT_MAX) return true;
    luma_cuda_failf(c, "matmul: %lld x %lld weight with %lld rows is too large for cuBLAS", (long long)w->rows,
                    (long long)w->cols, (long long)m);
    return false;
}

/* cuBLAS's handle on the backend's current stream, with that stream's
 * workspace (the side stream has its own: the two may run at once) and
 * host scalars. */
static cublasStatus_t cublas_on_stream(cuda_backend *c)
{
    cublasStatus_t st = cublasSetStream(c->cublas, c->stream);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasSetWorkspace(c->cublas, c->stream == c->side ? c->side_ws : c->cublas_ws, CUBLAS_WORKSPACE);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetPointerMode(c->cublas, CUBLAS_POINTER_MODE_HOST);
    return st;
}

/* ---- cuBLASLt: one choice of GEMM per bucket of rows ------------------------
 *
 * cublasGemmEx chooses its kernel afresh for every (rows, m, cols) it has
 * not met: about 0.1 ms of heuristics a shape, and 1.7-2.4 ms where the
 * choice is a kernel the process has not run yet (cuBLAS loads its own
 * kernels at their first use), so a prompt of a length not seen before
 * took 5-8 times as long as the same length again (cuda/NOTES.md,
 * "cuBLAS's choice once per bucket of rows"). lt_gemm makes the choice
 * once per shape and bucket of m (the heuristic asked at the bucket's
 * largest m) and runs that algorithm for every m of the bucket. */
#define LT_ALGOS 1024   /* slots of the table; at most 3/4 filled, then cublasGemmEx */

struct lt_algo {
    int32_t rows, cols, ldy, batch;   /* batch 0: a free slot */
    int64_t bucket;
    cublasLtMatmulAlgo_t algo;
    bool ok;                          /* the heuristic found one */
};

/* m's bucket, named by its largest m: multiples of 8 up to 64, of 64 up to
 * 512, powers of two past that. */
static int64_t lt_bucket(int64_t m)
{
    if (m <= 64) return (m + 7) / 8 * 8;
    if (m <= 512) return (m + 63) / 64 * 64;
    int64_t b = 1024;
    while (b < m) b *= 2;
    return b;
}

void luma_cuda_lt_init(cuda_backend *c)
{
    cublasOperation_t t = CUBLAS_OP_T;
    if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) {
        c->lt = NULL;
        return;
    }
    cublasLtMatmulDesc_t op = (cublasLtMatmulDesc_t)&c->lt_op;
    if (!(c->lt_algos = (struct lt_algo *)calloc(LT_ALGOS, sizeof *c->lt_algos)) ||
        cublasLtMatmulDescInit(op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t) != CUBLAS_STATUS_SUCCESS)
        luma_cuda_lt_free(c);
}

void luma_cuda_lt_free(cuda_backend *c)
{
    if (c->lt) cublasLtDestroy(c->lt);
    c->lt = NULL;
    free(c->lt_algos);
    c->lt_algos = NULL;
}

/* A column-major layout of r x cols elements of type t (leading dimension
 * ld), batch > 1: pointer arrays of that many. */
static bool lt_layout(cublasLtMatrixLayoutOpaque_t *l, cudaDataType t, int64_t r, int64_t cols, int64_t ld, int batch)
{
    cublasLtMatrixLayout_t h = (cublasLtMatrixLayout_t)l;
    if (cublasLtMatrixLayoutInit(h, t, (uint64_t)r, (uint64_t)cols, ld) != CUBLAS_STATUS_SUCCESS) return false;
    if (batch <= 1) return true;
    int32_t n = batch;
    uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    return cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n) ==
               CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode) ==
               CUBLAS_STATUS_SUCCESS;
}

/* The layouts of Y^T (rows x m, ldy) = A^T B: A cols x rows f16 (lda
 * cols), B cols x m f16 (ldb cols), Y f32. */
struct lt_layouts {
    cublasLtMatrixLayoutOpaque_t a, b, y;
};

static bool lt_layouts_for(lt_layouts *l, int rows, int64_t m, int cols, int ldy, int batch)
{
    return lt_layout(&l->a, CUDA_R_16F, cols, rows, cols, batch) &&
           lt_layout(&l->b, CUDA_R_16F, cols, m, cols, batch) && lt_layout(&l->y, CUDA_R_32F, rows, m, ldy, batch);
}

/* The alignment every operand of lt_gemm has (LT_ALIGN bytes, which the
 * tensor memory accelerator's copies need too): the heuristic, left to its
 * default of 256, could pick an algorithm that a buffer of some other
 * offset cannot feed. */
#define LT_ALIGN 16

static bool lt_align(cublasLtMatmulPreference_t p)
{
    const uint32_t a = LT_ALIGN;
    const cublasLtMatmulPreferenceAttributes_t which[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES
    };
    for (size_t i = 0; i < sizeof which / sizeof which[0]; i++)
        if (cublasLtMatmulPreferenceSetAttribute(p, which[i], &a, sizeof a) != CUBLAS_STATUS_SUCCESS) return false;
    return true;
}

/* The table's algorithm for the shape and m's bucket, chosen now where new;
 * NULL where there is none (the table full, or no algorithm). */
static const cublasLtMatmulAlgo_t *lt_algo_for(cuda_backend *c, int rows, int64_t m, int cols, int ldy, int batch,
                                               size_t ws_bytes)
{
    const int64_t bucket = lt_bucket(m);
    uint64_t h = ((uint64_t)rows * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)cols * 0xc2b2ae3d27d4eb4full) ^
                 ((uint64_t)ldy * 0x165667b19e3779f9ull) ^ ((uint64_t)bucket * 0x27d4eb2f165667c5ull) ^ (uint64_t)batch;
    h ^= h >> 29;
    for (int probe = 0; probe < LT_ALGOS; probe++) {
        struct lt_algo *e = &c->lt_algos[(h + (uint64_t)probe) % LT_ALGOS];
        if (e->batch == 0) {
            if (4 * (c->lt_used + 1) > 3 * LT_ALGOS) return NULL;
            lt_layouts l;
            cublasLtMatmulPreferenceOpaque_t pref;
            cublasLtMatmulPreference_t p = (cublasLtMatmulPreference_t)&pref;
            cublasLtMatmulHeuristicResult_t r;
            int got = 0;
            e->ok = lt_layouts_for(&l, rows, bucket, cols, ldy, batch) &&
                    cublasLtMatmulPreferenceInit(p) == CUBLAS_STATUS_SUCCESS &&
                    cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                         sizeof ws_bytes) == CUBLAS_STATUS_SUCCESS &&
                    lt_align(p) &&
                    cublasLtMatmulAlgoGetHeuristic(c->lt, (cublasLtMatmulDesc_t)&c->lt_op,
                                                   (cublasLtMatrixLayout_t)&l.a, (cublasLtMatrixLayout_t)&l.b,
                                                   (cublasLtMatrixLayout_t)&l.y, (cublasLtMatrixLayout_t)&l.y, p, 1,
                                                   &r, &got) == CUBLAS_STATUS_SUCCESS &&
                    got > 0;
            if (e->ok) e->algo = r.algo;
            e->rows = rows;
            e->cols = cols;
            e->ldy = ldy;
            e->batch = batch;
            e->bucket = bucket;
            c->lt_used++;
            c->lt_picks++;
            return e->ok ? &e->algo : NULL;
        }
        if (e->rows == rows && e->cols == cols && e->ldy == ldy && e->batch == batch && e->bucket == bucket)
            return e->ok ? &e->algo : NULL;
    }
    return NULL;
}

/* Y^T (rows x m, ldy) = A^T B through cuBLASLt with the algorithm of m's
 * bucket (batch > 1: a, b and y are device arrays of batch pointers, each
 * of them LT_ALIGN-aligned: the caller checks);
 * false, having queued nothing, where it cannot (no handle, no algorithm,
 * or the bucket's algorithm refuses this m): the caller then calls
 * cublasGemmEx. Not under batch invariance, whose products do not go
 * through cuBLAS but where they must (widths the matrix-vector kernels
 * cannot read), and there keep cublasGemmEx's choices. */
static bool lt_gemm(cuda_backend *c, int rows, int64_t m, int cols, int ldy, const void *a, const void *b, void *y,
                    int batch)
{
    if (!c->lt || c->invariant || m > INT32_MAX) return false;
    if (batch <= 1 && (((uintptr_t)a | (uintptr_t)b | (uintptr_t)y) % LT_ALIGN) != 0) return false;
    void *ws = c->stream == c->side ? c->side_ws : c->cublas_ws;
    const cublasLtMatmulAlgo_t *algo = lt_algo_for(c, rows, m, cols, ldy, batch, CUBLAS_WORKSPACE);
    lt_layouts l;
    if (!algo || !lt_layouts_for(&l, rows, m, cols, ldy, batch)) return false;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasLtMatmul(c->lt, (cublasLtMatmulDesc_t)&c->lt_op, &one, a, (cublasLtMatrixLayout_t)&l.a,
                                       b, (cublasLtMatrixLayout_t)&l.b, &zero, y, (cublasLtMatrixLayout_t)&l.y, y,
                                       (cublasLtMatrixLayout_t)&l.y, algo, ws, CUBLAS_WORKSPACE, c->stream);
    if (st != CUBLAS_STATUS_SUCCESS) return false;
    c->lt_calls++;
    return true;
}

/* The GEMMs run through cuBLASLt and the algorithms chosen (for the tests);
 * false where cuBLASLt is off. */
extern "C" bool luma_cuda_lt_counts(luma_backend *be, long long *calls, long long *picks)
{
    const cuda_backend *c = (const cuda_backend *)be;
    *calls = c->lt_calls;
    *picks = c->lt_picks;
    return c->lt != NULL;
}

/* Y (m x rows, row-major) = X W^T through cuBLAS, which is column-major: W
 * row-major is the cols x rows matrix A (lda cols), X row-major the cols x m
 * matrix B (ldb cols), so Y^T = A^T B is rows x m with ldc rows: the "TN"
 * product, both operands contiguous along k. xh holds the activations
 * (tensor_act). Without a resident f16 copy, panels of `panel` weight rows
 * are dequantized in turn into wh and fill column blocks of Y^T. */
static void tensor_gemm(cuda_backend *c, const luma_weight *w, const __half *xh, __half *wh, int64_t panel,
                        int64_t m, float *y)
{
    int64_t rows = w->rows, cols = w->cols;
    const __half *whole = resident_f16(c, w);
    if (whole && luma_cuda_g16(c, w, whole, xh, m, y)) return;   /* mmq.cu: where it measured faster */
    cublasStatus_t st = cublas_on_stream(c);
    const float one = 1.0f, zero = 0.0f;
    for (int64_t r0 = 0; r0 < rows && st == CUBLAS_STATUS_SUCCESS && LUMA_CUDA_OK(c); r0 += panel) {
        int64_t n = rows - r0 < panel ? rows - r0 : panel;
        const __half *a = whole ? whole + r0 * cols : wh;
        if (!whole) dequant_rows(c, w, r0, n, wh);
        if (LUMA_CUDA_OK(c) && lt_gemm(c, (int)n, m, (int)cols, (int)rows, a, xh, y + r0, 1)) continue;
        st = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)cols, &one, a, CUDA_R_16F,
                          (int)cols, xh, CUDA_R_16F, (int)cols, &zero, y + r0, CUDA_R_32F, (int)rows,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        luma_cuda_failf(c, "matmul: cuBLAS GEMM failed (%s)", cublas_status_name(st));
}

/* The slot of c's GEMM pointer tables that holds the 3 k pointers p (A[k],
 * B[k], C[k]), made where new; -1 where the table is off or full (then the
 * caller runs the products one by one). Before its GEMM reads a slot, the
 * stream has its pointers: a slot is written eagerly once (in stream
 * order, before any recorded step that reads it is replayed), or, while
 * the step is being recorded and no eager write came first, by a copy node
 * of the recording, which every replay runs again (tab_k's bit 7: written
 * eagerly). */
static int gemm_table_slot(cuda_backend *c, const void *const *p, int k)
{
    if (!c->gemm_batch || k < 2 || k > LUMA_MATMUL_MANY) return -1;
    const size_t bytes = (size_t)(3 * k) * sizeof(void *);
    uint64_t h = 1469598103934665603ull ^ (uint64_t)k;
    for (int i = 0; i < 3 * k; i++) h = (h ^ (uint64_t)(uintptr_t)p[i]) * 1099511628211ull;
    h ^= h >> 31;
    for (int probe = 0; probe < CUDA_GEMM_TAB_SLOTS; probe++) {
        const int slot = (int)((h + (uint64_t)probe) & (CUDA_GEMM_TAB_SLOTS - 1));
        void **e = c->tab_host + (size_t)slot * CUDA_GEMM_TAB_PTRS;
        const int kk = c->tab_k[slot] & 0x7f;
        if (kk == 0) {
            if (4 * (c->tab_used + 1) > 3 * CUDA_GEMM_TAB_SLOTS) return -1;   /* at most 3/4 full */
            memcpy(e, p, bytes);
            c->tab_k[slot] = (uint8_t)k;
            c->tab_used++;
        } else if (kk != k || memcmp(e, p, bytes) != 0) {
            continue;
        }
        if (c->tab_k[slot] & 0x80) return slot;
        if (luma_cuda_fail(c, cudaMemcpyAsync(c->tab_dev + (size_t)slot * CUDA_GEMM_TAB_PTRS, e, bytes,
                                              cudaMemcpyHostToDevice, c->stream),
                           "matmul (a batched GEMM's pointers)"))
            return -1;
        if (!c->capturing) c->tab_k[slot] |= 0x80;
        return slot;
    }
    return -1;
}

/* ys[i] = ws[i] xh for k weights of one shape on their resident f16
 * copies, as one cublasGemmBatchedEx; false, running nothing, where the
 * table has no slot for them. */
static bool tensor_gemm_batched(cuda_backend *c, const luma_weight *const *ws, float *const *ys, int k,
                                const __half *xh, int64_t m)
{
    const void *p[3 * LUMA_MATMUL_MANY];
    if (k < 2 || k > LUMA_MATMUL_MANY) return false;
    for (int i = 0; i < k; i++) {
        p[i] = resident_f16(c, ws[i]);
        p[k + i] = xh;
        p[2 * k + i] = ys[i];
        if (!p[i] || ws[i]->rows != ws[0]->rows || ws[i]->cols != ws[0]->cols) return false;
    }
    const int slot = gemm_table_slot(c, p, k);
    if (slot < 0) return false;
    void *const *t = c->tab_dev + (size_t)slot * CUDA_GEMM_TAB_PTRS;
    const int rows = (int)ws[0]->rows, cols = (int)ws[0]->cols;
    bool aligned = true;
    for (int i = 0; i < 3 * k; i++) aligned = aligned && (uintptr_t)p[i] % LT_ALIGN == 0;
    if (aligned && lt_gemm(c, rows, m, cols, rows, t, t + k, (void *)(t + 2 * k), k)) {
        c->gemm_batches++;
        return true;
    }
    cublasStatus_t st = cublas_on_stream(c);
    const float one = 1.0f, zero = 0.0f;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasGemmBatchedEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, rows, (int)m, cols, &one, (const void *const *)t,
                                 CUDA_R_16F, cols, (const void *const *)(t + k), CUDA_R_16F, cols, &zero,
                                 (void *const *)(t + 2 * k), CUDA_R_32F, rows, k, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        luma_cuda_failf(c, "matmul: cuBLAS batched GEMM failed (%s)", cublas_status_name(st));
    c->gemm_batches++;
    return true;
}

static void mm_tensor(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    if (!tensor_fits(c, w, m)) return;
    int64_t rows = w->rows, cols = w->cols;
    const __half *whole = resident_f16(c, w);
    int64_t panel = whole ? rows : PANEL_ELEMS / cols;
    if (panel < 1) panel = 1;
    if (panel > rows) panel = rows;
    size_t xbytes = align256((size_t)m * (size_t)cols * sizeof(__half));
    size_t wbytes = whole ? 0 : (size_t)panel * (size_t)cols * sizeof(__half);
    uint8_t *s = (uint8_t *)luma_cuda_scratch(c, xbytes + wbytes);
    if (!s) return;
    __half *xh = (__half *)s;
    tensor_act(c, w, x, m, xh);
    if (LUMA_CUDA_OK(c)) tensor_gemm(c, w, xh, (__half *)(s + xbytes), panel, m, y);
}

/* ---- entry points ---------------------------------------------------------------- */

bool luma_cuda_matmul_supports(enum luma_type t)
{
    switch (t) {
    case LUMA_F32: case LUMA_F16: case LUMA_BF16:
    case LUMA_Q4_0: case LUMA_Q4_1: case LUMA_Q5_0: case LUMA_Q5_1: case LUMA_Q8_0:
    case LUMA_Q2_K: case LUMA_Q3_K: case LUMA_Q4_K: case LUMA_Q5_K: case LUMA_Q6_K:
        return true;
    default:
        return false;
    }
}

/* The largest m of the matrix-vector path for block formats:
 * LUMA_MMV_MAX_M, or LUMA_CUDA_MMV_MAX_M from the environment (read once;
 * for measuring the two paths on the same steps). */
static int64_t mmv_max_m(void)
{
    static int64_t max_m = -1;
    if (max_m < 0) {
        const char *s = getenv("LUMA_CUDA_MMV_MAX_M");
        long v = s ? strtol(s, NULL, 10) : 0;
        max_m = v > 0 ? v : LUMA_MMV_MAX_M;
    }
    return max_m;
}

/* Whether w can be multiplied here at all; records why not. */
static bool matmul_ok(cuda_backend *c, const luma_weight *w)
{
    if (!luma_cuda_matmul_supports(w->type)) {
        luma_cuda_failf(c, "matmul: tensor type %s is not supported by the CUDA backend", luma_type_name(w->type));
        return false;
    }
    if (!w->dev || luma_row_size(w->type, w->cols) == 0) {
        luma_cuda_failf(c, "matmul: %s weight of %lld x %lld is not on the device or has a bad shape",
                        luma_type_name(w->type), (long long)w->rows, (long long)w->cols);
        return false;
    }
    return true;
}

/* Whether y = W x for m rows takes the matrix-vector path. Batch
 * invariance: every m, in passes of MMV_PASS_M rows, each row computed
 * alike; except a float weight those kernels cannot read (rows not whole
 * 16-byte loads: mmv_fits), which keeps the tensor cores. */
static bool takes_vec(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m)
{
    if (luma_cuda_tall_takes(c, w, m)) return false;
    int64_t max_m = c->invariant ? m : w->type == LUMA_F16 ? MMV_MAX_M_F16 : mmv_max_m();
    /* float activations: mmv_float and the kf types (whole float4 loads of x)
     * up to MMV_FLOAT_MAX_M rows where the weight has a resident f16 copy
     * for cuBLAS, up to max_m where it has none */
    if (c->float_act && !is_float_type(w->type)) {
        if (!c->invariant && resident_f16(c, w) && max_m > MMV_FLOAT_MAX_M) max_m = MMV_FLOAT_MAX_M;
        return m <= max_m && ((uintptr_t)x & 15) == 0;
    }
    if (mmv_tc_takes(c, w, m)) return mmv_fits(w, x);
    return m <= max_m && mmv_fits(w, x) && !luma_cuda_mmq_small(c, w, x, m);
}

const uint8_t *luma_cuda_x4(const cuda_backend *c, const luma_weight *w)
{
    return w->type == LUMA_Q8_0 && has_mmv(c, w) && w->cols % 128 == 0 ? (const uint8_t *)w->dev_mmv : NULL;
}

/* y = W x by the tall kernel (tall.cu) on the activations quantized as
 * for the matrix-vector kernels (a pending norm joins the quantizer). */
static void mm_tall(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    uint8_t *s = (uint8_t *)luma_cuda_scratch(c, act_q_bytes(m, w->cols));
    if (!s) return;
    quantize_into(c, w, x, m, s);
    const act_rows a = act_rows_at(w, x, m, s);
    if (LUMA_CUDA_OK(c)) luma_cuda_tall(c, w, (const int8_t *)a.q, a.ds, m, y);
}

void luma_cuda_matmul(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    if (!LUMA_CUDA_OK(c) || m <= 0 || w->rows <= 0 || !matmul_ok(c, w)) return;
    const bool tall = luma_cuda_tall_takes(c, w, m), vec = takes_vec(c, w, x, m);
    /* a pending norm joins the quantizer of mm_vec and mm_tall
     * (quantize_into); the other paths read x first */
    if (!(vec || tall) || is_float_type(w->type) || c->float_act) luma_cuda_pending_flush(c);
    if (tall) {
        mm_tall(c, w, x, m, y);
    } else if (vec) {
        if (c->float_act && !is_float_type(w->type)) mm_float(c, w, x, m, y);
        else mm_vec(c, w, x, m, y);
    } else if (!luma_cuda_mmq(c, w, x, m, y)) mm_tensor(c, w, x, m, y);   /* mmq.cu: where it measured faster */
}

/* Whether luma_cuda_matmul would multiply w by cuBLAS on its resident f16
 * copy (neither the matrix-vector path nor mmq takes it). */
static bool cublas_on_copy(cuda_backend *c, const luma_weight *w, const float *x, int64_t m)
{
    return !luma_cuda_tall_takes(c, w, m) && !takes_vec(c, w, x, m) && resident_f16(c, w) &&
           !luma_cuda_mmq_takes(c, w, x, m) && tensor_fits(c, w, m);
}

/* quantize_launch of gate = act(gate) * up, act LUMA_ACT_GELU or
 * LUMA_ACT_SILU, into the int8 values q and ds or the f16 xh (in
 * rs_kernel's order when RS). */
template <bool RS = false>
static void quantize_gated(cuda_backend *c, int act, enum luma_type t, float *gate, const float *up, int64_t n,
                           int8_t *q, float2 *ds, __half *xh, uint32_t *qi = NULL, int64_t cols = 0, int m = 0)
{
    if (act == LUMA_ACT_GELU) quantize_launch<LUMA_ACT_GELU, RS>(c, t, gate, gate, up, n, q, ds, xh, qi, cols, m);
    else quantize_launch<LUMA_ACT_SILU, RS>(c, t, gate, gate, up, n, q, ds, xh, qi, cols, m);
}

/* gated_matmul past the matrix-vector path, where the product is rs_kernel
 * or cuBLAS on the resident copy: the quantizer that writes their f16
 * activations makes act(gate) * up first (and stores it in gate), so that
 * no pass of its own reads gate and up. False where w takes another
 * route. */
static bool gated_tensor(cuda_backend *c, const luma_weight *w, float *gate, const float *up, int act, int64_t m,
                         float *y)
{
    bool rs = luma_cuda_rs_takes(c, w, gate, m);
    if (w->cols % 32 != 0 || (!rs && !cublas_on_copy(c, w, gate, m))) return false;
    __half *xh = (__half *)luma_cuda_scratch(c, (size_t)m * (size_t)w->cols * sizeof(__half));
    if (!xh) return true;
    if (rs) quantize_gated<true>(c, act, w->type, gate, up, m * w->cols, NULL, NULL, xh);
    else quantize_gated(c, act, w->type, gate, up, m * w->cols, NULL, NULL, xh);
    if (!LUMA_CUDA_OK(c)) return true;
    if (!rs) tensor_gemm(c, w, xh, NULL, w->rows, m, y);
    else if (!luma_cuda_rs(c, w, xh, m, y)) luma_cuda_matmul(c, w, gate, m, y);   /* gate is act(gate) * up now */
    return true;
}

bool luma_cuda_gated_matmul(cuda_backend *c, const luma_weight *w, float *gate, const float *up, int act,
                            int64_t m, float *y)
{
    if (!LUMA_CUDA_OK(c) || m <= 0 || w->rows <= 0) return true;
    if (!matmul_ok(c, w)) return true;
    if (c->float_act || is_float_type(w->type) || ((uintptr_t)gate & 15) || ((uintptr_t)up & 15)) return false;
    if (!takes_vec(c, w, gate, m)) return gated_tensor(c, w, gate, up, act, m, y);
    uint8_t *s = (uint8_t *)luma_cuda_scratch(c, act_q_bytes(m, w->cols));
    if (!s) return true;
    act_rows a = act_rows_at(w, gate, m, s);
    quantize_gated(c, act, w->type, gate, up, m * w->cols, (int8_t *)a.q, (float2 *)a.ds, NULL, (uint32_t *)a.qi,
                   w->cols, (int)m);
    if (LUMA_CUDA_OK(c)) mm_vec_run(c, w, a, m, y);
    return true;
}

/* mmv_gated for gate and up (w, type T, repacked), where their rows are at
 * most 3 rounds and its clusters fit (with go, launched); false where not. */
template <class T>
static bool ffn_gated_launch(cuda_backend *c, const luma_weight *w, const act_rows &a, mmv_gated_args &g, bool go)
{
    constexpr int stride = 32 / T::lpb;
    if (w->cols % T::qk != 0) return false;
    g.nb = (int)(w->cols / T::qk);
    g.row_bytes = (size_t)g.nb * T::bytes;
    switch ((g.nb + stride - 1) / stride) {
    case 1: return mmv_gated_launch<T, 1>(c, a, g, go);
    case 2: return mmv_gated_launch<T, 2>(c, a, g, go);
    case 3: return mmv_gated_launch<T, 3>(c, a, g, go);
    default: return false;
    }
}

static bool ffn_gated_type(cuda_backend *c, const luma_weight *w, const act_rows &a, mmv_gated_args &g, bool go)
{
    switch (w->type) {
    case LUMA_Q4_0: return ffn_gated_launch<type_q4_0_mmv>(c, w, a, g, go);
    case LUMA_Q5_0: return ffn_gated_launch<type_q5_0_mmv>(c, w, a, g, go);
    case LUMA_Q8_0: return ffn_gated_launch<type_q8_0_mmv>(c, w, a, g, go);
    default: return false;
    }
}

bool luma_cuda_ffn(cuda_backend *c, const luma_weight *const *w, int act, const float *x, int64_t m, float *gate,
                   float *up, float *y)
{
    /* LUMA_CUDA_FFN_GATED=0 in the environment: never (for measuring; read once) */
    static const bool on = luma_cuda_env_digit("LUMA_CUDA_FFN_GATED", 1) != 0;
    const luma_weight *wg = w[0], *wu = w[1], *wd = w[2];
    if (!on || m != 1 || !LUMA_CUDA_OK(c) || c->float_act || mmv_forced() || wg->type != wu->type ||
        wg->cols != wu->cols || wg->rows != wu->rows || wg->rows % 256 != 0 || wd->cols != wg->rows ||
        !has_mmv(c, wg) || !has_mmv(c, wu) || !wd->dev || !luma_cuda_matmul_supports(wd->type) ||
        is_float_type(wd->type) || !takes_vec(c, wg, x, m) || !takes_vec(c, wu, x, m) || !takes_vec(c, wd, gate, m) ||
        ((uintptr_t)gate & 15) || ((uintptr_t)up & 15) || (act != LUMA_ACT_GELU && act != LUMA_ACT_SILU))
        return false;
    mmv_gated_args g;
    g.wg = (const uint8_t *)wg->dev_mmv;
    g.wu = (const uint8_t *)wu->dev_mmv;
    g.act = act;
    g.k = luma_type_get(wd->type)->act_type == LUMA_Q8_K;
    g.n = wg->rows;
    g.gate = gate;
    g.up = up;
    act_rows ax = act_rows_at(wg, x, m, NULL);
    if (!ffn_gated_type(c, wg, ax, g, false)) return false;
    const size_t in_bytes = act_q_bytes(m, wg->cols);
    uint8_t *s = (uint8_t *)luma_cuda_scratch(c, in_bytes + act_q_bytes(m, wd->cols));
    if (!s) return true;   /* the failure is the backend's now */
    ax = act_rows_at(wg, x, m, s);
    const act_rows ad = act_rows_at(wd, gate, m, s + in_bytes);
    g.q = (int8_t *)ad.q;
    g.ds = (float2 *)ad.ds;
    quantize_into(c, wg, x, m, s);   /* a pending norm joins it, as in matmul_many */
    if (LUMA_CUDA_OK(c)) ffn_gated_type(c, wg, ax, g, true);
    if (LUMA_CUDA_OK(c)) mm_vec_run(c, wd, ad, m, y);
    return true;
}

int64_t luma_cuda_qkv_rope_max_m(void)
{
    return mmv_tc_hi() > MMV_PASS_M ? mmv_tc_hi() : MMV_PASS_M;
}

int luma_cuda_matmul_qkv_rope(cuda_backend *c, const luma_weight *const *ws, const float *const *b, const float *gq,
                              const float *gk, float eps, const float *x, int64_t m, float *const *ys,
                              int32_t head_dim, const rope_args *a, const int32_t *pos)
{
    if (m > luma_cuda_qkv_rope_max_m() || head_dim <= 0 || head_dim % 2 != 0 || !pos) {
        luma_cuda_matmul_many(c, 3, ws, x, m, ys);
        return 0;
    }
    mmv_rope_request rq;
    for (int i = 0; i < 3; i++) {
        rq.y[i] = ys[i];
        rq.b[i] = b[i];
    }
    rq.gq = gq;
    rq.gk = gk;
    rq.eps = eps;
    rq.rp.pos = pos;
    rq.rp.mask = 0;
    rq.rp.head_dim = head_dim;
    rq.rp.a = *a;
    rq.done = 0;
    c->qkv_rope = &rq;
    luma_cuda_matmul_many(c, 3, ws, x, m, ys);
    c->qkv_rope = NULL;
    return rq.done;
}

/* Whether v, past the matrix-vector path, joins w's cuBLAS group in
 * matmul_many: cuBLAS on its f16 copy (not rs_kernel) with w's tensor
 * activations. */
static bool cublas_joins(cuda_backend *c, const luma_weight *w, const luma_weight *v, const float *x, int64_t m)
{
    return same_tensor_act(c, w, v) && !luma_cuda_rs_takes(c, v, x, m) && cublas_on_copy(c, v, x, m);
}

/* matmul_many's products on cuBLAS from ws[i] on: one conversion of x for
 * every weight not yet done that joins ws[i]'s group. False where the
 * scratch failed. */
static bool cublas_group(cuda_backend *c, int i, int n, const luma_weight *const *ws, const int *fmt_of,
                         const float *x, int64_t m, float *const *ys, bool *done)
{
    const luma_weight *w = ws[i];
    __half *xh = (__half *)luma_cuda_scratch(c, (size_t)m * (size_t)w->cols * sizeof(__half));
    if (!xh) return false;
    tensor_act(c, w, x, m, xh);
    int group[LUMA_MATMUL_MANY], g = 0;
    for (int j = i; j < n && j < LUMA_MATMUL_MANY; j++)
        if (fmt_of[j] < 0 && !done[j] && cublas_joins(c, w, ws[j], x, m)) group[g++] = j;
    /* the members of one shape as one batched GEMM (the f16 wgmma kernel's,
     * where its rule takes them, one by one, below) */
    for (int a = 0; a < g && LUMA_CUDA_OK(c); a++) {
        const luma_weight *same[LUMA_MATMUL_MANY];
        float *out[LUMA_MATMUL_MANY];
        int k = 0, at[LUMA_MATMUL_MANY];
        for (int b = a; b < g; b++) {
            const luma_weight *v = ws[group[b]];
            if (!done[group[b]] && v->rows == ws[group[a]]->rows && !luma_cuda_g16_takes(c, v, m)) {
                at[k] = group[b];
                same[k] = v;
                out[k++] = ys[group[b]];
            }
        }
        if (k >= 2 && tensor_gemm_batched(c, same, out, k, xh, m))
            for (int b = 0; b < k; b++) done[at[b]] = true;
    }
    for (int a = 0; a < g && LUMA_CUDA_OK(c); a++) {
        const int j = group[a];
        if (done[j]) continue;
        tensor_gemm(c, ws[j], xh, NULL, ws[j]->rows, m, ys[j]);
        done[j] = true;
    }
    return true;
}

/* matmul_many's fork (cuda_backend.side): in a set of at least two products
 * past the matrix-vector path, at most LUMA_FORK_MAX_M rows, the first
 * that is not rs_kernel's (llama's q) goes to the side stream, where it has
 * at least c->fork_min weights (the 7B's q, not Gemma 3 270M's, whose
 * products are too small for the overlap to pay for the fork: measured);
 * where it is cuBLAS on its f16 copy, with every such product of the same
 * tensor activations (one conversion of x). Returns its index, or -1 where
 * the side would take the whole set or nothing. The side stream has its own
 * scratch and cuBLAS workspace; it takes no rs_kernel product, so that
 * stream-K's partial tiles stay this stream's. */
static int fork_plan(cuda_backend *c, int n, const luma_weight *const *ws, const int *fmt_of, const float *x,
                     int64_t m, bool *cb_group)
{
    if (c->fork_min <= 0 || c->invariant || m > LUMA_FORK_MAX_M) return -1;
    int side = -1, others = 0;
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY; i++) {
        if (fmt_of[i] >= 0) continue;
        others++;
        if (side < 0 && !luma_cuda_rs_takes(c, ws[i], x, m)) side = i;
    }
    if (side < 0 || others < 2 || ws[side]->rows * ws[side]->cols < c->fork_min) return -1;
    *cb_group = cublas_on_copy(c, ws[side], x, m);
    if (!*cb_group) return side;
    int group = 0;   /* what cublas_group would take */
    for (int i = side; i < n && i < LUMA_MATMUL_MANY; i++)
        if (fmt_of[i] < 0 && cublas_joins(c, ws[side], ws[i], x, m)) group++;
    return group < others ? side : -1;
}

/* The side stream waits for what this one has queued; launches (and
 * luma_cuda_scratch) go to it until c->stream is given back. Returns the
 * stream to give back. */
static cudaStream_t side_begin(cuda_backend *c)
{
    luma_cuda_fail(c, cudaEventRecord(c->fork_ev, c->stream), "matmul (the second stream's start)");
    luma_cuda_fail(c, cudaStreamWaitEvent(c->side, c->fork_ev, 0), "matmul (the second stream's start)");
    cudaStream_t back = c->stream;
    c->stream = c->side;
    return back;
}

/* This stream waits for what the side stream has queued. Made once a fork
 * has begun, failure or not: a recording must end with the side stream
 * joined. */
static void side_join(cuda_backend *c)
{
    cudaError_t e = cudaEventRecord(c->join_ev, c->side);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(c->stream, c->join_ev, 0);
    luma_cuda_fail(c, e, "matmul (the second stream's join)");
}

void luma_cuda_matmul_many(cuda_backend *c, int n, const luma_weight *const *ws, const float *x, int64_t m,
                           float *const *ys)
{
    if (!LUMA_CUDA_OK(c) || m <= 0 || n <= 0) return;
    /* the block-format weights on the matrix-vector path share one
     * preparation of x per activation format: with 8-bit activations one
     * quantization for Q8_0 and one for Q8_K, with float activations one
     * kf_order for the kf types (the other block types read x itself); each
     * product is then the kernel luma_cuda_matmul would run, on the same
     * values */
    enum { NONE = -1, FMT_Q8_0 = 0, FMT_Q8_K = 1, FMT_KF = 2, N_FMT = 3 };
    int fmt_of[LUMA_MATMUL_MANY];
    size_t at[N_FMT] = { 0 };
    bool used[N_FMT] = { false };
    size_t need = 0;
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY; i++) {
        const luma_weight *w = ws[i];
        fmt_of[i] = NONE;
        if (w->rows <= 0 || !matmul_ok(c, w)) return;
        if (is_float_type(w->type) || !takes_vec(c, w, x, m) || (c->float_act && !kfloat_takes(c, w))) continue;
        int f = c->float_act ? FMT_KF : luma_type_get(w->type)->act_type == LUMA_Q8_K ? FMT_Q8_K : FMT_Q8_0;
        fmt_of[i] = f;
        if (!used[f]) {
            used[f] = true;
            at[f] = need;
            need += f == FMT_KF ? align256((size_t)m * (size_t)w->cols * sizeof(float)) : act_q_bytes(m, w->cols);
        }
    }
    /* a pending norm joins the first quantizer below (quantize_into) where
     * every product reads x quantized; otherwise it runs first */
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY; i++)
        if (fmt_of[i] == NONE || fmt_of[i] == FMT_KF) {
            luma_cuda_pending_flush(c);
            break;
        }
    /* the others first: their paths may grow the scratch, and move it.
     * Weights for cuBLAS on a resident f16 copy share one conversion of x
     * per activation format, like the matrix-vector ones, and weights for
     * rs_kernel share its one (in its k order). */
    bool tensor_done[LUMA_MATMUL_MANY] = { false };
    /* Two streams (fork_plan): the side stream's products are queued
     * first, then this one's run beside them; each is the same kernel on
     * the same values as on one stream. */
    bool cb_group = false;
    const int side0 = fork_plan(c, n, ws, fmt_of, x, m, &cb_group);
    if (side0 >= 0) {
        cudaStream_t back = side_begin(c);
        c->forks++;
        if (cb_group) {
            cublas_group(c, side0, n, ws, fmt_of, x, m, ys, tensor_done);
        } else {
            luma_cuda_matmul(c, ws[side0], x, m, ys[side0]);
            tensor_done[side0] = true;
        }
        c->stream = back;
    }
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY && LUMA_CUDA_OK(c); i++) {
        const luma_weight *w = ws[i];
        if (fmt_of[i] != NONE || tensor_done[i]) continue;
        if (luma_cuda_rs_takes(c, w, x, m)) {
            __half *xp = (__half *)luma_cuda_scratch(c, (size_t)m * (size_t)w->cols * sizeof(__half));
            if (!xp) break;
            luma_cuda_quantize_act_rs(c, x, m * w->cols, xp);
            for (int j = i; j < n && j < LUMA_MATMUL_MANY && LUMA_CUDA_OK(c); j++) {
                const luma_weight *v = ws[j];
                if (fmt_of[j] != NONE || tensor_done[j] || v->cols != w->cols || !luma_cuda_rs_takes(c, v, x, m))
                    continue;
                int k = j + 1;   /* a second weight of v's shape for one launch of both */
                while (k < n && k < LUMA_MATMUL_MANY &&
                       (fmt_of[k] != NONE || tensor_done[k] || ws[k]->rows != v->rows || ws[k]->cols != v->cols ||
                        ws[k]->type != v->type || !luma_cuda_rs_takes(c, ws[k], x, m)))
                    k++;
                if (k < n && k < LUMA_MATMUL_MANY && luma_cuda_rs_pair(c, v, ws[k], xp, m, ys[j], ys[k])) {
                    tensor_done[j] = tensor_done[k] = true;
                    continue;
                }
                if (luma_cuda_rs(c, v, xp, m, ys[j])) {
                    tensor_done[j] = true;
                } else if (j == i) {
                    /* the other routes (which may move the scratch) */
                    luma_cuda_matmul(c, v, x, m, ys[j]);
                    tensor_done[j] = true;
                    break;
                }
            }
            continue;
        }
        if (!cublas_on_copy(c, w, x, m)) {
            luma_cuda_matmul(c, w, x, m, ys[i]);
            continue;
        }
        if (!cublas_group(c, i, n, ws, fmt_of, x, m, ys, tensor_done)) break;
    }
    if (side0 >= 0) side_join(c);
    if (!need || !LUMA_CUDA_OK(c)) return;
    uint8_t *s = (uint8_t *)luma_cuda_scratch(c, need);
    if (!s) return;
    bool done[N_FMT] = { false }, taken[LUMA_MATMUL_MANY] = { false };
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY && LUMA_CUDA_OK(c); i++) {
        const luma_weight *w = ws[i];
        int f = fmt_of[i];
        if (f == NONE || taken[i]) continue;
        if (!done[f]) {
            if (f == FMT_KF) kf_order_into(c, x, m, w->cols, (float *)(s + at[f]));
            else quantize_into(c, w, x, m, s + at[f]);
            done[f] = true;
        }
        if (f == FMT_KF) {
            if (LUMA_CUDA_OK(c)) mm_kfloat(c, w, (const float *)(s + at[f]), m, ys[i]);
            continue;
        }
        act_rows a = act_rows_at(w, x, m, s + at[f]);
        /* the later weights of the same type join this one's launch */
        const luma_weight *same[MMV_SEGS] = { w };
        float *ys_same[MMV_SEGS] = { ys[i] };
        int k = 1;
        for (int j = i + 1; j < n && j < LUMA_MATMUL_MANY && k < MMV_SEGS; j++)
            if (fmt_of[j] == f && ws[j]->type == w->type) {
                same[k] = ws[j];
                ys_same[k++] = ys[j];
                taken[j] = true;
            }
        /* and the rest of this format after them, when they are of one
         * other type that has a kernel with this one */
        int np = 0, rest = 0;
        for (int j = i + 1; j < n && j < LUMA_MATMUL_MANY; j++)
            if (fmt_of[j] == f && !taken[j]) {
                rest++;
                if (k + np < MMV_SEGS && (np == 0 || ws[j]->type == same[k]->type)) {
                    same[k + np] = ws[j];
                    ys_same[k + np++] = ys[j];
                }
            }
        if (np > 0 && np == rest && LUMA_CUDA_OK(c) && mm_vec_run_pair(c, same, ys_same, k + np, k, a, m)) {
            for (int j = i + 1; j < n && j < LUMA_MATMUL_MANY; j++)
                if (fmt_of[j] == f) taken[j] = true;
            continue;
        }
        if (k > 1 && LUMA_CUDA_OK(c) && mm_vec_run_many(c, same, ys_same, k, a, m)) continue;
        for (int j = 0; j < k && LUMA_CUDA_OK(c); j++) mm_vec_run(c, same[j], a, m, ys_same[j]);
    }
}

/* How many norms have been joined to a quantizer (for the tests). */
extern "C" long long luma_cuda_norm_quants(luma_backend *be)
{
    return ((cuda_backend *)be)->norm_quants;
}

/* How many launches made q, k and v by whole heads (for the tests). */
extern "C" long long luma_cuda_qkv_heads(luma_backend *be)
{
    return ((cuda_backend *)be)->qkv_heads;
}

/* How many launches made gate and up with the down's input (for the tests). */
extern "C" long long luma_cuda_ffn_gated(luma_backend *be)
{
    return ((cuda_backend *)be)->ffn_gated;
}

/* How many batched GEMMs have been queued (for the tests). */
extern "C" long long luma_cuda_gemm_batches(luma_backend *be)
{
    return ((cuda_backend *)be)->gemm_batches;
}

/* Groups of one shape on cuBLAS as one batched GEMM, or one GEMM each (for
 * the tests; on only where the pointer tables were made). */
extern "C" void luma_cuda_set_gemm_batch(luma_backend *be, bool on)
{
    cuda_backend *c = (cuda_backend *)be;
    c->gemm_batch = on && c->tab_dev && c->tab_host && c->tab_k;
}

/* Norms joined to the quantizer that follows them, or not (for the tests). */
extern "C" void luma_cuda_set_norm_quant(luma_backend *be, bool on)
{
    cuda_backend *c = (cuda_backend *)be;
    luma_cuda_pending_flush(c);
    c->normq_on = on;
}

/* How many attentions have quantized the next product's input (for the
 * tests). */
extern "C" long long luma_cuda_attn_quants(luma_backend *be)
{
    return ((cuda_backend *)be)->attn_quants;
}

/* Attentions quantizing the next product's input, or not (for the tests). */
extern "C" void luma_cuda_set_attn_quant(luma_backend *be, bool on)
{
    cuda_backend *c = (cuda_backend *)be;
    luma_cuda_pending_flush(c);
    c->attnq_on = on;
}

/* How many sets matmul_many has split over its two streams (for the tests). */
extern "C" long long luma_cuda_forks(luma_backend *be)
{
    return ((cuda_backend *)be)->forks;
}

/* ---- decode-step programs (program.cuh) ------------------------------------ */

#define PROG_CONSUMERS (PROG_WARPS * 32)
#define PROG_THREADS (PROG_CONSUMERS + 32)

struct prog_smem {
    uint8_t ring[PROG_STAGES][PROG_STAGE_BYTES];
    int8_t q[PROG_MAX_COLS];
    float2 ds[PROG_MAX_COLS / 32];
    float pair[2][PROG_WARPS];   /* RoPE: the odd rows' sums, by row group parity */
    float part[PROG_WARPS];
    uint64_t full[PROG_STAGES], empty[PROG_STAGES];
};

static __device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

static __device__ __forceinline__ unsigned ld_acquire(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ unsigned long long prog_now()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Every consumer of every CTA has arrived (their writes visible to the
 * others' L2 reads). bar[0] counts arrivals, bar[1] the barriers passed:
 * the last to arrive resets the count and opens the next generation. */
static __device__ void prog_grid_sync(unsigned *bar, unsigned G)
{
    team_barrier(1, PROG_CONSUMERS);
    if (threadIdx.x == 0) {
        unsigned gen = ld_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == G - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire(bar + 1) == gen) {
            }
        }
        __threadfence();
    }
    team_barrier(1, PROG_CONSUMERS);
}

/* A CTA's rows of a weight: its share of the row pairs. */
static __host__ __device__ __forceinline__ void prog_slice(int32_t rows, unsigned c, unsigned G, int32_t &lo,
                                                           int32_t &hi)
{
    int64_t pairs = rows / 2;
    lo = (int32_t)(2 * (pairs * c / G));
    hi = (int32_t)(2 * (pairs * (c + 1) / G));
}

static __device__ __forceinline__ void ldcg8(const float *p, float v[8])
{
    float4 a = __ldcg((const float4 *)p), b = __ldcg((const float4 *)p + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

static __device__ __forceinline__ void st8(float *p, const float v[8])
{
    ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

static __device__ __forceinline__ float act_gated_rt(int act, float g, float u)
{
    return act == LUMA_ACT_GELU ? act_gated<LUMA_ACT_GELU>(g, u) : act_gated<LUMA_ACT_SILU>(g, u);
}

/* The phase's activation row, quantized into s.q and s.ds (ACT_Q8_K, as
 * quantize_act writes them); NORM's output and the deferred gated
 * activation of the phase before written for this CTA's units (a unit:
 * 8 floats; CTA c takes the units u with u % G == c). A warp takes every
 * PROG_WARPS-th super-block of 256, a lane a unit of it; its next unit's
 * loads go out before the current one is quantized, and its first before
 * the norm's sum of squares, so that a norm costs one round trip to L2. */
static __device__ void prog_prologue(const prog_phase &ph, prog_smem &s, unsigned c, unsigned G)
{
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (ph.wb_gate)
        for (int u = (int)c + (int)G * tid; u < ph.wb_n / 8; u += (int)G * PROG_CONSUMERS) {
            float g[8], up[8];
            ldcg8(ph.wb_gate + 8 * u, g);
            ldcg8(ph.wb_up + 8 * u, up);
#pragma unroll
            for (int j = 0; j < 8; j++) g[j] = act_gated_rt(ph.wb_act, g[j], up[j]);
            st8(ph.wb_gate + 8 * u, g);
        }
    const int n = ph.cols, nsb = n / 256;
    float v[8], up[8] = { 0 };
    if (warp < nsb) {
        ldcg8(ph.x + 8 * (warp * 32 + lane), v);
        if (ph.pro == PROG_GATED) ldcg8(ph.g + 8 * (warp * 32 + lane), up);
    }
    float inv = 0.0f;
    if (ph.pro == PROG_NORM) {
        /* the sum of squares as rmsnorm_kernel and add_rmsnorm (ops.cu)
         * add it, over 256 threads: the same bits */
        float ss = 0.0f;
        if (tid < 256)
#pragma unroll 4
            for (int k = tid; k < n / 4; k += 256) {
                float4 x = __ldcg((const float4 *)ph.x + k);
                ss += fmaf(x.w, x.w, fmaf(x.z, x.z, fmaf(x.y, x.y, x.x * x.x)));
            }
        ss = warp_sum(ss);
        if (lane == 0) s.part[warp] = ss;
        team_barrier(1, PROG_CONSUMERS);
        ss = 0.0f;
        for (int w = 0; w < 8; w++) ss += s.part[w];
        inv = 1.0f / sqrtf(ss / (float)n + ph.eps);
    }
    for (int sb = warp; sb < nsb; sb += PROG_WARPS) {
        const int u = sb * 32 + lane, un = u + PROG_WARPS * 32;
        float nv[8], nup[8] = { 0 };
        if (sb + PROG_WARPS < nsb) {
            ldcg8(ph.x + 8 * un, nv);
            if (ph.pro == PROG_GATED) ldcg8(ph.g + 8 * un, nup);
        }
        if (ph.pro == PROG_NORM) {
            float4 g0 = __ldg((const float4 *)(ph.g + 8 * u)), g1 = __ldg((const float4 *)(ph.g + 8 * u) + 1);
            float g[8] = { g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w };
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = v[j] * inv * g[j];
            if (u % (int)G == (int)c) st8(ph.out + 8 * u, v);
        } else if (ph.pro == PROG_GATED) {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = act_gated_rt(ph.act, v[j], up[j]);
        }
        if (ph.n_w > 0) {
            int iq[8];
            float d = q8k_warp(v, lane, iq);
            int sum = quad_sum(iq);
            ((uint2 *)s.q)[u] = pack_q8(iq);
            if (lane % 4 == 0) s.ds[u / 4] = make_float2(d, d * (float)sum);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            v[j] = nv[j];
            up[j] = nup[j];
        }
    }
    team_barrier(1, PROG_CONSUMERS);
}

/* A lane group's sum over the first n blocks of a row's piece in a stage
 * (xb: the activation block of its first block), lane groups of 8 taking
 * every fourth block as mmv_direct's lanes do: over a whole row, the same
 * sums in the same order as the matrix-vector kernel's. */
template <class T>
static __device__ __forceinline__ float prog_acc(const uint8_t *piece, int n, int xb, const act_rows &a, float acc)
{
    static_assert(T::lpb == 8, "8 lanes a block");
    const int lane = threadIdx.x % 32, p = lane % 8;
#pragma unroll 4
    for (int ib = lane / 8; ib < n; ib += 4) {
        typename T::raw_t r;
        T::fetch(piece + (size_t)ib * T::bytes, p, r);
        typename T::w_t wv;
        T::decode(r, p, wv);
        typename T::x_t xv;
        T::loadx(a, 0, xb + ib, p, xv);
        acc += T::dot(wv, xv);
    }
    return acc;
}

/* The kernel. One CTA an SM. The producer warp walks the CTA's rows of
 * every weight of the program in order, in groups of PROG_WARPS rows, and
 * copies `slab` blocks of each row of a group into a stage of the ring
 * (a lane a row) until the group's rows are whole. Consumer warp w owns
 * row w of each group: it adds its pieces up stage after stage, releasing
 * each stage by an arrival (no wait for the other warps), then writes the
 * row: the residual add's x read when the row starts, a RoPE pair's two
 * rows meeting at a barrier of their two warps, the gated activation made
 * from the gate row the same lane wrote. */
static __global__ void __launch_bounds__(PROG_THREADS, 1) prog_kernel(const __grid_constant__ prog_params P)
{
    extern __shared__ __align__(128) uint8_t prog_raw[];
    prog_smem &s = *(prog_smem *)prog_raw;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned c = blockIdx.x, G = gridDim.x;
    if (tid == 0) {
        for (int i = 0; i < PROG_STAGES; i++) {
            mbar_init(&s.full[i]);
            mbar_init(&s.empty[i], PROG_WARPS);   /* an arrival a consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= PROG_CONSUMERS) {
        /* the producer: weights depend on nothing the step computes, so
         * it never waits for the consumers' phases, only for free stages */
        uint32_t k = 0;
        for (int pi = 0; pi < P.n; pi++) {
            long long cy_empty = 0;
            for (int i = 0; i < P.ph[pi].n_w; i++) {
                const prog_w &W = P.ph[pi].w[i];
                const int bb = W.row_bytes / W.nb;
                int32_t lo, hi;
                prog_slice(W.rows, c, G, lo, hi);
                for (int32_t g0 = lo; g0 < hi; g0 += PROG_WARPS) {
                    const int nr = min(PROG_WARPS, hi - g0);
                    for (int b0 = 0; b0 < W.nb; b0 += W.slab, k++) {
                        const uint32_t st = k % PROG_STAGES, piece = (uint32_t)(min(W.slab, W.nb - b0) * bb);
                        long long c0 = P.stats && lane == 0 ? clock64() : 0;
                        if (k >= PROG_STAGES) mbar_wait(&s.empty[st], (k / PROG_STAGES - 1) & 1);
                        if (P.stats && lane == 0) cy_empty += clock64() - c0;
                        if (lane == 0) mbar_expect(&s.full[st], piece * (uint32_t)nr);
                        __syncwarp();
                        if (lane < nr)
                            bulk_copy(s.ring[st] + (size_t)lane * W.slab * bb,
                                      W.w + (size_t)(g0 + lane) * W.row_bytes + (size_t)b0 * bb, piece, &s.full[st]);
                    }
                }
            }
            if (P.stats && lane == 0) atomicAdd(P.stats + PROG_STATS * pi + 7, (unsigned long long)cy_empty);
        }
        return;
    }
    const act_rows a = { (const int *)s.q, s.ds, NULL, 0, 0, 0 };
    uint32_t k = 0, groups = 0;
    for (int pi = 0; pi < P.n; pi++) {
        const prog_phase &ph = P.ph[pi];
        unsigned long long t0 = P.stats && tid == 0 ? prog_now() : 0, t1 = 0, t2 = 0;
        long long cy_wait = 0, cy_acc = 0, cy_epi = 0;
        if (pi == 0) wait_for_previous_kernel();
        else prog_grid_sync(P.bar, G);
        if (pi == P.n - 1) let_next_kernel_start();
        if (P.stats && tid == 0) t1 = prog_now();
        prog_prologue(ph, s, c, G);
        if (P.stats && tid == 0) t2 = prog_now();
        for (int i = 0; i < ph.n_w; i++) {
            const prog_w &W = ph.w[i];
            const int bb = W.row_bytes / W.nb;
            const bool gated = ph.gact && i == 1;   /* W.y: up; ph.w[0].y: the gate */
            int32_t lo, hi;
            prog_slice(W.rows, c, G, lo, hi);
            for (int32_t g0 = lo; g0 < hi; g0 += PROG_WARPS, groups++) {
                const int32_t r = g0 + warp;
                const bool mine = r < hi;
                float x0 = 0.0f, acc = 0.0f;
                if (mine && lane == 0) {
                    if (ph.resx) x0 = __ldcg(ph.resx + r);
                    if (gated) x0 = ph.w[0].y[r];   /* this lane wrote it */
                }
                for (int b0 = 0; b0 < W.nb; b0 += W.slab, k++) {
                    const int st = (int)(k % PROG_STAGES), n = min(W.slab, W.nb - b0);
                    long long c0 = P.stats && tid == 0 ? clock64() : 0;
                    mbar_wait(&s.full[st], (k / PROG_STAGES) & 1);
                    if (P.stats && tid == 0) {
                        long long c1 = clock64();
                        cy_wait += c1 - c0;
                        c0 = c1;
                    }
                    if (mine) {
                        const uint8_t *rp = s.ring[st] + (size_t)warp * W.slab * bb;
                        if (W.type == PROG_Q4_K) acc = prog_acc<type_q4_K>(rp, n, b0, a, acc);
                        else if (W.type == PROG_Q5_K) acc = prog_acc<type_q5_K>(rp, n, b0, a, acc);
                        else acc = prog_acc<type_q6_K_mmv>(rp, n, b0, a, acc);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&s.empty[st]);
                    if (P.stats && tid == 0) cy_acc += clock64() - c0;
                }
                if (!mine) continue;
                long long ce = P.stats && tid == 0 ? clock64() : 0;
                const float y = warp_sum(acc);
                if (W.rope) {
                    /* rows r (even warp) and r + 1 (groups hold whole
                     * pairs); the slot by the group's parity, so that the
                     * odd warp cannot overwrite it before it is read */
                    float *pair = s.pair[groups & 1];
                    if (lane == 0 && (warp & 1)) pair[warp] = y;
                    team_barrier(2 + warp / 2, 64);
                    if (lane == 0 && (warp & 1) == 0) {
                        int32_t e = r % P.ra.head_dim;
                        float ang = rope_angle(P.ra, (float)P.pos[0], e / 2), o0, o1;
                        rope_rotate(y, pair[warp + 1], sinf(ang), cosf(ang), o0, o1);
                        W.y[r] = o0;
                        W.y[r + 1] = o1;
                    }
                } else if (lane == 0) {
                    W.y[r] = y;
                    if (ph.resx) ph.resx[r] = x0 + y;
                    if (gated) ph.w[0].y[r] = act_gated_rt(ph.gact - 1, x0, y);
                }
                if (P.stats && tid == 0) cy_epi += clock64() - ce;
            }
        }
        if (P.stats && tid == 0) {
            unsigned long long *st = P.stats + PROG_STATS * pi, t3 = prog_now();
            atomicAdd(st, t1 - t0);
            atomicAdd(st + 1, t2 - t1);
            atomicAdd(st + 2, t3 - t2);
            atomicAdd(st + 3, 1ull);
            atomicAdd(st + 4, (unsigned long long)cy_wait);
            atomicAdd(st + 5, (unsigned long long)cy_acc);
            atomicAdd(st + 6, (unsigned long long)cy_epi);
        }
    }
}

bool luma_cuda_program_weight(const cuda_backend *c, const luma_weight *w, prog_w *pw)
{
    memset(pw, 0, sizeof *pw);
    if (w->cols % 256 != 0 || w->cols > PROG_MAX_COLS || w->rows % 2 != 0 || w->rows < 2) return false;
    if (w->type == LUMA_Q4_K) {
        pw->type = PROG_Q4_K;
        pw->w = mmv_bytes<type_q4_K>(w);
        pw->row_bytes = (int32_t)(w->cols / 256 * type_q4_K::bytes);
    } else if (w->type == LUMA_Q5_K) {
        pw->type = PROG_Q5_K;
        pw->w = mmv_bytes<type_q5_K>(w);
        pw->row_bytes = (int32_t)(w->cols / 256 * type_q5_K::bytes);
    } else if (w->type == LUMA_Q6_K && c->mmv_on && w->dev_mmv) {
        pw->type = PROG_Q6_K;
        pw->w = mmv_bytes<type_q6_K_mmv>(w);
        pw->row_bytes = (int32_t)(w->cols / 256 * type_q6_K_mmv::bytes);
    } else {
        return false;
    }
    if (!pw->w || ((uintptr_t)pw->w & 15) != 0) return false;
    pw->rows = (int32_t)w->rows;
    pw->nb = (int32_t)(w->cols / 256);
    /* a stage holds `slab` blocks of each of PROG_WARPS rows: a multiple
     * of 4 (the lane groups' stride), or the whole row */
    pw->slab = PROG_STAGE_BYTES / (PROG_WARPS * (pw->row_bytes / pw->nb)) / 4 * 4;
    if (pw->slab > pw->nb) pw->slab = pw->nb;
    return pw->slab > 0;
}

void luma_cuda_program_launch(cuda_backend *c, const prog_params *p)
{
    static bool attr_set;
    if (!attr_set) {
        if (luma_cuda_fail(c, cudaFuncSetAttribute(prog_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)sizeof(prog_smem)),
                           "program (shared memory)"))
            return;
        attr_set = true;
    }
    luma_launch(c, c->stream, (unsigned)c->n_sm, PROG_THREADS, sizeof(prog_smem), prog_kernel, *p);
    luma_cuda_fail(c, cudaGetLastError(), "program");
}
