/* The luma command: a Lua 5.4 interpreter with the engine preloaded.
 *
 *   luma script.lua [args]     runs a script; arg and ... as the lua command sets them
 *   luma -e 'code' [args]      runs a chunk
 *   luma COMMAND [options]     generate, chat, info, bench, fetch (lua/luma/cli.lua)
 */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdio.h>
#include <string.h>

int luaopen_luma(lua_State *L);

static const char *const commands[] = { "generate", "chat", "info", "bench", "fetch", "synth", NULL };

static void usage(FILE *f)
{
    fputs("usage: luma script.lua [args]      run a Lua script with the engine preloaded\n"
          "       luma -e 'code' [args]       run a chunk of Lua\n"
          "       luma generate [options]     stream a completion (luma generate --help)\n"
          "       luma chat [options]         talk to a model with its chat template\n"
          "       luma info [FILE]            metadata and tensors of a GGUF file\n"
          "       luma bench [options]        prefill and decode speed\n"
          "       luma fetch [MODEL]          download the default model (or another)\n"
          "       luma synth [options]        write a synthetic model of a real shape\n"
          "       luma --version\n",
          f);
}

static int traceback(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* Calls the function below its n arguments with a traceback on error,
 * keeping nres results. */
static int docall(lua_State *L, int n, int nres)
{
    int base = lua_gettop(L) - n;
    lua_pushcfunction(L, traceback);
    lua_insert(L, base);
    int rc = lua_pcall(L, n, nres, base);
    lua_remove(L, base);
    return rc;
}

/* arg = { [-k..-1] = interpreter and options, [0] = script, [1..] = args } */
static void create_arg(lua_State *L, char **argv, int argc, int script)
{
    lua_createtable(L, argc - script - 1, script + 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");
}

static int push_args(lua_State *L, char **argv, int argc, int first)
{
    luaL_checkstack(L, argc - first + 3, "too many arguments");
    for (int i = first; i < argc; i++) lua_pushstring(L, argv[i]);
    return argc - first;
}

static int report(lua_State *L, int rc)
{
    if (rc != LUA_OK) {
        fprintf(stderr, "luma: %s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
    }
    return rc == LUA_OK ? 0 : 1;
}

static int run(lua_State *L, int argc, char **argv)
{
    luaL_openlibs(L);
    luaL_requiref(L, "luma", luaopen_luma, 0);
    lua_pop(L, 1);
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0) {
        lua_getglobal(L, "require");
        lua_pushliteral(L, "luma");
        lua_call(L, 1, 1);
        lua_getfield(L, -1, "version");
        printf("luma %s (%s)\n", lua_tostring(L, -1), LUA_RELEASE);
        return 0;
    }
    if (strcmp(argv[1], "-e") == 0) {
        if (argc < 3) {
            fputs("luma: -e needs an argument\n", stderr);
            return 2;
        }
        create_arg(L, argv, argc, 2);
        if (luaL_loadbuffer(L, argv[2], strlen(argv[2]), "=(command line)") != LUA_OK) return report(L, 1);
        return report(L, docall(L, push_args(L, argv, argc, 3), 0));
    }
    for (int i = 0; commands[i]; i++) {
        if (strcmp(argv[1], commands[i]) != 0) continue;
        static const char chunk[] = "return require('luma.cli').main(...)";
        create_arg(L, argv, argc, 1);
        if (luaL_loadbuffer(L, chunk, sizeof chunk - 1, "=luma") != LUA_OK) return report(L, 1);
        int rc = docall(L, push_args(L, argv, argc, 1), 1);
        if (rc != LUA_OK) return report(L, rc);
        /* The command's exit status, when it returns one. */
        return lua_isinteger(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    }
    create_arg(L, argv, argc, 1);
    if (luaL_loadfile(L, argv[1]) != LUA_OK) return report(L, 1);
    return report(L, docall(L, push_args(L, argv, argc, 2), 0));
}

int main(int argc, char **argv)
{
    lua_State *L = luaL_newstate();
    if (!L) {
        fputs("luma: cannot create a Lua state: out of memory\n", stderr);
        return 1;
    }
    int rc = run(L, argc, argv);
    lua_close(L);
    return rc;
}
