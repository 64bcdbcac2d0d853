/* Shared by the files of the CUDA backend (compiled by nvcc as C++); nothing
 * outside cuda/ includes it. The backend keeps everything on one device:
 * quantized weights (luma_weight.dev, same bytes as in the file) and, memory
 * allowing, their f16 copies (luma_weight.dev_f16), activations
 * (luma_buf.data), the KV pools, the step's metadata and the logits. Work is
 * queued on one stream; failures are sticky and reported by sync. */
#ifndef LUMA_CUDA_INTERNAL_H
#define LUMA_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "backend.h"

#define LUMA_ANGLE_SLOTS 4          /* rotations whose angles mmv_heads keeps a step (Gemma 3: local and global) */
#define LUMA_ANGLE_SLOT_FLOATS 256   /* a rotation's table: 32 lanes x 4 sines and 4 cosines */
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
    /* Attention work lists: rows of sequences with fewer than
     * LUMA_CUDA_PREFILL_MIN_ROWS rows are decoded one query row at a time;
     * the other sequences are cut into tiles of LUMA_CUDA_ATTN_TILE rows,
     * each tile a pair (sequence, first row inside the sequence). */
    int32_t n_dec, n_tiles;
    int32_t *dec_rows;         /* [n_dec] */
    int32_t *tiles;            /* [n_tiles][2] */
    int32_t dec_max_pos;       /* the largest position of a decoded row, plus one */
    /* A power of two >= 128 and >= dec_max_pos: decode launch shapes use it,
     * so that a step's kernels depend on its context lengths only through
     * this bucket (a recorded graph replays for every step of the bucket). */
    int32_t dec_keys_bound;
    /* Whether a sequence has several decoded rows (a short prompt, a
     * speculated continuation): such shapes are recorded only when seen
     * again, so that a one-off prompt length pays no recording. */
    bool dec_chunks;
} cuda_step;

/* How the tensor-core path gets f16 weights. While RESIDENT, each matrix
 * loaded (other than F16 ones, used as they are) keeps a dequantized f16
 * copy in luma_weight.dev_f16; the copies are a cache that gives way: when
 * the next matrix would take their total past the budget, or an allocation
 * of the backend finds no memory, all are freed and the backend turns
 * PER_CALL for good. Weights loaded earlier then still hold their stale
 * dev_f16, so matmul reads it only while the backend is RESIDENT. */
enum cuda_f16_mode {
    CUDA_F16_UNDECIDED = 0,    /* no weight loaded yet */
    CUDA_F16_RESIDENT,
    CUDA_F16_PER_CALL,         /* dequantized into scratch by every large product */
};

/* The device memory weight_load made for one weight: its bytes as in the
 * file, and its f16 copy or NULL. */
typedef struct cuda_weight_copy {
    void *dev, *f16, *mmv;
} cuda_weight_copy;

/* A recorded decode step (cudaGraph): every operation the architecture's
 * forward queued for one step shape, replayed for later steps of the same
 * shape. A shape is recorded the first time it comes (cuda_backend.
 * graph_after steps of it run eagerly first: 0 unless the environment
 * says) and replayed from then on; a recording that fails (a scratch
 * buffer would have to grow) runs that step eagerly, which grows it, and
 * the shape is recorded again next time. A recording stays valid while the
 * buffers it names stay where they were (`where`).
 *
 * The shapes are many where sequences come and go (a scheduler's batch
 * changes its rows as requests start and end, each row count in each bucket
 * of context lengths a shape), so there are slots for CUDA_GRAPHS of them,
 * the least recently used given up first: with 32, a scheduler's 128
 * requests ending four a step cycled through more shapes than slots and
 * recorded every one of those steps again (cuda/NOTES.md, "The scheduler's
 * steps"). */
#define CUDA_GRAPHS 256
#define CUDA_GRAPH_TRIES 3     /* failed recordings of a shape before it runs eagerly for good */

typedef struct cuda_graph {
    uint64_t key;              /* the step shape; 0: free slot */
    uint64_t where;            /* fingerprint of the buffers it was recorded with */
    uint64_t used;             /* the backend's step counter at its last use (LRU) */
    cudaGraphExec_t exec;      /* NULL until recorded */
    int32_t failures;          /* recordings that failed */
    int32_t seen;              /* steps of this shape run since it got its slot */
} cuda_graph;

/* cuBLAS's workspace (cuda_backend.cublas_ws), given to it so that a
 * recorded step never makes it allocate (32 MiB, what it asks for on
 * Hopper). cublasSetStream puts the handle back on its own pool, so every
 * cublasSetStream is followed by cublasSetWorkspace. */
#define CUBLAS_WORKSPACE ((size_t)32 << 20)

#define CUDA_GEMM_TAB_SLOTS 1024                      /* batched GEMMs' pointer tables (a power of two) */
#define CUDA_GEMM_TAB_PTRS (3 * LUMA_MATMUL_MANY)     /* pointers a slot */

#define MMV_PASS_M 8           /* activation rows per matrix-vector kernel */
#define LUMA_FORK_MAX_M 256    /* matmul_many's two streams (fork_plan) up to this many rows */
#define LUMA_FORK_MIN ((int64_t)1 << 22) /* and for a side product of this many weights at least */

/* Scratch of kernels whose CTAs combine partial results: int32 counters
 * (or flags) at the start of mem, zero between calls (the kernel that
 * reads one resets it), then part_cap bytes of partial results
 * (luma_cuda_partials). */
typedef struct cuda_partials {
    void *mem;
    size_t counters;
    size_t part_cap;
} cuda_partials;

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
    cudaEvent_t staged;        /* the last upload out of host_stage has completed */
    void *host_results;        /* pinned host memory for the logits operations' results (logits.cu) */
    unsigned long long *chain_key;      /* chained decoding's token (the argmax's or the sampler's key) on
                                         * the device (read by embed), */
    unsigned long long *chain_host;     /* its pinned copy (made at the first use), */
    unsigned long long *chain_host_dev; /* the copy as the device addresses it (NULL: copied by cudaMemcpy), */
    unsigned long long *chain_parts;    /* the chained argmax's blocks' keys (argmax_grid of them), */
    cudaEvent_t chain_ev;               /* recorded after the copy */
    void *chain_hist;                   /* the history of chained draws (logits.cu's chain_hist) */
    void *topk_mem;            /* top-k's device work (logits.cu, topk_work): */
    size_t topk_cap;           /* its bytes, */
    int64_t topk_rows;         /* the rows its arrival counts cover */
    void *draw_mem;            /* sampler_draw_rows' device copy of its input and output (logits.cu), */
    size_t draw_cap;           /* its bytes */
    bool topk_stream;          /* small k: topk_stream_kernel (the default), not topk_small_kernel
                                * (LUMA_CUDA_TOPK=0) */
    cuda_weight_copy *weights; /* made by weight_load, freed with the backend */
    int32_t n_weights, weights_cap;
    /* The f16 copies: the policy, the memory free at the first weight_load,
     * the share of it (60%) the copies may take, their total and count. */
    enum cuda_f16_mode f16_mode;
    size_t f16_free_at_load, f16_budget, f16_bytes;
    int32_t n_f16;
    luma_kv_layout kvl;
    uint8_t *kv_mem[LUMA_KV_MAX_POOLS];
    size_t kv_block_bytes[LUMA_KV_MAX_POOLS];
    void *scratch;             /* matmul scratch: quantized activations, dequantized tiles */
    size_t scratch_cap;
    cuda_partials attn_scratch; /* decode attention: arrival counters, then the splits' partial results */
    cuda_partials sk_scratch;  /* rs_kernel's stream-K: a flag, then a partial tile, for each CTA */
    char failure[LUMA_ERR_SIZE]; /* first failure since the last sync; "" when none */
    /* CUDA graphs of decode steps (LUMA_CUDA_GRAPHS=0 in the environment
     * turns them off). While `capturing`, operations are recorded, not run:
     * nothing may synchronize with the host or allocate. */
    bool graphs_on, capturing;
    /* Kernels launched as programmatic dependents (cuda/launch.cuh;
     * LUMA_CUDA_PDL=0 in the environment turns it off). */
    bool pdl;
    /* Which kernels let the next one start before their own wait
     * (cuda/launch.cuh, follow_previous_kernel): 0 none, 1 the activation
     * quantizers, 2 those and the residual norms (LUMA_CUDA_EARLY in the
     * environment; 1 by default). */
    int early;
    /* decode_kernel reads the step's metadata and issues its first tiles of
     * earlier steps' keys before its wait (LUMA_CUDA_ATTN_EARLY=0 in the
     * environment: after it, as every other kernel). */
    int attn_early;
    /* The shared memory / L1 split every kernel of a step asks for
     * (cudaLaunchAttributePreferredSharedMemoryCarveout, percent of the
     * largest shared memory; -1: none asked, the driver's choice per
     * kernel). LUMA_CUDA_CARVEOUT in the environment. */
    int carveout;
    /* Chained decoding's token comes back through a kernel that writes
     * pinned host memory where the device addresses it, and the chained
     * argmax needs no zeroed key: no copy and no memset on the stream
     * between the logits and the next step (LUMA_CUDA_ZERO_COPY=0 in the
     * environment: the memset, the atomic argmax and the copy). */
    bool zero_copy;
    /* Q6_K matrices, and Q4_0, Q5_0 and Q8_0 ones, get a repacked copy for
     * the matrix-vector kernels (luma_weight.dev_mmv; LUMA_CUDA_Q6K_MMV=0,
     * LUMA_CUDA_X4_MMV=0 in the environment: not), Q4_K, Q5_K and Q6_K one
     * in tiles for mmv_tc (repack_tc, LUMA_CUDA_TC_MMV=0: not; tc_q6k,
     * LUMA_CUDA_TC_Q6K=0: not for Q6_K). Like the f16 copies they
     * give way: an allocation that finds the device full frees them all and
     * clears mmv_on, after which no kernel reads a dev_mmv and no more are
     * made. */
    bool repack_q6k, repack_x4, repack_tc, tc_q6k, mmv_on;
    int32_t n_mmv;
    cuda_graph graphs[CUDA_GRAPHS];
    /* slots in use (LUMA_CUDA_GRAPH_SLOTS, at most CUDA_GRAPHS), and steps
     * of a new shape run eagerly before it is recorded (LUMA_CUDA_GRAPH_AFTER):
     * both in the environment for measuring */
    int graph_slots, graph_after;
    int32_t prefill_min_rows;  /* a sequence's rows of a step that go through prefill attention, at least
                                * (LUMA_CUDA_PREFILL_MIN_ROWS, or $LUMA_CUDA_PREFILL_ROWS) */
    uint64_t n_steps;          /* steps run through step_run */
    uint64_t buf_gen;          /* bumped when a weight, buffer or KV pool is made or freed */
    void *cublas_ws;           /* cuBLAS workspace: no allocation inside a recording */
    /* Pointer tables of cublasGemmBatchedEx (matmul.cu, gemm_table_slot): a
     * matmul_many group of weights of one shape on their resident f16
     * copies runs as one batched GEMM, whose A, B and C pointers cuBLAS
     * reads from device memory. Slot s holds CUDA_GEMM_TAB_PTRS pointers
     * (A[], B[], C[] of up to LUMA_MATMUL_MANY products) in tab_dev, written
     * once from its pinned twin tab_host, which stays as written: a
     * recorded step's copy node reads it again at every replay. A slot is
     * keyed by its pointers and never rewritten (tab_k: products in slot s,
     * 0 free, bit 7 once copied eagerly); a full table, or
     * LUMA_CUDA_GEMM_BATCH=0, leaves the products one GEMM each. */
    void **tab_dev, **tab_host;
    uint8_t *tab_k;
    int tab_used;
    bool gemm_batch;
    long long gemm_batches;    /* batched GEMMs queued (recorded ones once) */
    /* cuBLASLt (matmul.cu, lt_gemm): the f16 GEMMs with their algorithm
     * chosen once per shape and bucket of activation rows (lt_algos, an
     * open-addressed table of LT_ALGOS), not once per row count as
     * cublasGemmEx chooses; NULL with LUMA_CUDA_LT=0, or where it could
     * not start: cublasGemmEx then. lt_op: the "TN" product's description. */
    cublasLtHandle_t lt;
    struct lt_algo *lt_algos;
    int lt_used;
    cublasLtMatmulDescOpaque_t lt_op;
    long long lt_calls, lt_picks;   /* GEMMs through it; heuristics run */
    /* counters for model.info and the benchmarks */
    uint64_t n_replays, n_recorded, n_rec_failed;   /* n_rec_failed: recordings given up (a buffer grew) */
    /* luma_cuda_mmq's choice: 0 its measured rule, 1 every product it can
     * take (f16 route), 2 the same with the int8 route for the K formats,
     * 3 the same with the wgmma route where it runs, 4 Q4_K by q8g_kernel
     * (the integer wgmma) where it runs, 5 Q4_K by rs_kernel (f16 wgmma
     * on weights dequantized in registers) where it runs, k split over
     * clusters, 6 the same with stream-K, -1 none
     * (luma_cuda_mmq_policy sets it, for measuring) */
    int mmq_policy;
    /* luma_cuda_g16's choice: 0 its measured rule (which takes nothing
     * unless LUMA_CUDA_G16 says so), 1 every product it can take, -1 none
     * (luma_cuda_g16_policy sets it, for measuring) */
    int g16_policy;
    /* mmq's wgmma route can run (luma_cuda_wgmma_probe; LUMA_CUDA_WGMMA=0
     * in the environment: not) */
    bool wgmma;
    /* policy 0 takes the downs of Q6_K by rs_kernel on their rs layout
     * (LUMA_CUDA_RS6=0 in the environment: not, for measuring) */
    bool rs6;
    /* policy 0 (and 5) takes two Q4_K weights of one shape over one x by
     * one rs_kernel launch (luma_cuda_rs_pair; LUMA_CUDA_RS_PAIR=0 in the
     * environment: not, for measuring); rs_pairs counts those launches */
    bool rs_pair;
    long long rs_pairs;
    /* the activation rows the tall kernel takes (tall.cu; LUMA_CUDA_TALL=
     * lo,hi in the environment sets them, for measuring); talls counts its
     * launches (recorded ones once) */
    int tall_lo, tall_hi;
    long long talls;
    /* matmul_many's second stream (matmul.cu, fork_plan): in a set of
     * products past the matrix-vector path, llama's q runs on `side`
     * while k and v run on `stream`; fork_ev and join_ev order the two.
     * LUMA_CUDA_FORK in the environment sets fork_min (0: one stream,
     * for measuring). forks counts those sets. */
    cudaStream_t side;
    cudaEvent_t fork_ev, join_ev;
    void *side_scratch;        /* luma_cuda_scratch while c->stream is side */
    size_t side_scratch_cap;
    void *side_ws;             /* cuBLAS's workspace on side */
    int64_t fork_min;          /* the weights (rows x cols) of a side product at least; 0: no fork */
    long long forks;
    /* Batch invariance (backend.h set_batch_invariant): every product on
     * the matrix-vector path whatever its rows, every attention row on the
     * decode kernel with splits of a fixed length, and no f16 copies. */
    bool invariant;
    /* Float activations (backend.h set_float_act): block-format products
     * multiply the dequantized weights by f32 activations on the
     * matrix-vector path (mmv_float) and by the f16 of the activations on
     * the tensor cores; nothing quantizes activations to 8 bits and mmq
     * takes nothing. */
    bool float_act;
    /* While luma_cuda_matmul_qkv_rope runs: the outputs the direct
     * matrix-vector kernel rotates as it writes them (matmul.cu). */
    struct mmv_rope_request *qkv_rope;
    /* mmv_heads' sines and cosines (matmul.cu, heads_angles): made once a
     * step for each rotation (its rope_args and positions) by the step's
     * first launch of it, read by the later ones; LUMA_ANGLE_SLOTS tables
     * of LUMA_ANGLE_SLOT_FLOATS on the device, and the rotations they hold
     * in this forward (n_angles, reset at the start of each forward, eager
     * or recorded: the table is used only inside one; angle_args: host
     * memory) */
    float *angles;
    int n_angles;
    const int32_t *angle_pos[LUMA_ANGLE_SLOTS];
    struct rope_args *angle_args;
    /* Decode-step programs (program.cu): while in_step (the forward of
     * step_run), operations of one row are collected into prog and run as
     * one persistent kernel; prog_on from LUMA_CUDA_PROGRAM (1: on; off
     * by default, being measured slower than the kernels so far).
     * programs counts the launches (recorded ones once). */
    bool in_step, prog_on;
    /* A residual norm waiting for the product that reads it (ops.cu,
     * luma_cuda_norm_pend): while in_step, with no program open, an
     * add_rmsnorm (or a whole row's rmsnorm: y.data NULL) of at most 8
     * rows (ops.cu, normq_max_rows) whose rows fit norm_regs_f (norm.cuh)
     * is not launched but kept here; the activation
     * quantizer of the next product, when that product reads its out
     * (matmul.cu, quantize_into), runs the norm and
     * the quantization as one kernel (norm_quantize), and every other
     * operation first launches the norm alone (luma_cuda_pending_flush). Same
     * bits either way. normq_on from LUMA_CUDA_NORM_QUANT (0: off);
     * norm_quants counts the joined launches (recorded ones once). */
    struct {
        bool on;
        luma_buf x, y, out;
        const luma_weight *yg, *g;
        float eps;
    } pend_norm;
    bool normq_on;
    long long norm_quants;
    /* q, k and v made by whole heads with Gemma's norms (matmul.cu,
     * mmv_heads): the launches (recorded ones once). */
    long long qkv_heads;
    /* Feed-forwards whose gate and up launch made act(gate) * up and its
     * quantization for the down product (matmul.cu, mmv_gated): the
     * launches (recorded ones once). */
    long long ffn_gated;
    /* Decode attention waiting for the product that reads it (attention.cu,
     * luma_cuda_attn_pend): while in_step, programs off, the attention of
     * a step of one row is not launched but kept here; the activation
     * quantizer of the next product, when that product reads its out
     * (matmul.cu, quantize_into), has the attention quantize its output
     * for it instead (decode_lean_kernel, attn_args.qo), and every other
     * operation first launches the attention alone (luma_cuda_pending_flush).
     * Same bits either way. attnq_on from LUMA_CUDA_ATTN_QUANT (0: off);
     * attn_quants counts the joined launches (recorded ones once). */
    struct {
        bool on;
        luma_buf q, k, v, out;
        const luma_step *step;
        luma_attn at;
    } pend_attn;
    bool attnq_on;
    long long attn_quants;
    struct prog_builder *prog;
    unsigned *prog_bar;        /* the program's grid barrier (2 counters) */
    long long programs;
    unsigned long long *prog_stats;   /* LUMA_CUDA_PROGRAM_TIMES: prog_params.stats */
} cuda_backend;

/* Records the first failure; every later operation of the step is skipped
 * until sync reports it. Returns true when e is an error. */
bool luma_cuda_fail(cuda_backend *c, cudaError_t e, const char *what);
/* Records a failure that is not a CUDA error (a bad argument). */
void luma_cuda_failf(cuda_backend *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
#define LUMA_CUDA_OK(c) ((c)->failure[0] == 0)
/* Hands the recorded failure to the caller as err and clears it: -1. */
int luma_cuda_report(cuda_backend *c, luma_err *err);

/* The device copy of n entries of the current step's tokens, pos or
 * out_rows, given the host pointer the operation was called with (a pointer
 * into one of the step's arrays); NULL after recording a failure when it
 * points elsewhere. */
const int32_t *luma_cuda_step_array(cuda_backend *c, const int32_t *host, int32_t n, const char *op);

/* A scratch buffer of at least n bytes (grows; NULL after recording a
 * failure): c->scratch, or c->side_scratch while launches go to the side
 * stream. */
void *luma_cuda_scratch(cuda_backend *c, size_t n);

/* At least `counters` counters and part_bytes of partial results in s,
 * keeping what it had, the new counters cleared; *ctr and *part point at
 * them. It grows only outside recordings: a recording that would need more
 * fails, and the step runs eagerly, which grows it. what names s in
 * errors. False after recording a failure. */
bool luma_cuda_partials(cuda_backend *c, cuda_partials *s, size_t counters, size_t part_bytes, const char *what,
                        int32_t **ctr, void **part);

/* ---- matmul.cu ----------------------------------------------------------- */

/* Whether matmul handles weights of type t. */
bool luma_cuda_matmul_supports(enum luma_type t);
/* y[i] = W x[i] for m rows: x is m x w->cols, y is m x w->rows, both f32 on
 * the device, row-major. Small m reads each weight byte once for all rows;
 * large m takes the tensor-core path. */
void luma_cuda_matmul(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y);
/* gate = act(gate) * up, then y = W gate, with the activation folded into
 * the quantizer of the matrix-vector path (the bits of silu_mul / gelu_mul
 * and matmul). Returns false, queuing nothing, where it does not apply (the
 * other paths, float weights); the caller then runs the two operations. */
bool luma_cuda_gated_matmul(cuda_backend *c, const luma_weight *w, float *gate, const float *up, int act,
                            int64_t m, float *y);
/* The feed-forward at one row where gate and up (w[0], w[1]) are the
 * repacked Q4_0, Q5_0 or Q8_0 of at most 3 rounds a row and the down (w[2])
 * takes the matrix-vector path: gate and up in clusters that also make
 * act(gate) * up and its quantization for the down (mmv_gated), then the
 * down; gate and up hold what matmul_many and gated_matmul leave there
 * (act(gate) * up and up). The bits of luma_cuda_matmul_many and
 * luma_cuda_gated_matmul. False, queuing nothing, elsewhere. */
bool luma_cuda_ffn(cuda_backend *c, const luma_weight *const *w, int act, const float *x, int64_t m, float *gate,
                   float *up, float *y);
/* W's x4 copy for the matrix-vector kernels (matmul.cu's x4_q8_0: 136
 * bytes a 128 elements of a row) where W is Q8_0 and the copy is there to
 * read, else NULL. */
const uint8_t *luma_cuda_x4(const cuda_backend *c, const luma_weight *w);
/* A switch in the environment for measuring (read once by each caller):
 * the digit it is set to, or dflt when it is unset or not one digit. */
int luma_cuda_env_digit(const char *name, int dflt);
/* A range of activation rows "lo,hi" from environment variable name, read
 * at the first call for r (a static of the rule that asks): true when it is
 * set, with lo >= 0. The rules' knobs for measuring (mmq.cu, matmul.cu). */
struct env_rows {
    int lo = -2, hi = 0;
};

static inline bool env_rows_set(env_rows &r, const char *name)
{
    if (r.lo == -2) {
        const char *s = getenv(name);
        int lo, hi;
        if (s && *s && sscanf(s, "%d,%d", &lo, &hi) == 2) {
            r.hi = hi;
            r.lo = lo;
        } else {
            r.lo = -1;
        }
    }
    return r.lo >= 0;
}
/* RoPE r's tables for heads of head_dim in rows of cols (cuda/rope.cuh);
 * false, recorded, when they are not supported. */
bool luma_cuda_rope_args(cuda_backend *c, const luma_rope *r, int32_t head_dim, int64_t cols, struct rope_args *a);
/* luma_cuda_matmul_many of q, k and v (ys[0..2]) that also adds the
 * biases b[0..2] (device vectors, NULL: none), or normalizes q's and k's
 * heads with gains gq, gk (mmv_heads at one row; then no biases and no
 * rotation by the other kernels), and rotates q and k (RoPE
 * NORM over heads of every one of their columns, at pos: a device array of
 * m positions; a: luma_cuda_rope_args's tables) where the direct
 * matrix-vector kernel (one pass of up to MMV_PASS_M rows) or mmv_tc writes
 * them, with add_bias's and rope_kernel's arithmetic. Returns which outputs
 * it finished (bit 0 q, bit 1 k: biased and rotated; bit 2 v: biased); the
 * caller does the rest. */
int luma_cuda_matmul_qkv_rope(cuda_backend *c, const luma_weight *const *ws, const float *const *b, const float *gq,
                              const float *gk, float eps, const float *x, int64_t m, float *const *ys,
                              int32_t head_dim, const struct rope_args *a, const int32_t *pos);
/* The most rows for which luma_cuda_matmul_qkv_rope may rotate anything:
 * MMV_PASS_M, or mmv_tc's range where that is larger */
int64_t luma_cuda_qkv_rope_max_m(void);
/* ys[i] = ws[i] x for n <= LUMA_MATMUL_MANY weights of x->cols columns:
 * the same bits as luma_cuda_matmul for each, with one quantization of x
 * for all the matrix-vector products that share its format. */
void luma_cuda_matmul_many(cuda_backend *c, int n, const luma_weight *const *ws, const float *x, int64_t m,
                           float *const *ys);
/* Queues the quantization of n activations x (n a multiple of the block of
 * w's act_type: 32 for Q8_0, 256 for Q8_K; x 16-byte aligned) as the CPU
 * backend quantizes them for weights of type t: into int8 values q and,
 * per block of 32, (d, d * sum of the q) in ds; or, when xh is not NULL,
 * into the f16 of each d * q. Failures are recorded. */
void luma_cuda_quantize_act(cuda_backend *c, enum luma_type t, const float *x, int64_t n, int8_t *q, float2 *ds,
                            __half *xh);
/* The same values as luma_cuda_quantize_act's f16 for a Q4_K weight, each
 * half superblock in rs_kernel's k order (mmq.cu, blocks.cuh). */
void luma_cuda_quantize_act_rs(cuda_backend *c, const float *x, int64_t n, __half *xh);
/* Queues the dequantization of all of w (from w->dev) to f16 into out
 * (rows x cols, row-major): the tensor-core path's operand. Not for F16
 * weights; failures are recorded. */
void luma_cuda_weight_to_f16(cuda_backend *c, const luma_weight *w, __half *out);
/* The matrix-vector kernels' own layouts (matmul.cu has them: type_q6_K_mmv,
 * type_x4): a Q6_K block of 256 in LUMA_Q6_K_MMV_BYTES; four Q4_0, Q5_0 or
 * Q8_0 blocks of 32 in the same bytes as in the file. */
#define LUMA_Q6_K_MMV_BYTES 224
#define LUMA_X4_Q4_0_BYTES 72
#define LUMA_X4_Q5_0_BYTES 88
#define LUMA_X4_Q8_0_BYTES 136
/* Q4_K and Q5_K for mmv_tc (matmul.cu): tiles of 16 rows (the last padded
 * with zero rows), a tile's superblocks in order, each one unit of 16
 * blocks' bytes: the 16 rows' 16-byte headers (d, dmin, scales), Q5_K's
 * high bits as 512 bytes, then 4 x 512 bytes of quant bytes. In the 512
 * bytes of chunk j lane 4 g + t of a warp finds at 16 lane the bytes 4 t ..
 * 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3 of chunk j (32 bytes) of row g, then
 * of row g + 8, the same for the high bits: a warp's load reads 512
 * contiguous bytes. */
/* Q6_K weights at least twice as wide as tall (a llama's downs) keep, after
 * their matrix-vector blocks, a second layout for rs_kernel (mmq.cu): per
 * block of 256, LUMA_Q6_K_RS_BYTES bytes (luma_cuda_q6k_rs has the layout). */
#define LUMA_Q6_K_RS_BYTES 288
/* and, after those, while its tile copies are on (tc_q6k), a tile copy
 * for mmv_tc (matmul.cu's tc_q6k has the layout): tiles of 16 rows (the
 * last padded with zero rows), a tile's superblocks in order, each one unit
 * of 16 x LUMA_Q6_K_TC_BYTES: the rows' int8 scales (16 bytes a row), their
 * d as f32, then 4 x 512 bytes of low nibbles and 2 x 512 of high bits, in
 * which each load of a warp reads 512 contiguous bytes. */
#define LUMA_Q6_K_TC_BYTES 212
/* Bytes of w repacked into its type's layout, 0 where it has none (another
 * type, a width the layout does not divide, a single row); with the rs
 * layout and the tile copy after it where w has them (c: whether tile
 * copies are made). */
size_t luma_cuda_mmv_bytes(const cuda_backend *c, const luma_weight *w);
/* The rs layout of w's repacked copy, where it has one and the kernels may
 * read it (the copies were not dropped since); else NULL. */
const uint8_t *luma_cuda_q6k_rs(const cuda_backend *c, const luma_weight *w);
/* w (w->dev) repacked into out (luma_cuda_mmv_bytes(w) bytes). Queued;
 * failures are recorded. */
void luma_cuda_repack(cuda_backend *c, const luma_weight *w, uint8_t *out);

/* A program's view of w (program.cuh), or false where programs do not
 * take it (its format, its width, its copies). */
bool luma_cuda_program_weight(const cuda_backend *c, const luma_weight *w, struct prog_w *pw);
/* Queues the program p (its barrier set). Failures are recorded. */
void luma_cuda_program_launch(cuda_backend *c, const struct prog_params *p);

/* ---- program.cu ---------------------------------------------------------- */

/* Whether operations go into a program now (a step's forward, programs on,
 * neither batch invariance nor float activations, no failure). */
bool luma_cuda_prog_active(const cuda_backend *c);
/* Each takes the operation of backend.h into the program, returning true,
 * or returns false having done nothing: the caller then flushes the
 * program and runs the operation as usual. */
bool luma_cuda_prog_rmsnorm(cuda_backend *c, const luma_buf *x, const luma_weight *g, int64_t group, float eps,
                            luma_buf *out);
bool luma_cuda_prog_add_rmsnorm(cuda_backend *c, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                                const luma_weight *g, float eps, luma_buf *out);
bool luma_cuda_prog_add(cuda_backend *c, luma_buf *x, const luma_buf *y);
bool luma_cuda_prog_matmul(cuda_backend *c, int n, const luma_weight *const *ws, const luma_buf *x,
                           luma_buf *const *ys);
bool luma_cuda_prog_qkv_rope(cuda_backend *c, const luma_weight *const *ws, const luma_buf *x, luma_buf *const *ys,
                             int32_t head_dim, const int32_t *pos, const luma_rope *r);
bool luma_cuda_prog_gated(cuda_backend *c, const luma_weight *w, luma_buf *gate, const luma_buf *up, int act,
                          luma_buf *y);
/* Queues what the program holds (nothing when empty). */
void luma_cuda_prog_flush(cuda_backend *c);
void luma_cuda_prog_free(cuda_backend *c);

/* ---- tall.cu ------------------------------------------------------------- */

/* Whether luma_cuda_tall takes y = W x for m activation rows: a Q8_0
 * weight of a vocabulary's rows and its x4 copy (luma_cuda_x4), m within
 * c->tall_lo .. c->tall_hi, outside batch invariance and float
 * activations. */
bool luma_cuda_tall_takes(const cuda_backend *c, const luma_weight *w, int64_t m);
/* c->tall_lo and tall_hi: the rule's, or LUMA_CUDA_TALL's. */
void luma_cuda_tall_init(cuda_backend *c);
/* cuBLASLt's handle and algorithm table (matmul.cu); without them the
 * GEMMs go through cublasGemmEx. */
void luma_cuda_lt_init(cuda_backend *c);
void luma_cuda_lt_free(cuda_backend *c);
/* y (m x rows) = W x on the tensor cores from W's x4 copy and the
 * activations' 8-bit values xq (m x cols) and their blocks' (d, d * sum)
 * xds, as the matrix-vector path's quantizer writes them, for a product
 * luma_cuda_tall_takes. */
void luma_cuda_tall(cuda_backend *c, const luma_weight *w, const int8_t *xq, const float2 *xds, int64_t m, float *y);

/* ---- mmq.cu -------------------------------------------------------------- */

/* Tensor-core product on quantized weights without an f16 copy: y = W x for
 * m rows, W's tiles dequantized into shared memory and fed to the tensor
 * cores. Returns false, queuing nothing, when it does not handle w's type or
 * this m; matmul then takes its other paths. */
bool luma_cuda_mmq(cuda_backend *c, const luma_weight *w, const float *x, int64_t m, float *y);
/* Whether luma_cuda_mmq would take this product (it queues nothing). */
bool luma_cuda_mmq_takes(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m);
/* Whether luma_cuda_mmq takes this product with rs_kernel, whose
 * activations are luma_cuda_quantize_act_rs's (the same for every Q4_K
 * weight of x's width: weights of one x can share them). */
bool luma_cuda_rs_takes(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m);
/* rs_kernel on activations xp that luma_cuda_quantize_act_rs made; false,
 * queuing nothing, where its shapes cannot take w (luma_cuda_mmq then goes
 * on to its other routes). */
bool luma_cuda_rs(cuda_backend *c, const luma_weight *w, const __half *xp, int64_t m, float *y);
/* y = W x and y2 = W2 x by one rs_kernel launch (two Q4_K weights of one
 * shape that luma_cuda_rs_takes, the same xp); false, queuing nothing,
 * where the pair does not fit (then each goes to luma_cuda_rs). */
bool luma_cuda_rs_pair(cuda_backend *c, const luma_weight *w, const luma_weight *w2, const __half *xp, int64_t m,
                       float *y, float *y2);
/* Whether this build's code for the device has the wgmma kernels (sm_90a
 * machine code on a compute capability 9.0 device). */
bool luma_cuda_wgmma_probe(cuda_backend *c);
/* y = W x on W's resident f16 copy wh and the activations' f16 xh (m x
 * cols) by the tensor memory accelerator and wgmma (sm_90a), where its
 * policy takes it; false, queuing nothing, where it does not. */
bool luma_cuda_g16(cuda_backend *c, const luma_weight *w, const __half *wh, const __half *xh, int64_t m, float *y);
/* Whether luma_cuda_g16 takes y = W x for m rows. */
bool luma_cuda_g16_takes(const cuda_backend *c, const luma_weight *w, int64_t m);
/* Whether luma_cuda_mmq takes this product although m is small enough for
 * the matrix-vector kernels (its int8 route, where it measured faster). */
bool luma_cuda_mmq_small(const cuda_backend *c, const luma_weight *w, const float *x, int64_t m);

/* ---- ops.cu -------------------------------------------------------------- */

/* Embedding rows, norms, RoPE and the elementwise operations, with the
 * signatures and semantics of luma_backend_ops. */
void luma_cuda_embed(luma_backend *be, const luma_weight *w, const int32_t *ids, int32_t n,
                     float scale, luma_buf *out);
void luma_cuda_gather(luma_backend *be, const luma_buf *x, const int32_t *rows, int32_t n,
                      luma_buf *out);
void luma_cuda_add_bias(luma_backend *be, luma_buf *x, const luma_weight *b);
void luma_cuda_rmsnorm(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group,
                       float eps, luma_buf *out);
/* y NULL (and yg NULL): the norm of x's whole rows alone, x unchanged
 * (luma_cuda_rmsnorm of group x->cols takes it, whatever the row count). */
void luma_cuda_add_rmsnorm(luma_backend *be, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                           const luma_weight *g, float eps, luma_buf *out);
void luma_cuda_rope(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos,
                    const luma_rope *r);
void luma_cuda_qk_rope(luma_backend *be, luma_buf *q, luma_buf *k, const luma_weight *gq, const luma_weight *gk,
                       int32_t head_dim, float eps, const int32_t *pos, const luma_rope *r);
void luma_cuda_qkv_bias_rope(luma_backend *be, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                             const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                             const luma_rope *r);
void luma_cuda_gelu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up);
void luma_cuda_silu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up);
void luma_cuda_add(luma_backend *be, luma_buf *x, const luma_buf *y);
/* add_rmsnorm kept pending (cuda_backend.pend_norm) instead of launched
 * (y NULL: the norm of whole rows alone, x unchanged): false, keeping
 * nothing, where it cannot be (then the caller launches it). Any pending
 * norm must have been flushed before. */
bool luma_cuda_norm_pend(cuda_backend *c, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                         const luma_weight *g, float eps, luma_buf *out);
/* Launches what waits for the product that reads it, alone: the pending
 * attention (attention.cu) or the pending norm. */
void luma_cuda_pending_flush(cuda_backend *c);

/* ---- attention.cu -------------------------------------------------------- */

#define LUMA_CUDA_ATTN_TILE 128       /* query rows per prefill tile: 1 or 2 tensor-core CTAs, 8 CUDA-core ones */
#define LUMA_CUDA_PREFILL_MIN_ROWS 32 /* fewer rows of a sequence: decoded row by row (NOTES.md,
                                        * "Short chunks of one sequence") */

/* Whether a sequence's n_rows rows of a step go through prefill attention
 * (tiles of query rows) rather than the decode kernel, a row at a time. */
static inline bool luma_cuda_prefill_rows(const cuda_backend *c, int32_t n_rows)
{
    return !c->invariant && n_rows >= c->prefill_min_rows;
}

/* Whether the attention kernels handle this KV layout (head sizes); called
 * by kv_alloc. Also raises the kernels' shared-memory limits. */
int luma_cuda_attention_setup(const luma_kv_layout *l, luma_err *err);
void luma_cuda_attention(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *a, luma_buf *out);
/* Where the product after the attention wants its activations: the int8
 * values q and their blocks' (d, d * sum) ds, quantized by scheme (an
 * act_scheme, quant8.cuh), as quantize_act writes them. */
typedef struct cuda_attn_quant {
    int8_t *q;
    float2 *ds;
    int scheme;
} cuda_attn_quant;
/* luma_cuda_attention that also quantizes its output into aq where its
 * kernel can (true; then out holds the values too), else leaves that to
 * the caller (false). */
bool luma_cuda_attention_quant(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                               const luma_step *step, const luma_attn *a, luma_buf *out, const cuda_attn_quant *aq);
/* The attention kept pending (cuda_backend.pend_attn) instead of launched:
 * false, keeping nothing, where it cannot be (then the caller launches
 * it). Anything pending must have been flushed before. */
bool luma_cuda_attn_pend(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *a, luma_buf *out);

/* ---- logits.cu ----------------------------------------------------------- */

/* The logits operations of luma_backend_ops (backend.h), for its table. */
int luma_cuda_logits_alloc(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err);
void luma_cuda_logits_free(luma_backend *be, luma_buf *b);
int luma_cuda_logits_argmax(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t *ids,
                            luma_err *err);
int luma_cuda_logits_topk_rows(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t k,
                               int32_t *ids, float *vals, int32_t *counts, luma_err *err);
int32_t luma_cuda_logits_topk(luma_backend *be, const luma_buf *b, int64_t row, int32_t k, int32_t *ids,
                              float *vals, luma_err *err);
int luma_cuda_logits_edit(luma_backend *be, luma_buf *b, int64_t row, const luma_logits_edit *e, luma_err *err);
int luma_cuda_logits_temperature(luma_backend *be, luma_buf *b, int64_t row, float t, luma_err *err);
int luma_cuda_logits_min_p(luma_backend *be, luma_buf *b, int64_t row, double lp, luma_err *err);
int luma_cuda_logits_softmax(luma_backend *be, luma_buf *b, int64_t row, bool log, luma_err *err);
int luma_cuda_logits_live_sums(luma_backend *be, const luma_buf *b, int64_t row, double *z, double *s,
                               luma_err *err);
int32_t luma_cuda_logits_sample(luma_backend *be, const luma_buf *b, int64_t row, double u, luma_err *err);
int luma_cuda_chain_argmax(luma_backend *be, const luma_buf *b, int64_t row, luma_err *err);
int luma_cuda_chain_sample(luma_backend *be, const luma_buf *b, int64_t row, const luma_sampler *s, double u,
                           luma_err *err);
int luma_cuda_chain_read(luma_backend *be, int32_t *id, luma_err *err);
int luma_cuda_chain_history(luma_backend *be, const int32_t *ids, int32_t n, luma_err *err);
int luma_cuda_sampler_draw_rows(luma_backend *be, int32_t n, int32_t k, const int32_t *ids, const float *vals,
                                const int32_t *counts, const luma_sampler *smp, const double *u, int32_t *out,
                                luma_err *err);

/* The id an argmax key names (logits.cu's rank_key: the ordered value
 * above, 0xffffffff - id below); -1 for the key 0 (every entry masked). */
__host__ __device__ __forceinline__ int32_t luma_cuda_key_id(unsigned long long k)
{
    return (int32_t)(0xffffffffu - (unsigned int)k);
}

#endif
