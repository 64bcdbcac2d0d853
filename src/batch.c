/* The batch step: chunks of tokens from many sequences packed into forward
 * passes of at most max_rows rows. Each weight matrix is read once per pass
 * for all its rows; attention runs per sequence over its own blocks.
 *
 * Rows of a pass are the chunks' tokens in order. A chunk longer than the
 * room left in a pass continues in the next one. Logits are computed only for
 * each chunk's last token (or all its tokens when asked): into host memory
 * LUMA_LOGIT_ROWS at a time, or into a logits set that stays with the
 * backend, all of a pass's rows in one product.
 *
 * Sets come from a small pool per model: a decode loop that releases each
 * step's set reuses its allocation instead of making one per step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "sample.h"

int64_t luma_model_out_rows(const luma_chunk *chunks, int32_t n_chunks)
{
    int64_t n = 0;
    for (int32_t i = 0; i < n_chunks; i++) n += chunks[i].all_logits ? chunks[i].n : 1;
    return n;
}

/* The model can run a forward pass at all. */
static int check_runs(const luma_model *m, luma_err *err)
{
    if (m->vocab_only) return luma_errf(err, "model was loaded with vocab_only: it cannot run a forward pass");
    return 0;
}

/* n more tokens fit s's context. */
static int check_room(const luma_model *m, const luma_seq *s, int32_t n, luma_err *err)
{
    if ((int64_t)s->n_tokens + n > m->n_ctx)
        return luma_errf(err, "context overflow: the sequence holds %d tokens, %d more exceed the context of %d",
                         s->n_tokens, n, m->n_ctx);
    return 0;
}

static int check_chunks(const luma_model *m, const luma_chunk *c, int32_t n, luma_err *err)
{
    if (check_runs(m, err)) return -1;
    if (n < 1) return luma_errf(err, "a batch needs at least one chunk");
    for (int32_t i = 0; i < n; i++) {
        if (!c[i].seq || c[i].seq->model != m)
            return luma_errf(err, "chunk %d: sequence belongs to another model", i + 1);
        if (c[i].n < 1) return luma_errf(err, "chunk %d: no tokens", i + 1);
        for (int32_t j = 0; j < i; j++)
            if (c[j].seq == c[i].seq)
                return luma_errf(err, "chunk %d: the same sequence appears twice in one batch", i + 1);
        if (check_room(m, c[i].seq, c[i].n, err)) return -1;
        for (int32_t j = 0; j < c[i].n; j++)
            if (c[i].ids[j] < 0 || c[i].ids[j] >= m->hp.n_vocab)
                return luma_errf(err, "chunk %d: token id %d out of range [0, %d)", i + 1, c[i].ids[j],
                                 m->hp.n_vocab);
    }
    return 0;
}

static int append_tokens(luma_seq *s, const int32_t *ids, int32_t n, luma_err *err)
{
    if (s->n_tokens + n > s->cap) {
        int32_t cap = s->cap ? s->cap : 64;
        while (cap < s->n_tokens + n) cap *= 2;
        int32_t *t = realloc(s->tokens, (size_t)cap * sizeof(int32_t));
        if (!t) return luma_errf(err, "out of memory for the token history");
        s->tokens = t;
        s->cap = cap;
    }
    memcpy(s->tokens + s->n_tokens, ids, (size_t)n * sizeof(int32_t));
    s->n_tokens += n;
    return 0;
}

/* Where a run's logits go: host memory, or the rows of a set. */
typedef struct logits_dst {
    float *host;               /* the next row, or NULL */
    luma_buf *set;             /* when host is NULL */
    int64_t row;               /* the next row of set */
    const luma_run_hook *hook; /* or NULL: called once the last pass is queued */
    int32_t *argmax;           /* or NULL: every row's argmax, found with the last pass */
    int32_t topk_k;            /* or 0: every row's topk_k best, found with the last pass, */
    int32_t *topk;             /* into topk (luma_logits_set.topk's layout) */
} logits_dst;

/* Row `row` of a top-k found ahead for rows rows of k entries, in
 * luma_logits_set.topk's layout: rows x k ids, rows x k values, rows
 * counts. */
typedef struct topk_row {
    int32_t *ids;
    float *vals;
    int32_t *count;
} topk_row;

static topk_row topk_at(int32_t *mem, int64_t rows, int64_t k, int64_t row)
{
    return (topk_row){ mem + row * k, (float *)(mem + rows * k) + row * k, mem + 2 * rows * k + row };
}

/* The last pass is queued: the caller's hook, then every row's argmax
 * and top-k where asked, all before the host waits for the device (the
 * first of them to wait waits for the pass). A failure of any fails the
 * run: the first to wait reports the pass's own failure first. */
static int last_pass_queued(luma_model *m, logits_dst *dst, luma_err *err)
{
    if (dst->hook && dst->hook->fn(dst->hook->ctx, err)) return -1;
    const int64_t rows = dst->set ? dst->set->rows : 0;
    if (dst->argmax && m->be->ops->logits_argmax(m->be, dst->set, 0, rows, dst->argmax, err)) return -1;
    if (dst->topk) {
        topk_row all = topk_at(dst->topk, rows, dst->topk_k, 0);
        if (m->be->ops->logits_topk_rows(m->be, dst->set, 0, rows, dst->topk_k, all.ids, all.vals, all.count, err))
            return -1;
    }
    return 0;
}

/* The logits projection: the output matrix, or the tied embeddings. */
static const luma_weight *output_weight(const luma_model *m)
{
    return m->output.host ? &m->output : &m->tok_embd;
}

/* Projects the pass's out rows to logits, appended at dst. */
static int project_logits(luma_model *m, int32_t n_out, logits_dst *dst, luma_err *err)
{
    luma_backend *be = m->be;
    const luma_weight *w = output_weight(m);
    if (!dst->host) {
        /* A set holds every row: one product reads the output matrix once
         * for all of them. */
        luma_buf rows = luma_buf_rows(&m->acts.out_rows, 0, n_out);
        luma_buf y = luma_buf_rows(dst->set, dst->row, n_out);
        be->ops->matmul(be, w, &rows, &y);
        dst->row += n_out;
        return 0;
    }
    for (int32_t r0 = 0; r0 < n_out; r0 += LUMA_LOGIT_ROWS) {
        int32_t n = n_out - r0 < LUMA_LOGIT_ROWS ? n_out - r0 : LUMA_LOGIT_ROWS;
        luma_buf rows = luma_buf_rows(&m->acts.out_rows, r0, n);
        be->ops->matmul(be, w, &rows, &m->acts.logits);
        if (be->ops->buf_read(be, &m->acts.logits, dst->host, err)) return -1;
        dst->host += (size_t)n * (size_t)m->hp.n_vocab;
    }
    return 0;
}

typedef struct forward_call {
    luma_model *m;
    const luma_step *step;
} forward_call;

static int call_forward(void *ctx, luma_err *err)
{
    forward_call *f = ctx;
    return f->m->arch->forward(f->m, f->step, err);
}

/* The architecture's forward, through the backend's step_run when it has one. */
static int run_forward(luma_model *m, const luma_step *step, luma_err *err)
{
    luma_backend *be = m->be;
    if (!be->ops->step_run) return m->arch->forward(m, step, err);
    forward_call f = { m, step };
    return be->ops->step_run(be, step, call_forward, &f, err);
}

/* A failed run takes s back to start_len tokens; the message of the first
 * failure (err) is kept. A sequence whose sliding-window blocks an earlier
 * pass already released cannot go back: it keeps the tokens its cache
 * holds, and the message says so (naming it `who`), so that its history and
 * its cache agree. */
static void seq_rollback(luma_model *m, luma_seq *s, int32_t start_len, const char *who, luma_err *err)
{
    luma_err ignored;
    luma_kv_rewind(m->kv, s->kv, start_len, &ignored);
    int32_t kept = luma_kv_seq_len(s->kv);
    if (s->n_tokens > kept) s->n_tokens = kept;
    if (kept > start_len && err) {
        size_t used = strlen(err->msg);
        snprintf(err->msg + used, sizeof err->msg - used,
                 " (%s keeps %d of its tokens: its sliding-window blocks were released)", who, kept - start_len);
    }
}

typedef struct pass {
    luma_step_seq *seqs;
    luma_seq **owners;
    int32_t *tokens, *pos, *out_rows;
} pass;

/* The chunks, checked, as passes; logits to dst. */
static int run_chunks(luma_model *m, const luma_chunk *chunks, int32_t n_chunks, logits_dst *dst,
                      luma_err *err)
{
    int32_t R = m->max_rows;
    pass p = { 0 };
    int32_t *start_len = malloc((size_t)n_chunks * sizeof(int32_t));
    p.seqs = malloc((size_t)R * sizeof *p.seqs);
    p.owners = malloc((size_t)R * sizeof *p.owners);
    p.tokens = malloc((size_t)R * sizeof(int32_t));
    p.pos = malloc((size_t)R * sizeof(int32_t));
    p.out_rows = malloc((size_t)R * sizeof(int32_t));
    int rc = -1;
    if (!start_len || !p.seqs || !p.owners || !p.tokens || !p.pos || !p.out_rows) {
        luma_errf(err, "out of memory for a batch");
        goto done;
    }
    for (int32_t i = 0; i < n_chunks; i++) start_len[i] = chunks[i].seq->n_tokens;

    int32_t ci = 0, off = 0;   /* next token: chunks[ci].ids[off] */
    while (ci < n_chunks) {
        luma_step step = { .tokens = p.tokens, .pos = p.pos, .seqs = p.seqs, .out_rows = p.out_rows };
        while (ci < n_chunks && step.n_rows < R) {
            const luma_chunk *c = &chunks[ci];
            luma_seq *s = c->seq;
            int32_t n = c->n - off < R - step.n_rows ? c->n - off : R - step.n_rows;
            if (luma_kv_reserve(m->kv, s->kv, n, err)) goto rollback;
            luma_step_seq *ss = &p.seqs[step.n_seqs];
            p.owners[step.n_seqs] = s;
            ss->row0 = step.n_rows;
            ss->n_rows = n;
            ss->pos0 = s->n_tokens;
            for (int pool = 0; pool < m->kv_layout.n_pools; pool++)
                ss->blocks[pool] = luma_kv_seq_blocks(s->kv, pool, &ss->n_blocks[pool]);
            for (int32_t j = 0; j < n; j++) {
                int32_t row = step.n_rows + j;
                p.tokens[row] = c->ids[off + j];
                p.pos[row] = s->n_tokens + j;
                if (c->all_logits || off + j == c->n - 1) p.out_rows[step.n_out++] = row;
            }
            step.n_rows += n;
            step.n_seqs++;
            off += n;
            if (off == c->n) {
                ci++;
                off = 0;
            }
        }
        if ((m->be->ops->step_begin && m->be->ops->step_begin(m->be, &step, err)) ||
            run_forward(m, &step, err) ||
            project_logits(m, step.n_out, dst, err))
            goto rollback;
        if (ci == n_chunks && last_pass_queued(m, dst, err)) {
            luma_err ignored;
            m->be->ops->sync(m->be, &ignored);
            goto rollback;
        }
        if (m->be->ops->sync(m->be, err)) goto rollback;
        for (int32_t i = 0; i < step.n_seqs; i++) {
            luma_seq *s = p.owners[i];
            luma_kv_commit(m->kv, s->kv, p.seqs[i].n_rows);
            if (append_tokens(s, p.tokens + p.seqs[i].row0, p.seqs[i].n_rows, err)) goto rollback;
        }
    }
    rc = 0;
    goto done;
rollback:
    for (int32_t i = 0; i < n_chunks; i++) {
        char who[32];
        snprintf(who, sizeof who, "chunk %d", i + 1);
        seq_rollback(m, chunks[i].seq, start_len[i], who, err);
    }
done:
    free(start_len);
    free(p.seqs);
    free(p.owners);
    free(p.tokens);
    free(p.pos);
    free(p.out_rows);
    return rc;
}

int luma_model_run(luma_model *m, const luma_chunk *chunks, int32_t n_chunks, float *logits,
                   luma_err *err)
{
    if (check_chunks(m, chunks, n_chunks, err)) return -1;
    logits_dst dst = { logits, NULL, 0, NULL, NULL, 0, NULL };
    return run_chunks(m, chunks, n_chunks, &dst, err);
}

/* ---- logits sets ---------------------------------------------------------- */

static int64_t set_bytes(const luma_logits_set *s)
{
    return s->buf.cap * (int64_t)sizeof(float);
}

static void list_remove(luma_logits_set **first, luma_logits_set **last, luma_logits_set *s)
{
    if (s->prev) s->prev->next = s->next;
    else *first = s->next;
    if (s->next) s->next->prev = s->prev;
    else if (last) *last = s->prev;
    s->prev = s->next = NULL;
}

static void set_free(luma_logits_set *s)
{
    luma_backend *be = s->model->be;
    if (be->ops->logits_free) be->ops->logits_free(be, &s->buf);
    else be->ops->buf_free(be, &s->buf);
    free(s->argmax);
    free(s->topk);
    free(s);
}

void luma_model_logits_drain(luma_model *m)
{
    while (m->sets_pool) {
        luma_logits_set *s = m->sets_pool;
        list_remove(&m->sets_pool, NULL, s);
        set_free(s);
    }
    m->n_pooled = 0;
    m->pooled_bytes = 0;
}

/* A pooled allocation of at least need floats (the smallest), else a new
 * one; the set comes back held, with rows x n_vocab. */
static luma_logits_set *set_get(luma_model *m, int64_t rows, luma_err *err)
{
    int64_t n_vocab = m->hp.n_vocab;
    size_t need;
    if (rows < 1 || luma_mul_size((size_t)rows, (size_t)n_vocab, &need) || need > (size_t)INT64_MAX / sizeof(float)) {
        luma_errf(err, "%lld rows of logits are too many", (long long)rows);
        return NULL;
    }
    luma_logits_set *s = NULL;
    for (luma_logits_set *p = m->sets_pool; p; p = p->next)
        if (p->buf.cap >= (int64_t)need && (!s || p->buf.cap < s->buf.cap)) s = p;
    if (s) {
        list_remove(&m->sets_pool, NULL, s);
        m->n_pooled--;
        m->pooled_bytes -= set_bytes(s);
        free(s->argmax);
        s->argmax = NULL;
        s->argmax_read = false;
        free(s->topk);
        s->topk = NULL;
        s->topk_k = 0;
        s->topk_read = false;
    } else {
        s = calloc(1, sizeof *s);
        if (!s) {
            luma_errf(err, "out of memory for a logits set");
            return NULL;
        }
        s->model = m;
        luma_backend *be = m->be;
        int (*alloc)(luma_backend *, luma_buf *, int64_t, int64_t, luma_err *) =
            be->ops->logits_alloc ? be->ops->logits_alloc : be->ops->buf_alloc;
        /* The pool's memory may be what is missing. */
        if (alloc(be, &s->buf, rows, n_vocab, err)) {
            luma_model_logits_drain(m);
            if (alloc(be, &s->buf, rows, n_vocab, err)) {
                free(s);
                return NULL;
            }
        }
    }
    s->buf.rows = rows;
    s->buf.cols = n_vocab;
    s->refs = 1;
    s->holders = NULL;
    s->prev = m->sets_last;
    s->next = NULL;
    if (m->sets_last) m->sets_last->next = s;
    else m->sets = s;
    m->sets_last = s;
    m->n_sets++;
    m->set_bytes += set_bytes(s);
    return s;
}

void luma_logits_set_release(luma_logits_set *s)
{
    if (!s || --s->refs > 0) return;
    luma_model *m = s->model;
    if (s->argmax && !s->argmax_read) m->argmax_ahead = false;   /* found by the run, never read */
    if (s->topk && !s->topk_read) m->topk_ahead = 0;
    list_remove(&m->sets, &m->sets_last, s);
    m->n_sets--;
    m->set_bytes -= set_bytes(s);
    s->next = m->sets_pool;
    if (m->sets_pool) m->sets_pool->prev = s;
    m->sets_pool = s;
    m->n_pooled++;
    m->pooled_bytes += set_bytes(s);
    /* The least recently released go first. */
    while (m->n_pooled > LUMA_SETS_MAX || (m->n_pooled > 1 && m->pooled_bytes > LUMA_SETS_BYTES)) {
        luma_logits_set *old = m->sets_pool;
        while (old->next) old = old->next;
        list_remove(&m->sets_pool, NULL, old);
        m->n_pooled--;
        m->pooled_bytes -= set_bytes(old);
        set_free(old);
    }
}

int luma_model_run_set(luma_model *m, const luma_chunk *chunks, int32_t n_chunks, const luma_run_hook *hook,
                       luma_logits_set **out, luma_err *err)
{
    *out = NULL;
    if (check_chunks(m, chunks, n_chunks, err)) return -1;
    luma_logits_set *s = set_get(m, luma_model_out_rows(chunks, n_chunks), err);
    if (!s) return -1;
    logits_dst dst = { NULL, &s->buf, 0, hook, NULL, 0, NULL };
    if (m->argmax_ahead && m->be->ops->logits_argmax)
        dst.argmax = malloc((size_t)s->buf.rows * sizeof(int32_t));   /* none: the set goes without */
    if (m->topk_ahead > 0 && m->topk_ahead <= LUMA_TOPK_AHEAD_MAX && s->buf.rows <= LUMA_TOPK_AHEAD_ROWS &&
        m->be->ops->logits_topk_rows) {
        dst.topk = malloc((size_t)s->buf.rows * (2 * (size_t)m->topk_ahead + 1) * sizeof(int32_t));
        if (dst.topk) dst.topk_k = m->topk_ahead;
    }
    if (run_chunks(m, chunks, n_chunks, &dst, err)) {
        free(dst.argmax);
        free(dst.topk);
        luma_logits_set_release(s);
        return -1;
    }
    s->argmax = dst.argmax;   /* the last pass found it: a run that succeeds had one */
    s->topk = dst.topk;
    s->topk_k = dst.topk_k;
    *out = s;
    return 0;
}

float *luma_logits_set_host(const luma_logits_set *s, int64_t row)
{
    if (s->model->be->ops->logits_argmax) return NULL;
    return s->buf.data + row * s->buf.cols;
}

int luma_logits_set_read(const luma_logits_set *s, int64_t row, float *dst, luma_err *err)
{
    if (row < 0 || row >= s->buf.rows)
        return luma_errf(err, "logits set: row %lld of %lld", (long long)row, (long long)s->buf.rows);
    luma_backend *be = s->model->be;
    luma_buf one = luma_buf_rows(&s->buf, row, 1);
    return be->ops->buf_read(be, &one, dst, err);
}

int luma_logits_set_read_at(const luma_logits_set *s, int64_t row, int32_t id, float *v, luma_err *err)
{
    if (row < 0 || row >= s->buf.rows || id < 0 || id >= s->buf.cols)
        return luma_errf(err, "logits set: entry %d of row %lld of %lld", (int)id, (long long)row,
                         (long long)s->buf.rows);
    luma_backend *be = s->model->be;
    luma_buf one = { s->buf.data + row * s->buf.cols + id, 1, 1, 1 };
    return be->ops->buf_read(be, &one, v, err);
}

int32_t luma_logits_set_argmax(luma_logits_set *s, int64_t row, bool cached, luma_err *err)
{
    if (row < 0 || row >= s->buf.rows)
        return luma_errf(err, "logits set: row %lld of %lld", (long long)row, (long long)s->buf.rows);
    luma_backend *be = s->model->be;
    int32_t n = (int32_t)s->buf.cols;
    if (!be->ops->logits_argmax) return luma_logits_argmax(s->buf.data + row * s->buf.cols, n, err);
    int32_t id;
    if (!cached) {
        if (be->ops->logits_argmax(be, &s->buf, row, 1, &id, err)) return -1;
    } else {
        if (!s->argmax) {
            int32_t *ids = malloc((size_t)s->buf.rows * sizeof *ids);
            if (!ids) return luma_errf(err, "argmax: out of memory for %lld rows", (long long)s->buf.rows);
            if (be->ops->logits_argmax(be, &s->buf, 0, s->buf.rows, ids, err)) {
                free(ids);
                return -1;
            }
            s->argmax = ids;
        }
        id = s->argmax[row];
        s->argmax_read = true;
        s->model->argmax_ahead = true;
    }
    if (id < 0) return luma_errf(err, "argmax: every logit is masked");
    return id;
}

int32_t luma_logits_set_topk(luma_logits_set *s, int64_t row, int32_t k, bool cached, int32_t *ids, float *vals,
                             luma_err *err)
{
    if (row < 0 || row >= s->buf.rows)
        return luma_errf(err, "logits set: row %lld of %lld", (long long)row, (long long)s->buf.rows);
    luma_backend *be = s->model->be;
    if (!be->ops->logits_topk)
        return luma_logits_topk(s->buf.data + row * s->buf.cols, (int32_t)s->buf.cols, k, ids, vals, err);
    /* a policy reads the run's top-k, or more of it: either way, keep
     * finding it ahead */
    if (cached) s->topk_read = true;
    if (cached && s->topk && k >= 1 && k <= s->topk_k) {
        /* the first k of the row's topk_k best, which come best first */
        const topk_row r = topk_at(s->topk, s->buf.rows, s->topk_k, row);
        int32_t got = *r.count < k ? *r.count : k;
        memcpy(ids, r.ids, (size_t)got * sizeof *ids);
        memcpy(vals, r.vals, (size_t)got * sizeof *vals);
        return got;
    }
    int32_t got = be->ops->logits_topk(be, &s->buf, row, k, ids, vals, err);
    if (got >= 0 && cached && be->ops->logits_topk_rows && k <= LUMA_TOPK_AHEAD_MAX && k > s->model->topk_ahead)
        s->model->topk_ahead = k;
    return got;
}

int32_t luma_logits_set_topk_lowered(luma_logits_set *s, int64_t row, int32_t k, const luma_lowering *p,
                                     int32_t *ids, float *vals)
{
    luma_model *m = s->model;
    if (row < 0 || row >= s->buf.rows || k < 1 || !m->be->ops->logits_topk_rows) return -1;
    /* more than k ahead, so that penalized entries can fall out */
    if (!s->topk || s->topk_k <= k) {
        if (k < LUMA_TOPK_AHEAD_MAX && m->topk_ahead < LUMA_TOPK_AHEAD_MAX) m->topk_ahead = LUMA_TOPK_AHEAD_MAX;
        return -1;
    }
    s->topk_read = true;
    const topk_row r = topk_at(s->topk, s->buf.rows, s->topk_k, row);
    const int32_t K = s->topk_k, n = *r.count, *rid = r.ids;
    const float *rv = r.vals;
    float v[LUMA_TOPK_AHEAD_MAX];
    int32_t at[LUMA_TOPK_AHEAD_MAX], pos[LUMA_TOPK_AHEAD_MAX] = { 0 }, counts[LUMA_TOPK_AHEAD_MAX] = { 0 }, hit = 0;
    memcpy(v, rv, (size_t)n * sizeof *v);
    /* each candidate's count, found among p's increasing ids by bisection
     * (the entries are penalized one by one, so in any order) */
    for (int32_t j = 0; j < n; j++) {
        int32_t lo = 0, hi = p->n;
        while (lo < hi) {
            int32_t mid = lo + (hi - lo) / 2;
            if (p->ids[mid] < rid[j]) lo = mid + 1;
            else hi = mid;
        }
        if (lo < p->n && p->ids[lo] == rid[j]) {
            pos[hit] = j;
            counts[hit++] = p->counts[lo];
        }
    }
    luma_logits_penalize_counted(v, pos, counts, hit, p->repeat, p->frequency, p->presence);
    /* rank them as the backend ranks: larger value first, ties by lower id */
    for (int32_t j = 0; j < n; j++) {
        int32_t a = j;
        while (a > 0 && luma_rank_before(v[j], rid[j], v[at[a - 1]], rid[at[a - 1]])) {
            at[a] = at[a - 1];
            a--;
        }
        at[a] = j;
    }
    const int32_t got = n < k ? n : k;
    if (n == K && got > 0) {
        /* entries past the K found rank below the last of them, before the
         * penalty and so after it: the k-th must not rank below that */
        if (luma_rank_before(rv[K - 1], rid[K - 1], v[at[got - 1]], rid[at[got - 1]])) return -1;
    }
    for (int32_t j = 0; j < got; j++) {
        ids[j] = rid[at[j]];
        vals[j] = v[at[j]];
    }
    return got;
}

/* ---- greedy and sampled decoding ------------------------------------------ */

/* Queues one decode row of s at position pos with token `token` (an id, or
 * LUMA_TOKEN_CHAINED), its logits into row `row` of set. The position's KV
 * room is reserved. */
static int decode_step(luma_model *m, luma_seq *s, int32_t pos, int32_t token, luma_logits_set *set, int64_t row,
                       luma_err *err)
{
    luma_step_seq ss = { .row0 = 0, .n_rows = 1, .pos0 = pos };
    for (int pool = 0; pool < m->kv_layout.n_pools; pool++)
        ss.blocks[pool] = luma_kv_seq_blocks(s->kv, pool, &ss.n_blocks[pool]);
    int32_t out_row = 0;
    luma_step step = { .n_rows = 1, .tokens = &token, .pos = &pos, .n_seqs = 1, .seqs = &ss, .n_out = 1,
                       .out_rows = &out_row };
    luma_backend *be = m->be;
    if ((be->ops->step_begin && be->ops->step_begin(be, &step, err)) || run_forward(m, &step, err)) return -1;
    luma_buf x = luma_buf_rows(&m->acts.out_rows, 0, 1);
    luma_buf y = luma_buf_rows(&set->buf, row, 1);
    be->ops->matmul(be, output_weight(m), &x, &y);
    return 0;
}

/* A new id is known: on_token, then the stop list. */
static int decode_note(int32_t id, const int32_t *stops, int32_t n_stops, luma_token_fn on_token, void *ctx,
                       bool *stop, luma_err *err)
{
    *stop = false;
    if (on_token && on_token(ctx, id, stop, err)) return -1;
    for (int32_t i = 0; i < n_stops && !*stop; i++) *stop = stops[i] == id;
    return 0;
}

/* The next id from row `row` of set, the step before it done (the loop
 * without chain ops); a penalizing sampler first penalizes the row (in
 * place on the host) over hist [n_hist]. */
static int32_t decode_pick(luma_model *m, luma_logits_set *set, int64_t row, const luma_sampler *smp, double u,
                           const int32_t *hist, int32_t n_hist, float **scratch, luma_err *err)
{
    if (!smp) return luma_logits_set_argmax(set, row, false, err);
    const int32_t nv = m->hp.n_vocab;
    float *x = luma_logits_set_host(set, row);
    if (!x) {
        if (!*scratch && !(*scratch = malloc((size_t)nv * sizeof **scratch)))
            return luma_errf(err, "sample: out of memory for a row of %d logits", (int)nv);
        if (luma_logits_set_read(set, row, *scratch, err)) return -1;
        x = *scratch;
    }
    if (luma_sampler_penalizes(smp) &&
        luma_logits_penalize(x, nv, hist, n_hist, smp->last_n, smp->repeat, smp->frequency, smp->presence, err))
        return -1;
    return luma_sampler_draw(smp, x, nv, u, err);
}

int luma_model_decode(luma_model *m, luma_seq *s, int32_t first, int32_t n, const luma_sampler *smp, luma_rng *rng,
                      const int32_t *history, int32_t n_history, const int32_t *stops, int32_t n_stops,
                      luma_token_fn on_token, void *ctx, int32_t *ids, int32_t *n_ids, luma_logits_set **last,
                      int64_t *last_row, luma_err *err)
{
    const char *what = smp ? "sample" : "greedy";
    *n_ids = 0;
    *last = NULL;
    *last_row = 0;
    if (check_runs(m, err)) return -1;
    if (!s || s->model != m) return luma_errf(err, "%s: the sequence belongs to another model", what);
    if (n < 0) return luma_errf(err, "%s: a negative count of tokens (%d)", what, n);
    if (first < 0 || first >= m->hp.n_vocab)
        return luma_errf(err, "%s: token id %d out of range [0, %d)", what, first, m->hp.n_vocab);
    if (smp && (luma_sampler_check(smp, err) || (!rng && luma_errf(err, "sample: no generator"))))
        return -1;
    const bool penalizes = smp && luma_sampler_penalizes(smp);
    if (penalizes && (n_history < 0 || (n_history > 0 && !history)))
        return luma_errf(err, "sample: a history of %d ids", (int)n_history);
    for (int32_t i = 0; penalizes && i < n_history; i++)
        if (history[i] < 0 || history[i] >= m->hp.n_vocab)
            return luma_errf(err, "sample: history id %d (at index %d) out of range [0, %d)", (int)history[i], (int)i,
                             m->hp.n_vocab);
    if (n == 0) return 0;
    if (check_room(m, s, n, err)) return -1;
    luma_backend *be = m->be;
    const bool chained = (smp ? be->ops->chain_sample != NULL && (!penalizes || be->ops->chain_history)
                              : be->ops->chain_argmax != NULL) &&
                         be->ops->chain_read;
    const int32_t len0 = s->n_tokens;
    float *scratch = NULL;   /* a row read back, where the set is not host memory */
    /* the penalties' window on the host: the history, then ids[0 ..] */
    int32_t *hist = NULL, n_hist = penalizes ? n_history + 1 : 0;
    if (penalizes) {
        if (!(hist = malloc(((size_t)n_history + (size_t)n) * sizeof *hist)))
            return luma_errf(err, "sample: out of memory for a history of %d ids", (int)(n_history + n));
        if (n_history > 0) memcpy(hist, history, (size_t)n_history * sizeof *hist);
        hist[n_history] = first;
        if (chained && be->ops->chain_history(be, hist, n_hist, err)) {
            free(hist);
            return -1;
        }
    }
    luma_logits_set *set = set_get(m, 2, err);   /* step j's logits in row j & 1 */
    if (!set) {
        free(hist);
        return -1;
    }

    /* Step j feeds ids[j] at position len0 + j; ids[j + 1] is the argmax of
     * its row, or smp's draw from it. At the loop's top k ids are known,
     * step k - 1 is queued and not yet committed, and every step before it
     * is. Chained, step k is queued before ids[k] is read, and discarded
     * when ids[k] stops. */
    int32_t k = 1;
    bool stop;
    ids[0] = first;
    if (decode_note(first, stops, n_stops, on_token, ctx, &stop, err)) goto fail;
    if (stop) {
        *n_ids = 1;
        luma_logits_set_release(set);
        free(hist);
        return 0;
    }
    if (luma_kv_reserve(m->kv, s->kv, 1, err) || decode_step(m, s, len0, first, set, 0, err)) goto fail;
    while (k < n) {
        int32_t id;
        const double u = smp ? luma_rng_uniform(rng) : 0.0;   /* one a draw, in the order of the draws */
        if (chained) {
            if ((smp ? be->ops->chain_sample(be, &set->buf, (k - 1) & 1, smp, u, err)
                     : be->ops->chain_argmax(be, &set->buf, (k - 1) & 1, err)) ||
                luma_kv_reserve(m->kv, s->kv, 2, err) ||
                decode_step(m, s, len0 + k, LUMA_TOKEN_CHAINED, set, k & 1, err) ||
                be->ops->chain_read(be, &id, err))
                goto fail;
            if (id < 0) {
                luma_errf(err, "%s: every logit is masked", what);
                goto fail;
            }
        } else {
            if (be->ops->sync(be, err)) goto fail;
            id = decode_pick(m, set, (k - 1) & 1, smp, u, hist, n_hist, &scratch, err);
            if (id < 0) goto fail;
        }
        luma_kv_commit(m->kv, s->kv, 1);
        if (append_tokens(s, &ids[k - 1], 1, err)) goto fail;
        ids[k++] = id;
        if (hist) hist[n_hist++] = id;
        if (decode_note(id, stops, n_stops, on_token, ctx, &stop, err)) goto fail;
        if (stop) {
            /* ends unfed: the logits before it are the last */
            if (be->ops->sync(be, err)) goto fail;
            luma_err ignored;
            luma_kv_rewind(m->kv, s->kv, luma_kv_seq_len(s->kv), &ignored);   /* drops the discarded room */
            *n_ids = k;
            *last = set;
            *last_row = (k - 2) & 1;
            free(scratch);
            free(hist);
            return 0;
        }
        if (!chained && (luma_kv_reserve(m->kv, s->kv, 1, err) || decode_step(m, s, len0 + k - 1, id, set,
                                                                              (k - 1) & 1, err)))
            goto fail;
    }
    if (be->ops->sync(be, err)) goto fail;
    luma_kv_commit(m->kv, s->kv, 1);
    if (append_tokens(s, &ids[n - 1], 1, err)) goto fail;
    *n_ids = n;
    *last = set;
    *last_row = (n - 1) & 1;
    free(scratch);
    free(hist);
    return 0;
fail:;
    luma_err ignored;
    be->ops->sync(be, &ignored);
    seq_rollback(m, s, len0, "the sequence", err);
    luma_logits_set_release(set);
    free(scratch);
    free(hist);
    return -1;
}
