/* Number formats (src/quant.c, src/cpu/quant_avx2.c):
 *   - type traits and row sizes match GGML's block layouts;
 *   - half/bfloat conversions round to nearest even and keep inf, NaN,
 *     subnormals; the F16C row conversion equals the scalar one;
 *   - the dequantizers equal, bit for bit, the gguf Python package on
 *     random blocks (spec/data/quant-golden.bin, scripts/gen-quant-golden.py),
 *     the SIMD ones the scalar ones on random blocks of every type, and the
 *     Q8_0 quantizer gives the package's bytes;
 *   - the scalar dots equal a double-precision dot of the dequantized rows;
 *   - the SIMD dots, tiles and activation quantizers equal the scalar ones.
 * Prints a timing line per type (informative, never asserted). */
#define _POSIX_C_SOURCE 200809L  /* clock_gettime */

#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const enum luma_type weight_types[] = {
    LUMA_F32, LUMA_F16, LUMA_BF16, LUMA_Q4_0, LUMA_Q4_1, LUMA_Q5_0, LUMA_Q5_1, LUMA_Q8_0,
    LUMA_Q2_K, LUMA_Q3_K, LUMA_Q4_K, LUMA_Q5_K, LUMA_Q6_K,
};
#define N_WEIGHT_TYPES (int)(sizeof weight_types / sizeof weight_types[0])

/* ---- random data -------------------------------------------------------- */

static void random_floats(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) x[i] = scale * gaussian();
}

/* ---- traits ------------------------------------------------------------- */

static void test_traits(void)
{
    /* GGML_QUANT_SIZES of the gguf package */
    static const struct { enum luma_type t; int64_t bs; size_t ts; const char *name; } want[] = {
        { LUMA_F32, 1, 4, "F32" }, { LUMA_F16, 1, 2, "F16" }, { LUMA_BF16, 1, 2, "BF16" },
        { LUMA_Q4_0, 32, 18, "Q4_0" }, { LUMA_Q4_1, 32, 20, "Q4_1" }, { LUMA_Q5_0, 32, 22, "Q5_0" },
        { LUMA_Q5_1, 32, 24, "Q5_1" }, { LUMA_Q8_0, 32, 34, "Q8_0" }, { LUMA_Q2_K, 256, 84, "Q2_K" },
        { LUMA_Q3_K, 256, 110, "Q3_K" }, { LUMA_Q4_K, 256, 144, "Q4_K" }, { LUMA_Q5_K, 256, 176, "Q5_K" },
        { LUMA_Q6_K, 256, 210, "Q6_K" }, { LUMA_Q8_K, 256, 292, "Q8_K" },
    };
    int checks = 0;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++, checks++) {
        const luma_type_traits *tr = luma_type_get(want[i].t);
        CHECKF(tr && tr->block_size == want[i].bs && tr->type_size == want[i].ts &&
                   strcmp(tr->name, want[i].name) == 0 && strcmp(luma_type_name(want[i].t), want[i].name) == 0,
               "traits of %s", want[i].name);
        CHECKF(luma_vec_dot_ref(want[i].t) && luma_vec_dot_get(want[i].t), "dot for %s", want[i].name);
    }
    CHECKF(luma_type_get(LUMA_Q8_1) == NULL && luma_type_get(4) == NULL && luma_type_get(LUMA_TYPE_COUNT) == NULL &&
               luma_type_get(0xffffffffu) == NULL, "unknown types");
    CHECKF(strcmp(luma_type_name(99), "unknown") == 0, "name of an unknown type");
    CHECKF(luma_vec_dot_get(LUMA_Q8_1) == NULL && luma_vec_dot_ref((enum luma_type)5) == NULL, "no dot for unknown");
    CHECKF(luma_type_get(LUMA_Q4_K)->act_type == LUMA_Q8_K && luma_type_get(LUMA_Q5_0)->act_type == LUMA_Q8_0 &&
               luma_type_get(LUMA_F16)->act_type == LUMA_F32, "activation types");
    CHECKF(luma_row_size(LUMA_Q4_K, 512) == 288 && luma_row_size(LUMA_F16, 7) == 14, "row sizes");
    CHECKF(luma_row_size(LUMA_Q4_K, 300) == 0 && luma_row_size(LUMA_Q4_0, 0) == 0 &&
               luma_row_size(LUMA_Q4_0, -32) == 0 && luma_row_size((enum luma_type)4, 32) == 0,
           "row size of a bad length or type is 0");
    CHECKF(luma_row_size(LUMA_F32, INT64_MAX) == 0 || sizeof(size_t) > 8, "row size overflow is 0");
    checks += 8;
    printf("traits: %d checks, simd path %s\n", checks, luma_simd_name());
}

/* ---- conversions -------------------------------------------------------- */

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_conversions(void)
{
    static const struct { float f; uint16_t h; } f16_cases[] = {
        { 0.0f, 0x0000 }, { -0.0f, 0x8000 }, { 1.0f, 0x3c00 }, { -2.0f, 0xc000 }, { 65504.0f, 0x7bff },
        { 65519.99f, 0x7bff }, { 65520.0f, 0x7c00 }, { 1e10f, 0x7c00 }, { -INFINITY, 0xfc00 }, { INFINITY, 0x7c00 },
        { 6.103515625e-05f, 0x0400 },             /* smallest normal */
        { 5.9604644775390625e-08f, 0x0001 },      /* smallest subnormal */
        { 2.98023223876953125e-08f, 0x0000 },     /* half of it: tie to even 0 */
        { 2.98023259e-08f, 0x0001 },              /* just above the tie */
        { 8.94069671630859375e-08f, 0x0002 },     /* 1.5 x smallest: tie to even 2 */
        { 6.100535392761230469e-05f, 0x0400 },   /* largest subnormal + half ulp: rounds up to normal */
        { 1.00048828125f, 0x3c00 },               /* 1 + half ulp: tie to even */
        { 1.00146484375f, 0x3c02 },               /* 1 + 1.5 ulp: tie to even */
        { 0.333333343f, 0x3555 },
    };
    int checks = 0;
    for (size_t i = 0; i < sizeof f16_cases / sizeof f16_cases[0]; i++, checks++)
        CHECKF(luma_f32_to_f16(f16_cases[i].f) == f16_cases[i].h, "f32_to_f16(%g) = 0x%04x, want 0x%04x",
               (double)f16_cases[i].f, luma_f32_to_f16(f16_cases[i].f), f16_cases[i].h);
    uint16_t hn = luma_f32_to_f16(NAN);
    CHECKF((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0, "f32_to_f16(NaN) is a NaN");
    CHECKF((luma_f32_to_f16(from_bits(0x7f800001)) & 0x7fff) > 0x7c00, "a signalling NaN with a low payload stays NaN");
    CHECKF(isnan(luma_f16_to_f32(0x7e00)) && isnan(luma_f16_to_f32(0xfc01)), "f16 NaN to f32");
    CHECKF(luma_f16_to_f32(0x0001) == 5.9604644775390625e-08f && luma_f16_to_f32(0x83ff) == -6.09755516e-05f,
           "f16 subnormals to f32");
    checks += 4;

    /* Every half: to float and back is the identity (NaNs stay NaN), the
     * midpoint to the next half rounds to the even one, F16C agrees. */
    float *row = xmalloc(65536 * sizeof(float));
    uint16_t *all = xmalloc(65536 * sizeof(uint16_t));
    for (uint32_t h = 0; h < 65536; h++) all[h] = (uint16_t)h;
    luma_f16_to_f32_row(all, row, 65536);
    int bad_round = 0, bad_mid = 0, bad_row = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = luma_f16_to_f32((uint16_t)h);
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (nan) {
            bad_round += !isnan(f) || (luma_f32_to_f16(f) & 0x7fff) <= 0x7c00;
            bad_row += !isnan(row[h]);
            continue;
        }
        bad_round += luma_f32_to_f16(f) != h;
        bad_row += bits_of(row[h]) != bits_of(f);
        if ((h & 0x7fff) < 0x7bff) {
            float next = luma_f16_to_f32((uint16_t)(h + 1));
            float mid = (float)(((double)f + (double)next) / 2);
            uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            bad_mid += luma_f32_to_f16(mid) != want;
        }
    }
    CHECKF(bad_round == 0, "%d halves do not round-trip", bad_round);
    CHECKF(bad_mid == 0, "%d midpoints do not round to even", bad_mid);
    CHECKF(bad_row == 0, "%d halves differ in luma_f16_to_f32_row", bad_row);
    free(row);
    free(all);
    checks += 3 * 65536;

    static const struct { float f; uint16_t b; } bf16_cases[] = {
        { 0.0f, 0x0000 }, { -0.0f, 0x8000 }, { 1.0f, 0x3f80 }, { -2.0f, 0xc000 }, { INFINITY, 0x7f80 },
        { -INFINITY, 0xff80 }, { 3.4028235e38f, 0x7f80 }, /* FLT_MAX rounds up to inf */
        { 1.00390625f, 0x3f80 },                          /* 1 + half ulp: tie to even */
        { 1.01171875f, 0x3f82 },                          /* 1 + 1.5 ulp: tie to even */
        { 1.00390637f, 0x3f81 },                          /* just above the tie */
        { 9.18354962e-41f, 0x0001 },                      /* subnormal kept */
    };
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0]; i++, checks++)
        CHECKF(luma_f32_to_bf16(bf16_cases[i].f) == bf16_cases[i].b, "f32_to_bf16(%g) = 0x%04x, want 0x%04x",
               (double)bf16_cases[i].f, luma_f32_to_bf16(bf16_cases[i].f), bf16_cases[i].b);
    uint16_t bn = luma_f32_to_bf16(from_bits(0x7f800001));
    CHECKF((bn & 0x7f80) == 0x7f80 && (bn & 0x7f) != 0, "bf16 of a NaN with a low payload stays NaN");
    CHECKF(isnan(luma_bf16_to_f32(0x7fc0)) && luma_bf16_to_f32(0x3f80) == 1.0f, "bf16 to f32");
    int bad_bf = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        float f = luma_bf16_to_f32((uint16_t)b);
        if (!isnan(f)) bad_bf += luma_f32_to_bf16(f) != b;
    }
    CHECKF(bad_bf == 0, "%d bfloats do not round-trip", bad_bf);
    checks += 2 + 65536;
    printf("conversions: %d checks\n", checks);
}

/* ---- golden data from the gguf Python package --------------------------- */

static int read_u32(FILE *f, uint32_t *v)
{
    uint8_t b[4];
    if (fread(b, 1, 4, f) != 4) return -1;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 0;
}

static void test_golden(void)
{
    const char *path = LUMA_SOURCE_DIR "/spec/data/quant-golden.bin";
    FILE *f = fopen(path, "rb");
    if (!f) {
        failures++;
        printf("golden: FAIL cannot open %s (run scripts/gen-quant-golden.py)\n", path);
        return;
    }
    char magic[4];
    uint32_t version = 0, count = 0;
    if (fread(magic, 1, 4, f) != 4 || memcmp(magic, "LQGD", 4) != 0 || read_u32(f, &version) || version != 1 ||
        read_u32(f, &count)) {
        failures++;
        printf("golden: FAIL %s is not a version 1 golden file\n", path);
        fclose(f);
        return;
    }
    int entries = 0, values = 0;
    for (uint32_t e = 0; e < count; e++) {
        uint32_t kind, type, n, nbytes;
        if (read_u32(f, &kind) || read_u32(f, &type) || read_u32(f, &n) || read_u32(f, &nbytes) || n > (1u << 20) ||
            nbytes > (1u << 22)) {
            CHECKF(0, "entry %u header truncated", e);
            break;
        }
        const luma_type_traits *tr = luma_type_get(type);
        uint8_t *bytes = xmalloc(nbytes);
        float *want = xmalloc((size_t)n * sizeof(float));
        if (fread(bytes, 1, nbytes, f) != nbytes || fread(want, sizeof(float), n, f) != n) {
            CHECKF(0, "entry %u truncated", e);
            free(bytes);
            free(want);
            break;
        }
        if (!tr || luma_row_size((enum luma_type)type, n) != nbytes) {
            CHECKF(0, "entry %u: type %u with %u elements in %u bytes", e, type, n, nbytes);
        } else if (kind == 0) {
            float *got = xmalloc((size_t)n * sizeof(float));
            luma_dequantize_row((enum luma_type)type, bytes, got, n);
            int bad = 0;
            for (uint32_t i = 0; i < n; i++) {
                bool same = bits_of(got[i]) == bits_of(want[i]) || (isnan(got[i]) && isnan(want[i]));
                if (!same && bad++ == 0)
                    CHECKF(0, "%s element %u: got %.9g, want %.9g", tr->name, i, (double)got[i], (double)want[i]);
            }
            CHECKF(bad == 0, "%s: %d of %u values differ from the gguf package", tr->name, bad, n);
            free(got);
        } else {
            uint8_t *got = xmalloc(nbytes), *simd = xmalloc(nbytes);
            luma_quantize_act_ref((enum luma_type)type, want, got, n);
            luma_quantize_act((enum luma_type)type, want, simd, n);
            CHECKF(memcmp(got, bytes, nbytes) == 0, "%s quantization differs from the gguf package", tr->name);
            CHECKF(memcmp(simd, bytes, nbytes) == 0, "%s SIMD quantization differs from the gguf package", tr->name);
            free(got);
            free(simd);
        }
        entries++;
        values += (int)n;
        free(bytes);
        free(want);
    }
    fclose(f);
    CHECKF(entries == (int)count && count >= 16, "read %d of %u golden entries", entries, count);
    printf("golden: %d entries, %d values compared with the gguf package\n", entries, values);
}

/* ---- dot products ------------------------------------------------------- */

/* The activation row in t's act_type and its dequantized values. */
typedef struct {
    enum luma_type type;
    void *q;
    float *deq;
    size_t row;
} act_row;

static act_row make_act(enum luma_type wt, int64_t n, const float *x)
{
    act_row a;
    a.type = luma_type_get(wt)->act_type;
    a.row = luma_row_size(a.type, n);
    a.q = xmalloc(a.row);
    a.deq = xmalloc((size_t)n * sizeof(float));
    luma_quantize_act_ref(a.type, x, a.q, n);
    luma_dequantize_row(a.type, a.q, a.deq, n);
    return a;
}

static void free_act(act_row *a)
{
    free(a->q);
    free(a->deq);
}

static void test_dots(void)
{
    static const int64_t lengths[] = { 256, 512, 4096 };
    int checks = 0;
    double worst_ref = 0.0, worst_simd = 0.0;
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        enum luma_type t = weight_types[ti];
        luma_vec_dot_fn ref = luma_vec_dot_ref(t), fast = luma_vec_dot_get(t);
        for (int li = 0; li < 3; li++) {
            int64_t n = lengths[li];
            for (int rep = 0; rep < 4; rep++) {
                uint8_t *w = xmalloc(luma_row_size(t, n));
                float *x = xmalloc((size_t)n * sizeof(float)), *wd = xmalloc((size_t)n * sizeof(float));
                random_weights(t, n, w);
                random_floats(x, n, rep == 3 ? 1e-3f : 1.0f);
                act_row a = make_act(t, n, x);
                luma_dequantize_row(t, w, wd, n);
                double exact = 0.0, mag = 0.0;
                for (int64_t i = 0; i < n; i++) {
                    exact += (double)wd[i] * (double)a.deq[i];
                    mag += fabs((double)wd[i] * (double)a.deq[i]);
                }
                float r = ref(n, w, a.q), s = fast(n, w, a.q);
                double er = fabs(r - exact) / (mag + 1e-30), es = fabs(s - r) / (mag + 1e-30);
                worst_ref = er > worst_ref ? er : worst_ref;
                worst_simd = es > worst_simd ? es : worst_simd;
                CHECKF(er <= 1e-5, "%s n=%lld: scalar %.9g, double %.9g (%.2g of sum|w*a|)", luma_type_name(t),
                       (long long)n, (double)r, exact, er);
                CHECKF(es <= 1e-4, "%s n=%lld: simd %.9g, scalar %.9g (%.2g of sum|w*a|)", luma_type_name(t),
                       (long long)n, (double)s, (double)r, es);
                checks += 2;
                free_act(&a);
                free(w);
                free(x);
                free(wd);
            }
        }
    }
    printf("dots: %d checks over %d types x lengths 256, 512, 4096; worst error scalar-vs-double %.2g, "
           "simd-vs-scalar %.2g (of sum|w*a|)\n", checks, N_WEIGHT_TYPES, worst_ref, worst_simd);
}

/* Odd float lengths take the scalar tail of the SIMD float kernels. */
static void test_float_tails(void)
{
    int checks = 0;
    static const enum luma_type ft[] = { LUMA_F32, LUMA_F16, LUMA_BF16 };
    for (int ti = 0; ti < 3; ti++)
        for (int64_t n = 1; n <= 41; n += 5) {
            uint8_t *w = xmalloc(luma_row_size(ft[ti], n));
            float *x = xmalloc((size_t)n * sizeof(float));
            random_weights(ft[ti], n, w);
            random_floats(x, n, 1.0f);
            float r = luma_vec_dot_ref(ft[ti])(n, w, x), s = luma_vec_dot_get(ft[ti])(n, w, x);
            CHECKF(fabsf(r - s) <= 1e-5f * (1.0f + fabsf(r)), "%s n=%lld: %g vs %g", luma_type_name(ft[ti]),
                   (long long)n, (double)s, (double)r);
            checks++;
            free(w);
            free(x);
        }
    printf("float tails: %d checks\n", checks);
}

/* The tile: 5 weight rows x 7 activation rows (tiles of 4, 2 and 1), rows
 * apart by more than their size, against one dot at a time. */
static void test_rows(void)
{
    int checks = 0;
    const int nr = 5, na = 7;
    const int64_t n = 512;
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        enum luma_type t = weight_types[ti];
        enum luma_type at = luma_type_get(t)->act_type;
        size_t ws = luma_row_size(t, n) + 64, as = luma_row_size(at, n) + 64, os = (size_t)nr + 3;
        uint8_t *w = xmalloc(ws * (size_t)nr), *a = xmalloc(as * (size_t)na);
        float *x = xmalloc((size_t)n * sizeof(float)), *out = xmalloc(os * (size_t)na * sizeof(float));
        for (int i = 0; i < nr; i++) random_weights(t, n, w + (size_t)i * ws);
        for (int j = 0; j < na; j++) {
            random_floats(x, n, 1.0f);
            luma_quantize_act(at, x, a + (size_t)j * as, n);
        }
        for (size_t k = 0; k < os * (size_t)na; k++) out[k] = -12345.0f;
        luma_vec_dot_rows(t, n, w, ws, nr, a, as, na, out, os);
        luma_vec_dot_fn dot = luma_vec_dot_get(t);
        int bad = 0, touched = 0;
        for (int j = 0; j < na; j++)
            for (size_t i = 0; i < os; i++) {
                float got = out[(size_t)j * os + i];
                if (i >= (size_t)nr) {
                    touched += got != -12345.0f;
                    continue;
                }
                float want = dot(n, w + i * ws, a + (size_t)j * as);
                bad += !(fabsf(got - want) <= 1e-5f * (1.0f + fabsf(want)));
            }
        CHECKF(bad == 0, "%s: %d tile results differ from single dots", luma_type_name(t), bad);
        CHECKF(touched == 0, "%s: the tile wrote %d values outside its rows", luma_type_name(t), touched);
        checks += nr * na + 1;
        free(w);
        free(a);
        free(x);
        free(out);
    }
    printf("rows: %d checks (%d x %d tiles, %d types)\n", checks, nr, na, N_WEIGHT_TYPES);
}

/* ---- activation quantizers ---------------------------------------------- */

static void test_quantize_act(void)
{
    int checks = 0;
    static const enum luma_type at[] = { LUMA_Q8_0, LUMA_Q8_K, LUMA_F32 };
    const int64_t n = 4096;
    float *x = xmalloc((size_t)n * sizeof(float));
    for (int ti = 0; ti < 3; ti++) {
        size_t row = luma_row_size(at[ti], n);
        uint8_t *r = xmalloc(row), *s = xmalloc(row);
        for (int rep = 0; rep < 12; rep++) {
            static const float scales[] = { 1.0f, 1e-4f, 1e3f, 1e-30f };
            random_floats(x, n, scales[rep % 4]);
            if (rep >= 4) /* a zero block, ties, and equal magnitudes of both signs */
                for (int64_t i = 0; i < 256; i++) x[i] = 0.0f;
            if (rep >= 8) {
                for (int64_t i = 256; i < 512; i++) x[i] = (float)((int)(i % 64) - 32) * 0.5f;
                x[300] = 127.0f;
                x[301] = -127.0f;
                x[600] = -64.0f;
                x[601] = 64.0f;
            }
            memset(r, 0xAA, row);
            memset(s, 0x55, row);
            luma_quantize_act_ref(at[ti], x, r, n);
            luma_quantize_act(at[ti], x, s, n);
            CHECKF(memcmp(r, s, row) == 0, "%s rep %d: SIMD bytes differ from the scalar ones", luma_type_name(at[ti]),
                   rep);
            checks++;
        }
        /* Q8_K: the largest magnitude maps to -127, and bsums are the sums */
        if (at[ti] == LUMA_Q8_K) {
            const luma_block_q8_K *b = (const luma_block_q8_K *)r;
            int bad = 0;
            for (int64_t k = 0; k < n / LUMA_QK_K; k++)
                for (int g = 0; g < 16; g++) {
                    int sum = 0;
                    for (int j = 0; j < 16; j++) sum += b[k].qs[16 * g + j];
                    bad += sum != b[k].bsums[g];
                }
            CHECKF(bad == 0, "Q8_K: %d bsums wrong", bad);
            CHECKF(b[1].qs[300 - 256] == -127 && b[1].qs[301 - 256] == 127 && b[0].d == 0.0f, "Q8_K extremes");
            checks += 2;
        }
        free(r);
        free(s);
    }
    free(x);
    printf("quantize_act: %d checks (SIMD equals scalar byte for byte)\n", checks);
}

/* ---- timing (informative) ----------------------------------------------- */

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static volatile float sink;

/* The best of 5 windows of at least 0.4 ms: other processes share the CPU. */
#define TIMED(ns_per_call, body)                                  \
    do {                                                          \
        ns_per_call = 1e30;                                       \
        for (int win = 0; win < 5; win++) {                       \
            int calls_ = 0;                                       \
            double t0_ = now_ns(), el_;                           \
            do {                                                  \
                body;                                             \
                calls_++;                                         \
                el_ = now_ns() - t0_;                             \
            } while (el_ < 4e5);                                  \
            if (el_ / calls_ < ns_per_call) ns_per_call = el_ / calls_; \
        }                                                         \
    } while (0)

static double time_dot(luma_vec_dot_fn f, int64_t n, const void *w, const void *a)
{
    double ns;
    TIMED(ns, sink += f(n, w, a));
    return ns / ((double)n / 256);
}

static void test_timing(void)
{
    const int64_t n = 4096;
    const int nr = 16, na = 4;
    float *x = xmalloc((size_t)n * sizeof(float)), out[16 * 4];
    random_floats(x, n, 1.0f);
    printf("timing (ns per 256 elements per dot; %s; tile = %d weight rows x %d tokens):\n", luma_simd_name(), nr, na);
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        enum luma_type t = weight_types[ti];
        enum luma_type at = luma_type_get(t)->act_type;
        size_t ws = luma_row_size(t, n), as = luma_row_size(at, n);
        uint8_t *w = xmalloc(ws * (size_t)nr), *a = xmalloc(as * (size_t)na);
        for (int i = 0; i < nr; i++) random_weights(t, n, w + (size_t)i * ws);
        for (int j = 0; j < na; j++) luma_quantize_act(at, x, a + (size_t)j * as, n);
        double scalar = time_dot(luma_vec_dot_ref(t), n, w, a), simd = time_dot(luma_vec_dot_get(t), n, w, a);
        double tile;
        TIMED(tile, (luma_vec_dot_rows(t, n, w, ws, nr, a, as, na, out, (size_t)nr), sink += out[0]));
        tile /= nr * na * ((double)n / 256);
        printf("  %-5s scalar %8.1f  simd %7.1f  tile %7.1f\n", luma_type_name(t), scalar, simd, tile);
        free(w);
        free(a);
    }
    free(x);
}

/* luma_dequantize_row (SIMD where the CPU has it) against the scalar
 * reference, bit for bit, on random blocks of every weight type. */
static void test_dequant_simd(void)
{
    const int64_t n = 4096;
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        enum luma_type t = weight_types[ti];
        size_t bytes = luma_row_size(t, n);
        uint8_t *w = xmalloc(bytes);
        random_weights(t, n, w);
        float *ref = xmalloc((size_t)n * sizeof(float)), *got = xmalloc((size_t)n * sizeof(float));
        luma_dequantize_row_ref(t, w, ref, n);
        luma_dequantize_row(t, w, got, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += bits_of(ref[i]) != bits_of(got[i]) && !(isnan(ref[i]) && isnan(got[i]));
        CHECKF(bad == 0, "%s: %d of %lld dequantized values differ from the scalar reference", luma_type_name(t), bad,
               (long long)n);
        free(w);
        free(ref);
        free(got);
    }
}

int main(void)
{
    rnd_seed(0x9e3779b97f4a7c15ULL);
    test_traits();
    test_conversions();
    test_golden();
    test_dequant_simd();
    test_quantize_act();
    test_dots();
    test_float_tails();
    test_rows();
    test_timing();
    if (failures) {
        printf("test_quant: %d failures\n", failures);
        return 1;
    }
    printf("test_quant: all passed\n");
    return 0;
}
