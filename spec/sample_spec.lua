-- logits:draw and seq:sample: a sampling chain in one call, and sampled
-- decoding in one call, against the Logits' methods one at a time and the
-- loop of them and seq:eval. On a GPU each step's
-- token is drawn on the device from the step before (queued before the
-- host reads it); these specs hold that path to the loop's ids, logits and
-- generator state.
local H = require "helper"
local luma = require "luma"
local P = luma.policy

local PROMPT = "Once upon a time"

-- option sets of P.from_options that seq:sample runs
local CHAINS = {
  { temp = 0.8, top_k = 40, top_p = 0.95 },
  { temp = 1.3, top_k = 64, min_p = 0.05 },
  { temp = 0.5, top_k = 8, top_p = 0.9, min_p = 0.1 },
  { temp = 2.0, top_k = 1 },
}

-- the chain of o as the Logits' methods run it, one call each
local function methods(o)
  return function(logits, state)
    logits:top_k(o.top_k)
    if o.top_p and o.top_p < 1 then logits:top_p(o.top_p) end
    if o.min_p and o.min_p > 0 then logits:min_p(o.min_p) end
    logits:temperature(o.temp or 0.8)
    return logits:sample(state.rng)
  end
end

describe("logits:draw", function()
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  local function fresh()
    local seq, logits = H.prompted(model, PROMPT)
    seq:close()
    return logits
  end

  it("draws what the methods draw, leaving the logits as they were", function()
    for i, o in ipairs(CHAINS) do
      for seed = 1, 8 do
        local a, b = fresh(), fresh()
        local ra, rb = luma.rng(100 * i + seed), luma.rng(100 * i + seed)
        local best = b:argmax()
        assert.are.equal(methods(o)(a, { rng = ra }), b:draw(P.sampler(P.from_options(o)), rb))
        assert.are.equal(ra:random(), rb:random())
        assert.are.equal(best, b:argmax())
        assert.are.equal(0, H.max_abs_diff(fresh(), b))
      end
    end
  end)

  it("draws from edited and compact logits as the methods do", function()
    local o = { top_k = 8, top_p = 0.9, temp = 1.2 }
    for seed = 1, 8 do
      local a, b = fresh(), fresh()
      local best = a:argmax()
      for _, l in ipairs{ a, b } do l:bias({ [best] = -math.huge }):top_k(20) end
      assert.are.equal(methods(o)(a, { rng = luma.rng(seed) }), b:draw(o, luma.rng(seed)))
    end
    local l = fresh():allow({ 7 })
    assert.are.equal(7, l:draw({ top_k = 40, temp = 0.5 }, luma.rng(1)))
    l = fresh():mask(fresh():topk(#l))
    local ok, e = pcall(l.draw, l, { top_k = 4 }, luma.rng(1))
    assert.is_false(ok)
    assert.matches("masked", e)
  end)

  it("rejects bad options with clear errors", function()
    local l = fresh()
    for _, c in ipairs{ { {}, "top_k" }, { { top_k = 0 }, "top_k" }, { { top_k = 65 }, "top_k" },
                        { { top_k = 4, top_p = 0 }, "top_p" }, { { top_k = 4, temp = 0 }, "temp" },
                        { { top_k = 4, min_p = 2 }, "min_p" } } do
      local ok, e = pcall(l.draw, l, c[1], luma.rng(1))
      assert.is_false(ok)
      assert.matches(c[2], e)
    end
    assert.has_error(function() l:draw({ top_k = 4 }) end)
    assert.has_error(function() l:draw(4, luma.rng(1)) end)
  end)
end)

describe("seq:sample", function()
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  local function start() return H.prompted(model, PROMPT) end

  -- the loop seq:sample replaces: n ids drawn by the Logits' methods, each fed
  local function loop(n, o, seed)
    local seq, logits = start()
    local state = { rng = luma.rng(seed) }
    local policy = methods(o)
    local ids = {}
    for i = 1, n do
      ids[i] = policy(logits, state)
      logits = seq:eval(ids[i])
    end
    return ids, logits, seq, state.rng
  end

  -- seq:sample's options for o
  local function opts(o, rng, extra)
    local t = P.sampler(P.from_options(o))
    t.rng = rng
    for k, v in pairs(extra or {}) do t[k] = v end
    return t
  end

  it("gives the Lua policy's ids, last logits and generator state", function()
    for i, o in ipairs(CHAINS) do
      local want, want_logits, want_seq, want_rng = loop(20, o, i)
      local seq, logits = start()
      local rng = luma.rng(i)
      local ids, last = seq:sample(logits, 20, opts(o, rng))
      assert.are.same(want, ids)
      assert.are.equal(0, H.max_abs_diff(want_logits, last))
      assert.are.same(want_seq:tokens(), seq:tokens())
      assert.are.equal(want_rng:random(), rng:random())
      seq:close()
      want_seq:close()
    end
  end)

  it("penalizes over the sequence's tokens (or a history given) and the ids drawn, as P.penalties does", function()
    local chains = {
      P.from_options{ temp = 0.8, top_k = 40, top_p = 0.95, repeat_ = 1.3 },
      P.from_options{ temp = 1.0, top_k = 64, min_p = 0.02, repeat_ = 1.1, last_n = 8 },
      P.chain{ P.penalties{ frequency = 0.5, presence = 0.3, last_n = 16 }, P.top_k(40), P.temperature(0.9) },
    }
    for i, chain in ipairs(chains) do
      for _, history in ipairs{ false, { 3, 3, 7 } } do
        -- the Lua loop, its window the tokens so far (or the history and the ids drawn)
        local seq, logits = start()
        local state, want = { rng = luma.rng(i) }, {}
        for k = 1, 24 do
          if history then
            state.tokens = { table.unpack(history) }
            table.move(want, 1, k - 1, #history + 1, state.tokens)
          else
            state.tokens = seq:tokens()
          end
          want[k] = chain(logits, state)
          logits = seq:eval(want[k])
        end
        local seq2, logits2 = start()
        local so = P.sampler(chain)
        assert.is_not_nil(so.last_n)
        so.rng, so.history = luma.rng(i), history or nil
        local ids, last = seq2:sample(logits2, 24, so)
        assert.are.same(want, ids, "chain " .. i)
        assert.are.equal(0, H.max_abs_diff(logits, last))
        assert.are.equal(state.rng:random(), so.rng:random())
        seq:close()
        seq2:close()
      end
    end
  end)

  it("draws: other seeds give other ids", function()
    local seen = {}
    local distinct = 0
    for seed = 1, 4 do
      local seq, logits = start()
      local key = table.concat(seq:sample(logits, 12, opts(CHAINS[2], luma.rng(seed))), ",")
      if not seen[key] then distinct = distinct + 1 end
      seen[key] = true
      seq:close()
    end
    assert.is_true(distinct >= 2)
  end)

  it("ends at a stop id or on_token's true, unfed", function()
    local want = loop(10, CHAINS[1], 7)
    local seq, logits = start()
    local len = seq:len()
    local ids = seq:sample(logits, 10, opts(CHAINS[1], luma.rng(7), { stop = { want[6] } }))
    -- the first draw of want[6] may come earlier
    local at
    for i, id in ipairs(want) do
      if id == want[6] then at = i break end
    end
    assert.are.same({ table.unpack(want, 1, at) }, ids)
    assert.are.equal(len + at - 1, seq:len())
    seq:close()
    seq, logits = start()
    local seen = {}
    ids = seq:sample(logits, 10, opts(CHAINS[1], luma.rng(7), { on_token = function(id)
      seen[#seen + 1] = id
      return #seen == 4
    end }))
    assert.are.same({ table.unpack(want, 1, 4) }, ids)
    assert.are.same(ids, seen)
    assert.are.equal(len + 3, seq:len())
    seq:close()
  end)

  it("draws nothing, and leaves the generator and the logits, when asked for no id", function()
    local seq, logits = start()
    local copy = logits:copy()
    local rng = luma.rng(4)
    local ids, last = seq:sample(logits, 0, opts(CHAINS[1], rng, { repeat_ = 1.5 }))
    assert.are.same({}, ids)
    assert.are.equal(logits, last)
    assert.are.equal(luma.rng(4):random(), rng:random())
    assert.are.equal(0, H.max_abs_diff(copy, logits))
    seq:close()
  end)

  it("draws the first id with the Logits' own methods, edits included", function()
    local seq, logits = start()
    logits:allow({ 5, 6 })
    local ids = seq:sample(logits, 1, opts(CHAINS[2], luma.rng(1)))
    assert.is_true(ids[1] == 5 or ids[1] == 6)
    seq:close()
  end)

  it("raises on_token's error as it was and leaves the sequence as it was", function()
    local seq, logits = start()
    local before = seq:tokens()
    local n = 0
    local ok, e = pcall(seq.sample, seq, logits, 12, opts(CHAINS[1], luma.rng(3), { on_token = function()
      n = n + 1
      if n == 5 then error("fifth") end
    end }))
    assert.is_false(ok)
    assert.matches("fifth", e)
    assert.are.same(before, seq:tokens())
    seq:close()
  end)

  it("rejects bad options with clear errors", function()
    local seq, logits = start()
    local rng = luma.rng(1)
    local cases = {
      { {}, "rng" },
      { { rng = rng }, "top_k" },
      { { rng = rng, top_k = 0 }, "top_k" },
      { { rng = rng, top_k = 65 }, "top_k" },
      { { rng = rng, top_k = 1.5 }, "top_k" },
      { { rng = 1, top_k = 4 }, "rng" },
      { { rng = rng, top_k = 4, top_p = 0 }, "top_p" },
      { { rng = rng, top_k = 4, top_p = 1.5 }, "top_p" },
      { { rng = rng, top_k = 4, min_p = -0.1 }, "min_p" },
      { { rng = rng, top_k = 4, temp = 0 }, "temp" },
      { { rng = rng, top_k = 4, temp = "hot" }, "temp" },
      { { rng = rng, top_k = 4, stop = 3 }, "stop" },
      { { rng = rng, top_k = 4, repeat_ = 0 }, "repeat_" },
      { { rng = rng, top_k = 4, repeat_ = 1.1, last_n = 0 }, "last_n" },
      { { rng = rng, top_k = 4, repeat_ = 1.1, last_n = 257 }, "last_n" },
      { { rng = rng, top_k = 4, frequency = "x" }, "frequency" },
      { { rng = rng, top_k = 4, repeat_ = 1.1, history = 3 }, "history" },
      { { rng = rng, top_k = 4, repeat_ = 1.1, history = { -1 } }, "range" },
    }
    for _, c in ipairs(cases) do
      local ok, e = pcall(seq.sample, seq, logits, 3, c[1])
      assert.is_false(ok)
      assert.matches(c[2], e)
    end
    assert.has_error(function() seq:sample(logits, -1, { rng = rng, top_k = 4 }) end)
    assert.are.equal(#model:tokenize(PROMPT), seq:len())
    seq:close()
  end)
end)

describe("P.sampler", function()
  it("gives seq:sample's options for chains of top_k, top_p, min_p and temperature", function()
    assert.are.same({ top_k = 40, top_p = 0.9, temp = 0.7 }, P.sampler(P.chain{ P.top_k(40), P.top_p(0.9), P.temperature(0.7) }))
    assert.are.same({ top_k = 64, min_p = 0.2, temp = 2 }, P.sampler(P.chain{ P.top_k(64), P.min_p(0.2), P.temperature(2) }))
    assert.are.same({ top_k = 1, temp = 1 }, P.sampler(P.chain{ P.top_k(1), P.temperature(1) }))
    -- out of order, missing a part, another part, min_keep, a chooser: the Lua chain runs them
    assert.is_nil(P.sampler(P.chain{ P.top_p(0.9), P.top_k(40), P.temperature(0.7) }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.top_p(0.9) }))
    assert.is_nil(P.sampler(P.chain{ P.top_p(0.9), P.temperature(0.7) }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.typical(0.9), P.temperature(0.7) }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.top_p(0.9, 5), P.temperature(0.7) }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.temperature(0) }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.temperature(0.7), P.greedy() }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.temperature(0.7), P.temperature(0.7) }))
  end)

  it("gives seq:sample's options for the chains P.from_options makes, penalties first", function()
    assert.are.same({ top_k = 40, top_p = 0.95, temp = 0.8 }, P.sampler(P.from_options{ top_k = 40, top_p = 0.95 }))
    assert.are.same({ top_k = 3, min_p = 0.1, temp = 1 }, P.sampler(P.from_options{ top_k = 3, min_p = 0.1, temp = 1 }))
    assert.are.same({ top_k = 40, temp = 0.8, repeat_ = 1.1, frequency = 0, presence = 0, last_n = 64 },
                    P.sampler(P.from_options{ top_k = 40, repeat_ = 1.1 }))
    -- a window seq:sample cannot keep (all of the history, or past 256)
    assert.is_nil(P.sampler(P.from_options{ top_k = 40, repeat_ = 1.1, last_n = 0 }))
    assert.is_nil(P.sampler(P.from_options{ top_k = 40, repeat_ = 1.1, last_n = 300 }))
    assert.is_nil(P.sampler(P.chain{ P.top_k(40), P.penalties{ repeat_ = 1.1 }, P.temperature(0.8) }))
    assert.is_nil(P.sampler(P.from_options{ top_p = 0.9 }))
    assert.is_nil(P.sampler(P.from_options{ top_k = 65 }))
    assert.is_nil(P.sampler(P.from_options{ temp = 0, top_k = 40 }))
    assert.is_nil(P.sampler(function(l) return l:argmax() end))
  end)
end)

describe("luma.generate with a sampling chain (through seq:sample)", function()
  local S = luma.stop
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  it("gives the iterator's text, stats and sequence, the default policy included", function()
    for i, o in ipairs{ { max_tokens = 16 }, { max_tokens = 40, stop = { S.strings{ "." } } },
                        { max_tokens = 24, policy = P.from_options(CHAINS[2]), chain = CHAINS[2] },
                        { max_tokens = 24, policy = P.chain{ P.top_k(16), P.min_p(0.1), P.temperature(0.9) },
                          chain = { top_k = 16, min_p = 0.1, temp = 0.9 } } } do
      -- the same chain by the Logits' methods: the iterator runs it
      local fo = { seed = i }
      local so = { policy = methods(o.chain or { temp = 0.8, top_k = 40, top_p = 0.95 }), seed = i }
      for k, v in pairs(o) do
        if k ~= "chain" then fo[k] = v end
        if k ~= "policy" and k ~= "chain" then so[k] = v end
      end
      H.same_generation(model, PROMPT, fo, so)
    end
    -- penalties: the same chain wrapped, so that P.sampler does not know it
    for i, o in ipairs{ { temp = 0.8, top_k = 40, repeat_ = 1.3 }, { temp = 1.1, top_k = 20, repeat_ = 1.2, last_n = 4 } } do
      local chain = P.from_options(o)
      assert.is_not_nil(P.sampler(chain))
      H.same_generation(model, PROMPT, { seed = i, max_tokens = 32, policy = chain },
                        { seed = i, max_tokens = 32, policy = function(l, st) return chain(l, st) end })
    end
  end)

  it("stops at the end of the context", function()
    local small = H.load({ ctx = 16 })
    local text, stats = luma.generate(small, PROMPT, { seed = 1, max_tokens = 50 })
    assert.are.equal("ctx", stats.stop)
    assert.are.equal(16 - stats.prompt_tokens, stats.tokens)
    assert.is_true(#text > 0)
    small:close()
  end)
end)
