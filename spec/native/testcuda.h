/* What the GPU tests share beyond testutil.h: the CUDA runtime's headers
 * and a check of a CUDA call. Included only by tests built with the CUDA
 * backend (spec/native/test_cuda*.c). */
#ifndef LUMA_TESTCUDA_H
#define LUMA_TESTCUDA_H

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "quant.h"
#include "testutil.h"

/* CHECKF on a CUDA call's result; true when it succeeded. */
static inline bool cuda_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return true;
    CHECKF(0, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

/* A rows x cols weight of type t with random blocks (random_weights), loaded
 * by be into *w: its host blocks (w->host, which the caller frees), or NULL
 * after a failed check, with nothing left to free. */
static inline uint8_t *load_random_weight(luma_backend *be, enum luma_type t, int64_t rows, int64_t cols,
                                          luma_weight *w)
{
    uint8_t *host = xmalloc(luma_row_size(t, cols) * (size_t)rows);
    random_weights(t, rows * cols, host);
    *w = (luma_weight){ .type = t, .rows = rows, .cols = cols, .host = host };
    luma_err err = { { 0 } };
    if (be->ops->weight_load(be, w, &err) != 0) {
        CHECKF(0, "weight_load %s %lldx%lld: %s", luma_type_name(t), (long long)rows, (long long)cols, err.msg);
        free(host);
        return NULL;
    }
    return host;
}

/* Whether the switch `name` is turned off in the environment (set to 0). */
static inline bool env_off(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "0") == 0;
}

/* Bytes of the copy weight_load repacks w into (luma_weight.dev_mmv;
 * cuda/matmul.cu): for the matrix-vector kernels Q6_K blocks of 256 in 224
 * bytes, four Q4_0, Q5_0 or Q8_0 blocks in the file's bytes, Q4_K and Q5_K
 * in tiles of 16 rows (the last padded) for mmv_tc; then, for Q6_K
 * weights at least twice as wide as tall, rs_kernel's layout, 288 bytes a
 * block, and for every Q6_K one its tiles for mmv_tc, 212 bytes a row's
 * block. 0 where it makes none: another type, a width the layout does not
 * divide, one row, or the copy turned off in the environment. */
static inline size_t repacked_bytes(const luma_weight *w)
{
    if (w->rows < 2) return 0;
    bool tc_on = !env_off("LUMA_CUDA_TC_MMV");
    bool tc6_on = tc_on && !env_off("LUMA_CUDA_TC_Q6K");
    if (w->type == LUMA_Q6_K && w->cols % 256 == 0 && !env_off("LUMA_CUDA_Q6K_MMV"))   /* + tiles of 16 rows */
        return (size_t)w->rows * (size_t)(w->cols / 256) * (w->cols >= 2 * w->rows ? 224 + 288 : 224) +
               (tc6_on ? (size_t)((w->rows + 15) / 16 * 16) * (size_t)(w->cols / 256) * 212 : 0);
    bool tc_type = w->type == LUMA_Q4_K || w->type == LUMA_Q5_K;
    if (tc_type && w->cols % 256 == 0 && tc_on)   /* whole tiles of 16 rows */
        return (size_t)((w->rows + 15) / 16 * 16) * luma_row_size(w->type, w->cols);
    bool x4_type = w->type == LUMA_Q4_0 || w->type == LUMA_Q5_0 || w->type == LUMA_Q8_0;
    if (x4_type && w->cols % 128 == 0 && !env_off("LUMA_CUDA_X4_MMV"))
        return (size_t)w->rows * luma_row_size(w->type, w->cols);   /* the same bytes, rearranged */
    return 0;
}

#endif
