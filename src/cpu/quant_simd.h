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

#endif
