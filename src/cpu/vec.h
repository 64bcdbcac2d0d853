/* Float vector primitives of the CPU backend: attention over a block of
 * cached F16 or F32 keys and values, softmax exponentials, sums of
 * squares, gated activations, with AVX2/FMA/F16C versions chosen at run time.
 *
 * The attention primitives take several query rows at once (the heads that
 * share a KV head, times a few tokens), so that each cached key or value is
 * loaded and converted once for all of them. Query and output rows are
 * given as pointers: they need not be evenly spaced. */
#ifndef LUMA_CPU_VEC_H
#define LUMA_CPU_VEC_H

#include <stddef.h>
#include <stdint.h>

typedef struct luma_vec_ops {
    /* s[i * ld + j] = dot(q[i], key j) for i < nq, j < nk: keys of n
     * elements, ks elements apart. */
    void (*qk_f16)(int64_t n, const float *const *q, int nq, const uint16_t *k, size_t ks, int nk,
                   float *s, size_t ld);
    void (*qk_f32)(int64_t n, const float *const *q, int nq, const float *k, size_t ks, int nk,
                   float *s, size_t ld);
    /* o[i] += sum over j < nk of p[i * ld + j] * value j, for i < nq. */
    void (*pv_f16)(int64_t n, float *const *o, int nq, const float *p, size_t ld, const uint16_t *v,
                   size_t vs, int nk);
    void (*pv_f32)(int64_t n, float *const *o, int nq, const float *p, size_t ld, const float *v,
                   size_t vs, int nk);
    /* The sum of x[i]^2 in double precision (for RMS norms). */
    double (*sum_sq)(int64_t n, const float *x);
    /* y = exp(x - m), returning the sum of y; y may be x. */
    float (*exp_sum)(int64_t n, const float *x, float m, float *y);
    /* g = act(g) * u: GELU (tanh approximation), SiLU. */
    void (*gelu_mul)(int64_t n, float *g, const float *u);
    void (*silu_mul)(int64_t n, float *g, const float *u);
    void (*f32_to_f16)(int64_t n, const float *x, uint16_t *y);
} luma_vec_ops;

const luma_vec_ops *luma_vec_get(void);
/* The portable versions, for tests. */
const luma_vec_ops *luma_vec_ref(void);
/* Defined in vec_avx2.c on x86-64. */
const luma_vec_ops *luma_vec_avx2(void);

#endif
