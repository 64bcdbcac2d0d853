-- The text side of a generation, shared by luma.stream and the scheduler: a
-- prompt's token ids, the list of stop conditions, and an emitter that turns
-- the chosen tokens into the text to show under those conditions.
--
--   local T = require "luma.text"
--   local ids = T.tokenize(model, prompt, true, true)
--   local stops = T.stops(opts.stop, "stream")
--   local out = T.emitter(stops, max_tokens)
--   local why = out:stop_before()           -- a limit of 0: make no token
--   -- for each chosen token, state.id set:
--   local piece, stop = out:push(state)     -- piece nil: nothing to yield
--
-- The emitter keeps the whole generated text (`out:text()`, also what the
-- stop conditions read as state.text) and how many of its bytes were shown
-- (`emitted`). It holds back the bytes a condition's hold() asks for and the
-- bytes of an unfinished UTF-8 character; when a condition stops, the text
-- up to its cut (or before the token, for "eog") is shown and the rest is
-- dropped.
--
-- The text is kept as its pieces and joined only when something reads it
-- whole (a stop condition reading state.text, hold(), shown()): a token
-- costs its piece and the few bytes not yet shown, not a copy of everything
-- generated before it, so long generations and many of them at once do not
-- fill the collector with copies.
local S = require "luma.stop"

local T = {}

-- T.incomplete_tail(s): how many bytes at the end of s do not yet form a
-- complete UTF-8 character (0 to 3).
local function incomplete_tail(s)
  local n = #s
  for back = 0, math.min(3, n - 1) do
    local b = s:byte(n - back)
    if b < 0x80 then return 0 end
    if b >= 0xC0 then
      local need = b >= 0xF0 and 4 or b >= 0xE0 and 3 or 2
      return back + 1 < need and back + 1 or 0
    end
  end
  return 0
end
T.incomplete_tail = incomplete_tail

-- The ids of a prompt text. With bos, the model's BOS token goes first,
-- unless special tokens are parsed and the text already begins with it (a
-- chat-formatted prompt such as luma.chat.format makes).
function T.tokenize(model, text, bos, special)
  if bos and special and model.bos then
    local mark = model:piece(model.bos, true)
    if mark ~= "" and text:sub(1, #mark) == mark then bos = false end
  end
  return model:tokenize(text, { bos = bos, special = special })
end

-- The stop conditions of opts.stop as a list: nil or false gives
-- { S.eog() }, one condition a list of it. Raises "<who>: ..." at the
-- caller's caller.
function T.stops(stops, who)
  if not stops then return { S.eog() } end
  if type(stops) == "function" or (type(stops) == "table" and stops.check) then return { stops } end
  if type(stops) ~= "table" then error(who .. ": stop must be a list of conditions", 3) end
  for i, c in ipairs(stops) do
    if type(c) ~= "function" and not (type(c) == "table" and type(c.check) == "function") then
      error(who .. ": stop condition " .. i .. " is not a function", 3)
    end
  end
  return stops
end

-- Asks the stop conditions about state, whose token's text was just
-- appended to a text of `before` bytes: the first reason to stop (or nil),
-- the bytes of the text to keep when stopping (nil: all of it), and the
-- bytes to hold back (the hold() of the conditions that go on, given
-- src:text(), the whole text).
function T.ask(stops, state, before, src)
  local stop, keep, hold = nil, nil, 0
  for i = 1, #stops do
    local c = stops[i]
    local r, cut
    if type(c) == "function" then r, cut = c(state) else r, cut = c.check(state) end
    if r then
      stop = stop or r
      if r == "eog" then keep = math.min(keep or before, before) end
      if cut then keep = math.min(keep or cut, cut) end
    elseif type(c) == "table" and c.hold then
      hold = math.max(hold, c.hold(src:text()))
    end
  end
  return stop, keep, hold
end

local Emitter = {}
Emitter.__index = Emitter

-- Pieces joined into one string once there are this many.
local JOIN = 64

-- stops: a list from T.stops; max_tokens: tokens at most.
function T.emitter(stops, max_tokens)
  local e = setmetatable({ stops = stops, max_tokens = max_tokens, parts = {}, n = 0, len = 0, emitted = 0 }, Emitter)
  -- state.text, read when a condition reads it
  e.state_mt = { __index = function(_, k) if k == "text" then return e:text() end end }
  return e
end

-- The reason to stop before the first token (a limit of 0), or nil.
function Emitter:stop_before()
  if self.max_tokens == 0 then return "max_tokens" end
  for _, c in ipairs(self.stops) do
    if type(c) == "table" and c.max_tokens == 0 then return "stop" end
  end
  return nil
end

-- The whole text, held-back bytes included.
function Emitter:text()
  local parts, n = self.parts, self.n
  if n == 0 then return "" end
  if n > 1 then
    parts[1] = table.concat(parts, "", 1, n)
    for i = 2, n do parts[i] = nil end
    self.n = 1
  end
  return parts[1]
end

-- The text shown so far.
function Emitter:shown()
  if self.emitted == self.len then return self:text() end
  return self:text():sub(1, self.emitted)
end

-- The last m (<= len) bytes of the text, from the pieces at its end.
function Emitter:last(m)
  if m <= 0 then return "" end
  local parts, i = self.parts, self.n
  local s = parts[i]
  while #s < m do
    i = i - 1
    s = parts[i] .. s
  end
  return #s == m and s or s:sub(-m)
end

-- Takes the token state.id, chosen after state.step others: appends its text,
-- asks the stop conditions and counts the step. limit, when given, is a
-- reason to stop after this token if nothing else stops (a caller's own
-- bound, such as a full context). Returns the text to show now ("" when all
-- of it is held back; nil when the token is not to be yielded: an "eog" with
-- nothing left to show) and the stop reason, or nil to go on.
function Emitter:push(state, limit)
  if getmetatable(state) ~= self.state_mt then
    state.text = nil
    setmetatable(state, self.state_mt)
  end
  local before = self.len
  local piece = state.model:piece(state.id)
  if #piece > 0 then
    if self.n >= JOIN then self:text() end
    self.n = self.n + 1
    self.parts[self.n] = piece
    self.len = before + #piece
  end
  local stop, keep, hold = T.ask(self.stops, state, before, self)
  if not stop and state.step + 1 >= self.max_tokens then stop = "max_tokens" end
  if not stop then stop = limit end
  state.step = state.step + 1
  if stop then
    local upto = keep or self.len
    local shown = upto > self.emitted and self:text():sub(self.emitted + 1, upto) or ""
    self.emitted = self.emitted + #shown
    if shown == "" and stop == "eog" then shown = nil end
    return shown, stop == true and "stop" or stop
  end
  -- incomplete_tail reads the last 4 bytes at most: the last piece, or
  -- the last pieces where it is shorter (byte tokens)
  local tail = self.parts[self.n] or ""
  if #tail < 4 then tail = self:last(math.min(4, self.len)) end
  local upto = self.len - math.max(hold, incomplete_tail(tail))
  if upto <= self.emitted then return "", nil end
  local shown = self:last(self.len - self.emitted)
  if upto < self.len then shown = shown:sub(1, upto - self.emitted) end
  self.emitted = upto
  return shown, nil
end

return T
