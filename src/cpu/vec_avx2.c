#include "cpu/vec.h"

#include <immintrin.h>
#include <stdbool.h>

#define INLINE static inline __attribute__((always_inline))

/* Query rows and keys per tile of qk (8 accumulators), query rows per tile
 * of pv (times two vectors of values: 8 accumulators). */
#define QK_Q 4
#define QK_K 2
#define PV_Q 4

INLINE float hsum(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The sums of 8 vectors, in order, in one vector. */
INLINE __m256 hsum8(const __m256 a[8])
{
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE __m256 load8(bool f16, const void *p, size_t i)
{
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

INLINE float load1(bool f16, const void *p, size_t i)
{
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* exp(x) to about 2 ulp (Cephes' polynomial after a reduction by ln 2);
 * 0 below -87.3, where the result would leave the normal range. */
INLINE __m256 exp8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.3762626647949f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* ---- attention -------------------------------------------------------- */

/* nq (<= QK_Q) query rows against nk (<= QK_K) keys, constants once inlined. */
INLINE void qk_tile(bool f16, int64_t n, const float *const *q, int nq, const void *k, size_t ks, int nk,
                    float *s, size_t ld)
{
    __m256 acc[QK_Q * QK_K];
    for (int a = 0; a < QK_Q * QK_K; a++) acc[a] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        __m256 kv[QK_K];
        for (int j = 0; j < nk; j++) kv[j] = load8(f16, k, (size_t)j * ks + (size_t)d);
        for (int i = 0; i < nq; i++) {
            __m256 qv = _mm256_loadu_ps(q[i] + d);
            for (int j = 0; j < nk; j++) acc[i * QK_K + j] = _mm256_fmadd_ps(qv, kv[j], acc[i * QK_K + j]);
        }
    }
    /* one way of summing the lanes for every tile shape: a score does not
     * depend on which queries and keys share its tile */
    float sums[QK_Q * QK_K];
    _mm256_storeu_ps(sums, hsum8(acc));
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            float v = sums[i * QK_K + j];
            for (int64_t e = d; e < n; e++) v += q[i][e] * load1(f16, k, (size_t)j * ks + (size_t)e);
            s[(size_t)i * ld + (size_t)j] = v;
        }
}

INLINE void qk(bool f16, int64_t n, const float *const *q, int nq, const void *k, size_t ks, int nk,
               float *s, size_t ld)
{
    for (int j = 0; j < nk; j += QK_K) {
        const void *kj = f16 ? (const void *)((const uint16_t *)k + (size_t)j * ks)
                             : (const void *)((const float *)k + (size_t)j * ks);
        for (int i = 0; i < nq; i += QK_Q) {
            int bq = nq - i < QK_Q ? nq - i : QK_Q;
            float *sij = s + (size_t)i * ld + (size_t)j;
            if (nk - j >= QK_K) {
                if (bq == 4) qk_tile(f16, n, q + i, 4, kj, ks, QK_K, sij, ld);
                else if (bq == 3) qk_tile(f16, n, q + i, 3, kj, ks, QK_K, sij, ld);
                else if (bq == 2) qk_tile(f16, n, q + i, 2, kj, ks, QK_K, sij, ld);
                else qk_tile(f16, n, q + i, 1, kj, ks, QK_K, sij, ld);
            } else {
                if (bq == 4) qk_tile(f16, n, q + i, 4, kj, ks, 1, sij, ld);
                else if (bq == 3) qk_tile(f16, n, q + i, 3, kj, ks, 1, sij, ld);
                else if (bq == 2) qk_tile(f16, n, q + i, 2, kj, ks, 1, sij, ld);
                else qk_tile(f16, n, q + i, 1, kj, ks, 1, sij, ld);
            }
        }
    }
}

/* nq (<= PV_Q) output rows, 16 columns a step, then 8, then one by one. */
INLINE void pv_tile(bool f16, int64_t n, float *const *o, int nq, const float *p, size_t ld, const void *v,
                    size_t vs, int nk)
{
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        __m256 acc[PV_Q][2];
        for (int i = 0; i < nq; i++) {
            acc[i][0] = _mm256_loadu_ps(o[i] + d);
            acc[i][1] = _mm256_loadu_ps(o[i] + d + 8);
        }
        for (int j = 0; j < nk; j++) {
            __m256 v0 = load8(f16, v, (size_t)j * vs + (size_t)d);
            __m256 v1 = load8(f16, v, (size_t)j * vs + (size_t)d + 8);
            for (int i = 0; i < nq; i++) {
                __m256 w = _mm256_broadcast_ss(p + (size_t)i * ld + (size_t)j);
                acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
            }
        }
        for (int i = 0; i < nq; i++) {
            _mm256_storeu_ps(o[i] + d, acc[i][0]);
            _mm256_storeu_ps(o[i] + d + 8, acc[i][1]);
        }
    }
    for (; d + 8 <= n; d += 8)
        for (int i = 0; i < nq; i++) {
            __m256 acc = _mm256_loadu_ps(o[i] + d);
            for (int j = 0; j < nk; j++)
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (size_t)i * ld + (size_t)j),
                                      load8(f16, v, (size_t)j * vs + (size_t)d), acc);
            _mm256_storeu_ps(o[i] + d, acc);
        }
    for (; d < n; d++)
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < nk; j++) o[i][d] += p[(size_t)i * ld + (size_t)j] * load1(f16, v, (size_t)j * vs + (size_t)d);
}

INLINE void pv(bool f16, int64_t n, float *const *o, int nq, const float *p, size_t ld, const void *v,
               size_t vs, int nk)
{
    for (int i = 0; i < nq; i += PV_Q) {
        int bq = nq - i < PV_Q ? nq - i : PV_Q;
        const float *pi = p + (size_t)i * ld;
        if (bq == 4) pv_tile(f16, n, o + i, 4, pi, ld, v, vs, nk);
        else if (bq == 3) pv_tile(f16, n, o + i, 3, pi, ld, v, vs, nk);
        else if (bq == 2) pv_tile(f16, n, o + i, 2, pi, ld, v, vs, nk);
        else pv_tile(f16, n, o + i, 1, pi, ld, v, vs, nk);
    }
}

static void qk_f16(int64_t n, const float *const *q, int nq, const uint16_t *k, size_t ks, int nk,
                   float *s, size_t ld)
{
    qk(true, n, q, nq, k, ks, nk, s, ld);
}

static void qk_f32(int64_t n, const float *const *q, int nq, const float *k, size_t ks, int nk,
                   float *s, size_t ld)
{
    qk(false, n, q, nq, k, ks, nk, s, ld);
}

static void pv_f16(int64_t n, float *const *o, int nq, const float *p, size_t ld, const uint16_t *v,
                   size_t vs, int nk)
{
    pv(true, n, o, nq, p, ld, v, vs, nk);
}

static void pv_f32(int64_t n, float *const *o, int nq, const float *p, size_t ld, const float *v,
                   size_t vs, int nk)
{
    pv(false, n, o, nq, p, ld, v, vs, nk);
}

/* ---- norms, exponentials and activations ----------------------------- */

static double sum_sq(int64_t n, const float *x)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        a0 = _mm256_fmadd_pd(x0, x0, a0);
        a1 = _mm256_fmadd_pd(x1, x1, a1);
    }
    __m256d a = _mm256_add_pd(a0, a1);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    double s = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    for (; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static float exp_sum(int64_t n, const float *x, float m, float *y)
{
    __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(y + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float s = hsum(acc);
    for (; i < n; i++) {
        float tail[8] = { x[i] - m };
        float e = _mm256_cvtss_f32(exp8(_mm256_loadu_ps(tail)));
        y[i] = e;
        s += e;
    }
    return s;
}

/* gelu_tanh(x) = x / 2 (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3) */
INLINE __m256 gelu8(__m256 x)
{
    const __m256 c2 = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
    __m256 u = _mm256_mul_ps(_mm256_mul_ps(c2, x), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(x, x),
                                                                   _mm256_set1_ps(1.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(u)));
}

INLINE __m256 silu8(__m256 x)
{
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* The last n % 8 elements go through a zero-padded vector. */
#define GATED(name, act)                                                                 \
    static void name(int64_t n, float *g, const float *u)                                \
    {                                                                                    \
        int64_t i = 0;                                                                   \
        for (; i + 8 <= n; i += 8)                                                       \
            _mm256_storeu_ps(g + i, _mm256_mul_ps(act(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i))); \
        if (i < n) {                                                                     \
            float t[8] = { 0 };                                                          \
            for (int64_t k = i; k < n; k++) t[k - i] = g[k];                             \
            _mm256_storeu_ps(t, act(_mm256_loadu_ps(t)));                                \
            for (int64_t k = i; k < n; k++) g[k] = t[k - i] * u[k];                      \
        }                                                                                \
    }

GATED(gelu_mul, gelu8)
GATED(silu_mul, silu8)

static void f32_to_f16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

static const luma_vec_ops avx2_ops = { qk_f16, qk_f32, pv_f16, pv_f32, sum_sq, exp_sum, gelu_mul, silu_mul, f32_to_f16 };

const luma_vec_ops *luma_vec_avx2(void) { return &avx2_ops; }
