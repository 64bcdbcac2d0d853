-- Logits: indexing, and every transform checked against a plain Lua
-- computation on a real model's logits. Rng: reproducible draws.
local luma = require "luma"
local H = require "helper"

local inf = math.huge

-- The entries of a Logits as a Lua array: v[id + 1].
local function values(l)
  local v = {}
  for i = 0, #l - 1 do v[i + 1] = l[i] end
  return v
end

local function finite(x) return x > -inf and x < inf end

-- Probabilities of v (masked entries 0), in double precision.
local function softmax(v)
  local max = -inf
  for _, x in ipairs(v) do if finite(x) and x > max then max = x end end
  local p, sum = {}, 0
  for i, x in ipairs(v) do
    p[i] = finite(x) and math.exp(x - max) or 0
    sum = sum + p[i]
  end
  for i = 1, #p do p[i] = p[i] / sum end
  return p
end

-- Ids (0-based) of the finite entries of l.
local function kept(l)
  local ids = {}
  for i = 0, #l - 1 do if finite(l[i]) then ids[#ids + 1] = i end end
  return ids
end

-- Checks that the finite entries of got are exactly the entries of before
-- named by keep (unchanged), and that every other entry is masked.
local function assert_filtered(before, got, keep)
  local set = {}
  for _, id in ipairs(keep) do set[id] = true end
  for i = 0, #got - 1 do
    if set[i] then
      if got[i] ~= before[i + 1] then error("entry " .. i .. " changed by a filter") end
    elseif got[i] ~= -inf then
      error("entry " .. i .. " should be masked, is " .. got[i])
    end
  end
end

-- Checks a "smallest set of most likely entries reaching mass p" filter:
-- the kept entries outrank every masked one, their mass reaches p, and
-- dropping the least of them would fall short of it. score(i) ranks entries
-- (lower first kept); reach(mass) says the mass is enough.
local function assert_smallest_prefix(probs, keep, score, reach)
  local set, mass, worst_kept, worst_id = {}, 0, -inf, nil
  for _, id in ipairs(keep) do
    set[id] = true
    mass = mass + probs[id + 1]
    if score(id) > worst_kept then worst_kept, worst_id = score(id), id end
  end
  for i = 0, #probs - 1 do
    if not set[i] and probs[i + 1] > 0 then
      assert(score(i) >= worst_kept - 1e-6, "masked entry " .. i .. " outranks a kept one")
    end
  end
  assert.is_true(reach(mass), "kept mass " .. mass .. " is not enough")
  assert.is_false(reach(mass - probs[worst_id + 1] - 1e-6), "the kept set is not the smallest")
end

describe("Logits", function()
  local model, base, v, probs
  setup(function()
    model = H.load{ ctx = 64 }
    local seq = model:sequence()
    -- A flatter distribution than a factual prompt gives, so that the
    -- filters keep more than one or two entries.
    base = seq:eval(model:tokenize("My favourite thing to do on a rainy day is")):temperature(1.5)
    seq:close()
    v = values(base)
    probs = softmax(v)
  end)
  teardown(function() if model then model:close() end end)

  it("is indexed by token id from 0, and #logits is the vocabulary size", function()
    assert.are.equal(model.n_vocab, #base)
    assert.are.equal(v[1], base[0])
    assert.are.equal(v[model.n_vocab], base[model.n_vocab - 1])
    assert.are.equal("number", type(base[model.eos]))
    assert.matches("out of range", select(2, pcall(function() return base[model.n_vocab] end)))
    assert.matches("out of range", select(2, pcall(function() return base[-1] end)))
    assert.has_error(function() return base[1.5] end)
    assert.is_nil(base.no_such_method)
    assert.are.equal("luma.Logits (262144)", tostring(base))
  end)

  it("takes assignments by token id, checking the id and the value", function()
    local l = base:copy()
    l[5] = 3.25
    assert.are.equal(3.25, l[5])
    l[model.n_vocab - 1] = -inf
    assert.are.equal(-inf, l[model.n_vocab - 1])
    assert.matches("out of range", select(2, pcall(function() l[model.n_vocab] = 1 end)))
    assert.has_error(function() l[-1] = 1 end)
    assert.has_error(function() l[5] = "x" end)
    assert.has_error(function() l.field = 1 end)
  end)

  it("copies: a copy changes independently of its source", function()
    local c = base:copy()
    c[7] = 1234
    c:top_k(1)
    assert.are.equal(v[8], base[7])
    assert.are.equal(#v, #kept(base))
  end)

  it("argmax is the id of the largest entry, topk the k largest, largest first", function()
    local best = 1
    for i = 2, #v do if v[i] > v[best] then best = i end end
    assert.are.equal(best - 1, base:argmax())
    local ids, vals = base:topk(5)
    assert.are.equal(5, #ids)
    assert.are.equal(best - 1, ids[1])
    for i = 1, 5 do
      assert.are.equal(v[ids[i] + 1], vals[i])
      if i > 1 then assert.is_true(vals[i] <= vals[i - 1]) end
    end
    local fifth = vals[5]
    local above = 0
    for i = 1, #v do if v[i] > fifth then above = above + 1 end end
    assert.is_true(above <= 4)
    local few_ids = base:copy():top_k(3):topk(10)
    assert.are.equal(3, #few_ids)
    assert.matches("k must be in", select(2, pcall(base.topk, base, 0)))
    assert.matches("k must be in", select(2, pcall(base.topk, base, model.n_vocab + 1)))
  end)

  it("temperature divides every entry; temperature 0 keeps only the argmax", function()
    local l = base:copy()
    assert.are.equal(l, l:temperature(0.5))
    for i = 0, #l - 1, 97 do
      assert.is_true(math.abs(l[i] - v[i + 1] / 0.5) <= 1e-5 * math.abs(v[i + 1]) + 1e-6)
    end
    l = base:copy():temperature(0)
    assert.are.same({ base:argmax() }, kept(l))
    assert.matches("temperature", select(2, pcall(l.temperature, l, -1)))
    assert.has_error(function() l:temperature("hot") end)
  end)

  it("top_k keeps exactly the k largest entries", function()
    local l = base:copy()
    assert.are.equal(l, l:top_k(40))
    local keep = kept(l)
    assert.are.equal(40, #keep)
    assert_filtered(v, l, keep)
    local ids = base:topk(40)
    table.sort(ids)
    assert.are.same(ids, keep)
    assert.are.equal(model.n_vocab, #kept(base:copy():top_k(model.n_vocab + 10)))
    assert.matches("k must be at least 1", select(2, pcall(l.top_k, l, 0)))
  end)

  it("top_p on a top_k's few entries, in their order or after edits reorder them", function()
    -- the compact form remembers the top-k's order and top_p checks it
    -- before it trusts it: a bias lowering the best entries (which edits the
    -- few in place) reorders them
    for _, edit in ipairs{ false, true } do
      local l = base:copy():top_k(40)
      local ids = base:topk(40)
      if edit then
        local b = {}
        for j = 1, 10 do b[ids[j]] = -3 * j / 10 end
        l:bias(b)
      end
      local before = values(l)
      local p = softmax(before)
      l:top_p(0.9)
      local keep = kept(l)
      assert_filtered(before, l, keep)
      assert_smallest_prefix(p, keep, function(i) return -p[i + 1] end,
                             function(mass) return mass >= 0.9 end)
    end
  end)

  it("top_p keeps the smallest set of most likely entries whose mass reaches p", function()
    for _, p in ipairs{ 0.5, 0.9 } do
      local l = base:copy():top_p(p)
      local keep = kept(l)
      assert_filtered(v, l, keep)
      assert_smallest_prefix(probs, keep, function(i) return -probs[i + 1] end,
                             function(mass) return mass >= p end)
    end
    assert.is_true(#kept(base:copy():top_p(0.01, 20)) >= 20)
    assert.matches("p must be in", select(2, pcall(base.top_p, base:copy(), 0)))
    assert.matches("p must be in", select(2, pcall(base.top_p, base:copy(), 1.5)))
    assert.matches("min_keep", select(2, pcall(base.top_p, base:copy(), 0.5, -1)))
  end)

  it("min_p keeps the entries with probability at least p times the largest", function()
    local max = 0
    for _, x in ipairs(probs) do max = math.max(max, x) end
    local l = base:copy():min_p(0.05)
    local keep = kept(l)
    assert_filtered(v, l, keep)
    local set = {}
    for _, id in ipairs(keep) do set[id] = true end
    for i = 1, #probs do
      local ratio = probs[i] / max
      if ratio > 0.05 * (1 + 1e-4) then assert.is_true(set[i - 1], "entry " .. (i - 1) .. " was dropped") end
      if ratio < 0.05 * (1 - 1e-4) then assert.is_nil(set[i - 1], "entry " .. (i - 1) .. " was kept") end
    end
    assert.is_true(#kept(base:copy():min_p(1, 7)) >= 7)
    assert.matches("p must be in", select(2, pcall(base.min_p, base:copy(), 2)))
  end)

  it("typical keeps the entries closest to the entropy, up to mass p", function()
    local h = 0
    for _, x in ipairs(probs) do if x > 0 then h = h - x * math.log(x) end end
    local l = base:copy():typical(0.9)
    local keep = kept(l)
    assert_filtered(v, l, keep)
    assert_smallest_prefix(probs, keep, function(i) return math.abs(-math.log(probs[i + 1]) - h) end,
                           function(mass) return mass > 0.9 end)
    assert.matches("p must be in", select(2, pcall(base.typical, base:copy(), -0.1)))
  end)

  it("penalize applies repeat, frequency and presence penalties over the last_n ids", function()
    local ids = base:topk(4)
    local a, b, c, d = ids[1], ids[2], ids[3], ids[4]
    local hist = { d, a, b, a, c, a }
    local opts = { repeat_ = 1.3, frequency = 0.25, presence = 0.5, last_n = 5 }
    local l = base:copy()
    assert.are.equal(l, l:penalize(hist, opts))
    -- d falls outside the last 5 ids.
    local counts = { [a] = 3, [b] = 1, [c] = 1 }
    for i = 0, #l - 1 do
      local want = v[i + 1]
      local n = counts[i]
      if n then
        want = want > 0 and want / 1.3 or want * 1.3
        want = want - n * 0.25 - 0.5
      end
      if math.abs(l[i] - want) > 1e-5 * (1 + math.abs(want)) then
        error(string.format("entry %d: got %g, want %g", i, l[i], want))
      end
    end
    -- Neutral settings change nothing.
    local same = base:copy():penalize(hist, { repeat_ = 1, last_n = 0 })
    assert.are.equal(0, H.max_abs_diff(base, same))
    assert.matches("repeat", select(2, pcall(base.penalize, base:copy(), hist, { repeat_ = 0 })))
    assert.matches("out of range", select(2, pcall(base.penalize, base:copy(), { -1 })))
    assert.matches("'repeat_' must be a number", select(2, pcall(base.penalize, base:copy(), hist, { repeat_ = "x" })))
  end)

  it("bias adds to the named entries; -inf bans a token", function()
    local l = base:copy()
    assert.are.equal(l, l:bias{ [10] = 2.5, [20] = -inf, [30] = -1 })
    assert.is_true(math.abs(l[10] - (v[11] + 2.5)) < 1e-5)
    assert.are.equal(-inf, l[20])
    assert.is_true(math.abs(l[30] - (v[31] - 1)) < 1e-5)
    assert.are.equal(v[12], l[11])
    assert.matches("out of range", select(2, pcall(l.bias, l, { [model.n_vocab] = 1 })))
    assert.matches("token id", select(2, pcall(l.bias, l, { x = 1 })))
    assert.matches("NaN or %+inf", select(2, pcall(l.bias, l, { [1] = inf })))
  end)

  it("mask and allow take an id list or an id set", function()
    local top = base:topk(3)
    local l = base:copy()
    assert.are.equal(l, l:mask{ top[1], top[2] })
    assert.are.equal(-inf, l[top[1]])
    assert.are.equal(-inf, l[top[2]])
    assert.are.equal(top[3], l:argmax())
    assert.are.equal(#v - 2, #kept(l))
    l = base:copy():mask{ [top[1]] = true, [top[2]] = false }
    assert.are.equal(top[2], l:argmax())
    l = base:copy():allow{ 5, 6, 7 }
    assert.are.same({ 5, 6, 7 }, kept(l))
    assert_filtered(v, l, { 5, 6, 7 })
    l = base:copy():allow{ [9] = true, [11] = true }
    assert.are.same({ 9, 11 }, kept(l))
    assert.matches("out of range", select(2, pcall(l.mask, l, { model.n_vocab })))
    assert.has_error(function() l:allow("x") end)
  end)

  it("softmax gives probabilities that sum to 1; masked entries become 0", function()
    local l = base:copy()
    assert.are.equal(l, l:softmax())
    local sum = 0
    for i = 0, #l - 1 do
      sum = sum + l[i]
      if math.abs(l[i] - probs[i + 1]) > 1e-5 then error("entry " .. i .. " differs from the Lua softmax") end
    end
    assert.is_true(math.abs(sum - 1) < 1e-4)
    local masked = base:copy():top_k(10):softmax()
    sum = 0
    for i = 0, #masked - 1 do sum = sum + masked[i] end
    assert.is_true(math.abs(sum - 1) < 1e-5)
    local nonzero = 0
    for i = 0, #masked - 1 do if masked[i] ~= 0 then nonzero = nonzero + 1 end end
    assert.are.equal(10, nonzero)
  end)

  it("log_softmax gives log-probabilities; masked entries stay -inf", function()
    local l = base:copy():log_softmax()
    local sum = 0
    for i = 0, #l - 1, 13 do
      local want = math.log(probs[i + 1])
      assert.is_true(math.abs(l[i] - want) < 1e-4 * (1 + math.abs(want)))
    end
    for i = 0, #l - 1 do sum = sum + math.exp(l[i]) end
    assert.is_true(math.abs(sum - 1) < 1e-4)
    local m = base:copy():top_k(3):log_softmax()
    assert.are.equal(3, #kept(m))
  end)

  it("entropy is the entropy of the softmax in nats and leaves the logits alone", function()
    local h = 0
    for _, x in ipairs(probs) do if x > 0 then h = h - x * math.log(x) end end
    local l = base:copy()
    assert.is_true(math.abs(l:entropy() - h) < 1e-4 * h)
    assert.are.equal(0, H.max_abs_diff(base, l))
    assert.is_true(math.abs(base:copy():top_k(1):entropy()) < 1e-9)
  end)

  it("every chooser and reduction says so when every entry is masked", function()
    local none = base:copy():allow{}
    assert.are.equal(0, #kept(none))
    for _, f in ipairs{ "argmax", "softmax", "log_softmax", "entropy" } do
      assert.matches("masked", select(2, pcall(none[f], none)))
    end
    assert.matches("masked", select(2, pcall(none.sample, none, luma.rng(1))))
  end)

  it("sample draws reproducibly from the softmax with a seeded rng", function()
    local l = base:copy():top_k(3)
    local function draws(seed, n)
      local rng, out = luma.rng(seed), {}
      for i = 1, n do out[i] = l:sample(rng) end
      return out
    end
    assert.are.same(draws(42, 20), draws(42, 20))
    assert.are_not.same(draws(42, 20), draws(43, 20))
    local top_probs = softmax(values(l))
    local counts, n = {}, 400
    for _, id in ipairs(draws(7, n)) do counts[id] = (counts[id] or 0) + 1 end
    for id, c in pairs(counts) do
      assert.is_true(top_probs[id + 1] > 0, "sampled a masked entry")
      assert.is_true(math.abs(c / n - top_probs[id + 1]) < 0.1, "frequency of " .. id .. " is off")
    end
    assert.are.equal(base:argmax(), base:copy():top_k(1):sample(luma.rng(1)))
    assert.matches("luma.Rng expected", select(2, pcall(l.sample, l)))
    assert.matches("luma.Rng expected", select(2, pcall(l.sample, l, 5)))
  end)

  it("chains: every transform returns the same object", function()
    local l = base:copy()
    local r = l:penalize({ 1, 2 }, { repeat_ = 1.1 }):bias{ [3] = 1 }:mask{ 4 }:top_k(50):top_p(0.99)
               :min_p(0.001):typical(0.999):temperature(0.9)
    assert.is_true(rawequal(l, r))
    assert.is_true(rawequal(l, l:allow{ l:argmax() }:softmax()))
    assert.is_true(rawequal(l, l:log_softmax()))
  end)
end)

describe("Rng", function()
  it("repeats its draws for the same seed, and differs for another", function()
    local a, b, c = luma.rng(123), luma.rng(123), luma.rng(124)
    local same, differ = true, false
    for _ = 1, 50 do
      local x, y, z = a:random(), b:random(), c:random()
      assert.is_true(x >= 0 and x < 1)
      if x ~= y then same = false end
      if x ~= z then differ = true end
    end
    assert.is_true(same)
    assert.is_true(differ)
    assert.are.equal("luma.Rng", tostring(a))
  end)

  it("draws integers in [m, n] with random(m, n), covering the interval", function()
    local r = luma.rng(5)
    local seen = {}
    for _ = 1, 200 do
      local x = r:random(1, 6)
      assert.are.equal("integer", math.type(x))
      assert.is_true(x >= 1 and x <= 6)
      seen[x] = true
    end
    for k = 1, 6 do assert.is_true(seen[k]) end
    assert.are.equal(7, r:random(7, 7))
    assert.matches("interval is empty", select(2, pcall(r.random, r, 5, 1)))
    assert.has_error(function() luma.rng("seed") end)
    assert.has_error(function() luma.rng(1.5) end)
  end)
end)
