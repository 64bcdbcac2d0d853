/* Models edited after they were written: every edit of a tiny synthetic
 * model's metadata or tensors either loads (and then tokenizes, runs a short
 * prompt and detokenizes) or is refused with a message; nothing crashes,
 * reads out of bounds or leaks (the sanitizer build runs it too).
 *
 * The models are the tiny presets of the three architectures over
 * vocabularies this test writes itself: SPM (byte tokens, scored pieces) for
 * llama and gemma3, byte-level BPE with merges for qwen2. Each file is
 * rewritten once per edit:
 *   - every key: removed; made a string; made an array; a number key set to
 *     0, 1, 3, 7, 100,000, 2^31 - 1, 2^32 - 1 and -1 (floats to 0, -1,
 *     NaN, inf, 1e-38, 1e38); a string key emptied or renamed; a bool key
 *     flipped; an array key cut to half its length or emptied;
 *   - tokenizer.ggml.token_type with values out of range;
 *   - every tensor: removed; its two dimensions swapped; made 3-D; its type
 *     changed (F32, F16, Q8_0, Q4_K where the row allows; random bytes). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "model.h"
#include "quant.h"
#include "synth.h"
#include "tokenizer.h"
#include "unicode.h"
#define LUMA_TEST_TMPDIR
#include "testutil.h"

/* ---- the vocabularies ----------------------------------------------------- */

static int save(luma_gguf_writer *w, const char *path)
{
    luma_err err;
    int rc = luma_gguf_writer_save(w, path, &err);
    if (rc) fprintf(stderr, "test_model_edits: %s: %s\n", path, err.msg);
    luma_gguf_writer_free(w);
    return rc;
}

/* SPM: <unk>, <s>, </s>, the 256 byte tokens, then scored pieces. */
static int write_spm_vocab(const char *path)
{
    static const char *const pieces[] = {
        "\xe2\x96\x81", "\xe2\x96\x81the", "\xe2\x96\x81hello", "\xe2\x96\x81world", "he", "ll", "o", "w",
        "or", "ld", "H", "e", "l", "d", "r", "\xe2\x96\x81H", "ello", "<start_of_turn>", "<end_of_turn>",
    };
    enum { N_PIECES = sizeof pieces / sizeof pieces[0], N = 3 + 256 + N_PIECES };
    static char bytes[256][8];
    luma_str toks[N];
    float scores[N];
    int32_t types[N];
    const char *head[] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < 3; i++) {
        toks[i] = (luma_str){head[i], strlen(head[i])};
        types[i] = i ? LUMA_TOKEN_CONTROL : LUMA_TOKEN_UNKNOWN;
        scores[i] = 0;
    }
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        toks[3 + b] = (luma_str){bytes[b], strlen(bytes[b])};
        types[3 + b] = LUMA_TOKEN_BYTE;
        scores[3 + b] = 0;
    }
    for (int i = 0; i < N_PIECES; i++) {
        toks[259 + i] = (luma_str){pieces[i], strlen(pieces[i])};
        types[259 + i] = pieces[i][0] == '<' ? LUMA_TOKEN_CONTROL : LUMA_TOKEN_NORMAL;
        scores[259 + i] = -(float)i;
    }
    luma_gguf_writer *w = luma_gguf_writer_new();
    luma_gguf_set_str(w, "general.architecture", "llama");
    luma_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    luma_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, N);
    luma_gguf_set_arr(w, "tokenizer.ggml.scores", LUMA_GGUF_F32, scores, N);
    luma_gguf_set_arr(w, "tokenizer.ggml.token_type", LUMA_GGUF_I32, types, N);
    luma_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    luma_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    luma_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    luma_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
    return save(w, path);
}

/* Byte-level BPE: the 256 byte characters (GPT-2's mapping), a few merges
 * and their results, then <|endoftext|>. */
static int write_bpe_vocab(const char *path)
{
    static const char *const merges[] = {"\xc4\xa0 t", "h e", "l l", "ll o", "\xc4\xa0t he", "w o", "r l",
                                         "rl d", "wo rld", "\xc4\xa0 wo"};
    static const char *const merged[] = {"\xc4\xa0t", "he", "ll", "llo", "\xc4\xa0the", "wo", "rl", "rld",
                                         "world", "\xc4\xa0wo"};
    enum { N_MERGES = sizeof merges / sizeof merges[0], N = 256 + N_MERGES + 1 };
    static char chars[256][4];
    luma_str toks[N], mstr[N_MERGES];
    int32_t types[N];
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        uint32_t cp = keep ? (uint32_t)b : 256u + (uint32_t)extra++;
        size_t k = luma_utf8_encode(cp, chars[b]);
        toks[b] = (luma_str){chars[b], k};
        types[b] = LUMA_TOKEN_NORMAL;
    }
    for (int i = 0; i < N_MERGES; i++) {
        toks[256 + i] = (luma_str){merged[i], strlen(merged[i])};
        types[256 + i] = LUMA_TOKEN_NORMAL;
        mstr[i] = (luma_str){merges[i], strlen(merges[i])};
    }
    toks[N - 1] = (luma_str){"<|endoftext|>", 13};
    types[N - 1] = LUMA_TOKEN_CONTROL;
    luma_gguf_writer *w = luma_gguf_writer_new();
    luma_gguf_set_str(w, "general.architecture", "qwen2");
    luma_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    luma_gguf_set_str(w, "tokenizer.ggml.pre", "qwen2");
    luma_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, N);
    luma_gguf_set_arr(w, "tokenizer.ggml.token_type", LUMA_GGUF_I32, types, N);
    luma_gguf_set_arr_str(w, "tokenizer.ggml.merges", mstr, N_MERGES);
    luma_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", N - 1);
    luma_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", N - 1);
    luma_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    return save(w, path);
}

/* ---- edits -------------------------------------------------------------------- */

enum kind {
    KV_DROP, KV_STRING, KV_ARRAY, KV_NUMBER, KV_EMPTY_STRING, KV_FLIP, KV_HALF, KV_NONE, KV_TYPES,
    T_DROP, T_SWAP, T_3D, T_TYPE, KEEP,
};

typedef struct edit {
    enum kind kind;
    uint64_t index;             /* of the kv or the tensor */
    luma_gguf_value v;          /* KV_NUMBER */
    uint32_t type;              /* T_TYPE */
} edit;

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint8_t random_byte(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(rng_state >> 56);
}

static void cstr(luma_str s, char *buf, size_t cap)
{
    size_t n = s.len < cap - 1 ? (size_t)s.len : cap - 1;
    memcpy(buf, s.ptr, n);
    buf[n] = 0;
}

static void edit_kv(luma_gguf_writer *w, const luma_gguf_kv *kv, const edit *e)
{
    char key[256];
    cstr(kv->key, key, sizeof key);
    const luma_gguf_value *v = &kv->value;
    luma_gguf_value half = *v;
    static const uint32_t two[2] = {1, 2};
    switch (e->kind) {
    case KV_DROP: break;
    case KV_STRING: luma_gguf_set_str(w, key, "x"); break;
    case KV_EMPTY_STRING: luma_gguf_set_str(w, key, ""); break;
    case KV_ARRAY: luma_gguf_set_arr(w, key, LUMA_GGUF_U32, two, 2); break;
    case KV_NUMBER: luma_gguf_set_value(w, key, &e->v); break;
    case KV_FLIP: luma_gguf_set_bool(w, key, !v->v.u64); break;
    case KV_HALF:
    case KV_NONE:
        half.n = e->kind == KV_HALF ? v->n / 2 : 0;
        if (half.n == 0) half.strs = NULL, half.items = NULL;
        luma_gguf_set_value(w, key, &half);
        break;
    case KV_TYPES: {
        int32_t *t = malloc(sizeof *t * (size_t)(v->n ? v->n : 1));
        if (!t) abort();
        for (uint64_t i = 0; i < v->n; i++) {
            memcpy(&t[i], (const int32_t *)v->data + i, sizeof *t);
            if (i % 5 == 1) t[i] = (int32_t)(i % 3 == 0 ? 99 : i % 3 == 1 ? 0 : -7);
        }
        luma_gguf_set_arr(w, key, LUMA_GGUF_I32, t, v->n);
        free(t);
        break;
    }
    default: luma_gguf_copy_kv(w, kv);
    }
}

static int edit_tensor(luma_gguf_writer *w, const luma_gguf_tensor *t, const edit *e, luma_err *err)
{
    char name[128];
    cstr(t->name, name, sizeof name);
    int64_t ne[LUMA_GGUF_MAX_DIMS];
    memcpy(ne, t->ne, sizeof ne);
    switch (e->kind) {
    case T_DROP: return 0;
    case T_SWAP:
        if (t->n_dims < 2) return 1;
        ne[0] = t->ne[1], ne[1] = t->ne[0];
        /* the data as it is: a row of another length in the same bytes, where the type allows it */
        if (luma_row_size(t->type, ne[0]) * (size_t)ne[1] != t->size) return 1;
        return luma_gguf_add_tensor(w, name, t->type, t->n_dims, ne, t->data, t->size, err);
    case T_3D:
        if (t->ne[1] % 2) return 1;
        ne[1] = t->ne[1] / 2, ne[2] = 2;
        return luma_gguf_add_tensor(w, name, t->type, 3, ne, t->data, t->size, err);
    case T_TYPE: {
        const luma_type_traits *tr = luma_type_get(e->type);
        if (!tr || t->ne[0] % tr->block_size) return 1;
        size_t size = luma_row_size(e->type, t->ne[0]) * (size_t)(t->ne[1] * t->ne[2] * t->ne[3]);
        uint8_t *data = malloc(size);
        if (!data) abort();
        for (size_t i = 0; i < size; i++) data[i] = random_byte();
        int rc = luma_gguf_add_tensor(w, name, e->type, t->n_dims, t->ne, data, size, err);
        free(data);
        return rc;
    }
    default: return luma_gguf_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, t->size, err);
    }
}

/* Writes g with edit e to path; 1 when the edit does not apply to that kv
 * or tensor (or the writer refuses the result), -1 on an error. */
static int write_edited(const luma_gguf *g, const edit *e, const char *path)
{
    luma_err err;
    luma_gguf_writer *w = luma_gguf_writer_new();
    bool on_kv = e->kind < T_DROP;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        if (on_kv && i == e->index) edit_kv(w, &g->kv[i], e);
        else luma_gguf_copy_kv(w, &g->kv[i]);
    }
    int rc = 0;
    static const edit keep = {.kind = KEEP};
    for (uint64_t i = 0; i < g->n_tensors && rc == 0; i++)
        rc = edit_tensor(w, &g->tensors[i], !on_kv && i == e->index ? e : &keep, &err);
    if (rc) {
        if (rc < 0) fprintf(stderr, "test_model_edits: writing edit %d of tensor %llu: %s\n", (int)e->kind,
                            (unsigned long long)e->index, err.msg);
        luma_gguf_writer_free(w);
        return rc > 0 ? 1 : -1;
    }
    rc = luma_gguf_writer_save(w, path, &err);
    luma_gguf_writer_free(w);
    return rc ? 1 : 0;
}

typedef struct tally {
    int loaded, refused, skipped;
} tally;

/* Loads path; when it loads, tokenizes a prompt, runs it and detokenizes
 * the ids. Every failure must come with a message. */
static void try_model(const char *path, tally *t)
{
    luma_err err = {{0}};
    luma_model *m = luma_test_load(path, "cpu", true, 32, 32, 0, &err);
    if (!m) {
        CHECK(err.msg[0] != '\0');
        t->refused++;
        return;
    }
    t->loaded++;
    static const char text[] = "<start_of_turn>Hello world, the \xc3\xa9t\xc3\xa9 \xff";
    int32_t ids[64];
    int64_t n = luma_tokenize(m->vocab, text, sizeof text - 1, true, true, ids, 64, &err);
    CHECK(n >= 0 || err.msg[0] != '\0');
    if (n > 16) n = 16;
    luma_seq *s = luma_seq_new(m, &err);
    float *logits = malloc(sizeof *logits * (size_t)m->hp.n_vocab);
    if (n > 0 && s && logits) {
        err.msg[0] = '\0';
        luma_chunk c = {s, ids, (int32_t)n, false};
        if (luma_model_run(m, &c, 1, logits, &err) != 0) CHECK(err.msg[0] != '\0');
        char out[512];
        if (luma_detokenize(m->vocab, ids, n, true, out, sizeof out, &err) < 0) CHECK(err.msg[0] != '\0');
    } else if (!s) {
        CHECK(err.msg[0] != '\0');
    }
    free(logits);
    luma_seq_free(s);
    luma_model_free(m);
}

/* Writes g with each of the n edits of its kv or tensor i to out, and tries it. */
static void apply_edits(const luma_gguf *g, uint64_t i, edit *list, int n, const char *out, tally *t)
{
    for (int k = 0; k < n; k++) {
        list[k].index = i;
        int rc = write_edited(g, &list[k], out);
        if (rc == 0) try_model(out, t);
        else if (rc > 0) t->skipped++;
        else failures++;
    }
}

static bool key_is(const luma_gguf_kv *kv, const char *prefix)
{
    size_t n = strlen(prefix);
    return kv->key.len >= n && memcmp(kv->key.ptr, prefix, n) == 0;
}

static void run_edits(const char *label, const char *path)
{
    luma_gguf *g = NULL;
    luma_err err;
    if (luma_gguf_open(path, &g, &err) != 0) {
        failures++;
        fprintf(stderr, "test_model_edits: %s: %s\n", label, err.msg);
        return;
    }
    char out[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(out, "edited.gguf");
    tally t = {0, 0, 0};
    int before = failures;
    /* the model as written loads */
    try_model(path, &t);
    CHECK(t.loaded == 1);
    static const uint64_t ints[] = {0, 1, 3, 7, 100000, 0x7fffffffu, 0xffffffffu};
    static const double floats[] = {0.0, -1.0, NAN, INFINITY, 1e-38, 1e38};
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const luma_gguf_value *v = &g->kv[i].value;
        edit list[32];
        int n = 0;
        list[n++] = (edit){.kind = KV_DROP};
        list[n++] = (edit){.kind = KV_STRING};
        list[n++] = (edit){.kind = KV_ARRAY};
        if (v->type == LUMA_GGUF_STRING) list[n++] = (edit){.kind = KV_EMPTY_STRING};
        if (v->type == LUMA_GGUF_BOOL) list[n++] = (edit){.kind = KV_FLIP};
        if (v->type == LUMA_GGUF_ARRAY) {
            list[n++] = (edit){.kind = KV_HALF};
            list[n++] = (edit){.kind = KV_NONE};
            if (v->elem_type == LUMA_GGUF_I32 && key_is(&g->kv[i], "tokenizer.ggml.token_type"))
                list[n++] = (edit){.kind = KV_TYPES};
        }
        bool number = v->type <= LUMA_GGUF_F32 || v->type >= LUMA_GGUF_U64;
        if (number && v->type != LUMA_GGUF_F32 && v->type != LUMA_GGUF_F64) {
            for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
                list[n++] = (edit){.kind = KV_NUMBER, .v = {.type = LUMA_GGUF_U32, .v.u64 = ints[k]}};
            list[n++] = (edit){.kind = KV_NUMBER, .v = {.type = LUMA_GGUF_I32, .v.i64 = -1}};
        } else if (number) {
            for (size_t k = 0; k < sizeof floats / sizeof floats[0]; k++)
                list[n++] = (edit){.kind = KV_NUMBER, .v = {.type = LUMA_GGUF_F32, .v.f64 = floats[k]}};
        }
        apply_edits(g, i, list, n, out, &t);
    }
    static const uint32_t types[] = {LUMA_F32, LUMA_F16, LUMA_Q8_0, LUMA_Q4_K};
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        edit list[8] = {{.kind = T_DROP}, {.kind = T_SWAP}, {.kind = T_3D}};
        int n = 3;
        for (size_t k = 0; k < sizeof types / sizeof types[0]; k++)
            if (types[k] != g->tensors[i].type) list[n++] = (edit){.kind = T_TYPE, .type = types[k]};
        apply_edits(g, i, list, n, out, &t);
    }
    unlink(out);
    luma_gguf_close(g);
    printf("test_model_edits: %s: %d edits loaded and ran, %d refused with a message, %d not applicable: %s\n",
           label, t.loaded - 1, t.refused, t.skipped, failures == before ? "ok" : "FAILED");
}

int main(void)
{
    if (!luma_test_tmpdir_make("test_model_edits")) {
        perror("test_model_edits: mkdtemp");
        return 1;
    }
    char spm[LUMA_TEST_PATH_CAP], bpe[LUMA_TEST_PATH_CAP], model[LUMA_TEST_PATH_CAP];
    luma_test_tmp_path(spm, "spm.gguf");
    luma_test_tmp_path(bpe, "bpe.gguf");
    luma_test_tmp_path(model, "model.gguf");
    if (write_spm_vocab(spm) || write_bpe_vocab(bpe)) return 1;
    static const char *const presets[][2] = {{"tiny-llama", "spm"}, {"tiny-qwen2", "bpe"}, {"tiny-gemma3", "spm"}};
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        luma_synth_params p;
        luma_err err;
        if (luma_synth_preset(presets[i][0], &p, &err) != 0) {
            failures++;
            fprintf(stderr, "test_model_edits: %s\n", err.msg);
            continue;
        }
        p.seed = 7 + i;
        p.vocab_path = strcmp(presets[i][1], "spm") == 0 ? spm : bpe;
        if (luma_synth_write(&p, model, &err) != 0) {
            failures++;
            fprintf(stderr, "test_model_edits: %s: %s\n", presets[i][0], err.msg);
            continue;
        }
        run_edits(presets[i][0], model);
        unlink(model);
    }
    unlink(spm);
    unlink(bpe);
    rmdir(luma_test_tmpdir);
    printf("test_model_edits: %s\n", failures ? "FAILED" : "all passed");
    return failures != 0;
}
