/* Gemma 3.
 *
 *   x = embed(tokens) * sqrt(n_embd)
 *   per layer:
 *     h = rmsnorm(x) ; q, k, v = Wq h, Wk h, Wv h     q: [n_head][dk], k, v: [n_kv_head][dk]
 *     q, k = rmsnorm per head, then RoPE (NeoX) with the layer's base
 *     x += rmsnorm(Wo attention(q, k, v))             sliding-window layers see 512 keys
 *     h = rmsnorm(x)
 *     x += rmsnorm(Wdown (gelu_tanh(Wgate h) * Wup h))
 *   logits = token_embd . rmsnorm(x)                  output tied to the embedding
 *
 * Norm gains in GGUF files already include Gemma's "+1". Five of every six
 * layers use a sliding window with RoPE base 10000; every sixth attends over
 * the whole context with the file's base. */
#include <math.h>

#include "model.h"

#define SWA_PATTERN 6
#define SWA_ROPE_BASE 10000.0f

static int gemma3_load(luma_model *m, luma_err *err)
{
    luma_hparams *hp = &m->hp;
    if (luma_model_read_hparams(m, 1000000.0f, err)) return -1;
    uint32_t window, pattern;
    if (luma_model_u32(m, "attention.sliding_window", 0, &window, err) ||
        luma_model_u32(m, "attention.sliding_window_pattern", SWA_PATTERN, &pattern, err))
        return -1;
    if (pattern == 0) return luma_errf(err, "gemma3: attention.sliding_window_pattern must be positive");
    hp->swa_window = (int32_t)(window > INT32_MAX ? INT32_MAX : window);
    for (int il = 0; il < hp->n_layer; il++) hp->layer_swa[il] = window > 0 && (il + 1) % (int)pattern != 0;
    hp->rope_kind = LUMA_ROPE_NEOX;
    hp->rope_base_swa = SWA_ROPE_BASE;
    hp->embd_scale = sqrtf((float)hp->n_embd);
    /* The 27B model scales queries by its model width per head instead. */
    if (hp->n_layer == 62) hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head));

    if (luma_model_bind_common(m, err)) return -1;
    int64_t E = hp->n_embd;
    for (int il = 0; il < hp->n_layer; il++) {
        luma_layer *l = &m->layers[il];
        if (luma_model_layer_weight(m, &l->q_norm, il, "attn_q_norm", 1, hp->head_dim_k, false, err) ||
            luma_model_layer_weight(m, &l->k_norm, il, "attn_k_norm", 1, hp->head_dim_k, false, err) ||
            luma_model_layer_weight(m, &l->post_attn_norm, il, "post_attention_norm", 1, E, false, err) ||
            luma_model_layer_weight(m, &l->post_ffn_norm, il, "post_ffw_norm", 1, E, false, err))
            return -1;
    }
    return 0;
}

static int gemma3_forward(luma_model *m, const luma_step *step, luma_err *err)
{
    const luma_hparams *hp = &m->hp;
    const luma_backend_ops *be = m->be->ops;
    luma_backend *b = m->be;
    luma_acts *a = &m->acts;
    int32_t dk = hp->head_dim_k;

    be->embed(b, &m->tok_embd, step->tokens, step->n_rows, hp->embd_scale, &a->x);
    be->rmsnorm(b, &a->x, &m->layers[0].attn_norm, hp->n_embd, hp->eps, &a->h);
    for (int il = 0; il < hp->n_layer; il++) {
        const luma_layer *l = &m->layers[il];
        luma_attn at;
        luma_model_attn(m, il, &at);
        luma_rope rope = { hp->rope_kind, hp->rope_dims,
                           hp->layer_swa[il] ? hp->rope_base_swa : hp->rope_base,
                           hp->layer_swa[il] ? 1.0f : hp->rope_pos_scale, NULL };

        /* a->h holds this layer's normalized input */
        const luma_qkv p = { { &l->wq, &l->wk, &l->wv }, { NULL, NULL, NULL }, &l->q_norm, &l->k_norm, hp->eps };
        luma_model_qkv_rope(m, &p, &a->h, (luma_buf *const[]){ &a->q, &a->k, &a->v }, dk, step->pos, &rope);
        be->attention(b, &a->q, &a->k, &a->v, step, &at, &a->attn);
        be->matmul(b, &l->wo, &a->attn, &a->o);
        luma_model_residual_norm(m, &a->x, &a->o, &l->post_attn_norm, &l->ffn_norm, &a->h);

        luma_model_ffn(m, &l->gate, &l->up, &l->down, LUMA_ACT_GELU, &a->h, &a->gate, &a->up, &a->o);
        const luma_weight *next = il + 1 < hp->n_layer ? &m->layers[il + 1].attn_norm : &m->output_norm;
        luma_model_residual_norm(m, &a->x, &a->o, &l->post_ffn_norm, next, luma_model_norm_out(m, step, il));
    }
    luma_model_gather_out(m, step);
    return be->sync(b, err);
}

const luma_arch luma_arch_gemma3 = { "gemma3", gemma3_load, gemma3_forward };
