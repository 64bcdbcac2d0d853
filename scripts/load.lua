-- A synthetic load: many requests with random prompt and output lengths
-- (seeded, so every run asks the same), served by the scheduler at several
-- concurrency levels and, for comparison, one after another.
--
--   luma scripts/load.lua [--requests 16] [--concurrency 1,4,16] [--prompt 16-48]
--                         [--output 16-48] [--seed 1] [--budget ROWS] [--ctx 1024]
--                         [--kv-mb 128] [--no-sequential]
--
-- Per row: wall time, generated tokens per second over all requests, the
-- speedup over the sequential run, time to first token and time per output
-- token (p50/p90/p99, in ms, measured from submission), and the scheduler's
-- own Lua time per step (everything in step() but batch:run and the
-- policies), then the same with the policies.
local luma = require "luma"
local Scheduler = require "luma.scheduler"
local P = luma.policy

local o = { requests = "16", concurrency = "1,4,16", prompt = "16-48", output = "16-48", seed = "1",
            ctx = "1024", ["kv-mb"] = "128" }
local i = 1
while i <= #arg do
  local k = arg[i]:match("^%-%-([%w%-]+)$")
  if k == "no-sequential" then
    o[k] = true
  elseif k and o[k] ~= nil or k == "budget" then
    o[k], i = arg[i + 1], i + 1
  else
    error("load.lua: unknown argument " .. arg[i] .. " (see the comment at the top of the script)", 0)
  end
  i = i + 1
end

local function int(s) return math.tointeger(tonumber(s)) or error("load.lua: not an integer: " .. tostring(s), 0) end
local function range(s)
  local a, b = s:match("^(%d+)%-(%d+)$")
  if a then return int(a), int(b) end
  return int(s), int(s)
end

local model <close> = luma.load(require("luma.fetch").default_model(),
                                { ctx = int(o.ctx), kv_mb = int(o["kv-mb"]) })

-- Prompts of random token ids drawn from ordinary text (no shared prefixes
-- beyond the first token), with exact lengths.
local rng = luma.rng(int(o.seed))
local pool = model:tokenize("The old lighthouse keeper climbed the stairs every evening, counting the steps " ..
                            "and listening to the waves, while ships passed far out at sea carrying grain, " ..
                            "letters, and travellers who never knew his name.", { bos = false })
local p_lo, p_hi = range(o.prompt)
local n_lo, n_hi = range(o.output)
local requests = {}
for r = 1, int(o.requests) do
  local ids = { model.bos }
  for k = 2, rng:random(p_lo, p_hi) do ids[k] = pool[rng:random(1, #pool)] end
  requests[r] = { ids = ids, max_tokens = rng:random(n_lo, n_hi) }
end

-- Nearest-rank percentile of a list of seconds, in milliseconds.
local function pct(list, p)
  local s = { table.unpack(list) }
  table.sort(s)
  if #s == 0 then return 0 end
  return 1000 * s[math.max(1, math.ceil(p / 100 * #s))]
end

-- st: the scheduler's stats, for its Lua time per step without and with
-- the policies (greedy: one argmax per request).
local function row(name, time, tokens, base, ttft, tpot, st)
  local lua = "-"
  if st then
    lua = string.format("%.3f / %.3f", 1000 * (st.lua_time - st.policy_time) / st.steps,
                        1000 * st.lua_time / st.steps)
  end
  print(string.format("%-12s %7.2f %9.1f %8s   %6.0f %6.0f %6.0f   %6.1f %6.1f %6.1f   %s",
                      name, time, tokens / time, base and string.format("%.2fx", base / time) or "-",
                      pct(ttft, 50), pct(ttft, 90), pct(ttft, 99), pct(tpot, 50), pct(tpot, 90), pct(tpot, 99), lua))
end

-- wait: seconds between the common start and the request's own submission.
local function collect(stats, ttft, tpot, wait)
  ttft[#ttft + 1] = (wait or 0) + stats.ttft
  if stats.tokens > 1 then tpot[#tpot + 1] = (stats.time - stats.ttft) / (stats.tokens - 1) end
  return stats.tokens
end

print(string.format("%d requests, prompts %s tokens, outputs %s tokens, seed %s; %s, %s",
                    #requests, o.prompt, o.output, o.seed, model.info.name or model.info.arch, model.info.backend))
print(string.format("%-12s %7s %9s %8s   %20s   %20s   %s", "run", "time s", "tokens/s", "speedup",
                    "ttft ms p50/p90/p99", "tpot ms p50/p90/p99", "Lua ms/step (+policy)"))

-- One after another. Every request arrives at the start, as in the batched
-- runs, so its time to first token includes the wait for those before it.
local base
if not o["no-sequential"] then
  local ttft, tpot, tokens = {}, {}, 0
  local t0 = luma.now()
  for _, r in ipairs(requests) do
    local wait = luma.now() - t0
    local _, stats = luma.generate(model, r.ids, { policy = P.greedy(), max_tokens = r.max_tokens, stop = {} })
    tokens = tokens + collect(stats, ttft, tpot, wait)
  end
  base = luma.now() - t0
  row("sequential", base, tokens, nil, ttft, tpot)
end

for level in o.concurrency:gmatch("%d+") do
  local c = int(level)
  local sch = Scheduler.new(model, { max_seqs = c, token_budget = o.budget and int(o.budget) })
  local ttft, tpot, tokens = {}, {}, 0
  local function on_done(_, _, stats) tokens = tokens + collect(stats, ttft, tpot) end
  local t0 = luma.now()
  for _, r in ipairs(requests) do
    sch:submit{ prompt = r.ids, policy = P.greedy(), max_tokens = r.max_tokens, stop = {}, on_done = on_done }
  end
  sch:run()
  local time = luma.now() - t0
  local st = sch.stats
  row("batch " .. c, time, tokens, base, ttft, tpot, st)
  if st.preemptions > 0 then print(string.format("  (%d preemptions after %d full KV caches)", st.preemptions, st.kv_full)) end
  sch:close()
end
