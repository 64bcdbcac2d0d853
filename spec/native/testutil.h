/* What the native tests share, written once: the failure count and its
 * CHECK macros, a seeded random generator, random weights in every format,
 * xmalloc, and where the default model is. Each test is a program of its
 * own, so everything here is static (inline: a test need not use it all) and
 * a test includes it as "testutil.h" from its own folder. */
#ifndef LUMA_TESTUTIL_H
#define LUMA_TESTUTIL_H

#include "quant.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- checks ------------------------------------------------------------- */

/* A test exits non-zero when this is not 0 at the end. */
static int failures;

/* CHECK(cond) names a failed condition on stderr, every time. */
#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            failures++;                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);  \
        }                                                                             \
    } while (0)

/* CHECKF(cond, fmt, ...) prints its message on stdout, for the first 20
 * failures only: it sits in loops over thousands of elements. */
#define CHECKF(cond, ...)                                     \
    do {                                                      \
        if (!(cond)) {                                        \
            failures++;                                       \
            if (failures <= 20) {                             \
                printf("  FAIL %s:%d: ", __FILE__, __LINE__); \
                printf(__VA_ARGS__);                          \
                printf("\n");                                 \
            }                                                 \
        }                                                     \
    } while (0)

/* ---- random data -------------------------------------------------------- */

/* splitmix64. Each test seeds it once with its own constant, so its data
 * stays the same from run to run. */
static uint64_t rnd_state;

static inline void rnd_seed(uint64_t seed)
{
    rnd_state = seed;
}

static inline uint64_t rnd(void)
{
    uint64_t z = (rnd_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* 24 random bits spread over [lo, hi). */
static inline float uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() >> 40) / (float)(1 << 24);
}

/* A cheap bell-shaped value in (-2, 2) with unit-ish spread (the sum of
 * two uniforms). */
static inline float bell(void)
{
    uint64_t r = rnd();
    float a = (float)(r & 0xffffff) / (float)(1 << 24), b = (float)((r >> 24) & 0xffffff) / (float)(1 << 24);
    return 2.0f * (a + b - 1.0f);
}

/* A standard normal (Box-Muller). */
static inline float gaussian(void)
{
    float u = uniform(1e-7f, 1.0f), v = uniform(0.0f, 6.2831853f);
    return sqrtf(-2.0f * logf(u)) * cosf(v);
}

/* Offsets of the half-float scales in a block: d, then m or dmin (-1: none). */
static inline void scale_offsets(enum luma_type t, int *d, int *m)
{
    *m = -1;
    switch (t) {
    case LUMA_Q4_0: *d = offsetof(luma_block_q4_0, d); break;
    case LUMA_Q4_1: *d = offsetof(luma_block_q4_1, d); *m = offsetof(luma_block_q4_1, m); break;
    case LUMA_Q5_0: *d = offsetof(luma_block_q5_0, d); break;
    case LUMA_Q5_1: *d = offsetof(luma_block_q5_1, d); *m = offsetof(luma_block_q5_1, m); break;
    case LUMA_Q8_0: *d = offsetof(luma_block_q8_0, d); break;
    case LUMA_Q2_K: *d = offsetof(luma_block_q2_K, d); *m = offsetof(luma_block_q2_K, dmin); break;
    case LUMA_Q3_K: *d = offsetof(luma_block_q3_K, d); break;
    case LUMA_Q4_K: *d = offsetof(luma_block_q4_K, d); *m = offsetof(luma_block_q4_K, dmin); break;
    case LUMA_Q5_K: *d = offsetof(luma_block_q5_K, d); *m = offsetof(luma_block_q5_K, dmin); break;
    case LUMA_Q6_K: *d = offsetof(luma_block_q6_K, d); break;
    default: *d = -1; break;
    }
}

static inline void put_half(uint8_t *p, float v)
{
    uint16_t h = luma_f32_to_f16(v);
    memcpy(p, &h, sizeof h);
}

/* n weights of type t into dst, luma_row_size(t, n) bytes: one row, or a
 * whole rows x cols matrix when a row is whole blocks. The block formats get
 * random bytes with their half scales set to [1e-3, 1e-1], so that no block
 * holds an inf or a NaN; the minimums of Q4_1 and Q5_1 (a signed offset)
 * take either sign, the K formats' dmin stays positive as a quantizer
 * writes it. The float formats get standard normals. */
static inline void random_weights(enum luma_type t, int64_t n, uint8_t *dst)
{
    const luma_type_traits *tr = luma_type_get(t);
    if (!tr->is_quantized) {
        for (int64_t i = 0; i < n; i++) {
            float v = gaussian();
            if (t == LUMA_F32) {
                memcpy(dst + 4 * i, &v, 4);
            } else {
                uint16_t h = t == LUMA_F16 ? luma_f32_to_f16(v) : luma_f32_to_bf16(v);
                memcpy(dst + 2 * i, &h, 2);
            }
        }
        return;
    }
    size_t bytes = luma_row_size(t, n);
    for (size_t i = 0; i < bytes; i++) dst[i] = (uint8_t)rnd();
    int od, om;
    scale_offsets(t, &od, &om);
    if (od < 0) return;
    for (size_t b = 0; b < bytes / tr->type_size; b++) {
        uint8_t *blk = dst + b * tr->type_size;
        put_half(blk + od, uniform(1e-3f, 1e-1f));
        if (om < 0) continue;
        bool negative = (t == LUMA_Q4_1 || t == LUMA_Q5_1) && (rnd() & 1);
        float m = uniform(1e-3f, 1e-1f);
        put_half(blk + om, negative ? -m : m);
    }
}

/* The index of the first largest of x[0..n), every value counted (unlike
 * luma_logits_argmax, which skips masked entries): the tests' top-1. */
static inline int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* malloc that ends the test when memory runs out; never NULL, even for 0. */
static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        printf("out of memory\n");
        exit(1);
    }
    return p;
}

/* ---- matrix products ---------------------------------------------------- */

/* The weight rows the product checks sample: ns = min(rows, max) rows
 * spread evenly over [0, rows) into rows_s, and their dequantized values
 * (ns x cols floats; the caller frees them). */
static inline float *sample_weight_rows(enum luma_type t, const uint8_t *w, int64_t rows, int64_t cols, int max,
                                        int64_t *rows_s, int *ns)
{
    size_t row_bytes = luma_row_size(t, cols);
    *ns = rows < max ? (int)rows : max;
    for (int s = 0; s < *ns; s++) rows_s[s] = *ns == 1 ? 0 : (int64_t)s * (rows - 1) / (*ns - 1);
    float *wref = xmalloc((size_t)*ns * (size_t)cols * sizeof(float));
    for (int s = 0; s < *ns; s++)
        luma_dequantize_row(t, w + (size_t)rows_s[s] * row_bytes, wref + (size_t)s * (size_t)cols, cols);
    return wref;
}

/* Largest error of sampled outputs of y = W x (y: m x rows) relative to
 * sum |w x|, against double precision: wref holds the ns dequantized weight
 * rows rows_s[], and at most about max_acts of the m activation rows are
 * checked. A non-finite output counts as infinite. */
static inline double product_rel_error(const float *wref, const int64_t *rows_s, int ns, const float *x, int64_t m,
                                       int64_t cols, const float *y, int64_t rows, int64_t max_acts)
{
    double worst = 0.0;
    int64_t step = m <= max_acts ? 1 : m / max_acts;
    for (int64_t j = 0; j < m; j += step)
        for (int s = 0; s < ns; s++) {
            const float *wr = wref + (size_t)s * (size_t)cols, *xr = x + (size_t)j * (size_t)cols;
            double ref = 0.0, mag = 0.0;
            for (int64_t k = 0; k < cols; k++) {
                double p = (double)wr[k] * (double)xr[k];
                ref += p;
                mag += fabs(p);
            }
            double got = y[(size_t)j * (size_t)rows + (size_t)rows_s[s]];
            double e = isfinite(got) ? fabs(got - ref) / (mag > 0.0 ? mag : 1.0) : INFINITY;
            if (!(e <= worst)) worst = e;
        }
    return worst;
}

/* The same, against the CPU backend's own product instead of the exact one:
 * each checked activation row quantized to the weight type's act_type
 * (luma_quantize_act) and dotted with the weight row as stored (w: the
 * type's bytes, row_bytes per row) by luma_vec_dot_get. A backend that
 * multiplies the same int8 activations differs from it only by the order of
 * its float sums. Float types (F32 activations) come out as
 * product_rel_error. */
static inline double cpu_product_rel_error(enum luma_type t, const uint8_t *w, size_t row_bytes, const float *wref,
                                           const int64_t *rows_s, int ns, const float *x, int64_t m,
                                           int64_t cols, const float *y, int64_t rows, int64_t max_acts)
{
    luma_vec_dot_fn dot = luma_vec_dot_get(t);
    enum luma_type at = luma_type_get(t)->act_type;
    void *act = malloc(luma_row_size(at, cols) + sizeof(float) * (size_t)cols);
    if (!dot || !act) {
        free(act);
        return INFINITY;
    }
    double worst = 0.0;
    int64_t step = m <= max_acts ? 1 : m / max_acts;
    for (int64_t j = 0; j < m; j += step) {
        const float *xr = x + (size_t)j * (size_t)cols;
        luma_quantize_act(at, xr, act, cols);
        for (int s = 0; s < ns; s++) {
            const float *wr = wref + (size_t)s * (size_t)cols;
            double mag = 0.0;
            for (int64_t k = 0; k < cols; k++) mag += fabs((double)wr[k] * (double)xr[k]);
            double ref = dot(cols, w + (size_t)rows_s[s] * row_bytes, act);
            double got = y[(size_t)j * (size_t)rows + (size_t)rows_s[s]];
            double e = isfinite(got) ? fabs(got - ref) / (mag > 0.0 ? mag : 1.0) : INFINITY;
            if (!(e <= worst)) worst = e;
        }
    }
    free(act);
    return worst;
}

/* ---- the default model -------------------------------------------------- */

#define LUMA_TEST_MODEL_NAME "gemma-3-270m-q4_k_m.gguf"

/* $LUMA_MODEL when set, else ~/.cache/luma/models/LUMA_TEST_MODEL_NAME, into
 * buf (for the test's message either way); true when that file opens. Each
 * test decides what its absence means: a failure, or a check that did not
 * run. */
static inline bool luma_test_model_path(char *buf, size_t size)
{
    const char *env = getenv("LUMA_MODEL"), *home = getenv("HOME");
    int n = env && *env ? snprintf(buf, size, "%s", env)
                        : snprintf(buf, size, "%s/.cache/luma/models/" LUMA_TEST_MODEL_NAME, home ? home : "");
    if (n < 0 || (size_t)n >= size) return false;
    FILE *f = fopen(buf, "rb");
    if (!f) return false;
    fclose(f);
    return true;
}

#ifdef LUMA_MODEL_H
/* The model at path on backend ("cpu", "cuda") with a context of n_ctx,
 * steps of at most max_rows rows and a KV budget of kv_bytes (0: the
 * default), CUDA graphs off while graphs is false (LUMA_CUDA_GRAPHS=0 while
 * it loads; tests that include model.h define _POSIX_C_SOURCE for setenv).
 * NULL, with err set, on failure. */
static inline luma_model *luma_test_load(const char *path, const char *backend, bool graphs, int32_t n_ctx,
                                         int32_t max_rows, int64_t kv_bytes, luma_err *err)
{
    luma_model_params p;
    luma_model_params_default(&p);
    p.backend = backend;
    p.n_ctx = n_ctx;
    p.max_rows = max_rows;
    p.kv_bytes = kv_bytes;
    if (!graphs) setenv("LUMA_CUDA_GRAPHS", "0", 1);
    luma_model *m = NULL;
    int rc = luma_model_load(path, &p, &m, err);
    unsetenv("LUMA_CUDA_GRAPHS");
    return rc == 0 ? m : NULL;
}

#ifdef LUMA_SYNTH_H
/* The three copies a test of a GPU switch compares, of the synthetic model
 * sp written to path: m[0] on the CPU, m[1] on the GPU, m[2] on the GPU with
 * graphs off (eager), each with a context of n_ctx, steps of at most
 * max_rows rows and kv_bytes of cache. False, with a failed check naming
 * label and nothing left loaded, where the file or a copy cannot be made;
 * luma_test_free_three frees them and the file. */
static inline bool luma_test_load_three(const luma_synth_params *sp, const char *path, int32_t n_ctx,
                                        int32_t max_rows, int64_t kv_bytes, luma_model *m[3], const char *label)
{
    luma_err err = { { 0 } };
    m[0] = m[1] = m[2] = NULL;
    if (luma_synth_write(sp, path, &err) != 0) {
        CHECKF(0, "%s: writing the model: %s", label, err.msg);
        return false;
    }
    m[0] = luma_test_load(path, "cpu", true, n_ctx, max_rows, kv_bytes, &err);
    if (m[0]) m[1] = luma_test_load(path, "cuda", true, n_ctx, max_rows, kv_bytes, &err);
    if (m[1]) m[2] = luma_test_load(path, "cuda", false, n_ctx, max_rows, kv_bytes, &err);
    if (m[2]) return true;
    CHECKF(0, "%s: loading the model: %s", label, err.msg);
    for (int i = 0; i < 2; i++) luma_model_free(m[i]);
    m[0] = m[1] = NULL;
    remove(path);
    return false;
}

static inline void luma_test_free_three(luma_model *m[3], const char *path)
{
    for (int i = 2; i >= 0; i--) luma_model_free(m[i]);
    remove(path);
}
#endif

/* n_seqs new sequences of m, sequence s given ids[s (prompt + steps) ...]:
 * its prompt (all of them in one step), then `steps` steps of one forced
 * token a sequence, each step's logits into out ([steps][n_seqs][n_vocab]).
 * A failure is a failed check naming `name`, and false. */
static inline bool luma_test_forced_steps(luma_model *m, int n_seqs, const int32_t *ids, int prompt, int steps,
                                          float *out, const char *name)
{
    luma_err err = { { 0 } };
    const int32_t nv = m->hp.n_vocab;
    const size_t row = (size_t)(prompt + steps);
    luma_seq **seqs = (luma_seq **)xmalloc((size_t)n_seqs * sizeof *seqs);
    luma_chunk *c = (luma_chunk *)xmalloc((size_t)n_seqs * sizeof *c);
    bool ok = true;
    for (int s = 0; s < n_seqs; s++) seqs[s] = NULL;
    for (int s = 0; s < n_seqs && ok; s++) ok = (seqs[s] = luma_seq_new(m, &err)) != NULL;
    float *scratch = (float *)xmalloc((size_t)n_seqs * (size_t)nv * sizeof(float));
    if (ok) {
        for (int s = 0; s < n_seqs; s++) c[s] = (luma_chunk){ seqs[s], ids + s * row, prompt, false };
        ok = luma_model_run(m, c, n_seqs, scratch, &err) == 0;
    }
    for (int t = 0; ok && t < steps; t++) {
        for (int s = 0; s < n_seqs; s++) c[s] = (luma_chunk){ seqs[s], ids + s * row + prompt + t, 1, false };
        ok = luma_model_run(m, c, n_seqs, out + (size_t)t * (size_t)n_seqs * (size_t)nv, &err) == 0;
    }
    CHECKF(ok, "%s, %d sequences: %s", name, n_seqs, err.msg);
    free(scratch);
    for (int s = 0; s < n_seqs; s++) luma_seq_free(seqs[s]);
    free(c);
    free(seqs);
    return ok;
}
#endif

/* Elements of a and b (n floats each) whose bits differ. */
static inline size_t luma_test_bits_differ(const float *a, const float *b, size_t n)
{
    size_t d = 0;
    for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

#ifdef LUMA_SOURCE_DIR
/* A vocabulary for synthetic models, into buf: $LUMA_VOCAB when set; else
 * the shared llama-spm vocabulary beside the repository (32,000 tokens)
 * where there is one; else the default model's (luma_test_model_path: its
 * 262,144 tokens make the synthetic embeddings and outputs larger and the
 * tests slower, but a clone without the shared folder has it once fetched).
 * True when the file opens. */
static inline bool luma_test_vocab_path(char *buf, size_t size)
{
    const char *env = getenv("LUMA_VOCAB");
    int n = env && *env ? snprintf(buf, size, "%s", env)
                        : snprintf(buf, size, "%s/../shared/testdata/tokenizer/ggml-vocab-llama-spm.gguf",
                                   LUMA_SOURCE_DIR);
    if (n < 0 || (size_t)n >= size) return false;
    FILE *f = fopen(buf, "rb");
    if (f) {
        fclose(f);
        return true;
    }
    if (env && *env) return false;
    char model[1024];
    if (!luma_test_model_path(model, sizeof model) || strlen(model) >= size) return false;
    snprintf(buf, size, "%s", model);
    return true;
}

#ifdef LUMA_BACKEND_H
/* The opening of a GPU test that builds synthetic models, named name: with
 * no CUDA device it says its checks did not run and the test passes (0);
 * with no vocabulary it fails (1); else -1, the vocabulary's path in buf. */
static inline int luma_test_gpu_start(const char *name, char *buf, size_t size)
{
    if (!luma_backend_cuda_available()) {
        printf("%s: no CUDA device, the GPU checks did not run\n", name);
        return 0;
    }
    if (!luma_test_vocab_path(buf, size)) {
        printf("%s: FAIL: no vocabulary at %s (set LUMA_VOCAB to a GGUF file with a tokenizer)\n", name, buf);
        return 1;
    }
    return -1;
}
#endif
#endif

#ifdef LUMA_TOKENIZER_H
/* ---- text ----------------------------------------------------------------- */
/* (for tests that include tokenizer.h before this header) */

#include "unicode.h"

/* Tokenizes into a fresh array (*n ids) and holds luma_tokenize to its
 * contract on the way: the counting call, a buffer of half the count
 * written within it and answered with the full count, the whole buffer,
 * every id in range. NULL (*n = -1), the reason on stderr, when the call
 * fails or breaks the contract. */
static inline int32_t *luma_test_tokenize(const luma_vocab *v, const char *text, size_t len, bool add_special,
                                          bool parse_special, int64_t *n)
{
    const int32_t guard = 0x5a5a5a5a;
    luma_err err = { { 0 } };
    int64_t k = luma_tokenize(v, text, len, add_special, parse_special, NULL, 0, &err);
    *n = -1;
    if (k < 0) {
        fprintf(stderr, "tokenize: %s\n", err.msg);
        return NULL;
    }
    int32_t *ids = malloc(sizeof *ids * (size_t)(k + 1));
    if (!ids) return NULL;
    for (int64_t i = 0; i <= k; i++) ids[i] = guard;
    bool ok = luma_tokenize(v, text, len, add_special, parse_special, ids, k / 2, &err) == k;
    for (int64_t i = k / 2; ok && i <= k; i++) ok = ids[i] == guard;
    ok = ok && luma_tokenize(v, text, len, add_special, parse_special, ids, k, &err) == k && ids[k] == guard;
    for (int64_t i = 0; ok && i < k; i++) ok = ids[i] >= 0 && ids[i] < luma_vocab_size(v);
    if (!ok) {
        fprintf(stderr, "tokenize: %lld ids, but a short or full buffer broke the contract\n", (long long)k);
        free(ids);
        return NULL;
    }
    *n = k;
    return ids;
}

/* Detokenizes into a fresh NUL-terminated string (*len bytes), holding
 * luma_detokenize to its contract as luma_test_tokenize does (a buffer of
 * half the length written within it and answered with the full length).
 * NULL when the call fails or breaks it. */
static inline char *luma_test_detokenize(const luma_vocab *v, const int32_t *ids, int64_t n, bool special,
                                         size_t *len)
{
    const char guard = (char)0x5a;
    luma_err err = { { 0 } };
    int64_t k = luma_detokenize(v, ids, n, special, NULL, 0, &err);
    if (k < 0) return NULL;
    char *s = malloc((size_t)k + 1);
    if (!s) return NULL;
    memset(s, guard, (size_t)k + 1);
    bool ok = luma_detokenize(v, ids, n, special, s, (size_t)(k / 2), &err) == k;
    for (int64_t i = k / 2; ok && i <= k; i++) ok = s[i] == guard;
    ok = ok && luma_detokenize(v, ids, n, special, s, (size_t)k, &err) == k && s[k] == guard;
    if (!ok) {
        fprintf(stderr, "detokenize: %lld bytes, but a short or full buffer broke the contract\n", (long long)k);
        free(s);
        return NULL;
    }
    s[k] = 0;
    *len = (size_t)k;
    return s;
}

/* Whether n bytes of s are valid UTF-8. */
static inline bool luma_test_utf8_valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += luma_utf8_decode(s + i, n - i, &cp);
        if (cp == LUMA_UTF8_INVALID) return false;
    }
    return true;
}

/* Streams ids through luma_detok, each first into a one-byte buffer (to
 * exercise the "needs more room" answer), then into one of exactly the size
 * asked for; false when a chunk is not valid UTF-8, when a token asks for
 * more than 3 * (max piece + 3) bytes, when the flush gives more than 3, or
 * when a call writes past its buffer. The joined chunks go to *out
 * (malloc'd, NUL-terminated), their length to *out_len. */
static inline bool luma_test_stream(const luma_vocab *v, const int32_t *ids, int64_t n, bool special,
                                    char **out, size_t *out_len)
{
    const char guard = (char)0x5a;
    size_t cap = 3 * (luma_vocab_max_piece(v) + 3), len = 0;
    char *all = malloc(cap * (size_t)(n + 1) + 1), *chunk = malloc(cap + 1);
    bool ok = all && chunk;
    luma_detok d;
    luma_detok_init(&d);
    for (int64_t i = 0; ok && i <= n; i++) {
        size_t k;
        if (i < n) {
            char tiny[2] = {0, guard};
            k = luma_detok_push(&d, v, ids[i], special, tiny, 1);
            ok = tiny[1] == guard && k <= cap;
            if (ok && k <= 1) {
                memcpy(chunk, tiny, k);
            } else if (ok) {
                chunk[k] = guard;
                ok = luma_detok_push(&d, v, ids[i], special, chunk, k) == k && chunk[k] == guard;
            }
        } else {
            k = luma_detok_flush(&d, chunk, cap);
            ok = k <= 3;
        }
        if (ok) ok = luma_test_utf8_valid(chunk, k);
        if (ok) {
            memcpy(all + len, chunk, k);
            len += k;
        }
    }
    free(chunk);
    if (all) all[len] = 0;
    *out = all;
    *out_len = len;
    return ok;
}
#endif

#ifdef LUMA_TEST_TMPDIR
/* ---- a directory for the test's files ------------------------------------ */
/* (for tests that define LUMA_TEST_TMPDIR, and _POSIX_C_SOURCE 200809L for
 * mkdtemp, before including this header) */

#include <unistd.h>

#define LUMA_TEST_PATH_CAP 512

static char luma_test_tmpdir[256];

/* Makes $TMPDIR/luma_<name>_XXXXXX (TMPDIR unset or empty: /tmp) the test's
 * directory; false when it cannot. The test removes it (rmdir) at its end. */
static inline bool luma_test_tmpdir_make(const char *name)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(luma_test_tmpdir, sizeof luma_test_tmpdir, "%s/luma_%s_XXXXXX", tmp && *tmp ? tmp : "/tmp", name);
    return mkdtemp(luma_test_tmpdir) != NULL;
}

/* The path of name inside the test's directory. */
static inline void luma_test_tmp_path(char out[LUMA_TEST_PATH_CAP], const char *name)
{
    snprintf(out, LUMA_TEST_PATH_CAP, "%s/%s", luma_test_tmpdir, name);
}
#endif

#endif
