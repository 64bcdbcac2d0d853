/* The CUDA backend's logits operations (cuda/logits.cu) against the host
 * functions of src/sample.c, on random rows of 32000 and 262144 logits:
 *   - argmax of every row in one call, and of one row: the same id
 *     (ties by lower id, -1 for a row with every entry masked);
 *   - topk for k = 1, 40, 64, 256, 2048 (both of its kernels): the same
 *     count, ids and values;
 *   - temperature, penalize (counted on the host), bias, mask, min_p and
 *     stored entries: the same floats, bit for bit;
 *   - softmax and log_softmax: every entry the host's or an ulp off; the
 *     entropy's sums within 1e-12;
 *   - sample for 200 uniforms a row (60 on the large vocabulary): the
 *     same id, except where the target sits within rounding of a boundary
 *     (each such draw is checked to be);
 *   - the sampler's draw chained on the device (chain_sample, chain_read)
 *     for six chains of top-k, top-p, min-p and temperature, 20 uniforms
 *     each a row: luma_sampler_draw's id;
 *   - penalizing samplers chained (chain_history, chain_sample): the
 *     host's penalties and draws, step after step;
 *   - many rows' draws in one call (sampler_draw_rows) against
 *     luma_sampler_draw_top on the same entries;
 * on rows with distinct values, many ties, masked entries (-inf, NaN and
 * +inf, which count as masked), fewer live entries than k, none live, all
 * equal, signed zeros, and values near FLT_MAX; and bad arguments come back
 * as errors that leave the backend working. Then a synthetic model's run
 * into a logits set against the same run copied to the host, the set's
 * cached argmax, and the pool. Ends with timings: argmax of 128 rows x
 * 262144 (with the bandwidth it implies), top-k 40 and 2048, sample,
 * temperature and penalize of one row, and penalize then top-k 40 (a
 * sampling policy's device work).
 * Built with the CUDA backend only; without a device it says so and passes. */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "model.h"
#include "rng.h"
#include "sample.h"
#include "synth.h"
#include "testutil.h"

/* Built only with the CUDA backend, whose link dependencies bring the
 * runtime's headers. */
#include <cuda_runtime.h>

#define ROWS 11

static luma_backend *gpu;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Row r of the test rows: each a different kind of trouble. */
static void make_row(float *x, int32_t n, int r)
{
    for (int32_t i = 0; i < n; i++) {
        float g = gaussian();
        switch (r) {
        case 0: x[i] = 3.0f * g; break;                              /* distinct */
        case 1: x[i] = roundf(2.0f * g) * 0.25f; break;              /* many ties */
        case 2: {                                                    /* masked */
            uint64_t u = rnd() % 100;
            x[i] = u < 30 ? -INFINITY : u == 30 ? NAN : u == 31 ? INFINITY : 4.0f * g;
            break;
        }
        case 3: x[i] = i % (n / 30) == 7 ? g : -INFINITY; break;     /* ~30 live */
        case 4: x[i] = -INFINITY; break;                             /* none live */
        case 5: x[i] = 1.5f; break;                                  /* all equal */
        case 6: x[i] = (rnd() & 1) ? -0.0f : (rnd() & 1) ? 0.0f : -fabsf(g); break;  /* signed zeros */
        case 7: x[i] = g * 3e38f; break;                             /* near FLT_MAX */
        case 8: x[i] = 10.0f + 0.5f * g - (float)(i % 1000) * 0.01f; break;   /* a trend */
        case 9: {                   /* the best crowded into a few threads of each 4096 (thread i % 256) */
            int32_t t = i % 4096 % 256, s = i % 4096 / 256;
            x[i] = t < 64 ? 1000.0f - (float)(16 * t + s) : g;
            break;
        }
        default: x[i] = (rnd() % 1000 == 0) ? 20.0f + g : g; break;  /* a few high */
        }
    }
}

static bool same_float(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b));
}

/* A copy from pageable memory may return before it lands; under
 * compute-sanitizer the backend's next kernels then read the rows before
 * it (seen as rows a few entries stale), so the helpers wait for it. */
static void upload(luma_buf *b, const float *x, int64_t rows)
{
    CHECK(cudaMemcpy(b->data, x, (size_t)rows * (size_t)b->cols * sizeof(float), cudaMemcpyHostToDevice) ==
          cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

static void download_row(const luma_buf *b, int64_t row, float *x)
{
    CHECK(cudaMemcpy(x, b->data + row * b->cols, (size_t)b->cols * sizeof(float), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
}

/* ---- argmax, topk ----------------------------------------------------------- */

static void test_argmax(luma_buf *b, const float *rows, int32_t n)
{
    luma_err err;
    int32_t ids[ROWS], one;
    int bad = 0;
    CHECKF(gpu->ops->logits_argmax(gpu, b, 0, ROWS, ids, &err) == 0, "argmax: %s", err.msg);
    for (int r = 0; r < ROWS; r++) {
        int32_t want = luma_logits_argmax(rows + (size_t)r * n, n, NULL);
        CHECKF(gpu->ops->logits_argmax(gpu, b, r, 1, &one, &err) == 0, "argmax of row %d: %s", r, err.msg);
        bad += ids[r] != want || one != want;
        CHECKF(ids[r] == want && one == want, "argmax row %d (n %d): %d and %d, host %d", r, n, ids[r], one, want);
    }
    printf("argmax    n %6d: %d rows in one call and one by one, %d differ\n", n, ROWS, bad);
}

static void test_topk(luma_buf *b, const float *rows, int32_t n)
{
    /* many blocks up to 64 (n 262144) or 256 (n 32000: at 256 most rows take the
     * whole-chunk sort), one block above */
    static const int32_t ks[] = { 1, 40, 64, 256, 2048 };
    int32_t *gi = xmalloc(LUMA_TOPK_MAX * sizeof *gi), *hi = xmalloc(LUMA_TOPK_MAX * sizeof *hi);
    float *gv = xmalloc(LUMA_TOPK_MAX * sizeof *gv), *hv = xmalloc(LUMA_TOPK_MAX * sizeof *hv);
    luma_err err;
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        int32_t k = ks[ki];
        int bad = 0;
        for (int r = 0; r < ROWS; r++) {
            int32_t want = luma_logits_topk(rows + (size_t)r * n, n, k, hi, hv, &err);
            int32_t got = gpu->ops->logits_topk(gpu, b, r, k, gi, gv, &err);
            CHECKF(got == want, "topk %d row %d (n %d): %d entries, host %d (%s)", k, r, n, got, want,
                   got < 0 ? err.msg : "");
            int row_bad = got != want;
            for (int32_t j = 0; j < want && got == want; j++) row_bad |= gi[j] != hi[j] || !same_float(gv[j], hv[j]);
            CHECKF(!row_bad, "topk %d row %d (n %d): the entries differ from the host's", k, r, n);
            bad += row_bad;
        }
        printf("topk      n %6d: k %4d on %d rows, %d differ\n", n, k, ROWS, bad);
    }
    /* rows 3 .. ROWS - 1 at once: each row's k best at ids[i k ...] */
    int32_t *ri = xmalloc((size_t)ROWS * LUMA_TOPK_MAX * sizeof *ri), counts[ROWS];
    float *rv = xmalloc((size_t)ROWS * LUMA_TOPK_MAX * sizeof *rv);
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        int32_t k = ks[ki];
        int bad = 0, rc = gpu->ops->logits_topk_rows(gpu, b, 3, ROWS - 3, k, ri, rv, counts, &err);
        CHECKF(rc == 0, "topk of rows 3 .. %d, k %d: %s", ROWS - 1, k, rc ? err.msg : "");
        for (int r = 3; r < ROWS && rc == 0; r++) {
            const int32_t *gi_r = ri + (size_t)(r - 3) * k;
            const float *gv_r = rv + (size_t)(r - 3) * k;
            int32_t want = luma_logits_topk(rows + (size_t)r * n, n, k, hi, hv, &err);
            int row_bad = counts[r - 3] != want;
            for (int32_t j = 0; j < want && !row_bad; j++) row_bad |= gi_r[j] != hi[j] || !same_float(gv_r[j], hv[j]);
            bad += row_bad;
        }
        CHECKF(bad == 0, "topk of rows at once, k %d (n %d): %d rows differ from the host's", k, n, bad);
        printf("topk rows n %6d: k %4d on rows 3-%d in one call, %d differ\n", n, k, ROWS - 1, bad);
    }
    CHECK(gpu->ops->logits_topk_rows(gpu, b, 3, ROWS - 2, 4, ri, rv, counts, &err) < 0 && strstr(err.msg, "rows"));
    CHECK(gpu->ops->logits_topk_rows(gpu, b, 0, 1, 0, ri, rv, counts, &err) < 0 && strstr(err.msg, "k must be"));
    free(ri);
    free(rv);
    /* A batch's rows at once (the test rows over and over): few blocks a
     * row, each taking several chunks, where a run finds top-k ahead. */
    enum { MANY = 128 };
    luma_buf many;
    if (gpu->ops->logits_alloc(gpu, &many, MANY, n, &err) == 0) {
        for (int r = 0; r < MANY; r++)
            CHECK(cudaMemcpy(many.data + (size_t)r * n, rows + (size_t)(r % ROWS) * n, (size_t)n * sizeof(float),
                             cudaMemcpyHostToDevice) == cudaSuccess);
        int32_t *mi = xmalloc((size_t)MANY * 64 * sizeof *mi), mc[MANY];
        float *mv = xmalloc((size_t)MANY * 64 * sizeof *mv);
        static const int32_t mks[] = { 1, 40, 64 };
        for (size_t ki = 0; ki < sizeof mks / sizeof mks[0]; ki++) {
            int32_t k = mks[ki];
            int bad = 0, rc = gpu->ops->logits_topk_rows(gpu, &many, 0, MANY, k, mi, mv, mc, &err);
            CHECKF(rc == 0, "topk of %d rows, k %d: %s", MANY, k, rc ? err.msg : "");
            for (int r = 0; r < MANY && rc == 0; r++) {
                int32_t want = luma_logits_topk(rows + (size_t)(r % ROWS) * n, n, k, hi, hv, &err);
                int row_bad = mc[r] != want;
                for (int32_t j = 0; j < want && !row_bad; j++)
                    row_bad |= mi[(size_t)r * k + j] != hi[j] || !same_float(mv[(size_t)r * k + j], hv[j]);
                bad += row_bad;
            }
            CHECKF(bad == 0, "topk of %d rows at once, k %d (n %d): %d rows differ from the host's", MANY, k, n, bad);
            printf("topk rows n %6d: k %4d on %d rows in one call, %d differ\n", n, k, MANY, bad);
        }
        free(mi);
        free(mv);
        gpu->ops->logits_free(gpu, &many);
    } else {
        CHECKF(0, "logits_alloc of %d rows: %s", MANY, err.msg);
    }
    free(gi);
    free(hi);
    free(gv);
    free(hv);
}

/* ---- in-place edits ------------------------------------------------------ */

/* Applies op to row r on the device and host_op to a host copy; compares
 * every float. */
typedef int (*device_op)(luma_buf *b, int64_t row, void *ctx, luma_err *err);
typedef int (*host_op)(float *x, int32_t n, void *ctx, luma_err *err);

static int compare_edit(const char *name, luma_buf *b, const float *rows, int32_t n, device_op dop, host_op hop,
                        void *ctx)
{
    float *want = xmalloc((size_t)n * sizeof *want), *got = xmalloc((size_t)n * sizeof *got);
    luma_err err;
    int bad_rows = 0;
    upload(b, rows, ROWS);
    for (int r = 0; r < ROWS; r++) {
        memcpy(want, rows + (size_t)r * n, (size_t)n * sizeof *want);
        CHECKF(hop(want, n, ctx, &err) == 0, "%s on the host: %s", name, err.msg);
        CHECKF(dop(b, r, ctx, &err) == 0, "%s row %d: %s", name, r, err.msg);
        download_row(b, r, got);
        int32_t diff = 0;
        for (int32_t i = 0; i < n; i++) diff += !same_float(got[i], want[i]);
        CHECKF(diff == 0, "%s row %d (n %d): %d entries differ from the host's", name, r, n, diff);
        bad_rows += diff != 0;
    }
    free(want);
    free(got);
    return bad_rows;
}

static int dev_temperature(luma_buf *b, int64_t row, void *ctx, luma_err *err)
{
    return gpu->ops->logits_temperature(gpu, b, row, *(float *)ctx, err);
}

static int host_temperature(float *x, int32_t n, void *ctx, luma_err *err)
{
    return luma_logits_temperature(x, n, *(float *)ctx, err);
}

typedef struct penalty {
    const int32_t *hist;
    int32_t n_hist, last_n;
    float repeat, frequency, presence;
} penalty;

static int dev_penalize(luma_buf *b, int64_t row, void *ctx, luma_err *err)
{
    penalty *p = ctx;
    int32_t *ids = xmalloc(2 * (size_t)p->n_hist * sizeof *ids);
    float *counts = xmalloc((size_t)p->n_hist * sizeof *counts);
    int32_t k = luma_logits_penalty_counts((int32_t)b->cols, p->hist, p->n_hist, p->last_n, p->repeat, p->frequency,
                                           p->presence, ids, ids + p->n_hist, err);
    for (int32_t j = 0; j < k; j++) counts[j] = (float)ids[p->n_hist + j];
    luma_logits_edit e = { LUMA_EDIT_PENALIZE, k, ids, counts, p->repeat, p->frequency, p->presence };
    int rc = k < 0 ? -1 : gpu->ops->logits_edit(gpu, b, row, &e, err);
    free(ids);
    free(counts);
    return rc;
}

static int host_penalize(float *x, int32_t n, void *ctx, luma_err *err)
{
    penalty *p = ctx;
    return luma_logits_penalize(x, n, p->hist, p->n_hist, p->last_n, p->repeat, p->frequency, p->presence, err);
}

typedef struct listed {
    const int32_t *ids;
    const float *values;
    int32_t n;
    bool mask;
} listed;

static int dev_listed(luma_buf *b, int64_t row, void *ctx, luma_err *err)
{
    listed *l = ctx;
    luma_logits_edit e = { l->mask ? LUMA_EDIT_MASK : LUMA_EDIT_BIAS, l->n, l->ids, l->values, 1.0f, 0.0f, 0.0f };
    return gpu->ops->logits_edit(gpu, b, row, &e, err);
}

static int host_listed(float *x, int32_t n, void *ctx, luma_err *err)
{
    listed *l = ctx;
    return l->mask ? luma_logits_mask(x, n, l->ids, l->n, err) : luma_logits_bias(x, n, l->ids, l->values, l->n, err);
}

static int dev_min_p(luma_buf *b, int64_t row, void *ctx, luma_err *err)
{
    return gpu->ops->logits_min_p(gpu, b, row, log(*(float *)ctx), err);
}

static int host_min_p(float *x, int32_t n, void *ctx, luma_err *err)
{
    return luma_logits_min_p(x, n, *(float *)ctx, 1, err);
}

static int dev_set(luma_buf *b, int64_t row, void *ctx, luma_err *err)
{
    listed *l = ctx;
    luma_logits_edit e = { LUMA_EDIT_SET, l->n, l->ids, l->values, 1.0f, 0.0f, 0.0f };
    return gpu->ops->logits_edit(gpu, b, row, &e, err);
}

static int host_set(float *x, int32_t n, void *ctx, luma_err *err)
{
    (void)n;
    (void)err;
    listed *l = ctx;
    for (int32_t i = 0; i < l->n; i++) x[l->ids[i]] = l->values[i];
    return 0;
}

static void test_edits(luma_buf *b, const float *rows, int32_t n)
{
    static const float mps[] = { 0.05f, 0.5f, 1.0f, 1e-30f };
    for (size_t i = 0; i < sizeof mps / sizeof mps[0]; i++) {
        float p = mps[i];
        int bad = compare_edit("min_p", b, rows, n, dev_min_p, host_min_p, &p);
        printf("min_p     n %6d: p %g on %d rows, %d differ\n", n, (double)p, ROWS, bad);
    }
    static const float ts[] = { 0.7f, 1.3f, 1e-30f };
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        float t = ts[i];
        int bad = compare_edit("temperature", b, rows, n, dev_temperature, host_temperature, &t);
        printf("temperature n %6d: t %g on %d rows, %d differ\n", n, (double)t, ROWS, bad);
    }
    /* a history over few ids (repeats) and some of the top ones */
    int32_t hist[300];
    for (int i = 0; i < 300; i++) hist[i] = i % 3 == 0 ? (int32_t)(rnd() % 40) : (int32_t)(rnd() % (uint64_t)n);
    penalty ps[] = { { hist, 300, 64, 1.1f, 0.0f, 0.0f }, { hist, 300, 0, 1.3f, 0.25f, 0.5f },
                     { hist, 300, 200, 0.8f, -0.1f, 0.3f } };
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        int bad = compare_edit("penalize", b, rows, n, dev_penalize, host_penalize, &ps[i]);
        printf("penalize  n %6d: last_n %3d repeat %.1f frequency %.2f presence %.1f on %d rows, %d differ\n", n,
               ps[i].last_n, (double)ps[i].repeat, (double)ps[i].frequency, (double)ps[i].presence, ROWS, bad);
    }
    /* 600 distinct ids (three launches), values including -inf and huge ones */
    int32_t *ids = xmalloc(600 * sizeof *ids);
    float *vals = xmalloc(600 * sizeof *vals);
    for (int32_t i = 0; i < 600; i++) {
        ids[i] = (int32_t)(((int64_t)i * 7919) % n);
        vals[i] = i % 50 == 0 ? -INFINITY : i % 77 == 0 ? 3e38f : 2.0f * gaussian();
    }
    listed bias = { ids, vals, 600, false }, mask = { ids, NULL, 600, true };
    int bad = compare_edit("bias", b, rows, n, dev_listed, host_listed, &bias);
    printf("bias      n %6d: 600 ids on %d rows, %d differ\n", n, ROWS, bad);
    bad = compare_edit("mask", b, rows, n, dev_listed, host_listed, &mask);
    printf("mask      n %6d: 600 ids on %d rows, %d differ\n", n, ROWS, bad);
    /* stored values: any float, NaN and infinities included */
    for (int32_t i = 0; i < 600; i++) vals[i] = i % 97 == 0 ? NAN : i % 89 == 0 ? INFINITY : vals[i];
    listed set = { ids, vals, 600, false };
    bad = compare_edit("set", b, rows, n, dev_set, host_set, &set);
    printf("set       n %6d: 600 ids on %d rows, %d differ\n", n, ROWS, bad);
    free(ids);
    free(vals);
    upload(b, rows, ROWS);
}

/* ---- distributions -------------------------------------------------------- */

/* Whether a and b are the same float or neighbours (an ulp apart). */
static bool within_ulp(float a, float b)
{
    if (same_float(a, b)) return true;
    if (!isfinite(a) || !isfinite(b) || (a < 0.0f) != (b < 0.0f)) return false;
    uint32_t ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    return (ua > ub ? ua - ub : ub - ua) <= 1;
}

/* softmax and log_softmax on the device against the host's: every entry
 * the same or an ulp off (the normalizer is summed in another order), the
 * entropy's sums within 1e-12; a row with nothing live refused on both,
 * and left as it was. */
static void test_dist(luma_buf *b, const float *rows, int32_t n)
{
    float *want = xmalloc((size_t)n * sizeof *want), *got = xmalloc((size_t)n * sizeof *got);
    luma_err err, herr;
    for (int log1 = 0; log1 < 2; log1++) {
        const char *name = log1 ? "log_softmax" : "softmax";
        int64_t ulps = 0, refused = 0;
        upload(b, rows, ROWS);
        for (int r = 0; r < ROWS; r++) {
            memcpy(want, rows + (size_t)r * n, (size_t)n * sizeof *want);
            int hrc = log1 ? luma_logits_log_softmax(want, n, &herr) : luma_logits_softmax(want, n, &herr);
            int drc = gpu->ops->logits_softmax(gpu, b, r, log1 != 0, &err);
            CHECKF(hrc == drc, "%s row %d: the host %s, the device %s", name, r, hrc ? herr.msg : "ran",
                   drc ? err.msg : "ran");
            download_row(b, r, got);
            if (drc) {
                refused++;
                CHECKF(strstr(err.msg, "masked") != NULL, "%s row %d: %s", name, r, err.msg);
                CHECKF(memcmp(got, rows + (size_t)r * n, (size_t)n * sizeof *got) == 0,
                       "%s row %d: a refused row changed", name, r);
                continue;
            }
            int32_t off = 0, far = 0, first = -1;
            for (int32_t i = 0; i < n; i++) {
                off += !same_float(got[i], want[i]);
                far += !within_ulp(got[i], want[i]);
                if (first < 0 && !within_ulp(got[i], want[i])) first = i;
            }
            ulps += off;
            CHECKF(far == 0, "%s row %d (n %d): %d entries more than an ulp from the host's (the first at %d: %.9g, "
                   "the host's %.9g, the input %.9g)", name, r, n, far, first, first < 0 ? 0.0 : (double)got[first],
                   first < 0 ? 0.0 : (double)want[first], first < 0 ? 0.0 : (double)rows[(size_t)r * n + first]);
        }
        printf("%-11s n %6d: %d rows (%lld refused, nothing live), %lld entries an ulp off the host's\n", name, n,
               ROWS, (long long)refused, (long long)ulps);
    }
    upload(b, rows, ROWS);
    double worst = 0.0;
    for (int r = 0; r < ROWS; r++) {
        double h, z, s;
        int hrc = luma_logits_entropy(rows + (size_t)r * n, n, &h, &herr);
        int drc = gpu->ops->logits_live_sums(gpu, b, r, &z, &s, &err);
        CHECKF(hrc == drc, "entropy row %d: the host %s, the device %s", r, hrc ? herr.msg : "ran",
               drc ? err.msg : "ran");
        if (hrc || drc) continue;
        double d = fabs(luma_entropy_of_sums(z, s) - h) / (h > 1.0 ? h : 1.0);
        worst = d > worst ? d : worst;
        CHECKF(d < 1e-12, "entropy row %d: %.17g against the host's %.17g", r, luma_entropy_of_sums(z, s), h);
    }
    printf("entropy     n %6d: %d rows, largest relative difference %.2g\n", n, ROWS, worst);
    free(want);
    free(got);
}

/* ---- sampling ------------------------------------------------------------ */

/* Whether target u * z sits within rounding of the boundary between ids a
 * and b of x: the running mass just past the smaller id is about the target. */
static bool near_boundary(const float *x, int32_t n, double u, int32_t a, int32_t b)
{
    float m = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m && x[i] < INFINITY) m = x[i];
    double z = 0.0;
    for (int32_t i = 0; i < n; i++)
        if (isfinite(x[i])) z += exp((double)x[i] - m);
    int32_t lo = a < b ? a : b, hi = a < b ? b : a;
    double mass = 0.0, at_lo = 0.0;
    for (int32_t i = 0; i <= hi; i++) {
        if (!isfinite(x[i])) continue;
        if (i < hi) mass += exp((double)x[i] - m);
        if (i == lo) at_lo = mass;
    }
    double t = u * z;
    /* every entry strictly between them carries no mass above rounding */
    return fabs(t - at_lo) <= 1e-9 * z && fabs(mass - at_lo) <= 1e-9 * z;
}

static void test_sample(luma_buf *b, const float *rows, int32_t n)
{
    luma_err err;
    int draws = 0, differ = 0, unexplained = 0, per_row = n > 100000 ? 60 : 200;
    for (int r = 0; r < ROWS; r++) {
        const float *x = rows + (size_t)r * n;
        luma_rng host_rng, dev_rng;
        luma_rng_seed(&host_rng, 1000 + (uint64_t)r);
        luma_rng_seed(&dev_rng, 1000 + (uint64_t)r);
        for (int d = 0; d < per_row; d++) {
            double u = luma_rng_uniform(&dev_rng);
            int32_t want = luma_logits_sample(x, n, &host_rng, NULL);
            int32_t got = gpu->ops->logits_sample(gpu, b, r, u, &err);
            draws++;
            if (want == got) continue;
            differ++;
            bool ok = want >= 0 && got >= 0 && near_boundary(x, n, u, want, got);
            unexplained += !ok;
            CHECKF(ok, "sample row %d (n %d) u %.17g: %d, host %d", r, n, u, got, want);
        }
    }
    printf("sample    n %6d: %d draws, %d differ from the host's (%d not at a rounding boundary)\n", n, draws,
           differ, unexplained);
}

/* The sampler's draw chained on the device (chain_sample, then chain_read)
 * against luma_sampler_draw on the host, for several chains and uniforms
 * a row: the same id (-1 for a row with nothing live). */
static const luma_sampler SAMPLERS[] = {
    { 40, 0.95f, 0.0f, 0.8f, 1.0f, 0.0f, 0.0f, 0 }, { 64, 1.0f, 0.05f, 1.3f, 1.0f, 0.0f, 0.0f, 0 },
    { 8, 0.9f, 0.1f, 0.5f, 1.0f, 0.0f, 0.0f, 0 },   { 1, 1.0f, 0.0f, 2.0f, 1.0f, 0.0f, 0.0f, 0 },
    { 64, 0.5f, 0.0f, 0.01f, 1.0f, 0.0f, 0.0f, 0 }, { 3, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },
};

static void test_chain_sample(luma_buf *b, const float *rows, int32_t n)
{
    luma_err err;
    int draws = 0, differ = 0;
    for (int r = 0; r < ROWS; r++) {
        const float *x = rows + (size_t)r * n;
        luma_rng rng;
        luma_rng_seed(&rng, 2000 + (uint64_t)r);
        for (size_t si = 0; si < sizeof SAMPLERS / sizeof *SAMPLERS; si++) {
            for (int d = 0; d < 20; d++) {
                const double u = luma_rng_uniform(&rng);
                luma_err herr;
                int32_t want = luma_sampler_draw(&SAMPLERS[si], x, n, u, &herr), got = -7;
                CHECKF(gpu->ops->chain_sample(gpu, b, r, &SAMPLERS[si], u, &err) == 0, "chain_sample: %s", err.msg);
                CHECKF(gpu->ops->chain_read(gpu, &got, &err) == 0, "chain_read: %s", err.msg);
                draws++;
                if (want == got) continue;
                differ++;
                CHECKF(0, "chained draw row %d (n %d) sampler %zu u %.17g: %d, host %d", r, n, si, u, got, want);
            }
        }
    }
    printf("chained   n %6d: %d draws of %zu samplers, %d differ from the host's\n", n, draws,
           sizeof SAMPLERS / sizeof *SAMPLERS, differ);
}

/* Penalizing samplers chained on the device: from a history begun by
 * chain_history (300 ids with repeats, many among each row's best), 20
 * draws a row, each penalizing the row in place over the history and the
 * ids drawn since, against the same on a host copy (luma_logits_penalize,
 * then luma_sampler_draw): the same ids, and the row the same floats. */
static void test_chain_penalties(luma_buf *b, const float *rows, int32_t n)
{
    static const luma_sampler pen[] = {
        { 40, 0.95f, 0.0f, 0.8f, 1.3f, 0.0f, 0.0f, 64 },
        { 64, 1.0f, 0.05f, 1.0f, 1.1f, 0.25f, 0.5f, 256 },
        { 8, 0.9f, 0.0f, 0.7f, 0.8f, -0.1f, 0.3f, 1 },
    };
    enum { H = 300, D = 20 };
    float *x = xmalloc((size_t)n * sizeof *x), *got = xmalloc((size_t)n * sizeof *got);
    int32_t *hist = xmalloc((H + D) * sizeof *hist);
    luma_err err;
    int draws = 0, differ = 0, rows_differ = 0;
    for (size_t si = 0; si < sizeof pen / sizeof *pen; si++) {
        upload(b, rows, ROWS);
        for (int r = 0; r < ROWS; r++) {
            const float *row = rows + (size_t)r * n;
            int32_t best[16];
            float bv[16];
            int32_t nb = luma_logits_topk(row, n, 16, best, bv, &err);
            for (int i = 0; i < H; i++)
                hist[i] = nb > 0 && i % 2 == 0 ? best[rnd() % (uint64_t)nb] : (int32_t)(rnd() % (uint64_t)n);
            int32_t nh = H;
            CHECKF(gpu->ops->chain_history(gpu, hist, nh, &err) == 0, "chain_history: %s", err.msg);
            memcpy(x, row, (size_t)n * sizeof *x);
            luma_rng rng;
            luma_rng_seed(&rng, 5000 + (uint64_t)r);
            for (int d = 0; d < D; d++) {
                const double u = luma_rng_uniform(&rng);
                luma_err herr;
                int32_t want = luma_logits_penalize(x, n, hist, nh, pen[si].last_n, pen[si].repeat, pen[si].frequency,
                                                    pen[si].presence, &herr) == 0
                                   ? luma_sampler_draw(&pen[si], x, n, u, &herr)
                                   : -2;
                int32_t id = -7;
                CHECKF(gpu->ops->chain_sample(gpu, b, r, &pen[si], u, &err) == 0, "chain_sample: %s", err.msg);
                CHECKF(gpu->ops->chain_read(gpu, &id, &err) == 0, "chain_read: %s", err.msg);
                draws++;
                if (id != want) {
                    differ++;
                    CHECKF(0, "penalized chained draw, sampler %zu row %d step %d: %d, host %d", si, r, d, id, want);
                }
                if (want < 0) break;
                hist[nh++] = want;
            }
            download_row(b, r, got);
            int32_t diff = 0;
            for (int32_t i = 0; i < n; i++) diff += !same_float(got[i], x[i]);
            rows_differ += diff != 0;
            CHECKF(diff == 0, "penalized chained draws, sampler %zu row %d: %d entries differ", si, r, diff);
        }
    }
    printf("penalized n %6d: %d chained draws of %zu samplers, %d differ from the host's, %d rows differ\n", n,
           draws, sizeof pen / sizeof *pen, differ, rows_differ);
    upload(b, rows, ROWS);
    free(x);
    free(got);
    free(hist);
}

/* Many rows' draws at once (sampler_draw_rows) against
 * luma_sampler_draw_top on the same entries: each test row's 64 best
 * (as logits_topk_rows leaves them) drawn by every sampler with 10
 * uniforms, all in one call; the same id, -1 for a row with nothing
 * live. */
static void test_draw_rows(const float *rows, int32_t n)
{
    enum { K = LUMA_SAMPLER_K_MAX, U = 10 };
    const int ns = (int)(sizeof SAMPLERS / sizeof *SAMPLERS), total = ROWS * ns * U;
    int32_t *ids = xmalloc((size_t)total * K * sizeof *ids), *counts = xmalloc((size_t)total * sizeof *counts);
    int32_t *out = xmalloc((size_t)total * sizeof *out);
    float *vals = xmalloc((size_t)total * K * sizeof *vals);
    luma_sampler *smp = xmalloc((size_t)total * sizeof *smp);
    double *u = xmalloc((size_t)total * sizeof *u);
    luma_rng rng;
    luma_rng_seed(&rng, 3000);
    luma_err err;
    int i = 0;
    for (int r = 0; r < ROWS; r++) {
        int32_t rid[K];
        float rv[K];
        int32_t c = luma_logits_topk(rows + (size_t)r * n, n, K, rid, rv, &err);
        CHECKF(c >= 0, "host top-k: %s", err.msg);
        for (int si = 0; si < ns; si++)
            for (int d = 0; d < U; d++, i++) {
                memcpy(ids + (size_t)i * K, rid, sizeof rid);
                memcpy(vals + (size_t)i * K, rv, sizeof rv);
                counts[i] = c;
                smp[i] = SAMPLERS[si];
                u[i] = luma_rng_uniform(&rng);
            }
    }
    CHECKF(gpu->ops->sampler_draw_rows(gpu, total, K, ids, vals, counts, smp, u, out, &err) == 0,
           "sampler_draw_rows: %s", err.msg);
    int differ = 0;
    for (i = 0; i < total; i++) {
        int32_t hid[K];
        float hv[K];
        const int32_t c = counts[i] < smp[i].top_k ? counts[i] : smp[i].top_k;
        memcpy(hid, ids + (size_t)i * K, sizeof hid);
        memcpy(hv, vals + (size_t)i * K, sizeof hv);
        luma_err herr;
        const int32_t want = c > 0 ? luma_sampler_draw_top(&smp[i], hid, hv, c, u[i], &herr) : -1;
        if (want == out[i]) continue;
        differ++;
        CHECKF(0, "draw of many rows, entry %d (row %d) u %.17g: %d, host %d", i, i / (ns * U), u[i], out[i], want);
    }
    /* the uniform out of range is refused */
    u[0] = 1.0;
    CHECK(gpu->ops->sampler_draw_rows(gpu, total, K, ids, vals, counts, smp, u, out, &err) < 0 &&
          strstr(err.msg, "uniform"));
    printf("rows      n %6d: %d draws in one call, %d differ from the host's\n", n, total, differ);
    free(ids);
    free(counts);
    free(out);
    free(vals);
    free(smp);
    free(u);
}

/* ---- bad arguments --------------------------------------------------------- */

static void test_errors(luma_buf *b, const float *rows, int32_t n)
{
    luma_err err;
    int32_t ids[4];
    float vals[4];
    CHECK(gpu->ops->logits_topk(gpu, b, 0, 0, ids, vals, &err) < 0 && strstr(err.msg, "k must be"));
    CHECK(gpu->ops->logits_topk(gpu, b, 0, LUMA_TOPK_MAX + 1, ids, vals, &err) < 0);
    CHECK(gpu->ops->logits_topk(gpu, b, ROWS, 4, ids, vals, &err) < 0 && strstr(err.msg, "row"));
    CHECK(gpu->ops->logits_argmax(gpu, b, ROWS - 1, 2, ids, &err) < 0);
    int32_t bad_id = n;
    luma_logits_edit e = { LUMA_EDIT_MASK, 1, &bad_id, NULL, 1.0f, 0.0f, 0.0f };
    CHECK(gpu->ops->logits_edit(gpu, b, 0, &e, &err) < 0 && strstr(err.msg, "mask"));
    CHECK(gpu->ops->logits_temperature(gpu, b, 0, 0.0f, &err) < 0);
    CHECK(gpu->ops->logits_sample(gpu, b, 0, 1.0, &err) < 0);
    CHECK(gpu->ops->logits_sample(gpu, b, 4, 0.5, &err) < 0 && strstr(err.msg, "masked"));
    luma_sampler bad = SAMPLERS[0];
    bad.top_k = LUMA_SAMPLER_K_MAX + 1;
    CHECK(gpu->ops->chain_sample(gpu, b, 0, &bad, 0.5, &err) < 0 && strstr(err.msg, "top_k"));
    bad = SAMPLERS[0];
    bad.temp = 0.0f;
    CHECK(gpu->ops->chain_sample(gpu, b, 0, &bad, 0.5, &err) < 0 && strstr(err.msg, "temp"));
    CHECK(gpu->ops->chain_sample(gpu, b, 0, &SAMPLERS[0], 1.0, &err) < 0 && strstr(err.msg, "uniform"));
    CHECK(gpu->ops->chain_sample(gpu, b, ROWS, &SAMPLERS[0], 0.5, &err) < 0 && strstr(err.msg, "row"));
    luma_buf huge;
    CHECK(gpu->ops->logits_alloc(gpu, &huge, (int64_t)1 << 40, 262144, &err) < 0);
    /* still working */
    CHECK(gpu->ops->logits_argmax(gpu, b, 0, 1, ids, &err) == 0 && ids[0] == luma_logits_argmax(rows, n, NULL));
    printf("errors    n %6d: bad k, rows, ids, t, u and sizes refused; the backend keeps working\n", n);
}

/* Every check on n entries; topk_only: the top-k checks alone. */
static void test_vocab(int32_t n, bool topk_only)
{
    luma_err err;
    luma_buf b;
    if (gpu->ops->logits_alloc(gpu, &b, ROWS, n, &err)) {
        CHECKF(0, "logits_alloc: %s", err.msg);
        return;
    }
    float *rows = xmalloc((size_t)ROWS * (size_t)n * sizeof *rows);
    for (int r = 0; r < ROWS; r++) make_row(rows + (size_t)r * n, n, r);
    upload(&b, rows, ROWS);
    if (!topk_only) test_argmax(&b, rows, n);
    test_topk(&b, rows, n);
    if (!topk_only) {
        test_sample(&b, rows, n);
        test_chain_sample(&b, rows, n);
        test_draw_rows(rows, n);
        test_chain_penalties(&b, rows, n);
        test_dist(&b, rows, n);
        test_edits(&b, rows, n);
        test_errors(&b, rows, n);
    }
    gpu->ops->logits_free(gpu, &b);
    free(rows);
}

/* A second backend with the other small-k batch top-k kernel than the
 * first's (LUMA_CUDA_TOPK: 1, the default, topk_stream_kernel; 0,
 * topk_small_kernel), or NULL; *name says which it has. */
static luma_backend *other_topk_backend(const char **name)
{
    const char *was = getenv("LUMA_CUDA_TOPK");
    char saved[16] = "";
    if (was) snprintf(saved, sizeof saved, "%s", was);
    bool stream_first = !(was && strcmp(was, "0") == 0);
    setenv("LUMA_CUDA_TOPK", stream_first ? "0" : "1", 1);
    *name = stream_first ? "topk_small_kernel (LUMA_CUDA_TOPK=0)" : "topk_stream_kernel (LUMA_CUDA_TOPK=1)";
    luma_err err;
    luma_backend *be = luma_backend_cuda_new(0, &err);
    if (was) setenv("LUMA_CUDA_TOPK", saved, 1);
    else unsetenv("LUMA_CUDA_TOPK");
    CHECKF(be != NULL, "a backend with %s: %s", *name, be ? "" : err.msg);
    return be;
}

/* The top-k checks again on the other kernel's backend. */
static void test_topk_other(int32_t n)
{
    luma_backend *main_gpu = gpu;
    const char *name;
    gpu = other_topk_backend(&name);
    if (!gpu) {
        gpu = main_gpu;
        return;
    }
    printf("%s:\n", name);
    test_vocab(n, true);
    gpu->ops->free(gpu);
    gpu = main_gpu;
}

/* ---- a model's run into a set ----------------------------------------------- */

/* Run hooks: one that counts its calls, one that fails. */
static int count_hook(void *ctx, luma_err *err)
{
    (void)err;
    ++*(int *)ctx;
    return 0;
}

static int failing_hook(void *ctx, luma_err *err)
{
    (void)ctx;
    return luma_errf(err, "the hook says no");
}

static void test_model(const char *vocab)
{
    luma_err err = { { 0 } };
    luma_synth_params sp;
    char path[256];
    snprintf(path, sizeof path, "/tmp/luma-logits-%d.gguf", (int)getpid());
    if (luma_synth_preset("tiny-gemma3", &sp, &err)) {
        CHECKF(0, "tiny-gemma3: %s", err.msg);
        return;
    }
    sp.seed = 5;
    sp.vocab_path = vocab;
    if (luma_synth_write(&sp, path, &err)) {
        CHECKF(0, "writing a synthetic model: %s", err.msg);
        return;
    }
    luma_model_params p;
    luma_model_params_default(&p);
    p.backend = "cuda";
    p.n_ctx = 256;
    p.max_rows = 16;
    p.kv_bytes = (int64_t)64 << 20;
    luma_model *m = NULL;
    if (luma_model_load(path, &p, &m, &err)) {
        CHECKF(0, "loading the synthetic model: %s", err.msg);
        remove(path);
        return;
    }
    int32_t nv = m->hp.n_vocab, prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = 1 + (int32_t)(rnd() % (uint64_t)(nv - 1));
    luma_seq *a[3], *h[3];
    luma_chunk ca[3], ch[3];
    for (int i = 0; i < 3; i++) {
        a[i] = luma_seq_new(m, &err);
        h[i] = luma_seq_new(m, &err);
        /* a prompt of 40 over 16-row passes, and all of one chunk's rows */
        ca[i] = (luma_chunk){ a[i], prompt, 10 + 15 * i, i == 1 };
        ch[i] = (luma_chunk){ h[i], prompt, 10 + 15 * i, i == 1 };
    }
    int64_t rows = luma_model_out_rows(ca, 3);
    float *want = xmalloc((size_t)rows * (size_t)nv * sizeof *want), *got = xmalloc((size_t)nv * sizeof *got);
    luma_logits_set *s = NULL;
    double worst = 0.0;
    int argmax_bad = 0;
    if (luma_model_run(m, ch, 3, want, &err) || luma_model_run_set(m, ca, 3, NULL, &s, &err)) {
        CHECKF(0, "the runs: %s", err.msg);
    } else {
        CHECK(s->buf.rows == rows && m->n_sets == 1);
        for (int64_t r = 0; r < rows; r++) {
            CHECK(luma_logits_set_read(s, r, got, &err) == 0);
            for (int32_t i = 0; i < nv; i++) {
                double d = fabs((double)got[i] - (double)want[(size_t)r * nv + i]);
                if (!(d <= worst)) worst = d;
            }
            argmax_bad += luma_logits_set_argmax(s, r, true, &err) != luma_logits_argmax(got, nv, NULL);
        }
        luma_logits_set_release(s);
        CHECK(m->n_sets == 0 && m->n_pooled == 1);
        /* decode steps reuse the pooled allocation; the set's argmax having
         * been read above, the next runs find it with their last pass (equal
         * to a fresh one), and the hook runs once a run */
        CHECK(m->argmax_ahead);
        int32_t tok[3] = { 5, 6, 7 };
        int hooked = 0, ahead = 0, ahead_bad = 0;
        luma_run_hook hook = { count_hook, &hooked };
        for (int t = 0; t < 5; t++) {
            for (int i = 0; i < 3; i++) ca[i] = (luma_chunk){ a[i], &tok[i], 1, false };
            CHECK(luma_model_run_set(m, ca, 3, &hook, &s, &err) == 0);
            if (!s) break;
            ahead += s->argmax != NULL;   /* before any read: found by the run */
            for (int i = 0; i < 3; i++) {
                int32_t fresh = luma_logits_set_argmax(s, i, false, &err);
                tok[i] = luma_logits_set_argmax(s, i, true, &err);
                ahead_bad += tok[i] != fresh;
            }
            luma_logits_set_release(s);
        }
        CHECK(m->n_sets == 0 && m->n_pooled == 1);
        CHECKF(hooked == 5 && ahead == 5 && ahead_bad == 0, "hook %d of 5 runs, argmax ahead %d of 5 (%d differ)",
               hooked, ahead, ahead_bad);
        /* a set released unread turns it off */
        for (int i = 0; i < 3; i++) ca[i] = (luma_chunk){ a[i], &tok[i], 1, false };
        CHECK(luma_model_run_set(m, ca, 3, NULL, &s, &err) == 0);
        luma_logits_set_release(s);
        CHECK(!m->argmax_ahead);
        /* top-k alike: a read of an unchanged row's top 8 asks the next runs
         * for every row's top 8 with their last pass; the top 5 and top 8
         * then come from it, equal to fresh ones; a set released unread
         * turns it off */
        CHECK(m->topk_ahead == 0);
        int32_t ti[8], fi[8], got_n = 0, fresh_n = 0, topk_ahead = 0, topk_bad = 0;
        float tv[8], fv[8];
        for (int t = 0; t < 4; t++) {
            for (int i = 0; i < 3; i++) ca[i] = (luma_chunk){ a[i], &tok[i], 1, false };
            CHECK(luma_model_run_set(m, ca, 3, NULL, &s, &err) == 0);
            if (!s) break;
            topk_ahead += s->topk != NULL && s->topk_k == 8;
            for (int i = 0; i < 3; i++) {
                for (int32_t k = 5; k <= 8; k += 3) {
                    got_n = luma_logits_set_topk(s, i, k, true, ti, tv, &err);
                    fresh_n = gpu->ops->logits_topk(gpu, &s->buf, i, k, fi, fv, &err);
                    topk_bad += got_n != fresh_n || got_n != k || memcmp(ti, fi, (size_t)k * sizeof *ti) != 0 ||
                                memcmp(tv, fv, (size_t)k * sizeof *tv) != 0;
                }
                tok[i] = ti[0];
            }
            luma_logits_set_release(s);
        }
        CHECKF(topk_ahead == 3 && topk_bad == 0 && m->topk_ahead == 8,
               "top-k ahead in %d of the 3 runs after the first (k %d), %d differ", topk_ahead, m->topk_ahead,
               topk_bad);
        for (int i = 0; i < 3; i++) ca[i] = (luma_chunk){ a[i], &tok[i], 1, false };
        CHECK(luma_model_run_set(m, ca, 3, NULL, &s, &err) == 0);
        luma_logits_set_release(s);
        CHECK(m->topk_ahead == 0);
        /* a penalty that only lowers: the top 5 after it from the top 64
         * found ahead, equal to the backend's after the same edit; refused
         * where the penalized 5th falls below the 64th (all but 3 of the
         * 64 lowered by far) */
        m->topk_ahead = LUMA_TOPK_AHEAD_MAX;
        int low_served = 0, low_bad = 0, low_refused = 0;
        for (int t = 0; t < 3; t++) {
            for (int i = 0; i < 3; i++) ca[i] = (luma_chunk){ a[i], &tok[i], 1, false };
            CHECK(luma_model_run_set(m, ca, 3, NULL, &s, &err) == 0);
            if (!s) break;
            for (int i = 0; i < 3; i++) {
                int32_t top[LUMA_TOPK_AHEAD_MAX], pc[LUMA_TOPK_AHEAD_MAX];
                float topv[LUMA_TOPK_AHEAD_MAX], pcf[LUMA_TOPK_AHEAD_MAX];
                CHECK(luma_logits_set_topk(s, i, LUMA_TOPK_AHEAD_MAX, true, top, topv, &err) == LUMA_TOPK_AHEAD_MAX);
                const bool far = t == 2;
                int32_t np = far ? LUMA_TOPK_AHEAD_MAX - 3 : 3, pid[LUMA_TOPK_AHEAD_MAX];
                for (int32_t j = 0; j < np; j++) {
                    pid[j] = far ? top[j] : top[j * 2 + 1];
                    pc[j] = 1 + j % 2;
                }
                /* a lowering's ids increase (luma_lowering) */
                for (int32_t j = 1; j < np; j++)
                    for (int32_t q = j; q > 0 && pid[q - 1] > pid[q]; q--) {
                        int32_t ti_ = pid[q], tc = pc[q];
                        pid[q] = pid[q - 1];
                        pc[q] = pc[q - 1];
                        pid[q - 1] = ti_;
                        pc[q - 1] = tc;
                    }
                for (int32_t j = 0; j < np; j++) pcf[j] = (float)pc[j];
                luma_lowering low = { pid, pc, np, 1.5f, 0.1f, far ? 1000.0f : 0.2f };
                got_n = luma_logits_set_topk_lowered(s, i, 5, &low, ti, tv);
                luma_logits_edit e = { LUMA_EDIT_PENALIZE, np, pid, pcf, 1.5f, 0.1f, low.presence };
                CHECK(gpu->ops->logits_edit(gpu, &s->buf, i, &e, &err) == 0);
                fresh_n = gpu->ops->logits_topk(gpu, &s->buf, i, 5, fi, fv, &err);
                if (got_n >= 0) {
                    low_served++;
                    low_bad += got_n != fresh_n || memcmp(ti, fi, (size_t)got_n * sizeof *ti) != 0 ||
                               memcmp(tv, fv, (size_t)got_n * sizeof *tv) != 0;
                }
                low_refused += far && got_n < 0;
                tok[i] = top[0];
            }
            luma_logits_set_release(s);
        }
        CHECKF(low_served == 6 && low_bad == 0 && low_refused == 3,
               "top-k after a lowering penalty: %d of 6 served, %d differ, %d of 3 refused", low_served, low_bad,
               low_refused);
        m->topk_ahead = 0;
        /* a failing hook fails the run, and the sequences stay as they were */
        int32_t before = a[0]->n_tokens;
        luma_run_hook bad = { failing_hook, NULL };
        CHECK(luma_model_run_set(m, ca, 3, &bad, &s, &err) != 0 && s == NULL);
        CHECKF(strstr(err.msg, "the hook says no") != NULL, "the hook's failure: %s", err.msg);
        CHECK(a[0]->n_tokens == before && m->n_sets == 0);
        CHECK(luma_model_run_set(m, ca, 3, NULL, &s, &err) == 0 && a[0]->n_tokens == before + 1);
        CHECK(s && !s->argmax);
        luma_logits_set_release(s);
    }
    /* the same kernels on the same rows: equal, up to any nondeterminism of the GPU's sums */
    CHECKF(worst <= 1e-3, "a run into a set differs from the run copied out by %g", worst);
    CHECKF(argmax_bad == 0, "%d cached argmax differ", argmax_bad);
    printf("model: %lld rows run into a set equal the run copied out (max |diff| %g), cached argmax %d differ; "
           "decode steps reuse one pooled allocation; argmax and top-k found ahead equal fresh ones\n",
           (long long)rows, worst, argmax_bad);
    luma_model_logits_drain(m);
    CHECK(m->n_pooled == 0 && m->pooled_bytes == 0);
    for (int i = 0; i < 3; i++) {
        luma_seq_free(a[i]);
        luma_seq_free(h[i]);
    }
    free(want);
    free(got);
    luma_model_free(m);
    remove(path);
}

/* ---- timings --------------------------------------------------------------- */

static void timings(void)
{
    const int32_t n = 262144, R = 128;
    luma_err err;
    luma_buf b;
    if (gpu->ops->logits_alloc(gpu, &b, R, n, &err)) {
        CHECKF(0, "logits_alloc for the timings: %s", err.msg);
        return;
    }
    float *x = xmalloc((size_t)R * (size_t)n * sizeof *x);
    for (size_t i = 0; i < (size_t)R * (size_t)n; i++) x[i] = uniform(-8.0f, 8.0f);
    upload(&b, x, R);
    int32_t *ids = xmalloc(LUMA_TOPK_MAX * sizeof *ids);
    float *vals = xmalloc(LUMA_TOPK_MAX * sizeof *vals);
    double t0, us[9];
    luma_backend *st;
    const char *other = "";
    int reps = 50;
    gpu->ops->logits_argmax(gpu, &b, 0, R, ids, &err);
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_argmax(gpu, &b, 0, R, ids, &err);
    us[0] = (now_s() - t0) / reps * 1e6;
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_topk(gpu, &b, i % R, 40, ids, vals, &err);
    us[1] = (now_s() - t0) / reps * 1e6;
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_topk(gpu, &b, i % R, 2048, ids, vals, &err);
    us[2] = (now_s() - t0) / reps * 1e6;
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_sample(gpu, &b, i % R, 0.5, &err);
    us[3] = (now_s() - t0) / reps * 1e6;
    double chained;
    {
        int32_t id;
        t0 = now_s();
        for (int i = 0; i < reps; i++) {
            gpu->ops->chain_sample(gpu, &b, i % R, &SAMPLERS[0], 0.5, &err);
            gpu->ops->chain_read(gpu, &id, &err);
        }
        chained = (now_s() - t0) / reps * 1e6;
    }
    /* the draws of R rows from their top-k 40, one call */
    double rows_us, rows_host_us;
    {
        int32_t *ri = xmalloc((size_t)R * 64 * sizeof *ri), *cn = xmalloc((size_t)R * sizeof *cn),
                *out = xmalloc((size_t)R * sizeof *out);
        float *rv = xmalloc((size_t)R * 64 * sizeof *rv);
        luma_sampler *smp = xmalloc((size_t)R * sizeof *smp);
        double *u = xmalloc((size_t)R * sizeof *u);
        gpu->ops->logits_topk_rows(gpu, &b, 0, R, 64, ri, rv, cn, &err);
        for (int r = 0; r < R; r++) {
            smp[r] = SAMPLERS[0];
            u[r] = (r + 0.5) / R;
        }
        gpu->ops->sampler_draw_rows(gpu, R, 64, ri, rv, cn, smp, u, out, &err);
        t0 = now_s();
        for (int i = 0; i < reps; i++) gpu->ops->sampler_draw_rows(gpu, R, 64, ri, rv, cn, smp, u, out, &err);
        rows_us = (now_s() - t0) / reps * 1e6;
        t0 = now_s();
        for (int i = 0; i < reps; i++)
            for (int r = 0; r < R; r++) {
                int32_t hid[64];
                float hv[64];
                memcpy(hid, ri + (size_t)r * 64, sizeof hid);
                memcpy(hv, rv + (size_t)r * 64, sizeof hv);
                luma_sampler_draw_top(&smp[r], hid, hv, cn[r] < 40 ? cn[r] : 40, u[r], &err);
            }
        rows_host_us = (now_s() - t0) / reps * 1e6;
        free(ri);
        free(cn);
        free(out);
        free(rv);
        free(smp);
        free(u);
    }
    /* log_softmax in place (each row once: a row's second would see its
     * first's output) and the entropy's sums, against the host's */
    double dist_us[3];
    {
        float *row = xmalloc((size_t)n * sizeof *row);
        t0 = now_s();
        for (int i = 0; i < reps; i++) gpu->ops->logits_softmax(gpu, &b, i % R, true, &err);
        dist_us[0] = (now_s() - t0) / reps * 1e6;
        double z, s;
        t0 = now_s();
        for (int i = 0; i < reps; i++) gpu->ops->logits_live_sums(gpu, &b, i % R, &z, &s, &err);
        dist_us[1] = (now_s() - t0) / reps * 1e6;
        t0 = now_s();
        for (int i = 0; i < 5; i++) {
            memcpy(row, x + (size_t)i * n, (size_t)n * sizeof *row);
            luma_logits_log_softmax(row, n, &err);
        }
        dist_us[2] = (now_s() - t0) / 5 * 1e6;
        free(row);
        upload(&b, x, R);
    }
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_temperature(gpu, &b, i % R, 1.0f, &err);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    us[4] = (now_s() - t0) / reps * 1e6;
    int32_t pid[64];
    float pc[64];
    for (int j = 0; j < 64; j++) {
        pid[j] = j * 101;
        pc[j] = 1.0f;
    }
    luma_logits_edit e = { LUMA_EDIT_PENALIZE, 64, pid, pc, 1.1f, 0.0f, 0.0f };
    t0 = now_s();
    for (int i = 0; i < reps; i++) gpu->ops->logits_edit(gpu, &b, i % R, &e, &err);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    us[5] = (now_s() - t0) / reps * 1e6;
    /* a sampling policy's device work: penalties, then top-k 40 back */
    t0 = now_s();
    for (int i = 0; i < reps; i++) {
        gpu->ops->logits_edit(gpu, &b, i % R, &e, &err);
        gpu->ops->logits_topk(gpu, &b, i % R, 40, ids, vals, &err);
    }
    us[6] = (now_s() - t0) / reps * 1e6;
    /* top-k 40 of every row in one call, as a run finds it ahead for a batch */
    {
        int32_t *ri = xmalloc((size_t)R * 40 * sizeof *ri), *cn = xmalloc((size_t)R * sizeof *cn);
        float *rv = xmalloc((size_t)R * 40 * sizeof *rv);
        gpu->ops->logits_topk_rows(gpu, &b, 0, R, 40, ri, rv, cn, &err);
        t0 = now_s();
        for (int i = 0; i < reps; i++) gpu->ops->logits_topk_rows(gpu, &b, 0, R, 40, ri, rv, cn, &err);
        us[7] = (now_s() - t0) / reps * 1e6;
        st = other_topk_backend(&other);
        us[8] = 0.0;
        if (st) {
            st->ops->logits_topk_rows(st, &b, 0, R, 40, ri, rv, cn, &err);
            t0 = now_s();
            for (int i = 0; i < reps; i++) st->ops->logits_topk_rows(st, &b, 0, R, 40, ri, rv, cn, &err);
            us[8] = (now_s() - t0) / reps * 1e6;
            st->ops->free(st);
        }
        free(ri);
        free(rv);
        free(cn);
    }
    /* host references, one row */
    t0 = now_s();
    for (int i = 0; i < 5; i++) luma_logits_topk(x + (size_t)i * n, n, 40, ids, vals, &err);
    double host_topk = (now_s() - t0) / 5 * 1e6;
    printf("timing (wall clock; n = 262144; a call with a result waits for it, temperature and penalize\n"
           "        are queued and the loop waits once at its end):\n");
    printf("  argmax of %d rows      %8.1f us  %6.0f GB/s (reads %d MiB)\n", R, us[0],
           (double)R * n * 4 / (us[0] * 1e-6) / 1e9, R);
    printf("  top-k 40 of one row    %8.1f us  (host heap: %.0f us)\n", us[1], host_topk);
    printf("  top-k 2048 of one row  %8.1f us\n", us[2]);
    printf("  top-k 40 of %d rows    %8.1f us  %6.0f GB/s\n", R, us[7], (double)R * n * 4 / (us[7] * 1e-6) / 1e9);
    if (us[8] > 0.0)
        printf("    the same, other      %8.1f us  %6.0f GB/s (%s)\n", us[8],
               (double)R * n * 4 / (us[8] * 1e-6) / 1e9, other);
    printf("  sample one row         %8.1f us\n", us[3]);
    printf("  chained draw one row   %8.1f us  (top-k 40, top-p 0.95, temperature 0.8, then read)\n", chained);
    printf("  draws of %d rows       %8.1f us  (the same chain from each row's top-k; on the host %.1f us)\n", R,
           rows_us, rows_host_us);
    printf("  log_softmax one row    %8.1f us  (on the host, without the copy down: %.0f us)\n", dist_us[0],
           dist_us[2]);
    printf("  entropy one row        %8.1f us\n", dist_us[1]);
    printf("  temperature one row    %8.1f us\n", us[4]);
    printf("  penalize 64 ids        %8.1f us\n", us[5]);
    printf("  penalize, then top-k 40 %7.1f us\n", us[6]);
    free(x);
    free(ids);
    free(vals);
    gpu->ops->logits_free(gpu, &b);
}

int main(void)
{
    rnd_seed(0x5eed10617ULL);
    if (!luma_backend_cuda_available()) {
        printf("test_cuda_logits: no CUDA device, the GPU checks did not run\n");
        return 0;
    }
    luma_err err;
    gpu = luma_backend_cuda_new(0, &err);
    if (!gpu) {
        printf("test_cuda_logits: FAIL: %s\n", err.msg);
        return 1;
    }
    test_vocab(32000, false);
    test_vocab(262144, false);
    test_topk_other(32000);
    test_topk_other(262144);
    static char vocab[1024];
    if (luma_test_vocab_path(vocab, sizeof vocab)) {
        test_model(vocab);
    } else {
        CHECKF(0, "no vocabulary at %s for the synthetic model (set LUMA_VOCAB to a GGUF file with a tokenizer)", vocab);
    }
    /* LUMA_CUDA_QUICK: the checks only (a run under compute-sanitizer) */
    if (!getenv("LUMA_CUDA_QUICK")) timings();
    gpu->ops->free(gpu);
    if (failures) {
        printf("test_cuda_logits: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_logits: all checks passed\n");
    return 0;
}
