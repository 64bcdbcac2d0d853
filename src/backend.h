/* The backend interface: the small set of operations a forward pass needs,
 * implemented once per device (src/cpu/, cuda/). Architectures call these and
 * never touch activation memory themselves; backends never know which
 * architecture calls them.
 *
 * Activations are luma_buf: a row-major float32 matrix of rows x cols living
 * where the backend keeps it (host memory on the CPU, device memory on a GPU).
 * A "row" is one token of the step. Weights are luma_weight: a matrix of
 * rows x cols in a GGUF block format, rows contiguous (cols = GGUF ne[0]). */
#ifndef LUMA_BACKEND_H
#define LUMA_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"
#include "kv.h"
#include "quant.h"
#include "sample.h"

typedef struct luma_weight {
    enum luma_type type;
    int64_t rows, cols;        /* a vector has rows == 1 */
    const void *host;          /* in the mapped file */
    void *dev;                 /* the backend's copy, when it keeps one */
    void *dev_f16;             /* the backend's f16 copy for large products, or NULL */
    void *dev_mmv;             /* the backend's own layout for its matrix-vector kernels, or NULL */
    /* Set before weight_load for q's and k's weights and biases when RoPE
     * NEOX turns whole heads: the rows (a bias's columns) are heads of
     * neox_head, whose pairs (i, i + neox_head / 2) rotate together. A
     * backend may store each such pair at (2i, 2i + 1) and say so in
     * pairs_adjacent: its products then give q and k in that order, which
     * RoPE NORM turns as NEOX turned the file's order. Attention's scores
     * are the same sums in another order. 0: none. */
    int32_t neox_head;
    bool pairs_adjacent;
} luma_weight;

typedef struct luma_buf {
    float *data;               /* host or device pointer, owned by the backend */
    int64_t rows, cols;
    int64_t cap;               /* allocated floats */
} luma_buf;

/* Rows [r0, r0 + n) of b, sharing its memory (never freed). */
static inline luma_buf luma_buf_rows(const luma_buf *b, int64_t r0, int64_t n)
{
    luma_buf v = { b->data + r0 * b->cols, n, b->cols, n * b->cols };
    return v;
}

/* One sequence's share of a step: rows [row0, row0 + n_rows) of every
 * activation are its tokens, at positions pos0, pos0 + 1, ... Its KV block
 * tables cover every position up to pos0 + n_rows - 1. */
typedef struct luma_step_seq {
    int32_t row0, n_rows;
    int32_t pos0;
    const int32_t *blocks[LUMA_KV_MAX_POOLS];
    int32_t n_blocks[LUMA_KV_MAX_POOLS];
} luma_step_seq;

/* A step row's token that is the id queued last by chain_argmax or
 * chain_sample (backend ops below): decoding chained on the device. */
#define LUMA_TOKEN_CHAINED (-2)

typedef struct luma_step {
    int32_t n_rows;
    const int32_t *tokens;     /* [n_rows]; LUMA_TOKEN_CHAINED where chained */
    const int32_t *pos;        /* [n_rows] position of each row */
    int32_t n_seqs;
    const luma_step_seq *seqs;
    int32_t n_out;             /* rows whose logits are wanted, ascending */
    const int32_t *out_rows;
} luma_step;

#define LUMA_MATMUL_MANY 4   /* weights of one matmul_many call at most */

enum luma_act { LUMA_ACT_GELU = 0, LUMA_ACT_SILU = 1 };   /* gated_matmul's activations */

/* Shape of the KV storage: per pool, the layers stored in it and the size of
 * one cached key and value row. Each block of a pool holds, for each of its
 * layers, K then V: [n_kv_head][block_tokens][head_dim]. */
typedef struct luma_kv_layout {
    int n_pools;
    int32_t block_tokens;
    int32_t n_blocks[LUMA_KV_MAX_POOLS];
    int32_t n_layers[LUMA_KV_MAX_POOLS];
    int32_t n_kv_head, head_dim_k, head_dim_v;
    enum luma_type type;       /* LUMA_F16 or LUMA_F32 */
} luma_kv_layout;

/* Bytes of one element of the cache. */
static inline size_t luma_kv_elem_size(const luma_kv_layout *l) { return l->type == LUMA_F16 ? 2 : 4; }

/* Bytes of one position's K and V in one layer (every kv head): a layer of
 * a block is block_tokens of them. */
static inline size_t luma_kv_token_bytes(const luma_kv_layout *l)
{
    return (size_t)l->n_kv_head * ((size_t)l->head_dim_k + (size_t)l->head_dim_v) * luma_kv_elem_size(l);
}

enum luma_rope_kind { LUMA_ROPE_NORM = 0, LUMA_ROPE_NEOX = 2 };

typedef struct luma_rope {
    enum luma_rope_kind kind;
    int32_t n_dims;            /* rotated dimensions of each head (<= head_dim) */
    float base;                /* theta_i = pos * scale * base^(-2i/n_dims) / factor_i */
    float pos_scale;           /* linear scaling: 1 / factor */
    const float *freq_factors; /* [n_dims/2] or NULL (Llama 3 long-context) */
} luma_rope;

/* q, k and v's weights of a layer, for qkv_rope. */
typedef struct luma_qkv {
    const luma_weight *w[3];   /* wq, wk, wv */
    const luma_weight *b[3];   /* their biases (qwen2), NULL: none */
    const luma_weight *gq, *gk;   /* each head's norm gains of q and k (Gemma 3), both or neither */
    float eps;                 /* the norms' epsilon */
} luma_qkv;

typedef struct luma_attn {
    int pool;                  /* KV pool of this layer */
    int32_t layer;             /* index of the layer inside its pool */
    int32_t n_head, n_kv_head, head_dim_k, head_dim_v;
    int32_t window;            /* 0: full causal; w: keys with pos > p - w */
    float scale;               /* applied to q.k */
    float softcap;             /* 0: none; c: c * tanh(s / c) */
} luma_attn;

/* An edit of listed entries of a row of logits (logits_edit): the device
 * side of luma_logits_penalize (once the caller has counted the history with
 * luma_logits_penalty_counts), luma_logits_bias, luma_logits_mask, and of
 * storing values (logits[id] = v). */
enum luma_logits_edit_kind { LUMA_EDIT_PENALIZE, LUMA_EDIT_BIAS, LUMA_EDIT_MASK, LUMA_EDIT_SET };

typedef struct luma_logits_edit {
    enum luma_logits_edit_kind kind;
    int32_t n;
    const int32_t *ids;        /* [n] in [0, cols); distinct for PENALIZE, BIAS and SET */
    const float *values;       /* [n] PENALIZE: each id's count; BIAS: the value added
                                * (-INFINITY masks); MASK: unused; SET: the value
                                * stored (any float) */
    float repeat, frequency, presence;   /* PENALIZE */
} luma_logits_edit;

/* The largest k of logits_topk. */
#define LUMA_TOPK_MAX 2048
/* The largest k a run finds ahead for every row (luma_model.topk_ahead),
 * and the most rows a run does so for. */
#define LUMA_TOPK_AHEAD_MAX 64
#define LUMA_TOPK_AHEAD_ROWS 512

typedef struct luma_backend luma_backend;

typedef struct luma_backend_ops {
    const char *name;
    void (*free)(luma_backend *be);
    /* Weights: make w usable by this backend (a GPU uploads it). */
    int (*weight_load)(luma_backend *be, luma_weight *w, luma_err *err);

    int (*buf_alloc)(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err);
    void (*buf_free)(luma_backend *be, luma_buf *b);
    /* Copies rows x cols floats of b to host memory. */
    int (*buf_read)(luma_backend *be, const luma_buf *b, float *dst, luma_err *err);

    int (*kv_alloc)(luma_backend *be, const luma_kv_layout *layout, luma_err *err);
    /* Called once before the operations of a step: a GPU uploads the step's
     * tokens, positions, out rows and block tables here, and the operations
     * below that take step data (embed's ids, rope's pos, attention's step)
     * are given the same pointers. NULL when a backend needs nothing. */
    int (*step_begin)(luma_backend *be, const luma_step *step, luma_err *err);
    /* Optional: runs forward(ctx), which queues every operation of the step
     * that step_begin described (the logits projection not included), so
     * that a backend may record the operations of a step of this shape once
     * and replay them (CUDA graphs for decode steps). The operations it
     * queues must depend on the step only through its shape: the arrays
     * step_begin uploaded and buffers that stay where they are. NULL: the
     * caller calls forward itself. */
    int (*step_run)(luma_backend *be, const luma_step *step, int (*forward)(void *ctx, luma_err *err),
                    void *ctx, luma_err *err);
    /* The luma_kv copy-on-write callback target. */
    void (*kv_copy_block)(luma_backend *be, int pool, int32_t src, int32_t dst);

    /* out[i] = dequantized row ids[i] of w, times scale. */
    void (*embed)(luma_backend *be, const luma_weight *w, const int32_t *ids, int32_t n,
                  float scale, luma_buf *out);
    /* y[i] = W x[i] for every row i of x (y->cols = w->rows). */
    void (*matmul)(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y);
    /* matmul of n (at most LUMA_MATMUL_MANY) weights by the same x, into
     * ys[i]: q, k and v of one input, or gate and up; each ys[i] gets the
     * bits matmul would give it. Optional: NULL when a backend gains
     * nothing from seeing them together (callers use luma_model_matmuls,
     * which falls back). */
    void (*matmul_many)(luma_backend *be, int n, const luma_weight *const *ws, const luma_buf *x,
                        luma_buf *const *ys);
    /* out[j] = x[rows[j]] for the n listed rows. */
    void (*gather)(luma_backend *be, const luma_buf *x, const int32_t *rows, int32_t n,
                   luma_buf *out);
    /* x[i] += b (b: a vector of x->cols). */
    void (*add_bias)(luma_backend *be, luma_buf *x, const luma_weight *b);
    /* Each row of x cut into groups of `group` columns; each group scaled to
     * unit RMS and multiplied by g (a vector of `group`), into out (may be x). */
    void (*rmsnorm)(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group,
                    float eps, luma_buf *out);
    /* The residual add and the next norm in one pass: x += y, then out =
     * each row of x scaled to unit RMS times g (a vector of x->cols). When yg
     * is not NULL, y is first normalized the same way with gain yg (x +=
     * rmsnorm(y) * yg, Gemma's post-norms; y is left as it was). out is
     * neither x nor y. Optional: NULL when a backend does not fuse them
     * (callers use luma_model_residual_norm, which falls back). */
    void (*add_rmsnorm)(luma_backend *be, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                        const luma_weight *g, float eps, luma_buf *out);
    /* Rotates each head (head_dim columns) of every row at pos[row]. */
    void (*rope)(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos,
                 const luma_rope *r);
    /* Attention's inputs: each head (head_dim columns) of q and of k
     * normalized with gain gq, gk (head_dim floats) when given (Gemma's
     * q_norm and k_norm; both or neither), then rotated as rope rotates it.
     * Optional: NULL when a backend does not fuse them (callers use
     * luma_model_qk_rope, which falls back to rmsnorm and rope). */
    void (*qk_rope)(luma_backend *be, luma_buf *q, luma_buf *k, const luma_weight *gq, const luma_weight *gk,
                    int32_t head_dim, float eps, const int32_t *pos, const luma_rope *r);
    /* Qwen2's attention inputs: each row of q, k and v plus bias bq, bk, bv
     * (one row of q's, k's, v's columns; NULL: none), then each head of q
     * and of k rotated as rope rotates it: the bits of add_bias and rope.
     * Optional: NULL when a backend does not fuse them (callers use
     * luma_model_qkv_bias_rope, which falls back to add_bias and
     * luma_model_qk_rope). */
    void (*qkv_bias_rope)(luma_backend *be, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                          const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                          const luma_rope *r);
    /* matmul_many of p->w[0..2] (wq, wk, wv) into q, k, v (ys[0..2]), plus
     * the biases p->b[0..2] (NULL: none), then each head of q and of k
     * normalized with gains p->gq, p->gk when given (as qk_rope), then q
     * and k rotated as rope rotates them: each with the bits that
     * matmul_many, add_bias and qk_rope give. Optional: NULL, or false
     * having done nothing when the backend does not fuse them for this
     * step (callers use luma_model_qkv_rope, which falls back). A backend
     * that stored wq's and wk's pairs adjacent (pairs_adjacent) takes
     * every call for them: it alone knows their order. */
    bool (*qkv_rope)(luma_backend *be, const luma_qkv *p, const luma_buf *x, luma_buf *const *ys, int32_t head_dim,
                     const int32_t *pos, const luma_rope *r);
    /* Stores k and v rows in the KV cache at their positions, then writes
     * attention of each q row over its sequence's cached keys into out. */
    void (*attention)(luma_backend *be, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                      const luma_step *step, const luma_attn *a, luma_buf *out);
    /* gate = act(gate) * up, act GELU (tanh approximation) or SiLU. */
    void (*gelu_mul)(luma_backend *be, luma_buf *gate, const luma_buf *up);
    void (*silu_mul)(luma_backend *be, luma_buf *gate, const luma_buf *up);
    /* The feed-forward's last product: gate = act(gate) * up as gelu_mul
     * or silu_mul makes it (act LUMA_ACT_GELU or LUMA_ACT_SILU), then
     * y = W gate, with the same bits as those two calls. Optional: NULL when
     * a backend does not fuse them (callers use luma_model_gated_matmul,
     * which falls back). */
    void (*gated_matmul)(luma_backend *be, const luma_weight *w, luma_buf *gate, const luma_buf *up, int act,
                         luma_buf *y);
    /* A layer's feed-forward: gate = W_gate x and up = W_up x (w[0], w[1],
     * as matmul_many), then y = W_down (act(gate) * up) (w[2], as
     * gated_matmul, which leaves act(gate) * up in gate), with the bits of
     * those two calls. Optional: NULL, or false having done nothing when
     * the backend does not fuse them for this step (callers use
     * luma_model_ffn, which falls back). */
    bool (*ffn)(luma_backend *be, const luma_weight *const *w, int act, const luma_buf *x, luma_buf *gate,
                luma_buf *up, luma_buf *y);
    /* x += y */
    void (*add)(luma_backend *be, luma_buf *x, const luma_buf *y);

    /* ---- logits that stay on the device ---------------------------------
     * Logits sets (luma_logits_set, src/model.h) live in buffers made by
     * logits_alloc: rows x cols floats, a row a vocabulary. The operations
     * below work on one row (or every row) where it lies, so that only their
     * small results cross to the host; each has the semantics of the
     * src/sample.h function it names, to the bit unless said otherwise
     * (the same ids, the same floats, ties by lower id). They run between
     * steps, never while a forward is queued or recorded: each waits for its
     * own work and returns failures as values (-1 with err set), naming the
     * operation. A backend whose buffers are host memory (the CPU) leaves
     * all of them NULL: sets are then made by buf_alloc, and callers run the
     * host functions on b->data. */
    /* Like buf_alloc, plus a small work area after the b->cap floats for
     * the operations below; it never moves buffers a step has recorded.
     * Freed by logits_free, which waits for queued work. */
    int (*logits_alloc)(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err);
    void (*logits_free)(luma_backend *be, luma_buf *b);
    /* ids[i] = luma_logits_argmax of row row0 + i, for n rows in one pass;
     * -1 for a row whose entries are all masked (not an error). */
    int (*logits_argmax)(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t *ids,
                         luma_err *err);
    /* luma_logits_topk of one row, k in [1, LUMA_TOPK_MAX]: the count. */
    int32_t (*logits_topk)(luma_backend *be, const luma_buf *b, int64_t row, int32_t k, int32_t *ids,
                           float *vals, luma_err *err);
    /* The same for n rows from row0 with one wait: row row0 + i's entries
     * at ids[i k ...] and vals[i k ...], their count at counts[i]. */
    int (*logits_topk_rows)(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t k,
                            int32_t *ids, float *vals, int32_t *counts, luma_err *err);
    /* Applies e to one row (ids checked by the caller). */
    int (*logits_edit)(luma_backend *be, luma_buf *b, int64_t row, const luma_logits_edit *e,
                       luma_err *err);
    /* luma_logits_temperature of one row for t > 0 (finite). */
    int (*logits_temperature)(luma_backend *be, luma_buf *b, int64_t row, float t, luma_err *err);
    /* luma_logits_min_p of one row with min_keep 1, given lp = log(p)
     * (the caller's, so that the threshold is the host's to the bit). */
    int (*logits_min_p)(luma_backend *be, luma_buf *b, int64_t row, double lp, luma_err *err);
    /* luma_logits_softmax (log false) or luma_logits_log_softmax (log
     * true) of one row, in place; waits, and fails (the row unchanged)
     * when every entry is masked. The normalizer is summed in another
     * order than the host's (and the device's exp and log may be a last
     * bit off glibc's), so an entry can differ from the host's by an ulp
     * where it rounds near a boundary. */
    int (*logits_softmax)(luma_backend *be, luma_buf *b, int64_t row, bool log, luma_err *err);
    /* The sums luma_logits_entropy takes of one row: with m its largest
     * live entry, z = sum exp(x_i - m) and s = sum exp(x_i - m)(x_i - m)
     * over the live entries, in double (added in another order than the
     * host's); -1 with err set when every entry is masked. */
    int (*logits_live_sums)(luma_backend *be, const luma_buf *b, int64_t row, double *z, double *s, luma_err *err);
    /* The id luma_logits_sample draws from one row when its uniform is u:
     * the same id, except where the sums, added in another order, round
     * across a boundary. -1 with err set when every entry is masked. */
    int32_t (*logits_sample)(luma_backend *be, const luma_buf *b, int64_t row, double u, luma_err *err);
    /* Decoding chained on the device (luma_model_decode): both or
     * neither. chain_argmax queues the argmax of one row and returns
     * without waiting: the next step's rows whose token is
     * LUMA_TOKEN_CHAINED take that id on the device, so the host can queue
     * the step before it knows the id. chain_read waits for the last queued
     * argmax only (not for the work queued after it) and gives its id, -1
     * when every entry is masked. Unlike the operations above these may
     * come between a step's operations and the next step: the host never
     * waits for a step before queuing the next. */
    int (*chain_argmax)(luma_backend *be, const luma_buf *b, int64_t row, luma_err *err);
    /* Optional beside them: sampling chained the same way. chain_sample
     * queues the draw of s from one row for the uniform u, in the place
     * of chain_argmax's argmax: luma_sampler_draw's id, except where the
     * device's exp or log, a last bit off the host's, moves a sum across
     * a boundary. Where s penalizes, the row is first penalized in place
     * (luma_logits_penalize, to the bit) over the last s->last_n ids of
     * the history that chain_history began, each draw adding its id. */
    int (*chain_sample)(luma_backend *be, const luma_buf *b, int64_t row, const luma_sampler *s, double u,
                        luma_err *err);
    /* Begins the device's history of chained draws: ids [n], of which the
     * last LUMA_SAMPLER_WINDOW_MAX are kept (queued). Optional: without
     * it, penalizing samplers are not chained. */
    int (*chain_history)(luma_backend *be, const int32_t *ids, int32_t n, luma_err *err);
    int (*chain_read)(luma_backend *be, int32_t *id, luma_err *err);
    /* Optional: luma_sampler_draw_top for n rows at once (one wait), from
     * entries laid out as logits_topk_rows leaves them: row i's counts[i]
     * entries, best first, at ids[i k ...] and vals[i k ...], of which
     * its sampler smp[i] takes the first smp[i].top_k (checked by the
     * caller); out[i] = its draw for the uniform u[i], -1 where it has no
     * entry (not an error). The same id as the host's, except where the
     * device's exp or log, a last bit off, moves a sum across a boundary.
     * Host memory in and out: no logits set is involved. */
    int (*sampler_draw_rows)(luma_backend *be, int32_t n, int32_t k, const int32_t *ids, const float *vals,
                             const int32_t *counts, const luma_sampler *smp, const double *u, int32_t *out,
                             luma_err *err);

    /* Waits for the step's work and reports any failure it met. */
    int (*sync)(luma_backend *be, luma_err *err);
    /* Called after the load's warm-up steps (luma_backend.warmup): whatever
     * they taught the backend's tables of step shapes (seen, recorded) is
     * forgotten, so that the first real steps count as first. May be NULL. */
    void (*warmed)(luma_backend *be);

    /* Batch invariance: with on, every row of a step is computed by the same
     * arithmetic whatever else shares the step (its rows, other sequences,
     * their lengths), so a token's logits are the same bits whether its
     * prompt ran at once, in chunks or one token at a time, alone or in a
     * batch. Called once, before weight_load. Optional: NULL for a backend
     * that always computes this way (the CPU). */
    int (*set_batch_invariant)(luma_backend *be, bool on, luma_err *err);

    /* Float activations: with on, matmul (and matmul_many, gated_matmul)
     * multiply the weights' dequantized values by the activations as floats
     * (f32; f16 where a backend multiplies on tensor cores) instead of
     * quantizing each activation row to 8 bits for the weight's activation
     * format. Slower, and closer to the model: a one-ulp change of an
     * activation then moves the logits by about 1e-2 instead of about 1, so
     * two backends agree on nearly every top-1 (cuda/NOTES.md, "Float
     * activations"). Float weights are multiplied as floats either way.
     * Called once, before weight_load; required of every backend. */
    int (*set_float_act)(luma_backend *be, bool on, luma_err *err);

    /* The rate, in bytes a second read plus written, at which the device
     * copies `bytes` from one of its buffers to another (two buffers of
     * that size made for it and freed after), the best of reps copies after
     * one untimed: the bandwidth a decode step's weight reads are measured
     * against (luma bench --peak-gbs copy). Optional: NULL for a backend
     * whose memory is the host's (the CPU). */
    int (*copy_rate)(luma_backend *be, size_t bytes, int reps, double *rate, luma_err *err);
} luma_backend_ops;

#define LUMA_WARMUP_STEPS 4

struct luma_backend {
    const luma_backend_ops *ops;
    /* A load ends with throwaway steps of one sequence, of warmup[0],
     * warmup[1], ... rows (a 0 ends the list; fewer rows where the context
     * is shorter), so that what a backend does at its first steps of some
     * shape (a GPU's library set-up, kernels loaded on first use) falls in
     * the load and not in the first prompts; all 0: none. */
    int32_t warmup[LUMA_WARMUP_STEPS];
};

/* The CPU backend: a pool of n_threads persistent workers (0: one per core). */
luma_backend *luma_backend_cpu_new(int n_threads, luma_err *err);
/* The CUDA backend, or NULL with err set when there is no usable GPU or the
 * build has none. */
luma_backend *luma_backend_cuda_new(int device, luma_err *err);
bool luma_backend_cuda_available(void);

#endif
