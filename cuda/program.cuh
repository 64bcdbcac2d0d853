/* Decode-step programs (program.cu builds them, matmul.cu runs them).
 *
 * At one activation row a step is a chain of matrix-vector products with
 * small operations between them. Run as kernels, each product pays a
 * kernel boundary: its last wave drains, the next kernel waits, its first
 * loads go out, and the memory idles meanwhile. A program runs several
 * products (and the norms, the residual adds and the gated activation
 * between them) as one persistent kernel, one CTA an SM: a producer warp
 * streams every weight byte the CTA will need, in program order, into a
 * ring of shared-memory stages by bulk copies; the consumer warps compute
 * each phase from the stages and meet the other CTAs at a grid barrier
 * between phases. Weights depend on nothing the step computes, so the
 * producer runs ahead across the barriers and the memory stays busy.
 *
 * A phase: a prologue makes the activation row, every CTA the whole of it
 * (quantized to int8 in its shared memory as quantize_act quantizes it for
 * the K formats); then every CTA multiplies its share of each weight's
 * rows (whole row pairs, so that RoPE's pairs stay together) and writes
 * them, through an epilogue. A stage of the ring holds a group of
 * PROG_WARPS rows, `slab` blocks of each; consumer warp w owns row w of
 * every group and adds its pieces up in the matrix-vector kernel's order
 * (the same bits). Phases are separated by grid barriers: a phase reads
 * only what earlier phases (or kernels) wrote. */
#ifndef LUMA_CUDA_PROGRAM_CUH
#define LUMA_CUDA_PROGRAM_CUH

#include <stdint.h>

#include "rope.cuh"

#define PROG_MAX_PHASES 8
#define PROG_MAX_W 3
#define PROG_WARPS 16                      /* consumer warps; one more warp is the producer */
#define PROG_STAGE_BYTES (36 << 10)        /* a ring stage: 16 rows of 16 Q4_K blocks */
#define PROG_STAGES 5
#define PROG_MAX_COLS 16384                /* the widest activation row */
#define PROG_STATS 8                       /* LUMA_CUDA_PROGRAM_TIMES: counters a phase index */

/* The weight formats a program reads (K formats: activations quantized
 * as Q8_K; Q6_K in the matrix-vector kernels' repacked layout). */
enum prog_type { PROG_Q4_K = 0, PROG_Q5_K = 1, PROG_Q6_K = 2 };

/* How a phase makes its activation row (cols floats):
 *   QUANT  x itself;
 *   NORM   x scaled to unit RMS times g (eps), also written to out;
 *   GATED  act(x) * up, act SILU or GELU (act_gated). */
enum prog_pro { PROG_QUANT = 0, PROG_NORM = 1, PROG_GATED = 2 };

typedef struct prog_w {
    const uint8_t *w;          /* rows of row_bytes */
    float *y;                  /* rows floats */
    int32_t type, rows, nb, row_bytes;
    int32_t slab;              /* blocks a stage holds of each of its rows */
    int32_t rope;              /* rotate row pairs (RoPE NORM) as they are written */
} prog_w;

typedef struct prog_phase {
    int32_t pro, act, cols, n_w;
    const float *x, *g;        /* g: the norm's gain, or GATED's up */
    float *out;                /* NORM's output (every CTA writes its units) */
    float eps;
    float *resx;               /* not NULL: x[r] += the product's row r too (n_w == 1) */
    /* Not 0: w[0] and w[1] are the gate and up of a gated activation
     * (act + 1): w[0].y[r] = act(gate[r]) * up[r] as up's row r is written. */
    int32_t gact;
    /* The gated activation of the phase before, stored into its gate now
     * that nothing reads the gate (wb_n floats, NULL: none). */
    float *wb_gate;
    const float *wb_up;
    int32_t wb_n, wb_act;
    prog_w w[PROG_MAX_W];
} prog_phase;

typedef struct prog_params {
    int32_t n;
    prog_phase ph[PROG_MAX_PHASES];
    const int32_t *pos;        /* the step's one position (RoPE) */
    unsigned *bar;             /* the grid barrier: arrivals, generation */
    unsigned long long *stats; /* not NULL: ns a CTA spent per phase index (wait, prologue, products, count) */
    rope_args ra;
} prog_params;

#endif
