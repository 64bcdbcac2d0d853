#include "cpu/vec.h"

#include <math.h>

#include "quant.h"

static void qk_f16(int64_t n, const float *const *q, int nq, const uint16_t *k, size_t ks, int nk,
                   float *s, size_t ld)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            float acc = 0;
            for (int64_t d = 0; d < n; d++) acc += q[i][d] * luma_f16_to_f32(k[(size_t)j * ks + (size_t)d]);
            s[(size_t)i * ld + (size_t)j] = acc;
        }
}

static void qk_f32(int64_t n, const float *const *q, int nq, const float *k, size_t ks, int nk,
                   float *s, size_t ld)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            float acc = 0;
            for (int64_t d = 0; d < n; d++) acc += q[i][d] * k[(size_t)j * ks + (size_t)d];
            s[(size_t)i * ld + (size_t)j] = acc;
        }
}

static void pv_f16(int64_t n, float *const *o, int nq, const float *p, size_t ld, const uint16_t *v,
                   size_t vs, int nk)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            float w = p[(size_t)i * ld + (size_t)j];
            for (int64_t d = 0; d < n; d++) o[i][d] += w * luma_f16_to_f32(v[(size_t)j * vs + (size_t)d]);
        }
}

static void pv_f32(int64_t n, float *const *o, int nq, const float *p, size_t ld, const float *v,
                   size_t vs, int nk)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            float w = p[(size_t)i * ld + (size_t)j];
            for (int64_t d = 0; d < n; d++) o[i][d] += w * v[(size_t)j * vs + (size_t)d];
        }
}

static double sum_sq(int64_t n, const float *x)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static float exp_sum(int64_t n, const float *x, float m, float *y)
{
    float s = 0;
    for (int64_t i = 0; i < n; i++) {
        y[i] = expf(x[i] - m);
        s += y[i];
    }
    return s;
}

static void gelu_mul(int64_t n, float *g, const float *u)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        float x = g[i];
        g[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[i];
    }
}

static void silu_mul(int64_t n, float *g, const float *u)
{
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void f32_to_f16(int64_t n, const float *x, uint16_t *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = luma_f32_to_f16(x[i]);
}

static const luma_vec_ops ref_ops = { qk_f16, qk_f32, pv_f16, pv_f32, sum_sq, exp_sum, gelu_mul, silu_mul, f32_to_f16 };

const luma_vec_ops *luma_vec_ref(void) { return &ref_ops; }

const luma_vec_ops *luma_vec_get(void)
{
#if defined(__x86_64__)
    /* Every CPU with AVX2 and FMA also has F16C (clang cannot test for it). */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return luma_vec_avx2();
#endif
    return &ref_ops;
}
