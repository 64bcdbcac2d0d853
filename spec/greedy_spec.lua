-- seq:greedy: greedy decoding in one call, against the loop of argmax and
-- seq:eval it replaces. On a GPU each step's token is the device's argmax
-- of the step before (queued before the host reads it); these specs hold
-- that path to the loop's ids and logits bit for bit.
local H = require "helper"

local PROMPT = "Once upon a time"

describe("seq:greedy", function()
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  -- a sequence with the prompt evaluated, and its last logits
  local function start() return H.prompted(model, PROMPT) end

  -- the loop seq:greedy replaces: n ids, each fed
  local function loop(n)
    local seq, logits = start()
    local ids = {}
    for i = 1, n do
      ids[i] = logits:argmax()
      logits = seq:eval(ids[i])
    end
    return ids, logits, seq
  end

  local function same_tokens(a, b)
    assert.are.same(a:tokens(), b:tokens())
  end

  it("gives the ids and the last logits of the argmax loop, bit for bit", function()
    local want, want_logits, want_seq = loop(24)
    local seq, logits = start()
    local ids, last = seq:greedy(logits, 24)
    assert.are.same(want, ids)
    assert.are.equal(0, H.max_abs_diff(want_logits, last))
    same_tokens(want_seq, seq)
    -- and it goes on from there as the loop would
    local more = seq:greedy(last, 4)
    local again = want_seq:greedy(want_logits, 4)
    assert.are.same(again, more)
    seq:close()
    want_seq:close()
  end)

  it("ends at a stop id, which it does not feed", function()
    local want = loop(10)
    local seq, logits = start()
    local len = seq:len()
    local ids, last = seq:greedy(logits, 10, { stop = { 1, want[6] } })
    assert.are.same({ table.unpack(want, 1, 6) }, ids)
    assert.are.equal(len + 5, seq:len())
    assert.are.equal(want[6], last:argmax())
    -- the sequence's cache holds exactly the fed ids: it continues as the loop
    local next_ids = seq:greedy(last, 3)
    assert.are.same({ table.unpack(want, 6, 8) }, next_ids)
    seq:close()
  end)

  it("calls on_token once for each id in order; true stops", function()
    local want = loop(8)
    local seq, logits = start()
    local len = seq:len()
    local seen = {}
    local ids = seq:greedy(logits, 8, { on_token = function(id)
      seen[#seen + 1] = id
      return #seen == 4
    end })
    assert.are.same({ table.unpack(want, 1, 4) }, ids)
    assert.are.same(ids, seen)
    assert.are.equal(len + 3, seq:len())
    seq:close()
  end)

  it("returns the logits it was given when nothing is fed", function()
    local seq, logits = start()
    local len = seq:len()
    local ids, last = seq:greedy(logits, 0)
    assert.are.same({}, ids)
    assert.are.equal(logits, last)
    local first = logits:argmax()
    ids, last = seq:greedy(logits, 5, { stop = { first } })
    assert.are.same({ first }, ids)
    assert.are.equal(logits, last)
    assert.are.equal(len, seq:len())
    seq:close()
  end)

  it("takes the first id as logits:argmax() does, edits included", function()
    local seq, logits = start()
    local best = logits:argmax()
    logits:bias({ [best] = -math.huge })
    local second = logits:argmax()
    assert.are_not.equal(best, second)
    local ids = seq:greedy(logits, 3)
    assert.are.equal(second, ids[1])
    seq:close()
  end)

  it("raises on_token's error as it was and leaves the sequence as it was", function()
    local seq, logits = start()
    local before = seq:tokens()
    local marker = { "mine" }
    local ok, e = pcall(seq.greedy, seq, logits, 12, { on_token = function(id)
      if id ~= nil and #seq:tokens() >= 0 then error(marker) end
    end })
    assert.is_false(ok)
    assert.are.equal(marker, e)
    assert.are.same(before, seq:tokens())
    -- an error at the fifth id, steps already in flight
    local n = 0
    ok, e = pcall(seq.greedy, seq, logits, 12, { on_token = function()
      n = n + 1
      if n == 5 then error("fifth") end
    end })
    assert.is_false(ok)
    assert.matches("fifth", e)
    assert.are.same(before, seq:tokens())
    -- and the sequence still decodes as the loop does
    local want = loop(6)
    assert.are.same(want, (seq:greedy(logits, 6)))
    seq:close()
  end)

  it("keeps the model busy while on_token runs", function()
    local seq, logits = start()
    local before = seq:tokens()
    local ok, e = pcall(seq.greedy, seq, logits, 4, { on_token = function(id) seq:eval(id) end })
    assert.is_false(ok)
    assert.matches("model is busy", e)
    assert.are.same(before, seq:tokens())
    seq:close()
  end)

  it("rejects bad arguments with clear errors", function()
    local seq, logits = start()
    assert.has_error(function() seq:greedy(logits, -1) end)
    assert.has_error(function() seq:greedy(logits, 1.5) end)
    assert.has_error(function() seq:greedy(nil, 3) end)
    assert.has_error(function() seq:greedy(logits, 3, 7) end)
    local ok, e = pcall(seq.greedy, seq, logits, 3, { stop = 5 })
    assert.is_false(ok)
    assert.matches("stop", e)
    ok, e = pcall(seq.greedy, seq, logits, 3, { stop = { #logits } })
    assert.is_false(ok)
    assert.matches("out of range", e)
    ok, e = pcall(seq.greedy, seq, logits, 3, { on_token = 1 })
    assert.is_false(ok)
    assert.matches("on_token", e)
    seq:close()
    ok, e = pcall(seq.greedy, seq, logits, 3)
    assert.is_false(ok)
    assert.matches("closed", e)
  end)
end)

describe("seq:greedy at the limits", function()
  it("refuses to pass the context and loses nothing", function()
    local model = H.load({ ctx = 16 })
    local seq = model:sequence()
    local ids = model:tokenize(PROMPT)
    local logits = seq:eval(ids)
    local room = 16 - #ids
    local ok, e = pcall(seq.greedy, seq, logits, room + 1)
    assert.is_false(ok)
    assert.matches("context overflow", e)
    assert.are.equal(#ids, seq:len())
    local got = seq:greedy(logits, room)
    assert.are.equal(room, #got)
    assert.are.equal(16, seq:len())
    model:close()
  end)

  it("fails whole when the KV cache fills mid-way, the sequence as it was", function()
    -- room for one sequence of the context and a little more: another
    -- sequence takes most of it first
    local model = H.load({ ctx = 256, kv_mb = 6 })
    local ids = model:tokenize(PROMPT)
    local other = model:sequence()
    other:greedy(other:eval(ids), 200)
    local seq = model:sequence()
    local logits = seq:eval(ids)
    local before = seq:tokens()
    local ok, e = pcall(seq.greedy, seq, logits, 256 - #ids)
    assert.is_false(ok)
    assert.matches("KV cache full", e)
    assert.are.same(before, seq:tokens())
    -- the blocks came back: the same sequence still decodes
    local got = seq:greedy(logits, 8)
    assert.are.equal(8, #got)
    other:close()
    model:close()
  end)
end)

describe("luma.generate with P.greedy() (through seq:greedy)", function()
  local luma = require "luma"
  local P, S = luma.policy, luma.stop
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  -- the same generation through the iterator: a greedy policy that is not P.greedy()'s
  local function argmax(logits) return logits:argmax() end

  it("gives the iterator's text, stats and sequence", function()
    for _, o in ipairs{ { max_tokens = 12 }, { max_tokens = 40, stop = { S.strings{ "." } } },
                        { max_tokens = 40, stop = { S.when(function(st) return #st.tokens >= 12 end) } } } do
      local fo = { policy = P.greedy() }
      local so = { policy = argmax }
      for k, v in pairs(o) do fo[k], so[k] = v, v end
      H.same_generation(model, PROMPT, fo, so)
    end
  end)

  it("stops at the end of the context", function()
    local small = H.load({ ctx = 16 })
    local text, stats = luma.generate(small, PROMPT, { policy = P.greedy(), max_tokens = 50 })
    assert.are.equal("ctx", stats.stop)
    assert.are.equal(16 - stats.prompt_tokens, stats.tokens)
    assert.is_true(#text > 0)
    small:close()
  end)

  it("runs on_token while the model is busy, and fails whole on its error", function()
    local seq = model:sequence()
    local ok, e = pcall(luma.generate, model, PROMPT, { policy = P.greedy(), seq = seq,
                                                        on_token = function() model:sequence() end })
    assert.is_false(ok)
    assert.matches("model is busy", e)
    -- the prompt went in before the first token; nothing after it did
    assert.are.equal(#model:tokenize(PROMPT), seq:len())
    seq:close()
  end)
end)
