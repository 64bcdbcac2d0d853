package = "luma"
version = "0.1.0-1"
source = { url = "git+file://." }
description = {
  summary = "Lua-scriptable inference engine for GGUF language models",
  detailed = [[
luma loads GGUF models (Gemma 3, Llama, Qwen2) and exposes models, KV-cache
sequences, batches and logits to Lua, so sampling policies, stop conditions
and batch scheduling are Lua code calling native CPU paths.]],
  license = "MIT",
}
dependencies = { "lua >= 5.4, < 5.5" }
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "Release",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    LUMA_LUA_CMOD_DIR = "$(LIBDIR)",
    LUMA_LUA_LMOD_DIR = "$(LUADIR)",
    LUMA_INSTALL_LIBRARY = "OFF",
  },
}
