-- Where a scheduler's step goes, part by part: n requests of a p-token
-- prompt, each making exactly g tokens, run with the scheduler's text
-- streamed in flight (overlap on) and between steps (off), alternating for
-- r rounds. Each part of step() is timed by wrapping it: sweep, admit,
-- plan, choose (the policy's calls and the token's bookkeeping), emit (the
-- text, stop conditions, on_token: inside batch:run when overlapping),
-- retire, notify, batch:add and batch:run; "rest" is the step less the
-- parts (emit not counted twice). Then the default policy's calls (top_k
-- 40, top_p 0.95, temperature 0.8, sample) on every row of a batch's
-- steps, each timed alone, and the four without the Logits' __index.
--
--   luma scripts/scheduler-parts.lua [-m model] [-b backend] [-s requests] [-p tokens] [-g tokens]
--                                   [-r rounds] [-P default|const] [-k MiB]
--
-- -m: a GGUF file (default: the default model); -b: cpu, cuda or auto
-- (default); -s: requests (default 32); -p: prompt tokens (default 128);
-- -g: tokens each makes (default 128); -r: rounds (default 2); -P: the
-- policy, the scheduler's default or one returning a constant id (the
-- scheduler's own cost alone); -k: the KV cache's MiB (default 0: as
-- luma.load's kv_mb).
local luma = require "luma"
local fetch = require "luma.fetch"
local bench = require "luma.bench"
local Scheduler = require "luma.scheduler"

local opt, int = bench.script_options(arg,
  { b = "auto", s = "32", p = "128", g = "128", r = "2", P = "default", k = "0" },
  "usage: scheduler-parts.lua [-m model] [-b backend] [-s requests] [-p tokens] [-g tokens] [-r rounds] "
    .. "[-P default|const] [-k MiB]")
local n, plen, gen, rounds, kv = int("s", 1), int("p", 1), int("g", 2), int("r", 1), int("k", 0)
if opt.P ~= "default" and opt.P ~= "const" then error("-P must be default or const", 0) end
local model <close> = luma.load(opt.m or fetch.default_model(), { backend = opt.b, kv_mb = kv > 0 and kv or nil })
local now = luma.now

local ids = bench.prompt_ids(model, plen)

-- every part of a step, timed where it is called, once `on`
local acc, on = {}, false
local function wrap(tbl, name, label)
  local f = tbl[name]
  label = label or name
  tbl[name] = function(...)
    if not on then return f(...) end
    local t = now()
    local a, b = f(...)
    acc[label] = (acc[label] or 0) + (now() - t)
    return a, b
  end
end
for _, k in ipairs{ "sweep", "admit_waiting", "plan", "choose", "emit", "retire_stopped", "notify" } do
  wrap(Scheduler, k)
end
local batch_methods = getmetatable(model:batch()).__index
wrap(batch_methods, "add", "batch:add")
wrap(batch_methods, "run", "batch:run")

local policy = opt.P == "const" and function() return ids[1] end or nil
local function go(overlap, measure)
  local sch = Scheduler.new(model, { prefix = false, overlap = overlap })
  for i = 1, n do sch:submit{ prompt = ids, max_tokens = gen, seed = i, stop = {}, policy = policy } end
  while sch.stats.tokens < n and sch:step() do end
  local st = sch.stats
  local steps, tokens, t0 = st.steps, st.tokens, now()
  acc, on = {}, measure
  sch:run()
  on = false
  local dt = now() - t0
  steps = st.steps - steps
  sch:close()
  if not measure then return end
  local total, known, parts = dt / steps * 1e6, 0, {}
  for k, v in pairs(acc) do
    parts[#parts + 1] = { k, v / steps * 1e6 }
    if k ~= "emit" or not overlap then known = known + v / steps * 1e6 end
  end
  table.sort(parts, function(a, b) return a[2] > b[2] end)
  local line = {}
  for _, p in ipairs(parts) do line[#line + 1] = string.format("%s %.0f", p[1], p[2]) end
  print(string.format("overlap %-3s: %.1f tokens/s; step %.0f us: %s, rest %.0f", overlap and "on" or "off",
                      (st.tokens - tokens) / dt, total, table.concat(line, ", "), total - known))
end

print(string.format("%s, %s, %d requests of %d + %d tokens, policy %s", model.info.name or model.info.arch,
                    model.info.backend, n, plen, gen, opt.P))
go(true, false)   -- records the step shapes on a GPU backend
for _ = 1, rounds do
  go(false, true)
  go(true, true)
end

-- the default policy's calls on every row of a batch, for gen steps
local batch, seqs, nexts = bench.prefilled(model, n, ids)
local rngs = {}
for i = 1, n do rngs[i] = luma.rng(i) end
local top_k, top_p, temperature, sample   -- the methods, taken from the first Logits
local calls, direct, rows = { 0, 0, 0, 0 }, 0, 0
for s = 1, gen do
  for i = 1, n do batch:add(seqs[i], nexts[i]) end
  local out = batch:run()
  for i = 1, n do
    local lg = out[seqs[i]]
    if not top_k then top_k, top_p, temperature, sample = lg.top_k, lg.top_p, lg.temperature, lg.sample end
    if s % 2 == 0 then
      local t0 = now()
      lg:top_k(40)
      local t1 = now()
      lg:top_p(0.95)
      local t2 = now()
      lg:temperature(0.8)
      local t3 = now()
      nexts[i] = lg:sample(rngs[i])
      local t4 = now()
      calls[1], calls[2], calls[3], calls[4] = calls[1] + t1 - t0, calls[2] + t2 - t1, calls[3] + t3 - t2,
                                               calls[4] + t4 - t3
      rows = rows + 1
    else
      local t0 = now()
      top_k(lg, 40)
      top_p(lg, 0.95)
      temperature(lg, 0.8)
      nexts[i] = sample(lg, rngs[i])
      direct = direct + (now() - t0)
    end
  end
end
for i = 1, n do seqs[i]:close() end
local us = function(v, c) return c > 0 and v / c * 1e6 or 0 end
print(string.format("the default policy's calls on %d rows (us a row): top_k %.2f, top_p %.2f, temperature %.2f, "
                    .. "sample %.2f; the four without __index %.2f", n, us(calls[1], rows), us(calls[2], rows),
                    us(calls[3], rows), us(calls[4], rows), us(direct, n * gen - rows)))
