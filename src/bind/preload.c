/* package.preload entries for the Lua files compiled into the binary
 * (lua_files.c, generated from lua/luma/ at build time). */
#include "bind/bind.h"

typedef struct { const char *module, *chunkname, *src; size_t len; } luma_lua_file;
extern const luma_lua_file luma_lua_files[];

static int load_embedded(lua_State *L)
{
    const luma_lua_file *f = lua_touserdata(L, lua_upvalueindex(1));
    if (luaL_loadbuffer(L, f->src, f->len, f->chunkname) != LUA_OK) return lua_error(L);
    lua_pushvalue(L, 1);
    lua_call(L, 1, 1);
    return 1;
}

void luma_bind_preload_lua(lua_State *L)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    for (const luma_lua_file *f = luma_lua_files; f->module; f++) {
        lua_pushlightuserdata(L, (void *)f);
        lua_pushcclosure(L, load_embedded, 1);
        lua_setfield(L, -2, f->module);
    }
    lua_pop(L, 1);
}
