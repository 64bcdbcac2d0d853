/* UTF-8 and the few Unicode properties the tokenizers need: the major class
 * of a code point's general category (what \p{L}, \p{N} ... test) and
 * White_Space (what \s tests). The tables are generated into unicode_data.c
 * by scripts/gen-unicode.py. */
#ifndef LUMA_UNICODE_H
#define LUMA_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The major class of a general category; Cn (unassigned) is its own. */
enum luma_ucat {
    LUMA_UCAT_UNASSIGNED = 0,
    LUMA_UCAT_LETTER = 1,       /* L* */
    LUMA_UCAT_MARK = 2,         /* M* */
    LUMA_UCAT_NUMBER = 3,       /* N* */
    LUMA_UCAT_PUNCT = 4,        /* P* */
    LUMA_UCAT_SYMBOL = 5,       /* S* */
    LUMA_UCAT_SEPARATOR = 6,    /* Z* */
    LUMA_UCAT_OTHER = 7         /* Cc, Cf, Co, Cs */
};

/* Stored by luma_utf8_decode for bytes that are not a valid character. */
#define LUMA_UTF8_INVALID 0xFFFFFFFFu

/* Decodes the character at s[0..len) (len > 0): stores its code point and
 * returns its length, 1 to 4. Bytes that do not form a valid character
 * (overlong forms, surrogates, code points past U+10FFFF, stray continuation
 * bytes, a sequence cut short) store LUMA_UTF8_INVALID and return the length
 * of the maximal invalid subpart (at least 1), the unit Unicode recommends
 * replacing with one U+FFFD. */
size_t luma_utf8_decode(const char *s, size_t len, uint32_t *cp);

/* Writes the UTF-8 form of cp (at most 4 bytes) and returns its length, or 0
 * when cp is a surrogate or past U+10FFFF. */
size_t luma_utf8_encode(uint32_t cp, char out[4]);

/* The number of bytes at the end of s[0..len) that begin a valid character
 * but stop before its end (0 to 3): a stream holds them back until the rest
 * arrives. */
size_t luma_utf8_incomplete_tail(const char *s, size_t len);

/* The length a lead byte announces (1 for ASCII and for bytes that cannot
 * lead), without validating what follows: the unit SentencePiece-style
 * tokenizers split text into. */
size_t luma_utf8_lead_len(unsigned char lead);

enum luma_ucat luma_unicode_category(uint32_t cp);
bool luma_unicode_is_space(uint32_t cp);

/* Tables generated into unicode_data.c. */
extern const uint32_t luma_unicode_ranges[];    /* first_code_point << 3 | enum luma_ucat */
extern const size_t luma_unicode_ranges_len;
extern const uint32_t luma_unicode_spaces[];    /* White_Space, ascending */
extern const size_t luma_unicode_spaces_len;

#endif
