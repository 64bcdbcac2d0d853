/* Tokenizers built from GGUF metadata (tokenizer.ggml.*):
 *   SPM  (tokenizer.ggml.model = "llama"): scored pieces, byte fallback
 *        (<0xXX> tokens), U+2581 for spaces, optional space prefix;
 *   BPE  (tokenizer.ggml.model = "gpt2"): byte-level BPE with ranked merges,
 *        after the pre-tokenizer named by tokenizer.ggml.pre.
 * Token types (tokenizer.ggml.token_type) follow GGUF: 1 normal, 2 unknown,
 * 3 control, 4 user-defined, 5 unused, 6 byte (normal when the key is
 * absent). As in llama.cpp, tokens found by their text as end of turn or
 * generation (see luma_vocab_special) become control tokens, and other
 * values behave as unused. */
#ifndef LUMA_TOKENIZER_H
#define LUMA_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "gguf.h"

enum luma_vocab_kind { LUMA_VOCAB_SPM = 1, LUMA_VOCAB_BPE = 2 };

enum luma_token_type {
    LUMA_TOKEN_NORMAL = 1, LUMA_TOKEN_UNKNOWN = 2, LUMA_TOKEN_CONTROL = 3,
    LUMA_TOKEN_USER_DEFINED = 4, LUMA_TOKEN_UNUSED = 5, LUMA_TOKEN_BYTE = 6
};

/* Special token ids; -1 where the vocabulary has none. From the metadata
 * (tokenizer.ggml.bos_token_id ...; SPM vocabularies default to bos 1, eos 2,
 * unk 0 as SentencePiece does). eot, when the metadata does not name it, is
 * the first of <|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>, <|endoftext|>,
 * <|end_of_text|>, <EOT>, _<EOT>, <end_of_utterance> in the vocabulary, and
 * eom likewise <|eom_id|>. nl is llama.cpp's newline token: SPM's byte token
 * <0x0A>, BPE's first token of "\n". */
typedef struct luma_vocab_special {
    int32_t bos, eos, eot, eom, unk, pad, sep, nl;
    bool add_bos, add_eos;
} luma_vocab_special;

typedef struct luma_vocab luma_vocab;

/* Reads the vocabulary of an open file. An unknown tokenizer.ggml.model or
 * tokenizer.ggml.pre is an error naming the value. The vocabulary copies
 * what it needs: the file may be closed afterwards.
 * Pre-tokenizers (tokenizer.ggml.pre, with the aliases llama.cpp accepts):
 *   gpt-2     (phi-2, mpt, olmo)
 *             's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   llama-bpe (llama3, llama-v3, falcon3, pixtral, dbrx, smaug-bpe)
 *             (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+
 *             |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   qwen2     (deepseek-r1-qwen, megrez, stablelm2): llama-bpe with \p{N} for \p{N}{1,3}
 *   default   SPM only: no splitting. */
int luma_vocab_load(const luma_gguf *g, luma_vocab **out, luma_err *err);
void luma_vocab_free(luma_vocab *v);

enum luma_vocab_kind luma_vocab_kind(const luma_vocab *v);
int32_t luma_vocab_size(const luma_vocab *v);
const luma_vocab_special *luma_vocab_specials(const luma_vocab *v);
/* The name of the pre-tokenizer in use ("gpt-2", "llama-bpe", "qwen2", ...,
 * "default" for SPM). */
const char *luma_vocab_pre(const luma_vocab *v);
/* id must be in range (callers check with luma_vocab_size). */
enum luma_token_type luma_vocab_type(const luma_vocab *v, int32_t id);
/* The token's text as stored in the vocabulary (an empty text reads
 * "[EMPTY_<id>]", as in llama.cpp). */
luma_str luma_vocab_text(const luma_vocab *v, int32_t id);
/* The id of the token whose text is text[0..len), or -1. */
int32_t luma_vocab_find(const luma_vocab *v, const char *text, size_t len);
/* The longest piece of any token (luma_token_piece with special = true). */
size_t luma_vocab_max_piece(const luma_vocab *v);
/* End of generation: eos, eot and the other end-of-turn tokens the vocabulary
 * names (<end_of_turn>, <|eot_id|>, <|im_end|>, <|endoftext|> ...). */
bool luma_vocab_is_eog(const luma_vocab *v, int32_t id);

/* Tokenizes len bytes of text as llama.cpp's llama_tokenize does. add_special
 * adds BOS/EOS as the vocabulary asks (tokenizer.ggml.add_bos_token ...).
 * parse_special recognizes control tokens written in the text
 * ("<start_of_turn>"); otherwise such text is tokenized as plain text.
 * User-defined tokens are always recognized. Where recognized tokens overlap
 * the longer wins. SPM adds a space before the text and after each
 * recognized token when the vocabulary asks (tokenizer.ggml.add_space_prefix,
 * true when absent). Bytes that are not valid UTF-8 are kept: SPM falls back
 * to byte tokens, BPE encodes every byte. Writes at most cap ids to out and
 * returns the number of ids the whole text needs (call again with a larger
 * buffer when it exceeds cap), or -1 with err set. */
int64_t luma_tokenize(const luma_vocab *v, const char *text, size_t len, bool add_special,
                      bool parse_special, int32_t *out, int64_t cap, luma_err *err);

/* The bytes one token stands for: byte tokens decoded, U+2581 turned back to
 * spaces (SPM), byte-level characters turned back to bytes (BPE), the text
 * of user-defined tokens as is. Control and unknown tokens give their text
 * only when special is true, else nothing; unused tokens give nothing.
 * Writes at most cap bytes and returns the full length; an id out of range
 * gives 0. */
size_t luma_token_piece(const luma_vocab *v, int32_t id, bool special, char *buf, size_t cap);

/* The text of a sequence of ids: their pieces back to back, the inverse of
 * luma_tokenize where the vocabulary allows. When the vocabulary adds a space
 * prefix, one leading space is removed from the first piece that is not
 * empty (so a leading BOS does not keep it, as in SentencePiece; llama.cpp
 * keeps it after a BOS). BPE spaces are kept as they are (llama.cpp's
 * clean_spaces is not applied). Returns the full length; writes at most cap
 * bytes. Ids out of range are an error (-1). */
int64_t luma_detokenize(const luma_vocab *v, const int32_t *ids, int64_t n, bool special,
                        char *buf, size_t cap, luma_err *err);

/* Streaming detokenizer: fed one id at a time, it emits only whole, valid
 * UTF-8 characters, holding an incomplete tail (at most 3 bytes) for the
 * next call. Bytes that cannot become a valid character are emitted as
 * U+FFFD, one per maximal invalid subpart, so every chunk is valid UTF-8;
 * where the full text is valid UTF-8 the chunks join to exactly what
 * luma_detokenize gives. */
typedef struct luma_detok {
    uint8_t pending[8];
    int n_pending;
    bool first;     /* no piece seen yet: the SPM space prefix is still to drop */
} luma_detok;

void luma_detok_init(luma_detok *d);
/* Appends what id completes to out and returns its byte count. When that
 * count exceeds cap, out holds an unspecified prefix and the state is
 * unchanged: call again with a buffer of that size. One token never needs
 * more than 3 * (luma_vocab_max_piece(v) + 3) bytes. Ids out of range give
 * nothing. */
size_t luma_detok_push(luma_detok *d, const luma_vocab *v, int32_t id, bool special,
                       char *out, size_t cap);
/* Emits what is held (an incomplete character becomes U+FFFD: at most 3
 * bytes) with the same contract as luma_detok_push. */
size_t luma_detok_flush(luma_detok *d, char *out, size_t cap);

/* Splits text as the named pre-tokenizer does (see luma_vocab_load; any of
 * the accepted names). Writes the end offset of each piece (at most cap) to
 * ends and returns the number of pieces, or -1 with err set for an unknown
 * name. Invalid UTF-8 bytes split like U+FFFD. */
int64_t luma_pretokenize(const char *pre, const char *text, size_t len, size_t *ends,
                         int64_t cap, luma_err *err);

#endif
