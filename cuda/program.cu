/* Decode-step programs (program.cuh): the backend's operations of a step
 * of one row, collected into phases as the forward calls them and run as
 * one persistent kernel (matmul.cu, prog_kernel) when an operation comes
 * that a program does not take (attention, the embedding, the end of the
 * step).
 *
 * What a program takes (a row of one token; the forward's calls, in
 * order):
 *   matmul, matmul_many, qkv_rope (RoPE NORM over whole heads) and
 *     gated_matmul of K-format weights (Q4_K, Q5_K, Q6_K repacked) whose
 *     phase has 4M weights or more: a phase;
 *   rmsnorm of a whole row, and the norm of add_rmsnorm: the next phase's
 *     prologue (each CTA normalizes the row itself) when that phase reads
 *     the norm's output; a phase of its own otherwise;
 *   the residual add of add_rmsnorm and add, when the phase before wrote
 *     their y: that phase's epilogue adds each row into x as it writes it.
 * gated_matmul's store of act(gate) * up into gate: where the phase
 * before made gate and up (matmul_many of the two), that phase writes it
 * as it writes up's rows and the gated phase quantizes the gate alone;
 * otherwise it waits for the next phase (every CTA reads the whole gate
 * during its own).
 *
 * LUMA_CUDA_PROGRAM_TIMES in the environment has the kernel add up, by
 * phase index, the time each CTA waits at the phase's barrier, spends in
 * its prologue and in its products; the backend prints the averages when
 * it is freed.
 *
 * A phase reads only what earlier phases wrote, and writes nothing its own
 * prologue reads: whatever would break that (an operation reading the
 * buffer the open phase adds into, a norm in place) is not taken, and the
 * program runs before it. Programs are off with batch invariance and float
 * activations (their sums are added in another order than the
 * matrix-vector kernels', and rows of one token only would get them).
 * They are off unless LUMA_CUDA_PROGRAM=1 is in the environment (or a test
 * turns them on): on the 7B shape at batch 1 they measured slower than the
 * kernels (cuda/NOTES.md, "Decode-step programs"). LUMA_CUDA_PROGRAM_TRACE
 * in the environment prints each program's phases as it is queued. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "program.cuh"

#define PROG_MIN_WEIGHTS ((int64_t)1 << 22)

typedef struct prog_builder {
    prog_params p;
    bool have_rope;
    /* a norm waiting for the phase that reads its output */
    bool norm;
    const float *norm_x;
    const luma_weight *norm_g;
    float *norm_out;
    float norm_eps;
    int32_t norm_cols;
    /* the last phase's gated store, for the next phase */
    float *wb_gate;
    const float *wb_up;
    int32_t wb_n, wb_act;
} prog_builder;

static prog_builder *builder(cuda_backend *c)
{
    if (!c->prog) c->prog = (prog_builder *)calloc(1, sizeof(prog_builder));
    return c->prog;
}

bool luma_cuda_prog_active(const cuda_backend *c)
{
    return c->in_step && c->prog_on && !c->invariant && !c->float_act && LUMA_CUDA_OK(c);
}

/* A new phase, leaving room for the two a flush may add (a norm, a gated
 * store); NULL when the program is full. */
static prog_phase *new_phase(prog_builder *b)
{
    if (b->p.n + 2 >= PROG_MAX_PHASES) return NULL;
    prog_phase *ph = &b->p.ph[b->p.n];
    memset(ph, 0, sizeof *ph);
    return ph;
}

/* The store of act(gate) * up the phase before left, into ph. */
static void take_store(prog_builder *b, prog_phase *ph)
{
    ph->wb_gate = b->wb_gate;
    ph->wb_up = b->wb_up;
    ph->wb_n = b->wb_n;
    ph->wb_act = b->wb_act;
    b->wb_gate = NULL;
}

/* ph's prologue: the pending norm when x is its output, else x itself. */
static void set_input(prog_builder *b, prog_phase *ph, const float *x, int32_t cols)
{
    ph->cols = cols;
    if (b->norm && b->norm_out == x) {
        ph->pro = PROG_NORM;
        ph->x = b->norm_x;
        ph->g = (const float *)b->norm_g->dev;
        ph->out = b->norm_out;
        ph->eps = b->norm_eps;
        b->norm = false;
    } else {
        ph->pro = PROG_QUANT;
        ph->x = x;
    }
}

/* The pending norm as a phase of its own (with the pending store). */
static void norm_phase(prog_builder *b)
{
    prog_phase *ph = &b->p.ph[b->p.n];
    memset(ph, 0, sizeof *ph);
    take_store(b, ph);
    if (b->norm) set_input(b, ph, b->norm_out, b->norm_cols);
    b->p.n++;
}

/* Whether p is the gate whose store is pending: the next phase writes it
 * while every CTA would be reading it. */
static bool store_pending(const prog_builder *b, const float *p)
{
    return b->wb_gate && b->wb_gate == p;
}

/* Whether the next phase may not write p: its prologue reads the pending
 * store's up and writes its gate, every CTA its own units, with no barrier
 * before the phase's own stores. */
static bool store_inputs(const prog_builder *b, const float *p)
{
    return store_pending(b, p) || (b->wb_gate && b->wb_up == p);
}

void luma_cuda_prog_flush(cuda_backend *c)
{
    prog_builder *b = c->prog;
    if (!b || (b->p.n == 0 && !b->norm)) return;
    if (!LUMA_CUDA_OK(c)) goto done;
    if (b->p.n == 0) {
        /* a lone norm: the ordinary kernel */
        luma_buf x = { (float *)b->norm_x, 1, b->norm_cols, b->norm_cols };
        luma_buf out = { b->norm_out, 1, b->norm_cols, b->norm_cols };
        b->norm = false;
        luma_cuda_rmsnorm(&c->base, &x, b->norm_g, b->norm_cols, b->norm_eps, &out);
        return;
    }
    if (b->norm || b->wb_gate) norm_phase(b);
    b->p.bar = c->prog_bar;
    static const bool times = getenv("LUMA_CUDA_PROGRAM_TIMES") != NULL;
    if (times && !c->prog_stats && cudaMalloc((void **)&c->prog_stats, PROG_STATS * PROG_MAX_PHASES * 8) == cudaSuccess)
        cudaMemset(c->prog_stats, 0, PROG_STATS * PROG_MAX_PHASES * 8);
    b->p.stats = c->prog_stats;
    static const bool trace = getenv("LUMA_CUDA_PROGRAM_TRACE") != NULL;   /* read once */
    if (trace) {
        fprintf(stderr, "program %lld:", c->programs);
        for (int i = 0; i < b->p.n; i++) {
            const prog_phase *ph = &b->p.ph[i];
            fprintf(stderr, " [pro %d cols %d%s%s%s", ph->pro, ph->cols, ph->resx ? " +x" : "", ph->wb_gate ? " wb" : "",
                    ph->gact ? " gated" : "");
            for (int j = 0; j < ph->n_w; j++)
                fprintf(stderr, " w%d:%dx%d/%d%s", ph->w[j].type, ph->w[j].rows, ph->w[j].nb, ph->w[j].slab,
                        ph->w[j].rope ? "r" : "");
            fprintf(stderr, "]");
        }
        fprintf(stderr, "\n");
    }
    luma_cuda_program_launch(c, &b->p);
    c->programs++;
done:
    b->p.n = 0;
    b->have_rope = false;
    b->norm = false;
    b->wb_gate = NULL;
}

/* Whether a program can hold the norm of the row x with gain g into out
 * (a whole row of K-format width, a float gain, not in place). */
static bool norm_takes(const luma_buf *x, const luma_weight *g, const luma_buf *out)
{
    return x->rows == 1 && g->cols == x->cols && x->cols % 256 == 0 && x->cols <= PROG_MAX_COLS &&
           out->data != x->data && g->type == LUMA_F32 && ((uintptr_t)g->dev & 15) == 0;
}

/* The norm of x into out, pending until a phase reads out (or the flush). */
static void pend_norm(prog_builder *b, const luma_buf *x, const luma_weight *g, float eps, luma_buf *out)
{
    b->norm = true;
    b->norm_x = x->data;
    b->norm_g = g;
    b->norm_out = out->data;
    b->norm_eps = eps;
    b->norm_cols = (int32_t)x->cols;
    out->rows = x->rows;
    out->cols = x->cols;
}

bool luma_cuda_prog_rmsnorm(cuda_backend *c, const luma_buf *x, const luma_weight *g, int64_t group, float eps,
                            luma_buf *out)
{
    if (!luma_cuda_prog_active(c) || group != x->cols || !norm_takes(x, g, out)) return false;
    prog_builder *b = builder(c);
    if (!b || b->norm || store_inputs(b, out->data) || store_pending(b, x->data)) return false;
    pend_norm(b, x, g, eps, out);
    return true;
}

/* x += y where the last phase wrote y alone: its epilogue adds. */
static bool fuse_add(cuda_backend *c, luma_buf *x, const luma_buf *y)
{
    prog_builder *b = c->prog;
    if (!luma_cuda_prog_active(c) || !b || b->p.n == 0 || b->norm || x->rows != 1 || y->rows != 1 ||
        x->cols != y->cols)
        return false;
    prog_phase *ph = &b->p.ph[b->p.n - 1];
    if (ph->n_w != 1 || ph->w[0].y != y->data || ph->resx || ph->w[0].rope || ph->x == x->data ||
        ph->g == x->data || ph->wb_gate == x->data || ph->wb_up == x->data || ph->out == x->data)
        return false;
    ph->resx = x->data;
    return true;
}

bool luma_cuda_prog_add_rmsnorm(cuda_backend *c, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                                const luma_weight *g, float eps, luma_buf *out)
{
    if (yg || out->data == y->data || !norm_takes(x, g, out)) return false;
    if (c->prog && (store_inputs(c->prog, x->data) || store_inputs(c->prog, out->data))) return false;
    if (!fuse_add(c, x, y)) return false;
    pend_norm(c->prog, x, g, eps, out);
    return true;
}

bool luma_cuda_prog_add(cuda_backend *c, luma_buf *x, const luma_buf *y)
{
    return fuse_add(c, x, y);
}

/* A phase of n weights over x (NULL up) or over act(x) * up, the first
 * rope_n of them rotated as they are written. */
static prog_phase *product_phase(cuda_backend *c, int n, const luma_weight *const *ws, const luma_buf *x,
                                 luma_buf *const *ys, const float *up, int rope_n)
{
    if (!luma_cuda_prog_active(c) || x->rows != 1 || n < 1 || n > PROG_MAX_W || ((uintptr_t)x->data & 15) != 0 ||
        (up && ((uintptr_t)up & 15) != 0))
        return NULL;
    prog_builder *b = builder(c);
    if (!b) return NULL;
    prog_w pw[PROG_MAX_W];
    int64_t weights = 0;
    for (int i = 0; i < n; i++) {
        if (ws[i]->cols != x->cols || !luma_cuda_program_weight(c, ws[i], &pw[i]) || ys[i]->data == x->data ||
            (up && ys[i]->data == up) || store_inputs(b, ys[i]->data) || (b->norm && ys[i]->data == b->norm_out))
            return NULL;
        pw[i].y = ys[i]->data;
        pw[i].rope = i < rope_n;
        weights += ws[i]->rows * ws[i]->cols;
    }
    if (weights < PROG_MIN_WEIGHTS) return NULL;
    /* the phase must not read the gate its own prologue stores; a norm
     * whose output it does not read goes first, as a phase */
    bool reads_norm = b->norm && b->norm_out == x->data;
    if (store_pending(b, x->data) || (up && store_pending(b, up))) return NULL;
    if (b->norm && !reads_norm) {
        if (b->p.n + 3 >= PROG_MAX_PHASES) return NULL;
        norm_phase(b);
    }
    prog_phase *ph = new_phase(b);
    if (!ph) return NULL;
    take_store(b, ph);
    if (up) {
        ph->pro = PROG_GATED;
        ph->x = x->data;
        ph->g = up;
        ph->cols = (int32_t)x->cols;
    } else {
        set_input(b, ph, x->data, (int32_t)x->cols);
    }
    ph->n_w = n;
    for (int i = 0; i < n; i++) {
        ph->w[i] = pw[i];
        ys[i]->rows = 1;
        ys[i]->cols = ws[i]->rows;
    }
    b->p.n++;
    return ph;
}

bool luma_cuda_prog_matmul(cuda_backend *c, int n, const luma_weight *const *ws, const luma_buf *x,
                           luma_buf *const *ys)
{
    return product_phase(c, n, ws, x, ys, NULL, 0) != NULL;
}

bool luma_cuda_prog_qkv_rope(cuda_backend *c, const luma_weight *const *ws, const luma_buf *x, luma_buf *const *ys,
                             int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    if (!luma_cuda_prog_active(c) || r->kind != LUMA_ROPE_NORM || r->n_dims != head_dim || head_dim % 2 != 0 ||
        head_dim / 2 > ROPE_MAX_HALF || x->rows != 1 || ws[0]->rows % head_dim != 0 || ws[1]->rows % head_dim != 0 ||
        !c->step.host || pos != c->step.host->pos)
        return false;
    prog_builder *b = builder(c);
    if (!b) return false;
    rope_args a;
    memset(&a, 0, sizeof a);
    const int32_t *d_pos = luma_cuda_step_array(c, pos, 1, "rope");
    if (!d_pos || !luma_cuda_rope_args(c, r, head_dim, ws[0]->rows, &a)) return true;   /* recorded: sync reports it */
    a.heads = 0;   /* per weight; the kernel reads only head_dim and the tables */
    if (b->have_rope && (memcmp(&a, &b->p.ra, sizeof a) != 0 || d_pos != b->p.pos)) return false;
    if (!product_phase(c, 3, ws, x, ys, NULL, 2)) return false;
    b->p.ra = a;
    b->p.pos = d_pos;
    b->have_rope = true;
    return true;
}

bool luma_cuda_prog_gated(cuda_backend *c, const luma_weight *w, luma_buf *gate, const luma_buf *up, int act,
                          luma_buf *y)
{
    if (act != LUMA_ACT_SILU && act != LUMA_ACT_GELU) return false;
    if (up->rows != gate->rows || up->cols != gate->cols || gate->data == up->data) return false;
    luma_buf *const ys[1] = { y };
    prog_builder *b = c->prog;
    /* gate and up made by the last phase, by row: it writes act(gate) *
     * up into gate as it writes up, and this phase reads the gate alone */
    prog_phase *last = b && b->p.n > 0 && !b->norm && !b->wb_gate ? &b->p.ph[b->p.n - 1] : NULL;
    if (last && last->n_w == 2 && !last->gact && !last->resx && last->w[0].y == gate->data &&
        last->w[1].y == up->data && last->w[0].rows == last->w[1].rows && !last->w[0].rope && !last->w[1].rope) {
        if (!product_phase(c, 1, &w, gate, ys, NULL, 0)) return false;
        last->gact = act + 1;
        return true;
    }
    prog_phase *ph = product_phase(c, 1, &w, gate, ys, up->data, 0);
    if (!ph) return false;
    ph->act = act;
    b = c->prog;
    b->wb_gate = gate->data;
    b->wb_up = up->data;
    b->wb_n = (int32_t)gate->cols;
    b->wb_act = act;
    return true;
}

void luma_cuda_prog_free(cuda_backend *c)
{
    free(c->prog);
    c->prog = NULL;
    if (c->prog_stats) {
        unsigned long long h[PROG_STATS * PROG_MAX_PHASES];
        int khz = 0;
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, c->device);
        const double cy = khz > 0 ? khz / 1e3 : 1.0; /* cycles a us */
        if (cudaMemcpy(h, c->prog_stats, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess)
            for (int i = 0; i < PROG_MAX_PHASES; i++) {
                const unsigned long long *e = h + PROG_STATS * i;
                if (!e[3]) continue;
                const double n = (double)e[3];
                fprintf(stderr,
                        "program phase %d: %llu CTA runs, us a run: wait %.2f prologue %.2f products %.2f"
                        " (consumer 0: stage waits %.2f, stages %.2f, row ends %.2f; producer: waits %.2f)\n",
                        i, e[3], e[0] / 1e3 / n, e[1] / 1e3 / n, e[2] / 1e3 / n, e[4] / cy / n, e[5] / cy / n,
                        e[6] / cy / n, e[7] / cy / n);
            }
        cudaFree(c->prog_stats);
        c->prog_stats = NULL;
    }
    cudaFree(c->prog_bar);   /* made with the backend, zeroed */
    c->prog_bar = NULL;
}

/* For the tests: programs launched so far, and programs on or off (the
 * environment's choice until called). */
extern "C" long long luma_cuda_programs(luma_backend *be)
{
    return ((cuda_backend *)be)->programs;
}

extern "C" void luma_cuda_set_programs(luma_backend *be, bool on)
{
    cuda_backend *c = (cuda_backend *)be;
    luma_cuda_prog_flush(c);
    c->prog_on = on;
}
