-- luma bench: prefill and decode speed of one model on one backend.
--   prefill: one forward over a prompt of N tokens (time to first token);
--   decode: greedy tokens one at a time with C argmax, and optionally with a
--           Lua sampling chain (penalties, top-k 40, top-p 0.95, temp 0.8),
--           and the same chain through seq:sample, timed over the steps
--           after the first (reported on its own);
--           with --policy also luma generate's default sampling chain
--           (top-k 40, top-p 0.95, temp 0.8) in Lua and through seq:sample;
--           with --policy and batches, the batches again, each sequence
--           sampled by top-k 40, top-p 0.95 and temperature 0.8 (by the
--           Lua chain a row, and by one luma.draw a step), and the same
--           requests run by luma.scheduler (its default policy, then the
--           penalties chain);
--   bandwidth: weight bytes read per decoded token x tokens/s;
--   with --depth, decode (seq:greedy) after prompts of those lengths, and
--   the bandwidth counting the cache's keys and values each step reads.
local luma = require "luma"

local M = {}

local TEXT = [[The old lighthouse keeper climbed the spiral stairs every evening, counting the
steps as his father had taught him. Two hundred and twelve, never more, never less. From
the lamp room he could see the whole bay: the fishing boats returning, the gulls wheeling
over the harbour, the slow procession of clouds moving in from the west. ]]

local function peak_rss_mib()
  local f = io.open("/proc/self/status")
  if not f then return nil end
  for line in f:lines() do
    local kb = line:match("^VmHWM:%s+(%d+)")
    if kb then f:close(); return tonumber(kb) / 1024 end
  end
  f:close()
end

-- A prompt of exactly n tokens of real text.
local function prompt_ids(model, n)
  local ids = model:tokenize(TEXT, { bos = true })
  local more = model:tokenize(TEXT, { bos = false })
  while #ids < n do
    for _, id in ipairs(more) do ids[#ids + 1] = id end
  end
  for i = #ids, n + 1, -1 do ids[i] = nil end
  return ids
end

M.prompt_ids = prompt_ids

-- The options of a measuring script (scripts/): "-x value" pairs, x one of
-- defaults' keys or m (a model file); anything else raises usage. Returns
-- the options (defaults filled in) and int(name, lo), option name as an
-- integer of at least lo (raising "-name must be ..." otherwise).
function M.script_options(args, defaults, usage)
  local opt = {}
  for k, v in pairs(defaults) do opt[k] = v end
  for i = 1, #args, 2 do
    local k = args[i]:match("^%-(%a)$")
    if not k or opt[k] == nil and k ~= "m" or args[i + 1] == nil then error(usage, 0) end
    opt[k] = args[i + 1]
  end
  local function int(name, lo)
    local v = math.tointeger(tonumber(opt[name]))
    if not v or v < lo then error("-" .. name .. " must be an integer of at least " .. lo, 0) end
    return v
  end
  return opt, int
end

-- Decode and aggregate decode time their steps after the first: the first
-- step of a shape is where a GPU backend records it (a CUDA graph), a cost
-- paid once per shape, reported on its own.
local function decode(model, ids, n, policy, rng)
  local seq = model:sequence()
  local logits = seq:eval(ids)
  local state = { model = model, seq = seq, rng = rng, step = 0, prompt_len = #ids }
  local policy_time = 0
  local t0 = luma.now()
  local first = 0
  for i = 1, n do
    if i == 2 then
      first = luma.now() - t0
      t0, policy_time = luma.now(), 0
    end
    local id
    if policy then
      state.tokens = seq:tokens()
      state.step = i - 1
      local p0 = luma.now()
      id = policy(logits, state)
      policy_time = policy_time + (luma.now() - p0)
    else
      id = logits:argmax()
    end
    logits = seq:eval(id)
  end
  local dt = luma.now() - t0
  seq:close()
  return dt, policy_time, first
end

-- The same decode as one call of seq:greedy or seq:sample (method; opts:
-- its options), on a GPU each step's token chained on the device: the time
-- of its steps after the first.
local function chained_decode(model, ids, n, method, opts)
  local seq = model:sequence()
  local _, logits = seq[method](seq, seq:eval(ids), 1, opts)
  local t0 = luma.now()
  seq[method](seq, logits, n - 1, opts)
  local dt = luma.now() - t0
  seq:close()
  return dt
end

-- n new sequences of model, each prefilled with ids in one batch:run:
-- returns the batch, the sequences and each one's greedy next token.
function M.prefilled(model, n, ids)
  local seqs, last = {}, {}
  local batch = model:batch()
  for i = 1, n do
    seqs[i] = model:sequence()
    batch:add(seqs[i], ids)
  end
  local out = batch:run()
  for i = 1, n do last[i] = out[seqs[i]]:argmax() end
  return batch, seqs, last
end

-- Aggregate decode: n sequences, each prefilled with a prompt of plen
-- tokens, then gen steps where every step is one batch:run over all of
-- them, each sequence's next token its argmax, or what policy draws for it
-- (with a state and a generator of its own), or, with draw (seq:sample's
-- options), what one luma.draw a step draws for all of them. Returns
-- generated tokens per second over the decode steps after the first, and
-- the first step's seconds. timed, when given, is called as the timed
-- steps begin.
function M.batched_decode(model, n, plen, gen, policy, timed, draw)
  local batch, seqs, last = M.prefilled(model, n, prompt_ids(model, plen))
  local states, rngs, rows = {}, {}, {}
  for i = 1, n do
    rngs[i] = luma.rng(i)
    states[i] = { model = model, seq = seqs[i], rng = rngs[i], step = 0, prompt_len = plen }
  end
  local how = { out = last, release = true }
  local out
  local t0 = luma.now()
  local first
  for step = 1, gen do
    for i = 1, n do batch:add(seqs[i], last[i]) end
    out = batch:run()
    if draw then
      for i = 1, n do rows[i] = out[seqs[i]] end
      luma.draw(rows, draw, rngs, how)
    end
    for i = 1, draw and 0 or n do
      if policy then
        states[i].step = step
        last[i] = policy(out[seqs[i]], states[i])
      else
        last[i] = out[seqs[i]]:argmax()
      end
    end
    if step == 1 then
      first = luma.now() - t0
      if timed then timed() end
      t0 = luma.now()
    end
  end
  local dt = luma.now() - t0
  for i = 1, n do seqs[i]:close() end
  return n * (gen - 1) / dt, first
end

-- The best of reps runs of f (a rate and the first step's time, as
-- batched_decode returns them): the highest rate, with its run's first step.
function M.best_rate(reps, f)
  local best, first = -math.huge, nil
  for _ = 1, reps do
    local rate, f1 = f()
    if rate > best then best, first = rate, f1 end
  end
  return best, first
end

-- The same through luma.scheduler: n requests of a plen-token prompt, each
-- making exactly gen tokens with the scheduler's default policy. Prompts are
-- fed token_budget rows a step, so requests start, and end, a few at a time.
-- Returns generated tokens per second once every prompt is in (the rest of
-- the run: its steps of all n, then its last ones as requests end), and
-- over that part the scheduler's steps and its Lua and policy seconds (its
-- stats). timed, when given, is called as that part begins; overlap is the
-- scheduler's option (nil: its default); policy, every request's (nil: the
-- scheduler's default).
function M.scheduled_decode(model, n, plen, gen, timed, overlap, policy)
  local Scheduler = require "luma.scheduler"
  local ids = prompt_ids(model, plen)
  local sch = Scheduler.new(model, { prefix = false, overlap = overlap })
  for i = 1, n do sch:submit{ prompt = ids, max_tokens = gen, seed = i, stop = {}, policy = policy } end
  while sch.stats.tokens < n and sch:step() do end
  local st = sch.stats
  local tokens, steps, lua, policy = st.tokens, st.steps, st.lua_time, st.policy_time
  if timed then timed() end
  local t0 = luma.now()
  sch:run()
  local dt = luma.now() - t0
  sch:close()
  return (st.tokens - tokens) / dt, st.steps - steps, st.lua_time - lua, st.policy_time - policy
end

local function list(s)
  local t = {}
  for v in tostring(s):gmatch("[^,]+") do t[#t + 1] = assert(math.tointeger(tonumber(v)), "expected integers: " .. s) end
  return t
end

-- o: luma bench's options; load_model(o, opts) loads the model;
-- usage_error(msg) raises a mistake in the options.
function M.run(o, load_model, usage_error)
  local t0 = luma.now()
  local model, path = load_model(o, { max_rows = o["max-rows"], kv_mb = o["kv-mb"] })
  local load_s = luma.now() - t0
  local info = model.info
  local reps = math.max(1, o.reps)
  local depths = o.depth and list(o.depth) or {}
  for _, depth in ipairs(depths) do
    if depth < 1 or depth + o.gen > info.ctx then
      model:close()
      usage_error(string.format("bench: --depth %d and -n %d need a context of %d tokens, the model has %d (--ctx)",
                                depth, o.gen, depth + o.gen, info.ctx))
    end
  end
  local rows = {}
  local function row(name, value, unit) rows[#rows + 1] = { name, value, unit } end
  -- --peak-gbs: GB/s, or "copy": the backend's device-to-device copy rate
  -- (read plus written), measured here, where it has one
  local peak = o["peak-gbs"]
  if peak == "copy" then
    peak = model:copy_bandwidth()
    if not peak then
      model:close()
      usage_error("bench: --peak-gbs copy: the " .. info.backend .. " backend has no device copy to measure; " ..
                  "give the bandwidth in GB/s")
    end
    o["peak-gbs"] = math.floor(peak + 0.5)
    row("copy bandwidth (measured, read + written)", string.format("%.0f", peak), "GB/s")
  elseif peak then
    local n = tonumber(peak)
    if not n or n <= 0 then
      model:close()
      usage_error("bench: --peak-gbs expects GB/s (a positive number) or 'copy', got '" .. peak .. "'")
    end
    o["peak-gbs"] = n
  end

  -- A first pass pays one-time costs (library handles, scratch growth).
  do
    local seq = model:sequence()
    seq:eval(prompt_ids(model, 32))
    seq:close()
  end
  -- Prefill: the best of reps, for each prompt length.
  local prefill = {}
  for _, plen in ipairs(list(o.prompt)) do
    local ids = prompt_ids(model, plen)
    local best = math.huge
    for _ = 1, reps do
      local seq = model:sequence()
      local s0 = luma.now()
      seq:eval(ids)
      best = math.min(best, luma.now() - s0)
      seq:close()
    end
    prefill[#prefill + 1] = { plen, best }
  end
  -- Decode after a short prompt.
  local short = prompt_ids(model, 16)
  local dec, dec_first = math.huge, math.huge
  for _ = 1, reps do
    local d, _, f = decode(model, short, o.gen)
    dec, dec_first = math.min(dec, d), math.min(dec_first, f)
  end
  local timed = o.gen - 1
  local tps = timed / dec
  local greedy = math.huge
  if timed > 0 then
    for _ = 1, reps do greedy = math.min(greedy, chained_decode(model, short, o.gen, "greedy")) end
  end
  local gtps = timed / greedy

  row("model", (info.name or info.arch) .. " (" .. path:match("[^/]*$") .. ")", "")
  row("backend", info.backend .. (info.backend == "cpu" and (", " .. luma.simd() .. ", " ..
      (o.threads > 0 and o.threads or "all") .. " threads") or "") ..
      (info.batch_invariant and info.backend ~= "cpu" and ", batch-invariant" or "") ..
      (info.float_act and ", float activations" or ""), "")
  row("load", string.format("%.2f", load_s), "s")
  for _, pf in ipairs(prefill) do
    row("prefill " .. pf[1] .. " tokens", string.format("%.1f", pf[1] / pf[2]), "tokens/s")
    row("time to first token (" .. pf[1] .. ")", string.format("%.1f", pf[2] * 1000), "ms")
  end
  row("decode (argmax), steps 2-" .. o.gen, string.format("%.2f", tps), "tokens/s")
  row("decode time per token", string.format("%.2f", dec / timed * 1000), "ms")
  row("decode, first step", string.format("%.2f", dec_first * 1000), "ms")
  row("decode (seq:greedy), steps 2-" .. o.gen, string.format("%.2f", gtps), "tokens/s")
  row("seq:greedy time per token", string.format("%.2f", greedy / timed * 1000), "ms")
  row("weights read per token", string.format("%.1f", info.weight_bytes / 1048576), "MiB")
  row("achieved weight bandwidth", string.format("%.2f", info.weight_bytes * tps / 1e9), "GB/s")
  if o["peak-gbs"] then
    row("fraction of the bandwidth roofline", string.format("%.1f", info.weight_bytes * tps / 1e9 / o["peak-gbs"] * 100),
        "% of " .. o["peak-gbs"] .. " GB/s")
    row("the same, seq:greedy", string.format("%.1f", info.weight_bytes * gtps / 1e9 / o["peak-gbs"] * 100),
        "% of " .. o["peak-gbs"] .. " GB/s")
  end
  -- Decode after a long prompt: seq:greedy at each depth, and the bandwidth
  -- counting the cache's keys and values a step reads besides the weights.
  for _, depth in ipairs(depths) do
    local ids = prompt_ids(model, depth)
    local best = math.huge
    for _ = 1, reps do best = math.min(best, chained_decode(model, ids, o.gen, "greedy")) end
    local per = best / timed
    -- the cache a timed step reads: step i (2..gen) sees depth + i keys,
    -- the window's at most in the sliding layers
    local swa, window, kv = info.swa_layers, info.sliding_window, 0
    for i = 2, o.gen do
      local keys = depth + i
      kv = kv + info.kv_token_bytes * ((info.layers - swa) * keys + swa * math.min(keys, window > 0 and window or keys))
    end
    kv = kv / timed
    row(string.format("decode at depth %d (seq:greedy)", depth), string.format("%.2f", 1 / per), "tokens/s")
    row(string.format("time per token at depth %d", depth), string.format("%.2f", per * 1000), "ms")
    row(string.format("weights + KV read per token at %d", depth),
        string.format("%.1f + %.1f", info.weight_bytes / 1048576, kv / 1048576), "MiB")
    row(string.format("achieved bandwidth at depth %d", depth),
        string.format("%.2f", (info.weight_bytes + kv) / per / 1e9) ..
        (o["peak-gbs"] and string.format(" (%.1f%%)", (info.weight_bytes + kv) / per / 1e9 / o["peak-gbs"] * 100) or ""),
        "GB/s" .. (o["peak-gbs"] and " (% of " .. o["peak-gbs"] .. ")" or ""))
  end
  if o.batch then
    for _, n in ipairs(list(o.batch)) do
      local tps_n, first = M.best_rate(reps, function() return M.batched_decode(model, n, o["batch-prompt"], o.gen) end)
      row(string.format("aggregate decode, %d seqs (%d+%d)", n, o["batch-prompt"], o.gen),
          string.format("%.1f", tps_n), "tokens/s")
      row(string.format("aggregate decode, %d seqs, first step", n), string.format("%.2f", first * 1000), "ms")
    end
  end
  if o.policy then
    local P = require "luma.policy"
    local chain = P.chain{ P.penalties{ repeat_ = 1.1, last_n = 64 }, P.top_k(40), P.top_p(0.95), P.temperature(0.8) }
    local pdec, ptime = math.huge, 0
    for _ = 1, reps do
      local d, p = decode(model, short, o.gen, chain, luma.rng(1))
      if d < pdec then pdec, ptime = d, p end
    end
    row("decode with Lua policy chain", string.format("%.2f", timed / pdec), "tokens/s")
    row("Lua policy cost per token", string.format("%.1f", ptime / timed * 1e6), "us")
    row("Lua policy share of decode", string.format("%.1f", ptime / pdec * 100), "%")
    -- the same chain, penalties included, through seq:sample
    local pchained = math.huge
    for _ = 1, timed > 0 and reps or 0 do
      local so = P.sampler(chain)
      so.rng = luma.rng(1)
      pchained = math.min(pchained, chained_decode(model, short, o.gen, "sample", so))
    end
    row("the same chain (seq:sample)", string.format("%.2f", timed / pchained), "tokens/s")
    -- luma generate's default chain, in Lua and through seq:sample
    local default = P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95 }
    local sdec, cdec = math.huge, math.huge
    if timed > 0 then
      for _ = 1, reps do
        sdec = math.min(sdec, (decode(model, short, o.gen, default, luma.rng(1))))
        local so = P.sampler(default)
        so.rng = luma.rng(1)
        cdec = math.min(cdec, chained_decode(model, short, o.gen, "sample", so))
      end
    end
    row("decode, sampled by a Lua policy", string.format("%.2f", timed / sdec), "tokens/s")
    row("decode, sampled (seq:sample)", string.format("%.2f", timed / cdec), "tokens/s")
    -- Batches sampled by that default chain (the scheduler's default policy).
    if o.batch then
      for _, n in ipairs(list(o.batch)) do
        local plen = o["batch-prompt"]
        local tps_n = M.best_rate(reps, function() return M.batched_decode(model, n, plen, o.gen, default) end)
        row(string.format("aggregate decode, %d seqs, sampled", n), string.format("%.1f", tps_n), "tokens/s")
        tps_n = M.best_rate(reps, function()
          return M.batched_decode(model, n, plen, o.gen, nil, nil, P.sampler(default))
        end)
        row(string.format("aggregate decode, %d seqs, luma.draw", n), string.format("%.1f", tps_n), "tokens/s")
      end
      -- and as a scheduler runs them (twice: the first records its shapes)
      for _, n in ipairs(list(o.batch)) do
        M.scheduled_decode(model, n, o["batch-prompt"], o.gen)
        local tps_n = M.scheduled_decode(model, n, o["batch-prompt"], o.gen)
        row(string.format("scheduler, %d requests (%d+%d)", n, o["batch-prompt"], o.gen), string.format("%.1f", tps_n),
            "tokens/s")
        -- the same with the penalties of the Lua policy chain above
        tps_n = M.scheduled_decode(model, n, o["batch-prompt"], o.gen, nil, nil, chain)
        row(string.format("scheduler, %d requests, penalties", n), string.format("%.1f", tps_n), "tokens/s")
      end
    end
  end
  local rss = peak_rss_mib()
  if rss then row("peak memory (RSS)", string.format("%.0f", rss), "MiB") end

  print(string.format("%-36s %-28s %s", "measure", "value", "unit"))
  for _, r in ipairs(rows) do print(string.format("%-36s %-28s %s", r[1], r[2], r[3])) end
  model:close()
  return 0
end

return M
