/* The CPU backend: weights stay in the mapped file, activations in host
 * memory, every operation split over the thread pool.
 *
 * matmul quantizes each activation row once to the weight's activation
 * format, then walks the weight matrix in tiles of TILE_W rows; each tile is
 * multiplied with the activation rows TILE_A at a time while it sits in L1,
 * so a prefill of M tokens reads the weights from memory once, not M times.
 * With AVX2, the legacy block formats go through weight panels instead
 * (cpu/quant_simd.h): from a few activation rows on, each thread decodes 8
 * weight rows at a time into a panel and runs every activation row against
 * it, paying the decoding once per prefill instead of once per 4 tokens;
 * fewer rows (decode) take the panels' rows kernel, which gives the same
 * results bit for bit. With float activations (set_float_act) a tile's rows
 * are dequantized to f32 instead, and every activation row is multiplied
 * with them as floats (the vector ops' qk_f32). Every operation computes a
 * row the same way whatever the other rows of the step, so a sequence's
 * logits do not depend on how its tokens were batched. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/pool.h"
#include "cpu/quant_simd.h"
#include "cpu/vec.h"
#include "quant.h"

#define TILE_W 16
#define TILE_A 4
/* Below this many floats an elementwise operation runs on the calling thread:
 * waking the pool would cost more than the work. */
#define SMALL_OP 16384

#define ROPE_TABLES 2

/* cos and sin of every (row, rotated pair) of a step for one RoPE setting,
 * kept between calls: the forward rotates q and k of every layer, and its
 * layers share one or two settings, so a step computes each table once
 * instead of once per call. A table is reused only for an equal setting and
 * equal positions. */
typedef struct rope_table {
    luma_rope r;
    int32_t *pos;              /* [rows] */
    float *cs;                 /* [rows][n_dims / 2] pairs cos, sin */
    float *pw;                 /* [n_dims / 2] base^(-2i/n_dims) */
    int64_t rows;
    size_t pos_cap, cs_cap, pw_cap;
} rope_table;

typedef struct cpu_backend {
    luma_backend base;
    luma_pool *pool;
    const luma_vec_ops *vec;
    bool avx2;
    void *act;                 /* quantized activation rows */
    size_t act_cap;
    uint8_t *panels;           /* one weight panel per thread */
    size_t panels_cap;
    bool float_act;            /* set_float_act */
    float *deq;                /* float activations: one dequantized tile per thread */
    size_t deq_cap;
    const float **rows;        /* float activations: the activation rows */
    size_t rows_cap;
    rope_table rope[ROPE_TABLES];
    int rope_next;             /* the slot to refill next */
    luma_kv_layout kvl;
    uint8_t *kv_mem[LUMA_KV_MAX_POOLS];
    size_t kv_block_bytes[LUMA_KV_MAX_POOLS];
    const char *failure;       /* set by an operation that could not run; reported by sync */
} cpu_backend;

static cpu_backend *cpu(luma_backend *be) { return (cpu_backend *)be; }

static void run(cpu_backend *c, luma_pool_fn fn, void *ctx, int64_t work)
{
    if (work < SMALL_OP) fn(ctx, 0, 1);
    else luma_pool_run(c->pool, fn, ctx);
}

/* ---- memory ------------------------------------------------------------- */

/* Grows *mem to at least need bytes; false when out of memory. */
static bool reserve(void *mem, size_t *cap, size_t need)
{
    if (need <= *cap) return true;
    void *m = realloc(*(void **)mem, need);
    if (!m) return false;
    *(void **)mem = m;
    *cap = need;
    return true;
}

static int cpu_weight_load(luma_backend *be, luma_weight *w, luma_err *err)
{
    return 0;   /* used in place from the mapping */
}

static int cpu_buf_alloc(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err)
{
    size_t n;
    if (rows < 0 || cols < 0 || luma_mul_size((size_t)rows, (size_t)cols, &n) ||
        n > SIZE_MAX / sizeof(float))
        return luma_errf(err, "activation buffer of %lld x %lld is too large",
                         (long long)rows, (long long)cols);
    float *d = calloc(n ? n : 1, sizeof(float));
    if (!d) return luma_errf(err, "out of memory for a %lld x %lld activation buffer",
                             (long long)rows, (long long)cols);
    b->data = d;
    b->rows = rows;
    b->cols = cols;
    b->cap = (int64_t)n;
    return 0;
}

static void cpu_buf_free(luma_backend *be, luma_buf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

static int cpu_buf_read(luma_backend *be, const luma_buf *b, float *dst, luma_err *err)
{
    memcpy(dst, b->data, (size_t)b->rows * (size_t)b->cols * sizeof(float));
    return 0;
}

/* Bytes of one layer inside a block: K [n_kv_head][B][dk] then V [n_kv_head][B][dv]. */
static size_t kv_layer_bytes(const luma_kv_layout *l)
{
    return (size_t)l->block_tokens * luma_kv_token_bytes(l);
}

static int cpu_kv_alloc(luma_backend *be, const luma_kv_layout *l, luma_err *err)
{
    cpu_backend *c = cpu(be);
    for (int p = 0; p < LUMA_KV_MAX_POOLS; p++) {
        free(c->kv_mem[p]);
        c->kv_mem[p] = NULL;
    }
    c->kvl = *l;
    for (int p = 0; p < l->n_pools; p++) {
        size_t block, total;
        if (luma_mul_size(kv_layer_bytes(l), (size_t)l->n_layers[p], &block) ||
            luma_mul_size(block, (size_t)l->n_blocks[p], &total))
            return luma_errf(err, "KV cache pool %d is too large", p);
        c->kv_block_bytes[p] = block;
        c->kv_mem[p] = malloc(total ? total : 1);
        if (!c->kv_mem[p])
            return luma_errf(err, "out of memory for the KV cache (%zu MiB in pool %d)",
                             total >> 20, p);
    }
    return 0;
}

static void cpu_kv_copy_block(luma_backend *be, int pool, int32_t src, int32_t dst)
{
    cpu_backend *c = cpu(be);
    size_t bb = c->kv_block_bytes[pool];
    memcpy(c->kv_mem[pool] + (size_t)dst * bb, c->kv_mem[pool] + (size_t)src * bb, bb);
}

/* ---- embedding, matmul -------------------------------------------------- */

static void cpu_embed(luma_backend *be, const luma_weight *w, const int32_t *ids, int32_t n,
                      float scale, luma_buf *out)
{
    size_t rs = luma_row_size(w->type, w->cols);
    for (int32_t i = 0; i < n; i++) {
        float *dst = out->data + (size_t)i * (size_t)w->cols;
        luma_dequantize_row(w->type, (const uint8_t *)w->host + (size_t)ids[i] * rs, dst, w->cols);
        if (scale != 1.0f)
            for (int64_t j = 0; j < w->cols; j++) dst[j] *= scale;
    }
    out->rows = n;
    out->cols = w->cols;
}

typedef struct {
    const luma_weight *w;
    const luma_buf *x;
    int32_t n;                 /* activation rows */
    void *act;
    size_t act_row;
    luma_buf *y;
    const luma_panel_ops *panel;   /* NULL: tiles */
    bool packed;               /* through panels, else the panels' rows kernel */
    uint8_t *panels;
    size_t panel_bytes;
} matmul_job;

static void quantize_job(void *p, int ith, int nth)
{
    matmul_job *j = p;
    enum luma_type at = luma_type_get(j->w->type)->act_type;
    int64_t n = j->x->cols;
    long lo, hi;
    luma_pool_split(j->n, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) {
        const float *x = j->x->data + (size_t)i * (size_t)n;
        uint8_t *dst = (uint8_t *)j->act + (size_t)i * j->act_row;
        if (!j->panel) {
            luma_quantize_act(at, x, dst, n);
            continue;
        }
#if defined(__x86_64__)
        /* through 8 Q8_0 blocks at a time */
        luma_block_q8_0 tmp[8];
        for (int64_t k = 0; k < n; k += 8 * LUMA_QK) {
            int64_t len = n - k < 8 * LUMA_QK ? n - k : 8 * LUMA_QK;
            luma_quantize_act(at, x + k, tmp, len);
            luma_panel_act_avx2(tmp, len, (luma_panel_act *)dst + k / LUMA_QK);
        }
#endif
    }
}

static void matmul_panel_run(void *p, int ith, int nth)
{
    matmul_job *j = p;
    const luma_weight *w = j->w;
    size_t wrow = luma_row_size(w->type, w->cols);
    uint8_t *panel = j->panels + (size_t)ith * j->panel_bytes;
    long panels = (w->rows + LUMA_PANEL_ROWS - 1) / LUMA_PANEL_ROWS, lo, hi;
    luma_pool_split(panels, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) {
        int64_t r0 = t * LUMA_PANEL_ROWS;
        int nr = (int)(w->rows - r0 < LUMA_PANEL_ROWS ? w->rows - r0 : LUMA_PANEL_ROWS);
        j->panel->pack(w->cols, (const uint8_t *)w->host + (size_t)r0 * wrow, wrow, nr, panel);
        j->panel->dot(w->cols, panel, nr, j->act, j->act_row, j->n, j->y->data + r0, (size_t)w->rows);
    }
}

static void matmul_job_run(void *p, int ith, int nth)
{
    matmul_job *j = p;
    const luma_weight *w = j->w;
    size_t wrow = luma_row_size(w->type, w->cols);
    long tiles = (w->rows + TILE_W - 1) / TILE_W, lo, hi;
    luma_pool_split(tiles, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) {
        int64_t r0 = t * TILE_W;
        int nr = (int)(w->rows - r0 < TILE_W ? w->rows - r0 : TILE_W);
        const uint8_t *wt = (const uint8_t *)w->host + (size_t)r0 * wrow;
        if (j->panel) {
            j->panel->rows(w->cols, wt, wrow, nr, j->act, j->act_row, j->n, j->y->data + r0, (size_t)w->rows);
            continue;
        }
        for (int32_t a0 = 0; a0 < j->n; a0 += TILE_A) {
            int na = j->n - a0 < TILE_A ? j->n - a0 : TILE_A;
            luma_vec_dot_rows(w->type, w->cols, wt, wrow, nr,
                              (const uint8_t *)j->act + (size_t)a0 * j->act_row, j->act_row, na,
                              j->y->data + (size_t)a0 * (size_t)w->rows + r0, (size_t)w->rows);
        }
    }
}

typedef struct {
    const luma_weight *w;
    const float *const *x;     /* the n activation rows */
    int32_t n;
    float *deq;                /* TILE_W rows of w->cols floats per thread */
    const luma_vec_ops *vec;
    luma_buf *y;
} float_job;

static void matmul_float_run(void *p, int ith, int nth)
{
    float_job *j = p;
    const luma_weight *w = j->w;
    size_t wrow = luma_row_size(w->type, w->cols);
    float *deq = j->deq + (size_t)ith * TILE_W * (size_t)w->cols;
    long tiles = (w->rows + TILE_W - 1) / TILE_W, lo, hi;
    luma_pool_split(tiles, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) {
        int64_t r0 = t * TILE_W;
        int nr = (int)(w->rows - r0 < TILE_W ? w->rows - r0 : TILE_W);
        for (int r = 0; r < nr; r++)
            luma_dequantize_row(w->type, (const uint8_t *)w->host + (size_t)(r0 + r) * wrow,
                                deq + (size_t)r * (size_t)w->cols, w->cols);
        j->vec->qk_f32(w->cols, j->x, j->n, deq, (size_t)w->cols, nr, j->y->data + r0, (size_t)w->rows);
    }
}

static void matmul_float(cpu_backend *c, const luma_weight *w, const luma_buf *x, luma_buf *y)
{
    int32_t n = (int32_t)x->rows;
    size_t per = (size_t)TILE_W * (size_t)w->cols * sizeof(float);
    if (!reserve(&c->deq, &c->deq_cap, per * (size_t)luma_pool_size(c->pool)) ||
        !reserve(&c->rows, &c->rows_cap, sizeof(float *) * (size_t)(n ? n : 1))) {
        c->failure = "out of memory for dequantized weight rows";
        return;
    }
    for (int32_t i = 0; i < n; i++) c->rows[i] = x->data + (size_t)i * (size_t)x->cols;
    float_job j = { w, c->rows, n, c->deq, c->vec, y };
    if (n > 0) luma_pool_run(c->pool, matmul_float_run, &j);
    y->rows = n;
    y->cols = w->rows;
}

static void cpu_matmul(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y)
{
    cpu_backend *c = cpu(be);
    if (c->float_act) {
        matmul_float(c, w, x, y);
        return;
    }
    int32_t n = (int32_t)x->rows;
    matmul_job j = { .w = w, .x = x, .n = n, .y = y };
#if defined(__x86_64__)
    if (c->avx2) j.panel = luma_panel_avx2(w->type);
#endif
    if (j.panel) {
        j.packed = n >= j.panel->min_rows;
        j.act_row = (size_t)(w->cols / LUMA_QK) * sizeof(luma_panel_act);
        j.panel_bytes = (size_t)(w->cols / LUMA_QK) * j.panel->block_bytes;
        if (j.packed && !reserve(&c->panels, &c->panels_cap, j.panel_bytes * (size_t)luma_pool_size(c->pool))) {
            c->failure = "out of memory for weight panels";
            return;
        }
        j.panels = c->panels;
    } else {
        j.act_row = luma_row_size(luma_type_get(w->type)->act_type, w->cols);
    }
    if (!reserve(&c->act, &c->act_cap, j.act_row * (size_t)(n ? n : 1))) {
        c->failure = "out of memory for quantized activations";
        return;
    }
    j.act = c->act;
    run(c, quantize_job, &j, (int64_t)n * w->cols);
    luma_pool_run(c->pool, j.packed ? matmul_panel_run : matmul_job_run, &j);
    y->rows = n;
    y->cols = w->rows;
}

static void cpu_gather(luma_backend *be, const luma_buf *x, const int32_t *rows, int32_t n,
                       luma_buf *out)
{
    for (int32_t j = 0; j < n; j++)
        memcpy(out->data + (size_t)j * (size_t)x->cols, x->data + (size_t)rows[j] * (size_t)x->cols,
               (size_t)x->cols * sizeof(float));
    out->rows = n;
    out->cols = x->cols;
}

/* ---- elementwise -------------------------------------------------------- */

static void cpu_add_bias(luma_backend *be, luma_buf *x, const luma_weight *b)
{
    const float *bv = b->host;
    for (int64_t i = 0; i < x->rows; i++) {
        float *r = x->data + (size_t)i * (size_t)x->cols;
        for (int64_t j = 0; j < x->cols; j++) r[j] += bv[j];
    }
}

typedef struct {
    const luma_buf *x;
    const float *g;
    int64_t group;
    float eps;
    luma_buf *out;
    const luma_vec_ops *vec;
} norm_job;

static void norm_job_run(void *p, int ith, int nth)
{
    norm_job *j = p;
    int64_t per_row = j->x->cols / j->group;
    long lo, hi;
    luma_pool_split(j->x->rows * per_row, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) {
        const float *src = j->x->data + (size_t)i * (size_t)j->group;
        float *dst = j->out->data + (size_t)i * (size_t)j->group;
        float s = (float)(1.0 / sqrt(j->vec->sum_sq(j->group, src) / (double)j->group + j->eps));
        for (int64_t k = 0; k < j->group; k++) dst[k] = src[k] * s * j->g[k];
    }
}

static void cpu_rmsnorm(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group,
                        float eps, luma_buf *out)
{
    out->rows = x->rows;
    out->cols = x->cols;
    norm_job j = { x, g->host, group, eps, out, cpu(be)->vec };
    run(cpu(be), norm_job_run, &j, x->rows * x->cols);
}

typedef struct {
    rope_table *t;
    luma_buf *x;
    int32_t head_dim;
} rope_job;

static void rope_fill_run(void *p, int ith, int nth)
{
    rope_job *j = p;
    const luma_rope *r = &j->t->r;
    int32_t half = r->n_dims / 2;
    long lo, hi;
    luma_pool_split(j->t->rows, ith, nth, &lo, &hi);
    for (long row = lo; row < hi; row++) {
        float pos = (float)j->t->pos[row] * r->pos_scale, *cs = j->t->cs + (size_t)row * (size_t)half * 2;
        for (int32_t i = 0; i < half; i++) {
            float theta = pos * j->t->pw[i];
            if (r->freq_factors) theta /= r->freq_factors[i];
            cs[2 * i] = cosf(theta);
            cs[2 * i + 1] = sinf(theta);
        }
    }
}

static void rope_job_run(void *p, int ith, int nth)
{
    rope_job *j = p;
    const luma_rope *r = &j->t->r;
    int64_t heads = j->x->cols / j->head_dim;
    int32_t half = r->n_dims / 2;
    /* NORM rotates adjacent pairs (a, a + 1); NEOX the two halves (a, a + half) */
    int32_t step = r->kind == LUMA_ROPE_NEOX ? 1 : 2, other = r->kind == LUMA_ROPE_NEOX ? half : 1;
    long lo, hi;
    luma_pool_split(j->x->rows, ith, nth, &lo, &hi);
    for (long row = lo; row < hi; row++) {
        const float *cs = j->t->cs + (size_t)row * (size_t)half * 2;
        for (int64_t h = 0; h < heads; h++) {
            float *v = j->x->data + (size_t)row * (size_t)j->x->cols + (size_t)h * (size_t)j->head_dim;
            for (int32_t i = 0; i < half; i++) {
                float *a = v + i * step, *b = a + other;
                float x0 = *a, x1 = *b;
                *a = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
                *b = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
            }
        }
    }
}

static bool rope_same(const luma_rope *a, const luma_rope *b)
{
    return a->kind == b->kind && a->n_dims == b->n_dims && a->base == b->base &&
           a->pos_scale == b->pos_scale && a->freq_factors == b->freq_factors;
}

/* The table for r at these positions: a kept one, or the older slot filled. */
static rope_table *rope_lookup(cpu_backend *c, const int32_t *pos, int64_t rows, const luma_rope *r)
{
    for (int i = 0; i < ROPE_TABLES; i++) {
        rope_table *t = &c->rope[i];
        if (t->rows == rows && rope_same(&t->r, r) && memcmp(t->pos, pos, (size_t)rows * sizeof *pos) == 0) {
            c->rope_next = (i + 1) % ROPE_TABLES;
            return t;
        }
    }
    rope_table *t = &c->rope[c->rope_next];
    c->rope_next = (c->rope_next + 1) % ROPE_TABLES;
    t->rows = 0;
    int32_t half = r->n_dims / 2;
    if (!reserve(&t->pos, &t->pos_cap, (size_t)rows * sizeof *pos) ||
        !reserve(&t->cs, &t->cs_cap, (size_t)rows * (size_t)half * 2 * sizeof(float)) ||
        !reserve(&t->pw, &t->pw_cap, (size_t)(half > 0 ? half : 1) * sizeof(float)))
        return NULL;
    memcpy(t->pos, pos, (size_t)rows * sizeof *pos);
    /* theta_i = pos * scale * base^(-2i/n_dims) / factor_i, multiplied in
     * that order; the powers once per table */
    for (int32_t i = 0; i < half; i++) t->pw[i] = powf(r->base, -2.0f * (float)i / (float)r->n_dims);
    t->r = *r;
    t->rows = rows;
    rope_job j = { t, NULL, 0 };
    run(c, rope_fill_run, &j, rows * r->n_dims * 16);
    return t;
}

static void cpu_rope(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos,
                     const luma_rope *r)
{
    cpu_backend *c = cpu(be);
    rope_table *t = rope_lookup(c, pos, x->rows, r);
    if (!t) {
        c->failure = "out of memory for RoPE tables";
        return;
    }
    rope_job j = { t, x, head_dim };
    run(c, rope_job_run, &j, x->rows * x->cols);
}

typedef struct {
    luma_buf *a;
    const luma_buf *b;
    int op;
    const luma_vec_ops *vec;
} ew_job;

enum { EW_ADD, EW_GELU_MUL, EW_SILU_MUL };

static void ew_job_run(void *p, int ith, int nth)
{
    ew_job *j = p;
    long lo, hi;
    luma_pool_split(j->a->rows * j->a->cols, ith, nth, &lo, &hi);
    float *a = j->a->data + lo;
    const float *b = j->b->data + lo;
    switch (j->op) {
    case EW_ADD:
        for (long i = 0; i < hi - lo; i++) a[i] += b[i];
        break;
    case EW_GELU_MUL:
        j->vec->gelu_mul(hi - lo, a, b);
        break;
    case EW_SILU_MUL:
        j->vec->silu_mul(hi - lo, a, b);
        break;
    }
}

static void elementwise(luma_backend *be, luma_buf *a, const luma_buf *b, int op)
{
    ew_job j = { a, b, op, cpu(be)->vec };
    run(cpu(be), ew_job_run, &j, a->rows * a->cols * (op == EW_ADD ? 1 : 4));
}

static void cpu_add(luma_backend *be, luma_buf *x, const luma_buf *y) { elementwise(be, x, y, EW_ADD); }
static void cpu_gelu_mul(luma_backend *be, luma_buf *g, const luma_buf *u) { elementwise(be, g, u, EW_GELU_MUL); }
static void cpu_silu_mul(luma_backend *be, luma_buf *g, const luma_buf *u) { elementwise(be, g, u, EW_SILU_MUL); }

/* ---- attention over the paged cache ------------------------------------- */

/* The work is cut into items: a run of up to ATTN_ROWS consecutive rows of
 * one sequence, times a set of heads sharing one KV head (fewer heads when
 * there would be fewer items than threads, as in decode). An item walks its
 * keys in chunks of ATTN_CHUNK positions with an online softmax (each query
 * row keeps its running maximum and sum, and its output is rescaled when the
 * maximum grows), so every cached key and value is read and converted once
 * for all of the item's query rows (up to ATTN_Q of them). Chunks start at
 * multiples of ATTN_CHUNK and always span ATTN_CHUNK scores (those a row
 * does not see are -inf): a row's arithmetic is then the same whatever rows
 * and heads share its item. */
#define ATTN_ROWS 4
#define ATTN_Q 16
#define ATTN_CHUNK 64

typedef struct {
    int32_t row0, n_rows, seq;
} attn_run_rows;

typedef struct {
    cpu_backend *c;
    const luma_buf *q, *k, *v;
    const luma_step *step;
    const luma_attn *a;
    luma_buf *out;
    int32_t *row_seq;          /* sequence of each row */
    const attn_run_rows *runs;
    int32_t n_runs;
    int32_t heads;             /* per item, dividing the group of a KV head */
} attn_job;

/* Address of the K (or V) row of a cached position, for one kv head. */
static uint8_t *kv_row(cpu_backend *c, const luma_attn *a, int32_t block, int32_t off, int32_t kvh,
                       bool value)
{
    const luma_kv_layout *l = &c->kvl;
    size_t es = luma_kv_elem_size(l);
    uint8_t *base = c->kv_mem[a->pool] + (size_t)block * c->kv_block_bytes[a->pool] +
                    (size_t)a->layer * kv_layer_bytes(l);
    size_t k_bytes = (size_t)l->n_kv_head * (size_t)l->block_tokens * (size_t)l->head_dim_k * es;
    if (!value)
        return base + ((size_t)kvh * (size_t)l->block_tokens + (size_t)off) * (size_t)l->head_dim_k * es;
    return base + k_bytes + ((size_t)kvh * (size_t)l->block_tokens + (size_t)off) * (size_t)l->head_dim_v * es;
}

static void store_row(cpu_backend *c, const float *src, uint8_t *dst, int64_t n)
{
    if (c->kvl.type == LUMA_F16) c->vec->f32_to_f16(n, src, (uint16_t *)dst);
    else memcpy(dst, src, (size_t)n * sizeof(float));
}

static void attn_store_run(void *p, int ith, int nth)
{
    attn_job *j = p;
    const luma_attn *a = j->a;
    int32_t B = j->c->kvl.block_tokens;
    long lo, hi;
    luma_pool_split(j->step->n_rows, ith, nth, &lo, &hi);
    for (long r = lo; r < hi; r++) {
        const luma_step_seq *s = &j->step->seqs[j->row_seq[r]];
        int32_t pos = j->step->pos[r];
        int32_t block = s->blocks[a->pool][pos / B];
        for (int32_t h = 0; h < a->n_kv_head; h++) {
            store_row(j->c, j->k->data + (size_t)r * (size_t)j->k->cols + (size_t)h * (size_t)a->head_dim_k,
                      kv_row(j->c, a, block, pos % B, h, false), a->head_dim_k);
            store_row(j->c, j->v->data + (size_t)r * (size_t)j->v->cols + (size_t)h * (size_t)a->head_dim_v,
                      kv_row(j->c, a, block, pos % B, h, true), a->head_dim_v);
        }
    }
}

/* The keys [k0, k1) of one sequence, cut at KV block boundaries: scores
 * s[i * ATTN_CHUNK + key - k0] of the nq query rows, or (o != NULL) the
 * weighted values added to o. */
static void attn_keys(cpu_backend *c, const luma_attn *a, const luma_step_seq *sq, int32_t kvh,
                      int32_t k0, int32_t k1, const float *const *q, float *const *o, int nq, float *s)
{
    const luma_vec_ops *vec = c->vec;
    bool f16 = c->kvl.type == LUMA_F16;
    int32_t B = c->kvl.block_tokens;
    for (int32_t k = k0; k < k1;) {
        int32_t block = sq->blocks[a->pool][k / B], off = k % B;
        int nk = (int)(B - off < k1 - k ? B - off : k1 - k);
        float *sk = s + (k - k0);
        if (!o) {
            const uint8_t *kr = kv_row(c, a, block, off, kvh, false);
            if (f16) vec->qk_f16(a->head_dim_k, q, nq, (const uint16_t *)kr, (size_t)a->head_dim_k, nk, sk, ATTN_CHUNK);
            else vec->qk_f32(a->head_dim_k, q, nq, (const float *)kr, (size_t)a->head_dim_k, nk, sk, ATTN_CHUNK);
        } else {
            const uint8_t *vr = kv_row(c, a, block, off, kvh, true);
            if (f16) vec->pv_f16(a->head_dim_v, o, nq, sk, ATTN_CHUNK, (const uint16_t *)vr, (size_t)a->head_dim_v, nk);
            else vec->pv_f32(a->head_dim_v, o, nq, sk, ATTN_CHUNK, (const float *)vr, (size_t)a->head_dim_v, nk);
        }
        k += nk;
    }
}

static void attn_run(void *p, int ith, int nth)
{
    attn_job *j = p;
    cpu_backend *c = j->c;
    const luma_attn *a = j->a;
    int32_t group = a->n_head / a->n_kv_head, hsplits = group / j->heads, dv = a->head_dim_v;
    float s[ATTN_Q * ATTN_CHUNK], m[ATTN_Q], l[ATTN_Q];
    const float *q[ATTN_Q];
    float *o[ATTN_Q];
    int32_t first[ATTN_Q], last[ATTN_Q];
    long lo, hi;
    luma_pool_split((long)j->n_runs * a->n_kv_head * hsplits, ith, nth, &lo, &hi);
    for (long item = lo; item < hi; item++) {
        int32_t hs = (int32_t)(item % hsplits), kvh = (int32_t)(item / hsplits % a->n_kv_head);
        int32_t h0 = kvh * group + hs * j->heads;
        const attn_run_rows *run = &j->runs[item / hsplits / a->n_kv_head];
        const luma_step_seq *sq = &j->step->seqs[run->seq];
        int nq = run->n_rows * j->heads;
        for (int i = 0; i < nq; i++) {
            int32_t r = run->row0 + i / j->heads, h = h0 + i % j->heads;
            int32_t pos = j->step->pos[r];
            q[i] = j->q->data + (size_t)r * (size_t)j->q->cols + (size_t)h * (size_t)a->head_dim_k;
            o[i] = j->out->data + (size_t)r * (size_t)j->out->cols + (size_t)h * (size_t)dv;
            memset(o[i], 0, (size_t)dv * sizeof(float));
            first[i] = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            last[i] = pos;
            m[i] = -INFINITY;
            l[i] = 0;
        }
        /* rows run at increasing positions: the first row sees the first
         * key, the last row the last */
        int32_t kb = first[0], ke = last[nq - 1] + 1;
        for (int32_t c0 = kb / ATTN_CHUNK * ATTN_CHUNK; c0 < ke; c0 += ATTN_CHUNK) {
            int32_t k0 = c0 > kb ? c0 : kb, k1 = c0 + ATTN_CHUNK < ke ? c0 + ATTN_CHUNK : ke;
            attn_keys(c, a, sq, kvh, k0, k1, q, NULL, nq, s + (k0 - c0));
            for (int i = 0; i < nq; i++) {
                float *si = s + (size_t)i * ATTN_CHUNK, mx = -INFINITY;
                for (int32_t k = c0; k < c0 + ATTN_CHUNK; k++) {
                    float sc = -INFINITY;
                    if (k >= k0 && k < k1 && k >= first[i] && k <= last[i]) {
                        sc = si[k - c0] * a->scale;
                        if (a->softcap > 0) sc = a->softcap * tanhf(sc / a->softcap);
                    }
                    si[k - c0] = sc;
                    if (sc > mx) mx = sc;
                }
                if (mx == -INFINITY) {
                    memset(si, 0, ATTN_CHUNK * sizeof(float));
                    continue;
                }
                if (mx > m[i]) {
                    float f = expf(m[i] - mx);
                    l[i] *= f;
                    if (f != 1.0f)
                        for (int32_t d = 0; d < dv; d++) o[i][d] *= f;
                    m[i] = mx;
                }
                l[i] += c->vec->exp_sum(ATTN_CHUNK, si, m[i], si);
            }
            attn_keys(c, a, sq, kvh, k0, k1, NULL, o, nq, s + (k0 - c0));
        }
        for (int i = 0; i < nq; i++) {
            float inv = 1.0f / l[i];
            for (int32_t d = 0; d < dv; d++) o[i][d] *= inv;
        }
    }
}

static void cpu_attention(luma_backend *be, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                          const luma_step *step, const luma_attn *a, luma_buf *out)
{
    cpu_backend *c = cpu(be);
    /* The rows of a step are few (at most max_rows): small stack maps from
     * row to sequence, and runs of rows, keep the workers free of searching. */
    int32_t row_seq_small[1024];
    attn_run_rows runs_small[1024];
    bool small = step->n_rows <= 1024;
    int32_t *row_seq = small ? row_seq_small : malloc((size_t)step->n_rows * sizeof(int32_t));
    attn_run_rows *runs = small ? runs_small : malloc((size_t)step->n_rows * sizeof *runs);
    if (!row_seq || !runs) {
        c->failure = "out of memory for attention";
        goto done;
    }
    int32_t group = a->n_head / a->n_kv_head, heads = group < ATTN_Q ? group : ATTN_Q;
    while (group % heads) heads--;
    int32_t rows = ATTN_Q / heads < ATTN_ROWS ? ATTN_Q / heads : ATTN_ROWS;
    int32_t n_runs = 0;
    for (int32_t s = 0; s < step->n_seqs; s++) {
        const luma_step_seq *sq = &step->seqs[s];
        for (int32_t r = 0; r < sq->n_rows; r++) row_seq[sq->row0 + r] = s;
        for (int32_t r = 0; r < sq->n_rows; r += rows) {
            int32_t n = sq->n_rows - r < rows ? sq->n_rows - r : rows;
            runs[n_runs++] = (attn_run_rows){ sq->row0 + r, n, s };
        }
    }
    /* Too few items for the threads (decode): fewer heads per item. */
    int nth = luma_pool_size(c->pool);
    while (heads > 1 && (long)n_runs * a->n_kv_head * (group / heads) < nth) {
        int32_t h = heads - 1;
        while (group % h) h--;
        heads = h;
    }
    out->rows = q->rows;
    out->cols = (int64_t)a->n_head * a->head_dim_v;
    attn_job j = { c, q, k, v, step, a, out, row_seq, runs, n_runs, heads };
    run(c, attn_store_run, &j, step->n_rows * k->cols);
    luma_pool_run(c->pool, attn_run, &j);
done:
    if (row_seq != row_seq_small) free(row_seq);
    if (runs != runs_small) free(runs);
}

static int cpu_sync(luma_backend *be, luma_err *err)
{
    cpu_backend *c = cpu(be);
    if (!c->failure) return 0;
    luma_errf(err, "%s", c->failure);
    c->failure = NULL;
    return -1;
}

static void cpu_free(luma_backend *be)
{
    cpu_backend *c = cpu(be);
    if (!c) return;
    luma_pool_free(c->pool);
    for (int p = 0; p < LUMA_KV_MAX_POOLS; p++) free(c->kv_mem[p]);
    free(c->act);
    free(c->panels);
    free(c->deq);
    free(c->rows);
    for (int i = 0; i < ROPE_TABLES; i++) {
        free(c->rope[i].pos);
        free(c->rope[i].cs);
        free(c->rope[i].pw);
    }
    free(c);
}

static int cpu_set_float_act(luma_backend *be, bool on, luma_err *err)
{
    cpu(be)->float_act = on;
    return 0;
}

static const luma_backend_ops cpu_ops = {
    .name = "cpu",
    .free = cpu_free,
    .weight_load = cpu_weight_load,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .buf_read = cpu_buf_read,
    .kv_alloc = cpu_kv_alloc,
    .kv_copy_block = cpu_kv_copy_block,
    .embed = cpu_embed,
    .matmul = cpu_matmul,
    .gather = cpu_gather,
    .add_bias = cpu_add_bias,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .gelu_mul = cpu_gelu_mul,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .sync = cpu_sync,
    .set_float_act = cpu_set_float_act,
};

luma_backend *luma_backend_cpu_new(int n_threads, luma_err *err)
{
    cpu_backend *c = calloc(1, sizeof *c);
    if (!c) {
        luma_errf(err, "out of memory for the CPU backend");
        return NULL;
    }
    c->base.ops = &cpu_ops;
    c->vec = luma_vec_get();
    c->avx2 = strcmp(luma_simd_name(), "avx2") == 0;
    c->pool = luma_pool_new(n_threads);
    if (!c->pool) {
        free(c);
        luma_errf(err, "could not start %d worker threads", n_threads);
        return NULL;
    }
    return &c->base;
}
