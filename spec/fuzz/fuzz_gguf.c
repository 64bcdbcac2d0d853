/* libFuzzer target for the GGUF reader: any input either is refused with a
 * message or opens into structures whose every string, array and tensor lies
 * inside the input. On success it reads all of them (nested arrays too), runs
 * the typed getters on every key, finds every tensor by name, and re-encodes
 * every value with the writer. A broken invariant traps; an over-read is
 * caught by AddressSanitizer. See README.md for how to build and run it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf.h"

static volatile uint64_t sink;

static void require(int ok)
{
    if (!ok) __builtin_trap();
}

static uint64_t touch(const luma_gguf *g, const void *p, uint64_t n, uint64_t h)
{
    const uint8_t *b = p;
    if (n == 0) return h;
    require(b >= g->base && b <= g->base + g->size && n <= (uint64_t)(g->base + g->size - b));
    for (uint64_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static uint64_t touch_value(const luma_gguf *g, const luma_gguf_value *v, uint64_t h, int depth)
{
    require(depth <= LUMA_GGUF_MAX_NESTING && (unsigned)v->type < LUMA_GGUF_TYPE_COUNT);
    if (v->type == LUMA_GGUF_STRING) return touch(g, v->v.str.ptr, v->v.str.len, h);
    if (v->type != LUMA_GGUF_ARRAY) return h ^ v->v.u64;
    require((unsigned)v->elem_type < LUMA_GGUF_TYPE_COUNT);
    if (v->elem_type == LUMA_GGUF_STRING) {
        for (uint64_t i = 0; i < v->n; i++) h = touch(g, v->strs[i].ptr, v->strs[i].len, h);
    } else if (v->elem_type == LUMA_GGUF_ARRAY) {
        for (uint64_t i = 0; i < v->n; i++) {
            require(v->items[i].type == LUMA_GGUF_ARRAY);
            h = touch_value(g, &v->items[i], h, depth + 1);
        }
    } else {
        h = touch(g, v->data, v->n * luma_gguf_type_size(v->elem_type), h);
    }
    return h;
}

/* The getters take NUL-terminated names: a name with a NUL byte inside is
 * not reachable by them and is skipped. */
static int cstr(luma_str s, char *buf, size_t cap)
{
    if (s.len >= cap || memchr(s.ptr, 0, (size_t)s.len)) return 0;
    memcpy(buf, s.ptr, (size_t)s.len);
    buf[s.len] = '\0';
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    luma_gguf *g = NULL;
    luma_err err = {{0}};
    if (luma_gguf_open_memory(data, size, &g, &err) != 0) {
        require(g == NULL && err.msg[0] != '\0');
        return 0;
    }
    uint64_t h = 0xcbf29ce484222325ULL;
    char name[256];
    luma_gguf_writer *w = luma_gguf_writer_new();
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const luma_gguf_kv *kv = &g->kv[i];
        h = touch_value(g, &kv->value, touch(g, kv->key.ptr, kv->key.len, h), 1);
        luma_gguf_copy_kv(w, kv);
        if (cstr(kv->key, name, sizeof name)) {
            uint32_t u; float f; bool b; luma_str s; const luma_gguf_value *a;
            require(luma_gguf_find(g, name) == kv);
            luma_gguf_get_u32(g, name, 0, &u, &err);
            luma_gguf_get_f32(g, name, 0, &f, &err);
            luma_gguf_get_bool(g, name, false, &b, &err);
            luma_gguf_get_str(g, name, &s, &err);
            luma_gguf_get_arr(g, name, kv->value.elem_type, &a, &err);
        }
    }
    luma_gguf_writer_free(w);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const luma_gguf_tensor *t = &g->tensors[i];
        require(t->data != NULL && (const uint8_t *)t->data >= g->base + g->data_offset);
        require(t->offset % g->alignment == 0);
        h = touch(g, t->data, t->size, touch(g, t->name.ptr, t->name.len, h));
        if (cstr(t->name, name, sizeof name)) require(luma_gguf_find_tensor(g, name) == t);
    }
    sink = h;
    luma_gguf_close(g);
    return 0;
}
