-- Policies choose the next token. A policy is a function (logits, state) -> id;
-- a transform is a function (logits, state) that edits logits in place and
-- returns nothing. The library's own are built exactly like a user's.
--
-- state: { model, seq, tokens (prompt and generated ids), step (0-based),
--          rng, prompt_len }
local P = {}

local function check_number(name, v, lo, hi)
  if type(v) ~= "number" or v ~= v or v < lo or v > hi then
    error(string.format("%s: expected a number in [%g, %g], got %s", name, lo, hi, tostring(v)), 3)
  end
end

-- the functions P.greedy made (weak keys)
local greedy_fns = setmetatable({}, { __mode = "k" })

function P.greedy()
  local f = function(logits) return logits:argmax() end
  greedy_fns[f] = true
  return f
end

-- Whether f is a policy made by P.greedy(): luma.generate then decodes
-- through seq:greedy, taking each token where the logits are.
function P.is_greedy(f)
  return greedy_fns[f] == true
end

function P.sample()
  return function(logits, state) return logits:sample(state.rng) end
end

-- the transforms below that seq:sample can run (weak keys): { option, value }
local steps = setmetatable({}, { __mode = "k" })

local function step(f, option, value)
  steps[f] = { option, value }
  return f
end

function P.temperature(t)
  check_number("temperature", t, 0, math.huge)
  local f = function(logits) logits:temperature(t) end
  return t > 0 and t <= 3.4e38 and step(f, "temp", t) or f
end

function P.top_k(k)
  if math.type(k) ~= "integer" or k < 1 then error("top_k: expected a positive integer", 2) end
  return step(function(logits) logits:top_k(k) end, "top_k", k)
end

function P.top_p(p, min_keep)
  check_number("top_p", p, 0, 1)
  local f = function(logits) logits:top_p(p, min_keep or 1) end
  return (min_keep or 1) == 1 and p > 0 and step(f, "top_p", p) or f
end

function P.min_p(p, min_keep)
  check_number("min_p", p, 0, 1)
  local f = function(logits) logits:min_p(p, min_keep or 1) end
  return (min_keep or 1) == 1 and p > 0 and step(f, "min_p", p) or f
end

function P.typical(p, min_keep)
  check_number("typical", p, 0, 1)
  return function(logits) logits:typical(p, min_keep or 1) end
end

-- P.penalties{ repeat_ = 1.1, frequency = 0, presence = 0, last_n = 64 }
function P.penalties(o)
  o = o or {}
  local opts = { repeat_ = o.repeat_ or 1.0, frequency = o.frequency or 0.0,
                 presence = o.presence or 0.0, last_n = o.last_n or 64 }
  local f = function(logits, state) logits:penalize(state.tokens, opts) end
  -- seq:sample's window is 1 to 256 ids
  local w = opts.last_n
  if math.type(w) == "integer" and w >= 1 and w <= 256 then steps[f] = { "penalties", opts } end
  return f
end

-- P.bias{ [id] = value, ... }: -math.huge bans a token
function P.bias(tbl)
  if type(tbl) ~= "table" then error("bias: expected a table {[id] = value}", 2) end
  return function(logits) logits:bias(tbl) end
end

-- the chains that seq:sample can run (weak keys): their options
local samplers = setmetatable({}, { __mode = "k" })

-- seq:sample's options for a chain of list, or nil: P.penalties{...}
-- (optional, last_n 1 to 256), then P.top_k(k) with k in [1, 64], then
-- P.top_p(p), then P.min_p(p) (each optional, min_keep 1), then
-- P.temperature(t) with t > 0, and nothing else.
local function sampler_of(list)
  local o, i = {}, 1
  local s = steps[list[1]]
  if s and s[1] == "penalties" then
    for k, v in pairs(s[2]) do o[k] = v end
    i = 2
  end
  for _, option in ipairs{ "top_k", "top_p", "min_p", "temp" } do
    local s = steps[list[i]]
    if s and s[1] == option then
      o[option] = s[2]
      i = i + 1
    end
  end
  if i ~= #list + 1 or not o.top_k or o.top_k > 64 or not o.temp then return nil end
  return o
end

-- P.chain{ t1, t2, ..., [chooser] }: runs each function in order; the first
-- that returns a token id ends the chain. Without one, it samples.
function P.chain(list)
  if type(list) ~= "table" then error("chain: expected a list of functions", 2) end
  for i, f in ipairs(list) do
    if type(f) ~= "function" then error("chain: element " .. i .. " is not a function", 2) end
  end
  local n = #list
  local f = function(logits, state)
    for i = 1, n do
      local id = list[i](logits, state)
      if id ~= nil then return id end
    end
    return logits:sample(state.rng)
  end
  samplers[f] = sampler_of(list)
  return f
end

-- Mirostat 2.0 (Basu et al. 2021): keeps the surprise of sampled tokens
-- near tau by truncating tokens more surprising than mu, then moving mu.
-- P.mirostat{ tau = 5.0, eta = 0.1 }
function P.mirostat(o)
  o = o or {}
  local tau, eta = o.tau or 5.0, o.eta or 0.1
  check_number("mirostat tau", tau, 0, math.huge)
  check_number("mirostat eta", eta, 0, math.huge)
  local mu = 2 * tau
  local ln2 = math.log(2)
  return function(logits, state)
    if state.step == 0 then mu = 2 * tau end
    logits:log_softmax()
    local best = logits:argmax()
    -- Keep tokens whose surprise -log2 p is at most mu: p >= 2^-mu.
    local rel = 2 ^ -mu / math.exp(logits[best])
    if rel < 1 then logits:min_p(rel) else logits:top_k(1) end
    logits:log_softmax()
    local id = logits:sample(state.rng)
    local surprise = -logits[id] / ln2
    mu = mu - eta * (surprise - tau)
    return id
  end
end

-- The usual sampling chain from plain options (used by luma generate):
-- { temp = 0.8, top_k = 40, top_p = 0.95, min_p = 0.05, repeat_ = 1.1 }.
-- temp = 0 is greedy.
function P.from_options(o)
  o = o or {}
  if o.temp == 0 then return P.greedy() end
  local list = {}
  if o.repeat_ and o.repeat_ ~= 1 then list[#list + 1] = P.penalties{ repeat_ = o.repeat_, last_n = o.last_n } end
  if o.top_k and o.top_k > 0 then list[#list + 1] = P.top_k(o.top_k) end
  if o.top_p and o.top_p < 1 then list[#list + 1] = P.top_p(o.top_p) end
  if o.min_p and o.min_p > 0 then list[#list + 1] = P.min_p(o.min_p) end
  list[#list + 1] = P.temperature(o.temp or 0.8)
  return P.chain(list)
end

-- The options of seq:sample (a new table: top_k, top_p, min_p, temp, and
-- repeat_, frequency, presence, last_n where the chain penalizes) that
-- draw what f draws, where f is a chain that P.chain made of optionally
-- P.penalties{...} (last_n 1 to 256), then P.top_k(k) (k in [1, 64]),
-- then optionally P.top_p(p) and P.min_p(p) (min_keep 1), then
-- P.temperature(t) (t > 0), and nothing else: P.from_options' chains are
-- such. nil for any other function. luma.generate then decodes through
-- seq:sample.
function P.sampler(f)
  local o = samplers[f]
  if not o then return nil end
  return { top_k = o.top_k, top_p = o.top_p, min_p = o.min_p, temp = o.temp,
           repeat_ = o.repeat_, frequency = o.frequency, presence = o.presence, last_n = o.last_n }
end

return P
