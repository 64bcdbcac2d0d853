/* Model userdata: luma.load, tokenization, model.info, sequences. */
#include <stdlib.h>
#include <string.h>

#include "bind/bind.h"

lmodel *luma_bind_checkmodel(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_MODEL_MT);
}

luma_model *luma_bind_model(lua_State *L, int i)
{
    lmodel *lm = luma_bind_checkmodel(L, i);
    if (!lm->m) luaL_error(L, "model is closed");
    return lm->m;
}

void luma_bind_idle(lua_State *L, const luma_model *m)
{
    if (m->busy) luaL_error(L, "model is busy: its step is in flight (batch:run's during and seq:greedy's on_token "
                               "may not use the model's sequences, batches or logits)");
}

typedef struct progress_ctx {
    lua_State *L;
    int fn;          /* stack index of the callback */
    bool failed;     /* the callback raised; its error is on the stack */
} progress_ctx;

static int call_progress(void *p, float frac)
{
    progress_ctx *pc = p;
    lua_State *L = pc->L;
    lua_pushvalue(L, pc->fn);
    lua_pushnumber(L, frac);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
        pc->failed = true;
        return 1;
    }
    /* Returning false cancels the load. */
    int cancel = lua_isboolean(L, -1) && !lua_toboolean(L, -1);
    lua_pop(L, 1);
    return cancel;
}

/* luma.load(path [, opts]) */
int luma_bind_load(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    luma_model_params p;
    luma_model_params_default(&p);
    p.backend = luma_bind_optstr(L, 2, "backend", "auto");
    lua_Integer threads = luma_bind_optint(L, 2, "threads", 0);
    lua_Integer ctx = luma_bind_optint(L, 2, "ctx", 0);
    lua_Integer kv_mb = luma_bind_optint(L, 2, "kv_mb", 0);
    lua_Integer max_rows = luma_bind_optint(L, 2, "max_rows", 0);
    lua_Integer rewind = luma_bind_optint(L, 2, "rewind", LUMA_DEFAULT_REWIND);
    if (threads < 0 || threads > 256) luaL_error(L, "option 'threads' must be in [0, 256]");
    if (ctx < 0 || ctx > (1 << 24)) luaL_error(L, "option 'ctx' must be in [0, 16777216]");
    if (kv_mb < 0 || kv_mb > (1 << 24)) luaL_error(L, "option 'kv_mb' must be in [0, 16777216]");
    if (max_rows < 0 || max_rows > 65536) luaL_error(L, "option 'max_rows' must be in [0, 65536]");
    if (rewind < 0 || rewind > 65536) luaL_error(L, "option 'rewind' must be in [0, 65536]");
    p.n_threads = (int)threads;
    p.n_ctx = (int32_t)ctx;
    p.kv_bytes = (int64_t)kv_mb << 20;
    p.max_rows = (int32_t)max_rows;
    p.rewind = (int32_t)rewind;
    p.kv_f32 = strcmp(luma_bind_optstr(L, 2, "kv_type", "f16"), "f32") == 0;
    p.vocab_only = luma_bind_optbool(L, 2, "vocab_only", false);
    p.batch_invariant = luma_bind_optbool(L, 2, "batch_invariant", false);
    p.float_act = luma_bind_optbool(L, 2, "float_act", false);
    progress_ctx pc = { L, 0, false };
    if (!lua_isnoneornil(L, 2)) {
        lua_getfield(L, 2, "progress");
        if (!lua_isnil(L, -1)) {
            if (!lua_isfunction(L, -1)) return luaL_error(L, "option 'progress' must be a function");
            pc.fn = lua_gettop(L);
            p.progress = call_progress;
            p.progress_ctx = &pc;
        }
    }
    lmodel *lm = lua_newuserdatauv(L, sizeof *lm, 0);
    lm->m = NULL;
    lm->seqs = NULL;
    luaL_setmetatable(L, LUMA_MODEL_MT);
    luma_err err;
    if (luma_model_load(path, &p, &lm->m, &err)) {
        /* The callback's own error, as it raised it, is on the stack top. */
        if (pc.failed) return lua_error(L);
        return luma_bind_error(L, &err);
    }
    return 1;
}

static void model_release(lmodel *lm)
{
    while (lm->seqs) {
        lseq *q = lm->seqs;
        luma_bind_seq_release(q);
        /* Tells a later use of q why it is closed. */
        q->owner = NULL;
    }
    luma_model_free(lm->m);
    lm->m = NULL;
}

static int model_close(lua_State *L)
{
    lmodel *lm = luma_bind_checkmodel(L, 1);
    if (lm->m) luma_bind_idle(L, lm->m);
    model_release(lm);
    return 0;
}

/* The collector's close: a model whose step is in flight is referenced by
 * the running batch, so this never meets one. */
static int model_gc(lua_State *L)
{
    model_release(luma_bind_checkmodel(L, 1));
    return 0;
}

static int model_tostring(lua_State *L)
{
    lmodel *lm = luma_bind_checkmodel(L, 1);
    if (!lm->m) lua_pushliteral(L, "luma.Model (closed)");
    else lua_pushfstring(L, "luma.Model (%s, %d tokens)", lm->m->hp.arch, lm->m->hp.n_vocab);
    return 1;
}

/* model:tokenize(text [, {bos = bool, special = bool}]) */
static int model_tokenize(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    bool bos = luma_bind_optbool(L, 3, "bos", true);
    bool special = luma_bind_optbool(L, 3, "special", false);
    luma_err err;
    int32_t small[256];
    int64_t n = luma_tokenize(m->vocab, text, len, bos, special, small, 256, &err);
    if (n < 0) return luma_bind_error(L, &err);
    int32_t *ids = small;
    if (n > 256) {
        ids = lua_newuserdatauv(L, (size_t)n * sizeof(int32_t), 0);
        if (luma_tokenize(m->vocab, text, len, bos, special, ids, n, &err) < 0)
            return luma_bind_error(L, &err);
    }
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* model:detokenize(ids [, {special = bool}]) */
static int model_detokenize(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    bool special = luma_bind_optbool(L, 3, "special", false);
    int32_t n;
    int32_t *ids = luma_bind_checkids(L, 2, m->hp.n_vocab, &n);
    luma_err err;
    luaL_Buffer b;
    char *buf = luaL_buffinitsize(L, &b, 256);
    int64_t len = luma_detokenize(m->vocab, ids, n, special, buf, 256, &err);
    if (len < 0) return luma_bind_error(L, &err);
    if (len > 256) {
        buf = luaL_prepbuffsize(&b, (size_t)len);
        if (luma_detokenize(m->vocab, ids, n, special, buf, (size_t)len, &err) < 0)
            return luma_bind_error(L, &err);
    }
    luaL_pushresultsize(&b, (size_t)len);
    return 1;
}

static int32_t check_id(lua_State *L, int i, const luma_model *m)
{
    lua_Integer id = luaL_checkinteger(L, i);
    if (id < 0 || id >= m->hp.n_vocab)
        luaL_argerror(L, i, lua_pushfstring(L, "token id %I out of range [0, %d)", id, (int)m->hp.n_vocab));
    return (int32_t)id;
}

/* model:piece(id [, special]) -> the bytes of one token */
static int model_piece(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    int32_t id = check_id(L, 2, m);
    bool special = lua_toboolean(L, 3);
    char small[128];
    size_t n = luma_token_piece(m->vocab, id, special, small, sizeof small);
    if (n <= sizeof small) {
        lua_pushlstring(L, small, n);
        return 1;
    }
    luaL_Buffer b;
    char *buf = luaL_buffinitsize(L, &b, n);
    luma_token_piece(m->vocab, id, special, buf, n);
    luaL_pushresultsize(&b, n);
    return 1;
}

static int model_is_eog(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    lua_pushboolean(L, luma_vocab_is_eog(m->vocab, check_id(L, 2, m)));
    return 1;
}

/* model:token_type(id) -> "normal", "control", "byte", ... */
static int model_token_type(lua_State *L)
{
    static const char *const names[] = { "undefined", "normal", "unknown", "control",
                                         "user_defined", "unused", "byte" };
    luma_model *m = luma_bind_model(L, 1);
    unsigned t = (unsigned)luma_vocab_type(m->vocab, check_id(L, 2, m));
    lua_pushstring(L, t < sizeof names / sizeof names[0] ? names[t] : "undefined");
    return 1;
}

static void set_int(lua_State *L, const char *k, lua_Integer v)
{
    lua_pushinteger(L, v);
    lua_setfield(L, -2, k);
}

static void push_info(lua_State *L, const luma_model *m)
{
    const luma_hparams *hp = &m->hp;
    lua_newtable(L);
    lua_pushstring(L, hp->arch);
    lua_setfield(L, -2, "arch");
    set_int(L, "vocab", hp->n_vocab);
    luma_str name = { 0 };
    luma_err err;
    if (luma_gguf_get_str(m->file, "general.name", &name, &err) == 0 && name.ptr) {
        lua_pushlstring(L, name.ptr, name.len);
        lua_setfield(L, -2, "name");
    }
    lua_pushstring(L, luma_vocab_kind(m->vocab) == LUMA_VOCAB_SPM ? "spm" : "bpe");
    lua_setfield(L, -2, "tokenizer");
    lua_pushstring(L, luma_vocab_pre(m->vocab));
    lua_setfield(L, -2, "pre");
    if (m->vocab_only) {
        lua_pushboolean(L, 1);
        lua_setfield(L, -2, "vocab_only");
        return;
    }
    set_int(L, "layers", hp->n_layer);
    set_int(L, "embd", hp->n_embd);
    set_int(L, "heads", hp->n_head);
    set_int(L, "kv_heads", hp->n_kv_head);
    set_int(L, "head_dim", hp->head_dim_k);
    set_int(L, "ff", hp->n_ff);
    set_int(L, "ctx_train", hp->n_ctx_train);
    set_int(L, "ctx", m->n_ctx);
    set_int(L, "max_rows", m->max_rows);
    set_int(L, "rewind", m->rewind);
    set_int(L, "sliding_window", hp->swa_window);
    set_int(L, "weight_bytes", m->weight_bytes);
    set_int(L, "file_bytes", (lua_Integer)m->file->size);
    uint32_t ftype = 0;
    if (luma_gguf_get_u32(m->file, "general.file_type", 0, &ftype, &err) == 0) set_int(L, "file_type", ftype);
    lua_pushstring(L, m->be->ops->name);
    lua_setfield(L, -2, "backend");
    lua_pushboolean(L, m->batch_invariant);
    lua_setfield(L, -2, "batch_invariant");
    lua_pushboolean(L, m->float_act);
    lua_setfield(L, -2, "float_act");
    const luma_kv_layout *l = &m->kv_layout;
    const int64_t token = (int64_t)luma_kv_token_bytes(l);
    int64_t kv_bytes = 0;
    for (int p = 0; p < l->n_pools; p++) kv_bytes += (int64_t)l->n_blocks[p] * l->n_layers[p] * l->block_tokens * token;
    set_int(L, "kv_bytes", kv_bytes);
    /* what a decode step reads of the cache per key: a position's K and V
     * in one layer (kv_token_bytes), in each of the layers; the sliding-
     * window layers (swa_layers of them) read at most sliding_window keys */
    set_int(L, "kv_token_bytes", token);
    set_int(L, "swa_layers", luma_swa_layers(hp));
}

static int model_index(lua_State *L)
{
    static const char *const fields[] = { "eos", "bos", "eot", "n_vocab", "info", NULL };
    luma_bind_checkmodel(L, 1);
    const char *k = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : NULL;
    int f = 0;
    while (k && fields[f] && strcmp(k, fields[f]) != 0) f++;
    if (k && fields[f]) {
        luma_model *m = luma_bind_model(L, 1);
        const luma_vocab_special *sp = luma_vocab_specials(m->vocab);
        const int32_t v[] = { sp->eos, sp->bos, sp->eot, m->hp.n_vocab };
        if (f == 4) push_info(L, m);
        else if (v[f] < 0) lua_pushnil(L);
        else lua_pushinteger(L, v[f]);
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_gettable(L, lua_upvalueindex(1));
    return 1;
}

/* model:meta(key) -> a metadata value (strings, numbers, booleans, arrays
 * as Lua arrays), or nil */
static void push_value(lua_State *L, const luma_gguf_value *v, int depth);

static void push_scalar(lua_State *L, enum luma_gguf_type t, const uint8_t *p)
{
    switch (t) {
    case LUMA_GGUF_U8: lua_pushinteger(L, *p); break;
    case LUMA_GGUF_I8: lua_pushinteger(L, *(const int8_t *)p); break;
    case LUMA_GGUF_U16: { uint16_t x; memcpy(&x, p, 2); lua_pushinteger(L, x); break; }
    case LUMA_GGUF_I16: { int16_t x; memcpy(&x, p, 2); lua_pushinteger(L, x); break; }
    case LUMA_GGUF_U32: { uint32_t x; memcpy(&x, p, 4); lua_pushinteger(L, x); break; }
    case LUMA_GGUF_I32: { int32_t x; memcpy(&x, p, 4); lua_pushinteger(L, x); break; }
    case LUMA_GGUF_F32: { float x; memcpy(&x, p, 4); lua_pushnumber(L, x); break; }
    case LUMA_GGUF_BOOL: lua_pushboolean(L, *p != 0); break;
    case LUMA_GGUF_U64: { uint64_t x; memcpy(&x, p, 8); lua_pushinteger(L, (lua_Integer)x); break; }
    case LUMA_GGUF_I64: { int64_t x; memcpy(&x, p, 8); lua_pushinteger(L, x); break; }
    case LUMA_GGUF_F64: { double x; memcpy(&x, p, 8); lua_pushnumber(L, x); break; }
    default: lua_pushnil(L); break;
    }
}

static size_t scalar_size(enum luma_gguf_type t)
{
    switch (t) {
    case LUMA_GGUF_U8: case LUMA_GGUF_I8: case LUMA_GGUF_BOOL: return 1;
    case LUMA_GGUF_U16: case LUMA_GGUF_I16: return 2;
    case LUMA_GGUF_U32: case LUMA_GGUF_I32: case LUMA_GGUF_F32: return 4;
    default: return 8;
    }
}

static void push_value(lua_State *L, const luma_gguf_value *v, int depth)
{
    luaL_checkstack(L, 4, "metadata nesting");
    switch (v->type) {
    case LUMA_GGUF_STRING: lua_pushlstring(L, v->v.str.ptr, v->v.str.len); return;
    case LUMA_GGUF_BOOL: lua_pushboolean(L, v->v.u64 != 0); return;
    case LUMA_GGUF_F32: case LUMA_GGUF_F64: lua_pushnumber(L, v->v.f64); return;
    case LUMA_GGUF_I8: case LUMA_GGUF_I16: case LUMA_GGUF_I32: case LUMA_GGUF_I64:
        lua_pushinteger(L, v->v.i64); return;
    case LUMA_GGUF_ARRAY: break;
    default: lua_pushinteger(L, (lua_Integer)v->v.u64); return;
    }
    lua_createtable(L, v->n > 1 << 20 ? 1 << 20 : (int)v->n, 0);
    for (uint64_t i = 0; i < v->n; i++) {
        if (v->elem_type == LUMA_GGUF_STRING) lua_pushlstring(L, v->strs[i].ptr, v->strs[i].len);
        else if (v->elem_type == LUMA_GGUF_ARRAY) push_value(L, &v->items[i], depth + 1);
        else push_scalar(L, v->elem_type, (const uint8_t *)v->data + i * scalar_size(v->elem_type));
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
}

static int model_meta(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    const char *key = luaL_checkstring(L, 2);
    const luma_gguf_kv *kv = luma_gguf_find(m->file, key);
    if (!kv) return 0;
    push_value(L, &kv->value, 0);
    return 1;
}

/* model:meta_keys() -> array of keys; model:tensors() -> array of
 * {name, type, shape = {...}, bytes} */
static int model_meta_keys(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    lua_createtable(L, (int)m->file->n_kv, 0);
    for (uint64_t i = 0; i < m->file->n_kv; i++) {
        lua_pushlstring(L, m->file->kv[i].key.ptr, m->file->kv[i].key.len);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int model_tensors(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    lua_createtable(L, (int)m->file->n_tensors, 0);
    for (uint64_t i = 0; i < m->file->n_tensors; i++) {
        const luma_gguf_tensor *t = &m->file->tensors[i];
        lua_createtable(L, 0, 4);
        lua_pushlstring(L, t->name.ptr, t->name.len);
        lua_setfield(L, -2, "name");
        lua_pushstring(L, luma_type_name(t->type));
        lua_setfield(L, -2, "type");
        lua_createtable(L, (int)t->n_dims, 0);
        for (uint32_t d = 0; d < t->n_dims; d++) {
            lua_pushinteger(L, t->ne[d]);
            lua_rawseti(L, -2, d + 1);
        }
        lua_setfield(L, -2, "shape");
        set_int(L, "bytes", (lua_Integer)t->size);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

/* model:kv_free() -> {free blocks of pool 1 [, pool 2]}, tokens per block */
static int model_kv_free(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    if (m->vocab_only) return luaL_error(L, "model was loaded with vocab_only: it has no KV cache");
    const luma_kv_params *p = luma_kv_get_params(m->kv);
    lua_createtable(L, p->n_pools, 0);
    for (int i = 0; i < p->n_pools; i++) {
        lua_pushinteger(L, luma_kv_free_blocks(m->kv, i));
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushinteger(L, p->block_tokens);
    return 2;
}

/* model:copy_bandwidth([mib [, reps]]) -> GB/s (bytes read plus written,
 * 1e9 a GB) of the backend's device-to-device copy of mib MiB (default
 * 1024), the best of reps (default 5); nil for a backend whose memory is
 * the host's (the CPU). */
static int model_copy_bandwidth(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    const lua_Integer mib = luaL_optinteger(L, 2, 1024), reps = luaL_optinteger(L, 3, 5);
    luaL_argcheck(L, mib >= 1 && mib <= (1 << 20), 2, "MiB must be in [1, 1048576]");
    luaL_argcheck(L, reps >= 1 && reps <= 1000, 3, "copies must be in [1, 1000]");
    if (m->vocab_only) return luaL_error(L, "model was loaded with vocab_only: it has no backend");
    luma_bind_idle(L, m);
    if (!m->be->ops->copy_rate) {
        lua_pushnil(L);
        return 1;
    }
    double rate = 0.0;
    luma_err err;
    if (m->be->ops->copy_rate(m->be, (size_t)mib << 20, (int)reps, &rate, &err)) return luma_bind_error(L, &err);
    lua_pushnumber(L, rate / 1e9);
    return 1;
}

static const luaL_Reg meta[] = {
    { "__gc", model_gc },
    { "__close", model_close },
    { "__tostring", model_tostring },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "tokenize", model_tokenize },
    { "detokenize", model_detokenize },
    { "piece", model_piece },
    { "is_eog", model_is_eog },
    { "token_type", model_token_type },
    { "sequence", luma_bind_newseq },
    { "meta", model_meta },
    { "meta_keys", model_meta_keys },
    { "tensors", model_tensors },
    { "kv_free", model_kv_free },
    { "copy_bandwidth", model_copy_bandwidth },
    { "close", model_close },
    { NULL, NULL },
};

void luma_bind_open_model(lua_State *L)
{
    luma_bind_newclass(L, LUMA_MODEL_MT, meta, methods, model_index);
}
