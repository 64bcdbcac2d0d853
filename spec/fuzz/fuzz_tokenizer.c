/* libFuzzer target for the tokenizers, the detokenizers and the
 * pre-tokenizers, over the vocabulary of a GGUF file (a model or a
 * vocabulary-only file): $LUMA_FUZZ_VOCAB, a path, or a bare file name
 * looked up beside the default model (where `luma fetch` puts the models:
 * "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"); without it, the default
 * model ($LUMA_MODEL, else ~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf).
 * An input is one byte of switches and then the text. For every input:
 *   - tokenizing and detokenizing never fail and keep to their buffers
 *     (luma_test_tokenize, luma_test_detokenize in testutil.h);
 *   - with add_special the ids are the plain ids with BOS / EOS around them
 *     as the vocabulary asks;
 *   - the ids detokenize, within any buffer, to the text again where the
 *     vocabulary can give it back (the rule of test_tokenizer's random
 *     round trips: BPE always; SPM for valid UTF-8 without U+2581, which
 *     SPM reads as a space, and with special parsing only without a space
 *     prefix);
 *   - the streaming detokenizer's chunks are valid UTF-8 and join to the
 *     detokenized text when that is valid UTF-8;
 *   - every pre-tokenizer cuts the text into pieces that are not empty and
 *     end where the text ends, whatever the buffer;
 *   - token pieces of ids taken from the input stay within their buffers.
 * A broken invariant traps; an over-read is caught by AddressSanitizer.
 * See README.md for how to build and run it. */
#define _GNU_SOURCE /* memmem */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode.h"
#include "../native/testutil.h"

static luma_vocab *vocab;
static bool space_prefix;

/* Names the broken invariant's line, then traps. */
#define require(ok) \
    do { \
        if (!(ok)) { \
            fprintf(stderr, "fuzz_tokenizer: line %d: %s\n", __LINE__, #ok); \
            __builtin_trap(); \
        } \
    } while (0)

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *name = getenv("LUMA_FUZZ_VOCAB");
    char path[4096];
    luma_gguf *g = NULL;
    luma_err err = {{0}};
    (void)failures;
    if (!luma_test_model_path(path, sizeof path) && !(name && strchr(name, '/'))) {
        fprintf(stderr, "fuzz_tokenizer: the default model is missing (%s); set LUMA_MODEL or fetch "
                        LUMA_TEST_MODEL_NAME " into ~/.cache/luma/models\n", path);
        exit(2);
    }
    if (name && *name) {
        char *slash = strrchr(path, '/');
        if (strchr(name, '/')) snprintf(path, sizeof path, "%s", name);
        else snprintf(slash ? slash + 1 : path, sizeof path - (size_t)(slash ? slash + 1 - path : 0), "%s", name);
    }
    if (luma_gguf_open(path, &g, &err) != 0 || luma_vocab_load(g, &vocab, &err) != 0) {
        fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, err.msg);
        exit(2);
    }
    luma_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", true, &space_prefix, &err);
    space_prefix = space_prefix && luma_vocab_kind(vocab) == LUMA_VOCAB_SPM;
    luma_gguf_close(g);
    return 0;
}

#define CANARY 0x5au

static void check_pretokenizers(const char *text, size_t len)
{
    static const char *const names[] = {"gpt-2", "llama-bpe", "qwen2", "default", "llama3", "phi-2"};
    size_t *ends = malloc(sizeof *ends * (len + 2));
    require(ends != NULL);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        luma_err err = {{0}};
        int64_t k = luma_pretokenize(names[i], text, len, ends, (int64_t)len + 1, &err);
        require(k >= 0 && (size_t)k <= len && (len == 0) == (k == 0));
        for (int64_t j = 0; j < k; j++) require(ends[j] > (j ? ends[j - 1] : 0) && ends[j] <= len);
        if (k) require(ends[k - 1] == len);
        ends[k / 2] = (size_t)-1;
        require(luma_pretokenize(names[i], text, len, ends, k / 2, &err) == k);
        require(ends[k / 2] == (size_t)-1);
    }
    free(ends);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    uint8_t sw = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    bool parse_special = sw & 1, special = sw & 2;

    int64_t n, ns;
    int32_t *ids = luma_test_tokenize(vocab, text, len, false, parse_special, &n);
    int32_t *with = luma_test_tokenize(vocab, text, len, true, parse_special, &ns);
    require(ids && with);
    const luma_vocab_special *sp = luma_vocab_specials(vocab);
    int64_t at = sp->add_bos && sp->bos >= 0, tail = sp->add_eos && sp->eos >= 0;
    require(ns == at + n + tail);
    if (at) require(with[0] == sp->bos);
    if (tail) require(with[ns - 1] == sp->eos);
    require(n == 0 || memcmp(with + at, ids, sizeof *ids * (size_t)n) == 0);
    free(with);

    size_t back_len, got_len;
    char *back = luma_test_detokenize(vocab, ids, n, parse_special, &back_len);
    require(back);
    bool spm = luma_vocab_kind(vocab) == LUMA_VOCAB_SPM;
    if (!spm || (luma_test_utf8_valid(text, len) && !memmem(text, len, "\xe2\x96\x81", 3) &&
                 !(parse_special && space_prefix)))
        require(back_len == len && memcmp(back, text, len) == 0);
    char *got;
    require(luma_test_stream(vocab, ids, n, parse_special, &got, &got_len));
    if (luma_test_utf8_valid(back, back_len)) require(got_len == back_len && memcmp(got, back, got_len) == 0);
    free(got);
    free(back);
    free(ids);

    /* Pieces of ids read from the text, in and out of range. */
    char piece[16];
    for (size_t i = 0; i + 4 <= len && i < 64; i += 4) {
        int32_t id;
        memcpy(&id, text + i, 4);
        if (!(sw & 4)) id = (int32_t)((uint32_t)id % (uint32_t)luma_vocab_size(vocab));
        piece[8] = (char)CANARY;
        size_t k = luma_token_piece(vocab, id, special, piece, 8);
        require((uint8_t)piece[8] == CANARY);
        if (id < 0 || id >= luma_vocab_size(vocab)) require(k == 0);
        else require(k <= luma_vocab_max_piece(vocab));
    }

    if (sw & 8) check_pretokenizers(text, len);
    return 0;
}
