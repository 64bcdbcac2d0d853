#include "cpu/vec.h"

#include <immintrin.h>

static float hsum(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static float dot_f16(int64_t n, const uint16_t *x, const float *y)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i + 8)));
        a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(y + i), a0);
        a1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(y + i + 8), a1);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += _cvtsh_ss(x[i]) * y[i];
    return s;
}

static float dot_f32(int64_t n, const float *x, const float *y)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += x[i] * y[i];
    return s;
}

static void axpy_f16(int64_t n, float a, const uint16_t *x, float *y)
{
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, xv, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += a * _cvtsh_ss(x[i]);
}

static void axpy_f32(int64_t n, float a, const float *x, float *y)
{
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

static void f32_to_f16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

static const luma_vec_ops avx2_ops = { dot_f16, dot_f32, axpy_f16, axpy_f32, f32_to_f16 };

const luma_vec_ops *luma_vec_avx2(void) { return &avx2_ops; }
