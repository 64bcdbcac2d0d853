/* luma.synth{...}: writes a synthetic model (src/synth.h).
 *   luma.synth{ preset = "llama-7b", vocab = "vocab.gguf", out = "llama-7b.gguf",
 *               mix = "q4_k_m", seed = 1 }
 * Any field of the preset can be overridden: arch, layers, embd, heads,
 * kv_heads, head_dim, ff, ctx, window, rope_base, eps, tied. */
#include "bind/bind.h"
#include "synth.h"

static int32_t opt_i32(lua_State *L, const char *key, int32_t def)
{
    lua_Integer v = luma_bind_optint(L, 1, key, def);
    if (v < 0 || v > INT32_MAX) luaL_error(L, "option '%s' out of range", key);
    return (int32_t)v;
}

int luma_bind_synth(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    luma_synth_params p = { 0 };
    luma_err err;
    const char *preset = luma_bind_optstr(L, 1, "preset", NULL);
    if (preset && luma_synth_preset(preset, &p, &err)) return luma_bind_error(L, &err);
    p.arch = luma_bind_optstr(L, 1, "arch", p.arch);
    if (!p.arch) return luaL_error(L, "synth: give a preset or an arch");
    p.n_layer = opt_i32(L, "layers", p.n_layer);
    p.n_embd = opt_i32(L, "embd", p.n_embd);
    p.n_head = opt_i32(L, "heads", p.n_head);
    p.n_kv_head = opt_i32(L, "kv_heads", p.n_kv_head ? p.n_kv_head : p.n_head);
    p.head_dim = opt_i32(L, "head_dim", p.head_dim);
    p.n_ff = opt_i32(L, "ff", p.n_ff);
    p.n_ctx = opt_i32(L, "ctx", p.n_ctx);
    p.swa_window = opt_i32(L, "window", p.swa_window);
    p.rope_base = (float)luma_bind_optnum(L, 1, "rope_base", p.rope_base);
    p.eps = (float)luma_bind_optnum(L, 1, "eps", p.eps);
    p.tied = luma_bind_optbool(L, 1, "tied", p.tied);
    p.mix = luma_bind_optstr(L, 1, "mix", "q4_k_m");
    lua_Integer seed = luma_bind_optint(L, 1, "seed", 0);
    p.seed = (uint64_t)seed;
    p.vocab_path = luma_bind_optstr(L, 1, "vocab", NULL);
    const char *out = luma_bind_optstr(L, 1, "out", NULL);
    if (!p.vocab_path) return luaL_error(L, "synth: option 'vocab' (a GGUF file to copy the vocabulary from) is required");
    if (!out) return luaL_error(L, "synth: option 'out' (the file to write) is required");
    if (luma_synth_write(&p, out, &err)) return luma_bind_error(L, &err);
    lua_pushstring(L, out);
    return 1;
}

/* luma.synth_presets() -> { "tiny-llama", ... } */
int luma_bind_synth_presets(lua_State *L)
{
    lua_newtable(L);
    for (int i = 0; luma_synth_preset_name(i); i++) {
        lua_pushstring(L, luma_synth_preset_name(i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}
