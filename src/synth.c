/* Synthetic models (see synth.h): the presets, the tensor list of each
 * architecture, the tensor type each mix gives a tensor, and random rows of
 * each type, made while the file is written. */
#include "synth.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "quant.h"
#include "rng.h"

#define MAX_LAYERS 1024
#define MAX_DIM (1 << 20)
/* Tensors of one layer at most (gemma3: 13; qwen2: 9 and 3 biases), and the
 * three outside the layers. */
#define LAYER_TENSORS 13
#define GLOBAL_TENSORS 3

/* ---- presets ------------------------------------------------------------ */

typedef struct preset {
    const char *name;
    luma_synth_params p;
} preset;

#define SHAPE(a, layers, embd, heads, kv, hd, ff, ctx, window, base, tie) \
    { .arch = a, .n_layer = layers, .n_embd = embd, .n_head = heads, .n_kv_head = kv,   \
      .head_dim = hd, .n_ff = ff, .n_ctx = ctx, .swa_window = window, .rope_base = base, \
      .tied = tie }

/* The tiny ones run in milliseconds for tests: tiny-llama keeps a separate
 * output matrix, tiny-qwen2 ties it; tiny-gemma3 has one full-attention layer
 * after five sliding-window ones, a window short enough for a test prompt to
 * pass it, and heads wider than n_embd / n_head, as Gemma's are. The others
 * are real models' shapes, for benchmarks. */
static const preset presets[] = {
    { "tiny-llama", SHAPE("llama", 2, 256, 4, 2, 64, 512, 2048, 0, 10000.0f, false) },
    { "tiny-qwen2", SHAPE("qwen2", 2, 256, 4, 2, 64, 512, 2048, 0, 1000000.0f, true) },
    { "tiny-gemma3", SHAPE("gemma3", 6, 256, 4, 1, 128, 512, 2048, 64, 1000000.0f, true) },
    { "llama-1b", SHAPE("llama", 16, 2048, 32, 8, 64, 8192, 8192, 0, 500000.0f, true) },
    { "llama-7b", SHAPE("llama", 32, 4096, 32, 8, 128, 14336, 8192, 0, 500000.0f, false) },
    { "qwen2-0.5b", SHAPE("qwen2", 24, 896, 14, 2, 64, 4864, 32768, 0, 1000000.0f, true) },
    { "qwen2-7b", SHAPE("qwen2", 28, 3584, 28, 4, 128, 18944, 32768, 0, 1000000.0f, false) },
    { "gemma3-270m", SHAPE("gemma3", 18, 640, 4, 1, 256, 2048, 32768, 512, 1000000.0f, true) },
    { "gemma3-1b", SHAPE("gemma3", 26, 1152, 4, 1, 256, 6912, 32768, 512, 1000000.0f, true) },
};

#define N_PRESETS (int)(sizeof presets / sizeof presets[0])

const char *luma_synth_preset_name(int i)
{
    return i >= 0 && i < N_PRESETS ? presets[i].name : NULL;
}

int luma_synth_preset(const char *name, luma_synth_params *p, luma_err *err)
{
    for (int i = 0; i < N_PRESETS; i++) {
        if (name && strcmp(name, presets[i].name) == 0) {
            *p = presets[i].p;
            return 0;
        }
    }
    char list[256] = "";
    for (int i = 0; i < N_PRESETS; i++) {
        size_t len = strlen(list);
        snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", presets[i].name);
    }
    return luma_errf(err, "unknown synthetic model preset '%.64s' (known: %s)", name ? name : "(null)", list);
}

/* ---- mixes: which type each tensor gets ------------------------------- */

typedef struct mix {
    const char *name;
    uint32_t file_type;         /* general.file_type, llama.cpp's numbering */
    enum luma_type base;        /* most matrices */
    enum luma_type out;         /* output.weight, or token_embd when tied */
    bool more_bits;             /* attn_v and ffn_down of some layers in Q6_K */
} mix;

static const mix mixes[] = {
    { "q4_k_m", 15, LUMA_Q4_K, LUMA_Q6_K, true },
    { "q4_0", 2, LUMA_Q4_0, LUMA_Q6_K, false },
    { "q8_0", 7, LUMA_Q8_0, LUMA_Q8_0, false },
    { "f16", 1, LUMA_F16, LUMA_F16, false },
    { "f32", 0, LUMA_F32, LUMA_F32, false },
};

/* llama.cpp's use_more_bits: the first and last eighth of the layers and
 * every third one between them. */
static bool use_more_bits(int il, int n)
{
    return il < n / 8 || il >= 7 * n / 8 || (il - n / 8) % 3 == 2;
}

/* A K type needs rows of whole 256-element super-blocks; llama.cpp falls
 * back to a legacy type of about the same size otherwise. */
static enum luma_type fit_row(enum luma_type t, int64_t cols)
{
    if (cols % LUMA_QK_K == 0) return t;
    if (t == LUMA_Q4_K) return LUMA_Q5_0;
    if (t == LUMA_Q6_K) return LUMA_Q8_0;
    return t;
}

/* ---- random rows -------------------------------------------------------- */

enum fill_kind { FILL_MATRIX, FILL_GAIN, FILL_BIAS };

typedef struct synth_tensor {
    char name[64];
    enum luma_type type;
    uint32_t n_dims;
    int64_t ne[2];              /* cols, rows */
    enum fill_kind kind;
    uint64_t seed;
} synth_tensor;

static void random_bytes(luma_rng *r, void *dst, size_t n)
{
    uint8_t *p = dst;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v = luma_rng_next_u64(r);
        memcpy(p, &v, 8);
    }
    if (n) {
        uint64_t v = luma_rng_next_u64(r);
        memcpy(p, &v, n);
    }
}

static float uniform(luma_rng *r, float lo, float hi)
{
    return lo + (hi - lo) * (float)luma_rng_uniform(r);
}

/* A block's scale: the one that gives the target deviation, times a random
 * factor in [0.75, 1.25) so that blocks differ (divided by its root mean
 * square, sqrt(1 + 1/48), to keep the deviation). */
static float block_scale(luma_rng *r, float unit)
{
    return unit * uniform(r, 0.75f, 1.25f) / 1.0104f;
}

/* The divisors below are the root mean square of a block's quant values
 * when its scale is 1, so d = sigma / divisor gives weights of deviation
 * sigma. The most negative value of the symmetric formats is left out, as a
 * quantizer leaves it to the one extreme weight of a block, so that rows
 * have mean zero. Q8_0: uniform in [-127, 127]. */
static void row_q8_0(luma_rng *r, luma_block_q8_0 *b, int64_t nb, float sigma)
{
    for (int64_t i = 0; i < nb; i++) {
        b[i].d = luma_f32_to_f16(block_scale(r, sigma / 73.6f));
        random_bytes(r, b[i].qs, sizeof b[i].qs);
        for (int j = 0; j < LUMA_QK; j++)
            if (b[i].qs[j] == -128) b[i].qs[j] = -127;
    }
}

/* Q4_0: nibble - 8 in [-7, 7], a nibble of 0 (-8) turned into 8 (0). */
static void row_q4_0(luma_rng *r, luma_block_q4_0 *b, int64_t nb, float sigma)
{
    for (int64_t i = 0; i < nb; i++) {
        b[i].d = luma_f32_to_f16(block_scale(r, sigma / 4.183f));
        random_bytes(r, b[i].qs, sizeof b[i].qs);
        for (int j = 0; j < LUMA_QK / 2; j++) {
            if ((b[i].qs[j] & 0x0f) == 0) b[i].qs[j] |= 0x08;
            if ((b[i].qs[j] & 0xf0) == 0) b[i].qs[j] |= 0x80;
        }
    }
}

/* Q5_0: five bits - 16 in [-15, 15], a -16 turned into 0 by setting its
 * high bit. */
static void row_q5_0(luma_rng *r, luma_block_q5_0 *b, int64_t nb, float sigma)
{
    for (int64_t i = 0; i < nb; i++) {
        b[i].d = luma_f32_to_f16(block_scale(r, sigma / 8.803f));
        random_bytes(r, b[i].qh, sizeof b[i].qh);
        random_bytes(r, b[i].qs, sizeof b[i].qs);
        for (int j = 0; j < LUMA_QK; j++) {
            int nibble = j < LUMA_QK / 2 ? b[i].qs[j] & 0x0f : b[i].qs[j - LUMA_QK / 2] >> 4;
            if (nibble == 0 && !(b[i].qh[j / 8] >> (j % 8) & 1)) b[i].qh[j / 8] |= (uint8_t)(1u << (j % 8));
        }
    }
}

/* Q4_K: sub-block j of 32 weights decodes as d * sc_j * q - dmin * m_j with q
 * in [0, 15]. Scales sc_j are random in [32, 63] and dmin = 8 d, so m_j =
 * round(sc_j * 7.5 / 8) centres each sub-block on zero; the weights are then
 * about d * sc_j * (q - 7.5), of root mean square 223 d. The eight 6-bit
 * scales and mins pack into 12 bytes: bytes 0-3 hold sc 0-3, bytes 4-7 m 0-3,
 * their top two bits the top bits of sc 4-7 and m 4-7, whose low four bits
 * fill bytes 8-11. */
static void row_q4_K(luma_rng *r, luma_block_q4_K *b, int64_t nb, float sigma)
{
    for (int64_t i = 0; i < nb; i++) {
        float d = block_scale(r, sigma / 223.1f);
        b[i].d = luma_f32_to_f16(d);
        b[i].dmin = luma_f32_to_f16(8.0f * d);
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = (uint8_t)(32 + luma_rng_next_u64(r) % 32);
            m[j] = (uint8_t)((sc[j] * 15 + 8) / 16);
        }
        for (int j = 0; j < 4; j++) {
            b[i].scales[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            b[i].scales[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            b[i].scales[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
        }
        random_bytes(r, b[i].qs, sizeof b[i].qs);
    }
}

/* Q6_K: d * scale_j * (q - 32), q in [0, 63] (root mean square 18.5), the
 * sixteen int8 scales of magnitude in [32, 127] (84.2) with random signs. */
static void row_q6_K(luma_rng *r, luma_block_q6_K *b, int64_t nb, float sigma)
{
    for (int64_t i = 0; i < nb; i++) {
        b[i].d = luma_f32_to_f16(block_scale(r, sigma / 1556.0f));
        for (int j = 0; j < LUMA_QK_K / 16; j++) {
            uint64_t v = luma_rng_next_u64(r);
            int mag = 32 + (int)(v % 96);
            b[i].scales[j] = (int8_t)(v >> 32 & 1 ? -mag : mag);
        }
        random_bytes(r, b[i].ql, sizeof b[i].ql);
        random_bytes(r, b[i].qh, sizeof b[i].qh);
    }
}

/* n values uniform in [lo, hi), as F32 or F16. */
static void row_float(luma_rng *r, enum luma_type t, void *dst, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++) {
        float v = uniform(r, lo, hi);
        if (t == LUMA_F16) ((uint16_t *)dst)[i] = luma_f32_to_f16(v);
        else ((float *)dst)[i] = v;
    }
}

/* A row of a matrix: weights of deviation 1/sqrt(cols), so that a product
 * with a normalized activation row has deviation about 1. Float rows are
 * uniform, of half-width sqrt(3) sigma. */
static void row_matrix(luma_rng *r, enum luma_type t, void *dst, int64_t cols)
{
    float sigma = 1.0f / sqrtf((float)cols);
    switch (t) {
    case LUMA_Q8_0: row_q8_0(r, dst, cols / LUMA_QK, sigma); break;
    case LUMA_Q4_0: row_q4_0(r, dst, cols / LUMA_QK, sigma); break;
    case LUMA_Q5_0: row_q5_0(r, dst, cols / LUMA_QK, sigma); break;
    case LUMA_Q4_K: row_q4_K(r, dst, cols / LUMA_QK_K, sigma); break;
    case LUMA_Q6_K: row_q6_K(r, dst, cols / LUMA_QK_K, sigma); break;
    default: row_float(r, t, dst, cols, -1.7320508f * sigma, 1.7320508f * sigma); break;
    }
}

/* Rows are seeded one by one from the tensor's seed, so the bytes do not
 * depend on how many rows the writer asks for at a time. */
static int fill_rows(void *ctx, int64_t row0, int64_t n_rows, void *dst, luma_err *err)
{
    const synth_tensor *t = ctx;
    size_t row_bytes = luma_row_size(t->type, t->ne[0]);
    for (int64_t i = 0; i < n_rows; i++) {
        luma_rng r;
        luma_rng_seed(&r, t->seed ^ (uint64_t)(row0 + i) * 0x9e3779b97f4a7c15u);
        void *out = (uint8_t *)dst + (size_t)i * row_bytes;
        switch (t->kind) {
        case FILL_MATRIX: row_matrix(&r, t->type, out, t->ne[0]); break;
        case FILL_GAIN: row_float(&r, LUMA_F32, out, t->ne[0], 0.8f, 1.2f); break;
        case FILL_BIAS: row_float(&r, LUMA_F32, out, t->ne[0], -0.5f, 0.5f); break;
        }
    }
    return 0;
}

/* ---- the model ---------------------------------------------------------- */

typedef struct plan {
    const luma_synth_params *p;
    const mix *mix;
    int64_t n_vocab;
    synth_tensor *tensors;
    int n;
} plan;

/* FNV-1a of the name, mixed with the seed: each tensor's numbers depend on
 * its name only, not on its place in the file. */
static uint64_t tensor_seed(uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325u;
    for (const char *c = name; *c; c++) h = (h ^ (uint8_t)*c) * 0x100000001b3u;
    return h ^ seed * 0xbf58476d1ce4e5b9u;
}

static void add(plan *pl, const char *name, enum fill_kind kind, enum luma_type type, int64_t cols,
                int64_t rows)
{
    synth_tensor *t = &pl->tensors[pl->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->kind = kind;
    t->type = kind == FILL_MATRIX ? fit_row(type, cols) : LUMA_F32;
    t->n_dims = kind == FILL_MATRIX ? 2 : 1;
    t->ne[0] = cols;
    t->ne[1] = rows;
    t->seed = tensor_seed(pl->p->seed, name);
}

static void add_layer(plan *pl, int il, const char *what, enum fill_kind kind, enum luma_type type,
                      int64_t cols, int64_t rows)
{
    char name[64];
    bool bias = kind == FILL_BIAS;
    snprintf(name, sizeof name, "blk.%d.%s.%s", il, what, bias ? "bias" : "weight");
    add(pl, name, kind, type, cols, rows);
}

/* The tensors of the architecture, with llama.cpp's names and shapes
 * (ne[0] = the row length). */
static void list_tensors(plan *pl)
{
    const luma_synth_params *p = pl->p;
    const mix *mx = pl->mix;
    bool gemma = strcmp(p->arch, "gemma3") == 0, qwen = strcmp(p->arch, "qwen2") == 0;
    bool tied = gemma || p->tied;
    int64_t E = p->n_embd, D = p->head_dim, F = p->n_ff;
    int64_t Q = (int64_t)p->n_head * D, KV = (int64_t)p->n_kv_head * D;

    add(pl, "token_embd.weight", FILL_MATRIX, tied ? mx->out : mx->base, E, pl->n_vocab);
    for (int il = 0; il < p->n_layer; il++) {
        enum luma_type wide = mx->more_bits && use_more_bits(il, p->n_layer) ? LUMA_Q6_K : mx->base;
        add_layer(pl, il, "attn_norm", FILL_GAIN, LUMA_F32, E, 1);
        add_layer(pl, il, "attn_q", FILL_MATRIX, mx->base, E, Q);
        add_layer(pl, il, "attn_k", FILL_MATRIX, mx->base, E, KV);
        add_layer(pl, il, "attn_v", FILL_MATRIX, wide, E, KV);
        if (qwen) {
            add_layer(pl, il, "attn_q", FILL_BIAS, LUMA_F32, Q, 1);
            add_layer(pl, il, "attn_k", FILL_BIAS, LUMA_F32, KV, 1);
            add_layer(pl, il, "attn_v", FILL_BIAS, LUMA_F32, KV, 1);
        }
        if (gemma) {
            add_layer(pl, il, "attn_q_norm", FILL_GAIN, LUMA_F32, D, 1);
            add_layer(pl, il, "attn_k_norm", FILL_GAIN, LUMA_F32, D, 1);
        }
        add_layer(pl, il, "attn_output", FILL_MATRIX, mx->base, Q, E);
        if (gemma) add_layer(pl, il, "post_attention_norm", FILL_GAIN, LUMA_F32, E, 1);
        add_layer(pl, il, "ffn_norm", FILL_GAIN, LUMA_F32, E, 1);
        add_layer(pl, il, "ffn_gate", FILL_MATRIX, mx->base, E, F);
        add_layer(pl, il, "ffn_up", FILL_MATRIX, mx->base, E, F);
        add_layer(pl, il, "ffn_down", FILL_MATRIX, wide, F, E);
        if (gemma) add_layer(pl, il, "post_ffw_norm", FILL_GAIN, LUMA_F32, E, 1);
    }
    add(pl, "output_norm.weight", FILL_GAIN, LUMA_F32, E, 1);
    if (!tied) add(pl, "output.weight", FILL_MATRIX, mx->out, E, pl->n_vocab);
}

static int check_params(const luma_synth_params *p, luma_err *err)
{
    if (!p->arch || (strcmp(p->arch, "llama") != 0 && strcmp(p->arch, "qwen2") != 0 &&
                     strcmp(p->arch, "gemma3") != 0))
        return luma_errf(err, "synth: unknown architecture '%.32s' (llama, qwen2 or gemma3)",
                         p->arch ? p->arch : "(null)");
    if (p->n_layer < 1 || p->n_layer > MAX_LAYERS)
        return luma_errf(err, "synth: n_layer %d is not in 1..%d", p->n_layer, MAX_LAYERS);
    if (p->n_embd < 1 || p->n_embd > MAX_DIM || p->n_ff < 1 || p->n_ff > MAX_DIM || p->n_head < 1 ||
        p->n_head > 1024 || p->n_kv_head < 1 || p->head_dim < 0 || p->head_dim > 1024 ||
        p->n_ctx < 0 || p->swa_window < 0)
        return luma_errf(err, "synth: sizes out of range (n_embd %d, n_ff %d, heads %d/%d, head_dim %d, "
                         "n_ctx %d, window %d)", p->n_embd, p->n_ff, p->n_head, p->n_kv_head, p->head_dim,
                         p->n_ctx, p->swa_window);
    if (p->n_head % p->n_kv_head != 0)
        return luma_errf(err, "synth: %d heads do not share %d KV heads evenly", p->n_head, p->n_kv_head);
    int32_t hd = p->head_dim ? p->head_dim : p->n_embd / p->n_head;
    if (hd < 2 || hd % 2 != 0)
        return luma_errf(err, "synth: head dimension %d must be even (RoPE rotates pairs)", hd);
    if (p->n_embd % LUMA_QK != 0 || p->n_ff % LUMA_QK != 0 || (int64_t)p->n_head * hd % LUMA_QK != 0 ||
        (int64_t)p->n_kv_head * hd % LUMA_QK != 0)
        return luma_errf(err, "synth: n_embd, n_ff and the attention widths must be multiples of %d",
                         LUMA_QK);
    if (!p->vocab_path) return luma_errf(err, "synth: no vocabulary file given");
    return 0;
}

/* Hyper-parameters under llama.cpp's keys, with the defaults filled in. */
static void write_meta(luma_gguf_writer *w, const plan *pl)
{
    const luma_synth_params *p = pl->p;
    bool gemma = strcmp(p->arch, "gemma3") == 0, llama = strcmp(p->arch, "llama") == 0;
    char key[96], name[128];
#define KEY(suffix) (snprintf(key, sizeof key, "%s.%s", p->arch, suffix), key)
    snprintf(name, sizeof name, "luma synthetic %s (%s, seed %" PRIu64 ")", p->arch, pl->mix->name, p->seed);
    luma_gguf_set_str(w, "general.architecture", p->arch);
    luma_gguf_set_str(w, "general.name", name);
    luma_gguf_set_u32(w, "general.file_type", pl->mix->file_type);
    if (pl->mix->base != LUMA_F16 && pl->mix->base != LUMA_F32)
        luma_gguf_set_u32(w, "general.quantization_version", 2);
    luma_gguf_set_u32(w, KEY("context_length"), (uint32_t)(p->n_ctx ? p->n_ctx : 4096));
    luma_gguf_set_u32(w, KEY("embedding_length"), (uint32_t)p->n_embd);
    luma_gguf_set_u32(w, KEY("block_count"), (uint32_t)p->n_layer);
    luma_gguf_set_u32(w, KEY("feed_forward_length"), (uint32_t)p->n_ff);
    luma_gguf_set_u32(w, KEY("attention.head_count"), (uint32_t)p->n_head);
    luma_gguf_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_kv_head);
    luma_gguf_set_u32(w, KEY("attention.key_length"), (uint32_t)p->head_dim);
    luma_gguf_set_u32(w, KEY("attention.value_length"), (uint32_t)p->head_dim);
    luma_gguf_set_u32(w, KEY("rope.dimension_count"), (uint32_t)p->head_dim);
    float base = p->rope_base > 0 ? p->rope_base : llama ? 10000.0f : 1000000.0f;
    float eps = p->eps > 0 ? p->eps : llama ? 1e-5f : 1e-6f;
    luma_gguf_set_f32(w, KEY("rope.freq_base"), base);
    luma_gguf_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), eps);
    if (gemma) luma_gguf_set_u32(w, KEY("attention.sliding_window"), (uint32_t)(p->swa_window ? p->swa_window : 512));
#undef KEY
}

/* Copies the tokenizer.* keys of the vocabulary file; the vocabulary size
 * is the length of its token list. */
static int copy_vocab(luma_gguf_writer *w, const char *path, int64_t *n_vocab, luma_err *err)
{
    luma_gguf *v;
    if (luma_gguf_open(path, &v, err)) return -1;
    const luma_gguf_value *tokens;
    if (luma_gguf_get_arr(v, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, err)) {
        luma_gguf_close(v);
        return -1;
    }
    if (!tokens || tokens->n == 0 || tokens->n > INT32_MAX) {
        luma_gguf_close(v);
        return luma_errf(err, "synth: %s has no usable tokenizer.ggml.tokens", path);
    }
    *n_vocab = (int64_t)tokens->n;
    for (uint64_t i = 0; i < v->n_kv; i++)
        if (v->kv[i].key.len > 10 && memcmp(v->kv[i].key.ptr, "tokenizer.", 10) == 0)
            luma_gguf_copy_kv(w, &v->kv[i]);
    luma_gguf_close(v);
    return 0;
}

int luma_synth_write(const luma_synth_params *params, const char *path, luma_err *err)
{
    if (check_params(params, err)) return -1;
    luma_synth_params p = *params;
    if (!p.head_dim) p.head_dim = p.n_embd / p.n_head;
    plan pl = { .p = &p };
    const char *mix_name = p.mix ? p.mix : "q4_k_m";
    for (size_t i = 0; i < sizeof mixes / sizeof mixes[0]; i++)
        if (strcmp(mix_name, mixes[i].name) == 0) pl.mix = &mixes[i];
    if (!pl.mix)
        return luma_errf(err, "synth: unknown mix '%.32s' (q4_k_m, q4_0, q8_0, f16 or f32)", mix_name);

    luma_gguf_writer *w = luma_gguf_writer_new();
    if (!w) return luma_errf(err, "out of memory");
    pl.tensors = calloc((size_t)p.n_layer * LAYER_TENSORS + GLOBAL_TENSORS, sizeof *pl.tensors);
    int rc = -1;
    if (!pl.tensors) {
        luma_errf(err, "out of memory");
        goto done;
    }
    write_meta(w, &pl);
    if (copy_vocab(w, p.vocab_path, &pl.n_vocab, err)) goto done;
    list_tensors(&pl);
    for (int i = 0; i < pl.n; i++) {
        synth_tensor *t = &pl.tensors[i];
        if (luma_gguf_add_tensor_fill(w, t->name, t->type, t->n_dims, t->ne, fill_rows, t, err)) goto done;
    }
    rc = luma_gguf_writer_save(w, path, err);
done:
    free(pl.tensors);
    luma_gguf_writer_free(w);
    return rc;
}
