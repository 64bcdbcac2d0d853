#include "unicode.h"

/* Well-formed UTF-8 (Unicode, table 3-7): the lead byte fixes the length and
 * the range of the second byte; later bytes are 80..BF. */
static size_t lead_info(unsigned char b, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b == 0xE0) { *lo = 0xA0; return 3; }
    if (b >= 0xE1 && b <= 0xEC) return 3;
    if (b == 0xED) { *hi = 0x9F; return 3; }
    if (b >= 0xEE && b <= 0xEF) return 3;
    if (b == 0xF0) { *lo = 0x90; return 4; }
    if (b >= 0xF1 && b <= 0xF3) return 4;
    if (b == 0xF4) { *hi = 0x8F; return 4; }
    return 0;
}

size_t luma_utf8_decode(const char *s, size_t len, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80) {
        *cp = u[0];
        return 1;
    }
    unsigned char lo, hi;
    size_t need = lead_info(u[0], &lo, &hi);
    if (need == 0) {
        *cp = LUMA_UTF8_INVALID;
        return 1;
    }
    uint32_t c = u[0] & (0x7Fu >> need);
    for (size_t i = 1; i < need; i++) {
        if (i >= len || u[i] < lo || u[i] > hi) {
            *cp = LUMA_UTF8_INVALID;
            return i;
        }
        c = c << 6 | (u[i] & 0x3Fu);
        lo = 0x80;
        hi = 0xBF;
    }
    *cp = c;
    return need;
}

size_t luma_utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp < 0x110000) {
        out[0] = (char)(0xF0 | cp >> 18);
        out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        out[2] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

size_t luma_utf8_incomplete_tail(const char *s, size_t len)
{
    for (size_t k = len < 3 ? len : 3; k > 0; k--) {
        const char *t = s + len - k;
        unsigned char lo, hi;
        uint32_t cp;
        /* a valid prefix of a longer character uses up all k bytes */
        if (lead_info((unsigned char)t[0], &lo, &hi) > k && luma_utf8_decode(t, k, &cp) == k)
            return k;
    }
    return 0;
}

size_t luma_utf8_lead_len(unsigned char lead)
{
    static const unsigned char len_by_high_nibble[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                                         1, 1, 1, 1, 2, 2, 3, 4};
    return len_by_high_nibble[lead >> 4];
}

enum luma_ucat luma_unicode_category(uint32_t cp)
{
    if (cp >= 0x110000) return LUMA_UCAT_UNASSIGNED;
    /* the last range starting at or before cp; ranges[0] starts at 0 */
    size_t lo = 0, hi = luma_unicode_ranges_len;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (luma_unicode_ranges[mid] >> 3 <= cp) lo = mid;
        else hi = mid;
    }
    return (enum luma_ucat)(luma_unicode_ranges[lo] & 7);
}

bool luma_unicode_is_space(uint32_t cp)
{
    size_t lo = 0, hi = luma_unicode_spaces_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (luma_unicode_spaces[mid] < cp) lo = mid + 1;
        else hi = mid;
    }
    return lo < luma_unicode_spaces_len && luma_unicode_spaces[lo] == cp;
}
