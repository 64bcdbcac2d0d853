/* Tensor-core products on quantized weights: y[i] = W x[i] for the m
 * activation rows of a step, reading W's blocks (luma_weight.dev, as in the
 * file) rather than an f16 copy. cuda/NOTES.md ("Own tensor-core GEMM") has
 * the napkin math and the measurements behind luma_cuda_mmq's rule.
 *
 * Two routes, one kernel template:
 *   f16 route     the weights dequantized in registers to f16 and
 *                 multiplied with mma.sync.m16n8k16 (every format here);
 *   int8 route    (Q4_K, Q5_K, Q6_K) the weights' integers and the
 *                 activations' int8 values multiplied with
 *                 mma.sync.m16n8k32 (s8), each sub-block's integer sum then
 *                 scaled: nothing is dequantized, and the result is the CPU
 *                 backend's product but for the order of float sums.
 * On sm_90a, four wgmma kernels (sections below):
 *   q8g_kernel    Q4_K on the integer tensor cores, a superblock summed in
 *                 integers (the CPU's) and scaled once: chosen by the rule
 *                 at 17 to 64 activation rows;
 *   rs_kernel     Q4_K on the f16 tensor cores, the weights dequantized in
 *                 registers as wgmma's A operand: chosen by the rule for
 *                 tall weights at 17 to 128 rows, wide ones at 65 to 256,
 *                 and wide ones of many tiles (the downs) at 9 to 128 by
 *                 stream-K (tiles cut between all the CTAs the GPU holds,
 *                 partial tiles summed in a fixed order); two tall weights
 *                 of one x (gate and up) in one launch, each stage's
 *                 activations shared (luma_cuda_rs_pair);
 *   mmq_wg_kernel the f16 route with wgmma: measured, not chosen;
 *   g16_kernel    wgmma on a weight's resident f16 copy (the product cuBLAS
 *                 takes otherwise, matmul.cu): measured, not chosen.
 * Two kernels:
 *   quantize_act  (matmul.cu) the activations (m x cols, f32) to f16 in
 *                 scratch, as the cuBLAS path converts them (f16 route), or
 *                 to int8 with (d, d * sum) per 32 (int8 route): the values
 *                 of their 8-bit quantization in the CPU backend's format,
 *                 what the matrix-vector path multiplies too;
 *   mmq_kernel    one CTA of 8 warps computes a tile of 64 or 128 weight
 *                 rows x BM activation rows over a range of k. Each k-step
 *                 is 256 elements (one K super-block, or eight 32-blocks):
 *                 the tile's raw weight blocks and its f16 activations are
 *                 copied to shared memory with cp.async, up to 4 steps in
 *                 flight. Each warp owns 32 weight rows (two m16 tiles of
 *                 mma.sync.m16n8k16, f16 x f16 -> f32) and a share of each
 *                 k-step: its threads dequantize their own A-fragment
 *                 elements straight from the raw blocks into registers (f32
 *                 arithmetic as src/quant.c, rounded once to f16), so
 *                 dequantized weights never touch memory. B fragments come
 *                 from the shared activation tile.
 *
 * The k order inside an mma is free (the dot product does not care) as long
 * as A and B agree, so each 32-element group a of a k-step is laid over the
 * mma chunks 2a and 2a + 1 such that thread t of a quad (lane % 4) holds
 * elements 32a + 8t .. 32a + 8t + 7: chunk 2a gets the first four, chunk
 * 2a + 1 the last four, in the A slots (k = 2t, 2t + 1, 2t + 8, 2t + 9) of
 * m16n8k16. Those eight elements sit in one 8-byte piece of every block
 * format, and the matching activations are 16 contiguous bytes of the
 * natural f16 row: one shared-memory load gives the B fragments of both
 * chunks.
 *
 * Small m leaves few tiles (4096 rows are 64 tiles of 64), so k is split
 * over a cluster of up to 8 CTAs (gridDim.z) sized to fill the GPU; the
 * cluster's partial tiles meet in distributed shared memory and each CTA
 * sums a slice of the tile in the fixed order of the splits, so results do
 * not depend on timing. Every launch parameter depends on (m, rows, cols)
 * only, and nothing allocates or synchronizes once the scratch has grown:
 * the product can be recorded into a CUDA graph. */
#include "cuda_internal.h"
#include "blocks.cuh"
#include "launch.cuh"

#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>

LUMA_TRACE_TU(mmq)

namespace cg = cooperative_groups;

#define MMQ_THREADS 256         /* 8 warps */
#define MMQ_K 256               /* elements per k-step */
/* Shared memory a CTA may take so that two fit on an SM (228 KB, 1 KB of
 * which each CTA reserves). */
#define MMQ_SMEM_BUDGET (112 * 1024)
/* A CTA's first loads and final reduction, in k-steps, for choosing splits. */
#define MMQ_FILL 2
#define Q8G_LO 17          /* q8g_kernel's rule for Q4_K: m from Q8G_LO to Q8G_HI */
#define Q8G_HI 64
#define RS_TALL_LO 17       /* rs_kernel's rule (rs_wins) */
#define RS_TALL_HI 128
#define RS_WIDE_LO 65
#define RS_WIDE_HI 256
#define RS_SK_LO 9          /* wide weights of many tiles take rs_kernel's stream-K at this m ... */
#define RS_SK_HI 128        /* ... up to this one (rs_sk_fits) */
#define RS_SK_ROUNDS 4      /* a stream-K CTA's share: at least this many rounds */
#define G16_TALL_ROWS 8192 /* weights of this many rows take 128-row CTAs, the others 64 */
#define LOW4 0x0F0F0F0Fu
/* Bytes between the int8 activation rows of a k-step in shared memory:
 * 256 plus 16, so that the eight rows a quad's loads touch fall in
 * distinct banks. */
#define MMQ8_XROW 272

/* ---- small helpers (the shared ones are in blocks.cuh) ------------------- */

/* Eight bytes at a 2-aligned shared address (blocks of 34 and 210 bytes). */
static __device__ __forceinline__ uint2 ld8_a2(const uint8_t *p)
{
    const uint16_t *h = (const uint16_t *)p;
    return make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16, (uint32_t)h[2] | (uint32_t)h[3] << 16);
}

/* ---- block formats ----------------------------------------------------------
 *
 * One struct per weight type, describing a k-step's span of a weight row:
 *   span     bytes of the blocks that hold 256 elements;
 *   slot     bytes a row's span takes in shared memory: the span, its offset
 *            from 16-byte alignment (0 for spans that are multiples of 16 at
 *            16-aligned rows, at most 14 for Q6_K), rounded so that 8 rows
 *            of 8-byte reads spread over the banks (slot = 32 or 96 mod 128);
 *   off      the bias of the raw values;
 *   math     how the values are computed (deq_math);
 *   group(b, t, a, w0, w1, d, mn)
 *            elements 32a + 8t .. 32a + 8t + 7 of the span at b as eight
 *            biased bytes (w0: the first four, low byte first), their scale
 *            d and minimum mn: element = d * (byte - off) - mn, the value
 *            src/quant.c computes in f32, rounded once to f16. */

/* Each way below gives exactly quant.c's f32 result rounded to f16:
 *   DEQ_HALF  d * (byte - off), d an f16 and no minimum (Q4_0, Q5_0, Q8_0):
 *             the product has at most 19 significant bits, so f32 holds it
 *             exactly and one f16 multiplication (HMUL2, two values at
 *             once) rounds it the same way;
 *   DEQ_MUL   the same with d = f16 x int8 scale (Q6_K): still exact in
 *             f32, one FMUL, then rounded to f16;
 *   DEQ_FMA   d * byte - mn (Q4_K, Q5_K: d and mn are f16 x 6-bit): the
 *             product is exact in f32, so one fused multiply-add rounds
 *             like quant.c's multiply then subtract. */
enum deq_math { DEQ_HALF, DEQ_MUL, DEQ_FMA };

/* Q4_K: sub-block a is the low (a even) or high nibbles of qs[32 (a / 2) ..]. */
struct mmq_q4_K {
    static constexpr bool i8 = false;
    static constexpr int span = 144, slot = 160, off = 0, math = DEQ_FMA;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        uint4 hdr = *(const uint4 *)b;
        uint2 q = *(const uint2 *)(b + 16 + 32 * (a / 2) + 8 * t);
        int sh = 4 * (a % 2), sc, m;
        w0 = (q.x >> sh) & LOW4;
        w1 = (q.y >> sh) & LOW4;
        scale_min_k4(a, hdr.y, hdr.z, hdr.w, sc, m);
        d = __fmul_rn(f16_bits(hdr.x & 0xffff), (float)sc);
        mn = __fmul_rn(f16_bits(hdr.x >> 16), (float)m);
    }
};

/* Q5_K: Q4_K plus the fifth bit of element l of sub-block a: bit a of qh[l]. */
struct mmq_q5_K {
    static constexpr bool i8 = false;
    static constexpr int span = 176, slot = 224, off = 0, math = DEQ_FMA;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        uint4 hdr = *(const uint4 *)b;
        uint2 h = *(const uint2 *)(b + 16 + 8 * t);
        uint2 q = *(const uint2 *)(b + 48 + 32 * (a / 2) + 8 * t);
        int sh = 4 * (a % 2), sc, m;
        w0 = ((q.x >> sh) & LOW4) | ((h.x >> a) & 0x01010101u) << 4;
        w1 = ((q.y >> sh) & LOW4) | ((h.y >> a) & 0x01010101u) << 4;
        scale_min_k4(a, hdr.y, hdr.z, hdr.w, sc, m);
        d = __fmul_rn(f16_bits(hdr.x & 0xffff), (float)sc);
        mn = __fmul_rn(f16_bits(hdr.x >> 16), (float)m);
    }
};

/* Q6_K: group a = 4c + k holds elements 128c + 32k + l; low 4 bits in
 * ql[64c + 32 (k % 2) + l] (high nibble for k >= 2), top 2 bits at bit 2k
 * of qh[32c + l], scale scales[8c + 2k + l / 16] (l / 16 = t / 2 here). */
struct mmq_q6_K {
    static constexpr bool i8 = false;
    static constexpr int span = 210, slot = 224, off = 32, math = DEQ_MUL;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        int c = a / 4, k = a % 4;
        uint2 ql = ld8_a2(b + 64 * c + 32 * (k % 2) + 8 * t), qh = ld8_a2(b + 128 + 32 * c + 8 * t);
        int sl = 4 * (k / 2), sh = 2 * k;
        w0 = ((ql.x >> sl) & LOW4) | ((qh.x >> sh) & 0x03030303u) << 4;
        w1 = ((ql.y >> sl) & LOW4) | ((qh.y >> sh) & 0x03030303u) << 4;
        d = __fmul_rn(f16_bits(*(const uint16_t *)(b + 208)), (float)(int8_t)b[192 + 8 * c + 2 * k + t / 2]);
        mn = 0.0f;
    }
};

/* Q8_0: group a is block a (34 bytes); int8 values biased by 128. */
struct mmq_q8_0 {
    static constexpr bool i8 = false;
    static constexpr int span = 272, slot = 288, off = 128, math = DEQ_HALF;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        const uint8_t *blk = b + 34 * a;
        uint2 q = ld8_a2(blk + 2 + 8 * t);
        w0 = q.x ^ 0x80808080u;
        w1 = q.y ^ 0x80808080u;
        d = f16_bits(*(const uint16_t *)blk);
        mn = 0.0f;
    }
};

/* Q4_0: group a is block a (18 bytes): elements 0..15 the low nibbles of
 * qs[0..15], 16..31 the high ones. */
struct mmq_q4_0 {
    static constexpr bool i8 = false;
    static constexpr int span = 144, slot = 160, off = 8, math = DEQ_HALF;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        const uint8_t *blk = b + 18 * a;
        uint2 q = ld8_a2(blk + 2 + 8 * (t % 2));
        int sh = 4 * (t / 2);
        w0 = (q.x >> sh) & LOW4;
        w1 = (q.y >> sh) & LOW4;
        d = f16_bits(*(const uint16_t *)blk);
        mn = 0.0f;
    }
};

/* Q5_0: Q4_0 plus the fifth bit of element e: bit e of qh. */
struct mmq_q5_0 {
    static constexpr bool i8 = false;
    static constexpr int span = 176, slot = 224, off = 16, math = DEQ_HALF;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d, float &mn)
    {
        const uint8_t *blk = b + 22 * a;
        const uint16_t *h = (const uint16_t *)(blk + 2);
        uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 16;
        uint2 q = ld8_a2(blk + 6 + 8 * (t % 2));
        int sh = 4 * (t / 2);
        w0 = ((q.x >> sh) & LOW4) | bits4_to_bytes(qh >> (8 * t));
        w1 = ((q.y >> sh) & LOW4) | bits4_to_bytes(qh >> (8 * t + 4));
        d = f16_bits(*(const uint16_t *)blk);
        mn = 0.0f;
    }
};

/* Byte i of w (a value biased by T::off) as the float d * (byte - off) - mn
 * (DEQ_MUL, DEQ_FMA): 0x4B0000bb is the float 2^23 + bb, so one subtraction
 * gives byte - off exactly, with no integer-to-float conversion. */
template <class T>
static __device__ __forceinline__ float deq_byte(uint32_t w, int i, float d, float mn)
{
    float q = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + i)) - (8388608.0f + (float)T::off);
    return T::math == DEQ_FMA ? __fmaf_rn(d, q, -mn) : __fmul_rn(d, q);
}

/* Two values at once (DEQ_HALF): bytes sel & 0xF and sel >> 8 & 0xF of w
 * under 0x64 high bytes are the f16 pair 1024 + byte, minus 1024 + off
 * exactly, times d. */
template <class T>
static __device__ __forceinline__ uint32_t deq_half2(uint32_t w, uint32_t sel, __half2 d)
{
    uint32_t h = __byte_perm(w, 0x64646464u, sel);
    __half2 q = __hsub2(*(const __half2 *)&h, __float2half2_rn(1024.0f + (float)T::off));
    __half2 v = __hmul2(q, d);
    return *(const uint32_t *)&v;
}

/* The eight values of a group as the A-fragment registers of its two
 * chunks: a[0] = values 0, 1, a[1] = 2, 3 (chunk 2a); a[2], a[3] likewise
 * for values 4..7 (chunk 2a + 1). */
template <class T>
static __device__ __forceinline__ void deq_group(uint32_t w0, uint32_t w1, float d, float mn, uint32_t (&a)[4])
{
    if constexpr (T::math == DEQ_HALF) {
        __half2 d2 = __float2half2_rn(d);   /* d came from an f16: exact */
        a[0] = deq_half2<T>(w0, 0x4140, d2);
        a[1] = deq_half2<T>(w0, 0x4342, d2);
        a[2] = deq_half2<T>(w1, 0x4140, d2);
        a[3] = deq_half2<T>(w1, 0x4342, d2);
    } else {
        a[0] = pack_h2(deq_byte<T>(w0, 0, d, mn), deq_byte<T>(w0, 1, d, mn));
        a[1] = pack_h2(deq_byte<T>(w0, 2, d, mn), deq_byte<T>(w0, 3, d, mn));
        a[2] = pack_h2(deq_byte<T>(w1, 0, d, mn), deq_byte<T>(w1, 1, d, mn));
        a[3] = pack_h2(deq_byte<T>(w1, 2, d, mn), deq_byte<T>(w1, 3, d, mn));
    }
}

/* deq_group in f16 pairs for every format (the wgmma route): d (and mn)
 * rounded to f16 first, then one HMUL2 or HFMA2 per two values, so a value
 * can differ from quant.c's rounded once by an f16 ulp; a third of the
 * instructions of the f32 arithmetic, which bounds that route. */
template <class T>
static __device__ __forceinline__ void deq_group_h2(uint32_t w0, uint32_t w1, float d, float mn, uint32_t (&a)[4])
{
    if constexpr (T::math == DEQ_FMA) {
        __half2 d2 = __float2half2_rn(d), m2 = __float2half2_rn(-mn);
        const __half2 bias = __float2half2_rn(1024.0f + (float)T::off);
        const uint32_t sel[2] = { 0x4140, 0x4342 };
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t h = __byte_perm(i < 2 ? w0 : w1, 0x64646464u, sel[i % 2]);
            __half2 v = __hfma2(__hsub2(*(const __half2 *)&h, bias), d2, m2);
            a[i] = *(const uint32_t *)&v;
        }
    } else {
        __half2 d2 = __float2half2_rn(d);
        a[0] = deq_half2<T>(w0, 0x4140, d2);
        a[1] = deq_half2<T>(w0, 0x4342, d2);
        a[2] = deq_half2<T>(w1, 0x4140, d2);
        a[3] = deq_half2<T>(w1, 0x4342, d2);
    }
}

/* ---- the int8 route (K formats) ---------------------------------------------
 *
 * The weights' integer values meet the activations' int8 values (quantized
 * exactly as the CPU backend quantizes them: Q8_K super-blocks, one scale
 * per 256) in mma.sync.m16n8k32 (s8 x s8 -> s32): one mma per 32-element
 * sub-block and m16 x n8 tile, whose integer sum is then scaled by the
 * sub-block's weight scale. Nothing is dequantized; a thread unpacks its
 * A fragments with a shift and a mask per four weights.
 *
 * Thread t of a quad holds elements 4t .. 4t + 3 (w0) and 16 + 4t .. 16 +
 * 4t + 3 (w1) of a sub-block: the k slots of m16n8k32's A fragment in their
 * natural order, and the B fragment is the same two 4-byte pieces of the
 * activation row. Q6_K's sub-blocks of 16 (each with its own scale) are two
 * m16n8k16 products over w0 and w1.
 *
 *   group(b, t, a, w0, w1, d0, d1, mn)
 *            sub-block a of the span at b: the eight values as signed
 *            bytes, the scales of their two halves (d0, d1: equal but for
 *            Q6_K) and the minimum (element = d * q - mn). */
struct mmq8_q4_K {
    static constexpr int span = 144, slot = 160;
    static constexpr bool i8 = true, k16 = false, has_min = true;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d0, float &d1, float &mn)
    {
        uint4 hdr = *(const uint4 *)b;
        const uint8_t *qs = b + 16 + 32 * (a / 2);
        int sh = 4 * (a % 2), sc, m;
        w0 = (*(const uint32_t *)(qs + 4 * t) >> sh) & LOW4;
        w1 = (*(const uint32_t *)(qs + 16 + 4 * t) >> sh) & LOW4;
        scale_min_k4(a, hdr.y, hdr.z, hdr.w, sc, m);
        d0 = d1 = f16_bits(hdr.x & 0xffff) * (float)sc;
        mn = f16_bits(hdr.x >> 16) * (float)m;
    }
};

struct mmq8_q5_K {
    static constexpr int span = 176, slot = 224;
    static constexpr bool i8 = true, k16 = false, has_min = true;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d0, float &d1, float &mn)
    {
        uint4 hdr = *(const uint4 *)b;
        const uint8_t *qs = b + 48 + 32 * (a / 2);
        uint32_t h0 = *(const uint32_t *)(b + 16 + 4 * t), h1 = *(const uint32_t *)(b + 32 + 4 * t);
        int sh = 4 * (a % 2), sc, m;
        w0 = ((*(const uint32_t *)(qs + 4 * t) >> sh) & LOW4) | ((h0 >> a) & 0x01010101u) << 4;
        w1 = ((*(const uint32_t *)(qs + 16 + 4 * t) >> sh) & LOW4) | ((h1 >> a) & 0x01010101u) << 4;
        scale_min_k4(a, hdr.y, hdr.z, hdr.w, sc, m);
        d0 = d1 = f16_bits(hdr.x & 0xffff) * (float)sc;
        mn = f16_bits(hdr.x >> 16) * (float)m;
    }
};

/* Four bytes at a 2-aligned shared address. */
static __device__ __forceinline__ uint32_t ld4_a2(const uint8_t *p)
{
    const uint16_t *h = (const uint16_t *)p;
    return (uint32_t)h[0] | (uint32_t)h[1] << 16;
}

struct mmq8_q6_K {
    static constexpr int span = 210, slot = 224;
    static constexpr bool i8 = true, k16 = true, has_min = false;
    static __device__ __forceinline__ void group(const uint8_t *b, int t, int a, uint32_t &w0, uint32_t &w1,
                                                 float &d0, float &d1, float &mn)
    {
        int c = a / 4, k = a % 4, sl = 4 * (k / 2), sh = 2 * k;
        const uint8_t *ql = b + 64 * c + 32 * (k % 2) + 4 * t, *qh = b + 128 + 32 * c + 4 * t;
        uint32_t lo0 = ld4_a2(ql), lo1 = ld4_a2(ql + 16), hi0 = ld4_a2(qh), hi1 = ld4_a2(qh + 16);
        w0 = __vsub4(((lo0 >> sl) & LOW4) | ((hi0 >> sh) & 0x03030303u) << 4, 0x20202020u);
        w1 = __vsub4(((lo1 >> sl) & LOW4) | ((hi1 >> sh) & 0x03030303u) << 4, 0x20202020u);
        float d = f16_bits(*(const uint16_t *)(b + 208));
        d0 = d * (float)(int8_t)b[192 + 8 * c + 2 * k];
        d1 = d * (float)(int8_t)b[193 + 8 * c + 2 * k];
        mn = 0.0f;
    }
};

/* ---- the GEMM kernel ------------------------------------------------------- */

/* A CTA's 8 warps: rw along the weight rows (32 rows each) times kw along
 * a k-step's eight groups (8 / kw groups each), so that every warp has a
 * short stretch of dequantization and the SM many warps to hide its
 * latency. Small activation tiles take 64 rows per CTA (more tiles for the
 * GPU), larger ones 128 (fewer activation reads per weight row). The kw
 * partial results are added in a fixed order at the end. */
template <int BM>
struct mmq_warps {
    static constexpr int rw = BM <= 32 ? 2 : 4;
    static constexpr int kw = 8 / rw;
    static constexpr int rows = 32 * rw;          /* weight rows per CTA */
    static constexpr int row_threads = 32 * rw;   /* threads of one k-warp set */
    /* two CTAs per SM (registers capped at 128) while the accumulators are small */
    static constexpr int min_ctas = BM <= 32 ? 2 : 1;
};

/* Shared memory of one pipeline stage: the tile's raw spans, then BM rows
 * of 256 f16 activations (512 bytes each, their 16-byte pieces swizzled by
 * row parity so that a quad's loads of rows g and g + 1 use all banks).
 * After the main loop the same memory holds the partial results. */
template <class T, int BM>
struct mmq_shape {
    typedef mmq_warps<BM> W;
    static constexpr int raw = W::rows * T::slot;
    /* f16 activations, or (int8 route) the int8 rows (MMQ8_XROW bytes
     * apart) and then their (d, d * sum) per 32, as [8 groups][BM] */
    static constexpr int xt = T::i8 ? BM * (MMQ8_XROW + 64) : BM * MMQ_K * 2;
    static constexpr int stage = raw + xt;
    static constexpr int budget = W::min_ctas == 2 ? MMQ_SMEM_BUDGET : 2 * MMQ_SMEM_BUDGET;
    static constexpr int stages = 4 * stage <= budget ? 4 : 3 * stage <= budget ? 3 : 2;
    static constexpr int smem = stages * stage;
    static_assert((W::kw - 1) * W::row_threads * BM * 4 <= smem, "the partial results fit");
};

/* What a CTA needs to find its data. */
struct mmq_args {
    const uint8_t *w;           /* the weight rows, row_bytes apart */
    const uint8_t *w_end;       /* one past the last weight byte */
    size_t row_bytes;
    int64_t rows, m, cols;
    int nkb;                    /* k-steps per row: cols / 256 */
    const __half *xh;           /* m x cols */
    const int8_t *xq;           /* the int8 route: m x cols */
    const float2 *xds;          /* and (d, d * sum) per 32 of them */
    float *y;                   /* m x rows */
    float *y2;                  /* rs_kernel's pairs: the second weight's m x rows */
    /* rs_kernel's stream-K (sk CTAs; 0: the grid's tiles and splits): a
     * partial tile of each CTA, and a flag each that says it is written */
    int sk;
    float *part;
    int32_t *flags;
};

/* Where row rr of the tile's k-step kb starts in global memory. */
template <class T>
static __device__ __forceinline__ const uint8_t *span_at(const mmq_args &p, int64_t r0, int rr, int kb)
{
    int64_t r = r0 + rr < p.rows ? r0 + rr : p.rows - 1;   /* rows past the end repeat the last */
    return p.w + (size_t)r * p.row_bytes + (size_t)kb * T::span;
}

/* Queues the raw spans of k-step kb: 16-byte pieces from the span's
 * aligned start, the last one clipped at the end of the weights. Spans of
 * whole 16-byte pieces start aligned (16-aligned weights, rows of whole
 * spans) and are copied as they are. */
template <class T, int ROWS>
static __device__ __forceinline__ void load_raw(uint8_t *dst, const mmq_args &p, int64_t r0, int kb)
{
    constexpr bool aligned = T::span % 16 == 0;
    constexpr int pieces = aligned ? T::span / 16 : T::slot / 16;
    for (int i = threadIdx.x; i < ROWS * pieces; i += MMQ_THREADS) {
        int rr = i / pieces, k = i % pieces;
        const uint8_t *span = span_at<T>(p, r0, rr, kb);
        if (aligned) {
            cp_async16_n(dst + rr * T::slot + 16 * k, span + 16 * k, 16);
            continue;
        }
        const uint8_t *src = (const uint8_t *)((uintptr_t)span & ~(uintptr_t)15) + 16 * k;
        if (src < span + T::span) {
            ptrdiff_t left = p.w_end - src;
            cp_async16_n(dst + rr * T::slot + 16 * k, src, left < 16 ? (int)left : 16);
        }
    }
}

/* Queues the activations of k-step kb, rows n0 .. n0 + BM - 1 (zeros past m). */
template <int BM>
static __device__ __forceinline__ void load_x(uint8_t *dst, const mmq_args &p, int64_t n0, int kb)
{
    for (int i = threadIdx.x; i < BM * 32; i += MMQ_THREADS) {
        int nn = i / 32, k = i % 32;
        int64_t n = n0 + nn < p.m ? n0 + nn : p.m - 1;
        const __half *src = p.xh + n * p.cols + (int64_t)kb * MMQ_K + 8 * k;
        cp_async16_n(dst + nn * 512 + ((k ^ ((nn & 1) << 2)) * 16), src, n0 + nn < p.m ? 16 : 0);
    }
}

static __device__ __forceinline__ void cp_async8(void *dst, const void *src, int src_bytes)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}

/* The int8 route's activations of k-step kb, rows n0 .. n0 + BM - 1: 16
 * pieces of 16 bytes a row, then the eight (d, d * sum) of each row into
 * the transposed table (zeros past m: no contribution). */
template <int BM>
static __device__ __forceinline__ void load_x8(uint8_t *dst, const mmq_args &p, int64_t n0, int kb)
{
    for (int i = threadIdx.x; i < BM * 16; i += MMQ_THREADS) {
        int nn = i / 16, k = i % 16;
        int64_t n = n0 + nn < p.m ? n0 + nn : p.m - 1;
        cp_async16_n(dst + nn * MMQ8_XROW + 16 * k, p.xq + n * p.cols + (int64_t)kb * MMQ_K + 16 * k,
                   n0 + nn < p.m ? 16 : 0);
    }
    uint8_t *ds = dst + BM * MMQ8_XROW;
    for (int i = threadIdx.x; i < BM * 8; i += MMQ_THREADS) {
        int nn = i / 8, a = i % 8;
        int64_t n = n0 + nn < p.m ? n0 + nn : p.m - 1;
        cp_async8(ds + (a * BM + nn) * 8, p.xds + n * (p.cols / 32) + (int64_t)kb * 8 + a, n0 + nn < p.m ? 8 : 0);
    }
}

/* Queues the activations of k-step kb in the form T's route reads. */
template <class T, int BM>
static __device__ __forceinline__ void load_act(uint8_t *dst, const mmq_args &p, int64_t n0, int kb)
{
    if constexpr (T::i8) load_x8<BM>(dst, p, n0, kb);
    else load_x<BM>(dst, p, n0, kb);
}

/* Where the thread (g = lane / 4) of row warp rw finds its four weight
 * rows (g, g + 8, g + 16, g + 24 of the warp) in the stage: each row's
 * slot, past the span's offset from 16-byte alignment. */
template <class T>
static __device__ __forceinline__ void thread_spans(const uint8_t *stage, const mmq_args &p, int64_t r0, int kb,
                                                    int rw, int g, const uint8_t *(&blk)[4])
{
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int rr = rw * 32 + g + 8 * q;
        blk[q] = stage + rr * T::slot + (T::span % 16 == 0 ? 0 : (uintptr_t)span_at<T>(p, r0, rr, kb) & 15);
    }
}

/* acc += this warp's share of the stage's k-step: its 32 weight rows, the
 * groups a of k-warp KW, the BM activation rows. Thread (g = lane / 4,
 * t = lane % 4) dequantizes rows g, g + 8, g + 16, g + 24 of the warp,
 * elements 32a + 8t .. + 7 of each group. */
template <class T, int BM, int KW>
static __device__ __forceinline__ void mma_groups(const uint8_t *stage, const mmq_args &p, int64_t r0, int kb,
                                                  float (&acc)[2][BM / 8][4])
{
    typedef mmq_warps<BM> W;
    constexpr int groups = 8 / W::kw, a0 = KW * groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int rw = warp % W::rw;
    const uint8_t *blk[4];
    thread_spans<T>(stage, p, r0, kb, rw, g, blk);
    const uint8_t *xs = stage + mmq_shape<T, BM>::raw;
#pragma unroll
    for (int ai = 0; ai < groups; ai++) {
        const int a = a0 + ai;
        uint32_t af[2][2][4];   /* [m16 tile][chunk 2a + u][register] */
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint32_t w0, w1;
            float d, mn;
            uint32_t v[4];
            T::group(blk[q], t, a, w0, w1, d, mn);
            deq_group<T>(w0, w1, d, mn, v);
            int mt = q / 2, h = q % 2;
            af[mt][0][h] = v[0];
            af[mt][0][2 + h] = v[1];
            af[mt][1][h] = v[2];
            af[mt][1][2 + h] = v[3];
        }
#pragma unroll
        for (int nt = 0; nt < BM / 8; nt++) {
            uint4 b = *(const uint4 *)(xs + (8 * nt + g) * 512 + (((4 * a + t) ^ ((g & 1) << 2)) * 16));
            mma16816(acc[0][nt], af[0][0], b.x, b.y);
            mma16816(acc[1][nt], af[1][0], b.x, b.y);
            mma16816(acc[0][nt], af[0][1], b.z, b.w);
            mma16816(acc[1][nt], af[1][1], b.z, b.w);
        }
    }
}

/* The int8 route's share of a k-step: per sub-block a of k-warp KW, the
 * products of every m16 x n8 tile are issued first (independent mmas in
 * flight), then each integer sum is scaled by its weight row's scale times
 * its activation column's d, and the minimum term (-mn x the activations'
 * d * sum) subtracted. Q6_K's two halves take two k16 mmas a tile. */
template <class T, int BM, int KW>
static __device__ __forceinline__ void mma_groups8(const uint8_t *stage, const mmq_args &p, int64_t r0, int kb,
                                                   float (&acc)[2][BM / 8][4])
{
    typedef mmq_warps<BM> W;
    constexpr int groups = 8 / W::kw, a0 = KW * groups, NT = BM / 8, H = T::k16 ? 2 : 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int rw = warp % W::rw;
    const uint8_t *blk[4];
    thread_spans<T>(stage, p, r0, kb, rw, g, blk);
    const uint8_t *xs = stage + mmq_shape<T, BM>::raw;
    const float4 *ds = (const float4 *)(xs + BM * MMQ8_XROW);   /* [a][BM / 2]: columns 2j, 2j + 1 */
#pragma unroll
    for (int ai = 0; ai < groups; ai++) {
        const int a = a0 + ai;
        uint32_t af[2][4];
        float d0[4], d1[4], mn[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint32_t w0, w1;
            T::group(blk[q], t, a, w0, w1, d0[q], d1[q], mn[q]);
            af[q / 2][q % 2] = w0;
            af[q / 2][2 + q % 2] = w1;
        }
        int c[NT][2][H][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint8_t *xr = xs + (8 * nt + g) * MMQ8_XROW + 32 * a + 4 * t;
            uint32_t b0 = *(const uint32_t *)xr, b1 = *(const uint32_t *)(xr + 16);
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                for (int h = 0; h < H; h++) c[nt][mt][h][0] = c[nt][mt][h][1] = c[nt][mt][h][2] = c[nt][mt][h][3] = 0;
                if constexpr (T::k16) {
                    mma_s8_k16(c[nt][mt][0], af[mt][0], af[mt][1], b0);
                    mma_s8_k16(c[nt][mt][H - 1], af[mt][2], af[mt][3], b1);
                } else {
                    mma_s8_k32(c[nt][mt][0], af[mt], b0, b1);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float4 dd = ds[(a * BM + 8 * nt + 2 * t) / 2];   /* (d, d * sum) of columns 2t, 2t + 1 */
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int q = 2 * mt + i / 2;
                    float dx = i % 2 ? dd.z : dd.x, v = acc[mt][nt][i];
                    v = __fmaf_rn(d0[q] * dx, i2f(c[nt][mt][0][i]), v);
                    if constexpr (T::k16) v = __fmaf_rn(d1[q] * dx, i2f(c[nt][mt][H - 1][i]), v);
                    if constexpr (T::has_min) v = __fmaf_rn(-mn[q], i % 2 ? dd.w : dd.y, v);
                    acc[mt][nt][i] = v;
                }
        }
    }
}

/* One k-warp's share of a k-step on the route of T. */
template <class T, int BM, int KW>
static __device__ __forceinline__ void mma_share(const uint8_t *stage, const mmq_args &p, int64_t r0, int kb,
                                                 float (&acc)[2][BM / 8][4])
{
    if constexpr (T::i8) mma_groups8<T, BM, KW>(stage, p, r0, kb, acc);
    else mma_groups<T, BM, KW>(stage, p, r0, kb, acc);
}

/* The warp's k-warp index as a compile-time constant, so that every group
 * number, shift and scale index in the dequantization is one. */
template <class T, int BM>
static __device__ __forceinline__ void mma_step(const uint8_t *stage, const mmq_args &p, int64_t r0, int kb,
                                                float (&acc)[2][BM / 8][4])
{
    typedef mmq_warps<BM> W;
    switch (threadIdx.x / 32 / W::rw) {
    case 0: mma_share<T, BM, 0>(stage, p, r0, kb, acc); break;
    case 1: mma_share<T, BM, 1>(stage, p, r0, kb, acc); break;
    case 2: if (W::kw > 2) mma_share<T, BM, 2 % W::kw>(stage, p, r0, kb, acc); break;
    default: if (W::kw > 3) mma_share<T, BM, 3 % W::kw>(stage, p, r0, kb, acc); break;
    }
}

/* The output of accumulator (mt, nt, c) of row thread th (= row warp * 32
 * + lane): its weight row and activation row inside the tile. */
static __device__ __forceinline__ void acc_at(int th, int mt, int nt, int c, int &rr, int &nn)
{
    int warp = th / 32, g = th % 32 / 4, t = th % 4;
    rr = warp * 32 + 16 * mt + g + 8 * (c / 2);
    nn = 8 * nt + 2 * t + c % 2;
}

/* y[n0 + nn][r0 + rr] = v inside the product. */
static __device__ __forceinline__ void store_y(const mmq_args &p, int64_t r0, int64_t n0, int rr, int nn, float v)
{
    if (r0 + rr < p.rows && n0 + nn < p.m) p.y[(n0 + nn) * p.rows + r0 + rr] = v;
}

/* Split k: every CTA of the cluster has put its partial tile in red, the
 * same units float4s in the same order; rank r sums its slice of them over
 * all CTAs in rank order (so the bits do not depend on timing) and hands
 * each sum to out(u, sum). Returns once no CTA reads another's red. */
template <class F>
static __device__ __forceinline__ void cluster_sum_slices(float *red, int units, int splits, int nthreads, F out)
{
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int rank = (int)cluster.block_rank();
    const int u1 = (rank + 1) * units / splits;
    for (int u = rank * units / splits + (int)threadIdx.x; u < u1; u += nthreads) {
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int k = 0; k < splits; k++) {
            float4 v = ((const float4 *)cluster.map_shared_rank(red, k))[u];
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        out(u, sum);
    }
    cluster.sync();   /* no CTA leaves while another still reads its memory */
}

/* Grid: (activation tiles, weight-row tiles, splits of k); the splits of a
 * tile form one cluster. */
template <class T, int BM>
static __global__ void __launch_bounds__(MMQ_THREADS, mmq_warps<BM>::min_ctas) mmq_kernel(mmq_args p)
{
    typedef mmq_shape<T, BM> S;
    typedef mmq_warps<BM> W;
    constexpr int E = BM;   /* accumulators per thread: 2 m16 tiles x BM / 8 n8 tiles x 4 */
    extern __shared__ __align__(16) uint8_t smem[];
    const int64_t n0 = (int64_t)blockIdx.x * BM, r0 = (int64_t)blockIdx.y * W::rows;
    const int splits = gridDim.z, split = blockIdx.z;
    const int kb0 = (int)((int64_t)split * p.nkb / splits), kb1 = (int)((int64_t)(split + 1) * p.nkb / splits);
    const int nk = kb1 - kb0;

    /* The weights do not depend on the previous kernel: their first stages
     * are fetched before waiting for it. The first commit group then holds
     * all of them with stage 0's activations. */
    for (int s = 0; s < S::stages - 1; s++)
        if (s < nk) load_raw<T, W::rows>(smem + s * S::stage, p, r0, kb0 + s);
    wait_for_previous_kernel();
    for (int s = 0; s < S::stages - 1; s++) {
        if (s < nk) {
            load_act<T, BM>(smem + s * S::stage + S::raw, p, n0, kb0 + s);
        }
        cp_async_commit();
    }

    float acc[2][BM / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < BM / 8; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[mt][nt][c] = 0.0f;

    for (int i = 0; i < nk; i++) {
        cp_async_wait<S::stages - 2>();
        __syncthreads();   /* step i has landed, and every warp is done with step i - 1's buffer */
        int next = i + S::stages - 1;
        if (next < nk) {
            uint8_t *st = smem + (next % S::stages) * S::stage;
            load_raw<T, W::rows>(st, p, r0, kb0 + next);
            load_act<T, BM>(st + S::raw, p, n0, kb0 + next);
        }
        cp_async_commit();
        mma_step<T, BM>(smem + (i % S::stages) * S::stage, p, r0, kb0 + i, acc);
    }

    /* The k-warps' partial results meet in shared memory as
     * red[k-warp - 1][e][row thread], e = (mt, nt, c); k-warp 0 adds them
     * to its own in k-warp order. */
    cp_async_wait<0>();
    __syncthreads();
    float *red = (float *)smem;
    const int kw = threadIdx.x / W::row_threads, th = threadIdx.x % W::row_threads;
    if (kw > 0)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < BM / 8; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    red[((kw - 1) * E + (mt * (BM / 8) + nt) * 4 + c) * W::row_threads + th] = acc[mt][nt][c];
    __syncthreads();
    if (kw == 0)
        for (int k = 1; k < W::kw; k++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < BM / 8; nt++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        acc[mt][nt][c] += red[((k - 1) * E + (mt * (BM / 8) + nt) * 4 + c) * W::row_threads + th];

    if (splits == 1) {
        if (kw == 0)
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < BM / 8; nt++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        int rr, nn;
                        acc_at(th, mt, nt, c, rr, nn);
                        store_y(p, r0, n0, rr, nn, acc[mt][nt][c]);
                    }
        return;
    }

    /* Split k: the CTA's tile goes to red[e][row thread]; rank k of the
     * cluster then sums its slice of every CTA's red, in rank order. */
    __syncthreads();
    if (kw == 0)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < BM / 8; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) red[((mt * (BM / 8) + nt) * 4 + c) * W::row_threads + th] = acc[mt][nt][c];
    cluster_sum_slices(red, W::row_threads * E / 4, splits, MMQ_THREADS, [&](int u, float4 sum) {
        /* the four floats are row threads 4j .. 4j + 3 of one element e:
         * one quad, t = 0..3 */
        int e = 4 * u / W::row_threads, th0 = 4 * u % W::row_threads;
        int c = e % 4, nt = e / 4 % (BM / 8), mt = e / 4 / (BM / 8);
        float s[4] = { sum.x, sum.y, sum.z, sum.w };
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int rr, nn;
            acc_at(th0 + j, mt, nt, c, rr, nn);
            store_y(p, r0, n0, rr, nn, s[j]);
        }
    });
}

/* ---- the wgmma route (sm_90a) -------------------------------------------------
 *
 * Hopper's warpgroup MMA (wgmma.mma_async) on weights dequantized in
 * shared memory, for batched decode (m of 33 to 128). A CTA of four
 * warpgroups owns 128 weight rows x BN activation rows (BN = 64 or 128)
 * over its range of k, in stages of 64 k (four per 256-k step):
 *   producers  (warpgroups 2 and 3): one thread has the tensor memory
 *              accelerator copy each 256-k step's raw blocks (one step
 *              ahead) and each stage's f16 activations (quantize_act's
 *              output, the CPU's 8-bit values; two stages ahead) into
 *              shared memory, through 2-D tensor maps, completion counted
 *              in bytes on mbarriers; all of them dequantize a stage's
 *              128 x 64 weights to f16 (T::group, deq_group_h2: within an
 *              f16 ulp of quant.c's values) into its A tile;
 *   consumers  (warpgroups 0 and 1, 64 rows each: wgmma's M) wait for a
 *              stage, issue its four k16 wgmmas (both operands from shared
 *              memory, f32 accumulators in registers) and release the stage
 *              once the next stage's are issued and it is done.
 * MMQ_WG_STAGES buffers; named barriers (ids MMQ_WG_BAR_*) carry "A full"
 * (producers arrive, consumers wait) and "stage empty" (the reverse), an
 * mbarrier per buffer "B landed". The copies are the async proxy's, so
 * the proxy fence each producer needs before wgmma reads its A writes does
 * not wait for them (it did with cp.async: cuda/NOTES.md).
 *
 * Checked against the CPU like the other routes (test_cuda_mmq, policy 3),
 * but slower than cuBLAS on the resident f16 copy on the H100 (cuda/NOTES.md,
 * "The wgmma route"): the producers, not the tensor cores, set its pace, so
 * the rule does not choose it; LUMA_CUDA_WG_LO=n makes it take m > n, for
 * measuring.
 *
 * Both tiles use wgmma's canonical K-major layout without swizzling: 8 x 8
 * core matrices of 128 contiguous bytes (8 rows x 16 bytes of k), a k16
 * chunk's two k halves MMQ_WG_LBO bytes apart, consecutive groups of 8
 * rows MMQ_WG_SBO apart, chunks 16 x rows bytes apart. T::group gives a
 * thread elements 32a + 8t .. + 7 of a row in order: exactly one 16-byte
 * core-matrix row (chunk 2a + t / 2, half t % 2), so k keeps its natural
 * order. B is as the copies land it: boxes of 8 k x BN rows, each BN x 16
 * contiguous bytes (its own LBO BN x 16 and SBO 128). */
#define MMQ_WG_ROWS 128       /* weight rows per CTA: two consumer warpgroups */
#define MMQ_WG_THREADS 512    /* two consumer and two producer warpgroups */
#define MMQ_WG_PRODUCERS 256
#define MMQ_WG_K 64           /* k per stage */
#define MMQ_WG_STAGES 4       /* B is copied two stages ahead of its use */
#define MMQ_WG_LBO 128        /* bytes between the k halves of a chunk */
#define MMQ_WG_SBO 256        /* bytes between groups of 8 rows */
#define MMQ_WG_BAR_FULL 1     /* + stage buffer: the stage's tiles are ready */
#define MMQ_WG_BAR_EMPTY 5    /* + stage buffer: the consumers are done with it */
#define MMQ_WG_BAR_PROD 9     /* the producers among themselves */

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MMQ_WG_DEVICE 1
#endif

/* Shared memory: MMQ_WG_STAGES stages of (A: 128 rows, B: BN rows) x 64 k
 * of f16, then two 256-k steps of raw spans. After the main loop the
 * partial results (split k) use the stages. */
template <class T, int BN>
struct mmq_wg_shape {
    static constexpr int a = MMQ_WG_ROWS * MMQ_WG_K * 2;
    static constexpr int b = BN * MMQ_WG_K * 2;
    static constexpr int stage = a + b;
    static constexpr int raw = MMQ_WG_ROWS * T::slot;
    static constexpr int smem = MMQ_WG_STAGES * stage + 2 * raw + 8 * (MMQ_WG_STAGES + 2);   /* + mbarriers */
    static_assert(MMQ_WG_ROWS * BN * 2 <= MMQ_WG_STAGES * stage, "the partial tile fits");
};

#ifdef MMQ_WG_DEVICE
static __device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t lbo = MMQ_WG_LBO, uint32_t sbo = MMQ_WG_SBO)
{
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32;
}

/* A 2-D box of tensor map m at (c0, c1) into shared memory at dst. */
static __device__ __forceinline__ void tma_2d(void *dst, const CUtensorMap *m, int c0, int c1, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"((uint64_t)m), "r"(c0), "r"(c1),
                 "r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
}

static __device__ __forceinline__ void bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

static __device__ __forceinline__ void bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])

/* d += A B for one k16 chunk, A (64 x 16) at da, B (16 x BN) at db; d is
 * the warpgroup's 64 x BN tile, BN / 2 floats a thread. */
static __device__ __forceinline__ void wg_mma(float (&d)[64], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"
                 " %64, %65, p, 1, 1, 0, 0;\n}"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
                 : "l"(da), "l"(db));
}

static __device__ __forceinline__ void wg_mma(float (&d)[32], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
                 " %32, %33, p, 1, 1, 0, 0;\n}"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
                 : "l"(da), "l"(db));
}
#undef WG_D8

template <int E>
static __device__ __forceinline__ void wg_pin(float (&d)[E])
{
#pragma unroll
    for (int i = 0; i < E; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* The output of accumulator e of consumer thread th (warp w = th / 32):
 * its weight row and activation row inside the CTA's tile (wgmma's D
 * fragment: n8 chunk e / 4, rows g and g + 8 of the warp's 16). */
static __device__ __forceinline__ void wg_acc_at(int th, int e, int &rr, int &nn)
{
    int warp = th / 32, g = th % 32 / 4, t = th % 4;
    rr = 16 * warp + g + 8 * (e % 4 / 2);
    nn = 8 * (e / 4) + 2 * t + e % 2;
}

/* The end of a wgmma kernel, after a __syncthreads that follows the last
 * wgmma: the C consumer threads (0 .. C - 1, consumer true) hold E
 * accumulators each in wgmma's D order, which go to y; with split k they
 * first go to red[e][thread] in the CTA's shared memory at smem, and rank k
 * of the cluster sums its slice of every CTA's red, in rank order (the same
 * bits every time). nthreads: the CTA's threads, all of which call this. */
template <int E, int C>
static __device__ __forceinline__ void wg_tile_out(const mmq_args &p, int64_t r0, int64_t n0, const float (&acc)[E],
                                                   bool consumer, int splits, uint8_t *smem, int nthreads)
{
    const int th = threadIdx.x;
    if (splits == 1) {
        if (consumer)
#pragma unroll
            for (int e = 0; e < E; e++) {
                int rr, nn;
                wg_acc_at(th, e, rr, nn);
                store_y(p, r0, n0, rr, nn, acc[e]);
            }
        return;
    }
    float *red = (float *)smem;
    if (consumer)
#pragma unroll
        for (int e = 0; e < E; e++) red[e * C + th] = acc[e];
    cluster_sum_slices(red, C * E / 4, splits, nthreads, [&](int u, float4 sum) {
        int e = 4 * u / C, th0 = 4 * u % C;
        float s4[4] = { sum.x, sum.y, sum.z, sum.w };
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int rr, nn;
            wg_acc_at(th0 + j, e, rr, nn);
            store_y(p, r0, n0, rr, nn, s4[j]);
        }
    });
}

#endif

/* Grid: (activation tiles, weight-row tiles, splits of k); the splits of a
 * tile form one cluster, reduced as in mmq_kernel. */
template <class T, int BN>
static __global__ void __launch_bounds__(MMQ_WG_THREADS, 1)
    mmq_wg_kernel(mmq_args p, const __grid_constant__ CUtensorMap tmx, const __grid_constant__ CUtensorMap tmw)
{
#ifdef MMQ_WG_DEVICE
    typedef mmq_wg_shape<T, BN> S;
    constexpr int E = BN / 2;   /* accumulators per consumer thread */
    constexpr int ALL = MMQ_WG_THREADS;
    extern __shared__ __align__(128) uint8_t wsmem[];
    uint8_t *const smem = wsmem;   /* 128-aligned: the copies' destinations */
    uint8_t *raw = smem + MMQ_WG_STAGES * S::stage;
    uint64_t *bfull = (uint64_t *)(raw + 2 * S::raw), *rfull = bfull + MMQ_WG_STAGES;
    const int64_t n0 = (int64_t)blockIdx.x * BN, r0 = (int64_t)blockIdx.y * MMQ_WG_ROWS;
    const int splits = gridDim.z, split = blockIdx.z;
    const int kb0 = (int)((int64_t)split * p.nkb / splits), kb1 = (int)((int64_t)(split + 1) * p.nkb / splits);
    const int nst = (kb1 - kb0) * (MMQ_K / MMQ_WG_K);   /* stages: four per 256-k step */
    /* the warpgroup index read through a shuffle is one the compiler knows
     * to be warp-uniform: the consumers' wgmmas are then not in a divergent
     * path, which ptxas would serialize (C7518) */
    const bool producer = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) >= (ALL - MMQ_WG_PRODUCERS) / 128;
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.0f;
    if (threadIdx.x == 0) {
        for (int i = 0; i < MMQ_WG_STAGES; i++) mbar_init(&bfull[i], 1);
        for (int i = 0; i < 2; i++) mbar_init(&rfull[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (producer) {
        /* Iteration st: once the consumers are done with stage st - 2,
         * copy B(st + 2) into its buffer and, at a step's first stage, the
         * next step's raw spans (both by the tensor memory accelerator, one
         * thread issuing, completion counted in bytes on an mbarrier: the
         * async proxy, so no copy is waited for by the proxy fence below);
         * dequantize stage st's A and mark the stage full. */
        const int pt = threadIdx.x - (ALL - MMQ_WG_PRODUCERS);
        const int rr = pt / 2, tp = pt % 2;   /* weight row; its pieces t = 2 tp, 2 tp + 1 of each 32-group */
        auto copy_b = [&](int s_) {
            uint8_t *b_t = smem + (s_ % MMQ_WG_STAGES) * S::stage + S::a;
            mbar_expect(&bfull[s_ % MMQ_WG_STAGES], BN * MMQ_WG_K * 2);
            for (int g = 0; g < MMQ_WG_K / 8; g++)
                tma_2d(b_t + g * (BN * 16), &tmx, kb0 * MMQ_K + s_ * MMQ_WG_K + 8 * g, (int)n0, &bfull[s_ % MMQ_WG_STAGES]);
        };
        /* a box starts 16-byte aligned: a span that does not (Q6_K's 210
         * bytes) lands (kb span) % 16 bytes into its slot, which has room */
        auto copy_raw = [&](int j_) {
            mbar_expect(&rfull[j_ % 2], MMQ_WG_ROWS * T::slot);
            tma_2d(raw + (j_ % 2) * S::raw, &tmw, ((kb0 + j_) * T::span) & ~15, (int)r0, &rfull[j_ % 2]);
        };
        if (pt == 0 && nst > 0) copy_raw(0);   /* the weights do not depend on the previous kernel */
        wait_for_previous_kernel();
        if (pt == 0) {
            if (nst > 0) copy_b(0);
            if (nst > 1) copy_b(1);
        }
        for (int j = 0; j < nst / 4; j++) {
            const uint8_t *blk = raw + (j % 2) * S::raw + rr * T::slot + (((kb0 + j) * T::span) & 15);
#pragma unroll
            for (int sub = 0; sub < 4; sub++) {
                const int st = 4 * j + sub;
                if (st + 2 < nst) {
                    if (st >= 2) bar_sync(MMQ_WG_BAR_EMPTY + (st + 2) % MMQ_WG_STAGES, ALL);
                    if (pt == 0) copy_b(st + 2);
                }
                if (sub == 0) {
                    if (pt == 0 && j + 1 < nst / 4) copy_raw(j + 1);   /* its buffer's readers met at the last PROD */
                    mbar_wait(&rfull[j % 2], (j / 2) & 1);
                }
                uint8_t *a_t = smem + (st % MMQ_WG_STAGES) * S::stage + (rr / 8) * MMQ_WG_SBO + (rr % 8) * 16;
                /* Every read of the stage's blocks before any write of its
                 * tile: the compiler cannot tell the two apart, and a store
                 * between them would order each piece's loads after the
                 * previous piece's store (and reload the header). */
                uint32_t w0[4], w1[4], v[4][4];
                float d[4], mn[4];
#pragma unroll
                for (int k = 0; k < 4; k++)   /* a = 2 sub + k / 2 (compile-time: constant scale shifts), t = 2 tp + k % 2 */
                    T::group(blk, 2 * tp + k % 2, 2 * sub + k / 2, w0[k], w1[k], d[k], mn[k]);
#pragma unroll
                for (int k = 0; k < 4; k++) deq_group_h2<T>(w0[k], w1[k], d[k], mn[k], v[k]);
#pragma unroll
                for (int k = 0; k < 4; k++)
                    *(uint4 *)(a_t + (2 * (k / 2) + tp) * (MMQ_WG_ROWS * 32) + (k % 2) * MMQ_WG_LBO) =
                        make_uint4(v[k][0], v[k][1], v[k][2], v[k][3]);
                /* the shared-memory writes are the generic proxy's; wgmma reads through the async proxy */
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                if (sub == 3) bar_sync(MMQ_WG_BAR_PROD, MMQ_WG_PRODUCERS);   /* all done reading step j's spans */
                bar_arrive(MMQ_WG_BAR_FULL + st % MMQ_WG_STAGES, ALL);
            }
        }
    } else {
        const int wg = threadIdx.x / 128;
        for (int st = 0; st < nst; st++) {
            const uint8_t *a_t = smem + (st % MMQ_WG_STAGES) * S::stage + wg * (64 / 8) * MMQ_WG_SBO;
            const uint8_t *b_t = smem + (st % MMQ_WG_STAGES) * S::stage + S::a;
            bar_sync(MMQ_WG_BAR_FULL + st % MMQ_WG_STAGES, ALL);
            mbar_wait(&bfull[st % MMQ_WG_STAGES], (st / MMQ_WG_STAGES) & 1);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
            /* B as the copies land it: 8-k groups BN x 16 bytes apart, rows 16 */
#pragma unroll
            for (int c = 0; c < MMQ_WG_K / 16; c++)
                wg_mma(acc, wg_desc(a_t + c * (MMQ_WG_ROWS * 32)), wg_desc(b_t + c * (BN * 32), BN * 16, 128));
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            /* stage st - 1 is done: its buffer goes back to the producers,
             * who wait for stages up to nst - 5 */
            if (st >= 1 && st - 1 <= nst - 5) bar_arrive(MMQ_WG_BAR_EMPTY + (st - 1) % MMQ_WG_STAGES, ALL);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        wg_pin(acc);
    }

    __syncthreads();
    wg_tile_out<E, ALL - MMQ_WG_PRODUCERS>(p, r0, n0, acc, !producer, splits, smem, ALL);
#endif
}

/* ---- host side ---------------------------------------------------------------- */

/* How many CTAs, and clusters of 2, 4 and 8 CTAs, of one kernel fit on the
 * GPU at once, found at its first launch on a device (after raising its
 * shared-memory limit there: the limit belongs to the device's context). */
typedef struct mmq_fit {
    uint64_t ready;            /* devices (bit = ordinal) set up */
    int clusters[4];           /* [log2 of the cluster size]; [0]: single CTAs */
} mmq_fit;

static const mmq_fit *mmq_setup_kernel(cuda_backend *c, mmq_fit *fit, const void *fn, int smem, int threads)
{
    uint64_t bit = c->device < 64 ? (uint64_t)1 << c->device : 0;
    if (bit && (fit->ready & bit)) return fit;
    int per_sm = 0;
    if (luma_cuda_fail(c, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                       "matmul (mmq shared memory limit)") ||
        luma_cuda_fail(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, (size_t)smem),
                       "matmul (mmq occupancy)"))
        return NULL;
    fit->clusters[0] = per_sm * c->n_sm;
    for (int l = 1; l < 4; l++) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr;
        cfg.gridDim = dim3(1, 1, 1u << l);
        cfg.blockDim = dim3((unsigned)threads);
        cfg.dynamicSmemBytes = (size_t)smem;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = 1;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1u << l;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int n = 0;
        if (luma_cuda_fail(c, cudaOccupancyMaxActiveClusters(&n, fn, &cfg), "matmul (mmq cluster occupancy)"))
            return NULL;
        fit->clusters[l] = n;
    }
    fit->ready |= bit;
    return fit;
}

/* The splits of k (1, 2, 4, 8: the portable cluster size) with the least
 * estimated time: waves of clusters x (k-steps per CTA + MMQ_FILL). */
static int mmq_splits(const mmq_fit *fit, int64_t tiles, int nkb)
{
    int best = 1;
    int64_t best_cost = INT64_MAX;
    for (int l = 0; l < 4; l++) {
        int s = 1 << l;
        if (s > nkb || fit->clusters[l] <= 0) continue;
        int64_t waves = (tiles + fit->clusters[l] - 1) / fit->clusters[l];
        int64_t cost = waves * ((nkb + s - 1) / s + MMQ_FILL);
        if (cost < best_cost) {
            best = s;
            best_cost = cost;
        }
    }
    return best;
}

/* The activations as a kernel reads them: f16 values, or int8 values with
 * (d, d * sum) per 32 (the int8 route). */
struct mmq_x {
    const __half *xh;
    const int8_t *xq;
    const float2 *xds;
};

/* The kernel's arguments for y = W x over m activation rows at xh. */
static mmq_args mmq_args_for(const luma_weight *w, const mmq_x &x, int64_t m, float *y)
{
    mmq_args p;
    p.row_bytes = luma_row_size(w->type, w->cols);
    p.w = (const uint8_t *)w->dev;
    p.w_end = p.w + p.row_bytes * (size_t)w->rows;
    p.rows = w->rows;
    p.m = m;
    p.cols = w->cols;
    p.nkb = (int)(w->cols / MMQ_K);
    p.xh = x.xh;
    p.xq = x.xq;
    p.xds = x.xds;
    p.y = y;
    p.y2 = NULL;
    p.sk = 0;
    p.part = NULL;
    p.flags = NULL;
    return p;
}

/* Queues kernel fn (mmq_kernel or mmq_wg_kernel) on n_tiles x row_tiles
 * tiles, k split over clusters as mmq_splits chooses; or, for rs_kernel's
 * stream-K (p.sk), on p.sk CTAs. */
template <typename... A>
static void mmq_queue(cuda_backend *c, void (*fn)(mmq_args, A...), const mmq_fit *fit, const mmq_args &p,
                      int64_t n_tiles, int64_t row_tiles, int smem, int threads, A... more)
{
    int splits = p.sk ? 1 : mmq_splits(fit, n_tiles * row_tiles, p.nkb);
    dim3 grid = p.sk ? dim3((unsigned)p.sk) : dim3((unsigned)n_tiles, (unsigned)row_tiles, (unsigned)splits);
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, c->stream, grid, (unsigned)threads, smem, attr);
    if (splits > 1) {
        cudaLaunchAttribute &cl = attr[cfg.numAttrs++];
        cl.id = cudaLaunchAttributeClusterDimension;
        cl.val.clusterDim.x = 1;
        cl.val.clusterDim.y = 1;
        cl.val.clusterDim.z = (unsigned)splits;
    }
    luma_cuda_fail(c, cudaLaunchKernelEx(&cfg, fn, p, more...), "matmul (mmq kernel)");
}

template <class T, int BM>
static void mmq_launch(cuda_backend *c, const luma_weight *w, const mmq_x &x, int64_t m, float *y)
{
    typedef mmq_warps<BM> W;
    static mmq_fit fit;
    const int smem = mmq_shape<T, BM>::smem;
    if (!mmq_setup_kernel(c, &fit, (const void *)mmq_kernel<T, BM>, smem, MMQ_THREADS)) return;
    mmq_queue(c, mmq_kernel<T, BM>, &fit, mmq_args_for(w, x, m, y), (m + BM - 1) / BM,
              (w->rows + W::rows - 1) / W::rows, smem, MMQ_THREADS);
}

/* cuTensorMapEncodeTiled from the driver, found once (NULL when absent). */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static bool looked;
    if (!looked) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) ==
                cudaSuccess && q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
        cudaGetLastError();
        looked = true;
    }
    return fn;
}

/* A 2-D tensor map over rows x cols elements of type t (row stride
 * row_bytes) read in boxes of bc x br; false when the driver declines. */
static bool tensor_map_2d(CUtensorMap *m, CUtensorMapDataType t, const void *base, uint64_t cols, uint64_t rows,
                          uint64_t row_bytes, uint32_t bc, uint32_t br,
                          CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE)
{
    PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
    if (!enc) return false;
    cuuint64_t dims[2] = { cols, rows }, strides[1] = { row_bytes };
    cuuint32_t box[2] = { bc, br }, es[2] = { 1, 1 };
    return enc(m, t, 2, (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
               CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Whether the wgmma route can copy this weight's spans as boxes: rows of
 * whole 16-byte units, a slot of at most 256 bytes (a box's limit). */
template <class T>
static bool mmq_wg_fits(const luma_weight *w)
{
    return T::slot <= 256 && luma_row_size(w->type, w->cols) % 16 == 0 && w->rows <= INT32_MAX &&
           w->cols <= INT32_MAX;
}

/* The wgmma route: x quantized to f16 as for the other routes (in
 * scratch), tensor maps over it and over the weight, then the kernel.
 * False (nothing queued) where the route cannot take the product. */
template <class T, int BN>
static bool mmq_wg_launch(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    static mmq_fit fit;
    const int smem = mmq_wg_shape<T, BN>::smem;
    if (!mmq_wg_fits<T>(w) || m > INT32_MAX) return false;
    size_t bytes;
    if (luma_mul_size((size_t)m, (size_t)w->cols * sizeof(__half), &bytes)) return false;
    __half *xh = (__half *)luma_cuda_scratch(c, bytes);
    if (!xh) return true;
    CUtensorMap tmx, tmw;
    size_t row_bytes = luma_row_size(w->type, w->cols);
    if (!tensor_map_2d(&tmx, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, xh, (uint64_t)w->cols, (uint64_t)m,
                       (uint64_t)w->cols * sizeof(__half), 8, BN) ||
        !tensor_map_2d(&tmw, CU_TENSOR_MAP_DATA_TYPE_UINT8, w->dev, row_bytes, (uint64_t)w->rows, row_bytes, T::slot,
                       MMQ_WG_ROWS))
        return false;
    if (!mmq_setup_kernel(c, &fit, (const void *)mmq_wg_kernel<T, BN>, smem, MMQ_WG_THREADS)) return true;
    luma_cuda_quantize_act(c, w->type, x, m * w->cols, NULL, NULL, xh);
    mmq_x xa = { xh, NULL, NULL };
    if (LUMA_CUDA_OK(c))
        mmq_queue(c, mmq_wg_kernel<T, BN>, &fit, mmq_args_for(w, xa, m, y), (m + BN - 1) / BN,
                  (w->rows + MMQ_WG_ROWS - 1) / MMQ_WG_ROWS, smem, MMQ_WG_THREADS, tmx, tmw);
    return true;
}

template <class T>
static bool mmq_wg_run(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    return m <= 64 ? mmq_wg_launch<T, 64>(c, w, x, m, y) : mmq_wg_launch<T, 128>(c, w, x, m, y);
}

/* ---- f16 weights on the tensor cores: the resident copies (sm_90a) ------------
 *
 * y = W x on a weight's resident f16 copy for batched decode, the product
 * cuBLAS takes otherwise (matmul.cu, tensor_gemm), on the same operands:
 * the f16 copy and the activations' f16 (tensor_act). At m <= 256 the
 * product is bound by reading the copy, so the kernel is arranged around
 * the copies: a CTA owns 64 NW weight rows (NW consumer warpgroups of 64
 * rows, wgmma's M) x BN activation rows over its range of k, in stages of
 * 64 k:
 *   producer   (the last warp): one thread has the tensor memory
 *              accelerator copy each stage's A (64 NW rows x 64 k) and B
 *              (BN x 64 k) into a ring of S::stages buffers, 128-byte
 *              swizzled (a box row is one 128-byte line, which wgmma reads
 *              through descriptors in the same swizzle mode), completion
 *              counted in bytes on the buffer's "full" mbarrier; the
 *              weights of the first stages are asked for before the wait on
 *              the previous kernel (they do not depend on it);
 *   consumers  wait for a stage, issue its four k16 wgmmas (both operands
 *              in shared memory, f32 accumulators) and, once the next
 *              stage's are issued and this stage's are done, arrive on its
 *              "empty" mbarrier, which the producer waits for before it
 *              reuses the buffer.
 * Small row counts split k over a cluster, reduced as in mmq_kernel
 * (partial tiles added in rank order: the same bits every time).
 *
 * Measured on the H100 (cuda/NOTES.md, "f16 wgmma on the resident
 * copies"): 0.9-1.07x cuBLAS, 2.0-2.45 TB/s at m = 16 to 128, like cuBLAS;
 * the 7B's aggregate decode was 1-3% slower with it. So the rule does not
 * take it; LUMA_CUDA_G16=lo,hi in the environment makes it take m from lo
 * to hi, for measuring. */
#define G16_K 64              /* k per stage: one 128-byte line of f16 */
#define G16_SMEM_CAP (200 * 1024)

template <int NW, int BN>
struct g16_shape {
    static constexpr int threads = 128 * NW + 32;   /* NW consumer warpgroups and a producer warp */
    static constexpr int rows = 64 * NW;
    static constexpr int a = rows * G16_K * 2;
    static constexpr int b = BN * G16_K * 2;
    static constexpr int stage = a + b;
    static constexpr int stages = (G16_SMEM_CAP - 1024) / (stage + 16);
    static constexpr int smem = 1024 + stages * (stage + 16);   /* + alignment to 1024 and the mbarriers */
    static_assert(rows * BN * 4 <= stages * stage, "the partial tile fits");
    static_assert(rows <= 256 && BN <= 256, "one box a stage and operand");
    static_assert(stages >= 2, "a consumer frees a stage only after issuing the next one's products");
};

#ifdef MMQ_WG_DEVICE
/* A wgmma descriptor for a K-major tile at shared address a whose rows are
 * 128-byte lines swizzled in 1024-byte groups of 8 rows (the tile starts on
 * 1024 bytes; a k16 chunk c of the line starts at a + 32 c). */
static __device__ __forceinline__ uint64_t g16_desc(uint32_t a)
{
    return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

static __device__ __forceinline__ void mbar_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"((uint32_t)__cvta_generic_to_shared(b)) : "memory");
}

/* The copy ring of a kernel with one producer thread (g16_kernel,
 * q8g_kernel): STAGES buffers of STAGE bytes from the first 1024-byte
 * boundary of the dynamic shared memory dyn (the swizzled copies need it),
 * a "full" and an "empty" mbarrier for each after them (the empty ones
 * completing on empty_arrivals arrivals), and this CTA's share [st0, st0 +
 * nst) of the nkb stages (its split of k: blockIdx.z of gridDim.z), in
 * whole units of `unit` stages (nkb a multiple of it); or, made with
 * wg_stages, nst stages that the kernel maps to its data itself
 * (rs_kernel's stream-K). Every thread of the CTA makes it; the mbarriers
 * are ready when it returns. */
struct wg_stages {
    int nst;
};

template <int STAGES, int STAGE>
struct wg_ring {
    uint8_t *smem;
    uint32_t sbase;
    uint64_t *full, *empty;
    int st0, nst;

    __device__ __forceinline__ wg_ring(uint8_t *dyn, int nkb, int empty_arrivals, int unit = 1)
    {
        const int splits = gridDim.z, split = blockIdx.z, nu = nkb / unit;
        const int lo = unit * (int)((int64_t)split * nu / splits);
        init(dyn, lo, unit * (int)((int64_t)(split + 1) * nu / splits) - lo, empty_arrivals);
    }

    /* The same ring over nst stages that the kernel maps itself (st0 0). */
    __device__ __forceinline__ wg_ring(uint8_t *dyn, int empty_arrivals, wg_stages n)
    {
        init(dyn, 0, n.nst, empty_arrivals);
    }

    __device__ __forceinline__ void init(uint8_t *dyn, int st0_, int nst_, int empty_arrivals)
    {
        smem = dyn + ((1024 - ((uint32_t)__cvta_generic_to_shared(dyn) & 1023)) & 1023);
        sbase = (uint32_t)__cvta_generic_to_shared(smem);
        full = (uint64_t *)(smem + STAGES * STAGE);
        empty = full + STAGES;
        st0 = st0_;
        nst = nst_;
        if (threadIdx.x == 0) {
            for (int i = 0; i < STAGES; i++) {
                mbar_init(&full[i], 1);
                mbar_init(&empty[i], empty_arrivals);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }

    /* The producer thread's loop. The weights of the first stages go before
     * the wait on the previous kernel (no kernel of a step writes them);
     * then stage by stage: once the consumers have given its buffer back,
     * the weights, then the activations. bytes: what one stage's copies
     * bring in all; weights(st, buf, bar) and acts(st, buf, bar) queue the
     * copies of stage st0 + st into buffer buf, completing on bar. */
    template <class W, class A>
    __device__ __forceinline__ void produce(uint32_t bytes, W weights, A acts) const
    {
        const int pre = nst < STAGES ? nst : STAGES;
        for (int st = 0; st < pre; st++) {
            mbar_expect(&full[st], bytes);
            weights(st, smem + st * STAGE, &full[st]);
        }
        wait_for_previous_kernel();
        let_next_kernel_start();
        for (int st = 0; st < nst; st++) {
            const int s = st % STAGES;
            uint8_t *buf = smem + s * STAGE;
            if (st >= STAGES) {
                mbar_wait(&empty[s], (st / STAGES + 1) & 1);
                mbar_expect(&full[s], bytes);
                weights(st, buf, &full[s]);
            }
            acts(st, buf, &full[s]);
        }
    }
};

#endif

/* Grid: (activation tiles, weight-row tiles, splits of k); p.nkb counts
 * stages of G16_K. */
template <int NW, int BN>
static __global__ void __launch_bounds__(128 * NW + 32, 1)
    g16_kernel(mmq_args p, const __grid_constant__ CUtensorMap tmw, const __grid_constant__ CUtensorMap tmx)
{
#ifdef MMQ_WG_DEVICE
    typedef g16_shape<NW, BN> S;
    constexpr int E = BN / 2;
    extern __shared__ uint8_t gsmem[];
    const wg_ring<S::stages, S::stage> ring(gsmem, p.nkb, NW);
    const int64_t n0 = (int64_t)blockIdx.x * BN, r0 = (int64_t)blockIdx.y * S::rows;
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0);   /* warp-uniform to the compiler */
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.0f;

    if (warp == 4 * NW) {
        if (threadIdx.x == 128 * NW)
            ring.produce(
                S::stage,
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    tma_2d(buf, &tmw, (ring.st0 + st) * G16_K, (int)r0, bar);
                },
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    tma_2d(buf + S::a, &tmx, (ring.st0 + st) * G16_K, (int)n0, bar);
                });
    } else {
        wait_for_previous_kernel();   /* before the stores: the kernel before may read y */
        const uint32_t a_wg = ring.sbase + (uint32_t)(warp / 4) * 64 * 128;
        for (int st = 0; st < ring.nst; st++) {
            const int s = st % S::stages;
            const uint32_t a = a_wg + (uint32_t)(s * S::stage), b = ring.sbase + (uint32_t)(s * S::stage + S::a);
            mbar_wait(&ring.full[s], (st / S::stages) & 1);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int c = 0; c < G16_K / 16; c++) wg_mma(acc, g16_desc(a + 32 * c), g16_desc(b + 32 * c));
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            if (st >= 1 && threadIdx.x % 128 == 0) mbar_arrive(&ring.empty[(st - 1) % S::stages]);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        wg_pin(acc);
    }

    __syncthreads();
    /* every copy landed (each full mbarrier was waited for) and every
     * wgmma is done: the ring may hold the partial tile */
    wg_tile_out<E, 128 * NW>(p, r0, n0, acc, warp < 4 * NW, gridDim.z, ring.smem, S::threads);
#endif
}

/* y = W x through g16_kernel<NW, BN> on the f16 copy wh and the
 * activations' f16 xh; false (nothing queued) when the driver declines the
 * tensor maps. */
template <int NW, int BN>
static bool g16_launch(cuda_backend *c, const luma_weight *w, const __half *wh, const __half *xh, int64_t m, float *y)
{
    typedef g16_shape<NW, BN> S;
    static mmq_fit fit;
    CUtensorMap tmw, tmx;
    const uint64_t cols = (uint64_t)w->cols;
    if (!tensor_map_2d(&tmw, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, wh, cols, (uint64_t)w->rows, cols * 2, G16_K, S::rows,
                       CU_TENSOR_MAP_SWIZZLE_128B) ||
        !tensor_map_2d(&tmx, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, xh, cols, (uint64_t)m, cols * 2, G16_K, BN,
                       CU_TENSOR_MAP_SWIZZLE_128B))
        return false;
    if (!mmq_setup_kernel(c, &fit, (const void *)g16_kernel<NW, BN>, S::smem, S::threads)) return true;
    mmq_args p = mmq_args_for(w, mmq_x{}, m, y);
    p.nkb = (int)(w->cols / G16_K);   /* stages of 64 k, not k-steps */
    mmq_queue(c, g16_kernel<NW, BN>, &fit, p, (m + BN - 1) / BN, (w->rows + S::rows - 1) / S::rows, S::smem,
              S::threads, tmw, tmx);
    return true;
}

/* Which products g16 takes under policy 0: none, unless LUMA_CUDA_G16=lo,hi
 * in the environment gives a range of m (above). */
static bool g16_wins(int64_t m)
{
    static env_rows env;
    return env_rows_set(env, "LUMA_CUDA_G16") && m >= env.lo && m <= env.hi;
}

bool luma_cuda_g16_takes(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    if (!c->wgmma || c->g16_policy < 0 || (c->g16_policy == 0 && !g16_wins(m))) return false;
    return w->cols % G16_K == 0 && w->cols <= INT32_MAX && w->rows <= INT32_MAX && m <= INT32_MAX;
}

bool luma_cuda_g16(cuda_backend *c, const luma_weight *w, const __half *wh, const __half *xh, int64_t m, float *y)
{
    if (!luma_cuda_g16_takes(c, w, m)) return false;
    /* 128-row CTAs (two consumer warpgroups) for tall weights; 64-row ones
     * (one) below G16_TALL_ROWS rows, so that 4096 rows make 64 tiles that
     * split k in pairs: 128 CTAs, one wave */
    if (w->rows >= G16_TALL_ROWS)
        return m <= 64 ? g16_launch<2, 64>(c, w, wh, xh, m, y) : g16_launch<2, 128>(c, w, wh, xh, m, y);
    return m <= 64 ? g16_launch<1, 64>(c, w, wh, xh, m, y) : g16_launch<1, 128>(c, w, wh, xh, m, y);
}

extern "C" void luma_cuda_g16_policy(luma_backend *be, int policy)
{
    ((cuda_backend *)be)->g16_policy = policy < 0 ? -1 : policy > 1 ? 1 : policy;
}

/* ---- Q4_K on the integer tensor cores (sm_90a) ---------------------------------
 *
 * y = W x straight from Q4_K blocks and the activations' int8 values (one
 * scale per 256, Q8_K as on the CPU: quantize_act's int8 output), by
 * wgmma .s8: a superblock of 256 k sums in integers. With the 6-bit scale
 * of sub-block s split as sc = 8 sh + sl (sh, sl < 8), sh q and sl q are
 * below 106 and fit int8, so three chains per superblock give, exactly,
 *   H = sum_k sh q x,  L = sum_k sl q x,  M = sum_k m x
 * (M's operand is the sub-block's minimum in every column), and the
 * superblock adds d_x (d (8 H + L) - dmin M) to the f32 result: the CPU's
 * integers, scaled once per 256 k.
 *
 * A CTA owns 64 NW weight rows (NW consumer warpgroups of 64, wgmma's M) x
 * Q8G_BN activation rows over its range of k, a superblock a stage:
 *   producer   (the last warp): one thread has the tensor memory
 *              accelerator copy each stage's raw Q4_K blocks (64 NW rows x
 *              144 bytes), its int8 activations (Q8G_BN rows x 256, two
 *              128-byte swizzled lines) and their (d, d sum) pairs into a
 *              ring of buffers, completion in bytes on "full" mbarriers;
 *   consumers  make their A operands in registers from the raw blocks (a
 *              thread holds rows g and g + 8 of its warp's 16, k 4t .. 4t +
 *              3 and 16 + 4t .. of each 32: the mma.m16n8k32 order), issue
 *              the three chains' wgmmas a sub-block at a time (two register
 *              sets, so a set is rewritten only once its wgmmas are done),
 *              then scale the superblock's sums into f32; each warp then
 *              gives the buffer back on its "empty" mbarrier (one arrival
 *              a warp: the warps read the raw blocks and scales
 *              themselves, and drift apart after their last wgmma).
 * Small row counts split k over a cluster, reduced as in mmq_kernel. */
#define Q8G_BN 64
#define Q8G_SPAN 144   /* a Q4_K block */
#define Q8G_SMEM_CAP (110 * 1024)   /* two CTAs an SM */

template <int NW>
struct q8g_shape {
    static constexpr int threads = 128 * NW + 32;
    static constexpr int rows = 64 * NW;
    static constexpr int b = Q8G_BN * MMQ_K;        /* two 128-byte lines a row, first (1024-aligned) */
    static constexpr int raw = rows * Q8G_SPAN;
    static constexpr int ds = Q8G_BN * 64;          /* 8 (d, d sum) pairs a row */
    static constexpr int stage = (b + raw + ds + 1023) / 1024 * 1024;
    static constexpr int stages = (Q8G_SMEM_CAP - 1024) / (stage + 16);
    static constexpr int smem = 1024 + stages * (stage + 16);
    static_assert(rows * Q8G_BN * 4 <= stages * stage, "the partial tile fits");
    static_assert(stages >= 2, "a stage is given back after the next one's products");
};

#ifdef MMQ_WG_DEVICE
#define WG_R8(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), \
                 "+r"(d[i + 6]), "+r"(d[i + 7])
/* d (+)= A B for one k32 chunk: A (64 x 32 int8) in registers, B (32 x 64)
 * at descriptor db; d starts over when first. */
static __device__ __forceinline__ void wg_mma_s8(int (&d)[32], const uint32_t (&a)[4], uint64_t db, bool first)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
                 " {%32,%33,%34,%35}, %36, p;\n}"
                 : WG_R8(0), WG_R8(8), WG_R8(16), WG_R8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"((uint32_t)first));
}
#undef WG_R8

/* Keeps r's value live up to here: a register that a wgmma still reads
 * must not be reused before the wait that says it is done. */
template <int E>
static __device__ __forceinline__ void keep_regs(uint32_t (&r)[E])
{
#pragma unroll
    for (int i = 0; i < E; i++) asm volatile("" : "+r"(r[i])::"memory");
}

template <int E>
static __device__ __forceinline__ void keep_regs(int (&r)[E])
{
#pragma unroll
    for (int i = 0; i < E; i++) asm volatile("" : "+r"(r[i])::"memory");
}
#endif

/* Grid: (activation tiles, weight-row tiles, splits of k); p.nkb counts
 * superblocks. */
template <int NW, int DEPTH>
static __global__ void __launch_bounds__(128 * NW + 32, 1)
    q8g_kernel(mmq_args p, const __grid_constant__ CUtensorMap tmw, const __grid_constant__ CUtensorMap tmx,
               const __grid_constant__ CUtensorMap tmd)
{
#ifdef MMQ_WG_DEVICE
    typedef q8g_shape<NW> S;
    constexpr int E = Q8G_BN / 2;
    extern __shared__ uint8_t qsmem[];
    /* every consumer warp gives a stage back: each reads it itself */
    const wg_ring<S::stages, S::stage> ring(qsmem, p.nkb, 4 * NW);
    const int64_t n0 = (int64_t)blockIdx.x * Q8G_BN, r0 = (int64_t)blockIdx.y * S::rows;
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0);
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.0f;

    if (warp == 4 * NW) {
        if (threadIdx.x == 128 * NW)
            ring.produce(
                S::b + S::raw + S::ds,
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    tma_2d(buf + S::b, &tmw, (ring.st0 + st) * Q8G_SPAN, (int)r0, bar);
                },
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    const int k0 = (ring.st0 + st) * MMQ_K;
                    tma_2d(buf, &tmx, k0, (int)n0, bar);
                    tma_2d(buf + Q8G_BN * 128, &tmx, k0 + 128, (int)n0, bar);
                    tma_2d(buf + S::b + S::raw, &tmd, k0 / 16, (int)n0, bar);   /* 2 floats per 32 */
                });
    } else {
        wait_for_previous_kernel();   /* before the stores: the kernel before may read y */
        const int wg = warp / 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int ra = 64 * wg + 16 * (warp % 4) + g;   /* this thread's rows ra and ra + 8 of the tile */
        for (int st = 0; st < ring.nst; st++) {
            const int s = st % S::stages;
            const uint8_t *buf = ring.smem + s * S::stage;
            const uint32_t bb = ring.sbase + (uint32_t)(s * S::stage);
            mbar_wait(&ring.full[s], (st / S::stages) & 1);
            const uint8_t *wa = buf + S::b + ra * Q8G_SPAN, *wb = wa + 8 * Q8G_SPAN;
            const uint4 ha = *(const uint4 *)wa, hb = *(const uint4 *)wb;
            int h[E], l[E], mm[E];
            uint32_t a[DEPTH][3][4], qw[4];
#pragma unroll
            for (int c = 0; c < 8; c++) {
                const int set = c % DEPTH;
                int sca, ma, scb, mb;
                scale_min_k4(c, ha.y, ha.z, ha.w, sca, ma);
                scale_min_k4(c, hb.y, hb.z, hb.w, scb, mb);
                if (c % 2 == 0) {   /* sub-blocks 2j and 2j + 1 share their bytes (low and high nibbles) */
                    const int off = 16 + 32 * (c / 2) + 4 * t;
                    qw[0] = *(const uint32_t *)(wa + off);
                    qw[1] = *(const uint32_t *)(wb + off);
                    qw[2] = *(const uint32_t *)(wa + off + 16);
                    qw[3] = *(const uint32_t *)(wb + off + 16);
                }
                const int sh = 4 * (c & 1);
                const uint32_t qa0 = (qw[0] >> sh) & 0x0F0F0F0Fu, qb0 = (qw[1] >> sh) & 0x0F0F0F0Fu;
                const uint32_t qa1 = (qw[2] >> sh) & 0x0F0F0F0Fu, qb1 = (qw[3] >> sh) & 0x0F0F0F0Fu;
                /* bytes below 16 times factors below 8: no carries */
                a[set][0][0] = qa0 * (uint32_t)(sca >> 3);
                a[set][0][1] = qb0 * (uint32_t)(scb >> 3);
                a[set][0][2] = qa1 * (uint32_t)(sca >> 3);
                a[set][0][3] = qb1 * (uint32_t)(scb >> 3);
                a[set][1][0] = qa0 * (uint32_t)(sca & 7);
                a[set][1][1] = qb0 * (uint32_t)(scb & 7);
                a[set][1][2] = qa1 * (uint32_t)(sca & 7);
                a[set][1][3] = qb1 * (uint32_t)(scb & 7);
                a[set][2][0] = a[set][2][2] = (uint32_t)ma * 0x01010101u;
                a[set][2][1] = a[set][2][3] = (uint32_t)mb * 0x01010101u;
                const uint64_t db = g16_desc(bb + (uint32_t)((c / 4) * (Q8G_BN * 128) + 32 * (c % 4)));
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                wg_mma_s8(h, a[set][0], db, c == 0);
                wg_mma_s8(l, a[set][1], db, c == 0);
                wg_mma_s8(mm, a[set][2], db, c == 0);
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(DEPTH - 1) : "memory");
#pragma unroll
                for (int i = 0; i < 3; i++) keep_regs(a[(c + 1) % DEPTH][i]);   /* its last chunk is done */
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
            for (int j = 0; j < DEPTH; j++)
#pragma unroll
                for (int i = 0; i < 3; i++) keep_regs(a[j][i]);
            keep_regs(h);
            keep_regs(l);
            keep_regs(mm);
            /* d_x of this thread's activation rows (the pair's first float), then the sums */
            const float *dsx = (const float *)(buf + S::b + S::raw);
            const float da = f16_bits(ha.x & 0xffff), dma = f16_bits(ha.x >> 16);
            const float db_ = f16_bits(hb.x & 0xffff), dmb = f16_bits(hb.x >> 16);
            float dxs[E / 2];   /* columns 8 j + 2 t + i */
#pragma unroll
            for (int j = 0; j < E / 2; j++) dxs[j] = dsx[(8 * (j / 2) + 2 * t + j % 2) * 16];
#pragma unroll
            for (int e = 0; e < E; e++) {
                const bool lo = (e % 4) < 2;   /* row ra, else ra + 8 */
                const float dx = dxs[2 * (e / 4) + e % 2];
                const float v = (lo ? da : db_) * (float)(8 * h[e] + l[e]) - (lo ? dma : dmb) * (float)mm[e];
                acc[e] = fmaf(dx, v, acc[e]);
            }
            /* each warp gives the stage back once all its lanes are done
             * reading it (the scales, the raw blocks): warps of a group
             * drift apart after their last wgmma */
            __syncwarp();
            if (lane == 0) mbar_arrive(&ring.empty[s]);
        }
    }

    __syncthreads();
    wg_tile_out<E, 128 * NW>(p, r0, n0, acc, warp < 4 * NW, gridDim.z, ring.smem, S::threads);
#endif
}

/* y = W x through q8g_kernel<NW, DEPTH> on the Q4_K blocks and the
 * activations' int8 values xq and (d, d sum) pairs xds; false (nothing
 * queued) where it cannot take the product. */
template <int NW, int DEPTH>
static bool q8g_launch(cuda_backend *c, const luma_weight *w, const int8_t *xq, const float2 *xds, int64_t m,
                       float *y)
{
    typedef q8g_shape<NW> S;
    static mmq_fit fit;
    CUtensorMap tmw, tmx, tmd;
    const uint64_t cols = (uint64_t)w->cols, row_bytes = luma_row_size(w->type, w->cols);
    if (!tensor_map_2d(&tmw, CU_TENSOR_MAP_DATA_TYPE_UINT8, w->dev, row_bytes, (uint64_t)w->rows, row_bytes,
                       Q8G_SPAN, S::rows) ||
        !tensor_map_2d(&tmx, CU_TENSOR_MAP_DATA_TYPE_UINT8, xq, cols, (uint64_t)m, cols, 128, Q8G_BN,
                       CU_TENSOR_MAP_SWIZZLE_128B) ||
        !tensor_map_2d(&tmd, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, xds, cols / 16, (uint64_t)m, cols / 16 * 4, 16,
                       Q8G_BN))
        return false;
    if (!mmq_setup_kernel(c, &fit, (const void *)q8g_kernel<NW, DEPTH>, S::smem, S::threads)) return true;
    const mmq_x xa = { NULL, xq, xds };
    mmq_queue(c, q8g_kernel<NW, DEPTH>, &fit, mmq_args_for(w, xa, m, y), (m + Q8G_BN - 1) / Q8G_BN,
              (w->rows + S::rows - 1) / S::rows, S::smem, S::threads, tmw, tmx, tmd);
    return true;
}

/* One consumer warpgroup a CTA, two CTAs an SM: with two in one CTA the
 * three chains' sums spill at the 168 registers 288 threads leave. Two
 * register sets of A operands (DEPTH): a chunk's wgmmas run while the next
 * chunk's operands are made. */
static bool q8g_run(cuda_backend *c, const luma_weight *w, const int8_t *xq, const float2 *xds, int64_t m, float *y)
{
    return q8g_launch<1, 2>(c, w, xq, xds, m, y);   /* a third register set measured the same */
}

/* ---- Q4_K dequantized into wgmma's registers (sm_90a) ---------------------------
 *
 * y = W x straight from the Q4_K blocks on the f16 tensor cores, the
 * weights as wgmma's A operand in registers. Nothing of the weights goes
 * through shared memory but their raw bytes, and no warp waits on another
 * to dequantize: each consumer thread turns the quant bytes of its own A
 * fragments into f16 with a few instructions (0x6400 | q is the f16 of
 * 1024 + q; minus 1024, times the sub-block's f16 scale d sc, minus its
 * f16 minimum dmin m: one HSUB2 and one HFMA2 per two weights), so the
 * dequantization costs about two instructions a weight against the 64
 * clocks of tensor work that a k16 chunk of 64 rows x 128 activations is.
 * The k order inside a half superblock follows the quant bytes
 * (rs_q4k_pos, blocks.cuh); the activations' f16 are written in that
 * order (luma_cuda_quantize_act_rs).
 *
 * A CTA owns 64 NW weight rows (NW consumer warpgroups) x BN activation
 * rows over its range of k, half a superblock (128 k) a stage:
 *   producer   (the last warp): one thread has the tensor memory
 *              accelerator copy each stage's activations (two boxes of
 *              BN x 64 k, 128-byte swizzled, as wgmma reads B), the rows'
 *              16-byte block headers and their 64 quant bytes of the half
 *              into a ring of buffers;
 *   consumers  read their rows' header and quant bytes, make the stage's
 *              eight A fragments in one of two register sets, issue its
 *              eight wgmmas, then wait for the stage before (whose set is
 *              then free) and give its buffer back (one arrival a warp:
 *              every warp reads the raw bytes itself).
 * Small row counts split k over a cluster, reduced as in mmq_kernel.
 * Pairs (P = 2: two weights of one shape over the same activations, llama's
 * gate and up): a stage also holds the second weight's rows, so its
 * activations are copied once for both; a consumer thread keeps both
 * weights' accumulators (2 x 64 at BN = 128), which fit once setmaxnreg
 * moves registers from the producer warpgroup (40 a thread) to the
 * consumers (232), and makes its fragments in units of four k16 chunks (two
 * sets of 16 registers, alternating). The activation copies from L2, one
 * per weight tile and stage, bound the single kernel at these shapes (the
 * copies alone take 80-90% of its time: cuda/NOTES.md). */
#define RS_K 128                    /* k per stage: half a Q4_K superblock */
#define RS_SMEM_CAP (220 * 1024)    /* one CTA an SM */

/* rs_kernel's weight formats: the bytes a row has in a stage (hdr: its
 * block's scales, copied every stage; qs: the half's quants) and where the
 * tensor maps find them for stage gs (half superblock gs of the row). */
struct rs_q4k {   /* the file's Q4_K blocks: d, dmin, 12 scale bytes, then 128 quant bytes */
    static constexpr bool q6 = false;
    static constexpr int block = 144, hdr = 16, qs = 64;
    static __device__ __forceinline__ int hdr_at(int gs) { return block * (gs / 2); }
    static __device__ __forceinline__ int qs_at(int gs) { return block * (gs / 2) + 16 + 64 * (gs % 2); }
};

struct rs_q6k {   /* Q6_K in its rs layout (repack_q6_K_rs, matmul.cu): a byte a weight, then the scales and d */
    static constexpr bool q6 = true;
    static constexpr int block = LUMA_Q6_K_RS_BYTES, hdr = 32, qs = 128;
    static __device__ __forceinline__ int hdr_at(int gs) { return block * (gs / 2) + 256; }
    static __device__ __forceinline__ int qs_at(int gs) { return block * (gs / 2) + 128 * (gs % 2); }
};

template <int NW, int BN, class F = rs_q4k, int P = 1>
struct rs_shape {
    /* NW consumer warpgroups and a producer warp; pairs: a producer
     * warpgroup, so that setmaxnreg can move its registers to the consumers */
    static constexpr int threads = 128 * NW + (P == 2 ? 128 : 32);
    static constexpr int rows = 64 * NW;
    static constexpr int b = BN * RS_K * 2;   /* first: the swizzled lines want 1024-byte alignment */
    static constexpr int hdr = rows * F::hdr;
    static constexpr int qs = rows * F::qs;   /* Q6_K's in 128-byte swizzled lines: 1024-byte aligned too */
    static constexpr int wt = hdr + qs;       /* a weight's bytes a stage; P weights after b */
    static_assert(!F::q6 || (b + hdr) % 1024 == 0, "the quants' swizzled lines start 1024-byte aligned");
    static_assert(P == 1 || !F::q6, "pairs of weights: Q4_K");
    static constexpr int stage = (b + P * wt + 1023) / 1024 * 1024;
    static constexpr int fit = (RS_SMEM_CAP - 1024) / (stage + 16);
    static constexpr int stages = fit < 8 ? fit : 8;
    static constexpr int smem = 1024 + stages * (stage + 16);
    static_assert(rows * BN * 4 <= stages * stage, "the partial tile fits");
    static_assert(stages >= 2, "a stage is given back once the next one's products are issued");
};

#ifdef MMQ_WG_DEVICE
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
/* d += A B for one k16 chunk: A (64 x 16 f16) in registers a0..a3 (the
 * warp's 16 rows in mma.m16n8k16's A order), B (16 x BN) at descriptor db. */
static __device__ __forceinline__ void wg_mma_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"
                 " {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

static __device__ __forceinline__ void wg_mma_rs(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
                 " {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}
#undef WG_D8

/* The f16 pair (q * s - m) of the nibbles at bits 0..3 and 16..19 of w. */
static __device__ __forceinline__ uint32_t rs_deq2(uint32_t w, __half2 s, __half2 nm)
{
    uint32_t h = (w & 0x000F000Fu) | 0x64006400u;   /* 1024 + q, exactly */
    __half2 q = __hsub2(*(const __half2 *)&h, __half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
    __half2 r = __hfma2(q, s, nm);
    return *(const uint32_t *)&r;
}

/* The f16 pairs (d sc, d sc) and (-dmin m, -dmin m) of sub-blocks 2 p and
 * 2 p + 1 (s[0], nm[0]: first half of the superblock) and 4 + 2 p, 5 + 2 p
 * (s[1], nm[1]) of the Q4_K block whose 16-byte header is h; sel is
 * rs_sel(p). The same roundings as f32 products rounded to f16. */
static __device__ __forceinline__ uint32_t rs_sel(int p)
{
    return (uint32_t)(2 * p) | 0x40u | (uint32_t)(2 * p + 1) << 8 | 0x4000u;
}

static __device__ __forceinline__ void rs_scales(const uint4 &h, uint32_t sel, __half2 (&s)[2], __half2 (&nm)[2])
{
    const uint32_t sc_lo = h.y & 0x3F3F3F3Fu, mn_lo = h.z & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    const uint32_t dd = __byte_perm(h.x, 0, 0x1010), nd = __byte_perm(h.x, 0, 0x3232) ^ 0x80008000u;
    const __half2 k1024 = __half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
    const uint32_t v[4] = { __byte_perm(sc_lo, 0x64646464u, sel), __byte_perm(sc_hi, 0x64646464u, sel),
                            __byte_perm(mn_lo, 0x64646464u, sel), __byte_perm(mn_hi, 0x64646464u, sel) };
#pragma unroll
    for (int i = 0; i < 2; i++) {
        s[i] = __hmul2(__hsub2(*(const __half2 *)&v[i], k1024), *(const __half2 *)&dd);
        nm[i] = __hmul2(__hsub2(*(const __half2 *)&v[2 + i], k1024), *(const __half2 *)&nd);
    }
}

/* The f16 pair d sc (q - 32) of the bytes of w that sel picks (PRMT
 * selectors 0x4240: bytes 0 and 2; 0x4341: 1 and 3) for Q6_K in the rs
 * layout; s is (d sc, d sc). 0x64 above a byte q < 64 is the f16 of
 * 1024 + q; minus 1056 is q - 32, exactly. */
static __device__ __forceinline__ uint32_t rs_deq6(uint32_t w, uint32_t sel, __half2 s)
{
    uint32_t h = __byte_perm(w, 0x64646464u, sel);
    __half2 q = __hsub2(*(const __half2 *)&h, __half2(__ushort_as_half(0x6420), __ushort_as_half(0x6420)));
    __half2 r = __hmul2(q, s);
    return *(const uint32_t *)&r;
}
#endif


/* rs_kernel's stream-K (mmq_args.sk CTAs). The tiles' rounds, tile after
 * tile (tile t: activation tile t % nt, row tile t / nt), are cut into sk
 * equal ranges, one a CTA, so that no SM idles while others finish a wave
 * or a cluster's reduction (where it pays: rs_sk_fits). A CTA goes over its
 * range's tiles from the last to the first: the head of the last one (a
 * tile it does not finish) first, into its partial slot, then whole
 * tiles, then the tail of the first one, which it finishes: it waits for
 * the slots of the CTAs before it that hold the tile's earlier rounds
 * (which they wrote first) and adds them to its own, in the order of the
 * CTAs. The sk CTAs are resident together (sk is at most what the GPU
 * holds at once) and a CTA only waits for CTAs before it, which wrote
 * before they waited: no deadlock, and the bits do not depend on timing.
 * A CTA writes at most one slot (only its first tile can be left
 * unfinished); the flag of a slot is set when it is written and cleared by
 * the CTA that reads it, so all are zero between launches. */
#ifdef MMQ_WG_DEVICE
struct rs_range {
    int a, b;   /* the CTA's rounds, counted over all tiles */
    int R;      /* rounds a tile */

    /* The rounds [k0, k1) of tile t in the range. */
    __device__ __forceinline__ void of(int t, int &k0, int &k1) const
    {
        k0 = (a > t * R ? a : t * R) - t * R;
        k1 = (b < (t + 1) * R ? b : (t + 1) * R) - t * R;
    }
};

/* The producer's walk over a range's stages (U a round), tiles from the
 * last: the tile, its weight rows r and activation rows n (nt activation
 * tiles of BN, ROWS weight rows a tile), the stage gs inside it and the
 * end of the range's stages there. One step a stage, no division but at a
 * tile's change: the producer is one thread, and its work a stage is on
 * the consumers' path. */
template <int ROWS, int BN, int U>
struct rs_walk {
    int tile, r, n, gs, end;

    __device__ __forceinline__ void enter(const rs_range &rg, int t, int nt)
    {
        int k0, k1;
        rg.of(t, k0, k1);
        tile = t;
        r = t / nt * ROWS;
        n = t % nt * BN;
        gs = k0 * U;
        end = k1 * U;
    }

    __device__ __forceinline__ void next(const rs_range &rg, int nt)
    {
        if (++gs == end) enter(rg, tile - 1, nt);
    }
};

static __device__ __forceinline__ int32_t flag_acquire(const int32_t *f)
{
    int32_t v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    return v;
}

static __device__ __forceinline__ void flag_release(int32_t *f, int32_t v)
{
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(f), "r"(v) : "memory");
}

#define RS_BAR_CONSUMERS 1   /* named barrier of the consumer threads (stream-K's partial tiles) */

/* Stream-K's end of a tile's rounds [k0, k1) of R for the C consumer
 * threads (rs_range above): acc to y when the range is the whole tile, to
 * the CTA's slot when the tile goes on in the CTAs after, else acc plus
 * the slots of the CTAs before (from c0, in that order) to y. */
template <int E, int C>
static __device__ __forceinline__ void rs_sk_out(const mmq_args &p, int64_t r0, int64_t n0, float (&acc)[E],
                                                 int k0, int k1, int R, int c0)
{
    const int th = threadIdx.x, cta = blockIdx.x;
    int rr, nn;
    if (k0 == 0 && k1 == R) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            wg_acc_at(th, e, rr, nn);
            store_y(p, r0, n0, rr, nn, acc[e]);
        }
        return;
    }
    if (k1 < R) {
        float *slot = p.part + (size_t)cta * (C * E);
#pragma unroll
        for (int e = 0; e < E; e++) __stcg(slot + e * C + th, acc[e]);
        bar_sync(RS_BAR_CONSUMERS, C);
        if (th == 0) {
            __threadfence();
            flag_release(p.flags + cta, 1);
        }
        return;
    }
    if (th == 0)
        for (int c = c0; c < cta; c++) {
            while (flag_acquire(p.flags + c) == 0) __nanosleep(32);
            p.flags[c] = 0;
        }
    bar_sync(RS_BAR_CONSUMERS, C);
    for (int c = c0; c < cta; c++) {
        const float *slot = p.part + (size_t)c * (C * E) + th;
        float v[E];   /* a slot's loads all in flight at once */
#pragma unroll
        for (int e = 0; e < E; e++) v[e] = __ldcg(slot + e * C);
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] += v[e];
    }
#pragma unroll
    for (int e = 0; e < E; e++) {
        wg_acc_at(th, e, rr, nn);
        store_y(p, r0, n0, rr, nn, acc[e]);
    }
}
#endif

/* Grid: (activation tiles, weight-row tiles, splits of k), or p.sk CTAs
 * (SK: stream-K, above); p.nkb counts rounds of U stages (half
 * superblocks). */
template <int NW, int BN, int U, bool SK, class F, int P>
static __global__ void __launch_bounds__(rs_shape<NW, BN, F, P>::threads, 1)
    rs_kernel(mmq_args p, const __grid_constant__ CUtensorMap tmh, const __grid_constant__ CUtensorMap tmq,
              const __grid_constant__ CUtensorMap tmx, const __grid_constant__ CUtensorMap tmh2,
              const __grid_constant__ CUtensorMap tmq2)
{
#ifdef MMQ_WG_DEVICE
    typedef rs_shape<NW, BN, F, P> S;
    typedef wg_ring<S::stages, S::stage> ring_t;
    constexpr int E = BN / 2, C = 128 * NW;
    static_assert(P == 1 || !SK, "pairs of weights: the grid's tiles");
    extern __shared__ uint8_t rsmem[];
    const int R = p.nkb;
    int nt = 0, all = 0;   /* stream-K: activation tiles, rounds of all tiles (under 2^31: the launch checks) */
    rs_range rg = { 0, 0, R };
    if constexpr (SK) {
        nt = (int)((p.m + BN - 1) / BN);
        all = nt * (int)((p.rows + S::rows - 1) / S::rows) * R;
        rg.a = (int)((int64_t)blockIdx.x * all / p.sk);
        rg.b = (int)((int64_t)(blockIdx.x + 1) * all / p.sk);
    }
    const ring_t ring = SK ? ring_t(rsmem, 4 * NW, wg_stages{ (rg.b - rg.a) * U }) : ring_t(rsmem, R * U, 4 * NW, U);
    const int64_t n0 = (int64_t)blockIdx.x * BN, r0 = (int64_t)blockIdx.y * S::rows;   /* without stream-K */
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0);   /* warp-uniform to the compiler */
    float acc[E], acc2[P == 2 ? E : 1];   /* acc2: the second weight's (P = 2) */
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.0f;
#pragma unroll
    for (int e = 0; e < (P == 2 ? E : 1); e++) acc2[e] = 0.0f;

    if (warp >= 4 * NW) {
        if constexpr (P == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == C) {
            /* stream-K: the weights' stages and the activations' each walk
             * the range once, in order (ring.produce's calls) */
            rs_walk<S::rows, BN, U> ww, wa;
            if constexpr (SK) {
                ww.enter(rg, (rg.b - 1) / R, nt);
                wa = ww;
            }
            ring.produce(
                S::b + P * S::wt,
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    int gs = ring.st0 + st, r = (int)r0;
                    if constexpr (SK) {
                        gs = ww.gs;
                        r = ww.r;
                        ww.next(rg, nt);
                    }
                    tma_2d(buf + S::b, &tmh, F::hdr_at(gs), r, bar);
                    tma_2d(buf + S::b + S::hdr, &tmq, F::qs_at(gs), r, bar);
                    if constexpr (P == 2) {
                        tma_2d(buf + S::b + S::wt, &tmh2, F::hdr_at(gs), r, bar);
                        tma_2d(buf + S::b + S::wt + S::hdr, &tmq2, F::qs_at(gs), r, bar);
                    }
                },
                [&](int st, uint8_t *buf, uint64_t *bar) {
                    int gs = ring.st0 + st, n = (int)n0;
                    if constexpr (SK) {
                        gs = wa.gs;
                        n = wa.n;
                        wa.next(rg, nt);
                    }
                    tma_2d(buf, &tmx, gs * RS_K, n, bar);
                    tma_2d(buf + BN * 128, &tmx, gs * RS_K + 64, n, bar);
                });
        }
        /* pairs: the producers leave (the copies they queued complete on
         * the consumers' barriers), so that no code after the branches runs
         * under their 40 registers with the consumers' accumulators live */
        if constexpr (P == 2) return;
    } else {
        /* pairs: 2 x 64 accumulators a thread (40 x 128 + 232 x 256 registers) */
        if constexpr (P == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        wait_for_previous_kernel();   /* before the stores: the kernel before may read y */
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int ra = 64 * (warp / 4) + 16 * (warp % 4) + g;   /* this thread's rows ra and ra + 8 of the tile */
        uint32_t a0[32], a1[32];   /* two register sets of a stage's eight A fragments */
        uint32_t b0[16], b1[16];   /* pairs: two sets of four fragments */
#pragma unroll
        for (int i = 0; i < 32; i++) a0[i] = a1[i] = 0;
#pragma unroll
        for (int i = 0; i < 16; i++) b0[i] = b1[i] = 0;
        const uint32_t sel = rs_sel(t / 2);
        /* this superblock's scales of weight j: [j][0] first half, [j][1] second */
        __half2 sa[P][2], ma[P][2], sb[P][2], mb[P][2];
        /* stage st's A fragments of weight j: all eight k16 chunks into a
         * set of 32 registers, or (pairs) chunks 4 h .. 4 h + 3 into a set
         * of 16; the first of a stage waits for its copies */
        auto make = [&](uint32_t *a, int N, int st, bool first_half, int j, int h) {
            const int s = st % S::stages;
            const uint8_t *buf = ring.smem + s * S::stage + j * S::wt;
            if (j == 0 && h == 0) mbar_wait(&ring.full[s], (st / S::stages) & 1);
            if constexpr (F::q6) {
                /* this thread's lane part pp of the block, rows ra and ra + 8:
                 * the scales of s0 and s1, and 32 bytes of quants from the
                 * swizzled lines (16-byte unit i of line r at i ^ r % 8; ra % 8
                 * is g) */
                const int pp = 4 * (first_half ? 0 : 1) + t;
                const uint8_t *ha = buf + S::b + F::hdr * ra, *hb = ha + 8 * F::hdr;
                const uint32_t sca = *(const uint16_t *)(ha + 2 * pp), scb = *(const uint16_t *)(hb + 2 * pp);
                const float da = *(const float *)(ha + 16), db = *(const float *)(hb + 16);
                const __half2 s0a = __float2half2_rn(da * (float)(int8_t)(sca & 0xFF)),
                              s1a = __float2half2_rn(da * (float)(int8_t)(sca >> 8)),
                              s0b = __float2half2_rn(db * (float)(int8_t)(scb & 0xFF)),
                              s1b = __float2half2_rn(db * (float)(int8_t)(scb >> 8));
                const uint8_t *qa = buf + S::b + S::hdr + F::qs * ra, *qb = qa + 8 * F::qs;
                const uint4 a0 = *(const uint4 *)(qa + 16 * ((2 * t) ^ g)), a1 = *(const uint4 *)(qa + 16 * ((2 * t + 1) ^ g));
                const uint4 b0 = *(const uint4 *)(qb + 16 * ((2 * t) ^ g)), b1 = *(const uint4 *)(qb + 16 * ((2 * t + 1) ^ g));
                const uint32_t wa[8] = { a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w };
                const uint32_t wb[8] = { b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w };
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    uint32_t *lo = a + 8 * u, *hi = a + 8 * u + 4;
                    lo[0] = rs_deq6(wa[2 * u], 0x4240u, s0a);
                    lo[1] = rs_deq6(wb[2 * u], 0x4240u, s0b);
                    lo[2] = rs_deq6(wa[2 * u], 0x4341u, s0a);
                    lo[3] = rs_deq6(wb[2 * u], 0x4341u, s0b);
                    hi[0] = rs_deq6(wa[2 * u + 1], 0x4240u, s1a);
                    hi[1] = rs_deq6(wb[2 * u + 1], 0x4240u, s1b);
                    hi[2] = rs_deq6(wa[2 * u + 1], 0x4341u, s1a);
                    hi[3] = rs_deq6(wb[2 * u + 1], 0x4341u, s1b);
                }
                return;
            }
            if (first_half && h == 0) {
                rs_scales(*(const uint4 *)(buf + S::b + 16 * ra), sel, sa[j], ma[j]);
                rs_scales(*(const uint4 *)(buf + S::b + 16 * ra + 128), sel, sb[j], mb[j]);
            }
            const uint4 qa = *(const uint4 *)(buf + S::b + S::hdr + 64 * ra + 16 * t);
            const uint4 qb = *(const uint4 *)(buf + S::b + S::hdr + 64 * ra + 512 + 16 * t);
            const int hf = first_half ? 0 : 1;
            const __half2 sa0 = __low2half2(sa[j][hf]), sa1 = __high2half2(sa[j][hf]),
                          ma0 = __low2half2(ma[j][hf]), ma1 = __high2half2(ma[j][hf]),
                          sb0 = __low2half2(sb[j][hf]), sb1 = __high2half2(sb[j][hf]),
                          mb0 = __low2half2(mb[j][hf]), mb1 = __high2half2(mb[j][hf]);
            const uint32_t wa[4] = { qa.x, qa.y, qa.z, qa.w }, wb[4] = { qb.x, qb.y, qb.z, qb.w };
#pragma unroll
            for (int i = 0; i < N / 8; i++) {
                const int u = (N == 32 ? 0 : 2 * h) + i;
                uint32_t *lo = a + 8 * i, *hi = a + 8 * i + 4;
                lo[0] = rs_deq2(wa[u], sa0, ma0);
                lo[1] = rs_deq2(wb[u], sb0, mb0);
                lo[2] = rs_deq2(wa[u] >> 8, sa0, ma0);
                lo[3] = rs_deq2(wb[u] >> 8, sb0, mb0);
                hi[0] = rs_deq2(wa[u] >> 4, sa1, ma1);
                hi[1] = rs_deq2(wb[u] >> 4, sb1, mb1);
                hi[2] = rs_deq2(wa[u] >> 12, sa1, ma1);
                hi[3] = rs_deq2(wb[u] >> 12, sb1, mb1);
            }
        };
        /* the wgmmas of a set that make filled (the same N and h) into d */
        auto issue_to = [&](float (&d)[E], const uint32_t *a, int N, int st, int h) {
            const uint32_t bb = ring.sbase + (uint32_t)((st % S::stages) * S::stage);
            const uint64_t d0 = g16_desc(bb);   /* chunk c: + its offset / 16 in the address field */
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int i = 0; i < N / 4; i++) {
                const int c = (N == 32 ? 0 : 4 * h) + i;
                wg_mma_rs(d, a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3],
                          d0 + (uint64_t)(((c / 4) * (BN * 128) + 32 * (c % 4)) >> 4));
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        };
        auto issue = [&](const uint32_t (&a)[32], int st) { issue_to(acc, a, 32, st, 0); };
        auto give_back = [&](int st) {
            __syncwarp();
            if (lane == 0) mbar_arrive(&ring.empty[st % S::stages]);
        };
        /* U stages, their register sets alternating: a set is rewritten
         * only after the wait that says its wgmmas are done, and nothing is
         * in flight from one round to the next (ptxas serializes the wgmmas
         * otherwise) */
        auto round = [&](int st) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                if constexpr (P == 2) {
                    /* pairs: four units a stage (each weight's two halves of
                     * k) in two sets of 16 registers, alternating; the wait
                     * after a stage's first unit says the stage before is
                     * done */
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const int j = q / 2, h = q % 2;
                        if (q % 2 == 0) make(b0, 16, st + u, u % 2 == 0, j, h);
                        else make(b1, 16, st + u, u % 2 == 0, j, h);
                        if (q == 0) issue_to(acc, b0, 16, st + u, h);
                        else if (q == 1) issue_to(acc, b1, 16, st + u, h);
                        else if (q == 2) issue_to(acc2, b0, 16, st + u, h);
                        else issue_to(acc2, b1, 16, st + u, h);
                        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                        if (q % 2 == 0) keep_regs(b1);
                        else keep_regs(b0);
                        if (q == 0 && u > 0) give_back(st + u - 1);
                    }
                } else {
                    if (u % 2 == 0) make(a0, 32, st + u, true, 0, 0);   /* rounds start on a superblock: U even */
                    else make(a1, 32, st + u, false, 0, 0);
                    if (u % 2 == 0) issue(a0, st + u);
                    else issue(a1, st + u);
                    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                    if (u % 2 == 0) keep_regs(a1);
                    else keep_regs(a0);
                    if (u > 0) give_back(st + u - 1);
                }
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            if constexpr (P == 2) {
                keep_regs(b0);
                keep_regs(b1);
            } else {
                keep_regs(a0);
                keep_regs(a1);
            }
            give_back(st + U - 1);
        };
        if constexpr (SK) {
            int st = 0;   /* the range's tiles from the last */
            for (int tile = (rg.b - 1) / R; rg.b > rg.a && tile >= rg.a / R; tile--) {
                int k0, k1;
                rg.of(tile, k0, k1);
                for (int r = k0; r < k1; r++, st += U) round(st);
                wg_pin(acc);
                /* the tile's first CTA: the last whose range starts at or before its rounds */
                const int c0 = (int)(((int64_t)(tile * R + 1) * p.sk - 1) / all);
                rs_sk_out<E, C>(p, (int64_t)(tile / nt) * S::rows, (int64_t)(tile % nt) * BN, acc, k0, k1, R, c0);
#pragma unroll
                for (int e = 0; e < E; e++) acc[e] = 0.0f;
            }
        } else {
            for (int st = 0; st < ring.nst; st += U) round(st);
            wg_pin(acc);
            if constexpr (P == 2) {
                /* k is not split (rs_launch): each thread's sums go to y
                 * and y2 as they are */
                wg_pin(acc2);
                mmq_args p2 = p;
                p2.y = p.y2;
                wg_tile_out<E, C>(p, r0, n0, acc, true, 1, ring.smem, C);
                wg_tile_out<E, C>(p2, r0, n0, acc2, true, 1, ring.smem, C);
                return;
            }
        }
    }
    if constexpr (SK || P == 2) return;
    __syncthreads();
    wg_tile_out<E, C>(p, r0, n0, acc, warp < 4 * NW, gridDim.z, ring.smem, S::threads);
#endif
}

/* Whether policy 0 takes w by rs_kernel's stream-K at m: weights at least
 * twice as wide as tall (the downs) whose tiles hold RS_SK_ROUNDS rounds or
 * more an SM, at m = RS_SK_LO .. RS_SK_HI. There it measured faster than
 * the clusters, q8g_kernel and cuBLAS on the H100; with fewer rounds (the
 * 7B's k and v: 64 for 132 SMs) a tile's CTAs sum too many partial tiles
 * (cuda/NOTES.md). */
static bool rs_sk_fits(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    return w->cols >= 2 * w->rows && m >= RS_SK_LO && m <= RS_SK_HI &&
           (w->rows + 127) / 128 * (w->cols / (4 * RS_K)) >= (int64_t)RS_SK_ROUNDS * c->n_sm;
}

/* rs_kernel's stream-K CTAs (as many as the GPU holds at once, at most
 * one a round), or 0 for its tiles with k split over clusters
 * (mmq_splits): where rs_sk_fits under policy 0, always under policy 6,
 * never under policy 5. LUMA_CUDA_SK=0 or 1 in the environment says never
 * or always instead of the rule, for measuring. */
static int rs_stream_k(const cuda_backend *c, const mmq_fit *fit, const luma_weight *w, int64_t m, int64_t rounds)
{
    static int env = -2;
    if (env == -2) {
        const char *v = getenv("LUMA_CUDA_SK");
        env = v && *v ? atoi(v) != 0 : -1;
    }
    const int64_t ctas = fit->clusters[0] < rounds ? fit->clusters[0] : rounds;
    if (c->mmq_policy == 5 || ctas <= 0 || rounds > INT32_MAX) return 0;
    if (c->mmq_policy == 6) return (int)ctas;
    if (env >= 0) return env ? (int)ctas : 0;
    return rs_sk_fits(c, w, m) ? (int)ctas : 0;
}

/* Stream-K's memory (c->sk_scratch): a flag for each of ctas CTAs, then a
 * partial tile of part_bytes for each. */
static bool rs_sk_scratch(cuda_backend *c, int ctas, size_t part_bytes, mmq_args *p)
{
    void *part;
    if (!luma_cuda_partials(c, &c->sk_scratch, (size_t)ctas, (size_t)ctas * part_bytes, "the stream-K scratch",
                            &p->flags, &part))
        return false;
    p->part = (float *)part;
    return true;
}

/* The tensor maps of w's blocks in format F at blocks for rs_kernel's
 * copies: each row's headers (tmh) and its quants (tmq), S::rows rows a box. */
template <class S, class F>
static bool rs_weight_maps(const luma_weight *w, const void *blocks, CUtensorMap *tmh, CUtensorMap *tmq)
{
    const uint64_t row_bytes = (uint64_t)(w->cols / 256) * F::block;
    return tensor_map_2d(tmh, CU_TENSOR_MAP_DATA_TYPE_UINT8, blocks, row_bytes, (uint64_t)w->rows, row_bytes, F::hdr,
                         S::rows) &&
           tensor_map_2d(tmq, CU_TENSOR_MAP_DATA_TYPE_UINT8, blocks, row_bytes, (uint64_t)w->rows, row_bytes, F::qs,
                         S::rows, F::q6 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE);
}

/* y = W x through rs_kernel<NW, BN, U, SK, F, P> on w's blocks in format F
 * (Q4_K: the file's; Q6_K: its rs layout, luma_cuda_q6k_rs) and the
 * activations' f16 xp in rs_kernel's k order; with P = 2, also y2 = W2 x
 * in the same CTAs (w2 of w's type and shape), where the grid's tiles fit
 * the GPU without splitting k or stream-K. False (nothing queued) when w
 * has no such blocks, the driver declines the tensor maps, or the pair
 * does not fit so. */
template <int NW, int BN, int U, class F, int P = 1>
static bool rs_launch(cuda_backend *c, const luma_weight *w, const __half *xp, int64_t m, float *y,
                      const luma_weight *w2 = NULL, float *y2 = NULL)
{
    typedef rs_shape<NW, BN, F, P> S;
    static mmq_fit fit;
    CUtensorMap tmh, tmq, tmx, tmh2, tmq2;
    const void *blocks = F::q6 ? (const void *)luma_cuda_q6k_rs(c, w) : w->dev;
    if (!blocks || w->cols % (RS_K * U) != 0) return false;
    const uint64_t cols = (uint64_t)w->cols;
    if (!rs_weight_maps<S, F>(w, blocks, &tmh, &tmq) ||
        !tensor_map_2d(&tmx, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, xp, cols, (uint64_t)m, cols * 2, 64, BN,
                       CU_TENSOR_MAP_SWIZZLE_128B))
        return false;
    tmh2 = tmh;
    tmq2 = tmq;
    if (P == 2 && (!w2 || !w2->dev || !rs_weight_maps<S, F>(w2, w2->dev, &tmh2, &tmq2))) return false;
    if (!mmq_setup_kernel(c, &fit, (const void *)rs_kernel<NW, BN, U, false, F, P>, S::smem, S::threads)) return true;
    mmq_args p = mmq_args_for(w, mmq_x{ xp, NULL, NULL }, m, y);
    p.nkb = (int)(w->cols / (RS_K * U));   /* rounds of U stages, not k-steps */
    p.y2 = y2;
    const int64_t n_tiles = (m + BN - 1) / BN, row_tiles = (w->rows + S::rows - 1) / S::rows;
    p.sk = rs_stream_k(c, &fit, w, m, n_tiles * row_tiles * p.nkb);
    if (P == 2 && (p.sk || mmq_splits(&fit, n_tiles * row_tiles, p.nkb) != 1)) return false;
    if (!p.sk) {
        mmq_queue(c, rs_kernel<NW, BN, U, false, F, P>, &fit, p, n_tiles, row_tiles, S::smem, S::threads, tmh, tmq,
                  tmx, tmh2, tmq2);
        return true;
    }
    if constexpr (P == 1) {
        static mmq_fit fit_sk;
        if (!mmq_setup_kernel(c, &fit_sk, (const void *)rs_kernel<NW, BN, U, true, F, 1>, S::smem, S::threads) ||
            !rs_sk_scratch(c, p.sk, (size_t)S::rows * BN * sizeof(float), &p))
            return true;
        mmq_queue(c, rs_kernel<NW, BN, U, true, F, 1>, &fit_sk, p, n_tiles, row_tiles, S::smem, S::threads, tmh,
                  tmq, tmx, tmh2, tmq2);
    }
    return true;
}

/* Rounds of four stages (512 k) where the width allows, else two. */
template <class F>
static bool rs_run_as(cuda_backend *c, const luma_weight *w, const __half *xp, int64_t m, float *y)
{
    if (w->cols % (4 * RS_K) == 0)
        return m <= 64 ? rs_launch<2, 64, 4, F>(c, w, xp, m, y) : rs_launch<2, 128, 4, F>(c, w, xp, m, y);
    return m <= 64 ? rs_launch<2, 64, 2, F>(c, w, xp, m, y) : rs_launch<2, 128, 2, F>(c, w, xp, m, y);
}

static bool rs_run(cuda_backend *c, const luma_weight *w, const __half *xp, int64_t m, float *y)
{
    return w->type == LUMA_Q6_K ? rs_run_as<rs_q6k>(c, w, xp, m, y) : rs_run_as<rs_q4k>(c, w, xp, m, y);
}

/* Activation tiles of 8, 16, 32 or 64 rows (32 at most on the int8
 * route); a larger m takes several tiles, each reading the weights again
 * (from L2 when they run together). */
template <class T>
static void mmq_run(cuda_backend *c, const luma_weight *w, const mmq_x &x, int64_t m, float *y)
{
    if (m <= 8) mmq_launch<T, 8>(c, w, x, m, y);
    else if (m <= 16) mmq_launch<T, 16>(c, w, x, m, y);
    else if constexpr (T::i8) mmq_launch<T, 32>(c, w, x, m, y);   /* the int8 route's 64 would spill */
    else if (m <= 32) mmq_launch<T, 32>(c, w, x, m, y);
    else mmq_launch<T, 64>(c, w, x, m, y);
}

static bool mmq_supports(enum luma_type t)
{
    switch (t) {
    case LUMA_Q4_0: case LUMA_Q5_0: case LUMA_Q8_0: case LUMA_Q4_K: case LUMA_Q5_K: case LUMA_Q6_K:
        return true;
    default:
        return false;
    }
}

/* Whether the kernels can take this product: weights on the device, k-steps
 * of whole 256-element spans, 16-byte aligned weights and activations, grid
 * limits. */
static bool mmq_fits(const luma_weight *w, const float *x, int64_t m)
{
    return mmq_supports(w->type) && m >= 1 && w->rows >= 1 && w->cols >= MMQ_K && w->cols % MMQ_K == 0 &&
           w->cols / MMQ_K <= INT32_MAX && (w->rows + 63) / 64 <= 65535 && m <= INT32_MAX &&
           w->dev && ((uintptr_t)w->dev & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

/* The measured rule (cuda/NOTES.md, spec/native/test_cuda_mmq's table on
 * the H100): per type, the m for which this kernel beat matmul's other path
 * on all three of llama-8B's matrices timed (4096 x 4096, 14336 x 4096,
 * 4096 x 14336). That path is the matrix-vector kernels up to m = 8, then
 * cuBLAS on the weight's resident f16 copy when the backend keeps one, or
 * cuBLAS after dequantizing the weight per call. A bound between two
 * measured m where the kernel won at both is taken to hold in between.
 * Below m = 9 matmul takes the matrix-vector path first wherever it can
 * read the weight (takes_vec, matmul.cu; the int8 route of
 * luma_cuda_mmq_small aside), so the lower bounds under 9 only hold for
 * weights it cannot: that path multiplies the CPU's integers, which this
 * kernel's f16 route for the legacy formats does not. */
static const struct mmq_rule {
    enum luma_type type;
    int16_t lo, hi_res, hi_pc;   /* lo <= m <= hi_res with a resident copy, hi_pc without */
} mmq_rules[] = {
    { LUMA_Q4_K, 8, 16, 128 },
    { LUMA_Q5_K, 8, 16, 128 },
    { LUMA_Q6_K, 8, 8, 128 },
    { LUMA_Q8_0, 2, 32, 128 },
    { LUMA_Q4_0, 4, 32, 128 },
    { LUMA_Q5_0, 8, 16, 128 },
};

/* Tall Q4_K and Q5_K matrices (llama's gate and up: at least twice as
 * many rows as columns) keep the f16 route up to m = 32 even beside a
 * resident copy: 14336 x 4096 at m = 32, 45.4 against cuBLAS's 50.3 us
 * (Q4_K) and 48.8 against 50.3 (Q5_K); square and wide ones lose there. */
#define MMQ_TALL_HI_RES 32

static bool mmq_wins(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    bool resident = c->f16_mode == CUDA_F16_RESIDENT && w->dev_f16;
    bool tall = (w->type == LUMA_Q4_K || w->type == LUMA_Q5_K) && w->rows >= 2 * w->cols;
    for (size_t i = 0; i < sizeof mmq_rules / sizeof mmq_rules[0]; i++) {
        const struct mmq_rule *r = &mmq_rules[i];
        if (r->type != w->type) continue;
        int hi = resident ? (tall && r->hi_res < MMQ_TALL_HI_RES ? MMQ_TALL_HI_RES : r->hi_res) : r->hi_pc;
        return m >= r->lo && m <= hi;
    }
    return false;
}

/* The int8 route: the K formats. */
static bool mmq8_supports(enum luma_type t)
{
    return t == LUMA_Q4_K || t == LUMA_Q5_K || t == LUMA_Q6_K;
}

/* Where the int8 route replaces the other paths (spec/native/test_cuda_mmq's
 * table on the H100, cuda/NOTES.md): lo <= m <= hi, whether or not the
 * weight has a resident f16 copy. Its m <= 8 come before the
 * matrix-vector kernels (luma_cuda_mmq_small): at m = 8 it beats them on
 * every shape (the products of 8 rows share one pass of mma over the
 * blocks), at m = 16 it beats cuBLAS on the copy and the f16 route for
 * Q4_K and Q5_K; Q6_K's sub-blocks of 16 double its scaling work and it
 * wins at m = 8 only. Q4_K and Q5_K at m <= 32, and Q6_K with its tile
 * copy, now go to matmul.cu's mmv_tc before this route (takes_vec), so the
 * rule decides where mmv_tc is off. LUMA_CUDA_MMQ8="lo,hi" replaces the
 * bounds of every type, for measuring. */
static const struct mmq8_rule {
    enum luma_type type;
    int lo, hi;
} mmq8_rules[] = {
    { LUMA_Q4_K, 8, 16 },
    { LUMA_Q5_K, 8, 16 },
    { LUMA_Q6_K, 8, 8 },
};

static bool mmq8_wins(const luma_weight *w, int64_t m)
{
    static env_rows env;
    bool set = env_rows_set(env, "LUMA_CUDA_MMQ8");
    for (size_t i = 0; i < sizeof mmq8_rules / sizeof mmq8_rules[0]; i++) {
        const struct mmq8_rule *r = &mmq8_rules[i];
        if (r->type != w->type) continue;
        return set ? m >= env.lo && m <= env.hi : m >= r->lo && m <= r->hi;
    }
    return false;
}

/* The wgmma route (sm_90a builds on a compute capability 9.0 device:
 * c->wgmma) lost to the other paths at every measured m (cuda/NOTES.md),
 * so the rule never takes it; LUMA_CUDA_WG_LO=n in the environment makes
 * it take every supported product of more than n rows, for measuring. */
static bool mmq_wg_wins(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    static int env_lo = -2;
    if (env_lo == -2) {
        const char *s = getenv("LUMA_CUDA_WG_LO");
        env_lo = s && *s ? atoi(s) : -1;
    }
    return c->wgmma && env_lo >= 0 && m > env_lo;
}

/* Whether q8g_kernel takes a Q4_K product under policy 0: m from Q8G_LO to
 * Q8G_HI, where it beat cuBLAS on the resident copy and mmq's other routes
 * on the H100 (cuda/NOTES.md); LUMA_CUDA_Q8G=lo,hi in the environment sets
 * the range instead, for measuring ("9999,0": never). */
static bool q8g_wins(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    static env_rows env;
    bool set = env_rows_set(env, "LUMA_CUDA_Q8G");
    int lo = set ? env.lo : Q8G_LO, hi = set ? env.hi : Q8G_HI;
    return c->wgmma && w->type == LUMA_Q4_K && m >= lo && m <= hi;
}

/* Whether rs_kernel takes a Q4_K or Q6_K product under policy 0: where it
 * beat cuBLAS on the resident copy and q8g_kernel on the H100
 * (cuda/NOTES.md). Q4_K: weights at least twice as tall as wide (llama's
 * gate and up) at m = RS_TALL_LO .. RS_TALL_HI, at least twice as wide as
 * tall (down) at RS_WIDE_LO .. RS_WIDE_HI, and by stream-K where
 * rs_sk_fits; LUMA_CUDA_RS=lo,hi in the environment takes every shape from
 * lo to hi instead, for measuring ("9999,0": never). Q6_K: on its rs
 * layout by stream-K where rs_sk_fits (c->rs6). */
static bool rs_wins(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    static env_rows env;
    if (!c->wgmma) return false;
    if (w->type == LUMA_Q6_K) return c->rs6 && luma_cuda_q6k_rs(c, w) && rs_sk_fits(c, w, m);
    if (w->type != LUMA_Q4_K) return false;
    if (env_rows_set(env, "LUMA_CUDA_RS")) return m >= env.lo && m <= env.hi;
    if (w->rows >= 2 * w->cols) return m >= RS_TALL_LO && m <= RS_TALL_HI;
    return rs_sk_fits(c, w, m) || (w->cols >= 2 * w->rows && m >= RS_WIDE_LO && m <= RS_WIDE_HI);
}

bool luma_cuda_mmq_small(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m)
{
    return c->mmq_policy == 0 && !c->invariant && !c->float_act && mmq8_wins(w, m) && mmq_fits(w, x, m);
}

bool luma_cuda_mmq_takes(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m)
{
    if (c->mmq_policy < 0 || c->float_act || !mmq_fits(w, x, m)) return false;
    return c->mmq_policy != 0 || (mmq8_supports(w->type) && mmq8_wins(w, m)) || mmq_wg_wins(c, w, m) ||
           q8g_wins(c, w, m) || rs_wins(c, w, m) || mmq_wins(c, w, m);
}

bool luma_cuda_rs_takes(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m)
{
    return luma_cuda_mmq_takes(c, w, x, m) && c->wgmma &&
           (w->type == LUMA_Q4_K || (w->type == LUMA_Q6_K && luma_cuda_q6k_rs(c, w))) &&
           (c->mmq_policy == 5 || c->mmq_policy == 6 || (c->mmq_policy == 0 && rs_wins(c, w, m)));
}

bool luma_cuda_rs(cuda_backend *c, const luma_weight *w, const __half *xp, int64_t m, float *y)
{
    return rs_run(c, w, xp, m, y);
}

/* Two Q4_K weights of one shape over the same activations in one launch
 * (llama's gate and up): each CTA's stages bring the activations once for
 * both weights' rows, half the activation copies of two launches, which
 * bound rs_kernel at these shapes (cuda/NOTES.md). Where the pair does not
 * fit (stream-K, split k, widths not of 512) nothing is queued and the
 * answer is false. */
bool luma_cuda_rs_pair(cuda_backend *c, const luma_weight *w, const luma_weight *w2, const __half *xp, int64_t m,
                       float *y, float *y2)
{
    if (!c->rs_pair || (c->mmq_policy != 0 && c->mmq_policy != 5) || w->type != LUMA_Q4_K ||
        w2->type != LUMA_Q4_K || w->rows != w2->rows || w->cols != w2->cols || w->cols % (4 * RS_K) != 0)
        return false;
    bool took = m <= 64 ? rs_launch<2, 64, 4, rs_q4k, 2>(c, w, xp, m, y, w2, y2)
                        : rs_launch<2, 128, 4, rs_q4k, 2>(c, w, xp, m, y, w2, y2);
    if (took) c->rs_pairs++;
    return took;
}

bool luma_cuda_mmq(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y)
{
    if (!luma_cuda_mmq_takes(c, w, x, m)) return false;
    size_t elems, bytes;
    if (luma_mul_size((size_t)m, (size_t)w->cols, &elems) || luma_mul_size(elems, sizeof(__half), &bytes)) {
        luma_cuda_failf(c, "matmul: %lld x %lld activations are too large", (long long)m, (long long)w->cols);
        return true;
    }
    if (luma_cuda_rs_takes(c, w, x, m)) {
        __half *xp = (__half *)luma_cuda_scratch(c, bytes);
        if (!xp) return true;
        luma_cuda_quantize_act_rs(c, x, (int64_t)elems, xp);
        if (!LUMA_CUDA_OK(c) || luma_cuda_rs(c, w, xp, m, y)) return true;
    }
    bool q8g = w->type == LUMA_Q4_K && c->wgmma && (c->mmq_policy == 4 || (c->mmq_policy == 0 && q8g_wins(c, w, m)));
    bool i8 = q8g || (mmq8_supports(w->type) && (c->mmq_policy == 2 || (c->mmq_policy == 0 && mmq8_wins(w, m))));
    if (!LUMA_CUDA_OK(c)) return true;
    if (!i8 && c->wgmma && (c->mmq_policy == 3 || (c->mmq_policy == 0 && mmq_wg_wins(c, w, m)))) {
        bool took = false;
        switch (w->type) {
        case LUMA_Q4_0: took = mmq_wg_run<mmq_q4_0>(c, w, x, m, y); break;
        case LUMA_Q5_0: took = mmq_wg_run<mmq_q5_0>(c, w, x, m, y); break;
        case LUMA_Q4_K: took = mmq_wg_run<mmq_q4_K>(c, w, x, m, y); break;
        case LUMA_Q5_K: took = mmq_wg_run<mmq_q5_K>(c, w, x, m, y); break;
        case LUMA_Q6_K: took = mmq_wg_run<mmq_q6_K>(c, w, x, m, y); break;
        default: break;   /* Q8_0: a 272-byte span is more than a box */
        }
        if (took) return true;
    }
    mmq_x xa = { NULL, NULL, NULL };
    if (i8) {
        /* int8 values, then (d, d * sum) per 32 from a 256-byte boundary */
        size_t qbytes = (elems + 255) & ~(size_t)255;
        uint8_t *s = (uint8_t *)luma_cuda_scratch(c, qbytes + elems / 32 * sizeof(float2));
        if (!s) return true;
        xa.xq = (const int8_t *)s;
        xa.xds = (const float2 *)(s + qbytes);
        luma_cuda_quantize_act(c, w->type, x, (int64_t)elems, (int8_t *)s, (float2 *)(s + qbytes), NULL);
    } else {
        __half *xh = (__half *)luma_cuda_scratch(c, bytes);
        if (!xh) return true;
        xa.xh = xh;
        luma_cuda_quantize_act(c, w->type, x, (int64_t)elems, NULL, NULL, xh);
    }
    if (!LUMA_CUDA_OK(c)) return true;
    if (q8g && q8g_run(c, w, xa.xq, xa.xds, m, y)) return true;
    switch (w->type) {
    case LUMA_Q4_0: mmq_run<mmq_q4_0>(c, w, xa, m, y); break;
    case LUMA_Q5_0: mmq_run<mmq_q5_0>(c, w, xa, m, y); break;
    case LUMA_Q8_0: mmq_run<mmq_q8_0>(c, w, xa, m, y); break;
    case LUMA_Q4_K: if (i8) mmq_run<mmq8_q4_K>(c, w, xa, m, y); else mmq_run<mmq_q4_K>(c, w, xa, m, y); break;
    case LUMA_Q5_K: if (i8) mmq_run<mmq8_q5_K>(c, w, xa, m, y); else mmq_run<mmq_q5_K>(c, w, xa, m, y); break;
    case LUMA_Q6_K: if (i8) mmq_run<mmq8_q6_K>(c, w, xa, m, y); else mmq_run<mmq_q6_K>(c, w, xa, m, y); break;
    default: break;
    }
    return true;
}

/* ---- for measuring (spec/native/test_cuda_mmq.c) ------------------------------ */

extern "C" void luma_cuda_mmq_policy(luma_backend *be, int policy)
{
    ((cuda_backend *)be)->mmq_policy = policy < 0 ? -1 : policy > 6 ? 6 : policy;
}

/* How many pairs of weights rs_kernel has taken in one launch
 * (luma_cuda_rs_pair). */
extern "C" long long luma_cuda_rs_pairs(luma_backend *be)
{
    return ((cuda_backend *)be)->rs_pairs;
}

/* Whether the wgmma route runs here (policy 3 falls back to the f16 route
 * where it does not). */
extern "C" bool luma_cuda_mmq_has_wgmma(luma_backend *be)
{
    return ((cuda_backend *)be)->wgmma;
}

static __global__ void mmq_wg_probe(int *out)
{
#ifdef MMQ_WG_DEVICE
    *out = 1;
#else
    *out = 0;
#endif
}

/* Whether this build's code for the device has the wgmma kernels (sm_90a
 * machine code on a compute capability 9.0 device); false on any failure,
 * which it clears. */
bool luma_cuda_wgmma_probe(cuda_backend *c)
{
    int *d = NULL, h = 0;
    bool ok = cudaMalloc(&d, sizeof *d) == cudaSuccess;
    if (ok) {
        mmq_wg_probe<<<1, 1, 0, c->stream>>>(d);
        ok = cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, c->stream) == cudaSuccess &&
             cudaStreamSynchronize(c->stream) == cudaSuccess;
    }
    if (d) cudaFree(d);
    cudaGetLastError();
    return ok && h == 1;
}

extern "C" bool luma_cuda_mmq_matmul(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y)
{
    cuda_backend *c = (cuda_backend *)be;
    if (!luma_cuda_mmq(c, w, x->data, x->rows, y->data)) return false;
    y->rows = x->rows;
    y->cols = w->rows;
    return true;
}
