/* test_gguf: the GGUF reader and writer.
 *
 * Pins down: a file written with every metadata type and tensors of four
 * types reads back value for value (and copies back byte for byte); every
 * truncation and thousands of random mutations of it are refused cleanly or
 * open with every range inside the buffer (buffers are exactly sized, so the
 * sanitizer build catches any over-read); hand-made malformed files are
 * refused with a message naming the problem; real files (the default model,
 * the tokenizer vocabularies) open when present.
 *
 * `test_gguf --write-corpus DIR` writes the fuzzer's seed files instead. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "quant.h"
#include "testutil.h"

/* ---- small tools ---------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1DULL;
}

static void fill(void *dst, size_t n, uint64_t seed)
{
    uint8_t *p = dst;
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rng_next(&seed) >> 56);
}

static uint64_t fnv(uint64_t h, const void *p, uint64_t n)
{
    const uint8_t *b = p;
    for (uint64_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* A growable byte string, for hand-made files. */
typedef struct bytes {
    uint8_t *p;
    size_t len, cap;
} bytes;

static void b_put(bytes *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) { fprintf(stderr, "test_gguf: out of memory\n"); exit(2); }
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void b_u32(bytes *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(bytes *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(bytes *b, const char *s) { b_u64(b, strlen(s)); b_put(b, s, strlen(s)); }

static void b_pad(bytes *b, size_t align)
{
    static const uint8_t zero[256];
    if (b->len % align) b_put(b, zero, align - b->len % align);
}

static void b_zeros(bytes *b, size_t n)
{
    static const uint8_t zero[256];
    for (size_t k; n > 0; n -= k) {
        k = n < sizeof zero ? n : sizeof zero;
        b_put(b, zero, k);
    }
}

static void b_header(bytes *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    b_put(b, "GGUF", 4);
    b_u32(b, version);
    b_u64(b, n_tensors);
    b_u64(b, n_kv);
}

static void b_kv_u32(bytes *b, const char *key, uint32_t v)
{
    b_str(b, key);
    b_u32(b, LUMA_GGUF_U32);
    b_u32(b, v);
}

static void b_tensor(bytes *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                     uint32_t type, uint64_t offset)
{
    b_str(b, name);
    b_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) b_u64(b, ne[d]);
    b_u32(b, type);
    b_u64(b, offset);
}

static int read_file(const char *path, bytes *out)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    uint8_t chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, fp)) > 0) b_put(out, chunk, n);
    fclose(fp);
    return 0;
}

/* Opens a copy of src[0..len) in a buffer of exactly len bytes, so that the
 * sanitizer build reports any read past the end. *keep is freed by the caller
 * after closing. */
static int open_copy(const uint8_t *src, size_t len, luma_gguf **g, uint8_t **keep, luma_err *err)
{
    *keep = malloc(len ? len : 1);
    if (!*keep) { fprintf(stderr, "test_gguf: out of memory\n"); exit(2); }
    if (len) memcpy(*keep, src, len);
    return luma_gguf_open_memory(*keep, len, g, err);
}

/* ---- walking an open file --------------------------------------------------- */

static int in_file(const luma_gguf *g, const void *p, uint64_t n)
{
    const uint8_t *b = p;
    if (n == 0) return 1;
    return b >= g->base && b <= g->base + g->size && n <= (uint64_t)(g->base + g->size - b);
}

static uint64_t walk_value(const luma_gguf *g, const luma_gguf_value *v, uint64_t h, int depth)
{
    CHECK(depth <= LUMA_GGUF_MAX_NESTING);
    if (v->type == LUMA_GGUF_STRING) {
        CHECK(in_file(g, v->v.str.ptr, v->v.str.len));
        return fnv(h, v->v.str.ptr, v->v.str.len);
    }
    if (v->type != LUMA_GGUF_ARRAY) return fnv(h, &v->v, sizeof v->v);
    for (uint64_t i = 0; i < v->n; i++) {
        if (v->elem_type == LUMA_GGUF_STRING) {
            CHECK(in_file(g, v->strs[i].ptr, v->strs[i].len));
            h = fnv(h, v->strs[i].ptr, v->strs[i].len);
        } else if (v->elem_type == LUMA_GGUF_ARRAY) {
            CHECK(v->items[i].type == LUMA_GGUF_ARRAY);
            h = walk_value(g, &v->items[i], h, depth + 1);
        }
    }
    if (v->elem_type != LUMA_GGUF_STRING && v->elem_type != LUMA_GGUF_ARRAY) {
        CHECK(in_file(g, v->data, v->n * luma_gguf_type_size(v->elem_type)));
        h = fnv(h, v->data, v->n * luma_gguf_type_size(v->elem_type));
    }
    return h;
}

/* Touches every value and every tensor byte; checks each range lies in the file. */
static uint64_t walk(const luma_gguf *g)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        CHECK(in_file(g, g->kv[i].key.ptr, g->kv[i].key.len));
        h = walk_value(g, &g->kv[i].value, fnv(h, g->kv[i].key.ptr, g->kv[i].key.len), 1);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        CHECK(t->data != NULL);
        CHECK((const uint8_t *)t->data >= g->base + g->data_offset);
        CHECK(in_file(g, t->data, t->size));
        CHECK(t->offset % g->alignment == 0);
        h = fnv(h, t->data, t->size);
    }
    return h;
}

/* ---- the sample file ---------------------------------------------------------- */

struct sample_tensor {
    const char *name;
    uint32_t type, n_dims;
    int64_t ne[4];
    size_t size;
};

/* The last tensor's size is a multiple of 32, so the file ends without
 * padding and every shorter prefix misses tensor bytes. */
static const struct sample_tensor sample_tensors[] = {
    {"token_embd.weight", LUMA_Q4_K, 2, {256, 2, 1, 1}, 2 * 144},
    {"blk.0.attn_q.weight", LUMA_Q8_0, 2, {64, 2, 1, 1}, 4 * 34},
    {"blk.0.ffn_up.weight", LUMA_F16, 3, {16, 2, 3, 1}, 16 * 2 * 3 * 2},
    {"output_norm.weight", LUMA_F32, 4, {8, 1, 2, 2}, 8 * 4 * 4},
};
#define N_SAMPLE_TENSORS (sizeof sample_tensors / sizeof sample_tensors[0])

static const luma_str sample_strs[] = {
    {"a", 1}, {"", 0}, {"tokens with spaces", 18}, {"\xe2\x96\x81x", 4},
};

static const int32_t nested_a[] = {1, 2};
static const int32_t nested_b[] = {3};
static const int32_t nested_c[] = {5, 6, 7};
static const luma_str nested_s[] = {{"x", 1}, {"yz", 2}};

/* Three elements of each scalar type, from a fixed pattern. */
static void scalar_pattern(enum luma_gguf_type t, uint8_t out[24])
{
    for (int i = 0; i < 24; i++) out[i] = (uint8_t)(17 * (int)t + 5 * i + 1);
    if (t == LUMA_GGUF_BOOL) out[0] = 1, out[1] = 0, out[2] = 1;
}

static char arr_key[LUMA_GGUF_TYPE_COUNT][32];

static void sample_kvs(luma_gguf_writer *w)
{
    luma_gguf_set_str(w, "general.architecture", "test");
    luma_gguf_set_value(w, "t.u8", &(luma_gguf_value){.type = LUMA_GGUF_U8, .v.u64 = 200});
    luma_gguf_set_value(w, "t.i8", &(luma_gguf_value){.type = LUMA_GGUF_I8, .v.i64 = -100});
    luma_gguf_set_value(w, "t.u16", &(luma_gguf_value){.type = LUMA_GGUF_U16, .v.u64 = 60000});
    luma_gguf_set_value(w, "t.i16", &(luma_gguf_value){.type = LUMA_GGUF_I16, .v.i64 = -30000});
    luma_gguf_set_u32(w, "t.u32", 4000000000u);
    luma_gguf_set_i32(w, "t.i32", -2000000000);
    luma_gguf_set_f32(w, "t.f32", 1.5f);
    luma_gguf_set_bool(w, "t.bool", true);
    luma_gguf_set_str(w, "t.str", "h\xc3\xa9llo");
    luma_gguf_set_value(w, "t.u64", &(luma_gguf_value){.type = LUMA_GGUF_U64,
                                                       .v.u64 = (1ULL << 63) + 5});
    luma_gguf_set_value(w, "t.i64", &(luma_gguf_value){.type = LUMA_GGUF_I64,
                                                       .v.i64 = -(1LL << 62)});
    luma_gguf_set_value(w, "t.f64", &(luma_gguf_value){.type = LUMA_GGUF_F64,
                                                       .v.f64 = 3.141592653589793});
    luma_gguf_set_str(w, "t.empty", "");
    for (int t = 0; t < LUMA_GGUF_TYPE_COUNT; t++) {
        uint8_t pat[24];
        if (t == LUMA_GGUF_STRING || t == LUMA_GGUF_ARRAY) continue;
        snprintf(arr_key[t], sizeof arr_key[t], "t.arr_%s", luma_gguf_type_name(t));
        scalar_pattern(t, pat);
        luma_gguf_set_arr(w, arr_key[t], t, pat, 3);
    }
    luma_gguf_set_arr_str(w, "t.arr_str", sample_strs, 4);
    luma_gguf_set_arr(w, "t.arr_none", LUMA_GGUF_I32, NULL, 0);

    /* [[1, 2], [3], [["x", "yz"]], [[5, 6, 7]]]: mixed element types, depth 3 */
    luma_gguf_value deep_s = {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_STRING, .n = 2,
                              .strs = nested_s};
    luma_gguf_value deep_i = {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_I32, .n = 3,
                              .data = nested_c};
    luma_gguf_value items[4] = {
        {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_I32, .n = 2, .data = nested_a},
        {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_I32, .n = 1, .data = nested_b},
        {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_ARRAY, .n = 1, .items = &deep_s},
        {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_ARRAY, .n = 1, .items = &deep_i},
    };
    luma_gguf_value nested = {.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_ARRAY, .n = 4,
                              .items = items};
    luma_gguf_set_value(w, "t.nested", &nested);

    /* setting a key again replaces it in place */
    luma_gguf_set_u32(w, "t.replaced", 1);
    luma_gguf_set_u32(w, "t.replaced", 2);
}

static int sample_write(const char *path, uint32_t alignment)
{
    luma_err err;
    luma_gguf_writer *w = luma_gguf_writer_new();
    if (alignment) luma_gguf_set_u32(w, "general.alignment", alignment);
    sample_kvs(w);
    for (size_t i = 0; i < N_SAMPLE_TENSORS; i++) {
        const struct sample_tensor *s = &sample_tensors[i];
        uint8_t data[512];
        fill(data, s->size, i + 1);
        if (luma_gguf_add_tensor(w, s->name, s->type, s->n_dims, s->ne, data, s->size, &err)) {
            fprintf(stderr, "test_gguf: add_tensor: %s\n", err.msg);
            failures++;
        }
    }
    int rc = luma_gguf_writer_save(w, path, &err);
    if (rc) fprintf(stderr, "test_gguf: save: %s\n", err.msg);
    luma_gguf_writer_free(w);
    return rc;
}

static const luma_gguf_value *value_of(const luma_gguf *g, const char *key)
{
    static const luma_gguf_value absent = {.type = LUMA_GGUF_TYPE_COUNT};
    const luma_gguf_kv *kv = luma_gguf_find(g, key);
    CHECK(kv != NULL);
    return kv ? &kv->value : &absent;
}

static void check_sample(const luma_gguf *g, uint64_t alignment)
{
    luma_err err;
    CHECK(g->version == 3);
    CHECK(g->alignment == alignment);
    CHECK(g->n_kv == 2 + 12 + 1 + 11 + 3 + (alignment != 32));
    CHECK(g->n_tensors == N_SAMPLE_TENSORS);

    const luma_gguf_value *v;
    v = value_of(g, "t.u8");  CHECK(v->type == LUMA_GGUF_U8 && v->v.u64 == 200);
    v = value_of(g, "t.i8");  CHECK(v->type == LUMA_GGUF_I8 && v->v.i64 == -100);
    v = value_of(g, "t.u16"); CHECK(v->type == LUMA_GGUF_U16 && v->v.u64 == 60000);
    v = value_of(g, "t.i16"); CHECK(v->type == LUMA_GGUF_I16 && v->v.i64 == -30000);
    v = value_of(g, "t.u32"); CHECK(v->type == LUMA_GGUF_U32 && v->v.u64 == 4000000000u);
    v = value_of(g, "t.i32"); CHECK(v->type == LUMA_GGUF_I32 && v->v.i64 == -2000000000);
    v = value_of(g, "t.f32"); CHECK(v->type == LUMA_GGUF_F32 && v->v.f64 == 1.5);
    v = value_of(g, "t.bool"); CHECK(v->type == LUMA_GGUF_BOOL && v->v.u64 == 1);
    v = value_of(g, "t.str"); CHECK(v->type == LUMA_GGUF_STRING && luma_str_eq(v->v.str, "h\xc3\xa9llo"));
    v = value_of(g, "t.u64"); CHECK(v->type == LUMA_GGUF_U64 && v->v.u64 == (1ULL << 63) + 5);
    v = value_of(g, "t.i64"); CHECK(v->type == LUMA_GGUF_I64 && v->v.i64 == -(1LL << 62));
    v = value_of(g, "t.f64"); CHECK(v->type == LUMA_GGUF_F64 && v->v.f64 == 3.141592653589793);
    v = value_of(g, "t.empty"); CHECK(v->type == LUMA_GGUF_STRING && v->v.str.len == 0);
    v = value_of(g, "t.replaced"); CHECK(v->type == LUMA_GGUF_U32 && v->v.u64 == 2);
    CHECK(luma_str_eq(g->kv[alignment != 32 ? 1 : 0].key, "general.architecture"));

    for (int t = 0; t < LUMA_GGUF_TYPE_COUNT; t++) {
        uint8_t pat[24];
        if (t == LUMA_GGUF_STRING || t == LUMA_GGUF_ARRAY) continue;
        scalar_pattern(t, pat);
        const luma_gguf_value *a = NULL;
        CHECK(luma_gguf_get_arr(g, arr_key[t], t, &a, &err) == 0 && a != NULL);
        if (!a) continue;
        CHECK(a->type == LUMA_GGUF_ARRAY && a->elem_type == (enum luma_gguf_type)t && a->n == 3);
        CHECK(memcmp(a->data, pat, 3 * luma_gguf_type_size(t)) == 0);
        CHECK(a->strs == NULL && a->items == NULL);
    }

    v = value_of(g, "t.arr_str");
    CHECK(v->type == LUMA_GGUF_ARRAY && v->elem_type == LUMA_GGUF_STRING && v->n == 4);
    for (uint64_t i = 0; v->strs && i < 4 && i < v->n; i++)
        CHECK(v->strs[i].len == sample_strs[i].len &&
              memcmp(v->strs[i].ptr, sample_strs[i].ptr, sample_strs[i].len) == 0);
    v = value_of(g, "t.arr_none");
    CHECK(v->type == LUMA_GGUF_ARRAY && v->elem_type == LUMA_GGUF_I32 && v->n == 0);

    v = value_of(g, "t.nested");
    CHECK(v->type == LUMA_GGUF_ARRAY && v->elem_type == LUMA_GGUF_ARRAY && v->n == 4 && v->items);
    if (v->items && v->n == 4) {
        const luma_gguf_value *it = v->items;
        int32_t x[3];
        CHECK(it[0].elem_type == LUMA_GGUF_I32 && it[0].n == 2);
        memcpy(x, it[0].data, 8);
        CHECK(x[0] == 1 && x[1] == 2);
        CHECK(it[1].elem_type == LUMA_GGUF_I32 && it[1].n == 1);
        memcpy(x, it[1].data, 4);
        CHECK(x[0] == 3);
        CHECK(it[2].elem_type == LUMA_GGUF_ARRAY && it[2].n == 1 && it[2].items);
        if (it[2].items) {
            const luma_gguf_value *s = &it[2].items[0];
            CHECK(s->elem_type == LUMA_GGUF_STRING && s->n == 2 && s->strs &&
                  luma_str_eq(s->strs[0], "x") && luma_str_eq(s->strs[1], "yz"));
        }
        CHECK(it[3].elem_type == LUMA_GGUF_ARRAY && it[3].n == 1 && it[3].items);
        if (it[3].items) {
            const luma_gguf_value *s = &it[3].items[0];
            CHECK(s->elem_type == LUMA_GGUF_I32 && s->n == 3);
            memcpy(x, s->data, 12);
            CHECK(x[0] == 5 && x[1] == 6 && x[2] == 7);
        }
    }

    CHECK(g->data_offset % alignment == 0);
    CHECK(g->size % alignment == 0);
    for (size_t i = 0; i < N_SAMPLE_TENSORS; i++) {
        const struct sample_tensor *s = &sample_tensors[i];
        const luma_gguf_tensor *t = luma_gguf_find_tensor(g, s->name);
        uint8_t data[512];
        CHECK(t == &g->tensors[i]);
        if (!t) continue;
        fill(data, s->size, i + 1);
        CHECK(luma_str_eq(t->name, s->name));
        CHECK(t->type == s->type && t->n_dims == s->n_dims);
        CHECK(memcmp(t->ne, s->ne, sizeof t->ne) == 0);
        CHECK(t->size == s->size);
        CHECK(t->offset % alignment == 0);
        CHECK(t->data == g->base + g->data_offset + t->offset);
        CHECK(memcmp(t->data, data, s->size) == 0);
    }
    CHECK(luma_gguf_find_tensor(g, "token_embd") == NULL);
    CHECK(luma_gguf_find_tensor(g, "token_embd.weightx") == NULL);
    CHECK(luma_gguf_find(g, "t.u") == NULL);
    CHECK(luma_gguf_find(g, "t.u80") == NULL);
}

/* The typed getters: conversions, defaults, and type errors. */
static void check_getters(const luma_gguf *g)
{
    luma_err err;
    uint32_t u;
    float f;
    bool b;
    luma_str s;
    const luma_gguf_value *a;

    CHECK(luma_gguf_get_u32(g, "t.u8", 0, &u, &err) == 0 && u == 200);
    CHECK(luma_gguf_get_u32(g, "t.u16", 0, &u, &err) == 0 && u == 60000);
    CHECK(luma_gguf_get_u32(g, "t.u32", 0, &u, &err) == 0 && u == 4000000000u);
    CHECK(luma_gguf_get_u32(g, "missing", 77, &u, &err) == 0 && u == 77);
    CHECK(luma_gguf_get_u32(g, "t.i8", 0, &u, &err) == -1 && strstr(err.msg, "fit"));
    CHECK(luma_gguf_get_u32(g, "t.u64", 0, &u, &err) == -1 && strstr(err.msg, "t.u64"));
    CHECK(luma_gguf_get_u32(g, "t.str", 0, &u, &err) == -1 && strstr(err.msg, "string"));
    CHECK(luma_gguf_get_u32(g, "t.f32", 0, &u, &err) == -1 && strstr(err.msg, "expected"));
    CHECK(luma_gguf_get_f32(g, "t.f32", 0, &f, &err) == 0 && f == 1.5f);
    CHECK(luma_gguf_get_f32(g, "t.f64", 0, &f, &err) == 0 && f == (float)3.141592653589793);
    CHECK(luma_gguf_get_f32(g, "missing", 0.25f, &f, &err) == 0 && f == 0.25f);
    CHECK(luma_gguf_get_f32(g, "t.u32", 0, &f, &err) == -1 && strstr(err.msg, "float"));
    CHECK(luma_gguf_get_bool(g, "t.bool", false, &b, &err) == 0 && b);
    CHECK(luma_gguf_get_bool(g, "missing", true, &b, &err) == 0 && b);
    CHECK(luma_gguf_get_bool(g, "t.u8", false, &b, &err) == -1 && strstr(err.msg, "bool"));
    CHECK(luma_gguf_get_str(g, "t.str", &s, &err) == 0 && luma_str_eq(s, "h\xc3\xa9llo"));
    CHECK(luma_gguf_get_str(g, "missing", &s, &err) == 0 && s.ptr == NULL && s.len == 0);
    CHECK(luma_gguf_get_str(g, "t.arr_str", &s, &err) == -1 && strstr(err.msg, "array"));
    CHECK(luma_gguf_get_arr(g, "t.arr_str", LUMA_GGUF_STRING, &a, &err) == 0 && a && a->n == 4);
    CHECK(luma_gguf_get_arr(g, "missing", LUMA_GGUF_STRING, &a, &err) == 0 && a == NULL);
    CHECK(luma_gguf_get_arr(g, "t.arr_i32", LUMA_GGUF_F32, &a, &err) == -1 &&
          strstr(err.msg, "array of i32"));
    CHECK(luma_gguf_get_arr(g, "t.u8", LUMA_GGUF_U8, &a, &err) == -1 && strstr(err.msg, "u8"));
    CHECK(strcmp(luma_gguf_type_name(LUMA_GGUF_F64), "f64") == 0);
    CHECK(strcmp(luma_gguf_type_name(LUMA_GGUF_TYPE_COUNT), "unknown") == 0);
    CHECK(luma_gguf_type_size(LUMA_GGUF_I16) == 2 && luma_gguf_type_size(LUMA_GGUF_F64) == 8);
    CHECK(luma_gguf_type_size(LUMA_GGUF_STRING) == 0 && luma_gguf_type_size(LUMA_GGUF_TYPE_COUNT) == 0);
}

/* Every kv and tensor copied into a new writer gives the same bytes. */
static void check_copy(const luma_gguf *g, const bytes *orig, const char *path)
{
    luma_err err;
    bytes again = {0};
    luma_gguf_writer *w = luma_gguf_writer_new();
    for (uint64_t i = 0; i < g->n_kv; i++) luma_gguf_copy_kv(w, &g->kv[i]);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        CHECK(luma_gguf_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, t->size, &err) == 0);
    }
    CHECK(luma_gguf_writer_save(w, path, &err) == 0);
    luma_gguf_writer_free(w);
    CHECK(read_file(path, &again) == 0);
    CHECK(again.len == orig->len && memcmp(again.p, orig->p, orig->len) == 0);
    free(again.p);
}

static int test_roundtrip(const char *path, bytes *file)
{
    luma_gguf *g = NULL;
    luma_err err;
    int before = failures;

    CHECK(sample_write(path, 0) == 0);
    CHECK(luma_gguf_open(path, &g, &err) == 0);
    if (!g) { fprintf(stderr, "test_gguf: open: %s\n", err.msg); return -1; }
    check_sample(g, 32);
    check_getters(g);
    CHECK(read_file(path, file) == 0);
    CHECK(file->len == g->size && memcmp(file->p, g->base, g->size) == 0);
    uint64_t h = walk(g);
    check_copy(g, file, path);
    luma_gguf_close(g);

    /* the same through a caller's buffer */
    uint8_t *keep;
    CHECK(open_copy(file->p, file->len, &g, &keep, &err) == 0);
    if (g) {
        check_sample(g, 32);
        CHECK(walk(g) == h);
    }
    luma_gguf_close(g);
    free(keep);

    /* a non-default alignment moves the data section and every offset */
    CHECK(sample_write(path, 64) == 0);
    CHECK(luma_gguf_open(path, &g, &err) == 0);
    if (g) check_sample(g, 64);
    luma_gguf_close(g);

    printf("test_gguf: round trip: %" PRIu64 " keys of every type (nested arrays, strings), "
           "%zu tensors (Q4_K, Q8_0, F16, F32), %zu bytes, alignment 32 and 64: %s\n",
           (uint64_t)(2 + 12 + 1 + 11 + 3), N_SAMPLE_TENSORS, file->len,
           failures == before ? "ok" : "FAILED");
    return 0;
}

/* ---- truncations and mutations ------------------------------------------------ */

static void test_truncations(const bytes *file)
{
    int before = failures;
    size_t refused = 0;
    for (size_t len = 0; len <= file->len; len++) {
        luma_gguf *g = NULL;
        uint8_t *keep;
        luma_err err = {{0}};
        int rc = open_copy(file->p, len, &g, &keep, &err);
        if (len == file->len) {
            CHECK(rc == 0 && g != NULL);
        } else {
            CHECK(rc == -1 && g == NULL && err.msg[0] != '\0');
            if (rc == 0) fprintf(stderr, "test_gguf: prefix of %zu bytes opened\n", len);
            refused += rc == -1;
        }
        luma_gguf_close(g);
        free(keep);
    }
    printf("test_gguf: truncations: %zu of %zu prefixes refused with a message: %s\n", refused,
           file->len, failures == before ? "ok" : "FAILED");
}

static void test_mutations(const bytes *file, size_t header_len, int count)
{
    static const uint8_t special[] = {0x00, 0xff, 0x7f, 0x80, 0x01, 0x20, 0x40};
    int before = failures, opened = 0, refused = 0;
    uint64_t seed = 0x9e3779b97f4a7c15ULL, sum = 0;
    uint8_t *buf = malloc(file->len);
    for (int k = 0; k < count; k++) {
        memcpy(buf, file->p, file->len);
        int n = 1 + (int)(rng_next(&seed) % 8);
        for (int j = 0; j < n; j++) {
            uint64_t r = rng_next(&seed);
            /* mostly in the header and metadata, where the parser's decisions are */
            size_t pos = (size_t)((r >> 8) % (r & 1 ? header_len : file->len));
            buf[pos] = r & 2 ? (uint8_t)(r >> 40) : special[(r >> 40) % sizeof special];
        }
        luma_gguf *g = NULL;
        uint8_t *keep;
        luma_err err = {{0}};
        if (open_copy(buf, file->len, &g, &keep, &err) == 0) {
            opened++;
            sum += walk(g);
        } else {
            refused++;
            CHECK(g == NULL && err.msg[0] != '\0');
        }
        luma_gguf_close(g);
        free(keep);
    }
    free(buf);
    printf("test_gguf: mutations: %d (1-8 bytes each): %d opened and walked, %d refused "
           "(checksum %016" PRIx64 "): %s\n", count, opened, refused, sum,
           failures == before ? "ok" : "FAILED");
}

/* ---- hand-made malformed files ---------------------------------------------- */

static int n_malformed;

static void expect_fail(const char *label, bytes *b, const char *word, const char *where)
{
    luma_gguf *g = NULL;
    uint8_t *keep;
    luma_err err = {{0}};
    int rc = open_copy(b->p, b->len, &g, &keep, &err);
    n_malformed++;
    if (rc == 0 || g != NULL || !strstr(err.msg, word) || (where && !strstr(err.msg, where))) {
        failures++;
        fprintf(stderr, "test_gguf: malformed '%s': rc %d, message \"%s\" (wanted \"%s\"%s%s)\n",
                label, rc, err.msg, word, where ? " and " : "", where ? where : "");
    }
    luma_gguf_close(g);
    free(keep);
    free(b->p);
    *b = (bytes){0};
}

static luma_gguf *expect_open(const char *label, bytes *b, uint8_t **keep)
{
    luma_gguf *g = NULL;
    luma_err err = {{0}};
    if (open_copy(b->p, b->len, &g, keep, &err) != 0) {
        failures++;
        fprintf(stderr, "test_gguf: '%s' should open: %s\n", label, err.msg);
    }
    return g;
}

/* One tensor file: header, kv general.alignment when align != 0, one tensor
 * info, padding, data. */
static void one_tensor(bytes *b, uint32_t align, const char *name, uint32_t n_dims,
                       const uint64_t *ne, uint32_t type, uint64_t offset, size_t data_bytes)
{
    b_header(b, 3, 1, align ? 1 : 0);
    if (align) b_kv_u32(b, "general.alignment", align);
    b_tensor(b, name, n_dims, ne, type, offset);
    b_pad(b, align && (align & (align - 1)) == 0 ? align : 32);
    b_zeros(b, data_bytes);
}

static void nest(bytes *b, int depth)
{
    b_u32(b, depth > 1 ? LUMA_GGUF_ARRAY : LUMA_GGUF_U8);
    b_u64(b, 1);
    if (depth > 1) nest(b, depth - 1);
    else b_put(b, "\x2a", 1);
}

static void test_malformed(void)
{
    int before = failures;
    bytes b = {0};
    uint8_t *keep;
    luma_gguf *g;
    const uint64_t ne1[1] = {32}, ne2[2] = {32, 2};

    b_put(&b, "GGUX", 4); b_u32(&b, 3); b_u64(&b, 0); b_u64(&b, 0);
    expect_fail("bad magic", &b, "magic", NULL);
    b_put(&b, "GG", 2);
    expect_fail("two bytes", &b, "magic", NULL);
    expect_fail("empty", &b, "magic", NULL);
    b_header(&b, 1, 0, 0);
    expect_fail("version 1", &b, "version 1", NULL);
    b_header(&b, 99, 0, 0);
    expect_fail("version 99", &b, "version 99", NULL);
    b_header(&b, 0x03000000u, 0, 0);
    expect_fail("big-endian", &b, "big-endian", NULL);
    b_header(&b, 3, 0, 1ULL << 60);
    expect_fail("huge n_kv", &b, "n_kv", NULL);
    b_header(&b, 3, UINT64_MAX, 0);
    expect_fail("huge n_tensors", &b, "n_tensors", NULL);
    b_header(&b, 3, 1, 1); b_zeros(&b, 40);
    expect_fail("n_kv and n_tensors together", &b, "n_kv", NULL);

    b_header(&b, 3, 0, 1); b_u64(&b, 1ULL << 62); b_zeros(&b, 16);
    expect_fail("huge key length", &b, "length", "key 0");
    b_header(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, LUMA_GGUF_STRING); b_u64(&b, UINT64_MAX);
    b_zeros(&b, 8);
    expect_fail("huge string length", &b, "string length", "'k'");
    b_header(&b, 3, 0, 1); b_str(&b, "k.arr"); b_u32(&b, LUMA_GGUF_ARRAY);
    b_u32(&b, LUMA_GGUF_U64); b_u64(&b, 1ULL << 61); b_zeros(&b, 64);
    expect_fail("array count x size overflows", &b, "array", "'k.arr'");
    b_header(&b, 3, 0, 1); b_str(&b, "k.arr"); b_u32(&b, LUMA_GGUF_ARRAY);
    b_u32(&b, LUMA_GGUF_STRING); b_u64(&b, 1000); b_zeros(&b, 64);
    expect_fail("array of strings past end", &b, "array", "'k.arr'");
    b_header(&b, 3, 0, 1); b_str(&b, "k.arr"); b_u32(&b, LUMA_GGUF_ARRAY);
    b_u32(&b, LUMA_GGUF_ARRAY); b_u64(&b, UINT64_MAX / 4); b_zeros(&b, 64);
    expect_fail("array of arrays past end", &b, "array", "'k.arr'");
    b_header(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, 13); b_u32(&b, 0);
    expect_fail("unknown value type", &b, "value type 13", "'k'");
    b_header(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, LUMA_GGUF_ARRAY); b_u32(&b, 77); b_u64(&b, 0);
    expect_fail("unknown element type", &b, "element type 77", "'k'");
    b_header(&b, 3, 0, 1); b_str(&b, "deep"); b_u32(&b, LUMA_GGUF_ARRAY);
    nest(&b, LUMA_GGUF_MAX_NESTING + 1);
    expect_fail("arrays nested 9 deep", &b, "nested deeper", "'deep'");
    b_header(&b, 3, 0, 2); b_kv_u32(&b, "a", 1); b_kv_u32(&b, "a", 2);
    expect_fail("duplicate key", &b, "duplicate key", "'a'");

    b_header(&b, 3, 0, 1); b_kv_u32(&b, "general.alignment", 0);
    expect_fail("alignment 0", &b, "alignment 0", NULL);
    b_header(&b, 3, 0, 1); b_kv_u32(&b, "general.alignment", 3);
    expect_fail("alignment 3", &b, "alignment 3", NULL);
    b_header(&b, 3, 0, 1); b_str(&b, "general.alignment"); b_u32(&b, LUMA_GGUF_U64); b_u64(&b, 32);
    expect_fail("alignment as u64", &b, "must be a u32", NULL);

    one_tensor(&b, 0, "w", 1, ne1, LUMA_F32, 32, 128);
    expect_fail("tensor offset past end", &b, "past the end", "'w'");
    one_tensor(&b, 0, "w", 1, ne1, LUMA_F32, 0, 127);
    expect_fail("tensor size past end", &b, "past the end", "'w'");
    one_tensor(&b, 0, "w", 1, ne1, LUMA_F32, 4, 256);
    expect_fail("misaligned offset", &b, "not aligned", "'w'");
    one_tensor(&b, 64, "w", 1, ne1, LUMA_F32, 32, 256);
    expect_fail("offset aligned to 32, not 64", &b, "not aligned to 64", "'w'");
    one_tensor(&b, 0, "w", 2, (const uint64_t[]){32, 0}, LUMA_F32, 0, 256);
    expect_fail("zero dimension", &b, "dimension 1", "'w'");
    one_tensor(&b, 0, "w", 2, (const uint64_t[]){32, 1ULL << 63}, LUMA_F32, 0, 256);
    expect_fail("dimension past int64", &b, "dimension 1", "'w'");
    one_tensor(&b, 0, "w", 4, (const uint64_t[]){1ULL << 20, 1ULL << 20, 1ULL << 20, 1ULL << 20},
               LUMA_F32, 0, 256);
    expect_fail("dimension product overflow", &b, "overflow", "'w'");
    one_tensor(&b, 0, "w", 2, (const uint64_t[]){1ULL << 40, 1ULL << 22}, LUMA_F32, 0, 256);
    expect_fail("byte size overflow", &b, "overflow", "'w'");
    one_tensor(&b, 0, "w", 1, ne1, 99, 0, 256);
    expect_fail("unknown tensor type 99", &b, "unknown tensor type 99", "'w'");
    one_tensor(&b, 0, "w", 1, ne1, 4, 0, 256);
    expect_fail("removed tensor type 4", &b, "unknown tensor type 4", "'w'");
    one_tensor(&b, 0, "w", 0, ne1, LUMA_F32, 0, 256);
    expect_fail("n_dims 0", &b, "n_dims 0", "'w'");
    one_tensor(&b, 0, "w", 5, (const uint64_t[]){32, 1, 1, 1, 1}, LUMA_F32, 0, 256);
    expect_fail("n_dims 5", &b, "n_dims 5", "'w'");
    one_tensor(&b, 0, "w", 1, (const uint64_t[]){100}, LUMA_Q4_K, 0, 256);
    expect_fail("row not a multiple of the block", &b, "block size", "'w'");
    b_header(&b, 3, 1, 0); b_tensor(&b, "w", 1, ne1, LUMA_F32, 0);
    expect_fail("no data section", &b, "data section", NULL);
    b_header(&b, 3, 2, 0); b_tensor(&b, "w", 1, ne1, LUMA_F32, 0);
    b_tensor(&b, "w", 1, ne1, LUMA_F32, 128); b_pad(&b, 32); b_zeros(&b, 256);
    expect_fail("duplicate tensor name", &b, "duplicate tensor", "'w'");
    b_header(&b, 3, 1, 0); b_tensor(&b, "bad\x01name", 1, ne1, 99, 0); b_pad(&b, 32);
    expect_fail("unprintable name shown safely", &b, "'bad?name'", NULL);

    /* valid corner cases */
    b_header(&b, 2, 1, 1); b_kv_u32(&b, "general.alignment", 64);
    b_tensor(&b, "w", 2, ne2, LUMA_F32, 0); b_pad(&b, 64); b_zeros(&b, 256);
    g = expect_open("version 2, alignment 64", &b, &keep);
    if (g) {
        CHECK(g->version == 2 && g->alignment == 64 && g->data_offset % 64 == 0);
        CHECK(g->tensors[0].size == 256 && g->tensors[0].ne[1] == 2 && g->tensors[0].ne[3] == 1);
    }
    luma_gguf_close(g); free(keep); free(b.p); b = (bytes){0};
    b_header(&b, 3, 0, 2); b_kv_u32(&b, "v", 7); b_str(&b, "deep"); b_u32(&b, LUMA_GGUF_ARRAY);
    nest(&b, LUMA_GGUF_MAX_NESTING);
    g = expect_open("vocabulary-only, arrays nested 8 deep, unpadded", &b, &keep);
    if (g) {
        CHECK(g->n_tensors == 0 && g->tensors == NULL && g->data_offset >= b.len);
        walk(g);
    }
    luma_gguf_close(g); free(keep); free(b.p); b = (bytes){0};
    b_header(&b, 3, 0, 1); b_str(&b, "b"); b_u32(&b, LUMA_GGUF_BOOL); b_put(&b, "\x05", 1);
    g = expect_open("bool byte 5", &b, &keep);
    if (g) CHECK(g->kv[0].value.v.u64 == 1);
    luma_gguf_close(g); free(keep); free(b.p); b = (bytes){0};

    CHECK(luma_gguf_open_memory(NULL, 0, &g, NULL) == -1 && g == NULL);
    printf("test_gguf: malformed files: %d refused with a message naming the problem, "
           "3 corner cases open: %s\n", n_malformed, failures == before ? "ok" : "FAILED");
}

/* ---- the writer's refusals, luma_gguf_open's file errors -------------------------- */

static void expect_save_fail(luma_gguf_writer *w, const char *path, const char *word)
{
    luma_err err = {{0}};
    int rc = luma_gguf_writer_save(w, path, &err);
    if (rc == 0 || !strstr(err.msg, word)) {
        failures++;
        fprintf(stderr, "test_gguf: save should fail with \"%s\": rc %d, \"%s\"\n", word, rc, err.msg);
    }
    luma_gguf_writer_free(w);
}

static void test_writer_errors(const char *path)
{
    int before = failures;
    luma_err err;
    luma_gguf_writer *w = luma_gguf_writer_new();
    uint8_t data[600] = {0};
    const int64_t ne[2] = {256, 2};
    CHECK(luma_gguf_add_tensor(w, "a", LUMA_Q4_K, 2, ne, data, 287, &err) == -1 &&
          strstr(err.msg, "needs 288"));
    CHECK(luma_gguf_add_tensor(w, "a", LUMA_Q4_K, 2, ne, data, 288, &err) == 0);
    CHECK(luma_gguf_add_tensor(w, "a", LUMA_Q4_K, 2, ne, data, 288, &err) == -1 &&
          strstr(err.msg, "duplicate"));
    CHECK(luma_gguf_add_tensor(w, "b", 99, 2, ne, data, 288, &err) == -1 &&
          strstr(err.msg, "unknown type"));
    CHECK(luma_gguf_add_tensor(w, "b", LUMA_Q4_K, 1, (const int64_t[]){100}, data, 288, &err) == -1
          && strstr(err.msg, "block size"));
    CHECK(luma_gguf_add_tensor(w, "b", LUMA_F32, 5, ne, data, 288, &err) == -1 &&
          strstr(err.msg, "n_dims"));
    CHECK(luma_gguf_add_tensor(w, "b", LUMA_F32, 1, (const int64_t[]){0}, data, 0, &err) == -1 &&
          strstr(err.msg, "dimension"));
    CHECK(luma_gguf_add_tensor(w, "", LUMA_F32, 1, ne, data, 1024, &err) == -1 &&
          strstr(err.msg, "name"));
    CHECK(luma_gguf_add_tensor(w, "0123456789012345678901234567890123456789012345678901234567890123",
                               LUMA_F32, 1, (const int64_t[]){1}, data, 4, &err) == -1 &&
          strstr(err.msg, "name"));
    luma_gguf_set_arr(w, "s", LUMA_GGUF_STRING, data, 1);
    luma_gguf_set_u32(w, "after", 1);
    expect_save_fail(w, path, "scalar");

    w = luma_gguf_writer_new();
    luma_gguf_set_u32(w, "general.alignment", 3);
    expect_save_fail(w, path, "alignment");
    w = luma_gguf_writer_new();
    luma_gguf_set_f32(w, "general.alignment", 32);
    expect_save_fail(w, path, "u32");

    luma_gguf_value levels[LUMA_GGUF_MAX_NESTING + 1];
    for (int i = 0; i <= LUMA_GGUF_MAX_NESTING; i++)
        levels[i] = (luma_gguf_value){.type = LUMA_GGUF_ARRAY, .elem_type = LUMA_GGUF_ARRAY,
                                      .n = 1, .items = &levels[i + 1]};
    levels[LUMA_GGUF_MAX_NESTING] = (luma_gguf_value){.type = LUMA_GGUF_ARRAY,
                                                      .elem_type = LUMA_GGUF_U8, .n = 1, .data = data};
    w = luma_gguf_writer_new();
    luma_gguf_set_value(w, "deep", &levels[0]);
    expect_save_fail(w, path, "nested");
    w = luma_gguf_writer_new();
    luma_gguf_set_value(w, "t", &(luma_gguf_value){.type = 42});
    expect_save_fail(w, path, "type");
    w = luma_gguf_writer_new();
    expect_save_fail(w, "/nonexistent-dir/x.gguf", "nonexistent-dir");

    /* nested 8 deep is the limit, and it reads back */
    luma_gguf *g = NULL;
    w = luma_gguf_writer_new();
    luma_gguf_set_value(w, "deep", &levels[1]);
    CHECK(luma_gguf_writer_save(w, path, &err) == 0);
    luma_gguf_writer_free(w);
    CHECK(luma_gguf_open(path, &g, &err) == 0 && g->n_kv == 1 && g->n_tensors == 0);
    luma_gguf_close(g);

    luma_gguf_writer_free(NULL);
    luma_gguf_close(NULL);
    luma_gguf_set_u32(NULL, "x", 1);
    CHECK(luma_gguf_writer_save(NULL, path, &err) == -1);
    CHECK(luma_gguf_open("/nonexistent-dir/x.gguf", &g, &err) == -1 && g == NULL &&
          strstr(err.msg, "/nonexistent-dir/x.gguf"));
    CHECK(luma_gguf_open("/", &g, &err) == -1 && strstr(err.msg, "regular"));
    FILE *fp = fopen(path, "wb");
    if (fp) fclose(fp);
    CHECK(luma_gguf_open(path, &g, &err) == -1 && strstr(err.msg, "empty"));
    printf("test_gguf: writer and file errors: refused with messages: %s\n",
           failures == before ? "ok" : "FAILED");
}

/* ---- real files ---------------------------------------------------------------- */

static void test_model(void)
{
    char path[4096];
    if (!luma_test_model_path(path, sizeof path)) {
        printf("test_gguf: default model not found, real-file check did not run\n");
        return;
    }
    int before = failures;
    luma_gguf *g = NULL;
    luma_err err;
    luma_str arch;
    const luma_gguf_value *tokens = NULL;
    if (luma_gguf_open(path, &g, &err) != 0) {
        failures++;
        fprintf(stderr, "test_gguf: %s\n", err.msg);
        return;
    }
    CHECK(g->n_tensors == 236);
    CHECK(luma_gguf_get_str(g, "general.architecture", &arch, &err) == 0 &&
          luma_str_eq(arch, "gemma3"));
    CHECK(luma_gguf_get_arr(g, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, &err) == 0 &&
          tokens && tokens->n == 262144);
    CHECK(luma_gguf_find_tensor(g, "token_embd.weight") != NULL);
    uint64_t data_bytes = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        const uint8_t *p = t->data;
        char name[80];
        CHECK(p >= g->base + g->data_offset && t->size <= (uint64_t)(g->base + g->size - p));
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        CHECK(luma_gguf_find_tensor(g, name) == t);
        data_bytes += t->size;
    }
    printf("test_gguf: default model: %" PRIu64 " tensors (%" PRIu64 " bytes) inside the file, "
           "arch gemma3, %" PRIu64 " tokens: %s\n", g->n_tensors, data_bytes,
           tokens ? tokens->n : 0, failures == before ? "ok" : "FAILED");
    luma_gguf_close(g);
}

static void test_vocab_files(void)
{
    const char *dir = LUMA_SOURCE_DIR "/../shared/testdata/tokenizer";
    DIR *d = opendir(dir);
    if (!d) {
        printf("test_gguf: %s not found, the vocabulary-file suite did not run\n", dir);
        return;
    }
    int before = failures, n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 5, ".gguf") != 0) continue;
        char path[4096];
        luma_gguf *g = NULL;
        luma_err err;
        luma_str model;
        const luma_gguf_value *tokens = NULL;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (luma_gguf_open(path, &g, &err) != 0) {
            failures++;
            fprintf(stderr, "test_gguf: %s\n", err.msg);
            continue;
        }
        CHECK(g->n_tensors == 0);
        CHECK(luma_gguf_get_str(g, "tokenizer.ggml.model", &model, &err) == 0 && model.len > 0);
        CHECK(luma_gguf_get_arr(g, "tokenizer.ggml.tokens", LUMA_GGUF_STRING, &tokens, &err) == 0 &&
              tokens && tokens->n > 0);
        walk(g);
        luma_gguf_close(g);
        n++;
    }
    closedir(d);
    CHECK(n > 0);
    printf("test_gguf: vocabulary files: %d opened and walked: %s\n", n,
           failures == before ? "ok" : "FAILED");
}

/* ---- the fuzzer's seed corpus ------------------------------------------------------ */

static int save_bytes(const char *dir, const char *name, const bytes *b)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(b->p, 1, b->len, fp) != b->len) {
        if (fp) fclose(fp);
        fprintf(stderr, "test_gguf: cannot write %s\n", path);
        return -1;
    }
    fclose(fp);
    printf("%s (%zu bytes)\n", path, b->len);
    return 0;
}

static int write_corpus(const char *dir)
{
    char path[4096];
    bytes b = {0};
    int rc = 0;

    snprintf(path, sizeof path, "%s/all_types.gguf", dir);
    rc |= sample_write(path, 0);
    printf("%s\n", path);
    snprintf(path, sizeof path, "%s/align64.gguf", dir);
    rc |= sample_write(path, 64);
    printf("%s\n", path);

    b_header(&b, 2, 1, 1); b_kv_u32(&b, "general.alignment", 64);
    b_tensor(&b, "w", 2, (const uint64_t[]){32, 2}, LUMA_Q8_0, 0); b_pad(&b, 64); b_zeros(&b, 68);
    rc |= save_bytes(dir, "v2_q8_0.gguf", &b);
    free(b.p); b = (bytes){0};

    b_header(&b, 3, 0, 3); b_str(&b, "tokenizer.ggml.model"); b_u32(&b, LUMA_GGUF_STRING);
    b_str(&b, "llama");
    b_str(&b, "tokenizer.ggml.tokens"); b_u32(&b, LUMA_GGUF_ARRAY); b_u32(&b, LUMA_GGUF_STRING);
    b_u64(&b, 3); b_str(&b, "<s>"); b_str(&b, "\xe2\x96\x81the"); b_str(&b, "");
    b_str(&b, "deep"); b_u32(&b, LUMA_GGUF_ARRAY); nest(&b, LUMA_GGUF_MAX_NESTING);
    rc |= save_bytes(dir, "vocab_nested.gguf", &b);
    free(b.p);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0) return write_corpus(argv[2]);

    const char *tmp = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/luma_test_gguf_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) {
        fprintf(stderr, "test_gguf: cannot create a temporary file\n");
        return 1;
    }
    close(fd);

    bytes file = {0};
    if (test_roundtrip(path, &file) == 0) {
        luma_gguf *g = NULL;
        luma_err err;
        size_t header_len = file.len;
        if (luma_gguf_open_memory(file.p, file.len, &g, &err) == 0)
            header_len = (size_t)g->data_offset;
        luma_gguf_close(g);
        test_truncations(&file);
        test_mutations(&file, header_len, 5000);
    }
    free(file.p);
    test_malformed();
    test_writer_errors(path);
    test_model();
    test_vocab_files();
    remove(path);

    if (failures) {
        printf("test_gguf: %d checks FAILED\n", failures);
        return 1;
    }
    printf("test_gguf: all checks passed\n");
    return 0;
}
