/* Errors travel as values: a function that can fail returns 0 on success and
 * -1 on failure, after writing a message into the caller's luma_err. Only the
 * Lua binding turns a luma_err into a Lua error. */
#ifndef LUMA_ERR_H
#define LUMA_ERR_H

#include <stddef.h>
#include <stdint.h>

#define LUMA_ERR_SIZE 256

typedef struct luma_err {
    char msg[LUMA_ERR_SIZE];
} luma_err;

/* Formats the message into err (when err is not NULL) and returns -1, so a
 * failing path reads `return luma_errf(err, "...", ...);`. */
int luma_errf(luma_err *err, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Overflow-checked size arithmetic: return 0 and store the result, or -1 when
 * the result does not fit. */
static inline int luma_mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a) return -1;
    *out = a * b;
    return 0;
}

static inline int luma_add_size(size_t a, size_t b, size_t *out)
{
    if (b > SIZE_MAX - a) return -1;
    *out = a + b;
    return 0;
}

#endif
