/* A loaded model: hyper-parameters from the file's metadata, weights bound by
 * tensor name, the vocabulary, a backend and its KV cache; and sequences, the
 * unit of generation (a KV-cache sequence plus the tokens it holds).
 *
 * One step runs chunks of tokens from one or more sequences as a single
 * forward pass and yields logits for the rows asked for. */
#ifndef LUMA_MODEL_H
#define LUMA_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "err.h"
#include "gguf.h"
#include "kv.h"
#include "tokenizer.h"

#define LUMA_MAX_LAYERS 256
/* Logits are produced this many rows at a time, so a request for every
 * position of a long prompt never needs rows x n_vocab floats at once. */
#define LUMA_LOGIT_ROWS 32
/* Logits sets: a run collects garbage first when the sets still held from
 * Lua reach this many, or these bytes (or twice the new set's); released
 * sets are kept for reuse up to the same bounds (and always the last one),
 * so that a decode loop neither allocates nor frees backend memory once it
 * has warmed up. */
#define LUMA_SETS_MAX 8
#define LUMA_SETS_BYTES ((int64_t)256 << 20)

typedef struct luma_hparams {
    char arch[32];
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head, n_kv_head;
    int32_t head_dim_k, head_dim_v;
    int32_t n_ff;
    float eps;
    enum luma_rope_kind rope_kind;
    int32_t rope_dims;
    float rope_base, rope_base_swa;
    float rope_pos_scale;
    int32_t swa_window;                 /* 0: no sliding-window layers */
    bool layer_swa[LUMA_MAX_LAYERS];    /* uses the window */
    float attn_scale;
    float attn_softcap, final_softcap;  /* 0: none */
    float embd_scale;                   /* embeddings are multiplied by it */
} luma_hparams;

/* How many layers use the sliding window (none without a window). */
static inline int32_t luma_swa_layers(const luma_hparams *hp)
{
    int32_t n = 0;
    for (int32_t i = 0; i < hp->n_layer; i++) n += hp->swa_window > 0 && hp->layer_swa[i];
    return n;
}

typedef struct luma_layer {
    luma_weight attn_norm, wq, wk, wv, wo, bq, bk, bv;
    luma_weight q_norm, k_norm, post_attn_norm;
    luma_weight ffn_norm, gate, up, down, post_ffn_norm;
} luma_layer;

typedef struct luma_model luma_model;
typedef struct luma_logits_set luma_logits_set;

/* One architecture: how to read its hyper-parameters and tensors, and its
 * forward pass written against the backend interface. */
typedef struct luma_arch {
    const char *name;
    int (*load)(luma_model *m, luma_err *err);
    /* Runs the step; leaves in m->acts.out_rows the final normalized hidden
     * state of each of the step's out rows, in order (the caller projects
     * them to logits with m->output). */
    int (*forward)(luma_model *m, const luma_step *step, luma_err *err);
} luma_arch;

/* Activation buffers sized for the largest step. */
typedef struct luma_acts {
    luma_buf x, h, q, k, v, attn, o, gate, up, out_rows, logits;
} luma_acts;

#define LUMA_DEFAULT_REWIND 64   /* a speculated step's guesses, at most */

typedef struct luma_model_params {
    const char *backend;       /* "cpu", "cuda" or "auto" (NULL: auto) */
    int n_threads;             /* 0: one per core */
    int32_t n_ctx;             /* longest sequence; 0: the training context, capped at 8192 */
    int64_t kv_bytes;          /* KV memory budget; 0: enough for one sequence of n_ctx */
    int32_t max_rows;          /* rows per step (prompt chunk); 0: 512 */
    /* Positions a sequence can always rewind on sliding-window layers (their
     * blocks are kept that much past the window); luma_model_params_default
     * sets LUMA_DEFAULT_REWIND. */
    int32_t rewind;
    bool kv_f32;               /* store keys and values as F32 instead of F16 */
    bool batch_invariant;      /* rows computed alike in every step shape (backend.h), at a cost on the GPU */
    bool float_act;            /* products take float activations, not 8-bit ones (backend.h) */
    bool vocab_only;
    /* Called with the fraction loaded; returning non-zero cancels the load. */
    int (*progress)(void *ctx, float frac);
    void *progress_ctx;
} luma_model_params;

struct luma_model {
    luma_gguf *file;
    luma_vocab *vocab;
    luma_hparams hp;
    const luma_arch *arch;
    luma_weight tok_embd, output, output_norm;
    float *rope_freqs;                 /* Llama 3 frequency factors, or NULL */
    /* Set by an architecture before binding when its q and k go through
     * luma_model_qkv_rope under RoPE NEOX over whole heads: the head size,
     * given to q's and k's weights and biases as luma_weight.neox_head
     * (luma_model_layer_weight_rotated). 0: none. */
    int32_t rope_pair_head;
    luma_layer *layers;
    luma_backend *be;
    luma_kv *kv;
    luma_kv_layout kv_layout;
    int32_t n_ctx;
    int32_t max_rows;
    int32_t rewind;
    luma_acts acts;
    int64_t weight_bytes;              /* bytes of weights read per token */
    bool vocab_only;
    bool batch_invariant;              /* every row computed alike in any step shape */
    bool float_act;                    /* products take float activations */
    /* Loading progress: bytes of tensors bound so far, of all in the file. */
    const luma_model_params *loading;
    int64_t load_done, load_total;
    /* Logits sets (batch.c): the held ones, oldest first, and the released
     * ones kept for reuse. */
    luma_logits_set *sets, *sets_last, *sets_pool;
    int32_t n_sets, n_pooled;
    int64_t set_bytes, pooled_bytes;
    /* The last set's argmax was read: a run into a set finds every row's
     * argmax with its last pass, before the host waits for it (a backend
     * with logits_argmax only). A set released unread turns it off. */
    bool argmax_ahead;
    /* Likewise, the k of the last set's top-k read from a row no edit had
     * changed (k <= LUMA_TOPK_AHEAD_MAX; a backend with logits_topk_rows
     * only): a run into a set of up to LUMA_TOPK_AHEAD_ROWS rows finds
     * every row's k best with its last pass. 0 for none; a set released
     * with its top-k found and unread sets it back to 0. */
    int32_t topk_ahead;
    /* A step is queued and a caller's code runs while the device computes
     * it (batch:run's during): nothing may reach the backend, the KV cache
     * or the logits sets until the run is over (the bindings check it). */
    bool busy;
};

void luma_model_params_default(luma_model_params *p);
int luma_model_load(const char *path, const luma_model_params *p, luma_model **out, luma_err *err);
void luma_model_free(luma_model *m);

/* Binds a weight by tensor name: expected rows x cols (rows 1 for a vector).
 * A missing tensor is an error unless optional, which leaves w->host NULL. */
int luma_model_weight(luma_model *m, luma_weight *w, const char *name, int64_t rows, int64_t cols,
                      bool optional, luma_err *err);
/* Binds "blk.<il>.<name>.weight" (or ".bias" when name ends in ".bias"). */
int luma_model_layer_weight(luma_model *m, luma_weight *w, int il, const char *name, int64_t rows,
                            int64_t cols, bool optional, luma_err *err);
/* luma_model_layer_weight for q's and k's weights and biases: given
 * m->rope_pair_head as neox_head before the backend loads them. */
int luma_model_layer_weight_rotated(luma_model *m, luma_weight *w, int il, const char *name, int64_t rows,
                                    int64_t cols, bool optional, luma_err *err);
/* Reads the hyper-parameters every architecture shares (sizes, heads, norm
 * epsilon, RoPE base and linear scaling, training context) into m->hp and
 * allocates m->layers. Architectures then adjust what differs. */
int luma_model_read_hparams(luma_model *m, float rope_base_default, luma_err *err);
/* Binds the tensors every architecture has: token_embd, output_norm, the
 * optional output, and per layer attn_norm, attn_q/k/v, attn_output,
 * ffn_norm, ffn_gate/up/down. Architectures bind their extras after it. */
int luma_model_bind_common(luma_model *m, luma_err *err);
/* The attention parameters of layer il: its KV pool, window and scale. */
void luma_model_attn(const luma_model *m, int il, luma_attn *a);
/* Each head of q and k normalized with gq, gk when given, then rotated at
 * pos: through the backend's fused qk_rope when it has one, else as
 * separate rmsnorm and rope operations. */
void luma_model_qk_rope(const luma_model *m, luma_buf *q, luma_buf *k, const luma_weight *gq,
                        const luma_weight *gk, int32_t head_dim, const int32_t *pos, const luma_rope *r);
/* q, k and v plus their biases bq, bk, bv (NULL: none), then q and k
 * rotated at pos: through the backend's fused qkv_bias_rope when it has
 * one, else as add_bias and luma_model_qk_rope; the same bits either way. */
void luma_model_qkv_bias_rope(const luma_model *m, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                              const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                              const luma_rope *r);
/* q, k, v = wq x, wk x, wv x (p->w, ys in that order) plus the biases
 * p->b (NULL entries: none), then q's and k's heads normalized with
 * p->gq, p->gk when given and rotated at pos: through the backend's
 * qkv_rope when it takes them, else as luma_model_matmuls, add_bias and
 * luma_model_qk_rope; the same bits either way. */
void luma_model_qkv_rope(const luma_model *m, const luma_qkv *p, const luma_buf *x, luma_buf *const *ys,
                         int32_t head_dim, const int32_t *pos, const luma_rope *r);
/* gate = act(gate) * up, then y = w gate: through the backend's fused
 * gated_matmul when it has one, else gelu_mul or silu_mul and matmul. */
void luma_model_gated_matmul(const luma_model *m, const luma_weight *w, luma_buf *gate, const luma_buf *up,
                             int act, luma_buf *y);
/* The feed-forward: gate = gate_w x, up = up_w x, then y = down_w (act(gate)
 * * up), act(gate) * up left in gate: through the backend's ffn when it
 * takes them, else as luma_model_matmuls and luma_model_gated_matmul; the
 * same bits either way. */
void luma_model_ffn(const luma_model *m, const luma_weight *gate_w, const luma_weight *up_w, const luma_weight *down_w,
                    int act, const luma_buf *x, luma_buf *gate, luma_buf *up, luma_buf *y);
/* ys[i] = ws[i] x for the n weights: through the backend's matmul_many when
 * it has one, else one matmul each; the same bits either way. */
void luma_model_matmuls(const luma_model *m, int n, const luma_weight *const *ws, const luma_buf *x,
                        luma_buf *const *ys);
/* x += (yg ? rmsnorm(y) * yg : y), then out = rmsnorm(x) * g: through the
 * backend's fused add_rmsnorm when it has one, else as separate operations
 * (which, when yg is given, normalize y in place). */
void luma_model_residual_norm(const luma_model *m, luma_buf *x, luma_buf *y, const luma_weight *yg,
                              const luma_weight *g, luma_buf *out);
/* Where layer il's closing residual norm writes: the next layer's input
 * (acts.h), or after the last layer, the output norm of every row: into
 * acts.out_rows directly when every row is an out row (a decode step: the
 * add, the norm and no gather), else into acts.h for luma_model_gather_out.
 * A row's bits are the same either way. */
luma_buf *luma_model_norm_out(luma_model *m, const luma_step *step, int il);
/* After the last layer: the step's out rows of acts.h into acts.out_rows,
 * where luma_model_norm_out did not put them there already. */
void luma_model_gather_out(luma_model *m, const luma_step *step);
/* Reads "<arch>.<suffix>" (e.g. "block_count"), with a default when absent. */
int luma_model_u32(const luma_model *m, const char *suffix, uint32_t def, uint32_t *out, luma_err *err);
int luma_model_f32(const luma_model *m, const char *suffix, float def, float *out, luma_err *err);

/* The architectures luma knows; NULL when name is not one. */
const luma_arch *luma_arch_find(const char *name);

/* ---- sequences ---------------------------------------------------------- */

typedef struct luma_seq {
    luma_model *model;
    luma_kv_seq *kv;
    int32_t *tokens;
    int32_t n_tokens, cap;
} luma_seq;

luma_seq *luma_seq_new(luma_model *m, luma_err *err);
luma_seq *luma_seq_fork(luma_seq *s, luma_err *err);
void luma_seq_free(luma_seq *s);
int luma_seq_rewind(luma_seq *s, int32_t n, luma_err *err);

/* One chunk of a step: tokens appended to a sequence. */
typedef struct luma_chunk {
    luma_seq *seq;
    const int32_t *ids;
    int32_t n;
    bool all_logits;           /* logits for every token, not just the last */
} luma_chunk;

/* Runs the chunks as one forward (splitting at max_rows when needed) and
 * writes the logits of each chunk's last token (or every token) to logits,
 * n_vocab floats per row, chunk by chunk. A failure (context or KV memory
 * exhausted, an id out of range) leaves every sequence as it was. */
int luma_model_run(luma_model *m, const luma_chunk *chunks, int32_t n_chunks, float *logits,
                   luma_err *err);
/* Rows of logits luma_model_run writes for these chunks. */
int64_t luma_model_out_rows(const luma_chunk *chunks, int32_t n_chunks);

/* ---- logits that stay with the backend ---------------------------------- */

/* The logits of one run left where the backend keeps its buffers (device
 * memory on a GPU, host memory on the CPU) instead of copied out: rows x
 * n_vocab floats, rows in the order luma_model_run writes them. Holders
 * share a set by reference count; the last release puts its memory in the
 * model's pool, for the next run to reuse. Its rows are read and worked on
 * through the backend's logits operations (backend.h); a backend without
 * them keeps buf.data in host memory, where the src/sample.h functions
 * apply. Every set must be released, and the pool drained, before the
 * model is freed. */
struct luma_logits_set {
    luma_model *model;
    luma_buf buf;              /* rows x n_vocab (buf.cap may be more: a reused allocation) */
    int32_t refs;
    int32_t *argmax;           /* every row's argmax, once luma_logits_set_argmax cached it or the run found it */
    bool argmax_read;          /* argmax read since the run (one found by the run and unread is not) */
    int32_t topk_k;            /* the k best of every row found by the run (topk_ahead), or 0: */
    int32_t *topk;             /* rows x topk_k ids, rows x topk_k values (floats), rows counts */
    bool topk_read;            /* topk read since the run */
    void *holders;             /* the holders' own list (the Lua binding's Logits of the set) */
    luma_logits_set *prev, *next;   /* in the model's held sets, or in its pool */
};

/* Host work a caller does while the device computes a run's last pass
 * (before the run waits for it), such as making the objects that will hand
 * out its rows. Nonzero (err set) fails the run. */
typedef struct luma_run_hook {
    int (*fn)(void *ctx, luma_err *err);
    void *ctx;
} luma_run_hook;

/* luma_model_run into a new set, whose one reference is the caller's;
 * hook (or NULL) runs once the last pass is queued. The sequences are left
 * as they were when it fails. */
int luma_model_run_set(luma_model *m, const luma_chunk *chunks, int32_t n_chunks, const luma_run_hook *hook,
                       luma_logits_set **out, luma_err *err);
void luma_logits_set_release(luma_logits_set *s);

/* Greedy or sampled decoding of one sequence. ids[0] = first (the
 * argmax, or smp's draw, of the sequence's last logits, taken by the
 * caller); then while fewer than n ids are known: the last id is fed and
 * the next id is the argmax of its logits (smp NULL) or smp's draw from
 * them (luma_sampler_draw), one luma_rng_uniform of rng a draw, in order.
 * An id in stops (n_stops of them), or one for which on_token (or NULL)
 * sets *stop, ends it unfed. So ids[0..*n_ids) are what a loop of the
 * choice and luma_model_run would give, the sequence gains every id but a
 * stopping one, and *last gets a new set (the caller's reference) whose
 * row *last_row holds the logits of the last id fed (NULL when none was:
 * first stopped, or n = 0).
 * on_token(ctx, id, &stop, err) is called once for each id as it becomes
 * known, while the device computes the step that feeds it; nonzero fails
 * the call. With the backend's chain ops each step's token is the
 * device's choice from the step before, queued before the host reads it
 * (a draw on the device is the host's but where its exp or log, a last
 * bit off, moves a sum across a boundary). Any failure (context or KV
 * cache full, an all-masked row, on_token's) leaves the sequence as it
 * was, except, as luma_model_run, where the sliding-window blocks of its
 * early positions were released on the way: it then keeps the tokens its
 * cache holds, and err says so. */
typedef int (*luma_token_fn)(void *ctx, int32_t id, bool *stop, luma_err *err);
/* A penalizing sampler's window is over history [n_history] (the ids
 * before first; NULL when it does not penalize), then the ids drawn. */
int luma_model_decode(luma_model *m, luma_seq *s, int32_t first, int32_t n, const luma_sampler *smp, luma_rng *rng,
                      const int32_t *history, int32_t n_history, const int32_t *stops, int32_t n_stops,
                      luma_token_fn on_token, void *ctx, int32_t *ids, int32_t *n_ids, luma_logits_set **last,
                      int64_t *last_row, luma_err *err);
/* Frees the pool of released sets; held sets stay. */
void luma_model_logits_drain(luma_model *m);
/* Row `row` in host memory where the backend keeps its buffers there; NULL
 * on a device. */
float *luma_logits_set_host(const luma_logits_set *s, int64_t row);
/* Copies row `row` (n_vocab floats) to dst. */
int luma_logits_set_read(const luma_logits_set *s, int64_t row, float *dst, luma_err *err);
/* Entry id of row `row` into *v. */
int luma_logits_set_read_at(const luma_logits_set *s, int64_t row, int32_t id, float *v, luma_err *err);
/* luma_logits_argmax of row `row` (-1 with err set when every entry is
 * masked). cached: the first such call finds every row's argmax in one pass
 * and keeps them, for rows unchanged since the run. */
int32_t luma_logits_set_argmax(luma_logits_set *s, int64_t row, bool cached, luma_err *err);
/* luma_logits_topk of row `row` (k in [1, LUMA_TOPK_MAX]): the count, or -1
 * with err set. cached: the row is unchanged since the run, so the k best
 * the run found ahead serve where they are at least k, and a backend with
 * logits_topk_rows is asked to find this k ahead from the next run on. */
int32_t luma_logits_set_topk(luma_logits_set *s, int64_t row, int32_t k, bool cached, int32_t *ids, float *vals,
                             luma_err *err);
/* A penalty that only lowers entries (luma_logits_penalize_counted with
 * repeat >= 1, frequency >= 0, presence >= 0) over n distinct ids, in
 * increasing order (as luma_logits_penalty_counts gives them). */
typedef struct luma_lowering {
    const int32_t *ids, *counts;
    int32_t n;
    float repeat, frequency, presence;
} luma_lowering;
/* luma_logits_topk of row `row` after p was applied to it since the run
 * (and nothing else), from the k best the run found ahead: they hold the
 * answer where, penalized, their k-th best still ranks at or above the
 * last of them. The count, or -1 where they do not (or none were found),
 * and the caller then asks the backend; it also asks the next runs to find
 * LUMA_TOPK_AHEAD_MAX ahead. */
int32_t luma_logits_set_topk_lowered(luma_logits_set *s, int64_t row, int32_t k, const luma_lowering *p,
                                     int32_t *ids, float *vals);

#endif
