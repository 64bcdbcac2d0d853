/* test_synth: synthetic models and the GGUF writer's streamed tensors.
 *
 * Pins down: each tiny preset (llama, qwen2, gemma3) writes a file whose
 * metadata, tensor names, types (llama.cpp's Q4_K_M choice) and shapes are
 * those of its architecture, whose weights have the intended spread, and
 * which luma loads and runs to finite logits of a sensible spread, over
 * more positions than tiny-gemma3's sliding window; the other mixes and the
 * fallback for rows that are not whole K super-blocks load and run too; the
 * same parameters give the same bytes (and, for each golden file in
 * spec/data made from a synthetic model, the very file it was made from,
 * when its vocabulary, the default model, is present); bad
 * parameters are refused without leaving a file; a streamed tensor is
 * written chunk by chunk and a failing fill ends the save.
 *
 * The vocabulary comes from the tokenizer test data when present, else from
 * the default model ($LUMA_MODEL, else ~/.cache/luma/models/...); with
 * neither, the test fails. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "model.h"
#include "quant.h"
#include "sha256.h"
#include "synth.h"
#define LUMA_TEST_TMPDIR
#include "testutil.h"

#define VOCAB_DIR LUMA_SOURCE_DIR "/../shared/testdata/tokenizer/"
#define SPM_VOCAB "ggml-vocab-llama-spm.gguf"

static bool exists(const char *path)
{
    return access(path, R_OK) == 0;
}

/* ---- one tiny preset: the file ------------------------------------------ */

typedef struct expect {
    const char *preset, *arch;
    int n_layer, n_embd, n_head, n_kv, head_dim, n_ff, window;
    bool tied, biases, gemma_norms;
    unsigned wide_layers;       /* bit il: attn_v and ffn_down in Q6_K */
} expect;

/* The shapes of synth.c's presets; wide layers are llama.cpp's
 * use_more_bits(il, n_layer) for Q4_K_M. */
static const expect tiny[] = {
    { "tiny-llama", "llama", 2, 256, 4, 2, 64, 512, 0, false, false, false, 1u << 1 },
    { "tiny-qwen2", "qwen2", 2, 256, 4, 2, 64, 512, 0, true, true, false, 1u << 1 },
    { "tiny-gemma3", "gemma3", 6, 256, 4, 1, 128, 512, 64, true, false, true, 1u << 2 | 1u << 5 },
};

static uint32_t meta_u32(const luma_gguf *g, const char *arch, const char *suffix)
{
    char key[128];
    luma_err err;
    uint32_t v = 0;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (luma_gguf_get_u32(g, key, 0, &v, &err) != 0) return 0;
    return v;
}

/* A tensor of this name, type and [cols, rows] (rows 0: a vector). */
static void check_tensor(const luma_gguf *g, const char *name, uint32_t type, int64_t cols, int64_t rows)
{
    const luma_gguf_tensor *t = luma_gguf_find_tensor(g, name);
    if (!t) {
        failures++;
        fprintf(stderr, "test_synth: tensor %s is missing\n", name);
        return;
    }
    bool ok = t->type == type && t->ne[0] == cols && (rows ? t->n_dims == 2 && t->ne[1] == rows : t->n_dims == 1);
    if (!ok) {
        failures++;
        fprintf(stderr, "test_synth: %s is %s [%lld, %lld], expected %s [%lld, %lld]\n", name,
                luma_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1], luma_type_name(type),
                (long long)cols, (long long)rows);
    }
}

static void check_layer_tensor(const luma_gguf *g, int il, const char *what, uint32_t type, int64_t cols,
                               int64_t rows)
{
    char name[96];
    size_t len = strlen(what);
    bool bias = len > 5 && strcmp(what + len - 5, ".bias") == 0;
    snprintf(name, sizeof name, bias ? "blk.%d.%s" : "blk.%d.%s.weight", il, what);
    check_tensor(g, name, type, cols, rows);
}

/* Mean and deviation of the first rows of a tensor, dequantized. */
static void row_stats(const luma_gguf_tensor *t, int64_t n_rows, double *mean, double *sd)
{
    int64_t cols = t->ne[0];
    size_t row = luma_row_size((enum luma_type)t->type, cols);
    float *x = malloc((size_t)cols * sizeof *x);
    double s = 0, s2 = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        luma_dequantize_row((enum luma_type)t->type, (const uint8_t *)t->data + (size_t)r * row, x, cols);
        for (int64_t i = 0; i < cols; i++) {
            s += x[i];
            s2 += (double)x[i] * x[i];
        }
    }
    free(x);
    double n = (double)(n_rows * cols);
    *mean = s / n;
    *sd = sqrt(s2 / n - *mean * *mean);
}

/* Matrices: mean near 0 and deviation within 10% of 1/sqrt(cols); norm
 * gains in [0.8, 1.2]; biases in [-0.5, 0.5]. */
static int check_spread(const luma_gguf *g)
{
    int bad = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        int64_t rows = t->n_dims == 2 ? (t->ne[1] < 64 ? t->ne[1] : 64) : 1;
        double mean, sd;
        row_stats(t, rows, &mean, &sd);
        bool ok;
        if (t->n_dims == 2) {
            double want = 1.0 / sqrt((double)t->ne[0]);
            ok = fabs(sd / want - 1.0) < 0.1 && fabs(mean) < 0.1 * want;
        } else {
            bool bias = t->name.len > 5 && memcmp(t->name.ptr + t->name.len - 5, ".bias", 5) == 0;
            ok = bias ? fabs(mean) < 0.1 && sd > 0.2 && sd < 0.35 : fabs(mean - 1.0) < 0.05 && sd > 0.05 && sd < 0.15;
        }
        if (!ok) {
            bad++;
            fprintf(stderr, "test_synth: %.*s: mean %.4f, deviation %.4f\n", (int)t->name.len, t->name.ptr,
                    mean, sd);
        }
    }
    return bad;
}

static void check_file(const expect *e, const char *path, int64_t n_vocab)
{
    luma_gguf *g = NULL;
    luma_err err;
    if (luma_gguf_open(path, &g, &err) != 0) {
        failures++;
        fprintf(stderr, "test_synth: %s: %s\n", path, err.msg);
        return;
    }
    luma_str arch;
    CHECK(luma_gguf_get_str(g, "general.architecture", &arch, &err) == 0 && luma_str_eq(arch, e->arch));
    uint32_t ft = 0;
    CHECK(luma_gguf_get_u32(g, "general.file_type", 0, &ft, &err) == 0 && ft == 15);
    CHECK(meta_u32(g, e->arch, "block_count") == (uint32_t)e->n_layer);
    CHECK(meta_u32(g, e->arch, "embedding_length") == (uint32_t)e->n_embd);
    CHECK(meta_u32(g, e->arch, "feed_forward_length") == (uint32_t)e->n_ff);
    CHECK(meta_u32(g, e->arch, "attention.head_count") == (uint32_t)e->n_head);
    CHECK(meta_u32(g, e->arch, "attention.head_count_kv") == (uint32_t)e->n_kv);
    CHECK(meta_u32(g, e->arch, "attention.key_length") == (uint32_t)e->head_dim);
    CHECK(meta_u32(g, e->arch, "attention.value_length") == (uint32_t)e->head_dim);
    CHECK(meta_u32(g, e->arch, "rope.dimension_count") == (uint32_t)e->head_dim);
    CHECK(meta_u32(g, e->arch, "context_length") > 0);
    CHECK(meta_u32(g, e->arch, "attention.sliding_window") == (uint32_t)e->window);
    char key[96];
    float base = 0, eps = 0;
    snprintf(key, sizeof key, "%s.rope.freq_base", e->arch);
    CHECK(luma_gguf_get_f32(g, key, 0, &base, &err) == 0 && base >= 10000.0f);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", e->arch);
    CHECK(luma_gguf_get_f32(g, key, 0, &eps, &err) == 0 && eps > 0 && eps <= 1e-5f);
    const luma_gguf_value *tokens;
    CHECK(luma_gguf_get_arr(g, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, &err) == 0 && tokens &&
          (int64_t)tokens->n == n_vocab);
    CHECK(luma_gguf_find(g, "tokenizer.ggml.model") != NULL);

    int64_t E = e->n_embd, F = e->n_ff, Q = (int64_t)e->n_head * e->head_dim;
    int64_t KV = (int64_t)e->n_kv * e->head_dim;
    uint64_t per_layer = 9 + (e->biases ? 3 : 0) + (e->gemma_norms ? 4 : 0);
    CHECK(g->n_tensors == per_layer * (uint64_t)e->n_layer + (e->tied ? 2 : 3));
    check_tensor(g, "token_embd.weight", e->tied ? LUMA_Q6_K : LUMA_Q4_K, E, n_vocab);
    check_tensor(g, "output_norm.weight", LUMA_F32, E, 0);
    if (e->tied) CHECK(luma_gguf_find_tensor(g, "output.weight") == NULL);
    else check_tensor(g, "output.weight", LUMA_Q6_K, E, n_vocab);
    for (int il = 0; il < e->n_layer; il++) {
        uint32_t wide = e->wide_layers >> il & 1 ? LUMA_Q6_K : LUMA_Q4_K;
        check_layer_tensor(g, il, "attn_norm", LUMA_F32, E, 0);
        check_layer_tensor(g, il, "attn_q", LUMA_Q4_K, E, Q);
        check_layer_tensor(g, il, "attn_k", LUMA_Q4_K, E, KV);
        check_layer_tensor(g, il, "attn_v", wide, E, KV);
        check_layer_tensor(g, il, "attn_output", LUMA_Q4_K, Q, E);
        check_layer_tensor(g, il, "ffn_norm", LUMA_F32, E, 0);
        check_layer_tensor(g, il, "ffn_gate", LUMA_Q4_K, E, F);
        check_layer_tensor(g, il, "ffn_up", LUMA_Q4_K, E, F);
        check_layer_tensor(g, il, "ffn_down", wide, F, E);
        if (e->biases) {
            check_layer_tensor(g, il, "attn_q.bias", LUMA_F32, Q, 0);
            check_layer_tensor(g, il, "attn_k.bias", LUMA_F32, KV, 0);
            check_layer_tensor(g, il, "attn_v.bias", LUMA_F32, KV, 0);
        }
        if (e->gemma_norms) {
            check_layer_tensor(g, il, "attn_q_norm", LUMA_F32, e->head_dim, 0);
            check_layer_tensor(g, il, "attn_k_norm", LUMA_F32, e->head_dim, 0);
            check_layer_tensor(g, il, "post_attention_norm", LUMA_F32, E, 0);
            check_layer_tensor(g, il, "post_ffw_norm", LUMA_F32, E, 0);
        }
    }
    int bad = check_spread(g);
    failures += bad;
    printf("test_synth: %s: %llu tensors, metadata, types, shapes and weight spread: %s\n", e->preset,
           (unsigned long long)g->n_tensors, bad ? "FAILED" : "ok");
    luma_gguf_close(g);
}

/* ---- running it --------------------------------------------------------- */

#define RUN_TOKENS 80   /* more than tiny-gemma3's window of 64 */

/* Loads the model and runs RUN_TOKENS tokens as one chunk, logits for each:
 * every logit finite, each row's deviation in [0.3, 5] and no logit beyond 50. */
static void check_runs(const char *label, const char *path)
{
    luma_model_params mp;
    luma_model_params_default(&mp);
    mp.backend = "cpu";
    mp.n_threads = 2;
    mp.n_ctx = 256;
    luma_model *m = NULL;
    luma_err err;
    if (luma_model_load(path, &mp, &m, &err) != 0) {
        failures++;
        fprintf(stderr, "test_synth: %s: load: %s\n", label, err.msg);
        return;
    }
    int32_t n_vocab = m->hp.n_vocab;
    int32_t ids[RUN_TOKENS];
    for (int i = 0; i < RUN_TOKENS; i++) ids[i] = (int32_t)((i * 7919 + 13) % n_vocab);
    float *logits = malloc((size_t)RUN_TOKENS * (size_t)n_vocab * sizeof *logits);
    luma_seq *s = luma_seq_new(m, &err);
    bool ok = logits && s;
    if (ok) {
        luma_chunk c = { s, ids, RUN_TOKENS, true };
        ok = luma_model_run(m, &c, 1, logits, &err) == 0;
        if (!ok) fprintf(stderr, "test_synth: %s: run: %s\n", label, err.msg);
    }
    double lo = INFINITY, hi = 0, peak = 0;
    for (int r = 0; ok && r < RUN_TOKENS; r++) {
        const float *x = logits + (size_t)r * (size_t)n_vocab;
        double s1 = 0, s2 = 0;
        for (int32_t i = 0; i < n_vocab; i++) {
            if (!isfinite(x[i])) ok = false;
            s1 += x[i];
            s2 += (double)x[i] * x[i];
            if (fabs(x[i]) > peak) peak = fabs(x[i]);
        }
        double sd = sqrt(s2 / n_vocab - (s1 / n_vocab) * (s1 / n_vocab));
        if (sd < lo) lo = sd;
        if (sd > hi) hi = sd;
    }
    ok = ok && lo >= 0.3 && hi <= 5.0 && peak < 50.0;
    if (!ok) failures++;
    printf("test_synth: %s: luma runs %d positions, logits finite, deviation %.2f..%.2f, |max| %.1f: %s\n",
           label, RUN_TOKENS, lo, hi, peak, ok ? "ok" : "FAILED");
    luma_seq_free(s);
    free(logits);
    luma_model_free(m);
}

/* ---- mixes, the row fallback, determinism, errors ------------------------ */

static luma_synth_params tiny_params(const char *preset, const char *vocab, const char *mix, uint64_t seed)
{
    luma_synth_params p;
    luma_err err;
    if (luma_synth_preset(preset, &p, &err) != 0) {
        failures++;
        fprintf(stderr, "test_synth: %s\n", err.msg);
    }
    p.vocab_path = vocab;
    p.mix = mix;
    p.seed = seed;
    return p;
}

static int write_model(const luma_synth_params *p, const char *path)
{
    luma_err err;
    if (luma_synth_write(p, path, &err) == 0) return 0;
    failures++;
    fprintf(stderr, "test_synth: write %s: %s\n", path, err.msg);
    return -1;
}

static uint32_t tensor_type(const char *path, const char *name)
{
    luma_gguf *g = NULL;
    luma_err err;
    uint32_t t = UINT32_MAX;
    if (luma_gguf_open(path, &g, &err) != 0) return t;
    const luma_gguf_tensor *x = luma_gguf_find_tensor(g, name);
    if (x) t = x->type;
    luma_gguf_close(g);
    return t;
}

static void test_mixes(const char *vocab)
{
    static const struct { const char *mix; uint32_t q, out; } mixes[] = {
        { "q4_0", LUMA_Q4_0, LUMA_Q6_K }, { "q8_0", LUMA_Q8_0, LUMA_Q8_0 },
        { "f16", LUMA_F16, LUMA_F16 }, { "f32", LUMA_F32, LUMA_F32 },
    };
    for (size_t i = 0; i < sizeof mixes / sizeof mixes[0]; i++) {
        luma_synth_params p = tiny_params("tiny-llama", vocab, mixes[i].mix, 5);
        p.n_layer = 1;
        p.tied = true;  /* one vocabulary-sized matrix: F32 ones are large */
        char path[LUMA_TEST_PATH_CAP];
        luma_test_tmp_path(path, "mix.gguf");
        if (write_model(&p, path) != 0) continue;
        CHECK(tensor_type(path, "blk.0.attn_q.weight") == mixes[i].q);
        CHECK(tensor_type(path, "blk.0.ffn_down.weight") == mixes[i].q);
        CHECK(tensor_type(path, "token_embd.weight") == mixes[i].out);
        char label[64];
        snprintf(label, sizeof label, "tiny-llama %s", mixes[i].mix);
        check_runs(label, path);
        remove(path);
    }

    /* Rows of 160 or 96 are not whole super-blocks: Q4_K falls back to
     * Q5_0, Q6_K to Q8_0, as llama.cpp does. */
    luma_synth_params p = { .arch = "llama", .n_layer = 1, .n_embd = 160, .n_head = 5, .n_kv_head = 1,
                            .n_ff = 96, .seed = 9, .vocab_path = vocab };
    char path[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(path, "fallback.gguf");
    if (write_model(&p, path) == 0) {
        CHECK(tensor_type(path, "blk.0.attn_q.weight") == LUMA_Q5_0);
        CHECK(tensor_type(path, "blk.0.attn_v.weight") == LUMA_Q8_0);
        CHECK(tensor_type(path, "blk.0.ffn_down.weight") == LUMA_Q8_0);
        CHECK(tensor_type(path, "output.weight") == LUMA_Q8_0);
        CHECK(tensor_type(path, "token_embd.weight") == LUMA_Q5_0);
        check_runs("160-wide llama, legacy fallbacks", path);
        remove(path);
    }
}

static bool same_bytes(const char *a, const char *b)
{
    char ha[65], hb[65];
    luma_err err;
    return luma_sha256_file(a, ha, &err) == 0 && luma_sha256_file(b, hb, &err) == 0 && strcmp(ha, hb) == 0;
}

/* The value of `key = "..."` or `key = N` on the model line of a golden file. */
static bool golden_field(const char *line, const char *key, char *out, size_t cap)
{
    char pat[40];
    snprintf(pat, sizeof pat, " %s = ", key);
    const char *p = strstr(line, pat);
    if (!p) return false;
    p += strlen(pat);
    bool quoted = *p == '"';
    p += quoted;
    size_t n = strcspn(p, quoted ? "\"" : ", }");
    if (n >= cap) return false;
    memcpy(out, p, n);
    out[n] = '\0';
    return true;
}

/* A golden file made from a synthetic model names its recipe and checksum;
 * writing the recipe again must give that very file, or the golden data no
 * longer describes the model the specs run. */
static void check_golden_recipe(const char *preset)
{
    char path[512], line[1024];
    snprintf(path, sizeof path, "%s/spec/data/%s-golden.lua", LUMA_SOURCE_DIR, preset);
    FILE *f = fopen(path, "r");
    if (!f) return;
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strncmp(line, "model = {", 9) == 0;
    fclose(f);
    char seed[32], mix[16], vocab[128], sha[80], vocab_path[512];
    if (!found || !golden_field(line, "seed", seed, sizeof seed) || !golden_field(line, "mix", mix, sizeof mix) ||
        !golden_field(line, "vocab", vocab, sizeof vocab) || !golden_field(line, "sha256", sha, sizeof sha)) {
        failures++;
        fprintf(stderr, "test_synth: %s: no model = { seed, mix, vocab, sha256 } line\n", path);
        return;
    }
    if (strcmp(vocab, LUMA_TEST_MODEL_NAME) == 0) luma_test_model_path(vocab_path, sizeof vocab_path);
    else snprintf(vocab_path, sizeof vocab_path, "%s%s", VOCAB_DIR, vocab);
    if (!exists(vocab_path)) {
        printf("test_synth: %s golden recipe: vocabulary %s absent, not checked\n", preset, vocab);
        return;
    }
    luma_synth_params p = tiny_params(preset, vocab_path, mix, strtoull(seed, NULL, 10));
    char out[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(out, "golden.gguf");
    char hex[65];
    luma_err err;
    bool ok = write_model(&p, out) == 0 && luma_sha256_file(out, hex, &err) == 0 && strcmp(hex, sha) == 0;
    if (!ok) failures++;
    printf("test_synth: %s golden recipe (seed %s, %s) rebuilds the file it was made from: %s\n", preset, seed,
           mix, ok ? "ok" : "FAILED (the writer changed: regenerate with scripts/ref-forward.py golden)");
    remove(out);
}

static void test_determinism(const char *vocab)
{
    luma_synth_params p = tiny_params("tiny-qwen2", vocab, NULL, 42);
    char a[LUMA_TEST_PATH_CAP], b[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(a, "a.gguf");
    luma_test_tmp_path(b, "b.gguf");
    bool ok = write_model(&p, a) == 0 && write_model(&p, b) == 0 && same_bytes(a, b);
    p.seed = 43;
    ok = ok && write_model(&p, b) == 0 && !same_bytes(a, b);
    if (!ok) failures++;
    printf("test_synth: same parameters give the same bytes, another seed others: %s\n", ok ? "ok" : "FAILED");
    remove(a);
    remove(b);
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++) check_golden_recipe(tiny[i].preset);
}

static void expect_refused(luma_synth_params p, const char *word)
{
    char path[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(path, "refused.gguf");
    luma_err err = { { 0 } };
    int rc = luma_synth_write(&p, path, &err);
    if (rc == 0 || !strstr(err.msg, word) || exists(path)) {
        failures++;
        fprintf(stderr, "test_synth: expected a refusal naming \"%s\": rc %d, \"%s\"\n", word, rc, err.msg);
    }
    remove(path);
}

static void test_errors(const char *vocab)
{
    int before = failures;
    luma_synth_params p;
    luma_err err = { { 0 } };
    CHECK(luma_synth_preset("no-such-model", &p, &err) == -1 && strstr(err.msg, "tiny-llama") &&
          strstr(err.msg, "llama-7b"));
    CHECK(luma_synth_preset_name(0) != NULL && luma_synth_preset_name(1000) == NULL);
    luma_synth_params ok = tiny_params("tiny-llama", vocab, NULL, 1), bad;
    bad = ok; bad.arch = "gpt2"; expect_refused(bad, "architecture");
    bad = ok; bad.mix = "q3_k_xl"; expect_refused(bad, "mix");
    bad = ok; bad.n_kv_head = 3; expect_refused(bad, "KV heads");
    bad = ok; bad.n_embd = 200; bad.head_dim = 0; expect_refused(bad, "multiples");
    bad = ok; bad.head_dim = 63; expect_refused(bad, "even");
    bad = ok; bad.n_layer = 0; expect_refused(bad, "n_layer");
    bad = ok; bad.vocab_path = NULL; expect_refused(bad, "vocabulary");
    char missing[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(missing, "missing.gguf");
    bad = ok; bad.vocab_path = missing; expect_refused(bad, "missing.gguf");
    printf("test_synth: unknown presets, bad shapes, mixes and vocabularies refused, no file left: %s\n",
           failures == before ? "ok" : "FAILED");
}

/* ---- the writer's streamed tensors -------------------------------------- */

typedef struct fill_ctx {
    int calls;
    int64_t fail_at;            /* a row whose chunk fails; -1: none */
} fill_ctx;

/* Row r of an F32 [300, n] tensor holds r * 1000 + column. */
static int fill_f32(void *ctx, int64_t row0, int64_t n_rows, void *dst, luma_err *err)
{
    fill_ctx *c = ctx;
    c->calls++;
    if (c->fail_at >= row0 && c->fail_at < row0 + n_rows) return luma_errf(err, "fill refused row %lld",
                                                                              (long long)c->fail_at);
    float *x = dst;
    for (int64_t r = 0; r < n_rows; r++)
        for (int i = 0; i < 300; i++) x[r * 300 + i] = (float)((row0 + r) * 1000 + i);
    return 0;
}

static void test_streamed(void)
{
    int before = failures;
    const int64_t ne[2] = { 300, 5000 };   /* 6 MB: more than one chunk */
    char path[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(path, "streamed.gguf");
    luma_err err;
    fill_ctx c = { 0, -1 };
    luma_gguf_writer *w = luma_gguf_writer_new();
    const float small[4] = { 1, 2, 3, 4 };
    CHECK(luma_gguf_add_tensor(w, "small", LUMA_F32, 1, (const int64_t[]){ 4 }, small, sizeof small, &err) == 0);
    CHECK(luma_gguf_add_tensor_fill(w, "big", LUMA_F32, 2, ne, fill_f32, &c, &err) == 0);
    CHECK(luma_gguf_add_tensor_fill(w, "big", LUMA_F32, 2, ne, fill_f32, &c, &err) == -1 &&
          strstr(err.msg, "duplicate"));
    CHECK(luma_gguf_add_tensor_fill(w, "odd", LUMA_Q4_K, 2, ne, fill_f32, &c, &err) == -1 &&
          strstr(err.msg, "block size"));
    CHECK(luma_gguf_add_tensor_fill(w, "none", LUMA_F32, 2, ne, NULL, &c, &err) == -1);
    CHECK(luma_gguf_writer_save(w, path, &err) == 0);
    int chunks = c.calls;
    CHECK(chunks >= 2);
    luma_gguf *g = NULL;
    if (luma_gguf_open(path, &g, &err) == 0) {
        const luma_gguf_tensor *t = luma_gguf_find_tensor(g, "big");
        const luma_gguf_tensor *s = luma_gguf_find_tensor(g, "small");
        CHECK(t && t->ne[0] == 300 && t->ne[1] == 5000 && s && memcmp(s->data, small, sizeof small) == 0);
        bool same = t != NULL;
        for (int64_t r = 0; same && r < 5000; r += 37) {
            float v[300];
            memcpy(v, (const uint8_t *)t->data + (size_t)r * sizeof v, sizeof v);
            for (int i = 0; i < 300; i++) same = same && v[i] == (float)(r * 1000 + i);
        }
        CHECK(same);
        luma_gguf_close(g);
    } else {
        failures++;
        fprintf(stderr, "test_synth: streamed file: %s\n", err.msg);
    }
    luma_gguf_writer_free(w);
    remove(path);

    c = (fill_ctx){ 0, 4500 };
    w = luma_gguf_writer_new();
    CHECK(luma_gguf_add_tensor_fill(w, "big", LUMA_F32, 2, ne, fill_f32, &c, &err) == 0);
    CHECK(luma_gguf_writer_save(w, path, &err) == -1 && strstr(err.msg, "fill refused row 4500") && !exists(path));
    luma_gguf_writer_free(w);
    printf("test_synth: a streamed tensor written in %d chunks, a failing fill ends the save: %s\n", chunks,
           failures == before ? "ok" : "FAILED");
}

/* ---- main --------------------------------------------------------------- */

static bool pick_vocab(char *out, size_t cap)
{
    snprintf(out, cap, "%s", VOCAB_DIR SPM_VOCAB);
    if (exists(out)) return true;
    return luma_test_model_path(out, cap);
}

int main(void)
{
    char vocab[4096];
    if (!pick_vocab(vocab, sizeof vocab)) {
        printf("test_synth: FAIL: no vocabulary: neither %s nor the default model (%s) is present; set "
               "LUMA_MODEL or fetch the default model\n", VOCAB_DIR SPM_VOCAB, vocab);
        return 1;
    }
    if (!luma_test_tmpdir_make("test_synth")) {
        printf("test_synth: FAIL: cannot create a temporary directory\n");
        return 1;
    }
    printf("test_synth: vocabulary from %s\n", vocab);

    luma_gguf *v = NULL;
    luma_err err;
    int64_t n_vocab = 0;
    const luma_gguf_value *tokens = NULL;
    if (luma_gguf_open(vocab, &v, &err) == 0 &&
        luma_gguf_get_arr(v, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, &err) == 0 && tokens)
        n_vocab = (int64_t)tokens->n;
    luma_gguf_close(v);
    CHECK(n_vocab > 0);

    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++) {
        luma_synth_params p = tiny_params(tiny[i].preset, vocab, "q4_k_m", 1);
        char path[LUMA_TEST_PATH_CAP];
        luma_test_tmp_path(path, "tiny.gguf");
        if (write_model(&p, path) != 0) continue;
        check_file(&tiny[i], path, n_vocab);
        check_runs(tiny[i].preset, path);
        remove(path);
    }
    test_mixes(vocab);
    test_determinism(vocab);
    test_errors(vocab);
    test_streamed();
    rmdir(luma_test_tmpdir);

    if (failures) {
        printf("test_synth: %d checks FAILED\n", failures);
        return 1;
    }
    printf("test_synth: all checks passed\n");
    return 0;
}
