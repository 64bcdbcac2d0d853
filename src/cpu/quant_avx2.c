/* AVX2/FMA/F16C kernels of the number formats (built with -mavx2 -mfma
 * -mf16c; quant.c calls them only on a CPU with AVX2 and FMA, and every such
 * CPU has F16C).
 *
 * Integer dots multiply unsigned bytes by signed bytes with maddubs (adjacent
 * pairs summed to int16), then madd the int16 pairs to int32, by ones or by
 * the sub-block scales. Signed weights enter as |w| against sign(a, w).
 * No pair sum saturates: |w| <= 128 against |a| <= 127 gives at most 32512.
 *
 * A weight block is decoded once into registers, then met by up to TILE_A
 * activation rows: luma_vec_dot_rows reads each weight byte once per tile of
 * tokens, and a single dot is the tile of one weight row and one token. For
 * many tokens (prefill), the CPU backend decodes 8 weight rows once into a
 * panel instead and runs every token against it (the last section). */
#include "quant_simd.h"

#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define TILE_A 4

INLINE float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float hmax_ps(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float f16(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* |v|, with the new value first so that a NaN is passed over as fmaxf does. */
INLINE __m256 max_abs(__m256 v, __m256 m)
{
    return _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), m);
}

/* Four vectors of 8 int32 (elements 0..31 in order) to 32 int8, saturating. */
INLINE __m256i pack_i8(__m256i i0, __m256i i1, __m256i i2, __m256i i3)
{
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    /* the packs interleave the 128-bit lanes: dwords hold 0-3, 8-11, 16-19,
     * 24-27, 4-7, 12-15, 20-23, 28-31 */
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A matrix-vector product (decode) is otherwise compute-bound and
 * memory-bound by turns: the hardware prefetcher does not run far enough
 * ahead of the decoding. So each step asks for the same bytes of a weight
 * row about PREFETCH_BYTES further on (whole rows ahead, ws bytes each).
 * Rows past the last are never read, and a prefetch cannot fault. */
#define PREFETCH_BYTES 4096

INLINE size_t prefetch_distance(size_t ws)
{
    return ws ? (PREFETCH_BYTES + ws - 1) / ws * ws : 0;
}

/* [p, p + len) at dist bytes ahead, one cache line at a time. */
INLINE void prefetch_ahead(const uint8_t *p, size_t dist, size_t len)
{
    const char *q = (const char *)p + dist;
    for (size_t o = 0; o < len; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
}

/* ---- legacy formats (32-element blocks) against Q8_0 ------------------- */

/* 16 bytes of nibbles to 32 bytes: low nibbles (elements 0..15), then high.
 * A broadcast load and a per-lane shift, where the obvious insert would
 * compete for the shuffle unit with the rest of the decoding. */
INLINE __m256i nibbles(const uint8_t *p)
{
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* The 32 bits of a Q5 qh (little-endian) to 32 bytes: 0xFF where set. */
INLINE __m256i bits_to_bytes(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, sizeof x);
    const __m256i spread = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                              0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* One decoded block: 32 values in element order; signed (with |q| beside)
 * for Q4_0, Q5_0, Q8_0, unsigned with a minimum m for Q4_1, Q5_1. */
typedef struct {
    __m256i q, absq;
    float d, m;
} legacy_w;

INLINE bool legacy_has_min(enum luma_type t)
{
    return t == LUMA_Q4_1 || t == LUMA_Q5_1;
}

INLINE size_t legacy_block_size(enum luma_type t)
{
    switch (t) {
    case LUMA_Q4_0: return sizeof(luma_block_q4_0);
    case LUMA_Q4_1: return sizeof(luma_block_q4_1);
    case LUMA_Q5_0: return sizeof(luma_block_q5_0);
    case LUMA_Q5_1: return sizeof(luma_block_q5_1);
    default: return sizeof(luma_block_q8_0);
    }
}

INLINE legacy_w legacy_decode(enum luma_type t, const uint8_t *blk)
{
    legacy_w w = { .m = 0.0f };
    switch (t) {
    case LUMA_Q4_0: {
        const luma_block_q4_0 *x = (const luma_block_q4_0 *)blk;
        w.q = _mm256_sub_epi8(nibbles(x->qs), _mm256_set1_epi8(8));
        w.d = f16(x->d);
        break;
    }
    case LUMA_Q4_1: {
        const luma_block_q4_1 *x = (const luma_block_q4_1 *)blk;
        w.q = nibbles(x->qs);
        w.d = f16(x->d);
        w.m = f16(x->m);
        break;
    }
    case LUMA_Q5_0: {
        /* q - 16 is the nibble itself when the fifth bit is set, else the
         * nibble with the top four bits set */
        const luma_block_q5_0 *x = (const luma_block_q5_0 *)blk;
        __m256i high = _mm256_andnot_si256(bits_to_bytes(x->qh), _mm256_set1_epi8((char)0xF0));
        w.q = _mm256_or_si256(nibbles(x->qs), high);
        w.d = f16(x->d);
        break;
    }
    case LUMA_Q5_1: {
        const luma_block_q5_1 *x = (const luma_block_q5_1 *)blk;
        __m256i high = _mm256_and_si256(bits_to_bytes(x->qh), _mm256_set1_epi8(0x10));
        w.q = _mm256_or_si256(nibbles(x->qs), high);
        w.d = f16(x->d);
        w.m = f16(x->m);
        break;
    }
    default: {
        const luma_block_q8_0 *x = (const luma_block_q8_0 *)blk;
        w.q = _mm256_loadu_si256((const __m256i *)x->qs);
        w.d = f16(x->d);
        break;
    }
    }
    if (!legacy_has_min(t)) w.absq = _mm256_sign_epi8(w.q, w.q);
    return w;
}

INLINE __m256 legacy_dot(enum luma_type t, const legacy_w *w, const luma_block_q8_0 *y, __m256 acc)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a = _mm256_loadu_si256((const __m256i *)y->qs);
    float dy = f16(y->d);
    if (legacy_has_min(t)) {
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w->q, a), ones);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w->d * dy), _mm256_cvtepi32_ps(p), acc);
        return _mm256_fmadd_ps(_mm256_set1_ps(w->m * dy), _mm256_cvtepi32_ps(s), acc);
    }
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w->absq, _mm256_sign_epi8(a, w->q)), ones);
    return _mm256_fmadd_ps(_mm256_set1_ps(w->d * dy), _mm256_cvtepi32_ps(p), acc);
}

/* nr weight rows against ta (a constant once inlined) activation rows. Two
 * blocks a step, into two sets of accumulators: one chain of fused
 * multiply-adds would wait on its own latency at every block. */
INLINE void legacy_tile(enum luma_type t, int ta, int64_t n, const uint8_t *w, size_t ws, int nr,
                        const uint8_t *a, size_t as, float *out, size_t os)
{
    const size_t bs = legacy_block_size(t), dist = prefetch_distance(ws);
    const int64_t nb = n / LUMA_QK;
    for (int i = 0; i < nr; i++) {
        const uint8_t *wr = w + (size_t)i * ws;
        __m256 acc0[TILE_A], acc1[TILE_A];
        for (int r = 0; r < ta; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            prefetch_ahead(wr + (size_t)b * bs, dist, 2 * bs);
            legacy_w x0 = legacy_decode(t, wr + (size_t)b * bs);
            legacy_w x1 = legacy_decode(t, wr + (size_t)(b + 1) * bs);
            for (int r = 0; r < ta; r++) {
                const luma_block_q8_0 *y = (const luma_block_q8_0 *)(a + (size_t)r * as) + b;
                acc0[r] = legacy_dot(t, &x0, y, acc0[r]);
                acc1[r] = legacy_dot(t, &x1, y + 1, acc1[r]);
            }
        }
        if (b < nb) {
            legacy_w x0 = legacy_decode(t, wr + (size_t)b * bs);
            for (int r = 0; r < ta; r++)
                acc0[r] = legacy_dot(t, &x0, (const luma_block_q8_0 *)(a + (size_t)r * as) + b, acc0[r]);
        }
        for (int r = 0; r < ta; r++) out[(size_t)r * os + (size_t)i] = hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
    }
}

/* ---- K formats (256-element super-blocks) against Q8_K ----------------- */

/* One decoded super-block: 256 unsigned values in element order (8 x 32
 * bytes); for each 32 bytes, the int16 scales lined up with maddubs' output
 * (lanes 0-7: the first group of 16, lanes 8-15: the second); the integer
 * offset of each group of 16, which meets the activation's bsums; and the
 * float scales: value = d * scale * q - dmin * offset. */
typedef struct {
    __m256i q[8], sc[8], off;
    float d, dmin;
} kquant_w;

/* 16 int8 group scales to the 8 scale vectors of kquant_w. */
INLINE void group_scales(__m128i sc8, __m256i sc[8])
{
    for (int k = 0; k < 8; k++) {
        __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ULL * (uint64_t)(2 * k + 1)),
                                      (long long)(0x0101010101010101ULL * (uint64_t)(2 * k)));
        sc[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
    }
}

/* The 2-bit pair k of each of 32 bytes. */
INLINE __m256i bit_pair(__m256i bytes, int k)
{
    return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * k), _mm256_set1_epi8(3));
}

/* Bit b of each of 32 bytes, moved to bit `to` (shifts stay inside each
 * byte after the mask: at most 7 places, and the mask keeps one bit). */
INLINE __m256i bit_to(__m256i bytes, int b, int to)
{
    __m256i s = b >= to ? _mm256_srli_epi16(bytes, b - to) : _mm256_slli_epi16(bytes, to - b);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(1 << to)));
}

/* Q4_K/Q5_K scale bytes (see scale_min_k4 in quant.c) to 8 scales and 8
 * minimums, each as 16 bytes with every value twice (one per group of 16). */
INLINE void k4_scales(const uint8_t *packed, __m128i *sc16, __m128i *min16)
{
    uint32_t u[3];
    memcpy(u, packed, sizeof u);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    uint32_t sc_lo = u[0] & low6;
    uint32_t sc_hi = (u[2] & low4) | ((u[0] >> 6) & low2) << 4;
    uint32_t mn_lo = u[1] & low6;
    uint32_t mn_hi = ((u[2] >> 4) & low4) | ((u[1] >> 6) & low2) << 4;
    __m128i s = _mm_setr_epi32((int)sc_lo, (int)sc_hi, 0, 0);
    __m128i m = _mm_setr_epi32((int)mn_lo, (int)mn_hi, 0, 0);
    *sc16 = _mm_unpacklo_epi8(s, s);
    *min16 = _mm_unpacklo_epi8(m, m);
}

INLINE size_t k_block_size(enum luma_type t)
{
    switch (t) {
    case LUMA_Q2_K: return sizeof(luma_block_q2_K);
    case LUMA_Q3_K: return sizeof(luma_block_q3_K);
    case LUMA_Q4_K: return sizeof(luma_block_q4_K);
    case LUMA_Q5_K: return sizeof(luma_block_q5_K);
    default: return sizeof(luma_block_q6_K);
    }
}

INLINE void k_decode(enum luma_type t, const uint8_t *blk, kquant_w *w)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (t) {
    case LUMA_Q2_K: {
        /* scales: low nibble the scale, high nibble the minimum */
        const luma_block_q2_K *x = (const luma_block_q2_K *)blk;
        __m128i s = _mm_loadu_si128((const __m128i *)x->scales);
        group_scales(_mm_and_si128(s, _mm_set1_epi8(0x0F)), w->sc);
        w->off = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F)));
        for (int c = 0; c < 2; c++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int k = 0; k < 4; k++) w->q[4 * c + k] = bit_pair(bits, k);
        }
        w->d = f16(x->d);
        w->dmin = f16(x->dmin);
        break;
    }
    case LUMA_Q3_K: {
        /* q = (2 low bits | high bit << 2) - 4: offset 4 * scale */
        const luma_block_q3_K *x = (const luma_block_q3_K *)blk;
        uint32_t u[3];
        memcpy(u, x->scales, sizeof u);
        const uint32_t nib = 0x0f0f0f0f, low2 = 0x03030303;
        __m128i s6 = _mm_setr_epi32((int)((u[0] & nib) | (u[2] & low2) << 4),
                                    (int)((u[1] & nib) | ((u[2] >> 2) & low2) << 4),
                                    (int)(((u[0] >> 4) & nib) | ((u[2] >> 4) & low2) << 4),
                                    (int)(((u[1] >> 4) & nib) | ((u[2] >> 6) & low2) << 4));
        __m128i sc = _mm_sub_epi8(s6, _mm_set1_epi8(32));
        group_scales(sc, w->sc);
        w->off = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 2);
        __m256i hmask = _mm256_loadu_si256((const __m256i *)x->hmask);
        for (int c = 0; c < 2; c++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int k = 0; k < 4; k++)
                w->q[4 * c + k] = _mm256_or_si256(bit_pair(bits, k), bit_to(hmask, 4 * c + k, 2));
        }
        w->d = w->dmin = f16(x->d);
        break;
    }
    case LUMA_Q4_K:
    case LUMA_Q5_K: {
        /* Q5_K is Q4_K plus a fifth bit per value in qh */
        const luma_block_q4_K *x4 = (const luma_block_q4_K *)blk;
        const luma_block_q5_K *x5 = (const luma_block_q5_K *)blk;
        __m128i sc16, min16;
        k4_scales(t == LUMA_Q4_K ? x4->scales : x5->scales, &sc16, &min16);
        group_scales(sc16, w->sc);
        w->off = _mm256_cvtepu8_epi16(min16);
        const uint8_t *qs = t == LUMA_Q4_K ? x4->qs : x5->qs;
        for (int j = 0; j < 4; j++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            w->q[2 * j] = _mm256_and_si256(bits, low4);
            w->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
        }
        if (t == LUMA_Q5_K) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)x5->qh);
            for (int s = 0; s < 8; s++) w->q[s] = _mm256_or_si256(w->q[s], bit_to(qh, s, 4));
        }
        w->d = f16(t == LUMA_Q4_K ? x4->d : x5->d);
        w->dmin = f16(t == LUMA_Q4_K ? x4->dmin : x5->dmin);
        break;
    }
    default: {
        /* Q6_K: q = 6 bits - 32: offset 32 * scale */
        const luma_block_q6_K *x = (const luma_block_q6_K *)blk;
        const __m256i top2 = _mm256_set1_epi8(0x30);
        __m128i sc = _mm_loadu_si128((const __m128i *)x->scales);
        group_scales(sc, w->sc);
        w->off = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);
        for (int c = 0; c < 2; c++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * c));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * c + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * c));
            w->q[4 * c + 0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                              _mm256_and_si256(_mm256_slli_epi16(h, 4), top2));
            w->q[4 * c + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                              _mm256_and_si256(_mm256_slli_epi16(h, 2), top2));
            w->q[4 * c + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                              _mm256_and_si256(h, top2));
            w->q[4 * c + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), top2));
        }
        w->d = w->dmin = f16(x->d);
        break;
    }
    }
}

INLINE __m256 k_dot(const kquant_w *w, const luma_block_q8_K *y, __m256 acc)
{
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int k = 0; k < 8; k += 2) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * k));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * k + 32));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w->q[k], a0), w->sc[k]));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w->q[k + 1], a1), w->sc[k + 1]));
    }
    __m256i summ = _mm256_madd_epi16(w->off, _mm256_loadu_si256((const __m256i *)y->bsums));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(w->d * y->d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    return _mm256_fnmadd_ps(_mm256_set1_ps(w->dmin * y->d), _mm256_cvtepi32_ps(summ), acc);
}

INLINE void k_tile(enum luma_type t, int ta, int64_t n, const uint8_t *w, size_t ws, int nr,
                   const uint8_t *a, size_t as, float *out, size_t os)
{
    const size_t bs = k_block_size(t), dist = prefetch_distance(ws);
    for (int i = 0; i < nr; i++) {
        const uint8_t *wr = w + (size_t)i * ws;
        __m256 acc[TILE_A];
        for (int r = 0; r < ta; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / LUMA_QK_K; b++) {
            kquant_w x;
            prefetch_ahead(wr + (size_t)b * bs, dist, bs);
            k_decode(t, wr + (size_t)b * bs, &x);
            for (int r = 0; r < ta; r++)
                acc[r] = k_dot(&x, (const luma_block_q8_K *)(a + (size_t)r * as) + b, acc[r]);
        }
        for (int r = 0; r < ta; r++) out[(size_t)r * os + (size_t)i] = hsum_ps(acc[r]);
    }
}

/* ---- float formats against F32 ----------------------------------------- */

INLINE __m256 float_load8(enum luma_type t, const uint8_t *w, int64_t i)
{
    switch (t) {
    case LUMA_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
    case LUMA_BF16: {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
    default:
        return _mm256_loadu_ps((const float *)(w + 4 * i));
    }
}

INLINE float float_load1(enum luma_type t, const uint8_t *w, int64_t i)
{
    uint16_t h;
    float f;
    if (t == LUMA_F32) {
        memcpy(&f, w + 4 * i, sizeof f);
        return f;
    }
    memcpy(&h, w + 2 * i, sizeof h);
    if (t == LUMA_F16) return f16(h);
    uint32_t u = (uint32_t)h << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE void float_tile(enum luma_type t, int ta, int64_t n, const uint8_t *w, size_t ws, int nr,
                       const uint8_t *a, size_t as, float *out, size_t os)
{
    for (int i = 0; i < nr; i++) {
        const uint8_t *wr = w + (size_t)i * ws;
        __m256 acc0[TILE_A], acc1[TILE_A];
        for (int r = 0; r < ta; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            __m256 x0 = float_load8(t, wr, j), x1 = float_load8(t, wr, j + 8);
            for (int r = 0; r < ta; r++) {
                const float *y = (const float *)(a + (size_t)r * as) + j;
                acc0[r] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(y), acc0[r]);
                acc1[r] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(y + 8), acc1[r]);
            }
        }
        for (int r = 0; r < ta; r++) {
            const float *y = (const float *)(a + (size_t)r * as);
            float s = hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
            for (int64_t k = j; k < n; k++) s += float_load1(t, wr, k) * y[k];
            out[(size_t)r * os + (size_t)i] = s;
        }
    }
}

/* ---- entry points ------------------------------------------------------- */

enum family { FAMILY_FLOAT, FAMILY_LEGACY, FAMILY_K };

INLINE void tile(enum family f, enum luma_type t, int ta, int64_t n, const void *w, size_t ws, int nr,
                 const uint8_t *a, size_t as, float *out, size_t os)
{
    switch (f) {
    case FAMILY_FLOAT: float_tile(t, ta, n, w, ws, nr, a, as, out, os); break;
    case FAMILY_LEGACY: legacy_tile(t, ta, n, w, ws, nr, a, as, out, os); break;
    case FAMILY_K: k_tile(t, ta, n, w, ws, nr, a, as, out, os); break;
    }
}

/* Activation rows TILE_A at a time, then the rest by two and by one, each
 * tile width a constant so that its accumulators stay in registers. */
INLINE void rows(enum family f, enum luma_type t, int64_t n, const void *w, size_t ws, int nr,
                 const void *a, size_t as, int na, float *out, size_t os)
{
    const uint8_t *ab = a;
    int j = 0;
    for (; j + TILE_A <= na; j += TILE_A)
        tile(f, t, TILE_A, n, w, ws, nr, ab + (size_t)j * as, as, out + (size_t)j * os, os);
    if (j + 2 <= na) {
        tile(f, t, 2, n, w, ws, nr, ab + (size_t)j * as, as, out + (size_t)j * os, os);
        j += 2;
    }
    if (j < na) tile(f, t, 1, n, w, ws, nr, ab + (size_t)j * as, as, out + (size_t)j * os, os);
}

/* Each type gets its own copy of the tile code, specialized by inlining. */
#define KERNELS(name, family, type)                                                              \
    static float dot_##name(int64_t n, const void *w, const void *a)                             \
    {                                                                                            \
        float r;                                                                                 \
        tile(family, type, 1, n, w, 0, 1, a, 0, &r, 0);                                          \
        return r;                                                                                \
    }                                                                                            \
    static void rows_##name(int64_t n, const void *w, size_t ws, int nr, const void *a,          \
                            size_t as, int na, float *out, size_t os)                            \
    {                                                                                            \
        rows(family, type, n, w, ws, nr, a, as, na, out, os);                                    \
    }

KERNELS(f32, FAMILY_FLOAT, LUMA_F32)
KERNELS(f16, FAMILY_FLOAT, LUMA_F16)
KERNELS(bf16, FAMILY_FLOAT, LUMA_BF16)
KERNELS(q4_0, FAMILY_LEGACY, LUMA_Q4_0)
KERNELS(q4_1, FAMILY_LEGACY, LUMA_Q4_1)
KERNELS(q5_0, FAMILY_LEGACY, LUMA_Q5_0)
KERNELS(q5_1, FAMILY_LEGACY, LUMA_Q5_1)
KERNELS(q8_0, FAMILY_LEGACY, LUMA_Q8_0)
KERNELS(q2_K, FAMILY_K, LUMA_Q2_K)
KERNELS(q3_K, FAMILY_K, LUMA_Q3_K)
KERNELS(q4_K, FAMILY_K, LUMA_Q4_K)
KERNELS(q5_K, FAMILY_K, LUMA_Q5_K)
KERNELS(q6_K, FAMILY_K, LUMA_Q6_K)

luma_vec_dot_fn luma_vec_dot_avx2(enum luma_type t)
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
    default: return NULL;
    }
}

luma_vec_rows_fn luma_vec_rows_avx2(enum luma_type t)
{
    switch (t) {
    case LUMA_F32: return rows_f32;
    case LUMA_F16: return rows_f16;
    case LUMA_BF16: return rows_bf16;
    case LUMA_Q4_0: return rows_q4_0;
    case LUMA_Q4_1: return rows_q4_1;
    case LUMA_Q5_0: return rows_q5_0;
    case LUMA_Q5_1: return rows_q5_1;
    case LUMA_Q8_0: return rows_q8_0;
    case LUMA_Q2_K: return rows_q2_K;
    case LUMA_Q3_K: return rows_q3_K;
    case LUMA_Q4_K: return rows_q4_K;
    case LUMA_Q5_K: return rows_q5_K;
    case LUMA_Q6_K: return rows_q6_K;
    default: return NULL;
    }
}

/* ---- weight panels against many activation rows (prefill) -------------- */

/* A panel holds LUMA_PANEL_ROWS weight rows of a legacy format decoded to
 * bytes and interleaved four by four: for each block of 32 elements,
 * 32-byte vector k holds elements 4k..4k+3 of row r in bytes 4r..4r+3. Four
 * bytes of an activation row broadcast against it give, after maddubs and
 * madd, one int32 sum per weight row in its own lane: the 8 rows need no
 * horizontal sums. Each block then carries the rows' float scales and
 * offsets: value = scale * q + offset. The bytes are unsigned (the offset
 * absorbs the zero point of Q4_0 and Q5_0, or is the minimum of Q4_1 and
 * Q5_1) except for Q8_0, whose signed bytes meet the activations through
 * the sign trick. */
#define PR LUMA_PANEL_ROWS
#define PANEL_BLOCK_BYTES (32 * PR + 2 * PR * sizeof(float))

/* Where panels overtake the tiles (measured, M activation rows of 1024
 * elements): from 4 rows for Q4_0, Q4_1, Q5_0, Q5_1, whose panel kernel
 * gains most; from 16 for Q8_0. */
#define PANEL_MIN_ROWS(t) ((t) == LUMA_Q8_0 ? 16 : 4)

INLINE bool panel_signed(enum luma_type t)
{
    return t == LUMA_Q8_0;
}

/* How many maddubs results add up in int16 before they must widen: one is
 * at most 2 * qmax * 127. */
INLINE int panel_sum_len(enum luma_type t)
{
    switch (t) {
    case LUMA_Q4_0: case LUMA_Q4_1: return 8;   /* qmax 15: 3810 */
    case LUMA_Q5_0: case LUMA_Q5_1: return 4;   /* 31: 7874 */
    default: return 1;                          /* |q| 128: 32512 */
    }
}

INLINE int panel_zero(enum luma_type t)
{
    return t == LUMA_Q4_0 ? 8 : t == LUMA_Q5_0 ? 16 : 0;
}

/* Block b of one weight row: its bytes as the panel holds them (q), the
 * bytes that meet the activations (|q| for Q8_0, else q), its scale and
 * offset. */
typedef struct {
    __m256i q, qa;
    float scale, offset;
} panel_block;

INLINE panel_block panel_decode(enum luma_type t, const uint8_t *blk)
{
    legacy_w w = legacy_decode(t, blk);
    panel_block pb;
    pb.q = _mm256_add_epi8(w.q, _mm256_set1_epi8((char)panel_zero(t)));
    pb.qa = panel_signed(t) ? w.absq : pb.q;
    pb.scale = w.d;
    pb.offset = legacy_has_min(t) ? w.m : -(float)panel_zero(t) * w.d;
    return pb;
}

/* The integer dot of a decoded block with 32 activation bytes, as 8 int32
 * partial sums. */
INLINE __m256i panel_block_dot(enum luma_type t, const panel_block *pb, __m256i a)
{
    __m256i p = panel_signed(t) ? _mm256_maddubs_epi16(pb->qa, _mm256_sign_epi8(a, pb->q))
                                : _mm256_maddubs_epi16(pb->qa, a);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* Row i's 32 bytes of a block to their interleaved places. */
INLINE void panel_put(uint8_t *pb, int i, __m256i q)
{
    uint32_t u[8];
    _mm256_storeu_si256((__m256i *)u, q);
    for (int k = 0; k < 8; k++) memcpy(pb + 32 * k + 4 * i, &u[k], 4);
}

INLINE void panel_pack(enum luma_type t, int64_t n, const uint8_t *w, size_t ws, int nr, uint8_t *panel)
{
    const int64_t nb = n / LUMA_QK;
    if (nr < PR) memset(panel, 0, (size_t)nb * PANEL_BLOCK_BYTES);
    for (int i = 0; i < nr; i++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = panel + (size_t)b * PANEL_BLOCK_BYTES;
            float *scale = (float *)(pb + 32 * PR), *offset = scale + PR;
            panel_block x = panel_decode(t, w + (size_t)i * ws + (size_t)b * legacy_block_size(t));
            panel_put(pb, i, x.q);
            scale[i] = x.scale;
            offset[i] = x.offset;
        }
}

/* One block's contribution to the lanes' sums: the same operations, in the
 * same order, in the panel kernel and in the rows kernel below. */
INLINE __m256 panel_step(enum luma_type t, __m256 acc, __m256i sum, __m256 scale, __m256 offset,
                         const luma_panel_act *y)
{
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(y->d)), acc);
    return panel_signed(t) ? acc : _mm256_fmadd_ps(offset, _mm256_set1_ps(y->s), acc);
}

/* The panel against ta (a constant once inlined) activation rows, each
 * row's PR results stored at out + r * os. Each activation row finishes a
 * block before the next starts (the panel's bytes come again from L1):
 * that keeps its partial sums in few registers. */
INLINE void panel_tile(enum luma_type t, int ta, int64_t nb, const uint8_t *panel, const uint8_t *a,
                       size_t as, float *out, size_t os)
{
    const int L = panel_sum_len(t);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_A];
    for (int r = 0; r < ta; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + (size_t)b * PANEL_BLOCK_BYTES;
        const float *scale = (const float *)(pb + 32 * PR), *offset = scale + PR;
        for (int r = 0; r < ta; r++) {
            const luma_panel_act *y = (const luma_panel_act *)(a + (size_t)r * as) + b;
            __m256i s32 = _mm256_setzero_si256();
            for (int k0 = 0; k0 < 8; k0 += L) {
                __m256i s16 = _mm256_setzero_si256();
                for (int k = k0; k < k0 + L; k++) {
                    __m256i wq = _mm256_loadu_si256((const __m256i *)(pb + 32 * k));
                    int32_t a4;
                    memcpy(&a4, y->q + 4 * k, sizeof a4);
                    __m256i av = _mm256_set1_epi32(a4), p;
                    if (panel_signed(t)) p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(av, wq));
                    else p = _mm256_maddubs_epi16(wq, av);
                    s16 = k == k0 ? p : _mm256_add_epi16(s16, p);
                }
                __m256i p = _mm256_madd_epi16(s16, ones);
                s32 = k0 == 0 ? p : _mm256_add_epi32(s32, p);
            }
            acc[r] = panel_step(t, acc[r], s32, _mm256_loadu_ps(scale), _mm256_loadu_ps(offset), y);
        }
    }
    for (int r = 0; r < ta; r++) _mm256_storeu_ps(out + (size_t)r * os, acc[r]);
}

INLINE void panel_rows(enum luma_type t, int64_t n, const void *panel, int nr, const void *a, size_t as,
                       int na, float *out, size_t os)
{
    const uint8_t *ab = a;
    const int64_t nb = n / LUMA_QK;
    float part[TILE_A * PR];
    for (int j = 0; j < na;) {
        int ta = na - j >= TILE_A ? TILE_A : na - j >= 2 ? 2 : 1;
        const uint8_t *aj = ab + (size_t)j * as;
        /* a full panel writes its results in place, a partial one through part */
        float *dst = nr == PR ? out + (size_t)j * os : part;
        size_t ds = nr == PR ? os : PR;
        if (ta == TILE_A) panel_tile(t, TILE_A, nb, panel, aj, as, dst, ds);
        else if (ta == 2) panel_tile(t, 2, nb, panel, aj, as, dst, ds);
        else panel_tile(t, 1, nb, panel, aj, as, dst, ds);
        if (nr < PR)
            for (int r = 0; r < ta; r++)
                memcpy(out + (size_t)(j + r) * os, part + r * PR, (size_t)nr * sizeof(float));
        j += ta;
    }
}

/* The panel's arithmetic on weight rows as they are stored, for the few
 * activation rows where packing a panel does not pay (decode). 8 rows at a
 * time and EXACT_SEG blocks at a time: each row in turn streams its blocks
 * (as the hardware prefetcher likes), leaving each block's 8 int32 partial
 * sums, scale and offset; then each block's 8 rows fold into one vector
 * whose lanes meet the scales and offsets exactly as a panel's lanes do. A
 * row of activations thus gets the same results, bit for bit, in a panel
 * among many rows or alone: a prefill gives the logits of its tokens
 * evaluated one by one. */
#define EXACT_SEG 32

/* The sums of the 8 int32 lanes of each of 8 vectors, in order. */
INLINE __m256i hsum8_epi32(const __m256i p[8])
{
    __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

INLINE void exact_rows8(enum luma_type t, int64_t n, const uint8_t *w, size_t ws, int nr, const luma_panel_act *y,
                        float *out)
{
    const size_t bs = legacy_block_size(t), dist = prefetch_distance(ws);
    const int64_t nb = n / LUMA_QK;
    __m256i part[EXACT_SEG][PR];
    float scale[EXACT_SEG][PR], offset[EXACT_SEG][PR];
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += EXACT_SEG) {
        const int seg = (int)(nb - b0 < EXACT_SEG ? nb - b0 : EXACT_SEG);
        for (int i = 0; i < PR; i++) {
            const uint8_t *row = w + (size_t)i * ws + (size_t)b0 * bs;
            for (int b = 0; b < seg; b++) {
                if (i >= nr) {
                    part[b][i] = _mm256_setzero_si256();
                    scale[b][i] = offset[b][i] = 0.0f;
                    continue;
                }
                prefetch_ahead(row + (size_t)b * bs, dist, bs);
                panel_block x = panel_decode(t, row + (size_t)b * bs);
                part[b][i] = panel_block_dot(t, &x, _mm256_loadu_si256((const __m256i *)y[b0 + b].q));
                scale[b][i] = x.scale;
                offset[b][i] = x.offset;
            }
        }
        for (int b = 0; b < seg; b++)
            acc = panel_step(t, acc, hsum8_epi32(part[b]), _mm256_loadu_ps(scale[b]), _mm256_loadu_ps(offset[b]),
                             y + b0 + b);
    }
    float lanes[PR];
    _mm256_storeu_ps(lanes, acc);
    memcpy(out, lanes, (size_t)nr * sizeof(float));
}

INLINE void exact_rows(enum luma_type t, int64_t n, const void *w, size_t ws, int nr, const void *a, size_t as,
                       int na, float *out, size_t os)
{
    for (int i0 = 0; i0 < nr; i0 += PR)
        for (int r = 0; r < na; r++)
            exact_rows8(t, n, (const uint8_t *)w + (size_t)i0 * ws, ws, nr - i0 < PR ? nr - i0 : PR,
                        (const luma_panel_act *)((const uint8_t *)a + (size_t)r * as), out + (size_t)r * os + i0);
}

/* Q8_0 activation rows (n elements) to panel blocks: the same int8 values,
 * the scale as a float, and the scale times the block's sum, which the
 * weights' offsets meet. */
void luma_panel_act_avx2(const luma_block_q8_0 *src, int64_t n, luma_panel_act *dst)
{
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < n / LUMA_QK; b++, src++, dst++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)src->qs);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_hadd_epi32(h, h);
        h = _mm_hadd_epi32(h, h);
        _mm256_storeu_si256((__m256i *)dst->q, q);
        dst->d = f16(src->d);
        dst->s = dst->d * (float)_mm_cvtsi128_si32(h);
    }
}

#define PANEL_KERNELS(name, type)                                                                \
    static void pack_##name(int64_t n, const void *w, size_t ws, int nr, void *panel)           \
    {                                                                                            \
        panel_pack(type, n, w, ws, nr, panel);                                                   \
    }                                                                                            \
    static void panel_dot_##name(int64_t n, const void *panel, int nr, const void *a, size_t as, \
                                 int na, float *out, size_t os)                                  \
    {                                                                                            \
        panel_rows(type, n, panel, nr, a, as, na, out, os);                                      \
    }                                                                                            \
    static void exact_##name(int64_t n, const void *w, size_t ws, int nr, const void *a, size_t as, \
                             int na, float *out, size_t os)                                      \
    {                                                                                            \
        exact_rows(type, n, w, ws, nr, a, as, na, out, os);                                      \
    }                                                                                            \
    static const luma_panel_ops panel_##name = { PANEL_BLOCK_BYTES, PANEL_MIN_ROWS(type), pack_##name, \
                                                 panel_dot_##name, exact_##name };

PANEL_KERNELS(q4_0, LUMA_Q4_0)
PANEL_KERNELS(q4_1, LUMA_Q4_1)
PANEL_KERNELS(q5_0, LUMA_Q5_0)
PANEL_KERNELS(q5_1, LUMA_Q5_1)
PANEL_KERNELS(q8_0, LUMA_Q8_0)

const luma_panel_ops *luma_panel_avx2(enum luma_type t)
{
    switch (t) {
    case LUMA_Q4_0: return &panel_q4_0;
    case LUMA_Q4_1: return &panel_q4_1;
    case LUMA_Q5_0: return &panel_q5_0;
    case LUMA_Q5_1: return &panel_q5_1;
    case LUMA_Q8_0: return &panel_q8_0;
    default: return NULL;
    }
}

/* ---- activation quantizers ---------------------------------------------- */

/* roundf: half away from zero (cvtps rounds half to even). */
INLINE __m256 round_away(__m256 p)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, p), f = _mm256_floor_ps(a);
    __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(a, f), _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                              _mm256_set1_ps(1.0f));
    return _mm256_or_ps(_mm256_add_ps(f, up), _mm256_and_ps(p, sign));
}

void luma_quantize_q8_0_avx2(const float *x, luma_block_q8_0 *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += LUMA_QK, y++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = max_abs(v[k], m);
        }
        float amax = hmax_ps(m);
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y->d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v[k], _mm256_set1_ps(id))));
        _mm256_storeu_si256((__m256i *)y->qs, pack_i8(q[0], q[1], q[2], q[3]));
    }
}

void luma_quantize_q8_K_avx2(const float *x, luma_block_q8_K *y, int64_t nb)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++, x += LUMA_QK_K, y++) {
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < LUMA_QK_K; k += 8) m = max_abs(_mm256_loadu_ps(x + k), m);
        float amax = hmax_ps(m);
        if (amax == 0.0f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        /* the first element of that magnitude, as the scalar scan finds it */
        int first = 0;
        for (int k = 0; k < LUMA_QK_K; k += 8) {
            __m256 eq = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), _mm256_set1_ps(amax),
                                      _CMP_EQ_OQ);
            int mask = _mm256_movemask_ps(eq);
            if (mask) {
                first = k + __builtin_ctz((unsigned)mask);
                break;
            }
        }
        float iscale = -127.0f / x[first];
        const __m256 vs = _mm256_set1_ps(iscale);
        for (int g = 0; g < LUMA_QK_K; g += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                __m256 p = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + g + 8 * k), vs),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_cvtps_epi32(p);
            }
            /* the signed pack saturates the one value that can reach 128 */
            __m256i q8 = pack_i8(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i *)(y->qs + g), q8);
            int32_t s[8];
            __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
            _mm256_storeu_si256((__m256i *)s, sums);
            y->bsums[g / 16] = (int16_t)(s[0] + s[1] + s[2] + s[3]);
            y->bsums[g / 16 + 1] = (int16_t)(s[4] + s[5] + s[6] + s[7]);
        }
        y->d = 1.0f / iscale;
    }
}

void luma_f16_to_f32_row_avx2(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = f16(src[i]);
}

/* ---- dequantizers --------------------------------------------------------- */

/* Each element as its scalar reference in quant.c computes it: the integer
 * value made a float, one IEEE multiply by the block's (or sub-block's)
 * scale, and for Q4_K one subtraction of the minimum, never fused: the
 * same bits. */

/* 8 signed bytes (the low 8 of q) times d, to y[0..7] */
INLINE void store8_i8(float *y, __m128i q, __m256 d)
{
    _mm256_storeu_ps(y, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
}

/* 32 signed bytes times d */
INLINE void store32_i8(float *y, __m256i v, __m256 d)
{
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    store8_i8(y, lo, d);
    store8_i8(y + 8, _mm_srli_si128(lo, 8), d);
    store8_i8(y + 16, hi, d);
    store8_i8(y + 24, _mm_srli_si128(hi, 8), d);
}

/* The low and high nibbles of 16 bytes: elements 0..15, then 16..31. */
INLINE __m256i nibbles16(const uint8_t *qs)
{
    __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* Byte j = 0x10 where bit j of h is set, else 0. */
INLINE __m256i bits_to_16(uint32_t h)
{
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                     2, 3, 3, 3, 3, 3, 3, 3, 3));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

static void dequant_q4_0(const luma_block_q4_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK)
        store32_i8(y, _mm256_sub_epi8(nibbles16(x->qs), _mm256_set1_epi8(8)), _mm256_set1_ps(f16(x->d)));
}

static void dequant_q5_0(const luma_block_q5_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK) {
        uint32_t qh;
        memcpy(&qh, x->qh, 4);
        __m256i v = _mm256_or_si256(nibbles16(x->qs), bits_to_16(qh));
        store32_i8(y, _mm256_sub_epi8(v, _mm256_set1_epi8(16)), _mm256_set1_ps(f16(x->d)));
    }
}

static void dequant_q8_0(const luma_block_q8_0 *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK)
        store32_i8(y, _mm256_loadu_si256((const __m256i *)x->qs), _mm256_set1_ps(f16(x->d)));
}

/* Q4_K: sub-block s is the low (s even) or high nibbles of qs[32 (s / 2) ..]. */
static void dequant_q4_K(const luma_block_q4_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = f16(x->d), dmin = f16(x->dmin);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            luma_scale_min_k4(s, x->scales, &sc, &m);
            __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)m);
            __m256i q = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (s / 2)));
            q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
            __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            __m128i part[4] = { lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8) };
            for (int i = 0; i < 4; i++) {
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i]));
                _mm256_storeu_ps(y + 32 * s + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d1, f), m1));
            }
        }
    }
}

/* Q6_K: element 128 c + 32 k + l is (4 bits of ql, 2 of qh) - 32, times
 * d * scales[8 c + 2 k + l / 16]. */
static void dequant_q6_K(const luma_block_q6_K *x, float *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x++, y += LUMA_QK_K) {
        float d = f16(x->d);
        for (int c = 0; c < 2; c++) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * c));
            for (int k = 0; k < 4; k++) {
                __m256i ql = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * c + 32 * (k % 2)));
                ql = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
                float *yk = y + 128 * c + 32 * k;
                __m256 d0 = _mm256_set1_ps(d * (float)x->scales[8 * c + 2 * k]);
                __m256 d1 = _mm256_set1_ps(d * (float)x->scales[8 * c + 2 * k + 1]);
                __m128i lo = _mm256_castsi256_si128(v), up = _mm256_extracti128_si256(v, 1);
                store8_i8(yk, lo, d0);
                store8_i8(yk + 8, _mm_srli_si128(lo, 8), d0);
                store8_i8(yk + 16, up, d1);
                store8_i8(yk + 24, _mm_srli_si128(up, 8), d1);
            }
        }
    }
}

bool luma_dequantize_avx2(enum luma_type t, const void *src, float *dst, int64_t nb)
{
    switch (t) {
    case LUMA_Q4_0: dequant_q4_0(src, dst, nb); return true;
    case LUMA_Q5_0: dequant_q5_0(src, dst, nb); return true;
    case LUMA_Q8_0: dequant_q8_0(src, dst, nb); return true;
    case LUMA_Q4_K: dequant_q4_K(src, dst, nb); return true;
    case LUMA_Q6_K: dequant_q6_K(src, dst, nb); return true;
    default: return false;
    }
}
