/* Float vector primitives of the CPU backend (attention over F16 or F32 keys
 * and values, norms), with AVX2/F16C versions chosen at run time. */
#ifndef LUMA_CPU_VEC_H
#define LUMA_CPU_VEC_H

#include <stdint.h>

typedef struct luma_vec_ops {
    float (*dot_f16)(int64_t n, const uint16_t *x, const float *y);
    float (*dot_f32)(int64_t n, const float *x, const float *y);
    /* y += a * x */
    void (*axpy_f16)(int64_t n, float a, const uint16_t *x, float *y);
    void (*axpy_f32)(int64_t n, float a, const float *x, float *y);
    void (*f32_to_f16)(int64_t n, const float *x, uint16_t *y);
} luma_vec_ops;

const luma_vec_ops *luma_vec_get(void);
/* The portable versions, for tests. */
const luma_vec_ops *luma_vec_ref(void);
/* Defined in vec_avx2.c on x86-64. */
const luma_vec_ops *luma_vec_avx2(void);

#endif
