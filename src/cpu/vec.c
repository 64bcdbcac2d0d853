#include "cpu/vec.h"

#include "quant.h"

static float dot_f16(int64_t n, const uint16_t *x, const float *y)
{
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += luma_f16_to_f32(x[i]) * y[i];
    return s;
}

static float dot_f32(int64_t n, const float *x, const float *y)
{
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i] * y[i];
    return s;
}

static void axpy_f16(int64_t n, float a, const uint16_t *x, float *y)
{
    for (int64_t i = 0; i < n; i++) y[i] += a * luma_f16_to_f32(x[i]);
}

static void axpy_f32(int64_t n, float a, const float *x, float *y)
{
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void f32_to_f16(int64_t n, const float *x, uint16_t *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = luma_f32_to_f16(x[i]);
}

static const luma_vec_ops ref_ops = { dot_f16, dot_f32, axpy_f16, axpy_f32, f32_to_f16 };

const luma_vec_ops *luma_vec_ref(void) { return &ref_ops; }

const luma_vec_ops *luma_vec_get(void)
{
#if defined(__x86_64__)
    /* Every CPU with AVX2 and FMA also has F16C (clang cannot test for it). */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return luma_vec_avx2();
#endif
    return &ref_ops;
}
