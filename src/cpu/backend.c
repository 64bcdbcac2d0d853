/* The CPU backend: weights stay in the mapped file, activations in host
 * memory, every operation split over the thread pool.
 *
 * matmul quantizes each activation row once to the weight's activation
 * format, then walks the weight matrix in tiles of TILE_W rows; each tile is
 * multiplied with the activation rows TILE_A at a time while it sits in L1,
 * so a prefill of M tokens reads the weights from memory once, not M times. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/pool.h"
#include "cpu/vec.h"
#include "quant.h"

#define TILE_W 16
#define TILE_A 4
/* Below this many floats an elementwise operation runs on the calling thread:
 * waking the pool would cost more than the work. */
#define SMALL_OP 16384

typedef struct cpu_backend {
    luma_backend base;
    luma_pool *pool;
    const luma_vec_ops *vec;
    void *act;                 /* quantized activation rows */
    size_t act_cap;
    float *scratch;            /* per-thread attention scores and accumulators */
    size_t scratch_per_thread;
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

static size_t kv_elem_size(const luma_kv_layout *l) { return l->type == LUMA_F16 ? 2 : 4; }

/* Bytes of one layer inside a block: K [n_kv_head][B][dk] then V [n_kv_head][B][dv]. */
static size_t kv_layer_bytes(const luma_kv_layout *l)
{
    return (size_t)l->n_kv_head * (size_t)l->block_tokens *
           ((size_t)l->head_dim_k + (size_t)l->head_dim_v) * kv_elem_size(l);
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
    /* Scores for the longest visible context, plus one output head. */
    size_t ctx = 0;
    for (int p = 0; p < l->n_pools; p++) ctx += (size_t)l->n_blocks[p] * (size_t)l->block_tokens;
    c->scratch_per_thread = ctx + (size_t)l->head_dim_v + 16;
    free(c->scratch);
    c->scratch = malloc(c->scratch_per_thread * (size_t)luma_pool_size(c->pool) * sizeof(float));
    if (!c->scratch) return luma_errf(err, "out of memory for attention scratch");
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
} matmul_job;

static void quantize_job(void *p, int ith, int nth)
{
    matmul_job *j = p;
    enum luma_type at = luma_type_get(j->w->type)->act_type;
    long lo, hi;
    luma_pool_split(j->n, ith, nth, &lo, &hi);
    for (long i = lo; i < hi; i++) {
        luma_quantize_act(at, j->x->data + (size_t)i * (size_t)j->x->cols,
                          (uint8_t *)j->act + (size_t)i * j->act_row, j->x->cols);
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
        for (int32_t a0 = 0; a0 < j->n; a0 += TILE_A) {
            int na = j->n - a0 < TILE_A ? j->n - a0 : TILE_A;
            luma_vec_dot_rows(w->type, w->cols, wt, wrow, nr,
                              (const uint8_t *)j->act + (size_t)a0 * j->act_row, j->act_row, na,
                              j->y->data + (size_t)a0 * (size_t)w->rows + r0, (size_t)w->rows);
        }
    }
}

static void cpu_matmul(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y)
{
    cpu_backend *c = cpu(be);
    int32_t n = (int32_t)x->rows;
    enum luma_type at = luma_type_get(w->type)->act_type;
    size_t act_row = luma_row_size(at, w->cols);
    size_t need = act_row * (size_t)(n ? n : 1);
    if (need > c->act_cap) {
        void *a = realloc(c->act, need);
        if (!a) {
            c->failure = "out of memory for quantized activations";
            return;
        }
        c->act = a;
        c->act_cap = need;
    }
    matmul_job j = { w, x, n, c->act, act_row, y };
    run(c, quantize_job, &j, (int64_t)n * w->cols);
    luma_pool_run(c->pool, matmul_job_run, &j);
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
        double ss = 0;
        for (int64_t k = 0; k < j->group; k++) ss += (double)src[k] * src[k];
        float s = (float)(1.0 / sqrt(ss / (double)j->group + j->eps));
        for (int64_t k = 0; k < j->group; k++) dst[k] = src[k] * s * j->g[k];
    }
}

static void cpu_rmsnorm(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group,
                        float eps, luma_buf *out)
{
    out->rows = x->rows;
    out->cols = x->cols;
    norm_job j = { x, g->host, group, eps, out };
    run(cpu(be), norm_job_run, &j, x->rows * x->cols);
}

typedef struct {
    luma_buf *x;
    int32_t head_dim;
    const int32_t *pos;
    const luma_rope *r;
} rope_job;

static void rope_job_run(void *p, int ith, int nth)
{
    rope_job *j = p;
    const luma_rope *r = j->r;
    int64_t heads = j->x->cols / j->head_dim;
    int32_t half = r->n_dims / 2;
    long lo, hi;
    luma_pool_split(j->x->rows, ith, nth, &lo, &hi);
    for (long row = lo; row < hi; row++) {
        float pos = (float)j->pos[row] * r->pos_scale;
        for (int32_t i = 0; i < half; i++) {
            float theta = pos * powf(r->base, -2.0f * (float)i / (float)r->n_dims);
            if (r->freq_factors) theta /= r->freq_factors[i];
            float cs = cosf(theta), sn = sinf(theta);
            for (int64_t h = 0; h < heads; h++) {
                float *v = j->x->data + (size_t)row * (size_t)j->x->cols + (size_t)h * (size_t)j->head_dim;
                /* NORM rotates adjacent pairs; NEOX rotates the two halves. */
                int32_t a = r->kind == LUMA_ROPE_NEOX ? i : 2 * i;
                int32_t b = r->kind == LUMA_ROPE_NEOX ? i + half : 2 * i + 1;
                float x0 = v[a], x1 = v[b];
                v[a] = x0 * cs - x1 * sn;
                v[b] = x0 * sn + x1 * cs;
            }
        }
    }
}

static void cpu_rope(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos,
                     const luma_rope *r)
{
    rope_job j = { x, head_dim, pos, r };
    run(cpu(be), rope_job_run, &j, x->rows * x->cols * 8);
}

typedef struct {
    luma_buf *a;
    const luma_buf *b;
    int op;
} ew_job;

enum { EW_ADD, EW_GELU_MUL, EW_SILU_MUL };

static float gelu_tanh(float x)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

static void ew_job_run(void *p, int ith, int nth)
{
    ew_job *j = p;
    long lo, hi;
    luma_pool_split(j->a->rows * j->a->cols, ith, nth, &lo, &hi);
    float *a = j->a->data;
    const float *b = j->b->data;
    switch (j->op) {
    case EW_ADD:
        for (long i = lo; i < hi; i++) a[i] += b[i];
        break;
    case EW_GELU_MUL:
        for (long i = lo; i < hi; i++) a[i] = gelu_tanh(a[i]) * b[i];
        break;
    case EW_SILU_MUL:
        for (long i = lo; i < hi; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
        break;
    }
}

static void elementwise(luma_backend *be, luma_buf *a, const luma_buf *b, int op)
{
    ew_job j = { a, b, op };
    run(cpu(be), ew_job_run, &j, a->rows * a->cols * (op == EW_ADD ? 1 : 8));
}

static void cpu_add(luma_backend *be, luma_buf *x, const luma_buf *y) { elementwise(be, x, y, EW_ADD); }
static void cpu_gelu_mul(luma_backend *be, luma_buf *g, const luma_buf *u) { elementwise(be, g, u, EW_GELU_MUL); }
static void cpu_silu_mul(luma_backend *be, luma_buf *g, const luma_buf *u) { elementwise(be, g, u, EW_SILU_MUL); }

/* ---- attention over the paged cache ------------------------------------- */

typedef struct {
    cpu_backend *c;
    const luma_buf *q, *k, *v;
    const luma_step *step;
    const luma_attn *a;
    luma_buf *out;
    int32_t *row_seq;          /* sequence of each row */
} attn_job;

/* Address of the K (or V) row of a cached position, for one kv head. */
static uint8_t *kv_row(cpu_backend *c, const luma_attn *a, int32_t block, int32_t off, int32_t kvh,
                       bool value)
{
    const luma_kv_layout *l = &c->kvl;
    size_t es = kv_elem_size(l);
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

static void attn_run(void *p, int ith, int nth)
{
    attn_job *j = p;
    cpu_backend *c = j->c;
    const luma_attn *a = j->a;
    const luma_vec_ops *vec = c->vec;
    bool f16 = c->kvl.type == LUMA_F16;
    int32_t B = c->kvl.block_tokens, group = a->n_head / a->n_kv_head;
    float *scores = c->scratch + (size_t)ith * c->scratch_per_thread;
    long lo, hi;
    luma_pool_split((long)j->step->n_rows * a->n_head, ith, nth, &lo, &hi);
    for (long item = lo; item < hi; item++) {
        long r = item / a->n_head;
        int32_t h = (int32_t)(item % a->n_head), kvh = h / group;
        const luma_step_seq *s = &j->step->seqs[j->row_seq[r]];
        int32_t pos = j->step->pos[r];
        int32_t first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        const float *q = j->q->data + (size_t)r * (size_t)j->q->cols + (size_t)h * (size_t)a->head_dim_k;
        float mx = -INFINITY;
        for (int32_t k = first; k <= pos; k++) {
            const uint8_t *kr = kv_row(c, a, s->blocks[a->pool][k / B], k % B, kvh, false);
            float sc = (f16 ? vec->dot_f16(a->head_dim_k, (const uint16_t *)kr, q)
                            : vec->dot_f32(a->head_dim_k, (const float *)kr, q)) * a->scale;
            if (a->softcap > 0) sc = a->softcap * tanhf(sc / a->softcap);
            scores[k - first] = sc;
            if (sc > mx) mx = sc;
        }
        float sum = 0;
        for (int32_t k = first; k <= pos; k++) {
            float e = expf(scores[k - first] - mx);
            scores[k - first] = e;
            sum += e;
        }
        float *o = j->out->data + (size_t)r * (size_t)j->out->cols + (size_t)h * (size_t)a->head_dim_v;
        memset(o, 0, (size_t)a->head_dim_v * sizeof(float));
        float inv = 1.0f / sum;
        for (int32_t k = first; k <= pos; k++) {
            const uint8_t *vr = kv_row(c, a, s->blocks[a->pool][k / B], k % B, kvh, true);
            float w = scores[k - first] * inv;
            if (f16) vec->axpy_f16(a->head_dim_v, w, (const uint16_t *)vr, o);
            else vec->axpy_f32(a->head_dim_v, w, (const float *)vr, o);
        }
    }
}

static void cpu_attention(luma_backend *be, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                          const luma_step *step, const luma_attn *a, luma_buf *out)
{
    cpu_backend *c = cpu(be);
    /* The rows of a step are few (at most max_rows): a small stack map from
     * row to sequence keeps the workers free of searching. */
    int32_t row_seq_small[1024];
    int32_t *row_seq = step->n_rows <= 1024 ? row_seq_small : malloc((size_t)step->n_rows * sizeof(int32_t));
    if (!row_seq) {
        c->failure = "out of memory for attention";
        return;
    }
    for (int32_t s = 0; s < step->n_seqs; s++)
        for (int32_t r = 0; r < step->seqs[s].n_rows; r++) row_seq[step->seqs[s].row0 + r] = s;
    out->rows = q->rows;
    out->cols = (int64_t)a->n_head * a->head_dim_v;
    attn_job j = { c, q, k, v, step, a, out, row_seq };
    run(c, attn_store_run, &j, step->n_rows * k->cols);
    luma_pool_run(c->pool, attn_run, &j);
    if (row_seq != row_seq_small) free(row_seq);
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
    free(c->scratch);
    free(c->act);
    free(c);
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
    c->pool = luma_pool_new(n_threads);
    if (!c->pool) {
        free(c);
        luma_errf(err, "could not start %d worker threads", n_threads);
        return NULL;
    }
    return &c->base;
}
