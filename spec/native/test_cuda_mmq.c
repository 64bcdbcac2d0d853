/* The tensor-core product on quantized weights (cuda/mmq.cu), forced on
 * through luma_cuda_mmq_policy, against a double-precision CPU reference
 * built from luma_dequantize_row and the f32 activations:
 *   - Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K weights (random blocks with sane
 *     half scales: random_weights of testutil.h), llama-8B's shapes
 *     4096 x 4096, 14336 x 4096, 4096 x 14336, 1024 x 4096 and small ones that leave
 *     partial tiles (333 rows, 130 rows, one k-step of 256 columns, one
 *     row tile over 14336 columns), m from 1 to 512, multiples of the
 *     activation tiles and not: each output's error relative to sum |w x|
 *     stays under TOL (f16 operands, f32 accumulation);
 *   - the int8 route of the K formats (policy 2) on the same products,
 *     within TOL_CPU_INT8 of the CPU backend's own product;
 *   - the wgmma route (policy 3) where it runs (sm_90a code on a compute
 *     capability 9.0 device), within TOL and TOL_CPU, twice the same bits;
 *   - where it runs too, Q4_K by the integer wgmma kernel (policy 4),
 *     within TOL_CPU_INT8 of the CPU backend's product, twice the same
 *     bits, and timed;
 *   - where it runs too, Q4_K by rs_kernel (policy 5: f16 wgmma on weights
 *     dequantized in registers, k split over clusters), and Q6_K at least
 *     twice as wide as tall on the rs layout weight_load keeps for it (a
 *     byte a weight, cuda/matmul.cu), within TOL and
 *     TOL_CPU, twice the same bits, and timed; and the same with stream-K
 *     (policy 6: every CTA the GPU holds at once, tiles cut between CTAs
 *     and their partial tiles summed by the CTA that finishes the tile)
 *     likewise; with LUMA_MMQ_G16_TIMES, two copies of a Q4_K weight by
 *     matmul_many under policy 5 (rs_kernel, both in one launch) are timed
 *     against two rs_kernel calls (test_cuda_matmul checks the pairs'
 *     bits);
 *   - where it runs too, matmul's product on the resident f16 copy by
 *     g16_kernel (forced for every m > 8), within TOL and TOL_CPU, twice
 *     the same bits, and timed against cuBLAS on the same copy;
 *   - the same product twice gives the same bits (split-k partial tiles are
 *     summed in a fixed order);
 *   - the policy: -1 declines everything, 1 takes every supported product;
 *     types it does not cover and widths that are not whole 256-element
 *     steps are declined whatever the policy;
 *   - then a timing table for the three big shapes and m = 1 .. 512
 *     (cudaEvent, best of TIME_REPS calls queued behind a long memset,
 *     weights rotated through copies larger than L2): this kernel against
 *     matmul's own paths with mmq turned off: the matrix-vector kernels
 *     (m <= 8) or cuBLAS on the resident f16 copy, and cuBLAS after
 *     dequantizing per call. The last columns say what luma_cuda_mmq's
 *     measured rule (policy 0) picks with a resident f16 copy and without.
 * Without a CUDA device it says so and passes. LUMA_CUDA_QUICK=1 keeps to the
 * small shapes and skips the timing; LUMA_MMQ_TYPES="Q4_K,Q6_K" and
 * LUMA_MMQ_SHAPES="14336x4096" keep to those types and big shapes;
 * LUMA_MMQ_G16_TIMES=1 skips the checks and times only cuBLAS on the
 * resident copy, g16_kernel and the Q4_K wgmma kernels. */
#include "backend.h"
#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef LUMA_HAVE_CUDA
#include "testcuda.h"

/* cuda/mmq.cu's entry points for measuring, with C linkage (the backend's
 * internal header is C++). be must be a CUDA backend. */
void luma_cuda_mmq_policy(luma_backend *be, int policy);
bool luma_cuda_mmq_matmul(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y);
bool luma_cuda_mmq_has_wgmma(luma_backend *be);
void luma_cuda_g16_policy(luma_backend *be, int policy);

static const enum luma_type types[] = { LUMA_Q4_K, LUMA_Q6_K, LUMA_Q8_0, LUMA_Q5_K, LUMA_Q4_0, LUMA_Q5_0 };
#define N_TYPES (int)(sizeof types / sizeof types[0])

static const struct shape { int64_t rows, cols; int big; } shapes[] = {
    { 333, 512, 0 }, { 130, 256, 0 }, { 1000, 768, 0 }, { 128, 14336, 0 },
    { 4096, 4096, 1 }, { 14336, 4096, 1 }, { 4096, 14336, 1 }, { 1024, 4096, 1 },
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

static const int check_ms[] = { 1, 2, 3, 8, 9, 16, 17, 32, 40, 64, 100, 128, 256, 300, 512 };
#define N_CHECK_MS (int)(sizeof check_ms / sizeof check_ms[0])
static const int time_ms[] = { 1, 2, 4, 8, 16, 32, 64, 128, 256, 512 };
#define N_TIME_MS (int)(sizeof time_ms / sizeof time_ms[0])
#define M_MAX 512

/* f16 operands lose at most 2^-11 of each factor; f32 sums of up to 14336
 * products add little to that. */
#define TOL 5e-3   /* the activations' 8-bit quantization, as on the matrix-vector path */
#define TOL_CPU 2e-3   /* against the CPU backend's product: f16 rounding only */
#define TOL_CPU_INT8 1e-5   /* the int8 route: the CPU's integers, only the float sums' order differs */

#define SAMPLE_ROWS 32   /* weight rows checked per product */
#define LINE_SIZE 768    /* one shape's line of errors */
#define SAMPLE_ACTS 48   /* activation rows checked per product */
#define TIME_REPS 8
#define N_COPIES 8                            /* quantized copies timed in rotation */
#define L2_DEFEAT_BYTES ((size_t)192 << 20)   /* well over the H100's 50 MB of L2 */
#define QUEUE_BYTES ((size_t)1 << 30)         /* memset that keeps the GPU busy while calls queue */

typedef struct ctx {
    luma_backend *be;
    int quick;
    bool wg;                   /* the wgmma route runs on this device */
    void *queue;               /* QUEUE_BYTES of device memory for the memset */
    luma_buf x, y;             /* M_MAX rows of the current shape */
    luma_buf y2;               /* the second output of a pair (timing) */
} ctx;

/* The ways of computing y = W x that are timed. */
enum path { MMQ, MMQ8, MMQ_WG, MATMUL_RESIDENT, MATMUL_PER_CALL, G16, MMQ_Q8G, MMQ_RS, MMQ_RS_SK, MMQ_PAIR, N_PATHS };

/* The policy that forces each mmq route. */
static int route_policy(enum path pt)
{
    return pt == MMQ8 ? 2 : pt == MMQ_WG ? 3 : pt == MMQ_Q8G ? 4 : pt == MMQ_RS ? 5 : pt == MMQ_RS_SK ? 6 : 1;
}

/* Whether mmq has its int8 route for t (policy 2 takes it). */
static bool has_int8(enum luma_type t)
{
    return t == LUMA_Q4_K || t == LUMA_Q5_K || t == LUMA_Q6_K;
}

/* One timed (type, shape, m): microseconds per path (0: not timed) and
 * whether policy 0 takes the product, with and without an f16 copy. */
typedef struct timing {
    double us[N_PATHS];
    bool rule_res, rule_pc;
} timing;

/* ---- running one product ------------------------------------------------ */

/* y = W x for the first m rows of cx->x, by the path: 0 on success. */
static int run_path(ctx *cx, enum path pt, const luma_weight *w, int64_t m)
{
    luma_buf xv = luma_buf_rows(&cx->x, 0, m), yv = luma_buf_rows(&cx->y, 0, m);
    yv.cols = w->rows;
    if (pt == MMQ || pt == MMQ8 || pt == MMQ_WG || pt == MMQ_Q8G || pt == MMQ_RS || pt == MMQ_RS_SK) {
        luma_cuda_mmq_policy(cx->be, route_policy(pt));
        bool took = luma_cuda_mmq_matmul(cx->be, w, &xv, &yv);
        CHECKF(took, "%s %lldx%lld m=%lld: mmq declined a product it supports", luma_type_name(w->type),
               (long long)w->rows, (long long)w->cols, (long long)m);
        return took ? 0 : -1;
    }
    /* matmul without mmq; on the resident copy cuBLAS, or g16_kernel for G16 */
    luma_cuda_mmq_policy(cx->be, -1);
    luma_cuda_g16_policy(cx->be, pt == G16 ? 1 : -1);
    cx->be->ops->matmul(cx->be, w, &xv, &yv);
    luma_cuda_g16_policy(cx->be, 0);
    return 0;
}

/* Two copies of a Q4_K weight over the first m rows of cx->x by
 * matmul_many under policy 5 (rs_kernel; both in one launch where the pair
 * fits); 0 on success. */
static int run_pair(ctx *cx, const luma_weight *w, const luma_weight *w2, int64_t m)
{
    luma_buf xv = luma_buf_rows(&cx->x, 0, m), y1 = luma_buf_rows(&cx->y, 0, m), y2 = luma_buf_rows(&cx->y2, 0, m);
    const luma_weight *ws[2] = { w, w2 };
    luma_buf *ys[2] = { &y1, &y2 };
    luma_cuda_mmq_policy(cx->be, 5);
    cx->be->ops->matmul_many(cx->be, 2, ws, &xv, ys);
    luma_cuda_mmq_policy(cx->be, 0);
    return 0;
}

/* Runs the product and reads y back (m x rows floats); 0 on success. */
static int product(ctx *cx, enum path pt, const luma_weight *w, int64_t m, float *y)
{
    luma_err err = { { 0 } };
    if (run_path(cx, pt, w, m) != 0) return -1;
    if (cx->be->ops->sync(cx->be, &err) != 0) {
        CHECKF(0, "%s %lldx%lld m=%lld: %s", luma_type_name(w->type), (long long)w->rows, (long long)w->cols,
               (long long)m, err.msg);
        return -1;
    }
    luma_buf yv = luma_buf_rows(&cx->y, 0, m);
    yv.cols = w->rows;
    if (cx->be->ops->buf_read(cx->be, &yv, y, &err) != 0) {
        CHECKF(0, "buf_read: %s", err.msg);
        return -1;
    }
    return 0;
}

/* ---- timing --------------------------------------------------------------- */

/* Copies of one weight for timing in rotation: quantized copies for mmq,
 * the matrix-vector kernels and the per-call path, f16 copies (each paired
 * with a quantized one) for the resident path. */
typedef struct copies {
    luma_weight q[N_COPIES], f[N_COPIES];
    int nq, nf;
} copies;

static void copies_free(copies *cp)
{
    for (int i = 0; i < cp->nq; i++) {
        cudaFree(cp->q[i].dev);
        cudaFree(cp->q[i].dev_mmv);
    }
    for (int i = 0; i < cp->nf; i++) cudaFree(cp->f[i].dev_f16);
    cp->nq = cp->nf = 0;
}

static int copies_make(copies *cp, const luma_weight *w, size_t qbytes)
{
    size_t fbytes = (size_t)w->rows * (size_t)w->cols * 2;
    int nf = (int)((L2_DEFEAT_BYTES + fbytes - 1) / fbytes);
    if (nf > N_COPIES) nf = N_COPIES;
    memset(cp, 0, sizeof *cp);
    for (int i = 0; i < N_COPIES; i++) {
        luma_weight *c = &cp->q[i];
        *c = *w;
        c->dev = c->dev_f16 = c->dev_mmv = NULL;
        if (!cuda_ok(cudaMalloc(&c->dev, qbytes + 16), "cudaMalloc (weight copy, padded as weight_load pads)")) goto fail;
        cp->nq++;
        if (!cuda_ok(cudaMemcpy(c->dev, w->dev, qbytes, cudaMemcpyDeviceToDevice), "copy weights")) goto fail;
        size_t mmv = repacked_bytes(w);   /* Q6_K's rs layout is in it */
        if (w->dev_mmv && (!cuda_ok(cudaMalloc(&c->dev_mmv, mmv), "cudaMalloc (repacked weight copy)") ||
                           !cuda_ok(cudaMemcpy(c->dev_mmv, w->dev_mmv, mmv, cudaMemcpyDeviceToDevice), "copy repacked")))
            goto fail;
    }
    for (int i = 0; i < nf && w->dev_f16; i++) {
        luma_weight *c = &cp->f[i];
        *c = cp->q[i];
        if (!cuda_ok(cudaMalloc(&c->dev_f16, fbytes), "cudaMalloc (f16 weight copy)")) goto fail;
        cp->nf++;
        if (!cuda_ok(cudaMemcpy(c->dev_f16, w->dev_f16, fbytes, cudaMemcpyDeviceToDevice), "copy f16 weights"))
            goto fail;
    }
    return 0;
fail:
    copies_free(cp);
    return -1;
}

/* Best time of TIME_REPS calls in microseconds, 0 on failure: the calls
 * queue behind a long memset, each between two events on the legacy stream
 * (which orders itself against the backend's blocking stream), each on the
 * next copy of the weight. */
static double time_path(ctx *cx, enum path pt, const copies *cp, int64_t m)
{
    bool res = pt == MATMUL_RESIDENT || pt == G16;
    const luma_weight *ws = res ? cp->f : cp->q;
    int n = res ? cp->nf : cp->nq;
    luma_err err = { { 0 } };
    cudaEvent_t ev[2 * TIME_REPS];
    int n_ev = 0;
    double best = 0.0;
    if (n == 0) return 0.0;
    for (; n_ev < 2 * TIME_REPS; n_ev++)
        if (!cuda_ok(cudaEventCreate(&ev[n_ev]), "cudaEventCreate")) goto done;
    if ((pt == MMQ_PAIR ? run_pair(cx, &ws[0], &ws[1 % n], m) : run_path(cx, pt, &ws[0], m)) != 0 ||
        cx->be->ops->sync(cx->be, &err) != 0) {   /* grows scratch */
        CHECKF(0, "timing warm-up: %s", err.msg);
        goto done;
    }
    if (!cuda_ok(cudaMemsetAsync(cx->queue, 1, QUEUE_BYTES, 0), "queue memset")) goto done;
    for (int i = 0; i < TIME_REPS; i++) {
        cudaEventRecord(ev[2 * i], 0);
        if (pt == MMQ_PAIR) run_pair(cx, &ws[(i + 1) % n], &ws[(i + 2) % n], m);
        else run_path(cx, pt, &ws[(i + 1) % n], m);
        cudaEventRecord(ev[2 * i + 1], 0);
    }
    if (cx->be->ops->sync(cx->be, &err) != 0) {
        CHECKF(0, "timing: %s", err.msg);
        goto done;
    }
    if (!cuda_ok(cudaEventSynchronize(ev[2 * TIME_REPS - 1]), "cudaEventSynchronize")) goto done;
    for (int i = 0; i < TIME_REPS; i++) {
        float ms_ = 0.0f;
        if (!cuda_ok(cudaEventElapsedTime(&ms_, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime")) goto done;
        if (best == 0.0 || ms_ * 1e3 < best) best = ms_ * 1e3;
    }
done:
    for (int i = 0; i < n_ev; i++) cudaEventDestroy(ev[i]);
    return best;
}

/* ---- one weight matrix ---------------------------------------------------- */

/* What a product is checked against: the weight's blocks, the sampled rows
 * dequantized, the f32 activations. */
typedef struct product_ref {
    const luma_weight *w;
    const uint8_t *host;
    size_t row_bytes;
    const float *wref;
    const int64_t *rows_s;
    int ns;
    const float *x;
} product_ref;

/* Route pt (MMQ8 or MMQ_WG) on the first m activation rows into y2:
 * within TOL of the reference and tol_cpu of the CPU backend's product
 * (its error appended to line as " tag error"), and, when repeat, the same
 * bits a second time (y is then rewritten with the f16 route's product, as
 * the caller had it). -1 when a product did not run. */
static int check_route(ctx *cx, enum path pt, const char *name, const char *tag, double tol_cpu, bool repeat,
                       const product_ref *r, int64_t m, float *y, float *y2, char *line, int *len)
{
    const luma_weight *w = r->w;
    int64_t rows = w->rows, cols = w->cols;
    for (int64_t k = 0; k < m * rows; k++) y2[k] = NAN;
    if (product(cx, pt, w, m, y2) != 0) return -1;
    double e = product_rel_error(r->wref, r->rows_s, r->ns, r->x, m, cols, y2, rows, SAMPLE_ACTS);
    double ec = cpu_product_rel_error(w->type, r->host, r->row_bytes, r->wref, r->rows_s, r->ns, r->x, m, cols, y2,
                                      rows, SAMPLE_ACTS);
    CHECKF(e <= TOL && ec <= tol_cpu,
           "%s %lldx%lld m=%lld: %s route: max relative error %.3g (tol %.0e), %.3g against the CPU backend's "
           "product (tol %.0e)", luma_type_name(w->type), (long long)rows, (long long)cols, (long long)m, name, e, TOL,
           ec, tol_cpu);
    if (*len < LINE_SIZE) *len += snprintf(line + *len, LINE_SIZE - (size_t)*len, "/%s %.0e", tag, ec);
    if (!repeat) return 0;
    if (product(cx, pt, w, m, y) != 0) return -1;
    CHECKF(memcmp(y, y2, (size_t)(m * rows) * sizeof(float)) == 0,
           "%s %lldx%lld m=%lld: two runs of the same %s-route product differ", luma_type_name(w->type),
           (long long)rows, (long long)cols, (long long)m, name);
    return product(cx, MMQ, w, m, y);
}

/* Checks mmq for every m against the reference (and twice for the same
 * bits), prints one line of the largest errors, and times the big shapes. */
static void check_shape(ctx *cx, enum luma_type t, const struct shape *sh, timing tm[N_TIME_MS])
{
    const luma_backend_ops *ops = cx->be->ops;
    int64_t rows = sh->rows, cols = sh->cols;
    size_t row_bytes = luma_row_size(t, cols), bytes = row_bytes * (size_t)rows;
    luma_weight w;
    uint8_t *host = load_random_weight(cx->be, t, rows, cols, &w);
    if (!host) return;
    luma_err err = { { 0 } };
    int m_max = cx->quick ? 128 : M_MAX;
    if (ops->buf_alloc(cx->be, &cx->x, m_max, cols, &err) != 0 ||
        ops->buf_alloc(cx->be, &cx->y, m_max, rows, &err) != 0 ||
        ops->buf_alloc(cx->be, &cx->y2, m_max, rows, &err) != 0) {
        CHECKF(0, "buf_alloc: %s", err.msg);
        goto out;
    }

    int64_t rows_s[SAMPLE_ROWS];
    int ns;
    float *wref = sample_weight_rows(t, host, rows, cols, SAMPLE_ROWS, rows_s, &ns);
    float *x = xmalloc((size_t)m_max * (size_t)cols * sizeof(float));
    float *y = xmalloc((size_t)m_max * (size_t)rows * sizeof(float));
    float *y2 = xmalloc((size_t)m_max * (size_t)rows * sizeof(float));
    for (int64_t k = 0; k < m_max * cols; k++) x[k] = bell();
    if (!cuda_ok(cudaMemcpy(cx->x.data, x, (size_t)(m_max * cols) * sizeof(float), cudaMemcpyHostToDevice),
                 "upload x"))
        goto free_all;

    /* rs_kernel: Q4_K on the file's blocks, Q6_K at least twice as wide as
     * tall on the rs layout weight_load keeps in its repacked copy */
    const bool q6_rs = t == LUMA_Q6_K && cols >= 2 * rows && repacked_bytes(&w) > 0;
    CHECKF(!q6_rs || w.dev_mmv, "weight_load Q6_K %lldx%lld made no repacked copy", (long long)rows, (long long)cols);
    const bool rs = cx->wg && (t == LUMA_Q4_K || (q6_rs && w.dev_mmv));
    const product_ref ref = { &w, host, row_bytes, wref, rows_s, ns, x };
    char line[LINE_SIZE];
    int len = snprintf(line, sizeof line, "%-5s %5lldx%-5lld", luma_type_name(t), (long long)rows, (long long)cols);
    const char *g16_only = getenv("LUMA_MMQ_G16_TIMES");   /* only cuBLAS, g16 and q8g, timed: for measuring */
    for (int i = 0; i < N_CHECK_MS && !(g16_only && *g16_only); i++) {
        int64_t m = check_ms[i];
        if (m > m_max) continue;
        for (int64_t k = 0; k < m * rows; k++) y[k] = NAN;
        if (product(cx, MMQ, &w, m, y) != 0) continue;
        double e = product_rel_error(wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
        CHECKF(e <= TOL, "%s %lldx%lld m=%lld: max relative error %.3g > %.0e", luma_type_name(t), (long long)rows,
               (long long)cols, (long long)m, e, TOL);
        /* the CPU backend's product of the same quantized activations:
         * only the f16 rounding of weights and d * q stands between them */
        double ec = cpu_product_rel_error(t, host, row_bytes, wref, rows_s, ns, x, m, cols, y, rows, SAMPLE_ACTS);
        CHECKF(ec <= TOL_CPU, "%s %lldx%lld m=%lld: max error %.3g against the CPU backend's product > %.0e",
               luma_type_name(t), (long long)rows, (long long)cols, (long long)m, ec, TOL_CPU);
        if (len < (int)sizeof line)
            len += snprintf(line + len, sizeof line - (size_t)len, " %lld:%.0e/%.0e", (long long)m, e, ec);
        if (has_int8(t) && check_route(cx, MMQ8, "int8", "i8", TOL_CPU_INT8, m == 16 || m == 100, &ref, m, y, y2,
                                       line, &len) != 0)
            continue;
        if (cx->wg && check_route(cx, MMQ_WG, "wgmma", "wg", TOL_CPU, m == 100 || m == 300, &ref, m, y, y2, line,
                                  &len) != 0)
            continue;
        if (cx->wg && t == LUMA_Q4_K &&
            check_route(cx, MMQ_Q8G, "int8 wgmma", "q8g", TOL_CPU_INT8, m == 17 || m == 100 || m == 300, &ref, m, y,
                        y2, line, &len) != 0)
            continue;
        if (rs &&
            check_route(cx, MMQ_RS, "f16 wgmma from registers", "rs", TOL_CPU, m == 17 || m == 100 || m == 300,
                        &ref, m, y, y2, line, &len) != 0)
            continue;
        if (rs &&
            check_route(cx, MMQ_RS_SK, "f16 wgmma from registers, stream-K", "sk", TOL_CPU,
                        m == 17 || m == 64 || m == 128 || m == 300, &ref, m, y, y2, line, &len) != 0)
            continue;
        if (cx->wg && m > 8 && w.dev_f16 &&
            check_route(cx, G16, "f16 wgmma", "g16", TOL_CPU, m == 17 || m == 100 || m == 300, &ref, m, y, y2, line,
                        &len) != 0)
            continue;
        if (m != 16 && m != 100) continue;
        if (product(cx, MMQ, &w, m, y2) != 0) continue;
        CHECKF(memcmp(y, y2, (size_t)(m * rows) * sizeof(float)) == 0,
               "%s %lldx%lld m=%lld: two runs of the same product differ", luma_type_name(t), (long long)rows,
               (long long)cols, (long long)m);
    }
    printf("%s  (m:error/against the CPU's product, tol %.0e/%.0e)\n", line, TOL, TOL_CPU);

    if (sh->big && !cx->quick) {
        copies cp;
        if (copies_make(&cp, &w, bytes) == 0) {
            for (int i = 0; i < N_TIME_MS; i++) {
                int64_t m = time_ms[i];
                if (g16_only && *g16_only) {
                    tm[i].us[MATMUL_RESIDENT] = time_path(cx, MATMUL_RESIDENT, &cp, m);
                    tm[i].us[G16] = cx->wg && m > 8 ? time_path(cx, G16, &cp, m) : 0.0;
                    tm[i].us[MMQ_Q8G] = cx->wg && t == LUMA_Q4_K && m > 8 ? time_path(cx, MMQ_Q8G, &cp, m) : 0.0;
                    tm[i].us[MMQ_RS] = rs && m > 8 ? time_path(cx, MMQ_RS, &cp, m) : 0.0;
                    tm[i].us[MMQ_RS_SK] = rs && m > 8 ? time_path(cx, MMQ_RS_SK, &cp, m) : 0.0;
                    tm[i].us[MMQ_PAIR] = rs && t == LUMA_Q4_K && m > 8 ? time_path(cx, MMQ_PAIR, &cp, m) : 0.0;
                    continue;
                }
                tm[i].us[MMQ] = time_path(cx, MMQ, &cp, m);
                tm[i].us[MMQ8] = has_int8(t) && m > 1 ? time_path(cx, MMQ8, &cp, m) : 0.0;
                tm[i].us[MMQ_WG] = cx->wg && m > 8 ? time_path(cx, MMQ_WG, &cp, m) : 0.0;
                tm[i].us[MATMUL_RESIDENT] = time_path(cx, MATMUL_RESIDENT, &cp, m);
                tm[i].us[MATMUL_PER_CALL] = m > 8 ? time_path(cx, MATMUL_PER_CALL, &cp, m) : 0.0;
                tm[i].us[G16] = cx->wg && m > 8 ? time_path(cx, G16, &cp, m) : 0.0;
                tm[i].us[MMQ_Q8G] = cx->wg && t == LUMA_Q4_K && m > 8 ? time_path(cx, MMQ_Q8G, &cp, m) : 0.0;
                tm[i].us[MMQ_RS] = rs && m > 8 ? time_path(cx, MMQ_RS, &cp, m) : 0.0;
                tm[i].us[MMQ_RS_SK] = rs && m > 8 ? time_path(cx, MMQ_RS_SK, &cp, m) : 0.0;
                luma_buf xv = luma_buf_rows(&cx->x, 0, m), yv = luma_buf_rows(&cx->y, 0, m);
                luma_weight per_call = w;
                per_call.dev_f16 = NULL;
                luma_cuda_mmq_policy(cx->be, 0);
                tm[i].rule_res = luma_cuda_mmq_matmul(cx->be, &w, &xv, &yv);
                tm[i].rule_pc = luma_cuda_mmq_matmul(cx->be, &per_call, &xv, &yv);
                if (ops->sync(cx->be, &err) != 0) CHECKF(0, "policy 0: %s", err.msg);
            }
            copies_free(&cp);
        }
    }
free_all:
    free(x);
    free(y);
    free(y2);
    free(wref);
out:
    if (cx->x.data) ops->buf_free(cx->be, &cx->x);
    if (cx->y.data) ops->buf_free(cx->be, &cx->y);
    if (cx->y2.data) ops->buf_free(cx->be, &cx->y2);
    memset(&cx->x, 0, sizeof cx->x);
    memset(&cx->y, 0, sizeof cx->y);
    memset(&cx->y2, 0, sizeof cx->y2);
    free(host);
}

/* The policy: -1 declines, 1 takes what mmq supports; unsupported types and
 * widths are declined. The weights are never multiplied (m = 16 rows of
 * a buffer that is never read). */
static void check_policy(ctx *cx)
{
    const luma_backend_ops *ops = cx->be->ops;
    struct { enum luma_type t; int64_t cols; bool supported; } cases[] = {
        { LUMA_Q4_K, 512, true }, { LUMA_Q8_0, 640, false }, { LUMA_Q2_K, 512, false },
        { LUMA_Q4_1, 512, false }, { LUMA_F16, 512, false },
    };
    luma_err err = { { 0 } };
    int n = (int)(sizeof cases / sizeof cases[0]), checked = 0;
    for (int i = 0; i < n; i++) {
        int64_t rows = 64, cols = cases[i].cols;
        luma_weight w;
        uint8_t *host = load_random_weight(cx->be, cases[i].t, rows, cols, &w);
        if (!host) continue;
        luma_buf xb = { 0 }, yb = { 0 };
        if (ops->buf_alloc(cx->be, &xb, 16, cols, &err) != 0 || ops->buf_alloc(cx->be, &yb, 16, rows, &err) != 0) {
            CHECKF(0, "policy check setup: %s", err.msg);
        } else {
            cudaMemset(xb.data, 0, (size_t)(16 * cols) * sizeof(float));
            luma_cuda_mmq_policy(cx->be, -1);
            CHECKF(!luma_cuda_mmq_matmul(cx->be, &w, &xb, &yb), "policy -1 took a %s product",
                   luma_type_name(cases[i].t));
            luma_cuda_mmq_policy(cx->be, 1);
            bool took = luma_cuda_mmq_matmul(cx->be, &w, &xb, &yb);
            CHECKF(took == cases[i].supported, "policy 1 %s a %s product of %lld columns",
                   took ? "took" : "declined", luma_type_name(cases[i].t), (long long)cols);
            if (ops->sync(cx->be, &err) != 0) CHECKF(0, "policy check: %s", err.msg);
            checked++;
        }
        if (xb.data) ops->buf_free(cx->be, &xb);
        if (yb.data) ops->buf_free(cx->be, &yb);
        free(host);
    }
    luma_cuda_mmq_policy(cx->be, 0);
    printf("policy: %d cases checked\n", checked);
}

static void print_timing(enum luma_type t, const struct shape *sh, int64_t m, const timing *tm)
{
    double flop = 2.0 * (double)m * (double)sh->rows * (double)sh->cols;
    double qbytes = (double)(luma_row_size(t, sh->cols) * (size_t)sh->rows);
    double fbytes = 2.0 * (double)sh->rows * (double)sh->cols;
    const double *us = tm->us;
    double res_bytes = m <= 8 ? qbytes : fbytes;
    printf("%-5s %5lldx%-5lld %4lld | %8.1f %6.1f %6.0f | %8.1f %6.1f %6.0f |", luma_type_name(t),
           (long long)sh->rows, (long long)sh->cols, (long long)m, us[MMQ], us[MMQ] > 0 ? flop / (us[MMQ] * 1e6) : 0.0,
           us[MMQ] > 0 ? qbytes / (us[MMQ] * 1e3) : 0.0, us[MATMUL_RESIDENT],
           us[MATMUL_RESIDENT] > 0 ? flop / (us[MATMUL_RESIDENT] * 1e6) : 0.0,
           us[MATMUL_RESIDENT] > 0 ? res_bytes / (us[MATMUL_RESIDENT] * 1e3) : 0.0);
    if (us[MATMUL_PER_CALL] > 0)
        printf(" %8.1f %6.1f |", us[MATMUL_PER_CALL], flop / (us[MATMUL_PER_CALL] * 1e6));
    else
        printf(" %8s %6s |", "-", "-");
    if (us[MMQ8] > 0)
        printf(" %7.1f %6.1f %6.0f |", us[MMQ8], flop / (us[MMQ8] * 1e6), qbytes / (us[MMQ8] * 1e3));
    else
        printf(" %7s %6s %6s |", "-", "-", "-");
    if (us[MMQ_WG] > 0)
        printf(" %7.1f %6.1f %6.0f |", us[MMQ_WG], flop / (us[MMQ_WG] * 1e6), qbytes / (us[MMQ_WG] * 1e3));
    else
        printf(" %7s %6s %6s |", "-", "-", "-");
    if (us[G16] > 0)
        printf(" %7.1f %6.1f %6.0f %5.2fx |", us[G16], flop / (us[G16] * 1e6), fbytes / (us[G16] * 1e3),
               us[MATMUL_RESIDENT] / us[G16]);
    else
        printf(" %7s %6s %6s %6s |", "-", "-", "-", "-");
    if (us[MMQ_Q8G] > 0)
        printf(" %7.1f %6.1f %6.0f %5.2fx |", us[MMQ_Q8G], flop / (us[MMQ_Q8G] * 1e6), qbytes / (us[MMQ_Q8G] * 1e3),
               us[MATMUL_RESIDENT] / us[MMQ_Q8G]);
    else
        printf(" %7s %6s %6s %6s |", "-", "-", "-", "-");
    for (int pt = MMQ_RS; pt <= MMQ_RS_SK; pt++)
        if (us[pt] > 0)
            printf(" %7.1f %6.1f %6.0f %5.2fx |", us[pt], flop / (us[pt] * 1e6), qbytes / (us[pt] * 1e3),
                   us[MATMUL_RESIDENT] / us[pt]);
        else
            printf(" %7s %6s %6s %6s |", "-", "-", "-", "-");
    if (us[MMQ_PAIR] > 0 && us[MMQ_RS] > 0)   /* two weights: against two rs_kernel calls */
        printf(" %7.1f %5.2fx |", us[MMQ_PAIR], 2.0 * us[MMQ_RS] / us[MMQ_PAIR]);
    else
        printf(" %7s %6s |", "-", "-");
    double vs_res = us[MMQ] > 0 ? us[MATMUL_RESIDENT] / us[MMQ] : 0.0;
    double vs_pc = us[MMQ] > 0 && us[MATMUL_PER_CALL] > 0 ? us[MATMUL_PER_CALL] / us[MMQ] : 0.0;
    printf(" %5.2fx %-4s", vs_res, vs_res > 1.0 ? "mmq" : m <= 8 ? "mmv" : "cuBLAS");
    if (vs_pc > 0) printf(" %5.2fx %-6s", vs_pc, vs_pc > 1.0 ? "mmq" : "cuBLAS");
    else printf(" %6s %-6s", "-", "");
    printf(" %-3s %s\n", tm->rule_res ? "mmq" : "-", tm->rule_pc ? "mmq" : "-");
}

static const char *shape_name(const struct shape *sh)
{
    static char name[48];
    snprintf(name, sizeof name, "%lldx%lld", (long long)sh->rows, (long long)sh->cols);
    return name;
}

static int run_checks(void)
{
    luma_err err = { { 0 } };
    ctx cx = { 0 };
    const char *q = getenv("LUMA_CUDA_QUICK");
    cx.quick = q && *q && strcmp(q, "0") != 0;
    cx.be = luma_backend_cuda_new(0, &err);
    if (!cx.be) {
        printf("test_cuda_mmq: FAIL: a CUDA device is present but the backend did not start: %s\n", err.msg);
        return 1;
    }
    if (!cx.quick && !cuda_ok(cudaMalloc(&cx.queue, QUEUE_BYTES), "cudaMalloc (queue)")) cx.quick = 1;

    cx.wg = luma_cuda_mmq_has_wgmma(cx.be);
    printf("wgmma route: %s\n", cx.wg ? "runs here (checked and timed)" : "not on this device or build: not checked");
    check_policy(&cx);
    static timing tms[N_TYPES][N_SHAPES][N_TIME_MS];
    int checked = 0;
    const char *only = getenv("LUMA_MMQ_TYPES");         /* "Q4_K,Q6_K": only these, for measuring */
    const char *only_shape = getenv("LUMA_MMQ_SHAPES");  /* "14336x4096": likewise */
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int si = 0; si < N_SHAPES; si++) {
            if (cx.quick && shapes[si].big) continue;
            if (only && *only && !strstr(only, luma_type_name(types[ti]))) continue;
            if (only_shape && *only_shape && !strstr(only_shape, shape_name(&shapes[si]))) continue;
            check_shape(&cx, types[ti], &shapes[si], tms[ti][si]);
            checked++;
        }
    printf("mmq: %d weight matrices checked%s\n", checked, cx.quick ? " (quick: small shapes only)" : "");

    if (!cx.quick) {
        printf("\ntiming (best of %d, weights cold in L2): microseconds, TFLOP/s, GB/s of the weights each path "
               "reads\n", TIME_REPS);
        printf("type  shape          m |      mmq: us TFLOP/s  GB/s | matmul resident f16 (mmv for m <= 8): us "
               "TFLOP/s GB/s | per call: us TFLOP/s | int8 route: us TFLOP/s GB/s | wgmma route: us TFLOP/s GB/s | f16 wgmma on the copy: us TFLOP/s GB/s vs cuBLAS | Q4_K int8 wgmma: us TFLOP/s GB/s vs cuBLAS | Q4_K f16 wgmma from registers: us TFLOP/s GB/s vs cuBLAS | the same, stream-K | Q4_K: two weights of one x in one launch (matmul_many): us, vs two | mmq vs resident | vs per call | rule: resident, per call\n");
        for (int ti = 0; ti < N_TYPES; ti++)
            for (int si = 0; si < N_SHAPES; si++)
                if (shapes[si].big && !(only && *only && !strstr(only, luma_type_name(types[ti]))) &&
                    !(only_shape && *only_shape && !strstr(only_shape, shape_name(&shapes[si]))))
                    for (int i = 0; i < N_TIME_MS; i++)
                        print_timing(types[ti], &shapes[si], time_ms[i], &tms[ti][si][i]);
    }
    if (cx.queue) cudaFree(cx.queue);
    cx.be->ops->free(cx.be);
    return 0;
}

#endif

int main(void)
{
    rnd_seed(0x13198a2e03707344ULL);
    if (!luma_backend_cuda_available()) {
        printf("test_cuda_mmq: no CUDA device, the GPU checks did not run\n");
        return 0;
    }
#ifdef LUMA_HAVE_CUDA
    if (run_checks() != 0) return 1;
#else
    printf("test_cuda_mmq: FAIL: the library has a CUDA backend but this test was compiled without LUMA_HAVE_CUDA\n");
    return 1;
#endif
    if (failures) {
        printf("test_cuda_mmq: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_mmq: all checks passed\n");
    return 0;
}
