/* Loading a model: the file, its vocabulary, the architecture's weights on
 * a backend, the KV cache and the activation buffers of the largest step. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KV_BLOCK_TOKENS 16
#define DEFAULT_MAX_ROWS 512
#define DEFAULT_CTX_CAP 8192

extern const luma_arch luma_arch_gemma3;
extern const luma_arch luma_arch_llama;
extern const luma_arch luma_arch_qwen2;

static const luma_arch *const arches[] = { &luma_arch_gemma3, &luma_arch_llama, &luma_arch_qwen2 };

const luma_arch *luma_arch_find(const char *name)
{
    for (size_t i = 0; i < sizeof arches / sizeof arches[0]; i++)
        if (strcmp(arches[i]->name, name) == 0) return arches[i];
    return NULL;
}

void luma_model_params_default(luma_model_params *p)
{
    memset(p, 0, sizeof *p);
    p->rewind = LUMA_DEFAULT_REWIND;
}

/* ---- metadata and tensors ----------------------------------------------- */

static void arch_key(const luma_model *m, const char *suffix, char *key, size_t cap)
{
    snprintf(key, cap, "%s.%s", m->hp.arch, suffix);
}

int luma_model_u32(const luma_model *m, const char *suffix, uint32_t def, uint32_t *out, luma_err *err)
{
    char key[128];
    arch_key(m, suffix, key, sizeof key);
    return luma_gguf_get_u32(m->file, key, def, out, err);
}

int luma_model_f32(const luma_model *m, const char *suffix, float def, float *out, luma_err *err)
{
    char key[128];
    arch_key(m, suffix, key, sizeof key);
    return luma_gguf_get_f32(m->file, key, def, out, err);
}

/* luma_model_weight, the weight given neox_head before the backend loads it */
static int bind_weight(luma_model *m, luma_weight *w, const char *name, int64_t rows, int64_t cols, bool optional,
                       int32_t neox_head, luma_err *err)
{
    memset(w, 0, sizeof *w);
    const luma_gguf_tensor *t = luma_gguf_find_tensor(m->file, name);
    if (!t) {
        if (optional) return 0;
        return luma_errf(err, "missing tensor '%s'", name);
    }
    bool vector = rows == 1;
    bool shape_ok = t->ne[0] == cols && t->ne[2] == 1 && t->ne[3] == 1 &&
                    (vector ? t->n_dims == 1 || t->ne[1] == 1 : t->ne[1] == rows);
    if (!shape_ok)
        return luma_errf(err, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                         name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                         (long long)t->ne[3], (long long)cols, (long long)rows);
    if (vector && t->type != LUMA_F32)
        return luma_errf(err, "tensor '%s' is %s; norms and biases must be F32", name,
                         luma_type_name(t->type));
    if (!vector && !luma_vec_dot_get((enum luma_type)t->type))
        return luma_errf(err, "tensor '%s' has type %s, which luma cannot multiply", name,
                         luma_type_name(t->type));
    w->type = (enum luma_type)t->type;
    w->rows = rows;
    w->cols = cols;
    w->host = t->data;
    w->neox_head = neox_head;
    if (m->be->ops->weight_load(m->be, w, err)) return -1;
    const luma_model_params *p = m->loading;
    m->load_done += (int64_t)t->size;
    if (p && p->progress && m->load_total > 0 &&
        p->progress(p->progress_ctx, 0.99f * (float)m->load_done / (float)m->load_total))
        return luma_errf(err, "loading cancelled");
    return 0;
}

int luma_model_weight(luma_model *m, luma_weight *w, const char *name, int64_t rows, int64_t cols,
                      bool optional, luma_err *err)
{
    return bind_weight(m, w, name, rows, cols, optional, 0, err);
}

static int bind_layer_weight(luma_model *m, luma_weight *w, int il, const char *name, int64_t rows, int64_t cols,
                             bool optional, int32_t neox_head, luma_err *err)
{
    char full[96];
    size_t len = strlen(name);
    bool bias = len > 5 && strcmp(name + len - 5, ".bias") == 0;
    snprintf(full, sizeof full, bias ? "blk.%d.%s" : "blk.%d.%s.weight", il, name);
    return bind_weight(m, w, full, rows, cols, optional, neox_head, err);
}

int luma_model_layer_weight(luma_model *m, luma_weight *w, int il, const char *name, int64_t rows,
                            int64_t cols, bool optional, luma_err *err)
{
    return bind_layer_weight(m, w, il, name, rows, cols, optional, 0, err);
}

int luma_model_layer_weight_rotated(luma_model *m, luma_weight *w, int il, const char *name, int64_t rows,
                                    int64_t cols, bool optional, luma_err *err)
{
    return bind_layer_weight(m, w, il, name, rows, cols, optional, m->rope_pair_head, err);
}

int luma_model_read_hparams(luma_model *m, float rope_base_default, luma_err *err)
{
    luma_hparams *hp = &m->hp;
    uint32_t n_embd, n_layer, n_head, n_kv, dk, dv, n_ff, ctx, rope_dims;
    if (luma_model_u32(m, "embedding_length", 0, &n_embd, err) ||
        luma_model_u32(m, "block_count", 0, &n_layer, err) ||
        luma_model_u32(m, "attention.head_count", 0, &n_head, err) ||
        luma_model_u32(m, "feed_forward_length", 0, &n_ff, err) ||
        luma_model_u32(m, "context_length", 0, &ctx, err))
        return -1;
    if (n_embd == 0 || n_layer == 0 || n_head == 0 || n_ff == 0)
        return luma_errf(err, "%s: embedding_length, block_count, attention.head_count and "
                              "feed_forward_length must be present and positive", hp->arch);
    if (n_layer > LUMA_MAX_LAYERS || n_embd > (1u << 20) || n_head > 1024 || n_ff > (1u << 22))
        return luma_errf(err, "%s: hyper-parameters out of range", hp->arch);
    if (luma_model_u32(m, "attention.head_count_kv", n_head, &n_kv, err) ||
        luma_model_u32(m, "attention.key_length", n_embd / n_head, &dk, err) ||
        luma_model_u32(m, "attention.value_length", dk, &dv, err) ||
        luma_model_u32(m, "rope.dimension_count", dk, &rope_dims, err) ||
        luma_model_f32(m, "attention.layer_norm_rms_epsilon", 1e-5f, &hp->eps, err) ||
        luma_model_f32(m, "rope.freq_base", rope_base_default, &hp->rope_base, err))
        return -1;
    if (n_kv == 0 || n_head % n_kv != 0 || dk == 0 || dk > 1024 || dv == 0 || dv > 1024 ||
        rope_dims > dk || rope_dims % 2 != 0)
        return luma_errf(err, "%s: inconsistent attention shape (%u heads, %u kv heads, key %u, value %u, rope %u)",
                         hp->arch, n_head, n_kv, dk, dv, rope_dims);
    hp->n_embd = (int32_t)n_embd;
    hp->n_layer = (int32_t)n_layer;
    hp->n_head = (int32_t)n_head;
    hp->n_kv_head = (int32_t)n_kv;
    hp->head_dim_k = (int32_t)dk;
    hp->head_dim_v = (int32_t)dv;
    hp->n_ff = (int32_t)n_ff;
    hp->n_ctx_train = (int32_t)(ctx > INT32_MAX ? INT32_MAX : ctx);
    hp->rope_dims = (int32_t)rope_dims;
    hp->rope_base_swa = hp->rope_base;
    hp->attn_scale = 1.0f / sqrtf((float)dk);
    hp->embd_scale = 1.0f;

    char key[128];
    luma_str type;
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch);
    if (luma_gguf_get_str(m->file, key, &type, err)) return -1;
    float factor = 1.0f;
    if (luma_model_f32(m, "rope.scaling.factor", 1.0f, &factor, err)) return -1;
    hp->rope_pos_scale = 1.0f;
    if (type.ptr && !luma_str_eq(type, "none")) {
        if (!luma_str_eq(type, "linear"))
            return luma_errf(err, "%s: RoPE scaling '%.*s' is not supported (only linear)", hp->arch,
                             (int)(type.len > 32 ? 32 : type.len), type.ptr);
        if (!(factor > 0)) return luma_errf(err, "%s: rope.scaling.factor must be positive", hp->arch);
        hp->rope_pos_scale = 1.0f / factor;
    }
    m->layers = calloc(n_layer, sizeof *m->layers);
    if (!m->layers) return luma_errf(err, "out of memory");
    return 0;
}

int luma_model_bind_common(luma_model *m, luma_err *err)
{
    const luma_hparams *hp = &m->hp;
    int64_t E = hp->n_embd, Q = (int64_t)hp->n_head * hp->head_dim_k;
    int64_t K = (int64_t)hp->n_kv_head * hp->head_dim_k, V = (int64_t)hp->n_kv_head * hp->head_dim_v;
    int64_t O = (int64_t)hp->n_head * hp->head_dim_v, F = hp->n_ff;
    if (luma_model_weight(m, &m->tok_embd, "token_embd.weight", hp->n_vocab, E, false, err) ||
        luma_model_weight(m, &m->output_norm, "output_norm.weight", 1, E, false, err) ||
        luma_model_weight(m, &m->output, "output.weight", hp->n_vocab, E, true, err))
        return -1;
    for (int il = 0; il < hp->n_layer; il++) {
        luma_layer *l = &m->layers[il];
        if (luma_model_layer_weight(m, &l->attn_norm, il, "attn_norm", 1, E, false, err) ||
            luma_model_layer_weight_rotated(m, &l->wq, il, "attn_q", Q, E, false, err) ||
            luma_model_layer_weight_rotated(m, &l->wk, il, "attn_k", K, E, false, err) ||
            luma_model_layer_weight(m, &l->wv, il, "attn_v", V, E, false, err) ||
            luma_model_layer_weight(m, &l->wo, il, "attn_output", E, O, false, err) ||
            luma_model_layer_weight(m, &l->ffn_norm, il, "ffn_norm", 1, E, false, err) ||
            luma_model_layer_weight(m, &l->gate, il, "ffn_gate", F, E, false, err) ||
            luma_model_layer_weight(m, &l->up, il, "ffn_up", F, E, false, err) ||
            luma_model_layer_weight(m, &l->down, il, "ffn_down", E, F, false, err))
            return -1;
    }
    return 0;
}

void luma_model_attn(const luma_model *m, int il, luma_attn *a)
{
    const luma_hparams *hp = &m->hp;
    bool swa = hp->layer_swa[il];
    a->pool = m->kv_layout.n_pools == 2 && swa ? 1 : 0;
    a->layer = 0;
    for (int i = 0; i < il; i++)
        if (m->kv_layout.n_pools == 1 || hp->layer_swa[i] == swa) a->layer++;
    a->n_head = hp->n_head;
    a->n_kv_head = hp->n_kv_head;
    a->head_dim_k = hp->head_dim_k;
    a->head_dim_v = hp->head_dim_v;
    a->window = swa ? hp->swa_window : 0;
    a->scale = hp->attn_scale;
    a->softcap = hp->attn_softcap;
}

void luma_model_matmuls(const luma_model *m, int n, const luma_weight *const *ws, const luma_buf *x,
                        luma_buf *const *ys)
{
    luma_backend *b = m->be;
    if (b->ops->matmul_many && n <= LUMA_MATMUL_MANY) {
        b->ops->matmul_many(b, n, ws, x, ys);
        return;
    }
    for (int i = 0; i < n; i++) b->ops->matmul(b, ws[i], x, ys[i]);
}

void luma_model_qk_rope(const luma_model *m, luma_buf *q, luma_buf *k, const luma_weight *gq,
                        const luma_weight *gk, int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    luma_backend *b = m->be;
    const luma_backend_ops *be = b->ops;
    if (be->qk_rope) {
        be->qk_rope(b, q, k, gq, gk, head_dim, m->hp.eps, pos, r);
        return;
    }
    if (gq) be->rmsnorm(b, q, gq, head_dim, m->hp.eps, q);
    if (gk) be->rmsnorm(b, k, gk, head_dim, m->hp.eps, k);
    be->rope(b, q, head_dim, pos, r);
    be->rope(b, k, head_dim, pos, r);
}

void luma_model_qkv_bias_rope(const luma_model *m, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                              const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                              const luma_rope *r)
{
    luma_backend *b = m->be;
    const luma_backend_ops *be = b->ops;
    if (be->qkv_bias_rope) {
        be->qkv_bias_rope(b, q, k, v, bq, bk, bv, head_dim, pos, r);
        return;
    }
    if (bq) be->add_bias(b, q, bq);
    if (bk) be->add_bias(b, k, bk);
    if (bv) be->add_bias(b, v, bv);
    luma_model_qk_rope(m, q, k, NULL, NULL, head_dim, pos, r);
}

void luma_model_qkv_rope(const luma_model *m, const luma_qkv *p, const luma_buf *x, luma_buf *const *ys,
                         int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    luma_backend *b = m->be;
    if (b->ops->qkv_rope && b->ops->qkv_rope(b, p, x, ys, head_dim, pos, r)) return;
    luma_model_matmuls(m, 3, p->w, x, ys);
    if (p->gq) {
        for (int i = 0; i < 3; i++)
            if (p->b[i]) b->ops->add_bias(b, ys[i], p->b[i]);
        luma_model_qk_rope(m, ys[0], ys[1], p->gq, p->gk, head_dim, pos, r);
    } else if (p->b[0] || p->b[1] || p->b[2]) {
        luma_model_qkv_bias_rope(m, ys[0], ys[1], ys[2], p->b[0], p->b[1], p->b[2], head_dim, pos, r);
    } else {
        luma_model_qk_rope(m, ys[0], ys[1], NULL, NULL, head_dim, pos, r);
    }
}

void luma_model_gated_matmul(const luma_model *m, const luma_weight *w, luma_buf *gate, const luma_buf *up,
                             int act, luma_buf *y)
{
    luma_backend *b = m->be;
    const luma_backend_ops *be = b->ops;
    if (be->gated_matmul) {
        be->gated_matmul(b, w, gate, up, act, y);
        return;
    }
    if (act == LUMA_ACT_GELU) be->gelu_mul(b, gate, up);
    else be->silu_mul(b, gate, up);
    be->matmul(b, w, gate, y);
}

void luma_model_ffn(const luma_model *m, const luma_weight *gate_w, const luma_weight *up_w, const luma_weight *down_w,
                    int act, const luma_buf *x, luma_buf *gate, luma_buf *up, luma_buf *y)
{
    luma_backend *b = m->be;
    const luma_weight *const w[3] = { gate_w, up_w, down_w };
    if (b->ops->ffn && b->ops->ffn(b, w, act, x, gate, up, y)) return;
    luma_model_matmuls(m, 2, w, x, (luma_buf *const[]){ gate, up });
    luma_model_gated_matmul(m, down_w, gate, up, act, y);
}

void luma_model_residual_norm(const luma_model *m, luma_buf *x, luma_buf *y, const luma_weight *yg,
                              const luma_weight *g, luma_buf *out)
{
    luma_backend *b = m->be;
    const luma_backend_ops *be = b->ops;
    float eps = m->hp.eps;
    if (be->add_rmsnorm) {
        be->add_rmsnorm(b, x, y, yg, g, eps, out);
        return;
    }
    if (yg) be->rmsnorm(b, y, yg, m->hp.n_embd, eps, y);
    be->add(b, x, y);
    be->rmsnorm(b, x, g, m->hp.n_embd, eps, out);
}

/* Whether the out rows are every row, in order. */
static bool every_row_out(const luma_step *step)
{
    if (step->n_out != step->n_rows) return false;
    for (int32_t i = 0; i < step->n_out; i++)
        if (step->out_rows[i] != i) return false;
    return true;
}

luma_buf *luma_model_norm_out(luma_model *m, const luma_step *step, int il)
{
    if (il + 1 < m->hp.n_layer || !every_row_out(step)) return &m->acts.h;
    return &m->acts.out_rows;
}

void luma_model_gather_out(luma_model *m, const luma_step *step)
{
    if (every_row_out(step)) return;
    m->be->ops->gather(m->be, &m->acts.h, step->out_rows, step->n_out, &m->acts.out_rows);
}

/* ---- KV cache and activations ------------------------------------------- */

static void kv_copy(void *ctx, int pool, int32_t src, int32_t dst)
{
    luma_backend *be = ctx;
    be->ops->kv_copy_block(be, pool, src, dst);
}

static int32_t div_up(int64_t a, int64_t b) { return (int32_t)((a + b - 1) / b); }

static int setup_kv(luma_model *m, const luma_model_params *p, luma_err *err)
{
    const luma_hparams *hp = &m->hp;
    luma_kv_layout *l = &m->kv_layout;
    memset(l, 0, sizeof *l);
    l->block_tokens = KV_BLOCK_TOKENS;
    l->n_kv_head = hp->n_kv_head;
    l->head_dim_k = hp->head_dim_k;
    l->head_dim_v = hp->head_dim_v;
    l->type = p->kv_f32 ? LUMA_F32 : LUMA_F16;
    const int32_t n_swa = luma_swa_layers(hp);
    /* Sliding-window layers get their own pool when the window is shorter
     * than the context; otherwise they see everything anyway. */
    bool split = hp->swa_window > 0 && n_swa > 0 && hp->swa_window < m->n_ctx;
    l->n_pools = split ? (n_swa < hp->n_layer ? 2 : 1) : 1;
    int32_t window[LUMA_KV_MAX_POOLS] = { 0, 0 };
    if (split && n_swa == hp->n_layer) {
        l->n_layers[0] = n_swa;
        window[0] = hp->swa_window;
    } else if (split) {
        l->n_layers[0] = hp->n_layer - n_swa;
        l->n_layers[1] = n_swa;
        window[1] = hp->swa_window;
    } else {
        l->n_layers[0] = hp->n_layer;
    }
    /* Blocks one sequence of n_ctx positions needs in each pool: a windowed
     * pool holds the window plus one step of new rows. */
    int32_t per_seq[LUMA_KV_MAX_POOLS];
    int64_t seq_bytes = 0;
    int64_t layer_block = (int64_t)l->block_tokens * (int64_t)luma_kv_token_bytes(l);
    for (int p2 = 0; p2 < l->n_pools; p2++) {
        per_seq[p2] = div_up(m->n_ctx, l->block_tokens);
        if (window[p2] > 0) {
            int32_t w = div_up(window[p2] + m->max_rows + m->rewind, l->block_tokens) + 1;
            if (w < per_seq[p2]) per_seq[p2] = w;
        }
        seq_bytes += (int64_t)per_seq[p2] * l->n_layers[p2] * layer_block;
    }
    int64_t budget = p->kv_bytes > 0 ? p->kv_bytes : seq_bytes;
    int64_t n_seq = budget / seq_bytes;
    if (n_seq < 1)
        return luma_errf(err, "KV budget of %lld bytes is below the %lld bytes one sequence of %d positions needs",
                         (long long)budget, (long long)seq_bytes, m->n_ctx);
    luma_kv_params kp = { .n_pools = l->n_pools, .block_tokens = l->block_tokens, .keep = m->rewind,
                          .copy = kv_copy, .copy_ctx = m->be };
    for (int p2 = 0; p2 < l->n_pools; p2++) {
        l->n_blocks[p2] = (int32_t)(n_seq * per_seq[p2]);
        kp.n_blocks[p2] = l->n_blocks[p2];
        kp.window[p2] = window[p2];
    }
    if (m->be->ops->kv_alloc(m->be, l, err)) return -1;
    return luma_kv_new(&kp, &m->kv, err);
}

static int alloc_acts(luma_model *m, luma_err *err)
{
    const luma_hparams *hp = &m->hp;
    luma_backend *be = m->be;
    luma_acts *a = &m->acts;
    int64_t r = m->max_rows;
    int64_t qd = (int64_t)hp->n_head * hp->head_dim_k, kd = (int64_t)hp->n_kv_head * hp->head_dim_k;
    int64_t vd = (int64_t)hp->n_kv_head * hp->head_dim_v, ad = (int64_t)hp->n_head * hp->head_dim_v;
    struct { luma_buf *b; int64_t rows, cols; } plan[] = {
        { &a->x, r, hp->n_embd }, { &a->h, r, hp->n_embd }, { &a->q, r, qd }, { &a->k, r, kd },
        { &a->v, r, vd }, { &a->attn, r, ad }, { &a->o, r, hp->n_embd }, { &a->gate, r, hp->n_ff },
        { &a->up, r, hp->n_ff }, { &a->out_rows, r, hp->n_embd }, { &a->logits, LUMA_LOGIT_ROWS, hp->n_vocab },
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        if (be->ops->buf_alloc(be, plan[i].b, plan[i].rows, plan[i].cols, err)) return -1;
    return 0;
}

static void free_acts(luma_model *m)
{
    luma_buf *all[] = { &m->acts.x, &m->acts.h, &m->acts.q, &m->acts.k, &m->acts.v, &m->acts.attn,
                        &m->acts.o, &m->acts.gate, &m->acts.up, &m->acts.out_rows, &m->acts.logits };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->data) m->be->ops->buf_free(m->be, all[i]);
}

/* The backend's warm-up steps (luma_backend.warmup): one sequence fed that
 * many ids a step, then freed. Their failure is not the load's: a real step
 * reports whatever it hit. */
static void warm_up(luma_model *m)
{
    const int32_t *rows = m->be->warmup;
    if (rows[0] < 1 || m->vocab_only) return;
    int32_t most = 0;
    for (int i = 0; i < LUMA_WARMUP_STEPS && rows[i] > 0; i++)
        if (rows[i] > most) most = rows[i];
    luma_err err = { { 0 } };
    int32_t *ids = malloc((size_t)most * sizeof(int32_t));
    float *logits = malloc((size_t)m->hp.n_vocab * sizeof(float));
    luma_seq *s = ids && logits ? luma_seq_new(m, &err) : NULL;
    for (int i = 0; s && i < LUMA_WARMUP_STEPS && rows[i] > 0; i++) {
        int32_t n = rows[i];
        if (n > m->n_ctx - 1 - s->n_tokens) n = m->n_ctx - 1 - s->n_tokens;
        if (n < 1) break;
        for (int32_t j = 0; j < n; j++) ids[j] = (int32_t)(1 + (s->n_tokens + j) % (m->hp.n_vocab - 1));
        luma_chunk c = { s, ids, n, false };
        if (luma_model_run(m, &c, 1, logits, &err)) break;
    }
    if (s) luma_seq_free(s);
    if (m->be->ops->warmed) m->be->ops->warmed(m->be);
    free(ids);
    free(logits);
}

/* ---- load --------------------------------------------------------------- */

static luma_backend *make_backend(const luma_model_params *p, luma_err *err)
{
    const char *name = p->backend ? p->backend : "auto";
    if (strcmp(name, "cpu") == 0) return luma_backend_cpu_new(p->n_threads, err);
    if (strcmp(name, "cuda") == 0) return luma_backend_cuda_new(0, err);
    if (strcmp(name, "auto") == 0) {
        if (luma_backend_cuda_available()) {
            luma_backend *be = luma_backend_cuda_new(0, err);
            if (be) return be;
        }
        return luma_backend_cpu_new(p->n_threads, err);
    }
    luma_errf(err, "unknown backend '%s' (expected cpu, cuda or auto)", name);
    return NULL;
}

int luma_model_load(const char *path, const luma_model_params *p, luma_model **out, luma_err *err)
{
    *out = NULL;
    luma_model_params defaults;
    if (!p) {
        luma_model_params_default(&defaults);
        p = &defaults;
    }
    luma_model *m = calloc(1, sizeof *m);
    if (!m) return luma_errf(err, "out of memory");
    if (luma_gguf_open(path, &m->file, err)) goto fail;
    if (luma_vocab_load(m->file, &m->vocab, err)) goto fail;
    luma_str arch;
    if (luma_gguf_get_str(m->file, "general.architecture", &arch, err)) goto fail;
    if (!arch.ptr) {
        luma_errf(err, "%s: no general.architecture in the file", path);
        goto fail;
    }
    snprintf(m->hp.arch, sizeof m->hp.arch, "%.*s", (int)(arch.len < 31 ? arch.len : 31), arch.ptr);
    m->hp.n_vocab = luma_vocab_size(m->vocab);
    m->vocab_only = p->vocab_only;
    if (p->vocab_only) {
        *out = m;
        return 0;
    }
    m->arch = luma_arch_find(m->hp.arch);
    if (!m->arch || arch.len >= sizeof m->hp.arch) {
        luma_errf(err, "unsupported architecture '%.*s' (luma knows gemma3, llama, qwen2)",
                  (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
        goto fail;
    }
    m->be = make_backend(p, err);
    if (!m->be) goto fail;
    if (p->batch_invariant && m->be->ops->set_batch_invariant &&
        m->be->ops->set_batch_invariant(m->be, true, err))
        goto fail;
    m->batch_invariant = p->batch_invariant || !m->be->ops->set_batch_invariant;
    if (p->float_act && m->be->ops->set_float_act(m->be, true, err)) goto fail;
    m->float_act = p->float_act;
    if (p->progress && p->progress(p->progress_ctx, 0.0f)) {
        luma_errf(err, "loading cancelled");
        goto fail;
    }
    m->loading = p;
    for (uint64_t i = 0; i < m->file->n_tensors; i++) m->load_total += (int64_t)m->file->tensors[i].size;
    if (m->arch->load(m, err)) goto fail;
    m->loading = NULL;
    if (m->hp.n_vocab != m->tok_embd.rows) {
        luma_errf(err, "vocabulary has %d tokens but token_embd has %lld rows", m->hp.n_vocab,
                  (long long)m->tok_embd.rows);
        goto fail;
    }
    m->weight_bytes = m->load_total;
    /* The embedding table is read one row per token, not whole, unless it
     * is also the output projection. */
    if (m->output.host)
        m->weight_bytes -= (int64_t)luma_row_size(m->tok_embd.type, m->tok_embd.cols) * (m->tok_embd.rows - 1);
    if (p->n_ctx < 0 || p->max_rows < 0 || p->rewind < 0) {
        luma_errf(err, "ctx, max_rows and rewind must not be negative");
        goto fail;
    }
    m->n_ctx = p->n_ctx ? p->n_ctx : (m->hp.n_ctx_train < DEFAULT_CTX_CAP ? m->hp.n_ctx_train : DEFAULT_CTX_CAP);
    if (m->n_ctx <= 0) m->n_ctx = DEFAULT_CTX_CAP;
    m->max_rows = p->max_rows ? p->max_rows : DEFAULT_MAX_ROWS;
    m->rewind = p->rewind;
    if (setup_kv(m, p, err) || alloc_acts(m, err)) goto fail;
    warm_up(m);
    if (p->progress && p->progress(p->progress_ctx, 1.0f)) {
        luma_errf(err, "loading cancelled");
        goto fail;
    }
    *out = m;
    return 0;
fail:
    luma_model_free(m);
    return -1;
}

void luma_model_free(luma_model *m)
{
    if (!m) return;
    if (m->be) {
        luma_model_logits_drain(m);
        free_acts(m);
        m->be->ops->free(m->be);
    }
    luma_kv_free(m->kv);
    free(m->layers);
    free(m->rope_freqs);
    luma_vocab_free(m->vocab);
    luma_gguf_close(m->file);
    free(m);
}
