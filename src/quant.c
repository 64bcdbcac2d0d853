/* Scalar reference of the number formats: type traits, half and bfloat
 * conversions, dequantization, activation quantizers and dot products, plus
 * the run-time choice of the AVX2 kernels (cpu/quant_avx2.c). The loops
 * follow the element order of each format literally; they define what the
 * SIMD kernels must compute, and dequantize bit for bit as the gguf Python
 * package does (spec/data/quant-golden.bin pins that). */
#include "quant.h"
#include "cpu/quant_simd.h"

#include <math.h>
#include <string.h>

/* The golden values were computed with separate rounding of each product and
 * sum; contracting a*b+c into one fused operation would change the last bit. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

_Static_assert(sizeof(luma_block_q4_0) == 18, "Q4_0 block layout");
_Static_assert(sizeof(luma_block_q4_1) == 20, "Q4_1 block layout");
_Static_assert(sizeof(luma_block_q5_0) == 22, "Q5_0 block layout");
_Static_assert(sizeof(luma_block_q5_1) == 24, "Q5_1 block layout");
_Static_assert(sizeof(luma_block_q8_0) == 34, "Q8_0 block layout");
_Static_assert(sizeof(luma_block_q2_K) == 84, "Q2_K block layout");
_Static_assert(sizeof(luma_block_q3_K) == 110, "Q3_K block layout");
_Static_assert(sizeof(luma_block_q4_K) == 144, "Q4_K block layout");
_Static_assert(sizeof(luma_block_q5_K) == 176, "Q5_K block layout");
_Static_assert(sizeof(luma_block_q6_K) == 210, "Q6_K block layout");
_Static_assert(sizeof(luma_block_q8_K) == 292, "Q8_K block layout");

static const luma_type_traits type_traits[LUMA_TYPE_COUNT] = {
    [LUMA_F32]  = { "F32",  1, 4, false, LUMA_F32 },
    [LUMA_F16]  = { "F16",  1, 2, false, LUMA_F32 },
    [LUMA_BF16] = { "BF16", 1, 2, false, LUMA_F32 },
    [LUMA_Q4_0] = { "Q4_0", LUMA_QK, sizeof(luma_block_q4_0), true, LUMA_Q8_0 },
    [LUMA_Q4_1] = { "Q4_1", LUMA_QK, sizeof(luma_block_q4_1), true, LUMA_Q8_0 },
    [LUMA_Q5_0] = { "Q5_0", LUMA_QK, sizeof(luma_block_q5_0), true, LUMA_Q8_0 },
    [LUMA_Q5_1] = { "Q5_1", LUMA_QK, sizeof(luma_block_q5_1), true, LUMA_Q8_0 },
    [LUMA_Q8_0] = { "Q8_0", LUMA_QK, sizeof(luma_block_q8_0), true, LUMA_Q8_0 },
    [LUMA_Q2_K] = { "Q2_K", LUMA_QK_K, sizeof(luma_block_q2_K), true, LUMA_Q8_K },
    [LUMA_Q3_K] = { "Q3_K", LUMA_QK_K, sizeof(luma_block_q3_K), true, LUMA_Q8_K },
    [LUMA_Q4_K] = { "Q4_K", LUMA_QK_K, sizeof(luma_block_q4_K), true, LUMA_Q8_K },
    [LUMA_Q5_K] = { "Q5_K", LUMA_QK_K, sizeof(luma_block_q5_K), true, LUMA_Q8_K },
    [LUMA_Q6_K] = { "Q6_K", LUMA_QK_K, sizeof(luma_block_q6_K), true, LUMA_Q8_K },
    [LUMA_Q8_K] = { "Q8_K", LUMA_QK_K, sizeof(luma_block_q8_K), true, LUMA_Q8_K },
};

const luma_type_traits *luma_type_get(uint32_t t)
{
    if (t >= LUMA_TYPE_COUNT || !type_traits[t].name) return NULL;
    return &type_traits[t];
}

const char *luma_type_name(uint32_t t)
{
    const luma_type_traits *tr = luma_type_get(t);
    return tr ? tr->name : "unknown";
}

size_t luma_row_size(enum luma_type t, int64_t n)
{
    const luma_type_traits *tr = luma_type_get(t);
    if (!tr || n <= 0 || n % tr->block_size != 0) return 0;
    uint64_t blocks = (uint64_t)(n / tr->block_size);
    if (blocks > SIZE_MAX / tr->type_size) return 0;
    return (size_t)blocks * tr->type_size;
}

/* The AVX2 kernels also use F16C, which every AVX2 CPU has (Intel since Ivy
 * Bridge, AMD since Piledriver, both before AVX2). */
static bool have_avx2(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

const char *luma_simd_name(void)
{
    return have_avx2() ? "avx2" : "scalar";
}

/* ---- half and bfloat ---------------------------------------------------- */

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* half: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. */
float luma_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000 | mant << 13);
    if (exp != 0) return f32_from_bits(sign | (exp + 112) << 23 | mant << 13);
    if (mant == 0) return f32_from_bits(sign);
    /* subnormal mant * 2^-24: shift the leading one into the implicit bit */
    uint32_t e = 113;
    while (!(mant & 0x400)) {
        mant <<= 1;
        e--;
    }
    return f32_from_bits(sign | e << 23 | (mant & 0x3ff) << 13);
}

uint16_t luma_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* >= 65520 rounds to inf */
    if (ax >= 0x38800000) {                                  /* >= 2^-14: a normal half */
        uint32_t r = ax - (112u << 23);
        return (uint16_t)(sign | ((r + 0xfff + ((r >> 13) & 1)) >> 13));
    }
    if (ax < 0x33000000) return sign;                        /* < 2^-25 rounds to zero */
    /* subnormal half: round m * 2^(e-150) to a multiple of 2^-24 */
    uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e, h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

float luma_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t luma_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

void luma_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n)
{
#if defined(__x86_64__)
    if (have_avx2()) {
        luma_f16_to_f32_row_avx2(src, dst, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = luma_f16_to_f32(src[i]);
}

/* ---- scale packing of the K formats ------------------------------------- */

/* Q4_K and Q5_K: eight 6-bit scales and eight 6-bit minimums in 12 bytes.
 * Bytes 0..3: scales 0..3 (low 6 bits), top 2 bits of scales 4..7;
 * bytes 4..7: the same for the minimums;
 * bytes 8..11: low 4 bits of scales 4..7 (low nibble), of minimums 4..7 (high). */
void luma_scale_min_k4(int j, const uint8_t *q, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K: sixteen 6-bit scales, stored offset by 32, in 12 bytes. Bytes 0..7
 * hold the low 4 bits (scales 0..7 in the low nibbles, 8..15 in the high);
 * bytes 8..11 the top 2 bits: scale j in byte 8 + j % 4 at bit 2 * (j / 4). */
static void q3_k_scales(const uint8_t *s, int sc[16])
{
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (lo | hi << 4) - 32;
    }
}

/* The K formats with 2-bit (Q2_K, Q3_K) and 6-bit (Q6_K) values lay a
 * super-block out as two halves of 128 elements; element 128c + 32k + l
 * (k < 4, l < 32) takes bit pair k of byte l of the half's packed bytes and
 * uses sub-block scale 8c + 2k + l / 16. */

/* ---- dequantization ----------------------------------------------------- */

static void dequant_q4_0(const luma_block_q4_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        float d = luma_f16_to_f32(x->d);
        for (int j = 0; j < LUMA_QK / 2; j++) {
            y[j] = d * (float)((x->qs[j] & 0xF) - 8);
            y[j + LUMA_QK / 2] = d * (float)((x->qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const luma_block_q4_1 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        float d = luma_f16_to_f32(x->d), m = luma_f16_to_f32(x->m);
        for (int j = 0; j < LUMA_QK / 2; j++) {
            y[j] = d * (float)(x->qs[j] & 0xF) + m;
            y[j + LUMA_QK / 2] = d * (float)(x->qs[j] >> 4) + m;
        }
    }
}

static uint32_t load_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 5-bit values of elements j and j + 16 (j < 16) of a Q5_0/Q5_1 block. */
static int q5_lo(const uint8_t *qs, uint32_t qh, int j)
{
    return (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
}

static int q5_hi(const uint8_t *qs, uint32_t qh, int j)
{
    return (qs[j] >> 4) | (int)((qh >> (j + LUMA_QK / 2)) & 1) << 4;
}

static void dequant_q5_0(const luma_block_q5_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        float d = luma_f16_to_f32(x->d);
        uint32_t qh = load_u32le(x->qh);
        for (int j = 0; j < LUMA_QK / 2; j++) {
            y[j] = d * (float)(q5_lo(x->qs, qh, j) - 16);
            y[j + LUMA_QK / 2] = d * (float)(q5_hi(x->qs, qh, j) - 16);
        }
    }
}

static void dequant_q5_1(const luma_block_q5_1 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        float d = luma_f16_to_f32(x->d), m = luma_f16_to_f32(x->m);
        uint32_t qh = load_u32le(x->qh);
        for (int j = 0; j < LUMA_QK / 2; j++) {
            y[j] = d * (float)q5_lo(x->qs, qh, j) + m;
            y[j + LUMA_QK / 2] = d * (float)q5_hi(x->qs, qh, j) + m;
        }
    }
}

static void dequant_q8_0(const luma_block_q8_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        float d = luma_f16_to_f32(x->d);
        for (int j = 0; j < LUMA_QK; j++) y[j] = d * (float)x->qs[j];
    }
}

static void dequant_q2_K(const luma_block_q2_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = luma_f16_to_f32(x->d), dmin = luma_f16_to_f32(x->dmin);
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int g = 8 * c + 2 * k + l / 16;
                    float dl = d * (float)(x->scales[g] & 0xF), ml = dmin * (float)(x->scales[g] >> 4);
                    int q = (x->qs[32 * c + l] >> (2 * k)) & 3;
                    y[128 * c + 32 * k + l] = dl * (float)q - ml;
                }
    }
}

/* Q3_K: value = 2 low bits - (high bit clear ? 4 : 0); the high bit of
 * element 128c + 32k + l is bit 4c + k of hmask[l]. */
static int q3_k_value(const luma_block_q3_K *x, int c, int k, int l)
{
    int lo = (x->qs[32 * c + l] >> (2 * k)) & 3;
    return (x->hmask[l] >> (4 * c + k)) & 1 ? lo : lo - 4;
}

static void dequant_q3_K(const luma_block_q3_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = luma_f16_to_f32(x->d);
        int sc[16];
        q3_k_scales(x->scales, sc);
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    float dl = d * (float)sc[8 * c + 2 * k + l / 16];
                    y[128 * c + 32 * k + l] = dl * (float)q3_k_value(x, c, k, l);
                }
    }
}

/* Q4_K and Q5_K: sub-block 2j + h (32 elements) is the low (h = 0) or high
 * (h = 1) nibbles of qs[32j .. 32j + 31]; Q5_K's fifth bit of element l of
 * sub-block s is bit s of qh[l]. */
static void dequant_q4_K(const luma_block_q4_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = luma_f16_to_f32(x->d), dmin = luma_f16_to_f32(x->dmin);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            luma_scale_min_k4(s, x->scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int q = (x->qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
                y[32 * s + l] = d1 * (float)q - m1;
            }
        }
    }
}

static void dequant_q5_K(const luma_block_q5_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = luma_f16_to_f32(x->d), dmin = luma_f16_to_f32(x->dmin);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            luma_scale_min_k4(s, x->scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int q = ((x->qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) | ((x->qh[l] >> s) & 1) << 4;
                y[32 * s + l] = d1 * (float)q - m1;
            }
        }
    }
}

/* Q6_K: element 128c + 32k + l has its low 4 bits in ql[64c + 32(k % 2) + l]
 * (low nibble for k < 2, high for k >= 2), its top 2 bits at bit 2k of
 * qh[32c + l]; value = those 6 bits - 32. */
static int q6_k_value(const luma_block_q6_K *x, int c, int k, int l)
{
    int lo = (x->ql[64 * c + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
    int hi = (x->qh[32 * c + l] >> (2 * k)) & 3;
    return (lo | hi << 4) - 32;
}

static void dequant_q6_K(const luma_block_q6_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = luma_f16_to_f32(x->d);
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    float dl = d * (float)x->scales[8 * c + 2 * k + l / 16];
                    y[128 * c + 32 * k + l] = dl * (float)q6_k_value(x, c, k, l);
                }
    }
}

static void dequant_q8_K(const luma_block_q8_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K)
        for (int j = 0; j < LUMA_QK_K; j++) y[j] = x->d * (float)x->qs[j];
}

void luma_dequantize_row(enum luma_type t, const void *src, float *dst, int64_t n)
{
    const luma_type_traits *tr = luma_type_get(t);
    if (!tr || n <= 0) return;
#if defined(__x86_64__)
    if (have_avx2() && luma_dequantize_avx2(t, src, dst, n / tr->block_size)) return;
#endif
    luma_dequantize_row_ref(t, src, dst, n);
}

void luma_dequantize_row_ref(enum luma_type t, const void *src, float *dst, int64_t n)
{
    const luma_type_traits *tr = luma_type_get(t);
    if (!tr || n <= 0) return;
    int64_t nb = n / tr->block_size;
    const uint16_t *h = src;
    switch (t) {
    case LUMA_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case LUMA_F16: for (int64_t i = 0; i < n; i++) dst[i] = luma_f16_to_f32(h[i]); break;
    case LUMA_BF16: for (int64_t i = 0; i < n; i++) dst[i] = luma_bf16_to_f32(h[i]); break;
    case LUMA_Q4_0: dequant_q4_0(src, dst, nb); break;
    case LUMA_Q4_1: dequant_q4_1(src, dst, nb); break;
    case LUMA_Q5_0: dequant_q5_0(src, dst, nb); break;
    case LUMA_Q5_1: dequant_q5_1(src, dst, nb); break;
    case LUMA_Q8_0: dequant_q8_0(src, dst, nb); break;
    case LUMA_Q2_K: dequant_q2_K(src, dst, nb); break;
    case LUMA_Q3_K: dequant_q3_K(src, dst, nb); break;
    case LUMA_Q4_K: dequant_q4_K(src, dst, nb); break;
    case LUMA_Q5_K: dequant_q5_K(src, dst, nb); break;
    case LUMA_Q6_K: dequant_q6_K(src, dst, nb); break;
    case LUMA_Q8_K: dequant_q8_K(src, dst, nb); break;
    default: break;
    }
}

/* ---- activation quantizers ---------------------------------------------- */

/* Q8_0: d = max|x| / 127, q = round(x / d) half away from zero. */
static void quantize_q8_0(const float *x, luma_block_q8_0 *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += LUMA_QK, y++) {
        float amax = 0.0f;
        for (int j = 0; j < LUMA_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y->d = luma_f32_to_f16(d);
        for (int j = 0; j < LUMA_QK; j++) y->qs[j] = (int8_t)roundf(x[j] * id);
    }
}

/* Round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves
 * the rounded integer in the low mantissa bits. */
static int nearest_int(float v)
{
    uint32_t i = f32_bits(v + 12582912.0f);
    return (int)(i & 0x007fffff) - 0x00400000;
}

/* Q8_K: the element of largest magnitude (the first one, on ties) maps to
 * -127; the others round to nearest even and clamp at 127; d = 1 / scale. */
static void quantize_q8_K(const float *x, luma_block_q8_K *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += LUMA_QK_K, y++) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < LUMA_QK_K; j++)
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        if (amax == 0.0f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < LUMA_QK_K; j++) {
            int v = nearest_int(iscale * x[j]);
            y->qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < LUMA_QK_K / 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y->qs[16 * g + j];
            y->bsums[g] = (int16_t)s;
        }
        y->d = 1.0f / iscale;
    }
}

void luma_quantize_act_ref(enum luma_type t, const float *src, void *dst, int64_t n)
{
    if (n <= 0) return;
    switch (t) {
    case LUMA_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case LUMA_Q8_0: quantize_q8_0(src, dst, n / LUMA_QK); break;
    case LUMA_Q8_K: quantize_q8_K(src, dst, n / LUMA_QK_K); break;
    default: break;
    }
}

void luma_quantize_act(enum luma_type t, const float *src, void *dst, int64_t n)
{
#if defined(__x86_64__)
    if (n > 0 && have_avx2()) {
        if (t == LUMA_Q8_0) {
            luma_quantize_q8_0_avx2(src, dst, n / LUMA_QK);
            return;
        }
        if (t == LUMA_Q8_K) {
            luma_quantize_q8_K_avx2(src, dst, n / LUMA_QK_K);
            return;
        }
    }
#endif
    luma_quantize_act_ref(t, src, dst, n);
}

/* ---- dot products ------------------------------------------------------- */

/* The float formats sum in double: the reference the SIMD sums are held to. */
static float dot_f32(int64_t n, const void *w, const void *a)
{
    const float *x = w, *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)y[i];
    return (float)s;
}

static float dot_f16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w;
    const float *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)luma_f16_to_f32(x[i]) * (double)y[i];
    return (float)s;
}

static float dot_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w;
    const float *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)luma_bf16_to_f32(x[i]) * (double)y[i];
    return (float)s;
}

/* The block formats sum each block exactly in integers, then scale it. */
static float dot_q4_0(int64_t n, const void *w, const void *a)
{
    const luma_block_q4_0 *x = w;
    const luma_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK; b++, x++, y++) {
        int s = 0;
        for (int j = 0; j < LUMA_QK / 2; j++)
            s += ((x->qs[j] & 0xF) - 8) * y->qs[j] + ((x->qs[j] >> 4) - 8) * y->qs[j + LUMA_QK / 2];
        sum += (float)s * (luma_f16_to_f32(x->d) * luma_f16_to_f32(y->d));
    }
    return sum;
}

static float dot_q4_1(int64_t n, const void *w, const void *a)
{
    const luma_block_q4_1 *x = w;
    const luma_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK; b++, x++, y++) {
        int s = 0, sy = 0;
        for (int j = 0; j < LUMA_QK / 2; j++) {
            s += (x->qs[j] & 0xF) * y->qs[j] + (x->qs[j] >> 4) * y->qs[j + LUMA_QK / 2];
            sy += y->qs[j] + y->qs[j + LUMA_QK / 2];
        }
        float dy = luma_f16_to_f32(y->d);
        sum += (float)s * (luma_f16_to_f32(x->d) * dy) + (float)sy * (luma_f16_to_f32(x->m) * dy);
    }
    return sum;
}

static float dot_q5_0(int64_t n, const void *w, const void *a)
{
    const luma_block_q5_0 *x = w;
    const luma_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK; b++, x++, y++) {
        uint32_t qh = load_u32le(x->qh);
        int s = 0;
        for (int j = 0; j < LUMA_QK / 2; j++)
            s += (q5_lo(x->qs, qh, j) - 16) * y->qs[j] + (q5_hi(x->qs, qh, j) - 16) * y->qs[j + LUMA_QK / 2];
        sum += (float)s * (luma_f16_to_f32(x->d) * luma_f16_to_f32(y->d));
    }
    return sum;
}

static float dot_q5_1(int64_t n, const void *w, const void *a)
{
    const luma_block_q5_1 *x = w;
    const luma_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK; b++, x++, y++) {
        uint32_t qh = load_u32le(x->qh);
        int s = 0, sy = 0;
        for (int j = 0; j < LUMA_QK / 2; j++) {
            s += q5_lo(x->qs, qh, j) * y->qs[j] + q5_hi(x->qs, qh, j) * y->qs[j + LUMA_QK / 2];
            sy += y->qs[j] + y->qs[j + LUMA_QK / 2];
        }
        float dy = luma_f16_to_f32(y->d);
        sum += (float)s * (luma_f16_to_f32(x->d) * dy) + (float)sy * (luma_f16_to_f32(x->m) * dy);
    }
    return sum;
}

static float dot_q8_0(int64_t n, const void *w, const void *a)
{
    const luma_block_q8_0 *x = w;
    const luma_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK; b++, x++, y++) {
        int s = 0;
        for (int j = 0; j < LUMA_QK; j++) s += x->qs[j] * y->qs[j];
        sum += (float)s * (luma_f16_to_f32(x->d) * luma_f16_to_f32(y->d));
    }
    return sum;
}

/* The K dots: per super-block, sumi = sum over sub-blocks of scale x the
 * integer dot, and the minimums meet the activation's bsums; the result is
 * y.d * (d * sumi - dmin * summ). */
static float dot_q2_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q2_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int sumi = 0, summ = 0;
        for (int g = 0; g < 16; g++) summ += (x->scales[g] >> 4) * y->bsums[g];
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int h = 0; h < 2; h++) {
                    int s = 0;
                    for (int l = 16 * h; l < 16 * h + 16; l++)
                        s += ((x->qs[32 * c + l] >> (2 * k)) & 3) * y->qs[128 * c + 32 * k + l];
                    sumi += (x->scales[8 * c + 2 * k + h] & 0xF) * s;
                }
        sum += y->d * (luma_f16_to_f32(x->d) * (float)sumi - luma_f16_to_f32(x->dmin) * (float)summ);
    }
    return sum;
}

static float dot_q3_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q3_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int sc[16], sumi = 0;
        q3_k_scales(x->scales, sc);
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int h = 0; h < 2; h++) {
                    int s = 0;
                    for (int l = 16 * h; l < 16 * h + 16; l++)
                        s += q3_k_value(x, c, k, l) * y->qs[128 * c + 32 * k + l];
                    sumi += sc[8 * c + 2 * k + h] * s;
                }
        sum += y->d * luma_f16_to_f32(x->d) * (float)sumi;
    }
    return sum;
}

static float dot_q4_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q4_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; s++) {
            int sc, m, dot = 0;
            luma_scale_min_k4(s, x->scales, &sc, &m);
            for (int l = 0; l < 32; l++)
                dot += ((x->qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) * y->qs[32 * s + l];
            sumi += sc * dot;
            summ += m * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
        }
        sum += y->d * (luma_f16_to_f32(x->d) * (float)sumi - luma_f16_to_f32(x->dmin) * (float)summ);
    }
    return sum;
}

static float dot_q5_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q5_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; s++) {
            int sc, m, dot = 0;
            luma_scale_min_k4(s, x->scales, &sc, &m);
            for (int l = 0; l < 32; l++) {
                int q = ((x->qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) | ((x->qh[l] >> s) & 1) << 4;
                dot += q * y->qs[32 * s + l];
            }
            sumi += sc * dot;
            summ += m * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
        }
        sum += y->d * (luma_f16_to_f32(x->d) * (float)sumi - luma_f16_to_f32(x->dmin) * (float)summ);
    }
    return sum;
}

static float dot_q6_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q6_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int sumi = 0;
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 4; k++)
                for (int h = 0; h < 2; h++) {
                    int s = 0;
                    for (int l = 16 * h; l < 16 * h + 16; l++)
                        s += q6_k_value(x, c, k, l) * y->qs[128 * c + 32 * k + l];
                    sumi += x->scales[8 * c + 2 * k + h] * s;
                }
        sum += y->d * luma_f16_to_f32(x->d) * (float)sumi;
    }
    return sum;
}

static float dot_q8_K(int64_t n, const void *w, const void *a)
{
    const luma_block_q8_K *x = w;
    const luma_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / LUMA_QK_K; b++, x++, y++) {
        int s = 0;
        for (int j = 0; j < LUMA_QK_K; j++) s += x->qs[j] * y->qs[j];
        sum += (float)s * (x->d * y->d);
    }
    return sum;
}

luma_vec_dot_fn luma_vec_dot_ref(enum luma_type t)
{
    switch (t) {
    case LUMA_F32: return dot_f32;
    case LUMA_F16: return dot_f16;
    case LUMA_BF16: return dot_bf16;
    case LUMA_Q4_0: return dot_q4_0;
    case LUMA_Q4_1: return dot_q4_1;
    case LUMA_Q5_0: return dot_q5_0;
    case LUMA_Q5_1: return dot_q5_1;
    case LUMA_Q8_0: return dot_q8_0;
    case LUMA_Q2_K: return dot_q2_K;
    case LUMA_Q3_K: return dot_q3_K;
    case LUMA_Q4_K: return dot_q4_K;
    case LUMA_Q5_K: return dot_q5_K;
    case LUMA_Q6_K: return dot_q6_K;
    case LUMA_Q8_K: return dot_q8_K;
    default: return NULL;
    }
}

luma_vec_dot_fn luma_vec_dot_get(enum luma_type t)
{
#if defined(__x86_64__)
    if (have_avx2()) {
        luma_vec_dot_fn f = luma_vec_dot_avx2(t);
        if (f) return f;
    }
#endif
    return luma_vec_dot_ref(t);
}

void luma_vec_dot_rows(enum luma_type t, int64_t n, const void *w, size_t w_stride, int nr,
                       const void *a, size_t a_stride, int na, float *out, size_t out_stride)
{
#if defined(__x86_64__)
    if (have_avx2()) {
        luma_vec_rows_fn f = luma_vec_rows_avx2(t);
        if (f) {
            f(n, w, w_stride, nr, a, a_stride, na, out, out_stride);
            return;
        }
    }
#endif
    luma_vec_dot_fn dot = luma_vec_dot_ref(t);
    if (!dot) return;
    for (int j = 0; j < na; j++)
        for (int i = 0; i < nr; i++)
            out[(size_t)j * out_stride + (size_t)i] =
                dot(n, (const uint8_t *)w + (size_t)i * w_stride, (const uint8_t *)a + (size_t)j * a_stride);
}
