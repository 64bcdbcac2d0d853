/* test_tokenizer: the SPM and BPE tokenizers, the pre-tokenizers, the
 * detokenizers and the UTF-8 helpers under them.
 *
 * Pins down:
 *   - UTF-8 decoding agrees with the standard on valid and invalid input;
 *   - the gpt-2, llama-bpe and qwen2 pre-tokenizers split like their regexes
 *     (spec/data/pretok-golden.txt, from Python's regex module);
 *   - small hand-made vocabularies: special and user-defined tokens, byte
 *     fallback, BOS/EOS, end-of-generation detection, merges and
 *     ignore_merges, errors that name an unknown model or pre-tokenizer;
 *   - llama.cpp's own vectors (../shared/testdata/tokenizer, add_special and
 *     parse_special off, as its test-tokenizer-0 runs them) pass exactly,
 *     and decode back to their text;
 *   - Gemma 3's vocabulary matches llama.cpp on spec/data/gemma3-tokenizer*
 *     (scripts/gen-tokenizer-golden.py), round-trips, loads quickly, and
 *     streams through the incremental detokenizer in valid UTF-8 chunks that
 *     join to the full text. The model is $LUMA_MODEL or
 *     ~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf; its absence fails. */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode.h"
#include "testutil.h"

/* ---- small tools ------------------------------------------------------------ */

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += k;
        if (n == cap) {
            char *b = realloc(buf, cap * 2 + 1);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static bool same_ids(const int32_t *a, int64_t na, const int32_t *b, int64_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, sizeof *a * (size_t)na) == 0);
}

/* ---- UTF-8 and categories ------------------------------------------------------ */

static void test_unicode(void)
{
    int before = failures;
    char buf[4];
    uint32_t cp;
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 100000; i++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        uint32_t c = (uint32_t)(seed % 0x110000);
        size_t k = luma_utf8_encode(c, buf);
        if (c >= 0xD800 && c <= 0xDFFF) {
            CHECK(k == 0);
            continue;
        }
        CHECK(k >= 1 && luma_utf8_decode(buf, k, &cp) == k && cp == c);
        CHECK(luma_utf8_incomplete_tail(buf, k) == 0);
        for (size_t cut = 1; cut < k; cut++) CHECK(luma_utf8_incomplete_tail(buf, cut) == cut);
    }
    static const struct { const char *s; size_t len, unit; } bad[] = {
        {"\x80", 1, 1},             /* stray continuation */
        {"\xC0\xAF", 2, 1},         /* overlong lead */
        {"\xE0\x80\xAF", 3, 1},     /* overlong three-byte */
        {"\xED\xA0\x80", 3, 1},     /* surrogate */
        {"\xF4\x90\x80\x80", 4, 1}, /* past U+10FFFF */
        {"\xFF", 1, 1},
        {"\xE4\xB8", 2, 2},         /* cut short at the end */
        {"\xE4\xB8" "a", 3, 2},     /* cut short by ASCII */
        {"\xF0\x9F\x98" "a", 4, 3},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(luma_utf8_decode(bad[i].s, bad[i].len, &cp) == bad[i].unit && cp == LUMA_UTF8_INVALID);
    CHECK(luma_utf8_incomplete_tail("a\xE4\xB8", 3) == 2);
    CHECK(luma_utf8_incomplete_tail("a\xE4\xB8" "a", 4) == 0);
    CHECK(luma_utf8_incomplete_tail("\xED\xA0", 2) == 0);  /* can only become a surrogate */
    CHECK(luma_utf8_lead_len(0xE4) == 3 && luma_utf8_lead_len(0x80) == 1 && luma_utf8_lead_len(0xF5) == 4);

    CHECK(luma_unicode_category('A') == LUMA_UCAT_LETTER);
    CHECK(luma_unicode_category('7') == LUMA_UCAT_NUMBER);
    CHECK(luma_unicode_category(0x0663) == LUMA_UCAT_NUMBER);   /* Arabic-Indic three */
    CHECK(luma_unicode_category(0x4E2D) == LUMA_UCAT_LETTER);   /* 中 */
    CHECK(luma_unicode_category(0x0301) == LUMA_UCAT_MARK);
    CHECK(luma_unicode_category('!') == LUMA_UCAT_PUNCT);
    CHECK(luma_unicode_category(0x1F600) == LUMA_UCAT_SYMBOL);
    CHECK(luma_unicode_category(0x3000) == LUMA_UCAT_SEPARATOR);
    CHECK(luma_unicode_category(0x0000) == LUMA_UCAT_OTHER);
    CHECK(luma_unicode_category(0xE000) == LUMA_UCAT_OTHER);    /* private use */
    CHECK(luma_unicode_category(0x0378) == LUMA_UCAT_UNASSIGNED);
    CHECK(luma_unicode_category(0x10FFFF) == LUMA_UCAT_UNASSIGNED);
    CHECK(luma_unicode_category(0x110000) == LUMA_UCAT_UNASSIGNED);
    CHECK(luma_unicode_is_space(' ') && luma_unicode_is_space('\t') && luma_unicode_is_space(0x85) &&
          luma_unicode_is_space(0x3000) && luma_unicode_is_space(0x2028));
    CHECK(!luma_unicode_is_space(0x1C) && !luma_unicode_is_space(0x200B) && !luma_unicode_is_space('a'));
    printf("test_tokenizer: UTF-8 and Unicode classes: %s\n", failures == before ? "ok" : "FAILED");
}

/* ---- pre-tokenizers against Python's regex ----------------------------------------- */

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static void test_pretok_golden(void)
{
    size_t len;
    char *data = read_file(LUMA_SOURCE_DIR "/spec/data/pretok-golden.txt", &len);
    if (!data) {
        failures++;
        printf("test_tokenizer: pre-tokenizer golden: FAILED, spec/data/pretok-golden.txt missing\n");
        return;
    }
    int cases = 0, passed = 0;
    char *save = NULL;
    for (char *line = strtok_r(data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '#') continue;
        char *pre = line, *hex = strchr(pre, ' ');
        if (!hex) continue;
        *hex++ = 0;
        char *list = strchr(hex, ' ');
        if (!list) continue;
        *list++ = 0;
        size_t n = strlen(hex) / 2;
        char *text = malloc(n + 1);
        size_t want[512], n_want = 0;
        for (size_t i = 0; i < n; i++) text[i] = (char)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));
        for (char *p = list; *p && n_want < 512;) {
            want[n_want++] = strtoul(p, &p, 10);
            if (*p == ',') p++;
        }
        size_t got[512];
        luma_err err;
        int64_t k = luma_pretokenize(pre, text, n, got, 512, &err);
        cases++;
        if (k == (int64_t)n_want && memcmp(got, want, n_want * sizeof *got) == 0) {
            passed++;
        } else {
            fprintf(stderr, "test_tokenizer: %s splits '%.*s' into %" PRId64 " pieces, want %zu\n",
                    pre, (int)n, text, k, n_want);
        }
        free(text);
    }
    free(data);
    luma_err err;
    size_t ends[4];
    CHECK(luma_pretokenize("no-such-pre", "x", 1, ends, 4, &err) == -1 && strstr(err.msg, "no-such-pre"));
    CHECK(luma_pretokenize("llama3", "a b", 3, ends, 4, &err) == 2 && ends[0] == 1 && ends[1] == 3);
    /* invalid bytes split like U+FFFD (a symbol), and are kept */
    CHECK(luma_pretokenize("gpt-2", "ab\xff\xfe cd", 7, ends, 4, &err) == 3 && ends[0] == 2 &&
          ends[1] == 4 && ends[2] == 7);
    CHECK(luma_pretokenize("default", "a b", 3, ends, 4, &err) == 1 && ends[0] == 3);
    if (cases < 100) failures++;
    if (passed != cases) failures++;
    printf("test_tokenizer: pre-tokenizer golden (gpt-2, llama-bpe, qwen2): %d/%d passed\n", passed, cases);
}

/* ---- hand-made vocabularies ---------------------------------------------------------- */

typedef struct tok {
    const char *text;
    int32_t type;
    float score;
} tok;

static luma_vocab *make_vocab(const char *model, const char *pre, const tok *toks, size_t n,
                              const char *const *merges, size_t n_merges, bool with_merges,
                              luma_err *err)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/luma-test-tokenizer-%ld.gguf", (long)getpid());
    luma_gguf_writer *w = luma_gguf_writer_new();
    luma_str *strs = malloc(sizeof *strs * n);
    int32_t *types = malloc(sizeof *types * n);
    float *scores = malloc(sizeof *scores * n);
    for (size_t i = 0; i < n; i++) {
        strs[i] = (luma_str){toks[i].text, strlen(toks[i].text)};
        types[i] = toks[i].type;
        scores[i] = toks[i].score;
    }
    luma_gguf_set_str(w, "general.architecture", "llama");
    luma_gguf_set_str(w, "tokenizer.ggml.model", model);
    if (pre) luma_gguf_set_str(w, "tokenizer.ggml.pre", pre);
    luma_gguf_set_arr_str(w, "tokenizer.ggml.tokens", strs, n);
    luma_gguf_set_arr(w, "tokenizer.ggml.token_type", LUMA_GGUF_I32, types, n);
    luma_gguf_set_arr(w, "tokenizer.ggml.scores", LUMA_GGUF_F32, scores, n);
    if (with_merges) {
        luma_str *ms = malloc(sizeof *ms * (n_merges + 1));
        for (size_t i = 0; i < n_merges; i++) ms[i] = (luma_str){merges[i], strlen(merges[i])};
        luma_gguf_set_arr_str(w, "tokenizer.ggml.merges", ms, n_merges);
        free(ms);
    }
    luma_vocab *v = NULL;
    luma_gguf *g = NULL;
    if (luma_gguf_writer_save(w, path, err) == 0 && luma_gguf_open(path, &g, err) == 0) {
        luma_vocab_load(g, &v, err);
        luma_gguf_close(g);
    }
    remove(path);
    luma_gguf_writer_free(w);
    free(strs);
    free(types);
    free(scores);
    return v;
}

static bool ids_are(const luma_vocab *v, const char *text, bool add_special, bool parse_special,
                    const int32_t *want, int64_t n_want)
{
    int64_t n;
    int32_t *ids = luma_test_tokenize(v, text, strlen(text), add_special, parse_special, &n);
    bool ok = ids && same_ids(ids, n, want, n_want);
    if (!ok) {
        fprintf(stderr, "test_tokenizer: '%s' gave", text);
        for (int64_t i = 0; ids && i < n; i++) fprintf(stderr, " %" PRId32, ids[i]);
        fprintf(stderr, "\n");
    }
    free(ids);
    return ok;
}

static bool text_is(const luma_vocab *v, const int32_t *ids, int64_t n, bool special, const char *want)
{
    size_t len;
    char *s = luma_test_detokenize(v, ids, n, special, &len);
    bool ok = s && len == strlen(want) && memcmp(s, want, len) == 0;
    if (!ok) fprintf(stderr, "test_tokenizer: detokenized to '%s', want '%s'\n", s ? s : "(error)", want);
    free(s);
    return ok;
}

/* SPM: ids 0..2 <unk> <s> </s>, 3..258 the byte tokens, then the rest. */
enum { S_A = 259, S_B, S_AB, S_SP, S_SPAB, S_SPA, S_START, S_IMEND, S_HASH, S_SP2, S_N };

static void test_spm_small(void)
{
    int before = failures;
    static tok toks[S_N];
    static char bytes[256][7];
    toks[0] = (tok){"<unk>", LUMA_TOKEN_UNKNOWN, 0};
    toks[1] = (tok){"<s>", LUMA_TOKEN_CONTROL, 0};
    toks[2] = (tok){"</s>", LUMA_TOKEN_CONTROL, 0};
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        toks[3 + b] = (tok){bytes[b], LUMA_TOKEN_BYTE, 0};
    }
    toks[S_A] = (tok){"a", LUMA_TOKEN_NORMAL, -3};
    toks[S_B] = (tok){"b", LUMA_TOKEN_NORMAL, -3};
    toks[S_AB] = (tok){"ab", LUMA_TOKEN_NORMAL, -2};
    toks[S_SP] = (tok){"\xe2\x96\x81", LUMA_TOKEN_NORMAL, -3};
    toks[S_SPAB] = (tok){"\xe2\x96\x81" "ab", LUMA_TOKEN_NORMAL, -1};
    toks[S_SPA] = (tok){"\xe2\x96\x81" "a", LUMA_TOKEN_NORMAL, -1.5f};
    toks[S_START] = (tok){"<start>", LUMA_TOKEN_CONTROL, 0};
    toks[S_IMEND] = (tok){"<|im_end|>", LUMA_TOKEN_NORMAL, 0};
    toks[S_HASH] = (tok){"##", LUMA_TOKEN_USER_DEFINED, 0};
    toks[S_SP2] = (tok){"\xe2\x96\x81\xe2\x96\x81", LUMA_TOKEN_NORMAL, -0.5f};
    luma_err err;
    luma_vocab *v = make_vocab("llama", NULL, toks, S_N, NULL, 0, false, &err);
    if (!v) {
        failures++;
        printf("test_tokenizer: small SPM vocabulary: FAILED to load: %s\n", err.msg);
        return;
    }
    const luma_vocab_special *sp = luma_vocab_specials(v);
    CHECK(luma_vocab_kind(v) == LUMA_VOCAB_SPM && strcmp(luma_vocab_pre(v), "default") == 0);
    CHECK(sp->bos == 1 && sp->eos == 2 && sp->unk == 0 && sp->add_bos && !sp->add_eos);
    CHECK(sp->nl == 3 + '\n');
    /* <|im_end|> is found by its text: end of turn, end of generation, control */
    CHECK(sp->eot == S_IMEND && luma_vocab_type(v, S_IMEND) == LUMA_TOKEN_CONTROL);
    CHECK(luma_vocab_is_eog(v, S_IMEND) && luma_vocab_is_eog(v, 2) && !luma_vocab_is_eog(v, 1));
    CHECK(luma_vocab_find(v, "ab", 2) == S_AB && luma_vocab_find(v, "abc", 3) == -1);

    /* the space prefix; highest score first: "▁a" + "b" loses to "▁" + ... "▁ab" */
    CHECK(ids_are(v, "ab", false, false, (int32_t[]){S_SPAB}, 1));
    CHECK(ids_are(v, "ab", true, false, (int32_t[]){1, S_SPAB}, 2));
    CHECK(ids_are(v, "", true, false, (int32_t[]){1}, 1));
    CHECK(ids_are(v, "", false, false, NULL, 0));
    CHECK(ids_are(v, "a  ab", false, false, (int32_t[]){S_SPA, S_SP2, S_AB}, 3));
    /* byte fallback, invalid UTF-8 included */
    CHECK(ids_are(v, "a\xc3\xa9\xff", false, false, (int32_t[]){S_SPA, 3 + 0xC3, 3 + 0xA9, 3 + 0xFF}, 4));
    /* control tokens only with parse_special; user-defined always; a space after each */
    CHECK(ids_are(v, "<start>ab", false, true, (int32_t[]){S_START, S_SPAB}, 2));
    CHECK(ids_are(v, "##ab", false, false, (int32_t[]){S_HASH, S_SPAB}, 2));
    CHECK(ids_are(v, "a##", false, false, (int32_t[]){S_SPA, S_HASH}, 2));
    int64_t n;
    int32_t *ids = luma_test_tokenize(v, "<start>", 7, false, false, &n);
    CHECK(ids && n > 1);
    for (int64_t i = 0; ids && i < n; i++) CHECK(ids[i] != S_START);
    free(ids);

    /* detokenizing: the space prefix goes, also after a leading BOS */
    CHECK(text_is(v, (int32_t[]){S_SPAB}, 1, false, "ab"));
    CHECK(text_is(v, (int32_t[]){1, S_SPAB, S_SPA}, 3, false, "ab a"));
    CHECK(text_is(v, (int32_t[]){1, S_SPAB}, 2, true, "<s> ab"));
    CHECK(text_is(v, (int32_t[]){S_SPA, 3 + 0xC3, 3 + 0xA9, S_HASH, S_START}, 5, false, "a\xc3\xa9##"));
    CHECK(luma_detokenize(v, (int32_t[]){S_N}, 1, false, NULL, 0, &err) == -1 && strstr(err.msg, "range"));
    char piece[8];
    CHECK(luma_token_piece(v, S_START, false, piece, sizeof piece) == 0);
    CHECK(luma_token_piece(v, S_START, true, piece, sizeof piece) == 7 && memcmp(piece, "<start>", 7) == 0);
    CHECK(luma_token_piece(v, 3 + 'A', false, piece, sizeof piece) == 1 && piece[0] == 'A');
    CHECK(luma_token_piece(v, -1, true, piece, sizeof piece) == 0);

    /* streaming: a character split over byte tokens is held, then released */
    luma_detok d;
    char out[64];
    luma_detok_init(&d);
    CHECK(luma_detok_push(&d, v, S_SPA, false, out, sizeof out) == 1 && out[0] == 'a');
    CHECK(luma_detok_push(&d, v, 3 + 0xE4, false, out, sizeof out) == 0);
    CHECK(luma_detok_push(&d, v, 3 + 0xB8, false, out, sizeof out) == 0);
    CHECK(luma_detok_push(&d, v, 3 + 0xAD, false, out, 0) == 3);     /* no room: state kept */
    CHECK(luma_detok_push(&d, v, 3 + 0xAD, false, out, sizeof out) == 3 && memcmp(out, "\xe4\xb8\xad", 3) == 0);
    /* a held prefix broken by the next byte becomes U+FFFD, the byte stays */
    CHECK(luma_detok_push(&d, v, 3 + 0xE4, false, out, sizeof out) == 0);
    CHECK(luma_detok_push(&d, v, S_AB, false, out, sizeof out) == 5 && memcmp(out, "\xef\xbf\xbd" "ab", 5) == 0);
    CHECK(luma_detok_push(&d, v, 3 + 0xFF, false, out, sizeof out) == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0);
    CHECK(luma_detok_push(&d, v, 3 + 0xF0, false, out, sizeof out) == 0);
    CHECK(luma_detok_flush(&d, out, 2) == 3);
    CHECK(luma_detok_flush(&d, out, sizeof out) == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0);
    CHECK(luma_detok_flush(&d, out, sizeof out) == 0);
    luma_detok_init(&d);
    CHECK(luma_detok_push(&d, v, 1, false, out, sizeof out) == 0);    /* BOS: nothing, prefix still due */
    CHECK(luma_detok_push(&d, v, S_SPAB, false, out, sizeof out) == 2 && memcmp(out, "ab", 2) == 0);
    CHECK(luma_detok_push(&d, v, S_SPAB, false, out, sizeof out) == 3 && memcmp(out, " ab", 3) == 0);
    CHECK(luma_detok_push(&d, v, S_N + 5, false, out, sizeof out) == 0);
    luma_vocab_free(v);
    printf("test_tokenizer: small SPM vocabulary (specials, byte fallback, streaming): %s\n",
           failures == before ? "ok" : "FAILED");
}

static void test_bpe_small(void)
{
    int before = failures;
    /* the 256 byte-level characters, then merged tokens */
    static tok toks[256 + 8];
    static char chars[256][4];
    for (int b = 0, extra = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        uint32_t cp = printable ? (uint32_t)b : 0x100 + (uint32_t)extra++;
        chars[b][luma_utf8_encode(cp, chars[b])] = 0;
        toks[b] = (tok){chars[b], LUMA_TOKEN_NORMAL, 0};
    }
    enum { HE = 256, LL, HELL, HELLO, GWORLD, EOT, N };
    toks[HE] = (tok){"he", LUMA_TOKEN_NORMAL, 0};
    toks[LL] = (tok){"ll", LUMA_TOKEN_NORMAL, 0};
    toks[HELL] = (tok){"hell", LUMA_TOKEN_NORMAL, 0};
    toks[HELLO] = (tok){"hello", LUMA_TOKEN_NORMAL, 0};
    toks[GWORLD] = (tok){"\xc4\xa0world", LUMA_TOKEN_NORMAL, 0};   /* "Ġworld" */
    toks[EOT] = (tok){"<|endoftext|>", LUMA_TOKEN_NORMAL, 0};
    static const char *const merges[] = {"h e", "l l", "he ll", "hell o", "e l"};
    luma_err err;
    luma_vocab *v = make_vocab("gpt2", "gpt-2", toks, N, merges, 5, true, &err);
    if (!v) {
        failures++;
        printf("test_tokenizer: small BPE vocabulary: FAILED to load: %s\n", err.msg);
        return;
    }
    CHECK(luma_vocab_kind(v) == LUMA_VOCAB_BPE && strcmp(luma_vocab_pre(v), "gpt-2") == 0);
    const luma_vocab_special *sp = luma_vocab_specials(v);
    CHECK(sp->bos == -1 && !sp->add_bos && sp->nl == '\n');
    CHECK(sp->eot == EOT && luma_vocab_is_eog(v, EOT) && luma_vocab_type(v, EOT) == LUMA_TOKEN_CONTROL);
    /* ranks, not scores: "h e" first, then "l l", then "he ll" */
    CHECK(ids_are(v, "hello", false, false, (int32_t[]){HELLO}, 1));
    CHECK(ids_are(v, "helo", false, false, (int32_t[]){HE, 'l', 'o'}, 3));
    /* no merges make "Ġworld" under gpt-2; llama-bpe takes a word that is a token whole */
    CHECK(ids_are(v, " world", false, false, (int32_t[]){' ', 'w', 'o', 'r', 'l', 'd'}, 6));
    CHECK(ids_are(v, "\xff", false, false, (int32_t[]){0xFF}, 1));
    CHECK(text_is(v, (int32_t[]){HELLO, ' ', 'w', '\n', 0xC3, 0xA9}, 6, false, "hello w\n\xc3\xa9"));
    CHECK(text_is(v, (int32_t[]){EOT}, 1, false, ""));
    CHECK(text_is(v, (int32_t[]){EOT}, 1, true, "<|endoftext|>"));
    CHECK(ids_are(v, "<|endoftext|>", false, true, (int32_t[]){EOT}, 1));
    luma_vocab_free(v);

    v = make_vocab("gpt2", "llama-bpe", toks, N, merges, 5, true, &err);
    CHECK(v && luma_vocab_specials(v)->add_bos && strcmp(luma_vocab_pre(v), "llama-bpe") == 0);
    if (v) {
        CHECK(ids_are(v, " world", false, false, (int32_t[]){GWORLD}, 1));
        /* add_bos without a BOS token is an error, not a crash */
        int32_t one[1];
        CHECK(luma_tokenize(v, "x", 1, true, false, one, 1, &err) == -1 && strstr(err.msg, "BOS"));
    }
    luma_vocab_free(v);

    /* errors name what is wrong */
    v = make_vocab("gpt2", "no-such-pre", toks, N, merges, 5, true, &err);
    CHECK(!v && strstr(err.msg, "no-such-pre"));
    v = make_vocab("gpt2", "default", toks, N, merges, 5, true, &err);
    CHECK(!v && strstr(err.msg, "default"));
    v = make_vocab("gpt2", NULL, toks, N, merges, 5, true, &err);
    CHECK(!v && strstr(err.msg, "tokenizer.ggml.pre"));
    v = make_vocab("gpt2", "gpt-2", toks, N, merges, 5, false, &err);
    CHECK(!v && strstr(err.msg, "merges"));
    v = make_vocab("bert", NULL, toks, N, NULL, 0, false, &err);
    CHECK(!v && strstr(err.msg, "bert"));
    printf("test_tokenizer: small BPE vocabulary (merges, ignore_merges, errors): %s\n",
           failures == before ? "ok" : "FAILED");
}

/* ---- test vectors: .inp texts and .out ids, llama.cpp's format ----------------------------- */

typedef struct vectors {
    char *inp, *out;
    size_t n;
    const char **text;
    size_t *len;
    int32_t **ids;
    int64_t *n_ids;
} vectors;

static void vectors_free(vectors *t)
{
    for (size_t i = 0; i < t->n; i++) free(t->ids[i]);
    free(t->text);
    free(t->len);
    free(t->ids);
    free(t->n_ids);
    free(t->inp);
    free(t->out);
}

/* Texts are separated by "\n__ggml_vocab_test__\n" (the last one follows it
 * too); each .out line holds one text's ids. */
static bool vectors_read(const char *stem, vectors *t)
{
    static const char sep[] = "\n__ggml_vocab_test__\n";
    char path[4096];
    size_t inp_len, out_len;
    memset(t, 0, sizeof *t);
    snprintf(path, sizeof path, "%s.inp", stem);
    t->inp = read_file(path, &inp_len);
    snprintf(path, sizeof path, "%s.out", stem);
    t->out = read_file(path, &out_len);
    if (!t->inp || !t->out) return false;
    size_t cap = inp_len / (sizeof sep - 1) + 2;
    t->text = malloc(sizeof *t->text * cap);
    t->len = malloc(sizeof *t->len * cap);
    t->ids = calloc(cap, sizeof *t->ids);
    t->n_ids = malloc(sizeof *t->n_ids * cap);
    for (size_t pos = 0; pos < inp_len;) {
        char *next = strstr(t->inp + pos, sep);
        size_t end = next ? (size_t)(next - t->inp) : inp_len;
        t->text[t->n] = t->inp + pos;
        t->len[t->n++] = end - pos;
        pos = next ? end + sizeof sep - 1 : inp_len;
    }
    char *line = t->out;
    for (size_t i = 0; i < t->n; i++) {
        char *nl = strchr(line, '\n');
        if (!nl) return false;
        *nl = 0;
        t->ids[i] = malloc(sizeof *t->ids[i] * (strlen(line) / 2 + 1));
        int64_t k = 0;
        for (char *p = line;;) {
            char *e;
            long id = strtol(p, &e, 10);
            if (e == p) break;
            t->ids[i][k++] = (int32_t)id;
            p = e;
        }
        t->n_ids[i] = k;
        line = nl + 1;
    }
    return true;
}

static bool has_spm_space(const char *s, size_t n)
{
    for (size_t i = 0; i + 3 <= n; i++)
        if (memcmp(s + i, "\xe2\x96\x81", 3) == 0) return true;
    return false;
}

/* Tokenizes every vector; counts exact matches and round trips (the
 * detokenized ids give the text back) over the texts that can round-trip:
 * SPM reads a U+2581 in the text as a space. */
static void run_vectors(const luma_vocab *v, const vectors *t, bool add_special, bool parse_special,
                        int *passed, int *round_trips, int *can_round_trip)
{
    *passed = *round_trips = *can_round_trip = 0;
    for (size_t i = 0; i < t->n; i++) {
        int64_t n;
        int32_t *ids = luma_test_tokenize(v, t->text[i], t->len[i], add_special, parse_special, &n);
        if (ids && same_ids(ids, n, t->ids[i], t->n_ids[i])) {
            (*passed)++;
        } else {
            fprintf(stderr, "test_tokenizer: mismatch on '%.*s':\n  got ", (int)t->len[i], t->text[i]);
            for (int64_t j = 0; ids && j < n; j++) fprintf(stderr, " %" PRId32, ids[j]);
            fprintf(stderr, "\n  want");
            for (int64_t j = 0; j < t->n_ids[i]; j++) fprintf(stderr, " %" PRId32, t->ids[i][j]);
            fprintf(stderr, "\n");
        }
        free(ids);
        if (luma_vocab_kind(v) == LUMA_VOCAB_SPM && has_spm_space(t->text[i], t->len[i])) continue;
        (*can_round_trip)++;
        /* without BOS, detokenizing gives the text back; special tokens parsed
         * from the text come back when rendered */
        int64_t m;
        int32_t *plain = luma_test_tokenize(v, t->text[i], t->len[i], false, parse_special, &m);
        size_t len;
        char *back = plain ? luma_test_detokenize(v, plain, m, parse_special, &len) : NULL;
        if (back && len == t->len[i] && memcmp(back, t->text[i], len) == 0) (*round_trips)++;
        else fprintf(stderr, "test_tokenizer: round trip of '%.*s' gave '%s'\n", (int)t->len[i], t->text[i],
                     back ? back : "(error)");
        free(back);
        free(plain);
    }
}

/* Random strings of pieces chosen to stress the tokenizers (runs of spaces
 * and newlines, contractions, digits, special-token text, multi-byte and
 * invalid UTF-8) stream in valid UTF-8 chunks that join to the full text
 * when it is valid, and round-trip where the vocabulary allows: BPE always;
 * SPM for valid UTF-8 (an invalid lead byte swallows the U+2581 of a
 * following space into its byte fallback, as in llama.cpp), and with
 * special parsing only without a space prefix (SPM adds one after each
 * special token). */
static void random_round_trips(const luma_vocab *v, const char *name, bool space_prefix)
{
    static const char *const parts[] = {
        " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "a", "Zq", "17", "4096", "'s", "'LL", "!?",
        "<start_of_turn>", "<end_of_turn>", "<eos>", "<s>", "</s>", "<|endoftext|>", "<unk>",
        "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "\xd0\xbc\xd0\xb8\xd1\x80", "\xe0\xa4\xa8",
        "\xc2\xa0",
        "\xc3", "\xff", "\x80", "\xed\xa0\x80", "\xe4\xb8",      /* invalid: the last 5 */
    };
    const size_t n_parts = sizeof parts / sizeof parts[0];
    int before = failures, n_cases = 0, n_round_trips = 0;
    uint64_t seed = 0x2545F4914F6CDD1Dull;
    for (int c = 0; c < 300; c++) {
        char text[512];
        size_t len = 0;
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        for (int k = (int)(seed >> 59); k > 0; k--) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            /* two strings in three are valid UTF-8 */
            const char *p = parts[(seed >> 33) % (c % 3 ? n_parts - 5 : n_parts)];
            memcpy(text + len, p, strlen(p));
            len += strlen(p);
        }
        bool special = c % 2;
        int64_t n;
        int32_t *ids = luma_test_tokenize(v, text, len, false, special, &n);
        size_t back_len = 0, got_len = 0;
        char *back = ids ? luma_test_detokenize(v, ids, n, special, &back_len) : NULL, *got = NULL;
        bool spm = luma_vocab_kind(v) == LUMA_VOCAB_SPM;
        if (!spm || (luma_test_utf8_valid(text, len) && !(special && space_prefix))) {
            CHECK(back && back_len == len && memcmp(back, text, len) == 0);
            n_round_trips++;
        }
        CHECK(ids && luma_test_stream(v, ids, n, special, &got, &got_len));
        if (back && luma_test_utf8_valid(back, back_len))
            CHECK(got && got_len == back_len && memcmp(got, back, got_len) == 0);
        n_cases++;
        free(got);
        free(back);
        free(ids);
    }
    printf("test_tokenizer: %s: %d random strings stream, %d of them round-trip: %s\n", name, n_cases,
           n_round_trips, failures == before ? "ok" : "FAILED");
}

static luma_vocab *open_vocab(const char *path, double *ms)
{
    luma_gguf *g = NULL;
    luma_vocab *v = NULL;
    luma_err err;
    if (luma_gguf_open(path, &g, &err) == 0) {
        double t0 = now_ms();
        if (luma_vocab_load(g, &v, &err) != 0) v = NULL;
        if (ms) *ms = now_ms() - t0;
        luma_gguf_close(g);
    }
    if (!v) fprintf(stderr, "test_tokenizer: %s: %s\n", path, err.msg);
    return v;
}

static void test_shared(void)
{
    static const char *const names[] = {"ggml-vocab-llama-spm", "ggml-vocab-gpt-2"};
    struct stat st;
    if (stat(LUMA_SOURCE_DIR "/../shared/testdata/tokenizer", &st) != 0) {
        printf("test_tokenizer: shared tokenizer vectors (../shared/testdata/tokenizer) absent: "
               "that suite did not run\n");
        return;
    }
    for (size_t i = 0; i < 2; i++) {
        char stem[4096];
        snprintf(stem, sizeof stem, "%s/../shared/testdata/tokenizer/%s.gguf", LUMA_SOURCE_DIR, names[i]);
        vectors t;
        luma_vocab *v = open_vocab(stem, NULL);
        if (!v || !vectors_read(stem, &t) || t.n == 0) {
            failures++;
            printf("test_tokenizer: %s: FAILED to read the vocabulary or its vectors\n", names[i]);
            luma_vocab_free(v);
            vectors_free(&t);
            continue;
        }
        int passed, round_trips, can;
        run_vectors(v, &t, false, false, &passed, &round_trips, &can);
        if (passed != (int)t.n || round_trips != can) failures++;
        printf("test_tokenizer: %s: %d/%zu passed, %d/%d round trips\n", names[i], passed, t.n,
               round_trips, can);
        random_round_trips(v, names[i], i == 0);
        luma_vocab_free(v);
        vectors_free(&t);
    }
}

/* ---- Gemma 3 ------------------------------------------------------------------------------ */

static void test_gemma_stream(const luma_vocab *v)
{
    static const char *const texts[] = {
        "人工智能正在改变世界。今天天气很好！",
        "👨‍👩‍👧‍👦🏳️‍🌈🇫🇷 😀😁😂 🦙",
        "नमस्ते दुनिया! 안녕하세요 مرحبا Привет",
        "𓀀𓀁𓀂 𒀀𒀁 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    };
    int before = failures, byte_tokens = 0, chunks = 0;
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        int64_t n;
        int32_t *ids = luma_test_tokenize(v, texts[i], strlen(texts[i]), true, false, &n);
        CHECK(ids != NULL);
        if (!ids) continue;
        for (int64_t j = 0; j < n; j++) byte_tokens += luma_vocab_type(v, ids[j]) == LUMA_TOKEN_BYTE;
        size_t full_len = 0, got_len = 0;
        char *full = luma_test_detokenize(v, ids, n, false, &full_len), *got = NULL;
        CHECK(luma_test_stream(v, ids, n, false, &got, &got_len));
        CHECK(full && got && full_len == got_len && memcmp(full, got, got_len) == 0);
        CHECK(full && full_len == strlen(texts[i]) && memcmp(full, texts[i], full_len) == 0);
        chunks += (int)n;
        free(full);
        free(got);
        free(ids);
    }
    /* the last text has characters Gemma spells with byte tokens */
    CHECK(byte_tokens >= 8);
    printf("test_tokenizer: gemma3 streaming detokenizer: %d tokens (%d byte tokens) in valid UTF-8 "
           "chunks, joined = full text: %s\n", chunks, byte_tokens, failures == before ? "ok" : "FAILED");
}

static void test_gemma(void)
{
    char path[4096];
    if (!luma_test_model_path(path, sizeof path)) {
        failures++;
        printf("test_tokenizer: FAILED: the default model is missing (%s); set LUMA_MODEL or fetch "
               "gemma-3-270m-q4_k_m.gguf into ~/.cache/luma/models\n", path);
        return;
    }
    double ms = 0;
    luma_vocab *v = open_vocab(path, &ms);
    if (!v) {
        failures++;
        printf("test_tokenizer: gemma3: FAILED to load the vocabulary\n");
        return;
    }
    int before = failures;
    const luma_vocab_special *sp = luma_vocab_specials(v);
    CHECK(luma_vocab_size(v) == 262144 && luma_vocab_kind(v) == LUMA_VOCAB_SPM);
    CHECK(sp->bos == 2 && sp->eos == 1 && sp->unk == 3 && sp->pad == 0 && sp->add_bos && !sp->add_eos);
    CHECK(sp->eot == 106 && luma_vocab_is_eog(v, 106) && luma_vocab_is_eog(v, 1) && !luma_vocab_is_eog(v, 105));
    CHECK(luma_vocab_find(v, "<start_of_turn>", 15) == 105);
    CHECK(luma_vocab_max_piece(v) >= 31);
    /* well under a second on one core; the bound leaves room for sanitizers */
    CHECK(ms < 3000);
    printf("test_tokenizer: gemma3 vocabulary: loaded in %.0f ms, specials: %s\n", ms,
           failures == before ? "ok" : "FAILED");

    static const struct { const char *stem; bool special; } sets[] = {
        {LUMA_SOURCE_DIR "/spec/data/gemma3-tokenizer", false},
        {LUMA_SOURCE_DIR "/spec/data/gemma3-tokenizer-special", true},
    };
    int total = 0;
    for (size_t i = 0; i < 2; i++) {
        vectors t;
        if (!vectors_read(sets[i].stem, &t)) {
            failures++;
            printf("test_tokenizer: %s: FAILED to read\n", sets[i].stem);
            vectors_free(&t);
            continue;
        }
        int passed, round_trips, can;
        run_vectors(v, &t, sets[i].special, sets[i].special, &passed, &round_trips, &can);
        if (passed != (int)t.n || round_trips != can || can < (int)t.n - 1) failures++;
        total += (int)t.n;
        printf("test_tokenizer: %s (add_special=%d, parse_special=%d): %d/%zu passed, "
               "%d/%d round trips (texts with U+2581 excluded)\n",
               strrchr(sets[i].stem, '/') + 1, sets[i].special, sets[i].special, passed, t.n,
               round_trips, can);
        vectors_free(&t);
    }
    if (total < 50) failures++;
    random_round_trips(v, "gemma3", false);
    test_gemma_stream(v);
    luma_vocab_free(v);
}

int main(void)
{
    test_unicode();
    test_pretok_golden();
    test_spm_small();
    test_bpe_small();
    test_shared();
    test_gemma();
    if (failures) {
        printf("test_tokenizer: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_tokenizer: all passed\n");
    return 0;
}
