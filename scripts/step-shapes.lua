-- Does a token's result depend on the shape of the step it ran in? A prompt
-- runs as one step (logits for every row) and again one token per step; on
-- a GPU both are also compared with the CPU backend. Prints, per prompt
-- length, the largest |difference| of the logits over the vocabulary (worst
-- row) and how often the top token agrees.
--
--   luma scripts/step-shapes.lua [-b backend] [-n tokens] [-i]
--
-- -b: cpu, cuda or auto (default); -n: prompt lengths, a list (default
-- 6,20); -i: load batch-invariant (luma.load's batch_invariant).
local luma = require "luma"
local fetch = require "luma.fetch"

local opt = { b = "auto", n = "6,20" }
local i = 1
while i <= #arg do
  local k = arg[i]:match("^%-(%a)$")
  if k == "i" then
    opt.i = true
    i = i + 1
  elseif k and arg[i + 1] then
    opt[k] = arg[i + 1]
    i = i + 2
  else
    error("usage: step-shapes.lua [-b backend] [-n tokens] [-i]", 0)
  end
end

local path = fetch.default_model()
local model = luma.load(path, { backend = opt.b, ctx = 1024, batch_invariant = opt.i or nil })
local cpu = model.info.backend ~= "cpu" and luma.load(path, { backend = "cpu", ctx = 1024 }) or nil
local text = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his " ..
             "father had taught him. Two hundred and twelve, he would whisper at the top."
local ids = model:tokenize(text)

local function maxdiff(a, b)
  local d = 0
  for t = 0, #a - 1 do d = math.max(d, math.abs(a[t] - b[t])) end
  return d
end

print(string.format("backend %s%s", model.info.backend, model.info.batch_invariant and ", batch-invariant" or ""))
for n in opt.n:gmatch("%d+") do
  n = math.min(tonumber(n), #ids)
  local prompt = { table.unpack(ids, 1, n) }
  local s1, s2 = model:sequence(), model:sequence()
  local whole = s1:eval(prompt, { all = true })
  local steps = {}
  for j = 1, n do steps[j] = s2:eval(prompt[j]) end
  local ref = cpu and cpu:sequence() or nil
  local on_cpu = ref and ref:eval(prompt, { all = true })
  local w1, w2, agree = 0, 0, 0
  for j = 1, n do
    w1 = math.max(w1, maxdiff(whole[j], steps[j]))
    if on_cpu then
      w2 = math.max(w2, maxdiff(steps[j], on_cpu[j]))
      if steps[j]:argmax() == on_cpu[j]:argmax() then agree = agree + 1 end
    end
  end
  local line = string.format("%3d tokens: one step against one token per step: max |diff| %.3f", n, w1)
  if on_cpu then
    line = line .. string.format("; one token per step against the CPU: max |diff| %.3f, top-1 %d/%d", w2, agree, n)
  end
  print(line)
  s1:close()
  s2:close()
  if ref then ref:close() end
end
model:close()
if cpu then cpu:close() end
