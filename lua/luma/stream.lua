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
local luma = require "luma"
local P = require "luma.policy"
local T = require "luma.text"

local function stream(model, prompt, opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("stream: opts must be a table", 2) end
  local policy = opts.policy or P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95 }
  if type(policy) ~= "function" then error("stream: policy must be a function (logits, state) -> id", 2) end
  local stops = T.stops(opts.stop, "stream")
  local max_tokens = opts.max_tokens or 256
  if math.type(max_tokens) ~= "integer" or max_tokens < 0 then
    error("stream: max_tokens must be a non-negative integer", 2)
  end
  local seq = opts.seq
  local own_seq = seq == nil
  local ids
  if type(prompt) == "string" then
    local fresh = seq == nil or seq:len() == 0
    ids = T.tokenize(model, prompt, fresh, opts.special ~= false)
  elseif type(prompt) == "table" then
    ids = prompt
  else
    error("stream: prompt must be a string or a list of token ids", 2)
  end
  if #ids == 0 then error("stream: the prompt has no tokens", 2) end

  local stats = opts.stats or {}
  stats.prompt_tokens, stats.tokens = #ids, 0
  stats.stop, stats.ttft, stats.time, stats.tokens_per_s = nil, nil, nil, nil
  local state = { model = model, rng = luma.rng(opts.seed or os.time()), step = 0,
                  prompt_len = #ids }
  local out = T.emitter(stops, max_tokens)
  local done, last_id = false, nil
  local t0 = luma.now()

  local function finish(reason)
    done = true
    stats.stop = stats.stop or reason
    stats.time = luma.now() - t0
    local decode = stats.time - (stats.ttft or 0)
    stats.tokens_per_s = stats.tokens > 1 and decode > 0 and (stats.tokens - 1) / decode or nil
    if own_seq and seq then seq:close() end
  end

  local function step()
    if done then return nil end
    local before = last_id == nil and out:stop_before()
    if before then
      finish(before)
      return nil
    end
    local logits
    seq = seq or model:sequence()
    state.seq = seq
    if last_id == nil then
      logits = seq:eval(ids)
      stats.ttft = luma.now() - t0
    else
      logits = seq:eval(last_id)
    end
    state.tokens = seq:tokens()
    local id = policy(logits, state)
    if math.type(id) ~= "integer" or id < 0 or id >= #logits then
      finish("error")
      error("policy returned " .. tostring(id) .. ", not a token id", 0)
    end
    last_id = id
    state.id = id
    stats.tokens = stats.tokens + 1
    local piece, stop = out:push(state)
    if stop then finish(stop) end
    if piece == nil then return nil end
    if opts.on_token then opts.on_token(piece, id, state) end
    return piece, id
  end

  local closer = setmetatable({}, { __close = function() if not done then finish("cancelled") end end })
  return function()
    local ok, a, b = pcall(step)
    if not ok then
      if not done then finish("error") end
      error(a, 0)
    end
    return a, b
  end, nil, nil, closer
end

return stream
