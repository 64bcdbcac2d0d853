/* Products of one shape on cuBLAS as one batched GEMM (matmul.cu,
 * tensor_gemm_batched: k and v, gate and up of Gemma 3's 640-wide layers
 * past the matrix-vector path), against one GEMM each, and against the CPU.
 *
 * A synthetic Gemma 3 of 270M's width (Q5_0 and Q8_0 products over 640
 * columns, whose products past 8 rows are cuBLAS's on the weights'
 * resident f16 copies) runs, on 16 and on 40 sequences side by side, a
 * prompt and then single-token steps of forced tokens, on:
 *   off    the GPU with one GEMM a product (luma_cuda_set_gemm_batch);
 *   on     the GPU with the batched GEMMs (the default), recorded steps
 *          replayed;
 *   eager  a second GPU copy with the batched GEMMs and CUDA graphs off.
 * Checks: batched GEMMs ran (in the eager run, at least one a layer at
 * every step) and not while off; on equals eager bit for bit (the same
 * GEMMs, recorded or not); on against off within float rounding (cuBLAS
 * may choose another kernel for the batch: the sums' order may differ),
 * and the same top-1; off's top-1 agrees with the CPU's at most rows. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"
#include "synth.h"
#include "testutil.h"

long long luma_cuda_gemm_batches(luma_backend *be);
void luma_cuda_set_gemm_batch(luma_backend *be, bool on);

#define PROMPT 12
#define STEPS 8
#define MAX_SEQS 40
#define KV_BYTES ((int64_t)64 << 20)   /* 40 sequences of 20 tokens, and more */

static bool run(luma_model *m, int n_seqs, float *out, const char *name)
{
    int32_t nv = m->hp.n_vocab;
    int32_t *ids = xmalloc((size_t)n_seqs * (PROMPT + STEPS) * sizeof(int32_t));
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < PROMPT + STEPS; i++) ids[s * (PROMPT + STEPS) + i] = (int32_t)((i * 7919 + 101 + 613 * s) % nv);
    bool ok = luma_test_forced_steps(m, n_seqs, ids, PROMPT, STEPS, out, name);
    free(ids);
    return ok;
}

int main(void)
{
    static char vocab[1024];
    const int start = luma_test_gpu_start("test_cuda_gemm_batch", vocab, sizeof vocab);
    if (start >= 0) return start;
    const char *env = getenv("LUMA_CUDA_GEMM_BATCH");
    if (env && strcmp(env, "0") == 0) {
        printf("test_cuda_gemm_batch: FAIL: LUMA_CUDA_GEMM_BATCH=0 turns off what this test checks\n");
        return 1;
    }
    const luma_synth_params sp = { .arch = "gemma3", .n_layer = 3, .n_embd = 640, .n_head = 4, .n_kv_head = 1,
                                   .head_dim = 256, .n_ff = 2048, .n_ctx = 4096, .seed = 37, .vocab_path = vocab };
    char path[256];
    snprintf(path, sizeof path, "/tmp/luma-gemm-batch-%d.gguf", (int)getpid());
    luma_model *m[3];
    if (!luma_test_load_three(&sp, path, 256, MAX_SEQS * PROMPT, KV_BYTES, m, "gemma3 640")) {
        printf("test_cuda_gemm_batch: %d failures\n", failures);
        return 1;
    }
    luma_model *cpu = m[0], *gpu = m[1], *eager = m[2];
    int32_t nv = cpu->hp.n_vocab;
    const int seq_counts[] = { 16, MAX_SEQS };
    for (int t = 0; t < 2; t++) {
        const int n_seqs = seq_counts[t];
        size_t n = (size_t)STEPS * (size_t)n_seqs * (size_t)nv;
        float *lc = xmalloc(n * sizeof(float)), *loff = xmalloc(n * sizeof(float)), *lon = xmalloc(n * sizeof(float)),
              *leg = xmalloc(n * sizeof(float));
        luma_cuda_set_gemm_batch(gpu->be, false);
        long long b0 = luma_cuda_gemm_batches(gpu->be);
        bool ok = run(cpu, n_seqs, lc, "cpu") && run(gpu, n_seqs, loff, "off");
        long long b1 = luma_cuda_gemm_batches(gpu->be);
        luma_cuda_set_gemm_batch(gpu->be, true);
        ok = ok && run(gpu, n_seqs, lon, "on");
        long long b2 = luma_cuda_gemm_batches(gpu->be), e0 = luma_cuda_gemm_batches(eager->be);
        ok = ok && run(eager, n_seqs, leg, "eager");
        long long e1 = luma_cuda_gemm_batches(eager->be);
        if (ok) {
            int agree = 0, same_top = 0;
            double worst = 0.0;
            for (int r = 0; r < STEPS * n_seqs; r++) {
                const float *c = lc + (size_t)r * (size_t)nv, *f = loff + (size_t)r * (size_t)nv,
                            *o = lon + (size_t)r * (size_t)nv;
                agree += argmax(c, nv) == argmax(f, nv);
                same_top += argmax(f, nv) == argmax(o, nv);
                float scale = 0.0f;
                for (int32_t i = 0; i < nv; i++) scale = fmaxf(scale, fabsf(f[i]));
                for (int32_t i = 0; i < nv; i++) {
                    double d = fabs((double)f[i] - (double)o[i]) / (scale > 0.0f ? scale : 1.0f);
                    if (d > worst) worst = d;
                }
            }
            size_t d_eager = luma_test_bits_differ(lon, leg, n);
            printf("gemma3 640, %d sequences: batched GEMMs %lld (off) / %lld (on, recorded) / %lld (eager, %d steps); "
                   "on against off: largest difference %.2e of the row's largest logit, top-1 the same at %d of %d "
                   "rows; eager against on: %zu logits differ; top-1 with the CPU at %d of %d rows\n",
                   n_seqs, b1 - b0, b2 - b1, e1 - e0, STEPS, worst, same_top, STEPS * n_seqs, d_eager, agree,
                   STEPS * n_seqs);
            CHECKF(b1 == b0, "%lld batched GEMMs while off", b1 - b0);
            CHECKF(b2 > b1, "%d sequences: no batched GEMM while on", n_seqs);
            CHECKF(e1 - e0 >= (long long)STEPS * sp.n_layer, "%d sequences: the eager run batched %lld GEMMs in %d "
                   "steps of %d layers", n_seqs, e1 - e0, STEPS, sp.n_layer);
            CHECKF(worst < 1e-4, "%d sequences: on against off differ by %.2e of a row's largest logit", n_seqs, worst);
            CHECKF(same_top * 100 >= STEPS * n_seqs * 99, "%d sequences: top-1 the same at %d of %d rows", n_seqs,
                   same_top, STEPS * n_seqs);
            CHECKF(d_eager == 0, "%d sequences: %zu logits differ eager against recorded", n_seqs, d_eager);
            CHECKF(agree * 4 >= STEPS * n_seqs * 3, "%d sequences: top-1 with the CPU at %d of %d rows", n_seqs, agree,
                   STEPS * n_seqs);
        }
        free(lc);
        free(loff);
        free(lon);
        free(leg);
    }
    luma_test_free_three(m, path);
    if (failures) {
        printf("test_cuda_gemm_batch: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_gemm_batch: all checks passed\n");
    return 0;
}
