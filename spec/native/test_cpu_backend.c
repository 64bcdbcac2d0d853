/* The CPU backend (src/cpu/), each piece against a plain reference on
 * random data:
 *   - the pool runs every job once on each thread, and its split covers
 *     every item exactly once;
 *   - the vector primitives (vec.h): the chosen versions equal the portable
 *     ones up to float rounding, and exp, GELU and SiLU equal the double
 *     formulas to 1e-5;
 *   - weight panels (quant_simd.h): every panel format equals the tile
 *     kernels on the same activations, the rows kernel equals the panel bit
 *     for bit, and a partial panel writes only its rows;
 *   - the backend's operations: matmul (tiles, the panels' rows kernel,
 *     panels) equals the scalar dot of the same quantized activations, and
 *     a row alone gives the same bits as in a batch; rmsnorm, RoPE (both
 *     kinds, partial rotation, frequency factors, tables that follow changed
 *     positions), GELU/SiLU and add equal their formulas;
 *     attention over the paged cache (F16 and F32, two sequences in one
 *     step, a sliding window, a soft cap, a prefill then more rows) equals a
 *     double-precision softmax over the stored keys and values, and a
 *     prefill gives the same bits as its rows evaluated one per step. */
#include "backend.h"
#include "cpu/pool.h"
#include "cpu/quant_simd.h"
#include "cpu/vec.h"
#include "quant.h"
#include "testutil.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void random_floats(float *x, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++) x[i] = uniform(lo, hi);
}

/* sum |w_k a_k| of a weight row and an activation row (dequantized): the
 * scale of the rounding a dot may carry. */
static double abs_dot(enum luma_type t, int64_t n, const void *w, const void *a)
{
    float *wf = xmalloc((size_t)n * sizeof(float)), *af = xmalloc((size_t)n * sizeof(float));
    luma_dequantize_row(t, w, wf, n);
    luma_dequantize_row(luma_type_get(t)->act_type, a, af, n);
    double s = 0;
    for (int64_t k = 0; k < n; k++) s += fabs((double)wf[k] * af[k]);
    free(wf);
    free(af);
    return s;
}

/* ---- pool --------------------------------------------------------------- */

typedef struct {
    atomic_int calls[8];
    atomic_int bad;
} pool_probe;

static void probe_job(void *ctx, int ith, int nth)
{
    pool_probe *p = ctx;
    if (nth != 3 || ith < 0 || ith >= 3) atomic_fetch_add(&p->bad, 1);
    else atomic_fetch_add(&p->calls[ith], 1);
}

static void test_pool(void)
{
    int checks = 0;
    luma_pool *pool = luma_pool_new(3);
    CHECKF(pool && luma_pool_size(pool) == 3, "a pool of 3");
    checks++;
    if (pool) {
        pool_probe p = { 0 };
        const int runs = 20000;
        for (int i = 0; i < runs; i++) luma_pool_run(pool, probe_job, &p);
        for (int i = 0; i < 3; i++, checks++)
            CHECKF(atomic_load(&p.calls[i]) == runs, "thread %d ran %d of %d jobs", i, atomic_load(&p.calls[i]), runs);
        CHECKF(atomic_load(&p.bad) == 0, "jobs saw a bad index");
        checks++;
        luma_pool_free(pool);
    }
    for (long n = 0; n < 40; n++)
        for (int nth = 1; nth <= 5; nth++, checks++) {
            long covered = 0, expect = 0;
            for (int ith = 0; ith < nth; ith++) {
                long lo, hi;
                luma_pool_split(n, ith, nth, &lo, &hi);
                if (lo != expect || hi < lo) covered = -1000;
                covered += hi - lo;
                expect = hi;
            }
            CHECKF(covered == n && expect == n, "split of %ld over %d", n, nth);
        }
    printf("pool: %d checks\n", checks);
}

/* ---- vector primitives -------------------------------------------------- */

static bool close_to(double got, double want, double rel, double abs_tol)
{
    return fabs(got - want) <= rel * fabs(want) + abs_tol;
}

static void test_vec(void)
{
    const luma_vec_ops *v = luma_vec_get(), *r = luma_vec_ref();
    int checks = 0;
    enum { MAXN = 300, MAXQ = 7, MAXK = 6 };
    float *q = xmalloc(MAXQ * MAXN * sizeof(float)), *kf = xmalloc(MAXK * MAXN * sizeof(float));
    uint16_t *kh = xmalloc(MAXK * MAXN * sizeof(uint16_t));
    float *o1 = xmalloc(MAXQ * MAXN * sizeof(float)), *o2 = xmalloc(MAXQ * MAXN * sizeof(float));
    float s1[MAXQ * MAXK], s2[MAXQ * MAXK], p[MAXQ * MAXK];
    static const int64_t ns[] = { 1, 7, 8, 40, 64, 256, 263 };
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        int64_t n = ns[ni];
        random_floats(q, MAXQ * MAXN, -1, 1);
        random_floats(kf, MAXK * MAXN, -1, 1);
        v->f32_to_f16(MAXK * MAXN, kf, kh);
        for (int i = 0; i < MAXK * MAXN; i++, checks++) CHECKF(kh[i] == luma_f32_to_f16(kf[i]), "f32_to_f16 at %d", i);
        for (int nq = 1; nq <= MAXQ; nq++)
            for (int nk = 1; nk <= MAXK; nk++) {
                const float *qp[MAXQ];
                float *op1[MAXQ], *op2[MAXQ];
                for (int i = 0; i < nq; i++) {
                    /* uneven spacing, as attention gives */
                    qp[i] = q + (size_t)((i * 3) % MAXQ) * MAXN;
                    op1[i] = o1 + (size_t)i * MAXN;
                    op2[i] = o2 + (size_t)i * MAXN;
                }
                for (int f16 = 0; f16 < 2; f16++) {
                    if (f16) {
                        v->qk_f16(n, qp, nq, kh, MAXN, nk, s1, MAXK);
                        r->qk_f16(n, qp, nq, kh, MAXN, nk, s2, MAXK);
                    } else {
                        v->qk_f32(n, qp, nq, kf, MAXN, nk, s1, MAXK);
                        r->qk_f32(n, qp, nq, kf, MAXN, nk, s2, MAXK);
                    }
                    for (int i = 0; i < nq; i++)
                        for (int j = 0; j < nk; j++, checks++)
                            CHECKF(close_to(s1[i * MAXK + j], s2[i * MAXK + j], 1e-5, 1e-5 * (double)n),
                                  "qk f16=%d n=%lld (%d,%d): %g vs %g", f16, (long long)n, i, j,
                                  s1[i * MAXK + j], s2[i * MAXK + j]);
                    random_floats(p, MAXQ * MAXK, 0, 1);
                    random_floats(o1, MAXQ * MAXN, -1, 1);
                    memcpy(o2, o1, MAXQ * MAXN * sizeof(float));
                    if (f16) {
                        v->pv_f16(n, op1, nq, p, MAXK, kh, MAXN, nk);
                        r->pv_f16(n, op2, nq, p, MAXK, kh, MAXN, nk);
                    } else {
                        v->pv_f32(n, op1, nq, p, MAXK, kf, MAXN, nk);
                        r->pv_f32(n, op2, nq, p, MAXK, kf, MAXN, nk);
                    }
                    for (int i = 0; i < MAXQ * MAXN; i++, checks++)
                        CHECKF(close_to(o1[i], o2[i], 1e-5, 1e-5), "pv f16=%d n=%lld nq=%d nk=%d at %d: %g vs %g", f16,
                              (long long)n, nq, nk, i, o1[i], o2[i]);
                }
            }
        float sq1 = v->sum_sq(n, q), sq2 = r->sum_sq(n, q);
        CHECKF(close_to(sq1, sq2, 1e-5, 0), "sum_sq n=%lld: %g vs %g", (long long)n, sq1, sq2);
        checks++;
    }
    /* exp over a wide range (and -inf, for masked scores), GELU and SiLU */
    enum { NE = 1003 };
    float *x = xmalloc(NE * sizeof(float)), *y = xmalloc(NE * sizeof(float)), *u = xmalloc(NE * sizeof(float));
    float *g = xmalloc(NE * sizeof(float));
    random_floats(x, NE, -100, 10);
    x[5] = -INFINITY;
    x[6] = 0;
    double want_sum = 0;
    /* x - m is rounded to float first, as the kernels do */
    for (int i = 0; i < NE; i++) want_sum += exp((double)(x[i] - 3.0f));
    float got_sum = v->exp_sum(NE, x, 3.0f, y);
    for (int i = 0; i < NE; i++, checks++)
        CHECKF(close_to(y[i], exp((double)(x[i] - 3.0f)), 1e-6, 1e-37), "exp(%g) = %g", x[i] - 3.0, y[i]);
    CHECKF(close_to(got_sum, want_sum, 1e-5, 0) && y[5] == 0, "exp_sum %g vs %g", got_sum, want_sum);
    checks++;
    for (int act = 0; act < 2; act++) {
        random_floats(g, NE, -12, 12);
        g[0] = 0;
        g[1] = -60;
        g[2] = 60;
        random_floats(u, NE, -2, 2);
        memcpy(x, g, NE * sizeof(float));
        if (act == 0) v->gelu_mul(NE, g, u);
        else v->silu_mul(NE, g, u);
        for (int i = 0; i < NE; i++, checks++) {
            double z = x[i];
            double want = act == 0 ? 0.5 * z * (1 + tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))) * u[i]
                                   : z / (1 + exp(-z)) * u[i];
            CHECKF(close_to(g[i], want, 1e-5, 1e-6), "%s(%g) * %g = %g, want %g", act ? "silu" : "gelu", z, u[i], g[i],
                  want);
        }
    }
    free(q), free(kf), free(kh), free(o1), free(o2), free(x), free(y), free(u), free(g);
    printf("vec: %d checks (%s)\n", checks, v == r ? "portable" : "avx2");
}

/* ---- weight panels ------------------------------------------------------ */

static void test_panels(void)
{
#if defined(__x86_64__)
    if (strcmp(luma_simd_name(), "avx2") != 0) {
        printf("panels: not run (no AVX2 on this CPU)\n");
        return;
    }
    static const enum luma_type types[] = { LUMA_Q4_0, LUMA_Q4_1, LUMA_Q5_0, LUMA_Q5_1, LUMA_Q8_0 };
    /* more blocks than the rows kernel takes at once (EXACT_SEG, 32) */
    const int64_t n = 1248;
    const int na = 7, os = LUMA_PANEL_ROWS + 3;
    int checks = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        enum luma_type t = types[ti], at = luma_type_get(t)->act_type;
        const luma_panel_ops *po = luma_panel_avx2(t);
        CHECKF(po != NULL && at == LUMA_Q8_0, "%s has panels", luma_type_name(t));
        checks++;
        if (!po) continue;
        size_t ws = luma_row_size(t, n), as = luma_row_size(at, n);
        uint8_t *w = xmalloc(ws * LUMA_PANEL_ROWS), *a = xmalloc(as * (size_t)na);
        uint8_t *panel = xmalloc((size_t)(n / LUMA_QK) * po->block_bytes);
        luma_panel_act *pa = xmalloc(sizeof *pa * (size_t)(n / LUMA_QK) * (size_t)na);
        float *x = xmalloc((size_t)n * sizeof(float));
        for (int i = 0; i < LUMA_PANEL_ROWS; i++) random_weights(t, n, w + (size_t)i * ws);
        for (int j = 0; j < na; j++) {
            random_floats(x, n, -1, 1);
            x[j] = 30.0f; /* an outlier, as real activations have */
            luma_quantize_act(at, x, a + (size_t)j * as, n);
            luma_panel_act_avx2((const luma_block_q8_0 *)(a + (size_t)j * as), n, pa + (size_t)j * (size_t)(n / LUMA_QK));
        }
        for (int nr = LUMA_PANEL_ROWS; nr >= 3; nr -= 5) {
            float want[LUMA_PANEL_ROWS * 7], got[7 * (LUMA_PANEL_ROWS + 3)];
            for (int i = 0; i < 7 * os; i++) got[i] = 12345.0f;
            luma_vec_dot_rows(t, n, w, ws, nr, a, as, na, want, LUMA_PANEL_ROWS);
            po->pack(n, w, ws, nr, panel);
            for (int j = 1; j <= na; j += 3) {
                /* 1, 4 and 7 rows: tiles of 1; 4; 4, 2 and 1 */
                po->dot(n, panel, nr, pa, sizeof *pa * (size_t)(n / LUMA_QK), j, got, (size_t)os);
                float direct[7 * (LUMA_PANEL_ROWS + 3)];
                po->rows(n, w, ws, nr, pa, sizeof *pa * (size_t)(n / LUMA_QK), j, direct, (size_t)os);
                for (int r = 0; r < j; r++, checks++)
                    CHECKF(memcmp(direct + r * os, got + r * os, (size_t)nr * sizeof(float)) == 0,
                          "%s: the rows kernel differs from the panel (%d rows, activation row %d)", luma_type_name(t),
                          nr, r);
                for (int r = 0; r < j; r++)
                    for (int i = 0; i < os; i++, checks++) {
                        float g = got[r * os + i];
                        if (i >= nr) {
                            CHECKF(g == 12345.0f, "%s: a panel of %d rows wrote column %d", luma_type_name(t), nr, i);
                            continue;
                        }
                        double scale = abs_dot(t, n, w + (size_t)i * ws, a + (size_t)r * as);
                        float wv = want[r * LUMA_PANEL_ROWS + i];
                        CHECKF(fabs(g - wv) <= 1e-5 * scale + 1e-6, "%s: panel (%d, %d) = %g, tiles %g (scale %g)",
                              luma_type_name(t), r, i, g, wv, scale);
                    }
            }
        }
        free(w), free(a), free(panel), free(pa), free(x);
    }
    printf("panels: %d checks (%d formats, full and partial panels)\n", checks, (int)(sizeof types / sizeof types[0]));
#else
    printf("panels: not run (not x86-64)\n");
#endif
}

/* ---- backend operations ------------------------------------------------- */

static luma_backend *new_backend(int threads)
{
    luma_err err = { { 0 } };
    luma_backend *be = luma_backend_cpu_new(threads, &err);
    if (!be) {
        printf("cannot start the CPU backend: %s\n", err.msg);
        exit(1);
    }
    return be;
}

static luma_buf new_buf(luma_backend *be, int64_t rows, int64_t cols)
{
    luma_err err = { { 0 } };
    luma_buf b;
    if (be->ops->buf_alloc(be, &b, rows, cols, &err)) {
        printf("buf_alloc: %s\n", err.msg);
        exit(1);
    }
    return b;
}

static void test_matmul(luma_backend *be)
{
    static const enum luma_type types[] = { LUMA_F32, LUMA_Q5_0, LUMA_Q8_0, LUMA_Q4_K, LUMA_Q6_K };
    /* legacy formats: the rows kernel, then panels from 4 rows (16 for Q8_0); K formats: tiles */
    static const int32_t ms[] = { 1, 3, 4, 9, 17 };
    const int64_t n = 512, rows = 37;
    int checks = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        enum luma_type t = types[ti], at = luma_type_get(t)->act_type;
        size_t ws = luma_row_size(t, n), as = luma_row_size(at, n);
        uint8_t *w = xmalloc(ws * (size_t)rows), *a = xmalloc(as);
        for (int64_t i = 0; i < rows; i++) random_weights(t, n, w + (size_t)i * ws);
        luma_weight wt = { .type = t, .rows = rows, .cols = n, .host = w };
        luma_vec_dot_fn dot = luma_vec_dot_ref(t);
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
            int32_t m = ms[mi];
            luma_buf x = new_buf(be, m, n), y = new_buf(be, m, rows);
            random_floats(x.data, m * n, -1, 1);
            be->ops->matmul(be, &wt, &x, &y);
            CHECKF(y.rows == m && y.cols == rows, "matmul shape");
            checks++;
            /* each row alone gives the same bits as in the batch */
            for (int32_t j = 0; j < m; j++, checks++) {
                luma_buf xj = luma_buf_rows(&x, j, 1), yj = new_buf(be, 1, rows);
                be->ops->matmul(be, &wt, &xj, &yj);
                CHECKF(memcmp(yj.data, y.data + (size_t)j * (size_t)rows, (size_t)rows * sizeof(float)) == 0,
                      "matmul %s: row %d of %d differs from the row alone", luma_type_name(t), j, m);
                be->ops->buf_free(be, &yj);
            }
            for (int32_t j = 0; j < m; j++) {
                luma_quantize_act_ref(at, x.data + (size_t)j * (size_t)n, a, n);
                for (int64_t i = 0; i < rows; i++, checks++) {
                    float want = dot(n, w + (size_t)i * ws, a);
                    double scale = t == LUMA_F32 ? (double)n : abs_dot(t, n, w + (size_t)i * ws, a);
                    float got = y.data[(size_t)j * (size_t)rows + (size_t)i];
                    CHECKF(fabs(got - want) <= 1e-5 * scale + 1e-6, "matmul %s M=%d (%d, %lld): %g, want %g",
                          luma_type_name(t), m, j, (long long)i, got, want);
                }
            }
            be->ops->buf_free(be, &x);
            be->ops->buf_free(be, &y);
        }
        free(w), free(a);
    }
    printf("matmul: %d checks (tiles and panels, %d formats, rows alone equal rows in a batch)\n", checks,
           (int)(sizeof types / sizeof types[0]));
}

static void test_elementwise(luma_backend *be)
{
    int checks = 0;
    /* small and large (pool) sizes */
    static const int64_t rows_list[] = { 2, 40 };
    for (size_t ri = 0; ri < 2; ri++) {
        int64_t rows = rows_list[ri], cols = 1024;
        luma_buf x = new_buf(be, rows, cols), y = new_buf(be, rows, cols), z = new_buf(be, rows, cols);
        float *x0 = xmalloc((size_t)(rows * cols) * sizeof(float));
        random_floats(x.data, rows * cols, -6, 6);
        random_floats(y.data, rows * cols, -2, 2);
        memcpy(x0, x.data, (size_t)(rows * cols) * sizeof(float));
        be->ops->gelu_mul(be, &x, &y);
        for (int64_t i = 0; i < rows * cols; i++, checks++) {
            double v = x0[i], want = 0.5 * v * (1 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))) * y.data[i];
            CHECKF(close_to(x.data[i], want, 1e-5, 1e-6), "gelu_mul at %lld", (long long)i);
        }
        memcpy(x.data, x0, (size_t)(rows * cols) * sizeof(float));
        be->ops->silu_mul(be, &x, &y);
        for (int64_t i = 0; i < rows * cols; i++, checks++) {
            double v = x0[i], want = v / (1 + exp(-v)) * y.data[i];
            CHECKF(close_to(x.data[i], want, 1e-5, 1e-6), "silu_mul at %lld", (long long)i);
        }
        memcpy(x.data, x0, (size_t)(rows * cols) * sizeof(float));
        be->ops->add(be, &x, &y);
        for (int64_t i = 0; i < rows * cols; i++, checks++)
            CHECKF(x.data[i] == x0[i] + y.data[i], "add at %lld", (long long)i);
        /* rmsnorm of whole rows, then of groups of 64, into another buffer */
        float *g = xmalloc((size_t)cols * sizeof(float));
        random_floats(g, cols, 0.5f, 1.5f);
        luma_weight gw = { .type = LUMA_F32, .rows = 1, .cols = cols, .host = g };
        for (int64_t group = cols; group >= 64; group /= 16) {
            memcpy(x.data, x0, (size_t)(rows * cols) * sizeof(float));
            be->ops->rmsnorm(be, &x, &gw, group, 1e-6f, &z);
            for (int64_t i = 0; i < rows * cols / group; i++) {
                double ss = 0;
                for (int64_t k = 0; k < group; k++) ss += (double)x0[i * group + k] * x0[i * group + k];
                double s = 1 / sqrt(ss / (double)group + 1e-6);
                for (int64_t k = 0; k < group; k++, checks++)
                    CHECKF(close_to(z.data[i * group + k], x0[i * group + k] * s * g[k], 1e-5, 1e-6), "rmsnorm");
            }
        }
        free(g);
        free(x0);
        be->ops->buf_free(be, &x);
        be->ops->buf_free(be, &y);
        be->ops->buf_free(be, &z);
    }
    printf("elementwise: %d checks (gelu_mul, silu_mul, add, rmsnorm)\n", checks);
}

static void rope_reference(const float *x, float *out, int64_t rows, int64_t cols, int32_t hd, const int32_t *pos,
                           const luma_rope *r)
{
    memcpy(out, x, (size_t)(rows * cols) * sizeof(float));
    int32_t half = r->n_dims / 2;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t h = 0; h < cols / hd; h++)
            for (int32_t i = 0; i < half; i++) {
                double theta = pos[row] * (double)r->pos_scale * pow(r->base, -2.0 * i / r->n_dims);
                if (r->freq_factors) theta /= r->freq_factors[i];
                int32_t a = r->kind == LUMA_ROPE_NEOX ? i : 2 * i, b = r->kind == LUMA_ROPE_NEOX ? i + half : 2 * i + 1;
                const float *v = x + row * cols + h * hd;
                float *o = out + row * cols + h * hd;
                o[a] = (float)(v[a] * cos(theta) - v[b] * sin(theta));
                o[b] = (float)(v[a] * sin(theta) + v[b] * cos(theta));
            }
}

static void test_rope(luma_backend *be)
{
    const int64_t rows = 6, hd = 32, cols = 3 * hd;
    int32_t pos[6] = { 0, 1, 2, 50, 51, 700 };
    float ff[8] = { 1, 1, 2, 4, 1, 8, 1, 1 };
    luma_rope settings[] = {
        { LUMA_ROPE_NEOX, 32, 10000.0f, 1.0f, NULL },
        { LUMA_ROPE_NORM, 16, 500000.0f, 0.25f, ff },
        { LUMA_ROPE_NEOX, 32, 1000000.0f, 1.0f, NULL },
    };
    luma_buf x = new_buf(be, rows, cols);
    float *x0 = xmalloc((size_t)(rows * cols) * sizeof(float)), *want = xmalloc((size_t)(rows * cols) * sizeof(float));
    int checks = 0;
    /* three settings in turn (more than the backend keeps), the same
     * position array changed in place between rounds */
    for (int round = 0; round < 4; round++) {
        if (round == 2)
            for (int i = 0; i < rows; i++) pos[i] += 17;
        for (size_t si = 0; si < sizeof settings / sizeof settings[0]; si++) {
            random_floats(x0, rows * cols, -1, 1);
            memcpy(x.data, x0, (size_t)(rows * cols) * sizeof(float));
            be->ops->rope(be, &x, (int32_t)hd, pos, &settings[si]);
            rope_reference(x0, want, rows, cols, (int32_t)hd, pos, &settings[si]);
            /* float angles carry about pos x 6e-8 radians of rounding */
            for (int64_t i = 0; i < rows * cols; i++, checks++)
                CHECKF(close_to(x.data[i], want[i], 2e-4, 2e-5 + 2e-7 * pos[i / cols]),
                      "rope setting %zu round %d at %lld: %g, want %g", si, round, (long long)i, x.data[i], want[i]);
        }
    }
    free(x0), free(want);
    be->ops->buf_free(be, &x);
    printf("rope: %d checks (NEOX, NORM with factors, partial rotation, changed positions)\n", checks);
}

/* Attention: one pool of 12 blocks of 16, two layers, 4 query heads over 2
 * KV heads. Sequence A holds blocks {3, 0, 6, 1, 2, 4, 7, 8, 9, 10}, B
 * holds {5}. Step 1 is A's prefill of 130 rows (several key chunks); step 2
 * is 7 more rows of A and B's first 2; step 3 one more row of A (decode). */
enum { AB = 16, AHQ = 4, AHK = 2, ADK = 64, ADV = 40, APRE = 130, AMAX = 160 };

typedef struct {
    float *k, *v;   /* [pos][AHK][dk or dv] as stored (F16-rounded) */
} attn_ref_seq;

static void attn_reference(const float *q, int64_t qcols, const attn_ref_seq *rs, int32_t pos, const luma_attn *a,
                           float *out)
{
    for (int h = 0; h < AHQ; h++) {
        int kvh = h / (AHQ / AHK);
        int32_t first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        double w[AMAX], mx = -INFINITY, sum = 0;
        for (int32_t k = first; k <= pos; k++) {
            double s = 0;
            for (int d = 0; d < ADK; d++) s += (double)q[h * ADK + d] * rs->k[((size_t)k * AHK + (size_t)kvh) * ADK + (size_t)d];
            s *= a->scale;
            if (a->softcap > 0) s = a->softcap * tanh(s / a->softcap);
            w[k - first] = s;
            if (s > mx) mx = s;
        }
        for (int32_t k = first; k <= pos; k++) sum += (w[k - first] = exp(w[k - first] - mx));
        for (int d = 0; d < ADV; d++) {
            double o = 0;
            for (int32_t k = first; k <= pos; k++)
                o += w[k - first] / sum * rs->v[((size_t)k * AHK + (size_t)kvh) * ADV + (size_t)d];
            out[h * ADV + d] = (float)o;
        }
    }
    (void)qcols;
}

static void test_attention(int threads, enum luma_type kv_type)
{
    luma_backend *be = new_backend(threads);
    luma_err err = { { 0 } };
    luma_kv_layout l = { 0 };
    l.n_pools = 1;
    l.block_tokens = AB;
    l.n_blocks[0] = 12;
    l.n_layers[0] = 2;
    l.n_kv_head = AHK;
    l.head_dim_k = ADK;
    l.head_dim_v = ADV;
    l.type = kv_type;
    CHECKF(be->ops->kv_alloc(be, &l, &err) == 0, "kv_alloc: %s", err.msg);
    static const int32_t blocks_a[] = { 3, 0, 6, 1, 2, 4, 7, 8, 9, 10 }, blocks_b[] = { 5 };
    luma_attn layers[2] = {
        { 0, 0, AHQ, AHK, ADK, ADV, 5, 0.125f, 0.0f },     /* a window of 5 */
        { 0, 1, AHQ, AHK, ADK, ADV, 0, 0.125f, 30.0f },    /* full, soft cap */
    };
    attn_ref_seq ref[2][2];   /* [layer][sequence] */
    for (int li = 0; li < 2; li++)
        for (int s = 0; s < 2; s++) {
            ref[li][s].k = xmalloc(AMAX * AHK * ADK * sizeof(float));
            ref[li][s].v = xmalloc(AMAX * AHK * ADV * sizeof(float));
        }
    int checks = 0;
    for (int stepi = 0; stepi < 3; stepi++) {
        static const int32_t rows_a[] = { APRE, 7, 1 }, rows_b[] = { 0, 2, 0 }, pos_a[] = { 0, APRE, APRE + 7 };
        int32_t n_rows = rows_a[stepi] + rows_b[stepi];
        int32_t tokens[APRE] = { 0 }, pos[APRE], out_rows[1] = { 0 }, row_seq[APRE];
        luma_step_seq seqs[2] = { { 0 } };
        seqs[0].n_rows = rows_a[stepi];
        seqs[0].pos0 = pos_a[stepi];
        seqs[0].blocks[0] = blocks_a;
        seqs[0].n_blocks[0] = 10;
        seqs[1].row0 = rows_a[stepi];
        seqs[1].n_rows = rows_b[stepi];
        seqs[1].blocks[0] = blocks_b;
        seqs[1].n_blocks[0] = 1;
        int n_seqs = rows_b[stepi] ? 2 : 1;
        for (int s = 0; s < n_seqs; s++)
            for (int r = 0; r < seqs[s].n_rows; r++) {
                pos[seqs[s].row0 + r] = seqs[s].pos0 + r;
                row_seq[seqs[s].row0 + r] = s;
            }
        luma_step step = { n_rows, tokens, pos, n_seqs, seqs, 1, out_rows };
        for (int li = 0; li < 2; li++) {
            luma_buf q = new_buf(be, n_rows, AHQ * ADK), k = new_buf(be, n_rows, AHK * ADK);
            luma_buf v = new_buf(be, n_rows, AHK * ADV), o = new_buf(be, n_rows, AHQ * ADV);
            random_floats(q.data, n_rows * AHQ * ADK, -1, 1);
            random_floats(k.data, n_rows * AHK * ADK, -1, 1);
            random_floats(v.data, n_rows * AHK * ADV, -1, 1);
            for (int r = 0; r < n_rows; r++) {
                attn_ref_seq *rs = &ref[li][row_seq[r]];
                for (int i = 0; i < AHK * ADK; i++) {
                    float x = k.data[r * AHK * ADK + i];
                    rs->k[(size_t)pos[r] * AHK * ADK + (size_t)i] = kv_type == LUMA_F16 ? luma_f16_to_f32(luma_f32_to_f16(x)) : x;
                }
                for (int i = 0; i < AHK * ADV; i++) {
                    float x = v.data[r * AHK * ADV + i];
                    rs->v[(size_t)pos[r] * AHK * ADV + (size_t)i] = kv_type == LUMA_F16 ? luma_f16_to_f32(luma_f32_to_f16(x)) : x;
                }
            }
            be->ops->attention(be, &q, &k, &v, &step, &layers[li], &o);
            CHECKF(o.rows == n_rows && o.cols == AHQ * ADV, "attention output shape");
            for (int r = 0; r < n_rows; r++) {
                float want[AHQ * ADV];
                attn_reference(q.data + r * AHQ * ADK, AHQ * ADK, &ref[li][row_seq[r]], pos[r], &layers[li], want);
                for (int i = 0; i < AHQ * ADV; i++, checks++)
                    CHECKF(close_to(o.data[r * AHQ * ADV + i], want[i], 1e-4, 1e-5),
                          "attention %s layer %d step %d row %d at %d: %g, want %g", luma_type_name(kv_type), li, stepi,
                          r, i, o.data[r * AHQ * ADV + i], want[i]);
            }
            be->ops->buf_free(be, &q), be->ops->buf_free(be, &k), be->ops->buf_free(be, &v), be->ops->buf_free(be, &o);
        }
    }
    CHECKF(be->ops->sync(be, &err) == 0, "sync after attention: %s", err.msg);
    for (int li = 0; li < 2; li++)
        for (int s = 0; s < 2; s++) free(ref[li][s].k), free(ref[li][s].v);
    be->ops->free(be);
    printf("attention %s, %d threads: %d checks\n", luma_type_name(kv_type), threads, checks);
}

/* Attention of 100 rows of one sequence in one step, in steps of 7 rows and
 * in steps of 1 row: the same bits (full and windowed layers). */
static void test_attention_batching(int threads, enum luma_type kv_type)
{
    enum { N = 100 };
    static const int32_t chunk_rows[] = { N, 7, 1 };
    int32_t blocks[(N + AB - 1) / AB];
    for (int i = 0; i < (N + AB - 1) / AB; i++) blocks[i] = ((N + AB - 1) / AB - 1 - i);
    float *qd = xmalloc(N * AHQ * ADK * sizeof(float)), *kd = xmalloc(N * AHK * ADK * sizeof(float));
    float *vd = xmalloc(N * AHK * ADV * sizeof(float)), *outs[3];
    random_floats(qd, N * AHQ * ADK, -2, 2);
    random_floats(kd, N * AHK * ADK, -2, 2);
    random_floats(vd, N * AHK * ADV, -1, 1);
    luma_attn layers[2] = {
        { 0, 0, AHQ, AHK, ADK, ADV, 37, 0.125f, 0.0f },
        { 0, 1, AHQ, AHK, ADK, ADV, 0, 0.125f, 0.0f },
    };
    int checks = 0;
    for (int li = 0; li < 2; li++) {
        for (int ci = 0; ci < 3; ci++) {
            luma_backend *be = new_backend(threads);
            luma_err err = { { 0 } };
            luma_kv_layout l = { 0 };
            l.n_pools = 1;
            l.block_tokens = AB;
            l.n_blocks[0] = (N + AB - 1) / AB;
            l.n_layers[0] = 2;
            l.n_kv_head = AHK;
            l.head_dim_k = ADK;
            l.head_dim_v = ADV;
            l.type = kv_type;
            CHECKF(be->ops->kv_alloc(be, &l, &err) == 0, "kv_alloc: %s", err.msg);
            outs[ci] = xmalloc(N * AHQ * ADV * sizeof(float));
            luma_buf q = new_buf(be, N, AHQ * ADK), k = new_buf(be, N, AHK * ADK);
            luma_buf v = new_buf(be, N, AHK * ADV), o = new_buf(be, N, AHQ * ADV);
            memcpy(q.data, qd, N * AHQ * ADK * sizeof(float));
            memcpy(k.data, kd, N * AHK * ADK * sizeof(float));
            memcpy(v.data, vd, N * AHK * ADV * sizeof(float));
            for (int32_t r0 = 0; r0 < N; r0 += chunk_rows[ci]) {
                int32_t n = N - r0 < chunk_rows[ci] ? N - r0 : chunk_rows[ci];
                int32_t tokens[N] = { 0 }, pos[N], out_row = 0;
                for (int32_t r = 0; r < n; r++) pos[r] = r0 + r;
                luma_step_seq sq = { 0 };
                sq.n_rows = n;
                sq.pos0 = r0;
                sq.blocks[0] = blocks;
                sq.n_blocks[0] = (N + AB - 1) / AB;
                luma_step step = { n, tokens, pos, 1, &sq, 1, &out_row };
                luma_buf qs = luma_buf_rows(&q, r0, n), ks = luma_buf_rows(&k, r0, n), vs = luma_buf_rows(&v, r0, n);
                luma_buf os = luma_buf_rows(&o, r0, n);
                be->ops->attention(be, &qs, &ks, &vs, &step, &layers[li], &os);
            }
            memcpy(outs[ci], o.data, N * AHQ * ADV * sizeof(float));
            be->ops->buf_free(be, &q), be->ops->buf_free(be, &k), be->ops->buf_free(be, &v), be->ops->buf_free(be, &o);
            be->ops->free(be);
        }
        for (int ci = 1; ci < 3; ci++)
            for (int r = 0; r < N; r++, checks++)
                CHECKF(memcmp(outs[0] + r * AHQ * ADV, outs[ci] + r * AHQ * ADV, AHQ * ADV * sizeof(float)) == 0,
                      "attention %s layer %d: row %d in steps of %d differs from the prefill", luma_type_name(kv_type),
                      li, r, chunk_rows[ci]);
        for (int ci = 0; ci < 3; ci++) free(outs[ci]);
    }
    free(qd), free(kd), free(vd);
    printf("attention batching %s, %d threads: %d checks (steps of 100, 7 and 1 rows)\n", luma_type_name(kv_type),
           threads, checks);
}

int main(void)
{
    rnd_seed(0x2545f4914f6cdd1dULL);
    test_pool();
    test_vec();
    test_panels();
    for (int threads = 1; threads <= 3; threads += 2) {
        luma_backend *be = new_backend(threads);
        test_matmul(be);
        test_elementwise(be);
        test_rope(be);
        luma_err err = { { 0 } };
        CHECKF(be->ops->sync(be, &err) == 0, "sync: %s", err.msg);
        be->ops->free(be);
        test_attention(threads, LUMA_F16);
        test_attention(threads, LUMA_F32);
        test_attention_batching(threads, LUMA_F16);
        test_attention_batching(threads, LUMA_F32);
    }
    if (failures) {
        printf("%d failures\n", failures);
        return 1;
    }
    printf("all passed\n");
    return 0;
}
