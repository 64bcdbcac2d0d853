/* Synthetic models: a GGUF file of a real architecture's shape (llama, qwen2,
 * gemma3) with random weights in real quantized formats and the vocabulary
 * of another GGUF file. They let tests check a forward pass on an
 * architecture without downloading a model of it, and benchmarks run shapes
 * too large to download.
 *
 * Weights are made from the seed straight as quantized blocks: random quants
 * under scales chosen so that each weight has a standard deviation of about
 * 1/sqrt(row length); norm gains are random around 1 (gemma3 files store
 * 1 + w, so around 1 too); qwen2's Q, K, V biases are small. The same
 * parameters give the same file, byte for byte. Tensors are made while the
 * file is written, a few MiB at a time, so a 7B model needs little memory.
 *
 * The tensor types follow llama.cpp's choice for the mix: "q4_k_m" puts most
 * matrices in Q4_K, attn_v and ffn_down of some layers and the output matrix
 * in Q6_K, and falls back to Q5_0 / Q8_0 where a row is not a multiple of
 * 256; "q4_0", "q8_0", "f16" and "f32" are uniform (q4_0's output is Q6_K).
 * Norms and biases are F32. */
#ifndef LUMA_SYNTH_H
#define LUMA_SYNTH_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"

typedef struct luma_synth_params {
    const char *arch;           /* "llama", "qwen2" or "gemma3" */
    int32_t n_layer, n_embd, n_head, n_kv_head;
    int32_t head_dim;           /* 0: n_embd / n_head */
    int32_t n_ff;
    int32_t n_ctx;              /* context_length written to the file; 0: 4096 */
    int32_t swa_window;         /* gemma3's sliding window; 0: 512 */
    float rope_base;            /* 0: the architecture's default */
    float eps;                  /* RMSNorm epsilon; 0: the architecture's default */
    bool tied;                  /* llama, qwen2: no output.weight (gemma3 always ties) */
    const char *mix;            /* "q4_k_m", "q4_0", "q8_0", "f16", "f32"; NULL: q4_k_m */
    uint64_t seed;
    const char *vocab_path;     /* GGUF file whose tokenizer.* keys are copied */
} luma_synth_params;

/* Fills p with the shape of a named preset ("tiny-llama", "llama-7b", ...;
 * see luma_synth_preset_name); mix is NULL, seed 0 and vocab_path NULL for
 * the caller to set. -1 for an unknown name, with the list in the message. */
int luma_synth_preset(const char *name, luma_synth_params *p, luma_err *err);
/* The i-th preset's name, from 0; NULL past the last. */
const char *luma_synth_preset_name(int i);

/* Writes the model to path (replacing it); on failure no file is left. */
int luma_synth_write(const luma_synth_params *p, const char *path, luma_err *err);

#endif
