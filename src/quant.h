/* Number formats: the block layouts of GGUF tensor types, scalar reference
 * (de)quantization, and dot products of a weight row with an activation row
 * quantized to the matching activation format.
 *
 * Type numbers are those stored in GGUF tensor infos. A row of n elements of
 * a block type holds n / block_size blocks of type_size bytes.
 *
 * Activation formats (act_type): F32, F16 and BF16 weights meet F32
 * activations; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights meet Q8_0 activations;
 * the K formats (and Q8_K) meet Q8_K activations, whose bsums carry the sums
 * the K formats' minimums and offsets need. */
#ifndef LUMA_QUANT_H
#define LUMA_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum luma_type {
    LUMA_F32 = 0, LUMA_F16 = 1, LUMA_Q4_0 = 2, LUMA_Q4_1 = 3,
    LUMA_Q5_0 = 6, LUMA_Q5_1 = 7, LUMA_Q8_0 = 8, LUMA_Q8_1 = 9,
    LUMA_Q2_K = 10, LUMA_Q3_K = 11, LUMA_Q4_K = 12, LUMA_Q5_K = 13,
    LUMA_Q6_K = 14, LUMA_Q8_K = 15,
    LUMA_BF16 = 30,
    LUMA_TYPE_COUNT = 40
};

#define LUMA_QK 32     /* elements per block of the legacy formats */
#define LUMA_QK_K 256  /* elements per super-block of the K formats */

/* Block layouts, byte for byte as stored in GGUF files. `d`, `m`, `dmin`
 * are IEEE half floats stored as uint16_t. Element j of a block decodes as:
 *   Q4_0  d * (nibble_j - 8)          nibble_j: low nibbles of qs[0..15] are
 *   Q4_1  d * nibble_j + m              elements 0..15, high nibbles 16..31
 *   Q5_0  d * ((nibble_j | bit_j << 4) - 16)   bit_j: bit j of qh (a
 *   Q5_1  d * (nibble_j | bit_j << 4) + m        little-endian uint32)
 *   Q8_0  d * qs[j]
 * The K formats split a super-block into sub-blocks with 4- to 8-bit scales;
 * luma_dequantize_row in quant.c spells out each one's bit packing. */
typedef struct { uint16_t d; uint8_t qs[LUMA_QK / 2]; } luma_block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[LUMA_QK / 2]; } luma_block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[LUMA_QK / 2]; } luma_block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[LUMA_QK / 2]; } luma_block_q5_1;
typedef struct { uint16_t d; int8_t qs[LUMA_QK]; } luma_block_q8_0;
typedef struct { uint8_t scales[LUMA_QK_K / 16]; uint8_t qs[LUMA_QK_K / 4]; uint16_t d, dmin; } luma_block_q2_K;
typedef struct { uint8_t hmask[LUMA_QK_K / 8]; uint8_t qs[LUMA_QK_K / 4]; uint8_t scales[12]; uint16_t d; } luma_block_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[LUMA_QK_K / 2]; } luma_block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[LUMA_QK_K / 8]; uint8_t qs[LUMA_QK_K / 2]; } luma_block_q5_K;
typedef struct { uint8_t ql[LUMA_QK_K / 2]; uint8_t qh[LUMA_QK_K / 4]; int8_t scales[LUMA_QK_K / 16]; uint16_t d; } luma_block_q6_K;
/* Activation super-block: float scale, 256 int8 values, and the sums of each
 * group of 16 (used by the K formats' minimums). */
typedef struct { float d; int8_t qs[LUMA_QK_K]; int16_t bsums[LUMA_QK_K / 16]; } luma_block_q8_K;

/* dot(n, w, a): the dot product of one weight row (n elements of its type)
 * with one activation row (n elements of the type's act_type). */
typedef float (*luma_vec_dot_fn)(int64_t n, const void *w, const void *a);

typedef struct luma_type_traits {
    const char *name;           /* "Q4_K"; NULL for an unknown type number */
    int64_t block_size;         /* elements per block */
    size_t type_size;           /* bytes per block */
    bool is_quantized;
    enum luma_type act_type;    /* format the activations are quantized to */
} luma_type_traits;

/* NULL when t is not a type luma knows (Q8_1 is not: no file stores it). */
const luma_type_traits *luma_type_get(uint32_t t);
const char *luma_type_name(uint32_t t);
/* Bytes of a row of n elements; 0 when the type is unknown, n is not a
 * positive multiple of the block size, or the size overflows. */
size_t luma_row_size(enum luma_type t, int64_t n);

/* IEEE conversions: round to nearest even, overflow to infinity, NaN stays
 * NaN (quieted), subnormals kept. */
float luma_f16_to_f32(uint16_t h);
uint16_t luma_f32_to_f16(float f);
float luma_bf16_to_f32(uint16_t h);
uint16_t luma_f32_to_bf16(float f);
/* n halves to floats; F16C when the CPU has it. */
void luma_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);

/* Sub-block j's 6-bit scale and minimum of a Q4_K or Q5_K block, from its
 * 12 packed bytes q. */
void luma_scale_min_k4(int j, const uint8_t *q, int *sc, int *m);

/* Dequantization of n elements (n a multiple of the block size; a partial
 * last block is not read), as src/quant.c spells it out; also decodes Q8_K.
 * Dispatches to the SIMD version where the CPU has one for t, which gives
 * the same bits (the same float operations per element). */
void luma_dequantize_row(enum luma_type t, const void *src, float *dst, int64_t n);
/* Always the scalar version (tests compare the two). */
void luma_dequantize_row_ref(enum luma_type t, const void *src, float *dst, int64_t n);
/* Quantizes n floats to an activation format (F32, Q8_0 or Q8_K; n a
 * multiple of its block size), rounding like GGML's reference quantize_row_q8_0 (half away from zero) and
 * quantize_row_q8_K (half to even, the largest magnitude maps to -127);
 * dispatches to the SIMD version when the CPU has it, which gives the same
 * bytes. Other types leave dst untouched. */
void luma_quantize_act(enum luma_type t, const float *src, void *dst, int64_t n);
/* Always the scalar version (tests compare the two). */
void luma_quantize_act_ref(enum luma_type t, const float *src, void *dst, int64_t n);

/* The dot product for weights of type t against activations of
 * luma_type_get(t)->act_type: AVX2/FMA when the CPU supports it, else scalar
 * (Q8_K weights, which no file holds, always take the scalar one). NULL for
 * a type without one. */
luma_vec_dot_fn luma_vec_dot_get(enum luma_type t);
/* Always the scalar reference (tests compare the two). */
luma_vec_dot_fn luma_vec_dot_ref(enum luma_type t);
/* Whether the SIMD path is in use ("avx2" or "scalar"). */
const char *luma_simd_name(void);

/* A tile of dot products: nr weight rows (w, w_stride bytes apart) against na
 * activation rows (a, a_stride bytes apart, in t's act_type), all of n
 * elements: out[j * out_stride + i] = dot(weight row i, activation row j).
 * The SIMD version decodes each weight block once for up to 4 activation
 * rows, so a caller gains by passing several tokens at once and by keeping
 * the tile (nr rows of weights, na of activations) small enough for L1/L2.
 * Does nothing for a type without a dot product. */
void luma_vec_dot_rows(enum luma_type t, int64_t n, const void *w, size_t w_stride, int nr,
                       const void *a, size_t a_stride, int na, float *out, size_t out_stride);

#endif
