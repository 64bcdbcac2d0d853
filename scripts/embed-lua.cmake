# Writes a C file that registers lua/luma/*.lua in package.preload, so the
# luma binary and luma.so carry their Lua half with them.
#   cmake -DLUA_DIR=<dir holding luma/> -DOUT=<file.c> -P embed-lua.cmake
file(GLOB files RELATIVE ${LUA_DIR} ${LUA_DIR}/luma/*.lua)
list(SORT files)
set(body "")
set(table "")
set(i 0)
foreach(f ${files})
  file(READ ${LUA_DIR}/${f} hex HEX)
  string(LENGTH "${hex}" hexlen)
  math(EXPR n "${hexlen} / 2")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," hex "${hex}")
  string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" hex "${hex}")
  string(REGEX REPLACE "\\.lua$" "" mod "${f}")
  string(REPLACE "/" "." mod "${mod}")
  string(APPEND body "static const unsigned char src${i}[] = {\n${hex}0};\n")
  string(APPEND table "    { \"${mod}\", \"@${f}\", (const char *)src${i}, ${n} },\n")
  math(EXPR i "${i} + 1")
endforeach()
file(WRITE ${OUT}.tmp "/* Generated from lua/luma by scripts/embed-lua.cmake. */
#include <stddef.h>
${body}
typedef struct { const char *module, *chunkname, *src; size_t len; } luma_lua_file;
const luma_lua_file luma_lua_files[] = {
${table}    { NULL, NULL, NULL, 0 },
};
")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
