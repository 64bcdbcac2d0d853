/* The CUDA backend (cuda/) against the CPU backend (src/cpu/backend.c), op by
 * op on random inputs, then on the default model:
 *   - embed of every block format equals the CPU's rows bit for bit (random
 *     blocks with sane half scales: random_weights of testutil.h), times a
 *     scale;
 *   - rmsnorm (whole rows, per-head groups, in place, unaligned rows), qk_rope
 *     (per-head norms and RoPE of q and k in one launch), qkv_bias_rope
 *     (qwen2's biases of q, k and v and RoPE of q and k in one launch, also
 *     bit for bit against the GPU's add_bias and qk_rope), rope
 *     NORM and NEOX (partial rotation, linear position scaling, frequency
 *     factors), add_bias, add, gelu_mul (through half precision, as the
 *     CPU's), silu_mul and gather: the largest error relative to the largest
 *     reference value stays under each op's tolerance (0 for the exact ones);
 *   - attention over the paged KV cache, each backend through its own
 *     kv_alloc and the same luma_kv block tables: gemma's shape (4 heads over
 *     1 kv head of 256, two pools, window 512), llama's (32 over 8 of 128),
 *     an odd one (14 over 2, keys of 96, values of 80, softcap), heads of 64
 *     without grouping and 16 heads over 2 of 128 with a softcap (groups 1,
 *     4 and 8 of dimensions 64, 128 and 256 for the tensor-core prefill), F16
 *     and F32 caches; decode steps at contexts up to ~3000 (split over the
 *     keys), a long prefill chunk (300 rows: not a whole number of 64-row
 *     tiles), three sequences prefilling together (70, 129 and 8 rows, the
 *     first at ~3000 keys) and a mixed step, with window 0 and 512. The
 *     tensor-core prefill rounds q and the softmax weights to f16: its steps
 *     are held to 2e-3 (numpy's model of that rounding gives 2e-4 to 7e-4
 *     on these shapes), the f32 kernels to 1e-4 (F16 cache) and 2e-5 (F32);
 *     the F16 shapes of heads of 64 and 128 again with every decode row on
 *     decode_lean_kernel (the kernel the defaults give many short rows),
 *     and every shape's three decode rows on decode_kernel, their splits
 *     merged by the last split and by combine_kernel;
 *   - decode steps on the 7B llama shape and gemma's (F16 cache): 32 and
 *     128 rows of 128 to 512 keys, 128 rows of 600 to 1100 keys under a
 *     window of 512 (gemma), rows past the lean kernel's reach at many
 *     units (40 rows of 2100 to 2600 keys, llama; 160 of 1100 to 1400,
 *     gemma), one row of 4096 and one of 32768 keys; each
 *     against the CPU, then timed at the bandwidth of its K and V reads;
 *   - a 4096-row causal prefill on the 7B llama shape (32 heads over 8 of
 *     128) and on gemma's, each timed on the CUDA-core and the tensor-core
 *     kernel (LUMA_CUDA_ATTN_PREFILL=cores), the two outputs compared;
 *   - a failure inside a step (ids that are not the step's) comes back from
 *     sync as a message and the backend keeps working;
 *   - the default model on both backends: the logits of a 64-token prompt
 *     (top-1 agreement, max abs diff) and a 32-token greedy continuation,
 *     identical or parting only at a near tie (CPU margin < 0.3).
 * Ends with a table: op, max relative error, tolerance, and for the big
 * shapes the GPU time per call (cudaEvent, calls queued behind a long memset
 * so launch gaps are not timed) with the bandwidth it implies.
 * Built with the CUDA backend only; without a device it says so and passes.
 * LUMA_CUDA_QUICK=1 runs smaller cases and neither the model nor the timings
 * (for compute-sanitizer); LUMA_CUDA_ONLY=attention runs the attention
 * checks and timings alone, LUMA_CUDA_ONLY=prefill-timing the prefill
 * timings alone (for a profiler), LUMA_CUDA_ONLY=decode-timing the decode
 * cases below alone. */
#define _POSIX_C_SOURCE 200809L   /* setenv */
#include "backend.h"
#include "kv.h"
#include "model.h"
#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Built only with the CUDA backend, whose link dependencies bring the
 * runtime's headers. */
#include "testcuda.h"

static int quick;
static luma_backend *cpu, *gpu;

/* ---- random data -------------------------------------------------------- */

static float *random_floats(size_t n, float scale)
{
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * gaussian();
    return x;
}

/* ---- results ------------------------------------------------------------ */

typedef struct result {
    char op[80];
    double err, tol;
    double us, gbps;           /* GPU time per call and bandwidth; 0: not timed */
} result;

static result results[200];
static int n_results;

static void report(const char *op, double err, double tol)
{
    bool ok = err <= tol;      /* false for NaN */
    if (!ok) failures++;
    printf("%-40s max rel err %.2e (tol %.0e)%s\n", op, err, tol, ok ? "" : "  FAIL");
    if (n_results < (int)(sizeof results / sizeof results[0])) {
        result *r = &results[n_results++];
        snprintf(r->op, sizeof r->op, "%s", op);
        r->err = err;
        r->tol = tol;
        r->us = r->gbps = 0.0;
    }
}

/* max |a - b| / max |b|; infinite when a is not finite where b is. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) && isfinite(b[i])) return INFINITY;
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > num) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return den > 0.0 ? num / den : num;
}

/* ---- the same data on both backends ------------------------------------- */

typedef struct dual {
    luma_buf c, g;
} dual;

static void dual_new(dual *d, int64_t rows, int64_t cols)
{
    luma_err err = { { 0 } };
    if (cpu->ops->buf_alloc(cpu, &d->c, rows, cols, &err) != 0 ||
        gpu->ops->buf_alloc(gpu, &d->g, rows, cols, &err) != 0) {
        printf("test_cuda: buf_alloc %lld x %lld: %s\n", (long long)rows, (long long)cols, err.msg);
        exit(1);
    }
}

static void dual_free(dual *d)
{
    cpu->ops->buf_free(cpu, &d->c);
    gpu->ops->buf_free(gpu, &d->g);
}

/* Fills the buffers' rows x cols with x. */
static void dual_set(dual *d, const float *x)
{
    size_t bytes = (size_t)(d->c.rows * d->c.cols) * sizeof(float);
    memcpy(d->c.data, x, bytes);
    cuda_ok(cudaMemcpy(d->g.data, x, bytes, cudaMemcpyHostToDevice), "upload");
}

/* Both views of rows [r0, r0 + n). */
static dual dual_rows(const dual *d, int64_t r0, int64_t n)
{
    dual v = { luma_buf_rows(&d->c, r0, n), luma_buf_rows(&d->g, r0, n) };
    return v;
}

/* The GPU's result against the CPU's; a read failure counts as infinite. */
static double dual_err(const dual *d)
{
    luma_err err = { { 0 } };
    if (d->c.rows != d->g.rows || d->c.cols != d->g.cols) {
        CHECKF(0, "shapes differ: cpu %lld x %lld, gpu %lld x %lld", (long long)d->c.rows, (long long)d->c.cols,
               (long long)d->g.rows, (long long)d->g.cols);
        return INFINITY;
    }
    size_t n = (size_t)(d->c.rows * d->c.cols);
    float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
    double e = INFINITY;
    if (cpu->ops->buf_read(cpu, &d->c, b, &err) != 0 || gpu->ops->buf_read(gpu, &d->g, a, &err) != 0)
        CHECKF(0, "buf_read: %s", err.msg);
    else
        e = rel_err(a, b, n);
    free(a);
    free(b);
    return e;
}

typedef struct dual_w {
    luma_weight c, g;
} dual_w;

static bool dual_weight(dual_w *w, enum luma_type t, int64_t rows, int64_t cols, const void *host)
{
    luma_err err = { { 0 } };
    luma_weight x = { .type = t, .rows = rows, .cols = cols, .host = host };
    w->c = w->g = x;
    if (cpu->ops->weight_load(cpu, &w->c, &err) != 0 || gpu->ops->weight_load(gpu, &w->g, &err) != 0) {
        CHECKF(0, "weight_load %s %lld x %lld: %s", luma_type_name(t), (long long)rows, (long long)cols, err.msg);
        return false;
    }
    return true;
}

/* A step: rows of sequences with tokens, positions, out rows, block tables. */
typedef struct tstep {
    luma_step s;
    luma_step_seq seqs[4];
    int32_t *tokens, *pos, *out_rows;
} tstep;

/* One sequence of n rows at positions pos (or 0, 1, ...), tokens ids (or 0). */
static void step_simple(tstep *t, int32_t n, const int32_t *ids, const int32_t *pos, const int32_t *out,
                        int32_t n_out)
{
    memset(t, 0, sizeof *t);
    t->tokens = xmalloc((size_t)n * sizeof(int32_t));
    t->pos = xmalloc((size_t)n * sizeof(int32_t));
    t->out_rows = xmalloc((size_t)(n_out > 0 ? n_out : 1) * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) {
        t->tokens[i] = ids ? ids[i] : 0;
        t->pos[i] = pos ? pos[i] : i;
    }
    for (int32_t i = 0; i < n_out; i++) t->out_rows[i] = out[i];
    t->seqs[0].n_rows = n;
    t->s = (luma_step){ .n_rows = n, .tokens = t->tokens, .pos = t->pos, .n_seqs = 1, .seqs = t->seqs,
                        .n_out = n_out, .out_rows = t->out_rows };
}

static void step_free(tstep *t)
{
    free(t->tokens);
    free(t->pos);
    free(t->out_rows);
}

static bool step_begin(tstep *t)
{
    luma_err err = { { 0 } };
    if (gpu->ops->step_begin(gpu, &t->s, &err) != 0) {
        CHECKF(0, "step_begin: %s", err.msg);
        return false;
    }
    return true;
}

static bool gpu_sync(const char *what)
{
    luma_err err = { { 0 } };
    if (gpu->ops->sync(gpu, &err) != 0) {
        CHECKF(0, "%s: %s", what, err.msg);
        return false;
    }
    return true;
}

/* ---- timing ------------------------------------------------------------- */

#define TIME_REPS 10
#define QUEUE_BYTES ((size_t)512 << 20)

static void *queue_mem;

typedef void (*gpu_call)(void *ctx);

/* Best GPU time of one call, in microseconds; the calls wait behind a memset
 * of QUEUE_BYTES so that they are all queued before the first one runs. */
static double gpu_us(gpu_call call, void *ctx)
{
    cudaEvent_t ev[2 * TIME_REPS];
    int n_ev = 0;
    double best = 0.0;
    for (; n_ev < 2 * TIME_REPS; n_ev++)
        if (!cuda_ok(cudaEventCreate(&ev[n_ev]), "cudaEventCreate")) goto done;
    call(ctx);
    if (!gpu_sync("timing warm-up")) goto done;
    if (!cuda_ok(cudaMemsetAsync(queue_mem, 1, QUEUE_BYTES, 0), "queue memset")) goto done;
    for (int i = 0; i < TIME_REPS; i++) {
        cudaEventRecord(ev[2 * i], 0);
        call(ctx);
        cudaEventRecord(ev[2 * i + 1], 0);
    }
    if (!gpu_sync("timing") || !cuda_ok(cudaEventSynchronize(ev[2 * TIME_REPS - 1]), "cudaEventSynchronize"))
        goto done;
    for (int i = 0; i < TIME_REPS; i++) {
        float ms = 0.0f;
        if (!cuda_ok(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime")) goto done;
        if (best == 0.0 || ms * 1e3 < best) best = ms * 1e3;
    }
done:
    for (int i = 0; i < n_ev; i++) cudaEventDestroy(ev[i]);
    return best;
}

/* Times call and attaches the time (and bytes / time) to the last result. */
static void timed(gpu_call call, void *ctx, double bytes)
{
    if (quick || n_results == 0) return;
    result *r = &results[n_results - 1];
    r->us = gpu_us(call, ctx);
    r->gbps = r->us > 0.0 ? bytes / (r->us * 1e3) : 0.0;
}

/* ---- embed -------------------------------------------------------------- */

static void test_embed(void)
{
    static const enum luma_type types[] = {
        LUMA_F32, LUMA_F16, LUMA_BF16, LUMA_Q4_0, LUMA_Q4_1, LUMA_Q5_0, LUMA_Q5_1, LUMA_Q8_0,
        LUMA_Q2_K, LUMA_Q3_K, LUMA_Q4_K, LUMA_Q5_K, LUMA_Q6_K,
    };
    const int64_t rows = 48, cols = 512;
    const int32_t n = 20;
    int32_t ids[20];
    for (int32_t i = 0; i < n; i++) ids[i] = (int32_t)(rnd() % (uint64_t)rows);
    ids[0] = 0;
    ids[1] = (int32_t)rows - 1;
    tstep t;
    step_simple(&t, n, ids, NULL, NULL, 0);
    dual x;
    dual_new(&x, n, cols);
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        enum luma_type ty = types[k];
        size_t rs = luma_row_size(ty, cols);
        uint8_t *table = xmalloc(rs * (size_t)rows);
        for (int64_t r = 0; r < rows; r++) random_weights(ty, cols, table + (size_t)r * rs);
        dual_w w;
        char name[48];
        snprintf(name, sizeof name, "embed %s", luma_type_name(ty));
        if (dual_weight(&w, ty, rows, cols, table) && step_begin(&t)) {
            cpu->ops->embed(cpu, &w.c, t.tokens, n, 0.75f, &x.c);
            gpu->ops->embed(gpu, &w.g, t.tokens, n, 0.75f, &x.g);
            report(name, dual_err(&x), 0.0);
        }
        free(table);
    }
    dual_free(&x);
    step_free(&t);
}

/* ---- rmsnorm ------------------------------------------------------------ */

typedef struct norm_ctx {
    dual *x;
    dual_w *g;
    int64_t group;
} norm_ctx;

static void norm_call(void *p)
{
    norm_ctx *c = p;
    gpu->ops->rmsnorm(gpu, &c->x->g, &c->g->g, c->group, 1e-6f, &c->x->g);
}

static void test_rmsnorm(void)
{
    static const struct { int64_t rows, cols, group; int in_place, offset, timed; const char *what; } cases[] = {
        { 7, 640, 640, 0, 0, 0, "rows of 640" },
        { 33, 1024, 256, 1, 0, 0, "heads of 256, in place" },
        { 5, 4096, 128, 0, 0, 0, "heads of 128" },
        { 3, 2560, 2560, 0, 0, 0, "rows of 2560" },
        { 6, 90, 45, 0, 1, 0, "groups of 45, unaligned" },
        { 1, 640, 640, 1, 0, 0, "a row of 640, in place" },
        { 3, 1152, 1152, 1, 0, 0, "rows of 1152, in place" },
        { 4, 90, 90, 0, 1, 0, "rows of 90, unaligned" },
        { 512, 4096, 4096, 1, 0, 1, "512 rows of 4096" },
        { 512, 4096, 128, 1, 0, 1, "512 x 32 heads of 128" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int64_t rows = cases[k].rows, cols = cases[k].cols, group = cases[k].group, r0 = cases[k].offset;
        if (quick && rows > 64) continue;
        float *x = random_floats((size_t)((rows + r0) * cols), 2.0f), *gain = xmalloc((size_t)group * sizeof(float));
        for (int64_t i = 0; i < group; i++) gain[i] = 1.0f + 0.5f * gaussian();
        dual xb, ob;
        dual_new(&xb, rows + r0, cols);
        dual_new(&ob, rows + r0, cols);
        dual_set(&xb, x);
        dual_w g;
        if (dual_weight(&g, LUMA_F32, 1, group, gain)) {
            dual xv = dual_rows(&xb, r0, rows), ov = cases[k].in_place ? xv : dual_rows(&ob, r0, rows);
            cpu->ops->rmsnorm(cpu, &xv.c, &g.c, group, 1e-6f, &ov.c);
            gpu->ops->rmsnorm(gpu, &xv.g, &g.g, group, 1e-6f, &ov.g);
            char name[48];
            snprintf(name, sizeof name, "rmsnorm %s", cases[k].what);
            report(name, dual_err(&ov), 1e-5);
            if (cases[k].timed) {
                norm_ctx c = { &xv, &g, group };
                timed(norm_call, &c, 2.0 * (double)(rows * cols) * 4.0);
            }
        }
        dual_free(&xb);
        dual_free(&ob);
        free(x);
        free(gain);
    }
}

/* ---- add_rmsnorm: the fused residual add and norm ----------------------- */

/* add_rmsnorm again on the same x and y through its loop kernel
 * (LUMA_CUDA_NORM_REGS=0): x and out must be the same bits as the kernel
 * that keeps the row in registers (up to 8192 columns) gave. */
static void add_rmsnorm_bits(const float *x, const float *y, int64_t rows, int64_t cols, const dual *xb,
                             const dual *ob, const luma_weight *yg, const luma_weight *g)
{
    luma_err err = { { 0 } };
    size_t n = (size_t)(rows * cols);
    dual sx, sy, so;
    dual_new(&sx, rows, cols);
    dual_new(&sy, rows, cols);
    dual_new(&so, rows, cols);
    dual_set(&sx, x);
    dual_set(&sy, y);
    setenv("LUMA_CUDA_NORM_REGS", "0", 1);
    gpu->ops->add_rmsnorm(gpu, &sx.g, &sy.g, yg, g, 1e-6f, &so.g);
    unsetenv("LUMA_CUDA_NORM_REGS");
    float *a = xmalloc(2 * n * sizeof(float)), *b = xmalloc(2 * n * sizeof(float));
    if (gpu->ops->buf_read(gpu, &sx.g, a, &err) != 0 || gpu->ops->buf_read(gpu, &so.g, a + n, &err) != 0 ||
        gpu->ops->buf_read(gpu, &xb->g, b, &err) != 0 || gpu->ops->buf_read(gpu, &ob->g, b + n, &err) != 0) {
        CHECKF(0, "buf_read: %s", err.msg);
    } else {
        CHECKF(memcmp(a, b, 2 * n * sizeof(float)) == 0, "add_rmsnorm %lldx%lld%s: the two kernels differ in bits",
               (long long)rows, (long long)cols, yg ? " post-norm" : "");
    }
    free(a);
    free(b);
    dual_free(&sx);
    dual_free(&sy);
    dual_free(&so);
}

/* Against the CPU's separate operations: y normalized with gain yg (or not),
 * added to x, x normalized with gain g into out. */
static void test_add_rmsnorm(void)
{
    static const struct { int64_t rows, cols; int post_norm; } cases[] = {
        { 7, 640, 1 }, { 7, 640, 0 }, { 9, 4096, 0 }, { 5, 4096, 1 }, { 3, 90, 1 }, { 130, 2048, 0 },
        { 1, 4096, 0 }, { 2, 8192, 0 }, { 3, 6144, 1 }, { 2, 10240, 0 }, { 2, 12288, 1 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int64_t rows = cases[k].rows, cols = cases[k].cols;
        float *x = random_floats((size_t)(rows * cols), 2.0f), *y = random_floats((size_t)(rows * cols), 3.0f);
        float *gains = xmalloc((size_t)(2 * cols) * sizeof(float));
        for (int64_t i = 0; i < 2 * cols; i++) gains[i] = 1.0f + 0.5f * gaussian();
        dual xb, yb, ob;
        dual_new(&xb, rows, cols);
        dual_new(&yb, rows, cols);
        dual_new(&ob, rows, cols);
        dual_set(&xb, x);
        dual_set(&yb, y);
        dual_w g, yg;
        if (dual_weight(&g, LUMA_F32, 1, cols, gains) && dual_weight(&yg, LUMA_F32, 1, cols, gains + cols)) {
            bool post = cases[k].post_norm;
            if (post) cpu->ops->rmsnorm(cpu, &yb.c, &yg.c, cols, 1e-6f, &yb.c);
            cpu->ops->add(cpu, &xb.c, &yb.c);
            cpu->ops->rmsnorm(cpu, &xb.c, &g.c, cols, 1e-6f, &ob.c);
            gpu->ops->add_rmsnorm(gpu, &xb.g, &yb.g, post ? &yg.g : NULL, &g.g, 1e-6f, &ob.g);
            char name[48];
            snprintf(name, sizeof name, "add_rmsnorm %lldx%lld%s (x)", (long long)rows, (long long)cols,
                     post ? " post-norm" : "");
            report(name, dual_err(&xb), 1e-5);
            snprintf(name, sizeof name, "add_rmsnorm %lldx%lld%s (out)", (long long)rows, (long long)cols,
                     post ? " post-norm" : "");
            report(name, dual_err(&ob), 1e-5);
            if (cols % 4 == 0 && cols <= 8192) add_rmsnorm_bits(x, y, rows, cols, &xb, &ob, post ? &yg.g : NULL, &g.g);
        }
        dual_free(&xb);
        dual_free(&yb);
        dual_free(&ob);
        free(x);
        free(y);
        free(gains);
    }
}

/* ---- rope --------------------------------------------------------------- */

typedef struct rope_ctx {
    dual *x;
    int32_t head_dim;
    const int32_t *pos;
    const luma_rope *r;
} rope_ctx;

static void rope_call(void *p)
{
    rope_ctx *c = p;
    gpu->ops->rope(gpu, &c->x->g, c->head_dim, c->pos, c->r);
}

static void test_rope(void)
{
    static const struct {
        int32_t rows, head_dim, heads, n_dims;
        enum luma_rope_kind kind;
        float base, pos_scale;
        int freq_factors, timed;
        const char *what;
    } cases[] = {
        { 20, 256, 4, 256, LUMA_ROPE_NEOX, 1e6f, 1.0f, 0, 0, "NEOX 4 x 256 (gemma)" },
        { 20, 128, 8, 128, LUMA_ROPE_NORM, 5e5f, 1.0f, 1, 0, "NORM 8 x 128, freq factors" },
        { 9, 128, 2, 64, LUMA_ROPE_NEOX, 1e4f, 0.25f, 0, 0, "NEOX 64 of 128, pos x 0.25" },
        { 11, 64, 14, 64, LUMA_ROPE_NORM, 1e4f, 1.0f, 0, 0, "NORM 14 x 64" },
        { 13, 96, 3, 96, LUMA_ROPE_NEOX, 1e4f, 1.0f, 1, 0, "NEOX 3 x 96, freq factors" },
        { 512, 128, 32, 128, LUMA_ROPE_NORM, 5e5f, 1.0f, 0, 1, "NORM 512 x 32 x 128" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int32_t rows = cases[k].rows, hd = cases[k].head_dim;
        int64_t cols = (int64_t)cases[k].heads * hd;
        if (quick && rows > 64) continue;
        float *x = random_floats((size_t)(rows * cols), 1.5f);
        float ff[512];
        int32_t *pos = xmalloc((size_t)rows * sizeof(int32_t));
        for (int32_t i = 0; i < rows; i++) pos[i] = (int32_t)(rnd() % 32768);
        pos[0] = 0;
        for (int i = 0; i < cases[k].n_dims / 2; i++) ff[i] = uniform(1.0f, 32.0f);
        luma_rope r = { cases[k].kind, cases[k].n_dims, cases[k].base, cases[k].pos_scale,
                        cases[k].freq_factors ? ff : NULL };
        dual xb;
        dual_new(&xb, rows, cols);
        dual_set(&xb, x);
        tstep t;
        step_simple(&t, rows, NULL, pos, NULL, 0);
        if (step_begin(&t)) {
            cpu->ops->rope(cpu, &xb.c, hd, t.pos, &r);
            gpu->ops->rope(gpu, &xb.g, hd, t.pos, &r);
            char name[48];
            snprintf(name, sizeof name, "rope %s", cases[k].what);
            report(name, dual_err(&xb), 1e-5);
            if (cases[k].timed) {
                rope_ctx c = { &xb, hd, t.pos, &r };
                timed(rope_call, &c, 2.0 * (double)(rows * cols) * 4.0);
            }
        }
        step_free(&t);
        dual_free(&xb);
        free(x);
        free(pos);
    }
}

/* ---- qk_rope: per-head norms and RoPE of q and k in one launch ----------- */

/* Against the CPU's separate rmsnorm (per head) and rope of q and k: gemma's
 * shape with its q_norm and k_norm, llama's and qwen2's without, and a head
 * size the fused kernel does not take (the backend falls back). */
static void test_qk_rope(void)
{
    static const struct {
        int32_t rows, head_dim, hq, hk;
        enum luma_rope_kind kind;
        int norms, freq_factors;
        const char *what;
    } cases[] = {
        { 20, 256, 4, 1, LUMA_ROPE_NEOX, 1, 0, "gemma 4+1 x 256, norms" },
        { 3, 256, 8, 4, LUMA_ROPE_NORM, 1, 0, "NORM 8+4 x 256, norms" },
        { 17, 128, 32, 8, LUMA_ROPE_NORM, 0, 1, "llama 32+8 x 128, freq factors" },
        { 9, 128, 14, 2, LUMA_ROPE_NEOX, 0, 0, "qwen2 14+2 x 128" },
        { 5, 128, 4, 4, LUMA_ROPE_NEOX, 1, 0, "NEOX 4+4 x 128, norms" },
        { 7, 64, 6, 2, LUMA_ROPE_NEOX, 1, 0, "NEOX 6+2 x 64 (not fused)" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int32_t rows = cases[k].rows, hd = cases[k].head_dim;
        int64_t qc = (int64_t)cases[k].hq * hd, kc = (int64_t)cases[k].hk * hd;
        float *xq = random_floats((size_t)(rows * qc), 2.0f), *xk = random_floats((size_t)(rows * kc), 2.0f);
        float *gains = xmalloc((size_t)(2 * hd) * sizeof(float)), ff[256];
        for (int32_t i = 0; i < 2 * hd; i++) gains[i] = 1.0f + 0.5f * gaussian();
        for (int i = 0; i < hd / 2; i++) ff[i] = uniform(1.0f, 32.0f);
        int32_t *pos = xmalloc((size_t)rows * sizeof(int32_t));
        for (int32_t i = 0; i < rows; i++) pos[i] = (int32_t)(rnd() % 32768);
        luma_rope r = { cases[k].kind, hd, 1e6f, 1.0f, cases[k].freq_factors ? ff : NULL };
        dual qb, kb;
        dual_new(&qb, rows, qc);
        dual_new(&kb, rows, kc);
        dual_set(&qb, xq);
        dual_set(&kb, xk);
        dual_w gq, gk;
        tstep t;
        step_simple(&t, rows, NULL, pos, NULL, 0);
        if (dual_weight(&gq, LUMA_F32, 1, hd, gains) && dual_weight(&gk, LUMA_F32, 1, hd, gains + hd) &&
            step_begin(&t)) {
            bool norms = cases[k].norms;
            if (norms) {
                cpu->ops->rmsnorm(cpu, &qb.c, &gq.c, hd, 1e-6f, &qb.c);
                cpu->ops->rmsnorm(cpu, &kb.c, &gk.c, hd, 1e-6f, &kb.c);
            }
            cpu->ops->rope(cpu, &qb.c, hd, t.pos, &r);
            cpu->ops->rope(cpu, &kb.c, hd, t.pos, &r);
            gpu->ops->qk_rope(gpu, &qb.g, &kb.g, norms ? &gq.g : NULL, norms ? &gk.g : NULL, hd, 1e-6f, t.pos, &r);
            char name[64];
            snprintf(name, sizeof name, "qk_rope %s (q)", cases[k].what);
            report(name, dual_err(&qb), 1e-5);
            snprintf(name, sizeof name, "qk_rope %s (k)", cases[k].what);
            report(name, dual_err(&kb), 1e-5);
        }
        step_free(&t);
        dual_free(&qb);
        dual_free(&kb);
        free(xq);
        free(xk);
        free(gains);
        free(pos);
    }
}

/* ---- qkv_bias_rope: qwen2's biases and RoPE in one launch ----------------- */

/* The three buffers' GPU copies read back into one host array */
static bool read3(const dual *a, const dual *b, const dual *c, float *out)
{
    luma_err err = { { 0 } };
    const dual *d[3] = { a, b, c };
    for (int i = 0; i < 3; i++) {
        if (gpu->ops->buf_read(gpu, &d[i]->g, out, &err) != 0) {
            CHECKF(0, "buf_read: %s", err.msg);
            return false;
        }
        out += d[i]->g.rows * d[i]->g.cols;
    }
    return true;
}

/* Against the CPU's add_bias (three) and rope (two), and bit for bit
 * against the GPU's own add_bias and qk_rope (the unfused path): Qwen2.5
 * 0.5B's heads of 64 at one and at 7 rows, Qwen2.5 7B's heads of 128, NORM
 * pairs with frequency factors, a missing bias, and half the columns
 * rotated (which the fused kernel declines). */
static void test_qkv_bias_rope(void)
{
    static const struct {
        int32_t rows, head_dim, hq, hk, n_dims;
        enum luma_rope_kind kind;
        int freq_factors, no_bk;
        const char *what;
    } cases[] = {
        { 1, 64, 14, 2, 64, LUMA_ROPE_NEOX, 0, 0, "qwen2.5-0.5b 14+2 x 64, one row" },
        { 7, 64, 14, 2, 64, LUMA_ROPE_NEOX, 0, 0, "qwen2.5-0.5b 14+2 x 64" },
        { 5, 128, 28, 4, 128, LUMA_ROPE_NEOX, 0, 0, "qwen2.5-7b 28+4 x 128" },
        { 3, 64, 8, 8, 64, LUMA_ROPE_NORM, 1, 1, "NORM 8+8 x 64, freq factors, no k bias" },
        { 4, 64, 6, 2, 32, LUMA_ROPE_NEOX, 0, 0, "NEOX 32 of 64 (not fused)" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int32_t rows = cases[k].rows, hd = cases[k].head_dim;
        const int64_t qc = (int64_t)cases[k].hq * hd, kc = (int64_t)cases[k].hk * hd, vc = kc;
        const size_t n = (size_t)(rows * (qc + kc + vc));
        float *x = random_floats(n, 2.0f), *bias = random_floats((size_t)(qc + kc + vc), 20.0f), ff[256];
        for (int i = 0; i < hd / 2; i++) ff[i] = uniform(1.0f, 32.0f);
        int32_t *pos = xmalloc((size_t)rows * sizeof(int32_t));
        for (int32_t i = 0; i < rows; i++) pos[i] = (int32_t)(rnd() % 32768);
        luma_rope r = { cases[k].kind, cases[k].n_dims, 1e6f, 1.0f, cases[k].freq_factors ? ff : NULL };
        dual b[2][3];   /* [fused, unfused][q, k, v] */
        const int64_t cols[3] = { qc, kc, vc };
        for (int f = 0; f < 2; f++)
            for (int i = 0; i < 3; i++) {
                dual_new(&b[f][i], rows, cols[i]);
                dual_set(&b[f][i], x + (i == 0 ? 0 : i == 1 ? rows * qc : rows * (qc + kc)));
            }
        dual_w bw[3];
        tstep t;
        step_simple(&t, rows, NULL, pos, NULL, 0);
        if (dual_weight(&bw[0], LUMA_F32, 1, qc, bias) && dual_weight(&bw[1], LUMA_F32, 1, kc, bias + qc) &&
            dual_weight(&bw[2], LUMA_F32, 1, vc, bias + qc + kc) && step_begin(&t)) {
            const bool with_bk = !cases[k].no_bk;
            for (int i = 0; i < 3; i++)
                if (i != 1 || with_bk) cpu->ops->add_bias(cpu, &b[0][i].c, &bw[i].c);
            cpu->ops->rope(cpu, &b[0][0].c, hd, t.pos, &r);
            cpu->ops->rope(cpu, &b[0][1].c, hd, t.pos, &r);
            gpu->ops->qkv_bias_rope(gpu, &b[0][0].g, &b[0][1].g, &b[0][2].g, &bw[0].g, with_bk ? &bw[1].g : NULL,
                                    &bw[2].g, hd, t.pos, &r);
            for (int i = 0; i < 3; i++)
                if (i != 1 || with_bk) gpu->ops->add_bias(gpu, &b[1][i].g, &bw[i].g);
            gpu->ops->qk_rope(gpu, &b[1][0].g, &b[1][1].g, NULL, NULL, hd, 1e-6f, t.pos, &r);
            static const char *const part[3] = { "q", "k", "v" };
            for (int i = 0; i < 3; i++) {
                char name[80];
                snprintf(name, sizeof name, "qkv_bias_rope %s (%s)", cases[k].what, part[i]);
                report(name, dual_err(&b[0][i]), 1e-5);
            }
            float *fused = xmalloc(n * sizeof(float)), *sep = xmalloc(n * sizeof(float));
            if (read3(&b[0][0], &b[0][1], &b[0][2], fused) && read3(&b[1][0], &b[1][1], &b[1][2], sep))
                CHECKF(memcmp(fused, sep, n * sizeof(float)) == 0,
                       "qkv_bias_rope %s: not the bits of add_bias and qk_rope", cases[k].what);
            free(fused);
            free(sep);
        }
        step_free(&t);
        for (int f = 0; f < 2; f++)
            for (int i = 0; i < 3; i++) dual_free(&b[f][i]);
        free(x);
        free(bias);
        free(pos);
    }
}

/* ---- qkv_rope: q, k, v with q and k rotated as the products write them --- */

/* One check of qkv_rope at m rows: random activations x (m x cols) on both
 * backends, positions below pos_mod, q, k and v's outputs y (rows[i]
 * columns) on both, and y2 on the GPU alone for the unfused path; the
 * step begun. */
typedef struct qkv_case {
    int32_t m;
    float *x;
    int32_t *pos;
    dual xb, y[3];
    luma_buf y2[3];
    tstep t;
} qkv_case;

static bool qkv_case_new(qkv_case *k, int32_t m, int64_t cols, const int64_t *rows, int32_t pos_mod)
{
    luma_err err = { { 0 } };
    memset(k, 0, sizeof *k);
    k->m = m;
    k->x = random_floats((size_t)(m * cols), 1.0f);
    k->pos = xmalloc((size_t)m * sizeof(int32_t));
    for (int32_t i = 0; i < m; i++) k->pos[i] = (int32_t)(rnd() % (uint32_t)pos_mod);
    dual_new(&k->xb, m, cols);
    dual_set(&k->xb, k->x);
    for (int i = 0; i < 3; i++) {
        dual_new(&k->y[i], m, rows[i]);
        if (gpu->ops->buf_alloc(gpu, &k->y2[i], m, rows[i], &err) != 0) CHECKF(0, "buf_alloc: %s", err.msg);
    }
    step_simple(&k->t, m, NULL, k->pos, NULL, 0);
    return step_begin(&k->t);
}

static void qkv_case_free(qkv_case *k)
{
    step_free(&k->t);
    dual_free(&k->xb);
    for (int i = 0; i < 3; i++) {
        dual_free(&k->y[i]);
        gpu->ops->buf_free(gpu, &k->y2[i]);
    }
    free(k->x);
    free(k->pos);
}

/* q's, k's and v's weights of types t and rows[i] x cols, random, on both
 * backends (host[i]: their bytes, for the caller to free). */
static bool qkv_weights(dual_w *w, uint8_t **host, const enum luma_type *t, const int64_t *rows, int64_t cols)
{
    bool ok = true;
    for (int i = 0; i < 3; i++) {
        host[i] = xmalloc(luma_row_size(t[i], cols) * (size_t)rows[i]);
        random_weights(t[i], rows[i] * cols, host[i]);
        ok = ok && dual_weight(&w[i], t[i], rows[i], cols, host[i]);
    }
    return ok;
}

/* Output i from the fused path (a) and the unfused one (b), on the GPU;
 * false, reported, when they cannot be read. */
static bool qkv_case_read(const qkv_case *k, int i, float *a, float *b)
{
    luma_err err = { { 0 } };
    if (gpu->ops->buf_read(gpu, &k->y[i].g, a, &err) != 0 || gpu->ops->buf_read(gpu, &k->y2[i], b, &err) != 0) {
        CHECKF(0, "buf_read: %s", err.msg);
        return false;
    }
    return true;
}

/* The GPU's qkv_rope against its own matmul_many then qk_rope (no norms):
 * the same bits, for q, k, v in the Q4_K_M mix and in other block types
 * (Q8_0 at one row takes the staged kernel, which leaves the rotation to
 * rope), at the decode row counts the matrix-vector kernels take (mmv_tc
 * up to 32: one and two groups of 16) and past them; and q, k against the
 * CPU's matmul then rope (past 8 rows the legacy formats' products take
 * mmq's f16 route: a looser bound). */
static void test_qkv_rope(void)
{
    static const struct {
        enum luma_type t[3];
        int32_t hq, hk, head_dim;
    } sets[] = {
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q6_K }, 8, 2, 128 },
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q4_K }, 4, 4, 64 },
        { { LUMA_Q8_0, LUMA_Q5_0, LUMA_Q8_0 }, 4, 1, 256 },
        { { LUMA_Q6_K, LUMA_Q5_K, LUMA_Q4_0 }, 6, 2, 128 },
    };
    static const int32_t ms[] = { 1, 2, 3, 8, 16, 24, 32, 40 };
    const int64_t cols = 512;
    if (!gpu->ops->qkv_rope) {
        CHECKF(0, "the CUDA backend has qkv_rope");
        return;
    }
    int fused = 0;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        int32_t hd = sets[si].head_dim;
        int64_t rows[3] = { (int64_t)sets[si].hq * hd, (int64_t)sets[si].hk * hd, (int64_t)sets[si].hk * hd };
        dual_w w[3];
        uint8_t *host[3];
        bool ok = qkv_weights(w, host, sets[si].t, rows, cols);
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0] && ok; mi++) {
            const int32_t m = ms[mi];
            luma_rope r = { LUMA_ROPE_NORM, hd, 10000.0f, 1.0f, NULL };
            qkv_case k;
            dual *y = k.y;
            if (qkv_case_new(&k, m, cols, rows, 8192)) {
                const luma_weight *wg[3] = { &w[0].g, &w[1].g, &w[2].g };
                luma_buf *yg[3] = { &y[0].g, &y[1].g, &y[2].g }, *yg2[3] = { &k.y2[0], &k.y2[1], &k.y2[2] };
                const luma_qkv qp = { { wg[0], wg[1], wg[2] }, { NULL, NULL, NULL }, NULL, NULL, 1e-6f };
                bool took = gpu->ops->qkv_rope(gpu, &qp, &k.xb.g, yg, hd, k.t.pos, &r);
                fused += took;
                /* declined past the kernels' rows (mmv_tc's 32): the
                 * forward then runs matmul_many and the rotations itself */
                CHECKF(took || m > 32, "qkv_rope declined m=%d", (int)m);
                if (!took) gpu->ops->matmul_many(gpu, 3, wg, &k.xb.g, yg);
                if (!took) gpu->ops->qk_rope(gpu, yg[0], yg[1], NULL, NULL, hd, 1e-6f, k.t.pos, &r);
                gpu->ops->matmul_many(gpu, 3, wg, &k.xb.g, yg2);
                gpu->ops->qk_rope(gpu, yg2[0], yg2[1], NULL, NULL, hd, 1e-6f, k.t.pos, &r);
                for (int i = 0; i < 3; i++) {
                    cpu->ops->matmul(cpu, &w[i].c, &k.xb.c, &y[i].c);
                    if (i < 2) cpu->ops->rope(cpu, &y[i].c, hd, k.t.pos, &r);
                }
                if (gpu_sync("qkv_rope")) {
                    for (int i = 0; i < 3; i++) {
                        size_t n = (size_t)(m * rows[i]);
                        float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
                        if (qkv_case_read(&k, i, a, b))
                            CHECKF(memcmp(a, b, n * sizeof(float)) == 0,
                                   "qkv_rope set %zu, output %d at m=%d: not the bits of matmul_many and qk_rope",
                                   si, i, (int)m);
                        free(a);
                        free(b);
                    }
                    char name[80];
                    snprintf(name, sizeof name, "qkv_rope %s/%s/%s m=%d (q)", luma_type_name(sets[si].t[0]),
                             luma_type_name(sets[si].t[1]), luma_type_name(sets[si].t[2]), (int)m);
                    report(name, dual_err(&y[0]), m <= 8 ? 1e-3 : 4e-3);
                }
            }
            qkv_case_free(&k);
        }
        for (int i = 0; i < 3; i++) free(host[i]);
    }
    CHECKF(fused > 0, "qkv_rope took the decode row counts");
}

/* ---- qkv_rope with Qwen2's biases, the pairs stored adjacent -------------- */

/* Rows of h columns (cols of them a row, rows rows) from the file's order
 * to the order of weights stored with their NEOX pairs adjacent
 * (luma_weight.pairs_adjacent): column i < h / 2 of a head to 2i, column
 * i + h / 2 to 2i + 1. */
static float *pairs_adjacent(const float *x, int64_t rows, int64_t cols, int32_t h)
{
    float *y = xmalloc((size_t)(rows * cols) * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = c % h, to = c - i + (i < h / 2 ? 2 * i : 2 * (i - h / 2) + 1);
            y[r * cols + to] = x[r * cols + c];
        }
    return y;
}

/* Qwen2's q, k and v: weights and biases loaded with neox_head, so that the
 * GPU stores q's and k's NEOX pairs adjacent, then qkv_rope with the
 * biases at every decode row count and past them. It must take every call
 * (it alone knows the order); q and k are the CPU's matmul, add_bias and
 * NEOX rope in that order, v the CPU's; and the bits are the GPU's own
 * matmul_many then qkv_bias_rope with NORM on the stored order: the biases
 * and rotation the products add where they write q, k and v are
 * add_bias's and rope's. Qwen2.5 0.5B's shapes (896 columns of Q5_0 and
 * Q8_0, heads of 64) and a 7B mix (Q4_K, Q6_K, heads of 128). */
static void test_qkv_rope_biases(void)
{
    static const struct {
        enum luma_type t[3];
        int32_t hq, hk, head_dim;
        int64_t cols;
    } sets[] = {
        { { LUMA_Q5_0, LUMA_Q5_0, LUMA_Q8_0 }, 14, 2, 64, 896 },
        { { LUMA_Q4_K, LUMA_Q4_K, LUMA_Q6_K }, 8, 2, 128, 512 },
    };
    static const int32_t ms[] = { 1, 2, 3, 8, 16, 24, 32, 40 };
    int taken = 0, calls = 0;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        const int32_t hd = sets[si].head_dim;
        const int64_t cols = sets[si].cols;
        const int64_t rows[3] = { (int64_t)sets[si].hq * hd, (int64_t)sets[si].hk * hd, (int64_t)sets[si].hk * hd };
        luma_weight wc[3], wg[3], bc[3], bg[3];
        uint8_t *host[3];
        float *bias[3];
        luma_err err = { { 0 } };
        bool ok = true;
        for (int i = 0; i < 3; i++) {
            host[i] = xmalloc(luma_row_size(sets[si].t[i], cols) * (size_t)rows[i]);
            random_weights(sets[si].t[i], rows[i] * cols, host[i]);
            bias[i] = random_floats((size_t)rows[i], 1.0f);
            const int32_t h = i < 2 ? hd : 0;
            wc[i] = (luma_weight){ .type = sets[si].t[i], .rows = rows[i], .cols = cols, .host = host[i] };
            bc[i] = (luma_weight){ .type = LUMA_F32, .rows = 1, .cols = rows[i], .host = bias[i] };
            wg[i] = wc[i];
            bg[i] = bc[i];
            wg[i].neox_head = bg[i].neox_head = h;
            ok = ok && cpu->ops->weight_load(cpu, &wc[i], &err) == 0 && cpu->ops->weight_load(cpu, &bc[i], &err) == 0 &&
                 gpu->ops->weight_load(gpu, &wg[i], &err) == 0 && gpu->ops->weight_load(gpu, &bg[i], &err) == 0;
            if (!ok) CHECKF(0, "weight_load: %s", err.msg);
        }
        CHECKF(!ok || (wg[0].pairs_adjacent && wg[1].pairs_adjacent && bg[0].pairs_adjacent && bg[1].pairs_adjacent &&
                       !wg[2].pairs_adjacent && !bg[2].pairs_adjacent && !wc[0].pairs_adjacent),
               "the GPU stores q's and k's pairs adjacent, v's and the CPU's not");
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0] && ok; mi++) {
            const int32_t m = ms[mi];
            luma_rope neox = { LUMA_ROPE_NEOX, hd, 1e6f, 1.0f, NULL }, norm = neox;
            norm.kind = LUMA_ROPE_NORM;
            qkv_case k;
            dual *y = k.y;
            luma_buf *y2 = k.y2;
            if (qkv_case_new(&k, m, cols, rows, 32768)) {
                const luma_weight *ws[3] = { &wg[0], &wg[1], &wg[2] }, *bs[3] = { &bg[0], &bg[1], &bg[2] };
                luma_buf *yg[3] = { &y[0].g, &y[1].g, &y[2].g };
                calls++;
                const luma_qkv qp = { { ws[0], ws[1], ws[2] }, { bs[0], bs[1], bs[2] }, NULL, NULL, 1e-6f };
                taken += gpu->ops->qkv_rope(gpu, &qp, &k.xb.g, yg, hd, k.t.pos, &neox);
                gpu->ops->matmul_many(gpu, 3, ws, &k.xb.g, (luma_buf *const[]){ &y2[0], &y2[1], &y2[2] });
                gpu->ops->qkv_bias_rope(gpu, &y2[0], &y2[1], &y2[2], &bg[0], &bg[1], &bg[2], hd, k.t.pos, &norm);
                for (int i = 0; i < 3; i++) {
                    cpu->ops->matmul(cpu, &wc[i], &k.xb.c, &y[i].c);
                    cpu->ops->add_bias(cpu, &y[i].c, &bc[i]);
                    if (i < 2) cpu->ops->rope(cpu, &y[i].c, hd, k.t.pos, &neox);
                }
                if (gpu_sync("qkv_rope with biases")) {
                    for (int i = 0; i < 3; i++) {
                        const size_t n = (size_t)(m * rows[i]);
                        float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
                        float *c = xmalloc(n * sizeof(float));
                        if (!qkv_case_read(&k, i, a, b)) {
                        } else if (cpu->ops->buf_read(cpu, &y[i].c, c, &err) != 0) {
                            CHECKF(0, "buf_read: %s", err.msg);
                        } else {
                            CHECKF(memcmp(a, b, n * sizeof(float)) == 0,
                                   "qkv_rope with biases, set %zu, output %d at m=%d: not the bits of matmul_many "
                                   "and qkv_bias_rope",
                                   si, i, (int)m);
                            float *ref = i < 2 ? pairs_adjacent(c, m, rows[i], hd) : c;
                            char name[80];
                            snprintf(name, sizeof name, "qkv_rope+bias %s/%s/%s m=%d (%c)",
                                     luma_type_name(sets[si].t[0]), luma_type_name(sets[si].t[1]),
                                     luma_type_name(sets[si].t[2]), (int)m, "qkv"[i]);
                            report(name, rel_err(a, ref, n), m <= 8 ? 1e-3 : 4e-3);
                            if (ref != c) free(ref);
                        }
                        free(a);
                        free(b);
                        free(c);
                    }
                }
            }
            qkv_case_free(&k);
        }
        for (int i = 0; i < 3; i++) {
            free(host[i]);
            free(bias[i]);
        }
    }
    CHECKF(taken == calls, "qkv_rope took every call with its pairs adjacent (%d of %d)", taken, calls);
}

/* ---- qkv_rope with Gemma 3's norms: q, k and v by whole heads ------------ */

long long luma_cuda_qkv_heads(luma_backend *be);

/* Gemma 3's q, k and v (heads of 256, q_norm and k_norm, NEOX) through
 * qkv_rope: at one row the products make whole heads and normalize and
 * rotate q and k themselves (mmv_heads), which must give the bits of the
 * GPU's matmul_many then qk_rope, and the CPU's matmul, rmsnorm and rope
 * within the 8-bit products' bound; at 3 rows the same through the
 * fallback. Gemma 3 270M's shapes (640 columns: Q5_0 q and k, Q8_0 v; all
 * Q8_0) and 1B's (1,152 columns of Q5_0, three rounds a row). */
static void test_qkv_heads(void)
{
    static const struct {
        enum luma_type t[3];
        int64_t cols;
    } sets[] = {
        { { LUMA_Q5_0, LUMA_Q5_0, LUMA_Q8_0 }, 640 },
        { { LUMA_Q8_0, LUMA_Q8_0, LUMA_Q8_0 }, 640 },
        { { LUMA_Q5_0, LUMA_Q5_0, LUMA_Q5_0 }, 1152 },
    };
    static const int32_t ms[] = { 1, 3 };
    const int32_t hd = 256;
    const int64_t rows[3] = { 4 * 256, 256, 256 };
    const long long heads0 = luma_cuda_qkv_heads(gpu);
    int ones = 0;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        const int64_t cols = sets[si].cols;
        dual_w w[3], g[2];
        uint8_t *host[3];
        float *gains = random_floats(2 * (size_t)hd, 1.0f);
        bool ok = qkv_weights(w, host, sets[si].t, rows, cols) && dual_weight(&g[0], LUMA_F32, 1, hd, gains) &&
                  dual_weight(&g[1], LUMA_F32, 1, hd, gains + hd);
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0] && ok; mi++) {
            const int32_t m = ms[mi];
            const luma_rope r = { LUMA_ROPE_NEOX, hd, 1e6f, 1.0f, NULL };
            qkv_case k;
            dual *y = k.y;
            if (qkv_case_new(&k, m, cols, rows, 32768)) {
                const luma_weight *wg[3] = { &w[0].g, &w[1].g, &w[2].g };
                const luma_qkv qp = { { wg[0], wg[1], wg[2] }, { NULL, NULL, NULL }, &g[0].g, &g[1].g, 1e-6f };
                luma_buf *yg[3] = { &y[0].g, &y[1].g, &y[2].g }, *yg2[3] = { &k.y2[0], &k.y2[1], &k.y2[2] };
                const long long before = luma_cuda_qkv_heads(gpu);
                const bool took = gpu->ops->qkv_rope(gpu, &qp, &k.xb.g, yg, hd, k.t.pos, &r);
                CHECKF(took == (m == 1), "qkv_rope with norms %s one row at m=%d", took ? "took more than" : "declined",
                       (int)m);
                if (!took) {
                    gpu->ops->matmul_many(gpu, 3, wg, &k.xb.g, yg);
                    gpu->ops->qk_rope(gpu, yg[0], yg[1], &g[0].g, &g[1].g, hd, 1e-6f, k.t.pos, &r);
                }
                ones += m == 1 && luma_cuda_qkv_heads(gpu) > before;
                gpu->ops->matmul_many(gpu, 3, wg, &k.xb.g, yg2);
                gpu->ops->qk_rope(gpu, yg2[0], yg2[1], &g[0].g, &g[1].g, hd, 1e-6f, k.t.pos, &r);
                for (int i = 0; i < 3; i++) cpu->ops->matmul(cpu, &w[i].c, &k.xb.c, &y[i].c);
                for (int i = 0; i < 2; i++) {
                    cpu->ops->rmsnorm(cpu, &y[i].c, &g[i].c, hd, 1e-6f, &y[i].c);
                    cpu->ops->rope(cpu, &y[i].c, hd, k.t.pos, &r);
                }
                if (gpu_sync("qkv_rope with norms")) {
                    for (int i = 0; i < 3; i++) {
                        const size_t n = (size_t)(m * rows[i]);
                        float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
                        if (qkv_case_read(&k, i, a, b))
                            CHECKF(memcmp(a, b, n * sizeof(float)) == 0,
                                   "qkv_rope with norms, set %zu, output %d at m=%d: not the bits of matmul_many and "
                                   "qk_rope",
                                   si, i, (int)m);
                        free(a);
                        free(b);
                        char name[80];
                        snprintf(name, sizeof name, "qkv_rope+norms %s/%s/%s x %d m=%d (%c)",
                                 luma_type_name(sets[si].t[0]), luma_type_name(sets[si].t[1]),
                                 luma_type_name(sets[si].t[2]), (int)cols, (int)m, "qkv"[i]);
                        report(name, dual_err(&y[i]), 1e-4);
                    }
                }
            }
            qkv_case_free(&k);
        }
        for (int i = 0; i < 3; i++) free(host[i]);
        free(gains);
    }
    CHECKF(ones == (int)(sizeof sets / sizeof sets[0]), "q, k and v by whole heads at one row: %d of %d sets", ones,
           (int)(sizeof sets / sizeof sets[0]));
    CHECKF(luma_cuda_qkv_heads(gpu) > heads0, "q, k and v by whole heads ran");
}

/* ---- ffn: gate and up making the down's input (mmv_gated) ---------------- */

long long luma_cuda_ffn_gated(luma_backend *be);

/* The GPU's ffn against its own matmul_many then gated_matmul: the same
 * bits in y, gate (act(gate) * up) and up, at one row taken by the
 * clusters of mmv_gated (counted) and at 3 rows declined; y against the
 * CPU's matmul, gelu_mul / silu_mul and matmul. Gemma 3 270M's, Qwen2.5
 * 0.5B's and Gemma 3 1B's shapes (Q5_0 gate and up of 640, 896 and 1,152
 * columns, 1 to 3 rounds a row, one or two pairs of rows a warp, Q6_K
 * down: 8-bit activations of super-blocks of 256), and Q8_0 and Q4_0 with
 * a Q8_0 down (blocks of 32). */
static void test_ffn_gated(void)
{
    static const struct {
        enum luma_type t, down;
        int64_t cols, ffn;
        int act;
    } sets[] = {
        { LUMA_Q5_0, LUMA_Q6_K, 640, 2048, LUMA_ACT_GELU },
        { LUMA_Q5_0, LUMA_Q6_K, 896, 4864, LUMA_ACT_SILU },
        { LUMA_Q5_0, LUMA_Q6_K, 1152, 6912, LUMA_ACT_GELU },
        { LUMA_Q8_0, LUMA_Q8_0, 640, 2048, LUMA_ACT_SILU },
        { LUMA_Q4_0, LUMA_Q8_0, 512, 768, LUMA_ACT_GELU },
    };
    static const int32_t ms[] = { 1, 3 };
    if (!gpu->ops->ffn) {
        CHECKF(0, "the CUDA backend has ffn");
        return;
    }
    const long long gated0 = luma_cuda_ffn_gated(gpu);
    int ones = 0;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        const int64_t cols = sets[si].cols, ffn = sets[si].ffn;
        const enum luma_type t[3] = { sets[si].t, sets[si].t, sets[si].down };
        const int64_t rows[3] = { ffn, ffn, cols }, wcols[3] = { cols, cols, ffn };
        dual_w w[3];
        uint8_t *host[3];
        bool ok = true;
        for (int i = 0; i < 3; i++) {
            host[i] = xmalloc(luma_row_size(t[i], wcols[i]) * (size_t)rows[i]);
            random_weights(t[i], rows[i] * wcols[i], host[i]);
            ok = ok && dual_weight(&w[i], t[i], rows[i], wcols[i], host[i]);
        }
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0] && ok; mi++) {
            const int32_t m = ms[mi];
            float *x = random_floats((size_t)(m * cols), 1.0f);
            dual xb, gate, up, y;
            luma_buf g2[3];   /* gate, up and y of the unfused path */
            luma_err err = { { 0 } };
            dual_new(&xb, m, cols);
            dual_set(&xb, x);
            dual_new(&gate, m, ffn);
            dual_new(&up, m, ffn);
            dual_new(&y, m, cols);
            for (int i = 0; i < 3; i++)
                if (gpu->ops->buf_alloc(gpu, &g2[i], m, i < 2 ? ffn : cols, &err) != 0)
                    CHECKF(0, "buf_alloc: %s", err.msg);
            const luma_weight *wg[3] = { &w[0].g, &w[1].g, &w[2].g };
            const long long before = luma_cuda_ffn_gated(gpu);
            const bool took = gpu->ops->ffn(gpu, wg, sets[si].act, &xb.g, &gate.g, &up.g, &y.g);
            CHECKF(took == (m == 1), "ffn %s one row at m=%d", took ? "took more than" : "declined", (int)m);
            ones += m == 1 && luma_cuda_ffn_gated(gpu) > before;
            if (!took) {
                gpu->ops->matmul_many(gpu, 2, wg, &xb.g, (luma_buf *const[]){ &gate.g, &up.g });
                gpu->ops->gated_matmul(gpu, wg[2], &gate.g, &up.g, sets[si].act, &y.g);
            }
            gpu->ops->matmul_many(gpu, 2, wg, &xb.g, (luma_buf *const[]){ &g2[0], &g2[1] });
            gpu->ops->gated_matmul(gpu, wg[2], &g2[0], &g2[1], sets[si].act, &g2[2]);
            cpu->ops->matmul(cpu, &w[0].c, &xb.c, &gate.c);
            cpu->ops->matmul(cpu, &w[1].c, &xb.c, &up.c);
            if (sets[si].act == LUMA_ACT_GELU) cpu->ops->gelu_mul(cpu, &gate.c, &up.c);
            else cpu->ops->silu_mul(cpu, &gate.c, &up.c);
            cpu->ops->matmul(cpu, &w[2].c, &gate.c, &y.c);
            if (gpu_sync("ffn")) {
                const dual *got[3] = { &gate, &up, &y };
                for (int i = 0; i < 3; i++) {
                    const size_t n = (size_t)(m * (i < 2 ? ffn : cols));
                    float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
                    if (gpu->ops->buf_read(gpu, &got[i]->g, a, &err) == 0 &&
                        gpu->ops->buf_read(gpu, &g2[i], b, &err) == 0)
                        CHECKF(memcmp(a, b, n * sizeof(float)) == 0,
                               "ffn set %zu, %s at m=%d: not the bits of matmul_many and gated_matmul", si,
                               i == 0 ? "gate" : i == 1 ? "up" : "y", (int)m);
                    else
                        CHECKF(0, "buf_read: %s", err.msg);
                    free(a);
                    free(b);
                }
                char name[80];
                snprintf(name, sizeof name, "ffn %s x %d, %d, %s m=%d (y)", luma_type_name(t[0]), (int)cols, (int)ffn,
                         luma_type_name(t[2]), (int)m);
                report(name, dual_err(&y), 2e-3);
            }
            for (int i = 0; i < 3; i++) gpu->ops->buf_free(gpu, &g2[i]);
            dual_free(&xb);
            dual_free(&gate);
            dual_free(&up);
            dual_free(&y);
            free(x);
        }
        for (int i = 0; i < 3; i++) free(host[i]);
    }
    CHECKF(ones == (int)(sizeof sets / sizeof sets[0]), "gate and up with the down's input at one row: %d of %d sets",
           ones, (int)(sizeof sets / sizeof sets[0]));
    CHECKF(luma_cuda_ffn_gated(gpu) > gated0, "gate and up with the down's input ran");
}

/* ---- elementwise, bias, gather ------------------------------------------ */

enum { OP_ADD, OP_GELU, OP_SILU };

typedef struct ew_ctx {
    int op;
    dual *a, *b;
} ew_ctx;

static void ew_gpu(int op, luma_buf *a, const luma_buf *b)
{
    if (op == OP_ADD) gpu->ops->add(gpu, a, b);
    else if (op == OP_GELU) gpu->ops->gelu_mul(gpu, a, b);
    else gpu->ops->silu_mul(gpu, a, b);
}

static void ew_call(void *p)
{
    ew_ctx *c = p;
    ew_gpu(c->op, &c->a->g, &c->b->g);
}

static void test_elementwise(void)
{
    static const char *names[] = { "add", "gelu_mul", "silu_mul" };
    /* GELU's result is rounded to half precision: an ulp of tanh can move
     * it by one half-precision step */
    static const double tols[] = { 0.0, 1e-3, 1e-5 };
    static const struct { int64_t rows, cols, offset; int timed; const char *what; } shapes[] = {
        { 64, 1000, 0, 0, "64 x 1000" },
        { 3, 7, 0, 0, "3 x 7 (tail)" },
        { 4, 90, 1, 0, "4 x 90, unaligned" },
        { 512, 14336, 0, 1, "512 x 14336" },
    };
    for (int op = OP_ADD; op <= OP_SILU; op++)
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int64_t rows = shapes[k].rows, cols = shapes[k].cols, r0 = shapes[k].offset;
            if (quick && rows > 64) continue;
            size_t n = (size_t)((rows + r0) * cols);
            float *a = random_floats(n, 3.0f), *b = random_floats(n, 2.0f);
            dual ab, bb;
            dual_new(&ab, rows + r0, cols);
            dual_new(&bb, rows + r0, cols);
            dual_set(&ab, a);
            dual_set(&bb, b);
            dual av = dual_rows(&ab, r0, rows), bv = dual_rows(&bb, r0, rows);
            if (op == OP_ADD) cpu->ops->add(cpu, &av.c, &bv.c);
            else if (op == OP_GELU) cpu->ops->gelu_mul(cpu, &av.c, &bv.c);
            else cpu->ops->silu_mul(cpu, &av.c, &bv.c);
            ew_gpu(op, &av.g, &bv.g);
            char name[48];
            snprintf(name, sizeof name, "%s %s", names[op], shapes[k].what);
            report(name, dual_err(&ab), tols[op]);
            if (shapes[k].timed) {
                ew_ctx c = { op, &av, &bv };
                timed(ew_call, &c, 3.0 * (double)(rows * cols) * 4.0);
            }
            dual_free(&ab);
            dual_free(&bb);
            free(a);
            free(b);
        }
}

static void test_bias_gather(void)
{
    static const int64_t widths[] = { 896, 90 };
    for (size_t k = 0; k < 2; k++) {
        int64_t rows = 13, cols = widths[k];
        float *x = random_floats((size_t)(rows * cols), 2.0f), *bias = random_floats((size_t)cols, 1.0f);
        dual xb;
        dual_new(&xb, rows, cols);
        dual_set(&xb, x);
        dual_w b;
        if (dual_weight(&b, LUMA_F32, 1, cols, bias)) {
            cpu->ops->add_bias(cpu, &xb.c, &b.c);
            gpu->ops->add_bias(gpu, &xb.g, &b.g);
            char name[48];
            snprintf(name, sizeof name, "add_bias 13 x %lld", (long long)cols);
            report(name, dual_err(&xb), 0.0);
        }
        static const int32_t out[] = { 12, 0, 7, 3, 3 };
        tstep t;
        step_simple(&t, (int32_t)rows, NULL, NULL, out, 5);
        dual ob;
        dual_new(&ob, 5, cols);
        if (step_begin(&t)) {
            cpu->ops->gather(cpu, &xb.c, t.out_rows, 5, &ob.c);
            gpu->ops->gather(gpu, &xb.g, t.out_rows, 5, &ob.g);
            char name[48];
            snprintf(name, sizeof name, "gather 5 of 13 x %lld", (long long)cols);
            report(name, dual_err(&ob), 0.0);
        }
        step_free(&t);
        dual_free(&ob);
        dual_free(&xb);
        free(x);
        free(bias);
    }
}

/* ---- attention ---------------------------------------------------------- */

#define BLOCK_TOKENS 16
#define WINDOW 512

typedef struct attn_shape {
    const char *name;
    int32_t n_head, n_kv, dk, dv;
    int n_pools;               /* 2: layers with the window get their own pool */
    float softcap;
} attn_shape;

typedef struct kv_env {
    const attn_shape *sh;
    enum luma_type type;
    luma_kv *kv;
    luma_kv_seq *seq[3];
    luma_attn full, win;       /* the attended layers: whole context, window */
} kv_env;

static void copy_both(void *ctx, int pool, int32_t src, int32_t dst)
{
    (void)ctx;
    cpu->ops->kv_copy_block(cpu, pool, src, dst);
    gpu->ops->kv_copy_block(gpu, pool, src, dst);
}

/* One step's rows: parts[i] rows of sequence seq_of[i]. */
typedef struct attn_step {
    tstep t;
    int n;
    int32_t seq_of[3];
} attn_step;

static bool build_step(kv_env *e, attn_step *as, const int *seqs, const int32_t *rows, int n_parts)
{
    luma_err err = { { 0 } };
    int32_t total = 0;
    for (int i = 0; i < n_parts; i++) total += rows[i];
    memset(as, 0, sizeof *as);
    tstep *t = &as->t;
    t->tokens = xmalloc((size_t)total * sizeof(int32_t));
    t->pos = xmalloc((size_t)total * sizeof(int32_t));
    t->out_rows = xmalloc(sizeof(int32_t));
    int32_t at = 0;
    for (int i = 0; i < n_parts; i++) {
        luma_kv_seq *s = e->seq[seqs[i]];
        if (luma_kv_reserve(e->kv, s, rows[i], &err) != 0) {
            CHECKF(0, "luma_kv_reserve: %s", err.msg);
            return false;
        }
        luma_step_seq *q = &t->seqs[i];
        q->row0 = at;
        q->n_rows = rows[i];
        q->pos0 = luma_kv_seq_len(s);
        for (int p = 0; p < e->sh->n_pools; p++) q->blocks[p] = luma_kv_seq_blocks(s, p, &q->n_blocks[p]);
        for (int32_t j = 0; j < rows[i]; j++) {
            t->tokens[at + j] = 0;
            t->pos[at + j] = q->pos0 + j;
        }
        at += rows[i];
    }
    t->s = (luma_step){ .n_rows = total, .tokens = t->tokens, .pos = t->pos, .n_seqs = n_parts, .seqs = t->seqs,
                        .n_out = 0, .out_rows = t->out_rows };
    return step_begin(t);
}

typedef struct attn_ctx {
    dual *q, *k, *v, *o;
    const luma_step *s;
    const luma_attn *a;
} attn_ctx;

static void attn_call(void *p)
{
    attn_ctx *c = p;
    gpu->ops->attention(gpu, &c->q->g, &c->k->g, &c->v->g, c->s, c->a, &c->o->g);
}

enum { UNTIMED, TIMED, TIMED_BYTES };

/* Fresh random q, k and v of R rows for layer a on both backends, and the
 * output buffers. */
typedef struct attn_io {
    dual q, k, v, o;
} attn_io;

static void attn_io_new(attn_io *io, int64_t R, const luma_attn *a)
{
    dual_new(&io->q, R, (int64_t)a->n_head * a->head_dim_k);
    dual_new(&io->k, R, (int64_t)a->n_kv_head * a->head_dim_k);
    dual_new(&io->v, R, (int64_t)a->n_kv_head * a->head_dim_v);
    dual_new(&io->o, R, (int64_t)a->n_head * a->head_dim_v);
    dual *in[3] = { &io->q, &io->k, &io->v };
    for (int i = 0; i < 3; i++) {
        float *h = random_floats((size_t)(in[i]->c.rows * in[i]->c.cols), i == 0 ? 2.0f : 1.0f);
        dual_set(in[i], h);
        free(h);
    }
}

static void attn_io_free(attn_io *io)
{
    dual_free(&io->q);
    dual_free(&io->k);
    dual_free(&io->v);
    dual_free(&io->o);
}

/* Bytes of K and V a decode kernel must read for rows at positions pos[0..n):
 * each row's visible keys once, es bytes an element. */
static double visible_kv_bytes(const int32_t *pos, int32_t n, const luma_attn *a, double es)
{
    double bytes = 0.0;
    for (int32_t r = 0; r < n; r++) {
        int32_t p = pos[r], first = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
        bytes += (double)(p - first + 1) * a->n_kv_head * (a->head_dim_k + a->head_dim_v) * es;
    }
    return bytes;
}

/* Whether the GPU runs part of the step on the tensor-core prefill: F16
 * cache, keys and values of one size among 64, 128, 256, and a chunk of at
 * least LUMA_CUDA_PREFILL_ROWS rows (LUMA_CUDA_PREFILL_MIN_ROWS in
 * cuda/cuda_internal.h, 32, unless $LUMA_CUDA_PREFILL_ROWS sets it). */
static bool tensor_core_step(enum luma_type type, const luma_step *s, const luma_attn *a)
{
    if (type != LUMA_F16 || a->head_dim_k != a->head_dim_v ||
        (a->head_dim_k != 64 && a->head_dim_k != 128 && a->head_dim_k != 256))
        return false;
    const char *env = getenv("LUMA_CUDA_PREFILL_ROWS");
    const int32_t min_rows = env && atoi(env) > 0 ? atoi(env) : 32;
    for (int32_t i = 0; i < s->n_seqs; i++)
        if (s->seqs[i].n_rows >= min_rows) return true;
    return false;
}

/* f16 q and softmax weights on the tensor cores; f32 arithmetic otherwise,
 * over f16 or f32 keys and values. */
static double attn_tol(enum luma_type type, const luma_step *s, const luma_attn *a)
{
    if (tensor_core_step(type, s, a)) return 2e-3;
    return type == LUMA_F16 ? 1e-4 : 2e-5;
}

/* Runs attention of layer a on both backends over fresh random q, k, v for
 * the step's rows; n_head may be fewer than the shape's (filling). Returns
 * the error, and reports it as `label` when label is set; TIMED_BYTES also
 * gives the bandwidth of reading each row's visible keys and values once
 * (the decode kernel's traffic). */
static double attend(kv_env *e, const luma_step *s, const luma_attn *a, const char *label, int timing)
{
    attn_io io;
    attn_io_new(&io, s->n_rows, a);
    cpu->ops->attention(cpu, &io.q.c, &io.k.c, &io.v.c, s, a, &io.o.c);
    gpu->ops->attention(gpu, &io.q.g, &io.k.g, &io.v.g, s, a, &io.o.g);
    double err = dual_err(&io.o);
    if (label) report(label, err, attn_tol(e->type, s, a));
    if (label && timing != UNTIMED) {
        double bytes =
            timing == TIMED_BYTES ? visible_kv_bytes(s->pos, s->n_rows, a, e->type == LUMA_F16 ? 2.0 : 4.0) : 0.0;
        attn_ctx c = { &io.q, &io.k, &io.v, &io.o, s, a };
        timed(attn_call, &c, bytes);
    }
    attn_io_free(&io);
    return err;
}

/* Grows sequence si to len positions through steps of up to 512 rows whose
 * attention sees only the row's own key (window 1): it stores k and v in
 * every attended layer at little cost. */
static void fill(kv_env *e, int si, int32_t len)
{
    while (luma_kv_seq_len(e->seq[si]) < len) {
        int32_t n = len - luma_kv_seq_len(e->seq[si]);
        if (n > 512) n = 512;
        attn_step as;
        if (!build_step(e, &as, &si, &n, 1)) {
            step_free(&as.t);
            return;
        }
        const luma_attn *layers[2] = { &e->full, &e->win };
        for (int i = 0; i < (e->sh->n_pools == 2 ? 2 : 1); i++) {
            luma_attn a = *layers[i];
            a.n_head = a.n_kv_head;
            a.window = 1;
            double err = attend(e, &as.t.s, &a, NULL, UNTIMED);
            CHECKF(err <= 1e-6, "filling %s: window-1 attention differs by %.2e", e->sh->name, err);
        }
        luma_kv_commit(e->kv, e->seq[si], n);
        step_free(&as.t);
    }
}

static void test_attention_shape(const attn_shape *sh, enum luma_type type)
{
    luma_err err = { { 0 } };
    int32_t lens[3] = { quick ? 600 : 3000, quick ? 200 : 700, 37 };
    int32_t prefill = quick ? 64 : 300, mixed = quick ? 40 : 100;   /* mixed: prefill rows beside decode rows */
    static const int32_t together[3] = { 70, 129, 8 };   /* rows of "prefill x3" */
    int32_t n_blocks =
        (lens[0] + lens[1] + lens[2] + prefill + mixed + together[0] + together[1] + together[2]) / BLOCK_TOKENS + 16;
    luma_kv_layout l = { .n_pools = sh->n_pools, .block_tokens = BLOCK_TOKENS, .n_kv_head = sh->n_kv,
                         .head_dim_k = sh->dk, .head_dim_v = sh->dv, .type = type };
    luma_kv_params kp = { .n_pools = sh->n_pools, .block_tokens = BLOCK_TOKENS, .copy = copy_both };
    for (int p = 0; p < sh->n_pools; p++) {
        l.n_blocks[p] = kp.n_blocks[p] = n_blocks;
        l.n_layers[p] = p == 0 ? 2 : 1;
        kp.window[p] = p == 1 ? WINDOW : 0;
    }
    kv_env e = { .sh = sh, .type = type };
    if (cpu->ops->kv_alloc(cpu, &l, &err) != 0 || gpu->ops->kv_alloc(gpu, &l, &err) != 0 ||
        luma_kv_new(&kp, &e.kv, &err) != 0) {
        CHECKF(0, "KV cache for %s: %s", sh->name, err.msg);
        return;
    }
    for (int i = 0; i < 3; i++) e.seq[i] = luma_kv_seq_new(e.kv);
    luma_attn full = { 0, 1, sh->n_head, sh->n_kv, sh->dk, sh->dv, 0, 1.0f / sqrtf((float)sh->dk), sh->softcap };
    e.full = e.win = full;
    e.win.window = WINDOW;
    if (sh->n_pools == 2) {
        e.win.pool = 1;
        e.win.layer = 0;
    }
    for (int i = 0; i < 3; i++) fill(&e, i, lens[i]);

    static const struct { const char *what; int n; int seqs[3]; int32_t rows[3]; int timing; } steps[] = {
        { "decode x3", 3, { 0, 1, 2 }, { 1, 1, 1 }, TIMED_BYTES },
        { "decode short", 1, { 2 }, { 1 }, UNTIMED },
        { "prefill", 1, { 2 }, { 0 }, TIMED },
        { "mixed", 3, { 0, 1, 2 }, { 1, 0, 5 }, UNTIMED },
        { "prefill x3", 3, { 0, 1, 2 }, { 0, 0, 0 }, UNTIMED },
    };
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        int32_t rows[3];
        memcpy(rows, steps[k].rows, sizeof rows);
        if (k == 2) rows[0] = prefill;
        if (k == 3) rows[1] = mixed;
        if (k == 4) memcpy(rows, together, sizeof rows);
        attn_step as;
        if (build_step(&e, &as, steps[k].seqs, rows, steps[k].n)) {
            char label[64];
            snprintf(label, sizeof label, "attn %s %s %s w0", sh->name, luma_type_name(type), steps[k].what);
            attend(&e, &as.t.s, &e.full, label, type == LUMA_F16 ? steps[k].timing : UNTIMED);
            snprintf(label, sizeof label, "attn %s %s %s w%d", sh->name, luma_type_name(type), steps[k].what, WINDOW);
            attend(&e, &as.t.s, &e.win, label, UNTIMED);
            /* the decode rows again on decode_kernel whatever their keys
             * (the lean kernel's reach 0, and no lean splits), each row's
             * splits merged by the last of them to finish and by
             * combine_kernel: the defaults give few rows the second, many
             * rows the first */
            if (k == 0) {
                static const char *const merges[2][2] = { { "0,8192,0,1,64,1024,-1,-1,1,0,0,4,64,0,0", "merged" },
                                                          { "0,8192,0,1,64,0,-1,-1,1,0,0,4,64,0,0", "combined" } };
                for (int mi = 0; mi < 2; mi++) {
                    setenv("LUMA_CUDA_ATTN_DECODE", merges[mi][0], 1);
                    snprintf(label, sizeof label, "attn %s %s %s %s w0", sh->name, luma_type_name(type),
                             steps[k].what, merges[mi][1]);
                    attend(&e, &as.t.s, &e.full, label, UNTIMED);
                    snprintf(label, sizeof label, "attn %s %s %s %s w%d", sh->name, luma_type_name(type),
                             steps[k].what, merges[mi][1], WINDOW);
                    attend(&e, &as.t.s, &e.win, label, UNTIMED);
                }
                unsetenv("LUMA_CUDA_ATTN_DECODE");
            }
            /* the decode rows again on decode_lean_kernel (which the
             * defaults give rows of up to some keys only), with 1, 2, 4
             * and 8 parts a unit (2 and more merge them; heads of 256
             * take 4 at most), and for heads of 128 and 256 with two
             * warps a part (each half of the values) at up to 4 parts;
             * each row in one CTA, and (2 parts and more) split over
             * CTAs of a tile a part whatever the row's keys, merged by
             * the last split */
            if (type == LUMA_F16 && sh->dk == sh->dv && (sh->dk == 64 || sh->dk == 128 || sh->dk == 256)) {
                for (int ds = 1; ds <= (sh->dk >= 128 ? 2 : 1); ds++)
                    for (int split = 1; split <= (sh->dk > 128 || ds > 1 ? 4 : 8); split *= 2)
                        for (int tiles = 0; tiles <= (split > 1 ? 1 : 0); tiles++) {
                            char tuning[80];
                            /* split: a reach of a CTA a unit of no keys (lean_keys 1), splits of a tile
                             * a part from the first (lean_tiles 1, lean_solo 0) */
                            snprintf(tuning, sizeof tuning, "0,8192,0,1,64,64,-1,-1,0,%s,%d,4,64,%d,%s",
                                     tiles ? "1" : "1000000", split, ds, tiles ? "1,0" : "0");
                            setenv("LUMA_CUDA_ATTN_DECODE", tuning, 1);
                            snprintf(label, sizeof label, "attn %s f16 %s lean/%dx%d/%s w0", sh->name, steps[k].what,
                                     split, ds, tiles ? "split" : "whole");
                            attend(&e, &as.t.s, &e.full, label, UNTIMED);
                            snprintf(label, sizeof label, "attn %s f16 %s lean/%dx%d/%s w%d", sh->name,
                                     steps[k].what, split, ds, tiles ? "split" : "whole", WINDOW);
                            attend(&e, &as.t.s, &e.win, label, UNTIMED);
                        }
                unsetenv("LUMA_CUDA_ATTN_DECODE");
            }
        }
        step_free(&as.t);
    }
    for (int i = 0; i < 3; i++) luma_kv_seq_free(e.kv, e.seq[i]);
    luma_kv_free(e.kv);
}

static void test_attention(void)
{
    static const attn_shape shapes[] = {
        { "gemma 4/1x256", 4, 1, 256, 256, 2, 0.0f },
        { "llama 32/8x128", 32, 8, 128, 128, 1, 0.0f },
        { "odd 14/2x96/80", 14, 2, 96, 80, 1, 30.0f },
        { "mha 8/8x64", 8, 8, 64, 64, 1, 0.0f },
        { "cap 16/2x128", 16, 2, 128, 128, 1, 10.0f },
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        test_attention_shape(&shapes[i], LUMA_F16);
        if (!quick || i == 0) test_attention_shape(&shapes[i], LUMA_F32);
    }
}

/* ---- decode: batched rows and long contexts ----------------------------- */

/* Decode steps of the shapes that decide decode speed: every row of its own
 * sequence, one new token per row (its key stored by the step itself), the
 * keys the rows see (their context and their own) spread evenly over [lo,
 * hi]. Checked against the CPU, then timed at the bandwidth of reading each
 * row's visible K and V once (F16 cache). LUMA_CUDA_DECODE_CONFIGS, a list
 * of decode tunings separated by ';' (each "stages,stage_bytes,warps,waves,
 * min_split,merge_kb,mma[,one_split,lean_min,lean_keys,lean_split,...,lean_tiles]", as cuda/attention.cu reads
 * LUMA_CUDA_ATTN_DECODE, set to each in turn), also checks and times each of
 * them; LUMA_CUDA_DECODE_CASE=i runs case i alone (for a profiler). */
typedef struct dec_case {
    const char *name;
    int32_t n_head, n_kv, d;   /* query heads over kv heads of d dimensions (keys and values) */
    int32_t rows, lo, hi, window;
} dec_case;

#define FILL_ROWS 4096

static bool step_begin_s(const luma_step *s)
{
    luma_err err = { { 0 } };
    if (gpu->ops->step_begin(gpu, s, &err) != 0) {
        CHECKF(0, "step_begin: %s", err.msg);
        return false;
    }
    return true;
}

/* A step of n sequences, rows[i] rows each at their next positions, with
 * its arrays on the heap (a decode step may hold hundreds of sequences). */
typedef struct big_step {
    luma_step s;
    luma_step_seq *seqs;
    int32_t *tokens, *pos, out;
} big_step;

static void big_step_free(big_step *b)
{
    free(b->seqs);
    free(b->tokens);
    free(b->pos);
    memset(b, 0, sizeof *b);
}

static bool big_step_build(luma_kv *kv, luma_kv_seq **seqs, const int32_t *rows, int32_t n, big_step *b)
{
    luma_err err = { { 0 } };
    int32_t total = 0;
    for (int32_t i = 0; i < n; i++) total += rows[i];
    memset(b, 0, sizeof *b);
    b->seqs = xmalloc((size_t)n * sizeof *b->seqs);
    b->tokens = xmalloc((size_t)total * sizeof(int32_t));
    b->pos = xmalloc((size_t)total * sizeof(int32_t));
    int32_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        if (luma_kv_reserve(kv, seqs[i], rows[i], &err) != 0) {
            CHECKF(0, "luma_kv_reserve: %s", err.msg);
            return false;
        }
        luma_step_seq *q = &b->seqs[i];
        memset(q, 0, sizeof *q);
        q->row0 = at;
        q->n_rows = rows[i];
        q->pos0 = luma_kv_seq_len(seqs[i]);
        q->blocks[0] = luma_kv_seq_blocks(seqs[i], 0, &q->n_blocks[0]);
        for (int32_t j = 0; j < rows[i]; j++) {
            b->tokens[at + j] = 0;
            b->pos[at + j] = q->pos0 + j;
        }
        at += rows[i];
    }
    b->s = (luma_step){ .n_rows = total, .tokens = b->tokens, .pos = b->pos, .n_seqs = n, .seqs = b->seqs,
                        .n_out = 0, .out_rows = &b->out };
    return true;
}

/* Fills every sequence to its length through chunks of up to FILL_ROWS rows
 * of random keys and values, stored on both backends by window-1 attention
 * (each row sees only its own key). */
static bool decode_fill(const dec_case *dc, luma_kv *kv, luma_kv_seq **seqs, const int32_t *len)
{
    int64_t cols = (int64_t)dc->n_kv * dc->d;
    dual q, k, v, o;
    dual_new(&q, FILL_ROWS, cols);
    dual_new(&k, FILL_ROWS, cols);
    dual_new(&v, FILL_ROWS, cols);
    dual_new(&o, FILL_ROWS, cols);
    float *zero = calloc((size_t)(FILL_ROWS * cols), sizeof(float));
    float *hk = xmalloc((size_t)(FILL_ROWS * cols) * sizeof(float)), *hv = xmalloc((size_t)(FILL_ROWS * cols) * sizeof(float));
    if (!zero) {
        printf("test_cuda: out of memory\n");
        exit(1);
    }
    dual_set(&q, zero);
    luma_attn a = { 0, 0, dc->n_kv, dc->n_kv, dc->d, dc->d, 1, 1.0f / sqrtf((float)dc->d), 0.0f };
    bool ok = true;
    for (int32_t i = 0; i < dc->rows && ok; i++) {
        while (ok && luma_kv_seq_len(seqs[i]) < len[i]) {
            int32_t n = len[i] - luma_kv_seq_len(seqs[i]);
            if (n > FILL_ROWS) n = FILL_ROWS;
            big_step b;
            ok = big_step_build(kv, &seqs[i], &n, 1, &b) && step_begin_s(&b.s);
            if (ok) {
                for (int64_t e = 0; e < n * cols; e++) {
                    hk[e] = uniform(-2.0f, 2.0f);
                    hv[e] = uniform(-2.0f, 2.0f);
                }
                dual kr = dual_rows(&k, 0, n), vr = dual_rows(&v, 0, n), qr = dual_rows(&q, 0, n), orow = dual_rows(&o, 0, n);
                memcpy(kr.c.data, hk, (size_t)(n * cols) * sizeof(float));
                memcpy(vr.c.data, hv, (size_t)(n * cols) * sizeof(float));
                ok = cuda_ok(cudaMemcpy(kr.g.data, hk, (size_t)(n * cols) * sizeof(float), cudaMemcpyHostToDevice), "upload") &&
                     cuda_ok(cudaMemcpy(vr.g.data, hv, (size_t)(n * cols) * sizeof(float), cudaMemcpyHostToDevice), "upload");
                if (ok) {
                    cpu->ops->attention(cpu, &qr.c, &kr.c, &vr.c, &b.s, &a, &orow.c);
                    gpu->ops->attention(gpu, &qr.g, &kr.g, &vr.g, &b.s, &a, &orow.g);
                    ok = gpu_sync("filling the decode cases");
                }
                if (ok) luma_kv_commit(kv, seqs[i], n);
            }
            big_step_free(&b);
        }
    }
    free(zero);
    free(hk);
    free(hv);
    dual_free(&q);
    dual_free(&k);
    dual_free(&v);
    dual_free(&o);
    return ok;
}

/* The GPU's output of the step's attention against the CPU's (ref). */
static double decode_err(attn_ctx *c, const float *ref)
{
    luma_err err = { { 0 } };
    size_t n = (size_t)(c->o->g.rows * c->o->g.cols);
    float *got = xmalloc(n * sizeof(float));
    double e = INFINITY;
    attn_call(c);
    if (gpu_sync("decode case") && gpu->ops->buf_read(gpu, &c->o->g, got, &err) == 0) e = rel_err(got, ref, n);
    else if (err.msg[0]) CHECKF(0, "buf_read: %s", err.msg);
    free(got);
    return e;
}

/* The decode step of case dc over its filled cache: the GPU against the
 * CPU, timed, then each tuning of configs. */
static void decode_run(const dec_case *dc, const big_step *b, const int32_t *len, const char *label,
                       const char *configs)
{
    int32_t R = dc->rows;
    luma_attn a = { 0, 0, dc->n_head, dc->n_kv, dc->d, dc->d, dc->window, 1.0f / sqrtf((float)dc->d), 0.0f };
    attn_io io;
    attn_io_new(&io, R, &a);
    cpu->ops->attention(cpu, &io.q.c, &io.k.c, &io.v.c, &b->s, &a, &io.o.c);
    attn_ctx c = { &io.q, &io.k, &io.v, &io.o, &b->s, &a };
    report(label, decode_err(&c, io.o.c.data), 1e-4);
    double bytes = visible_kv_bytes(len, R, &a, 2.0);
    timed(attn_call, &c, bytes);
    const result *r = &results[n_results - 1];
    printf("decode %-36s %8.2f us %7.1f GB/s %5.1f%% of 3000 GB/s (%.1f MB of K and V)\n", label, r->us, r->gbps,
           r->gbps / 30.0, bytes / 1e6);
    for (const char *cfg = configs; cfg && *cfg;) {
        char one[64];
        size_t n = strcspn(cfg, ";");
        snprintf(one, sizeof one, "%.*s", (int)(n < sizeof one ? n : sizeof one - 1), cfg);
        cfg += n + (cfg[n] == ';');
        setenv("LUMA_CUDA_ATTN_DECODE", one, 1);
        double e = decode_err(&c, io.o.c.data), us = gpu_us(attn_call, &c);
        CHECKF(e <= 1e-4, "%s with decode tuning %s: error %.2e", label, one, e);
        printf("  tuning %-22s err %.1e %8.2f us %7.1f GB/s %5.1f%%\n", one, e, us, bytes / (us * 1e3),
               bytes / (us * 1e3) / 30.0);
        unsetenv("LUMA_CUDA_ATTN_DECODE");
    }
    attn_io_free(&io);
}

static void decode_case(const dec_case *dc, const char *configs)
{
    luma_err err = { { 0 } };
    int32_t R = dc->rows;
    int32_t *len = xmalloc((size_t)R * sizeof(int32_t)), *ones = xmalloc((size_t)R * sizeof(int32_t));
    luma_kv_seq **seqs = xmalloc((size_t)R * sizeof *seqs);
    int32_t n_blocks = 0;
    for (int32_t i = 0; i < R; i++) {
        len[i] = dc->lo - 1 + (int32_t)((int64_t)(dc->hi - dc->lo) * i / (R > 1 ? R - 1 : 1));
        ones[i] = 1;
        n_blocks += len[i] / BLOCK_TOKENS + 2;
    }
    char label[48];
    if (R == 1) snprintf(label, sizeof label, "attn dec %s 1 row %d", dc->name, dc->lo);
    else snprintf(label, sizeof label, "attn dec %s %d rows %d-%d", dc->name, R, dc->lo, dc->hi);
    if (dc->window > 0) snprintf(label + strlen(label), sizeof label - strlen(label), " w%d", dc->window);
    luma_kv_layout l = { .n_pools = 1, .block_tokens = BLOCK_TOKENS, .n_kv_head = dc->n_kv, .head_dim_k = dc->d,
                         .head_dim_v = dc->d, .type = LUMA_F16 };
    luma_kv_params kp = { .n_pools = 1, .block_tokens = BLOCK_TOKENS, .copy = copy_both };
    l.n_blocks[0] = kp.n_blocks[0] = n_blocks;
    l.n_layers[0] = 1;
    luma_kv *kv = NULL;
    if (cpu->ops->kv_alloc(cpu, &l, &err) != 0 || gpu->ops->kv_alloc(gpu, &l, &err) != 0 ||
        luma_kv_new(&kp, &kv, &err) != 0) {
        CHECKF(0, "KV cache for %s: %s", label, err.msg);
    } else {
        for (int32_t i = 0; i < R; i++) seqs[i] = luma_kv_seq_new(kv);
        big_step b;
        memset(&b, 0, sizeof b);
        if (decode_fill(dc, kv, seqs, len) && big_step_build(kv, seqs, ones, R, &b) && step_begin_s(&b.s))
            decode_run(dc, &b, len, label, configs);
        big_step_free(&b);
        for (int32_t i = 0; i < R; i++) luma_kv_seq_free(kv, seqs[i]);
        luma_kv_free(kv);
    }
    free(len);
    free(ones);
    free(seqs);
}

static void test_decode_timing(void)
{
    static const dec_case cases[] = {
        { "llama", 32, 8, 128, 32, 128, 512, 0 },
        { "llama", 32, 8, 128, 128, 128, 512, 0 },
        { "llama", 32, 8, 128, 128, 129, 256, 0 },
        { "gemma", 4, 1, 256, 32, 128, 512, 0 },
        { "gemma", 4, 1, 256, 128, 128, 512, 0 },
        { "gemma", 4, 1, 256, 128, 600, 1100, WINDOW },
        { "llama", 32, 8, 128, 40, 2100, 2600, 0 },   /* 320 units past the lean kernel's reach */
        { "gemma", 4, 1, 256, 160, 1100, 1400, 0 },   /* 160 */
        { "llama", 32, 8, 128, 1, 4096, 4096, 0 },
        { "llama", 32, 8, 128, 1, 32768, 32768, 0 },
        { "gemma", 4, 1, 256, 1, 4096, 4096, 0 },
        { "gemma", 4, 1, 256, 1, 32768, 32768, 0 },
    };
    if (quick) {
        printf("decode timing: not run (LUMA_CUDA_QUICK)\n");
        return;
    }
    const char *configs = getenv("LUMA_CUDA_DECODE_CONFIGS"), *one = getenv("LUMA_CUDA_DECODE_CASE");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!one || !*one || (size_t)atoi(one) == i) decode_case(&cases[i], configs);
}

/* ---- prefill: CUDA cores against tensor cores --------------------------- */

/* A causal prefill of n rows from position 0 in one sequence, on the
 * CUDA-core kernel (LUMA_CUDA_ATTN_PREFILL=cores when the cache is made)
 * and on the tensor cores: the outputs compared, each timed, at 4 n^2 / 2 *
 * dk * heads flops (QK^T and PV over half the keys). */
static void time_prefill(const attn_shape *sh, int32_t n)
{
    luma_err err = { { 0 } };
    luma_kv_layout l = { .n_pools = 1, .block_tokens = BLOCK_TOKENS, .n_kv_head = sh->n_kv,
                         .head_dim_k = sh->dk, .head_dim_v = sh->dv, .type = LUMA_F16 };
    luma_kv_params kp = { .n_pools = 1, .block_tokens = BLOCK_TOKENS, .copy = copy_both };
    l.n_blocks[0] = kp.n_blocks[0] = n / BLOCK_TOKENS + 1;
    l.n_layers[0] = 1;
    kv_env e = { .sh = sh, .type = LUMA_F16 };
    if (luma_kv_new(&kp, &e.kv, &err) != 0) {
        CHECKF(0, "KV cache for the %s prefill timing: %s", sh->name, err.msg);
        return;
    }
    e.seq[0] = luma_kv_seq_new(e.kv);
    luma_attn a = { 0, 0, sh->n_head, sh->n_kv, sh->dk, sh->dv, 0, 1.0f / sqrtf((float)sh->dk), sh->softcap };
    int64_t qc = (int64_t)sh->n_head * sh->dk, kc = (int64_t)sh->n_kv * sh->dk, vc = (int64_t)sh->n_kv * sh->dv;
    int64_t oc = (int64_t)sh->n_head * sh->dv;
    dual q, k, v, o;
    memset(&q, 0, sizeof q);
    memset(&k, 0, sizeof k);
    memset(&v, 0, sizeof v);
    memset(&o, 0, sizeof o);
    float *hq = random_floats((size_t)(n * qc), 2.0f), *hk = random_floats((size_t)(n * kc), 1.0f);
    float *hv = random_floats((size_t)(n * vc), 1.0f);
    float *out[2] = { xmalloc((size_t)(n * oc) * sizeof(float)), xmalloc((size_t)(n * oc) * sizeof(float)) };
    double us[2] = { 0.0, 0.0 };
    attn_step as;
    memset(&as, 0, sizeof as);
    int seq0 = 0;
    if (gpu->ops->buf_alloc(gpu, &q.g, n, qc, &err) != 0 || gpu->ops->buf_alloc(gpu, &k.g, n, kc, &err) != 0 ||
        gpu->ops->buf_alloc(gpu, &v.g, n, vc, &err) != 0 || gpu->ops->buf_alloc(gpu, &o.g, n, oc, &err) != 0) {
        CHECKF(0, "buffers for the %s prefill timing: %s", sh->name, err.msg);
        goto done;
    }
    if (!cuda_ok(cudaMemcpy(q.g.data, hq, (size_t)(n * qc) * sizeof(float), cudaMemcpyHostToDevice), "upload") ||
        !cuda_ok(cudaMemcpy(k.g.data, hk, (size_t)(n * kc) * sizeof(float), cudaMemcpyHostToDevice), "upload") ||
        !cuda_ok(cudaMemcpy(v.g.data, hv, (size_t)(n * vc) * sizeof(float), cudaMemcpyHostToDevice), "upload"))
        goto done;
    for (int kernel = 0; kernel < 2; kernel++) {
        /* the kernel is chosen when the cache is made, and the step's block
         * tables follow the cache's layout: the step comes after */
        if (kernel == 0) setenv("LUMA_CUDA_ATTN_PREFILL", "cores", 1);
        else unsetenv("LUMA_CUDA_ATTN_PREFILL");
        if (gpu->ops->kv_alloc(gpu, &l, &err) != 0) {
            CHECKF(0, "kv_alloc for the %s prefill timing: %s", sh->name, err.msg);
            goto done;
        }
        if (!(kernel == 0 ? build_step(&e, &as, &seq0, &n, 1) : step_begin(&as.t))) goto done;
        gpu->ops->attention(gpu, &q.g, &k.g, &v.g, &as.t.s, &a, &o.g);
        if (!gpu_sync("prefill timing")) goto done;
        if (gpu->ops->buf_read(gpu, &o.g, out[kernel], &err) != 0) {
            CHECKF(0, "reading the %s prefill: %s", sh->name, err.msg);
            goto done;
        }
        attn_ctx c = { &q, &k, &v, &o, &as.t.s, &a };
        us[kernel] = gpu_us(attn_call, &c);
    }
    char label[48];
    snprintf(label, sizeof label, "attn %s prefill %d tc vs cores", sh->name, n);
    report(label, rel_err(out[1], out[0], (size_t)(n * oc)), 2e-3);
    results[n_results - 1].us = us[1];
    double flops = 4.0 * (double)n * (double)n / 2.0 * sh->dk * sh->n_head;
    printf("attn %s F16 causal prefill of %d rows: CUDA cores %.3f ms (%.1f TFLOP/s), tensor cores %.3f ms "
           "(%.1f TFLOP/s), %.1fx\n",
           sh->name, n, us[0] / 1e3, us[0] > 0.0 ? flops / (us[0] * 1e6) : 0.0, us[1] / 1e3,
           us[1] > 0.0 ? flops / (us[1] * 1e6) : 0.0, us[1] > 0.0 ? us[0] / us[1] : 0.0);
done:
    unsetenv("LUMA_CUDA_ATTN_PREFILL");
    step_free(&as.t);
    gpu->ops->buf_free(gpu, &q.g);
    gpu->ops->buf_free(gpu, &k.g);
    gpu->ops->buf_free(gpu, &v.g);
    gpu->ops->buf_free(gpu, &o.g);
    free(hq);
    free(hk);
    free(hv);
    free(out[0]);
    free(out[1]);
    luma_kv_seq_free(e.kv, e.seq[0]);
    luma_kv_free(e.kv);
}

static void test_prefill_timing(void)
{
    static const attn_shape shapes[] = {
        { "llama 32/8x128", 32, 8, 128, 128, 1, 0.0f },
        { "gemma 4/1x256", 4, 1, 256, 256, 1, 0.0f },
    };
    if (quick) return;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) time_prefill(&shapes[i], 4096);
}

/* ---- failures ----------------------------------------------------------- */

/* An operation given row indices that are not the step's fails at sync with
 * a message, and the backend goes on working. */
static void test_failure(void)
{
    int32_t foreign[2] = { 0, 1 };
    float one = 1.0f;
    dual x;
    dual_new(&x, 2, 1);
    dual_w w;
    tstep t;
    step_simple(&t, 2, NULL, NULL, NULL, 0);
    luma_err err = { { 0 } };
    if (dual_weight(&w, LUMA_F32, 1, 1, &one) && step_begin(&t)) {
        gpu->ops->embed(gpu, &w.g, foreign, 2, 1.0f, &x.g);
        int rc = gpu->ops->sync(gpu, &err);
        CHECKF(rc != 0 && strstr(err.msg, "step") != NULL, "sync after a foreign id list: rc %d, '%s'", rc, err.msg);
        CHECKF(gpu->ops->sync(gpu, &err) == 0, "a second sync is clean: '%s'", err.msg);
        gpu->ops->embed(gpu, &w.g, t.tokens, 1, 1.0f, &x.g);
        CHECKF(gpu_sync("embed after a failure"), "the backend works after a failure");
        printf("failure reporting: '%s'\n", err.msg);
    }
    step_free(&t);
    dual_free(&x);
}

/* ---- the default model -------------------------------------------------- */

static const char prompt[] =
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he wrote down the ships he saw, the color of the sea, and the shapes of the clouds "
    "that gathered over the northern cliffs. One autumn night, a storm rolled in from the west, and the "
    "keeper saw a small boat struggling against the waves near the rocks below the tower. He lit the great "
    "lamp, rang the bell, and ran down to the harbor";

static void test_model(void)
{
    char path[1024];
    if (!luma_test_model_path(path, sizeof path)) {
        failures++;
        printf("model: FAIL: the model file %s is missing; set LUMA_MODEL or fetch the default model into "
               "~/.cache/luma/models/\n", path);
        return;
    }
    luma_err err = { { 0 } };
    luma_model *m[2] = { NULL, NULL };
    luma_seq *s[2] = { NULL, NULL };
    static const char *names[2] = { "cpu", "cuda" };
    float *logits[2] = { NULL, NULL };
    for (int b = 0; b < 2; b++) {
        luma_model_params p;
        luma_model_params_default(&p);
        p.backend = names[b];
        p.n_threads = 2;
        p.n_ctx = 256;
        p.max_rows = 64;
        if (luma_model_load(path, &p, &m[b], &err) != 0 || !(s[b] = luma_seq_new(m[b], &err))) {
            CHECKF(0, "loading %s on %s: %s", path, names[b], err.msg);
            goto done;
        }
    }
    int32_t nv = m[0]->hp.n_vocab, ids[256];
    int64_t n = luma_tokenize(m[0]->vocab, prompt, strlen(prompt), true, false, ids, 256, &err);
    if (n < 64) {
        CHECKF(0, "the prompt gives %lld tokens, fewer than 64 (%s)", (long long)n, err.msg);
        goto done;
    }
    for (int b = 0; b < 2; b++) {
        logits[b] = xmalloc((size_t)64 * (size_t)nv * sizeof(float));
        luma_chunk c = { s[b], ids, 64, true };
        if (luma_model_run(m[b], &c, 1, logits[b], &err) != 0) {
            CHECKF(0, "prompt on %s: %s", names[b], err.msg);
            goto done;
        }
    }
    int agree = 0;
    double max_diff = 0.0;
    for (int32_t r = 0; r < 64; r++) {
        const float *a = logits[0] + (size_t)r * (size_t)nv, *g = logits[1] + (size_t)r * (size_t)nv;
        agree += argmax(a, nv) == argmax(g, nv);
        for (int32_t i = 0; i < nv; i++) {
            double d = fabs((double)a[i] - (double)g[i]);
            if (!(d <= max_diff)) max_diff = d;   /* NaN sticks */
        }
    }
    printf("model: 64-token prompt: top-1 agrees on %d of 64 rows, max abs logit diff %.4f\n", agree, max_diff);
    CHECKF(agree >= 58 && isfinite(max_diff), "prompt logits: top-1 agreement %d of 64, max abs diff %g", agree,
           max_diff);

    /* greedy, in lockstep from the prompt's last row */
    int32_t tok[2] = { argmax(logits[0] + (size_t)63 * (size_t)nv, nv), argmax(logits[1] + (size_t)63 * (size_t)nv, nv) };
    const float *last[2] = { logits[0] + (size_t)63 * (size_t)nv, logits[1] + (size_t)63 * (size_t)nv };
    int same = 0;
    for (; same < 32; same++) {
        if (tok[0] != tok[1]) {
            double margin = (double)last[0][tok[0]] - (double)last[0][tok[1]];
            printf("model: greedy continuations part at token %d (cpu %d, cuda %d, cpu margin %.3f)\n", same, tok[0],
                   tok[1], margin);
            CHECKF(margin < 0.3, "greedy continuations part at token %d with a cpu margin of %.3f", same, margin);
            break;
        }
        for (int b = 0; b < 2; b++) {
            luma_chunk c = { s[b], &tok[b], 1, false };
            if (luma_model_run(m[b], &c, 1, logits[b], &err) != 0) {
                CHECKF(0, "greedy step on %s: %s", names[b], err.msg);
                goto done;
            }
            last[b] = logits[b];
        }
        tok[0] = argmax(last[0], nv);
        tok[1] = argmax(last[1], nv);
    }
    if (same == 32) printf("model: 32 greedy tokens identical on both backends\n");
done:
    for (int b = 0; b < 2; b++) {
        free(logits[b]);
        luma_seq_free(s[b]);
        luma_model_free(m[b]);
    }
}

/* ---- main --------------------------------------------------------------- */

static void print_table(void)
{
    printf("\n%-40s %10s %7s %10s %8s\n", "op", "rel err", "tol", "GPU us", "GB/s");
    for (int i = 0; i < n_results; i++) {
        const result *r = &results[i];
        printf("%-40s %10.2e %7.0e", r->op, r->err, r->tol);
        if (r->us > 0.0) printf(" %10.2f %8.1f", r->us, r->gbps);
        printf("%s\n", r->err <= r->tol ? "" : "  FAIL");
    }
}

static int run_checks(void)
{
    luma_err err = { { 0 } };
    const char *q = getenv("LUMA_CUDA_QUICK");
    quick = q && *q && strcmp(q, "0") != 0;
    cpu = luma_backend_cpu_new(2, &err);
    if (cpu) gpu = luma_backend_cuda_new(0, &err);
    if (!cpu || !gpu) {
        printf("test_cuda: FAIL: creating the backends: %s\n", err.msg);
        return 1;
    }
    const char *only = getenv("LUMA_CUDA_ONLY");
    bool timing_only = only && strcmp(only, "prefill-timing") == 0;
    bool decode_only = only && strcmp(only, "decode-timing") == 0;
    bool attention_only = timing_only || decode_only || (only && strcmp(only, "attention") == 0);
    if (!quick && !cuda_ok(cudaMalloc(&queue_mem, QUEUE_BYTES), "cudaMalloc (timing queue)")) return 1;
    if (!attention_only) {
        test_embed();
        test_rmsnorm();
        test_qk_rope();
        test_qkv_bias_rope();
        test_qkv_rope();
        test_qkv_rope_biases();
        test_qkv_heads();
        test_ffn_gated();
        test_add_rmsnorm();
        test_rope();
        test_elementwise();
        test_bias_gather();
        test_failure();   /* before any KV layout: its step has no block tables */
    }
    if (!timing_only && !decode_only) test_attention();
    if (!timing_only) test_decode_timing();
    if (!decode_only) test_prefill_timing();
    cpu->ops->free(cpu);
    gpu->ops->free(gpu);
    if (queue_mem) cudaFree(queue_mem);
    if (attention_only) printf("model: not run (LUMA_CUDA_ONLY=%s)\n", only);
    else if (quick) printf("model: not run (LUMA_CUDA_QUICK)\n");
    else test_model();
    print_table();
    return 0;
}

int main(void)
{
    rnd_seed(0x2545f4914f6cdd1dULL);
    if (!luma_backend_cuda_available()) {
        printf("test_cuda: no CUDA device, the GPU checks did not run\n");
        return 0;
    }
    if (run_checks() != 0) return 1;
    if (failures) {
        printf("test_cuda: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda: all checks passed\n");
    return 0;
}
