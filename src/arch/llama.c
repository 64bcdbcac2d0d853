/* Llama (Llama 2 and 3, Mistral, SmolLM, TinyLlama) and Qwen2, which is
 * Llama with biases on Q, K and V and NeoX-style RoPE.
 *
 *   x = embed(tokens)
 *   per layer:
 *     h = rmsnorm(x) ; q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)
 *     q, k = RoPE(q, k)                               grouped-query: n_kv_head <= n_head
 *     x += Wo attention(q, k, v)
 *     x += Wdown (silu(Wgate h') * Wup h')            h' = rmsnorm(x)
 *   logits = output . rmsnorm(x)                      output or, when absent, token_embd
 *
 * Llama 3.1's long-context RoPE comes as per-frequency divisors in the
 * tensor rope_freqs.weight. */
#include <stdlib.h>
#include <string.h>

#include "model.h"

static int load_common(luma_model *m, bool qkv_bias, enum luma_rope_kind rope, luma_err *err)
{
    luma_hparams *hp = &m->hp;
    if (luma_model_read_hparams(m, 10000.0f, err)) return -1;
    hp->rope_kind = rope;
    /* Qwen2's q and k, with their biases, go through luma_model_qkv_rope:
     * a backend may store their NEOX pairs adjacent */
    if (qkv_bias && rope == LUMA_ROPE_NEOX && hp->rope_dims == hp->head_dim_k) m->rope_pair_head = hp->head_dim_k;

    if (luma_model_bind_common(m, err)) return -1;
    int64_t Q = (int64_t)hp->n_head * hp->head_dim_k, K = (int64_t)hp->n_kv_head * hp->head_dim_k;
    int64_t V = (int64_t)hp->n_kv_head * hp->head_dim_v;
    luma_weight freqs;
    if (luma_model_weight(m, &freqs, "rope_freqs.weight", 1, hp->rope_dims / 2, true, err)) return -1;
    if (freqs.host) {
        size_t bytes = (size_t)(hp->rope_dims / 2) * sizeof(float);
        m->rope_freqs = malloc(bytes);
        if (!m->rope_freqs) return luma_errf(err, "out of memory");
        memcpy(m->rope_freqs, freqs.host, bytes);
    }
    for (int il = 0; il < hp->n_layer; il++) {
        luma_layer *l = &m->layers[il];
        if (luma_model_layer_weight_rotated(m, &l->bq, il, "attn_q.bias", 1, Q, !qkv_bias, err) ||
            luma_model_layer_weight_rotated(m, &l->bk, il, "attn_k.bias", 1, K, !qkv_bias, err) ||
            luma_model_layer_weight(m, &l->bv, il, "attn_v.bias", 1, V, !qkv_bias, err))
            return -1;
    }
    return 0;
}

static int llama_load(luma_model *m, luma_err *err) { return load_common(m, false, LUMA_ROPE_NORM, err); }
static int qwen2_load(luma_model *m, luma_err *err) { return load_common(m, true, LUMA_ROPE_NEOX, err); }

static int llama_forward(luma_model *m, const luma_step *step, luma_err *err)
{
    const luma_hparams *hp = &m->hp;
    const luma_backend_ops *be = m->be->ops;
    luma_backend *b = m->be;
    luma_acts *a = &m->acts;
    int32_t dk = hp->head_dim_k;
    luma_rope rope = { hp->rope_kind, hp->rope_dims, hp->rope_base, hp->rope_pos_scale, m->rope_freqs };

    be->embed(b, &m->tok_embd, step->tokens, step->n_rows, hp->embd_scale, &a->x);
    be->rmsnorm(b, &a->x, &m->layers[0].attn_norm, hp->n_embd, hp->eps, &a->h);
    for (int il = 0; il < hp->n_layer; il++) {
        const luma_layer *l = &m->layers[il];
        luma_attn at;
        luma_model_attn(m, il, &at);

        /* a->h holds this layer's normalized input */
        /* qwen2's biases go in before the rotation */
        const luma_qkv p = { { &l->wq, &l->wk, &l->wv },
                             { l->bq.host ? &l->bq : NULL, l->bk.host ? &l->bk : NULL, l->bv.host ? &l->bv : NULL },
                             NULL, NULL, hp->eps };
        luma_buf *const qkv[] = { &a->q, &a->k, &a->v };
        luma_model_qkv_rope(m, &p, &a->h, qkv, dk, step->pos, &rope);
        be->attention(b, &a->q, &a->k, &a->v, step, &at, &a->attn);
        be->matmul(b, &l->wo, &a->attn, &a->o);
        luma_model_residual_norm(m, &a->x, &a->o, NULL, &l->ffn_norm, &a->h);

        luma_model_ffn(m, &l->gate, &l->up, &l->down, LUMA_ACT_SILU, &a->h, &a->gate, &a->up, &a->o);
        const luma_weight *next = il + 1 < hp->n_layer ? &m->layers[il + 1].attn_norm : &m->output_norm;
        luma_model_residual_norm(m, &a->x, &a->o, NULL, next, luma_model_norm_out(m, step, il));
    }
    luma_model_gather_out(m, step);
    return be->sync(b, err);
}

const luma_arch luma_arch_llama = { "llama", llama_load, llama_forward };
const luma_arch luma_arch_qwen2 = { "qwen2", qwen2_load, llama_forward };
