-- Where a scheduler's decode steps go: n requests of a p-token prompt, each
-- making exactly g tokens with the scheduler's default policy (top-k 40,
-- top-p 0.95, temperature 0.8), run twice (the first records the step
-- shapes on a GPU backend). Once every prompt is in, it times each
-- batch:run and sorts the steps into those of all n requests and those
-- after the first requests ended (fewer rows, a shape each), noting the
-- runs in which Lua's collector ran (the heap shrank); then the scheduler's
-- own Lua time a step, and the same rows run by hand (one batch:run a step,
-- each row sampled by the same policy) for comparison. Both runs are luma
-- bench's (luma.bench: scheduled_decode, batched_decode).
--
--   luma scripts/scheduler-steps.lua [-m model] [-b backend] [-s requests] [-p tokens] [-g tokens] [-k MiB]
--
-- -m: a GGUF file (default: the default model); -b: cpu, cuda or auto
-- (default); -s: requests (default 32); -p: prompt tokens (default 128);
-- -g: tokens each makes (default 128); -k: the KV cache's MiB (default 0:
-- as luma.load's kv_mb).
local luma = require "luma"
local fetch = require "luma.fetch"
local bench = require "luma.bench"
local P = luma.policy

local opt, int = bench.script_options(arg, { b = "auto", s = "32", p = "128", g = "128", k = "0" },
  "usage: scheduler-steps.lua [-m model] [-b backend] [-s requests] [-p tokens] [-g tokens] [-k MiB]")
local n, plen, gen, kv = int("s", 1), int("p", 1), int("g", 2), int("k", 0)
local model <close> = luma.load(opt.m or fetch.default_model(), { backend = opt.b, kv_mb = kv > 0 and kv or nil })

-- batch:run, timed wherever it is called, once log is a list
local now = luma.now
local methods = getmetatable(model:batch()).__index
local run = methods.run
local log
methods.run = function(b)
  local rows, heap, t = #b, collectgarbage("count"), now()
  local out = run(b)
  if log then log[#log + 1] = { rows, now() - t, collectgarbage("count") < heap } end
  return out
end
local function start_log() log = {} end

bench.scheduled_decode(model, n, plen, gen)   -- records the step shapes
local tps, steps, lua, policy = bench.scheduled_decode(model, n, plen, gen, start_log)
local groups = { all = { 0, 0, 0, 0 }, fewer = { 0, 0, 0, 0 } }
for _, e in ipairs(log) do
  local g = groups[e[1] == n and "all" or "fewer"]
  g[1], g[2], g[3], g[4] = g[1] + 1, g[2] + e[1], g[3] + e[2], g[4] + (e[3] and 1 or 0)
end
print(string.format("%s, %s, %d requests of %d + %d tokens", model.info.name or model.info.arch, model.info.backend,
                    n, plen, gen))
print(string.format("scheduler: %.1f tokens/s; Lua a step %.1f us, its policy %.1f us (%.2f us a request)", tps,
                    lua / steps * 1e6, policy / steps * 1e6, policy / steps * 1e6 / n))
for _, k in ipairs{ "all", "fewer" } do
  local g = groups[k]
  if g[1] > 0 then
    print(string.format("  steps of %s requests: %d, %.1f rows, batch:run %.3f ms, collector in %d", k, g[1],
                        g[2] / g[1], g[3] / g[1] * 1e3, g[4]))
  end
end

-- the same rows by hand, its steps after the first timed
log = nil
local sampler = P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95 }
local hand = bench.batched_decode(model, n, plen, gen, sampler, start_log)
local tr = 0
for _, e in ipairs(log) do tr = tr + e[2] end
print(string.format("by hand: %.1f tokens/s, batch:run %.3f ms", hand, tr / #log * 1e3))
