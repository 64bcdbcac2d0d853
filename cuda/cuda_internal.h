/* Shared by the files of the CUDA backend (compiled by nvcc as C++); nothing
 * outside cuda/ includes it. The backend keeps everything on one device:
 * quantized weights (luma_weight.dev, same bytes as in the file), activations
 * (luma_buf.data), the KV pools, the step's metadata and the logits. Work is
 * queued on one stream; failures are sticky and reported by sync. */
#ifndef LUMA_CUDA_INTERNAL_H
#define LUMA_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "backend.h"
}

/* The step's metadata on the device, uploaded by step_begin in one copy. */
typedef struct cuda_step {
    const luma_step *host;     /* the step these arrays describe */
    int32_t n_rows, n_seqs, n_out;
    int32_t *tokens, *pos, *out_rows;
    int32_t *row_seq;          /* [n_rows] sequence of each row */
    int32_t *seq_row0, *seq_nrows, *seq_pos0;   /* [n_seqs] */
    /* Block tables: table of pool p for sequence s starts at
     * blocks + block_off[p * n_seqs + s] and has block_n[...] entries. */
    int32_t *blocks, *block_off, *block_n;
    int32_t max_pos;           /* the largest position of the step, plus one */
} cuda_step;

typedef struct cuda_backend {
    luma_backend base;
    int device;
    int n_sm;
    cudaStream_t stream;
    cublasHandle_t cublas;
    cuda_step step;
    void *step_mem;            /* device arena holding the step's arrays */
    size_t step_cap;
    void *host_stage;          /* pinned host staging for the step upload */
    size_t stage_cap;
    luma_kv_layout kvl;
    uint8_t *kv_mem[LUMA_KV_MAX_POOLS];
    size_t kv_block_bytes[LUMA_KV_MAX_POOLS];
    void *scratch;             /* matmul scratch: quantized activations, dequantized tiles */
    size_t scratch_cap;
    float *attn_scratch;       /* split-K partial results of decode attention */
    size_t attn_scratch_cap;
    char failure[LUMA_ERR_SIZE]; /* first failure since the last sync; "" when none */
} cuda_backend;

/* Records the first failure; every later operation of the step is skipped
 * until sync reports it. Returns true when e is an error. */
bool luma_cuda_fail(cuda_backend *c, cudaError_t e, const char *what);
#define LUMA_CUDA_OK(c) ((c)->failure[0] == 0)

/* A scratch buffer of at least n bytes (grows; NULL after recording a failure). */
void *luma_cuda_scratch(cuda_backend *c, size_t n);

/* ---- matmul.cu ----------------------------------------------------------- */

/* Whether matmul handles weights of type t. */
bool luma_cuda_matmul_supports(enum luma_type t);
/* y[i] = W x[i] for m rows: x is m x w->cols, y is m x w->rows, both f32 on
 * the device, row-major. Small m reads each weight byte once for all rows;
 * large m takes the tensor-core path. */
void luma_cuda_matmul(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y);

/* ---- attention.cu -------------------------------------------------------- */

void luma_cuda_attention(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *a, luma_buf *out);

#endif
