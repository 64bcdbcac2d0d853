/* Recorded decode steps (CUDA graphs) against the same steps run eagerly.
 *
 * Two copies of one model on the GPU, the second loaded with
 * LUMA_CUDA_GRAPHS=0, decode the same tokens in lockstep for several batch
 * sizes; their logits must be equal (the same kernels run with the same
 * arguments, recorded or not). Synthetic gemma3 and llama models (sliding
 * windows, GQA, the Q4_K_M mix; a gemma3 of Q8_0 with heads of 256, as
 * Gemma 3 270M's) are written first, so the test needs no
 * download; their vocabulary comes from $LUMA_VOCAB, else the shared
 * llama-spm vocabulary beside the repository, else the default model
 * (testutil.h, luma_test_vocab_path). Then times a decode step of
 * each batch size both ways, and checks when a shape is recorded and that
 * many shapes keep their recordings. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "synth.h"
#include "testutil.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define MAX_B 24
#define STEPS 40

/* B sequences of different prompt lengths on both models, then steps
 * decode steps in lockstep; returns the largest |difference| of logits. */
static double lockstep(luma_model *m[2], int B, int steps, double *step_ms)
{
    luma_err err = { { 0 } };
    int32_t nv = m[0]->hp.n_vocab;
    luma_seq *s[2][MAX_B] = { { NULL } };
    float *lg[2];
    lg[0] = xmalloc((size_t)B * (size_t)nv * sizeof(float));
    lg[1] = xmalloc((size_t)B * (size_t)nv * sizeof(float));
    int32_t tok[MAX_B], prompt[96];
    double worst = 0.0;
    luma_chunk c[2][MAX_B];
    for (int i = 0; i < 96; i++) prompt[i] = 1 + (int32_t)(rnd() % (uint64_t)(nv - 1));
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < B; i++) {
            if (!(s[k][i] = luma_seq_new(m[k], &err))) {
                CHECKF(0, "a sequence: %s", err.msg);
                goto done;
            }
            c[k][i] = (luma_chunk){ s[k][i], prompt, 5 + (i * 7) % 90, false };
        }
        if (luma_model_run(m[k], c[k], B, lg[k], &err) != 0) {
            CHECKF(0, "prompts: %s", err.msg);
            goto done;
        }
    }
    for (int t = 0; t < steps; t++) {
        for (int i = 0; i < B; i++) tok[i] = argmax(lg[0] + (size_t)i * (size_t)nv, nv);
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < B; i++) c[k][i] = (luma_chunk){ s[k][i], &tok[i], 1, false };
            double t0 = now_s();
            if (luma_model_run(m[k], c[k], B, lg[k], &err) != 0) {
                CHECKF(0, "decode step %d of %d sequences (%s): %s", t, B, k ? "eager" : "graphs", err.msg);
                goto done;
            }
            if (t >= steps / 2) step_ms[k] += (now_s() - t0) * 1e3 / (steps - steps / 2);
        }
        for (size_t j = 0; j < (size_t)B * (size_t)nv; j++) {
            double d = fabs((double)lg[0][j] - (double)lg[1][j]);
            if (!(d <= worst)) worst = d;
        }
    }
done:
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < B; i++) luma_seq_free(s[k][i]);
    free(lg[0]);
    free(lg[1]);
    return worst;
}

/* cuda/backend.cu: how many steps have been recorded, and replayed; how
 * many recordings were given up (a scratch buffer had to grow) */
void luma_cuda_graph_counts(luma_backend *be, long long *recorded, long long *replays);
long long luma_cuda_graph_failures(luma_backend *be);

/* B new sequences of one 20-token prompt, then n decode steps of them: the
 * recordings and replays those steps made. */
static void shape_steps(luma_model *m, int B, int n, long long *rec, long long *rep)
{
    luma_err err = { { 0 } };
    int32_t nv = m->hp.n_vocab, prompt[20], tok[48];
    luma_seq *s[48] = { NULL };
    luma_chunk c[48];
    float *lg = xmalloc((size_t)B * (size_t)nv * sizeof(float));
    long long r0 = 0, p0 = 0, r1 = 0, p1 = 0;
    *rec = *rep = -1;
    for (int i = 0; i < 20; i++) prompt[i] = 1 + i;
    for (int i = 0; i < B; i++) {
        if (!(s[i] = luma_seq_new(m, &err))) {
            CHECKF(0, "a sequence: %s", err.msg);
            goto done;
        }
        c[i] = (luma_chunk){ s[i], prompt, 20, false };
    }
    if (luma_model_run(m, c, B, lg, &err) != 0) {
        CHECKF(0, "prompts of %d sequences: %s", B, err.msg);
        goto done;
    }
    luma_cuda_graph_counts(m->be, &r0, &p0);
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < B; i++) {
            tok[i] = 1 + (i + t) % (nv - 1);
            c[i] = (luma_chunk){ s[i], &tok[i], 1, false };
        }
        if (luma_model_run(m, c, B, lg, &err) != 0) {
            CHECKF(0, "decode step of %d sequences: %s", B, err.msg);
            goto done;
        }
    }
    luma_cuda_graph_counts(m->be, &r1, &p1);
    *rec = r1 - r0;
    *rep = p1 - p0;
done:
    for (int i = 0; i < B; i++) luma_seq_free(s[i]);
    free(lg);
}

/* The recording rule (cuda_internal.h, CUDA_GRAPHS): a new shape is
 * recorded at its first step and replayed from then on, and a scheduler's
 * many shapes (here 37 batch sizes) do not push out the ones before them
 * (with 32 slots, as before, they did). */
static void test_rule(luma_model *m, const char *preset)
{
    if (getenv("LUMA_CUDA_GRAPH_AFTER") || getenv("LUMA_CUDA_GRAPH_SLOTS")) {
        printf("%s: the recording rule not checked (LUMA_CUDA_GRAPH_AFTER or _SLOTS set)\n", preset);
        return;
    }
    long long rec, rep;
    /* the largest first, so that no buffer grows (and no recording goes
     * stale) later; 5 sequences are a shape lockstep did not make */
    shape_steps(m, 42, 1, &rec, &rep);
    shape_steps(m, 5, 3, &rec, &rep);
    CHECKF(rec == 1 && rep == 3, "%s: 3 steps of a new shape made %lld recordings and %lld replays, not 1 and 3",
           preset, rec, rep);
    /* 37 shapes more (lockstep's 8, 17 and 24 among them, already
     * recorded): every step replayed, each recorded once at most */
    int others = 0;
    for (int B = 6; B <= 42; B++) {
        shape_steps(m, B, 2, &rec, &rep);
        others += rec <= 1 && rep == 2;
    }
    CHECKF(others == 37, "%s: %d of 37 shapes replayed at both their steps", preset, others);
    shape_steps(m, 5, 1, &rec, &rep);
    CHECKF(rec == 0 && rep == 1, "%s: the first shape, after 37 others: %lld recordings and %lld replays, not 0 and 1 "
           "(its recording was given up)", preset, rec, rep);
    printf("%s: recording rule: a new shape recorded at once and replayed; 38 shapes kept\n", preset);
}

/* A sequence's chunk of several decoded rows (fewer than
 * LUMA_CUDA_PREFILL_MIN_ROWS: a short prompt, a speculated continuation
 * checked in one step), as speculative decoding runs them: a step of
 * CHUNK rows with every row's logits, rewound by all but one row, again
 * and again. Such a shape is recorded when it is seen again, not at first
 * sight, and its recorded steps equal the eager copy's bit for bit. */
#define CHUNK 9
static void test_chunks(luma_model *m[2], const char *preset)
{
    if (getenv("LUMA_CUDA_GRAPH_AFTER") || getenv("LUMA_CUDA_PREFILL_ROWS")) {
        printf("%s: the chunk rule not checked (LUMA_CUDA_GRAPH_AFTER or _PREFILL_ROWS set)\n", preset);
        return;
    }
    luma_err err = { { 0 } };
    int32_t nv = m[0]->hp.n_vocab, prompt[40], ids[CHUNK];
    luma_seq *s[2] = { NULL, NULL };
    float *lg[2] = { xmalloc((size_t)CHUNK * (size_t)nv * sizeof(float)),
                     xmalloc((size_t)CHUNK * (size_t)nv * sizeof(float)) };
    long long rec[4] = { 0 }, rep[4] = { 0 };
    double worst = 0.0;
    for (int i = 0; i < 40; i++) prompt[i] = 1 + (int32_t)(rnd() % (uint64_t)(nv - 1));
    for (int k = 0; k < 2; k++) {
        luma_chunk c = { NULL, prompt, 40, false };
        if (!(c.seq = s[k] = luma_seq_new(m[k], &err)) || luma_model_run(m[k], &c, 1, lg[k], &err) != 0) {
            CHECKF(0, "%s: a prompt of 40 tokens: %s", preset, err.msg);
            goto done;
        }
    }
    for (int t = 0; t < 4; t++) {
        for (int i = 0; i < CHUNK; i++) ids[i] = 1 + (int32_t)(rnd() % (uint64_t)(nv - 1));
        for (int k = 0; k < 2; k++) {
            luma_chunk c = { s[k], ids, CHUNK, true };
            long long r0 = 0, p0 = 0, r1 = 0, p1 = 0;
            luma_cuda_graph_counts(m[k]->be, &r0, &p0);
            if (luma_model_run(m[k], &c, 1, lg[k], &err) != 0 ||
                luma_seq_rewind(s[k], s[k]->n_tokens - (CHUNK - 1), &err) != 0) {
                CHECKF(0, "%s: a chunk of %d rows, step %d: %s", preset, CHUNK, t, err.msg);
                goto done;
            }
            luma_cuda_graph_counts(m[k]->be, &r1, &p1);
            if (k == 0) {
                rec[t] = r1 - r0;
                rep[t] = p1 - p0;
            }
        }
        for (size_t j = 0; j < (size_t)CHUNK * (size_t)nv; j++) {
            double d = fabs((double)lg[0][j] - (double)lg[1][j]);
            if (!(d <= worst)) worst = d;
        }
    }
    CHECKF(rec[0] == 0 && rep[0] == 0, "%s: a chunk's first step made %lld recordings and %lld replays, not 0 and 0",
           preset, rec[0], rep[0]);
    CHECKF(rec[1] == 1 && rep[1] == 1, "%s: a chunk's second step made %lld recordings and %lld replays, not 1 and 1",
           preset, rec[1], rep[1]);
    CHECKF(rec[2] == 0 && rep[2] == 1 && rec[3] == 0 && rep[3] == 1,
           "%s: a chunk's third and fourth steps made %lld, %lld recordings and %lld, %lld replays, not 0 and 1",
           preset, rec[2], rec[3], rep[2], rep[3]);
    CHECKF(worst == 0.0, "%s: chunks of %d rows recorded and eager differ by %g", preset, CHUNK, worst);
    printf("%s: chunks of %d rows: recorded at the second step, replayed after; max |graphs - eager| %.3g\n", preset,
           CHUNK, worst);
done:
    for (int k = 0; k < 2; k++) luma_seq_free(s[k]);
    free(lg[0]);
    free(lg[1]);
}

/* The load's warm-up steps (luma_backend.warmup: a prompt tile, then a
 * short chunk of the same sequence) leave nothing in the table of step
 * shapes: run again on a new sequence right after the load, each step is
 * a first sight, so none is recorded (a tile never is, a chunk of one
 * sequence at its second sight). */
static void test_warm(luma_model *m, const char *label)
{
    if (getenv("LUMA_CUDA_WARMUP") || getenv("LUMA_CUDA_GRAPH_AFTER") || getenv("LUMA_CUDA_PREFILL_ROWS")) {
        printf("%s: the warm-up not checked (LUMA_CUDA_WARMUP, _GRAPH_AFTER or _PREFILL_ROWS set)\n", label);
        return;
    }
    const int32_t *w = m->be->warmup;
    CHECKF(w[0] > 1 && w[1] > 1, "%s: the warm-up is steps of %d, %d rows, not two of several", label, w[0], w[1]);
    luma_err err = { { 0 } };
    int32_t nv = m->hp.n_vocab, ids[64];
    long long r0 = 0, p0 = 0, r1 = 0, p1 = 0;
    float *lg = xmalloc((size_t)nv * sizeof(float));
    luma_seq *s = luma_seq_new(m, &err);
    CHECKF(s != NULL, "%s: a sequence: %s", label, err.msg);
    luma_cuda_graph_counts(m->be, &r0, &p0);
    CHECKF(r0 == 0 && p0 == 0, "%s: the load left %lld recordings and %lld replays counted", label, r0, p0);
    for (int i = 0; s && i < LUMA_WARMUP_STEPS && w[i] > 0; i++) {
        int32_t n = w[i] < 64 ? w[i] : 64;
        for (int j = 0; j < n; j++) ids[j] = 1 + (int32_t)(rnd() % (uint64_t)(nv - 1));
        luma_chunk c = { s, ids, n, false };
        CHECKF(luma_model_run(m, &c, 1, lg, &err) == 0, "%s: the warm-up's step of %d rows again: %s", label, n,
               err.msg);
    }
    luma_cuda_graph_counts(m->be, &r1, &p1);
    CHECKF(r1 == r0 && p1 == p0, "%s: the warm-up's steps run again made %lld recordings and %lld replays, not 0",
           label, r1 - r0, p1 - p0);
    printf("%s: the warm-up's steps (%d, %d rows) run again: %lld recordings (none: the load left no trace)\n", label,
           w[0], w[1], r1 - r0);
    luma_seq_free(s);
    free(lg);
}

/* cuda/matmul.cu: how many launches made q, k and v by whole heads */
long long luma_cuda_qkv_heads(luma_backend *be);

/* preset's model, its heads head_dim wide (0: the preset's), its tensors
 * of mix (NULL: the preset's), named as label; with head_dim 256 and Q8_0,
 * both copies must make q, k and v by whole heads. */
static void test_model(const char *label, const char *preset, int head_dim, const char *mix, const char *vocab)
{
    luma_err err = { { 0 } };
    luma_synth_params sp;
    char path[256];
    snprintf(path, sizeof path, "/tmp/luma-graphs-%s-%d.gguf", label, (int)getpid());
    if (luma_synth_preset(preset, &sp, &err) != 0) {
        CHECKF(0, "%s: %s", preset, err.msg);
        return;
    }
    sp.seed = 7;
    sp.vocab_path = vocab;
    if (head_dim) sp.head_dim = head_dim;
    if (mix) sp.mix = mix;
    if (luma_synth_write(&sp, path, &err) != 0) {
        CHECKF(0, "writing %s: %s", label, err.msg);
        return;
    }
    luma_model *m[2] = { luma_test_load(path, "cuda", true, 1024, 64, (int64_t)512 << 20, &err), NULL };
    if (m[0]) m[1] = luma_test_load(path, "cuda", false, 1024, 64, (int64_t)512 << 20, &err);
    if (!m[0] || !m[1]) {
        CHECKF(0, "loading %s on the GPU: %s", label, err.msg);
    } else {
        test_warm(m[0], label);
        if (head_dim == 256 && mix && strcmp(mix, "q8_0") == 0) {
            /* first (no buffer has grown yet), one sequence through 700
             * steps: its attention splits grow their scratch as the
             * context does, so some recordings fail and the step runs
             * eagerly, then is recorded again (each a forward of its own,
             * which makes the angles again) */
            const long long failed = luma_cuda_graph_failures(m[0]->be);
            double ms[2] = { 0, 0 };
            double d = lockstep(m, 1, 700, ms);
            const long long now = luma_cuda_graph_failures(m[0]->be);
            printf("%s: 1 sequence x 700 steps: max |graphs - eager| %.3g; %lld recordings given up\n", label, d,
                   now - failed);
            CHECKF(d == 0.0, "%s, 1 sequence x 700 steps: recorded and eager steps differ by %g", label, d);
            CHECKF(now > failed, "%s: no recording was given up over 700 steps (the case is not covered)", label);
            for (int k = 0; k < 2; k++)
                CHECKF(luma_cuda_qkv_heads(m[k]->be) > 0, "%s (%s): q, k and v were not made by whole heads", label,
                       k ? "eager" : "graphs");
        }
        static const int sizes[] = { 1, 2, 3, 8, 17, 24 };
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            double ms[2] = { 0, 0 };
            double d = lockstep(m, sizes[i], STEPS, ms);
            printf("%s: %2d sequences x %d steps: max |graphs - eager| %.3g; a step %.3f ms recorded, %.3f ms eager\n",
                   label, sizes[i], STEPS, d, ms[0], ms[1]);
            CHECKF(d == 0.0, "%s, %d sequences: recorded and eager steps differ by %g", label, sizes[i], d);
        }
        test_rule(m[0], label);
        test_chunks(m, label);
    }
    luma_model_free(m[0]);
    luma_model_free(m[1]);
    remove(path);
}

int main(void)
{
    rnd_seed(0x9e3779b97f4a7c15ULL);
    static char vocab[1024];
    const int start = luma_test_gpu_start("test_cuda_graphs", vocab, sizeof vocab);
    if (start >= 0) return start;
    test_model("tiny-gemma3", "tiny-gemma3", 0, NULL, vocab);
    /* Gemma 3 270M's heads of 256 and Q8_0 matrices: q, k and v made by
     * whole heads with their norms and rotations (cuda/matmul.cu,
     * mmv_heads), whose angles each forward makes once a rotation and the
     * later layers read, recordings that fail and are made again included */
    test_model("tiny-gemma3-h256-q8", "tiny-gemma3", 256, "q8_0", vocab);
    test_model("tiny-llama", "tiny-llama", 0, NULL, vocab);
    if (failures) {
        printf("test_cuda_graphs: %d failures\n", failures);
        return 1;
    }
    printf("test_cuda_graphs: all checks passed\n");
    return 0;
}
