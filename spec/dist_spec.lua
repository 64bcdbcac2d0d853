-- A step's logits where they lie: softmax, log_softmax, entropy, min_p,
-- top_p and single entries (logits[id], logits[id] = v). On a GPU these run in device
-- memory and only small results cross; each is held here to the same
-- method on a host copy of the row (logits:copy()).
local H = require "helper"
local luma = require "luma"
local P = luma.policy

local PROMPTS = { "Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3, 4," }

-- a and b the same float, or an ulp or so apart (a normalizer summed in
-- another order)
local function close(a, b)
  if a == b then return true end
  return math.abs(a - b) <= 2.5e-7 * math.max(math.abs(a), math.abs(b))
end

-- Every entry of two Logits, compared by same(x, y); the count that differ.
local function count_differ(a, b, same)
  assert(#a == #b)
  local n = 0
  for i = 0, #a - 1 do
    if not same(a[i], b[i]) then n = n + 1 end
  end
  return n
end

describe("logits where they lie", function()
  local model
  setup(function() model = H.load() end)
  teardown(function() model:close() end)

  -- a step's last logits, where the step left them
  local function fresh(i)
    local seq, logits = H.prompted(model, PROMPTS[(i or 1) % #PROMPTS + 1])
    seq:close()
    return logits
  end

  it("take softmax and log_softmax as a host copy does", function()
    for i = 1, #PROMPTS do
      for _, m in ipairs{ "softmax", "log_softmax" } do
        local a = fresh(i)
        local b = a:copy()
        assert.are.equal(a, a[m](a))
        b[m](b)
        assert.are.equal(0, count_differ(a, b, close), m .. " of prompt " .. i)
        assert.are.equal(b:argmax(), a:argmax())
      end
    end
    -- probabilities sum to 1 where they lie
    local p = fresh(2):softmax()
    local ids, vals = p:topk(5)
    assert.are.equal(5, #ids)
    assert.is_true(vals[1] > 0 and vals[1] <= 1)
  end)

  it("measure the entropy as a host copy does", function()
    for i = 1, #PROMPTS do
      local a = fresh(i)
      local h, want = a:entropy(), a:copy():entropy()
      assert.is_true(math.abs(h - want) <= 1e-9 * math.max(1, want), h .. " against " .. want)
      -- and of a sharper distribution
      a:temperature(0.25)
      assert.is_true(math.abs(a:entropy() - a:copy():entropy()) <= 1e-9 * math.max(1, want))
    end
  end)

  it("keep min_p's entries as a host copy does", function()
    for _, p in ipairs{ 0.01, 0.2, 1.0 } do
      for _, keep in ipairs{ 1, 50 } do
        local a = fresh(3)
        local b = a:copy()
        a:min_p(p, keep)
        b:min_p(p, keep)
        assert.are.equal(0, count_differ(a, b, function(x, y) return x == y end), "p " .. p .. " keep " .. keep)
      end
    end
  end)

  it("keep top_p's entries as a host copy does, without a top_k before", function()
    for i = 1, #PROMPTS do
      for _, p in ipairs{ 0.3, 0.9, 0.95, 0.999 } do
        for _, keep in ipairs{ 1, 80 } do
          local a = fresh(i)
          local b = a:copy()
          a:top_p(p, keep)
          b:top_p(p, keep)
          assert.are.equal(0, count_differ(a, b, function(x, y) return x == y end),
                           "prompt " .. i .. " p " .. p .. " keep " .. keep)
        end
      end
    end
    -- a chain without top_k, generated where the logits lie and on host copies
    local chain = P.from_options{ temp = 0.9, top_k = 0, top_p = 0.9 }
    assert.is_nil(P.sampler(chain))
    local here = luma.generate(model, PROMPTS[1], { policy = chain, seed = 3, max_tokens = 16 })
    local copied = luma.generate(model, PROMPTS[1], { policy = function(l, st) return chain(l:copy(), st) end,
                                                      seed = 3, max_tokens = 16 })
    assert.are.equal(copied, here)
  end)

  it("read and store single entries, and loops over every entry", function()
    local a = fresh(4)
    local b = a:copy()
    local best = a:argmax()
    assert.are.equal(b[best], a[best])
    assert.are.equal(b[0], a[0])
    a[7] = 1e9
    b[7] = 1e9
    a[best] = -math.huge
    b[best] = -math.huge
    assert.are.equal(7, a:argmax())
    assert.are.equal(-math.huge, a[best])
    assert.are.equal(1e9, a[7])
    -- past a few single entries the row comes over whole: a loop stays cheap
    local sum_a, sum_b = 0, 0
    for i = 0, #a - 1 do
      if a[i] > -math.huge then sum_a = sum_a + a[i] end
      if b[i] > -math.huge then sum_b = sum_b + b[i] end
    end
    assert.are.equal(sum_b, sum_a)
    local ok, e = pcall(function() a[#a] = 1 end)
    assert.is_false(ok)
    assert.matches("out of range", e)
  end)

  it("draw by mirostat as a host copy does", function()
    local on, off = P.mirostat{ tau = 3, eta = 0.2 }, P.mirostat{ tau = 3, eta = 0.2 }
    local ra, rb = luma.rng(11), luma.rng(11)
    for step = 0, 11 do
      local a = fresh(step)
      local b = a:copy()
      assert.are.equal(off(b, { rng = rb, step = step }), on(a, { rng = ra, step = step }), "step " .. step)
    end
    assert.are.equal(rb:random(), ra:random())
  end)

  it("refuse a row with nothing live, leaving it as it was", function()
    local a = fresh(1)
    local ids = a:topk(#a)
    a:mask(ids)
    for _, m in ipairs{ "softmax", "log_softmax", "entropy" } do
      local ok, e = pcall(a[m], a)
      assert.is_false(ok)
      assert.matches("every logit is masked", e)
    end
    assert.are.equal(-math.huge, a[ids[1]])
  end)
end)
