/* Batch userdata: chunks from many sequences run as one forward.
 *   local b = model:batch()
 *   b:add(seq_a, {id}); b:add(seq_b, prompt_ids)
 *   local out = b:run()     -- out[seq_a], out[seq_b]: Logits
 *   local out = b:run(during)   -- during() runs while the device computes
 * A batch is emptied by run and can be filled again.
 *
 * during, when given, is called once the step is queued and before the host
 * waits for it, so that host work (a scheduler's text, callbacks) overlaps
 * the device's. Until it returns the model is busy: its sequences, batches
 * and device logits raise an error (luma_bind_idle), and the collector is
 * stopped (a finalizer could reach them). An error it raises is raised by
 * run once the step is over: the step's tokens are in their sequences, its
 * logits are not handed out. A run that fails before its step is queued
 * (a full KV cache, say) does not call it. The pending chunks are
 * a C array in the userdata (a decode step adds one token for each of
 * many sequences, so an add makes no Lua objects for a single id); the
 * user value keeps what they point to alive: [2i - 1] the sequence of chunk
 * i, [2i] the userdata holding a checked copy of its ids (false for one id,
 * kept in the chunk itself). */
#include <stdlib.h>

#include "bind/bind.h"

typedef struct pending {
    const int32_t *ids;     /* NULL: the one id is `one` */
    int32_t n, one;
    bool all;
} pending;

typedef struct lbatch {
    int n, cap;             /* chunks added since the last run, and room */
    pending *chunks;
} lbatch;

static lbatch *checkbatch(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_BATCH_MT);
}

static int batch_gc(lua_State *L)
{
    lbatch *b = checkbatch(L, 1);
    free(b->chunks);
    b->chunks = NULL;
    b->n = b->cap = 0;
    return 0;
}

static int model_batch(lua_State *L)
{
    luma_bind_model(L, 1);
    lbatch *b = lua_newuserdatauv(L, sizeof *b, 2);
    b->n = b->cap = 0;
    b->chunks = NULL;
    luaL_setmetatable(L, LUMA_BATCH_MT);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    lua_newtable(L);
    lua_setiuservalue(L, -2, 2);
    return 1;
}

/* batch:add(seq, ids | id [, {all = true}]) -> batch */
static int batch_add(lua_State *L)
{
    lbatch *b = checkbatch(L, 1);
    luma_seq *s = luma_bind_seq(L, 2);
    lua_getiuservalue(L, 1, 1);
    luma_model *m = luma_bind_model(L, -1);
    lua_pop(L, 1);
    if (s->model != m) return luaL_argerror(L, 2, "sequence belongs to another model");
    bool all = luma_bind_optbool(L, 4, "all", false);
    pending c = { NULL, 1, 0, all };
    c.ids = luma_bind_checkidarg(L, 3, m->hp.n_vocab, &c.one, &c.n);
    if (c.ids == &c.one) {
        c.ids = NULL;   /* kept in the chunk, which moves */
        lua_pushboolean(L, 0);
    }
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 16;
        pending *p = realloc(b->chunks, (size_t)cap * sizeof *p);
        if (!p) return luaL_error(L, "out of memory for a batch of %d chunks", cap);
        b->chunks = p;
        b->cap = cap;
    }
    lua_getiuservalue(L, 1, 2);
    lua_pushvalue(L, 2);
    lua_rawseti(L, -2, 2 * b->n + 1);
    lua_pushvalue(L, -2);
    lua_rawseti(L, -2, 2 * b->n + 2);
    b->chunks[b->n++] = c;
    lua_settop(L, 1);
    return 1;
}

/* What batch:run hands out, made while the device computes the step. */
typedef struct results_call {
    lua_State *L;
    luma_model *m;
    const luma_chunk *chunks;
    int n;
    int64_t rows;
    int pending_refs;       /* stack index of the pending chunks' references */
    int during;             /* stack index of the during function, or 0 */
    llogits **slots;        /* out: the Logits in row order */
    bool during_failed;     /* out: during raised; its error is on the stack */
} results_call;

/* make_results(call, refs) -> slots, {[seq] = Logits (or array of Logits
 * with all = true)}: the Logits, not yet holding their rows. */
static int make_results(lua_State *L)
{
    results_call *r = lua_touserdata(L, 1);
    const int refs = 2;
    r->slots = lua_newuserdatauv(L, (size_t)r->rows * sizeof *r->slots, 0);
    lua_createtable(L, 0, r->n);
    int res = lua_gettop(L);
    int64_t row = 0;
    for (int i = 0; i < r->n; i++) {
        lua_rawgeti(L, refs, 2 * i + 1);
        int32_t k = r->chunks[i].all_logits ? r->chunks[i].n : 1;
        if (r->chunks[i].all_logits) lua_createtable(L, k, 0);
        for (int32_t j = 0; j < k; j++) {
            r->slots[row++] = luma_bind_newlogits(L, r->m->hp.n_vocab);
            if (r->chunks[i].all_logits) lua_rawseti(L, -2, j + 1);
        }
        lua_rawset(L, res);
    }
    return 2;
}

/* The run's hook: make_results, then during, each protected, with the
 * collector stopped (a finalizer must not reach the model while its step is
 * in flight) and during with the model busy. Leaves slots and the results
 * on the stack, and during's error above them when it raised. */
static int results_hook(void *ctx, luma_err *err)
{
    results_call *r = ctx;
    lua_State *L = r->L;
    const bool gc_on = lua_gc(L, LUA_GCISRUNNING);
    if (gc_on) lua_gc(L, LUA_GCSTOP);
    lua_pushcfunction(L, make_results);
    lua_pushlightuserdata(L, r);
    lua_pushvalue(L, r->pending_refs);
    int st = lua_pcall(L, 2, 2, 0);
    if (st == LUA_OK && r->during) {
        lua_pushvalue(L, r->during);
        r->m->busy = true;
        r->during_failed = lua_pcall(L, 0, 0, 0) != LUA_OK;
        r->m->busy = false;
    }
    if (gc_on) lua_gc(L, LUA_GCRESTART);
    if (st == LUA_OK) return 0;
    const char *msg = lua_tostring(L, -1);
    luma_errf(err, "batch:run: %s", msg ? msg : "error making the results");
    lua_pop(L, 1);
    return -1;
}

/* batch:run([during]) -> {[seq] = Logits (or array of Logits with all = true)} */
static int batch_run(lua_State *L)
{
    lbatch *b = checkbatch(L, 1);
    const int during = lua_isnoneornil(L, 2) ? 0 : 2;
    if (during) luaL_checktype(L, 2, LUA_TFUNCTION);
    lua_getiuservalue(L, 1, 1);
    luma_model *m = luma_bind_model(L, -1);
    luma_bind_idle(L, m);
    if (b->n == 0) return luaL_error(L, "batch is empty");
    lua_getiuservalue(L, 1, 2);
    int pending_refs = lua_gettop(L);
    int n = b->n;
    /* Emptied whether or not the step runs: the chunks are either all run
     * or none (every sequence is as it was). The old references stay on the
     * stack until the run is over. */
    b->n = 0;
    lua_createtable(L, 2 * n, 0);
    lua_setiuservalue(L, 1, 2);
    /* The chunks, then the single ids (a finalizer run by the collection
     * below may add to this batch again, moving b->chunks). */
    luma_chunk *chunks = lua_newuserdatauv(L, (size_t)n * (sizeof *chunks + sizeof(int32_t)), 0);
    int32_t *ones = (int32_t *)(chunks + n);
    for (int i = 0; i < n; i++) {
        const pending *p = &b->chunks[i];
        lua_rawgeti(L, pending_refs, 2 * i + 1);
        chunks[i].seq = luma_bind_seq(L, -1);
        lua_pop(L, 1);
        ones[i] = p->one;
        chunks[i].ids = p->ids ? p->ids : &ones[i];
        chunks[i].n = p->n;
        chunks[i].all_logits = p->all;
    }
    int64_t rows = luma_model_out_rows(chunks, n);
    luma_bind_logits_budget(L, m, rows);
    /* The results are made once the step is queued (the hook), so that
     * the device works meanwhile, and before the run ends, so that nothing
     * can fail between the run and handing its rows out. */
    results_call r = { L, m, chunks, n, rows, pending_refs, during, NULL, false };
    luma_run_hook hook = { results_hook, &r };
    luma_logits_set *set;
    luma_err err;
    if (luma_model_run_set(m, chunks, n, &hook, &set, &err)) return luma_bind_error(L, &err);
    for (int64_t i = 0; i < rows; i++) luma_bind_logits_hold(r.slots[i], set, i);
    luma_logits_set_release(set);
    if (r.during_failed) return lua_error(L);
    return 1;
}

static int batch_len(lua_State *L)
{
    lua_pushinteger(L, checkbatch(L, 1)->n);
    return 1;
}

static const luaL_Reg meta[] = {
    { "__len", batch_len },
    { "__gc", batch_gc },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "add", batch_add },
    { "run", batch_run },
    { NULL, NULL },
};

void luma_bind_open_batch(lua_State *L)
{
    luma_bind_newclass(L, LUMA_BATCH_MT, meta, methods, NULL);
    /* model:batch() */
    luaL_getmetatable(L, LUMA_MODEL_MT);
    lua_getfield(L, -1, "__index");
    lua_getupvalue(L, -1, 1);
    lua_pushcfunction(L, model_batch);
    lua_setfield(L, -2, "batch");
    lua_pop(L, 3);
}
