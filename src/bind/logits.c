/* Logits userdata: one float per vocabulary entry, indexed by token id from
 * 0 (logits[model.eos]); #logits is the vocabulary size. Transforms edit in
 * place and return the object, so they chain:
 *   logits:penalize(hist, {repeat_ = 1.1}):top_k(40):top_p(0.95):temperature(0.8):sample(rng) */
#include <math.h>
#include <string.h>

#include "bind/bind.h"
#include "sample.h"

llogits *luma_bind_checklogits(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_LOGITS_MT);
}

llogits *luma_bind_newlogits(lua_State *L, int32_t n)
{
    llogits *lg = lua_newuserdatauv(L, sizeof *lg + (size_t)n * sizeof(float), 0);
    lg->n = n;
    luaL_setmetatable(L, LUMA_LOGITS_MT);
    return lg;
}

static int32_t check_index(lua_State *L, const llogits *lg, int i)
{
    lua_Integer id = luaL_checkinteger(L, i);
    if (id < 0 || id >= lg->n)
        luaL_error(L, "token id %I out of range [0, %d)", id, (int)lg->n);
    return (int32_t)id;
}

static int logits_index(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    if (lua_type(L, 2) == LUA_TNUMBER) {
        lua_pushnumber(L, lg->x[check_index(L, lg, 2)]);
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_gettable(L, lua_upvalueindex(1));
    return 1;
}

static int logits_newindex(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t id = check_index(L, lg, 2);
    lg->x[id] = (float)luaL_checknumber(L, 3);
    return 0;
}

static int logits_len(lua_State *L)
{
    lua_pushinteger(L, luma_bind_checklogits(L, 1)->n);
    return 1;
}

static int logits_tostring(lua_State *L)
{
    lua_pushfstring(L, "luma.Logits (%d)", (int)luma_bind_checklogits(L, 1)->n);
    return 1;
}

/* Returns self, for chaining, after a transform that returned rc. */
static int chain(lua_State *L, int rc, const luma_err *err)
{
    if (rc < 0) return luma_bind_error(L, err);
    lua_settop(L, 1);
    return 1;
}

static int logits_argmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    int32_t id = luma_logits_argmax(lg->x, lg->n, &err);
    if (id < 0) return luaL_error(L, "argmax: every entry is masked");
    lua_pushinteger(L, id);
    return 1;
}

/* logits:topk(k) -> ids, values (Lua arrays, largest first) */
static int logits_topk(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k < 1 || k > lg->n) return luaL_argerror(L, 2, "k must be in [1, vocabulary size]");
    int32_t *ids = lua_newuserdatauv(L, (size_t)k * sizeof(int32_t), 0);
    float *vals = lua_newuserdatauv(L, (size_t)k * sizeof(float), 0);
    luma_err err;
    int32_t got = luma_logits_topk(lg->x, lg->n, (int32_t)k, ids, vals, &err);
    if (got < 0) return luma_bind_error(L, &err);
    lua_createtable(L, got, 0);
    lua_createtable(L, got, 0);
    for (int32_t i = 0; i < got; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -3, i + 1);
        lua_pushnumber(L, vals[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 2;
}

static int logits_temperature(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_temperature(lg->x, lg->n, (float)luaL_checknumber(L, 2), &err), &err);
}

static int logits_top_k(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k < 1) return luaL_argerror(L, 2, "k must be at least 1");
    if (k > lg->n) k = lg->n;
    luma_err err;
    return chain(L, luma_logits_top_k(lg->x, lg->n, (int32_t)k, &err), &err);
}

static int32_t check_min_keep(lua_State *L, int i)
{
    lua_Integer k = luaL_optinteger(L, i, 1);
    if (k < 0 || k > INT32_MAX) luaL_argerror(L, i, "min_keep must be a non-negative integer");
    return (int32_t)k;
}

static int logits_top_p(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_top_p(lg->x, lg->n, (float)luaL_checknumber(L, 2), check_min_keep(L, 3), &err), &err);
}

static int logits_min_p(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_min_p(lg->x, lg->n, (float)luaL_checknumber(L, 2), check_min_keep(L, 3), &err), &err);
}

static int logits_typical(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_typical(lg->x, lg->n, (float)luaL_checknumber(L, 2), check_min_keep(L, 3), &err), &err);
}

/* logits:penalize(history, {repeat_ =, frequency =, presence =, last_n =}) */
static int logits_penalize(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    float rep = (float)luma_bind_optnum(L, 3, "repeat_", 1.0);
    float freq = (float)luma_bind_optnum(L, 3, "frequency", 0.0);
    float pres = (float)luma_bind_optnum(L, 3, "presence", 0.0);
    lua_Integer last_n = luma_bind_optint(L, 3, "last_n", 64);
    int32_t n;
    int32_t *hist = luma_bind_checkids(L, 2, lg->n, &n);
    if (last_n > INT32_MAX || last_n < INT32_MIN) return luaL_error(L, "option 'last_n' out of range");
    luma_err err;
    return chain(L, luma_logits_penalize(lg->x, lg->n, hist, n, (int32_t)last_n, rep, freq, pres, &err), &err);
}

/* logits:bias({[id] = value, ...}) */
static int logits_bias(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    luma_err err;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        int isint, isnum;
        lua_Integer id = lua_tointegerx(L, -2, &isint);
        lua_Number v = lua_tonumberx(L, -1, &isnum);
        if (!isint || !isnum) return luaL_argerror(L, 2, "expected {[token id] = number}");
        if (id < 0 || id >= lg->n)
            return luaL_argerror(L, 2, lua_pushfstring(L, "token id %I out of range [0, %d)", id, (int)lg->n));
        int32_t i32 = (int32_t)id;
        float f = (float)v;
        if (luma_logits_bias(lg->x, lg->n, &i32, &f, 1, &err) < 0) return luma_bind_error(L, &err);
        lua_pop(L, 1);
    }
    lua_settop(L, 1);
    return 1;
}

/* Reads a set of ids: a Lua array {id, ...} or a set {[id] = true, ...}. */
static int32_t *check_idset(lua_State *L, int i, int32_t n_vocab, int32_t *count)
{
    luaL_checktype(L, i, LUA_TTABLE);
    if (luaL_len(L, i) > 0) return luma_bind_checkids(L, i, n_vocab, count);
    int32_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, i)) {
        n++;
        lua_pop(L, 1);
    }
    int32_t *ids = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof(int32_t), 0);
    int32_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, i)) {
        int isint;
        lua_Integer id = lua_tointegerx(L, -2, &isint);
        if (!isint || id < 0 || id >= n_vocab)
            luaL_argerror(L, i, lua_pushfstring(L, "expected token ids in [0, %d)", (int)n_vocab));
        if (lua_toboolean(L, -1)) ids[k++] = (int32_t)id;
        lua_pop(L, 1);
    }
    *count = k;
    return ids;
}

static int logits_mask(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t n;
    int32_t *ids = check_idset(L, 2, lg->n, &n);
    luma_err err;
    return chain(L, luma_logits_mask(lg->x, lg->n, ids, n, &err), &err);
}

static int logits_allow(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t n;
    int32_t *ids = check_idset(L, 2, lg->n, &n);
    luma_err err;
    return chain(L, luma_logits_allow(lg->x, lg->n, ids, n, &err), &err);
}

static int logits_softmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_softmax(lg->x, lg->n, &err), &err);
}

static int logits_log_softmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    return chain(L, luma_logits_log_softmax(lg->x, lg->n, &err), &err);
}

static int logits_entropy(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    double h;
    if (luma_logits_entropy(lg->x, lg->n, &h, &err)) return luma_bind_error(L, &err);
    lua_pushnumber(L, h);
    return 1;
}

static int logits_sample(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_rng *rng = luma_bind_checkrng(L, 2);
    luma_err err;
    int32_t id = luma_logits_sample(lg->x, lg->n, rng, &err);
    if (id < 0) return luma_bind_error(L, &err);
    lua_pushinteger(L, id);
    return 1;
}

static int logits_copy(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    llogits *c = luma_bind_newlogits(L, lg->n);
    memcpy(c->x, lg->x, (size_t)lg->n * sizeof(float));
    return 1;
}

static const luaL_Reg meta[] = {
    { "__newindex", logits_newindex },
    { "__len", logits_len },
    { "__tostring", logits_tostring },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "argmax", logits_argmax },
    { "topk", logits_topk },
    { "temperature", logits_temperature },
    { "top_k", logits_top_k },
    { "top_p", logits_top_p },
    { "min_p", logits_min_p },
    { "typical", logits_typical },
    { "penalize", logits_penalize },
    { "bias", logits_bias },
    { "mask", logits_mask },
    { "allow", logits_allow },
    { "softmax", logits_softmax },
    { "log_softmax", logits_log_softmax },
    { "entropy", logits_entropy },
    { "sample", logits_sample },
    { "copy", logits_copy },
    { NULL, NULL },
};

void luma_bind_open_logits(lua_State *L)
{
    luma_bind_newclass(L, LUMA_LOGITS_MT, meta, methods, logits_index);
}
