/* GGUF v2/v3: open (mmap or a caller's buffer), validate every count, length,
 * offset and size against the bytes actually there, then serve lookups from
 * the validated structures. The writer at the end produces GGUF v3. */
#define _POSIX_C_SOURCE 200809L

#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant.h"

/* Smallest encodings of the variable-size records: a count read from the
 * file cannot exceed the bytes left divided by these. */
#define MIN_STR 8       /* u64 length, no bytes */
#define MIN_KV 13       /* empty key, u32 type, a one-byte value */
#define MIN_TENSOR 32   /* empty name, u32 n_dims, one u64 dim, u32 type, u64 offset */
#define MIN_ARRAY 12    /* u32 element type, u64 count */

#define NAME_SHOWN 64   /* bytes of a key or tensor name quoted in a message */
#define WRITER_MAX_NAME 63

/* Encoded size of each scalar type; 0 for STRING and ARRAY. */
static const uint8_t scalar_size[LUMA_GGUF_TYPE_COUNT] = {
    [LUMA_GGUF_U8] = 1, [LUMA_GGUF_I8] = 1, [LUMA_GGUF_U16] = 2, [LUMA_GGUF_I16] = 2,
    [LUMA_GGUF_U32] = 4, [LUMA_GGUF_I32] = 4, [LUMA_GGUF_F32] = 4, [LUMA_GGUF_BOOL] = 1,
    [LUMA_GGUF_U64] = 8, [LUMA_GGUF_I64] = 8, [LUMA_GGUF_F64] = 8,
};

static const char *const type_names[LUMA_GGUF_TYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array",
    "u64", "i64", "f64",
};

const char *luma_gguf_type_name(enum luma_gguf_type t)
{
    return (unsigned)t < LUMA_GGUF_TYPE_COUNT ? type_names[t] : "unknown";
}

size_t luma_gguf_type_size(enum luma_gguf_type t)
{
    return (unsigned)t < LUMA_GGUF_TYPE_COUNT ? scalar_size[t] : 0;
}

bool luma_str_eq(luma_str s, const char *cstr)
{
    size_t n = strlen(cstr);
    return s.len == n && (n == 0 || memcmp(s.ptr, cstr, n) == 0);
}

/* Lexicographic order of byte strings; a prefix sorts first. */
static int str_cmp(const char *a, uint64_t alen, const char *b, uint64_t blen)
{
    uint64_t n = alen < blen ? alen : blen;
    int c = n ? memcmp(a, b, n) : 0;
    if (c) return c;
    return alen < blen ? -1 : alen > blen;
}

/* A name from the file, quoted safely: at most NAME_SHOWN bytes, bytes that
 * are not printable ASCII shown as '?'. */
static void show_name(luma_str s, char out[NAME_SHOWN + 4])
{
    size_t n = s.len < NAME_SHOWN ? (size_t)s.len : NAME_SHOWN;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        out[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
    }
    strcpy(out + n, s.len > NAME_SHOWN ? "..." : "");
}

/* Bytes of a tensor of a known type whose ne[0] is a multiple of the block
 * size: luma_row_size(ne[0]) x the other dimensions. -1 on overflow. */
static int tensor_bytes(const luma_type_traits *tr, uint32_t type, const int64_t ne[LUMA_GGUF_MAX_DIMS],
                        size_t *out)
{
    size_t checked, rows = 1;
    /* luma_row_size does not report overflow: blocks x block bytes is checked here first */
    if (luma_mul_size((size_t)(ne[0] / tr->block_size), tr->type_size, &checked) != 0) return -1;
    size_t row = luma_row_size((enum luma_type)type, ne[0]);
    for (int d = 1; d < LUMA_GGUF_MAX_DIMS; d++)
        if (luma_mul_size(rows, (size_t)ne[d], &rows) != 0) return -1;
    return luma_mul_size(row, rows, out);
}

/* ---- reading ------------------------------------------------------------ */

/* Every allocation of an open file is a chunk on one list, freed at close. */
typedef struct chunk {
    struct chunk *next;
    max_align_t data[];
} chunk;

typedef struct gguf_file {
    luma_gguf pub;
    chunk *chunks;
    const luma_gguf_kv **kv_sorted;         /* by key, for lookup */
    const luma_gguf_tensor **tensor_sorted; /* by name */
    bool mapped;
} gguf_file;

typedef struct parser {
    const uint8_t *base;
    size_t size;
    size_t pos;
    gguf_file *file;
    luma_err *err;
    /* the entry being read, named in messages */
    const char *what;   /* "header", "key", "tensor" */
    uint64_t index;
    luma_str name;      /* {NULL, 0} until read */
    size_t start;       /* byte offset of the entry */
} parser;

static int fail(parser *p, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static int fail(parser *p, const char *fmt, ...)
{
    char msg[LUMA_ERR_SIZE], name[NAME_SHOWN + 4];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (strcmp(p->what, "header") == 0)
        return luma_errf(p->err, "gguf header: %s", msg);
    if (!p->name.ptr)
        return luma_errf(p->err, "gguf %s %" PRIu64 " (byte %zu): %s", p->what, p->index,
                         p->start, msg);
    show_name(p->name, name);
    return luma_errf(p->err, "gguf %s '%s' (#%" PRIu64 ", byte %zu): %s", p->what, name,
                     p->index, p->start, msg);
}

static void *own_alloc(parser *p, uint64_t n, size_t size)
{
    size_t bytes, total;
    if (n > SIZE_MAX || luma_mul_size((size_t)n, size, &bytes) != 0 ||
        luma_add_size(bytes, sizeof(chunk), &total) != 0) {
        fail(p, "%" PRIu64 " entries do not fit in memory", n);
        return NULL;
    }
    chunk *c = calloc(1, total);
    if (!c) {
        fail(p, "out of memory allocating %zu bytes", bytes);
        return NULL;
    }
    c->next = p->file->chunks;
    p->file->chunks = c;
    return c->data;
}

static int need(parser *p, uint64_t n, const char *what)
{
    if (n > p->size - p->pos)
        return fail(p, "unexpected end of file reading %s at byte %zu (file is %zu bytes)", what,
                    p->pos, p->size);
    return 0;
}

static int read_u32(parser *p, uint32_t *v, const char *what)
{
    if (need(p, 4, what)) return -1;
    memcpy(v, p->base + p->pos, 4);
    p->pos += 4;
    return 0;
}

static int read_u64(parser *p, uint64_t *v, const char *what)
{
    if (need(p, 8, what)) return -1;
    memcpy(v, p->base + p->pos, 8);
    p->pos += 8;
    return 0;
}

static int read_str(parser *p, luma_str *s, const char *what)
{
    uint64_t len;
    size_t at = p->pos;
    if (read_u64(p, &len, what)) return -1;
    if (len > p->size - p->pos)
        return fail(p, "%s length %" PRIu64 " at byte %zu runs past the end of the file "
                    "(%zu bytes left)", what, len, at, p->size - p->pos);
    s->ptr = (const char *)p->base + p->pos;
    s->len = len;
    p->pos += (size_t)len;
    return 0;
}

static void decode_scalar(const uint8_t *src, enum luma_gguf_type t, luma_gguf_value *v)
{
    uint8_t u8; uint16_t u16; uint32_t u32; uint64_t u64;
    int8_t i8; int16_t i16; int32_t i32; int64_t i64;
    float f32; double f64;
    switch (t) {
    case LUMA_GGUF_U8:   memcpy(&u8, src, 1);  v->v.u64 = u8; break;
    case LUMA_GGUF_BOOL: memcpy(&u8, src, 1);  v->v.u64 = u8 != 0; break;
    case LUMA_GGUF_U16:  memcpy(&u16, src, 2); v->v.u64 = u16; break;
    case LUMA_GGUF_U32:  memcpy(&u32, src, 4); v->v.u64 = u32; break;
    case LUMA_GGUF_U64:  memcpy(&u64, src, 8); v->v.u64 = u64; break;
    case LUMA_GGUF_I8:   memcpy(&i8, src, 1);  v->v.i64 = i8; break;
    case LUMA_GGUF_I16:  memcpy(&i16, src, 2); v->v.i64 = i16; break;
    case LUMA_GGUF_I32:  memcpy(&i32, src, 4); v->v.i64 = i32; break;
    case LUMA_GGUF_I64:  memcpy(&i64, src, 8); v->v.i64 = i64; break;
    case LUMA_GGUF_F32:  memcpy(&f32, src, 4); v->v.f64 = f32; break;
    case LUMA_GGUF_F64:  memcpy(&f64, src, 8); v->v.f64 = f64; break;
    default: break;
    }
}

/* An array body: u32 element type, u64 count, then the elements. */
static int read_array(parser *p, luma_gguf_value *v, int depth)
{
    uint32_t elem;
    uint64_t n;
    size_t at = p->pos;
    if (depth > LUMA_GGUF_MAX_NESTING)
        return fail(p, "arrays nested deeper than %d at byte %zu", LUMA_GGUF_MAX_NESTING, at);
    if (read_u32(p, &elem, "an array element type")) return -1;
    if (elem >= LUMA_GGUF_TYPE_COUNT)
        return fail(p, "unknown array element type %" PRIu32 " at byte %zu", elem, at);
    if (read_u64(p, &n, "an array count")) return -1;
    v->type = LUMA_GGUF_ARRAY;
    v->elem_type = (enum luma_gguf_type)elem;
    v->n = n;
    v->data = p->base + p->pos;

    size_t left = p->size - p->pos;
    size_t min = elem == LUMA_GGUF_STRING ? MIN_STR
               : elem == LUMA_GGUF_ARRAY ? MIN_ARRAY : scalar_size[elem];
    if (n > left / min)
        return fail(p, "array of %" PRIu64 " %s elements at byte %zu runs past the end of the file "
                    "(%zu bytes left)", n, type_names[elem], at, left);
    if (elem == LUMA_GGUF_STRING && n > 0) {
        luma_str *strs = own_alloc(p, n, sizeof *strs);
        if (!strs) return -1;
        for (uint64_t i = 0; i < n; i++)
            if (read_str(p, &strs[i], "an array string")) return -1;
        v->strs = strs;
    } else if (elem == LUMA_GGUF_ARRAY && n > 0) {
        luma_gguf_value *items = own_alloc(p, n, sizeof *items);
        if (!items) return -1;
        for (uint64_t i = 0; i < n; i++)
            if (read_array(p, &items[i], depth + 1)) return -1;
        v->items = items;
    } else {
        p->pos += (size_t)n * min;
    }
    return 0;
}

static int read_value(parser *p, luma_gguf_value *v)
{
    uint32_t type;
    size_t at = p->pos;
    if (read_u32(p, &type, "the value type")) return -1;
    if (type >= LUMA_GGUF_TYPE_COUNT)
        return fail(p, "unknown value type %" PRIu32 " at byte %zu", type, at);
    v->type = (enum luma_gguf_type)type;
    if (type == LUMA_GGUF_STRING) return read_str(p, &v->v.str, "the string");
    if (type == LUMA_GGUF_ARRAY) return read_array(p, v, 1);
    if (need(p, scalar_size[type], "the value")) return -1;
    decode_scalar(p->base + p->pos, v->type, v);
    p->pos += scalar_size[type];
    return 0;
}

static int cmp_kv(const void *a, const void *b)
{
    const luma_gguf_kv *x = *(const luma_gguf_kv *const *)a, *y = *(const luma_gguf_kv *const *)b;
    int c = str_cmp(x->key.ptr, x->key.len, y->key.ptr, y->key.len);
    return c ? c : (x > y) - (x < y);
}

static int cmp_tensor(const void *a, const void *b)
{
    const luma_gguf_tensor *x = *(const luma_gguf_tensor *const *)a;
    const luma_gguf_tensor *y = *(const luma_gguf_tensor *const *)b;
    int c = str_cmp(x->name.ptr, x->name.len, y->name.ptr, y->name.len);
    return c ? c : (x > y) - (x < y);
}

static int read_header(parser *p, luma_gguf *g)
{
    static const char magic[4] = {'G', 'G', 'U', 'F'};
    p->what = "header";
    if (p->size < 4 || memcmp(p->base, magic, 4) != 0)
        return fail(p, "bad magic: not a GGUF file");
    p->pos = 4;
    if (read_u32(p, &g->version, "the version")) return -1;
    if (g->version == 1)
        return fail(p, "GGUF version 1 is not supported (only versions 2 and 3)");
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return fail(p, "unsupported version: a big-endian GGUF file");
    if (g->version != 2 && g->version != 3)
        return fail(p, "unsupported GGUF version %" PRIu32 " (only versions 2 and 3)", g->version);
    if (read_u64(p, &g->n_tensors, "the tensor count")) return -1;
    if (read_u64(p, &g->n_kv, "the metadata count")) return -1;

    size_t left = p->size - p->pos;
    if (g->n_kv > left / MIN_KV)
        return fail(p, "n_kv %" PRIu64 " is more than the %zu bytes left can hold", g->n_kv, left);
    if (g->n_tensors > left / MIN_TENSOR)
        return fail(p, "n_tensors %" PRIu64 " is more than the %zu bytes left can hold",
                    g->n_tensors, left);
    if (g->n_kv * MIN_KV > left - g->n_tensors * MIN_TENSOR)
        return fail(p, "n_kv %" PRIu64 " and n_tensors %" PRIu64 " are more than the %zu bytes "
                    "left can hold", g->n_kv, g->n_tensors, left);
    return 0;
}

static int read_kvs(parser *p, luma_gguf *g)
{
    if (g->n_kv == 0) return 0;
    g->kv = own_alloc(p, g->n_kv, sizeof *g->kv);
    const luma_gguf_kv **sorted = own_alloc(p, g->n_kv, sizeof *sorted);
    if (!g->kv || !sorted) return -1;
    p->what = "key";
    for (uint64_t i = 0; i < g->n_kv; i++) {
        luma_gguf_kv *kv = &g->kv[i];
        p->index = i;
        p->start = p->pos;
        p->name = (luma_str){NULL, 0};
        if (read_str(p, &kv->key, "the key")) return -1;
        p->name = kv->key;
        if (read_value(p, &kv->value)) return -1;
        sorted[i] = kv;
    }
    qsort(sorted, (size_t)g->n_kv, sizeof *sorted, cmp_kv);
    for (uint64_t i = 1; i < g->n_kv; i++) {
        const luma_gguf_kv *a = sorted[i - 1], *b = sorted[i];
        if (str_cmp(a->key.ptr, a->key.len, b->key.ptr, b->key.len) == 0) {
            p->index = (uint64_t)(b - g->kv);
            p->start = (size_t)((const uint8_t *)b->key.ptr - p->base) - MIN_STR;
            p->name = b->key;
            return fail(p, "duplicate key (first defined as #%td)", a - g->kv);
        }
    }
    p->file->kv_sorted = sorted;
    return 0;
}

static int read_alignment(parser *p, luma_gguf *g)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, "general.alignment");
    g->alignment = LUMA_GGUF_DEFAULT_ALIGNMENT;
    if (!kv) return 0;
    p->what = "key";
    p->index = (uint64_t)(kv - g->kv);
    p->start = (size_t)((const uint8_t *)kv->key.ptr - p->base) - MIN_STR;
    p->name = kv->key;
    if (kv->value.type != LUMA_GGUF_U32)
        return fail(p, "general.alignment must be a u32, not %s", type_names[kv->value.type]);
    uint64_t a = kv->value.v.u64;
    if (a == 0 || (a & (a - 1)) != 0)
        return fail(p, "alignment %" PRIu64 " is not a non-zero power of two", a);
    g->alignment = a;
    return 0;
}

/* Shape, type and size of one tensor info; its place in the data section is
 * checked once the section's start is known. */
static int read_tensor_info(parser *p, luma_gguf_tensor *t)
{
    uint32_t n_dims;
    if (read_str(p, &t->name, "the tensor name")) return -1;
    p->name = t->name;
    if (read_u32(p, &n_dims, "n_dims")) return -1;
    if (n_dims < 1 || n_dims > LUMA_GGUF_MAX_DIMS)
        return fail(p, "n_dims %" PRIu32 " is not in 1..%d", n_dims, LUMA_GGUF_MAX_DIMS);
    t->n_dims = n_dims;
    int64_t nelem = 1;
    for (int d = 0; d < LUMA_GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if ((uint32_t)d < n_dims && read_u64(p, &ne, "a dimension")) return -1;
        if (ne == 0 || ne > INT64_MAX)
            return fail(p, "dimension %d is %" PRIu64 ", not a positive int64", d, ne);
        if ((int64_t)ne > INT64_MAX / nelem)
            return fail(p, "dimensions overflow int64 in their product (at dimension %d)", d);
        t->ne[d] = (int64_t)ne;
        nelem *= (int64_t)ne;
    }
    if (read_u32(p, &t->type, "the tensor type")) return -1;
    if (read_u64(p, &t->offset, "the tensor offset")) return -1;

    const luma_type_traits *tr = luma_type_get(t->type);
    if (!tr || !tr->name)
        return fail(p, "unknown tensor type %" PRIu32, t->type);
    if (t->ne[0] % tr->block_size != 0)
        return fail(p, "row of %" PRId64 " elements is not a multiple of the %s block size %" PRId64,
                    t->ne[0], tr->name, tr->block_size);
    size_t size;
    if (tensor_bytes(tr, t->type, t->ne, &size) != 0)
        return fail(p, "tensor size overflows (%s [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "])",
                    tr->name, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    t->size = size;
    return 0;
}

static int read_tensors(parser *p, luma_gguf *g)
{
    if (g->n_tensors == 0) return 0;
    g->tensors = own_alloc(p, g->n_tensors, sizeof *g->tensors);
    const luma_gguf_tensor **sorted = own_alloc(p, g->n_tensors, sizeof *sorted);
    if (!g->tensors || !sorted) return -1;
    p->what = "tensor";
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        p->index = i;
        p->start = p->pos;
        p->name = (luma_str){NULL, 0};
        if (read_tensor_info(p, &g->tensors[i])) return -1;
        sorted[i] = &g->tensors[i];
    }
    qsort(sorted, (size_t)g->n_tensors, sizeof *sorted, cmp_tensor);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const luma_gguf_tensor *a = sorted[i - 1], *b = sorted[i];
        if (str_cmp(a->name.ptr, a->name.len, b->name.ptr, b->name.len) == 0) {
            p->index = (uint64_t)(b - g->tensors);
            p->start = (size_t)((const uint8_t *)b->name.ptr - p->base) - MIN_STR;
            p->name = b->name;
            return fail(p, "duplicate tensor name (first defined as #%td)", a - g->tensors);
        }
    }
    p->file->tensor_sorted = sorted;
    return 0;
}

/* The data section starts at the first aligned byte after the tensor infos;
 * each tensor lies inside it at an aligned offset. */
static int place_tensors(parser *p, luma_gguf *g)
{
    size_t rem = p->pos % g->alignment, pad = rem ? (size_t)g->alignment - rem : 0;
    p->what = "header";
    if (pad > SIZE_MAX - p->pos)
        return fail(p, "data section offset overflows");
    g->data_offset = p->pos + pad;
    if (g->n_tensors == 0) return 0;
    if (g->data_offset > p->size)
        return fail(p, "data section at byte %" PRIu64 " starts past the end of the file (%zu bytes)",
                    g->data_offset, p->size);
    uint64_t data_size = p->size - g->data_offset;
    p->what = "tensor";
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        luma_gguf_tensor *t = &g->tensors[i];
        p->index = i;
        p->start = (size_t)((const uint8_t *)t->name.ptr - p->base) - MIN_STR;
        p->name = t->name;
        if (t->offset % g->alignment != 0)
            return fail(p, "offset %" PRIu64 " is not aligned to %" PRIu64, t->offset, g->alignment);
        if (t->offset > data_size || t->size > data_size - t->offset)
            return fail(p, "offset %" PRIu64 " + size %" PRIu64 " runs past the end of the data "
                        "section (%" PRIu64 " bytes)", t->offset, t->size, data_size);
        t->data = p->base + g->data_offset + t->offset;
    }
    return 0;
}

static void release(gguf_file *f)
{
    while (f->chunks) {
        chunk *next = f->chunks->next;
        free(f->chunks);
        f->chunks = next;
    }
    if (f->mapped) munmap((void *)f->pub.base, f->pub.size);
    free(f);
}

static int parse(const void *data, size_t size, bool mapped, luma_gguf **out, luma_err *err)
{
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        if (mapped) munmap((void *)data, size);
        return luma_errf(err, "gguf: out of memory");
    }
    f->mapped = mapped;
    f->pub.base = data;
    f->pub.size = size;
    f->pub.priv = f;
    parser p = {.base = data, .size = size, .file = f, .err = err, .what = "header"};
    if (read_header(&p, &f->pub) || read_kvs(&p, &f->pub) || read_alignment(&p, &f->pub) ||
        read_tensors(&p, &f->pub) || place_tensors(&p, &f->pub)) {
        release(f);
        return -1;
    }
    *out = &f->pub;
    return 0;
}

int luma_gguf_open_memory(const void *data, size_t size, luma_gguf **out, luma_err *err)
{
    static const uint8_t empty[1];
    *out = NULL;
    return parse(data ? data : empty, data ? size : 0, false, out, err);
}

int luma_gguf_open(const char *path, luma_gguf **out, luma_err *err)
{
    struct stat st;
    luma_err perr;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return luma_errf(err, "%s: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return luma_errf(err, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode) || st.st_size <= 0 || (uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return luma_errf(err, "%s: not a GGUF file (%s)", path,
                         !S_ISREG(st.st_mode) ? "not a regular file"
                         : st.st_size == 0 ? "empty" : "too large to map");
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return luma_errf(err, "%s: mmap: %s", path, strerror(e));
    if (parse(map, size, true, out, &perr) != 0)
        return luma_errf(err, "%s: %s", path, perr.msg);
    return 0;
}

void luma_gguf_close(luma_gguf *g)
{
    if (g) release(g->priv);
}

/* ---- lookup ------------------------------------------------------------- */

const luma_gguf_kv *luma_gguf_find(const luma_gguf *g, const char *key)
{
    if (!g || !key || g->n_kv == 0) return NULL;
    const gguf_file *f = g->priv;
    size_t klen = strlen(key), lo = 0, hi = (size_t)g->n_kv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const luma_gguf_kv *kv = f->kv_sorted[mid];
        int c = str_cmp(kv->key.ptr, kv->key.len, key, klen);
        if (c == 0) return kv;
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

const luma_gguf_tensor *luma_gguf_find_tensor(const luma_gguf *g, const char *name)
{
    if (!g || !name || g->n_tensors == 0) return NULL;
    const gguf_file *f = g->priv;
    size_t nlen = strlen(name), lo = 0, hi = (size_t)g->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const luma_gguf_tensor *t = f->tensor_sorted[mid];
        int c = str_cmp(t->name.ptr, t->name.len, name, nlen);
        if (c == 0) return t;
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

static int wrong_type(const char *key, const luma_gguf_value *v, const char *want, luma_err *err)
{
    if (v->type == LUMA_GGUF_ARRAY)
        return luma_errf(err, "gguf key '%s': expected %s, found an array of %s", key, want,
                         type_names[v->elem_type]);
    return luma_errf(err, "gguf key '%s': expected %s, found %s", key, want, type_names[v->type]);
}

int luma_gguf_get_u32(const luma_gguf *g, const char *key, uint32_t def, uint32_t *out, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    if (!kv) { *out = def; return 0; }
    const luma_gguf_value *v = &kv->value;
    switch (v->type) {
    case LUMA_GGUF_U8: case LUMA_GGUF_U16: case LUMA_GGUF_U32: case LUMA_GGUF_U64:
        if (v->v.u64 > UINT32_MAX)
            return luma_errf(err, "gguf key '%s': %" PRIu64 " does not fit in a u32", key, v->v.u64);
        *out = (uint32_t)v->v.u64;
        return 0;
    case LUMA_GGUF_I8: case LUMA_GGUF_I16: case LUMA_GGUF_I32: case LUMA_GGUF_I64:
        if (v->v.i64 < 0 || v->v.i64 > (int64_t)UINT32_MAX)
            return luma_errf(err, "gguf key '%s': %" PRId64 " does not fit in a u32", key, v->v.i64);
        *out = (uint32_t)v->v.i64;
        return 0;
    default:
        return wrong_type(key, v, "an integer", err);
    }
}

int luma_gguf_get_f32(const luma_gguf *g, const char *key, float def, float *out, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    if (!kv) { *out = def; return 0; }
    if (kv->value.type != LUMA_GGUF_F32 && kv->value.type != LUMA_GGUF_F64)
        return wrong_type(key, &kv->value, "a float", err);
    *out = (float)kv->value.v.f64;
    return 0;
}

int luma_gguf_get_bool(const luma_gguf *g, const char *key, bool def, bool *out, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    if (!kv) { *out = def; return 0; }
    if (kv->value.type != LUMA_GGUF_BOOL) return wrong_type(key, &kv->value, "a bool", err);
    *out = kv->value.v.u64 != 0;
    return 0;
}

int luma_gguf_get_str(const luma_gguf *g, const char *key, luma_str *out, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    *out = (luma_str){NULL, 0};
    if (!kv) return 0;
    if (kv->value.type != LUMA_GGUF_STRING) return wrong_type(key, &kv->value, "a string", err);
    *out = kv->value.v.str;
    return 0;
}

int luma_gguf_get_arr(const luma_gguf *g, const char *key, enum luma_gguf_type elem,
                      const luma_gguf_value **out, luma_err *err)
{
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    *out = NULL;
    if (!kv) return 0;
    if (kv->value.type != LUMA_GGUF_ARRAY || kv->value.elem_type != elem) {
        char want[32];
        snprintf(want, sizeof want, "an array of %s", luma_gguf_type_name(elem));
        return wrong_type(key, &kv->value, want, err);
    }
    *out = &kv->value;
    return 0;
}

/* ---- writing ------------------------------------------------------------ */

typedef struct buf {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} buf;

static void put(buf *b, const void *src, size_t n)
{
    if (b->oom || n == 0) return;
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2) { b->oom = true; return; }
            cap *= 2;
        }
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->oom = true; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }

static void put_str(buf *b, const char *s, uint64_t len)
{
    put_u64(b, len);
    put(b, s, (size_t)len);
}

typedef struct wkv {
    char *key;
    size_t key_len;
    buf value;          /* u32 type and the encoded value */
} wkv;

/* A tensor holds either a copy of its data or a fill callback that makes
 * the data at save time. */
typedef struct wtensor {
    char *name;
    uint32_t type, n_dims;
    int64_t ne[LUMA_GGUF_MAX_DIMS];
    void *data;
    size_t size;
    luma_gguf_fill_fn fill;
    void *fill_ctx;
} wtensor;

struct luma_gguf_writer {
    wkv *kv;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
    uint64_t alignment;
    bool failed;        /* the first failure of a setter, reported at save */
    luma_err why;
};

luma_gguf_writer *luma_gguf_writer_new(void)
{
    luma_gguf_writer *w = calloc(1, sizeof *w);
    if (w) w->alignment = LUMA_GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void luma_gguf_writer_free(luma_gguf_writer *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].value.p);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->kv);
    free(w->tensors);
    free(w);
}

static void writer_fail(luma_gguf_writer *w, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static void writer_fail(luma_gguf_writer *w, const char *fmt, ...)
{
    if (w->failed) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->why.msg, sizeof w->why.msg, fmt, ap);
    va_end(ap);
    w->failed = true;
}

/* Grows an array of `size`-byte entries to hold one more. */
static bool grow(void **arr, size_t *cap, size_t n, size_t size)
{
    if (n < *cap) return true;
    size_t ncap = *cap ? *cap * 2 : 16, bytes;
    if (luma_mul_size(ncap, size, &bytes) != 0) return false;
    void *p = realloc(*arr, bytes);
    if (!p) return false;
    *arr = p;
    *cap = ncap;
    return true;
}

static void encode_scalar(buf *b, const luma_gguf_value *v, enum luma_gguf_type t)
{
    uint8_t u8; uint16_t u16; uint32_t u32; float f32;
    switch (t) {
    case LUMA_GGUF_U8: case LUMA_GGUF_I8:
        u8 = t == LUMA_GGUF_U8 ? (uint8_t)v->v.u64 : (uint8_t)v->v.i64; put(b, &u8, 1); break;
    case LUMA_GGUF_BOOL: u8 = v->v.u64 != 0; put(b, &u8, 1); break;
    case LUMA_GGUF_U16: case LUMA_GGUF_I16:
        u16 = t == LUMA_GGUF_U16 ? (uint16_t)v->v.u64 : (uint16_t)v->v.i64; put(b, &u16, 2); break;
    case LUMA_GGUF_U32: case LUMA_GGUF_I32:
        u32 = t == LUMA_GGUF_U32 ? (uint32_t)v->v.u64 : (uint32_t)v->v.i64; put(b, &u32, 4); break;
    case LUMA_GGUF_U64: put_u64(b, v->v.u64); break;
    case LUMA_GGUF_I64: put_u64(b, (uint64_t)v->v.i64); break;
    case LUMA_GGUF_F32: f32 = (float)v->v.f64; put(b, &f32, 4); break;
    case LUMA_GGUF_F64: put(b, &v->v.f64, 8); break;
    default: break;
    }
}

/* An array body as read_array reads it; returns a reason on a bad value. */
static const char *encode_array(buf *b, const luma_gguf_value *v, int depth)
{
    if (depth > LUMA_GGUF_MAX_NESTING) return "arrays nested too deep";
    if (v->type != LUMA_GGUF_ARRAY) return "a nested item is not an array";
    if ((unsigned)v->elem_type >= LUMA_GGUF_TYPE_COUNT) return "unknown array element type";
    put_u32(b, v->elem_type);
    put_u64(b, v->n);
    if (v->n == 0) return NULL;
    if (v->elem_type == LUMA_GGUF_STRING) {
        if (!v->strs) return "array of strings without strs";
        for (uint64_t i = 0; i < v->n; i++) put_str(b, v->strs[i].ptr, v->strs[i].len);
    } else if (v->elem_type == LUMA_GGUF_ARRAY) {
        if (!v->items) return "nested array without items";
        for (uint64_t i = 0; i < v->n; i++) {
            const char *why = encode_array(b, &v->items[i], depth + 1);
            if (why) return why;
        }
    } else {
        size_t bytes;
        if (!v->data) return "array without data";
        if (v->n > SIZE_MAX || luma_mul_size((size_t)v->n, scalar_size[v->elem_type], &bytes) != 0)
            return "array too large";
        put(b, v->data, bytes);
    }
    return NULL;
}

static void set_kv(luma_gguf_writer *w, const char *key, size_t key_len, const luma_gguf_value *v)
{
    if (!w || w->failed) return;
    if (!key || !v) { writer_fail(w, "gguf writer: NULL key or value"); return; }
    char name[NAME_SHOWN + 4];
    show_name((luma_str){key, key_len}, name);
    buf b = {0};
    const char *why = NULL;
    if ((unsigned)v->type >= LUMA_GGUF_TYPE_COUNT) {
        why = "unknown value type";
    } else {
        put_u32(&b, v->type);
        if (v->type == LUMA_GGUF_STRING) put_str(&b, v->v.str.ptr, v->v.str.len);
        else if (v->type == LUMA_GGUF_ARRAY) why = encode_array(&b, v, 1);
        else encode_scalar(&b, v, v->type);
    }
    if (!why && b.oom) why = "out of memory";
    if (!why && luma_str_eq((luma_str){key, key_len}, "general.alignment")) {
        uint64_t a = v->v.u64;
        if (v->type != LUMA_GGUF_U32) why = "general.alignment must be a u32";
        else if (a == 0 || (a & (a - 1)) != 0) why = "alignment is not a non-zero power of two";
        else w->alignment = a;
    }
    if (why) {
        free(b.p);
        writer_fail(w, "gguf writer: key '%s': %s", name, why);
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        wkv *kv = &w->kv[i];
        if (kv->key_len == key_len && memcmp(kv->key, key, key_len) == 0) {
            free(kv->value.p);
            kv->value = b;
            return;
        }
    }
    char *copy = malloc(key_len + 1);
    if (!copy || !grow((void **)&w->kv, &w->cap_kv, w->n_kv, sizeof *w->kv)) {
        free(copy);
        free(b.p);
        writer_fail(w, "gguf writer: key '%s': out of memory", name);
        return;
    }
    memcpy(copy, key, key_len);
    copy[key_len] = '\0';
    w->kv[w->n_kv++] = (wkv){copy, key_len, b};
}

void luma_gguf_set_value(luma_gguf_writer *w, const char *key, const luma_gguf_value *v)
{
    set_kv(w, key, key ? strlen(key) : 0, v);
}

void luma_gguf_copy_kv(luma_gguf_writer *w, const luma_gguf_kv *kv)
{
    if (!kv) { set_kv(w, NULL, 0, NULL); return; }
    set_kv(w, kv->key.ptr ? kv->key.ptr : "", (size_t)kv->key.len, &kv->value);
}

void luma_gguf_set_u32(luma_gguf_writer *w, const char *key, uint32_t v)
{
    luma_gguf_value val = {.type = LUMA_GGUF_U32, .v.u64 = v};
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_i32(luma_gguf_writer *w, const char *key, int32_t v)
{
    luma_gguf_value val = {.type = LUMA_GGUF_I32, .v.i64 = v};
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_f32(luma_gguf_writer *w, const char *key, float v)
{
    luma_gguf_value val = {.type = LUMA_GGUF_F32, .v.f64 = v};
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_bool(luma_gguf_writer *w, const char *key, bool v)
{
    luma_gguf_value val = {.type = LUMA_GGUF_BOOL, .v.u64 = v};
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_str(luma_gguf_writer *w, const char *key, const char *v)
{
    luma_gguf_value val = {.type = LUMA_GGUF_STRING};
    if (!v) { luma_gguf_set_value(w, key, NULL); return; }
    val.v.str = (luma_str){v, strlen(v)};
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_arr(luma_gguf_writer *w, const char *key, enum luma_gguf_type elem,
                       const void *data, uint64_t n)
{
    luma_gguf_value val = {.type = LUMA_GGUF_ARRAY, .elem_type = elem, .n = n, .data = data};
    if (w && (elem == LUMA_GGUF_STRING || elem == LUMA_GGUF_ARRAY)) {
        writer_fail(w, "gguf writer: key '%s': luma_gguf_set_arr takes scalar elements, not %s",
                    key ? key : "(null)", type_names[elem]);
        return;
    }
    luma_gguf_set_value(w, key, &val);
}

void luma_gguf_set_arr_str(luma_gguf_writer *w, const char *key, const luma_str *strs, uint64_t n)
{
    luma_gguf_value val = {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_STRING, .n = n,
                           .strs = strs};
    luma_gguf_set_value(w, key, &val);
}

/* Checks a new tensor's name, shape and type and fills in t (name not yet
 * copied); size is the bytes its data will have. */
static int check_tensor(const luma_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                        const int64_t *ne, wtensor *t, luma_err *err)
{
    if (!w) return luma_errf(err, "gguf writer: out of memory");
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > WRITER_MAX_NAME)
        return luma_errf(err, "gguf writer: tensor name must be 1..%d bytes", WRITER_MAX_NAME);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return luma_errf(err, "gguf writer: duplicate tensor '%s'", name);
    if (n_dims < 1 || n_dims > LUMA_GGUF_MAX_DIMS || !ne)
        return luma_errf(err, "gguf writer: tensor '%s': n_dims %" PRIu32 " is not in 1..%d",
                         name, n_dims, LUMA_GGUF_MAX_DIMS);
    const luma_type_traits *tr = luma_type_get(type);
    if (!tr || !tr->name)
        return luma_errf(err, "gguf writer: tensor '%s': unknown type %" PRIu32, name, type);
    *t = (wtensor){.type = type, .n_dims = n_dims, .ne = {1, 1, 1, 1}};
    int64_t nelem = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || ne[d] > INT64_MAX / nelem)
            return luma_errf(err, "gguf writer: tensor '%s': bad dimension %" PRIu32 " (%" PRId64 ")",
                             name, d, ne[d]);
        t->ne[d] = ne[d];
        nelem *= ne[d];
    }
    if (t->ne[0] % tr->block_size != 0)
        return luma_errf(err, "gguf writer: tensor '%s': row of %" PRId64 " is not a multiple "
                         "of the %s block size", name, t->ne[0], tr->name);
    if (tensor_bytes(tr, type, t->ne, &t->size) != 0)
        return luma_errf(err, "gguf writer: tensor '%s': too large", name);
    return 0;
}

/* Appends t, taking ownership of data (which may be NULL). */
static int push_tensor(luma_gguf_writer *w, const char *name, wtensor t, luma_err *err)
{
    size_t len = strlen(name);
    t.name = malloc(len + 1);
    if (!t.name || !grow((void **)&w->tensors, &w->cap_tensors, w->n_tensors, sizeof *w->tensors)) {
        free(t.name);
        free(t.data);
        return luma_errf(err, "gguf writer: tensor '%s': out of memory", name);
    }
    memcpy(t.name, name, len + 1);
    w->tensors[w->n_tensors++] = t;
    return 0;
}

int luma_gguf_add_tensor(luma_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                         const int64_t *ne, const void *data, size_t size, luma_err *err)
{
    wtensor t;
    if (check_tensor(w, name, type, n_dims, ne, &t, err)) return -1;
    if (t.size != size)
        return luma_errf(err, "gguf writer: tensor '%s': data is %zu bytes, %s [%" PRId64 ", %"
                         PRId64 ", %" PRId64 ", %" PRId64 "] needs %zu", name, size,
                         luma_type_name(type), t.ne[0], t.ne[1], t.ne[2], t.ne[3], t.size);
    if (!data) return luma_errf(err, "gguf writer: tensor '%s': no data", name);
    t.data = malloc(size);
    if (!t.data) return luma_errf(err, "gguf writer: tensor '%s': out of memory", name);
    memcpy(t.data, data, size);
    return push_tensor(w, name, t, err);
}

int luma_gguf_add_tensor_fill(luma_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                              const int64_t *ne, luma_gguf_fill_fn fill, void *ctx, luma_err *err)
{
    wtensor t;
    if (check_tensor(w, name, type, n_dims, ne, &t, err)) return -1;
    if (!fill) return luma_errf(err, "gguf writer: tensor '%s': no fill function", name);
    t.fill = fill;
    t.fill_ctx = ctx;
    return push_tensor(w, name, t, err);
}

static size_t padding(uint64_t pos, uint64_t alignment)
{
    uint64_t rem = pos % alignment;
    return rem ? (size_t)(alignment - rem) : 0;
}

static bool write_all(FILE *fp, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, fp) == n;
}

static bool write_zeros(FILE *fp, size_t n)
{
    static const uint8_t zeros[256];
    for (size_t k; n > 0; n -= k) {
        k = n < sizeof zeros ? n : sizeof zeros;
        if (!write_all(fp, zeros, k)) return false;
    }
    return true;
}

/* A filled tensor is made this many bytes at a time (or one row, when a
 * row is larger). */
#define FILL_CHUNK ((size_t)4 << 20)

enum { WRITTEN, WRITE_FAILED, FILL_FAILED };

/* Writes a tensor whose data its fill callback makes, a chunk of whole rows
 * at a time. FILL_FAILED leaves the callback's message in err. */
static int write_filled(FILE *fp, const wtensor *t, luma_err *err)
{
    int64_t n_rows = t->ne[1] * t->ne[2] * t->ne[3];
    size_t row = t->size / (size_t)n_rows;
    int64_t per = (int64_t)(FILL_CHUNK / row);
    if (per < 1) per = 1;
    if (per > n_rows) per = n_rows;
    uint8_t *rows = malloc((size_t)per * row);
    if (!rows) {
        luma_errf(err, "gguf writer: tensor '%s': out of memory", t->name);
        return FILL_FAILED;
    }
    int rc = WRITTEN;
    for (int64_t r = 0; r < n_rows && rc == WRITTEN; r += per) {
        int64_t n = n_rows - r < per ? n_rows - r : per;
        if (t->fill(t->fill_ctx, r, n, rows, err) != 0) rc = FILL_FAILED;
        else if (!write_all(fp, rows, (size_t)n * row)) rc = WRITE_FAILED;
    }
    free(rows);
    return rc;
}

/* Everything before the data section: the header, the metadata, the tensor
 * infos with offsets that place each tensor at the next aligned byte. */
static int encode_head(const luma_gguf_writer *w, buf *b)
{
    static const char magic[4] = {'G', 'G', 'U', 'F'};
    put(b, magic, 4);
    put_u32(b, 3);
    put_u64(b, w->n_tensors);
    put_u64(b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        put_str(b, w->kv[i].key, w->kv[i].key_len);
        put(b, w->kv[i].value.p, w->kv[i].value.len);
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        put_str(b, t->name, strlen(t->name));
        put_u32(b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(b, (uint64_t)t->ne[d]);
        put_u32(b, t->type);
        put_u64(b, offset);
        offset += t->size + padding(t->size, w->alignment);
    }
    return b->oom ? -1 : 0;
}

int luma_gguf_writer_save(luma_gguf_writer *w, const char *path, luma_err *err)
{
    if (!w) return luma_errf(err, "gguf writer: out of memory");
    if (w->failed) return luma_errf(err, "%s", w->why.msg);
    buf head = {0};
    if (encode_head(w, &head) != 0) {
        free(head.p);
        return luma_errf(err, "gguf writer: out of memory encoding the header");
    }
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        free(head.p);
        return luma_errf(err, "%s: %s", path, strerror(errno));
    }
    bool ok = write_all(fp, head.p, head.len) && write_zeros(fp, padding(head.len, w->alignment));
    bool filled = true;
    for (size_t i = 0; ok && filled && i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        if (t->fill) {
            int rc = write_filled(fp, t, err);
            ok = rc != WRITE_FAILED;
            filled = rc != FILL_FAILED;
        } else {
            ok = write_all(fp, t->data, t->size);
        }
        ok = ok && filled && write_zeros(fp, padding(t->size, w->alignment));
    }
    int e = errno;
    free(head.p);
    if (fclose(fp) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (!ok) {
        remove(path);
        if (!filled) return -1;
        return luma_errf(err, "%s: write failed: %s", path, strerror(e));
    }
    return 0;
}
