/* The AVX2/FMA/F16C kernels of quant.h, defined in quant_avx2.c (built on
 * x86-64 only); quant.c calls them when the CPU has those features. Each
 * gives what its scalar reference in quant.c gives: the same bytes for the
 * quantizers, the same value up to float summation order for the dots. */
#ifndef LUMA_CPU_QUANT_SIMD_H
#define LUMA_CPU_QUANT_SIMD_H

#include "quant.h"

typedef void (*luma_vec_rows_fn)(int64_t n, const void *w, size_t w_stride, int nr,
                                 const void *a, size_t a_stride, int na, float *out, size_t out_stride);

/* NULL for a type without an AVX2 kernel. */
luma_vec_dot_fn luma_vec_dot_avx2(enum luma_type t);
luma_vec_rows_fn luma_vec_rows_avx2(enum luma_type t);
void luma_quantize_q8_0_avx2(const float *x, luma_block_q8_0 *y, int64_t nb);
void luma_quantize_q8_K_avx2(const float *x, luma_block_q8_K *y, int64_t nb);
void luma_f16_to_f32_row_avx2(const uint16_t *src, float *dst, int64_t n);
/* nb blocks of type t to floats, the same bits as luma_dequantize_row_ref;
 * false, writing nothing, for a type without an AVX2 version (it has them
 * for Q4_0, Q5_0, Q8_0, Q4_K and Q6_K). */
bool luma_dequantize_avx2(enum luma_type t, const void *src, float *dst, int64_t nb);

/* Weight panels, for matmuls over many activation rows (prefill), in the
 * legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): a panel is
 * LUMA_PANEL_ROWS weight rows decoded once into bytes laid out for the
 * activation rows that follow (quant_avx2.c describes the layout). The
 * activations are the usual Q8_0 rows, recast as blocks of 32 int8 with
 * their scale d and d times their sum (which the weights' zero points and
 * minimums meet); results equal the tile kernels' up to float rounding. A
 * row of activations gets the same results, bit for bit, through a panel or
 * through the rows kernel, so a matmul's rows do not depend on how many
 * there are. */
#define LUMA_PANEL_ROWS 8

typedef struct { int8_t q[LUMA_QK]; float d, s; } luma_panel_act;

typedef struct luma_panel_ops {
    size_t block_bytes;        /* panel bytes per 32 elements of a row */
    int min_rows;              /* fewer activation rows go faster through the rows kernel */
    /* Decodes nr <= LUMA_PANEL_ROWS rows of n elements (ws bytes apart)
     * into panel (n / 32 * block_bytes bytes); missing rows read as zeros. */
    void (*pack)(int64_t n, const void *w, size_t ws, int nr, void *panel);
    /* out[j * os + i] = dot(row i, activation row j) for i < nr, j < na;
     * activation rows are n / 32 luma_panel_act each, as bytes apart. */
    void (*dot)(int64_t n, const void *panel, int nr, const void *a, size_t as, int na, float *out,
                size_t os);
    /* The same results, bit for bit, from nr rows as stored (ws bytes
     * apart), for fewer than min_rows activation rows. */
    void (*rows)(int64_t n, const void *w, size_t ws, int nr, const void *a, size_t as, int na, float *out,
                 size_t os);
} luma_panel_ops;

/* NULL for a type without panels. */
const luma_panel_ops *luma_panel_avx2(enum luma_type t);
/* A Q8_0 activation row of n elements to n / 32 panel blocks. */
void luma_panel_act_avx2(const luma_block_q8_0 *src, int64_t n, luma_panel_act *dst);

#endif
