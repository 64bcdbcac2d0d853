/* Rng userdata: luma.rng(seed), reproducible across runs and platforms. */
#include "bind/bind.h"

luma_rng *luma_bind_checkrng(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_RNG_MT);
}

/* luma.rng([seed]) */
int luma_bind_rng(lua_State *L)
{
    lua_Integer seed = luaL_optinteger(L, 1, 0);
    luma_rng *r = lua_newuserdatauv(L, sizeof *r, 0);
    luma_rng_seed(r, (uint64_t)seed);
    luaL_setmetatable(L, LUMA_RNG_MT);
    return 1;
}

/* rng:random() -> float in [0, 1); rng:random(m, n) -> integer in [m, n] */
static int rng_random(lua_State *L)
{
    luma_rng *r = luma_bind_checkrng(L, 1);
    if (lua_isnoneornil(L, 2)) {
        lua_pushnumber(L, luma_rng_uniform(r));
        return 1;
    }
    lua_Integer lo = luaL_checkinteger(L, 2), hi = luaL_checkinteger(L, 3);
    luaL_argcheck(L, lo <= hi, 3, "interval is empty");
    uint64_t span = (uint64_t)hi - (uint64_t)lo + 1;
    uint64_t v = span ? luma_rng_next_u64(r) % span : luma_rng_next_u64(r);
    lua_pushinteger(L, (lua_Integer)((uint64_t)lo + v));
    return 1;
}

static int rng_tostring(lua_State *L)
{
    luma_bind_checkrng(L, 1);
    lua_pushliteral(L, "luma.Rng");
    return 1;
}

static const luaL_Reg meta[] = {
    { "__tostring", rng_tostring },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "random", rng_random },
    { NULL, NULL },
};

void luma_bind_open_rng(lua_State *L)
{
    luma_bind_newclass(L, LUMA_RNG_MT, meta, methods, NULL);
}
