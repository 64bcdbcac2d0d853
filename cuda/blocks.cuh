/* Device helpers that the kernels reading GGUF blocks share (matmul.cu,
 * mmq.cu, tall.cu): half-float bits, the Q5 high bits, the K-quant 6-bit
 * scales, and the f16 tensor-core product of one m16n8k16 tile. */
#ifndef LUMA_CUDA_BLOCKS_CUH
#define LUMA_CUDA_BLOCKS_CUH

#include <cuda_fp16.h>
#include <stdint.h>

static __device__ __forceinline__ float f16_bits(uint32_t h)
{
    return __half2float(__ushort_as_half((unsigned short)h));
}

/* Bits 0..3 of b to bit 4 of bytes 0..3: the fifth bit of four Q5 values. */
static __device__ __forceinline__ uint32_t bits4_to_bytes(uint32_t b)
{
    return (b & 1) << 4 | (b & 2) << 11 | (b & 4) << 18 | (b & 8) << 25;
}

/* Q4_K and Q5_K scale and minimum of sub-block s (src/quant.c
 * scale_min_k4) from the three words of the 12 scale bytes; s is a run-time
 * index, so the bytes are picked by shifts rather than from an array. */
static __device__ __forceinline__ void scale_min_k4(int s, uint32_t w1, uint32_t w2, uint32_t w3, int &sc, int &m)
{
    if (s < 4) {
        sc = (w1 >> 8 * s) & 63;
        m = (w2 >> 8 * s) & 63;
    } else {
        int b = 8 * (s - 4);
        sc = ((w3 >> b) & 0xF) | ((w1 >> (b + 6)) & 3) << 4;
        m = ((w3 >> (b + 4)) & 0xF) | ((w2 >> (b + 6)) & 3) << 4;
    }
}

/* The scales and minimums of sub-blocks 2 sj and 2 sj + 1 (scale_min_k4's)
 * without a branch, two to a word: sc holds 2 sj's scale in byte 0 and
 * 2 sj + 1's in byte 1, m their minimums (a lane's sj is fixed, and where
 * the 8 lanes of a block take both halves of the branch, a warp would run
 * both). The low 4 bits come from a (mm), bits 4 and 5 from t1 (t2) >> sh. */
static __device__ __forceinline__ void scale_min_k4_pair_packed(int sj, uint32_t w1, uint32_t w2, uint32_t w3,
                                                                uint32_t &sc, uint32_t &m)
{
    const int b = 16 * (sj & 1), sh = sj >= 2 ? 2 : 0;
    const uint32_t t1 = w1 >> b, t2 = w2 >> b, t3 = w3 >> b;
    const uint32_t a = sj >= 2 ? t3 : t1, mm = sj >= 2 ? t3 >> 4 : t2;
    sc = ((a & 0x0F0Fu) | ((t1 >> sh) & ~0x0F0Fu)) & 0x3F3Fu;
    m = ((mm & 0x0F0Fu) | ((t2 >> sh) & ~0x0F0Fu)) & 0x3F3Fu;
}

/* The same four values one to an int. */
static __device__ __forceinline__ void scale_min_k4_pair(int sj, uint32_t w1, uint32_t w2, uint32_t w3, int &s0,
                                                         int &m0, int &s1, int &m1)
{
    uint32_t sc, m;
    scale_min_k4_pair_packed(sj, w1, w2, w3, sc, m);
    s0 = (int)(sc & 0xFF);
    s1 = (int)(sc >> 8);
    m0 = (int)(m & 0xFF);
    m1 = (int)(m >> 8);
}

/* An integer as a float, exactly for |c| < 2^22 (the sums of a block's
 * products, its scales), with two full-rate instructions instead of one
 * quarter-rate conversion. */
static __device__ __forceinline__ float i2f(int c)
{
    return __int_as_float(c + 0x4B400000) - 12582912.0f;
}

/* Byte i (0 or 1) of v as a float, exactly: i2f's trick with the byte put
 * into 0x4B400000 by one byte permute. */
static __device__ __forceinline__ float byte_f(uint32_t v, int i)
{
    return __int_as_float((int)__byte_perm(v, 0x4B400000u, i == 0 ? 0x7650 : 0x7651)) - 12582912.0f;
}

/* Two floats as the f16 pair of one 32-bit register (lo in the low half). */
static __device__ __forceinline__ uint32_t pack_h2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

/* c += A B, int8: m16n8k32 (a: rows g, g + 8 at k 4t..4t+3, then the same
 * at 16 + 4t..; b0, b1: k 4t.. and 16 + 4t.. of column g) and m16n8k16
 * (a0, a1: rows g, g + 8 at k 4t..4t+3; b: those k of column g). */
static __device__ __forceinline__ void mma_s8_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void mma_s8_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b)
{
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

/* rs_kernel (mmq.cu) takes Q4_K weights as wgmma's A operand straight from
 * their quant bytes: for half a superblock (128 k, 64 bytes a row) thread t
 * of a quad reads bytes 16 t .. 16 t + 15, and each 32-bit word u of them
 * gives the k16 chunks 2 u (low nibbles) and 2 u + 1 (high nibbles), bytes
 * 0 and 2 in the A slots 2 t, 2 t + 1, bytes 1 and 3 in 2 t + 8, 2 t + 9.
 * The activations are stored in that k order: element el (0 .. 127) of a
 * half superblock goes to position rs_q4k_pos(el). In Q4_K, byte l of the
 * 32-byte pair p holds elements 64 p + l (low nibble) and 64 p + 32 + l. */
static __host__ __device__ __forceinline__ int rs_q4k_pos(int el)
{
    int p = el >> 6, e = (el >> 5) & 1, l = el & 31, t = 2 * p + (l >> 4), i = l & 15;
    return 16 * (2 * (i >> 2) + e) + 8 * (i & 1) + 2 * t + ((i >> 1) & 1);
}

/* c += A B for one m16n8k16 tile: a holds the A fragment (rows g, g + 8;
 * k slots 2t, 2t + 1 and 2t + 8, 2t + 9), b0 and b1 the B fragment. */
static __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif
