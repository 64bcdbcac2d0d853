/* The CUDA backend's matrix products (cuda/matmul.cu), through the backend
 * interface, against a double-precision CPU reference built from
 * luma_dequantize_row and the f32 activations:
 *   - every weight type, random blocks with sane half scales (random_weights
 *     of testutil.h), shapes from gemma's 640 columns and odd row counts
 *     (weights that end off a 16-byte boundary among them) to llama-8B's
 *     4096 x 4096, 14336 x 4096, 4096 x 14336 and 1024 x 4096, and m = 1,
 *     2, 3, 8 (matrix-vector kernels, direct and staged: int8 activations
 *     for the block formats) and 16, 64, 512 (f16 tensor-core path), the
 *     large m twice: with the resident f16 copy weight_load made
 *     (luma_weight.dev_f16) and with the weight dequantized per call (the
 *     same weight, dev_f16 cleared): each output's error relative to
 *     sum |w x| stays under the tolerance of its number format; block
 *     formats also against the CPU backend's product (the activations
 *     quantized as src/quant.c does it): within float rounding (1e-5) on
 *     the matrix-vector path, within f16 rounding on the tensor cores;
 *   - weight_load keeps an f16 copy of every matrix but the F16 ones (the
 *     test's few GB are far inside the copies' budget), and a copy
 *     repacked for the matrix-vector kernels of the Q6_K, Q4_0, Q5_0 and
 *     Q8_0 ones whose width the layout divides; m <= 8 runs both on it and,
 *     the copy hidden, on the file's blocks; both copies give way to an
 *     allocation that needs their memory (check_drop);
 *   - then a timing table for the big shapes (cudaEvent around 16 calls
 *     queued back to back behind a long memset, so that the host's launches
 *     are not timed, on weight copies that are cold in L2): m = 1 and 8 both
 *     eagerly and recorded as a CUDA graph by the backend's step_run (as
 *     decode steps run), GB/s of weights and the fraction of the H100's
 *     3000 GB/s; m = 512 (on the first two shapes) with the resident copy
 *     and dequantizing per call, ms per call and TFLOP/s side by side;
 *   - float activations (check_float: a second backend, set_float_act):
 *     every block format against the same double reference, within 1e-5
 *     of sum |w x| on the matrix-vector path (m <= 4: mmv_float and
 *     mmv_kfloat, which multiply the CPU's dequantized values by the f32
 *     activations as the CPU backend's float product does, in another
 *     order) and within f16 rounding on the tensor cores; a row's bits the
 *     same at m = 3 as at m = 1; matmul_many and gated_matmul as with 8-bit activations; and,
 *     outside quick mode, m = 1, 2, 4 and 8 timed in a graph on the big Q4_K,
 *     Q6_K, Q5_0 and Q8_0 shapes next to the 8-bit kernels;
 *   - outside quick mode, Gemma 3's output projection (262144 x 640, Q8_0,
 *     Q5_0, Q4_0: the narrow kernel by rule) at m = 1, 3 and 8, each row's
 *     bits the same at every m, and timed at m = 1 and 8 (check_vocab);
 *   - the tall kernel (Q8_0 weights of a vocabulary's rows on the tensor
 *     cores, cuda/tall.cu) at m = 2 to 128 on two shapes, against the
 *     reference, the CPU and the product with it off; outside quick mode
 *     Gemma 3's output projection timed with it on and off (check_tall);
 *   - cuBLASLt's algorithm chosen once per bucket of m and run at every m
 *     of it (check_lt).
 * Without a CUDA device it says so and passes. LUMA_CUDA_QUICK=1 keeps to the
 * small shapes and skips the timing (for compute-sanitizer runs);
 * LUMA_CUDA_ONLY=tall runs the tall kernel's checks (and timing) alone;
 * LUMA_CUDA_TIME_TYPES=Q4_K,Q6_K times only the types it names.
 *
 * The events and the memset go to the legacy default stream, which orders
 * itself against the backend's stream as long as that one is a blocking
 * stream (cudaStreamCreate without cudaStreamNonBlocking). */
#define _POSIX_C_SOURCE 200809L   /* setenv */
#include "backend.h"
#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A CUDA build links the CUDA runtime into every test; LUMA_HAVE_CUDA says
 * so (the headers alone prove nothing: they may sit in /usr/local/include of
 * a machine that builds for the CPU only). */
#ifdef LUMA_HAVE_CUDA
#include "testcuda.h"
#endif

#ifdef LUMA_HAVE_CUDA

static const enum luma_type types[] = {
    LUMA_F32, LUMA_F16, LUMA_BF16, LUMA_Q4_0, LUMA_Q4_1, LUMA_Q5_0, LUMA_Q5_1, LUMA_Q8_0,
    LUMA_Q2_K, LUMA_Q3_K, LUMA_Q4_K, LUMA_Q5_K, LUMA_Q6_K,
};
#define N_TYPES (int)(sizeof types / sizeof types[0])

/* rows x cols; the big ones are timed: TIME_ALL at m = 1, 8 and 512,
 * TIME_DECODE at m = 1 and 8 only (llama-8B's ffn_down and its attn_k and
 * attn_v with 8 KV heads). 1024 x 640 has gemma's width (no K format fits
 * it), 333 x 1002 leaves float rows without whole 16-byte loads; 999 x 1312
 * and 333 x 768 end their weights off a 16-byte boundary (rows of 41 and 3
 * blocks), which the matrix-vector kernels' bulk copies cannot reach. */
enum { TIME_NONE, TIME_ALL, TIME_DECODE };
static const struct shape { int64_t rows, cols; int big; } shapes[] = {
    { 640, 1024, TIME_NONE }, { 999, 2048, TIME_NONE }, { 1024, 640, TIME_NONE }, { 333, 1002, TIME_NONE },
    { 999, 1312, TIME_NONE }, { 333, 768, TIME_NONE },
    { 4096, 4096, TIME_ALL }, { 14336, 4096, TIME_ALL }, { 4096, 14336, TIME_DECODE }, { 1024, 4096, TIME_DECODE },
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

static const int ms[] = { 1, 2, 3, 8, 16, 24, 40, 64, 512 };
#define N_MS (int)(sizeof ms / sizeof ms[0])
/* LUMA_MMV_MAX_M of cuda/matmul.cu: a larger m takes the tensor-core path
 * (F16 weights take it from m = 3, with no copy to tell apart). */
#define MMV_MAX_M 8
/* ... except for the 8-bit tensor-core kernel (mmv_tc), which takes Q4_K
 * and Q5_K (and Q6_K on its tile copy) up to 32 rows (MMV_TC_RULE_HI) and
 * multiplies the same int8 values as the CPU */
#define MMV_TC_MAX_M 32

/* Whether the product of w at m rows multiplies the CPU's int8 values in
 * another order only (a matrix-vector kernel): tile, whether w has its
 * repacked copy. */
static bool cpu_exact(const luma_weight *w, int64_t m, bool tile)
{
    if (m <= MMV_MAX_M) return true;
    bool tc = w->type == LUMA_Q4_K || w->type == LUMA_Q5_K || (w->type == LUMA_Q6_K && tile);
    return tc && m <= MMV_TC_MAX_M && w->cols % 256 == 0 && !getenv("LUMA_CUDA_MMV_TC");
}

/* Errors relative to sum |w x|: int8 activations (block formats with small
 * m) lose about 1/254 of each block's largest value per element; f16
 * operands (the tensor-core path) at most 2^-11 of each factor. */
#define TOL_INT8 5e-3
#define TOL_F16 2e-3
/* Errors relative to sum |w x| against the CPU backend's product of the same
 * quantized activations (cpu_product_rel_error): the matrix-vector path
 * multiplies the same int8 values and differs only in the order of float
 * sums; the tensor-core paths also round the weights and d * q to f16. */
#define TOL_CPU_INT8 1e-5
#define TOL_CPU_F16 2e-3

#define SAMPLE_ROWS 32   /* weight rows checked per shape */
#define SAMPLE_ACTS 64   /* activation rows checked per m */
#define TIME_CALLS 16    /* calls per timed batch */
#define TIME_BATCHES 3   /* batches timed, the best kept */
#define L2_DEFEAT_BYTES ((size_t)192 << 20)   /* well over the H100's 50 MB of L2 */
#define QUEUE_BYTES ((size_t)1 << 30)         /* memset that keeps the GPU busy while calls queue */
#define HBM_GBS 3000.0

/* ---- one weight matrix -------------------------------------------------- */

typedef struct ctx {
    luma_backend *be;
    int quick;
    const char *time_types;    /* LUMA_CUDA_TIME_TYPES: the types to time ("Q4_K,Q6_K"), NULL for all */
    int graphs;                /* the backend records steps (step_run): time replays too */
    void *queue;               /* QUEUE_BYTES of device memory for the memset */
} ctx;

/* Whether type t is timed: never in quick mode, else when LUMA_CUDA_TIME_TYPES
 * is unset or names it. */
static int timed(const ctx *cx, enum luma_type t)
{
    if (cx->quick) return 0;
    if (!cx->time_types) return 1;
    const char *name = luma_type_name(t), *p = cx->time_types;
    size_t n = strlen(name);
    for (;;) {
        if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == 0)) return 1;
        p = strchr(p, ',');
        if (!p) return 0;
        p++;
    }
}

typedef struct timing {
    double us[6];              /* m = 1, 8 eager; m = 1, 8 replayed; 512 resident, 512 per call; 0: not timed */
} timing;

/* y = W x on the device for m rows of x; 0 on success. y is m x rows. */
static int run_matmul(ctx *cx, const luma_weight *w, const float *x, int64_t m, float *y)
{
    const luma_backend_ops *ops = cx->be->ops;
    luma_err err = { { 0 } };
    luma_buf xb = { 0 }, yb = { 0 };
    int rc = -1;
    if (ops->buf_alloc(cx->be, &xb, m, w->cols, &err) != 0 || ops->buf_alloc(cx->be, &yb, m, w->rows, &err) != 0) {
        CHECKF(0, "buf_alloc: %s", err.msg);
        goto done;
    }
    if (!cuda_ok(cudaMemcpy(xb.data, x, (size_t)(m * w->cols) * sizeof(float), cudaMemcpyHostToDevice),
                 "upload x"))
        goto done;
    ops->matmul(cx->be, w, &xb, &yb);
    if (ops->sync(cx->be, &err) != 0) {
        CHECKF(0, "%s %lldx%lld m=%lld: %s", luma_type_name(w->type), (long long)w->rows, (long long)w->cols,
               (long long)m, err.msg);
        goto done;
    }
    CHECKF(yb.rows == m && yb.cols == w->rows, "matmul sets y to m x rows (%lld x %lld)", (long long)yb.rows,
           (long long)yb.cols);
    if (ops->buf_read(cx->be, &yb, y, &err) != 0) {
        CHECKF(0, "buf_read: %s", err.msg);
        goto done;
    }
    rc = 0;
done:
    if (xb.data) ops->buf_free(cx->be, &xb);
    if (yb.data) ops->buf_free(cx->be, &yb);
    return rc;
}

/* The calls of one timed batch, queued by queue_calls: eagerly, or recorded
 * by the backend's step_run and replayed as a CUDA graph. */
typedef struct batch {
    ctx *cx;
    const luma_weight *wc;
    int copies;
    luma_buf *xb, *yb;
} batch;

static int queue_calls(void *p, luma_err *err)
{
    batch *b = p;
    (void)err;
    for (int i = 0; i < TIME_CALLS; i++)
        b->cx->be->ops->matmul(b->cx->be, &b->wc[(i + 1) % b->copies], b->xb, b->yb);
    return 0;
}

/* A one-row decode step with no KV cache: the vehicle for step_run. */
static const int32_t step_token = 0, step_pos = 0, step_out = 0;
static const luma_step_seq step_seq = { .row0 = 0, .n_rows = 1, .pos0 = 0 };
static const luma_step graph_step = { 1, &step_token, &step_pos, 1, &step_seq, 1, &step_out };

/* Queues one batch (graph: through step_begin and step_run, which records
 * the calls on its second run and replays them from the third). */
static int run_batch(batch *b, int graph)
{
    const luma_backend_ops *ops = b->cx->be->ops;
    luma_err err = { { 0 } };
    if (!graph) return queue_calls(b, &err);
    if (ops->step_begin(b->cx->be, &graph_step, &err) != 0 ||
        ops->step_run(b->cx->be, &graph_step, queue_calls, b, &err) != 0) {
        CHECKF(0, "step_run: %s", err.msg);
        return -1;
    }
    return 0;
}

/* Time per call of y = W x in a stream of TIME_CALLS calls queued back to
 * back (as a decode step runs them), in microseconds: the best of
 * TIME_BATCHES batches, each queued behind a long memset (so that the host's
 * launches are not timed, and which also flushes L2) between two events.
 * The calls cycle through enough copies of W (its f16 copy too, when it has
 * one: that is what the GEMM reads) that none is still in L2 when its turn
 * comes again. Timing each call alone would add the two events' crossings
 * between the legacy stream and the backend's, a few microseconds. */
static double time_matmul(ctx *cx, const luma_weight *w, size_t wbytes, int64_t m, int graph)
{
    const luma_backend_ops *ops = cx->be->ops;
    luma_err err = { { 0 } };
    luma_buf xb = { 0 }, yb = { 0 };
    size_t f16_bytes = (size_t)w->rows * (size_t)w->cols * 2;
    size_t mmv_bytes = repacked_bytes(w);
    size_t read = w->dev_f16 ? f16_bytes : wbytes;
    int copies = (int)((L2_DEFEAT_BYTES + read - 1) / read);
    if (copies > TIME_CALLS) copies = TIME_CALLS;
    if (copies < 2) copies = 2;
    luma_weight wc[TIME_CALLS];
    memset(wc, 0, sizeof wc);   /* a copy's pointers stay NULL until allocated */
    cudaEvent_t ev[2 * TIME_BATCHES];
    int n_ev = 0;
    double best = 0.0;
    for (; n_ev < 2 * TIME_BATCHES; n_ev++)
        if (!cuda_ok(cudaEventCreate(&ev[n_ev]), "cudaEventCreate")) goto done;
    for (int i = 0; i < copies; i++) {
        luma_weight *c = &wc[i];
        *c = *w;
        c->dev = c->dev_f16 = c->dev_mmv = NULL;
        if (!cuda_ok(cudaMalloc(&c->dev, wbytes + 16), "cudaMalloc (weight copy, padded as weight_load pads)") ||
            !cuda_ok(cudaMemcpy(c->dev, w->dev, wbytes, cudaMemcpyDeviceToDevice), "copy weights"))
            goto done;
        if (w->dev_mmv &&
            (!cuda_ok(cudaMalloc(&c->dev_mmv, mmv_bytes), "cudaMalloc (repacked weight copy)") ||
             !cuda_ok(cudaMemcpy(c->dev_mmv, w->dev_mmv, mmv_bytes, cudaMemcpyDeviceToDevice), "copy repacked")))
            goto done;
        if (w->dev_f16 &&
            (!cuda_ok(cudaMalloc(&c->dev_f16, f16_bytes), "cudaMalloc (f16 weight copy)") ||
             !cuda_ok(cudaMemcpy(c->dev_f16, w->dev_f16, f16_bytes, cudaMemcpyDeviceToDevice), "copy f16 weights")))
            goto done;
    }
    if (ops->buf_alloc(cx->be, &xb, m, w->cols, &err) != 0 || ops->buf_alloc(cx->be, &yb, m, w->rows, &err) != 0) {
        CHECKF(0, "buf_alloc: %s", err.msg);
        goto done;
    }
    /* activations of unit spread: quantizing zeros would take shortcuts */
    float *xh = xmalloc((size_t)(m * w->cols) * sizeof(float));
    for (int64_t k = 0; k < m * w->cols; k++) xh[k] = bell();
    int up = cuda_ok(cudaMemcpy(xb.data, xh, (size_t)(m * w->cols) * sizeof(float), cudaMemcpyHostToDevice),
                     "upload x");
    free(xh);
    if (!up) goto done;
    batch bt = { cx, wc, copies, &xb, &yb };
    /* grows the scratch before the timed calls; a graph's first two runs
     * (eager, then recorded) */
    for (int warm = 0; warm < (graph ? 2 : 1); warm++)
        if (run_batch(&bt, graph) != 0 || ops->sync(cx->be, &err) != 0) {
            CHECKF(0, "timing warm-up: %s", err.msg);
            goto done;
        }
    for (int b = 0; b < TIME_BATCHES; b++) {
        if (graph && ops->step_begin(cx->be, &graph_step, &err) != 0) {
            CHECKF(0, "step_begin: %s", err.msg);
            goto done;
        }
        if (!cuda_ok(cudaMemsetAsync(cx->queue, 1, QUEUE_BYTES, 0), "queue memset")) goto done;
        cudaEventRecord(ev[2 * b], 0);
        if (graph) {
            if (ops->step_run(cx->be, &graph_step, queue_calls, &bt, &err) != 0) {
                CHECKF(0, "step_run: %s", err.msg);
                goto done;
            }
        } else {
            queue_calls(&bt, &err);
        }
        cudaEventRecord(ev[2 * b + 1], 0);
    }
    if (ops->sync(cx->be, &err) != 0) {
        CHECKF(0, "timing: %s", err.msg);
        goto done;
    }
    if (!cuda_ok(cudaEventSynchronize(ev[2 * TIME_BATCHES - 1]), "cudaEventSynchronize")) goto done;
    for (int b = 0; b < TIME_BATCHES; b++) {
        float ms_ = 0.0f;
        if (!cuda_ok(cudaEventElapsedTime(&ms_, ev[2 * b], ev[2 * b + 1]), "cudaEventElapsedTime")) goto done;
        double us = ms_ * 1e3 / TIME_CALLS;
        if (best == 0.0 || us < best) best = us;
    }
done:
    for (int i = 0; i < n_ev; i++) cudaEventDestroy(ev[i]);
    for (int i = 0; i < copies; i++) {
        cudaFree(wc[i].dev);
        cudaFree(wc[i].dev_f16);
        cudaFree(wc[i].dev_mmv);
    }
    if (xb.data) ops->buf_free(cx->be, &xb);
    if (yb.data) ops->buf_free(cx->be, &yb);
    return best;
}

/* Checks W x for every m against the reference, the large m both with the
 * resident f16 copy and dequantizing per call, prints one line ("m=64
 * 3.1e-05/3.2e-05": resident/per call), and times the big shapes. */
static void check_shape(ctx *cx, enum luma_type t, const struct shape *sh, timing *tm)
{
    const luma_type_traits *tr = luma_type_get(t);
    int64_t rows = sh->rows, cols = sh->cols;
    size_t row_bytes = luma_row_size(t, cols), bytes = row_bytes * (size_t)rows;
    luma_weight w;
    uint8_t *host = load_random_weight(cx->be, t, rows, cols, &w);
    if (!host) return;
    /* F16 weights are their own f16 form; every other matrix gets a copy */
    bool copy_expected = t != LUMA_F16;
    CHECKF((w.dev_f16 != NULL) == copy_expected, "weight_load %s %lldx%lld %s an f16 copy", tr->name,
           (long long)rows, (long long)cols, copy_expected ? "did not keep" : "kept");
    /* Q6_K, Q4_0, Q5_0 and Q8_0 matrices also get a copy repacked for the matrix-vector
     * kernels where their layout divides a row; file_layout is the same
     * weight without it (the kernels then read the file's blocks, as where
     * the device had no room for the copy) */
    bool mmv_expected = repacked_bytes(&w) > 0;
    CHECKF((w.dev_mmv != NULL) == mmv_expected, "weight_load %s %lldx%lld %s a repacked copy", tr->name,
           (long long)rows, (long long)cols, mmv_expected ? "did not keep" : "kept");
    luma_weight per_call = w, file_layout = w;
    per_call.dev_f16 = NULL;
    file_layout.dev_mmv = NULL;

    int64_t rows_s[SAMPLE_ROWS];
    int ns;
    float *wref = sample_weight_rows(t, host, rows, cols, SAMPLE_ROWS, rows_s, &ns);

    int m_max = cx->quick ? 64 : 512;
    float *x = xmalloc((size_t)m_max * (size_t)cols * sizeof(float));
    float *y = xmalloc((size_t)m_max * (size_t)rows * sizeof(float));
    char line[512];
    int len = snprintf(line, sizeof line, "%-5s %5lldx%-5lld", tr->name, (long long)rows, (long long)cols);
    double tol_small = tr->is_quantized ? TOL_INT8 : TOL_F16;
    for (int i = 0; i < N_MS; i++) {
        int64_t m = ms[i];
        if (m > m_max || (cx->quick && (m == 2 || m == 8))) continue;
        /* block formats: every path multiplies the activations' 8-bit values */
        double tol = tol_small;
        for (int64_t k = 0; k < m * cols; k++) x[k] = bell();
        for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
        if (run_matmul(cx, &w, x, m, y) != 0) continue;
        double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
        CHECKF(e <= tol, "%s %lldx%lld m=%lld: max relative error %.3g > %.1g", tr->name, (long long)rows,
               (long long)cols, (long long)m, e, tol);
        if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - (size_t)len, "  m=%lld %.1e", (long long)m, e);
        if (tr->is_quantized) {
            /* and the CPU backend's product: the same int8 activations */
            bool tiles = w.dev_mmv && !env_off("LUMA_CUDA_TC_MMV") && !env_off("LUMA_CUDA_TC_Q6K");
            double tc = cpu_exact(&w, m, tiles) ? TOL_CPU_INT8 : TOL_CPU_F16;
            double ec = cpu_product_rel_error(t, host, row_bytes, wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
            CHECKF(ec <= tc, "%s %lldx%lld m=%lld: max error %.3g against the CPU backend's product > %.1g", tr->name,
                   (long long)rows, (long long)cols, (long long)m, ec, tc);
            if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - (size_t)len, " (cpu %.0e)", ec);
        }
        if (w.dev_mmv && (m <= MMV_MAX_M || cpu_exact(&file_layout, m, false))) {
            for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
            if (run_matmul(cx, &file_layout, x, m, y) != 0) continue;
            double ec = cpu_product_rel_error(t, host, row_bytes, wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
            CHECKF(ec <= TOL_CPU_INT8,
                   "%s %lldx%lld m=%lld, the file's layout: max error %.3g against the CPU backend's product > %.1g",
                   tr->name, (long long)rows, (long long)cols, (long long)m, ec, TOL_CPU_INT8);
            if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - (size_t)len, " (file %.0e)", ec);
        }
        if (m <= MMV_MAX_M || !w.dev_f16) continue;
        for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
        if (run_matmul(cx, &per_call, x, m, y) != 0) continue;
        e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
        CHECKF(e <= tol, "%s %lldx%lld m=%lld dequantized per call: max relative error %.3g > %.1g", tr->name,
               (long long)rows, (long long)cols, (long long)m, e, tol);
        if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - (size_t)len, "/%.1e", e);
    }
    printf("%s  (tol %.0e)\n", line, tol_small);

    if (sh->big != TIME_NONE && timed(cx, t)) {
        tm->us[0] = time_matmul(cx, &per_call, bytes, 1, 0);
        tm->us[1] = time_matmul(cx, &per_call, bytes, 8, 0);
        if (cx->graphs) {
            tm->us[2] = time_matmul(cx, &per_call, bytes, 1, 1);
            tm->us[3] = time_matmul(cx, &per_call, bytes, 8, 1);
        }
        if (sh->big == TIME_ALL) tm->us[4] = time_matmul(cx, &w, bytes, 512, 0);
        if (sh->big == TIME_ALL && w.dev_f16) tm->us[5] = time_matmul(cx, &per_call, bytes, 512, 0);
        if (w.dev_mmv && cx->graphs)
            printf("%s %lldx%lld m=1 in a graph: repacked %.1f us, the file's layout %.1f us\n", tr->name,
                   (long long)rows, (long long)cols, tm->us[2], time_matmul(cx, &file_layout, bytes, 1, 1));
        /* over 20 TB/s: the events did not wait for the backend's stream */
        CHECKF(tm->us[0] > (double)bytes / 2e7, "%s %lldx%lld m=1 timed at %.2f us: implausible", tr->name,
               (long long)rows, (long long)cols, tm->us[0]);
    }
    free(x);
    free(y);
    free(wref);
    free(host);
}

static double tflops(const struct shape *sh, double us)
{
    return us > 0 ? 2.0 * 512.0 * (double)sh->rows * (double)sh->cols / (us * 1e6) : 0.0;
}

static void print_timing(enum luma_type t, const struct shape *sh, const timing *tm)
{
    size_t bytes = luma_row_size(t, sh->cols) * (size_t)sh->rows;
    printf("%-5s %5lldx%-5lld %6.1f MB", luma_type_name(t), (long long)sh->rows, (long long)sh->cols,
           (double)bytes / 1e6);
    /* m = 1 and 8: eager us, replayed us, the bandwidth of the better */
    for (int k = 0; k < 2; k++) {
        double e = tm->us[k], g = tm->us[2 + k], best = g > 0 && g < e ? g : e;
        double gbs = best > 0 ? (double)bytes / (best * 1e3) : 0.0;
        printf(" | %6.1f %6.1f us %5.0f GB/s %3.0f%%", e, g, gbs, 100.0 * gbs / HBM_GBS);
    }
    if (sh->big != TIME_ALL) {
        printf(" |   (decode shape: m <= 8 only)\n");
        return;
    }
    printf(" | %7.3f ms %6.1f TFLOP/s", tm->us[4] / 1e3, tflops(sh, tm->us[4]));
    if (tm->us[5] > 0 && tm->us[4] > 0)
        printf(" | %7.3f ms %6.1f TFLOP/s %5.2fx\n", tm->us[5] / 1e3, tflops(sh, tm->us[5]), tm->us[5] / tm->us[4]);
    else
        printf(" |   %s\n", t == LUMA_F16 ? "(F16 weights: no copy)" : "(not timed)");
}

/* cuda/mmq.cu's entry points for measuring, with C linkage: whether the
 * wgmma kernels run here, and how many pairs of weights rs_kernel has taken
 * in one launch. */
bool luma_cuda_mmq_has_wgmma(luma_backend *be);
long long luma_cuda_rs_pairs(luma_backend *be);
/* cuda/matmul.cu: how many sets matmul_many split over its two streams */
long long luma_cuda_forks(luma_backend *be);
/* cuda/backend.cu: how many steps have been recorded, and replayed */
void luma_cuda_graph_counts(luma_backend *be, long long *recorded, long long *replays);

/* One matmul_many call: the forward of a recorded step. */
typedef struct many_call {
    ctx *cx;
    const luma_weight *const *ws;
    luma_buf *xb;
    luma_buf *const *ys;
} many_call;

static int queue_many(void *p, luma_err *err)
{
    many_call *mc = p;
    (void)err;
    mc->cx->be->ops->matmul_many(mc->cx->be, 3, mc->ws, mc->xb, mc->ys);
    return 0;
}

/* Whether y's contents are want's bits (n floats). */
static int same_bits(ctx *cx, const luma_buf *yb, const float *want, size_t n)
{
    luma_err err = { { 0 } };
    float *got = xmalloc(n * sizeof(float));
    int same = cx->be->ops->buf_read(cx->be, yb, got, &err) == 0 && memcmp(got, want, n * sizeof(float)) == 0;
    free(got);
    return same;
}

/* matmul_many against one matmul per weight: the same bits, for weights of
 * one activation format (q, k and v of a K-quant model), of both formats,
 * with an F16 weight (which leaves the matrix-vector path above m = 2), and
 * of one type (one launch for all three; odd row counts end a two-row
 * group inside a segment), at m on either side of the matrix-vector
 * path's limit and on the tensor-core routes; tall Q4_K weights of one
 * shape (llama's gate and up), next to each other or not, which rs_kernel
 * takes in one launch where wgmma runs (pairs: say that it must). Past
 * the matrix-vector path matmul_many runs a set's first product that is
 * not rs_kernel's on a second stream (at m = 128 the first set's cuBLAS
 * products, 512 rows and the Q6_K, beside rs_kernel's 128 x 512): at m =
 * 16 and up each set also runs recorded in a step and replayed, the same
 * bits each time. */
static void check_many(ctx *cx, bool pairs)
{
    static const struct {
        enum luma_type t[3];
        int64_t rows[3];
    } sets[] = {
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q6_K }, { 512, 128, 128 } },
        { { LUMA_Q5_0, LUMA_Q4_K, LUMA_Q8_0 }, { 300, 256, 64 } },
        { { LUMA_F16, LUMA_Q6_K, LUMA_Q4_0 }, { 256, 96, 160 } },
        { { LUMA_Q6_K, LUMA_Q6_K, LUMA_Q6_K }, { 129, 255, 64 } },
        { { LUMA_Q5_0, LUMA_Q5_0, LUMA_Q4_K }, { 97, 33, 64 } },
        { { LUMA_Q5_0, LUMA_Q5_0, LUMA_Q8_0 }, { 160, 96, 33 } },
        { { LUMA_Q8_0, LUMA_Q8_0, LUMA_Q8_0 }, { 129, 64, 255 } },
        { { LUMA_Q4_0, LUMA_Q4_0, LUMA_Q4_0 }, { 64, 191, 97 } },
        /* tall and wide Q4_K: rs_kernel's products share its activations */
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q4_K }, { 1024, 1536, 128 } },
        /* pairs of one shape: the first two, then the first and the last */
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q4_K }, { 1024, 1024, 128 } },
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q4_K }, { 1536, 1024, 1536 } },
    };
    static const int64_t many_ms[] = { 1, 3, 8, 16, 32, 128 };
    const luma_backend_ops *ops = cx->be->ops;
    const int64_t cols = 512;
    int checked = 0;
    const long long pairs0 = luma_cuda_rs_pairs(cx->be), forks0 = luma_cuda_forks(cx->be);
    int replayed = 0;
    CHECKF(ops->matmul_many != NULL, "the CUDA backend has matmul_many");
    if (!ops->matmul_many) return;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        luma_weight w[3];
        uint8_t *host[3];
        luma_err err = { { 0 } };
        for (int i = 0; i < 3; i++) {
            enum luma_type t = sets[si].t[i];
            size_t bytes = luma_row_size(t, cols) * (size_t)sets[si].rows[i];
            host[i] = xmalloc(bytes);
            random_weights(t, sets[si].rows[i] * cols, host[i]);
            w[i] = (luma_weight){ .type = t, .rows = sets[si].rows[i], .cols = cols, .host = host[i] };
            if (ops->weight_load(cx->be, &w[i], &err) != 0) CHECKF(0, "weight_load: %s", err.msg);
        }
        for (size_t mi = 0; mi < sizeof many_ms / sizeof many_ms[0]; mi++) {
            int64_t m = many_ms[mi];
            float *x = xmalloc((size_t)(m * cols) * sizeof(float));
            for (int64_t k = 0; k < m * cols; k++) x[k] = bell();
            luma_buf xb = { 0 }, yb[3] = { { 0 } };
            if (ops->buf_alloc(cx->be, &xb, m, cols, &err) != 0) CHECKF(0, "buf_alloc: %s", err.msg);
            for (int i = 0; i < 3; i++)
                if (ops->buf_alloc(cx->be, &yb[i], m, w[i].rows, &err) != 0) CHECKF(0, "buf_alloc: %s", err.msg);
            cudaMemcpy(xb.data, x, (size_t)(m * cols) * sizeof(float), cudaMemcpyHostToDevice);
            const luma_weight *ws[3] = { &w[0], &w[1], &w[2] };
            luma_buf *ys[3] = { &yb[0], &yb[1], &yb[2] };
            ops->matmul_many(cx->be, 3, ws, &xb, ys);
            if (ops->sync(cx->be, &err) != 0) CHECKF(0, "matmul_many: %s", err.msg);
            /* matmul's bits, made once: its buffers, allocated and freed,
             * would make a recording stale */
            float *want[3];
            int have[3];
            for (int i = 0; i < 3; i++) {
                want[i] = xmalloc((size_t)(m * w[i].rows) * sizeof(float));
                have[i] = run_matmul(cx, &w[i], x, m, want[i]) == 0;
            }
            for (int i = 0; i < 3; i++) {
                CHECKF(yb[i].rows == m && yb[i].cols == w[i].rows, "matmul_many sets y to m x rows");
                if (have[i])
                    CHECKF(same_bits(cx, &yb[i], want[i], (size_t)(m * w[i].rows)),
                           "matmul_many set %zu, %s at m=%lld: not the bits of matmul", si,
                           luma_type_name(w[i].type), (long long)m);
                checked++;
            }
            /* through step_run: the first run records, the others replay
             * that recording; the outputs cleared before each */
            long long recorded0, replays0, recorded1, replays1;
            luma_cuda_graph_counts(cx->be, &recorded0, &replays0);
            for (int run = 0; m >= 16 && cx->graphs && run < 3; run++) {
                many_call mc = { cx, ws, &xb, ys };
                for (int i = 0; i < 3; i++) cudaMemset(yb[i].data, 0, (size_t)(m * w[i].rows) * sizeof(float));
                if (ops->step_begin(cx->be, &graph_step, &err) != 0 ||
                    ops->step_run(cx->be, &graph_step, queue_many, &mc, &err) != 0 || ops->sync(cx->be, &err) != 0) {
                    CHECKF(0, "matmul_many in a step: %s", err.msg);
                    break;
                }
                for (int i = 0; i < 3; i++) {
                    if (have[i])
                        CHECKF(same_bits(cx, &yb[i], want[i], (size_t)(m * w[i].rows)),
                               "matmul_many set %zu, %s at m=%lld, step run %d: not the bits of matmul", si,
                               luma_type_name(w[i].type), (long long)m, run);
                    replayed++;
                }
            }
            luma_cuda_graph_counts(cx->be, &recorded1, &replays1);
            if (m >= 16 && cx->graphs && !getenv("LUMA_CUDA_GRAPHS"))
                CHECKF(recorded1 - recorded0 == 1 && replays1 - replays0 == 3,
                       "matmul_many set %zu at m=%lld: 3 step runs made %lld recordings and %lld replays, not 1 and 3",
                       si, (long long)m, recorded1 - recorded0, replays1 - replays0);
            for (int i = 0; i < 3; i++) free(want[i]);
            ops->buf_free(cx->be, &xb);
            for (int i = 0; i < 3; i++) ops->buf_free(cx->be, &yb[i]);
            free(x);
        }
        for (int i = 0; i < 3; i++) free(host[i]);
    }
    const long long npairs = luma_cuda_rs_pairs(cx->be) - pairs0;
    if (pairs && luma_cuda_mmq_has_wgmma(cx->be) && !getenv("LUMA_CUDA_RS_PAIR"))
        CHECKF(npairs >= 4, "matmul_many took %lld pairs of tall Q4_K weights in one launch, not 4", npairs);
    const long long nforks = luma_cuda_forks(cx->be) - forks0;
    const char *fork_min = getenv("LUMA_CUDA_FORK");
    if (pairs && luma_cuda_mmq_has_wgmma(cx->be) && fork_min && atoll(fork_min) == 1)
        CHECKF(nforks >= 1, "matmul_many ran no set on two streams");
    printf("matmul_many: %d products equal to matmul's, bit for bit (%lld in pairs of one launch); %d in recorded "
           "steps; %lld sets on two streams\n",
           checked, 2 * npairs, replayed, nforks);
}

/* gated_matmul against gelu_mul or silu_mul and then matmul on the same
 * backend: the same bits in gate and in y, on the matrix-vector path and
 * on rs_kernel and cuBLAS (where the activation is folded into the
 * quantizer), and on the other routes. */
static void check_gated(ctx *cx)
{
    static const enum luma_type gtypes[] = { LUMA_Q4_K, LUMA_Q6_K, LUMA_Q5_0, LUMA_Q8_0, LUMA_F16 };
    static const int64_t gms[] = { 1, 3, 8, 16, 128 };
    const luma_backend_ops *ops = cx->be->ops;
    const int64_t cols = 1024, rows = 200;
    int checked = 0;
    CHECKF(ops->gated_matmul != NULL, "the CUDA backend has gated_matmul");
    if (!ops->gated_matmul) return;
    for (size_t ti = 0; ti < sizeof gtypes / sizeof gtypes[0]; ti++) {
        enum luma_type t = gtypes[ti];
        luma_err err = { { 0 } };
        luma_weight w;
        uint8_t *host = load_random_weight(cx->be, t, rows, cols, &w);
        if (!host) continue;
        for (size_t mi = 0; mi < sizeof gms / sizeof gms[0]; mi++)
            for (int act = LUMA_ACT_GELU; act <= LUMA_ACT_SILU; act++) {
                int64_t m = gms[mi];
                size_t nx = (size_t)(m * cols), ny = (size_t)(m * rows);
                float *g = xmalloc(nx * sizeof(float)), *u = xmalloc(nx * sizeof(float));
                for (size_t k = 0; k < nx; k++) {
                    g[k] = 2.0f * bell();
                    u[k] = bell();
                }
                luma_buf gb[2] = { { 0 } }, ub = { 0 }, yb[2] = { { 0 } };
                for (int v = 0; v < 2; v++)
                    if (ops->buf_alloc(cx->be, &gb[v], m, cols, &err) != 0 ||
                        ops->buf_alloc(cx->be, &yb[v], m, rows, &err) != 0)
                        CHECKF(0, "buf_alloc: %s", err.msg);
                if (ops->buf_alloc(cx->be, &ub, m, cols, &err) != 0) CHECKF(0, "buf_alloc: %s", err.msg);
                for (int v = 0; v < 2; v++) cudaMemcpy(gb[v].data, g, nx * sizeof(float), cudaMemcpyHostToDevice);
                cudaMemcpy(ub.data, u, nx * sizeof(float), cudaMemcpyHostToDevice);
                ops->gated_matmul(cx->be, &w, &gb[0], &ub, act, &yb[0]);
                if (act == LUMA_ACT_GELU) ops->gelu_mul(cx->be, &gb[1], &ub);
                else ops->silu_mul(cx->be, &gb[1], &ub);
                ops->matmul(cx->be, &w, &gb[1], &yb[1]);
                if (ops->sync(cx->be, &err) != 0) CHECKF(0, "gated_matmul: %s", err.msg);
                float *got = xmalloc((nx > ny ? nx : ny) * sizeof(float)), *want = xmalloc((nx > ny ? nx : ny) * sizeof(float));
                CHECKF(yb[0].rows == m && yb[0].cols == rows, "gated_matmul sets y to m x rows");
                if (ops->buf_read(cx->be, &yb[0], got, &err) == 0 && ops->buf_read(cx->be, &yb[1], want, &err) == 0)
                    CHECKF(memcmp(got, want, ny * sizeof(float)) == 0, "gated_matmul %s m=%lld %s: y differs",
                           luma_type_name(t), (long long)m, act == LUMA_ACT_GELU ? "GELU" : "SiLU");
                if (ops->buf_read(cx->be, &gb[0], got, &err) == 0 && ops->buf_read(cx->be, &gb[1], want, &err) == 0)
                    CHECKF(memcmp(got, want, nx * sizeof(float)) == 0, "gated_matmul %s m=%lld %s: gate differs",
                           luma_type_name(t), (long long)m, act == LUMA_ACT_GELU ? "GELU" : "SiLU");
                checked++;
                for (int v = 0; v < 2; v++) {
                    ops->buf_free(cx->be, &gb[v]);
                    ops->buf_free(cx->be, &yb[v]);
                }
                ops->buf_free(cx->be, &ub);
                free(g);
                free(u);
                free(got);
                free(want);
            }
        free(host);
    }
    printf("gated_matmul: %d products and gates equal to gelu_mul / silu_mul and matmul, bit for bit\n", checked);
}

/* Float activations: the tolerance against the double reference on the
 * matrix-vector path, where only the order of float sums differs; that
 * path's largest m (MMV_FLOAT_MAX_M of cuda/matmul.cu: above it the
 * resident f16 copy and the tensor cores). */
#define TOL_FLOAT 1e-5
#define FLOAT_MAX_M 4

static void check_float(ctx *base)
{
    static const int fms[] = { 1, 3, 4, 8, 16, 64 };
    luma_err err = { { 0 } };
    ctx cx = *base;
    cx.be = luma_backend_cuda_new(0, &err);
    if (!cx.be) {
        CHECKF(0, "a second CUDA backend did not start: %s", err.msg);
        return;
    }
    const luma_backend_ops *ops = cx.be->ops;
    CHECKF(ops->set_float_act && ops->set_float_act(cx.be, true, &err) == 0, "set_float_act: %s", err.msg);
    int checked = 0;
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum luma_type t = types[ti];
        const luma_type_traits *tr = luma_type_get(t);
        if (!tr->is_quantized) continue;
        for (int si = 0; si < N_SHAPES; si++) {
            const struct shape *sh = &shapes[si];
            int64_t rows = sh->rows, cols = sh->cols;
            bool big = sh->big != TIME_NONE;
            if (cols % tr->block_size != 0 || (big && (cx.quick || rows != 4096 || cols != 4096))) continue;
            luma_weight w;
            uint8_t *host = load_random_weight(cx.be, t, rows, cols, &w);
            if (!host) continue;
            /* Q6_K, Q4_0, Q5_0 and Q8_0: the repacked copy (the kf and kf_x4
             * kernels) and, as file_layout, the file's blocks (the
             * element-wise kernel) */
            luma_weight file_layout = w;
            file_layout.dev_mmv = NULL;
            int64_t rows_s[SAMPLE_ROWS];
            int ns;
            float *wref = sample_weight_rows(t, host, rows, cols, SAMPLE_ROWS, rows_s, &ns);
            float *x = xmalloc((size_t)64 * (size_t)cols * sizeof(float));
            float *y = xmalloc((size_t)64 * (size_t)rows * sizeof(float));
            float *y1 = xmalloc((size_t)rows * sizeof(float));
            char line[256];
            int len = snprintf(line, sizeof line, "float %-5s %5lldx%-5lld", tr->name, (long long)rows, (long long)cols);
            for (size_t mi = 0; mi < sizeof fms / sizeof fms[0]; mi++) {
                int64_t m = fms[mi];
                for (int64_t k = 0; k < m * cols; k++) x[k] = bell();
                for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
                if (run_matmul(&cx, &w, x, m, y) != 0) continue;
                double tol = m <= FLOAT_MAX_M ? TOL_FLOAT : TOL_F16;
                double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
                CHECKF(e <= tol, "float activations %s %lldx%lld m=%lld: max relative error %.3g > %.1g", tr->name,
                       (long long)rows, (long long)cols, (long long)m, e, tol);
                if (len < (int)sizeof line)
                    len += snprintf(line + len, sizeof line - (size_t)len, "  m=%lld %.1e", (long long)m, e);
                if (m == 3 && run_matmul(&cx, &w, x, 1, y1) == 0)
                    CHECKF(memcmp(y, y1, (size_t)rows * sizeof(float)) == 0,
                           "float activations %s %lldx%lld: row 0 of m = 3 differs from m = 1", tr->name,
                           (long long)rows, (long long)cols);
                if (m <= FLOAT_MAX_M && w.dev_mmv) {
                    for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
                    if (run_matmul(&cx, &file_layout, x, m, y) != 0) continue;
                    e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
                    CHECKF(e <= TOL_FLOAT, "float activations %s %lldx%lld m=%lld, the file's layout: max relative "
                           "error %.3g > %.1g", tr->name, (long long)rows, (long long)cols, (long long)m, e, TOL_FLOAT);
                    if (len < (int)sizeof line)
                        len += snprintf(line + len, sizeof line - (size_t)len, " (file %.1e)", e);
                }
            }
            printf("%s\n", line);
            checked++;
            free(x);
            free(y);
            free(y1);
            free(wref);
            free(host);   /* the backend frees its weights with itself */
        }
    }
    printf("float activations: %d weight matrices checked\n", checked);
    check_many(&cx, false);
    check_gated(&cx);
    /* m = 1 to 8 in a graph, next to the 8-bit kernels of the first backend */
    static const enum luma_type ttypes[] = { LUMA_Q4_K, LUMA_Q6_K, LUMA_Q5_0, LUMA_Q8_0 };
    for (int ti = 0; ti < (int)(sizeof ttypes / sizeof ttypes[0]) && !cx.quick && cx.graphs; ti++)
        for (int si = 0; si < N_SHAPES; si++) {
            const struct shape *sh = &shapes[si];
            enum luma_type t = ttypes[ti];
            if (sh->big == TIME_NONE || !timed(&cx, t)) continue;
            size_t bytes = luma_row_size(t, sh->cols) * (size_t)sh->rows;
            uint8_t *host = xmalloc(bytes);
            random_weights(t, sh->rows * sh->cols, host);
            luma_weight wf = { .type = t, .rows = sh->rows, .cols = sh->cols, .host = host }, wi = wf;
            if (ops->weight_load(cx.be, &wf, &err) == 0 && base->be->ops->weight_load(base->be, &wi, &err) == 0) {
                luma_weight pf = wf, pi = wi;   /* float keeps its f16 copy: cuBLAS above FLOAT_MAX_M */
                pi.dev_f16 = NULL;
                printf("%s %lldx%lld in a graph, float activations against 8-bit, us:", luma_type_name(t),
                       (long long)sh->rows, (long long)sh->cols);
                for (int64_t m = 1; m <= 8; m *= 2)
                    printf("  m=%lld %.1f / %.1f", (long long)m, time_matmul(&cx, &pf, bytes, m, 1),
                           time_matmul(base, &pi, bytes, m, 1));
                printf("\n");
            } else {
                CHECKF(0, "weight_load: %s", err.msg);
            }
            free(host);
        }
    ops->free(cx.be);
}

/* The copies give way to allocations: on a backend of its own, a Q8_0
 * weight with both copies (f16 and repacked), then an activation buffer
 * that fits only once both are freed (more than the free memory and the f16
 * copy together, less than that with the repacked copy too). It must be
 * allocated, and the weight must then multiply with the bits it gives
 * without its repacked copy, within float rounding of the CPU backend.
 * (Under compute-sanitizer the out-of-memory it provokes shows as API
 * errors of dev_malloc's cudaMalloc and cudaGetLastError.) */
static void check_drop(void)
{
    const enum luma_type t = LUMA_Q8_0;
    const int64_t rows = 14336, cols = 4096;
    luma_err err = { { 0 } };
    ctx cx = { 0 };
    cx.be = luma_backend_cuda_new(0, &err);
    if (!cx.be) {
        CHECKF(0, "a second CUDA backend: %s", err.msg);
        return;
    }
    const luma_backend_ops *ops = cx.be->ops;
    luma_weight w = { .type = t, .rows = rows, .cols = cols };
    if (repacked_bytes(&w) == 0) {   /* LUMA_CUDA_X4_MMV=0: no repacked copy to give way */
        printf("drop: not run (the repacked copies are turned off: LUMA_CUDA_X4_MMV=0)\n");
        ops->free(cx.be);
        return;
    }
    size_t row_bytes = luma_row_size(t, cols), bytes = row_bytes * (size_t)rows;
    uint8_t *host = xmalloc(bytes);
    random_weights(t, rows * cols, host);
    w.host = host;
    float *x = xmalloc((size_t)cols * sizeof(float)), *want = xmalloc((size_t)rows * sizeof(float)),
          *got = xmalloc((size_t)rows * sizeof(float));
    for (int64_t k = 0; k < cols; k++) x[k] = bell();
    luma_buf big = { 0 };
    if (ops->weight_load(cx.be, &w, &err) != 0) {
        CHECKF(0, "weight_load: %s", err.msg);
        goto done;
    }
    size_t mmv = repacked_bytes(&w), f16 = (size_t)rows * (size_t)cols * 2, free_b = 0, total_b = 0;
    CHECKF(w.dev_f16 != NULL && w.dev_mmv != NULL && mmv > 0, "drop: the weight has both copies");
    luma_weight file_layout = w;
    file_layout.dev_mmv = NULL;
    if (run_matmul(&cx, &file_layout, x, 1, want) != 0 || !cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo"))
        goto done;
    const int64_t per_row = 1 << 20;   /* floats: 4 MiB a row */
    int64_t big_rows = (int64_t)((free_b + f16 + mmv / 2) / (per_row * sizeof(float))) + 1;
    /* Memory the driver holds elsewhere may come free once an allocation
     * fails (the f16 copy alone then makes room, and the product still
     * reads the repacked copy): measured again, a larger buffer the next
     * time, until the repacked copy has given way too. */
    bool same = false;
    for (int attempt = 0; attempt < 4; attempt++) {
        CHECKF(ops->buf_alloc(cx.be, &big, big_rows, per_row, &err) == 0,
               "drop: %lld MiB, which fit once the copies are freed, not allocated: %s", (long long)(big_rows * 4),
               err.msg);
        ops->buf_free(cx.be, &big);
        if (run_matmul(&cx, &w, x, 1, got) != 0) goto done;
        same = memcmp(got, want, (size_t)rows * sizeof(float)) == 0;
        if (same || !cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo")) break;
        big_rows = (int64_t)((free_b + mmv / 2) / (per_row * sizeof(float))) + 1;
    }
    CHECKF(same, "drop: after the copies gave way the product differs from the file's blocks'");
    int64_t rows_s[SAMPLE_ROWS];
    int ns;
    float *wref = sample_weight_rows(t, host, rows, cols, SAMPLE_ROWS, rows_s, &ns);
    double ec = cpu_product_rel_error(t, host, row_bytes, wref, rows_s, ns, x, 1, cols, got, rows, SAMPLE_ACTS);
    CHECKF(ec <= TOL_CPU_INT8, "drop: max error %.3g against the CPU backend's product > %.1g", ec, TOL_CPU_INT8);
    printf("copies gave way to a %lld MiB buffer; the product after it: %.0e against the CPU\n",
           (long long)(big_rows * 4), ec);
    free(wref);
done:
    free(x);
    free(want);
    free(got);
    free(host);
    ops->free(cx.be);
}

/* A random rows x cols weight of type t loaded by the backend into *w,
 * SAMPLE_ROWS of its rows dequantized for the reference, and m_max x cols
 * random activations: what check_vocab and check_tall start from. False
 * after a failed check, with nothing to free. */
typedef struct sampled {
    uint8_t *host;             /* the weight's blocks */
    float *wref;               /* rows_s's rows, dequantized */
    int64_t rows_s[SAMPLE_ROWS];
    int ns;
    float *x;
} sampled;

static bool sampled_load(ctx *cx, enum luma_type t, int64_t rows, int64_t cols, int64_t m_max, luma_weight *w,
                         sampled *sm)
{
    sm->host = load_random_weight(cx->be, t, rows, cols, w);
    if (!sm->host) return false;
    sm->wref = sample_weight_rows(t, sm->host, rows, cols, SAMPLE_ROWS, sm->rows_s, &sm->ns);
    sm->x = xmalloc((size_t)m_max * (size_t)cols * sizeof(float));
    for (int64_t k = 0; k < m_max * cols; k++) sm->x[k] = bell();
    return true;
}

static void sampled_free(sampled *sm)
{
    free(sm->x);
    free(sm->wref);
    free(sm->host);   /* the backend frees its weights with itself */
}

void luma_cuda_tall_range(luma_backend *be, int lo, int hi);
long long luma_cuda_talls(luma_backend *be);

/* Gemma 3's output projection, 262,144 rows of 640 (its tied embedding),
 * in the block types a Q4_K_M file gives such a matrix: a row shorter than
 * three of a warp's rounds, in so many rows that the matrix-vector path
 * takes the narrow kernel (a group of lanes a row; the tall kernel, which
 * takes Q8_0 from 4 rows by its rule, turned off here). Checked at m = 1, 3
 * and 8 against the reference and the CPU's product, the rows of m = 3 and
 * 8 bit for bit those of m = 1 (batch invariance), then timed at m = 1
 * and 8 in a graph. Not in quick mode (178 MB of Q8_0). */
static void check_vocab(ctx *cx)
{
    static const enum luma_type vt[] = { LUMA_Q8_0, LUMA_Q5_0, LUMA_Q4_0 };
    const int64_t rows = 262144, cols = 640;
    if (cx->quick) return;
    luma_cuda_tall_range(cx->be, 1, 0);   /* the narrow kernel at every m (check_tall has the other) */
    for (size_t ti = 0; ti < sizeof vt / sizeof vt[0]; ti++) {
        enum luma_type t = vt[ti];
        size_t row_bytes = luma_row_size(t, cols), bytes = row_bytes * (size_t)rows;
        luma_weight w;
        sampled sm;
        if (!sampled_load(cx, t, rows, cols, 8, &w, &sm)) continue;
        const float *x = sm.x, *wref = sm.wref;
        const uint8_t *host = sm.host;
        const int64_t *rows_s = sm.rows_s;
        const int ns = sm.ns;
        float *y1 = xmalloc((size_t)rows * sizeof(float)), *y = xmalloc((size_t)8 * (size_t)rows * sizeof(float));
        char line[256];
        int len = snprintf(line, sizeof line, "%-5s %lldx%lld (an output projection)", luma_type_name(t),
                           (long long)rows, (long long)cols);
        if (run_matmul(cx, &w, x, 1, y1) == 0) {
            static const int64_t vms[] = { 1, 3, 8 };
            for (size_t mi = 0; mi < sizeof vms / sizeof vms[0]; mi++) {
                int64_t m = vms[mi];
                for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
                if (run_matmul(cx, &w, x, m, y) != 0) break;
                double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
                double ec = cpu_product_rel_error(t, host, row_bytes, wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
                CHECKF(e <= TOL_INT8 && ec <= TOL_CPU_INT8,
                       "%s %lldx%lld m=%lld: max relative error %.3g (> %.1g?), against the CPU's product %.3g (> %.1g?)",
                       luma_type_name(t), (long long)rows, (long long)cols, (long long)m, e, TOL_INT8, ec, TOL_CPU_INT8);
                CHECKF(memcmp(y, y1, (size_t)rows * sizeof(float)) == 0,
                       "%s %lldx%lld: row 0 of m = %lld differs from m = 1", luma_type_name(t), (long long)rows,
                       (long long)cols, (long long)m);
                if (len < (int)sizeof line)
                    len += snprintf(line + len, sizeof line - (size_t)len, "  m=%lld %.1e (cpu %.0e)", (long long)m, e, ec);
            }
        }
        printf("%s\n", line);
        if (cx->graphs && timed(cx, t)) {
            double us1 = time_matmul(cx, &w, bytes, 1, 1), us8 = time_matmul(cx, &w, bytes, 8, 1);
            printf("%-5s %lldx%lld %.1f MB in a graph: m=1 %.1f us %.0f GB/s, m=8 %.1f us %.0f GB/s\n",
                   luma_type_name(t), (long long)rows, (long long)cols, (double)bytes / 1e6, us1,
                   us1 > 0 ? (double)bytes / (us1 * 1e3) : 0.0, us8, us8 > 0 ? (double)bytes / (us8 * 1e3) : 0.0);
        }
        free(y);
        free(y1);
        sampled_free(&sm);
    }
    luma_cuda_tall_range(cx->be, -1, -1);
}

/* The tall kernel (cuda/tall.cu): Q8_0 weights of a vocabulary's rows on
 * the tensor cores from their x4 copy, at 2 to 64 activation rows. Three
 * shapes (3, 9 and 5 groups of 128 a row, the last of rows not a multiple
 * of 16), m from 2 to 128: each launch taken where its slabs and
 * activations fit shared memory (at 1,152 columns up to 32 rows; never
 * past 64 rows, nor on rows that do not fill the last slab) and nothing
 * else, every output written,
 * within f16 rounding of the reference and the CPU's product, and within
 * float rounding of the same product with the kernel off (cuBLAS on the
 * resident f16 copy past 8 rows: the same f16 operands, other sums). Then,
 * outside quick mode, Gemma 3's output projection timed with the kernel
 * on and off at 2 to 128 rows. */
static void check_tall(ctx *cx)
{
    static const struct {
        int64_t rows, cols;
    } shs[] = { { 65536, 384 }, { 65552, 1152 }, { 65545, 640 } };
    static const int64_t tall_ms[] = { 2, 5, 8, 13, 16, 24, 40, 64, 100, 128 };
    const int64_t mmax = 128;
    for (size_t si = 0; si < sizeof shs / sizeof shs[0]; si++) {
        const int64_t rows = shs[si].rows, cols = shs[si].cols;
        size_t row_bytes = luma_row_size(LUMA_Q8_0, cols);
        luma_weight w;
        sampled sm;
        if (!sampled_load(cx, LUMA_Q8_0, rows, cols, mmax, &w, &sm)) continue;
        const float *x = sm.x, *wref = sm.wref;
        const uint8_t *host = sm.host;
        const int64_t *rows_s = sm.rows_s;
        const int ns = sm.ns;
        float *y = xmalloc((size_t)mmax * (size_t)rows * sizeof(float));
        float *y0 = xmalloc((size_t)mmax * (size_t)rows * sizeof(float));
        char line[512];
        int len = snprintf(line, sizeof line, "Q8_0  %lldx%lld (tall kernel)", (long long)rows, (long long)cols);
        for (size_t mi = 0; mi < sizeof tall_ms / sizeof tall_ms[0]; mi++) {
            const int64_t m = tall_ms[mi];
            int nt = 1;
            while (8 * nt < m) nt *= 2;
            /* tall.cu's shared memory: the activations, 8 nt rows of cols +
             * 32 halves, the mbarriers and two warps' two slab buffers (16
             * rows of cols / 128 groups of 136 bytes) at least; whole slabs
             * only, 64 rows at most */
            const size_t slab = (size_t)16 * (size_t)(cols / 128) * 136;
            const bool fits = m <= 64 && rows % 16 == 0 &&
                              (size_t)8 * (size_t)nt * (size_t)(cols + 32) * 2 + 128 + 4 * slab <= (size_t)227 * 1024;
            for (int64_t k = 0; k < m * rows; k++) y[k] = y0[k] = NAN;
            luma_cuda_tall_range(cx->be, 2, 128);
            const long long n0 = luma_cuda_talls(cx->be);
            if (run_matmul(cx, &w, x, m, y) != 0) break;
            const long long took = luma_cuda_talls(cx->be) - n0;
            luma_cuda_tall_range(cx->be, 1, 0);
            if (run_matmul(cx, &w, x, m, y0) != 0) break;
            CHECKF(took == (fits ? 1 : 0), "Q8_0 %lldx%lld m=%lld: %lld tall launches, expected %d", (long long)rows,
                   (long long)cols, (long long)m, took, fits ? 1 : 0);
            double scale = 0.0, diff = 0.0;
            int64_t unwritten = 0;
            for (int64_t k = 0; k < m * rows; k++) {
                if (!isfinite(y[k])) unwritten++;
                if (fabs(y0[k]) > scale) scale = fabs(y0[k]);
                if (fabs((double)y[k] - y0[k]) > diff) diff = fabs((double)y[k] - y0[k]);
            }
            double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
            double ec = cpu_product_rel_error(LUMA_Q8_0, host, row_bytes, wref, rows_s, ns, x, m, cols, y, rows,
                                              SAMPLE_ACTS);
            CHECKF(unwritten == 0, "Q8_0 %lldx%lld m=%lld: %lld outputs not finite", (long long)rows,
                   (long long)cols, (long long)m, (long long)unwritten);
            CHECKF(e <= TOL_F16 && ec <= TOL_CPU_F16,
                   "Q8_0 %lldx%lld m=%lld: max relative error %.3g (> %.1g?), against the CPU's product %.3g "
                   "(> %.1g?)",
                   (long long)rows, (long long)cols, (long long)m, e, TOL_F16, ec, TOL_CPU_F16);
            /* m <= 8 with the kernel off is the narrow kernel on int8
             * activations: f16 rounding apart, not float rounding */
            const double tol = m <= 8 ? 4e-3 : 1e-4;
            CHECKF(scale > 0 && diff <= tol * scale,
                   "Q8_0 %lldx%lld m=%lld: differs from the kernel off by %.3g of the largest output (> %.0e)",
                   (long long)rows, (long long)cols, (long long)m, scale > 0 ? diff / scale : 0.0, tol);
            if (len < (int)sizeof line)
                len += snprintf(line + len, sizeof line - (size_t)len, "  m=%lld%s %.0e", (long long)m,
                                took ? "" : "(off)", e);
        }
        luma_cuda_tall_range(cx->be, -1, -1);
        printf("%s\n", line);
        free(y);
        free(y0);
        sampled_free(&sm);
    }
    if (!cx->graphs || !timed(cx, LUMA_Q8_0)) return;
    const int64_t rows = 262144, cols = 640;
    luma_weight w;
    uint8_t *host = load_random_weight(cx->be, LUMA_Q8_0, rows, cols, &w);
    if (!host) return;
    const size_t bytes = luma_row_size(LUMA_Q8_0, cols) * (size_t)rows;
    static const int64_t tm[] = { 2, 4, 8, 16, 32, 64, 128 };
    for (size_t mi = 0; mi < sizeof tm / sizeof tm[0]; mi++) {
        luma_cuda_tall_range(cx->be, 2, 128);
        double on = time_matmul(cx, &w, bytes, tm[mi], 1);
        luma_cuda_tall_range(cx->be, 1, 0);
        double off = time_matmul(cx, &w, bytes, tm[mi], 1);
        printf("Q8_0  %lldx%lld in a graph, m=%lld: tall kernel %.1f us (%.0f GB/s of Q8_0), off %.1f us\n",
               (long long)rows, (long long)cols, (long long)tm[mi], on, on > 0 ? (double)bytes / (on * 1e3) : 0.0,
               off);
    }
    luma_cuda_tall_range(cx->be, -1, -1);
    free(host);
}

/* cuda/matmul.cu: GEMMs through cuBLASLt, algorithms chosen */
bool luma_cuda_lt_counts(luma_backend *be, long long *calls, long long *picks);

/* cuBLASLt's algorithm chosen once per bucket of m (lt_bucket: 65 to 128
 * rows are one) and run at every m of it: an F16 weight of Gemma's width
 * (the tensor-core path from m = 3) at m = 65, 72, ..., 128, each product
 * against the reference within f16 rounding, one choice for all of them
 * and every product through cuBLASLt; then m = 129 (the next bucket: a
 * choice of its own). With LUMA_CUDA_LT=0 none goes through it. */
static void check_lt(ctx *cx)
{
    const int64_t rows = 1024, cols = 640;
    luma_weight w;
    uint8_t *host = load_random_weight(cx->be, LUMA_F16, rows, cols, &w);
    if (!host) return;
    int64_t rows_s[SAMPLE_ROWS];
    int ns;
    float *wref = sample_weight_rows(LUMA_F16, host, rows, cols, SAMPLE_ROWS, rows_s, &ns);
    float *x = xmalloc((size_t)129 * (size_t)cols * sizeof(float));
    float *y = xmalloc((size_t)129 * (size_t)rows * sizeof(float));
    long long c0 = 0, p0 = 0, c1 = 0, p1 = 0, c2 = 0, p2 = 0;
    const bool on = luma_cuda_lt_counts(cx->be, &c0, &p0);
    int products = 0;
    double worst = 0.0;
    for (int64_t m = 65; m <= 129; m += (m == 128 ? 1 : 7)) {
        if (m == 129) luma_cuda_lt_counts(cx->be, &c1, &p1);
        for (int64_t k = 0; k < m * cols; k++) x[k] = bell();
        for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
        if (run_matmul(cx, &w, x, m, y) != 0) break;
        double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
        CHECKF(e <= TOL_F16, "F16 1024x640 m=%lld (cuBLASLt's bucket): max relative error %.3g > %.1g", (long long)m,
               e, TOL_F16);
        if (e > worst) worst = e;
        if (m < 129) products++;
    }
    luma_cuda_lt_counts(cx->be, &c2, &p2);
    if (on) {
        CHECKF(c1 - c0 == products && p1 - p0 == 1,
               "cuBLASLt: %d products of 65 to 128 rows made %lld calls and %lld choices, not %d and 1", products,
               c1 - c0, p1 - p0, products);
        CHECKF(c2 - c1 == 1 && p2 - p1 == 1, "cuBLASLt: m = 129 made %lld calls and %lld choices, not 1 and 1",
               c2 - c1, p2 - p1);
    } else {
        CHECKF(c2 == c0 && p2 == p0, "cuBLASLt is off but ran %lld products", c2 - c0);
    }
    printf("cuBLASLt (%s): %d products of 65 to 128 rows with %lld choice(s), m = 129 with %lld; max relative error "
           "%.1e\n", on ? "on" : "off", products, p1 - p0, p2 - p1, worst);
    free(x);
    free(y);
    free(wref);
    free(host);
}

static int run_checks(void)
{
    luma_err err = { { 0 } };
    ctx cx = { 0 };
    const char *q = getenv("LUMA_CUDA_QUICK");
    cx.quick = q && *q && strcmp(q, "0") != 0;
    cx.time_types = getenv("LUMA_CUDA_TIME_TYPES");
    if (cx.time_types && !*cx.time_types) cx.time_types = NULL;
    cx.be = luma_backend_cuda_new(0, &err);
    if (!cx.be) {
        printf("test_cuda_matmul: FAIL: a CUDA device is present but the backend did not start: %s\n", err.msg);
        return 1;
    }
    cx.graphs = cx.be->ops->step_begin && cx.be->ops->step_run;
    if (!cx.quick && !cuda_ok(cudaMalloc(&cx.queue, QUEUE_BYTES), "cudaMalloc (queue)")) cx.quick = 1;

    const char *only = getenv("LUMA_CUDA_ONLY");
    if (only && strcmp(only, "tall") == 0) {
        check_tall(&cx);
        printf("matmul: the other checks not run (LUMA_CUDA_ONLY=tall)\n");
        if (cx.queue) cudaFree(cx.queue);
        cx.be->ops->free(cx.be);
        return 0;
    }
    static timing tms[N_TYPES][N_SHAPES];
    int checked = 0;
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int si = 0; si < N_SHAPES; si++) {
            const struct shape *sh = &shapes[si];
            if (sh->cols % luma_type_get(types[ti])->block_size != 0 || (cx.quick && sh->big != TIME_NONE)) continue;
            check_shape(&cx, types[ti], sh, &tms[ti][si]);
            checked++;
        }
    printf("matmul: %d weight matrices checked%s\n", checked, cx.quick ? " (quick: small shapes only)" : "");
    check_many(&cx, true);
    check_gated(&cx);
    check_float(&cx);
    check_vocab(&cx);
    check_tall(&cx);
    check_lt(&cx);

    if (!cx.quick) {
        printf("\ntiming (per call in a stream of %d, best of %d; weights cold in L2; %% of %.0f GB/s):\n", TIME_CALLS,
               TIME_BATCHES, HBM_GBS);
        printf("type  shape       weights | m=1: eager, graph  bandwidth  | m=8: eager, graph  bandwidth  | "
               "m=512, resident f16: time  throughput | m=512, dequantized per call: time  throughput  resident's "
               "speedup\n");
        for (int ti = 0; ti < N_TYPES; ti++)
            for (int si = 0; si < N_SHAPES; si++)
                if (shapes[si].big != TIME_NONE && timed(&cx, types[ti]) &&
                    shapes[si].cols % luma_type_get(types[ti])->block_size == 0)
                    print_timing(types[ti], &shapes[si], &tms[ti][si]);
    }
    if (cx.queue) cudaFree(cx.queue);
    cx.be->ops->free(cx.be);
    check_drop();
    return 0;
}

#endif

int main(void)
{
    rnd_seed(0x243f6a8885a308d3ULL);
    /* matmul_many's second stream for every product size (these weights
     * are smaller than the default's bound), unless the environment says */
    setenv("LUMA_CUDA_FORK", "1", 0);
    /* a step shape recorded the first time it comes, as by default
     * (check_many counts one recording and three replays in three runs) */
    setenv("LUMA_CUDA_GRAPH_AFTER", "0", 0);
    if (!luma_backend_cuda_available()) {
        printf("test_cuda_matmul: no CUDA device, the GPU checks did not run\n");
        return 0;
    }
#ifdef LUMA_HAVE_CUDA
    if (run_checks() != 0) return 1;
#else
    printf("test_cuda_matmul: FAIL: the library has a CUDA backend but this test was compiled without "
           "LUMA_HAVE_CUDA\n");
    return 1;
#endif
    if (failures) {
        printf("test_cuda_matmul: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_matmul: all checks passed\n");
    return 0;
}
