/* Residual norms joined to the activation quantizer of the product after
 * them (cuda_backend.pend_norm, matmul.cu norm_quantize), and decode
 * attention quantizing o's input itself (cuda_backend.pend_attn,
 * decode_lean_kernel's attn_args.qo), against the kernels they replace,
 * and against the CPU.
 *
 * Three synthetic models in the Q4_K_M mix, each written first (the
 * vocabulary from $LUMA_VOCAB, else the shared llama-spm one beside the
 * repository, else the default model's):
 *   gemma3 640   Gemma 3 270M's width: Q5_0 and Q8_0 products over 640
 *                columns (8-bit activations in blocks of 32, a float4 a
 *                thread of the row);
 *   llama 4096   the 7B's layer shape: Q4_K and Q6_K (activations in
 *                superblocks of 256, four float4s a thread), q and k
 *                rotated by the product (qkv_rope);
 *   llama 256    tiny-llama's width (superblocks, one float4 a thread).
 * Each runs, on one sequence and on four side by side, a prompt and then
 * single-token steps of forced tokens, on:
 *   off    the GPU with the norms, the attentions and the quantizers
 *          launched alone (LUMA_CUDA_NORM_QUANT=0, LUMA_CUDA_ATTN_QUANT=0);
 *   on     the GPU with them joined (the default), recorded steps replayed;
 *   eager  a second GPU copy with them joined and CUDA graphs off.
 * Checks: the joined kernels ran (in the eager run, at least one norm a
 * layer at every step, and on one sequence an attention a layer at every
 * single-token step where the model's heads make whole blocks of o's
 * activations) and not while off; on and eager equal off bit for bit (the
 * same norm, attention and quantization, in the same order); off's top-1
 * agrees with the CPU's at most steps (the GPU itself is checked against
 * the CPU in test_cuda). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"
#include "synth.h"
#include "testutil.h"

long long luma_cuda_norm_quants(luma_backend *be);
void luma_cuda_set_norm_quant(luma_backend *be, bool on);
long long luma_cuda_attn_quants(luma_backend *be);
void luma_cuda_set_attn_quant(luma_backend *be, bool on);

#define PROMPT 12
#define STEPS 16
#define MAX_SEQS 4

/* n_seqs new sequences of m, each given the prompt (all in one step), then
 * STEPS steps of one forced token a sequence: every step's logits into out
 * ([STEPS][n_seqs][n_vocab]). */
static bool run(luma_model *m, int n_seqs, float *out, const char *name)
{
    int32_t nv = m->hp.n_vocab, ids[MAX_SEQS][PROMPT + STEPS];
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < PROMPT + STEPS; i++) ids[s][i] = (int32_t)((i * 7919 + 101 + 613 * s) % nv);
    return luma_test_forced_steps(m, n_seqs, &ids[0][0], PROMPT, STEPS, out, name);
}

/* attn: whether the attention quantizes o's input on one sequence (the
 * model's heads of a CTA make whole blocks of the activations) */
static void check_model(const luma_synth_params *sp, const char *label, bool attn)
{
    char path[256];
    snprintf(path, sizeof path, "/tmp/luma-normq-%d.gguf", (int)getpid());
    luma_model *m[3];
    if (!luma_test_load_three(sp, path, 256, 64, 0, m, label)) return;
    luma_model *cpu = m[0], *gpu = m[1], *eager = m[2];
    int32_t nv = cpu->hp.n_vocab;
    for (int n_seqs = 1; n_seqs <= MAX_SEQS; n_seqs += MAX_SEQS - 1) {
        size_t n = (size_t)STEPS * (size_t)n_seqs * (size_t)nv;
        float *lc = xmalloc(n * sizeof(float)), *loff = xmalloc(n * sizeof(float)), *lon = xmalloc(n * sizeof(float)),
              *leg = xmalloc(n * sizeof(float));
        luma_cuda_set_norm_quant(gpu->be, false);
        luma_cuda_set_attn_quant(gpu->be, false);
        long long j0 = luma_cuda_norm_quants(gpu->be), a0 = luma_cuda_attn_quants(gpu->be);
        bool ok = run(cpu, n_seqs, lc, "cpu") && run(gpu, n_seqs, loff, "off");
        long long j1 = luma_cuda_norm_quants(gpu->be), a1 = luma_cuda_attn_quants(gpu->be);
        luma_cuda_set_norm_quant(gpu->be, true);
        luma_cuda_set_attn_quant(gpu->be, true);
        ok = ok && run(gpu, n_seqs, lon, "on");
        long long j2 = luma_cuda_norm_quants(gpu->be), e0 = luma_cuda_norm_quants(eager->be);
        long long a2 = luma_cuda_attn_quants(gpu->be), f0 = luma_cuda_attn_quants(eager->be);
        ok = ok && run(eager, n_seqs, leg, "eager");
        long long e1 = luma_cuda_norm_quants(eager->be), f1 = luma_cuda_attn_quants(eager->be);
        if (ok) {
            int agree = 0;
            for (int r = 0; r < STEPS * n_seqs; r++)
                agree += argmax(lc + (size_t)r * (size_t)nv, nv) == argmax(loff + (size_t)r * (size_t)nv, nv);
            size_t d_on = luma_test_bits_differ(loff, lon, n), d_eager = luma_test_bits_differ(loff, leg, n);
            printf("%s, %d sequences: norms joined %lld (off) / %lld (on, recorded) / %lld (eager, %d steps), "
                   "attentions %lld / %lld / %lld; on and eager against off: %zu and %zu logits differ; top-1 with "
                   "the CPU at %d of %d rows\n",
                   label, n_seqs, j1 - j0, j2 - j1, e1 - e0, STEPS, a1 - a0, a2 - a1, f1 - f0, d_on, d_eager, agree,
                   STEPS * n_seqs);
            CHECKF(j1 == j0, "%s: %lld norms joined while off", label, j1 - j0);
            CHECKF(a1 == a0, "%s: %lld attentions joined while off", label, a1 - a0);
            if (attn && n_seqs == 1) {
                CHECKF(a2 > a1, "%s: no attention joined while on", label);
                CHECKF(f1 - f0 == (long long)STEPS * sp->n_layer, "%s: the eager run joined %lld attentions in %d "
                       "steps of %d layers", label, f1 - f0, STEPS, sp->n_layer);
            } else {
                CHECKF(f1 == f0 && a2 == a1, "%s, %d sequences: %lld attentions joined", label, n_seqs,
                       f1 - f0 + a2 - a1);
            }
            CHECKF(j2 > j1, "%s: no norm joined while on", label);
            CHECKF(e1 - e0 >= (long long)STEPS * sp->n_layer, "%s: the eager run joined %lld norms in %d steps of %d "
                   "layers", label, e1 - e0, STEPS, sp->n_layer);
            CHECKF(d_on == 0, "%s, %d sequences: %zu logits differ joined against not", label, n_seqs, d_on);
            CHECKF(d_eager == 0, "%s, %d sequences: %zu logits differ eager against off", label, n_seqs, d_eager);
            CHECKF(agree * 4 >= STEPS * n_seqs * 3, "%s: top-1 with the CPU at %d of %d rows", label, agree,
                   STEPS * n_seqs);
        }
        free(lc);
        free(loff);
        free(lon);
        free(leg);
    }
    luma_test_free_three(m, path);
}

int main(void)
{
    static char vocab[1024];
    const int start = luma_test_gpu_start("test_cuda_normq", vocab, sizeof vocab);
    if (start >= 0) return start;
    const luma_synth_params models[] = {
        { .arch = "gemma3", .n_layer = 3, .n_embd = 640, .n_head = 4, .n_kv_head = 1, .head_dim = 256, .n_ff = 2048,
          .n_ctx = 4096, .seed = 23, .vocab_path = vocab },
        { .arch = "llama", .n_layer = 2, .n_embd = 4096, .n_head = 32, .n_kv_head = 8, .head_dim = 128,
          .n_ff = 14336, .n_ctx = 4096, .rope_base = 500000.0f, .seed = 29, .vocab_path = vocab },
        { .arch = "llama", .n_layer = 2, .n_embd = 256, .n_head = 4, .n_kv_head = 2, .head_dim = 64, .n_ff = 512,
          .n_ctx = 2048, .rope_base = 10000.0f, .seed = 31, .vocab_path = vocab },
    };
    const char *labels[] = { "gemma3 640", "llama 4096", "llama 256" };
    /* llama 256: two heads of 64 a kv head, 128 columns, not a super-block
     * of the K formats' activations */
    const bool attn[] = { true, true, false };
    for (int i = 0; i < 3; i++) check_model(&models[i], labels[i], attn[i]);
    if (failures) {
        printf("test_cuda_normq: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_normq: all checks passed\n");
    return 0;
}
