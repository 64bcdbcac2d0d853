/* Batch userdata: chunks from many sequences run as one forward.
 *   local b = model:batch()
 *   b:add(seq_a, {id}); b:add(seq_b, prompt_ids)
 *   local out = b:run()     -- out[seq_a], out[seq_b]: Logits
 * A batch is emptied by run and can be filled again. The pending chunks live
 * in the user value: an array of {seq, ids, n, all}, ids a userdata holding
 * a checked copy of the n token ids. */
#include "bind/bind.h"

typedef struct lbatch {
    int n;                  /* chunks added since the last run */
} lbatch;

static lbatch *checkbatch(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_BATCH_MT);
}

static int model_batch(lua_State *L)
{
    luma_bind_model(L, 1);
    lbatch *b = lua_newuserdatauv(L, sizeof *b, 2);
    b->n = 0;
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
    /* One id is kept as a list of one. */
    if (lua_type(L, 3) == LUA_TNUMBER) {
        lua_createtable(L, 1, 0);
        lua_pushvalue(L, 3);
        lua_rawseti(L, -2, 1);
        lua_replace(L, 3);
    }
    int32_t n;
    luma_bind_checkids(L, 3, m->hp.n_vocab, &n);
    if (n == 0) return luaL_argerror(L, 3, "no token ids");
    lua_createtable(L, 4, 0);
    lua_pushvalue(L, 2);
    lua_rawseti(L, -2, 1);
    lua_pushvalue(L, -2);
    lua_rawseti(L, -2, 2);
    lua_pushinteger(L, n);
    lua_rawseti(L, -2, 3);
    lua_pushboolean(L, all);
    lua_rawseti(L, -2, 4);
    lua_getiuservalue(L, 1, 2);
    lua_pushvalue(L, -2);
    lua_rawseti(L, -2, ++b->n);
    lua_settop(L, 1);
    return 1;
}

/* batch:run() -> {[seq] = Logits (or array of Logits with all = true)} */
static int batch_run(lua_State *L)
{
    lbatch *b = checkbatch(L, 1);
    lua_getiuservalue(L, 1, 1);
    luma_model *m = luma_bind_model(L, -1);
    if (b->n == 0) return luaL_error(L, "batch is empty");
    lua_getiuservalue(L, 1, 2);
    int pending = lua_gettop(L);
    int n = b->n;
    /* Emptied whether or not the step runs: the chunks are either all run
     * or none (every sequence is as it was). */
    b->n = 0;
    lua_newtable(L);
    lua_setiuservalue(L, 1, 2);
    luma_chunk *chunks = lua_newuserdatauv(L, (size_t)n * sizeof *chunks, 0);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, pending, i + 1);
        lua_rawgeti(L, -1, 1);
        chunks[i].seq = luma_bind_seq(L, -1);
        /* The id buffer stays referenced from the pending table. */
        lua_rawgeti(L, -2, 2);
        chunks[i].ids = lua_touserdata(L, -1);
        lua_rawgeti(L, -3, 3);
        chunks[i].n = (int32_t)lua_tointeger(L, -1);
        lua_rawgeti(L, -4, 4);
        chunks[i].all_logits = lua_toboolean(L, -1);
        lua_pop(L, 5);
    }
    int64_t rows = luma_model_out_rows(chunks, n);
    luma_bind_logits_budget(L, m, rows);
    /* The results exist before the run, so that nothing can fail between
     * the run and handing its rows out; slots lists them in row order. */
    llogits **slots = lua_newuserdatauv(L, (size_t)rows * sizeof *slots, 0);
    lua_newtable(L);
    int res = lua_gettop(L);
    int64_t row = 0;
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, pending, i + 1);
        lua_rawgeti(L, -1, 1);
        int32_t r = chunks[i].all_logits ? chunks[i].n : 1;
        if (chunks[i].all_logits) lua_createtable(L, r, 0);
        for (int32_t j = 0; j < r; j++) {
            slots[row++] = luma_bind_newlogits(L, m->hp.n_vocab);
            if (chunks[i].all_logits) lua_rawseti(L, -2, j + 1);
        }
        lua_rawset(L, res);
        lua_pop(L, 1);
    }
    luma_logits_set *set;
    luma_err err;
    if (luma_model_run_set(m, chunks, n, &set, &err)) return luma_bind_error(L, &err);
    for (int64_t r = 0; r < rows; r++) luma_bind_logits_hold(slots[r], set, r);
    luma_logits_set_release(set);
    lua_settop(L, res);
    return 1;
}

static int batch_len(lua_State *L)
{
    lua_pushinteger(L, checkbatch(L, 1)->n);
    return 1;
}

static const luaL_Reg meta[] = {
    { "__len", batch_len },
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
