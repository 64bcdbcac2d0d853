-- Where the time of an aggregate decode step goes: s sequences, each
-- prefilled with a prompt of p tokens, then n greedy steps of one token
-- each, every step one batch:run. For each step it times the Lua side (the
-- adds, then argmax over the results) and the run (the step on the backend,
-- with the host's own work in it), and prints the first steps one by one
-- (where a GPU backend records a new shape) and the median of the rest.
--
--   luma scripts/step-times.lua [-m model] [-b backend] [-s seqs] [-p tokens] [-n steps] [-k MiB]
--
-- -m: a GGUF file (default: the default model); -b: cpu, cuda or auto
-- (default); -s: sequences (default 8); -p: prompt tokens each (default
-- 32); -n: decode steps (default 16); -k: the KV cache's MiB (default 0:
-- one full context, as luma.load's kv_mb).
local luma = require "luma"
local fetch = require "luma.fetch"
local bench = require "luma.bench"

local opt = bench.script_options(arg, { b = "auto", s = "8", p = "32", n = "16", k = "0" },
  "usage: step-times.lua [-m model] [-b backend] [-s seqs] [-p tokens] [-n steps] [-k MiB]")
local function int(v) return math.tointeger(tonumber(v)) end
local n_seqs, plen, steps, kv_mb = int(opt.s), int(opt.p), int(opt.n), int(opt.k)
if not (n_seqs and plen and steps and kv_mb and n_seqs >= 1 and plen >= 1 and steps >= 3 and kv_mb >= 0) then
  error("step-times.lua: -s and -p must be positive integers, -n at least 3, -k at least 0", 0)
end

local model = luma.load(opt.m or fetch.default_model(),
  { backend = opt.b, kv_mb = kv_mb, max_rows = math.max(512, n_seqs) })
local ids = model:tokenize(string.rep("The lighthouse keeper counted the steps. ", plen), { bos = true })
for k = #ids, plen + 1, -1 do ids[k] = nil end

local batch, seqs, last = bench.prefilled(model, n_seqs, ids)
local out

local times = {}
for step = 1, steps do
  local t0 = luma.now()
  for s = 1, n_seqs do batch:add(seqs[s], last[s]) end
  local t1 = luma.now()
  out = batch:run()
  local t2 = luma.now()
  for s = 1, n_seqs do last[s] = out[seqs[s]]:argmax() end
  local t3 = luma.now()
  times[step] = { total = t3 - t0, add = t1 - t0, run = t2 - t1, argmax = t3 - t2 }
end
for s = 1, n_seqs do seqs[s]:close() end

print(string.format("%s, %s: %d sequences of %d prompt tokens, %d steps of one token each",
  model.info.name or model.info.arch, model.info.backend, n_seqs, #ids, steps))
local function show(label, t)
  print(string.format("%-14s %8.3f ms   adds %7.1f us   run %8.3f ms   argmax %7.1f us   %9.1f tokens/s", label,
    t.total * 1e3, t.add * 1e6, t.run * 1e3, t.argmax * 1e6, n_seqs / t.total))
end
show("step 1", times[1])
show("step 2", times[2])
local rest = {}
for k = 3, steps do rest[#rest + 1] = times[k] end
table.sort(rest, function(a, b) return a.total < b.total end)
show("median of 3-" .. steps, rest[#rest // 2 + 1])
model:close()
