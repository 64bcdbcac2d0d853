/* Tokenizers, following llama.cpp's llama-vocab.cpp so that ids match it:
 *
 *   text --(special tokens split out: longest first)--> fragments
 *   SPM fragment: spaces -> U+2581, split into UTF-8 units, then the bigram
 *                 of highest score merged first while it is a token; pieces
 *                 that are no token fall back to byte tokens <0xXX>.
 *   BPE fragment: pre-tokenizer (a hand-written state machine per regex)
 *                 -> words, bytes -> GPT-2 byte-level characters, then the
 *                 merge of lowest rank applied first.
 *
 * Token texts live back to back in one buffer; an open-addressing table maps
 * text to id, another maps a merge's (left, right) texts to its rank. */
#include "tokenizer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unicode.h"

#define SPM_SPACE "\xe2\x96\x81"    /* U+2581, SentencePiece's visible space */
#define SPM_SPACE_LEN 3

enum pre_kind { PRE_DEFAULT, PRE_GPT2, PRE_LLAMA3, PRE_QWEN2 };

static const char *const pre_names[] = {"default", "gpt-2", "llama-bpe", "qwen2"};

/* The names llama.cpp maps to these regexes. llama-bpe and its closest
 * aliases also skip merges for a word that is already a token, and add BOS
 * unless the metadata says otherwise. */
static const struct pre_alias {
    const char *name;
    enum pre_kind kind;
    bool ignore_merges, add_bos;
} pre_aliases[] = {
    {"default", PRE_DEFAULT, false, false},
    {"gpt-2", PRE_GPT2, false, false},
    {"phi-2", PRE_GPT2, false, false},
    {"mpt", PRE_GPT2, false, false},
    {"olmo", PRE_GPT2, false, false},
    {"llama-bpe", PRE_LLAMA3, true, true},
    {"llama3", PRE_LLAMA3, true, true},
    {"llama-v3", PRE_LLAMA3, true, true},
    {"falcon3", PRE_LLAMA3, true, true},
    {"pixtral", PRE_LLAMA3, true, true},
    {"dbrx", PRE_LLAMA3, false, false},
    {"smaug-bpe", PRE_LLAMA3, false, false},
    {"qwen2", PRE_QWEN2, false, false},
    {"deepseek-r1-qwen", PRE_QWEN2, false, false},
    {"megrez", PRE_QWEN2, false, false},
    {"stablelm2", PRE_QWEN2, false, false},
};

static const struct pre_alias *find_pre(const char *name, size_t len)
{
    for (size_t i = 0; i < sizeof pre_aliases / sizeof pre_aliases[0]; i++)
        if (strlen(pre_aliases[i].name) == len && memcmp(pre_aliases[i].name, name, len) == 0)
            return &pre_aliases[i];
    return NULL;
}

/* Tokens whose text marks the end of a turn, after llama.cpp: the first
 * present becomes eot when the metadata names none; all of them, eos, eot
 * and eom end generation. */
static const char *const eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
};
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "</s>", "<eos>",
};

/* Special tokens of one text length: those recognized in text are found by
 * hashing the substring at each position whose first and last bytes can
 * start and end one. Bit b of a set: some token has byte b there. */
typedef struct special_group {
    size_t len;
    uint64_t first_any[4], last_any[4];     /* control, unknown and user-defined tokens */
    uint64_t first_user[4], last_user[4];   /* user-defined tokens */
} special_group;

typedef struct merge {
    size_t off;                 /* of the left text in merge_text; right follows a space */
    size_t left_len, right_len;
} merge;

struct luma_vocab {
    enum luma_vocab_kind kind;
    enum pre_kind pre;
    bool add_space_prefix, ignore_merges;
    int32_t n;
    char *text;                 /* every token's text, back to back */
    size_t *text_off;           /* n + 1 */
    float *score;
    uint8_t *type;              /* enum luma_token_type */
    char *piece;                /* every token's piece (special = true), back to back */
    size_t *piece_off;          /* n + 1 */
    size_t max_piece;
    int32_t *slot;              /* text -> id: open addressing, -1 empty */
    size_t slot_mask;
    char *merge_text;
    merge *merges;
    int32_t n_merges;
    int32_t *merge_slot;        /* (left, right) -> merge index = rank */
    size_t merge_mask;
    int32_t byte_token[256];    /* the token of each byte, -1 where none */
    special_group *groups;      /* longest first */
    size_t n_groups;
    int32_t *eog;
    size_t n_eog;
    luma_vocab_special sp;
};

/* ---- growable arrays ---------------------------------------------------- */

static int grow(void **p, size_t *cap, size_t need, size_t elem, luma_err *err)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        if (n > SIZE_MAX / 2) return luma_errf(err, "tokenizer: out of memory");
        n *= 2;
    }
    size_t bytes;
    if (luma_mul_size(n, elem, &bytes)) return luma_errf(err, "tokenizer: out of memory");
    void *q = realloc(*p, bytes);
    if (!q) return luma_errf(err, "tokenizer: out of memory (%zu bytes)", bytes);
    *p = q;
    *cap = n;
    return 0;
}

typedef struct ids_vec {
    int32_t *v;
    size_t n, cap;
} ids_vec;

static int push_id(ids_vec *o, int32_t id, luma_err *err)
{
    if (grow((void **)&o->v, &o->cap, o->n + 1, sizeof *o->v, err)) return -1;
    o->v[o->n++] = id;
    return 0;
}

/* ---- hashing ------------------------------------------------------------ */

static uint64_t hash_bytes(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

#define HASH_SEED 0xcbf29ce484222325ull

/* A power of two at least twice n (load factor at most 1/2), or 0. */
static size_t table_size(size_t n)
{
    size_t size = 16;
    while (size / 2 < n) {
        if (size > SIZE_MAX / 4) return 0;
        size *= 2;
    }
    return size;
}

static luma_str token_str(const luma_vocab *v, int32_t id)
{
    return (luma_str){v->text + v->text_off[id], v->text_off[id + 1] - v->text_off[id]};
}

int32_t luma_vocab_find(const luma_vocab *v, const char *text, size_t len)
{
    size_t i = (size_t)hash_bytes(HASH_SEED, text, len) & v->slot_mask;
    for (;; i = (i + 1) & v->slot_mask) {
        int32_t id = v->slot[i];
        if (id < 0) return -1;
        luma_str t = token_str(v, id);
        if (t.len == len && memcmp(t.ptr, text, len) == 0) return id;
    }
}

static uint64_t hash_pair(const char *a, size_t an, const char *b, size_t bn)
{
    uint64_t h = hash_bytes(HASH_SEED, a, an);
    h = (h ^ 0x100) * 0x100000001b3ull;     /* a separator no byte equals */
    return hash_bytes(h, b, bn);
}

/* The rank of merging a then b, or -1. */
static int32_t merge_rank(const luma_vocab *v, const char *a, size_t an, const char *b, size_t bn)
{
    size_t i = (size_t)hash_pair(a, an, b, bn) & v->merge_mask;
    for (;; i = (i + 1) & v->merge_mask) {
        int32_t r = v->merge_slot[i];
        if (r < 0) return -1;
        const merge *m = &v->merges[r];
        const char *l = v->merge_text + m->off;
        if (m->left_len == an && m->right_len == bn && memcmp(l, a, an) == 0 &&
            memcmp(l + an + 1, b, bn) == 0)
            return r;
    }
}

/* ---- GPT-2 byte-level alphabet -------------------------------------------
 * Printable bytes (! to ~, ¡ to ¬, ® to ÿ) stand for themselves; the other
 * 68 map in order to U+0100 and up. */

static uint32_t byte_to_cp(unsigned char b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    if (b <= 0x20) return 0x100 + b;
    if (b <= 0xA0) return 0x100 + 33 + (b - 0x7F);
    return 0x100 + 67;  /* 0xAD */
}

/* The byte a byte-level character stands for, or -1. */
static int cp_to_byte(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF))
        return (int)cp;
    if (cp < 0x100 || cp >= 0x100 + 68) return -1;
    uint32_t i = cp - 0x100;
    if (i <= 0x20) return (int)i;
    if (i < 33 + 34) return (int)(i - 33 + 0x7F);
    return 0xAD;
}

/* ---- pre-tokenizers ------------------------------------------------------
 * Each regex is matched by hand over code points, the way llama.cpp's
 * unicode_regex_split_custom_* do: at each position the alternatives are
 * tried in the regex's order and the first that matches ends a piece. */

enum { CF_LETTER = 1, CF_NUMBER = 2, CF_SPACE = 4, CF_IN = 8 };

typedef struct scratch {
    char *buf;                  /* escaped or byte-encoded text */
    size_t buf_cap;
    uint32_t *cp;               /* code points of the text being split ... */
    uint8_t *cf;                /* ... their CF_* flags ... */
    size_t *cp_off;             /* ... and byte offsets (n + 1) */
    size_t cp_cap, cpf_cap, off_cap;
    size_t *ends;               /* piece ends, in bytes */
    size_t n_ends, ends_cap;
    struct sym *syms;
    size_t syms_cap;
    struct bigram *heap;
    size_t heap_n, heap_cap;
} scratch;

static void scratch_free(scratch *s)
{
    free(s->buf);
    free(s->cp);
    free(s->cf);
    free(s->cp_off);
    free(s->ends);
    free(s->syms);
    free(s->heap);
}

/* Decodes text into s->cp / s->cf / s->cp_off; returns the code point count
 * or -1. Invalid bytes count as U+FFFD (a symbol). */
static int64_t decode_text(scratch *s, const char *text, size_t len, luma_err *err)
{
    size_t need;
    if (luma_add_size(len, 1, &need)) return luma_errf(err, "tokenizer: text too long");
    if (grow((void **)&s->cp, &s->cp_cap, need, sizeof *s->cp, err) ||
        grow((void **)&s->cf, &s->cpf_cap, need, sizeof *s->cf, err) ||
        grow((void **)&s->cp_off, &s->off_cap, need, sizeof *s->cp_off, err))
        return -1;
    size_t n = 0;
    for (size_t at = 0; at < len; n++) {
        uint32_t c;
        size_t k = luma_utf8_decode(text + at, len - at, &c);
        if (c == LUMA_UTF8_INVALID) c = 0xFFFD;
        enum luma_ucat cat = luma_unicode_category(c);
        s->cp[n] = c;
        s->cf[n] = (uint8_t)(CF_IN | (cat == LUMA_UCAT_LETTER ? CF_LETTER : 0) |
                             (cat == LUMA_UCAT_NUMBER ? CF_NUMBER : 0) |
                             (luma_unicode_is_space(c) ? CF_SPACE : 0));
        s->cp_off[n] = at;
        at += k;
    }
    s->cp_off[n] = len;
    return (int64_t)n;
}

typedef struct splitter {
    scratch *s;
    size_t n, prev;             /* code point count; end of the last piece */
    luma_err *err;
    int failed;
} splitter;

static uint32_t sp_cp(const splitter *p, size_t i) { return i < p->n ? p->s->cp[i] : 0xFFFFFFFFu; }
static unsigned sp_cf(const splitter *p, size_t i) { return i < p->n ? p->s->cf[i] : 0; }

static void sp_add(splitter *p, size_t end)
{
    if (end <= p->prev || p->failed) return;
    if (grow((void **)&p->s->ends, &p->s->ends_cap, p->s->n_ends + 1, sizeof *p->s->ends, p->err)) {
        p->failed = 1;
        return;
    }
    p->s->ends[p->s->n_ends++] = p->s->cp_off[end];
    p->prev = end;
}

static uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 's|'t|'re|'ve|'m|'ll|'d (case-insensitive when fold): the length, or 0. */
static size_t contraction(const splitter *p, size_t pos, bool fold)
{
    if (sp_cp(p, pos) != '\'' || pos + 1 >= p->n) return 0;
    uint32_t a = sp_cp(p, pos + 1), b = sp_cp(p, pos + 2);
    if (fold) {
        a = ascii_lower(a);
        b = ascii_lower(b);
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 < p->n && ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')))
        return 3;
    return 0;
}

#define NOT_SLN(f) (!((f) & (CF_SPACE | CF_LETTER | CF_NUMBER)) && ((f) & CF_IN))

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void split_gpt2(splitter *p)
{
    for (size_t pos = 0; pos < p->n;) {
        uint32_t c = sp_cp(p, pos);
        size_t k = contraction(p, pos, false);
        if (k) {
            pos += k;
            sp_add(p, pos);
            continue;
        }
        unsigned f2 = c == ' ' ? sp_cf(p, pos + 1) : sp_cf(p, pos);
        if (f2 & CF_LETTER) {
            pos += c == ' ';
            while (sp_cf(p, pos) & CF_LETTER) pos++;
            sp_add(p, pos);
            continue;
        }
        if (f2 & CF_NUMBER) {
            pos += c == ' ';
            while (sp_cf(p, pos) & CF_NUMBER) pos++;
            sp_add(p, pos);
            continue;
        }
        if (NOT_SLN(f2)) {
            pos += c == ' ';
            while (NOT_SLN(sp_cf(p, pos))) pos++;
            sp_add(p, pos);
            continue;
        }
        size_t ws = 0;
        while (sp_cf(p, pos + ws) & CF_SPACE) ws++;
        if (ws > 1 && pos + ws < p->n) {    /* \s+(?!\S): leave the last space to the next word */
            pos += ws - 1;
            sp_add(p, pos);
            continue;
        }
        pos += ws ? ws : 1;
        sp_add(p, pos);
    }
}

/* (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+
 * |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * and, with max_digits 1, Qwen2's variant with \p{N}. */
static void split_llama3(splitter *p, size_t max_digits)
{
    for (size_t pos = 0; pos < p->n;) {
        uint32_t c = sp_cp(p, pos);
        unsigned f = sp_cf(p, pos);
        size_t k = contraction(p, pos, true);
        if (k) {
            pos += k;
            sp_add(p, pos);
            continue;
        }
        if (!(c == '\r' || c == '\n' || (f & CF_NUMBER)) &&
            ((f & CF_LETTER) || (sp_cf(p, pos + 1) & CF_LETTER))) {
            pos++;
            while (sp_cf(p, pos) & CF_LETTER) pos++;
            sp_add(p, pos);
            continue;
        }
        if (f & CF_NUMBER) {
            size_t start = pos;
            while ((sp_cf(p, pos) & CF_NUMBER) && pos - start < max_digits) pos++;
            sp_add(p, pos);
            continue;
        }
        unsigned f2 = c == ' ' ? sp_cf(p, pos + 1) : f;
        if (!(f2 & (CF_SPACE | CF_LETTER | CF_NUMBER)) && (f & CF_IN)) {
            pos += c == ' ';
            while (NOT_SLN(sp_cf(p, pos))) pos++;
            while (sp_cp(p, pos) == '\r' || sp_cp(p, pos) == '\n') pos++;
            sp_add(p, pos);
            continue;
        }
        size_t ws = 0, last_nl = 0;
        while (sp_cf(p, pos + ws) & CF_SPACE) {
            uint32_t w = sp_cp(p, pos + ws);
            if (w == '\r' || w == '\n') last_nl = pos + ws + 1;
            ws++;
        }
        if (last_nl) {                      /* \s*[\r\n]+ */
            pos = last_nl;
            sp_add(p, pos);
            continue;
        }
        if (ws > 1 && pos + ws < p->n) {    /* \s+(?!\S) */
            pos += ws - 1;
            sp_add(p, pos);
            continue;
        }
        pos += ws ? ws : 1;
        sp_add(p, pos);
    }
}

/* Fills s->ends with the byte end of each piece of text. */
static int pretokenize(enum pre_kind kind, scratch *s, const char *text, size_t len, luma_err *err)
{
    s->n_ends = 0;
    if (len == 0) return 0;
    if (kind == PRE_DEFAULT) {
        if (grow((void **)&s->ends, &s->ends_cap, 1, sizeof *s->ends, err)) return -1;
        s->ends[s->n_ends++] = len;
        return 0;
    }
    int64_t n = decode_text(s, text, len, err);
    if (n < 0) return -1;
    splitter p = {s, (size_t)n, 0, err, 0};
    if (kind == PRE_GPT2) split_gpt2(&p);
    else split_llama3(&p, kind == PRE_LLAMA3 ? 3 : 1);
    return p.failed ? -1 : 0;
}

int64_t luma_pretokenize(const char *pre, const char *text, size_t len, size_t *ends,
                         int64_t cap, luma_err *err)
{
    const struct pre_alias *a = find_pre(pre, strlen(pre));
    if (!a) return luma_errf(err, "unknown pre-tokenizer '%s'", pre);
    scratch s = {0};
    if (pretokenize(a->kind, &s, text, len, err)) {
        scratch_free(&s);
        return -1;
    }
    for (size_t i = 0; i < s.n_ends && (int64_t)i < cap; i++) ends[i] = s.ends[i];
    int64_t n = (int64_t)s.n_ends;
    scratch_free(&s);
    return n;
}

/* ---- merging -------------------------------------------------------------
 * Both tokenizers keep a linked list of symbols over one buffer and a heap
 * of candidate merges of neighbours. A candidate is stale when either side
 * has since been merged away or grown (its size no longer matches). */

typedef struct sym {
    size_t off, n;              /* bytes in scratch.buf; n = 0 once merged away */
    int32_t prev, next;
} sym;

typedef struct bigram {
    double key;                 /* SPM: score; BPE: -rank. Highest first ... */
    int32_t left, right;        /* ... then leftmost first */
    size_t size;
} bigram;

static bool bigram_before(const bigram *a, const bigram *b)
{
    return a->key > b->key || (a->key == b->key && a->left < b->left);
}

static int heap_push(scratch *s, bigram b, luma_err *err)
{
    if (grow((void **)&s->heap, &s->heap_cap, s->heap_n + 1, sizeof *s->heap, err)) return -1;
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = b;
    return 0;
}

static bigram heap_pop(scratch *s)
{
    bigram top = s->heap[0], last = s->heap[--s->heap_n];
    size_t i = 0, n = s->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && bigram_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!bigram_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}

/* Splits s->buf[0..len) into symbols of one UTF-8 unit each (by lead byte,
 * as llama.cpp does, cut at the end). Returns the count or -1. */
static int64_t make_symbols(scratch *s, size_t len, luma_err *err)
{
    if (len > INT32_MAX) return luma_errf(err, "tokenizer: text fragment of %zu bytes is too long", len);
    if (grow((void **)&s->syms, &s->syms_cap, len, sizeof *s->syms, err)) return -1;
    int32_t n = 0;
    for (size_t at = 0; at < len; n++) {
        size_t k = luma_utf8_lead_len((unsigned char)s->buf[at]);
        if (k > len - at) k = len - at;
        s->syms[n] = (sym){at, k, n - 1, at + k == len ? -1 : n + 1};
        at += k;
    }
    return n;
}

/* Cuts s->buf[0, n) into symbols, queues every pair of neighbours that
 * try_add accepts, and applies the queued merges until none is left (try_add
 * is called again for each new pair). Returns the symbol count, or -1. */
typedef int (*try_add_fn)(const luma_vocab *v, scratch *s, int32_t left, int32_t right, luma_err *err);

static int64_t merge_symbols(const luma_vocab *v, scratch *s, size_t n, try_add_fn try_add, luma_err *err)
{
    int64_t n_syms = make_symbols(s, n, err);
    if (n_syms < 0) return -1;
    s->heap_n = 0;
    for (int32_t i = 1; i < n_syms; i++)
        if (try_add(v, s, i - 1, i, err)) return -1;
    while (s->heap_n > 0) {
        bigram b = heap_pop(s);
        sym *l = &s->syms[b.left], *r = &s->syms[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s->syms[r->next].prev = b.left;
        if (try_add(v, s, l->prev, b.left, err) || try_add(v, s, b.left, l->next, err)) return -1;
    }
    return n_syms;
}

/* ---- SPM ------------------------------------------------------------------ */

static int spm_try_add(const luma_vocab *v, scratch *s, int32_t left, int32_t right, luma_err *err)
{
    if (left < 0 || right < 0) return 0;
    size_t size = s->syms[left].n + s->syms[right].n;
    int32_t id = luma_vocab_find(v, s->buf + s->syms[left].off, size);
    if (id < 0) return 0;
    return heap_push(s, (bigram){v->score[id], left, right, size}, err);
}

static int byte_fallback(const luma_vocab *v, unsigned char b, ids_vec *out, luma_err *err)
{
    int32_t id = v->byte_token[b] >= 0 ? v->byte_token[b] : v->sp.unk;
    if (id < 0) return luma_errf(err, "tokenizer: no token for byte 0x%02X and no unknown token", b);
    return push_id(out, id, err);
}

/* One fragment of text; prefix adds the SentencePiece space in front. */
static int spm_fragment(const luma_vocab *v, scratch *s, const char *text, size_t len, bool prefix,
                        ids_vec *out, luma_err *err)
{
    size_t cap;
    if (luma_add_size(len, 1, &cap) || luma_mul_size(cap, SPM_SPACE_LEN, &cap))
        return luma_errf(err, "tokenizer: text too long");
    if (grow((void **)&s->buf, &s->buf_cap, cap, 1, err)) return -1;
    size_t n = 0;
    if (prefix) {
        memcpy(s->buf, SPM_SPACE, SPM_SPACE_LEN);
        n = SPM_SPACE_LEN;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s->buf + n, SPM_SPACE, SPM_SPACE_LEN);
            n += SPM_SPACE_LEN;
        } else {
            s->buf[n++] = text[i];
        }
    }
    int64_t n_syms = merge_symbols(v, s, n, spm_try_add, err);
    if (n_syms < 0) return -1;
    /* A symbol left unmerged that is no token is one UTF-8 unit: bytes. */
    for (int32_t i = n_syms > 0 ? 0 : -1; i >= 0; i = s->syms[i].next) {
        const sym *y = &s->syms[i];
        int32_t id = luma_vocab_find(v, s->buf + y->off, y->n);
        if (id >= 0) {
            if (push_id(out, id, err)) return -1;
            continue;
        }
        for (size_t j = 0; j < y->n; j++)
            if (byte_fallback(v, (unsigned char)s->buf[y->off + j], out, err)) return -1;
    }
    return 0;
}

/* ---- BPE ------------------------------------------------------------------ */

static int bpe_try_add(const luma_vocab *v, scratch *s, int32_t left, int32_t right, luma_err *err)
{
    if (left < 0 || right < 0) return 0;
    const sym *l = &s->syms[left], *r = &s->syms[right];
    int32_t rank = merge_rank(v, s->buf + l->off, l->n, s->buf + r->off, r->n);
    if (rank < 0) return 0;
    return heap_push(s, (bigram){-(double)rank, left, right, l->n + r->n}, err);
}

/* One pre-tokenized word, raw bytes. */
static int bpe_word(const luma_vocab *v, scratch *s, const char *word, size_t len, ids_vec *out,
                    luma_err *err)
{
    size_t cap;
    if (luma_mul_size(len, 2, &cap)) return luma_errf(err, "tokenizer: text too long");
    if (grow((void **)&s->buf, &s->buf_cap, cap, 1, err)) return -1;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += luma_utf8_encode(byte_to_cp((unsigned char)word[i]), s->buf + n);
    if (v->ignore_merges) {
        int32_t id = luma_vocab_find(v, s->buf, n);
        if (id >= 0) return push_id(out, id, err);
    }
    int64_t n_syms = merge_symbols(v, s, n, bpe_try_add, err);
    if (n_syms < 0) return -1;
    for (int32_t i = n_syms > 0 ? 0 : -1; i >= 0; i = s->syms[i].next) {
        const sym *y = &s->syms[i];
        int32_t id = luma_vocab_find(v, s->buf + y->off, y->n);
        if (id >= 0) {
            if (push_id(out, id, err)) return -1;
            continue;
        }
        /* no token for the merged text: one per byte-level character, if any */
        for (size_t j = 0; j < y->n;) {
            size_t k = luma_utf8_lead_len((unsigned char)s->buf[y->off + j]);
            if (k > y->n - j) k = y->n - j;
            id = luma_vocab_find(v, s->buf + y->off + j, k);
            if (id >= 0 && push_id(out, id, err)) return -1;
            j += k;
        }
    }
    return 0;
}

static int bpe_fragment(const luma_vocab *v, scratch *s, const char *text, size_t len, ids_vec *out,
                        luma_err *err)
{
    if (pretokenize(v->pre, s, text, len, err)) return -1;
    /* bpe_word reuses the scratch buffers but not s->ends */
    size_t n_words = s->n_ends;
    size_t *ends = s->ends;
    s->ends = NULL;
    s->ends_cap = 0;
    int rc = 0;
    for (size_t i = 0, start = 0; i < n_words && rc == 0; start = ends[i], i++)
        rc = bpe_word(v, s, text + start, ends[i] - start, out, err);
    free(ends);
    return rc;
}

/* ---- special tokens in text ----------------------------------------------- */

typedef struct frag {
    size_t off, len;
    int32_t id;                 /* a recognized token, or -1 for text */
} frag;

typedef struct frag_vec {
    frag *v;
    size_t n, cap;
} frag_vec;

static int push_frag(frag_vec *f, frag x, luma_err *err)
{
    if (grow((void **)&f->v, &f->cap, f->n + 1, sizeof *f->v, err)) return -1;
    f->v[f->n++] = x;
    return 0;
}

static bool recognized(const luma_vocab *v, int32_t id, bool parse_special)
{
    uint8_t t = v->type[id];
    return t == LUMA_TOKEN_USER_DEFINED ||
           (parse_special && (t == LUMA_TOKEN_CONTROL || t == LUMA_TOKEN_UNKNOWN));
}

static bool bit_set(const uint64_t bits[4], unsigned char b) { return bits[b >> 6] >> (b & 63) & 1; }

/* Splits text into text fragments and recognized tokens: for each token
 * length, longest first, every occurrence in what is still text, leftmost
 * first (llama.cpp's tokenizer_st_partition goes token by token; the two
 * differ only for distinct tokens of one length that overlap). */
static int partition(const luma_vocab *v, const char *text, size_t len, bool parse_special,
                     frag_vec *f, luma_err *err)
{
    frag_vec next = {0};
    f->n = 0;
    if (len > 0 && push_frag(f, (frag){0, len, -1}, err)) return -1;
    for (size_t g = 0; g < v->n_groups; g++) {
        const special_group *grp = &v->groups[g];
        const uint64_t *first = parse_special ? grp->first_any : grp->first_user;
        const uint64_t *last = parse_special ? grp->last_any : grp->last_user;
        if (!(first[0] | first[1] | first[2] | first[3])) continue;
        next.n = 0;
        for (size_t i = 0; i < f->n; i++) {
            frag x = f->v[i];
            if (x.id >= 0 || x.len < grp->len) {
                if (push_frag(&next, x, err)) goto fail;
                continue;
            }
            size_t start = x.off, end = x.off + x.len;
            for (size_t p = x.off; p + grp->len <= end;) {
                int32_t id = -1;
                if (bit_set(first, (unsigned char)text[p]) &&
                    bit_set(last, (unsigned char)text[p + grp->len - 1])) {
                    id = luma_vocab_find(v, text + p, grp->len);
                    if (id >= 0 && !recognized(v, id, parse_special)) id = -1;
                }
                if (id < 0) {
                    p++;
                    continue;
                }
                if (p > start && push_frag(&next, (frag){start, p - start, -1}, err)) goto fail;
                if (push_frag(&next, (frag){p, grp->len, id}, err)) goto fail;
                p += grp->len;
                start = p;
            }
            if (end > start && push_frag(&next, (frag){start, end - start, -1}, err)) goto fail;
        }
        frag_vec t = *f;
        *f = next;
        next = t;
    }
    free(next.v);
    return 0;
fail:
    free(next.v);
    return -1;
}

static int tokenize_into(const luma_vocab *v, const char *text, size_t len, bool add_special,
                         bool parse_special, ids_vec *out, luma_err *err)
{
    frag_vec f = {0};
    scratch s = {0};
    int rc = -1;
    if (partition(v, text, len, parse_special, &f, err)) goto done;
    if (add_special && v->sp.add_bos) {
        if (v->sp.bos < 0) {
            luma_errf(err, "tokenizer: the vocabulary adds BOS but has no BOS token");
            goto done;
        }
        if (push_id(out, v->sp.bos, err)) goto done;
    }
    bool after_special = true;  /* SPM prefixes a space at the start and after each token */
    for (size_t i = 0; i < f.n; i++) {
        const frag *x = &f.v[i];
        if (x->id >= 0) {
            if (push_id(out, x->id, err)) goto done;
            after_special = true;
            continue;
        }
        if (v->kind == LUMA_VOCAB_SPM) {
            if (spm_fragment(v, &s, text + x->off, x->len, v->add_space_prefix && after_special, out, err))
                goto done;
        } else if (bpe_fragment(v, &s, text + x->off, x->len, out, err)) {
            goto done;
        }
        after_special = false;
    }
    if (add_special && v->sp.add_eos) {
        if (v->sp.eos < 0) {
            luma_errf(err, "tokenizer: the vocabulary adds EOS but has no EOS token");
            goto done;
        }
        if (push_id(out, v->sp.eos, err)) goto done;
    }
    rc = 0;
done:
    free(f.v);
    scratch_free(&s);
    return rc;
}

int64_t luma_tokenize(const luma_vocab *v, const char *text, size_t len, bool add_special,
                      bool parse_special, int32_t *out, int64_t cap, luma_err *err)
{
    ids_vec ids = {0};
    if (tokenize_into(v, text, len, add_special, parse_special, &ids, err)) {
        free(ids.v);
        return -1;
    }
    size_t n = ids.n;
    if (cap > 0 && n > 0) memcpy(out, ids.v, ((size_t)cap < n ? (size_t)cap : n) * sizeof *out);
    free(ids.v);
    return (int64_t)n;
}

/* ---- pieces and detokenizing ---------------------------------------------- */

/* <0xXX>: the byte, or -1. */
static int byte_of_text(luma_str t)
{
    if (t.len != 6 || memcmp(t.ptr, "<0x", 3) != 0 || t.ptr[5] != '>') return -1;
    int b = 0;
    for (int i = 3; i < 5; i++) {
        char c = t.ptr[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
              : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        b = b * 16 + d;
    }
    return b;
}

/* Writes the piece of id (special = true) to out when out is not NULL;
 * returns its length. */
static size_t make_piece(const luma_vocab *v, int32_t id, char *out)
{
    luma_str t = token_str(v, id);
    size_t n = 0;
    switch (v->type[id]) {
    case LUMA_TOKEN_CONTROL:
    case LUMA_TOKEN_UNKNOWN:
    case LUMA_TOKEN_USER_DEFINED:
        if (out) memcpy(out, t.ptr, t.len);
        return t.len;
    case LUMA_TOKEN_BYTE: {
        int b = byte_of_text(t);
        if (b < 0) return 0;
        if (out) out[0] = (char)b;
        return 1;
    }
    case LUMA_TOKEN_NORMAL:
        break;
    default:
        return 0;
    }
    if (v->kind == LUMA_VOCAB_SPM) {
        for (size_t i = 0; i < t.len;) {
            if (t.len - i >= SPM_SPACE_LEN && memcmp(t.ptr + i, SPM_SPACE, SPM_SPACE_LEN) == 0) {
                if (out) out[n] = ' ';
                n++;
                i += SPM_SPACE_LEN;
            } else {
                if (out) out[n] = t.ptr[i];
                n++;
                i++;
            }
        }
        return n;
    }
    /* byte-level characters back to bytes; anything else is kept as is */
    for (size_t i = 0; i < t.len;) {
        uint32_t c;
        size_t k = luma_utf8_decode(t.ptr + i, t.len - i, &c);
        int b = c == LUMA_UTF8_INVALID ? -1 : cp_to_byte(c);
        if (b >= 0) {
            if (out) out[n] = (char)b;
            n++;
        } else {
            if (out) memcpy(out + n, t.ptr + i, k);
            n += k;
        }
        i += k;
    }
    return n;
}

static luma_str piece_of(const luma_vocab *v, int32_t id, bool special)
{
    if (id < 0 || id >= v->n) return (luma_str){"", 0};
    uint8_t t = v->type[id];
    if (!special && (t == LUMA_TOKEN_CONTROL || t == LUMA_TOKEN_UNKNOWN)) return (luma_str){"", 0};
    return (luma_str){v->piece + v->piece_off[id], v->piece_off[id + 1] - v->piece_off[id]};
}

size_t luma_token_piece(const luma_vocab *v, int32_t id, bool special, char *buf, size_t cap)
{
    luma_str p = piece_of(v, id, special);
    if (p.len > 0 && cap > 0) memcpy(buf, p.ptr, p.len < cap ? p.len : cap);
    return p.len;
}

int64_t luma_detokenize(const luma_vocab *v, const int32_t *ids, int64_t n, bool special,
                        char *buf, size_t cap, luma_err *err)
{
    size_t total = 0;
    bool strip = v->add_space_prefix;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= v->n)
            return luma_errf(err, "token id %" PRId32 " out of range (vocabulary of %" PRId32 ")",
                             ids[i], v->n);
        luma_str p = piece_of(v, ids[i], special);
        if (p.len == 0) continue;
        if (strip && p.ptr[0] == ' ') {
            p.ptr++;
            p.len--;
        }
        strip = false;
        if (total < cap) memcpy(buf + total, p.ptr, p.len < cap - total ? p.len : cap - total);
        if (luma_add_size(total, p.len, &total)) return luma_errf(err, "detokenize: text too long");
    }
    return (int64_t)total;
}

void luma_detok_init(luma_detok *d)
{
    memset(d, 0, sizeof *d);
    d->first = true;
}

typedef struct emitter {
    char *out;
    size_t cap, n;
} emitter;

static void emit(emitter *e, const void *p, size_t k)
{
    if (e->n < e->cap) memcpy(e->out + e->n, p, k < e->cap - e->n ? k : e->cap - e->n);
    e->n += k;
}

#define REPLACEMENT "\xef\xbf\xbd"

size_t luma_detok_push(luma_detok *d, const luma_vocab *v, int32_t id, bool special,
                       char *out, size_t cap)
{
    luma_str p = piece_of(v, id, special);
    const char *s = p.ptr;
    size_t len = p.len, pos = 0;
    if (d->first && len > 0 && v->add_space_prefix && s[0] == ' ') {
        s++;
        len--;
    }
    emitter e = {out, cap, 0};
    char pend[8];
    size_t np = (size_t)d->n_pending;
    memcpy(pend, d->pending, np);
    /* Complete the held character one byte at a time: each byte either
     * extends it or shows the held bytes were a maximal invalid subpart. */
    while (np > 0 && pos < len) {
        pend[np++] = s[pos++];
        uint32_t c;
        size_t k = luma_utf8_decode(pend, np, &c);
        if (c != LUMA_UTF8_INVALID) {
            emit(&e, pend, k);
            np = 0;
        } else if (k < np) {
            emit(&e, REPLACEMENT, 3);
            np = 0;
            pos--;
        }
    }
    while (pos < len) {
        uint32_t c;
        size_t k = luma_utf8_decode(s + pos, len - pos, &c);
        if (c != LUMA_UTF8_INVALID) {
            emit(&e, s + pos, k);
        } else if (pos + k == len && luma_utf8_incomplete_tail(s + pos, k) == k) {
            memcpy(pend, s + pos, k);
            np = k;
        } else {
            emit(&e, REPLACEMENT, 3);
        }
        pos += k;
    }
    if (e.n <= cap) {
        memcpy(d->pending, pend, np);
        d->n_pending = (int)np;
        if (p.len > 0) d->first = false;
    }
    return e.n;
}

size_t luma_detok_flush(luma_detok *d, char *out, size_t cap)
{
    if (d->n_pending == 0) return 0;
    if (cap >= 3) {
        memcpy(out, REPLACEMENT, 3);
        d->n_pending = 0;
    }
    return 3;
}

/* ---- accessors ------------------------------------------------------------ */

enum luma_vocab_kind luma_vocab_kind(const luma_vocab *v) { return v->kind; }
int32_t luma_vocab_size(const luma_vocab *v) { return v->n; }
const luma_vocab_special *luma_vocab_specials(const luma_vocab *v) { return &v->sp; }
const char *luma_vocab_pre(const luma_vocab *v) { return pre_names[v->pre]; }
enum luma_token_type luma_vocab_type(const luma_vocab *v, int32_t id) { return (enum luma_token_type)v->type[id]; }
luma_str luma_vocab_text(const luma_vocab *v, int32_t id) { return token_str(v, id); }
size_t luma_vocab_max_piece(const luma_vocab *v) { return v->max_piece; }

bool luma_vocab_is_eog(const luma_vocab *v, int32_t id)
{
    for (size_t i = 0; i < v->n_eog; i++)
        if (v->eog[i] == id) return true;
    return false;
}

/* ---- loading ---------------------------------------------------------------- */

void luma_vocab_free(luma_vocab *v)
{
    if (!v) return;
    free(v->text);
    free(v->text_off);
    free(v->score);
    free(v->type);
    free(v->piece);
    free(v->piece_off);
    free(v->slot);
    free(v->merge_text);
    free(v->merges);
    free(v->merge_slot);
    free(v->groups);
    free(v->eog);
    free(v);
}

static void *alloc_array(size_t n, size_t elem, luma_err *err)
{
    size_t bytes;
    if (luma_mul_size(n ? n : 1, elem, &bytes)) {
        luma_errf(err, "tokenizer: out of memory");
        return NULL;
    }
    void *p = malloc(bytes);
    if (!p) luma_errf(err, "tokenizer: out of memory (%zu bytes)", bytes);
    return p;
}

/* Token texts, the text -> id table. Empty texts become "[EMPTY_<id>]". */
static int load_texts(luma_vocab *v, const luma_gguf_value *tokens, luma_err *err)
{
    size_t total = 0;
    for (int32_t i = 0; i < v->n; i++) {
        uint64_t len = tokens->strs[i].len ? tokens->strs[i].len : 24;
        if (len > SIZE_MAX || luma_add_size(total, (size_t)len, &total))
            return luma_errf(err, "tokenizer: token texts too large");
    }
    v->text = alloc_array(total, 1, err);
    v->text_off = alloc_array((size_t)v->n + 1, sizeof *v->text_off, err);
    if (!v->text || !v->text_off) return -1;
    size_t at = 0;
    for (int32_t i = 0; i < v->n; i++) {
        luma_str s = tokens->strs[i];
        v->text_off[i] = at;
        if (s.len) {
            memcpy(v->text + at, s.ptr, (size_t)s.len);
            at += (size_t)s.len;
        } else {
            char tmp[32];
            int k = snprintf(tmp, sizeof tmp, "[EMPTY_%" PRId32 "]", i);
            memcpy(v->text + at, tmp, (size_t)k);
            at += (size_t)k;
        }
    }
    v->text_off[v->n] = at;

    size_t size = table_size((size_t)v->n);
    if (!size) return luma_errf(err, "tokenizer: vocabulary too large");
    v->slot = alloc_array(size, sizeof *v->slot, err);
    if (!v->slot) return -1;
    memset(v->slot, 0xff, size * sizeof *v->slot);
    v->slot_mask = size - 1;
    /* a repeated text maps to its last id, as in llama.cpp */
    for (int32_t id = 0; id < v->n; id++) {
        luma_str t = token_str(v, id);
        size_t i = (size_t)hash_bytes(HASH_SEED, t.ptr, t.len) & v->slot_mask;
        for (;; i = (i + 1) & v->slot_mask) {
            int32_t o = v->slot[i];
            if (o < 0) break;
            luma_str u = token_str(v, o);
            if (u.len == t.len && memcmp(u.ptr, t.ptr, t.len) == 0) break;
        }
        v->slot[i] = id;
    }
    return 0;
}

/* Scores (f32 or i32; 0 when absent) and types (1..6; normal when absent,
 * anything else counts as unused). */
static int load_scores_types(luma_vocab *v, const luma_gguf *g, luma_err *err)
{
    v->score = alloc_array((size_t)v->n, sizeof *v->score, err);
    v->type = alloc_array((size_t)v->n, 1, err);
    if (!v->score || !v->type) return -1;
    const luma_gguf_kv *kv = luma_gguf_find(g, "tokenizer.ggml.scores");
    if (kv) {
        const luma_gguf_value *a = &kv->value;
        if (a->type != LUMA_GGUF_ARRAY || (a->elem_type != LUMA_GGUF_F32 && a->elem_type != LUMA_GGUF_I32))
            return luma_errf(err, "tokenizer.ggml.scores: expected an array of f32 or i32");
        if (a->n < (uint64_t)v->n)
            return luma_errf(err, "tokenizer.ggml.scores: %" PRIu64 " scores for %" PRId32 " tokens",
                             a->n, v->n);
        for (int32_t i = 0; i < v->n; i++) {
            if (a->elem_type == LUMA_GGUF_F32) {
                memcpy(&v->score[i], (const char *)a->data + (size_t)i * 4, 4);
            } else {
                int32_t s;
                memcpy(&s, (const char *)a->data + (size_t)i * 4, 4);
                v->score[i] = (float)s;
            }
        }
    } else {
        for (int32_t i = 0; i < v->n; i++) v->score[i] = 0.0f;
    }
    const luma_gguf_value *types;
    if (luma_gguf_get_arr(g, "tokenizer.ggml.token_type", LUMA_GGUF_I32, &types, err)) return -1;
    if (types && types->n < (uint64_t)v->n)
        return luma_errf(err, "tokenizer.ggml.token_type: %" PRIu64 " types for %" PRId32 " tokens",
                         types->n, v->n);
    for (int32_t i = 0; i < v->n; i++) {
        int32_t t = LUMA_TOKEN_NORMAL;
        if (types) memcpy(&t, (const char *)types->data + (size_t)i * 4, 4);
        v->type[i] = (uint8_t)(t >= LUMA_TOKEN_NORMAL && t <= LUMA_TOKEN_BYTE ? t : LUMA_TOKEN_UNUSED);
    }
    return 0;
}

static int load_merges(luma_vocab *v, const luma_gguf *g, luma_err *err)
{
    const luma_gguf_value *a;
    if (luma_gguf_get_arr(g, "tokenizer.ggml.merges", LUMA_GGUF_STRING, &a, err)) return -1;
    if (!a) return luma_errf(err, "tokenizer: BPE vocabulary without tokenizer.ggml.merges");
    if (a->n > INT32_MAX) return luma_errf(err, "tokenizer.ggml.merges: too many merges");
    size_t total = 0;
    for (uint64_t i = 0; i < a->n; i++)
        if (a->strs[i].len > SIZE_MAX || luma_add_size(total, (size_t)a->strs[i].len, &total))
            return luma_errf(err, "tokenizer.ggml.merges: too large");
    v->merge_text = alloc_array(total, 1, err);
    v->merges = alloc_array((size_t)a->n, sizeof *v->merges, err);
    size_t size = table_size((size_t)a->n);
    if (!size) return luma_errf(err, "tokenizer.ggml.merges: too many merges");
    v->merge_slot = alloc_array(size, sizeof *v->merge_slot, err);
    if (!v->merge_text || !v->merges || !v->merge_slot) return -1;
    memset(v->merge_slot, 0xff, size * sizeof *v->merge_slot);
    v->merge_mask = size - 1;
    size_t at = 0;
    for (uint64_t r = 0; r < a->n; r++) {
        luma_str s = a->strs[r];
        /* "left right", split at the first space after the first byte */
        const char *sp = s.len > 1 ? memchr(s.ptr + 1, ' ', (size_t)s.len - 1) : NULL;
        if (!sp) continue;
        memcpy(v->merge_text + at, s.ptr, (size_t)s.len);
        merge m = {at, (size_t)(sp - s.ptr), (size_t)s.len - (size_t)(sp - s.ptr) - 1};
        at += (size_t)s.len;
        const char *l = v->merge_text + m.off;
        size_t i = (size_t)hash_pair(l, m.left_len, l + m.left_len + 1, m.right_len) & v->merge_mask;
        bool dup = false;
        for (;; i = (i + 1) & v->merge_mask) {
            int32_t o = v->merge_slot[i];
            if (o < 0) break;
            const merge *q = &v->merges[o];
            const char *ql = v->merge_text + q->off;
            if (q->left_len == m.left_len && q->right_len == m.right_len &&
                memcmp(ql, l, (size_t)s.len) == 0) {
                dup = true;     /* the first rank stays */
                break;
            }
        }
        v->merges[v->n_merges] = m;
        if (!dup) v->merge_slot[i] = v->n_merges;
        v->n_merges++;
    }
    return 0;
}

/* An id from metadata: kept when it is an integer in range, else the default
 * stays (as llama.cpp does); a non-integer value is an error. */
static int load_id(const luma_gguf *g, const char *key, int32_t n, int32_t *id, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    if (!kv) return 0;
    const luma_gguf_value *x = &kv->value;
    switch (x->type) {
    case LUMA_GGUF_U8: case LUMA_GGUF_U16: case LUMA_GGUF_U32: case LUMA_GGUF_U64:
        if (x->v.u64 < (uint64_t)n) *id = (int32_t)x->v.u64;
        return 0;
    case LUMA_GGUF_I8: case LUMA_GGUF_I16: case LUMA_GGUF_I32: case LUMA_GGUF_I64:
        if (x->v.i64 >= 0 && x->v.i64 < n) *id = (int32_t)x->v.i64;
        return 0;
    default:
        return luma_errf(err, "%s: expected an integer token id, found %s", key,
                         luma_gguf_type_name(x->type));
    }
}

/* Adds a token to the end-of-generation set. */
static int add_eog(luma_vocab *v, int32_t id, size_t *cap, luma_err *err)
{
    if (id < 0 || luma_vocab_is_eog(v, id)) return 0;
    if (grow((void **)&v->eog, cap, v->n_eog + 1, sizeof *v->eog, err)) return -1;
    v->eog[v->n_eog++] = id;
    return 0;
}

static int32_t find_cstr(const luma_vocab *v, const char *s) { return luma_vocab_find(v, s, strlen(s)); }

static int load_specials(luma_vocab *v, const luma_gguf *g, bool add_bos_default, luma_err *err)
{
    luma_vocab_special *sp = &v->sp;
    bool spm = v->kind == LUMA_VOCAB_SPM;
    *sp = (luma_vocab_special){spm ? 1 : -1, spm ? 2 : -1, -1, -1, spm ? 0 : -1, -1, -1, -1, false, false};
    int32_t *defaults[] = {&sp->bos, &sp->eos, &sp->unk};
    for (size_t i = 0; i < 3; i++)
        if (*defaults[i] >= v->n) *defaults[i] = -1;
    static const struct { const char *key; size_t field; } keys[] = {
        {"tokenizer.ggml.bos_token_id", offsetof(luma_vocab_special, bos)},
        {"tokenizer.ggml.eos_token_id", offsetof(luma_vocab_special, eos)},
        {"tokenizer.ggml.eot_token_id", offsetof(luma_vocab_special, eot)},
        {"tokenizer.ggml.eom_token_id", offsetof(luma_vocab_special, eom)},
        {"tokenizer.ggml.unknown_token_id", offsetof(luma_vocab_special, unk)},
        {"tokenizer.ggml.seperator_token_id", offsetof(luma_vocab_special, sep)},
        {"tokenizer.ggml.padding_token_id", offsetof(luma_vocab_special, pad)},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (load_id(g, keys[i].key, v->n, (int32_t *)((char *)sp + keys[i].field), err)) return -1;
    if (luma_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", add_bos_default, &sp->add_bos, err) ||
        luma_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", false, &sp->add_eos, err))
        return -1;

    /* tokens found by their text count as control tokens, as in llama.cpp */
    for (size_t i = 0; sp->eot < 0 && i < sizeof eot_texts / sizeof eot_texts[0]; i++) {
        sp->eot = find_cstr(v, eot_texts[i]);
        if (sp->eot >= 0) v->type[sp->eot] = LUMA_TOKEN_CONTROL;
    }
    if (sp->eom < 0) {
        sp->eom = find_cstr(v, "<|eom_id|>");
        if (sp->eom >= 0) v->type[sp->eom] = LUMA_TOKEN_CONTROL;
    }
    size_t cap = 0;
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++) {
        int32_t id = find_cstr(v, eog_texts[i]);
        if (id < 0) continue;
        v->type[id] = LUMA_TOKEN_CONTROL;
        if (add_eog(v, id, &cap, err)) return -1;
    }
    if (add_eog(v, sp->eos, &cap, err) || add_eog(v, sp->eot, &cap, err) || add_eog(v, sp->eom, &cap, err))
        return -1;
    return 0;
}

/* Groups of control, unknown and user-defined tokens by text length. */
static int load_groups(luma_vocab *v, luma_err *err)
{
    size_t n_lens = 0, max_len = 0;
    for (int32_t i = 0; i < v->n; i++) {
        uint8_t t = v->type[i];
        if (t == LUMA_TOKEN_CONTROL || t == LUMA_TOKEN_UNKNOWN || t == LUMA_TOKEN_USER_DEFINED) {
            size_t len = token_str(v, i).len;
            if (len > max_len) max_len = len;
        }
    }
    if (max_len == 0) return 0;
    /* a presence map over lengths keeps this linear */
    uint8_t *seen = calloc(max_len + 1, 1);
    if (!seen) return luma_errf(err, "tokenizer: out of memory");
    for (int32_t i = 0; i < v->n; i++) {
        uint8_t t = v->type[i];
        if (t == LUMA_TOKEN_CONTROL || t == LUMA_TOKEN_UNKNOWN || t == LUMA_TOKEN_USER_DEFINED) {
            size_t len = token_str(v, i).len;
            if (!seen[len]) n_lens++;
            seen[len] = 1;
        }
    }
    v->groups = alloc_array(n_lens, sizeof *v->groups, err);
    if (!v->groups) {
        free(seen);
        return -1;
    }
    for (size_t len = max_len; len > 0; len--)
        if (seen[len]) v->groups[v->n_groups++] = (special_group){.len = len};
    for (int32_t i = 0; i < v->n; i++) {
        uint8_t t = v->type[i];
        if (t != LUMA_TOKEN_CONTROL && t != LUMA_TOKEN_UNKNOWN && t != LUMA_TOKEN_USER_DEFINED) continue;
        luma_str s = token_str(v, i);
        special_group *grp = v->groups;
        while (grp->len != s.len) grp++;
        unsigned char b = (unsigned char)s.ptr[0], e = (unsigned char)s.ptr[s.len - 1];
        grp->first_any[b >> 6] |= 1ull << (b & 63);
        grp->last_any[e >> 6] |= 1ull << (e & 63);
        if (t == LUMA_TOKEN_USER_DEFINED) {
            grp->first_user[b >> 6] |= 1ull << (b & 63);
            grp->last_user[e >> 6] |= 1ull << (e & 63);
        }
    }
    free(seen);
    return 0;
}

static int load_pieces(luma_vocab *v, luma_err *err)
{
    size_t total = 0;
    for (int32_t i = 0; i < v->n; i++) {
        size_t k = make_piece(v, i, NULL);
        if (k > v->max_piece) v->max_piece = k;
        if (luma_add_size(total, k, &total)) return luma_errf(err, "tokenizer: pieces too large");
    }
    v->piece = alloc_array(total, 1, err);
    v->piece_off = alloc_array((size_t)v->n + 1, sizeof *v->piece_off, err);
    if (!v->piece || !v->piece_off) return -1;
    size_t at = 0;
    for (int32_t i = 0; i < v->n; i++) {
        v->piece_off[i] = at;
        at += make_piece(v, i, v->piece + at);
    }
    v->piece_off[v->n] = at;
    return 0;
}

static void load_byte_tokens(luma_vocab *v)
{
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char buf[6];
        if (v->kind == LUMA_VOCAB_SPM) {
            char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            v->byte_token[b] = luma_vocab_find(v, name, 6);
            if (v->byte_token[b] < 0) {
                buf[0] = (char)b;
                v->byte_token[b] = luma_vocab_find(v, buf, 1);
            }
        } else {
            size_t k = luma_utf8_encode(byte_to_cp((unsigned char)b), buf);
            v->byte_token[b] = luma_vocab_find(v, buf, k);
        }
    }
}

static int load(luma_vocab *v, const luma_gguf *g, luma_err *err)
{
    luma_str model, pre;
    if (luma_gguf_get_str(g, "tokenizer.ggml.model", &model, err) ||
        luma_gguf_get_str(g, "tokenizer.ggml.pre", &pre, err))
        return -1;
    if (!model.ptr) return luma_errf(err, "tokenizer: no tokenizer.ggml.model in the file");
    bool add_bos_default;
    if (luma_str_eq(model, "llama")) {
        v->kind = LUMA_VOCAB_SPM;
        v->pre = PRE_DEFAULT;
        add_bos_default = true;
    } else if (luma_str_eq(model, "gpt2")) {
        v->kind = LUMA_VOCAB_BPE;
        if (!pre.ptr)
            return luma_errf(err, "tokenizer: BPE vocabulary without tokenizer.ggml.pre");
        const struct pre_alias *a = find_pre(pre.ptr, (size_t)pre.len);
        if (!a || a->kind == PRE_DEFAULT)
            return luma_errf(err, "tokenizer: unknown pre-tokenizer '%.*s' (tokenizer.ggml.pre)",
                             (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
        v->pre = a->kind;
        v->ignore_merges = a->ignore_merges;
        add_bos_default = a->add_bos;
    } else {
        return luma_errf(err, "tokenizer: unknown tokenizer model '%.*s' (tokenizer.ggml.model)",
                         (int)(model.len > 64 ? 64 : model.len), model.ptr);
    }
    if (luma_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", v->kind == LUMA_VOCAB_SPM,
                           &v->add_space_prefix, err))
        return -1;

    const luma_gguf_value *tokens;
    if (luma_gguf_get_arr(g, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, err)) return -1;
    if (!tokens || tokens->n == 0) return luma_errf(err, "tokenizer: no tokenizer.ggml.tokens in the file");
    if (tokens->n > INT32_MAX) return luma_errf(err, "tokenizer: %" PRIu64 " tokens is too many", tokens->n);
    v->n = (int32_t)tokens->n;

    if (load_texts(v, tokens, err) || load_scores_types(v, g, err)) return -1;
    if (v->kind == LUMA_VOCAB_BPE && load_merges(v, g, err)) return -1;
    if (load_specials(v, g, add_bos_default, err) || load_groups(v, err) || load_pieces(v, err)) return -1;
    load_byte_tokens(v);

    if (v->kind == LUMA_VOCAB_SPM) {
        v->sp.nl = v->byte_token['\n'];
    } else {
        ids_vec nl = {0};
        int rc = tokenize_into(v, "\n", 1, false, false, &nl, err);
        v->sp.nl = rc == 0 && nl.n > 0 ? nl.v[0] : v->sp.pad;
        free(nl.v);
        if (rc) return -1;
    }
    return 0;
}

int luma_vocab_load(const luma_gguf *g, luma_vocab **out, luma_err *err)
{
    *out = NULL;
    luma_vocab *v = calloc(1, sizeof *v);
    if (!v) return luma_errf(err, "tokenizer: out of memory");
    if (load(v, g, err)) {
        luma_vocab_free(v);
        return -1;
    }
    *out = v;
    return 0;
}
