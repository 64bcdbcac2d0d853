-- What a process's prompts cost the first time their length comes and
-- again: each length of the list is a prompt on a new sequence, timed to
-- its logits and their argmax, then the same length once more. A backend
-- that prepares for a step shape at its first use (on a GPU: cuBLAS's
-- choice of kernel and the kernel's first load, a recording of the step)
-- shows it in the first column; the load's warm-up (LUMA_CUDA_WARMUP) and
-- the cuBLASLt choice per bucket of rows (LUMA_CUDA_LT) are what keep it
-- small. On a GPU a prompt of fewer than 32 tokens is recorded as a CUDA
-- graph when its length comes again, so its second time holds the
-- recording; from the third on it is replayed.
--
--   luma scripts/first-prompts.lua [-m model] [-b backend] [-l lengths]
--
-- -m: a GGUF file (default: the default model); -b: cpu, cuda or auto
-- (default); -l: prompt lengths in tokens, a comma-separated list, in the
-- order they run (default 13,100,300,1000,77,450,2000).
local luma = require "luma"
local cli = require "luma.cli"

local name, usage = "scripts/first-prompts.lua", "[options]"
local spec = {
  model = { kind = "string", short = "m", help = "GGUF file (default: the default model)" },
  backend = { kind = "string", short = "b", help = "cpu, cuda or auto", default = "auto" },
  lengths = { kind = "string", short = "l", help = "prompt lengths, comma-separated",
              default = "13,100,300,1000,77,450,2000" },
}
local opt = cli.script(name, usage, spec, arg)
local lengths, longest = {}, 0
for w in opt.lengths:gmatch("[^,]+") do
  local n = math.tointeger(tonumber(w))
  if not n or n < 1 then error("-l must list positive integers, got '" .. w .. "'", 0) end
  lengths[#lengths + 1], longest = n, math.max(longest, n)
end
if #lengths == 0 then error("-l must list at least one length", 0) end

local t0 = luma.now()
-- luma.load's defaults, as a user has them: a prompt runs in steps of at
-- most max_rows (512) rows
local model <close> = luma.load(opt.model or require("luma.fetch").default_model(), { backend = opt.backend })
if longest >= model.info.ctx then error("-l: " .. longest .. " tokens do not fit the context", 0) end
local load_ms = (luma.now() - t0) * 1e3
local text = "The lighthouse keeper counted the steps, then the waves, then the gulls. "
local ids = model:tokenize(string.rep(text, longest // 8 + 2), { bos = true })
if #ids < longest then error("the prompt text has too few tokens", 0) end

local function prompt_ms(n)
  local seq <close> = model:sequence()
  local a = luma.now()
  seq:eval({ table.unpack(ids, 1, n) }):argmax()
  return (luma.now() - a) * 1e3
end

print(string.format("%s on %s: load %.0f ms", model.info.name or model.info.arch, model.info.backend, load_ms))
print(string.format("%8s  %12s  %10s", "tokens", "first ms", "again ms"))
for _, n in ipairs(lengths) do
  local first = prompt_ms(n)
  print(string.format("%8d  %12.2f  %10.2f", n, first, prompt_ms(n)))
end
