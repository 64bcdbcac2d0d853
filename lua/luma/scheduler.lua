-- Continuous batching: many generations share every forward pass.
--
--   local Scheduler = require "luma.scheduler"
--   local sch = Scheduler.new(model, { token_budget = 256 })
--   local h = sch:submit{ prompt = "Once upon a time", max_tokens = 64,
--                         on_token = function(piece, id, req) io.write(piece) end,
--                         on_done = function(req, text, stats) end }
--   sch:run()                      -- or sch:step() until it returns false
--   h.status                       -- "waiting", "running" or "done"
--   h.text, h.stats                -- the text streamed so far; stats once done
--   h.ids, h.prompt_len            -- prompt and generated token ids
--   h:cancel()
--
-- A request: prompt (string or ids), policy, stop, max_tokens, seed, special
-- (as in luma.stream), priority (higher first, default 0), on_token(piece,
-- id, req), on_done(req, text, stats). stats: prompt_tokens, tokens, stop,
-- ttft and time (seconds since submit), tokens_per_s, cached_tokens (taken
-- from the prefix cache), preemptions, error.
--
-- One step: retire cancelled requests, admit waiting ones, then pack one row
-- for every running request that decodes and fill the rest of the token
-- budget with prompt chunks, run it as one batch, and let each request whose
-- tokens are all in its sequence choose its next token. A request's `ids` are
-- its prompt and the tokens it generated; `n_done` of them are in its
-- sequence. Prefill, decode and recomputation after preemption are therefore
-- the same thing: feeding ids[n_done + 1 ..] to the sequence.
--
-- A chosen token is streamed (its text, the stop conditions, on_token) while
-- the device computes the next step, in batch:run's during: the host's text
-- work overlaps the device's. The token's row goes into that step unless its
-- count or the context already ends the request; a stop condition that ends
-- it there makes that one row wasted work, never a different output. While
-- the step is in flight, on_token and the stop conditions may not use the
-- model's sequences, batches or device logits (an error says so and ends the
-- request); opts.overlap = false streams each token right after its choice,
-- between steps, instead.
--
-- Admission asks the KV cache for its free blocks (model:kv_free()): they
-- must cover the newcomer's ids and its first new token, plus, for each
-- running request, the blocks its ids not yet in its sequence need, and at
-- least one to grow into. In the sliding-window pool (the second, Gemma 3) a
-- sequence holds at most the window, the positions kept for rewinds
-- (luma.load's rewind) and one step's rows: older blocks are released as it
-- grows. Cached prefixes standing in the way are evicted,
-- least recently used first.
--
-- When a step still finds the KV cache full (requests grow after they were
-- admitted), it is retried after the prefix cache evicts an entry or, once
-- it is empty, after a running request is preempted: its sequence is closed
-- and it waits again with all its ids, to be recomputed later. Its stream
-- goes on where it was; no token is lost.
--
-- Every decision is a replaceable function of opts:
--   order(a, b)       waiting requests in admission order (default: priority, then arrival)
--   admit(sch, req)   whether the head of the queue may start now; asked only while
--                     something runs, so the queue always moves (default: fewer
--                     than max_seqs run and sch:kv_room(req))
--   budget(sch)       rows of this step (default token_budget)
--   victim(sch, running) the request to preempt (default: lowest priority, latest arrival)
-- Other opts: token_budget (default model.info.max_rows), max_seqs (default
-- token_budget), prefix (a luma.prefix cache, or false for none; default a
-- new one), overlap (default true: above).
--
-- An error inside a request's policy, stop condition or on_token ends that
-- request (stop "error", the message in stats.error); the others go on. An
-- error inside on_done is raised by step() once every request is settled.
local luma = require "luma"
local P = require "luma.policy"
local T = require "luma.text"
local Prefix = require "luma.prefix"

-- The policy of a request that names none (its chain keeps no state).
local default_policy = P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95 }
-- luma.draw's options of a policy: P.sampler's, false where it has none;
-- one table a policy, so that a step's draws share their options.
local samplers = setmetatable({}, { __mode = "k" })
local function sampler_of(policy)
  local o = samplers[policy]
  if o == nil then
    o = P.sampler(policy) or false
    samplers[policy] = o
  end
  return o
end

local Scheduler = {}
Scheduler.__index = Scheduler

local Request = {}
-- h.text of a request still running is its emitter's shown text, joined when
-- read (retire sets the final one); every other field a request reads each
-- step is set (false where unset) so that finding it never comes here.
function Request.__index(req, k)
  if k == "text" then return rawget(req, "out"):shown() end
  return Request[k]
end

local function by_priority(a, b)
  if a.priority ~= b.priority then return a.priority > b.priority end
  return a.id < b.id
end

local function admit_by_memory(sch, req)
  return #sch.running < sch.max_seqs and sch:kv_room(req)
end

local function fixed_budget(sch)
  return sch.token_budget
end

-- The request whose loss costs least: lowest priority, then the latest.
local function latest_lowest(_, running)
  local v = running[1]
  for _, r in ipairs(running) do
    if r.priority < v.priority or (r.priority == v.priority and r.id > v.id) then v = r end
  end
  return v
end

local function positive_integer(name, v)
  if math.type(v) ~= "integer" or v < 1 then
    error("scheduler: " .. name .. " must be a positive integer, got " .. tostring(v), 3)
  end
end

function Scheduler.new(model, opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("scheduler: opts must be a table", 2) end
  local token_budget = opts.token_budget or model.info.max_rows
  positive_integer("token_budget", token_budget)
  local max_seqs = opts.max_seqs or token_budget
  positive_integer("max_seqs", max_seqs)
  for _, k in ipairs{ "order", "admit", "budget", "victim" } do
    if opts[k] ~= nil and type(opts[k]) ~= "function" then error("scheduler: " .. k .. " must be a function", 2) end
  end
  if opts.overlap ~= nil and type(opts.overlap) ~= "boolean" then error("scheduler: overlap must be a boolean", 2) end
  local prefix = opts.prefix
  if prefix == nil or prefix == true then prefix = Prefix.new(model) end
  local free, block = model:kv_free()
  -- A second pool holds the sliding-window layers. (A model whose every
  -- layer slides has one pool, counted here as a full one: too many blocks,
  -- never too few.)
  local window = {}
  for p = 1, #free do window[p] = p == 2 and model.info.sliding_window or 0 end
  local sch = setmetatable({
    model = model,
    ctx = model.info.ctx,
    block = block,
    window = window,
    batch = model:batch(),
    token_budget = token_budget,
    max_seqs = max_seqs,
    prefix = prefix or nil,
    order = opts.order or by_priority,
    admit = opts.admit or admit_by_memory,
    budget = opts.budget or fixed_budget,
    victim = opts.victim or latest_lowest,
    waiting = {},
    running = {},
    finished = {},       -- retired in this step, waiting for on_done
    overlap = opts.overlap ~= false,
    pending = {},        -- requests whose chosen token is not streamed yet
    spare = {},          -- the other pending list (they take turns)
    stopped = {},        -- requests whose streamed token ended them, to retire
    count = 0,
    -- lua_time: all of step() but batch:run (run_time); policy_time is part
    -- of it. emit_time: the streaming, inside batch:run with overlap (then
    -- part of run_time), else part of lua_time.
    stats = { steps = 0, rows = 0, tokens = 0, lua_time = 0, run_time = 0, policy_time = 0, emit_time = 0,
              kv_full = 0, evictions = 0, preemptions = 0 },
  }, Scheduler)
  sch.emit_all = function() sch:emit() end
  return sch
end

-- sch:submit(request) -> handle (the request, with status, text, ids, stats).
function Scheduler:submit(r)
  if type(r) ~= "table" then error("submit: expected a request table", 2) end
  local ids
  if type(r.prompt) == "string" then
    ids = T.tokenize(self.model, r.prompt, true, r.special ~= false)
  elseif type(r.prompt) == "table" then
    ids = table.move(r.prompt, 1, #r.prompt, 1, {})
  else
    error("submit: prompt must be a string or a list of token ids", 2)
  end
  if #ids == 0 then error("submit: the prompt has no tokens", 2) end
  if #ids > self.ctx then
    error(string.format("submit: the prompt has %d tokens, more than the context of %d", #ids, self.ctx), 2)
  end
  local policy = r.policy or default_policy
  if type(policy) ~= "function" then error("submit: policy must be a function (logits, state) -> id", 2) end
  local max_tokens = r.max_tokens or 256
  if math.type(max_tokens) ~= "integer" or max_tokens < 0 then
    error("submit: max_tokens must be a non-negative integer", 2)
  end
  local priority = r.priority or 0
  if type(priority) ~= "number" then error("submit: priority must be a number", 2) end
  self.count = self.count + 1
  local req = setmetatable({
    sch = self, id = self.count, priority = priority, status = "waiting",
    ids = ids, prompt_len = #ids, n_done = 0, seq = nil,
    policy = policy, sampler = sampler_of(policy), out = T.emitter(T.stops(r.stop, "submit"), max_tokens),
    on_token = r.on_token or false, on_done = r.on_done or false,
    -- next: the chosen token not yet streamed (then in no list of ids);
    -- last: it ends the request; ending, ending_err: the stop it met
    next = false, last = false, ending = false, ending_err = false,
    cached_tokens = 0, preemptions = 0, cancelled = false, prefix_done = false,
    t_submit = luma.now(), t_first = false,
  }, Request)
  req.state = { model = self.model, rng = luma.rng(r.seed or os.time() + self.count), step = 0,
                prompt_len = #ids, tokens = ids }
  self.waiting[#self.waiting + 1] = req
  return req
end

-- Takes effect at the next step boundary; on_done sees stop "cancelled".
function Request:cancel()
  if self.status ~= "done" then self.cancelled = true end
  return self
end

-- KV blocks of pool p that a sequence of n tokens holds at most: all of
-- them, or in a sliding-window pool those of the window, of the positions
-- kept for rewinds and of one step's rows, plus the block the window's
-- start falls in.
function Scheduler:pool_blocks(p, n)
  local w, b = self.window[p], self.block
  if w > 0 then w = w + (self.model.info.rewind or 0) end
  if w > 0 and n > w + self.token_budget then n = w + self.token_budget + b end
  return (n + b - 1) // b
end

-- Whether the free KV blocks of every pool cover req's ids and first new
-- token, and for each running request the blocks of its ids not yet in its
-- sequence, at least one.
function Scheduler:kv_fits(req)
  local free = self.model:kv_free()
  for p = 1, #free do
    local need = self:pool_blocks(p, #req.ids + 1)
    for _, r in ipairs(self.running) do
      need = need + math.max(1, self:pool_blocks(p, #r.ids + 1) - self:pool_blocks(p, r.n_done))
    end
    if need > free[p] then return false end
  end
  return true
end

-- kv_fits, after evicting cached prefixes until req fits or none is left:
-- a running request is worth more than a cached prompt.
function Scheduler:kv_room(req)
  while not self:kv_fits(req) do
    if not (self.prefix and self.prefix:evict()) then return false end
    self.stats.evictions = self.stats.evictions + 1
  end
  return true
end

local function remove(list, x)
  for i, y in ipairs(list) do
    if y == x then
      table.remove(list, i)
      return
    end
  end
end

-- Streams req's chosen token: its text, the stop conditions, on_token.
-- Returns the stop reason, or nil to go on.
local function emit_one(sch, req)
  local state, id = req.state, req.next
  state.id = id
  req.next = false
  -- The token is evaluated next step only if the context has room for it.
  local piece, stop = req.out:push(state, #req.ids + 1 > sch.ctx and "ctx" or nil)
  req.ids[#req.ids + 1] = id
  if piece and req.on_token then req.on_token(piece, id, req) end
  return stop
end

-- A request that still has a token to stream streams it first; a stop it
-- meets there is the reason (it came before this one).
function Scheduler:retire(req, reason, err)
  if req.next then
    local ok, stop = pcall(emit_one, self, req)
    if not ok then reason, err = "error", stop elseif stop then reason, err = stop, nil end
  end
  if req.status == "running" then remove(self.running, req) else remove(self.waiting, req) end
  if req.seq then req.seq:close() end
  req.seq = nil
  req.status = "done"
  req.text = req.out:shown()
  local now, tokens = luma.now(), #req.ids - req.prompt_len
  local stats = { prompt_tokens = req.prompt_len, tokens = tokens, stop = reason, error = err,
                  time = now - req.t_submit, cached_tokens = req.cached_tokens, preemptions = req.preemptions }
  if req.t_first then
    stats.ttft = req.t_first - req.t_submit
    local decode = now - req.t_first
    stats.tokens_per_s = tokens > 1 and decode > 0 and (tokens - 1) / decode or nil
  end
  req.stats = stats
  self.finished[#self.finished + 1] = req
end

-- Closes the request's sequence and queues it again with all its ids.
function Scheduler:preempt(req)
  remove(self.running, req)
  req.seq:close()
  req.seq = nil
  req.n_done = 0
  req.status = "waiting"
  req.preemptions = req.preemptions + 1
  self.stats.preemptions = self.stats.preemptions + 1
  self.waiting[#self.waiting + 1] = req
end

function Scheduler:start(req)
  local seq, n
  if self.prefix then seq, n = self.prefix:lookup(req.ids) end
  req.seq = seq or self.model:sequence()
  req.n_done = n or 0
  if req.preemptions == 0 then req.cached_tokens = req.n_done end
  req.status = "running"
  self.running[#self.running + 1] = req
end

function Scheduler:sweep()
  for _, list in ipairs{ self.running, self.waiting } do
    for i = #list, 1, -1 do
      if list[i].cancelled then self:retire(list[i], "cancelled") end
    end
  end
end

function Scheduler:admit_waiting()
  table.sort(self.waiting, self.order)
  while #self.waiting > 0 do
    local req = self.waiting[1]
    local before = req.state.step == 0 and req.out:stop_before()
    if before then
      self:retire(req, before)
    elseif #self.running == 0 or self.admit(self, req) then
      table.remove(self.waiting, 1)
      self:start(req)
    else
      return
    end
  end
end

-- The chunks of this step in the order they go into the batch: plan[2i - 1]
-- a request, plan[2i] its rows (one table a step, none a request).
function Scheduler:plan()
  local budget = self.budget(self)
  positive_integer("budget", budget)
  local plan, k = {}, 0
  -- Decoding requests first: one row each keeps every generation moving.
  -- (A token still to be streamed is the row; one that ends its request
  -- gets none.)
  for _, req in ipairs(self.running) do
    if budget > 0 and (req.next and not req.last or #req.ids - req.n_done == 1) then
      plan[k + 1], plan[k + 2] = req, 1
      k = k + 2
      budget = budget - 1
    end
  end
  for _, req in ipairs(self.running) do
    local left = #req.ids - req.n_done
    if budget > 0 and left > 1 and not req.next then
      local n = math.min(left, budget)
      plan[k + 1], plan[k + 2] = req, n
      k = k + 2
      budget = budget - n
    end
  end
  return plan
end

-- After "KV cache full": makes room for the next try.
function Scheduler:relieve(msg)
  self.stats.kv_full = self.stats.kv_full + 1
  if self.prefix and self.prefix:evict() then
    self.stats.evictions = self.stats.evictions + 1
  elseif #self.running == 1 then
    -- Alone with an empty cache: it can never fit.
    self:retire(self.running[1], "error", msg)
  else
    local v = self.victim(self, self.running)
    if type(v) ~= "table" or v.status ~= "running" or v.sch ~= self then
      error("scheduler: victim must return one of the running requests", 0)
    end
    self:preempt(v)
  end
end

-- Runs the plan, relieving memory until it fits, and streams the chosen
-- tokens while the device computes it (overlap); the logits by sequence,
-- and the plan that ran (nil when nothing could).
function Scheduler:run_batch()
  local plan = self:plan()
  while true do
    if #plan == 0 then return nil end
    for i = 1, #plan, 2 do
      local req, n = plan[i], plan[i + 1]
      -- a decoding row is one id: no table for it
      self.batch:add(req.seq, n == 1 and (req.next or req.ids[req.n_done + 1])
                              or table.move(req.ids, req.n_done + 1, req.n_done + n, 1, {}))
    end
    local t = luma.now()
    local ok, out = pcall(self.batch.run, self.batch, self.overlap and #self.pending > 0 and self.emit_all or nil)
    self.stats.run_time = self.stats.run_time + (luma.now() - t)
    if ok then return out, plan end
    out = tostring(out)
    if not out:find("KV cache full", 1, true) then error(out, 0) end
    self:relieve(out)
    if #self.running == 0 then return nil end
    plan = self:plan()
  end
end

-- Chooses req's next token from logits (id: the one its policy drew
-- already, or nil); it is streamed later (emit).
function Scheduler:choose(req, logits, id)
  local state = req.state
  state.seq = req.seq
  if id == nil then
    local t = luma.now()
    id = req.policy(logits, state)
    self.stats.policy_time = self.stats.policy_time + (luma.now() - t)
  end
  if math.type(id) ~= "integer" or id < 0 or id >= #logits then
    error("policy returned " .. tostring(id) .. ", not a token id", 0)
  end
  req.t_first = req.t_first or luma.now()
  req.next = id
  -- what the emitter will stop at whatever the conditions say
  req.last = state.step + 1 >= req.out.max_tokens or #req.ids + 1 > self.ctx
  self.stats.tokens = self.stats.tokens + 1
  self.pending[#self.pending + 1] = req
end

-- Lets each request of list choose from its row of out, in order. The
-- requests whose policy is a chain seq:sample knows (penalties included)
-- draw in one luma.draw (on a GPU, one launch for all of them: the ids the
-- policies would give, as seq:sample's are); if that fails, each policy
-- runs on its own.
function Scheduler:choose_all(list, out)
  local rows, opts, rngs, hists, drawn = {}, {}, {}, {}, nil
  local n = 0
  for i = 1, #list do
    local req = list[i]
    if req.sampler then
      n = n + 1
      rows[n], opts[n], rngs[n], hists[n] = out[req.seq], req.sampler, req.state.rng, req.state.tokens
    end
  end
  if n > 0 then
    local t = luma.now()
    -- (the rows are not read again: their sets go at once, not at collection;
    -- a penalizing chain's window is state.tokens, as P.penalties' is)
    local ok, ids = pcall(luma.draw, rows, opts, rngs, { release = true, histories = hists })
    self.stats.policy_time = self.stats.policy_time + (luma.now() - t)
    if ok then drawn = ids end
  end
  local k = 0
  for i = 1, #list do
    local req, id = list[i], nil
    if req.sampler and drawn then
      k = k + 1
      id = drawn[k]
    end
    local ok, err = pcall(self.choose, self, req, out[req.seq], id)
    if not ok then self:retire(req, "error", err) end
  end
end

-- Streams the pending tokens (see emit_one); the requests they end are
-- listed in stopped, retired once the step is over.
function Scheduler:emit()
  local list = self.pending
  self.pending, self.spare = self.spare, list
  local stopped, t = self.stopped, luma.now()
  for i = 1, #list do
    local req = list[i]
    list[i] = nil
    if req.next then
      local ok, stop = pcall(emit_one, self, req)
      if not ok then req.ending, req.ending_err = "error", stop elseif stop then req.ending = stop end
      if req.ending then stopped[#stopped + 1] = req end
    end
  end
  self.stats.emit_time = self.stats.emit_time + (luma.now() - t)
end

function Scheduler:retire_stopped()
  local stopped = self.stopped
  for i = 1, #stopped do
    local req = stopped[i]
    stopped[i] = nil
    if req.status ~= "done" then self:retire(req, req.ending, req.ending_err or nil) end
  end
end

-- Calls on_done of the requests retired in this step; the first error is
-- raised after all were called.
function Scheduler:notify()
  local list = self.finished
  self.finished = {}
  local first
  for _, req in ipairs(list) do
    if req.on_done then
      local ok, err = pcall(req.on_done, req, req.text, req.stats)
      if not ok and not first then first = err end
    end
  end
  if first then error(first, 0) end
end

-- One batch:run. Returns true while requests are waiting or running.
function Scheduler:step()
  local t0 = luma.now()
  local run0 = self.stats.run_time
  self:sweep()
  self:admit_waiting()
  if #self.running > 0 then
    local out, plan = self:run_batch()
    -- the tokens not streamed during the run (none ran, or no overlap)
    if #self.pending > 0 then self:emit() end
    -- those that ended their requests: the rows they had here were for nothing
    self:retire_stopped()
    local rows, choosing = 0, {}
    for i = 1, plan and #plan or 0, 2 do
      local req, n = plan[i], plan[i + 1]
      rows = rows + n
      if req.status == "running" then
        req.n_done = req.n_done + n
        if self.prefix and not req.prefix_done and req.n_done >= req.prompt_len then
          req.prefix_done = true
          self.prefix:insert(req.seq, req.prompt_len)
        end
        if req.n_done == #req.ids and not req.cancelled then choosing[#choosing + 1] = req end
      end
    end
    self:choose_all(choosing, out)
    if not self.overlap then
      self:emit()
      self:retire_stopped()
    end
    self.stats.rows = self.stats.rows + rows
    self:sweep()
    self.stats.steps = self.stats.steps + 1
    self.stats.lua_time = self.stats.lua_time + (luma.now() - t0) - (self.stats.run_time - run0)
  end
  self:notify()
  return #self.running > 0 or #self.waiting > 0
end

-- Steps until every request is done.
function Scheduler:run()
  while self:step() do end
end

-- Drops every request (no on_done) and the prefix cache's sequences.
function Scheduler:close()
  for _, list in ipairs{ self.running, self.waiting } do
    for _, req in ipairs(list) do
      if req.seq then req.seq:close() end
      req.seq = nil
      req.status = "done"
    end
  end
  for _, req in ipairs(self.pending) do req.next = false end
  self.running, self.waiting, self.finished = {}, {}, {}
  self.pending, self.spare, self.stopped = {}, {}, {}
  if self.prefix then self.prefix:clear() end
end

return Scheduler
