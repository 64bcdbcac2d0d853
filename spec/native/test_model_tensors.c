/* The default model's tensors through the number formats: every tensor of
 * the real Gemma 3 270M Q4_K_M file dequantizes to finite values, and on a
 * few rows of each the SIMD dot equals the scalar reference, on real blocks.
 * The model is $LUMA_MODEL, else ~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf;
 * a missing file is a failure (CI always fetches it). */
#include "gguf.h"
#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A fixed pseudo-random activation row. */
static void activations(float *x, int64_t n)
{
    uint32_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)((int32_t)(s >> 8) - (1 << 23)) / (float)(1 << 23);
    }
}

/* Rows 0, 1 and the last: the SIMD dot against the scalar one. */
static int check_dots(const luma_gguf_tensor *t, int64_t rows, size_t row_bytes, float *x, void *act)
{
    enum luma_type wt = (enum luma_type)t->type;
    enum luma_type at = luma_type_get(wt)->act_type;
    int64_t n = t->ne[0];
    luma_vec_dot_fn ref = luma_vec_dot_ref(wt), fast = luma_vec_dot_get(wt);
    activations(x, n);
    luma_quantize_act(at, x, act, n);
    int checked = 0;
    const int64_t pick[3] = { 0, 1, rows - 1 };
    for (int k = 0; k < 3; k++) {
        if (pick[k] >= rows || (k == 2 && rows <= 2)) continue;
        const uint8_t *w = (const uint8_t *)t->data + (size_t)pick[k] * row_bytes;
        float r = ref(n, w, act), s = fast(n, w, act);
        float tol = 1e-4f * (1.0f + fabsf(r));
        if (!(fabsf(r - s) <= tol)) {
            failures++;
            printf("  FAIL %.*s row %lld: simd %.9g, scalar %.9g\n", (int)t->name.len, t->name.ptr,
                   (long long)pick[k], (double)s, (double)r);
        }
        checked++;
    }
    return checked;
}

int main(void)
{
    char path[4096];
    if (!luma_test_model_path(path, sizeof path)) {
        printf("test_model_tensors: FAIL: the model file %s is missing; set LUMA_MODEL or fetch the default "
               "model into ~/.cache/luma/models/\n", path);
        return 1;
    }

    luma_err err = { { 0 } };
    luma_gguf *g = NULL;
    if (luma_gguf_open(path, &g, &err) != 0) {
        printf("test_model_tensors: FAIL: cannot open %s: %s\n", path, err.msg);
        return 1;
    }

    int64_t max_row = 1;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].ne[0] > max_row) max_row = g->tensors[i].ne[0];
    float *row = malloc((size_t)max_row * sizeof(float)), *x = malloc((size_t)max_row * sizeof(float));
    void *act = malloc((size_t)max_row * sizeof(float) + 64);
    if (!row || !x || !act) {
        printf("test_model_tensors: FAIL: out of memory\n");
        return 1;
    }

    int64_t per_type[LUMA_TYPE_COUNT] = { 0 }, elements = 0;
    int dots = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        enum luma_type type = (enum luma_type)t->type;
        int64_t n = t->ne[0], rows = t->ne[1] * t->ne[2] * t->ne[3];
        size_t row_bytes = luma_row_size(type, n);
        if (!t->data || row_bytes == 0 || (uint64_t)row_bytes * (uint64_t)rows != t->size) {
            failures++;
            printf("  FAIL %.*s: %s rows of %lld elements do not fill its %llu bytes\n", (int)t->name.len,
                   t->name.ptr, luma_type_name(type), (long long)n, (unsigned long long)t->size);
            continue;
        }
        int64_t bad = 0;
        for (int64_t r = 0; r < rows; r++) {
            luma_dequantize_row(type, (const uint8_t *)t->data + (size_t)r * row_bytes, row, n);
            for (int64_t j = 0; j < n; j++) bad += !isfinite(row[j]);
        }
        if (bad) {
            failures++;
            printf("  FAIL %.*s (%s): %lld values are not finite\n", (int)t->name.len, t->name.ptr,
                   luma_type_name(type), (long long)bad);
        }
        if (luma_vec_dot_ref(type)) dots += check_dots(t, rows, row_bytes, x, act);
        per_type[type]++;
        elements += n * rows;
    }
    printf("tensors: %llu tensors, %lld values dequantized, all finite unless listed above\n",
           (unsigned long long)g->n_tensors, (long long)elements);
    printf("types:");
    for (int t = 0; t < LUMA_TYPE_COUNT; t++)
        if (per_type[t]) printf(" %s x%lld", luma_type_name((uint32_t)t), (long long)per_type[t]);
    printf("\ndots: %d real rows, %s equals the scalar reference\n", dots, luma_simd_name());

    free(row);
    free(x);
    free(act);
    luma_gguf_close(g);
    if (failures) {
        printf("test_model_tensors: %d failures\n", failures);
        return 1;
    }
    printf("test_model_tensors: all passed\n");
    return 0;
}
