/* GGUF v2/v3 reader: the file is mmapped read-only, parsed and validated once
 * at open; every later lookup reads validated structures only.
 *
 * Layout of a GGUF file (little-endian):
 *   magic "GGUF", u32 version, u64 n_tensors, u64 n_kv   (v1 used u32 counts: refused)
 *   n_kv    x { string key, u32 type, value }
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset }
 *   padding to general.alignment (default 32), then the data section;
 *   tensor offsets are relative to the data section and aligned.
 *   string = u64 length + bytes (no terminator);
 *   array  = u32 element type + u64 count + elements (arrays may nest). */
#ifndef LUMA_GGUF_H
#define LUMA_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

enum luma_gguf_type {
    LUMA_GGUF_U8 = 0, LUMA_GGUF_I8 = 1, LUMA_GGUF_U16 = 2, LUMA_GGUF_I16 = 3,
    LUMA_GGUF_U32 = 4, LUMA_GGUF_I32 = 5, LUMA_GGUF_F32 = 6, LUMA_GGUF_BOOL = 7,
    LUMA_GGUF_STRING = 8, LUMA_GGUF_ARRAY = 9, LUMA_GGUF_U64 = 10, LUMA_GGUF_I64 = 11,
    LUMA_GGUF_F64 = 12,
    LUMA_GGUF_TYPE_COUNT
};

#define LUMA_GGUF_MAX_DIMS 4

/* A string inside the mapped file: not NUL-terminated. */
typedef struct luma_str {
    const char *ptr;
    uint64_t len;
} luma_str;

#define LUMA_GGUF_DEFAULT_ALIGNMENT 32
/* Arrays of arrays nest at most this deep (a plain array is depth 1). */
#define LUMA_GGUF_MAX_NESTING 8

/* One metadata value. Scalars are decoded; arrays keep a pointer to their
 * first element in the file (packed little-endian and possibly unaligned:
 * read elements with memcpy). For arrays of strings, `strs` holds the decoded
 * strings (n entries). For nested arrays, `items` holds the decoded inner
 * arrays (n entries, each of type ARRAY). strs and items are NULL when n is 0.
 * A bool is 0 or 1 in v.u64 (any non-zero byte reads as 1). */
typedef struct luma_gguf_value {
    enum luma_gguf_type type;
    union {
        uint64_t u64;   /* u8, u16, u32, u64, bool */
        int64_t i64;    /* i8, i16, i32, i64 */
        double f64;     /* f32, f64 */
        luma_str str;
    } v;
    /* arrays only */
    enum luma_gguf_type elem_type;
    uint64_t n;
    const void *data;                     /* n packed scalars, in file order */
    const luma_str *strs;                 /* when elem_type == STRING */
    const struct luma_gguf_value *items;  /* when elem_type == ARRAY */
} luma_gguf_value;

typedef struct luma_gguf_kv {
    luma_str key;
    luma_gguf_value value;
} luma_gguf_kv;

typedef struct luma_gguf_tensor {
    luma_str name;
    uint32_t type;              /* ggml type number, see quant.h (validated known) */
    uint32_t n_dims;
    int64_t ne[LUMA_GGUF_MAX_DIMS]; /* ne[0] is the contiguous (row) dimension; unused dims are 1 */
    uint64_t offset;            /* from the start of the data section */
    uint64_t size;              /* bytes */
    const void *data;           /* inside the mapping; NULL for a vocab-only file */
} luma_gguf_tensor;

typedef struct luma_gguf {
    uint32_t version;
    uint64_t n_kv;
    luma_gguf_kv *kv;
    uint64_t n_tensors;
    luma_gguf_tensor *tensors;
    uint64_t alignment;
    uint64_t data_offset;       /* start of the data section in the file (past
                                   the end when a file without tensors is unpadded) */
    const uint8_t *base;        /* the mapping */
    size_t size;                /* file size */
    void *priv;                 /* owned allocations */
} luma_gguf;

/* Opens and validates a file. On failure *out is NULL and err names the
 * problem and where ("tensor 'blk.0.attn_q.weight': offset ... past end"). */
int luma_gguf_open(const char *path, luma_gguf **out, luma_err *err);
/* Same checks over a caller's buffer (not copied; must outlive the result). */
int luma_gguf_open_memory(const void *data, size_t size, luma_gguf **out, luma_err *err);
void luma_gguf_close(luma_gguf *g);

const luma_gguf_kv *luma_gguf_find(const luma_gguf *g, const char *key);
const luma_gguf_tensor *luma_gguf_find_tensor(const luma_gguf *g, const char *name);

/* Typed getters: a missing key gives `def` and returns 0; a key of the wrong
 * type is an error. Any integer type converts when the value fits; the f32
 * getter takes f32 or f64. */
int luma_gguf_get_u32(const luma_gguf *g, const char *key, uint32_t def, uint32_t *out, luma_err *err);
int luma_gguf_get_f32(const luma_gguf *g, const char *key, float def, float *out, luma_err *err);
int luma_gguf_get_bool(const luma_gguf *g, const char *key, bool def, bool *out, luma_err *err);
/* *out points into the file (not NUL-terminated); missing gives {NULL, 0}. */
int luma_gguf_get_str(const luma_gguf *g, const char *key, luma_str *out, luma_err *err);
/* An array of the given element type; missing gives NULL. */
int luma_gguf_get_arr(const luma_gguf *g, const char *key, enum luma_gguf_type elem,
                      const luma_gguf_value **out, luma_err *err);

const char *luma_gguf_type_name(enum luma_gguf_type t);
/* Bytes of one element of a scalar type; 0 for STRING, ARRAY and unknown types. */
size_t luma_gguf_type_size(enum luma_gguf_type t);
bool luma_str_eq(luma_str s, const char *cstr);

/* Writing GGUF v3 files (tests, the synthetic model tool). Keys and tensors
 * are written in the order they were first added; setting a key again
 * replaces its value in place. luma_gguf_add_tensor copies a tensor's data at
 * add time; luma_gguf_add_tensor_fill has it made at save time instead.
 * Setters cannot fail: a bad value or an allocation failure is remembered and
 * reported by luma_gguf_writer_save. A u32 `general.alignment` (a power of
 * two) sets the alignment of the data section; tensor names are 1..63 bytes
 * so that every GGUF engine reads them. */
typedef struct luma_gguf_writer luma_gguf_writer;
luma_gguf_writer *luma_gguf_writer_new(void);
void luma_gguf_writer_free(luma_gguf_writer *w);
void luma_gguf_set_u32(luma_gguf_writer *w, const char *key, uint32_t v);
void luma_gguf_set_i32(luma_gguf_writer *w, const char *key, int32_t v);
void luma_gguf_set_f32(luma_gguf_writer *w, const char *key, float v);
void luma_gguf_set_bool(luma_gguf_writer *w, const char *key, bool v);
void luma_gguf_set_str(luma_gguf_writer *w, const char *key, const char *v);
/* A scalar array (elem: U8..F64 except STRING/ARRAY), n elements packed. */
void luma_gguf_set_arr(luma_gguf_writer *w, const char *key, enum luma_gguf_type elem,
                       const void *data, uint64_t n);
void luma_gguf_set_arr_str(luma_gguf_writer *w, const char *key, const luma_str *strs, uint64_t n);
/* Any value: every scalar type (taken from the union member of its type and
 * truncated to its width), strings, arrays of any element type, nested arrays. */
void luma_gguf_set_value(luma_gguf_writer *w, const char *key, const luma_gguf_value *v);
/* Copies an existing kv (any type, nested arrays included) from another file. */
void luma_gguf_copy_kv(luma_gguf_writer *w, const luma_gguf_kv *kv);
int luma_gguf_add_tensor(luma_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                         const int64_t *ne, const void *data, size_t size, luma_err *err);
/* Makes rows [row0, row0 + n_rows) of a tensor into dst, packed (a row is
 * ne[0] elements; a tensor has ne[1] * ne[2] * ne[3] rows). Returns 0, or -1
 * after writing a message into err, which ends the save. */
typedef int (*luma_gguf_fill_fn)(void *ctx, int64_t row0, int64_t n_rows, void *dst, luma_err *err);
/* A tensor whose data fill makes while the file is saved, at most a few MiB
 * at a time, so that a file larger than memory can be written. ctx must stay
 * valid until luma_gguf_writer_save returns. */
int luma_gguf_add_tensor_fill(luma_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                              const int64_t *ne, luma_gguf_fill_fn fill, void *ctx, luma_err *err);
/* Writes the file; on any failure (a fill's included) removes it. */
int luma_gguf_writer_save(luma_gguf_writer *w, const char *path, luma_err *err);

#endif
