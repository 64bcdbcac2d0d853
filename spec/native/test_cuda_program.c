/* Decode-step programs (cuda/program.cu) against the ordinary kernels, the
 * CPU, and themselves.
 *
 * A synthetic llama with the 7B's layer shape (4096 wide, 32 heads of 128,
 * 8 KV heads, FFN 14336) in the Q4_K_M mix, 4 layers (so that attn_v and
 * ffn_down are Q4_K in two layers and Q6_K in the others), written first;
 * its vocabulary comes from $LUMA_VOCAB, else the shared llama-spm
 * vocabulary beside the repository, else the default model's. The same
 * prompt and the same forced tokens then run, one decode step at a time,
 * on:
 *   cpu     the CPU backend;
 *   off     the GPU with programs off (the ordinary kernels);
 *   on      the GPU with programs on (they are off by default), recorded
 *           steps replayed;
 *   again   the same model and sequence shape once more;
 *   eager   a second GPU copy with programs on and CUDA graphs off.
 * Checks: programs ran (a program a layer at each eager step); `on`, `again` and
 * `eager` are equal bit for bit (a program's sums do not depend on timing,
 * recorded or not), and equal to `off` bit for bit (a program quantizes,
 * normalizes and adds up each row as the kernels do, in their order);
 * `on` is as close to the CPU as `off` is: the same top-1
 * at as many steps, give or take one, and a mean |logit difference| at most
 * 1.5 times off's plus 0.01 (both quantize the activations to 8 bits; a
 * one-step change of an 8-bit activation moves logits by up to about 1, so
 * the two GPU paths may differ as much as either differs from the CPU). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"
#include "synth.h"
#include "testutil.h"

long long luma_cuda_programs(luma_backend *be);
void luma_cuda_set_programs(luma_backend *be, bool on);

#define PROMPT 16
#define STEPS 24
#define RUNS 5

static const char *run_names[RUNS] = { "cpu", "off", "on", "again", "eager" };

/* The prompt, then STEPS single-token steps of the forced tokens, on a new
 * sequence of m: the logits of every decode step into out. */
static bool run(luma_model *m, const int32_t *ids, float *out, const char *name)
{
    return luma_test_forced_steps(m, 1, ids, PROMPT, STEPS, out, name);
}

int main(void)
{
    static char vocab[1024];
    const int start = luma_test_gpu_start("test_cuda_program", vocab, sizeof vocab);
    if (start >= 0) return start;
    luma_err err = { { 0 } };
    char path[256];
    snprintf(path, sizeof path, "/tmp/luma-program-%d.gguf", (int)getpid());
    luma_synth_params sp = { .arch = "llama", .n_layer = 4, .n_embd = 4096, .n_head = 32, .n_kv_head = 8,
                             .head_dim = 128, .n_ff = 14336, .n_ctx = 4096, .rope_base = 500000.0f,
                             .seed = 17, .vocab_path = vocab };
    if (luma_synth_write(&sp, path, &err) != 0) {
        printf("test_cuda_program: FAIL: writing the model: %s\n", err.msg);
        return 1;
    }
    luma_model *cpu = luma_test_load(path, "cpu", true, 256, 64, 0, &err), *gpu = NULL, *eager = NULL;
    if (cpu) gpu = luma_test_load(path, "cuda", true, 256, 64, 0, &err);
    if (gpu) eager = luma_test_load(path, "cuda", false, 256, 64, 0, &err);
    float *lg[RUNS] = { NULL };
    if (!cpu || !gpu || !eager) {
        CHECKF(0, "loading the model: %s", err.msg);
        goto done;
    }
    int32_t nv = cpu->hp.n_vocab, ids[PROMPT + STEPS];
    for (int i = 0; i < PROMPT + STEPS; i++) ids[i] = (int32_t)((i * 7919 + 101) % nv);
    for (int r = 0; r < RUNS; r++) lg[r] = xmalloc((size_t)STEPS * (size_t)nv * sizeof(float));

    bool ok = run(cpu, ids, lg[0], "cpu");
    luma_cuda_set_programs(gpu->be, false);
    long long p0 = luma_cuda_programs(gpu->be);
    ok = ok && run(gpu, ids, lg[1], "off");
    CHECKF(luma_cuda_programs(gpu->be) == p0, "programs ran while off (%lld)", luma_cuda_programs(gpu->be) - p0);
    luma_cuda_set_programs(gpu->be, true);
    ok = ok && run(gpu, ids, lg[2], "on");
    long long p1 = luma_cuda_programs(gpu->be);
    ok = ok && run(gpu, ids, lg[3], "again");
    luma_cuda_set_programs(eager->be, true);
    long long e0 = luma_cuda_programs(eager->be);
    ok = ok && run(eager, ids, lg[4], "eager");
    long long e1 = luma_cuda_programs(eager->be);
    if (!ok) goto done;
    /* eager: a program a layer (attention between them) at every step */
    printf("programs: %lld launched by the recorded run, %lld by the eager run (%d steps)\n", p1 - p0, e1 - e0, STEPS);
    CHECKF(p1 > p0, "no program ran with programs on");
    CHECKF(e1 - e0 >= (long long)STEPS * 4, "the eager run launched %lld programs in %d steps of 4 layers", e1 - e0,
           STEPS);

    for (int r = 3; r < RUNS; r++) {
        size_t diff = luma_test_bits_differ(lg[2], lg[r], (size_t)STEPS * (size_t)nv);
        printf("%s against on: %zu logits differ\n", run_names[r], diff);
        CHECKF(diff == 0, "%s: %zu logits differ from the recorded run", run_names[r], diff);
    }
    int agree[RUNS] = { 0 };
    double mean[RUNS] = { 0 }, worst[RUNS] = { 0 };
    for (int r = 1; r <= 2; r++) {
        for (int t = 0; t < STEPS; t++) {
            const float *a = lg[0] + (size_t)t * (size_t)nv, *g = lg[r] + (size_t)t * (size_t)nv;
            agree[r] += argmax(a, nv) == argmax(g, nv);
            for (int32_t i = 0; i < nv; i++) {
                double d = fabs((double)a[i] - (double)g[i]);
                mean[r] += d;
                if (!(d <= worst[r])) worst[r] = d;
            }
        }
        mean[r] /= (double)STEPS * (double)nv;
        printf("%-5s against cpu: top-1 at %d of %d steps, mean |diff| %.4f, max %.4f\n", run_names[r], agree[r],
               STEPS, mean[r], worst[r]);
    }
    double onoff = 0.0;
    size_t ndiff = 0;
    for (size_t i = 0; i < (size_t)STEPS * (size_t)nv; i++) {
        onoff = fmax(onoff, fabs((double)lg[1][i] - (double)lg[2][i]));
        ndiff += memcmp(&lg[1][i], &lg[2][i], sizeof(float)) != 0;
    }
    printf("on against off: %zu logits differ, max |diff| %.4g\n", ndiff, onoff);
    CHECKF(ndiff == 0, "programs on against off: %zu logits differ (max %.4g)", ndiff, onoff);
    CHECKF(isfinite(mean[2]) && isfinite(worst[2]), "non-finite logits with programs on");
    CHECKF(agree[2] + 1 >= agree[1], "top-1 against the CPU: %d steps with programs, %d without", agree[2], agree[1]);
    CHECKF(mean[2] <= 1.5 * mean[1] + 0.01, "mean |diff| against the CPU: %.4f with programs, %.4f without",
           mean[2], mean[1]);
done:
    for (int r = 0; r < RUNS; r++) free(lg[r]);
    luma_model_free(eager);
    luma_model_free(gpu);
    luma_model_free(cpu);
    remove(path);
    if (failures) {
        printf("test_cuda_program: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_program: all checks passed\n");
    return 0;
}
