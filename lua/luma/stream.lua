-- luma.stream(model, prompt, opts): an iterator over (piece, id) of a
-- generation. Nothing runs between iterations: each call evaluates one token,
-- so the loop can pause, run in a coroutine, or stop early (breaking out of a
-- generic for closes the sequence it made).
--
-- opts: policy (default: sampling with temp 0.8, top-k 40, top-p 0.95),
--       stop (list of conditions; default { S.eog() }), max_tokens (256),
--       seed, special (parse special tokens in the prompt, default true),
--       seq (continue this sequence instead of making a new one),
--       on_token(piece, id, state), stats (a table filled in place).
-- A prompt text on a fresh sequence gets the BOS token first, unless special
-- tokens are parsed and it already begins with it (luma.chat.format's text).
--
-- luma.stream.run(model, prompt, opts, emit) runs a generation to its end,
-- calling emit(piece, id) where the iterator would yield. With the policy
-- P.greedy() it decodes through seq:greedy, and with a sampling chain
-- that seq:sample can run (P.sampler: the default policy is one) through
-- seq:sample: each step's token is taken where the logits
-- are (on a GPU, the next step is queued before the host reads it), the
-- same tokens and text as the iterator's (a draw on a GPU: but where the
-- device's exp or log, a last bit off the host's, moves a sum across a
-- boundary). Then emit, on_token and the stop conditions run while the
-- model is busy (they may not use its sequences, batches or device
-- logits), and a generation that reaches the end of the context stops
-- there ("ctx") instead of failing.
local luma = require "luma"
local P = require "luma.policy"
local T = require "luma.text"

-- The generation's state: options checked, the prompt's ids, the emitter.
local function setup(model, prompt, opts, level)
  opts = opts or {}
  if type(opts) ~= "table" then error("stream: opts must be a table", level) end
  local policy = opts.policy or P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95 }
  if type(policy) ~= "function" then error("stream: policy must be a function (logits, state) -> id", level) end
  local stops = T.stops(opts.stop, "stream")
  local max_tokens = opts.max_tokens or 256
  if math.type(max_tokens) ~= "integer" or max_tokens < 0 then
    error("stream: max_tokens must be a non-negative integer", level)
  end
  local seq = opts.seq
  local ids
  if type(prompt) == "string" then
    local fresh = seq == nil or seq:len() == 0
    ids = T.tokenize(model, prompt, fresh, opts.special ~= false)
  elseif type(prompt) == "table" then
    ids = prompt
  else
    error("stream: prompt must be a string or a list of token ids", level)
  end
  if #ids == 0 then error("stream: the prompt has no tokens", level) end

  local stats = opts.stats or {}
  stats.prompt_tokens, stats.tokens = #ids, 0
  stats.stop, stats.ttft, stats.time, stats.tokens_per_s = nil, nil, nil, nil
  return {
    model = model, opts = opts, policy = policy, ids = ids, seq = seq, own_seq = seq == nil,
    stats = stats, out = T.emitter(stops, max_tokens), max_tokens = max_tokens, done = false,
    state = { model = model, rng = luma.rng(opts.seed or os.time()), step = 0, prompt_len = #ids },
    t0 = luma.now(),
  }
end

local function finish(g, reason)
  g.done = true
  local stats = g.stats
  stats.stop = stats.stop or reason
  stats.time = luma.now() - g.t0
  local decode = stats.time - (stats.ttft or 0)
  stats.tokens_per_s = stats.tokens > 1 and decode > 0 and (stats.tokens - 1) / decode or nil
  if g.own_seq and g.seq and not g.busy then g.seq:close() end
end

-- The sequence, made at the first step, and the prompt's logits.
local function prefill(g)
  g.seq = g.seq or g.model:sequence()
  g.state.seq = g.seq
  local logits = g.seq:eval(g.ids)
  g.stats.ttft = luma.now() - g.t0
  return logits
end

-- Token id was chosen: counts it, asks the emitter, calls on_token. Returns
-- the piece to yield (nil: none) and whether the generation stops.
local function took(g, id, limit)
  local state = g.state
  state.id = id
  g.stats.tokens = g.stats.tokens + 1
  local piece, stop = g.out:push(state, limit)
  if stop then finish(g, stop) end
  if piece ~= nil and g.opts.on_token then g.opts.on_token(piece, id, state) end
  return piece, stop ~= nil
end

-- The iterator over a generation set up.
local function iterate(g)
  local policy, state, last_id = g.policy, g.state, nil

  local function step()
    if g.done then return nil end
    local before = last_id == nil and g.out:stop_before()
    if before then
      finish(g, before)
      return nil
    end
    local logits = last_id == nil and prefill(g) or g.seq:eval(last_id)
    state.tokens = g.seq:tokens()
    local id = policy(logits, state)
    if math.type(id) ~= "integer" or id < 0 or id >= #logits then
      finish(g, "error")
      error("policy returned " .. tostring(id) .. ", not a token id", 0)
    end
    last_id = id
    local piece = took(g, id)
    if piece == nil then return nil end
    return piece, id
  end

  local closer = setmetatable({}, { __close = function() if not g.done then finish(g, "cancelled") end end })
  return function()
    local ok, a, b = pcall(step)
    if not ok then
      if not g.done then finish(g, "error") end
      error(a, 0)
    end
    return a, b
  end, nil, nil, closer
end

local function stream(model, prompt, opts)
  return iterate(setup(model, prompt, opts, 3))
end

-- The whole generation through seq:greedy (smp nil) or seq:sample (smp:
-- its options).
local function run_chained(g, emit, smp)
  local before = g.out:stop_before()
  if before then return finish(g, before) end
  local logits = prefill(g)
  local seq, state = g.seq, g.state
  local room = g.model.info.ctx - seq:len()
  local n = math.min(g.max_tokens, room)
  g.busy = true   -- finish leaves the sequence to run to close
  local o = smp or {}
  o.on_token = function(id)
    state.tokens = seq:tokens()
    local piece, stop = took(g, id, state.step + 1 >= n and "ctx" or nil)
    if piece ~= nil then emit(piece, id) end
    return stop
  end
  if smp then
    o.rng = state.rng
    seq:sample(logits, n, o)
  else
    seq:greedy(logits, n, o)
  end
end

local function run(model, prompt, opts, emit)
  if type(emit) ~= "function" then error("stream.run: emit must be a function (piece, id)", 2) end
  local g = setup(model, prompt, opts, 3)
  local smp = P.sampler(g.policy)
  if not smp and not P.is_greedy(g.policy) then
    for piece, id in iterate(g) do emit(piece, id) end
    return
  end
  local ok, e = pcall(run_chained, g, emit, smp)
  g.busy = false
  if not g.done then finish(g, ok and "ctx" or "error") end   -- ok: no room for a token
  if g.own_seq and g.seq then g.seq:close() end
  if not ok then error(e, 0) end
end

return setmetatable({ run = run }, { __call = function(_, ...) return stream(...) end })
