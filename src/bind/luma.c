/* luaopen_luma: the module table, its functions, and the helpers every
 * userdata file shares. The pure-Lua half (the files of lua/luma/) is reached
 * through the module table: luma.policy, luma.stop, luma.generate ... are
 * loaded on first use. */
#define _POSIX_C_SOURCE 200809L
#include <string.h>
#include <time.h>

#include "bind/bind.h"
#include "sha256.h"

int luma_bind_error(lua_State *L, const luma_err *err)
{
    return luaL_error(L, "%s", err->msg);
}

static bool getopt_field(lua_State *L, int i, const char *key)
{
    if (lua_isnoneornil(L, i)) return false;
    luaL_checktype(L, i, LUA_TTABLE);
    lua_getfield(L, i, key);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        return false;
    }
    return true;
}

bool luma_bind_optbool(lua_State *L, int i, const char *key, bool def)
{
    if (!getopt_field(L, i, key)) return def;
    if (!lua_isboolean(L, -1)) luaL_error(L, "option '%s' must be a boolean", key);
    bool v = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

lua_Integer luma_bind_optint(lua_State *L, int i, const char *key, lua_Integer def)
{
    if (!getopt_field(L, i, key)) return def;
    int ok;
    lua_Integer v = lua_tointegerx(L, -1, &ok);
    if (!ok) luaL_error(L, "option '%s' must be an integer", key);
    lua_pop(L, 1);
    return v;
}

lua_Number luma_bind_optnum(lua_State *L, int i, const char *key, lua_Number def)
{
    if (!getopt_field(L, i, key)) return def;
    int ok;
    lua_Number v = lua_tonumberx(L, -1, &ok);
    if (!ok) luaL_error(L, "option '%s' must be a number", key);
    lua_pop(L, 1);
    return v;
}

const char *luma_bind_optstr(lua_State *L, int i, const char *key, const char *def)
{
    if (!getopt_field(L, i, key)) return def;
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "option '%s' must be a string", key);
    /* The string stays referenced by the options table. */
    const char *s = lua_tostring(L, -1);
    lua_pop(L, 1);
    return s;
}

void luma_bind_newclass(lua_State *L, const char *name, const luaL_Reg *meta, const luaL_Reg *methods,
                        lua_CFunction index)
{
    luaL_newmetatable(L, name);
    luaL_setfuncs(L, meta, 0);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    if (index) lua_pushcclosure(L, index, 1);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
}

int32_t *luma_bind_checkids(lua_State *L, int i, int32_t n_vocab, int32_t *count)
{
    luaL_checktype(L, i, LUA_TTABLE);
    lua_Integer n = luaL_len(L, i);
    if (n < 0 || n > (1 << 26)) luaL_argerror(L, i, "too many token ids");
    int32_t *ids = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof(int32_t), 0);
    for (lua_Integer k = 1; k <= n; k++) {
        int isint;
        lua_Integer v = (lua_rawgeti(L, i, k), lua_tointegerx(L, -1, &isint));
        lua_pop(L, 1);
        if (!isint)
            return luaL_argerror(L, i, lua_pushfstring(L, "element %I is not an integer token id", k)), NULL;
        if (v < 0 || (n_vocab > 0 && v >= n_vocab))
            return luaL_argerror(L, i, lua_pushfstring(L, "token id %I at position %I is out of range [0, %d)", v, k,
                                                       (int)n_vocab)), NULL;
        ids[k - 1] = (int32_t)v;
    }
    *count = (int32_t)n;
    return ids;
}

const int32_t *luma_bind_checkidarg(lua_State *L, int i, int32_t n_vocab, int32_t *one, int32_t *count)
{
    if (lua_type(L, i) == LUA_TNUMBER) {
        int isint;
        lua_Integer id = lua_tointegerx(L, i, &isint);
        if (!isint)
            luaL_argerror(L, i, lua_pushfstring(L, "token id must be an integer (%s is not an integer)",
                                                luaL_tolstring(L, i, NULL)));
        if (id < 0 || id >= n_vocab)
            luaL_argerror(L, i, lua_pushfstring(L, "token id %I out of range [0, %d)", id, (int)n_vocab));
        *one = (int32_t)id;
        *count = 1;
        return one;
    }
    const int32_t *ids = luma_bind_checkids(L, i, n_vocab, count);
    if (*count == 0) luaL_argerror(L, i, "no token ids");
    return ids;
}

static int l_sha256(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    char hex[65];
    luma_err err;
    if (luma_sha256_file(path, hex, &err)) return luma_bind_error(L, &err);
    lua_pushstring(L, hex);
    return 1;
}

static int l_backends(lua_State *L)
{
    lua_newtable(L);
    lua_pushstring(L, "cpu");
    lua_rawseti(L, -2, 1);
    if (luma_backend_cuda_available()) {
        lua_pushstring(L, "cuda");
        lua_rawseti(L, -2, 2);
    }
    return 1;
}

/* Seconds on a monotonic clock, for timing generation. */
static int l_now(lua_State *L)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
    return 1;
}

static int l_simd(lua_State *L)
{
    lua_pushstring(L, luma_simd_name());
    return 1;
}


static const luaL_Reg funcs[] = {
    { "load", luma_bind_load },
    { "rng", luma_bind_rng },
    { "draw", luma_bind_draw },
    { "synth", luma_bind_synth },
    { "synth_presets", luma_bind_synth_presets },
    { "sha256", l_sha256 },
    { "backends", l_backends },
    { "simd", l_simd },
    { "now", l_now },
    { NULL, NULL },
};

/* luma.<name> for a name not in the table: require "luma.<name>", each
 * time (require finds it in package.loaded after the first), so that
 * luma.policy and a module's own require "luma.policy" are always one
 * table, also where package.loaded is reset between uses (busted's
 * insulation of spec files). */
static int module_index(lua_State *L)
{
    const char *name = luaL_checkstring(L, 2);
    lua_getglobal(L, "require");
    lua_pushfstring(L, "luma.%s", name);
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_getfield(L, -1, lua_tostring(L, -3));
    bool known = !lua_isnil(L, -1);
    lua_pop(L, 3);
    if (!known) {
        lua_pop(L, 2);
        return 0;
    }
    lua_call(L, 1, 1);
    return 1;
}

int luaopen_luma(lua_State *L)
{
    luaL_checkversion(L);
    luma_bind_open_model(L);
    luma_bind_open_seq(L);
    luma_bind_open_logits(L);
    luma_bind_open_rng(L);
    luma_bind_open_batch(L);
    luma_bind_preload_lua(L);
    luaL_newlib(L, funcs);
    lua_pushstring(L, LUMA_VERSION);
    lua_setfield(L, -2, "version");
    lua_newtable(L);
    lua_pushcfunction(L, module_index);
    lua_setfield(L, -2, "__index");
    lua_setmetatable(L, -2);
    return 1;
}
